/*
 * tova.c - policy "tova": TOVA (Oren et al., "Transformers are Multi-State
 * RNNs", 2024) as kvpress implements it (POLICIES.md §1.9, `tova_press.py`).
 *
 * Score of a held token = attention of the step's LAST query on it,
 * averaged over ALL query heads (the same score for every KV head, so one
 * list per layer). The newest token's score is padded to max + 1 (max over
 * the other held tokens) so it is never evicted. When more than `budget`
 * tokens are held, the lowest-scored ones are evicted in one decision per
 * step until `budget` remain: top-k keeps the higher score, ties to the
 * lower index (POLICIES.md "Common notation"), i.e. among equal scores the
 * higher index goes first. TOVA keeps no state between steps.
 *
 * Parameter: budget (256, [RECON] default shared with the other baselines).
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "select.h"
#include "util.h"

#define TOVA_MAX 1048576u

typedef struct tova_scratch {
    uint32_t cap;
    double *score;
    uint64_t *keys;
} tova_scratch;

typedef struct tova_state {
    uint32_t budget, q_heads, layers;
    tova_scratch *ly; /* per layer, so that layers may be stepped concurrently */
} tova_state;

/* The parameters, parsed into a tova_config. */
typedef struct tova_config {
    uint32_t budget;
} tova_config;

static const policy_param_spec tova_params[] = {
    POLICY_PARAM_U32("budget", "256",
                     "tokens held per layer after each step, 1..1048576 ([RECON] default)", 1,
                     TOVA_MAX, offsetof(tova_config, budget)),
};

static void tova_destroy(void *state)
{
    tova_state *st = state;
    if (st == NULL)
        return;
    for (uint32_t l = 0; st->ly != NULL && l < st->layers; l++) {
        free(st->ly[l].score);
        free(st->ly[l].keys);
    }
    free(st->ly);
    free(st);
}

static int tova_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                       size_t errlen)
{
    *state = NULL;
    tova_config c;
    if (policy_params_parse(p, tova_params, sizeof tova_params / sizeof tova_params[0], &c, err,
                            errlen) != 0)
        return -1;
    if (g->q_heads == 0) {
        snprintf(err, errlen, "tova: geometry has no query heads");
        return -1;
    }
    tova_state *st = calloc(1, sizeof *st);
    if (st != NULL) {
        st->budget = c.budget;
        st->q_heads = g->q_heads;
        st->layers = g->layers;
        st->ly = calloc(g->layers ? g->layers : 1, sizeof *st->ly);
    }
    if (st == NULL || st->ly == NULL) {
        tova_destroy(st);
        snprintf(err, errlen, "out of memory creating policy 'tova'");
        return -1;
    }
    *state = st;
    return 0;
}

static int scratch_reserve(tova_scratch *s, uint32_t need)
{
    if (need <= s->cap)
        return 0;
    double *score = realloc(s->score, (size_t)need * sizeof *score);
    if (score == NULL)
        return -1;
    s->score = score;
    uint64_t *keys = realloc(s->keys, (size_t)need * sizeof *keys);
    if (keys == NULL)
        return -1;
    s->keys = keys;
    s->cap = need;
    return 0;
}

/* score[i] = the mean over the heads of rows[h][i]; returns the max over
 * i < n - 1. */
static double mean_max(const float *const *rows, uint32_t heads, uint32_t n, double *score)
{
    policy_mean_rows(rows, heads, n, score);
    return policy_max(score, n - 1);
}

/* score[i] = sum[i], the worker's sum over the query heads (stats.score
 * of the last query): the mean's order, ties included, without dividing;
 * returns the max over i < n - 1. Both loops vectorise. */
POLICY_HOT static double scores_from_sum(const float *sum, uint32_t n, double *score)
{
    for (uint32_t i = 0; i < n; i++)
        score[i] = (double)sum[i];
    return policy_max(score, n - 1);
}

/* The worker's summed scores, eight floats at a time (GCC's vector
 * extension: each clone of POLICY_HOT gets its own width). */
typedef float sum_vec __attribute__((vector_size(32)));
typedef int sum_mask __attribute__((vector_size(32)));
#define SUM_VEC (sizeof(sum_vec) / sizeof(float))

/* Vectors a round, each with its own accumulators: a compare and a blend
 * that wait on the last round's result take ~5 cycles, four independent
 * chains keep the loads busy (a 32k-token list: 13 us -> 3.5). */
#define SUM_CHAINS 4

/* a where take is all ones, else b (a macro: a function returning a
 * vector would change the ABI of the clone without AVX). */
#define SUM_PICK(take, a, b) ((sum_vec)(((sum_mask)(a) & (take)) | ((sum_mask)(b) & ~(take))))

/* One pass over x[0..n), SUM_VEC <= n: 1 when no value is a NaN, with
 * their minimum and maximum. */
POLICY_HOT static int sum_extremes(const float *x, size_t n, float *min, float *max)
{
    sum_vec lo[SUM_CHAINS], hi[SUM_CHAINS], v;
    sum_mask ordered[SUM_CHAINS];
    for (int c = 0; c < SUM_CHAINS; c++) {
        memcpy(&lo[c], x, sizeof v);
        hi[c] = lo[c];
        ordered[c] = (sum_mask){0} - 1;
    }
    size_t i = 0;
    for (; i + SUM_CHAINS * SUM_VEC <= n; i += SUM_CHAINS * SUM_VEC)
        for (int c = 0; c < SUM_CHAINS; c++) {
            memcpy(&v, x + i + c * SUM_VEC, sizeof v);
            ordered[c] &= v == v;
            lo[c] = SUM_PICK(v < lo[c], v, lo[c]);
            hi[c] = SUM_PICK(v > hi[c], v, hi[c]);
        }
    for (; i + SUM_VEC <= n; i += SUM_VEC) {
        memcpy(&v, x + i, sizeof v);
        ordered[0] &= v == v;
        lo[0] = SUM_PICK(v < lo[0], v, lo[0]);
        hi[0] = SUM_PICK(v > hi[0], v, hi[0]);
    }
    int ok = 1;
    float mn = lo[0][0], mx = hi[0][0];
    for (int c = 0; c < SUM_CHAINS; c++)
        for (size_t k = 0; k < SUM_VEC; k++) {
            ok &= ordered[c][k] != 0;
            mn = lo[c][k] < mn ? lo[c][k] : mn;
            mx = hi[c][k] > mx ? hi[c][k] : mx;
        }
    for (; i < n; i++) {
        ok &= x[i] == x[i];
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    *min = mn, *max = mx;
    return ok;
}

/* The last i < n with x[i] == value (-0.0 equal to +0.0), n when none:
 * from the end, a round of vectors tested at once. */
POLICY_HOT static size_t sum_last_equal(const float *x, size_t n, float value)
{
    size_t end = n;
    while (end % SUM_VEC != 0 && x[end - 1] != value)
        end--;
    if (end % SUM_VEC == 0) {
        sum_vec want = (sum_vec){0} + value, v;
        for (; end >= SUM_CHAINS * SUM_VEC; end -= SUM_CHAINS * SUM_VEC) {
            sum_mask eq = {0};
            for (int c = 1; c <= SUM_CHAINS; c++) {
                memcpy(&v, x + end - c * SUM_VEC, sizeof v);
                eq |= v == want;
            }
            uint64_t w[sizeof eq / sizeof(uint64_t)], any = 0;
            memcpy(w, &eq, sizeof w);
            for (size_t k = 0; k < sizeof eq / sizeof(uint64_t); k++)
                any |= w[k];
            if (any != 0)
                break;
        }
        while (end > 0 && x[end - 1] != value)
            end--;
    }
    return end > 0 ? end - 1 : n;
}

/* Sums a decode step takes at a time (policy_ops.stats_in_place): 2 KiB,
 * in L1 with the best part so far. */
#define SUM_CHUNK 512

/* The minimum and maximum of x[0..n), 0 < n, no NaN among them. */
static void chunk_extremes(const float *x, size_t n, float *min, float *max)
{
    if (n >= SUM_VEC) {
        (void)sum_extremes(x, n, min, max);
        return;
    }
    *min = *max = x[0];
    for (size_t i = 1; i < n; i++) {
        *min = x[i] < *min ? x[i] : *min;
        *max = x[i] > *max ? x[i] : *max;
    }
}

/*
 * A decode step of the summed statistic (one token to evict), from the
 * sums as they came: the token the padded scores would give (the last
 * minimum of score[0..n), score[i] = sum[i], score[n - 1] = max + 1),
 * instead of n doubles written and read again for the max and the
 * minimum. A float converts to double exactly and in order, so the
 * floats' extremes are the scores'. The newest token is the minimum only
 * when max + 1 rounds to max and every other score equals it (beyond
 * 2^53). Each sum is read once, into L1 a part at a time, and checked
 * there; the part that holds the last minimum so far is kept, so that the
 * victim is searched for among the values that were checked. Returns n
 * when a sum is not finite.
 */
static size_t sum_decode_victim(const float *sum, uint32_t n)
{
    float part[SUM_CHUNK], best[SUM_CHUNK], min = 0, max = 0, last_sum;
    size_t best_at = 0, best_len = 0;
    for (size_t c = 0; c < (size_t)n - 1; c += SUM_CHUNK) {
        size_t len = n - 1 - c < SUM_CHUNK ? n - 1 - c : SUM_CHUNK;
        if (policy_copy_first_outside(part, sum + c, len, -FLT_MAX) < len)
            return n;
        float lo, hi;
        chunk_extremes(part, len, &lo, &hi);
        max = c == 0 || hi > max ? hi : max;
        if (c == 0 || lo <= min) { /* the last part that holds the minimum */
            min = lo, best_at = c, best_len = len;
            memcpy(best, part, len * sizeof *part);
        }
    }
    if (policy_copy_first_outside(&last_sum, sum + n - 1, 1, -FLT_MAX) < 1)
        return n;
    size_t last = best_at + sum_last_equal(best, best_len, min);
    return (double)max + 1 <= (double)min ? n - 1 : last;
}

static int tova_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                     policy_decision *d, char *err, size_t errlen)
{
    tova_state *st = state;
    if (view->layer >= st->layers || view->heads != 1) {
        snprintf(err, errlen, "tova: bad view (layer %u of %u, %u lists; expected 1)", view->layer,
                 st->layers, view->heads);
        return -1;
    }
    /* The last query's attention per query head, or its sum over them
     * (ops.needs_alt): the same mean, a q_heads-th of the bytes. */
    int summed = stats->last_attn == NULL && stats->score != NULL;
    if (stats->last_attn == NULL && !summed) {
        snprintf(err, errlen,
                 "tova needs stats.last_attn (POLICY_NEEDS_LAST_ATTN) or its sum over the query "
                 "heads as stats.score, got neither");
        return -1;
    }
    if (summed && stats->score_queries != 1) {
        snprintf(err, errlen,
                 "tova: stats.score must sum the last query's attention over the query heads "
                 "(score_queries 1), got score_queries %u",
                 stats->score_queries);
        return -1;
    }
    for (uint32_t h = 0; !summed && h < st->q_heads; h++)
        if (stats->last_attn[h] == NULL) {
            snprintf(err, errlen, "tova: stats.last_attn[%u] (query head) is missing", h);
            return -1;
        }
    uint32_t n = view->tokens[0];
    if (n <= st->budget) {
        policy_decision_span(d, 0, 0, 0);
        return 0;
    }
    if (summed && n - st->budget == 1) {
        size_t victim = sum_decode_victim(stats->score, n);
        if (victim < n) {
            policy_evict_one(d, 0, (uint32_t)victim);
            return 0;
        }
    }
    /* A sum is checked as it came (4 bytes a token), the mean, or sums
     * read in place, as computed (what the decision reads). */
    int computed = !summed || stats->in_place;
    size_t bad = !computed && !stats->finite ? policy_first_outside(stats->score, n, -FLT_MAX) : n;
    tova_scratch *sc = &st->ly[view->layer];
    if (scratch_reserve(sc, n) != 0) {
        snprintf(err, errlen, "tova: out of memory for %u tokens", n);
        return -1;
    }
    double max = summed ? scores_from_sum(stats->score, n, sc->score)
                        : mean_max(stats->last_attn, st->q_heads, n, sc->score);
    bad = computed ? policy_first_nonfinite(sc->score, n) : bad;
    if (bad < n && summed)
        return policy_stats_refused(err, errlen, "tova", view->layer, bad);
    if (bad < n) {
        snprintf(err, errlen, "tova: stats.last_attn of token %zu is not finite", bad);
        return -1;
    }
    sc->score[n - 1] = max + 1; /* kvpress: the last token is padded with max + 1 */
    /* Evict the lowest scores first; among equal scores the higher index
     * goes first (visited in reverse order), so that the lower is kept. */
    if (n - st->budget == 1) { /* a decode step */
        policy_evict_one(d, 0, (uint32_t)policy_last_min(sc->score, n));
        return 0;
    }
    for (uint32_t i = 0; i < n; i++)
        sc->keys[i] = policy_key(sc->score[i]);
    policy_cut cut = policy_select_cut(sc->keys, n, n - st->budget);
    uint8_t *evict = (uint8_t *)sc->keys; /* the keys are spent: n bytes of room */
    policy_cut_mark(&cut, sc->score, 1.0, NULL, 1, n, 1, evict);
    policy_evict_marked(d->tier[0], evict, 1, n);
    return 0;
}

const policy_ops policy_tova = {
    .name = "tova",
    .summary = "TOVA: keep the `budget` tokens with the highest last-query attention averaged "
               "over all query heads (or summed by the worker, as score); the newest token always "
               "stays",
    .params = tova_params,
    .nparams = sizeof(tova_params) / sizeof(tova_params[0]),
    .needs = POLICY_NEEDS_LAST_ATTN,
    .needs_alt = POLICY_NEEDS_SCORE,
    .per_head = 0,
    .layers_concurrent = 1,
    .stats_in_place = 1, /* only its summed score is read so (seq.c) */
    .create = tova_create,
    .step = tova_step,
    .destroy = tova_destroy,
};
