/*
 * Unit tests of daemon/seq.h on its own: a pool made directly (pool.h) and
 * a policy from the registry, no store. What seq.h promises: fresh,
 * never-reused slots for appended tokens and their segments per list; one
 * epoch per change; a refused append changes nothing; emptied blocks wait
 * in the retired list until an ack at or after their epoch; per-head lists;
 * step statistics checked before anything changes; INT8 demotion in whole
 * INT8 blocks with values inside POLICIES.md §5.4's bound, and an
 * operator's eviction that re-quantises the INT8 survivors; Revive of
 * offloaded victims into blocks the caller owns; seq_destroy returning
 * every block. K/V go into the pool and come back through the pool's ops
 * (kernels/ops.h), so the same tests run on the shadow backend, where a
 * direct access to pool memory faults.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>

#include "backend.h"
#include "helper.h"
#include "seq_harness.h"
#include "migrate.h"
#include "pool.h"
#include "seq.h"
#include "tier.h"
#include "weightedkv.h"
/* White-box, in test_append_check (positions near 2^32 cannot be reached
 * by appending in a unit test's time) and test_sketch_undo (a call's
 * journal of sketch cells, which no call makes in both forms by itself). */
#include "seq_internal.h"

/* 2 layers, 4 query heads over 2 KV heads, head_dim 8, 4 tokens a block,
 * fp32: 512-byte blocks, 12 INT8 tokens a block (all-heads lists). */
static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};
#define BLOCK_BYTES 512
#define HD 8
#define MAX_LISTS 4 /* layers x kv_heads */

typedef struct fx {
    pool *p;
    seq *s;
    const kv_ops *ops;
    tier_ctx tier;   /* a list's storage as seq lays it out, for reading back */
    uint32_t heads;  /* lists per layer */
    uint32_t lheads; /* KV heads in one list's block: kv_heads, or 1 per head */
} fx;

/* Threads the next fx_open's sequence decides its layers on, from any
 * number of tokens (pool.h policy_threads); 0: one. */
static uint32_t g_policy_threads;

/* A pool of `blocks` blocks on backend b and a sequence of `policy` with
 * key/value pairs kv[0..2 * npairs). */
static void fx_open(fx *f, const backend *b, uint32_t blocks, const char *policy,
                    const char *const *kv, size_t npairs)
{
    memset(f, 0, sizeof *f);
    status st;
    pool_geometry g = geom;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    if (pool_create(1, "m", &g, (size_t)blocks * BLOCK_BYTES, b, &f->p, &st) != ST_OK)
        fail_msg("pool_create: %s", st.msg);
    assert_ptr_equal(f->p->backend, b);
    /* On shadow the arena's address is a PROT_NONE stand-in: reading it
     * directly would fault, only the ops reach the bytes. */
    assert_int_equal(kv_shadow_real(f->p->base) != NULL, b == &backend_shadow);
    assert_int_equal(f->p->block_bytes, BLOCK_BYTES);
    assert_int_equal(f->p->block_count, blocks);
    f->p->policy_threads = g_policy_threads;
    f->p->policy_parallel_tokens = 0;
    const policy_ops *ops = policy_find(policy);
    assert_non_null(ops);
    const char *keys[8], *values[8];
    assert_true(npairs <= 8);
    for (size_t i = 0; i < npairs; i++) {
        keys[i] = kv[2 * i];
        values[i] = kv[2 * i + 1];
    }
    policy_params pp;
    char err[POLICY_ERR_LEN];
    if (policy_params_resolve(ops, keys, values, npairs, &pp, err, sizeof err) != 0)
        fail_msg("policy_params_resolve: %s", err);
    if (seq_create(7, 3, f->p, ops, &pp, "unit", &f->s, &st) != ST_OK)
        fail_msg("seq_create: %s", st.msg);
    f->ops = f->p->backend->ops;
    f->heads = seq_heads(f->s);
    kv_layout ll = f->p->layout;
    if (f->heads > 1) { /* seq.h: a per-head list's block holds rows of its one head */
        ll.block_tokens *= ll.kv_heads;
        ll.kv_heads = 1;
    }
    f->lheads = ll.kv_heads;
    assert_int_equal(
        tier_ctx_init(&f->tier, f->ops, f->p->base, f->p->block_bytes, &ll, (kv_dtype)g.dtype), 0);
}

/* seq_destroy gives every block back (held, retired, victims). */
static void fx_close(fx *f)
{
    seq_destroy(f->s);
    assert_int_equal(f->p->nfree, f->p->block_count);
    pool_destroy(f->p);
}

static size_t nlists(const fx *f)
{
    return (size_t)seq_layers(f->s) * f->heads;
}

/* Channel c of KV head h of position p in layer l, K (kv 0) or V (kv 1):
 * a different value for every index, so a token read from the wrong slot,
 * head, layer or half is far off; channel c stays within 1 + c, so INT8
 * groups have different scales. */
static float value_of(uint32_t p, uint32_t l, uint32_t h, uint32_t c, int kv)
{
    return (float)((1.0 + c) * sin(0.7 * p + 1.3 * h + 0.5 * c + 2.1 * l + 0.9 * kv));
}

/* Write the K/V of the tokens at positions first.. of list i into the
 * slots segs names, through the pool's ops. */
static void write_tokens(fx *f, size_t i, uint64_t first, const kv_segment *segs, size_t nsegs)
{
    uint32_t l = (uint32_t)(i / f->heads), k = (uint32_t)(i % f->heads);
    size_t n = kv_segments_tokens(segs, nsegs), half = n * f->lheads * HD;
    if (n == 0)
        return;
    float *host = malloc(2 * half * sizeof *host);
    assert_non_null(host);
    for (int part = 0; part < 2; part++)
        for (uint32_t hh = 0; hh < f->lheads; hh++)
            for (size_t t = 0; t < n; t++)
                for (uint32_t c = 0; c < HD; c++)
                    host[part * half + (hh * n + t) * HD + c] =
                        value_of((uint32_t)(first + t), l, f->heads == 1 ? hh : k, c, part);
    uint8_t *dev = f->ops->alloc(2 * half * sizeof *host);
    assert_non_null(dev);
    assert_int_equal(f->ops->copy(KV_HOST_TO_DEVICE, dev, host, 2 * half * sizeof *host), 0);
    assert_int_equal(
        f->ops->scatter(&f->tier.l, f->p->base, segs, nsegs, dev, dev + half * sizeof *host), 0);
    f->ops->free(dev);
    free(host);
}

/* n stored tokens (FULL or INT8) read back through tier_read and the
 * ops: K then V, each [lheads][n][head_dim]; malloc'd. */
static float *read_tokens(fx *f, const tier_token *tok, size_t n)
{
    size_t bytes = n * tier_token_bytes(&f->tier);
    uint8_t *stage = tier_stage_alloc(&f->tier, n);
    float *host = malloc(bytes);
    assert_non_null(stage);
    assert_non_null(host);
    assert_int_equal(tier_read(&f->tier, tok, n, stage, stage + bytes / 2), 0);
    assert_int_equal(f->ops->copy(KV_DEVICE_TO_HOST, host, stage, bytes), 0);
    tier_stage_free(&f->tier, stage);
    return host;
}

/* The error bound of one quantisation of channel c of a K (kv 0) or V row
 * in tier t (0 at full precision). INT8: POLICIES.md §5.4, s / 2 with s =
 * max|group| / 127 <= (1 + c) / 127. INT4 / INT2 (kernels.h "Low-bit
 * tiers"): s / 2 with s = the group's range / L, rounded up in fp16; a K
 * group is one channel over tokens, |value| <= 1 + c, a V group a token's
 * 8 channels, |value| <= 8. */
static double tier_bound(uint8_t t, int kv, uint32_t c)
{
    if (t == POLICY_INT8)
        return (1.0 + c) / 254.0;
    if (t != POLICY_INT4 && t != POLICY_INT2)
        return 0;
    double levels = t == POLICY_INT4 ? 15 : 3, range = kv ? 16.0 : 2.0 * (1 + c);
    return range / levels / 2 * (1 + 1.0 / 512);
}

/* Check n tokens of list (l, k) as read_tokens returned them against the
 * values written for positions pos: exact at full precision, else within
 * tier_bound (a little float slack) per quantisation: `rounds` of them
 * (re-quantised tokens: 2, the second's group max grown by the first's
 * error). */
static void check_values(const fx *f, uint32_t l, uint32_t k, const float *kv, const uint32_t *pos,
                         const uint8_t *tier, size_t n, int rounds)
{
    double per = (rounds + (rounds - 1) / 254.0) * (1 + 1e-5);
    size_t half = n * f->lheads * HD;
    for (int part = 0; part < 2; part++)
        for (uint32_t hh = 0; hh < f->lheads; hh++)
            for (size_t i = 0; i < n; i++)
                for (uint32_t c = 0; c < HD; c++) {
                    uint32_t h = f->heads == 1 ? hh : k;
                    float want = value_of(pos[i], l, h, c, part);
                    float got = kv[part * half + (hh * n + i) * HD + c];
                    double bound = tier_bound(tier[i], part, c) * per;
                    if (fabs((double)got - want) > bound)
                        fail_msg("layer %u head %u position %u channel %u %s: got %g, want %g "
                                 "(tier %u)",
                                 l, h, pos[i], c, part ? "V" : "K", got, want, tier[i]);
                }
}

/* List (l, k) as stored, checked to have its segments cover exactly its
 * tokens, none in the sketch: the tokens read back (read_tokens) and each
 * one's tier (*tier), malloc'd; NULL when it holds none. */
static float *list_read(fx *f, uint32_t l, uint32_t k, seq_list_view *v, uint8_t **tier)
{
    seq_list_view_get(f->s, l, k, v);
    assert_int_equal(kv_segments_tokens(v->segs, v->nsegs), v->tokens);
    *tier = NULL;
    if (v->tokens == 0)
        return NULL;
    tier_token *tok = malloc(v->tokens * sizeof *tok);
    *tier = malloc(v->tokens);
    assert_non_null(tok);
    assert_non_null(*tier);
    uint32_t t = 0;
    for (size_t i = 0; i < v->nsegs; i++) {
        assert_int_not_equal(v->seg_tier[i], POLICY_SKETCH);
        for (uint32_t j = 0; j < v->segs[i].count; j++, t++) {
            tok[t] = (tier_token){v->segs[i].block, v->segs[i].first_slot + j, v->seg_tier[i]};
            (*tier)[t] = v->seg_tier[i];
        }
    }
    float *kv = read_tokens(f, tok, v->tokens);
    free(tok);
    return kv;
}

/* Every token of the list reads back what was written for its position
 * (list_read; quantised ones within the bound of `rounds` quantisations).
 * Returns the quantised tokens. */
static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* The list's blocks_at_most, when known, is at least the distinct blocks
 * its segments use (seq_internal.h: an eviction trusts it to rule out a
 * due compaction). */
static void check_blocks_bound(fx *f, uint32_t l, uint32_t k)
{
    const seq_list *ly = seq_list_at(f->s, l, k);
    if (ly->blocks_at_most == SEQ_BLOCKS_UNKNOWN || ly->nsegs == 0)
        return;
    uint32_t *b = malloc(ly->nsegs * sizeof *b);
    assert_non_null(b);
    size_t n = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        if (ly->seg_tier[i] != POLICY_SKETCH)
            b[n++] = ly->segs[i].block;
    qsort(b, n, sizeof *b, cmp_u32);
    uint32_t distinct = 0;
    for (size_t i = 0; i < n; i++)
        distinct += i == 0 || b[i] != b[i - 1];
    free(b);
    if (distinct > ly->blocks_at_most)
        fail_msg("layer %u list %u: segments use %u blocks, blocks_at_most says %u", l, k, distinct,
                 ly->blocks_at_most);
}

static uint32_t check_list_rounds(fx *f, uint32_t l, uint32_t k, int rounds)
{
    check_blocks_bound(f, l, k);
    seq_list_view v;
    uint8_t *tier;
    float *kv = list_read(f, l, k, &v, &tier);
    uint32_t nq = 0;
    for (uint32_t t = 0; t < v.tokens; t++)
        nq += policy_tier_quantised(tier[t]);
    if (v.tokens > 0)
        check_values(f, l, k, kv, v.positions, tier, v.tokens, rounds);
    free(kv);
    free(tier);
    return nq;
}

static uint32_t check_list(fx *f, uint32_t l, uint32_t k)
{
    return check_list_rounds(f, l, k, 1);
}

/* One seq_append's writes[] with room for `count` segments per list. */
typedef struct batch {
    kv_segment *segs[MAX_LISTS];
    size_t n[MAX_LISTS];
    uint32_t evicted;
} batch;

static void batch_free(batch *b)
{
    for (size_t i = 0; i < MAX_LISTS; i++)
        free(b->segs[i]);
}

/* seq_append, then the new tokens' K/V written where writes[] says. */
static status_code append_batch(fx *f, int64_t count, batch *b, status *st)
{
    memset(b, 0, sizeof *b);
    size_t room = count > 0 && count <= SEQ_MAX_APPEND ? (size_t)count : 1;
    assert_true(nlists(f) <= MAX_LISTS);
    for (size_t i = 0; i < nlists(f); i++)
        assert_non_null(b->segs[i] = malloc(room * sizeof *b->segs[i]));
    uint64_t first = seq_appended(f->s);
    status_code rc = seq_append(f->s, count, b->segs, b->n, &b->evicted, st);
    for (size_t i = 0; rc == ST_OK && i < nlists(f); i++)
        write_tokens(f, i, first, b->segs[i], b->n[i]);
    return rc;
}

/* Append that must succeed; returns the tokens evicted. */
static uint32_t append(fx *f, int64_t count)
{
    batch b;
    status st;
    if (append_batch(f, count, &b, &st) != ST_OK)
        fail_msg("append %lld: %s", (long long)count, st.msg);
    batch_free(&b);
    return b.evicted;
}

static void assert_seg(const kv_segment *s, uint32_t block, uint32_t first, uint32_t count)
{
    assert_int_equal(s->block, block);
    assert_int_equal(s->first_slot, first);
    assert_int_equal(s->count, count);
}

/* Full policy: appends fill the tail block's never-written slots, then
 * fresh blocks, one list's blocks never another's; writes[] are the new
 * tokens' segments, the list's segments are all of them, one epoch each. */
static void test_append_writes_and_segments(void **state)
{
    fx f;
    fx_open(&f, backend_of(state), 64, "full", NULL, 0);
    assert_int_equal(seq_id_of(f.s), 7);
    assert_int_equal(seq_session_id(f.s), 3);
    assert_ptr_equal(seq_pool(f.s), f.p);
    assert_string_equal(seq_policy(f.s)->name, "full");
    assert_string_equal(seq_label(f.s), "unit");
    assert_int_equal(seq_layers(f.s), 2);
    assert_int_equal(seq_heads(f.s), 1);
    assert_int_equal(seq_epoch(f.s), 0);
    batch b;
    status st;
    /* Nothing to revive yet, said as such (its ranges once underflowed to
     * "positions 0..18446744073709551615"). */
    seq_revived none;
    assert_int_equal(seq_revive(f.s, &(seq_revive_request){0, 0, 0, 0, 0, 0}, &none, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "no position yet"));
    assert_null(none.blocks);
    assert_int_equal(f.p->nfree, 64);
    assert_int_equal(append_batch(&f, 6, &b, &st), ST_OK);
    assert_int_equal(b.evicted, 0);
    assert_int_equal(seq_epoch(f.s), 1);
    assert_int_equal(seq_appended(f.s), 6);
    uint32_t blk[2][3];
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(b.n[l], 2);
        blk[l][0] = b.segs[l][0].block;
        blk[l][1] = b.segs[l][1].block;
        assert_seg(&b.segs[l][0], blk[l][0], 0, 4);
        assert_seg(&b.segs[l][1], blk[l][1], 0, 2);
    }
    batch_free(&b);
    assert_int_equal(f.p->nfree, 60);
    assert_int_equal(append_batch(&f, 3, &b, &st), ST_OK);
    assert_int_equal(seq_epoch(f.s), 2);
    for (uint32_t l = 0; l < 2; l++) {
        /* The tail's slots 2 and 3, then slot 0 of a new block. */
        assert_int_equal(b.n[l], 2);
        assert_seg(&b.segs[l][0], blk[l][1], 2, 2);
        blk[l][2] = b.segs[l][1].block;
        assert_seg(&b.segs[l][1], blk[l][2], 0, 1);
    }
    batch_free(&b);
    assert_int_equal(f.p->nfree, 58);
    /* Six distinct blocks over the two layers. */
    for (int i = 0; i < 6; i++)
        for (int j = i + 1; j < 6; j++)
            assert_int_not_equal(blk[i / 3][i % 3], blk[j / 3][j % 3]);
    for (uint32_t l = 0; l < 2; l++) {
        seq_list_view v;
        seq_list_view_get(f.s, l, 0, &v);
        assert_int_equal(v.tokens, 9);
        for (uint32_t p = 0; p < 9; p++)
            assert_int_equal(v.positions[p], p);
        /* Runs in one block merge: 4 + 4 + 1. */
        assert_int_equal(v.nsegs, 3);
        assert_seg(&v.segs[0], blk[l][0], 0, 4);
        assert_seg(&v.segs[1], blk[l][1], 0, 4);
        assert_seg(&v.segs[2], blk[l][2], 0, 1);
        assert_int_equal(v.noffloaded, 0);
        assert_int_equal(seq_list_blocks(f.s, l, 0), 3);
        const uint32_t *pos;
        assert_int_equal(seq_list_tokens(f.s, l, 0, &pos), 9);
        assert_ptr_equal(pos, v.positions);
        assert_int_equal(check_list(&f, l, 0), 0);
    }
    assert_int_equal(seq_blocks_held(f.s), 6);
    assert_int_equal(seq_tokens_held(f.s), 18);
    assert_int_equal(seq_retired_count(f.s), 0);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_FULL], 18);
    assert_int_equal(tokens[POLICY_INT8] + tokens[POLICY_SKETCH], 0);
    assert_int_equal(bytes[POLICY_FULL], 6 * BLOCK_BYTES);
    assert_int_equal(bytes[POLICY_INT8] + bytes[POLICY_SKETCH], 0);
    fx_close(&f);
}

/* Whether any segment of any list uses block b. */
static int block_in_lists(fx *f, uint32_t b)
{
    for (uint32_t l = 0; l < seq_layers(f->s); l++)
        for (uint32_t k = 0; k < f->heads; k++) {
            seq_list_view v;
            seq_list_view_get(f->s, l, k, &v);
            for (size_t i = 0; i < v.nsegs; i++)
                if (v.segs[i].block == b)
                    return 1;
        }
    return 0;
}

/* Whether a list's segments or a victim kept in the pool (victims=int8:
 * at full precision until a block's worth is quantised) use block b. */
static int block_in_use(fx *f, uint32_t b)
{
    for (size_t i = 0; i < nlists(f); i++) {
        const seq_list *ly = &f->s->lists[i];
        for (size_t j = 0; j < ly->noffloaded; j++)
            if (ly->offloaded_at[j].tier != POLICY_SKETCH && ly->offloaded_at[j].block == b)
                return 1;
    }
    return block_in_lists(f, b);
}

/*
 * Streaming (2 sinks, window 6), one token an append, the worker acking
 * two epochs late: each append is one epoch; the list holds exactly the
 * sinks, the window and the new token, and reads back the values written
 * for those positions (eviction and compaction moved the right bytes); a
 * new token never gets a slot that held a token, unless its block went back
 * to the pool through an ack; retired blocks carry the epoch that emptied
 * them, hold no list's token, and return to the pool only with an ack at or
 * after that epoch; held (retired included) plus free blocks are the pool.
 */
static void test_streaming_fresh_slots_retire_ack(void **state)
{
    enum { SINKS = 2, WINDOW = 6, BLOCKS = 64, SLOTS = 4 };
    const char *const kv[] = {"n_sink", "2", "window", "6"};
    fx f;
    fx_open(&f, backend_of(state), BLOCKS, "streaming", kv, 2);
    uint8_t used[BLOCKS][SLOTS] = {{0}};
    uint64_t acked = 0, retired_total = 0, freed_total = 0;
    for (uint32_t T = 1; T <= 60; T++) {
        uint64_t held_before = seq_tokens_held(f.s), e = seq_epoch(f.s) + 1;
        size_t nretired_before = seq_retired_count(f.s);
        batch b;
        status st;
        assert_int_equal(append_batch(&f, 1, &b, &st), ST_OK);
        assert_int_equal(seq_epoch(f.s), e);
        assert_int_equal(seq_appended(f.s), T);
        for (size_t i = 0; i < 2; i++) {
            assert_int_equal(b.n[i], 1);
            assert_int_equal(b.segs[i][0].count, 1);
            uint32_t blk = b.segs[i][0].block, slot = b.segs[i][0].first_slot;
            assert_true(blk < BLOCKS && slot < SLOTS);
            if (used[blk][slot])
                fail_msg("T=%u: slot %u of block %u handed out again", T, slot, blk);
        }
        assert_int_equal(b.evicted, held_before + 2 - seq_tokens_held(f.s));
        batch_free(&b);
        for (uint32_t l = 0; l < 2; l++) {
            seq_list_view v;
            seq_list_view_get(f.s, l, 0, &v);
            /* The step of tokens < T-1 ended at this append: sinks, the
             * window of those, and the new token T-1. */
            uint32_t want = 0;
            for (uint32_t p = 0; p < T; p++)
                if (p < SINKS || p + WINDOW >= T - 1) {
                    assert_true(want < v.tokens);
                    assert_int_equal(v.positions[want++], p);
                }
            assert_int_equal(v.tokens, want);
            check_list(&f, l, 0);
            for (size_t i = 0; i < v.nsegs; i++)
                for (uint32_t j = 0; j < v.segs[i].count; j++)
                    used[v.segs[i].block][v.segs[i].first_slot + j] = 1;
        }
        const seq_retired *r;
        size_t nr = seq_retired_blocks(f.s, &r);
        assert_int_equal(nr, seq_retired_count(f.s));
        assert_true(nr >= nretired_before);
        for (size_t i = 0; i < nr; i++) {
            assert_true(r[i].epoch > acked && r[i].epoch <= e);
            assert_int_equal(r[i].epoch == e, i >= nretired_before); /* new ones: this epoch */
            assert_false(block_in_lists(&f, r[i].block));
        }
        retired_total += nr - nretired_before;
        assert_int_equal(f.p->nfree + seq_blocks_held(f.s), BLOCKS);
        if (e < 3)
            continue;
        /* The worker acks e - 2: exactly the blocks retired at or before
         * it come back (and may be handed out again). */
        uint64_t ack = e - 2;
        uint32_t nfree = f.p->nfree;
        seq_ack(f.s, acked); /* an ack already seen frees nothing more */
        assert_int_equal(f.p->nfree, nfree);
        nr = seq_retired_blocks(f.s, &r);
        size_t due = 0;
        for (size_t i = 0; i < nr; i++)
            if (r[i].epoch <= ack) {
                memset(used[r[i].block], 0, SLOTS);
                due++;
            }
        seq_ack(f.s, ack);
        assert_int_equal(f.p->nfree, nfree + due);
        assert_int_equal(seq_retired_count(f.s), nr - due);
        freed_total += due;
        acked = ack;
    }
    /* The run retired and freed blocks: the checks above saw both. */
    assert_true(retired_total >= 10);
    assert_true(freed_total >= 8);
    /* Bounded: the sinks' block and the window's (with the tail), per layer. */
    assert_true(seq_blocks_held(f.s) <= 2 * 4 + seq_retired_count(f.s));
    fx_close(&f);
}

/* A refused append changes nothing: the pool lacks blocks (the tail's free
 * slots count), the epoch, tokens and free blocks stay; the exact fit
 * passes. With streaming, the step that ends at the append still happens
 * (its evictions are a change: one epoch), and its retired blocks are not
 * free until acked. */
static void test_append_exhausted_changes_nothing(void **state)
{
    fx f;
    fx_open(&f, backend_of(state), 10, "full", NULL, 0);
    append(&f, 6); /* 2 blocks a layer, 2 free slots in each tail */
    assert_int_equal(f.p->nfree, 6);
    batch b;
    status st;
    /* 15 more: 2 in the tail, 13 need 4 blocks a layer, 8 > 6. */
    assert_int_equal(append_batch(&f, 15, &b, &st), ST_RESOURCE_EXHAUSTED);
    batch_free(&b);
    assert_non_null(strstr(st.msg, "needs 8 free blocks"));
    assert_int_equal(seq_epoch(f.s), 1);
    assert_int_equal(seq_appended(f.s), 6);
    assert_int_equal(seq_tokens_held(f.s), 12);
    assert_int_equal(seq_blocks_held(f.s), 4);
    assert_int_equal(f.p->nfree, 6);
    /* 14: exactly the 6 free blocks. */
    assert_int_equal(append(&f, 14), 0);
    assert_int_equal(seq_epoch(f.s), 2);
    assert_int_equal(f.p->nfree, 0);
    assert_int_equal(append_batch(&f, 1, &b, &st), ST_RESOURCE_EXHAUSTED);
    batch_free(&b);
    assert_int_equal(seq_epoch(f.s), 2);
    assert_int_equal(seq_appended(f.s), 20);
    for (uint32_t l = 0; l < 2; l++)
        check_list(&f, l, 0);
    fx_close(&f);

    const char *const kv[] = {"n_sink", "0", "window", "4"};
    fx_open(&f, backend_of(state), 6, "streaming", kv, 2);
    append(&f, 4);
    append(&f, 4); /* its step keeps all 4 */
    assert_int_equal(f.p->nfree, 2);
    /* The step of 8 evicts the first block of each layer (retired, not
     * free); then 9 tokens need 3 blocks a layer: refused. */
    assert_int_equal(append_batch(&f, 9, &b, &st), ST_RESOURCE_EXHAUSTED);
    batch_free(&b);
    assert_int_equal(b.evicted, 8);
    assert_int_equal(seq_epoch(f.s), 3);
    assert_int_equal(seq_appended(f.s), 8);
    assert_int_equal(seq_tokens_held(f.s), 8);
    assert_int_equal(seq_retired_count(f.s), 2);
    assert_int_equal(f.p->nfree, 2);
    seq_ack(f.s, 2);
    assert_int_equal(f.p->nfree, 2);
    seq_ack(f.s, 3);
    assert_int_equal(f.p->nfree, 4);
    /* The step already ran: 8 more need 2 blocks a layer and evict nothing. */
    assert_int_equal(append(&f, 8), 0);
    assert_int_equal(f.p->nfree, 0);
    /* A Revive needs blocks too: refused, nothing taken. */
    seq_revived out;
    memset(&out, 0xff, sizeof out);
    assert_int_equal(seq_revive(f.s, &(seq_revive_request){0, 0, 0, 0, 1, 0}, &out, &st),
                     ST_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(st.msg, "reviving 12 tokens needs 3 free blocks"));
    assert_null(out.blocks);
    assert_int_equal(out.nblocks, 0);
    assert_int_equal(f.p->nfree, 0);
    for (uint32_t l = 0; l < 2; l++)
        check_list(&f, l, 0);
    fx_close(&f);
}

/* seq_append_check's limits: 1 .. SEQ_MAX_APPEND tokens, positions below
 * 2^32; seq_append refuses the same and changes nothing. */
static void test_append_check(void **state)
{
    fx f;
    fx_open(&f, backend_of(state), 16, "full", NULL, 0);
    status st;
    const int64_t bad[] = {0, -1, SEQ_MAX_APPEND + 1, INT64_MIN, INT64_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(seq_append_check(f.s, bad[i], &st), ST_INVALID_ARGUMENT);
        assert_non_null(strstr(st.msg, "count must be between 1 and 65536"));
        batch b;
        assert_int_equal(append_batch(&f, bad[i], &b, &st), ST_INVALID_ARGUMENT);
        batch_free(&b);
    }
    assert_int_equal(seq_epoch(f.s), 0);
    assert_int_equal(seq_appended(f.s), 0);
    assert_int_equal(f.p->nfree, 16);
    assert_int_equal(seq_append_check(f.s, 1, &st), ST_OK);
    assert_int_equal(seq_append_check(f.s, SEQ_MAX_APPEND, &st), ST_OK);
    /* Near the end of the positions: 2^32 - 1 of them in all. */
    f.s->appended = UINT32_MAX - 10;
    assert_int_equal(seq_append_check(f.s, 10, &st), ST_OK);
    assert_int_equal(seq_append_check(f.s, 11, &st), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "2^32-1"));
    f.s->appended = 0;
    fx_close(&f);
}

/* Window attention of a step before which every list holds n tokens:
 * [layer][q head][token]. Query heads 0, 1 (KV head 0) attend to tokens 0..3,
 * heads 2, 3 (KV head 1) to none in particular. */
static float *adakv_window_attn(uint32_t n, size_t *nfloats)
{
    *nfloats = (size_t)2 * 4 * n;
    float *a = malloc(*nfloats * sizeof *a);
    assert_non_null(a);
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t q = 0; q < 4; q++)
            for (uint32_t i = 0; i < n; i++)
                a[((size_t)l * 4 + q) * n + i] = q < 2 && i < 4 ? 1.0f : 0.01f;
    return a;
}

/* What seq_step must leave alone when it refuses a step. */
typedef struct seq_state_mark {
    uint64_t epoch, tokens;
    uint32_t nfree, held;
    size_t retired;
} seq_state_mark;

static seq_state_mark mark(fx *f)
{
    return (seq_state_mark){seq_epoch(f->s), seq_tokens_held(f->s), f->p->nfree,
                            seq_blocks_held(f->s), seq_retired_count(f->s)};
}

static void assert_unchanged(fx *f, seq_state_mark m)
{
    seq_state_mark now = mark(f);
    assert_int_equal(now.epoch, m.epoch);
    assert_int_equal(now.tokens, m.tokens);
    assert_int_equal(now.nfree, m.nfree);
    assert_int_equal(now.held, m.held);
    assert_int_equal(now.retired, m.retired);
}

/* A step seq_step refuses, and the words its message must hold. */
static void step_refused(fx *f, const seq_step_input *in, status_code want, const char *words)
{
    seq_state_mark m = mark(f);
    status st;
    uint32_t evicted = 99;
    assert_int_equal(seq_step(f->s, in, &evicted, &st), want);
    if (strstr(st.msg, words) == NULL)
        fail_msg("'%s' lacks '%s'", st.msg, words);
    assert_int_equal(evicted, 0);
    assert_unchanged(f, m);
}

/*
 * AdaKV decides per KV head: seq_heads is kv_heads, each (layer, head) is
 * its own list in its own blocks (rows of one head), seq_step_floats counts
 * each query head's row over its KV head's list, wrong statistics change
 * nothing, and after a step the heads hold different tokens, each reading
 * back its own head's values.
 */
static void test_per_head_lists_and_step_checks(void **state)
{
    const char *const kv[] = {"budget", "4", "window", "2", "kernel", "1"};
    fx f;
    fx_open(&f, backend_of(state), 64, "adakv", kv, 3);
    assert_int_equal(seq_heads(f.s), 2);
    assert_int_equal(nlists(&f), 4);
    batch b;
    status st;
    assert_int_equal(append_batch(&f, 12, &b, &st), ST_OK);
    /* A per-head block holds kv_heads x 4 = 8 rows: 8 + 4, 8 blocks in all. */
    uint32_t blocks[8];
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(b.n[i], 2);
        assert_int_equal(b.segs[i][0].count, 8);
        assert_int_equal(b.segs[i][1].count, 4);
        assert_int_equal(b.segs[i][1].first_slot, 0);
        blocks[2 * i] = b.segs[i][0].block;
        blocks[2 * i + 1] = b.segs[i][1].block;
    }
    batch_free(&b);
    for (int i = 0; i < 8; i++)
        for (int j = i + 1; j < 8; j++)
            assert_int_not_equal(blocks[i], blocks[j]);
    assert_int_equal(f.p->nfree, 56);
    assert_int_equal(seq_tokens_held(f.s), 48);
    /* Rows per layer: q_heads over 12 tokens, or kv_heads for vnorm. */
    assert_int_equal(seq_step_floats(f.s, POLICY_NEEDS_WINDOW_ATTN), 2 * 4 * 12);
    assert_int_equal(seq_step_floats(f.s, POLICY_NEEDS_VNORM), 2 * 2 * 12);
    assert_int_equal(seq_step_floats(f.s, POLICY_NEEDS_WINDOW_ATTN | POLICY_NEEDS_LAST_ATTN),
                     2 * 2 * 4 * 12);

    size_t nf;
    float *attn = adakv_window_attn(12, &nf);
    seq_step_input in = {.arrays = POLICY_NEEDS_WINDOW_ATTN,
                         .prefill = 1,
                         .window_queries = 2,
                         .confidence = -1.0,
                         .data = attn,
                         .nfloats = nf};
    seq_step_input bad = in;
    bad.arrays = 0;
    bad.data = NULL;
    bad.nfloats = 0;
    step_refused(&f, &bad, ST_FAILED_PRECONDITION, "needs 'window_attn'");
    bad = in;
    bad.nfloats = nf - 1;
    step_refused(&f, &bad, ST_INVALID_ARGUMENT, "hold 95 floats; the layers' token lists need 96");
    bad = in;
    bad.arrays |= POLICY_NEEDS_SCORE;
    step_refused(&f, &bad, ST_INVALID_ARGUMENT, "one list per KV head");
    bad = in;
    bad.new_tokens = 13;
    step_refused(&f, &bad, ST_INVALID_ARGUMENT, "only 12 tokens were appended");
    bad = in;
    bad.confidence = 1.5;
    step_refused(&f, &bad, ST_INVALID_ARGUMENT, "confidence");
    attn[nf - 1] = NAN;
    step_refused(&f, &in, ST_INVALID_ARGUMENT, "non-finite value at float 95");
    /* Statistics in shared memory (the ring's): each layer's part copied
     * and checked before its step (test_policy_host checks when), refused
     * by the same message, and nothing changes. */
    float *copy = malloc(nf * sizeof *copy);
    assert_non_null(copy);
    in.copy = copy;
    step_refused(&f, &in, ST_INVALID_ARGUMENT, "non-finite value at float 95");
    attn[nf - 1] = 0.01f;
    float first = attn[0];
    attn[0] = INFINITY;
    step_refused(&f, &in, ST_INVALID_ARGUMENT, "non-finite value at float 0");
    attn[0] = first;

    uint32_t evicted;
    for (size_t i = 0; i < nf; i++)
        copy[i] = -1.0f;
    assert_int_equal(seq_step(f.s, &in, &evicted, &st), ST_OK);
    assert_memory_equal(copy, attn, nf * sizeof *copy); /* what the policy read */
    free(copy);
    free(attn);
    assert_int_equal(seq_epoch(f.s), 2);
    /* 4 x 2 = 8 tokens a layer kept: KV head 0 its attended 0..3, both
     * their observation window 10, 11; KV head 1 nothing more. */
    assert_int_equal(evicted, 2 * (24 - 8));
    static const uint32_t head0[] = {0, 1, 2, 3, 10, 11}, head1[] = {10, 11};
    for (uint32_t l = 0; l < 2; l++) {
        seq_list_view v;
        seq_list_view_get(f.s, l, 0, &v);
        assert_int_equal(v.tokens, 6);
        assert_memory_equal(v.positions, head0, sizeof head0);
        seq_list_view_get(f.s, l, 1, &v);
        assert_int_equal(v.tokens, 2);
        assert_memory_equal(v.positions, head1, sizeof head1);
        check_list(&f, l, 0);
        check_list(&f, l, 1);
    }
    /* Each query head's row is its KV head's list: 2 x 6 + 2 x 2 a layer. */
    assert_int_equal(seq_step_floats(f.s, POLICY_NEEDS_WINDOW_ATTN), 2 * (2 * 6 + 2 * 2));
    assert_int_equal(seq_step_floats(f.s, POLICY_NEEDS_VNORM), 2 * (6 + 2));
    /* KV head 1's first block (rows 0..7) emptied in each layer, retired
     * at epoch 2; KV head 0's 6 tokens still use both its blocks. */
    const seq_retired *r;
    size_t nr = seq_retired_blocks(f.s, &r);
    assert_int_equal(nr, 2);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(seq_list_blocks(f.s, l, 0), 2);
        assert_int_equal(seq_list_blocks(f.s, l, 1), 1);
    }
    for (size_t i = 0; i < nr; i++) {
        assert_int_equal(r[i].epoch, 2);
        assert_false(block_in_lists(&f, r[i].block));
    }
    assert_int_equal(f.p->nfree + seq_blocks_held(f.s), 64);
    seq_ack(f.s, 2);
    assert_int_equal(seq_retired_count(f.s), 0);
    assert_int_equal(f.p->nfree + seq_blocks_held(f.s), 64);
    fx_close(&f);
}

/*
 * int8=on, int8_window=4 with the full policy: the step over 20 tokens
 * decides all but the newest 4 INT8, and seq stores them in whole INT8
 * blocks (12 tokens each): positions 0..11 go to one INT8 block a layer,
 * 12..15 wait at full precision; the 3 blocks that held 0..11 are
 * retired. Every token reads back within POLICIES.md §5.4's bound.
 */
static void test_int8_demotion(void **state)
{
    const char *const kv[] = {"int8", "on", "int8_window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 64, "full", kv, 2);
    assert_int_equal(seq_block_tokens(f.s, POLICY_INT8), 12);
    append(&f, 20);
    assert_int_equal(append(&f, 1), 0); /* the step of the 20 ends here */
    assert_int_equal(seq_epoch(f.s), 2);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_FULL], 2 * 9);
    assert_int_equal(tokens[POLICY_INT8], 2 * 12);
    assert_int_equal(tokens[POLICY_SKETCH], 0);
    /* Full: 12..15 and 16..19 in their blocks, 20 in a new tail. */
    assert_int_equal(bytes[POLICY_FULL], 2 * 3 * BLOCK_BYTES);
    assert_int_equal(bytes[POLICY_INT8], 2 * BLOCK_BYTES);
    assert_int_equal(bytes[POLICY_SKETCH], 0);
    uint64_t moved[POLICY_TIERS];
    seq_moved_totals(f.s, moved);
    assert_int_equal(moved[POLICY_INT8], 24);
    assert_int_equal(moved[POLICY_SKETCH] + moved[POLICY_FULL], 0);
    const snapshot_tiers *rep = seq_tier_report(f.s);
    assert_int_equal(rep->moved[POLICY_INT8], 24);
    assert_true(rep->nobs >= 1);
    for (size_t i = 0; i < rep->nobs; i++) {
        assert_int_equal(rep->obs[i].kind, POLICY_INT8);
        assert_true(rep->obs[i].value > 0 && rep->obs[i].value <= 1.0 / 254 + 1e-6);
    }
    seq_tier_report_clear(f.s);
    assert_int_equal(seq_tier_report(f.s)->moved[POLICY_INT8], 0);
    assert_int_equal(seq_tier_report(f.s)->nobs, 0);
    seq_moved_totals(f.s, moved);
    assert_int_equal(moved[POLICY_INT8], 24); /* the lifetime total stays */
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t t[POLICY_TIERS];
        seq_list_tier_tokens(f.s, l, 0, t);
        assert_int_equal(t[POLICY_FULL], 9);
        assert_int_equal(t[POLICY_INT8], 12);
        seq_list_view v;
        seq_list_view_get(f.s, l, 0, &v);
        assert_int_equal(v.tokens, 21);
        for (uint32_t p = 0; p < 21; p++)
            assert_int_equal(v.positions[p], p);
        assert_int_equal(v.seg_tier[0], POLICY_INT8);
        assert_int_equal(v.segs[0].first_slot, 0);
        assert_int_equal(v.segs[0].count, 12);
        assert_int_equal(seq_list_blocks(f.s, l, 0), 4);
        assert_int_equal(check_list(&f, l, 0), 12);
    }
    const seq_retired *r;
    size_t nr = seq_retired_blocks(f.s, &r);
    assert_int_equal(nr, 6);
    for (size_t i = 0; i < nr; i++) {
        assert_int_equal(r[i].epoch, 2);
        assert_false(block_in_lists(&f, r[i].block));
    }
    /* 7 more (21..27), and the step over 0..27 at the next append decides
     * 12..23 INT8: the next whole INT8 block's worth. */
    append(&f, 7);
    assert_int_equal(append(&f, 1), 0);
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_INT8], 2 * 24);
    assert_int_equal(tokens[POLICY_FULL], 2 * 5);
    for (uint32_t l = 0; l < 2; l++)
        assert_int_equal(check_list(&f, l, 0), 24);
    fx_close(&f);
}

/* seq_step without statistics (full, streaming need none): the step an
 * Append would end, ended now; it must succeed. */
static void step_silent(fx *f)
{
    status st;
    uint32_t evicted;
    seq_step_input in = {.confidence = -1.0};
    if (seq_step(f->s, &in, &evicted, &st) != ST_OK)
        fail_msg("seq_step: %s", st.msg);
}

/* List l's count of its victims at full precision is right. */
static void check_full_victims(fx *f, uint32_t l)
{
    const seq_list *ly = seq_list_at(f->s, l, 0);
    size_t full = 0;
    for (size_t j = 0; j < ly->noffloaded; j++)
        full += ly->offloaded_at[j].tier == POLICY_FULL;
    assert_int_equal(ly->nfull_victims, full);
}

/* Sequences a and b hold the same: tokens and bytes by tier, moves,
 * retired blocks (with_epochs: and the epochs, theirs and the retired
 * blocks'), and per list the positions, tiers and values, bit for bit
 * (where the blocks lie may differ). */
static void assert_same_holdings(fx *a, fx *b, int with_epochs)
{
    if (with_epochs)
        assert_int_equal(seq_epoch(a->s), seq_epoch(b->s));
    uint64_t ta[POLICY_TIERS], ba[POLICY_TIERS], tb[POLICY_TIERS], bb[POLICY_TIERS];
    seq_tier_usage(a->s, ta, ba);
    seq_tier_usage(b->s, tb, bb);
    assert_memory_equal(ta, tb, sizeof ta);
    assert_memory_equal(ba, bb, sizeof ba);
    seq_moved_totals(a->s, ta);
    seq_moved_totals(b->s, tb);
    assert_memory_equal(ta, tb, sizeof ta);
    const seq_retired *ra, *rb;
    size_t nr = seq_retired_blocks(a->s, &ra);
    assert_int_equal(seq_retired_blocks(b->s, &rb), nr);
    for (size_t i = 0; with_epochs && i < nr; i++)
        assert_int_equal(ra[i].epoch, rb[i].epoch);
    assert_int_equal(seq_blocks_held(a->s), seq_blocks_held(b->s));
    for (uint32_t l = 0; l < seq_layers(a->s); l++) {
        seq_list_view va, vb;
        uint8_t *tier_a, *tier_b;
        float *kva = list_read(a, l, 0, &va, &tier_a), *kvb = list_read(b, l, 0, &vb, &tier_b);
        assert_int_equal(va.tokens, vb.tokens);
        assert_memory_equal(va.positions, vb.positions, va.tokens * sizeof *va.positions);
        assert_memory_equal(tier_a, tier_b, va.tokens);
        assert_memory_equal(kva, kvb, va.tokens * tier_token_bytes(&a->tier));
        free(kva), free(kvb), free(tier_a), free(tier_b);
    }
}

static void assert_same_seq(fx *a, fx *b)
{
    assert_same_holdings(a, b, 1);
}

/*
 * seq_set_demote_after_step (issue 16 §3): steps (seq_step) over the tokens
 * of test_int8_demotion quantise nothing; the demotion each leaves due runs in parts (blocks
 * others take between plan and fill change nothing it writes), and then
 * the sequence holds exactly what the same steps give when they demote
 * themselves. A failed fill leaves the pool's free stack as it was and the
 * tokens at full precision, still due.
 */
static void test_demotion_after_step(void **state)
{
    const char *const kv[] = {"int8", "on", "int8_window", "4"};
    fx in, f;
    fx_open(&in, backend_of(state), 64, "full", kv, 2);
    fx_open(&f, backend_of(state), 64, "full", kv, 2);
    seq_set_demote_after_step(f.s, 1);
    status st;
    seq_demote_job *job;
    for (int round = 0; round < 2; round++) {
        int64_t n = round == 0 ? 21 : 8;
        append(&in, n);
        step_silent(&in);
        append(&f, n);
        uint64_t appended = seq_epoch(f.s);
        step_silent(&f);
        /* The step only left the lists due: it changed no table, and the
         * demotion publishes the next epoch (store.c demote_due). */
        assert_int_equal(seq_epoch(f.s), appended);
        uint64_t at = appended + 1;
        uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
        seq_tier_usage(f.s, tokens, bytes);
        assert_int_equal(tokens[POLICY_INT8], (uint64_t)2 * 12 * round);
        uint32_t nfree = f.p->nfree;
        assert_int_equal(seq_demote_plan(f.s, at, &job, &st), ST_OK);
        assert_non_null(job);
        assert_int_equal(f.p->nfree, nfree - 2); /* one INT8 block per list */
        if (round == 1) {
            uint32_t *stack = malloc(nfree * sizeof *stack);
            assert_non_null(stack);
            assert_int_equal(seq_demote_finish(job, -1, &st), ST_RESOURCE_EXHAUSTED);
            assert_int_equal(f.p->nfree, nfree);
            memcpy(stack, f.p->free_stack, nfree * sizeof *stack);
            seq_tier_usage(f.s, tokens, bytes);
            assert_int_equal(tokens[POLICY_INT8], 2 * 12);
            assert_int_equal(seq_demote_plan(f.s, at, &job, &st), ST_OK);
            assert_non_null(job); /* still due */
            assert_int_equal(seq_demote_finish(job, -1, &st), ST_RESOURCE_EXHAUSTED);
            assert_memory_equal(f.p->free_stack, stack, nfree * sizeof *stack);
            free(stack);
            assert_int_equal(seq_demote_plan(f.s, at, &job, &st), ST_OK);
        }
        uint32_t other[3];
        for (int i = 0; i < 3; i++)
            assert_int_equal(pool_alloc_block(f.p, &other[i]), 0);
        assert_int_equal(seq_demote_finish(job, seq_demote_fill(job), &st), ST_OK);
        for (int i = 3; i-- > 0;)
            pool_free_block(f.p, other[i]);
        assert_same_seq(&in, &f);
        for (uint32_t l = 0; l < 2; l++)
            assert_int_equal(check_list(&f, l, 0), 12 * (round + 1));
        assert_int_equal(seq_demote_plan(f.s, seq_epoch(f.s), &job, &st), ST_OK);
        assert_null(job); /* nothing due */
    }
    assert_int_equal(seq_tier_report(f.s)->moved[POLICY_INT8], 48);
    fx_close(&in);
    fx_close(&f);
}

/*
 * demote=int4 and demote=int2: the same rule into low-bit blocks of 18 and
 * 27 tokens (fp32, 2 heads x 8 channels, 4-token pool blocks of 512 bytes;
 * kernels.h "Low-bit tiers"). 30 (int4) or 40 (int2) tokens with a window
 * of 4 leave one block's worth to demote at the step: those tokens become
 * that tier's, one pool block per list, and read back within the tier's
 * bound; the moves, the measured errors and the bytes are counted by tier.
 */
static void check_lowbit_demotion(void **state, const char *tier_name, uint8_t tier,
                                  uint32_t block_tokens, uint32_t appended)
{
    const char *const kv[] = {"demote", tier_name, "int8_window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 64, "full", kv, 2);
    assert_int_equal(seq_block_tokens(f.s, tier), block_tokens);
    append(&f, appended);
    assert_int_equal(append(&f, 1), 0); /* the step of the first batch ends here */
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS], moved[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[tier], 2 * block_tokens);
    assert_int_equal(tokens[POLICY_INT8], 0);
    assert_int_equal(tokens[POLICY_FULL], 2 * (appended + 1 - block_tokens));
    assert_int_equal(bytes[tier], 2 * BLOCK_BYTES);
    seq_moved_totals(f.s, moved);
    assert_int_equal(moved[tier], 2 * block_tokens);
    assert_int_equal(moved[POLICY_INT8] + moved[POLICY_FULL] + moved[POLICY_SKETCH], 0);
    const snapshot_tiers *rep = seq_tier_report(f.s);
    assert_true(rep->nobs >= 1);
    for (size_t i = 0; i < rep->nobs; i++) {
        assert_int_equal(rep->obs[i].kind, tier);
        /* half a step of a group (at most 8 / L), against the largest
         * |value| of a block's worth of tokens (above 4 here) */
        assert_true(rep->obs[i].value > 0 &&
                    rep->obs[i].value <= 8.0 / (tier == POLICY_INT4 ? 15 : 3) / 4);
    }
    for (uint32_t l = 0; l < 2; l++) {
        seq_list_view v;
        seq_list_view_get(f.s, l, 0, &v);
        assert_int_equal(v.seg_tier[0], tier);
        assert_int_equal(v.segs[0].count, block_tokens);
        assert_int_equal(check_list(&f, l, 0), block_tokens);
    }
    fx_close(&f);
}

static void test_int4_demotion(void **state)
{
    check_lowbit_demotion(state, "int4", POLICY_INT4, 18, 30);
}

static void test_int2_demotion(void **state)
{
    check_lowbit_demotion(state, "int2", POLICY_INT2, 27, 40);
}

/*
 * An operator's eviction (seq_policy_layer_step, the decision amended,
 * seq_apply_decision, seq_publish_epoch) with int8=on: 0..35 are three
 * INT8 blocks; keeping every third of them leaves 12 INT8 tokens spread
 * over 3 blocks, more than one block beyond the one they fill, so they are
 * re-quantised into one fresh block (POLICIES.md §5.4 "on compaction") and
 * the three are retired at the epoch; values stay within two
 * quantisations' bound.
 */
/* The full policy with int8=on, int8_window=2, over `blocks` pool blocks:
 * nq + 2 tokens appended and a step, so that each list holds nq INT8
 * tokens in whole INT8 blocks (nq a multiple of 12), then the report
 * cleared. */
static void open_demoted(fx *f, void **state, uint32_t blocks, uint32_t nq)
{
    const char *const kv[] = {"int8", "on", "int8_window", "2"};
    fx_open(f, backend_of(state), blocks, "full", kv, 2);
    append(f, nq + 2);
    append(f, 1); /* the step of the nq + 2 */
    uint32_t t[POLICY_TIERS];
    seq_list_tier_tokens(f->s, 0, 0, t);
    assert_int_equal(t[POLICY_INT8], nq);
    seq_tier_report_clear(f->s);
}

static void test_operator_evict_requantizes(void **state)
{
    fx f;
    open_demoted(&f, state, 64, 36); /* 0..35 in 3 INT8 blocks */
    const policy_decision *d;
    status st;
    assert_int_equal(seq_policy_layer_step(f.s, 0, &d, &st), ST_OK);
    for (uint32_t i = 0; i < 36; i++)
        if (i % 3 != 0)
            d->tier[0][i] = POLICY_EVICT;
    uint64_t epoch = seq_epoch(f.s) + 1;
    size_t evicted = 0;
    int changed = 0;
    assert_int_equal(seq_apply_decision(f.s, 0, d, epoch, &evicted, &changed, &st), ST_OK);
    seq_publish_epoch(f.s, epoch);
    assert_int_equal(evicted, 24);
    assert_true(changed);
    assert_int_equal(seq_epoch(f.s), epoch);
    assert_int_equal(seq_tier_report(f.s)->requantized, 12);
    seq_list_view v;
    seq_list_view_get(f.s, 0, 0, &v);
    assert_int_equal(v.tokens, 15); /* 0, 3, .., 33, and 36..38 */
    for (uint32_t i = 0; i < 12; i++)
        assert_int_equal(v.positions[i], 3 * i);
    /* The 12 in one INT8 block, slots 0..11. */
    assert_int_equal(v.seg_tier[0], POLICY_INT8);
    assert_seg(&v.segs[0], v.segs[0].block, 0, 12);
    assert_int_equal(check_list_rounds(&f, 0, 0, 2), 12);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(bytes[POLICY_INT8], (1 + 3) * BLOCK_BYTES); /* layer 1 keeps its 3 */
    const seq_retired *r;
    size_t nr = seq_retired_blocks(f.s, &r), at_epoch = 0;
    for (size_t i = 0; i < nr; i++)
        if (r[i].epoch == epoch) {
            at_epoch++;
            assert_false(block_in_lists(&f, r[i].block));
        }
    assert_true(at_epoch >= 3);
    assert_int_equal(f.p->nfree + seq_blocks_held(f.s), 64);
    fx_close(&f);
}

/* Read what a Revive rebuilt (full precision, list layout, in the caller's
 * blocks) and check it against the values written for its positions. */

/* The (block, slot) of every token of revive `out`, in order. */
static tier_token *revived_slots(const seq_revived *out)
{
    tier_token *tok = malloc((out->ntokens ? out->ntokens : 1) * sizeof *tok);
    assert_non_null(tok);
    size_t t = 0;
    for (size_t i = 0; i < out->nsegs; i++)
        for (uint32_t j = 0; j < out->segs[i].count; j++)
            tok[t++] = (tier_token){out->segs[i].block, out->segs[i].first_slot + j, POLICY_FULL};
    assert_int_equal(t, out->ntokens);
    return tok;
}

/* A Revive's tokens read back (read_tokens); NULL when it has no token. */
static float *revived_values(fx *f, const seq_revived *out)
{
    assert_int_equal(kv_segments_tokens(out->segs, out->nsegs), out->ntokens);
    if (out->ntokens == 0)
        return NULL;
    tier_token *tok = revived_slots(out);
    float *kv = read_tokens(f, tok, out->ntokens);
    free(tok);
    return kv;
}

static void check_revived(fx *f, uint32_t l, uint32_t k, const seq_revived *out)
{
    float *kv = revived_values(f, out);
    if (kv != NULL)
        check_values(f, l, k, kv, out->positions, out->src_tier, out->ntokens, 1);
    free(kv);
}

static void assert_revived_empty(const seq_revived *out)
{
    assert_null(out->segs);
    assert_null(out->positions);
    assert_null(out->blocks);
    assert_int_equal(out->ntokens + out->nsegs + out->nblocks, 0);
}

/* A revive that must succeed, its tokens checked; the caller frees it. */
static void revive_ok(fx *f, seq_revive_request req, seq_revived *out)
{
    status st;
    uint32_t nfree = f->p->nfree;
    if (seq_revive(f->s, &req, out, &st) != ST_OK)
        fail_msg("revive: %s", st.msg);
    assert_int_equal(out->nblocks, (out->ntokens + 3) / 4);
    assert_int_equal(f->p->nfree, nfree - out->nblocks);
    check_revived(f, req.layer, req.head, out);
}

/* Streaming (1 sink, window 3), victims=sketch with 4096 buckets, 12
 * tokens appended: 0 and 8..11 held, 1..7 offloaded to the sketch. */
static void open_sketch_victims(fx *f, void **state)
{
    const char *const kv[] = {"n_sink",  "1",      "window",         "3",
                              "victims", "sketch", "sketch_buckets", "4096"};
    fx_open(f, backend_of(state), 64, "streaming", kv, 4);
    for (int i = 0; i < 12; i++)
        append(f, 1);
}

/*
 * Streaming (1 sink, window 3) with victims=sketch and buckets enough that
 * 7 victims share no cell in two of three rows: a Revive of the whole list
 * rebuilds held tokens exactly and victims from the sketch (exactly here),
 * in position order, into blocks the caller owns; the sketch keeps them.
 * Bad requests are refused with *out zeroed and nothing taken.
 */
static void test_revive_sketch_victims(void **state)
{
    fx f;
    open_sketch_victims(&f, state);
    /* Held 0, 8..11; victims 1..7 offloaded. */
    seq_list_view v;
    seq_list_view_get(f.s, 1, 0, &v);
    assert_int_equal(v.tokens, 5);
    assert_int_equal(v.noffloaded, 7);
    for (uint32_t j = 0; j < 7; j++)
        assert_int_equal(v.offloaded[j], 1 + j);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_SKETCH], 2 * 7);
    assert_true(bytes[POLICY_SKETCH] > 0);
    uint32_t nfree = f.p->nfree;
    seq_revived a, b;
    revive_ok(&f, (seq_revive_request){1, 0, 0, 0, 0, 0}, &a);
    assert_int_equal(a.ntokens, 12);
    for (uint32_t p = 0; p < 12; p++) {
        assert_int_equal(a.positions[p], p);
        assert_int_equal(a.src_tier[p], p >= 1 && p <= 7 ? POLICY_SKETCH : POLICY_FULL);
    }
    /* The sketch is not changed: again, the same bytes. */
    revive_ok(&f, (seq_revive_request){1, 0, 3, 4, 0, 0}, &b);
    assert_int_equal(b.ntokens, 4);
    assert_int_equal(b.positions[0], 3);
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_SKETCH], 2 * 7);
    revived_free(f.p, &a);
    revived_free(f.p, &b);
    assert_int_equal(f.p->nfree, nfree);

    status st;
    const seq_revive_request bad[] = {
        {2, 0, 0, 0, 0, 0},  /* no layer 2 */
        {0, 1, 0, 0, 0, 1},  /* one list a layer */
        {0, 0, 12, 0, 0, 0}, /* past the end */
        {0, 0, 10, 3, 0, 1}, /* 10..12: 12 is not appended */
    };
    const char *said[] = {"does not exist", "does not exist",
                          "first position 12 is not in the sequence (positions 0..11 exist)",
                          "positions 10..12 are not in the sequence (positions 0..11 exist)"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&a, 0xff, sizeof a);
        assert_int_equal(seq_revive(f.s, &bad[i], &a, &st), ST_INVALID_ARGUMENT);
        assert_non_null(strstr(st.msg, said[i]));
        assert_revived_empty(&a);
        assert_int_equal(f.p->nfree, nfree);
    }
    fx_close(&f);
}

/*
 * seq_revive in parts, as the store runs it without its lock: blocks taken
 * from the pool between the plan and the fill (another sequence's step)
 * change nothing of what the fill writes, and a failed fill gives the
 * plan's blocks back so that the free stack is exactly as before.
 */
static void test_revive_in_parts(void **state)
{
    fx f;
    open_sketch_victims(&f, state);
    uint32_t nfree = f.p->nfree, *stack = malloc(nfree * sizeof *stack);
    assert_non_null(stack);
    status st;
    seq_revive_job *job;
    seq_revived out;
    assert_int_equal(seq_revive_plan(f.s, &(seq_revive_request){1, 0, 0, 0, 0, 0}, &job, &st),
                     ST_OK);
    assert_int_equal(seq_revive_blocks(job), 3);
    assert_int_equal(f.p->nfree, nfree - 3);
    uint32_t other[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(pool_alloc_block(f.p, &other[i]), 0);
    assert_int_equal(seq_revive_finish(job, seq_revive_fill(job), &out, &st), ST_OK);
    assert_int_equal(out.ntokens, 12);
    for (uint32_t p = 0; p < 12; p++)
        assert_int_equal(out.src_tier[p], p >= 1 && p <= 7 ? POLICY_SKETCH : POLICY_FULL);
    check_revived(&f, 1, 0, &out);
    revived_free(f.p, &out);
    for (int i = 3; i-- > 0;)
        pool_free_block(f.p, other[i]);
    assert_int_equal(f.p->nfree, nfree);

    memcpy(stack, f.p->free_stack, nfree * sizeof *stack);
    assert_int_equal(seq_revive_plan(f.s, &(seq_revive_request){0, 0, 2, 5, 0, 0}, &job, &st),
                     ST_OK);
    assert_int_equal(f.p->nfree, nfree - 2);
    memset(&out, 0xff, sizeof out);
    assert_int_equal(seq_revive_finish(job, -1, &out, &st), ST_RESOURCE_EXHAUSTED);
    assert_revived_empty(&out);
    assert_int_equal(f.p->nfree, nfree);
    assert_memory_equal(f.p->free_stack, stack, nfree * sizeof *stack);
    free(stack);
    fx_close(&f);
}

/* victims=evict: Revive refuses positions evicted outright, naming the
 * first run, or leaves them out with skip_evicted. */
static void test_revive_evicted_outright(void **state)
{
    const char *const kv[] = {"n_sink", "1", "window", "3"};
    fx f;
    fx_open(&f, backend_of(state), 64, "streaming", kv, 2);
    for (int i = 0; i < 12; i++)
        append(&f, 1);
    uint32_t nfree = f.p->nfree;
    seq_revived a;
    status st;
    memset(&a, 0xff, sizeof a);
    assert_int_equal(seq_revive(f.s, &(seq_revive_request){0, 0, 0, 0, 0, 0}, &a, &st),
                     ST_FAILED_PRECONDITION);
    assert_non_null(strstr(st.msg, "7 of positions 0..11 of layer 0 were evicted outright"));
    assert_non_null(strstr(st.msg, "first: 1..7"));
    assert_revived_empty(&a);
    assert_int_equal(f.p->nfree, nfree);
    revive_ok(&f, (seq_revive_request){0, 0, 0, 0, 1, 0}, &a);
    static const uint32_t held[] = {0, 8, 9, 10, 11};
    assert_int_equal(a.ntokens, 5);
    assert_memory_equal(a.positions, held, sizeof held);
    for (size_t i = 0; i < 5; i++)
        assert_int_equal(a.src_tier[i], POLICY_FULL);
    revived_free(f.p, &a);
    /* Only evicted positions: nothing to rebuild, no block taken. */
    revive_ok(&f, (seq_revive_request){0, 0, 2, 5, 1, 0}, &a);
    assert_int_equal(a.ntokens, 0);
    assert_int_equal(a.nblocks, 0);
    revived_free(f.p, &a);
    assert_int_equal(f.p->nfree, nfree);
    fx_close(&f);
}

/*
 * victims=int8 (no sinks, window 4): after 30 tokens the 25 victims are
 * kept out of the table, 24 of them quantised in two INT8 blocks, one
 * waiting at full precision. A Revive rebuilds victims (INT8 within the
 * bound) and held tokens; seq_destroy with the revive's blocks still
 * held and retired blocks unacked gives back everything but those.
 */
static void test_revive_int8_victims_and_destroy(void **state)
{
    const char *const kv[] = {"n_sink", "0", "window", "4", "victims", "int8"};
    fx f;
    fx_open(&f, backend_of(state), 64, "streaming", kv, 3);
    for (int i = 0; i < 30; i++)
        append(&f, 1);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_INT8], 2 * 24);
    assert_int_equal(tokens[POLICY_FULL], 2 * (1 + 5)); /* 1 waiting, 5 held */
    assert_int_equal(bytes[POLICY_INT8], 2 * 2 * BLOCK_BYTES);
    assert_true(seq_retired_count(f.s) > 0);
    seq_revived a;
    revive_ok(&f, (seq_revive_request){1, 0, 0, 0, 0, 0}, &a);
    assert_int_equal(a.ntokens, 30);
    for (uint32_t p = 0; p < 30; p++) {
        assert_int_equal(a.positions[p], p);
        assert_int_equal(a.src_tier[p], p < 24 ? POLICY_INT8 : POLICY_FULL);
    }
    /* seq_destroy frees what the sequence holds, not the caller's. */
    uint32_t scratch = (uint32_t)a.nblocks;
    assert_int_equal(scratch, 8);
    seq_destroy(f.s);
    assert_int_equal(f.p->nfree, f.p->block_count - scratch);
    revived_free(f.p, &a);
    assert_int_equal(f.p->nfree, f.p->block_count);
    pool_destroy(f.p);
}

/* Whether block b is one of the revive's scratch blocks. */
static int is_scratch(const seq_revived *out, uint32_t b)
{
    for (size_t i = 0; i < out->nblocks; i++)
        if (out->blocks[i] == b)
            return 1;
    return 0;
}

/*
 * An in-place Revive (test_revive_int8_victims_and_destroy's list: 24 INT8
 * victims, one victim waiting at full precision, 5 tokens held at full
 * precision) gives the tokens, positions, tiers and values of a copying
 * one, but names the list's own slots for the 5 held tokens and rebuilds
 * only the 25 victims into scratch (7 blocks, not 8); a range of held
 * tokens alone takes no scratch at all.
 */
static void test_revive_in_place(void **state)
{
    const char *const kv[] = {"n_sink", "0", "window", "4", "victims", "int8"};
    fx f;
    fx_open(&f, backend_of(state), 64, "streaming", kv, 3);
    for (int i = 0; i < 30; i++)
        append(&f, 1);
    seq_revived copy, here, held;
    revive_ok(&f, (seq_revive_request){1, 0, 0, 0, 0, 0}, &copy);
    uint32_t nfree = f.p->nfree;
    status st;
    if (seq_revive(f.s, &(seq_revive_request){1, 0, 0, 0, 0, 1}, &here, &st) != ST_OK)
        fail_msg("revive in place: %s", st.msg);
    assert_int_equal(here.ntokens, 30);
    assert_int_equal(here.nblocks, 7);
    assert_int_equal(f.p->nfree, nfree - 7);
    assert_memory_equal(here.positions, copy.positions, 30 * sizeof *here.positions);
    assert_memory_equal(here.src_tier, copy.src_tier, 30);
    float *vc = revived_values(&f, &copy), *vh = revived_values(&f, &here);
    assert_memory_equal(vc, vh, 30 * tier_token_bytes(&f.tier));
    free(vc), free(vh);
    check_revived(&f, 1, 0, &here);
    /* The held tokens' slots are the list's, the others scratch. */
    seq_list_view v;
    seq_list_view_get(f.s, 1, 0, &v);
    assert_int_equal(v.tokens, 5);
    seq_revived list = {.segs = (kv_segment *)v.segs, .nsegs = v.nsegs, .ntokens = v.tokens};
    tier_token *mine = revived_slots(&list), *got = revived_slots(&here);
    for (uint32_t t = 0; t < 30; t++) {
        uint32_t h = 0;
        while (h < v.tokens && v.positions[h] != here.positions[t])
            h++;
        if (h < v.tokens) {
            assert_int_equal(got[t].block, mine[h].block);
            assert_int_equal(got[t].slot, mine[h].slot);
        } else {
            assert_true(is_scratch(&here, got[t].block));
        }
    }
    free(mine), free(got);
    /* Held tokens only: nothing copied, no scratch. */
    uint32_t first = v.positions[1];
    nfree = f.p->nfree;
    if (seq_revive(f.s, &(seq_revive_request){1, 0, first, 4, 0, 1}, &held, &st) != ST_OK)
        fail_msg("revive in place: %s", st.msg);
    assert_int_equal(held.ntokens, 4);
    assert_int_equal(held.nblocks, 0);
    assert_int_equal(f.p->nfree, nfree);
    check_revived(&f, 1, 0, &held);
    revived_free(f.p, &held);
    revived_free(f.p, &here);
    revived_free(f.p, &copy);
    fx_close(&f);
}

/*
 * victims=int8 with seq_set_demote_after_step: steps (seq_step) leave their
 * victims at full precision and seq_demote_due quantises them after each
 * (test_revive_int8_victims_and_destroy's 30 tokens, a step after each); after every one the
 * sequence holds what the steps give when they quantise themselves, at the
 * same epoch (asked for the next, as the store asks, a demotion of victims
 * alone publishes none: no table changed), and a Revive of all positions
 * reads the same values, bit for bit.
 */
static void test_int8_victims_after_step(void **state)
{
    const char *const kv[] = {"n_sink", "0", "window", "4", "victims", "int8"};
    fx in, f;
    fx_open(&in, backend_of(state), 64, "streaming", kv, 3);
    fx_open(&f, backend_of(state), 64, "streaming", kv, 3);
    seq_set_demote_after_step(f.s, 1);
    status st;
    for (int i = 0; i < 30; i++) {
        append(&in, 1);
        step_silent(&in);
        append(&f, 1);
        step_silent(&f);
        assert_int_equal(seq_demote_due(f.s, seq_epoch(f.s) + 1, &st), ST_OK);
        assert_same_seq(&in, &f);
        for (uint32_t l = 0; l < 2; l++)
            check_full_victims(&f, l);
    }
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(f.s, tokens, bytes);
    assert_int_equal(tokens[POLICY_INT8], 2 * 24);
    seq_revived a, b;
    revive_ok(&in, (seq_revive_request){1, 0, 0, 0, 0, 0}, &a);
    revive_ok(&f, (seq_revive_request){1, 0, 0, 0, 0, 0}, &b);
    assert_int_equal(a.ntokens, 30);
    assert_int_equal(b.ntokens, 30);
    assert_memory_equal(a.src_tier, b.src_tier, 30);
    float *va = revived_values(&in, &a), *vb = revived_values(&f, &b);
    assert_memory_equal(va, vb, 30 * tier_token_bytes(&f.tier));
    free(va), free(vb);
    revived_free(in.p, &a);
    revived_free(f.p, &b);
    fx_close(&in);
    fx_close(&f);
}

/* ---- export and import with sketches (seq.h seq_export) ------------------ */

/* from's sequence moved as two daemons move it: described, its blocks and
 * sketch cells read, encoded (migrate_encode), decoded (migrate.h: the
 * manifest, then every data and sketch value) and imported into *to, a
 * new pool of the same geometry on the same backend. */
static void move_to(fx *from, fx *to, void **state)
{
    memset(to, 0, sizeof *to);
    status st;
    pool_geometry g = geom;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    if (pool_create(2, "m", &g, 64 * BLOCK_BYTES, backend_of(state), &to->p, &st) != ST_OK)
        fail_msg("pool_create: %s", st.msg);
    seq_export x;
    if (seq_export_describe(from->s, &x, &st) != ST_OK)
        fail_msg("describe: %s", st.msg);
    assert_int_equal(seq_export_read_sketches(from->s, &x), 0);
    uint8_t *bytes = malloc(x.nblocks * BLOCK_BYTES + 1);
    assert_non_null(bytes);
    assert_int_equal(pool_read_blocks(from->p, x.blocks, x.nblocks, bytes), 0);
    migrate_values v;
    if (migrate_encode(&x, &from->p->geom, 0, BLOCK_BYTES, bytes, "ns", "t", "0123456789abcdef", &v,
                       &st) != ST_OK)
        fail_msg("encode: %s", st.msg);
    seq_export_free(&x);
    free(bytes);
    migrate_plan plan;
    const remote_kv *m = &v.kv[v.n - 1];
    if (migrate_decode_manifest(m->val, m->len, &to->p->geom, 0, &plan, &st) != ST_OK)
        fail_msg("decode: %s", st.msg);
    assert_int_equal(plan.ndata, v.n - 1);
    bytes = malloc(plan.image.nblocks * BLOCK_BYTES + 1);
    assert_non_null(bytes);
    for (size_t i = 0; i < plan.ndata; i++)
        for (size_t j = 0; j + 1 < v.n; j++)
            if (strcmp(v.kv[j].key, plan.data[i].key) == 0 &&
                migrate_decode_data(&plan, i, v.kv[j].val, v.kv[j].len, bytes, &st) != ST_OK)
                fail_msg("decode %s: %s", plan.data[i].key, st.msg);
    uint32_t *blocks = malloc((plan.image.nblocks + 1) * sizeof *blocks);
    assert_non_null(blocks);
    for (size_t i = 0; i < plan.image.nblocks; i++)
        assert_int_equal(pool_alloc_block(to->p, &blocks[i]), 0);
    assert_int_equal(pool_write_blocks(to->p, blocks, plan.image.nblocks, bytes), 0);
    if (seq_import(8, 3, to->p, &plan.image, blocks, &to->s, &st) != ST_OK)
        fail_msg("import: %s", st.msg);
    free(blocks);
    free(bytes);
    migrate_plan_free(&plan);
    migrate_values_free(&v);
    to->ops = from->ops;
    to->heads = from->heads;
    to->lheads = from->lheads;
    kv_layout ll = from->tier.l;
    assert_int_equal(
        tier_ctx_init(&to->tier, to->ops, to->p->base, to->p->block_bytes, &ll, (kv_dtype)g.dtype),
        0);
}

/* The two sequences' lists are the same (positions, victims, tiers by
 * token) and a Revive of every list rebuilds bit-identical values (the
 * sketch estimates included) from the same tiers. Returns the tokens
 * revived from a sketch. */
static size_t assert_same(fx *a, fx *b)
{
    assert_int_equal(seq_appended(a->s), seq_appended(b->s));
    uint64_t ta[POLICY_TIERS], ba[POLICY_TIERS], tb[POLICY_TIERS], bb[POLICY_TIERS];
    seq_tier_usage(a->s, ta, ba);
    seq_tier_usage(b->s, tb, bb);
    assert_memory_equal(ta, tb, sizeof ta);
    assert_int_equal(ba[POLICY_SKETCH], bb[POLICY_SKETCH]);
    size_t sketched = 0;
    for (uint32_t l = 0; l < seq_layers(a->s); l++)
        for (uint32_t k = 0; k < a->heads; k++) {
            seq_list_view va, vb;
            seq_list_view_get(a->s, l, k, &va);
            seq_list_view_get(b->s, l, k, &vb);
            assert_int_equal(va.tokens, vb.tokens);
            assert_int_equal(va.noffloaded, vb.noffloaded);
            if (va.tokens > 0)
                assert_memory_equal(va.positions, vb.positions, va.tokens * sizeof(uint32_t));
            if (va.noffloaded > 0)
                assert_memory_equal(va.offloaded, vb.offloaded, va.noffloaded * sizeof(uint32_t));
            seq_revived ra, rb;
            status st;
            seq_revive_request req = {l, k, 0, 0, 1, 0};
            assert_int_equal(seq_revive(a->s, &req, &ra, &st), ST_OK);
            assert_int_equal(seq_revive(b->s, &req, &rb, &st), ST_OK);
            assert_int_equal(ra.ntokens, rb.ntokens);
            if (ra.ntokens > 0) {
                assert_memory_equal(ra.positions, rb.positions, ra.ntokens * sizeof(uint32_t));
                assert_memory_equal(ra.src_tier, rb.src_tier, ra.ntokens);
                float *xa = revived_values(a, &ra), *xb = revived_values(b, &rb);
                /* Bit for bit: the same cells, hashes and estimates. */
                assert_memory_equal(xa, xb, 2 * ra.ntokens * a->lheads * HD * sizeof(float));
                free(xa);
                free(xb);
            }
            for (size_t i = 0; i < ra.ntokens; i++)
                sketched += ra.src_tier[i] == POLICY_SKETCH;
            revived_free(a->p, &ra);
            revived_free(b->p, &rb);
        }
    return sketched;
}

/*
 * A victims=sketch sequence (streaming, 7 victims a list in the sketch)
 * moved to another pool: the same lists, the same sketch bytes, and a
 * Revive rebuilds the same estimates bit for bit; both continue (appends
 * offload more victims into the sketches) and stay the same. An image whose
 * sketch was not read, or whose size is not this policy's geometry, is
 * refused with nothing created.
 */
static void test_move_sketch_victims(void **state)
{
    fx a, b;
    open_sketch_victims(&a, state);
    move_to(&a, &b, state);
    assert_int_equal(assert_same(&a, &b), 2 * 7);
    for (int i = 0; i < 6; i++) {
        append(&a, 1);
        append(&b, 1);
    }
    assert_int_equal(assert_same(&a, &b), 2 * 13);

    /* Refused: cells not read, cells of another geometry. */
    seq_export x;
    status st;
    assert_int_equal(seq_export_describe(a.s, &x, &st), ST_OK);
    assert_true(x.lists[0].sketch_bytes > 0);
    uint32_t nfree = b.p->nfree;
    uint32_t *blocks = malloc((x.nblocks + 1) * sizeof *blocks);
    assert_non_null(blocks);
    for (size_t i = 0; i < x.nblocks; i++)
        assert_int_equal(pool_alloc_block(b.p, &blocks[i]), 0);
    seq *c = NULL;
    uint8_t *cells = x.lists[1].sketch;
    x.lists[1].sketch = NULL;
    assert_int_equal(seq_import(9, 3, b.p, &x, blocks, &c, &st), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "sketch"));
    x.lists[1].sketch = cells;
    assert_int_equal(seq_export_read_sketches(a.s, &x), 0);
    x.lists[1].sketch_bytes -= 68; /* a cell fewer: not streaming's 3 x 4096 */
    assert_int_equal(seq_import(9, 3, b.p, &x, blocks, &c, &st), ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "geometry"));
    x.lists[1].sketch_bytes += 68;
    x.lists[1].sketch_bytes = 0; /* victims in the sketch, no sketch */
    assert_int_equal(seq_import(9, 3, b.p, &x, blocks, &c, &st), ST_INVALID_ARGUMENT);
    assert_null(c);
    for (size_t i = 0; i < x.nblocks; i++)
        pool_free_block(b.p, blocks[i]);
    assert_int_equal(b.p->nfree, nfree);
    free(blocks);
    seq_export_free(&x);
    fx_close(&a);
    fx_close(&b);
}

/*
 * A reviver sequence that has sketched (budget 8: Recent and Candidate of
 * 3, the rest to the Vague store; steps with no statistics) moved to
 * another pool: the same lists and tiers, bit-identical revived estimates,
 * and, stepped on with the same appends, the same decisions (swap-backs
 * and sketching from the moved sketch and state) and estimates.
 */
/* A step with the scores data[0..n) (freed); returns the tokens it evicted. */
static uint32_t step_with_scores(fx *f, float *data, size_t n)
{
    seq_step_input in = {
        .arrays = POLICY_NEEDS_SCORE, .score_queries = 1, .data = data, .nfloats = n};
    uint32_t evicted;
    status st;
    if (seq_step(f->s, &in, &evicted, &st) != ST_OK)
        fail_msg("step: %s", st.msg);
    free(data);
    return evicted;
}

/* One token appended and a step with attention scores that depend only on
 * the round and the index: the same for two sequences with the same lists. */
static void append_step(fx *f, uint32_t round)
{
    append(f, 1);
    size_t n = seq_step_floats(f->s, POLICY_NEEDS_SCORE);
    assert_true(n != (size_t)-1);
    float *data = malloc((n + 1) * sizeof *data);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (float)((i * 7 + round * 3) % 11) / 11.0f;
    step_with_scores(f, data, n);
}

/* Whether some list of f holds a full-precision segment before a
 * quantised one. */
static int full_before_quantised(fx *f)
{
    for (uint32_t l = 0; l < seq_layers(f->s); l++)
        for (uint32_t k = 0; k < f->heads; k++) {
            const seq_list *ly = seq_list_at(f->s, l, k);
            int full = 0;
            for (size_t j = 0; j < ly->nsegs; j++) {
                if (full && policy_tier_quantised(ly->seg_tier[j]))
                    return 1;
                full |= ly->seg_tier[j] == POLICY_FULL;
            }
        }
    return 0;
}

/* The demotion f's step left due, planned, filled and finished as the
 * demoter runs it after the reply; whether it quantised tokens into INT8. */
static int demote_after_step(fx *f)
{
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS], after[POLICY_TIERS];
    seq_tier_usage(f->s, tokens, bytes);
    seq_demote_job *job;
    status st;
    assert_int_equal(seq_demote_plan(f->s, seq_epoch(f->s) + 1, &job, &st), ST_OK);
    if (job != NULL)
        assert_int_equal(seq_demote_finish(job, seq_demote_fill(job), &st), ST_OK);
    seq_tier_usage(f->s, after, bytes);
    return after[POLICY_INT8] > tokens[POLICY_INT8];
}

/*
 * demote_keep (precision by importance) keeps the important tokens at full
 * precision between quantised ones; when they come due later, the demotion
 * after the step finds them in those runs (seq_demote.c counts the tokens
 * due a run of full-precision segments at a time), and the sequence holds
 * what the same steps give when they demote themselves.
 */
static void test_demotion_between_quantised_runs(void **state)
{
    const char *const kv[] = {"demote", "int8", "int8_window", "4", "demote_keep", "0.5"};
    fx in, f;
    fx_open(&in, backend_of(state), 256, "full", kv, 3);
    fx_open(&f, backend_of(state), 256, "full", kv, 3);
    seq_set_demote_after_step(f.s, 1);
    int between = 0, demoted_between = 0;
    for (uint32_t round = 0; round < 16; round++) {
        fx *both[2] = {&in, &f};
        for (int i = 0; i < 2; i++) {
            append(both[i], 9);
            size_t n = seq_step_floats(both[i]->s, POLICY_NEEDS_SCORE);
            float *data = malloc((n + 1) * sizeof *data);
            assert_non_null(data);
            for (size_t t = 0; t < n; t++) /* importance that moves from round to round */
                data[t] = (float)((t * 7 + round * 5) % 13) / 13.0f;
            step_with_scores(both[i], data, n);
        }
        int before = full_before_quantised(&f);
        int demoted = demote_after_step(&f);
        between += before;
        demoted_between += before && demoted;
        assert_same_holdings(&in, &f, 0);
        for (uint32_t l = 0; l < seq_layers(f.s); l++)
            check_list(&f, l, 0);
    }
    assert_true(between > 0);
    assert_true(demoted_between > 0);
    fx_close(&in);
    fx_close(&f);
}

/*
 * A list with victims in its sketch takes the step's general path, which
 * leaves its tokens decided INT8 due (list_demote_to) rather than
 * quantising them in the step; the demotion after the step must find
 * them (SEQ_DUE_TIERS) beside the list's victims, so that the sequence
 * holds what the same steps give when they demote themselves.
 */
static void test_demotion_after_step_general_path(void **state)
{
    const char *const kv[] = {"n_sink", "2",           "window", "40",      "int8",
                              "on",     "int8_window", "4",      "victims", "sketch"};
    fx in, f;
    fx_open(&in, backend_of(state), 256, "streaming", kv, 5);
    fx_open(&f, backend_of(state), 256, "streaming", kv, 5);
    seq_set_demote_after_step(f.s, 1);
    int demoted = 0;
    for (uint32_t round = 0; round < 12; round++) {
        append(&in, 5);
        step_silent(&in);
        append(&f, 5);
        step_silent(&f);
        demoted += demote_after_step(&f);
        assert_same_holdings(&in, &f, 0);
    }
    assert_true(demoted > 0);
    fx_close(&in);
    fx_close(&f);
}

/*
 * TOVA takes the last query's attention per query head (needs) or its sum
 * over them as score (needs_alt): the step with the sum evicts the token
 * the rows would, and a step with neither is refused, naming last_attn.
 */
static void test_tova_takes_the_summed_score(void **state)
{
    const char *const kv[] = {"budget", "6"};
    fx f;
    fx_open(&f, backend_of(state), 64, "tova", kv, 1);
    append(&f, 7);
    seq_step_input none = {.confidence = -1.0};
    step_refused(&f, &none, ST_FAILED_PRECONDITION, "needs 'last_attn'");
    size_t n = seq_step_floats(f.s, POLICY_NEEDS_SCORE);
    assert_int_equal(n, 2 * 7);
    float *sum = malloc(n * sizeof *sum);
    assert_non_null(sum);
    for (size_t i = 0; i < n; i++) /* layer 0 least attends position 2, layer 1 position 4 */
        sum[i] = i == 2 || i == 7 + 4 ? 0.5f : 1.0f + (float)(i % 3);
    seq_step_input in = {.arrays = POLICY_NEEDS_SCORE,
                         .score_queries = 1,
                         .confidence = -1.0,
                         .data = sum,
                         .nfloats = n};
    uint32_t evicted;
    status st;
    if (seq_step(f.s, &in, &evicted, &st) != ST_OK)
        fail_msg("step: %s", st.msg);
    assert_int_equal(evicted, 2);
    for (uint32_t l = 0; l < 2; l++) {
        seq_list_view v;
        seq_list_view_get(f.s, l, 0, &v);
        assert_int_equal(v.tokens, 6);
        for (uint32_t i = 0; i < v.tokens; i++)
            assert_int_not_equal(v.positions[i], l == 0 ? 2 : 4);
        check_list(&f, l, 0);
    }
    free(sum);
    fx_close(&f);
}

/*
 * A policy that takes its statistics itself (policy_ops.stats_in_place:
 * h2o, tova's summed score, ov_block) is handed the worker's memory, not a copy: the same steps
 * leave the same lists as steps of daemon-owned statistics, the copy is
 * not written (unless copy_always, which the metrics ask for), and a NaN
 * in layer 1 is refused by its index in the step's floats, as the copy's
 * check names it, changing nothing.
 */
static void test_statistics_read_in_place(void **state)
{
    static const struct {
        const char *policy, *kv[8];
        size_t pairs;
    } cases[] = {
        {"h2o", {"budget", "9", "recent", "3"}, 2},
        {"tova", {"budget", "9"}, 1}, /* its summed score */
        {"ov_block",
         {"start_size", "4", "recent_size", "4", "max_cache_size", "12", "snapkv_window", "0"},
         4},
        /* SnapKV's window of 8 counted once a step: a refused step's count undone */
        {"ov_block", {"start_size", "4", "recent_size", "4", "max_cache_size", "12"}, 3},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        fx a, b;
        fx_open(&a, backend_of(state), 160, cases[c].policy, cases[c].kv, cases[c].pairs);
        fx_open(&b, backend_of(state), 160, cases[c].policy, cases[c].kv, cases[c].pairs);
        float copy[64], data[64];
        uint64_t seed = 7;
        uint32_t evicted = 0;
        for (uint32_t round = 0; round < 24; round++) {
            uint32_t count = round == 0 ? 12 : 1 + round % 2;
            append(&a, count);
            append(&b, count);
            size_t n = seq_step_floats(a.s, POLICY_NEEDS_SCORE);
            assert_true(n <= 64);
            for (size_t i = 0; i < n; i++) {
                seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                data[i] = (float)(seed >> 40) / (float)(1u << 24);
                copy[i] = -1.0f;
            }
            seq_step_input in = {.arrays = POLICY_NEEDS_SCORE,
                                 .score_queries = 1,
                                 .confidence = -1.0,
                                 .data = data,
                                 .nfloats = n};
            seq_step_input shared = in;
            shared.copy = copy;
            shared.copy_always = round % 4 == 3;
            if (round == 5 || round == 9 || round == 14) {                /* layer 1's (2 layers) */
                size_t at = n / 2 + (round == 9 ? 1 : n / 4 + round % 2); /* 9: ov_block's start */
                float was = data[at];
                data[at] = round == 5 ? NAN : -INFINITY;
                char want[64];
                snprintf(want, sizeof want, "non-finite value at float %zu", at);
                step_refused(&a, &shared, ST_INVALID_ARGUMENT, want);
                data[at] = was;
            }
            uint32_t ea, eb;
            status st;
            if (seq_step(a.s, &shared, &ea, &st) != ST_OK)
                fail_msg("%s round %u, in place: %s", cases[c].policy, round, st.msg);
            if (seq_step(b.s, &in, &eb, &st) != ST_OK)
                fail_msg("%s round %u: %s", cases[c].policy, round, st.msg);
            assert_int_equal(ea, eb);
            evicted += ea;
            for (size_t i = 0; i < n; i++)
                assert_true(copy[i] == (shared.copy_always ? data[i] : -1.0f));
            assert_same_holdings(&a, &b, 0);
        }
        assert_true(evicted > 0);
        fx_close(&a);
        fx_close(&b);
    }
}

/* One step of f with `in` (statistics drawn from seed where in->data is
 * NULL); its status, and its message in msg. */
static status_code step_drawn(fx *f, seq_step_input in, uint64_t seed, int nan_layer, char *msg)
{
    size_t n = seq_step_floats(f->s, in.arrays);
    float *data = malloc((n ? n : 1) * sizeof *data);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        data[i] = (float)(seed >> 40) / (float)(1u << 24);
    }
    if (nan_layer >= 0) /* the layer's rows are the second half (2 layers) */
        data[n / 2 + 1] = NAN;
    in.data = data;
    in.nfloats = n;
    uint32_t evicted;
    status st = {0};
    status_code rc = seq_step(f->s, &in, &evicted, &st);
    snprintf(msg, 256, "%s", rc == ST_OK ? "" : st.msg);
    free(data);
    return rc;
}

/* Two sequences alike but for the threads their layers decide on (3, and
 * the step's own; every other step of the first lends it a kept helper, as
 * a ring does, daemon/helper.h): the same steps leave the same lists
 * holding the same values (every kept token its own, but where weightedkv
 * merged), and a step whose layer 1 has a NaN is refused alike on both and
 * changes nothing. */
static void test_layers_on_threads(void **state)
{
    static const struct {
        const char *policy, *kv[8];
        unsigned arrays;
        int merges;
    } cases[] = {
        {"tova", {"budget", "9"}, POLICY_NEEDS_LAST_ATTN, 0},
        {"h2o", {"budget", "9"}, POLICY_NEEDS_SCORE, 0},
        {"confkv",
         {"budget_tight", "9", "budget_loose", "9", "protect", "2", "fp16_window", "3"},
         POLICY_NEEDS_LAST_ATTN,
         0},
        {"weightedkv", {"cache_size", "9", "n_recent", "2"}, POLICY_NEEDS_LAST_ATTN, 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        fx a, b;
        size_t pairs = 0;
        while (pairs < 4 && cases[c].kv[2 * pairs] != NULL)
            pairs++;
        g_policy_threads = 3;
        fx_open(&a, backend_of(state), 160, cases[c].policy, cases[c].kv, pairs);
        g_policy_threads = 0;
        fx_open(&b, backend_of(state), 160, cases[c].policy, cases[c].kv, pairs);
        seq_step_input in = {.arrays = cases[c].arrays, .score_queries = 1, .confidence = 0.5};
        helper *hp = helper_create();
        assert_non_null(hp);
        seq_step_input lent = in;
        lent.helper = helper_lend(hp);
        char ma[256], mb[256];
        for (uint64_t round = 0; round < 24; round++) {
            append(&a, round == 0 ? 12 : 1 + round % 2);
            append(&b, round == 0 ? 12 : 1 + round % 2);
            int bad = round == 10;
            status_code ra = step_drawn(&a, round % 2 ? lent : in, round, bad ? 1 : -1, ma);
            assert_int_equal(ra, step_drawn(&b, in, round, bad ? 1 : -1, mb));
            assert_int_equal(ra, bad ? ST_INVALID_ARGUMENT : ST_OK);
            assert_string_equal(ma, mb);
            if (bad) {
                assert_non_null(strstr(ma, "non-finite"));
                /* Nothing changed: the next step decides over the same lists. */
                assert_int_equal(step_drawn(&a, in, 100 + round, -1, ma), ST_OK);
                assert_int_equal(step_drawn(&b, in, 100 + round, -1, mb), ST_OK);
            }
            for (uint32_t l = 0; l < 2; l++)
                for (uint32_t k = 0; k < a.heads; k++) {
                    seq_list_view va, vb;
                    uint8_t *ta, *tb;
                    float *xa = list_read(&a, l, k, &va, &ta), *xb = list_read(&b, l, k, &vb, &tb);
                    assert_int_equal(va.tokens, vb.tokens);
                    assert_true(va.tokens <= 9);
                    assert_memory_equal(va.positions, vb.positions,
                                        va.tokens * sizeof *va.positions);
                    assert_memory_equal(ta, tb, va.tokens);
                    assert_memory_equal(xa, xb, (size_t)va.tokens * 2 * a.lheads * HD * sizeof *xa);
                    if (!cases[c].merges)
                        check_list(&a, l, k);
                    free(xa), free(xb), free(ta), free(tb);
                }
        }
        fx_close(&a);
        fx_close(&b);
        helper_destroy(hp);
    }
}

/* The last query's attention of query head h to position p at a round. */
static float wkv_attn(uint32_t round, uint32_t l, uint32_t h, uint32_t p)
{
    return (float)((p * 7 + h * 3 + l * 5 + round * 11) % 13) / 13.0f;
}

/*
 * WeightedKV's decode steps write the merged values where the worker reads
 * them (seq_apply.c: a decode step's merge is found in the segments): over
 * rounds that cross blocks, the test keeps its own model of each per-head
 * list, the accumulators (policies/weightedkv.c step 1) from the policy's
 * state and the step's rows, and each token's value, merged as POLICIES.md
 * §4.1 says into the right neighbour of the token the step evicted. Every
 * held token's V reads back its model's value and its K what was written.
 */
static void test_weightedkv_merges_in_place(void **state)
{
    const char *const kv[] = {"cache_size", "6", "n_init", "1", "n_recent", "2"};
    enum { ROUNDS = 24, POS = 64 };
    fx f;
    fx_open(&f, backend_of(state), 128, "weightedkv", kv, 3);
    assert_int_equal(f.heads, 2);
    static float model[2][2][POS][HD]; /* [layer][head][position] V */
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t k = 0; k < 2; k++)
            for (uint32_t p = 0; p < POS; p++)
                for (uint32_t c = 0; c < HD; c++)
                    model[l][k][p][c] = value_of(p, l, k, c, 1);
    append(&f, 6);
    uint32_t merges = 0;
    for (uint32_t round = 0; round < ROUNDS; round++) {
        if (round > 0)
            append(&f, 1);
        size_t nf = seq_step_floats(f.s, POLICY_NEEDS_LAST_ATTN);
        float *data = malloc(nf * sizeof *data);
        assert_non_null(data);
        /* Layer by layer, query head by query head, over its list (kvstash_step.h). */
        size_t at = 0;
        seq_list_view before[2][2]; /* positions: the host's, until the step */
        uint32_t held[2][2][8];
        double w[2][2][8];
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t h = 0; h < 4; h++) {
                seq_list_view_get(f.s, l, h / 2, &before[l][h / 2]);
                for (uint32_t i = 0; i < before[l][h / 2].tokens; i++)
                    data[at++] = wkv_attn(round, l, h, before[l][h / 2].positions[i]);
            }
        assert_int_equal(at, nf);
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t k = 0; k < 2; k++) {
                const double *a, *c;
                uint32_t n;
                assert_int_equal(
                    weightedkv_head_state(policy_host_state(f.s->host), l, k, &a, &c, &n), 0);
                assert_true(before[l][k].tokens <= 8 && n <= before[l][k].tokens);
                for (uint32_t i = 0; i < before[l][k].tokens; i++) {
                    uint32_t p = held[l][k][i] = before[l][k].positions[i];
                    double m = ((double)wkv_attn(round, l, 2 * k, p) +
                                (double)wkv_attn(round, l, 2 * k + 1, p)) /
                               2;
                    w[l][k][i] = ((i < n ? a[i] : 0.0) + m) / ((i < n ? c[i] : 0.0) + 1.0);
                }
            }
        seq_step_input in = {
            .arrays = POLICY_NEEDS_LAST_ATTN, .confidence = -1.0, .data = data, .nfloats = nf};
        uint32_t evicted;
        status st;
        if (seq_step(f.s, &in, &evicted, &st) != ST_OK)
            fail_msg("step: %s", st.msg);
        free(data);
        for (uint32_t l = 0; l < 2; l++)
            for (uint32_t k = 0; k < 2; k++) {
                uint32_t n = before[l][k].tokens;
                const uint32_t *was = held[l][k];
                seq_list_view v;
                uint8_t *tier;
                float *got = list_read(&f, l, k, &v, &tier);
                if (n > 6) { /* one merge: the lowest weight of [1, n - 2), into the next */
                    uint32_t j = 1;
                    for (uint32_t i = 1; i < n - 2; i++)
                        j = w[l][k][i] < w[l][k][j] ? i : j;
                    assert_int_equal(v.tokens, n - 1);
                    for (uint32_t i = 0; i < v.tokens; i++)
                        assert_int_equal(v.positions[i], was[i < j ? i : i + 1]);
                    float wf = (float)w[l][k][j], wi = (float)w[l][k][j + 1];
                    if (!(wf + wi > 0.0f))
                        wf = wi = 1.0f;
                    float *into = model[l][k][was[j + 1]], *from = model[l][k][was[j]];
                    for (uint32_t c = 0; c < HD; c++)
                        into[c] = (wf * from[c] + wi * into[c]) / (wf + wi);
                    merges++;
                }
                for (uint32_t i = 0; i < v.tokens; i++)
                    for (uint32_t c = 0; c < HD; c++) {
                        uint32_t p = v.positions[i];
                        assert_int_equal(tier[i], POLICY_FULL);
                        assert_float_equal(got[i * HD + c], value_of(p, l, k, c, 0), 0.0);
                        if (fabsf(got[v.tokens * HD + i * HD + c] - model[l][k][p][c]) > 1e-5f)
                            fail_msg("round %u layer %u head %u position %u channel %u: V %g, "
                                     "want %g",
                                     round, l, k, p, c, got[v.tokens * HD + i * HD + c],
                                     model[l][k][p][c]);
                    }
                free(got);
                free(tier);
            }
        seq_ack(f.s, seq_epoch(f.s));
    }
    assert_int_equal(merges, 4 * (ROUNDS - 1));
    fx_close(&f);
}

/* A list's tokens as (block, slot) by position, for tests that follow
 * tokens across a step: UINT32_MAX where p is not in the list. */
enum { SLOTS_MAX = 1024 };
typedef struct list_slots {
    uint32_t block[SLOTS_MAX], slot[SLOTS_MAX];
} list_slots;

static void list_slots_get(fx *f, uint32_t l, list_slots *out)
{
    memset(out, 0xff, sizeof *out);
    seq_list_view v;
    seq_list_view_get(f->s, l, 0, &v);
    uint32_t t = 0;
    for (size_t i = 0; i < v.nsegs; i++)
        for (uint32_t j = 0; j < v.segs[i].count; j++, t++) {
            assert_true(v.positions[t] < SLOTS_MAX);
            out->block[v.positions[t]] = v.segs[i].block;
            out->slot[v.positions[t]] = v.segs[i].first_slot + j;
        }
}

/* After a step of layer l's list: the segments are maximal runs (as
 * list_encode makes them), and every block the list used before (its tail
 * too) and does not now is retired, at this step's epoch. */
static void check_cut_list(fx *f, uint32_t l, const list_slots *before, int had_tail, uint32_t tail,
                           size_t nretired, uint32_t round)
{
    check_list(f, l, 0);
    seq_list_view v;
    seq_list_view_get(f->s, l, 0, &v);
    for (size_t i = 1; i < v.nsegs; i++)
        assert_false(v.segs[i].block == v.segs[i - 1].block &&
                     v.segs[i - 1].first_slot + v.segs[i - 1].count == v.segs[i].first_slot);
    const seq_retired *r;
    size_t nr = seq_retired_blocks(f->s, &r);
    const seq_list *ly = seq_list_at(f->s, l, 0);
    for (uint32_t p = 0; p < SLOTS_MAX + 1; p++) {
        uint32_t b = p < SLOTS_MAX ? before->block[p] : had_tail ? tail : UINT32_MAX;
        if (b == UINT32_MAX || block_in_use(f, b) || (ly->has_tail && ly->tail_block == b))
            continue;
        int found = 0;
        for (size_t i = nretired; i < nr; i++)
            found |= r[i].block == b && r[i].epoch == seq_epoch(f->s);
        if (!found)
            fail_msg("round %u layer %u: block %u left the list, not retired", round, l, b);
    }
}

/*
 * Steps that only evict full-precision tokens (seq_apply.c
 * list_apply_evictions works on the segments): `append` tokens, then a step
 * whose scores interleave heavy and light tokens, until `positions` were
 * appended. After each step the kept tokens are where they were (unless the
 * step compacted the list: then all of them read back their values from
 * fresh blocks), the list passes check_cut_list, and no retired block is in
 * a list or holds a victim. Counts the steps that evicted in place and
 * those that compacted.
 */
typedef struct follow_counts {
    uint32_t in_place;     /* lists a step evicted from without moving a token */
    uint32_t compacted;    /* lists a step moved tokens of */
    uint32_t most_at_once; /* the most lists one step moved tokens of */
    uint32_t most_moved;   /* the most tokens one step moved in one list */
    uint32_t cut_steps;    /* evicting steps whose answer can name their cuts */
} follow_counts;

/* The score follow_evictions gives position p when it scores by position:
 * 1, every 7th position never attended; 2, only among the first 60, two
 * in 7 never attended and the one between them barely (h2o evicts those
 * after the others: each is then a segment of one token that goes whole). */
static float position_score(uint32_t p, int by_position)
{
    if (by_position == 1)
        return p % 7 == 0 ? 0.0f : 1.0f;
    if (p >= 60)
        return 1.0f;
    return p % 7 == 0 || p % 7 == 2 ? 0.0f : p % 7 == 1 ? 1e-6f : 1.0f;
}

/* A step of the two lists' scores: heavy and light tokens interleaved,
 * moving with the round, or by position (position_score). Returns the
 * tokens it evicted. */
static uint32_t step_scored(fx *f, uint32_t round, int by_position)
{
    size_t n = seq_step_floats(f->s, POLICY_NEEDS_SCORE);
    float *data = malloc((n + 1) * sizeof *data);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (float)((i * 5 + round * 3) % 7) / 7.0f;
    for (uint32_t l = 0, at = 0; by_position && l < 2; l++) {
        const uint32_t *pos;
        uint32_t nl = seq_list_tokens(f->s, l, 0, &pos);
        for (uint32_t i = 0; i < nl; i++)
            data[at++] = position_score(pos[i], by_position);
    }
    return step_with_scores(f, data, n);
}

static follow_counts follow_evictions(fx *f, uint32_t append_n, uint32_t positions, int by_position)
{
    follow_counts c = {0};
    list_slots *before = malloc(2 * sizeof *before), *after = malloc(sizeof *after);
    assert_true(before != NULL && after != NULL && positions <= SLOTS_MAX);
    for (uint32_t round = 0; seq_appended(f->s) + append_n <= positions; round++) {
        append(f, append_n);
        uint32_t tail[2];
        int has_tail[2];
        for (uint32_t l = 0; l < 2; l++) {
            list_slots_get(f, l, &before[l]);
            tail[l] = seq_list_at(f->s, l, 0)->tail_block;
            has_tail[l] = seq_list_at(f->s, l, 0)->has_tail;
        }
        size_t nretired = seq_retired_count(f->s);
        uint32_t evicted = step_scored(f, round, by_position);
        seq_cuts cuts;
        c.cut_steps += evicted > 0 && seq_step_cuts(f->s, &cuts);
        uint32_t lists_moved = 0;
        for (uint32_t l = 0; l < 2; l++) {
            list_slots_get(f, l, after);
            uint32_t moved = 0;
            for (uint32_t p = 0; p < SLOTS_MAX; p++)
                if (after->block[p] != UINT32_MAX && before[l].block[p] != UINT32_MAX)
                    moved += after->block[p] != before[l].block[p] ||
                             after->slot[p] != before[l].slot[p];
            c.in_place += moved == 0 && evicted > 0;
            c.compacted += moved > 0;
            lists_moved += moved > 0;
            c.most_moved = moved > c.most_moved ? moved : c.most_moved;
            check_cut_list(f, l, &before[l], has_tail[l], tail[l], nretired, round);
            check_full_victims(f, l);
        }
        c.most_at_once = lists_moved > c.most_at_once ? lists_moved : c.most_at_once;
        const seq_retired *r;
        size_t nr = seq_retired_blocks(f->s, &r);
        for (size_t i = 0; i < nr; i++)
            assert_false(block_in_use(f, r[i].block));
        seq_ack(f->s, seq_epoch(f->s));
    }
    free(before);
    free(after);
    return c;
}

/* h2o evicting from the middle of small lists, several tokens a step: the
 * segments are rebuilt, and compaction comes often. */
static void test_evictions_on_the_segments(void **state)
{
    const char *const kv[] = {"budget", "9", "recent", "3"};
    fx f;
    fx_open(&f, backend_of(state), 64, "h2o", kv, 2);
    follow_counts c = follow_evictions(&f, 5, 64, 0);
    assert_true(c.in_place >= 4); /* steps that evicted and did not compact */
    assert_true(c.compacted >= 1);
    fx_close(&f);
}

/*
 * A call's compactions copy at most the sequence's budget beyond its first
 * list (SEQ_COMPACT_TOKENS): the two layers of h2o come due together, and
 * with the default budget both are compacted in the same step; with a
 * budget of one token, one list a step, the other at a later step, and
 * every kept token still reads back its values (follow_evictions).
 */
static void test_compactions_spread_over_calls(void **state)
{
    const char *const kv[] = {"budget", "40", "recent", "4"};
    fx f;
    fx_open(&f, backend_of(state), 128, "h2o", kv, 2);
    follow_counts c = follow_evictions(&f, 3, 200, 0);
    assert_int_equal(c.most_at_once, 2);
    fx_close(&f);
    fx_open(&f, backend_of(state), 128, "h2o", kv, 2);
    f.s->compact_budget = 1;
    c = follow_evictions(&f, 3, 200, 0);
    assert_int_equal(c.most_at_once, 1);
    assert_true(c.compacted >= 3); /* in three steps or more */
    fx_close(&f);
}

/*
 * A list longer than the sequence's compaction window (SEQ_COMPACT_TOKENS)
 * is compacted a window at a time, at successive steps (seq_apply.c
 * list_compact): with the default window h2o's 40-token lists are copied
 * whole; with a window of 8 tokens no step moves more than 8 tokens of a
 * list, compactions still come and keep the lists within their blocks, and
 * every kept token still reads back its values (follow_evictions).
 */
static void test_compaction_by_windows(void **state)
{
    const char *const kv[] = {"budget", "40", "recent", "4"};
    fx f;
    fx_open(&f, backend_of(state), 128, "h2o", kv, 2);
    follow_counts whole = follow_evictions(&f, 3, 300, 0);
    assert_true(whole.most_moved > 8);
    fx_close(&f);
    fx_open(&f, backend_of(state), 128, "h2o", kv, 2);
    f.s->compact_window = 8; /* two blocks of 4 slots */
    follow_counts c = follow_evictions(&f, 3, 300, 0);
    assert_true(c.most_moved >= 1 && c.most_moved <= 8);
    /* More compactions, each smaller, but each window moves on along the
     * list: five windows cover it, so at most five times as many (windows
     * that started over at the front would never get the list under the
     * rule, and compact at every step). */
    assert_true(c.compacted > whole.compacted && c.compacted <= 5 * whole.compacted);
    for (uint32_t l = 0; l < 2; l++) {
        const seq_list *ly = seq_list_at(f.s, l, 0);
        uint32_t blocks = 0;
        for (size_t i = 0; i < ly->nsegs; i++) /* segments of distinct blocks, counted */
            blocks += i == 0 || ly->segs[i].block != ly->segs[i - 1].block;
        /* 40 tokens fill 10 blocks; the rule allows one more, and a list
         * over it waits a step or two for its next window. */
        assert_true(blocks <= 10 + 1 + 2);
    }
    fx_close(&f);
    /* A window is whole blocks: 6 tokens are one block of 4. */
    fx_open(&f, backend_of(state), 128, "h2o", kv, 2);
    f.s->compact_window = 6;
    c = follow_evictions(&f, 3, 300, 0);
    assert_true(c.most_moved >= 1 && c.most_moved <= 4);
    fx_close(&f);
}

/*
 * Decode steps over long lists, where no compaction can be due and the
 * evicted tokens are cut out of the segments in place (list_cut_in_place):
 * h2o's one token a step from anywhere (segments split, and compaction
 * comes once they are too many), and StreamingLLM's oldest token after the
 * sinks (whole segments go and their blocks are retired).
 */
static void test_evictions_cut_in_place(void **state)
{
    const char *const h2o[] = {"budget", "300", "recent", "8"};
    fx f;
    fx_open(&f, backend_of(state), 512, "h2o", h2o, 2);
    follow_counts c = follow_evictions(&f, 1, 700, 1);
    assert_true(c.in_place >= 300);
    assert_true(c.compacted >= 2);
    fx_close(&f);
    const char *const streaming[] = {"n_sink", "5", "window", "250"};
    fx_open(&f, backend_of(state), 512, "streaming", streaming, 2);
    c = follow_evictions(&f, 1, 700, 0);
    assert_true(c.in_place >= 800); /* two layers, 700 - 255 steps that evicted */
    fx_close(&f);
}

/* What the runner of test_step_commit_runner saw. */
typedef struct commit_seen {
    seq *s;
    int storage_calls; /* the application's, before the commit's */
    int calls;
    int savepoint;          /* the pool's, when the runner was called */
    uint32_t before, after; /* list 0's tokens in the host, around the work */
    uint64_t held;          /* seq_tokens_held after the work */
} commit_seen;

static int run_commit(void *ctx, seq_work_kind kind, int (*work)(void *), void *arg)
{
    commit_seen *c = ctx;
    if (kind == SEQ_WORK_STORAGE) {
        assert_int_equal(c->calls, 0);
        c->storage_calls++;
        return work(arg);
    }
    c->calls++;
    c->savepoint = seq_pool(c->s)->sp_active;
    c->before = seq_list_tokens(c->s, 0, 0, NULL);
    int rc = work(arg);
    c->after = seq_list_tokens(c->s, 0, 0, NULL);
    c->held = seq_tokens_held(c->s);
    return rc;
}

/*
 * seq_step in parts, as the store runs it (seq.h seq_step_plan): once the
 * storage follows the decision, seq_step_finish hands the host's commit to
 * the caller's runner, which may let the store's lock go around it. By
 * then the storage's transaction has ended (the pool's savepoint, one per
 * pool, is free for another sequence's step). The host's lists are the
 * decision's until the work runs and cut after it;
 * until finish returns seq_tokens_held answers the count at the plan (a
 * snapshot beside the commit reads nothing it changes); after, the new
 * count, a new epoch, and every kept token reads back its values.
 */
static void test_step_commit_runner(void **state)
{
    const char *const kv[] = {"n_sink", "2", "window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 64, "streaming", kv, 2);
    append(&f, 12);
    uint64_t epoch = seq_epoch(f.s);
    commit_seen c = {.s = f.s};
    seq_step_input in = {.confidence = -1.0};
    seq_step_job *job;
    status st;
    uint32_t evicted;
    assert_int_equal(seq_step_plan(f.s, &in, &job, &st), ST_OK);
    seq_step_decide(job);
    assert_int_equal(seq_step_finish(job, run_commit, &c, &evicted, &st), ST_OK);
    assert_int_equal(c.storage_calls, 1);
    assert_int_equal(c.calls, 1);
    assert_int_equal(c.savepoint, 0);
    assert_int_equal(c.before, 12);
    assert_int_equal(c.after, 6);
    assert_int_equal(c.held, 12 * nlists(&f));
    assert_int_equal(evicted, 6 * nlists(&f));
    assert_int_equal(seq_tokens_held(f.s), 6 * nlists(&f));
    assert_int_equal(seq_epoch(f.s), epoch + 1);
    for (uint32_t l = 0; l < seq_layers(f.s); l++)
        for (uint32_t k = 0; k < f.heads; k++) {
            assert_int_equal(seq_list_tokens(f.s, l, k, NULL), 6);
            check_list(&f, l, k);
        }
    fx_close(&f);
}

/* What a runner that applies the storage detached (as the store's does
 * without its lock) saw. */
typedef struct detach_seen {
    seq *s;
    int detached;       /* seq_detach took the reserve */
    int needs_lock;     /* the work asked to run again under the lock */
    uint32_t taken;     /* blocks the work took from the reserve */
    uint32_t nfree_in;  /* the pool's free blocks after the detach */
    uint32_t nfree_out; /* and before the attach */
} detach_seen;

static int run_detached(void *ctx, seq_work_kind kind, int (*work)(void *), void *arg)
{
    detach_seen *c = ctx;
    if (kind != SEQ_WORK_STORAGE)
        return work(arg);
    c->detached = seq_detach(c->s) == 0;
    c->nfree_in = seq_pool(c->s)->nfree;
    int rc = work(arg);
    c->nfree_out = seq_pool(c->s)->nfree;
    c->taken = c->s->detached.cap - c->s->detached.n;
    seq_attach(c->s);
    if (rc == SEQ_WORK_NEEDS_LOCK) {
        c->needs_lock++;
        rc = work(arg);
    }
    return rc;
}

/* A prompt's step with the scores of round 0 (append_step's) through
 * run; returns the tokens it evicted. */
static uint32_t prefill_with(fx *f, seq_step_runner run, void *ctx)
{
    size_t n = seq_step_floats(f->s, POLICY_NEEDS_SCORE);
    float *data = malloc((n + 1) * sizeof *data);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (float)((i * 7) % 11) / 11.0f;
    seq_step_input in = {
        .arrays = POLICY_NEEDS_SCORE, .prefill = 1, .score_queries = 1, .data = data, .nfloats = n};
    seq_step_job *job;
    status st;
    uint32_t evicted;
    assert_int_equal(seq_step_plan(f->s, &in, &job, &st), ST_OK);
    seq_step_decide(job);
    if (seq_step_finish(job, run, ctx, &evicted, &st) != ST_OK)
        fail_msg("finish: %s", st.msg);
    free(data);
    return evicted;
}

/*
 * A prompt's step applied detached from the pool (seq.h seq_detach, as the
 * store applies a long one without its lock), against the same step
 * applied attached: h2o's prompt evicts scattered tokens and compacts the
 * survivors into fresh blocks, which come from the reserve (the pool's free
 * stack untouched from detach to attach); after the attach the two
 * sequences, and then their decode steps, are alike in tokens, tiers,
 * values, blocks and the pool's free blocks. With int8=on the decision
 * quantises, which detached work leaves, unchanged, to a second call under
 * the lock; in a pool too full to spare the reserve the sequence stays
 * attached.
 */
static void test_step_applied_detached(void **state)
{
    const char *const plain[] = {"budget", "120", "recent", "8"};
    const char *const int8[] = {"budget", "120", "recent", "8", "int8", "on", "int8_window", "8"};
    struct {
        const char *const *kv;
        size_t npairs;
        uint32_t blocks;
        int detached, needs_lock;
    } cases[] = {{plain, 2, 1024, 1, 0}, {int8, 4, 1024, 1, 1}, {plain, 2, 300, 0, 0}};
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        fx a, b;
        fx_open(&a, backend_of(state), cases[t].blocks, "h2o", cases[t].kv, cases[t].npairs);
        fx_open(&b, backend_of(state), cases[t].blocks, "h2o", cases[t].kv, cases[t].npairs);
        append(&a, 400);
        append(&b, 400);
        detach_seen c = {.s = a.s};
        uint32_t ea = prefill_with(&a, run_detached, &c);
        assert_int_equal(ea, prefill_with(&b, NULL, NULL));
        assert_true(ea >= 2 * 270);
        assert_int_equal(c.detached, cases[t].detached);
        assert_int_equal(c.needs_lock, cases[t].needs_lock);
        assert_false(seq_detached(a.s));
        if (cases[t].detached) {
            assert_int_equal(c.nfree_in, c.nfree_out);
            if (!cases[t].needs_lock)
                assert_true(c.taken > 0); /* the compaction's fresh blocks */
        }
        assert_same_seq(&a, &b);
        assert_int_equal(a.p->nfree, b.p->nfree);
        for (uint32_t r = 1; r <= 6; r++) {
            append_step(&a, r);
            append_step(&b, r);
        }
        assert_same_seq(&a, &b);
        assert_int_equal(a.p->nfree, b.p->nfree);
        fx_close(&a);
        fx_close(&b);
    }
}

/*
 * The blocks of a detached sequence's transaction: taken from the reserve
 * and given back in it, all as they were after a rollback; after the end,
 * the attach gives the pool the unused reserve and the given blocks, and
 * the taken ones stay taken.
 */
static void test_detached_blocks_roll_back(void **state)
{
    const char *const kv[] = {"n_sink", "2", "window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 256, "streaming", kv, 2);
    append(&f, 40);
    uint32_t free0 = f.p->nfree;
    assert_int_equal(seq_detach(f.s), 0);
    assert_true(seq_detached(f.s));
    assert_int_equal(seq_detach(f.s), -1); /* once */
    uint32_t reserve = seq_free_blocks(f.s);
    assert_true(reserve > 2);
    assert_int_equal(f.p->nfree, free0 - reserve);
    uint32_t own = seq_list_at(f.s, 0, 0)->segs[0].block;
    for (int round = 0; round < 2; round++) {
        seq_begin(f.s);
        uint32_t b1, b2;
        assert_int_equal(seq_take_block(f.s, &b1), 0);
        assert_int_equal(seq_take_block(f.s, &b2), 0);
        assert_int_not_equal(b1, b2);
        seq_give_block(f.s, b1);
        seq_give_block(f.s, own);
        assert_int_equal(seq_free_blocks(f.s), reserve - 2);
        assert_int_equal(f.p->nfree, free0 - reserve); /* the pool untouched */
        if (round == 0) {
            seq_rollback(f.s);
            assert_int_equal(seq_free_blocks(f.s), reserve);
            assert_int_equal(f.s->detached.ngiven, 0);
            continue;
        }
        seq_end(f.s);
        /* b1 and own wait for the attach; b2 is the sequence's now. */
        assert_int_equal(f.s->detached.ngiven, 2);
        seq_attach(f.s);
        assert_false(seq_detached(f.s));
        assert_int_equal(f.p->nfree, free0 + 1 - 1); /* own and b1 back, b2 taken */
        /* Put the list's block back where the test took it from. */
        uint32_t again;
        assert_int_equal(pool_alloc_block(f.p, &again), 0);
        assert_true(again == own || again == b1);
        if (again != own) {
            pool_free_block(f.p, again);
            pool_alloc_block(f.p, &again);
        }
        pool_free_block(f.p, b2);
    }
    fx_close(&f);
}

/* seq_give_back_blocks (the store's, under its lock, before it destroys a
 * released sequence without it): every block, held and retired, back in the
 * pool once; seq_destroy after it gives none twice (fx_close checks the
 * pool's count again). */
static void test_give_back_then_destroy(void **state)
{
    const char *const kv[] = {"n_sink", "2", "window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 64, "streaming", kv, 2);
    append(&f, 40);
    seq_step_input in = {.confidence = -1.0};
    uint32_t evicted;
    status st;
    assert_int_equal(seq_step(f.s, &in, &evicted, &st), ST_OK);
    assert_true(evicted > 0);
    assert_true(seq_retired_count(f.s) > 0);
    assert_true(f.p->nfree < f.p->block_count);
    seq_give_back_blocks(f.s);
    assert_int_equal(f.p->nfree, f.p->block_count);
    assert_int_equal(seq_blocks_held(f.s), 0);
    assert_int_equal(seq_retired_count(f.s), 0);
    fx_close(&f);
}

/* Segments of tier t in list (l, 0), and the distinct blocks they use. */
static uint32_t tier_segments(fx *f, uint32_t l, uint8_t t, uint32_t *blocks)
{
    const seq_list *ly = seq_list_at(f->s, l, 0);
    uint32_t n = 0, *b = malloc((ly->nsegs + 1) * sizeof *b);
    assert_non_null(b);
    for (size_t i = 0; i < ly->nsegs; i++)
        if (ly->seg_tier[i] == t)
            b[n++] = ly->segs[i].block;
    qsort(b, n, sizeof *b, cmp_u32);
    *blocks = 0;
    for (uint32_t i = 0; i < n; i++)
        *blocks += i == 0 || b[i] != b[i - 1];
    free(b);
    return n;
}

/*
 * int8=on: h2o's decode steps evict tokens stored in INT8 blocks (among the
 * first 60 positions, all INT8 by then: position_score's mode 2, whose last
 * victims are segments of one token that go whole) and then full-precision
 * ones, and a step whose decision keeps every other token in its tier cuts
 * them out of the segments in place (list_apply_tiered_evictions): after
 * 40 such steps of two 600-token lists nothing was re-quantised (the
 * rule's slack), most steps moved no token (the others demoted a block)
 * and could answer with their cuts (a list that went through list_apply
 * cannot), the INT8 tokens sit in more segments than blocks (cut in place,
 * not re-blocked), and follow_evictions' checks hold: every held token
 * reads back its values within one quantisation (a segment whose tier went
 * astray in a split or a removal reads INT8 codes as full precision, or
 * the reverse), maximal segments, blocks that left the list retired.
 */
static void test_int8_evictions_cut_in_place(void **state)
{
    const char *const kv[] = {"budget", "600", "recent", "8", "int8", "on", "int8_window", "8"};
    fx f;
    fx_open(&f, backend_of(state), 512, "h2o", kv, 4);
    follow_counts c = follow_evictions(&f, 1, 640, 2);
    assert_int_equal(seq_tier_report(f.s)->requantized, 0);
    assert_true(c.in_place >= 2 * 30);
    assert_true(c.cut_steps >= 30);
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t blocks, segs = tier_segments(&f, l, POLICY_INT8, &blocks);
        assert_true(blocks >= 40);
        assert_true(segs >= blocks + 5);
    }
    fx_close(&f);
}

/* Lists l of a and b have the same segments but for where their blocks
 * lie: as many, of the same tiers and lengths (segments both sides keep
 * maximal). */
static void assert_same_segments(fx *a, fx *b, uint32_t l)
{
    seq_list_view va, vb;
    seq_list_view_get(a->s, l, 0, &va);
    seq_list_view_get(b->s, l, 0, &vb);
    assert_int_equal(va.nsegs, vb.nsegs);
    assert_memory_equal(va.seg_tier, vb.seg_tier, va.nsegs);
    for (size_t j = 0; j < va.nsegs; j++)
        assert_int_equal(va.segs[j].count, vb.segs[j].count);
}

/* The last demotion's moves (seq_demotion_moves) say where each moved
 * token of the lists is now: every run's tokens are in its block, at its
 * slots, in its tier. Returns the tokens they name. */
static uint32_t check_moves(fx *f, uint64_t from)
{
    seq_moves mv;
    assert_true(seq_demotion_moves(f->s, &mv));
    assert_int_equal(mv.from_epoch, from);
    assert_int_equal(mv.to_epoch, seq_epoch(f->s));
    uint32_t named = 0;
    for (size_t r = 0; r < mv.n; r++) {
        const seq_moved_run *m = &mv.runs[r];
        assert_true(m->list < 2);
        seq_list_view v;
        seq_list_view_get(f->s, m->list, 0, &v);
        for (uint32_t t = 0; t < m->count; t++) {
            uint32_t i = m->first + t, base = 0;
            size_t j = 0;
            while (j < v.nsegs && base + v.segs[j].count <= i)
                base += v.segs[j++].count;
            assert_true(j < v.nsegs);
            assert_int_equal(v.segs[j].block, m->block);
            assert_int_equal(v.segs[j].first_slot + (i - base), m->first_slot + t);
            assert_int_equal(v.seg_tier[j], m->tier);
        }
        named += m->count;
    }
    return named;
}

/*
 * The demoter's demotion works on the lists' segments (seq_demote.c): h2o
 * with int8=on, whose decode steps evict INT8 tokens (position_score's
 * mode 2) and full-precision ones, so that its INT8 tokens sit in split
 * segments, two tokens appended a step, each step's demotion left to
 * seq_demote_due. After every step the sequence holds what the same steps
 * give when they demote themselves (assert_same_holdings: tiers, values,
 * bytes, retired blocks), in the same segments. With a window of 3 the full-precision
 * tokens left after a demotion are spread over more 4-token blocks than the
 * compaction rule allows in some rounds: those lists are compacted after the
 * demotion, as the step compacts them.
 */
static void test_demotion_on_the_segments(void **state)
{
    const char *const kv[] = {"budget", "400", "recent", "3", "int8", "on", "int8_window", "150"};
    fx in, f;
    fx_open(&in, backend_of(state), 256, "h2o", kv, 4);
    fx_open(&f, backend_of(state), 256, "h2o", kv, 4);
    seq_set_demote_after_step(f.s, 1);
    status st;
    uint64_t demoted = 0;
    for (uint32_t round = 0; seq_appended(f.s) + 2 <= 900; round++) {
        append(&in, 2);
        append(&f, 2);
        uint32_t evicted = step_scored(&in, round, 0);
        assert_int_equal(step_scored(&f, round, 0), evicted);
        uint64_t before = seq_tier_report(f.s)->moved[POLICY_INT8], from = seq_epoch(f.s);
        assert_int_equal(seq_demote_due(f.s, from + 1, &st), ST_OK);
        uint64_t moved = seq_tier_report(f.s)->moved[POLICY_INT8] - before;
        demoted += moved > 0;
        /* What it moved, as the worker learns it: every token it demoted. */
        if (moved > 0)
            assert_int_equal(check_moves(&f, from), moved);
        /* A step that evicts and demotes moves the epoch once; here the
         * demotion moves it again. */
        assert_same_holdings(&in, &f, 0);
        for (uint32_t l = 0; l < 2; l++)
            assert_same_segments(&in, &f, l);
        seq_ack(in.s, seq_epoch(in.s));
        seq_ack(f.s, seq_epoch(f.s));
    }
    assert_true(demoted >= 15);
    fx_close(&in);
    fx_close(&f);
}

/* Take all but `leave` of the pool's free blocks into held[] (room for
 * the pool's blocks); returns how many. */
static uint32_t pool_hold(fx *f, uint32_t leave, uint32_t *held)
{
    uint32_t n = 0;
    while (f->p->nfree > leave)
        assert_int_equal(pool_alloc_block(f->p, &held[n++]), 0);
    return n;
}

static void pool_give(fx *f, uint32_t *held, uint32_t n)
{
    while (n > 0)
        pool_free_block(f->p, held[--n]);
}

/*
 * A demotion that leaves a list's full-precision tokens over the
 * compaction rule compacts them, as the step's own order does (seq_demote.c
 * publish_list). int8=on, window 4, 4-token blocks: 24 tokens, of which an
 * operator's eviction (with the pool held empty: nothing compacted or
 * demoted) takes 13..15, 17..19, 21 and 22; then a step (the pool held to
 * two blocks: the demotion is left due, the compaction it needs is
 * skipped). The demotion (0..11 to INT8) leaves 12, 16, 20 and 23 in three
 * blocks where two are allowed: it compacts them into one, and every held
 * token reads back its values.
 */
static void test_demotion_compacts(void **state)
{
    const char *const kv[] = {"int8", "on", "int8_window", "4"};
    fx f;
    fx_open(&f, backend_of(state), 64, "full", kv, 2);
    seq_set_demote_after_step(f.s, 1);
    uint32_t held[64], nheld;
    status st;
    append(&f, 24);
    nheld = pool_hold(&f, 0, held);
    uint64_t epoch = seq_epoch(f.s) + 1;
    for (uint32_t l = 0; l < 2; l++) {
        const policy_decision *d;
        assert_int_equal(seq_policy_layer_step(f.s, l, &d, &st), ST_OK);
        for (uint32_t i = 13; i < 23; i++)
            if (i != 16 && i != 20)
                d->tier[0][i] = POLICY_EVICT;
        size_t evicted = 0;
        int changed = 0;
        assert_int_equal(seq_apply_decision(f.s, l, d, epoch, &evicted, &changed, &st), ST_OK);
        assert_int_equal(evicted, 8);
    }
    seq_publish_epoch(f.s, epoch);
    pool_give(&f, held, nheld);
    nheld = pool_hold(&f, 2, held);
    step_silent(&f);
    pool_give(&f, held, nheld);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(check_list(&f, l, 0), 0);
        assert_true(list_compact_due(f.s, seq_list_at(f.s, l, 0)));
    }
    assert_int_equal(seq_demote_due(f.s, seq_epoch(f.s) + 1, &st), ST_OK);
    seq_moves mv;
    assert_false(seq_demotion_moves(f.s, &mv)); /* compacted: the table is read again */
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(check_list(&f, l, 0), 12);
        assert_false(list_compact_due(f.s, seq_list_at(f.s, l, 0)));
        uint32_t blocks;
        tier_segments(&f, l, POLICY_FULL, &blocks);
        assert_int_equal(blocks, 1);
    }
    fx_close(&f);
}

/*
 * victims=int8 and a demotion of victims alone: it changes no table and
 * publishes no epoch, unless a list it finishes was over the compaction
 * rule: then it compacts the list, which changes its table, and publishes
 * the next epoch. h2o, five tokens appended and scattered evictions a
 * step, the pool held to two blocks at each step (which then compacts
 * nothing) and given back for the demotion; demotions come both ways.
 */
static void test_victims_demotion_epochs(void **state)
{
    const char *const kv[] = {"budget", "24", "recent", "3", "victims", "int8"};
    fx f;
    fx_open(&f, backend_of(state), 128, "h2o", kv, 3);
    seq_set_demote_after_step(f.s, 1);
    uint32_t held[128], quiet = 0, compacting = 0;
    status st;
    for (uint32_t round = 0; seq_appended(f.s) + 5 <= 300; round++) {
        append(&f, 5);
        uint32_t nheld = pool_hold(&f, 2, held);
        step_scored(&f, round, 0);
        pool_give(&f, held, nheld);
        int over = 0;
        for (uint32_t l = 0; l < 2; l++)
            over |= list_compact_due(f.s, seq_list_at(f.s, l, 0));
        uint64_t epoch = seq_epoch(f.s), moved = seq_tier_report(f.s)->moved[POLICY_INT8];
        assert_int_equal(seq_demote_due(f.s, epoch + 1, &st), ST_OK);
        if (seq_tier_report(f.s)->moved[POLICY_INT8] == moved)
            continue;
        assert_int_equal(seq_epoch(f.s), epoch + (uint64_t)over);
        quiet += !over;
        compacting += (uint32_t)over;
        for (uint32_t l = 0; l < 2; l++) {
            check_list(&f, l, 0);
            assert_false(list_compact_due(f.s, seq_list_at(f.s, l, 0)));
        }
        seq_ack(f.s, seq_epoch(f.s));
    }
    if (quiet < 3 || compacting < 3)
        fail_msg("%u demotions without a table change, %u with one", quiet, compacting);
    fx_close(&f);
}

/*
 * victims=sketch and victims=int8: StreamingLLM's decode steps put their
 * victim in the list's sketch, or keep it where it is stored (quantised a
 * block's worth at a time), and cut it out of the segments in place
 * (list_apply_tiered_evictions, offload_victims, quantize_victims), so each
 * step can answer with its cuts (a list that went through list_apply
 * cannot); every victim is an offloaded one, in position order, and
 * follow_evictions' checks hold. test_revive_sketch_victims,
 * test_revive_int8_victims_and_destroy and test_faults' "victims=" cases
 * check what the victims hold, the blocks they keep and free, and the undo.
 */
static void test_victims_cut_in_place(void **state)
{
    const char *const modes[] = {"sketch", "int8"};
    for (size_t m = 0; m < 2; m++) {
        const char *const kv[] = {"n_sink", "5", "window", "250", "victims", modes[m]};
        fx f;
        fx_open(&f, backend_of(state), 512, "streaming", kv, 3);
        follow_counts c = follow_evictions(&f, 1, 300, 0);
        if (c.cut_steps < 40) /* of the 45 that evicted */
            fail_msg("victims=%s: %u steps answered with cuts", modes[m], c.cut_steps);
        for (uint32_t l = 0; l < 2; l++) {
            seq_list_view v;
            seq_list_view_get(f.s, l, 0, &v);
            assert_int_equal(v.noffloaded, 300 - 255);
            for (uint32_t j = 0; j < v.noffloaded; j++)
                assert_int_equal(v.offloaded[j], 5 + j);
        }
        uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
        seq_tier_usage(f.s, tokens, bytes);
        if (m == 1) /* 45 victims a list: three INT8 blocks of 12, 9 waiting */
            assert_int_equal(tokens[POLICY_INT8], 2 * 36);
        fx_close(&f);
    }
}

/* Evict, by an operator's decision on layer 0, the INT8 tokens i < n with
 * i % every == 0; returns the tokens the decision evicted. */
static size_t evict_every(fx *f, uint32_t n, uint32_t every)
{
    const policy_decision *d;
    status st;
    assert_int_equal(seq_policy_layer_step(f->s, 0, &d, &st), ST_OK);
    for (uint32_t i = 0; i < n; i++)
        if (i % every == 0)
            d->tier[0][i] = POLICY_EVICT;
    uint64_t epoch = seq_epoch(f->s) + 1;
    size_t evicted = 0;
    int changed = 0;
    assert_int_equal(seq_apply_decision(f->s, 0, d, epoch, &evicted, &changed, &st), ST_OK);
    seq_publish_epoch(f->s, epoch);
    return evicted;
}

/*
 * A long list's INT8 tokens are re-quantised only past the slack of a
 * sixteenth of the blocks they fill (seq_apply.c compact_slack): 480 INT8
 * tokens in 40 blocks; evicting 24 (one in 20, from 24 blocks) leaves 456
 * that fill 38, two beyond, within the slack of two: nothing re-quantised,
 * the tokens where they were (one block beyond, the rule of a short list,
 * would re-quantise all of them every 12 evictions of a long decode, and
 * their error would grow with each round). 12 more evicted (444 fill 37,
 * three beyond): all 444 re-quantised into 37 fresh blocks.
 */
static void test_int8_requantize_slack(void **state)
{
    fx f;
    uint32_t blocks;
    open_demoted(&f, state, 512, 480); /* 0..479 in 40 INT8 blocks */
    assert_int_equal(evict_every(&f, 480, 20), 24);
    assert_int_equal(seq_tier_report(f.s)->requantized, 0);
    tier_segments(&f, 0, POLICY_INT8, &blocks);
    assert_int_equal(blocks, 40);
    assert_int_equal(check_list(&f, 0, 0), 456);
    assert_int_equal(evict_every(&f, 456, 38), 12);
    assert_int_equal(seq_tier_report(f.s)->requantized, 444);
    tier_segments(&f, 0, POLICY_INT8, &blocks);
    assert_int_equal(blocks, 37);
    assert_int_equal(check_list_rounds(&f, 0, 0, 2), 444);
    fx_close(&f);
}

static void test_move_reviver(void **state)
{
    const char *const kv[] = {"budget", "8", "slack", "0", "buckets", "16"};
    fx a, b;
    fx_open(&a, backend_of(state), 64, "reviver", kv, 3);
    for (uint32_t i = 0; i < 24; i++)
        append_step(&a, i);
    uint64_t tokens[POLICY_TIERS], bytes[POLICY_TIERS];
    seq_tier_usage(a.s, tokens, bytes);
    assert_true(tokens[POLICY_SKETCH] > 0);
    move_to(&a, &b, state);
    assert_true(assert_same(&a, &b) > 0);
    for (uint32_t i = 24; i < 34; i++) {
        append_step(&a, i);
        append_step(&b, i);
    }
    assert_true(assert_same(&a, &b) > 0);
    fx_close(&a);
    fx_close(&b);
}

/* A list's sketch cells as bytes (tier_sketch_save). */
static uint8_t *sketch_bytes(const seq_list *ly)
{
    uint8_t *b = malloc(tier_sketch_bytes(&ly->sketch));
    assert_non_null(b);
    assert_int_equal(tier_sketch_save(&ly->sketch, b), 0);
    return b;
}

/*
 * A call's undo of a sketch (seq_txn_save_sketch): the cells a few
 * positions touch, saved one write at a time, then, past half the sketch,
 * one copy of the whole; a rollback puts back the copy and then the older
 * cells, so every byte is as before the call. With cells only, the same.
 */
static void test_sketch_undo(void **state)
{
    fx f;
    open_sketch_victims(&f, state);
    seq_list *ly = &f.s->lists[0];
    size_t bytes = tier_sketch_bytes(&ly->sketch);
    uint8_t *was = sketch_bytes(ly);
    uint32_t few[2] = {1, 5}, many[3000];
    for (uint32_t i = 0; i < 3000; i++)
        many[i] = 100 + i; /* 9,000 cells: past half of 3 x 4096 */
    for (int whole = 0; whole < 2; whole++) {
        seq_begin(f.s);
        assert_int_equal(seq_txn_save_sketch(f.s, ly, few, 2), 0);
        assert_int_equal(tier_sketch_delete(&ly->sketch, few, 2), 0);
        if (whole) {
            assert_int_equal(seq_txn_save_sketch(f.s, ly, many, 3000), 0);
            assert_int_equal(tier_sketch_delete(&ly->sketch, many, 3000), 0);
        } else {
            assert_int_equal(seq_txn_save_sketch(f.s, ly, few + 1, 1), 0);
            assert_int_equal(tier_sketch_delete(&ly->sketch, few + 1, 1), 0);
        }
        uint8_t *changed = sketch_bytes(ly);
        assert_memory_not_equal(changed, was, bytes);
        free(changed);
        seq_rollback(f.s);
        uint8_t *now = sketch_bytes(ly);
        assert_memory_equal(now, was, bytes);
        free(now);
    }
    free(was);
    fx_close(&f);
}

/* Segments [first, first + nold) of a list replaced by out[0..nout), as
 * a cut in place does (seq_apply.c list_put_pieces), after its save. */
static void cut_segments(seq *s, seq_list *ly, size_t first, size_t nold, const kv_segment *out,
                         size_t nout)
{
    assert_int_equal(list_reserve(ly, ly->nsegs + nout), 0);
    assert_int_equal(seq_txn_save_cut(s, ly, first, nold, nout), 0);
    size_t after = ly->nsegs - first - nold;
    memmove(&ly->segs[first + nout], &ly->segs[first + nold], after * sizeof *ly->segs);
    memmove(&ly->seg_tier[first + nout], &ly->seg_tier[first + nold], after);
    memcpy(&ly->segs[first], out, nout * sizeof *out);
    memset(&ly->seg_tier[first], POLICY_INT8, nout); /* a tier the list did not have */
    ly->nsegs = first + nout + after;
}

/*
 * A call's undo of cuts in place (seq_txn_save_cut): each saves only the
 * segments it replaces; a rollback undoes them newest first, on the list's
 * own arrays, and every segment and tier is as before the call. A later
 * change that saves the whole list (seq_txn_save_list) makes its copy
 * from the list and the cuts, so that a rollback after it also puts back
 * the list as before the cuts. After an end, the cuts stay.
 */
static void test_cut_undo(void **state)
{
    const char *const kv[] = {"n_sink", "2", "window", "400"};
    fx f;
    fx_open(&f, backend_of(state), 256, "streaming", kv, 2);
    append(&f, 120);
    seq_list *ly = seq_list_at(f.s, 0, 0);
    assert_true(ly->nsegs >= 6);
    size_t n0 = ly->nsegs;
    kv_segment was[64];
    uint8_t was_tier[64];
    assert_true(n0 <= 64);
    memcpy(was, ly->segs, n0 * sizeof *was);
    memcpy(was_tier, ly->seg_tier, n0);
    kv_segment split[3] = {{was[1].block, was[1].first_slot, 1},
                           {was[1].block, was[1].first_slot + 2, 1},
                           {was[2].block, was[2].first_slot + 1, 1}};
    for (int round = 0; round < 3; round++) {
        seq_begin(f.s);
        cut_segments(f.s, ly, 1, 2, split, 3);             /* one more segment */
        cut_segments(f.s, ly, ly->nsegs - 2, 2, split, 0); /* two fewer */
        cut_segments(f.s, ly, 0, 1, split + 2, 1);         /* as many */
        assert_int_equal(ly->nsegs, n0 - 1);
        if (round == 1) { /* a whole save after the cuts, then any change */
            assert_int_equal(seq_txn_save_list(f.s, ly), 0);
            ly->nsegs = 1;
            ly->segs[0] = split[0];
        }
        if (round == 2) {
            seq_end(f.s);
            assert_int_equal(ly->nsegs, n0 - 1);
            assert_memory_equal(&ly->segs[0], &split[2], sizeof split[2]);
            assert_memory_equal(&ly->segs[1], split, 3 * sizeof *split);
            assert_memory_equal(&ly->segs[4], &was[3], (n0 - 5) * sizeof *was);
            break;
        }
        seq_rollback(f.s);
        assert_int_equal(ly->nsegs, n0);
        assert_memory_equal(ly->segs, was, n0 * sizeof *was);
        assert_memory_equal(ly->seg_tier, was_tier, n0);
    }
    /* Put the list back as it was for fx_close's count of blocks. */
    memcpy(ly->segs, was, n0 * sizeof *was);
    memcpy(ly->seg_tier, was_tier, n0);
    ly->nsegs = n0;
    fx_close(&f);
}

int main(void)
{
    /* Each test on the host backend, and the ones that move values also on
     * shadow: pool memory there faults unless reached through the ops. */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_append_writes_and_segments),
        cmocka_unit_test(test_cut_undo),
        ON_SHADOW(test_append_writes_and_segments),
        cmocka_unit_test(test_streaming_fresh_slots_retire_ack),
        ON_SHADOW(test_streaming_fresh_slots_retire_ack),
        cmocka_unit_test(test_append_exhausted_changes_nothing),
        cmocka_unit_test(test_append_check),
        cmocka_unit_test(test_per_head_lists_and_step_checks),
        ON_SHADOW(test_per_head_lists_and_step_checks),
        cmocka_unit_test(test_int8_demotion),
        ON_SHADOW(test_int8_demotion),
        cmocka_unit_test(test_demotion_after_step),
        ON_SHADOW(test_demotion_after_step),
        cmocka_unit_test(test_demotion_between_quantised_runs),
        ON_SHADOW(test_demotion_between_quantised_runs),
        cmocka_unit_test(test_demotion_after_step_general_path),
        ON_SHADOW(test_demotion_after_step_general_path),
        cmocka_unit_test(test_int4_demotion),
        ON_SHADOW(test_int4_demotion),
        cmocka_unit_test(test_int2_demotion),
        ON_SHADOW(test_int2_demotion),
        cmocka_unit_test(test_operator_evict_requantizes),
        ON_SHADOW(test_operator_evict_requantizes),
        cmocka_unit_test(test_int8_requantize_slack),
        ON_SHADOW(test_int8_requantize_slack),
        cmocka_unit_test(test_victims_cut_in_place),
        ON_SHADOW(test_victims_cut_in_place),
        cmocka_unit_test(test_revive_sketch_victims),
        ON_SHADOW(test_revive_sketch_victims),
        cmocka_unit_test(test_revive_evicted_outright),
        cmocka_unit_test(test_revive_in_parts),
        ON_SHADOW(test_revive_in_parts),
        cmocka_unit_test(test_revive_int8_victims_and_destroy),
        ON_SHADOW(test_revive_int8_victims_and_destroy),
        cmocka_unit_test(test_revive_in_place),
        ON_SHADOW(test_revive_in_place),
        cmocka_unit_test(test_int8_victims_after_step),
        ON_SHADOW(test_int8_victims_after_step),
        cmocka_unit_test(test_move_sketch_victims),
        ON_SHADOW(test_move_sketch_victims),
        cmocka_unit_test(test_evictions_on_the_segments),
        ON_SHADOW(test_evictions_on_the_segments),
        cmocka_unit_test(test_compactions_spread_over_calls),
        cmocka_unit_test(test_compaction_by_windows),
        ON_SHADOW(test_compaction_by_windows),
        cmocka_unit_test(test_weightedkv_merges_in_place),
        ON_SHADOW(test_weightedkv_merges_in_place),
        cmocka_unit_test(test_evictions_cut_in_place),
        ON_SHADOW(test_evictions_cut_in_place),
        cmocka_unit_test(test_step_commit_runner),
        ON_SHADOW(test_step_commit_runner),
        cmocka_unit_test(test_step_applied_detached),
        ON_SHADOW(test_step_applied_detached),
        cmocka_unit_test(test_detached_blocks_roll_back),
        cmocka_unit_test(test_give_back_then_destroy),
        cmocka_unit_test(test_int8_evictions_cut_in_place),
        cmocka_unit_test(test_demotion_on_the_segments),
        ON_SHADOW(test_demotion_on_the_segments),
        cmocka_unit_test(test_demotion_compacts),
        ON_SHADOW(test_demotion_compacts),
        cmocka_unit_test(test_victims_demotion_epochs),
        ON_SHADOW(test_victims_demotion_epochs),
        ON_SHADOW(test_int8_evictions_cut_in_place),
        cmocka_unit_test(test_tova_takes_the_summed_score),
        cmocka_unit_test(test_statistics_read_in_place),
        cmocka_unit_test(test_layers_on_threads),
        ON_SHADOW(test_layers_on_threads),
        cmocka_unit_test(test_move_reviver),
        cmocka_unit_test(test_sketch_undo),
        ON_SHADOW(test_sketch_undo),
        ON_SHADOW(test_move_reviver),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
