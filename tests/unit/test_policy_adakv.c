/*
 * test_policy_adakv.c - policy "adakv": AdaKV on SnapKV scores (POLICIES.md
 * §1.9 "AdaKV", i.e. §1.5 without the two stages).
 *
 * Vectors by hand for the safeguard, the global budget and the bottom-k tie
 * rule; a prefill through the host by hand; kvpress's test_head_compression
 * (L = 128, cr in {.2 .4 .6 .8}: the evicted fraction averaged over layers
 * equals cr within 1e-2) and keep_highest_score (the kept set is exactly the
 * global top n_keep·Hkv, here after the safeguard, against an independent
 * reference); the budget extension and determinism.
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

/* ---- pure pieces ---- */

static void test_global_budget_by_hand(void **s)
{
    (void)s;
    /* T-CK3's scores: n_keep 2, Hkv 2 -> keep 4 of 8. Evict the 4 lowest:
     * .05 (1,2), .05 (1,3), .1 (0,3), .1 (1,1) (tie: lower head first). */
    const double a0[4] = {0.5, 0.3, 0.25, 0.1}, a1[4] = {0.2, 0.1, 0.05, 0.05};
    const double *a[2] = {a0, a1};
    const uint32_t len[2] = {4, 4};
    uint8_t f0[4] = {0}, f1[4] = {0}, k0[4], k1[4];
    uint8_t *forced[2] = {f0, f1}, *keep[2] = {k0, k1};
    uint32_t B[2];
    snapkv_entry tmp[8];
    size_t n_safe = (size_t)(2 * 0.2); /* 0 */
    assert_int_equal(adakv_budgets(a, len, 2, n_safe, 4, forced, B, tmp), 4);
    assert_int_equal(B[0], 3);
    assert_int_equal(B[1], 1);
    adakv_select(a, len, 2, 4, (const uint8_t *const *)forced, keep, tmp);
    sk_expect_keep(k0, 4, "0,1,2");
    sk_expect_keep(k1, 4, "0");
}

static void test_safeguard_by_hand(void **s)
{
    (void)s;
    /* Head 0 beats head 1 everywhere. L = 10, cr .5: n_keep 5, 10 of 20 kept. */
    double a0[10], a1[10];
    for (int i = 0; i < 10; i++) {
        a0[i] = 0.9 - 0.1 * i; /* .9 .. 0 */
        a1[i] = 0.001 * (10 - i);
    }
    a1[6] = 0.05; /* head 1's best */
    const double *a[2] = {a0, a1};
    const uint32_t len[2] = {10, 10};
    uint8_t f0[10], f1[10], k0[10], k1[10];
    uint8_t *forced[2] = {f0, f1}, *keep[2] = {k0, k1};
    uint32_t B[2];
    snapkv_entry tmp[20];
    /* No safeguard: head 0 takes every slot (a0[9] = 0 still beats .05? no:
     * 0 < .05, so head 1 wins one slot through its score alone). */
    memset(f0, 0, 10);
    memset(f1, 0, 10);
    adakv_budgets(a, len, 2, 0, 10, forced, B, tmp);
    assert_int_equal(B[0], 9);
    assert_int_equal(B[1], 1);
    /* Make head 0 win all: then only the safeguard saves head 1. */
    a0[9] = 0.06;
    memset(f0, 0, 10);
    memset(f1, 0, 10);
    adakv_budgets(a, len, 2, 0, 10, forced, B, tmp);
    assert_int_equal(B[0], 10);
    assert_int_equal(B[1], 0);
    size_t n_safe = (size_t)(5 * 0.2); /* int(1.0) = 1 */
    assert_int_equal(n_safe, 1);
    memset(f0, 0, 10);
    memset(f1, 0, 10);
    adakv_budgets(a, len, 2, n_safe, 10, forced, B, tmp);
    assert_int_equal(B[0], 9);
    assert_int_equal(B[1], 1);
    sk_expect_keep(f1, 10, "6"); /* the safeguard forced head 1's best */
    sk_expect_keep(f0, 10, "0");
    adakv_select(a, len, 2, 10, (const uint8_t *const *)forced, keep, tmp);
    sk_expect_keep(k0, 10, "0,1,2,3,4,5,6,7,8");
    sk_expect_keep(k1, 10, "6");
}

static void test_bottom_k_ties(void **s)
{
    (void)s;
    /* The reference evicts topk(-scores): on ties the lower (head, index)
     * goes first (POLICIES.md "Common notation"). */
    const double a0[2] = {0.1, 0.1}, a1[2] = {0.1, 0.1};
    const double *a[2] = {a0, a1};
    const uint32_t len[2] = {2, 2};
    uint8_t f0[2] = {0}, f1[2] = {0}, k0[2], k1[2];
    const uint8_t *forced[2] = {f0, f1};
    uint8_t *keep[2] = {k0, k1};
    snapkv_entry tmp[4];
    adakv_select(a, len, 2, 3, forced, keep, tmp);
    sk_expect_keep(k0, 2, "1");
    sk_expect_keep(k1, 2, "0,1");
}

/* ---- through the host, by hand ---- */

static void test_adakv_prefill_by_hand(void **s)
{
    (void)s;
    /* Hq = Hkv = 2, window 1, kernel 1, L = 5: the scores are T-CK3's plus
     * window tokens at .5 + 1. n_keep = int(2.5) = 2, keep 4 of 10: both
     * window tokens, (0,0) and (0,1). */
    const float r0[5] = {0.5f, 0.3f, 0.25f, 0.1f, 0}, r1[5] = {0.2f, 0.1f, 0.05f, 0.05f, 0};
    const float *rows[2] = {r0, r1};
    policy_host *h =
        ph_host("adakv", (const char *const[]){"window=1", "kernel=1", NULL}, ph_geom(1, 2, 2));
    assert_int_equal(policy_host_append(h, 5), 0);
    policy_stats st = {
        .new_tokens = 5, .prefill = 1, .window_attn = rows, .window_queries = 1, .confidence = -1};
    assert_int_equal(ph_step(h, 0, &st), 6);
    ph_expect_held(h, 0, 0, "0,1,4");
    ph_expect_held(h, 0, 1, "4");
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(js, "\"kept\":3"));
    assert_non_null(strstr(js, "\"kept\":1"));
    assert_null(strstr(js, "stage2"));
    free(js);
    policy_host_destroy(h);
}

/* ---- properties ---- */

/* kvpress tests/presses/test_head_compression.py. */
static void test_head_compression(void **s)
{
    (void)s;
    const double crs[] = {0.2, 0.4, 0.6, 0.8};
    const uint32_t layers = 4, Hq = 8, Hkv = 4, L = 128;
    for (int t = 0; t < 4; t++) {
        uint64_t seed = 4242 + (uint64_t)t;
        char cr[40];
        snprintf(cr, sizeof cr, "compression_ratio=%g", crs[t]);
        policy_host *h =
            ph_host("adakv", (const char *const[]){cr, "window=8", NULL}, ph_geom(layers, Hq, Hkv));
        assert_int_equal(policy_host_append(h, L), 0);
        double frac = 0;
        for (uint32_t l = 0; l < layers; l++) {
            sk_stats st;
            sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, L, 8);
            size_t ev = ph_step(h, l, &st.st);
            sk_stats_free(&st);
            assert_int_equal(ev, Hkv * (L - (size_t)(L * (1 - crs[t]))));
            frac += (double)ev / (double)(Hkv * L);
        }
        frac /= layers;
        if (fabs(frac - crs[t]) > 1e-2)
            fail_msg("cr %g: evicted fraction %g", crs[t], frac);
        policy_host_destroy(h);
    }
}

static void keep_highest(uint64_t seed, double cr, const char *safeguard)
{
    const uint32_t Hq = 8, Hkv = 4, L = 96, w = 8;
    char crs[40], sg[40];
    snprintf(crs, sizeof crs, "compression_ratio=%g", cr);
    snprintf(sg, sizeof sg, "alpha_safeguard=%s", safeguard);
    policy_host *h =
        ph_host("adakv", (const char *const[]){crs, sg, "window=8", NULL}, ph_geom(1, Hq, Hkv));
    assert_int_equal(policy_host_append(h, L), 0);
    sk_stats st;
    sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 1, L, w);
    double *ref[4];
    uint8_t *safe[4], *win[4];
    for (uint32_t g = 0; g < Hkv; g++) {
        ref[g] = malloc(L * sizeof(double));
        safe[g] = malloc(L);
        win[g] = malloc(L);
    }
    sk_ref_scores(policy_host_view(h, 0), &st.st, Hq, w, 5, 0, 1, ref);
    size_t n_keep = (size_t)((double)L * (1 - cr));
    size_t n_safe = (size_t)((double)n_keep * atof(safeguard));
    uint32_t B[4];
    sk_ref_ada(ref, Hkv, L, n_safe, n_keep * Hkv, safe, win, B);
    ph_step(h, 0, &st.st);
    const policy_layer_view *v = policy_host_view(h, 0);
    size_t total = 0;
    for (uint32_t g = 0; g < Hkv; g++) {
        uint8_t held[96] = {0};
        for (uint32_t i = 0; i < v->tokens[g]; i++)
            held[v->positions[g][i]] = 1;
        for (uint32_t i = 0; i < L; i++)
            if (held[i] != win[g][i])
                fail_msg("seed %llu head %u token %u: held %d, reference %d",
                         (unsigned long long)seed, g, i, held[i], win[g][i]);
        assert_int_equal(v->tokens[g], B[g]);
        assert_true(v->tokens[g] >= n_safe);
        total += v->tokens[g];
        free(ref[g]);
        free(safe[g]);
        free(win[g]);
    }
    assert_int_equal(total, n_keep * Hkv);
    sk_stats_free(&st);
    policy_host_destroy(h);
}

static void test_keep_highest_score(void **s)
{
    (void)s;
    const double crs[] = {0.1, 0.3, 0.5, 0.7, 0.9};
    for (uint64_t t = 0; t < 5; t++) {
        keep_highest(900 + t, crs[t], "0");   /* plain global top-k */
        keep_highest(910 + t, crs[t], "0.2"); /* with the safeguard */
        keep_highest(920 + t, crs[t], "1");   /* safeguard = uniform budget */
    }
}

static void test_budget_extension(void **s)
{
    (void)s;
    const uint32_t Hq = 4, Hkv = 2, w = 8, B = 30;
    uint64_t seed = 31337;
    policy_host *h =
        ph_host("adakv", (const char *const[]){"budget=30", "window=8", "protect_window=1", NULL},
                ph_geom(2, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 80), 0);
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, 80, w);
        assert_int_equal(ph_step(h, l, &st.st), 2 * 80 - 2 * 30);
        sk_stats_free(&st);
    }
    int unequal = 0;
    for (int t = 0; t < 40; t++) {
        assert_int_equal(policy_host_append(h, 1), 0);
        for (uint32_t l = 0; l < 2; l++) {
            sk_stats_random(&st, h, l, Hq, Hkv, &seed, 0, 1, w);
            ph_step(h, l, &st.st);
            sk_stats_free(&st);
            const policy_layer_view *v = policy_host_view(h, l);
            assert_int_equal(v->tokens[0] + v->tokens[1], Hkv * B);
            unequal |= v->tokens[0] != v->tokens[1];
            for (uint32_t g = 0; g < Hkv; g++) {
                uint32_t win = 0;
                for (uint32_t i = 0; i < v->tokens[g]; i++)
                    win += v->positions[g][i] + w >= v->appended;
                assert_int_equal(win, w);
            }
        }
    }
    assert_true(unequal); /* AdaKV: heads keep different counts */
    policy_host_destroy(h);
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
    const char *kv[] = {"window=8", "budget=20", NULL};
    ph_check_portable("adakv", kv, ph_geom(2, 4, 2), 40, 12, 7);
    const char *kv_safe[] = {"window=8", "budget=16", "alpha_safeguard=0.5", "window_pad=max",
                             NULL};
    ph_check_portable("adakv", kv_safe, ph_geom(3, 8, 4), 30, 10, 8);
}

static void test_invalid_configs(void **s)
{
    (void)s;
    static const ph_reject cases[] = {
        {{"alpha_safeguard=1.2"}, {"alpha_safeguard", "[0, 1]"}},
        {{"alpha_safeguard=-0.2"}, {"alpha_safeguard", "[0, 1]"}},
        {{"first_stage_ratio=0.5"}, {"first_stage_ratio"}}, /* criticalkv's, not adakv's */
        {{"pooling=sum"}, {"pooling", "avg, max"}},
        {{"budget=3", "window=4"}, {"budget", "greater than window (4)"}},
    };
    ph_expect_rejects("adakv", ph_geom(1, 4, 2), cases, PH_N(cases));
}

static void test_registry(void **s)
{
    (void)s;
    static const ph_default defaults[] = {
        {"alpha_safeguard", "0.2"},
        {"compression_ratio", "0.5"},
    };
    ph_expect_registry("adakv", POLICY_NEEDS_WINDOW_ATTN, 1, defaults, PH_N(defaults));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_global_budget_by_hand),
        cmocka_unit_test(test_safeguard_by_hand),
        cmocka_unit_test(test_bottom_k_ties),
        cmocka_unit_test(test_adakv_prefill_by_hand),
        cmocka_unit_test(test_head_compression),
        cmocka_unit_test(test_keep_highest_score),
        cmocka_unit_test(test_budget_extension),
        cmocka_unit_test(test_moves_to_another_daemon),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
