/*
 * rpc.h - a thin gRPC C core server: completion-queue threads, registered
 * methods, unary replies and server-streaming "lease" calls.
 *
 * gRPC's C API has no stability promise (C-STACK.md), so nothing but this
 * file touches it on the server side. Handlers receive the decoded request
 * and the caller's `kvstash-token` metadata (NULL if absent), run on a CQ
 * thread and must not block; they answer with a status and, on success, a
 * packed response (pbgrpc_pack).
 *
 * A call over TCP without a token reaches only grpc.health.v1.Health: the
 * server answers any other method UNAUTHENTICATED itself. A handler that
 * sees token NULL thus serves a caller of the Unix socket, whom the
 * filesystem limits to the daemon's uid and root (socket mode 0600).
 * With rpc_config.tls the TCP port speaks only TLS and admits a client only
 * after it proved a certificate signed by the configured client CA; the
 * token rule above applies on top.
 */
#ifndef KVSTASH_RPC_H
#define KVSTASH_RPC_H

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <stdint.h>

#include "status.h"

/* Unary handler: on ST_OK, *resp holds the packed reply (the RPC layer
 * destroys it). */
typedef status_code (*rpc_unary_fn)(void *app, const char *token, const ProtobufCMessage *req,
                                    grpc_byte_buffer **resp, status *st);

/* Server-stream opener: on ST_OK, *first is sent at once and the stream stays
 * open until the client cancels or dies (or the server stops); then
 * stream_closed(app, cookie) runs once. */
typedef status_code (*rpc_stream_open_fn)(void *app, const char *token, const ProtobufCMessage *req,
                                          grpc_byte_buffer **first, uint64_t *cookie, status *st);
typedef void (*rpc_stream_closed_fn)(void *app, uint64_t cookie);

typedef struct rpc_method {
    const char *path; /* "/kvstash.v1.Store/Attach" */
    const ProtobufCMessageDescriptor *request;
    rpc_unary_fn unary;             /* set for unary methods */
    rpc_stream_open_fn stream_open; /* set for server streams */
    rpc_stream_closed_fn stream_closed;
    /* Long calls (an operator's move over a long sequence): served only by
     * a completion-queue thread of their own, beside cfg->threads, so that
     * no other call is matched to a thread busy with one (issue 12). */
    int own_thread;
} rpc_method;

typedef struct rpc_server rpc_server;

/* Metrics hook: one call of methods[method] finished with status `code`;
 * `seconds` from its arrival to its reply (or stream start) being queued.
 * Runs on a CQ thread: must not block. */
typedef void (*rpc_observe_fn)(void *ctx, size_t method, int code, double seconds);

/* TLS for the TCP port: the server's certificate chain and key and the CA
 * whose signature a client's certificate must carry, as PEM text read once
 * at start (rpc_tls_load). TLS authenticates the transport only: a call
 * still needs a session token for anything but health (docs/reliability.md). */
typedef struct rpc_tls {
    char *cert_pem, *key_pem, *client_ca_pem; /* owned; rpc_tls_free */
} rpc_tls;

typedef struct rpc_config {
    const char *unix_path;  /* required: listen on unix:PATH */
    const char *tcp_addr;   /* optional "HOST:PORT"; loopback only without tls */
    int threads;            /* completion-queue threads, >= 1 */
    rpc_observe_fn observe; /* optional (metrics.h metrics_rpc) */
    void *observe_ctx;
    const rpc_tls *tls; /* optional: TLS with client certificates on tcp_addr */
} rpc_config;

/* Start serving `methods` (the table must outlive the server). Calls
 * grpc_init. Returns ST_OK or an error in st (e.g. cannot bind). */
status_code rpc_server_start(const rpc_config *cfg, const rpc_method *methods, size_t nmethods,
                             void *app, rpc_server **out, status *st);

/* Stop accepting calls, cancel the live ones (stream_closed runs for each
 * open stream), join the threads, free everything, grpc_shutdown. */
void rpc_server_stop(rpc_server *srv);

/* Whether `addr` ("host:port") names a loopback interface. */
int rpc_addr_is_loopback(const char *addr);

/* Whether kvstashd may serve gRPC on TCP `addr`: always with TLS, else only
 * on loopback. Returns ST_OK or ST_INVALID_ARGUMENT with the reason in st. */
status_code rpc_tcp_allowed(const char *addr, const rpc_tls *tls, status *st);

/* Read the three PEM files into *out (all or nothing). Returns ST_OK, or
 * ST_INVALID_ARGUMENT naming the file that cannot be read or holds no PEM
 * block (then *out is empty). Free with rpc_tls_free. */
status_code rpc_tls_load(const char *cert_path, const char *key_path, const char *client_ca_path,
                         rpc_tls *out, status *st);
void rpc_tls_free(rpc_tls *tls);

#endif
