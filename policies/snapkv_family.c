/*
 * snapkv_family.c - SnapKV scores, AdaKV budgets and CriticalKV two-stage
 * selection (POLICIES.md §1), and the step driver of the policies "snapkv",
 * "adakv", "criticalkv" and "criticalkv_ada" (snapkv_family.h).
 *
 * The reference is kvpress (SnapKVPress, AdaKVPress, CriticalKVPress,
 * CriticalAdaKVPress) as pinned in POLICIES.md §0. The reference masks
 * (head, position) pairs; here every KV head has its own token list
 * (ops->per_head = 1) and a masked pair is an EVICT in that head's list.
 */
#include "snapkv_family.h"

#include "describe.h"
#include "select.h"
#include "util.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- SnapKV base scores (§1.3) ---- */

/*
 * Average pooling (kvpress avg_pool1d, count_include_pad) works on blocks
 * of POOL_BLOCK outputs whose inputs are first copied, as doubles, into a
 * buffer padded with zeros where the window passes the row's ends: the
 * block then stays in L1 and every tap is one vectorisable pass. Each output
 * is still 0 + in[i-r] + ... + in[i+r] in that order, divided by the
 * kernel (the padded zeros add +0.0, which changes no sum that starts at
 * +0.0), so the bits are those of the one-at-a-time loop (pool_at).
 */
#define POOL_BLOCK 1024
#define POOL_KERNEL_MAX 1025 /* SNAPKV_PARAM_KERNEL's bound */

/* buf[0 .. m + 2r) = in[b - r .. b + m + r), 0 outside [0, n): the part
 * inside is [lo, hi) of buf. */
static void pool_pad(double *buf, size_t n, size_t b, size_t m, size_t r, size_t *lo, size_t *hi)
{
    *lo = b >= r ? 0 : r - b;
    *hi = b + m + r <= n ? m + 2 * r : n + r - b;
    for (size_t j = 0; j < *lo; j++)
        buf[j] = 0.0;
    for (size_t j = *hi; j < m + 2 * r; j++)
        buf[j] = 0.0;
}

static void pool_fill_double(double *buf, const double *in, size_t n, size_t b, size_t m, size_t r)
{
    size_t lo, hi;
    pool_pad(buf, n, b, m, r, &lo, &hi);
    for (size_t j = lo; j < hi; j++) /* b + j - r is in [0, n) here */
        buf[j] = in[b + j - r];
}

/* The same from floats; returns whether every float read was finite (the
 * policy checks the worker's numbers in the pass that reads them). */
static int pool_fill_float(double *buf, const float *in, size_t n, size_t b, size_t m, size_t r)
{
    size_t lo, hi;
    pool_pad(buf, n, b, m, r, &lo, &hi);
    int finite = 1;
    for (size_t j = lo; j < hi; j++) {
        float x = in[b + j - r];
        finite &= (x >= -FLT_MAX) & (x <= FLT_MAX);
        buf[j] = x;
    }
    return finite;
}

/*
 * s / d, correctly rounded, from y = 1 / d rounded: q = s·y is within an ulp
 * of the quotient, its remainder s - q·d is exact in an FMA, and one fused
 * step q + r·y rounds to the quotient itself (Markstein's theorem, for any
 * finite s whose quotient is a normal number, as every score here). The
 * same bits as a division, for a multiply and two FMAs: a vector divide
 * takes several times as long, and the pools divide every output of every
 * query head.
 */
static inline double quotient_by(double s, double d, double y)
{
    double q = s * y;
    double r = fma(-q, d, s);
    return fma(r, y, q);
}

/* acc[i] += (buf[i] + ... + buf[i + kernel - 1]) / kernel, i < m, one
 * output at a time: with a constant kernel the compiler unrolls the taps
 * and vectorises over i, the sum never leaving a register. The reference
 * sums from 0; starting from the first tap differs only when every tap is
 * -0 (a sum of -0 instead of +0), and adding -0 or +0 to an accumulator
 * that starts at +0 gives the same bits, so it saves an add an output. */
static inline void avg_pool_outputs(const double *buf, size_t m, uint32_t kernel, double *acc)
{
    double d = kernel, y = 1.0 / d;
    for (size_t i = 0; i < m; i++) {
        double s = buf[i];
        for (uint32_t t = 1; t < kernel; t++)
            s += buf[i + t];
        acc[i] += quotient_by(s, d, y);
    }
}

/* The same for any kernel: tap by tap over the block, in the same order. */
static void avg_pool_taps(const double *buf, size_t m, uint32_t kernel, double *acc)
{
    double sum[POOL_BLOCK], d = kernel, y = 1.0 / d;
    for (size_t i = 0; i < m; i++)
        sum[i] = 0.0;
    for (uint32_t t = 0; t < kernel; t++)
        for (size_t i = 0; i < m; i++)
            sum[i] += buf[i + t];
    for (size_t i = 0; i < m; i++)
        acc[i] += quotient_by(sum[i], d, y);
}

POLICY_HOT static void avg_pool_block(const double *buf, size_t m, uint32_t kernel, double *acc)
{
    switch (kernel) { /* kvpress's 5 and the AdaKV paper's 7 */
    case 5:
        avg_pool_outputs(buf, m, 5, acc);
        break;
    case 7:
        avg_pool_outputs(buf, m, 7, acc);
        break;
    default:
        avg_pool_taps(buf, m, kernel, acc);
        break;
    }
}

/* Output i of the pool, one at a time (max pooling). */
static double pool_at(const double *in, size_t n, uint32_t kernel, snapkv_pooling mode, size_t i)
{
    size_t r = kernel / 2;
    size_t lo = i >= r ? i - r : 0;
    size_t hi = i + r < n ? i + r : n - 1;
    if (mode == SNAPKV_POOL_MAX) {
        /* max_pool1d pads with -inf: only real positions can win. */
        double m = in[lo];
        for (size_t j = lo + 1; j <= hi; j++)
            if (in[j] > m)
                m = in[j];
        return m;
    }
    /* avg_pool1d, count_include_pad: the padded zeros count. */
    double s = 0;
    for (size_t j = lo; j <= hi; j++)
        s += in[j];
    return s / kernel;
}

POLICY_HOT void snapkv_pool(const double *in, size_t n, uint32_t kernel, snapkv_pooling mode,
                            double *out)
{
    size_t r = kernel / 2;
    if (mode == SNAPKV_POOL_MAX) {
        for (size_t i = 0; i < n; i++)
            out[i] = pool_at(in, n, kernel, mode, i);
        return;
    }
    double buf[POOL_BLOCK + POOL_KERNEL_MAX];
    for (size_t b = 0; b < n; b += POOL_BLOCK) {
        size_t m = n - b < POOL_BLOCK ? n - b : POOL_BLOCK;
        pool_fill_double(buf, in, n, b, m, r);
        for (size_t i = 0; i < m; i++)
            out[b + i] = 0.0;
        avg_pool_block(buf, m, kernel, out + b);
    }
}

/* One KV head's prefix scores with max pooling: each query head's row
 * converted to doubles (row, P entries) and pooled one output at a time. */
static int max_pool_group(const float *const *rows, uint32_t G, uint32_t P, uint32_t kernel,
                          double *acc, double *row)
{
    int finite = 1;
    memset(acc, 0, P * sizeof *acc);
    for (uint32_t h = 0; h < G; h++) {
        for (uint32_t i = 0; i < P; i++) {
            float x = rows[h][i];
            finite &= (x >= -FLT_MAX) & (x <= FLT_MAX);
            row[i] = x;
        }
        for (uint32_t i = 0; i < P; i++)
            acc[i] += pool_at(row, P, kernel, SNAPKV_POOL_MAX, i);
    }
    return finite;
}

/* The same with avg pooling, block by block: the G pooled rows are summed
 * in head order from 0 (as a memset accumulator would be). */
POLICY_HOT static int avg_pool_group(const float *const *rows, uint32_t G, uint32_t P,
                                     uint32_t kernel, double *acc)
{
    size_t r = kernel / 2;
    double buf[POOL_BLOCK + POOL_KERNEL_MAX];
    int finite = 1;
    for (size_t b = 0; b < P; b += POOL_BLOCK) {
        size_t m = P - b < POOL_BLOCK ? P - b : POOL_BLOCK;
        for (size_t i = 0; i < m; i++)
            acc[b + i] = 0.0;
        for (uint32_t h = 0; h < G; h++) {
            finite &= pool_fill_float(buf, rows[h], P, b, m, r);
            avg_pool_block(buf, m, kernel, acc + b);
        }
    }
    return finite;
}

POLICY_HOT int snapkv_base_scores(const float *const *window_attn, uint32_t q_heads,
                                  uint32_t kv_heads, const uint32_t *len, const uint32_t *prefix,
                                  uint32_t kernel, snapkv_pooling pool, snapkv_window_pad pad,
                                  double *const *score, double *scratch)
{
    uint32_t G = q_heads / kv_heads;
    double mx = -INFINITY;
    int finite = 1;
    for (uint32_t g = 0; g < kv_heads; g++) {
        uint32_t P = prefix[g];
        if (P == 0)
            continue;
        double *acc = score[g];
        if (pool == SNAPKV_POOL_MAX)
            finite &= max_pool_group(window_attn + (size_t)g * G, G, P, kernel, acc, scratch);
        else
            finite &= avg_pool_group(window_attn + (size_t)g * G, G, P, kernel, acc);
        double d = G, y = 1.0 / d;
        for (uint32_t i = 0; i < P; i++)
            acc[i] = quotient_by(acc[i], d, y); /* GQA: mean over the group's query heads */
        double head_max = policy_max(acc, P);
        mx = head_max > mx ? head_max : mx;
    }
    /* The max over every head's prefix, as kvpress's scores.max(). */
    double win = pad == SNAPKV_PAD_MAX_PLUS_ONE ? mx + 1 : mx;
    for (uint32_t g = 0; g < kv_heads; g++)
        for (uint32_t i = prefix[g]; i < len[g]; i++)
            score[g][i] = win;
    return finite;
}

size_t snapkv_n_keep(size_t L, double compression_ratio)
{
    return (size_t)((double)L * (1.0 - compression_ratio));
}

size_t criticalkv_stage1_size(size_t L, double compression_ratio, double alpha)
{
    return (size_t)((1.0 - compression_ratio) * (double)L * alpha);
}

/* ---- selection ---- */

/*
 * Every selection here orders entries by class first (forced entries come
 * first in a top-k, last in a bottom-k), then by key, then by position
 * (index, or head then index when the heads are flattened). The keys of the
 * class that comes first go to the front of tmp, the others to the back,
 * and the cut is made in the one class the boundary falls in: all of the
 * first class is chosen when it has at most k entries. cut_of() returns that
 * cut and whether it belongs to the first class.
 */
typedef struct class_cut {
    policy_cut cut;
    int in_first; /* the cut is among the first class; else all of it is chosen */
} class_cut;

static class_cut cut_of(uint64_t *tmp, size_t first, size_t n, size_t k)
{
    if (k <= first)
        return (class_cut){policy_select_cut(tmp, first, k), 1};
    return (class_cut){policy_select_cut(tmp + first, n - first, k - first), 0};
}

/* Put the key of the next entry at the front of tmp (tmp[(*f)++]) when
 * it is of the first class, else at the back (tmp[--(*u)]). Both slots are
 * written and one kept, without a branch: stage 1's winners are random, so
 * the class would mispredict. *f < *u before each call. */
static inline void place(uint64_t *tmp, size_t *f, size_t *u, uint64_t key, int first)
{
    tmp[*f] = key;
    tmp[*u - 1] = key;
    *f += (size_t)first;
    *u -= (size_t)!first;
}

/*
 * chosen[i] = whether entry i of one row is chosen by c, for the rows of a
 * selection visited in position order (c's ties count down across rows).
 * The key is policy_key(sign·score[i]) (sign -1 for a top-k); entry i is of
 * the class that comes first when (forced[i] != 0) == forced_first. chosen
 * must not alias forced.
 */
static void choose_row(const double *score, double sign, const uint8_t *forced, int forced_first,
                       size_t n, class_cut *c, uint8_t *chosen)
{
    uint8_t ff = forced_first != 0;
    if (c->in_first) {
        policy_cut_mark(&c->cut, score, sign, forced, ff, n, 0, chosen);
        return;
    }
    policy_cut_mark(&c->cut, score, sign, forced, !ff, n, 0, chosen);
    for (size_t i = 0; i < n; i++) /* the whole first class is chosen */
        chosen[i] |= (uint8_t)((forced[i] != 0) == ff);
}

POLICY_HOT void snapkv_mark_top(const double *score, const uint8_t *forced, size_t n, size_t k,
                                uint8_t *mark, snapkv_entry *tmp)
{
    if (k > n)
        k = n;
    if (k == 0)
        return;
    /* Top-k: forced first, then higher score (key -score), lower index. */
    size_t f = 0;
    for (size_t i = 0; i < n; i++)
        f += forced[i] != 0;
    class_cut c;
    if (k > f) { /* all the forced and the best others: one pass */
        policy_score_keys kd = {-1.0, &forced, 0};
        uint32_t len = (uint32_t)n;
        c = (class_cut){policy_select_cut_rows(&score, &len, 1, &kd, k, tmp), 0};
    } else {
        size_t u = n;
        f = 0;
        for (size_t i = 0; i < n; i++)
            place(tmp, &f, &u, policy_key(-score[i]), forced[i] != 0);
        c = cut_of(tmp, f, n, k);
    }
    /* The chosen are marked; marks already set stay (mark may be forced). */
    uint8_t *chosen = (uint8_t *)tmp; /* the keys are spent: n bytes of room */
    choose_row(score, -1.0, forced, 1, n, &c, chosen);
    for (size_t i = 0; i < n; i++)
        mark[i] |= chosen[i];
}

void criticalkv_select(const double *a, const float *vnorm, size_t n, size_t n_keep, size_t b1,
                       double eps, uint8_t *forced, double *z, uint8_t *keep, snapkv_entry *tmp)
{
    /* Stage 1: the b1 best by attention alone are forced (§1.4). */
    snapkv_mark_top(a, forced, n, b1, forced, tmp);
    /* Stage 2: (a + eps)·n; eps goes on the attention, not the norm. */
    for (size_t i = 0; i < n; i++)
        z[i] = (a[i] + eps) * (double)vnorm[i];
    memset(keep, 0, n);
    snapkv_mark_top(z, forced, n, n_keep, keep, tmp);
}

/* The key of a[g][i]: -a for a top-k, a for a bottom-k. */
static uint64_t flat_key(double a, int top_k)
{
    return policy_key(top_k ? -a : a);
}

/* Every entry of every head flattened head-major, as the reference's
 * scores.reshape(bsz, -1): the keys of the class that comes first (forced
 * for a top-k, unforced for a bottom-k) at the front of tmp. Returns the
 * cut of the k first. */
static class_cut flat_cut(const double *const *a, const uint32_t *len, uint32_t heads,
                          const uint8_t *const *forced, int top_k, size_t n, size_t k,
                          snapkv_entry *tmp)
{
    /* The first class is the forced (top-k) or the unforced (bottom-k);
     * a cut among the unforced is one pass (policy_select_cut_rows). */
    size_t f = 0, u = n, n_forced = 0;
    for (uint32_t g = 0; g < heads; g++)
        for (uint32_t i = 0; i < len[g]; i++)
            n_forced += forced[g][i] != 0;
    if (top_k && k > n_forced) {
        policy_score_keys kd = {-1.0, forced, 0};
        return (class_cut){policy_select_cut_rows(a, len, heads, &kd, k, tmp), 0};
    }
    if (!top_k && k <= n - n_forced) {
        policy_score_keys kd = {1.0, forced, UINT64_MAX};
        return (class_cut){policy_select_cut_rows(a, len, heads, &kd, k, tmp), 1};
    }
    for (uint32_t g = 0; g < heads; g++)
        for (uint32_t i = 0; i < len[g]; i++)
            place(tmp, &f, &u, flat_key(a[g][i], top_k), (forced[g][i] != 0) == (top_k != 0));
    return cut_of(tmp, f, n, k);
}

static size_t total_len(const uint32_t *len, uint32_t heads)
{
    size_t n = 0;
    for (uint32_t g = 0; g < heads; g++)
        n += len[g];
    return n;
}

/* The AdaKV safeguard (§1.5): each head's n_safe best are forced. */
static void adakv_safeguard(const double *const *a, const uint32_t *len, uint32_t heads,
                            size_t n_safe, uint8_t *const *forced, snapkv_entry *tmp)
{
    for (uint32_t g = 0; g < heads; g++)
        snapkv_mark_top(a[g], forced[g], len[g], n_safe, forced[g], tmp);
}

size_t adakv_budgets(const double *const *a, const uint32_t *len, uint32_t heads, size_t n_safe,
                     size_t total, uint8_t *const *forced, uint32_t *B, snapkv_entry *tmp)
{
    adakv_safeguard(a, len, heads, n_safe, forced, tmp);
    size_t n = total_len(len, heads);
    if (total > n)
        total = n;
    /* The `total` best of all heads (forced first, higher score, lower
     * head, lower index); B[g] = how many head g won. */
    class_cut c = flat_cut(a, len, heads, (const uint8_t *const *)forced, 1, n, total, tmp);
    uint8_t *chosen = (uint8_t *)tmp; /* the keys are spent: n bytes of room */
    for (uint32_t g = 0; g < heads; g++) {
        choose_row(a[g], -1.0, forced[g], 1, len[g], &c, chosen);
        uint32_t won = 0;
        for (uint32_t i = 0; i < len[g]; i++)
            won += chosen[i];
        B[g] = won;
    }
    return total;
}

void adakv_select(const double *const *a, const uint32_t *len, uint32_t heads, size_t total,
                  const uint8_t *const *forced, uint8_t *const *keep, snapkv_entry *tmp)
{
    size_t n = total_len(len, heads);
    if (total >= n) {
        for (uint32_t g = 0; g < heads; g++)
            memset(keep[g], 1, len[g]);
        return;
    }
    /* AdaKVPress evicts topk(-scores) of the flattened heads: bottom-k,
     * unforced first, lower score, lower head, lower index. */
    class_cut c = flat_cut(a, len, heads, forced, 0, n, n - total, tmp);
    for (uint32_t g = 0; g < heads; g++) {
        choose_row(a[g], 1.0, forced[g], 0, len[g], &c, keep[g]); /* chosen: evicted */
        for (uint32_t i = 0; i < len[g]; i++)
            keep[g][i] = !keep[g][i];
    }
}

/* ---- configuration ---- */

static int variant_ada(snapkv_variant v)
{
    return v == SNAPKV_ADA || v == SNAPKV_CRITICAL_ADA;
}

static int variant_critical(snapkv_variant v)
{
    return v == SNAPKV_CRITICAL || v == SNAPKV_CRITICAL_ADA;
}

static const char *const variant_name[] = {"snapkv", "adakv", "criticalkv", "criticalkv_ada"};

const char *const snapkv_pooling_names[] = {"avg", "max", NULL};
const char *const snapkv_window_pad_names[] = {"max_plus_one", "max", NULL};

/* Parse and validate the parameters of `variant` with its policy's spec
 * (keys it does not declare keep their defaults). Returns 0, or -1 with err
 * naming the parameter. */
static int snapkv_config_parse(const policy_params *p, snapkv_variant variant,
                               const policy_param_spec *spec, size_t n, snapkv_config *cfg,
                               char *err, size_t errlen)
{
    snapkv_config c = {
        .variant = variant, .first_stage_ratio = 0.5, .epsilon = 1e-4, .alpha_safeguard = 0.2};
    if (policy_params_parse(p, spec, n, &c, err, errlen) != 0)
        return -1;
    if (c.compression_ratio >= 1) {
        policy_set_err(err, errlen, "parameter compression_ratio must be in [0, 1), got '%s'",
                       policy_params_get(p, "compression_ratio"));
        return -1;
    }
    if (c.kernel % 2 == 0) {
        /* An even kernel with k/2 padding yields L+1 pooled scores. */
        policy_set_err(err, errlen, "parameter kernel must be odd, got %u", c.kernel);
        return -1;
    }
    if (c.budget != 0 && c.budget <= c.window) {
        /* Otherwise a held list could exceed the budget with L <= window,
         * where SnapKV cannot score it (§1.7), and grow without bound. */
        policy_set_err(err, errlen,
                       "parameter budget must be 0 (off) or greater than window (%u), got %u",
                       c.window, c.budget);
        return -1;
    }
    *cfg = c;
    return 0;
}

/* ---- state ---- */

/* What the last compression (or skip) of one layer did, for describe(). */
typedef struct snapkv_head_record {
    uint32_t held, prefix, kept;
    uint32_t forced; /* tokens forced (window guard, safeguard, stage 1) */
    uint32_t *pos;   /* [kept] positions of the kept tokens */
    float *score;    /* [kept] their base (SnapKV) scores, as float */
    float *z;        /* [kept] their stage-2 scores; NULL but for the criticalkv variants */
    uint8_t *force;  /* [kept] forced by the window guard, safeguard or stage 1 */
} snapkv_head_record;

typedef struct snapkv_layer_record {
    uint64_t compressions, last_step;
    char event[192];
    snapkv_head_record *heads; /* [kv_heads] */
} snapkv_layer_record;

struct snapkv_state {
    snapkv_config cfg;
    uint32_t layers, q_heads, kv_heads;
    snapkv_layer_record *rec; /* [layers] */
};

static void record_free(snapkv_layer_record *r, uint32_t heads)
{
    for (uint32_t g = 0; r->heads != NULL && g < heads; g++) {
        free(r->heads[g].pos);
        free(r->heads[g].score);
        free(r->heads[g].z);
        free(r->heads[g].force);
    }
    free(r->heads);
}

void snapkv_family_destroy(void *state)
{
    snapkv_state *st = state;
    if (st == NULL)
        return;
    for (uint32_t l = 0; st->rec != NULL && l < st->layers; l++)
        record_free(&st->rec[l], st->kv_heads);
    free(st->rec);
    free(st);
}

int snapkv_family_create(const policy_params *p, const policy_geometry *g, snapkv_variant variant,
                         const policy_ops *ops, void **state, char *err, size_t errlen)
{
    *state = NULL;
    snapkv_config cfg;
    if (snapkv_config_parse(p, variant, ops->params, ops->nparams, &cfg, err, errlen) != 0)
        return -1;
    if (g->layers == 0 || g->kv_heads == 0 || g->q_heads == 0 || g->q_heads % g->kv_heads != 0) {
        policy_set_err(
            err, errlen,
            "policy %s needs layers >= 1 and q_heads a multiple of kv_heads, got layers=%u "
            "q_heads=%u kv_heads=%u",
            variant_name[variant], g->layers, g->q_heads, g->kv_heads);
        return -1;
    }
    snapkv_state *st = calloc(1, sizeof *st);
    if (st == NULL)
        goto oom;
    st->cfg = cfg;
    st->layers = g->layers;
    st->q_heads = g->q_heads;
    st->kv_heads = g->kv_heads;
    st->rec = calloc(g->layers, sizeof *st->rec);
    if (st->rec == NULL)
        goto oom;
    for (uint32_t l = 0; l < g->layers; l++) {
        st->rec[l].heads = calloc(g->kv_heads, sizeof *st->rec[l].heads);
        if (st->rec[l].heads == NULL)
            goto oom;
        snprintf(st->rec[l].event, sizeof st->rec[l].event, "none");
    }
    *state = st;
    return 0;
oom:
    snapkv_family_destroy(st);
    policy_set_err(err, errlen, "out of memory creating policy '%s'", variant_name[variant]);
    return -1;
}

/* ---- step ---- */

/* The per-compression work arrays, one allocation each. */
typedef struct work {
    double **a, **z;
    uint8_t **forced, **keep;
    uint32_t *len, *prefix, *B;
    snapkv_entry *tmp;
    double *scratch;
} work;

static void work_free(work *w, uint32_t heads)
{
    for (uint32_t g = 0; g < heads; g++) {
        if (w->a)
            free(w->a[g]);
        if (w->z)
            free(w->z[g]);
        if (w->forced)
            free(w->forced[g]);
        if (w->keep)
            free(w->keep[g]);
    }
    free(w->a);
    free(w->z);
    free(w->forced);
    free(w->keep);
    free(w->len);
    free(w->prefix);
    free(w->B);
    free(w->tmp);
    free(w->scratch);
}

/* The work arrays of one compression; z (CriticalKV's stage-2 scores, each
 * written before it is read) only with `stage2`: a plain SnapKV step at
 * 32k tokens would otherwise zero 2 MiB a layer it never reads. */
static int work_alloc(work *w, const policy_layer_view *view, size_t total, uint32_t Lmax,
                      int stage2)
{
    uint32_t H = view->heads;
    memset(w, 0, sizeof *w);
    w->a = calloc(H, sizeof *w->a);
    w->z = calloc(H, sizeof *w->z);
    w->forced = calloc(H, sizeof *w->forced);
    w->keep = calloc(H, sizeof *w->keep);
    w->len = calloc(H, sizeof *w->len);
    w->prefix = calloc(H, sizeof *w->prefix);
    w->B = calloc(H, sizeof *w->B);
    w->tmp = malloc((total ? total : 1) * sizeof *w->tmp);
    w->scratch = malloc(2 * ((size_t)Lmax + 1) * sizeof *w->scratch);
    if (!w->a || !w->z || !w->forced || !w->keep || !w->len || !w->prefix || !w->B || !w->tmp ||
        !w->scratch)
        return -1;
    for (uint32_t g = 0; g < H; g++) {
        size_t n = view->tokens[g] ? view->tokens[g] : 1;
        w->a[g] = malloc(n * sizeof *w->a[g]);
        w->z[g] = stage2 ? malloc(n * sizeof *w->z[g]) : NULL;
        w->forced[g] = calloc(n, 1);
        w->keep[g] = calloc(n, 1);
        if (!w->a[g] || (stage2 && !w->z[g]) || !w->forced[g] || !w->keep[g])
            return -1;
    }
    return 0;
}

/* Check the window_attn a compression reads: present and finite (the
 * first bad entry in head order is named). */
static int check_window_attn(const snapkv_state *st, const policy_layer_view *view,
                             const policy_stats *stats, const uint32_t *prefix, char *err,
                             size_t errlen)
{
    const char *name = variant_name[st->cfg.variant];
    uint32_t G = st->q_heads / st->kv_heads;
    for (uint32_t h = 0; h < st->q_heads; h++) {
        const float *row = stats->window_attn[h];
        if (row == NULL && prefix[h / G] > 0) {
            policy_set_err(err, errlen, "policy %s: window_attn of query head %u is missing", name,
                           h);
            return -1;
        }
        size_t bad = policy_first_outside(row, prefix[h / G], -FLT_MAX);
        if (bad < prefix[h / G]) {
            policy_set_err(err, errlen,
                           "policy %s: window_attn[%u][%zu] is not a finite number (layer %u)",
                           name, h, bad, view->layer);
            return -1;
        }
    }
    return 0;
}

/* Whether every query head with prefix tokens has its window_attn row. */
static int window_attn_present(const snapkv_state *st, const policy_stats *stats,
                               const uint32_t *prefix)
{
    uint32_t G = st->q_heads / st->kv_heads;
    for (uint32_t h = 0; h < st->q_heads; h++)
        if (stats->window_attn[h] == NULL && prefix[h / G] > 0)
            return 0;
    return 1;
}

/* Check the vnorm a criticalkv compression reads: present, finite, >= 0. */
static int check_vnorm(const snapkv_state *st, const policy_layer_view *view,
                       const policy_stats *stats, char *err, size_t errlen)
{
    const char *name = variant_name[st->cfg.variant];
    if (!variant_critical(st->cfg.variant))
        return 0;
    if (stats->vnorm == NULL) {
        policy_set_err(err, errlen,
                       "policy %s needs vnorm (projected value norms, POLICIES.md §1.2) on a "
                       "compression step (layer %u)",
                       name, view->layer);
        return -1;
    }
    for (uint32_t g = 0; g < view->heads; g++) {
        const float *row = stats->vnorm[g];
        if (row == NULL && view->tokens[g] > 0) {
            policy_set_err(err, errlen, "policy %s: vnorm of KV head %u is missing", name, g);
            return -1;
        }
        size_t bad = policy_first_outside(row, view->tokens[g], 0.0f);
        if (bad < view->tokens[g]) {
            policy_set_err(err, errlen,
                           "policy %s: vnorm[%u][%zu] must be a finite number >= 0 (layer %u)",
                           name, g, bad, view->layer);
            return -1;
        }
    }
    return 0;
}

/* Run the variant's selection on the work arrays: w->keep gets the answer. */
static void select_tokens(const snapkv_state *st, const policy_stats *stats, work *w, size_t total)
{
    const snapkv_config *c = &st->cfg;
    uint32_t H = st->kv_heads;
    if (!variant_ada(c->variant)) {
        for (uint32_t g = 0; g < H; g++) {
            size_t L = w->len[g];
            size_t n_keep = c->budget ? (L < c->budget ? L : c->budget)
                                      : snapkv_n_keep(L, c->compression_ratio);
            w->B[g] = (uint32_t)n_keep;
            if (c->variant == SNAPKV_PLAIN) {
                snapkv_mark_top(w->a[g], w->forced[g], L, n_keep, w->keep[g], w->tmp);
                continue;
            }
            /* [RECON] budget mode has no ratio: stage 1 is int(n_keep·α). */
            size_t b1 = c->budget
                            ? (size_t)((double)n_keep * c->first_stage_ratio)
                            : criticalkv_stage1_size(L, c->compression_ratio, c->first_stage_ratio);
            if (b1 > n_keep)
                b1 = n_keep;
            criticalkv_select(w->a[g], stats->vnorm[g], L, n_keep, b1, c->epsilon, w->forced[g],
                              w->z[g], w->keep[g], w->tmp);
        }
        return;
    }
    /* Ada: one budget for all heads. With equal lists the mean length is
     * L itself, so n_keep = int(L·(1 − cr)) exactly as the reference;
     * [RECON] lists that diverged earlier use their mean length. */
    size_t n_keep =
        c->budget ? c->budget : (size_t)(((double)total / H) * (1.0 - c->compression_ratio));
    size_t n_safe = (size_t)((double)n_keep * c->alpha_safeguard);
    if (c->variant == SNAPKV_ADA) {
        /* The per-head budgets are not needed: the safeguard, then the
         * flattened bottom-k (total clamped as adakv_budgets does). */
        adakv_safeguard((const double *const *)w->a, w->len, H, n_safe, w->forced, w->tmp);
        size_t K = n_keep * H < total ? n_keep * H : total;
        adakv_select((const double *const *)w->a, w->len, H, K, (const uint8_t *const *)w->forced,
                     w->keep, w->tmp);
        return;
    }
    adakv_budgets((const double *const *)w->a, w->len, H, n_safe, n_keep * H, w->forced, w->B,
                  w->tmp);
    for (uint32_t g = 0; g < H; g++) {
        size_t b1 = criticalkv_ada_stage1_size(w->B[g], c->first_stage_ratio);
        criticalkv_select(w->a[g], stats->vnorm[g], w->len[g], w->B[g], b1, c->epsilon,
                          w->forced[g], w->z[g], w->keep[g], w->tmp);
    }
}

/* Bit j of the result: keep[j] (each 0 or 1), j < n <= 64; eight flags at
 * a time packed into the bits of a byte by one multiplication. */
static uint64_t keep_bits(const uint8_t *keep, uint32_t n)
{
    uint64_t bits = 0;
    uint32_t j = 0;
    for (; j + 8 <= n; j += 8) {
        uint64_t w;
        memcpy(&w, keep + j, sizeof w);
        bits |= ((w * UINT64_C(0x0102040810204080)) >> 56) << j;
    }
    for (; j < n; j++)
        bits |= (uint64_t)(keep[j] != 0) << j;
    return bits;
}

/* The kept tokens' entries of a head record, in position order (z NULL:
 * no stage 2, its scores are 0). Only the set bits of 64 flags at a time
 * are visited: a branch per token, or per byte of flags, would mispredict
 * with a quarter of random tokens kept. */
static void record_kept(snapkv_head_record *hr, const uint32_t *pos, const double *a,
                        const double *z, const uint8_t *forced, const uint8_t *keep, uint32_t n)
{
    /* Local pointers: the record's fields could alias what they copy. */
    uint32_t *restrict out_pos = hr->pos;
    float *restrict out_score = hr->score, *restrict out_z = z != NULL ? hr->z : NULL;
    uint8_t *restrict out_force = hr->force;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i += 64) {
        uint64_t bits = keep_bits(keep + i, n - i < 64 ? n - i : 64);
        for (; bits != 0; bits &= bits - 1) {
            uint32_t j = i + (uint32_t)__builtin_ctzll(bits);
            out_pos[k] = pos[j];
            out_score[k] = (float)a[j];
            out_force[k] = forced[j];
            if (out_z != NULL)
                out_z[k] = (float)z[j];
            k++;
        }
    }
}

/* Keep the record of a compression: the kept tokens with their scores. */
POLICY_HOT static int record_compression(snapkv_state *st, const policy_layer_view *view,
                                         const work *w)
{
    snapkv_layer_record *r = &st->rec[view->layer];
    for (uint32_t g = 0; g < view->heads; g++) {
        snapkv_head_record *hr = &r->heads[g];
        uint32_t kept = 0;
        for (uint32_t i = 0; i < w->len[g]; i++)
            kept += w->keep[g][i];
        /* All four first: a failure must leave the record's arrays and its
         * `kept` in step (describe, save and export read kept entries). */
        size_t n = kept ? kept : 1;
        int critical = variant_critical(st->cfg.variant);
        uint32_t *pos = malloc(n * sizeof *pos);
        float *score = malloc(n * sizeof *score), *z = critical ? malloc(n * sizeof *z) : NULL;
        uint8_t *force = malloc(n);
        if (pos == NULL || score == NULL || (critical && z == NULL) || force == NULL) {
            free(pos), free(score), free(z), free(force);
            return -1;
        }
        free(hr->pos), free(hr->score), free(hr->z), free(hr->force);
        hr->pos = pos;
        hr->score = score;
        hr->z = z;
        hr->force = force;
        hr->held = w->len[g];
        hr->prefix = w->prefix[g];
        hr->kept = kept;
        uint32_t forced = 0;
        for (uint32_t i = 0; i < w->len[g]; i++)
            forced += w->forced[g][i];
        hr->forced = forced;
        const double *stage2 = critical ? w->z[g] : NULL;
        record_kept(hr, view->positions[g], w->a[g], stage2, w->forced[g], w->keep[g], w->len[g]);
    }
    r->compressions++;
    r->last_step = view->step;
    snprintf(r->event, sizeof r->event, "compressed");
    return 0;
}

static void record_skip(snapkv_state *st, const policy_layer_view *view, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void record_skip(snapkv_state *st, const policy_layer_view *view, const char *fmt, ...)
{
    snapkv_layer_record *r = &st->rec[view->layer];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->event, sizeof r->event, fmt, ap);
    va_end(ap);
    r->last_step = view->step;
}

/* Whether this step compresses (1), waits (0), or is an error (-1). */
static int due(const snapkv_state *st, const policy_layer_view *view, const policy_stats *stats,
               size_t total, uint32_t Lmax, char *err, size_t errlen)
{
    const snapkv_config *c = &st->cfg;
    if (c->budget == 0) /* kvpress: compress once, at the end of the prompt */
        return stats->prefill && stats->window_attn != NULL;
    int over = variant_ada(c->variant) ? total > (size_t)c->budget * view->heads : Lmax > c->budget;
    if (!over)
        return 0;
    if (stats->window_attn != NULL)
        return 1;
    if (stats->prefill)
        return 0; /* the window attention comes with the prompt's last step */
    policy_set_err(err, errlen,
                   "policy %s needs window_attn on decode steps over budget (layer %u holds %zu "
                   "tokens, budget %u per head)",
                   variant_name[c->variant], view->layer, total, c->budget);
    return -1;
}

/* tier[i] = EVICT where keep[i] is 0 (branch-free: keep is random). */
int snapkv_family_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                       policy_decision *d, char *err, size_t errlen)
{
    snapkv_state *st = state;
    const snapkv_config *c = &st->cfg;
    const char *name = variant_name[c->variant];
    if (view->heads != st->kv_heads || view->layer >= st->layers) {
        policy_set_err(err, errlen,
                       "policy %s: view of layer %u has %u lists, expected %u (kv_heads)", name,
                       view->layer, view->heads, st->kv_heads);
        return -1;
    }
    size_t total = 0;
    uint32_t Lmax = 0;
    for (uint32_t g = 0; g < view->heads; g++) {
        total += view->tokens[g];
        if (view->tokens[g] > Lmax)
            Lmax = view->tokens[g];
    }
    int go = due(st, view, stats, total, Lmax, err, errlen);
    if (go <= 0)
        return go;
    if (c->budget == 0 && c->compression_ratio == 0) {
        record_skip(st, view, "skipped: compression_ratio = 0");
        return 0;
    }
    if (stats->window_queries != 0 && stats->window_queries != c->window) {
        policy_set_err(err, errlen,
                       "policy %s: window_attn averages %u queries but parameter window is %u",
                       name, stats->window_queries, c->window);
        return -1;
    }
    if (Lmax <= c->window) {
        record_skip(st, view,
                    "skipped: L = %u <= window = %u (SnapKV needs more tokens than its "
                    "observation window, POLICIES.md §1.7)",
                    Lmax, c->window);
        return 0;
    }
    /* Window tokens: the positions of the window's own queries. */
    uint64_t wstart = view->appended - c->window;
    work w;
    if (work_alloc(&w, view, total, Lmax, variant_critical(c->variant)) != 0) {
        work_free(&w, view->heads);
        policy_set_err(err, errlen, "policy %s: out of memory", name);
        return -1;
    }
    for (uint32_t g = 0; g < view->heads; g++) {
        /* Positions ascend: the prefix is those below wstart. */
        uint32_t P = 0, hi = view->tokens[g];
        while (P < hi) {
            uint32_t mid = P + (hi - P) / 2;
            if (view->positions[g][mid] < wstart)
                P = mid + 1;
            else
                hi = mid;
        }
        w.len[g] = view->tokens[g];
        w.prefix[g] = P;
        /* §1.7 / §6 #2: protect_window forces window tokens from the start. */
        for (uint32_t i = P; c->protect_window && i < w.len[g]; i++)
            w.forced[g][i] = 1;
    }
    /* The window attention is checked for finite numbers in the pass that
     * pools it (one read of the biggest input); only a bad row is read
     * again, to name its first bad entry. Missing rows are found first. */
    if (!window_attn_present(st, stats, w.prefix) ||
        !snapkv_base_scores(stats->window_attn, st->q_heads, st->kv_heads, w.len, w.prefix,
                            c->kernel, c->pooling, c->window_pad, w.a, w.scratch)) {
        check_window_attn(st, view, stats, w.prefix, err, errlen);
        work_free(&w, view->heads);
        return -1;
    }
    if (check_vnorm(st, view, stats, err, errlen) != 0) {
        work_free(&w, view->heads);
        return -1;
    }
    select_tokens(st, stats, &w, total);
    for (uint32_t g = 0; g < view->heads; g++) {
        for (uint32_t i = w.prefix[g]; c->protect_window && i < w.len[g]; i++)
            w.keep[g][i] = 1; /* even past n_keep when window > n_keep */
        policy_evict_marked(d->tier[g], w.keep[g], 0, w.len[g]);
    }
    int rc = record_compression(st, view, &w);
    work_free(&w, view->heads);
    if (rc != 0) {
        policy_set_err(err, errlen, "policy %s: out of memory", name);
        return -1;
    }
    return 0;
}

/* ---- transactions (host.h) ---- */

/* A saved layer record, with the head count that frees it. The heads'
 * arrays hold exactly `kept` entries, as record_compression() sizes them. */
typedef struct snapkv_saved {
    uint32_t heads;
    snapkv_layer_record rec;
} snapkv_saved;

void snapkv_family_discard(void *saved)
{
    snapkv_saved *c = saved;
    if (c == NULL)
        return;
    record_free(&c->rec, c->heads);
    free(c);
}

int snapkv_family_save(void *state, uint32_t layer, void **saved)
{
    const snapkv_state *st = state;
    const snapkv_layer_record *r = &st->rec[layer];
    snapkv_saved *c = calloc(1, sizeof *c);
    if (c == NULL)
        goto oom;
    c->heads = st->kv_heads;
    c->rec = *r;
    c->rec.heads = calloc(st->kv_heads, sizeof *c->rec.heads);
    if (c->rec.heads == NULL)
        goto oom;
    for (uint32_t g = 0; g < st->kv_heads; g++) {
        const snapkv_head_record *from = &r->heads[g];
        snapkv_head_record *to = &c->rec.heads[g];
        *to = *from;
        to->pos = policy_array_copy(from->pos, from->kept, from->kept, sizeof *from->pos);
        to->score = policy_array_copy(from->score, from->kept, from->kept, sizeof *from->score);
        to->z = from->z != NULL
                    ? policy_array_copy(from->z, from->kept, from->kept, sizeof *from->z)
                    : NULL;
        to->force = policy_array_copy(from->force, from->kept, from->kept, sizeof *from->force);
        if (!to->pos || !to->score || (from->z != NULL && !to->z) || !to->force)
            goto oom;
    }
    *saved = c;
    return 0;
oom:
    snapkv_family_discard(c);
    errno = ENOMEM;
    return -1;
}

void snapkv_family_restore(void *state, uint32_t layer, void *saved)
{
    snapkv_state *st = state;
    snapkv_saved *c = saved;
    record_free(&st->rec[layer], st->kv_heads);
    st->rec[layer] = c->rec;
    free(c);
}

/* ---- moving a sequence (policy.h export_layer / import_layer) ---- */

/* The byte format is in snapkv_family.h; these sizes follow it. */
static const uint8_t wire_magic[4] = {'S', 'K', 'V', 'F'};
#define WIRE_HEADER 31u /* magic .. last_step */
#define WIRE_HEAD 16u   /* held, prefix, kept, forced */
#define WIRE_ENTRY 13u  /* position, score, stage-2 score, is_forced */

static uint8_t *export_head_entries(uint8_t *p, const snapkv_head_record *hr)
{
    for (uint32_t k = 0; k < hr->kept; k++)
        p = policy_put_le(p, hr->pos[k], 4);
    for (uint32_t k = 0; k < hr->kept; k++)
        p = policy_put_le(p, policy_f32_bits(hr->score[k]), 4);
    for (uint32_t k = 0; k < hr->kept; k++) /* 0 without a stage 2 */
        p = policy_put_le(p, hr->z != NULL ? policy_f32_bits(hr->z[k]) : 0, 4);
    for (uint32_t k = 0; k < hr->kept; k++)
        p = policy_put_le(p, hr->force[k], 1);
    return p;
}

void *snapkv_family_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const snapkv_state *st = state;
    const snapkv_layer_record *r = &st->rec[layer];
    size_t elen = strlen(r->event); /* < sizeof r->event: fits the byte */
    size_t n = WIRE_HEADER + elen + (size_t)WIRE_HEAD * st->kv_heads;
    for (uint32_t g = 0; g < st->kv_heads; g++)
        n += (size_t)WIRE_ENTRY * r->heads[g].kept;
    uint8_t *buf = malloc(n);
    if (buf == NULL)
        return NULL;
    uint8_t *p = buf;
    memcpy(p, wire_magic, sizeof wire_magic);
    p += sizeof wire_magic;
    p = policy_put_le(p, SNAPKV_WIRE_VERSION, 1);
    p = policy_put_le(p, (uint64_t)st->cfg.variant, 1);
    p = policy_put_le(p, elen, 1);
    p = policy_put_le(p, st->kv_heads, 4);
    p = policy_put_le(p, layer, 4);
    p = policy_put_le(p, r->compressions, 8);
    p = policy_put_le(p, r->last_step, 8);
    memcpy(p, r->event, elen);
    p += elen;
    for (uint32_t g = 0; g < st->kv_heads; g++) {
        const snapkv_head_record *hr = &r->heads[g];
        p = policy_put_le(p, hr->held, 4);
        p = policy_put_le(p, hr->prefix, 4);
        p = policy_put_le(p, hr->kept, 4);
        p = policy_put_le(p, hr->forced, 4);
    }
    for (uint32_t g = 0; g < st->kv_heads; g++)
        p = export_head_entries(p, &r->heads[g]);
    *len = n;
    return buf;
}

/* Bytes being read: every read checks that they hold it (they come over
 * the network); a read past the end yields zeros and marks the reader. */
typedef struct wire_in {
    const uint8_t *p;
    size_t left;
    int ran_out;
} wire_in;

static const uint8_t *wire_take(wire_in *in, size_t n)
{
    if (in->left < n) {
        in->ran_out = 1;
        in->left = 0;
        return NULL;
    }
    const uint8_t *at = in->p;
    in->p += n;
    in->left -= n;
    return at;
}

/* n little-endian bytes as an unsigned number. */
static uint64_t wire_get(wire_in *in, size_t n)
{
    const uint8_t *b = wire_take(in, n);
    return b != NULL ? policy_get_le(b, (unsigned)n) : 0;
}

static float wire_get_f32(wire_in *in)
{
    return policy_bits_f32((uint32_t)wire_get(in, 4));
}

/* The fixed header and the event text into rec (heads untouched), checked
 * against this state's variant, kv_heads and the layer being imported. */
static int import_header(const snapkv_state *st, uint32_t layer, wire_in *in,
                         snapkv_layer_record *rec, char *err, size_t errlen)
{
    const uint8_t *magic = wire_take(in, sizeof wire_magic);
    uint64_t version = wire_get(in, 1), variant = wire_get(in, 1), elen = wire_get(in, 1);
    uint64_t heads = wire_get(in, 4), from_layer = wire_get(in, 4);
    rec->compressions = wire_get(in, 8);
    rec->last_step = wire_get(in, 8);
    const uint8_t *event = wire_take(in, elen);
    if (in->ran_out) {
        policy_set_err(err, errlen, "state is cut short in its header");
        return -1;
    }
    if (memcmp(magic, wire_magic, sizeof wire_magic) != 0) {
        policy_set_err(err, errlen, "not SnapKV-family state (bad magic)");
        return -1;
    }
    if (version != SNAPKV_WIRE_VERSION) {
        policy_set_err(err, errlen, "state format version %u, this daemon reads %u",
                       (unsigned)version, (unsigned)SNAPKV_WIRE_VERSION);
        return -1;
    }
    if (variant != (uint64_t)st->cfg.variant) {
        size_t known = sizeof variant_name / sizeof *variant_name;
        policy_set_err(err, errlen, "state written by policy %s, not %s",
                       variant < known ? variant_name[variant] : "(unknown)",
                       variant_name[st->cfg.variant]);
        return -1;
    }
    if (heads != st->kv_heads || from_layer != layer) {
        policy_set_err(err, errlen, "state of layer %u with kv_heads %u, expected layer %u with %u",
                       (unsigned)from_layer, (unsigned)heads, layer, st->kv_heads);
        return -1;
    }
    /* Written as the text before its NUL: a NUL inside, or no room for one,
     * is not something export wrote. */
    if (elen >= sizeof rec->event || memchr(event, '\0', elen) != NULL) {
        policy_set_err(err, errlen, "event text of %u bytes is not a text under %zu bytes",
                       (unsigned)elen, sizeof rec->event);
        return -1;
    }
    memcpy(rec->event, event, elen);
    rec->event[elen] = '\0';
    return 0;
}

/* A head's counts as record_compression() leaves them. */
static int check_head_counts(const snapkv_head_record *hr, uint32_t g, uint64_t compressions,
                             char *err, size_t errlen)
{
    if (hr->prefix > hr->held || hr->kept > hr->held || hr->forced > hr->held) {
        policy_set_err(err, errlen, "head %u: prefix %u, kept %u or forced %u exceeds held %u", g,
                       hr->prefix, hr->kept, hr->forced, hr->held);
        return -1;
    }
    if (compressions == 0 && hr->held != 0) {
        policy_set_err(err, errlen, "head %u has a record but the layer never compressed", g);
        return -1;
    }
    return 0;
}

/* The heads' counts into rec->heads (no arrays yet). The bytes left must
 * then be exactly the entries the counts announce: checked before any
 * allocation, so no count is trusted for one. */
static int import_counts(const snapkv_state *st, wire_in *in, snapkv_layer_record *rec, char *err,
                         size_t errlen)
{
    for (uint32_t g = 0; g < st->kv_heads; g++) {
        snapkv_head_record *hr = &rec->heads[g];
        hr->held = (uint32_t)wire_get(in, 4);
        hr->prefix = (uint32_t)wire_get(in, 4);
        hr->kept = (uint32_t)wire_get(in, 4);
        hr->forced = (uint32_t)wire_get(in, 4);
    }
    if (in->ran_out) {
        policy_set_err(err, errlen, "state is cut short in its head counts");
        return -1;
    }
    uint64_t need = 0; /* stops growing past in->left: no overflow */
    for (uint32_t g = 0; g < st->kv_heads && need <= in->left; g++) {
        if (check_head_counts(&rec->heads[g], g, rec->compressions, err, errlen) != 0)
            return -1;
        need += (uint64_t)WIRE_ENTRY * rec->heads[g].kept;
    }
    if (need != in->left) {
        policy_set_err(err, errlen, "state has %zu bytes of entries, its counts need %s%llu",
                       in->left, need > in->left ? "at least " : "", (unsigned long long)need);
        return -1;
    }
    return 0;
}

/* A head's entries as record_kept() writes them (format in the header). */
static int check_entries(const snapkv_state *st, const snapkv_head_record *hr, uint32_t g,
                         char *err, size_t errlen)
{
    /* A stage-2 score is the float of a product of doubles: it can be
     * infinite, never NaN; the other variants write 0. */
    int critical = variant_critical(st->cfg.variant);
    uint32_t forced = 0;
    for (uint32_t k = 0; k < hr->kept; k++) {
        const char *bad = NULL;
        if (k > 0 && hr->pos[k] <= hr->pos[k - 1])
            bad = "position not above the previous one";
        else if (!isfinite(hr->score[k]))
            bad = "score not a finite number";
        else if (critical ? isnan(hr->z[k]) : hr->z[k] != 0.0f)
            bad = critical ? "stage-2 score is NaN" : "stage-2 score not 0 (no stage 2)";
        else if (hr->force[k] > 1)
            bad = "is_forced not 0 or 1";
        if (bad != NULL) {
            policy_set_err(err, errlen, "head %u entry %u: %s", g, k, bad);
            return -1;
        }
        forced += hr->force[k];
    }
    if (forced > hr->forced) {
        policy_set_err(err, errlen, "head %u: %u kept tokens forced, of %u forced in all", g,
                       forced, hr->forced);
        return -1;
    }
    return 0;
}

/* Allocate a head's arrays (as record_compression() sizes them), read its
 * entries and check them. The arrays belong to hr even on failure. */
static int import_entries(const snapkv_state *st, wire_in *in, snapkv_head_record *hr, uint32_t g,
                          char *err, size_t errlen)
{
    size_t n = hr->kept ? hr->kept : 1;
    hr->pos = malloc(n * sizeof *hr->pos);
    hr->score = malloc(n * sizeof *hr->score);
    hr->z = malloc(n * sizeof *hr->z);
    hr->force = malloc(n);
    if (!hr->pos || !hr->score || !hr->z || !hr->force) {
        policy_set_err(err, errlen, "out of memory");
        return -1;
    }
    for (uint32_t k = 0; k < hr->kept; k++)
        hr->pos[k] = (uint32_t)wire_get(in, 4);
    for (uint32_t k = 0; k < hr->kept; k++)
        hr->score[k] = wire_get_f32(in);
    for (uint32_t k = 0; k < hr->kept; k++)
        hr->z[k] = wire_get_f32(in);
    for (uint32_t k = 0; k < hr->kept; k++)
        hr->force[k] = (uint8_t)wire_get(in, 1);
    int rc = check_entries(st, hr, g, err, errlen);
    if (!variant_critical(st->cfg.variant)) { /* checked to be 0: not kept */
        free(hr->z);
        hr->z = NULL;
    }
    return rc;
}

int snapkv_family_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                               size_t errlen)
{
    snapkv_state *st = state;
    if (layer >= st->layers) {
        policy_set_err(err, errlen, "no layer %u (%u layers)", layer, st->layers);
        return -1;
    }
    wire_in in = {buf, len, 0};
    snapkv_layer_record rec = {0};
    if (import_header(st, layer, &in, &rec, err, errlen) != 0)
        return -1;
    rec.heads = calloc(st->kv_heads, sizeof *rec.heads);
    if (rec.heads == NULL) {
        policy_set_err(err, errlen, "out of memory");
        return -1;
    }
    int rc = import_counts(st, &in, &rec, err, errlen);
    for (uint32_t g = 0; rc == 0 && g < st->kv_heads; g++)
        rc = import_entries(st, &in, &rec.heads[g], g, err, errlen);
    if (rc != 0) {
        record_free(&rec, st->kv_heads);
        return -1;
    }
    /* Everything checked: only now does the layer's record change. */
    record_free(&st->rec[layer], st->kv_heads);
    st->rec[layer] = rec;
    return 0;
}

/* ---- describe ---- */

/* A JSON string body: the event texts are ours, but escape anyway. */
static void json_string(policy_text *b, const char *s)
{
    policy_text_add(b, "\"");
    for (; *s != '\0'; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            policy_text_add(b, "\\%c", ch);
        else if (ch < 0x20)
            policy_text_add(b, "\\u%04x", ch);
        else
            policy_text_add(b, "%c", ch);
    }
    policy_text_add(b, "\"");
}

static void describe_head(policy_text *b, const snapkv_head_record *hr, int critical)
{
    policy_text_add(b, "{\"held\":%u,\"prefix\":%u,\"kept\":%u,\"forced\":%u,\"positions\":[",
                    hr->held, hr->prefix, hr->kept, hr->forced);
    for (uint32_t k = 0; k < hr->kept; k++)
        policy_text_add(b, "%s%u", k ? "," : "", hr->pos[k]);
    policy_text_add(b, "],\"score\":[");
    for (uint32_t k = 0; k < hr->kept; k++)
        policy_text_add(b, "%s%.9g", k ? "," : "", (double)hr->score[k]);
    if (critical) {
        policy_text_add(b, "],\"stage2\":[");
        for (uint32_t k = 0; k < hr->kept; k++)
            policy_text_add(b, "%s%.9g", k ? "," : "", (double)hr->z[k]);
    }
    policy_text_add(b, "],\"is_forced\":[");
    for (uint32_t k = 0; k < hr->kept; k++)
        policy_text_add(b, "%s%u", k ? "," : "", hr->force[k]);
    policy_text_add(b, "]}");
}

char *snapkv_family_describe(void *state, uint32_t layer)
{
    snapkv_state *st = state;
    if (st == NULL || layer >= st->layers)
        return NULL;
    const snapkv_config *c = &st->cfg;
    const snapkv_layer_record *r = &st->rec[layer];
    policy_text b = {0};
    policy_text_add(&b, "{\"policy\":\"%s\",\"layer\":%u,\"window\":%u,\"budget\":%u,",
                    variant_name[c->variant], layer, c->window, c->budget);
    policy_text_add(&b, "\"compressions\":%llu,\"last_step\":%llu,\"last_event\":",
                    (unsigned long long)r->compressions, (unsigned long long)r->last_step);
    json_string(&b, r->event);
    policy_text_add(&b, ",\"heads\":[");
    for (uint32_t g = 0; g < st->kv_heads; g++) {
        policy_text_add(&b, "%s", g ? "," : "");
        describe_head(&b, &r->heads[g], variant_critical(c->variant));
    }
    policy_text_add(&b, "]}");
    return policy_text_finish(&b);
}
