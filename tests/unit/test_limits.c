/*
 * Unit tests of the store's limits (issue 12, problems 2 and 4's reply;
 * docs/reliability.md): sequences' sketch cells reserved against
 * the daemon memory budget before anything exists, per-session quotas of
 * sequences and pool blocks, and replies over the reply limit refused
 * before the call changes anything. The store is called directly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "store.h"
#include "store_harness.h"
#include "store_operator.h"

/* 2 layers, 4 q heads over 2 KV heads of 8 dims, 4-token blocks, fp32:
 * 512-byte blocks; a list's sketch has 2 x 8 = 16 floats per cell. */
static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};
#define CELL_BYTES (2 * 16 * sizeof(float) + sizeof(int32_t))

typedef struct fixture {
    store *st;
    char a[STORE_TOKEN_LEN + 1], b[STORE_TOKEN_LEN + 1];
} fixture;

static fixture fx;

/* A store with the given limits and two attached sessions, a and b. */
static fixture *open_store(size_t max_daemon_bytes, uint32_t session_max_seqs,
                           uint32_t session_max_blocks, size_t max_reply_bytes)
{
    memset(&fx, 0, sizeof fx);
    store_config cfg = {.pool_bytes = 1 << 20,
                        .max_pools = 2,
                        .max_sessions = 4,
                        .max_seqs = 64,
                        .max_daemon_bytes = max_daemon_bytes,
                        .session_max_seqs = session_max_seqs,
                        .session_max_blocks = session_max_blocks,
                        .max_reply_bytes = max_reply_bytes};
    assert_non_null(fx.st = store_create(&cfg, NULL));
    status s;
    store_attach_result r;
    assert_int_equal(store_session_open(fx.st, 100, 1000, 1000, 1, fx.a, &s), ST_OK);
    assert_int_equal(store_attach(fx.st, fx.a, "m", &geom, "a", &r, &s), ST_OK);
    assert_int_equal(store_session_open(fx.st, 101, 1000, 1000, 2, fx.b, &s), ST_OK);
    assert_int_equal(store_attach(fx.st, fx.b, "m", &geom, "b", &r, &s), ST_OK);
    return &fx;
}

static int teardown(void **state)
{
    (void)state;
    store_destroy(fx.st);
    return 0;
}

static status_code create_sketch(fixture *f, const char *token, const char *rows,
                                 const char *buckets, uint64_t *id, status *s)
{
    const char *keys[] = {"window", "n_sink", "victims", "sketch_rows", "sketch_buckets"};
    const char *values[] = {"4", "0", "sketch", rows, buckets};
    return seq_create_for(f->st, token, "streaming", keys, values, 5, id, s);
}

static status_code create_full(fixture *f, const char *token, uint64_t *id, status *s)
{
    return seq_create_for(f->st, token, "full", NULL, NULL, 0, id, s);
}

static status_code append(fixture *f, const char *token, uint64_t id, int64_t count, status *s)
{
    store_table t;
    status_code rc = store_append(f->st, token, id, count, 0, &t, s);
    store_table_free(&t);
    return rc;
}

/* What Stats shows: the limits' use, and one sequence or session. */
static snapshot snap(fixture *f)
{
    snapshot sn;
    assert_int_equal(store_snapshot(f->st, &sn), 0);
    return sn;
}

static snapshot_seq seq_of(fixture *f, uint64_t id)
{
    snapshot sn = snap(f);
    snapshot_seq q = {0};
    for (size_t i = 0; i < sn.nseqs; i++)
        if (sn.seqs[i].id == id)
            q = sn.seqs[i];
    snapshot_free(&sn);
    assert_int_equal(q.id, id);
    return q;
}

static uint64_t reserved(fixture *f)
{
    snapshot sn = snap(f);
    uint64_t r = sn.mem_reserved;
    snapshot_free(&sn);
    return r;
}

static void test_sketch_bytes_saturate(void **state)
{
    (void)state;
    assert_int_equal(tier_sketch_bytes_for(3, 64, 16), 192 * CELL_BYTES);
    /* 32 rows x 2^20 buckets of absurd cells: saturates, never wraps */
    assert_int_equal(tier_sketch_bytes_for(32, 1u << 20, SIZE_MAX / 4), SIZE_MAX);
}

/* Problem 2: the largest sketch is refused at create, naming the numbers,
 * and leaves nothing behind; what fits is reserved, and given back. */
static void test_sketch_reserved_at_create(void **state)
{
    fixture *f = *state = open_store(1 << 20, 0, 0, 0);
    status s;
    uint64_t big, small, plain;
    assert_int_equal(create_sketch(f, f->a, "32", "65536", &big, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "--max-daemon-mb"));
    assert_non_null(strstr(s.msg, "need 528.0 MiB")); /* 2 lists x 2^21 cells x 132 bytes */
    assert_non_null(strstr(s.msg, "1.0 MiB left"));
    assert_non_null(strstr(s.msg, "or raise --max-daemon-mb")); /* whole, not truncated */
    snapshot sn = snap(f);
    assert_int_equal(sn.nseqs, 0);
    assert_int_equal(sn.mem_reserved, 0);
    assert_int_equal(sn.mem_limit, 1 << 20);
    snapshot_free(&sn);

    assert_int_equal(create_sketch(f, f->a, "3", "64", &small, &s), ST_OK);
    assert_int_equal(seq_of(f, small).sketch_reserved, 2 * 192 * CELL_BYTES);
    assert_int_equal(reserved(f), 2 * 192 * CELL_BYTES);
    /* a policy with no sketch of its own reserves nothing */
    assert_int_equal(create_full(f, f->a, &plain, &s), ST_OK);
    assert_int_equal(seq_of(f, plain).sketch_reserved, 0);
    assert_int_equal(reserved(f), 2 * 192 * CELL_BYTES);

    /* the cells allocated stay within the reservation */
    assert_int_equal(append(f, f->a, small, 12, &s), ST_OK);
    assert_int_equal(append(f, f->a, small, 1, &s), ST_OK); /* the step offloads 8 */
    snapshot_seq q = seq_of(f, small);
    assert_true(q.tier_bytes[POLICY_SKETCH] > 0);
    assert_true(q.tier_bytes[POLICY_SKETCH] <= q.sketch_reserved);

    uint32_t freed;
    assert_int_equal(store_seq_release(f->st, f->a, small, &freed, &s), ST_OK);
    assert_int_equal(reserved(f), 0);
}

/* The budget fills across sessions and comes back when a session ends. */
static void test_budget_shared_and_returned(void **state)
{
    size_t one = 2 * 8 * 1024 * CELL_BYTES; /* 8 rows x 1024 buckets, 2 lists */
    fixture *f = *state = open_store(2 * one + one / 2, 0, 0, 0);
    status s;
    uint64_t id;
    assert_int_equal(create_sketch(f, f->a, "8", "1024", &id, &s), ST_OK);
    assert_int_equal(create_sketch(f, f->b, "8", "1024", &id, &s), ST_OK);
    assert_int_equal(create_sketch(f, f->b, "8", "1024", &id, &s), ST_RESOURCE_EXHAUSTED);
    assert_int_equal(reserved(f), 2 * one);
    uint32_t released;
    assert_int_equal(store_detach(f->st, f->a, &released, &s), ST_OK);
    assert_int_equal(reserved(f), one);
    assert_int_equal(create_sketch(f, f->b, "8", "1024", &id, &s), ST_OK);
}

/* An operator's offload into the sketch of a sequence that reserved
 * nothing reserves first, and is refused, changing nothing, past the
 * budget. */
static void test_offload_reserves(void **state)
{
    fixture *f = *state = open_store(1000, 0, 0, 0); /* less than one 3 x 64 sketch */
    status s;
    uint64_t id;
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
    assert_int_equal(append(f, f->a, id, 8, &s), ST_OK);
    uint64_t epoch = seq_of(f, id).epoch;
    operator_range r = {0, 4};
    operator_evict_result out;
    assert_int_equal(operator_apply(f->st, f->a, id, POLICY_SKETCH, &r, 1, NULL, 0, &out, &s),
                     ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "--max-daemon-mb"));
    snapshot_seq q = seq_of(f, id);
    assert_int_equal(q.tier_tokens[POLICY_SKETCH], 0);
    assert_int_equal(q.sketch_reserved, 0);
    assert_int_equal(q.epoch, epoch);
}

/* --session-max-seqs: one session at its quota, the other unaffected. */
static void test_session_max_seqs(void **state)
{
    fixture *f = *state = open_store(0, 2, 0, 0);
    status s;
    uint64_t a1, a2, id;
    assert_int_equal(create_full(f, f->a, &a1, &s), ST_OK);
    assert_int_equal(create_full(f, f->a, &a2, &s), ST_OK);
    assert_int_equal(create_full(f, f->a, &id, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "--session-max-seqs"));
    assert_int_equal(create_full(f, f->b, &id, &s), ST_OK);
    assert_int_equal(create_full(f, f->b, &id, &s), ST_OK);
    uint32_t freed;
    assert_int_equal(store_seq_release(f->st, f->a, a1, &freed, &s), ST_OK);
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
}

/* --session-max-blocks: an append that would pass it is refused before a
 * token is added; the tail's free slots need no block; another session
 * has its own quota. */
static void test_session_max_blocks(void **state)
{
    fixture *f = *state = open_store(0, 0, 6, 0);
    status s;
    uint64_t a, b;
    assert_int_equal(create_full(f, f->a, &a, &s), ST_OK);
    assert_int_equal(create_full(f, f->b, &b, &s), ST_OK);
    assert_int_equal(append(f, f->a, a, 10, &s), ST_OK); /* 3 blocks a layer: 6 */
    assert_int_equal(append(f, f->a, a, 3, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "holds 6 of --session-max-blocks 6"));
    assert_non_null(strstr(s.msg, "or raise it"));
    assert_int_equal(seq_of(f, a).appended, 10);
    assert_int_equal(append(f, f->a, a, 2, &s), ST_OK); /* fills the tails */
    snapshot sn = snap(f);
    for (size_t i = 0; i < sn.nsessions; i++)
        if (strcmp(sn.sessions[i].name, "a") == 0)
            assert_int_equal(sn.sessions[i].blocks, 6);
    assert_int_equal(sn.session_max_blocks, 6);
    snapshot_free(&sn);
    assert_int_equal(append(f, f->b, b, 12, &s), ST_OK);
    assert_int_equal(append(f, f->b, b, 1, &s), ST_RESOURCE_EXHAUSTED);
}

/* Revive scratch counts to the block quota: a Revive past it is refused
 * and its blocks go back to the pool. */
static void test_revive_within_block_quota(void **state)
{
    fixture *f = *state = open_store(0, 0, 6, 0);
    status s;
    uint64_t id;
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
    assert_int_equal(append(f, f->a, id, 8, &s), ST_OK); /* 2 blocks a layer: 4 */
    seq_revive_request rq = {0, 0, 0, 8, 0, 0};          /* 8 rows: 2 scratch blocks */
    store_revive_result rv;
    assert_int_equal(store_revive(f->st, f->a, id, &rq, &rv, &s), ST_OK);
    store_revive_result_free(&rv);
    snapshot sn = snap(f);
    uint32_t free_before = sn.pools[0].blocks_free;
    snapshot_free(&sn);
    assert_int_equal(store_revive(f->st, f->a, id, &rq, &rv, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "this Revive needs 2 more pool blocks"));
    sn = snap(f);
    assert_int_equal(sn.pools[0].blocks_free, free_before);
    snapshot_free(&sn);
}

/* Problem 4's reply: an Append whose reply could pass the limit is refused
 * with nothing appended and the count that fits named; that count works. */
static void test_append_reply_refused(void **state)
{
    fixture *f = *state = open_store(0, 0, 0, 4096);
    status s;
    uint64_t id;
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
    assert_int_equal(append(f, f->a, id, 65536, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "--max-reply-mb"));
    assert_non_null(strstr(s.msg, "nothing was appended"));
    snapshot_seq q = seq_of(f, id);
    assert_int_equal(q.appended, 0);
    assert_int_equal(q.blocks, 0);
    const char *most = strstr(s.msg, "at most ");
    assert_non_null(most);
    long n = strtol(most + strlen("at most "), NULL, 10);
    assert_true(n > 100 && n < 4096);
    assert_int_equal(append(f, f->a, id, n, &s), ST_OK);
    /* n is the most: one more on an empty sequence is refused */
    uint64_t fresh;
    assert_int_equal(create_full(f, f->a, &fresh, &s), ST_OK);
    assert_int_equal(append(f, f->a, fresh, n + 1, &s), ST_RESOURCE_EXHAUSTED);
}

/* The ring's answer (segments only, in its data area) is bounded the same
 * way, in its own form: what the refusal names fits, exactly. */
static void test_ring_form_refused(void **state)
{
    fixture *f = *state = open_store(0, 0, 0, 0);
    status s;
    uint64_t id;
    store_reply_form ring = {
        .limit = 1000, .list_bytes = 4, .segment_bytes = 12, .limit_name = "the ring's data area"};
    store_table t;
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
    assert_int_equal(store_append_within(f->st, f->a, id, 1000, 0, &ring, &t, &s),
                     ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "over the ring's data area (1000 bytes)"));
    assert_int_equal(seq_of(f, id).appended, 0);
    long n = strtol(strstr(s.msg, "at most ") + strlen("at most "), NULL, 10);
    assert_true(n > 100);
    assert_int_equal(store_append_within(f->st, f->a, id, n, 0, &ring, &t, &s), ST_OK);
    size_t need = 0; /* what daemon/ring.c writes */
    for (uint32_t l = 0; l < t.nlists; l++)
        need += 4 + t.lists[l].nsegs * 12;
    assert_true(need <= 1000);
    store_table_free(&t);
}

/* GetBlockTable with positions over the limit is refused; without them
 * the same table fits. Revive over the limit is refused with nothing
 * revived. */
static void test_table_and_revive_reply_refused(void **state)
{
    fixture *f = *state = open_store(0, 0, 0, 4096);
    status s;
    uint64_t id;
    assert_int_equal(create_full(f, f->a, &id, &s), ST_OK);
    /* 400 tokens a list in 100 blocks: 2 x (100 segments x 16 + 400
     * positions x 2) bytes with positions, over 4096; 3.3 KiB without */
    for (int i = 0; i < 4; i++)
        assert_int_equal(append(f, f->a, id, 100, &s), ST_OK);
    store_table t;
    assert_int_equal(store_get_table(f->st, f->a, id, 0, 1, &t, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "without positions"));
    assert_int_equal(store_get_table(f->st, f->a, id, 0, 0, &t, &s), ST_OK);
    store_table_free(&t);
    snapshot sn = snap(f);
    uint32_t free_before = sn.pools[0].blocks_free;
    snapshot_free(&sn);
    seq_revive_request rq = {0, 0, 0, 0, 0, 0}; /* all 400 of layer 0 */
    store_revive_result rv;
    assert_int_equal(store_revive(f->st, f->a, id, &rq, &rv, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "revive at most"));
    assert_non_null(strstr(s.msg, "nothing was revived"));
    sn = snap(f);
    assert_int_equal(sn.pools[0].blocks_free, free_before);
    snapshot_free(&sn);
    rq.count = 100;
    assert_int_equal(store_revive(f->st, f->a, id, &rq, &rv, &s), ST_OK);
    store_revive_result_free(&rv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sketch_bytes_saturate),
        cmocka_unit_test_teardown(test_sketch_reserved_at_create, teardown),
        cmocka_unit_test_teardown(test_budget_shared_and_returned, teardown),
        cmocka_unit_test_teardown(test_offload_reserves, teardown),
        cmocka_unit_test_teardown(test_session_max_seqs, teardown),
        cmocka_unit_test_teardown(test_session_max_blocks, teardown),
        cmocka_unit_test_teardown(test_revive_within_block_quota, teardown),
        cmocka_unit_test_teardown(test_append_reply_refused, teardown),
        cmocka_unit_test_teardown(test_ring_form_refused, teardown),
        cmocka_unit_test_teardown(test_table_and_revive_reply_refused, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
