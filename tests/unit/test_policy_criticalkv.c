/*
 * test_policy_criticalkv.c - policy "criticalkv" (POLICIES.md §1.4) and its
 * pure pieces: the projected value L1 norm (§1.2, T-CK1) and the two-stage
 * selection (T-CK2), the forced bit (§1.7, §6 #3), the window-token edge
 * case (§1.7, §6 #2), and properties through the policy host on seeded
 * random stats (kept set = an independent two-stage reference; budget
 * extension; protected window; determinism).
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
#include "util.h"

static void expect_fvec(const float *got, const double *want, size_t n, double tol)
{
    for (size_t i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > tol)
            fail_msg("entry %zu: got %.9g, expected %.9g", i, got[i], want[i]);
}

/* ---- §1.2 projected value norm ---- */

/* T-CK1: Hkv=1, Hq=2, d=2, D=3. */
static const float ck1_wo[3][4] = {{1, 0, 0.5f, -1}, {0, 2, 0, 1}, {-1, 1, 1, 0}};
static const float ck1_v[4][2] = {{1, 0}, {0, 2}, {0.5f, 0.5f}, {1, 1}};

static void test_ck1_projected_norm(void **s)
{
    (void)s;
    float n[4];
    ph_vnorm_l1(&ck1_v[0][0], &ck1_wo[0][0], 1, 2, 2, 3, 4, n);
    expect_fvec(n, (const double[]){1.75, 5.0, 1.375, 2.75}, 4, 1e-6);
    /* The per-head L1 norms: each head's d x D block alone (Hq = 1). */
    float wo0[3][2], wo1[3][2];
    for (int c = 0; c < 3; c++) {
        wo0[c][0] = ck1_wo[c][0];
        wo0[c][1] = ck1_wo[c][1];
        wo1[c][0] = ck1_wo[c][2];
        wo1[c][1] = ck1_wo[c][3];
    }
    ph_vnorm_l1(&ck1_v[0][0], &wo0[0][0], 1, 1, 2, 3, 4, n);
    expect_fvec(n, (const double[]){2.0, 6.0, 1.5, 3.0}, 4, 1e-6);
    ph_vnorm_l1(&ck1_v[0][0], &wo1[0][0], 1, 1, 2, 3, 4, n);
    expect_fvec(n, (const double[]){1.5, 4.0, 1.25, 2.5}, 4, 1e-6);
}

static void test_projected_norm_layout(void **s)
{
    (void)s;
    /* Hkv = Hq = 2 (G = 1), d = 1, D = 2: KV head g reads only column g.
     * Wo rows [1 2], [-1 3]; V[0] = [2, 1], V[1] = [-1, .5].
     * n[0] = |2·1| + |2·-1| = 4 and 2; n[1] = |-1·2| + |-1·3| = 5 and 2.5. */
    const float wo[2][2] = {{1, 2}, {-1, 3}};
    const float v[2][2] = {{2, 1}, {-1, 0.5f}};
    float n[4];
    ph_vnorm_l1(&v[0][0], &wo[0][0], 2, 2, 1, 2, 2, n);
    expect_fvec(n, (const double[]){4, 2, 5, 2.5}, 4, 1e-6);
    /* A zero value vector has norm 0 (§1.7). */
    const float z[1][2] = {{0, 0}};
    ph_vnorm_l1(&z[0][0], &ck1_wo[0][0], 1, 2, 2, 3, 1, n);
    assert_true(n[0] == 0);
}

/* ---- §1.4 two-stage selection ---- */

static void test_ck2_two_stage(void **s)
{
    (void)s;
    const double a[4] = {0.40, 0.05, 0.30, 0.25};
    const float n[4] = {1.75f, 5.0f, 1.375f, 2.75f};
    size_t n_keep = snapkv_n_keep(4, 0.5), b1 = criticalkv_stage1_size(4, 0.5, 0.5);
    assert_int_equal(n_keep, 2);
    assert_int_equal(b1, 1);
    uint8_t forced[4] = {0}, keep[4];
    double z[4];
    snapkv_entry tmp[4];
    criticalkv_select(a, n, 4, n_keep, b1, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 4, "0,3");
    sk_expect_keep(forced, 4, "0"); /* stage 1 = {t0} */
    assert_true(fabs(z[1] - 0.2505) < 1e-4);
    assert_true(fabs(z[2] - 0.41264) < 1e-4);
    assert_true(fabs(z[3] - 0.68778) < 1e-4);
    /* Plain SnapKV keeps {0, 2}. */
    uint8_t none[4] = {0}, top[4] = {0};
    snapkv_mark_top(a, none, 4, n_keep, top, tmp);
    sk_expect_keep(top, 4, "0,2");
}

static void test_stage1_arithmetic(void **s)
{
    (void)s;
    /* Common notation: int((1-0.7)·10·0.5) = int(1.5000000000000002) = 1. */
    assert_int_equal(criticalkv_stage1_size(10, 0.7, 0.5), 1);
    assert_int_equal(criticalkv_stage1_size(6, 0.5, 0.5), 1);    /* int(1.5) */
    assert_int_equal(criticalkv_stage1_size(5, 0.5, 0.5), 1);    /* int(1.25) */
    assert_int_equal(criticalkv_stage1_size(3, 0.5, 0.5), 0);    /* b1 = 0 (§1.7) */
    assert_int_equal(criticalkv_stage1_size(100, 0.5, 1.0), 50); /* alpha 1: all stage 1 */
}

static void test_b1_zero_is_pure_stage2(void **s)
{
    (void)s;
    const double a[4] = {0.40, 0.05, 0.30, 0.25};
    const float n[4] = {1.0f, 5.0f, 1.375f, 2.75f};
    uint8_t forced[4] = {0}, keep[4];
    double z[4];
    snapkv_entry tmp[4];
    /* z = [.4001 .2505 .41264 .68778]: t3 wins without stage 1... */
    criticalkv_select(a, n, 4, 1, 0, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 4, "3");
    /* ...t0 wins with it. */
    memset(forced, 0, 4);
    criticalkv_select(a, n, 4, 1, 1, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 4, "0");
    /* epsilon goes on the attention: a = 0 still scores eps·n. */
    const double a0[2] = {0, 0};
    const float n2[2] = {1, 3};
    memset(forced, 0, 4);
    criticalkv_select(a0, n2, 2, 1, 0, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 2, "1");
    assert_true(fabs(z[1] - 3e-4) < 1e-12);
}

static void test_forced_bit(void **s)
{
    (void)s;
    /* §1.7: a zero value vector scores 0 in stage 2 and goes first... */
    const double a[3] = {0.9, 0.1, 0.2};
    const float n[3] = {0, 1, 1};
    uint8_t forced[3] = {0}, keep[3];
    double z[3];
    snapkv_entry tmp[3];
    criticalkv_select(a, n, 3, 2, 0, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 3, "1,2");
    /* ...unless forced: the reference's dtype-max times 0 would lose, the bit does not. */
    memset(forced, 0, 3);
    criticalkv_select(a, n, 3, 2, 1, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 3, "0,2");
    /* A huge norm does not overflow anything: forced entries simply sort first. */
    const float big[3] = {1e30f, 3e38f, 3e38f};
    memset(forced, 0, 3);
    criticalkv_select(a, big, 3, 2, 1, 1e-4, forced, z, keep, tmp);
    sk_expect_keep(keep, 3, "0,2");
}

/* ---- through the host, by hand ---- */

/* One layer, Hq = Hkv = 1, kernel 1: the window attention is the score. */
static policy_host *run_by_hand(const char *const *kv, uint32_t L, const float *attn,
                                const float *vnorm, uint32_t window)
{
    policy_host *h = ph_host("criticalkv", kv, ph_geom(1, 1, 1));
    assert_int_equal(policy_host_append(h, L), 0);
    const float *rows[1] = {attn}, *norms[1] = {vnorm};
    policy_stats st = {.new_tokens = L,
                       .prefill = 1,
                       .window_attn = rows,
                       .window_queries = window,
                       .vnorm = norms,
                       .confidence = -1};
    ph_step(h, 0, &st);
    return h;
}

static void test_criticalkv_prefill_by_hand(void **s)
{
    (void)s;
    /* T-CK2's scores plus one window token: L = 5, n_keep = 2, b1 = int(1.25) = 1
     * = the window token (1.4); stage 2 over [.4001 .2505 .41264 .68778]. */
    const float attn[5] = {0.40f, 0.05f, 0.30f, 0.25f, 0};
    const float nrm[5] = {1.0f, 5.0f, 1.375f, 2.75f, 1.0f};
    policy_host *h =
        run_by_hand((const char *const[]){"window=1", "kernel=1", NULL}, 5, attn, nrm, 1);
    ph_expect_held(h, 0, 0, "3,4");
    char *js = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(js, "\"stage2\":["));
    assert_non_null(strstr(js, "\"positions\":[3,4]"));
    free(js);
    policy_host_destroy(h);
    h = ph_host("snapkv", (const char *const[]){"window=1", "kernel=1", NULL}, ph_geom(1, 1, 1));
    assert_int_equal(policy_host_append(h, 5), 0);
    const float *rows[1] = {attn};
    policy_stats st = {.new_tokens = 5, .prefill = 1, .window_attn = rows, .confidence = -1};
    ph_step(h, 0, &st);
    ph_expect_held(h, 0, 0, "0,4"); /* plain SnapKV */
    policy_host_destroy(h);
}

static void test_window_token_can_lose(void **s)
{
    (void)s;
    /* §1.7: window 2 > b1 = int(1.5) = 1. Window tokens 4 and 5 tie at 1.4,
     * stage 1 takes 4; token 5 has norm .1: z = 1.4001·.1 = .14 loses to
     * t3 (.68778) and t2 (.41264). Keep {2, 3, 4}. */
    const float attn[6] = {0.40f, 0.05f, 0.30f, 0.25f, 0, 0};
    const float nrm[6] = {1.0f, 5.0f, 1.375f, 2.75f, 1.0f, 0.1f};
    policy_host *h =
        run_by_hand((const char *const[]){"window=2", "kernel=1", NULL}, 6, attn, nrm, 2);
    ph_expect_held(h, 0, 0, "2,3,4");
    policy_host_destroy(h);
    h = run_by_hand((const char *const[]){"window=2", "kernel=1", "protect_window=1", NULL}, 6,
                    attn, nrm, 2);
    ph_expect_held(h, 0, 0, "3,4,5");
    policy_host_destroy(h);
}

/* ---- properties ---- */

/* Independent two-stage reference over ref scores a and norms n of one head. */
static void ref_two_stage(const double *a, const float *n, size_t L, size_t n_keep, size_t b1,
                          double eps, uint8_t *keep)
{
    double *z = malloc(L * sizeof *z);
    uint8_t *forced = calloc(L, 1);
    for (size_t i = 0; i < L; i++) {
        forced[i] = sk_rank(a, L, i) < b1;
        z[i] = (a[i] + eps) * n[i];
    }
    /* The n_keep - b1 best unforced by z, ties to the lower index. */
    for (size_t i = 0; i < L; i++) {
        size_t better = 0;
        for (size_t j = 0; j < L; j++)
            if (!forced[j] && (z[j] > z[i] || (z[j] == z[i] && j < i)))
                better++;
        keep[i] = forced[i] || better < n_keep - b1;
    }
    free(z);
    free(forced);
}

static void test_matches_reference(void **s)
{
    (void)s;
    const uint32_t Hq = 8, Hkv = 4, L = 160, w = 16;
    const double crs[] = {0.2, 0.5, 0.7, 0.9};
    const double alphas[] = {0.5, 0.25, 0.9, 0.5};
    for (int t = 0; t < 4; t++) {
        uint64_t seed = 1000 + (uint64_t)t;
        char cr[40], al[40];
        snprintf(cr, sizeof cr, "compression_ratio=%g", crs[t]);
        snprintf(al, sizeof al, "first_stage_ratio=%g", alphas[t]);
        policy_host *h = ph_host("criticalkv", (const char *const[]){cr, al, "window=16", NULL},
                                 ph_geom(1, Hq, Hkv));
        assert_int_equal(policy_host_append(h, L), 0);
        sk_stats st;
        sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 1, L, w);
        double *ref[4];
        for (uint32_t g = 0; g < Hkv; g++)
            ref[g] = malloc(L * sizeof(double));
        sk_ref_scores(policy_host_view(h, 0), &st.st, Hq, w, 5, 0, 1, ref);
        size_t n_keep = (size_t)((double)L * (1 - crs[t]));
        size_t b1 = (size_t)((1 - crs[t]) * (double)L * alphas[t]);
        ph_step(h, 0, &st.st);
        const policy_layer_view *v = policy_host_view(h, 0);
        for (uint32_t g = 0; g < Hkv; g++) {
            uint8_t want[160], held[160] = {0};
            ref_two_stage(ref[g], st.vn[g], L, n_keep, b1, 1e-4, want);
            assert_int_equal(v->tokens[g], n_keep);
            for (uint32_t i = 0; i < v->tokens[g]; i++)
                held[v->positions[g][i]] = 1;
            for (uint32_t i = 0; i < L; i++)
                if (held[i] != want[i])
                    fail_msg("case %d head %u token %u: held %d, reference %d", t, g, i, held[i],
                             want[i]);
            free(ref[g]);
        }
        sk_stats_free(&st);
        policy_host_destroy(h);
    }
}

static void test_budget_protect_window(void **s)
{
    (void)s;
    const uint32_t Hq = 4, Hkv = 2, w = 8, B = 24;
    uint64_t seed = 77;
    policy_host *h = ph_host("criticalkv",
                             (const char *const[]){"budget=24", "window=8", "protect_window=1",
                                                   "first_stage_ratio=0.1", NULL},
                             ph_geom(2, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 50), 0);
    for (uint32_t l = 0; l < 2; l++) {
        sk_stats_random(&st, h, l, Hq, Hkv, &seed, 1, 50, w);
        ph_step(h, l, &st.st);
        sk_stats_free(&st);
    }
    for (int t = 0; t < 40; t++) {
        uint32_t n = 1 + (uint32_t)(ph_rand(&seed) % 3);
        assert_int_equal(policy_host_append(h, n), 0);
        for (uint32_t l = 0; l < 2; l++) {
            sk_stats_random(&st, h, l, Hq, Hkv, &seed, 0, n, w);
            ph_step(h, l, &st.st);
            sk_stats_free(&st);
            const policy_layer_view *v = policy_host_view(h, l);
            for (uint32_t g = 0; g < Hkv; g++) {
                assert_int_equal(v->tokens[g], B);
                uint32_t win = 0;
                for (uint32_t i = 0; i < v->tokens[g]; i++)
                    win += v->positions[g][i] + w >= v->appended;
                assert_int_equal(win, w); /* protected: all window tokens held */
            }
        }
    }
    /* vnorm is required on a compression step. */
    assert_int_equal(policy_host_append(h, 1), 0);
    sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 0, 1, w);
    st.st.vnorm = NULL;
    ph_step_fails(h, 0, &st.st, "vnorm");
    st.st.vnorm = (const float *const *)st.vn;
    st.vn[1][3] = -1;
    ph_step_fails(h, 0, &st.st, "vnorm[1][3]");
    st.vn[1][3] = INFINITY;
    ph_step_fails(h, 0, &st.st, "vnorm[1][3]");
    sk_stats_free(&st);
    policy_host_destroy(h);
}

/* Without protect_window, window tokens with tiny norms are evicted in the
 * budget mode too (reference behaviour, §1.7): budget 20, first_stage_ratio
 * .2 -> b1 = 4 < window 8. Stage 1 takes window tokens 32..35 (ties to the
 * lower index); 36..39 score (max+1+eps)·1e-6 in stage 2 and lose to every
 * prefix token (norm >= .25). */
static void test_budget_reference_mode(void **s)
{
    (void)s;
    const uint32_t Hq = 2, Hkv = 1, w = 8;
    uint64_t seed = 5150;
    policy_host *h = ph_host(
        "criticalkv", (const char *const[]){"budget=20", "window=8", "first_stage_ratio=0.2", NULL},
        ph_geom(1, Hq, Hkv));
    sk_stats st;
    assert_int_equal(policy_host_append(h, 40), 0);
    sk_stats_random(&st, h, 0, Hq, Hkv, &seed, 1, 40, w);
    for (uint32_t i = 32; i < 40; i++)
        st.vn[0][i] = 1e-6f;
    ph_step(h, 0, &st.st);
    sk_stats_free(&st);
    const policy_layer_view *v = policy_host_view(h, 0);
    assert_int_equal(v->tokens[0], 20);
    for (uint32_t i = 0; i < 20; i++)
        if (i < 16)
            assert_true(v->positions[0][i] < 32);
        else
            assert_int_equal(v->positions[0][i], 32 + (i - 16));
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
    ph_check_portable("criticalkv", kv, ph_geom(2, 4, 2), 40, 12, 7);
    const char *kv_protect[] = {"window=8", "budget=20", "first_stage_ratio=0.25",
                                "protect_window=1", NULL};
    ph_check_portable("criticalkv", kv_protect, ph_geom(3, 8, 2), 30, 10, 8);
}

/* import_layer checks what comes over the network: a wrong magic, version,
 * variant, kv_heads or layer, counts that disagree with the length, trailing
 * bytes and non-finite scores are refused, and the layer keeps the record it
 * had (here one imported before, so that there are arrays to keep). */
static void test_import_refuses_bad_state(void **s)
{
    (void)s;
    const char *kv[] = {"window=8", NULL};
    policy_geometry g = ph_geom(2, 4, 2);
    uint64_t rng = 5;
    policy_host *a = ph_host("criticalkv", kv, g);
    ph_round(a, &g, 40, 1, &rng); /* the end of the prompt: 20 of 40 kept per head */
    size_t len;
    uint8_t *good = policy_host_export_state(a, 0, &len);
    assert_non_null(good);
    policy_host *b = ph_host("criticalkv", kv, g);
    const policy_ops *ops = policy_host_ops(b);
    void *state = policy_host_state(b);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(ops->import_layer(state, 0, good, len, err, sizeof err), 0);
    char *before = ops->describe(state, 0), *orig = ops->describe(policy_host_state(a), 0);
    assert_string_equal(before, orig);

    size_t counts = 31 + good[6], entries = counts + 16 * (size_t)g.kv_heads;
    uint32_t kept0 = (uint32_t)policy_get_le(good + counts + 8, 4);
    assert_int_equal(kept0, 20);
    const ph_spoil cases[] = {
        {"magic", 0, 1, 'X', 0, "magic"},
        {"version", 4, 1, SNAPKV_WIRE_VERSION + 1, 0, "version"},
        {"variant", 5, 1, SNAPKV_CRITICAL_ADA, 0, "criticalkv_ada"},
        {"kv_heads", 7, 4, 3, 0, "kv_heads"},
        {"layer", 11, 4, 1, 0, "layer"},
        {"head 0 kept + 1", counts + 8, 4, kept0 + 1, 0, "entries"},
        {"head 0 kept - 1", counts + 8, 4, kept0 - 1, 0, "entries"},
        {"trailing byte", 0, 0, 0, 1, "entries"},
        {"NaN score", entries + 4 * (size_t)kept0, 4, 0x7fc00000u, 0, "score"},
        {"infinite score", entries + 4 * (size_t)kept0, 4, 0xff800000u, 0, "score"},
        {"NaN stage-2 score", entries + 8 * (size_t)kept0, 4, 0x7fc00000u, 0, "stage-2"},
    };
    for (size_t i = 0; i < PH_N(cases); i++)
        ph_expect_refused(b, 0, good, len, &cases[i]);
    free(before), free(orig), free(good);
    policy_host_destroy(a);
    policy_host_destroy(b);
}

static void test_invalid_configs(void **s)
{
    (void)s;
    policy_geometry g = ph_geom(1, 4, 2);
    static const ph_reject cases[] = {
        {{"first_stage_ratio=1.5"}, {"first_stage_ratio", "[0, 1]"}},
        {{"first_stage_ratio=x"}, {"first_stage_ratio", "[0, 1]"}},
        {{"epsilon=-1e-4"}, {"epsilon", "[0, 1]"}},
        {{"kernel=6"}, {"kernel", "odd"}},
        {{"compression_ratio=1.0"}, {"compression_ratio", "[0, 1)"}},
        {{"budget=8", "window=8"}, {"budget", "greater than window (8)"}},
        {{"alpha_safeguard=0.2"}, {"alpha_safeguard"}}, /* the ada variants' */
    };
    ph_expect_rejects("criticalkv", g, cases, PH_N(cases));
    policy_host_destroy(
        ph_host("criticalkv", (const char *const[]){"first_stage_ratio=0", "epsilon=0", NULL}, g));
}

static void test_registry(void **s)
{
    (void)s;
    static const ph_default defaults[] = {
        {"first_stage_ratio", "0.5"},
        {"epsilon", "1e-4"},
        {"compression_ratio", "0.5"},
        {"window", "64"},
    };
    ph_expect_registry("criticalkv", POLICY_NEEDS_WINDOW_ATTN | POLICY_NEEDS_VNORM, 1, defaults,
                       PH_N(defaults));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ck1_projected_norm),
        cmocka_unit_test(test_projected_norm_layout),
        cmocka_unit_test(test_ck2_two_stage),
        cmocka_unit_test(test_stage1_arithmetic),
        cmocka_unit_test(test_b1_zero_is_pure_stage2),
        cmocka_unit_test(test_forced_bit),
        cmocka_unit_test(test_criticalkv_prefill_by_hand),
        cmocka_unit_test(test_window_token_can_lose),
        cmocka_unit_test(test_matches_reference),
        cmocka_unit_test(test_budget_protect_window),
        cmocka_unit_test(test_budget_reference_mode),
        cmocka_unit_test(test_moves_to_another_daemon),
        cmocka_unit_test(test_import_refuses_bad_state),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
