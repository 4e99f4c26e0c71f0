/* Comparing two element arrays (kernels.h kv_elts_diff): the daemon's
 * measure of what a tier move cost, cheap next to the move itself. */
#include <math.h>

#include "elt.h"
#include "isa.h"
#include "kernels.h"

enum { DIFF_CHUNK = 512, DIFF_LANES = 8 };

#ifdef __AVX2__
#include <immintrin.h>

/* The lane loop below in AVX2 registers (gcc leaves it scalar: it was most
 * of a demoting step's time). The same operations per lane in the same
 * order, so both builds give the same sums: maxps is the loop's `a > b ?
 * a : b`, and no multiply-add is fused. */
static void diff_lanes(const float *x, const float *y, size_t m, float *max_diff, float *max_ref,
                       float *sq_diff, float *sq_ref)
{
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 md = _mm256_setzero_ps(), mr = md, sd = md, sr = md;
    for (size_t i = 0; i < m; i += DIFF_LANES) {
        __m256 a = _mm256_loadu_ps(x + i);
        __m256 e = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(y + i), a), abs);
        a = _mm256_and_ps(a, abs);
        md = _mm256_max_ps(e, md);
        mr = _mm256_max_ps(a, mr);
        sd = _mm256_add_ps(sd, _mm256_mul_ps(e, e));
        sr = _mm256_add_ps(sr, _mm256_mul_ps(a, a));
    }
    _mm256_storeu_ps(max_diff, md);
    _mm256_storeu_ps(max_ref, mr);
    _mm256_storeu_ps(sq_diff, sd);
    _mm256_storeu_ps(sq_ref, sr);
}
#else
static void diff_lanes(const float *x, const float *y, size_t m, float *max_diff, float *max_ref,
                       float *sq_diff, float *sq_ref)
{
    for (size_t l = 0; l < DIFF_LANES; l++)
        max_diff[l] = max_ref[l] = sq_diff[l] = sq_ref[l] = 0;
    for (size_t i = 0; i < m; i += DIFF_LANES)
        for (size_t l = 0; l < DIFF_LANES; l++) {
            float e = fabsf(y[i + l] - x[i + l]), a = fabsf(x[i + l]);
            max_diff[l] = e > max_diff[l] ? e : max_diff[l];
            max_ref[l] = a > max_ref[l] ? a : max_ref[l];
            sq_diff[l] += e * e;
            sq_ref[l] += a * a;
        }
}
#endif

void KV_FAST(kv_elts_diff)(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d)
{
    size_t elt = t == KV_FP32 ? 4 : 2;
    float x[DIFF_CHUNK], y[DIFF_CHUNK];
    for (size_t at = 0; at < n; at += DIFF_CHUNK) {
        size_t m = n - at < DIFF_CHUNK ? n - at : DIFF_CHUNK;
        kv_row_load(ref + at * elt, t, m, x);
        kv_row_load(got + at * elt, t, m, y);
        for (size_t i = m; i % DIFF_LANES != 0; i++) /* pad the last lanes with zeros */
            x[i] = y[i] = 0;
        /* Lane-wise partial results, so that the loop vectorises. */
        float max_diff[DIFF_LANES], max_ref[DIFF_LANES], sq_diff[DIFF_LANES], sq_ref[DIFF_LANES];
        diff_lanes(x, y, m, max_diff, max_ref, sq_diff, sq_ref);
        for (size_t l = 0; l < DIFF_LANES; l++) {
            d->max_diff = max_diff[l] > d->max_diff ? max_diff[l] : d->max_diff;
            d->max_ref = max_ref[l] > d->max_ref ? max_ref[l] : d->max_ref;
            d->sq_diff += sq_diff[l];
            d->sq_ref += sq_ref[l];
        }
    }
}
