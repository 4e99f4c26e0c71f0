/*
 * test_kernels_lowbit.c - the INT4 / INT2 tier kernels (kernels.h "Low-bit
 * tiers"): the block layout and how many tokens fit a pool block; the group
 * quantiser on hand-computed vectors (rounding directions of the fp16
 * scale and zero point); fast == reference byte for byte on seeded random
 * shapes, group sizes, lists and dtypes; the round-trip bound per group
 * (error <= s/2, the range covered, constant groups exact); dequantised
 * blocks of any bytes (parameters NaN, infinite, subnormal, shifts that
 * overflow) fast == reference; hostile values
 * (inf, NaN, beyond fp16) give codes without undefined behaviour; threads
 * do not change bytes. Run once per ISA build.
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
#include "lowbit.h"
#include "test_kernels_harness.h"

#define NB 5u /* pool blocks per shape */

static const uint32_t k_groups[] = {0, 1, 3, 8}; /* 0: the default, 32 */
static const uint32_t k_bits[] = {4, 2};

static void expect_bytes(const uint8_t *a, const uint8_t *b, size_t n, const kv_layout *l,
                         uint32_t bits, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            fail_msg("%s: byte %zu of %zu differs (%u vs %u), heads=%u tokens=%u dim=%u group=%u "
                     "bits=%u",
                     what, i, n, a[i], b[i], l->kv_heads, l->block_tokens, l->head_dim,
                     kv_lowbit_group(l), bits);
}

static float half_at(const uint8_t *p, size_t i)
{
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return kv_half_to_float(h);
}

static void test_layout(void **state)
{
    (void)state;
    kv_layout l = {8, 49, 128, 2, 32};
    /* INT4: rows of 64 bytes; codes 8*49*64 = 25088 each of K and V;
     * K params 2 groups: 4*8*2*128 = 8192 from 50176; V params 4 groups a
     * token: 4*8*49*4 = 6272 -> 64640; the shift, 4 bytes, padded to 16 */
    assert_int_equal(kv_lowbit_block_bytes(&l, 4), 64656);
    assert_int_equal(kv_lowbit_shift_offset(&l, 4, 1), 64656 + 64640);
    assert_int_equal(kv_lowbit_code_offset(&l, 4, 0, 0, 0, 1), 64);
    assert_int_equal(kv_lowbit_code_offset(&l, 4, 0, 0, 1, 0), 49 * 64);
    assert_int_equal(kv_lowbit_code_offset(&l, 4, 0, 1, 0, 0), 25088);
    assert_int_equal(kv_lowbit_code_offset(&l, 4, 2, 1, 7, 48),
                     2 * 64656 + 25088 + (7 * 49 + 48) * 64);
    assert_int_equal(kv_lowbit_key_params_offset(&l, 4, 0, 0, 0), 50176);
    assert_int_equal(kv_lowbit_key_params_offset(&l, 4, 0, 0, 1), 50176 + 512);
    assert_int_equal(kv_lowbit_key_params_offset(&l, 4, 0, 1, 0), 50176 + 1024);
    assert_int_equal(kv_lowbit_value_params_offset(&l, 4, 0, 0, 0), 50176 + 8192);
    assert_int_equal(kv_lowbit_value_params_offset(&l, 4, 1, 7, 48),
                     64656 + 50176 + 8192 + (7 * 49 + 48) * 16);
    /* the default group is 32 */
    kv_layout d = l;
    d.quant_group = 0;
    assert_int_equal(kv_lowbit_group(&d), 32);
    assert_int_equal(kv_lowbit_block_bytes(&d, 2), kv_lowbit_block_bytes(&l, 2));
    /* odd sizes: a 5-channel INT2 row takes 2 bytes; groups of 3 tokens
     * and channels: 3 key groups for 7 tokens, 2 value groups a token */
    kv_layout odd = {3, 7, 5, 2, 3};
    size_t codes = 3 * 7 * 2; /* 42 each: params at 96 */
    assert_int_equal(kv_lowbit_code_offset(&odd, 2, 0, 1, 0, 0), codes);
    assert_int_equal(kv_lowbit_key_params_offset(&odd, 2, 0, 0, 0), 96);
    assert_int_equal(kv_lowbit_value_params_offset(&odd, 2, 0, 0, 0), 96 + 4 * 3 * 3 * 5);
    assert_int_equal(kv_lowbit_block_bytes(&odd, 2), 448); /* 96 + 180 + 168 + 4, padded */
    assert_int_equal(kv_lowbit_shift_offset(&odd, 2, 0), 444);
}

/* The largest T whose low-bit block fits one pool block, and the bytes it
 * saves against fp16 at the served shape. */
static void test_tokens_per_block(void **state)
{
    (void)state;
    kv_layout llama = {8, 16, 128, 2, 0};
    assert_int_equal(kv_lowbit_tokens_per_block(&llama, 4), 49);
    assert_int_equal(kv_lowbit_tokens_per_block(&llama, 2), 83);
    print_message("fp16 8x128, 16-token blocks: INT8 %u, INT4 %u, INT2 %u tokens a block\n",
                  kv_int8_tokens_per_block(&llama), kv_lowbit_tokens_per_block(&llama, 4),
                  kv_lowbit_tokens_per_block(&llama, 2));
    kv_layout tiny = {1, 1, 1, 2, 0};
    assert_int_equal(kv_lowbit_tokens_per_block(&tiny, 4), 0); /* 4 bytes: padding is 16 */
    rng r = {41};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        l.quant_group = k_groups[si % KH_N(k_groups)];
        for (size_t b = 0; b < KH_N(k_bits); b++) {
            uint32_t bits = k_bits[b], T = kv_lowbit_tokens_per_block(&l, bits);
            kv_layout q = l;
            q.block_tokens = T + 1;
            assert_true(kv_lowbit_block_bytes(&q, bits) > kv_block_bytes(&l));
            if (T == 0)
                continue;
            q.block_tokens = T;
            assert_true(kv_lowbit_block_bytes(&q, bits) <= kv_block_bytes(&l));
            /* a full block written into pool block 1 of 3 stays inside it */
            size_t bb = kv_block_bytes(&l);
            uint8_t *pool = xcalloc(3 * bb), *src = xcalloc(kv_block_bytes(&q)),
                    *was = xcalloc(3 * bb);
            fill_bytes(&r, pool, 3 * bb);
            memcpy(was, pool, 3 * bb);
            fill_pool(&r, src, kv_block_bytes(&q), t, 2.0f);
            kv_segment all = {0, 0, T};
            uint32_t zero = 0;
            kv_lowbit_quantize(&q, bits, t, src, &all, 1, pool + bb, &zero, 1);
            assert_memory_equal(pool, was, bb);
            assert_memory_equal(pool + 2 * bb, was + 2 * bb, bb);
            free(pool);
            free(src);
            free(was);
        }
    }
}

/* The quantiser on vectors worked by hand. */
static void test_group_vectors(void **state)
{
    (void)state;
    uint16_t s, z;
    /* 0..3 at 2 bits: z = 0, s = 1, exact */
    kv_lowbit_params(0.0f, 3.0f, 2, &s, &z);
    assert_true(kv_half_to_float(s) == 1.0f && kv_half_to_float(z) == 0.0f);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(kv_lowbit_code((float)i, 1.0f, 0.0f, 2), i);
    /* [-1, 0.5] at 4 bits: 1.5 / 15 = 0.1, whose nearest fp16
     * (0.0999755859375) is below it: s steps up to 0.10003662109375 */
    kv_lowbit_params(-1.0f, 0.5f, 4, &s, &z);
    assert_true(kv_half_to_float(z) == -1.0f);
    assert_true(kv_half_to_float(s) == 0.10003662109375f);
    float sf = kv_half_to_float(s);
    assert_int_equal(kv_lowbit_code(0.5f, sf, -1.0f, 4), 15);
    assert_int_equal(kv_lowbit_code(-1.0f, sf, -1.0f, 4), 0);
    assert_int_equal(kv_lowbit_code(-0.7f, sf, -1.0f, 4), 3); /* 2.9989 */
    assert_true(kv_lowbit_value(3, sf, -1.0f, 1.0f) == 3 * 0.10003662109375f - 1.0f);
    assert_true(kv_lowbit_value(3, sf, -1.0f, 4.0f) == (3 * 0.10003662109375f - 1.0f) * 4);
    /* the block's shift: none up to 32768, then what brings max |x| there */
    assert_int_equal(kv_lowbit_shift(0.0f), 0);
    assert_int_equal(kv_lowbit_shift(32767.0f), 0);
    assert_int_equal(kv_lowbit_shift(65535.0f), 1); /* 2^15·1.99997: 2^-1 brings it under 2^15 */
    assert_int_equal(kv_lowbit_shift(1e6f), 5);     /* 1e6 / 32 = 31250 */
    assert_int_equal(kv_lowbit_shift(INFINITY), 114);
    assert_true(kv_lowbit_pow2(-5) == 1.0f / 32 && kv_lowbit_pow2(1000) == 0x1p127f &&
                kv_lowbit_pow2(-1000) == 0x1p-126f); /* clamped: any stored int32 */
    /* the zero point rounds down: min 0.1 (fp16 nearest 0.0999755859375 is
     * below, kept); min -1/3 (nearest -0.333251953125 is above: one step
     * down) */
    kv_lowbit_params(0.1f, 1.0f, 4, &s, &z);
    assert_true(kv_half_to_float(z) == 0.0999755859375f);
    kv_lowbit_params(-1.0f / 3, 1.0f, 4, &s, &z);
    assert_true(kv_half_to_float(z) == -0.33349609375f);
    assert_true(kv_half_to_float(z) <= -1.0f / 3);
    /* a constant group representable in fp16: s = 0, every code 0, exact */
    kv_lowbit_params(0.75f, 0.75f, 2, &s, &z);
    assert_true(s == 0 && kv_half_to_float(z) == 0.75f);
    assert_int_equal(kv_lowbit_code(0.75f, 0.0f, 0.75f, 2), 0);
    /* a constant group that is not: a tiny positive s covers it */
    kv_lowbit_params(0.1f, 0.1f, 2, &s, &z);
    assert_true(s != 0 && kv_half_to_float(z) <= 0.1f &&
                kv_half_to_float(s) * 3 + kv_half_to_float(z) >= 0.1f);
    /* no number (all NaN): zeros; beyond fp16: clamped, codes in range */
    kv_lowbit_params(INFINITY, -INFINITY, 4, &s, &z);
    assert_true(s == 0 && z == 0);
    kv_lowbit_params(-1e30f, 1e30f, 4, &s, &z);
    assert_true(kv_half_to_float(z) == -65504.0f && kv_half_to_float(s) == 65504.0f);
    assert_int_equal(kv_lowbit_code(NAN, 1.0f, 0.0f, 4), 0);
    assert_int_equal(kv_lowbit_code(INFINITY, 1.0f, 0.0f, 4), 15);
    assert_int_equal(kv_lowbit_code(-INFINITY, 1.0f, 0.0f, 2), 0);
}

/* Quantise a random list into random low-bit blocks with ref and fast. */
static void check_quantize(rng *r, const kv_layout *l, uint32_t bits, kv_dtype t, uint8_t *pool,
                           kv_segment *segs)
{
    size_t qbb = kv_lowbit_block_bytes(l, bits);
    uint32_t nqa = NB + 2;
    uint8_t *q1 = xcalloc(nqa * qbb), *q2 = xcalloc(nqa * qbb);
    uint32_t qblocks[NB + 2];
    fill_pool(r, pool, NB * kv_block_bytes(l), t, rng_below(r, 2) ? 1.0f : 300.0f);
    size_t nsegs = gen_disjoint(r, l, 0, NB, segs);
    size_t ntok = kv_segments_tokens(segs, nsegs);
    size_t nq = (ntok + l->block_tokens - 1) / l->block_tokens + rng_below(r, 2);
    permutation(r, qblocks, nqa);
    fill_bytes(r, q1, nqa * qbb);
    memcpy(q2, q1, nqa * qbb);
    kv_lowbit_quantize_ref(l, bits, t, pool, segs, nsegs, q1, qblocks, nq);
    kv_lowbit_quantize(l, bits, t, pool, segs, nsegs, q2, qblocks, nq);
    expect_bytes(q1, q2, nqa * qbb, l, bits, "quantize");
    free(q1);
    free(q2);
}

/* Dequantise random tokens of quantised blocks into a random list of a
 * pool of any dtype, with ref and fast; every other trial into blocks of
 * another number of tokens than the low-bit blocks' (test_kernels_int8.c
 * checks the reference's addressing of such blocks). */
static void check_dequantize(rng *r, const kv_layout *lq, uint32_t bits, kv_segment *segs)
{
    kv_dtype t = dtype_of(rng_below(r, 3)), src_t = dtype_of(rng_below(r, 3));
    kv_layout l = *lq, ls = *lq, dl = *lq;
    l.elt_size = dl.elt_size = dtype_size(t);
    ls.elt_size = dtype_size(src_t);
    if (rng_below(r, 2))
        dl.block_tokens = 1 + rng_below(r, 2 * l.block_tokens);
    uint32_t nbd = (NB * l.block_tokens + dl.block_tokens - 1) / dl.block_tokens;
    size_t qbb = kv_lowbit_block_bytes(&l, bits), pool_bytes = nbd * kv_block_bytes(&dl);
    uint8_t *q = xcalloc(NB * qbb), *p1 = xcalloc(pool_bytes), *p2 = xcalloc(pool_bytes);
    kv_segment *dsegs = xcalloc((size_t)nbd * dl.block_tokens * sizeof *dsegs);
    uint8_t *src = xcalloc(NB * kv_block_bytes(&ls));
    fill_pool(r, src, NB * kv_block_bytes(&ls), src_t, 5.0f);
    uint32_t qblocks[NB];
    for (uint32_t b = 0; b < NB; b++) {
        segs[b] = (kv_segment){b, 0, l.block_tokens};
        qblocks[b] = b;
    }
    kv_lowbit_quantize_ref(&ls, bits, src_t, src, segs, NB, q, qblocks, NB);
    size_t nq = gen_disjoint(r, &l, 0, NB, segs);
    size_t nd = gen_exact(r, &dl, 0, nbd, kv_segments_tokens(segs, nq), dsegs);
    fill_bytes(r, p1, pool_bytes);
    memcpy(p2, p1, pool_bytes);
    kv_lowbit_dequantize_ref(&l, bits, q, segs, nq, t, &dl, p1, dsegs, nd);
    kv_lowbit_dequantize(&l, bits, q, segs, nq, t, &dl, p2, dsegs, nd);
    expect_bytes(p1, p2, pool_bytes, &l, bits, "dequantize");
    free(dsegs);
    free(q);
    free(p1);
    free(p2);
    free(src);
}

static void test_fast_equals_ref(void **state)
{
    (void)state;
    rng r = {42};
    for (size_t si = 0; si < KH_SHAPES; si += 2) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint8_t *pool = xcalloc(NB * kv_block_bytes(&l));
        kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
        l.quant_group = k_groups[(si / 2) % KH_N(k_groups)]; /* a group size per shape */
        for (size_t b = 0; b < KH_N(k_bits); b++) {
            check_quantize(&r, &l, k_bits[b], t, pool, segs);
            check_dequantize(&r, &l, k_bits[b], segs);
        }
        free(pool);
        free(segs);
    }
}

/* An fp16 parameter as a worker may have written it: any finite value
 * (subnormals and +-65504 among them), and, `bad` times in 1000, an
 * infinity or a NaN with a random payload, quiet or signalling. */
static uint16_t any_half(rng *r, uint32_t bad)
{
    uint16_t sign = (uint16_t)(rng_below(r, 2) << 15);
    if (rng_below(r, 1000) < bad)
        return rng_below(r, 4) == 0 ? (uint16_t)(sign | 0x7c00u)
                                    : (uint16_t)(sign | 0x7c00u | (1 + rng_below(r, 0x3ff)));
    switch (rng_below(r, 8)) {
    case 0:
        return (uint16_t)(sign | rng_below(r, 0x400)); /* subnormal or zero */
    case 1:
        return (uint16_t)(sign | KV_HALF_MAX_BITS);
    default:
        return (uint16_t)(sign | rng_below(r, 0x7c00)); /* any finite */
    }
}

/* Dequantisation is a function of the low-bit block's bytes, whoever wrote
 * them: random codes, parameters of any fp16 bits (per block none, few or
 * many of them infinite or NaN), shifts that make values overflow fp16 or
 * fp32 and fall to subnormals, clamped ones. Fast == ref byte for byte into
 * every dtype, every group size (multiples of 8 and not), every dim of the
 * harness (tails after the last multiple of 8, rows past KV_CHUNK), into
 * blocks of another number of tokens every other trial. */
static void test_dequantize_any_params(void **state)
{
    (void)state;
    static const int32_t shifts[] = {0, 0, 1, 5, 15, 30, -10, -24, -126, -140, 127, 200};
    static const uint32_t bads[] = {0, 2, 50};
    static const uint32_t groups[] = {0, 1, 3, 8, 12, 16};
    rng r = {46};
    kv_segment *segs = xcalloc(NB * 16 * sizeof *segs);
    for (size_t si = 0; si < 2 * KH_SHAPES / 3; si++) { /* each (heads, tokens, dim), both widths */
        kv_dtype t0;
        kv_layout l = kh_shape(si % (KH_SHAPES / 3), &t0), dl;
        kv_dtype t = dtype_of(rng_below(&r, 3));
        l.elt_size = dtype_size(t);
        l.quant_group = groups[rng_below(&r, KH_N(groups))];
        dl = l;
        if (rng_below(&r, 2))
            dl.block_tokens = 1 + rng_below(&r, 2 * l.block_tokens);
        uint32_t bits = k_bits[si / (KH_SHAPES / 3)];
        uint32_t nbd = (NB * l.block_tokens + dl.block_tokens - 1) / dl.block_tokens;
        size_t qbb = kv_lowbit_block_bytes(&l, bits), pool_bytes = nbd * kv_block_bytes(&dl);
        uint8_t *q = xcalloc(NB * qbb), *p1 = xcalloc(pool_bytes), *p2 = xcalloc(pool_bytes);
        kv_segment *dsegs = xcalloc((size_t)nbd * dl.block_tokens * sizeof *dsegs);
        fill_bytes(&r, q, NB * qbb);
        for (uint32_t b = 0; b < NB; b++) {
            size_t lo = kv_lowbit_key_params_offset(&l, bits, b, 0, 0);
            size_t hi = kv_lowbit_shift_offset(&l, bits, b);
            uint32_t bad = bads[rng_below(&r, KH_N(bads))];
            for (size_t o = lo; o + 2 <= hi; o += 2) {
                uint16_t h = any_half(&r, bad);
                memcpy(q + o, &h, 2);
            }
            int32_t e = rng_below(&r, 8) ? shifts[rng_below(&r, KH_N(shifts))]
                                         : (int32_t)(uint32_t)rng_next(&r);
            memcpy(q + hi, &e, 4);
        }
        size_t nq = gen_disjoint(&r, &l, 0, NB, segs);
        size_t nd = gen_exact(&r, &dl, 0, nbd, kv_segments_tokens(segs, nq), dsegs);
        fill_bytes(&r, p1, pool_bytes);
        memcpy(p2, p1, pool_bytes);
        kv_lowbit_dequantize_ref(&l, bits, q, segs, nq, t, &dl, p1, dsegs, nd);
        kv_lowbit_dequantize(&l, bits, q, segs, nq, t, &dl, p2, dsegs, nd);
        expect_bytes(p1, p2, pool_bytes, &l, bits, dtype_name(t));
        free(q);
        free(p1);
        free(p2);
        free(dsegs);
    }
    free(segs);
}

/* An element of type t (its bits at p) as a worker may have written it,
 * drawn by `mode`: 0 usual values of a random scale; 1 half of them +0 or
 * -0 (the sign of a zero min or max is the first one's in the
 * reference's order); 2 a mix of zeros, subnormals, NaN with payloads,
 * infinities and values of any exponent; 3 the block's one value `c` in
 * most places (constant groups, s = 0); 4 any finite exponent (shifts,
 * parameters at the ends of the fp16 range, subnormal after the shift)
 * and NaN, which must not hide the largest |x| from the shift. */
static void any_elt(rng *r, kv_dtype t, uint32_t mode, float c, uint8_t *p)
{
    uint32_t mbits = t == KV_FP16 ? 10 : t == KV_BF16 ? 7 : 23, ebits = t == KV_FP16 ? 5 : 8;
    uint32_t emax = (1u << ebits) - 1, sign = (uint32_t)rng_below(r, 2) << (mbits + ebits);
    uint32_t mant = (uint32_t)rng_next(r) & ((1u << mbits) - 1), exp, k = rng_below(r, 20);
    static const float scales[] = {1.0f, 1e-3f, 300.0f, 1e5f};
    if (mode == 0 || (mode == 1 && k >= 10) || (mode == 2 && k >= 10) || (mode == 3 && k >= 18)) {
        kv_elt_store(p, t, rng_float(r) * scales[rng_below(r, KH_N(scales))]);
        return;
    }
    if (mode == 3) {
        kv_elt_store(p, t, c);
        return;
    }
    if (mode == 4 && k < 2) {
        exp = emax; /* NaN */
        mant |= 1;
    } else if (mode == 4 || (mode == 2 && k >= 7)) {
        exp = rng_below(r, emax); /* finite */
    } else if (mode == 1 || k < 2) {
        exp = mant = 0; /* +-0 */
    } else if (k < 4) {
        exp = 0; /* subnormal */
        mant |= 1;
    } else if (k < 6) {
        exp = emax; /* NaN */
        mant |= 1;
    } else {
        exp = emax; /* infinity */
        mant = 0;
    }
    uint32_t b = sign | exp << mbits | mant;
    if (t == KV_FP32) {
        memcpy(p, &b, 4);
    } else {
        uint16_t h = (uint16_t)b;
        memcpy(p, &h, 2);
    }
}

/* Quantisation of any pool contents (any_elt's modes, a mode per block)
 * fast == ref byte for byte, every (heads, tokens, dim) of the harness,
 * both widths, every dtype, group sizes multiples of 8 (the AVX2 build's
 * value groups in registers) and not. */
static void test_quantize_any_values(void **state)
{
    (void)state;
    static const uint32_t groups[] = {0, 8, 16, 24, 1, 3};
    rng r = {47};
    kv_segment *segs = xcalloc(NB * 16 * sizeof *segs);
    for (size_t si = 0; si < 2 * KH_SHAPES / 3; si++) {
        kv_dtype t0;
        kv_layout l = kh_shape(si % (KH_SHAPES / 3), &t0);
        kv_dtype t = dtype_of(rng_below(&r, 3));
        uint32_t bits = k_bits[si / (KH_SHAPES / 3)];
        l.elt_size = dtype_size(t);
        l.quant_group = groups[rng_below(&r, KH_N(groups))];
        size_t bb = kv_block_bytes(&l), qbb = kv_lowbit_block_bytes(&l, bits);
        uint8_t *pool = xcalloc(NB * bb), *q1 = xcalloc((NB + 1) * qbb);
        uint8_t *q2 = xcalloc((NB + 1) * qbb);
        uint32_t qblocks[NB + 1];
        for (uint32_t b = 0; b < NB; b++) {
            uint32_t mode = rng_below(&r, 5);
            float c = rng_float(&r) * (rng_below(&r, 2) ? 1.0f : 1e4f);
            for (size_t o = 0; o < bb; o += l.elt_size)
                any_elt(&r, t, mode, c, pool + b * bb + o);
        }
        size_t nsegs = gen_disjoint(&r, &l, 0, NB, segs);
        size_t nq = (kv_segments_tokens(segs, nsegs) + l.block_tokens - 1) / l.block_tokens;
        permutation(&r, qblocks, NB + 1);
        fill_bytes(&r, q1, (NB + 1) * qbb);
        memcpy(q2, q1, (NB + 1) * qbb);
        kv_lowbit_quantize_ref(&l, bits, t, pool, segs, nsegs, q1, qblocks, nq);
        kv_lowbit_quantize(&l, bits, t, pool, segs, nsegs, q2, qblocks, nq);
        expect_bytes(q1, q2, (NB + 1) * qbb, &l, bits, dtype_name(t));
        free(pool);
        free(q1);
        free(q2);
    }
    free(segs);
}

/* Element c of (block b, kv, head h, slot s) of a pool of layout l. */
static size_t elt_off(const kv_layout *l, uint32_t b, uint32_t kv, uint32_t h, uint32_t s,
                      uint32_t c)
{
    return kv_key_offset(l, b, h, s) + (kv ? kv_block_bytes(l) / 2 : 0) + (size_t)c * l->elt_size;
}

/* The group of (kv, h, s, c) in block b of a low-bit arena: its scale and
 * zero point, times the block's 2^e (exact: a power of two). */
static void group_params(const kv_layout *l, uint32_t bits, const uint8_t *q, uint32_t b,
                         uint32_t kv, uint32_t h, uint32_t s, uint32_t c, float *sf, float *zf)
{
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G;
    int32_t e;
    memcpy(&e, q + kv_lowbit_shift_offset(l, bits, b), 4);
    float p2 = kv_lowbit_pow2(e);
    if (kv == 0) {
        const uint8_t *p = q + kv_lowbit_key_params_offset(l, bits, b, h, s / G);
        *sf = half_at(p, c) * p2;
        *zf = half_at(p, (size_t)d + c) * p2;
    } else {
        const uint8_t *p = q + kv_lowbit_value_params_offset(l, bits, b, h, s);
        *sf = half_at(p, c / G) * p2;
        *zf = half_at(p, (size_t)nv + c / G) * p2;
    }
}

/* Whole blocks quantised and read back into fp32: every value within s/2
 * (plus the fp32 rounding of code·s + z) of its original, inside [z, z +
 * sL]; a channel of zeros exact. Values up to 10, and on every other
 * shape up to 10^6 (not fp16: the block's shift brings them into the fp16
 * parameters' range). The mean error of INT2 is above INT4's. */
static void test_round_trip_bound(void **state)
{
    (void)state;
    rng r = {43};
    double mean_err[2] = {0, 0};
    size_t counted[2] = {0, 0};
    for (size_t si = 0; si < KH_SHAPES; si += 5)
        for (size_t b = 0; b < KH_N(k_bits); b++) {
            kv_dtype t;
            kv_layout l = kh_shape(si, &t);
            l.quant_group = k_groups[(si / 5) % KH_N(k_groups)];
            uint32_t T = l.block_tokens, bits = k_bits[b], L = (1u << bits) - 1;
            size_t pb = NB * kv_block_bytes(&l);
            kv_layout l32 = l;
            l32.elt_size = 4;
            uint8_t *pool = xcalloc(pb), *q = xcalloc(NB * kv_lowbit_block_bytes(&l, bits));
            uint8_t *back = xcalloc(NB * kv_block_bytes(&l32));
            kv_segment segs[NB];
            uint32_t qblocks[NB];
            int large = (si / 5) % 2 && t != KV_FP16;
            fill_pool(&r, pool, pb, t, large ? 1e6f : 10.0f);
            for (uint32_t bl = 0; bl < NB; bl++) {
                for (uint32_t s = 0; s < T; s++) /* channel 0 of every key: zero */
                    for (uint32_t h = 0; h < l.kv_heads; h++)
                        kv_elt_store(pool + elt_off(&l, bl, 0, h, s, 0), t, 0.0f);
                segs[bl] = (kv_segment){bl, 0, T};
                qblocks[bl] = bl;
            }
            kv_lowbit_quantize(&l, bits, t, pool, segs, NB, q, qblocks, NB);
            kv_lowbit_dequantize(&l32, bits, q, segs, NB, KV_FP32, &l32, back, segs, NB);
            for (uint32_t bl = 0; bl < NB; bl++) { /* shifted only when values pass 32768 */
                int32_t e;
                memcpy(&e, q + kv_lowbit_shift_offset(&l, bits, bl), 4);
                assert_true(large ? e > 0 : e == 0);
            }
            for (uint32_t bl = 0; bl < NB; bl++)
                for (uint32_t kv = 0; kv < 2; kv++)
                    for (uint32_t h = 0; h < l.kv_heads; h++)
                        for (uint32_t s = 0; s < T; s++)
                            for (uint32_t c = 0; c < l.head_dim; c++) {
                                float x = kv_elt_load(pool + elt_off(&l, bl, kv, h, s, c), t);
                                float y =
                                    kv_elt_load(back + elt_off(&l32, bl, kv, h, s, c), KV_FP32);
                                float sf, zf;
                                group_params(&l, bits, q, bl, kv, h, s, c, &sf, &zf);
                                double tol = sf / 2.0 + 1e-6 * (fabs(zf) + sf * L);
                                if (!(fabs((double)y - x) <= tol))
                                    fail_msg("%u bits: |%g - %g| > s/2 = %g (kv %u head %u slot "
                                             "%u ch %u)",
                                             bits, (double)y, (double)x, sf / 2.0, kv, h, s, c);
                                assert_true(zf <= x && x <= sf * (float)L + zf);
                                if (kv == 0 && c == 0)
                                    assert_true(y == 0.0f);
                                mean_err[b] += fabs((double)y - x);
                                counted[b]++;
                            }
            free(pool);
            free(q);
            free(back);
        }
    mean_err[0] /= (double)counted[0];
    mean_err[1] /= (double)counted[1];
    print_message("mean |error| (values up to 10 and 10^6): INT4 %.4f, INT2 %.4f\n", mean_err[0],
                  mean_err[1]);
    assert_true(mean_err[0] > 0 && mean_err[1] > 2 * mean_err[0]);
}

/* A worker may write anything into its pool: inf, NaN and values beyond
 * fp16 quantise (fast == ref, under UBSan in CI) into codes in range. */
static void test_hostile_values(void **state)
{
    (void)state;
    rng r = {44};
    kv_layout l = {2, 9, 20, 4, 4};
    uint8_t *pool = xcalloc(NB * kv_block_bytes(&l));
    fill_pool(&r, pool, NB * kv_block_bytes(&l), KV_FP32, 1.0f);
    static const float odd[] = {INFINITY, -INFINITY, NAN, 1e30f, -1e30f, 70000.0f, 1e-40f};
    for (size_t i = 0; i < NB * kv_block_bytes(&l) / 4; i += 1 + rng_below(&r, 7))
        memcpy(pool + 4 * i, &odd[rng_below(&r, KH_N(odd))], 4);
    kv_segment segs[NB];
    uint32_t qblocks[NB];
    for (uint32_t b = 0; b < NB; b++) {
        segs[b] = (kv_segment){b, 0, 9};
        qblocks[b] = b;
    }
    for (size_t b = 0; b < KH_N(k_bits); b++) {
        size_t qbb = kv_lowbit_block_bytes(&l, k_bits[b]);
        uint8_t *q1 = xcalloc(NB * qbb), *q2 = xcalloc(NB * qbb);
        uint8_t *back = xcalloc(NB * kv_block_bytes(&l));
        kv_lowbit_quantize_ref(&l, k_bits[b], KV_FP32, pool, segs, NB, q1, qblocks, NB);
        kv_lowbit_quantize(&l, k_bits[b], KV_FP32, pool, segs, NB, q2, qblocks, NB);
        expect_bytes(q1, q2, NB * qbb, &l, k_bits[b], "hostile quantize");
        kv_lowbit_dequantize(&l, k_bits[b], q2, segs, NB, KV_FP32, &l, back, segs, NB);
        for (size_t i = 0; i < NB * kv_block_bytes(&l) / 4; i++) {
            float y;
            memcpy(&y, back + 4 * i, 4);
            assert_false(isnan(y)); /* infinite where an infinity saturated a group */
        }
        free(q1);
        free(q2);
        free(back);
    }
    free(pool);
}

/* A list that splits over threads gives the same bytes as one thread. */
static void test_threads_deterministic(void **state)
{
    (void)state;
    rng r = {45};
    kv_layout l = {8, 49, 128, 2, 0}; /* INT4 blocks of fp16 8x128 16-token blocks */
    uint32_t nb = 40;                 /* 7.7 MiB of fp16 tokens: several threads' worth */
    size_t pb = nb * kv_block_bytes(&l), qbb = kv_lowbit_block_bytes(&l, 4);
    uint8_t *pool = xcalloc(pb), *q1 = xcalloc(nb * qbb), *q2 = xcalloc(nb * qbb);
    uint8_t *b1 = xcalloc(pb), *b2 = xcalloc(pb);
    kv_segment *segs = xcalloc(nb * 49 * sizeof *segs);
    uint32_t *qblocks = xcalloc(nb * sizeof *qblocks);
    fill_pool(&r, pool, pb, KV_FP16, 4.0f);
    size_t n = cut_blocks(&r, &l, 0, nb, 2, segs);
    shuffle_segs(&r, segs, n);
    permutation(&r, qblocks, nb);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_lowbit_quantize(&l, 4, KV_FP16, pool, segs, n, q1, qblocks, nb);
    kv_lowbit_dequantize(&l, 4, q1, segs, n, KV_FP16, &l, b1, segs, n);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_lowbit_quantize(&l, 4, KV_FP16, pool, segs, n, q2, qblocks, nb);
    kv_lowbit_dequantize(&l, 4, q2, segs, n, KV_FP16, &l, b2, segs, n);
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
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_tokens_per_block),
        cmocka_unit_test(test_group_vectors),
        cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_dequantize_any_params),
        cmocka_unit_test(test_quantize_any_values),
        cmocka_unit_test(test_round_trip_bound),
        cmocka_unit_test(test_hostile_values),
        cmocka_unit_test(test_threads_deterministic),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
