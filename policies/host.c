#define _GNU_SOURCE 1 /* helper_cpus.h */

#include "host.h"

#include "storage.h"
#include "util.h"

#include "../kernels/helper_cpus.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HOST_COMMIT_AVX2 1
#endif

/*
 * One token list: a whole layer, or one KV head of it. Its tokens are
 * entries off..off+tokens of the arrays (cap entries each): a commit that
 * evicts near the front moves the entries before the evicted ones up and
 * advances off, so that evicting the oldest tokens after the sinks, each
 * step of StreamingLLM, moves a few entries, not the whole list.
 */
typedef struct host_list {
    uint32_t *pos_buf;
    uint8_t *tier_buf, *next_buf;
    float *attn_buf;
    uint32_t off, tokens, cap;
    /* pos_buf + off, tier_buf + off, attn_buf + off (list_at) */
    uint32_t *pos;
    uint8_t *tier;
    /* demote_keep only: the attention each token has received, summed over
     * steps and query heads (storage.h), NULL otherwise. */
    float *attn;
    /* The pending decision for this list (next_buf + off), and how many of
     * its first entries are known to equal tier's while none is pending: a
     * commit that moves next_tier as it moves tier leaves them all equal,
     * and the next decision's preset then copies only the tokens appended
     * since (otherwise every decode step copied every list's tiers). */
    uint8_t *next_tier;
    uint32_t next_same;
    /* How many entries hold a tier other than POLICY_FULL: while none
     * does, a decision's span may stay narrow (policy.h). */
    uint32_t not_full;
    /* Transactions: the token count at begin (appends only add after it),
     * and, once the layer was stepped, its first begin_tokens attention
     * entries as they were (demote_keep only: every step adds to all). */
    uint32_t begin_tokens;
    float *saved_attn;
} host_list;

/*
 * What a commit changed in one list, to undo it in a rollback: the list's
 * token count before and after, and entries at..at+evicted of the undo log
 * for its evicted tokens (their index before the commit, position and
 * tier), then `changed` entries for kept tokens whose tier changed (their
 * index after the commit and tier before). A decode step logs a few
 * entries, where a copy of every list for the rollback cost a pass over
 * all of them.
 */
typedef struct host_undo {
    uint32_t layer, head;
    uint32_t before, after, evicted, changed;
    int front; /* the entries before the evicted moved up (list_remove) */
    size_t at;
} host_undo;

typedef struct host_undo_log {
    host_undo *commits;
    size_t ncommits, commits_cap;
    uint32_t *idx, *pos;
    uint8_t *tier;
    size_t n, cap;
    size_t keep; /* the most a step could log: end frees a larger log */
} host_undo_log;

typedef struct host_layer {
    host_list *lists; /* [heads] */
    /* What the view points into. */
    uint32_t *tokens;
    const uint32_t **positions;
    const uint8_t **tiers;
    uint8_t **decision_tiers;
    policy_span *spans; /* [heads], the decision's */
    policy_layer_view view;
    policy_merge *merges;
    size_t merges_cap;
    policy_decision decision;
    int pending;
    /* Transactions: stepped since begin (lists and policy state saved), and
     * the policy's copy (ops->save; may be NULL). */
    int saved;
    void *policy_saved;
} host_layer;

struct policy_host {
    const policy_ops *ops;
    void *state;
    policy_geometry geom;
    policy_storage storage;
    uint32_t heads;
    uint64_t appended, steps;
    host_layer *layers;
    /* Transactions: open, and the counters at begin. */
    int txn;
    uint64_t begin_appended, begin_steps;
    host_undo_log undo; /* also the commit's scratch outside a transaction */
    /* demote_keep: the lists' mean attention and the demotion's scratch. */
    double *importance;
    void *demote_scratch;
    uint32_t grade_cap;
    /* policy_host_set_threads */
    uint32_t threads;
    uint64_t parallel_tokens;
    const policy_stats_fetch *fetch; /* policy_host_step_layers', while it runs */
};

static int graded(const policy_host *h)
{
    return h->storage.demote != POLICY_FULL && h->storage.demote_keep > 0;
}

static void layer_free(host_layer *ly, uint32_t heads)
{
    for (uint32_t h = 0; ly->lists != NULL && h < heads; h++) {
        free(ly->lists[h].pos_buf);
        free(ly->lists[h].tier_buf);
        free(ly->lists[h].next_buf);
        free(ly->lists[h].attn_buf);
        free(ly->lists[h].saved_attn);
    }
    free(ly->lists);
    free(ly->tokens);
    free(ly->positions);
    free(ly->tiers);
    free(ly->decision_tiers);
    free(ly->spans);
    free(ly->merges);
}

static int layer_init(host_layer *ly, uint32_t layer, uint32_t heads)
{
    ly->lists = calloc(heads, sizeof *ly->lists);
    ly->tokens = calloc(heads, sizeof *ly->tokens);
    ly->positions = calloc(heads, sizeof *ly->positions);
    ly->tiers = calloc(heads, sizeof *ly->tiers);
    ly->decision_tiers = calloc(heads, sizeof *ly->decision_tiers);
    ly->spans = calloc(heads, sizeof *ly->spans);
    if (!ly->lists || !ly->tokens || !ly->positions || !ly->tiers || !ly->decision_tiers ||
        !ly->spans)
        return -1;
    ly->view.layer = layer;
    ly->view.heads = heads;
    ly->view.tokens = ly->tokens;
    ly->view.positions = ly->positions;
    ly->view.tier = ly->tiers;
    ly->decision.tier = ly->decision_tiers;
    ly->decision.span = ly->spans;
    return 0;
}

int policy_host_create(const policy_ops *ops, const policy_params *params,
                       const policy_geometry *geometry, policy_host **out, char *err, size_t errlen)
{
    *out = NULL;
    policy_host *h = calloc(1, sizeof *h);
    if (h == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    h->ops = ops;
    h->geom = *geometry;
    h->heads = ops->per_head ? geometry->kv_heads : 1;
    h->layers = calloc(geometry->layers, sizeof *h->layers);
    int ok = h->layers != NULL;
    for (uint32_t l = 0; ok && l < geometry->layers; l++)
        ok = layer_init(&h->layers[l], l, h->heads) == 0;
    if (!ok) {
        snprintf(err, errlen, "out of memory");
        policy_host_destroy(h);
        return -1;
    }
    if (policy_storage_parse(params, &h->storage, err, errlen) != 0 ||
        ops->create(params, geometry, &h->state, err, errlen) != 0) {
        h->state = NULL;
        policy_host_destroy(h);
        return -1;
    }
    *out = h;
    return 0;
}

static void undo_log_free(host_undo_log *u)
{
    free(u->commits);
    free(u->idx);
    free(u->pos);
    free(u->tier);
    memset(u, 0, sizeof *u);
}

void policy_host_destroy(policy_host *h)
{
    if (h == NULL)
        return;
    if (h->txn)
        policy_host_end(h); /* frees the saved copies */
    if (h->state != NULL)
        h->ops->destroy(h->state);
    for (uint32_t l = 0; h->layers != NULL && l < h->geom.layers; l++)
        layer_free(&h->layers[l], h->heads);
    free(h->layers);
    undo_log_free(&h->undo);
    free(h->importance);
    free(h->demote_scratch);
    free(h);
}

const policy_ops *policy_host_ops(const policy_host *h)
{
    return h->ops;
}

void *policy_host_state(const policy_host *h)
{
    return h->state;
}

uint32_t policy_host_heads(const policy_host *h)
{
    return h->heads;
}

const policy_storage *policy_host_storage(const policy_host *h)
{
    return &h->storage;
}

void policy_host_sketch_geometry(const policy_host *h, uint32_t layer, policy_sketch_geometry *out)
{
    if (h->ops->sketch_geometry == NULL || h->ops->sketch_geometry(h->state, layer, out) != 0)
        policy_storage_sketch_geometry(&h->storage, layer, out);
}

const uint32_t *policy_host_tier_order(const policy_host *h, uint32_t layer, size_t *n)
{
    *n = 0;
    return h->ops->tier_order ? h->ops->tier_order(h->state, layer, n) : NULL;
}

/* Point the list's arrays at entry off of its buffers (none yet: NULL). */
static void list_at(host_list *li, uint32_t off)
{
    li->off = off;
    li->pos = li->pos_buf != NULL ? li->pos_buf + off : NULL;
    li->tier = li->tier_buf != NULL ? li->tier_buf + off : NULL;
    li->next_tier = li->next_buf != NULL ? li->next_buf + off : NULL;
    li->attn = li->attn_buf != NULL ? li->attn_buf + off : NULL;
}

/* not_full counted again (after a rollback or a restore). */
static void list_count_not_full(host_list *li)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < li->tokens; i++)
        c += li->tier[i] != POLICY_FULL;
    li->not_full = c;
}

/* Move the list's entries to the start of its buffers. */
static void list_to_front(host_list *li)
{
    if (li->off == 0)
        return;
    memmove(li->pos_buf, li->pos, li->tokens * sizeof *li->pos);
    memmove(li->tier_buf, li->tier, li->tokens);
    memmove(li->next_buf, li->next_tier, li->next_same);
    if (li->attn != NULL)
        memmove(li->attn_buf, li->attn, li->tokens * sizeof *li->attn);
    list_at(li, 0);
}

/* Room for `need` entries from off; the entries move to the front first
 * when that makes room (then realloc copies only them). A failed realloc
 * leaves the list as it was, perhaps moved to the front. */
static int list_reserve(host_list *li, uint32_t need, int with_attn)
{
    if ((uint64_t)li->off + need <= li->cap)
        return 0;
    list_to_front(li);
    /* A quarter of room beyond need: a list whose start moves up at each
     * commit (one evicted token, the shorter side moved) is then moved back
     * to the front once every need / 4 appends, not at each (issue 16 §2:
     * 32 lists of 32k tokens a decode step). */
    uint64_t want = (uint64_t)need + need / 4;
    if (want <= li->cap)
        return 0;
    /* 64-bit so that doubling past 2^31 cannot wrap to 0 and spin. */
    uint64_t cap64 = li->cap ? li->cap : 16;
    while (cap64 < want)
        cap64 *= 2;
    uint32_t cap = cap64 > UINT32_MAX ? UINT32_MAX : (uint32_t)cap64;
    uint32_t *pos = realloc(li->pos_buf, cap * sizeof *pos);
    if (pos != NULL)
        li->pos_buf = pos;
    uint8_t *tier = pos != NULL ? realloc(li->tier_buf, cap) : NULL;
    if (tier != NULL)
        li->tier_buf = tier;
    uint8_t *next = tier != NULL ? realloc(li->next_buf, cap) : NULL;
    if (next != NULL)
        li->next_buf = next;
    float *attn = next != NULL && with_attn ? realloc(li->attn_buf, cap * sizeof *attn) : NULL;
    if (attn != NULL)
        li->attn_buf = attn;
    list_at(li, 0); /* the buffers that moved */
    if (next == NULL || (with_attn && attn == NULL))
        return need <= li->cap ? 0 : -1; /* cap stays: the next call grows them all again */
    li->cap = cap;
    return 0;
}

/* Point the layer's view and decision at the lists' current arrays. */
static void layer_refresh(host_layer *ly, uint32_t heads, uint64_t appended, uint64_t steps)
{
    for (uint32_t k = 0; k < heads; k++) {
        ly->tokens[k] = ly->lists[k].tokens;
        ly->positions[k] = ly->lists[k].pos;
        ly->tiers[k] = ly->lists[k].tier;
        ly->decision_tiers[k] = ly->lists[k].next_tier;
    }
    ly->view.appended = appended;
    ly->view.step = steps;
}

int policy_host_append(policy_host *h, uint32_t n)
{
    /* Positions are uint32_t: refuse what would wrap them (and the lists'
     * counts, which never exceed the positions). */
    if (h->appended + n > UINT32_MAX)
        return -1;
    /* Reserve every list first, so that a failure leaves the host as it was
     * instead of some layers a step ahead of the others. */
    for (uint32_t l = 0; l < h->geom.layers; l++)
        for (uint32_t k = 0; k < h->heads; k++)
            if (list_reserve(&h->layers[l].lists[k], h->layers[l].lists[k].tokens + n, graded(h)) !=
                0)
                return -1;
    for (uint32_t l = 0; l < h->geom.layers; l++) {
        host_layer *ly = &h->layers[l];
        for (uint32_t k = 0; k < h->heads; k++) {
            host_list *li = &ly->lists[k];
            for (uint32_t i = 0; i < n; i++) {
                li->pos[li->tokens + i] = (uint32_t)(h->appended + i);
                li->tier[li->tokens + i] = POLICY_FULL;
                if (li->attn != NULL)
                    li->attn[li->tokens + i] = 0;
            }
            li->tokens += n;
        }
        ly->pending = 0;
    }
    h->appended += n;
    return 0;
}

int policy_host_portable(const policy_host *h)
{
    return h->ops->save == NULL || (h->ops->export_layer != NULL && h->ops->import_layer != NULL);
}

void *policy_host_export_state(const policy_host *h, uint32_t layer, size_t *len)
{
    *len = 0;
    if (h->ops->export_layer == NULL)
        return malloc(1);
    return h->ops->export_layer(h->state, layer, len);
}

uint64_t policy_host_appended(const policy_host *h)
{
    return h->appended;
}

uint64_t policy_host_steps(const policy_host *h)
{
    return h->steps;
}

const float *policy_host_attn(const policy_host *h, uint32_t layer, uint32_t head)
{
    return h->layers[layer].lists[head].attn;
}

static int image_check(const policy_host_list_image *li, uint64_t appended, char *err,
                       size_t errlen)
{
    for (uint32_t i = 0; i < li->tokens; i++) {
        if (li->pos[i] >= appended || (i > 0 && li->pos[i] <= li->pos[i - 1])) {
            snprintf(err, errlen, "position %u at %u is not ascending below %llu", li->pos[i], i,
                     (unsigned long long)appended);
            return -1;
        }
        if (li->tier[i] >= POLICY_TIERS || li->tier[i] == POLICY_EVICT) {
            snprintf(err, errlen, "position %u has tier %u, not a stored tier", li->pos[i],
                     li->tier[i]);
            return -1;
        }
    }
    return 0;
}

int policy_host_restore(policy_host *h, uint64_t appended, uint64_t steps,
                        const policy_host_list_image *lists, const policy_host_state_image *states,
                        char *err, size_t errlen)
{
    if (!policy_host_portable(h)) {
        snprintf(err, errlen, "policy %s keeps state of its own that it cannot write out",
                 h->ops->name);
        return -1;
    }
    if ((h->ops->import_layer != NULL) != (states != NULL)) {
        snprintf(err, errlen, "policy %s %s per-layer state", h->ops->name,
                 states != NULL ? "keeps no" : "needs its");
        return -1;
    }
    if (h->appended != 0 || h->txn || appended > UINT32_MAX) {
        snprintf(err, errlen, "restore needs a fresh host and at most 2^32-1 tokens");
        return -1;
    }
    size_t nlists = (size_t)h->geom.layers * h->heads;
    for (size_t i = 0; i < nlists; i++) {
        host_list *li = &h->layers[i / h->heads].lists[i % h->heads];
        if (image_check(&lists[i], appended, err, errlen) != 0)
            return -1;
        if (list_reserve(li, lists[i].tokens, graded(h)) != 0) {
            snprintf(err, errlen, "out of memory");
            return -1; /* reserved lists stay empty: the host is as it was */
        }
    }
    for (size_t i = 0; i < nlists; i++) {
        host_list *li = &h->layers[i / h->heads].lists[i % h->heads];
        const policy_host_list_image *im = &lists[i];
        if (im->tokens > 0) {
            memcpy(li->pos, im->pos, im->tokens * sizeof *li->pos);
            memcpy(li->tier, im->tier, im->tokens);
        }
        if (li->attn != NULL)
            for (uint32_t t = 0; t < im->tokens; t++)
                li->attn[t] = im->attn != NULL ? im->attn[t] : 0.0f;
        li->tokens = im->tokens;
        list_count_not_full(li);
    }
    for (uint32_t l = 0; l < h->geom.layers; l++)
        h->layers[l].pending = 0;
    h->appended = appended;
    h->steps = steps;
    for (uint32_t l = 0; states != NULL && l < h->geom.layers; l++) {
        char perr[POLICY_ERR_LEN] = "";
        if (h->ops->import_layer(h->state, l, states[l].buf, states[l].len, perr, sizeof perr) !=
            0) {
            snprintf(err, errlen, "layer %u's %s state: %s", l, h->ops->name, perr);
            return -1;
        }
    }
    return 0;
}

const policy_layer_view *policy_host_view(policy_host *h, uint32_t layer)
{
    host_layer *ly = &h->layers[layer];
    layer_refresh(ly, h->heads, h->appended, h->steps);
    return &ly->view;
}

/* The layer's decision preset to its current tiers; room for a merge a
 * token only for a policy that merges (20 bytes a token and layer the
 * others never use), grown by doubling, as the lists grow a token a step. */
static int layer_prepare_decision(host_layer *ly, uint32_t heads, int merges)
{
    size_t total = 0;
    for (uint32_t k = 0; k < heads; k++) {
        host_list *li = &ly->lists[k];
        /* An empty list may have no arrays yet: memcpy's pointers must not
         * be NULL even for 0 bytes (fuzz_replay: a step before any append). */
        if (li->tokens > li->next_same)
            memcpy(li->next_tier + li->next_same, li->tier + li->next_same,
                   li->tokens - li->next_same);
        li->next_same = 0; /* until a commit: the policy writes into it */
        ly->spans[k] = (policy_span){0, li->tokens};
        total += li->tokens;
    }
    if (merges && total > ly->merges_cap) {
        size_t cap = ly->merges_cap ? ly->merges_cap : 16;
        while (cap < total)
            cap *= 2;
        policy_merge *m = realloc(ly->merges, cap * sizeof *m);
        if (m == NULL)
            return -1;
        ly->merges = m;
        ly->merges_cap = cap;
    }
    ly->decision.merges = ly->merges;
    ly->decision.merges_cap = ly->merges_cap;
    ly->decision.nmerges = 0;
    ly->decision.rerotate_keys = 0;
    ly->decision.rope_theta = 0;
    ly->decision.rope_pairing = 0;
    return 0;
}

/* Whether every one of t[0..n) is a tier: no early exit, vectorised. */
POLICY_HOT static int tiers_valid(const uint8_t *t, uint32_t n)
{
    uint8_t bad = 0;
    for (uint32_t i = 0; i < n; i++)
        bad |= t[i] >= POLICY_TIERS;
    return !bad;
}

/* Every list's span as the host keeps it: one the policy narrowed stays
 * narrow only where every tier outside it is POLICY_FULL (policy.h) and
 * nothing merges. */
static int layer_settle_spans(host_layer *ly, uint32_t heads, char *err, size_t errlen)
{
    for (uint32_t k = 0; k < heads; k++) {
        const host_list *li = &ly->lists[k];
        policy_span *sp = &ly->spans[k];
        if (sp->lo > sp->hi || sp->hi > li->tokens) {
            snprintf(err, errlen, "span [%u, %u) of list %u is not within its %u tokens", sp->lo,
                     sp->hi, k, li->tokens);
            return -1;
        }
        if (li->not_full > 0 || ly->decision.nmerges > 0)
            *sp = (policy_span){0, li->tokens};
    }
    return 0;
}

/* A policy's decision must be applicable as it stands: the daemon trusts
 * it to move memory. Outside its spans it is as preset. */
static int decision_valid(host_layer *ly, uint32_t heads, char *err, size_t errlen)
{
    const policy_decision *d = &ly->decision;
    if (layer_settle_spans(ly, heads, err, errlen) != 0)
        return -1;
    for (uint32_t k = 0; k < heads; k++) {
        const uint8_t *t = d->tier[k];
        uint32_t lo = ly->spans[k].lo, hi = ly->spans[k].hi;
        /* An empty span may be of a list with no arrays yet (fuzz_replay:
         * a step before any append): no offset to a null pointer. */
        int bad = hi > lo && !tiers_valid(t + lo, hi - lo);
        for (uint32_t i = lo; bad && i < hi; i++)
            if (t[i] >= POLICY_TIERS) {
                snprintf(err, errlen, "invalid tier %u for token %u of list %u", t[i], i, k);
                return -1;
            }
    }
    if (d->nmerges > d->merges_cap) {
        snprintf(err, errlen, "%zu merges exceed the capacity %zu", d->nmerges, d->merges_cap);
        return -1;
    }
    for (size_t m = 0; m < d->nmerges; m++) {
        const policy_merge *g = &d->merges[m];
        if (g->head >= heads || g->from >= ly->lists[g->head].tokens ||
            g->into >= ly->lists[g->head].tokens || g->from == g->into ||
            d->tier[g->head][g->from] != POLICY_EVICT ||
            d->tier[g->head][g->into] == POLICY_EVICT) {
            snprintf(err, errlen,
                     "merge %zu (head %u, %u into %u) is not a merge of an evicted "
                     "token into a kept one",
                     m, g->head, g->from, g->into);
            return -1;
        }
    }
    return 0;
}

/* Free the layer's saved attention (rollback used it, or end drops it). */
static void layer_drop_saved(host_layer *ly, uint32_t heads)
{
    for (uint32_t k = 0; k < heads; k++) {
        free(ly->lists[k].saved_attn);
        ly->lists[k].saved_attn = NULL;
    }
}

/* The first step of a layer in a transaction: keep what its steps change
 * in place, the attention sums as they were at begin (appends since then
 * only added after begin_tokens) and the policy's layer state. What its
 * commits change, the undo log keeps. */
static int layer_save(policy_host *h, host_layer *ly, uint32_t layer)
{
    int ok = 1;
    for (uint32_t k = 0; ok && k < h->heads; k++) {
        host_list *li = &ly->lists[k];
        uint32_t n = li->begin_tokens;
        if (li->attn != NULL) {
            li->saved_attn = policy_array_copy(li->attn, n, n, sizeof *li->attn);
            ok = li->saved_attn != NULL;
        }
    }
    void *copy = NULL;
    if (ok && h->ops->save != NULL)
        ok = h->ops->save(h->state, layer, &copy) == 0;
    if (!ok) {
        layer_drop_saved(ly, h->heads);
        errno = ENOMEM;
        return -1;
    }
    ly->policy_saved = copy;
    ly->saved = 1;
    return 0;
}

/* A transaction ends: the log empties, and a log that a large commit grew
 * beyond what this transaction's steps reserved is given back (a prefill
 * that evicted most of a long prompt); one that stepped nothing (an
 * append) keeps it for the next step. */
static void undo_log_end(host_undo_log *u)
{
    u->ncommits = u->n = 0;
    if (u->keep > 0 && u->cap > 2 * u->keep + 1024)
        undo_log_free(u);
    u->keep = 0;
}

void policy_host_begin(policy_host *h)
{
    if (h->txn)
        return;
    for (uint32_t l = 0; l < h->geom.layers; l++) {
        host_layer *ly = &h->layers[l];
        ly->pending = 0;
        for (uint32_t k = 0; k < h->heads; k++)
            ly->lists[k].begin_tokens = ly->lists[k].tokens;
    }
    h->begin_appended = h->appended;
    h->begin_steps = h->steps;
    h->txn = 1;
}

/*
 * Undo one commit of list li (the commits after it undone already): the
 * tokens appended since it dropped, the kept tokens' tiers put back, and
 * the evicted entries put back at their indices, the kept ones spread out
 * around them: downwards when the commit moved the front up (off then is
 * as the commit left it, at least m), else upwards (off is as the commit
 * found it, or 0 when an append moved the list to the front of its
 * buffers since; the buffers have only grown).
 */
static void undo_commit(host_list *li, const host_undo_log *u, const host_undo *c)
{
    li->tokens = c->after;
    for (uint32_t i = 0; i < c->changed; i++) {
        size_t e = c->at + c->evicted + i;
        li->tier[u->idx[e]] = u->tier[e];
    }
    uint32_t m = c->evicted;
    const uint32_t *idx = u->idx + c->at, *pos = u->pos + c->at;
    const uint8_t *tier = u->tier + c->at;
    if (c->front &&
        li->off >= m) { /* lowest first: each entry moves down by the evicted before it */
        uint32_t *p = li->pos - m;
        uint8_t *t = li->tier - m;
        uint32_t from = 0, to = 0; /* next kept entry, and its index before */
        for (uint32_t j = 0; j <= m; j++) {
            uint32_t end = j < m ? idx[j] : c->before;
            memmove(p + to, li->pos + from, (end - to) * sizeof *p);
            memmove(t + to, li->tier + from, end - to);
            from += end - to;
            if (j < m)
                p[end] = pos[j], t[end] = tier[j];
            to = end + 1;
        }
        list_at(li, li->off - m);
    } else { /* highest first: each entry moves up by the evicted before it */
        uint32_t from = c->after, to = c->before;
        for (uint32_t j = m; j-- > 0;) {
            uint32_t run = to - idx[j] - 1;
            from -= run, to -= run;
            memmove(li->pos + to, li->pos + from, run * sizeof *li->pos);
            memmove(li->tier + to, li->tier + from, run);
            to--;
            li->pos[to] = pos[j], li->tier[to] = tier[j];
        }
    }
    li->tokens = c->before;
}

void policy_host_rollback(policy_host *h)
{
    if (!h->txn)
        return;
    for (size_t i = h->undo.ncommits; i-- > 0;) {
        const host_undo *c = &h->undo.commits[i];
        undo_commit(&h->layers[c->layer].lists[c->head], &h->undo, c);
    }
    for (uint32_t l = 0; l < h->geom.layers; l++) {
        host_layer *ly = &h->layers[l];
        for (uint32_t k = 0; k < h->heads; k++) {
            host_list *li = &ly->lists[k];
            li->tokens = li->begin_tokens; /* drops what was appended since */
            if (ly->saved && li->attn != NULL && li->begin_tokens > 0)
                memcpy(li->attn, li->saved_attn, li->begin_tokens * sizeof *li->attn);
            list_count_not_full(li);
            li->next_same = 0;
        }
        layer_drop_saved(ly, h->heads);
        if (ly->policy_saved != NULL)
            h->ops->restore(h->state, l, ly->policy_saved);
        ly->policy_saved = NULL;
        ly->saved = 0;
        ly->pending = 0;
    }
    h->appended = h->begin_appended;
    h->steps = h->begin_steps;
    undo_log_end(&h->undo);
    h->txn = 0;
}

void policy_host_end(policy_host *h)
{
    if (!h->txn)
        return;
    for (uint32_t l = 0; l < h->geom.layers; l++) {
        host_layer *ly = &h->layers[l];
        layer_drop_saved(ly, h->heads);
        if (ly->policy_saved != NULL)
            h->ops->discard(ly->policy_saved);
        ly->policy_saved = NULL;
        ly->saved = 0;
    }
    undo_log_end(&h->undo);
    h->txn = 0;
}

/* The attention list k's tokens got in this step, summed over the list's
 * query heads: the summed score, else the last query's, else the window's
 * mean (storage.h demote_keep). NULL arrays add nothing. */
static void list_observe_attention(const policy_host *h, host_list *li, uint32_t k,
                                   const policy_stats *st)
{
    if (st->score != NULL && h->heads == 1) {
        for (uint32_t i = 0; i < li->tokens; i++)
            li->attn[i] += st->score[i];
        return;
    }
    const float *const *rows = st->last_attn != NULL ? st->last_attn : st->window_attn;
    if (rows == NULL)
        return;
    uint32_t group = h->heads == 1 ? h->geom.q_heads : h->geom.q_heads / h->geom.kv_heads;
    for (uint32_t q = k * group; q < (k + 1) * group; q++)
        for (uint32_t i = 0; i < li->tokens; i++)
            li->attn[i] += rows[q][i];
}

static void layer_observe_attention(policy_host *h, host_layer *ly, const policy_stats *stats)
{
    for (uint32_t k = 0; k < h->heads; k++)
        if (ly->lists[k].attn != NULL)
            list_observe_attention(h, &ly->lists[k], k, stats);
}

/* The storage options' demotion of the pending decision (storage.h); with
 * demote_keep, by each token's mean attention over the queries since it
 * arrived (ZipCache's normalised score: older tokens have had more
 * queries). */
static int layer_demote(policy_host *h, host_layer *ly)
{
    for (uint32_t k = 0; k < h->heads; k++) {
        host_list *li = &ly->lists[k];
        if (h->storage.demote != POLICY_FULL) /* it may change any tier */
            ly->spans[k] = (policy_span){0, li->tokens};
        if (!graded(h) || li->attn == NULL) {
            policy_storage_demote(&h->storage, li->next_tier, li->tokens, NULL, NULL);
            continue;
        }
        if (li->tokens > h->grade_cap) {
            double *imp = realloc(h->importance, li->tokens * sizeof *imp);
            if (imp != NULL)
                h->importance = imp;
            void *scratch = realloc(h->demote_scratch, policy_storage_demote_scratch(li->tokens));
            if (scratch != NULL)
                h->demote_scratch = scratch;
            if (imp == NULL || scratch == NULL)
                return -1;
            h->grade_cap = li->tokens;
        }
        for (uint32_t i = 0; i < li->tokens; i++)
            h->importance[i] = li->attn[i] / (double)(h->appended - li->pos[i]);
        policy_storage_demote(&h->storage, li->next_tier, li->tokens, h->importance,
                              h->demote_scratch);
    }
    return 0;
}

/* Room for what the commits of the layers stepped and not committed yet
 * (layers lo..hi-1 included) log: an entry for each token at most
 * (evicted, or kept with another tier) and a commit for each list, so that
 * commit cannot fail. */
static int undo_log_reserve(policy_host *h, uint32_t lo, uint32_t hi)
{
    host_undo_log *u = &h->undo;
    size_t need = u->n, every = u->n, lists = 0;
    for (uint32_t l = 0; l < h->geom.layers; l++) {
        const host_layer *ly = &h->layers[l];
        size_t tokens = 0;
        for (uint32_t k = 0; k < h->heads; k++)
            tokens += ly->lists[k].tokens;
        every += tokens;
        if (!ly->pending && (l < lo || l >= hi))
            continue;
        need += tokens;
        lists += h->heads;
    }
    /* A step usually goes through every layer: room for all of them at
     * once, rather than a log copied again at each doubling (75 MB at 32
     * layers x 8 heads x 32k tokens), and kept while they hold as many. */
    if (every - u->n > u->keep)
        u->keep = every - u->n;
    if (need > u->cap) {
        size_t cap = u->cap ? u->cap : 64;
        while (cap < need)
            cap *= 2;
        if (cap < every)
            cap = every;
        uint32_t *idx = realloc(u->idx, cap * sizeof *idx);
        if (idx != NULL)
            u->idx = idx;
        uint32_t *pos = realloc(u->pos, cap * sizeof *pos);
        if (pos != NULL)
            u->pos = pos;
        uint8_t *tier = realloc(u->tier, cap);
        if (tier != NULL)
            u->tier = tier;
        if (idx == NULL || pos == NULL || tier == NULL)
            return -1;
        u->cap = cap;
    }
    if (u->ncommits + lists > u->commits_cap) {
        size_t cap = u->commits_cap ? 2 * u->commits_cap : 64;
        while (cap < u->ncommits + lists)
            cap *= 2;
        host_undo *c = realloc(u->commits, cap * sizeof *c);
        if (c == NULL)
            return -1;
        u->commits = c;
        u->commits_cap = cap;
    }
    return 0;
}

/* Before a layer's step: in a transaction, its first step saves it; an
 * earlier decision of the layer that was never committed is gone (its
 * arrays are about to be overwritten), and a failed step must leave
 * nothing for commit to apply. */
static int layer_begin(policy_host *h, uint32_t layer, char *err, size_t errlen)
{
    host_layer *ly = &h->layers[layer];
    if (h->txn && !ly->saved && layer_save(h, ly, layer) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    ly->pending = 0;
    return 0;
}

/* The part of a layer's step that touches the layer alone (and the
 * policy's state of it): the view, the decision preset, the policy's
 * step, the decision checked. */
static int layer_step(policy_host *h, uint32_t layer, const policy_stats *stats, char *err,
                      size_t errlen)
{
    if (h->fetch != NULL && h->fetch->fn(h->fetch->ctx, layer, err, errlen) != 0)
        return -1;
    host_layer *ly = &h->layers[layer];
    layer_refresh(ly, h->heads, h->appended, h->steps);
    if (layer_prepare_decision(ly, h->heads, h->ops->merges) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (h->ops->step(h->state, &ly->view, stats, &ly->decision, err, errlen) != 0)
        return -1;
    return decision_valid(ly, h->heads, err, errlen);
}

/* After it, on the host's shared scratch: the attention observed, the
 * storage options' demotion; the decision is pending. */
static int layer_finish(policy_host *h, uint32_t layer, const policy_stats *stats,
                        const policy_decision **decision, char *err, size_t errlen)
{
    host_layer *ly = &h->layers[layer];
    if (graded(h))
        layer_observe_attention(h, ly, stats);
    if (layer_demote(h, ly) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    ly->pending = 1;
    *decision = &ly->decision;
    return 0;
}

int policy_host_step(policy_host *h, uint32_t layer, const policy_stats *stats,
                     const policy_decision **decision, char *err, size_t errlen)
{
    if (layer_begin(h, layer, err, errlen) != 0)
        return -1;
    if (layer == 0)
        h->steps++;
    if (undo_log_reserve(h, layer, layer + 1) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (layer_step(h, layer, stats, err, errlen) != 0)
        return -1;
    return layer_finish(h, layer, stats, decision, err, errlen);
}

int policy_host_stats_in_place(const policy_host *h)
{
    return h->ops->stats_in_place && !graded(h);
}

void policy_host_set_threads(policy_host *h, uint32_t threads, uint64_t min_tokens)
{
    h->threads = threads;
    h->parallel_tokens = min_tokens;
}

/* How many threads a step of every layer takes: one unless the policy's
 * layers may step at once and there is enough to share. */
static uint32_t step_threads(const policy_host *h)
{
    uint32_t n = h->threads < h->geom.layers ? h->threads : h->geom.layers;
    if (n <= 1 || !h->ops->layers_concurrent ||
        (h->ops->layers_concurrent_now != NULL && !h->ops->layers_concurrent_now(h->state)))
        return 1;
    uint64_t tokens = 0;
    for (uint32_t l = 0; l < h->geom.layers; l++)
        for (uint32_t k = 0; k < h->heads; k++)
            tokens += h->layers[l].lists[k].tokens;
    return tokens >= h->parallel_tokens ? n : 1;
}

/* The layers' policy steps shared out between threads, a layer at a time
 * in order, each one's result kept for the caller to report in order. */
typedef struct layer_steps {
    policy_host *h;
    const policy_stats *stats;
    atomic_uint next;
    int *rc, *errnum;
    char (*err)[POLICY_ERR_LEN];
    helper_cpus cpus;
} layer_steps;

static void layer_steps_take(layer_steps *j)
{
    for (;;) {
        uint32_t l = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (l >= j->h->geom.layers)
            return;
        errno = 0;
        j->rc[l] = layer_step(j->h, l, &j->stats[l], j->err[l], POLICY_ERR_LEN);
        j->errnum[l] = errno;
    }
}

static void *layer_steps_helper(void *arg)
{
    layer_steps *j = arg;
    helper_cpus_enter(&j->cpus);
    layer_steps_take(j);
    return NULL;
}

/* policy_helper's fn: a lent thread places itself. */
static void layer_steps_lent(void *arg)
{
    layer_steps_take(arg);
}

/* Every layer's policy step on `threads` threads (fewer when one cannot
 * be started), the lent helper first, then the first failure in layer
 * order, or each layer finished. */
static int step_layers_threaded(policy_host *h, uint32_t threads, const policy_helper *helper,
                                const policy_stats *stats, const policy_decision **decisions,
                                char *err, size_t errlen)
{
    uint32_t L = h->geom.layers;
    layer_steps j = {.h = h, .stats = stats};
    atomic_init(&j.next, 0);
    j.rc = calloc(L, sizeof *j.rc);
    j.errnum = calloc(L, sizeof *j.errnum);
    j.err = calloc(L, sizeof *j.err);
    pthread_t *tid = calloc(threads, sizeof *tid);
    int rc = j.rc && j.errnum && j.err && tid ? 0 : -1;
    uint32_t started = 0;
    int lent = rc == 0 && helper != NULL && helper->start(helper->ctx, layer_steps_lent, &j) == 0;
    if (rc == 0 && threads > 1 + (uint32_t)lent) {
        pthread_attr_t attr;
        int have_attr = pthread_attr_init(&attr) == 0;
        if (have_attr) /* helper_cpus.h: else they wait for the caller */
            helper_cpus_place(&j.cpus, &attr);
        while (started + 1 + (uint32_t)lent < threads &&
               pthread_create(&tid[started], have_attr ? &attr : NULL, layer_steps_helper, &j) == 0)
            started++;
        if (have_attr)
            pthread_attr_destroy(&attr);
    }
    if (rc == 0)
        layer_steps_take(&j);
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    if (lent)
        helper->join(helper->ctx);
    if (rc != 0) {
        snprintf(err, errlen, "out of memory");
        errno = ENOMEM;
    }
    for (uint32_t l = 0; rc == 0 && l < L; l++) {
        if (j.rc[l] != 0) {
            snprintf(err, errlen, "%s", j.err[l]);
            errno = j.errnum[l];
            rc = -1;
        } else {
            rc = layer_finish(h, l, &stats[l], &decisions[l], err, errlen);
        }
    }
    free(j.rc);
    free(j.errnum);
    free(j.err);
    free(tid);
    return rc;
}

static int step_layers(policy_host *h, const policy_helper *helper, const policy_stats *stats,
                       const policy_decision **decisions, char *err, size_t errlen)
{
    uint32_t threads = step_threads(h);
    if (threads <= 1) {
        /* On one thread every layer's statistics are fetched first: one
         * pass over them all measured faster than a pass before each
         * layer (a decode step of h2o at 32k tokens: 3.0 ms against 3.2). */
        for (uint32_t l = 0; h->fetch != NULL && l < h->geom.layers; l++)
            if (h->fetch->fn(h->fetch->ctx, l, err, errlen) != 0)
                return -1;
        h->fetch = NULL;
        for (uint32_t l = 0; l < h->geom.layers; l++)
            if (policy_host_step(h, l, &stats[l], &decisions[l], err, errlen) != 0)
                return -1;
        return 0;
    }
    for (uint32_t l = 0; l < h->geom.layers; l++)
        if (layer_begin(h, l, err, errlen) != 0)
            return -1;
    h->steps++;
    if (undo_log_reserve(h, 0, h->geom.layers) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return step_layers_threaded(h, threads, helper, stats, decisions, err, errlen);
}

int policy_host_step_layers(policy_host *h, const policy_stats *stats,
                            const policy_stats_fetch *fetch, const policy_helper *helper,
                            const policy_decision **decisions, char *err, size_t errlen)
{
    h->fetch = fetch;
    int rc = step_layers(h, helper, stats, decisions, err, errlen);
    h->fetch = NULL;
    return rc;
}

/* The kept tokens of list li whose tier the decision changes (within its
 * span sp), in the undo log after the m evicted ones logged from e (their
 * index after the commit, and tier before), their tiers changed; compared
 * with memcmp 512 bytes at a time, as a decode step changes few. Returns
 * how many. */
static uint32_t list_change_tiers(host_list *li, policy_span sp, host_undo_log *u, size_t e,
                                  uint32_t m)
{
    uint32_t changed = 0;
    const uint8_t *next = li->next_tier;
    for (uint32_t j = 0, from = sp.lo; j <= m; j++) { /* the kept run before evicted j */
        uint32_t end = j < m ? u->idx[e + j] : sp.hi;
        for (uint32_t i = from; i < end;) {
            uint32_t stop = end - i > 512 ? i + 512 : end;
            if (memcmp(li->tier + i, next + i, stop - i) == 0) {
                i = stop;
                continue;
            }
            for (; i < stop; i++)
                if (li->tier[i] != next[i]) {
                    size_t at = e + m + changed++;
                    u->idx[at] = i - j, u->tier[at] = li->tier[i];
                    li->tier[i] = next[i];
                }
        }
        from = end + 1;
    }
    return changed;
}

/* Remove the m evicted entries (indices idx[], ascending) from the list,
 * moving the fewer kept entries: those after the first evicted one down,
 * or those before the last one up (off advances by m: returns 1). */
static int list_remove(host_list *li, const uint32_t *idx, uint32_t m)
{
    uint32_t n = li->tokens;
    if ((uint64_t)idx[m - 1] + 1 < (uint64_t)n - idx[0]) { /* the front is shorter */
        uint32_t to = idx[m - 1] + 1; /* the kept runs, from the last, end at `to` */
        for (uint32_t j = m; j-- > 0;) {
            uint32_t start = j > 0 ? idx[j - 1] + 1 : 0, run = idx[j] - start;
            to -= run;
            memmove(li->pos + to, li->pos + start, run * sizeof *li->pos);
            memmove(li->tier + to, li->tier + start, run);
            memmove(li->next_tier + to, li->next_tier + start, run);
            if (li->attn != NULL)
                memmove(li->attn + to, li->attn + start, run * sizeof *li->attn);
        }
        list_at(li, li->off + m);
        li->tokens = n - m;
        return 1;
    }
    uint32_t to = idx[0];
    for (uint32_t j = 0; j < m; j++) {
        uint32_t start = idx[j] + 1, run = (j + 1 < m ? idx[j + 1] : n) - start;
        memmove(li->pos + to, li->pos + start, run * sizeof *li->pos);
        memmove(li->tier + to, li->tier + start, run);
        memmove(li->next_tier + to, li->next_tier + start, run);
        if (li->attn != NULL)
            memmove(li->attn + to, li->attn + start, run * sizeof *li->attn);
        to += run;
    }
    li->tokens = n - m;
    return 0;
}

/* The evicted entries of li (next_tier POLICY_EVICT) within span sp,
 * ascending, logged at idx/pos/tier (their index before the commit,
 * position and tier); returns how many. memchr finds a first (a decode
 * step evicts a few of many); the bytes after a hit are looked at one by
 * one while hits keep coming within 16, since a prompt's decision evicts
 * most of a list and a call a token would cost more than the bytes. Each
 * byte's entry is written whether evicted or not, and kept only by
 * counting it: no branch to mispredict. The log has room for every entry
 * of the list (undo_log_reserve), so the spare writes stay inside it. */
static uint32_t find_evicted_scalar(const host_list *li, policy_span sp, uint32_t *restrict idx,
                                    uint32_t *restrict pos, uint8_t *restrict tier)
{
    const uint8_t *next = li->next_tier, *from_tier = li->tier;
    const uint32_t *from_pos = li->pos;
    uint32_t m = 0, n = sp.hi;
    for (uint32_t i = sp.lo; i < n;) {
        const uint8_t *x = memchr(next + i, POLICY_EVICT, n - i);
        if (x == NULL)
            break;
        for (uint32_t hit = i = (uint32_t)(x - next); i < n && i - hit <= 16; i++) {
            uint32_t evicted = next[i] == POLICY_EVICT;
            idx[m] = i, pos[m] = from_pos[i], tier[m] = from_tier[i];
            m += evicted;
            hit = evicted ? i : hit;
        }
    }
    return m;
}

/* The undo log's write position for changed tiers, and the next kept
 * entry's index, as list_commit_dense goes. */
typedef struct dense_cursor {
    uint32_t changed, to;
} dense_cursor;

/* list_commit_dense's start: the tiers changed before the first evicted
 * entry (from the span's start), which stay where they are. */
static void commit_front_tiers(host_list *li, uint32_t lo, host_undo_log *u, size_t e, uint32_t m,
                               dense_cursor *c)
{
    const uint8_t *next = li->next_tier;
    uint8_t *tier = li->tier;
    for (uint32_t i = lo; i < c->to; i++)
        if (tier[i] != next[i]) {
            size_t at = e + m + c->changed++;
            u->idx[at] = i, u->tier[at] = tier[i];
            tier[i] = next[i];
        }
}

/* list_commit_dense over entries [from, end), from after the first
 * evicted one. */
static void commit_entries(host_list *li, host_undo_log *u, size_t e, uint32_t m, uint32_t from,
                           uint32_t end, dense_cursor *c)
{
    const uint8_t *next = li->next_tier;
    uint32_t *restrict pos = li->pos;
    uint8_t *restrict tier = li->tier;
    float *restrict attn = li->attn;
    uint32_t to = c->to;
    for (uint32_t i = from; i < end; i++) {
        uint8_t was = tier[i], now = next[i];
        uint32_t kept = now != POLICY_EVICT;
        if (kept && was != now) {
            size_t at = e + m + c->changed++;
            u->idx[at] = to, u->tier[at] = was;
        }
        pos[to] = pos[i];
        tier[to] = now;
        if (attn != NULL)
            attn[to] = attn[i];
        to += kept;
    }
    c->to = to;
}

#ifdef HOST_COMMIT_AVX2
/*
 * The commit's compactions eight entries at a time with AVX2: the entries
 * an 8-bit mask selects are moved to the front of a vector by a shuffle
 * looked up by the mask (pack_lanes), and all eight lanes are stored at the
 * output's end, never past what is still to be read (its index is at most
 * the input's). A compiler does not vectorise a compaction, and the scalar
 * loops' dependent store addresses cost a few cycles an entry: a prompt's
 * commit of 32 layers x 8 KV heads x 32k tokens took 30 ms.
 */
static uint8_t pack_lanes[256][8]; /* [mask]: the lanes of its set bits, in order */
static pthread_once_t pack_lanes_once = PTHREAD_ONCE_INIT;

static void pack_lanes_init(void)
{
    for (unsigned mask = 0; mask < 256; mask++)
        for (unsigned lane = 0, k = 0; lane < 8; lane++)
            if (mask >> lane & 1)
                pack_lanes[mask][k++] = (uint8_t)lane;
}

static int commit_avx2(void)
{
    if (!__builtin_cpu_supports("avx2"))
        return 0;
    pthread_once(&pack_lanes_once, pack_lanes_init);
    return 1;
}

__attribute__((target("avx2"))) static inline __m128i lanes_of(unsigned mask)
{
    return _mm_loadl_epi64((const __m128i *)pack_lanes[mask]);
}

/* The eight 32-bit words at p, those of mask first, stored at out. */
__attribute__((target("avx2"))) static inline void pack_words(void *out, const void *p,
                                                              unsigned mask)
{
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    __m256i perm = _mm256_cvtepu8_epi32(lanes_of(mask));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(x, perm));
}

/* The eight bytes of x, those of mask first, stored at out. */
__attribute__((target("avx2"))) static inline void pack_bytes(uint8_t *out, __m128i x,
                                                              unsigned mask)
{
    _mm_storel_epi64((__m128i *)out, _mm_shuffle_epi8(x, lanes_of(mask)));
}

/* list_find_evicted: 32 decisions compared at once, and a group of eight
 * with an eviction packed into the log. The log has room for every entry
 * of the list, so that eight lanes stored at m <= i stay inside it. */
__attribute__((target("avx2"))) static uint32_t
find_evicted_avx2(const host_list *li, policy_span sp, uint32_t *restrict idx,
                  uint32_t *restrict pos, uint8_t *restrict tier)
{
    const uint8_t *next = li->next_tier, *from_tier = li->tier;
    const uint32_t *from_pos = li->pos;
    uint32_t m = 0, n = sp.hi, i = sp.lo;
    const __m256i evict = _mm256_set1_epi8((char)POLICY_EVICT);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; i + 32 <= n; i += 32) {
        __m256i t = _mm256_loadu_si256((const __m256i *)(next + i));
        uint32_t hits = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(t, evict));
        for (uint32_t j = i; hits != 0; j += 8, hits >>= 8) {
            unsigned mask = hits & 0xffu;
            if (mask == 0)
                continue;
            __m256i at = _mm256_add_epi32(_mm256_set1_epi32((int)j), lane);
            pack_words(idx + m, &at, mask);
            pack_words(pos + m, from_pos + j, mask);
            pack_bytes(tier + m, _mm_loadl_epi64((const __m128i *)(from_tier + j)), mask);
            m += (uint32_t)__builtin_popcount(mask);
        }
    }
    for (; i < n; i++) {
        idx[m] = i, pos[m] = from_pos[i], tier[m] = from_tier[i];
        m += next[i] == POLICY_EVICT;
    }
    return m;
}

/* list_commit_dense, eight entries at a time; a group with a kept entry
 * whose tier changes (rare but for demotions) goes through the scalar
 * loop, which logs it. */
__attribute__((target("avx2"))) static uint32_t
list_commit_dense_avx2(host_list *li, uint32_t lo, host_undo_log *u, size_t e, uint32_t m)
{
    uint32_t n = li->tokens, i = u->idx[e];
    dense_cursor c = {0, i};
    commit_front_tiers(li, lo, u, e, m, &c);
    const uint8_t *next = li->next_tier;
    const __m128i evict = _mm_set1_epi8((char)POLICY_EVICT);
    for (; i + 8 <= n; i += 8) {
        __m128i now = _mm_loadl_epi64((const __m128i *)(next + i));
        __m128i was = _mm_loadl_epi64((const __m128i *)(li->tier + i));
        unsigned kept = ~(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(now, evict)) & 0xffu;
        unsigned same = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(now, was)) & 0xffu;
        if ((kept & ~same) != 0) {
            commit_entries(li, u, e, m, i, i + 8, &c);
            continue;
        }
        pack_words(li->pos + c.to, li->pos + i, kept);
        pack_bytes(li->tier + c.to, now, kept);
        if (li->attn != NULL)
            pack_words(li->attn + c.to, li->attn + i, kept);
        c.to += (uint32_t)__builtin_popcount(kept);
    }
    commit_entries(li, u, e, m, i, n, &c);
    li->tokens = n - m;
    return c.changed;
}
#endif

/* The evicted entries of li, as find_evicted_scalar. */
static uint32_t list_find_evicted(const host_list *li, policy_span sp, uint32_t *restrict idx,
                                  uint32_t *restrict pos, uint8_t *restrict tier)
{
#ifdef HOST_COMMIT_AVX2
    if (commit_avx2())
        return find_evicted_avx2(li, sp, idx, pos, tier);
#endif
    return find_evicted_scalar(li, sp, idx, pos, tier);
}

/* list_change_tiers then list_remove's back variant in one pass, for a
 * list whose kept runs after the first evicted entry are short (a
 * prompt's decision evicts most of a list): their memcmp and three
 * memmove calls a run cost more than the runs. The same lists and the
 * same undo log entries, in the same order. Every entry is copied down,
 * and kept by advancing past it, without a branch; a changed tier is
 * rare but for demotions. */
static uint32_t list_commit_dense(host_list *li, uint32_t lo, host_undo_log *u, size_t e,
                                  uint32_t m)
{
#ifdef HOST_COMMIT_AVX2
    if (commit_avx2())
        return list_commit_dense_avx2(li, lo, u, e, m);
#endif
    uint32_t n = li->tokens;
    dense_cursor c = {0, u->idx[e]};
    commit_front_tiers(li, lo, u, e, m, &c);
    commit_entries(li, u, e, m, c.to, n, &c);
    li->tokens = n - m;
    return c.changed;
}

/* not_full after a commit, from what it logged at e: m evicted entries
 * (their tiers before), then `changed` kept ones (index after, tier
 * before). */
static void list_count_changes(host_list *li, const host_undo_log *u, size_t e, uint32_t m,
                               uint32_t changed)
{
    for (size_t x = e; x < e + m; x++)
        li->not_full -= u->tier[x] != POLICY_FULL;
    for (size_t x = e + m; x < e + m + changed; x++)
        li->not_full +=
            (uint32_t)(li->tier[u->idx[x]] != POLICY_FULL) - (uint32_t)(u->tier[x] != POLICY_FULL);
}

/* Commit list k of layer l: its evicted tokens and changed tiers logged
 * for a rollback, the tiers changed, the evicted entries removed. Returns
 * how many went. */
static uint32_t list_commit(policy_host *h, uint32_t l, uint32_t k)
{
    host_list *li = &h->layers[l].lists[k];
    policy_span sp = h->layers[l].spans[k];
    host_undo_log *u = &h->undo;
    size_t e = u->n;
    uint32_t n = li->tokens;
    /* An empty list may have no log yet: no pointer into it. */
    uint32_t m = n > 0 ? list_find_evicted(li, sp, u->idx + e, u->pos + e, u->tier + e) : 0;
    uint32_t changed = 0;
    /* Kept entries the back variant moves, and the front one. */
    uint64_t back = m > 0 ? n - u->idx[e] - m : 0,
             front_moves = m > 0 ? u->idx[e + m - 1] + 1 - m : 0;
    int front = 0;
    if (m > 0 && back < 16u * (uint64_t)m && back <= 2 * front_moves) { /* runs under 16 */
        changed = list_commit_dense(li, sp.lo, u, e, m);
    } else {
        /* The changed tiers copied from next_tier, the evicted entries
         * removed from both: the two are equal after it. */
        changed = list_change_tiers(li, sp, u, e, m);
        front = m > 0 ? list_remove(li, u->idx + e, m) : 0;
        li->next_same = li->tokens;
    }
    list_count_changes(li, u, e, m, changed);
    if (h->txn && (m > 0 || changed > 0)) {
        u->commits[u->ncommits++] = (host_undo){l, k, n, n - m, m, changed, front, e};
        u->n += m + changed;
    }
    return m;
}

policy_decision *policy_host_decision_whole(policy_host *h, uint32_t layer)
{
    host_layer *ly = &h->layers[layer];
    for (uint32_t k = 0; k < h->heads; k++)
        ly->spans[k] = (policy_span){0, ly->lists[k].tokens};
    return &ly->decision;
}

size_t policy_host_commit(policy_host *h, uint32_t layer)
{
    host_layer *ly = &h->layers[layer];
    if (!ly->pending)
        return 0;
    size_t evicted = 0;
    for (uint32_t k = 0; k < h->heads; k++)
        evicted += list_commit(h, layer, k);
    ly->pending = 0;
    return evicted;
}
