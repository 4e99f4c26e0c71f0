/*
 * test_policies.c - unit tests for policies/: the registry, parameter
 * resolution and parsing, the "full" and "streaming" policies, and the
 * mean over query heads that tova, confkv and weightedkv share (util.h).
 *
 * The policy tests drive a policy through the policy host (policies/host.h)
 * the way the daemon does: each step appends the step's tokens to every
 * layer, runs the policy on each layer, checks the decision, and commits it.
 * After every commit the held set of streaming is compared with its
 * definition (policies/streaming.c): of the T positions appended so far,
 * exactly {p < n_sink} ∪ {p >= T - window} are held, all in full precision.
 */
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

/* ---- helpers ---- */

static const policy_ops *find(const char *name)
{
    return ph_ops(name);
}

static policy_geometry geometry(uint32_t layers, uint32_t kv_heads)
{
    return ph_geom(layers, kv_heads * 2, kv_heads);
}

/* Resolve the parameters and create a host; fails the test on error. */
static policy_host *host_new(const policy_ops *ops, const char *const *keys,
                             const char *const *values, size_t n, uint32_t layers)
{
    policy_host *h = ph_host_pairs(ops->name, keys, values, n, geometry(layers, 4));
    assert_ptr_equal(policy_host_ops(h), ops);
    assert_int_equal(policy_host_heads(h), ops->per_head ? 4 : 1);
    return h;
}

static policy_host *streaming_host(uint32_t n_sink, uint32_t window, uint32_t layers)
{
    char s[16], w[16];
    snprintf(s, sizeof(s), "%u", n_sink);
    snprintf(w, sizeof(w), "%u", window);
    const char *keys[] = {"n_sink", "window"};
    const char *values[] = {s, w};
    return host_new(find("streaming"), keys, values, 2, layers);
}

/*
 * One step of `incoming` tokens on every layer: append, step, check the
 * decision, commit. A decision may only evict (full and streaming never
 * change a tier otherwise). Every layer must evict the same number of
 * tokens, which is returned.
 */
static size_t host_step(policy_host *h, uint32_t layers, uint32_t incoming, int prefill)
{
    assert_int_equal(policy_host_append(h, incoming), 0);
    policy_stats stats = {.new_tokens = incoming, .prefill = prefill, .confidence = -1.0};
    size_t evicted0 = 0;
    for (uint32_t l = 0; l < layers; l++) {
        const policy_layer_view *v = policy_host_view(h, l);
        uint32_t before = v->tokens[0];
        const policy_decision *d = NULL;
        char err[POLICY_ERR_LEN] = "";
        if (policy_host_step(h, l, &stats, &d, err, sizeof(err)) != 0)
            fail_msg("step: %s", err);
        assert_non_null(d);
        v = policy_host_view(h, l);
        assert_int_equal(v->tokens[0], before);
        size_t evicts = 0;
        for (uint32_t i = 0; i < before; i++) {
            if (d->tier[0][i] == POLICY_EVICT)
                evicts++;
            else if (d->tier[0][i] != v->tier[0][i])
                fail_msg("layer %u token %u: tier %u -> %u", l, i, v->tier[0][i], d->tier[0][i]);
        }
        assert_int_equal(d->nmerges, 0);
        assert_int_equal(d->rerotate_keys, 0);
        size_t evicted = policy_host_commit(h, l);
        assert_int_equal(evicted, evicts);
        assert_int_equal(policy_host_view(h, l)->tokens[0], before - evicts);
        if (l == 0)
            evicted0 = evicted;
        else
            assert_int_equal(evicted, evicted0);
    }
    return evicted0;
}

/* Held set of `layer` must be exactly {p < n_sink} ∪ {p >= T - window}
 * within [0, T), ascending, all FULL. */
static void check_streaming_layer(policy_host *h, uint32_t layer, uint32_t n_sink, uint32_t window)
{
    const policy_layer_view *v = policy_host_view(h, layer);
    assert_int_equal(v->heads, 1);
    uint64_t total = v->appended;
    uint64_t recent_from = total > window ? total - window : 0;
    uint32_t held = v->tokens[0];
    const uint32_t *pos = v->positions[0];
    uint32_t i = 0;
    for (uint64_t p = 0; p < total; p++) {
        if (p >= n_sink && p < recent_from)
            continue;
        if (i >= held || pos[i] != p)
            fail_msg("layer %u T=%llu n_sink=%u window=%u: position %llu should be held "
                     "(held %u tokens)",
                     layer, (unsigned long long)total, n_sink, window, (unsigned long long)p, held);
        if (v->tier[0][i] != POLICY_FULL)
            fail_msg("position %llu has tier %u", (unsigned long long)p, v->tier[0][i]);
        i++;
    }
    if (i != held)
        fail_msg("layer %u T=%llu n_sink=%u window=%u: %u tokens held, expected %u", layer,
                 (unsigned long long)total, n_sink, window, held, i);
}

static void check_streaming(policy_host *h, uint32_t layers, uint32_t n_sink, uint32_t window)
{
    for (uint32_t l = 0; l < layers; l++)
        check_streaming_layer(h, l, n_sink, window);
}

static uint32_t held(policy_host *h, uint32_t layer)
{
    return policy_host_view(h, layer)->tokens[0];
}

static uint64_t appended(policy_host *h)
{
    return policy_host_view(h, 0)->appended;
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
    assert_null(policy_find("stream"));
    assert_null(policy_find(NULL));
}

static void test_registry_list(void **unused)
{
    (void)unused;
    size_t n = 0;
    const policy_ops *const *all = policy_list(&n);
    assert_non_null(all);
    /* More policies get added at the end; these two come first. */
    assert_true(n >= 2);
    assert_string_equal(all[0]->name, "full");
    assert_string_equal(all[1]->name, "streaming");
    for (size_t i = 0; i < n; i++) {
        assert_non_null(all[i]->name);
        assert_true(strlen(all[i]->name) > 0);
        for (size_t j = 0; j < i; j++)
            if (strcmp(all[i]->name, all[j]->name) == 0)
                fail_msg("policy name '%s' registered twice", all[i]->name);
        assert_ptr_equal(policy_find(all[i]->name), all[i]);
        assert_non_null(all[i]->summary);
        assert_true(strlen(all[i]->summary) > 0);
        assert_null(strchr(all[i]->summary, '\n'));
        assert_non_null(all[i]->create);
        assert_non_null(all[i]->step);
        assert_non_null(all[i]->destroy);
        assert_true(all[i]->nparams <= POLICY_MAX_PARAMS);
        assert_true(all[i]->nparams == 0 || all[i]->params != NULL);
        for (size_t k = 0; k < all[i]->nparams; k++) {
            assert_non_null(all[i]->params[k].key);
            assert_non_null(all[i]->params[k].def);
            assert_non_null(all[i]->params[k].help);
        }
        /* Every policy must be creatable with its defaults. */
        policy_params p;
        char err[POLICY_ERR_LEN] = "";
        assert_int_equal(policy_params_resolve(all[i], NULL, NULL, 0, &p, err, sizeof(err)), 0);
    }
    size_t again = 0;
    assert_ptr_equal(policy_list(&again), all);
    assert_int_equal(again, n);
    assert_ptr_equal(policy_list(NULL), all);

    /* full and streaming need nothing from the worker and decide per layer. */
    assert_int_equal(find("full")->needs, 0);
    assert_int_equal(find("full")->per_head, 0);
    assert_int_equal(find("streaming")->needs, 0);
    assert_int_equal(find("streaming")->per_head, 0);
}

/* ---- parameters ---- */

static void test_params_defaults(void **unused)
{
    (void)unused;
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(find("streaming"), NULL, NULL, 0, &p, err, sizeof(err)),
                     0);
    /* The policy's keys, then the storage keys every policy accepts. */
    assert_int_equal(p.count, 2 + 8);
    assert_string_equal(p.key[0], "n_sink");
    assert_string_equal(p.key[1], "window");
    assert_string_equal(p.key[2], "demote");
    assert_string_equal(policy_params_get(&p, "demote"), "off");
    assert_string_equal(policy_params_get(&p, "int8"), "off");
    assert_string_equal(policy_params_get(&p, "int8_window"), "32");
    assert_string_equal(policy_params_get(&p, "demote_keep"), "0");
    assert_string_equal(policy_params_get(&p, "victims"), "evict");
    assert_string_equal(policy_params_get(&p, "n_sink"), "4");
    assert_string_equal(policy_params_get(&p, "window"), "1020");
    assert_null(policy_params_get(&p, "nope"));
    assert_null(policy_params_get(&p, NULL));
    assert_null(policy_params_get(NULL, "window"));

    assert_int_equal(policy_params_resolve(find("full"), NULL, NULL, 0, &p, err, sizeof(err)), 0);
    assert_int_equal(p.count, 8); /* the storage keys */
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
static void expect_resolve_error(const policy_ops *ops, const char *const *keys,
                                 const char *const *values, size_t n, const char *expected_sub)
{
    policy_params p, before;
    memset(&p, 0x5C, sizeof(p));
    before = p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(ops, keys, values, n, &p, err, sizeof(err)), -1);
    if (strstr(err, expected_sub) == NULL)
        fail_msg("error '%s' does not contain '%s'", err, expected_sub);
    assert_memory_equal(&p, &before, sizeof(p));
}

static void test_params_unknown_key(void **unused)
{
    (void)unused;
    const char *keys[] = {"window", "foo"};
    const char *values[] = {"8", "1"};
    expect_resolve_error(find("streaming"), keys, values, 2,
                         "unknown parameter 'foo' for policy 'streaming' (known: n_sink, window; "
                         "and the storage keys demote, int8, victims, sketch_*)");
    expect_resolve_error(find("full"), keys, values, 1,
                         "unknown parameter 'window' for policy 'full' (known: and the storage "
                         "keys demote, int8, victims, sketch_*)");
}

static void test_params_duplicate(void **unused)
{
    (void)unused;
    const char *keys[] = {"window", "n_sink", "window"};
    const char *values[] = {"8", "1", "8"};
    expect_resolve_error(find("streaming"), keys, values, 3,
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
    expect_resolve_error(find("streaming"), keys, bad, 1, "parameter 'window'");
    expect_resolve_error(find("streaming"), keys, bad, 1, "63 bytes");
}

static void test_params_empty_key(void **unused)
{
    (void)unused;
    const char *keys[] = {""};
    const char *values[] = {"1"};
    expect_resolve_error(find("streaming"), keys, values, 1, "empty parameter name");
    const char *null_key[] = {NULL};
    expect_resolve_error(find("streaming"), null_key, values, 1, "empty parameter name");
    const char *k[] = {"window"};
    const char *null_value[] = {NULL};
    expect_resolve_error(find("streaming"), k, null_value, 1, "'window'");
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

/* policy_host_create with streaming and one parameter must fail with `expected`. */
static void expect_streaming_create_error(const char *key, const char *value, const char *expected)
{
    const policy_ops *ops = find("streaming");
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {key};
    const char *values[] = {value};
    assert_int_equal(policy_params_resolve(ops, keys, values, 1, &p, err, sizeof(err)), 0);

    /* Directly... */
    policy_geometry g = geometry(2, 4);
    void *state = (void *)&p;
    assert_int_equal(ops->create(&p, &g, &state, err, sizeof(err)), -1);
    assert_null(state);
    assert_string_equal(err, expected);

    /* ...and through the host, which passes the message on. */
    policy_host *h = (policy_host *)&p;
    memset(err, 0, sizeof(err));
    assert_int_equal(policy_host_create(ops, &p, &g, &h, err, sizeof(err)), -1);
    assert_null(h);
    assert_string_equal(err, expected);
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

    /* Lower and upper bounds, through the policy's create(). */
    expect_streaming_create_error("window", "0",
                                  "parameter window must be an integer in [1, 1048576], got '0'");
    expect_streaming_create_error(
        "window", "1048577", "parameter window must be an integer in [1, 1048576], got '1048577'");
    expect_streaming_create_error(
        "n_sink", "four", "parameter n_sink must be an integer in [0, 1048576], got 'four'");

    /* A key the set does not have. */
    policy_params p;
    assert_int_equal(policy_params_resolve(find("streaming"), NULL, NULL, 0, &p, err, sizeof(err)),
                     0);
    v = 77;
    assert_int_equal(policy_params_uint(&p, "nope", 0, 10, &v, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "nope"));
    assert_int_equal(v, 77);
}

/* A policy with a real-number and a choice parameter, for the parsers. */
static const policy_param_spec parse_spec[] = {
    {.key = "ratio", .def = "0.5", .help = "a real number"},
    {.key = "mode", .def = "mean", .help = "one of mean, max, sum"},
};
static const policy_ops parse_ops = {
    .name = "parse-test",
    .summary = "parameters only",
    .params = parse_spec,
    .nparams = 2,
};

static policy_params parse_params(const char *key, const char *value)
{
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {key};
    const char *values[] = {value};
    if (policy_params_resolve(&parse_ops, keys, values, key ? 1 : 0, &p, err, sizeof(err)) != 0)
        fail_msg("resolve: %s", err);
    return p;
}

static int parse_ratio(const char *value, double min, double max, double *out, char *err)
{
    policy_params p = parse_params("ratio", value);
    return policy_params_double(&p, "ratio", min, max, out, err, POLICY_ERR_LEN);
}

static void test_params_double_good(void **unused)
{
    (void)unused;
    char err[POLICY_ERR_LEN] = "";
    double v = -7;
    policy_params p = parse_params(NULL, NULL);
    assert_int_equal(policy_params_double(&p, "ratio", 0, 1, &v, err, sizeof(err)), 0);
    assert_true(v == 0.5);

    const struct {
        const char *text;
        double min, max, want;
    } good[] = {
        {"0", 0, 1, 0},        {"1", 0, 1, 1},        {"0.25", 0, 1, 0.25},  {"1e-3", 0, 1, 0.001},
        {"2.5e1", 0, 100, 25}, {"-0.5", -1, 1, -0.5}, {".5", 0, 1, 0.5},     {"5.", 0, 10, 5},
        {"-1", -1, 1, -1},     {"100", 0, 100, 100},  {"1E2", 0, 1000, 100}, {"0.000", 0, 1, 0},
        {"-0", 0, 1, 0},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        v = -7;
        if (parse_ratio(good[i].text, good[i].min, good[i].max, &v, err) != 0)
            fail_msg("'%s' rejected: %s", good[i].text, err);
        if (v != good[i].want)
            fail_msg("'%s' parsed as %g, expected %g", good[i].text, v, good[i].want);
    }
}

static void test_params_double_bad(void **unused)
{
    (void)unused;
    const char *bad[] = {"nan",  "NaN", "-nan",  "inf",    "-inf", "Infinity", "1e",
                         "",     "1e+", "0.5x",  "0.5 ",   " 0.5", "\t0.5",    "1.5",
                         "-0.1", "2",   "1e400", "-1e400", "e3",   "..5",      "0.5.1",
                         "1,5",  "one", "-",     "+",      "."};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[POLICY_ERR_LEN] = "";
        char expected[POLICY_ERR_LEN];
        double v = 12345;
        if (parse_ratio(bad[i], 0, 1, &v, err) != -1)
            fail_msg("'%s' accepted as %g", bad[i], v);
        assert_true(v == 12345);
        snprintf(expected, sizeof(expected), "parameter ratio must be a number in [0, 1], got '%s'",
                 bad[i]);
        assert_string_equal(err, expected);
    }

    /* Out of range on both sides of a non-trivial interval. */
    char err[POLICY_ERR_LEN] = "";
    double v = 0;
    assert_int_equal(parse_ratio("0.09", 0.1, 0.9, &v, err), -1);
    assert_string_equal(err, "parameter ratio must be a number in [0.1, 0.9], got '0.09'");
    assert_int_equal(parse_ratio("0.91", 0.1, 0.9, &v, err), -1);
    assert_int_equal(parse_ratio("0.9", 0.1, 0.9, &v, err), 0);
    assert_true(v == 0.9);

    /* A key the set does not have. */
    policy_params p = parse_params(NULL, NULL);
    v = 3;
    assert_int_equal(policy_params_double(&p, "nope", 0, 1, &v, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "nope"));
    assert_true(v == 3);
    assert_int_equal(policy_params_double(&p, "nope", 0, 1, &v, NULL, 0), -1);
}

static const char *const modes[] = {"mean", "max", "sum", NULL};

static void test_params_choice(void **unused)
{
    (void)unused;
    char err[POLICY_ERR_LEN] = "";
    unsigned v = 99;
    policy_params p = parse_params(NULL, NULL);
    assert_int_equal(policy_params_choice(&p, "mode", modes, &v, err, sizeof(err)), 0);
    assert_int_equal(v, 0);
    for (unsigned i = 0; modes[i] != NULL; i++) {
        p = parse_params("mode", modes[i]);
        v = 99;
        assert_int_equal(policy_params_choice(&p, "mode", modes, &v, err, sizeof(err)), 0);
        assert_int_equal(v, i);
    }

    /* Unknown choices list the choices; *out stays. */
    const char *bad[] = {"median", "", "Mean", "mean ", " max", "su", "sums", "0"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char expected[POLICY_ERR_LEN];
        p = parse_params("mode", bad[i]);
        v = 99;
        assert_int_equal(policy_params_choice(&p, "mode", modes, &v, err, sizeof(err)), -1);
        assert_int_equal(v, 99);
        snprintf(expected, sizeof(expected),
                 "parameter mode must be one of mean, max, sum, got '%s'", bad[i]);
        assert_string_equal(err, expected);
    }

    /* One choice only; no error buffer. */
    const char *const one[] = {"only", NULL};
    p = parse_params("mode", "other");
    assert_int_equal(policy_params_choice(&p, "mode", one, &v, err, sizeof(err)), -1);
    assert_string_equal(err, "parameter mode must be one of only, got 'other'");
    assert_int_equal(policy_params_choice(&p, "mode", one, &v, NULL, 0), -1);

    /* A key the set does not have. */
    assert_int_equal(policy_params_choice(&p, "nope", modes, &v, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "nope"));
    assert_int_equal(v, 99);
}

/* policy_params_parse: every type lands at its offset, a word stores its
 * value, TEXT entries are left alone, and the first bad value's message
 * names the parameter and its range. */
typedef struct parsed_cfg {
    uint32_t n, slack;
    double ratio;
    unsigned mode;
    int untouched;
} parsed_cfg;

static const policy_param_spec typed_spec[] = {
    POLICY_PARAM_U32("n", "7", "an integer", 1, 100, offsetof(parsed_cfg, n)),
    {.key = "slack",
     .def = "-1",
     .help = "-1 or an integer",
     .type = POLICY_PARAM_UINT,
     .min = 0,
     .max = 50,
     .offset = offsetof(parsed_cfg, slack),
     .word = "-1",
     .word_value = 999},
    POLICY_PARAM_F64("ratio", "0.5", "a real number", 0.25, 1, offsetof(parsed_cfg, ratio)),
    POLICY_PARAM_ONE_OF("mode", "max", "one of mean, max, sum", modes, offsetof(parsed_cfg, mode)),
    {.key = "text", .def = "anything", .help = "read by the policy itself"},
};
static const policy_ops typed_ops = {
    .name = "typed-test",
    .summary = "typed parameters only",
    .params = typed_spec,
    .nparams = sizeof typed_spec / sizeof typed_spec[0],
};

static int parse_typed(const char *key, const char *value, parsed_cfg *c, char *err)
{
    policy_params p;
    const char *keys[] = {key};
    const char *values[] = {value};
    if (policy_params_resolve(&typed_ops, keys, values, key ? 1 : 0, &p, err, POLICY_ERR_LEN) != 0)
        fail_msg("resolve: %s", err);
    *c = (parsed_cfg){0, 0, 0, 0, 42};
    return policy_params_parse(&p, typed_spec, typed_ops.nparams, c, err, POLICY_ERR_LEN);
}

static void test_params_parse_typed(void **unused)
{
    (void)unused;
    char err[POLICY_ERR_LEN] = "";
    parsed_cfg c;
    assert_int_equal(parse_typed(NULL, NULL, &c, err), 0);
    assert_int_equal(c.n, 7);
    assert_int_equal(c.slack, 999); /* the default is the word */
    assert_true(c.ratio == 0.5);
    assert_int_equal(c.mode, 1);
    assert_int_equal(c.untouched, 42);
    assert_int_equal(parse_typed("slack", "50", &c, err), 0);
    assert_int_equal(c.slack, 50);

    static const struct {
        const char *key, *value, *message;
    } bad[] = {
        {"n", "0", "parameter n must be an integer in [1, 100], got '0'"},
        {"n", "101", "parameter n must be an integer in [1, 100], got '101'"},
        {"slack", "51", "parameter slack must be '-1' or an integer in [0, 50], got '51'"},
        {"slack", "-2", "parameter slack must be '-1' or an integer in [0, 50], got '-2'"},
        {"ratio", "0.2", "parameter ratio must be a number in [0.25, 1], got '0.2'"},
        {"mode", "median", "parameter mode must be one of mean, max, sum, got 'median'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (parse_typed(bad[i].key, bad[i].value, &c, err) != -1)
            fail_msg("%s=%s accepted", bad[i].key, bad[i].value);
        assert_string_equal(err, bad[i].message);
    }
}

/* ---- full ---- */

static void test_full_keeps_everything(void **unused)
{
    (void)unused;
    const uint32_t layers = 3;
    policy_host *h = host_new(find("full"), NULL, NULL, 0, layers);
    assert_null(policy_host_state(h));
    assert_int_equal(host_step(h, layers, 100, 1), 0);
    for (uint32_t step = 0; step < 300; step++)
        assert_int_equal(host_step(h, layers, step % 7 == 0 ? 13 : 1, 0), 0);
    for (uint32_t l = 0; l < layers; l++) {
        const policy_layer_view *v = policy_host_view(h, l);
        assert_int_equal(v->heads, 1);
        assert_int_equal(v->tokens[0], v->appended);
        for (uint32_t i = 0; i < v->tokens[0]; i++) {
            assert_int_equal(v->positions[0][i], i);
            assert_int_equal(v->tier[0][i], POLICY_FULL);
        }
    }
    policy_host_destroy(h);
}

/* ---- the mean over query heads (util.h) ---- */

/* policy_tiers_count adds each tier's count to what counts[] holds, at
 * lengths around the vector widths, and flags a value that is no tier
 * (counted nowhere) wherever it is. */
static void test_tiers_count(void **unused)
{
    (void)unused;
    uint8_t t[200] = {0};
    for (size_t n = 0; n <= sizeof t; n += n < 70 ? 1 : 13) {
        uint32_t want[POLICY_TIERS] = {1, 2, 3, 4, 5, 6}, got[POLICY_TIERS] = {1, 2, 3, 4, 5, 6};
        for (size_t i = 0; i < n; i++) {
            t[i] = (uint8_t)((i * 7 + i / 5) % POLICY_TIERS);
            want[t[i]]++;
        }
        assert_int_equal(policy_tiers_count(t, n, got), 0);
        assert_memory_equal(got, want, sizeof want);
        for (size_t bad = 0; bad < n; bad += 1 + bad / 3) {
            uint8_t was = t[bad];
            t[bad] = (uint8_t)(POLICY_TIERS + bad % 250);
            uint32_t base[POLICY_TIERS] = {1, 2, 3, 4, 5, 6};
            assert_int_equal(policy_tiers_count(t, n, base), 1);
            base[was]++; /* the value it replaced, which is not counted now */
            assert_memory_equal(base, want, sizeof want);
            t[bad] = was;
        }
    }
}

/* policy_tiers_keep_or_evict says whether every tier is `keep` or
 * POLICY_EVICT and counts the evictions, for every kept tier, at lengths
 * around the vector widths, with one other value anywhere (or none). */
static void test_tiers_keep_or_evict(void **unused)
{
    (void)unused;
    uint8_t t[200];
    for (uint8_t keep = 0; keep < POLICY_TIERS; keep++) {
        if (keep == POLICY_EVICT)
            continue;
        for (size_t n = 0; n <= sizeof t; n += n < 70 ? 1 : 13) {
            uint32_t want = 0, got = 12345;
            for (size_t i = 0; i < n; i++) {
                t[i] = (i * 7 + i / 5) % 3 == 0 ? POLICY_EVICT : keep;
                want += t[i] == POLICY_EVICT;
            }
            assert_int_equal(policy_tiers_keep_or_evict(t, n, keep, &got), 1);
            assert_int_equal(got, want);
            for (size_t other = 0; other < n; other += 1 + other / 3) {
                uint8_t was = t[other];
                t[other] = (uint8_t)((keep + 1 + other % 4) % (POLICY_TIERS + 1));
                if (t[other] == POLICY_EVICT || t[other] == keep)
                    t[other] = POLICY_TIERS; /* no tier at all */
                assert_int_equal(policy_tiers_keep_or_evict(t, n, keep, &got), 0);
                t[other] = was;
            }
        }
    }
}

/* policy_mean_rows is each token's rows summed one after another in double,
 * then divided: bit for bit, for inputs whose sum depends on the order
 * (signs and magnitudes from 2^-40 to 2^40), at lengths around its blocks. */
static void test_mean_rows_in_row_order(void **unused)
{
    (void)unused;
    const uint32_t nrows_set[] = {1, 3, 4, 32};
    const size_t n_set[] = {1, 15, 511, 512, 513, 1040, 1537};
    uint64_t rng = 0x9e3779b97f4a7c15u;
    float *data = malloc(32 * 1537 * sizeof *data);
    double *got = malloc(1537 * sizeof *got);
    assert_non_null(data);
    assert_non_null(got);
    for (size_t i = 0; i < 32 * 1537; i++) {
        rng = rng * 6364136223846793005u + 1442695040888963407u;
        int e = (int)(rng >> 58) + (int)((rng >> 40) & 15) - 40; /* -40 .. 38 */
        float mag = ldexpf(1.0f + (float)((rng >> 20) & 0xfffff) / 1048576.0f, e);
        data[i] = (rng >> 19) & 1 ? -mag : mag;
    }
    size_t order_matters = 0;
    for (size_t a = 0; a < sizeof nrows_set / sizeof nrows_set[0]; a++)
        for (size_t b = 0; b < sizeof n_set / sizeof n_set[0]; b++) {
            uint32_t nrows = nrows_set[a];
            size_t n = n_set[b];
            const float *rows[32];
            for (uint32_t r = 0; r < nrows; r++)
                rows[r] = data + (size_t)r * n;
            policy_mean_rows(rows, nrows, n, got);
            for (size_t i = 0; i < n; i++) {
                double sum = 0.0, back = 0.0;
                for (uint32_t r = 0; r < nrows; r++)
                    sum += (double)rows[r][i];
                for (uint32_t r = nrows; r-- > 0;)
                    back += (double)rows[r][i];
                double want = sum / (double)nrows;
                order_matters += want != back / (double)nrows;
                if (memcmp(&want, &got[i], sizeof want) != 0)
                    fail_msg("rows %u, n %zu, token %zu: %a, want %a", nrows, n, i, got[i], want);
            }
        }
    assert_true(order_matters > 100); /* the inputs tell a reversed sum apart */
    /* A non-finite input gives a non-finite mean. */
    data[700] = NAN;
    const float *rows[3] = {data, data + 513, data + 1026};
    policy_mean_rows(rows, 3, 513, got);
    assert_true(isnan(got[187]));
    free(data);
    free(got);
}

/* ---- streaming ---- */

static void test_streaming_one_at_a_time(void **unused)
{
    (void)unused;
    const uint32_t layers = 2;
    policy_host *h = streaming_host(4, 8, layers);
    for (uint32_t t = 1; t <= 200; t++) {
        size_t evicted = host_step(h, layers, 1, 0);
        assert_int_equal(appended(h), t);
        check_streaming(h, layers, 4, 8);
        /* Once 4 + 8 are held, each new token pushes the oldest non-sink out. */
        assert_int_equal(evicted, t > 12 ? 1 : 0);
        assert_int_equal(held(h, 0), t < 12 ? t : 12);
        if (t >= 12) {
            const uint32_t *pos = policy_host_view(h, 1)->positions[0];
            for (uint32_t i = 0; i < 4; i++)
                assert_int_equal(pos[i], i);
            for (uint32_t i = 0; i < 8; i++)
                assert_int_equal(pos[4 + i], t - 8 + i);
        }
    }
    policy_host_destroy(h);
}

static void test_streaming_prefill_then_decode(void **unused)
{
    (void)unused;
    const uint32_t layers = 2;
    policy_host *h = streaming_host(4, 8, layers);

    /* The prefill is trimmed in its own step: sinks + the last 8. */
    assert_int_equal(host_step(h, layers, 50, 1), 50 - 4 - 8);
    assert_int_equal(held(h, 0), 12);
    check_streaming(h, layers, 4, 8);

    for (uint32_t i = 0; i < 100; i++) {
        assert_int_equal(host_step(h, layers, 1, 0), 1);
        check_streaming(h, layers, 4, 8);
    }

    /* A long chunk mid-sequence: the old window and the chunk's head go. */
    assert_int_equal(host_step(h, layers, 20, 1), 20);
    assert_int_equal(held(h, 0), 12);
    check_streaming(h, layers, 4, 8);
    assert_int_equal(host_step(h, layers, 1, 0), 1);
    check_streaming(h, layers, 4, 8);

    /* A chunk of exactly `window` replaces the whole window. */
    assert_int_equal(host_step(h, layers, 8, 1), 8);
    check_streaming(h, layers, 4, 8);
    /* A chunk of window - 1 keeps one old window token. */
    assert_int_equal(host_step(h, layers, 7, 1), 7);
    check_streaming(h, layers, 4, 8);
    assert_int_equal(appended(h), 50 + 100 + 20 + 1 + 8 + 7);
    policy_host_destroy(h);
}

static void test_streaming_no_sinks(void **unused)
{
    (void)unused;
    policy_host *h = streaming_host(0, 5, 1);
    for (uint32_t t = 1; t <= 100; t++) {
        assert_int_equal(host_step(h, 1, 1, 0), t > 5 ? 1 : 0);
        check_streaming(h, 1, 0, 5);
        assert_int_equal(policy_host_view(h, 0)->positions[0][0], t > 5 ? t - 5 : 0);
    }
    assert_int_equal(host_step(h, 1, 5, 1), 5); /* a chunk of `window`: all old ones go */
    check_streaming(h, 1, 0, 5);
    assert_int_equal(host_step(h, 1, 12, 1), 12);
    check_streaming(h, 1, 0, 5);
    assert_int_equal(held(h, 0), 5);
    policy_host_destroy(h);

    /* window = 1: only the newest token survives. */
    h = streaming_host(0, 1, 1);
    assert_int_equal(host_step(h, 1, 30, 1), 29);
    for (uint32_t t = 0; t < 20; t++) {
        assert_int_equal(host_step(h, 1, 1, 0), 1);
        assert_int_equal(held(h, 0), 1);
        assert_int_equal(policy_host_view(h, 0)->positions[0][0], 30 + t);
    }
    policy_host_destroy(h);
}

static void test_streaming_window_larger_than_sequence(void **unused)
{
    (void)unused;
    policy_host *h = streaming_host(4, 1000, 2);
    assert_int_equal(host_step(h, 2, 100, 1), 0);
    for (uint32_t t = 0; t < 300; t++)
        assert_int_equal(host_step(h, 2, t % 10 == 0 ? 3 : 1, 0), 0);
    assert_int_equal(held(h, 0), appended(h));
    check_streaming(h, 2, 4, 1000);
    /* Crossing 4 + 1000 tokens starts the eviction. */
    while (appended(h) < 1004)
        assert_int_equal(host_step(h, 2, 1, 0), 0);
    assert_int_equal(host_step(h, 2, 1, 0), 1);
    check_streaming(h, 2, 4, 1000);
    policy_host_destroy(h);

    /* Sinks longer than the sequence: everything is a sink. */
    h = streaming_host(1000, 1, 1);
    for (uint32_t t = 0; t < 500; t++)
        assert_int_equal(host_step(h, 1, 1, 0), 0);
    assert_int_equal(host_step(h, 1, 499, 1), 0);
    assert_int_equal(held(h, 0), 999);
    /* Positions 999 and 1000: one sink, one window token. */
    assert_int_equal(host_step(h, 1, 2, 0), 0);
    assert_int_equal(host_step(h, 1, 1, 0), 1);
    assert_int_equal(held(h, 0), 1001);
    check_streaming(h, 1, 1000, 1);
    policy_host_destroy(h);
}

/* Sinks are decided by original position, not by index in the held list;
 * the policy touches only the entries it evicts. Driven without a host so
 * that the positions can have any gaps. */
static void test_streaming_sinks_by_position(void **unused)
{
    (void)unused;
    const policy_ops *ops = find("streaming");
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    const char *keys[] = {"n_sink", "window"};
    const char *values[] = {"4", "3"};
    assert_int_equal(policy_params_resolve(ops, keys, values, 2, &p, err, sizeof(err)), 0);
    policy_geometry g = geometry(1, 4);
    void *state = NULL;
    assert_int_equal(ops->create(&p, &g, &state, err, sizeof(err)), 0);

    const uint32_t pos[] = {0, 1, 10, 11, 12, 13};
    const uint8_t cur[] = {POLICY_FULL, POLICY_INT8, POLICY_FULL,
                           POLICY_FULL, POLICY_INT8, POLICY_SKETCH};
    uint8_t next[6];
    memcpy(next, cur, sizeof(next));
    const uint32_t tokens[] = {6};
    const uint32_t *const positions[] = {pos};
    const uint8_t *const tiers[] = {cur};
    uint8_t *const dtier[] = {next};
    policy_merge merges[6];
    policy_layer_view view = {.layer = 0,
                              .heads = 1,
                              .tokens = tokens,
                              .positions = positions,
                              .tier = tiers,
                              .appended = 14,
                              .step = 3};
    policy_stats stats = {.new_tokens = 1, .confidence = -1.0};
    policy_decision d = {.tier = dtier, .merges = merges, .merges_cap = 6};
    assert_int_equal(ops->step(state, &view, &stats, &d, err, sizeof(err)), 0);
    /* Non-sinks 10, 11, 12, 13: the oldest one goes. By index the first four
     * would be "sinks" and nothing would go. */
    const uint8_t expected[] = {POLICY_FULL, POLICY_INT8, POLICY_EVICT,
                                POLICY_FULL, POLICY_INT8, POLICY_SKETCH};
    assert_memory_equal(next, expected, sizeof(expected));
    assert_int_equal(d.nmerges, 0);
    assert_int_equal(d.rerotate_keys, 0);

    /* Window covers the rest: nothing changes. */
    const uint32_t tokens3[] = {4};
    const uint32_t pos3[] = {0, 11, 12, 13};
    const uint32_t *const positions3[] = {pos3};
    view.tokens = tokens3;
    view.positions = positions3;
    memcpy(next, cur, sizeof(next));
    assert_int_equal(ops->step(state, &view, &stats, &d, err, sizeof(err)), 0);
    assert_memory_equal(next, cur, 4);

    /* Nothing held. */
    const uint32_t none[] = {0};
    view.tokens = none;
    assert_int_equal(ops->step(state, &view, &stats, &d, err, sizeof(err)), 0);
    ops->destroy(state);
}

static void test_streaming_defaults(void **unused)
{
    (void)unused;
    policy_host *h = host_new(find("streaming"), NULL, NULL, 0, 1);
    assert_int_equal(host_step(h, 1, 600, 1), 0);
    for (uint32_t t = 0; t < 450; t++) {
        host_step(h, 1, 1, 0);
        check_streaming(h, 1, 4, 1020);
    }
    assert_int_equal(held(h, 0), 4 + 1020);
    policy_host_destroy(h);
}

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Property: random n_sink, window, layers and chunk sizes, seeded. */
static void test_streaming_random_chunks(void **unused)
{
    (void)unused;
    uint64_t seed = 0x6b767374617368ULL; /* "kvstash" */
    for (int trial = 0; trial < 300; trial++) {
        uint32_t n_sink = (uint32_t)(xorshift(&seed) % 12);
        uint32_t window = 1 + (uint32_t)(xorshift(&seed) % 24);
        uint32_t layers = 1 + (uint32_t)(xorshift(&seed) % 3);
        policy_host *h = streaming_host(n_sink, window, layers);
        uint32_t expect_held = 0;
        for (int step = 0; step < 60; step++) {
            uint32_t r = (uint32_t)(xorshift(&seed) % 8);
            uint32_t incoming = r < 5 ? 1 : 1 + (uint32_t)(xorshift(&seed) % 40);
            size_t evicted = host_step(h, layers, incoming, r >= 5);
            check_streaming(h, layers, n_sink, window);
            /* Conservation: what was held plus what came minus what went. */
            assert_int_equal(held(h, 0), expect_held + incoming - evicted);
            expect_held = held(h, 0);
        }
        policy_host_destroy(h);
    }
}

/*
 * Spans (policy.h): a policy that narrows its decision's span to what it
 * changed must leave every tier outside it as preset, whatever it decides.
 * The per-step policies that narrow it (streaming, h2o, tova from the
 * summed score and from last_attn, ov_block) run a prompt and hundreds of
 * decode steps of random statistics through a host; after each step, every
 * tier outside each span equals the view's tier before it, and decode
 * steps did narrow (a span the host widened would pass trivially).
 */
typedef struct span_case {
    const char *policy;
    const char *kv[6];
    int last_attn; /* statistics as last_attn rows, else a summed score */
} span_case;

static void span_stats(policy_stats *st, const span_case *c, uint32_t n, int prefill, float *score,
                       float *const *rows, uint32_t q_heads, uint64_t *rng)
{
    for (uint32_t i = 0; i < n; i++)
        score[i] = (float)(xorshift(rng) % 1000) / 1000.0f;
    for (uint32_t q = 0; q < q_heads; q++)
        for (uint32_t i = 0; i < n; i++)
            rows[q][i] = (float)(xorshift(rng) % 1000) / 1000.0f;
    *st = (policy_stats){.new_tokens = 1, .prefill = prefill, .confidence = -1.0};
    if (c->last_attn) {
        st->last_attn = (const float *const *)rows;
    } else {
        st->score = score;
        st->score_queries = 1;
    }
}

static void test_decision_spans_honest(void **unused)
{
    (void)unused;
    enum { LAYERS = 2, Q_HEADS = 4, PROMPT = 300, STEPS = 400, MAX = PROMPT + STEPS + 1 };
    static const span_case cases[] = {
        {"streaming", {"n_sink=4", "window=120", NULL}, 0},
        {"h2o", {"budget=160", "recent=16", "sinks=3", NULL}, 0},
        {"tova", {"budget=160", NULL}, 0},
        {"tova", {"budget=160", NULL}, 1},
        {"ov_block",
         {"start_size=32", "recent_size=32", "max_cache_size=160", "max_pool_window=1",
          "snapkv_window=0", NULL},
         0},
    };
    static float score[MAX], row_buf[Q_HEADS][MAX];
    static uint8_t before[MAX];
    float *rows[Q_HEADS];
    for (uint32_t q = 0; q < Q_HEADS; q++)
        rows[q] = row_buf[q];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const span_case *sc = &cases[c];
        policy_geometry g = ph_geom(LAYERS, Q_HEADS, 1);
        policy_host *h = ph_host(sc->policy, sc->kv, g);
        uint64_t rng = 0x5eed + c;
        unsigned narrow = 0, decode_steps = 0;
        for (uint32_t step = 0; step <= STEPS; step++) {
            assert_int_equal(policy_host_append(h, step == 0 ? PROMPT : 1), 0);
            for (uint32_t l = 0; l < LAYERS; l++) {
                const policy_layer_view *v = policy_host_view(h, l);
                uint32_t n = v->tokens[0];
                assert_true(n <= MAX);
                memcpy(before, v->tier[0], n);
                policy_stats st;
                span_stats(&st, sc, n, step == 0, score, rows, Q_HEADS, &rng);
                const policy_decision *d = ph_decide(h, l, &st);
                assert_non_null(d->span);
                policy_span sp = d->span[0];
                assert_true(sp.lo <= sp.hi && sp.hi <= n);
                for (uint32_t i = 0; i < n; i++)
                    if (i < sp.lo || i >= sp.hi)
                        assert_int_equal(d->tier[0][i], before[i]);
                decode_steps += step > 0;
                narrow += step > 0 && sp.hi - sp.lo < n;
                policy_host_commit(h, l);
            }
        }
        if (narrow != decode_steps)
            fail_msg("%s: %u of %u decode steps narrowed their span", sc->policy, narrow,
                     decode_steps);
        policy_host_destroy(h);
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
        cmocka_unit_test(test_params_double_good),
        cmocka_unit_test(test_params_double_bad),
        cmocka_unit_test(test_params_choice),
        cmocka_unit_test(test_params_parse_typed),
        cmocka_unit_test(test_full_keeps_everything),
        cmocka_unit_test(test_tiers_count),
        cmocka_unit_test(test_tiers_keep_or_evict),
        cmocka_unit_test(test_mean_rows_in_row_order),
        cmocka_unit_test(test_streaming_one_at_a_time),
        cmocka_unit_test(test_streaming_prefill_then_decode),
        cmocka_unit_test(test_streaming_no_sinks),
        cmocka_unit_test(test_streaming_window_larger_than_sequence),
        cmocka_unit_test(test_streaming_sinks_by_position),
        cmocka_unit_test(test_streaming_defaults),
        cmocka_unit_test(test_streaming_random_chunks),
        cmocka_unit_test(test_decision_spans_honest),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
