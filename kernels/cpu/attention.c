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
 * fp32 once into two stack tiles (fp16 with F16C in the AVX2 build; INT8 as
 * code * scale, the dequantisation fused into the read) and serve every
 * query head of its group. One walk takes up to ATTN_STATE query heads, KV
 * head after KV head per chunk, so a chunk's blocks are read nearly in
 * order, and the rows of the chunk after are prefetched meanwhile (a list's
 * blocks are scattered over the pool: the hardware prefetchers cannot run
 * ahead of them).
 *
 * Scores are 8-lane dot products, eight tokens at a time; the V
 * accumulation runs channel-outer, so that up to 64 channels of the
 * accumulator stay in registers over the chunk's tokens; exp is a
 * vectorised polynomial. The generic build's plain C and the AVX2 build's
 * intrinsics do the same IEEE operations per lane in the same order, so
 * both give the same bits (isa.h). No scratch of the list's length: the
 * accumulator is `out` itself, and with probs asked for the raw scores go
 * into probs and are normalised at the end.
 *
 * Chunks are runs of the list's tokens whose length depends on head_dim
 * alone, wherever the segment boundaries fall: the same tokens give the
 * same bits in one segment or many, in the pool layout or in a per-head
 * list's rows. Large calls split their query heads over threads
 * (parallel.h); each head's arithmetic is the same whatever the split.
 */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"

#define ATTN_CHUNK 32u  /* tokens per chunk at most: their scores live on the stack */
#define ATTN_TILE 4096u /* floats of a chunk's K (or V) tile; a longer row takes the reference */
#define ATTN_HEADS 16u  /* query heads of one KV head per unit of work */
#define ATTN_STATE 64u  /* query heads per walk over the list */

typedef struct attn_job {
    const kv_layout *l;
    kv_layout q8; /* the INT8 block an INT8 segment's block holds */
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

/* Where one token's K and V rows are: elements of type t, or INT8 codes
 * with their blocks' scale rows (ks != NULL). */
typedef struct attn_row {
    const uint8_t *k, *v, *ks, *vs;
} attn_row;

/* Offsets inside a block of KV head g's rows at slot 0, per tier. */
typedef struct head_rows {
    size_t block_bytes, k, v, row; /* full precision */
    size_t qk, qv, qks, qvs, qrow; /* INT8 */
} head_rows;

static head_rows head_rows_of(const attn_job *j, uint32_t g)
{
    const kv_layout *l = j->l;
    head_rows r;
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

/* K (v = 0) or V (v = 1) rows of a chunk into tile [cnt][d]. */
static void load_tile(const attn_job *j, const attn_row *rows, uint32_t cnt, int v, float *tile)
{
    uint32_t d = j->l->head_dim;
    for (uint32_t i = 0; i < cnt; i++) {
        float *x = tile + (size_t)i * d;
        if (rows[i].ks == NULL)
            kv_row_load(v ? rows[i].v : rows[i].k, j->t, d, x);
        else
            int8_row_load(v ? rows[i].v : rows[i].k, v ? rows[i].vs : rows[i].ks, d, x);
    }
}

/* a.b in 8 lanes: lane k sums a[c] * b[c] over channels c = k mod 8 in
 * order, then the lanes add as ((0+4) + (2+6)) + ((1+5) + (3+7)): a fixed
 * order, the one an 8-wide register reduces in (dot8_finish). */
static float dot8(const float *restrict a, const float *restrict b, uint32_t d)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t c = 0;
    for (; c + 8 <= d; c += 8)
        for (uint32_t k = 0; k < 8; k++)
            l[k] += a[c + k] * b[c + k];
    for (uint32_t k = 0; c + k < d; k++)
        l[k] += a[c + k] * b[c + k];
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* acc[c] += p[i] * vt[i][c] for the chunk's tokens i in order, channel
 * blocks outer: each channel sees the same additions in the same order,
 * whatever block it falls in. */
static void accumulate(float *restrict acc, const float *restrict vt, const float *restrict p,
                       uint32_t cnt, uint32_t d, uint32_t c)
{
    for (; c + 8 <= d; c += 8) {
        float r[8];
        memcpy(r, acc + c, sizeof r);
        for (uint32_t i = 0; i < cnt; i++)
            for (uint32_t k = 0; k < 8; k++)
                r[k] += p[i] * vt[(size_t)i * d + c + k];
        memcpy(acc + c, r, sizeof r);
    }
    for (; c < d; c++) {
        float r = acc[c];
        for (uint32_t i = 0; i < cnt; i++)
            r += p[i] * vt[(size_t)i * d + c];
        acc[c] = r;
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* NT tokens' dot8 at once (NT independent chains, the query read once for
 * all), the same operations per lane; b holds the tokens' rows `stride`
 * floats apart. */
#define DOT8_AVX2(NT)                                                                              \
    static void dot8x##NT##_avx2(const float *a, const float *b, size_t stride, uint32_t d,        \
                                 float *out)                                                       \
    {                                                                                              \
        __m256 s[NT];                                                                              \
        for (int t = 0; t < NT; t++)                                                               \
            s[t] = _mm256_setzero_ps();                                                            \
        uint32_t c = 0;                                                                            \
        for (; c + 8 <= d; c += 8) {                                                               \
            __m256 x = _mm256_loadu_ps(a + c);                                                     \
            for (int t = 0; t < NT; t++)                                                           \
                s[t] = _mm256_add_ps(s[t], _mm256_mul_ps(x, _mm256_loadu_ps(b + t * stride + c))); \
        }                                                                                          \
        for (int t = 0; t < NT; t++)                                                               \
            out[t] = dot8_finish(s[t], a + c, b + t * stride + c, d - c);                          \
    }

/* The end of a dot8: the last n < 8 channels lane by lane, then the lanes
 * added in dot8's order. */
static inline float dot8_finish(__m256 s, const float *a, const float *b, uint32_t n)
{
    if (n > 0) {
        float l[8];
        _mm256_storeu_ps(l, s);
        for (uint32_t k = 0; k < n; k++)
            l[k] += a[k] * b[k];
        s = _mm256_loadu_ps(l);
    }
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v)); /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

DOT8_AVX2(8)
DOT8_AVX2(4)

/* accumulate for channels [c, c + 8 * NB) in NB registers (NB chains). */
#define ACCUMULATE_AVX2(NB)                                                                        \
    static void accumulate##NB##_avx2(float *acc, const float *vt, const float *p, uint32_t cnt,   \
                                      uint32_t d, uint32_t c)                                      \
    {                                                                                              \
        __m256 r[NB];                                                                              \
        for (int k = 0; k < NB; k++)                                                               \
            r[k] = _mm256_loadu_ps(acc + c + 8 * k);                                               \
        for (uint32_t i = 0; i < cnt; i++) {                                                       \
            __m256 pi = _mm256_set1_ps(p[i]);                                                      \
            const float *v = vt + (size_t)i * d + c;                                               \
            for (int k = 0; k < NB; k++)                                                           \
                r[k] = _mm256_add_ps(r[k], _mm256_mul_ps(pi, _mm256_loadu_ps(v + 8 * k)));         \
        }                                                                                          \
        for (int k = 0; k < NB; k++)                                                               \
            _mm256_storeu_ps(acc + c + 8 * k, r[k]);                                               \
    }

ACCUMULATE_AVX2(8)
ACCUMULATE_AVX2(4)

/* accumulate's first d - d % 32 channels, 64 or 32 at a time: enough
 * independent chains to hide the additions' latency. Returns how many it
 * did. */
static uint32_t accumulate_avx2(float *acc, const float *vt, const float *p, uint32_t cnt,
                                uint32_t d)
{
    uint32_t c = 0;
    for (; c + 64 <= d; c += 64)
        accumulate8_avx2(acc, vt, p, cnt, d, c);
    for (; c + 32 <= d; c += 32)
        accumulate4_avx2(acc, vt, p, cnt, d, c);
    return c;
}
#endif

/*
 * x[i] = e^x[i] for x[i] <= 0 (the softmax's exponents: scores minus their
 * running max), in a loop that vectorises: Cody-Waite reduction by ln 2
 * and Cephes' expf polynomial (relative error about 2e-7), separate
 * multiplications and additions, so both builds give the same bits. Below
 * -87 (e^x under FLT_MIN) it gives 0, where expf gives a subnormal.
 */
static void exp_nonpos(float *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t low = kv_mask(x[i] < -87.0f); /* selects as masks: the loop vectorises */
        float v =
            kv_bits_to_float(kv_select(low, kv_float_to_bits(-87.0f), kv_float_to_bits(x[i])));
        float k = (v * 1.44269504089f + 12582912.0f) - 12582912.0f; /* rne(v / ln 2) */
        float r = (v - k * 0.693359375f) - k * -2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = (p * (r * r) + r) + 1.0f;
        float two_k = kv_bits_to_float((uint32_t)((int32_t)k + 127) << 23);
        x[i] = kv_bits_to_float(kv_select(low, 0u, kv_float_to_bits(p * two_k)));
    }
}

/* The chunk's cnt raw scores q.k * scale. */
static void scores(const float *qh, const float *kt, uint32_t cnt, uint32_t d, float scale,
                   float *sc)
{
    uint32_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= cnt; i += 8)
        dot8x8_avx2(qh, kt + (size_t)i * d, d, d, sc + i);
    for (; i + 4 <= cnt; i += 4)
        dot8x4_avx2(qh, kt + (size_t)i * d, d, d, sc + i);
#endif
    for (; i < cnt; i++)
        sc[i] = dot8(qh, kt + (size_t)i * d, d);
    for (i = 0; i < cnt; i++)
        sc[i] *= scale;
}

/* Running state of one query head's online softmax. */
typedef struct online {
    float max, sum;
} online;

/* Fold a chunk of cnt tokens (tiles kt, vt) into one query head's state and
 * accumulator acc (its row of out); raw (may be NULL) receives the raw
 * scores. */
static void fold(const attn_job *j, const float *kt, const float *vt, uint32_t cnt, const float *qh,
                 online *st, float *acc, float *raw)
{
    uint32_t d = j->l->head_dim;
    float sc[ATTN_CHUNK], cmax = -INFINITY;
    scores(qh, kt, cnt, d, j->scale, sc);
    for (uint32_t i = 0; i < cnt; i++)
        cmax = sc[i] > cmax ? sc[i] : cmax;
    if (raw != NULL)
        memcpy(raw, sc, cnt * sizeof *sc);
    float mx = st->max, sum = st->sum;
    if (cmax > mx) {            /* a new running max: rescale what came before */
        float corr = mx - cmax; /* e^(old max - new max) */
        exp_nonpos(&corr, 1);
        corr = mx == -INFINITY ? 0.0f : corr;
        sum *= corr;
        for (uint32_t c = 0; c < d; c++)
            acc[c] *= corr;
        mx = cmax;
    }
    for (uint32_t i = 0; i < cnt; i++)
        sc[i] -= mx;
    exp_nonpos(sc, cnt);
    for (uint32_t i = 0; i < cnt; i++)
        sum += sc[i];
    *st = (online){mx, sum};
    uint32_t c = 0;
#ifdef __AVX2__
    c = accumulate_avx2(acc, vt, sc, cnt, d);
#endif
    accumulate(acc, vt, sc, cnt, d, c);
}

/* A token of the current chunk: its tier, block and slot. */
typedef struct chunk_tok {
    uint8_t tier;
    uint32_t block, slot;
} chunk_tok;

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

/* K and V tiles of a KV head (its rows hr) for the chunk's cnt tokens. */
static void load_tiles(const attn_job *j, const head_rows *hr, const chunk_tok *toks, uint32_t cnt,
                       float *kt, float *vt)
{
    attn_row rows[ATTN_CHUNK];
    for (uint32_t i = 0; i < cnt; i++)
        rows[i] = row_at(j, hr, toks[i].tier, toks[i].block, toks[i].slot);
    load_tile(j, rows, cnt, 0, kt);
    load_tile(j, rows, cnt, 1, vt);
}

/* A position in the segment list, for the prefetch that runs a chunk
 * ahead of the one being read. */
typedef struct list_pos {
    size_t k;   /* segment */
    uint32_t s; /* token of it */
} list_pos;

/* Prefetch the K and V rows of the KV heads of hr[0 .. nhr) of the token
 * at *p, then step past it. */
static void prefetch_next(const attn_job *j, const head_rows *hr, uint32_t nhr, list_pos *p)
{
    while (p->k < j->nsegs && p->s >= j->segs[p->k].count) {
        p->k++;
        p->s = 0;
    }
    if (p->k >= j->nsegs)
        return;
    uint8_t tier = j->tiers != NULL ? j->tiers[p->k] : KV_TIER_FULL;
    for (uint32_t g = 0; g < nhr; g++) {
        attn_row r = row_at(j, &hr[g], tier, j->segs[p->k].block, j->segs[p->k].first_slot + p->s);
        size_t bytes = tier == KV_TIER_FULL ? hr[g].row : hr[g].qrow;
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(r.k + b);
            __builtin_prefetch(r.v + b);
        }
    }
    p->s++;
}

/*
 * Units [u0, u1) (at most ATTN_STATE query heads) over the whole list, in
 * one walk: per chunk, the K and V rows of each KV head in turn. A chunk's
 * blocks are then read head after head, K and V, close to sequentially,
 * which the hardware prefetchers follow; a walk per KV head would read
 * 1 / kv_heads of each block, scattered over the pool.
 */
static void attend(const attn_job *j, size_t u0, size_t u1)
{
    uint32_t d = j->l->head_dim;
    uint32_t cap = d == 0 || ATTN_TILE / d > ATTN_CHUNK ? ATTN_CHUNK : ATTN_TILE / d;
    float kt[ATTN_TILE], vt[ATTN_TILE];
    online st[ATTN_STATE];
    head_rows hr[ATTN_STATE]; /* of KV heads g0 .. g0 + nhr - 1 */
    chunk_tok toks[ATTN_CHUNK];
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
    size_t done = 0;
    uint32_t cnt = 0;
    list_pos ahead = {0, 0};
    for (uint32_t i = 0; i < cap; i++)
        prefetch_next(j, hr, nhr, &ahead);
    for (size_t k = 0; k < j->nsegs; k++) {
        uint8_t tier = j->tiers != NULL ? j->tiers[k] : KV_TIER_FULL;
        assert(tier == KV_TIER_FULL || tier == KV_TIER_INT8);
        assert(tier == KV_TIER_FULL ||
               (uint64_t)j->segs[k].first_slot + j->segs[k].count <= j->q8.block_tokens);
        for (uint32_t s = 0; s < j->segs[k].count; s++) {
            toks[cnt++] = (chunk_tok){tier, j->segs[k].block, j->segs[k].first_slot + s};
            prefetch_next(j, hr, nhr, &ahead);
            if (cnt < cap && done + cnt < j->n)
                continue;
            uint32_t si = 0, loaded = UINT32_MAX;
            for (size_t u = u0; u < u1; u++) {
                unit x = unit_of(j, u);
                if (x.nh > 0 && x.g != loaded) {
                    load_tiles(j, &hr[x.g - g0], toks, cnt, kt, vt);
                    loaded = x.g;
                }
                for (uint32_t h = 0; h < x.nh; h++) {
                    size_t qh = x.h0 + h;
                    fold(j, kt, vt, cnt, j->q + qh * d, &st[si++], j->out + qh * d,
                         j->probs != NULL ? j->probs + qh * j->n + done : NULL);
                }
            }
            done += cnt;
            cnt = 0;
        }
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
    attn_job j = {.l = l, .q8 = *l, .t = t, .pool = pool, .segs = segs, .nsegs = nsegs};
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
