/*
 * int8.c - fast CPU INT8 tier kernels (kernels.h "INT8 tier").
 *
 * Quantisation takes each (INT8 block, K/V, head, chunk of channels) group
 * in two passes over its rows, max|x| then codes, converting in registers
 * as it reads (the second pass reads from cache). The AVX2 build takes
 * max|x| of fp16 and bf16 rows on their bits, 16 channels an instruction,
 * and skips the clamp where no quotient can pass 127 (every scale normal);
 * it is bound by vector instructions, not by the division's latency: a
 * reciprocal multiply with an exact check near ties measured slower (the
 * check costs more instructions than the division). Dequantisation steps
 * a run's row addresses; the AVX2 build converts an fp16 row in registers
 * (codes to fp32, the product, cvtps2ph: one pass, 0.61 -> 0.85 of memcpy
 * in bench_kernels), other rows go through a stack buffer. Every
 * per-channel loop runs across channels, so it vectorises. The result equals int8_ref.c byte for
 * byte:
 *  - max|x| does not depend on the order it is taken in, nor on taking it
 *    on the bits of sign-magnitude fp16 / bf16 (finite values);
 *  - s = max/127 and x/s are the same IEEE divisions (no reciprocal);
 *  - round half to even is (y + 1.5·2^23) - 1.5·2^23, exact for
 *    |y| < 2^22 (|x/s| <= 127 here), which is nearbyintf in the default
 *    rounding mode without a libm call per element; the AVX2 build uses
 *    cvtps2dq, which rounds the same way.
 * Quantisation splits over INT8 blocks and dequantisation over tokens
 * (parallel.h); each output byte is written by one thread.
 */
#include <assert.h>
#include <math.h>
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

/* The pool rows of an INT8 block's m tokens in list order, each at byte
 * `off` (K or V, head, first channel) of its token's block: an address is
 * computed once per segment run, then stepped a row at a time. */
typedef struct row_walk {
    kv_cursor cur;
    const uint8_t *pool, *p;
    size_t block_bytes, row, off;
    uint32_t left, run; /* rows still to give; of them, left in this run */
} row_walk;

static row_walk walk_start(const quant_job *j, const kv_cursor *start, uint32_t m, size_t off)
{
    row_walk w = {*start, j->pool, NULL, kv_block_bytes(j->l), kv_row_bytes(j->l), off, m, 0};
    return w;
}

/* The next row, NULL after the last. */
static inline const uint8_t *walk_next(row_walk *w)
{
    if (w->left == 0)
        return NULL;
    if (w->run == 0) {
        uint32_t blk, slot, r = kv_cursor_run(&w->cur, &blk, &slot);
        if (r == 0)
            return NULL;
        kv_cursor_skip(&w->cur, r);
        w->run = r;
        w->p = w->pool + (size_t)blk * w->block_bytes + (size_t)slot * w->row + w->off;
    }
    const uint8_t *p = w->p;
    w->p += w->row;
    w->run--;
    w->left--;
    return p;
}

/* The portable loops, for the generic build and the AVX2 build's last
 * channels: n channels of the row at p (x: room for n floats). */
static void amax_row(const uint8_t *p, kv_dtype t, uint32_t n, float *x, float *amax)
{
    kv_row_load(p, t, n, x);
    for (uint32_t c = 0; c < n; c++) {
        float a = fabsf(x[c]);
        amax[c] = a > amax[c] ? a : amax[c];
    }
}

static void codes_row(const uint8_t *p, kv_dtype t, const float *s, uint32_t n, float *x, int8_t *q)
{
    kv_row_load(p, t, n, x);
    for (uint32_t c = 0; c < n; c++) {
        float r = (x[c] / s[c] + RNE_MAGIC) - RNE_MAGIC;
        /* the reference's clamp, written as min / max (equal for the
         * finite values kernels.h requires) */
        r = r < 127 ? r : 127;
        r = r > -127 ? r : -127;
        q[c] = (int8_t)(int)r;
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* 8 pool elements of type t as fp32: the values kv_row_load gives for the
 * finite elements quantisation requires (F16C for fp16, a shift for bf16),
 * converted in registers. */
static inline __m256 load8(const uint8_t *p, kv_dtype t)
{
    if (t == KV_FP32)
        return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (t == KV_FP16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* amax_row for the first n - n % 8 channels; returns how many it did. */
static uint32_t amax_avx2(const uint8_t *p, kv_dtype t, uint32_t n, float *amax)
{
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    size_t e = t == KV_FP32 ? 4 : 2;
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 a = _mm256_and_ps(load8(p + c * e, t), abs);
        _mm256_storeu_ps(amax + c, _mm256_max_ps(_mm256_loadu_ps(amax + c), a));
    }
    return c;
}

/* For fp16 and bf16 rows: max|x| of the first n - n % 16 channels as the
 * bits of |x| (sign bit cleared), 16 channels an instruction. Both are
 * sign-magnitude, so for the finite values quantisation requires the
 * largest |x| has the largest bits: the max is exact, and it is converted
 * to fp32 once per group (amax_bits_load). Returns how many it did. */
static uint32_t amax16_avx2(const uint8_t *p, uint32_t n, uint16_t *m)
{
    const __m256i mag = _mm256_set1_epi16(0x7fff);
    uint32_t c = 0;
    for (; c + 16 <= n; c += 16) {
        __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 2 * (size_t)c)), mag);
        __m256i *o = (__m256i *)(void *)(m + c);
        _mm256_storeu_si256(o, _mm256_max_epu16(_mm256_loadu_si256(o), v));
    }
    return c;
}

/* codes_row for the first n - n % 32 channels: the same IEEE division,
 * then cvtps2dq, which rounds in the current mode (nearest even by
 * default, as nearbyintf), and the saturating packs, which narrow without
 * change. With `clamp` the quotient is clamped to [-127, 127] in float
 * first, as the portable loop does; without, the caller knows every scale
 * of the group is normal (>= FLT_MIN), so that s = max|x| / 127 is rounded
 * by at most 2^-24 relative and |x / s| <= 127 (1 + 2^-22) rounds to at
 * most 127: the clamp would change nothing. Returns how many channels it
 * did. t and clamp are constants where it is inlined (codes_avx2). */
static inline __attribute__((always_inline)) uint32_t
codes_avx2_t(const uint8_t *p, kv_dtype t, const float *s, uint32_t n, int8_t *q, int clamp)
{
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    size_t e = t == KV_FP32 ? 4 : 2;
    uint32_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m256i v[4];
        for (uint32_t k = 0; k < 4; k++) {
            uint32_t o = c + 8 * k;
            __m256 y = _mm256_div_ps(load8(p + o * e, t), _mm256_loadu_ps(s + o));
            if (clamp)
                y = _mm256_max_ps(_mm256_min_ps(y, hi), lo);
            v[k] = _mm256_cvtps_epi32(y);
        }
        __m256i w =
            _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + c), _mm256_permutevar8x32_epi32(w, order));
    }
    return c;
}

static uint32_t codes_avx2(const uint8_t *p, kv_dtype t, const float *s, uint32_t n, int8_t *q,
                           int clamp)
{
    if (clamp)
        return codes_avx2_t(p, t, s, n, q, 1);
    if (t == KV_FP16)
        return codes_avx2_t(p, KV_FP16, s, n, q, 0);
    if (t == KV_BF16)
        return codes_avx2_t(p, KV_BF16, s, n, q, 0);
    return codes_avx2_t(p, KV_FP32, s, n, q, 0);
}
#endif

/*
 * Scales and codes of channels [c0, c0 + n) of (kv, head h) of the INT8
 * block at qb, whose m tokens start where cursor `start` stands; n <=
 * KV_CHUNK. Two passes over the rows, max|x| then codes, each converting
 * as it reads: the second pass reads from cache, and no tile of the
 * group's floats is kept. The first pass also prefetches the rows of the
 * group that comes next, a row of pf (NULL: none) per row read: the same
 * rows of the next (K/V, head) of the block, or the next block's first
 * group (quant_blocks). The rows of a list are scattered over the pool, so
 * the hardware prefetchers cannot run ahead of them.
 */
/* Byte offset in a pool block of channel c0 of (kv, head h) at slot 0. */
static size_t quant_group_offset(const kv_layout *l, uint32_t kv, uint32_t h, uint32_t c0)
{
    size_t ahead = (size_t)l->block_tokens * kv_row_bytes(l);
    return (kv ? kv_block_bytes(l) / 2 : 0) + h * ahead + (size_t)c0 * l->elt_size;
}

static void quant_group(const quant_job *j, const kv_cursor *start, uint32_t m, uint8_t *qb,
                        uint32_t kv, uint32_t h, uint32_t c0, uint32_t n, row_walk *pf)
{
    const kv_layout *l = j->l;
    size_t off = quant_group_offset(l, kv, h, c0), e = l->elt_size;
    float x[KV_CHUNK], amax[KV_CHUNK], s[KV_CHUNK];
    const uint8_t *p;

    for (uint32_t c = 0; c < n; c++)
        amax[c] = 0;
#ifdef __AVX2__
    uint16_t bits[KV_CHUNK]; /* fp16 / bf16: max |x| as bits, channels [0, c16) */
    uint32_t c16 = j->t == KV_FP32 ? 0 : n & ~15u;
    memset(bits, 0, sizeof bits);
#endif
    row_walk w = walk_start(j, start, m, off);
    while ((p = walk_next(&w)) != NULL) {
        const uint8_t *pp = pf != NULL ? walk_next(pf) : NULL;
        for (size_t b = 0; pp != NULL && b < n * e; b += 64)
            __builtin_prefetch(pp + b);
        uint32_t c = 0;
#ifdef __AVX2__
        c = c16 > 0 ? amax16_avx2(p, c16, bits) : amax_avx2(p, j->t, n, amax);
#endif
        if (c < n)
            amax_row(p + c * e, j->t, n - c, x, amax + c);
    }
#ifdef __AVX2__
    for (uint32_t c = 0; c < c16; c += 8)
        _mm256_storeu_ps(amax + c, load8((const uint8_t *)(bits + c), j->t));
#endif
    /* §5.4: a scale of 0 (an all-zero group, or one that underflows)
     * becomes 1 (a mask select: the loop then vectorises, the division
     * included) */
    for (uint32_t c = 0; c < n; c++) {
        float q = amax[c] / 127.0f;
        s[c] = kv_bits_to_float(
            kv_select(kv_mask(q > 0), kv_float_to_bits(q), kv_float_to_bits(1.0f)));
    }
    memcpy(qb + kv_int8_scale_offset(l, 0, kv, h) + 4 * (size_t)c0, s, 4 * (size_t)n);

    int8_t *q = (int8_t *)qb + kv_int8_code_offset(l, 0, kv, h, 0) + c0;
#ifdef __AVX2__
    uint32_t tiny = 0; /* a scale below FLT_MIN: codes_avx2 must clamp */
    for (uint32_t c = 0; c < n; c++)
        tiny |= kv_mask(s[c] < 0x1p-126f);
#endif
    w = walk_start(j, start, m, off);
    for (; (p = walk_next(&w)) != NULL; q += l->head_dim) {
        uint32_t c = 0;
#ifdef __AVX2__
        c = codes_avx2(p, j->t, s, n, q, tiny != 0);
#endif
        if (c < n)
            codes_row(p + c * e, j->t, s + c, n - c, x, q + c);
    }
}

/* The prefetches for group (g, c0) of a block (g = kv * H + head): the
 * walk over the rows of the group after it, in this block from `cur` (m
 * tokens) or, after the last group, in the next block from `next` (mn
 * tokens, 0 if none). */
static row_walk *pf_walk(const quant_job *j, uint32_t g, uint32_t c0, const kv_cursor *cur,
                         uint32_t m, const kv_cursor *next, uint32_t mn, row_walk *w)
{
    const kv_layout *l = j->l;
    uint32_t H = l->kv_heads;
    if (c0 + KV_CHUNK < l->head_dim)
        *w = walk_start(j, cur, m, quant_group_offset(l, g / H, g % H, c0 + KV_CHUNK));
    else if (g + 1 < 2 * H)
        *w = walk_start(j, cur, m, quant_group_offset(l, (g + 1) / H, (g + 1) % H, 0));
    else if (mn > 0)
        *w = walk_start(j, next, mn, 0);
    else
        return NULL;
    return w;
}

static void quant_blocks(void *ctx, size_t lo, size_t hi)
{
    const quant_job *j = ctx;
    const kv_layout *l = j->l;
    uint32_t T = l->block_tokens, d = l->head_dim, H = l->kv_heads;
    size_t codes = kv_int8_code_offset(l, 0, 1, 0, 0); /* of K (or V): H*T*d */
    size_t scales = kv_int8_scale_offset(l, 0, 0, 0), bytes = kv_int8_block_bytes(l);
    size_t scales_end = scales + 8 * (size_t)H * d;
    kv_cursor cur, next; /* at the first token of block b, b + 1 */
    kv_cursor_init(&cur, j->segs, j->nsegs, lo * T);
    for (size_t b = lo; b < hi; b++, cur = next) {
        size_t first = b * T;
        uint32_t m = j->ntok > first ? (uint32_t)(j->ntok - first < T ? j->ntok - first : T) : 0;
        uint32_t mn = b + 1 < hi && j->ntok > first + T
                          ? (uint32_t)(j->ntok - first - T < T ? j->ntok - first - T : T)
                          : 0;
        uint32_t blk, slot;
        next = cur;
        for (uint32_t i = 0; i < m; i++)
            kv_cursor_next(&next, &blk, &slot);
        uint8_t *qb = j->qpool + kv_int8_code_offset(l, j->qblocks[b], 0, 0, 0);
        memset(qb + 2 * codes, 0, scales - 2 * codes); /* the padding bytes */
        memset(qb + scales_end, 0, bytes - scales_end);
        for (uint32_t g = 0; g < 2 * H; g++) { /* g = kv * H + head */
            uint32_t kv = g / H, h = g % H;
            for (uint32_t c0 = 0; c0 < d; c0 += KV_CHUNK) {
                row_walk w;
                quant_group(j, &cur, m, qb, kv, h, c0, d - c0 < KV_CHUNK ? d - c0 : KV_CHUNK,
                            pf_walk(j, g, c0, &cur, m, &next, mn, &w));
            }
            /* slots past the block's tokens: code 0 */
            memset(qb + kv_int8_code_offset(l, 0, kv, h, m), 0, (size_t)(T - m) * d);
        }
    }
}

void KV_FAST(kv_int8_quantize)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                               const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                               const uint32_t *qblocks, size_t nq)
{
    quant_job j = {l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), qpool, qblocks};
    assert(j.ntok <= nq * (size_t)l->block_tokens);
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
    const kv_layout *dl;
    uint8_t *pool;
    const kv_segment *dst;
    size_t ndst;
} dequant_job;

/* One row of w <= KV_CHUNK channels: x = code * scale in fp32, stored as t
 * through a stack buffer. */
static void dequant_row(const int8_t *q, const float *s, uint32_t w, kv_dtype t, uint8_t *out)
{
    float buf[KV_CHUNK];
    for (uint32_t i = 0; i < w; i++)
        buf[i] = (float)q[i] * s[i];
    kv_row_store(out, t, w, buf);
}

#ifdef __AVX2__
/* Whether the w scales at s (w a multiple of 8) are all finite: then no
 * product code * s is NaN (codes are integers), whose payload only the
 * portable conversion gives as the reference does. */
static int scales_finite(const float *s, uint32_t w)
{
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 bad = _mm256_setzero_ps();
    for (uint32_t c = 0; c < w; c += 8) {
        __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(s + c));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* |s| >= inf, or NaN */
    }
    return _mm256_testz_ps(bad, bad);
}

/* n rows of w channels (a multiple of 16), codes q (rows qpitch apart) to
 * fp16 out (rows opitch bytes apart), in registers: the same fp32 products
 * as dequant_row, rounded by cvtps2ph as kv_f16_store_f16c rounds them.
 * The scales s are finite (scales_finite) and read in place. */
static void dequant_rows_f16(const int8_t *q, size_t qpitch, const float *s, uint32_t w,
                             uint8_t *out, size_t opitch, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++, q += qpitch, out += opitch)
        for (uint32_t c = 0; c < w; c += 16) {
            __m128i b0 = _mm_loadl_epi64((const __m128i *)(const void *)(q + c));
            __m128i b1 = _mm_loadl_epi64((const __m128i *)(const void *)(q + c + 8));
            __m256 x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
            __m256 x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
            x0 = _mm256_mul_ps(x0, _mm256_loadu_ps(s + c));
            x1 = _mm256_mul_ps(x1, _mm256_loadu_ps(s + c + 8));
            __m128i *o = (__m128i *)(void *)(out + 2 * (size_t)c);
            _mm_storeu_si128(o, _mm256_cvtps_ph(x0, _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128(o + 1, _mm256_cvtps_ph(x1, _MM_FROUND_TO_NEAREST_INT));
        }
}
#endif

/* n tokens from INT8 (qb, qs..) to pool (db, ds..): per (kv, head, chunk)
 * the scales are read once for the whole run, and both rows' addresses are
 * computed once and stepped a token at a time. */
static void dequant_run(const void *ctx, uint32_t qb, uint32_t qs, uint32_t db, uint32_t ds,
                        uint32_t n)
{
    const dequant_job *j = ctx;
    const kv_layout *l = j->l, *dl = j->dl;
    size_t half = kv_block_bytes(dl) / 2, row = kv_row_bytes(dl), e = dl->elt_size;
    float s[KV_CHUNK];
    for (uint32_t kv = 0; kv < 2; kv++)
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            const int8_t *q0 = (const int8_t *)j->qpool + kv_int8_code_offset(l, qb, kv, h, qs);
            const uint8_t *sc = j->qpool + kv_int8_scale_offset(l, qb, kv, h);
            uint8_t *out0 = j->pool + kv_key_offset(dl, db, h, ds) + (kv ? half : 0);
            for (uint32_t c0 = 0; c0 < l->head_dim; c0 += KV_CHUNK) {
                uint32_t w = l->head_dim - c0 < KV_CHUNK ? l->head_dim - c0 : KV_CHUNK;
#ifdef __AVX2__
                /* scales are 4-byte aligned (kernels.h "INT8 tier") */
                const float *sp = (const float *)(const void *)(sc + 4 * (size_t)c0);
                if (j->t == KV_FP16 && w % 16 == 0 && scales_finite(sp, w)) {
                    dequant_rows_f16(q0 + c0, l->head_dim, sp, w, out0 + c0 * e, row, n);
                    continue;
                }
#endif
                memcpy(s, sc + 4 * (size_t)c0, 4 * (size_t)w);
                for (uint32_t i = 0; i < n; i++)
                    dequant_row(q0 + (size_t)i * l->head_dim + c0, s, w, j->t,
                                out0 + i * row + c0 * e);
            }
        }
}

static void dequant_tokens(void *ctx, size_t lo, size_t hi)
{
    const dequant_job *j = ctx;
    kv_walk_pairs(j->qsegs, j->nqsegs, j->dst, j->ndst, lo, hi, dequant_run, j);
}

void KV_FAST(kv_int8_dequantize)(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                                 size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                                 const kv_segment *dst, size_t ndst)
{
    dequant_job j = {l, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst};
    size_t a = kv_segments_tokens(qsegs, nqsegs), b = kv_segments_tokens(dst, ndst);
    size_t n = a < b ? a : b;
    size_t bytes = n * 2 * (size_t)l->kv_heads * l->head_dim * (1 + dl->elt_size);
    kv_parallel_for(n, bytes, dequant_tokens, &j);
}
