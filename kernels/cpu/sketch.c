/*
 * sketch.c - fast CPU count-sketch kernels (kernels.h "Count sketch").
 *
 * The same IEEE operations as sketch_ref.c (the definition), in
 * an order that touches memory linearly: a token's K and V rows are
 * converted once per chunk of channels and applied to every row's cell, and
 * the per-row estimates are computed across channels before the median.
 * Every cell element still receives its additions in token order, and the
 * median is the result of the same insertion sort (written out as selects
 * for 1, 2 and 3 rows; three, the default, fused with the estimates, as
 * vector min/max in the AVX2 build), so even the sign of a zero matches the
 * reference. A query of three rows into fp16 slots, a Revive's, converts
 * the medians in registers and stores them straight into the slots.
 *
 * Insert splits keys from values and query over tokens (parallel.h); revive
 * runs on the calling thread, because a token's estimate depends on every
 * earlier token's delete through the shared cells and counts.
 */
#include <assert.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#define QCHUNK 128u /* channels per query step: est[] holds rows x QCHUNK floats */

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

/* Halves [lo, hi) (0: keys, 1: values) of every token, in token order: a
 * token's row of each head is converted once and added to its cell in
 * every row of the sketch. */
static void insert_halves(void *ctx, size_t lo, size_t hi)
{
    const insert_job *j = ctx;
    const kv_sketch *sk = j->sk;
    const kv_layout *l = j->l;
    size_t half_bytes = kv_block_bytes(l) / 2;
    float x[KV_CHUNK];
    for (size_t half = lo; half < hi; half++) {
        float *cells = half == 0 ? sk->key : sk->value;
        kv_cursor cur;
        uint32_t blk, slot;
        kv_cursor_init(&cur, j->segs, j->nsegs, 0);
        for (size_t n = 0; kv_cursor_next(&cur, &blk, &slot); n++) {
            const uint32_t *hn = j->h + n * sk->rows;
            const int8_t *gn = j->g + n * sk->rows;
            for (uint32_t head = 0; head < l->kv_heads; head++) {
                const uint8_t *row =
                    j->pool + kv_key_offset(l, blk, head, slot) + half * half_bytes;
                for (uint32_t j0 = 0; j0 < l->head_dim; j0 += KV_CHUNK) {
                    uint32_t w = l->head_dim - j0 < KV_CHUNK ? l->head_dim - j0 : KV_CHUNK;
                    size_t c0 = (size_t)head * l->head_dim + j0;
                    kv_row_load(row + (size_t)j0 * l->elt_size, j->t, w, x);
                    for (uint32_t i = 0; i < sk->rows; i++) {
                        size_t cell = (size_t)i * sk->buckets + hn[i];
                        float *restrict cx = cells + cell * sk->dim + c0;
                        if (half == 0) {
                            for (uint32_t c = 0; c < w; c++)
                                cx[c] += x[c];
                        } else {
                            float gv = (float)gn[i]; /* sketch_ref.c: sign (+1) * g */
                            for (uint32_t c = 0; c < w; c++)
                                cx[c] += gv * x[c];
                        }
                    }
                }
            }
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
    /* Keys and values on their own threads: their cells are separate
     * arrays. Split by channels instead, two threads write the same pages
     * of every cell, and on a 2-vCPU Xeon an insert of 4,096 tokens took
     * 4.5 ms on two threads against 4.0 on one (2.4-3.4 ms now). */
    kv_parallel_for(2, bytes, insert_halves, &j);
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

/* Where one half's three estimates of a token's channels come from (three
 * rows, the default): a key's estimate is x or x / count, a value's x·g or
 * (x·g) / count (the same operations as row_estimates and median_rows). A
 * key is never multiplied, even by 1, nor a row divided that does not
 * divide: that would quieten a signalling NaN the reference returns as it
 * is. */
typedef struct median3_cells {
    const float *x[3]; /* each row's cell, from channel 0 */
    float gi[3], d[3];
    int divide[3]; /* row i divides by its count d[i] */
    int signs;     /* values: multiplied by g */
    int divides;   /* some row divides */
} median3_cells;

static median3_cells median3_cells_of(const kv_sketch *sk, const float *cells, const uint32_t *h,
                                      const int8_t *g, kv_estimate est_mode)
{
    median3_cells m = {.signs = g != NULL, .divides = 0};
    for (uint32_t i = 0; i < 3; i++) {
        size_t cell = (size_t)i * sk->buckets + h[i];
        int32_t cnt = sk->count[cell];
        int divide = est_mode == KV_ESTIMATE_MEAN && cnt > 0;
        m.x[i] = cells + cell * sk->dim;
        m.gi[i] = g != NULL ? (float)g[i] : 1.0f;
        m.d[i] = (float)cnt;
        m.divide[i] = divide;
        m.divides |= divide;
    }
    return m;
}

#ifdef __AVX2__
/* The medians of 8 channels from c, without divides: each select is the one
 * min/max instruction with its exact semantics (minps(x, y) is x < y ? x : y,
 * NaN and signed zeros included), so the bits are those of the scalar loop
 * in median3_estimates. */
static inline __m256 median3_avx2(const median3_cells *m, size_t c)
{
    __m256 a = _mm256_loadu_ps(m->x[0] + c), b = _mm256_loadu_ps(m->x[1] + c),
           e = _mm256_loadu_ps(m->x[2] + c);
    if (m->signs) {
        a = _mm256_mul_ps(a, _mm256_set1_ps(m->gi[0]));
        b = _mm256_mul_ps(b, _mm256_set1_ps(m->gi[1]));
        e = _mm256_mul_ps(e, _mm256_set1_ps(m->gi[2]));
    }
    __m256 lo = _mm256_min_ps(b, a);                 /* a > b ? b : a */
    __m256 hi = _mm256_max_ps(a, b);                 /* a > b ? a : b */
    __m256 mid = _mm256_max_ps(lo, e);               /* lo > e ? lo : e */
    __m256 above = _mm256_cmp_ps(hi, e, _CMP_GT_OQ); /* hi > e */
    return _mm256_blendv_ps(hi, mid, above);
}

/* Channels [c0, c0 + w) of one half's medians straight into an fp16 row,
 * as kv_row_store would write them (w a multiple of 8, no divides): a
 * Revive's query then never stores its floats. Returns 0, having written
 * what it wrote, when a median was NaN (vcvtps2ph keeps payload bits that
 * kv_elt_store drops) or the case is not one it does: the caller then
 * stores the chunk the general way. */
static int median3_store_f16(const median3_cells *m, size_t c0, uint32_t w, uint8_t *row)
{
    if (m->divides || w % 8 != 0)
        return 0;
    __m256 nan = _mm256_setzero_ps();
    for (uint32_t c = 0; c < w; c += 8) {
        __m256 y = median3_avx2(m, c0 + c);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
        _mm_storeu_si128((__m128i *)(row + 2 * (size_t)c),
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
    }
    return _mm256_testz_ps(nan, nan);
}

/* The same sixteen channels at a time (w a multiple of 16), where the CPU
 * has AVX-512 (kv_isa_avx512): half the instructions of the loop above, a
 * query 15% faster (bench_kernels' sketch_query on a Xeon with AVX-512). */
__attribute__((target("avx512f"))) static int
median3_store_f16_avx512(const median3_cells *m, size_t c0, uint32_t w, uint8_t *row)
{
    if (m->divides || w % 16 != 0)
        return 0;
    const float *x0 = m->x[0] + c0, *x1 = m->x[1] + c0, *x2 = m->x[2] + c0;
    __m512 g0 = _mm512_set1_ps(m->gi[0]), g1 = _mm512_set1_ps(m->gi[1]),
           g2 = _mm512_set1_ps(m->gi[2]);
    __mmask16 nan = 0;
    for (uint32_t c = 0; c < w; c += 16) {
        __m512 a = _mm512_loadu_ps(x0 + c), b = _mm512_loadu_ps(x1 + c),
               e = _mm512_loadu_ps(x2 + c);
        if (m->signs) {
            a = _mm512_mul_ps(a, g0);
            b = _mm512_mul_ps(b, g1);
            e = _mm512_mul_ps(e, g2);
        }
        __m512 lo = _mm512_min_ps(b, a), hi = _mm512_max_ps(a, b), mid = _mm512_max_ps(lo, e);
        __m512 y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(hi, e, _CMP_GT_OQ), hi, mid);
        nan |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        _mm256_storeu_si256((__m256i *)(row + 2 * (size_t)c),
                            _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
    }
    return nan == 0;
}
#endif

/* Medians of channels [c0, c0 + w) into out. */
static void median3_estimates(const median3_cells *m, size_t c0, uint32_t w, float *out)
{
    const float *restrict x0 = m->x[0] + c0, *restrict x1 = m->x[1] + c0,
                          *restrict x2 = m->x[2] + c0;
    const float *gi = m->gi, *d = m->d;
    if (!m->divides) {
        uint32_t c = 0;
#ifdef __AVX2__
        for (; c + 8 <= w; c += 8)
            _mm256_storeu_ps(out + c, median3_avx2(m, c0 + c));
#endif
        for (; c < w; c++) {
            float a = x0[c], b = x1[c], e = x2[c];
            if (m->signs)
                a *= gi[0], b *= gi[1], e *= gi[2];
            float lo = a > b ? b : a, hi = a > b ? a : b;
            out[c] = hi > e ? (lo > e ? lo : e) : hi;
        }
        return;
    }
    const int *dv = m->divide;
    for (uint32_t c = 0; c < w; c++) {
        float a = x0[c], b = x1[c], e = x2[c];
        if (m->signs)
            a *= gi[0], b *= gi[1], e *= gi[2];
        a = dv[0] ? a / d[0] : a;
        b = dv[1] ? b / d[1] : b;
        e = dv[2] ? e / d[2] : e;
        float lo = a > b ? b : a, hi = a > b ? a : b;
        out[c] = hi > e ? (lo > e ? lo : e) : hi;
    }
}

/* Where a query stores its tokens: (blk, slot) of pool, laid out as l, in
 * dtype t; half is kv_block_bytes(l) / 2 (from a K row to its V row). */
typedef struct query_dest {
    const kv_layout *l;
    kv_dtype t;
    uint8_t *pool; /* NULL: the estimates are not stored (a delete) */
    size_t half;
    int avx512; /* kv_isa_avx512(), asked once a call */
    uint32_t blk, slot;
} query_dest;

static query_dest query_dest_of(const kv_layout *l, kv_dtype t, uint8_t *pool)
{
    return (query_dest){l, t, pool, pool != NULL ? kv_block_bytes(l) / 2 : 0, kv_isa_avx512(),
                        0, 0};
}

/* Channels [c0, c0 + w) of the token, within one row of the destination
 * (`row`, NULL for none): stored there, with the fp16 fast paths where
 * they apply (three rows, no divides, `need` 0), else through ke and ve,
 * which then hold the estimates. */
static void query_chunk(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                        const median3_cells *m, const query_dest *o, uint8_t *row, size_t c0,
                        uint32_t w, int need, float *ke, float *ve)
{
#ifndef __AVX2__
    (void)need;
#else
    if (m != NULL && row != NULL && !need && o->t == KV_FP16) {
        if (o->avx512 && w % 16 == 0 && median3_store_f16_avx512(&m[0], c0, w, row) &&
            median3_store_f16_avx512(&m[1], c0, w, row + o->half))
            return;
        if (median3_store_f16(&m[0], c0, w, row) && median3_store_f16(&m[1], c0, w, row + o->half))
            return;
    }
#endif
    if (m != NULL) {
        median3_estimates(&m[0], c0, w, ke);
        median3_estimates(&m[1], c0, w, ve);
    } else {
        float est[KV_SKETCH_MAX_ROWS][QCHUNK];
        row_estimates(sk, sk->key, h, NULL, sk->key_estimate, c0, w, est);
        median_rows(est, sk->rows, w, ke);
        row_estimates(sk, sk->value, h, g, sk->value_estimate, c0, w, est);
        median_rows(est, sk->rows, w, ve);
    }
    if (row != NULL) {
        kv_row_store(row, o->t, w, ke);
        kv_row_store(row + o->half, o->t, w, ve);
    }
}

/* Subtract a token's estimates of channels [c0, c0 + w) from its cells. */
static void delete_chunk(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t c0, uint32_t w,
                         const float *ke, const float *ve)
{
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

/* One token: estimates of every channel, stored in its slot unless o->pool
 * is NULL, and with del subtracted from the cells, then counts - 1. The
 * channels go a head row at a time (the whole sketch row when nothing is
 * stored), in chunks of at most QCHUNK. */
static void query_token(kv_sketch *sk, const uint32_t *h, const int8_t *g, const query_dest *o,
                        int del)
{
    float ke[QCHUNK], ve[QCHUNK];
    median3_cells m[2];
    if (sk->rows == 3) { /* the cells and counts a token reads do not change until its end */
        m[0] = median3_cells_of(sk, sk->key, h, NULL, sk->key_estimate);
        m[1] = median3_cells_of(sk, sk->value, h, g, sk->value_estimate);
    }
    uint32_t row_len = o->pool != NULL ? o->l->head_dim : sk->dim, head = 0;
    for (size_t r = 0; r < sk->dim; r += row_len, head++) {
        uint8_t *row = NULL;
        if (o->pool != NULL)
            row = o->pool + kv_key_offset(o->l, o->blk, head, o->slot);
        for (uint32_t j0 = 0; j0 < row_len; j0 += QCHUNK) {
            uint32_t w = row_len - j0 < QCHUNK ? row_len - j0 : QCHUNK;
            query_chunk(sk, h, g, sk->rows == 3 ? m : NULL, o,
                        row != NULL ? row + (size_t)j0 * o->l->elt_size : NULL, r + j0, w, del, ke,
                        ve);
            if (del)
                delete_chunk(sk, h, g, r + j0, w, ke, ve);
        }
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
    kv_cursor_init(&cur, j->segs, j->nsegs, lo);
    query_dest o = query_dest_of(j->l, j->t, j->pool);
    for (size_t n = lo; n < hi && kv_cursor_next(&cur, &o.blk, &o.slot); n++)
        query_token(&copy, j->h + n * copy.rows, j->g + n * copy.rows, &o, 0);
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
    kv_cursor_init(&cur, segs, nsegs, 0);
    query_dest o = query_dest_of(l, t, pool);
    for (size_t n = 0; kv_cursor_next(&cur, &o.blk, &o.slot); n++)
        query_token(sk, h + n * sk->rows, g + n * sk->rows, &o, 1);
}

void KV_FAST(kv_sketch_delete)(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    assert(sk->rows >= 1 && sk->rows <= KV_SKETCH_MAX_ROWS);
    query_dest none = query_dest_of(NULL, KV_FP32, NULL);
    for (size_t k = 0; k < n; k++)
        query_token(sk, h + k * sk->rows, g + k * sk->rows, &none, 1);
}
