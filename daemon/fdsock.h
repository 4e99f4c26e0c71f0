/*
 * fdsock.h - the fd socket: worker identity (SO_PEERCRED), session tokens and
 * pool fds (SCM_RIGHTS) on a SOCK_SEQPACKET Unix socket beside the gRPC one.
 * Protocol and rationale: docs/protocol.md.
 *
 * One thread polls the listener and every connection. A connection that
 * closes ends its session in the store at once: that is how a killed worker
 * is reclaimed even before gRPC notices its lease stream died.
 */
#ifndef KVSTASH_FDSOCK_H
#define KVSTASH_FDSOCK_H

#include "status.h"
#include "store.h"

typedef struct fdsock fdsock;

/* Bind `path` (its mode comes from the daemon umask) and start the thread. */
status_code fdsock_start(const char *path, store *st, fdsock **out, status *s);

/* Stop the thread, close every connection and unlink the socket. */
void fdsock_stop(fdsock *fs);

#endif
