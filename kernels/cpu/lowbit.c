/*
 * lowbit.c - fast CPU INT4 / INT2 tier kernels (kernels.h "Low-bit tiers").
 *
 * Quantisation takes a block's key groups (a head's G slots, by chunks of
 * KV_CHUNK channels) and value groups (a token's G channels) in two passes
 * over their rows, range then codes, converting rows with kv_row_load (F16C
 * in the AVX2 build) and walking the list with a cursor saved at each
 * group's first token; the second pass reads from cache. Codes are OR-ed
 * into the zeroed block, a code never straddling a byte (8 % bits == 0).
 * Dequantisation converts a token's parameters once per row. The quantiser
 * itself is kernels/lowbit.h, shared with the reference, whose operations
 * (min, max, IEEE division, rne, one multiplication and one addition) this
 * file does in the same order per element: the result equals lowbit_ref.c
 * byte for byte. Quantisation splits over blocks and dequantisation over
 * tokens (parallel.h); each output byte is written by one thread.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "../lowbit.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

typedef struct quant_job {
    const kv_layout *l;
    uint32_t bits;
    kv_dtype t;
    const uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs, ntok;
    uint8_t *qpool;
    const uint32_t *qblocks;
} quant_job;

/* Byte offset in a pool block of (kv, head h, slot s). */
static size_t pool_row(const kv_layout *l, uint32_t kv, uint32_t h, uint32_t slot)
{
    return kv_key_offset(l, 0, h, slot) + (kv ? kv_block_bytes(l) / 2 : 0);
}

/* The next token's row (kv, head h) of the list, NULL at its end. */
static const uint8_t *next_row(const quant_job *j, kv_cursor *c, uint32_t kv, uint32_t h)
{
    uint32_t blk = 0, slot = 0;
    if (!kv_cursor_next(c, &blk, &slot))
        return NULL;
    return j->pool + (size_t)blk * kv_block_bytes(j->l) + pool_row(j->l, kv, h, slot);
}

/* x[c] *= p: the block's shift (kernels/lowbit.h). */
static void shift_row(float *x, uint32_t n, float p)
{
    for (uint32_t c = 0; c < n; c++)
        x[c] = x[c] * p;
}

static void range_update(const float *x, uint32_t n, float *lo, float *hi)
{
    for (uint32_t c = 0; c < n; c++) {
        lo[c] = x[c] < lo[c] ? x[c] : lo[c];
        hi[c] = x[c] > hi[c] ? x[c] : hi[c];
    }
}

/* OR n codes of x (params s, z per element, or one pair when `one`) into
 * row from channel c0. */
static void pack_codes(const float *x, uint32_t n, const float *s, const float *z, int one,
                       uint32_t bits, uint8_t *row, uint32_t c0)
{
    for (uint32_t c = 0; c < n; c++) {
        uint32_t k = one ? 0 : c, bit = (c0 + c) * bits;
        uint32_t code = kv_lowbit_code(x[c], s[k], z[k], bits);
        row[bit >> 3] = (uint8_t)(row[bit >> 3] | code << (bit & 7u));
    }
}

/* Key group: n <= G tokens from cursor `start`, channels [c0, c0 + w) of
 * head h, into slots k0.. of block qb, shifted by p. */
static void quant_keys(const quant_job *j, const kv_cursor *start, uint32_t n, uint8_t *qb,
                       uint32_t h, uint32_t k0, uint32_t c0, uint32_t w, float p)
{
    const kv_layout *l = j->l;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, bits = j->bits;
    size_t e = l->elt_size;
    float x[KV_CHUNK], lo[KV_CHUNK], hi[KV_CHUNK], s[KV_CHUNK], z[KV_CHUNK];
    for (uint32_t c = 0; c < w; c++) {
        lo[c] = INFINITY;
        hi[c] = -INFINITY;
    }
    kv_cursor cur = *start;
    for (uint32_t i = 0; i < n; i++) {
        kv_row_load(next_row(j, &cur, 0, h) + c0 * e, j->t, w, x);
        shift_row(x, w, p);
        range_update(x, w, lo, hi);
    }
    uint8_t *par = qb + kv_lowbit_key_params_offset(l, bits, 0, h, k0 / G);
    for (uint32_t c = 0; c < w; c++) {
        uint16_t hs, hz;
        kv_lowbit_params(lo[c], hi[c], bits, &hs, &hz);
        memcpy(par + 2 * (size_t)(c0 + c), &hs, 2);
        memcpy(par + 2 * ((size_t)d + c0 + c), &hz, 2);
        s[c] = kv_half_to_float(hs);
        z[c] = kv_half_to_float(hz);
    }
    cur = *start;
    for (uint32_t i = 0; i < n; i++) {
        kv_row_load(next_row(j, &cur, 0, h) + c0 * e, j->t, w, x);
        shift_row(x, w, p);
        pack_codes(x, w, s, z, 0, bits, qb + kv_lowbit_code_offset(l, bits, 0, 0, h, k0 + i), c0);
    }
}

/* Value row of head h of the token at `row` into slot i of block qb,
 * shifted by p: per group of G channels, its range then its codes,
 * KV_CHUNK channels at a time. */
static void quant_value_row(const quant_job *j, const uint8_t *row, uint8_t *qb, uint32_t h,
                            uint32_t i, float p)
{
    const kv_layout *l = j->l;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G, bits = j->bits;
    size_t e = l->elt_size;
    uint8_t *par = qb + kv_lowbit_value_params_offset(l, bits, 0, h, i);
    uint8_t *codes = qb + kv_lowbit_code_offset(l, bits, 0, 1, h, i);
    float x[KV_CHUNK];
    for (uint32_t c0 = 0; c0 < d; c0 += G) {
        uint32_t n = d - c0 < G ? d - c0 : G;
        float lo = INFINITY, hi = -INFINITY;
        for (uint32_t a = 0; a < n; a += KV_CHUNK) {
            uint32_t w = n - a < KV_CHUNK ? n - a : KV_CHUNK;
            kv_row_load(row + (size_t)(c0 + a) * e, j->t, w, x);
            shift_row(x, w, p);
            for (uint32_t c = 0; c < w; c++) {
                lo = x[c] < lo ? x[c] : lo;
                hi = x[c] > hi ? x[c] : hi;
            }
        }
        uint16_t hs, hz;
        kv_lowbit_params(lo, hi, bits, &hs, &hz);
        memcpy(par + 2 * (size_t)(c0 / G), &hs, 2);
        memcpy(par + 2 * ((size_t)nv + c0 / G), &hz, 2);
        float s = kv_half_to_float(hs), z = kv_half_to_float(hz);
        for (uint32_t a = 0; a < n; a += KV_CHUNK) {
            uint32_t w = n - a < KV_CHUNK ? n - a : KV_CHUNK;
            kv_row_load(row + (size_t)(c0 + a) * e, j->t, w, x);
            shift_row(x, w, p);
            pack_codes(x, w, &s, &z, 1, bits, codes, c0 + a);
        }
    }
}

/* The shift of the block whose m tokens start at cursor `start`: the
 * largest |x| of their rows, K and V, every head. */
static int32_t block_shift(const quant_job *j, const kv_cursor *start, uint32_t m)
{
    const kv_layout *l = j->l;
    float x[KV_CHUNK], amax = 0;
    size_t e = l->elt_size;
    kv_cursor cur = *start;
    for (uint32_t i = 0; i < m; i++) {
        uint32_t blk = 0, slot = 0;
        kv_cursor_next(&cur, &blk, &slot);
        const uint8_t *base = j->pool + (size_t)blk * kv_block_bytes(l);
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c0 = 0; c0 < l->head_dim; c0 += KV_CHUNK) {
                    uint32_t w = l->head_dim - c0 < KV_CHUNK ? l->head_dim - c0 : KV_CHUNK;
                    kv_row_load(base + pool_row(l, kv, h, slot) + c0 * e, j->t, w, x);
                    for (uint32_t c = 0; c < w; c++) {
                        float a = fabsf(x[c]);
                        amax = a > amax ? a : amax;
                    }
                }
    }
    return kv_lowbit_shift(amax);
}

static void quant_blocks(void *ctx, size_t lo, size_t hi)
{
    const quant_job *j = ctx;
    const kv_layout *l = j->l;
    uint32_t T = l->block_tokens, G = kv_lowbit_group(l), d = l->head_dim;
    size_t bytes = kv_lowbit_block_bytes(l, j->bits);
    kv_cursor cur;
    kv_cursor_init(&cur, j->segs, j->nsegs, lo * T);
    for (size_t b = lo; b < hi; b++) {
        size_t first = b * T;
        uint32_t m = j->ntok > first ? (uint32_t)(j->ntok - first < T ? j->ntok - first : T) : 0;
        uint8_t *qb = j->qpool + (size_t)j->qblocks[b] * bytes;
        memset(qb, 0, bytes);
        int32_t shift = block_shift(j, &cur, m);
        memcpy(qb + kv_lowbit_shift_offset(l, j->bits, 0), &shift, 4);
        float p = kv_lowbit_pow2(-shift);
        for (uint32_t k0 = 0; k0 < m; k0 += G) { /* key groups, cur at their first token */
            uint32_t n = m - k0 < G ? m - k0 : G;
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c0 = 0; c0 < d; c0 += KV_CHUNK)
                    quant_keys(j, &cur, n, qb, h, k0, c0, d - c0 < KV_CHUNK ? d - c0 : KV_CHUNK, p);
            for (uint32_t i = 0; i < n; i++) { /* the same tokens' values; cur steps past */
                uint32_t blk = 0, slot = 0;
                kv_cursor_next(&cur, &blk, &slot);
                const uint8_t *blk_base = j->pool + (size_t)blk * kv_block_bytes(l);
                for (uint32_t h = 0; h < l->kv_heads; h++)
                    quant_value_row(j, blk_base + pool_row(l, 1, h, slot), qb, h, k0 + i, p);
            }
        }
    }
}

void KV_FAST(kv_lowbit_quantize)(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                                 const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                                 const uint32_t *qblocks, size_t nq)
{
    assert(bits == 4 || bits == 2);
    quant_job j = {l, bits, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), qpool, qblocks};
    assert(j.ntok <= nq * (size_t)l->block_tokens);
    size_t bytes = nq * (kv_block_bytes(l) + kv_lowbit_block_bytes(l, bits));
    kv_parallel_for(nq, bytes, quant_blocks, &j);
}

/* ---- dequantise ---- */

typedef struct dequant_job {
    const kv_layout *l;
    uint32_t bits;
    const uint8_t *qpool;
    const kv_segment *qsegs;
    size_t nqsegs;
    kv_dtype t;
    const kv_layout *dl;
    uint8_t *pool;
    const kv_segment *dst;
    size_t ndst;
} dequant_job;

static float half_at(const uint8_t *p, size_t i)
{
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return kv_half_to_float(h);
}

/* One token: low-bit (qb, qs) to pool (db, ds), K and V of every head. */
static void dequant_token(const dequant_job *j, uint32_t qb, uint32_t qs, uint32_t db, uint32_t ds)
{
    const kv_layout *l = j->l, *dl = j->dl;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G, bits = j->bits;
    size_t half = kv_block_bytes(dl) / 2;
    float buf[KV_CHUNK];
    int32_t shift;
    memcpy(&shift, j->qpool + kv_lowbit_shift_offset(l, bits, qb), 4);
    float p2 = kv_lowbit_pow2(shift);
    for (uint32_t h = 0; h < l->kv_heads; h++) {
        const uint8_t *kp = j->qpool + kv_lowbit_key_params_offset(l, bits, qb, h, qs / G);
        const uint8_t *vp = j->qpool + kv_lowbit_value_params_offset(l, bits, qb, h, qs);
        const uint8_t *krow = j->qpool + kv_lowbit_code_offset(l, bits, qb, 0, h, qs);
        const uint8_t *vrow = j->qpool + kv_lowbit_code_offset(l, bits, qb, 1, h, qs);
        uint8_t *kout = j->pool + kv_key_offset(dl, db, h, ds);
        for (uint32_t c0 = 0; c0 < d; c0 += KV_CHUNK) {
            uint32_t w = d - c0 < KV_CHUNK ? d - c0 : KV_CHUNK;
            for (uint32_t c = 0; c < w; c++)
                buf[c] = kv_lowbit_value(kv_lowbit_get(krow, c0 + c, bits), half_at(kp, c0 + c),
                                         half_at(kp, (size_t)d + c0 + c), p2);
            kv_row_store(kout + (size_t)c0 * dl->elt_size, j->t, w, buf);
            for (uint32_t c = 0; c < w; c++) {
                uint32_t g = (c0 + c) / G;
                buf[c] = kv_lowbit_value(kv_lowbit_get(vrow, c0 + c, bits), half_at(vp, g),
                                         half_at(vp, (size_t)nv + g), p2);
            }
            kv_row_store(kout + half + (size_t)c0 * dl->elt_size, j->t, w, buf);
        }
    }
}

/* A run of n tokens (kv_walk_pairs), one at a time. */
static void dequant_run(const void *ctx, uint32_t qb, uint32_t qs, uint32_t db, uint32_t ds,
                        uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        dequant_token(ctx, qb, qs + i, db, ds + i);
}

static void dequant_tokens(void *ctx, size_t lo, size_t hi)
{
    const dequant_job *j = ctx;
    kv_walk_pairs(j->qsegs, j->nqsegs, j->dst, j->ndst, lo, hi, dequant_run, j);
}

void KV_FAST(kv_lowbit_dequantize)(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                                   const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                   const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                                   size_t ndst)
{
    assert(bits == 4 || bits == 2);
    dequant_job j = {l, bits, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst};
    size_t a = kv_segments_tokens(qsegs, nqsegs), b = kv_segments_tokens(dst, ndst);
    size_t n = a < b ? a : b;
    size_t bytes = n * 2 * (size_t)l->kv_heads * l->head_dim * (1 + dl->elt_size);
    kv_parallel_for(n, bytes, dequant_tokens, &j);
}
