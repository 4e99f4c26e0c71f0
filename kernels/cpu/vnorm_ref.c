/*
 * vnorm_ref.c - reference projected value L1 norm (POLICIES.md §1.2), the
 * definition: sums in double, in the loop order below, with each value read
 * from the pool through kv_elt_load. The fast and CUDA versions equal it;
 * the §1.8 paper vectors (tests/unit/test_policy_criticalkv.c) run on it.
 * Slow on purpose.
 */
#include <assert.h>
#include <math.h>

#include "kernels.h"

void kv_vnorm_l1_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                     size_t nsegs, const float *wo, size_t wo_stride, uint32_t q_heads,
                     uint32_t hidden, float *out)
{
    assert(l->kv_heads > 0 && q_heads % l->kv_heads == 0);
    uint32_t G = q_heads / l->kv_heads, d = l->head_dim;
    size_t tokens = kv_segments_tokens(segs, nsegs), half = kv_block_bytes(l) / 2;
    for (uint32_t g = 0; g < l->kv_heads; g++) {
        size_t i = 0;
        for (size_t s = 0; s < nsegs; s++)
            for (uint32_t k = 0; k < segs[s].count; k++, i++) {
                const uint8_t *vi =
                    pool + kv_key_offset(l, segs[s].block, g, segs[s].first_slot + k) + half;
                double acc = 0;
                for (uint32_t h = g * G; h < g * G + G; h++) {
                    double sum = 0;
                    for (uint32_t c = 0; c < hidden; c++) {
                        const float *w = wo + (size_t)c * wo_stride + (size_t)h * d;
                        double dot = 0;
                        for (uint32_t j = 0; j < d; j++)
                            dot +=
                                (double)kv_elt_load(vi + (size_t)j * l->elt_size, t) * (double)w[j];
                        sum += fabs(dot);
                    }
                    acc += sum;
                }
                out[(size_t)g * tokens + i] = (float)(acc / G); /* mean over the group */
            }
    }
}
