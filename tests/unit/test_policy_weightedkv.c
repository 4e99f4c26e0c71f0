/*
 * test_policy_weightedkv.c - unit tests for policy "weightedkv"
 * (policies/weightedkv.c, POLICIES.md §4): T-WKV1 (the paper's Fig. 3 toy)
 * on wkv_plan() and the kernels' merge reference (kv_merge_values_ref via
 * policy_harness.h) with one-hot values, so that each
 * merged row reads off its mixture coefficients; T-WKV2 through the policy
 * host (a, c, w after each step and the merge weights); the edge cases of
 * §4.2, GQA, the prefill extension, invalid configurations; and seeded
 * property tests (wkv_plan equals one-merge-at-a-time Algorithm 1,
 * wkv_flatten keeps the plan's values with merges into kept entries only,
 * a long prefill through the host matches Algorithm 1, protected
 * entries kept, lists at m, convex rows, no value lost, determinism).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include <cmocka.h>

#include "policy_harness.h"
#include "weightedkv.h"

#define TOL 1e-4
#define DIM 16 /* one-hot value vectors: one channel per original token */

/* ---- helpers ---- */

static policy_host *make_host(const char *const *keys, const char *const *values, size_t n,
                              const policy_geometry *g)
{
    return ph_host_pairs("weightedkv", keys, values, n, *g);
}

static policy_geometry geom(uint32_t layers, uint32_t q_heads, uint32_t kv_heads)
{
    return (policy_geometry){layers, q_heads, kv_heads, 64, 16, 10000.0f};
}

/* A list of one-hot values: row i starts as e_{id[i]}. */
typedef struct vlist {
    float v[DIM][DIM];
    uint32_t key[DIM]; /* original token whose key the row keeps */
    size_t n;
} vlist;

static void vlist_push(vlist *l, uint32_t token)
{
    memset(l->v[l->n], 0, sizeof l->v[l->n]);
    l->v[l->n][token] = 1.0f;
    l->key[l->n] = token;
    l->n++;
}

/* Apply merges of head 0 to the rows, then drop every merges[i].from. */
static void vlist_apply(vlist *l, const policy_merge *m, size_t count)
{
    ph_merge_values(&l->v[0][0], l->n, DIM, m, count, 0);
    uint8_t gone[DIM] = {0};
    for (size_t i = 0; i < count; i++)
        gone[m[i].from] = 1;
    size_t out = 0;
    for (size_t i = 0; i < l->n; i++)
        if (!gone[i]) {
            memmove(l->v[out], l->v[i], sizeof l->v[i]);
            l->key[out] = l->key[i];
            out++;
        }
    l->n = out;
}

static void expect_mix(const float *row, const double *coef)
{
    for (int t = 0; t < DIM; t++)
        assert_float_equal(row[t], coef[t], 1e-6);
}

/* ---- T-WKV1: the Fig. 3 toy (m = 4, Algorithm 1's range) ---- */

static size_t plan_step(vlist *l, const double *w, policy_merge *m)
{
    const wkv_config cfg = {4, 0, 1};
    uint32_t scratch[3 * DIM];
    assert_int_equal(l->n, 5);
    size_t count = wkv_plan(w, l->n, &cfg, 0, scratch, m);
    assert_int_equal(count, 1);
    return count;
}

static void test_twkv1_fig3(void **unused)
{
    (void)unused;
    vlist l = {0};
    policy_merge m[DIM];
    for (uint32_t t = 1; t <= 5; t++)
        vlist_push(&l, t);
    /* Step 5: (v1..v5) = (0.3, 0.1, 0.5, 0.3, 0.5): v2 into v3, v2/6 + 5v3/6. */
    const double w5[] = {0.3, 0.1, 0.5, 0.3, 0.5};
    plan_step(&l, w5, m);
    assert_int_equal(m[0].from, 1);
    assert_int_equal(m[0].into, 2);
    assert_float_equal(m[0].w_from, 0.1, 1e-7);
    assert_float_equal(m[0].w_into, 0.5, 1e-7);
    vlist_apply(&l, m, 1);
    expect_mix(l.v[1], (double[DIM]){[2] = 1.0 / 6, [3] = 5.0 / 6});
    /* The garbled v4/v5 order of the PDF dump makes no difference. */
    const double w5b[] = {0.3, 0.1, 0.5, 0.5, 0.3};
    vlist alt = {0};
    for (uint32_t t = 1; t <= 5; t++)
        vlist_push(&alt, t);
    plan_step(&alt, w5b, m);
    assert_int_equal(m[0].from, 1);
    assert_int_equal(m[0].into, 2);
    /* Step 6: (v1, ṽ3, v4, v5, v6) = (0.3, 0.4, 0.2, 0.3, 0.9): v4 into v5. */
    vlist_push(&l, 6);
    const double w6[] = {0.3, 0.4, 0.2, 0.3, 0.9};
    plan_step(&l, w6, m);
    assert_int_equal(m[0].from, 2);
    assert_int_equal(m[0].into, 3);
    vlist_apply(&l, m, 1);
    expect_mix(l.v[2], (double[DIM]){[4] = 0.4, [5] = 0.6});
    /* Step 7: (v1, ṽ3, ṽ5, v6, v7) = (0.3, 0.4, 0.2, 0.5, 0.7): ṽ5 into v6. */
    vlist_push(&l, 7);
    const double w7[] = {0.3, 0.4, 0.2, 0.5, 0.7};
    plan_step(&l, w7, m);
    assert_int_equal(m[0].from, 2);
    assert_int_equal(m[0].into, 3);
    vlist_apply(&l, m, 1);
    /* Step 8: (v1, ṽ3, ṽ6, v7, v8) = (0.2, 0.4, 0.3, 0.4, 0.6): v1 into ṽ3. */
    vlist_push(&l, 8);
    const double w8[] = {0.2, 0.4, 0.3, 0.4, 0.6};
    plan_step(&l, w8, m);
    assert_int_equal(m[0].from, 0);
    assert_int_equal(m[0].into, 1);
    vlist_apply(&l, m, 1);
    /* Final: keys (k3, k6, k7, k8); ṽ3' = v1/3 + v2/9 + 5v3/9,
     * ṽ6 = 4/35 v4 + 6/35 v5 + 25/35 v6. */
    assert_int_equal(l.n, 4);
    const uint32_t keys[] = {3, 6, 7, 8};
    for (int i = 0; i < 4; i++)
        assert_int_equal(l.key[i], keys[i]);
    expect_mix(l.v[0], (double[DIM]){[1] = 1.0 / 3, [2] = 1.0 / 9, [3] = 5.0 / 9});
    expect_mix(l.v[1], (double[DIM]){[4] = 4.0 / 35, [5] = 6.0 / 35, [6] = 25.0 / 35});
    expect_mix(l.v[2], (double[DIM]){[7] = 1.0});
    expect_mix(l.v[3], (double[DIM]){[8] = 1.0});
}

/* ---- T-WKV2 through the host (m = 3, one head) ---- */

typedef struct attn {
    float data[8][64];
    const float *ptr[8];
} attn;

static const policy_decision *step_rows(policy_host *h, uint32_t layer, attn *a, uint32_t q,
                                        uint32_t new_tokens)
{
    for (uint32_t i = 0; i < q; i++)
        a->ptr[i] = a->data[i];
    policy_stats st = {.new_tokens = new_tokens, .last_attn = a->ptr, .confidence = -1};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, layer, &st, &d, err, sizeof err) != 0)
        fail_msg("step: %s", err);
    return d;
}

static void expect_state(policy_host *h, uint32_t head, const double *a, const double *c,
                         uint32_t n)
{
    const double *ga, *gc;
    uint32_t gn;
    assert_int_equal(weightedkv_head_state(policy_host_state(h), 0, head, &ga, &gc, &gn), 0);
    assert_int_equal(gn, n);
    for (uint32_t i = 0; i < n; i++) {
        assert_float_equal(ga[i], a[i], 1e-6);
        assert_float_equal(gc[i], c[i], 0.0);
    }
}

static void expect_positions(policy_host *h, uint32_t head, const uint32_t *pos, uint32_t n)
{
    const policy_layer_view *v = policy_host_view(h, 0);
    assert_int_equal(v->tokens[head], n);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(v->positions[head][i], pos[i]);
}

/* The T-WKV2 rows over `heads` query heads whose mean is the row. */
static void twkv2_rows(attn *a, uint32_t heads, const float *row, uint32_t n)
{
    for (uint32_t h = 0; h < heads; h++)
        for (uint32_t i = 0; i < n; i++) /* ±0.05 around the row; the mean is the row */
            a->data[h][i] = row[i] + (heads == 1 ? 0.0f : (h % 2 ? -0.05f : 0.05f));
}

static void run_twkv2(uint32_t q_heads, int literal)
{
    const char *k[] = {"cache_size", "n_init", "n_recent", "literal_overwrite"};
    const char *v[] = {"3", "0", "1", literal ? "1" : "0"};
    policy_geometry g = geom(1, q_heads, 1);
    policy_host *h = make_host(k, v, 4, &g);
    attn a = {0};
    const float rows[4][4] = {{1.0f}, {0.6f, 0.4f}, {0.5f, 0.2f, 0.3f}, {0.4f, 0.1f, 0.3f, 0.2f}};
    const double after_a[3][3] = {{1.0}, {1.6, 0.4}, {2.1, 0.6, 0.3}};
    const double after_c[3][3] = {{1}, {2, 1}, {3, 2, 1}};
    for (uint32_t s = 0; s < 3; s++) { /* steps 1..3: no merge yet */
        assert_int_equal(policy_host_append(h, 1), 0);
        twkv2_rows(&a, q_heads, rows[s], s + 1);
        const policy_decision *d = step_rows(h, 0, &a, q_heads, 1);
        assert_int_equal(d->nmerges, 0);
        assert_int_equal(policy_host_commit(h, 0), 0);
        expect_state(h, 0, after_a[s], after_c[s], s + 1);
    }
    /* Step 4: a = [2.5,0.7,0.6,0.2], c = [4,3,2,1], w = [0.625,0.2333,0.3,0.2];
     * j = 1 (the newest, w = 0.2, is no candidate): ṽ3 = 0.4375 v2 + 0.5625 v3. */
    assert_int_equal(policy_host_append(h, 1), 0);
    twkv2_rows(&a, q_heads, rows[3], 4);
    const policy_decision *d = step_rows(h, 0, &a, q_heads, 1);
    assert_int_equal(d->nmerges, 1);
    assert_int_equal(d->merges[0].head, 0);
    assert_int_equal(d->merges[0].from, 1);
    assert_int_equal(d->merges[0].into, 2);
    assert_float_equal(d->merges[0].w_from, 0.7 / 3, TOL);
    assert_float_equal(d->merges[0].w_into, 0.3, TOL);
    double wf = d->merges[0].w_from, wi = d->merges[0].w_into;
    assert_float_equal(wf / (wf + wi), 0.4375, TOL);
    assert_float_equal(wi / (wf + wi), 0.5625, TOL);
    assert_int_equal(d->tier[0][1], POLICY_EVICT);
    vlist l = {0};
    for (uint32_t t = 1; t <= 4; t++)
        vlist_push(&l, t);
    vlist_apply(&l, d->merges, d->nmerges);
    expect_mix(l.v[1], (double[DIM]){[2] = 0.4375, [3] = 0.5625});
    assert_int_equal(policy_host_commit(h, 0), 1);
    expect_positions(h, 0, (const uint32_t[]){0, 2, 3}, 3); /* keys k1, k3, k4 */
    if (literal) /* a = a/c on the merging step: the survivors' w */
        expect_state(h, 0, (const double[]){0.625, 0.3, 0.2}, (const double[]){4, 2, 1}, 3);
    else
        expect_state(h, 0, (const double[]){2.5, 0.6, 0.2}, (const double[]){4, 2, 1}, 3);
    /* Step 5 over (1,3,4,5) with [0.3,0.3,0.1,0.3]: a = [2.8,0.9,0.3,0.3],
     * c = [5,3,2,1], w = [0.56,0.3,0.15,0.3]: j = 2, ṽ5 = v4/3 + 2v5/3.
     * Literal: a = [0.925,0.6,0.3,0.3], w = [0.185,0.2,0.15,0.3]: j = 2 too. */
    assert_int_equal(policy_host_append(h, 1), 0);
    twkv2_rows(&a, q_heads, (const float[]){0.3f, 0.3f, 0.1f, 0.3f}, 4);
    d = step_rows(h, 0, &a, q_heads, 1);
    assert_int_equal(d->nmerges, 1);
    assert_int_equal(d->merges[0].from, 2);
    assert_int_equal(d->merges[0].into, 3);
    wf = d->merges[0].w_from;
    wi = d->merges[0].w_into;
    assert_float_equal(wf, 0.15, TOL);
    assert_float_equal(wi, 0.3, TOL);
    assert_float_equal(wf / (wf + wi), 1.0 / 3, TOL);
    vlist_push(&l, 5);
    vlist_apply(&l, d->merges, d->nmerges);
    expect_mix(l.v[2], (double[DIM]){[4] = 1.0 / 3, [5] = 2.0 / 3});
    assert_int_equal(policy_host_commit(h, 0), 1);
    expect_positions(h, 0, (const uint32_t[]){0, 2, 4}, 3);
    if (literal)
        expect_state(h, 0, (const double[]){0.185, 0.2, 0.3}, (const double[]){5, 3, 1}, 3);
    else
        expect_state(h, 0, (const double[]){2.8, 0.9, 0.3}, (const double[]){5, 3, 1}, 3);
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"c\":[5,3,1]"));
    free(js);
    policy_host_destroy(h);
}

static void test_twkv2_accumulation(void **unused)
{
    (void)unused;
    run_twkv2(1, 0);
}

static void test_twkv2_gqa_mean(void **unused)
{
    (void)unused;
    run_twkv2(4, 0); /* four query heads share the KV head: their mean is A_t */
}

static void test_twkv2_literal_overwrite(void **unused)
{
    (void)unused;
    run_twkv2(1, 1);
}

/* ---- edge cases ---- */

static void test_zero_weights(void **unused)
{
    (void)unused;
    float wf, wi;
    wkv_merge_weights(0.0, 0.0, &wf, &wi);
    assert_float_equal(wf, 1.0, 0.0);
    assert_float_equal(wi, 1.0, 0.0);
    wkv_merge_weights(0.0, 0.25, &wf, &wi); /* one zero: the neighbour takes all */
    assert_float_equal(wf, 0.0, 0.0);
    assert_float_equal(wi, 0.25, 0.0);
    assert_float_equal(wkv_weight(1.0, 0.0), 0.0, 0.0);
    assert_float_equal(wkv_weight(1.5, 3.0), 0.5, 0.0);
    /* Through the host: all attention 0 -> all w 0 -> lowest candidate
     * index (n_init = 1), merged as the plain average. */
    const char *k[] = {"cache_size", "n_init", "n_recent"};
    const char *v[] = {"3", "1", "1"};
    policy_geometry g = geom(1, 1, 1);
    policy_host *h = make_host(k, v, 3, &g);
    attn a = {0};
    assert_int_equal(policy_host_append(h, 3), 0);
    step_rows(h, 0, &a, 1, 3);
    policy_host_commit(h, 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    const policy_decision *d = step_rows(h, 0, &a, 1, 1);
    assert_int_equal(d->nmerges, 1);
    assert_int_equal(d->merges[0].from, 1);
    assert_int_equal(d->merges[0].into, 2);
    assert_float_equal(d->merges[0].w_from, 1.0, 0.0);
    assert_float_equal(d->merges[0].w_into, 1.0, 0.0);
    policy_host_destroy(h);
}

static void test_argmin_ties_and_protection(void **unused)
{
    (void)unused;
    uint32_t scratch[3 * 8];
    policy_merge m[8];
    /* Ties: lowest index. Protected: the first n_init = 2 and last n_recent = 3
     * never leave, even with the lowest weights. */
    const double w[] = {0.0, 0.0, 0.4, 0.2, 0.2, 0.0, 0.0, 0.0};
    const wkv_config cfg = {7, 2, 3};
    assert_int_equal(wkv_plan(w, 8, &cfg, 5, scratch, m), 1);
    assert_int_equal(m[0].head, 5);
    assert_int_equal(m[0].from, 3);
    assert_int_equal(m[0].into, 4);
    /* The right neighbour may be the first protected recent entry. */
    const double w2[] = {0.0, 0.0, 0.4, 0.3, 0.2, 0.0, 0.0, 0.0};
    assert_int_equal(wkv_plan(w2, 8, &cfg, 0, scratch, m), 1);
    assert_int_equal(m[0].from, 4);
    assert_int_equal(m[0].into, 5);
    /* n <= m: nothing. */
    assert_int_equal(wkv_plan(w, 7, &cfg, 0, scratch, m), 0);
    /* A NaN weight (from statistics the daemon would have refused) still
     * gives one merge of a candidate into its right neighbour. */
    const double wn[] = {0.0, 0.0, NAN, 0.3, 0.2, 0.0, 0.0, 0.0};
    assert_int_equal(wkv_plan(wn, 8, &cfg, 0, scratch, m), 1);
    assert_in_range(m[0].from, 2, 4);
    assert_int_equal(m[0].into, m[0].from + 1);
    /* Several merges (prefill), m = 5 of 8: victims in (w, index) order,
     * 4 (0.2), 3 (0.3), 2 (0.4), each into its right neighbour at its
     * turn, which is 5 every time. */
    assert_int_equal(wkv_plan(w2, 8, &(wkv_config){5, 2, 3}, 0, scratch, m), 3);
    const uint32_t from[] = {4, 3, 2}, into[] = {5, 5, 5};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(m[i].from, from[i]);
        assert_int_equal(m[i].into, into[i]);
    }
    /* A victim that first absorbs an earlier one: 3 (0.1) into 4, then 4. */
    const double w3[] = {0.9, 0.5, 0.5, 0.1, 0.2, 0.9, 0.9};
    assert_int_equal(wkv_plan(w3, 7, &(wkv_config){5, 1, 1}, 0, scratch, m), 2);
    assert_int_equal(m[0].from, 3);
    assert_int_equal(m[0].into, 4);
    assert_int_equal(m[1].from, 4);
    assert_int_equal(m[1].into, 5);
    /* Flattened for the host: both into 5, the same final value. */
    policy_merge f[8];
    uint32_t us[3 * 8];
    double ds[8];
    wkv_flatten(m, 2, 7, f, us, ds);
    assert_int_equal(f[0].from, 3);
    assert_int_equal(f[0].into, 5);
    assert_float_equal(f[0].w_from, 0.2 / 3, 1e-7);
    assert_float_equal(f[0].w_into, 0.9, 1e-7);
    assert_int_equal(f[1].from, 4);
    assert_int_equal(f[1].into, 5);
    assert_float_equal(f[1].w_from, 0.4 / 3, 1e-7);
    assert_float_equal(f[1].w_into, 0.9 + 0.2 / 3, 1e-7);
}

/* merge = 0: the same victims, no merge records. */
static void test_merge_off(void **unused)
{
    (void)unused;
    const char *k[] = {"cache_size", "n_init", "n_recent", "merge"};
    const char *v[] = {"3", "0", "1", "0"};
    policy_geometry g = geom(1, 1, 1);
    policy_host *h = make_host(k, v, 4, &g);
    attn a = {0};
    const float rows[4][4] = {{1.0f}, {0.6f, 0.4f}, {0.5f, 0.2f, 0.3f}, {0.4f, 0.1f, 0.3f, 0.2f}};
    for (uint32_t s = 0; s < 4; s++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        memcpy(a.data[0], rows[s], sizeof rows[s]);
        const policy_decision *d = step_rows(h, 0, &a, 1, 1);
        assert_int_equal(d->nmerges, 0);
        assert_int_equal(policy_host_commit(h, 0), s == 3);
    }
    expect_positions(h, 0, (const uint32_t[]){0, 2, 3}, 3);
    policy_host_destroy(h);
}

/* Per KV head: 2 KV heads, 2 query heads each, different attention: the
 * heads' lists diverge, and each head reads only its own group. */
static void test_heads_diverge(void **unused)
{
    (void)unused;
    const char *k[] = {"cache_size", "n_init", "n_recent"};
    const char *v[] = {"3", "0", "1"};
    policy_geometry g = geom(1, 4, 2);
    policy_host *h = make_host(k, v, 3, &g);
    attn a = {0};
    assert_int_equal(policy_host_append(h, 3), 0);
    step_rows(h, 0, &a, 4, 3);
    policy_host_commit(h, 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    /* KV head 0 (q 0,1): token 0 lowest; KV head 1 (q 2,3): token 1 lowest. */
    const float r[4][4] = {{0.0f, 0.5f, 0.5f, 0.0f},
                           {0.2f, 0.5f, 0.3f, 0.0f},
                           {0.5f, 0.0f, 0.5f, 0.0f},
                           {0.5f, 0.2f, 0.3f, 0.0f}};
    memcpy(a.data[0], r[0], sizeof r[0]);
    memcpy(a.data[1], r[1], sizeof r[1]);
    memcpy(a.data[2], r[2], sizeof r[2]);
    memcpy(a.data[3], r[3], sizeof r[3]);
    const policy_decision *d = step_rows(h, 0, &a, 4, 1);
    assert_int_equal(d->nmerges, 2);
    assert_int_equal(d->merges[0].head, 0);
    assert_int_equal(d->merges[0].from, 0);
    assert_int_equal(d->merges[1].head, 1);
    assert_int_equal(d->merges[1].from, 1);
    assert_int_equal(policy_host_commit(h, 0), 2);
    expect_positions(h, 0, (const uint32_t[]){1, 2, 3}, 3);
    expect_positions(h, 1, (const uint32_t[]){0, 2, 3}, 3);
    policy_host_destroy(h);
}

/* Prefill extension (§4.1): window_attn over the whole prompt gives
 * a[i] = Σ_{q≥i} A[q][i] and c[i] = L − i; then merges until n <= m. */
static void test_prefill_extension(void **unused)
{
    (void)unused;
    const char *k[] = {"cache_size", "n_init", "n_recent"};
    const char *v[] = {"3", "1", "1"};
    policy_geometry g = geom(1, 1, 1);
    policy_host *h = make_host(k, v, 3, &g);
    /* Causal attention of a 5-token prompt, rows q = 0..4. */
    const double A[5][5] = {
        {1.0}, {0.5, 0.5}, {0.6, 0.1, 0.3}, {0.4, 0.3, 0.2, 0.1}, {0.5, 0.05, 0.15, 0.1, 0.2}};
    attn win = {0}, last = {0};
    for (int i = 0; i < 5; i++) {
        double s = 0.0;
        for (int q = 0; q < 5; q++)
            s += A[q][i];
        win.data[0][i] = (float)(s / 5.0); /* the mean over the 5 window queries */
        last.data[0][i] = (float)A[4][i];
    }
    win.ptr[0] = win.data[0];
    last.ptr[0] = last.data[0];
    assert_int_equal(policy_host_append(h, 5), 0);
    policy_stats st = {.new_tokens = 5,
                       .prefill = 1,
                       .last_attn = last.ptr,
                       .window_attn = win.ptr,
                       .window_queries = 5,
                       .confidence = -1};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    /* a = [3.0, 0.95, 0.65, 0.2, 0.2], c = [5,4,3,2,1],
     * w = [0.6, 0.2375, 0.2167, 0.1, 0.2]; candidates [1, 4):
     * 3 (0.1) into 4, then 2 (0.2167) into 4. */
    assert_int_equal(d->nmerges, 2);
    assert_int_equal(d->merges[0].from, 3);
    assert_int_equal(d->merges[0].into, 4);
    assert_float_equal(d->merges[0].w_from, 0.1, TOL);
    assert_int_equal(d->merges[1].from, 2);
    assert_int_equal(d->merges[1].into, 4);
    assert_float_equal(d->merges[1].w_from, 0.65 / 3, TOL);
    assert_float_equal(d->merges[1].w_into, 0.2, TOL);
    assert_int_equal(policy_host_commit(h, 0), 2);
    expect_state(h, 0, (const double[]){3.0, 0.95, 0.2}, (const double[]){5, 4, 1}, 3);
    policy_host_destroy(h);

    /* Without window_attn, a prefill step accumulates its last row once. */
    h = make_host(k, v, 3, &g);
    assert_int_equal(policy_host_append(h, 5), 0);
    st.window_attn = NULL;
    st.window_queries = 0;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    /* w = A[4] = [0.5,0.05,0.15,0.1,0.2]: candidates 1..3: 1, then 3. */
    assert_int_equal(d->nmerges, 2);
    assert_int_equal(d->merges[0].from, 1);
    assert_int_equal(d->merges[0].into, 2);
    assert_int_equal(d->merges[1].from, 3);
    assert_int_equal(d->merges[1].into, 4);
    policy_host_commit(h, 0);
    expect_state(h, 0, (const double[]){0.5, 0.15, 0.2}, (const double[]){1, 1, 1}, 3);
    policy_host_destroy(h);
}

static void test_missing_stats(void **unused)
{
    (void)unused;
    policy_geometry g = geom(1, 2, 1);
    policy_host *h = make_host(NULL, NULL, 0, &g);
    assert_int_equal(policy_host_append(h, 2), 0);
    policy_stats st = {.new_tokens = 2, .confidence = -1};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "last_attn"));
    attn a = {0};
    a.ptr[0] = a.data[0];
    st.last_attn = a.ptr; /* query head 1 missing */
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "last_attn"));
    a.ptr[1] = a.data[1];
    st.new_tokens = 1; /* the policy tracks 0 tokens, the list holds 2 */
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "out of sync"));
    st.new_tokens = 2;
    st.prefill = 1;
    st.window_attn = a.ptr;
    st.window_queries = 3; /* more than the step's queries */
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "window_queries"));
    policy_host_destroy(h);
}

/* ---- invalid configurations and defaults ---- */

static void test_invalid_configs(void **unused)
{
    (void)unused;
    policy_geometry g = geom(2, 4, 2);
    static const ph_reject cases[] = {
        {{"cache_size=128"}, {"cache_size", "n_init", "n_recent"}},
        {{"cache_size=10", "n_init=4", "n_recent=6"}, {"cache_size", "n_init", "n_recent"}},
        {{"n_recent=0"}, {"n_recent", "[1, 1048576]"}},
        {{"merge=2"}, {"merge", "[0, 1]"}},
        {{"literal_overwrite=yes"}, {"literal_overwrite", "[0, 1]"}},
        {{"cache_size=-3"}, {"cache_size", "[2, 1048576]"}},
    };
    ph_expect_rejects("weightedkv", g, cases, PH_N(cases));
    ph_expect_reject("weightedkv", NULL, geom(1, 3, 2), "kv_heads"); /* q_heads % kv_heads */
    /* The smallest accepted middle: m = n_init + n_recent + 1. */
    policy_host *h = make_host((const char *[]){"cache_size", "n_init", "n_recent"},
                               (const char *[]){"10", "4", "5"}, 3, &g);
    policy_host_destroy(h);
}

static void test_defaults(void **unused)
{
    (void)unused;
    static const ph_default defaults[] = {{"cache_size", "256"},
                                          {"n_init", "4"},
                                          {"n_recent", "124"},
                                          {"merge", "1"},
                                          {"literal_overwrite", "0"}};
    ph_expect_registry("weightedkv", POLICY_NEEDS_LAST_ATTN, 1, defaults, PH_N(defaults));
}

/* ---- properties on seeded random stats ---- */

static uint64_t rng_state;

/* The harness's seeded stream. */
static uint32_t rng(void)
{
    return (uint32_t)ph_rand(&rng_state);
}

static double rng_unit(void)
{
    return ph_uniform(&rng_state, 0, 1);
}

/*
 * Lists longer than the step's blocks (weightedkv.c WKV_BLOCK, 512): from a
 * prompt of 1,020 tokens, decode steps whose old entries end before, at and
 * after a block's edge, then evict. Every step's a and c equal a model's
 * bit for bit (one query head: its row is the mean), and each evicted token
 * is the first minimum of a/c over the candidates.
 */
static void test_long_lists(void **unused)
{
    (void)unused;
    enum { PROMPT = 1020, STEPS = 100, CAP = 1100, N_INIT = 4, N_RECENT = 8 };
    const char *k[] = {"cache_size", "n_init", "n_recent"};
    const char *v[] = {"1100", "4", "8"};
    policy_geometry g = geom(1, 1, 1);
    policy_host *h = make_host(k, v, 3, &g);
    double *ma = calloc(PROMPT + STEPS, sizeof *ma), *mc = calloc(PROMPT + STEPS, sizeof *mc);
    float *row = malloc((PROMPT + STEPS) * sizeof *row);
    assert_true(ma && mc && row);
    rng_state = 31;
    uint32_t n = 0, evictions = 0;
    for (uint32_t step = 0; step <= STEPS; step++) {
        uint32_t add = step == 0 ? PROMPT : 1, evicted = 0;
        assert_int_equal(policy_host_append(h, add), 0);
        for (uint32_t i = 0; i < n + add; i++)
            row[i] = (float)(rng() % 1000) / 1000.0f;
        const float *rows[1] = {row};
        policy_stats st = {.new_tokens = add, .last_attn = rows, .confidence = -1};
        const policy_decision *d;
        char err[POLICY_ERR_LEN] = "";
        if (policy_host_step(h, 0, &st, &d, err, sizeof err) != 0)
            fail_msg("step: %s", err);
        for (uint32_t i = 0; i < n + add; i++) {
            ma[i] = (i < n ? ma[i] : 0.0) + (0.0 + (double)row[i]) / 1.0;
            mc[i] = (i < n ? mc[i] : 0.0) + 1.0;
        }
        n += add;
        if (n > CAP) {
            uint32_t j = N_INIT;
            for (uint32_t i = N_INIT; i < n - N_RECENT; i++)
                j = ma[i] / mc[i] < ma[j] / mc[j] ? i : j;
            assert_int_equal(d->nmerges, 1);
            assert_int_equal(d->merges[0].from, j);
            memmove(ma + j, ma + j + 1, (n - j - 1) * sizeof *ma);
            memmove(mc + j, mc + j + 1, (n - j - 1) * sizeof *mc);
            n--;
            evicted = 1;
        }
        evictions += evicted;
        assert_int_equal(policy_host_commit(h, 0), evicted);
        const double *ga, *gc;
        uint32_t gn;
        assert_int_equal(weightedkv_head_state(policy_host_state(h), 0, 0, &ga, &gc, &gn), 0);
        assert_int_equal(gn, n);
        assert_memory_equal(ga, ma, n * sizeof *ma);
        assert_memory_equal(gc, mc, n * sizeof *mc);
    }
    assert_int_equal(evictions, PROMPT + STEPS - CAP);
    free(ma);
    free(mc);
    free(row);
    policy_host_destroy(h);
}

/* wkv_plan equals Algorithm 1 run one merge at a time: argmin over the
 * current list's candidates, merge into the right neighbour, delete. */
static void test_plan_equals_sequential(void **unused)
{
    (void)unused;
    enum { N = 40 };
    rng_state = 7;
    for (int trial = 0; trial < 500; trial++) {
        double w[N];
        size_t n = 6 + rng() % (N - 6);
        for (size_t i = 0; i < n; i++)
            w[i] = (double)(rng() % 6) / 8.0; /* few distinct values: many ties */
        wkv_config cfg = {0, rng() % 3, 1 + rng() % 3};
        uint32_t lo = cfg.n_init + cfg.n_recent + 1;
        cfg.cache_size = lo + rng() % (uint32_t)(n + 2 - lo);
        uint32_t scratch[3 * N];
        policy_merge m[N];
        size_t count = wkv_plan(w, n, &cfg, 3, scratch, m);
        /* the reference */
        uint32_t idx[N];
        size_t len = n, k = 0;
        for (size_t i = 0; i < n; i++)
            idx[i] = (uint32_t)i;
        while (len > cfg.cache_size) {
            size_t best = cfg.n_init;
            for (size_t j = cfg.n_init; j < len - cfg.n_recent; j++)
                if (w[idx[j]] < w[idx[best]])
                    best = j;
            assert_true(k < count);
            assert_int_equal(m[k].head, 3);
            assert_int_equal(m[k].from, idx[best]);
            assert_int_equal(m[k].into, idx[best + 1]);
            memmove(&idx[best], &idx[best + 1], (len - best - 1) * sizeof idx[0]);
            len--;
            k++;
        }
        assert_int_equal(count, k);
    }
}

/* wkv_flatten on random plans with many merges: the same values as the
 * plan applied in order; every `into` is kept, every victim `from` once; a
 * plan without chains is unchanged. */
static void test_flatten_equals_plan(void **unused)
{
    (void)unused;
    enum { N = 48, D = 3 };
    rng_state = 11;
    int chains = 0;
    for (int trial = 0; trial < 400; trial++) {
        double w[N];
        size_t n = 8 + rng() % (N - 8);
        for (size_t i = 0; i < n; i++) /* zeros too: the (1,1) and one-zero weights */
            w[i] = (double)(rng() % 5) / 4.0 * (rng() % 4 ? 1.0 : 0.0);
        wkv_config cfg = {0, rng() % 3, 1 + rng() % 3};
        uint32_t lo = cfg.n_init + cfg.n_recent + 1;
        cfg.cache_size = lo + rng() % (uint32_t)(n - lo);
        uint32_t scratch[3 * N];
        double ds[N];
        policy_merge plan[N], flat[N];
        size_t k = wkv_plan(w, n, &cfg, 0, scratch, plan);
        assert_int_equal(k, n - cfg.cache_size);
        wkv_flatten(plan, k, n, flat, scratch, ds);
        float a[N][D], b[N][D];
        for (size_t i = 0; i < n; i++)
            for (size_t x = 0; x < D; x++)
                a[i][x] = b[i][x] = (float)rng_unit() - 0.5f;
        ph_merge_values(&a[0][0], n, D, plan, k, 0);
        ph_merge_values(&b[0][0], n, D, flat, k, 0);
        uint8_t gone[N] = {0};
        int chain = 0;
        for (size_t m = 0; m < k; m++) {
            assert_int_equal(gone[flat[m].from], 0);
            gone[flat[m].from] = 1;
        }
        for (size_t m = 0; m < k; m++) {
            assert_int_equal(gone[flat[m].into], 0);
            chain |= gone[plan[m].into];
        }
        chains += chain;
        if (!chain)
            assert_memory_equal(plan, flat, k * sizeof plan[0]);
        for (size_t i = 0; i < n; i++)
            if (!gone[i])
                for (size_t x = 0; x < D; x++)
                    assert_float_equal(a[i][x], b[i][x], 1e-5);
    }
    assert_true(chains > 50); /* the property was exercised */
}

/* A long prefill through the host: chains are flattened, the host accepts
 * the decision, and the kept values match Algorithm 1 one merge at a time. */
static void test_prefill_chains_through_host(void **unused)
{
    (void)unused;
    enum { P = 60, M = 12 };
    const char *k[] = {"cache_size", "n_init", "n_recent"};
    const char *v[] = {"12", "2", "4"};
    policy_geometry g = geom(1, 1, 1);
    policy_host *h = make_host(k, v, 3, &g);
    static float row[P];
    rng_state = 5;
    for (int i = 0; i < P; i++)
        row[i] = (float)rng_unit();
    const float *ptr[1] = {row};
    assert_int_equal(policy_host_append(h, P), 0);
    policy_stats st = {.new_tokens = P, .prefill = 1, .last_attn = ptr, .confidence = -1};
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, 0, &st, &d, err, sizeof err) != 0)
        fail_msg("step: %s", err);
    assert_int_equal(d->nmerges, P - M);
    /* Reference: Algorithm 1 one merge at a time on one-hot values. */
    static float ref[P][P], got[P][P];
    memset(ref, 0, sizeof ref);
    for (int i = 0; i < P; i++)
        ref[i][i] = 1.0f;
    memcpy(got, ref, sizeof ref);
    uint32_t idx[P];
    for (int i = 0; i < P; i++)
        idx[i] = (uint32_t)i;
    size_t len = P;
    while (len > M) {
        size_t best = 2;
        for (size_t j = 2; j < len - 4; j++)
            if (row[idx[j]] < row[idx[best]])
                best = j;
        policy_merge one = {0, idx[best], idx[best + 1], 0, 0};
        wkv_merge_weights(row[idx[best]], row[idx[best + 1]], &one.w_from, &one.w_into);
        ph_merge_values(&ref[0][0], P, P, &one, 1, 0);
        memmove(&idx[best], &idx[best + 1], (len - best - 1) * sizeof idx[0]);
        len--;
    }
    ph_merge_values(&got[0][0], P, P, d->merges, d->nmerges, 0);
    assert_int_equal(policy_host_commit(h, 0), P - M);
    const policy_layer_view *view = policy_host_view(h, 0);
    assert_int_equal(view->tokens[0], M);
    for (int i = 0; i < M; i++) {
        assert_int_equal(view->positions[0][i], idx[i]);
        for (int x = 0; x < P; x++)
            assert_float_equal(got[idx[i]][x], ref[idx[i]][x], 1e-5);
    }
    policy_host_destroy(h);
}

/* A random decode run through the host with merges applied to one-hot
 * values. Checks after every step: each list holds min(m, appended)
 * entries, the first n_init and last n_recent positions are held, every
 * held row is a convex mixture that includes its own token, and no value
 * is lost when merging (every token ever appended weighs in some row).
 * Returns a hash of all decisions. */
static uint64_t run_random(uint64_t seed, int merge)
{
    enum { Q = 4, KV = 2, L = 2, T = 90, M = 20, NI = 2, NR = 5 };
    const char *k[] = {"cache_size", "n_init", "n_recent", "merge"};
    const char *v[] = {"20", "2", "5", merge ? "1" : "0"};
    policy_geometry g = geom(L, Q, KV);
    policy_host *h = make_host(k, v, 4, &g);
    static float vals[L][KV][T][T]; /* [layer][head][list index][token] */
    memset(vals, 0, sizeof vals);
    static float rowbuf[Q][T];
    const float *ptr[Q];
    rng_state = seed;
    uint64_t hash = 14695981039346656037ull;
    for (uint32_t t = 0; t < T; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        for (uint32_t l = 0; l < L; l++) {
            const policy_layer_view *view = policy_host_view(h, l);
            for (uint32_t kv = 0; kv < KV; kv++)
                vals[l][kv][view->tokens[kv] - 1][t] = 1.0f; /* the new token's value */
            for (uint32_t q = 0; q < Q; q++) {
                for (uint32_t i = 0; i < T; i++)
                    rowbuf[q][i] = (float)rng_unit();
                ptr[q] = rowbuf[q];
            }
            policy_stats st = {.new_tokens = 1, .last_attn = ptr, .confidence = -1};
            const policy_decision *d;
            char err[POLICY_ERR_LEN] = "";
            if (policy_host_step(h, l, &st, &d, err, sizeof err) != 0)
                fail_msg("step: %s", err);
            assert_int_equal(d->nmerges, merge && view->tokens[0] > M ? KV : 0);
            for (uint32_t kv = 0; kv < KV; kv++) {
                uint32_t n = view->tokens[kv];
                ph_merge_values(&vals[l][kv][0][0], n, T, d->merges, d->nmerges, kv);
                uint32_t out = 0;
                for (uint32_t i = 0; i < n; i++) {
                    if (d->tier[kv][i] == POLICY_EVICT) {
                        hash = (hash ^ (view->positions[kv][i] + 1000u * kv)) * 1099511628211ull;
                        continue;
                    }
                    memmove(vals[l][kv][out], vals[l][kv][i], sizeof vals[l][kv][i]);
                    out++;
                }
                for (uint32_t i = out; i < n; i++)
                    memset(vals[l][kv][i], 0, sizeof vals[l][kv][i]);
            }
            for (size_t x = 0; x < d->nmerges; x++)
                hash = (hash ^ (uint64_t)(d->merges[x].w_from * 1e6f)) * 1099511628211ull;
            policy_host_commit(h, l);
            view = policy_host_view(h, l);
            uint32_t appended = t + 1;
            for (uint32_t kv = 0; kv < KV; kv++) {
                uint32_t n = view->tokens[kv];
                const uint32_t *pos = view->positions[kv];
                assert_int_equal(n, appended < M ? appended : M);
                for (uint32_t i = 0; i < NI && i < n; i++)
                    assert_int_equal(pos[i], i);
                for (uint32_t i = 0; i < NR && i < n; i++)
                    assert_int_equal(pos[n - 1 - i], appended - 1 - i);
                for (uint32_t i = 0; i < n; i++) {
                    double s = 0.0;
                    for (uint32_t x = 0; x < T; x++)
                        s += vals[l][kv][i][x];
                    assert_float_equal(s, 1.0, 1e-4);                     /* convex */
                    assert_true(vals[l][kv][i][pos[i]] > 0.0f || !merge); /* own key's value */
                }
                /* merge: every value ever appended still weighs in some row
                 * (attention is positive, so every merge weight is); off:
                 * exactly the held tokens' values remain. */
                for (uint32_t x = 0; x < appended; x++) {
                    int held = 0, present = 0;
                    for (uint32_t i = 0; i < n; i++) {
                        held |= pos[i] == x;
                        present |= vals[l][kv][i][x] > 0.0f;
                    }
                    assert_int_equal(present, merge ? 1 : held);
                }
            }
        }
    }
    policy_host_destroy(h);
    return hash;
}

static void test_random_properties(void **unused)
{
    (void)unused;
    for (uint64_t seed = 1; seed <= 4; seed++) {
        uint64_t a = run_random(seed, 1);
        assert_true(a == run_random(seed, 1));
        run_random(seed, 0);
    }
    assert_true(run_random(1, 1) != run_random(2, 1));
}

/* ---- moving a sequence (export_layer / import_layer) ---- */

/* Moved mid-run, the host decides as the original: GQA with two KV heads
 * over two layers, MHA with literal_overwrite, and the Eviction ablation
 * (merge=0) over three layers. Each merges on every decode step. */
static void test_portable(void **unused)
{
    (void)unused;
    const char *gqa[] = {"cache_size=8", "n_init=1", "n_recent=2", NULL};
    ph_check_portable("weightedkv", gqa, geom(2, 4, 2), 20, 12, 1);
    const char *literal[] = {"cache_size=12", "n_init=2", "n_recent=3", "literal_overwrite=1",
                             NULL};
    ph_check_portable("weightedkv", literal, geom(1, 2, 2), 30, 10, 2);
    const char *evict[] = {"cache_size=6", "n_init=0", "n_recent=1", "merge=0", NULL};
    ph_check_portable("weightedkv", evict, geom(3, 8, 2), 9, 16, 3);
}

static void test_import_refuses(void **unused)
{
    (void)unused;
    const char *kv[] = {"cache_size=8", "n_init=1", "n_recent=2", NULL};
    policy_geometry g = geom(1, 4, 2);
    policy_host *a = ph_host("weightedkv", kv, g);
    uint64_t rng = 9;
    ph_round(a, &g, 20, 1, &rng);
    ph_round(a, &g, 3, 0, &rng);
    size_t len;
    uint8_t *buf = policy_host_export_state(a, 0, &len);
    assert_non_null(buf);
    /* Both heads at m = 8: header, counts, then a[8], c[8] per head. */
    enum { N = 8, COUNTS = WKV_STATE_HEAD, A0 = COUNTS + 8, C0 = A0 + 8 * N };
    assert_int_equal(len, WKV_STATE_HEAD + 2 * 4 + 2 * 16 * N);
    /* A state with content first, so that "unchanged" means something. */
    policy_host *b = ph_host("weightedkv", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(
        policy_host_ops(b)->import_layer(policy_host_state(b), 0, buf, len, err, sizeof err), 0);
    const uint64_t nan_bits = 0x7ff8000000000000ull, inf_bits = 0x7ff0000000000000ull;
    const ph_spoil cases[] = {
        {"wrong magic", 3, 1, 'x', 0, "magic"},
        {"a future version", 4, 1, 2, 0, "version"},
        {"not the geometry's kv_heads", 5, 4, 3, 0, "KV heads"},
        {"a count against the length", COUNTS, 4, N - 1, 0, "need"},
        {"an n no allocation may trust", COUNTS + 4, 4, UINT32_MAX, 0, "cache_size"},
        {"more than a step leaves", COUNTS + 4, 4, N + 1, 0, "cache_size"},
        {"a trailing byte", 0, 0, 0, 1, "need"},
        {"a NaN accumulator", A0 + 8 * 2, 8, nan_bits, 0, "entry 2"},
        {"an infinite count", C0 + 8 * 5, 8, inf_bits, 0, "entry 5"},
        {"c = 0 (w = a/0)", C0 + 16 * N + 8 * 7, 8, 0, 0, "head 1 entry 7"},
    };
    for (size_t i = 0; i < PH_N(cases); i++)
        ph_expect_refused(b, 0, buf, len, &cases[i]);
    /* Cut inside the header, and inside the counts: refused before reading. */
    const policy_ops *ops = policy_host_ops(b);
    assert_int_equal(
        ops->import_layer(policy_host_state(b), 0, buf, WKV_STATE_HEAD - 1, err, sizeof err), -1);
    assert_non_null(strstr(err, "header"));
    assert_int_equal(
        ops->import_layer(policy_host_state(b), 0, buf, WKV_STATE_HEAD + 6, err, sizeof err), -1);
    assert_non_null(strstr(err, "counts"));
    free(buf);
    policy_host_destroy(a);
    policy_host_destroy(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_twkv1_fig3),
        cmocka_unit_test(test_twkv2_accumulation),
        cmocka_unit_test(test_twkv2_gqa_mean),
        cmocka_unit_test(test_twkv2_literal_overwrite),
        cmocka_unit_test(test_long_lists),
        cmocka_unit_test(test_zero_weights),
        cmocka_unit_test(test_argmin_ties_and_protection),
        cmocka_unit_test(test_merge_off),
        cmocka_unit_test(test_heads_diverge),
        cmocka_unit_test(test_prefill_extension),
        cmocka_unit_test(test_missing_stats),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_plan_equals_sequential),
        cmocka_unit_test(test_flatten_equals_plan),
        cmocka_unit_test(test_prefill_chains_through_host),
        cmocka_unit_test(test_random_properties),
        cmocka_unit_test(test_portable),
        cmocka_unit_test(test_import_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
