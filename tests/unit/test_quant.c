/* INT8 group quantisation against POLICIES.md §5.4 (T-CF4) and its bound. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <cmocka.h>

#include "kernels.h"

static void test_tcf4_roundtrips_exactly(void **state)
{
    (void)state;
    const float x[3] = {0.5f, -1.27f, 0.01f};
    int8_t q[3];
    float s = kv_quantize_group_ref(x, 3, q);
    assert_float_equal(s, 0.01f, 1e-9);
    assert_int_equal(q[0], 50);
    assert_int_equal(q[1], -127);
    assert_int_equal(q[2], 1);
    float back[3];
    kv_dequantize_group_ref(q, 3, s, back);
    for (int i = 0; i < 3; i++)
        assert_float_equal(back[i], x[i], 1e-6);
}

static void test_zero_group(void **state)
{
    (void)state;
    const float x[4] = {0, 0, -0.0f, 0};
    int8_t q[4] = {9, 9, 9, 9};
    assert_float_equal(kv_quantize_group_ref(x, 4, q), 1.0f, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(q[i], 0);
}

static void test_half_to_even_and_bound(void **state)
{
    (void)state;
    /* max 127 -> s = 1: 2.5 rounds to 2, 3.5 to 4, -2.5 to -2. */
    const float x[4] = {127, 2.5f, 3.5f, -2.5f};
    int8_t q[4];
    assert_float_equal(kv_quantize_group_ref(x, 4, q), 1.0f, 0);
    assert_int_equal(q[1], 2);
    assert_int_equal(q[2], 4);
    assert_int_equal(q[3], -2);
    /* Random groups: error per value <= max|x| / 254 (issue 4, acceptance 1). */
    srand(7);
    for (int g = 0; g < 200; g++) {
        float v[37], back[37];
        int8_t c[37];
        float amax = 0;
        for (int i = 0; i < 37; i++) {
            v[i] = ((float)rand() / RAND_MAX - 0.5f) * (float)(g + 1);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        float s = kv_quantize_group_ref(v, 37, c);
        kv_dequantize_group_ref(c, 37, s, back);
        for (int i = 0; i < 37; i++)
            assert_true(fabsf(back[i] - v[i]) <= amax / 254.0f * 1.0001f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tcf4_roundtrips_exactly),
        cmocka_unit_test(test_zero_group),
        cmocka_unit_test(test_half_to_even_and_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
