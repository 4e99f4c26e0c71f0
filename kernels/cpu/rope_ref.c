/*
 * rope_ref.c - reference RoPE re-rotation (POLICIES.md §2.8, kernels.h):
 * one pair of one key at a time, angle and coefficients recomputed for every
 * element. Slow on purpose; only the tests and tests/gpu call it.
 */
#include <assert.h>
#include <math.h>

#include "kernels.h"

void kv_rope_rerotate_ref(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                          size_t nsegs, const int32_t *delta, double theta, kv_rope_pairing pairing)
{
    uint32_t d = l->head_dim, half = d / 2;
    assert(d % 2 == 0);
    size_t n = 0;
    for (size_t s = 0; s < nsegs; s++)
        for (uint32_t k = 0; k < segs[s].count; k++, n++)
            for (uint32_t h = 0; h < l->kv_heads; h++) {
                uint8_t *row = pool + kv_key_offset(l, segs[s].block, h, segs[s].first_slot + k);
                for (uint32_t j = 0; j < half; j++) {
                    double inv_freq = pow(theta, -(double)(2 * j) / (double)d);
                    double angle = (double)delta[n] * inv_freq;
                    float c = (float)cos(angle), sn = (float)sin(angle);
                    uint32_t a = pairing == KV_ROPE_HALF ? j : 2 * j;
                    uint32_t b = pairing == KV_ROPE_HALF ? j + half : 2 * j + 1;
                    float x = kv_elt_load(row + (size_t)a * l->elt_size, t);
                    float y = kv_elt_load(row + (size_t)b * l->elt_size, t);
                    kv_elt_store(row + (size_t)a * l->elt_size, t, x * c - y * sn);
                    kv_elt_store(row + (size_t)b * l->elt_size, t, x * sn + y * c);
                }
            }
}
