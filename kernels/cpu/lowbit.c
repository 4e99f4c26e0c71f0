/*
 * lowbit.c - fast CPU INT4 / INT2 tier kernels (kernels.h "Low-bit tiers").
 *
 * Quantisation takes a block's key groups (a head's G slots, by chunks of
 * KV_CHUNK channels) and value groups (a token's G channels) in two passes
 * over their rows, range then codes, converting rows with kv_row_load (F16C
 * in the AVX2 build) and walking the list with a cursor saved at each
 * group's first token; the second pass reads from cache. Codes are OR-ed
 * into the zeroed block, a code never straddling a byte (8 % bits == 0).
 * Dequantisation takes a run of tokens head by head: a key group's
 * parameters are converted once for the run's tokens in it, a value
 * group's once per token. The AVX2 build computes 8 channels a step in
 * registers (codes widened by a variable shift, (code·s + z)·p2, cvtps2ph
 * or the bf16 rounding on 8 lanes: 0.04 -> 0.5 of memcpy into fp16 in
 * bench_kernels); groups whose parameters are not all finite, channels
 * past the last multiple of 8 and value groups that start off one take
 * the portable loop, as the generic build does for all. The quantiser
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

/* Whether the fp16 at p[i] is finite. A group whose scale and zero point
 * are has no NaN value (codes are integers, |s|, |z| < 2^16, the shift a
 * power of two), which cvtps2ph and the bf16 rounding in registers convert
 * as the portable conversions do: those alone give NaN payloads as the
 * reference does. */
static int half_finite(const uint8_t *p, size_t i)
{
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return (h & 0x7c00u) != 0x7c00u;
}

/* Whether the n floats of s and of z are all finite. */
static int params_finite(const float *s, const float *z, uint32_t n)
{
    uint32_t bad = 0;
    for (uint32_t c = 0; c < n; c++)
        bad |= kv_mask((kv_float_to_bits(s[c]) & 0x7f800000u) == 0x7f800000u) |
               kv_mask((kv_float_to_bits(z[c]) & 0x7f800000u) == 0x7f800000u);
    return bad == 0;
}

/* Channels [c0, c1) of the code row `codes` into the row `out` (both at
 * channel 0), portably: kv_lowbit_value of each code with its scale and
 * zero point, s[c - c0] and z[c - c0] (one = 0: a pair per channel, as
 * keys have) or s[0] and z[0] (one = 1: one pair, a value group), stored
 * as t (elements of e bytes) through a stack buffer. */
static void row_portable(const uint8_t *codes, uint32_t bits, const float *s, const float *z,
                         int one, float p2, uint32_t c0, uint32_t c1, kv_dtype t, size_t e,
                         uint8_t *out)
{
    float buf[KV_CHUNK];
    for (uint32_t a = c0; a < c1; a += KV_CHUNK) {
        uint32_t w = c1 - a < KV_CHUNK ? c1 - a : KV_CHUNK;
        for (uint32_t c = 0; c < w; c++) {
            uint32_t k = one ? 0 : a - c0 + c;
            buf[c] = kv_lowbit_value(kv_lowbit_get(codes, a + c, bits), s[k], z[k], p2);
        }
        kv_row_store(out + (size_t)a * e, t, w, buf);
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* The 8 codes from channel c (c % 8 == 0: they start on a byte and take
 * `bits` bytes, read alone) as floats: the bytes broadcast, each lane
 * shifted to its code. */
static inline __m256 codes8(const uint8_t *row, uint32_t c, uint32_t bits)
{
    uint32_t u = 0;
    memcpy(&u, row + c * bits / 8, bits); /* bits is a constant (row_avx2) */
    __m256i sh = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                           : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)u), sh);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << bits) - 1)));
}

/* 8 floats, none NaN, stored as t: cvtps2ph rounds to nearest even as
 * kv_float_to_half does (overflow to infinity, subnormals included), and
 * the bf16 rounding is kv_float_to_bf16's on 8 lanes (its NaN case aside). */
static inline void store8(uint8_t *out, kv_dtype t, __m256 x)
{
    if (t == KV_FP32) {
        _mm256_storeu_ps((float *)(void *)out, x);
    } else if (t == KV_FP16) {
        _mm_storeu_si128((__m128i *)(void *)out, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m256i b = _mm256_castps_si256(x);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        b = _mm256_srli_epi32(b, 16);
        __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        _mm_storeu_si128((__m128i *)(void *)out, _mm_packus_epi32(lo, hi));
    }
}

/* row_portable for c0, c1 multiples of 8 and finite parameters, in
 * registers: the same two roundings as kv_lowbit_value, (code·s + z)·p2
 * (mul, add, mul: no FMA). Inlined with bits, one and t constant
 * (row_fast). */
static inline __attribute__((always_inline)) void row_avx2(const uint8_t *codes, uint32_t bits,
                                                           const float *s, const float *z, int one,
                                                           float p2, uint32_t c0, uint32_t c1,
                                                           kv_dtype t, uint8_t *out)
{
    size_t e = t == KV_FP32 ? 4 : 2;
    __m256 vp2 = _mm256_set1_ps(p2), vs = _mm256_set1_ps(s[0]), vz = _mm256_set1_ps(z[0]);
    for (uint32_t c = c0; c < c1; c += 8) {
        if (!one) {
            vs = _mm256_loadu_ps(s + (c - c0));
            vz = _mm256_loadu_ps(z + (c - c0));
        }
        __m256 m = _mm256_mul_ps(codes8(codes, c, bits), vs);
        store8(out + (size_t)c * e, t, _mm256_mul_ps(_mm256_add_ps(m, vz), vp2));
    }
}

#define ROW_AVX2(ONE, BITS, T) row_avx2(codes, BITS, s, z, ONE, p2, c0, c1, T, out)
#define ROW_AVX2_DTYPE(ONE, BITS)                                                                  \
    (t == KV_FP16   ? ROW_AVX2(ONE, BITS, KV_FP16)                                                 \
     : t == KV_BF16 ? ROW_AVX2(ONE, BITS, KV_BF16)                                                 \
                    : ROW_AVX2(ONE, BITS, KV_FP32))

static void row_fast(const uint8_t *codes, uint32_t bits, const float *s, const float *z, int one,
                     float p2, uint32_t c0, uint32_t c1, kv_dtype t, uint8_t *out)
{
    if (one)
        bits == 4 ? ROW_AVX2_DTYPE(1, 4) : ROW_AVX2_DTYPE(1, 2);
    else
        bits == 4 ? ROW_AVX2_DTYPE(0, 4) : ROW_AVX2_DTYPE(0, 2);
}
#endif

/* row_portable, whose parameters are all finite when `finite`: the AVX2
 * build then does the channels from c0 (a multiple of 8) to the last
 * multiple of 8 in registers, and the rest portably. */
static void dequant_row(const uint8_t *codes, uint32_t bits, const float *s, const float *z,
                        int one, int finite, float p2, uint32_t c0, uint32_t c1, kv_dtype t,
                        size_t e, uint8_t *out)
{
    uint32_t a = c0;
#ifdef __AVX2__
    if (finite && c0 % 8 == 0 && c1 - c0 >= 8) {
        a = c0 + ((c1 - c0) & ~7u);
        row_fast(codes, bits, s, z, one, p2, c0, a, t, out);
    }
#else
    (void)finite;
#endif
    if (a < c1)
        row_portable(codes, bits, one ? s : s + (a - c0), one ? z : z + (a - c0), one, p2, a, c1, t,
                     e, out);
}

/* n tokens from low-bit (qb, qs..) to pool (db, ds..), head by head: the
 * parameters of a key group are converted once for the run's tokens in
 * it (KV_CHUNK channels at a time), those of a value group once per
 * token; code rows, value parameters and pool rows are stepped a token at
 * a time. */
static void dequant_run(const void *ctx, uint32_t qb, uint32_t qs, uint32_t db, uint32_t ds,
                        uint32_t n)
{
    const dequant_job *j = ctx;
    const kv_layout *l = j->l, *dl = j->dl;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G, bits = j->bits;
    size_t e = dl->elt_size, orow = kv_row_bytes(dl), half = kv_block_bytes(dl) / 2;
    /* steps from a slot to the next (kernels.h "Low-bit tiers") */
    size_t crow = kv_lowbit_code_offset(l, bits, 0, 0, 0, 1);
    size_t vstep = kv_lowbit_value_params_offset(l, bits, 0, 0, 1) -
                   kv_lowbit_value_params_offset(l, bits, 0, 0, 0);
    int32_t shift;
    memcpy(&shift, j->qpool + kv_lowbit_shift_offset(l, bits, qb), 4);
    float p2 = kv_lowbit_pow2(shift);
    float s[KV_CHUNK], z[KV_CHUNK];
    for (uint32_t h = 0; h < l->kv_heads; h++) {
        const uint8_t *krow = j->qpool + kv_lowbit_code_offset(l, bits, qb, 0, h, qs);
        const uint8_t *vrow = j->qpool + kv_lowbit_code_offset(l, bits, qb, 1, h, qs);
        const uint8_t *vp = j->qpool + kv_lowbit_value_params_offset(l, bits, qb, h, qs);
        uint8_t *kout = j->pool + kv_key_offset(dl, db, h, ds);
        for (uint32_t c0 = 0; c0 < d; c0 += KV_CHUNK) {
            uint32_t w = d - c0 < KV_CHUNK ? d - c0 : KV_CHUNK, kg = UINT32_MAX;
            int finite = 0;
            for (uint32_t i = 0; i < n; i++) {
                if ((qs + i) / G != kg) {
                    kg = (qs + i) / G;
                    const uint8_t *kp = j->qpool + kv_lowbit_key_params_offset(l, bits, qb, h, kg);
                    kv_row_load(kp + 2 * (size_t)c0, KV_FP16, w, s);
                    kv_row_load(kp + 2 * ((size_t)d + c0), KV_FP16, w, z);
                    finite = params_finite(s, z, w);
                }
                dequant_row(krow + i * crow, bits, s, z, 0, finite, p2, c0, c0 + w, j->t, e,
                            kout + i * orow);
            }
        }
        for (uint32_t i = 0; i < n; i++, vp += vstep)
            for (uint32_t g = 0; g < nv; g++) {
                float gs = half_at(vp, g), gz = half_at(vp, (size_t)nv + g);
                int finite = half_finite(vp, g) && half_finite(vp, (size_t)nv + g);
                uint32_t c1 = d - g * G < G ? d : (g + 1) * G;
                dequant_row(vrow + i * crow, bits, &gs, &gz, 1, finite, p2, g * G, c1, j->t, e,
                            kout + half + i * orow);
            }
    }
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
