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
            m[i] = (kv_merge){a / l.block_tokens, a % l.block_tokens, b / l.block_tokens,
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_equals_ref),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
