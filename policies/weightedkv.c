/*
 * weightedkv.c - policy "weightedkv": WeightedKV (arXiv 2503.01330;
 * POLICIES.md §4, Algorithm 1 of [WKV-PDF]). Keys of low-attention tokens are
 * dropped; their values are merged into the right neighbour's value by a
 * convex combination weighted by historical average attention.
 *
 * Per KV head (ops->per_head = 1: statistics are per head, so the heads'
 * lists diverge) the policy keeps a[i] (accumulated attention) and c[i]
 * (times accumulated), in list order. Each step:
 *   1. A = mean of the group's query-head rows of stats->last_attn
 *      (§4.1 [RECON] for GQA; for MHA the head's own row). a += A and c += 1
 *      for every entry, the new ones included (they start at 0).
 *   2. While n > m: w = a/c; j = argmin w over [n_init, n − n_recent), ties
 *      to the lowest index; a policy_merge {head, from=j, into=j+1 (the next
 *      surviving entry), w[j], w[j+1]} is emitted and j is evicted. The
 *      neighbour keeps its own a and c. In decode n = m+1: one merge.
 *      (wkv_plan() in weightedkv.h does all merges of a step at once.)
 *   3. When a step merges more than once (prefill), a victim may first
 *      absorb earlier victims. The host accepts only merges into entries the
 *      step keeps, so wkv_flatten() rewrites such chains into runs of merges
 *      into the kept entry, with the same resulting values.
 * The decision never changes another tier; merges must be applied in order
 * before the evicted rows are dropped (policy.h "policy_merge").
 *
 * Prefill [RECON] (§4.1 extension): when the step is a prefill step and the
 * worker reports window_attn over w = window_queries >= 1 queries (the last
 * w of this step), then a[i] += w·mean(window_attn)[i] = Σ over those
 * queries of A[q][i] and c[i] += the number of them that see token i,
 * min(w, appended − position[i]). With the whole prompt as one chunk and
 * w = L this is exactly a[i] = Σ_{q≥i} A[q][i], c[i] = L − i. Without
 * window_attn, a prefill step accumulates its last query like a decode step.
 * Either way the merges then repeat until n <= m.
 *
 * Candidates in general [RECON]: [n_init, n − n_recent) of the current list,
 * which is §4.1's [n_init, (m+1) − n_recent) in steady state (n = m+1).
 * n_recent >= 1 because the newest entry has no right neighbour.
 *
 * merge=0 is the paper's "Eviction" ablation: the same victims, no merge
 * records. literal_overwrite=1 reproduces Algorithm 1's `a = a/n`: on every
 * step that merges, a[i] is replaced by w[i] = a[i]/c[i] (c is kept), so
 * later averages mix averages with raw sums (§4.1 quirk, §6 #13).
 */
#include "weightedkv.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "describe.h"
#include "select.h"
#include "util.h"

#define WKV_MAX 1048576u

/* A head's accumulators, in two pairs of arrays: a step writes a + A and
 * c + 1 into the spare pair and makes it current, so that the pair it read
 * stays as it was and save() keeps it without a copy (restore() makes it
 * current again). While a saved copy holds the current pair (pinned), a
 * step does not make it the spare; discard() gives it back. */
typedef struct wkv_head {
    double *a, *c; /* [n] in list order */
    uint32_t n, cap;
    double *spare_a, *spare_c; /* contents not kept; spare_cap 0: none */
    uint32_t spare_cap;
    int pinned;
} wkv_head;

/* A layer's scratch for the step of one of its lists, a layer's own so
 * that the host may step layers at once. */
typedef struct wkv_scratch {
    double *w, *attn, *coef;
    uint32_t *idx;
    policy_merge *plan;
    uint32_t cap;
} wkv_scratch;

typedef struct wkv_state {
    wkv_config cfg;
    int merge, literal;
    uint32_t layers, q_heads, kv_heads, group;
    wkv_head *heads;      /* [layers * kv_heads] */
    wkv_scratch *scratch; /* [layers] */
} wkv_state;

/* The parameters as parsed (policy_params_parse). */
typedef struct wkv_parsed {
    wkv_config cfg;
    uint32_t merge, literal;
} wkv_parsed;

static const policy_param_spec wkv_params[] = {
    POLICY_PARAM_U32("cache_size", "256",
                     "m: entries per KV head after each step (POLICIES.md §4.1; the paper uses 256 "
                     "and 1024)",
                     2, WKV_MAX, offsetof(wkv_parsed, cfg.cache_size)),
    POLICY_PARAM_U32("n_init", "4", "initial entries never merged away (§4.1: 4)", 0, WKV_MAX,
                     offsetof(wkv_parsed, cfg.n_init)),
    POLICY_PARAM_U32("n_recent", "124",
                     "most recent entries never merged away, >= 1 (§4.1: 124 for m=256, 508 for "
                     "m=1024)",
                     1, WKV_MAX, offsetof(wkv_parsed, cfg.n_recent)),
    POLICY_PARAM_U32("merge", "1",
                     "1 = merge the victim's value into its right neighbour; 0 = drop it like its "
                     "key (the paper's Eviction ablation, §4.2)",
                     0, 1, offsetof(wkv_parsed, merge)),
    POLICY_PARAM_U32("literal_overwrite", "0",
                     "1 = Algorithm 1 literally: a = a/c on each merging step (§4.1 quirk); 0 = "
                     "keep a as the raw sum",
                     0, 1, offsetof(wkv_parsed, literal)),
};

/* ---- the pure pieces (weightedkv.h) -------------------------------------- */

/* Inlined where the step needs it (through the exported name, which a
 * library built position-independent may interpose, it is a call). */
static inline double weight_of(double a, double c)
{
    return c > 0.0 ? a / c : 0.0;
}

double wkv_weight(double a, double c)
{
    return weight_of(a, c);
}

void wkv_merge_weights(double w_from, double w_into, float *wf, float *wi)
{
    if (w_from + w_into > 0.0) {
        *wf = (float)w_from;
        *wi = (float)w_into;
    } else {
        *wf = 1.0f; /* §4.2: both 0, the plain average */
        *wi = 1.0f;
    }
}

/* Min-heap of candidate indices by (w, index). */
static int lighter(const double *w, uint32_t x, uint32_t y)
{
    return w[x] < w[y] || (w[x] == w[y] && x < y);
}

static void heap_down(const double *w, uint32_t *heap, size_t root, size_t n)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n)
            return;
        if (child + 1 < n && lighter(w, heap[child + 1], heap[child]))
            child++;
        if (!lighter(w, heap[child], heap[root]))
            return;
        uint32_t t = heap[root];
        heap[root] = heap[child];
        heap[child] = t;
        root = child;
    }
}

size_t wkv_plan(const double *w, size_t n, const wkv_config *cfg, uint32_t head, uint32_t *scratch,
                policy_merge *out)
{
    if (n <= cfg->cache_size || n < (size_t)cfg->n_recent)
        return 0;
    size_t lo = cfg->n_init, hi = n - cfg->n_recent;
    if (hi <= lo || cfg->n_recent == 0)
        return 0;
    size_t k = n - cfg->cache_size;
    if (k > hi - lo)
        k = hi - lo;
    /* A decode step: the first minimum, no heap (the heap orders NaNs
     * somehow, policy_first_min not at all). */
    if (k == 1 && !policy_has_nan(w + lo, hi - lo)) {
        size_t j = lo + policy_first_min(w + lo, hi - lo);
        out[0] = (policy_merge){.head = head, .from = (uint32_t)j, .into = (uint32_t)j + 1};
        wkv_merge_weights(w[j], w[j + 1], &out[0].w_from, &out[0].w_into);
        return 1;
    }
    uint32_t *heap = scratch, *next = scratch + n, *prev = scratch + 2 * n;
    size_t hn = hi - lo;
    for (size_t i = 0; i < hn; i++)
        heap[i] = (uint32_t)(lo + i);
    for (size_t i = hn / 2; i-- > 0;)
        heap_down(w, heap, i, hn);
    for (size_t i = 0; i < n; i++) {
        next[i] = (uint32_t)(i + 1);
        prev[i] = i > 0 ? (uint32_t)(i - 1) : UINT32_MAX; /* none */
    }
    for (size_t m = 0; m < k; m++) {
        uint32_t j = heap[0];
        heap[0] = heap[--hn];
        heap_down(w, heap, 0, hn);
        uint32_t into = next[j]; /* j < n − n_recent: the fixed tail follows it */
        out[m].head = head;
        out[m].from = j;
        out[m].into = into;
        wkv_merge_weights(w[j], w[into], &out[m].w_from, &out[m].w_into);
        /* Unlink j: later victims see the list without it. */
        prev[into] = prev[j];
        if (prev[j] != UINT32_MAX)
            next[prev[j]] = into;
    }
    return k;
}

void wkv_flatten(const policy_merge *plan, size_t k, size_t n, policy_merge *out,
                 uint32_t *uscratch, double *dscratch)
{
    uint32_t *root = uscratch;         /* [n] terminal plan record of each victim */
    uint32_t *start = uscratch + n;    /* [k+1] bucket starts per terminal record */
    uint32_t *order = start + (k + 1); /* [k] victims grouped by terminal record */
    double *coef = dscratch;           /* [n] r_t: share in the terminal row */
    for (size_t i = 0; i < n; i++)
        root[i] = UINT32_MAX;
    /* Backwards in time: a victim's row goes into its target's row (α) and
     * rides along until that row's own terminal merge; every merge into a
     * row scales what the row held before by β. A target not yet seen is
     * never evicted later: its record is terminal. */
    for (size_t m = k; m-- > 0;) {
        uint32_t u = plan[m].from, v = plan[m].into;
        double sum = (double)plan[m].w_from + (double)plan[m].w_into;
        if (root[v] == UINT32_MAX) {
            root[u] = (uint32_t)m;
            coef[u] = 1.0;
        } else {
            root[u] = root[v];
            coef[u] = (double)plan[m].w_from / sum * coef[v];
            coef[v] *= (double)plan[m].w_into / sum;
        }
    }
    /* Group victims by terminal record, positive shares first, in plan order. */
    memset(start, 0, (k + 1) * sizeof *start);
    for (size_t m = 0; m < k; m++)
        start[root[plan[m].from] + 1]++;
    for (size_t m = 0; m < k; m++)
        start[m + 1] += start[m];
    for (int pass = 0; pass < 2; pass++)
        for (size_t m = 0; m < k; m++) {
            uint32_t t = plan[m].from;
            if ((coef[t] > 0.0) == (pass == 0))
                order[start[root[t]]++] = t;
        }
    /* start[r] now ends bucket r; bucket r begins where bucket r-1 ended. */
    size_t o = 0;
    for (size_t m = 0; m < k; m++) {
        if (root[plan[m].from] != m)
            continue; /* not terminal */
        double wf = plan[m].w_from, into_w = plan[m].w_into;
        for (uint32_t b = m ? start[m - 1] : 0; b < start[m]; b++) {
            double p = wf * coef[order[b]];
            out[o++] =
                (policy_merge){plan[m].head, order[b], plan[m].into, (float)p, (float)into_w};
            into_w += p;
        }
    }
}

/* ---- the policy ---------------------------------------------------------- */

int weightedkv_head_state(const void *state, uint32_t layer, uint32_t head, const double **a,
                          const double **c, uint32_t *n)
{
    const wkv_state *s = state;
    if (s == NULL || layer >= s->layers || head >= s->kv_heads)
        return -1;
    const wkv_head *hd = &s->heads[(size_t)layer * s->kv_heads + head];
    *a = hd->a;
    *c = hd->c;
    *n = hd->n;
    return 0;
}

static int parse_params(const policy_params *p, wkv_state *s, char *err, size_t errlen)
{
    wkv_parsed w;
    if (policy_params_parse(p, wkv_params, sizeof wkv_params / sizeof wkv_params[0], &w, err,
                            errlen) != 0)
        return -1;
    const wkv_config *c = &w.cfg;
    /* §4.2: the merge-managed middle must hold at least one entry. */
    if ((uint64_t)c->cache_size < (uint64_t)c->n_init + c->n_recent + 1) {
        policy_set_err(
            err, errlen,
            "parameter cache_size (%u) must be at least n_init + n_recent + 1 (%u + %u + 1)",
            c->cache_size, c->n_init, c->n_recent);
        return -1;
    }
    s->cfg = w.cfg;
    s->merge = (int)w.merge;
    s->literal = (int)w.literal;
    return 0;
}

static void wkv_destroy(void *state)
{
    wkv_state *s = state;
    if (s == NULL)
        return;
    for (size_t i = 0; s->heads != NULL && i < (size_t)s->layers * s->kv_heads; i++) {
        free(s->heads[i].a);
        free(s->heads[i].c);
        free(s->heads[i].spare_a);
        free(s->heads[i].spare_c);
    }
    free(s->heads);
    for (uint32_t l = 0; s->scratch != NULL && l < s->layers; l++) {
        wkv_scratch *sc = &s->scratch[l];
        free(sc->w);
        free(sc->attn);
        free(sc->coef);
        free(sc->idx);
        free(sc->plan);
    }
    free(s->scratch);
    free(s);
}

static int wkv_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                      size_t errlen)
{
    *state = NULL;
    wkv_state tmp = {0};
    if (parse_params(p, &tmp, err, errlen) != 0)
        return -1;
    if (g == NULL || g->layers == 0 || g->kv_heads == 0 || g->q_heads % g->kv_heads != 0 ||
        g->q_heads == 0) {
        policy_set_err(
            err, errlen,
            "weightedkv needs a geometry with layers >= 1 and q_heads a positive multiple "
            "of kv_heads");
        return -1;
    }
    wkv_state *s = malloc(sizeof *s);
    if (s == NULL) {
        policy_set_err(err, errlen, "out of memory creating policy 'weightedkv'");
        return -1;
    }
    *s = tmp;
    s->layers = g->layers;
    s->q_heads = g->q_heads;
    s->kv_heads = g->kv_heads;
    s->group = g->q_heads / g->kv_heads;
    s->heads = calloc((size_t)g->layers * g->kv_heads, sizeof *s->heads);
    s->scratch = calloc(g->layers, sizeof *s->scratch);
    if (s->heads == NULL || s->scratch == NULL) {
        wkv_destroy(s);
        policy_set_err(err, errlen, "out of memory creating policy 'weightedkv'");
        return -1;
    }
    *state = s;
    return 0;
}

/* Room for n entries in the head's spare pair and in the step's scratch. */
static int reserve(wkv_scratch *sc, wkv_head *hd, uint32_t n)
{
    if (n > hd->spare_cap) {
        uint32_t cap = hd->spare_cap ? hd->spare_cap : 64;
        while (cap < n)
            cap = cap > UINT32_MAX / 2 ? n : cap * 2;
        free(hd->spare_a);
        free(hd->spare_c);
        hd->spare_a = malloc((size_t)cap * sizeof *hd->spare_a);
        hd->spare_c = malloc((size_t)cap * sizeof *hd->spare_c);
        hd->spare_cap = hd->spare_a != NULL && hd->spare_c != NULL ? cap : 0;
        if (hd->spare_cap == 0)
            return -1;
    }
    if (n > sc->cap) {
        double *w = realloc(sc->w, (size_t)n * sizeof *w);
        if (w == NULL)
            return -1;
        sc->w = w;
        double *at = realloc(sc->attn, (size_t)n * sizeof *at);
        if (at == NULL)
            return -1;
        sc->attn = at;
        double *cf = realloc(sc->coef, (size_t)n * sizeof *cf);
        if (cf == NULL)
            return -1;
        sc->coef = cf;
        uint32_t *idx = realloc(sc->idx, 3 * (size_t)n * sizeof *idx);
        if (idx == NULL)
            return -1;
        sc->idx = idx;
        policy_merge *pl = realloc(sc->plan, (size_t)n * sizeof *pl);
        if (pl == NULL)
            return -1;
        sc->plan = pl;
        sc->cap = n;
    }
    return 0;
}

/* sc->attn[i] = mean over KV head k's query heads of rows[h][i] (§4.1 GQA). */
static void group_mean(const wkv_state *s, wkv_scratch *sc, const float *const *rows, uint32_t k,
                       uint32_t n)
{
    policy_mean_rows(rows + (size_t)k * s->group, s->group, n, sc->attn);
}

static int check_stats(const wkv_state *s, const policy_stats *st, int window, char *err,
                       size_t errlen)
{
    if (st->last_attn == NULL) {
        policy_set_err(err, errlen,
                       "weightedkv needs stats last_attn (attention of the last query)");
        return -1;
    }
    for (uint32_t h = 0; h < s->q_heads; h++)
        if (st->last_attn[h] == NULL || (window && st->window_attn[h] == NULL)) {
            policy_set_err(err, errlen, "weightedkv: stats %s of query head %u missing",
                           st->last_attn[h] == NULL ? "last_attn" : "window_attn", h);
            return -1;
        }
    if (window && st->window_queries > st->new_tokens) {
        policy_set_err(err, errlen,
                       "weightedkv: window_queries (%u) exceeds the step's new_tokens (%u)",
                       st->window_queries, st->new_tokens);
        return -1;
    }
    return 0;
}

/* Step 1 for one head: grow to n entries and accumulate this step. */
/* The spare pair becomes current; the current one becomes the spare,
 * unless a saved copy holds it. */
static void head_swap(wkv_head *hd)
{
    double *a = hd->a, *c = hd->c;
    uint32_t cap = hd->cap;
    hd->a = hd->spare_a, hd->c = hd->spare_c, hd->cap = hd->spare_cap;
    if (hd->pinned) {
        hd->spare_a = hd->spare_c = NULL, hd->spare_cap = 0;
        hd->pinned = 0;
    } else {
        hd->spare_a = a, hd->spare_c = c, hd->spare_cap = cap;
    }
}

/* Entries of a step's pass at a time (add_step): 16 KiB of doubles. */
#define WKV_BLOCK 512

/* Four doubles at a time (GCC's vector extension: GCC keeps a division
 * under a condition scalar, so the selects are written as masks). */
typedef double wkv_vec __attribute__((vector_size(32)));
typedef long long wkv_mask __attribute__((vector_size(32)));
#define WKV_VEC (sizeof(wkv_vec) / sizeof(double))

/* w[i] = wkv_weight(a[i], c[i]): a / c where c > 0, else +0.0, divided by 1
 * there. */
POLICY_HOT static void weights(const double *restrict a, const double *restrict c, uint32_t n,
                               double *restrict w)
{
    const wkv_vec one = (wkv_vec){0} + 1.0;
    uint32_t i = 0;
    for (; i + WKV_VEC <= n; i += WKV_VEC) {
        wkv_vec va, vc;
        memcpy(&va, a + i, sizeof va);
        memcpy(&vc, c + i, sizeof vc);
        wkv_mask pos = vc > 0.0;
        wkv_vec d = (wkv_vec)(((wkv_mask)vc & pos) | ((wkv_mask)one & ~pos));
        wkv_vec q = (wkv_vec)((wkv_mask)(va / d) & pos);
        memcpy(w + i, &q, sizeof q);
    }
    for (; i < n; i++)
        w[i] = weight_of(a[i], c[i]);
}

/* a + A and c + 1 for the old entries of a pair, 0 + A and 0 + 1 for the
 * new ones, into another pair, and their weights into w: a block at a
 * time, so that the weights read the new pair while it is in L1. */
POLICY_HOT static void add_step(const double *restrict a, const double *restrict c,
                                const double *restrict attn, uint32_t old, uint32_t n,
                                double *restrict na, double *restrict nc, double *restrict w)
{
    for (uint32_t b = 0; b < n; b += WKV_BLOCK) {
        uint32_t end = n - b < WKV_BLOCK ? n : b + WKV_BLOCK, mid = old < b ? b : old;
        mid = mid > end ? end : mid;
        for (uint32_t i = b; i < mid; i++) {
            na[i] = a[i] + attn[i];
            nc[i] = c[i] + 1.0;
        }
        for (uint32_t i = mid; i < end; i++) {
            na[i] = 0.0 + attn[i];
            nc[i] = 0.0 + 1.0;
        }
        weights(na + b, nc + b, end - b, w + b);
    }
}

/* Step 1 into the spare pair (room for n: reserve), which becomes
 * current. A new entry starts at a = c = 0 before its first update.
 * Returns 1 when it left the new pair's weights in sc->w (a decode step). */
static int accumulate(const wkv_state *s, wkv_scratch *sc, wkv_head *hd,
                      const policy_layer_view *view, uint32_t k, const policy_stats *st, int window)
{
    uint32_t n = view->tokens[k], old = hd->n;
    const double *a = hd->a, *c = hd->c;
    double *restrict na = hd->spare_a, *restrict nc = hd->spare_c;
    if (window) {
        /* Prefill extension: Σ over the window's queries, and how many see i. */
        uint64_t wq = st->window_queries;
        group_mean(s, sc, st->window_attn, k, n);
        for (uint32_t i = 0; i < n; i++) {
            uint64_t after = view->appended - view->positions[k][i];
            na[i] = (i < old ? a[i] : 0.0) + (double)wq * sc->attn[i];
            nc[i] = (i < old ? c[i] : 0.0) + (double)(after < wq ? after : wq);
        }
    } else {
        group_mean(s, sc, st->last_attn, k, n);
        add_step(a, c, sc->attn, old, n, na, nc, sc->w);
    }
    head_swap(hd);
    hd->n = n;
    return !window;
}

/* Step 2 for one head: the merges, the evictions, and the compaction.
 * have_w: sc->w holds the head's weights already. */
static int merge_head(const wkv_state *s, wkv_scratch *sc, wkv_head *hd, uint32_t k, int have_w,
                      policy_decision *d, char *err, size_t errlen)
{
    uint32_t n = hd->n;
    if (n <= s->cfg.cache_size)
        return 0;
    if (!have_w)
        weights(hd->a, hd->c, n, sc->w);
    if (s->literal)
        memcpy(hd->a, sc->w, (size_t)n * sizeof *hd->a); /* Algorithm 1's `a = a/n` */
    size_t count = wkv_plan(sc->w, n, &s->cfg, k, sc->idx, sc->plan);
    if (s->merge && d->nmerges + count > d->merges_cap) {
        policy_set_err(err, errlen, "weightedkv: %zu merges do not fit the decision (room for %zu)",
                       d->nmerges + count, d->merges_cap);
        return -1;
    }
    for (size_t m = 0; m < count; m++)
        d->tier[k][sc->plan[m].from] = POLICY_EVICT;
    if (s->merge) {
        /* Chains (prefill) become merges into kept entries; the plan's
         * scratch is free again. */
        wkv_flatten(sc->plan, count, n, d->merges + d->nmerges, sc->idx, sc->coef);
        d->nmerges += count;
    }
    /* Entries before the first eviction stay where they are; after a
     * decode step's one, the rest move down as one block. */
    const uint8_t *first = memchr(d->tier[k], POLICY_EVICT, n);
    uint32_t out = first != NULL ? (uint32_t)(first - d->tier[k]) : n;
    if (out + 1 < n && memchr(first + 1, POLICY_EVICT, n - out - 1) == NULL) {
        memmove(hd->a + out, hd->a + out + 1, (size_t)(n - out - 1) * sizeof *hd->a);
        memmove(hd->c + out, hd->c + out + 1, (size_t)(n - out - 1) * sizeof *hd->c);
        hd->n = n - 1;
        return 0;
    }
    for (uint32_t i = out; i < n; i++)
        if (d->tier[k][i] != POLICY_EVICT) {
            hd->a[out] = hd->a[i];
            hd->c[out] = hd->c[i];
            out++;
        }
    hd->n = out;
    return 0;
}

static int wkv_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                    policy_decision *d, char *err, size_t errlen)
{
    wkv_state *s = state;
    if (view->layer >= s->layers || view->heads != s->kv_heads) {
        policy_set_err(err, errlen,
                       "weightedkv: view of layer %u with %u lists does not match the policy "
                       "(%u KV heads)",
                       view->layer, view->heads, s->kv_heads);
        return -1;
    }
    int window = stats->prefill && stats->window_attn != NULL && stats->window_queries > 0;
    if (check_stats(s, stats, window, err, errlen) != 0)
        return -1;
    wkv_head *heads = &s->heads[(size_t)view->layer * s->kv_heads];
    wkv_scratch *sc = &s->scratch[view->layer];
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        uint32_t n = view->tokens[k];
        if (stats->new_tokens > n || heads[k].n != n - stats->new_tokens) {
            policy_set_err(
                err, errlen,
                "weightedkv: head %u holds %u tokens with %u new, but the policy tracks %u "
                "(out of sync)",
                k, n, stats->new_tokens, heads[k].n);
            return -1;
        }
    }
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        if (reserve(sc, &heads[k], view->tokens[k]) != 0) {
            policy_set_err(err, errlen, "out of memory in policy 'weightedkv'");
            return -1;
        }
        int have_w = accumulate(s, sc, &heads[k], view, k, stats, window);
        if (merge_head(s, sc, &heads[k], k, have_w, d, err, errlen) != 0)
            return -1;
    }
    return 0;
}

/* ---- transactions (host.h) ---------------------------------------------- */

/* A saved layer: its kv_heads current pairs, which the layer's next step
 * leaves as they are (it writes the spare pairs): no copy. An imported
 * layer comes in the same form, in arrays of its own. The step's
 * wkv_scratch is not state. */
typedef struct wkv_saved {
    wkv_head *dst; /* the layer's heads (discard() is told only the copy) */
    uint32_t heads;
    wkv_head head[];
} wkv_saved;

/* A saved layer whose arrays are its own (an import that failed). */
static void saved_free(wkv_saved *c)
{
    for (uint32_t k = 0; c != NULL && k < c->heads; k++) {
        free(c->head[k].a);
        free(c->head[k].c);
    }
    free(c);
}

static void wkv_discard(void *saved)
{
    wkv_saved *c = saved;
    for (uint32_t k = 0; c != NULL && k < c->heads; k++) {
        wkv_head *hd = &c->dst[k], *sv = &c->head[k];
        if (hd->a == sv->a) {
            hd->pinned = 0; /* no step since: the pair is still the current one */
        } else if (hd->spare_cap == 0) {
            hd->spare_a = sv->a, hd->spare_c = sv->c, hd->spare_cap = sv->cap;
        } else {
            free(sv->a);
            free(sv->c);
        }
    }
    free(c);
}

static int wkv_save(void *state, uint32_t layer, void **saved)
{
    const wkv_state *s = state;
    wkv_head *src = &s->heads[(size_t)layer * s->kv_heads];
    wkv_saved *c = malloc(sizeof *c + s->kv_heads * sizeof c->head[0]);
    if (c == NULL) {
        errno = ENOMEM;
        return -1;
    }
    c->dst = src;
    c->heads = s->kv_heads;
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        c->head[k] = (wkv_head){.a = src[k].a, .c = src[k].c, .n = src[k].n, .cap = src[k].cap};
        src[k].pinned = 1;
    }
    *saved = c;
    return 0;
}

/* Make the saved (or imported) pairs current; a pair a step made current
 * since becomes the spare. */
static void wkv_restore(void *state, uint32_t layer, void *saved)
{
    wkv_state *s = state;
    wkv_saved *c = saved;
    wkv_head *dst = &s->heads[(size_t)layer * s->kv_heads];
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        wkv_head *hd = &dst[k], *sv = &c->head[k];
        if (hd->a != sv->a) {
            free(hd->spare_a);
            free(hd->spare_c);
            hd->spare_a = hd->a, hd->spare_c = hd->c, hd->spare_cap = hd->cap;
            hd->a = sv->a, hd->c = sv->c, hd->cap = sv->cap;
        }
        hd->n = sv->n;
        hd->pinned = 0;
    }
    free(c);
}

/* ---- moving a sequence (issue 17; the format in weightedkv.h) ------------ */

/* Doubles travel as their IEEE bits: the round trip is exact. */
static uint8_t *put_f64s(uint8_t *p, const double *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        p = policy_put_le(p, policy_f64_bits(x[i]), 8);
    return p;
}

/* ops->export_layer: the layer's kv_heads accumulators, as save copies them
 * (the config and the scratch come from create() on the other side). */
static void *wkv_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const wkv_state *s = state;
    const wkv_head *hd = &s->heads[(size_t)layer * s->kv_heads];
    *len = WKV_STATE_HEAD + 4 * (size_t)s->kv_heads;
    for (uint32_t k = 0; k < s->kv_heads; k++)
        *len += 16 * (size_t)hd[k].n;
    uint8_t *buf = malloc(*len);
    if (buf == NULL) {
        *len = 0;
        return NULL;
    }
    uint8_t *p = policy_put_le(buf, WKV_STATE_MAGIC, 4);
    p = policy_put_le(p, WKV_STATE_VERSION, 1);
    p = policy_put_le(p, s->kv_heads, 4);
    for (uint32_t k = 0; k < s->kv_heads; k++)
        p = policy_put_le(p, hd[k].n, 4);
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        p = put_f64s(p, hd[k].a, hd[k].n);
        p = put_f64s(p, hd[k].c, hd[k].n);
    }
    return buf;
}

/* The header and the counts, checked against the geometry, the parameters
 * and the length before any count sizes an allocation. */
static int import_check(const wkv_state *s, uint32_t layer, const uint8_t *p, size_t len, char *err,
                        size_t errlen)
{
    if (layer >= s->layers) {
        policy_set_err(err, errlen, "layer %u out of range (%u layers)", layer, s->layers);
        return -1;
    }
    uint64_t need = WKV_STATE_HEAD + 4 * (uint64_t)s->kv_heads;
    if (len < WKV_STATE_HEAD) {
        policy_set_err(err, errlen, "%zu bytes, shorter than the %u-byte header", len,
                       WKV_STATE_HEAD);
        return -1;
    }
    if (policy_get_le(p, 4) != WKV_STATE_MAGIC || p[4] != WKV_STATE_VERSION) {
        policy_set_err(err, errlen, "not weightedkv state version %u (magic %08x, version %u)",
                       WKV_STATE_VERSION, (unsigned)policy_get_le(p, 4), p[4]);
        return -1;
    }
    if (policy_get_le(p + 5, 4) != s->kv_heads) {
        policy_set_err(err, errlen, "state of %u KV heads, the geometry has %u",
                       (unsigned)policy_get_le(p + 5, 4), s->kv_heads);
        return -1;
    }
    if (len < need) {
        policy_set_err(err, errlen, "%zu bytes, too short for the counts of %u heads", len,
                       s->kv_heads);
        return -1;
    }
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        uint32_t n = (uint32_t)policy_get_le(p + WKV_STATE_HEAD + 4 * (size_t)k, 4);
        /* Every step ends with at most m entries (§4.1): more is not state
         * this policy can have. */
        if (n > s->cfg.cache_size) {
            policy_set_err(err, errlen, "head %u holds %u entries, more than cache_size %u", k, n,
                           s->cfg.cache_size);
            return -1;
        }
        need += 16 * (uint64_t)n;
    }
    if ((uint64_t)len != need) {
        policy_set_err(err, errlen, "the counts need %llu bytes, got %zu", (unsigned long long)need,
                       len);
        return -1;
    }
    return 0;
}

/* n doubles (their IEEE bits) at *p into x; advances *p. */
static void get_f64s(const uint8_t **p, double *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++, *p += 8)
        x[i] = policy_bits_f64(policy_get_le(*p, 8));
}

/* One head's a[n] and c[n] at *p into hd (arrays of exactly n, as save
 * makes them). Stats are finite (the daemon checks them), so every a is;
 * every entry was counted when it came (accumulate), so c >= 1 and
 * w = a/c is finite. */
static int import_head(wkv_head *hd, uint32_t k, uint32_t n, const uint8_t **p, char *err,
                       size_t errlen)
{
    hd->n = hd->cap = n;
    hd->a = policy_array_copy(NULL, 0, n, sizeof *hd->a);
    hd->c = policy_array_copy(NULL, 0, n, sizeof *hd->c);
    if (hd->a == NULL || hd->c == NULL) {
        policy_set_err(err, errlen, "out of memory in policy 'weightedkv'");
        return -1;
    }
    get_f64s(p, hd->a, n);
    get_f64s(p, hd->c, n);
    for (uint32_t i = 0; i < n; i++)
        if (!isfinite(hd->a[i]) || !(hd->c[i] >= 1.0 && isfinite(hd->c[i]))) {
            policy_set_err(err, errlen, "head %u entry %u: a = %g, c = %g (a finite, c >= 1)", k, i,
                           hd->a[i], hd->c[i]);
            return -1;
        }
    return 0;
}

/* ops->import_layer: check, read into a saved layer, and swap it in as
 * restore() does. */
static int wkv_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                            size_t errlen)
{
    wkv_state *s = state;
    const uint8_t *p = buf;
    if (import_check(s, layer, p, len, err, errlen) != 0)
        return -1;
    wkv_saved *c = calloc(1, sizeof *c + s->kv_heads * sizeof c->head[0]);
    if (c == NULL) {
        policy_set_err(err, errlen, "out of memory in policy 'weightedkv'");
        return -1;
    }
    c->heads = s->kv_heads;
    const uint8_t *at = p + WKV_STATE_HEAD + 4 * (size_t)s->kv_heads;
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        uint32_t n = (uint32_t)policy_get_le(p + WKV_STATE_HEAD + 4 * (size_t)k, 4);
        if (import_head(&c->head[k], k, n, &at, err, errlen) != 0) {
            saved_free(c);
            return -1;
        }
    }
    wkv_restore(s, layer, c);
    return 0;
}

/* ---- describe ------------------------------------------------------------ */

static void text_array(policy_text *t, const char *name, const double *x, uint32_t n)
{
    policy_text_add(t, "\"%s\":[", name);
    for (uint32_t i = 0; i < n; i++)
        policy_text_add(t, "%s%.9g", i ? "," : "", x[i]);
    policy_text_add(t, "]");
}

static char *wkv_describe(void *state, uint32_t layer)
{
    const wkv_state *s = state;
    if (s == NULL || layer >= s->layers)
        return NULL;
    policy_text t = {0};
    policy_text_add(&t, "{\"layer\":%u,\"heads\":[", layer);
    for (uint32_t k = 0; k < s->kv_heads; k++) {
        const wkv_head *hd = &s->heads[(size_t)layer * s->kv_heads + k];
        policy_text_add(&t, "%s{\"tokens\":%u,", k ? "," : "", hd->n);
        text_array(&t, "a", hd->a, hd->n);
        policy_text_add(&t, ",");
        text_array(&t, "c", hd->c, hd->n);
        policy_text_add(&t, "}");
    }
    policy_text_add(&t, "]}");
    return policy_text_finish(&t);
}

const policy_ops policy_weightedkv = {
    .name = "weightedkv",
    .summary = "WeightedKV: per KV head, drop the key of the lowest average-attention token and "
               "merge its value into the right neighbour (keeps cache_size entries)",
    .params = wkv_params,
    .nparams = sizeof(wkv_params) / sizeof(wkv_params[0]),
    .needs = POLICY_NEEDS_LAST_ATTN,
    .per_head = 1,
    .layers_concurrent = 1,
    .merges = 1,
    .create = wkv_create,
    .step = wkv_step,
    .describe = wkv_describe,
    .destroy = wkv_destroy,
    .save = wkv_save,
    .restore = wkv_restore,
    .discard = wkv_discard,
    .export_layer = wkv_export_layer,
    .import_layer = wkv_import_layer,
};
