/*
 * test_policy_snapkv.c - policy "snapkv" and the SnapKV base scorer
 * (POLICIES.md §1.3, §1.6, §1.7, §1.9; policies/snapkv_family.h).
 *
 * Vectors: T-SNAP1 (avg pool), max-pool vectors computed by hand, base
 * scores of a GQA layer by hand, and whole prefill steps through the policy
 * host whose kept sets were computed by hand. Properties on seeded random
 * stats: kvpress's keep_highest_score (the kept set of each head is exactly
 * the top n_keep of the §1.3 score, computed by an independent reference),
 * the budget extension never leaves a layer over budget, window tokens
 * survive, same input gives the same output.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "snapkv_harness.h"

static void expect_vec(const double *got, const double *want, size_t n, double tol)
{
    for (size_t i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > tol)
            fail_msg("entry %zu: got %.9g, expected %.9g", i, got[i], want[i]);
}

/* ---- pooling ---- */

static void test_snap1_avg_pool(void **s)
{
    (void)s;
    /* T-SNAP1: k=5, zero padding counted. */
    const double in[5] = {0.1, 0.2, 0.3, 0.4, 0.5};
    const double want[5] = {0.12, 0.20, 0.30, 0.28, 0.24};
    double out[5];
    snapkv_pool(in, 5, 5, SNAPKV_POOL_AVG, out);
    expect_vec(out, want, 5, 1e-12);
}

static void test_max_pool_by_hand(void **s)
{
    (void)s;
    const double in[6] = {0.1, 0.5, 0.2, 0.0, 0.3, 0.1};
    double out[6];
    snapkv_pool(in, 6, 3, SNAPKV_POOL_MAX, out);
    expect_vec(out, (const double[]){0.5, 0.5, 0.5, 0.3, 0.3, 0.3}, 6, 0);
    snapkv_pool(in, 6, 5, SNAPKV_POOL_MAX, out);
    expect_vec(out, (const double[]){0.5, 0.5, 0.5, 0.5, 0.3, 0.3}, 6, 0);
    /* Padded positions never win a max: with zero padding the ends would be 0. */
    const double neg[3] = {-1, -2, -3};
    snapkv_pool(neg, 3, 3, SNAPKV_POOL_MAX, out);
    expect_vec(out, (const double[]){-1, -1, -2}, 3, 0);
    /* ...while avg counts the padded zeros in its divisor. */
    snapkv_pool(neg, 3, 3, SNAPKV_POOL_AVG, out);
    expect_vec(out, (const double[]){-1, -2, -5.0 / 3}, 3, 1e-12);
}

static void test_pool_edges(void **s)
{
    (void)s;
    const double in[3] = {0.1, 0.2, 0.3};
    double out[3];
    snapkv_pool(in, 3, 1, SNAPKV_POOL_AVG, out); /* kernel 1: identity */
    expect_vec(out, in, 3, 0);
    snapkv_pool(in, 3, 1, SNAPKV_POOL_MAX, out);
    expect_vec(out, in, 3, 0);
    /* A kernel wider than the row: every output sums the whole row / k. */
    snapkv_pool(in, 3, 7, SNAPKV_POOL_AVG, out);
    expect_vec(out, (const double[]){0.6 / 7, 0.6 / 7, 0.6 / 7}, 3, 1e-12);
    snapkv_pool(in, 1, 5, SNAPKV_POOL_AVG, out);
    expect_vec(out, (const double[]){0.1 / 5}, 1, 1e-12);
}

/* ---- base scores of a GQA layer ---- */

/* Hq = 4, Hkv = 2 (G = 2), lists of 6 tokens: prefix 4, window 2, k = 3. */
static const float by_hand_attn[4][6] = {
    {0.3f, 0.0f, 0.6f, 0.0f, 9, 9}, /* window entries are never read */
    {0.0f, 0.3f, 0.0f, 0.3f, 9, 9},
    {0.9f, 0.0f, 0.0f, 0.0f, 9, 9},
    {0.0f, 0.0f, 0.0f, 0.0f, 9, 9},
};

static void base_by_hand(snapkv_pooling pool, snapkv_window_pad pad, double out[2][6])
{
    const float *rows[4] = {by_hand_attn[0], by_hand_attn[1], by_hand_attn[2], by_hand_attn[3]};
    const uint32_t len[2] = {6, 6}, prefix[2] = {4, 4};
    double *score[2] = {out[0], out[1]};
    double scratch[16];
    snapkv_base_scores(rows, 4, 2, len, prefix, 3, pool, pad, score, scratch);
}

static void test_base_scores_by_hand(void **s)
{
    (void)s;
    double out[2][6];
    /* avg: h0 -> [.1 .3 .2 .2], h1 -> [.1 .1 .2 .1], mean g0 = [.1 .2 .2 .15];
     * h2 -> [.3 .3 0 0], h3 -> 0, g1 = [.15 .15 0 0]; max .2 -> window 1.2. */
    base_by_hand(SNAPKV_POOL_AVG, SNAPKV_PAD_MAX_PLUS_ONE, out);
    expect_vec(out[0], (const double[]){0.1, 0.2, 0.2, 0.15, 1.2, 1.2}, 6, 1e-7);
    expect_vec(out[1], (const double[]){0.15, 0.15, 0, 0, 1.2, 1.2}, 6, 1e-7);
    base_by_hand(SNAPKV_POOL_AVG, SNAPKV_PAD_MAX, out); /* [DKV]: max + 0 */
    expect_vec(out[1], (const double[]){0.15, 0.15, 0, 0, 0.2, 0.2}, 6, 1e-7);
    /* max: h0 -> [.3 .6 .6 .6], h1 -> [.3 .3 .3 .3], g0 = [.3 .45 .45 .45];
     * h2 -> [.9 .9 0 0], g1 = [.45 .45 0 0]; window 1.45. */
    base_by_hand(SNAPKV_POOL_MAX, SNAPKV_PAD_MAX_PLUS_ONE, out);
    expect_vec(out[0], (const double[]){0.3, 0.45, 0.45, 0.45, 1.45, 1.45}, 6, 1e-7);
    expect_vec(out[1], (const double[]){0.45, 0.45, 0, 0, 1.45, 1.45}, 6, 1e-7);
}

static void test_budget_arithmetic(void **s)
{
    (void)s;
    assert_int_equal(snapkv_n_keep(10, 0.5), 5);
    assert_int_equal(snapkv_n_keep(6, 0.6), 2);    /* 6·0.4 = 2.4000000000000004 */
    assert_int_equal(snapkv_n_keep(128, 0.8), 25); /* 25.599999999999994 */
    assert_int_equal(snapkv_n_keep(65, 0.5), 32);
    assert_int_equal(snapkv_n_keep(7, 0), 7);
}

/* ---- whole prefill steps through the host, by hand ---- */

/* One layer, Hq = 2, Hkv = 1, 6 tokens (prefix 4 + window 2), kernel 3.
 * Rows are dyadic so that every sum is exact. */
static const float e2e_attn[2][6] = {
    {0.5f, 0.125f, 0.25f, 0.0f, 0, 0},
    {0.0f, 0.125f, 0.625f, 0.875f, 0, 0},
};

static policy_host *e2e_run(const char *const *kv)
{
    policy_host *h = ph_host("snapkv", kv, ph_geom(1, 2, 1));
    assert_int_equal(policy_host_append(h, 6), 0);
    const float *rows[2] = {e2e_attn[0], e2e_attn[1]};
    policy_stats st = {
        .new_tokens = 6, .prefill = 1, .window_attn = rows, .window_queries = 2, .confidence = -1};
    ph_step(h, 0, &st);
    return h;
}

static void test_snapkv_prefill_by_hand(void **s)
{
    (void)s;
    /* avg: h0 -> [.625 .875 .375 .25]/3, h1 -> [.125 .75 1.625 1.5]/3;
     * scores [.125 .2708 .3333 .2917], window .3333 + 1. n_keep = 3. */
    policy_host *h = e2e_run((const char *const[]){"window=2", "kernel=3", NULL});
    ph_expect_held(h, 0, 0, "2,4,5");
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"compressions\":1"));
    assert_non_null(strstr(js, "\"positions\":[2,4,5]"));
    assert_non_null(strstr(js, "\"last_event\":\"compressed\""));
    free(js);
    policy_host_destroy(h);
    /* max: h0 -> [.5 .5 .25 .25], h1 -> [.125 .625 .875 .875];
     * scores [.3125 .5625 .5625 .5625]: an exact three-way tie, lower index wins. */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "pooling=max", NULL});
    ph_expect_held(h, 0, 0, "1,4,5");
    policy_host_destroy(h);
    /* cr = 0.6: n_keep = int(6·0.4) = 2. max+1 keeps the window... */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "compression_ratio=0.6", NULL});
    ph_expect_held(h, 0, 0, "4,5");
    policy_host_destroy(h);
    /* ...[DKV] max padding ties the window with token 2, which is lower. */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "compression_ratio=0.6",
                                      "window_pad=max", NULL});
    ph_expect_held(h, 0, 0, "2,4");
    policy_host_destroy(h);
    /* protect_window keeps the window in spite of the tie. */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "compression_ratio=0.6",
                                      "window_pad=max", "protect_window=1", NULL});
    ph_expect_held(h, 0, 0, "4,5");
    policy_host_destroy(h);
    /* n_keep = int(6·0.1) = 0 drops everything in the reference... */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "compression_ratio=0.9", NULL});
    ph_expect_held(h, 0, 0, "");
    policy_host_destroy(h);
    /* ...but never a protected window token. */
    h = e2e_run((const char *const[]){"window=2", "kernel=3", "compression_ratio=0.9",
                                      "protect_window=1", NULL});
    ph_expect_held(h, 0, 0, "4,5");
    policy_host_destroy(h);
}

/* ---- when it compresses ---- */

static void test_window_too_long_is_skipped(void **s)
{
    (void)s;
    uint64_t seed = 7;
    policy_host *h = ph_host("snapkv", (const char *const[]){"window=8", NULL}, ph_geom(1, 2, 1));
    assert_int_equal(policy_host_append(h, 8), 0);
    sk_stats st;
    sk_stats_random(&st, h, 0, 2, 1, &seed, 1, 8, 8);
    assert_int_equal(ph_step(h, 0, &st.st), 0); /* L = 8 <= window: SnapKV refuses */
    sk_stats_free(&st);
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(js, "skipped: L = 8 <= window = 8"));
    assert_non_null(strstr(js, "\"compressions\":0"));
    free(js);
    policy_host_destroy(h);

    h = ph_host("snapkv", (const char *const[]){"window=8", NULL}, ph_geom(1, 2, 1));
    assert_int_equal(policy_host_append(h, 9), 0);
    sk_stats_random(&st, h, 0, 2, 1, &seed, 1, 9, 8);
    assert_int_equal(ph_step(h, 0, &st.st), 9 - 4); /* n_keep = int(4.5) = 4 */
    sk_stats_free(&st);
    policy_host_destroy(h);
}

static void test_compresses_once_at_end_of_prompt(void **s)
{
    (void)s;
    uint64_t seed = 11;
    policy_host *h = ph_host("snapkv", (const char *const[]){"window=4", NULL}, ph_geom(2, 4, 2));
    sk_stats st;
    /* Prefill chunks without window_attn: the prompt goes on. */
    for (int chunk = 0; chunk < 3; chunk++) {
        assert_int_equal(policy_host_append(h, 10), 0);
        policy_stats none = {.new_tokens = 10, .prefill = 1, .confidence = -1};
        for (uint32_t l = 0; l < 2; l++)
            assert_int_equal(ph_step(h, l, &none), 0);
    }
    /* The last chunk carries window_attn: 40 -> int(20) per head. */
    assert_int_equal(policy_host_append(h, 10), 0);
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats_random(&st, h, l, 4, 2, &seed, 1, 10, 4);
        assert_int_equal(ph_step(h, l, &st.st), 2 * 20);
        sk_stats_free(&st);
        const policy_layer_view *v = policy_host_view(h, l);
        assert_int_equal(v->tokens[0], 20);
        assert_int_equal(v->tokens[1], 20);
    }
    /* Decode steps, even with window_attn, leave the cache alone (budget off). */
    for (int t = 0; t < 5; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        for (uint32_t l = 0; l < 2; l++) {
            sk_stats_random(&st, h, l, 4, 2, &seed, 0, 1, 4);
            assert_int_equal(ph_step(h, l, &st.st), 0);
            sk_stats_free(&st);
        }
    }
    assert_int_equal(policy_host_view(h, 1)->tokens[1], 25);
    policy_host_destroy(h);
}

static void test_ratio_zero_is_noop(void **s)
{
    (void)s;
    uint64_t seed = 3;
    policy_host *h = ph_host(
        "snapkv", (const char *const[]){"compression_ratio=0", "window=4", NULL}, ph_geom(1, 2, 2));
    assert_int_equal(policy_host_append(h, 30), 0);
    sk_stats st;
    sk_stats_random(&st, h, 0, 2, 2, &seed, 1, 30, 4);
    assert_int_equal(ph_step(h, 0, &st.st), 0);
    sk_stats_free(&st);
    policy_host_destroy(h);
}

/* ---- properties ---- */

/* kvpress test_presses_keep_highest_score: per head, the kept set is exactly
 * the top n_keep of the §1.3 score (reference computed independently). */
/* The describe record of head g of a layer: its kept positions are the
 * held ones, in order, and each score is the reference's, as a float. */
static void expect_record(policy_host *h, uint32_t layer, uint32_t g, const double *ref)
{
    char *js = policy_host_ops(h)->describe(policy_host_state(h), layer);
    assert_non_null(js);
    const char *at = js;
    for (uint32_t k = 0; k <= g; k++) {
        at = strstr(at, "\"positions\":[");
        assert_non_null(at);
        at += strlen("\"positions\":[");
    }
    const policy_layer_view *v = policy_host_view(h, layer);
    char *end;
    for (uint32_t i = 0; i < v->tokens[g]; i++, at = end + 1) {
        unsigned long p = strtoul(at, &end, 10);
        if (end == at || p != v->positions[g][i])
            fail_msg("head %u: record entry %u names position %lu, the list holds %u", g, i, p,
                     v->positions[g][i]);
    }
    assert_int_equal(at[-1], ']');
    at = strstr(at, "\"score\":[");
    assert_non_null(at);
    at += strlen("\"score\":[");
    for (uint32_t i = 0; i < v->tokens[g]; i++, at = end + 1) {
        double sc = strtod(at, &end);
        double want = (float)ref[v->positions[g][i]];
        if (end == at || fabs(sc - want) > 1e-6 * fabs(want))
            fail_msg("head %u: record entry %u scores %.9g, the reference %.9g", g, i, sc, want);
    }
    free(js);
}

static void keep_highest(uint64_t seed, const char *pooling, const char *pad, double cr)
{
    const uint32_t Hq = 8, Hkv = 2, L = 200, w = 16, k = 5;
    char crs[32], pools[32], pads[32];
    snprintf(crs, sizeof crs, "compression_ratio=%g", cr);
    snprintf(pools, sizeof pools, "pooling=%s", pooling);
    snprintf(pads, sizeof pads, "window_pad=%s", pad);
    policy_host *h =
        ph_host("snapkv", (const char *const[]){crs, pools, pads, "window=16", "kernel=5", NULL},
                ph_geom(2, Hq, Hkv));
    assert_int_equal(policy_host_append(h, L), 0);
    size_t n_keep = (size_t)((double)L * (1.0 - cr));
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats st;
        sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, L, w);
        double *ref[2] = {malloc(L * sizeof(double)), malloc(L * sizeof(double))};
        sk_ref_scores(policy_host_view(h, l), &st.st, Hq, w, k, strcmp(pooling, "max") == 0,
                      strcmp(pad, "max_plus_one") == 0, ref);
        ph_step(h, l, &st.st);
        const policy_layer_view *v = policy_host_view(h, l);
        for (uint32_t g = 0; g < Hkv; g++) {
            assert_int_equal(v->tokens[g], n_keep);
            uint8_t held[200] = {0};
            for (uint32_t i = 0; i < v->tokens[g]; i++)
                held[v->positions[g][i]] = 1;
            for (uint32_t i = 0; i < L; i++)
                if (held[i] != (sk_rank(ref[g], L, i) < n_keep))
                    fail_msg("seed %llu head %u token %u: held %d, rank %zu of n_keep %zu",
                             (unsigned long long)seed, g, i, held[i], sk_rank(ref[g], L, i),
                             n_keep);
            expect_record(h, l, g, ref[g]);
        }
        free(ref[0]);
        free(ref[1]);
        sk_stats_free(&st);
    }
    policy_host_destroy(h);
}

static void test_keep_highest_score(void **s)
{
    (void)s;
    const double crs[] = {0.1, 0.25, 0.5, 0.75, 0.9};
    for (uint64_t seed = 1; seed <= 5; seed++) {
        keep_highest(seed * 101, "avg", "max_plus_one", crs[seed - 1]);
        keep_highest(seed * 103, "max", "max_plus_one", crs[seed - 1]);
        keep_highest(seed * 107, "avg", "max", crs[seed - 1]);
    }
}

/* Budget extension: after every step with window_attn no head holds more
 * than budget, window tokens are always held, and the heads differ. */
static void test_budget_extension(void **s)
{
    (void)s;
    const uint32_t Hq = 4, Hkv = 2, w = 8, B = 40;
    uint64_t seed = 99;
    policy_host *h = ph_host("snapkv", (const char *const[]){"budget=40", "window=8", NULL},
                             ph_geom(2, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 100), 0);
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, 100, w);
        assert_int_equal(ph_step(h, l, &st.st), 2 * 60);
        sk_stats_free(&st);
    }
    int differ = 0;
    for (int t = 0; t < 50; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        for (uint32_t l = 0; l < 2; l++) {
            sk_stats_random(&st, h, l, Hq, Hkv, &seed, 0, 1, w);
            assert_int_equal(ph_step(h, l, &st.st), Hkv); /* one per head */
            sk_stats_free(&st);
            const policy_layer_view *v = policy_host_view(h, l);
            for (uint32_t g = 0; g < Hkv; g++) {
                assert_int_equal(v->tokens[g], B);
                uint32_t win = 0;
                for (uint32_t i = 0; i < v->tokens[g]; i++)
                    win += v->positions[g][i] + w >= v->appended;
                assert_int_equal(win, w);
            }
            differ |= memcmp(v->positions[0], v->positions[1], B * sizeof(uint32_t)) != 0;
        }
    }
    assert_true(differ); /* per-head lists diverge */
    /* A decode step over budget without window_attn cannot be served. */
    assert_int_equal(policy_host_append(h, 1), 0);
    policy_stats none = {.new_tokens = 1, .prefill = 0, .confidence = -1};
    ph_step_fails(h, 0, &none, "window_attn");
    policy_host_destroy(h);
}

static void run_seeded(uint64_t seed, char **held_out, char **desc_out)
{
    const uint32_t Hq = 4, Hkv = 2;
    policy_host *h = ph_host("snapkv", (const char *const[]){"window=8", "budget=30", NULL},
                             ph_geom(1, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 64), 0);
    sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 1, 64, 8);
    ph_step(h, 0, &st.st);
    sk_stats_free(&st);
    for (int t = 0; t < 10; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 0, 1, 8);
        ph_step(h, 0, &st.st);
        sk_stats_free(&st);
    }
    *held_out = malloc(4096);
    ph_held(h, 0, 0, *held_out, 2048);
    size_t n = strlen(*held_out);
    (*held_out)[n] = '|';
    ph_held(h, 0, 1, *held_out + n + 1, 2047);
    *desc_out = policy_host_ops(h)->describe(policy_host_state(h), 0);
    policy_host_destroy(h);
}

static void test_deterministic(void **s)
{
    (void)s;
    char *h1, *d1, *h2, *d2, *h3, *d3;
    run_seeded(42, &h1, &d1);
    run_seeded(42, &h2, &d2);
    run_seeded(43, &h3, &d3);
    assert_string_equal(h1, h2);
    assert_string_equal(d1, d2);
    assert_true(strcmp(h1, h3) != 0); /* the input matters */
    free(h1);
    free(d1);
    free(h2);
    free(d2);
    free(h3);
    free(d3);
}

/* ---- moving a sequence ---- */

/* A host moved to another daemon (export_layer / import_layer) after the
 * prompt and some decode steps holds the same lists and records, and steps
 * on exactly as the original. budget > 0 so that decode steps evict too
 * (the ratio rule compresses only at the end of the prompt); window = 8, the
 * window_queries of the harness's statistics. */
static void test_moves_to_another_daemon(void **s)
{
    (void)s;
    const char *kv[] = {"window=8", "budget=24", NULL};
    ph_check_portable("snapkv", kv, ph_geom(2, 4, 2), 40, 12, 7);
    const char *kv_max[] = {"window=8", "budget=20",        "pooling=max",
                            "kernel=7", "protect_window=1", NULL};
    ph_check_portable("snapkv", kv_max, ph_geom(3, 8, 2), 30, 10, 8);
}

/* ---- refusals ---- */

static void test_invalid_configs(void **s)
{
    (void)s;
    policy_geometry g = ph_geom(1, 4, 2);
    static const ph_reject cases[] = {
        {{"compression_ratio=1"}, {"compression_ratio", "[0, 1)"}},
        {{"compression_ratio=-0.1"}, {"compression_ratio", "[0, 1]"}},
        {{"compression_ratio=nan"}, {"compression_ratio", "[0, 1]"}},
        {{"window=0"}, {"window", "[1, 1048576]"}},
        {{"kernel=4"}, {"kernel", "odd"}},
        {{"kernel=0"}, {"kernel", "[1, 1025]"}},
        {{"pooling=mean"}, {"pooling", "avg, max"}},
        {{"window_pad=min"}, {"window_pad", "max_plus_one, max"}},
        {{"protect_window=2"}, {"protect_window", "[0, 1]"}},
        {{"budget=64"}, {"budget", "greater than window (64)"}},
        {{"budget=10", "window=16"}, {"budget", "greater than window (16)"}},
        {{"budget=-1"}, {"budget", "[0, 2147483647]"}},
        /* Parameters of the other variants are unknown here. */
        {{"epsilon=0.1"}, {"epsilon"}},
        {{"alpha_safeguard=0.1"}, {"alpha_safeguard"}},
    };
    ph_expect_rejects("snapkv", g, cases, PH_N(cases));
    ph_expect_reject("snapkv", NULL, ph_geom(1, 3, 2), "kv_heads");
    /* Defaults are valid; budget just above window is. */
    policy_host_destroy(ph_host("snapkv", NULL, g));
    policy_host_destroy(ph_host("snapkv", (const char *const[]){"budget=65", NULL}, g));
}

static void test_bad_stats(void **s)
{
    (void)s;
    uint64_t seed = 5;
    policy_host *h = ph_host("snapkv", (const char *const[]){"window=4", NULL}, ph_geom(1, 4, 2));
    assert_int_equal(policy_host_append(h, 20), 0);
    sk_stats st;
    sk_stats_random(&st, h, 0, 4, 2, &seed, 1, 20, 8);
    ph_step_fails(h, 0, &st.st, "window"); /* averages 8 queries, window is 4 */
    st.st.window_queries = 4;
    st.wa[2][3] = NAN;
    ph_step_fails(h, 0, &st.st, "window_attn[2][3]");
    st.wa[2][3] = 0.5f;
    float *keep = st.wa[3];
    st.wa[3] = NULL;
    ph_step_fails(h, 0, &st.st, "window_attn of query head 3");
    st.wa[3] = keep;
    st.st.window_queries = 0; /* unspecified: taken as window */
    assert_int_equal(ph_step(h, 0, &st.st), 2 * 10);
    sk_stats_free(&st);
    policy_host_destroy(h);
}

static void test_registry(void **s)
{
    (void)s;
    static const ph_default defaults[] = {
        {"compression_ratio", "0.5"},
        {"window", "64"},
        {"kernel", "5"},
        {"pooling", "avg"},
        {"window_pad", "max_plus_one"},
        {"protect_window", "0"},
        {"budget", "0"},
    };
    ph_expect_registry("snapkv", POLICY_NEEDS_WINDOW_ATTN, 1, defaults, PH_N(defaults));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_snap1_avg_pool),
        cmocka_unit_test(test_max_pool_by_hand),
        cmocka_unit_test(test_pool_edges),
        cmocka_unit_test(test_base_scores_by_hand),
        cmocka_unit_test(test_budget_arithmetic),
        cmocka_unit_test(test_snapkv_prefill_by_hand),
        cmocka_unit_test(test_window_too_long_is_skipped),
        cmocka_unit_test(test_compresses_once_at_end_of_prompt),
        cmocka_unit_test(test_ratio_zero_is_noop),
        cmocka_unit_test(test_keep_highest_score),
        cmocka_unit_test(test_budget_extension),
        cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_moves_to_another_daemon),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_bad_stats),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
