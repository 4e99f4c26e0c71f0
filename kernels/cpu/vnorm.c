/*
 * vnorm.c - fast CPU projected value L1 norm (kernels.h "Projected value
 * norm").
 *
 * The reference computes, per token, Hq·D dot products of length d, each a
 * sequential double sum over j, then sums their magnitudes over c in order.
 * Here TILE tokens are done together: their values are transposed into
 * vt[j][t] (double), and for each output feature c the W^O row slice (d
 * contiguous floats) is read once and applied to all TILE tokens, so the
 * inner loop runs across tokens (vectorised) while every token's dot is
 * still the same sequence of double operations over j, and its L1 sum the
 * same sequence over c. The result equals the reference exactly; W^O is read
 * once per tile instead of once per token. Splits over tiles (parallel.h).
 * head_dim above KV_CHUNK takes the reference's path.
 */
#include <assert.h>
#include <math.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#define TILE 16u

typedef struct vnorm_job {
    const kv_layout *l;
    kv_dtype t;
    const uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs, ntok;
    const float *wo;
    size_t wo_stride;
    uint32_t q_heads, hidden;
    float *out;
} vnorm_job;

/* Tokens [first, first + nt) of the list, kv head g. */
static void vnorm_tile(const vnorm_job *j, uint32_t g, size_t first, uint32_t nt)
{
    const kv_layout *l = j->l;
    uint32_t d = l->head_dim, G = j->q_heads / l->kv_heads;
    size_t half = kv_block_bytes(l) / 2;
    double vt[KV_CHUNK][TILE], dot[TILE], sum[TILE], acc[TILE];
    float row[KV_CHUNK];
    kv_cursor cur;
    uint32_t blk, slot;

    kv_cursor_init(&cur, j->segs, j->nsegs, first);
    for (uint32_t t = 0; t < TILE; t++) {
        if (t < nt && kv_cursor_next(&cur, &blk, &slot))
            kv_row_load(j->pool + kv_key_offset(l, blk, g, slot) + half, j->t, d, row);
        else
            for (uint32_t k = 0; k < d; k++)
                row[k] = 0; /* padding lanes: computed, never stored */
        for (uint32_t k = 0; k < d; k++)
            vt[k][t] = (double)row[k];
        acc[t] = 0;
    }
    for (uint32_t h = g * G; h < g * G + G; h++) {
        for (uint32_t t = 0; t < TILE; t++)
            sum[t] = 0;
        for (uint32_t c = 0; c < j->hidden; c++) {
            const float *w = j->wo + (size_t)c * j->wo_stride + (size_t)h * d;
            for (uint32_t t = 0; t < TILE; t++)
                dot[t] = 0;
            for (uint32_t k = 0; k < d; k++) {
                double wk = (double)w[k];
                for (uint32_t t = 0; t < TILE; t++)
                    dot[t] += vt[k][t] * wk;
            }
            for (uint32_t t = 0; t < TILE; t++)
                sum[t] += fabs(dot[t]);
        }
        for (uint32_t t = 0; t < TILE; t++)
            acc[t] += sum[t];
    }
    for (uint32_t t = 0; t < nt; t++)
        j->out[(size_t)g * j->ntok + first + t] = (float)(acc[t] / G);
}

/* Items are (kv head, tile) pairs, head-major. */
static void vnorm_items(void *ctx, size_t lo, size_t hi)
{
    const vnorm_job *j = ctx;
    size_t tiles = (j->ntok + TILE - 1) / TILE;
    for (size_t it = lo; it < hi; it++) {
        uint32_t g = (uint32_t)(it / tiles);
        size_t first = it % tiles * TILE;
        uint32_t nt = j->ntok - first < TILE ? (uint32_t)(j->ntok - first) : TILE;
        vnorm_tile(j, g, first, nt);
    }
}

void KV_FAST(kv_vnorm_l1)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, const float *wo, size_t wo_stride,
                          uint32_t q_heads, uint32_t hidden, float *out)
{
    assert(l->kv_heads > 0 && q_heads % l->kv_heads == 0);
    if (l->head_dim > KV_CHUNK) {
        kv_vnorm_l1_ref(l, t, pool, segs, nsegs, wo, wo_stride, q_heads, hidden, out);
        return;
    }
    vnorm_job j = {l,  t,         pool,    segs,   nsegs, kv_segments_tokens(segs, nsegs),
                   wo, wo_stride, q_heads, hidden, out};
    size_t tiles = (j.ntok + TILE - 1) / TILE, items = tiles * l->kv_heads;
    /* W^O is read once per tile: that is the traffic that matters. */
    size_t bytes = items * (size_t)(q_heads / l->kv_heads) * hidden * l->head_dim * 4;
    kv_parallel_for(items, bytes, vnorm_items, &j);
}
