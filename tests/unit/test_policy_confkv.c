/*
 * test_policy_confkv.c - unit tests for policy "confkv" (policies/confkv.c,
 * POLICIES.md §5): the §5.6 vectors T-CF1..T-CF3 and the §5.5 pyramid
 * example on the pure functions of confkv.h, the same pieces through the
 * policy host, invalid configurations, and seeded property tests (budget
 * met, protected window kept, FP16 window, determinism).
 * T-CF4 (INT8 storage) belongs to the kernels and is tested there.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>

#include "confkv.h"
#include "policy_harness.h"

#define TOL 1e-4

static const confkv_weights W_DEFAULT = {0.4, 0.3, 0.3, CONFKV_MARGIN_SIGMOID};

/* ---- helpers ---- */

static policy_host *make_host(const char *const *keys, const char *const *values, size_t n,
                              const policy_geometry *g)
{
    return ph_host_pairs("confkv", keys, values, n, *g);
}

static policy_geometry geom(uint32_t layers, uint32_t q_heads)
{
    return (policy_geometry){layers, q_heads, 1, 64, 16, 10000.0f};
}

/* Per-query-head attention rows, row h = attn + h * stride. */
typedef struct rows {
    float *data;
    const float **ptr;
} rows;

static rows rows_new(uint32_t q_heads, uint32_t n)
{
    rows r = {calloc((size_t)q_heads * (n ? n : 1), sizeof(float)),
              calloc(q_heads, sizeof(float *))};
    assert_non_null(r.data);
    assert_non_null(r.ptr);
    for (uint32_t h = 0; h < q_heads; h++)
        r.ptr[h] = r.data + (size_t)h * n;
    return r;
}

static void rows_free(rows *r)
{
    free(r->data);
    free(r->ptr);
}

/* One step of one layer with the given rows; commits; returns the evictions. */
static size_t step_layer(policy_host *h, uint32_t layer, const rows *r, uint32_t new_tokens,
                         int prefill, double conf, const policy_decision **out)
{
    policy_stats st = {
        .new_tokens = new_tokens, .prefill = prefill, .last_attn = r->ptr, .confidence = conf};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, layer, &st, &d, err, sizeof err) != 0)
        fail_msg("step: %s", err);
    if (out != NULL)
        *out = d;
    return policy_host_commit(h, layer);
}

static const double *layer_ema(policy_host *h, uint32_t layer, uint32_t *n)
{
    const double *e;
    assert_int_equal(confkv_layer_ema(policy_host_state(h), layer, &e, n), 0);
    return e;
}

/* ---- T-CF1: confidence ---- */

static void check_conf(const float *p, size_t V, double ht, double delta, double sig, double top,
                       double c)
{
    confkv_signals s;
    double got = confkv_confidence(p, V, &W_DEFAULT, &s);
    assert_float_equal(s.entropy, ht, TOL);
    if (isinf(delta))
        assert_true(isinf(s.margin));
    else
        assert_float_equal(s.margin, delta, TOL);
    assert_float_equal(s.margin_term, sig, TOL);
    assert_float_equal(s.top, top, TOL);
    assert_float_equal(got, c, TOL);
    /* The logit form agrees (z = ln p, shifted: softmax is shift-invariant;
     * a zero probability has no finite logit). */
    float z[8];
    for (size_t v = 0; v < V; v++) {
        if (p[v] <= 0.0f)
            return;
        z[v] = logf(p[v]) + 3.0f;
    }
    confkv_signals sl;
    double gl = confkv_confidence_logits(z, V, &W_DEFAULT, &sl);
    assert_float_equal(gl, c, TOL);
    assert_float_equal(sl.entropy, ht, TOL);
    assert_float_equal(sl.top, top, TOL);
}

static void test_tcf1_confident(void **unused)
{
    (void)unused;
    const float p[] = {0.85f, 0.05f, 0.05f, 0.05f};
    check_conf(p, 4, 0.4238, 2.8332, 0.9444, 0.85, 0.7688);
    double c = confkv_confidence(p, 4, &W_DEFAULT, NULL);
    assert_int_equal(confkv_budget(c, 0.7, 128, 512), 128); /* B_tight */
}

static void test_tcf1_uncertain(void **unused)
{
    (void)unused;
    const float p[] = {0.4f, 0.35f, 0.15f, 0.1f};
    check_conf(p, 4, 0.9008, 0.1335, 0.5333, 0.4, 0.3197);
    double c = confkv_confidence(p, 4, &W_DEFAULT, NULL);
    assert_int_equal(confkv_budget(c, 0.7, 128, 512), 512); /* B_loose */
}

static void test_tcf1_uniform(void **unused)
{
    (void)unused;
    const float p[] = {0.25f, 0.25f, 0.25f, 0.25f};
    check_conf(p, 4, 1.0, 0.0, 0.5, 0.25, 0.225);
    /* tanh mode: the margin term is 2σ(0) − 1 = 0, so c = wP·0.25. */
    confkv_weights w = W_DEFAULT;
    w.margin_mode = CONFKV_MARGIN_TANH;
    assert_float_equal(confkv_confidence(p, 4, &w, NULL), 0.075, 1e-9);
}

static void test_confidence_edges(void **unused)
{
    (void)unused;
    /* One-hot: H~ = 0, Δ = +inf, σ = 1, p = 1: c = 1. */
    const float hot[] = {0.0f, 1.0f, 0.0f};
    check_conf(hot, 3, 0.0, INFINITY, 1.0, 1.0, 1.0);
    /* Unnormalised input is divided by its sum: 2x the first row. */
    const float twice[] = {1.7f, 0.1f, 0.1f, 0.1f};
    assert_float_equal(confkv_confidence(twice, 4, &W_DEFAULT, NULL), 0.7688, TOL);
    /* Refused: V < 2, negative, all zero, NaN. */
    const float bad[] = {0.5f, -0.1f, 0.6f};
    const float zero[] = {0.0f, 0.0f};
    const float nan_p[] = {NAN, 0.5f};
    assert_true(confkv_confidence(hot, 1, &W_DEFAULT, NULL) < 0);
    assert_true(confkv_confidence(bad, 3, &W_DEFAULT, NULL) < 0);
    assert_true(confkv_confidence(zero, 2, &W_DEFAULT, NULL) < 0);
    assert_true(confkv_confidence(nan_p, 2, &W_DEFAULT, NULL) < 0);
    assert_true(confkv_confidence_logits(nan_p, 2, &W_DEFAULT, NULL) < 0);
    /* Huge logits do not overflow: the top token takes everything. */
    const float big[] = {1000.0f, 0.0f, -1000.0f, 0.0f};
    assert_float_equal(confkv_confidence_logits(big, 4, &W_DEFAULT, NULL), 1.0, 1e-9);
    /* τ boundary: c == τ selects the tight budget. */
    assert_int_equal(confkv_budget(0.7, 0.7, 128, 512), 128);
    assert_int_equal(confkv_budget(0.6999, 0.7, 128, 512), 512);
}

/* ---- T-CF2: ranker ---- */

static void test_tcf2_ranker(void **unused)
{
    (void)unused;
    const double ema[] = {0.02, 0.10, 0.06, 0.04};
    const uint32_t step[] = {3, 10, 20, 40};
    double rank[4];
    confkv_rank(ema, step, 4, 0.5, rank);
    const double want[] = {0.0, 0.5946, 0.4797, 0.625};
    for (int i = 0; i < 4; i++)
        assert_float_equal(rank[i], want[i], TOL);
    /* â = [0, 1, 0.5, 0.25] and r̂ = [0, 7/37, 17/37, 1]: λ = 1 and λ = 0. */
    confkv_rank(ema, step, 4, 1.0, rank);
    assert_float_equal(rank[3], 0.25, 1e-12);
    confkv_rank(ema, step, 4, 0.0, rank);
    assert_float_equal(rank[1], 7.0 / 37.0, 1e-12);
    assert_float_equal(rank[2], 17.0 / 37.0, 1e-12);
    /* Eviction order: candidate 0, then 2, 1, 3. */
    confkv_rank(ema, step, 4, 0.5, rank);
    uint32_t idx[] = {0, 1, 2, 3};
    confkv_order(rank, step, idx, 4);
    const uint32_t order[] = {0, 2, 1, 3};
    for (int i = 0; i < 4; i++)
        assert_int_equal(idx[i], order[i]);
}

static void test_ranker_ties(void **unused)
{
    (void)unused;
    /* max == min: minmax is 0 for all, so every rank is 0 and the older
     * token goes first, whatever order idx starts in. */
    const double ema[] = {0.3, 0.3, 0.3};
    const uint32_t step[] = {9, 4, 7};
    double rank[3];
    confkv_rank(ema, step, 3, 1.0, rank);
    for (int i = 0; i < 3; i++)
        assert_float_equal(rank[i], 0.0, 0.0);
    uint32_t idx[] = {2, 0, 1};
    confkv_order(rank, step, idx, 3);
    assert_int_equal(idx[0], 1); /* step 4 */
    assert_int_equal(idx[1], 2); /* step 7 */
    assert_int_equal(idx[2], 0); /* step 9 */
    /* One candidate: rank 0. */
    confkv_rank(ema, step, 1, 0.5, rank);
    assert_float_equal(rank[0], 0.0, 0.0);
}

/* ---- T-CF3: EMA ---- */

static void test_tcf3_ema(void **unused)
{
    (void)unused;
    double e = confkv_ema(0.0, 0.2, 0.9);
    assert_float_equal(e, 0.02, 1e-12);
    e = confkv_ema(e, 0.0, 0.9);
    assert_float_equal(e, 0.018, 1e-12);
}

/* T-CF3 through the policy: 2 query heads whose mean is the mass. */
static void test_tcf3_through_host(void **unused)
{
    (void)unused;
    policy_geometry g = geom(1, 2);
    policy_host *h = make_host(NULL, NULL, 0, &g);
    assert_int_equal(policy_host_append(h, 1), 0);
    rows r = rows_new(2, 1);
    r.data[0] = 0.3f; /* head 0 */
    r.data[1] = 0.1f; /* head 1: mean 0.2 */
    step_layer(h, 0, &r, 1, 1, -1.0, NULL);
    uint32_t n;
    const double *e = layer_ema(h, 0, &n);
    assert_int_equal(n, 1);
    assert_float_equal(e[0], 0.02, 1e-7);
    rows_free(&r);
    assert_int_equal(policy_host_append(h, 1), 0);
    r = rows_new(2, 2);
    r.data[1] = r.data[3] = 0.5f; /* the new token; token 0 gets 0 */
    step_layer(h, 0, &r, 1, 0, 0.9, NULL);
    e = layer_ema(h, 0, &n);
    assert_int_equal(n, 2);
    assert_float_equal(e[0], 0.018, 1e-7);
    assert_float_equal(e[1], 0.05, 1e-7);
    rows_free(&r);
    policy_host_destroy(h);
}

/* ---- §5.5 pyramid ---- */

static void test_pyramid_example(void **unused)
{
    (void)unused;
    const uint32_t want[] = {192, 149, 107, 64};
    for (uint32_t l = 0; l < 4; l++)
        assert_int_equal(confkv_layer_budget(128, l, 4, 1.5, 0.5, 32), want[l]);
    /* The floor W+1, and a single layer gets the midpoint factor. */
    assert_int_equal(confkv_layer_budget(40, 3, 4, 1.5, 0.5, 32), 33);
    assert_int_equal(confkv_layer_budget(128, 0, 1, 1.5, 0.5, 32), 128);
    /* Round half to even: 3 layers, B = 5, middle factor 1.0 -> 5; l = 2:
     * 5·0.5 = 2.5 -> 2 (floor W+1 = 1). */
    assert_int_equal(confkv_layer_budget(5, 2, 3, 1.5, 0.5, 0), 2);
    assert_int_equal(confkv_layer_budget(5, 0, 3, 1.5, 0.5, 0), 8); /* 7.5 -> 8 */
}

/* ---- the policy through the host ---- */

/* T-CF2's shape through the host: masses [0.2,1,0.6,0.4] in prefill make
 * the EMA [0.02,0.10,0.06,0.04]; the decode step puts all mass on the new
 * (protected) token, which scales the old EMA by γ and leaves â as is.
 * Steps are positions 0..3: r̂ = [0,1/3,2/3,1], rank = [0,.6667,.5833,.625].
 * Budget 3 of 5 evicts positions 0 and 2. */
static void test_ranker_through_host(void **unused)
{
    (void)unused;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "fp16_window"};
    const char *v[] = {"3", "3", "1", "100"};
    policy_geometry g = geom(1, 1);
    policy_host *h = make_host(k, v, 4, &g);
    assert_int_equal(policy_host_append(h, 4), 0);
    rows r = rows_new(1, 4);
    const float mass[] = {0.2f, 1.0f, 0.6f, 0.4f};
    memcpy(r.data, mass, sizeof mass);
    assert_int_equal(step_layer(h, 0, &r, 4, 1, -1.0, NULL), 0); /* prefill keeps all */
    uint32_t n;
    const double *e = layer_ema(h, 0, &n);
    const double want[] = {0.02, 0.10, 0.06, 0.04};
    for (int i = 0; i < 4; i++)
        assert_float_equal(e[i], want[i], 1e-7);
    rows_free(&r);
    assert_int_equal(policy_host_append(h, 1), 0);
    r = rows_new(1, 5);
    r.data[4] = 1.0f;
    const policy_decision *d;
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.5, &d), 2);
    const policy_layer_view *view = policy_host_view(h, 0);
    assert_int_equal(view->tokens[0], 3);
    assert_int_equal(view->positions[0][0], 1);
    assert_int_equal(view->positions[0][1], 3);
    assert_int_equal(view->positions[0][2], 4);
    e = layer_ema(h, 0, &n);
    assert_int_equal(n, 3);
    assert_float_equal(e[0], 0.09, 1e-7); /* 0.9 · 0.10 */
    assert_float_equal(e[1], 0.036, 1e-7);
    assert_float_equal(e[2], 0.1, 1e-7);
    rows_free(&r);
    policy_host_destroy(h);
}

/*
 * A decode step's one eviction is the first of (rank, step, index): with
 * attention-only ranking, no memory in the EMA and the same attention for
 * every token, every rank ties and the oldest candidate goes, step after
 * step. A NaN in the statistics (the daemon refuses them) still evicts
 * one token.
 */
static void test_decode_ties_evict_the_oldest(void **unused)
{
    (void)unused;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "lambda", "gamma"};
    const char *v[] = {"8", "8", "2", "1", "0"};
    policy_geometry g = geom(1, 2);
    policy_host *h = make_host(k, v, 5, &g);
    rows r = rows_new(2, 64);
    for (size_t i = 0; i < 2 * 64; i++)
        r.data[i] = 0.25f;
    assert_int_equal(policy_host_append(h, 8), 0);
    assert_int_equal(step_layer(h, 0, &r, 8, 1, 0.9, NULL), 0);
    for (uint32_t t = 8; t < 20; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.9, NULL), 1);
        const policy_layer_view *view = policy_host_view(h, 0);
        assert_int_equal(view->tokens[0], 8);
        for (uint32_t i = 0; i < 8; i++)
            assert_int_equal(view->positions[0][i], t - 7 + i);
    }
    r.data[0] = NAN;  /* the first candidate: where policy_first_min starts */
    r.data[1] = 0.5f; /* a range, so that the NaN reaches its rank */
    assert_int_equal(policy_host_append(h, 1), 0);
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.9, NULL), 1);
    assert_int_equal(policy_host_view(h, 0)->tokens[0], 8);
    rows_free(&r);
    policy_host_destroy(h);
}

/* Budget selection by confidence, sawtooth, and the prefill no-op. */
static void test_budget_by_confidence(void **unused)
{
    (void)unused;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "fp16_window"};
    const char *v[] = {"8", "20", "2", "1000"};
    policy_geometry g = geom(1, 1);
    policy_host *h = make_host(k, v, 4, &g);
    assert_int_equal(policy_host_append(h, 30), 0);
    rows r = rows_new(1, 31);
    step_layer(h, 0, &r, 30, 1, -1.0, NULL);
    assert_int_equal(policy_host_view(h, 0)->tokens[0], 30); /* prefill keeps all */
    assert_int_equal(policy_host_append(h, 1), 0);
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.69, NULL), 11); /* loose: 31 -> 20 */
    assert_int_equal(policy_host_view(h, 0)->tokens[0], 20);
    for (int i = 0; i < 3; i++) { /* uncertain steps grow it again */
        assert_int_equal(policy_host_append(h, 1), 0);
        step_layer(h, 0, &r, 1, 0, 0.1, NULL);
    }
    assert_int_equal(policy_host_view(h, 0)->tokens[0], 20);
    assert_int_equal(policy_host_append(h, 1), 0);
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.7, NULL), 13); /* tight: 21 -> 8 */
    const policy_layer_view *view = policy_host_view(h, 0);
    assert_int_equal(view->tokens[0], 8);
    /* The two newest are protected. */
    assert_int_equal(view->positions[0][7], view->appended - 1);
    assert_int_equal(view->positions[0][6], view->appended - 2);
    rows_free(&r);
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"budget\":8"));
    assert_non_null(strstr(js, "\"tokens\":8"));
    free(js);
    policy_host_destroy(h);
}

/* Pyramid through the host: each layer keeps its own budget. */
static void test_pyramid_through_host(void **unused)
{
    (void)unused;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "pyramid"};
    const char *v[] = {"128", "128", "32", "1"};
    policy_geometry g = geom(4, 1);
    policy_host *h = make_host(k, v, 4, &g);
    assert_int_equal(policy_host_append(h, 300), 0);
    rows r = rows_new(1, 301);
    for (uint32_t l = 0; l < 4; l++)
        step_layer(h, l, &r, 300, 1, -1.0, NULL);
    assert_int_equal(policy_host_append(h, 1), 0);
    const uint32_t want[] = {192, 149, 107, 64};
    for (uint32_t l = 0; l < 4; l++) {
        step_layer(h, l, &r, 1, 0, 0.9, NULL);
        assert_int_equal(policy_host_view(h, l)->tokens[0], want[l]);
    }
    rows_free(&r);
    policy_host_destroy(h);
}

/* FP16 window: the F newest retained keep FULL, older become INT8; an INT8
 * token that falls back into the F newest stays INT8. */
static void test_fp16_window(void **unused)
{
    (void)unused;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "fp16_window", "lambda"};
    const char *v[] = {"6", "10", "1", "3", "1"};
    policy_geometry g = geom(1, 1);
    policy_host *h = make_host(k, v, 5, &g);
    assert_int_equal(policy_host_append(h, 8), 0);
    rows r = rows_new(1, 10);
    step_layer(h, 0, &r, 8, 1, -1.0, NULL);
    const policy_layer_view *view = policy_host_view(h, 0);
    for (uint32_t i = 0; i < 8; i++) /* prefill changes no tier */
        assert_int_equal(view->tier[0][i], POLICY_FULL);
    assert_int_equal(policy_host_append(h, 1), 0);
    /* Loose (10): nothing evicted; 9 tokens, the 3 newest FULL. */
    for (uint32_t i = 0; i < 9; i++)
        r.data[i] = 0.0f;
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.0, NULL), 0);
    view = policy_host_view(h, 0);
    for (uint32_t i = 0; i < 9; i++)
        assert_int_equal(view->tier[0][i], i >= 6 ? POLICY_FULL : POLICY_INT8);
    /* Tight (6) with λ = 1 (attention only): positions 6 and 7 (FULL, in
     * the window) get no mass, the others equal mass: 6 and 7 go first,
     * then the oldest, 0 and 1 (equal rank: older first). Of the retained
     * 2,3,4,5,8,9 the 3 newest are 9, 8 and 5: INT8 position 5 is back
     * among them and must stay INT8. */
    assert_int_equal(policy_host_append(h, 1), 0);
    const float mass[] = {0.9f, 0.9f, 0.9f, 0.9f, 0.9f, 0.9f, 0.0f, 0.0f, 0.9f, 0.5f};
    memcpy(r.data, mass, sizeof mass);
    const policy_decision *d;
    assert_int_equal(step_layer(h, 0, &r, 1, 0, 0.95, &d), 4);
    view = policy_host_view(h, 0);
    assert_int_equal(view->tokens[0], 6);
    const uint32_t pos[] = {2, 3, 4, 5, 8, 9};
    const uint8_t tier[] = {POLICY_INT8, POLICY_INT8, POLICY_INT8,
                            POLICY_INT8, POLICY_FULL, POLICY_FULL};
    for (uint32_t i = 0; i < 6; i++) {
        assert_int_equal(view->positions[0][i], pos[i]);
        assert_int_equal(view->tier[0][i], tier[i]);
    }
    rows_free(&r);
    policy_host_destroy(h);
}

static void test_missing_stats(void **unused)
{
    (void)unused;
    policy_geometry g = geom(1, 2);
    policy_host *h = make_host(NULL, NULL, 0, &g);
    assert_int_equal(policy_host_append(h, 2), 0);
    policy_stats st = {.new_tokens = 2, .prefill = 1, .confidence = -1.0};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "last_attn"));
    rows r = rows_new(2, 2);
    st.last_attn = r.ptr;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0); /* prefill: no c */
    policy_host_commit(h, 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    rows_free(&r);
    r = rows_new(2, 3);
    st = (policy_stats){.new_tokens = 1, .last_attn = r.ptr, .confidence = -1.0};
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "confidence"));
    st.confidence = NAN;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    /* A stats/list mismatch is refused, not read out of bounds. */
    st.confidence = 0.5;
    st.new_tokens = 2;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "out of sync"));
    rows_free(&r);
    policy_host_destroy(h);
}

/* ---- invalid configurations ---- */

static void test_invalid_configs(void **unused)
{
    (void)unused;
    static const ph_reject cases[] = {
        {{"w_entropy=0.5"}, {"w_entropy", "w_margin", "w_top"}},
        {{"w_top=0.2"}, {"w_entropy", "w_margin", "w_top"}},
        {{"budget_tight=600"}, {"budget_tight", "budget_loose"}},
        {{"protect=128"}, {"protect", "budget_tight"}},
        {{"rho_bottom=1.6"}, {"rho_bottom", "rho_top"}},
        {{"tau=1.5"}, {"tau", "[0, 1]"}},
        {{"gamma=-0.1"}, {"gamma", "[0, 1]"}},
        {{"lambda=x"}, {"lambda", "[0, 1]"}},
        {{"budget_loose=0"}, {"budget_loose", "[1, "}},
        {{"pyramid=2"}, {"pyramid", "[0, 1]"}},
        {{"margin_mode=relu"}, {"margin_mode", "sigmoid, tanh"}},
    };
    ph_expect_rejects("confkv", geom(2, 2), cases, PH_N(cases));
    /* Accepted: the weights within 1e-6 of 1, tanh margin, equal budgets. */
    policy_geometry g = geom(1, 1);
    const char *k[] = {"w_entropy", "w_margin", "w_top", "margin_mode", "budget_loose"};
    const char *v[] = {"0.3333333", "0.3333333", "0.3333334", "tanh", "128"};
    policy_host *h = make_host(k, v, 5, &g);
    policy_host_destroy(h);
    /* The worker's query on the same parameters: the weights as parsed. */
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(ph_ops("confkv"), k, v, 5, &p, err, sizeof err), 0);
    confkv_config c;
    assert_int_equal(confkv_config_parse(&p, &c, err, sizeof err), 0);
    assert_true(c.weights.top == 0.3333334 && c.weights.margin_mode == CONFKV_MARGIN_TANH);
    assert_int_equal(c.loose, 128);
    const char *bk[] = {"w_top"};
    const char *bv[] = {"0.2"};
    assert_int_equal(policy_params_resolve(ph_ops("confkv"), bk, bv, 1, &p, err, sizeof err), 0);
    assert_int_equal(confkv_config_parse(&p, &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "w_entropy + w_margin + w_top"));
}

static void test_defaults(void **unused)
{
    (void)unused;
    static const ph_default defaults[] = {
        {"tau", "0.7"},        {"budget_tight", "128"},   {"budget_loose", "512"},
        {"protect", "32"},     {"fp16_window", "128"},    {"lambda", "0.5"},
        {"gamma", "0.9"},      {"w_entropy", "0.4"},      {"w_margin", "0.3"},
        {"w_top", "0.3"},      {"pyramid", "0"},          {"rho_top", "1.5"},
        {"rho_bottom", "0.5"}, {"margin_mode", "sigmoid"}};
    ph_expect_registry("confkv", POLICY_NEEDS_LAST_ATTN | POLICY_NEEDS_CONFIDENCE, 0, defaults,
                       PH_N(defaults));
}

/* ---- properties on seeded random stats ---- */

static uint64_t rng_state;

/* The harness's seeded stream, in [0, 1). */
static double rng_unit(void)
{
    return ph_uniform(&rng_state, 0, 1);
}

typedef struct trace {
    uint64_t hash; /* of every decision */
} trace;

static uint64_t mix(uint64_t h, uint64_t x)
{
    return (h ^ x) * 1099511628211ull;
}

/* Run a random sequence; check budget, protection and tiers after every
 * decode step; return a hash of all held positions and tiers. */
static uint64_t run_random(uint64_t seed, int pyramid)
{
    const uint32_t layers = 3, q = 4, tight = 24, loose = 60, protect = 8, fwin = 16;
    const char *k[] = {"budget_tight", "budget_loose", "protect", "fp16_window", "pyramid"};
    const char *v[] = {"24", "60", "8", "16", pyramid ? "1" : "0"};
    policy_geometry g = geom(layers, q);
    policy_host *h = make_host(k, v, 5, &g);
    rng_state = seed;
    uint64_t hash = 14695981039346656037ull;
    rows r = rows_new(q, 512);
    uint32_t prompt = 40 + ph_below(&rng_state, 40);
    assert_int_equal(policy_host_append(h, prompt), 0);
    for (uint32_t step = 0; step < 200; step++) {
        int prefill = step == 0;
        uint32_t nnew = prefill ? prompt : 1;
        if (!prefill)
            assert_int_equal(policy_host_append(h, 1), 0);
        double conf = rng_unit();
        uint32_t budget = conf >= 0.7 ? tight : loose;
        for (uint32_t l = 0; l < layers; l++) {
            const policy_layer_view *view = policy_host_view(h, l);
            uint32_t n = view->tokens[0];
            for (uint32_t hh = 0; hh < q; hh++)
                for (uint32_t i = 0; i < n; i++)
                    r.data[(size_t)hh * 512 + i] = (float)rng_unit() / (float)n;
            for (uint32_t hh = 0; hh < q; hh++)
                r.ptr[hh] = r.data + (size_t)hh * 512;
            step_layer(h, l, &r, nnew, prefill, conf, NULL);
            view = policy_host_view(h, l);
            n = view->tokens[0];
            const uint32_t *pos = view->positions[0];
            if (prefill) {
                assert_int_equal(n, prompt);
                continue;
            }
            uint32_t bl =
                pyramid ? confkv_layer_budget(budget, l, layers, 1.5, 0.5, protect) : budget;
            assert_true(n <= bl);
            /* The W newest positions are all held (the list ends with them). */
            assert_true(n >= protect);
            for (uint32_t i = 0; i < protect; i++)
                assert_int_equal(pos[n - 1 - i], view->appended - 1 - i);
            /* Only the F newest retained may be FULL. */
            for (uint32_t i = 0; i + fwin < n; i++)
                assert_int_equal(view->tier[0][i], POLICY_INT8);
            for (uint32_t i = 0; i < n; i++)
                hash = mix(mix(hash, pos[i]), view->tier[0][i]);
        }
    }
    rows_free(&r);
    policy_host_destroy(h);
    return hash;
}

static void test_random_properties(void **unused)
{
    (void)unused;
    for (uint64_t seed = 1; seed <= 5; seed++) {
        uint64_t a = run_random(seed, 0), b = run_random(seed, 0);
        assert_true(a == b); /* same input, same output */
        uint64_t c = run_random(seed, 1), d = run_random(seed, 1);
        assert_true(c == d);
        assert_true(a != c); /* the pyramid changes decisions */
    }
    assert_true(run_random(1, 0) != run_random(2, 0));
}

/* ---- moving a sequence (export_layer / import_layer) ---- */

/* Moved mid-run, the host decides as the original: tight/loose budgets,
 * the pyramid over three layers, and attention-only ranking with no FP16
 * window (every configuration evicts on each decode step). */
static void test_portable(void **unused)
{
    (void)unused;
    const char *small[] = {"budget_tight=8", "budget_loose=16", "protect=2", "fp16_window=4", NULL};
    ph_check_portable("confkv", small, geom(2, 4), 24, 12, 1);
    const char *pyramid[] = {"budget_tight=12", "budget_loose=20", "protect=3", "fp16_window=6",
                             "pyramid=1",       "tau=0.5",         NULL};
    ph_check_portable("confkv", pyramid, geom(3, 2), 40, 10, 2);
    const char *attention[] = {
        "budget_tight=6", "budget_loose=6", "protect=1",        "fp16_window=0",
        "lambda=1",       "gamma=0.5",      "margin_mode=tanh", NULL};
    ph_check_portable("confkv", attention, geom(1, 1), 10, 16, 3);
}

static void test_import_refuses(void **unused)
{
    (void)unused;
    const char *kv[] = {"budget_tight=8", "budget_loose=16", "protect=2", NULL};
    policy_geometry g = geom(1, 2);
    policy_host *a = ph_host("confkv", kv, g);
    uint64_t rng = 9;
    ph_round(a, &g, 20, 1, &rng);
    ph_round(a, &g, 3, 0, &rng); /* decided: a budget and a confidence */
    size_t len;
    uint8_t *buf = policy_host_export_state(a, 0, &len);
    assert_non_null(buf);
    uint32_t n = policy_host_view(a, 0)->tokens[0];
    assert_true(n > 3); /* case 7 below changes token 3 */
    assert_int_equal(len, CONFKV_STATE_HEAD + 8 * (size_t)n);
    /* A state with content first, so that "unchanged" means something. */
    policy_host *b = ph_host("confkv", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(
        policy_host_ops(b)->import_layer(policy_host_state(b), 0, buf, len, err, sizeof err), 0);
    const uint64_t nan_bits = 0x7ff8000000000000ull, inf_bits = 0x7ff0000000000000ull;
    const ph_spoil cases[] = {
        {"wrong magic", 0, 1, 'x', 0, "magic"},
        {"a future version", 4, 1, 2, 0, "version"},
        {"the flag is 0 or 1", 5, 1, 2, 0, "decided"},
        {"n disagrees with the length", 18, 4, n - 1, 0, "need"},
        {"an n no allocation may trust", 18, 4, UINT32_MAX, 0, "need"},
        {"a trailing byte", 0, 0, 0, 1, "need"},
        {"a NaN EMA", 22 + 8 * 3, 8, nan_bits, 0, "EMA"},
        {"confidence not finite", 10, 8, inf_bits, 0, "confidence"},
        {"no confidence gives budget 7", 6, 4, 7, 0, "budget"},
    };
    for (size_t i = 0; i < PH_N(cases); i++)
        ph_expect_refused(b, 0, buf, len, &cases[i]);
    /* Shorter than the header: refused before reading it. */
    assert_int_equal(policy_host_ops(b)->import_layer(policy_host_state(b), 0, buf,
                                                      CONFKV_STATE_HEAD - 1, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "header"));
    free(buf);
    policy_host_destroy(a);
    policy_host_destroy(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tcf1_confident),
        cmocka_unit_test(test_tcf1_uncertain),
        cmocka_unit_test(test_tcf1_uniform),
        cmocka_unit_test(test_confidence_edges),
        cmocka_unit_test(test_tcf2_ranker),
        cmocka_unit_test(test_ranker_ties),
        cmocka_unit_test(test_tcf3_ema),
        cmocka_unit_test(test_tcf3_through_host),
        cmocka_unit_test(test_pyramid_example),
        cmocka_unit_test(test_ranker_through_host),
        cmocka_unit_test(test_decode_ties_evict_the_oldest),
        cmocka_unit_test(test_budget_by_confidence),
        cmocka_unit_test(test_pyramid_through_host),
        cmocka_unit_test(test_fp16_window),
        cmocka_unit_test(test_missing_stats),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_random_properties),
        cmocka_unit_test(test_portable),
        cmocka_unit_test(test_import_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
