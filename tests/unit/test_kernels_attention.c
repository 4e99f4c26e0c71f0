/*
 * test_kernels_attention.c - kv_decode_attention (fast) and _ref against a
 * naive softmax attention written here from the layout's definition alone
 * (kernels.h "Pool layout"), on seeded random pools: fp32, fp16 and bf16,
 * all-heads lists with grouped-query attention, per-head row layouts, random
 * segment lists (odd sizes, empty lists), and scores far apart (the online
 * softmax must not overflow).
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

/* ---- seeded randomness (splitmix64) ---- */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rng_below(rng *r, uint32_t n)
{
    return (uint32_t)(rng_next(r) % n);
}

/* Uniform in [-1, 1). */
static float rng_unit(rng *r)
{
    return (float)((double)(rng_next(r) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

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

static size_t elt_size(kv_dtype t)
{
    return t == KV_FP32 ? 4 : 2;
}

/* Fill the pool with values in [-amp, amp], stored in the pool's dtype. */
static void fill_pool(rng *r, fixture *f, float amp)
{
    size_t elts = kv_block_bytes(&f->l) * f->blocks / f->l.elt_size;
    for (size_t i = 0; i < elts; i++)
        kv_elt_store(f->pool + i * f->l.elt_size, f->t, amp * rng_unit(r));
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
    f->l = (kv_layout){kv_heads, block_tokens, head_dim, (uint32_t)elt_size(t)};
    f->blocks = 9;
    f->q_heads = kv_heads * group;
    f->pool = malloc(kv_block_bytes(&f->l) * f->blocks);
    f->q = malloc((size_t)f->q_heads * head_dim * sizeof *f->q);
    assert_non_null(f->pool);
    assert_non_null(f->q);
    fill_pool(r, f, 1.0f);
    for (size_t i = 0; i < (size_t)f->q_heads * head_dim; i++)
        f->q[i] = 2.0f * rng_unit(r);
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
                             size_t, const float *, uint32_t, float, float *, float *);

/* Run `fn` with and without probs and compare both with the naive result:
 * outputs within tol (values are in [-1, 1]), probabilities within tol, and
 * the same output whether probs is asked for or not. */
static void check_against_naive(const fixture *f, attention_fn fn, float scale, double tol)
{
    uint32_t d = f->l.head_dim;
    size_t no = (size_t)f->q_heads * d, np = (size_t)f->q_heads * (f->n ? f->n : 1);
    double *want = malloc(no * sizeof *want), *wantp = malloc(np * sizeof *wantp);
    float *got = malloc(no * sizeof *got), *got2 = malloc(no * sizeof *got2);
    float *gotp = malloc(np * sizeof *gotp);
    assert_true(want && wantp && got && got2 && gotp);
    naive_attention(f, scale, want, wantp);
    fn(&f->l, f->t, f->pool, f->segs, f->nsegs, f->q, f->q_heads, scale, got, gotp);
    fn(&f->l, f->t, f->pool, f->segs, f->nsegs, f->q, f->q_heads, scale, got2, NULL);
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
    free(gotp);
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
                kv_layout pool_l = {kvh, bt, d, f.l.elt_size};
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
        fill_pool(&r, &f, 60.0f); /* |q.k| up to 2 * 60 * 8 */
        for (size_t i = 0; i < (size_t)f.q_heads * 8; i++)
            f.q[i] = 2.0f * rng_unit(&r);
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
        (ref ? kv_decode_attention_ref : kv_decode_attention)(&f.l, f.t, f.pool, NULL, 0, f.q, 4,
                                                              1.0f, out, probs);
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
    kv_decode_attention(&f.l, f.t, f.pool, &one, 1, f.q, 6, 0.5f, out, probs);
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
    kv_decode_attention(&f.l, f.t, f.pool, one, 2, f.q, 6, 0.3f, a, pa);
    kv_decode_attention(&f.l, f.t, f.pool, many, 6, f.q, 6, 0.3f, b, pb);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(pa, pb, sizeof pa);
    /* Per-head rows: KV head g's tokens are rows g*16 .. g*16+15 of the
     * same blocks seen with one head of 32 rows. */
    kv_layout rows = {1, 32, 12, 4};
    for (uint32_t g = 0; g < 2; g++) {
        kv_segment rs[3] = {{1, g * 16, 7}, {1, g * 16 + 7, 9}, {5, g * 16, 16}};
        float o[3 * 12], p[3 * 32];
        kv_decode_attention(&rows, f.t, f.pool, rs, 3, f.q + g * 3 * 12, 3, 0.3f, o, p);
        assert_memory_equal(o, a + g * 3 * 12, sizeof o);
        assert_memory_equal(p, pa + g * 3 * 32, sizeof p);
    }
    fixture_free(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_all_heads),
        cmocka_unit_test(test_per_head_rows),
        cmocka_unit_test(test_far_apart_scores),
        cmocka_unit_test(test_long_and_single),
        cmocka_unit_test(test_empty_list),
        cmocka_unit_test(test_single_token_exact),
        cmocka_unit_test(test_segmentation_invariant),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
