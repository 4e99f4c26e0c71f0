/*
 * merge_list.c - fast batched value merges (kernels.h "Value merges,
 * batched"). The reference (merge_list_ref.c) applies kv_merge_value
 * (merge.c) once per merge. This version converts each head's two rows once per chunk and mixes
 * them across channels with the same fp32 expression a*x + b*y (weights normalised exactly as
 * merge.c does), so the results are identical; the AVX2 build mixes fp16 rows in registers
 * (mix_f16). The rows of the merge MERGE_AHEAD later are prefetched first: a list's merges
 * touch rows scattered over the pool.
 */
#include <string.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "tokens.h"

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>

/* dst = a * src + b * dst for n fp16 elements (n % 8 == 0), in registers
 * (F16C), the same fp32 multiplications and addition as the portable path
 * (no FMA: ISO C does not contract, and these are separate instructions).
 * The results go through a stack row first: when any input or result is a
 * NaN (where F16C's conversions keep payload bits that kv_elt_load /
 * kv_elt_store do not), dst is left as it was and it returns 0, for the
 * portable path to redo the row. */
static int mix_f16(const uint8_t *src, uint8_t *dst, uint32_t n, float a, float b)
{
    uint16_t out[KV_CHUNK];
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    __m256 nan = _mm256_setzero_ps();
    for (uint32_t c = 0; c < n; c += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + 2 * c)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(dst + 2 * c)));
        __m256 r = _mm256_add_ps(_mm256_mul_ps(va, x), _mm256_mul_ps(vb, y));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, y, _CMP_UNORD_Q));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
        _mm_storeu_si128((__m128i *)(void *)(out + c),
                         _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
    if (!_mm256_testz_ps(nan, nan))
        return 0;
    memcpy(dst, out, 2 * (size_t)n);
    return 1;
}
#endif

#define MERGE_AHEAD 4u /* merges from a merge's prefetch to its arithmetic */

/* Prefetch the two V rows of every head of merge m, for writing. */
static void prefetch_merge(const kv_layout *l, const uint8_t *pool, const kv_merge *m, size_t half)
{
    size_t row = (size_t)l->head_dim * l->elt_size;
    for (uint32_t h = 0; h < l->kv_heads; h++) {
        const uint8_t *src = pool + kv_key_offset(l, m->from_block, h, m->from_slot) + half;
        const uint8_t *dst = pool + kv_key_offset(l, m->into_block, h, m->into_slot) + half;
        for (size_t b = 0; b < row; b += 64) {
            __builtin_prefetch(src + b, 0);
            __builtin_prefetch(dst + b, 1);
        }
    }
}

void KV_FAST(kv_merge_values)(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                              size_t n)
{
    size_t half = kv_block_bytes(l) / 2;
    float x[KV_CHUNK], y[KV_CHUNK];
    for (size_t i = 0; i < n; i++) {
        if (i + MERGE_AHEAD < n) /* the merges' rows are scattered: no hardware prefetch */
            prefetch_merge(l, pool, &m[i + MERGE_AHEAD], half);
        float sum = m[i].w_from + m[i].w_into;
        /* POLICIES.md §4.2: both weights zero (underflow) -> the plain average. */
        float a = sum > 0 ? m[i].w_from / sum : 0.5f, b = sum > 0 ? m[i].w_into / sum : 0.5f;
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            const uint8_t *src = pool + kv_key_offset(l, m[i].from_block, h, m[i].from_slot) + half;
            uint8_t *dst = pool + kv_key_offset(l, m[i].into_block, h, m[i].into_slot) + half;
            for (uint32_t c0 = 0; c0 < l->head_dim; c0 += KV_CHUNK) {
                uint32_t w = l->head_dim - c0 < KV_CHUNK ? l->head_dim - c0 : KV_CHUNK;
                size_t off = (size_t)c0 * l->elt_size;
#if defined(__F16C__) && defined(__AVX2__)
                if (t == KV_FP16 && w % 8 == 0 && mix_f16(src + off, dst + off, w, a, b))
                    continue;
#endif
                kv_row_load(src + off, t, w, x);
                kv_row_load(dst + off, t, w, y);
                for (uint32_t c = 0; c < w; c++)
                    y[c] = a * x[c] + b * y[c];
                kv_row_store(dst + off, t, w, y);
            }
        }
    }
}
