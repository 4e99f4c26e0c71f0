/*
 * attention_ref.c - the reference decode attention (kernels.h
 * kv_decode_attention): every score, then the softmax, in double. A
 * full-precision element is read through kv_elt_load, an INT8 one through
 * kv_dequantize_group_ref (code * scale in fp32), an INT4 / INT2 one as
 * kv_lowbit_dequantize_ref reads it, so the result is exactly that of the
 * same tokens dequantised into an fp32 pool.
 *
 * Slow on purpose; the tests and tests/gpu compare the fast and CUDA
 * versions with it.
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lowbit.h"
#include "kernels.h"

/* The layouts of the quantised blocks a segment's pool block may hold. */
typedef struct ref_tiers {
    kv_layout q8, q4, q2;
} ref_tiers;

static ref_tiers ref_tiers_of(const kv_layout *l)
{
    ref_tiers r = {*l, *l, *l};
    r.q8.block_tokens = kv_int8_tokens_per_block(l);
    r.q4.block_tokens = kv_lowbit_tokens_per_block(l, 4);
    r.q2.block_tokens = kv_lowbit_tokens_per_block(l, 2);
    return r;
}

/* The slots a segment of this tier may name in its block. */
static uint32_t ref_tier_slots(const kv_layout *l, const ref_tiers *r, uint8_t tier)
{
    return tier == KV_TIER_INT8   ? r->q8.block_tokens
           : tier == KV_TIER_INT4 ? r->q4.block_tokens
           : tier == KV_TIER_INT2 ? r->q2.block_tokens
                                  : l->block_tokens;
}

static float ref_half(const uint8_t *p, size_t i)
{
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return kv_half_to_float(h);
}

/* Element c of a row of a low-bit block (layout q, `bits`) at qb. */
static float ref_lowbit_elt(const kv_layout *q, uint32_t bits, const uint8_t *qb, uint32_t kv,
                            uint32_t g, uint32_t slot, uint32_t c)
{
    uint32_t G = kv_lowbit_group(q), d = q->head_dim, nv = (d + G - 1) / G;
    uint32_t code = kv_lowbit_get(qb + kv_lowbit_code_offset(q, bits, 0, kv, g, slot), c, bits);
    int32_t e;
    memcpy(&e, qb + kv_lowbit_shift_offset(q, bits, 0), 4);
    float p2 = kv_lowbit_pow2(e);
    if (kv == 0) {
        const uint8_t *p = qb + kv_lowbit_key_params_offset(q, bits, 0, g, slot / G);
        return kv_lowbit_value(code, ref_half(p, c), ref_half(p, (size_t)d + c), p2);
    }
    const uint8_t *p = qb + kv_lowbit_value_params_offset(q, bits, 0, g, slot);
    return kv_lowbit_value(code, ref_half(p, c / G), ref_half(p, (size_t)nv + c / G), p2);
}

/* Element c of the K (kv = 0) or V (kv = 1) row of (block, KV head g,
 * slot), as the float the segment's tier defines; r gives the layouts of
 * the quantised blocks a segment's block holds. */
static float ref_elt(const kv_layout *l, const ref_tiers *r, kv_dtype t, const uint8_t *pool,
                     uint8_t tier, uint32_t block, uint32_t kv, uint32_t g, uint32_t slot,
                     uint32_t c)
{
    if (tier == KV_TIER_FULL) {
        size_t off = kv_key_offset(l, block, g, slot) + (kv ? kv_block_bytes(l) / 2 : 0);
        return kv_elt_load(pool + off + (size_t)c * l->elt_size, t);
    }
    const uint8_t *qb = pool + (size_t)block * kv_block_bytes(l);
    if (tier == KV_TIER_INT4 || tier == KV_TIER_INT2)
        return ref_lowbit_elt(tier == KV_TIER_INT4 ? &r->q4 : &r->q2, tier == KV_TIER_INT4 ? 4 : 2,
                              qb, kv, g, slot, c);
    int8_t code = (int8_t)qb[kv_int8_code_offset(&r->q8, 0, kv, g, slot) + c];
    float s, x;
    memcpy(&s, qb + kv_int8_scale_offset(&r->q8, 0, kv, g) + 4 * (size_t)c, 4);
    kv_dequantize_group_ref(&code, 1, s, &x);
    return x;
}

void kv_decode_attention_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                             const float *q, uint32_t q_heads, float scale, float *out,
                             float *probs)
{
    size_t n = kv_segments_tokens(segs, nsegs);
    uint32_t d = l->head_dim, group = l->kv_heads ? q_heads / l->kv_heads : 0;
    group = group ? group : 1; /* the contract asks q_heads % kv_heads == 0 */
    ref_tiers rt = ref_tiers_of(l);
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
        for (size_t k = 0; k < nsegs; k++) {
            uint8_t tier = tiers != NULL ? tiers[k] : KV_TIER_FULL;
            assert(tier == KV_TIER_FULL || tier == KV_TIER_INT8 || tier == KV_TIER_INT4 ||
                   tier == KV_TIER_INT2);
            uint32_t slots = ref_tier_slots(l, &rt, tier);
            assert((uint64_t)segs[k].first_slot + segs[k].count <= slots);
            (void)slots;
            for (uint32_t j = 0; j < segs[k].count; j++, i++) {
                double dot = 0;
                for (uint32_t c = 0; c < d; c++)
                    dot += (double)qh[c] * ref_elt(l, &rt, t, pool, tier, segs[k].block, 0, g,
                                                   segs[k].first_slot + j, c);
                s[i] = dot * scale;
                mx = s[i] > mx ? s[i] : mx;
            }
        }
        for (i = 0; i < n; i++)
            sum += s[i] = exp(s[i] - mx);
        memset(acc, 0, d * sizeof *acc);
        i = 0;
        for (size_t k = 0; k < nsegs; k++) {
            uint8_t tier = tiers != NULL ? tiers[k] : KV_TIER_FULL;
            for (uint32_t j = 0; j < segs[k].count; j++, i++) {
                double p = s[i] / sum;
                if (probs != NULL)
                    probs[(size_t)h * n + i] = (float)p;
                for (uint32_t c = 0; c < d; c++)
                    acc[c] += p * ref_elt(l, &rt, t, pool, tier, segs[k].block, 1, g,
                                          segs[k].first_slot + j, c);
            }
        }
        for (uint32_t c = 0; c < d; c++)
            oh[c] = (float)acc[c];
    }
    free(s);
    free(acc);
}
