/*
 * test_kernels_int8.c - the INT8 tier kernels (kernels.h "INT8 tier"):
 * fast == reference byte for byte on seeded random shapes, lists and
 * dtypes (odd sizes included); the acceptance bound of issue 4 (error per
 * value <= max|group| / 254, all-zero groups exact, the bytes saved); T-CF4
 * through the block kernel; the block layout; how many tokens an INT8 block
 * in a pool block holds; blocks of thousands of tokens; threads do not
 * change bytes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "test_kernels_harness.h"

#define NB 5u /* pool blocks per shape */

static void expect_bytes(const uint8_t *a, const uint8_t *b, size_t n, const kv_layout *l,
                         kv_dtype t, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            fail_msg("%s: byte %zu of %zu differs (%u vs %u), heads=%u tokens=%u dim=%u %s", what,
                     i, n, a[i], b[i], l->kv_heads, l->block_tokens, l->head_dim, dtype_name(t));
}

static void test_layout(void **state)
{
    (void)state;
    kv_layout l = {8, 16, 128, 2, 0};
    /* codes 2 * 8*16*128 = 32768, scales 8 * 8 * 128 = 8192 */
    assert_int_equal(kv_int8_block_bytes(&l), 40960);
    assert_int_equal(kv_int8_code_offset(&l, 0, 0, 0, 0), 0);
    assert_int_equal(kv_int8_code_offset(&l, 0, 0, 0, 1), 128);
    assert_int_equal(kv_int8_code_offset(&l, 0, 0, 1, 0), 16 * 128);
    assert_int_equal(kv_int8_code_offset(&l, 0, 1, 0, 0), 16384);
    assert_int_equal(kv_int8_code_offset(&l, 2, 1, 7, 15), 2 * 40960 + 16384 + (7 * 16 + 15) * 128);
    assert_int_equal(kv_int8_scale_offset(&l, 0, 0, 0), 32768);
    assert_int_equal(kv_int8_scale_offset(&l, 0, 0, 1), 32768 + 512);
    assert_int_equal(kv_int8_scale_offset(&l, 1, 1, 0), 40960 + 32768 + 4096);
    /* Odd sizes: scales start 16-aligned and blocks are padded to 16. */
    kv_layout odd = {3, 7, 5, 2, 0};
    size_t codes = 2 * 3 * 7 * 5; /* 210 -> scales at 224 */
    assert_int_equal(kv_int8_scale_offset(&odd, 0, 0, 0), 224);
    assert_int_equal(kv_int8_block_bytes(&odd), 352); /* 224 + 8*3*5 = 344, padded */
    assert_true(kv_int8_code_offset(&odd, 0, 1, 2, 6) + 5 == codes);
    assert_int_equal(kv_int8_scale_offset(&odd, 0, 1, 2) + 4 * 5, 344);
    assert_int_equal(kv_int8_code_offset(&odd, 1, 0, 0, 0), 352);
}

/* Issue 4 acceptance 1: "memory accounting shows the saving". */
static void test_bytes_saved(void **state)
{
    (void)state;
    const uint32_t tokens[] = {16, 32, 64};
    for (size_t i = 0; i < 3; i++) {
        kv_layout l = {8, tokens[i], 128, 2, 0};
        double ratio = (double)kv_int8_block_bytes(&l) / (double)kv_block_bytes(&l);
        double want = (tokens[i] + 4.0) / (2.0 * tokens[i]);
        print_message("INT8 block / fp16 block at %u tokens: %zu / %zu = %.4f\n", tokens[i],
                      kv_int8_block_bytes(&l), kv_block_bytes(&l), ratio);
        assert_true(ratio == want);
        kv_layout f32 = {8, tokens[i], 128, 4, 0};
        assert_true((double)kv_int8_block_bytes(&f32) / (double)kv_block_bytes(&f32) == want / 2);
    }
}

/* kv_int8_tokens_per_block: the largest T whose INT8 block fits in one
 * pool block (T fits, T + 1 does not), 0 when not even one token fits;
 * then a whole INT8 block written at a pool block's start stays inside it. */
static void test_tokens_per_block(void **state)
{
    (void)state;
    kv_layout fp16 = {4, 16, 8, 2, 0}; /* 2048-byte blocks: 64 T + 256 <= 2048 */
    assert_int_equal(kv_block_bytes(&fp16), 2048);
    assert_int_equal(kv_int8_tokens_per_block(&fp16), 28);
    kv_layout llama = {8, 16, 128, 2, 0}, llama32 = {8, 16, 128, 4, 0};
    assert_int_equal(kv_int8_tokens_per_block(&llama), 28);
    assert_int_equal(kv_int8_tokens_per_block(&llama32), 60);
    kv_layout tiny = {1, 2, 1, 2, 0}, one32 = {3, 1, 64, 4, 0};
    assert_int_equal(kv_int8_tokens_per_block(&tiny), 0);  /* 8 bytes: the padding alone is 16 */
    assert_int_equal(kv_int8_tokens_per_block(&one32), 0); /* fp32, 1 token: the scales fill it */
    rng r = {14};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        if (si % 7 == 0)
            l.head_dim += 1 + rng_below(&r, 5); /* odd head_dim */
        uint32_t T = kv_int8_tokens_per_block(&l);
        kv_layout q = l;
        q.block_tokens = T + 1;
        assert_true(kv_int8_block_bytes(&q) > kv_block_bytes(&l));
        if (T == 0)
            continue;
        q.block_tokens = T;
        assert_true(kv_int8_block_bytes(&q) <= kv_block_bytes(&l));
        /* quantise a full INT8 block into pool block 1 of 3: blocks 0 and 2
         * keep their bytes */
        size_t bb = kv_block_bytes(&l);
        uint8_t *pool = xcalloc(3 * bb), *src = xcalloc(kv_block_bytes(&q)), *was = xcalloc(3 * bb);
        fill_bytes(&r, pool, 3 * bb);
        memcpy(was, pool, 3 * bb);
        fill_pool(&r, src, kv_block_bytes(&q), t, 2.0f);
        kv_segment all = {0, 0, T};
        uint32_t zero = 0;
        kv_int8_quantize(&q, t, src, &all, 1, pool + bb, &zero, 1);
        assert_memory_equal(pool, was, bb);
        assert_memory_equal(pool + 2 * bb, was + 2 * bb, bb);
        free(pool);
        free(src);
        free(was);
    }
}

/* The fast quantiser has no limit on block_tokens (it once kept a group's
 * tokens in a stack tile of 8192 floats): a block of 9000 tokens. */
static void test_long_block(void **state)
{
    (void)state;
    rng r = {15};
    kv_layout l = {2, 9000, 3, 2, 0};
    size_t pb = kv_block_bytes(&l), qb = kv_int8_block_bytes(&l);
    uint8_t *pool = xcalloc(pb), *q1 = xcalloc(qb), *q2 = xcalloc(qb);
    fill_pool(&r, pool, pb, KV_BF16, 5.0f);
    kv_segment segs[2] = {{0, 4000, 5000}, {0, 0, 3999}}; /* 8999 tokens */
    uint32_t zero = 0;
    kv_int8_quantize_ref(&l, KV_BF16, pool, segs, 2, q1, &zero, 1);
    kv_int8_quantize(&l, KV_BF16, pool, segs, 2, q2, &zero, 1);
    expect_bytes(q1, q2, qb, &l, KV_BF16, "quantize 9000 tokens");
    free(pool);
    free(q1);
    free(q2);
}

/* T-CF4 (POLICIES.md §5.4) through the block kernels: one head, dim 1,
 * three tokens x = [0.5, -1.27, 0.01] -> s = 0.01, codes [50, -127, 1]. */
static void test_tcf4_block(void **state)
{
    (void)state;
    kv_layout l = {1, 3, 1, 4, 0};
    float pool[6] = {0.5f, -1.27f, 0.01f, 0, 0, 0}; /* K then V (all zero) */
    uint8_t q[64];
    memset(q, 0x55, sizeof q);
    assert_true(kv_int8_block_bytes(&l) <= sizeof q);
    kv_segment seg = {0, 0, 3};
    uint32_t qb = 0;
    kv_int8_quantize(&l, KV_FP32, (uint8_t *)pool, &seg, 1, q, &qb, 1);
    assert_int_equal((int8_t)q[0], 50);
    assert_int_equal((int8_t)q[1], -127);
    assert_int_equal((int8_t)q[2], 1);
    float s;
    memcpy(&s, q + kv_int8_scale_offset(&l, 0, 0, 0), 4);
    assert_true(s == 1.27f / 127.0f);
    memcpy(&s, q + kv_int8_scale_offset(&l, 0, 1, 0), 4);
    assert_true(s == 1.0f); /* the all-zero V group */
    float back[6];
    memset(back, 0x7f, sizeof back);
    kv_int8_dequantize(&l, q, &seg, 1, KV_FP32, &l, (uint8_t *)back, &seg, 1);
    for (int i = 0; i < 3; i++)
        assert_float_equal(back[i], pool[i], 1e-6);
    for (int i = 3; i < 6; i++)
        assert_true(back[i] == 0 && !signbit(back[i])); /* zero group: exact */
}

/* Ties round half to even in the fast kernel too: a max of 127 makes s = 1,
 * so x / s is exactly the tie. */
static void test_ties_to_even(void **state)
{
    (void)state;
    kv_layout l = {1, 8, 1, 4, 0};
    float pool[16] = {127,  2.5f,  3.5f, -2.5f, -0.5f, 0.5f, 1.5f,    126.5f,
                      -127, -3.5f, 4.5f, -4.5f, 0,     5.5f, -125.5f, 6.5f};
    const int8_t want[16] = {127, 2, 4, -2, 0, 0, 2, 126, -127, -4, 4, -4, 0, 6, -126, 6};
    uint8_t q1[64], q2[64];
    assert_true(kv_int8_block_bytes(&l) <= sizeof q1);
    kv_segment seg = {0, 0, 8};
    uint32_t qb = 0;
    kv_int8_quantize_ref(&l, KV_FP32, (uint8_t *)pool, &seg, 1, q1, &qb, 1);
    kv_int8_quantize(&l, KV_FP32, (uint8_t *)pool, &seg, 1, q2, &qb, 1);
    assert_memory_equal(q1, q2, kv_int8_block_bytes(&l));
    for (int i = 0; i < 16; i++)
        assert_int_equal((int8_t)q2[i], want[i]);
}

/* Groups whose max|x| is subnormal (fp32 and bf16) or tiny make scales
 * below FLT_MIN, where the fast kernel must clamp x / s as the reference
 * does (int8.c codes_avx2); next to them, groups of normal scales, whose
 * clamp it skips, with values near every rounding tie. Fast equals ref.
 * (Not max|x| = 2^-149: s = max / 127 is then 0 and 0 / s NaN, which the
 * reference casts to int8 through undefined behaviour.) */
/* §5.4 "if s == 0: s = 1": a channel whose max is below 127 smallest
 * subnormals (0x1p-149, 0x1p-144) has a scale that underflows to 0; it must
 * be 1 with all-zero codes (no division by zero). */
static void expect_underflow_scale_one(const kv_layout *l, const uint8_t *qb, const float *amax,
                                       int trial)
{
    for (uint32_t c = 0; c < 2 * l->head_dim; c++) {
        float a = amax[(c + (uint32_t)trial) % 10];
        if (a / 127.0f > 0)
            continue;
        float s;
        memcpy(&s, qb + kv_int8_scale_offset(l, 0, c / l->head_dim, 0) + 4 * (c % l->head_dim), 4);
        if (s != 1.0f)
            fail_msg("channel %u, max %a: scale %a, want 1", c, (double)a, (double)s);
        for (uint32_t i = 0; i < l->block_tokens; i++)
            if (((const int8_t *)
                     qb)[kv_int8_code_offset(l, 0, c / l->head_dim, 0, i) + c % l->head_dim] != 0)
                fail_msg("channel %u, max %a: code of token %u is not 0", c, (double)a, i);
    }
}

static void test_tiny_scales(void **state)
{
    (void)state;
    rng r = {41};
    static const float amax[] = {0x1p-142f, 0x1p-140f, 3e-39f, 0x1p-126f, 1.1e-38f,
                                 1e-30f,    127.0f,    3.0e5f, 0x1p-149f, 0x1p-144f};
    for (uint32_t dt = 0; dt < 2; dt++) {
        kv_dtype t = dt == 0 ? KV_FP32 : KV_BF16;
        kv_layout l = {1, 16, 64, dtype_size(t), 0};
        uint8_t *pool = xcalloc(kv_block_bytes(&l));
        size_t qbb = kv_int8_block_bytes(&l);
        uint8_t *q1 = xcalloc(qbb), *q2 = xcalloc(qbb);
        for (int trial = 0; trial < 200; trial++) {
            for (uint32_t c = 0; c < 2 * l.head_dim; c++) { /* K and V channels */
                float a = amax[(c + (uint32_t)trial) % (sizeof amax / sizeof amax[0])];
                size_t base = (c < l.head_dim ? 0 : kv_block_bytes(&l) / 2) +
                              (size_t)(c % l.head_dim) * l.elt_size;
                for (uint32_t i = 0; i < l.block_tokens; i++) {
                    /* slot 0 holds the max; the others near ties (k + 1/2) * a / 127,
                     * nudged by a few ulps, or random */
                    float v = a;
                    if (i > 0 && rng_below(&r, 2)) {
                        float k = (float)rng_below(&r, 254) - 127.0f + 0.5f;
                        v = k * (a / 127.0f);
                        int nudge = (int)rng_below(&r, 7) - 3;
                        for (; nudge > 0; nudge--)
                            v = nextafterf(v, INFINITY);
                        for (; nudge < 0; nudge++)
                            v = nextafterf(v, -INFINITY);
                        v = fabsf(v) > a ? copysignf(a, v) : v;
                    } else if (i > 0)
                        v = rng_float(&r) * a;
                    kv_elt_store(pool + base + kv_key_offset(&l, 0, 0, i), t, v);
                }
            }
            kv_segment seg = {0, 0, l.block_tokens};
            uint32_t qb = 0;
            kv_int8_quantize_ref(&l, t, pool, &seg, 1, q1, &qb, 1);
            kv_int8_quantize(&l, t, pool, &seg, 1, q2, &qb, 1);
            expect_bytes(q1, q2, qbb, &l, t, "quantize tiny scales");
            expect_underflow_scale_one(&l, q1, amax, trial);
        }
        free(pool);
        free(q1);
        free(q2);
    }
}

/* Quantise a random list into random INT8 blocks with ref and fast. */
static void check_quantize(rng *r, const kv_layout *l, kv_dtype t, uint8_t *pool, kv_segment *segs)
{
    size_t pool_bytes = NB * kv_block_bytes(l), qbb = kv_int8_block_bytes(l);
    uint32_t nqa = NB + 2; /* INT8 arena blocks */
    uint8_t *q1 = xcalloc(nqa * qbb), *q2 = xcalloc(nqa * qbb);
    uint32_t qblocks[NB + 2];
    fill_pool(r, pool, pool_bytes, t, rng_below(r, 2) ? 1.0f : 300.0f);
    size_t nsegs = gen_disjoint(r, l, 0, NB, segs);
    size_t ntok = kv_segments_tokens(segs, nsegs);
    size_t nq = (ntok + l->block_tokens - 1) / l->block_tokens + rng_below(r, 2);
    permutation(r, qblocks, nqa);
    fill_bytes(r, q1, nqa * qbb);
    memcpy(q2, q1, nqa * qbb);
    kv_int8_quantize_ref(l, t, pool, segs, nsegs, q1, qblocks, nq);
    kv_int8_quantize(l, t, pool, segs, nsegs, q2, qblocks, nq);
    expect_bytes(q1, q2, nqa * qbb, l, t, "quantize");
    free(q1);
    free(q2);
}

/* Dequantise random INT8 tokens (random codes, positive scales and a few
 * odd ones) into a random disjoint list of a pool of any dtype, with ref
 * and fast. Every other trial the destination's blocks hold another
 * number of tokens than the INT8 blocks (as a pool block's 16 beside
 * INT8's 28): then the reference's tokens, gathered, must also equal
 * those it writes into blocks of the INT8 layout. */
static void check_dequantize(rng *r, const kv_layout *lq, kv_segment *segs, kv_segment *dsegs)
{
    kv_dtype t = dtype_of(rng_below(r, 3));
    kv_layout l = *lq, dl = *lq;
    l.elt_size = dl.elt_size = dtype_size(t);
    if (rng_below(r, 2))
        dl.block_tokens = 1 + rng_below(r, 2 * l.block_tokens);
    uint32_t nbd = (NB * l.block_tokens + dl.block_tokens - 1) / dl.block_tokens;
    size_t qbb = kv_int8_block_bytes(&l), pool_bytes = nbd * kv_block_bytes(&dl);
    uint8_t *q = xcalloc(NB * qbb), *p1 = xcalloc(pool_bytes), *p2 = xcalloc(pool_bytes);
    kv_segment *ds = xcalloc((size_t)nbd * dl.block_tokens * sizeof *ds);
    fill_bytes(r, q, NB * qbb);
    for (uint32_t b = 0; b < NB; b++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l.kv_heads; h++)
                for (uint32_t c = 0; c < l.head_dim; c++) {
                    float s = (rng_float(r) + 1.5f) * 0.01f;
                    /* now and then a scale whose products leave fp16's
                     * normal range, or are not numbers at all (a hostile
                     * worker's bytes): the fast paths must round,
                     * overflow and carry NaN payloads as the reference */
                    static const uint32_t odd[] = {0x7fe00000u /* NaN, payload */,
                                                   0x7f800000u /* inf */, 0x33d6bf95u /* 1e-7 */,
                                                   0x447a0000u /* 1000 */};
                    if (rng_below(r, 16) == 0)
                        memcpy(&s, &odd[rng_below(r, 4)], 4);
                    memcpy(q + kv_int8_scale_offset(&l, b, kv, h) + 4 * c, &s, 4);
                }
    size_t nq = gen_disjoint(r, &l, 0, NB, segs);
    size_t ntok = kv_segments_tokens(segs, nq);
    size_t nd = gen_exact(r, &dl, 0, nbd, ntok, ds);
    fill_bytes(r, p1, pool_bytes);
    memcpy(p2, p1, pool_bytes);
    kv_int8_dequantize_ref(&l, q, segs, nq, t, &dl, p1, ds, nd);
    kv_int8_dequantize(&l, q, segs, nq, t, &dl, p2, ds, nd);
    expect_bytes(p1, p2, pool_bytes, &l, t, "dequantize");
    if (dl.block_tokens != l.block_tokens) {
        size_t half = ntok * l.kv_heads * l.head_dim * l.elt_size;
        uint8_t *p3 = xcalloc(NB * kv_block_bytes(&l)), *a = xcalloc(2 * half),
                *b = xcalloc(2 * half);
        size_t n3 = gen_exact(r, &l, 0, NB, ntok, dsegs);
        kv_int8_dequantize_ref(&l, q, segs, nq, t, &l, p3, dsegs, n3);
        kv_gather_ref(&l, p3, dsegs, n3, a, a + half);
        kv_gather_ref(&dl, p1, ds, nd, b, b + half);
        expect_bytes(a, b, 2 * half, &dl, t, "dequantize into other blocks");
        free(p3);
        free(a);
        free(b);
    }
    free(q);
    free(p1);
    free(p2);
    free(ds);
}

static void test_fast_equals_ref(void **state)
{
    (void)state;
    rng r = {11};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint8_t *pool = xcalloc(NB * kv_block_bytes(&l));
        kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
        kv_segment *dsegs = xcalloc(NB * l.block_tokens * sizeof *dsegs);
        for (int trial = 0; trial < 3; trial++) {
            check_quantize(&r, &l, t, pool, segs);
            check_dequantize(&r, &l, segs, dsegs);
        }
        free(pool);
        free(segs);
        free(dsegs);
    }
}

/* Issue 4 acceptance 1 on random groups: quantise whole lists, dequantise
 * into fp32, and compare each value with its group's max / 254; groups of
 * zeros come back exactly. Into fp16, the bound plus fp16's rounding. */
static void test_round_trip_bound(void **state)
{
    (void)state;
    rng r = {12};
    for (size_t si = 0; si < KH_SHAPES; si += 5) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint32_t T = l.block_tokens;
        size_t pb = NB * kv_block_bytes(&l);
        kv_layout l32 = l, l16 = l;
        l32.elt_size = 4;
        l16.elt_size = 2;
        uint8_t *pool = xcalloc(pb), *q = xcalloc(NB * kv_int8_block_bytes(&l));
        uint8_t *back = xcalloc(NB * kv_block_bytes(&l32)), *back16 = xcalloc(pb);
        kv_segment *segs = xcalloc(NB * T * sizeof *segs);
        fill_pool(&r, pool, pb, t, 10.0f);
        /* Zero channel 0 of every K row, and all of head 0's V in block 1. */
        for (uint32_t b = 0; b < NB; b++)
            for (uint32_t s = 0; s < T; s++)
                for (uint32_t h = 0; h < l.kv_heads; h++) {
                    kv_elt_store(pool + kv_key_offset(&l, b, h, s), t, 0.0f);
                    if (b == 1 && h == 0)
                        memset(pool + kv_key_offset(&l, b, 0, s) + pb / NB / 2, 0,
                               (size_t)l.head_dim * l.elt_size);
                }
        /* Whole blocks in order: INT8 block b holds pool block b. */
        uint32_t qblocks[NB];
        for (uint32_t b = 0; b < NB; b++) {
            segs[b] = (kv_segment){b, 0, T};
            qblocks[b] = b;
        }
        kv_int8_quantize(&l, t, pool, segs, NB, q, qblocks, NB);
        kv_int8_dequantize(&l32, q, segs, NB, KV_FP32, &l32, back, segs, NB);
        kv_int8_dequantize(&l16, q, segs, NB, KV_FP16, &l16, back16, segs, NB);
        for (uint32_t b = 0; b < NB; b++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < l.kv_heads; h++)
                    for (uint32_t c = 0; c < l.head_dim; c++) {
                        float amax = 0;
                        size_t off[64], off32[64], off16[64];
                        assert_true(T <= 64);
                        for (uint32_t s = 0; s < T; s++) {
                            off[s] = kv_key_offset(&l, b, h, s) + (kv ? pb / NB / 2 : 0) +
                                     (size_t)c * l.elt_size;
                            off32[s] = kv_key_offset(&l32, b, h, s) +
                                       (kv ? kv_block_bytes(&l32) / 2 : 0) + (size_t)c * 4;
                            off16[s] = kv_key_offset(&l16, b, h, s) +
                                       (kv ? kv_block_bytes(&l16) / 2 : 0) + (size_t)c * 2;
                            amax = fmaxf(amax, fabsf(kv_elt_load(pool + off[s], t)));
                        }
                        for (uint32_t s = 0; s < T; s++) {
                            float x = kv_elt_load(pool + off[s], t);
                            float y = kv_elt_load(back + off32[s], KV_FP32);
                            float y16 = kv_elt_load(back16 + off16[s], KV_FP16);
                            if (amax == 0) {
                                assert_true(y == 0 && y16 == 0);
                                continue;
                            }
                            if (fabsf(y - x) > amax / 254.0f * (1 + 1e-5f))
                                fail_msg("error %g > max %g / 254 (block %u kv %u head %u ch %u)",
                                         (double)fabsf(y - x), (double)amax, b, kv, h, c);
                            /* fp16 output: the bound plus half an fp16 ulp of y */
                            float ulp16 = fmaxf(ldexpf(1.0f, ilogbf(fabsf(y) + 1e-30f) - 10),
                                                ldexpf(1.0f, -24));
                            assert_true(fabsf(y16 - x) <= amax / 254.0f * (1 + 1e-5f) + ulp16 / 2);
                        }
                    }
        free(pool);
        free(q);
        free(back);
        free(back16);
        free(segs);
    }
}

/* A list that splits over threads gives the same bytes as one thread. */
static void test_threads_deterministic(void **state)
{
    (void)state;
    rng r = {13};
    kv_layout l = {8, 16, 128, 2, 0};
    uint32_t nb = 256; /* 16 MiB of fp16 pool: several threads' worth */
    size_t pb = nb * kv_block_bytes(&l), qbb = kv_int8_block_bytes(&l);
    uint8_t *pool = xcalloc(pb), *q1 = xcalloc(nb * qbb), *q2 = xcalloc(nb * qbb);
    uint8_t *b1 = xcalloc(pb), *b2 = xcalloc(pb);
    kv_segment *segs = xcalloc(nb * 16 * sizeof *segs);
    uint32_t *qblocks = xcalloc(nb * sizeof *qblocks);
    fill_pool(&r, pool, pb, KV_FP16, 4.0f);
    size_t n = cut_blocks(&r, &l, 0, nb, 2, segs);
    shuffle_segs(&r, segs, n);
    permutation(&r, qblocks, nb);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_int8_quantize(&l, KV_FP16, pool, segs, n, q1, qblocks, nb);
    kv_int8_dequantize(&l, q1, segs, n, KV_FP16, &l, b1, segs, n);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_int8_quantize(&l, KV_FP16, pool, segs, n, q2, qblocks, nb);
    kv_int8_dequantize(&l, q2, segs, n, KV_FP16, &l, b2, segs, n);
    print_message("threads for this job: %u\n", kv_parallel_threads(pb));
    assert_memory_equal(q1, q2, nb * qbb);
    assert_memory_equal(b1, b2, pb);
    free(pool);
    free(q1);
    free(q2);
    free(b1);
    free(b2);
    free(segs);
    free(qblocks);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),           cmocka_unit_test(test_bytes_saved),
        cmocka_unit_test(test_tokens_per_block), cmocka_unit_test(test_long_block),
        cmocka_unit_test(test_tcf4_block),       cmocka_unit_test(test_ties_to_even),
        cmocka_unit_test(test_tiny_scales),      cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_round_trip_bound), cmocka_unit_test(test_threads_deterministic),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
