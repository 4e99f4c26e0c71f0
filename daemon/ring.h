/*
 * ring.h - the daemon's side of a session's per-step ring (proto/kvstash_ring.h).
 *
 * Each ring has a thread that waits on the ring's request futex and serves
 * requests by calling the store with the session's token, exactly like a
 * gRPC handler would: the ring is a faster door, not a second set of rules.
 */
#ifndef KVSTASH_RING_SERVER_H
#define KVSTASH_RING_SERVER_H

#include <stddef.h>

#include "status.h"
#include "store.h"

typedef struct ring ring;

/* Create a sealed memfd of `bytes`, map it and start its thread, which acts
 * for the session holding `token`. */
status_code ring_create(store *st, const char *token, size_t bytes, ring **out, status *s);

/* The ring's memfd (owned by the ring) and its size. */
int ring_fd(const ring *r);
size_t ring_bytes(const ring *r);

/* Ask the thread to stop. Never blocks, so it is safe under the store lock. */
void ring_close(ring *r);

/* Wait for a closed ring's thread to end, then free the ring. Must not be
 * called with the store lock held (the thread may be waiting for it). */
void ring_join(ring *r);

/*
 * store_transport_open for the fd socket's RING: ring_create with
 * RING_BYTES_DEFAULT (proto/kvstash_ring.h); *out is the ring as that
 * session's transport, which the store closes and joins when the session
 * ends (the store never calls ring_* itself).
 */
status_code ring_transport_open(store *st, const char *token, store_transport *out, status *s);

#endif
