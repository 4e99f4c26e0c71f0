/*
 * test_kernels_elt.c - kernels/elt.h (the branch-free element conversions
 * the fast CPU kernels and the CUDA kernels share) equals kv_elt_load /
 * kv_elt_store bit for bit: every fp16 and bf16 pattern, and floats from
 * every binade, every rounding boundary and a dense stride over all 2^32
 * patterns.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "elt.h"
#include "kernels.h"

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static void test_load_every_16_bit_pattern(void **state)
{
    (void)state;
    for (uint32_t b = 0; b < 65536; b++) {
        uint8_t p[2] = {(uint8_t)b, (uint8_t)(b >> 8)};
        uint32_t want = bits_of(kv_elt_load(p, KV_FP16)), got = bits_of(kv_half_to_float(b));
        if (want != got)
            fail_msg("fp16 0x%04x: kv_elt_load 0x%08x, elt.h 0x%08x", b, want, got);
        want = bits_of(kv_elt_load(p, KV_BF16));
        got = bits_of(kv_bf16_to_float((uint16_t)b));
        if (want != got)
            fail_msg("bf16 0x%04x: kv_elt_load 0x%08x, elt.h 0x%08x", b, want, got);
    }
}

static void check_store(uint32_t fb)
{
    float f;
    memcpy(&f, &fb, 4);
    uint8_t p[2];
    kv_elt_store(p, KV_FP16, f);
    uint16_t want = (uint16_t)(p[0] | p[1] << 8), got = kv_float_to_half(f);
    if (want != got)
        fail_msg("float 0x%08x -> fp16: kv_elt_store 0x%04x, elt.h 0x%04x", fb, want, got);
    kv_elt_store(p, KV_BF16, f);
    want = (uint16_t)(p[0] | p[1] << 8);
    got = kv_float_to_bf16(f);
    if (want != got)
        fail_msg("float 0x%08x -> bf16: kv_elt_store 0x%04x, elt.h 0x%04x", fb, want, got);
}

static void test_store_boundaries(void **state)
{
    (void)state;
    /* Around every fp16 value's midpoints (and so every rounding decision)
     * and every bf16 one: the float patterns of each 16-bit value shifted
     * into place, +-3 ulps, both signs. */
    for (uint32_t e = 0; e < 0x10000; e++) {
        float hv = kv_half_to_float((uint16_t)e);
        uint32_t hb = bits_of(hv), bb = e << 16;
        for (int32_t k = -3; k <= 3; k++) {
            check_store(hb + (uint32_t)k);
            check_store((hb + (uint32_t)k) + 0x1000u); /* the fp16 midpoint region */
            check_store(bb + (uint32_t)k);
            check_store(bb + 0x8000u + (uint32_t)k); /* the bf16 midpoint */
        }
    }
    /* Overflow edges, infinities, NaNs, zeros, subnormal floats. */
    const uint32_t special[] = {0x477fefffu, 0x477ff000u, 0x477ff001u, 0x7f7fffffu, 0x7f800000u,
                                0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0x00000000u, 0x00000001u,
                                0x007fffffu, 0x33000000u, 0x33000001u, 0x337fffffu, 0x38800000u,
                                0x387fffffu, 0x387fe000u, 0x387ff000u};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) {
        check_store(special[i]);
        check_store(special[i] | 0x80000000u);
    }
}

static void test_store_dense_stride(void **state)
{
    (void)state;
    /* About 2^25 patterns spread over all of them. */
    for (uint64_t b = 0; b < 0x100000000ull; b += 127)
        check_store((uint32_t)b);
}

/* kv_elts_diff against a double-precision loop over kv_elt_load, for each
 * dtype, odd lengths and chunk edges, in both ISA builds: maxima exact,
 * sums within fp32 rounding. */
static void test_elts_diff(void **state)
{
    (void)state;
    static const size_t lengths[] = {0, 1, 7, 8, 9, 511, 512, 513, 1500};
    uint64_t seed = 12345;
    for (int isa = 0; isa < 2; isa++) {
        if (isa == 0)
            setenv("KVSTASH_KERNEL_ISA", "generic", 1);
        else
            unsetenv("KVSTASH_KERNEL_ISA");
        for (kv_dtype t = KV_FP16; t <= KV_FP32; t++) {
            size_t elt = t == KV_FP32 ? 4 : 2;
            for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
                size_t n = lengths[li];
                uint8_t got[1500 * 4], ref[1500 * 4];
                double want_md = 0, want_mr = 0, want_sd = 0, want_sr = 0;
                for (size_t i = 0; i < n; i++) {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    float x = (float)((double)(seed >> 40) / (double)(1ull << 24) * 8.0 - 4.0);
                    float y = x + (float)((double)((seed >> 8) & 0xffff) / 65536.0 - 0.5) * 0.1f;
                    kv_elt_store(ref + i * elt, t, x);
                    kv_elt_store(got + i * elt, t, y);
                    double xr = kv_elt_load(ref + i * elt, t), yr = kv_elt_load(got + i * elt, t);
                    double e = yr > xr ? yr - xr : xr - yr, a = xr < 0 ? -xr : xr;
                    want_md = e > want_md ? e : want_md;
                    want_mr = a > want_mr ? a : want_mr;
                    want_sd += e * e;
                    want_sr += a * a;
                }
                kv_diff d = {0, 0, 0, 0};
                kv_elts_diff(got, ref, t, n, &d);
                if (d.max_diff != (double)(float)want_md || d.max_ref != want_mr)
                    fail_msg("dtype %d n %zu: max %g %g, want %g %g", (int)t, n, d.max_diff,
                             d.max_ref, want_md, want_mr);
                if (d.sq_diff < want_sd * (1 - 1e-5) || d.sq_diff > want_sd * (1 + 1e-5) ||
                    d.sq_ref < want_sr * (1 - 1e-5) || d.sq_ref > want_sr * (1 + 1e-5))
                    fail_msg("dtype %d n %zu: sums %g %g, want %g %g", (int)t, n, d.sq_diff,
                             d.sq_ref, want_sd, want_sr);
            }
        }
    }
    unsetenv("KVSTASH_KERNEL_ISA");
}

/* Both ISA builds of kv_elts_diff give the same four sums, bit for bit
 * (kernels/cpu/isa.h), over chunk edges and odd tails. */
static void test_elts_diff_builds_agree(void **state)
{
    (void)state;
    static const size_t lengths[] = {3, 8, 100, 512, 1029, 4096};
    static uint8_t got[4096 * 4], ref[4096 * 4];
    uint64_t seed = 99;
    for (kv_dtype t = KV_FP16; t <= KV_FP32; t++)
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            size_t n = lengths[li], elt = t == KV_FP32 ? 4 : 2;
            for (size_t i = 0; i < n; i++) {
                seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                float x = (float)((double)(seed >> 40) / (double)(1ull << 24) * 200.0 - 100.0);
                kv_elt_store(ref + i * elt, t, x);
                kv_elt_store(got + i * elt, t, x * (1.0f + (float)(seed & 0xff) / 4096.0f));
            }
            kv_diff a = {0, 0, 0, 0}, b = {0, 0, 0, 0};
            setenv("KVSTASH_KERNEL_ISA", "generic", 1);
            kv_elts_diff(got, ref, t, n, &a);
            unsetenv("KVSTASH_KERNEL_ISA");
            kv_elts_diff(got, ref, t, n, &b);
            if (a.max_diff != b.max_diff || a.max_ref != b.max_ref || a.sq_diff != b.sq_diff ||
                a.sq_ref != b.sq_ref)
                fail_msg("dtype %d n %zu: generic %a %a %a %a, %s %a %a %a %a", (int)t, n,
                         a.max_diff, a.max_ref, a.sq_diff, a.sq_ref, kv_kernel_isa(), b.max_diff,
                         b.max_ref, b.sq_diff, b.sq_ref);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_every_16_bit_pattern), cmocka_unit_test(test_store_boundaries),
        cmocka_unit_test(test_store_dense_stride),        cmocka_unit_test(test_elts_diff),
        cmocka_unit_test(test_elts_diff_builds_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
