/*
 * fdsock.h - the fd socket: worker identity (SO_PEERCRED), session tokens and
 * pool fds (SCM_RIGHTS) on a SOCK_SEQPACKET Unix socket beside the gRPC one.
 * Protocol and rationale: docs/protocol.md.
 *
 * One thread polls the listener and every connection. A connection that
 * closes ends its session in the store at once: that is how a killed worker
 * is reclaimed even before gRPC notices its lease stream died.
 *
 * Admission cannot be exhausted (docs/reliability.md): a
 * connection without an attached session (no HELLO, no Attach yet, or its
 * session ended) is closed after pending_timeout_ms; at most max_pending of
 * them live at once, a new one closing the oldest; out of file descriptors,
 * the thread sheds new connections on a spare descriptor (or stops polling
 * the listener for a moment) instead of spinning on accept(). Every
 * FDSOCK_TICK_MS the thread also expires the store's leases
 * (store_expire_leases) and releases the quarantined blocks of workers whose
 * process has exited (store_quarantine_reap).
 */
#ifndef KVSTASH_FDSOCK_H
#define KVSTASH_FDSOCK_H

#include "status.h"
#include "store.h"

typedef struct fdsock fdsock;

#define FDSOCK_TICK_MS 100 /* how often timeouts are checked */

struct metrics; /* metrics.h */

typedef struct fdsock_config {
    uint32_t pending_timeout_ms; /* close a connection this long without an attached session */
    uint32_t max_pending;        /* connections without one at once; a new one closes the oldest */
    struct metrics *metrics;     /* counters (kvstash_fdsock_shed_total); NULL = none */
    size_t ring_bytes;           /* each session's ring (--ring-mb); 0 = RING_BYTES_DEFAULT */
} fdsock_config;

/* Bind `path` (its mode comes from the daemon umask) and start the thread. */
status_code fdsock_start(const char *path, store *st, const fdsock_config *cfg, fdsock **out,
                         status *s);

/* Stop the thread, close every connection and unlink the socket. */
void fdsock_stop(fdsock *fs);

#endif
