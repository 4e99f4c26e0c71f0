/*
 * ring.h - the daemon's side of a session's per-step ring (proto/kvstash_ring.h).
 *
 * Each ring has a thread that waits on the ring's request futex and serves
 * requests by calling the store with the session's token, exactly like a
 * gRPC handler would: the ring is a faster door, not a second set of rules.
 *
 * The worker can write the whole shared header at any time, so nothing in
 * it steers the daemon: the thread stops on a flag of its own (the header's
 * `closing` only tells the worker), sleeps at most a bounded slice before
 * looking at that flag again, and reads each request once into private
 * memory before checking it.
 */
#ifndef KVSTASH_RING_SERVER_H
#define KVSTASH_RING_SERVER_H

#include <stddef.h>

#include "status.h"
#include "store.h"

typedef struct ring ring;

/* Create a sealed memfd of `bytes` (at least 2 * RING_DATA_OFFSET), map it
 * and start its thread, which acts for the session holding `token`. */
status_code ring_create(store *st, const char *token, size_t bytes, ring **out, status *s);

/* The ring's memfd (owned by the ring) and its size. */
int ring_fd(const ring *r);
size_t ring_bytes(const ring *r);

/* Ask the thread to stop. Never blocks, so it is safe under the store lock.
 * The thread ends within one futex slice (50 ms) or, when it is serving a
 * request, as soon as that store call returns. */
void ring_close(ring *r);

/* 1 once a closed ring's thread has ended (ring_join then returns at once),
 * else 0. Never blocks. */
int ring_ended(const ring *r);

/* Wait for a closed ring's thread to end, then free the ring. Must not be
 * called with the store lock held (the thread may be waiting for it). */
void ring_join(ring *r);

/*
 * store_transport_open for the fd socket's RING: ring_create of `bytes`
 * (--ring-mb; RING_BYTES_DEFAULT in proto/kvstash_ring.h by default); *out is
 * the ring as that session's transport, which the store closes and joins
 * when the session ends (the store never calls ring_* itself).
 */
status_code ring_transport_open(store *st, const char *token, size_t bytes, store_transport *out,
                                status *s);

#endif
