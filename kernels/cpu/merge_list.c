/*
 * merge_list.c - fast batched value merges (kernels.h "Value merges,
 * batched"). The reference (merge_list_ref.c) applies kv_merge_value
 * (merge.c) once per merge. This version converts each head's two rows once per chunk and mixes
 * them across channels with the same fp32 expression a*x + b*y (weights normalised exactly as
 * merge.c does), so the results are identical. The rows of the merge MERGE_AHEAD later are
 * prefetched first: a list's merges touch rows scattered over the pool.
 */
#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "tokens.h"

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
                kv_row_load(src + off, t, w, x);
                kv_row_load(dst + off, t, w, y);
                for (uint32_t c = 0; c < w; c++)
                    y[c] = a * x[c] + b * y[c];
                kv_row_store(dst + off, t, w, y);
            }
        }
    }
}
