/*
 * attention.c - one query token's attention over a list in the pool
 * (kernels.h kv_decode_attention): what a worker runs to read its cache
 * through the store's table, whatever the policy did to the list.
 *
 * The reference computes every score, then the softmax, in double. The fast
 * version walks the list by chunks of ATTN_CHUNK tokens with an online softmax
 * (Milakov & Gimelshein 2018; FlashAttention's running max and sum): per
 * chunk it rescales the running sum and accumulator once, and it keeps no
 * scratch of the list's length (the chunk's scores live on the stack, the
 * accumulator is `out` itself). With probs asked for, the raw scores go into
 * probs and are normalised at the end.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Tokens per chunk of the fast version: its scores live on the stack. */
#define ATTN_CHUNK 32

/* One element of a K or V row as float (kv_elt_load, with fp32 inline). */
static inline float elt(const uint8_t *row, uint32_t i, kv_dtype t)
{
    if (t == KV_FP32) {
        float f;
        memcpy(&f, row + (size_t)i * 4, 4);
        return f;
    }
    return kv_elt_load(row + (size_t)i * 2, t);
}

static size_t v_delta(const kv_layout *l)
{
    return kv_block_bytes(l) / 2;
}

/* q_heads per KV head; the contract asks q_heads to be a multiple of it. */
static uint32_t group_of(const kv_layout *l, uint32_t q_heads)
{
    uint32_t g = l->kv_heads ? q_heads / l->kv_heads : 0;
    return g ? g : 1;
}

void kv_decode_attention_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const float *q, uint32_t q_heads,
                             float scale, float *out, float *probs)
{
    size_t n = kv_segments_tokens(segs, nsegs);
    uint32_t d = l->head_dim, group = group_of(l, q_heads);
    double *s = malloc((n ? n : 1) * sizeof *s), *acc = malloc((d ? d : 1) * sizeof *acc);
    for (uint32_t h = 0; h < q_heads; h++) {
        const float *qh = q + (size_t)h * d;
        float *oh = out + (size_t)h * d;
        uint32_t g = h / group;
        if (n == 0 || s == NULL || acc == NULL) {
            memset(oh, 0, d * sizeof *oh);
            continue;
        }
        double mx = -INFINITY, sum = 0;
        size_t i = 0;
        for (size_t k = 0; k < nsegs; k++)
            for (uint32_t j = 0; j < segs[k].count; j++, i++) {
                const uint8_t *kr =
                    pool + kv_key_offset(l, segs[k].block, g, segs[k].first_slot + j);
                double dot = 0;
                for (uint32_t c = 0; c < d; c++)
                    dot += (double)qh[c] * elt(kr, c, t);
                s[i] = dot * scale;
                mx = s[i] > mx ? s[i] : mx;
            }
        for (i = 0; i < n; i++)
            sum += s[i] = exp(s[i] - mx);
        memset(acc, 0, d * sizeof *acc);
        i = 0;
        for (size_t k = 0; k < nsegs; k++)
            for (uint32_t j = 0; j < segs[k].count; j++, i++) {
                const uint8_t *vr =
                    pool + kv_key_offset(l, segs[k].block, g, segs[k].first_slot + j) + v_delta(l);
                double p = s[i] / sum;
                if (probs != NULL)
                    probs[(size_t)h * n + i] = (float)p;
                for (uint32_t c = 0; c < d; c++)
                    acc[c] += p * elt(vr, c, t);
            }
        for (uint32_t c = 0; c < d; c++)
            oh[c] = (float)acc[c];
    }
    free(s);
    free(acc);
}

/* Running state of one query head's online softmax. */
typedef struct online {
    float max, sum;
} online;

/* Fold one chunk of `cnt` tokens (K rows at krow[j], V rows v_delta after)
 * into head h's state and accumulator `acc` (= its row of out); raw (may be
 * NULL) receives the raw scores. */
static void chunk_fold(const kv_layout *l, kv_dtype t, const uint8_t *const *krow, const float *qh,
                       float scale, uint32_t cnt, online *st, float *acc, float *raw)
{
    uint32_t d = l->head_dim;
    size_t vd = v_delta(l);
    float sc[ATTN_CHUNK], cmax = -INFINITY;
    for (uint32_t j = 0; j < cnt; j++) {
        float dot = 0;
        for (uint32_t c = 0; c < d; c++)
            dot += qh[c] * elt(krow[j], c, t);
        sc[j] = dot * scale;
        cmax = sc[j] > cmax ? sc[j] : cmax;
        if (raw != NULL)
            raw[j] = sc[j];
    }
    if (cmax > st->max) { /* a new running max: rescale what came before */
        float corr = st->max == -INFINITY ? 0.0f : expf(st->max - cmax);
        st->sum *= corr;
        for (uint32_t c = 0; c < d; c++)
            acc[c] *= corr;
        st->max = cmax;
    }
    for (uint32_t j = 0; j < cnt; j++) {
        float p = expf(sc[j] - st->max);
        const uint8_t *vr = krow[j] + vd;
        st->sum += p;
        for (uint32_t c = 0; c < d; c++)
            acc[c] += p * elt(vr, c, t);
    }
}

/*
 * Chunks are runs of ATTN_CHUNK tokens of the list, wherever the segment
 * boundaries fall: the arithmetic depends only on the tokens in list order,
 * so the same tokens give the same bits whether they sit in one segment or
 * many, in the pool layout or in a per-head list's rows.
 */
void kv_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, const float *q, uint32_t q_heads,
                         float scale, float *out, float *probs)
{
    size_t n = kv_segments_tokens(segs, nsegs);
    uint32_t d = l->head_dim, group = group_of(l, q_heads);
    const uint8_t *krow[ATTN_CHUNK];
    for (uint32_t h = 0; h < q_heads; h++) {
        const float *qh = q + (size_t)h * d;
        float *acc = out + (size_t)h * d;
        float *raw = probs != NULL ? probs + (size_t)h * n : NULL;
        uint32_t g = h / group, cnt = 0;
        online st = {-INFINITY, 0.0f};
        memset(acc, 0, d * sizeof *acc);
        size_t done = 0;
        for (size_t k = 0; k < nsegs; k++)
            for (uint32_t j = 0; j < segs[k].count; j++) {
                krow[cnt++] = pool + kv_key_offset(l, segs[k].block, g, segs[k].first_slot + j);
                if (cnt < ATTN_CHUNK && done + cnt < n)
                    continue;
                chunk_fold(l, t, krow, qh, scale, cnt, &st, acc, raw ? raw + done : NULL);
                done += cnt;
                cnt = 0;
            }
        if (n == 0)
            continue;
        float inv = 1.0f / st.sum;
        for (uint32_t c = 0; c < d; c++)
            acc[c] *= inv;
        for (size_t k = 0; raw != NULL && k < n; k++)
            raw[k] = expf(raw[k] - st.max) * inv;
    }
}
