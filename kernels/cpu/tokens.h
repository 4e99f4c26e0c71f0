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

/* Bytes of one K or V row of the pool: one head, one slot. */
static inline size_t kv_row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

/* Channels converted per step by the fast kernels (a stack buffer). */
#define KV_CHUNK 256u

#endif
