/*
 * test_policy_reviver.c - KVReviver (POLICIES.md §3; policies/reviver.{c,h}).
 *
 * - T-KR1 (§3.7) on the kernels' reference sketch (kv_sketch_*_ref, through
 *   policy_harness.h): every cell, every query, the hand check of J0's
 *   value, the delete-leaves-others-unchanged property; the MEAN variant
 *   (§3.8) on the same inserts; even-r lower median. (The §3.2 hash vectors
 *   are test_kernels_sketch.c's: the hash is kernels/sketch_hash.h.)
 * - Round trip: with no bucket shared, query returns exactly what was
 *   inserted, also after deletes (injected tables and the real hash).
 * - T-KR2 (§3.7): the compress trace, through reviver_compress() and through
 *   the policy host (tiers, describe(), operation log).
 * - Config validation: every message names its parameter.
 * - Properties through the host on seeded random scores: nothing is ever
 *   evicted, raw tokens stay within R_b + slack + C_b, the newest R_b are
 *   raw, tiers and operations equal a literal linear-scan transcription of
 *   §3.5, same input gives same output, and a simulated daemon that applies
 *   the operations to a sketch revives exact K/V when no buckets collide.
 * - Moving a sequence (export_layer / import_layer): three configurations
 *   moved mid-run decide, describe and order their operations exactly as
 *   the original, every round's bytes re-import to the same bytes; a table
 *   of spoiled bytes is refused, named, and leaves the layer unchanged.
 */
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
#include "reviver.h"
#include "sketch_hash.h"

#define TOL 1e-6

/* ---- helpers ---- */

/* The harness's seeded stream, as the tests draw it. */
static uint64_t rng_state;

static uint32_t rng(void)
{
    return (uint32_t)ph_rand(&rng_state);
}

static float rng_unit(void)
{
    return ph_uniform(&rng_state, 0, 1);
}

static const policy_geometry geom1 = {1, 2, 1, 4, 16, 10000.0f};

/* Create through the host; fails the test on error. */
static policy_host *host_new(const char *const *keys, const char *const *values, size_t n,
                             const policy_geometry *g)
{
    return ph_host_pairs("reviver", keys, values, n, *g);
}

static char *describe(policy_host *h, uint32_t layer)
{
    char *s = policy_host_ops(h)->describe(policy_host_state(h), layer);
    assert_non_null(s);
    return s;
}

/* The layer's sketch geometry as the daemon asks for it (ops->sketch_geometry). */
static int sketch_geometry(policy_host *h, uint32_t layer, policy_sketch_geometry *out)
{
    return policy_host_ops(h)->sketch_geometry(policy_host_state(h), layer, out);
}

/* The JSON array after "key": in describe() text, as written ("[0,1]"). */
static void json_array(const char *json, const char *key, char *out, size_t len)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    assert_non_null(p);
    p += strlen(pat);
    const char *e = strchr(p, ']');
    assert_non_null(e);
    size_t n = (size_t)(e - p + 1);
    assert_true(n < len);
    memcpy(out, p, n);
    out[n] = '\0';
}

static void expect_store(const char *json, const char *key, const char *want)
{
    char got[512];
    json_array(json, key, got, sizeof got);
    if (strcmp(got, want) != 0)
        fail_msg("%s = %s, want %s", key, got, want);
}

/* ---- T-KR1 ---- */

static const uint32_t KR1_H[4][3] = {{0, 1, 2}, {1, 1, 0}, {2, 0, 2}, {0, 2, 1}};
static const int8_t KR1_G[4][3] = {{1, -1, 1}, {-1, 1, 1}, {1, 1, -1}, {1, -1, -1}};
static const float KR1_K[4][2] = {{1, 0}, {0, 1}, {2, 2}, {-1, 1}};
static const float KR1_V[4][2] = {{1, 2}, {3, -1}, {0, 1}, {2, 2}};

/* The §3.7 sketch: J0..J3 inserted through the kernels' reference. */
static void kr1_build(kv_sketch *s, kv_estimate ke, kv_estimate ve)
{
    *s = ph_sketch_new(3, 3, 2, ke, ve);
    for (int j = 0; j < 4; j++)
        ph_sketch_insert(s, KR1_H[j], KR1_G[j], KR1_K[j], KR1_V[j]);
}

static void expect_vec(const float *got, float a, float b)
{
    assert_float_equal(got[0], a, TOL);
    assert_float_equal(got[1], b, TOL);
}

static void test_kr1_cells(void **unused)
{
    (void)unused;
    kv_sketch s;
    kr1_build(&s, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    /* cellK rows (buckets 0, 1, 2), §3.7 */
    static const float K[3][3][2] = {
        {{0, 1}, {0, 1}, {2, 2}}, {{2, 2}, {1, 1}, {-1, 1}}, {{0, 1}, {-1, 1}, {3, 2}}};
    static const float V[3][3][2] = {
        {{3, 4}, {-3, 1}, {0, 1}}, {{0, 1}, {2, -3}, {-2, -2}}, {{3, -1}, {-2, -2}, {1, 1}}};
    /* bucket counts: row0 {J0,J3},{J1},{J2}; row1 {J2},{J0,J1},{J3}; row2 {J1},{J3},{J0,J2} */
    static const int32_t C[3][3] = {{2, 1, 1}, {1, 2, 1}, {1, 1, 2}};
    for (int r = 0; r < 3; r++)
        for (int b = 0; b < 3; b++) {
            expect_vec(&s.key[(r * 3 + b) * 2], K[r][b][0], K[r][b][1]);
            expect_vec(&s.value[(r * 3 + b) * 2], V[r][b][0], V[r][b][1]);
            assert_int_equal(s.count[r * 3 + b], C[r][b]);
        }
    ph_sketch_free(&s);
}

static void test_kr1_queries(void **unused)
{
    (void)unused;
    kv_sketch s;
    kr1_build(&s, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    static const float want[4][2][2] = {
        {{1, 1}, {1, 3}},   /* J0: key biased (true [1,0]), value biased (true [1,2]) */
        {{0, 1}, {3, -1}},  /* J1: exact */
        {{2, 2}, {0, 1}},   /* J2: exact */
        {{-1, 1}, {2, 2}}}; /* J3: exact */
    for (int j = 0; j < 4; j++) {
        float k[2], v[2];
        ph_sketch_query(&s, KR1_H[j], KR1_G[j], k, v);
        expect_vec(k, want[j][0][0], want[j][0][1]);
        expect_vec(v, want[j][1][0], want[j][1][1]);
    }
    /* Hand check of J0's value: row estimates +[3,4], -[2,-3] = [-2,3], +[1,1];
     * medians ch0 {3,-2,1} -> 1, ch1 {4,3,1} -> 3. */
    const float *c0 = &s.value[(0 * 3 + 0) * 2], *c1 = &s.value[(1 * 3 + 1) * 2],
                *c2 = &s.value[(2 * 3 + 2) * 2];
    expect_vec(c0, 3, 4);
    assert_float_equal(-c1[0], -2, TOL);
    assert_float_equal(-c1[1], 3, TOL);
    expect_vec(c2, 1, 1);
    ph_sketch_free(&s);
}

static void test_kr1_delete_keeps_others(void **unused)
{
    (void)unused;
    kv_sketch s;
    kr1_build(&s, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    float before[4][2][2];
    for (int j = 0; j < 4; j++)
        ph_sketch_query(&s, KR1_H[j], KR1_G[j], before[j][0], before[j][1]);
    float k[2], v[2];
    ph_sketch_revive(&s, KR1_H[2], KR1_G[2], k, v); /* Alg. 3: query, delete that */
    expect_vec(k, 2, 2);
    for (int j = 0; j < 4; j++) {
        if (j == 2)
            continue;
        float k2[2], v2[2];
        ph_sketch_query(&s, KR1_H[j], KR1_G[j], k2, v2);
        expect_vec(k2, before[j][0][0], before[j][0][1]);
        expect_vec(v2, before[j][1][0], before[j][1][1]);
    }
    /* J2's cells lost exactly its contribution: row0 bucket2 key [2,2] -> [0,0]. */
    expect_vec(&s.key[(0 * 3 + 2) * 2], 0, 0);
    assert_int_equal(s.count[0 * 3 + 2], 0);
    /* row2 bucket2 value: [1,1] - g(-1)·[0,1] = [1,2] */
    expect_vec(&s.value[(2 * 3 + 2) * 2], 1, 2);

    /* Deleting the BIASED estimate of J0 leaves residual (§3.3, §6 #12): row0
     * bucket0 key was k0 + k3 = [0,1]; minus J0's estimate [1,1] -> [-1,0],
     * not k3 = [-1,1]. */
    ph_sketch_revive(&s, KR1_H[0], KR1_G[0], k, v);
    expect_vec(k, 1, 1);
    expect_vec(&s.key[0], -1, 0);
    ph_sketch_free(&s);
}

static void test_kr1_mean_variant(void **unused)
{
    (void)unused;
    /* Same inserts, each row's cell divided by its count (§3.8). J0: keys
     * [0,1]/2, [1,1]/2, [3,2]/2 -> medians ch0 {0,.5,1.5} = .5, ch1 {.5,.5,1} =
     * .5; values +[3,4]/2, -[2,-3]/2, +[1,1]/2 -> ch0 {1.5,-1,.5} = .5, ch1
     * {2,1.5,.5} = 1.5. J1..J3 stay exact. */
    kv_sketch s;
    kr1_build(&s, KV_ESTIMATE_MEAN, KV_ESTIMATE_MEAN);
    static const float want[4][2][2] = {
        {{0.5f, 0.5f}, {0.5f, 1.5f}}, {{0, 1}, {3, -1}}, {{2, 2}, {0, 1}}, {{-1, 1}, {2, 2}}};
    for (int j = 0; j < 4; j++) {
        float k[2], v[2];
        ph_sketch_query(&s, KR1_H[j], KR1_G[j], k, v);
        expect_vec(k, want[j][0][0], want[j][0][1]);
        expect_vec(v, want[j][1][0], want[j][1][1]);
    }
    ph_sketch_free(&s);
    /* key mean, value sum: J0 -> key [.5,.5], value [1,3] */
    kr1_build(&s, KV_ESTIMATE_MEAN, KV_ESTIMATE_SUM);
    float k[2], v[2];
    ph_sketch_query(&s, KR1_H[0], KR1_G[0], k, v);
    expect_vec(k, 0.5f, 0.5f);
    expect_vec(v, 1, 3);
    ph_sketch_free(&s);
}

static void test_even_rows_lower_median(void **unused)
{
    (void)unused;
    /* r = 4, one channel: a token alone in its buckets has row estimates equal
     * to its value; bucket-mates make the rows differ. Rows of J0 hold
     * {5, 3, 9, 1} (J0 = 1 everywhere plus mates 4, 2, 8, 0): sorted {1,3,5,9},
     * lower middle 3 (torch.median), not 4 (the mean of the middle two). */
    kv_sketch s;
    s = ph_sketch_new(4, 2, 1, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    const uint32_t h0[4] = {0, 0, 0, 0};
    const int8_t g[4] = {1, 1, 1, 1};
    const float one = 1;
    ph_sketch_insert(&s, h0, g, &one, &one);
    const float mates[4] = {4, 2, 8, 0};
    for (uint32_t r = 0; r < 4; r++) { /* add a mate to row r's bucket 0 only */
        uint32_t hm[4] = {1, 1, 1, 1};
        hm[r] = 0;
        float x = mates[r];
        ph_sketch_insert(&s, hm, g, &x, &x);
    }
    /* row r bucket 0 = 1 + mates[r]; other mates land in bucket 1 */
    float k, v;
    ph_sketch_query(&s, h0, g, &k, &v);
    assert_float_equal(k, 3, TOL);
    assert_float_equal(v, 3, TOL);
    ph_sketch_free(&s);
    /* r = 2: {1+4, 1+2} -> lower middle 3 */
    s = ph_sketch_new(2, 2, 1, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    ph_sketch_insert(&s, h0, g, &one, &one);
    const uint32_t a[2] = {0, 1}, b[2] = {1, 0};
    const float four = 4, two = 2;
    ph_sketch_insert(&s, a, g, &four, &four);
    ph_sketch_insert(&s, b, g, &two, &two);
    ph_sketch_query(&s, h0, g, &k, &v);
    assert_float_equal(k, 3, TOL);
    ph_sketch_free(&s);
}

/* ---- round trip without collisions ---- */

static void roundtrip(kv_estimate est)
{
    enum { N = 24, D = 5 };
    for (uint32_t rows = 1; rows <= 5; rows++) {
        rng_state = 1000 + rows;
        uint32_t buckets = N + rows; /* b >= N: a permutation per row never collides */
        kv_sketch s;
        s = ph_sketch_new(rows, buckets, D, est, est);
        uint32_t h[N][KV_SKETCH_MAX_ROWS];
        int8_t g[N][KV_SKETCH_MAX_ROWS];
        float k[N][D], v[N][D];
        for (uint32_t r = 0; r < rows; r++) {
            uint32_t perm[N + 5];
            for (uint32_t i = 0; i < buckets; i++)
                perm[i] = i;
            for (uint32_t i = buckets - 1; i > 0; i--) {
                uint32_t j = rng() % (i + 1), t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
            for (uint32_t j = 0; j < N; j++) {
                h[j][r] = perm[j];
                g[j][r] = rng() & 1 ? 1 : -1;
            }
        }
        for (uint32_t j = 0; j < N; j++) {
            for (uint32_t c = 0; c < D; c++) {
                k[j][c] = rng_unit() * 8 - 4;
                v[j][c] = rng_unit() * 8 - 4;
            }
            ph_sketch_insert(&s, h[j], g[j], k[j], v[j]);
        }
        for (uint32_t j = 0; j < N; j++) {
            float kq[D], vq[D];
            /* revive (query, then delete) every other one; the rest must
             * stay exact */
            if (j % 2 == 0)
                ph_sketch_revive(&s, h[j], g[j], kq, vq);
            else
                ph_sketch_query(&s, h[j], g[j], kq, vq);
            assert_memory_equal(kq, k[j], sizeof kq);
            assert_memory_equal(vq, v[j], sizeof vq);
        }
        for (uint32_t j = 1; j < N; j += 2) {
            float kq[D], vq[D];
            ph_sketch_query(&s, h[j], g[j], kq, vq);
            assert_memory_equal(kq, k[j], sizeof kq);
            assert_memory_equal(vq, v[j], sizeof vq);
        }
        ph_sketch_free(&s);
    }
}

static void test_roundtrip_exact_sum(void **unused)
{
    (void)unused;
    roundtrip(KV_ESTIMATE_SUM);
}

static void test_roundtrip_exact_mean(void **unused)
{
    (void)unused;
    roundtrip(KV_ESTIMATE_MEAN);
}

static void test_roundtrip_real_hash(void **unused)
{
    (void)unused;
    /* The §3.2 family with b = 2^20 and 64 tokens: check there is no shared
     * bucket in any row, then every query is exact. */
    enum { N = 64, R = 3, D = 3 };
    const uint32_t b = 1u << 20;
    uint64_t seed = kv_sketch_layer_seed(42, 5);
    kv_sketch s = ph_sketch_new(R, b, D, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    uint32_t h[N][R];
    int8_t g[N][R];
    float k[N][D], v[N][D];
    rng_state = 99;
    for (uint32_t j = 0; j < N; j++) {
        kv_sketch_hash(seed, R, b, 1000 + 7 * j, h[j], g[j]);
        for (uint32_t i = 0; i < j; i++)
            for (uint32_t r = 0; r < R; r++)
                assert_int_not_equal(h[i][r], h[j][r]);
        for (uint32_t c = 0; c < D; c++) {
            k[j][c] = rng_unit() - 0.5f;
            v[j][c] = rng_unit() - 0.5f;
        }
        ph_sketch_insert(&s, h[j], g[j], k[j], v[j]);
    }
    for (uint32_t j = 0; j < N; j++) {
        float kq[D], vq[D];
        ph_sketch_query(&s, h[j], g[j], kq, vq);
        assert_memory_equal(kq, k[j], sizeof kq);
        assert_memory_equal(vq, v[j], sizeof vq);
    }
    ph_sketch_free(&s);
}

/* ---- T-KR2 ---- */

/* Fixed scores of the trace (binary-exact where ties could matter). */
static const float KR2_SCORE[7] = {0.50f, 0.10f, 0.40f, 0.05f, 0.30f, 0.20f, 0.25f};

static void expect_locs(const uint8_t *loc, uint32_t n, const char *want)
{
    /* want: one letter per token, R/C/V */
    assert_int_equal(strlen(want), n);
    for (uint32_t i = 0; i < n; i++) {
        char c = loc[i] == REVIVER_RECENT ? 'R' : loc[i] == REVIVER_CANDIDATE ? 'C' : 'V';
        if (c != want[i])
            fail_msg("token t%u is in %c, want %c (want %s)", i, c, want[i], want);
    }
}

static void test_kr2_compress_trace(void **unused)
{
    (void)unused;
    const reviver_budgets b = {2, 1, 2, 1.1};
    double score[7];
    uint8_t loc[7];
    uint32_t scratch[14];
    reviver_op ops[7];
    size_t nops;
    /* Per push t_k (k = 0..6): R/C/V of t0..t_k after compress. */
    static const char *const want[7] = {
        "R",       /* t0 */
        "RR",      /* t1 */
        "RRR",     /* t2: |R| = 3 = R_b + slack, no spill */
        "CCRR",    /* t3: |R| = 4 > 3, t0 and t1 move to C */
        "CCRRR",   /* t4: |R| = 3 */
        "CVCVRR",  /* t5: t2, t3 -> C = {t0..t3}; pop t3 (.05), t1 (.10) into V;
                    *     swap test 0.40·1.1 = 0.44 < 0.10 fails */
        "CCVVRRR", /* t6: t1 raised to .60; 0.44 < 0.60: revive t1, sketch t2;
                    *     then 0.50·1.1 = 0.55 < max_V 0.40 fails */
    };
    for (uint32_t t = 0; t < 7; t++) {
        score[t] = KR2_SCORE[t];
        if (t == 6)
            score[1] = 0.60;
        assert_int_equal(reviver_compress(&b, t + 1, 1, score, loc, scratch, ops, 7, &nops), 0);
        expect_locs(loc, t + 1, want[t]);
        if (t == 5) {
            assert_int_equal(nops, 2);
            assert_int_equal(ops[0].index, 3);
            assert_int_equal(ops[0].kind, REVIVER_OP_SKETCH);
            assert_int_equal(ops[1].index, 1);
            assert_int_equal(ops[1].kind, REVIVER_OP_SKETCH);
        } else if (t == 6) {
            assert_int_equal(nops, 2);
            assert_int_equal(ops[0].index, 1);
            assert_int_equal(ops[0].kind, REVIVER_OP_REVIVE);
            assert_int_equal(ops[1].index, 2);
            assert_int_equal(ops[1].kind, REVIVER_OP_SKETCH);
        } else {
            assert_int_equal(nops, 0);
        }
    }
    /* A too-small operation log is reported, not overrun. */
    memset(loc, 0, sizeof loc);
    for (int i = 0; i < 7; i++)
        score[i] = KR2_SCORE[i];
    assert_int_equal(reviver_compress(&b, 7, 7, score, loc, scratch, ops, 2, &nops), -1);
    assert_int_equal(nops, 2);
}

static void test_kr2_prefill_cascade(void **unused)
{
    (void)unused;
    /* §3.5 prefill: the whole prompt at once cascades R -> C -> V. Seven
     * tokens with the T-KR2 scores: R keeps t5, t6; C gets t0..t4 and keeps
     * the two heaviest (t0 .50, t2 .40); t3, t1, t4 go to V in pop order.
     * The swap test 0.40·1.1 < max_V 0.30 fails. */
    const reviver_budgets b = {2, 1, 2, 1.1};
    double score[7];
    uint8_t loc[7];
    uint32_t scratch[14];
    reviver_op ops[7];
    size_t nops;
    for (int i = 0; i < 7; i++)
        score[i] = KR2_SCORE[i];
    assert_int_equal(reviver_compress(&b, 7, 7, score, loc, scratch, ops, 7, &nops), 0);
    expect_locs(loc, 7, "CVCVVRR");
    assert_int_equal(nops, 3);
    assert_int_equal(ops[0].index, 3);
    assert_int_equal(ops[1].index, 1);
    assert_int_equal(ops[2].index, 4);
}

static void test_compress_ties(void **unused)
{
    (void)unused;
    /* Ties: C pops the older (smaller index) first; V revives the smaller
     * index first. R_b = 0, slack = 0, C_b = 1: everything spills. */
    const reviver_budgets b = {0, 0, 1, 1.0};
    double score[4] = {0.25, 0.25, 0.25, 0.25};
    uint8_t loc[4];
    uint32_t scratch[8];
    reviver_op ops[4];
    size_t nops;
    assert_int_equal(reviver_compress(&b, 4, 4, score, loc, scratch, ops, 4, &nops), 0);
    expect_locs(loc, 4, "VVVC"); /* t0, t1, t2 popped in that order; t3 stays */
    assert_int_equal(nops, 3);
    assert_int_equal(ops[0].index, 0);
    assert_int_equal(ops[2].index, 2);
    /* Raise t0 and t2 equally: both beat t3; t0 (smaller) is revived first,
     * then t3 sinks; t2 is not revived (min_C 0.5 is not < 0.5). */
    score[0] = 0.5;
    score[2] = 0.5;
    assert_int_equal(reviver_compress(&b, 4, 0, score, loc, scratch, ops, 4, &nops), 0);
    expect_locs(loc, 4, "CVVV");
    assert_int_equal(nops, 2);
    assert_int_equal(ops[0].index, 0);
    assert_int_equal(ops[0].kind, REVIVER_OP_REVIVE);
    assert_int_equal(ops[1].index, 3);
    assert_int_equal(ops[1].kind, REVIVER_OP_SKETCH);
}

static void test_compress_slack_zero_and_empty_c(void **unused)
{
    (void)unused;
    /* slack 0 spills every step: R_b = 1 keeps exactly the newest. C_b = 0:
     * every spilled token goes straight to V and the swap loop is skipped. */
    const reviver_budgets b = {1, 0, 0, 1.1};
    double score[3] = {0.9, 0.1, 0.1};
    uint8_t loc[3];
    uint32_t scratch[6];
    reviver_op ops[3];
    size_t nops;
    assert_int_equal(reviver_compress(&b, 1, 1, score, loc, scratch, ops, 3, &nops), 0);
    expect_locs(loc, 1, "R");
    assert_int_equal(reviver_compress(&b, 2, 1, score, loc, scratch, ops, 3, &nops), 0);
    expect_locs(loc, 2, "VR");
    assert_int_equal(reviver_compress(&b, 3, 1, score, loc, scratch, ops, 3, &nops), 0);
    expect_locs(loc, 3, "VVR");
}

/* Step layer 0 of a 1-layer host with one new token and the given scores. */
static const policy_decision *host_step(policy_host *h, uint32_t new_tokens, const float *score)
{
    assert_int_equal(policy_host_append(h, new_tokens), 0);
    policy_stats st = {0};
    st.new_tokens = new_tokens;
    st.score = score;
    st.confidence = -1;
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, 0, &st, &d, err, sizeof err) != 0)
        fail_msg("step: %s", err);
    return d;
}

static void test_kr2_through_host(void **unused)
{
    (void)unused;
    /* M = 10, shares .6/.2/.2: R_b = int(.2·10) = 2, C_b = 2; slack 1. The
     * stats carry each token's fixed score on arrival; at t6's step t1 gets
     * +0.50 ("raise t1's accumulated score to 0.60"). */
    const char *keys[] = {"budget", "vague_share", "candidate_share", "recent_share", "slack"};
    const char *values[] = {"10", "0.6", "0.2", "0.2", "1"};
    policy_host *h = host_new(keys, values, 5, &geom1);
    for (uint32_t t = 0; t < 7; t++) {
        float score[7] = {0};
        score[t] = KR2_SCORE[t];
        if (t == 6)
            score[1] = 0.50f;
        const policy_decision *d = host_step(h, 1, score);
        if (t == 5) {
            /* t1 and t3 go to the sketch */
            for (uint32_t i = 0; i <= t; i++)
                assert_int_equal(d->tier[0][i], i == 1 || i == 3 ? POLICY_SKETCH : POLICY_FULL);
        }
        if (t == 6) {
            /* t1 comes back (SKETCH -> FULL), t2 leaves (FULL -> SKETCH) */
            for (uint32_t i = 0; i <= t; i++)
                assert_int_equal(d->tier[0][i], i == 2 || i == 3 ? POLICY_SKETCH : POLICY_FULL);
        }
        assert_int_equal(policy_host_commit(h, 0), 0); /* never evicts */
        char *j = describe(h, 0);
        if (t == 5) {
            expect_store(j, "candidate", "[0,2]");
            expect_store(j, "vague", "[1,3]");
            expect_store(j, "recent", "[4,5]");
            expect_store(j, "ops", "[[\"sketch\",3]");
        }
        if (t == 6) {
            expect_store(j, "candidate", "[0,1]");
            expect_store(j, "vague", "[2,3]");
            expect_store(j, "recent", "[4,5,6]");
            expect_store(j, "ops", "[[\"revive\",1]");
            assert_non_null(strstr(j, "\"ops\":[[\"revive\",1],[\"sketch\",2]]"));
            assert_non_null(strstr(j, "\"recent_budget\":2,\"slack\":1,\"candidate_budget\":2"));
        }
        free(j);
    }
    size_t n;
    const reviver_op *ops = reviver_layer_ops(policy_host_state(h), 0, &n);
    assert_int_equal(n, 2);
    assert_int_equal(ops[0].kind, REVIVER_OP_REVIVE);
    assert_int_equal(ops[0].index, 1);
    assert_int_equal(ops[1].kind, REVIVER_OP_SKETCH);
    assert_int_equal(ops[1].index, 2);
    const policy_layer_view *v = policy_host_view(h, 0);
    assert_int_equal(v->tokens[0], 7); /* sketched tokens stay in the list */
    policy_host_destroy(h);
}

/* ---- configuration ---- */

static void test_defaults_and_derivation(void **unused)
{
    (void)unused;
    /* M = 256: R_b = int(.45·256) = int(115.2) = 115, C_b = 115, slack =
     * min(32, 115) = 32, b = round(.1·256 / 3) = round(8.53) = 9. */
    policy_host *h = host_new(NULL, NULL, 0, &geom1);
    char *j = describe(h, 0);
    assert_non_null(strstr(j, "\"recent_budget\":115,\"slack\":32,\"candidate_budget\":115,"
                              "\"rows\":3,\"buckets\":9"));
    assert_non_null(strstr(j, "\"key_estimate\":\"sum\",\"value_estimate\":\"sum\""));
    free(j);
    policy_sketch_geometry c;
    assert_int_equal(sketch_geometry(h, 0, &c), 0);
    assert_int_equal(c.rows, 3);
    assert_int_equal(c.buckets, 9);
    assert_true(c.layer_seed == kv_sketch_layer_seed(0, 0));
    assert_int_equal(c.key_mean, 0);
    assert_int_equal(sketch_geometry(h, 1, &c), -1);
    size_t n = 5;
    assert_null(reviver_layer_ops(policy_host_state(h), 0, &n));
    assert_int_equal(n, 0);
    policy_host_destroy(h);

    /* M = 205 (the paper's 10% of 2k): R_b = C_b = int(92.25) = 92, b =
     * round(20.5 / 3) = round(6.83) = 7; slack 32. Explicit key mean. */
    const char *k2[] = {"budget", "key_estimate", "seed"};
    const char *v2[] = {"205", "mean", "7"};
    policy_geometry g4 = {4, 8, 4, 8, 16, 10000.0f};
    h = host_new(k2, v2, 3, &g4);
    j = describe(h, 3);
    assert_non_null(strstr(j, "\"recent_budget\":92,\"slack\":32,\"candidate_budget\":92,"
                              "\"rows\":3,\"buckets\":7,\"layer_seed\":\"0x953aeb70673e29cb\""));
    assert_non_null(strstr(j, "\"key_estimate\":\"mean\""));
    free(j);
    assert_int_equal(sketch_geometry(h, 3, &c), 0);
    assert_true(c.layer_seed == 0x953AEB70673E29CBull);
    assert_int_equal(c.key_mean, 1);
    policy_host_destroy(h);

    /* M = 10: b = max(1, round(1/3)) = 1; R_b = int(4.5) = 4, slack = min(32, 4)
     * = 4. Explicit buckets win; slack 0 is kept. */
    const char *k3[] = {"budget", "slack"};
    const char *v3[] = {"10", "0"};
    h = host_new(k3, v3, 1, &geom1);
    j = describe(h, 0);
    assert_non_null(strstr(j, "\"recent_budget\":4,\"slack\":4,\"candidate_budget\":4,"
                              "\"rows\":3,\"buckets\":1"));
    free(j);
    policy_host_destroy(h);
    h = host_new(k3, v3, 2, &geom1);
    j = describe(h, 0);
    assert_non_null(strstr(j, "\"slack\":0,"));
    free(j);
    policy_host_destroy(h);
    const char *k4[] = {"buckets", "rows"};
    const char *v4[] = {"1000", "4"};
    h = host_new(k4, v4, 2, &geom1);
    assert_int_equal(sketch_geometry(h, 0, &c), 0);
    assert_int_equal(c.buckets, 1000);
    assert_int_equal(c.rows, 4);
    policy_host_destroy(h);
}

static void test_invalid_configs(void **unused)
{
    (void)unused;
    static const ph_reject cases[] = {
        {{"vague_share=0.1", "candidate_share=0.5", "recent_share=0.45"},
         {"vague_share + candidate_share + recent_share", "must sum to 1"}},
        {{"vague_share=0", "candidate_share=0.5", "recent_share=0.5"}, {"vague_share", "> 0"}},
        {{"rows=0"}, {"rows", "[1, 32]"}},
        {{"rows=33"}, {"rows", "[1, 32]"}},
        {{"budget=0"}, {"budget", "[1, 1048576]"}},
        {{"slack=-2"}, {"slack", "'-1' or an integer in [0, 1048576]"}},
        {{"slack=x"}, {"slack", "'-1' or an integer in [0, 1048576]"}},
        {{"replace_rate=0.9"}, {"replace_rate", "[1, 1e+06]"}},
        {{"key_estimate=median"}, {"key_estimate", "sum, mean"}},
        {{"value_estimate=median"}, {"value_estimate", "sum, mean"}},
        {{"buckets=-2"}, {"buckets", "[0, 1048576]"}},
        {{"seed=4294967296"}, {"seed", "[0, 4294967295]"}},
        {{"vague_share=nan"}, {"vague_share", "[0, 1]"}},
    };
    ph_expect_rejects("reviver", geom1, cases, PH_N(cases));
}

static void test_step_rejects_bad_stats(void **unused)
{
    (void)unused;
    policy_host *h = host_new(NULL, NULL, 0, &geom1);
    assert_int_equal(policy_host_append(h, 3), 0);
    policy_stats st = {0};
    st.new_tokens = 3;
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "score"));
    float bad[3] = {0.1f, -0.5f, 0.2f};
    st.score = bad;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "score[1]"));
    /* a rejected step changed nothing: the same step with good scores works */
    float good[3] = {0.1f, 0.5f, 0.2f};
    st.score = good;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    policy_host_commit(h, 0);
    /* Tokens appended without a step are new too, whatever new_tokens says:
     * 2 more appended, new_tokens = 1 -> positions 3 and 4 join Recent. */
    assert_int_equal(policy_host_append(h, 1), 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    float five[5] = {0};
    st.score = five;
    st.new_tokens = 1;
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    policy_host_commit(h, 0);
    char *j = describe(h, 0);
    expect_store(j, "recent", "[0,1,2,3,4]");
    free(j);
    /* A view that does not extend the tracked tokens is refused. */
    const uint32_t tokens[1] = {4}, pos[4] = {0, 1, 2, 3};
    const uint32_t *positions[1] = {pos};
    const uint8_t tier[4] = {0};
    const uint8_t *tiers[1] = {tier};
    uint8_t out[4];
    uint8_t *outs[1] = {out};
    policy_layer_view view = {0, 1, tokens, positions, tiers, 4, 3};
    policy_decision dec = {.tier = outs};
    const policy_ops *ops = policy_host_ops(h);
    assert_int_equal(ops->step(policy_host_state(h), &view, &st, &dec, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not extend the 5 tokens"));
    const uint32_t tokens6[1] = {6}, pos6[6] = {0, 1, 2, 4, 5, 6};
    const uint32_t *positions6[1] = {pos6};
    view.tokens = tokens6;
    view.positions = positions6;
    assert_int_equal(ops->step(policy_host_state(h), &view, &st, &dec, err, sizeof err), -1);
    assert_non_null(strstr(err, "does not extend"));
    policy_host_destroy(h);
}

static void test_daemon_keeping_tokens_full(void **unused)
{
    (void)unused;
    /* A daemon that cannot sketch yet applies SKETCH as FULL (kvstashd's
     * layer_apply until the tiers land). The policy carries on from its own
     * stores: T-KR2 gives the same stores, and each decision still says
     * SKETCH for the Vague tokens. */
    const char *keys[] = {"budget", "vague_share", "candidate_share", "recent_share", "slack"};
    const char *values[] = {"10", "0.6", "0.2", "0.2", "1"};
    policy_host *h = host_new(keys, values, 5, &geom1);
    const policy_decision *d = NULL;
    for (uint32_t t = 0; t < 7; t++) {
        float score[7] = {0};
        score[t] = KR2_SCORE[t];
        if (t == 6)
            score[1] = 0.50f;
        d = host_step(h, 1, score);
        if (t < 6)
            for (uint32_t i = 0; i <= t; i++)
                d->tier[0][i] = POLICY_FULL;
        assert_int_equal(policy_host_commit(h, 0), 0);
    }
    for (uint32_t i = 0; i < 7; i++)
        assert_int_equal(policy_host_view(h, 0)->tier[0][i],
                         i == 2 || i == 3 ? POLICY_SKETCH : POLICY_FULL);
    char *j = describe(h, 0);
    expect_store(j, "candidate", "[0,1]");
    expect_store(j, "vague", "[2,3]");
    free(j);
    policy_host_destroy(h);
}

/* ---- properties through the host ---- */

/* §3.5 transcribed literally with linear scans: the oracle for the heaps. */
static size_t naive_compress(const reviver_budgets *b, uint32_t n, uint32_t nnew, const double *s,
                             uint8_t *loc, reviver_op *ops)
{
    size_t nops = 0;
    uint32_t cnt[3] = {0, 0, 0};
    for (uint32_t i = n - nnew; i < n; i++)
        loc[i] = REVIVER_RECENT;
    for (uint32_t i = 0; i < n; i++)
        cnt[loc[i]]++;
    if (cnt[REVIVER_RECENT] > b->recent + b->slack) {
        uint32_t move = cnt[REVIVER_RECENT] - b->recent;
        for (uint32_t i = 0; i < n && move > 0; i++)
            if (loc[i] == REVIVER_RECENT) {
                loc[i] = REVIVER_CANDIDATE;
                move--;
                cnt[REVIVER_RECENT]--;
                cnt[REVIVER_CANDIDATE]++;
            }
    }
    for (;;) {
        uint32_t jc = UINT32_MAX, jv = UINT32_MAX;
        for (uint32_t i = 0; i < n; i++) {
            if (loc[i] == REVIVER_CANDIDATE && (jc == UINT32_MAX || s[i] < s[jc]))
                jc = i;
            if (loc[i] == REVIVER_VAGUE && (jv == UINT32_MAX || s[i] > s[jv]))
                jv = i;
        }
        if (cnt[REVIVER_CANDIDATE] > b->candidate) {
            loc[jc] = REVIVER_VAGUE;
            ops[nops++] = (reviver_op){jc, REVIVER_OP_SKETCH};
            cnt[REVIVER_CANDIDATE]--;
            cnt[REVIVER_VAGUE]++;
            continue;
        }
        break;
    }
    uint32_t guard = cnt[REVIVER_CANDIDATE] + cnt[REVIVER_VAGUE];
    while (cnt[REVIVER_CANDIDATE] > 0 && cnt[REVIVER_VAGUE] > 0 && guard-- > 0) {
        uint32_t jc = UINT32_MAX, jv = UINT32_MAX;
        for (uint32_t i = 0; i < n; i++) {
            if (loc[i] == REVIVER_CANDIDATE && (jc == UINT32_MAX || s[i] < s[jc]))
                jc = i;
            if (loc[i] == REVIVER_VAGUE && (jv == UINT32_MAX || s[i] > s[jv]))
                jv = i;
        }
        if (!(s[jc] * b->replace_rate < s[jv]))
            break;
        ops[nops++] = (reviver_op){jv, REVIVER_OP_REVIVE};
        ops[nops++] = (reviver_op){jc, REVIVER_OP_SKETCH};
        loc[jv] = REVIVER_CANDIDATE;
        loc[jc] = REVIVER_VAGUE;
    }
    return nops;
}

/*
 * reviver_compress on its own against the oracle, from random stores: steps
 * of a move or two (the sketch holds the least attended but a few, as in a
 * steady decode) and steps of dozens of pops and swaps both occur.
 */
static void test_compress_few_and_many_moves(void **unused)
{
    (void)unused;
    enum { N = 300 };
    double score[N];
    uint8_t loc[N], want_loc[N];
    uint32_t scratch[2 * N];
    reviver_op ops[N], want[N];
    rng_state = 99;
    uint32_t few = 0, many_pops = 0, many_swaps = 0;
    for (int trial = 0; trial < 400; trial++) {
        uint32_t n = 20 + rng() % (N - 20), nnew = 1 + rng() % 3;
        int ties = trial % 3 == 0;
        for (uint32_t i = 0; i < n; i++) {
            float u = rng_unit();
            score[i] = ties ? (double)(rng() % 5) : (double)(u * u * u);
            loc[i] = (uint8_t)(rng() % 3); /* RECENT, CANDIDATE or VAGUE */
            /* Odd trials: the sketch holds the least attended but a few,
             * as in a steady decode, so that few tokens swap. */
            if (trial % 2 && loc[i] == REVIVER_VAGUE && rng() % 64 != 0)
                score[i] = ties ? 0.0 : score[i] / 1024;
        }
        uint32_t cand = 0;
        for (uint32_t i = 0; i < n - nnew; i++)
            cand += loc[i] == REVIVER_CANDIDATE;
        /* C_b from "a few under |C|" to "many under": pops from 0 to dozens. */
        uint32_t under = trial % 2 ? rng() % 3 : rng() % 40;
        reviver_budgets b = {n, 0, cand > under ? cand - under : 0,
                             trial % 4 == 0 ? 1.0 : 1.0 + rng_unit()};
        memcpy(want_loc, loc, n);
        size_t nwant = naive_compress(&b, n, nnew, score, want_loc, want), nops;
        assert_int_equal(reviver_compress(&b, n, nnew, score, loc, scratch, ops, N, &nops), 0);
        assert_int_equal(nops, nwant);
        assert_memory_equal(loc, want_loc, n);
        uint32_t swaps = 0, pops = 0;
        for (size_t k = 0; k < nops; k++) {
            assert_int_equal(ops[k].index, want[k].index);
            assert_int_equal(ops[k].kind, want[k].kind);
            swaps += ops[k].kind == REVIVER_OP_REVIVE;
        }
        pops = (uint32_t)nops - 2 * swaps;
        few += pops + swaps > 0 && pops <= 2 && swaps <= 2;
        many_pops += pops > 8;
        many_swaps += swaps > 8;
    }
    assert_true(few >= 20);
    assert_true(many_pops >= 20);
    assert_true(many_swaps >= 20);
}

/* Run `steps` random steps on `layers` layers; compare with the oracle and
 * check the invariants. out[] (if not NULL) receives every decision's tiers
 * for the determinism check. Optionally simulates the daemon's sketch. */
static size_t run_random(uint64_t seed, const char *const *keys, const char *const *values,
                         size_t nkeys, reviver_budgets b, uint32_t layers, uint32_t steps,
                         uint8_t *out, size_t out_cap, int quantised)
{
    policy_geometry g = {layers, 4, 2, 4, 16, 10000.0f};
    policy_host *h = host_new(keys, values, nkeys, &g);
    rng_state = seed;
    uint32_t cap = 4096;
    double *acc = calloc((size_t)layers * cap, sizeof *acc);
    uint8_t *loc = calloc((size_t)layers * cap, 1);
    reviver_op *ops = calloc(cap, sizeof *ops);
    float *score = calloc(cap, sizeof *score);
    assert_true(acc && loc && ops && score);
    size_t written = 0;
    uint32_t n = 0, swaps = 0;
    for (uint32_t s = 0; s < steps; s++) {
        uint32_t nnew = s == 0 ? 1 + rng() % 40 : (rng() % 8 == 0 ? 1 + rng() % 6 : 1);
        assert_int_equal(policy_host_append(h, nnew), 0);
        n += nnew;
        assert_true(n <= cap);
        for (uint32_t l = 0; l < layers; l++) {
            for (uint32_t i = 0; i < n; i++) {
                /* quantised scores make ties common; else heavy-tailed */
                float u = rng_unit();
                score[i] = quantised ? (float)(rng() % 4) * 0.25f : u * u * u;
            }
            policy_stats st = {0};
            st.new_tokens = nnew;
            st.score = score;
            st.confidence = -1;
            const policy_decision *d;
            char err[POLICY_ERR_LEN] = "";
            if (policy_host_step(h, l, &st, &d, err, sizeof err) != 0)
                fail_msg("step: %s", err);
            /* the oracle */
            double *a = acc + (size_t)l * cap;
            uint8_t *lo = loc + (size_t)l * cap;
            for (uint32_t i = 0; i < n; i++)
                a[i] += (double)score[i];
            size_t nops = naive_compress(&b, n, nnew, a, lo, ops);
            size_t got_n;
            const reviver_op *got = reviver_layer_ops(policy_host_state(h), l, &got_n);
            assert_int_equal(got_n, nops);
            for (size_t k = 0; k < nops; k++) {
                assert_int_equal(got[k].index, ops[k].index);
                assert_int_equal(got[k].kind, ops[k].kind);
                swaps += ops[k].kind == REVIVER_OP_REVIVE;
            }
            uint32_t raw = 0;
            for (uint32_t i = 0; i < n; i++) {
                uint8_t want = lo[i] == REVIVER_VAGUE ? POLICY_SKETCH : POLICY_FULL;
                assert_int_equal(d->tier[0][i], want);
                raw += want == POLICY_FULL;
                if (i + b.recent >= n) /* the newest R_b are always raw */
                    assert_int_equal(want, POLICY_FULL);
                if (out != NULL) {
                    assert_true(written < out_cap);
                    out[written++] = d->tier[0][i];
                }
            }
            assert_true(raw <= b.recent + b.slack + b.candidate);
            assert_int_equal(policy_host_commit(h, l), 0); /* never evicts */
            assert_int_equal(policy_host_view(h, l)->tokens[0], n);
        }
    }
    assert_true(swaps > 0); /* the swap path was exercised */
    free(acc);
    free(loc);
    free(ops);
    free(score);
    policy_host_destroy(h);
    return written;
}

static void test_property_matches_oracle(void **unused)
{
    (void)unused;
    /* M = 40: R_b = int(.45·40) = 18, C_b = 18, slack min(32, 18) = 18. */
    const char *k1[] = {"budget"};
    const char *v1[] = {"40"};
    reviver_budgets b1 = {18, 18, 18, 1.1};
    for (uint64_t seed = 1; seed <= 4; seed++)
        run_random(seed, k1, v1, 1, b1, 2, 300, NULL, 0, 0);
    /* slack 0, RR 1.0, ties everywhere: M = 20, shares .2/.4/.4 -> R_b = 8, C_b = 8. */
    const char *k2[] = {"budget",      "slack",           "replace_rate",
                        "vague_share", "candidate_share", "recent_share"};
    const char *v2[] = {"20", "0", "1.0", "0.2", "0.4", "0.4"};
    reviver_budgets b2 = {8, 0, 8, 1.0};
    for (uint64_t seed = 10; seed <= 12; seed++)
        run_random(seed, k2, v2, 6, b2, 1, 300, NULL, 0, 1);
}

static void test_property_deterministic(void **unused)
{
    (void)unused;
    const char *k[] = {"budget"};
    const char *v[] = {"24"};
    reviver_budgets b = {10, 10, 10, 1.1};
    size_t cap = 1u << 20;
    uint8_t *a = malloc(cap), *c = malloc(cap);
    assert_true(a && c);
    size_t na = run_random(77, k, v, 1, b, 2, 200, a, cap, 0);
    size_t nc = run_random(77, k, v, 1, b, 2, 200, c, cap, 0);
    assert_int_equal(na, nc);
    assert_memory_equal(a, c, na);
    free(a);
    free(c);
}

static void test_property_daemon_simulation(void **unused)
{
    (void)unused;
    /* Apply each step's operations, in order, to a sketch the way the daemon
     * does (sketch: insert the token's K/V; revive: query, delete the
     * estimate, keep the estimate). With 2^16 buckets and 150 tokens no two
     * tokens share a bucket in two rows (checked below), so each median is
     * exact and every revived token gets its original K/V back, bit for bit. */
    enum { D = 4, NMAX = 160 };
    const char *k[] = {"budget", "buckets", "seed"};
    const char *v[] = {"20", "65536", "3"};
    policy_host *h = host_new(k, v, 3, &geom1);
    policy_sketch_geometry cfg;
    assert_int_equal(sketch_geometry(h, 0, &cfg), 0);
    assert_int_equal(cfg.rows, 3);
    static uint32_t hb_all[NMAX][3];
    int8_t g_unused[3];
    for (uint32_t j = 0; j < 150; j++) {
        kv_sketch_hash(cfg.layer_seed, 3, cfg.buckets, j, hb_all[j], g_unused);
        for (uint32_t i = 0; i < j; i++) {
            int shared = 0;
            for (uint32_t r = 0; r < 3; r++)
                shared += hb_all[i][r] == hb_all[j][r];
            assert_true(shared <= 1);
        }
    }
    kv_sketch sk = ph_sketch_new(cfg.rows, cfg.buckets, D, (kv_estimate)cfg.key_mean,
                                 (kv_estimate)cfg.value_mean);
    static float orig_k[NMAX][D], orig_v[NMAX][D], raw_k[NMAX][D], raw_v[NMAX][D];
    static uint8_t in_sketch[NMAX];
    float score[NMAX];
    rng_state = 5;
    uint32_t n = 0, revived = 0;
    while (n < 150) {
        for (uint32_t c = 0; c < D; c++) {
            orig_k[n][c] = raw_k[n][c] = rng_unit() - 0.5f;
            orig_v[n][c] = raw_v[n][c] = rng_unit() - 0.5f;
        }
        n++;
        for (uint32_t i = 0; i < n; i++) {
            float u = rng_unit();
            score[i] = u * u * u * u;
        }
        host_step(h, 1, score);
        size_t nops;
        const reviver_op *ops = reviver_layer_ops(policy_host_state(h), 0, &nops);
        for (size_t o = 0; o < nops; o++) {
            uint32_t j = ops[o].index;
            uint32_t hb[KV_SKETCH_MAX_ROWS];
            int8_t g[KV_SKETCH_MAX_ROWS];
            kv_sketch_hash(cfg.layer_seed, cfg.rows, cfg.buckets, j, hb, g);
            if (ops[o].kind == REVIVER_OP_SKETCH) {
                assert_false(in_sketch[j]);
                ph_sketch_insert(&sk, hb, g, raw_k[j], raw_v[j]);
                in_sketch[j] = 1;
            } else {
                assert_true(in_sketch[j]);
                ph_sketch_revive(&sk, hb, g, raw_k[j], raw_v[j]);
                assert_memory_equal(raw_k[j], orig_k[j], sizeof raw_k[j]);
                assert_memory_equal(raw_v[j], orig_v[j], sizeof raw_v[j]);
                in_sketch[j] = 0;
                revived++;
            }
        }
        policy_host_commit(h, 0);
        const policy_layer_view *view = policy_host_view(h, 0);
        for (uint32_t i = 0; i < n; i++)
            assert_int_equal(view->tier[0][i], in_sketch[i] ? POLICY_SKETCH : POLICY_FULL);
    }
    assert_true(revived > 0);
    ph_sketch_free(&sk);
    policy_host_destroy(h);
}

/* ---- moving a sequence (export_layer / import_layer) ---- */

/* Sketch and revive changes of one round (ph_round's append, statistics and
 * steps, drawn the same way), counted from each decision against the view
 * it was made on. reviver never evicts, so ph_round's count stays 0. */
typedef struct moves {
    size_t sketched, revived;
} moves;

static moves round_moves(policy_host *h, const policy_geometry *g, uint32_t n, int prefill,
                         uint64_t *rng)
{
    moves m = {0, 0};
    if (policy_host_append(h, n) != 0)
        fail_msg("append of %u failed", n);
    for (uint32_t l = 0; l < g->layers; l++) {
        ph_stats_buf b;
        ph_stats_random(h, l, g, n, prefill, rng, &b);
        const policy_decision *d = ph_decide(h, l, &b.st);
        const policy_layer_view *v = policy_host_view(h, l);
        for (uint32_t i = 0; i < v->tokens[0]; i++) {
            /* Older tokens may be INT8 (demote=int8) when they go. */
            m.sketched += v->tier[0][i] != POLICY_SKETCH && d->tier[0][i] == POLICY_SKETCH;
            m.revived += v->tier[0][i] == POLICY_SKETCH && d->tier[0][i] != POLICY_SKETCH;
        }
        assert_int_equal(policy_host_commit(h, l), 0); /* never evicts */
        ph_stats_free(&b);
    }
    return m;
}

/* Every layer of h exported, imported into a fresh state of the same
 * parameters and exported again gives the same bytes (import accepts
 * every state a step leaves, and reads back what export wrote). */
static void expect_reexport_equal(policy_host *h, const char *const *kv, policy_geometry g)
{
    policy_host *c = ph_host("reviver", kv, g);
    const policy_ops *ops = policy_host_ops(h);
    for (uint32_t l = 0; l < g.layers; l++) {
        size_t len, len2;
        uint8_t *buf = policy_host_export_state(h, l, &len);
        assert_non_null(buf);
        char err[POLICY_ERR_LEN] = "";
        if (ops->import_layer(policy_host_state(c), l, buf, len, err, sizeof err) != 0)
            fail_msg("layer %u's own state refused: %s", l, err);
        uint8_t *again = policy_host_export_state(c, l, &len2);
        assert_non_null(again);
        assert_int_equal(len, len2);
        assert_memory_equal(buf, again, len);
        free(buf), free(again);
    }
    policy_host_destroy(c);
}

/* The last step's operations and their order (tier_order) of a and b. */
static void expect_same_ops(policy_host *a, policy_host *b, uint32_t layers)
{
    const policy_ops *ops = policy_host_ops(a);
    for (uint32_t l = 0; l < layers; l++) {
        size_t na, nb, ta, tb;
        const reviver_op *oa = reviver_layer_ops(policy_host_state(a), l, &na);
        const reviver_op *ob = reviver_layer_ops(policy_host_state(b), l, &nb);
        assert_int_equal(na, nb);
        if (na > 0)
            assert_memory_equal(oa, ob, na * sizeof *oa);
        const uint32_t *xa = ops->tier_order(policy_host_state(a), l, &ta);
        const uint32_t *xb = ops->tier_order(policy_host_state(b), l, &tb);
        assert_int_equal(ta, tb);
        if (ta > 0)
            assert_memory_equal(xa, xb, ta * sizeof *xa);
    }
}

/*
 * ph_check_portable with what only reviver has: the same rounds, move
 * (ph_moved) and comparisons (ph_expect_same_hosts), plus the operation
 * logs and tier_order (the order the daemon applies sketch swaps in), and
 * every round's state of every layer re-imported byte for byte; sketch
 * and revive changes counted apart.
 */
static moves check_portable(const char *const *kv, policy_geometry g, uint32_t prefill,
                            uint32_t rounds, uint64_t seed)
{
    uint64_t rng = seed;
    policy_host *a = ph_host("reviver", kv, g);
    assert_true(policy_host_portable(a));
    round_moves(a, &g, prefill, 1, &rng);
    for (uint32_t r = 0; r < rounds; r++) {
        round_moves(a, &g, 1 + ph_below(&rng, 8), 0, &rng);
        expect_reexport_equal(a, kv, g);
    }
    policy_host *b = ph_moved(a, "reviver", kv, g);
    ph_expect_same_hosts(a, b, g, "after the move");
    expect_same_ops(a, b, g.layers);
    moves after = {0, 0};
    for (uint32_t r = 0; r < rounds; r++) {
        uint32_t n = 1 + ph_below(&rng, 8);
        uint64_t fork = rng;
        moves m = round_moves(a, &g, n, 0, &rng);
        round_moves(b, &g, n, 0, &fork);
        ph_expect_same_hosts(a, b, g, "stepping on after the move");
        expect_same_ops(a, b, g.layers);
        expect_reexport_equal(b, kv, g);
        after.sketched += m.sketched;
        after.revived += m.revived;
    }
    if (after.sketched == 0)
        fail_msg("nothing was sketched after the move: the check proves little");
    /* Truncated state is refused, with a reason. */
    size_t len;
    void *buf = policy_host_export_state(a, 0, &len);
    assert_non_null(buf);
    policy_host *c = ph_host("reviver", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_not_equal(
        policy_host_ops(c)->import_layer(policy_host_state(c), 0, buf, len - 1, err, sizeof err),
        0);
    assert_true(err[0] != '\0');
    free(buf);
    policy_host_destroy(c);
    policy_host_destroy(a);
    policy_host_destroy(b);
    return after;
}

static void test_moves_to_another_host(void **unused)
{
    (void)unused;
    /* Defaults but a small M: R_b = C_b = 18, slack 18, b = 1 (r = 3). */
    const char *kv1[] = {"budget=40", NULL};
    moves m1 = check_portable(kv1, ph_geom(3, 4, 2), 40, 30, 21);
    /* slack 0 (spill every step), RR 1.0, mean estimates, own seed and b. */
    const char *kv2[] = {"budget=20",
                         "slack=0",
                         "replace_rate=1.0",
                         "vague_share=0.2",
                         "candidate_share=0.4",
                         "recent_share=0.4",
                         "key_estimate=mean",
                         "value_estimate=mean",
                         "buckets=7",
                         "seed=99",
                         NULL};
    moves m2 = check_portable(kv2, ph_geom(2, 2, 1), 30, 40, 22);
    /* No Candidate (C_b = 0): every spilled token goes straight to the
     * sketch; a prefill under the budget; demotion on top. */
    const char *kv3[] = {"budget=16",
                         "candidate_share=0",
                         "recent_share=0.75",
                         "vague_share=0.25",
                         "demote=int8",
                         "int8_window=4",
                         NULL};
    moves m3 = check_portable(kv3, ph_geom(2, 2, 2), 5, 30, 23);
    ph_check_portable("reviver", kv1, ph_geom(3, 4, 2), 40, 30, 24); /* the generic property */
    /* The swap path ran after the move where a Candidate exists. */
    assert_true(m1.revived > 0);
    assert_true(m2.revived > 0);
    assert_int_equal(m3.revived, 0);
}

/* reviver.c's format, version 1: the offsets the cases below spoil. */
enum {
    RV_OFF_VERSION = 4,
    RV_OFF_LAYER = 5,
    RV_OFF_BUDGET = 13,
    RV_OFF_SLACK = 21,
    RV_OFF_RATE = 29,
    RV_OFF_SEED = 45,
    RV_OFF_KEY_EST = 53,
    RV_OFF_N = 55,
    RV_OFF_NOPS = 59,
    RV_HEAD = 63,
};

/* The index of the first token of store s in the exported bytes (n if none);
 * from: search from there. */
static uint32_t find_store(const uint8_t *b, uint32_t n, uint8_t s, uint32_t from)
{
    const uint8_t *loc = b + RV_HEAD + 12 * (size_t)n;
    uint32_t i = from;
    while (i < n && loc[i] != s)
        i++;
    return i;
}

/* import_layer checks the bytes rather than trusting them: each spoiled
 * copy is refused, names what is wrong and changes nothing. */
static void test_import_refuses_ph_spoil(void **unused)
{
    (void)unused;
    /* M = 20: R_b = 8, slack 0, C_b = 8, r = 1, b = 4. */
    const char *kv[] = {"budget=20",        "slack=0", "vague_share=0.2", "candidate_share=0.4",
                        "recent_share=0.4", "rows=1",  "buckets=4",       NULL};
    policy_geometry g = ph_geom(2, 2, 1);
    uint64_t r = 5;
    policy_host *a = ph_host("reviver", kv, g);
    round_moves(a, &g, 20, 1, &r);
    /* Step on until layer 1's last step revived something. */
    size_t nops = 0;
    const reviver_op *ops = NULL;
    int revive = 0;
    for (int k = 0; k < 200 && !revive; k++) {
        round_moves(a, &g, 1 + ph_below(&r, 3), 0, &r);
        ops = reviver_layer_ops(policy_host_state(a), 1, &nops);
        for (size_t i = 0; i < nops; i++)
            revive |= ops[i].kind == REVIVER_OP_REVIVE;
    }
    assert_true(revive);
    size_t len;
    uint8_t *good = policy_host_export_state(a, 1, &len);
    assert_non_null(good);
    uint32_t n = (uint32_t)policy_get_le(good + RV_OFF_N, 4);
    assert_int_equal((uint32_t)policy_get_le(good + RV_OFF_NOPS, 4), nops);
    assert_int_equal(len, RV_HEAD + 13 * (size_t)n + 5 * nops);
    assert_memory_equal(good, "rviv\1", 5);
    /* Into a host that holds layer 1's state already, so that "unchanged"
     * means something. */
    policy_host *c = ph_host("reviver", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(
        policy_host_ops(c)->import_layer(policy_host_state(c), 1, good, len, err, sizeof err), 0);
    size_t pos = RV_HEAD, score = pos + 4 * (size_t)n, loc = score + 8 * (size_t)n;
    size_t op_index = loc + n, op_kind = op_index + 4 * nops;
    /* Where the stores are: Recent is the tail; C and V are full. */
    uint32_t first_c = find_store(good, n, REVIVER_CANDIDATE, 0);
    uint32_t first_v = find_store(good, n, REVIVER_VAGUE, 0);
    uint32_t first_r = find_store(good, n, REVIVER_RECENT, 0);
    assert_true(first_c < n && first_v < n && first_r >= 1 && first_r + 2 <= n);
    assert_int_equal(n - first_r, 8); /* |R| = R_b: slack 0 */
    size_t first_revive = 0;
    while (ops[first_revive].kind != REVIVER_OP_REVIVE)
        first_revive++;
    const ph_spoil cases[] = {
        {"magic", 0, 1, 'R', 0, "magic"},
        {"version", RV_OFF_VERSION, 1, 2, 0, "version 2"},
        {"other budget", RV_OFF_BUDGET, 4, 21, 0, "budget 21"},
        {"other slack", RV_OFF_SLACK, 4, 1, 0, "slack 1"},
        {"other replace_rate", RV_OFF_RATE, 8, policy_f64_bits(1.5), 0, "replace_rate 1.5"},
        {"other seed", RV_OFF_SEED, 8, 7, 0, "seed 7"},
        {"other key_estimate", RV_OFF_KEY_EST, 1, 1, 0, "key_estimate 1"},
        {"count short of the length", RV_OFF_N, 4, n - 1, 0, "bytes"},
        {"more operations than tokens", RV_OFF_NOPS, 4, n + 1, 0, "operations for"},
        {"operations short of the length", RV_OFF_NOPS, 4, nops - 1, 0, "bytes"},
        {"trailing byte", 0, 0, 0, 1, "bytes"},
        {"cut short", 0, 0, 0, -1, "bytes"},
        {"header only", 0, 0, 0, -(int)(len - (RV_HEAD - 1)), "header"},
        {"NaN score", score, 8, 0x7ff8000000000000ull, 0, "finite"},
        {"infinite score", score + 8, 8, 0x7ff0000000000000ull, 0, "finite"},
        {"negative score", score + 16, 8, policy_f64_bits(-1.0), 0, ">= 0"},
        {"positions out of order", pos + 4, 4, (uint32_t)policy_get_le(good + pos, 4), 0, "ascend"},
        {"no such store", loc, 1, 3, 0, "store 3"},
        {"Recent not the newest", loc + n - 1, 1, REVIVER_VAGUE, 0, "newest"},
        {"Recent over R_b + slack", loc + first_r - 1, 1, REVIVER_RECENT, 0, "Recent holds 9"},
        {"Candidate over C_b", loc + first_v, 1, REVIVER_CANDIDATE, 0, "Candidate holds 9"},
        {"a swap left undone", score + 8 * (size_t)first_v, 8, policy_f64_bits(1e300), 0, "swap"},
        {"operation on no token", op_index, 4, n, 0, "indexes no token"},
        {"operation of no kind", op_kind, 1, 2, 0, "no kind"},
        {"a token moved twice", op_index + 4 * first_revive + 4, 4, ops[first_revive].index, 0,
         "second time"},
        {"an operation's token in the wrong store", op_index, 4, n - 1, 0, "other store"},
        {"operations out of order", op_kind + first_revive + 1, 1, REVIVER_OP_REVIVE, 0,
         "out of order"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ph_expect_refused(c, 1, good, len, &cases[i]);
    /* A revive without its sketch: the last operation dropped. */
    uint8_t *cut = malloc(len);
    assert_non_null(cut);
    memcpy(cut, good, op_index + 4 * (nops - 1));
    memcpy(cut + op_index + 4 * (nops - 1), good + op_kind, nops - 1);
    cut[RV_OFF_NOPS] = (uint8_t)(nops - 1); /* nops < 256 */
    ph_spoil unpaired = {"a revive without its sketch", 0, 0, 0, 0, "no sketch after it"};
    ph_expect_refused(c, 1, cut, len - 5, &unpaired);
    free(cut);
    /* Layer 1's bytes are not layer 0's; no layer 2. */
    ph_spoil other = {"another layer", 0, 0, 0, 0, "layer 1"};
    ph_expect_refused(c, 0, good, len, &other);
    char err2[POLICY_ERR_LEN] = "";
    assert_int_not_equal(
        policy_host_ops(c)->import_layer(policy_host_state(c), 2, good, len, err2, sizeof err2), 0);
    assert_non_null(strstr(err2, "layer 2 of 2"));
    /* And what it did accept is the original's state. */
    char *da = describe(a, 1), *dc = describe(c, 1);
    assert_string_equal(da, dc);
    free(da), free(dc);
    free(good);
    policy_host_destroy(a);
    policy_host_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kr1_cells),
        cmocka_unit_test(test_kr1_queries),
        cmocka_unit_test(test_kr1_delete_keeps_others),
        cmocka_unit_test(test_kr1_mean_variant),
        cmocka_unit_test(test_even_rows_lower_median),
        cmocka_unit_test(test_roundtrip_exact_sum),
        cmocka_unit_test(test_roundtrip_exact_mean),
        cmocka_unit_test(test_roundtrip_real_hash),
        cmocka_unit_test(test_kr2_compress_trace),
        cmocka_unit_test(test_kr2_prefill_cascade),
        cmocka_unit_test(test_compress_ties),
        cmocka_unit_test(test_compress_slack_zero_and_empty_c),
        cmocka_unit_test(test_kr2_through_host),
        cmocka_unit_test(test_defaults_and_derivation),
        cmocka_unit_test(test_invalid_configs),
        cmocka_unit_test(test_step_rejects_bad_stats),
        cmocka_unit_test(test_daemon_keeping_tokens_full),
        cmocka_unit_test(test_property_matches_oracle),
        cmocka_unit_test(test_compress_few_and_many_moves),
        cmocka_unit_test(test_property_deterministic),
        cmocka_unit_test(test_property_daemon_simulation),
        cmocka_unit_test(test_moves_to_another_host),
        cmocka_unit_test(test_import_refuses_ph_spoil),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
