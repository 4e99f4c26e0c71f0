/*
 * lowbit_ref.c - reference INT4 / INT2 tier kernels (kernels.h "Low-bit
 * tiers"): each group is gathered into a float array, its range taken, and
 * every element coded by kernels/lowbit.h, the definition of the quantiser;
 * addresses come from the layout functions, tokens from a plain walk of the
 * segment list, codes are packed one at a time.
 *
 * Slow on purpose; only the tests and tests/gpu call these.
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lowbit.h"
#include "kernels.h"
#include "ref_tokens.h"

/* Byte offset of element e of (block, kv, head, slot) in a pool of layout l. */
static size_t pool_elt(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head,
                       uint32_t slot, uint32_t e)
{
    size_t off = kv_key_offset(l, block, head, slot) + (size_t)e * l->elt_size;
    return kv ? off + kv_block_bytes(l) / 2 : off;
}

static void put_code(uint8_t *row, uint32_t c, uint32_t bits, uint32_t code)
{
    uint32_t bit = c * bits;
    row[bit >> 3] = (uint8_t)(row[bit >> 3] | code << (bit & 7u));
}

static void put_half(uint8_t *p, uint16_t h)
{
    memcpy(p, &h, 2);
}

static uint16_t get_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Quantise the n values x of one group: params into *s, *z; codes into
 * code[i]. */
static void quantize_group(const float *x, size_t n, uint32_t bits, uint16_t *s, uint16_t *z,
                           uint32_t *code)
{
    float lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    kv_lowbit_params(lo, hi, bits, s, z);
    for (size_t i = 0; i < n; i++)
        code[i] = kv_lowbit_code(x[i], kv_half_to_float(*s), kv_half_to_float(*z), bits);
}

/* The block's shift: the largest |x| of its m tokens, K and V, every head. */
static int32_t block_shift(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                           const kv_segment *segs, size_t nsegs, size_t first, uint32_t m)
{
    float amax = 0;
    for (uint32_t i = 0; i < m; i++) {
        uint32_t blk = 0, slot = 0;
        kv_ref_nth_token(segs, nsegs, first + i, &blk, &slot);
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c = 0; c < l->head_dim; c++) {
                    float a = fabsf(kv_elt_load(pool + pool_elt(l, blk, kv, h, slot, c), t));
                    amax = a > amax ? a : amax;
                }
    }
    return kv_lowbit_shift(amax);
}

/* The m tokens' keys, per channel over key groups of G slots, each value
 * times p (the block's 2^-e). */
static void quantize_keys(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, size_t first, uint32_t m,
                          uint8_t *qpool, uint32_t qb, float p, float *x, uint32_t *code)
{
    uint32_t G = kv_lowbit_group(l), d = l->head_dim;
    for (uint32_t h = 0; h < l->kv_heads; h++)
        for (uint32_t k0 = 0; k0 < m; k0 += G) {
            uint32_t n = m - k0 < G ? m - k0 : G;
            uint8_t *par = qpool + kv_lowbit_key_params_offset(l, bits, qb, h, k0 / G);
            for (uint32_t c = 0; c < d; c++) {
                for (uint32_t i = 0; i < n; i++) {
                    uint32_t blk = 0, slot = 0;
                    kv_ref_nth_token(segs, nsegs, first + k0 + i, &blk, &slot);
                    x[i] = kv_elt_load(pool + pool_elt(l, blk, 0, h, slot, c), t) * p;
                }
                uint16_t s, z;
                quantize_group(x, n, bits, &s, &z, code);
                put_half(par + 2 * (size_t)c, s);
                put_half(par + 2 * ((size_t)d + c), z);
                for (uint32_t i = 0; i < n; i++)
                    put_code(qpool + kv_lowbit_code_offset(l, bits, qb, 0, h, k0 + i), c, bits,
                             code[i]);
            }
        }
}

/* The m tokens' values, per token over value groups of G channels, each
 * value times p. */
static void quantize_values(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, size_t first, uint32_t m,
                            uint8_t *qpool, uint32_t qb, float p, float *x, uint32_t *code)
{
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G;
    for (uint32_t h = 0; h < l->kv_heads; h++)
        for (uint32_t i = 0; i < m; i++) {
            uint32_t blk = 0, slot = 0;
            kv_ref_nth_token(segs, nsegs, first + i, &blk, &slot);
            uint8_t *par = qpool + kv_lowbit_value_params_offset(l, bits, qb, h, i);
            uint8_t *row = qpool + kv_lowbit_code_offset(l, bits, qb, 1, h, i);
            for (uint32_t c0 = 0; c0 < d; c0 += G) {
                uint32_t n = d - c0 < G ? d - c0 : G;
                for (uint32_t c = 0; c < n; c++)
                    x[c] = kv_elt_load(pool + pool_elt(l, blk, 1, h, slot, c0 + c), t) * p;
                uint16_t s, z;
                quantize_group(x, n, bits, &s, &z, code);
                put_half(par + 2 * (size_t)(c0 / G), s);
                put_half(par + 2 * ((size_t)nv + c0 / G), z);
                for (uint32_t c = 0; c < n; c++)
                    put_code(row, c0 + c, bits, code[c]);
            }
        }
}

void kv_lowbit_quantize_ref(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                            const uint32_t *qblocks, size_t nq)
{
    assert(bits == 4 || bits == 2);
    uint32_t T = l->block_tokens, G = kv_lowbit_group(l);
    size_t ntok = kv_segments_tokens(segs, nsegs);
    assert(ntok <= nq * (size_t)T);
    size_t most = G > l->head_dim ? G : l->head_dim;
    float *x = malloc((most ? most : 1) * sizeof *x);
    uint32_t *code = malloc((most ? most : 1) * sizeof *code);
    if (x == NULL || code == NULL)
        abort(); /* test-only code */
    size_t bytes = kv_lowbit_block_bytes(l, bits);
    for (size_t b = 0; b < nq; b++) {
        size_t first = b * T;
        uint32_t m = ntok > first ? (uint32_t)(ntok - first < T ? ntok - first : T) : 0;
        memset(qpool + (size_t)qblocks[b] * bytes, 0, bytes);
        int32_t e = block_shift(l, t, pool, segs, nsegs, first, m);
        memcpy(qpool + kv_lowbit_shift_offset(l, bits, qblocks[b]), &e, 4);
        float p = kv_lowbit_pow2(-e);
        quantize_keys(l, bits, t, pool, segs, nsegs, first, m, qpool, qblocks[b], p, x, code);
        quantize_values(l, bits, t, pool, segs, nsegs, first, m, qpool, qblocks[b], p, x, code);
    }
    free(x);
    free(code);
}

void kv_lowbit_dequantize_ref(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                              const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                              const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                              size_t ndst)
{
    assert(bits == 4 || bits == 2);
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G;
    uint32_t qb, qs, db, ds;
    for (size_t i = 0;
         kv_ref_nth_token(qsegs, nqsegs, i, &qb, &qs) && kv_ref_nth_token(dst, ndst, i, &db, &ds);
         i++)
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            int32_t e;
            memcpy(&e, qpool + kv_lowbit_shift_offset(l, bits, qb), 4);
            float p2 = kv_lowbit_pow2(e);
            const uint8_t *kp = qpool + kv_lowbit_key_params_offset(l, bits, qb, h, qs / G);
            const uint8_t *vp = qpool + kv_lowbit_value_params_offset(l, bits, qb, h, qs);
            const uint8_t *krow = qpool + kv_lowbit_code_offset(l, bits, qb, 0, h, qs);
            const uint8_t *vrow = qpool + kv_lowbit_code_offset(l, bits, qb, 1, h, qs);
            for (uint32_t c = 0; c < d; c++) {
                float k = kv_lowbit_value(kv_lowbit_get(krow, c, bits),
                                          kv_half_to_float(get_half(kp + 2 * (size_t)c)),
                                          kv_half_to_float(get_half(kp + 2 * ((size_t)d + c))), p2);
                float v =
                    kv_lowbit_value(kv_lowbit_get(vrow, c, bits),
                                    kv_half_to_float(get_half(vp + 2 * (size_t)(c / G))),
                                    kv_half_to_float(get_half(vp + 2 * ((size_t)nv + c / G))), p2);
                kv_elt_store(pool + pool_elt(dl, db, 0, h, ds, c), t, k);
                kv_elt_store(pool + pool_elt(dl, db, 1, h, ds, c), t, v);
            }
        }
}
