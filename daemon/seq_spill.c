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

void seq_spill_key_part(uint32_t part, char out[12])
{
    snprintf(out, 12, "v%u", part);
}

/* The victims of list ly stored in pool block b (its tier `tier`), in
 * position order (the offloaded array's), into out (room for noffloaded). */
static size_t block_victims(const seq_list *ly, uint32_t b, uint8_t *tier, uint32_t *out)
{
    size_t n = 0;
    for (size_t j = 0; j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        if (at->tier == POLICY_SKETCH || tier_token_remote(at) || at->block != b)
            continue;
        *tier = at->tier;
        out[n++] = ly->offloaded[j];
    }
    return n;
}

void seq_spill_free(seq_spill *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->blocks[i].positions);
    free(p->blocks);
    free(p->ids);
    memset(p, 0, sizeof *p);
}

status_code seq_spill_plan(seq *s, seq_spill *out, status *st)
{
    memset(out, 0, sizeof *out);
    size_t n = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        n += s->lists[i].nvictim_blocks;
    if (n == 0)
        return ST_OK;
    if (n > (size_t)(SEQ_REMOTE_BLOCK - 1) - s->spill_parts)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "sequence %llu spilled %u parts already; it cannot spill more",
                          (unsigned long long)s->id, s->spill_parts);
    out->blocks = calloc(n, sizeof *out->blocks);
    out->ids = malloc(n * sizeof *out->ids);
    if (out->blocks == NULL || out->ids == NULL) {
        seq_spill_free(out);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (uint32_t l = 0; l < s->nlayers; l++)
        for (uint32_t k = 0; k < s->heads; k++) {
            const seq_list *ly = seq_list_at(s, l, k);
            for (size_t v = 0; v < ly->nvictim_blocks; v++) {
                seq_spill_block *b = &out->blocks[out->n];
                *b = (seq_spill_block){.layer = l, .head = k, .block = ly->victim_blocks[v]};
                b->positions = malloc((ly->noffloaded ? ly->noffloaded : 1) * sizeof *b->positions);
                if (b->positions == NULL) {
                    seq_spill_free(out);
                    return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
                }
                b->npositions = block_victims(ly, b->block, &b->tier, b->positions);
                out->ids[out->n++] = b->block;
            }
        }
    /* Numbered only once the plan stands: a failed plan wastes no part. */
    for (size_t i = 0; i < out->n; i++)
        out->blocks[i].part = s->spill_parts++;
    return ST_OK;
}

/* Whether list ly's victims in pool block b are still exactly positions
 * pos[0..n) (memory pressure may have dropped the block, and the pool
 * given it to another victim block meanwhile). */
static int block_unchanged(const seq_list *ly, uint32_t b, const uint32_t *pos, size_t n)
{
    size_t m = 0;
    int listed = 0;
    for (size_t v = 0; v < ly->nvictim_blocks; v++)
        listed |= ly->victim_blocks[v] == b;
    for (size_t j = 0; listed && j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        if (at->tier == POLICY_SKETCH || tier_token_remote(at) || at->block != b)
            continue;
        if (m == n || ly->offloaded[j] != pos[m])
            return 0;
        m++;
    }
    return listed && m == n && n > 0;
}

void seq_spill_commit(seq *s, seq_spill *p)
{
    for (size_t i = 0; i < p->n; i++) {
        seq_spill_block *b = &p->blocks[i];
        seq_list *ly = seq_list_at(s, b->layer, b->head);
        if (!block_unchanged(ly, b->block, b->positions, b->npositions))
            continue;
        for (size_t j = 0; j < ly->noffloaded; j++) {
            tier_token *at = &ly->offloaded_at[j];
            if (at->tier != POLICY_SKETCH && !tier_token_remote(at) && at->block == b->block)
                at->block = SEQ_REMOTE_BLOCK | b->part;
        }
        size_t kept = 0;
        for (size_t v = 0; v < ly->nvictim_blocks; v++)
            if (ly->victim_blocks[v] != b->block)
                ly->victim_blocks[kept++] = ly->victim_blocks[v];
        ly->nvictim_blocks = kept;
        pool_free_block(s->pool, b->block);
        b->committed = 1;
        s->spilled_tokens += b->npositions;
        s->spilled_blocks++;
    }
}
