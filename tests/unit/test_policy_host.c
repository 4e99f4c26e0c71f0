/*
 * test_policy_host.c - unit tests for the policy host (policies/host.h):
 * appending, the views it shows, running a policy's step, and committing
 * decisions, with fake policies defined here so that every outcome is known.
 *
 * fake_mod3 (one list per layer) evicts every token whose position is
 * divisible by 3 and demotes position % 3 == 1 to INT8. fake_head (per KV
 * head) evicts in head h the positions divisible by h + 2 and moves
 * position h to the sketch, so the heads' lists diverge. Both record what
 * the host showed them (fake_state) and check the preset decision.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "host.h"
#include "policy.h"
#include "util.h"

#define MAX_LAYERS 8

/* ---- fake policies ---- */

typedef struct fake_state {
    policy_geometry geom;
    char tag[64];
    int passive; /* observe only, decide nothing */
    uint64_t calls;
    uint32_t last_layer;                /* view->layer of the last call */
    uint32_t last_heads;                /* view->heads of the last call */
    const policy_stats *last_stats;     /* the stats pointer of the last call */
    uint64_t step_seen[MAX_LAYERS];     /* view->step, per layer */
    uint64_t appended_seen[MAX_LAYERS]; /* view->appended, per layer */
    unsigned preset_errors;             /* decision not preset to the view */
    unsigned cap_errors;                /* merges_cap < tokens in the view */
    unsigned order_errors;              /* positions not ascending */
    uint64_t non_full_seen;             /* tokens seen with a tier other than FULL */
} fake_state;

static int g_destroys;
static void *g_last_destroyed;

static const policy_param_spec fake_params[] = {
    {.key = "tag", .def = "none", .help = "any text, kept in the state"},
};

static int fake_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                       size_t errlen)
{
    fake_state *st = calloc(1, sizeof *st);
    if (st == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    st->geom = *g;
    const char *tag = policy_params_get(p, "tag");
    snprintf(st->tag, sizeof st->tag, "%s", tag ? tag : "(missing)");
    *state = st;
    return 0;
}

static void fake_destroy(void *state)
{
    g_destroys++;
    g_last_destroyed = state;
    free(state);
}

/* Record the call and check what every decision must look like on entry. */
static void fake_observe(fake_state *st, const policy_layer_view *v, const policy_stats *stats,
                         policy_decision *d)
{
    st->calls++;
    st->last_layer = v->layer;
    st->last_heads = v->heads;
    st->last_stats = stats;
    if (v->layer < MAX_LAYERS) {
        st->step_seen[v->layer] = v->step;
        st->appended_seen[v->layer] = v->appended;
    }
    size_t total = 0;
    for (uint32_t h = 0; h < v->heads; h++) {
        total += v->tokens[h];
        for (uint32_t i = 0; i < v->tokens[h]; i++) {
            if (d->tier[h][i] != v->tier[h][i])
                st->preset_errors++;
            if (v->tier[h][i] != POLICY_FULL)
                st->non_full_seen++;
            if (i > 0 && v->positions[h][i] <= v->positions[h][i - 1])
                st->order_errors++;
            if (v->positions[h][i] >= v->appended)
                st->order_errors++;
        }
    }
    if (d->nmerges != 0 || d->rerotate_keys != 0)
        st->preset_errors++;
    if (d->merges_cap < total || (total > 0 && d->merges == NULL))
        st->cap_errors++;
    /* Touch all of the promised room (ASan catches a capacity that lies). */
    for (size_t i = 0; i < d->merges_cap; i++)
        d->merges[i] = (policy_merge){.head = 0, .from = 0, .into = 0, .w_from = 1, .w_into = 1};
}

static int fake_mod3_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                          policy_decision *d, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    fake_state *st = state;
    fake_observe(st, v, stats, d);
    if (st->passive)
        return 0;
    uint32_t n = v->tokens[0];
    const uint32_t *pos = v->positions[0];
    for (uint32_t i = 0; i < n; i++) {
        if (pos[i] % 3 == 0)
            d->tier[0][i] = POLICY_EVICT;
        else if (pos[i] % 3 == 1)
            d->tier[0][i] = POLICY_INT8;
    }
    /* A merge of the first evicted token into the next kept one, and a
     * re-rotation: the next step's decision must come back cleared. */
    for (uint32_t i = 0; i + 1 < n; i++)
        if (pos[i] % 3 == 0) {
            d->merges[0] =
                (policy_merge){.head = 0, .from = i, .into = i + 1, .w_from = 1, .w_into = 1};
            d->nmerges = 1;
            break;
        }
    d->rerotate_keys = 1;
    return 0;
}

static int fake_head_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                          policy_decision *d, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    fake_state *st = state;
    fake_observe(st, v, stats, d);
    if (st->passive)
        return 0;
    for (uint32_t h = 0; h < v->heads; h++)
        for (uint32_t i = 0; i < v->tokens[h]; i++) {
            uint32_t p = v->positions[h][i];
            if (p % (h + 2) == 0)
                d->tier[h][i] = POLICY_EVICT;
            else if (p == h)
                d->tier[h][i] = POLICY_SKETCH;
        }
    return 0;
}

/* Needs scores: evicts tokens scoring below 0.5. Without scores it first
 * scribbles EVICT over the whole decision, then refuses. */
static int fake_score_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                           policy_decision *d, char *err, size_t errlen)
{
    fake_state *st = state;
    fake_observe(st, v, stats, d);
    for (uint32_t i = 0; i < v->tokens[0]; i++) {
        if (stats->score == NULL)
            d->tier[0][i] = POLICY_EVICT;
        else if (stats->score[i] < 0.5f)
            d->tier[0][i] = POLICY_EVICT;
    }
    if (stats->score == NULL) {
        snprintf(err, errlen, "fake-score needs attention scores (layer %u)", v->layer);
        return -1;
    }
    return 0;
}

static int fail_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                       size_t errlen)
{
    (void)g;
    *state = (void *)p; /* garbage the host must not destroy */
    snprintf(err, errlen, "parameter tag must be 'ok', got '%s'", policy_params_get(p, "tag"));
    return -1;
}

static const policy_ops fake_mod3 = {
    .name = "fake-mod3",
    .summary = "evict p % 3 == 0, INT8 for p % 3 == 1",
    .params = fake_params,
    .nparams = 1,
    .merges = 1, /* fake_observe checks the room */
    .create = fake_create,
    .step = fake_mod3_step,
    .destroy = fake_destroy,
};

static const policy_ops fake_head = {
    .name = "fake-head",
    .summary = "per KV head h: evict p % (h + 2) == 0, sketch p == h",
    .params = fake_params,
    .nparams = 1,
    .per_head = 1,
    .merges = 1, /* fake_observe checks the room */
    .create = fake_create,
    .step = fake_head_step,
    .destroy = fake_destroy,
};

static const policy_ops fake_score = {
    .name = "fake-score",
    .summary = "evict score < 0.5",
    .params = fake_params,
    .nparams = 1,
    .needs = POLICY_NEEDS_SCORE,
    .merges = 1, /* fake_observe checks the room */
    .create = fake_create,
    .step = fake_score_step,
    .destroy = fake_destroy,
};

static const policy_ops fake_fail = {
    .name = "fake-fail",
    .summary = "create always fails",
    .params = fake_params,
    .nparams = 1,
    .merges = 1, /* fake_observe checks the room */
    .create = fail_create,
    .step = fake_mod3_step,
    .destroy = fake_destroy,
};

/* ---- helpers ---- */

static policy_geometry geometry(uint32_t layers, uint32_t kv_heads)
{
    policy_geometry g = {.layers = layers,
                         .q_heads = kv_heads * 4,
                         .kv_heads = kv_heads,
                         .head_dim = 128,
                         .block_tokens = 16,
                         .rope_theta = 500000.0f};
    return g;
}

static policy_host *host_new(const policy_ops *ops, uint32_t layers, uint32_t kv_heads)
{
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {"tag"};
    const char *values[] = {"hello"};
    if (policy_params_resolve(ops, keys, values, 1, &p, err, sizeof(err)) != 0)
        fail_msg("resolve: %s", err);
    policy_geometry g = geometry(layers, kv_heads);
    policy_host *h = NULL;
    if (policy_host_create(ops, &p, &g, &h, err, sizeof(err)) != 0)
        fail_msg("create: %s", err);
    assert_non_null(h);
    return h;
}

static fake_state *state_of(policy_host *h)
{
    fake_state *st = policy_host_state(h);
    assert_non_null(st);
    return st;
}

static void check_fake_clean(policy_host *h)
{
    fake_state *st = state_of(h);
    assert_int_equal(st->preset_errors, 0);
    assert_int_equal(st->cap_errors, 0);
    assert_int_equal(st->order_errors, 0);
}

static const policy_decision *step_ok(policy_host *h, uint32_t layer, const policy_stats *stats)
{
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, layer, stats, &d, err, sizeof(err)) != 0)
        fail_msg("step of layer %u: %s", layer, err);
    assert_non_null(d);
    return d;
}

/* Every list of every layer holds exactly positions 0..n-1, all FULL. */
static void check_all_full(policy_host *h, uint32_t layers, uint32_t n)
{
    for (uint32_t l = 0; l < layers; l++) {
        const policy_layer_view *v = policy_host_view(h, l);
        assert_int_equal(v->layer, l);
        assert_int_equal(v->heads, policy_host_heads(h));
        assert_int_equal(v->appended, n);
        for (uint32_t k = 0; k < v->heads; k++) {
            assert_int_equal(v->tokens[k], n);
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(v->positions[k][i], i);
                assert_int_equal(v->tier[k][i], POLICY_FULL);
            }
        }
    }
}

/* mod3's held list after T appends and a commit: {p < T : p % 3 != 0},
 * INT8 where p % 3 == 1 (if `decided` covers p), else FULL. */
static void check_mod3_list(policy_host *h, uint32_t layer, uint32_t total, uint32_t decided)
{
    const policy_layer_view *v = policy_host_view(h, layer);
    assert_int_equal(v->heads, 1);
    assert_int_equal(v->appended, total);
    uint32_t i = 0;
    for (uint32_t p = 0; p < total; p++) {
        if (p < decided && p % 3 == 0)
            continue;
        if (i >= v->tokens[0] || v->positions[0][i] != p)
            fail_msg("layer %u T=%u: position %u should be at index %u", layer, total, p, i);
        uint8_t want = p < decided && p % 3 == 1 ? POLICY_INT8 : POLICY_FULL;
        if (v->tier[0][i] != want)
            fail_msg("layer %u position %u: tier %u, expected %u", layer, p, v->tier[0][i], want);
        i++;
    }
    assert_int_equal(v->tokens[0], i);
}

/* ---- create / destroy ---- */

static void test_create_and_destroy(void **unused)
{
    (void)unused;
    int destroys = g_destroys;
    policy_host *h = host_new(&fake_mod3, 3, 4);
    assert_ptr_equal(policy_host_ops(h), &fake_mod3);
    assert_int_equal(policy_host_heads(h), 1);
    fake_state *st = state_of(h);
    assert_string_equal(st->tag, "hello");
    policy_geometry g = geometry(3, 4);
    assert_memory_equal(&st->geom, &g, sizeof(g));
    assert_int_equal(st->calls, 0);
    /* Empty views before anything happened. */
    for (uint32_t l = 0; l < 3; l++) {
        const policy_layer_view *v = policy_host_view(h, l);
        assert_int_equal(v->layer, l);
        assert_int_equal(v->heads, 1);
        assert_int_equal(v->tokens[0], 0);
        assert_int_equal(v->appended, 0);
        assert_int_equal(v->step, 0);
        assert_int_equal(policy_host_commit(h, l), 0);
    }
    assert_int_equal(g_destroys, destroys);
    policy_host_destroy(h);
    assert_int_equal(g_destroys, destroys + 1);
    assert_ptr_equal(g_last_destroyed, st);

    /* A per-head policy gets one list per KV head. */
    h = host_new(&fake_head, 2, 8);
    assert_int_equal(policy_host_heads(h), 8);
    assert_int_equal(policy_host_view(h, 1)->heads, 8);
    policy_host_destroy(h);
    assert_int_equal(g_destroys, destroys + 2);

    policy_host_destroy(NULL);
}

static void test_create_failure(void **unused)
{
    (void)unused;
    int destroys = g_destroys;
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {"tag"};
    const char *values[] = {"nope"};
    assert_int_equal(policy_params_resolve(&fake_fail, keys, values, 1, &p, err, sizeof(err)), 0);
    policy_geometry g = geometry(2, 2);
    policy_host *h = (policy_host *)&p;
    assert_int_equal(policy_host_create(&fake_fail, &p, &g, &h, err, sizeof(err)), -1);
    assert_null(h);
    assert_string_equal(err, "parameter tag must be 'ok', got 'nope'");
    assert_int_equal(g_destroys, destroys); /* no state was made */

    /* A real policy's message comes through the same way. */
    const policy_ops *streaming = policy_find("streaming");
    assert_non_null(streaming);
    const char *skeys[] = {"window"};
    const char *svalues[] = {"-3"};
    assert_int_equal(policy_params_resolve(streaming, skeys, svalues, 1, &p, err, sizeof(err)), 0);
    h = (policy_host *)&p;
    assert_int_equal(policy_host_create(streaming, &p, &g, &h, err, sizeof(err)), -1);
    assert_null(h);
    assert_string_equal(err, "parameter window must be an integer in [1, 1048576], got '-3'");
}

/* ---- append ---- */

static void test_append(void **unused)
{
    (void)unused;
    policy_host *h = host_new(&fake_mod3, 3, 4);
    assert_int_equal(policy_host_append(h, 5), 0);
    check_all_full(h, 3, 5);
    assert_int_equal(policy_host_append(h, 0), 0);
    check_all_full(h, 3, 5);
    assert_int_equal(policy_host_append(h, 1), 0);
    assert_int_equal(policy_host_append(h, 300), 0); /* grows past the first capacity */
    check_all_full(h, 3, 306);
    assert_int_equal(state_of(h)->calls, 0); /* appending runs no policy */
    policy_host_destroy(h);

    /* Per head: the same tokens go to every head of every layer. */
    h = host_new(&fake_head, 2, 4);
    for (uint32_t i = 0; i < 40; i++)
        assert_int_equal(policy_host_append(h, i % 5), 0);
    check_all_full(h, 2, 80);
    policy_host_destroy(h);
}

/* Positions are uint32_t: an append that would wrap them is refused and
 * changes nothing. */
static void test_append_overflow(void **unused)
{
    (void)unused;
    policy_host *h = host_new(&fake_mod3, 2, 1);
    assert_int_equal(policy_host_append(h, 3), 0);
    assert_int_equal(policy_host_append(h, UINT32_MAX), -1);
    assert_int_equal(policy_host_append(h, UINT32_MAX - 2), -1);
    check_all_full(h, 2, 3);
    assert_int_equal(policy_host_append(h, 2), 0);
    check_all_full(h, 2, 5);
    policy_host_destroy(h);
}

/* Tokens appended after a commit arrive FULL beside the decided ones. */
static void test_append_after_commit(void **unused)
{
    (void)unused;
    policy_stats stats = {.confidence = -1.0};
    policy_host *h = host_new(&fake_mod3, 2, 1);
    assert_int_equal(policy_host_append(h, 10), 0);
    for (uint32_t l = 0; l < 2; l++) {
        step_ok(h, l, &stats);
        assert_int_equal(policy_host_commit(h, l), 4); /* 0, 3, 6, 9 */
    }
    assert_int_equal(policy_host_append(h, 5), 0);
    for (uint32_t l = 0; l < 2; l++)
        check_mod3_list(h, l, 15, 10);
    policy_host_destroy(h);
}

/* ---- step and commit ---- */

static void test_step_presets_decision(void **unused)
{
    (void)unused;
    policy_stats stats = {.new_tokens = 12, .prefill = 1, .confidence = -1.0};
    policy_host *h = host_new(&fake_mod3, 2, 1);
    fake_state *st = state_of(h);
    assert_int_equal(policy_host_append(h, 12), 0);
    for (uint32_t l = 0; l < 2; l++) {
        step_ok(h, l, &stats);
        policy_host_commit(h, l);
    }
    assert_int_equal(st->non_full_seen, 0);

    /* Now positions 1, 4, 7, 10 are INT8. A passive step must return a
     * decision equal to the current tiers, with no merges or re-rotation
     * left over from the last step. */
    st->passive = 1;
    assert_int_equal(policy_host_append(h, 3), 0);
    for (uint32_t l = 0; l < 2; l++) {
        const policy_decision *d = step_ok(h, l, &stats);
        const policy_layer_view *v = policy_host_view(h, l);
        assert_int_equal(v->tokens[0], 8 + 3);
        assert_memory_equal(d->tier[0], v->tier[0], v->tokens[0]);
        assert_int_equal(d->nmerges, 0);
        assert_int_equal(d->rerotate_keys, 0);
        assert_true(d->merges_cap >= v->tokens[0]);
        assert_int_equal(policy_host_commit(h, l), 0);
        check_mod3_list(h, l, 15, 12);
    }
    assert_int_equal(st->non_full_seen, 2 * 4);
    check_fake_clean(h);
    policy_host_destroy(h);
}

static void test_commit_mod3(void **unused)
{
    (void)unused;
    const uint32_t layers = 3;
    policy_host *h = host_new(&fake_mod3, layers, 4);
    uint32_t total = 0;
    for (uint32_t s = 1; s <= 40; s++) {
        uint32_t n = s % 9 == 0 ? 17 : 1;
        assert_int_equal(policy_host_append(h, n), 0);
        total += n;
        policy_stats stats = {.new_tokens = n, .confidence = -1.0};
        for (uint32_t l = 0; l < layers; l++) {
            const policy_decision *d = step_ok(h, l, &stats);
            const policy_layer_view *v = policy_host_view(h, l);
            /* The decision, before commit, in view order. */
            size_t want_evicted = 0, want_merges = 0;
            for (uint32_t i = 0; i < v->tokens[0]; i++) {
                uint32_t p = v->positions[0][i];
                uint8_t want = p % 3 == 0 ? POLICY_EVICT : p % 3 == 1 ? POLICY_INT8 : POLICY_FULL;
                assert_int_equal(d->tier[0][i], want);
                want_evicted += p % 3 == 0;
                want_merges |= p % 3 == 0 && i + 1 < v->tokens[0];
            }
            assert_int_equal(d->nmerges, want_merges);
            assert_int_equal(d->rerotate_keys, 1);
            /* Exactly the new tokens divisible by 3 go. */
            size_t new_div3 = 0;
            for (uint32_t p = total - n; p < total; p++)
                new_div3 += p % 3 == 0;
            assert_int_equal(want_evicted, new_div3);
            assert_int_equal(policy_host_commit(h, l), want_evicted);
            check_mod3_list(h, l, total, total);
            /* Committing again changes nothing. */
            assert_int_equal(policy_host_commit(h, l), 0);
            check_mod3_list(h, l, total, total);
        }
    }
    assert_int_equal(state_of(h)->calls, 40 * layers);
    check_fake_clean(h);
    policy_host_destroy(h);
}

/* A commit with no step before it, or for another layer, changes nothing. */
static void test_commit_without_step(void **unused)
{
    (void)unused;
    policy_stats stats = {.confidence = -1.0};
    policy_host *h = host_new(&fake_mod3, 2, 1);
    assert_int_equal(policy_host_append(h, 9), 0);
    assert_int_equal(policy_host_commit(h, 0), 0);
    assert_int_equal(policy_host_commit(h, 1), 0);
    check_all_full(h, 2, 9);
    step_ok(h, 0, &stats);
    assert_int_equal(policy_host_commit(h, 1), 0); /* layer 1 was not stepped */
    check_mod3_list(h, 1, 9, 0);
    assert_int_equal(policy_host_commit(h, 0), 3);
    check_mod3_list(h, 0, 9, 9);
    policy_host_destroy(h);
}

static void test_per_head_lists_diverge(void **unused)
{
    (void)unused;
    const uint32_t layers = 2, kv = 4;
    policy_host *h = host_new(&fake_head, layers, kv);
    fake_state *st = state_of(h);
    uint32_t total = 0;
    for (uint32_t s = 1; s <= 25; s++) {
        uint32_t n = s == 1 ? 30 : 1 + s % 3;
        assert_int_equal(policy_host_append(h, n), 0);
        total += n;
        policy_stats stats = {.new_tokens = n, .prefill = s == 1, .confidence = -1.0};
        for (uint32_t l = 0; l < layers; l++) {
            const policy_decision *d = step_ok(h, l, &stats);
            assert_int_equal(st->last_heads, kv);
            const policy_layer_view *v = policy_host_view(h, l);
            size_t want = 0;
            for (uint32_t k = 0; k < kv; k++)
                for (uint32_t i = 0; i < v->tokens[k]; i++) {
                    uint32_t p = v->positions[0 + k][i];
                    if (p % (k + 2) == 0) {
                        assert_int_equal(d->tier[k][i], POLICY_EVICT);
                        want++;
                    }
                }
            assert_int_equal(policy_host_commit(h, l), want);

            /* Head k holds {p < total : p % (k + 2) != 0}, position k in the sketch. */
            v = policy_host_view(h, l);
            assert_int_equal(v->heads, kv);
            for (uint32_t k = 0; k < kv; k++) {
                uint32_t i = 0;
                for (uint32_t p = 0; p < total; p++) {
                    if (p % (k + 2) == 0)
                        continue;
                    if (i >= v->tokens[k] || v->positions[k][i] != p)
                        fail_msg("layer %u head %u T=%u: position %u missing", l, k, total, p);
                    assert_int_equal(v->tier[k][i], p == k ? POLICY_SKETCH : POLICY_FULL);
                    i++;
                }
                assert_int_equal(v->tokens[k], i);
            }
        }
    }
    /* The lists really differ: head 0 keeps the odd positions only. */
    const policy_layer_view *v = policy_host_view(h, 1);
    assert_int_equal(v->tokens[0], total / 2);
    assert_true(v->tokens[1] > v->tokens[0]);
    assert_true(v->tokens[3] > v->tokens[2]);
    check_fake_clean(h);
    policy_host_destroy(h);
}

/* view->step counts the calls on layer 0; every layer of a step sees it. */
static void test_step_numbering(void **unused)
{
    (void)unused;
    const uint32_t layers = 4;
    policy_host *h = host_new(&fake_mod3, layers, 2);
    fake_state *st = state_of(h);
    st->passive = 1;
    uint64_t total = 0;
    for (uint64_t s = 1; s <= 20; s++) {
        uint32_t n = s == 1 ? 64 : 1;
        assert_int_equal(policy_host_append(h, n), 0);
        total += n;
        policy_stats stats = {.new_tokens = n, .confidence = -1.0};
        for (uint32_t l = 0; l < layers; l++) {
            step_ok(h, l, &stats);
            assert_int_equal(st->last_layer, l);
            assert_ptr_equal(st->last_stats, &stats);
            assert_int_equal(st->step_seen[l], s);
            assert_int_equal(st->appended_seen[l], total);
            policy_host_commit(h, l);
        }
        for (uint32_t l = 0; l < layers; l++)
            assert_int_equal(policy_host_view(h, l)->step, s);
    }

    /* Only layer 0 advances the count. */
    policy_stats stats = {.confidence = -1.0};
    step_ok(h, 3, &stats);
    step_ok(h, 2, &stats);
    assert_int_equal(st->step_seen[3], 20);
    assert_int_equal(st->step_seen[2], 20);
    step_ok(h, 0, &stats);
    assert_int_equal(st->step_seen[0], 21);
    step_ok(h, 1, &stats);
    assert_int_equal(st->step_seen[1], 21);
    assert_int_equal(st->calls, 20 * layers + 4);
    check_fake_clean(h);
    policy_host_destroy(h);
}

static void test_step_failure(void **unused)
{
    (void)unused;
    policy_host *h = host_new(&fake_score, 2, 1);
    assert_int_equal(policy_host_append(h, 8), 0);
    policy_stats none = {.new_tokens = 8, .confidence = -1.0};
    const float score[8] = {1, 0.1f, 1, 1, 0.2f, 1, 1, 0.3f};
    policy_stats scored = none;
    scored.score = score;
    scored.score_queries = 1;

    /* A refused step returns the policy's message and leaves nothing to commit. */
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 1, &none, &d, err, sizeof(err)), -1);
    assert_string_equal(err, "fake-score needs attention scores (layer 1)");
    assert_int_equal(policy_host_commit(h, 1), 0);
    check_all_full(h, 2, 8);

    /* A refused step after an uncommitted good one: the refused one's
     * scribbles must not be committed either. */
    step_ok(h, 0, &scored);
    memset(err, 0, sizeof(err));
    assert_int_equal(policy_host_step(h, 0, &none, &d, err, sizeof(err)), -1);
    assert_string_equal(err, "fake-score needs attention scores (layer 0)");
    assert_int_equal(policy_host_commit(h, 0), 0);
    check_all_full(h, 2, 8);

    /* And the policy works again once the stats are there. */
    for (uint32_t l = 0; l < 2; l++) {
        step_ok(h, l, &scored);
        assert_int_equal(policy_host_commit(h, l), 3);
        const policy_layer_view *v = policy_host_view(h, l);
        const uint32_t want[] = {0, 2, 3, 5, 6};
        assert_int_equal(v->tokens[0], 5);
        assert_memory_equal(v->positions[0], want, sizeof(want));
    }
    check_fake_clean(h);
    policy_host_destroy(h);
}

/* A step before any append: every list is empty and may have no arrays yet
 * (fuzz_replay found the host copying tiers from NULL, for 0 bytes: undefined
 * behaviour that the UBSan builds report; corpus/fuzz_replay/regress-*). */
static void test_step_before_any_append(void **unused)
{
    (void)unused;
    policy_host *h = host_new(&fake_mod3, 2, 2);
    state_of(h)->passive = 1;
    policy_stats stats = {.confidence = -1.0};
    for (uint32_t l = 0; l < 2; l++) {
        step_ok(h, l, &stats);
        assert_int_equal(policy_host_commit(h, l), 0);
    }
    check_all_full(h, 2, 0);
    check_fake_clean(h);
    policy_host_destroy(h);
}

/* Room for merges is at least the tokens of the view, over all heads. */
/* storage.h: demotion (int8=on, demote=int4) turns every held token but
 * the newest int8_window of a list to the demote tier; evicted and sketched
 * tokens do not count toward the window. */
static void test_storage_demote(void **unused)
{
    (void)unused;
    policy_storage st = {.demote = POLICY_INT8, .int8_window = 2};
    uint8_t t[7] = {POLICY_FULL, POLICY_EVICT, POLICY_FULL, POLICY_SKETCH,
                    POLICY_INT8, POLICY_FULL,  POLICY_FULL};
    assert_int_equal(policy_storage_demote(&st, t, 7, NULL, NULL), 2);
    const uint8_t want[7] = {POLICY_INT8, POLICY_EVICT, POLICY_INT8, POLICY_SKETCH,
                             POLICY_INT8, POLICY_FULL,  POLICY_FULL};
    assert_memory_equal(t, want, 7);
    st.demote = POLICY_FULL;
    uint8_t u[3] = {POLICY_FULL, POLICY_FULL, POLICY_FULL};
    assert_int_equal(policy_storage_demote(&st, u, 3, NULL, NULL), 0);
    assert_int_equal(u[0], POLICY_FULL);
    /* demote=int4: the same rule, INT4 tokens count as held */
    st.demote = POLICY_INT4;
    st.int8_window = 1;
    uint8_t w[4] = {POLICY_FULL, POLICY_INT4, POLICY_FULL, POLICY_FULL};
    assert_int_equal(policy_storage_demote(&st, w, 4, NULL, NULL), 2);
    const uint8_t want4[4] = {POLICY_INT4, POLICY_INT4, POLICY_INT4, POLICY_FULL};
    assert_memory_equal(w, want4, 4);
}

/* xorshift64: the random tests' generator. */
static uint64_t next_random(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* The age rule token by token, newest first, as POLICIES.md §5.4 states
 * it: the reference for policy_storage_demote's vectorised pass. */
static uint32_t demote_by_age_reference(uint8_t *tier, uint32_t n, uint32_t window, uint8_t to)
{
    uint32_t seen = 0, demoted = 0;
    for (uint32_t i = n; i-- > 0;) {
        int held = tier[i] == POLICY_FULL || policy_tier_quantised(tier[i]);
        if (!held || seen++ < window)
            continue;
        if (tier[i] == POLICY_FULL) {
            tier[i] = to;
            demoted++;
        }
    }
    return demoted;
}

/* The age rule over long lists of every tier, windows from none to more
 * than the list holds, into each quantised tier: the same tiers and count
 * as the reference. */
static void test_storage_demote_long_lists(void **unused)
{
    (void)unused;
    static const uint8_t to[3] = {POLICY_INT8, POLICY_INT4, POLICY_INT2};
    uint8_t a[3000], b[3000];
    uint64_t rng = 99;
    for (unsigned round = 0; round < 400; round++) {
        uint32_t n = (uint32_t)(next_random(&rng) % 3000);
        unsigned full_per_8 = (unsigned)(next_random(&rng) % 9); /* from none to all */
        for (uint32_t i = 0; i < n; i++) {
            uint64_t r = next_random(&rng);
            a[i] = r % 8 < full_per_8 ? POLICY_FULL : (uint8_t)((r >> 8) % POLICY_TIERS);
        }
        memcpy(b, a, n);
        uint32_t window = round % 4 == 0 ? n + 1 - (uint32_t)(round % 3) : round % 50;
        policy_storage st = {.demote = to[round % 3], .int8_window = window};
        uint32_t want = demote_by_age_reference(b, n, window, st.demote);
        assert_int_equal(policy_storage_demote(&st, a, n, NULL, NULL), want);
        assert_memory_equal(a, b, n);
    }
}

/* demote_keep: of the candidates (held, older than the window), the share
 * with the highest importance stays FULL; the lowest are demoted, ties to
 * the older; tokens already quantised count as candidates but never come
 * back. */
static void test_storage_demote_keep(void **unused)
{
    (void)unused;
    policy_storage st = {.demote = POLICY_INT4, .int8_window = 2, .demote_keep = 0.5};
    const double imp[10] = {5, 1, 7, 0.5, 3, 3, 9, 2, 0, 0};
    uint8_t t[10];
    memset(t, POLICY_FULL, sizeof t);
    void *scratch = malloc(policy_storage_demote_scratch(10));
    assert_non_null(scratch);
    /* 8 candidates, 4 stay: 0.5, 1, 2 and the older of the two 3s go */
    assert_int_equal(policy_storage_demote(&st, t, 10, imp, scratch), 4);
    const uint8_t want[10] = {POLICY_FULL, POLICY_INT4, POLICY_FULL, POLICY_INT4, POLICY_INT4,
                              POLICY_FULL, POLICY_FULL, POLICY_INT4, POLICY_FULL, POLICY_FULL};
    assert_memory_equal(t, want, 10);
    /* already at the share: nothing more; the window is not a candidate */
    assert_int_equal(policy_storage_demote(&st, t, 10, imp, scratch), 0);
    /* token 0 already quantised and an evicted one: 7 candidates, 3 stay */
    memset(t, POLICY_FULL, sizeof t);
    t[0] = POLICY_INT4;
    t[6] = POLICY_EVICT;
    assert_int_equal(policy_storage_demote(&st, t, 10, imp, scratch), 3);
    const uint8_t want2[10] = {POLICY_INT4, POLICY_INT4,  POLICY_FULL, POLICY_INT4, POLICY_FULL,
                               POLICY_FULL, POLICY_EVICT, POLICY_INT4, POLICY_FULL, POLICY_FULL};
    assert_memory_equal(t, want2, 10);
    /* demote_keep 1 keeps everything; 0 is the age rule */
    memset(t, POLICY_FULL, sizeof t);
    st.demote_keep = 1;
    assert_int_equal(policy_storage_demote(&st, t, 10, imp, scratch), 0);
    st.demote_keep = 0;
    assert_int_equal(policy_storage_demote(&st, t, 10, NULL, NULL), 8);
    free(scratch);
}

/* One step of the full policy on layer 0 with score[] and commit. */
static const policy_decision *step_scored(policy_host *h, const float *score)
{
    policy_stats st = {.score = score, .score_queries = 1, .confidence = -1};
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &st, &d, err, sizeof err), 0);
    return d;
}

/* The host grades by mean attention: the attention a token received over
 * the steps, over the queries since it arrived (appended - position). The
 * second step demotes token 1, which the plain sum would rank above tokens
 * 3 and 4; a rolled-back step's attention does not count. */
static void test_host_demote_keep(void **unused)
{
    (void)unused;
    const policy_ops *ops = policy_find("full");
    const char *keys[] = {"demote", "int8_window", "demote_keep"};
    const char *vals[] = {"int4", "1", "0.5"};
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(ops, keys, vals, 3, &p, err, sizeof err), 0);
    policy_geometry g = {
        .layers = 1, .q_heads = 2, .kv_heads = 1, .head_dim = 4, .block_tokens = 4};
    policy_host *h = NULL;
    assert_int_equal(policy_host_create(ops, &p, &g, &h, err, sizeof err), 0);
    assert_int_equal(policy_host_append(h, 5), 0);
    /* means 0.1/5, 0.9/4, 0.2/3, 0.8/2; token 4 is the window */
    const float s1[5] = {0.1f, 0.9f, 0.2f, 0.8f, 0.5f};
    const policy_decision *d = step_scored(h, s1);
    const uint8_t want1[5] = {POLICY_INT4, POLICY_FULL, POLICY_INT4, POLICY_FULL, POLICY_FULL};
    assert_memory_equal(d->tier[0], want1, 5);
    policy_host_commit(h, 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    /* a step that is rolled back: its attention would keep token 1 */
    policy_host_begin(h);
    const float huge[6] = {0, 100, 0, 0, 0, 0};
    step_scored(h, huge);
    policy_host_commit(h, 0);
    policy_host_rollback(h);
    assert_int_equal(policy_host_append(h, 1), 0);
    /* 6 candidates, 3 may stay FULL; of FULL tokens 1, 3, 4, 5 the means
     * 0.9/6, 0.8/4, 0.5/3, 0.6/2 demote token 1 (the sums would demote 4) */
    const float s2[7] = {0, 0, 0, 0, 0, 0.6f, 1};
    d = step_scored(h, s2);
    const uint8_t want2[7] = {POLICY_INT4, POLICY_INT4, POLICY_INT4, POLICY_FULL,
                              POLICY_FULL, POLICY_FULL, POLICY_FULL};
    assert_memory_equal(d->tier[0], want2, 7);
    policy_host_destroy(h);
}

/* The storage keys parse strictly and name the offender. */
static void test_storage_parse(void **unused)
{
    (void)unused;
    const policy_ops *ops = policy_find("full");
    const char *keys[] = {"int8", "int8_window", "victims"};
    const char *good[] = {"on", "5", "sketch"}, *bad[] = {"yes", "5", "sketch"};
    policy_params p;
    policy_storage st;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(ops, keys, good, 3, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), 0);
    assert_true(st.demote == POLICY_INT8 && st.int8_window == 5 &&
                st.victims == POLICY_VICTIMS_SKETCH);
    assert_int_equal(st.sketch_rows, 3);
    assert_int_equal(policy_params_resolve(ops, keys, bad, 3, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), -1);
    assert_non_null(strstr(err, "parameter int8 must be one of off, on, got 'yes'"));
    const char *int8_victims[] = {"off", "32", "int8"}, *no_victims[] = {"off", "32", "keep"};
    assert_int_equal(policy_params_resolve(ops, keys, int8_victims, 3, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), 0);
    assert_int_equal(st.victims, POLICY_VICTIMS_INT8);
    assert_int_equal(policy_params_resolve(ops, keys, no_victims, 3, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), -1);
    assert_non_null(
        strstr(err, "parameter victims must be one of evict, sketch, int8, got 'keep'"));
    /* demote picks the precision; int8=on is demote=int8 and may not
     * contradict it */
    const char *dkeys[] = {"demote", "int8"};
    const char *int4[] = {"int4", "off"}, *both[] = {"int8", "on"}, *clash[] = {"int2", "on"};
    assert_int_equal(policy_params_resolve(ops, dkeys, int4, 2, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), 0);
    assert_int_equal(st.demote, POLICY_INT4);
    assert_int_equal(policy_params_resolve(ops, dkeys, both, 2, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), 0);
    assert_int_equal(st.demote, POLICY_INT8);
    assert_int_equal(policy_params_resolve(ops, dkeys, clash, 2, &p, err, sizeof err), 0);
    assert_int_equal(policy_storage_parse(&p, &st, err, sizeof err), -1);
    assert_non_null(strstr(err, "int8=on and demote=int2 disagree"));
}

static void test_merges_capacity(void **unused)
{
    (void)unused;
    const policy_ops *ops[] = {&fake_mod3, &fake_head};
    for (size_t o = 0; o < 2; o++) {
        policy_host *h = host_new(ops[o], 2, 8);
        fake_state *st = state_of(h);
        st->passive = 1;
        policy_stats stats = {.confidence = -1.0};
        const uint32_t chunks[] = {1, 1000, 1, 5000, 3};
        size_t total = 0;
        for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
            assert_int_equal(policy_host_append(h, chunks[c]), 0);
            total += chunks[c];
            for (uint32_t l = 0; l < 2; l++) {
                const policy_decision *d = step_ok(h, l, &stats);
                assert_true(d->merges_cap >= total * policy_host_heads(h));
                assert_non_null(d->merges);
                policy_host_commit(h, l);
            }
        }
        assert_int_equal(st->cap_errors, 0);
        policy_host_destroy(h);
    }
}

/* A policy that does not merge gets no room for merges (20 bytes a token
 * and layer otherwise), and a decision that merges anyway is refused. */
static int plain_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                      policy_decision *d, char *err, size_t errlen)
{
    (void)state, (void)v, (void)stats, (void)err, (void)errlen;
    assert_null(d->merges);
    assert_int_equal(d->merges_cap, 0);
    d->nmerges = v->tokens[0] > 5; /* past 5 tokens, one merge it has no room for */
    return 0;
}

static void test_merges_only_for_policies_that_merge(void **unused)
{
    (void)unused;
    policy_ops plain = fake_mod3;
    plain.step = plain_step;
    plain.merges = 0;
    policy_host *h = host_new(&plain, 2, 8);
    policy_stats stats = {.confidence = -1.0};
    assert_int_equal(policy_host_append(h, 5), 0);
    step_ok(h, 0, &stats);
    assert_int_equal(policy_host_commit(h, 0), 0);
    assert_int_equal(policy_host_append(h, 1), 0);
    const policy_decision *d;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "merges exceed the capacity 0"));
    policy_host_destroy(h);
}

/* ---- layers on threads ---- */

/* fake_meet decides nothing; it records which thread stepped each layer,
 * and while g_meet_wait is set its step of layer 0 waits (10 s at most)
 * until both the host's caller and another thread have stepped a layer
 * (whichever stepped layer 0 among them): only a host that shares the
 * layers between its caller and other threads lets it go on before that. */
static pthread_t g_meet_thread[MAX_LAYERS];
static pthread_t g_meet_caller;          /* set before the host starts its threads */
static atomic_int g_meet_other;          /* a layer stepped off the caller's thread */
static atomic_int g_meet_caller_stepped; /* a layer stepped on it */
static int g_meet_wait;

/* policy_host_step_layers' fetch in meet_threads: each layer's once, before
 * its step, failing at layer g_fetch_fail. */
static atomic_int g_fetched[MAX_LAYERS];
static int g_fetch_fail = -1;

static int meet_fetch(void *ctx, uint32_t layer, char *err, size_t errlen)
{
    (void)ctx;
    if ((int)layer == g_fetch_fail) {
        snprintf(err, errlen, "layer %u's statistics are bad", layer);
        return -1;
    }
    atomic_fetch_add(&g_fetched[layer], 1);
    return 0;
}

static int fake_meet_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                          policy_decision *d, char *err, size_t errlen)
{
    (void)state, (void)stats, (void)d;
    if (atomic_load(&g_fetched[v->layer]) != 1) {
        snprintf(err, errlen, "layer %u stepped before its fetch", v->layer);
        return -1;
    }
    g_meet_thread[v->layer] = pthread_self();
    int on_caller = pthread_equal(pthread_self(), g_meet_caller);
    atomic_store(on_caller ? &g_meet_caller_stepped : &g_meet_other, 1);
    for (int i = 0; v->layer == 0 && g_meet_wait && i < 10000 &&
                    !(atomic_load(&g_meet_other) && atomic_load(&g_meet_caller_stepped));
         i++)
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    return 0;
}

static const policy_ops fake_meet = {
    .name = "fake-meet",
    .summary = "decides nothing, records the thread of each layer's step",
    .params = fake_params,
    .nparams = 1,
    .layers_concurrent = 1,
    .create = fake_create,
    .step = fake_meet_step,
    .destroy = fake_destroy,
};

/* A thread lent to the host for one call (policy_helper; kvstashd keeps
 * one per ring, daemon/helper.h): here one started at start and joined
 * at join, or none when it refuses. */
typedef struct lent_thread {
    pthread_t thread;
    int refuse, starts, joins;
    void (*fn)(void *arg);
    void *arg;
} lent_thread;

static void *lent_main(void *p)
{
    lent_thread *l = p;
    l->fn(l->arg);
    return NULL;
}

static int lent_start(void *ctx, void (*fn)(void *arg), void *arg)
{
    lent_thread *l = ctx;
    if (l->refuse)
        return -1;
    l->fn = fn, l->arg = arg;
    l->starts++;
    return pthread_create(&l->thread, NULL, lent_main, l) == 0 ? 0 : -1;
}

static void lent_join(void *ctx)
{
    lent_thread *l = ctx;
    pthread_join(l->thread, NULL);
    l->joins++;
}

/* Step every layer of h, with a lent thread or none; how many distinct
 * threads stepped them. */
static int meet_threads_lent(policy_host *h, uint32_t layers, const policy_helper *helper)
{
    const policy_stats stats = {0};
    policy_stats all[MAX_LAYERS];
    const policy_decision *d[MAX_LAYERS];
    char err[POLICY_ERR_LEN] = "";
    for (uint32_t l = 0; l < layers; l++)
        all[l] = stats;
    memset(g_meet_thread, 0, sizeof g_meet_thread);
    g_meet_caller = pthread_self();
    atomic_store(&g_meet_other, 0);
    atomic_store(&g_meet_caller_stepped, 0);
    for (uint32_t l = 0; l < layers; l++)
        atomic_store(&g_fetched[l], 0);
    policy_stats_fetch fetch = {meet_fetch, NULL};
    if (policy_host_step_layers(h, all, &fetch, helper, d, err, sizeof err) != 0)
        fail_msg("step_layers: %s", err);
    int distinct = 0;
    for (uint32_t l = 0; l < layers; l++) {
        assert_int_equal(atomic_load(&g_fetched[l]), 1); /* fetched once, before its step */
        int seen = 0;
        for (uint32_t m = 0; m < l; m++)
            seen |= pthread_equal(g_meet_thread[l], g_meet_thread[m]);
        distinct += !seen;
        assert_int_equal(policy_host_commit(h, l), 0);
    }
    return distinct;
}

static int meet_threads(policy_host *h, uint32_t layers)
{
    return meet_threads_lent(h, layers, NULL);
}

/* ---- commits of random decisions ---- */

/* fake-random decides every entry of every list (per KV head) from a
 * generator: a prompt-like step (regime 0) evicts most entries, in short
 * kept runs, and moves a few kept ones to another tier; regime 1 evicts
 * and moves a few; regime 2 evicts most and moves none; regime 3 evicts
 * a third, in kept runs that often fill a group of eight. */
typedef struct random_state {
    uint64_t rng;
    unsigned regime;        /* the test sets it before each step */
    unsigned preset_errors; /* decision tiers not preset to the view's */
    policy_span asked[2];   /* fake-span: what it narrowed each list's span to */
} random_state;

/* Count the tiers of a decision that are not preset to the view's. */
static unsigned preset_errors(const policy_layer_view *v, const policy_decision *d)
{
    unsigned bad = 0;
    for (uint32_t h = 0; h < v->heads; h++)
        bad += (unsigned)(v->tokens[h] > 0 && memcmp(d->tier[h], v->tier[h], v->tokens[h]) != 0);
    return bad;
}

static int random_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                         size_t errlen)
{
    (void)p;
    (void)g;
    random_state *st = calloc(1, sizeof *st);
    if (st == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    st->rng = 0x9e3779b97f4a7c15u;
    *state = st;
    return 0;
}

static int random_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                       policy_decision *d, char *err, size_t errlen)
{
    (void)stats;
    (void)err;
    (void)errlen;
    random_state *st = state;
    st->preset_errors += preset_errors(v, d);
    static const unsigned evict_per_mille[4] = {750, 3, 800, 300},
                          move_per_mille[4] = {40, 5, 0, 10};
    for (uint32_t h = 0; h < v->heads; h++)
        for (uint32_t i = 0; i < v->tokens[h]; i++) {
            uint64_t r = next_random(&st->rng);
            unsigned x = (unsigned)(r % 1000);
            if (x < evict_per_mille[st->regime])
                d->tier[h][i] = POLICY_EVICT;
            else if (x < evict_per_mille[st->regime] + move_per_mille[st->regime])
                d->tier[h][i] = policy_stored_tiers[(r >> 32) % POLICY_STORED_TIERS];
        }
    return 0;
}

static void random_destroy(void *state)
{
    free(state);
}

static const policy_ops fake_random = {
    .name = "fake-random",
    .summary = "random evictions and tier moves",
    .per_head = 1,
    .needs = POLICY_NEEDS_LAST_ATTN,
    .create = random_create,
    .step = random_step,
    .destroy = random_destroy,
};

/* A list as the host shows it: positions, tiers and (graded hosts) the
 * attention its tokens got. */
typedef struct list_copy {
    uint32_t n;
    uint32_t pos[8192];
    uint8_t tier[8192];
    float attn[8192];
} list_copy;

static void copy_list(policy_host *h, uint32_t l, uint32_t k, list_copy *c)
{
    const policy_layer_view *v = policy_host_view(h, l);
    c->n = v->tokens[k];
    assert_true(c->n <= 8192);
    memcpy(c->pos, v->positions[k], c->n * sizeof *c->pos);
    memcpy(c->tier, v->tier[k], c->n);
    const float *attn = policy_host_attn(h, l, k);
    if (attn != NULL)
        memcpy(c->attn, attn, c->n * sizeof *c->attn);
    else
        memset(c->attn, 0, sizeof c->attn);
}

static void assert_lists_equal(const list_copy *a, const list_copy *b)
{
    assert_int_equal(a->n, b->n);
    assert_memory_equal(a->pos, b->pos, a->n * sizeof *a->pos);
    assert_memory_equal(a->tier, b->tier, a->n);
    assert_memory_equal(a->attn, b->attn, a->n * sizeof *a->attn);
}

/* A commit leaves each list its kept entries in order, with the decided
 * tiers and the attention they had; a rollback puts back the list before
 * the step. Lists of hundreds to a few thousand entries, commits that evict
 * most or few, with tiers moved or not, a graded host (which keeps each
 * token's attention beside it) and a plain one: the vectorised commit
 * packs eight entries at a time, and its tails and groups with a moved
 * tier go entry by entry. */
static void test_commit_random_decisions(void **unused)
{
    (void)unused;
    enum { LAYERS = 2, HEADS = 2, Q_HEADS = HEADS * 4, ROWS = 8192 };
    static list_copy before[HEADS], decided[HEADS], after[HEADS];
    float *rows[Q_HEADS];
    uint64_t rng = 12345;
    for (unsigned q = 0; q < Q_HEADS; q++) {
        assert_non_null(rows[q] = malloc(ROWS * sizeof *rows[q]));
        for (unsigned i = 0; i < ROWS; i++)
            rows[q][i] = (float)(next_random(&rng) % 1000) / 1000.0f;
    }
    for (int graded = 0; graded < 2; graded++) {
        const char *keys[] = {"demote", "int8_window", "demote_keep"};
        const char *vals[] = {"int8", "16", "0.75"};
        policy_params p;
        char err[POLICY_ERR_LEN] = "";
        assert_int_equal(
            policy_params_resolve(&fake_random, keys, vals, graded ? 3 : 0, &p, err, sizeof err),
            0);
        policy_geometry g = geometry(LAYERS, HEADS);
        policy_host *h = NULL;
        assert_int_equal(policy_host_create(&fake_random, &p, &g, &h, err, sizeof err), 0);
        random_state *st = policy_host_state(h);
        policy_stats stats = {.last_attn = (const float *const *)rows, .confidence = -1};
        for (unsigned round = 0; round < 60; round++) {
            assert_int_equal(policy_host_append(h, 1 + (uint32_t)(next_random(&rng) % 600)), 0);
            int txn = round / 4 % 2;
            st->regime = round % 4;
            for (uint32_t l = 0; l < LAYERS; l++) {
                for (uint32_t k = 0; k < HEADS; k++)
                    copy_list(h, l, k, &before[k]);
                if (txn)
                    policy_host_begin(h);
                const policy_decision *d = NULL;
                assert_int_equal(policy_host_step(h, l, &stats, &d, err, sizeof err), 0);
                size_t evicted = 0;
                for (uint32_t k = 0; k < HEADS; k++) {
                    list_copy now, *want = &decided[k];
                    copy_list(h, l, k, &now); /* the attention as the step left it */
                    want->n = 0;
                    for (uint32_t i = 0; i < now.n; i++) {
                        if (d->tier[k][i] == POLICY_EVICT)
                            continue;
                        want->pos[want->n] = now.pos[i];
                        want->tier[want->n] = d->tier[k][i];
                        want->attn[want->n++] = now.attn[i];
                    }
                    evicted += now.n - want->n;
                }
                assert_int_equal(policy_host_commit(h, l), evicted);
                for (uint32_t k = 0; k < HEADS; k++) {
                    copy_list(h, l, k, &after[k]);
                    assert_lists_equal(&after[k], &decided[k]);
                }
                if (!txn)
                    continue;
                policy_host_rollback(h);
                for (uint32_t k = 0; k < HEADS; k++) {
                    copy_list(h, l, k, &after[k]);
                    assert_lists_equal(&after[k], &before[k]);
                }
            }
        }
        assert_int_equal(st->preset_errors, 0);
        policy_host_destroy(h);
    }
    for (unsigned q = 0; q < Q_HEADS; q++)
        free(rows[q]);
}

/* Layers step at once only when the host has threads, the policy allows
 * it and the lists hold enough tokens; the calling thread takes part. */
static void test_layers_on_threads(void **unused)
{
    (void)unused;
    policy_host *h = host_new(&fake_meet, 6, 1);
    assert_int_equal(policy_host_append(h, 50), 0); /* 300 tokens held */
    g_meet_wait = 0;
    assert_int_equal(meet_threads(h, 6), 1); /* no threads set */
    policy_host_set_threads(h, 2, 301);
    assert_int_equal(meet_threads(h, 6), 1); /* too few tokens */
    assert_true(pthread_equal(g_meet_thread[5], pthread_self()));
    policy_host_set_threads(h, 2, 300);
    g_meet_wait = 1;
    assert_int_equal(meet_threads(h, 6), 2);
    assert_int_equal(atomic_load(&g_meet_other), 1);
    assert_int_equal(policy_host_steps(h), 3);
    /* A lent thread is the helper, started and joined once; one that
     * refuses leaves the host to start its own. */
    lent_thread lent = {0};
    policy_helper helper = {lent_start, lent_join, &lent};
    assert_int_equal(meet_threads_lent(h, 6, &helper), 2);
    assert_int_equal(lent.starts, 1);
    assert_int_equal(lent.joins, 1);
    int on_lent = 0;
    for (uint32_t l = 0; l < 6; l++)
        on_lent |= pthread_equal(g_meet_thread[l], lent.thread);
    assert_true(on_lent);
    lent.refuse = 1;
    assert_int_equal(meet_threads_lent(h, 6, &helper), 2);
    assert_int_equal(lent.starts, 1);
    assert_int_equal(lent.joins, 1);
    policy_host_destroy(h);

    /* A fetch that fails fails the step with its message, on one thread
     * and on two. */
    for (uint32_t threads = 1; threads <= 2; threads++) {
        h = host_new(&fake_meet, 6, 1);
        assert_int_equal(policy_host_append(h, 50), 0);
        policy_host_set_threads(h, threads, 0);
        g_meet_wait = 0;
        g_fetch_fail = 3;
        policy_stats all[6] = {{0}};
        const policy_decision *d[6];
        char err[POLICY_ERR_LEN] = "";
        policy_stats_fetch fetch = {meet_fetch, NULL};
        for (uint32_t l = 0; l < 6; l++)
            atomic_store(&g_fetched[l], 0);
        assert_int_equal(policy_host_step_layers(h, all, &fetch, NULL, d, err, sizeof err), -1);
        assert_string_equal(err, "layer 3's statistics are bad");
        assert_int_equal(atomic_load(&g_fetched[3]), 0);
        g_fetch_fail = -1;
        policy_host_destroy(h);
    }

    policy_ops serial = fake_meet; /* the same policy, not declared concurrent */
    serial.layers_concurrent = 0;
    h = host_new(&serial, 6, 1);
    assert_int_equal(policy_host_append(h, 50), 0);
    policy_host_set_threads(h, 4, 0);
    g_meet_wait = 0;
    assert_int_equal(meet_threads(h, 6), 1);
    assert_true(pthread_equal(g_meet_thread[0], pthread_self()));
    policy_host_destroy(h);
}

/* ---- spans (policy.h policy_decision.span) ---- */

/* fake-span: each step, per list, a window [lo, hi) in which it evicts a
 * few tokens (regime 0), also moves a few to INT8 (1), puts every token
 * not at FULL back to FULL (2) or evicts them (3), or names a span beyond
 * the list (4); it narrows the span to the window (in 2 and 3, to the
 * tokens it changed). Its state is fake-random's. */
/* Regimes 2 and 3: every token not at FULL to `to`, the span around them. */
static policy_span span_not_full(const policy_layer_view *v, uint32_t h, policy_decision *d,
                                 uint8_t to)
{
    uint32_t lo = v->tokens[h], hi = 0;
    for (uint32_t i = 0; i < v->tokens[h]; i++)
        if (v->tier[h][i] != POLICY_FULL) {
            d->tier[h][i] = to;
            lo = i < lo ? i : lo;
            hi = i + 1;
        }
    return lo < hi ? (policy_span){lo, hi} : (policy_span){0, 0};
}

static int span_step(void *state, const policy_layer_view *v, const policy_stats *stats,
                     policy_decision *d, char *err, size_t errlen)
{
    (void)stats;
    (void)err;
    (void)errlen;
    random_state *st = state;
    st->preset_errors += preset_errors(v, d);
    for (uint32_t h = 0; h < v->heads; h++) {
        uint32_t n = v->tokens[h];
        policy_span sp;
        if (st->regime == 2 || st->regime == 3) {
            sp = span_not_full(v, h, d, st->regime == 2 ? POLICY_FULL : POLICY_EVICT);
        } else if (st->regime == 4) {
            sp = (policy_span){n / 2, n + 1};
        } else {
            uint32_t lo = (uint32_t)(next_random(&st->rng) % (n + 1));
            uint32_t hi = lo + (uint32_t)(next_random(&st->rng) % (n - lo + 1));
            for (uint32_t i = lo; i < hi; i++) {
                unsigned x = (unsigned)(next_random(&st->rng) % 100);
                if (x < 10)
                    d->tier[h][i] = POLICY_EVICT;
                else if (x < 14 && st->regime == 1)
                    d->tier[h][i] = POLICY_INT8;
            }
            sp = (policy_span){lo, hi};
        }
        st->asked[h] = sp;
        policy_decision_span(d, h, sp.lo, sp.hi);
    }
    return 0;
}

static const policy_ops fake_span = {
    .name = "fake-span",
    .summary = "random changes within a span it names",
    .params = fake_params,
    .nparams = sizeof fake_params / sizeof fake_params[0],
    .per_head = 1,
    .create = random_create,
    .step = span_step,
    .destroy = random_destroy,
};

/* The host keeps a policy's span only while every tier of the list is
 * FULL, so that outside it every tier is, and stays, FULL; the commit
 * applies the changes inside it exactly (as test_commit_random_decisions
 * checks the whole-list commit), and a rollback puts the lists back with
 * the count of tiers not at FULL that this rule reads. */
static void test_spans_kept_narrow_only_where_all_full(void **unused)
{
    (void)unused;
    enum { HEADS = 2 };
    static list_copy before[HEADS], decided[HEADS], after[HEADS];
    policy_host *h = host_new(&fake_span, 1, HEADS);
    random_state *st = policy_host_state(h);
    char err[POLICY_ERR_LEN] = "";
    policy_stats stats = {.confidence = -1};
    uint64_t rng = 99;
    static const unsigned regimes[] = {0, 0, 1, 0, 0, 2, 0, 1, 1, 3, 0, 0};
    unsigned narrowed = 0, widened = 0;
    for (unsigned round = 0; round < 120; round++) {
        assert_int_equal(policy_host_append(h, 1 + (uint32_t)(next_random(&rng) % 100)), 0);
        st->regime = regimes[round % 12];
        int txn = round % 5 == 4;
        int all_full[HEADS];
        for (uint32_t k = 0; k < HEADS; k++) {
            copy_list(h, 0, k, &before[k]);
            all_full[k] = memchr(before[k].tier, POLICY_INT8, before[k].n) == NULL;
        }
        if (txn)
            policy_host_begin(h);
        const policy_decision *d = step_ok(h, 0, &stats);
        size_t evicted = 0;
        for (uint32_t k = 0; k < HEADS; k++) {
            policy_span want = all_full[k] ? st->asked[k] : (policy_span){0, before[k].n};
            assert_int_equal(d->span[k].lo, want.lo);
            assert_int_equal(d->span[k].hi, want.hi);
            narrowed += all_full[k], widened += !all_full[k];
            list_copy *w = &decided[k];
            w->n = 0;
            for (uint32_t i = 0; i < before[k].n; i++) {
                if (d->tier[k][i] == POLICY_EVICT)
                    continue;
                w->pos[w->n] = before[k].pos[i];
                w->tier[w->n] = d->tier[k][i];
                w->attn[w->n++] = 0;
            }
            evicted += before[k].n - w->n;
        }
        assert_int_equal(policy_host_commit(h, 0), evicted);
        for (uint32_t k = 0; k < HEADS; k++) {
            copy_list(h, 0, k, &after[k]);
            assert_lists_equal(&after[k], &decided[k]);
        }
        if (txn) {
            policy_host_rollback(h);
            for (uint32_t k = 0; k < HEADS; k++) {
                copy_list(h, 0, k, &after[k]);
                assert_lists_equal(&after[k], &before[k]);
            }
        }
    }
    assert_true(narrowed > 50 && widened > 50);
    assert_int_equal(st->preset_errors, 0);

    /* A span beyond the list is refused, and nothing is pending. */
    st->regime = 4;
    const policy_decision *d = NULL;
    assert_int_equal(policy_host_step(h, 0, &stats, &d, err, sizeof err), -1);
    assert_non_null(strstr(err, "is not within its"));
    assert_int_equal(policy_host_commit(h, 0), 0);

    /* An operator's amendment sees whole lists. */
    st->regime = 3;
    d = step_ok(h, 0, &stats);
    policy_decision *whole = policy_host_decision_whole(h, 0);
    assert_ptr_equal(whole, d);
    for (uint32_t k = 0; k < HEADS; k++) {
        assert_int_equal(d->span[k].lo, 0);
        assert_int_equal(d->span[k].hi, policy_host_view(h, 0)->tokens[k]);
    }
    policy_host_destroy(h);

    /* Storage demotion may change any tier: spans are whole lists. */
    const char *keys[] = {"demote", "int8_window"};
    const char *vals[] = {"int8", "16"};
    policy_params p;
    assert_int_equal(policy_params_resolve(&fake_span, keys, vals, 2, &p, err, sizeof err), 0);
    policy_geometry g = geometry(1, HEADS);
    assert_int_equal(policy_host_create(&fake_span, &p, &g, &h, err, sizeof err), 0);
    st = policy_host_state(h);
    st->regime = 0;
    assert_int_equal(policy_host_append(h, 100), 0);
    d = step_ok(h, 0, &stats);
    for (uint32_t k = 0; k < HEADS; k++) {
        assert_int_equal(d->span[k].lo, 0);
        assert_int_equal(d->span[k].hi, 100);
    }
    policy_host_destroy(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_and_destroy),
        cmocka_unit_test(test_create_failure),
        cmocka_unit_test(test_append),
        cmocka_unit_test(test_append_overflow),
        cmocka_unit_test(test_append_after_commit),
        cmocka_unit_test(test_step_presets_decision),
        cmocka_unit_test(test_commit_mod3),
        cmocka_unit_test(test_commit_without_step),
        cmocka_unit_test(test_per_head_lists_diverge),
        cmocka_unit_test(test_step_numbering),
        cmocka_unit_test(test_step_failure),
        cmocka_unit_test(test_step_before_any_append),
        cmocka_unit_test(test_merges_capacity),
        cmocka_unit_test(test_merges_only_for_policies_that_merge),
        cmocka_unit_test(test_storage_demote),
        cmocka_unit_test(test_storage_demote_long_lists),
        cmocka_unit_test(test_storage_demote_keep),
        cmocka_unit_test(test_host_demote_keep),
        cmocka_unit_test(test_storage_parse),
        cmocka_unit_test(test_layers_on_threads),
        cmocka_unit_test(test_spans_kept_narrow_only_where_all_full),
        cmocka_unit_test(test_commit_random_decisions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
