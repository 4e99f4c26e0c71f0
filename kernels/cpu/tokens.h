/*
 * tokens.h - walking a segment list token by token (internal to
 * kernels/cpu). Allocation-free, so kernels can seek to any token of a list
 * (a thread's share) without building a table.
 */
#ifndef KVSTASH_KERNELS_TOKENS_H
#define KVSTASH_KERNELS_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

typedef struct kv_cursor {
    const kv_segment *segs;
    size_t nsegs;
    size_t i;      /* current segment */
    uint32_t used; /* tokens of it already returned */
} kv_cursor;

/* A cursor on token `skip` of the list (past the end when skip is). */
static inline void kv_cursor_init(kv_cursor *c, const kv_segment *segs, size_t nsegs, size_t skip)
{
    c->segs = segs;
    c->nsegs = nsegs;
    c->i = 0;
    c->used = 0;
    while (c->i < nsegs && skip >= segs[c->i].count) {
        skip -= segs[c->i].count;
        c->i++;
    }
    c->used = (uint32_t)skip;
}

/* The next token's (block, slot); 0 at the end of the list. */
static inline int kv_cursor_next(kv_cursor *c, uint32_t *block, uint32_t *slot)
{
    while (c->i < c->nsegs && c->used >= c->segs[c->i].count) {
        c->i++;
        c->used = 0;
    }
    if (c->i >= c->nsegs)
        return 0;
    *block = c->segs[c->i].block;
    *slot = c->segs[c->i].first_slot + c->used++;
    return 1;
}

/* Tokens left in the current segment (skipping exhausted and empty ones),
 * 0 at the end; *block and *slot receive the first of them. */
static inline uint32_t kv_cursor_run(kv_cursor *c, uint32_t *block, uint32_t *slot)
{
    while (c->i < c->nsegs && c->used >= c->segs[c->i].count) {
        c->i++;
        c->used = 0;
    }
    if (c->i >= c->nsegs)
        return 0;
    *block = c->segs[c->i].block;
    *slot = c->segs[c->i].first_slot + c->used;
    return c->segs[c->i].count - c->used;
}

/* Consume n tokens of the current segment (n <= what kv_cursor_run said). */
static inline void kv_cursor_skip(kv_cursor *c, uint32_t n)
{
    c->used += n;
}

/* Tokens [lo, hi) of two lists of the same length, in runs that stay in
 * one segment of each: fn(ctx, block and first slot in `a`, the same in
 * `b`, run length), in list order. For kernels that move the i-th token
 * of one list to the i-th slot of another (dequantisation). */
typedef void (*kv_pair_run_fn)(const void *ctx, uint32_t ablock, uint32_t aslot, uint32_t bblock,
                               uint32_t bslot, uint32_t n);

static inline void kv_walk_pairs(const kv_segment *a, size_t na, const kv_segment *b, size_t nb,
                                 size_t lo, size_t hi, kv_pair_run_fn fn, const void *ctx)
{
    kv_cursor ca, cb;
    kv_cursor_init(&ca, a, na, lo);
    kv_cursor_init(&cb, b, nb, lo);
    for (size_t i = lo; i < hi;) {
        uint32_t ab, as, bb, bs;
        uint32_t ra = kv_cursor_run(&ca, &ab, &as), rb = kv_cursor_run(&cb, &bb, &bs);
        if (ra == 0 || rb == 0)
            return;
        uint32_t n = ra < rb ? ra : rb;
        if (n > hi - i)
            n = (uint32_t)(hi - i);
        fn(ctx, ab, as, bb, bs, n);
        kv_cursor_skip(&ca, n);
        kv_cursor_skip(&cb, n);
        i += n;
    }
}

/* Bytes of one K or V row of the pool: one head, one slot. */
static inline size_t kv_row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

/* Channels converted per step by the fast kernels (a stack buffer). */
#define KV_CHUNK 256u

#endif
