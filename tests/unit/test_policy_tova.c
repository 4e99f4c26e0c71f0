/*
 * test_policy_tova.c - the TOVA baseline (policies/tova.c, POLICIES.md
 * §1.9).
 *
 * Hand-checkable vectors (binary fractions: means and ties are exact), the
 * GQA case (the mean runs over ALL query heads, not a KV group), missing
 * stats, invalid budget, and properties through the host on seeded random
 * attention: held <= budget after every step, the newest token never
 * evicted, the kept set equals a sort-based top-k oracle, determinism.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy_harness.h"

/* The harness's seeded stream, as the property tests draw it. */
static uint64_t rng_state;

static uint32_t rng(void)
{
    return (uint32_t)ph_rand(&rng_state);
}

static policy_host *host_new(uint32_t budget, const policy_geometry *g)
{
    char b[32];
    snprintf(b, sizeof b, "budget=%u", budget);
    const char *kv[] = {b, NULL};
    return ph_host("tova", kv, *g);
}

/* Append, step layer 0 with last_attn rows, commit; returns evictions. */
static size_t step(policy_host *h, uint32_t nnew, const float *const *attn)
{
    assert_int_equal(policy_host_append(h, nnew), 0);
    policy_stats st = {.new_tokens = nnew, .last_attn = attn, .confidence = -1};
    return ph_step(h, 0, &st);
}

static void expect_held(policy_host *h, const uint32_t *want, uint32_t n)
{
    ph_expect_positions(h, 0, 0, want, n);
}

static void test_hand_vectors(void **unused)
{
    (void)unused;
    policy_geometry g = {1, 2, 1, 4, 16, 10000.0f};
    policy_host *h = host_new(3, &g);
    /* Prefill t0..t4, 2 query heads:
     *   h0 = [.5   .125 .25  .0625 .0625]
     *   h1 = [.25  .25  .125 .25   .125 ]
     *   mean [.375 .1875 .1875 .15625 .09375]
     * t4 (newest) is padded to max + 1 = 1.375 although its own mean is the
     * lowest. Keep 3: t4, t0, then t1/t2 tie at .1875 -> the lower index t1
     * stays. Evicted: t2, t3. (Head 0 alone would have kept t2.) */
    const float a0[5] = {0.5f, 0.125f, 0.25f, 0.0625f, 0.0625f};
    const float a1[5] = {0.25f, 0.25f, 0.125f, 0.25f, 0.125f};
    const float *attn[2] = {a0, a1};
    assert_int_equal(step(h, 5, attn), 2);
    const uint32_t w1[] = {0, 1, 4};
    expect_held(h, w1, 3);

    /* Decode t5; lists are [t0 t1 t4 t5]:
     *   h0 = [.0625 .5  .25 .125]
     *   h1 = [.125  .25 .25 .375]
     *   mean [.09375 .375 .25 (t5 padded)]
     * TOVA keeps no history: t0, the best so far, is now the lowest -> out. */
    const float b0[4] = {0.0625f, 0.5f, 0.25f, 0.125f};
    const float b1[4] = {0.125f, 0.25f, 0.25f, 0.375f};
    const float *attn2[2] = {b0, b1};
    assert_int_equal(step(h, 1, attn2), 1);
    const uint32_t w2[] = {1, 4, 5};
    expect_held(h, w2, 3);
    policy_host_destroy(h);
}

static void test_gqa_all_heads(void **unused)
{
    (void)unused;
    /* 4 query heads over 2 KV heads: the score is the mean over all 4, not
     * over one group. t0..t3, budget 2:
     *   h0 = [.5 0 0 .5], h1 = [.5 0 0 .5]     (group of KV head 0)
     *   h2 = [0 .75 0 .25], h3 = [0 .75 .25 0] (group of KV head 1)
     *   mean [.25 .375 .0625 (t3 padded)] -> keep t3, t1; evict t0, t2.
     * Group 0 alone would have kept t0. */
    policy_geometry g = {1, 4, 2, 4, 16, 10000.0f};
    policy_host *h = host_new(2, &g);
    const float h0[4] = {0.5f, 0, 0, 0.5f}, h1[4] = {0.5f, 0, 0, 0.5f};
    const float h2[4] = {0, 0.75f, 0, 0.25f}, h3[4] = {0, 0.75f, 0.25f, 0};
    const float *attn[4] = {h0, h1, h2, h3};
    assert_int_equal(step(h, 4, attn), 2);
    const uint32_t w[] = {1, 3};
    expect_held(h, w, 2);
    policy_host_destroy(h);
}

static void test_missing_stats_and_invalid(void **unused)
{
    (void)unused;
    policy_geometry g = {1, 2, 1, 4, 16, 10000.0f};
    policy_host *h = host_new(2, &g);
    assert_int_equal(policy_host_append(h, 3), 0);
    policy_stats st = {0};
    st.new_tokens = 3;
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "last_attn"));
    const float a0[3] = {0.1f, 0.2f, 0.7f};
    const float *attn[2] = {a0, NULL};
    st.last_attn = attn;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "last_attn[1]"));
    /* A mean over the heads that is not finite fails the step, naming it. */
    const float a1[3] = {0.3f, 0.1f, NAN};
    attn[1] = a1;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "stats.last_attn of token 2 is not finite"));
    /* The sum over the heads of more than the last query is another rule. */
    const float sum[3] = {0.2f, 0.4f, 1.4f};
    st.last_attn = NULL;
    st.score = sum;
    st.score_queries = 2;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "score_queries 2"));
    st.score_queries = 1;
    const float inf_sum[3] = {0.2f, INFINITY, 1.4f};
    st.score = inf_sum;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "layer 0's stats.score[1] is not finite"));
    st.score = sum;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    assert_int_equal(d->tier[0][0], POLICY_EVICT); /* mean 0.1: the lowest */
    policy_host_destroy(h);

    static const ph_reject cases[] = {
        {{"budget=0"}, {"budget", "[1, 1048576]"}},
        {{"budget=1048577"}, {"budget", "[1, 1048576]"}},
        {{"budget=x"}, {"budget"}},
    };
    ph_expect_rejects("tova", g, cases, PH_N(cases));
    /* the default is 256 */
    policy_params p;
    assert_int_equal(policy_params_resolve(ph_ops("tova"), NULL, NULL, 0, &p, err, sizeof err), 0);
    assert_string_equal(policy_params_get(&p, "budget"), "256");
}

typedef struct cand {
    double s;
    uint32_t i;
} cand;

/* Top-k order: higher score first, ties to the lower index. */
static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->s != y->s)
        return x->s > y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* Random steps against the oracle, with last_attn, or (summed) with its
 * sum over the query heads as score (exact: multiples of 0.25). */
static size_t run_random(uint64_t seed, uint32_t budget, uint32_t q_heads, uint32_t steps,
                         int summed, uint8_t *out, size_t cap)
{
    policy_geometry g = {2, q_heads, 1, 4, 16, 10000.0f};
    policy_host *h = host_new(budget, &g);
    rng_state = seed;
    enum { MAXN = 1024, MAXH = 8 };
    static float attn[MAXH][MAXN], sum[MAXN];
    const float *rows[MAXH];
    for (uint32_t q = 0; q < MAXH; q++)
        rows[q] = attn[q];
    static cand c[MAXN];
    static uint8_t keep[MAXN];
    size_t written = 0;
    for (uint32_t st = 0; st < steps; st++) {
        uint32_t nnew = st == 0 ? 1 + rng() % (2 * budget) : (rng() % 6 == 0 ? 2 + rng() % 5 : 1);
        assert_int_equal(policy_host_append(h, nnew), 0);
        for (uint32_t l = 0; l < 2; l++) {
            const policy_layer_view *view = policy_host_view(h, l);
            uint32_t n = view->tokens[0];
            uint32_t newest = view->positions[0][n - 1];
            for (uint32_t q = 0; q < q_heads; q++)
                for (uint32_t i = 0; i < n; i++)
                    attn[q][i] = (float)(rng() % 4) * 0.25f; /* ties are common */
            policy_stats sts = {0};
            sts.new_tokens = nnew;
            sts.last_attn = summed ? NULL : rows;
            sts.confidence = -1;
            for (uint32_t i = 0; summed && i < n; i++) {
                sum[i] = 0;
                for (uint32_t q = 0; q < q_heads; q++)
                    sum[i] += attn[q][i];
            }
            sts.score = summed ? sum : NULL;
            sts.score_queries = 1;
            const policy_decision *d;
            char err[POLICY_ERR_LEN] = "";
            if (policy_host_step(h, l, &sts, &d, err, sizeof err) != 0)
                fail_msg("step: %s", err);
            /* oracle: mean over heads, the newest padded to max + 1, top-k */
            double max = -1;
            for (uint32_t i = 0; i < n; i++) {
                double s = 0;
                for (uint32_t q = 0; q < q_heads; q++)
                    s += attn[q][i];
                c[i] = (cand){s / q_heads, i};
                if (i + 1 < n && c[i].s > max)
                    max = c[i].s;
            }
            c[n - 1].s = max + 1;
            memset(keep, 0, n);
            qsort(c, n, sizeof *c, cand_cmp);
            for (uint32_t i = 0; i < n && i < budget; i++)
                keep[c[i].i] = 1;
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(d->tier[0][i] != POLICY_EVICT, keep[i]);
                if (out != NULL) {
                    assert_true(written < cap);
                    out[written++] = d->tier[0][i];
                }
            }
            policy_host_commit(h, l);
            view = policy_host_view(h, l);
            assert_int_equal(view->tokens[0], n < budget ? n : budget);
            assert_int_equal(view->positions[0][view->tokens[0] - 1], newest);
        }
    }
    policy_host_destroy(h);
    return written;
}

static void test_property_random(void **unused)
{
    (void)unused;
    for (int summed = 0; summed < 2; summed++) {
        run_random(1, 16, 8, 200, summed, NULL, 0);
        run_random(2, 1, 2, 100, summed, NULL, 0);
        run_random(3, 40, 3, 200, summed, NULL, 0);
    }
}

/* One decode step of n tokens (budget n - 1) with the summed statistic
 * sum[0..n): the evicted index; with one query head the same rows as
 * last_attn must evict the same token (the mean path, which writes every
 * score and pads the newest with max + 1). */
static uint32_t decode_victim(const float *sum, uint32_t n)
{
    policy_geometry g = {1, 1, 1, 4, 16, 10000.0f};
    uint32_t victim[2] = {UINT32_MAX, UINT32_MAX};
    for (int summed = 0; summed < 2; summed++) {
        policy_host *h = host_new(n - 1, &g);
        assert_int_equal(policy_host_append(h, n), 0);
        policy_stats st = {.new_tokens = n, .confidence = -1, .score_queries = 1};
        const float *rows[1] = {sum};
        st.last_attn = summed ? NULL : rows;
        st.score = summed ? sum : NULL;
        const policy_decision *d;
        char err[POLICY_ERR_LEN] = "";
        if (policy_host_step(h, 0, &st, &d, err, sizeof err) != 0)
            fail_msg("step: %s", err);
        for (uint32_t i = 0; i < n; i++)
            if (d->tier[0][i] == POLICY_EVICT) {
                assert_int_equal(victim[summed], UINT32_MAX); /* one token */
                victim[summed] = i;
            }
        policy_host_destroy(h);
    }
    assert_int_equal(victim[1], victim[0]);
    return victim[1];
}

/*
 * A decode step of the summed statistic reads the sums a block at a time
 * (tova.c sum_decode_victim): over several blocks, the last of equal
 * minima wherever they fall (-0.0 equal to +0.0), the newest token only
 * when max + 1 rounds to max and every score equals it, and on random
 * lists with ties the token the mean path evicts.
 */
static void test_decode_over_blocks(void **unused)
{
    (void)unused;
    enum { N = 1500 };
    static float sum[N];
    for (uint32_t i = 0; i < N; i++)
        sum[i] = 1.0f + (float)(i % 7);
    sum[3] = sum[700] = sum[1200] = 0.5f; /* blocks 0, 1 and 2 */
    assert_int_equal(decode_victim(sum, N), 1200);
    sum[1300] = 0.5f;
    sum[N - 1] = 0.0f; /* the newest is never the one, however low */
    assert_int_equal(decode_victim(sum, N), 1300);
    sum[10] = -0.0f, sum[1000] = 0.0f; /* a -0.0 first, a +0.0 last */
    assert_int_equal(decode_victim(sum, N), 1000);
    sum[1000] = 1.0f;
    assert_int_equal(decode_victim(sum, N), 10);
    for (uint32_t i = 0; i < N; i++) /* max + 1 == max: the newest ties, last */
        sum[i] = 1e30f;
    assert_int_equal(decode_victim(sum, N), N - 1);
    sum[5] = 1e29f;
    assert_int_equal(decode_victim(sum, N), 5);
    /* A sum that is not finite fails the step, naming it, the newest too,
     * as the worker's input (errno EBADMSG), read in place or not. */
    const uint32_t bad_at[5] = {900, N - 1, 2, 0, N - 2};
    for (int k = 0; k < 10; k++) {
        for (uint32_t i = 0; i < N; i++)
            sum[i] = 1.0f;
        int at = k % 5;
        sum[bad_at[at]] = at == 0 || at == 3 ? NAN : at == 4 ? -INFINITY : INFINITY;
        uint32_t n = at == 2 ? 5 : N; /* a list shorter than a vector */
        policy_geometry g = {1, 1, 1, 4, 16, 10000.0f};
        policy_host *h = host_new(n - 1, &g);
        assert_int_equal(policy_host_append(h, n), 0);
        policy_stats st = {.new_tokens = n,
                           .confidence = -1,
                           .score = sum,
                           .score_queries = 1,
                           .in_place = k >= 5};
        const policy_decision *d;
        char err[POLICY_ERR_LEN] = "", want[64];
        errno = 0;
        assert_int_not_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
        assert_int_equal(errno, EBADMSG);
        snprintf(want, sizeof want, "stats.score[%u] is not finite", bad_at[at]);
        if (strstr(err, want) == NULL)
            fail_msg("'%s' does not say '%s'", err, want);
        policy_host_destroy(h);
    }
    rng_state = 11;
    for (int round = 0; round < 80; round++) {
        uint32_t n = 2 + rng() % (round < 40 ? 12 : N - 1); /* short lists too */
        for (uint32_t i = 0; i < n; i++)
            sum[i] = (float)(rng() % (round < 40 ? 3 : 50)) * 0.25f; /* ties */
        decode_victim(sum, n);
    }
}

static void test_property_deterministic(void **unused)
{
    (void)unused;
    size_t cap = 1u << 20;
    uint8_t *a = malloc(cap), *b = malloc(cap);
    assert_true(a && b);
    size_t na = run_random(7, 12, 4, 150, 0, a, cap);
    size_t nb = run_random(7, 12, 4, 150, 0, b, cap);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    /* The sum over the heads decides exactly as the rows it sums. */
    nb = run_random(7, 12, 4, 150, 1, b, cap);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(a);
    free(b);
}

/* TOVA keeps no state beyond its lists: a host restored from them steps on
 * exactly as the original (the daemon's export and import). */
static void test_moves_to_another_host(void **unused)
{
    (void)unused;
    const char *kv[] = {"budget=24", NULL};
    ph_check_portable("tova", kv, ph_geom(2, 4, 2), 20, 12, 7);
    const char *kv8[] = {"budget=24", "demote=int8", "int8_window=8", NULL};
    ph_check_portable("tova", kv8, ph_geom(2, 4, 2), 30, 10, 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_vectors),
        cmocka_unit_test(test_gqa_all_heads),
        cmocka_unit_test(test_missing_stats_and_invalid),
        cmocka_unit_test(test_property_random),
        cmocka_unit_test(test_decode_over_blocks),
        cmocka_unit_test(test_moves_to_another_host),
        cmocka_unit_test(test_property_deterministic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
