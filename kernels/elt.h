/*
 * elt.h - element conversions shared by the fast CPU kernels and the CUDA
 * kernels (internal to kernels/; not part of the public interface).
 *
 * kv_elt_load / kv_elt_store (kernels/cpu/merge.c) are the definition of how
 * a pool element becomes a float and back. These inline versions compute the
 * same bits without branches, so that C loops vectorise and the same code
 * compiles for the GPU (KV_HD marks them __host__ __device__ under nvcc);
 * tests/unit/test_kernels_elt.c checks them against kv_elt_load/store on
 * every fp16 and bf16 value and on a dense sample of floats.
 *
 * Every function is pure and works on integers and plain float arithmetic in
 * round-to-nearest mode; nothing depends on the compiler contracting or
 * reassociating (the only float operations are one multiplication by a
 * power of two and one addition of 0.5, both exact or correctly rounded).
 */
#ifndef KVSTASH_KERNELS_ELT_H
#define KVSTASH_KERNELS_ELT_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#ifdef __CUDACC__
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#endif

KV_HD float kv_bits_to_float(uint32_t b)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

KV_HD uint32_t kv_float_to_bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
#endif
}

/* An all-ones mask when c, else 0: selects written as masks, which gcc
 * vectorises (a ?: in these loops reads to it as control flow). */
KV_HD uint32_t kv_mask(int c)
{
    return -(uint32_t)(c != 0);
}

KV_HD uint32_t kv_select(uint32_t m, uint32_t a, uint32_t b)
{
    return (a & m) | (b & ~m);
}

/* IEEE half -> float, exact. The exponent and mantissa shifted into float
 * position read as a float 2^112 too small for normal halves and as the
 * right multiple of 2^-136 for subnormal ones; one exact multiplication by
 * 2^112 fixes both. Infinity and NaN keep their payload as in kv_elt_load. */
KV_HD float kv_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    float mag = kv_bits_to_float(em << 13) * 5.192296858534828e+33f; /* 2^112 */
    uint32_t bits = kv_select(kv_mask(em >= 0x7c00u), 0x7f800000u | ((em & 0x3ffu) << 13),
                              kv_float_to_bits(mag));
    return kv_bits_to_float(sign | bits);
}

/* float -> IEEE half, round to nearest even, overflow to infinity, NaN to a
 * quiet NaN: the bits of kv_elt_store. A subnormal result is the integer
 * rne(|x|·2^24), read off the mantissa of |x| + 0.5 (whose unit in the last
 * place is 2^-24); the parity of that integer and of the sum's last bit agree
 * because 0.5 = 2^23 ulp is even, so the tie rule is the same. */
KV_HD uint16_t kv_float_to_half(float f)
{
    uint32_t x = kv_float_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    uint32_t normal = (abs + 0xfffu + ((abs >> 13) & 1u) - 0x38000000u) >> 13;
    uint32_t sub = kv_float_to_bits(kv_bits_to_float(abs) + 0.5f) - 0x3f000000u;
    uint32_t special = 0x7c00u | ((uint32_t)(abs > 0x7f800000u) << 9);
    uint32_t h = kv_select(kv_mask(abs < 0x38800000u), sub, normal);
    h = kv_select(kv_mask(abs >= 0x477ff000u), 0x7c00u, h);
    h = kv_select(kv_mask(abs >= 0x7f800000u), special, h);
    return (uint16_t)(sign | h);
}

KV_HD float kv_bf16_to_float(uint16_t h)
{
    return kv_bits_to_float((uint32_t)h << 16);
}

/* float -> bf16, round to nearest even; NaN stays a (quiet) NaN. */
KV_HD uint16_t kv_float_to_bf16(float f)
{
    uint32_t x = kv_float_to_bits(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    return (uint16_t)kv_select(kv_mask((x & 0x7fffffffu) > 0x7f800000u), nan, r);
}

#ifndef __CUDACC__

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>

/* fp16 -> fp32 of the first n - n % 8 elements with F16C; returns how many
 * it did. vcvtph2ps quietens signalling NaNs, which kv_elt_load does not:
 * when any lane came out NaN it returns 0, and the caller's scalar loop
 * redoes the row. */
static inline size_t kv_f16_load_f16c(const uint8_t *src, size_t n, float *dst)
{
    size_t i = 0;
    __m256 nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i)));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        _mm256_storeu_ps(dst + i, f);
    }
    return _mm256_testz_ps(nan, nan) ? i : 0;
}

/* fp32 -> fp16 (round to nearest even, as kv_elt_store) of the first
 * n - n % 8 elements; 0 when an input was NaN (vcvtps2ph keeps payload bits
 * that kv_elt_store drops): the caller's scalar loop then redoes the row. */
static inline size_t kv_f16_store_f16c(uint8_t *dst, size_t n, const float *src)
{
    size_t i = 0;
    __m256 nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
    return _mm256_testz_ps(nan, nan) ? i : 0;
}
#endif

/* Rows of n elements of type t <-> fp32, one loop per type so that each
 * vectorises (the unaligned 2-byte loads go through memcpy); fp16 uses F16C
 * in the AVX2 build (isa.h). */
static inline void kv_row_load(const uint8_t *restrict src, kv_dtype t, size_t n,
                               float *restrict dst)
{
    if (t == KV_FP32) {
        memcpy(dst, src, n * 4);
    } else if (t == KV_FP16) {
        size_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        i = kv_f16_load_f16c(src, n, dst);
#endif
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = kv_half_to_float(h);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = kv_bf16_to_float(h);
        }
    }
}

static inline void kv_row_store(uint8_t *restrict dst, kv_dtype t, size_t n,
                                const float *restrict src)
{
    if (t == KV_FP32) {
        memcpy(dst, src, n * 4);
    } else if (t == KV_FP16) {
        size_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        i = kv_f16_store_f16c(dst, n, src);
#endif
        for (; i < n; i++) {
            uint16_t h = kv_float_to_half(src[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = kv_float_to_bf16(src[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    }
}

#endif /* !__CUDACC__ */

#endif
