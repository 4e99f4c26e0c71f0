/*
 * test_policy_txn.c - policy host transactions (policies/host.h: begin,
 * rollback, end) and the policies' save/restore/discard (policy.h), over
 * every registered policy.
 *
 * Twin hosts A and B of the same policy get the same appends and steps
 * (seeded random stats, every array a policy may need). On A alone a
 * scenario opens a transaction, changes things (appends, steps, commits,
 * with other stats) and rolls back; from then on both hosts take the same
 * steps, and every decision, tier order, describe() answer and view must be
 * equal: a policy state or list that rollback did not put back exactly
 * shows up as a difference. A transaction that ends (keeps) must equal a
 * host that did the same without one. Under ASan the copies must balance
 * (no leak, no double free), a host destroyed with a transaction open
 * included; a failing save must leave the host as it was.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy_harness.h"

#define LAYERS 3
#define QH 4
#define KVH 2
#define WINDOW 4 /* snapkv family's window = window_queries of the stats */

/* 3 layers, GQA 4/2, 4-token blocks (ov_block's block size). */
static const policy_geometry geom = {LAYERS, QH, KVH, 64, 4, 10000.0f};

/* Each policy with parameters small enough that a few steps evict, merge,
 * sketch or demote. Every registered policy needs an entry. */
typedef struct txn_case {
    const char *policy;
    const char *kv[8];
} txn_case;

static const txn_case cases[] = {
    {"full", {NULL}},
    {"streaming", {"n_sink=2", "window=8", NULL}},
    {"confkv",
     {"budget_tight=8", "budget_loose=12", "protect=2", "fp16_window=4", "pyramid=1", NULL}},
    {"weightedkv", {"cache_size=10", "n_init=2", "n_recent=3", NULL}},
    {"reviver", {"budget=20", "slack=0", NULL}},
    {"h2o", {"budget=12", "recent=4", "sinks=1", NULL}},
    {"tova", {"budget=12", NULL}},
    {"snapkv", {"window=4", "budget=10", NULL}},
    {"adakv", {"window=4", "budget=10", NULL}},
    {"criticalkv", {"window=4", "budget=10", NULL}},
    {"criticalkv_ada", {"window=4", "budget=10", NULL}},
    {"ov_block",
     {"start_size=4", "recent_size=4", "max_cache_size=16", "snapkv_window=8", "kvcrush_budget=1",
      "max_pool_window=3", NULL}},
};

static const txn_case *case_of(const char *policy)
{
    for (size_t i = 0; i < PH_N(cases); i++)
        if (strcmp(cases[i].policy, policy) == 0)
            return &cases[i];
    fail_msg("policy %s has no case in test_policy_txn.c", policy);
    return NULL;
}

/* ---- stats: every array any policy reads, sized by the view -------------- */

typedef struct txn_stats {
    policy_stats st;
    float *score, *last[QH], *win[QH], *vn[KVH];
    const float *last_p[QH], *win_p[QH], *vn_p[KVH];
} txn_stats;

/* Stats for view v (the same on twins, so the same stats), drawn from seed. */
static void stats_build(txn_stats *s, const policy_layer_view *v, uint32_t new_tokens, int prefill,
                        uint64_t seed)
{
    memset(s, 0, sizeof *s);
    uint64_t r = seed;
    uint32_t group = QH / KVH;
    if (v->heads == 1) {
        s->score = ph_calloc(v->tokens[0], sizeof(float));
        for (uint32_t i = 0; i < v->tokens[0]; i++)
            s->score[i] = ph_uniform(&r, 0, 1);
        s->st.score = s->score;
    }
    for (uint32_t h = 0; h < QH; h++) {
        uint32_t n = v->tokens[v->heads == 1 ? 0 : h / group];
        s->last[h] = ph_calloc(n, sizeof(float));
        s->win[h] = ph_calloc(n, sizeof(float));
        for (uint32_t i = 0; i < n; i++) {
            s->last[h][i] = ph_uniform(&r, 0, 1);
            s->win[h][i] = ph_uniform(&r, 0, 1);
        }
        s->last_p[h] = s->last[h];
        s->win_p[h] = s->win[h];
    }
    for (uint32_t g = 0; g < KVH; g++) {
        uint32_t n = v->tokens[v->heads == 1 ? 0 : g];
        s->vn[g] = ph_calloc(n, sizeof(float));
        for (uint32_t i = 0; i < n; i++)
            s->vn[g][i] = ph_uniform(&r, 0, 2);
        s->vn_p[g] = s->vn[g];
    }
    s->st.new_tokens = new_tokens;
    s->st.prefill = prefill;
    s->st.score_queries = 1; /* ov_block: one SnapKV query per step */
    s->st.last_attn = s->last_p;
    s->st.window_attn = s->win_p;
    s->st.window_queries = WINDOW;
    s->st.vnorm = s->vn_p;
    s->st.confidence = ph_uniform(&r, 0, 1);
}

static void stats_free(txn_stats *s)
{
    free(s->score);
    for (uint32_t h = 0; h < QH; h++) {
        free(s->last[h]);
        free(s->win[h]);
    }
    for (uint32_t g = 0; g < KVH; g++)
        free(s->vn[g]);
}

/* ---- comparing twins ------------------------------------------------------- */

static void expect_same_view(policy_host *a, policy_host *b, uint32_t l, const char *when)
{
    const policy_layer_view *x = policy_host_view(a, l), *y = policy_host_view(b, l);
    if (x->heads != y->heads || x->appended != y->appended || x->step != y->step)
        fail_msg("%s: layer %u view counters differ (appended %llu/%llu, step %llu/%llu)", when, l,
                 (unsigned long long)x->appended, (unsigned long long)y->appended,
                 (unsigned long long)x->step, (unsigned long long)y->step);
    for (uint32_t k = 0; k < x->heads; k++) {
        if (x->tokens[k] != y->tokens[k])
            fail_msg("%s: layer %u list %u holds %u vs %u tokens", when, l, k, x->tokens[k],
                     y->tokens[k]);
        for (uint32_t i = 0; i < x->tokens[k]; i++)
            if (x->positions[k][i] != y->positions[k][i] || x->tier[k][i] != y->tier[k][i])
                fail_msg("%s: layer %u list %u token %u differs", when, l, k, i);
    }
}

static void expect_same_describe(policy_host *a, policy_host *b, uint32_t l, const char *when)
{
    const policy_ops *ops = policy_host_ops(a);
    if (ops->describe == NULL)
        return;
    char *x = ops->describe(policy_host_state(a), l), *y = ops->describe(policy_host_state(b), l);
    if ((x == NULL) != (y == NULL) || (x != NULL && strcmp(x, y) != 0))
        fail_msg("%s: %s describe(%u) differs:\n  %s\n  %s", when, ops->name, l, x ? x : "(null)",
                 y ? y : "(null)");
    free(x);
    free(y);
}

static void expect_same_tier_order(policy_host *a, policy_host *b, uint32_t l, const char *when)
{
    size_t nx, ny;
    const uint32_t *x = policy_host_tier_order(a, l, &nx), *y = policy_host_tier_order(b, l, &ny);
    if (nx != ny || (nx > 0 && memcmp(x, y, nx * sizeof *x) != 0))
        fail_msg("%s: layer %u tier order differs (%zu vs %zu entries)", when, l, nx, ny);
}

static void expect_same_hosts(policy_host *a, policy_host *b, const char *when)
{
    for (uint32_t l = 0; l < LAYERS; l++) {
        expect_same_view(a, b, l, when);
        expect_same_describe(a, b, l, when);
        expect_same_tier_order(a, b, l, when);
    }
}

static void expect_same_decision(const policy_decision *x, const policy_decision *y,
                                 const policy_layer_view *v, const char *when)
{
    for (uint32_t k = 0; k < v->heads; k++)
        if (memcmp(x->tier[k], y->tier[k], v->tokens[k]) != 0)
            fail_msg("%s: layer %u list %u decisions differ", when, v->layer, k);
    assert_int_equal(x->nmerges, y->nmerges);
    for (size_t m = 0; m < x->nmerges; m++)
        if (memcmp(&x->merges[m], &y->merges[m], sizeof x->merges[m]) != 0)
            fail_msg("%s: layer %u merge %zu differs", when, v->layer, m);
    assert_int_equal(x->rerotate_keys, y->rerotate_keys);
    assert_true(x->rope_theta == y->rope_theta);
    assert_int_equal(x->rope_pairing, y->rope_pairing);
}

/* ---- driving hosts ---------------------------------------------------------- */

/* Step layer l of every host with the same stats (drawn from seed and the
 * first host's view), check that they decide alike, and commit unless
 * `pending`. */
static void step_layer(policy_host *const *h, size_t nh, uint32_t l, uint32_t new_tokens,
                       int prefill, uint64_t seed, int pending, const char *when)
{
    txn_stats s;
    stats_build(&s, policy_host_view(h[0], l), new_tokens, prefill, seed);
    const policy_decision *d0 = ph_decide(h[0], l, &s.st);
    for (size_t i = 1; i < nh; i++) {
        const policy_decision *d = ph_decide(h[i], l, &s.st);
        expect_same_decision(d0, d, policy_host_view(h[0], l), when);
        expect_same_tier_order(h[0], h[i], l, when);
    }
    if (!pending) {
        size_t e0 = policy_host_commit(h[0], l);
        for (size_t i = 1; i < nh; i++)
            assert_int_equal(policy_host_commit(h[i], l), e0);
    }
    stats_free(&s);
}

/* One step of a sequence on every host: append n, step and commit every
 * layer in order (descending when `down`). */
static void step_all(policy_host *const *h, size_t nh, uint32_t n, int prefill, uint64_t seed,
                     int down, const char *when)
{
    for (size_t i = 0; i < nh; i++)
        assert_int_equal(policy_host_append(h[i], n), 0);
    for (uint32_t j = 0; j < LAYERS; j++) {
        uint32_t l = down ? LAYERS - 1 - j : j;
        step_layer(h, nh, l, n, prefill, seed * 31 + l, 0, when);
    }
    for (size_t i = 1; i < nh; i++)
        expect_same_hosts(h[0], h[i], when);
}

/* ---- scenarios ---------------------------------------------------------------- */

/* What happens on A inside its transaction (B does nothing, except in a
 * `keep` scenario, where B does the same without a transaction). */
typedef struct txn_scenario {
    const char *name;
    uint32_t warm_decode; /* decode steps before the transaction (after the prompt) */
    int at_prompt;        /* the transaction is the prompt itself (empty state at begin) */
    uint32_t append;      /* tokens appended in the transaction */
    int down;             /* layers stepped last to first */
    int restep;           /* layer 0 stepped (and committed) a second time */
    int mid_call;         /* layer 0 committed, layer 1 stepped, then rollback */
    int keep;             /* end instead of rollback */
    int no_steps;         /* only append in the transaction */
    uint32_t append_more; /* then appended, every layer stepped again (a second chunk) */
} txn_scenario;

static const txn_scenario scenarios[] = {
    {"rollback a whole step", 6, 0, 3, 0, 1, 0, 0, 0, 0},
    {"rollback, layers last to first", 6, 0, 5, 1, 0, 0, 0, 0, 0},
    {"rollback in the middle of a call", 6, 0, 1, 0, 0, 1, 0, 0, 0},
    {"rollback appends only", 4, 0, 4, 0, 0, 0, 0, 1, 0},
    {"rollback the prompt", 0, 1, 14, 0, 0, 0, 0, 0, 0},
    {"rollback before anything held", 0, 1, 0, 0, 0, 0, 0, 0, 0},
    {"end keeps a whole step", 6, 0, 3, 0, 1, 0, 1, 0, 0},
    {"end keeps, layers last to first", 6, 0, 5, 1, 0, 0, 1, 0, 0},
    {"rollback two chunks", 6, 0, 2, 0, 1, 0, 0, 0, 7},
    {"rollback a long decode", 40, 0, 1, 0, 1, 0, 0, 0, 1},
    {"end keeps two chunks", 6, 0, 2, 0, 1, 0, 1, 0, 7},
};

#define PROMPT 10
#define AFTER 10 /* decode steps both take after the transaction */

/* A's transaction. Stats come from seeds no twin step uses. */
static void run_txn(policy_host *a, policy_host *b, const txn_scenario *sc, const char *when)
{
    policy_host *only_a[] = {a}, *both[] = {a, b};
    int prefill = sc->at_prompt;
    policy_host_begin(a);
    if (sc->append > 0)
        assert_int_equal(policy_host_append(a, sc->append), 0);
    if (sc->keep)
        assert_int_equal(policy_host_append(b, sc->append), 0);
    if (sc->no_steps || sc->append == 0) {
        policy_host_rollback(a);
        policy_host_end(a); /* after rollback: nothing left to keep */
        return;
    }
    policy_host *const *h = sc->keep ? both : only_a;
    size_t nh = sc->keep ? 2 : 1;
    for (uint32_t j = 0; j < LAYERS; j++) {
        uint32_t l = sc->down ? LAYERS - 1 - j : j;
        if (sc->mid_call && l == 1) {
            step_layer(h, nh, l, sc->append, prefill, 0xC0FFEE + l, 1, when);
            break;
        }
        step_layer(h, nh, l, sc->append, prefill, 0xC0FFEE + l, 0, when);
    }
    for (size_t i = 0; i < nh && sc->append_more > 0; i++)
        assert_int_equal(policy_host_append(h[i], sc->append_more), 0);
    for (uint32_t l = 0; sc->append_more > 0 && l < LAYERS; l++)
        step_layer(h, nh, l, sc->append_more, prefill, 0xF00D + l, 0, when);
    if (sc->restep)
        step_layer(h, nh, 0, 0, prefill, 0xBEEF, 0, when);
    if (sc->keep) {
        policy_host_end(a);
        return;
    }
    policy_host_rollback(a);
    policy_host_end(a);
}

static void run_scenario(const char *policy, const txn_scenario *sc)
{
    const txn_case *tc = case_of(policy);
    char when[160];
    policy_host *a = ph_host(policy, tc->kv, geom), *b = ph_host(policy, tc->kv, geom);
    policy_host *both[] = {a, b};
    uint64_t seed = 1;
    snprintf(when, sizeof when, "%s, %s, before", policy, sc->name);
    if (!sc->at_prompt) {
        step_all(both, 2, PROMPT, 1, seed++, 0, when);
        for (uint32_t i = 0; i < sc->warm_decode; i++)
            step_all(both, 2, 1 + i % 2, 0, seed++, 0, when);
    }
    snprintf(when, sizeof when, "%s, %s, transaction", policy, sc->name);
    run_txn(a, b, sc, when);
    snprintf(when, sizeof when, "%s, %s, after the transaction", policy, sc->name);
    expect_same_hosts(a, b, when);
    if (sc->at_prompt)
        step_all(both, 2, PROMPT, 1, seed++, 0, when);
    for (uint32_t i = 0; i < AFTER; i++) {
        snprintf(when, sizeof when, "%s, %s, step %u after", policy, sc->name, i + 1);
        step_all(both, 2, 1 + i % 3, 0, seed++, sc->down && i == 0, when);
    }
    policy_host_destroy(a);
    policy_host_destroy(b);
}

/* Every scenario on every registered policy. */
static void test_twins(void **unused)
{
    (void)unused;
    size_t n;
    const policy_ops *const *all = policy_list(&n);
    for (size_t p = 0; p < n; p++)
        for (size_t s = 0; s < PH_N(scenarios); s++)
            run_scenario(all[p]->name, &scenarios[s]);
}

/* A policy whose step changes state brings the whole trio; the others none. */
static void test_trio(void **unused)
{
    (void)unused;
    size_t n;
    const policy_ops *const *all = policy_list(&n);
    for (size_t p = 0; p < n; p++) {
        const policy_ops *ops = all[p];
        int has = ops->save != NULL;
        assert_int_equal(ops->restore != NULL, has);
        assert_int_equal(ops->discard != NULL, has);
    }
    const char *stateful[] = {"h2o",        "confkv",         "weightedkv", "reviver", "adakv",
                              "criticalkv", "criticalkv_ada", "snapkv",     "ov_block"};
    for (size_t i = 0; i < PH_N(stateful); i++)
        if (ph_ops(stateful[i])->save == NULL)
            fail_msg("%s changes per-layer state in step but has no save()", stateful[i]);
}

/* Destroying a host with a transaction open frees the saved copies (ASan
 * finds a leak otherwise), and steps inside it saved each layer once. */
static void test_destroy_open(void **unused)
{
    (void)unused;
    size_t n;
    const policy_ops *const *all = policy_list(&n);
    for (size_t p = 0; p < n; p++) {
        const txn_case *tc = case_of(all[p]->name);
        policy_host *h = ph_host(tc->policy, tc->kv, geom);
        policy_host *one[] = {h};
        step_all(one, 1, PROMPT, 1, 7, 0, tc->policy);
        policy_host_begin(h);
        policy_host_begin(h); /* transactions do not nest: a no-op */
        step_all(one, 1, 2, 0, 8, 0, tc->policy);
        step_all(one, 1, 1, 0, 9, 0, tc->policy);
        policy_host_destroy(h);
    }
}

/* ---- layers stepped on threads ---------------------------------------------------- */

/* A steps every layer at once on three threads (policy_host_step_layers,
 * no token minimum), B one layer after another: the same decisions, and
 * the same hosts after each commit. drop_layer (-1: none) loses the arrays
 * of that layer's stats: both must then fail alike. */
static int step_threaded(policy_host *a, policy_host *b, uint32_t n, int prefill, uint64_t seed,
                         int drop_layer, const char *when)
{
    txn_stats s[LAYERS];
    policy_stats ps[LAYERS];
    assert_int_equal(policy_host_append(a, n), 0);
    assert_int_equal(policy_host_append(b, n), 0);
    for (uint32_t l = 0; l < LAYERS; l++) {
        stats_build(&s[l], policy_host_view(a, l), n, prefill, seed * 31 + l);
        ps[l] = s[l].st;
        if ((int)l == drop_layer) /* every array a policy may need, gone */
            ps[l].score = NULL, ps[l].last_attn = ps[l].window_attn = ps[l].vnorm = NULL;
    }
    const policy_decision *da[LAYERS], *db;
    char ea[POLICY_ERR_LEN] = "", eb[POLICY_ERR_LEN] = "";
    int ra = policy_host_step_layers(a, ps, NULL, NULL, da, ea, sizeof ea), rb = 0;
    for (uint32_t l = 0; rb == 0 && l < LAYERS; l++) {
        rb = policy_host_step(b, l, &ps[l], &db, eb, sizeof eb);
        if (rb == 0 && ra == 0)
            expect_same_decision(da[l], db, policy_host_view(b, l), when);
    }
    if (ra != rb || strcmp(ea, eb) != 0)
        fail_msg("%s: threaded step answered %d \"%s\", one layer at a time %d \"%s\"", when, ra,
                 ea, rb, eb);
    for (uint32_t l = 0; ra == 0 && l < LAYERS; l++)
        assert_int_equal(policy_host_commit(a, l), policy_host_commit(b, l));
    if (ra == 0)
        expect_same_hosts(a, b, when);
    for (uint32_t l = 0; l < LAYERS; l++)
        stats_free(&s[l]);
    return ra;
}

/* A prompt long enough that a layer's step outlasts starting a thread, so
 * that the layers do go to both (and the TSan build sees them there). */
#define THREADED_PROMPT 40000

/* A prompt and decode steps on threads equal the same one layer at a
 * time; a step whose layer 1 lacks its statistics fails with that layer's
 * message on both, and rolls back to equal hosts. */
static void layers_on_threads(const txn_case *tc)
{
    const policy_ops *ops = ph_ops(tc->policy);
    policy_host *a = ph_host(tc->policy, tc->kv, geom), *b = ph_host(tc->policy, tc->kv, geom);
    policy_host_set_threads(a, 3, 0);
    char when[160];
    snprintf(when, sizeof when, "%s on threads, prompt", tc->policy);
    step_threaded(a, b, THREADED_PROMPT, 1, 1, -1, when);
    for (uint32_t i = 0; i < 12; i++) {
        snprintf(when, sizeof when, "%s on threads, step %u", tc->policy, i + 1);
        step_threaded(a, b, 1 + i % 3, 0, 2 + i, -1, when);
    }
    if (ops->needs != 0) {
        snprintf(when, sizeof when, "%s on threads, layer 1 without statistics", tc->policy);
        policy_host_begin(a);
        policy_host_begin(b);
        assert_int_equal(step_threaded(a, b, 2, 0, 40, 1, when), -1);
        policy_host_rollback(a);
        policy_host_rollback(b);
        policy_host_end(a);
        policy_host_end(b);
        expect_same_hosts(a, b, when);
    }
    for (uint32_t i = 0; i < 4; i++) {
        snprintf(when, sizeof when, "%s on threads, step %u after", tc->policy, i + 1);
        step_threaded(a, b, 1, 0, 50 + i, -1, when);
    }
    policy_host_destroy(a);
    policy_host_destroy(b);
}

/* Every policy as above; ov_block also as its layers step at once, with
 * KVCrush anchors that draw nothing from its generator, and without
 * KVCrush (its case here draws random anchors: one layer at a time). */
static void test_layers_on_threads(void **unused)
{
    (void)unused;
    size_t n;
    const policy_ops *const *all = policy_list(&n);
    for (size_t p = 0; p < n; p++)
        layers_on_threads(case_of(all[p]->name));
    const txn_case ov[] = {
        {"ov_block",
         {"start_size=4", "recent_size=4", "max_cache_size=16", "snapkv_window=8",
          "kvcrush_budget=1", "kvcrush_anchor=mean", "max_pool_window=3", NULL}},
        {"ov_block",
         {"start_size=4", "recent_size=8", "max_cache_size=24", "snapkv_window=8",
          "aggregation=sum", NULL}},
    };
    for (size_t c = 0; c < PH_N(ov); c++)
        layers_on_threads(&ov[c]);
}

/* ---- a save that fails ---------------------------------------------------------- */

static policy_ops flaky; /* h2o whose save() fails while flaky_fail is set */
static int flaky_fail;

static int flaky_save(void *state, uint32_t layer, void **saved)
{
    if (flaky_fail) {
        errno = ENOMEM;
        return -1;
    }
    return ph_ops("h2o")->save(state, layer, saved);
}

/* The step answers -1 with errno ENOMEM and changes nothing: no decision
 * pending, the lists and the policy as they were; the transaction goes on
 * and still rolls back exactly. */
static void test_save_fails(void **unused)
{
    (void)unused;
    flaky = *ph_ops("h2o");
    flaky.save = flaky_save;
    const txn_case *tc = case_of("h2o");
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {"budget", "recent", "sinks"}, *vals[] = {"12", "4", "1"};
    assert_int_equal(policy_params_resolve(&flaky, keys, vals, 3, &p, err, sizeof err), 0);
    policy_host *a = NULL, *b = ph_host("h2o", tc->kv, geom);
    assert_int_equal(policy_host_create(&flaky, &p, &geom, &a, err, sizeof err), 0);
    policy_host *both[] = {a, b};
    step_all(both, 2, PROMPT, 1, 3, 0, "flaky prompt");
    step_all(both, 2, 5, 0, 4, 0, "flaky decode"); /* 15 tokens: over budget */

    policy_host_begin(a);
    assert_int_equal(policy_host_append(a, 3), 0);
    txn_stats s;
    stats_build(&s, policy_host_view(a, 0), 3, 0, 5);
    const policy_decision *d = NULL;
    flaky_fail = 1;
    errno = 0;
    assert_int_equal(policy_host_step(a, 0, &s.st, &d, err, sizeof err), -1);
    assert_int_equal(errno, ENOMEM);
    assert_int_equal(policy_host_commit(a, 0), 0); /* nothing pending */
    flaky_fail = 0;
    stats_free(&s);
    /* B catches up with the append; the failed step changed nothing else. */
    assert_int_equal(policy_host_append(b, 3), 0);
    expect_same_hosts(a, b, "after a failed save");
    /* The retried step saves and steps; rollback undoes it and the append. */
    policy_host *only_a[] = {a};
    step_layer(only_a, 1, 0, 3, 0, 6, 0, "retry");
    policy_host_rollback(a);
    policy_host_end(a);
    policy_host_destroy(b);
    b = ph_host("h2o", tc->kv, geom);
    both[1] = b;
    step_all(&b, 1, PROMPT, 1, 3, 0, "twin again");
    step_all(&b, 1, 5, 0, 4, 0, "twin again");
    expect_same_hosts(a, b, "after rollback of a retried save");
    for (uint64_t i = 0; i < 6; i++)
        step_all(both, 2, 1, 0, 10 + i, 0, "flaky after");
    policy_host_destroy(a);
    policy_host_destroy(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trio),         cmocka_unit_test(test_twins),
        cmocka_unit_test(test_destroy_open), cmocka_unit_test(test_layers_on_threads),
        cmocka_unit_test(test_save_fails),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
