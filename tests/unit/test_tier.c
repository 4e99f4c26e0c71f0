/*
 * Unit tests of daemon/tier.h on its own, over a private arena with the CPU
 * ops (device memory is host memory there, so the test reads it directly):
 * full-precision writes land in the right rows and read back exactly,
 * INT8 round trips stay within POLICIES.md §5.4's bound (max|group| / 254
 * per value), mixed lists read back in list order, copies, and the
 * count-sketch's insert / query / revive / delete, exact with enough
 * buckets and averaging when tokens share a cell.
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

#include "tier.h"

/* 2 KV heads x 16 tokens x 8 channels, fp32: 2048-byte blocks, 60 INT8
 * tokens a block. */
#define NBLOCKS 16
static const kv_layout layout = {2, 16, 8, 4, 0};

typedef struct fixture {
    uint8_t *arena;
    tier_ctx c;
    size_t row; /* bytes of one head's row of one token */
} fixture;

static int setup(void **state)
{
    static fixture f;
    size_t bb = kv_block_bytes(&layout);
    f.arena = kv_ops_cpu.alloc(NBLOCKS * bb);
    if (f.arena == NULL)
        return -1;
    memset(f.arena, 0, NBLOCKS * bb);
    if (tier_ctx_init(&f.c, &kv_ops_cpu, f.arena, bb, &layout, KV_FP32) != 0)
        return -1;
    f.row = (size_t)layout.head_dim * layout.elt_size;
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    kv_ops_cpu.free(f->arena);
    return 0;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

/* Uniform in [-scale, scale), seeded: the same values every run. */
static float rand_float(float scale)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return scale * ((float)(rng >> 40) / (float)(1u << 24) * 2.0f - 1.0f);
}

/* Staging for n tokens, K then V, filled with values whose magnitude
 * differs per head and channel (so groups have different scales). */
static uint8_t *staged_tokens(fixture *f, size_t n)
{
    uint8_t *s = tier_stage_alloc(&f->c, n);
    assert_non_null(s);
    float *x = (float *)s;
    size_t per = n * layout.kv_heads * layout.head_dim; /* floats of K (or V) */
    for (size_t i = 0; i < 2 * per; i++)
        x[i] = rand_float(0.5f + (float)(i % 13));
    return s;
}

/* Row of head h of token i of a staged [kv_heads][n][head_dim] array. */
static const uint8_t *stage_row(const fixture *f, const uint8_t *a, size_t n, uint32_t h, size_t i)
{
    return a + ((size_t)h * n + i) * f->row;
}

static void test_ctx_geometry(void **state)
{
    fixture *f = *state;
    assert_int_equal(f->c.l8.block_tokens, kv_int8_tokens_per_block(&layout));
    assert_int_equal(f->c.l8.block_tokens, 60); /* 32T + 128 <= 2048 */
    assert_int_equal(f->c.l8.kv_heads, 2);
    assert_int_equal(tier_block_tokens(&f->c, POLICY_INT4), kv_lowbit_tokens_per_block(&layout, 4));
    assert_int_equal(tier_block_tokens(&f->c, POLICY_INT2), kv_lowbit_tokens_per_block(&layout, 2));
    assert_int_equal(tier_block_tokens(&f->c, POLICY_INT4), 77); /* 16 rows' codes + params */
    assert_true(tier_layout(&f->c, POLICY_FULL) == &f->c.l);
    assert_int_equal(tier_token_bytes(&f->c), 2 * 2 * 8 * 4);
    /* fp32 blocks of one token cannot hold even one INT8 token with its
     * scales. */
    kv_layout tiny = {2, 1, 8, 4, 0};
    tier_ctx c;
    assert_int_equal(
        tier_ctx_init(&c, &kv_ops_cpu, f->arena, kv_block_bytes(&tiny), &tiny, KV_FP32), -1);
}

static void test_write_read_copy_full(void **state)
{
    fixture *f = *state;
    enum { N = 6 };
    const tier_token dst[N] = {{3, 1, POLICY_FULL},  {3, 2, POLICY_FULL},  {1, 0, POLICY_FULL},
                               {7, 15, POLICY_FULL}, {7, 14, POLICY_FULL}, {0, 5, POLICY_FULL}};
    uint8_t *in = staged_tokens(f, N);
    size_t half = N * tier_token_bytes(&f->c) / 2;
    assert_int_equal(tier_write(&f->c, dst, N, in, in + half), 0);
    /* Each token's rows are where kv_key_offset says, K and V. */
    size_t vo = f->c.block_bytes / 2;
    for (size_t i = 0; i < N; i++)
        for (uint32_t h = 0; h < layout.kv_heads; h++) {
            size_t off = kv_key_offset(&layout, dst[i].block, h, dst[i].slot);
            assert_memory_equal(f->arena + off, stage_row(f, in, N, h, i), f->row);
            assert_memory_equal(f->arena + off + vo, stage_row(f, in + half, N, h, i), f->row);
        }
    /* Block 2 was not written: still zero. */
    for (size_t b = 0; b < f->c.block_bytes; b++)
        assert_int_equal(f->arena[2 * f->c.block_bytes + b], 0);
    uint8_t *out = tier_stage_alloc(&f->c, N);
    assert_int_equal(tier_read(&f->c, dst, N, out, out + half), 0);
    assert_memory_equal(out, in, 2 * half);
    /* Pool to pool: the copies' rows equal the originals'. */
    const tier_token to[N] = {{10, 0, POLICY_FULL}, {10, 1, POLICY_FULL}, {10, 2, POLICY_FULL},
                              {11, 9, POLICY_FULL}, {10, 4, POLICY_FULL}, {10, 3, POLICY_FULL}};
    assert_int_equal(tier_copy(&f->c, dst, N, to), 0);
    memset(out, 0, 2 * half);
    assert_int_equal(tier_read(&f->c, to, N, out, out + half), 0);
    assert_memory_equal(out, in, 2 * half);
    tier_stage_free(&f->c, in);
    tier_stage_free(&f->c, out);
}

/* A move's error metric compares an evenly spaced sample of its tokens
 * (tier.h TIER_ERROR_SAMPLE): all of a small move; of a large one, the
 * first token and then every n / 32nd, increasing, inside the move. */
static void test_error_sample(void **state)
{
    (void)state;
    uint32_t idx[TIER_ERROR_SAMPLE];
    assert_int_equal(tier_error_sample(0, idx), 0);
    assert_int_equal(tier_error_sample(5, idx), 5);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(idx[i], i);
    assert_int_equal(tier_error_sample(TIER_ERROR_SAMPLE, idx), TIER_ERROR_SAMPLE);
    assert_int_equal(idx[TIER_ERROR_SAMPLE - 1], TIER_ERROR_SAMPLE - 1);
    assert_int_equal(tier_error_sample(100, idx), TIER_ERROR_SAMPLE);
    const uint32_t want[6] = {0, 3, 6, 9, 12, 15}; /* i * 100 / 32 */
    for (uint32_t i = 0; i < 6; i++)
        assert_int_equal(idx[i], want[i]);
    assert_int_equal(idx[TIER_ERROR_SAMPLE - 1], 96);
    assert_int_equal(tier_error_sample(1000000, idx), TIER_ERROR_SAMPLE);
    assert_int_equal(idx[1], 31250);
    for (uint32_t i = 1; i < TIER_ERROR_SAMPLE; i++)
        assert_true(idx[i] > idx[i - 1] && idx[i] < 1000000);
}

/* Staged tokens written to consecutive FULL slots from block `first`:
 * what tier_quantize and tier_sketch_insert take. Free with free(). */
static tier_token *full_tokens(fixture *f, uint32_t first, const uint8_t *in, size_t n)
{
    tier_token *tok = malloc(n * sizeof *tok);
    assert_non_null(tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (tier_token){first + (uint32_t)(i / layout.block_tokens),
                              (uint32_t)(i % layout.block_tokens), POLICY_FULL};
    size_t half = n * tier_token_bytes(&f->c) / 2;
    assert_int_equal(tier_write(&f->c, tok, n, in, in + half), 0);
    return tok;
}

/* Read a list of m tokens of any tiers in one call: each token reads back
 * as it reads alone, in list order. Returns the staged read (free with
 * tier_stage_free). */
static uint8_t *read_mixed(fixture *f, const tier_token *mixed, size_t m)
{
    size_t mhalf = m * tier_token_bytes(&f->c) / 2, ohalf = tier_token_bytes(&f->c) / 2;
    uint8_t *mo = tier_stage_alloc(&f->c, m), *one = tier_stage_alloc(&f->c, 1);
    assert_int_equal(tier_read(&f->c, mixed, m, mo, mo + mhalf), 0);
    for (size_t i = 0; i < m; i++) {
        assert_int_equal(tier_read(&f->c, &mixed[i], 1, one, one + ohalf), 0);
        for (uint32_t h = 0; h < layout.kv_heads; h++) {
            assert_memory_equal(stage_row(f, mo, m, h, i), stage_row(f, one, 1, h, 0), f->row);
            assert_memory_equal(stage_row(f, mo + mhalf, m, h, i),
                                stage_row(f, one + ohalf, 1, h, 0), f->row);
        }
    }
    tier_stage_free(&f->c, one);
    return mo;
}

/* Quantised tokens `from` copied to FULL slots `back` (two of each) hold
 * their dequantised values. */
static void expect_copies_dequantised(fixture *f, const tier_token *from, const tier_token *back)
{
    uint8_t *a = tier_stage_alloc(&f->c, 2), *b = tier_stage_alloc(&f->c, 2);
    size_t h2 = tier_token_bytes(&f->c);
    assert_int_equal(tier_copy(&f->c, from, 2, back), 0);
    assert_int_equal(tier_read(&f->c, from, 2, a, a + h2), 0);
    assert_int_equal(tier_read(&f->c, back, 2, b, b + h2), 0);
    assert_memory_equal(a, b, 2 * h2);
    tier_stage_free(&f->c, a);
    tier_stage_free(&f->c, b);
}

/* POLICIES.md §5.4: per (INT8 block, K/V, head, channel) group, s = max|x|
 * / 127 and codes round(x / s): every value comes back within s / 2. */
static void check_int8_bound(const fixture *f, const float *x, const float *y, size_t n,
                             uint32_t t8)
{
    double worst = 0;
    for (size_t part = 0; part < 2; part++)
        for (uint32_t h = 0; h < layout.kv_heads; h++)
            for (uint32_t ch = 0; ch < layout.head_dim; ch++)
                for (size_t b0 = 0; b0 < n; b0 += t8) {
                    size_t b1 = b0 + t8 < n ? b0 + t8 : n;
                    double gmax = 0;
                    for (size_t i = b0; i < b1; i++) {
                        size_t at = ((part * layout.kv_heads + h) * n + i) * layout.head_dim + ch;
                        gmax = fmax(gmax, fabs(x[at]));
                    }
                    for (size_t i = b0; i < b1; i++) {
                        size_t at = ((part * layout.kv_heads + h) * n + i) * layout.head_dim + ch;
                        double err = fabs((double)y[at] - x[at]);
                        if (err > gmax / 254 * (1 + 1e-6))
                            fail_msg("token %zu head %u channel %u: error %g > %g / 254", i, h, ch,
                                     err, gmax);
                        worst = fmax(worst, err / gmax);
                    }
                }
    (void)f;
    assert_true(worst > 0); /* quantised, not copied */
}

static void test_quantize_read_within_bound(void **state)
{
    fixture *f = *state;
    uint32_t t8 = f->c.l8.block_tokens;
    size_t n = t8 + 10; /* two INT8 blocks, the last partial */
    const uint32_t qblocks[2] = {5, 9};
    uint8_t *in = staged_tokens(f, n);
    size_t half = n * tier_token_bytes(&f->c) / 2;
    tier_token *src = full_tokens(f, 0, in, n); /* blocks 0..4 */
    assert_int_equal(tier_quantize(&f->c, POLICY_INT8, src, n, qblocks, 2), 0);
    free(src);
    tier_token *tok = malloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++)
        tok[i] = (tier_token){qblocks[i / t8], (uint32_t)(i % t8), POLICY_INT8};
    uint8_t *out = tier_stage_alloc(&f->c, n);
    assert_int_equal(tier_read(&f->c, tok, n, out, out + half), 0);
    check_int8_bound(f, (const float *)in, (const float *)out, n, t8);
    double ratio = -1;
    assert_int_equal(tier_error_ratio(&f->c, tok, n, in, &ratio), 0);
    assert_true(ratio > 0 && ratio <= 1.0 / 254 * (1 + 1e-6));

    /* A mixed list (INT8, FULL, INT8, ...): each token reads back as it
     * reads alone, in list order; the FULL ones exactly. */
    enum { M = 6 };
    const tier_token full[3] = {{12, 0, POLICY_FULL}, {12, 7, POLICY_FULL}, {4, 3, POLICY_FULL}};
    uint8_t *fin = staged_tokens(f, 3);
    size_t fhalf = 3 * tier_token_bytes(&f->c) / 2;
    assert_int_equal(tier_write(&f->c, full, 3, fin, fin + fhalf), 0);
    const tier_token mixed[M] = {tok[0], full[0], tok[t8 + 3], full[1], full[2], tok[7]};
    uint8_t *mo = read_mixed(f, mixed, M);
    /* full[1] is mixed[3]: its exact original. */
    for (uint32_t h = 0; h < layout.kv_heads; h++)
        assert_memory_equal(stage_row(f, mo, M, h, 3), stage_row(f, fin, 3, h, 1), f->row);

    /* INT8 to FULL: the copies hold the dequantised values. */
    const tier_token back[2] = {{13, 0, POLICY_FULL}, {13, 1, POLICY_FULL}};
    const tier_token from[2] = {tok[2], tok[t8 + 9]};
    expect_copies_dequantised(f, from, back);
    tier_stage_free(&f->c, mo);
    tier_stage_free(&f->c, fin);
    tier_stage_free(&f->c, out);
    tier_stage_free(&f->c, in);
    free(tok);
}

/* The range (max - min) of n floats `stride` apart. */
static double range_of(const float *x, size_t n, size_t stride)
{
    double lo = x[0], hi = x[0];
    for (size_t i = 1; i < n; i++) {
        lo = fmin(lo, x[i * stride]);
        hi = fmax(hi, x[i * stride]);
    }
    return hi - lo;
}

/* n staged tokens y read back from low-bit blocks of tq tokens (levels L)
 * against their originals x: within half a step of each value's group, a
 * K group one channel over a block's tokens, a V group a token's 8
 * channels (one group: the default 32 is wider). */
static void check_lowbit_bound(const float *x, const float *y, size_t n, uint32_t tq, double L)
{
    uint32_t d = layout.head_dim;
    for (size_t part = 0; part < 2; part++)
        for (uint32_t h = 0; h < layout.kv_heads; h++)
            for (size_t i = 0; i < n; i++)
                for (uint32_t c = 0; c < d; c++) {
                    size_t row0 = (part * layout.kv_heads + h) * n, at = (row0 + i) * d + c;
                    size_t b0 = i / tq * tq, m = b0 + tq < n ? tq : n - b0;
                    double range = part == 0 ? range_of(x + (row0 + b0) * d + c, m, d)
                                             : range_of(x + (row0 + i) * d, d, 1);
                    double bound = range / L / 2 * (1 + 1.0 / 512) + 1e-6;
                    if (!(fabs((double)y[at] - x[at]) <= bound))
                        fail_msg("%s token %zu head %u channel %u: %g, was %g (bound %g)",
                                 part ? "V" : "K", i, h, c, (double)y[at], (double)x[at], bound);
                }
}

/*
 * INT4 and INT2 blocks next to INT8 and full-precision tokens: quantised
 * with tier_quantize (a full block and a partial one), read back within
 * half a group's step (kernels.h "Low-bit tiers": K per channel over the
 * block's tokens, V per token over its 8 channels), and a list mixing all
 * four tiers reads each token as it reads alone; copies to full precision
 * hold the dequantised values.
 */
static void test_lowbit_tiers_mixed(void **state)
{
    fixture *f = *state;
    uint32_t t4 = tier_block_tokens(&f->c, POLICY_INT4), t2 = tier_block_tokens(&f->c, POLICY_INT2);
    size_t n4 = t4 + 5, n2 = 9;
    const uint32_t q4[2] = {14, 15}, q2[1] = {9};
    uint8_t *in4 = staged_tokens(f, n4), *in2 = staged_tokens(f, n2);
    size_t h4 = n4 * tier_token_bytes(&f->c) / 2;
    tier_token *src4 = full_tokens(f, 0, in4, n4), *src2 = full_tokens(f, 7, in2, n2);
    assert_int_equal(tier_quantize(&f->c, POLICY_INT4, src4, n4, q4, 2), 0);
    assert_int_equal(tier_quantize(&f->c, POLICY_INT2, src2, n2, q2, 1), 0);
    free(src4);
    free(src2);
    tier_token *tok4 = malloc(n4 * sizeof *tok4), *tok2 = malloc(n2 * sizeof *tok2);
    for (size_t i = 0; i < n4; i++)
        tok4[i] = (tier_token){q4[i / t4], (uint32_t)(i % t4), POLICY_INT4};
    for (size_t i = 0; i < n2; i++)
        tok2[i] = (tier_token){q2[0], (uint32_t)i, POLICY_INT2};
    (void)t2;
    /* Each value within half a step of its group: the step is at most the
     * group's range / L, rounded up in fp16. */
    double r4 = -1, r2 = -1;
    assert_int_equal(tier_error_ratio(&f->c, tok4, n4, in4, &r4), 0);
    assert_int_equal(tier_error_ratio(&f->c, tok2, n2, in2, &r2), 0);
    print_message("round trip / max: INT4 %.4f, INT2 %.4f\n", r4, r2);
    assert_true(r4 > 0 && r2 > r4);
    uint8_t *o4 = tier_stage_alloc(&f->c, n4);
    assert_int_equal(tier_read(&f->c, tok4, n4, o4, o4 + h4), 0);
    check_lowbit_bound((const float *)in4, (const float *)o4, n4, t4, 15);

    /* A list of all four tiers, out of order. */
    const uint32_t q8[1] = {11};
    uint8_t *in8 = staged_tokens(f, 4);
    tier_token *src8 = full_tokens(f, 8, in8, 4);
    assert_int_equal(tier_quantize(&f->c, POLICY_INT8, src8, 4, q8, 1), 0);
    free(src8);
    const tier_token full = {12, 3, POLICY_FULL};
    uint8_t *fin = staged_tokens(f, 1);
    assert_int_equal(tier_write(&f->c, &full, 1, fin, fin + tier_token_bytes(&f->c) / 2), 0);
    enum { M = 7 };
    const tier_token mixed[M] = {tok2[3], tok4[t4 + 2], full,   (tier_token){11, 2, POLICY_INT8},
                                 tok4[0], tok2[8],      tok4[1]};
    tier_stage_free(&f->c, read_mixed(f, mixed, M));
    /* INT4 and INT2 to FULL: the copies hold the dequantised values. */
    const tier_token back[2] = {{13, 0, POLICY_FULL}, {13, 1, POLICY_FULL}};
    const tier_token from[2] = {tok4[t4 + 4], tok2[0]};
    expect_copies_dequantised(f, from, back);
    tier_stage_free(&f->c, fin);
    tier_stage_free(&f->c, in8);
    tier_stage_free(&f->c, o4);
    tier_stage_free(&f->c, in4);
    tier_stage_free(&f->c, in2);
    free(tok4);
    free(tok2);
}

/* Destination i of n, in blocks 10..14: slots backwards (every token a
 * run of its own), forwards from slot 5 of block 10 (runs that cross from
 * one block into the next), or each token in the next block, where the
 * slot after the last token's may follow it in another block. */
static const char *const copy_orders[] = {"backwards", "forwards", "across blocks"};

static tier_token copy_destination(size_t i, size_t n, size_t order)
{
    if (order == 2)
        return (tier_token){10 + (uint32_t)(i % 5), (uint32_t)(i / 5), POLICY_FULL};
    size_t s = order == 1 ? 5 + i : n - 1 - i;
    return (tier_token){10 + (uint32_t)(s / 16), (uint32_t)(s % 16), POLICY_FULL};
}

/* int8_dequantize calls of the device-like ops below. */
static size_t int8_dequantize_calls;

static int counted_int8_dequantize(const kv_layout *l, const uint8_t *qpool,
                                   const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                   const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                                   size_t ndst)
{
    int8_dequantize_calls++;
    return kv_ops_cpu.int8_dequantize(l, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst);
}

/*
 * tier_copy of a long list, in host memory (each tier's tokens dequantised
 * straight into their slots) and as on a device (ops that are not host memory: staged
 * copy_chunk tokens at a time): a list of INT8, INT4 and full-precision
 * tokens, out of order, copied with chunks of 1, 3, 7 and 100 tokens
 * (chunks that cut quantised runs, chunks of one tier and of several, a
 * last partial chunk, one chunk for all), and with the default, into
 * slots in three orders: every slot holds what tier_read gives for
 * its source (the dequantised values, full-precision tokens exactly), and
 * no slot outside the destination's changes. INT8 blocks fill this
 * layout's pool blocks exactly, so that in one chunk (or in host memory,
 * at once) every INT8 run is dequantised by one kernel call (INT4's do
 * not: a call per run).
 */
static void test_copy_in_chunks(void **state)
{
    fixture *f = *state;
    uint32_t t8 = f->c.l8.block_tokens, t4 = tier_block_tokens(&f->c, POLICY_INT4);
    size_t n8 = t8 + 9, n4 = 11, tb = tier_token_bytes(&f->c);
    const uint32_t q8[2] = {5, 6}, q4[1] = {7};
    uint8_t *in8 = staged_tokens(f, n8), *in4 = staged_tokens(f, n4), *fin = staged_tokens(f, 20);
    tier_token *s8 = full_tokens(f, 0, in8, n8), *s4 = full_tokens(f, 0, in4, n4);
    assert_int_equal(tier_quantize(&f->c, POLICY_INT8, s8, n8, q8, 2), 0);
    assert_int_equal(tier_quantize(&f->c, POLICY_INT4, s4, n4, q4, 1), 0);
    free(s4);
    tier_token *full = full_tokens(f, 8, fin, 20); /* blocks 8, 9 */
    /* Sources: INT8 runs across its two blocks, INT4 runs, full tokens and
     * single tokens between them. */
    enum { N = 75 };
    tier_token src[N], dst[N];
    size_t n = 0;
    for (size_t i = 40; i < n8; i++) /* the end of INT8 block 5, all of block 6 */
        src[n++] = (tier_token){q8[i / t8], (uint32_t)(i % t8), POLICY_INT8};
    for (size_t i = 0; i < 6; i++)
        src[n++] = full[i];
    for (size_t i = 0; i < n4; i++)
        src[n++] = (tier_token){q4[0], (uint32_t)i, POLICY_INT4};
    for (size_t i = 0; n < N; i++) {
        src[n++] = (tier_token){q8[(3 * i) / t8], (uint32_t)((3 * i) % t8), POLICY_INT8};
        if (n < N)
            src[n++] = full[6 + i % 14];
    }
    (void)t4;
    size_t half = N * tb / 2, bb = f->c.block_bytes;
    uint8_t *want = tier_stage_alloc(&f->c, N), *got = tier_stage_alloc(&f->c, N);
    assert_int_equal(tier_read(&f->c, src, N, want, want + half), 0);
    uint8_t *before = malloc(NBLOCKS * bb);
    kv_ops device = kv_ops_cpu;
    device.host_memory = 0;
    device.int8_dequantize = counted_int8_dequantize;
    kv_ops host = kv_ops_cpu;
    host.int8_dequantize = counted_int8_dequantize;
    assert_int_equal(kv_int8_block_bytes(&f->c.l8), bb);
    const size_t chunks[] = {1, 3, 7, 100, f->c.copy_chunk, 0 /* host memory */};
    for (size_t k = 0; k < 3 * sizeof chunks / sizeof *chunks; k++) {
        size_t chunk = chunks[k / 3];
        for (size_t i = 0; i < N; i++)
            dst[i] = copy_destination(i, N, k % 3);
        memset(f->arena + 10 * bb, 0, 5 * bb);
        memcpy(before, f->arena, NBLOCKS * bb);
        tier_ctx c = f->c;
        c.ops = chunk > 0 ? &device : &host;
        c.copy_chunk = chunk > 0 ? chunk : c.copy_chunk;
        int8_dequantize_calls = 0;
        assert_int_equal(tier_copy(&c, src, N, dst), 0);
        if (chunk >= N || chunk == 0)
            assert_int_equal(int8_dequantize_calls, 1);
        memset(got, 0, 2 * half);
        assert_int_equal(tier_read(&f->c, dst, N, got, got + half), 0);
        if (memcmp(got, want, 2 * half) != 0)
            fail_msg("%s, chunks of %zu, %s: the copies differ from their sources' values",
                     chunk > 0 ? "as on a device" : "host memory", chunk, copy_orders[k % 3]);
        /* Only the destination slots changed. */
        for (size_t i = 0; i < N; i++)
            for (uint32_t h = 0; h < layout.kv_heads; h++) {
                size_t off = kv_key_offset(&layout, dst[i].block, h, dst[i].slot);
                memcpy(before + off, f->arena + off, f->row);
                memcpy(before + off + bb / 2, f->arena + off + bb / 2, f->row);
            }
        assert_memory_equal(before, f->arena, NBLOCKS * bb);
    }
    assert_true(f->c.copy_chunk >= N); /* 8 MiB of 128-byte tokens */
    free(before);
    free(s8);
    free(full);
    tier_stage_free(&f->c, want);
    tier_stage_free(&f->c, got);
    tier_stage_free(&f->c, in8);
    tier_stage_free(&f->c, in4);
    tier_stage_free(&f->c, fin);
}

static int sketch_cells_zero(const tier_sketch *s, double tol)
{
    size_t cells = (size_t)s->sk.rows * s->sk.buckets;
    for (size_t i = 0; i < cells; i++)
        if (s->sk.count[i] != 0)
            return 0;
    for (size_t i = 0; i < cells * s->sk.dim; i++)
        if (fabs(s->sk.key[i]) > tol || fabs(s->sk.value[i]) > tol)
            return 0;
    return 1;
}

/* With enough buckets no two of these positions share a cell in two of
 * the three rows, so the median of the rows is each token exactly. */
static void test_sketch_exact_with_enough_buckets(void **state)
{
    fixture *f = *state;
    enum { N = 8 };
    const uint32_t pos[N] = {0, 5, 17, 100, 1000, 4242, 70000, 123456};
    policy_sketch_geometry g = {3, 1024, 42, 0, 0};
    tier_sketch s;
    assert_int_equal(tier_sketch_init(&s, &f->c, &g), 0);
    assert_int_equal(tier_sketch_bytes(&s), 3 * 1024 * (2 * 16 * 4 + 4));
    assert_true(sketch_cells_zero(&s, 0));
    uint8_t *in = staged_tokens(f, N);
    size_t half = N * tier_token_bytes(&f->c) / 2;
    tier_token *src = full_tokens(f, 0, in, N);
    assert_int_equal(tier_sketch_insert(&s, &f->c, pos, src, N), 0);
    free(src);
    assert_false(sketch_cells_zero(&s, 0));
    double rel = -1;
    assert_int_equal(tier_sketch_error(&s, &f->c, pos, N, in, &rel), 0);
    assert_true(rel == 0);
    /* Query into pool slots: exact, and the sketch keeps them. */
    tier_token dst[N];
    for (uint32_t i = 0; i < N; i++)
        dst[i] = (tier_token){14, i, POLICY_FULL};
    uint8_t *out = tier_stage_alloc(&f->c, N);
    assert_int_equal(tier_sketch_read(&s, &f->c, f->arena, pos, N, dst, 0), 0);
    assert_int_equal(tier_read(&f->c, dst, N, out, out + half), 0);
    assert_memory_equal(out, in, 2 * half);
    /* Revive (Alg. 3) the first half: exact, and deleted from the sketch;
     * the rest still query exactly. */
    for (uint32_t i = 0; i < N; i++)
        dst[i] = (tier_token){15, i, POLICY_FULL};
    assert_int_equal(tier_sketch_read(&s, &f->c, f->arena, pos, N / 2, dst, 1), 0);
    assert_int_equal(tier_read(&f->c, dst, N / 2, out, out + half / 2), 0);
    for (uint32_t h = 0; h < layout.kv_heads; h++)
        for (size_t i = 0; i < N / 2; i++)
            assert_memory_equal(stage_row(f, out, N / 2, h, i), stage_row(f, in, N, h, i), f->row);
    /* The second half's originals, staged contiguously for the error. */
    uint8_t *rest = tier_stage_alloc(&f->c, N / 2);
    size_t rhalf = half / 2;
    for (int part = 0; part < 2; part++)
        for (uint32_t h = 0; h < layout.kv_heads; h++)
            for (size_t i = 0; i < N / 2; i++)
                memcpy((uint8_t *)stage_row(f, rest + part * rhalf, N / 2, h, i),
                       stage_row(f, in + part * half, N, h, N / 2 + i), f->row);
    assert_int_equal(tier_sketch_error(&s, &f->c, pos + N / 2, N / 2, rest, &rel), 0);
    assert_true(rel == 0);
    /* Deleting the rest empties every cell (up to fp32 rounding where two
     * tokens shared one). */
    assert_int_equal(tier_sketch_delete(&s, pos + N / 2, N / 2), 0);
    assert_true(sketch_cells_zero(&s, 1e-5));
    tier_sketch_free(&s);
    assert_int_equal(tier_sketch_bytes(&s), 0);
    tier_stage_free(&f->c, rest);
    tier_stage_free(&f->c, out);
    tier_stage_free(&f->c, in);
}

/* One row, one bucket: both tokens land in the same cell. Keys in MEAN
 * mode come back as their average; values (SUM mode, signed) as g0 times
 * the signed sum. */
static void test_sketch_shared_cell_estimates(void **state)
{
    fixture *f = *state;
    const uint32_t pos[2] = {3, 9};
    policy_sketch_geometry g = {1, 1, 7, 1, 0};
    tier_sketch s;
    assert_int_equal(tier_sketch_init(&s, &f->c, &g), 0);
    uint8_t *in = staged_tokens(f, 2);
    size_t half = tier_token_bytes(&f->c);
    tier_token *src = full_tokens(f, 0, in, 2);
    assert_int_equal(tier_sketch_insert(&s, &f->c, pos, src, 2), 0);
    free(src);
    assert_int_equal(s.sk.count[0], 2);
    uint32_t hb[2];
    int8_t sg[2];
    const uint64_t p64[2] = {3, 9};
    kv_sketch_hash_list(7, 1, 1, p64, 2, hb, sg);
    const tier_token dst = {6, 3, POLICY_FULL};
    assert_int_equal(tier_sketch_read(&s, &f->c, f->arena, pos, 1, &dst, 0), 0);
    uint8_t *out = tier_stage_alloc(&f->c, 1);
    assert_int_equal(tier_read(&f->c, &dst, 1, out, out + tier_token_bytes(&f->c) / 2), 0);
    const float *k = (const float *)in, *v = (const float *)(in + half);
    const float *ko = (const float *)out, *vo = ko + layout.kv_heads * layout.head_dim;
    for (uint32_t h = 0; h < layout.kv_heads; h++)
        for (uint32_t ch = 0; ch < layout.head_dim; ch++) {
            size_t a = ((size_t)h * 2 + 0) * layout.head_dim + ch;
            size_t b = ((size_t)h * 2 + 1) * layout.head_dim + ch;
            size_t o = (size_t)h * layout.head_dim + ch;
            assert_float_equal(ko[o], (k[a] + k[b]) / 2, 1e-5);
            assert_float_equal(vo[o], sg[0] * (sg[0] * v[a] + sg[1] * v[b]), 1e-5);
        }
    double rel = 0;
    assert_int_equal(tier_sketch_error(&s, &f->c, pos, 2, in, &rel), 0);
    assert_true(rel > 0.1); /* two random tokens in one cell are far apart */
    tier_sketch_free(&s);
    tier_stage_free(&f->c, out);
    tier_stage_free(&f->c, in);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ctx_geometry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_read_copy_full, setup, teardown),
        cmocka_unit_test(test_error_sample),
        cmocka_unit_test_setup_teardown(test_quantize_read_within_bound, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lowbit_tiers_mixed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_copy_in_chunks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sketch_exact_with_enough_buckets, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sketch_shared_cell_estimates, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
