/*
 * test_policy_criticalkv_ada.c - policy "criticalkv_ada": CriticalKV on
 * AdaKV budgets (POLICIES.md §1.5, kvpress CriticalAdaKVPress).
 *
 * T-CK3 through the pure functions and, with window tokens added, through
 * the host by hand; kvpress's test_head_compression (L = 128, cr in
 * {.2 .4 .6 .8}); the kept set against an independent reference of §1.5
 * (safeguard, global budget, per-head two stages) on seeded random stats;
 * the budget extension with a protected window; the float32 stage-1 size
 * (α = .58, B = 50 -> 29, where double gives 28); refusals.
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

/* ---- T-CK3 ---- */

static void test_ck3(void **s)
{
    (void)s;
    const double a0[4] = {0.5, 0.3, 0.25, 0.1}, a1[4] = {0.2, 0.1, 0.05, 0.05};
    const float n0[4] = {1, 1, 1, 5}, n1[4] = {1, 3, 1, 1};
    const double *a[2] = {a0, a1};
    const uint32_t len[2] = {4, 4};
    uint8_t f0[4] = {0}, f1[4] = {0}, k0[4], k1[4];
    uint8_t *forced[2] = {f0, f1};
    uint32_t B[2];
    double z0[4], z1[4];
    snapkv_entry tmp[8];
    size_t n_keep = snapkv_n_keep(4, 0.5);
    size_t n_safe = (size_t)((double)n_keep * 0.2);
    assert_int_equal(n_keep, 2);
    assert_int_equal(n_safe, 0);
    assert_int_equal(adakv_budgets(a, len, 2, n_safe, n_keep * 2, forced, B, tmp), 4);
    assert_int_equal(B[0], 3); /* global top-4 = {.5 .3 .25 .2} */
    assert_int_equal(B[1], 1);
    size_t b1_0 = (size_t)(B[0] * 0.5), b1_1 = (size_t)(B[1] * 0.5);
    assert_int_equal(b1_0, 1);
    assert_int_equal(b1_1, 0);
    criticalkv_select(a0, n0, 4, B[0], b1_0, 1e-4, f0, z0, k0, tmp);
    criticalkv_select(a1, n1, 4, B[1], b1_1, 1e-4, f1, z1, k1, tmp);
    sk_expect_keep(f0, 4, "0"); /* stage 1 of head 0 = {t0} */
    sk_expect_keep(f1, 4, "");
    assert_true(fabs(z0[1] - 0.3001) < 1e-4);
    assert_true(fabs(z0[2] - 0.2501) < 1e-4);
    assert_true(fabs(z0[3] - 0.5005) < 1e-4);
    assert_true(fabs(z1[0] - 0.2001) < 1e-4);
    assert_true(fabs(z1[1] - 0.3003) < 1e-4);
    sk_expect_keep(k0, 4, "0,1,3");
    sk_expect_keep(k1, 4, "1");
}

/* T-CK3's scores plus one window token per head (.5 + 1), through the host:
 * Hq = Hkv = 2, window 1, kernel 1, L = 5: n_keep = 2, 4 kept in all.
 * Budget: both window tokens, .5 and .3 -> B = [3, 1].
 * Head 0: b1 = 1 = its window token; z = [.5001 .3001 .2501 .5005] -> {0, 3, 4}.
 * Head 1: b1 = 0; z = [.2001 .3003 .0501 .0501, 1.5001·n] -> {4} when the
 * window token's norm is 1, {1} when it is .1 (§1.7: it can lose). */
static void ck3_host(float window_norm, const char *want_head1)
{
    const float r0[5] = {0.5f, 0.3f, 0.25f, 0.1f, 0}, r1[5] = {0.2f, 0.1f, 0.05f, 0.05f, 0};
    const float n0[5] = {1, 1, 1, 5, 1}, n1[5] = {1, 3, 1, 1, window_norm};
    const float *rows[2] = {r0, r1}, *norms[2] = {n0, n1};
    policy_host *h = ph_host("criticalkv_ada", (const char *const[]){"window=1", "kernel=1", NULL},
                             ph_geom(1, 2, 2));
    assert_int_equal(policy_host_append(h, 5), 0);
    policy_stats st = {.new_tokens = 5,
                       .prefill = 1,
                       .window_attn = rows,
                       .window_queries = 1,
                       .vnorm = norms,
                       .confidence = -1};
    assert_int_equal(ph_step(h, 0, &st), 6);
    ph_expect_held(h, 0, 0, "0,3,4");
    ph_expect_held(h, 0, 1, want_head1);
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(js, "\"policy\":\"criticalkv_ada\""));
    assert_non_null(strstr(js, "\"stage2\":["));
    free(js);
    policy_host_destroy(h);
}

static void test_ck3_through_host(void **s)
{
    (void)s;
    ck3_host(1.0f, "4");
    ck3_host(0.1f, "1");
}

/* ---- properties ---- */

static void test_head_compression(void **s)
{
    (void)s;
    const double crs[] = {0.2, 0.4, 0.6, 0.8};
    const uint32_t layers = 4, Hq = 8, Hkv = 4, L = 128;
    for (int t = 0; t < 4; t++) {
        uint64_t seed = 777 + (uint64_t)t;
        char cr[40];
        snprintf(cr, sizeof cr, "compression_ratio=%g", crs[t]);
        policy_host *h = ph_host("criticalkv_ada", (const char *const[]){cr, "window=8", NULL},
                                 ph_geom(layers, Hq, Hkv));
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

/* §1.5 from scratch: safeguard + budget (sk_ref_ada), then per head the
 * forced set = top max(n_safe, floor(B·α)) by a, filled up to B by z. */
static void matches_reference(uint64_t seed, double cr, double alpha, double safeguard)
{
    const uint32_t Hq = 8, Hkv = 4, L = 96, w = 8;
    const double eps = 1e-4;
    char crs[40], als[40], sgs[40];
    snprintf(crs, sizeof crs, "compression_ratio=%g", cr);
    snprintf(als, sizeof als, "first_stage_ratio=%g", alpha);
    snprintf(sgs, sizeof sgs, "alpha_safeguard=%g", safeguard);
    policy_host *h =
        ph_host("criticalkv_ada", (const char *const[]){crs, als, sgs, "window=8", NULL},
                ph_geom(1, Hq, Hkv));
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
    size_t n_safe = (size_t)((double)n_keep * safeguard);
    uint32_t B[4];
    sk_ref_ada(ref, Hkv, L, n_safe, n_keep * Hkv, safe, win, B);
    ph_step(h, 0, &st.st);
    const policy_layer_view *v = policy_host_view(h, 0);
    for (uint32_t g = 0; g < Hkv; g++) {
        size_t b1 = (size_t)((float)B[g] * (float)alpha); /* float32, as kvpress */
        size_t nf = b1 > n_safe ? b1 : n_safe;
        uint8_t forced[96], want[96], held[96] = {0};
        double z[96];
        size_t nforced = 0;
        for (uint32_t i = 0; i < L; i++) {
            forced[i] = sk_rank(ref[g], L, i) < nf;
            nforced += forced[i];
            z[i] = (ref[g][i] + eps) * st.vn[g][i];
        }
        for (uint32_t i = 0; i < L; i++) {
            size_t better = 0;
            for (uint32_t j = 0; j < L; j++)
                better += !forced[j] && (z[j] > z[i] || (z[j] == z[i] && j < i));
            want[i] = forced[i] || better < B[g] - nforced;
        }
        for (uint32_t i = 0; i < v->tokens[g]; i++)
            held[v->positions[g][i]] = 1;
        for (uint32_t i = 0; i < L; i++)
            if (held[i] != want[i])
                fail_msg("seed %llu head %u token %u: held %d, reference %d (B %u)",
                         (unsigned long long)seed, g, i, held[i], want[i], B[g]);
        free(ref[g]);
        free(safe[g]);
        free(win[g]);
    }
    sk_stats_free(&st);
    policy_host_destroy(h);
}

static void test_matches_reference(void **s)
{
    (void)s;
    matches_reference(1, 0.5, 0.5, 0.2);
    matches_reference(2, 0.2, 0.5, 0.2);
    matches_reference(3, 0.8, 0.5, 0.2);
    matches_reference(4, 0.5, 0.1, 0.6); /* safeguard larger than stage 1 */
    matches_reference(5, 0.5, 1.0, 0);
    matches_reference(6, 0.7, 0, 0.2); /* no stage 1: only the safeguard is forced */
}

static void test_budget_extension(void **s)
{
    (void)s;
    const uint32_t Hq = 4, Hkv = 2, w = 8, B = 30;
    uint64_t seed = 2718;
    policy_host *h = ph_host(
        "criticalkv_ada", (const char *const[]){"budget=30", "window=8", "protect_window=1", NULL},
        ph_geom(2, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 70), 0);
    /* Prefill in two chunks: only the last one carries window_attn. */
    policy_stats none = {.new_tokens = 70, .prefill = 1, .confidence = -1};
    for (uint32_t l = 0; l < 2; l++)
        assert_int_equal(ph_step(h, l, &none), 0);
    assert_int_equal(policy_host_append(h, 10), 0);
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, 10, w);
        assert_int_equal(ph_step(h, l, &st.st), 2 * 80 - 2 * 30);
        sk_stats_free(&st);
    }
    for (int t = 0; t < 40; t++) {
        uint32_t n = 1 + (uint32_t)(ph_rand(&seed) % 4);
        assert_int_equal(policy_host_append(h, n), 0);
        for (uint32_t l = 0; l < 2; l++) {
            sk_stats_random(&st, h, l, Hq, Hkv, &seed, 0, n, w);
            ph_step(h, l, &st.st);
            sk_stats_free(&st);
            const policy_layer_view *v = policy_host_view(h, l);
            assert_int_equal(v->tokens[0] + v->tokens[1], Hkv * B);
            for (uint32_t g = 0; g < Hkv; g++) {
                uint32_t win = 0;
                for (uint32_t i = 0; i < v->tokens[g]; i++)
                    win += v->positions[g][i] + w >= v->appended;
                assert_int_equal(win, w);
                assert_true(v->tokens[g] >= (uint32_t)(B * 0.2)); /* safeguard */
            }
        }
    }
    /* Missing vnorm on a compression step is refused, naming it. */
    assert_int_equal(policy_host_append(h, 1), 0);
    sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 0, 1, w);
    st.st.vnorm = NULL;
    ph_step_fails(h, 0, &st.st, "vnorm");
    sk_stats_free(&st);
    policy_host_destroy(h);
}

/* ---- stage-1 size in float32 (kvpress criticalkv_press.py:167) ---- */

static void test_stage1_size_float32(void **s)
{
    (void)s;
    /* The pair where float32 and double disagree: 50·.58 is 28.999999999999996
     * in double but rounds to 29.0f in float32. */
    assert_int_equal((size_t)(50 * 0.58), 28);
    assert_int_equal(criticalkv_ada_stage1_size(50, 0.58), 29);
    assert_int_equal(criticalkv_ada_stage1_size(3, 0.5), 1);
    assert_int_equal(criticalkv_ada_stage1_size(1, 0.5), 0);
    assert_int_equal(criticalkv_ada_stage1_size(50, 1.0), 50);
    assert_int_equal(criticalkv_ada_stage1_size(50, 0), 0);
}

/* The same pair through the host: one head, L = 100, cr = .5 -> B = 50,
 * α = .58. Window token 99 ranks first (max + 1), then 0, 1, ... by falling
 * attention. Token 27, the 29th by attention, has a zero value norm, so
 * stage 2 never keeps it: it is held only when stage 1 takes 29 tokens.
 * Then stage 2 fills 21 slots with 28..48; with 28 it would be 28..49. */
static void test_stage1_size_through_host(void **s)
{
    (void)s;
    enum { L = 100 };
    float row[L], norm[L];
    for (uint32_t i = 0; i < L; i++) {
        row[i] = i + 1 < L ? (float)(L - i) / 1000.0f : 0;
        norm[i] = i == 27 ? 0.0f : 1.0f;
    }
    const float *rows[1] = {row}, *norms[1] = {norm};
    policy_host *h = ph_host("criticalkv_ada",
                             (const char *const[]){"window=1", "kernel=1", "compression_ratio=0.5",
                                                   "first_stage_ratio=0.58", NULL},
                             ph_geom(1, 1, 1));
    assert_int_equal(policy_host_append(h, L), 0);
    policy_stats st = {.new_tokens = L,
                       .prefill = 1,
                       .window_attn = rows,
                       .window_queries = 1,
                       .vnorm = norms,
                       .confidence = -1};
    assert_int_equal(ph_step(h, 0, &st), 50);
    char want[400] = "";
    for (uint32_t i = 0; i <= 48; i++)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%u,", i);
    strcat(want, "99");
    ph_expect_held(h, 0, 0, want);
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
    const char *kv[] = {"window=8", "budget=24", NULL};
    ph_check_portable("criticalkv_ada", kv, ph_geom(2, 4, 2), 40, 12, 7);
    const char *kv_max[] = {
        "window=8", "budget=18", "pooling=max", "first_stage_ratio=0.7", "alpha_safeguard=0.3",
        NULL};
    ph_check_portable("criticalkv_ada", kv_max, ph_geom(3, 8, 4), 30, 10, 8);
}

static void test_invalid_configs(void **s)
{
    (void)s;
    static const ph_reject cases[] = {
        {{"alpha_safeguard=2"}, {"alpha_safeguard", "[0, 1]"}},
        {{"first_stage_ratio=-1"}, {"first_stage_ratio", "[0, 1]"}},
        {{"epsilon=inf"}, {"epsilon", "[0, 1]"}},
        {{"window_pad=none"}, {"window_pad", "max_plus_one, max"}},
    };
    ph_expect_rejects("criticalkv_ada", ph_geom(1, 4, 2), cases, PH_N(cases));
    ph_expect_reject("criticalkv_ada", NULL, ph_geom(1, 4, 0), "kv_heads");
}

static void test_registry(void **s)
{
    (void)s;
    static const ph_default defaults[] = {
        {"alpha_safeguard", "0.2"},
        {"first_stage_ratio", "0.5"},
        {"epsilon", "1e-4"},
        {"pooling", "avg"},
    };
    ph_expect_registry("criticalkv_ada", POLICY_NEEDS_WINDOW_ATTN | POLICY_NEEDS_VNORM, 1, defaults,
                       PH_N(defaults));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ck3),
        cmocka_unit_test(test_ck3_through_host),
        cmocka_unit_test(test_head_compression),
        cmocka_unit_test(test_matches_reference),
        cmocka_unit_test(test_budget_extension),
        cmocka_unit_test(test_stage1_size_float32),
        cmocka_unit_test(test_stage1_size_through_host),
        cmocka_unit_test(test_moves_to_another_daemon),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
