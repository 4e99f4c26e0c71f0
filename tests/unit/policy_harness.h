/*
 * policy_harness.h - what every policy unit test (tests/unit/test_polic*.c)
 * shares, written once:
 *   - a seeded RNG (splitmix64: deterministic everywhere, any seed);
 *   - creating a policy host from "key=value" text or key/value arrays;
 *   - rejection checks, one configuration or a numbered table of them;
 *   - stepping a layer through the host (success, or an expected refusal)
 *     and reading what it holds;
 *   - the kernels' references (kernels/kernels.h, the one implementation of
 *     the K/V math) on plain float vectors, for the paper vectors: a
 *     count-sketch over [dim] vectors, value merges over [n][dim] rows, the
 *     projected value norm over [kv_heads][tokens][d] values, and RoPE
 *     re-rotation of one key. Each puts the vectors in a one-block fp32 pool
 *     and calls the `_ref` kernel.
 *
 * Header-only (static inline) because each test is its own executable.
 */
#ifndef KVSTASH_TESTS_POLICY_HARNESS_H
#define KVSTASH_TESTS_POLICY_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "host.h"
#include "kernels.h"
#include "policy.h"

/* ---- seeded randomness ---------------------------------------------------- */

/* splitmix64: the next value of the stream whose state is *s. */
static inline uint64_t ph_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi) with 24-bit resolution, so every value is an exact
 * float and sums of a few stay exact. */
static inline float ph_uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)(ph_rand(s) >> 40) / (float)(1u << 24);
}

/* Uniform in [0, n) (n > 0; the modulo bias is irrelevant for tests). */
static inline uint32_t ph_below(uint64_t *s, uint32_t n)
{
    return (uint32_t)(ph_rand(s) % n);
}

/* ---- hosts ------------------------------------------------------------------ */

/* layers x (q_heads, kv_heads), head_dim 64, 16-token blocks, theta 1e4. */
static inline policy_geometry ph_geom(uint32_t layers, uint32_t q_heads, uint32_t kv_heads)
{
    policy_geometry g = {layers, q_heads, kv_heads, 64, 16, 10000.0f};
    return g;
}

static inline const policy_ops *ph_ops(const char *policy)
{
    const policy_ops *ops = policy_find(policy);
    if (ops == NULL)
        fail_msg("no policy %s", policy);
    return ops;
}

/* Resolve n key/value pairs and create the host; -1 with err set when
 * resolve or create refuses. */
static inline int ph_try_host_pairs(const char *policy, const char *const *keys,
                                    const char *const *values, size_t n, policy_geometry g,
                                    policy_host **out, char *err, size_t errlen)
{
    const policy_ops *ops = ph_ops(policy);
    policy_params p;
    *out = NULL;
    if (policy_params_resolve(ops, keys, values, n, &p, err, errlen) != 0)
        return -1;
    return policy_host_create(ops, &p, &g, out, err, errlen);
}

/* The same from "key=value" strings, NULL-terminated (kv may be NULL). */
static inline int ph_try_host(const char *policy, const char *const *kv, policy_geometry g,
                              policy_host **out, char *err, size_t errlen)
{
    char keys[POLICY_MAX_PARAMS][64], vals[POLICY_MAX_PARAMS][64];
    const char *kp[POLICY_MAX_PARAMS], *vp[POLICY_MAX_PARAMS];
    size_t n = 0;
    for (; kv != NULL && kv[n] != NULL; n++) {
        assert_true(n < POLICY_MAX_PARAMS);
        const char *eq = strchr(kv[n], '=');
        assert_non_null(eq);
        snprintf(keys[n], sizeof keys[n], "%.*s", (int)(eq - kv[n]), kv[n]);
        snprintf(vals[n], sizeof vals[n], "%s", eq + 1);
        kp[n] = keys[n];
        vp[n] = vals[n];
    }
    return ph_try_host_pairs(policy, kp, vp, n, g, out, err, errlen);
}

/* ph_try_host that fails the test on a refusal. */
static inline policy_host *ph_host(const char *policy, const char *const *kv, policy_geometry g)
{
    policy_host *h = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (ph_try_host(policy, kv, g, &h, err, sizeof err) != 0)
        fail_msg("creating %s: %s", policy, err);
    return h;
}

/* ph_try_host_pairs that fails the test on a refusal. */
static inline policy_host *ph_host_pairs(const char *policy, const char *const *keys,
                                         const char *const *values, size_t n, policy_geometry g)
{
    policy_host *h = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (ph_try_host_pairs(policy, keys, values, n, g, &h, err, sizeof err) != 0)
        fail_msg("creating %s: %s", policy, err);
    return h;
}

/* ---- rejections ------------------------------------------------------------- */

/* One configuration a policy must refuse: its "key=value" settings
 * (NULL-terminated) and words its message must contain (NULL-terminated;
 * the first is usually the parameter's name). */
typedef struct ph_reject {
    const char *kv[6];
    const char *words[4];
} ph_reject;

/* Expect resolve or create to refuse kv in geometry g, with a message that
 * contains every word; `what` names the case in a failure. */
static inline void ph_expect_reject_in(const char *policy, const char *const *kv, policy_geometry g,
                                       const char *const *words, const char *what)
{
    policy_host *h = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (ph_try_host(policy, kv, g, &h, err, sizeof err) == 0) {
        policy_host_destroy(h);
        fail_msg("%s %s: accepted a configuration it should refuse", policy, what);
    }
    for (size_t i = 0; words[i] != NULL; i++)
        if (strstr(err, words[i]) == NULL)
            fail_msg("%s %s: message '%s' does not contain '%s'", policy, what, err, words[i]);
}

/* One configuration, one word. */
static inline void ph_expect_reject(const char *policy, const char *const *kv, policy_geometry g,
                                    const char *word)
{
    const char *words[] = {word, NULL};
    ph_expect_reject_in(policy, kv, g, words, "");
}

/* Every case of a table (numbered from 1 in failures). */
static inline void ph_expect_rejects(const char *policy, policy_geometry g, const ph_reject *cases,
                                     size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char what[32];
        snprintf(what, sizeof what, "case %zu", i + 1);
        ph_expect_reject_in(policy, cases[i].kv, g, cases[i].words, what);
    }
}

#define PH_N(a) (sizeof(a) / sizeof((a)[0]))

/* ---- the registry entry ------------------------------------------------------- */

typedef struct ph_default {
    const char *key, *value;
} ph_default;

/* The policy is registered with these needs and per_head, every parameter
 * has help text, and resolving no parameters gives these defaults. */
static inline void ph_expect_registry(const char *policy, unsigned needs, int per_head,
                                      const ph_default *defaults, size_t n)
{
    const policy_ops *ops = ph_ops(policy);
    assert_int_equal(ops->per_head, per_head);
    assert_int_equal(ops->needs, needs);
    for (size_t i = 0; i < ops->nparams; i++)
        assert_true(ops->params[i].help != NULL && ops->params[i].help[0] != '\0');
    policy_params p;
    char err[POLICY_ERR_LEN] = "";
    assert_int_equal(policy_params_resolve(ops, NULL, NULL, 0, &p, err, sizeof err), 0);
    for (size_t i = 0; i < n; i++) {
        const char *got = policy_params_get(&p, defaults[i].key);
        if (got == NULL || strcmp(got, defaults[i].value) != 0)
            fail_msg("%s: default of %s is '%s', expected '%s'", policy, defaults[i].key,
                     got ? got : "(none)", defaults[i].value);
    }
}

/* ---- steps -------------------------------------------------------------------- */

/* Step one layer; fails the test when the policy refuses. */
static inline const policy_decision *ph_decide(policy_host *h, uint32_t layer,
                                               const policy_stats *st)
{
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, layer, st, &d, err, sizeof err) != 0)
        fail_msg("step of layer %u failed: %s", layer, err);
    return d;
}

/* Step and commit one layer; returns the number of evicted tokens. */
static inline size_t ph_step(policy_host *h, uint32_t layer, const policy_stats *st)
{
    ph_decide(h, layer, st);
    return policy_host_commit(h, layer);
}

/* Step one layer expecting a refusal whose message contains `word`. */
static inline void ph_step_fails(policy_host *h, uint32_t layer, const policy_stats *st,
                                 const char *word)
{
    const policy_decision *d = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (policy_host_step(h, layer, st, &d, err, sizeof err) == 0)
        fail_msg("step of layer %u succeeded, expected an error about %s", layer, word);
    if (strstr(err, word) == NULL)
        fail_msg("step error '%s' does not name '%s'", err, word);
}

/* Held positions of list g of a layer as "0,3,7". */
static inline void ph_held(policy_host *h, uint32_t layer, uint32_t g, char *buf, size_t len)
{
    const policy_layer_view *v = policy_host_view(h, layer);
    size_t used = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < v->tokens[g] && used < len; i++) {
        int n = snprintf(buf + used, len - used, "%s%u", i ? "," : "", v->positions[g][i]);
        if (n < 0)
            break;
        used += (size_t)n;
    }
}

static inline void ph_expect_held(policy_host *h, uint32_t layer, uint32_t g, const char *want)
{
    char got[1024];
    ph_held(h, layer, g, got, sizeof got);
    if (strcmp(got, want) != 0)
        fail_msg("layer %u head %u holds {%s}, expected {%s}", layer, g, got, want);
}

/* The same against positions. */
static inline void ph_expect_positions(policy_host *h, uint32_t layer, uint32_t g,
                                       const uint32_t *want, uint32_t n)
{
    const policy_layer_view *v = policy_host_view(h, layer);
    assert_int_equal(v->tokens[g], n);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(v->positions[g][i], want[i]);
}

/* ---- the kernels' references on float vectors --------------------------------- */

static inline void *ph_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    assert_non_null(p);
    return p;
}

/* One fp32 block of `tokens` slots, one head of `dim` channels: K rows then
 * V rows. */
static inline kv_layout ph_layout(uint32_t tokens, uint32_t dim)
{
    kv_layout l = {1, tokens, dim, 4, 0};
    return l;
}

/* A zeroed count-sketch of rows x buckets cells of dim floats (POLICIES.md
 * §3.3); free with ph_sketch_free. */
static inline kv_sketch ph_sketch_new(uint32_t rows, uint32_t buckets, uint32_t dim,
                                      kv_estimate key_estimate, kv_estimate value_estimate)
{
    size_t cells = (size_t)rows * buckets;
    kv_sketch s = {rows,
                   buckets,
                   dim,
                   key_estimate,
                   value_estimate,
                   ph_calloc(cells * dim, sizeof(float)),
                   ph_calloc(cells * dim, sizeof(float)),
                   ph_calloc(cells, sizeof(int32_t))};
    return s;
}

static inline void ph_sketch_free(kv_sketch *s)
{
    free(s->key);
    free(s->value);
    free(s->count);
    memset(s, 0, sizeof *s);
}

/* Alg. 1 for one token with buckets h and signs g (kv_sketch_insert_ref). */
static inline void ph_sketch_insert(kv_sketch *s, const uint32_t *h, const int8_t *g,
                                    const float *k, const float *v)
{
    kv_layout l = ph_layout(1, s->dim);
    float *pool = ph_calloc(2 * (size_t)s->dim, sizeof(float));
    memcpy(pool, k, s->dim * sizeof(float));
    memcpy(pool + s->dim, v, s->dim * sizeof(float));
    kv_segment seg = {0, 0, 1};
    kv_sketch_insert_ref(s, &l, KV_FP32, (const uint8_t *)pool, &seg, 1, h, g);
    free(pool);
}

/* Alg. 2 (query, del = 0) or Alg. 3's swap (revive: query, then delete the
 * estimate, del = 1) for one token; the estimate goes to k and v. */
static inline void ph_sketch_estimate(kv_sketch *s, const uint32_t *h, const int8_t *g, float *k,
                                      float *v, int del)
{
    kv_layout l = ph_layout(1, s->dim);
    float *pool = ph_calloc(2 * (size_t)s->dim, sizeof(float));
    kv_segment seg = {0, 0, 1};
    if (del)
        kv_sketch_revive_ref(s, h, g, &l, KV_FP32, (uint8_t *)pool, &seg, 1);
    else
        kv_sketch_query_ref(s, h, g, &l, KV_FP32, (uint8_t *)pool, &seg, 1);
    memcpy(k, pool, s->dim * sizeof(float));
    memcpy(v, pool + s->dim, s->dim * sizeof(float));
    free(pool);
}

static inline void ph_sketch_query(const kv_sketch *s, const uint32_t *h, const int8_t *g, float *k,
                                   float *v)
{
    kv_sketch view = *s; /* del = 0 changes nothing */
    ph_sketch_estimate(&view, h, g, k, v, 0);
}

static inline void ph_sketch_revive(kv_sketch *s, const uint32_t *h, const int8_t *g, float *k,
                                    float *v)
{
    ph_sketch_estimate(s, h, g, k, v, 1);
}

/* The merges of `head` (policy_merge, in order) on the rows of values
 * ([n][dim], list order) through kv_merge_values_ref. Fails the test on an
 * index outside the rows. */
static inline void ph_merge_values(float *values, size_t n, size_t dim, const policy_merge *m,
                                   size_t nm, uint32_t head)
{
    kv_layout l = ph_layout((uint32_t)n, (uint32_t)dim);
    float *pool = ph_calloc(2 * n * dim, sizeof(float));
    kv_merge *km = ph_calloc(nm, sizeof *km);
    size_t k = 0;
    for (size_t i = 0; i < nm; i++) {
        if (m[i].head != head)
            continue;
        assert_true(m[i].from < n && m[i].into < n);
        km[k++] = (kv_merge){0, m[i].from, 0, m[i].into, m[i].w_from, m[i].w_into};
    }
    memcpy(pool + n * dim, values, n * dim * sizeof(float)); /* the V half */
    kv_merge_values_ref(&l, KV_FP32, (uint8_t *)pool, km, k);
    memcpy(values, pool + n * dim, n * dim * sizeof(float));
    free(km);
    free(pool);
}

/* POLICIES.md §1.2 through kv_vnorm_l1_ref: v is [kv_heads][tokens][d],
 * wo is o_proj.weight [hidden][q_heads·d]; out is [kv_heads][tokens]. */
static inline void ph_vnorm_l1(const float *v, const float *wo, uint32_t kv_heads, uint32_t q_heads,
                               uint32_t d, uint32_t hidden, size_t tokens, float *out)
{
    kv_layout l = {kv_heads, (uint32_t)tokens, d, 4, 0};
    size_t half = (size_t)kv_heads * tokens * d;
    float *pool = ph_calloc(2 * half, sizeof(float));
    memcpy(pool + half, v, half * sizeof(float)); /* [kv_heads][tokens][d] is the V half */
    kv_segment seg = {0, 0, (uint32_t)tokens};
    kv_vnorm_l1_ref(&l, KV_FP32, (const uint8_t *)pool, &seg, 1, wo, (size_t)q_heads * d, q_heads,
                    hidden, out);
    free(pool);
}

/* Re-rotate one key of d fp32 values by delta positions (kv_rope_rerotate_ref,
 * rotate-half pairing unless interleaved). */
static inline void ph_rope_rerotate(float *key, uint32_t d, int32_t delta, double theta,
                                    kv_rope_pairing pairing)
{
    kv_layout l = ph_layout(1, d);
    float *pool = ph_calloc(2 * (size_t)d, sizeof(float));
    memcpy(pool, key, d * sizeof(float));
    kv_segment seg = {0, 0, 1};
    kv_rope_rerotate_ref(&l, KV_FP32, (uint8_t *)pool, &seg, 1, &delta, theta, pairing);
    memcpy(key, pool, d * sizeof(float));
    free(pool);
}

/* ---- moving a host (policy_host_restore) -------------------------------------- */

/* The statistics ops->needs, random, for every layer's lists as they are
 * now; arrays owned by *b (ph_stats_free). */
typedef struct ph_stats_buf {
    policy_stats st;
    float *score, *rows;
    const float **last, **window, **vnorm;
} ph_stats_buf;

static inline void ph_stats_free(ph_stats_buf *b)
{
    free(b->score), free(b->rows), free(b->last), free(b->window), free(b->vnorm);
    memset(b, 0, sizeof *b);
}

static inline void ph_stats_random(policy_host *h, uint32_t layer, const policy_geometry *g,
                                   uint32_t new_tokens, int prefill, uint64_t *rng, ph_stats_buf *b)
{
    const policy_ops *ops = policy_host_ops(h);
    const policy_layer_view *v = policy_host_view(h, layer);
    uint32_t per = g->q_heads / g->kv_heads, most = 1;
    for (uint32_t k = 0; k < v->heads; k++)
        most = v->tokens[k] > most ? v->tokens[k] : most;
    memset(b, 0, sizeof *b);
    b->st = (policy_stats){.new_tokens = new_tokens, .prefill = prefill, .confidence = -1};
    size_t nrows = (size_t)(g->q_heads * 2 + g->kv_heads);
    b->rows = ph_calloc(nrows * most, sizeof *b->rows);
    b->score = ph_calloc(most, sizeof *b->score);
    b->last = ph_calloc(g->q_heads, sizeof *b->last);
    b->window = ph_calloc(g->q_heads, sizeof *b->window);
    b->vnorm = ph_calloc(g->kv_heads, sizeof *b->vnorm);
    for (size_t i = 0; i < nrows * most; i++)
        b->rows[i] = ph_uniform(rng, 0.0f, 1.0f);
    for (uint32_t i = 0; i < most; i++)
        b->score[i] = ph_uniform(rng, 0.0f, 4.0f);
    for (uint32_t q = 0; q < g->q_heads; q++) {
        b->last[q] = b->rows + (size_t)q * most;
        b->window[q] = b->rows + (size_t)(g->q_heads + q) * most;
    }
    for (uint32_t k = 0; k < g->kv_heads; k++)
        b->vnorm[k] = b->rows + (size_t)(2 * g->q_heads + k) * most;
    (void)per;
    if (ops->needs & POLICY_NEEDS_SCORE) {
        b->st.score = b->score;
        b->st.score_queries = 1;
    }
    if (ops->needs & POLICY_NEEDS_LAST_ATTN)
        b->st.last_attn = b->last;
    if (ops->needs & POLICY_NEEDS_WINDOW_ATTN) {
        b->st.window_attn = b->window;
        b->st.window_queries = 8;
    }
    if (ops->needs & POLICY_NEEDS_VNORM)
        b->st.vnorm = b->vnorm;
    if (ops->needs & POLICY_NEEDS_CONFIDENCE)
        b->st.confidence = ph_uniform(rng, 0.0f, 1.0f);
}

/* Tokens of every list, by tier (POLICY_TIERS counts). */
static inline void ph_tier_counts(policy_host *h, const policy_geometry *g, uint64_t *counts)
{
    memset(counts, 0, POLICY_TIERS * sizeof *counts);
    for (uint32_t l = 0; l < g->layers; l++) {
        const policy_layer_view *v = policy_host_view(h, l);
        for (uint32_t k = 0; k < v->heads; k++)
            for (uint32_t i = 0; i < v->tokens[k]; i++)
                counts[v->tier[k][i] < POLICY_TIERS ? v->tier[k][i] : 0]++;
    }
}

/* One round on h: append n tokens, step and commit every layer with
 * statistics drawn from *rng. Returns how many tokens the policy moved:
 * evicted, or (a policy that keeps them, as reviver) sent to another
 * tier, as far as the tiers' counts tell. */
static inline size_t ph_round(policy_host *h, const policy_geometry *g, uint32_t n, int prefill,
                              uint64_t *rng)
{
    uint64_t before[POLICY_TIERS], after[POLICY_TIERS];
    if (policy_host_append(h, n) != 0)
        fail_msg("append of %u failed", n);
    ph_tier_counts(h, g, before);
    size_t moved = 0;
    for (uint32_t l = 0; l < g->layers; l++) {
        ph_stats_buf b;
        ph_stats_random(h, l, g, n, prefill, rng, &b);
        moved += ph_step(h, l, &b.st);
        ph_stats_free(&b);
    }
    ph_tier_counts(h, g, after);
    for (int t = 1; t < POLICY_TIERS; t++) /* every tier but FULL */
        moved += after[t] > before[t] ? after[t] - before[t] : before[t] - after[t];
    return moved;
}

/* A fresh host of the same policy with a's counters, lists and state
 * (policy_host_restore); fails the test when a is not portable or the
 * restore refuses. */
static inline policy_host *ph_moved(policy_host *a, const char *policy, const char *const *kv,
                                    policy_geometry g)
{
    uint32_t heads = policy_host_heads(a), nl = g.layers * heads;
    policy_host_list_image *im = ph_calloc(nl, sizeof *im);
    policy_host_state_image *states = ph_calloc(g.layers, sizeof *states);
    void **bufs = ph_calloc(g.layers, sizeof *bufs);
    for (uint32_t l = 0; l < g.layers; l++) {
        const policy_layer_view *v = policy_host_view(a, l);
        for (uint32_t k = 0; k < heads; k++)
            im[l * heads + k] = (policy_host_list_image){v->tokens[k], v->positions[k], v->tier[k],
                                                         policy_host_attn(a, l, k)};
        bufs[l] = policy_host_export_state(a, l, &states[l].len);
        assert_non_null(bufs[l]);
        states[l].buf = bufs[l];
    }
    policy_host *b = ph_host(policy, kv, g);
    char err[POLICY_ERR_LEN] = "";
    const policy_ops *ops = policy_host_ops(a);
    if (policy_host_restore(b, policy_host_appended(a), policy_host_steps(a), im,
                            ops->import_layer != NULL ? states : NULL, err, sizeof err) != 0)
        fail_msg("restore of %s failed: %s", policy, err);
    for (uint32_t l = 0; l < g.layers; l++)
        free(bufs[l]);
    free(bufs), free(states), free(im);
    return b;
}

/* The same lists, tiers and (when the policy describes it) state. */
static inline void ph_expect_same_hosts(policy_host *a, policy_host *b, policy_geometry g,
                                        const char *when)
{
    const policy_ops *ops = policy_host_ops(a);
    for (uint32_t l = 0; l < g.layers; l++) {
        const policy_layer_view *va = policy_host_view(a, l), *vb = policy_host_view(b, l);
        for (uint32_t k = 0; k < va->heads; k++) {
            if (va->tokens[k] != vb->tokens[k])
                fail_msg("%s: layer %u list %u holds %u tokens, the moved one %u", when, l, k,
                         va->tokens[k], vb->tokens[k]);
            for (uint32_t i = 0; i < va->tokens[k]; i++)
                if (va->positions[k][i] != vb->positions[k][i] || va->tier[k][i] != vb->tier[k][i])
                    fail_msg("%s: layer %u list %u token %u differs", when, l, k, i);
        }
        if (ops->describe != NULL) {
            char *da = ops->describe(policy_host_state(a), l);
            char *db = ops->describe(policy_host_state(b), l);
            if (da != NULL && db != NULL && strcmp(da, db) != 0)
                fail_msg("%s: layer %u's state differs:\n%s\n%s", when, l, da, db);
            free(da), free(db);
        }
    }
}

/*
 * The property a policy's export_layer / import_layer must have: a host
 * moved after some rounds (policy_host_restore) holds the same lists and
 * state, and stepped on with the same statistics as the original decides
 * exactly as it does (and the policy must evict or move some token to
 * another tier after the move, or the check proves little). `rounds`
 * rounds of 1..8 tokens after a prefill of
 * `prefill` tokens, then the move, then as many again on both. Also: the
 * policy refuses state bytes cut short by one, or with one byte changed
 * where that makes them impossible (import_layer must check, not trust).
 */
static inline void ph_check_portable(const char *policy, const char *const *kv, policy_geometry g,
                                     uint32_t prefill, uint32_t rounds, uint64_t seed)
{
    uint64_t rng = seed;
    policy_host *a = ph_host(policy, kv, g);
    if (!policy_host_portable(a))
        fail_msg("policy %s cannot move (no export_layer / import_layer)", policy);
    ph_round(a, &g, prefill, 1, &rng);
    for (uint32_t r = 0; r < rounds; r++)
        ph_round(a, &g, 1 + ph_below(&rng, 8), 0, &rng);
    policy_host *b = ph_moved(a, policy, kv, g);
    ph_expect_same_hosts(a, b, g, "after the move");
    size_t moved = 0;
    for (uint32_t r = 0; r < rounds; r++) {
        uint32_t n = 1 + ph_below(&rng, 8);
        uint64_t fork = rng;
        moved += ph_round(a, &g, n, 0, &rng);
        ph_round(b, &g, n, 0, &fork);
        ph_expect_same_hosts(a, b, g, "stepping on after the move");
    }
    if (moved == 0)
        fail_msg("%s moved no token after the move (evicted or changed tier): the check "
                 "proves little",
                 policy);
    /* Truncated state is refused. */
    if (policy_host_ops(a)->import_layer != NULL) {
        size_t len;
        void *buf = policy_host_export_state(a, 0, &len);
        assert_non_null(buf);
        policy_host *c = ph_host(policy, kv, g);
        char err[POLICY_ERR_LEN] = "";
        if (len > 0 && policy_host_ops(c)->import_layer(policy_host_state(c), 0, buf, len - 1, err,
                                                        sizeof err) == 0)
            fail_msg("%s accepted its layer state cut short by a byte", policy);
        if (len > 0 && err[0] == '\0')
            fail_msg("%s refused cut-short state without saying why", policy);
        free(buf);
        policy_host_destroy(c);
    }
    policy_host_destroy(a);
    policy_host_destroy(b);
}

/* One way to spoil a policy's valid layer state, which import_layer must
 * refuse: `width` bytes at `off` set to `value` (little-endian; width 0:
 * none), then `extra` bytes more (zeros) or fewer (cut); `word` is what
 * the refusal's message must say. */
typedef struct ph_spoil {
    const char *what;
    size_t off;
    unsigned width;
    uint64_t value;
    int extra;
    const char *word;
} ph_spoil;

/* import_layer of b's spoiling of good[0..len) into h's layer refuses,
 * naming b->word, and leaves the state as it was: the layer's describe()
 * and its exported bytes (which carry any state that is not per layer). */
static inline void ph_expect_refused(policy_host *h, uint32_t layer, const uint8_t *good,
                                     size_t len, const ph_spoil *b)
{
    const policy_ops *ops = policy_host_ops(h);
    size_t n = (size_t)((ptrdiff_t)len + b->extra), blen, alen;
    uint8_t *buf = ph_calloc(n + 1, 1);
    memcpy(buf, good, n < len ? n : len);
    for (unsigned i = 0; i < b->width; i++)
        buf[b->off + i] = (uint8_t)(b->value >> (8 * i));
    char *before = ops->describe(policy_host_state(h), layer);
    uint8_t *bbytes = policy_host_export_state(h, layer, &blen);
    char err[POLICY_ERR_LEN] = "";
    if (ops->import_layer(policy_host_state(h), layer, buf, n, err, sizeof err) == 0)
        fail_msg("%s: accepted", b->what);
    if (strstr(err, b->word) == NULL)
        fail_msg("%s: '%s' does not say '%s'", b->what, err, b->word);
    char *after = ops->describe(policy_host_state(h), layer);
    uint8_t *abytes = policy_host_export_state(h, layer, &alen);
    assert_non_null(bbytes);
    assert_non_null(abytes);
    if (strcmp(before, after) != 0 || blen != alen || memcmp(bbytes, abytes, blen) != 0)
        fail_msg("%s: the refused import changed the state", b->what);
    free(before), free(after), free(buf), free(bbytes), free(abytes);
}

#endif
