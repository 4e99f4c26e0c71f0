/*
 * test_kernels_merge_list.c - batched value merges (kernels.h "Value
 * merges, batched"): the fast version equals applying kv_merge_value once
 * per merge, byte for byte, on seeded random pools of every dtype and odd
 * sizes, including chains (a merge into a token that later merges on),
 * repeated targets, a token merged with itself and zero weights.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "test_kernels_harness.h"

static void test_fast_equals_ref(void **state)
{
    (void)state;
    rng r = {51};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint32_t nb = 3, ntok = nb * l.block_tokens;
        size_t pb = nb * kv_block_bytes(&l);
        uint8_t *p1 = xcalloc(pb), *p2 = xcalloc(pb);
        kv_merge m[24];
        fill_pool(&r, p1, pb, t, 4.0f);
        memcpy(p2, p1, pb);
        size_t n = 1 + rng_below(&r, 24);
        for (size_t i = 0; i < n; i++) {
            uint32_t a = rng_below(&r, ntok), b = rng_below(&r, ntok);
            if (i > 0 && rng_below(&r, 3) == 0) /* chain on from the last target */
                a = m[i - 1].into_block * l.block_tokens + m[i - 1].into_slot;
            m[i] = (kv_merge){a / l.block_tokens, a % l.block_tokens,   b / l.block_tokens,
                              b % l.block_tokens, rng_float(&r) + 1.0f, rng_float(&r) + 1.0f};
            if (rng_below(&r, 8) == 0)
                m[i].w_from = m[i].w_into = 0; /* §4.2: the plain average */
        }
        kv_merge_values_ref(&l, t, p1, m, n);
        kv_merge_values(&l, t, p2, m, n);
        if (memcmp(p1, p2, pb) != 0)
            fail_msg("merge differs: heads %u tokens %u dim %u %s", l.kv_heads, l.block_tokens,
                     l.head_dim, dtype_name(t));
        free(p1);
        free(p2);
    }
}

/* Every 16-bit pattern as a value (NaNs with payloads, infinities,
 * subnormals, signed zeros): the fp16 row conversions of the fast build
 * (F16C in the AVX2 build) must give kv_elt_load / kv_elt_store's bits. */
static void test_special_values(void **state)
{
    (void)state;
    for (int ti = 0; ti < 2; ti++) {
        kv_dtype t = ti ? KV_BF16 : KV_FP16;
        kv_layout l = {1, 2, 65536 / 2, 2, 0}; /* one block: K, then V of 2 slots */
        size_t pb = kv_block_bytes(&l);
        uint8_t *p1 = xcalloc(pb), *p2 = xcalloc(pb);
        /* V rows: slot 0 all patterns, slot 1 all patterns reversed */
        for (uint32_t i = 0; i < 32768; i++) {
            uint16_t a = (uint16_t)i, b = (uint16_t)(65535 - i), c = (uint16_t)(i + 32768),
                     d = (uint16_t)(32767 - i);
            memcpy(p1 + pb / 2 + 2 * i, &a, 2);
            memcpy(p1 + pb / 2 + 65536 + 2 * i, &b, 2);
            memcpy(p1 + 2 * i, &c, 2); /* keys: untouched, but there */
            memcpy(p1 + 65536 + 2 * i, &d, 2);
        }
        memcpy(p2, p1, pb);
        /* w_into 0: into = from exactly (1*x + 0*y), then mixes. */
        kv_merge m[3] = {{0, 0, 0, 1, 1.0f, 0.0f}, {0, 1, 0, 0, 1.0f, 3.0f}, {0, 0, 0, 0, 2, 2}};
        kv_merge_values_ref(&l, t, p1, m, 3);
        kv_merge_values(&l, t, p2, m, 3);
        assert_memory_equal(p1, p2, pb);
        free(p1);
        free(p2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_special_values),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
