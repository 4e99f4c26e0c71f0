/*
 * sketch.c - fast CPU count-sketch kernels (kernels.h "Count sketch").
 *
 * The same IEEE operations as sketch_ref.c (the definition), in
 * an order that touches memory linearly: a token's K and V rows are
 * converted once per chunk of channels and applied to every row's cell, and
 * the per-row estimates are computed across channels before the median.
 * Every cell element still receives its additions in token order, and the
 * median is the result of the same insertion sort (written out as selects
 * for 1, 2 and 3 rows; three, the default, fused with the estimates), so
 * even the sign of a zero matches the reference.
 *
 * Insert splits over channels and query over tokens (parallel.h); revive
 * runs on the calling thread, because a token's estimate depends on every
 * earlier token's delete through the shared cells and counts.
 */
#include <assert.h>
#include <string.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#define QCHUNK 64u /* channels per query step: est[] holds rows x QCHUNK floats */

/* ---- insert ---- */

typedef struct insert_job {
    kv_sketch *sk;
    const kv_layout *l;
    kv_dtype t;
    const uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs;
    const uint32_t *h;
    const int8_t *g;
} insert_job;

/* Channels [lo, hi) of every token, in token order. */
static void insert_channels(void *ctx, size_t lo, size_t hi)
{
    const insert_job *j = ctx;
    const kv_sketch *sk = j->sk;
    const kv_layout *l = j->l;
    size_t half = kv_block_bytes(l) / 2;
    float kb[KV_CHUNK], vb[KV_CHUNK];
    kv_cursor cur;
    uint32_t blk, slot;
    kv_cursor_init(&cur, j->segs, j->nsegs, 0);
    for (size_t n = 0; kv_cursor_next(&cur, &blk, &slot); n++) {
        const uint32_t *hn = j->h + n * sk->rows;
        const int8_t *gn = j->g + n * sk->rows;
        for (size_t c0 = lo; c0 < hi;) {
            uint32_t head = (uint32_t)(c0 / l->head_dim), j0 = (uint32_t)(c0 % l->head_dim);
            uint32_t w = l->head_dim - j0;
            if (w > KV_CHUNK)
                w = KV_CHUNK;
            if (w > hi - c0)
                w = (uint32_t)(hi - c0);
            const uint8_t *row =
                j->pool + kv_key_offset(l, blk, head, slot) + (size_t)j0 * l->elt_size;
            kv_row_load(row, j->t, w, kb);
            kv_row_load(row + half, j->t, w, vb);
            for (uint32_t i = 0; i < sk->rows; i++) {
                size_t cell = (size_t)i * sk->buckets + hn[i];
                float *ck = sk->key + cell * sk->dim + c0;
                float *cv = sk->value + cell * sk->dim + c0;
                float gv = (float)gn[i]; /* sketch_ref.c: sign (+1) * g */
                for (uint32_t c = 0; c < w; c++) {
                    ck[c] += kb[c];
                    cv[c] += gv * vb[c];
                }
            }
            c0 += w;
        }
    }
}

void KV_FAST(kv_sketch_insert)(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                               const kv_segment *segs, size_t nsegs, const uint32_t *h,
                               const int8_t *g)
{
    assert(sk->dim == l->kv_heads * l->head_dim);
    insert_job j = {sk, l, t, pool, segs, nsegs, h, g};
    size_t n = kv_segments_tokens(segs, nsegs);
    size_t bytes = n * sk->dim * (2 * (size_t)l->elt_size + 16 * (size_t)sk->rows);
    kv_parallel_for(sk->dim, bytes, insert_channels, &j);
    for (size_t k = 0; k < n; k++)
        for (uint32_t i = 0; i < sk->rows; i++)
            sk->count[(size_t)i * sk->buckets + h[k * sk->rows + i]] += 1;
}

/* ---- query / revive ---- */

/* The lower median of rows estimates est[0..rows)[c], c < w, into out:
 * exactly the insertion sort of sketch_ref.c (three rows take
 * median3_estimates). */
static void median_rows(float est[][QCHUNK], uint32_t rows, uint32_t w, float *out)
{
    if (rows == 1) {
        memcpy(out, est[0], w * sizeof(float));
    } else if (rows == 2) {
        for (uint32_t c = 0; c < w; c++)
            out[c] = est[0][c] > est[1][c] ? est[1][c] : est[0][c];
    } else {
        for (uint32_t c = 0; c < w; c++) {
            float v[KV_SKETCH_MAX_ROWS] = {0};
            for (uint32_t i = 0; i < rows; i++)
                v[i] = est[i][c];
            for (uint32_t i = 1; i < rows; i++) {
                float x = v[i];
                uint32_t k = i;
                for (; k > 0 && v[k - 1] > x; k--)
                    v[k] = v[k - 1];
                v[k] = x;
            }
            out[c] = v[(rows - 1) / 2];
        }
    }
}

/* Row estimates of channels [c0, c0 + w) of one half (g NULL: keys). */
static void row_estimates(const kv_sketch *sk, const float *cells, const uint32_t *h,
                          const int8_t *g, kv_estimate est_mode, size_t c0, uint32_t w,
                          float est[][QCHUNK])
{
    for (uint32_t i = 0; i < sk->rows; i++) {
        size_t cell = (size_t)i * sk->buckets + h[i];
        const float *x = cells + cell * sk->dim + c0;
        int32_t cnt = sk->count[cell];
        int divide = est_mode == KV_ESTIMATE_MEAN && cnt > 0;
        float d = (float)cnt;
        if (g != NULL) {
            float gi = (float)g[i];
            if (divide)
                for (uint32_t c = 0; c < w; c++)
                    est[i][c] = (x[c] * gi) / d;
            else
                for (uint32_t c = 0; c < w; c++)
                    est[i][c] = x[c] * gi;
        } else if (divide) {
            for (uint32_t c = 0; c < w; c++)
                est[i][c] = x[c] / d;
        } else {
            memcpy(est[i], x, w * sizeof(float));
        }
    }
}

/* Three rows, the default: each channel's three estimates and their median
 * in one pass, without est[] (the same operations as row_estimates and
 * median_rows: a key's estimate is x or x / count, a value's x·g or
 * (x·g) / count; multiplying by g = ±1 and dividing by 1 are exact, so a
 * row that does not divide is computed as one that divides by 1). */
static void median3_estimates(const kv_sketch *sk, const float *cells, const uint32_t *h,
                              const int8_t *g, kv_estimate est_mode, size_t c0, uint32_t w,
                              float *out)
{
    const float *x[3];
    float gi[3], d[3];
    int divides = 0;
    for (uint32_t i = 0; i < 3; i++) {
        size_t cell = (size_t)i * sk->buckets + h[i];
        int32_t cnt = sk->count[cell];
        int divide = est_mode == KV_ESTIMATE_MEAN && cnt > 0;
        x[i] = cells + cell * sk->dim + c0;
        gi[i] = g != NULL ? (float)g[i] : 1.0f;
        d[i] = divide ? (float)cnt : 1.0f;
        divides |= divide;
    }
    const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2];
    if (!divides) {
        for (uint32_t c = 0; c < w; c++) {
            float a = x0[c] * gi[0], b = x1[c] * gi[1], e = x2[c] * gi[2];
            float lo = a > b ? b : a, hi = a > b ? a : b;
            out[c] = hi > e ? (lo > e ? lo : e) : hi;
        }
        return;
    }
    for (uint32_t c = 0; c < w; c++) {
        float a = (x0[c] * gi[0]) / d[0], b = (x1[c] * gi[1]) / d[1], e = (x2[c] * gi[2]) / d[2];
        float lo = a > b ? b : a, hi = a > b ? a : b;
        out[c] = hi > e ? (lo > e ? lo : e) : hi;
    }
}

/* The median of the rows' estimates of channels [c0, c0 + w) of one half
 * (g NULL: keys) into out. */
static void estimate_median(const kv_sketch *sk, const float *cells, const uint32_t *h,
                            const int8_t *g, kv_estimate est_mode, size_t c0, uint32_t w,
                            float est[][QCHUNK], float *out)
{
    if (sk->rows == 3) {
        median3_estimates(sk, cells, h, g, est_mode, c0, w, out);
        return;
    }
    row_estimates(sk, cells, h, g, est_mode, c0, w, est);
    median_rows(est, sk->rows, w, out);
}

/* One token: estimates of every channel, stored in (blk, slot) unless pool
 * is NULL, and with del subtracted from the cells, then counts - 1. */
static void query_token(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                        kv_dtype t, uint8_t *pool, uint32_t blk, uint32_t slot, int del)
{
    float est[KV_SKETCH_MAX_ROWS][QCHUNK], ke[QCHUNK], ve[QCHUNK];
    size_t half = pool != NULL ? kv_block_bytes(l) / 2 : 0;
    for (size_t c0 = 0; c0 < sk->dim;) {
        uint32_t w = QCHUNK, head = 0, j0 = 0;
        if (pool != NULL) { /* stay inside one head's row */
            head = (uint32_t)(c0 / l->head_dim);
            j0 = (uint32_t)(c0 % l->head_dim);
            if (w > l->head_dim - j0)
                w = l->head_dim - j0;
        }
        if (w > sk->dim - c0)
            w = (uint32_t)(sk->dim - c0);
        estimate_median(sk, sk->key, h, NULL, sk->key_estimate, c0, w, est, ke);
        estimate_median(sk, sk->value, h, g, sk->value_estimate, c0, w, est, ve);
        if (pool != NULL) {
            uint8_t *row = pool + kv_key_offset(l, blk, head, slot) + (size_t)j0 * l->elt_size;
            kv_row_store(row, t, w, ke);
            kv_row_store(row + half, t, w, ve);
        }
        if (del) {
            for (uint32_t i = 0; i < sk->rows; i++) {
                size_t cell = (size_t)i * sk->buckets + h[i];
                float *ck = sk->key + cell * sk->dim + c0;
                float *cv = sk->value + cell * sk->dim + c0;
                float gv = -1.0f * (float)g[i]; /* sketch_ref.c: sign (-1) * g */
                for (uint32_t c = 0; c < w; c++) {
                    ck[c] += -1.0f * ke[c];
                    cv[c] += gv * ve[c];
                }
            }
        }
        c0 += w;
    }
    if (del)
        for (uint32_t i = 0; i < sk->rows; i++)
            sk->count[(size_t)i * sk->buckets + h[i]] -= 1;
}

typedef struct query_job {
    const kv_sketch *sk;
    const uint32_t *h;
    const int8_t *g;
    const kv_layout *l;
    kv_dtype t;
    uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs;
} query_job;

static void query_tokens(void *ctx, size_t lo, size_t hi)
{
    const query_job *j = ctx;
    kv_sketch copy = *j->sk; /* del = 0: nothing is written through it */
    kv_cursor cur;
    uint32_t blk, slot;
    kv_cursor_init(&cur, j->segs, j->nsegs, lo);
    for (size_t n = lo; n < hi && kv_cursor_next(&cur, &blk, &slot); n++)
        query_token(&copy, j->h + n * copy.rows, j->g + n * copy.rows, j->l, j->t, j->pool, blk,
                    slot, 0);
}

void KV_FAST(kv_sketch_query)(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                              const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                              size_t nsegs)
{
    assert(sk->rows >= 1 && sk->rows <= KV_SKETCH_MAX_ROWS);
    assert(sk->dim == l->kv_heads * l->head_dim);
    query_job j = {sk, h, g, l, t, pool, segs, nsegs};
    size_t n = kv_segments_tokens(segs, nsegs);
    size_t bytes = n * sk->dim * (2 * (size_t)l->elt_size + 8 * (size_t)sk->rows);
    kv_parallel_for(n, bytes, query_tokens, &j);
}

void KV_FAST(kv_sketch_revive)(kv_sketch *sk, const uint32_t *h, const int8_t *g,
                               const kv_layout *l, kv_dtype t, uint8_t *pool,
                               const kv_segment *segs, size_t nsegs)
{
    assert(sk->rows >= 1 && sk->rows <= KV_SKETCH_MAX_ROWS);
    assert(sk->dim == l->kv_heads * l->head_dim);
    kv_cursor cur;
    uint32_t blk, slot;
    kv_cursor_init(&cur, segs, nsegs, 0);
    for (size_t n = 0; kv_cursor_next(&cur, &blk, &slot); n++)
        query_token(sk, h + n * sk->rows, g + n * sk->rows, l, t, pool, blk, slot, 1);
}

void KV_FAST(kv_sketch_delete)(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    assert(sk->rows >= 1 && sk->rows <= KV_SKETCH_MAX_ROWS);
    for (size_t k = 0; k < n; k++)
        query_token(sk, h + k * sk->rows, g + k * sk->rows, NULL, KV_FP32, NULL, 0, 0, 1);
}
