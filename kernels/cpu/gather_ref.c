/*
 * gather_ref.c - reference kernels: one element at a time, addresses spelled
 * out from the layout in kernels.h without kv_key_offset, so the fast and
 * CUDA versions are checked against an independent formulation.
 *
 * Slow on purpose; only the tests and tests/gpu call these.
 */
#include <assert.h>
#include <string.h>

#include "kernels.h"
#include "ref_tokens.h"

/* Byte offset of element e of (block, kv = 0 for K / 1 for V, head, slot):
 * the pool is [block][kv][kv_heads][block_tokens][head_dim] elements. */
static size_t pool_elt(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head,
                       uint32_t slot, uint32_t e)
{
    size_t i = (size_t)block * 2 + kv;
    i = i * l->kv_heads + head;
    i = i * l->block_tokens + slot;
    i = i * l->head_dim + e;
    return i * l->elt_size;
}

/* Byte offset of element e of (head, token t) in a [kv_heads][ntokens]
 * [head_dim] buffer. */
static size_t flat_elt(const kv_layout *l, size_t ntokens, uint32_t head, size_t t, uint32_t e)
{
    return (((size_t)head * ntokens + t) * l->head_dim + e) * l->elt_size;
}

void kv_gather_ref(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                   uint8_t *k_out, uint8_t *v_out)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    uint8_t *out[2] = {k_out, v_out};
    for (uint32_t kv = 0; kv < 2; kv++) {
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            size_t t = 0;
            for (size_t s = 0; s < nsegs; s++) {
                assert(segs[s].first_slot + segs[s].count <= l->block_tokens);
                for (uint32_t j = 0; j < segs[s].count; j++, t++) {
                    for (uint32_t e = 0; e < l->head_dim; e++)
                        memcpy(out[kv] + flat_elt(l, ntokens, h, t, e),
                               pool + pool_elt(l, segs[s].block, kv, h, segs[s].first_slot + j, e),
                               l->elt_size);
                }
            }
        }
    }
}

void kv_scatter_ref(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                    const uint8_t *k_in, const uint8_t *v_in)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    const uint8_t *in[2] = {k_in, v_in};
    for (uint32_t kv = 0; kv < 2; kv++) {
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            size_t t = 0;
            for (size_t s = 0; s < nsegs; s++) {
                assert(segs[s].first_slot + segs[s].count <= l->block_tokens);
                for (uint32_t j = 0; j < segs[s].count; j++, t++) {
                    for (uint32_t e = 0; e < l->head_dim; e++)
                        memcpy(pool + pool_elt(l, segs[s].block, kv, h, segs[s].first_slot + j, e),
                               in[kv] + flat_elt(l, ntokens, h, t, e), l->elt_size);
                }
            }
        }
    }
}

void kv_copy_tokens_ref(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                        const kv_segment *dst, size_t ndst)
{
    uint32_t sb, ss, db, ds;
    /* Stops at the shorter list: the header asks for equal token counts. */
    for (size_t i = 0;
         kv_ref_nth_token(src, nsrc, i, &sb, &ss) && kv_ref_nth_token(dst, ndst, i, &db, &ds);
         i++) {
        assert(ss < l->block_tokens && ds < l->block_tokens);
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t e = 0; e < l->head_dim; e++)
                    memcpy(pool + pool_elt(l, db, kv, h, ds, e),
                           pool + pool_elt(l, sb, kv, h, ss, e), l->elt_size);
    }
}
