/*
 * lowbit.h - the INT4 / INT2 group quantiser (kernels.h "Low-bit tiers"),
 * written once for the reference, the fast CPU kernels and the CUDA ones
 * (internal to kernels/; KV_HD marks the functions __host__ __device__
 * under nvcc).
 *
 * A group of values x gets an fp16 zero point z and an fp16 scale s:
 *   z = the largest fp16 <= min x (clamped to the finite fp16 range),
 *   s = the smallest fp16 >= (max x - z) / L, stepped up until
 *       z + s·L >= max x in fp32 (L = 2^bits - 1),
 * so that every value of the group lies in [z, z + s·L]; its code is
 * rne((x - z) / s) clamped to [0, L] (0 when s = 0), and the value read
 * back is code·s + z in fp32 (two roundings, no fused multiply-add). The
 * error is then at most s/2 plus the rounding of those fp32 operations.
 *
 * fp16 parameters hold groups up to |x| = 65504. So that any finite
 * values do, a block is quantised shifted: every x of the block is
 * multiplied by 2^-e first, and every value read back by 2^e (exact
 * powers of two: no rounding but below FLT_MIN), with e =
 * kv_lowbit_shift(max |x| of the block): 0 while the largest |x| is
 * below 32768, as in every real model's K/V, else the smallest e that
 * brings it there. The bound becomes s·2^e / 2. NaN elements are ignored
 * by min and max and get code 0; a group without a number gets s = z = 0;
 * infinities saturate (the value read back may be infinite, never
 * undefined).
 */
#ifndef KVSTASH_KERNELS_LOWBIT_H
#define KVSTASH_KERNELS_LOWBIT_H

#include <stdint.h>

#include "elt.h"

#define KV_HALF_MAX_BITS 0x7bffu /* 65504 */

/* A product rounded on its own: nvcc would fuse it into a following add. */
#ifdef __CUDA_ARCH__
#define KV_LOWBIT_MUL(a, b) __fmul_rn(a, b)
#else
#define KV_LOWBIT_MUL(a, b) ((a) * (b))
#endif

/* The fp16 next to finite h towards +inf (up = 1) or -inf (up = 0); the
 * largest finite fp16 stays where it is. */
KV_HD uint16_t kv_lowbit_half_step(uint16_t h, int up)
{
    uint32_t neg = h & 0x8000u, mag = h & 0x7fffu;
    if (mag == 0) /* +-0: the smallest subnormal of the step's sign */
        return (uint16_t)(up ? 0x0001u : 0x8001u);
    if ((neg == 0) == (up != 0)) /* away from zero */
        return (uint16_t)(mag >= KV_HALF_MAX_BITS ? h : h + 1u);
    return (uint16_t)(h - 1u); /* towards zero */
}

/* x as an fp16, clamped to the finite range: rounded down (up = 0) or up. */
KV_HD uint16_t kv_lowbit_half_bound(float x, int up)
{
    if (!(x < 65504.0f))
        return KV_HALF_MAX_BITS;
    if (!(x > -65504.0f))
        return 0x8000u | KV_HALF_MAX_BITS;
    uint16_t h = kv_float_to_half(x);
    float back = kv_half_to_float(h);
    if (up ? back < x : back > x)
        h = kv_lowbit_half_step(h, up);
    return h;
}

/* The zero point and scale (fp16 bits) of a group whose smallest and
 * largest values are lo and hi (lo > hi: no number in the group). */
KV_HD void kv_lowbit_params(float lo, float hi, uint32_t bits, uint16_t *scale, uint16_t *zero)
{
    if (!(lo <= hi)) {
        *scale = 0;
        *zero = 0;
        return;
    }
    float levels = (float)((1u << bits) - 1u);
    uint16_t z = kv_lowbit_half_bound(lo, 0);
    float zf = kv_half_to_float(z);
    uint16_t s = kv_lowbit_half_bound((hi - zf) / levels, 1);
    /* the division and the check round in fp32: step s up until the
     * group's top is covered, as it is read back (a step or two at most) */
    while (KV_LOWBIT_MUL(kv_half_to_float(s), levels) + zf < hi && s != KV_HALF_MAX_BITS)
        s = kv_lowbit_half_step(s, 1);
    *scale = s;
    *zero = z;
}

/* The shift e of a block whose largest |x| is amax (>= 0, NaN never):
 * with amax = m·2^(E-127), m in [1, 2), amax·2^-e <= 2^15 once e >= E -
 * 141. At most 114 (infinity). */
KV_HD int32_t kv_lowbit_shift(float amax)
{
    uint32_t E = (kv_float_to_bits(amax) >> 23) & 0xffu;
    return E > 141u ? (int32_t)(E - 141u) : 0;
}

/* 2^e as a float, e clamped to [-126, 127] (a block's shift is read from
 * memory a worker can write: any int32 must give a number). */
KV_HD float kv_lowbit_pow2(int32_t e)
{
    e = e < -126 ? -126 : e > 127 ? 127 : e;
    return kv_bits_to_float((uint32_t)(127 + e) << 23);
}

/* The code of x (already shifted) in a group of scale s and zero point z
 * (as floats). */
KV_HD uint32_t kv_lowbit_code(float x, float s, float z, uint32_t bits)
{
    float levels = (float)((1u << bits) - 1u);
    if (!(s > 0))
        return 0;
    float r = (x - z) / s;
    /* rne by the 1.5·2^23 trick (exact below 2^22), after the clamp, so
     * that NaN and any out-of-range quotient give a valid code */
    r = r >= 0 ? r : 0;
    r = r <= levels ? r : levels;
#ifdef __CUDA_ARCH__
    r = rintf(r);
#else
    r = (r + 12582912.0f) - 12582912.0f;
#endif
    return (uint32_t)r;
}

/* The value code stands for in a group of scale s and zero point z, in a
 * block shifted by e (p2 = kv_lowbit_pow2(e)). */
KV_HD float kv_lowbit_value(uint32_t code, float s, float z, float p2)
{
    float m = KV_LOWBIT_MUL((float)code, s);
    return KV_LOWBIT_MUL(m + z, p2);
}

/* Code of channel c in a packed row (bits per code, low bits first). */
KV_HD uint32_t kv_lowbit_get(const uint8_t *row, uint32_t c, uint32_t bits)
{
    uint32_t bit = c * bits;
    return (uint32_t)(row[bit >> 3] >> (bit & 7u)) & ((1u << bits) - 1u);
}

#endif
