/*
 * attention.c - the fast CPU decode attention (kernels.h
 * kv_decode_attention): what a worker runs to read its cache through the
 * store's table, whatever the policy did to the list, INT8 segments
 * included. The reference is attention_ref.c.
 *
 * The list is walked by chunks of up to ATTN_CHUNK tokens with an online
 * softmax per query head (Milakov & Gimelshein 2018; FlashAttention's
 * running max and sum): per chunk the running sum and accumulator are
 * rescaled once. For each KV head, a chunk's K and V rows are converted to
 * fp32 once and serve every query head of its group: into two stack tiles
 * in the generic build (INT8 as code * scale), in registers in the AVX2
 * build (fp16 with F16C; INT8 rows as their codes, the per-channel scales
 * of their INT8 block folded out of the inner loops: the query is
 * multiplied by the K scale row once per block, and the V accumulation sums
 * p * code over the block's tokens before one multiplication by the V
 * scale row). One walk takes up to ATTN_STATE query heads, KV
 * head after KV head per chunk (a "step" is one KV head of one chunk), so a
 * chunk's blocks are read nearly in order. A list's blocks are scattered
 * over the pool, which the hardware prefetchers cannot follow: each step
 * prefetches the rows of the step ATTN_AHEAD later, a few lines at a time
 * between its own arithmetic (pf_queue), so that memory and arithmetic
 * overlap; one burst of prefetches measured no faster than none.
 *
 * Scores are 8-lane dot products, ATTN_HB query heads by two tokens at a
 * time (each K load serves four heads, each query load two tokens); the V
 * accumulation runs channel-outer for ATTN_HB heads at once, 16 channels of
 * each in registers over the chunk's tokens. Both use fused multiply-adds
 * (the AVX2 build is compiled with -mfma and dispatched only on CPUs with
 * FMA; isa.h). exp is a vectorised polynomial without FMA. The generic
 * build multiplies and adds separately (ATTN_MADD): fmaf there would be a
 * libm call per multiply-add on x86-64 (50 -> 327 ms a call), so the two
 * builds differ in the last bits, each within the reference's tolerance
 * (kernels.h); the attention is the one kernel whose builds are not
 * bit-identical. No scratch of the list's length: the
 * accumulator is `out` itself, and with probs asked for the raw scores go
 * into probs and are normalised at the end.
 *
 * Chunks are runs of the list's tokens whose length depends on head_dim
 * and on the tokens' tiers and blocks (a chunk does not split an INT8
 * block's tokens when it can help it: next_chunk), wherever the segment
 * boundaries fall: the same tokens give the
 * same bits in one segment or many, in the pool layout or in a per-head
 * list's rows. (An INT8 list does not give the bits of its dequantised copy:
 * the scales are applied in another order; both stay within the reference's
 * tolerance.) INT4 and INT2 rows (kernels.h "Low-bit tiers") are
 * dequantised into an fp32 tile per step, exactly as the reference reads
 * them, and attended as fp32 rows. Large calls split their query heads over threads
 * (parallel.h); each head's arithmetic is the same whatever the split.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "../elt.h"
#include "../lowbit.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"

#define ATTN_CHUNK 32u  /* tokens per chunk at most: their scores live on the stack */
#define ATTN_TILE 4096u /* floats of a chunk's K (or V) tile; a longer row takes the reference */
#define ATTN_HEADS 16u  /* query heads of one KV head per unit of work */
#define ATTN_STATE 64u  /* query heads per walk over the list */
#define ATTN_HB 4u      /* query heads folded together: a K or V load serves them all */
#define ATTN_AHEAD 2u   /* steps (a KV head of a chunk) from a row's prefetch to its read */
#define KV_LOWBIT_ROW_PARAMS 256u /* key parameters of a low-bit row read per pass */

typedef struct attn_job {
    const kv_layout *l;
    kv_layout q8;     /* the INT8 block an INT8 segment's block holds */
    kv_layout q4, q2; /* the INT4 / INT2 blocks */
    kv_dtype t;
    const uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs, n;
    const uint8_t *tiers;
    const float *q;
    uint32_t q_heads, group, batches;
    float scale;
    float *out, *probs;
} attn_job;

/* A token of the current chunk: its tier, block and slot. */
typedef struct chunk_tok {
    uint8_t tier;
    uint32_t block, slot;
} chunk_tok;

/* Where one token's K and V rows are: elements of type t, or INT8 codes
 * with their blocks' scale rows (ks != NULL). */
typedef struct attn_row {
    const uint8_t *k, *v, *ks, *vs;
} attn_row;

/* Offsets inside a block of KV head g's rows at slot 0, per tier. */
typedef struct head_rows {
    uint32_t g;                    /* the KV head */
    size_t block_bytes, k, v, row; /* full precision */
    size_t qk, qv, qks, qvs, qrow; /* INT8 */
} head_rows;

static head_rows head_rows_of(const attn_job *j, uint32_t g)
{
    const kv_layout *l = j->l;
    head_rows r;
    r.g = g;
    r.block_bytes = kv_block_bytes(l);
    r.k = kv_key_offset(l, 0, g, 0);
    r.v = r.k + r.block_bytes / 2;
    r.row = (size_t)l->head_dim * l->elt_size;
    r.qk = kv_int8_code_offset(&j->q8, 0, 0, g, 0);
    r.qv = kv_int8_code_offset(&j->q8, 0, 1, g, 0);
    r.qks = kv_int8_scale_offset(&j->q8, 0, 0, g);
    r.qvs = kv_int8_scale_offset(&j->q8, 0, 1, g);
    r.qrow = l->head_dim;
    return r;
}

static attn_row row_at(const attn_job *j, const head_rows *hr, uint8_t tier, uint32_t block,
                       uint32_t slot)
{
    const uint8_t *b = j->pool + (size_t)block * hr->block_bytes;
    if (tier == KV_TIER_FULL) {
        size_t o = (size_t)slot * hr->row;
        return (attn_row){b + hr->k + o, b + hr->v + o, NULL, NULL};
    }
    size_t o = (size_t)slot * hr->qrow;
    return (attn_row){b + hr->qk + o, b + hr->qv + o, b + hr->qks, b + hr->qvs};
}

static int tier_lowbit(uint8_t tier)
{
    return tier == KV_TIER_INT4 || tier == KV_TIER_INT2;
}

/* n codes of `bits` bits, packed low bits first from channel 0, one a byte
 * (n a multiple of 8 / bits within the row's bytes). A loop per width with
 * constant shifts: the generic one (a shift by (c & lanes) * bits) was most
 * of a low-bit attention's time. */
#define LOWBIT_CODES (KV_LOWBIT_ROW_PARAMS + 4) /* a chunk's codes, rounded up to a byte */

static void lowbit_unpack(const uint8_t *restrict row, uint32_t n, uint32_t bits,
                          uint8_t codes[restrict LOWBIT_CODES])
{
    n = n < LOWBIT_CODES ? n : LOWBIT_CODES; /* the callers' bound, spelled out for the compiler */
    if (bits == 4) {
        for (uint32_t i = 0; i < n / 2; i++) {
            codes[2 * i] = row[i] & 15u;
            codes[2 * i + 1] = row[i] >> 4;
        }
        return;
    }
    for (uint32_t i = 0; i < n / 4; i++) {
        codes[4 * i] = row[i] & 3u;
        codes[4 * i + 1] = (row[i] >> 2) & 3u;
        codes[4 * i + 2] = (row[i] >> 4) & 3u;
        codes[4 * i + 3] = row[i] >> 6;
    }
}

/* x[c] = kv_lowbit_value(codes[c], s[c], z[c], p2) for n channels: the same
 * operations (code·s, + z, ·2^e; no fused multiply-add: ISO C), in a loop
 * that vectorises. */
static void lowbit_values(const uint8_t *restrict codes, const float *restrict s,
                          const float *restrict z, float p2, uint32_t n, float *restrict x)
{
    for (uint32_t c = 0; c < n; c++) {
        float m = (float)codes[c] * s[c];
        x[c] = (m + z[c]) * p2;
    }
}

/*
 * The K (v = 0) or V row of KV head g of a low-bit token as d floats:
 * kv_lowbit_value of each code with its group's parameters, by chunks of
 * KV_LOWBIT_ROW_PARAMS channels: codes unpacked a byte each, the fp16
 * parameters widened with kv_row_load (F16C in the AVX2 build), then one
 * vector loop.
 */
static void lowbit_row_load(const attn_job *j, uint32_t g, const chunk_tok *tok, int v, float *x)
{
    uint32_t bits = tok->tier == KV_TIER_INT4 ? 4 : 2;
    const kv_layout *q = bits == 4 ? &j->q4 : &j->q2;
    uint32_t G = kv_lowbit_group(q), d = q->head_dim, nv = (d + G - 1) / G, slot = tok->slot;
    const uint8_t *qb = j->pool + (size_t)tok->block * kv_block_bytes(j->l);
    const uint8_t *row = qb + kv_lowbit_code_offset(q, bits, 0, (uint32_t)v, g, slot);
    uint8_t codes[LOWBIT_CODES];
    float s[KV_LOWBIT_ROW_PARAMS], z[KV_LOWBIT_ROW_PARAMS];
    int32_t e;
    memcpy(&e, qb + kv_lowbit_shift_offset(q, bits, 0), 4);
    float p2 = kv_lowbit_pow2(e);
    const uint8_t *kp = qb + kv_lowbit_key_params_offset(q, bits, 0, g, slot / G);
    const uint8_t *vp = qb + kv_lowbit_value_params_offset(q, bits, 0, g, slot);
    for (uint32_t c0 = 0; c0 < d; c0 += KV_LOWBIT_ROW_PARAMS) {
        uint32_t w = d - c0 < KV_LOWBIT_ROW_PARAMS ? d - c0 : KV_LOWBIT_ROW_PARAMS;
        uint32_t per = 8 / bits, nbytes = (w + per - 1) / per;
        lowbit_unpack(row + (size_t)c0 * bits / 8, nbytes * per, bits, codes);
        if (!v) {
            kv_row_load(kp + 2 * (size_t)c0, KV_FP16, w, s);
            kv_row_load(kp + 2 * ((size_t)d + c0), KV_FP16, w, z);
        } else {
            for (uint32_t c = 0; c < w;) { /* each group's parameters over its channels */
                uint32_t k = (c0 + c) / G, end = (k + 1) * G - c0;
                uint16_t hs, hz;
                memcpy(&hs, vp + 2 * (size_t)k, 2);
                memcpy(&hz, vp + 2 * ((size_t)nv + k), 2);
                float sf = kv_half_to_float(hs), zf = kv_half_to_float(hz);
                for (end = end < w ? end : w; c < end; c++) {
                    s[c] = sf;
                    z[c] = zf;
                }
            }
        }
        lowbit_values(codes, s, z, p2, w, x + c0);
    }
}

/* d floats of an INT8 row: code * scale in fp32 (kv_dequantize_group_ref). */
static void int8_row_load(const uint8_t *restrict codes, const uint8_t *restrict scales, uint32_t d,
                          float *restrict x)
{
    for (uint32_t c = 0; c < d; c++) {
        float s;
        memcpy(&s, scales + 4 * (size_t)c, 4);
        x[c] = (float)(int8_t)codes[c] * s;
    }
}

/*
 * x[i] = e^x[i] for x[i] <= 0 (the softmax's exponents: scores minus their
 * running max), in a loop that vectorises: Cody-Waite reduction by ln 2
 * and Cephes' expf polynomial (relative error about 2e-7), its Horner steps
 * fused multiply-adds in the AVX2 build (EXP_MADD). Below
 * -87 (e^x under FLT_MIN) it gives 0, where expf gives a subnormal.
 */
#ifdef __AVX2__
#define EXP_MADD(a, b, c) fmaf(a, b, c) /* one vfmadd: the AVX2 build has FMA */
#else
#define EXP_MADD(a, b, c) ((a) * (b) + (c))
#endif
static void exp_nonpos(float *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t low = kv_mask(x[i] < -87.0f); /* selects as masks: the loop vectorises */
        float v =
            kv_bits_to_float(kv_select(low, kv_float_to_bits(-87.0f), kv_float_to_bits(x[i])));
        float k = (v * 1.44269504089f + 12582912.0f) - 12582912.0f; /* rne(v / ln 2) */
        float r = (v - k * 0.693359375f) - k * -2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = EXP_MADD(p, r, 1.3981999507e-3f);
        p = EXP_MADD(p, r, 8.3334519073e-3f);
        p = EXP_MADD(p, r, 4.1665795894e-2f);
        p = EXP_MADD(p, r, 1.6666665459e-1f);
        p = EXP_MADD(p, r, 5.0000001201e-1f);
        p = EXP_MADD(p, r * r, r) + 1.0f;
        float two_k = kv_bits_to_float((uint32_t)((int32_t)k + 127) << 23);
        x[i] = kv_bits_to_float(kv_select(low, 0u, kv_float_to_bits(p * two_k)));
    }
}

/* Prefetches of the rows a later step reads, issued a few lines at a time
 * between the arithmetic of the current step, so that the memory works
 * while the core computes (a burst of them stalls the loads behind it). */
typedef struct pf_queue {
    /* byte ranges [lo, hi): runs of K rows, then of V rows (adjacent slots
     * of a block are one run), INT8 scale rows once per block */
    const uint8_t *lo[4 * ATTN_CHUNK], *hi[4 * ATTN_CHUNK];
    const uint8_t *at;  /* the next line of range i */
    uint32_t n, i, per; /* ranges, current range, lines per call */
} pf_queue;

static void pf_issue(pf_queue *q)
{
    uint32_t m = q->per;
    while (m > 0 && q->i < q->n) {
        const uint8_t *p = q->at, *end = q->hi[q->i];
        for (; m > 0 && p < end; m--, p += 64)
            __builtin_prefetch(p, 0, 2); /* locality 2: L2 and up */
        if (p < end) {
            q->at = p;
            return;
        }
        if (++q->i < q->n)
            q->at = (const uint8_t *)((uintptr_t)q->lo[q->i] & ~(uintptr_t)63);
    }
}

/* Append [p, p + bytes) to ranges lo/hi (*n of them), extending the last
 * one when it ends at p. */
static void pf_add(const uint8_t **lo, const uint8_t **hi, uint32_t *n, const uint8_t *p,
                   size_t bytes)
{
    if (*n > 0 && hi[*n - 1] == p) {
        hi[*n - 1] = p + bytes;
        return;
    }
    lo[*n] = p;
    hi[(*n)++] = p + bytes;
}

#ifndef __AVX2__
/* ---- generic build: the chunk's rows converted into fp32 tiles ---- */

/* One step's K and V rows as fp32 tiles [cnt][d]. */
typedef struct step {
    float kt[ATTN_TILE], vt[ATTN_TILE];
} step;

/* K (v = 0) or V (v = 1) rows of a chunk into tile [cnt][d]. */
static void load_tile(const attn_job *j, const head_rows *hr, const chunk_tok *toks,
                      const attn_row *rows, uint32_t cnt, int v, float *tile)
{
    uint32_t d = j->l->head_dim;
    for (uint32_t i = 0; i < cnt; i++) {
        float *x = tile + (size_t)i * d;
        if (tier_lowbit(toks[i].tier))
            lowbit_row_load(j, hr->g, &toks[i], v, x);
        else if (rows[i].ks == NULL)
            kv_row_load(v ? rows[i].v : rows[i].k, j->t, d, x);
        else
            int8_row_load(v ? rows[i].v : rows[i].k, v ? rows[i].vs : rows[i].ks, d, x);
    }
}

/* The K and V tiles of a KV head (its rows hr) for the chunk's cnt tokens. */
static void step_load(const attn_job *j, const head_rows *hr, const chunk_tok *toks, uint32_t cnt,
                      step *s)
{
    attn_row rows[ATTN_CHUNK];
    for (uint32_t i = 0; i < cnt; i++)
        if (!tier_lowbit(toks[i].tier))
            rows[i] = row_at(j, hr, toks[i].tier, toks[i].block, toks[i].slot);
    load_tile(j, hr, toks, rows, cnt, 0, s->kt);
    load_tile(j, hr, toks, rows, cnt, 1, s->vt);
}

/* a.b in 8 lanes: lane k sums a[c] * b[c] over channels c = k mod 8 in
 * order, then the lanes add as ((0+4) + (2+6)) + ((1+5) + (3+7)). */
static float dot8(const float *restrict a, const float *restrict b, uint32_t d)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t c = 0;
    for (; c + 8 <= d; c += 8)
        for (uint32_t k = 0; k < 8; k++)
            l[k] = a[c + k] * b[c + k] + l[k];
    for (uint32_t k = 0; c + k < d; k++)
        l[k] = a[c + k] * b[c + k] + l[k];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* acc[c] += p[i] * vt[i][c] for the chunk's tokens i in order, 8 channels
 * at a time (a loop gcc vectorises). */
static void accumulate(float *restrict acc, const float *restrict vt, const float *restrict p,
                       uint32_t cnt, uint32_t d)
{
    uint32_t c = 0;
    for (; c + 8 <= d; c += 8) {
        float r[8];
        memcpy(r, acc + c, sizeof r);
        for (uint32_t i = 0; i < cnt; i++)
            for (uint32_t k = 0; k < 8; k++)
                r[k] = p[i] * vt[(size_t)i * d + c + k] + r[k];
        memcpy(acc + c, r, sizeof r);
    }
    for (; c < d; c++) {
        float r = acc[c];
        for (uint32_t i = 0; i < cnt; i++)
            r = p[i] * vt[(size_t)i * d + c] + r;
        acc[c] = r;
    }
}

/* The chunk's cnt raw scores q.k * scale of nh <= ATTN_HB query heads (rows
 * d floats apart from q): sc[h * ATTN_CHUNK + i]. */
static void scores(const float *q, uint32_t nh, const step *s, uint32_t cnt, uint32_t d,
                   float scale, float *sc, pf_queue *pf)
{
    for (uint32_t h = 0; h < nh; h++) {
        for (uint32_t t = 0; t < cnt; t++)
            sc[h * ATTN_CHUNK + t] = dot8(q + (size_t)h * d, s->kt + (size_t)t * d, d) * scale;
        pf_issue(pf);
    }
}

/* acc rows (d floats apart) of nh <= ATTN_HB heads += their weights p
 * (rows ATTN_CHUNK apart) times the chunk's V rows. */
static void accumulate_heads(float *acc, uint32_t nh, const step *s, const float *p, uint32_t cnt,
                             uint32_t d, pf_queue *pf)
{
    for (uint32_t h = 0; h < nh; h++) {
        accumulate(acc + (size_t)h * d, s->vt, p + h * ATTN_CHUNK, cnt, d);
        pf_issue(pf);
    }
}

#else
/* ---- AVX2 + F16C + FMA build: rows converted in registers as they are read ---- */
#include <immintrin.h>

#define ATTN_INLINE static inline __attribute__((always_inline))

/* How a row's elements become fp32: the pool's dtype, or an INT8 row's
 * codes (its scales are applied per run, below). */
enum { ROW_F32, ROW_F16, ROW_BF16, ROW_I8 };

/* Consecutive tokens of a step read the same way: full-precision tokens,
 * or INT8 tokens of one INT8 block (one K and one V scale row). */
typedef struct row_run {
    uint32_t i0, i1; /* tokens [i0, i1) of the step */
    int kind;
    const uint8_t *ks, *vs; /* ROW_I8: the block's scale rows */
} row_run;

/* One step's rows: where each token's K and V are, by runs. */
typedef struct step {
    const uint8_t *k[ATTN_CHUNK], *v[ATTN_CHUNK];
    row_run run[ATTN_CHUNK];
    uint32_t nruns;
    float vtail[ATTN_CHUNK][8];         /* the V rows' last d % 8 channels, dequantised */
    float lk[ATTN_TILE], lv[ATTN_TILE]; /* low-bit tokens' rows, dequantised (fp32 rows) */
} step;

/* Channels [c, c + 8) of a row as fp32: fp16 and bf16 widen exactly, an
 * INT8 row gives its codes (exact in fp32). */
ATTN_INLINE __m256 ld8(const uint8_t *row, uint32_t c, int kind)
{
    switch (kind) {
    case ROW_F32:
        return _mm256_loadu_ps((const float *)(const void *)(row + 4 * (size_t)c));
    case ROW_F16:
        return _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * (size_t)c)));
    case ROW_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * (size_t)c));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    default: {
        __m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(row + c));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
    }
}

/* n < 8 elements of a row from channel c, as ld8 gives them (an INT8 row:
 * its codes). */
static void row_tail(const uint8_t *row, int kind, uint32_t c, uint32_t n, float *x)
{
    if (kind == ROW_I8)
        for (uint32_t k = 0; k < n; k++)
            x[k] = (float)(int8_t)row[c + k];
    else if (kind == ROW_F32)
        kv_row_load(row + (size_t)c * 4, KV_FP32, n, x);
    else
        kv_row_load(row + (size_t)c * 2, kind == ROW_F16 ? KV_FP16 : KV_BF16, n, x);
}

/* The rows of a KV head (its rows hr) for the chunk's cnt tokens, cut into
 * runs; the V rows' tails dequantised (code * scale). */
static void step_load(const attn_job *j, const head_rows *hr, const chunk_tok *toks, uint32_t cnt,
                      step *s)
{
    int full = j->t == KV_FP32 ? ROW_F32 : j->t == KV_FP16 ? ROW_F16 : ROW_BF16;
    uint32_t d = j->l->head_dim, c = d & ~7u;
    s->nruns = 0;
    for (uint32_t i = 0; i < cnt; i++) {
        attn_row r;
        int kind;
        if (tier_lowbit(toks[i].tier)) {
            float *k = s->lk + (size_t)i * d, *v = s->lv + (size_t)i * d;
            lowbit_row_load(j, hr->g, &toks[i], 0, k);
            lowbit_row_load(j, hr->g, &toks[i], 1, v);
            r = (attn_row){(const uint8_t *)k, (const uint8_t *)v, NULL, NULL};
            kind = ROW_F32;
        } else {
            r = row_at(j, hr, toks[i].tier, toks[i].block, toks[i].slot);
            kind = r.ks != NULL ? ROW_I8 : full;
        }
        s->k[i] = r.k;
        s->v[i] = r.v;
        row_run *last = s->nruns > 0 ? &s->run[s->nruns - 1] : NULL;
        if (last != NULL && last->kind == kind && last->ks == r.ks)
            last->i1 = i + 1;
        else
            s->run[s->nruns++] = (row_run){i, i + 1, kind, r.ks, r.vs};
        if (c < d && kind == ROW_I8)
            int8_row_load(r.v + c, r.vs + 4 * (size_t)c, d - c, s->vtail[i]);
        else if (c < d)
            row_tail(r.v, kind, c, d - c, s->vtail[i]);
    }
}

/* The sums of 8 chains of 8 lanes: lane m of the result is v[m]'s lanes
 * added as ((0+1) + (2+3)) + ((4+5) + (6+7)), whatever the other chains. */
static inline __m256 hsum8x8(const __m256 *v)
{
    __m256 ab = _mm256_hadd_ps(v[0], v[1]), cd = _mm256_hadd_ps(v[2], v[3]);
    __m256 ef = _mm256_hadd_ps(v[4], v[5]), gh = _mm256_hadd_ps(v[6], v[7]);
    __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
    return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                         _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

/*
 * Scores of H query heads (rows d floats apart from q) against T tokens
 * i0 .. i0 + T - 1 of one run, q.k * scale, the K rows converted in
 * registers: each K load serves the H heads, each query load the T tokens,
 * H * T independent chains of 8 lanes (lane k: channels k mod 8 in order,
 * then the last d % 8 channels one per lane; the lanes added by hsum8x8).
 * out[h * ATTN_CHUNK + i]. For an INT8 run q is the query times the K
 * scale row (scores_run), the rows its codes. Each (head, token) gets the
 * same operations whatever H and T.
 */
ATTN_INLINE void qk_block(const float *q, uint32_t d, const step *s, uint32_t i0, float scale,
                          float *out, int H, int T, int kind)
{
    __m256 acc[8]; /* chain h * 2 + t; the unused ones stay 0 */
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++)
        acc[m] = _mm256_setzero_ps();
    uint32_t c = 0;
    for (; c + 8 <= d; c += 8) {
        __m256 x[2];
#pragma GCC unroll 2
        for (int t = 0; t < T; t++)
            x[t] = ld8(s->k[i0 + t], c, kind);
#pragma GCC unroll 4
        for (int h = 0; h < H; h++) {
            __m256 a = _mm256_loadu_ps(q + (size_t)h * d + c);
#pragma GCC unroll 2
            for (int t = 0; t < T; t++)
                acc[h * 2 + t] = _mm256_fmadd_ps(a, x[t], acc[h * 2 + t]);
        }
    }
    for (int t = 0; t < T && c < d; t++) {
        float kb[8], l[8];
        row_tail(s->k[i0 + t], kind, c, d - c, kb);
        for (int h = 0; h < H; h++) {
            const float *qh = q + (size_t)h * d + c;
            _mm256_storeu_ps(l, acc[h * 2 + t]);
            for (uint32_t k = 0; k < d - c; k++)
                l[k] = fmaf(qh[k], kb[k], l[k]);
            acc[h * 2 + t] = _mm256_loadu_ps(l);
        }
    }
    float r[8];
    _mm256_storeu_ps(r, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++)
            out[h * ATTN_CHUNK + i0 + t] = r[h * 2 + t];
}

/*
 * acc rows (d floats apart) of H heads += their weights p (rows ATTN_CHUNK
 * apart) times the V rows of one run's tokens, channels [c, c + 8 * NB), the
 * tokens in order: each V load serves the H heads. An INT8 run sums p times
 * the codes over its tokens and multiplies that by the V scale row once, at
 * the run's end (the scale is the block's: sum_i p_i * code_i * s =
 * s * sum_i p_i * code_i). (The unroll pragmas here and in qk_block keep
 * the accumulators in registers: without them gcc 12 stored them to the
 * stack on every token, 30% slower.)
 */
ATTN_INLINE void av_block(float *acc, uint32_t d, const step *s, const float *p, const row_run *ru,
                          uint32_t c, int H, int NB, int kind)
{
    __m256 r[ATTN_HB][2];
    uint32_t i0 = ru->i0, i1 = ru->i1;
#pragma GCC unroll 4
    for (int h = 0; h < H; h++)
#pragma GCC unroll 2
        for (int k = 0; k < NB; k++)
            r[h][k] = kind == ROW_I8 ? _mm256_setzero_ps()
                                     : _mm256_loadu_ps(acc + (size_t)h * d + c + 8 * k);
    for (uint32_t i = i0; i < i1; i++) {
        __m256 v[2];
#pragma GCC unroll 2
        for (int k = 0; k < NB; k++)
            v[k] = ld8(s->v[i], c + 8 * k, kind);
#pragma GCC unroll 4
        for (int h = 0; h < H; h++) {
            __m256 pi = _mm256_broadcast_ss(p + h * ATTN_CHUNK + i);
#pragma GCC unroll 2
            for (int k = 0; k < NB; k++)
                r[h][k] = _mm256_fmadd_ps(pi, v[k], r[h][k]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < H; h++)
#pragma GCC unroll 2
        for (int k = 0; k < NB; k++) {
            float *a = acc + (size_t)h * d + c + 8 * k;
            if (kind == ROW_I8)
                r[h][k] = _mm256_fmadd_ps(
                    r[h][k],
                    _mm256_loadu_ps(
                        (const float *)(const void *)(ru->vs + 4 * ((size_t)c + 8 * k))),
                    _mm256_loadu_ps(a));
            _mm256_storeu_ps(a, r[h][k]);
        }
}

/* qk_block and av_block for each (H, T or NB), the kind of the run a
 * constant in each case: no branch in their inner loops. */
#define ATTN_BY_KIND(CALL, kind, ...)                                                              \
    switch (kind) {                                                                                \
    case ROW_F32:                                                                                  \
        CALL(__VA_ARGS__, ROW_F32);                                                                \
        break;                                                                                     \
    case ROW_F16:                                                                                  \
        CALL(__VA_ARGS__, ROW_F16);                                                                \
        break;                                                                                     \
    case ROW_BF16:                                                                                 \
        CALL(__VA_ARGS__, ROW_BF16);                                                               \
        break;                                                                                     \
    default:                                                                                       \
        CALL(__VA_ARGS__, ROW_I8);                                                                 \
    }

#define QK_FN(H, T)                                                                                \
    static void qk##H##x##T(const float *q, uint32_t d, const step *s, uint32_t i0, float scale,   \
                            float *out, int kind)                                                  \
    {                                                                                              \
        ATTN_BY_KIND(qk_block, kind, q, d, s, i0, scale, out, H, T)                                \
    }
#define AV_FN(H, NB)                                                                               \
    static void av##H##x##NB(float *acc, uint32_t d, const step *s, const float *p,                \
                             const row_run *ru, uint32_t c)                                        \
    {                                                                                              \
        ATTN_BY_KIND(av_block, ru->kind, acc, d, s, p, ru, c, H, NB)                               \
    }
QK_FN(1, 1)
QK_FN(1, 2)
QK_FN(2, 1)
QK_FN(2, 2)
QK_FN(3, 1)
QK_FN(3, 2)
QK_FN(4, 1)
QK_FN(4, 2)
AV_FN(1, 1)
AV_FN(1, 2)
AV_FN(2, 1)
AV_FN(2, 2)
AV_FN(3, 1)
AV_FN(3, 2)
AV_FN(4, 1)
AV_FN(4, 2)

typedef void (*qk_fn)(const float *, uint32_t, const step *, uint32_t, float, float *, int);
typedef void (*av_fn)(float *, uint32_t, const step *, const float *, const row_run *, uint32_t);
static const qk_fn k_qk[ATTN_HB][2] = {
    {qk1x1, qk1x2}, {qk2x1, qk2x2}, {qk3x1, qk3x2}, {qk4x1, qk4x2}};
static const av_fn k_av[ATTN_HB][2] = {
    {av1x1, av1x2}, {av2x1, av2x2}, {av3x1, av3x2}, {av4x1, av4x2}};

/* The chunk's cnt raw scores q.k * scale of nh <= ATTN_HB query heads (rows
 * d floats apart from q): sc[h * ATTN_CHUNK + i]. Run by run, two tokens at
 * a time; an INT8 run multiplies the query by its block's K scale row
 * once (qs = q * s_k, then qs.code: the scale folded out of the loop). */
static void scores(const float *q, uint32_t nh, const step *s, uint32_t cnt, uint32_t d,
                   float scale, float *sc, pf_queue *pf)
{
    float qs[ATTN_HB * ATTN_TILE];
    (void)cnt;
    for (uint32_t r = 0; r < s->nruns; r++) {
        const row_run *ru = &s->run[r];
        const float *qq = q;
        if (ru->kind == ROW_I8) {
            for (uint32_t h = 0; h < nh; h++) {
                const float *qh = q + (size_t)h * d;
                float *o = qs + (size_t)h * d;
                uint32_t c = 0;
                for (; c + 8 <= d; c += 8)
                    _mm256_storeu_ps(
                        o + c,
                        _mm256_mul_ps(_mm256_loadu_ps(qh + c),
                                      _mm256_loadu_ps(
                                          (const float *)(const void *)(ru->ks + 4 * (size_t)c))));
                for (; c < d; c++) {
                    float sk;
                    memcpy(&sk, ru->ks + 4 * (size_t)c, 4);
                    o[c] = qh[c] * sk;
                }
            }
            qq = qs;
        }
        uint32_t i = ru->i0;
        for (; i + 2 <= ru->i1; i += 2) {
            k_qk[nh - 1][1](qq, d, s, i, scale, sc, ru->kind);
            pf_issue(pf);
        }
        if (i < ru->i1)
            k_qk[nh - 1][0](qq, d, s, i, scale, sc, ru->kind);
    }
}

/* acc rows (d floats apart) of nh <= ATTN_HB heads += their weights p
 * (rows ATTN_CHUNK apart) times the chunk's V rows: 16 channels at a time,
 * then 8 (run by run), then the last d % 8 one by one from the dequantised
 * tails (the same fused multiply-adds, in the same token order). */
static void accumulate_heads(float *acc, uint32_t nh, const step *s, const float *p, uint32_t cnt,
                             uint32_t d, pf_queue *pf)
{
    uint32_t c = 0;
    for (; c + 16 <= d; c += 16) {
        for (uint32_t r = 0; r < s->nruns; r++)
            k_av[nh - 1][1](acc, d, s, p, &s->run[r], c);
        pf_issue(pf);
    }
    if (c + 8 <= d) {
        for (uint32_t r = 0; r < s->nruns; r++)
            k_av[nh - 1][0](acc, d, s, p, &s->run[r], c);
        c += 8;
    }
    for (uint32_t h = 0; h < nh && c < d; h++)
        for (uint32_t k = 0; c + k < d; k++) {
            float r = acc[(size_t)h * d + c + k];
            for (uint32_t i = 0; i < cnt; i++)
                r = fmaf(p[h * ATTN_CHUNK + i], s->vtail[i][k], r);
            acc[(size_t)h * d + c + k] = r;
        }
}
#endif

/* The largest of n (a multiple of 8) floats, in 8 lanes (a loop gcc
 * vectorises into max instructions). */
static float lanes_max(const float *x, uint32_t n)
{
    float l[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                  -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (uint32_t i = 0; i < n; i += 8)
        for (uint32_t k = 0; k < 8; k++)
            l[k] = x[i + k] > l[k] ? x[i + k] : l[k];
    for (uint32_t k = 4; k > 0; k /= 2)
        for (uint32_t m = 0; m < k; m++)
            l[m] = l[m + k] > l[m] ? l[m + k] : l[m];
    return l[0];
}

/* The sum of n (a multiple of 8) floats: lane k adds x[i] for i = k mod 8
 * in order, then the lanes add in halves, (0+4)+(2+6) and so on: a fixed
 * order for a chunk of a given length. */
static float lanes_sum(const float *x, uint32_t n)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t i = 0; i < n; i += 8)
        for (uint32_t k = 0; k < 8; k++)
            l[k] += x[i + k];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* Running state of one query head's online softmax. */
typedef struct online {
    float max, sum;
} online;

/* Fold a chunk of cnt tokens (the step's rows stp) into the states st and
 * accumulators (rows of out) of query heads qh0 .. qh0 + nh - 1, nh <=
 * ATTN_HB; with probs asked for, their raw scores go to probs at token
 * `done`. */
static void fold(const attn_job *j, const step *stp, uint32_t cnt, size_t qh0, uint32_t nh,
                 online *st, size_t done, pf_queue *pf)
{
    uint32_t d = j->l->head_dim;
    float sc[ATTN_HB * ATTN_CHUNK];
    float *acc = j->out + qh0 * d;
    scores(j->q + qh0 * d, nh, stp, cnt, d, j->scale, sc, pf);
    uint32_t n8 = (cnt + 7) & ~7u; /* scores padded with -inf to 8 lanes: e^-inf adds 0 */
    for (uint32_t h = 0; h < nh; h++) {
        float *s = sc + h * ATTN_CHUNK, *ah = acc + (size_t)h * d;
        for (uint32_t i = cnt; i < n8; i++)
            s[i] = -INFINITY;
        float cmax = lanes_max(s, n8);
        if (j->probs != NULL)
            memcpy(j->probs + (qh0 + h) * j->n + done, s, cnt * sizeof *s);
        float mx = st[h].max, sum = st[h].sum;
        if (cmax > mx) {            /* a new running max: rescale what came before */
            float corr = mx - cmax; /* e^(old max - new max) */
            exp_nonpos(&corr, 1);
            corr = mx == -INFINITY ? 0.0f : corr;
            sum *= corr;
            for (uint32_t c = 0; c < d; c++)
                ah[c] *= corr;
            mx = cmax;
        }
        for (uint32_t i = 0; i < n8; i++)
            s[i] -= mx;
        exp_nonpos(s, n8);
        sum += lanes_sum(s, n8);
        st[h] = (online){mx, sum};
    }
    accumulate_heads(acc, nh, stp, sc, cnt, d, pf);
}

/* Query heads [h0, h0 + nh) of KV head g: a unit of work. Units are
 * numbered KV head major, `batches` per KV head of up to ATTN_HEADS query
 * heads each. */
typedef struct unit {
    uint32_t g, h0, nh;
} unit;

static unit unit_of(const attn_job *j, size_t u)
{
    unit x;
    x.g = (uint32_t)(u / j->batches);
    x.h0 = x.g * j->group + (uint32_t)(u % j->batches) * ATTN_HEADS;
    uint32_t end = x.g * j->group + j->group < j->q_heads ? x.g * j->group + j->group : j->q_heads;
    x.nh = x.h0 < end ? (end - x.h0 < ATTN_HEADS ? end - x.h0 : ATTN_HEADS) : 0;
    return x;
}

/* A position in the segment list. */
typedef struct list_pos {
    size_t k;   /* segment */
    uint32_t s; /* token of it */
} list_pos;

/* The next chunk: up to cap tokens of the list from *p, which steps past
 * them. Returns how many (0 at the end). A chunk that would end inside the
 * tokens of one INT8 block ends before them instead, when that leaves it
 * at least cap / 2 tokens: a block's tokens then share one run (one scaled
 * query, one V scale multiplication: step_load) rather than two. The cut
 * depends on the tokens' tiers and blocks in list order alone, not on the
 * segments. */
static uint32_t next_chunk(const attn_job *j, list_pos *p, uint32_t cap, chunk_tok *toks)
{
    list_pos at[ATTN_CHUNK]; /* where each token of the chunk is in the list */
    uint32_t cnt = 0;
    while (cnt < cap && p->k < j->nsegs) {
        const kv_segment *sg = &j->segs[p->k];
        uint8_t tier = j->tiers != NULL ? j->tiers[p->k] : KV_TIER_FULL;
        assert(tier == KV_TIER_FULL || tier == KV_TIER_INT8 || tier_lowbit(tier));
        assert(tier != KV_TIER_INT8 || (uint64_t)sg->first_slot + sg->count <= j->q8.block_tokens);
        assert(tier != KV_TIER_INT4 || (uint64_t)sg->first_slot + sg->count <= j->q4.block_tokens);
        assert(tier != KV_TIER_INT2 || (uint64_t)sg->first_slot + sg->count <= j->q2.block_tokens);
        uint32_t m = sg->count - p->s < cap - cnt ? sg->count - p->s : cap - cnt;
        for (uint32_t i = 0; i < m; i++) {
            at[cnt] = (list_pos){p->k, p->s + i};
            toks[cnt++] = (chunk_tok){tier, sg->block, sg->first_slot + p->s + i};
        }
        p->s += m;
        if (p->s >= sg->count) {
            p->k++;
            p->s = 0;
        }
    }
    if (cnt < cap || p->k >= j->nsegs || toks[cnt - 1].tier != KV_TIER_INT8 ||
        j->tiers[p->k] != KV_TIER_INT8 || j->segs[p->k].block != toks[cnt - 1].block)
        return cnt; /* the chunk does not split an INT8 block's tokens */
    uint32_t start = cnt - 1;
    while (start > 0 && toks[start - 1].tier == KV_TIER_INT8 &&
           toks[start - 1].block == toks[cnt - 1].block)
        start--;
    if (start < cap / 2)
        return cnt;
    *p = at[start];
    return start;
}

/* Prefetch the K and V rows of one KV head (its rows hr) of cnt tokens. */
static void prefetch_rows(const attn_job *j, const head_rows *hr, const chunk_tok *toks,
                          uint32_t cnt, pf_queue *q)
{
    const uint8_t *vlo[2 * ATTN_CHUNK], *vhi[2 * ATTN_CHUNK];
    uint32_t nv = 0, sbytes = 4 * j->l->head_dim;
    size_t lines = 0;
    q->n = q->i = 0;
    for (uint32_t i = 0; i < cnt; i++) {
        if (tier_lowbit(toks[i].tier)) { /* their code rows; the parameters are small */
            uint32_t bits = toks[i].tier == KV_TIER_INT4 ? 4 : 2;
            const kv_layout *lq = bits == 4 ? &j->q4 : &j->q2;
            const uint8_t *qb = j->pool + (size_t)toks[i].block * hr->block_bytes;
            size_t bytes = ((size_t)lq->head_dim * bits + 7) / 8;
            pf_add(q->lo, q->hi, &q->n,
                   qb + kv_lowbit_code_offset(lq, bits, 0, 0, hr->g, toks[i].slot), bytes);
            pf_add(vlo, vhi, &nv, qb + kv_lowbit_code_offset(lq, bits, 0, 1, hr->g, toks[i].slot),
                   bytes);
            continue;
        }
        attn_row r = row_at(j, hr, toks[i].tier, toks[i].block, toks[i].slot);
        size_t bytes = toks[i].tier == KV_TIER_FULL ? hr->row : hr->qrow;
        if (r.ks != NULL &&
            (i == 0 || toks[i].tier != toks[i - 1].tier || toks[i].block != toks[i - 1].block)) {
            /* an INT8 block's scale rows, read with each of its rows */
            pf_add(q->lo, q->hi, &q->n, r.ks, sbytes);
            pf_add(vlo, vhi, &nv, r.vs, sbytes);
        }
        pf_add(q->lo, q->hi, &q->n, r.k, bytes);
        pf_add(vlo, vhi, &nv, r.v, bytes);
    }
    for (uint32_t i = 0; i < nv; i++) {
        q->lo[q->n] = vlo[i];
        q->hi[q->n++] = vhi[i];
    }
    for (uint32_t i = 0; i < q->n; i++)
        lines += (size_t)(q->hi[i] - q->lo[i]) / 64 + 1;
    q->at = q->n > 0 ? (const uint8_t *)((uintptr_t)q->lo[0] & ~(uintptr_t)63) : NULL;
    q->per = (uint32_t)((lines + 15) / 16);
}

/*
 * Units [u0, u1) (at most ATTN_STATE query heads) over the whole list, in
 * one walk: per chunk, the K and V rows of each KV head in turn. A chunk's
 * blocks are then read head after head, K and V, close to sequentially; a
 * walk per KV head would read 1 / kv_heads of each block, scattered over
 * the pool. The list's blocks are scattered, which the hardware
 * prefetchers cannot follow: each step (a KV head of a chunk) prefetches
 * the rows of the step ATTN_AHEAD steps later.
 */
static void attend(const attn_job *j, size_t u0, size_t u1)
{
    uint32_t d = j->l->head_dim;
    uint32_t cap = d == 0 || ATTN_TILE / d > ATTN_CHUNK ? ATTN_CHUNK : ATTN_TILE / d;
    step stp; /* one step's tiles (generic build) or rows (AVX2) */
    online st[ATTN_STATE];
    head_rows hr[ATTN_STATE]; /* of KV heads g0 .. g0 + nhr - 1 */
    chunk_tok toks[2][ATTN_CHUNK];
    uint32_t nst = 0, g0 = unit_of(j, u0).g, nhr = unit_of(j, u1 - 1).g - g0 + 1;
    assert(nhr <= ATTN_STATE); /* a unit has a query head at least */
    for (uint32_t g = 0; g < nhr; g++)
        hr[g] = head_rows_of(j, g0 + g);

    for (size_t u = u0; u < u1; u++) {
        unit x = unit_of(j, u);
        for (uint32_t h = 0; h < x.nh; h++) {
            assert(nst < ATTN_STATE);
            st[nst++] = (online){-INFINITY, 0.0f};
            memset(j->out + (size_t)(x.h0 + h) * d, 0, d * sizeof(float));
        }
    }
    list_pos pos = {0, 0};
    uint32_t cnt = next_chunk(j, &pos, cap, toks[0]);
    uint32_t ncnt = next_chunk(j, &pos, cap, toks[1]);
    pf_queue pf;
    for (uint32_t g = 0; g < ATTN_AHEAD && g < nhr; g++) {
        prefetch_rows(j, &hr[g], toks[0], cnt, &pf);
        pf.per = UINT32_MAX;
        pf_issue(&pf);
    }
    size_t done = 0;
    for (int c = 0; cnt > 0; c ^= 1) {
        uint32_t si = 0, loaded = UINT32_MAX;
        for (size_t u = u0; u < u1; u++) {
            unit x = unit_of(j, u);
            if (x.nh > 0 && x.g != loaded) {
                uint32_t pg = x.g - g0 + ATTN_AHEAD;
                pf.per = UINT32_MAX;
                pf_issue(&pf);   /* what is left of the last step's */
                pf.n = pf.i = 0; /* (prefetch_rows fills it, or it stays empty) */
                if (pg < nhr)
                    prefetch_rows(j, &hr[pg], toks[c], cnt, &pf);
                else if (pg - nhr < nhr)
                    prefetch_rows(j, &hr[pg - nhr], toks[c ^ 1], ncnt, &pf);
                step_load(j, &hr[x.g - g0], toks[c], cnt, &stp);
                loaded = x.g;
            }
            for (uint32_t h = 0; h < x.nh; h += ATTN_HB) {
                uint32_t nh = x.nh - h < ATTN_HB ? x.nh - h : ATTN_HB;
                fold(j, &stp, cnt, x.h0 + h, nh, &st[si], done, &pf);
                pf_issue(&pf);
                si += nh;
            }
        }
        done += cnt;
        cnt = ncnt;
        ncnt = next_chunk(j, &pos, cap, toks[c]);
    }
    if (j->n == 0)
        return;
    uint32_t si = 0;
    for (size_t u = u0; u < u1; u++) {
        unit x = unit_of(j, u);
        for (uint32_t h = 0; h < x.nh; h++, si++) {
            size_t qh = x.h0 + h;
            float inv = 1.0f / st[si].sum, *acc = j->out + qh * d;
            for (uint32_t c = 0; c < d; c++)
                acc[c] *= inv;
            float *raw = j->probs != NULL ? j->probs + qh * j->n : NULL;
            for (size_t i0 = 0; raw != NULL && i0 < j->n; i0 += ATTN_CHUNK) {
                uint32_t m = j->n - i0 < ATTN_CHUNK ? (uint32_t)(j->n - i0) : ATTN_CHUNK;
                for (uint32_t i = 0; i < m; i++)
                    raw[i0 + i] -= st[si].max;
                exp_nonpos(raw + i0, m);
                for (uint32_t i = 0; i < m; i++)
                    raw[i0 + i] *= inv;
            }
        }
    }
}

/* Item i of `items` takes units [units * i / items, units * (i + 1) / items). */
typedef struct attn_split {
    const attn_job *j;
    size_t units, items;
} attn_split;

static void attend_items(void *ctx, size_t lo, size_t hi)
{
    const attn_split *sp = ctx;
    for (size_t i = lo; i < hi; i++)
        attend(sp->j, sp->units * i / sp->items, sp->units * (i + 1) / sp->items);
}

void KV_FAST(kv_decode_attention)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                  const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                                  const float *q, uint32_t q_heads, float scale, float *out,
                                  float *probs)
{
    if (l->head_dim > ATTN_TILE) {
        kv_decode_attention_ref(l, t, pool, segs, nsegs, tiers, q, q_heads, scale, out, probs);
        return;
    }
    uint32_t group = l->kv_heads ? q_heads / l->kv_heads : 0;
    group = group ? group : 1; /* the contract asks q_heads % kv_heads == 0 */
    attn_job j = {.l = l, .q8 = *l, .q4 = *l, .q2 = *l, .t = t, .pool = pool, .segs = segs};
    j.nsegs = nsegs;
    j.n = kv_segments_tokens(segs, nsegs);
    j.tiers = tiers;
    j.q = q;
    j.q_heads = q_heads;
    j.group = group;
    j.batches = (group + ATTN_HEADS - 1) / ATTN_HEADS;
    j.scale = scale;
    j.out = out;
    j.probs = probs;
    j.q8.block_tokens = kv_int8_tokens_per_block(l);
    j.q4.block_tokens = kv_lowbit_tokens_per_block(l, 4);
    j.q2.block_tokens = kv_lowbit_tokens_per_block(l, 2);
    size_t kvh = (q_heads + group - 1) / group, units = kvh * j.batches;
    /* Items of as many units as the states allow, and at least one per
     * thread: results do not depend on how units are grouped. */
    size_t per_item = ATTN_STATE / (group < ATTN_HEADS ? group : ATTN_HEADS);
    size_t items = (units + per_item - 1) / per_item;
    /* every K and V row of the list, once per KV head */
    size_t bytes = j.n * 2 * kvh * l->head_dim * l->elt_size;
    unsigned nt = bytes < 2 * (size_t)KV_PARALLEL_GRAIN ? 1 : kv_parallel_threads(bytes);
    if (items < nt)
        items = nt < units ? nt : units;
    attn_split sp = {&j, units, items};
    if (nt <= 1) /* no thread to start: skip kv_parallel_for's CPU count */
        attend_items(&sp, 0, items);
    else
        kv_parallel_for(items, bytes, attend_items, &sp);
}
