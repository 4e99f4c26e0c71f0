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
#include <stdio.h>
#include <stdlib.h>

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

/* Outputs summed at a time: their sums (4 KiB) stay in L1 while every
 * head's row passes over them. The rows are then read a block at a time,
 * one after another: 32 streams, more than the hardware prefetches on its
 * own, so each block asks for the row's next one (twice as fast). */
#define MEAN_BLOCK 512

/* score[i] = mean over the heads of rows[h][i], summed in head order in
 * double (vectorised over a block of outputs, one head after another);
 * returns the max over i < n - 1. A non-finite sum gives a non-finite
 * score. */
POLICY_HOT static double mean_over_heads(const float *const *rows, uint32_t heads, uint32_t n,
                                         double *score)
{
    for (uint32_t b = 0; b < n; b += MEAN_BLOCK) {
        uint32_t m = n - b < MEAN_BLOCK ? n - b : MEAN_BLOCK;
        double *restrict acc = score + b;
        for (uint32_t i = 0; i < m; i++)
            acc[i] = 0.0;
        for (uint32_t h = 0; h < heads; h++) {
            const float *restrict row = rows[h] + b;
            uint32_t ahead = n - b - m < MEAN_BLOCK ? n - b - m : MEAN_BLOCK;
            for (uint32_t i = 0; i < ahead; i += 16) /* this row's next block */
                __builtin_prefetch(row + m + i);
            for (uint32_t i = 0; i < m; i++)
                acc[i] += (double)row[i];
        }
        for (uint32_t i = 0; i < m; i++)
            acc[i] /= (double)heads;
    }
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

/* The first i with a non-finite s[i], or n. */
static size_t first_not_finite(const double *s, size_t n)
{
    int ok = 1;
    for (size_t i = 0; i < n; i++)
        ok &= (s[i] >= -DBL_MAX) & (s[i] <= DBL_MAX);
    if (ok)
        return n;
    size_t i = 0;
    while (i < n && isfinite(s[i]))
        i++;
    return i;
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
    if (n <= st->budget)
        return 0;
    tova_scratch *sc = &st->ly[view->layer];
    if (scratch_reserve(sc, n) != 0) {
        snprintf(err, errlen, "tova: out of memory for %u tokens", n);
        return -1;
    }
    /* A sum is checked as it came (4 bytes a token), the mean as computed. */
    size_t bad = summed ? policy_first_outside(stats->score, n, -FLT_MAX) : n;
    double max = summed ? scores_from_sum(stats->score, n, sc->score)
                        : mean_over_heads(stats->last_attn, st->q_heads, n, sc->score);
    bad = summed ? bad : first_not_finite(sc->score, n);
    if (bad < n) {
        snprintf(err, errlen, "tova: stats.%s of token %zu is not finite",
                 summed ? "score" : "last_attn", bad);
        return -1;
    }
    sc->score[n - 1] = max + 1; /* kvpress: the last token is padded with max + 1 */
    /* Evict the lowest scores first; among equal scores the higher index
     * goes first (visited in reverse order), so that the lower is kept. */
    if (n - st->budget == 1) { /* a decode step */
        d->tier[0][policy_last_min(sc->score, n)] = POLICY_EVICT;
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
    .create = tova_create,
    .step = tova_step,
    .destroy = tova_destroy,
};
