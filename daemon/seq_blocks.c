/*
 * seq_blocks.c - where a sequence's blocks come from and go: its pool,
 * under the store's lock; or, while the sequence is detached (seq.h
 * seq_detach), a reserve taken from the pool beforehand, so that a step
 * can apply a long decision without the lock while other sequences' calls
 * take and give the pool's blocks under it.
 */
#include <stdlib.h>

#include "seq_internal.h"

/* Blocks a detached step may take: what one call's compactions copy into
 * fresh blocks (seq_apply.c list_compact: a first window of compact_window
 * tokens, then up to compact_budget more, and never more than the lists
 * hold) with a partial block for each list, and a few more. Any other
 * taking (a policy that quantises) may find the reserve short; the step
 * then runs again under the lock. */
static uint32_t reserve_wanted(seq *s)
{
    uint64_t tokens = (uint64_t)s->compact_window + s->compact_budget;
    uint64_t held = seq_tokens_held(s);
    tokens = held < tokens ? held : tokens;
    uint64_t n = tokens / s->block_slots + seq_nlists(s) + 2;
    return n < UINT32_MAX ? (uint32_t)n : UINT32_MAX;
}

/* Blocks the sequence holds at most: what a detached step could give back
 * (with those it takes from the reserve). */
static size_t blocks_held_at_most(const seq *s)
{
    size_t n = s->nretired;
    for (size_t i = 0; i < seq_nlists(s); i++) {
        const seq_list *ly = &s->lists[i];
        n += ly->nsegs + ly->noffloaded + ly->nvictim_blocks + (size_t)ly->has_tail;
    }
    return n;
}

int seq_detach(seq *s)
{
    seq_reserve *r = &s->detached;
    uint32_t want = reserve_wanted(s);
    pool *p = s->pool;
    /* A nearly full pool stays with the lock: a reserve would make other
     * sequences' appends fail for the blocks it holds a moment. */
    if (r->on || s->txn.active || (uint64_t)want * SEQ_DETACH_FREE_FACTOR > p->nfree)
        return -1;
    size_t given_cap = blocks_held_at_most(s) + want;
    r->blocks = malloc(want * sizeof *r->blocks);
    r->given = malloc(given_cap * sizeof *r->given);
    if (r->blocks == NULL || r->given == NULL) {
        free(r->blocks);
        free(r->given);
        *r = (seq_reserve){0};
        return -1;
    }
    for (r->n = 0; r->n < want; r->n++)
        pool_alloc_block(p, &r->blocks[r->n]); /* nfree checked above */
    r->cap = want;
    r->given_cap = given_cap;
    r->ngiven = 0;
    r->short_of = 0;
    r->on = 1;
    return 0;
}

void seq_attach(seq *s)
{
    seq_reserve *r = &s->detached;
    if (!r->on)
        return;
    /* Back in the order taken, so that a reserve nobody used leaves the
     * pool's free stack as it was. */
    while (r->n > 0)
        pool_free_block(s->pool, r->blocks[--r->n]);
    for (size_t i = 0; i < r->ngiven; i++)
        pool_free_block(s->pool, r->given[i]);
    free(r->blocks);
    free(r->given);
    *r = (seq_reserve){0};
}

int seq_detached(const seq *s)
{
    return s->detached.on;
}

int seq_detached_short(const seq *s)
{
    return s->detached.on && s->detached.short_of;
}

int seq_take_block(seq *s, uint32_t *block)
{
    seq_reserve *r = &s->detached;
    if (!r->on)
        return pool_alloc_block(s->pool, block);
    if (r->n == 0) {
        r->short_of = 1;
        return -1;
    }
    *block = r->blocks[--r->n];
    return 0;
}

void seq_give_block(seq *s, uint32_t block)
{
    seq_reserve *r = &s->detached;
    if (!r->on) {
        pool_free_block(s->pool, block);
        return;
    }
    /* given_cap counts every block the sequence holds or can take: a
     * block is given once. */
    if (r->ngiven < r->given_cap)
        r->given[r->ngiven++] = block;
}

uint32_t seq_free_blocks(const seq *s)
{
    return s->detached.on ? s->detached.n : s->pool->nfree;
}

void seq_blocks_begin(seq *s)
{
    seq_reserve *r = &s->detached;
    if (!r->on) {
        pool_savepoint(s->pool);
        return;
    }
    r->txn_n = r->n;
    r->txn_ngiven = r->ngiven;
}

void seq_blocks_end(seq *s)
{
    if (!s->detached.on)
        pool_release(s->pool);
}

void seq_blocks_rollback(seq *s)
{
    seq_reserve *r = &s->detached;
    if (!r->on) {
        pool_rollback(s->pool);
        return;
    }
    /* Taking never overwrites the reserve's ids: those taken since begin
     * are still above n. */
    r->n = r->txn_n;
    r->ngiven = r->txn_ngiven;
}
