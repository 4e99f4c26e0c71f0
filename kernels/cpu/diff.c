/* Comparing two element arrays (kernels.h kv_elts_diff): the daemon's
 * measure of what a tier move cost, cheap next to the move itself. */
#include <math.h>

#include "elt.h"
#include "isa.h"
#include "kernels.h"

enum { DIFF_CHUNK = 512, DIFF_LANES = 8 };

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
        float max_diff[DIFF_LANES] = {0}, max_ref[DIFF_LANES] = {0}, sq_diff[DIFF_LANES] = {0},
              sq_ref[DIFF_LANES] = {0};
        for (size_t i = 0; i < m; i += DIFF_LANES)
            for (size_t l = 0; l < DIFF_LANES; l++) {
                float e = fabsf(y[i + l] - x[i + l]), a = fabsf(x[i + l]);
                max_diff[l] = e > max_diff[l] ? e : max_diff[l];
                max_ref[l] = a > max_ref[l] ? a : max_ref[l];
                sq_diff[l] += e * e;
                sq_ref[l] += a * a;
            }
        for (size_t l = 0; l < DIFF_LANES; l++) {
            d->max_diff = max_diff[l] > d->max_diff ? max_diff[l] : d->max_diff;
            d->max_ref = max_ref[l] > d->max_ref ? max_ref[l] : d->max_ref;
            d->sq_diff += sq_diff[l];
            d->sq_ref += sq_ref[l];
        }
    }
}
