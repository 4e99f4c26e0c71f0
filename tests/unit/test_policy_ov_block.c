/*
 * test_policy_ov_block.c - policy "ov_block" (policies/ov_block.c):
 * OpenVINO GenAI token eviction, POLICIES.md §2.
 *
 * The §2.10 vectors T-OV1 (SUM, NORM_SUM, the rotation list), T-OV2
 * (KVCrush MEAN) and T-OV3 (rotation math) run through the pure functions of
 * ov_block.h, through the replay state operations, and through the policy
 * host the way the daemon drives the policy. Then the §2.3 registration and
 * counter rules, the forward max-pool, the tie rule, every KVCrush anchor,
 * the rotation plan bounds, invalid configurations, and seeded property
 * tests through the host (occupancy bound, protected areas, determinism),
 * and moving a sequence (export/import of the layer state round-trips and
 * decides as the original; import refuses spoiled bytes without a change).
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

#include "ov_block.h"
#include "policy_harness.h"
#include "util.h"

#define EPS 1e-4

/* ---- helpers ---- */

static policy_geometry geom(uint32_t layers, uint32_t B)
{
    policy_geometry g = {.layers = layers,
                         .q_heads = 4,
                         .kv_heads = 2,
                         .head_dim = 4,
                         .block_tokens = B,
                         .rope_theta = 10000.0f};
    return g;
}

static policy_host *new_host(const char *const *kv, uint32_t layers, uint32_t B)
{
    return ph_host("ov_block", kv, geom(layers, B));
}

static ov_block *state(policy_host *h)
{
    return policy_host_state(h);
}

/* Register the same vector on every layer; returns the status. */
static ov_reg_status reg(ov_block *st, const double *v, size_t n, uint32_t nsnap)
{
    const double *s[4] = {v, v, v, v};
    size_t ns[4] = {n, n, n, n};
    char err[POLICY_ERR_LEN] = "";
    ov_reg_status status;
    assert_true(ov_block_layers(st) <= 4);
    if (ov_block_register(st, s, ns, nsnap, &status, err, sizeof err) != 0)
        fail_msg("register: %s", err);
    return status;
}

static size_t evict(ov_block *st, uint32_t layer, uint32_t *out)
{
    uint32_t *b = NULL;
    size_t n = 0;
    char err[POLICY_ERR_LEN] = "";
    if (ov_block_evict(st, layer, &b, &n, err, sizeof err) != 0)
        fail_msg("evict: %s", err);
    if (n > 0)
        memcpy(out, b, n * sizeof *b);
    free(b);
    return n;
}

static void assert_acc(ov_block *st, uint32_t layer, const double *want, size_t n)
{
    assert_int_equal(ov_block_tracked(st, layer), n);
    const double *acc = ov_block_scores(st, layer);
    for (size_t i = 0; i < n; i++)
        if (fabs(acc[i] - want[i]) > 1e-12)
            fail_msg("layer %u acc[%zu] = %.17g, want %.17g", layer, i, acc[i], want[i]);
}

static void assert_cnt(ov_block *st, uint32_t layer, const uint64_t *want, size_t n)
{
    assert_int_equal(ov_block_tracked(st, layer), n);
    const uint64_t *c = ov_block_counters(st, layer);
    assert_non_null(c);
    for (size_t i = 0; i < n; i++)
        if (c[i] != want[i])
            fail_msg("layer %u cnt[%zu] = %llu, want %llu", layer, i, (unsigned long long)c[i],
                     (unsigned long long)want[i]);
}

/* Uniform in [0, 1) from the harness's seeded stream (53 bits). */
static double urand(uint64_t *s)
{
    return (double)(ph_rand(s) >> 11) / 9007199254740992.0;
}

/* ---- mt19937 ---- */

static void test_mt19937_reference(void **unused)
{
    (void)unused;
    ov_mt19937 r;
    /* C++ [rand.predef]: the 10000th output of a default-seeded mt19937. */
    ov_mt19937_seed(&r, 5489u);
    assert_int_equal(ov_mt19937_next(&r), 3499211612u);
    for (int i = 2; i < 10000; i++)
        ov_mt19937_next(&r);
    assert_int_equal(ov_mt19937_next(&r), 4123659995u);
    ov_mt19937_seed(&r, 0u); /* kvcrush_seed's default */
    assert_int_equal(ov_mt19937_next(&r), 2357136044u);
    assert_int_equal(ov_mt19937_next(&r), 2546248239u);
}

/* ---- forward max-pool (§2.3, §6 #4) ---- */

static void test_maxpool_forward_shrinking_tail(void **unused)
{
    (void)unused;
    const double x[] = {1, 3, 2, 5, 4, 0.5};
    double y[6];
    size_t dq[6];
    ov_fwd_maxpool(x, 6, 2, y, dq);
    const double w2[] = {3, 3, 5, 5, 4, 0.5}; /* forward, not centred: y[5] sees only x[5] */
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == w2[i]);
    ov_fwd_maxpool(x, 6, 3, y, dq);
    const double w3[] = {3, 5, 5, 5, 4, 0.5};
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == w3[i]);
    ov_fwd_maxpool(x, 6, 7, y, dq); /* the default window, longer than the vector */
    const double w7[] = {5, 5, 5, 5, 4, 0.5};
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == w7[i]);
    ov_fwd_maxpool(x, 6, 1, y, dq);
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == x[i]);
    ov_fwd_maxpool(x, 6, 0, y, dq);
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == x[i]);
}

static void test_maxpool_matches_naive(void **unused)
{
    (void)unused;
    uint64_t s = 42;
    static double x[2000], y[2000];
    static size_t dq[2000];
    for (int trial = 0; trial < 600; trial++) {
        /* Windows up to 64 take doubling spans (in blocks of 512 outputs),
         * longer ones the deque. */
        size_t n = 1 + ph_rand(&s) % (trial % 2 ? 200 : 2000), w = ph_rand(&s) % 80;
        /* Few distinct values, so ties are common, and both zeros: the
         * first of a window's maxima is the one that stays, to the bit. */
        for (size_t i = 0; i < n; i++) {
            uint64_t r = ph_rand(&s) % 6;
            x[i] = r == 5 ? -0.0 : (double)r;
        }
        ov_fwd_maxpool(x, n, w, y, dq);
        for (size_t i = 0; i < n; i++) {
            double m = x[i];
            size_t end = w <= 1 ? i + 1 : (i + w < n ? i + w : n);
            for (size_t j = i; j < end; j++)
                m = x[j] > m ? x[j] : m;
            if (memcmp(&y[i], &m, sizeof m) != 0)
                fail_msg("n=%zu w=%zu y[%zu]=%g want %g", n, w, i, y[i], m);
        }
    }
}

/* ---- counters (§2.3) ---- */

static void test_counter_formula(void **unused)
{
    (void)unused;
    /* No window: [n, n-1, ..., 1]. */
    for (size_t i = 0; i < 5; i++)
        assert_int_equal(ov_counter(i, 5, 5), 5 - i);
    /* Window of 3 over 6 tokens: [3,3,3] ++ [3,2,1]. */
    const uint64_t w[] = {3, 3, 3, 3, 2, 1};
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(ov_counter(i, 6, 3), w[i]);
    /* [RECON] fewer tokens than window queries: [n, ..., 1]. */
    assert_int_equal(ov_counter(0, 2, 8), 2);
    assert_int_equal(ov_counter(1, 2, 8), 1);
}

/* ---- T-OV1 (§2.10) ---- */

static const double tov1[11] = {5, 5, 0.4, 0.4, 0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7};

static const char *const tov1_norm[] = {"start_size=2",      "recent_size=2",   "max_cache_size=8",
                                        "max_pool_window=1", "snapkv_window=0", NULL};
static const char *const tov1_sum[] = {"start_size=2",
                                       "recent_size=2",
                                       "max_cache_size=8",
                                       "max_pool_window=1",
                                       "snapkv_window=0",
                                       "aggregation=sum",
                                       NULL};

static void test_tov1_norm_sum(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 2, 2);
    ov_block *st = state(h);
    assert_int_equal(reg(st, tov1, 11, 0), OV_REG_DONE);
    const uint64_t cnt[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, cnt, 9);
    assert_acc(st, 0, tov1 + 2, 9);
    /* The block scores of the evictable range [1, 4). */
    double bs[3];
    ov_score_blocks(ov_block_scores(st, 0), ov_block_counters(st, 0), 0, 3, 2, bs);
    assert_float_equal(bs[0], 0.09444, EPS);
    assert_float_equal(bs[1], 0.26190, EPS);
    assert_float_equal(bs[2], 0.13500, EPS);
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t v[8];
        assert_int_equal(evict(st, l, v), 1);
        assert_int_equal(v[0], 1); /* evict block 1 */
        const double rest[7] = {0.9, 0.8, 0.3, 0.3, 0.6, 0.5, 0.7};
        assert_acc(st, l, rest, 7);
        const uint64_t rcnt[7] = {7, 6, 5, 4, 3, 2, 1};
        assert_cnt(st, l, rcnt, 7);
    }
    /* Now at start + 7 = 9 = cap: nothing more to evict. */
    uint32_t v[8];
    assert_int_equal(evict(st, 0, v), 0);
    policy_host_destroy(h);
}

static void test_tov1_sum(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_sum, 1, 2);
    ov_block *st = state(h);
    reg(st, tov1, 11, 0);
    assert_null(ov_block_counters(st, 0));
    double bs[3];
    ov_score_blocks(ov_block_scores(st, 0), NULL, 0, 3, 2, bs);
    assert_float_equal(bs[0], 0.8, EPS);
    assert_float_equal(bs[1], 1.7, EPS);
    assert_float_equal(bs[2], 0.6, EPS);
    uint32_t v[8];
    assert_int_equal(evict(st, 0, v), 1);
    assert_int_equal(v[0], 3); /* evict block 3 */
    const double rest[7] = {0.4, 0.4, 0.9, 0.8, 0.6, 0.5, 0.7};
    assert_acc(st, 0, rest, 7);
    policy_host_destroy(h);
}

/* save() keeps the layer's buffers instead of copying them (policy.h):
 * an eviction that writes them in place, with no registration between,
 * must copy them first, or the restore puts back the compacted layer. */
static void test_saved_layer_survives_an_eviction(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_sum, 1, 2);
    ov_block *st = state(h);
    reg(st, tov1, 11, 0);
    const policy_ops *ops = ph_ops("ov_block");
    size_t n = ov_block_tracked(st, 0);
    double before[16];
    memcpy(before, ov_block_scores(st, 0), n * sizeof *before);
    void *saved = NULL;
    assert_int_equal(ops->save(st, 0, &saved), 0);
    uint32_t v[8];
    assert_int_equal(evict(st, 0, v), 1);
    assert_int_equal(ov_block_tracked(st, 0), n - 2);
    ops->restore(st, 0, saved);
    assert_acc(st, 0, before, n);
    /* And a copy that was not needed gives its buffers back. */
    assert_int_equal(ops->save(st, 0, &saved), 0);
    assert_int_equal(evict(st, 0, v), 1);
    ops->discard(saved);
    const double rest[7] = {0.4, 0.4, 0.9, 0.8, 0.6, 0.5, 0.7};
    assert_acc(st, 0, rest, 7);
    policy_host_destroy(h);
}

/* The counters are offsets from one shift (ov_block.c ov_layer), moved by a
 * registration's growth: a saved layer's counters come back after a
 * registration that moved the shift and appended, and after an eviction
 * that compacted them in a copy; a discarded copy leaves the new ones. */
static void test_saved_counters_survive_growth_and_eviction(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    ov_block *st = state(h);
    const policy_ops *ops = ph_ops("ov_block");
    double v[16];
    for (int i = 0; i < 16; i++)
        v[i] = 0.05 * ((i * 7) % 11 + 1);
    reg(st, v, 9, 0);
    const uint64_t c7[7] = {7, 6, 5, 4, 3, 2, 1};
    const uint64_t c10[10] = {10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
    const uint64_t c11[11] = {11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, c7, 7);
    void *saved = NULL;
    assert_int_equal(ops->save(st, 0, &saved), 0);
    assert_int_equal(reg(st, v, 12, 0), OV_REG_DONE);
    assert_cnt(st, 0, c10, 10);
    uint32_t b[8];
    size_t nb = evict(st, 0, b);
    assert_true(nb >= 1);
    assert_int_equal(ov_block_tracked(st, 0), 10 - 2 * nb);
    ops->restore(st, 0, saved);
    assert_cnt(st, 0, c7, 7);
    /* Growth again from the restored counters, then a discarded copy. */
    assert_int_equal(ops->save(st, 0, &saved), 0);
    assert_int_equal(reg(st, v, 12, 0), OV_REG_DONE);
    ops->discard(saved);
    assert_cnt(st, 0, c10, 10);
    assert_int_equal(reg(st, v, 13, 0), OV_REG_DONE);
    assert_cnt(st, 0, c11, 11);
    policy_host_destroy(h);
}

static void test_tov1_rotation_list(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    ov_block *st = state(h);
    reg(st, tov1, 11, 0);
    uint32_t v[8];
    assert_int_equal(evict(st, 0, v), 1);
    ov_rotation *r = NULL;
    size_t n = 0;
    char err[POLICY_ERR_LEN] = "";
    /* 11 tokens = 6 logical blocks before eviction. */
    assert_int_equal(ov_block_rotation(st, v, 1, 6, &r, &n, err, sizeof err), 0);
    assert_int_equal(n, 4);
    assert_int_equal(ov_block_head_size(st), 4); /* head_size 0 -> head_dim */
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(r[i].block, i + 1);
        assert_int_equal(r[i].delta, 2);
        /* d = 4: theta = 1, 0.01; row for delta 2. */
        assert_float_equal(r[i].cos_row[0], cos(2.0), 1e-12);
        assert_float_equal(r[i].sin_row[0], -sin(2.0), 1e-12);
        assert_float_equal(r[i].cos_row[1], cos(0.02), 1e-12);
        assert_float_equal(r[i].sin_row[1], -sin(0.02), 1e-12);
    }
    free(r);
    policy_host_destroy(h);
}

/* T-OV1 through the host, the daemon's path: float scores, one decode step. */
static void host_tov1(const char *const *kv, uint32_t expect_first_evicted_pos)
{
    policy_host *h = new_host(kv, 2, 2);
    assert_int_equal(policy_host_append(h, 11), 0);
    float s[11];
    for (int i = 0; i < 11; i++)
        s[i] = (float)tov1[i];
    policy_stats stats = {
        .new_tokens = 11, .prefill = 0, .score = s, .score_queries = 11, .confidence = -1};
    for (uint32_t l = 0; l < 2; l++) {
        const policy_decision *d = NULL;
        char err[POLICY_ERR_LEN] = "";
        if (policy_host_step(h, l, &stats, &d, err, sizeof err) != 0)
            fail_msg("step: %s", err);
        for (uint32_t i = 0; i < 11; i++) {
            int gone = i == expect_first_evicted_pos || i == expect_first_evicted_pos + 1;
            assert_int_equal(d->tier[0][i] == POLICY_EVICT, gone);
        }
        assert_int_equal(d->rerotate_keys, 0);
        assert_int_equal(policy_host_commit(h, l), 2);
        assert_int_equal(policy_host_view(h, l)->tokens[0], 9);
        assert_int_equal(ov_block_tracked(state(h), l), 7);
    }
    policy_host_destroy(h);
}

static void test_tov1_through_host(void **unused)
{
    (void)unused;
    host_tov1(tov1_norm, 2); /* block 1 = positions 2, 3 */
    host_tov1(tov1_sum, 6);  /* block 3 = positions 6, 7 */
}

static void test_tov1_prefill_never_evicts(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    assert_int_equal(policy_host_append(h, 11), 0);
    float s[11];
    for (int i = 0; i < 11; i++)
        s[i] = (float)tov1[i];
    policy_stats stats = {.new_tokens = 11, .prefill = 1, .score = s, .score_queries = 11};
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), 0);
    assert_int_equal(policy_host_commit(h, 0), 0);
    assert_int_equal(ov_block_tracked(state(h), 0), 9);
    policy_host_destroy(h);
}

static void test_rerotate_flag(void **unused)
{
    (void)unused;
    const char *const kv[] = {"start_size=2",
                              "recent_size=2",
                              "max_cache_size=8",
                              "max_pool_window=1",
                              "snapkv_window=0",
                              "apply_rotation=1",
                              NULL};
    policy_host *h = new_host(kv, 1, 2);
    assert_int_equal(policy_host_append(h, 11), 0);
    float s[11];
    for (int i = 0; i < 11; i++)
        s[i] = (float)tov1[i];
    policy_stats stats = {.new_tokens = 11, .prefill = 0, .score = s, .score_queries = 11};
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), 0);
    assert_int_equal(d->rerotate_keys, 1);
    policy_host_commit(h, 0);
    /* A step that evicts nothing asks for no rotation. */
    assert_int_equal(policy_host_append(h, 0), 0);
    stats.new_tokens = 0;
    stats.score_queries = 1;
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), 0);
    assert_int_equal(d->rerotate_keys, 0);
    policy_host_destroy(h);
}

/* ---- T-OV2 (§2.10) ---- */

static const double tov2[15] = {7,    7,    0.9, 0.1,  0.2, 0.75, 0.3, 0.35,
                                0.05, 0.62, 0.4, 0.15, 1,   1,    1};

/* NORM_SUM's block scores as specified (ov_block.h): each quotient by the
 * counter converted as C converts it, summed in t order, bit for bit; with
 * counters of every size (past 2^53 a conversion rounds), a shift that
 * wraps them, blocks of 1 to 40, lists across the chunks of quotients. */
static void test_block_scores_as_specified(void **unused)
{
    (void)unused;
    enum { MAXN = 5000 };
    double *acc = malloc(MAXN * sizeof *acc), *bs = malloc(MAXN * sizeof *bs);
    uint64_t *cnt = malloc(MAXN * sizeof *cnt);
    assert_true(acc && bs && cnt);
    uint64_t s = 12345;
    for (int trial = 0; trial < 300; trial++) {
        uint32_t B = 1 + (uint32_t)(ph_rand(&s) % 40);
        size_t nblocks = 1 + ph_rand(&s) % (MAXN / B);
        uint64_t shift = trial % 3 == 0 ? 0 : ph_rand(&s);
        for (size_t i = 0; i < nblocks * B; i++) {
            acc[i] = urand(&s) * ldexp(1.0, (int)(ph_rand(&s) % 40) - 20);
            uint64_t r = ph_rand(&s);
            int bits = (int)(r % 65);
            uint64_t c = bits == 64 ? ph_rand(&s) : ph_rand(&s) & ((UINT64_C(1) << bits) - 1);
            cnt[i] = c - shift; /* the counter c[i] = cnt[i] + shift is c */
            if (c == 0)
                cnt[i] += 1; /* a counter of 0 is never stored (the division) */
        }
        ov_score_blocks(acc, cnt, shift, nblocks, B, bs);
        for (size_t j = 0; j < nblocks; j++) {
            double want = 0.0;
            for (uint32_t t = 0; t < B; t++) {
                size_t i = j * B + t;
                want += acc[i] / (double)(cnt[i] + shift);
            }
            if (memcmp(&want, &bs[j], sizeof want) != 0)
                fail_msg("trial %d, B %u, block %zu: %a, want %a", trial, B, j, bs[j], want);
        }
    }
    free(acc);
    free(bs);
    free(cnt);
}

static void test_tov2_pieces(void **unused)
{
    (void)unused;
    const double *acc = tov2 + 2;
    double bs[5];
    ov_score_blocks(acc, NULL, 0, 5, 2, bs);
    const double want_bs[5] = {1.0, 0.95, 0.65, 0.67, 0.55};
    for (int j = 0; j < 5; j++)
        assert_float_equal(bs[j], want_bs[j], EPS);
    uint32_t v[4];
    assert_int_equal(ov_select_lowest(bs, 5, 4, v), 0);
    const uint32_t want_v[4] = {1, 2, 3, 4};
    for (int i = 0; i < 4; i++)
        assert_int_equal(v[i], want_v[i]);
    uint8_t ind[10], anchor[2];
    assert_int_equal(ov_kvcrush_indicators(acc, 10, ind), 0);
    const uint8_t want_ind[10] = {1, 0, 0, 1, 0, 1, 0, 1, 1, 0};
    for (int i = 0; i < 10; i++)
        assert_int_equal(ind[i], want_ind[i]);
    ov_kvcrush_anchor(OV_ANCHOR_MEAN, ind, 5, 2, NULL, anchor);
    assert_int_equal(anchor[0], 0); /* 2/5 = 0.4 */
    assert_int_equal(anchor[1], 1); /* 3/5 = 0.6 */
    uint32_t keep[2];
    size_t nk = 0;
    assert_int_equal(ov_kvcrush_retain(acc, 5, 2, v, 4, 2, OV_ANCHOR_MEAN, NULL, keep, &nk), 0);
    assert_int_equal(nk, 2); /* distances [2,0,0,0,2]: E = [1,2,3,4], step 2 */
    assert_int_equal(keep[0], 1);
    assert_int_equal(keep[1], 3);
}

static void test_tov2_evict(void **unused)
{
    (void)unused;
    const char *const kv[] = {"start_size=2",      "recent_size=2",       "max_cache_size=6",
                              "max_pool_window=1", "snapkv_window=0",     "aggregation=sum",
                              "kvcrush_budget=2",  "kvcrush_anchor=mean", NULL};
    policy_host *h = new_host(kv, 2, 2);
    ov_block *st = state(h);
    reg(st, tov2, 15, 0);
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t v[8];
        assert_int_equal(evict(st, l, v), 2);
        assert_int_equal(v[0], 3);
        assert_int_equal(v[1], 5);
        /* Kept relative blocks 0, 1, 3 and the tail. */
        const double rest[9] = {0.9, 0.1, 0.2, 0.75, 0.05, 0.62, 1, 1, 1};
        assert_acc(st, l, rest, 9);
    }
    policy_host_destroy(h);

    /* Without KVCrush the same vector evicts all four victims. */
    const char *const plain[] = {"start_size=2",
                                 "recent_size=2",
                                 "max_cache_size=6",
                                 "max_pool_window=1",
                                 "snapkv_window=0",
                                 "aggregation=sum",
                                 NULL};
    h = new_host(plain, 1, 2);
    reg(state(h), tov2, 15, 0);
    uint32_t v[8];
    assert_int_equal(evict(state(h), 0, v), 4);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(v[i], i + 2);
    policy_host_destroy(h);
}

/* ---- T-OV3 (§2.10): rotation math ---- */

/* HF RoPE (rotate-half) of k at position pos. */
static void rope(const double *k, double *out, uint32_t d, double pos, double theta)
{
    uint32_t h = d / 2;
    for (uint32_t j = 0; j < h; j++) {
        double a = pos * pow(theta, -2.0 * j / d);
        out[j] = k[j] * cos(a) - k[j + h] * sin(a);
        out[j + h] = k[j + h] * cos(a) + k[j] * sin(a);
    }
}

/* Rotate one key in place with a coefficient row (rotate-half pairs), in
 * double, as OpenVINO's cache manager applies ov_rotation_row's table:
 * k[j] = x*cos - y*sin, k[j+d/2] = x*sin + y*cos. */
static void apply_row(double *k, uint32_t d, const double *sin_row, const double *cos_row)
{
    uint32_t h = d / 2;
    for (uint32_t j = 0; j < h; j++) {
        double x = k[j], y = k[j + h];
        k[j] = x * cos_row[j] - y * sin_row[j];
        k[j + h] = x * sin_row[j] + y * cos_row[j];
    }
}

static void test_tov3_rotation_math(void **unused)
{
    (void)unused;
    const double k[4] = {1, 2, 3, 4};
    double at5[4], at3[4];
    rope(k, at5, 4, 5, 10000);
    const double want5[4] = {3.160435, 1.797584, -0.107938, 4.094959};
    for (int i = 0; i < 4; i++)
        assert_float_equal(at5[i], want5[i], 1e-5);
    /* The daemon's re-rotation (the kernels' reference, fp32) by -2. */
    float key[4];
    for (int i = 0; i < 4; i++)
        key[i] = (float)at5[i];
    ph_rope_rerotate(key, 4, -2, 10000, KV_ROPE_HALF);
    /* OpenVINO's coefficient row for delta 2, applied as its cache manager does. */
    double s[2], c[2];
    ov_rotation_row(2, 4, 10000, s, c);
    apply_row(at5, 4, s, c);
    const double want3[4] = {-1.413353, 1.879118, -2.828857, 4.058191};
    rope(k, at3, 4, 3, 10000);
    for (int i = 0; i < 4; i++) {
        assert_float_equal(at5[i], want3[i], 1e-5);
        assert_float_equal(at5[i], at3[i], 1e-5);
        assert_float_equal(key[i], want3[i], 1e-5);
    }
}

static void test_rotation_random_keys(void **unused)
{
    (void)unused;
    uint64_t seed = 7;
    for (int trial = 0; trial < 50; trial++) {
        uint32_t d = 2 * (1 + (uint32_t)(ph_rand(&seed) % 64));
        double theta = trial % 2 ? 10000.0 : 500000.0;
        double k[128], a[128], b[128], s[64], c[64];
        for (uint32_t i = 0; i < d; i++)
            k[i] = urand(&seed) * 2 - 1;
        uint32_t pos = (uint32_t)(ph_rand(&seed) % 4096),
                 delta = (uint32_t)(ph_rand(&seed) % (pos + 1));
        rope(k, a, d, pos, theta);
        float key[128];
        for (uint32_t i = 0; i < d; i++)
            key[i] = (float)a[i];
        ov_rotation_row(delta, d, theta, s, c);
        apply_row(a, d, s, c);
        ph_rope_rerotate(key, d, -(int32_t)delta, theta, KV_ROPE_HALF);
        rope(k, b, d, pos - delta, theta);
        for (uint32_t i = 0; i < d; i++) {
            assert_float_equal(a[i], b[i], 1e-9);
            assert_float_equal(key[i], b[i], 1e-5); /* fp32 keys and coefficients */
        }
    }
}

static void test_rotation_plan(void **unused)
{
    (void)unused;
    ov_rotation_step out[16];
    size_t n = 0;
    char err[POLICY_ERR_LEN] = "";
    /* Blocks before the first evicted block do not move. */
    const uint32_t e1[] = {3, 5};
    assert_int_equal(ov_rotation_plan(e1, 2, 8, 9, out, &n, err, sizeof err), 0);
    assert_int_equal(n, 3); /* 4 -> 3 (1), 6 -> 4 (2), 7 -> 5 (2) */
    assert_int_equal(out[0].block, 3);
    assert_int_equal(out[0].shift, 1);
    assert_int_equal(out[1].block, 4);
    assert_int_equal(out[1].shift, 2);
    assert_int_equal(out[2].block, 5);
    assert_int_equal(out[2].shift, 2);
    /* Evicting the tail moves nothing; nothing evicted moves nothing. */
    const uint32_t e2[] = {7};
    assert_int_equal(ov_rotation_plan(e2, 1, 8, 9, out, &n, err, sizeof err), 0);
    assert_int_equal(n, 0);
    assert_int_equal(ov_rotation_plan(NULL, 0, 8, 9, out, &n, err, sizeof err), 0);
    assert_int_equal(n, 0);
    /* An evicted block outside the sequence. */
    const uint32_t e3[] = {2, 8};
    assert_int_equal(ov_rotation_plan(e3, 2, 8, 9, out, &n, err, sizeof err), -1);
    assert_non_null(strstr(err, "block 8"));
    /* §6 #6: shift must be < Nmax (the reference allowed shift == Nmax). */
    assert_int_equal(ov_rotation_plan(e1, 2, 8, 3, out, &n, err, sizeof err), 0);
    assert_int_equal(ov_rotation_plan(e1, 2, 8, 2, out, &n, err, sizeof err), -1);
    assert_non_null(strstr(err, "shift of 2"));
}

static void test_rotation_state_errors(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    ov_rotation *r = NULL;
    size_t n = 9;
    char err[POLICY_ERR_LEN] = "";
    const uint32_t e[] = {6};
    assert_int_equal(ov_block_rotation(state(h), e, 1, 6, &r, &n, err, sizeof err), -1);
    assert_null(r);
    assert_non_null(strstr(err, "outside"));
    policy_host_destroy(h);
    /* A head size of 0 (model head_dim 0, head_size unset) cannot rotate. */
    const policy_ops *ops = policy_find("ov_block");
    policy_params p;
    assert_int_equal(policy_params_resolve(ops, NULL, NULL, 0, &p, err, sizeof err), 0);
    policy_geometry g = geom(1, 16);
    g.head_dim = 0;
    void *st = NULL;
    assert_int_equal(ops->create(&p, &g, &st, err, sizeof err), 0);
    assert_int_equal(ov_block_rotation(st, e, 1, 8, &r, &n, err, sizeof err), -1);
    assert_non_null(strstr(err, "head_size"));
    ops->destroy(st);
}

/* ---- §2.3 registration and counter rules ---- */

static const char *const win8[] = {"start_size=2",      "recent_size=2",   "max_cache_size=8",
                                   "max_pool_window=1", "snapkv_window=8", NULL};

static void test_register_initial_with_window(void **unused)
{
    (void)unused;
    policy_host *h = new_host(win8, 1, 2);
    ov_block *st = state(h);
    double v[12];
    for (int i = 0; i < 12; i++)
        v[i] = 0.1 * (i + 1);
    assert_int_equal(reg(st, v, 12, 4), OV_REG_DONE);
    assert_int_equal(ov_block_snapkv_registered(st), 4);
    const uint64_t c[10] = {4, 4, 4, 4, 4, 4, 4, 3, 2, 1}; /* [4]*6 ++ [4,3,2,1] */
    assert_cnt(st, 0, c, 10);
    assert_acc(st, 0, v + 2, 10);
    policy_host_destroy(h);
}

static void test_register_snapkv0_before_window_ignored(void **unused)
{
    (void)unused;
    policy_host *h = new_host(win8, 2, 2);
    ov_block *st = state(h);
    double v[14];
    for (int i = 0; i < 14; i++)
        v[i] = 1.0 + i;
    /* A prompt chunk before the window: nothing is tracked, nreg stays 0. */
    assert_int_equal(reg(st, v, 10, 0), OV_REG_BEFORE_WINDOW);
    assert_int_equal(ov_block_tracked(st, 0), 0);
    assert_int_equal(ov_block_tracked(st, 1), 0);
    assert_int_equal(ov_block_snapkv_registered(st), 0);
    /* The first window chunk is the initial registration. */
    assert_int_equal(reg(st, v, 14, 3), OV_REG_DONE);
    const uint64_t c[12] = {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 1};
    assert_cnt(st, 1, c, 12);
    assert_acc(st, 1, v + 2, 12);
    policy_host_destroy(h);

    /* With the window off, a snapkv-0 registration is the initial one. */
    h = new_host(tov1_norm, 1, 2);
    assert_int_equal(reg(state(h), v, 10, 0), OV_REG_DONE);
    const uint64_t c0[8] = {8, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(state(h), 0, c0, 8);
    policy_host_destroy(h);
}

static void test_register_growth_in_window(void **unused)
{
    (void)unused;
    policy_host *h = new_host(win8, 1, 2);
    ov_block *st = state(h);
    double v[16];
    for (int i = 0; i < 16; i++)
        v[i] = 1.0;
    reg(st, v, 8, 3); /* tracked 6, nreg 3 */
    /* Still inside the window (nreg 5 < 8): cnt = [nreg]*(new - nreg) ++ [nreg..1]. */
    assert_int_equal(reg(st, v, 12, 2), OV_REG_DONE);
    assert_int_equal(ov_block_snapkv_registered(st), 5);
    const uint64_t c[10] = {5, 5, 5, 5, 5, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, c, 10);
    const double a[10] = {2, 2, 2, 2, 2, 2, 1, 1, 1, 1};
    assert_acc(st, 0, a, 10);
    /* The registration that fills the window uses normal growth:
     * old counters + delta, then delta..1. */
    assert_int_equal(reg(st, v, 14, 3), OV_REG_DONE);
    assert_int_equal(ov_block_snapkv_registered(st), 8);
    const uint64_t c2[12] = {7, 7, 7, 7, 7, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, c2, 12);
    /* After the window: nsnap no longer counts, growth stays normal. */
    assert_int_equal(reg(st, v, 15, 1), OV_REG_DONE);
    assert_int_equal(ov_block_snapkv_registered(st), 8);
    const uint64_t c3[13] = {8, 8, 8, 8, 8, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, c3, 13);
    /* A registration with no new token adds scores, counters unchanged. */
    assert_int_equal(reg(st, v, 15, 1), OV_REG_DONE);
    assert_cnt(st, 0, c3, 13);
    assert_float_equal(ov_block_scores(st, 0)[0], 5.0, 1e-12);
    policy_host_destroy(h);
}

static void test_register_normal_growth_no_window(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    ov_block *st = state(h);
    const double v[8] = {9, 9, 1, 2, 3, 4, 5, 6};
    reg(st, v, 5, 0); /* tracked [1,2,3], cnt [3,2,1] */
    reg(st, v, 8, 0); /* + [1,2,3,4,5,6], delta 3 */
    const uint64_t c[6] = {6, 5, 4, 3, 2, 1};
    assert_cnt(st, 0, c, 6);
    const double a[6] = {2, 4, 6, 4, 5, 6};
    assert_acc(st, 0, a, 6);
    policy_host_destroy(h);
}

static void test_register_errors(void **unused)
{
    (void)unused;
    policy_host *h = new_host(win8, 1, 2);
    ov_block *st = state(h);
    double v[16] = {0};
    char err[POLICY_ERR_LEN] = "";
    const double *s[1] = {v};
    size_t n[1] = {12};
    assert_int_equal(ov_block_register(st, s, n, 6, NULL, err, sizeof err), 0);
    /* Overfilling the window is refused and changes nothing. */
    assert_int_equal(ov_block_register(st, s, n, 3, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "snapkv_window"));
    assert_int_equal(ov_block_snapkv_registered(st), 6);
    /* Fewer scores than held tokens (2 start + 10 tracked). */
    n[0] = 11;
    assert_int_equal(ov_block_register(st, s, n, 0, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "11 scores are fewer than the 12 tokens"));
    /* Non-finite. */
    n[0] = 12;
    v[5] = NAN;
    assert_int_equal(ov_block_register(st, s, n, 0, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "score 5"));
    policy_host_destroy(h);
}

static void test_register_short_skips_layers(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 2, 2);
    ov_block *st = state(h);
    const double v[4] = {1, 2, 3, 4};
    const double *s[2] = {v, v};
    size_t n[2] = {2, 4};
    ov_reg_status status;
    char err[POLICY_ERR_LEN] = "";
    /* Layer 0 holds only the start area: the reference returns, so layer 1
     * is not registered either. */
    assert_int_equal(ov_block_register(st, s, n, 0, &status, err, sizeof err), 0);
    assert_int_equal(status, OV_REG_SHORT);
    assert_int_equal(ov_block_tracked(st, 1), 0);
    policy_host_destroy(h);
}

static void test_register_maxpool_applied(void **unused)
{
    (void)unused;
    const char *const kv[] = {"start_size=2",      "recent_size=2",   "max_cache_size=8",
                              "max_pool_window=3", "snapkv_window=0", NULL};
    policy_host *h = new_host(kv, 1, 2);
    ov_block *st = state(h);
    /* The start area (100s) is cut off before pooling. */
    const double v[8] = {100, 100, 1, 5, 2, 0, 3, 1};
    reg(st, v, 8, 0);
    const double a[6] = {5, 5, 3, 3, 3, 1};
    assert_acc(st, 0, a, 6);
    policy_host_destroy(h);
    /* Default window 7. */
    const char *const kv7[] = {"start_size=2", "recent_size=2", "max_cache_size=8",
                               "snapkv_window=0", NULL};
    h = new_host(kv7, 1, 2);
    const double w[12] = {0, 0, 1, 0, 0, 0, 0, 0, 0, 2, 0, 0};
    reg(state(h), w, 12, 0);
    const double a7[10] = {1, 2, 2, 2, 2, 2, 2, 2, 0, 0};
    assert_acc(state(h), 0, a7, 10);
    policy_host_destroy(h);
}

/* ---- §2.5 tie rule ---- */

static void test_tie_lower_block_first(void **unused)
{
    (void)unused;
    const double bs[5] = {1, 1, 1, 1, 1};
    uint32_t out[5];
    assert_int_equal(ov_select_lowest(bs, 5, 2, out), 0);
    assert_int_equal(out[0], 0);
    assert_int_equal(out[1], 1);
    const double bs2[5] = {2, 1, 3, 1, 1};
    assert_int_equal(ov_select_lowest(bs2, 5, 2, out), 0);
    assert_int_equal(out[0], 1);
    assert_int_equal(out[1], 3);
    /* Through evict: all equal scores in SUM mode -> the lowest blocks go. */
    policy_host *h = new_host(tov1_sum, 1, 2);
    double v[15];
    for (int i = 0; i < 15; i++)
        v[i] = 0.5;
    reg(state(h), v, 15, 0); /* seq 15: range [1, 6), keep 2, evict 3 */
    uint32_t e[8];
    assert_int_equal(evict(state(h), 0, e), 3);
    assert_int_equal(e[0], 1);
    assert_int_equal(e[1], 2);
    assert_int_equal(e[2], 3);
    policy_host_destroy(h);
}

static void test_evict_partial_tail_and_cap(void **unused)
{
    (void)unused;
    /* seq = 9 = cap (max 8 + B - 1): not full yet. */
    policy_host *h = new_host(tov1_sum, 1, 2);
    double v[12] = {0};
    reg(state(h), v, 9, 0);
    uint32_t e[8];
    assert_int_equal(evict(state(h), 0, e), 0);
    /* seq 11: blocks 0..4 and a partial block 5. The recent block 4 and the
     * partial tail score 0 like block 1, yet only [1, 4) is evictable. */
    v[4] = 1;
    v[6] = 2;
    reg(state(h), v, 11, 0);
    assert_int_equal(evict(state(h), 0, e), 1);
    assert_int_equal(e[0], 1);
    assert_int_equal(ov_block_tracked(state(h), 0), 7);
    const double rest[7] = {1, 0, 2, 0, 0, 0, 0};
    assert_acc(state(h), 0, rest, 7);
    policy_host_destroy(h);
}

/* ---- KVCrush anchors ---- */

static void test_kvcrush_anchor_modes(void **unused)
{
    (void)unused;
    uint8_t ind[8] = {1, 1, 0, 1, 1, 1, 0, 0}, a[4];
    ov_kvcrush_anchor(OV_ANCHOR_ZEROS, ind, 2, 4, NULL, a);
    for (int p = 0; p < 4; p++)
        assert_int_equal(a[p], 0);
    ov_kvcrush_anchor(OV_ANCHOR_ONES, ind, 2, 4, NULL, a);
    for (int p = 0; p < 4; p++)
        assert_int_equal(a[p], 1);
    ov_kvcrush_anchor(OV_ANCHOR_ALTERNATING, ind, 2, 4, NULL, a);
    for (int p = 0; p < 4; p++)
        assert_int_equal(a[p], p % 2);
    /* MEAN is strict: 1/2 is not > 0.5. */
    ov_kvcrush_anchor(OV_ANCHOR_MEAN, ind, 2, 4, NULL, a);
    assert_int_equal(a[0], 1);
    assert_int_equal(a[1], 1);
    assert_int_equal(a[2], 0);
    assert_int_equal(a[3], 0);
    /* RANDOM: the top bit of successive draws of one persistent stream. */
    ov_mt19937 r, ref;
    ov_mt19937_seed(&r, 0);
    ov_mt19937_seed(&ref, 0);
    for (int call = 0; call < 3; call++) {
        ov_kvcrush_anchor(OV_ANCHOR_RANDOM, ind, 2, 4, &r, a);
        for (int p = 0; p < 4; p++)
            assert_int_equal(a[p], (ov_mt19937_next(&ref) >> 31) & 1);
    }
}

static void test_kvcrush_retain_properties(void **unused)
{
    (void)unused;
    uint64_t s = 99;
    for (int trial = 0; trial < 200; trial++) {
        uint32_t B = 1 + (uint32_t)(ph_rand(&s) % 6);
        size_t nE = 1 + ph_rand(&s) % 12;
        double acc[12 * 6];
        for (size_t i = 0; i < nE * B; i++)
            acc[i] = urand(&s);
        size_t nv = 1 + ph_rand(&s) % nE;
        uint32_t v[12];
        double bs[12];
        ov_score_blocks(acc, NULL, 0, nE, B, bs);
        assert_int_equal(ov_select_lowest(bs, nE, nv, v), 0);
        uint32_t budget = 1 + (uint32_t)(ph_rand(&s) % 5), keep[5];
        size_t nk;
        ov_mt19937 r;
        ov_mt19937_seed(&r, (uint32_t)trial);
        ov_anchor_mode mode = (ov_anchor_mode)(trial % 5);
        assert_int_equal(ov_kvcrush_retain(acc, nE, B, v, nv, budget, mode, &r, keep, &nk), 0);
        assert_int_equal(nk, nv < budget ? nv : budget);
        for (size_t i = 0; i < nk; i++) {
            int found = 0;
            for (size_t j = 0; j < nv; j++)
                found |= keep[i] == v[j];
            assert_true(found);
            if (i > 0)
                assert_true(keep[i] > keep[i - 1]);
        }
    }
}

static void test_kvcrush_random_reproducible(void **unused)
{
    (void)unused;
    const char *const kv[] = {"start_size=2",     "recent_size=2",
                              "max_cache_size=6", "max_pool_window=1",
                              "snapkv_window=0",  "aggregation=sum",
                              "kvcrush_budget=2", "kvcrush_anchor=random",
                              "kvcrush_seed=5",   NULL};
    uint32_t first[2][8];
    for (int run = 0; run < 2; run++) {
        policy_host *h = new_host(kv, 2, 2);
        reg(state(h), tov2, 15, 0);
        for (uint32_t l = 0; l < 2; l++) {
            uint32_t e[8];
            size_t n = evict(state(h), l, e);
            assert_int_equal(n, 2); /* budget 2 of 4 victims stay */
            if (run == 0)
                memcpy(first[l], e, sizeof e);
            else
                assert_memory_equal(first[l], e, n * sizeof *e);
        }
        policy_host_destroy(h);
    }
}

/* ---- configuration (§2.1) ---- */

static void test_config_defaults(void **unused)
{
    (void)unused;
    const policy_ops *ops = policy_find("ov_block");
    assert_non_null(ops);
    assert_int_equal(ops->needs, POLICY_NEEDS_SCORE);
    assert_int_equal(ops->per_head, 0);
    policy_params p;
    char err[POLICY_ERR_LEN];
    assert_int_equal(policy_params_resolve(ops, NULL, NULL, 0, &p, err, sizeof err), 0);
    const char *want[][2] = {
        {"start_size", "32"},    {"recent_size", "128"},      {"max_cache_size", "672"},
        {"block_size", "0"},     {"aggregation", "norm_sum"}, {"max_pool_window", "7"},
        {"snapkv_window", "8"},  {"kvcrush_budget", "0"},     {"kvcrush_anchor", "random"},
        {"kvcrush_seed", "0"},   {"rope_theta", "10000"},     {"head_size", "0"},
        {"apply_rotation", "0"}, {"rope_pairing", "half"}};
    assert_int_equal(p.count, sizeof want / sizeof want[0] + 8); /* + storage keys */
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        assert_string_equal(policy_params_get(&p, want[i][0]), want[i][1]);
    for (size_t i = 0; i < ops->nparams; i++)
        assert_true(strlen(ops->params[i].help) > 0);
    /* Defaults are valid with B = 16 and B = 32. */
    policy_host_destroy(new_host(NULL, 1, 16));
    policy_host_destroy(new_host(NULL, 1, 32));
    const char *const eq[] = {"block_size=16", NULL};
    policy_host_destroy(new_host(eq, 1, 16));
    const char *const empty[] = {"block_size=", NULL};
    policy_host_destroy(new_host(empty, 1, 16));
}

static void test_config_invalid(void **unused)
{
    (void)unused;
    static const ph_reject cases[] = {
        {{"start_size=0"}, {"start_size", "[1, 1073741824]"}},
        {{"recent_size=0"}, {"recent_size", "[1, 1073741824]"}},
        {{"max_cache_size=0"}, {"max_cache_size", "[1, 1073741824]"}},
        {{"max_cache_size=160"}, {"max_cache_size", "start_size + recent_size"}}, /* = 32 + 128 */
        {{"start_size=33", "max_cache_size=673"}, {"start_size", "multiple"}},
        {{"recent_size=120"}, {"recent_size", "multiple"}},
        {{"max_cache_size=680"}, {"max_cache_size", "multiple"}},
        {{"block_size=32"}, {"block_size", "(16)"}},
        {{"aggregation=adaptive_rkv"}, {"aggregation", "sum, norm_sum"}},
        {{"kvcrush_anchor=alternate"}, {"kvcrush_anchor", "alternating"}},
        {{"head_size=7"}, {"head_size", "even"}},
        {{"rope_theta=0"}, {"rope_theta", "[1, 1e+12]"}},
        {{"apply_rotation=2"}, {"apply_rotation", "[0, 1]"}},
        {{"kvcrush_seed=-1"}, {"kvcrush_seed", "[0, 4294967295]"}},
        {{"snapkv=8"}, {"snapkv"}},
        {{"max_pool_window=x"}, {"max_pool_window", "[0, 1048576]"}},
        {{"kvcrush_budget=-2"}, {"kvcrush_budget", "[0, 1048576]"}},
    };
    ph_expect_rejects("ov_block", geom(1, 16), cases, PH_N(cases));
    ph_expect_reject("ov_block", NULL, geom(1, 64), "start_size"); /* 32 is no multiple of 64 */
    ph_expect_reject("ov_block", NULL, geom(0, 16), "layers");
}

/* ---- step errors and describe ---- */

static void test_step_needs_score(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    assert_int_equal(policy_host_append(h, 4), 0);
    policy_stats stats = {.new_tokens = 4, .prefill = 0};
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "score"));
    policy_host_destroy(h);
}

/* A step's scores are widened and checked in one pass (ov_step): a NaN or
 * an infinity anywhere is refused by index, and the layer keeps what it
 * held. */
static void test_step_refuses_non_finite_scores(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    assert_int_equal(policy_host_append(h, 11), 0);
    float s[11];
    for (int i = 0; i < 11; i++)
        s[i] = 0.125f * (float)(i + 1);
    policy_stats stats = {.new_tokens = 11, .prefill = 1, .score = s, .score_queries = 1};
    char err[POLICY_ERR_LEN] = "";
    const policy_decision *d = NULL;
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), 0);
    policy_host_commit(h, 0);
    const uint64_t c9[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_cnt(state(h), 0, c9, 9);
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3; b++)
        for (size_t at = 0; at < 11; at += 5) {
            s[at] = bad[b];
            assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
            char want[64];
            snprintf(want, sizeof want, "score %zu is not a finite number", at);
            if (strstr(err, want) == NULL)
                fail_msg("'%s' does not say '%s'", err, want);
            s[at] = 0.125f * (float)(at + 1);
        }
    /* Read in place (policy_stats.in_place), each score is checked as the
     * pooling takes it, the start area's apart: the worker's input is
     * refused (errno EBADMSG), and the transaction undoes the step. */
    stats.new_tokens = 0;
    stats.prefill = 0;
    stats.in_place = 1;
    for (int b = 0; b < 3; b++)
        for (size_t at = 0; at < 11; at += 5) {
            s[at] = bad[b];
            policy_host_begin(h);
            errno = 0;
            assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
            assert_int_equal(errno, EBADMSG);
            char want[64];
            snprintf(want, sizeof want, "layer 0's stats.score[%zu] is not finite", at);
            if (strstr(err, want) == NULL)
                fail_msg("'%s' does not say '%s'", err, want);
            policy_host_rollback(h);
            s[at] = 0.125f * (float)(at + 1);
        }
    assert_cnt(state(h), 0, c9, 9);
    double want[9];
    for (int i = 0; i < 9; i++)
        want[i] = 0.125 * (i + 3);
    assert_acc(state(h), 0, want, 9);
    policy_host_destroy(h);
}

/* A step pools its float scores as they come and sums each block of them
 * while it is in L1 (ov_block.c pool_scores); a registration does so with
 * doubles. Either way the accumulators are §2.3's to the bit (a naive
 * pool of each step, added to the last accumulators, 0.0 + the pool for a
 * new token), and the counters agree: with the default window, a window
 * long enough for the deque, ties and both zeros, over a prefill and 40
 * decode steps. */
static void test_step_and_register_pool_and_sum_as_specified(void **unused)
{
    (void)unused;
    static const char *const w7[] = {"start_size=2",      "recent_size=2",   "max_cache_size=4096",
                                     "max_pool_window=7", "snapkv_window=0", NULL};
    static const char *const w70[] = {"start_size=2",        "recent_size=2",
                                      "max_cache_size=4096", "max_pool_window=70",
                                      "snapkv_window=0",     NULL};
    const char *const *configs[] = {w7, w70};
    uint64_t seed = 7;
    for (int c = 0; c < 2; c++) {
        policy_host *h = new_host(configs[c], 1, 2), *r = new_host(configs[c], 1, 2);
        size_t w = c == 0 ? 7 : 70;
        float f[1200];
        double v[1200], want[1200];
        size_t n = 0;
        for (int step = 0; step <= 40; step++) {
            size_t add = step == 0 ? 1100 : 1;
            assert_int_equal(policy_host_append(h, (uint32_t)add), 0);
            n += add;
            /* Mostly zeros of both signs, so that some windows hold
             * nothing else: more of them for the longer window. */
            uint64_t zeros = c == 0 ? 80 : 97;
            for (size_t i = 0; i < n; i++) {
                uint64_t x = ph_rand(&seed) % 100;
                f[i] = x >= zeros ? 0.25f * (float)(x % 5 + 1) : x % 2 ? -0.0f : 0.0f;
                v[i] = f[i];
            }
            policy_stats stats = {
                .new_tokens = (uint32_t)add, .prefill = step == 0, .score = f, .score_queries = 1};
            char err[POLICY_ERR_LEN] = "";
            const policy_decision *d = NULL;
            if (policy_host_step(h, 0, &stats, &d, err, sizeof err) != 0)
                fail_msg("step %d: %s", step, err);
            policy_host_commit(h, 0);
            reg(state(r), v, n, 1);
            size_t t = ov_block_tracked(state(h), 0), old = step == 0 ? 0 : t - add;
            assert_int_equal(t, n - 2);
            for (size_t i = 0; i < t; i++) {
                double m = v[i + 2];
                for (size_t j = i + 2; j < i + 2 + w && j < n; j++)
                    m = v[j] > m ? v[j] : m;
                want[i] = step == 0 ? m : (i < old ? want[i] : 0.0) + m;
            }
            assert_memory_equal(ov_block_scores(state(h), 0), want, t * sizeof(double));
            assert_int_equal(ov_block_tracked(state(r), 0), t);
            assert_memory_equal(ov_block_scores(state(h), 0), ov_block_scores(state(r), 0),
                                t * sizeof(double));
            static uint64_t ch[1200];
            memcpy(ch, ov_block_counters(state(h), 0), t * sizeof *ch);
            assert_memory_equal(ch, ov_block_counters(state(r), 0), t * sizeof *ch);
        }
        policy_host_destroy(h);
        policy_host_destroy(r);
    }
}

static void test_step_snapkv_counts_once_per_step(void **unused)
{
    (void)unused;
    policy_host *h = new_host(win8, 3, 2);
    assert_int_equal(policy_host_append(h, 12), 0);
    float s[12] = {0};
    policy_stats stats = {.new_tokens = 12, .prefill = 1, .score = s, .score_queries = 5};
    char err[POLICY_ERR_LEN] = "";
    const policy_decision *d = NULL;
    for (uint32_t l = 0; l < 3; l++) {
        assert_int_equal(policy_host_step(h, l, &stats, &d, err, sizeof err), 0);
        policy_host_commit(h, l);
    }
    assert_int_equal(ov_block_snapkv_registered(state(h)), 5);
    /* 5 + 4 > 8: the next step is refused with a message. */
    assert_int_equal(policy_host_append(h, 1), 0);
    stats.score_queries = 4;
    stats.new_tokens = 1;
    float s2[13] = {0};
    stats.score = s2;
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "snapkv_window"));
    policy_host_destroy(h);
}

static void test_describe(void **unused)
{
    (void)unused;
    policy_host *h = new_host(tov1_norm, 1, 2);
    const double v[5] = {1, 1, 0.5, 0.25, 3};
    reg(state(h), v, 5, 0);
    char *s = policy_find("ov_block")->describe(state(h), 0);
    assert_non_null(s);
    assert_string_equal(s, "{\"aggregation\":\"norm_sum\",\"snapkv_registered\":0,\"tracked\":3,"
                           "\"scores\":[0.5,0.25,3],\"counters\":[3,2,1]}");
    free(s);
    assert_null(policy_find("ov_block")->describe(state(h), 1));
    policy_host_destroy(h);
}

/* ---- property tests through the host ---- */

typedef struct run_cfg {
    const char *const *kv;
    uint32_t layers, B, start, recent, max, budget;
} run_cfg;

/*
 * A prompt in random chunks (prefill), then decode steps, with seeded random
 * scores. Checks after every step: held positions ascend; the start area
 * (positions < start) and the last `recent` appended positions are held; in
 * decode the occupancy is <= max + B - 1 + budget*B; evictions are whole
 * aligned blocks of the list; every layer keeps as many tokens; tracked
 * equals held - start. Returns a hash of every held list, for determinism.
 */
static uint64_t run(const run_cfg *c, uint64_t seed, int *rerotated)
{
    policy_host *h = new_host(c->kv, c->layers, c->B);
    ov_block *st = state(h);
    uint32_t prompt = 20 + (uint32_t)(ph_rand(&seed) % 200), done = 0;
    uint64_t hash = 1469598103934665603ull;
    float *s = NULL;
    for (int stepno = 0; stepno < 150; stepno++) {
        int prefill = done < prompt;
        uint32_t incoming = prefill ? 1 + (uint32_t)(ph_rand(&seed) % (prompt - done)) : 1;
        done += incoming;
        if (prefill && done == prompt)
            prefill = 0; /* the last prompt chunk ends prefill, as in §2.7 */
        assert_int_equal(policy_host_append(h, incoming), 0);
        uint32_t n0 = policy_host_view(h, 0)->tokens[0];
        for (uint32_t l = 0; l < c->layers; l++) {
            const policy_layer_view *v = policy_host_view(h, l);
            uint32_t n = v->tokens[0];
            assert_int_equal(n, n0);
            float *ns = realloc(s, n * sizeof *s);
            assert_non_null(ns);
            s = ns;
            for (uint32_t i = 0; i < n; i++)
                s[i] = (float)urand(&seed);
            policy_stats stats = {.new_tokens = incoming,
                                  .prefill = prefill,
                                  .score = s,
                                  .score_queries = 1,
                                  .confidence = -1};
            const policy_decision *d = NULL;
            char err[POLICY_ERR_LEN] = "";
            if (policy_host_step(h, l, &stats, &d, err, sizeof err) != 0)
                fail_msg("step: %s", err);
            uint32_t ev = 0;
            for (uint32_t i = 0; i < n; i++) {
                if (d->tier[0][i] != POLICY_EVICT)
                    continue;
                ev++;
                if (i % c->B == 0) /* whole, aligned blocks */
                    for (uint32_t t = 0; t < c->B; t++)
                        assert_int_equal(d->tier[0][i + t], POLICY_EVICT);
                else
                    assert_int_equal(d->tier[0][i - 1], POLICY_EVICT);
            }
            if (prefill)
                assert_int_equal(ev, 0);
            if (ev > 0 && d->rerotate_keys)
                *rerotated = 1;
            assert_int_equal(policy_host_commit(h, l), ev);
            v = policy_host_view(h, l);
            n = v->tokens[0];
            uint64_t T = v->appended;
            if (!prefill && ov_block_tracked(st, l) > 0)
                assert_true(n <= (uint64_t)c->max + c->B - 1 + (uint64_t)c->budget * c->B);
            for (uint32_t i = 0; i < n; i++) {
                if (i > 0)
                    assert_true(v->positions[0][i] > v->positions[0][i - 1]);
                hash = (hash ^ v->positions[0][i]) * 1099511628211ull;
            }
            for (uint32_t i = 0; i < c->start && i < T; i++)
                assert_int_equal(v->positions[0][i], i);
            for (uint32_t k = 0; k < c->recent && k < T; k++)
                assert_int_equal(v->positions[0][n - 1 - k], T - 1 - k);
            if (ov_block_tracked(st, l) > 0)
                assert_int_equal(ov_block_tracked(st, l) + c->start, n);
        }
    }
    free(s);
    policy_host_destroy(h);
    return hash;
}

static void test_property_random_runs(void **unused)
{
    (void)unused;
    const char *const k1[] = {"start_size=8", "recent_size=8", "max_cache_size=32", NULL};
    const char *const k2[] = {
        "start_size=4",     "recent_size=8",       "max_cache_size=24", "aggregation=sum",
        "kvcrush_budget=2", "kvcrush_anchor=mean", "apply_rotation=1",  NULL};
    const char *const k3[] = {"start_size=8",    "recent_size=4",     "max_cache_size=40",
                              "snapkv_window=0", "kvcrush_budget=1",  "kvcrush_anchor=random",
                              "kvcrush_seed=3",  "max_pool_window=1", NULL};
    const char *const k4[] = {"start_size=2",
                              "recent_size=2",
                              "max_cache_size=6",
                              "kvcrush_budget=3",
                              "kvcrush_anchor=alternating",
                              NULL};
    const run_cfg cfgs[] = {{k1, 2, 4, 8, 8, 32, 0},
                            {k2, 3, 4, 4, 8, 24, 2},
                            {k3, 2, 4, 8, 4, 40, 1},
                            {k4, 1, 2, 2, 2, 6, 3}};
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
        for (uint64_t seed = 1; seed <= 6; seed++) {
            int rot1 = 0, rot2 = 0;
            uint64_t a = run(&cfgs[i], seed * 7919, &rot1);
            uint64_t b = run(&cfgs[i], seed * 7919, &rot2);
            assert_true(a == b); /* same input, same output */
            assert_int_equal(rot1, i == 1);
        }
    }
}

/* ---- moving a sequence (export_layer / import_layer) ---- */

/* A sequence moved to another daemon holds and decides exactly as the
 * original: the accumulators and counters (both aggregations), the SnapKV
 * window's count (still filling at the move in the first configuration)
 * and the KVCrush rng (the second: under NORM_SUM the victims' raw scores
 * differ, so the random anchor picks which victim stays). */
static void test_moves_to_another_host(void **unused)
{
    (void)unused;
    const char *k1[] = {"start_size=4", "recent_size=8", "max_cache_size=24", NULL};
    ph_check_portable("ov_block", k1, geom(3, 4), 40, 5, 21);
    const char *k2[] = {"start_size=4",      "recent_size=8",
                        "max_cache_size=28", "aggregation=norm_sum",
                        "kvcrush_budget=2",  "kvcrush_anchor=random",
                        "kvcrush_seed=5",    "snapkv_window=0",
                        "apply_rotation=1",  NULL};
    ph_check_portable("ov_block", k2, geom(2, 4), 30, 12, 22);
    const char *k3[] = {"start_size=8",      "recent_size=4",
                        "max_cache_size=32", "aggregation=sum",
                        "kvcrush_budget=2",  "kvcrush_anchor=mean",
                        "max_pool_window=1", "snapkv_window=3",
                        "demote=int8",       NULL};
    ph_check_portable("ov_block", k3, geom(2, 4), 50, 10, 23);
}

/* import_layer checks the bytes (ov_block.c's format, version 1) rather
 * than trusting them: each spoiled copy is refused and changes nothing. */
static void test_import_refuses_ph_spoil(void **unused)
{
    (void)unused;
    const char *kv[] = {"start_size=4", "recent_size=8", "max_cache_size=24", NULL};
    policy_geometry g = geom(2, 4);
    uint64_t r = 9;
    policy_host *a = ph_host("ov_block", kv, g);
    ph_round(a, &g, 40, 1, &r);
    ph_round(a, &g, 3, 0, &r);
    size_t len;
    uint8_t *good = policy_host_export_state(a, 1, &len);
    assert_non_null(good);
    size_t n = ov_block_tracked(state(a), 1), acc = 2552, cnt = acc + 8 * n;
    assert_true(n >= 2);
    assert_int_equal(len, acc + 16 * n);
    assert_int_equal(policy_get_le(good + 2544, 8), n);
    /* Into a host that holds layer 1's state already (and nreg 2), so that
     * "unchanged" means something. */
    policy_host *c = ph_host("ov_block", kv, g);
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_ops(c)->import_layer(state(c), 1, good, len, err, sizeof err), 0);
    assert_int_equal(ov_block_snapkv_registered(state(c)), 2);
    const ph_spoil cases[] = {
        {"magic", 1, 1, 'V', 0, "magic"},
        {"version", 3, 1, 7, 0, "version 7"},
        {"other block size", 12, 4, 8, 0, "block size 8"},
        {"other aggregation", 24, 4, 0, 0, "aggregation 0"},
        {"nreg beyond the window", 28, 4, 9, 0, "snapkv_window"},
        {"rng index beyond 624", 44, 4, 625, 0, "mt19937"},
        {"count short of the length", 2544, 8, n - 1, 0, "bytes"},
        {"count beyond a list", 2544, 8, 1ull << 40, 0, "2^32"},
        {"trailing byte", 0, 0, 0, 1, "bytes"},
        {"cut short", 0, 0, 0, -1, "bytes"},
        {"header only", 0, 0, 0, -(int)(len - 100), "header"},
        {"NaN score", acc, 8, 0x7ff8000000000000ull, 0, "finite"},
        {"infinite score", acc + 8, 8, 0xfff0000000000000ull, 0, "finite"},
        {"zero counter", cnt + 8 * (n - 1), 8, 0, 0, "counter"},
        {"rising counter", cnt + 8, 8, policy_get_le(good + cnt, 8) + 1, 0, "counter 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ph_expect_refused(c, 1, good, len, &cases[i]);
    /* Layer 1's bytes are not layer 0's. */
    ph_spoil other = {"another layer", 0, 0, 0, 0, "layer 1"};
    ph_expect_refused(c, 0, good, len, &other);
    /* And what it did accept is the original's state. */
    char *da = policy_host_ops(a)->describe(state(a), 1);
    char *dc = policy_host_ops(c)->describe(state(c), 1);
    assert_string_equal(da, dc);
    free(da), free(dc);
    free(good);
    policy_host_destroy(a);
    policy_host_destroy(c);
}

/* The layers step at once (ops->layers_concurrent_now) unless KVCrush
 * draws random anchors from the generator, whose draws follow the layers'
 * order, or the pooling window needs the deque's shared scratch. */
static void test_layers_concurrent_when_order_free(void **unused)
{
    (void)unused;
    const struct {
        const char *kv[4];
        int concurrent;
    } cases[] = {
        {{NULL}, 1},
        {{"kvcrush_budget=2", NULL}, 0}, /* the anchor defaults to random */
        {{"kvcrush_budget=2", "kvcrush_anchor=mean", NULL}, 1},
        {{"kvcrush_anchor=random", NULL}, 1}, /* KVCrush off: no draws */
        {{"max_pool_window=64", NULL}, 1},
        {{"max_pool_window=65", NULL}, 0},
    };
    const policy_ops *ops = ph_ops("ov_block");
    assert_true(ops->layers_concurrent);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        policy_host *h = new_host(cases[i].kv, 2, 4);
        assert_int_equal(ops->layers_concurrent_now(policy_host_state(h)), cases[i].concurrent);
        policy_host_destroy(h);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mt19937_reference),
        cmocka_unit_test(test_maxpool_forward_shrinking_tail),
        cmocka_unit_test(test_maxpool_matches_naive),
        cmocka_unit_test(test_counter_formula),
        cmocka_unit_test(test_block_scores_as_specified),
        cmocka_unit_test(test_tov1_norm_sum),
        cmocka_unit_test(test_tov1_sum),
        cmocka_unit_test(test_tov1_rotation_list),
        cmocka_unit_test(test_tov1_through_host),
        cmocka_unit_test(test_tov1_prefill_never_evicts),
        cmocka_unit_test(test_rerotate_flag),
        cmocka_unit_test(test_tov2_pieces),
        cmocka_unit_test(test_tov2_evict),
        cmocka_unit_test(test_tov3_rotation_math),
        cmocka_unit_test(test_rotation_random_keys),
        cmocka_unit_test(test_rotation_plan),
        cmocka_unit_test(test_rotation_state_errors),
        cmocka_unit_test(test_layers_concurrent_when_order_free),
        cmocka_unit_test(test_register_initial_with_window),
        cmocka_unit_test(test_register_snapkv0_before_window_ignored),
        cmocka_unit_test(test_register_growth_in_window),
        cmocka_unit_test(test_register_normal_growth_no_window),
        cmocka_unit_test(test_register_errors),
        cmocka_unit_test(test_register_short_skips_layers),
        cmocka_unit_test(test_register_maxpool_applied),
        cmocka_unit_test(test_tie_lower_block_first),
        cmocka_unit_test(test_evict_partial_tail_and_cap),
        cmocka_unit_test(test_kvcrush_anchor_modes),
        cmocka_unit_test(test_kvcrush_retain_properties),
        cmocka_unit_test(test_kvcrush_random_reproducible),
        cmocka_unit_test(test_config_defaults),
        cmocka_unit_test(test_config_invalid),
        cmocka_unit_test(test_step_needs_score),
        cmocka_unit_test(test_step_refuses_non_finite_scores),
        cmocka_unit_test(test_step_and_register_pool_and_sum_as_specified),
        cmocka_unit_test(test_step_snapkv_counts_once_per_step),
        cmocka_unit_test(test_describe),
        cmocka_unit_test(test_saved_layer_survives_an_eviction),
        cmocka_unit_test(test_saved_counters_survive_growth_and_eviction),
        cmocka_unit_test(test_property_random_runs),
        cmocka_unit_test(test_moves_to_another_host),
        cmocka_unit_test(test_import_refuses_ph_spoil),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
