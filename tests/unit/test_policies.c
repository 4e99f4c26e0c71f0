/*
 * test_policies.c - unit tests for policies/: the registry, parameter
 * resolution and parsing, and the "full" and "streaming" policies.
 *
 * The streaming tests drive select() the way the daemon does: a layer holds
 * a positions array; before each append of `incoming` tokens select() is
 * asked, its keep mask is applied, and the new positions are appended. After
 * every append the held set is compared with the StreamingLLM definition
 * (policies/streaming.c): {p < n_sink} ∪ {p >= T - max(window, incoming)}.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy.h"

/* ---- helpers ---- */

static const policy_ops *find(const char *name)
{
    const policy_ops *ops = policy_find(name);
    assert_non_null(ops);
    return ops;
}

/* Resolve and create a policy from up to two key=value pairs; fails the test on error. */
static void *create(const policy_ops *ops, const char *const *keys, const char *const *values,
                    size_t n)
{
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    void *state = NULL;
    if (policy_params_resolve(ops, keys, values, n, &p, err, sizeof(err)) != 0)
        fail_msg("resolve: %s", err);
    if (ops->create(&p, &state, err, sizeof(err)) != 0)
        fail_msg("create: %s", err);
    return state;
}

static void *streaming_create(uint32_t n_sink, uint32_t window)
{
    char s[16], w[16];
    snprintf(s, sizeof(s), "%u", n_sink);
    snprintf(w, sizeof(w), "%u", window);
    const char *keys[] = {"n_sink", "window"};
    const char *values[] = {s, w};
    return create(find("streaming"), keys, values, 2);
}

/* One layer of a sequence as the daemon would hold it. */
typedef struct layer {
    uint32_t *pos;  /* held positions, ascending */
    uint8_t *keep;  /* scratch for select() */
    uint32_t held;  /* tokens held */
    uint32_t total; /* tokens ever appended (T) */
    uint32_t cap;
} layer;

static layer layer_new(uint32_t cap)
{
    layer l = {calloc(cap, sizeof(uint32_t)), calloc(cap, 1), 0, 0, cap};
    assert_non_null(l.pos);
    assert_non_null(l.keep);
    return l;
}

static void layer_free(layer *l)
{
    free(l->pos);
    free(l->keep);
}

/* select(), check its count against the mask, compact, append `incoming`
 * new positions. Returns the number evicted. */
static size_t layer_step(const policy_ops *ops, void *state, layer *l, uint32_t incoming)
{
    policy_layer_view view = {
        .layer = 0, .layers = 1, .tokens = l->held, .positions = l->pos, .appended = l->total};
    memset(l->keep, 0xAA, l->cap); /* neither 0 nor 1: select must write every entry */
    size_t evicted = ops->select(state, &view, incoming, l->keep);

    size_t zeros = 0;
    uint32_t kept = 0;
    for (uint32_t i = 0; i < l->held; i++) {
        assert_true(l->keep[i] == 0 || l->keep[i] == 1);
        if (l->keep[i])
            l->pos[kept++] = l->pos[i];
        else
            zeros++;
    }
    assert_int_equal(evicted, zeros);
    l->held = kept;
    assert_true(l->held + incoming <= l->cap);
    for (uint32_t i = 0; i < incoming; i++)
        l->pos[l->held++] = l->total++;
    return evicted;
}

/* Held set after an append of `incoming` must be exactly
 * {p < n_sink} ∪ {p >= T - max(window, incoming)}, within [0, T). */
static void check_streaming(const layer *l, uint32_t n_sink, uint32_t window, uint32_t incoming)
{
    uint32_t span = window > incoming ? window : incoming;
    uint32_t recent_from = l->total > span ? l->total - span : 0;
    uint32_t i = 0;
    for (uint32_t p = 0; p < l->total; p++) {
        if (p >= n_sink && p < recent_from)
            continue;
        if (i >= l->held || l->pos[i] != p)
            fail_msg("T=%u n_sink=%u window=%u incoming=%u: position %u should be held "
                     "(held %u tokens)",
                     l->total, n_sink, window, incoming, p, l->held);
        i++;
    }
    if (i != l->held)
        fail_msg("T=%u n_sink=%u window=%u: %u tokens held, expected %u", l->total, n_sink, window,
                 l->held, i);
}

/* ---- registry ---- */

static void test_registry_find(void **unused)
{
    (void)unused;
    assert_string_equal(find("full")->name, "full");
    assert_string_equal(find("streaming")->name, "streaming");
    assert_null(policy_find("nope"));
    assert_null(policy_find(""));
    assert_null(policy_find("Full"));
    assert_null(policy_find("streaming "));
    assert_null(policy_find(NULL));
}

static void test_registry_list(void **unused)
{
    (void)unused;
    size_t n = 99;
    const policy_ops *const *all = policy_list(&n);
    assert_int_equal(n, 2);
    assert_string_equal(all[0]->name, "full");
    assert_string_equal(all[1]->name, "streaming");
    for (size_t i = 0; i < n; i++) {
        assert_ptr_equal(policy_find(all[i]->name), all[i]);
        assert_non_null(all[i]->summary);
        assert_true(strlen(all[i]->summary) > 0);
        assert_null(strchr(all[i]->summary, '\n'));
        assert_non_null(all[i]->create);
        assert_non_null(all[i]->select);
        assert_non_null(all[i]->destroy);
        for (size_t k = 0; k < all[i]->nparams; k++) {
            assert_non_null(all[i]->params[k].key);
            assert_non_null(all[i]->params[k].def);
            assert_non_null(all[i]->params[k].help);
        }
    }
    assert_ptr_equal(policy_list(NULL), all);
}

/* ---- parameters ---- */

static void test_params_defaults(void **unused)
{
    (void)unused;
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(find("streaming"), NULL, NULL, 0, &p, err, sizeof(err)),
                     0);
    assert_int_equal(p.count, 2);
    assert_string_equal(p.key[0], "n_sink");
    assert_string_equal(p.key[1], "window");
    assert_string_equal(policy_params_get(&p, "n_sink"), "4");
    assert_string_equal(policy_params_get(&p, "window"), "1020");
    assert_null(policy_params_get(&p, "nope"));
    assert_null(policy_params_get(&p, NULL));

    assert_int_equal(policy_params_resolve(find("full"), NULL, NULL, 0, &p, err, sizeof(err)), 0);
    assert_int_equal(p.count, 0);
}

static void test_params_override(void **unused)
{
    (void)unused;
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {"window"};
    const char *values[] = {"8"};
    assert_int_equal(
        policy_params_resolve(find("streaming"), keys, values, 1, &p, err, sizeof(err)), 0);
    assert_string_equal(policy_params_get(&p, "n_sink"), "4");
    assert_string_equal(policy_params_get(&p, "window"), "8");
    uint32_t v = 0;
    assert_int_equal(policy_params_uint(&p, "window", 1, 1048576, &v, err, sizeof(err)), 0);
    assert_int_equal(v, 8);

    /* Client order does not matter; the set is in spec order. */
    const char *keys2[] = {"window", "n_sink"};
    const char *values2[] = {"16", "0"};
    assert_int_equal(
        policy_params_resolve(find("streaming"), keys2, values2, 2, &p, err, sizeof(err)), 0);
    assert_string_equal(p.key[0], "n_sink");
    assert_string_equal(p.value[0], "0");
    assert_string_equal(p.key[1], "window");
    assert_string_equal(p.value[1], "16");
}

/* A rejected resolve must leave *out untouched. */
static void expect_resolve_error(const char *policy, const char *const *keys,
                                 const char *const *values, size_t n, const char *expected_sub)
{
    policy_params p, before;
    memset(&p, 0x5C, sizeof(p));
    before = p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(find(policy), keys, values, n, &p, err, sizeof(err)),
                     -1);
    if (strstr(err, expected_sub) == NULL)
        fail_msg("error '%s' does not contain '%s'", err, expected_sub);
    assert_memory_equal(&p, &before, sizeof(p));
}

static void test_params_unknown_key(void **unused)
{
    (void)unused;
    const char *keys[] = {"window", "foo"};
    const char *values[] = {"8", "1"};
    expect_resolve_error("streaming", keys, values, 2,
                         "unknown parameter 'foo' for policy 'streaming' (known: n_sink, window)");
    expect_resolve_error("full", keys, values, 1,
                         "unknown parameter 'window' for policy 'full' (known: none)");
}

static void test_params_duplicate(void **unused)
{
    (void)unused;
    const char *keys[] = {"window", "n_sink", "window"};
    const char *values[] = {"8", "1", "8"};
    expect_resolve_error("streaming", keys, values, 3,
                         "duplicate parameter 'window' for policy 'streaming'");
}

static void test_params_value_length(void **unused)
{
    (void)unused;
    char v63[64], v64[65];
    memset(v63, '1', 63);
    v63[63] = '\0';
    memset(v64, '1', 64);
    v64[64] = '\0';
    const char *keys[] = {"window"};
    const char *ok[] = {v63};
    const char *bad[] = {v64};

    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(find("streaming"), keys, ok, 1, &p, err, sizeof(err)),
                     0);
    assert_string_equal(policy_params_get(&p, "window"), v63);
    expect_resolve_error("streaming", keys, bad, 1, "parameter 'window'");
    expect_resolve_error("streaming", keys, bad, 1, "63 bytes");
}

static void test_params_empty_key(void **unused)
{
    (void)unused;
    const char *keys[] = {""};
    const char *values[] = {"1"};
    expect_resolve_error("streaming", keys, values, 1, "empty parameter name");
    const char *null_key[] = {NULL};
    expect_resolve_error("streaming", null_key, values, 1, "empty parameter name");
    const char *k[] = {"window"};
    const char *null_value[] = {NULL};
    expect_resolve_error("streaming", k, null_value, 1, "'window'");
}

static void test_params_tiny_err_buffer(void **unused)
{
    (void)unused;
    policy_params p;
    char err[8];
    memset(err, 'x', sizeof(err));
    const char *keys[] = {"foo"};
    const char *values[] = {"1"};
    assert_int_equal(policy_params_resolve(find("streaming"), keys, values, 1, &p, err, 5), -1);
    assert_string_equal(err, "unkn");
    assert_int_equal(err[5], 'x');
    /* No error buffer at all is allowed. */
    assert_int_equal(policy_params_resolve(find("streaming"), keys, values, 1, &p, NULL, 0), -1);
}

/* Resolve n_sink=value and parse it in [0, 1048576]. */
static int parse_n_sink(const char *value, uint32_t *out, char *err)
{
    policy_params p;
    const char *keys[] = {"n_sink"};
    const char *values[] = {value};
    assert_int_equal(
        policy_params_resolve(find("streaming"), keys, values, 1, &p, err, POLICY_ERR_LEN), 0);
    return policy_params_uint(&p, "n_sink", 0, 1048576, out, err, POLICY_ERR_LEN);
}

static void test_params_uint_bad(void **unused)
{
    (void)unused;
    const char *bad[] = {"-1",   "1x",  "",           "99999999999999999999", "+3", " 3", "3 ",
                         "0x10", "1.0", "4294967296", "18446744073709551616", "1e3"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[POLICY_ERR_LEN] = "";
        char expected[POLICY_ERR_LEN];
        uint32_t v = 12345;
        assert_int_equal(parse_n_sink(bad[i], &v, err), -1);
        assert_int_equal(v, 12345);
        snprintf(expected, sizeof(expected),
                 "parameter n_sink must be an integer in [0, 1048576], got '%s'", bad[i]);
        assert_string_equal(err, expected);
    }
}

static void test_params_uint_range(void **unused)
{
    (void)unused;
    uint32_t v = 0;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(parse_n_sink("0", &v, err), 0);
    assert_int_equal(v, 0);
    assert_int_equal(parse_n_sink("1048576", &v, err), 0);
    assert_int_equal(v, 1048576);
    assert_int_equal(parse_n_sink("007", &v, err), 0);
    assert_int_equal(v, 7);
    assert_int_equal(parse_n_sink("1048577", &v, err), -1);
    assert_string_equal(err, "parameter n_sink must be an integer in [0, 1048576], got '1048577'");

    /* Lower bound, through the policy's create(). */
    policy_params p;
    void *state = (void *)&p;
    const char *keys[] = {"window"};
    const char *values[] = {"0"};
    const policy_ops *ops = find("streaming");
    assert_int_equal(policy_params_resolve(ops, keys, values, 1, &p, err, sizeof(err)), 0);
    assert_int_equal(ops->create(&p, &state, err, sizeof(err)), -1);
    assert_null(state);
    assert_string_equal(err, "parameter window must be an integer in [1, 1048576], got '0'");

    const char *keys2[] = {"n_sink"};
    const char *values2[] = {"four"};
    assert_int_equal(policy_params_resolve(ops, keys2, values2, 1, &p, err, sizeof(err)), 0);
    assert_int_equal(ops->create(&p, &state, err, sizeof(err)), -1);
    assert_string_equal(err, "parameter n_sink must be an integer in [0, 1048576], got 'four'");

    /* A key the set does not have. */
    assert_int_equal(policy_params_uint(&p, "nope", 0, 10, &v, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "nope"));
}

/* ---- full ---- */

static void test_full_keeps_everything(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("full");
    void *state = create(ops, NULL, NULL, 0);
    layer l = layer_new(4096);
    for (uint32_t step = 0; step < 300; step++)
        assert_int_equal(layer_step(ops, state, &l, step % 7 == 0 ? 13 : 1), 0);
    assert_int_equal(l.held, l.total);
    for (uint32_t i = 0; i < l.held; i++)
        assert_int_equal(l.pos[i], i);
    layer_free(&l);
    ops->destroy(state);
}

/* ---- streaming ---- */

static void test_streaming_one_at_a_time(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = streaming_create(4, 8);
    layer l = layer_new(64);
    for (uint32_t t = 1; t <= 200; t++) {
        size_t evicted = layer_step(ops, state, &l, 1);
        assert_int_equal(l.total, t);
        check_streaming(&l, 4, 8, 1);
        /* Before the append at most 4 + 8 were held; exactly one goes once full. */
        assert_int_equal(evicted, t > 12 ? 1 : 0);
        assert_int_equal(l.held, t < 12 ? t : 12);
    }
    layer_free(&l);
    ops->destroy(state);
}

static void test_streaming_prefill_then_decode(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = streaming_create(4, 8);
    layer l = layer_new(128);

    assert_int_equal(layer_step(ops, state, &l, 50), 0); /* nothing held yet */
    assert_int_equal(l.held, 50);
    check_streaming(&l, 4, 8, 50);

    /* The first decode step trims the prefill to the sinks + last 7, then appends. */
    assert_int_equal(layer_step(ops, state, &l, 1), 50 - 4 - 7);
    check_streaming(&l, 4, 8, 1);
    for (uint32_t i = 0; i < 100; i++) {
        assert_int_equal(layer_step(ops, state, &l, 1), 1);
        check_streaming(&l, 4, 8, 1);
    }

    /* A second long chunk mid-sequence: only the sinks survive it. */
    assert_int_equal(layer_step(ops, state, &l, 20), 8);
    assert_int_equal(l.held, 4 + 20);
    check_streaming(&l, 4, 8, 20);
    assert_int_equal(layer_step(ops, state, &l, 1), 20 - 7);
    check_streaming(&l, 4, 8, 1);

    /* A chunk of exactly `window`. */
    assert_int_equal(layer_step(ops, state, &l, 8), 8);
    check_streaming(&l, 4, 8, 8);
    layer_free(&l);
    ops->destroy(state);
}

static void test_streaming_no_sinks(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = streaming_create(0, 5);
    layer l = layer_new(64);
    for (uint32_t t = 1; t <= 100; t++) {
        layer_step(ops, state, &l, 1);
        check_streaming(&l, 0, 5, 1);
        assert_int_equal(l.pos[0], t > 5 ? t - 5 : 0);
    }
    assert_int_equal(layer_step(ops, state, &l, 5), 5); /* incoming == window: all go */
    check_streaming(&l, 0, 5, 5);
    layer_free(&l);
    ops->destroy(state);
}

static void test_streaming_window_larger_than_sequence(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = streaming_create(4, 1000);
    layer l = layer_new(1024);
    assert_int_equal(layer_step(ops, state, &l, 100), 0);
    for (uint32_t t = 0; t < 300; t++)
        assert_int_equal(layer_step(ops, state, &l, t % 10 == 0 ? 3 : 1), 0);
    assert_int_equal(l.held, l.total);
    check_streaming(&l, 4, 1000, 1);
    layer_free(&l);
    ops->destroy(state);

    /* Sinks larger than the sequence: everything is a sink. */
    state = streaming_create(1000, 1);
    l = layer_new(1024);
    for (uint32_t t = 0; t < 500; t++)
        assert_int_equal(layer_step(ops, state, &l, 1), 0);
    layer_free(&l);
    ops->destroy(state);
}

/* Sinks are decided by original position, not by index in the held array. */
static void test_streaming_sinks_by_position(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = streaming_create(4, 3);
    const uint32_t pos[] = {0, 1, 10, 11, 12, 13};
    uint8_t keep[6];
    policy_layer_view view = {
        .layer = 0, .layers = 1, .tokens = 6, .positions = pos, .appended = 14};
    assert_int_equal(ops->select(state, &view, 1, keep), 2);
    const uint8_t expected[] = {1, 1, 0, 0, 1, 1};
    assert_memory_equal(keep, expected, sizeof(expected));

    /* incoming > window: only the sinks stay. */
    assert_int_equal(ops->select(state, &view, 4, keep), 4);
    const uint8_t sinks_only[] = {1, 1, 0, 0, 0, 0};
    assert_memory_equal(keep, sinks_only, sizeof(sinks_only));

    /* Nothing held. */
    view.tokens = 0;
    assert_int_equal(ops->select(state, &view, 1, keep), 0);
    ops->destroy(state);
}

static void test_streaming_defaults(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    void *state = create(ops, NULL, NULL, 0);
    layer l = layer_new(1100);
    for (uint32_t t = 0; t < 1050; t++) {
        layer_step(ops, state, &l, 1);
        check_streaming(&l, 4, 1020, 1);
    }
    assert_int_equal(l.held, 4 + 1020);
    layer_free(&l);
    ops->destroy(state);
}

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Property: random n_sink, window and chunk sizes, seeded. */
static void test_streaming_random_chunks(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    uint64_t seed = 0x6b767374617368ULL; /* "kvstash" */
    for (int trial = 0; trial < 300; trial++) {
        uint32_t n_sink = (uint32_t)(xorshift(&seed) % 12);
        uint32_t window = 1 + (uint32_t)(xorshift(&seed) % 24);
        void *state = streaming_create(n_sink, window);
        layer l = layer_new(n_sink + 64 + 64);
        for (int step = 0; step < 60; step++) {
            uint32_t r = (uint32_t)(xorshift(&seed) % 8);
            uint32_t incoming = r < 5 ? 1 : 1 + (uint32_t)(xorshift(&seed) % 40);
            layer_step(ops, state, &l, incoming);
            check_streaming(&l, n_sink, window, incoming);
        }
        layer_free(&l);
        ops->destroy(state);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry_find),
        cmocka_unit_test(test_registry_list),
        cmocka_unit_test(test_params_defaults),
        cmocka_unit_test(test_params_override),
        cmocka_unit_test(test_params_unknown_key),
        cmocka_unit_test(test_params_duplicate),
        cmocka_unit_test(test_params_value_length),
        cmocka_unit_test(test_params_empty_key),
        cmocka_unit_test(test_params_tiny_err_buffer),
        cmocka_unit_test(test_params_uint_bad),
        cmocka_unit_test(test_params_uint_range),
        cmocka_unit_test(test_full_keeps_everything),
        cmocka_unit_test(test_streaming_one_at_a_time),
        cmocka_unit_test(test_streaming_prefill_then_decode),
        cmocka_unit_test(test_streaming_no_sinks),
        cmocka_unit_test(test_streaming_window_larger_than_sequence),
        cmocka_unit_test(test_streaming_sinks_by_position),
        cmocka_unit_test(test_streaming_defaults),
        cmocka_unit_test(test_streaming_random_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
