/*
 * seq_demote.c - the demotion a step leaves due, in three parts (seq.h
 * seq_demote_plan), so that its quantisation runs without the store's
 * lock: a step that demotes no longer holds up every other sequence.
 *
 * The plan takes what list_demote_to would take in the step (the oldest
 * tokens decided quantised but stored at full precision, whole blocks'
 * worth, POLICIES.md §5.4) and what list_victims_quantize would (victims=int8:
 * the victims still at full precision, whole INT8 blocks' worth), the fill
 * quantises them into the planned blocks, and the finish puts them in their
 * lists, in a transaction of its own. The fill reads only the pool's memory
 * of the planned tokens and writes only the planned blocks, which is why it
 * may run while other sequences change.
 *
 * The plan and the finish work on the lists' segments: a decode step's
 * demotion moves an INT8 block's worth of tokens a list, and expanding a
 * 32k-token list into an entry a token and encoding it again, as the step's
 * general path does, made the demotion a pass over every token of every
 * list under the store's lock (issue 16 §4: 12 ms at 32 layers x 32k
 * tokens, which the worker's next call waited for). Only a list that the
 * demotion leaves due for compaction is expanded, as before.
 */
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"
#include "util.h" /* policies/: policy_tiers_count */

static const uint8_t demote_tiers[] = {POLICY_INT8, POLICY_INT4, POLICY_INT2};
#define DEMOTE_TIERS (sizeof demote_tiers)

/* One list's part. Per quantised tier, the tokens to quantise (m[q] of
 * demote_tiers[q], the tiers one after the other): their indices in the
 * list (idx, ascending within a tier) and their storage (moved: a
 * full-precision slot until the fill quantises them into blocks qb, the
 * nq[q] of each tier one after the other). */
typedef struct demote_list {
    seq_list *ly;
    uint8_t due;     /* the list's demote_due at the plan */
    int compact_due; /* victims alone: list_compact_due of its segments, which they leave */
    uint32_t n;
    uint32_t *idx, *qb;
    tier_token *moved;
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

static size_t demoted_count(const demote_list *d)
{
    size_t m = 0;
    for (size_t q = 0; q < DEMOTE_TIERS; q++)
        m += d->m[q];
    return m;
}

static void job_free(seq_demote_job *j)
{
    for (size_t i = 0; i < j->nlists; i++) {
        demote_list *d = &j->lists[i];
        free(d->idx), free(d->qb), free(d->moved);
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
            seq_give_block(j->s, d->vqb[b]);
        size_t nq = 0;
        for (size_t q = 0; q < DEMOTE_TIERS; q++)
            nq += d->nq[q];
        while (nq-- > 0)
            seq_give_block(j->s, d->qb[nq]);
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
    if (t8 == 0 || ly->nfull_victims < t8) /* not a block's worth at full precision */
        return 0;
    d->vidx = malloc(ly->nfull_victims * sizeof *d->vidx);
    if (d->vidx == NULL)
        return -1;
    for (size_t j = 0; j < noff; j++)
        if (ly->offloaded_at[j].tier == POLICY_FULL)
            d->vidx[m++] = (uint32_t)j;
    size_t nq = m / t8;
    if (nq == 0 || nq > seq_free_blocks(s))
        return 0;
    d->vdst = malloc(noff * sizeof *d->vdst);
    d->vqb = malloc(nq * sizeof *d->vqb);
    if (d->vdst == NULL || d->vqb == NULL)
        return -1;
    memcpy(d->vdst, ly->offloaded_at, noff * sizeof *d->vdst);
    for (size_t b = 0; b < nq; b++)
        seq_take_block(s, &d->vqb[b]);
    d->vm = nq * t8;
    d->vnq = nq;
    return (long)nq;
}

/* The full-precision tokens of list ly that tier[0..n) decides qt, in
 * list order, found in its full-precision segments: their indices into
 * idx[] and their slots into at[], at most room of them. Returns their
 * count. */
static size_t full_decided(const seq_list *ly, const uint8_t *tier, uint32_t n, uint8_t qt,
                           uint32_t *idx, tier_token *at, size_t room)
{
    size_t m = 0;
    uint32_t i = 0;
    for (size_t j = 0; j < ly->nsegs && i < n; i += ly->segs[j++].count) {
        const kv_segment *g = &ly->segs[j];
        if (ly->seg_tier[j] != POLICY_FULL)
            continue;
        uint32_t c = g->count < n - i ? g->count : n - i;
        for (uint32_t t = 0; t < c && m < room; t++)
            if (tier[i + t] == qt) {
                idx[m] = i + t;
                at[m++] = (tier_token){g->block, g->first_slot + t, POLICY_FULL};
            }
    }
    return m;
}

/* counts[t]: how many of list ly's full-precision tokens tier[0..n)
 * decides t, one vectorised pass a run of full-precision segments (their
 * tokens are consecutive in the list). A victims=int8 list decides none
 * quantised, and three token-by-token passes over every list (full_decided)
 * were most of such a demotion's plan, which the next call waits for. */
static void full_decided_counts(const seq_list *ly, const uint8_t *tier, uint32_t n,
                                uint32_t counts[POLICY_TIERS])
{
    memset(counts, 0, POLICY_TIERS * sizeof *counts);
    uint32_t i = 0, run = 0;
    for (size_t j = 0; j < ly->nsegs && i + run < n; j++) {
        uint32_t c = ly->segs[j].count;
        if (ly->seg_tier[j] == POLICY_FULL) {
            run += c;
            continue;
        }
        if (run > 0)
            policy_tiers_count(tier + i, run, counts);
        i += run + c, run = 0;
    }
    if (run > 0 && i < n)
        policy_tiers_count(tier + i, run < n - i ? run : n - i, counts);
}

/* Choose list d's tokens to demote, tier by tier, and take their blocks
 * while the pool has them (a tier it has not waits for the next step, as
 * in list_demote_to). Returns the blocks taken, or -1 when out of memory. */
static long plan_list(seq *s, uint32_t l, uint32_t k, demote_list *d)
{
    const policy_layer_view *v = policy_host_view(s->host, l);
    seq_list *ly = seq_list_at(s, l, k);
    *d = (demote_list){.ly = ly, .due = ly->demote_due, .n = v->tokens[k]};
    ly->demote_due = 0;
    uint32_t counts[POLICY_TIERS] = {0};
    if (d->due != SEQ_DUE_VICTIMS) /* victims alone: no token decided quantised is due */
        full_decided_counts(ly, v->tier[k], d->n, counts);
    size_t most = 1; /* the tokens of the tiers with a block's worth */
    for (size_t q = 0; q < DEMOTE_TIERS; q++) {
        uint32_t t8 = tier_block_tokens(&s->tier, demote_tiers[q]);
        most += t8 > 0 && counts[demote_tiers[q]] >= t8 ? counts[demote_tiers[q]] : 0;
    }
    d->idx = malloc(most * sizeof *d->idx);
    d->qb = malloc(most * sizeof *d->qb);
    d->moved = malloc(most * sizeof *d->moved);
    if (d->idx == NULL || d->qb == NULL || d->moved == NULL)
        return -1;
    size_t at = 0, taken = 0;
    for (size_t q = 0; q < DEMOTE_TIERS; q++) {
        uint8_t qt = demote_tiers[q];
        uint32_t t8 = tier_block_tokens(&s->tier, qt);
        if (t8 == 0 || counts[qt] < t8)
            continue; /* not a block's worth: nothing to find */
        size_t m =
            full_decided(d->ly, v->tier[k], d->n, qt, d->idx + at, d->moved + at, counts[qt]);
        size_t nq = m / t8;
        if (nq == 0 || nq > seq_free_blocks(s))
            continue;
        for (size_t b = 0; b < nq; b++)
            seq_take_block(s, &d->qb[taken + b]);
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
        due += s->lists[i].demote_due != 0;
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
            if (!seq_list_at(s, l, k)->demote_due)
                continue;
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

size_t seq_demote_tokens(const seq_demote_job *j)
{
    size_t m = 0;
    for (size_t i = 0; i < j->nlists; i++)
        m += demoted_count(&j->lists[i]) + j->lists[i].vm;
    return m;
}

int seq_demote_fill(seq_demote_job *j)
{
    /* seq_quantize_into takes its tokens through an index: moved[] in order. */
    size_t most = 1;
    for (size_t i = 0; i < j->nlists; i++) {
        size_t m = demoted_count(&j->lists[i]);
        most = m > most ? m : most;
    }
    uint32_t *order = malloc(most * sizeof *order);
    if (order == NULL)
        return -1;
    for (size_t i = 0; i < most; i++)
        order[i] = (uint32_t)i;
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < j->nlists; i++) {
        demote_list *d = &j->lists[i];
        size_t at = 0, b = 0;
        for (size_t q = 0; rc == 0 && q < DEMOTE_TIERS; q++) {
            if (d->m[q] > 0 && seq_quantize_into(j->s, demote_tiers[q], d->moved + at, order,
                                                 d->m[q], d->qb + b, d->nq[q], &d->ratio[q]) != 0)
                rc = -1;
            at += d->m[q];
            b += d->nq[q];
        }
        if (rc == 0 && d->vm > 0 &&
            seq_quantize_into(j->s, POLICY_INT8, d->vdst, d->vidx, d->vm, d->vqb, d->vnq,
                              &d->vratio) != 0)
            rc = -1;
    }
    free(order);
    return rc;
}

/* Of the tiers' cursors cur[q] into d's demoted tokens (up to end[q]), the
 * one whose token comes first in the list; DEMOTE_TIERS when none is left. */
static size_t next_demoted(const demote_list *d, const size_t *cur, const size_t *end)
{
    size_t first = DEMOTE_TIERS;
    for (size_t q = 0; q < DEMOTE_TIERS; q++)
        if (cur[q] < end[q] && (first == DEMOTE_TIERS || d->idx[cur[q]] < d->idx[cur[first]]))
            first = q;
    return first;
}

/* List d's segments with its demoted tokens (d->idx) stored where the
 * fill put them (d->moved) instead of their full-precision slots, joined as
 * list_encode joins tokens, into segs[] and tiers[] (room for the list's
 * segments and two for each demoted token: each may split one). Returns
 * their count. A pass over the segments, not the tokens. */
static size_t demoted_segments(const demote_list *d, kv_segment *segs, uint8_t *tiers)
{
    const seq_list *ly = d->ly;
    size_t cur[DEMOTE_TIERS], end[DEMOTE_TIERS], at = 0, out = 0;
    for (size_t q = 0; q < DEMOTE_TIERS; q++) {
        cur[q] = at;
        at += d->m[q];
        end[q] = at;
    }
    uint32_t i = 0; /* the list index of segment j's first token */
    for (size_t j = 0; j < ly->nsegs; i += ly->segs[j++].count) {
        kv_segment g = ly->segs[j];
        for (uint32_t t = 0; t < g.count;) {
            size_t q = next_demoted(d, cur, end);
            uint32_t stop =
                q == DEMOTE_TIERS || d->idx[cur[q]] >= i + g.count ? g.count : d->idx[cur[q]] - i;
            if (stop > t)
                out = list_push_run(segs, tiers, out,
                                    (kv_segment){g.block, g.first_slot + t, stop - t},
                                    ly->seg_tier[j]);
            if (stop == g.count)
                break;
            const tier_token *to = &d->moved[cur[q]++];
            out = list_push_run(segs, tiers, out, (kv_segment){to->block, to->slot, 1}, to->tier);
            t = stop + 1;
        }
    }
    return out;
}

/* victims=int8: the list's victims become what the fill made of them, and
 * their INT8 blocks the list's victim blocks (the caller grew those). */
static void publish_victims(seq *s, demote_list *d)
{
    seq_list *ly = d->ly;
    size_t v0 = d->vidx[0]; /* the first it quantised: those before it are as they were */
    memcpy(ly->offloaded_at + v0, d->vdst + v0, (ly->noffloaded - v0) * sizeof *ly->offloaded_at);
    memcpy(ly->victim_blocks + ly->nvictim_blocks, d->vqb, d->vnq * sizeof *d->vqb);
    ly->nvictim_blocks += d->vnq;
    ly->nfull_victims -= d->vm;
    seq_moved(s, POLICY_INT8, d->vm);
}

/* The blocks a list uses: its segments', its victims' and (with_tail) its
 * tail block, with repeats, in a fresh array (*n of them); NULL when out of
 * memory. */
static uint32_t *list_blocks_now(const seq_list *ly, int with_tail, size_t *n)
{
    uint32_t *ids = malloc((ly->nsegs + ly->noffloaded + 1) * sizeof *ids);
    if (ids == NULL)
        return NULL;
    *n = list_fill_block_ids(ly, -1, ids);
    if (with_tail && ly->has_tail)
        ids[(*n)++] = ly->tail_block;
    return ids;
}

/* Append run g to the move log, joined to its last run when it continues
 * it (the same list, block and tier, the next token and slot); 0 when out
 * of memory (the log is then not valid). */
static int moves_push(seq_move_log *m, seq_moved_run g)
{
    seq_moved_run *last = m->n > 0 ? &m->runs[m->n - 1] : NULL;
    if (last != NULL && last->list == g.list && last->block == g.block && last->tier == g.tier &&
        last->first + last->count == g.first && last->first_slot + last->count == g.first_slot) {
        last->count += g.count;
        return 1;
    }
    if (m->n == m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 64;
        seq_moved_run *runs = realloc(m->runs, cap * sizeof *runs);
        if (runs == NULL)
            return 0;
        m->runs = runs;
        m->cap = cap;
    }
    m->runs[m->n++] = g;
    return 1;
}

/* List d's demoted tokens as runs of the move log, in list order. */
static void moves_log_list(seq *s, const demote_list *d)
{
    size_t cur[DEMOTE_TIERS], end[DEMOTE_TIERS], at = 0, q;
    for (q = 0; q < DEMOTE_TIERS; q++) {
        cur[q] = at;
        at += d->m[q];
        end[q] = at;
    }
    uint32_t list = (uint32_t)(d->ly - s->lists);
    while (s->moves.valid && (q = next_demoted(d, cur, end)) < DEMOTE_TIERS) {
        const tier_token *to = &d->moved[cur[q]];
        seq_moved_run g = {list, d->idx[cur[q]++], 1, to->block, to->slot, to->tier};
        s->moves.valid = moves_push(&s->moves, g);
    }
}

int seq_demotion_moves(const seq *s, seq_moves *out)
{
    const seq_move_log *m = &s->moves;
    if (!m->valid || m->to_epoch != s->epoch)
        return 0;
    *out = (seq_moves){m->from_epoch, m->to_epoch, m->n, m->runs};
    return 1;
}

/* List d becomes its demoted tokens, compacted when that leaves it due
 * (the step's own order: list_apply compacts after demoting); the blocks it
 * no longer uses are retired at `epoch`. Inside the finish's transaction.
 * The runs it moved go to the move log, which a compaction spoils. */
static int publish_list(seq *s, demote_list *d, uint64_t epoch)
{
    seq_list *ly = d->ly;
    /* Victims alone leave the segments as they are. */
    int resegment = demoted_count(d) > 0;
    size_t cap = resegment ? ly->nsegs + 2 * demoted_count(d) + 1 : 1, nb = 0, na = 0;
    kv_segment *segs = malloc(cap * sizeof *segs);
    uint8_t *tiers = malloc(cap);
    uint32_t *before = list_blocks_now(ly, 1, &nb), *after = NULL;
    size_t vfrom = d->vm > 0 ? d->vidx[0] : ly->noffloaded;
    int rc =
        segs != NULL && tiers != NULL && before != NULL ? seq_txn_save_list_from(s, ly, vfrom) : -1;
    size_t nsegs = rc == 0 && resegment ? demoted_segments(d, segs, tiers) : 0;
    if (rc == 0 && d->vnq > 0)
        rc = seq_grow((void **)&ly->victim_blocks, &ly->victim_blocks_cap,
                      ly->nvictim_blocks + d->vnq, sizeof *ly->victim_blocks);
    if (rc == 0 && resegment)
        rc = list_reserve(ly, nsegs ? nsegs : 1);
    if (rc == 0 && d->vnq > 0)
        publish_victims(s, d);
    if (rc == 0 && resegment) {
        memcpy(ly->segs, segs, nsegs * sizeof *segs);
        memcpy(ly->seg_tier, tiers, nsegs);
        ly->nsegs = nsegs;
        ly->blocks_at_most = SEQ_BLOCKS_UNKNOWN; /* as list_encode leaves it */
    }
    if (rc == 0)
        moves_log_list(s, d);
    if (rc == 0 && (resegment ? list_compact_due(s, ly) : d->compact_due)) {
        s->moves.valid = 0; /* tokens of this list moved again: read the table */
        tier_token *tok = list_expand(ly, d->n);
        rc = tok != NULL ? list_compact(s, ly, tok, d->n) : -1;
        if (rc == 0)
            rc = list_encode(ly, tok, d->n);
        free(tok);
    }
    if (rc == 0)
        rc = (after = list_blocks_now(ly, 0, &na)) != NULL ? 0 : -1;
    if (rc == 0)
        rc = list_retire_unused(s, ly, before, nb, after, na, epoch);
    for (size_t q = 0; rc == 0 && q < DEMOTE_TIERS; q++)
        seq_moved(s, demote_tiers[q], d->m[q]);
    free(segs);
    free(tiers);
    free(before);
    free(after);
    return rc;
}

status_code seq_demote_finish(seq_demote_job *j, int fill_rc, status *st)
{
    seq *s = j->s;
    int rc = fill_rc;
    /* Victims alone (victims=int8) are in no table: their demotion changes
     * none, unless a list it finishes is compacted. Then the blocks it
     * empties are retired at the epoch the worker holds (and acks at its
     * next call), and no epoch is published: the worker keeps its table by
     * the steps' cuts instead of reading it again. */
    int tables = 0;
    for (size_t i = 0; i < j->nlists; i++) {
        demote_list *d = &j->lists[i];
        if (demoted_count(d) == 0)
            d->compact_due = list_compact_due(s, d->ly);
        tables |= demoted_count(d) > 0 || d->compact_due;
    }
    uint64_t epoch = tables ? j->epoch : seq_epoch(s);
    /* A demotion that shares the step's epoch (seq.h) is in that step's table. */
    s->moves = (seq_move_log){.valid = tables && epoch != seq_epoch(s),
                              .from_epoch = seq_epoch(s),
                              .to_epoch = epoch,
                              .runs = s->moves.runs,
                              .cap = s->moves.cap};
    if (rc == 0) {
        seq_begin(s);
        for (size_t i = 0; rc == 0 && i < j->nlists; i++)
            rc = publish_list(s, &j->lists[i], epoch);
        if (rc != 0) {
            seq_rollback(s);
        } else {
            seq_end(s);
            seq_publish_epoch(s, epoch);
        }
    }
    if (rc != 0) {
        s->moves.valid = 0;
        give_back(j);
        for (size_t i = 0; i < j->nlists; i++)
            j->lists[i].ly->demote_due = j->lists[i].due; /* the next call may have the memory */
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
