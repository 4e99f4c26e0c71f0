/*
 * ring_client.h - the worker's side of the per-step ring
 * (proto/kvstash_ring.h): one request in flight, spin then futex.
 */
#ifndef KVSTASH_RING_CLIENT_H
#define KVSTASH_RING_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "kvstash_ring.h"

typedef struct ring_client {
    ring_header *hdr;
    size_t bytes;
    uint8_t *data; /* the data area */
    size_t data_bytes;
    int peer_fd; /* the session's fd-socket connection (not owned), or -1 */
} ring_client;

/* Map the ring memfd (the fd is closed either way). `peer_fd` is the
 * session's fd-socket connection, which stays the caller's: when kvstashd
 * dies the kernel hangs it up, which is how a call learns that no answer
 * will come (-1: no such check, only the deadline). Returns 0 or a negative
 * kvs_err with a message in err. */
int ring_client_open(ring_client *rc, int memfd, uint64_t bytes, int peer_fd, char *err,
                     size_t errlen);

void ring_client_close(ring_client *rc);

/* Send the request in rc->hdr->req (and the data area) and wait for the
 * answer, copied to *resp. KVS_ERR_UNAVAILABLE if the daemon closed the
 * ring (the session ended), died (peer_fd hung up: seen within one 50 ms
 * sleep slice) or gave no answer within rpc_timeout_ms(). */
int ring_client_call(ring_client *rc, ring_response *resp);

/* Polls of the answer before a call sleeps on its futex: ring_client_call
 * spins RING_CLIENT_SPIN (about a millisecond: most answers come within
 * microseconds, and a sleep and wake-up costs more); a call that may take
 * milliseconds (a Revive of thousands of tokens) spins RING_CLIENT_SPIN_SHORT,
 * so that it does not hold a CPU the daemon's copy or another worker's
 * step wants. */
#define RING_CLIENT_SPIN 20000u
#define RING_CLIENT_SPIN_SHORT 1000u
int ring_client_call_spin(ring_client *rc, uint32_t spins, ring_response *resp);

#endif
