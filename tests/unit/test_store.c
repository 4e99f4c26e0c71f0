/*
 * Unit tests of the daemon's store: sessions, pools, sequences, appends,
 * eviction through the streaming policy, retired blocks and acks, and the
 * "bad input changes nothing" rule. No gRPC: the store is called directly.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "store.h"
#include "store_harness.h"
/* White-box: the blocks of kept victims (nvictim_blocks) have no accessor,
 * nor the store's lock and the sequences moving without it. */
#include "seq_internal.h"
#include "store_internal.h"

typedef struct fixture {
    store *st;
    char token[STORE_TOKEN_LEN + 1];
    uint64_t pool_id;
    uint32_t block_count;
    int background; /* store_config.move_priority runs large copies on its threads */
} fixture;

static const pool_geometry small_geom = {2, 4, 2, 8, 4, POOL_FP32, 0};

static int setup_config(void **state, const store_config *cfg)
{
    static fixture f;
    memset(&f, 0, sizeof f);
    assert_non_null(f.st = store_create(cfg, NULL));
    f.background = cfg->move_priority != BACKGROUND_NORMAL;
    status s;
    assert_int_equal(store_session_open(f.st, 100, 1000, 1000, 1, f.token, &s), ST_OK);
    store_attach_result r;
    assert_int_equal(store_attach(f.st, f.token, "m", &small_geom, "w", &r, &s), ST_OK);
    f.pool_id = r.pool_id;
    f.block_count = r.block_count;
    *state = &f;
    return 0;
}

static int setup_pool(void **state, size_t pool_bytes)
{
    store_config cfg = {
        .pool_bytes = pool_bytes, .max_pools = 4, .max_sessions = 16, .max_seqs = 64};
    return setup_config(state, &cfg);
}

static int setup(void **state)
{
    return setup_pool(state, 1 << 20);
}

/* A Revive's copy of 4 blocks or more on a background thread. */
static int setup_background_pool(void **state, size_t pool_bytes)
{
    store_config cfg = {.pool_bytes = pool_bytes,
                        .max_pools = 4,
                        .max_sessions = 16,
                        .max_seqs = 64,
                        .move_priority = BACKGROUND_IDLE,
                        .move_background_bytes = 4 * 512};
    return setup_config(state, &cfg);
}

static int setup_background(void **state)
{
    return setup_background_pool(state, 1 << 20);
}

static int setup_background_large(void **state)
{
    return setup_background_pool(state, 64 << 20);
}

/* 128 blocks of 512 bytes: small enough to run out of quickly. */
static int setup_small(void **state)
{
    return setup_pool(state, 64 << 10);
}

/* Room for lists long enough that a step decides without the lock. */
static int setup_large(void **state)
{
    return setup_pool(state, 64 << 20);
}

static int teardown(void **state)
{
    fixture *f = *state;
    store_destroy(f->st);
    return 0;
}

/* The store as Stats sees it (store_snapshot). */
static snapshot take_snapshot(fixture *f)
{
    snapshot sn;
    assert_int_equal(store_snapshot(f->st, &sn), 0);
    return sn;
}

/* The fixture's pool, the first the store created. */
static snapshot_pool the_pool(fixture *f)
{
    snapshot sn = take_snapshot(f);
    assert_true(sn.npools >= 1);
    snapshot_pool p = sn.pools[0];
    snapshot_free(&sn);
    return p;
}

static size_t store_pools(fixture *f)
{
    snapshot sn = take_snapshot(f);
    size_t n = sn.npools;
    snapshot_free(&sn);
    return n;
}

static size_t store_seqs(fixture *f)
{
    snapshot sn = take_snapshot(f);
    size_t n = sn.nseqs;
    snapshot_free(&sn);
    return n;
}

static uint64_t make_seq(fixture *f, const char *policy, const char *const *keys,
                         const char *const *values, size_t n)
{
    uint64_t id;
    status s;
    assert_int_equal(seq_create_for(f->st, f->token, policy, keys, values, n, &id, &s), ST_OK);
    return id;
}

static void append(fixture *f, uint64_t id, int64_t count, uint64_t ack, store_table *w)
{
    status s;
    status_code rc = store_append(f->st, f->token, id, count, ack, w, &s);
    if (rc != ST_OK)
        fail_msg("append failed: %s", s.msg);
}

/* The held positions of one layer, through the public table copy. */
static void table_positions(fixture *f, uint64_t id, uint32_t layer, uint32_t *out, uint32_t *n)
{
    store_table t;
    status s;
    assert_int_equal(store_get_table(f->st, f->token, id, 0, 1, &t, &s), ST_OK);
    *n = t.lists[layer].tokens;
    memcpy(out, t.lists[layer].positions, *n * sizeof *out);
    /* Segments must cover exactly the held tokens. */
    assert_int_equal(kv_segments_tokens(t.lists[layer].segs, t.lists[layer].nsegs), *n);
    store_table_free(&t);
}

static void test_append_assigns_fresh_blocks(void **state)
{
    fixture *f = *state;
    uint64_t id = make_seq(f, "full", NULL, NULL, 0);
    store_table w;
    append(f, id, 6, 0, &w); /* block_tokens 4: 2 blocks per layer */
    assert_int_equal(w.nlists, 2);
    assert_int_equal(w.first_position, 0);
    assert_int_equal(w.epoch, 1);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(w.lists[l].nsegs, 2);
        assert_int_equal(w.lists[l].segs[0].count, 4);
        assert_int_equal(w.lists[l].segs[1].count, 2);
        assert_int_equal(w.lists[l].segs[1].first_slot, 0);
    }
    /* Four distinct blocks over the two layers. */
    assert_int_not_equal(w.lists[0].segs[0].block, w.lists[1].segs[0].block);
    assert_int_not_equal(w.lists[0].segs[1].block, w.lists[1].segs[1].block);
    assert_int_equal(the_pool(f).blocks_free, f->block_count - 4);
    uint32_t tail = w.lists[0].segs[1].block;
    store_table_free(&w);
    append(f, id, 1, 0, &w); /* fills the tail block's slot 2 */
    assert_int_equal(w.first_position, 6);
    assert_int_equal(w.lists[0].segs[0].block, tail);
    assert_int_equal(w.lists[0].segs[0].first_slot, 2);
    store_table_free(&w);
}

static void test_streaming_keeps_exactly_sinks_and_window(void **state)
{
    fixture *f = *state;
    const char *keys[] = {"n_sink", "window"}, *values[] = {"3", "5"};
    uint64_t id = make_seq(f, "streaming", keys, values, 2);
    uint64_t epoch = 0;
    for (uint32_t T = 1; T <= 60; T++) {
        store_table w;
        append(f, id, 1, epoch, &w);
        epoch = w.epoch;
        store_table_free(&w);
        uint32_t pos[64], n;
        for (uint32_t layer = 0; layer < 2; layer++) {
            table_positions(f, id, layer, pos, &n);
            uint32_t expect = 0;
            /* The step of tokens < T-1 ended at this append: sinks, the
             * window of those, and the new token T-1. */
            for (uint32_t p = 0; p < T; p++) {
                if (p >= 3 && p + 5 < T - 1)
                    continue;
                assert_true(expect < n);
                assert_int_equal(pos[expect], p);
                expect++;
            }
            assert_int_equal(n, expect);
        }
    }
    /* Held blocks stay bounded: sinks' block + the window's blocks (+1 tail)
     * per layer, not 60 tokens' worth. */
    seq *q = store_find_seq_locked(f->st, id);
    assert_true(seq_blocks_held(q) <= 2 * (1 + 3));
}

static void test_evicted_blocks_retire_until_ack(void **state)
{
    fixture *f = *state;
    const char *keys[] = {"n_sink", "window"}, *values[] = {"0", "4"};
    uint64_t id = make_seq(f, "streaming", keys, values, 2);
    store_table w;
    append(f, id, 4, 0, &w); /* one full block per layer */
    store_table_free(&w);
    append(f, id, 4, 0, &w); /* a second one; the first step keeps all 4 */
    assert_int_equal(w.evicted, 0);
    store_table_free(&w);
    uint32_t free_before = the_pool(f).blocks_free;
    append(f, id, 1, 0, &w); /* the step of 8 evicts the whole first block of each layer */
    assert_int_equal(w.evicted, 8);
    uint64_t epoch = w.epoch;
    store_table_free(&w);
    seq *q = store_find_seq_locked(f->st, id);
    assert_int_equal(seq_retired_count(q), 2);
    assert_int_equal(the_pool(f).blocks_free,
                     free_before - 2); /* new tail blocks; none freed yet */
    store_table t;
    status s;
    assert_int_equal(store_get_table(f->st, f->token, id, epoch, 0, &t, &s), ST_OK);
    store_table_free(&t);
    assert_int_equal(seq_retired_count(q), 0);
    assert_int_equal(the_pool(f).blocks_free, free_before); /* the 2 retired are back */
    /* Reusable: a new sequence gets those blocks. */
    uint64_t id2 = make_seq(f, "full", NULL, NULL, 0);
    append(f, id2, 8, 0, &w);
    store_table_free(&w);
    assert_int_equal(the_pool(f).blocks_free, free_before - 4);
}

static void test_pool_full_changes_nothing(void **state)
{
    fixture *f = *state;
    uint64_t id = make_seq(f, "full", NULL, NULL, 0);
    store_table w;
    append(f, id, 3, 0, &w);
    store_table_free(&w);
    seq *q = store_find_seq_locked(f->st, id);
    uint64_t epoch = seq_epoch(q);
    uint32_t nfree = the_pool(f).blocks_free;
    status s;
    /* Far more tokens than the pool holds. */
    assert_int_equal(store_append(f->st, f->token, id, 65536, 0, &w, &s), ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s.msg, "free blocks"));
    assert_int_equal(seq_epoch(q), epoch);
    assert_int_equal(seq_appended(q), 3);
    assert_int_equal(the_pool(f).blocks_free, nfree);
}

static void test_bad_counts(void **state)
{
    fixture *f = *state;
    uint64_t id = make_seq(f, "full", NULL, NULL, 0);
    store_table w;
    status s;
    int64_t bad[] = {0, -1, -5, 65537, INT64_MAX, INT64_MIN};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(store_append(f->st, f->token, id, bad[i], 0, &w, &s), ST_INVALID_ARGUMENT);
        assert_non_null(strstr(s.msg, "count"));
    }
    assert_int_equal(seq_epoch(store_find_seq_locked(f->st, id)), 0);
}

static void test_sessions_and_ownership(void **state)
{
    fixture *f = *state;
    uint64_t id = make_seq(f, "full", NULL, NULL, 0);
    char other[STORE_TOKEN_LEN + 1];
    status s;
    store_table w;
    assert_int_equal(store_session_open(f->st, 200, 1000, 1000, 2, other, &s), ST_OK);
    assert_int_equal(store_append(f->st, other, id, 1, 0, &w, &s), ST_FAILED_PRECONDITION);
    store_attach_result r;
    pool_geometry g = small_geom;
    g.kv_heads = 1;
    assert_int_equal(store_attach(f->st, other, "m", &g, "x", &r, &s), ST_FAILED_PRECONDITION);
    assert_non_null(strstr(s.msg, "geometry mismatch"));
    assert_int_equal(store_attach(f->st, other, "m", &small_geom, "x", &r, &s), ST_OK);
    assert_int_equal(r.pool_id, f->pool_id); /* same model, same pool */
    assert_int_equal(store_append(f->st, other, id, 1, 0, &w, &s), ST_PERMISSION_DENIED);
    assert_int_equal(store_append(f->st, NULL, id, 1, 0, &w, &s), ST_UNAUTHENTICATED);
    assert_int_equal(store_append(f->st, f->token, 999, 1, 0, &w, &s), ST_NOT_FOUND);
    /* The other session's connection closes: only its state goes. */
    store_session_conn_closed(f->st, 2);
    assert_int_equal(the_pool(f).sessions, 1);
    append(f, id, 1, 0, &w);
    store_table_free(&w);
}

static void test_reclaim_frees_everything(void **state)
{
    fixture *f = *state;
    uint32_t nfree = the_pool(f).blocks_free;
    uint64_t a = make_seq(f, "full", NULL, NULL, 0);
    const char *keys[] = {"n_sink", "window"}, *values[] = {"1", "2"};
    uint64_t b = make_seq(f, "streaming", keys, values, 2);
    store_table w;
    append(f, a, 9, 0, &w);
    store_table_free(&w);
    for (int i = 0; i < 20; i++) {
        append(f, b, 1, 0, &w); /* never acks: retired blocks pile up */
        store_table_free(&w);
    }
    assert_true(the_pool(f).blocks_free < nfree);
    char second[STORE_TOKEN_LEN + 1];
    status s;
    assert_int_equal(store_session_open(f->st, 300, 1000, 1000, 3, second, &s), ST_OK);
    store_attach_result r;
    assert_int_equal(store_attach(f->st, second, "m", &small_geom, "x", &r, &s), ST_OK);
    store_lease_end(f->st, 1); /* the fixture's session (id 1) dies */
    assert_null(store_find_seq_locked(f->st, a));
    assert_null(store_find_seq_locked(f->st, b));
    assert_int_equal(store_seqs(f), 0);
    assert_int_equal(the_pool(f).blocks_free, the_pool(f).blocks_total); /* all blocks back */
}

static void test_bad_geometry_and_policy(void **state)
{
    fixture *f = *state;
    char tok[STORE_TOKEN_LEN + 1];
    status s;
    store_attach_result r;
    assert_int_equal(store_session_open(f->st, 400, 1000, 1000, 4, tok, &s), ST_OK);
    pool_geometry g = small_geom;
    g.q_heads = 3;
    assert_int_equal(store_attach(f->st, tok, "x", &g, "", &r, &s), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(s.msg, "q_heads"));
    g = small_geom;
    g.head_dim = 0;
    assert_int_equal(store_attach(f->st, tok, "x", &g, "", &r, &s), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(s.msg, "head_dim"));
    g = small_geom;
    g.dtype = 0;
    assert_int_equal(store_attach(f->st, tok, "x", &g, "", &r, &s), ST_INVALID_ARGUMENT);
    assert_int_equal(store_attach(f->st, tok, "bad name!", &small_geom, "", &r, &s),
                     ST_INVALID_ARGUMENT);
    uint64_t id;
    assert_int_equal(seq_create_for(f->st, f->token, "nope", NULL, NULL, 0, &id, &s),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(s.msg, "nope"));
    const char *keys[] = {"window"}, *values[] = {"abc"};
    assert_int_equal(seq_create_for(f->st, f->token, "streaming", keys, values, 1, &id, &s),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(s.msg, "window"));
    assert_int_equal(store_seqs(f), 0);
    assert_int_equal(store_pools(f), 1); /* no pool was created for "x" */
}

/* The sources Revive reports for positions [first, first + n) of layer 0. */
static void revive_sources(fixture *f, uint64_t id, uint32_t first, uint32_t n, uint32_t counts[3])
{
    status s;
    store_revive_result r;
    assert_int_equal(
        store_revive(f->st, f->token, id, &(seq_revive_request){0, 0, first, n, 0, 0}, &r, &s),
        ST_OK);
    assert_int_equal(r.table.tokens, n);
    counts[0] = counts[1] = counts[2] = 0;
    for (uint32_t t = 0; t < n; t++)
        counts[r.src_tier[t]]++;
    uint32_t freed;
    assert_int_equal(store_scratch_release(f->st, f->token, r.scratch_id, &freed, &s), ST_OK);
    store_revive_result_free(&r);
}

/* victims=int8 keeps streaming's victims as INT8 out of the table, an INT8
 * block per 12 of them, until the pool runs short: then appends still
 * succeed because the oldest victim blocks give way, Revive says those
 * positions are gone, and every block is accounted for. */
static void test_int8_victims_give_way_under_pressure(void **state)
{
    fixture *f = *state;
    const char *keys[] = {"n_sink", "window", "victims"}, *values[] = {"0", "8", "int8"};
    uint64_t id = make_seq(f, "streaming", keys, values, 3);
    seq *q = store_find_seq_locked(f->st, id);
    uint32_t t8 = seq_block_tokens(q, POLICY_INT8);
    assert_int_equal(t8, 12); /* 512-byte blocks: 4 fp32 tokens, or 12 INT8 ones + scales */
    store_table w;
    uint64_t ack = 0;
    /* Two layers of victims at 1/12 block each fill 128 blocks in ~770 tokens. */
    assert_int_equal(f->block_count, 128);
    uint32_t total = 1500, counts[3];
    for (uint32_t p = 0; p < total; p++) {
        append(f, id, 1, ack, &w);
        ack = w.epoch;
        store_table_free(&w);
        if (p != 300)
            continue;
        /* No pressure yet: every victim kept, in whole INT8 blocks, the rest
         * waiting at full precision; the window of 8 and the newest token
         * (its step is the next append) held. */
        const seq_list *ly = &q->lists[0];
        assert_int_equal(ly->noffloaded, p + 1 - 9);
        assert_int_equal(ly->nvictim_blocks, ly->noffloaded / t8);
        uint32_t n8 = (uint32_t)(ly->noffloaded / t8 * t8); /* positions 0..n8-1 */
        revive_sources(f, id, 0, 96, counts);
        assert_int_equal(counts[POLICY_INT8], 96);
        revive_sources(f, id, n8 - 8, p + 1 - (n8 - 8), counts);
        assert_int_equal(counts[POLICY_INT8], 8);
        assert_int_equal(counts[POLICY_FULL], p + 1 - n8);
    }
    assert_true(seq_victims_dropped(q) > 0);
    assert_int_equal(seq_appended(q), total);
    /* Held and retired blocks plus free ones are the whole pool. */
    assert_int_equal(seq_blocks_held(q) + the_pool(f).blocks_free, f->block_count);
    status s;
    store_revive_result r;
    assert_int_equal(
        store_revive(f->st, f->token, id, &(seq_revive_request){0, 0, 0, 10, 0, 0}, &r, &s),
        ST_FAILED_PRECONDITION);
    assert_non_null(strstr(s.msg, "evicted outright"));
    /* The victims dropped are the oldest, whole INT8 blocks of each layer:
     * what is kept starts right after them. */
    for (uint32_t l = 0; l < 2; l++) {
        const seq_list *ly = &q->lists[l];
        assert_int_equal(ly->offloaded[0] % t8, 0);
        assert_int_equal(seq_victims_dropped(q), 2 * (uint64_t)ly->offloaded[0]);
        assert_int_equal(ly->offloaded[ly->noffloaded - 1], total - 10);
    }
    /* An append no amount of dropping can serve is refused, victims kept
     * (the step of the last token still ran first: one more victim). */
    uint64_t dropped = seq_victims_dropped(q), kept = q->lists[0].noffloaded;
    assert_int_equal(store_append(f->st, f->token, id, 65536, ack, &w, &s), ST_RESOURCE_EXHAUSTED);
    assert_int_equal(seq_victims_dropped(q), dropped);
    assert_int_equal(q->lists[0].noffloaded, kept + 1);
}

/* The value of channel c of token `pos`'s K (kv 0) or V (kv 1) row of a
 * head in layer l: distinct for every one. */
static float token_value(uint32_t l, uint32_t pos, uint32_t head, int kv, uint32_t c)
{
    return (float)(((l * 1000 + pos) * 4 + head * 2 + (uint32_t)kv) * 16 + c);
}

/* Write every token of an append's table (w) with token_value. */
static void write_tokens(fixture *f, uint64_t id, const store_table *w)
{
    pool *p = seq_pool(store_find_seq_locked(f->st, id));
    for (uint32_t l = 0; l < w->nlists; l++) {
        uint32_t pos = w->first_position;
        for (size_t j = 0; j < w->lists[l].nsegs; j++) {
            kv_segment g = w->lists[l].segs[j];
            for (uint32_t i = 0; i < g.count; i++, pos++)
                for (uint32_t h = 0; h < small_geom.kv_heads; h++)
                    for (int kv = 0; kv < 2; kv++) {
                        size_t at = kv_key_offset(&p->layout, g.block, h, g.first_slot + i) +
                                    (size_t)kv * p->block_bytes / 2;
                        float *row = (float *)(p->base + at);
                        for (uint32_t c = 0; c < small_geom.head_dim; c++)
                            row[c] = token_value(w->lists[l].layer, pos, h, kv, c);
                    }
        }
    }
}

/* Revive positions [first, first + n) of layer 1 and check that the
 * scratch holds what write_tokens wrote there. */
static void revive_and_check(fixture *f, uint64_t id, uint32_t first, uint32_t n)
{
    status s;
    store_revive_result r;
    assert_int_equal(
        store_revive(f->st, f->token, id, &(seq_revive_request){1, 0, first, n, 0, 0}, &r, &s),
        ST_OK);
    assert_int_equal(r.table.tokens, n);
    pool *p = seq_pool(store_find_seq_locked(f->st, id));
    uint32_t t = 0;
    for (size_t j = 0; j < r.table.nsegs; j++) {
        kv_segment g = r.table.segs[j];
        for (uint32_t i = 0; i < g.count; i++, t++) {
            assert_int_equal(r.table.positions[t], first + t);
            for (uint32_t h = 0; h < small_geom.kv_heads; h++)
                for (int kv = 0; kv < 2; kv++) {
                    size_t at = kv_key_offset(&p->layout, g.block, h, g.first_slot + i) +
                                (size_t)kv * p->block_bytes / 2;
                    const float *row = (const float *)(p->base + at);
                    for (uint32_t c = 0; c < small_geom.head_dim; c++)
                        assert_true(row[c] == token_value(1, first + t, h, kv, c));
                }
        }
    }
    assert_int_equal(t, n);
    uint32_t freed;
    assert_int_equal(store_scratch_release(f->st, f->token, r.scratch_id, &freed, &s), ST_OK);
    store_revive_result_free(&r);
}

/* A Revive's copy of store_config.move_background_bytes or more runs on a
 * background thread (background.h), a smaller one on the caller's; both
 * give back what the sequence holds. (test_demotion_after_the_reply runs
 * with this fixture too: a demotion's quantisation goes the same way.) */
static void test_revive_in_background(void **state)
{
    fixture *f = *state;
    uint64_t id = make_seq(f, "full", NULL, NULL, 0);
    store_table w;
    append(f, id, 40, 0, &w);
    write_tokens(f, id, &w);
    store_table_free(&w);
    assert_int_equal(store_background_moves(f->st), 0);
    revive_and_check(f, id, 5, 12); /* 3 blocks of 512 bytes: below 4 */
    assert_int_equal(store_background_moves(f->st), 0);
    revive_and_check(f, id, 3, 16); /* 4 blocks */
    assert_int_equal(store_background_moves(f->st), 1);
    revive_and_check(f, id, 0, 40);
    assert_int_equal(store_background_moves(f->st), 2);
}

/* Tokens of tier t in layer 0 of a table. */
static uint32_t table_tier_tokens(const store_table *t, uint8_t tier)
{
    uint32_t n = 0;
    for (size_t j = 0; j < t->lists[0].nsegs; j++)
        if ((t->lists[0].tiers != NULL ? t->lists[0].tiers[j] : POLICY_FULL) == tier)
            n += t->lists[0].segs[j].count;
    return n;
}

/* A step's demotion runs after the step's reply (store_demote.c): the
 * reply gives the step's own epoch; the sequence's next call waits for
 * the demotion and sees it at the next epoch, and the blocks the demoted
 * tokens left stay retired until the worker acks that epoch. */
static void test_demotion_after_the_reply(void **state)
{
    fixture *f = *state;
    const char *keys[] = {"n_sink", "window", "int8", "int8_window"};
    const char *values[] = {"4", "1048576", "on", "4"};
    uint64_t id = make_seq(f, "streaming", keys, values, 4);
    store_table w, t;
    status s;
    append(f, id, 40, 0, &w);
    uint64_t ack = w.epoch;
    store_table_free(&w);
    seq_step_input in = {.new_tokens = 40, .prefill = 1, .confidence = -1};
    uint64_t epoch;
    uint32_t evicted;
    assert_int_equal(store_step(f->st, f->token, id, ack, &in, NULL, NULL, &epoch, &evicted, &s),
                     ST_OK);
    assert_int_equal(evicted, 0);
    assert_int_equal(store_get_table(f->st, f->token, id, epoch, 0, &t, &s), ST_OK);
    assert_true(t.epoch == epoch + 1); /* published after the reply */
    seq *q = store_find_seq_locked(f->st, id);
    uint32_t t8 = seq_block_tokens(q, POLICY_INT8); /* 12: the 36 older than the window */
    assert_int_equal(table_tier_tokens(&t, POLICY_INT8), 36 / t8 * t8);
    assert_int_equal(table_tier_tokens(&t, POLICY_FULL), 40 - 36 / t8 * t8);
    const seq_retired *r;
    size_t nr = seq_retired_blocks(q, &r);
    assert_true(nr > 0);
    for (size_t i = 0; i < nr; i++)
        assert_true(r[i].epoch == t.epoch);
    uint64_t now;
    assert_int_equal(store_epoch(f->st, f->token, id, t.epoch, &now, &s), ST_OK);
    assert_int_equal(seq_retired_blocks(q, &r), 0);
    store_table_free(&t);
    /* The prompt's 72 tokens of 128 bytes: a background thread's, when
     * there are some. */
    assert_int_equal(store_background_moves(f->st), f->background);
    /* Decode steps that leave a block's worth due: demoted, 2 x 12 tokens,
     * but at the demoter's priority (the worker's next call waits). */
    uint32_t before = 36 / t8 * t8;
    ack = now;
    in = (seq_step_input){.new_tokens = 1, .confidence = -1};
    for (int i = 0; i < 24; i++) {
        append(f, id, 1, ack, &w);
        store_table_free(&w);
        assert_int_equal(
            store_step(f->st, f->token, id, ack, &in, NULL, NULL, &epoch, &evicted, &s), ST_OK);
        assert_int_equal(store_epoch(f->st, f->token, id, epoch, &ack, &s), ST_OK);
    }
    assert_int_equal(store_get_table(f->st, f->token, id, ack, 0, &t, &s), ST_OK);
    assert_true(table_tier_tokens(&t, POLICY_INT8) >= before + 2 * t8);
    store_table_free(&t);
    assert_int_equal(store_background_moves(f->st), f->background);
}

/* One token appended to sequence id and a step without statistics, acked
 * at *ack (updated); whether both succeeded. */
static int own_step(fixture *f, uint64_t id, uint64_t *ack)
{
    store_table w;
    status s;
    seq_step_input in = {.confidence = -1};
    uint32_t evicted;
    if (store_append(f->st, f->token, id, 1, *ack, &w, &s) != ST_OK)
        return 0;
    *ack = w.epoch;
    store_table_free(&w);
    return store_step(f->st, f->token, id, *ack, &in, NULL, NULL, ack, &evicted, &s) == ST_OK;
}

/* What the other thread of test_decision_without_the_lock saw. */
typedef struct beside_decision {
    fixture *f;
    uint64_t long_id, own_id;
    uint64_t long_tokens; /* the long sequence's tokens, which its steps keep */
    atomic_int done;
    atomic_int saw_moving; /* times it held the lock while the long one decided */
    int miscounted;        /* snapshots that counted the long one wrong */
    int own_steps;         /* its own sequence's appends and steps */
    int own_failures;
} beside_decision;

static uint64_t snapshot_tokens(store *st, uint64_t seq_id, int *found)
{
    snapshot sn;
    uint64_t tokens = 0;
    *found = 0;
    if (store_snapshot(st, &sn) != 0)
        return 0;
    for (size_t i = 0; i < sn.nseqs; i++)
        if (sn.seqs[i].id == seq_id)
            tokens = sn.seqs[i].tokens, *found = 1;
    snapshot_free(&sn);
    return tokens;
}

static void *step_beside_decision(void *arg)
{
    beside_decision *c = arg;
    store *st = c->f->st;
    uint64_t ack = 0;
    while (!atomic_load(&c->done)) {
        /* Waiting for the lock: woken whenever the stepping thread lets
         * it go, for a decision or at the end of a step. */
        pthread_mutex_lock(&st->lock);
        c->saw_moving += st->nmoving > 0; /* nothing else moves here */
        pthread_mutex_unlock(&st->lock);
        int found;
        c->miscounted += snapshot_tokens(st, c->long_id, &found) != c->long_tokens || !found;
        if (own_step(c->f, c->own_id, &ack))
            c->own_steps++;
        else
            c->own_failures++;
    }
    return NULL;
}

/* The statistics of the next step of sequence id: deterministic, different
 * per token. malloc'd; *n floats. */
/* A prompt step's input of n floats x with `arrays` (stats_for's). */
static seq_step_input prompt_input(unsigned arrays, const float *x, size_t n)
{
    return (seq_step_input){.arrays = arrays,
                            .prefill = 1,
                            .score_queries = 2,
                            .window_queries = 2,
                            .confidence = -1,
                            .data = x,
                            .nfloats = n};
}

static float *stats_for(fixture *f, uint64_t id, unsigned *arrays, size_t *n)
{
    seq *q = store_find_seq_locked(f->st, id);
    *arrays = q->policy->needs & ~(unsigned)POLICY_NEEDS_CONFIDENCE;
    *n = seq_step_floats(q, *arrays);
    float *x = malloc(*n * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < *n; i++)
        x[i] = (float)((i * 7) % 13) / 13.0f;
    return x;
}

/* A step's decision over long lists runs without the store's lock
 * (store_step, issue 16 §3): while one thread steps a 40,000-token h2o
 * sequence, another finds the lock free with the sequence marked moving,
 * takes snapshots that count the sequence's tokens as they are, and
 * appends to and steps a sequence of its own. */
static void test_decision_without_the_lock(void **state)
{
    fixture *f = *state;
    beside_decision c = {.f = f};
    const char *keys[] = {"budget", "recent"}, *values[] = {"20000", "8"};
    c.long_id = make_seq(f, "h2o", keys, values, 2);
    const char *wkeys[] = {"n_sink", "window"}, *wvalues[] = {"4", "16"};
    c.own_id = make_seq(f, "streaming", wkeys, wvalues, 2);
    store_table w;
    append(f, c.long_id, 40000, 0, &w);
    uint64_t ack = w.epoch;
    store_table_free(&w);
    status s;
    uint64_t epoch;
    uint32_t evicted;
    unsigned arrays;
    size_t n;
    float *x = stats_for(f, c.long_id, &arrays, &n);
    seq_step_input in = prompt_input(arrays, x, n);
    assert_int_equal(
        store_step(f->st, f->token, c.long_id, ack, &in, NULL, NULL, &epoch, &evicted, &s), ST_OK);
    free(x);
    int found;
    c.long_tokens = snapshot_tokens(f->st, c.long_id, &found);
    assert_true(found);
    /* Each list cut to its budget, and long enough to decide unlocked. */
    assert_int_equal(evicted, 40000 * 2 * seq_heads(store_find_seq_locked(f->st, c.long_id)) -
                                  c.long_tokens);
    assert_true(c.long_tokens >= STORE_UNLOCKED_DECISION_TOKENS);
    x = stats_for(f, c.long_id, &arrays, &n);
    in = (seq_step_input){.arrays = arrays,
                          .score_queries = 2,
                          .window_queries = 2,
                          .confidence = -1,
                          .data = x,
                          .nfloats = n};
    pthread_t other;
    assert_int_equal(pthread_create(&other, NULL, step_beside_decision, &c), 0);
    /* Until the other thread has seen a decision from outside: one step
     * does it on an idle machine; the bound, for a loaded one, is far
     * (each step decides over 40,000 tokens, under a millisecond). */
    int steps = 0;
    for (; steps < 20000 && atomic_load(&c.saw_moving) == 0; steps++) {
        status_code rc =
            store_step(f->st, f->token, c.long_id, epoch, &in, NULL, NULL, &epoch, &evicted, &s);
        if (rc != ST_OK)
            fail_msg("step %d: %s", steps, s.msg);
        assert_int_equal(evicted, 0);
    }
    atomic_store(&c.done, 1);
    assert_int_equal(pthread_join(other, NULL), 0);
    free(x);
    assert_true(c.saw_moving > 0);
    assert_int_equal(c.miscounted, 0);
    assert_int_equal(c.own_failures, 0);
    assert_true(c.own_steps > 0);
    assert_int_equal(snapshot_tokens(f->st, c.long_id, &found), c.long_tokens);
    /* The prefill's decision, its application (detached) and its commit
     * ran on a background thread, when there are some; the decode steps',
     * which the worker waits for, did not. */
    assert_int_equal(store_background_moves(f->st), 3 * f->background);
}

/* What the other thread of test_application_without_the_lock saw. */
typedef struct beside_application {
    fixture *f;
    uint64_t own_id;
    atomic_int done;
    atomic_int saw_detached; /* times it held the lock while a prompt applied */
    int unbalanced;          /* snapshots whose pool's blocks did not add up */
    atomic_int snapshots;
    int own_steps;
    int own_failures;
} beside_application;

/* Whether a snapshot's pool blocks add up: free, and each sequence's. */
static int snapshot_balanced(store *st)
{
    snapshot sn;
    if (store_snapshot(st, &sn) != 0)
        return 0;
    uint64_t held = 0;
    for (size_t i = 0; i < sn.nseqs; i++)
        held += sn.seqs[i].blocks;
    int ok = sn.npools == 1 && sn.pools[0].blocks_free + held == sn.pools[0].blocks_total;
    snapshot_free(&sn);
    return ok;
}

static void *step_beside_application(void *arg)
{
    beside_application *c = arg;
    store *st = c->f->st;
    uint64_t ack = 0;
    while (!atomic_load(&c->done)) {
        pthread_mutex_lock(&st->lock);
        c->saw_detached += st->ndetached > 0;
        pthread_mutex_unlock(&st->lock);
        c->unbalanced += !snapshot_balanced(st);
        c->snapshots++;
        if (own_step(c->f, c->own_id, &ack))
            c->own_steps++;
        else
            c->own_failures++;
    }
    return NULL;
}

/*
 * A prompt's application to the storage runs without the store's lock,
 * its sequence detached from the pool (issue 16 §3; seq.h seq_detach):
 * while one thread creates 40,000-token h2o sequences, steps their prompt
 * (which evicts three quarters of each list and compacts the rest into
 * fresh blocks) and releases them, another thread of the same pool finds
 * the lock free with a sequence detached, appends to and steps its own
 * sequence, and takes snapshots whose pool blocks add up (free, and every
 * sequence's): a snapshot waits for the detached sequence, whose reserve
 * is neither free nor in its lists yet.
 */
static void test_application_without_the_lock(void **state)
{
    fixture *f = *state;
    beside_application c = {.f = f};
    const char *wkeys[] = {"n_sink", "window"}, *wvalues[] = {"4", "16"};
    c.own_id = make_seq(f, "streaming", wkeys, wvalues, 2);
    pthread_t other;
    assert_int_equal(pthread_create(&other, NULL, step_beside_application, &c), 0);
    const char *keys[] = {"budget", "recent"}, *values[] = {"10000", "8"};
    int prompts = 0;
    for (; prompts < 200 && (atomic_load(&c.saw_detached) == 0 || atomic_load(&c.snapshots) < 20);
         prompts++) {
        uint64_t id = make_seq(f, "h2o", keys, values, 2);
        store_table w;
        append(f, id, 40000, 0, &w);
        uint64_t ack = w.epoch;
        store_table_free(&w);
        unsigned arrays;
        size_t n;
        pthread_mutex_lock(&f->st->lock); /* the other thread takes snapshots */
        float *x = stats_for(f, id, &arrays, &n);
        pthread_mutex_unlock(&f->st->lock);
        seq_step_input in = prompt_input(arrays, x, n);
        status s;
        uint64_t epoch;
        uint32_t evicted, freed;
        if (store_step(f->st, f->token, id, ack, &in, NULL, NULL, &epoch, &evicted, &s) != ST_OK)
            fail_msg("prompt %d: %s", prompts, s.msg);
        free(x);
        assert_int_equal(evicted, 2 * (40000 - 10000));
        assert_int_equal(store_seq_release(f->st, f->token, id, &freed, &s), ST_OK);
    }
    atomic_store(&c.done, 1);
    assert_int_equal(pthread_join(other, NULL), 0);
    assert_true(c.saw_detached > 0);
    assert_int_equal(c.unbalanced, 0);
    assert_int_equal(c.own_failures, 0);
    assert_true(c.own_steps > 0);
    assert_true(snapshot_balanced(f->st));
    /* Each prompt's application ran detached: no sequence needed the lock
     * after all. */
    assert_int_equal(f->st->detached_retries, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_append_assigns_fresh_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_streaming_keeps_exactly_sinks_and_window, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_evicted_blocks_retire_until_ack, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pool_full_changes_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_counts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sessions_and_ownership, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reclaim_frees_everything, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_geometry_and_policy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_demotion_after_the_reply, setup, teardown),
        cmocka_unit_test_setup_teardown(test_demotion_after_the_reply, setup_background, teardown),
        cmocka_unit_test_setup_teardown(test_decision_without_the_lock, setup_large, teardown),
        cmocka_unit_test_setup_teardown(test_decision_without_the_lock, setup_background_large,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_application_without_the_lock, setup_large, teardown),
        cmocka_unit_test_setup_teardown(test_application_without_the_lock, setup_background_large,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_revive_in_background, setup_background, teardown),
        cmocka_unit_test_setup_teardown(test_int8_victims_give_way_under_pressure, setup_small,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
