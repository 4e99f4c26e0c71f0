/*
 * fuzz_ring - the per-step ring (daemon/ring.c) as a hostile worker drives
 * it: a real ring thread over a real store, and the worker's side from
 * libkvstash (client/ring_client.c) writing whatever the input says into the
 * shared request slot and data area, header words included.
 *
 * Input: [session: bit 0 picks which of the fixture's two sessions the ring
 * acts for] then up to FUZZ_MAX_CALLS records, each
 *     [flags] [ring_request, raw: sizeof(ring_request) bytes]
 *     [length: u16 little-endian] [data-area bytes]
 * flags: FIX_SEQ puts the session's sequence id in the request, FIX_ACK the
 * last epoch answered, FIX_LEN sets data_bytes to the record's data length,
 * SCRIBBLE writes the next flag bits into the header's `closing` and
 * `daemon_waiting` words first (the worker can write the whole header:
 * ring.h). Every answer must carry a known status code and a terminated
 * message.
 */
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "fuzz_store.h"
#include "kvstash.h"
#include "kvstash_ring.h"
#include "ring.h"
#include "ring_client.h"

#define FUZZ_MAX_CALLS 16
#define FUZZ_RING_BYTES (64u << 10) /* test_ring's size: room for a few steps */

enum { FIX_SEQ = 1, FIX_ACK = 2, FIX_LEN = 4, SCRIBBLE = 8, CLOSING = 16, WAITING = 32 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A status code the daemon can answer (daemon/status.h: gRPC's 0..16). */
static void check_response(const ring_response *r)
{
    if (r->code < 0 || r->code > 16 || memchr(r->msg, '\0', sizeof r->msg) == NULL) {
        fprintf(stderr, "ring answered code %d with an unterminated or bad message\n", r->code);
        abort();
    }
}

static void one_call(ring_client *rc, const uint8_t *rec, const uint8_t *extra, size_t len,
                     uint64_t seq_id, uint64_t *epoch)
{
    uint8_t flags = rec[0];
    ring_request q;
    memcpy(&q, rec + 1, sizeof q);
    if (len > rc->data_bytes)
        len = rc->data_bytes;
    memcpy(rc->data, extra, len);
    if (flags & FIX_SEQ)
        q.seq_id = seq_id;
    if (flags & FIX_ACK)
        q.ack_epoch = *epoch;
    if (flags & FIX_LEN)
        q.data_bytes = len;
    if (flags & SCRIBBLE) {
        rc->hdr->closing = (flags & CLOSING) != 0;
        rc->hdr->daemon_waiting = (flags & WAITING) != 0;
    }
    memcpy((void *)&rc->hdr->req, &q, sizeof q);
    ring_response resp;
    if (ring_client_call(rc, &resp) != KVS_OK)
        return; /* the daemon closed the ring: nothing to check */
    check_response(&resp);
    if (resp.code == ST_OK)
        *epoch = resp.epoch;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int who = data[0] & 1;
    data++;
    size--;
    fuzz_store f;
    fuzz_store_open(&f, FUZZ_SESSIONS);
    ring *r;
    status s;
    fuzz_check(ring_create(f.st, f.token[who], FUZZ_RING_BYTES, &r, &s), &s, "ring_create");
    /* The worker's mapping, as libkvstash makes it from the fd it receives;
     * peer[0] stands for its fd-socket connection (test_ring does the same). */
    int fd = fcntl(ring_fd(r), F_DUPFD_CLOEXEC, 0);
    int peer[2];
    if (fd < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, peer) != 0)
        abort();
    ring_client rc;
    char err[256];
    if (ring_client_open(&rc, fd, FUZZ_RING_BYTES, peer[0], err, sizeof err) != KVS_OK) {
        fprintf(stderr, "fuzz fixture: ring_client_open: %s\n", err);
        abort();
    }
    uint64_t epoch = 0;
    const size_t head = 1 + sizeof(ring_request) + 2;
    for (int call = 0; call < FUZZ_MAX_CALLS && size >= head; call++) {
        size_t len = (size_t)data[head - 2] | (size_t)data[head - 1] << 8;
        if (len > size - head)
            len = size - head;
        one_call(&rc, data, data + head, len, f.seq_id[who], &epoch);
        data += head + len;
        size -= head + len;
    }
    ring_client_close(&rc);
    ring_close(r);
    ring_join(r);
    close(peer[0]);
    close(peer[1]);
    fuzz_store_close(&f);
    return 0;
}
