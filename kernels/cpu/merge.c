/* Value merging (WeightedKV, POLICIES.md §4.1) and the element conversions
 * it needs: the pool stores fp16, bf16 or fp32; the arithmetic is fp32. */
#include <math.h>
#include <string.h>

#include "kernels.h"

float kv_elt_load(const uint8_t *p, kv_dtype t)
{
    uint32_t bits;
    float f;
    if (t == KV_FP32) {
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    if (t == KV_BF16) {
        bits = (uint32_t)h << 16;
        memcpy(&f, &bits, 4);
        return f;
    }
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &bits, 4);
    return f;
}

/* float -> IEEE half, round to nearest even, overflow to infinity. */
static uint16_t half_from_float(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or nan */
        return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);
    if (abs >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00;
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal */
        float a;
        memcpy(&a, &abs, 4);
        return sign | (uint16_t)lrintf(a * 16777216.0f); /* 2^24, ties to even */
    }
    uint32_t mant = abs + 0xfffu + ((abs >> 13) & 1u); /* round to nearest even */
    return sign | (uint16_t)((mant - 0x38000000u) >> 13);
}

void kv_elt_store(uint8_t *p, kv_dtype t, float v)
{
    if (t == KV_FP32) {
        memcpy(p, &v, 4);
        return;
    }
    uint16_t h;
    if (t == KV_BF16) {
        uint32_t x;
        memcpy(&x, &v, 4);
        if ((x & 0x7fffffffu) > 0x7f800000u)
            h = (uint16_t)((x >> 16) | 0x40); /* keep nan a nan */
        else
            h = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    } else {
        h = half_from_float(v);
    }
    memcpy(p, &h, 2);
}

void kv_merge_value(const kv_layout *l, kv_dtype t, uint8_t *pool, uint32_t from_block,
                    uint32_t from_slot, uint32_t into_block, uint32_t into_slot, float w_from,
                    float w_into)
{
    float sum = w_from + w_into;
    /* POLICIES.md §4.2: both weights zero (underflow) -> the plain average. */
    float a = sum > 0 ? w_from / sum : 0.5f, b = sum > 0 ? w_into / sum : 0.5f;
    size_t half = kv_block_bytes(l) / 2, row = (size_t)l->head_dim * l->elt_size;
    for (uint32_t h = 0; h < l->kv_heads; h++) {
        const uint8_t *src = pool + kv_key_offset(l, from_block, h, from_slot) + half;
        uint8_t *dst = pool + kv_key_offset(l, into_block, h, into_slot) + half;
        for (size_t off = 0; off < row; off += l->elt_size) {
            float v = a * kv_elt_load(src + off, t) + b * kv_elt_load(dst + off, t);
            kv_elt_store(dst + off, t, v);
        }
    }
}
