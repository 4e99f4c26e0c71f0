/* Element conversions and WeightedKV's value merge kernel (kernels.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <cmocka.h>

#include "kernels.h"

/* Every finite fp16 and bf16 value survives load -> store unchanged. */
static void test_half_and_bf16_roundtrip(void **state)
{
    (void)state;
    for (uint32_t bits = 0; bits < 65536; bits++) {
        uint8_t in[2] = {(uint8_t)bits, (uint8_t)(bits >> 8)}, out[2];
        uint32_t exp = (bits >> 10) & 0x1f;
        if (exp != 31) {
            kv_elt_store(out, KV_FP16, kv_elt_load(in, KV_FP16));
            assert_memory_equal(in, out, 2);
        }
        if (((bits >> 7) & 0xff) != 0xff) {
            kv_elt_store(out, KV_BF16, kv_elt_load(in, KV_BF16));
            assert_memory_equal(in, out, 2);
        }
    }
}

static void test_known_values(void **state)
{
    (void)state;
    uint8_t b[2];
    kv_elt_store(b, KV_FP16, 1.0f);
    assert_int_equal(b[0] | b[1] << 8, 0x3c00);
    kv_elt_store(b, KV_FP16, -2.5f);
    assert_int_equal(b[0] | b[1] << 8, 0xc100);
    kv_elt_store(b, KV_FP16, 65520.0f); /* rounds past the largest half */
    assert_int_equal(b[0] | b[1] << 8, 0x7c00);
    kv_elt_store(b, KV_FP16, 5.960464477539063e-08f); /* smallest subnormal */
    assert_int_equal(b[0] | b[1] << 8, 0x0001);
    kv_elt_store(b, KV_FP16, 1.0f + 1.0f / 2048); /* a tie: to even (1.0) */
    assert_int_equal(b[0] | b[1] << 8, 0x3c00);
    kv_elt_store(b, KV_BF16, 1.0f);
    assert_int_equal(b[0] | b[1] << 8, 0x3f80);
}

/* V[into] = (wf V[from] + wi V[into]) / (wf + wi), every head, keys kept. */
static void test_merge_value(void **state)
{
    (void)state;
    kv_layout l = {2, 4, 3, 4, 0}; /* 2 heads, 4 slots, dim 3, fp32 */
    size_t bb = kv_block_bytes(&l);
    float pool[2 * 2 * 2 * 4 * 3];
    for (size_t i = 0; i < sizeof pool / sizeof pool[0]; i++)
        pool[i] = (float)i;
    float before[sizeof pool / sizeof pool[0]];
    memcpy(before, pool, sizeof pool);
    uint8_t *base = (uint8_t *)pool;
    kv_merge_value(&l, KV_FP32, base, 0, 1, 1, 2, 1.0f, 3.0f);
    for (uint32_t h = 0; h < 2; h++)
        for (uint32_t c = 0; c < 3; c++) {
            size_t from = (kv_key_offset(&l, 0, h, 1) + bb / 2) / 4 + c;
            size_t into = (kv_key_offset(&l, 1, h, 2) + bb / 2) / 4 + c;
            assert_float_equal(pool[into], 0.25f * before[from] + 0.75f * before[into], 1e-5);
            pool[into] = before[into];
        }
    assert_memory_equal(pool, before, sizeof pool); /* nothing else changed */
    /* Both weights zero: the plain average (POLICIES.md §4.2). */
    kv_merge_value(&l, KV_FP32, base, 0, 0, 0, 3, 0.0f, 0.0f);
    size_t from = (kv_key_offset(&l, 0, 0, 0) + bb / 2) / 4;
    size_t into = (kv_key_offset(&l, 0, 0, 3) + bb / 2) / 4;
    assert_float_equal(pool[into], 0.5f * (before[from] + before[into]), 1e-5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_half_and_bf16_roundtrip),
        cmocka_unit_test(test_known_values),
        cmocka_unit_test(test_merge_value),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
