/*
 * fdsock.h - the worker's side of kvstashd's fd socket (docs/protocol.md).
 *
 * A SOCK_SEQPACKET Unix socket at `<grpc socket>.fd`: one ASCII datagram per
 * message, at most 320 bytes. The daemon reads our SO_PEERCRED identity and
 * answers `HELLO 1` with the session token, and `MAP <pool_id>` with what
 * maps the pool (the memfd, or a CUDA arena's VMM fd or legacy handle). The connection must stay
 * open for the session's life: closing it ends the session on the daemon.
 *
 * All functions return 0 or a negative kvs_err, with a message in
 * err[errlen]; sends and receives time out after rpc_timeout_ms().
 */
#ifndef KVSTASH_CLIENT_FDSOCK_H
#define KVSTASH_CLIENT_FDSOCK_H

#include <stddef.h>
#include <stdint.h>

#include "kvstash_map.h"

/* The session token: 32 lowercase hex digits and a NUL. */
#define FDSOCK_TOKEN_LEN 32

/* Connect to `<socket_path>.fd`; *fd is the connected socket (close-on-exec,
 * owned by the caller). KVS_ERR_UNAVAILABLE when no daemon listens there. */
int fdsock_connect(const char *socket_path, int *fd, char *err, size_t errlen);

/* Send `HELLO 1` and read the token into token[FDSOCK_TOKEN_LEN + 1]. */
int fdsock_hello(int fd, char *token, char *err, size_t errlen);

/* Send `MAP <pool_id>`; on success *map is the answer (proto/kvstash_map.h:
 * host memory, or a CUDA arena's IPC kind, GPU UUID, size and legacy
 * handle) and *memfd the file descriptor that came with it (the memfd or
 * the VMM fd; close-on-exec, owned by the caller), -1 for a legacy CUDA
 * arena. An answer of a kind that needs an fd and came without one, or
 * with one it should not have, is KVS_ERR_PROTOCOL; so is a daemon `ERR`
 * answer, with its reason. */
int fdsock_map(int fd, uint64_t pool_id, kvstash_map_answer *map, int *memfd, char *err,
               size_t errlen);

/* Send `RING`; on success *memfd is the session's per-step ring
 * (proto/kvstash_ring.h), created by the daemon on first request. */
int fdsock_ring(int fd, int *memfd, uint64_t *bytes, char *err, size_t errlen);

#endif
