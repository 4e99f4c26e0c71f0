/*
 * seq_apply.c - applying a policy's decision to a sequence's lists: tier
 * moves, offloaded victims, INT8 / INT4 / INT2 demotion and compaction, value merges, key
 * re-rotation, full-precision compaction, retiring emptied blocks (seq.h
 * seq_apply_decision, seq_demote_pending).
 *
 * Everything here runs inside the call's transaction (seq_txn.c): a list,
 * its sketch cells and token slots written in place are saved before their
 * first change, so a part that fails just returns -1 and the caller rolls
 * the whole call back. Nothing here undoes its own work.
 */
#include <stdlib.h>
#include <sys/types.h>
#include <string.h>

#include "seq_internal.h"
#include "util.h" /* policies/: policy_tiers_keep_or_evict */

/* Insert tokens idx[0..m) (FULL or quantised) into the sketch; they become
 * sketch tokens. */
static int move_to_sketch(seq *s, seq_list *ly, uint32_t layer, tier_token *tok,
                          const uint32_t *pos, const uint32_t *idx, size_t m)
{
    uint32_t sidx[TIER_ERROR_SAMPLE], spos[TIER_ERROR_SAMPLE];
    size_t ns;
    uint8_t *orig;
    uint32_t *p = malloc((m ? m : 1) * sizeof *p);
    tier_token *src = malloc((m ? m : 1) * sizeof *src);
    for (size_t i = 0; p != NULL && src != NULL && i < m; i++) {
        p[i] = pos[idx[i]];
        src[i] = tok[idx[i]];
    }
    if (p == NULL || src == NULL || seq_txn_save_sketch(s, ly, p, m) != 0 ||
        list_sketch_ready(s, ly, layer) != 0 ||
        seq_stage_error_sample(s, tok, idx, m, sidx, &ns, &orig) != 0) {
        free(p);
        free(src);
        return -1;
    }
    for (size_t i = 0; i < ns; i++)
        spos[i] = pos[sidx[i]];
    int rc = tier_sketch_insert(&ly->sketch, &s->tier, p, src, m);
    double rel;
    if (rc == 0 && tier_sketch_error(&ly->sketch, &s->tier, spos, ns, orig, &rel) == 0)
        snapshot_tiers_observe(&s->report, POLICY_SKETCH, rel);
    for (size_t i = 0; rc == 0 && i < m; i++)
        tok[idx[i]] = (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH};
    seq_moved(s, POLICY_SKETCH, rc == 0 ? m : 0);
    tier_stage_free(&s->tier, orig);
    free(src);
    free(p);
    return rc;
}

/* Bring token i (SKETCH or quantised) back to a fresh full-precision slot: the
 * sketch's estimate, deleted from the sketch (KVReviver swap, Alg. 3), or
 * the dequantised values. Leaves it where it is when the pool is full. */
static int move_to_full(seq *s, seq_list *ly, tier_token *tok, const uint32_t *pos, uint32_t i)
{
    tier_token dst;
    int in_tail = list_tail_usable(ly, s->block_slots), sketched = tok[i].tier == POLICY_SKETCH;
    if (seq_txn_save_list(s, ly) != 0 || (sketched && seq_txn_save_sketch(s, ly, &pos[i], 1) != 0))
        return -1;
    if (list_take_slot(s, ly, &dst) != 0)
        return 0;
    /* A slot of the tail block is in a block the worker maps: its bytes are
     * part of what a rollback puts back. */
    if (in_tail && seq_txn_save_tokens(s, &dst, 1) != 0)
        return -1;
    if (sketched ? tier_sketch_read(&ly->sketch, &s->tier, s->pool->base, &pos[i], 1, &dst, 1) != 0
                 : tier_copy(&s->tier, &tok[i], 1, &dst) != 0)
        return -1;
    tok[i] = dst;
    seq_moved(s, POLICY_FULL, 1);
    return 0;
}

/* The policy's victims, by the storage option victims: offloaded into the
 * sketch; kept where they are stored (victims=int8: full-precision ones are
 * quantised by list_victims_quantize, sketch ones stay in the sketch); or
 * dropped (a dropped sketch token's estimate leaves the sketch). */
static int list_victims(seq *s, seq_list *ly, uint32_t layer, tier_token *tok, const uint32_t *pos,
                        const uint8_t *tier, uint32_t n, uint32_t *scratch)
{
    policy_victims mode = policy_host_storage(s->host)->victims;
    size_t m = 0, gone = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tier[i] != POLICY_EVICT)
            continue;
        int sketched = tok[i].tier == POLICY_SKETCH;
        if (mode == POLICY_VICTIMS_SKETCH && !sketched)
            scratch[m++] = i;
        else if (mode == POLICY_VICTIMS_EVICT && sketched)
            scratch[n - 1 - gone++] = pos[i];
        tier_token at =
            mode == POLICY_VICTIMS_INT8 ? tok[i] : (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH};
        if (mode != POLICY_VICTIMS_EVICT && list_offload_push(ly, pos[i], at) != 0)
            return -1;
    }
    if (m > 0 && move_to_sketch(s, ly, layer, tok, pos, scratch, m) != 0)
        return -1;
    if (gone == 0)
        return 0;
    if (seq_txn_save_sketch(s, ly, scratch + n - gone, gone) != 0)
        return -1;
    return tier_sketch_delete(&ly->sketch, scratch + n - gone, gone);
}

/* Whether token i's storage must change for decided tier `want` before
 * demotion, which is batched separately: a quantised token goes back to
 * full precision to be kept there, or to be demoted again into another
 * quantised tier. */
static int needs_move(uint8_t stored, uint8_t want)
{
    if (want == POLICY_EVICT)
        return 0;
    if (want == POLICY_SKETCH)
        return stored != POLICY_SKETCH;
    return stored == POLICY_SKETCH || (policy_tier_quantised(stored) && stored != want);
}

static int apply_move(seq *s, seq_list *ly, uint32_t layer, tier_token *tok, const uint32_t *pos,
                      const uint8_t *tier, uint32_t i)
{
    if (!needs_move(tok[i].tier, tier[i]))
        return 0;
    if (tier[i] == POLICY_SKETCH)
        return move_to_sketch(s, ly, layer, tok, pos, &i, 1);
    return move_to_full(s, ly, tok, pos, i);
}

/* Tier moves among kept tokens, in the policy's order (tier_order) if it
 * gives one, then the rest: revivals first, then insertions. The
 * insertions go into the sketch in one batch, in list order as one at a
 * time would (nothing reads the sketch between them): per token, the
 * staging, hashing and error query cost an operator's offload of a long
 * sequence seconds under the store's lock (issue 12). idx has room for n. */
static int list_moves(seq *s, seq_list *ly, uint32_t layer, tier_token *tok, const uint32_t *pos,
                      const uint8_t *tier, uint32_t n, uint32_t *idx)
{
    size_t norder, m = 0;
    const uint32_t *order = policy_host_tier_order(s->host, layer, &norder);
    for (size_t j = 0; j < norder; j++)
        if (order[j] < n && apply_move(s, ly, layer, tok, pos, tier, order[j]) != 0)
            return -1;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] != POLICY_SKETCH && apply_move(s, ly, layer, tok, pos, tier, i) != 0)
            return -1;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] == POLICY_SKETCH && needs_move(tok[i].tier, tier[i]))
            idx[m++] = i;
    return m > 0 ? move_to_sketch(s, ly, layer, tok, pos, idx, m) : 0;
}

/* seq_quantize_into fresh blocks of quantised tier qt, which the caller
 * checked the pool has; the round trip's error is observed. */
static int quantize_fresh(seq *s, uint8_t qt, tier_token *tok, const uint32_t *idx, size_t m)
{
    uint32_t t8 = tier_block_tokens(&s->tier, qt);
    size_t nq = (m + t8 - 1) / t8;
    uint32_t *qb = malloc((nq ? nq : 1) * sizeof *qb);
    if (qb == NULL)
        return -1;
    for (size_t b = 0; b < nq; b++)
        seq_take_block(s, &qb[b]); /* checked by the caller */
    double ratio;
    int rc = seq_quantize_into(s, qt, tok, idx, m, qb, nq, &ratio);
    if (rc == 0 && ratio >= 0)
        snapshot_tiers_observe(&s->report, qt, ratio);
    free(qb);
    return rc;
}

/* Demotion to quantised tier qt in whole blocks (POLICIES.md §5.4: a
 * block's scales cover all its tokens and it is written once): the oldest
 * tokens decided qt but stored at full precision, as many blocks' worth as
 * there are; with `partial`, all of them, the last block written partial
 * (its free slots are never filled: an operator's demote wants them now).
 * A step of a sequence that demotes after its steps only notes that the
 * list is due (seq_demote_plan). */
static int list_demote_to(seq *s, seq_list *ly, uint8_t qt, tier_token *tok, const uint8_t *tier,
                          uint32_t n, uint32_t *scratch, int partial)
{
    uint32_t t8 = tier_block_tokens(&s->tier, qt);
    size_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] == qt && tok[i].tier == POLICY_FULL)
            scratch[m++] = i;
    if (t8 == 0)
        return 0; /* the tier does not fit this pool (seq_create refuses it as demote) */
    size_t nq = partial ? (m + t8 - 1) / t8 : m / t8;
    if (nq == 0 || nq > seq_free_blocks(s))
        return 0;
    if (s->stepping && s->demote_after_step) {
        ly->demote_due |= SEQ_DUE_TIERS;
        return 0;
    }
    if (!partial)
        m = nq * t8;
    if (quantize_fresh(s, qt, tok, scratch, m) != 0)
        return -1;
    seq_moved(s, qt, m);
    return 0;
}

/* list_demote_to for every quantised tier. */
static int list_demote(seq *s, seq_list *ly, tier_token *tok, const uint8_t *tier, uint32_t n,
                       uint32_t *scratch, int partial)
{
    static const uint8_t qtiers[] = {POLICY_INT8, POLICY_INT4, POLICY_INT2};
    for (size_t q = 0; q < sizeof qtiers; q++)
        if (list_demote_to(s, ly, qtiers[q], tok, tier, n, scratch, partial) != 0)
            return -1;
    return 0;
}

/* The blocks beyond what they fill that a list's tokens of one tier may
 * use before they are compacted: one, or a sixteenth of the blocks they
 * fill on long lists. A compaction copies (or re-quantises) the whole
 * list, so a long list that loses a few tokens a step (h2o's evictions,
 * reviver's swaps, streaming's window) would otherwise be copied every few
 * steps; with the slack, each token it loses costs at most 16 token
 * copies, for at most 1/16 more blocks. */
static uint32_t compact_slack(uint32_t need)
{
    return need / 16 > 1 ? need / 16 : 1;
}

/*
 * POLICIES.md §5.4 "on compaction: dequantise survivors, gather, re-block,
 * re-quantise": when the INT8 tokens that stay (tier[i] INT8, stored INT8)
 * spread over more blocks beyond what they fill than compact_slack allows,
 * re-quantise them into fresh INT8 blocks with new scales, so that
 * evicting INT8 tokens gives memory back. Each re-quantisation adds up to
 * half a new scale of error, hence the slack: it runs at most once per
 * INT8 block's worth of evictions on a short list, and once per sixteenth
 * of the list's blocks on a long one, not every few steps of a long
 * decode (issue 16 §2: a 32k-token h2o list re-quantised all its tokens
 * every 28 evictions). It runs before this step's demotion, so a token is
 * quantised at most once a step. Skipped, harmlessly, when the pool lacks
 * the blocks. scratch has room for 2n.
 */
static int list_requantize_tier(seq *s, uint8_t qt, tier_token *tok, const uint8_t *tier,
                                uint32_t n, uint32_t *scratch)
{
    uint32_t t8 = tier_block_tokens(&s->tier, qt), *blocks = scratch + n;
    size_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] == qt && tok[i].tier == qt) {
            blocks[m] = tok[i].block;
            scratch[m++] = i;
        }
    if (m == 0)
        return 0;
    size_t need = (m + t8 - 1) / t8, have = seq_sort_unique(blocks, m);
    if (have <= need + compact_slack((uint32_t)need) || need > seq_free_blocks(s))
        return 0;
    if (quantize_fresh(s, qt, tok, scratch, m) != 0)
        return -1;
    s->requantized += m;
    s->report.requantized += m;
    return 0;
}

static int list_requantize(seq *s, tier_token *tok, const uint8_t *tier, uint32_t n,
                           uint32_t *scratch)
{
    static const uint8_t qtiers[] = {POLICY_INT8, POLICY_INT4, POLICY_INT2};
    /* victims=int8 keeps evicted INT8 tokens in their blocks: re-quantising
     * the others would free nothing. */
    if (policy_host_storage(s->host)->victims == POLICY_VICTIMS_INT8)
        return 0;
    for (size_t q = 0; q < sizeof qtiers; q++)
        if (list_requantize_tier(s, qtiers[q], tok, tier, n, scratch) != 0)
            return -1;
    return 0;
}

/*
 * victims=int8: the oldest victims still at full precision go to INT8 in
 * whole INT8 blocks, as demotion does (an INT8 block is written once); the
 * rest wait in their slots. The blocks are the list's victim blocks.
 * Skipped, harmlessly, when the pool lacks the blocks. scratch has room for
 * noffloaded.
 */
static int list_victims_quantize(seq *s, seq_list *ly, uint32_t *scratch)
{
    uint32_t t8 = s->tier.l8.block_tokens;
    size_t m = 0;
    for (size_t j = 0; j < ly->noffloaded; j++)
        if (ly->offloaded_at[j].tier == POLICY_FULL)
            scratch[m++] = (uint32_t)j;
    size_t nq = m / t8;
    if (nq == 0 || nq > seq_free_blocks(s) ||
        seq_grow((void **)&ly->victim_blocks, &ly->victim_blocks_cap, ly->nvictim_blocks + nq,
                 sizeof *ly->victim_blocks) != 0)
        return 0;
    if (s->stepping && s->demote_after_step) { /* seq_demote_plan quantises them */
        ly->demote_due |= SEQ_DUE_VICTIMS;
        return 0;
    }
    if (seq_txn_save_list_from(s, ly, scratch[0]) != 0 ||
        quantize_fresh(s, POLICY_INT8, ly->offloaded_at, scratch, nq * t8) != 0)
        return -1;
    ly->nfull_victims -= nq * t8;
    for (size_t b = 0; b < nq; b++)
        ly->victim_blocks[ly->nvictim_blocks++] = ly->offloaded_at[scratch[b * t8]].block;
    seq_moved(s, POLICY_INT8, nq * t8);
    return 0;
}

/* Free the oldest victim block of each list (memory pressure, seq_append):
 * its victims are gone for good. Returns the blocks freed. */
uint32_t seq_drop_victim_blocks(seq *s)
{
    uint32_t freed = 0;
    for (size_t k = 0; k < seq_nlists(s); k++) {
        seq_list *ly = &s->lists[k];
        if (ly->nvictim_blocks == 0)
            continue;
        uint32_t b = ly->victim_blocks[0];
        memmove(ly->victim_blocks, ly->victim_blocks + 1,
                --ly->nvictim_blocks * sizeof *ly->victim_blocks);
        size_t kept = 0;
        for (size_t j = 0; j < ly->noffloaded; j++) {
            if (ly->offloaded_at[j].tier == POLICY_INT8 && ly->offloaded_at[j].block == b)
                continue;
            ly->offloaded[kept] = ly->offloaded[j];
            ly->offloaded_at[kept++] = ly->offloaded_at[j];
        }
        s->victims_dropped += ly->noffloaded - kept;
        s->report.victims_dropped += ly->noffloaded - kept;
        ly->noffloaded = kept;
        seq_give_block(s, b);
        freed++;
    }
    return freed;
}

/* WeightedKV merges of layer l, before the merged-away tokens leave the
 * table. The merge runs at full precision: a quantised block is written
 * once, so a quantised token in a merge is first brought back to a fresh
 * full slot (dequantised; a kept one is demoted again with the next block). A
 * merge is skipped when the pool has no slot for that, or a token is in the
 * sketch (weightedkv keeps none there). */
static int apply_merges(seq *s, uint32_t l, const policy_decision *d, tier_token *const *toks)
{
    for (size_t m = 0; m < d->nmerges; m++) {
        const policy_merge *g = &d->merges[m];
        tier_token *tok = toks[g->head];
        seq_list *ly = seq_list_at(s, l, g->head);
        const uint32_t *pos;
        seq_list_tokens(s, l, g->head, &pos);
        if ((policy_tier_quantised(tok[g->from].tier) &&
             move_to_full(s, ly, tok, pos, g->from) != 0) ||
            (policy_tier_quantised(tok[g->into].tier) &&
             move_to_full(s, ly, tok, pos, g->into) != 0))
            return -1;
        const tier_token *from = &tok[g->from], *into = &tok[g->into];
        if (from->tier != POLICY_FULL || into->tier != POLICY_FULL)
            continue;
        if (seq_txn_save_tokens(s, into, 1) != 0)
            return -1;
        kv_merge one = {from->block, from->slot, into->block, into->slot, g->w_from, g->w_into};
        if (s->tier.ops->merge_values(&s->list_layout, s->tier.dtype, s->pool->base, &one, 1) != 0)
            return -1;
    }
    return 0;
}

/* A decode step's merges (WeightedKV: one a list) are found in the
 * segments; more than this many (a prefill's) go through apply_merges. */
#define SEQ_SEGMENT_MERGES 64

/* Where token i of list ly is stored: 0, or -1 when it is beyond the
 * segments or not at full precision. */
static int list_full_slot(const seq_list *ly, uint32_t i, tier_token *at)
{
    for (size_t j = 0; j < ly->nsegs; j++) {
        if (i < ly->segs[j].count) {
            *at = (tier_token){ly->segs[j].block, ly->segs[j].first_slot + i, ly->seg_tier[j]};
            return ly->seg_tier[j] == POLICY_FULL ? 0 : -1;
        }
        i -= ly->segs[j].count;
    }
    return -1;
}

/*
 * apply_merges for a decision of few merges, every token in them at full
 * precision: each token is found by a walk over its list's segments
 * instead of every list expanded into one entry per token, so that the
 * evictions can then take the common step (list_apply_evictions). The
 * same merges in the same order, saved the same way. Returns 1 when it
 * does not apply (nothing changed; apply_merges brings quantised tokens
 * back first), else 0 or -1.
 */
static int apply_merges_in_segments(seq *s, uint32_t l, const policy_decision *d)
{
    if (d->nmerges > SEQ_SEGMENT_MERGES)
        return 1;
    kv_merge merges[SEQ_SEGMENT_MERGES];
    tier_token into[SEQ_SEGMENT_MERGES];
    for (size_t m = 0; m < d->nmerges; m++) {
        const policy_merge *g = &d->merges[m];
        const seq_list *ly = seq_list_at(s, l, g->head);
        tier_token from;
        if (list_full_slot(ly, g->from, &from) != 0 || list_full_slot(ly, g->into, &into[m]) != 0)
            return 1;
        merges[m] =
            (kv_merge){from.block, from.slot, into[m].block, into[m].slot, g->w_from, g->w_into};
    }
    for (size_t m = 0; m < d->nmerges; m++)
        if (seq_txn_save_tokens(s, &into[m], 1) != 0 ||
            s->tier.ops->merge_values(&s->list_layout, s->tier.dtype, s->pool->base, &merges[m],
                                      1) != 0)
            return -1;
    return 0;
}

/*
 * OpenVINO §2.8: after an eviction, a kept token that moved from index i to
 * j of its list carries RoPE for a position j - i too far; rotate its key
 * back (kv_rope_rerotate). Only full-precision keys can be rewritten; the
 * worker is inside its synchronous step, not reading.
 */
static int list_rerotate(seq *s, const tier_token *tok, const uint8_t *tier, uint32_t n,
                         const policy_decision *d)
{
    int32_t *delta = malloc((n ? n : 1) * sizeof *delta);
    kv_segment *sg = malloc((n ? n : 1) * sizeof *sg);
    tier_token *at = malloc((n ? n : 1) * sizeof *at);
    int rc = delta == NULL || sg == NULL || at == NULL ? -1 : 0;
    uint32_t j = 0, m = 0;
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
        if (tier[i] == POLICY_EVICT)
            continue;
        if (tok[i].tier == POLICY_FULL && j != i) {
            delta[m] = (int32_t)j - (int32_t)i;
            at[m] = tok[i];
            sg[m++] = (kv_segment){tok[i].block, tok[i].slot, 1};
        }
        j++;
    }
    if (rc == 0)
        rc = seq_txn_save_tokens(s, at, m);
    if (rc == 0)
        rc =
            s->tier.ops->rope_rerotate(&s->list_layout, s->tier.dtype, s->pool->base, sg, m, delta,
                                       d->rope_theta > 0 ? d->rope_theta : s->pool->geom.rope_theta,
                                       d->rope_pairing ? KV_ROPE_INTERLEAVED : KV_ROPE_HALF);
    free(delta);
    free(sg);
    free(at);
    return rc;
}

static int full_run_start(const tier_token *kept, uint32_t i)
{
    return kept[i].tier == POLICY_FULL &&
           (i == 0 || kept[i - 1].block != kept[i].block || kept[i - 1].tier != POLICY_FULL);
}

/* Distinct blocks of the full-precision tokens, counted with the pool's
 * marks (cleared again): a step sorts nothing to know it. */
static uint32_t full_blocks(seq *s, const tier_token *kept, uint32_t n)
{
    uint32_t blocks = 0;
    for (uint32_t i = 0; i < n; i++)
        if (full_run_start(kept, i))
            blocks += (uint32_t)seq_mark(s, kept[i].block);
    for (uint32_t i = 0; i < n; i++)
        if (full_run_start(kept, i))
            seq_unmark(s, kept[i].block);
    return blocks;
}

/* Whether this call has copied its compaction budget already, so that a
 * list of nfull full-precision tokens (a window of them, when more: see
 * list_compact) waits for a later call. */
static int compact_over_budget(const seq *s, uint32_t nfull)
{
    uint32_t m = nfull < s->compact_window ? nfull : s->compact_window;
    return s->compacted > 0 && s->compacted + m > s->compact_budget;
}

/* The list's next compaction window: [*from, *to) holds at most
 * s->compact_window of its full-precision tokens (whole blocks of them, so
 * that a window in the middle of the list fills its fresh blocks), from
 * where the last one ended; the whole list when it has no more. Returns
 * their number. */
static uint32_t compact_window(const seq *s, const seq_list *ly, const tier_token *kept, uint32_t n,
                               uint32_t nfull, uint32_t *from, uint32_t *to)
{
    *from = 0, *to = n;
    if (nfull <= s->compact_window)
        return nfull;
    uint32_t w = s->compact_window, slots = s->block_slots;
    w = w > slots ? w - w % slots : w;
    uint32_t m = 0, i = ly->compact_next < n ? ly->compact_next : 0;
    *from = i;
    for (; i < n && m < w; i++)
        m += kept[i].tier == POLICY_FULL;
    *to = i;
    return m;
}

/*
 * seq_internal.h. Conf-KV's contiguous compaction, for any token-level eviction: when the
 * full-precision survivors are spread over more blocks than they fill plus
 * compact_slack(), copy them in list order into fresh blocks
 * (kv_copy_tokens), so that evicting tokens really gives memory back; the
 * old blocks are retired by the caller (those that no token uses any more).
 * A long list is copied a window of s->compact_window tokens at a time, at
 * successive calls while the rule holds, so that no call copies a whole
 * long context (at 32k tokens and head dim 128 that was a 128 MiB copy, tens
 * of milliseconds in one decode step). Skipped, harmlessly, when the pool
 * lacks the blocks, or left to a later call when this one has copied its
 * budget already (SEQ_COMPACT_TOKENS).
 */
int list_compact(seq *s, seq_list *ly, tier_token *kept, uint32_t n)
{
    uint32_t slots = s->block_slots, nfull = 0;
    for (uint32_t i = 0; i < n; i++)
        nfull += kept[i].tier == POLICY_FULL;
    uint32_t need = (nfull + slots - 1) / slots;
    if (need == 0 || full_blocks(s, kept, n) <= need + compact_slack(need))
        return 0;
    uint32_t from, to, m = compact_window(s, ly, kept, n, nfull, &from, &to);
    uint32_t fresh = (m + slots - 1) / slots;
    if (m == 0 || fresh > seq_free_blocks(s) || compact_over_budget(s, m))
        return 0;
    /* The copy in runs, as long as both sides allow: one token at a time
     * is a memcpy of a head's row per call. */
    kv_segment *src = malloc(m * sizeof *src), *dst = malloc(fresh * sizeof *dst);
    uint32_t *blocks = malloc(fresh * sizeof *blocks);
    int rc = src != NULL && dst != NULL && blocks != NULL ? 0 : -1;
    size_t nsrc = 0, ndst = 0;
    for (uint32_t i = from, j = 0; rc == 0 && i < to; i++) {
        if (kept[i].tier != POLICY_FULL)
            continue;
        if (j % slots == 0)
            seq_take_block(s, &blocks[j / slots]); /* checked above */
        nsrc = seq_push_run(src, nsrc, (kv_segment){kept[i].block, kept[i].slot, 1});
        ndst = seq_push_run(dst, ndst, (kv_segment){blocks[j / slots], j % slots, 1});
        j++;
    }
    if (rc == 0)
        rc = s->tier.ops->copy_tokens(&s->list_layout, s->pool->base, src, nsrc, dst, ndst);
    for (uint32_t i = from, j = 0; rc == 0 && i < to; i++)
        if (kept[i].tier == POLICY_FULL) {
            kept[i] = (tier_token){blocks[j / slots], j % slots, POLICY_FULL};
            j++;
        }
    if (rc == 0) {
        s->compacted += m;
        ly->compact_next = to < n ? to : 0;
        /* New tokens fill the last fresh block when the window ends the
         * list; one in the middle keeps its free slots empty. */
        if (to == n) {
            ly->tail_block = blocks[fresh - 1];
            ly->tail_next_slot = (m - 1) % slots + 1;
            ly->has_tail = 1;
        }
    }
    free(src);
    free(dst);
    free(blocks);
    return rc;
}

/* seq_internal.h. list_compact's rule (full_blocks) on the segments. */
int list_compact_due(seq *s, const seq_list *ly)
{
    uint32_t nfull = 0, blocks = 0;
    for (size_t j = 0; j < ly->nsegs; j++)
        if (ly->seg_tier[j] == POLICY_FULL) {
            nfull += ly->segs[j].count;
            blocks += (uint32_t)seq_mark(s, ly->segs[j].block);
        }
    for (size_t j = 0; j < ly->nsegs; j++)
        if (ly->seg_tier[j] == POLICY_FULL)
            seq_unmark(s, ly->segs[j].block);
    uint32_t need = (nfull + s->block_slots - 1) / s->block_slots;
    return need > 0 && blocks > need + compact_slack(need);
}

/* list_retire_unused with the blocks used after already marked (the caller
 * clears those marks): the blocks of before[] not marked are retired, each
 * once; their marks are cleared again. */
static int list_retire_unmarked(seq *s, seq_list *ly, const uint32_t *before, size_t nb,
                                uint64_t epoch)
{
    int rc = 0;
    for (size_t i = 0; i < nb && rc == 0; i++) {
        if (!seq_mark(s, before[i])) /* used after, or retired already */
            continue;
        rc = seq_retire(s, before[i], epoch);
        if (rc == 0 && ly->has_tail && ly->tail_block == before[i])
            ly->has_tail = 0;
    }
    for (size_t i = 0; i < nb; i++)
        seq_unmark(s, before[i]);
    return rc;
}

/* seq_internal.h. The pool's marks say which blocks were seen, so a step
 * sorts nothing; every mark is cleared again before returning. */
int list_retire_unused(seq *s, seq_list *ly, const uint32_t *before, size_t nb,
                       const uint32_t *after, size_t na, uint64_t epoch)
{
    for (size_t i = 0; i < na; i++)
        seq_mark(s, after[i]);
    int rc = list_retire_unmarked(s, ly, before, nb, epoch);
    for (size_t i = 0; i < na; i++)
        seq_unmark(s, after[i]);
    return rc;
}

/* What a decision does to one list's storage (list_touch). */
enum { LIST_TOUCHED, LIST_UNTOUCHED, LIST_COMES_DUE };

/* Whether a run of n decided tiers touches tokens stored at `stored`: an
 * eviction, or a move (needs_move: a quantised or sketched token decided
 * anything else, a full-precision one decided the sketch). Else 0, the
 * tokens decided quantised but still at full precision added to
 * pending[]. */
static int touch_run(uint8_t stored, const uint8_t *tier, uint32_t n,
                     uint32_t pending[POLICY_TIERS])
{
    if (stored != POLICY_FULL) {
        for (uint32_t i = 0; i < n; i++)
            if (tier[i] != stored)
                return 1;
        return 0;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (tier[i] == POLICY_EVICT || tier[i] == POLICY_SKETCH)
            return 1;
        pending[tier[i]]++; /* FULL's count is not looked at */
    }
    return 0;
}

/*
 * What the pending tokens of an otherwise untouched list make of it. A
 * step of a sequence that demotes after its steps, in which tokens decided
 * quantised but still at full precision come to fill a block, and nothing
 * else changes, is LIST_COMES_DUE: all list_apply would do is note it
 * (list_demote_to), after a dozen passes over the whole list (issue 16
 * §4: such a step took 60 µs where the others take 7). With merges, key
 * re-rotation or victims kept in the list, list_apply decides.
 */
static int touch_pending(const seq *s, const seq_list *ly, const policy_decision *d,
                         const uint32_t pending[POLICY_TIERS])
{
    int only_due = s->stepping && s->demote_after_step && ly->noffloaded == 0 && d->nmerges == 0 &&
                   !d->rerotate_keys;
    int due = 0;
    for (uint8_t t = 0; t < POLICY_TIERS; t++) {
        uint32_t t8 = tier_block_tokens(&s->tier, t);
        if (!policy_tier_quantised(t) || pending[t] == 0 || pending[t] < t8)
            continue;
        if (!only_due)
            return LIST_TOUCHED;
        due |= t8 > 0 && pending[t] / t8 <= seq_free_blocks(s); /* list_demote_to's test */
    }
    return due ? LIST_COMES_DUE : LIST_UNTOUCHED;
}

/* What the decision does to list (l, k) as its segments store it, so that
 * a list the step leaves alone is not expanded into tokens first. */
static int list_touch_segments(const seq *s, const seq_list *ly, const policy_decision *d,
                               uint32_t k)
{
    uint32_t pending[POLICY_TIERS] = {0}, t = 0;
    for (size_t i = 0; i < ly->nsegs; i++) {
        if (touch_run(ly->seg_tier[i], d->tier[k] + t, ly->segs[i].count, pending))
            return LIST_TOUCHED;
        t += ly->segs[i].count;
    }
    return touch_pending(s, ly, d, pending);
}

/* The same of the list's tokens, as merges may have left them. */
static int list_touch(const seq *s, const seq_list *ly, const tier_token *tok,
                      const policy_decision *d, uint32_t k, uint32_t n)
{
    uint32_t pending[POLICY_TIERS] = {0};
    for (uint32_t i = 0, j; i < n; i = j) {
        for (j = i + 1; j < n && tok[j].tier == tok[i].tier;)
            j++;
        if (touch_run(tok[i].tier, d->tier[k] + i, j - i, pending))
            return LIST_TOUCHED;
    }
    return touch_pending(s, ly, d, pending);
}

/* A list the decision leaves as it is, but for coming due: saved for a
 * rollback, and marked for seq_demote_plan. */
static int list_mark_due(seq *s, seq_list *ly)
{
    if (seq_txn_save_list(s, ly) != 0)
        return -1;
    ly->demote_due |= SEQ_DUE_TIERS;
    return 0;
}

/* A list that list_touch found untouched is left alone, or marked due:
 * 0, or -1 (out of memory). */
static int list_leave(seq *s, seq_list *ly, int touch)
{
    return touch == LIST_COMES_DUE ? list_mark_due(s, ly) : 0;
}

/* Apply one list's decided tiers to its storage (seq_apply_decision), a
 * list the decision touches (list_touch). */
static int list_apply(seq *s, uint32_t l, uint32_t k, tier_token *tok, const policy_decision *d,
                      uint64_t epoch, int *changed)
{
    seq_list *ly = seq_list_at(s, l, k);
    const uint32_t *pos;
    uint32_t n = seq_list_tokens(s, l, k, &pos);
    const uint8_t *tier = d->tier[k];
    if (seq_txn_save_list(s, ly) != 0)
        return -1;
    *changed = 1;
    /* Blocks used before (at most n + noffloaded + 1 with the tail, three
     * times: see below, and victims add at most n offloaded entries to the
     * last two), after, and an index list (2n, or noffloaded). */
    size_t cap = 2 * ((size_t)2 * n + ly->noffloaded) + 4;
    uint32_t *scratch = malloc(4 * cap * sizeof *scratch);
    if (scratch == NULL)
        return -1;
    uint32_t *before = scratch, *after = scratch + 2 * cap, *idx = scratch + 3 * cap;
    /* From the segments: as stored before this decision (merges may have
     * moved tokens of tok already). */
    size_t nb = list_fill_block_ids(ly, -1, before);
    if (ly->has_tail)
        before[nb++] = ly->tail_block;
    int rc = list_victims(s, ly, l, tok, pos, tier, n, idx);
    if (rc == 0)
        rc = list_victims_quantize(s, ly, idx);
    if (rc == 0)
        rc = list_moves(s, ly, l, tok, pos, tier, n, idx);
    if (rc == 0)
        rc = list_requantize(s, tok, tier, n, idx);
    /* Blocks the victims, moves and re-quantisation took (INT8 blocks,
     * tails for revived tokens) count as used before the demotion, which
     * may empty them again. */
    nb += list_block_ids(ly, tok, n, 1, before + nb);
    if (rc == 0)
        rc = list_demote(s, ly, tok, tier, n, idx, 0);
    if (rc == 0 && d->rerotate_keys)
        rc = list_rerotate(s, tok, tier, n, d);
    uint32_t kept = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] != POLICY_EVICT)
            tok[kept++] = tok[i];
    /* Blocks the moves and the demotion took count as used before
     * compaction, which may leave them. */
    nb += list_block_ids(ly, tok, kept, 1, before + nb);
    if (rc == 0)
        rc = list_compact(s, ly, tok, kept);
    if (rc == 0)
        rc = list_encode(ly, tok, kept);
    if (rc == 0)
        rc = list_retire_unused(s, ly, before, nb, after, list_block_ids(ly, tok, kept, 0, after),
                                epoch);
    free(scratch);
    return rc;
}

/* ---- the step's cuts, for its answer (seq.h seq_step_cuts) ---------------- */

/* Room for this many cut indices is kept between steps; more is given back
 * when a step used less than an eighth of it. */
#define SEQ_CUTS_KEEP 65536

void seq_cuts_begin(seq *s)
{
    seq_cut_log *c = &s->cuts;
    size_t n = seq_nlists(s) ? seq_nlists(s) : 1;
    if (c->count == NULL) {
        c->count = calloc(n, sizeof *c->count);
        c->first = calloc(n, sizeof *c->first);
    }
    c->valid = c->count != NULL && c->first != NULL;
    if (c->valid)
        memset(c->count, 0, n * sizeof *c->count);
    c->from_epoch = s->epoch;
    if (c->cap > SEQ_CUTS_KEEP && c->n < c->cap / 8) { /* a prefill's many cuts: give them back */
        free(c->idx);
        c->idx = NULL;
        c->cap = 0;
    }
    c->n = 0;
}

/* List li lost the tokens at indices [a, b); the lists are cut in order. */
static void cuts_log(seq *s, size_t li, uint32_t a, uint32_t b)
{
    seq_cut_log *c = &s->cuts;
    if (!c->valid)
        return;
    if (c->n + (b - a) > c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 1024;
        while (cap < c->n + (b - a))
            cap *= 2;
        uint32_t *idx = realloc(c->idx, cap * sizeof *idx);
        if (idx == NULL) { /* the worker reads the table instead */
            c->valid = 0;
            return;
        }
        c->idx = idx;
        c->cap = cap;
    }
    if (c->count[li] == 0)
        c->first[li] = (uint32_t)c->n;
    for (uint32_t i = a; i < b; i++)
        c->idx[c->n++] = i;
    c->count[li] += b - a;
}

int seq_step_cuts(const seq *s, seq_cuts *out)
{
    const seq_cut_log *c = &s->cuts;
    if (!c->valid)
        return 0;
    *out = (seq_cuts){c->from_epoch, seq_nlists(s), c->n, c->count, c->first, c->idx};
    return 1;
}

void seq_step_cuts_forget(seq *s)
{
    s->cuts.valid = 0;
}

/* One cut of list_cut_in_place: `take` tokens from token t of segment j,
 * token `at` of the list. */
typedef struct seg_cut {
    size_t seg;
    uint32_t t, take, at;
} seg_cut;

/* The cuts that remove the nevict evicted tokens of tier[0..n), all from
 * `from` on, from the list's segments, in segment order, into cuts[] (room
 * for nevict); the segments are only read. Returns the count, or -1 when
 * the segments hold fewer than the decision's tokens (list_apply then
 * decides). */
static ssize_t list_plan_cuts(const seq_list *ly, const uint8_t *tier, uint32_t n, uint32_t from,
                              uint32_t nevict, seg_cut *cuts)
{
    size_t j = 0, ncuts = 0;
    uint32_t base = 0;  /* the index of segment j's first token */
    uint32_t found = 0; /* evicted tokens planned */
    for (uint32_t a = from; a < n && found < nevict;) {
        const uint8_t *e = memchr(tier + a, POLICY_EVICT, n - a);
        if (e == NULL)
            break;
        a = (uint32_t)(e - tier);
        uint32_t b = a;
        while (b < n && tier[b] == POLICY_EVICT)
            b++;
        found += b - a;
        while (a < b) { /* the run [a, b), segment by segment */
            while (j < ly->nsegs && base + ly->segs[j].count <= a)
                base += ly->segs[j++].count;
            if (j == ly->nsegs)
                return -1;
            uint32_t t = a - base, left = ly->segs[j].count - t;
            uint32_t take = b - a < left ? b - a : left;
            cuts[ncuts++] = (seg_cut){j, t, take, a};
            a += take;
        }
    }
    return (ssize_t)ncuts;
}

/* Room list_cut_pieces needs for the segments it rebuilds: those from the
 * first cut's to the last's, and one more for each cut (a split). */
static size_t cuts_room(const seg_cut *cuts, size_t ncuts)
{
    return ncuts == 0 ? 0 : cuts[ncuts - 1].seg - cuts[0].seg + 1 + ncuts;
}

/* The cuts (in segment order, as list_plan_cuts plans them, at least one)
 * in one pass: the segments from the first cut's to the last's rebuilt
 * from their kept pieces in out[] (cuts_room), with their tiers; returns
 * how many (list_put_pieces puts them in). A block whose segment goes
 * whole is put in gone[]. The list is only read. */
static size_t list_cut_pieces(const seq_list *ly, const seg_cut *cuts, size_t ncuts,
                              kv_segment *out, uint8_t *out_tier, uint32_t *gone, size_t *ngone)
{
    size_t first = cuts[0].seg, last = cuts[ncuts - 1].seg, nout = 0;
    for (size_t c = 0, j = first; j <= last; j++) {
        kv_segment g = ly->segs[j];
        size_t pieces = nout;
        uint32_t from = 0; /* the segment's first token not placed yet */
        for (; c < ncuts && cuts[c].seg == j; c++) {
            if (cuts[c].t > from)
                out[nout++] = (kv_segment){g.block, g.first_slot + from, cuts[c].t - from};
            from = cuts[c].t + cuts[c].take;
        }
        if (from < g.count)
            out[nout++] = (kv_segment){g.block, g.first_slot + from, g.count - from};
        memset(out_tier + pieces, ly->seg_tier[j], nout - pieces);
        if (nout == pieces)
            gone[(*ngone)++] = g.block;
    }
    return nout;
}

/* Segments [first, first + nold) replaced by out[0..nout), those after
 * moved once (room for them all): a prompt cuts thousands of times, and a
 * memmove of every later segment per cut was quadratic. */
static void list_put_pieces(seq_list *ly, size_t first, size_t nold, const kv_segment *out,
                            const uint8_t *out_tier, size_t nout)
{
    size_t after = ly->nsegs - first - nold;
    memmove(&ly->segs[first + nout], &ly->segs[first + nold], after * sizeof *ly->segs);
    memmove(&ly->seg_tier[first + nout], &ly->seg_tier[first + nold], after);
    memcpy(&ly->segs[first], out, nout * sizeof *out);
    memcpy(&ly->seg_tier[first], out_tier, nout);
    ly->nsegs = first + nout + after;
}

/* Whether a segment of the list, or a victim it keeps in the pool
 * (victims=int8), uses block b. */
static int list_uses_block(const seq_list *ly, uint32_t b)
{
    int used = 0;
    for (size_t j = 0; j < ly->nsegs; j++) /* no early exit: vectorised */
        used |= ly->segs[j].block == b;
    for (size_t j = 0; j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        used |= at->tier != POLICY_SKETCH && !tier_token_remote(at) && at->block == b;
    }
    return used;
}

/* Retire at `epoch` the blocks of ids[0..n) (repeats allowed) that the list
 * no longer uses (list_uses_block), each once; the tail is forgotten when
 * it goes. */
static int list_retire_if_unused(seq *s, seq_list *ly, const uint32_t *ids, size_t n,
                                 uint64_t epoch)
{
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        int again = 0;
        for (size_t m = 0; m < i; m++)
            again |= ids[m] == ids[i];
        if (again || list_uses_block(ly, ids[i]))
            continue;
        rc = seq_retire(s, ids[i], epoch);
        if (rc == 0 && ly->has_tail && ly->tail_block == ids[i])
            ly->has_tail = 0;
    }
    return rc;
}

/*
 * list_apply_evictions when no compaction can be due: the evicted tokens
 * are cut out of the segments where they are, the other segments stay as
 * they are (a decode step evicts one token of thousands), and only the
 * blocks whose last segment went are retired. Segments stay maximal: a
 * cut leaves a gap, it never makes two segments contiguous. Returns 1
 * when the segments do not match the decision, else 0 or -1.
 */
static int list_cut_in_place(seq *s, seq_list *ly, const uint8_t *tier, uint32_t n, uint32_t from,
                             uint32_t nevict, uint64_t epoch, int *changed)
{
    seg_cut *cuts = malloc(nevict * sizeof *cuts);
    uint32_t *gone = malloc(nevict * sizeof *gone);
    ssize_t ncuts =
        cuts != NULL && gone != NULL ? list_plan_cuts(ly, tier, n, from, nevict, cuts) : -2;
    int rc = ncuts == -1 ? 1 : ncuts < 0 ? -1 : 0;
    size_t room = rc == 0 ? cuts_room(cuts, (size_t)ncuts) : 0;
    kv_segment *out = rc == 0 ? malloc((room ? room : 1) * sizeof *out) : NULL;
    uint8_t *out_tier = rc == 0 ? malloc(room ? room : 1) : NULL;
    size_t ngone = 0, first = 0, nold = 0, nout = 0;
    if (rc == 0 && (out == NULL || out_tier == NULL))
        rc = -1;
    if (rc == 0 && ncuts > 0) {
        nout = list_cut_pieces(ly, cuts, (size_t)ncuts, out, out_tier, gone, &ngone);
        first = cuts[0].seg;
        nold = cuts[ncuts - 1].seg - first + 1;
    }
    /* The save last: it must come right before the change it undoes. */
    if (rc == 0 && (list_reserve(ly, ly->nsegs + nevict) != 0 ||
                    seq_txn_save_cut(s, ly, first, nold, nout) != 0))
        rc = -1;
    if (rc == 0) {
        *changed = 1;
        list_put_pieces(ly, first, nold, out, out_tier, nout);
        for (ssize_t c = 0; c < ncuts; c++)
            cuts_log(s, (size_t)(ly - s->lists), cuts[c].at, cuts[c].at + cuts[c].take);
    }
    if (rc == 0)
        rc = list_retire_if_unused(s, ly, gone, ngone, epoch);
    free(cuts);
    free(gone);
    free(out);
    free(out_tier);
    return rc;
}

/* list_apply_evictions when a compaction may be due: the kept runs of
 * every segment, merged as list_encode merges, the blocks they use marked
 * and counted for list_compact's rule. Returns 1 when the compaction is
 * due (list_apply compacts), else 0 or -1. */
static int list_cut_rebuild(seq *s, seq_list *ly, const uint8_t *tier, uint32_t n, uint32_t nevict,
                            uint64_t epoch, int *changed)
{
    /* An evicted run splits a segment in two at most once per evicted token. */
    size_t cap = ly->nsegs + nevict, out = 0, nb = 0;
    kv_segment *segs = malloc(cap * sizeof *segs);
    uint32_t *ids = malloc((ly->nsegs + 1 + cap) * sizeof *ids); /* before (tail too), after */
    if (segs == NULL || ids == NULL) {
        free(segs);
        free(ids);
        return -1;
    }
    uint32_t *before = ids, *after = ids + ly->nsegs + 1;
    uint32_t i = 0, kept = 0;
    for (size_t j = 0; j < ly->nsegs && i < n; j++) {
        kv_segment g = ly->segs[j];
        uint32_t c = g.count < n - i ? g.count : n - i;
        before[nb++] = g.block;
        /* Most segments lose nothing: one memchr, not a test a token. */
        for (uint32_t t = 0; t < c;) {
            const uint8_t *e = memchr(tier + i + t, POLICY_EVICT, c - t);
            uint32_t run = e != NULL ? (uint32_t)(e - (tier + i + t)) : c - t;
            if (run > 0)
                out = seq_push_run(segs, out, (kv_segment){g.block, g.first_slot + t, run});
            kept += run;
            if (e != NULL)
                cuts_log(s, (size_t)(ly - s->lists), i + t + run, i + t + run + 1);
            t += run + (e != NULL);
        }
        i += c;
    }
    /* The blocks the kept tokens use, marked (until the end) and counted:
     * list_compact's rule, then what list_retire_unused needs marked. */
    for (size_t j = 0; j < out; j++)
        after[j] = segs[j].block;
    uint32_t need = (kept + s->block_slots - 1) / s->block_slots, blocks = 0;
    for (size_t j = 0; j < out; j++)
        blocks += (uint32_t)seq_mark(s, after[j]);
    int rc = need > 0 && need <= seq_free_blocks(s) && blocks > need + compact_slack(need) ? 1 : 0;
    if (rc == 0 && (seq_txn_save_list(s, ly) != 0 || list_reserve(ly, out ? out : 1) != 0))
        rc = -1;
    if (rc == 0) {
        *changed = 1;
        if (ly->has_tail)
            before[nb++] = ly->tail_block;
        memcpy(ly->segs, segs, out * sizeof *segs);
        memset(ly->seg_tier, POLICY_FULL, out);
        ly->nsegs = out;
        rc = list_retire_unmarked(s, ly, before, nb, epoch);
        /* Counted: the segments' blocks, and the tail's once more, in case
         * no segment ends in it yet (list_grow would then fill it without
         * taking a block to count). An upper bound is all the rule needs. */
        ly->blocks_at_most = blocks + (uint32_t)ly->has_tail;
    }
    for (size_t j = 0; j < out; j++)
        seq_unmark(s, after[j]);
    free(segs);
    free(ids);
    return rc;
}

/* What a decision does to a list with quantised segments, a run of
 * segments of one stored tier at a time: kept[t] tokens stay in tier t (a
 * full-precision token decided quantised stays full and counts in
 * pending[] as well), *nevict go. 0 when some token moves to another tier,
 * the list holds tokens in the sketch (list_apply's), or the segments hold
 * other than the decision's n. */
static int tiered_keep_or_evict(const seq_list *ly, const uint8_t *tier, uint32_t n, policy_span sp,
                                uint32_t kept[POLICY_TIERS], uint32_t pending[POLICY_TIERS],
                                uint32_t *nevict)
{
    uint32_t i = 0, evict = 0;
    for (size_t j = 0, e; j < ly->nsegs; j = e) {
        uint8_t stored = ly->seg_tier[j];
        uint32_t c = 0, count[POLICY_TIERS] = {0}, ev;
        for (e = j; e < ly->nsegs && ly->seg_tier[e] == stored; e++)
            c += ly->segs[e].count;
        /* Tokens in the sketch (reviver's) have no block to cut from: an
         * evicted one leaves the sketch in list_victims. */
        if (stored == POLICY_SKETCH || c > n - i)
            return 0;
        /* [a, b): what may differ from the stored tier. Outside the span
         * every tier is FULL (policy.h): a full-precision run is read only
         * where it meets the span. */
        uint32_t a = i, b = i + c;
        if (stored == POLICY_FULL) {
            a = sp.lo > a ? sp.lo : a;
            b = sp.hi < b ? sp.hi : b;
            b = b > a ? b : a;
        }
        /* Most runs only keep or evict: a third of the counting's work. */
        if (policy_tiers_keep_or_evict(tier + a, b - a, stored, &ev)) {
            i += c;
            evict += ev;
            kept[stored] += c - ev;
            continue;
        }
        if (policy_tiers_count(tier + a, b - a, count) != 0)
            return 0;
        i += c;
        evict += count[POLICY_EVICT];
        kept[stored] += c - count[POLICY_EVICT];
        for (uint8_t t = 0; t < POLICY_TIERS; t++) {
            if (t == stored || t == POLICY_EVICT || count[t] == 0)
                continue;
            if (stored != POLICY_FULL || !policy_tier_quantised(t))
                return 0;
            pending[t] += count[t];
        }
    }
    *nevict = evict;
    return i == n;
}

/* At least as many blocks as tier t's segments use: the runs of one block
 * among them (a block's tokens may come back after another's: counted
 * twice, still a bound). */
static uint32_t tier_blocks_at_most(const seq_list *ly, uint8_t t)
{
    uint32_t runs = 0, last = UINT32_MAX;
    for (size_t j = 0; j < ly->nsegs; j++) {
        if (ly->seg_tier[j] != t)
            continue;
        runs += ly->segs[j].block != last;
        last = ly->segs[j].block;
    }
    return runs;
}

/* Whether, after cuts that leave kept[t] tokens in tier t, neither
 * list_compact (full precision) nor list_requantize (each quantised tier)
 * can be due: cuts never add blocks, so the blocks the segments use now
 * bound what they will use. */
static int tiers_under_rules(const seq *s, const seq_list *ly, const uint32_t kept[POLICY_TIERS])
{
    for (uint8_t t = 0; t < POLICY_TIERS; t++) {
        uint32_t per = t == POLICY_FULL ? s->block_slots : tier_block_tokens(&s->tier, t);
        if (t != POLICY_FULL && !policy_tier_quantised(t))
            continue;
        if (kept[t] == 0 || per == 0)
            continue;
        uint32_t need = (kept[t] + per - 1) / per, limit = need + compact_slack(need);
        if (t == POLICY_FULL && compact_over_budget(s, kept[t]))
            continue;
        /* The blocks every segment uses, when known, bound full precision's
         * without a walk over the segments. */
        if (t == POLICY_FULL && ly->blocks_at_most != SEQ_BLOCKS_UNKNOWN &&
            ly->blocks_at_most <= limit)
            continue;
        if (tier_blocks_at_most(ly, t) > limit)
            return 0;
    }
    return 1;
}

/* victims=sketch: the nevict tokens tier[] evicts from list (l, k), all
 * from token `from` on, found in its segments with their positions, go
 * into the list's sketch and its offloaded victims (list_victims) before
 * they are cut out. 0, or -1. */
static int offload_victims(seq *s, uint32_t l, uint32_t k, const uint8_t *tier, uint32_t from,
                           uint32_t nevict)
{
    seq_list *ly = seq_list_at(s, l, k);
    const uint32_t *pos;
    seq_list_tokens(s, l, k, &pos);
    tier_token *tok = malloc(nevict * sizeof *tok);
    uint32_t *at = malloc(2 * (size_t)nevict * sizeof *at), m = 0;
    uint8_t *evict = malloc(nevict);
    int rc = tok != NULL && at != NULL && evict != NULL ? 0 : -1;
    for (size_t j = 0, i = 0; rc == 0 && j < ly->nsegs && m < nevict; i += ly->segs[j++].count) {
        const kv_segment *g = &ly->segs[j];
        if (i + g->count <= from)
            continue;
        for (uint32_t t = 0; t < g->count && m < nevict; t++) {
            const uint8_t *e = memchr(tier + i + t, POLICY_EVICT, g->count - t);
            if (e == NULL)
                break;
            t = (uint32_t)(e - (tier + i));
            tok[m] = (tier_token){g->block, g->first_slot + t, ly->seg_tier[j]};
            at[m++] = pos[i + t];
        }
    }
    if (rc == 0) {
        /* They go after the victims up to the first one's position (in
         * order, list_offload_push): those stay as they are. */
        size_t lo = 0, hi = ly->noffloaded;
        while (m > 0 && lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (ly->offloaded[mid] <= at[0])
                lo = mid + 1;
            else
                hi = mid;
        }
        memset(evict, POLICY_EVICT, m);
        rc = seq_txn_save_list_from(s, ly, lo) != 0
                 ? -1
                 : list_victims(s, ly, l, tok, at, evict, m, at + m);
    }
    free(tok);
    free(at);
    free(evict);
    return rc;
}

/* victims=int8: list_victims_quantize, then the full-precision blocks the
 * quantised victims were the last tokens of retired at `epoch`. 0, or -1. */
static int quantize_victims(seq *s, seq_list *ly, uint64_t epoch)
{
    size_t nfull = 0, n = ly->noffloaded, before = ly->nfull_victims;
    if (before < s->tier.l8.block_tokens)
        return 0; /* list_victims_quantize would find no block's worth */
    uint32_t *ids = malloc(2 * (n ? n : 1) * sizeof *ids);
    if (ids == NULL)
        return -1;
    for (size_t j = 0; j < n; j++)
        if (ly->offloaded_at[j].tier == POLICY_FULL)
            ids[nfull++] = ly->offloaded_at[j].block;
    int rc = list_victims_quantize(s, ly, ids + n);
    if (rc == 0 && ly->nfull_victims < before) /* some were quantised (not only marked due) */
        rc = list_retire_if_unused(s, ly, ids, nfull, epoch);
    free(ids);
    return rc;
}

/*
 * list_apply_evictions for a list with quantised segments (int8=on, or
 * demote=int4 / int2, on a decode step): when the decision keeps every
 * token in the tier it is stored in and evicts some, and the tokens it
 * decides quantised but are stored at full precision at most come due
 * for the demoter, the evicted tokens are cut out in place, as from a
 * full-precision list, as long as no compaction or re-quantisation can be
 * due. Otherwise, as before this path existed, every such step expanded,
 * applied, compacted and encoded the whole list (issue 16 §2: an h2o decode
 * step with int8=on took 8x the same step without, at 32k tokens, and its
 * answer had no cuts, so the worker read its whole table again). Returns
 * 1 when it does not apply (list_apply decides), else 0 or -1.
 */
static int list_apply_tiered_evictions(seq *s, uint32_t l, uint32_t k, const policy_decision *d,
                                       uint32_t n, uint64_t epoch, int *changed)
{
    seq_list *ly = seq_list_at(s, l, k);
    uint32_t kept[POLICY_TIERS] = {0}, pending[POLICY_TIERS] = {0}, nevict = 0;
    policy_span sp = policy_decision_span_of(d, k, n);
    if (sp.hi > n || !tiered_keep_or_evict(ly, d->tier[k], n, sp, kept, pending, &nevict))
        return 1;
    int touch = touch_pending(s, ly, d, pending);
    int tail_unused =
        ly->has_tail && (ly->nsegs == 0 || ly->segs[ly->nsegs - 1].block != ly->tail_block);
    if (touch == LIST_TOUCHED || (nevict > 0 && (tail_unused || !tiers_under_rules(s, ly, kept))))
        return 1;
    policy_victims victims = policy_host_storage(s->host)->victims;
    int rc = 0;
    if (nevict > 0 && victims != POLICY_VICTIMS_EVICT)
        rc = offload_victims(s, l, k, d->tier[k], sp.lo, nevict);
    /* The segments hold the decision's n (tiered_keep_or_evict), so the
     * cuts apply: list_cut_in_place does not hand the list back to
     * list_apply, which would offload the victims again. A block an INT8
     * victim stays in is not retired (list_uses_block). */
    if (rc == 0 && nevict > 0)
        rc = list_cut_in_place(s, ly, d->tier[k], n, 0, nevict, epoch, changed);
    if (rc == 0 && nevict > 0 && victims == POLICY_VICTIMS_INT8)
        rc = quantize_victims(s, ly, epoch);
    return rc == 0 ? list_leave(s, ly, touch) : rc;
}

/*
 * The common step, without a token array: a list stored all at full
 * precision (or with quantised segments: list_apply_tiered_evictions), no
 * victims kept, whose decision only keeps (FULL) and evicts.
 * What list_apply does then comes down to cutting the evicted tokens out
 * of the segments and retiring the blocks left empty, so it is done on the
 * segments (issue 16 §2: a streaming step at 32k tokens × 32 layers), in
 * place when no compaction can be due, where list_apply makes a dozen
 * passes over a 12-byte entry per token. The result is the same segments
 * and retired blocks as list_apply's. Returns 1 when it does not apply (a
 * tier to move, victims to keep, or a compaction due, which list_apply
 * does), else 0 or -1 (out of memory).
 */
static int list_apply_evictions(seq *s, uint32_t l, uint32_t k, const policy_decision *d,
                                uint64_t epoch, int *changed)
{
    seq_list *ly = seq_list_at(s, l, k);
    uint32_t n = seq_list_tokens(s, l, k, NULL), nevict;
    const uint8_t *tier = d->tier[k];
    policy_victims victims = policy_host_storage(s->host)->victims;
    if (victims != POLICY_VICTIMS_EVICT)
        return list_apply_tiered_evictions(s, l, k, d, n, epoch, changed);
    if (ly->noffloaded > 0)
        return 1;
    if (!seq_list_all_full(ly))
        return list_apply_tiered_evictions(s, l, k, d, n, epoch, changed);
    /* Outside its span every tier is and stays POLICY_FULL (policy.h). */
    policy_span sp = policy_decision_span_of(d, k, n);
    if (sp.hi > n)
        return 1;
    nevict = 0; /* an empty span: maybe an empty list, with no array to offset */
    if (sp.hi > sp.lo &&
        !policy_tiers_keep_or_evict(tier + sp.lo, sp.hi - sp.lo, POLICY_FULL, &nevict))
        return 1;
    if (nevict == 0)
        return 0; /* list_touch: LIST_UNTOUCHED */
    /* The blocks kept tokens use after the cuts are at most the segments
     * after them, and each evicted token splits at most one segment: below
     * list_compact's rule, no compaction can be due. A tail block that no
     * segment ends in (none of its slots written yet) is list_apply's. */
    uint32_t kept = n - nevict, need = (kept + s->block_slots - 1) / s->block_slots;
    size_t limit = (size_t)need + compact_slack(need);
    int tail_unused =
        ly->has_tail && (ly->nsegs == 0 || ly->segs[ly->nsegs - 1].block != ly->tail_block);
    /* Cuts never add blocks: a list known to use few enough blocks stays
     * under the rule too, however many segments decode steps split it into
     * (the rebuild is a pass over every segment of every list). A list
     * this call has no budget left to compact is cut in place as well. */
    int under_rule = ly->nsegs + nevict <= limit ||
                     (ly->blocks_at_most != SEQ_BLOCKS_UNKNOWN && ly->blocks_at_most <= limit) ||
                     compact_over_budget(s, kept);
    if (under_rule && !tail_unused)
        return list_cut_in_place(s, ly, tier, n, sp.lo, nevict, epoch, changed);
    return list_cut_rebuild(s, ly, tier, n, nevict, epoch, changed);
}

status_code seq_apply_storage(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                              int *changed, status *st)
{
    tier_token **toks = calloc(s->heads, sizeof *toks);
    int rc = toks == NULL ? -1 : 0;
    /* Merges found in the segments (0), or left to apply_merges (1), which
     * works on the token arrays of all the layer's lists. */
    int merges_left = 0;
    if (rc == 0 && d->nmerges > 0) {
        merges_left = d->rerotate_keys ? 1 : apply_merges_in_segments(s, l, d);
        rc = merges_left < 0 ? -1 : 0;
    }
    /* Lists the common step leaves to list_apply: all of them when merges
     * are left. */
    uint8_t *general = malloc(s->heads);
    rc = general == NULL ? -1 : rc;
    for (uint32_t k = 0; rc == 0 && k < s->heads; k++) {
        general[k] = 1;
        if (merges_left == 0 && !d->rerotate_keys) {
            int r = list_apply_evictions(s, l, k, d, epoch, changed);
            rc = r < 0 ? -1 : 0;
            general[k] = r == 1;
        }
    }
    for (uint32_t k = 0; rc == 0 && k < s->heads; k++) {
        if (!general[k])
            continue;
        int touch = merges_left ? LIST_TOUCHED : list_touch_segments(s, seq_list_at(s, l, k), d, k);
        if (touch != LIST_TOUCHED) {
            general[k] = 0;
            rc = list_leave(s, seq_list_at(s, l, k), touch);
            continue;
        }
        seq_step_cuts_forget(s); /* list_apply may move tokens or change tiers */
        toks[k] = list_expand(seq_list_at(s, l, k), seq_list_tokens(s, l, k, NULL));
        rc = toks[k] == NULL ? -1 : 0;
    }
    if (rc == 0 && merges_left)
        rc = apply_merges(s, l, d, toks);
    *changed |= d->nmerges > 0;
    for (uint32_t k = 0; rc == 0 && k < s->heads; k++) {
        if (!general[k])
            continue;
        /* After merges the segments are not what the tokens are: ask the
         * tokens (without merges the segments above answered already). */
        seq_list *ly = seq_list_at(s, l, k);
        int touch = merges_left ? list_touch(s, ly, toks[k], d, k, seq_list_tokens(s, l, k, NULL))
                                : LIST_TOUCHED;
        rc = touch == LIST_TOUCHED ? list_apply(s, l, k, toks[k], d, epoch, changed)
                                   : list_leave(s, ly, touch);
    }
    for (uint32_t k = 0; toks != NULL && k < s->heads; k++)
        free(toks[k]);
    free(toks);
    free(general);
    if (rc != 0)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    return ST_OK;
}

status_code seq_apply_decision(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                               size_t *evicted, int *changed, status *st)
{
    if (seq_apply_storage(s, l, d, epoch, changed, st) != ST_OK)
        return st->code;
    *evicted += policy_host_commit(s->host, l);
    return ST_OK;
}

/* Quantise list (l, k)'s tokens decided INT8 but stored at full precision,
 * a partial INT8 block included, then retire what the list no longer uses
 * as list_apply does: the blocks before (with the tail) that are not used
 * after (without it), each once. The INT8 blocks it takes are all used
 * after. */
static int list_demote_now(seq *s, uint32_t l, uint32_t k, uint64_t epoch, int *changed)
{
    seq_list *ly = seq_list_at(s, l, k);
    const policy_layer_view *v = policy_host_view(s->host, l);
    uint32_t n = v->tokens[k];
    const uint8_t *tier = v->tier[k];
    size_t cap = (size_t)n + ly->noffloaded + 2; /* blocks before (with the tail), after, indices */
    tier_token *tok = list_expand(ly, n);
    uint32_t *scratch = malloc(3 * cap * sizeof *scratch);
    if (tok == NULL || scratch == NULL) {
        free(tok);
        free(scratch);
        return -1;
    }
    uint32_t *before = scratch, *after = scratch + cap, *idx = scratch + 2 * cap;
    size_t nb = list_block_ids(ly, tok, n, 1, before);
    uint64_t moved = s->moved[POLICY_INT8] + s->moved[POLICY_INT4] + s->moved[POLICY_INT2];
    int rc = seq_txn_save_list(s, ly);
    if (rc == 0)
        rc = list_demote(s, ly, tok, tier, n, idx, 1);
    if (rc == 0 && s->moved[POLICY_INT8] + s->moved[POLICY_INT4] + s->moved[POLICY_INT2] != moved) {
        *changed = 1;
        rc = list_encode(ly, tok, n);
        if (rc == 0)
            rc = list_retire_unused(s, ly, before, nb, after, list_block_ids(ly, tok, n, 0, after),
                                    epoch);
    }
    free(tok);
    free(scratch);
    return rc;
}

status_code seq_demote_pending(seq *s, uint32_t layer, uint64_t epoch, int *changed, status *st)
{
    for (uint32_t k = 0; k < s->heads; k++)
        if (list_demote_now(s, layer, k, epoch, changed) != 0)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    return ST_OK;
}
