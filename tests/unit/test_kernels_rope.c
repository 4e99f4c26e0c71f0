/*
 * test_kernels_rope.c - RoPE re-rotation (kernels.h "RoPE re-rotation"):
 * - T-OV3 (POLICIES.md §2.10): RoPE(k, 5) rotated by -2 is RoPE(k, 3);
 * - the property rerotate(RoPE(k, p_old), p_new - p_old) == RoPE(k, p_new)
 *   within 1e-5 (fp32), 1e-3 (fp16), 1e-2 (bf16), both pairings, theta
 *   10000 and 500000, positions up to 32k;
 * - fast == reference byte for byte on random shapes, lists and deltas;
 *   values and unlisted tokens untouched; threads change nothing.
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

/* RoPE at position p in double: pairs per `pairing`, theta_j =
 * theta^(-2j/d). */
static void rope_double(const double *k, uint32_t d, double p, double theta,
                        kv_rope_pairing pairing, double *out)
{
    for (uint32_t j = 0; j < d / 2; j++) {
        uint32_t a = pairing == KV_ROPE_HALF ? j : 2 * j;
        uint32_t b = pairing == KV_ROPE_HALF ? j + d / 2 : 2 * j + 1;
        double ang = p * pow(theta, -2.0 * j / d);
        out[a] = k[a] * cos(ang) - k[b] * sin(ang);
        out[b] = k[a] * sin(ang) + k[b] * cos(ang);
    }
}

static void test_tov3(void **state)
{
    (void)state;
    const double k[4] = {1, 2, 3, 4}, at5[4] = {3.160435, 1.797584, -0.107938, 4.094959},
                 at3[4] = {-1.413353, 1.879118, -2.828857, 4.058191};
    double r5[4];
    rope_double(k, 4, 5, 10000, KV_ROPE_HALF, r5);
    for (int i = 0; i < 4; i++)
        assert_float_equal(r5[i], at5[i], 1e-6);
    for (int fast = 0; fast < 2; fast++) {
        kv_layout l = {1, 1, 4, 4, 0};
        float pool[8] = {0};
        for (int i = 0; i < 4; i++)
            pool[i] = (float)r5[i];
        kv_segment seg = {0, 0, 1};
        int32_t delta = -2; /* OpenVINO: one block of B = 2 evicted before it */
        (fast ? kv_rope_rerotate : kv_rope_rerotate_ref)(&l, KV_FP32, (uint8_t *)pool, &seg, 1,
                                                         &delta, 10000.0, KV_ROPE_HALF);
        for (int i = 0; i < 4; i++)
            assert_float_equal(pool[i], at3[i], 1e-5);
        for (int i = 4; i < 8; i++)
            assert_true(pool[i] == 0); /* V untouched */
    }
}

/* The property over a block of keys: each listed token gets its own
 * p_old and p_new. */
static void check_property(rng *r, kv_dtype t, kv_rope_pairing pairing, double theta, int fast)
{
    kv_layout l = {3, 8, 64, dtype_size(t), 0};
    size_t bb = kv_block_bytes(&l);
    uint8_t *pool = xcalloc(2 * bb);
    double k[64], roped[64], want[64];
    double tol = t == KV_FP32 ? 1e-5 : t == KV_FP16 ? 1e-3 : 1e-2;
    uint32_t pold[16], pnew[16];
    int32_t delta[16];
    double keys[16][3][64];
    kv_segment segs[2] = {{1, 0, 8}, {0, 0, 8}};
    for (uint32_t i = 0; i < 16; i++) {
        pold[i] = rng_below(r, 32768);
        /* eviction shifts left; also check right shifts and no shift */
        pnew[i] = i % 4 == 0 ? pold[i] : rng_below(r, 32768);
        delta[i] = (int32_t)pnew[i] - (int32_t)pold[i];
        uint32_t blk = segs[i / 8].block, slot = i % 8;
        for (uint32_t h = 0; h < 3; h++) {
            for (uint32_t j = 0; j < 64; j++)
                keys[i][h][j] = k[j] = rng_float(r) * 0.5;
            rope_double(k, 64, pold[i], theta, pairing, roped);
            for (uint32_t j = 0; j < 64; j++)
                kv_elt_store(pool + kv_key_offset(&l, blk, h, slot) + j * l.elt_size, t,
                             (float)roped[j]);
        }
    }
    (fast ? kv_rope_rerotate : kv_rope_rerotate_ref)(&l, t, pool, segs, 2, delta, theta, pairing);
    double worst = 0;
    for (uint32_t i = 0; i < 16; i++)
        for (uint32_t h = 0; h < 3; h++) {
            rope_double(keys[i][h], 64, pnew[i], theta, pairing, want);
            for (uint32_t j = 0; j < 64; j++) {
                size_t off = kv_key_offset(&l, segs[i / 8].block, h, i % 8) + j * l.elt_size;
                double err = fabs(kv_elt_load(pool + off, t) - want[j]);
                worst = err > worst ? err : worst;
                if (err > tol)
                    fail_msg("%s %s theta %g: token %u head %u ch %u: |%g - %g| > %g",
                             dtype_name(t), pairing == KV_ROPE_HALF ? "half" : "interleaved", theta,
                             i, h, j, (double)kv_elt_load(pool + off, t), want[j], tol);
            }
        }
    print_message("%s %-11s theta %-6g %s: worst error %.3g (tolerance %g)\n", dtype_name(t),
                  pairing == KV_ROPE_HALF ? "half" : "interleaved", theta, fast ? "fast" : "ref",
                  worst, tol);
    free(pool);
}

static void test_property(void **state)
{
    (void)state;
    rng r = {31};
    const double thetas[2] = {10000.0, 500000.0};
    for (uint32_t ti = 0; ti < 3; ti++)
        for (int pairing = 0; pairing < 2; pairing++)
            for (int th = 0; th < 2; th++)
                for (int fast = 0; fast < 2; fast++)
                    check_property(&r, dtype_of(ti), (kv_rope_pairing)pairing, thetas[th], fast);
}

static void test_fast_equals_ref(void **state)
{
    (void)state;
    rng r = {32};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint32_t nb = 4;
        size_t pb = nb * kv_block_bytes(&l);
        uint8_t *p1 = xcalloc(pb), *p2 = xcalloc(pb), *orig = xcalloc(pb);
        kv_segment *segs = xcalloc(nb * l.block_tokens * sizeof *segs);
        int32_t *delta = xcalloc(nb * l.block_tokens * sizeof *delta);
        for (int trial = 0; trial < 2; trial++) {
            fill_pool(&r, orig, pb, t, 3.0f);
            memcpy(p1, orig, pb);
            memcpy(p2, orig, pb);
            size_t n = gen_disjoint(&r, &l, 0, nb, segs), ntok = kv_segments_tokens(segs, n);
            /* runs of equal deltas (per block, as OpenVINO) and single ones */
            int32_t d = 0;
            for (size_t i = 0; i < ntok; i++) {
                if (rng_below(&r, 4) == 0)
                    d = (int32_t)rng_below(&r, 70000) - 35000;
                delta[i] = d;
            }
            kv_rope_pairing pairing = (kv_rope_pairing)(trial % 2);
            kv_rope_rerotate_ref(&l, t, p1, segs, n, delta, 10000.0, pairing);
            kv_rope_rerotate(&l, t, p2, segs, n, delta, 10000.0, pairing);
            if (memcmp(p1, p2, pb) != 0)
                fail_msg("rerotate differs: heads %u tokens %u dim %u %s", l.kv_heads,
                         l.block_tokens, l.head_dim, dtype_name(t));
            /* values of every block untouched */
            for (uint32_t b = 0; b < nb; b++) {
                size_t half = kv_block_bytes(&l) / 2, off = b * kv_block_bytes(&l) + half;
                assert_memory_equal(p2 + off, orig + off, half);
            }
        }
        free(p1);
        free(p2);
        free(orig);
        free(segs);
        free(delta);
    }
}

static void test_threads_deterministic(void **state)
{
    (void)state;
    rng r = {33};
    kv_layout l = {8, 16, 128, 2, 0};
    uint32_t nb = 128;
    size_t pb = nb * kv_block_bytes(&l);
    uint8_t *p1 = xcalloc(pb), *p2 = xcalloc(pb);
    kv_segment *segs = xcalloc(nb * 16 * sizeof *segs);
    int32_t *delta = xcalloc(nb * 16 * sizeof *delta);
    fill_pool(&r, p1, pb, KV_FP16, 1.0f);
    memcpy(p2, p1, pb);
    size_t n = cut_blocks(&r, &l, 0, nb, 2, segs);
    for (size_t i = 0; i < (size_t)nb * 16; i++)
        delta[i] = -(int32_t)(i / 16) * 16;
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_rope_rerotate(&l, KV_FP16, p1, segs, n, delta, 10000.0, KV_ROPE_HALF);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_rope_rerotate(&l, KV_FP16, p2, segs, n, delta, 10000.0, KV_ROPE_HALF);
    assert_memory_equal(p1, p2, pb);
    free(p1);
    free(p2);
    free(segs);
    free(delta);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tov3),
        cmocka_unit_test(test_property),
        cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_threads_deterministic),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
