/*
 * gather.c - fast CPU kernels: one memcpy per contiguous run.
 *
 * Within a block, the `count` consecutive slots of one head are contiguous in
 * both K and V (count * head_dim * elt_size bytes), and so are the matching
 * tokens of one head in a [kv_heads][ntokens][head_dim] buffer. So a segment
 * costs 2 * kv_heads memcpys, whatever its length; libc's memcpy then runs at
 * memory speed. Single-threaded: the daemon parallelises across sequences.
 */
#include <assert.h>
#include <string.h>

#include "kernels.h"

/* Bytes of one K or V row: one head, one slot. */
static size_t row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

/* Offset of the V half of a block relative to its K half. */
static size_t v_delta(const kv_layout *l)
{
    return kv_block_bytes(l) / 2;
}

/* Offset of (head, token t) in a [kv_heads][ntokens][head_dim] buffer. */
static size_t flat_offset(const kv_layout *l, uint32_t head, size_t ntokens, size_t t)
{
    return ((size_t)head * ntokens + t) * row_bytes(l);
}

void kv_gather(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
               uint8_t *k_out, uint8_t *v_out)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    size_t t = 0;
    for (size_t s = 0; s < nsegs; t += segs[s].count, s++) {
        size_t run = (size_t)segs[s].count * row_bytes(l);
        assert(segs[s].first_slot + segs[s].count <= l->block_tokens);
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            size_t po = kv_key_offset(l, segs[s].block, h, segs[s].first_slot);
            size_t fo = flat_offset(l, h, ntokens, t);
            memcpy(k_out + fo, pool + po, run);
            memcpy(v_out + fo, pool + po + v_delta(l), run);
        }
    }
}

void kv_scatter(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                const uint8_t *k_in, const uint8_t *v_in)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    size_t t = 0;
    for (size_t s = 0; s < nsegs; t += segs[s].count, s++) {
        size_t run = (size_t)segs[s].count * row_bytes(l);
        assert(segs[s].first_slot + segs[s].count <= l->block_tokens);
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            size_t po = kv_key_offset(l, segs[s].block, h, segs[s].first_slot);
            size_t fo = flat_offset(l, h, ntokens, t);
            memcpy(pool + po, k_in + fo, run);
            memcpy(pool + po + v_delta(l), v_in + fo, run);
        }
    }
}

/* A position in a segment list: segment index and tokens used of it. */
typedef struct seg_cursor {
    const kv_segment *segs;
    size_t nsegs;
    size_t i;
    uint32_t used;
} seg_cursor;

/* Skip exhausted (and empty) segments; returns tokens left in the current
 * one, 0 at the end of the list. */
static uint32_t cursor_left(seg_cursor *c)
{
    while (c->i < c->nsegs && c->used == c->segs[c->i].count) {
        c->i++;
        c->used = 0;
    }
    return c->i < c->nsegs ? c->segs[c->i].count - c->used : 0;
}

void kv_copy_tokens(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                    const kv_segment *dst, size_t ndst)
{
    seg_cursor s = {src, nsrc, 0, 0}, d = {dst, ndst, 0, 0};
    size_t row = row_bytes(l);
    uint32_t sl, dl;
    /* Each step copies the longest run contiguous in both lists; stops at the
     * shorter list, like the reference. */
    while ((sl = cursor_left(&s)) != 0 && (dl = cursor_left(&d)) != 0) {
        uint32_t n = sl < dl ? sl : dl;
        const kv_segment *ss = &src[s.i], *ds = &dst[d.i];
        assert(ss->first_slot + ss->count <= l->block_tokens);
        assert(ds->first_slot + ds->count <= l->block_tokens);
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            size_t so = kv_key_offset(l, ss->block, h, ss->first_slot + s.used);
            size_t dof = kv_key_offset(l, ds->block, h, ds->first_slot + d.used);
            memcpy(pool + dof, pool + so, n * row);
            memcpy(pool + dof + v_delta(l), pool + so + v_delta(l), n * row);
        }
        s.used += n;
        d.used += n;
    }
}
