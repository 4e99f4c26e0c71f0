/*
 * confkv.c - policy "confkv": Conf-KV (arXiv 2605.24786; POLICIES.md §5).
 * Every formula is the POLICIES.md §5.2 reconstruction [RECON]; the pure
 * pieces live in confkv.h and are tested with the §5.6 vectors.
 *
 * Per layer (one token list for all heads, ops->per_head = 0) the policy
 * keeps one EMA e_i of attention mass per held token, in list order.
 * Each step (§5.3):
 *   1. m_i = mean over query heads of stats->last_attn (this step's last
 *      query); e_i ← γ·e_i + (1−γ)·m_i for every held token, a new token
 *      starting at e = 0 (§5.2). In prefill this is the prompt's last row,
 *      which is where the EMA starts (§5.3 [RECON]).
 *   2. Prefill: keep everything, change no tier (§5.3: the first decode
 *      step applies B_t, and with it the FP16 window).
 *   3. Decode: B_t = tight if stats->confidence >= τ else loose; B_l is B_t
 *      or its pyramidal share (§5.5, `pyramid`=1). If len > B_l, the W =
 *      `protect` newest tokens are protected, the rest are ranked (§5.2:
 *      min-max over those candidates) and the first len − B_l in (rank,
 *      step) order are evicted, older first on equal rank.
 *   4. Precision (§5.3/§5.4): of the retained tokens, the F = `fp16_window`
 *      newest keep their tier; every older one becomes POLICY_INT8 (already
 *      INT8 stays INT8: a token that re-enters the F newest because newer
 *      tokens were evicted is not promoted back, its FP16 value is gone).
 *
 * Generation step [RECON]: the paper keeps each token's "original position"
 * and "generation step" as metadata. A token's generation step is taken to be
 * its original position (view->positions): both grow by one per token, so
 * min-max normalised recency is the same whether prompt tokens share one
 * step or not, except that prompt tokens keep their order.
 */
#include "confkv.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "describe.h"
#include "select.h"
#include "util.h"

#define CONFKV_MAX 1048576u

typedef struct confkv_layer {
    double *ema; /* [n] EMA of attention mass, in list order */
    uint32_t n, cap;
    int decided;       /* a decode step ran on this layer */
    double confidence; /* of the last decode step */
    uint32_t budget;   /* B_l of the last decode step */
} confkv_layer;

/* A layer's scratch for its step, apart from confkv_layer (which save,
 * restore and import copy whole): the host may step layers at once. */
typedef struct confkv_scratch {
    double *rank;
    uint64_t *keys; /* the eviction's selection */
    uint32_t cap;
} confkv_scratch;

typedef struct confkv_state {
    confkv_config cfg;
    uint32_t layers, q_heads;
    confkv_layer *ly;
    confkv_scratch *scratch; /* [layers] */
} confkv_state;

static const char *const margin_modes[] = {"sigmoid", "tanh", NULL};

#define CONFKV_F64(k, d, h, lo, hi, field)                                                         \
    POLICY_PARAM_F64(k, d, h, lo, hi, offsetof(confkv_config, field))
#define CONFKV_U32(k, d, h, lo, hi, field)                                                         \
    POLICY_PARAM_U32(k, d, h, lo, hi, offsetof(confkv_config, field))

static const policy_param_spec confkv_params[] = {
    CONFKV_F64("tau", "0.7",
               "confidence threshold: c_t >= tau selects budget_tight, else budget_loose "
               "(POLICIES.md §5.1), 0..1",
               0.0, 1.0, tau),
    CONFKV_U32("budget_tight", "128",
               "tokens kept per layer on confident steps (§5.1, WikiText knee)", 1, CONFKV_MAX,
               tight),
    CONFKV_U32("budget_loose", "512", "tokens kept per layer on uncertain steps (§5.2 [RECON])", 1,
               CONFKV_MAX, loose),
    CONFKV_U32("protect", "32",
               "W: the newest tokens never evicted (§5.2 [RECON]; 64 for NIAH/VWA)", 0, CONFKV_MAX,
               protect),
    CONFKV_U32("fp16_window", "128",
               "F: the newest retained tokens kept in full precision, older ones INT8 (§5.2 "
               "[RECON]; 256 for NIAH/VWA)",
               0, CONFKV_MAX, fp16_window),
    CONFKV_F64("lambda", "0.5",
               "ranker weight of the attention EMA vs recency (§5.2 [RECON]), 0..1", 0.0, 1.0,
               lambda),
    CONFKV_F64("gamma", "0.9", "EMA decay of the attention mass (§5.2 [RECON]), 0..1", 0.0, 1.0,
               gamma),
    CONFKV_F64("w_entropy", "0.4", "confidence weight of 1 - normalised entropy (§5.2 [RECON])",
               0.0, 1.0, weights.entropy),
    CONFKV_F64("w_margin", "0.3", "confidence weight of the top-1/top-2 log-prob margin term", 0.0,
               1.0, weights.margin),
    CONFKV_F64("w_top", "0.3",
               "confidence weight of the top-1 probability; the three weights sum to 1", 0.0, 1.0,
               weights.top),
    CONFKV_U32("pyramid", "0", "1 = Conf-KV-L: deeper layers get smaller budgets (§5.5)", 0, 1,
               pyramid),
    CONFKV_F64("rho_top", "1.5", "pyramid: budget factor of the first layer (§5.5 [RECON])", 0.0,
               64.0, rho_top),
    CONFKV_F64("rho_bottom", "0.5", "pyramid: budget factor of the last layer, <= rho_top", 0.0,
               64.0, rho_bottom),
    POLICY_PARAM_ONE_OF("margin_mode", "sigmoid",
                        "margin term: sigmoid(D) or tanh (= 2 sigmoid(D) - 1) (§5.2)", margin_modes,
                        offsetof(confkv_config, margin_mode)),
};

/* ---- the pure pieces (confkv.h) ------------------------------------------ */

static double margin_term(double delta, confkv_margin_mode mode)
{
    double s = 1.0 / (1.0 + exp(-delta)); /* exp(-inf) = 0: s = 1 */
    return mode == CONFKV_MARGIN_TANH ? 2.0 * s - 1.0 : s;
}

/* §5.2: c = wH·(1 − H~) + wM·margin + wP·p_(1), from the four signals. */
static double combine(const confkv_weights *w, double entropy_nats, double delta, double top,
                      size_t V, confkv_signals *sig)
{
    double ht = entropy_nats / log((double)V);
    if (ht < 0.0)
        ht = 0.0; /* rounding: H is in [0, ln V] */
    if (ht > 1.0)
        ht = 1.0;
    double mt = margin_term(delta, w->margin_mode);
    double c = w->entropy * (1.0 - ht) + w->margin * mt + w->top * top;
    if (sig != NULL)
        *sig = (confkv_signals){ht, delta, mt, top};
    return c < 0.0 ? 0.0 : (c > 1.0 ? 1.0 : c);
}

double confkv_confidence(const float *probs, size_t V, const confkv_weights *w, confkv_signals *sig)
{
    if (probs == NULL || w == NULL || V < 2)
        return -1.0;
    double sum = 0.0, p1 = 0.0, p2 = 0.0;
    for (size_t v = 0; v < V; v++) {
        double p = probs[v];
        if (!isfinite(p) || p < 0.0)
            return -1.0;
        sum += p;
        if (p > p1) {
            p2 = p1;
            p1 = p;
        } else if (p > p2) {
            p2 = p;
        }
    }
    if (!(sum > 0.0) || !isfinite(sum))
        return -1.0;
    double h = 0.0;
    for (size_t v = 0; v < V; v++) {
        double p = probs[v] / sum;
        if (p > 0.0)
            h -= p * log(p); /* 0·ln 0 = 0 */
    }
    /* Δ = ln p_(1) − ln p_(2); the normalisation cancels. p_(2) = 0: +inf. */
    double delta = p2 > 0.0 ? log(p1) - log(p2) : INFINITY;
    return combine(w, h, delta, p1 / sum, V, sig);
}

double confkv_confidence_logits(const float *logits, size_t V, const confkv_weights *w,
                                confkv_signals *sig)
{
    if (logits == NULL || w == NULL || V < 2)
        return -1.0;
    double z1 = -INFINITY, z2 = -INFINITY;
    for (size_t v = 0; v < V; v++) {
        double z = logits[v];
        if (!isfinite(z))
            return -1.0;
        if (z > z1) {
            z2 = z1;
            z1 = z;
        } else if (z > z2) {
            z2 = z;
        }
    }
    double s = 0.0;
    for (size_t v = 0; v < V; v++)
        s += exp((double)logits[v] - z1);
    double lse = z1 + log(s);
    double h = 0.0;
    for (size_t v = 0; v < V; v++) {
        double lp = (double)logits[v] - lse;
        h -= exp(lp) * lp;
    }
    return combine(w, h, z1 - z2, exp(z1 - lse), V, sig);
}

uint32_t confkv_budget(double c, double tau, uint32_t tight, uint32_t loose)
{
    return c >= tau ? tight : loose;
}

uint32_t confkv_layer_budget(uint32_t budget, uint32_t layer, uint32_t layers, double rho_top,
                             double rho_bottom, uint32_t protect)
{
    double factor;
    if (layers <= 1)
        factor = (rho_top + rho_bottom) / 2.0;
    else
        factor = rho_top - (rho_top - rho_bottom) * (double)layer / (double)(layers - 1);
    double b = nearbyint((double)budget * factor); /* default mode: half to even */
    double floor_b = (double)protect + 1.0;
    if (b < floor_b)
        b = floor_b;
    return b >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)b;
}

/* Inlined in the step's loop: through the exported name (a library built
 * position-independent may interpose it) it is a call per token. */
static inline double ema_of(double e, double mass, double gamma)
{
    return gamma * e + (1.0 - gamma) * mass;
}

double confkv_ema(double e, double mass, double gamma)
{
    return ema_of(e, mass, gamma);
}

/* The extremes skip NaNs as fmin and fmax do, in comparisons that
 * vectorise (fmin and fmax are calls). With every EMA a NaN they stay
 * +inf and -inf, where fmin gives NaN: either way no range, a = 0. The
 * sign of a zero extreme does not reach a rank. */
POLICY_HOT void confkv_rank(const double *ema, const uint32_t *step, size_t n, double lambda,
                            double *rank)
{
    if (n == 0)
        return;
    double emin = INFINITY, emax = -INFINITY;
    uint32_t smin = step[0], smax = step[0];
    for (size_t i = 0; i < n; i++) {
        emin = ema[i] < emin ? ema[i] : emin;
        emax = ema[i] > emax ? ema[i] : emax;
        smin = step[i] < smin ? step[i] : smin;
        smax = step[i] > smax ? step[i] : smax;
    }
    for (size_t i = 0; i < n; i++) {
        double a = emax > emin ? (ema[i] - emin) / (emax - emin) : 0.0;
        double r = smax > smin ? (double)(step[i] - smin) / (double)(smax - smin) : 0.0;
        rank[i] = lambda * a + (1.0 - lambda) * r;
    }
}

/* (rank, step, index) ascending: is token x evicted before token y? */
static int evict_before(const double *rank, const uint32_t *step, uint32_t x, uint32_t y)
{
    if (rank[x] != rank[y])
        return rank[x] < rank[y];
    if (step[x] != step[y])
        return step[x] < step[y];
    return x < y;
}

static void sift_down(const double *rank, const uint32_t *step, uint32_t *idx, size_t root,
                      size_t n)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n)
            return;
        if (child + 1 < n && evict_before(rank, step, idx[child], idx[child + 1]))
            child++;
        if (!evict_before(rank, step, idx[root], idx[child]))
            return;
        uint32_t t = idx[root];
        idx[root] = idx[child];
        idx[child] = t;
        root = child;
    }
}

void confkv_order(const double *rank, const uint32_t *step, uint32_t *idx, size_t n)
{
    /* Heap sort with a total order: no allocation, and the result does not
     * depend on the sort's stability. */
    for (size_t i = n / 2; i-- > 0;)
        sift_down(rank, step, idx, i, n);
    for (size_t end = n; end-- > 1;) {
        uint32_t t = idx[0];
        idx[0] = idx[end];
        idx[end] = t;
        sift_down(rank, step, idx, 0, end);
    }
}

/* ---- the policy ---------------------------------------------------------- */

int confkv_config_parse(const policy_params *p, confkv_config *s, char *err, size_t errlen)
{
    if (policy_params_parse(p, confkv_params, sizeof confkv_params / sizeof confkv_params[0], s,
                            err, errlen) != 0)
        return -1;
    s->weights.margin_mode = (confkv_margin_mode)s->margin_mode;
    double sum = s->weights.entropy + s->weights.margin + s->weights.top;
    if (fabs(sum - 1.0) > 1e-6) {
        policy_set_err(err, errlen, "parameters w_entropy + w_margin + w_top must sum to 1, got %g",
                       sum);
        return -1;
    }
    if (s->tight > s->loose) {
        policy_set_err(err, errlen, "parameter budget_tight (%u) must not exceed budget_loose (%u)",
                       s->tight, s->loose);
        return -1;
    }
    /* §5.5 keeps every layer budget above W; a budget <= W could never be met. */
    if (s->protect >= s->tight) {
        policy_set_err(err, errlen, "parameter protect (%u) must be smaller than budget_tight (%u)",
                       s->protect, s->tight);
        return -1;
    }
    if (s->rho_bottom > s->rho_top) {
        policy_set_err(
            err, errlen,
            "parameter rho_bottom (%g) must not exceed rho_top (%g): deeper layers get less "
            "(§5.5)",
            s->rho_bottom, s->rho_top);
        return -1;
    }
    return 0;
}

static void confkv_destroy(void *state)
{
    confkv_state *s = state;
    if (s == NULL)
        return;
    for (uint32_t l = 0; s->ly != NULL && l < s->layers; l++)
        free(s->ly[l].ema);
    for (uint32_t l = 0; s->scratch != NULL && l < s->layers; l++) {
        free(s->scratch[l].rank);
        free(s->scratch[l].keys);
    }
    free(s->ly);
    free(s->scratch);
    free(s);
}

static int confkv_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                         size_t errlen)
{
    *state = NULL;
    confkv_state tmp = {0};
    if (confkv_config_parse(p, &tmp.cfg, err, errlen) != 0)
        return -1;
    if (g == NULL || g->layers == 0 || g->q_heads == 0) {
        policy_set_err(err, errlen, "confkv needs a geometry with layers >= 1 and q_heads >= 1");
        return -1;
    }
    confkv_state *s = malloc(sizeof *s);
    if (s == NULL) {
        policy_set_err(err, errlen, "out of memory creating policy 'confkv'");
        return -1;
    }
    *s = tmp;
    s->layers = g->layers;
    s->q_heads = g->q_heads;
    s->ly = calloc(g->layers, sizeof *s->ly);
    s->scratch = calloc(g->layers, sizeof *s->scratch);
    if (s->ly == NULL || s->scratch == NULL) {
        confkv_destroy(s);
        policy_set_err(err, errlen, "out of memory creating policy 'confkv'");
        return -1;
    }
    *state = s;
    return 0;
}

static int reserve(confkv_layer *ly, confkv_scratch *sc, uint32_t n)
{
    if (n > ly->cap) {
        uint32_t cap = ly->cap ? ly->cap : 64;
        while (cap < n)
            cap = cap > UINT32_MAX / 2 ? n : cap * 2;
        double *e = realloc(ly->ema, (size_t)cap * sizeof *e);
        if (e == NULL)
            return -1;
        ly->ema = e;
        ly->cap = cap;
    }
    if (n > sc->cap) {
        double *r = realloc(sc->rank, (size_t)n * sizeof *r);
        if (r == NULL)
            return -1;
        sc->rank = r;
        uint64_t *x = realloc(sc->keys, (size_t)n * sizeof *x);
        if (x == NULL)
            return -1;
        sc->keys = x;
        sc->cap = n;
    }
    return 0;
}

/* Step 1: e_i ← γ·e_i + (1−γ)·mean_h last_attn[h][i]. The means go
 * through the step's rank scratch, which evict() overwrites. */
static void update_ema(const confkv_state *s, confkv_layer *ly, confkv_scratch *sc,
                       const policy_stats *st)
{
    double *mean = sc->rank;
    policy_mean_rows(st->last_attn, s->q_heads, ly->n, mean);
    for (uint32_t i = 0; i < ly->n; i++)
        ly->ema[i] = ema_of(ly->ema[i], mean[i], s->cfg.gamma);
}

/* Step 3: mark the evicted tokens in tier[]. The W newest are protected. */
static void evict(const confkv_state *s, const confkv_layer *ly, confkv_scratch *sc,
                  const uint32_t *pos, uint8_t *tier, uint32_t budget)
{
    uint32_t n = ly->n;
    if (n <= budget)
        return; /* §5.1: a no-op while the cache fits */
    uint32_t cand = n > s->cfg.protect ? n - s->cfg.protect : 0; /* positions ascend: a prefix */
    uint32_t k = n - budget;
    if (k > cand)
        k = cand;
    confkv_rank(ly->ema, pos, cand, s->cfg.lambda, sc->rank);
    if (k == 1 && !policy_has_nan(sc->rank, cand)) { /* a decode step: the first minimum */
        tier[policy_first_min(sc->rank, cand)] = POLICY_EVICT;
        return;
    }
    /* The k first of confkv_order's order (rank, step, index), selected
     * without sorting the rest: the view's positions ascend, so (step,
     * index) is index order, the order the cut is taken in. */
    for (uint32_t i = 0; i < cand; i++)
        sc->keys[i] = policy_key(sc->rank[i]);
    policy_cut cut = policy_select_cut(sc->keys, cand, k);
    uint8_t *evict = (uint8_t *)sc->keys; /* the keys are spent: cand bytes of room */
    policy_cut_mark(&cut, sc->rank, 1.0, NULL, 1, cand, 0, evict);
    policy_evict_marked(tier, evict, 1, cand);
}

/* Step 4: retained tokens older than the F newest retained become INT8. */
static void demote(const confkv_state *s, uint32_t n, uint8_t *tier)
{
    uint32_t newer = 0;
    for (uint32_t i = n; i-- > 0;) {
        if (tier[i] == POLICY_EVICT)
            continue;
        if (newer >= s->cfg.fp16_window && tier[i] == POLICY_FULL)
            tier[i] = POLICY_INT8;
        newer++;
    }
}

static void compact(confkv_layer *ly, const uint8_t *tier)
{
    uint32_t out = 0;
    for (uint32_t i = 0; i < ly->n; i++)
        if (tier[i] != POLICY_EVICT)
            ly->ema[out++] = ly->ema[i];
    ly->n = out;
}

static int check_stats(const confkv_state *s, const confkv_layer *ly, uint32_t n,
                       const policy_stats *st, char *err, size_t errlen)
{
    if (st->new_tokens > n || ly->n != n - st->new_tokens) {
        policy_set_err(
            err, errlen,
            "confkv: layer holds %u tokens with %u new, but the policy tracks %u (out of "
            "sync)",
            n, st->new_tokens, ly->n);
        return -1;
    }
    if (st->last_attn == NULL) {
        policy_set_err(err, errlen, "confkv needs stats last_attn (attention of the last query)");
        return -1;
    }
    for (uint32_t h = 0; h < s->q_heads; h++)
        if (st->last_attn[h] == NULL) {
            policy_set_err(err, errlen,
                           "confkv needs stats last_attn for every query head (%u missing)", h);
            return -1;
        }
    if (!st->prefill && !(st->confidence >= 0.0)) {
        policy_set_err(err, errlen,
                       "confkv needs stats confidence (c_t >= 0) in every decode step");
        return -1;
    }
    return 0;
}

/* Step 3's B_l for confidence c: B_t, or its pyramidal share (§5.5). */
static uint32_t step_budget(const confkv_state *s, uint32_t layer, double c)
{
    uint32_t budget = confkv_budget(c, s->cfg.tau, s->cfg.tight, s->cfg.loose);
    if (s->cfg.pyramid)
        budget = confkv_layer_budget(budget, layer, s->layers, s->cfg.rho_top, s->cfg.rho_bottom,
                                     s->cfg.protect);
    return budget;
}

static int confkv_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                       policy_decision *d, char *err, size_t errlen)
{
    confkv_state *s = state;
    if (view->layer >= s->layers || view->heads != 1) {
        policy_set_err(err, errlen,
                       "confkv: view of layer %u with %u lists does not match the policy",
                       view->layer, view->heads);
        return -1;
    }
    confkv_layer *ly = &s->ly[view->layer];
    confkv_scratch *sc = &s->scratch[view->layer];
    uint32_t n = view->tokens[0];
    if (check_stats(s, ly, n, stats, err, errlen) != 0)
        return -1;
    if (reserve(ly, sc, n) != 0) {
        policy_set_err(err, errlen, "out of memory in policy 'confkv'");
        return -1;
    }
    for (uint32_t i = ly->n; i < n; i++)
        ly->ema[i] = 0.0; /* a new token starts at 0 before its first update */
    ly->n = n;
    update_ema(s, ly, sc, stats);
    if (stats->prefill)
        return 0; /* §5.3: prefill keeps everything */
    uint32_t budget = step_budget(s, view->layer, stats->confidence);
    ly->decided = 1;
    ly->confidence = stats->confidence;
    ly->budget = budget;
    evict(s, ly, sc, view->positions[0], d->tier[0], budget);
    demote(s, n, d->tier[0]);
    compact(ly, d->tier[0]);
    return 0;
}

/* ops->save: the layer's record with its EMA in an array of exactly n (the
 * copy's cap), so that restore() only swaps (the scratch is apart). */
static int confkv_save(void *state, uint32_t layer, void **saved)
{
    const confkv_state *s = state;
    const confkv_layer *ly = &s->ly[layer];
    confkv_layer *c = malloc(sizeof *c);
    double *ema = policy_array_copy(ly->ema, ly->n, ly->n, sizeof *ly->ema);
    if (c == NULL || ema == NULL) {
        free(c);
        free(ema);
        errno = ENOMEM;
        return -1;
    }
    *c = *ly;
    c->ema = ema;
    c->cap = ly->n;
    *saved = c;
    return 0;
}

static void confkv_restore(void *state, uint32_t layer, void *saved)
{
    confkv_state *s = state;
    free(s->ly[layer].ema);
    s->ly[layer] = *(confkv_layer *)saved;
    free(saved);
}

static void confkv_discard(void *saved)
{
    if (saved != NULL)
        free(((confkv_layer *)saved)->ema);
    free(saved);
}

/* ---- moving a sequence (issue 17; the format in confkv.h) ---------------- */

/* ops->export_layer: everything step() and describe() read of the layer
 * (the config and the scratch come from create() on the other side). */
static void *confkv_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const confkv_layer *ly = &((const confkv_state *)state)->ly[layer];
    *len = CONFKV_STATE_HEAD + (size_t)ly->n * 8;
    uint8_t *buf = malloc(*len);
    if (buf == NULL) {
        *len = 0;
        return NULL;
    }
    uint8_t *p = policy_put_le(buf, CONFKV_STATE_MAGIC, 4);
    p = policy_put_le(p, CONFKV_STATE_VERSION, 1);
    p = policy_put_le(p, ly->decided != 0, 1);
    p = policy_put_le(p, ly->budget, 4);
    p = policy_put_le(p, policy_f64_bits(ly->confidence), 8);
    p = policy_put_le(p, ly->n, 4);
    for (uint32_t i = 0; i < ly->n; i++)
        p = policy_put_le(p, policy_f64_bits(ly->ema[i]), 8);
    return buf;
}

/* The last decode step's fields: what that step could have left, i.e. the
 * daemon's confidence range and the budget step_budget() gives for it; a
 * layer no decode step ran on has create()'s zeros. */
static int import_decided(const confkv_state *s, uint32_t layer, const confkv_layer *ly, char *err,
                          size_t errlen)
{
    if (!ly->decided) {
        if (ly->budget == 0 && policy_f64_bits(ly->confidence) == 0)
            return 0;
        policy_set_err(err, errlen, "a layer without a decode step has no budget or confidence");
        return -1;
    }
    if (!(ly->confidence >= 0.0 && ly->confidence <= 1.0)) {
        policy_set_err(err, errlen, "confidence %g is not in [0, 1]", ly->confidence);
        return -1;
    }
    uint32_t want = step_budget(s, layer, ly->confidence);
    if (ly->budget != want) {
        policy_set_err(err, errlen, "budget %u is not the %u that confidence %.9g gives",
                       ly->budget, want, ly->confidence);
        return -1;
    }
    return 0;
}

/* The header of a layer's bytes, checked against the policy, itself and
 * the length; ly receives its fields (ema not read yet). */
static int import_head(const confkv_state *s, uint32_t layer, const uint8_t *p, size_t len,
                       confkv_layer *ly, char *err, size_t errlen)
{
    if (len < CONFKV_STATE_HEAD) {
        policy_set_err(err, errlen, "%zu bytes, shorter than the %u-byte header", len,
                       CONFKV_STATE_HEAD);
        return -1;
    }
    if (policy_get_le(p, 4) != CONFKV_STATE_MAGIC || p[4] != CONFKV_STATE_VERSION) {
        policy_set_err(err, errlen, "not confkv state version %u (magic %08x, version %u)",
                       CONFKV_STATE_VERSION, (unsigned)policy_get_le(p, 4), p[4]);
        return -1;
    }
    if (p[5] > 1) {
        policy_set_err(err, errlen, "decided flag %u is not 0 or 1", p[5]);
        return -1;
    }
    *ly = (confkv_layer){.decided = p[5],
                         .budget = (uint32_t)policy_get_le(p + 6, 4),
                         .confidence = policy_bits_f64(policy_get_le(p + 10, 8)),
                         .n = (uint32_t)policy_get_le(p + 18, 4)};
    /* Exact length: the one bound on n, checked before n sizes anything. */
    if ((len - CONFKV_STATE_HEAD) % 8 != 0 || (len - CONFKV_STATE_HEAD) / 8 != ly->n) {
        policy_set_err(err, errlen, "%u tokens need %zu bytes of EMA, got %zu", ly->n,
                       (size_t)ly->n * 8, len - CONFKV_STATE_HEAD);
        return -1;
    }
    return import_decided(s, layer, ly, err, errlen);
}

/* ops->import_layer: check everything, then swap the new EMA in. */
static int confkv_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                               size_t errlen)
{
    confkv_state *s = state;
    const uint8_t *p = buf;
    confkv_layer ly;
    if (layer >= s->layers) {
        policy_set_err(err, errlen, "layer %u out of range (%u layers)", layer, s->layers);
        return -1;
    }
    if (import_head(s, layer, p, len, &ly, err, errlen) != 0)
        return -1;
    ly.ema = policy_array_copy(NULL, 0, ly.n, sizeof *ly.ema);
    ly.cap = ly.n;
    if (ly.ema == NULL) {
        policy_set_err(err, errlen, "out of memory in policy 'confkv'");
        return -1;
    }
    for (uint32_t i = 0; i < ly.n; i++) {
        ly.ema[i] = policy_bits_f64(policy_get_le(p + CONFKV_STATE_HEAD + (size_t)i * 8, 8));
        /* Stats are finite (the daemon checks them), so is every EMA; a
         * NaN would make the ranking's min-max and order meaningless. */
        if (!isfinite(ly.ema[i])) {
            policy_set_err(err, errlen, "EMA of token %u is not finite", i);
            free(ly.ema);
            return -1;
        }
    }
    free(s->ly[layer].ema);
    s->ly[layer] = ly;
    return 0;
}

int confkv_layer_ema(const void *state, uint32_t layer, const double **ema, uint32_t *n)
{
    const confkv_state *s = state;
    if (s == NULL || layer >= s->layers)
        return -1;
    *ema = s->ly[layer].ema;
    *n = s->ly[layer].n;
    return 0;
}

/* ---- describe ------------------------------------------------------------ */

static char *confkv_describe(void *state, uint32_t layer)
{
    const confkv_state *s = state;
    if (s == NULL || layer >= s->layers)
        return NULL;
    const confkv_layer *ly = &s->ly[layer];
    policy_text t = {0};
    policy_text_add(&t, "{\"layer\":%u,\"tokens\":%u", layer, ly->n);
    if (ly->decided)
        policy_text_add(&t, ",\"confidence\":%.9g,\"budget\":%u", ly->confidence, ly->budget);
    else
        policy_text_add(&t, ",\"confidence\":null,\"budget\":null");
    policy_text_add(&t, ",\"ema\":[");
    for (uint32_t i = 0; i < ly->n; i++)
        policy_text_add(&t, "%s%.9g", i ? "," : "", ly->ema[i]);
    policy_text_add(&t, "]}");
    return policy_text_finish(&t);
}

const policy_ops policy_confkv = {
    .name = "confkv",
    .summary = "Conf-KV: next-token confidence picks a tight or loose budget; evict by attention "
               "EMA + recency outside the newest `protect`; INT8 outside the newest fp16_window",
    .params = confkv_params,
    .nparams = sizeof(confkv_params) / sizeof(confkv_params[0]),
    .needs = POLICY_NEEDS_LAST_ATTN | POLICY_NEEDS_CONFIDENCE,
    .per_head = 0,
    .layers_concurrent = 1,
    .create = confkv_create,
    .step = confkv_step,
    .describe = confkv_describe,
    .destroy = confkv_destroy,
    .save = confkv_save,
    .restore = confkv_restore,
    .discard = confkv_discard,
    .export_layer = confkv_export_layer,
    .import_layer = confkv_import_layer,
};
