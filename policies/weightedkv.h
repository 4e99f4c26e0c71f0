/*
 * weightedkv.h - the pure pieces of WeightedKV (POLICIES.md §4; policy
 * "weightedkv" in weightedkv.c): average-attention weights and the choice of
 * the tokens whose keys go and whose values merge into their right
 * neighbour. The merge itself is K/V math: the policy returns it as
 * policy_merge records, and kv_merge_values (kernels/kernels.h) applies them.
 *
 * The policy calls exactly these functions; tests/unit/test_policy_
 * weightedkv.c checks them with the §4.3 vectors. None allocates.
 */
#ifndef KVSTASH_POLICIES_WEIGHTEDKV_H
#define KVSTASH_POLICIES_WEIGHTEDKV_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"

/* The merge-managed cache of one head (§4.1). */
typedef struct wkv_config {
    uint32_t cache_size; /* m: entries kept after each step */
    uint32_t n_init;     /* the first n_init entries are never merged away */
    uint32_t n_recent;   /* nor the last n_recent (>= 1: the newest has no right neighbour) */
} wkv_config;

/* Historical average attention w = a / c (§4.1); 0 when c == 0. */
double wkv_weight(double a, double c);

/*
 * The convex-merge weights of policy_merge for w[from], w[into] (§4.1):
 * the averages themselves, or 1 and 1 (the plain average) when they sum to
 * 0 (§4.2).
 */
void wkv_merge_weights(double w_from, double w_into, float *wf, float *wi);

/*
 * Plan one head's step (§4.1): while the list of n entries holds more than
 * m, take j = argmin w over the candidates [n_init, n − n_recent) of the
 * current list (ties: lowest index), merge its value into its current right
 * neighbour and drop it. The weights do not change while merging (the
 * neighbour keeps its own a and c), and the deletions happen left of the
 * fixed last n_recent entries, so this is the same as taking the n − m
 * candidates of lowest (w, index) in that order; the right neighbour of each
 * is the next entry not yet deleted when its turn comes (a chain: a victim
 * may first absorb an earlier victim).
 *
 * w holds the n weights in list order; scratch has room for 3n values.
 * out (room for n entries) receives the merges in the order Algorithm 1
 * applies them, with view indices (from, into), `head`, and
 * wkv_merge_weights() weights; every out[i].from is a token to evict. The
 * policy passes them through wkv_flatten() before emitting them. Returns the number of
 * merges: max(0, n − m), or fewer when the candidates run out (only with a
 * config the policy rejects: it requires m >= n_init + n_recent + 1).
 */
size_t wkv_plan(const double *w, size_t n, const wkv_config *cfg, uint32_t head, uint32_t *scratch,
                policy_merge *out);

/*
 * Rewrite a plan's k merges (Algorithm 1 order, over a list of n entries)
 * so that no merge goes into an entry that a later merge of the step takes
 * away, with the same final values. wkv_plan() yields such chains only when
 * a step merges more than once (prefill longer than m): there a victim may
 * first absorb earlier victims. Each kept entry x that a plan merge u -> x
 * (raw weights wf, wi) reaches becomes a run of merges t -> x, one per
 * original value t in u's row at that time (coefficient r_t, Σ r_t = 1):
 * w_from = wf·r_t, w_into = wi + wf·Σ(earlier r), so that applying them in
 * order leaves x = (wi·x + wf·Σ r_t·v_t) / (wi + wf) exactly as the plan
 * does. Contributors with r_t > 0 come first, so no merge has a zero
 * weight sum. A plan without chains (every decode step) comes out
 * unchanged. Every victim is `from` exactly once; order of the plan's kept
 * targets is kept. out has room for k entries (not the plan's buffer);
 * uscratch room for n + 2k + 1 values, dscratch for n.
 */
void wkv_flatten(const policy_merge *plan, size_t k, size_t n, policy_merge *out,
                 uint32_t *uscratch, double *dscratch);

/*
 * The accumulators of one head of one layer of a "weightedkv" policy state
 * (for tests and Inspect): *a and *c point at *n values in list order, valid
 * until the next step. Returns 0, or -1 when layer or head is out of range.
 */
int weightedkv_head_state(const void *state, uint32_t layer, uint32_t head, const double **a,
                          const double **c, uint32_t *n);

/*
 * A layer's state as ops->export_layer writes it and import_layer reads it
 * (moving a sequence to another daemon, policy.h), little-endian:
 *   0  u32  WKV_STATE_MAGIC ("wkvs")
 *   4  u8   WKV_STATE_VERSION
 *   5  u32  H: KV heads
 *   9  u32  n[H]: entries of each head
 *   then for each head k in order: f64 a[n[k]], then f64 c[n[k]], their
 *   IEEE bits, in list order.
 * import_layer refuses another magic or version, H other than the
 * geometry's kv_heads, an n above cache_size (no step leaves more), a
 * length other than 9 + 4H + 16·Σn, a non-finite a, and a c that is not
 * finite and >= 1.
 */
#define WKV_STATE_MAGIC 0x73766b77u /* "wkvs" */
#define WKV_STATE_VERSION 1u
#define WKV_STATE_HEAD 9u

#endif
