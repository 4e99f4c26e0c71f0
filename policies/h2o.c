/*
 * h2o.c - policy "h2o": Heavy-Hitter Oracle (Zhang et al., "H2O:
 * Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
 * Models", NeurIPS 2023), the accumulated-attention baseline (DESIGN.md
 * "Policies"; POLICIES.md §3.6 names it as KVReviver without a sketch).
 *
 * Each step adds the step's attention (stats.score: Σ over query heads and
 * the step's queries, POLICIES.md §2.2/§3.4) to every held token's
 * accumulated score. Protected: the `recent` newest held tokens and every
 * token whose original position is < `sinks`. When more than `budget`
 * tokens are held, the held - budget unprotected tokens with the lowest
 * accumulated score are evicted, ties to the lower index (POLICIES.md
 * "Common notation": bottom-k). In decode that is one token per step; a
 * prefill chunk may shed many at once.
 *
 * Parameters: budget (256, as the other baselines' [RECON] default), recent
 * ("half" = int(budget/2), the H2O paper's even heavy/recent split), sinks
 * (0). recent + sinks <= budget is required so that every step can get back
 * to budget; recent = budget - sinks is allowed (then h2o keeps a window).
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "describe.h"
#include "select.h"
#include "util.h"

#define H2O_MAX 1048576u

typedef struct h2o_layer {
    uint32_t n, cap;
    uint32_t *pos;     /* original positions, for describe */
    double *score;     /* accumulated attention */
    uint64_t *scratch; /* the keys of a selection */
} h2o_layer;

typedef struct h2o_state {
    uint32_t budget, recent, sinks;
    uint32_t layers;
    h2o_layer *ly;
} h2o_state;

/* The parameters; recent = H2O_HALF stands for 'half'. */
typedef struct h2o_config {
    uint32_t budget, recent, sinks;
} h2o_config;

#define H2O_HALF UINT32_MAX

static const policy_param_spec h2o_params[] = {
    POLICY_PARAM_U32("budget", "256",
                     "tokens held per layer after each step, 1..1048576 ([RECON] default)", 1,
                     H2O_MAX, offsetof(h2o_config, budget)),
    POLICY_PARAM_U32_OR("recent", "half",
                        "newest tokens never evicted: 'half' = int(budget/2) (H2O's even split) or "
                        "0..budget; recent + sinks <= budget",
                        0, H2O_MAX, offsetof(h2o_config, recent), "half", H2O_HALF),
    POLICY_PARAM_U32("sinks", "0", "tokens with position < sinks are never evicted, 0..budget", 0,
                     H2O_MAX, offsetof(h2o_config, sinks)),
};

static void layer_free(h2o_layer *ly)
{
    free(ly->pos);
    free(ly->score);
    free(ly->scratch);
}

static void h2o_destroy(void *state)
{
    h2o_state *st = state;
    if (st == NULL)
        return;
    for (uint32_t l = 0; st->ly != NULL && l < st->layers; l++)
        layer_free(&st->ly[l]);
    free(st->ly);
    free(st);
}

static int h2o_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                      size_t errlen)
{
    *state = NULL;
    h2o_config c;
    if (policy_params_parse(p, h2o_params, sizeof h2o_params / sizeof h2o_params[0], &c, err,
                            errlen) != 0)
        return -1;
    /* The bounds that depend on the budget. */
    uint32_t budget = c.budget, recent = c.recent == H2O_HALF ? budget / 2 : c.recent,
             sinks = c.sinks;
    if (recent > budget) {
        snprintf(err, errlen, "parameter recent must be 'half' or an integer in [0, %u], got '%s'",
                 budget, policy_params_get(p, "recent"));
        return -1;
    }
    if (sinks > budget) {
        snprintf(err, errlen, "parameter sinks must be an integer in [0, %u], got '%s'", budget,
                 policy_params_get(p, "sinks"));
        return -1;
    }
    if ((uint64_t)recent + sinks > budget) {
        snprintf(err, errlen,
                 "parameters recent (%u) + sinks (%u) must be <= budget (%u): protected tokens "
                 "alone would exceed the budget",
                 recent, sinks, budget);
        return -1;
    }
    h2o_state *st = calloc(1, sizeof *st);
    if (st == NULL)
        goto oom;
    st->budget = budget;
    st->recent = recent;
    st->sinks = sinks;
    st->layers = g->layers;
    st->ly = calloc(g->layers ? g->layers : 1, sizeof *st->ly);
    if (st->ly == NULL)
        goto oom;
    *state = st;
    return 0;
oom:
    h2o_destroy(st);
    snprintf(err, errlen, "out of memory creating policy 'h2o'");
    return -1;
}

static int layer_reserve(h2o_layer *ly, uint32_t need)
{
    if (need <= ly->cap)
        return 0;
    uint64_t cap64 = ly->cap ? ly->cap : 64;
    while (cap64 < need)
        cap64 *= 2;
    if (cap64 > UINT32_MAX)
        cap64 = need;
    size_t cap = (size_t)cap64;
    uint32_t *pos = realloc(ly->pos, cap * sizeof *pos);
    if (pos == NULL)
        return -1;
    ly->pos = pos;
    double *score = realloc(ly->score, cap * sizeof *score);
    if (score == NULL)
        return -1;
    ly->score = score;
    uint64_t *scratch = realloc(ly->scratch, cap * sizeof *scratch);
    if (scratch == NULL)
        return -1;
    ly->scratch = scratch;
    ly->cap = (uint32_t)cap;
    return 0;
}

static int h2o_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                    policy_decision *d, char *err, size_t errlen)
{
    h2o_state *st = state;
    if (view->layer >= st->layers || view->heads != 1) {
        snprintf(err, errlen, "h2o: bad view (layer %u of %u, %u lists; expected 1)", view->layer,
                 st->layers, view->heads);
        return -1;
    }
    if (stats->score == NULL) {
        snprintf(err, errlen, "h2o needs stats.score (POLICY_NEEDS_SCORE), got none");
        return -1;
    }
    h2o_layer *ly = &st->ly[view->layer];
    uint32_t n = view->tokens[0];
    /* The view must extend what the policy tracks (same positions, then
     * the tokens appended since, which are all new whatever stats.new_tokens
     * says): otherwise the scores would be attributed to the wrong tokens. */
    const uint32_t *pos = view->positions[0];
    if (n < ly->n || (ly->n > 0 && memcmp(pos, ly->pos, (size_t)ly->n * sizeof *pos) != 0)) {
        snprintf(err, errlen,
                 "h2o: layer %u view (%u tokens) does not extend the %u tokens the policy "
                 "tracks (was a decision not applied?)",
                 view->layer, n, ly->n);
        return -1;
    }
    size_t bad = policy_first_outside(stats->score, n, -FLT_MAX);
    if (bad < n) {
        snprintf(err, errlen, "h2o: stats.score[%zu] is not finite", bad);
        return -1;
    }
    if (layer_reserve(ly, n) != 0) {
        snprintf(err, errlen, "h2o: out of memory for %u tokens", n);
        return -1;
    }
    for (uint32_t i = ly->n; i < n; i++) {
        ly->score[i] = 0;
        ly->pos[i] = pos[i];
    }
    for (uint32_t i = 0; i < n; i++)
        ly->score[i] += (double)stats->score[i];
    ly->n = n;
    if (n <= st->budget)
        return 0;
    /* Candidates: neither a sink nor among the `recent` newest; positions
     * ascend, so they are the indices [first, first_recent). Evict the
     * lowest scores first, ties to the lower index. */
    uint32_t first_recent = n > st->recent ? n - st->recent : 0, first = 0;
    while (first < first_recent && pos[first] < st->sinks)
        first++;
    uint32_t m = first_recent - first;
    uint32_t k = n - st->budget;
    if (k > m)
        k = m;    /* cannot happen: recent + sinks <= budget */
    if (k == 1) { /* a decode step */
        d->tier[0][first + policy_first_min(ly->score + first, m)] = POLICY_EVICT;
    } else if (k > 1) {
        for (uint32_t i = 0; i < m; i++)
            ly->scratch[i] = policy_key(ly->score[first + i]);
        policy_cut cut = policy_select_cut(ly->scratch, m, k);
        uint8_t *evict = (uint8_t *)ly->scratch; /* the keys are spent: m bytes of room */
        policy_cut_mark(&cut, ly->score + first, 1.0, NULL, 1, m, 0, evict);
        for (uint32_t i = 0; i < m; i++)
            d->tier[0][first + i] = evict[i] ? (uint8_t)POLICY_EVICT : d->tier[0][first + i];
    }
    /* Compact the per-token state exactly as the host compacts the list:
     * run by run of kept tokens (a decode step evicts one of many). */
    uint32_t out = 0;
    for (uint32_t i = 0; i < n;) {
        const uint8_t *e = memchr(d->tier[0] + i, POLICY_EVICT, n - i);
        uint32_t end = e != NULL ? (uint32_t)(e - d->tier[0]) : n;
        if (out != i) {
            memmove(ly->pos + out, ly->pos + i, (end - i) * sizeof *ly->pos);
            memmove(ly->score + out, ly->score + i, (end - i) * sizeof *ly->score);
        }
        out += end - i;
        i = end;
        while (i < n && d->tier[0][i] == POLICY_EVICT)
            i++;
    }
    ly->n = out;
    return 0;
}

/* ops->save: the layer's tokens and scores, in arrays of exactly n (the
 * copy's cap), so that restore() only swaps. */
static int h2o_save(const void *state, uint32_t layer, void **saved)
{
    const h2o_state *st = state;
    const h2o_layer *ly = &st->ly[layer];
    h2o_layer *c = calloc(1, sizeof *c);
    if (c != NULL) {
        c->n = c->cap = ly->n;
        c->pos = policy_array_copy(ly->pos, ly->n, ly->n, sizeof *ly->pos);
        c->score = policy_array_copy(ly->score, ly->n, ly->n, sizeof *ly->score);
        c->scratch = policy_array_copy(NULL, 0, ly->n, sizeof *ly->scratch);
    }
    if (c == NULL || !c->pos || !c->score || !c->scratch) {
        if (c != NULL)
            layer_free(c);
        free(c);
        errno = ENOMEM;
        return -1;
    }
    *saved = c;
    return 0;
}

static void h2o_restore(void *state, uint32_t layer, void *saved)
{
    h2o_state *st = state;
    layer_free(&st->ly[layer]);
    st->ly[layer] = *(h2o_layer *)saved;
    free(saved);
}

static void h2o_discard(void *saved)
{
    if (saved != NULL)
        layer_free(saved);
    free(saved);
}

/* ---- moving a sequence (ops->export_layer / import_layer) ---------------
 *
 * A layer's state as bytes, little-endian, version 1:
 *   0  "h2o", then the version byte (1)
 *   4  u32 layer, layers, budget, recent, sinks: what the bytes were
 *      written for, checked against the importing state (same parameters
 *      and geometry, as policy.h requires)
 *  24  u32 n, the tracked tokens (<= budget: every step ends within it)
 *  28  n x u32 original positions, strictly ascending
 *      n x u64 accumulated scores, each a double's IEEE bits (finite)
 * The score is the only thing step() carries from one step to the next;
 * the positions pair it with the host's list. h2o has no state that is
 * not per layer. */

#define H2O_STATE_VERSION 1
#define H2O_STATE_ECHO 5                            /* layer, layers, budget, recent, sinks */
#define H2O_STATE_HEAD (4 + 4 * H2O_STATE_ECHO + 4) /* magic+version, echo, n */
#define H2O_STATE_TOKEN (4 + 8)                     /* a position and a score */

static const char *const h2o_echo_names[H2O_STATE_ECHO] = {"layer", "layers", "budget", "recent",
                                                           "sinks"};

static void state_echo(const h2o_state *st, uint32_t layer, uint32_t echo[H2O_STATE_ECHO])
{
    echo[0] = layer;
    echo[1] = st->layers;
    echo[2] = st->budget;
    echo[3] = st->recent;
    echo[4] = st->sinks;
}

static void *h2o_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const h2o_state *st = state;
    const h2o_layer *ly = &st->ly[layer];
    size_t total = H2O_STATE_HEAD + (size_t)ly->n * H2O_STATE_TOKEN;
    uint8_t *b = malloc(total);
    if (b == NULL)
        return NULL;
    memcpy(b, "h2o", 3);
    b[3] = H2O_STATE_VERSION;
    uint32_t echo[H2O_STATE_ECHO];
    state_echo(st, layer, echo);
    for (int i = 0; i < H2O_STATE_ECHO; i++)
        policy_put_le(b + 4 + 4 * i, echo[i], 4);
    policy_put_le(b + H2O_STATE_HEAD - 4, ly->n, 4);
    uint8_t *pos = b + H2O_STATE_HEAD, *score = pos + (size_t)ly->n * 4;
    for (uint32_t i = 0; i < ly->n; i++) {
        policy_put_le(pos + (size_t)i * 4, ly->pos[i], 4);
        policy_put_le(score + (size_t)i * 8, policy_f64_bits(ly->score[i]), 8);
    }
    *len = total;
    return b;
}

/* The header of layer's bytes against st; *n receives the token count,
 * which the exact length then confirms. */
static int state_head_check(const h2o_state *st, uint32_t layer, const uint8_t *b, size_t len,
                            uint32_t *n, char *err, size_t errlen)
{
    if (len < H2O_STATE_HEAD) {
        policy_set_err(err, errlen, "h2o state: %zu bytes are shorter than its %d-byte header", len,
                       H2O_STATE_HEAD);
        return -1;
    }
    if (memcmp(b, "h2o", 3) != 0) {
        policy_set_err(err, errlen, "h2o state: bad magic (not h2o's layer state)");
        return -1;
    }
    if (b[3] != H2O_STATE_VERSION) {
        policy_set_err(err, errlen, "h2o state: version %u, this build reads version %d",
                       (unsigned)b[3], H2O_STATE_VERSION);
        return -1;
    }
    uint32_t echo[H2O_STATE_ECHO];
    state_echo(st, layer, echo);
    for (int i = 0; i < H2O_STATE_ECHO; i++) {
        uint32_t v = (uint32_t)policy_get_le(b + 4 + 4 * i, 4);
        if (v != echo[i]) {
            policy_set_err(err, errlen, "h2o state: written for %s %u, this sequence has %u",
                           h2o_echo_names[i], v, echo[i]);
            return -1;
        }
    }
    *n = (uint32_t)policy_get_le(b + H2O_STATE_HEAD - 4, 4);
    if (*n > st->budget) { /* also bounds the allocation below */
        policy_set_err(err, errlen,
                       "h2o state: %u tokens exceed the budget of %u (a step never ends above it)",
                       *n, st->budget);
        return -1;
    }
    size_t want = H2O_STATE_HEAD + (size_t)*n * H2O_STATE_TOKEN;
    if (len != want) {
        policy_set_err(err, errlen, "h2o state: %zu bytes, but %u tokens take exactly %zu", len, *n,
                       want);
        return -1;
    }
    return 0;
}

/* Positions as a host's list holds them (ascending, distinct) and scores
 * that step() could have summed (finite). */
static int state_tokens_check(const uint8_t *pos, const uint8_t *score, uint32_t n, char *err,
                              size_t errlen)
{
    for (uint32_t i = 1; i < n; i++) {
        if ((uint32_t)policy_get_le(pos + (size_t)i * 4, 4) <=
            (uint32_t)policy_get_le(pos + (size_t)(i - 1) * 4, 4)) {
            policy_set_err(err, errlen, "h2o state: position of token %u does not ascend", i);
            return -1;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        if (!isfinite(policy_bits_f64(policy_get_le(score + (size_t)i * 8, 8)))) {
            policy_set_err(err, errlen, "h2o state: score of token %u is not finite", i);
            return -1;
        }
    }
    return 0;
}

/* Everything is checked and allocated before the layer is swapped in, so
 * a refusal leaves the state as it was. */
static int h2o_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                            size_t errlen)
{
    h2o_state *st = state;
    const uint8_t *b = buf;
    uint32_t n;
    if (layer >= st->layers) {
        policy_set_err(err, errlen, "h2o state: layer %u of %u", layer, st->layers);
        return -1;
    }
    if (state_head_check(st, layer, b, len, &n, err, errlen) != 0)
        return -1;
    const uint8_t *pos = b + H2O_STATE_HEAD, *score = pos + (size_t)n * 4;
    if (state_tokens_check(pos, score, n, err, errlen) != 0)
        return -1;
    /* Arrays of exactly n, as save() makes them. */
    h2o_layer ly = {.n = n, .cap = n};
    ly.pos = policy_array_copy(NULL, 0, n, sizeof *ly.pos);
    ly.score = policy_array_copy(NULL, 0, n, sizeof *ly.score);
    ly.scratch = policy_array_copy(NULL, 0, n, sizeof *ly.scratch);
    if (!ly.pos || !ly.score || !ly.scratch) {
        layer_free(&ly);
        policy_set_err(err, errlen, "h2o state: out of memory for %u tokens", n);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        ly.pos[i] = (uint32_t)policy_get_le(pos + (size_t)i * 4, 4);
        ly.score[i] = policy_bits_f64(policy_get_le(score + (size_t)i * 8, 8));
    }
    layer_free(&st->ly[layer]);
    st->ly[layer] = ly;
    return 0;
}

static char *h2o_describe(void *state, uint32_t layer)
{
    const h2o_state *st = state;
    if (st == NULL || layer >= st->layers)
        return NULL;
    const h2o_layer *ly = &st->ly[layer];
    policy_text t = {0};
    policy_text_add(&t, "{\"layer\":%u,\"budget\":%u,\"recent\":%u,\"sinks\":%u,\"positions\":[",
                    layer, st->budget, st->recent, st->sinks);
    for (uint32_t i = 0; i < ly->n; i++)
        policy_text_add(&t, "%s%u", i ? "," : "", ly->pos[i]);
    policy_text_add(&t, "],\"score\":[");
    for (uint32_t i = 0; i < ly->n; i++)
        policy_text_add(&t, "%s%.9g", i ? "," : "", ly->score[i]);
    policy_text_add(&t, "]}");
    return policy_text_finish(&t);
}

const policy_ops policy_h2o = {
    .name = "h2o",
    .summary = "H2O: keep the `recent` newest tokens (and positions < sinks) plus the heaviest "
               "accumulated-attention tokens, `budget` in all",
    .params = h2o_params,
    .nparams = sizeof(h2o_params) / sizeof(h2o_params[0]),
    .needs = POLICY_NEEDS_SCORE,
    .per_head = 0,
    .create = h2o_create,
    .step = h2o_step,
    .describe = h2o_describe,
    .destroy = h2o_destroy,
    .save = h2o_save,
    .restore = h2o_restore,
    .discard = h2o_discard,
    .export_layer = h2o_export_layer,
    .import_layer = h2o_import_layer,
};
