/*
 * int8_ref.c - reference INT8 tier kernels (POLICIES.md §5.4): each group is
 * gathered into a float array and handed to kv_quantize_group_ref, the
 * definition of the quantiser (T-CF4); addresses come from the layout
 * functions, tokens from a plain walk of the segment list.
 *
 * Slow on purpose; only the tests and tests/gpu call these.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ref_tokens.h"

/* Byte offset of element e of (block, kv, head, slot) in a pool of layout l. */
static size_t pool_elt(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head,
                       uint32_t slot, uint32_t e)
{
    size_t off = kv_key_offset(l, block, head, slot) + (size_t)e * l->elt_size;
    return kv ? off + kv_block_bytes(l) / 2 : off;
}

void kv_int8_quantize_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                          const uint32_t *qblocks, size_t nq)
{
    uint32_t T = l->block_tokens;
    size_t ntok = kv_segments_tokens(segs, nsegs);
    assert(ntok <= nq * (size_t)T);
    float *x = malloc((T ? T : 1) * sizeof *x);
    int8_t *q = malloc(T ? T : 1);
    if (x == NULL || q == NULL)
        abort(); /* test-only code */
    size_t codes = 2 * (size_t)l->kv_heads * T * l->head_dim;
    size_t scales = kv_int8_scale_offset(l, 0, 0, 0), bytes = kv_int8_block_bytes(l);
    for (size_t b = 0; b < nq; b++) {
        size_t first = b * T;
        uint8_t *base = qpool + kv_int8_code_offset(l, qblocks[b], 0, 0, 0);
        /* padding: after the codes and after the scales */
        memset(base + codes, 0, scales - codes);
        memset(base + scales + 8 * (size_t)l->kv_heads * l->head_dim, 0,
               bytes - scales - 8 * (size_t)l->kv_heads * l->head_dim);
        uint32_t m = ntok > first ? (uint32_t)(ntok - first < T ? ntok - first : T) : 0;
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c = 0; c < l->head_dim; c++) {
                    for (uint32_t i = 0; i < m; i++) {
                        uint32_t blk = 0, slot = 0;
                        kv_ref_nth_token(segs, nsegs, first + i, &blk, &slot);
                        x[i] = kv_elt_load(pool + pool_elt(l, blk, kv, h, slot, c), t);
                    }
                    float s = kv_quantize_group_ref(x, m, q);
                    for (uint32_t i = 0; i < T; i++)
                        qpool[kv_int8_code_offset(l, qblocks[b], kv, h, i) + c] =
                            (uint8_t)(i < m ? q[i] : 0);
                    memcpy(qpool + kv_int8_scale_offset(l, qblocks[b], kv, h) + 4 * (size_t)c, &s,
                           4);
                }
    }
    free(x);
    free(q);
}

void kv_int8_dequantize_ref(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                            size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                            const kv_segment *dst, size_t ndst)
{
    uint32_t qb, qs, db, ds;
    for (size_t i = 0;
         kv_ref_nth_token(qsegs, nqsegs, i, &qb, &qs) && kv_ref_nth_token(dst, ndst, i, &db, &ds);
         i++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t c = 0; c < l->head_dim; c++) {
                    int8_t code = (int8_t)qpool[kv_int8_code_offset(l, qb, kv, h, qs) + c];
                    float s;
                    memcpy(&s, qpool + kv_int8_scale_offset(l, qb, kv, h) + 4 * (size_t)c, 4);
                    float x;
                    kv_dequantize_group_ref(&code, 1, s, &x);
                    kv_elt_store(pool + pool_elt(dl, db, kv, h, ds, c), t, x);
                }
}
