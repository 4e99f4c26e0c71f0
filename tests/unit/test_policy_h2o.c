/*
 * test_policy_h2o.c - the H2O baseline (policies/h2o.c).
 *
 * A hand-checkable trace (scores are binary fractions, so sums and ties are
 * exact), the "half" default of recent, invalid configurations, and
 * properties through the host on seeded random scores: held <= budget after
 * every step, sinks and the `recent` newest never evicted, the evicted set
 * equals a sort-based oracle, same input gives same output. Moving a
 * sequence: export/import of the layer state round-trips and decides as
 * the original, and import refuses spoiled bytes without a change.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy_harness.h"
#include "util.h"

/* The harness's seeded stream, as the property tests draw it. */
static uint64_t rng_state;

static uint32_t rng(void)
{
    return (uint32_t)ph_rand(&rng_state);
}

static const policy_geometry geom1 = {1, 2, 1, 4, 16, 10000.0f};

static policy_host *host_new(const char *const *keys, const char *const *values, size_t n,
                             const policy_geometry *g)
{
    return ph_host_pairs("h2o", keys, values, n, *g);
}

/* Append nnew tokens, step layer 0 with `score` (one per held token), commit. */
static size_t step(policy_host *h, uint32_t nnew, const float *score)
{
    assert_int_equal(policy_host_append(h, nnew), 0);
    policy_stats st = {.new_tokens = nnew, .score = score, .confidence = -1};
    return ph_step(h, 0, &st);
}

static void expect_held(policy_host *h, const uint32_t *want, uint32_t n)
{
    ph_expect_positions(h, 0, 0, want, n);
}

static void test_hand_trace(void **unused)
{
    (void)unused;
    /* budget 4, recent 1, sinks 1. */
    const char *k[] = {"budget", "recent", "sinks"};
    const char *v[] = {"4", "1", "1"};
    policy_host *h = host_new(k, v, 3, &geom1);

    /* Step 1, prefill t0..t5, scores .0625 .125 .5 .25 .5 .375. Protected:
     * t0 (position < sinks; the lowest score, still kept) and t5 (newest).
     * 6 > 4: evict 2 of t1 .125, t2 .5, t3 .25, t4 .5 -> t1 and t3. */
    const float s1[6] = {0.0625f, 0.125f, 0.5f, 0.25f, 0.5f, 0.375f};
    assert_int_equal(step(h, 6, s1), 2);
    const uint32_t w1[] = {0, 2, 4, 5};
    expect_held(h, w1, 4);

    /* Step 2, append t6; stats for [t0 t2 t4 t5 t6] = [0 .125 0 .0625 .75]:
     * accumulated t0 .0625, t2 .625, t4 .5, t5 .4375, t6 .75. Protected t0,
     * t6; t5 (recent a step ago) is now the lowest candidate -> evicted. */
    const float s2[5] = {0, 0.125f, 0, 0.0625f, 0.75f};
    assert_int_equal(step(h, 1, s2), 1);
    const uint32_t w2[] = {0, 2, 4, 6};
    expect_held(h, w2, 4);

    /* Step 3, append t7; stats for [t0 t2 t4 t6 t7] = [0 0 .125 0 .25]:
     * t2 .625 and t4 .5 + .125 = .625 tie; t6 .75; t7 .25 is the lowest but
     * the newest. Tie -> the lower index (t2) is evicted. */
    const float s3[5] = {0, 0, 0.125f, 0, 0.25f};
    assert_int_equal(step(h, 1, s3), 1);
    const uint32_t w3[] = {0, 4, 6, 7};
    expect_held(h, w3, 4);

    /* The accumulated scores followed the compaction. */
    char *j = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(j);
    assert_string_equal(j, "{\"layer\":0,\"budget\":4,\"recent\":1,\"sinks\":1,"
                           "\"positions\":[0,4,6,7],\"score\":[0.0625,0.625,0.75,0.25]}");
    free(j);
    policy_host_destroy(h);
}

static void test_under_budget_keeps_all(void **unused)
{
    (void)unused;
    const char *k[] = {"budget", "recent"};
    const char *v[] = {"8", "0"};
    policy_host *h = host_new(k, v, 2, &geom1);
    const float s[8] = {0.5f, 0, 0, 0, 0, 0, 0, 0.25f};
    assert_int_equal(step(h, 8, s), 0); /* held == budget: nothing goes */
    /* recent 0: the newest token (score 0) is evicted when it is lowest;
     * among the zeros t1..t6 and t8 the lowest index goes: t1. */
    const float s2[9] = {0};
    assert_int_equal(step(h, 1, s2), 1);
    const uint32_t w[] = {0, 2, 3, 4, 5, 6, 7, 8};
    expect_held(h, w, 8);
    policy_host_destroy(h);
}

static void test_recent_default_half(void **unused)
{
    (void)unused;
    const char *k[] = {"budget"};
    const char *v[] = {"5"};
    policy_host *h = host_new(k, v, 1, &geom1);
    char *j = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(j, "\"budget\":5,\"recent\":2,\"sinks\":0")); /* int(5/2) */
    free(j);
    policy_host_destroy(h);
    h = host_new(NULL, NULL, 0, &geom1);
    j = policy_host_ops(h)->describe(policy_host_state(h), 0);
    assert_non_null(strstr(j, "\"budget\":256,\"recent\":128,\"sinks\":0"));
    free(j);
    policy_host_destroy(h);
    /* recent = budget - sinks is allowed: a pure window plus sinks */
    const char *k2[] = {"budget", "recent", "sinks"};
    const char *v2[] = {"4", "3", "1"};
    h = host_new(k2, v2, 3, &geom1);
    const float s[6] = {0, 1, 1, 1, 1, 1};
    assert_int_equal(step(h, 6, s), 2);
    const uint32_t w[] = {0, 3, 4, 5};
    expect_held(h, w, 4);
    policy_host_destroy(h);
}

static void test_invalid(void **unused)
{
    (void)unused;
    static const ph_reject cases[] = {
        {{"budget=0"}, {"budget", "[1, 1048576]"}},
        {{"budget=256", "recent=300"}, {"recent", "'half' or an integer in [0, 256]"}},
        {{"budget=256", "recent=quarter"}, {"recent", "'half'"}},
        {{"budget=256", "recent=200", "sinks=100"}, {"recent (200) + sinks (100)"}},
        {{"sinks=-1"}, {"sinks", "[0, "}},
        {{"budget=10", "sinks=11"}, {"sinks", "[0, 10]"}},
    };
    ph_expect_rejects("h2o", geom1, cases, PH_N(cases));
}

static void test_missing_score(void **unused)
{
    (void)unused;
    policy_host *h = host_new(NULL, NULL, 0, &geom1);
    assert_int_equal(policy_host_append(h, 2), 0);
    policy_stats st = {0};
    st.new_tokens = 2;
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "stats.score"));
    policy_host_destroy(h);
}

static void test_uncommitted_decision_detected(void **unused)
{
    (void)unused;
    /* budget 2, recent 1: step 1 evicts t0 of [t0 t1 t2]. If that decision is
     * not committed, the next view still holds t0 and the scores would land on
     * the wrong tokens: the step is refused. */
    const char *k[] = {"budget", "recent"};
    const char *v[] = {"2", "1"};
    policy_host *h = host_new(k, v, 2, &geom1);
    assert_int_equal(policy_host_append(h, 3), 0);
    const float s1[3] = {0.125f, 0.5f, 0.25f};
    policy_stats st = {0};
    st.new_tokens = 3;
    st.score = s1;
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    assert_int_equal(d->tier[0][0], POLICY_EVICT);
    assert_int_equal(policy_host_append(h, 1), 0); /* no commit */
    const float s2[4] = {0};
    st.new_tokens = 1;
    st.score = s2;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not extend the 2 tokens"));
    policy_host_destroy(h);
}

/* Sort-based oracle: evict the k unprotected tokens with the lowest
 * accumulated score, ties to the lower index. */
typedef struct cand {
    double s;
    uint32_t i;
} cand;

static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->s != y->s)
        return x->s < y->s ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* The layer's exported state (h2o.c's format) holds exactly the oracle's
 * tokens: a decode step's hole is skipped, whatever step left it. */
static void assert_state_is(policy_host *h, uint32_t l, const uint32_t *p, const double *a,
                            uint32_t n)
{
    size_t len = 0;
    uint8_t *b = policy_find("h2o")->export_layer(policy_host_state(h), l, &len);
    assert_non_null(b);
    assert_int_equal(len, 28 + (size_t)n * 12);
    assert_int_equal(policy_get_le(b + 24, 4), n);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(policy_get_le(b + 28 + (size_t)i * 4, 4), p[i]);
        double s = policy_bits_f64(policy_get_le(b + 28 + (size_t)n * 4 + (size_t)i * 8, 8));
        if (s != a[i])
            fail_msg("layer %u token %u: score %.17g, want %.17g", l, i, s, a[i]);
    }
    free(b);
}

static size_t run_random(uint64_t seed, uint32_t budget, uint32_t recent, uint32_t sinks,
                         uint32_t layers, uint32_t steps, uint8_t *out, size_t cap)
{
    char b[16], r[16], s[16];
    snprintf(b, sizeof b, "%u", budget);
    snprintf(r, sizeof r, "%u", recent);
    snprintf(s, sizeof s, "%u", sinks);
    const char *k[] = {"budget", "recent", "sinks"};
    const char *v[] = {b, r, s};
    policy_geometry g = {layers, 4, 2, 4, 16, 10000.0f};
    policy_host *h = host_new(k, v, 3, &g);
    rng_state = seed;
    enum { MAXN = 4096 };
    double *acc = calloc((size_t)layers * MAXN, sizeof *acc);
    uint32_t *pos = calloc((size_t)layers * MAXN, sizeof *pos);
    uint32_t *held = calloc(layers, sizeof *held);
    float *score = calloc(MAXN, sizeof *score);
    cand *c = calloc(MAXN, sizeof *c);
    uint8_t *ev = calloc(MAXN, 1);
    assert_true(acc && pos && held && score && c && ev);
    uint32_t appended = 0;
    size_t written = 0;
    for (uint32_t st = 0; st < steps; st++) {
        uint32_t nnew = st == 0 ? 1 + rng() % (2 * budget) : (rng() % 6 == 0 ? 2 + rng() % 5 : 1);
        assert_int_equal(policy_host_append(h, nnew), 0);
        for (uint32_t l = 0; l < layers; l++) {
            double *a = acc + (size_t)l * MAXN;
            uint32_t *p = pos + (size_t)l * MAXN;
            for (uint32_t i = 0; i < nnew; i++) {
                p[held[l] + i] = appended + i;
                a[held[l] + i] = 0;
            }
            uint32_t n = held[l] + nnew;
            assert_true(n < MAXN);
            for (uint32_t i = 0; i < n; i++) {
                score[i] = (float)(rng() % 8) * 0.125f; /* ties are common */
                a[i] += score[i];
            }
            policy_stats sts = {0};
            sts.new_tokens = nnew;
            sts.score = score;
            sts.confidence = -1;
            const policy_decision *d;
            char err[POLICY_ERR_LEN] = "";
            if (policy_host_step(h, l, &sts, &d, err, sizeof err) != 0)
                fail_msg("step: %s", err);
            /* oracle */
            memset(ev, 0, n);
            if (n > budget) {
                uint32_t m = 0;
                for (uint32_t i = 0; i + recent < n; i++)
                    if (p[i] >= sinks)
                        c[m++] = (cand){a[i], i};
                qsort(c, m, sizeof *c, cand_cmp);
                for (uint32_t i = 0; i < n - budget; i++)
                    ev[c[i].i] = 1;
            }
            uint32_t out_n = 0;
            for (uint32_t i = 0; i < n; i++) {
                int evicted = d->tier[0][i] == POLICY_EVICT;
                assert_int_equal(evicted, ev[i]);
                if (evicted) {
                    assert_true(p[i] >= sinks);  /* sinks never go */
                    assert_true(i + recent < n); /* nor the recent newest */
                } else {
                    p[out_n] = p[i];
                    a[out_n] = a[i];
                    out_n++;
                }
                if (out != NULL) {
                    assert_true(written < cap);
                    out[written++] = d->tier[0][i];
                }
            }
            policy_host_commit(h, l);
            held[l] = out_n;
            assert_true(held[l] <= budget || held[l] == n);
            assert_true(held[l] <= (n > budget ? budget : n));
            const policy_layer_view *view = policy_host_view(h, l);
            assert_int_equal(view->tokens[0], held[l]);
            assert_memory_equal(view->positions[0], p, held[l] * sizeof *p);
            assert_state_is(h, l, p, a, held[l]);
        }
        appended += nnew;
    }
    free(acc);
    free(pos);
    free(held);
    free(score);
    free(c);
    free(ev);
    policy_host_destroy(h);
    return written;
}

static void test_property_random(void **unused)
{
    (void)unused;
    run_random(1, 16, 8, 0, 2, 200, NULL, 0);
    run_random(2, 16, 0, 4, 1, 200, NULL, 0);
    run_random(3, 10, 6, 4, 3, 200, NULL, 0);
    run_random(4, 1, 0, 0, 1, 100, NULL, 0);
    run_random(5, 64, 32, 4, 1, 300, NULL, 0);
    /* Lists of several of the pass's 512-entry parts: the hole and the
     * candidates' ends fall anywhere in them. */
    run_random(6, 1300, 200, 3, 2, 150, NULL, 0);
}

static void test_property_deterministic(void **unused)
{
    (void)unused;
    size_t cap = 1u << 20;
    uint8_t *a = malloc(cap), *b = malloc(cap);
    assert_true(a && b);
    size_t na = run_random(9, 12, 5, 2, 2, 150, a, cap);
    size_t nb = run_random(9, 12, 5, 2, 2, 150, b, cap);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(a);
    free(b);
}

/* A sequence moved to another daemon (export_layer / import_layer through
 * the host) holds and decides exactly as the original. */
static void test_moves_to_another_host(void **unused)
{
    (void)unused;
    const char *kv1[] = {"budget=16", "sinks=2", NULL}; /* recent: half */
    ph_check_portable("h2o", kv1, ph_geom(3, 4, 2), 40, 10, 11);
    const char *kv2[] = {"budget=12", "recent=3", "demote=int8", "int8_window=4", NULL};
    ph_check_portable("h2o", kv2, ph_geom(2, 4, 2), 30, 12, 12);
    const char *kv3[] = {"budget=5", "recent=0", NULL}; /* a prefill under the budget */
    ph_check_portable("h2o", kv3, ph_geom(2, 2, 2), 3, 20, 13);
}

/* import_layer checks the bytes (h2o.c's format, version 1) rather than
 * trusting them: each spoiled copy is refused and changes nothing. */
static void test_import_refuses_ph_spoil(void **unused)
{
    (void)unused;
    const char *kv[] = {"budget=8", "recent=2", "sinks=1", NULL};
    policy_geometry g = ph_geom(2, 2, 1);
    uint64_t r = 5;
    policy_host *a = ph_host("h2o", kv, g);
    ph_round(a, &g, 20, 1, &r);
    ph_round(a, &g, 3, 0, &r);
    size_t len;
    uint8_t *good = policy_host_export_state(a, 1, &len);
    assert_non_null(good);
    uint32_t n = (uint32_t)policy_get_le(good + 24, 4);
    assert_int_equal(n, 8);
    assert_int_equal(len, 28 + 12 * (size_t)n);
    /* Into a host that holds layer 1's state already, so that "unchanged"
     * means something. */
    policy_host *c = ph_host("h2o", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(
        policy_host_ops(c)->import_layer(policy_host_state(c), 1, good, len, err, sizeof err), 0);
    size_t score0 = 28 + 4 * (size_t)n, pos1 = 28 + 4;
    const ph_spoil cases[] = {
        {"magic", 0, 1, 'H', 0, "magic"},
        {"version", 3, 1, 2, 0, "version 2"},
        {"other budget", 12, 4, 9, 0, "budget 9"},
        {"count short of the length", 24, 4, n - 1, 0, "bytes"},
        {"count over the budget", 24, 4, 9, 0, "budget"},
        {"trailing byte", 0, 0, 0, 1, "bytes"},
        {"cut short", 0, 0, 0, -1, "bytes"},
        {"header only", 0, 0, 0, -(int)(len - 20), "header"},
        {"NaN score", score0, 8, 0x7ff8000000000000ull, 0, "finite"},
        {"infinite score", score0 + 8, 8, 0x7ff0000000000000ull, 0, "finite"},
        {"positions out of order", pos1, 4, (uint32_t)policy_get_le(good + 28, 4), 0, "ascend"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ph_expect_refused(c, 1, good, len, &cases[i]);
    /* Layer 1's bytes are not layer 0's. */
    ph_spoil other = {"another layer", 0, 0, 0, 0, "layer 1"};
    ph_expect_refused(c, 0, good, len, &other);
    /* And what it did accept is the original's state. */
    char *da = policy_host_ops(a)->describe(policy_host_state(a), 1);
    char *dc = policy_host_ops(c)->describe(policy_host_state(c), 1);
    assert_string_equal(da, dc);
    free(da), free(dc);
    free(good);
    policy_host_destroy(a);
    policy_host_destroy(c);
}

/* Layer 0's policy state as bytes (export_layer), for comparing. */
static uint8_t *state_bytes(policy_host *h, size_t *len)
{
    uint8_t *b = policy_host_export_state(h, 0, len);
    assert_non_null(b);
    return b;
}

static void expect_state(policy_host *h, const uint8_t *want, size_t len)
{
    size_t n;
    uint8_t *b = state_bytes(h, &n);
    assert_int_equal(n, len);
    assert_memory_equal(b, want, len);
    free(b);
}

/* Random scores for n tokens, some of them -0.0. */
static void random_scores(float *s, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        s[i] = rng() % 9 == 0 ? -0.0f : (float)(rng() % 64) * 0.125f;
}

/*
 * A step keeps its attention apart and folds it into the sums at the next
 * step, in place, and a decode victim stays as a hole until then (h2o.c):
 * a rollback after one step, after two steps in one transaction, after a
 * prompt-sized step that compacts, and after a refused step, gives back
 * exactly the sums and positions the transaction began with, and the
 * sequence steps on as a twin that never took the rolled-back steps.
 */
static void test_rollback_restores_folded_sums(void **unused)
{
    (void)unused;
    const char *k[] = {"budget", "recent"};
    const char *v[] = {"8", "2"};
    policy_host *h = host_new(k, v, 2, &geom1), *twin = host_new(k, v, 2, &geom1);
    float s[32];
    rng_state = 21;
    random_scores(s, 12);
    step(h, 12, s), step(twin, 12, s);
    for (int i = 0; i < 5; i++) { /* decode steps: a sum pending and a hole */
        random_scores(s, 9);
        step(h, 1, s), step(twin, 1, s);
    }
    size_t len;
    uint8_t *before = state_bytes(h, &len);
    const uint32_t nnew[4] = {1, 1, 6, 1}, steps[4] = {1, 2, 1, 1};
    for (int c = 0; c < 4; c++) {
        policy_host_begin(h);
        for (uint32_t t = 0; t < steps[c]; t++) {
            assert_int_equal(policy_host_append(h, nnew[c]), 0);
            uint32_t n = 8 + nnew[c];
            random_scores(s, n);
            if (c == 3)
                s[3] = NAN; /* refused after its pass folded the sums */
            policy_stats st = {.new_tokens = nnew[c], .score = s, .confidence = -1};
            if (c == 3) { /* the worker's input: errno EBADMSG, the index named */
                errno = 0;
                ph_step_fails(h, 0, &st, "layer 0's stats.score[3] is not finite");
                assert_int_equal(errno, EBADMSG);
                continue;
            }
            ph_step(h, 0, &st);
        }
        policy_host_rollback(h);
        expect_state(h, before, len);
    }
    for (int i = 0; i < 3; i++) { /* and on, as the twin */
        random_scores(s, 9);
        step(h, 1, s), step(twin, 1, s);
        size_t tl;
        uint8_t *t = state_bytes(twin, &tl);
        expect_state(h, t, tl);
        free(t);
    }
    /* A new token's first sum is its score as it came: -0.0 stays -0.0. */
    random_scores(s, 9);
    s[8] = -0.0f;
    step(h, 1, s);
    uint8_t *b = state_bytes(h, &len);
    uint32_t n = (uint32_t)policy_get_le(b + 24, 4);
    assert_int_equal(policy_get_le(b + 28 + 4 * (size_t)n + 8 * (size_t)(n - 1), 8),
                     0x8000000000000000ull);
    free(b);
    free(before);
    policy_host_destroy(h);
    policy_host_destroy(twin);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_trace),
        cmocka_unit_test(test_under_budget_keeps_all),
        cmocka_unit_test(test_recent_default_half),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_missing_score),
        cmocka_unit_test(test_uncommitted_decision_detected),
        cmocka_unit_test(test_property_random),
        cmocka_unit_test(test_property_deterministic),
        cmocka_unit_test(test_moves_to_another_host),
        cmocka_unit_test(test_import_refuses_ph_spoil),
        cmocka_unit_test(test_rollback_restores_folded_sums),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
