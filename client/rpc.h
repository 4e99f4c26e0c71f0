/*
 * rpc.h - libkvstash's thin wrapper over the gRPC C core client API.
 *
 * gRPC's C API has no stability promise (C-STACK.md), so nothing else in
 * client/ includes grpc/grpc.h: this module is the only place to change when
 * it moves. It speaks protobuf-c messages (through proto/pbgrpc.h) and
 * returns kvs_err codes (kvstash.h), with the daemon's status details as the
 * error message.
 *
 * Every entry point blocks all asynchronous signals while it runs, so the
 * threads gRPC starts on demand inherit a fully blocked mask and the
 * application's signals keep going to its own threads.
 */
#ifndef KVSTASH_CLIENT_RPC_H
#define KVSTASH_CLIENT_RPC_H

#include <stddef.h>
#include <protobuf-c/protobuf-c.h>

/* The full method path of a kvstash.v1.Store method, e.g. RPC_STORE("Attach"). */
#define RPC_STORE(name) "/kvstash.v1.Store/" name

/* Deadline of unary calls and of the lease's first message, in ms: 10000,
 * or $KVSTASH_RPC_TIMEOUT_MS when that is a positive integer. */
int rpc_timeout_ms(void);

typedef struct rpc_channel rpc_channel;

/*
 * A channel to the gRPC server at Unix socket `socket_path`. Nothing is
 * connected yet (calls connect lazily and fail fast with UNAVAILABLE when no
 * daemon listens). Returns NULL only when out of memory or when the path is
 * too long for a Unix socket. Free with rpc_channel_close.
 */
rpc_channel *rpc_channel_open(const char *socket_path);
void rpc_channel_close(rpc_channel *ch);

/* PEM file paths for a TCP channel's TLS; all NULL for none. */
typedef struct rpc_tls_paths {
    const char *ca;   /* the CA that signed kvstashd's certificate */
    const char *cert; /* this client's certificate, signed by kvstashd's tls-client-ca */
    const char *key;  /* its private key */
} rpc_tls_paths;

/* Fill *t from $KVSTASH_TLS_CA, $KVSTASH_TLS_CERT and $KVSTASH_TLS_KEY
 * (NULL where unset). */
void rpc_tls_from_env(rpc_tls_paths *t);

/*
 * A channel to kvstashd's TCP port `addr` ("HOST:PORT"). With any of tls's
 * paths set, all three must be, and the channel speaks TLS: it trusts only
 * tls->ca and presents the client's certificate (kvstashd's --listen with
 * tls-client-ca demands one); otherwise it is plain text. The files are read
 * here. Over TCP, calls but health need a session token (daemon/rpc.h).
 * Returns NULL with the reason in err (missing or unreadable file, no memory).
 */
rpc_channel *rpc_channel_open_tcp(const char *addr, const rpc_tls_paths *tls, char *err,
                                  size_t errlen);

/*
 * One unary call: send `req` with metadata `kvstash-token: <token>` (none if
 * token is NULL) and wait for the reply, at most rpc_timeout_ms().
 * On success returns 0 and *resp is a message of type resp_desc, freed by the
 * caller with protobuf_c_message_free_unpacked(*resp, NULL). On failure
 * *resp is NULL, the result is a negative kvs_err (the gRPC status mapped as
 * in kvstash.h) and err[errlen] holds the status details.
 */
int rpc_unary(rpc_channel *ch, const char *method, const char *token, const ProtobufCMessage *req,
              const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp, char *err,
              size_t errlen);

typedef struct rpc_stream rpc_stream;

/*
 * Open a server-streaming call with no deadline (the kvstash Lease): send
 * `req` and close the sending side, wait at most rpc_timeout_ms() for the
 * first message (returned in *first, caller frees), then leave the call
 * open with its status pending. Errors as for rpc_unary; *out is set only
 * on success. Close with rpc_stream_close.
 */
int rpc_stream_open(rpc_channel *ch, const char *method, const char *token,
                    const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                    ProtobufCMessage **first, rpc_stream **out, char *err, size_t errlen);

/*
 * Cancel the call (if still open), collect its status and free everything.
 * Returns 0 if the stream was still open or ended with OK, else the mapped
 * status with its details in err (err may be NULL).
 */
int rpc_stream_close(rpc_stream *st, char *err, size_t errlen);

/* A gRPC status code (numeric) as a kvs_err, as kvstash.h documents. */
int rpc_code_to_err(int code);

#endif
