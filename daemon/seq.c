/*
 * seq.c - a sequence's life: create, append, step, ack, and what it
 * reports (seq.h). The list representation is seq_list.c, applying a
 * policy's decisions seq_apply.c, revive seq_revive.c; seq_internal.h
 * holds what they share.
 */
#include "seq.h"

#include <errno.h>
#include <float.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstash_step.h"
#include "seq_internal.h"
#include "util.h" /* policies/: policy_first_outside */

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
    s->compact_budget = SEQ_COMPACT_TOKENS;
    s->compact_window = SEQ_COMPACT_TOKENS;
    if (tier_ctx_init(&s->tier, pool->backend->ops, pool->base, pool->block_bytes, &s->list_layout,
                      (kv_dtype)pool->geom.dtype) != 0) {
        free(s);
        return status_set(st, ST_INVALID_ARGUMENT,
                          "a block of this pool cannot hold an INT8 block");
    }
    s->lists = calloc((size_t)s->nlayers * s->heads, sizeof *s->lists);
    s->marks = calloc((pool->block_count + 7) / 8, 1);
    if (s->lists == NULL || s->marks == NULL) {
        free(s->lists);
        free(s->marks);
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
        free(s->marks);
        free(s);
        return st->code;
    }
    policy_host_set_threads(s->host, pool->policy_threads, pool->policy_parallel_tokens);
    uint8_t demote = policy_host_storage(s->host)->demote;
    if (demote != POLICY_FULL && tier_block_tokens(&s->tier, demote) == 0) {
        status_set(st, ST_INVALID_ARGUMENT,
                   "demote=%s: a block of this pool cannot hold an %s block",
                   policy_tier_name(demote), demote == POLICY_INT4 ? "INT4" : "INT2");
        policy_host_destroy(s->host);
        free(s->lists);
        free(s->marks);
        free(s);
        return st->code;
    }
    *out = s;
    return ST_OK;
}

uint32_t seq_list_blocks(const seq *s, uint32_t layer, uint32_t head)
{
    return list_count_blocks(seq_list_at(s, layer, head), -1, s);
}

uint64_t seq_id_of(const seq *s)
{
    return s->id;
}

uint64_t seq_session_id(const seq *s)
{
    return s->session_id;
}

pool *seq_pool(const seq *s)
{
    return s->pool;
}

const policy_ops *seq_policy(const seq *s)
{
    return s->policy;
}

const policy_params *seq_params(const seq *s)
{
    return &s->params;
}

const char *seq_label(const seq *s)
{
    return s->label;
}

uint64_t seq_epoch(const seq *s)
{
    return s->epoch;
}

uint64_t seq_appended(const seq *s)
{
    return s->appended;
}

uint32_t seq_layers(const seq *s)
{
    return s->nlayers;
}

uint32_t seq_heads(const seq *s)
{
    return s->heads;
}

uint32_t seq_block_tokens(const seq *s, uint8_t t)
{
    return tier_block_tokens(&s->tier, t);
}

uint32_t seq_quant_group(const seq *s)
{
    return kv_lowbit_group(&s->list_layout);
}

void seq_moved_totals(const seq *s, uint64_t moved[POLICY_TIERS])
{
    memcpy(moved, s->moved, sizeof s->moved);
}

uint64_t seq_victims_dropped(const seq *s)
{
    return s->victims_dropped;
}

size_t seq_retired_blocks(const seq *s, const seq_retired **out)
{
    *out = s->retired;
    return s->nretired;
}

void seq_list_view_get(seq *s, uint32_t layer, uint32_t head, seq_list_view *v)
{
    const seq_list *ly = seq_list_at(s, layer, head);
    v->tokens = seq_list_tokens(s, layer, head, &v->positions);
    v->segs = ly->segs;
    v->seg_tier = ly->seg_tier;
    v->nsegs = ly->nsegs;
    v->offloaded = ly->offloaded;
    v->noffloaded = ly->noffloaded;
}

status_code seq_policy_layer_step(seq *s, uint32_t l, const policy_decision **d, status *st)
{
    policy_stats stats = {.new_tokens = s->unstepped, .confidence = -1.0};
    char err[POLICY_ERR_LEN] = "";
    errno = 0; /* ENOMEM after a failure: out of memory (malloc sets it), not a bug */
    if (policy_host_step(s->host, l, &stats, d, err, sizeof err) != 0)
        return status_set(st, errno == ENOMEM ? ST_RESOURCE_EXHAUSTED : ST_INTERNAL,
                          "policy %s failed: %s", s->policy->name, err);
    *d = policy_host_decision_whole(s->host, l); /* the operator amends any tier */
    return ST_OK;
}

void seq_set_demote_after_step(seq *s, int on)
{
    s->demote_after_step = on;
}

void seq_publish_epoch(seq *s, uint64_t epoch)
{
    s->epoch = epoch;
}

void seq_give_back_blocks(seq *s)
{
    for (size_t i = 0; i < seq_nlists(s); i++)
        list_free_blocks(&s->lists[i], s->pool);
    for (size_t i = 0; i < s->nretired; i++)
        seq_give_block(s, s->retired[i].block);
    s->nretired = 0;
}

void seq_destroy(seq *s)
{
    if (s == NULL)
        return;
    seq_give_back_blocks(s); /* none left when the caller gave them back */
    for (size_t i = 0; i < seq_nlists(s); i++) {
        free(s->lists[i].segs);
        free(s->lists[i].seg_tier);
        free(s->lists[i].offloaded);
        free(s->lists[i].offloaded_at);
        free(s->lists[i].victim_blocks);
        tier_sketch_free(&s->lists[i].sketch);
    }
    seq_txn_free(s);
    free(s->cuts.count);
    free(s->cuts.first);
    free(s->cuts.idx);
    free(s->moves.runs);
    policy_host_destroy(s->host);
    snapshot_tiers_free(&s->report);
    free(s->retired);
    free(s->lists);
    free(s->marks);
    free(s);
}

void seq_ack(seq *s, uint64_t ack_epoch)
{
    size_t kept = 0;
    for (size_t i = 0; i < s->nretired; i++) {
        if (s->retired[i].epoch <= ack_epoch)
            seq_give_block(s, s->retired[i].block);
        else
            s->retired[kept++] = s->retired[i];
    }
    s->nretired = kept;
}

uint32_t seq_blocks_held(const seq *s)
{
    uint32_t n = (uint32_t)s->nretired;
    for (size_t k = 0; k < seq_nlists(s); k++)
        n += list_count_blocks(&s->lists[k], -1, s);
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
    if (s->deciding) /* the host is the decision's (seq_step_plan) */
        return s->held_deciding;
    uint64_t n = 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        for (uint32_t k = 0; k < s->heads; k++)
            n += seq_list_tokens(s, l, k, NULL);
    return n;
}

const snapshot_tiers *seq_tier_report(const seq *s)
{
    return &s->report;
}

void seq_tier_report_clear(seq *s)
{
    snapshot_tiers_clear(&s->report);
}

/* Count n tokens moved to tier t (moved[]) in the totals and the report. */
void seq_moved(seq *s, uint8_t t, uint64_t n)
{
    s->moved[t] += n;
    s->report.moved[t] += n;
}

void seq_list_tier_tokens(const seq *s, uint32_t layer, uint32_t head,
                          uint32_t tokens[POLICY_TIERS])
{
    const seq_list *ly = seq_list_at(s, layer, head);
    memset(tokens, 0, POLICY_TIERS * sizeof *tokens);
    for (size_t i = 0; i < ly->nsegs; i++)
        tokens[ly->seg_tier[i]] += ly->segs[i].count;
}

void seq_tier_usage(const seq *s, uint64_t tokens[POLICY_TIERS], uint64_t bytes[POLICY_TIERS])
{
    for (int t = 0; t < POLICY_TIERS; t++)
        tokens[t] = bytes[t] = 0;
    for (size_t k = 0; k < seq_nlists(s); k++) {
        const seq_list *ly = &s->lists[k];
        for (size_t i = 0; i < ly->nsegs; i++)
            tokens[ly->seg_tier[i]] += ly->segs[i].count;
        for (int t = 0; t < POLICY_TIERS; t++)
            if (t == POLICY_FULL || policy_tier_quantised((unsigned)t))
                bytes[t] += (uint64_t)list_count_blocks(ly, (uint8_t)t, s) * s->pool->block_bytes;
        for (size_t j = 0; j < ly->noffloaded; j++)
            tokens[ly->offloaded_at[j].tier]++;
        bytes[POLICY_SKETCH] += tier_sketch_bytes(&ly->sketch);
    }
}

size_t seq_sketch_bytes_max(const seq *s)
{
    /* tier_sketch_init's dim: the list layout's heads (1 for per-head lists) */
    size_t dim = (size_t)s->list_layout.kv_heads * s->list_layout.head_dim, total = 0;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        policy_sketch_geometry g;
        policy_host_sketch_geometry(s->host, l, &g);
        size_t layer;
        if (__builtin_mul_overflow(tier_sketch_bytes_for(g.rows, g.buckets, dim), (size_t)s->heads,
                                   &layer) ||
            __builtin_add_overflow(total, layer, &total))
            return SIZE_MAX;
    }
    return total;
}

int seq_sketches(const seq *s)
{
    return policy_host_storage(s->host)->victims == POLICY_VICTIMS_SKETCH ||
           s->policy->sketch_geometry != NULL;
}

size_t seq_sketch_reserved(const seq *s)
{
    return s->sketch_reserved;
}

void seq_set_sketch_reserved(seq *s, size_t bytes)
{
    s->sketch_reserved = bytes;
}

uint64_t seq_append_blocks(const seq *s, uint32_t count)
{
    uint64_t blocks = 0;
    for (size_t k = 0; k < seq_nlists(s); k++) {
        const seq_list *ly = &s->lists[k];
        uint32_t room =
            list_tail_usable(ly, s->block_slots) ? s->block_slots - ly->tail_next_slot : 0;
        if (count > room)
            blocks += (count - room + s->block_slots - 1) / s->block_slots;
    }
    return blocks;
}

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

/* A step's input parsed for the policy, and the policy's decisions
 * (seq.h seq_step_plan). The rows point into the caller's statistics. */
struct seq_step_job {
    seq *s;
    uint32_t *tokens; /* each list's tokens when the step began */
    const float **rows;
    policy_stats *ps; /* [nlayers] */
    const policy_decision **d;
    status_code rc; /* the decision's, then the application's */
    status st;
    size_t evicted; /* the commit's */
    uint64_t epoch; /* the application's */
    int changed;
    /* in->copy's: each layer's part of the statistics, [start[l],
     * start[l + 1]), is copied from src into copy as its step begins
     * (step_job_fetch); bad_stats: one held a non-finite value. in_place:
     * the policy reads src itself (seq_step_input.copy), and nothing is
     * copied. */
    const float *src;
    float *copy;
    size_t nfloats;
    int in_place;
    size_t *start;
    atomic_int bad_stats;
    const policy_helper *helper; /* seq_step_input's */
};

static void step_job_clear(seq_step_job *j)
{
    free(j->tokens);
    free(j->rows);
    free(j->ps);
    free(j->d);
    free(j->start);
}

/* Where each layer's part of the statistics starts (layer-major,
 * proto/kvstash_step.h), start[layers] = the end. */
static size_t *layer_starts(const step_shape *sh, const uint32_t *tokens, size_t nfloats)
{
    size_t *start = malloc(((size_t)sh->layers + 1) * sizeof *start);
    if (start == NULL)
        return NULL;
    for (uint32_t l = 0; l <= sh->layers; l++)
        start[l] = nfloats;
    step_cursor c;
    step_cursor_init(&c, sh, tokens);
    while (step_cursor_next(&c))
        if (c.offset < start[c.layer])
            start[c.layer] = c.offset;
    for (uint32_t l = sh->layers; l-- > 0;) /* a layer without rows starts at the next */
        if (start[l] > start[l + 1])
            start[l] = start[l + 1];
    return start;
}

/* policy_stats_fetch: layer l's statistics copied out of shared memory,
 * checked as they are copied. */
static int step_job_fetch(void *ctx, uint32_t l, char *err, size_t errlen)
{
    seq_step_job *j = ctx;
    size_t a = j->start[l], n = j->start[l + 1] - a;
    size_t bad = policy_copy_first_outside(j->copy + a, j->src + a, n, -FLT_MAX);
    if (bad == n)
        return 0;
    atomic_store_explicit(&j->bad_stats, 1, memory_order_relaxed);
    snprintf(err, errlen, "step statistics hold a non-finite value at float %zu", a + bad);
    return -1;
}

/* Every row of the step, parsed once (proto/kvstash_step.h), and each
 * layer's statistics for the policy. The sizes were checked
 * (seq_step_check): a mismatch here is a bug. */
static status_code step_job_parse(seq *s, const seq_step_input *in, seq_step_job *j, status *st)
{
    *j = (seq_step_job){.s = s,
                        .rc = ST_OK,
                        .src = in->data,
                        .copy = in->copy,
                        .nfloats = in->nfloats,
                        .helper = in->helper};
    atomic_init(&j->bad_stats, 0);
    step_shape sh;
    j->tokens = step_tokens(s, in->arrays, &sh);
    j->rows = calloc((size_t)s->nlayers * step_layer_slots(&sh) + 1, sizeof *j->rows);
    j->ps = calloc(s->nlayers, sizeof *j->ps);
    j->d = calloc(s->nlayers, sizeof *j->d);
    if (j->tokens == NULL || j->rows == NULL || j->ps == NULL || j->d == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    j->in_place = j->copy != NULL && !in->copy_always && sh.arrays == STEP_SCORE &&
                  policy_host_stats_in_place(s->host);
    if (j->copy != NULL && !j->in_place &&
        (j->start = layer_starts(&sh, j->tokens, in->nfloats)) == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    /* The policies read the copy, which each layer's fetch fills, or take
     * the worker's values themselves. */
    const float *read = j->copy != NULL && !j->in_place ? j->copy : in->data;
    if (step_parse(&sh, j->tokens, read, in->nfloats, j->rows) != 0)
        return status_set(st, ST_INTERNAL, "step statistics do not match the lists");
    int data = in->data != NULL;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        policy_stats *ps = &j->ps[l];
        *ps = (policy_stats){.new_tokens = in->new_tokens ? in->new_tokens : s->unstepped,
                             .prefill = in->prefill,
                             .score_queries = in->score_queries,
                             .window_queries = in->window_queries,
                             .confidence = in->confidence,
                             .finite = !j->in_place, /* seq_step_check's, or no data */
                             .in_place = j->in_place};
        if (data && (sh.arrays & STEP_SCORE)) /* one list only: checked by seq_step_check */
            ps->score = j->rows[step_slot(&sh, l, STEP_SCORE, 0)];
        if (data && (sh.arrays & STEP_LAST_ATTN))
            ps->last_attn = &j->rows[step_slot(&sh, l, STEP_LAST_ATTN, 0)];
        if (data && (sh.arrays & STEP_WINDOW_ATTN))
            ps->window_attn = &j->rows[step_slot(&sh, l, STEP_WINDOW_ATTN, 0)];
        if (data && (sh.arrays & STEP_VNORM))
            ps->vnorm = &j->rows[step_slot(&sh, l, STEP_VNORM, 0)];
    }
    return ST_OK;
}

/* A policy that took the worker's statistics in place refused one: named
 * as the copy's check names it, by its index in the step's floats, unless
 * the worker has changed it since (then in the policy's words). */
static void step_job_refused(seq_step_job *j, const char *err)
{
    size_t bad = policy_first_outside(j->src, j->nfloats, -FLT_MAX);
    if (bad < j->nfloats)
        j->rc = status_set(&j->st, ST_INVALID_ARGUMENT,
                           "step statistics hold a non-finite value at float %zu", bad);
    else
        j->rc = status_set(&j->st, ST_INVALID_ARGUMENT,
                           "step statistics held a non-finite value while the step read them (%s)",
                           err);
}

/* Every layer decides, on several threads where the policy and the host
 * allow. Only the policy host changes. */
static void step_job_decide(seq_step_job *j)
{
    char err[POLICY_ERR_LEN];
    policy_stats_fetch fetch = {step_job_fetch, j};
    errno = 0; /* ENOMEM after a failure: out of memory (malloc sets it), not a bug */
    if (policy_host_step_layers(j->s->host, j->ps, j->copy != NULL && !j->in_place ? &fetch : NULL,
                                j->helper, j->d, err, sizeof err) == 0)
        return;
    if (atomic_load_explicit(&j->bad_stats, memory_order_relaxed)) /* the worker's, not ours */
        j->rc = status_set(&j->st, ST_INVALID_ARGUMENT, "%s", err);
    else if (j->in_place && errno == EBADMSG) /* policy_stats_refused */
        step_job_refused(j, err);
    else
        j->rc = status_set(&j->st, errno == ENOMEM ? ST_RESOURCE_EXHAUSTED : ST_INTERNAL,
                           "policy %s failed: %s", j->s->policy->name, err);
}

const policy_decision *const *seq_step_decisions(const seq_step_job *j)
{
    return j->rc == ST_OK ? j->d : NULL;
}

const uint32_t *seq_step_list_tokens(const seq_step_job *j)
{
    return j->tokens;
}

/* The decisions move memory one layer after another; on a failure the
 * caller rolls back. The host's lists stay as the decisions saw them
 * (step_job_commit). */
static status_code step_job_apply(seq_step_job *j, uint64_t epoch, int *changed, status *st)
{
    seq *s = j->s;
    status_code rc = ST_OK;
    seq_cuts_begin(s);
    for (uint32_t l = 0; l < s->nlayers && rc == ST_OK; l++)
        rc = seq_apply_storage(s, l, j->d[l], epoch, changed, st);
    return rc;
}

/* Every layer's decision committed to the host's lists, after the storage
 * followed it. */
static void step_job_commit(seq_step_job *j)
{
    for (uint32_t l = 0; l < j->s->nlayers; l++)
        j->evicted += policy_host_commit(j->s->host, l);
}

/* seq_step_finish's work for its runner: the commit, and the end of the
 * host's transaction (the storage's ended before). Only the host changes,
 * so it may run without the store's lock, as the decision did. */
static int step_job_commit_host(void *job)
{
    seq_step_job *j = job;
    step_job_commit(j);
    policy_host_end(j->s->host);
    return 0;
}

/* The step applied and committed: a new epoch if anything changed. */
static void step_job_end(seq_step_job *j, uint64_t epoch, int changed, uint32_t *evicted)
{
    seq *s = j->s;
    s->unstepped = 0;
    if (j->evicted > 0 || changed)
        s->epoch = epoch;
    *evicted = (uint32_t)j->evicted;
}

/* Run the policy on every layer and apply its decisions, inside the
 * caller's transaction. The input was checked: a failure here is a policy
 * bug, or memory. */
static status_code seq_run_policy(seq *s, const seq_step_input *in, uint64_t epoch,
                                  uint32_t *evicted, status *st)
{
    seq_step_job j;
    int changed = 0;
    status_code rc = step_job_parse(s, in, &j, st);
    if (rc == ST_OK) {
        step_job_decide(&j);
        rc = j.rc != ST_OK ? (*st = j.st, j.rc) : step_job_apply(&j, epoch, &changed, st);
    }
    if (rc == ST_OK) {
        step_job_commit(&j);
        step_job_end(&j, epoch, changed, evicted);
    }
    step_job_clear(&j);
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
    unsigned alt = s->policy->needs_alt;
    unsigned missing = alt != 0 && (in->arrays & alt) == alt ? 0 : s->policy->needs & ~in->arrays;
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
    /* Megabytes a step at long contexts: one vectorised pass, or none when
     * the caller's copy checked them. */
    size_t bad = in->finite || in->copy != NULL /* checked a layer at a time: step_job_fetch */
                     ? in->nfloats
                     : policy_first_outside(in->data, in->nfloats, -FLT_MAX);
    if (bad < in->nfloats)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "step statistics hold a non-finite value at float %zu", bad);
    return ST_OK;
}

status_code seq_step_plan(seq *s, const seq_step_input *in, seq_step_job **job, status *st)
{
    *job = NULL;
    if (seq_step_check(s, in, st) != ST_OK)
        return st->code;
    seq_step_job *j = malloc(sizeof *j);
    if (j == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (step_job_parse(s, in, j, st) != ST_OK) {
        step_job_clear(j);
        free(j);
        return st->code;
    }
    /* What snapshots count while the host is the decision's alone. */
    uint64_t held = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        held += j->tokens[i];
    s->held_deciding = held;
    s->deciding = 1;
    policy_host_begin(s->host); /* seq_begin's, begun early: the decision changes the host */
    *job = j;
    return ST_OK;
}

void seq_step_decide(seq_step_job *job)
{
    step_job_decide(job);
}

/* Whether the step's decisions and the lists hold full-precision tokens
 * only (kept or evicted, nothing offloaded), which a detached sequence can
 * apply with the blocks of its reserve. */
static int step_job_full_only(const seq_step_job *j)
{
    const seq *s = j->s;
    const policy_storage *ps = policy_host_storage(s->host);
    if (ps->demote != POLICY_FULL || ps->victims != POLICY_VICTIMS_EVICT)
        return 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        for (uint32_t k = 0; k < s->heads; k++) {
            const seq_list *ly = seq_list_at(s, l, k);
            /* Outside its span every tier is and stays POLICY_FULL. */
            policy_span sp = policy_decision_span_of(j->d[l], k, j->tokens[l * s->heads + k]);
            uint32_t nevict;
            if (ly->noffloaded > 0 ||
                (sp.hi > sp.lo && !policy_tiers_keep_or_evict(j->d[l]->tier[k] + sp.lo,
                                                              sp.hi - sp.lo, POLICY_FULL, &nevict)))
                return 0;
            if (!seq_list_all_full(ly))
                return 0;
        }
    return 1;
}

/* seq_step_finish's application to the storage, in a transaction ended
 * (the storage's part) or rolled back (with the host's decision) here: on
 * a detached sequence without the store's lock, where a decision that
 * needs more than the storage can do detached (any tier but full
 * precision) is left, unchanged, to a second call under the lock. */
static int step_job_apply_work(void *job)
{
    seq_step_job *j = job;
    seq *s = j->s;
    if (seq_detached(s) && !step_job_full_only(j))
        return SEQ_WORK_NEEDS_LOCK;
    seq_begin(s);
    s->stepping = 1;
    j->rc = step_job_apply(j, j->epoch, &j->changed, &j->st);
    s->stepping = 0;
    if (j->rc == ST_OK) {
        seq_end_storage(s); /* nothing can fail from here */
        return 0;
    }
    if (seq_detached_short(s)) { /* the storage as it was, the decision kept */
        seq_rollback_storage(s);
        j->rc = ST_OK;
        return SEQ_WORK_NEEDS_LOCK;
    }
    seq_rollback(s); /* the host's decision too */
    return 0;
}

status_code seq_step_finish(seq_step_job *job, seq_step_runner run, void *ctx, uint32_t *evicted,
                            status *st)
{
    seq *s = job->s;
    job->epoch = s->epoch + 1;
    job->changed = 0;
    *evicted = 0;
    status_code rc = job->rc;
    if (rc != ST_OK) {
        *st = job->st;
        seq_begin(s);
        seq_rollback(s); /* the host's decision */
    } else {
        if (run != NULL)
            run(ctx, SEQ_WORK_STORAGE, step_job_apply_work, job);
        else
            step_job_apply_work(job);
        if ((rc = job->rc) != ST_OK)
            *st = job->st;
    }
    if (rc == ST_OK) {
        if (run != NULL)
            run(ctx, SEQ_WORK_HOST, step_job_commit_host, job);
        else
            step_job_commit_host(job);
        step_job_end(job, job->epoch, job->changed, evicted);
    }
    s->deciding = 0;
    step_job_clear(job);
    free(job);
    return rc;
}

status_code seq_step(seq *s, const seq_step_input *in, uint32_t *evicted, status *st)
{
    seq_step_job *job;
    *evicted = 0;
    if (seq_step_plan(s, in, &job, st) != ST_OK)
        return st->code;
    seq_step_decide(job);
    return seq_step_finish(job, NULL, NULL, evicted, st);
}

static uint64_t seq_blocks_needed(const seq *s, uint32_t count)
{
    uint32_t bt = s->block_slots;
    uint64_t need = 0;
    for (size_t i = 0; i < seq_nlists(s); i++) {
        const seq_list *ly = &s->lists[i];
        uint32_t room = list_tail_usable(ly, bt) ? bt - ly->tail_next_slot : 0;
        need += list_blocks_needed(count, room, bt);
    }
    return need;
}

status_code seq_append_check(const seq *s, int64_t count, status *st)
{
    if (count < 1 || count > SEQ_MAX_APPEND)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "count must be between 1 and %d tokens per append, got %lld",
                          SEQ_MAX_APPEND, (long long)count);
    if (s->appended + (uint64_t)count > UINT32_MAX)
        return status_set(st, ST_INVALID_ARGUMENT, "sequence %llu would exceed 2^32-1 positions",
                          (unsigned long long)s->id);
    return ST_OK;
}

/* The blocks `count` new tokens take from the pool, when the pool has
 * them (after dropping kept victims: memory pressure costs them before it
 * refuses tokens); RESOURCE_EXHAUSTED when it has not. */
static status_code append_fits(seq *s, int64_t count, uint64_t *need, status *st)
{
    *need = seq_blocks_needed(s, (uint32_t)count);
    uint64_t droppable = 0;
    for (size_t i = 0; i < seq_nlists(s); i++)
        droppable += s->lists[i].nvictim_blocks;
    if (*need <= seq_free_blocks(s) + droppable)
        return ST_OK;
    return status_set(st, ST_RESOURCE_EXHAUSTED,
                      "appending %lld tokens needs %llu free blocks; pool '%s' has %u of %u "
                      "free (release sequences or start kvstashd with a larger --pool-mb)",
                      (long long)count, (unsigned long long)*need, s->pool->model,
                      seq_free_blocks(s), s->pool->block_count);
}

/* Every part that can fail runs before victims are dropped and slots
 * handed out, which cannot. */
static status_code append_tokens(seq *s, int64_t count, uint64_t need, kv_segment *const *writes,
                                 size_t *nwrites, uint64_t epoch, status *st)
{
    for (size_t i = 0; i < seq_nlists(s); i++)
        if (list_reserve(&s->lists[i], s->lists[i].nsegs + (size_t)count / s->block_slots + 2) != 0)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (policy_host_append(s->host, (uint32_t)count) != 0)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    while (need > seq_free_blocks(s) && seq_drop_victim_blocks(s) > 0)
        ;
    for (size_t i = 0; i < seq_nlists(s); i++)
        nwrites[i] = list_grow(s, &s->lists[i], (uint32_t)count, writes[i]);
    s->appended += (uint64_t)count;
    s->unstepped += (uint32_t)count;
    s->epoch = epoch;
    return ST_OK;
}

status_code seq_append(seq *s, int64_t count, kv_segment *const *writes, size_t *nwrites,
                       uint32_t *evicted, status *st)
{
    *evicted = 0;
    if (seq_append_check(s, count, st) != ST_OK)
        return st->code;
    /* One Append is one new epoch, whatever it changed. */
    uint64_t epoch = s->epoch + 1, need;
    seq_begin(s);
    if (seq_step_silent(s, epoch, evicted, st) != ST_OK) {
        seq_rollback(s);
        *evicted = 0;
        return st->code;
    }
    /* A pool without the blocks refuses the tokens but keeps the step: the
     * blocks it retired are what the worker's ack frees for its retry. */
    if (append_fits(s, count, &need, st) != ST_OK) {
        seq_end(s);
        return st->code;
    }
    if (append_tokens(s, count, need, writes, nwrites, epoch, st) != ST_OK) {
        seq_rollback(s);
        *evicted = 0;
        return st->code;
    }
    seq_end(s);
    return ST_OK;
}
