/*
 * sketch_ref.c - reference count-sketch kernels (POLICIES.md §3.3, Alg.
 * 1-3): the definition of the Vague store's arithmetic. Each token's K and V
 * are read from the pool through kv_elt_load, one channel at a time; the
 * fast (sketch.c) and CUDA versions repeat the same sequence of IEEE
 * operations and equal these exactly (tests/unit/test_kernels_sketch.c).
 * The §3.3 paper vectors (tests/unit/test_policy_reviver.c) run on these.
 *
 * Slow on purpose; only the tests and tests/gpu call these.
 */
#include <assert.h>
#include <stddef.h>

#include "kernels.h"
#include "ref_tokens.h"

/* Byte offset of channel c (= head * head_dim + j) of a token's K (kv = 0)
 * or V (kv = 1) in the pool. */
static size_t chan_offset(const kv_layout *l, uint32_t block, uint32_t slot, uint32_t kv,
                          uint32_t c)
{
    uint32_t head = c / l->head_dim, j = c % l->head_dim;
    size_t off = kv_key_offset(l, block, head, slot) + (size_t)j * l->elt_size;
    return kv ? off + kv_block_bytes(l) / 2 : off;
}

void kv_sketch_insert_ref(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g)
{
    assert(sk->dim == l->kv_heads * l->head_dim);
    uint32_t blk, slot;
    for (size_t n = 0; kv_ref_nth_token(segs, nsegs, n, &blk, &slot); n++) {
        const uint32_t *hn = h + n * sk->rows;
        const int8_t *gn = g + n * sk->rows;
        /* Alg. 1: key cell += k, value cell += g·v, count += 1 */
        for (uint32_t i = 0; i < sk->rows; i++) {
            size_t cell = (size_t)i * sk->buckets + hn[i];
            float *ck = sk->key + cell * sk->dim;
            float *cv = sk->value + cell * sk->dim;
            float sign = 1.0f, gv = sign * (float)gn[i];
            for (uint32_t c = 0; c < sk->dim; c++) {
                ck[c] += sign * kv_elt_load(pool + chan_offset(l, blk, slot, 0, c), t);
                cv[c] += gv * kv_elt_load(pool + chan_offset(l, blk, slot, 1, c), t);
            }
            sk->count[cell] += 1;
        }
    }
}

/* Lower median of x[0..n): the middle for odd n, the lower middle for even
 * n (torch.median; [RECON] for even rows). Insertion sort, n <= 32. */
static float lower_median(float *x, uint32_t n)
{
    for (uint32_t i = 1; i < n; i++) {
        float v = x[i];
        uint32_t j = i;
        for (; j > 0 && x[j - 1] > v; j--)
            x[j] = x[j - 1];
        x[j] = v;
    }
    return x[(n - 1) / 2];
}

/* One channel of one half of a query (Alg. 2): per row the cell (times
 * g[i] for values; over its count in MEAN mode), then the lower median. */
static float query_chan(const kv_sketch *sk, const float *cells, const uint32_t *h, const int8_t *g,
                        kv_estimate est, uint32_t c)
{
    float row[KV_SKETCH_MAX_ROWS];
    for (uint32_t i = 0; i < sk->rows; i++) {
        size_t cell = (size_t)i * sk->buckets + h[i];
        float x = cells[cell * sk->dim + c];
        if (g != NULL)
            x *= (float)g[i];
        if (est == KV_ESTIMATE_MEAN && sk->count[cell] > 0)
            x /= (float)sk->count[cell];
        row[i] = x;
    }
    return lower_median(row, sk->rows);
}

/* Query (and with del, delete) tokens in order; pool NULL stores nothing. */
static void query_tokens(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                         kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs, size_t n,
                         int del)
{
    assert(sk->rows >= 1 && sk->rows <= KV_SKETCH_MAX_ROWS);
    for (size_t k = 0; k < n; k++) {
        uint32_t blk = 0, slot = 0;
        if (pool != NULL && !kv_ref_nth_token(segs, nsegs, k, &blk, &slot))
            return;
        const uint32_t *hk = h + k * sk->rows;
        const int8_t *gk = g + k * sk->rows;
        for (uint32_t c = 0; c < sk->dim; c++) {
            float ke = query_chan(sk, sk->key, hk, NULL, sk->key_estimate, c);
            float ve = query_chan(sk, sk->value, hk, gk, sk->value_estimate, c);
            if (pool != NULL) {
                kv_elt_store(pool + chan_offset(l, blk, slot, 0, c), t, ke);
                kv_elt_store(pool + chan_offset(l, blk, slot, 1, c), t, ve);
            }
            if (!del)
                continue;
            /* Alg. 3's delete of the estimate: only channel c of the
             * cells changes, and counts change after every channel. */
            for (uint32_t i = 0; i < sk->rows; i++) {
                size_t cell = (size_t)i * sk->buckets + hk[i];
                float sign = -1.0f, gv = sign * (float)gk[i];
                sk->key[cell * sk->dim + c] += sign * ke;
                sk->value[cell * sk->dim + c] += gv * ve;
            }
        }
        if (del)
            for (uint32_t i = 0; i < sk->rows; i++)
                sk->count[(size_t)i * sk->buckets + hk[i]] -= 1;
    }
}

void kv_sketch_query_ref(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                         const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                         size_t nsegs)
{
    assert(sk->dim == l->kv_heads * l->head_dim);
    kv_sketch copy = *sk; /* not modified: del = 0 */
    query_tokens(&copy, h, g, l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), 0);
}

void kv_sketch_revive_ref(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                          kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs)
{
    assert(pool == NULL || sk->dim == l->kv_heads * l->head_dim);
    query_tokens(sk, h, g, l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), 1);
}
