/*
 * int8.c - fast CPU INT8 tier kernels (kernels.h "INT8 tier").
 *
 * Rows are converted to fp32 once, in chunks of channels on the stack (a
 * quantised group chunk's tokens sit in one tile between the max and the
 * codes), and every per-channel loop runs across channels, so it
 * vectorises. The result
 * equals int8_ref.c byte for byte:
 *  - max|x| does not depend on the order it is taken in;
 *  - s = max/127 and x/s are the same IEEE divisions (no reciprocal);
 *  - round half to even is (y + 1.5·2^23) - 1.5·2^23, exact for
 *    |y| < 2^22 (|x/s| <= 127 here), which is nearbyintf in the default
 *    rounding mode without a libm call per element.
 * Quantisation splits over INT8 blocks and dequantisation over tokens
 * (parallel.h); each output byte is written by one thread.
 */
#include <assert.h>
#include <string.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#define RNE_MAGIC 12582912.0f /* 1.5 * 2^23 */

/* ---- quantise ---- */

typedef struct quant_job {
    const kv_layout *l;
    kv_dtype t;
    const uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs, ntok;
    uint8_t *qpool;
    const uint32_t *qblocks;
} quant_job;

#ifdef __AVX2__
#include <immintrin.h>

/* Codes of the first n - n % 32 channels: the same IEEE division, then
 * cvtps2dq, which rounds in the current mode (nearest even by default, as
 * nearbyintf), clamps as integers and narrows with saturating packs (a
 * no-op within [-127, 127]). Returns how many channels it did. */
static uint32_t codes_avx2(const float *x, const float *s, uint32_t n, int8_t *q)
{
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    uint32_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            uint32_t o = c + 8 * (uint32_t)k;
            __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + o), _mm256_loadu_ps(s + o));
            v[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(y), hi), lo);
        }
        __m256i w =
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + c), _mm256_permutevar8x32_epi32(w, order));
    }
    return c;
}
#endif

/* Floats of the stack tile holding a group chunk's tokens, converted once. */
#define QTILE 8192u

/* Codes and scales of channels [c0, c0 + n) of (kv, head) of INT8 block b,
 * whose m tokens start where cursor `start` stands; m * n <= QTILE. */
static void quant_chunk(const quant_job *j, size_t b, uint32_t m, const kv_cursor *start,
                        uint32_t kv, uint32_t h, uint32_t c0, uint32_t n)
{
    const kv_layout *l = j->l;
    size_t half = kv ? kv_block_bytes(l) / 2 : 0, coff = (size_t)c0 * l->elt_size;
    float tile[QTILE], amax[KV_CHUNK], s[KV_CHUNK];
    kv_cursor cur = *start;
    uint32_t blk, slot, i;

    for (uint32_t c = 0; c < n; c++)
        amax[c] = 0;
    for (i = 0; i < m && kv_cursor_next(&cur, &blk, &slot); i++) {
        float *x = tile + (size_t)i * n;
        kv_row_load(j->pool + kv_key_offset(l, blk, h, slot) + half + coff, j->t, n, x);
        for (uint32_t c = 0; c < n; c++) {
            float a = x[c] < 0 ? -x[c] : x[c];
            amax[c] = a > amax[c] ? a : amax[c];
        }
    }
    m = i;
    /* §5.4: an all-zero group gets scale 1 (divided first, then selected:
     * a division under a condition does not vectorise). */
    for (uint32_t c = 0; c < n; c++) {
        float q = amax[c] / 127.0f;
        s[c] = amax[c] > 0 ? q : 1.0f;
    }
    memcpy(j->qpool + kv_int8_scale_offset(l, j->qblocks[b], kv, h) + 4 * (size_t)c0, s,
           4 * (size_t)n);

    size_t row0 = kv_int8_code_offset(l, j->qblocks[b], kv, h, 0) + c0;
    for (i = 0; i < l->block_tokens; i++) {
        int8_t *q = (int8_t *)j->qpool + row0 + (size_t)i * l->head_dim;
        if (i >= m) {
            memset(q, 0, n); /* slots past the block's tokens */
            continue;
        }
        const float *x = tile + (size_t)i * n;
        uint32_t c = 0;
#ifdef __AVX2__
        c = codes_avx2(x, s, n, q);
#endif
        for (; c < n; c++) {
            float r = (x[c] / s[c] + RNE_MAGIC) - RNE_MAGIC;
            /* the reference's clamp, written as min / max (equal for the
             * finite values kernels.h requires) */
            r = r < 127 ? r : 127;
            r = r > -127 ? r : -127;
            q[c] = (int8_t)(int)r;
        }
    }
}

static void quant_blocks(void *ctx, size_t lo, size_t hi)
{
    const quant_job *j = ctx;
    const kv_layout *l = j->l;
    uint32_t T = l->block_tokens;
    /* channels per chunk: the chunk's T rows fit the tile */
    uint32_t width = QTILE / (T ? T : 1) < KV_CHUNK ? QTILE / (T ? T : 1) : KV_CHUNK;
    size_t codes = 2 * (size_t)l->kv_heads * T * l->head_dim;
    size_t scales = kv_int8_scale_offset(l, 0, 0, 0), bytes = kv_int8_block_bytes(l);
    size_t scales_end = scales + 8 * (size_t)l->kv_heads * l->head_dim;
    kv_cursor cur; /* at the first token of block b */
    kv_cursor_init(&cur, j->segs, j->nsegs, lo * T);
    for (size_t b = lo; b < hi; b++) {
        size_t first = b * T;
        uint32_t m = j->ntok > first ? (uint32_t)(j->ntok - first < T ? j->ntok - first : T) : 0;
        uint8_t *base = j->qpool + kv_int8_code_offset(l, j->qblocks[b], 0, 0, 0);
        memset(base + codes, 0, scales - codes); /* the padding bytes */
        memset(base + scales_end, 0, bytes - scales_end);
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c0 = 0; c0 < l->head_dim; c0 += width) {
                    uint32_t n = l->head_dim - c0 < width ? l->head_dim - c0 : width;
                    quant_chunk(j, b, m, &cur, kv, h, c0, n);
                }
        uint32_t blk, slot;
        for (uint32_t i = 0; i < m; i++)
            kv_cursor_next(&cur, &blk, &slot);
    }
}

void KV_FAST(kv_int8_quantize)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                               const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                               const uint32_t *qblocks, size_t nq)
{
    quant_job j = {l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), qpool, qblocks};
    assert(j.ntok <= nq * (size_t)l->block_tokens);
    assert(l->block_tokens <= QTILE);
    size_t bytes = nq * (kv_block_bytes(l) + kv_int8_block_bytes(l));
    kv_parallel_for(nq, bytes, quant_blocks, &j);
}

/* ---- dequantise ---- */

typedef struct dequant_job {
    const kv_layout *l;
    const uint8_t *qpool;
    const kv_segment *qsegs;
    size_t nqsegs;
    kv_dtype t;
    uint8_t *pool;
    const kv_segment *dst;
    size_t ndst;
} dequant_job;

/* n tokens from INT8 (qb, qs..) to pool (db, ds..): per (kv, head, chunk)
 * the scales are read once for the whole run. */
static void dequant_run(const dequant_job *j, uint32_t qb, uint32_t qs, uint32_t db, uint32_t ds,
                        uint32_t n)
{
    const kv_layout *l = j->l;
    size_t half = kv_block_bytes(l) / 2;
    float s[KV_CHUNK], buf[KV_CHUNK];
    for (uint32_t kv = 0; kv < 2; kv++)
        for (uint32_t h = 0; h < l->kv_heads; h++)
            for (uint32_t c0 = 0; c0 < l->head_dim; c0 += KV_CHUNK) {
                uint32_t w = l->head_dim - c0 < KV_CHUNK ? l->head_dim - c0 : KV_CHUNK;
                memcpy(s, j->qpool + kv_int8_scale_offset(l, qb, kv, h) + 4 * (size_t)c0,
                       4 * (size_t)w);
                for (uint32_t i = 0; i < n; i++) {
                    const int8_t *q =
                        (const int8_t *)j->qpool + kv_int8_code_offset(l, qb, kv, h, qs + i) + c0;
                    for (uint32_t c = 0; c < w; c++)
                        buf[c] = (float)q[c] * s[c];
                    uint8_t *out = j->pool + kv_key_offset(l, db, h, ds + i) + (kv ? half : 0) +
                                   (size_t)c0 * l->elt_size;
                    kv_row_store(out, j->t, w, buf);
                }
            }
}

static void dequant_tokens(void *ctx, size_t lo, size_t hi)
{
    const dequant_job *j = ctx;
    kv_cursor src, dst;
    kv_cursor_init(&src, j->qsegs, j->nqsegs, lo);
    kv_cursor_init(&dst, j->dst, j->ndst, lo);
    for (size_t i = lo; i < hi;) {
        uint32_t qb, qs, db, ds;
        uint32_t ns = kv_cursor_run(&src, &qb, &qs), nd = kv_cursor_run(&dst, &db, &ds);
        if (ns == 0 || nd == 0)
            return;
        uint32_t n = ns < nd ? ns : nd;
        if (n > hi - i)
            n = (uint32_t)(hi - i);
        dequant_run(j, qb, qs, db, ds, n);
        kv_cursor_skip(&src, n);
        kv_cursor_skip(&dst, n);
        i += n;
    }
}

void KV_FAST(kv_int8_dequantize)(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                                 size_t nqsegs, kv_dtype t, uint8_t *pool, const kv_segment *dst,
                                 size_t ndst)
{
    dequant_job j = {l, qpool, qsegs, nqsegs, t, pool, dst, ndst};
    size_t a = kv_segments_tokens(qsegs, nqsegs), b = kv_segments_tokens(dst, ndst);
    size_t n = a < b ? a : b;
    size_t bytes = n * 2 * (size_t)l->kv_heads * l->head_dim * (1 + l->elt_size);
    kv_parallel_for(n, bytes, dequant_tokens, &j);
}
