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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_every_16_bit_pattern),
        cmocka_unit_test(test_store_boundaries),
        cmocka_unit_test(test_store_dense_stride),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
