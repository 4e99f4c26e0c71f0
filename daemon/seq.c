#include "seq.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstash_step.h"

/* The ring's array bits are the policies' needs (proto/kvstash_step.h). */
_Static_assert(STEP_SCORE == (unsigned)POLICY_NEEDS_SCORE &&
                   STEP_LAST_ATTN == (unsigned)POLICY_NEEDS_LAST_ATTN &&
                   STEP_WINDOW_ATTN == (unsigned)POLICY_NEEDS_WINDOW_ATTN &&
                   STEP_VNORM == (unsigned)POLICY_NEEDS_VNORM,
               "step array bits differ from POLICY_NEEDS_*");

status_code seq_create(uint64_t id, uint64_t session_id, pool *pool, const policy_ops *policy,
                       const policy_params *params, const char *label, seq **out, status *st)
{
    *out = NULL;
    seq *s = calloc(1, sizeof *s);
    if (s == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    s->id = id;
    s->session_id = session_id;
    s->pool = pool;
    s->policy = policy;
    s->params = *params;
    snprintf(s->label, sizeof s->label, "%s", label ? label : "");
    s->nlayers = pool->geom.layers;
    s->heads = policy->per_head ? pool->geom.kv_heads : 1;
    s->list_layout = pool->layout;
    if (policy->per_head) { /* a block holds rows of one head */
        s->list_layout.block_tokens *= s->list_layout.kv_heads;
        s->list_layout.kv_heads = 1;
    }
    s->block_slots = s->list_layout.block_tokens;
    if (tier_ctx_init(&s->tier, pool->backend->ops, pool->base, pool->block_bytes, &s->list_layout,
                      (kv_dtype)pool->geom.dtype) != 0) {
        free(s);
        return status_set(st, ST_INVALID_ARGUMENT,
                          "a block of this pool cannot hold an INT8 block");
    }
    s->lists = calloc((size_t)s->nlayers * s->heads, sizeof *s->lists);
    if (s->lists == NULL) {
        free(s);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    const pool_geometry *pg = &pool->geom;
    policy_geometry g = {pg->layers,   pg->q_heads,      pg->kv_heads,
                         pg->head_dim, pg->block_tokens, pg->rope_theta};
    char err[POLICY_ERR_LEN] = "";
    errno = 0; /* a policy refused by a failed allocation leaves ENOMEM, as malloc sets it */
    if (policy_host_create(policy, &s->params, &g, &s->host, err, sizeof err) != 0) {
        status_set(st, errno == ENOMEM ? ST_RESOURCE_EXHAUSTED : ST_INVALID_ARGUMENT,
                   "policy %s: %s", policy->name, err);
        free(s->lists);
        free(s);
        return st->code;
    }
    *out = s;
    return ST_OK;
}

static size_t seq_nlists(const seq *s)
{
    return (size_t)s->nlayers * s->heads;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Sort and drop repeats; returns the new count. */
static size_t sort_unique(uint32_t *a, size_t m)
{
    qsort(a, m, sizeof *a, cmp_u32);
    size_t d = 0;
    for (size_t i = 0; i < m; i++)
        if (d == 0 || a[d - 1] != a[i])
            a[d++] = a[i];
    return d;
}

/* The blocks (with repeats) of a list's offloaded victims stored in `tier`
 * (any tier with a block when tier < 0), written from out[0]. */
static size_t offloaded_block_ids(const seq_list *ly, int tier, uint32_t *out)
{
    size_t m = 0;
    for (size_t j = 0; j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        if (at->tier != POLICY_SKETCH && (tier < 0 || at->tier == tier))
            out[m++] = at->block;
    }
    return m;
}

/* The blocks (with repeats) of a list's segments and offloaded victims
 * stored in `tier` (any tier with a block when tier < 0), written from
 * out[0] (room for nsegs + noffloaded). */
static size_t list_fill_block_ids(const seq_list *ly, int tier, uint32_t *out)
{
    size_t m = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        if (ly->seg_tier[i] != POLICY_SKETCH && (tier < 0 || ly->seg_tier[i] == tier))
            out[m++] = ly->segs[i].block;
    return m + offloaded_block_ids(ly, tier, out + m);
}

/* The distinct blocks of a list's segments and offloaded victims stored in
 * `tier` (any tier with a block when tier < 0), sorted, in a malloc'd *out
 * (NULL and 0 when out of memory: callers count nothing rather than fail).
 * A block's segments need not be adjacent: revived and sketched tokens
 * interleave with others. */
static size_t list_block_ids(const seq_list *ly, int tier, uint32_t **out)
{
    *out = malloc((ly->nsegs + ly->noffloaded + 1) * sizeof **out);
    if (*out == NULL)
        return 0;
    return sort_unique(*out, list_fill_block_ids(ly, tier, *out));
}

static uint32_t list_count_blocks(const seq_list *ly, int tier)
{
    uint32_t *ids;
    size_t n = list_block_ids(ly, tier, &ids);
    free(ids);
    return (uint32_t)n;
}

uint32_t seq_list_blocks(const seq *s, uint32_t layer, uint32_t head)
{
    return list_count_blocks(&s->lists[(size_t)layer * s->heads + head], -1);
}

static void list_free_blocks(seq_list *ly, pool *p)
{
    uint32_t *ids;
    size_t n = list_block_ids(ly, -1, &ids);
    for (size_t i = 0; i < n; i++)
        pool_free_block(p, ids[i]);
    free(ids);
    /* A tail block whose every token was evicted is retired, not in segs. */
}

void seq_destroy(seq *s)
{
    if (s == NULL)
        return;
    for (size_t i = 0; i < seq_nlists(s); i++) {
        list_free_blocks(&s->lists[i], s->pool);
        free(s->lists[i].segs);
        free(s->lists[i].seg_tier);
        free(s->lists[i].offloaded);
        free(s->lists[i].offloaded_at);
        free(s->lists[i].victim_blocks);
        tier_sketch_free(&s->lists[i].sketch);
    }
    for (size_t i = 0; i < s->nretired; i++)
        pool_free_block(s->pool, s->retired[i].block);
    policy_host_destroy(s->host);
    snapshot_tiers_free(&s->report);
    free(s->retired);
    free(s->lists);
    free(s);
}

void seq_ack(seq *s, uint64_t ack_epoch)
{
    size_t kept = 0;
    for (size_t i = 0; i < s->nretired; i++) {
        if (s->retired[i].epoch <= ack_epoch)
            pool_free_block(s->pool, s->retired[i].block);
        else
            s->retired[kept++] = s->retired[i];
    }
    s->nretired = kept;
}

uint32_t seq_blocks_held(const seq *s)
{
    uint32_t n = (uint32_t)s->nretired;
    for (size_t k = 0; k < seq_nlists(s); k++)
        n += list_count_blocks(&s->lists[k], -1);
    return n;
}

size_t seq_retired_count(const seq *s)
{
    return s->nretired;
}

uint32_t seq_list_tokens(seq *s, uint32_t layer, uint32_t head, const uint32_t **positions)
{
    const policy_layer_view *v = policy_host_view(s->host, layer);
    if (positions != NULL)
        *positions = v->positions[head];
    return v->tokens[head];
}

uint64_t seq_tokens_held(seq *s)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        for (uint32_t k = 0; k < s->heads; k++)
            n += seq_list_tokens(s, l, k, NULL);
    return n;
}

/* ---- growth helpers --------------------------------------------------- */

static int grow(void **arr, size_t *cap, size_t need, size_t elt)
{
    if (need <= *cap)
        return 0;
    size_t ncap = *cap ? *cap : 8;
    while (ncap < need)
        ncap *= 2;
    void *n = realloc(*arr, ncap * elt);
    if (n == NULL)
        return -1;
    *arr = n;
    *cap = ncap;
    return 0;
}

static int list_reserve(seq_list *ly, size_t nsegs)
{
    size_t cap = ly->segs_cap;
    if (grow((void **)&ly->segs, &cap, nsegs, sizeof *ly->segs) != 0)
        return -1;
    if (cap != ly->segs_cap) {
        uint8_t *t = realloc(ly->seg_tier, cap);
        if (t == NULL)
            return -1; /* segs grew; segs_cap stays, so the next call retries */
        ly->seg_tier = t;
        ly->segs_cap = cap;
    }
    return 0;
}

static int seq_retire(seq *s, uint32_t block, uint64_t epoch)
{
    if (grow((void **)&s->retired, &s->retired_cap, s->nretired + 1, sizeof *s->retired) != 0)
        return -1;
    s->retired[s->nretired++] = (seq_retired){block, epoch};
    return 0;
}

static int tail_usable(const seq_list *ly, uint32_t block_slots)
{
    return ly->has_tail && ly->tail_next_slot < block_slots;
}

/* ---- the tokens of a list, one by one ---------------------------------- */

/* Expand a list's segments into one entry per token. */
static tier_token *list_expand(const seq_list *ly, uint32_t n)
{
    tier_token *tok = malloc((n ? n : 1) * sizeof *tok);
    if (tok == NULL)
        return NULL;
    size_t t = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        for (uint32_t j = 0; j < ly->segs[i].count && t < n; j++)
            tok[t++] = (tier_token){ly->segs[i].block, ly->segs[i].first_slot + j, ly->seg_tier[i]};
    return tok;
}

/* Rebuild a list's segments from per-token storage (runs of one tier in one
 * block with consecutive slots; sketch runs have no block). */
static int list_encode(seq_list *ly, const tier_token *tok, uint32_t n)
{
    if (list_reserve(ly, n ? n : 1) != 0)
        return -1;
    size_t out = 0;
    for (uint32_t i = 0; i < n; i++) {
        kv_segment *last = out ? &ly->segs[out - 1] : NULL;
        int sketch = tok[i].tier == POLICY_SKETCH;
        if (last != NULL && ly->seg_tier[out - 1] == tok[i].tier &&
            (sketch ||
             (last->block == tok[i].block && last->first_slot + last->count == tok[i].slot))) {
            last->count++;
            continue;
        }
        ly->segs[out] =
            sketch ? (kv_segment){TIER_NO_BLOCK, 0, 1} : (kv_segment){tok[i].block, tok[i].slot, 1};
        ly->seg_tier[out++] = tok[i].tier;
    }
    ly->nsegs = out;
    return 0;
}

/* Distinct blocks the tokens and the list's offloaded victims use (and the
 * tail block, with_tail), sorted, written from out[0] (room for n +
 * noffloaded + 1). */
static size_t list_block_set(const seq_list *ly, const tier_token *tok, uint32_t n, int with_tail,
                             uint32_t *out)
{
    size_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tok[i].tier != POLICY_SKETCH)
            out[m++] = tok[i].block;
    m += offloaded_block_ids(ly, -1, out + m);
    if (with_tail && ly->has_tail)
        out[m++] = ly->tail_block;
    return sort_unique(out, m);
}

/* A never-written full-precision slot at the list's tail (a new block when
 * the tail is full). Returns -1 when the pool has no free block. */
static int list_take_slot(seq *s, seq_list *ly, tier_token *out)
{
    if (!tail_usable(ly, s->block_slots)) {
        if (pool_alloc_block(s->pool, &ly->tail_block) != 0)
            return -1;
        ly->tail_next_slot = 0;
        ly->has_tail = 1;
    }
    *out = (tier_token){ly->tail_block, ly->tail_next_slot++, POLICY_FULL};
    return 0;
}

static int list_sketch_ready(seq *s, seq_list *ly, uint32_t layer)
{
    if (ly->sketch.sk.key != NULL)
        return 0;
    policy_sketch_geometry g;
    policy_host_sketch_geometry(s->host, layer, &g);
    return tier_sketch_init(&ly->sketch, &s->tier, &g);
}

/* Read the FULL / INT8 tokens idx[0..m) of tok into staging buffers. */
static int stage_tokens(seq *s, const tier_token *tok, const uint32_t *idx, size_t m, uint8_t **k,
                        uint8_t **v)
{
    size_t half = (m ? m : 1) * tier_token_bytes(&s->tier) / 2;
    tier_token *sel = malloc((m ? m : 1) * sizeof *sel);
    *k = tier_stage_alloc(&s->tier, m);
    if (sel == NULL || *k == NULL) {
        free(sel);
        tier_stage_free(&s->tier, *k);
        return -1;
    }
    *v = *k + half;
    for (size_t i = 0; i < m; i++)
        sel[i] = tok[idx[i]];
    int rc = tier_read(&s->tier, sel, m, *k, *v);
    free(sel);
    if (rc != 0)
        tier_stage_free(&s->tier, *k);
    return rc;
}

const snapshot_tiers *seq_tier_report(const seq *s)
{
    return &s->report;
}

void seq_tier_report_clear(seq *s)
{
    snapshot_tiers_clear(&s->report);
}

/* Count n tokens moved to tier move t (moved[]) in the totals and the report. */
static void seq_moved(seq *s, int t, uint64_t n)
{
    s->moved[t] += n;
    s->report.moved[t] += n;
}

/* tier_error_ratio of tokens idx[0..m) of tok against the staged k, v. */
static int stage_error(seq *s, const tier_token *tok, const uint32_t *idx, size_t m,
                       const uint8_t *k, const uint8_t *v, double *ratio)
{
    tier_token *sel = malloc((m ? m : 1) * sizeof *sel);
    if (sel == NULL)
        return -1;
    for (size_t i = 0; i < m; i++)
        sel[i] = tok[idx[i]];
    int rc = tier_error_ratio(&s->tier, sel, m, k, v, ratio);
    free(sel);
    return rc;
}

/* Insert tokens idx[0..m) (FULL or INT8) into the sketch; they become
 * sketch tokens. */
static int move_to_sketch(seq *s, seq_list *ly, uint32_t layer, tier_token *tok,
                          const uint32_t *pos, const uint32_t *idx, size_t m)
{
    uint8_t *k, *v;
    uint32_t *p = malloc((m ? m : 1) * sizeof *p);
    if (p == NULL || list_sketch_ready(s, ly, layer) != 0 ||
        stage_tokens(s, tok, idx, m, &k, &v) != 0) {
        free(p);
        return -1;
    }
    for (size_t i = 0; i < m; i++)
        p[i] = pos[idx[i]];
    int rc = tier_sketch_insert(&ly->sketch, &s->tier, p, m, k, v);
    double rel;
    if (rc == 0 && tier_sketch_error(&ly->sketch, &s->tier, p, m, k, v, &rel) == 0)
        snapshot_tiers_observe(&s->report, SNAPSHOT_OBS_SKETCH, rel);
    for (size_t i = 0; rc == 0 && i < m; i++)
        tok[idx[i]] = (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH};
    seq_moved(s, 1, rc == 0 ? m : 0);
    tier_stage_free(&s->tier, k);
    free(p);
    return rc;
}

/* Bring token i (SKETCH or INT8) back to a fresh full-precision slot: the
 * sketch's estimate, deleted from the sketch (KVReviver swap, Alg. 3), or
 * the dequantised values. Leaves it where it is when the pool is full. */
static int move_to_full(seq *s, seq_list *ly, tier_token *tok, const uint32_t *pos, uint32_t i)
{
    tier_token dst;
    /* The tail as it was: a failed copy gives the slot (and a block taken
     * for it) back, or the block would be held by no segment (test_faults). */
    uint32_t tail = ly->tail_block, next = ly->tail_next_slot;
    int had_tail = ly->has_tail, fresh = !tail_usable(ly, s->block_slots);
    if (list_take_slot(s, ly, &dst) != 0)
        return 0;
    if (tok[i].tier == POLICY_SKETCH
            ? tier_sketch_read(&ly->sketch, &s->tier, s->pool->base, &pos[i], 1, &dst, 1) != 0
            : tier_copy(&s->tier, &tok[i], 1, &dst) != 0) {
        if (fresh)
            pool_free_block(s->pool, dst.block);
        ly->tail_block = tail, ly->tail_next_slot = next, ly->has_tail = had_tail;
        return -1;
    }
    tok[i] = dst;
    seq_moved(s, 2, 1);
    return 0;
}

/* Keep a victim out of the list, stored at `at`. */
static int offload_push(seq_list *ly, uint32_t position, tier_token at)
{
    size_t cap = ly->offloaded_cap;
    if (grow((void **)&ly->offloaded, &cap, ly->noffloaded + 1, sizeof *ly->offloaded) != 0 ||
        grow((void **)&ly->offloaded_at, &ly->offloaded_cap, ly->noffloaded + 1,
             sizeof *ly->offloaded_at) != 0)
        return -1;
    /* Victims leave in position order within a step, but a step's victims
     * may be older than an earlier step's: keep the arrays sorted. */
    size_t i = ly->noffloaded;
    while (i > 0 && ly->offloaded[i - 1] > position) {
        ly->offloaded[i] = ly->offloaded[i - 1];
        ly->offloaded_at[i] = ly->offloaded_at[i - 1];
        i--;
    }
    ly->offloaded[i] = position;
    ly->offloaded_at[i] = at;
    ly->noffloaded++;
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
        if (mode != POLICY_VICTIMS_EVICT && offload_push(ly, pos[i], at) != 0)
            return -1;
    }
    if (m > 0 && move_to_sketch(s, ly, layer, tok, pos, scratch, m) != 0)
        return -1;
    return gone ? tier_sketch_delete(&ly->sketch, scratch + n - gone, gone) : 0;
}

/* Whether token i's storage must change for decided tier `want` (INT8
 * demotion is batched separately). */
static int needs_move(uint8_t stored, uint8_t want)
{
    if (want == POLICY_EVICT)
        return 0;
    if (want == POLICY_SKETCH)
        return stored != POLICY_SKETCH;
    return stored == POLICY_SKETCH || (want == POLICY_FULL && stored == POLICY_INT8);
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
 * gives one, then the rest: revivals first, then insertions. */
static int list_moves(seq *s, seq_list *ly, uint32_t layer, tier_token *tok, const uint32_t *pos,
                      const uint8_t *tier, uint32_t n)
{
    size_t norder;
    const uint32_t *order = policy_host_tier_order(s->host, layer, &norder);
    for (size_t j = 0; j < norder; j++)
        if (order[j] < n && apply_move(s, ly, layer, tok, pos, tier, order[j]) != 0)
            return -1;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < n; i++)
            if ((tier[i] == POLICY_SKETCH) == pass &&
                apply_move(s, ly, layer, tok, pos, tier, i) != 0)
                return -1;
    return 0;
}

/* Quantise tokens idx[0..m) of tok (FULL, or INT8 read back dequantised)
 * into fresh INT8 blocks, an INT8 block's worth to a block and the last
 * one partial; the caller checked that the pool has them. The tokens become
 * INT8 tokens of the new blocks; the round trip's error is observed. */
static int quantize_fresh(seq *s, tier_token *tok, const uint32_t *idx, size_t m)
{
    uint32_t t8 = s->tier.l8.block_tokens;
    size_t nq = (m + t8 - 1) / t8;
    uint32_t *qb = malloc((nq ? nq : 1) * sizeof *qb);
    uint8_t *k, *v;
    if (qb == NULL || stage_tokens(s, tok, idx, m, &k, &v) != 0) {
        free(qb);
        return -1;
    }
    for (size_t b = 0; b < nq; b++)
        pool_alloc_block(s->pool, &qb[b]); /* checked by the caller */
    int rc = tier_quantize(&s->tier, k, v, m, qb, nq);
    for (size_t j = 0; rc == 0 && j < m; j++)
        tok[idx[j]] = (tier_token){qb[j / t8], (uint32_t)(j % t8), POLICY_INT8};
    for (size_t b = 0; rc != 0 && b < nq; b++)
        pool_free_block(s->pool, qb[b]);
    double ratio;
    if (rc == 0 && stage_error(s, tok, idx, m, k, v, &ratio) == 0)
        snapshot_tiers_observe(&s->report, SNAPSHOT_OBS_INT8, ratio);
    tier_stage_free(&s->tier, k);
    free(qb);
    return rc;
}

/* INT8 demotion in whole INT8 blocks (POLICIES.md §5.4: a block's scales
 * cover all its tokens and it is written once): the oldest tokens decided
 * INT8 but stored at full precision, as many blocks' worth as there are;
 * with `partial`, all of them, the last INT8 block written partial (its
 * free slots are never filled: an operator's demote wants them now). */
static int list_demote(seq *s, tier_token *tok, const uint8_t *tier, uint32_t n, uint32_t *scratch,
                       int partial)
{
    uint32_t t8 = s->tier.l8.block_tokens;
    size_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] == POLICY_INT8 && tok[i].tier == POLICY_FULL)
            scratch[m++] = i;
    size_t nq = partial ? (m + t8 - 1) / t8 : m / t8;
    if (nq == 0 || nq > s->pool->nfree)
        return 0;
    if (!partial)
        m = nq * t8;
    if (quantize_fresh(s, tok, scratch, m) != 0)
        return -1;
    seq_moved(s, 0, m);
    return 0;
}

/*
 * POLICIES.md §5.4 "on compaction: dequantise survivors, gather, re-block,
 * re-quantise": when the INT8 tokens that stay (tier[i] INT8, stored INT8)
 * spread over more than one INT8 block beyond what they fill, re-quantise
 * them into fresh INT8 blocks with new scales, so that evicting INT8
 * tokens gives memory back. Each re-quantisation adds up to half a new
 * scale of error, hence the slack block: it runs at most once per INT8
 * block's worth of evictions, not at every eviction. It runs before this
 * step's demotion, so a token is quantised at most once a step. Skipped,
 * harmlessly, when the pool lacks the blocks. scratch has room for 2n.
 */
static int list_requantize(seq *s, tier_token *tok, const uint8_t *tier, uint32_t n,
                           uint32_t *scratch)
{
    uint32_t t8 = s->tier.l8.block_tokens, *blocks = scratch + n;
    size_t m = 0;
    /* victims=int8 keeps evicted INT8 tokens in their blocks: re-quantising
     * the others would free nothing. */
    if (policy_host_storage(s->host)->victims == POLICY_VICTIMS_INT8)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] == POLICY_INT8 && tok[i].tier == POLICY_INT8) {
            blocks[m] = tok[i].block;
            scratch[m++] = i;
        }
    size_t need = (m + t8 - 1) / t8, have = sort_unique(blocks, m);
    if (have <= need + 1 || need > s->pool->nfree)
        return 0;
    if (quantize_fresh(s, tok, scratch, m) != 0)
        return -1;
    s->requantized += m;
    s->report.requantized += m;
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
    if (nq == 0 || nq > s->pool->nfree ||
        grow((void **)&ly->victim_blocks, &ly->victim_blocks_cap, ly->nvictim_blocks + nq,
             sizeof *ly->victim_blocks) != 0)
        return 0;
    if (quantize_fresh(s, ly->offloaded_at, scratch, nq * t8) != 0)
        return -1;
    for (size_t b = 0; b < nq; b++)
        ly->victim_blocks[ly->nvictim_blocks++] = ly->offloaded_at[scratch[b * t8]].block;
    seq_moved(s, 0, nq * t8);
    return 0;
}

/* Free the oldest victim block of each list (memory pressure, seq_append):
 * its victims are gone for good. Returns the blocks freed. */
static uint32_t seq_drop_victim_blocks(seq *s)
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
        pool_free_block(s->pool, b);
        freed++;
    }
    return freed;
}

/* WeightedKV merges of layer l, before the merged-away tokens leave the
 * table. The merge runs at full precision: an INT8 block is written once,
 * so an INT8 token in a merge is first brought back to a fresh full slot
 * (dequantised; a kept one is demoted again with the next INT8 block). A
 * merge is skipped when the pool has no slot for that, or a token is in the
 * sketch (weightedkv keeps none there). */
static int apply_merges(seq *s, uint32_t l, const policy_decision *d, tier_token *const *toks)
{
    for (size_t m = 0; m < d->nmerges; m++) {
        const policy_merge *g = &d->merges[m];
        tier_token *tok = toks[g->head];
        seq_list *ly = &s->lists[(size_t)l * s->heads + g->head];
        const uint32_t *pos;
        seq_list_tokens(s, l, g->head, &pos);
        if ((tok[g->from].tier == POLICY_INT8 && move_to_full(s, ly, tok, pos, g->from) != 0) ||
            (tok[g->into].tier == POLICY_INT8 && move_to_full(s, ly, tok, pos, g->into) != 0))
            return -1;
        const tier_token *from = &tok[g->from], *into = &tok[g->into];
        if (from->tier != POLICY_FULL || into->tier != POLICY_FULL)
            continue;
        kv_merge one = {from->block, from->slot, into->block, into->slot, g->w_from, g->w_into};
        if (s->tier.ops->merge_values(&s->list_layout, s->tier.dtype, s->pool->base, &one, 1) != 0)
            return -1;
    }
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
    if (delta == NULL || sg == NULL) {
        free(delta);
        free(sg);
        return -1;
    }
    uint32_t j = 0, m = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tier[i] == POLICY_EVICT)
            continue;
        if (tok[i].tier == POLICY_FULL && j != i) {
            delta[m] = (int32_t)j - (int32_t)i;
            sg[m++] = (kv_segment){tok[i].block, tok[i].slot, 1};
        }
        j++;
    }
    int rc =
        s->tier.ops->rope_rerotate(&s->list_layout, s->tier.dtype, s->pool->base, sg, m, delta,
                                   d->rope_theta > 0 ? d->rope_theta : s->pool->geom.rope_theta,
                                   d->rope_pairing ? KV_ROPE_INTERLEAVED : KV_ROPE_HALF);
    free(delta);
    free(sg);
    return rc;
}

/*
 * Conf-KV's contiguous compaction, for any token-level eviction: when the
 * full-precision survivors are spread over more than one block beyond what
 * they fill, copy them into fresh blocks (kv_copy_tokens), so that evicting
 * tokens really gives memory back; the old blocks are retired by the
 * caller. Skipped, harmlessly, when the pool lacks the blocks.
 */
static int list_compact(seq *s, seq_list *ly, tier_token *kept, uint32_t n, uint32_t *scratch)
{
    uint32_t slots = s->block_slots, nfull = 0;
    for (uint32_t i = 0; i < n; i++)
        if (kept[i].tier == POLICY_FULL)
            scratch[nfull++] = kept[i].block;
    uint32_t need = (nfull + slots - 1) / slots;
    qsort(scratch, nfull, sizeof *scratch, cmp_u32);
    uint32_t have = 0;
    for (uint32_t i = 0; i < nfull; i++)
        have += i == 0 || scratch[i] != scratch[i - 1];
    if (have <= need + 1 || need > s->pool->nfree || need == 0)
        return 0;
    kv_segment *src = malloc(nfull * sizeof *src), *dst = malloc(nfull * sizeof *dst);
    if (src == NULL || dst == NULL) {
        free(src);
        free(dst);
        return -1;
    }
    uint32_t blk = 0;
    for (uint32_t i = 0, j = 0; i < n; i++) {
        if (kept[i].tier != POLICY_FULL)
            continue;
        if (j % slots == 0)
            pool_alloc_block(s->pool, &blk); /* checked above */
        src[j] = (kv_segment){kept[i].block, kept[i].slot, 1};
        dst[j] = (kv_segment){blk, j % slots, 1};
        j++;
    }
    if (s->tier.ops->copy_tokens(&s->list_layout, s->pool->base, src, nfull, dst, nfull) != 0) {
        for (uint32_t j = 0; j < nfull; j += slots) /* the list stays where it was */
            pool_free_block(s->pool, dst[j].block);
        free(src);
        free(dst);
        return -1;
    }
    for (uint32_t i = 0, j = 0; i < n; i++)
        if (kept[i].tier == POLICY_FULL) {
            kept[i] = (tier_token){dst[j].block, dst[j].first_slot, POLICY_FULL};
            j++;
        }
    ly->tail_block = blk;
    ly->tail_next_slot = (nfull - 1) % slots + 1;
    ly->has_tail = 1;
    free(src);
    free(dst);
    return 0;
}

/* Retire the blocks of `before` (sorted) that `after` (sorted) lacks. */
static int retire_unused(seq *s, seq_list *ly, const uint32_t *before, size_t nb,
                         const uint32_t *after, size_t na, uint64_t epoch)
{
    size_t j = 0;
    for (size_t i = 0; i < nb; i++) {
        while (j < na && after[j] < before[i])
            j++;
        if (j < na && after[j] == before[i])
            continue;
        if (seq_retire(s, before[i], epoch) != 0)
            return -1;
        if (ly->has_tail && ly->tail_block == before[i])
            ly->has_tail = 0;
    }
    return 0;
}

/* Room for the segments of a list of n tokens and for `blocks` more retired
 * blocks, made before a demotion or compaction takes blocks: failing in
 * list_encode or retire_unused after those would leave blocks that no
 * segment holds and segments unlike the host's list (test_faults). */
static int list_reserve_apply(seq *s, seq_list *ly, uint32_t n, size_t blocks)
{
    if (list_reserve(ly, n ? n : 1) != 0)
        return -1;
    return grow((void **)&s->retired, &s->retired_cap, s->nretired + blocks, sizeof *s->retired);
}

/* Whether the decision changes anything in this list's storage. */
static int list_untouched(const seq *s, const tier_token *tok, const uint8_t *tier, uint32_t n)
{
    uint32_t pending = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tier[i] == POLICY_EVICT || needs_move(tok[i].tier, tier[i]))
            return 0;
        pending += tier[i] == POLICY_INT8 && tok[i].tier == POLICY_FULL;
    }
    return pending < s->tier.l8.block_tokens;
}

/* Apply one list's decided tiers to its storage (seq_apply_decision). */
static int list_apply(seq *s, uint32_t l, uint32_t k, tier_token *tok, const policy_decision *d,
                      uint64_t epoch, int *changed)
{
    seq_list *ly = &s->lists[(size_t)l * s->heads + k];
    const uint32_t *pos;
    uint32_t n = seq_list_tokens(s, l, k, &pos);
    const uint8_t *tier = d->tier[k];
    if (list_untouched(s, tok, tier, n))
        return 0;
    *changed = 1;
    /* Blocks used before (at most n + noffloaded + 1 with the tail, three
     * times: see below), after, and an index list (2n, or noffloaded);
     * victims add at most n offloaded entries. */
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
    nb = sort_unique(before, nb);
    /* Retired at the end: blocks before and those taken on the way, at
     * most one per slot moved back to full precision (n / block_slots + 1)
     * and per INT8 block the victims, re-quantisation and demotion write
     * ((noffloaded + n) / t8 + 2n / t8 + 3). */
    uint32_t t8 = s->tier.l8.block_tokens;
    int rc = list_reserve_apply(
        s, ly, n, nb + n / s->block_slots + (ly->noffloaded + 3 * (size_t)n) / t8 + 4);
    if (rc == 0)
        rc = list_victims(s, ly, l, tok, pos, tier, n, idx);
    if (rc == 0)
        rc = list_victims_quantize(s, ly, idx);
    if (rc == 0)
        rc = list_moves(s, ly, l, tok, pos, tier, n);
    if (rc == 0)
        rc = list_requantize(s, tok, tier, n, idx);
    /* Blocks the victims, moves and re-quantisation took (INT8 blocks,
     * tails for revived tokens) count as used before the demotion, which
     * may empty them again. */
    nb = sort_unique(before, nb + list_block_set(ly, tok, n, 1, before + nb));
    if (rc == 0)
        rc = list_demote(s, tok, tier, n, idx, 0);
    if (rc == 0 && d->rerotate_keys)
        rc = list_rerotate(s, tok, tier, n, d);
    uint32_t kept = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] != POLICY_EVICT)
            tok[kept++] = tok[i];
    /* Blocks the moves and the demotion took count as used before
     * compaction, which may leave them. */
    nb = sort_unique(before, nb + list_block_set(ly, tok, kept, 1, before + nb));
    if (rc == 0)
        rc = list_compact(s, ly, tok, kept, idx);
    if (rc == 0)
        rc = list_encode(ly, tok, kept);
    if (rc == 0)
        rc =
            retire_unused(s, ly, before, nb, after, list_block_set(ly, tok, kept, 0, after), epoch);
    free(scratch);
    return rc;
}

status_code seq_apply_decision(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                               size_t *evicted, int *changed, status *st)
{
    tier_token **toks = calloc(s->heads, sizeof *toks);
    int rc = toks == NULL ? -1 : 0;
    for (uint32_t k = 0; rc == 0 && k < s->heads; k++) {
        toks[k] = list_expand(&s->lists[(size_t)l * s->heads + k], seq_list_tokens(s, l, k, NULL));
        rc = toks[k] == NULL ? -1 : 0;
    }
    if (rc == 0)
        rc = apply_merges(s, l, d, toks);
    *changed |= d->nmerges > 0;
    for (uint32_t k = 0; rc == 0 && k < s->heads; k++)
        rc = list_apply(s, l, k, toks[k], d, epoch, changed);
    for (uint32_t k = 0; toks != NULL && k < s->heads; k++)
        free(toks[k]);
    free(toks);
    if (rc != 0)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
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
    seq_list *ly = &s->lists[(size_t)l * s->heads + k];
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
    size_t nb = list_block_set(ly, tok, n, 1, before);
    uint64_t moved = s->moved[0];
    int rc = list_reserve_apply(s, ly, n, nb);
    if (rc == 0)
        rc = list_demote(s, tok, tier, n, idx, 1);
    if (rc == 0 && s->moved[0] != moved) {
        *changed = 1;
        rc = list_encode(ly, tok, n);
        if (rc == 0)
            rc = retire_unused(s, ly, before, nb, after, list_block_set(ly, tok, n, 0, after),
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

/* ---- storage reports and revive ------------------------------------------ */

void seq_list_tier_tokens(const seq *s, uint32_t layer, uint32_t head, uint32_t tokens[3])
{
    const seq_list *ly = &s->lists[(size_t)layer * s->heads + head];
    tokens[0] = tokens[1] = tokens[2] = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        tokens[ly->seg_tier[i]] += ly->segs[i].count;
}

void seq_tier_usage(const seq *s, uint64_t tokens[3], uint64_t bytes[3])
{
    for (int t = 0; t < 3; t++)
        tokens[t] = bytes[t] = 0;
    for (size_t k = 0; k < seq_nlists(s); k++) {
        const seq_list *ly = &s->lists[k];
        for (size_t i = 0; i < ly->nsegs; i++)
            tokens[ly->seg_tier[i]] += ly->segs[i].count;
        for (int t = POLICY_FULL; t <= POLICY_INT8; t++)
            bytes[t] += (uint64_t)list_count_blocks(ly, t) * s->pool->block_bytes;
        for (size_t j = 0; j < ly->noffloaded; j++)
            tokens[ly->offloaded_at[j].tier]++;
        bytes[POLICY_SKETCH] += tier_sketch_bytes(&ly->sketch);
    }
}

/* ---- steps -------------------------------------------------------------- */

/* The step layout of s's lists (proto/kvstash_step.h) and each list's
 * tokens now, malloc'd [nlayers * heads]; NULL when out of memory. */
static uint32_t *step_tokens(seq *s, unsigned arrays, step_shape *sh)
{
    *sh = (step_shape){s->nlayers, s->pool->geom.q_heads, s->pool->geom.kv_heads, s->heads,
                       arrays & STEP_ARRAYS};
    size_t n = (size_t)s->nlayers * s->heads;
    uint32_t *tokens = malloc((n ? n : 1) * sizeof *tokens);
    for (size_t i = 0; tokens != NULL && i < n; i++)
        tokens[i] = seq_list_tokens(s, (uint32_t)(i / s->heads), (uint32_t)(i % s->heads), NULL);
    return tokens;
}

size_t seq_step_floats(seq *s, unsigned arrays)
{
    step_shape sh;
    uint32_t *tokens = step_tokens(s, arrays, &sh);
    size_t n = tokens != NULL ? step_floats(&sh, tokens) : (size_t)-1;
    free(tokens);
    return n;
}

/* Run the policy on every layer and apply its decisions. The input was
 * checked: a failure here is a policy bug. */
static status_code seq_run_policy(seq *s, const seq_step_input *in, uint64_t epoch,
                                  uint32_t *evicted, status *st)
{
    /* Every row of the step, parsed once (proto/kvstash_step.h); the sizes
     * were checked (seq_step_check). */
    step_shape sh;
    uint32_t *tokens = step_tokens(s, in->arrays, &sh);
    const float **rows = calloc((size_t)s->nlayers * step_layer_slots(&sh) + 1, sizeof *rows);
    status_code rc = tokens == NULL || rows == NULL
                         ? status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory")
                     : step_parse(&sh, tokens, in->data, in->nfloats, rows) != 0
                         ? status_set(st, ST_INTERNAL, "step statistics do not match the lists")
                         : ST_OK;
    if (rc != ST_OK) {
        free(tokens);
        free(rows);
        return rc;
    }
    size_t total = 0;
    int changed = 0;
    int data = in->data != NULL;
    for (uint32_t l = 0; l < s->nlayers && rc == ST_OK; l++) {
        policy_stats ps = {.new_tokens = in->new_tokens ? in->new_tokens : s->unstepped,
                           .prefill = in->prefill,
                           .score_queries = in->score_queries,
                           .window_queries = in->window_queries,
                           .confidence = in->confidence};
        if (data && (sh.arrays & STEP_SCORE)) /* one list only: checked by seq_step_check */
            ps.score = rows[step_slot(&sh, l, STEP_SCORE, 0)];
        if (data && (sh.arrays & STEP_LAST_ATTN))
            ps.last_attn = &rows[step_slot(&sh, l, STEP_LAST_ATTN, 0)];
        if (data && (sh.arrays & STEP_WINDOW_ATTN))
            ps.window_attn = &rows[step_slot(&sh, l, STEP_WINDOW_ATTN, 0)];
        if (data && (sh.arrays & STEP_VNORM))
            ps.vnorm = &rows[step_slot(&sh, l, STEP_VNORM, 0)];
        const policy_decision *d;
        char err[POLICY_ERR_LEN];
        errno = 0; /* ENOMEM after a failure: out of memory (malloc sets it), not a bug */
        if (policy_host_step(s->host, l, &ps, &d, err, sizeof err) != 0)
            rc = status_set(st, errno == ENOMEM ? ST_RESOURCE_EXHAUSTED : ST_INTERNAL,
                            "policy %s failed: %s", s->policy->name, err);
        else
            rc = seq_apply_decision(s, l, d, epoch, &total, &changed, st);
    }
    free(tokens);
    free(rows);
    if (rc == ST_OK) /* a step that failed has not seen them (test_faults) */
        s->unstepped = 0;
    if (total > 0 || changed)
        s->epoch = epoch;
    *evicted = (uint32_t)total;
    return rc;
}

/* On the gRPC path a step ends when the next Append begins, for policies
 * that need nothing from the worker (full, streaming). */
static status_code seq_step_silent(seq *s, uint64_t epoch, uint32_t *evicted, status *st)
{
    *evicted = 0;
    if (s->unstepped == 0 || s->policy->needs != 0)
        return ST_OK;
    seq_step_input in = {.confidence = -1.0};
    return seq_run_policy(s, &in, epoch, evicted, st);
}

static const char *needs_name(unsigned bit)
{
    switch (bit) {
    case POLICY_NEEDS_SCORE:
        return "score";
    case POLICY_NEEDS_LAST_ATTN:
        return "last_attn";
    case POLICY_NEEDS_WINDOW_ATTN:
        return "window_attn";
    case POLICY_NEEDS_VNORM:
        return "vnorm";
    default:
        return "confidence";
    }
}

static status_code seq_step_check(seq *s, const seq_step_input *in, status *st)
{
    if ((in->arrays & POLICY_NEEDS_SCORE) && s->heads != 1)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "policy %s keeps one list per KV head: report last_attn or "
                          "window_attn per query head, not a summed score",
                          s->policy->name);
    unsigned missing = s->policy->needs & ~in->arrays;
    /* Confidence describes a next token: prefill steps have none (Conf-KV
     * §5.3 keeps everything until the first decode step). */
    if (missing & POLICY_NEEDS_CONFIDENCE && (in->confidence >= 0 || in->prefill))
        missing &= ~(unsigned)POLICY_NEEDS_CONFIDENCE;
    for (unsigned bit = 1; missing != 0; bit <<= 1)
        if (missing & bit)
            return status_set(st, ST_FAILED_PRECONDITION,
                              "policy %s needs '%s' in every step; this step has none",
                              s->policy->name, needs_name(bit));
    if (in->confidence > 1.0 || in->confidence != in->confidence)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "confidence must be in [0, 1] (or < 0 for "
                          "none), got %g",
                          in->confidence);
    if (in->new_tokens > s->unstepped)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "new_tokens is %u but only %u tokens were appended since the last step",
                          in->new_tokens, s->unstepped);
    size_t want = seq_step_floats(s, in->arrays);
    if (want == (size_t)-1)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (in->nfloats != want)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "step statistics hold %zu floats; the layers' token lists need %zu "
                          "(is the worker's table stale? epoch is %llu)",
                          in->nfloats, want, (unsigned long long)s->epoch);
    for (size_t i = 0; i < in->nfloats; i++)
        if (!isfinite(in->data[i]))
            return status_set(st, ST_INVALID_ARGUMENT,
                              "step statistics hold a non-finite value at float %zu", i);
    return ST_OK;
}

status_code seq_step(seq *s, const seq_step_input *in, uint32_t *evicted, status *st)
{
    *evicted = 0;
    if (seq_step_check(s, in, st) != ST_OK)
        return st->code;
    return seq_run_policy(s, in, s->epoch + 1, evicted, st);
}

/* ---- append ------------------------------------------------------------ */

static uint32_t blocks_needed(uint32_t count, uint32_t room, uint32_t block_tokens)
{
    return count <= room ? 0 : (count - room + block_tokens - 1) / block_tokens;
}

static void list_push(seq_list *ly, uint32_t block, uint32_t slot, uint32_t n)
{
    kv_segment *last = ly->nsegs ? &ly->segs[ly->nsegs - 1] : NULL;
    if (last != NULL && ly->seg_tier[ly->nsegs - 1] == POLICY_FULL && last->block == block &&
        last->first_slot + last->count == slot) {
        last->count += n;
    } else {
        ly->seg_tier[ly->nsegs] = POLICY_FULL;
        ly->segs[ly->nsegs++] = (kv_segment){block, slot, n};
    }
}

/* Put `count` new tokens at the list's tail; blocks were checked free. */
static size_t list_grow(seq *s, seq_list *ly, uint32_t count, kv_segment *writes)
{
    uint32_t bt = s->block_slots;
    size_t nw = 0;
    while (count > 0) {
        if (!tail_usable(ly, bt)) {
            pool_alloc_block(s->pool, &ly->tail_block); /* checked by the caller */
            ly->tail_next_slot = 0;
            ly->has_tail = 1;
        }
        uint32_t n = bt - ly->tail_next_slot;
        if (n > count)
            n = count;
        list_push(ly, ly->tail_block, ly->tail_next_slot, n);
        writes[nw++] = (kv_segment){ly->tail_block, ly->tail_next_slot, n};
        ly->tail_next_slot += n;
        count -= n;
    }
    return nw;
}

static uint64_t seq_blocks_needed(const seq *s, uint32_t count)
{
    uint32_t bt = s->block_slots;
    uint64_t need = 0;
    for (size_t i = 0; i < seq_nlists(s); i++) {
        const seq_list *ly = &s->lists[i];
        uint32_t room = tail_usable(ly, bt) ? bt - ly->tail_next_slot : 0;
        need += blocks_needed(count, room, bt);
    }
    return need;
}

status_code seq_append(seq *s, int64_t count, kv_segment *const *writes, size_t *nwrites,
                       uint32_t *evicted, status *st)
{
    if (count < 1 || count > SEQ_MAX_APPEND)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "count must be between 1 and %d tokens per append, got %lld",
                          SEQ_MAX_APPEND, (long long)count);
    if (s->appended + (uint64_t)count > UINT32_MAX)
        return status_set(st, ST_INVALID_ARGUMENT, "sequence %llu would exceed 2^32-1 positions",
                          (unsigned long long)s->id);
    /* One Append is one new epoch, whatever it changed. */
    uint64_t epoch = s->epoch + 1;
    if (seq_step_silent(s, epoch, evicted, st) != ST_OK)
        return st->code;
    uint64_t need = seq_blocks_needed(s, (uint32_t)count);
    /* Memory pressure costs kept victims before it refuses tokens, but only
     * when that makes room: a refused append changes nothing. */
    uint64_t droppable = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        droppable += s->lists[i].nvictim_blocks;
    while (need > s->pool->nfree && need <= s->pool->nfree + droppable &&
           seq_drop_victim_blocks(s) > 0)
        ;
    if (need > s->pool->nfree)
        return status_set(st, ST_RESOURCE_EXHAUSTED,
                          "appending %lld tokens needs %llu free blocks; pool '%s' has %u of %u "
                          "free (release sequences or start kvstashd with a larger --pool-mb)",
                          (long long)count, (unsigned long long)need, s->pool->model,
                          s->pool->nfree, s->pool->block_count);
    for (size_t i = 0; i < seq_nlists(s); i++)
        if (list_reserve(&s->lists[i], s->lists[i].nsegs + (size_t)count / s->block_slots + 2) != 0)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (policy_host_append(s->host, (uint32_t)count) != 0)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < seq_nlists(s); i++)
        nwrites[i] = list_grow(s, &s->lists[i], (uint32_t)count, writes[i]);
    s->appended += (uint64_t)count;
    s->unstepped += (uint32_t)count;
    s->epoch = epoch;
    return ST_OK;
}

/* ---- revive ------------------------------------------------------------- */

/* Positions [first, end) that are neither held nor offloaded: the first
 * such run in *gap_first / *gap_count, and how many in all. */
static uint32_t revive_gaps(const uint32_t *pos, uint32_t n, const uint32_t *off, size_t noff,
                            uint32_t first, uint32_t end, uint32_t *gap_first, uint32_t *gap_count)
{
    uint32_t i = 0, missing = 0;
    size_t j = 0;
    *gap_count = 0;
    for (uint32_t p = first; p < end; p++) {
        while (i < n && pos[i] < p)
            i++;
        while (j < noff && off[j] < p)
            j++;
        if ((i < n && pos[i] == p) || (j < noff && off[j] == p))
            continue;
        if (missing++ == 0)
            *gap_first = p;
        if (*gap_count == p - *gap_first)
            (*gap_count)++;
    }
    return missing;
}

/* The revived tokens in position order: where each is stored (held, or an
 * offloaded victim) and its position. */
static size_t revive_select(const seq_list *ly, const uint32_t *pos, const tier_token *tok,
                            uint32_t n, uint32_t first, uint32_t end, tier_token *src, uint32_t *at)
{
    size_t m = 0, j = 0, noff = ly->noffloaded;
    uint32_t i = 0;
    while (i < n || j < noff) {
        int held = j == noff || (i < n && pos[i] < ly->offloaded[j]);
        uint32_t p = held ? pos[i] : ly->offloaded[j];
        if (p >= first && p < end) {
            src[m] = held ? tok[i] : ly->offloaded_at[j];
            at[m++] = p;
        }
        held ? i++ : j++;
    }
    return m;
}

/* Write the revived tokens into dst: FULL / INT8 tokens read back, sketch
 * tokens queried. */
static int revive_fill(seq *s, seq_list *ly, const tier_token *src, const uint32_t *at, size_t m,
                       const tier_token *dst)
{
    for (size_t a = 0; a < m;) {
        int sketch = src[a].tier == POLICY_SKETCH;
        size_t b = a;
        while (b < m && (src[b].tier == POLICY_SKETCH) == sketch)
            b++;
        if (sketch) {
            if (tier_sketch_read(&ly->sketch, &s->tier, s->pool->base, at + a, b - a, dst + a, 0))
                return -1;
        } else if (tier_copy(&s->tier, src + a, b - a, dst + a) != 0) {
            return -1;
        }
        a = b;
    }
    return 0;
}

status_code seq_revive(seq *s, uint32_t layer, uint32_t head, uint32_t first, uint32_t count,
                       int skip_evicted, kv_segment **segs, size_t *nsegs, uint32_t **pos,
                       uint8_t **src_tier, size_t *ntokens, uint32_t **blocks, size_t *nblocks,
                       status *st)
{
    *segs = NULL, *pos = NULL, *src_tier = NULL, *blocks = NULL;
    *nsegs = *ntokens = *nblocks = 0;
    if (layer >= s->nlayers || head >= s->heads)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "list (layer %u, head %u) does not exist: the sequence has %u layers "
                          "and %u list(s) per layer",
                          layer, head, s->nlayers, s->heads);
    uint64_t end = count == 0 ? s->appended : (uint64_t)first + count;
    if (end > s->appended || first >= end)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "positions %u..%llu are not in the sequence (positions 0..%llu exist)",
                          first, (unsigned long long)end - 1, (unsigned long long)s->appended - 1);
    seq_list *ly = &s->lists[(size_t)layer * s->heads + head];
    const uint32_t *lpos;
    uint32_t n = seq_list_tokens(s, layer, head, &lpos), gap_first = 0, gap_count;
    uint32_t missing = revive_gaps(lpos, n, ly->offloaded, ly->noffloaded, first, (uint32_t)end,
                                   &gap_first, &gap_count);
    if (missing > 0 && !skip_evicted)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "%u of positions %u..%llu of layer %u were evicted outright, not "
                          "offloaded (first: %u..%u); nothing can revive them (create the "
                          "sequence with victims=sketch or victims=int8 to keep evicted "
                          "tokens, or ask with skip_evicted)",
                          missing, first, (unsigned long long)end - 1, layer, gap_first,
                          gap_first + gap_count - 1);
    size_t m = (size_t)(end - first) - missing;
    uint32_t slots = s->block_slots, need = (uint32_t)((m + slots - 1) / slots);
    if (need > s->pool->nfree)
        return status_set(st, ST_RESOURCE_EXHAUSTED,
                          "reviving %zu tokens needs %u free blocks; pool '%s' has %u", m, need,
                          s->pool->model, s->pool->nfree);
    tier_token *tok = list_expand(ly, n), *dst = malloc((m ? m : 1) * sizeof *dst);
    tier_token *src = malloc((m ? m : 1) * sizeof *src);
    *pos = malloc((m ? m : 1) * sizeof **pos);
    *src_tier = malloc(m ? m : 1);
    *blocks = malloc((need ? need : 1) * sizeof **blocks);
    *segs = malloc((need ? need : 1) * sizeof **segs);
    int rc = tok && dst && src && *pos && *src_tier && *blocks && *segs ? 0 : -1;
    uint32_t got = 0;
    if (rc == 0) {
        revive_select(ly, lpos, tok, n, first, (uint32_t)end, src, *pos);
        for (uint32_t b = 0; b < need; b++, got++) {
            pool_alloc_block(s->pool, &(*blocks)[b]); /* checked above */
            (*segs)[b] = (kv_segment){(*blocks)[b], 0,
                                      b + 1 < need ? slots : (uint32_t)(m - (size_t)b * slots)};
        }
        for (size_t j = 0; j < m; j++) {
            dst[j] = (tier_token){(*blocks)[j / slots], (uint32_t)(j % slots), POLICY_FULL};
            (*src_tier)[j] = src[j].tier;
        }
        rc = revive_fill(s, ly, src, *pos, m, dst);
    }
    free(tok);
    free(dst);
    free(src);
    if (rc != 0) {
        for (uint32_t b = 0; b < got; b++)
            pool_free_block(s->pool, (*blocks)[b]);
        free(*segs), free(*pos), free(*src_tier), free(*blocks);
        *segs = NULL, *pos = NULL, *src_tier = NULL, *blocks = NULL;
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    *nsegs = *nblocks = need;
    *ntokens = m;
    return ST_OK;
}
