/*
 * confkv.h - the pure pieces of Conf-KV (POLICIES.md §5; policy "confkv" in
 * confkv.c): next-token confidence, budget selection, the attention-mass
 * EMA, the ranker, eviction order and pyramidal layer budgets.
 *
 * Every formula here is a reconstruction (POLICIES.md §5.2 [RECON]): the
 * Conf-KV paper lost its inline formulas and has no public code. The policy
 * calls exactly these functions, and tests/unit/test_policy_confkv.c checks
 * them with the §5.6 vectors. None allocates; none keeps state.
 */
#ifndef KVSTASH_POLICIES_CONFKV_H
#define KVSTASH_POLICIES_CONFKV_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"

/* How the log-probability margin Δ enters the confidence (§5.2). */
typedef enum confkv_margin_mode {
    CONFKV_MARGIN_SIGMOID = 0, /* σ(Δ), in [1/2, 1): the default */
    CONFKV_MARGIN_TANH = 1,    /* 2σ(Δ) − 1 = tanh(Δ/2), in [0, 1) */
} confkv_margin_mode;

/* The weights of the three confidence signals; they must sum to 1. */
typedef struct confkv_weights {
    double entropy; /* wH, on 1 − H~ */
    double margin;  /* wM, on the margin term */
    double top;     /* wP, on p_(1) */
    confkv_margin_mode margin_mode;
} confkv_weights;

/* The signals behind one confidence value (for tests and Inspect). */
typedef struct confkv_signals {
    double entropy;     /* H~ = −Σ p ln p / ln V, in [0, 1] */
    double margin;      /* Δ = ln p_(1) − ln p_(2) >= 0 (+inf when p_(2) = 0) */
    double margin_term; /* σ(Δ) or tanh(Δ/2) */
    double top;         /* p_(1) */
} confkv_signals;

/*
 * Confidence c_t of one next-token distribution (§5.2):
 *   c = wH·(1 − H~) + wM·σ(Δ) + wP·p_(1)   (or tanh(Δ/2) for the margin).
 * probs holds V >= 2 non-negative probabilities; they are divided by their
 * sum first, so a distribution rounded to float (or fp16) still works.
 * Zero probabilities contribute 0·ln 0 = 0. *sig (may be NULL) receives the
 * signals. Returns c in [0, 1], or -1 when V < 2, probs is NULL, a
 * probability is negative or not finite, or they sum to 0: a worker reports
 * that as "no confidence" (policy_stats.confidence < 0).
 */
double confkv_confidence(const float *probs, size_t V, const confkv_weights *w,
                         confkv_signals *sig);

/*
 * The same from raw logits (temperature 1, p = softmax(z)), computed in log
 * space so that a 128k vocabulary with large logits does not underflow:
 * ln p_v = z_v − lse(z), H = lse − Σ p_v z_v, Δ = z_(1) − z_(2).
 * Returns c, or -1 when V < 2, logits is NULL or a logit is not finite.
 */
double confkv_confidence_logits(const float *logits, size_t V, const confkv_weights *w,
                                confkv_signals *sig);

/* B_t = B_tight if c >= tau else B_loose (§5.2). */
uint32_t confkv_budget(double c, double tau, uint32_t tight, uint32_t loose);

/*
 * Pyramidal budget of layer l of `layers` (§5.5 [RECON]):
 *   B_l = max(W+1, round(B·(ρ_top − (ρ_top − ρ_bottom)·l/(layers−1))))
 * in double, rounding half to even (Python round()). With one layer there is
 * no slope: the factor is the midpoint (ρ_top + ρ_bottom)/2, i.e. the mean
 * the formula keeps over layers. The result saturates at UINT32_MAX.
 */
uint32_t confkv_layer_budget(uint32_t budget, uint32_t layer, uint32_t layers, double rho_top,
                             double rho_bottom, uint32_t protect);

/* One EMA update (§5.2): e ← γ·e + (1−γ)·m. A new token starts at e = 0. */
double confkv_ema(double e, double mass, double gamma);

/*
 * Ranker over n candidates (§5.2): rank_i = λ·minmax(ema)_i +
 * (1−λ)·minmax(step)_i, where minmax(x)_i = (x_i − min x)/(max x − min x)
 * over the candidates, and 0 for all when max == min. rank receives n values.
 */
void confkv_rank(const double *ema, const uint32_t *step, size_t n, double lambda, double *rank);

/*
 * Eviction order (§5.3): sorts idx[0..n) (indices into rank/step) ascending
 * by (rank, step), so that the first k entries are the k tokens to evict;
 * equal ranks evict the older token (smaller generation step) first, and
 * equal steps the lower index. Stable and total: the order is deterministic.
 */
void confkv_order(const double *rank, const uint32_t *step, uint32_t *idx, size_t n);

/* ---- the policy's parameters ---- */

/* Policy "confkv"'s parameters, as its parameter spec parses them. */
typedef struct confkv_config {
    double tau, lambda, gamma, rho_top, rho_bottom;
    uint32_t tight, loose, protect, fp16_window, pyramid;
    confkv_weights weights; /* w_entropy, w_margin, w_top, margin_mode */
    unsigned margin_mode;   /* index of margin_mode ("sigmoid", "tanh") */
} confkv_config;

/*
 * Parse and cross-check a resolved "confkv" parameter set (the policy's own
 * create() does exactly this): the weights sum to 1, budget_tight <=
 * budget_loose, protect < budget_tight, rho_bottom <= rho_top. A worker that
 * computes the confidence reads the weights from here instead of parsing
 * confkv's keys itself. Returns 0, or -1 with err naming the parameter.
 */
int confkv_config_parse(const policy_params *p, confkv_config *out, char *err, size_t errlen);

/*
 * The EMA of one layer of a "confkv" policy state (for tests and Inspect):
 * *ema points at *n values in list order, valid until the next step.
 * Returns 0, or -1 when layer is out of range.
 */
int confkv_layer_ema(const void *state, uint32_t layer, const double **ema, uint32_t *n);

/*
 * A layer's state as ops->export_layer writes it and import_layer reads it
 * (moving a sequence to another daemon, policy.h), little-endian:
 *   0  u32  CONFKV_STATE_MAGIC ("cfkv")
 *   4  u8   CONFKV_STATE_VERSION
 *   5  u8   decided: 1 once a decode step ran on the layer, else 0
 *   6  u32  budget B_l of the last decode step (0 when not decided)
 *  10  f64  confidence of the last decode step, its IEEE bits (0 likewise)
 *  18  u32  n: tokens the policy tracks
 *  22  f64  ema[n], their IEEE bits, in list order
 * import_layer refuses another magic or version, a decided flag other than
 * 0/1, a length other than 22 + 8n, a confidence outside [0, 1] or a budget
 * that the parameters do not give for it, a budget or confidence on an
 * undecided layer, and a non-finite EMA.
 */
#define CONFKV_STATE_MAGIC 0x766b6663u /* "cfkv" */
#define CONFKV_STATE_VERSION 1u
#define CONFKV_STATE_HEAD 22u

#endif
