/*
 * lowbit.c - fast CPU INT4 / INT2 tier kernels (kernels.h "Low-bit tiers").
 *
 * Quantisation takes a block's key groups (a head's G slots, by chunks of
 * KV_CHUNK channels) and value groups (a token's G channels) in two passes
 * over their rows, range then codes, converting rows with kv_row_load (F16C
 * in the AVX2 build) and walking the list with a cursor saved at each
 * group's first token; the second pass reads from cache. Codes are OR-ed
 * into the zeroed block, a code never straddling a byte (8 % bits == 0).
 * The AVX2 build takes 8 channels a step in registers: the block's max
 * |x|, the keys' ranges (a lane per channel, over the tokens in order),
 * the value groups' ranges when G is a multiple of 8 (8 lanes, then
 * across them; a zero min or max, whose sign depends on the order, is
 * taken again in order), the parameters of 8 groups at once (cvtps2ph,
 * the covering check stepping the lanes that need it) and the codes (the
 * IEEE division, cvtps2dq, packed 32 at a time by packs and
 * multiply-adds): 0.03 -> 0.1-0.2 of memcpy in bench_kernels.
 *
 * Dequantisation takes a run of tokens head by head: a key group's
 * parameters are converted once for the run's tokens in it, a value
 * group's once per token. The AVX2 build computes 8 channels a step in
 * registers (codes widened by a variable shift, (code·s + z)·p2, cvtps2ph
 * or the bf16 rounding on 8 lanes: 0.04 -> 0.5 of memcpy into fp16 in
 * bench_kernels); groups whose parameters are not all finite, channels
 * past the last multiple of 8 and value groups that start off one take
 * the portable loop, as the generic build does for all.
 *
 * The quantiser itself is kernels/lowbit.h, shared with the reference,
 * whose operations (min, max, IEEE division, rne, one multiplication and
 * one addition) this file does in the same order per element: the result
 * equals lowbit_ref.c byte for byte. Quantisation splits over blocks and
 * dequantisation over tokens (parallel.h); each output byte is written by
 * one thread.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "../lowbit.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

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

#ifdef __AVX2__
/* 8 pool elements of type t as fp32, times p: the values kv_row_load and
 * shift_row give (F16C quietens a signalling NaN, which no result here
 * depends on: min, max and |x| ignore NaN, and its code is 0). */
static inline __m256 load8(const uint8_t *q, kv_dtype t, __m256 p)
{
    __m256 x;
    if (t == KV_FP32) {
        x = _mm256_loadu_ps((const float *)(const void *)q);
    } else {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)q);
        x = t == KV_FP16 ? _mm256_cvtph_ps(h)
                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_mul_ps(x, p);
}

/* 8 fp16 held in the low halves of 32-bit lanes, packed. */
static inline __m128i halves8(__m256i h)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* kv_lowbit_half_step on 8 lanes (fp16 bits in 32-bit lanes). */
static inline __m256i half_step8(__m256i h, int up)
{
    const __m256i one = _mm256_set1_epi32(1);
    __m256i mag = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
    __m256i pos =
        _mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), _mm256_setzero_si256());
    __m256i top = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(KV_HALF_MAX_BITS - 1));
    __m256i away = _mm256_blendv_epi8(_mm256_add_epi32(h, one), h, top);
    __m256i r = up ? _mm256_blendv_epi8(_mm256_sub_epi32(h, one), away, pos)
                   : _mm256_blendv_epi8(away, _mm256_sub_epi32(h, one), pos);
    __m256i zero = _mm256_cmpeq_epi32(mag, _mm256_setzero_si256());
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(up ? 0x0001 : 0x8001), zero);
}

/* kv_lowbit_half_bound on 8 lanes: cvtps2ph rounds a value inside the
 * finite fp16 range to nearest even as kv_float_to_half does (subnormals
 * included), and cvtph2ps reads it back exactly. */
static inline __m256i half_bound8(__m256 x, int up)
{
    __m128i h16 = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __m256 back = _mm256_cvtph_ps(h16);
    __m256i h = _mm256_cvtepu16_epi32(h16);
    __m256 off = up ? _mm256_cmp_ps(back, x, _CMP_LT_OQ) : _mm256_cmp_ps(back, x, _CMP_GT_OQ);
    h = _mm256_blendv_epi8(h, half_step8(h, up), _mm256_castps_si256(off));
    __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(-65504.0f), _CMP_NGT_UQ);
    /* the reference tests big first: it wins (NaN is both) */
    __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(65504.0f), _CMP_NLT_UQ);
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x8000 | KV_HALF_MAX_BITS),
                           _mm256_castps_si256(small));
    return _mm256_blendv_epi8(h, _mm256_set1_epi32(KV_HALF_MAX_BITS), _mm256_castps_si256(big));
}

/* kv_lowbit_params of 8 groups (ranges lo, hi): their scales and zero
 * points as fp16 into *s and *z, as floats into *sf and *zf. The covering
 * check steps the lanes that need it, until none does. */
static void params8(__m256 lo, __m256 hi, uint32_t bits, __m128i *s, __m128i *z, __m256 *sf,
                    __m256 *zf)
{
    const __m256 levels = _mm256_set1_ps((float)((1u << bits) - 1u));
    __m256i valid = _mm256_castps_si256(_mm256_cmp_ps(lo, hi, _CMP_LE_OQ));
    __m256i hz = half_bound8(lo, 0);
    __m256 zfl = _mm256_cvtph_ps(halves8(hz));
    __m256i hs = half_bound8(_mm256_div_ps(_mm256_sub_ps(hi, zfl), levels), 1);
    __m256i not_top =
        _mm256_andnot_si256(_mm256_cmpeq_epi32(hs, _mm256_set1_epi32(KV_HALF_MAX_BITS)), valid);
    for (;;) {
        __m256 top = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtph_ps(halves8(hs)), levels), zfl);
        __m256i step =
            _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(top, hi, _CMP_LT_OQ)), not_top);
        if (_mm256_testz_si256(step, step))
            break;
        hs = _mm256_blendv_epi8(hs, half_step8(hs, 1), step);
        not_top =
            _mm256_andnot_si256(_mm256_cmpeq_epi32(hs, _mm256_set1_epi32(KV_HALF_MAX_BITS)), valid);
    }
    *s = halves8(_mm256_and_si256(hs, valid));
    *z = halves8(_mm256_and_si256(hz, valid));
    *sf = _mm256_cvtph_ps(*s);
    *zf = _mm256_cvtph_ps(*z);
}

/* kv_lowbit_code of 8 values as 32-bit lanes (levels = 2^bits - 1).
 * max(q, 0) gives 0 for NaN as the reference's clamp does, and cvtps2dq
 * rounds to nearest even as its 1.5·2^23 trick does below 2^22. */
static inline __m256i codes8i(__m256 x, __m256 s, __m256 z, __m256 levels)
{
    __m256 q = _mm256_div_ps(_mm256_sub_ps(x, z), s);
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), levels);
    __m256 pos = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_and_si256(_mm256_cvtps_epi32(q), _mm256_castps_si256(pos));
}

/* 8 codes (32-bit lanes, channel order) stored as the row holds them at p
 * (`bits` bytes, lowest channel in the lowest bits). */
static inline void put8(uint8_t *p, __m256i c, uint32_t bits)
{
    c = _mm256_sllv_epi32(c, bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                       : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m128i o = _mm_or_si128(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4e));
    o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xb1));
    uint32_t w = (uint32_t)_mm_cvtsi128_si32(o);
    if (bits == 4) { /* constant sizes: one store */
        memcpy(p, &w, 4);
    } else {
        uint16_t w2 = (uint16_t)w;
        memcpy(p, &w2, 2);
    }
}

/* 32 codes (four times 8 lanes, channel order) stored as the row holds
 * them at p (4·bits bytes): narrowed to bytes by the saturating packs
 * (codes are below 16: no change) and put back in order, then neighbours
 * merged by multiply-adds, (1, 16) for 4 bits, (1, 4) then (1, 16) for 2. */
static inline void put32(uint8_t *p, const __m256i c[4], uint32_t bits)
{
    __m256i w =
        _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi16(bits == 4 ? 0x1001 : 0x0401));
    if (bits == 4) {
        __m128i o =
            _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
        _mm_storeu_si128((__m128i *)(void *)p, o);
    } else {
        __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00100001));
        __m128i o =
            _mm_packus_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
        _mm_storel_epi64((__m128i *)(void *)p, _mm_packus_epi16(o, o));
    }
}

/* The codes of channels [0, n - n % 8) of a pool row of type t, shifted
 * by vp, into the code row `codes` from channel c0 (a multiple of 8, so
 * that they fill whole bytes, which nothing else writes: stored, not
 * OR-ed), parameters per channel (s[c], z[c]) or one pair (one: s[0],
 * z[0]). Inlined with t, one and bits constant (codes_fast). Returns how
 * many channels it did. */
static inline __attribute__((always_inline)) uint32_t
codes_avx2(const uint8_t *row, kv_dtype t, __m256 vp, uint32_t n, const float *s, const float *z,
           int one, uint32_t bits, uint8_t *codes, uint32_t c0)
{
    const __m256 levels = _mm256_set1_ps((float)((1u << bits) - 1u));
    size_t e = t == KV_FP32 ? 4 : 2;
    __m256 vs = _mm256_set1_ps(s[0]), vz = _mm256_set1_ps(z[0]);
    uint32_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m256i v[4];
        for (uint32_t k = 0; k < 4; k++) {
            uint32_t o = c + 8 * k;
            v[k] = one ? codes8i(load8(row + o * e, t, vp), vs, vz, levels)
                       : codes8i(load8(row + o * e, t, vp), _mm256_loadu_ps(s + o),
                                 _mm256_loadu_ps(z + o), levels);
        }
        put32(codes + (c0 + c) * bits / 8, v, bits);
    }
    for (; c + 8 <= n; c += 8) {
        __m256i v = one ? codes8i(load8(row + c * e, t, vp), vs, vz, levels)
                        : codes8i(load8(row + c * e, t, vp), _mm256_loadu_ps(s + c),
                                  _mm256_loadu_ps(z + c), levels);
        put8(codes + (c0 + c) * bits / 8, v, bits);
    }
    return c;
}

#define CODES_AVX2(T, ONE, BITS) codes_avx2(row, T, vp, n, s, z, ONE, BITS, codes, c0)
#define CODES_AVX2_BITS(T, ONE) (bits == 4 ? CODES_AVX2(T, ONE, 4) : CODES_AVX2(T, ONE, 2))
#define CODES_AVX2_ONE(T) (one ? CODES_AVX2_BITS(T, 1) : CODES_AVX2_BITS(T, 0))

static uint32_t codes_fast(const uint8_t *row, kv_dtype t, __m256 vp, uint32_t n, const float *s,
                           const float *z, int one, uint32_t bits, uint8_t *codes, uint32_t c0)
{
    return t == KV_FP16   ? CODES_AVX2_ONE(KV_FP16)
           : t == KV_BF16 ? CODES_AVX2_ONE(KV_BF16)
                          : CODES_AVX2_ONE(KV_FP32);
}
#endif

/* Key group: n <= G tokens from cursor `start`, channels [c0, c0 + w) of
 * head h, into slots k0.. of block qb, shifted by p. The AVX2 build takes
 * channels [0, w - w % 8) in registers: each lane keeps its channel's
 * range over the tokens in their order, as range_update does. */
static void quant_keys(const quant_job *j, const kv_cursor *start, uint32_t n, uint8_t *qb,
                       uint32_t h, uint32_t k0, uint32_t c0, uint32_t w, float p)
{
    const kv_layout *l = j->l;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, bits = j->bits, v = 0;
    size_t e = l->elt_size;
    float x[KV_CHUNK], lo[KV_CHUNK], hi[KV_CHUNK], s[KV_CHUNK], z[KV_CHUNK];
    const uint8_t *row;
#ifdef __AVX2__
    const __m256 vp = _mm256_set1_ps(p);
    v = w & ~7u;
#endif
    for (uint32_t c = 0; c < w; c++) {
        lo[c] = INFINITY;
        hi[c] = -INFINITY;
    }
    kv_cursor cur = *start;
    for (uint32_t i = 0; i < n; i++) {
        row = next_row(j, &cur, 0, h) + c0 * e;
#ifdef __AVX2__
        for (uint32_t c = 0; c < v; c += 8) {
            __m256 y = load8(row + c * e, j->t, vp);
            _mm256_storeu_ps(lo + c, _mm256_min_ps(y, _mm256_loadu_ps(lo + c)));
            _mm256_storeu_ps(hi + c, _mm256_max_ps(y, _mm256_loadu_ps(hi + c)));
        }
#endif
        kv_row_load(row + v * e, j->t, w - v, x);
        shift_row(x, w - v, p);
        range_update(x, w - v, lo + v, hi + v);
    }
    uint8_t *par = qb + kv_lowbit_key_params_offset(l, bits, 0, h, k0 / G);
#ifdef __AVX2__
    for (uint32_t c = 0; c < v; c += 8) {
        __m128i hs, hz;
        __m256 sf, zf;
        params8(_mm256_loadu_ps(lo + c), _mm256_loadu_ps(hi + c), bits, &hs, &hz, &sf, &zf);
        _mm_storeu_si128((__m128i *)(void *)(par + 2 * (size_t)(c0 + c)), hs);
        _mm_storeu_si128((__m128i *)(void *)(par + 2 * ((size_t)d + c0 + c)), hz);
        _mm256_storeu_ps(s + c, sf);
        _mm256_storeu_ps(z + c, zf);
    }
#endif
    for (uint32_t c = v; c < w; c++) {
        uint16_t hs, hz;
        kv_lowbit_params(lo[c], hi[c], bits, &hs, &hz);
        memcpy(par + 2 * (size_t)(c0 + c), &hs, 2);
        memcpy(par + 2 * ((size_t)d + c0 + c), &hz, 2);
        s[c] = kv_half_to_float(hs);
        z[c] = kv_half_to_float(hz);
    }
    cur = *start;
    for (uint32_t i = 0; i < n; i++) {
        row = next_row(j, &cur, 0, h) + c0 * e;
        uint8_t *codes = qb + kv_lowbit_code_offset(l, bits, 0, 0, h, k0 + i);
#ifdef __AVX2__
        codes_fast(row, j->t, vp, v, s, z, 0, bits, codes, c0);
#endif
        kv_row_load(row + v * e, j->t, w - v, x);
        shift_row(x, w - v, p);
        pack_codes(x, w - v, s + v, z + v, 0, bits, codes, c0 + v);
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

#ifdef __AVX2__
#define VBATCH 64u /* value groups whose parameters are taken together */

/* Channels [c0, n) of row, shifted by p, into the range *lo, *hi in
 * channel order, as the reference takes it. */
static void range_scan(const uint8_t *row, kv_dtype t, uint32_t c0, uint32_t n, float p, float *lo,
                       float *hi)
{
    size_t e = t == KV_FP32 ? 4 : 2;
    float x[KV_CHUNK];
    for (uint32_t a = c0; a < n; a += KV_CHUNK) {
        uint32_t w = n - a < KV_CHUNK ? n - a : KV_CHUNK;
        kv_row_load(row + a * e, t, w, x);
        shift_row(x, w, p);
        for (uint32_t c = 0; c < w; c++) {
            *lo = x[c] < *lo ? x[c] : *lo;
            *hi = x[c] > *hi ? x[c] : *hi;
        }
    }
}

/* The range of a value group of n channels at row, shifted by p: a min
 * and a max per lane, then over the lanes and the last n % 8 channels.
 * Equal floats have the same bits but for +0 and -0, of which the
 * reference keeps the first in channel order: when the min or the max is
 * a zero, the group is scanned again in order. */
static void group_range8(const uint8_t *row, kv_dtype t, uint32_t n, float p, float *lo, float *hi)
{
    size_t e = t == KV_FP32 ? 4 : 2;
    __m256 vp = _mm256_set1_ps(p), l8 = _mm256_set1_ps(INFINITY), h8 = _mm256_set1_ps(-INFINITY);
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 y = load8(row + c * e, t, vp);
        l8 = _mm256_min_ps(y, l8);
        h8 = _mm256_max_ps(y, h8);
    }
    /* over the lanes, none NaN */
    l8 = _mm256_min_ps(l8, _mm256_permute2f128_ps(l8, l8, 1));
    h8 = _mm256_max_ps(h8, _mm256_permute2f128_ps(h8, h8, 1));
    l8 = _mm256_min_ps(l8, _mm256_permute_ps(l8, 0x4e));
    h8 = _mm256_max_ps(h8, _mm256_permute_ps(h8, 0x4e));
    l8 = _mm256_min_ps(l8, _mm256_permute_ps(l8, 0xb1));
    h8 = _mm256_max_ps(h8, _mm256_permute_ps(h8, 0xb1));
    float mn = _mm256_cvtss_f32(l8), mx = _mm256_cvtss_f32(h8);
    range_scan(row, t, c, n, p, &mn, &mx);
    if (mn == 0 || mx == 0) {
        mn = INFINITY;
        mx = -INFINITY;
        range_scan(row, t, 0, n, p, &mn, &mx);
    }
    *lo = mn;
    *hi = mx;
}

/* The value rows of every head of the token at `base` (its pool block),
 * slot `slot`, into slot i of block qb, shifted by p, for group sizes G
 * that are multiples of 8: the ranges of up to VBATCH groups, their
 * parameters 8 at a time (params8), then their codes 8 at a time. */
static void quant_values8(const quant_job *j, const uint8_t *base, uint32_t slot, uint8_t *qb,
                          uint32_t i, float p)
{
    const kv_layout *l = j->l;
    uint32_t G = kv_lowbit_group(l), d = l->head_dim, nv = (d + G - 1) / G, bits = j->bits;
    uint32_t total = l->kv_heads * nv;
    size_t e = l->elt_size;
    /* per head: a pool row, a code row, a parameter row further */
    size_t prow = pool_row(l, 1, 1, slot) - pool_row(l, 1, 0, slot);
    size_t crow =
        kv_lowbit_code_offset(l, bits, 0, 1, 1, i) - kv_lowbit_code_offset(l, bits, 0, 1, 0, i);
    size_t vrow = kv_lowbit_value_params_offset(l, bits, 0, 1, i) -
                  kv_lowbit_value_params_offset(l, bits, 0, 0, i);
    const uint8_t *row0 = base + pool_row(l, 1, 0, slot);
    uint8_t *codes0 = qb + kv_lowbit_code_offset(l, bits, 0, 1, 0, i);
    uint8_t *par0 = qb + kv_lowbit_value_params_offset(l, bits, 0, 0, i);
    __m256 vp = _mm256_set1_ps(p);
    float lo[VBATCH], hi[VBATCH], s[VBATCH], z[VBATCH];
    uint16_t hs[VBATCH], hz[VBATCH];
    for (uint32_t b0 = 0; b0 < total; b0 += VBATCH) {
        uint32_t nb = total - b0 < VBATCH ? total - b0 : VBATCH, k = 0;
        for (k = 0; k < nb; k++) {
            uint32_t h = (b0 + k) / nv, c0 = (b0 + k) % nv * G;
            group_range8(row0 + h * prow + c0 * e, j->t, d - c0 < G ? d - c0 : G, p, lo + k,
                         hi + k);
        }
        for (k = 0; k + 8 <= nb; k += 8) {
            __m128i s16, z16;
            __m256 sf, zf;
            params8(_mm256_loadu_ps(lo + k), _mm256_loadu_ps(hi + k), bits, &s16, &z16, &sf, &zf);
            _mm_storeu_si128((__m128i *)(void *)(hs + k), s16);
            _mm_storeu_si128((__m128i *)(void *)(hz + k), z16);
            _mm256_storeu_ps(s + k, sf);
            _mm256_storeu_ps(z + k, zf);
        }
        for (; k < nb; k++) {
            kv_lowbit_params(lo[k], hi[k], bits, hs + k, hz + k);
            s[k] = kv_half_to_float(hs[k]);
            z[k] = kv_half_to_float(hz[k]);
        }
        for (k = 0; k < nb; k++) {
            uint32_t h = (b0 + k) / nv, g = (b0 + k) % nv, c0 = g * G;
            uint32_t n = d - c0 < G ? d - c0 : G, c = 0;
            const uint8_t *row = row0 + h * prow + c0 * e;
            uint8_t *codes = codes0 + h * crow, *par = par0 + h * vrow;
            memcpy(par + 2 * (size_t)g, hs + k, 2);
            memcpy(par + 2 * ((size_t)nv + g), hz + k, 2);
            c = codes_fast(row, j->t, vp, n, s + k, z + k, 1, bits, codes, c0);
            if (c < n) {
                float x[8];
                kv_row_load(row + c * e, j->t, n - c, x);
                shift_row(x, n - c, p);
                pack_codes(x, n - c, s + k, z + k, 1, bits, codes, c0 + c);
            }
        }
    }
}
#endif

/* The shift of the block whose m tokens start at cursor `start`: the
 * largest |x| of their rows, K and V, every head. */
static int32_t block_shift(const quant_job *j, const kv_cursor *start, uint32_t m)
{
    const kv_layout *l = j->l;
    float x[KV_CHUNK], amax = 0;
    size_t e = l->elt_size;
    kv_cursor cur = *start;
#ifdef __AVX2__
    /* |x| has no -0: the max does not depend on the order it is taken in */
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), one = _mm256_set1_ps(1);
    __m256 a8 = _mm256_setzero_ps();
#endif
    for (uint32_t i = 0; i < m; i++) {
        uint32_t blk = 0, slot = 0;
        kv_cursor_next(&cur, &blk, &slot);
        const uint8_t *base = j->pool + (size_t)blk * kv_block_bytes(l);
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c0 = 0; c0 < l->head_dim; c0 += KV_CHUNK) {
                    uint32_t w = l->head_dim - c0 < KV_CHUNK ? l->head_dim - c0 : KV_CHUNK, c = 0;
                    const uint8_t *row = base + pool_row(l, kv, h, slot) + c0 * e;
#ifdef __AVX2__
                    for (; c + 8 <= w; c += 8) /* NaN lanes keep a8's, as below */
                        a8 = _mm256_max_ps(_mm256_and_ps(load8(row + c * e, j->t, one), abs), a8);
#endif
                    kv_row_load(row + c * e, j->t, w - c, x);
                    for (uint32_t k = 0; k < w - c; k++) {
                        float a = fabsf(x[k]);
                        amax = a > amax ? a : amax;
                    }
                }
    }
#ifdef __AVX2__
    float lanes[8];
    _mm256_storeu_ps(lanes, a8);
    for (uint32_t k = 0; k < 8; k++)
        amax = lanes[k] > amax ? lanes[k] : amax;
#endif
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
#ifdef __AVX2__
                if (G % 8 == 0) {
                    quant_values8(j, blk_base, slot, qb, k0 + i, p);
                    continue;
                }
#endif
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
