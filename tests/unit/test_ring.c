/*
 * Unit tests of daemon/ring.h on its own: a store without gRPC, a real ring
 * (sealed memfd, its thread) and the worker's side from libkvstash
 * (client/ring_client.h) mapping the same memfd. Each request goes through
 * the shared header and a futex doorbell, and its answer must equal what the
 * store says directly: the ring is a faster door, not a second set of rules.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <math.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvstash.h"
#include "kvstash_ring.h"
#include "policy.h"
#include "ring.h"
#include "ring_client.h"
#include "store.h"
#include "store_harness.h"

#define RING_TEST_BYTES (64u << 10)

typedef struct fixture {
    store *st;
    char token[STORE_TOKEN_LEN + 1];
    uint64_t seq_id;
    ring *r;
    ring_client rc;
    int peer[2]; /* stands for the fd-socket connection: [0] the worker's end */
} fixture;

static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};

/* The ring's size for the next setup: RING_TEST_BYTES unless a test's setup
 * says otherwise. */
static size_t ring_size = RING_TEST_BYTES;

static int setup_policy(void **state, const char *policy, const char *const *keys,
                        const char *const *values, size_t n)
{
    static fixture f;
    memset(&f, 0, sizeof f);
    store_config cfg = {.pool_bytes = 1 << 20, .max_pools = 2, .max_sessions = 4, .max_seqs = 8};
    assert_non_null(f.st = store_create(&cfg, NULL));
    status s;
    assert_int_equal(store_session_open(f.st, 100, 1000, 1000, 1, f.token, &s), ST_OK);
    store_attach_result ar;
    assert_int_equal(store_attach(f.st, f.token, "m", &geom, "w", &ar, &s), ST_OK);
    assert_int_equal(seq_create_for(f.st, f.token, policy, keys, values, n, &f.seq_id, &s), ST_OK);
    if (ring_create(f.st, f.token, ring_size, &f.r, &s) != ST_OK)
        fail_msg("ring_create: %s", s.msg);
    assert_int_equal(ring_bytes(f.r), ring_size);
    int fd = fcntl(ring_fd(f.r), F_DUPFD_CLOEXEC, 0);
    assert_true(fd >= 0);
    char err[256];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, f.peer), 0);
    if (ring_client_open(&f.rc, fd, ring_size, f.peer[0], err, sizeof err) != KVS_OK)
        fail_msg("ring_client_open: %s", err);
    *state = &f;
    return 0;
}

static int setup(void **state)
{
    return setup_policy(state, "full", NULL, NULL, 0);
}

/* The smallest ring: a 4 KiB data area. */
static int setup_small_ring(void **state)
{
    ring_size = 2 * RING_DATA_OFFSET;
    int rc = setup_policy(state, "full", NULL, NULL, 0);
    ring_size = RING_TEST_BYTES;
    return rc;
}

static int setup_h2o(void **state)
{
    /* 4 tokens a layer: the 2 most recent and the 2 heaviest of the rest. */
    static const char *const keys[] = {"budget", "recent"}, *const values[] = {"4", "2"};
    return setup_policy(state, "h2o", keys, values, 2);
}

static int teardown(void **state)
{
    fixture *f = *state;
    ring_client_close(&f->rc);
    if (f->r != NULL) {
        ring_close(f->r);
        ring_join(f->r);
    }
    close(f->peer[0]);
    if (f->peer[1] >= 0)
        close(f->peer[1]);
    store_destroy(f->st);
    return 0;
}

/* One request through the ring; the answer's code. */
static int32_t call(fixture *f, const ring_request *q, ring_response *resp)
{
    memcpy((void *)&f->rc.hdr->req, q, sizeof *q);
    memset(resp, 0xa5, sizeof *resp);
    assert_int_equal(ring_client_call(&f->rc, resp), KVS_OK);
    return resp->code;
}

static void test_header_and_ping(void **state)
{
    fixture *f = *state;
    assert_true(f->rc.hdr->magic == RING_MAGIC);
    assert_int_equal(f->rc.hdr->bytes, RING_TEST_BYTES);
    assert_int_equal(f->rc.data_bytes, RING_TEST_BYTES - RING_DATA_OFFSET);
    ring_response r;
    ring_request q = {.op = RING_OP_PING};
    assert_int_equal(call(f, &q, &r), ST_OK);
    assert_string_equal(r.msg, "");
    assert_int_equal(f->rc.hdr->resp_seq, f->rc.hdr->req_seq); /* one answer per request */
    q.op = 99;
    assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
    assert_string_equal(r.msg, "unknown ring op");
}

/* APPEND's answer carries the new tokens' segments, list by list, exactly
 * the table the store then reports. */
static void test_append_answers_the_table(void **state)
{
    fixture *f = *state;
    ring_response r;
    ring_request q = {.op = RING_OP_APPEND, .seq_id = f->seq_id, .count = 6};
    assert_int_equal(call(f, &q, &r), ST_OK);
    assert_int_equal(r.epoch, 1);
    assert_int_equal(r.first_position, 0);
    assert_int_equal(r.evicted, 0);
    assert_int_equal(r.lists_per_layer, 1);
    assert_int_equal(r.nsegments, 4); /* 4 + 2 tokens in each of 2 layers */
    store_table t;
    status s;
    assert_int_equal(store_get_table(f->st, f->token, f->seq_id, 0, 0, &t, &s), ST_OK);
    const uint32_t *d = (const uint32_t *)f->rc.data;
    for (uint32_t l = 0; l < t.nlists; l++) {
        assert_int_equal(*d++, t.lists[l].nsegs);
        for (size_t i = 0; i < t.lists[l].nsegs; i++, d += 3) {
            assert_int_equal(d[0], t.lists[l].segs[i].block);
            assert_int_equal(d[1], t.lists[l].segs[i].first_slot);
            assert_int_equal(d[2], t.lists[l].segs[i].count);
        }
    }
    store_table_free(&t);
    /* The store's rules, through the ring: a bad count changes nothing. */
    q.count = 0;
    assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(r.msg, "count must be between 1 and 65536"));
    q.count = 1;
    q.seq_id = 999;
    assert_int_equal(call(f, &q, &r), ST_NOT_FOUND);
    q = (ring_request){.op = RING_OP_EPOCH, .seq_id = f->seq_id};
    assert_int_equal(call(f, &q, &r), ST_OK);
    assert_int_equal(r.epoch, 1);
    q = (ring_request){.op = RING_OP_APPEND, .seq_id = f->seq_id, .count = 3};
    assert_int_equal(call(f, &q, &r), ST_OK);
    assert_int_equal(r.first_position, 6);
    assert_int_equal(r.epoch, 2);
}

/* Free blocks of the fixture's pool (Stats' view). */
static uint32_t pool_free(fixture *f)
{
    snapshot sn;
    assert_int_equal(store_snapshot(f->st, &sn), 0);
    uint32_t n = sn.pools[0].blocks_free;
    snapshot_free(&sn);
    return n;
}

/* A REVIVE request in the data area, then the call; the answer's code. */
static int32_t call_revive(fixture *f, uint64_t seq, ring_revive_request in, ring_response *r)
{
    memcpy(f->rc.data, &in, sizeof in);
    return call(f, &(ring_request){.op = RING_OP_REVIVE, .seq_id = seq, .data_bytes = sizeof in},
                r);
}

static int32_t call_release(fixture *f, uint64_t scratch_id, ring_response *r)
{
    memcpy(f->rc.data, &scratch_id, sizeof scratch_id);
    return call(f, &(ring_request){.op = RING_OP_RELEASE_SCRATCH, .data_bytes = sizeof scratch_id},
                r);
}

/* REVIVE answers what store_revive gives (the scratch's segments, the
 * positions, the source tiers) in the data area; RELEASE_SCRATCH frees the
 * scratch, once. Bad requests change nothing. */
static void test_revive_and_release(void **state)
{
    fixture *f = *state;
    ring_response r;
    assert_int_equal(
        call(f, &(ring_request){.op = RING_OP_APPEND, .seq_id = f->seq_id, .count = 10}, &r),
        ST_OK);
    uint32_t free_before = pool_free(f);
    assert_int_equal(call_revive(f, f->seq_id, (ring_revive_request){1, 0, 3, 6, 0, 0}, &r), ST_OK);
    ring_revive_reply h;
    memcpy(&h, f->rc.data, sizeof h);
    assert_true(h.scratch_id != 0);
    assert_int_equal(h.layer, 1);
    assert_int_equal(h.per_head, 0);
    assert_int_equal(h.tokens, 6);
    assert_int_equal(r.nsegments, h.nsegments);
    const uint32_t *u = (const uint32_t *)(f->rc.data + sizeof h);
    uint32_t total = 0;
    for (uint32_t i = 0; i < h.nsegments; i++) {
        assert_true(u[i] < 1u << 20); /* a pool block */
        assert_true(u[h.nsegments + i] + u[2 * h.nsegments + i] <= geom.block_tokens);
        total += u[2 * h.nsegments + i];
    }
    assert_int_equal(total, 6);
    const uint32_t *pos = u + 3 * h.nsegments;
    const uint8_t *src = (const uint8_t *)(pos + h.tokens);
    for (uint32_t i = 0; i < 6; i++) {
        assert_int_equal(pos[i], 3 + i);
        assert_int_equal(src[i], POLICY_FULL);
    }
    assert_int_equal(pool_free(f), free_before - h.nsegments);
    assert_int_equal(call_release(f, h.scratch_id, &r), ST_OK);
    uint32_t freed;
    memcpy(&freed, f->rc.data, sizeof freed);
    assert_int_equal(freed, h.nsegments);
    assert_int_equal(pool_free(f), free_before);
    assert_int_equal(call_release(f, h.scratch_id, &r), ST_NOT_FOUND);

    /* Garbage: the store's errors, the ring's own, nothing taken. */
    assert_int_equal(call_revive(f, 999, (ring_revive_request){0, 0, 0, 1, 0, 0}, &r),
                     ST_NOT_FOUND);
    assert_int_equal(call_revive(f, f->seq_id, (ring_revive_request){7, 0, 0, 1, 0, 0}, &r),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(
        call_revive(f, f->seq_id, (ring_revive_request){0, 0, UINT32_MAX, UINT32_MAX, 1, 0}, &r),
        ST_INVALID_ARGUMENT);
    assert_int_equal(call(f,
                          &(ring_request){.op = RING_OP_REVIVE,
                                          .seq_id = f->seq_id,
                                          .data_bytes = sizeof(ring_revive_request) + 1},
                          &r),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(r.msg, "ring_revive_request"));
    assert_int_equal(
        call(f,
             &(ring_request){.op = RING_OP_REVIVE, .seq_id = f->seq_id, .data_bytes = UINT64_MAX},
             &r),
        ST_INVALID_ARGUMENT);
    assert_int_equal(call(f, &(ring_request){.op = RING_OP_RELEASE_SCRATCH, .data_bytes = 4}, &r),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(call_release(f, UINT64_MAX, &r), ST_NOT_FOUND);
    assert_int_equal(pool_free(f), free_before);
}

/* A REVIVE whose answer would not fit the data area is refused, and the
 * scratch it made is given back. */
static void test_revive_too_large_for_the_ring(void **state)
{
    fixture *f = *state;
    ring_response r;
    store_table w; /* an append whose own answer needs gRPC's room */
    status s;
    assert_int_equal(store_append(f->st, f->token, f->seq_id, 1000, 0, &w, &s), ST_OK);
    store_table_free(&w);
    uint32_t free_before = pool_free(f);
    assert_int_equal(call_revive(f, f->seq_id, (ring_revive_request){0, 0, 0, 1000, 0, 0}, &r),
                     ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(r.msg, "use gRPC's Revive"));
    assert_int_equal(pool_free(f), free_before);
    assert_int_equal(call_revive(f, f->seq_id, (ring_revive_request){0, 0, 0, 100, 0, 0}, &r),
                     ST_OK);
}

/* A TABLE request for seq, with or without positions, then the call. */
static int32_t call_table(fixture *f, uint64_t seq, int with_positions, ring_response *r)
{
    ring_table_request in = {(uint32_t)with_positions, 0};
    memcpy(f->rc.data, &in, sizeof in);
    return call(f, &(ring_request){.op = RING_OP_TABLE, .seq_id = seq, .data_bytes = sizeof in}, r);
}

/* The TABLE answer in the data area is t, list for list: header, segments,
 * positions when asked for, tiers. */
static void assert_ring_table(fixture *f, const ring_response *r, const store_table *t,
                              int with_positions)
{
    ring_table_reply h;
    memcpy(&h, f->rc.data, sizeof h);
    assert_int_equal(h.nlists, t->nlists);
    assert_int_equal(r->epoch, t->epoch);
    const uint8_t *p = f->rc.data + sizeof h;
    size_t nsegs = 0;
    for (uint32_t l = 0; l < t->nlists; l++) {
        const store_layer_table *want = &t->lists[l];
        ring_table_list lh;
        memcpy(&lh, p, sizeof lh);
        assert_int_equal(lh.layer, want->layer);
        assert_int_equal(lh.tokens, want->tokens);
        assert_int_equal(lh.nsegments, want->nsegs);
        assert_int_equal(lh.npositions, with_positions ? want->tokens : 0);
        assert_int_equal(lh.int8_block_tokens, want->int8_block_tokens);
        const uint32_t *u = (const uint32_t *)(p + sizeof lh);
        for (uint32_t i = 0; i < lh.nsegments; i++) {
            assert_int_equal(u[i], want->segs[i].block);
            assert_int_equal(u[lh.nsegments + i], want->segs[i].first_slot);
            assert_int_equal(u[2 * lh.nsegments + i], want->segs[i].count);
        }
        u += 3 * lh.nsegments;
        for (uint32_t i = 0; i < lh.npositions; i++)
            assert_int_equal(u[i], want->positions[i]);
        const uint8_t *tier = (const uint8_t *)(u + lh.npositions);
        for (uint32_t i = 0; i < lh.nsegments; i++)
            assert_int_equal(tier[i], want->tiers[i]);
        p = tier + (lh.nsegments + 3) / 4 * 4;
        nsegs += lh.nsegments;
    }
    assert_int_equal(h.bytes, (uint64_t)(p - f->rc.data));
    assert_int_equal(r->nsegments, nsegs);
}

/* TABLE answers what GetBlockTable gives, tiers and positions included;
 * bad requests are refused. */
static void test_table_through_the_ring(void **state)
{
    fixture *f = *state;
    /* 30 tokens, all but the 2 newest demoted to INT8 (12 a block). */
    const char *keys[] = {"int8", "int8_window"}, *values[] = {"on", "2"};
    uint64_t id;
    status s;
    assert_int_equal(seq_create_for(f->st, f->token, "full", keys, values, 2, &id, &s), ST_OK);
    store_table w;
    assert_int_equal(store_append(f->st, f->token, id, 30, 0, &w, &s), ST_OK);
    store_table_free(&w);
    seq_step_input in = {.new_tokens = 30, .prefill = 1, .confidence = -1};
    uint64_t epoch;
    uint32_t evicted;
    assert_int_equal(store_step(f->st, f->token, id, 0, &in, NULL, NULL, &epoch, &evicted, &s),
                     ST_OK);
    for (int with_positions = 0; with_positions <= 1; with_positions++) {
        ring_response r;
        assert_int_equal(call_table(f, id, with_positions, &r), ST_OK);
        store_table t;
        assert_int_equal(store_get_table(f->st, f->token, id, 0, with_positions, &t, &s), ST_OK);
        int int8 = 0;
        for (size_t i = 0; i < t.lists[0].nsegs; i++)
            int8 += t.lists[0].tiers[i] == POLICY_INT8;
        assert_true(int8 > 0); /* the tiers are worth comparing */
        assert_ring_table(f, &r, &t, with_positions);
        store_table_free(&t);
    }
    ring_response r;
    assert_int_equal(call_table(f, 999, 1, &r), ST_NOT_FOUND);
    assert_int_equal(call(f,
                          &(ring_request){.op = RING_OP_TABLE,
                                          .seq_id = id,
                                          .data_bytes = sizeof(ring_table_request) - 1},
                          &r),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(r.msg, "ring_table_request"));
}

/* A TABLE that would not fit the data area is refused, and says what sets
 * the limit; without positions the same table fits. */
static void test_table_too_large_for_the_ring(void **state)
{
    fixture *f = *state;
    store_table w;
    status s;
    assert_int_equal(store_append(f->st, f->token, f->seq_id, 300, 0, &w, &s), ST_OK);
    store_table_free(&w);
    ring_response r;
    assert_int_equal(call_table(f, f->seq_id, 1, &r), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(r.msg, "--ring-mb"));
    assert_int_equal(call_table(f, f->seq_id, 0, &r), ST_OK);
    store_table t;
    assert_int_equal(store_get_table(f->st, f->token, f->seq_id, 0, 0, &t, &s), ST_OK);
    assert_ring_table(f, &r, &t, 0);
    store_table_free(&t);
}

/* STEP copies the statistics out of the data area and hands them to the
 * store: h2o keeps the 2 newest tokens and the 2 heaviest of the others. */
static void test_step_statistics(void **state)
{
    fixture *f = *state;
    ring_response r;
    ring_request q = {.op = RING_OP_APPEND, .seq_id = f->seq_id, .count = 8};
    assert_int_equal(call(f, &q, &r), ST_OK);
    /* Too few floats for 2 layers x 8 tokens: the store's message. */
    float *data = (float *)f->rc.data;
    for (int i = 0; i < 16; i++)
        data[i] = (float)(i % 8);
    q = (ring_request){.op = RING_OP_STEP,
                       .seq_id = f->seq_id,
                       .ack_epoch = r.epoch,
                       .arrays = POLICY_NEEDS_SCORE,
                       .confidence = -1,
                       .data_bytes = 15 * sizeof(float)};
    assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
    assert_non_null(
        strstr(r.msg, "step statistics hold 15 floats; the layers' token lists need 16"));
    q.data_bytes = 7; /* not whole floats */
    assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
    assert_string_equal(r.msg, "data_bytes exceeds the ring or is not whole floats");
    q.data_bytes = RING_TEST_BYTES; /* beyond the data area */
    assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
    /* A float that is not finite, checked as the statistics are copied out
     * of the ring: refused by its index, and nothing changes. */
    q.data_bytes = 16 * sizeof(float);
    const float bad[2] = {NAN, -INFINITY};
    const int bad_at[2] = {11, 0};
    for (int k = 0; k < 2; k++) {
        data[bad_at[k]] = bad[k];
        assert_int_equal(call(f, &q, &r), ST_INVALID_ARGUMENT);
        char want[64];
        snprintf(want, sizeof want, "non-finite value at float %d", bad_at[k]);
        assert_non_null(strstr(r.msg, want));
        data[bad_at[k]] = (float)(bad_at[k] % 8);
    }
    assert_int_equal(call(f, &q, &r), ST_OK);
    uint64_t epoch = r.epoch;
    /* What the step did is what the store's table says now. */
    store_table t;
    status s;
    assert_int_equal(store_get_table(f->st, f->token, f->seq_id, epoch, 1, &t, &s), ST_OK);
    assert_int_equal(t.epoch, epoch);
    assert_int_equal(r.evicted, 8);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(t.lists[l].tokens, 4);
        for (uint32_t i = 0; i < 4; i++)
            assert_int_equal(t.lists[l].positions[i], 4 + i); /* scores 4, 5; newest 6, 7 */
    }
    store_table_free(&t);
}

/* A worker that waits longer than the daemon spins finds the ring thread
 * asleep on the futex: the request must wake it. */
static void test_sleeping_thread_is_woken(void **state)
{
    fixture *f = *state;
    _Atomic uint32_t *waiting = (_Atomic uint32_t *)&f->rc.hdr->daemon_waiting;
    for (int i = 0; i < 2000 && !atomic_load(waiting); i++)
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    assert_int_equal(atomic_load(waiting), 1);
    ring_response r;
    ring_request q = {.op = RING_OP_EPOCH, .seq_id = f->seq_id};
    assert_int_equal(call(f, &q, &r), ST_OK);
    assert_int_equal(r.epoch, 0);
}

/* After ring_close a worker learns at once that no answer will come. */
static void test_closed_ring_is_unavailable(void **state)
{
    fixture *f = *state;
    ring_close(f->r);
    ring_join(f->r);
    f->r = NULL;
    /* ring_join unmapped the daemon's side; the worker's mapping stays. */
    assert_int_equal(f->rc.hdr->closing, 1);
    ring_response r;
    assert_int_equal(ring_client_call(&f->rc, &r), KVS_ERR_UNAVAILABLE);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Post a request the way a worker does, without waiting for the answer. */
static void post(fixture *f, const ring_request *q)
{
    memcpy((void *)&f->rc.hdr->req, q, sizeof *q);
    atomic_fetch_add((_Atomic uint32_t *)&f->rc.hdr->req_seq, 1);
    syscall(SYS_futex, &f->rc.hdr->req_seq, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* Issue 12: the worker can write `closing`, so the thread must not depend
 * on it. The thread is held inside a request (the store's lock) while the
 * ring closes and the worker puts `closing` back to 0; the old thread then
 * took the next req_seq for a request and slept on the futex for ever,
 * and the fd-socket thread joining it with it. */
static void test_worker_cannot_keep_a_closed_ring_alive(void **state)
{
    fixture *f = *state;
    _Atomic uint32_t *closing = (_Atomic uint32_t *)&f->rc.hdr->closing;
    store_lock(f->st);
    post(f, &(ring_request){.op = RING_OP_EPOCH, .seq_id = f->seq_id});
    nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL); /* it waits for the lock */
    ring_close(f->r);
    assert_int_equal(atomic_load(closing), 1); /* the courtesy signal */
    atomic_store(closing, 0);
    assert_int_equal(ring_ended(f->r), 0); /* still inside the request */
    store_unlock(f->st);
    double t0 = now_ms();
    while (!ring_ended(f->r) && now_ms() - t0 < 2000) {
        atomic_store(closing, 0); /* and again, as a hostile worker would */
        atomic_store((_Atomic uint32_t *)&f->rc.hdr->daemon_waiting, 0);
    }
    double took = now_ms() - t0;
    assert_true(ring_ended(f->r));
    assert_true(took < 500); /* one futex slice is 50 ms */
    ring_join(f->r);
    f->r = NULL;
}

/* Every field of a request comes from memory the worker writes: each is
 * read once and checked, and none changes the store or stops the ring. */
static void test_garbage_requests_are_refused(void **state)
{
    fixture *f = *state;
    uint64_t seq = f->seq_id;
    const uint64_t area = RING_TEST_BYTES - RING_DATA_OFFSET;
    static const struct {
        ring_request q;
        int32_t code;
    } cases[] = {
        /* 1 */ {{.op = 0}, ST_INVALID_ARGUMENT},
        /* 2 */ {{.op = UINT32_MAX}, ST_INVALID_ARGUMENT},
        /* 3 */ {{.op = RING_OP_APPEND, .count = -1}, ST_INVALID_ARGUMENT},
        /* 4 */ {{.op = RING_OP_APPEND, .count = INT64_MAX}, ST_INVALID_ARGUMENT},
        /* 5 */ {{.op = RING_OP_APPEND, .count = INT64_MIN}, ST_INVALID_ARGUMENT},
        /* 6 */ {{.op = RING_OP_APPEND, .count = 65537}, ST_INVALID_ARGUMENT},
        /* 7 */
        {{.op = RING_OP_STEP, .confidence = -1, .data_bytes = UINT64_MAX}, ST_INVALID_ARGUMENT},
        /* 8 */
        {{.op = RING_OP_STEP, .confidence = -1, .data_bytes = area + 4}, ST_INVALID_ARGUMENT},
        /* 9 */
        {{.op = RING_OP_STEP, .confidence = -1, .arrays = UINT32_MAX, .data_bytes = 64},
         ST_INVALID_ARGUMENT},
        /* 10 */
        {{.op = RING_OP_STEP, .confidence = -1, .new_tokens = UINT32_MAX}, ST_INVALID_ARGUMENT},
        /* 11 */ {{.op = RING_OP_STEP, .confidence = NAN}, ST_INVALID_ARGUMENT},
        /* 12 */ {{.op = RING_OP_STEP, .confidence = 2}, ST_INVALID_ARGUMENT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ring_request q = cases[i].q;
        if (q.op == RING_OP_APPEND || q.op == RING_OP_STEP)
            q.seq_id = seq; /* a real sequence: only the garbage field is wrong */
        ring_response r;
        int32_t code = call(f, &q, &r);
        if (code != cases[i].code)
            fail_msg("case %zu: code %d, expected %d (%s)", i + 1, code, cases[i].code, r.msg);
        assert_true(strlen(r.msg) > 0);
    }
    /* Unknown sequences, including ones the header's garbage could name. */
    static const uint64_t ids[] = {0, 999, UINT64_MAX};
    for (size_t i = 0; i < 3; i++) {
        ring_response r;
        assert_int_equal(call(f, &(ring_request){.op = RING_OP_EPOCH, .seq_id = ids[i]}, &r),
                         ST_NOT_FOUND);
        assert_int_equal(
            call(f, &(ring_request){.op = RING_OP_APPEND, .seq_id = ids[i], .count = 1}, &r),
            ST_NOT_FOUND);
    }
    /* The daemon never reads the header's magic or size back. */
    f->rc.hdr->magic = ~RING_MAGIC;
    f->rc.hdr->bytes = UINT64_MAX;
    ring_response r;
    assert_int_equal(call(f, &(ring_request){.op = RING_OP_PING}, &r), ST_OK);
    /* Nothing was appended or stepped. */
    assert_int_equal(call(f, &(ring_request){.op = RING_OP_EPOCH, .seq_id = seq}, &r), ST_OK);
    assert_int_equal(r.epoch, 0);
    store_table t;
    status s;
    assert_int_equal(store_get_table(f->st, f->token, seq, 0, 0, &t, &s), ST_OK);
    for (uint32_t l = 0; l < t.nlists; l++)
        assert_int_equal(t.lists[l].tokens, 0);
    store_table_free(&t);
}

/* A call waiting for an answer that cannot come (the daemon is gone: its
 * end of the fd-socket connection hung up) returns UNAVAILABLE within a
 * sleep slice, not at the 10 s deadline. The ring thread is held in the
 * store's lock meanwhile, so no answer comes. */
static void test_dead_peer_is_unavailable_at_once(void **state)
{
    fixture *f = *state;
    close(f->peer[1]);
    f->peer[1] = -1;
    store_lock(f->st);
    memcpy((void *)&f->rc.hdr->req, &(ring_request){.op = RING_OP_EPOCH, .seq_id = f->seq_id},
           sizeof(ring_request));
    ring_response r;
    double t0 = now_ms();
    int rc = ring_client_call(&f->rc, &r);
    double took = now_ms() - t0;
    store_unlock(f->st);
    assert_int_equal(rc, KVS_ERR_UNAVAILABLE);
    assert_true(took < 500);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_header_and_ping, setup, teardown),
        cmocka_unit_test_setup_teardown(test_append_answers_the_table, setup, teardown),
        cmocka_unit_test_setup_teardown(test_revive_and_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_revive_too_large_for_the_ring, setup_small_ring,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_table_through_the_ring, setup, teardown),
        cmocka_unit_test_setup_teardown(test_table_too_large_for_the_ring, setup_small_ring,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_step_statistics, setup_h2o, teardown),
        cmocka_unit_test_setup_teardown(test_sleeping_thread_is_woken, setup, teardown),
        cmocka_unit_test_setup_teardown(test_closed_ring_is_unavailable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_worker_cannot_keep_a_closed_ring_alive, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_garbage_requests_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dead_peer_is_unavailable_at_once, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
