/*
 * snapkv_harness.h - what only the SnapKV-family policy tests
 * (test_policy_{snapkv,adakv,criticalkv,criticalkv_ada}.c) share, on top of
 * policy_harness.h (hosts, rejections, RNG, steps): seeded random stats
 * shaped like a host's view, and independent references of the SnapKV base
 * score (POLICIES.md §1.3) and the AdaKV budget (§1.5), so the property
 * tests do not trust the code they test.
 *
 * Header-only (static functions) because each test is its own executable.
 */
#ifndef KVSTASH_TESTS_SNAPKV_HARNESS_H
#define KVSTASH_TESTS_SNAPKV_HARNESS_H

#include <math.h>

#include "policy_harness.h"
#include "snapkv_family.h"

#define SK_MAX_HEADS 16

/* Stats for one layer, shaped like the host's current view of that layer. */
typedef struct sk_stats {
    float *wa[SK_MAX_HEADS * 8]; /* [q_heads][list of kv head h/G] */
    float *vn[SK_MAX_HEADS];     /* [kv_heads][list] */
    policy_stats st;
    uint32_t q_heads, kv_heads;
} sk_stats;

static inline void sk_stats_free(sk_stats *s)
{
    for (uint32_t h = 0; h < s->q_heads; h++)
        free(s->wa[h]);
    for (uint32_t g = 0; g < s->kv_heads; g++)
        free(s->vn[g]);
    memset(s, 0, sizeof *s);
}

/* Random window attention in [0, 1) and vnorm in [0.25, 4) for every held
 * token of the layer; prefill flag and new tokens as given. */
static inline void sk_stats_random(sk_stats *s, policy_host *h, uint32_t layer, uint32_t q_heads,
                                   uint32_t kv_heads, uint64_t *seed, int prefill,
                                   uint32_t new_tokens, uint32_t window)
{
    memset(s, 0, sizeof *s);
    s->q_heads = q_heads;
    s->kv_heads = kv_heads;
    const policy_layer_view *v = policy_host_view(h, layer);
    uint32_t G = q_heads / kv_heads;
    uint32_t lists = v->heads;
    for (uint32_t q = 0; q < q_heads; q++) {
        uint32_t n = v->tokens[lists == 1 ? 0 : q / G];
        s->wa[q] = malloc((n ? n : 1) * sizeof(float));
        assert_non_null(s->wa[q]);
        for (uint32_t i = 0; i < n; i++)
            s->wa[q][i] = ph_uniform(seed, 0, 1);
    }
    for (uint32_t g = 0; g < kv_heads; g++) {
        uint32_t n = v->tokens[lists == 1 ? 0 : g];
        s->vn[g] = malloc((n ? n : 1) * sizeof(float));
        assert_non_null(s->vn[g]);
        for (uint32_t i = 0; i < n; i++)
            s->vn[g][i] = ph_uniform(seed, 0.25f, 4);
    }
    s->st.new_tokens = new_tokens;
    s->st.prefill = prefill;
    s->st.window_attn = (const float *const *)s->wa;
    s->st.window_queries = window;
    s->st.vnorm = (const float *const *)s->vn;
    s->st.confidence = -1;
}

/* The kept indices of keep[0..n) must be `want` ("0,3"). */
static inline void sk_expect_keep(const uint8_t *keep, size_t n, const char *want)
{
    char got[256] = "";
    size_t used = 0;
    for (size_t i = 0; i < n; i++)
        if (keep[i])
            used += (size_t)snprintf(got + used, sizeof got - used, "%s%zu", used ? "," : "", i);
    if (strcmp(got, want) != 0)
        fail_msg("kept {%s}, expected {%s}", got, want);
}

/*
 * Independent reference of the SnapKV base score of §1.3 for every token of
 * every list of a layer, written straight from the spec's pseudo-code
 * (separate from snapkv_base_scores): ref[g][i].
 */
static inline void sk_ref_scores(const policy_layer_view *v, const policy_stats *st,
                                 uint32_t q_heads, uint32_t window, uint32_t kernel, int maxpool,
                                 int pad_plus_one, double **ref)
{
    uint32_t H = v->heads, G = q_heads / H;
    double mx = -1e300;
    for (uint32_t g = 0; g < H; g++) {
        uint32_t P = 0;
        while (P < v->tokens[g] && v->positions[g][P] + window < v->appended)
            P++;
        for (uint32_t i = 0; i < P; i++) {
            double sum = 0;
            for (uint32_t q = g * G; q < (g + 1) * G; q++) {
                double acc = maxpool ? -1e300 : 0;
                for (long j = (long)i - (long)(kernel / 2); j <= (long)i + (long)(kernel / 2);
                     j++) {
                    if (j < 0 || j >= (long)P)
                        continue; /* padding: 0 for avg (still divided by k), never wins for max */
                    double x = st->window_attn[q][j];
                    acc = maxpool ? (x > acc ? x : acc) : acc + x;
                }
                sum += maxpool ? acc : acc / kernel;
            }
            ref[g][i] = sum / G;
            if (ref[g][i] > mx)
                mx = ref[g][i];
        }
        for (uint32_t i = P; i < v->tokens[g]; i++)
            ref[g][i] = -1; /* window: filled below */
    }
    for (uint32_t g = 0; g < H; g++)
        for (uint32_t i = 0; i < v->tokens[g]; i++)
            if (ref[g][i] == -1)
                ref[g][i] = pad_plus_one ? mx + 1 : mx;
}

/* Rank of entry (score s, index i) among n scores by "higher score, ties to
 * the lower index": the number of entries that beat it. */
static inline size_t sk_rank(const double *score, size_t n, size_t i)
{
    size_t r = 0;
    for (size_t j = 0; j < n; j++)
        if (score[j] > score[i] || (score[j] == score[i] && j < i))
            r++;
    return r;
}

/*
 * Independent reference of the AdaKV budget (§1.5) for H heads of L tokens:
 * safe[g][i] = 1 for the n_safe best of head g; then the K best entries by
 * (safeguarded first, higher score, lower head, lower index) are marked in
 * win[g][i] and counted in B[g].
 */
static inline void sk_ref_ada(double *const *a, uint32_t H, uint32_t L, size_t n_safe, size_t K,
                              uint8_t *const *safe, uint8_t *const *win, uint32_t *B)
{
    for (uint32_t g = 0; g < H; g++)
        for (uint32_t i = 0; i < L; i++)
            safe[g][i] = sk_rank(a[g], L, i) < n_safe;
    for (uint32_t g = 0; g < H; g++) {
        B[g] = 0;
        for (uint32_t i = 0; i < L; i++) {
            size_t better = 0;
            for (uint32_t g2 = 0; g2 < H; g2++)
                for (uint32_t j = 0; j < L; j++) {
                    int beats;
                    if (safe[g2][j] != safe[g][i])
                        beats = safe[g2][j];
                    else if (a[g2][j] != a[g][i])
                        beats = a[g2][j] > a[g][i];
                    else
                        beats = g2 < g || (g2 == g && j < i);
                    better += beats;
                }
            win[g][i] = better < K;
            B[g] += win[g][i];
        }
    }
}

#endif
