/*
 * seq_spill.c - victim blocks leaving the pool for the remote tier (seq.h
 * "Spilling victims"). Decides nothing and moves no byte: it names the
 * blocks, and once the caller wrote them, frees them and marks their
 * victims remote.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

const char *seq_remote_uid(const seq *s)
{
    return s->remote_uid;
}

void seq_set_remote_uid(seq *s, const char *uid)
{
    snprintf(s->remote_uid, sizeof s->remote_uid, "%s", uid);
}

uint32_t seq_spill_parts(const seq *s)
{
    return s->spill_parts;
}

uint64_t seq_spilled_tokens(const seq *s)
{
    return s->spilled_tokens;
}

uint64_t seq_spilled_blocks(const seq *s)
{
    return s->spilled_blocks;
}

uint64_t seq_spilled_bytes(const seq *s)
{
    return s->spilled_bytes;
}

void seq_spill_key_part(uint32_t part, char out[12])
{
    snprintf(out, 12, "v%u", part);
}

/* The victims of list ly stored in pool block b, or in its own sketch (b
 * TIER_NO_BLOCK), in position order (the offloaded array's), into out
 * (room for noffloaded); *tier is theirs. */
static size_t block_victims(const seq_list *ly, uint32_t b, uint8_t *tier, uint32_t *out)
{
    size_t n = 0;
    for (size_t j = 0; j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        int here = b == TIER_NO_BLOCK ? tier_token_local_sketch(at)
                                      : at->tier != POLICY_SKETCH && at->block == b;
        if (!here)
            continue;
        *tier = at->tier;
        out[n++] = ly->offloaded[j];
    }
    return n;
}

/* Whether list ly's sketch can leave: it has cells, and only victims are
 * in it (a policy's sketch tokens are read and changed by its steps). */
static int sketch_spillable(const seq_list *ly)
{
    if (ly->sketch.sk.key == NULL)
        return 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        if (ly->seg_tier[i] == POLICY_SKETCH)
            return 0;
    for (size_t j = 0; j < ly->noffloaded; j++)
        if (tier_token_local_sketch(&ly->offloaded_at[j]))
            return 1;
    return 0;
}

void seq_spill_free(seq_spill *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->blocks[i].positions);
    free(p->blocks);
    memset(p, 0, sizeof *p);
}

/* Entry p->n: list (l, k)'s pool block b, or its sketch (TIER_NO_BLOCK). */
static int plan_add(seq_spill *p, seq *s, uint32_t l, uint32_t k, uint32_t b)
{
    const seq_list *ly = seq_list_at(s, l, k);
    seq_spill_block *e = &p->blocks[p->n];
    *e = (seq_spill_block){.layer = l, .head = k, .block = b, .offset = p->bytes};
    e->bytes = b == TIER_NO_BLOCK ? tier_sketch_bytes(&ly->sketch) : s->pool->block_bytes;
    e->positions = malloc((ly->noffloaded ? ly->noffloaded : 1) * sizeof *e->positions);
    if (e->positions == NULL)
        return -1;
    e->npositions = block_victims(ly, b, &e->tier, e->positions);
    p->bytes += e->bytes;
    p->n++;
    return 0;
}

size_t seq_spill_candidates(const seq *s)
{
    size_t n = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        n += s->lists[i].nvictim_blocks + (size_t)sketch_spillable(&s->lists[i]);
    return n;
}

status_code seq_spill_plan(seq *s, seq_spill *out, status *st)
{
    memset(out, 0, sizeof *out);
    size_t n = seq_spill_candidates(s);
    if (n == 0)
        return ST_OK;
    if (n > (size_t)(SEQ_REMOTE_BLOCK - 1) - s->spill_parts)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "sequence %llu spilled %u parts already; it cannot spill more",
                          (unsigned long long)s->id, s->spill_parts);
    if ((out->blocks = calloc(n, sizeof *out->blocks)) == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    int rc = 0;
    for (uint32_t l = 0; rc == 0 && l < s->nlayers; l++)
        for (uint32_t k = 0; rc == 0 && k < s->heads; k++) {
            const seq_list *ly = seq_list_at(s, l, k);
            for (size_t v = 0; rc == 0 && v < ly->nvictim_blocks; v++)
                rc = plan_add(out, s, l, k, ly->victim_blocks[v]);
            if (rc == 0 && sketch_spillable(ly))
                rc = plan_add(out, s, l, k, TIER_NO_BLOCK);
        }
    if (rc != 0) {
        seq_spill_free(out);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    /* Numbered only once the plan stands: a failed plan wastes no part. */
    for (size_t i = 0; i < out->n; i++)
        out->blocks[i].part = s->spill_parts++;
    return ST_OK;
}

int seq_spill_read(seq *s, const seq_spill *p, uint8_t *host)
{
    for (size_t i = 0; i < p->n; i++) {
        const seq_spill_block *b = &p->blocks[i];
        int rc =
            b->block == TIER_NO_BLOCK
                ? tier_sketch_save(&seq_list_at(s, b->layer, b->head)->sketch, host + b->offset)
                : pool_read_blocks(s->pool, &b->block, 1, host + b->offset);
        if (rc != 0)
            return -1;
    }
    return 0;
}

/* Whether list ly's victims in pool block b (or its sketch) are still
 * exactly positions pos[0..n): memory pressure may have dropped the block,
 * and the pool given it to another victim block, or a step added victims
 * to the sketch, meanwhile. */
static int block_unchanged(const seq_list *ly, uint32_t b, const uint32_t *pos, size_t n)
{
    int listed = b == TIER_NO_BLOCK && sketch_spillable(ly);
    for (size_t v = 0; b != TIER_NO_BLOCK && v < ly->nvictim_blocks; v++)
        listed |= ly->victim_blocks[v] == b;
    size_t m = 0;
    for (size_t j = 0; listed && j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        int here = b == TIER_NO_BLOCK ? tier_token_local_sketch(at)
                                      : at->tier != POLICY_SKETCH && at->block == b;
        if (!here)
            continue;
        if (m == n || ly->offloaded[j] != pos[m])
            return 0;
        m++;
    }
    return listed && m == n && n > 0;
}

/* The planned block (or sketch) b left: its victims are remote, its
 * memory is free. */
static void commit_one(seq *s, seq_list *ly, seq_spill_block *b)
{
    for (size_t j = 0; j < ly->noffloaded; j++) {
        tier_token *at = &ly->offloaded_at[j];
        int here = b->block == TIER_NO_BLOCK ? tier_token_local_sketch(at)
                                             : at->tier != POLICY_SKETCH && at->block == b->block;
        if (here)
            at->block = SEQ_REMOTE_BLOCK | b->part;
    }
    if (b->block == TIER_NO_BLOCK) {
        tier_sketch_free(&ly->sketch); /* the next victims start a fresh one */
    } else {
        size_t kept = 0;
        for (size_t v = 0; v < ly->nvictim_blocks; v++)
            if (ly->victim_blocks[v] != b->block)
                ly->victim_blocks[kept++] = ly->victim_blocks[v];
        ly->nvictim_blocks = kept;
        seq_give_block(s, b->block);
        s->spilled_blocks++;
    }
    b->committed = 1;
    s->spilled_tokens += b->npositions;
    s->spilled_bytes += b->bytes;
}

void seq_spill_commit(seq *s, seq_spill *p)
{
    for (size_t i = 0; i < p->n; i++) {
        seq_spill_block *b = &p->blocks[i];
        seq_list *ly = seq_list_at(s, b->layer, b->head);
        if (block_unchanged(ly, b->block, b->positions, b->npositions))
            commit_one(s, ly, b);
    }
}
