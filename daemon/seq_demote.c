/*
 * seq_demote.c - the demotion a step leaves due, in three parts (seq.h
 * seq_demote_plan), so that its quantisation runs without the store's
 * lock: a step that demotes no longer holds up every other sequence.
 *
 * The plan takes what list_demote_to would take in the step (the oldest
 * tokens decided quantised but stored at full precision, whole blocks'
 * worth, POLICIES.md §5.4) and what list_victims_quantize would (victims=int8:
 * the victims still at full precision, whole INT8 blocks' worth), the fill
 * quantises into copies of each list's tokens and victims, and the finish
 * publishes the copies as the lists, in a transaction of its own. The fill reads only the pool's
 * memory of the planned tokens and writes only the planned blocks, which is why it may run while
 * other sequences change.
 */
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

static const uint8_t demote_tiers[] = {POLICY_INT8, POLICY_INT4, POLICY_INT2};
#define DEMOTE_TIERS (sizeof demote_tiers)

/* One list's part: its tokens as the plan found them (tok) and as they
 * will be (dst), and per quantised tier the tokens to quantise (indices
 * into tok, concatenated over the tiers) and the blocks they go to. */
typedef struct demote_list {
    seq_list *ly;
    uint32_t n;
    tier_token *tok, *dst;
    uint32_t *idx, *qb;
    size_t m[DEMOTE_TIERS], nq[DEMOTE_TIERS];
    double ratio[DEMOTE_TIERS];
    /* victims=int8: the victims as they will be, the ones to quantise
     * (indices into the list's offloaded_at) and their INT8 blocks */
    tier_token *vdst;
    uint32_t *vidx, *vqb;
    size_t vm, vnq;
    double vratio;
} demote_list;

struct seq_demote_job {
    seq *s;
    uint64_t epoch;
    demote_list *lists;
    size_t nlists;
};

static void job_free(seq_demote_job *j)
{
    for (size_t i = 0; i < j->nlists; i++) {
        demote_list *d = &j->lists[i];
        free(d->tok), free(d->dst), free(d->idx), free(d->qb);
        free(d->vdst), free(d->vidx), free(d->vqb);
    }
    free(j->lists);
    free(j);
}

/* The planned blocks back to the pool, the last taken first: the free
 * stack is then as before the plan, unless the pool moved meanwhile. */
static void give_back(seq_demote_job *j)
{
    for (size_t i = j->nlists; i-- > 0;) {
        demote_list *d = &j->lists[i];
        for (size_t b = d->vnq; b-- > 0;)
            pool_free_block(j->s->pool, d->vqb[b]);
        size_t nq = 0;
        for (size_t q = 0; q < DEMOTE_TIERS; q++)
            nq += d->nq[q];
        while (nq-- > 0)
            pool_free_block(j->s->pool, d->qb[nq]);
    }
}

/* victims=int8: list d's victims still at full precision, in whole INT8
 * blocks (the rest wait in their slots), with their blocks taken; as
 * list_victims_quantize in the step. Returns the blocks, or -1. */
static long plan_victims(seq *s, demote_list *d)
{
    const seq_list *ly = d->ly;
    uint32_t t8 = s->tier.l8.block_tokens;
    size_t m = 0, noff = ly->noffloaded;
    if (t8 == 0 || noff < t8)
        return 0;
    d->vidx = malloc(noff * sizeof *d->vidx);
    if (d->vidx == NULL)
        return -1;
    for (size_t j = 0; j < noff; j++)
        if (ly->offloaded_at[j].tier == POLICY_FULL)
            d->vidx[m++] = (uint32_t)j;
    size_t nq = m / t8;
    if (nq == 0 || nq > s->pool->nfree)
        return 0;
    d->vdst = malloc(noff * sizeof *d->vdst);
    d->vqb = malloc(nq * sizeof *d->vqb);
    if (d->vdst == NULL || d->vqb == NULL)
        return -1;
    memcpy(d->vdst, ly->offloaded_at, noff * sizeof *d->vdst);
    for (size_t b = 0; b < nq; b++)
        pool_alloc_block(s->pool, &d->vqb[b]);
    d->vm = nq * t8;
    d->vnq = nq;
    return (long)nq;
}

/* Choose list d's tokens to demote, tier by tier, and take their blocks
 * while the pool has them (a tier it has not waits for the next step, as
 * in list_demote_to). Returns the blocks taken, or -1 when out of memory. */
static long plan_list(seq *s, uint32_t l, uint32_t k, demote_list *d)
{
    const policy_layer_view *v = policy_host_view(s->host, l);
    uint32_t n = v->tokens[k];
    const uint8_t *tier = v->tier[k];
    *d = (demote_list){.ly = seq_list_at(s, l, k), .n = n};
    d->tok = list_expand(d->ly, n);
    d->dst = malloc((n ? n : 1) * sizeof *d->dst);
    d->idx = malloc((n ? n : 1) * sizeof *d->idx);
    d->qb = malloc((n ? n : 1) * sizeof *d->qb);
    if (d->tok == NULL || d->dst == NULL || d->idx == NULL || d->qb == NULL)
        return -1;
    memcpy(d->dst, d->tok, (size_t)n * sizeof *d->dst);
    size_t at = 0, taken = 0;
    for (size_t q = 0; q < DEMOTE_TIERS; q++) {
        uint8_t qt = demote_tiers[q];
        uint32_t t8 = tier_block_tokens(&s->tier, qt);
        size_t m = 0;
        for (uint32_t i = 0; t8 > 0 && i < n; i++)
            if (tier[i] == qt && d->tok[i].tier == POLICY_FULL)
                d->idx[at + m++] = i;
        size_t nq = t8 > 0 ? m / t8 : 0;
        if (nq == 0 || nq > s->pool->nfree)
            continue;
        for (size_t b = 0; b < nq; b++)
            pool_alloc_block(s->pool, &d->qb[taken + b]);
        d->m[q] = nq * t8;
        d->nq[q] = nq;
        at += d->m[q];
        taken += nq;
    }
    long vt = plan_victims(s, d);
    return vt < 0 ? -1 : (long)taken + vt;
}

int seq_demote_is_due(const seq *s)
{
    for (size_t i = 0; i < seq_nlists(s); i++)
        if (s->lists[i].demote_due)
            return 1;
    return 0;
}

status_code seq_demote_plan(seq *s, uint64_t epoch, seq_demote_job **out, status *st)
{
    *out = NULL;
    size_t due = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        due += s->lists[i].demote_due;
    if (due == 0)
        return ST_OK;
    seq_demote_job *j = calloc(1, sizeof *j);
    demote_list *lists = calloc(due, sizeof *lists);
    if (j == NULL || lists == NULL) {
        free(j);
        free(lists);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    *j = (seq_demote_job){.s = s, .epoch = epoch, .lists = lists};
    long taken = 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        for (uint32_t k = 0; k < s->heads && taken >= 0; k++) {
            seq_list *ly = seq_list_at(s, l, k);
            if (!ly->demote_due)
                continue;
            ly->demote_due = 0;
            long t = plan_list(s, l, k, &j->lists[j->nlists++]);
            taken = t < 0 ? -1 : taken + t;
        }
    if (taken <= 0) {
        give_back(j);
        job_free(j);
        return taken < 0 ? status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory") : ST_OK;
    }
    *out = j;
    return ST_OK;
}

int seq_demote_fill(seq_demote_job *j)
{
    for (size_t i = 0; i < j->nlists; i++) {
        demote_list *d = &j->lists[i];
        size_t at = 0, b = 0;
        for (size_t q = 0; q < DEMOTE_TIERS; q++) {
            if (d->m[q] > 0 && seq_quantize_into(j->s, demote_tiers[q], d->dst, d->idx + at,
                                                 d->m[q], d->qb + b, d->nq[q], &d->ratio[q]) != 0)
                return -1;
            at += d->m[q];
            b += d->nq[q];
        }
        if (d->vm > 0 && seq_quantize_into(j->s, POLICY_INT8, d->vdst, d->vidx, d->vm, d->vqb,
                                           d->vnq, &d->vratio) != 0)
            return -1;
    }
    return 0;
}

/* List d becomes its demoted tokens; the blocks it no longer uses are
 * retired at `epoch`. Inside the finish's transaction. */
static int publish_list(seq *s, demote_list *d, uint64_t epoch)
{
    seq_list *ly = d->ly;
    size_t cap = (size_t)d->n + ly->noffloaded + 2; /* list_block_ids' room, the tail included */
    uint32_t *before = malloc(2 * cap * sizeof *before), *after = before + cap;
    if (before == NULL || seq_txn_save_list(s, ly) != 0) {
        free(before);
        return -1;
    }
    size_t nb = list_block_ids(ly, d->tok, d->n, 1, before);
    int rc = d->vnq > 0 ? seq_grow((void **)&ly->victim_blocks, &ly->victim_blocks_cap,
                                   ly->nvictim_blocks + d->vnq, sizeof *ly->victim_blocks)
                        : 0;
    if (rc == 0 && d->vnq > 0) {
        memcpy(ly->offloaded_at, d->vdst, ly->noffloaded * sizeof *ly->offloaded_at);
        memcpy(ly->victim_blocks + ly->nvictim_blocks, d->vqb, d->vnq * sizeof *d->vqb);
        ly->nvictim_blocks += d->vnq;
        seq_moved(s, POLICY_INT8, d->vm);
    }
    /* The step compacted before the demotion left its holes: as in the
     * step's own order (list_apply), the survivors are compacted after. */
    if (rc == 0)
        rc = list_compact(s, ly, d->dst, d->n);
    if (rc == 0)
        rc = list_encode(ly, d->dst, d->n);
    if (rc == 0)
        rc = list_retire_unused(s, ly, before, nb, after,
                                list_block_ids(ly, d->dst, d->n, 0, after), epoch);
    for (size_t q = 0; rc == 0 && q < DEMOTE_TIERS; q++)
        seq_moved(s, demote_tiers[q], d->m[q]);
    free(before);
    return rc;
}

status_code seq_demote_finish(seq_demote_job *j, int fill_rc, status *st)
{
    seq *s = j->s;
    int rc = fill_rc;
    if (rc == 0) {
        seq_begin(s);
        for (size_t i = 0; rc == 0 && i < j->nlists; i++)
            rc = publish_list(s, &j->lists[i], j->epoch);
        if (rc != 0) {
            seq_rollback(s);
        } else {
            seq_end(s);
            seq_publish_epoch(s, j->epoch);
        }
    }
    if (rc != 0) {
        give_back(j);
        for (size_t i = 0; i < j->nlists; i++)
            j->lists[i].ly->demote_due = 1; /* the next call may have the memory */
        job_free(j);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < j->nlists; i++) {
        const demote_list *d = &j->lists[i];
        for (size_t q = 0; q < DEMOTE_TIERS; q++)
            if (d->m[q] > 0 && d->ratio[q] >= 0)
                snapshot_tiers_observe(&s->report, demote_tiers[q], d->ratio[q]);
        if (d->vm > 0 && d->vratio >= 0)
            snapshot_tiers_observe(&s->report, POLICY_INT8, d->vratio);
    }
    job_free(j);
    return ST_OK;
}

status_code seq_demote_due(seq *s, uint64_t epoch, status *st)
{
    seq_demote_job *j;
    status_code rc = seq_demote_plan(s, epoch, &j, st);
    if (rc != ST_OK || j == NULL)
        return rc;
    return seq_demote_finish(j, seq_demote_fill(j), st);
}
