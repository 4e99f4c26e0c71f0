/*
 * test_kernels_attention.c - kv_decode_attention (fast) and _ref against a
 * naive softmax attention written here from the layout's definition alone
 * (kernels.h "Pool layout"), on seeded random pools: fp32, fp16 and bf16,
 * all-heads lists with grouped-query attention, per-head row layouts, random
 * segment lists (odd sizes, empty lists), and scores far apart (the online
 * softmax must not overflow). Tiered lists (kernels.h: FULL, INT8, INT4 and INT2
 * segments mixed): the reference equals itself over the same tokens
 * dequantised into an fp32 pool, the fast version is within tolerance of
 * it over both;
 * tiers == NULL against all-FULL tiers; the generic and AVX2 builds
 * against each other within the tolerance (the AVX2 one fuses
 * multiply-adds, the generic one does not: kernels.h), threads against one
 * thread bit for bit. Every test runs under each ISA build (run_each_isa).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "test_kernels_harness.h"

/* ---- a random pool and list ---- */

typedef struct fixture {
    kv_layout l;
    kv_dtype t;
    uint32_t blocks, q_heads;
    uint8_t *pool;
    kv_segment segs[64];
    size_t nsegs, n;
    float *q;
} fixture;

/* Fill the pool with values in [-amp, amp], stored in the pool's dtype. */
static void fixture_fill(rng *r, fixture *f, float amp)
{
    size_t elts = kv_block_bytes(&f->l) * f->blocks / f->l.elt_size;
    for (size_t i = 0; i < elts; i++)
        kv_elt_store(f->pool + i * f->l.elt_size, f->t, amp * rng_float(r));
}

/* A random list: distinct (block, slot) runs, some blocks skipped, runs of
 * random length, in random block order; maybe empty. */
static void random_list(rng *r, fixture *f)
{
    f->nsegs = 0;
    f->n = 0;
    uint32_t bt = f->l.block_tokens;
    for (uint32_t b = 0; b < f->blocks && f->nsegs < 64; b++) {
        uint32_t blk = (b * 7 + 3) % f->blocks; /* a permutation: blocks is odd */
        if (rng_below(r, 4) == 0)
            continue;
        uint32_t first = rng_below(r, bt), count = 1 + rng_below(r, bt - first);
        f->segs[f->nsegs++] = (kv_segment){blk, first, count};
        f->n += count;
    }
}

static void fixture_make(rng *r, fixture *f, kv_dtype t, uint32_t kv_heads, uint32_t group,
                         uint32_t block_tokens, uint32_t head_dim)
{
    memset(f, 0, sizeof *f);
    f->t = t;
    f->l = (kv_layout){kv_heads, block_tokens, head_dim, dtype_size(t), 0};
    f->blocks = 9;
    f->q_heads = kv_heads * group;
    f->pool = malloc(kv_block_bytes(&f->l) * f->blocks);
    f->q = malloc((size_t)f->q_heads * head_dim * sizeof *f->q);
    assert_non_null(f->pool);
    assert_non_null(f->q);
    fixture_fill(r, f, 1.0f);
    for (size_t i = 0; i < (size_t)f->q_heads * head_dim; i++)
        f->q[i] = 2.0f * rng_float(r);
    random_list(r, f);
}

static void fixture_free(fixture *f)
{
    free(f->pool);
    free(f->q);
}

/* ---- the naive attention, from the layout's definition ---- */

/* Element c of the K (v = 0) or V (v = 1) row of (block, head, slot):
 * block b is [K: kv_heads][block_tokens][head_dim] then V alike. */
static double naive_elt(const fixture *f, uint32_t block, uint32_t head, uint32_t slot, uint32_t c,
                        int v)
{
    const kv_layout *l = &f->l;
    size_t per_part = (size_t)l->kv_heads * l->block_tokens * l->head_dim;
    size_t idx = (size_t)block * 2 * per_part + (size_t)v * per_part +
                 ((size_t)head * l->block_tokens + slot) * l->head_dim + c;
    return kv_elt_load(f->pool + idx * l->elt_size, f->t);
}

/* out [q_heads][d] and probs [q_heads][n], in double: query head h reads KV
 * head h / (q_heads / kv_heads). */
static void naive_attention(const fixture *f, float scale, double *out, double *probs)
{
    uint32_t d = f->l.head_dim, group = f->q_heads / f->l.kv_heads;
    for (uint32_t h = 0; h < f->q_heads; h++) {
        uint32_t g = h / group;
        double *s = probs + (size_t)h * f->n, mx = -INFINITY, sum = 0;
        size_t i = 0;
        for (size_t k = 0; k < f->nsegs; k++)
            for (uint32_t j = 0; j < f->segs[k].count; j++, i++) {
                double dot = 0;
                for (uint32_t c = 0; c < d; c++)
                    dot += f->q[(size_t)h * d + c] *
                           naive_elt(f, f->segs[k].block, g, f->segs[k].first_slot + j, c, 0);
                s[i] = dot * scale;
                if (s[i] > mx)
                    mx = s[i];
            }
        for (i = 0; i < f->n; i++)
            sum += s[i] = exp(s[i] - mx);
        for (i = 0; i < f->n; i++)
            s[i] /= sum;
        for (uint32_t c = 0; c < d; c++) {
            double acc = 0;
            i = 0;
            for (size_t k = 0; k < f->nsegs; k++)
                for (uint32_t j = 0; j < f->segs[k].count; j++, i++)
                    acc +=
                        s[i] * naive_elt(f, f->segs[k].block, g, f->segs[k].first_slot + j, c, 1);
            out[(size_t)h * d + c] = f->n ? acc : 0.0;
        }
    }
}

typedef void (*attention_fn)(const kv_layout *, kv_dtype, const uint8_t *, const kv_segment *,
                             size_t, const uint8_t *, const float *, uint32_t, float, float *,
                             float *);

/* Run `fn` with and without probs and compare both with the naive result:
 * outputs within tol (values are in [-1, 1]), probabilities within tol, and
 * the same output whether probs is asked for or not, and whether tiers is
 * NULL or says KV_TIER_FULL for every segment. */
static void check_against_naive(const fixture *f, attention_fn fn, float scale, double tol)
{
    uint32_t d = f->l.head_dim;
    size_t no = (size_t)f->q_heads * d, np = (size_t)f->q_heads * (f->n ? f->n : 1);
    double *want = malloc(no * sizeof *want), *wantp = malloc(np * sizeof *wantp);
    float *got = malloc(no * sizeof *got), *got2 = malloc(no * sizeof *got2);
    float *gotp = malloc(np * sizeof *gotp), *gotp3 = malloc(np * sizeof *gotp3);
    float *got3 = malloc(no * sizeof *got3);
    uint8_t full[64] = {0}; /* KV_TIER_FULL for every segment */
    assert_true(want && wantp && got && got2 && gotp && got3 && gotp3);
    naive_attention(f, scale, want, wantp);
    fn(&f->l, f->t, f->pool, f->segs, f->nsegs, NULL, f->q, f->q_heads, scale, got, gotp);
    fn(&f->l, f->t, f->pool, f->segs, f->nsegs, NULL, f->q, f->q_heads, scale, got2, NULL);
    fn(&f->l, f->t, f->pool, f->segs, f->nsegs, full, f->q, f->q_heads, scale, got3, gotp3);
    assert_memory_equal(got, got3, no * sizeof *got);
    assert_memory_equal(gotp, gotp3, (size_t)f->q_heads * f->n * sizeof *gotp);
    for (size_t i = 0; i < no; i++) {
        if (!(fabs(got[i] - want[i]) <= tol))
            fail_msg("out[%zu] = %.9g, naive %.9g (n=%zu d=%u q=%u kv=%u bt=%u dtype=%d)", i,
                     (double)got[i], want[i], f->n, d, f->q_heads, f->l.kv_heads, f->l.block_tokens,
                     (int)f->t);
        assert_true(got[i] == got2[i]);
    }
    for (uint32_t h = 0; h < f->q_heads; h++) {
        double sum = 0;
        for (size_t i = 0; i < f->n; i++) {
            size_t k = (size_t)h * f->n + i;
            if (!(fabs(gotp[k] - wantp[k]) <= tol))
                fail_msg("probs[%u][%zu] = %.9g, naive %.9g", h, i, (double)gotp[k], wantp[k]);
            sum += gotp[k];
        }
        if (f->n > 0)
            assert_true(fabs(sum - 1.0) <= 1e-5);
    }
    free(want);
    free(wantp);
    free(got);
    free(got2);
    free(got3);
    free(gotp);
    free(gotp3);
}

/* ---- tests ---- */

static const kv_dtype k_dtypes[] = {KV_FP32, KV_FP16, KV_BF16};
static const uint32_t k_head_dims[] = {1, 3, 8, 17, 64};
static const uint32_t k_block_tokens[] = {1, 4, 7, 16, 40};
static const uint32_t k_kv_heads[] = {1, 2, 4};
static const uint32_t k_groups[] = {1, 2, 3};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* Every shape, dtype and GQA group on random lists: fast and ref. */
static void test_random_all_heads(void **state)
{
    (void)state;
    rng r = {42};
    for (size_t a = 0; a < N_OF(k_dtypes); a++)
        for (size_t b = 0; b < N_OF(k_head_dims); b++)
            for (size_t c = 0; c < N_OF(k_block_tokens); c++)
                for (size_t e = 0; e < N_OF(k_kv_heads); e++) {
                    fixture f;
                    uint32_t group = k_groups[rng_below(&r, N_OF(k_groups))];
                    fixture_make(&r, &f, k_dtypes[a], k_kv_heads[e], group, k_block_tokens[c],
                                 k_head_dims[b]);
                    float scale = 1.0f / sqrtf((float)k_head_dims[b]);
                    check_against_naive(&f, kv_decode_attention, scale, 2e-6);
                    check_against_naive(&f, kv_decode_attention_ref, scale, 1e-6);
                    fixture_free(&f);
                }
}

/* A per-head list (store.proto LayerTable): a block of the pool seen as one
 * head of kv_heads * block_tokens rows; the group's query heads read it. The
 * naive side addresses rows from the pool layout, independently. */
static void test_per_head_rows(void **state)
{
    (void)state;
    rng r = {7};
    for (size_t a = 0; a < N_OF(k_dtypes); a++)
        for (uint32_t kvh = 1; kvh <= 4; kvh++)
            for (uint32_t group = 1; group <= 3; group++) {
                fixture f;
                uint32_t bt = 1 + rng_below(&r, 9), d = k_head_dims[rng_below(&r, 5)];
                /* The rows view: one head, kvh * bt rows per block. */
                fixture_make(&r, &f, k_dtypes[a], 1, group, kvh * bt, d);
                float scale = 1.0f / sqrtf((float)d);
                check_against_naive(&f, kv_decode_attention, scale, 2e-6);
                check_against_naive(&f, kv_decode_attention_ref, scale, 1e-6);
                /* The same bytes in the pool layout: row r of the view is
                 * (head r / bt, slot r % bt) of the pool's K part. */
                kv_layout pool_l = {kvh, bt, d, f.l.elt_size, 0};
                assert_int_equal(kv_block_bytes(&pool_l), kv_block_bytes(&f.l));
                for (uint32_t row = 0; row < kvh * bt; row++)
                    assert_int_equal(kv_key_offset(&f.l, 2, 0, row),
                                     kv_key_offset(&pool_l, 2, row / bt, row % bt));
                fixture_free(&f);
            }
}

/* Scores hundreds apart: the running max must keep exp() finite, in any
 * chunk order (the largest score first, last, in the middle). */
static void test_far_apart_scores(void **state)
{
    (void)state;
    rng r = {99};
    for (int trial = 0; trial < 24; trial++) {
        fixture f;
        fixture_make(&r, &f, KV_FP32, 2, 2, 16, 8);
        fixture_fill(&r, &f, 60.0f); /* |q.k| up to 2 * 60 * 8 */
        for (size_t i = 0; i < (size_t)f.q_heads * 8; i++)
            f.q[i] = 2.0f * rng_float(&r);
        random_list(&r, &f);
        /* Scores near 1000 carry float rounding of ~1e-4 into exp(), so the
         * tolerance is relative to the values' size (60) and a little wider;
         * what matters here is that nothing overflows to inf or nan. */
        check_against_naive(&f, kv_decode_attention, 1.0f, 60 * 2e-5);
        check_against_naive(&f, kv_decode_attention_ref, 1.0f, 60 * 1e-6);
        fixture_free(&f);
    }
}

/* Long segments: many chunks of one segment, then tokens one by one. */
static void test_long_and_single(void **state)
{
    (void)state;
    rng r = {5};
    fixture f;
    fixture_make(&r, &f, KV_FP16, 2, 4, 200, 16);
    f.nsegs = 0;
    f.n = 0;
    f.segs[f.nsegs++] = (kv_segment){4, 3, 197};
    f.n += 197;
    for (uint32_t i = 0; i < 40; i++) {
        f.segs[f.nsegs++] = (kv_segment){(i * 5) % 9, (i * 37) % 200, 1};
        f.n++;
    }
    check_against_naive(&f, kv_decode_attention, 0.25f, 2e-6);
    check_against_naive(&f, kv_decode_attention_ref, 0.25f, 1e-6);
    fixture_free(&f);
}

/* Groups wider than one walk takes (ATTN_STATE = 64 query heads, units of
 * 16): several walks over the list, every query head still right. */
static void test_many_query_heads(void **state)
{
    (void)state;
    rng r = {37};
    static const uint32_t groups[] = {17, 40, 70};
    for (size_t i = 0; i < N_OF(groups); i++) {
        fixture f;
        fixture_make(&r, &f, dtype_of((uint32_t)i), 1 + (uint32_t)i % 2, groups[i], 5, 24);
        check_against_naive(&f, kv_decode_attention, 0.2f, 2e-6);
        check_against_naive(&f, kv_decode_attention_ref, 0.2f, 1e-6);
        fixture_free(&f);
    }
}

/* An empty list gives zeros and writes no probabilities. */
static void test_empty_list(void **state)
{
    (void)state;
    rng r = {3};
    fixture f;
    fixture_make(&r, &f, KV_BF16, 2, 2, 4, 5);
    float out[4 * 5], probs[1] = {-7.0f};
    for (int ref = 0; ref < 2; ref++) {
        memset(out, 0x7f, sizeof out);
        (ref ? kv_decode_attention_ref : kv_decode_attention)(&f.l, f.t, f.pool, NULL, 0, NULL, f.q,
                                                              4, 1.0f, out, probs);
        for (size_t i = 0; i < 20; i++)
            assert_true(out[i] == 0.0f);
        assert_true(probs[0] == -7.0f);
    }
    fixture_free(&f);
}

/* One token: its value comes back exactly (fp32) and its probability is 1. */
static void test_single_token_exact(void **state)
{
    (void)state;
    rng r = {11};
    fixture f;
    fixture_make(&r, &f, KV_FP32, 3, 2, 5, 7);
    kv_segment one = {6, 2, 1};
    float out[6 * 7], probs[6];
    kv_decode_attention(&f.l, f.t, f.pool, &one, 1, NULL, f.q, 6, 0.5f, out, probs);
    for (uint32_t h = 0; h < 6; h++) {
        assert_true(probs[h] == 1.0f);
        for (uint32_t c = 0; c < 7; c++) {
            float v = kv_elt_load(f.pool + kv_key_offset(&f.l, 6, h / 2, 2) * 1 +
                                      kv_block_bytes(&f.l) / 2 + c * 4,
                                  KV_FP32);
            assert_true(out[h * 7 + c] == v);
        }
    }
    fixture_free(&f);
}

/* The arithmetic depends only on the tokens in list order: the same tokens
 * split into other segments, or read through a per-head list's row view of
 * the same blocks, give the same bits (a policy whose budget covers the
 * whole context then reproduces the full cache exactly). */
static void test_segmentation_invariant(void **state)
{
    (void)state;
    rng r = {17};
    fixture f;
    fixture_make(&r, &f, KV_FP32, 2, 3, 16, 12);
    kv_segment one[2] = {{1, 0, 16}, {5, 0, 16}};
    kv_segment many[6] = {{1, 0, 3}, {1, 3, 5}, {1, 8, 8}, {5, 0, 1}, {5, 1, 14}, {5, 15, 1}};
    float a[6 * 12], b[6 * 12], pa[6 * 32], pb[6 * 32];
    kv_decode_attention(&f.l, f.t, f.pool, one, 2, NULL, f.q, 6, 0.3f, a, pa);
    kv_decode_attention(&f.l, f.t, f.pool, many, 6, NULL, f.q, 6, 0.3f, b, pb);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(pa, pb, sizeof pa);
    /* Per-head rows: KV head g's tokens are rows g*16 .. g*16+15 of the
     * same blocks seen with one head of 32 rows. */
    kv_layout rows = {1, 32, 12, 4, 0};
    for (uint32_t g = 0; g < 2; g++) {
        kv_segment rs[3] = {{1, g * 16, 7}, {1, g * 16 + 7, 9}, {5, g * 16, 16}};
        float o[3 * 12], p[3 * 32];
        kv_decode_attention(&rows, f.t, f.pool, rs, 3, NULL, f.q + g * 3 * 12, 3, 0.3f, o, p);
        assert_memory_equal(o, a + g * 3 * 12, sizeof o);
        assert_memory_equal(p, pa + g * 3 * 32, sizeof p);
    }
    fixture_free(&f);
}

/* ---- tiered lists (kernels.h: KV_TIER_FULL and KV_TIER_INT8 segments) ---- */

#define TB 7u /* pool blocks of a tiered list */

/* A pool of TB blocks and a tiered list over them (gen_tiered). */
typedef struct tiered {
    kv_layout l, q8; /* q8: l with its INT8 blocks' tokens */
    kv_dtype t;
    uint32_t q_heads;
    uint8_t *pool;
    kv_segment *segs;
    uint8_t *tiers;
    size_t nsegs, n;
    float *q;
} tiered;

static void tiered_make(rng *r, tiered *f, kv_layout l, kv_dtype t, uint32_t q_heads)
{
    memset(f, 0, sizeof *f);
    f->l = l;
    f->t = t;
    f->q_heads = q_heads;
    f->q8 = l;
    f->q8.block_tokens = kv_int8_tokens_per_block(&l);
    size_t bb = kv_block_bytes(&l), tmax = tier_tokens_max(&l);
    f->pool = xcalloc(TB * bb);
    f->segs = xcalloc(TB * tmax * sizeof *f->segs);
    f->tiers = xcalloc(TB * tmax);
    f->q = xcalloc((size_t)q_heads * l.head_dim * sizeof *f->q);
    fill_pool(r, f->pool, TB * bb, t, 1.0f);
    for (size_t i = 0; i < (size_t)q_heads * l.head_dim; i++)
        f->q[i] = 2.0f * rng_float(r);
    f->nsegs = gen_tiered(r, &l, t, f->pool, TB, f->segs, f->tiers);
    f->n = kv_segments_tokens(f->segs, f->nsegs);
}

static void tiered_free(tiered *f)
{
    free(f->pool);
    free(f->segs);
    free(f->tiers);
    free(f->q);
}

/* The same tokens dequantised into fp32: pool block k of layout e holds
 * segment k's tokens at the same slots (INT8 ones through
 * kv_int8_dequantize_ref, INT4 / INT2 ones through
 * kv_lowbit_dequantize_ref, full ones through kv_elt_load), and esegs[k] =
 * {k, first_slot, count}. */
static uint8_t *dequantised(const tiered *f, kv_layout *e, kv_segment *esegs)
{
    const kv_layout *l = &f->l;
    kv_layout q32 = *l;
    q32.elt_size = 4;
    q32.block_tokens = tier_tokens_max(l);
    *e = q32;
    uint8_t *epool = xcalloc(f->nsegs * kv_block_bytes(e));
    uint8_t *scratch = xcalloc(kv_block_bytes(&q32));
    for (size_t k = 0; k < f->nsegs; k++) {
        kv_segment sg = f->segs[k], at0 = {0, sg.first_slot, sg.count};
        esegs[k] = (kv_segment){(uint32_t)k, sg.first_slot, sg.count};
        uint8_t tier = f->tiers[k];
        /* the quantised block's layout (its tokens), and scratch in q32 */
        kv_layout qt = q32;
        qt.block_tokens = tier_tokens(l, tier);
        const uint8_t *qb = f->pool + sg.block * kv_block_bytes(l);
        if (tier == KV_TIER_INT8)
            kv_int8_dequantize_ref(&qt, qb, &at0, 1, KV_FP32, &qt, scratch, &at0, 1);
        else if (tier == KV_TIER_INT4 || tier == KV_TIER_INT2)
            kv_lowbit_dequantize_ref(&qt, tier == KV_TIER_INT4 ? 4 : 2, qb, &at0, 1, KV_FP32, &qt,
                                     scratch, &at0, 1);
        for (uint32_t i = 0; i < sg.count; i++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < l->kv_heads; h++)
                    for (uint32_t c = 0; c < l->head_dim; c++) {
                        uint32_t slot = sg.first_slot + i;
                        float x;
                        if (tier != KV_TIER_FULL)
                            x = kv_elt_load(scratch + kv_key_offset(&qt, 0, h, slot) +
                                                (kv ? kv_block_bytes(&qt) / 2 : 0) + 4 * c,
                                            KV_FP32);
                        else
                            x = kv_elt_load(f->pool + kv_key_offset(l, sg.block, h, slot) +
                                                (kv ? kv_block_bytes(l) / 2 : 0) +
                                                (size_t)c * l->elt_size,
                                            f->t);
                        kv_elt_store(epool + kv_key_offset(e, (uint32_t)k, h, slot) +
                                         (kv ? kv_block_bytes(e) / 2 : 0) + 4 * c,
                                     KV_FP32, x);
                    }
    }
    free(scratch);
    return epool;
}

/* The tiered reference equals the reference over the dequantised fp32
 * tokens exactly (tolerance 0). The fast version is within 2e-6 of the
 * reference, outputs and probabilities, over the tiered list and over its
 * dequantised copy; not bit for bit between the two (its AVX2 build folds
 * the INT8 scales out of its inner loops: attention.c). */
static size_t g_int8_tokens;   /* INT8 tokens checked, so that a test cannot pass vacuously */
static size_t g_lowbit_tokens; /* INT4 and INT2 tokens checked */

static void check_tiered(const tiered *f)
{
    uint32_t d = f->l.head_dim;
    size_t no = (size_t)f->q_heads * d, np = (size_t)f->q_heads * f->n;
    float scale = d ? 1.0f / sqrtf((float)d) : 1.0f;
    kv_layout e;
    kv_segment *esegs = xcalloc(f->nsegs * sizeof *esegs);
    uint8_t *epool = dequantised(f, &e, esegs);
    for (size_t k = 0; k < f->nsegs; k++) {
        g_int8_tokens += f->tiers[k] == KV_TIER_INT8 ? f->segs[k].count : 0;
        g_lowbit_tokens +=
            f->tiers[k] == KV_TIER_INT4 || f->tiers[k] == KV_TIER_INT2 ? f->segs[k].count : 0;
    }
    float *o[4], *p[4];
    for (int i = 0; i < 4; i++) {
        o[i] = xcalloc(no * sizeof(float));
        p[i] = xcalloc((np ? np : 1) * sizeof(float));
    }
    kv_decode_attention_ref(&f->l, f->t, f->pool, f->segs, f->nsegs, f->tiers, f->q, f->q_heads,
                            scale, o[0], p[0]);
    kv_decode_attention_ref(&e, KV_FP32, epool, esegs, f->nsegs, NULL, f->q, f->q_heads, scale,
                            o[1], p[1]);
    kv_decode_attention(&f->l, f->t, f->pool, f->segs, f->nsegs, f->tiers, f->q, f->q_heads, scale,
                        o[2], p[2]);
    kv_decode_attention(&e, KV_FP32, epool, esegs, f->nsegs, NULL, f->q, f->q_heads, scale, o[3],
                        p[3]);
    assert_memory_equal(o[0], o[1], no * sizeof(float));
    assert_memory_equal(p[0], p[1], np * sizeof(float));
    for (int k = 2; k < 4; k++) {
        const char *what = k == 2 ? "tiered" : "dequantised";
        for (size_t i = 0; i < no; i++)
            if (!(fabs((double)o[k][i] - o[0][i]) <= 2e-6))
                fail_msg("%s out[%zu] = %.9g, ref %.9g (n=%zu d=%u kv=%u bt=%u int8 bt=%u %s)",
                         what, i, (double)o[k][i], (double)o[0][i], f->n, d, f->l.kv_heads,
                         f->l.block_tokens, f->q8.block_tokens, dtype_name(f->t));
        for (size_t i = 0; i < np; i++)
            if (!(fabs((double)p[k][i] - p[0][i]) <= 2e-6))
                fail_msg("%s probs[%zu] = %.9g, ref %.9g", what, i, (double)p[k][i],
                         (double)p[0][i]);
    }
    for (int i = 0; i < 4; i++) {
        free(o[i]);
        free(p[i]);
    }
    free(epool);
    free(esegs);
}

/* Mixed FULL / INT8 / INT4 / INT2 lists: all-heads lists with GQA and
 * per-head row layouts (kv_heads = 1, the quantised blocks then derived
 * from the rows layout), every dtype, odd sizes, quantised blocks holding
 * more or fewer tokens than a full one, low-bit groups of 32, 1, 2 and 5. */
static void test_tiered_equals_dequantised(void **state)
{
    (void)state;
    rng r = {23};
    g_int8_tokens = g_lowbit_tokens = 0;
    static const uint32_t dims[] = {1, 3, 8, 17, 64, 130};
    static const uint32_t groups[] = {0, 1, 2, 5};
    static const uint32_t tokens[] = {3, 4, 7, 16};
    for (uint32_t dt = 0; dt < 3; dt++)
        for (size_t a = 0; a < N_OF(dims); a++)
            for (size_t b = 0; b < N_OF(tokens); b++) {
                kv_dtype t = dtype_of(dt);
                uint32_t kvh = 1 + rng_below(&r, 3), group = 1 + rng_below(&r, 3);
                uint32_t qg = groups[(a + b) % N_OF(groups)];
                kv_layout pool_l = {kvh, tokens[b], dims[a], dtype_size(t), qg};
                kv_layout rows_l = {1, kvh * tokens[b], dims[a], dtype_size(t), qg};
                tiered f;
                tiered_make(&r, &f, pool_l, t, kvh * group);
                check_tiered(&f);
                tiered_free(&f);
                tiered_make(&r, &f, rows_l, t, group);
                check_tiered(&f);
                tiered_free(&f);
            }
    print_message("INT8 tokens read: %zu, INT4 and INT2: %zu\n", g_int8_tokens, g_lowbit_tokens);
    assert_true(g_int8_tokens > 1000 && g_lowbit_tokens > 1000);
}

/* An INT8 block holds kv_int8_tokens_per_block(l) tokens: fp16 8 x 128 x
 * 16 gives 28, and a list that reads its last slot reads the right row. */
static void test_tiered_last_slot(void **state)
{
    (void)state;
    rng r = {29};
    kv_layout l = {8, 16, 128, 2, 0};
    assert_int_equal(kv_int8_tokens_per_block(&l), 28);
    tiered f;
    tiered_make(&r, &f, l, KV_FP16, 16);
    /* one INT8 run ending at slot 27 of block 0, one full run after it */
    fill_pool(&r, f.pool, TB * kv_block_bytes(&l), KV_FP16, 1.0f);
    kv_layout q8 = f.q8;
    kv_segment whole = {0, 0, 28};
    uint32_t zero = 0;
    uint8_t *stage = xcalloc(kv_block_bytes(&q8));
    fill_pool(&r, stage, kv_block_bytes(&q8), KV_FP16, 1.0f);
    kv_int8_quantize_ref(&q8, KV_FP16, stage, &whole, 1, f.pool, &zero, 1);
    free(stage);
    f.segs[0] = (kv_segment){0, 20, 8};
    f.tiers[0] = KV_TIER_INT8;
    f.segs[1] = (kv_segment){3, 15, 1};
    f.tiers[1] = KV_TIER_FULL;
    f.nsegs = 2;
    f.n = 9;
    check_tiered(&f);
    tiered_free(&f);
}

/* The generic and AVX2 builds agree within the attention's tolerance,
 * 2e-6 (kernels.h: not bit for bit, the AVX2 build fuses multiply-adds),
 * tiered lists included; and a call large enough to split over threads
 * gives the bits of one thread. */
static void test_builds_and_threads_agree(void **state)
{
    (void)state;
    rng r = {31};
    for (int trial = 0; trial < 6; trial++) {
        kv_dtype t = dtype_of((uint32_t)trial);
        kv_layout l = {2 + (uint32_t)trial % 3, 16, trial % 2 ? 130 : 64, dtype_size(t), 0};
        tiered f;
        tiered_make(&r, &f, l, t, l.kv_heads * (1 + (uint32_t)trial % 4));
        size_t no = (size_t)f.q_heads * l.head_dim, np = (size_t)f.q_heads * f.n;
        float *o1 = xcalloc(no * 4), *o2 = xcalloc(no * 4), *p1 = xcalloc(np * 4 + 4),
              *p2 = xcalloc(np * 4 + 4);
        const char *was = getenv("KVSTASH_KERNEL_ISA");
        setenv("KVSTASH_KERNEL_ISA", "generic", 1);
        kv_decode_attention(&f.l, t, f.pool, f.segs, f.nsegs, f.tiers, f.q, f.q_heads, 0.2f, o1,
                            p1);
        unsetenv("KVSTASH_KERNEL_ISA");
        kv_decode_attention(&f.l, t, f.pool, f.segs, f.nsegs, f.tiers, f.q, f.q_heads, 0.2f, o2,
                            p2);
        if (was != NULL)
            setenv("KVSTASH_KERNEL_ISA", "generic", 1);
        for (size_t i = 0; i < no; i++)
            if (!(fabs((double)o1[i] - o2[i]) <= 2e-6))
                fail_msg("generic out[%zu] = %.9g, %s %.9g", i, (double)o1[i], kv_kernel_isa(),
                         (double)o2[i]);
        for (size_t i = 0; i < np; i++)
            if (!(fabs((double)p1[i] - p2[i]) <= 2e-6))
                fail_msg("generic probs[%zu] = %.9g, %s %.9g", i, (double)p1[i], kv_kernel_isa(),
                         (double)p2[i]);
        free(o1);
        free(o2);
        free(p1);
        free(p2);
        tiered_free(&f);
    }
    /* 8 KV heads x 2048 tokens of fp16 x 128: 8 MiB read, split over threads */
    kv_layout l = {8, 16, 128, 2, 0};
    fixture f;
    fixture_make(&r, &f, KV_FP16, 8, 4, 16, 128);
    free(f.pool);
    f.blocks = 128;
    f.pool = xcalloc(f.blocks * kv_block_bytes(&l));
    fill_pool(&r, f.pool, f.blocks * kv_block_bytes(&l), KV_FP16, 1.0f);
    kv_segment *segs = xcalloc(f.blocks * sizeof *segs);
    for (uint32_t b = 0; b < f.blocks; b++)
        segs[b] = (kv_segment){(b * 37) % f.blocks, 0, 16};
    size_t n = 16 * (size_t)f.blocks, no = 32 * 128;
    float *o1 = xcalloc(no * 4), *o2 = xcalloc(no * 4), *p1 = xcalloc(32 * n * 4),
          *p2 = xcalloc(32 * n * 4);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_decode_attention(&l, KV_FP16, f.pool, segs, f.blocks, NULL, f.q, 32, 0.09f, o1, p1);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_decode_attention(&l, KV_FP16, f.pool, segs, f.blocks, NULL, f.q, 32, 0.09f, o2, p2);
    print_message("attention threads for this call: %u\n",
                  kv_parallel_threads(8 * n * 2 * 128 * 2));
    assert_memory_equal(o1, o2, no * 4);
    assert_memory_equal(p1, p2, 32 * n * 4);
    free(o1);
    free(o2);
    free(p1);
    free(p2);
    free(segs);
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_all_heads),
        cmocka_unit_test(test_per_head_rows),
        cmocka_unit_test(test_far_apart_scores),
        cmocka_unit_test(test_long_and_single),
        cmocka_unit_test(test_many_query_heads),
        cmocka_unit_test(test_empty_list),
        cmocka_unit_test(test_single_token_exact),
        cmocka_unit_test(test_segmentation_invariant),
        cmocka_unit_test(test_tiered_equals_dequantised),
        cmocka_unit_test(test_tiered_last_slot),
        cmocka_unit_test(test_builds_and_threads_agree),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
