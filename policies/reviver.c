/*
 * reviver.c - policy "reviver": KVReviver (arXiv 2512.17917, POLICIES.md
 * §3), reversible compression into a per-layer count-sketch.
 *
 * Per layer three stores over every token ever seen: Recent (FIFO, budget
 * R_b plus slack), Candidate (budget C_b, minimum accumulated score leaves
 * first) and Vague (the sketch). Each step adds the step's attention to the
 * accumulated score of every token, sketched ones included (§3.4), and runs
 * compress (§3.5, reviver_compress() in reviver.h). Tiers: Recent and
 * Candidate tokens are POLICY_FULL, Vague tokens POLICY_SKETCH; a swap-back
 * turns a SKETCH token FULL again, and the daemon stores its sketch
 * estimate as its K/V ("revived lossy"). Nothing is ever evicted; the
 * operations' order is in reviver_layer_ops() (see reviver.h).
 *
 * Budgets ([RECON] default M = 256; shares per [S2] Tables 2-3):
 *   R_b = int(recent_share·M), C_b = int(candidate_share·M) (double, then
 *   truncated toward zero), b = buckets or max(1, round(vague_share·M / r))
 *   (round half away from zero), slack = min(32, R_b) unless given.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "describe.h"
#include "reviver.h"
#include "util.h"
/* The seed derivation only (pure integer functions); see the header. */
#include "../kernels/sketch_hash.h"

#define REVIVER_MAX 1048576u

/* How a row's cell becomes that row's estimate (§3.8); the kernels'
 * kv_estimate has the same values. */
typedef enum reviver_estimate {
    REVIVER_ESTIMATE_SUM = 0,  /* the cell itself, as [S2] Alg. 2 */
    REVIVER_ESTIMATE_MEAN = 1, /* the cell divided by the bucket's token count */
} reviver_estimate;

/* ---- §3.5 compress ---- */

/* A binary heap of token indices: the candidates' (minimum on top) or the
 * vague tokens' (maximum on top). */
typedef struct heap {
    uint32_t *a;
    uint32_t n;
    const double *score;
    int vague;
} heap;

/* Candidate: the minimum score on top, ties to the smaller (older) index. */
static int c_before(const double *s, uint32_t x, uint32_t y)
{
    return s[x] < s[y] || (s[x] == s[y] && x < y);
}

/* Vague: the maximum score on top, ties to the smaller index. */
static int v_before(const double *s, uint32_t x, uint32_t y)
{
    return s[x] > s[y] || (s[x] == s[y] && x < y);
}

/* The heap's order, inlined into its loops: a call through a pointer for
 * each comparison was a tenth of a decode step's time at 32k tokens. */
static inline int heap_before(const heap *hp, uint32_t x, uint32_t y)
{
    return hp->vague ? v_before(hp->score, x, y) : c_before(hp->score, x, y);
}

static void heap_down(heap *hp, uint32_t i)
{
    for (;;) {
        uint32_t best = i, l = 2 * i + 1, r = 2 * i + 2;
        if (l < hp->n && heap_before(hp, hp->a[l], hp->a[best]))
            best = l;
        if (r < hp->n && heap_before(hp, hp->a[r], hp->a[best]))
            best = r;
        if (best == i)
            return;
        uint32_t t = hp->a[i];
        hp->a[i] = hp->a[best];
        hp->a[best] = t;
        i = best;
    }
}

static void heap_build(heap *hp)
{
    for (uint32_t i = hp->n / 2; i-- > 0;)
        heap_down(hp, i);
}

static uint32_t heap_pop(heap *hp)
{
    uint32_t top = hp->a[0];
    hp->a[0] = hp->a[--hp->n];
    heap_down(hp, 0);
    return top;
}

static void heap_push(heap *hp, uint32_t x)
{
    uint32_t i = hp->n++;
    hp->a[i] = x;
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!heap_before(hp, hp->a[i], hp->a[p]))
            break;
        uint32_t t = hp->a[i];
        hp->a[i] = hp->a[p];
        hp->a[p] = t;
        i = p;
    }
}

/* A heap over the tokens of one store (REVIVER_CANDIDATE or _VAGUE). */
static heap heap_of(const uint8_t *loc, uint32_t n, uint8_t which, const double *score,
                    uint32_t *mem)
{
    heap hp = {mem, 0, score, which == REVIVER_VAGUE};
    for (uint32_t i = 0; i < n; i++)
        if (loc[i] == which)
            hp.a[hp.n++] = i;
    heap_build(&hp);
    return hp;
}

static int log_op(reviver_op *ops, size_t cap, size_t *nops, uint32_t index, uint32_t kind)
{
    if (*nops >= cap)
        return -1;
    ops[*nops].index = index;
    ops[*nops].kind = kind;
    (*nops)++;
    return 0;
}

int reviver_compress(const reviver_budgets *b, uint32_t n, uint32_t new_tokens, const double *score,
                     uint8_t *loc, uint32_t *scratch, reviver_op *ops, size_t ops_cap, size_t *nops)
{
    *nops = 0;
    /* 1. R.push(T) */
    for (uint32_t i = n - new_tokens; i < n; i++)
        loc[i] = REVIVER_RECENT;
    uint32_t recent = 0;
    for (uint32_t i = 0; i < n; i++)
        recent += loc[i] == REVIVER_RECENT;
    /* 2. spill the |R| - R_b oldest to C, in age order (64-bit: no wrap). */
    if ((uint64_t)recent > (uint64_t)b->recent + b->slack) {
        uint32_t move = recent - b->recent;
        for (uint32_t i = 0; i < n && move > 0; i++)
            if (loc[i] == REVIVER_RECENT) {
                loc[i] = REVIVER_CANDIDATE;
                move--;
            }
    }
    /* 3. while |C| > C_b: V.insert(C.pop_min()) */
    heap c = heap_of(loc, n, REVIVER_CANDIDATE, score, scratch);
    while (c.n > b->candidate) {
        uint32_t j = heap_pop(&c);
        loc[j] = REVIVER_VAGUE;
        if (log_op(ops, ops_cap, nops, j, REVIVER_OP_SKETCH) != 0)
            return -1;
    }
    if (c.n == 0)
        return 0;
    /* 4. the swap loop; guard is the [RECON] safety cap of §3.5. */
    heap v = heap_of(loc, n, REVIVER_VAGUE, score, scratch + n);
    uint64_t guard = (uint64_t)c.n + v.n;
    while (c.n > 0 && v.n > 0 && guard > 0 && score[c.a[0]] * b->replace_rate < score[v.a[0]]) {
        guard--;
        uint32_t jv = heap_pop(&v);
        uint32_t jc = heap_pop(&c);
        if (log_op(ops, ops_cap, nops, jv, REVIVER_OP_REVIVE) != 0 ||
            log_op(ops, ops_cap, nops, jc, REVIVER_OP_SKETCH) != 0)
            return -1;
        loc[jv] = REVIVER_CANDIDATE;
        loc[jc] = REVIVER_VAGUE;
        heap_push(&v, jc);
        heap_push(&c, jv);
    }
    return 0;
}

/* ---- the policy ---- */

typedef struct reviver_layer {
    uint32_t n, cap;
    uint32_t *pos;     /* original positions, for describe */
    double *score;     /* accumulated score (§3.4) */
    uint8_t *loc;      /* reviver_loc */
    uint32_t *scratch; /* 2·cap: the two heaps */
    reviver_op *ops;   /* cap: the last step's operations */
    size_t nops;
} reviver_layer;

typedef struct reviver_state {
    reviver_budgets budgets;
    uint32_t budget, rows, buckets;
    uint64_t seed;
    reviver_estimate key_estimate, value_estimate;
    uint32_t layers;
    reviver_layer *ly;
} reviver_state;

static const char *const estimate_names[] = {"sum", "mean", NULL};

/* The parameters as parsed (policy_params_parse); reviver_config() checks
 * them together. slack = REVIVER_SLACK_DERIVED stands for -1. */
typedef struct reviver_parsed {
    uint32_t budget, rows, buckets, slack, seed;
    double vague_share, candidate_share, recent_share, replace_rate;
    unsigned key_estimate, value_estimate;
} reviver_parsed;

#define REVIVER_SLACK_DERIVED UINT32_MAX
#define RV_U32(k, d, h, lo, hi, f) POLICY_PARAM_U32(k, d, h, lo, hi, offsetof(reviver_parsed, f))
#define RV_F64(k, d, h, lo, hi, f) POLICY_PARAM_F64(k, d, h, lo, hi, offsetof(reviver_parsed, f))

static const policy_param_spec reviver_params[] = {
    RV_U32("budget", "256",
           "per-layer token budget M shared by Recent, Candidate and the sketch's r·b slots, "
           "1..1048576 ([RECON] default; POLICIES.md §3.1)",
           1, REVIVER_MAX, budget),
    RV_F64("vague_share", "0.1",
           "share of M for the sketch (Vague), (0, 1] (§3.1, [S2] Tables 2-3)", 0, 1, vague_share),
    RV_F64("candidate_share", "0.45", "share of M for Candidate: C_b = int(share·M), [0, 1] (§3.1)",
           0, 1, candidate_share),
    RV_F64("recent_share", "0.45",
           "share of M for Recent: R_b = int(share·M), [0, 1]; the three shares sum to 1 (§3.1)", 0,
           1, recent_share),
    RV_U32("rows", "3", "sketch rows r (hash functions), 1..32 (§3.1, [S2])", 1, REVIVER_MAX_ROWS,
           rows),
    RV_U32("buckets", "0",
           "sketch buckets per row b, 0..1048576; 0 = max(1, round(vague_share·M / r)) (§3.1)", 0,
           REVIVER_MAX, buckets),
    POLICY_PARAM_U32_OR(
        "slack", "-1",
        "Recent spills when it holds more than R_b + slack; -1 = min(32, R_b) ([RECON] "
        "§3.5), 0 = spill every step, up to 1048576",
        0, REVIVER_MAX, offsetof(reviver_parsed, slack), "-1", REVIVER_SLACK_DERIVED),
    RV_F64("replace_rate", "1.1",
           "swap a sketched token back when min_C·replace_rate < max_V, [1, 1e6] (§3.5, [S2])", 1.0,
           1e6, replace_rate),
    POLICY_PARAM_ONE_OF("key_estimate", "sum",
                        "sum = the paper's bucket-sum keys (§3.3); mean = bucket sum / bucket "
                        "count (§3.8); the quality benchmark decides the default",
                        estimate_names, offsetof(reviver_parsed, key_estimate)),
    POLICY_PARAM_ONE_OF("value_estimate", "sum",
                        "sum (signed bucket sums, §3.3) or mean (divided by count, §3.8)",
                        estimate_names, offsetof(reviver_parsed, value_estimate)),
    RV_U32("seed", "0",
           "base of the per-layer hash seeds (kv_sketch_layer_seed), 0..4294967295 (§3.2)", 0,
           UINT32_MAX, seed),
};

static void layer_free(reviver_layer *ly)
{
    free(ly->pos);
    free(ly->score);
    free(ly->loc);
    free(ly->scratch);
    free(ly->ops);
}

static void reviver_destroy(void *state)
{
    reviver_state *st = state;
    if (st == NULL)
        return;
    for (uint32_t l = 0; st->ly != NULL && l < st->layers; l++)
        layer_free(&st->ly[l]);
    free(st->ly);
    free(st);
}

/* Parse and cross-check every parameter into *c (no allocation). */
static int reviver_config(const policy_params *p, reviver_state *c, char *err, size_t errlen)
{
    reviver_parsed r;
    if (policy_params_parse(p, reviver_params, sizeof reviver_params / sizeof reviver_params[0], &r,
                            err, errlen) != 0)
        return -1;
    double vs = r.vague_share, cs = r.candidate_share, rs = r.recent_share;
    if (fabs(vs + cs + rs - 1.0) > 1e-6) {
        snprintf(err, errlen,
                 "parameters vague_share + candidate_share + recent_share must sum to 1 "
                 "(within 1e-6), got %g + %g + %g = %.9g",
                 vs, cs, rs, vs + cs + rs);
        return -1;
    }
    /* §3.6: b = 0 or r = 0 means no Vague part (H2O); rejected. */
    if (vs <= 0) {
        snprintf(err, errlen,
                 "parameter vague_share must be > 0: without a sketch KVReviver degenerates to "
                 "H2O (POLICIES.md §3.6; use policy h2o)");
        return -1;
    }
    c->budget = r.budget;
    c->rows = r.rows;
    c->buckets = r.buckets;
    c->budgets.recent = (uint32_t)(rs * (double)c->budget);
    c->budgets.candidate = (uint32_t)(cs * (double)c->budget);
    c->budgets.replace_rate = r.replace_rate;
    if (c->buckets == 0) {
        double derived = round(vs * (double)c->budget / (double)c->rows);
        c->buckets = derived < 1 ? 1 : (uint32_t)derived;
    }
    c->budgets.slack = r.slack != REVIVER_SLACK_DERIVED ? r.slack
                       : c->budgets.recent < 32         ? c->budgets.recent
                                                        : 32;
    c->seed = r.seed;
    c->key_estimate = r.key_estimate == 1 ? REVIVER_ESTIMATE_MEAN : REVIVER_ESTIMATE_SUM;
    c->value_estimate = r.value_estimate == 1 ? REVIVER_ESTIMATE_MEAN : REVIVER_ESTIMATE_SUM;
    return 0;
}

static int reviver_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                          size_t errlen)
{
    *state = NULL;
    reviver_state c;
    memset(&c, 0, sizeof c);
    if (reviver_config(p, &c, err, errlen) != 0)
        return -1;
    reviver_state *st = malloc(sizeof *st);
    if (st == NULL)
        goto oom;
    *st = c;
    st->layers = g->layers;
    st->ly = calloc(g->layers ? g->layers : 1, sizeof *st->ly);
    if (st->ly == NULL)
        goto oom;
    *state = st;
    return 0;
oom:
    reviver_destroy(st);
    snprintf(err, errlen, "out of memory creating policy 'reviver'");
    return -1;
}

static int layer_reserve(reviver_layer *ly, uint32_t need)
{
    if (need <= ly->cap)
        return 0;
    uint64_t cap64 = ly->cap ? ly->cap : 64;
    while (cap64 < need)
        cap64 *= 2;
    if (cap64 > UINT32_MAX / 2)
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
    uint8_t *loc = realloc(ly->loc, cap);
    if (loc == NULL)
        return -1;
    ly->loc = loc;
    uint32_t *scratch = realloc(ly->scratch, 2 * cap * sizeof *scratch);
    if (scratch == NULL)
        return -1;
    ly->scratch = scratch;
    reviver_op *ops = realloc(ly->ops, cap * sizeof *ops);
    if (ops == NULL)
        return -1;
    ly->ops = ops;
    ly->cap = (uint32_t)cap;
    return 0;
}

/* Everything step() checks before it changes any state. */
static int step_check(const reviver_state *st, const policy_layer_view *view,
                      const policy_stats *stats, char *err, size_t errlen)
{
    if (view->layer >= st->layers || view->heads != 1) {
        snprintf(err, errlen, "reviver: bad view (layer %u of %u, %u lists; expected 1)",
                 view->layer, st->layers, view->heads);
        return -1;
    }
    if (stats->score == NULL) {
        snprintf(err, errlen, "reviver needs stats.score (POLICY_NEEDS_SCORE), got none");
        return -1;
    }
    /* The view must extend what the policy tracks: the same positions,
     * then the tokens appended since (this step's new tokens). The view's
     * tiers are not checked: a daemon that cannot move a token to the
     * sketch yet keeps it FULL, and the policy's stores stay the truth. */
    const reviver_layer *ly = &st->ly[view->layer];
    uint32_t n = view->tokens[0];
    if (n < ly->n ||
        (ly->n > 0 && memcmp(view->positions[0], ly->pos, (size_t)ly->n * sizeof *ly->pos) != 0)) {
        snprintf(err, errlen,
                 "reviver: layer %u view (%u tokens) does not extend the %u tokens the policy "
                 "tracks (was a decision not applied?)",
                 view->layer, n, ly->n);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        float s = stats->score[i];
        if (!isfinite(s) || s < 0) {
            snprintf(err, errlen, "reviver: stats.score[%u] = %g, must be finite and >= 0", i,
                     (double)s);
            return -1;
        }
    }
    return 0;
}

static int reviver_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                        policy_decision *d, char *err, size_t errlen)
{
    reviver_state *st = state;
    if (step_check(st, view, stats, err, errlen) != 0)
        return -1;
    reviver_layer *ly = &st->ly[view->layer];
    uint32_t n = view->tokens[0];
    if (layer_reserve(ly, n) != 0) {
        snprintf(err, errlen, "reviver: out of memory for %u tokens", n);
        return -1;
    }
    /* Every token the policy has not seen yet is new: stats.new_tokens may
     * count fewer when tokens were appended without a step in between. */
    uint32_t fresh = n - ly->n;
    for (uint32_t i = ly->n; i < n; i++) {
        ly->score[i] = 0;
        ly->loc[i] = REVIVER_RECENT;
        ly->pos[i] = view->positions[0][i];
    }
    /* §3.4: every token, sketched ones included, accumulates this step. */
    for (uint32_t i = 0; i < n; i++)
        ly->score[i] += (double)stats->score[i];
    ly->n = n;
    if (reviver_compress(&st->budgets, n, fresh, ly->score, ly->loc, ly->scratch, ly->ops, ly->cap,
                         &ly->nops) != 0) {
        /* Unreachable: replace_rate >= 1 and scores >= 0 bound the ops by n. */
        snprintf(err, errlen, "reviver: internal error (operation log overflow)");
        return -1;
    }
    for (uint32_t i = 0; i < n; i++)
        d->tier[0][i] = ly->loc[i] == REVIVER_VAGUE ? POLICY_SKETCH : POLICY_FULL;
    /* The heaps are done with their scratch: it carries the ops' order to
     * the daemon until the next step (reviver_tier_order). */
    for (size_t i = 0; i < ly->nops; i++)
        ly->scratch[i] = ly->ops[i].index;
    return 0;
}

/* ops->save: the stores, scores and the last step's operations with their
 * order (scratch[0..nops): tier_order() and describe() read them), in
 * arrays sized for exactly n tokens (the copy's cap; nops <= n, reviver
 * never evicts), so that restore() only swaps. */
static int reviver_save(void *state, uint32_t layer, void **saved)
{
    const reviver_state *st = state;
    const reviver_layer *ly = &st->ly[layer];
    reviver_layer *c = calloc(1, sizeof *c);
    if (c != NULL) {
        c->n = c->cap = ly->n;
        c->nops = ly->nops;
        c->pos = policy_array_copy(ly->pos, ly->n, ly->n, sizeof *ly->pos);
        c->score = policy_array_copy(ly->score, ly->n, ly->n, sizeof *ly->score);
        c->loc = policy_array_copy(ly->loc, ly->n, ly->n, sizeof *ly->loc);
        c->scratch =
            policy_array_copy(ly->scratch, ly->nops, 2 * (size_t)ly->n, sizeof *ly->scratch);
        c->ops = policy_array_copy(ly->ops, ly->nops, ly->n, sizeof *ly->ops);
    }
    if (c == NULL || !c->pos || !c->score || !c->loc || !c->scratch || !c->ops) {
        if (c != NULL)
            layer_free(c);
        free(c);
        errno = ENOMEM;
        return -1;
    }
    *saved = c;
    return 0;
}

static void reviver_restore(void *state, uint32_t layer, void *saved)
{
    reviver_state *st = state;
    layer_free(&st->ly[layer]);
    st->ly[layer] = *(reviver_layer *)saved;
    free(saved);
}

static void reviver_discard(void *saved)
{
    if (saved != NULL)
        layer_free(saved);
    free(saved);
}

/* ---- moving a sequence (ops->export_layer / import_layer) ---------------
 *
 * A layer's state as bytes, little-endian, version 1:
 *   0  "rviv", then the version byte (1)
 *   5  the echo, what the bytes were written for, checked against the
 *      importing state (same parameters and geometry, as policy.h
 *      requires): u32 layer, layers, budget M, R_b, slack, C_b;
 *      u64 replace_rate's bits; u32 rows, buckets; u64 seed;
 *      u8 key_estimate, value_estimate (0 sum, 1 mean)
 *  55  u32 n, the tracked tokens; u32 nops, the last step's operations
 *  63  n x u32 original positions, strictly ascending
 *      n x u64 accumulated scores, each a double's IEEE bits (finite, >= 0)
 *      n x u8 store (reviver_loc)
 *      nops x u32 operation's token index (< n), nops x u8 its kind
 * That is what save() copies: step() reads the positions, scores and
 * stores; describe() and tier_order() read the operations (tier_order's
 * array is the operations' indices, rebuilt on import). Everything else
 * (budgets, sketch geometry) comes from create(); reviver has no state
 * that is not per layer. Import also refuses stores and operations that
 * no step could have left (Recent not the newest tokens, a store over its
 * budget, a swap step 4 would still make, a token moved twice). */

#define RV_STATE_VERSION 1
#define RV_STATE_ECHO 12
#define RV_STATE_HEAD 63   /* magic, version, echo (50 bytes), n, nops */
#define RV_STATE_TOKEN 13u /* position, score, store */
#define RV_STATE_OP 5u     /* index, kind */

typedef struct rv_echo {
    const char *name;
    uint64_t value;
    unsigned width; /* bytes */
    int f64;        /* value holds a double's bits */
} rv_echo;

static void state_echo(const reviver_state *st, uint32_t layer, rv_echo e[RV_STATE_ECHO])
{
    const rv_echo all[RV_STATE_ECHO] = {
        {"layer", layer, 4, 0},
        {"layers", st->layers, 4, 0},
        {"budget", st->budget, 4, 0},
        {"recent budget", st->budgets.recent, 4, 0},
        {"slack", st->budgets.slack, 4, 0},
        {"candidate budget", st->budgets.candidate, 4, 0},
        {"replace_rate", policy_f64_bits(st->budgets.replace_rate), 8, 1},
        {"rows", st->rows, 4, 0},
        {"buckets", st->buckets, 4, 0},
        {"seed", st->seed, 8, 0},
        {"key_estimate", (uint64_t)st->key_estimate, 1, 0},
        {"value_estimate", (uint64_t)st->value_estimate, 1, 0},
    };
    memcpy(e, all, sizeof all);
}

/* The exact byte count of a layer of n tokens and nops operations (64-bit:
 * no wrap for any pair of u32 counts). */
static uint64_t state_bytes(uint32_t n, uint32_t nops)
{
    return RV_STATE_HEAD + (uint64_t)n * RV_STATE_TOKEN + (uint64_t)nops * RV_STATE_OP;
}

static void *reviver_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const reviver_state *st = state;
    const reviver_layer *ly = &st->ly[layer];
    uint32_t nops = (uint32_t)ly->nops; /* <= n (reviver_compress) */
    size_t total = (size_t)state_bytes(ly->n, nops);
    uint8_t *b = malloc(total);
    if (b == NULL)
        return NULL;
    memcpy(b, "rviv", 4);
    uint8_t *p = policy_put_le(b + 4, RV_STATE_VERSION, 1);
    rv_echo e[RV_STATE_ECHO];
    state_echo(st, layer, e);
    for (int i = 0; i < RV_STATE_ECHO; i++)
        p = policy_put_le(p, e[i].value, e[i].width);
    p = policy_put_le(p, ly->n, 4);
    p = policy_put_le(p, nops, 4);
    for (uint32_t i = 0; i < ly->n; i++)
        p = policy_put_le(p, ly->pos[i], 4);
    for (uint32_t i = 0; i < ly->n; i++)
        p = policy_put_le(p, policy_f64_bits(ly->score[i]), 8);
    for (uint32_t i = 0; i < ly->n; i++)
        p = policy_put_le(p, ly->loc[i], 1);
    for (uint32_t i = 0; i < nops; i++)
        p = policy_put_le(p, ly->ops[i].index, 4);
    for (uint32_t i = 0; i < nops; i++)
        p = policy_put_le(p, ly->ops[i].kind, 1);
    *len = total;
    return b;
}

/* The header of layer's bytes against st; *n and *nops receive the
 * counts, which the exact length then confirms. */
static int state_head_check(const reviver_state *st, uint32_t layer, const uint8_t *b, size_t len,
                            uint32_t *n, uint32_t *nops, char *err, size_t errlen)
{
    if (len < RV_STATE_HEAD) {
        policy_set_err(err, errlen, "reviver state: %zu bytes are shorter than its %d-byte header",
                       len, RV_STATE_HEAD);
        return -1;
    }
    if (memcmp(b, "rviv", 4) != 0) {
        policy_set_err(err, errlen, "reviver state: bad magic (not reviver's layer state)");
        return -1;
    }
    if (b[4] != RV_STATE_VERSION) {
        policy_set_err(err, errlen, "reviver state: version %u, this build reads version %d",
                       (unsigned)b[4], RV_STATE_VERSION);
        return -1;
    }
    rv_echo e[RV_STATE_ECHO];
    state_echo(st, layer, e);
    const uint8_t *p = b + 5;
    for (int i = 0; i < RV_STATE_ECHO; p += e[i].width, i++) {
        uint64_t v = policy_get_le(p, e[i].width);
        if (v == e[i].value)
            continue;
        if (e[i].f64)
            policy_set_err(err, errlen,
                           "reviver state: written for %s %.17g, this sequence has %.17g",
                           e[i].name, policy_bits_f64(v), policy_bits_f64(e[i].value));
        else
            policy_set_err(err, errlen,
                           "reviver state: written for %s %llu, this sequence has %llu", e[i].name,
                           (unsigned long long)v, (unsigned long long)e[i].value);
        return -1;
    }
    *n = (uint32_t)policy_get_le(p, 4);
    *nops = (uint32_t)policy_get_le(p + 4, 4);
    if (*nops > *n) {
        policy_set_err(err, errlen,
                       "reviver state: %u operations for %u tokens (a step moves a token at most "
                       "once)",
                       *nops, *n);
        return -1;
    }
    /* The one bound on n, checked before n sizes anything. */
    uint64_t want = state_bytes(*n, *nops);
    if ((uint64_t)len != want) {
        policy_set_err(err, errlen,
                       "reviver state: %zu bytes, but %u tokens and %u operations take exactly "
                       "%llu",
                       len, *n, *nops, (unsigned long long)want);
        return -1;
    }
    return 0;
}

/* Decode the tokens into ly (arrays of n) and check each: positions as a
 * host's list holds them (ascending, distinct), scores step() could have
 * summed (finite, >= 0), a store that exists. */
static int state_tokens_read(const uint8_t *p, reviver_layer *ly, char *err, size_t errlen)
{
    uint32_t n = ly->n;
    const uint8_t *pos = p, *score = pos + (size_t)n * 4, *loc = score + (size_t)n * 8;
    for (uint32_t i = 0; i < n; i++) {
        ly->pos[i] = (uint32_t)policy_get_le(pos + (size_t)i * 4, 4);
        ly->score[i] = policy_bits_f64(policy_get_le(score + (size_t)i * 8, 8));
        ly->loc[i] = loc[i];
        if (i > 0 && ly->pos[i] <= ly->pos[i - 1]) {
            policy_set_err(err, errlen, "reviver state: position of token %u does not ascend", i);
            return -1;
        }
        if (!isfinite(ly->score[i]) || ly->score[i] < 0) {
            policy_set_err(err, errlen,
                           "reviver state: score of token %u is %g, not finite and >= 0", i,
                           ly->score[i]);
            return -1;
        }
        if (ly->loc[i] > REVIVER_VAGUE) {
            policy_set_err(err, errlen,
                           "reviver state: store %u of token %u is not recent (0), candidate (1) "
                           "or vague (2)",
                           (unsigned)ly->loc[i], i);
            return -1;
        }
    }
    return 0;
}

/* The stores as compress (§3.5) leaves them: Recent is the newest tokens
 * (a FIFO: steps 1-2), at most R_b + slack of them; Candidate within C_b
 * (step 3); and no swap left that step 4 would make. */
static int state_stores_check(const reviver_state *st, const reviver_layer *ly, char *err,
                              size_t errlen)
{
    uint32_t count[3] = {0, 0, 0};
    uint32_t c_min = UINT32_MAX, v_max = UINT32_MAX;
    for (uint32_t i = 0; i < ly->n; i++) {
        uint8_t s = ly->loc[i];
        if (i > 0 && ly->loc[i - 1] == REVIVER_RECENT && s != REVIVER_RECENT) {
            policy_set_err(err, errlen,
                           "reviver state: token %u is Recent but token %u after it is not (Recent "
                           "holds the newest tokens)",
                           i - 1, i);
            return -1;
        }
        count[s]++;
        if (s == REVIVER_CANDIDATE && (c_min == UINT32_MAX || c_before(ly->score, i, c_min)))
            c_min = i;
        if (s == REVIVER_VAGUE && (v_max == UINT32_MAX || v_before(ly->score, i, v_max)))
            v_max = i;
    }
    const reviver_budgets *b = &st->budgets;
    if ((uint64_t)count[REVIVER_RECENT] > (uint64_t)b->recent + b->slack) {
        policy_set_err(err, errlen, "reviver state: Recent holds %u tokens, over R_b %u + slack %u",
                       count[REVIVER_RECENT], b->recent, b->slack);
        return -1;
    }
    if (count[REVIVER_CANDIDATE] > b->candidate) {
        policy_set_err(err, errlen, "reviver state: Candidate holds %u tokens, over its budget %u",
                       count[REVIVER_CANDIDATE], b->candidate);
        return -1;
    }
    if (c_min != UINT32_MAX && v_max != UINT32_MAX &&
        ly->score[c_min] * b->replace_rate < ly->score[v_max]) {
        policy_set_err(err, errlen,
                       "reviver state: Candidate's minimum score %.9g x replace_rate %g is below "
                       "the sketch's maximum %.9g (a swap step 4 would have made)",
                       ly->score[c_min], b->replace_rate, ly->score[v_max]);
        return -1;
    }
    return 0;
}

/* Decode the operations into ly->ops and ly->scratch[0..nops) (the order
 * tier_order() hands out) and check them against the stores: each token
 * at most once, a SKETCH's token now in the sketch, a REVIVE's in
 * Candidate, in §3.5's order: step 3's SKETCHes, then (REVIVE, SKETCH)
 * pairs. ly->scratch[nops..nops+n) serves as the seen-marks. */
static int state_ops_read(const uint8_t *p, reviver_layer *ly, char *err, size_t errlen)
{
    uint32_t n = ly->n, nops = (uint32_t)ly->nops;
    uint32_t *seen = ly->scratch + nops; /* nops <= n: within the 2n */
    memset(seen, 0, (size_t)n * sizeof *seen);
    uint32_t swaps = UINT32_MAX; /* the first REVIVE's index */
    for (uint32_t i = 0; i < nops; i++) {
        uint32_t j = (uint32_t)policy_get_le(p + (size_t)i * 4, 4);
        uint32_t kind = p[(size_t)nops * 4 + i];
        ly->ops[i] = (reviver_op){j, kind};
        ly->scratch[i] = j;
        if (kind == REVIVER_OP_REVIVE && swaps == UINT32_MAX)
            swaps = i;
        uint32_t want =
            swaps == UINT32_MAX || (i - swaps) % 2 ? REVIVER_OP_SKETCH : REVIVER_OP_REVIVE;
        const char *bad = NULL;
        if (j >= n)
            bad = "indexes no token";
        else if (kind != want)
            bad = kind > REVIVER_OP_REVIVE ? "has no kind (0 sketch, 1 revive)"
                                           : "is out of order (step 3's sketches, then "
                                             "revive-sketch pairs)";
        else if (seen[j]++)
            bad = "moves a token a second time";
        else if (ly->loc[j] != (kind == REVIVER_OP_SKETCH ? REVIVER_VAGUE : REVIVER_CANDIDATE))
            bad = "left its token in the other store";
        if (bad != NULL) {
            policy_set_err(err, errlen, "reviver state: operation %u (token %u, kind %u) %s", i, j,
                           kind, bad);
            return -1;
        }
    }
    if (swaps != UINT32_MAX && (nops - swaps) % 2) {
        policy_set_err(err, errlen, "reviver state: the last revive has no sketch after it");
        return -1;
    }
    return 0;
}

/* Everything is checked and allocated before the layer is swapped in, so
 * a refusal leaves the state as it was. The arrays are sized for exactly
 * n tokens, as save() makes them. */
static int reviver_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                                size_t errlen)
{
    reviver_state *st = state;
    const uint8_t *b = buf;
    uint32_t n, nops;
    if (layer >= st->layers) {
        policy_set_err(err, errlen, "reviver state: layer %u of %u", layer, st->layers);
        return -1;
    }
    if (state_head_check(st, layer, b, len, &n, &nops, err, errlen) != 0)
        return -1;
    reviver_layer ly = {.n = n, .cap = n, .nops = nops};
    ly.pos = policy_array_copy(NULL, 0, n, sizeof *ly.pos);
    ly.score = policy_array_copy(NULL, 0, n, sizeof *ly.score);
    ly.loc = policy_array_copy(NULL, 0, n, sizeof *ly.loc);
    ly.scratch = policy_array_copy(NULL, 0, 2 * (size_t)n, sizeof *ly.scratch);
    ly.ops = policy_array_copy(NULL, 0, n, sizeof *ly.ops);
    if (!ly.pos || !ly.score || !ly.loc || !ly.scratch || !ly.ops) {
        policy_set_err(err, errlen, "reviver state: out of memory for %u tokens", n);
        goto fail;
    }
    const uint8_t *tokens = b + RV_STATE_HEAD, *ops = tokens + (size_t)n * RV_STATE_TOKEN;
    if (state_tokens_read(tokens, &ly, err, errlen) != 0 ||
        state_stores_check(st, &ly, err, errlen) != 0 || state_ops_read(ops, &ly, err, errlen) != 0)
        goto fail;
    layer_free(&st->ly[layer]);
    st->ly[layer] = ly;
    return 0;
fail:
    layer_free(&ly);
    return -1;
}

/* The layer's sketch: rows x buckets, hashed with the layer's seed
 * (kernels/sketch_hash.h), each half's estimate as configured (§3.8). */
static int reviver_sketch_geometry(const void *state, uint32_t layer, policy_sketch_geometry *out)
{
    const reviver_state *st = state;
    if (st == NULL || layer >= st->layers)
        return -1;
    *out = (policy_sketch_geometry){st->rows, st->buckets, kv_sketch_layer_seed(st->seed, layer),
                                    st->key_estimate == REVIVER_ESTIMATE_MEAN,
                                    st->value_estimate == REVIVER_ESTIMATE_MEAN};
    return 0;
}

static const uint32_t *reviver_tier_order(const void *state, uint32_t layer, size_t *n)
{
    const reviver_state *st = state;
    return reviver_layer_ops(state, layer, n) ? st->ly[layer].scratch : NULL;
}

const reviver_op *reviver_layer_ops(const void *state, uint32_t layer, size_t *n)
{
    const reviver_state *st = state;
    *n = 0;
    if (st == NULL || layer >= st->layers || st->ly[layer].nops == 0)
        return NULL;
    *n = st->ly[layer].nops;
    return st->ly[layer].ops;
}

/* The positions of one store, as a JSON array. */
static void describe_store(policy_text *t, const reviver_layer *ly, uint8_t which)
{
    int first = 1;
    policy_text_add(t, "[");
    for (uint32_t i = 0; i < ly->n; i++)
        if (ly->loc[i] == which) {
            policy_text_add(t, "%s%u", first ? "" : ",", ly->pos[i]);
            first = 0;
        }
    policy_text_add(t, "]");
}

static char *reviver_describe(void *state, uint32_t layer)
{
    const reviver_state *st = state;
    if (st == NULL || layer >= st->layers)
        return NULL;
    const reviver_layer *ly = &st->ly[layer];
    policy_text t = {0};
    policy_text_add(&t,
                    "{\"layer\":%u,\"recent_budget\":%u,\"slack\":%u,\"candidate_budget\":%u,"
                    "\"rows\":%u,\"buckets\":%u,\"layer_seed\":\"0x%016llx\","
                    "\"key_estimate\":\"%s\",\"value_estimate\":\"%s\",\"recent\":",
                    layer, st->budgets.recent, st->budgets.slack, st->budgets.candidate, st->rows,
                    st->buckets, (unsigned long long)kv_sketch_layer_seed(st->seed, layer),
                    estimate_names[st->key_estimate], estimate_names[st->value_estimate]);
    describe_store(&t, ly, REVIVER_RECENT);
    policy_text_add(&t, ",\"candidate\":");
    describe_store(&t, ly, REVIVER_CANDIDATE);
    policy_text_add(&t, ",\"vague\":");
    describe_store(&t, ly, REVIVER_VAGUE);
    policy_text_add(&t, ",\"score\":[");
    for (uint32_t i = 0; i < ly->n; i++)
        policy_text_add(&t, "%s%.9g", i ? "," : "", ly->score[i]);
    policy_text_add(&t, "],\"ops\":[");
    for (size_t i = 0; i < ly->nops; i++)
        policy_text_add(&t, "%s[\"%s\",%u]", i ? "," : "",
                        ly->ops[i].kind == REVIVER_OP_REVIVE ? "revive" : "sketch",
                        ly->pos[ly->ops[i].index]);
    policy_text_add(&t, "]}");
    return policy_text_finish(&t);
}

const policy_ops policy_reviver = {
    .name = "reviver",
    .summary = "KVReviver: per layer Recent FIFO + Candidate heavy hitters + count-sketch; "
               "sketched tokens can be swapped back (revived lossy)",
    .params = reviver_params,
    .nparams = sizeof(reviver_params) / sizeof(reviver_params[0]),
    .needs = POLICY_NEEDS_SCORE,
    .per_head = 0,
    .layers_concurrent = 1,
    .create = reviver_create,
    .step = reviver_step,
    .describe = reviver_describe,
    .destroy = reviver_destroy,
    .sketch_geometry = reviver_sketch_geometry,
    .tier_order = reviver_tier_order,
    .save = reviver_save,
    .restore = reviver_restore,
    .discard = reviver_discard,
    .export_layer = reviver_export_layer,
    .import_layer = reviver_import_layer,
};
