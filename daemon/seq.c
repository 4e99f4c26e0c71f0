#include "seq.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    s->lists = calloc((size_t)s->nlayers * s->heads, sizeof *s->lists);
    if (s->lists == NULL) {
        free(s);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    const pool_geometry *pg = &pool->geom;
    policy_geometry g = {pg->layers,   pg->q_heads,      pg->kv_heads,
                         pg->head_dim, pg->block_tokens, pg->rope_theta};
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_create(policy, &s->params, &g, &s->host, err, sizeof err) != 0) {
        status_set(st, ST_INVALID_ARGUMENT, "policy %s: %s", policy->name, err);
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

static void list_free_blocks(seq_list *ly, pool *p)
{
    /* A block's segments are adjacent in the list (tokens arrive in order). */
    for (size_t i = 0; i < ly->nsegs; i++)
        if (i == 0 || ly->segs[i].block != ly->segs[i - 1].block)
            pool_free_block(p, ly->segs[i].block);
    /* A tail block whose every token was evicted is retired, not in segs. */
}

void seq_destroy(seq *s)
{
    if (s == NULL)
        return;
    for (size_t i = 0; i < seq_nlists(s); i++) {
        list_free_blocks(&s->lists[i], s->pool);
        free(s->lists[i].segs);
    }
    for (size_t i = 0; i < s->nretired; i++)
        pool_free_block(s->pool, s->retired[i].block);
    policy_host_destroy(s->host);
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
    for (size_t k = 0; k < seq_nlists(s); k++) {
        const seq_list *ly = &s->lists[k];
        for (size_t i = 0; i < ly->nsegs; i++)
            if (i == 0 || ly->segs[i].block != ly->segs[i - 1].block)
                n++;
    }
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
    return grow((void **)&ly->segs, &ly->segs_cap, nsegs, sizeof *ly->segs);
}

static int seq_retire(seq *s, uint32_t block, uint64_t epoch)
{
    if (grow((void **)&s->retired, &s->retired_cap, s->nretired + 1, sizeof *s->retired) != 0)
        return -1;
    s->retired[s->nretired++] = (seq_retired){block, epoch};
    return 0;
}

/* ---- eviction ----------------------------------------------------------- */

/* Drop the tokens whose decided tier is POLICY_EVICT from the segments, in
 * place (a split segment needs room, reserved by the caller), and retire the
 * blocks left with no token. */
static int list_evict(seq *s, seq_list *ly, const uint8_t *tier, uint64_t epoch)
{
    size_t nsegs = ly->nsegs;
    kv_segment *old = malloc((nsegs ? nsegs : 1) * sizeof *old);
    if (old == NULL)
        return -1;
    memcpy(old, ly->segs, nsegs * sizeof *old);
    size_t out = 0, t = 0;
    int block_has_kept = 0;
    for (size_t i = 0; i < nsegs; i++) {
        const kv_segment *sg = &old[i];
        int run_open = 0;
        for (uint32_t j = 0; j < sg->count; j++, t++) {
            if (tier[t] == POLICY_EVICT) {
                run_open = 0;
                continue;
            }
            block_has_kept = 1;
            if (run_open)
                ly->segs[out - 1].count++;
            else
                ly->segs[out++] = (kv_segment){sg->block, sg->first_slot + j, 1};
            run_open = 1;
        }
        if (i + 1 < nsegs && old[i + 1].block == sg->block)
            continue; /* the block goes on in the next segment */
        if (!block_has_kept) {
            if (seq_retire(s, sg->block, epoch) != 0) {
                free(old);
                return -1;
            }
            if (ly->has_tail && ly->tail_block == sg->block)
                ly->has_tail = 0;
        }
        block_has_kept = 0;
    }
    ly->nsegs = out;
    free(old);
    return 0;
}

/* Segments after the eviction: at most one per kept run, plus the old ones. */
static size_t evicted_seg_bound(const seq_list *ly, const uint8_t *tier, uint32_t n)
{
    size_t runs = 0;
    for (uint32_t t = 0; t < n; t++)
        if (tier[t] != POLICY_EVICT && (t == 0 || tier[t - 1] == POLICY_EVICT))
            runs++;
    return runs + ly->nsegs;
}

/* The (block, slot) of token i of a list. */
static kv_segment list_token(const seq_list *ly, uint32_t i)
{
    size_t k = 0;
    while (i >= ly->segs[k].count)
        i -= ly->segs[k++].count;
    return (kv_segment){ly->segs[k].block, ly->segs[k].first_slot + i, 1};
}

/* WeightedKV merges, before the merged-away tokens leave the table. */
static void apply_merges(seq *s, uint32_t l, const policy_decision *d)
{
    for (size_t m = 0; m < d->nmerges; m++) {
        const policy_merge *g = &d->merges[m];
        const seq_list *ly = &s->lists[(size_t)l * s->heads + g->head];
        kv_segment from = list_token(ly, g->from), into = list_token(ly, g->into);
        kv_merge_value(&s->list_layout, (kv_dtype)s->pool->geom.dtype, s->pool->base, from.block,
                       from.first_slot, into.block, into.first_slot, g->w_from, g->w_into);
    }
}

/* Distinct blocks a list's segments use (a block's segments are adjacent). */
static uint32_t list_blocks(const seq_list *ly)
{
    uint32_t n = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        n += i == 0 || ly->segs[i].block != ly->segs[i - 1].block;
    return n;
}

/*
 * Conf-KV's contiguous compaction, for any token-level eviction: when the
 * survivors are spread over more than one block beyond what they fill, copy
 * them into fresh blocks (kv_copy_tokens) and retire the old ones, so that
 * evicting tokens really gives memory back. Skipped, harmlessly, when the
 * pool has no free blocks for the copy.
 */
static int list_compact(seq *s, seq_list *ly, uint32_t tokens, uint64_t epoch)
{
    uint32_t slots = s->block_slots, need = (tokens + slots - 1) / slots;
    uint32_t have = list_blocks(ly);
    if (have <= need + 1 || need > s->pool->nfree || need == 0)
        return 0;
    kv_segment *dst = malloc(need * sizeof *dst);
    if (dst == NULL)
        return -1;
    for (uint32_t b = 0; b < need; b++) {
        pool_alloc_block(s->pool, &dst[b].block);
        dst[b].first_slot = 0;
        dst[b].count = b + 1 < need ? slots : tokens - (need - 1) * slots;
    }
    kv_copy_tokens(&s->list_layout, s->pool->base, ly->segs, ly->nsegs, dst, need);
    for (size_t i = 0; i < ly->nsegs; i++)
        if ((i == 0 || ly->segs[i].block != ly->segs[i - 1].block) &&
            seq_retire(s, ly->segs[i].block, epoch) != 0) {
            free(dst);
            return -1;
        }
    if (ly->has_tail && (ly->nsegs == 0 || ly->segs[ly->nsegs - 1].block != ly->tail_block) &&
        seq_retire(s, ly->tail_block, epoch) != 0) {
        free(dst);
        return -1;
    }
    free(ly->segs);
    ly->segs = dst;
    ly->nsegs = ly->segs_cap = need;
    ly->tail_block = dst[need - 1].block;
    ly->tail_next_slot = dst[need - 1].count;
    ly->has_tail = 1;
    return 0;
}

/*
 * OpenVINO §2.8: after an eviction, a kept token that moved from index i to
 * j of its list carries RoPE for a position j - i too far; rotate its key
 * back (kv_rope_rerotate). Runs before compaction, which moves bytes but
 * not indices. The worker is inside its synchronous step, not reading.
 */
static int list_rerotate(seq *s, seq_list *ly, const uint8_t *tier, uint32_t n,
                         const policy_decision *d)
{
    int32_t *delta = malloc((n ? n : 1) * sizeof *delta);
    if (delta == NULL)
        return -1;
    uint32_t j = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tier[i] != POLICY_EVICT) {
            delta[j] = (int32_t)j - (int32_t)i;
            j++;
        }
    kv_rope_rerotate(&s->list_layout, (kv_dtype)s->pool->geom.dtype, s->pool->base, ly->segs,
                     ly->nsegs, delta, d->rope_theta > 0 ? d->rope_theta : s->pool->geom.rope_theta,
                     d->rope_pairing ? KV_ROPE_INTERLEAVED : KV_ROPE_HALF);
    free(delta);
    return 0;
}

/* Apply one layer's decision: merge, evict in the segments, then commit in
 * the host. INT8 and sketch tiers are recorded in the host (the policy sees
 * them) but the tokens stay in full precision until the tiers land. */
status_code seq_apply_decision(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                               size_t *evicted, status *st)
{
    apply_merges(s, l, d);
    for (uint32_t k = 0; k < s->heads; k++) {
        seq_list *ly = &s->lists[(size_t)l * s->heads + k];
        uint32_t n = seq_list_tokens(s, l, k, NULL);
        int any = 0;
        for (uint32_t t = 0; t < n && !any; t++)
            any = d->tier[k][t] == POLICY_EVICT;
        if (!any)
            continue;
        uint32_t kept = 0;
        for (uint32_t t = 0; t < n; t++)
            kept += d->tier[k][t] != POLICY_EVICT;
        if (list_reserve(ly, evicted_seg_bound(ly, d->tier[k], n)) != 0 ||
            list_evict(s, ly, d->tier[k], epoch) != 0 ||
            (d->rerotate_keys && list_rerotate(s, ly, d->tier[k], n, d) != 0) ||
            list_compact(s, ly, kept, epoch) != 0)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    *evicted += policy_host_commit(s->host, l);
    return ST_OK;
}

/* ---- steps -------------------------------------------------------------- */

/* Point one layer's stats at its arrays in `data` (layout: proto/kvstash_ring.h);
 * with data NULL only counts. ptrs has room for 3 * q_heads entries.
 * Returns the floats the layer uses. */
static size_t layer_stats(seq *s, uint32_t l, unsigned arrays, const float *data, policy_stats *ps,
                          const float **ptrs)
{
    uint32_t q = s->pool->geom.q_heads, kv = s->pool->geom.kv_heads, group = q / kv;
    size_t off = 0;
    if (arrays & POLICY_NEEDS_SCORE) { /* one list only: checked by seq_step_check */
        if (data != NULL)
            ps->score = data;
        off += seq_list_tokens(s, l, 0, NULL);
    }
    /* Per query head (last_attn, window_attn), then per KV head (vnorm); query
     * head h reads KV head h / group (POLICIES.md notation). */
    const unsigned kinds[3] = {POLICY_NEEDS_LAST_ATTN, POLICY_NEEDS_WINDOW_ATTN,
                               POLICY_NEEDS_VNORM};
    for (int k = 0; k < 3; k++) {
        if (!(arrays & kinds[k]))
            continue;
        uint32_t rows = k < 2 ? q : kv, per_list = k < 2 ? group : 1;
        const float **base = ptrs + (size_t)k * q;
        for (uint32_t h = 0; h < rows; h++) {
            if (data != NULL)
                base[h] = data + off;
            off += seq_list_tokens(s, l, s->heads == 1 ? 0 : h / per_list, NULL);
        }
        if (data == NULL)
            continue;
        if (k == 0)
            ps->last_attn = base;
        else if (k == 1)
            ps->window_attn = base;
        else
            ps->vnorm = base;
    }
    return off;
}

size_t seq_step_floats(seq *s, unsigned arrays)
{
    size_t total = 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        total += layer_stats(s, l, arrays, NULL, NULL, NULL);
    return total;
}

/* Run the policy on every layer and apply its decisions. The input was
 * checked: a failure here is a policy bug. */
static status_code seq_run_policy(seq *s, const seq_step_input *in, uint64_t epoch,
                                  uint32_t *evicted, status *st)
{
    const float **ptrs = calloc(3 * (size_t)s->pool->geom.q_heads, sizeof *ptrs);
    if (ptrs == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    size_t off = 0, total = 0;
    status_code rc = ST_OK;
    for (uint32_t l = 0; l < s->nlayers && rc == ST_OK; l++) {
        policy_stats ps = {.new_tokens = in->new_tokens ? in->new_tokens : s->unstepped,
                           .prefill = in->prefill,
                           .score_queries = in->score_queries,
                           .window_queries = in->window_queries,
                           .confidence = in->confidence};
        off += layer_stats(s, l, in->arrays, in->data ? in->data + off : NULL, &ps, ptrs);
        const policy_decision *d;
        char err[POLICY_ERR_LEN];
        if (policy_host_step(s->host, l, &ps, &d, err, sizeof err) != 0)
            rc = status_set(st, ST_INTERNAL, "policy %s failed: %s", s->policy->name, err);
        else
            rc = seq_apply_decision(s, l, d, epoch, &total, st);
    }
    free(ptrs);
    s->unstepped = 0;
    if (total > 0)
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

static int tail_usable(const seq_list *ly, uint32_t block_slots)
{
    return ly->has_tail && ly->tail_next_slot < block_slots;
}

static uint32_t blocks_needed(uint32_t count, uint32_t room, uint32_t block_tokens)
{
    return count <= room ? 0 : (count - room + block_tokens - 1) / block_tokens;
}

static void list_push(seq_list *ly, uint32_t block, uint32_t slot, uint32_t n)
{
    kv_segment *last = ly->nsegs ? &ly->segs[ly->nsegs - 1] : NULL;
    if (last != NULL && last->block == block && last->first_slot + last->count == slot)
        last->count += n;
    else
        ly->segs[ly->nsegs++] = (kv_segment){block, slot, n};
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
