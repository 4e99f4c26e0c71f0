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

/*
 * A layer's tokens: their original positions (to check that each view
 * extends them; describe, export) and accumulated scores, kept in place
 * (issue 16 §2: a second buffer written each step, so that the one read
 * stayed for a rollback, read and wrote 44 bytes a token, 32 MiB a decode
 * step at 32k tokens x 32 layers). A step's attention is not added at once:
 * it is kept as `added` (a float a token) and folded into the sums at the
 * start of the next step, as that step's pass goes by. A token's sum is
 * score[e] + (double)added[e] while has_added: the same double addition,
 * so the same bits, as adding it at once. A rollback after a step then
 * needs no copy: the fold changed how the sums are held, not what they are
 * (save() notes where they were; a step that would change them, a second
 * step in a transaction or a prefill's compaction, copies them first).
 *
 * A decode step evicts one token from the middle of the list; it stays in
 * the arrays as a hole (has_hole, at index `hole`) that the next step's
 * fold closes as it passes, instead of moving the half of the arrays after
 * it: the arrays then hold n + 1 entries.
 */
typedef struct h2o_saved h2o_saved;

typedef struct h2o_layer {
    uint32_t n, cap; /* n: tokens tracked; cap: entries each array has room for */
    uint32_t *pos;
    double *score;
    float *added; /* the last step's attention, not yet in score (has_added) */
    int has_added;
    int has_hole;
    uint32_t hole;
    h2o_saved *saved;  /* the transaction's save(), until restore or discard */
    uint64_t *scratch; /* the keys of a selection */
    uint32_t scratch_cap;
} h2o_layer;

/* What save() keeps: how the layer held its tokens then; once a step has
 * folded them (folded), their sums are score[0..n) with no hole; pos and
 * score: a copy of those, taken before a step changed them. */
struct h2o_saved {
    h2o_layer *ly;
    uint32_t n, hole;
    int has_added, has_hole;
    int folded;
    uint32_t *pos;
    double *score;
};

/* The entry of the layer's arrays that holds tracked token i. */
static uint32_t layer_entry(const h2o_layer *ly, uint32_t i)
{
    return i + (uint32_t)(ly->has_hole && i >= ly->hole);
}

/* The accumulated score of entry e. */
static double entry_score(const h2o_layer *ly, uint32_t e)
{
    return ly->has_added ? ly->score[e] + (double)ly->added[e] : ly->score[e];
}

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
    free(ly->added);
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

/* Room for n entries in each array (their contents kept; never none
 * after it, so that no pointer is offset from NULL) and, for a selection,
 * in the scratch keys; -1 when out of memory. */
static int layer_reserve(h2o_layer *ly, uint32_t n, int keys)
{
    if (n > ly->cap || ly->cap == 0) {
        uint64_t cap64 = ly->cap ? ly->cap : 64;
        while (cap64 < n)
            cap64 *= 2;
        size_t cap = cap64 > UINT32_MAX ? n : (size_t)cap64;
        uint32_t *pos = realloc(ly->pos, cap * sizeof *pos);
        if (pos != NULL)
            ly->pos = pos;
        double *score = realloc(ly->score, cap * sizeof *score);
        if (score != NULL)
            ly->score = score;
        float *added = realloc(ly->added, cap * sizeof *added);
        if (added != NULL)
            ly->added = added;
        if (pos == NULL || score == NULL || added == NULL)
            return -1;
        ly->cap = (uint32_t)cap;
    }
    if (keys && n > ly->scratch_cap) {
        uint64_t *k = realloc(ly->scratch, (size_t)n * sizeof *k);
        if (k == NULL)
            return -1;
        ly->scratch = k;
        ly->scratch_cap = n;
    }
    return 0;
}

/* What a step's pass found wrong with it. */
enum { FOLD_NOT_EXTENDING = 1, FOLD_NOT_FINITE = 2 };

/*
 * The step's pass over n entries that stay where they are: each sum folds
 * in the last step's attention (with_added), the step's (s, taken and
 * checked) takes its place in added, and the view's positions are
 * compared with the tracked ones.
 */
POLICY_HOT static int fold_in_place(double *restrict score, float *restrict added,
                                    const uint32_t *restrict tracked, int with_added,
                                    const uint32_t *restrict pos, const float *restrict s,
                                    uint32_t n)
{
    uint32_t diff = 0;
    for (uint32_t i = 0; i < n; i++) {
        diff |= pos[i] ^ tracked[i];
        if (with_added)
            score[i] += (double)added[i];
        added[i] = s[i];
    }
    return diff != 0 ? FOLD_NOT_EXTENDING : 0;
}

/* The same for n entries of the tokens after the hole, each moved down one
 * entry (from entry i + 1 to i) as it is folded. */
POLICY_HOT static int fold_down(uint32_t *restrict tracked, double *restrict score,
                                float *restrict added, int with_added, const uint32_t *restrict pos,
                                const float *restrict s, uint32_t n)
{
    uint32_t diff = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = tracked[i + 1];
        double sum = with_added ? score[i + 1] + (double)added[i + 1] : score[i + 1];
        diff |= pos[i] ^ p;
        tracked[i] = p;
        score[i] = sum;
        added[i] = s[i];
    }
    return diff != 0 ? FOLD_NOT_EXTENDING : 0;
}

/* The n tokens appended since: a sum of -0.0, which adds to any value
 * exactly (x + -0.0 is x, signed zeros too), so that a new token's first
 * score is the step's value as it came; or, summed (a prompt's step,
 * which selects from the sums at once), that value itself. */
POLICY_HOT static void fold_new(uint32_t *restrict tracked, double *restrict score,
                                float *restrict added, int summed, const uint32_t *restrict pos,
                                const float *restrict s, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        tracked[i] = pos[i];
        if (summed) {
            score[i] = (double)s[i];
        } else {
            score[i] = -0.0;
            added[i] = s[i];
        }
    }
}

/* Entries a pass handles at a time: the step's values for them are taken
 * into L1 (policy_ops.stats_in_place) and checked, and the part of the
 * arrays the pass wrote is still there for the decode step's minimum. */
#define H2O_CHUNK 512u

/* What one pass does besides folding: how the tracked tokens are held
 * (entries [0, hole) in place, then moved down one over the hole, then
 * the new tokens from entry `tracked`), and, for a decode step, the
 * candidates [cand_from, cand_to) whose least sum it finds (min). */
typedef struct fold_pass {
    int with_added, new_summed;
    uint32_t hole, tracked;
    uint32_t cand_from, cand_to;
    policy_min_sum *min;
} fold_pass;

/* Entries [from, to) of the pass; s: the step's values for them, taken. */
static int fold_chunk(h2o_layer *ly, const fold_pass *fp, const uint32_t *pos, const float *s,
                      uint32_t from, uint32_t to)
{
    int wrong = 0;
    uint32_t a = from, b = to < fp->hole ? to : fp->hole;
    if (a < b)
        wrong |= fold_in_place(ly->score + a, ly->added + a, ly->pos + a, fp->with_added, pos + a,
                               s, b - a);
    a = from > fp->hole ? from : fp->hole, b = to < fp->tracked ? to : fp->tracked;
    if (a < b)
        wrong |= fold_down(ly->pos + a, ly->score + a, ly->added + a, fp->with_added, pos + a,
                           s + (a - from), b - a);
    a = from > fp->tracked ? from : fp->tracked;
    if (a < to)
        fold_new(ly->pos + a, ly->score + a, ly->added + a, fp->new_summed, pos + a, s + (a - from),
                 to - a);
    a = from > fp->cand_from ? from : fp->cand_from, b = to < fp->cand_to ? to : fp->cand_to;
    if (fp->min != NULL && a < b)
        policy_min_sum_offer(fp->min, ly->score, ly->added, a, b);
    return wrong;
}

/*
 * The step's one pass over a view of n >= ly->n tokens (room reserved):
 * the tracked tokens' sums folded and the hole closed, whatever the pass
 * finds (the sums stay what they were), then the step's attention kept
 * as added when the view extends the tracked tokens and is finite. With
 * new_summed the new tokens' entries hold their sums instead (their added
 * is not written): the caller adds the tracked ones' at once. A new
 * token's entry counts only once the pass succeeds. With min, the least
 * of the candidates' sums [cand_from, cand_to) is found on the way; *bad:
 * the first value not finite, if any.
 */
static int layer_fold(h2o_layer *ly, const uint32_t *pos, const float *s, uint32_t n,
                      int new_summed, uint32_t cand_from, uint32_t cand_to, policy_min_sum *min,
                      size_t *bad)
{
    fold_pass fp = {.with_added = ly->has_added,
                    .new_summed = new_summed,
                    .hole = ly->has_hole ? ly->hole : ly->n,
                    .tracked = ly->n,
                    .cand_from = cand_from,
                    .cand_to = cand_to,
                    .min = min};
    int wrong = 0;
    float taken[H2O_CHUNK];
    for (uint32_t c = 0; c < n; c += H2O_CHUNK) {
        uint32_t to = n - c < H2O_CHUNK ? n : c + H2O_CHUNK;
        size_t at = policy_copy_first_outside(taken, s + c, to - c, -FLT_MAX);
        if (at < to - c && !(wrong & FOLD_NOT_FINITE)) {
            wrong |= FOLD_NOT_FINITE;
            *bad = c + at;
        }
        wrong |= fold_chunk(ly, &fp, pos, taken, c, to);
    }
    ly->has_hole = 0;
    ly->has_added = wrong == 0;
    if (wrong == 0)
        ly->n = n;
    return wrong;
}

/* Before a step changes the sums save() found (a second step in the
 * transaction, a prefill's compaction): a copy of them, unless taken.
 * Folded, they are the arrays' first n entries; else as the layer holds
 * them now (no step since). -1 when out of memory, nothing changed. */
static int saved_copy(h2o_saved *c)
{
    if (c->score != NULL)
        return 0;
    const h2o_layer *ly = c->ly;
    size_t n = c->n ? c->n : 1;
    uint32_t *pos = malloc(n * sizeof *pos);
    double *score = malloc(n * sizeof *score);
    if (pos == NULL || score == NULL) {
        free(pos);
        free(score);
        return -1;
    }
    for (uint32_t i = 0; i < c->n; i++) {
        uint32_t e = c->folded ? i : layer_entry(ly, i);
        pos[i] = ly->pos[e];
        score[i] = c->folded ? ly->score[e] : entry_score(ly, e);
    }
    c->pos = pos, c->score = score;
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
    int many = n > st->budget + 1; /* a selection, then a compaction */
    h2o_saved *c = ly->saved;
    uint32_t entries = ly->n + (uint32_t)ly->has_hole;
    if (n >= ly->n && (layer_reserve(ly, n > entries ? n : entries, many) != 0 ||
                       (c != NULL && (c->folded || many) && saved_copy(c) != 0))) {
        snprintf(err, errlen, "h2o: out of memory for %u tokens", n);
        return -1;
    }
    if (c != NULL && n >= ly->n)
        c->folded = 1; /* from here on the sums are held folded */
    /* Candidates: neither a sink nor among the `recent` newest; positions
     * ascend, so they are the indices [first, first_recent). A decode step
     * (one over budget) finds the least sum among them in its pass. */
    uint32_t first_recent = n > st->recent ? n - st->recent : 0, first = 0;
    while (first < first_recent && pos[first] < st->sinks)
        first++;
    policy_min_sum min = {0};
    int decode = n == st->budget + 1 && first < first_recent;
    uint32_t tracked = ly->n;
    size_t bad = n;
    int wrong = n < ly->n ? FOLD_NOT_EXTENDING
                          : layer_fold(ly, pos, stats->score, n, many, first, first_recent,
                                       decode ? &min : NULL, &bad);
    if (wrong & FOLD_NOT_EXTENDING) {
        snprintf(err, errlen,
                 "h2o: layer %u view (%u tokens) does not extend the %u tokens the policy "
                 "tracks (was a decision not applied?)",
                 view->layer, n, ly->n);
        return -1;
    }
    if (wrong & FOLD_NOT_FINITE)
        return policy_stats_refused(err, errlen, "h2o", view->layer, bad);
    if (n <= st->budget) {
        policy_decision_span(d, 0, 0, 0);
        return 0;
    }
    /* Evict the lowest scores first, ties to the lower index. */
    uint32_t m = first_recent - first;
    uint32_t k = n - st->budget;
    if (k > m)
        k = m;    /* cannot happen: recent + sinks <= budget */
    if (decode) { /* k == 1: the victim stays in the arrays as their hole */
        uint32_t v = (uint32_t)policy_min_sum_first(&min, ly->score, ly->added);
        policy_evict_one(d, 0, v);
        ly->n = n - 1, ly->has_hole = 1, ly->hole = v;
        return 0;
    }
    if (many) { /* k > 1: recent + sinks <= budget */
        double *restrict sc = ly->score;
        for (uint32_t i = 0; i < tracked; i++) /* the sums, to select from (saved_copy above) */
            sc[i] += (double)ly->added[i];
        ly->has_added = 0;
        const double *cand = sc + first;
        policy_score_keys kd = {1.0, NULL, 0};
        policy_cut cut = policy_select_cut_rows(&cand, &m, 1, &kd, k, ly->scratch);
        uint8_t *evict = (uint8_t *)ly->scratch; /* the keys are spent: m bytes of room */
        policy_cut_mark(&cut, sc + first, 1.0, NULL, 1, m, 0, evict);
        policy_evict_marked(d->tier[0] + first, evict, 1, m);
        policy_decision_span(d, 0, first, first + m);
        /* Compact the per-token state exactly as the host compacts the
         * list, token by token without a branch (a prefill evicts
         * thousands). */
        uint32_t out = 0;
        uint32_t *restrict p = ly->pos;
        for (uint32_t i = 0; i < n; i++) {
            p[out] = p[i];
            sc[out] = sc[i];
            out += d->tier[0][i] != POLICY_EVICT;
        }
        ly->n = out;
    }
    return 0;
}

/* ops->save: how the layer holds its sums now; its next step folds them
 * in place without changing them (no copy). */
static int h2o_save(void *state, uint32_t layer, void **saved)
{
    h2o_state *st = state;
    h2o_layer *ly = &st->ly[layer];
    h2o_saved *c = calloc(1, sizeof *c);
    if (c == NULL) {
        errno = ENOMEM;
        return -1;
    }
    *c = (h2o_saved){ly, ly->n, ly->hole, ly->has_added, ly->has_hole, 0, NULL, NULL};
    ly->saved = c;
    *saved = c;
    return 0;
}

static void h2o_restore(void *state, uint32_t layer, void *saved)
{
    (void)state, (void)layer;
    h2o_saved *c = saved;
    h2o_layer *ly = c->ly;
    ly->n = c->n;
    if (c->score != NULL) { /* a step changed them: the copy goes back (room never shrinks) */
        memcpy(ly->pos, c->pos, (size_t)c->n * sizeof *ly->pos);
        memcpy(ly->score, c->score, (size_t)c->n * sizeof *ly->score);
    }
    if (c->folded) {
        ly->has_added = 0, ly->has_hole = 0;
    } else {
        ly->has_added = c->has_added, ly->has_hole = c->has_hole, ly->hole = c->hole;
    }
    ly->saved = NULL;
    free(c->pos);
    free(c->score);
    free(c);
}

static void h2o_discard(void *saved)
{
    h2o_saved *c = saved;
    if (c == NULL)
        return;
    if (c->ly->saved == c)
        c->ly->saved = NULL;
    free(c->pos);
    free(c->score);
    free(c);
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
        uint32_t e = layer_entry(ly, i);
        policy_put_le(pos + (size_t)i * 4, ly->pos[e], 4);
        policy_put_le(score + (size_t)i * 8, policy_f64_bits(entry_score(ly, e)), 8);
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
    h2o_layer ly = {.n = n, .cap = n};
    ly.pos = policy_array_copy(NULL, 0, n, sizeof *ly.pos);
    ly.score = policy_array_copy(NULL, 0, n, sizeof *ly.score);
    ly.added = policy_array_copy(NULL, 0, n, sizeof *ly.added);
    if (!ly.pos || !ly.score || !ly.added) {
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
        policy_text_add(&t, "%s%u", i ? "," : "", ly->pos[layer_entry(ly, i)]);
    policy_text_add(&t, "],\"score\":[");
    for (uint32_t i = 0; i < ly->n; i++)
        policy_text_add(&t, "%s%.9g", i ? "," : "", entry_score(ly, layer_entry(ly, i)));
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
    .layers_concurrent = 1,
    .stats_in_place = 1,
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
