/*
 * snapkv_family.h - the pure pieces of SnapKV, AdaKV, CriticalKV and
 * CriticalAdaKV (POLICIES.md §1), and the step driver the four policies
 * "snapkv", "adakv", "criticalkv" and "criticalkv_ada" share.
 *
 * The policies call exactly these functions, and
 * tests/unit/test_policy_{snapkv,adakv,criticalkv,criticalkv_ada}.c check
 * them with the §1.8 vectors. The pure functions allocate nothing and keep
 * no state; snapkv_family_create() owns the only state (the configuration
 * and, per layer, a record of the last compression for describe()).
 *
 * Selection order (POLICIES.md "Common notation"; §1.7 and §6 #3): an entry
 * is a (forced, score) pair. "Top-k" keeps forced entries first, then higher
 * scores, ties to the lower index (lower head first for flattened
 * selections); "bottom-k" evicts unforced entries first, then lower scores,
 * ties to the lower index. The reference forces entries by writing the
 * dtype's maximum into the score, which overflows to inf after the value
 * norm product and loses to nothing but a zero norm; the forced bit has the
 * same ordering without the overflow, and a forced entry stays forced even
 * when its value norm is 0.
 */
#ifndef KVSTASH_POLICIES_SNAPKV_FAMILY_H
#define KVSTASH_POLICIES_SNAPKV_FAMILY_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"
#include "select.h"

/* ---- pure algorithm pieces ---- */

/* The projected value norm of POLICIES.md §1.2 (CriticalKV's n) is K/V math:
 * kv_vnorm_l1 (kernels/kernels.h) computes it where the values live, and the
 * policies receive it as policy_stats.vnorm. */

typedef enum snapkv_pooling {
    SNAPKV_POOL_AVG = 0, /* kvpress: avg_pool1d, zero padding k/2, divisor always k */
    SNAPKV_POOL_MAX = 1, /* AdaKV paper code: max_pool1d, padded positions never win */
} snapkv_pooling;

/*
 * 1-D pooling over n scores with an odd kernel k, stride 1 and k/2 padding
 * on each side (§1.3), so out has n entries too. out must not alias in.
 * Example (T-SNAP1): avg, k=5: [.1 .2 .3 .4 .5] -> [.12 .20 .30 .28 .24].
 */
void snapkv_pool(const double *in, size_t n, uint32_t kernel, snapkv_pooling mode, double *out);

typedef enum snapkv_window_pad {
    SNAPKV_PAD_MAX_PLUS_ONE = 0, /* kvpress: window tokens score max + 1 */
    SNAPKV_PAD_MAX = 1,          /* DefensiveKV fork: window tokens score max */
} snapkv_window_pad;

/*
 * SnapKV base scores of one layer (§1.3) over per-KV-head token lists.
 * List g holds len[g] tokens, of which the first prefix[g] lie before the
 * observation window and the rest are window tokens. window_attn[h] (query
 * head h reads list h / G, G = q_heads / kv_heads) holds the mean attention
 * of the window queries on each token of its list; only the first prefix[g]
 * entries are read. Each query head's prefix row is pooled, the G pooled rows
 * of a group are averaged, and every window token gets the largest prefix
 * score over all heads, plus 1 for SNAPKV_PAD_MAX_PLUS_ONE. scratch holds
 * 2·max(prefix) doubles. At least one prefix[g] must be > 0. Returns 1 when
 * every window_attn entry read was a finite number, else 0 (the scores are
 * then meaningless).
 */
int snapkv_base_scores(const float *const *window_attn, uint32_t q_heads, uint32_t kv_heads,
                       const uint32_t *len, const uint32_t *prefix, uint32_t kernel,
                       snapkv_pooling pool, snapkv_window_pad pad, double *const *score,
                       double *scratch);

/* Budgets in IEEE double, truncated toward zero like Python int()
 * (POLICIES.md "Common notation"): int(L·(1 − cr)), the ScorerPress rule. */
size_t snapkv_n_keep(size_t L, double compression_ratio);

/* CriticalKV stage-1 size int((1 − cr)·L·α) (§1.4), from the product and not
 * from n_keep. */
size_t criticalkv_stage1_size(size_t L, double compression_ratio, double alpha);

/* CriticalAdaKV stage-1 size of a head with budget B: int(float32(B)·
 * float32(α)), the reference's float32 product (§1.5; defined in
 * criticalkv_ada.c). */
size_t criticalkv_ada_stage1_size(size_t head_budget, double alpha);

/* Scratch room for one entry of a selection: its key (select.h). */
typedef uint64_t snapkv_entry;

/*
 * Top-k of one list: mark the k best (forced first, then higher score, ties
 * to the lower index) with mark[i] = 1; others are left as they are. k is
 * clamped to n. tmp holds n entries.
 */
void snapkv_mark_top(const double *score, const uint8_t *forced, size_t n, size_t k, uint8_t *mark,
                     snapkv_entry *tmp);

/*
 * CriticalKV selection for one head (§1.4; also the per-head part of §1.5):
 *   stage 1: force the b1 best of (forced, a);
 *   stage 2: z = (a + eps)·vnorm; keep the n_keep best of (forced, z).
 * forced[] is in/out (entries forced on entry stay forced, stage-1 winners
 * are added); z[] (n doubles) receives the stage-2 scores; keep[i] is set to
 * 1 for kept tokens and 0 for the others. tmp holds n entries. A forced
 * entry is kept even when its value norm is 0 (§1.7).
 * T-CK2: a = [.40 .05 .30 .25], n = [1.75 5 1.375 2.75], n_keep 2, b1 1 ->
 * keep {0, 3}.
 */
void criticalkv_select(const double *a, const float *vnorm, size_t n, size_t n_keep, size_t b1,
                       double eps, uint8_t *forced, double *z, uint8_t *keep, snapkv_entry *tmp);

/*
 * AdaKV budgets (§1.5 "safeguard" and "budget"): in every head force the
 * min(n_safe, len[g]) best of (forced, a); then take the `total` best entries
 * of all heads flattened (ties to the lower head, then the lower index) and
 * let B[g] be how many of them head g won. forced[g][] is in/out. total is
 * clamped to Σ len. tmp holds Σ len entries. Returns Σ B (= the clamped total).
 */
size_t adakv_budgets(const double *const *a, const uint32_t *len, uint32_t heads, size_t n_safe,
                     size_t total, uint8_t *const *forced, uint32_t *B, snapkv_entry *tmp);

/*
 * AdaKV selection (§1.9 "AdaKV"): after adakv_budgets' safeguard, evict the
 * Σ len − total worst entries over all heads flattened (bottom-k as the
 * reference's topk(−scores): unforced first, lower score, ties to the lower
 * head, then the lower index). keep[g][i] is set to 1 or 0. tmp holds Σ len
 * entries.
 */
void adakv_select(const double *const *a, const uint32_t *len, uint32_t heads, size_t total,
                  const uint8_t *const *forced, uint8_t *const *keep, snapkv_entry *tmp);

/* ---- the shared policy driver ---- */

typedef enum snapkv_variant {
    SNAPKV_PLAIN = 0,        /* "snapkv": §1.3 scores, top n_keep per head */
    SNAPKV_ADA = 1,          /* "adakv": §1.9, safeguard + global budget */
    SNAPKV_CRITICAL = 2,     /* "criticalkv": §1.4 */
    SNAPKV_CRITICAL_ADA = 3, /* "criticalkv_ada": §1.5 */
} snapkv_variant;

typedef struct snapkv_config {
    snapkv_variant variant;
    double compression_ratio;
    uint32_t window, kernel;
    unsigned pooling;                  /* snapkv_pooling */
    unsigned window_pad;               /* snapkv_window_pad */
    double first_stage_ratio, epsilon; /* criticalkv variants */
    double alpha_safeguard;            /* ada variants */
    uint32_t protect_window;
    uint32_t budget; /* 0 = off; else the decode-time extension (see below) */
} snapkv_config;

/* Parameter specs shared by the four policies (POLICIES.md §1.6, §6 #1-3),
 * each parsed into its snapkv_config field by policy_params_parse. */
extern const char *const snapkv_pooling_names[];    /* "avg", "max" */
extern const char *const snapkv_window_pad_names[]; /* "max_plus_one", "max" */

/* clang-format off */
#define SNAPKV_PARAM_COMPRESSION_RATIO POLICY_PARAM_F64("compression_ratio", "0.5", \
    "fraction of a layer's tokens evicted at the end of the prompt, [0, 1): n_keep = " \
    "int(L*(1-compression_ratio)); 0 = never compress (unused when budget > 0)", \
    0, 1, offsetof(snapkv_config, compression_ratio))
#define SNAPKV_PARAM_WINDOW POLICY_PARAM_U32("window", "64", \
    "observation window w: the last w prompt tokens are the queries whose attention scores " \
    "the others, 1..1048576 (kvpress 64, DefensiveKV 32, AdaKV paper 32)", \
    1, 1048576, offsetof(snapkv_config, window))
#define SNAPKV_PARAM_KERNEL POLICY_PARAM_U32("kernel", "5", \
    "pooling kernel size, odd, 1..1025 (kvpress 5, AdaKV paper 7)", \
    1, 1025, offsetof(snapkv_config, kernel))
#define SNAPKV_PARAM_POOLING POLICY_PARAM_ONE_OF("pooling", "avg", \
    "avg (kvpress: zero padding counted) or max (AdaKV paper: padding never wins)", \
    snapkv_pooling_names, offsetof(snapkv_config, pooling))
#define SNAPKV_PARAM_WINDOW_PAD POLICY_PARAM_ONE_OF("window_pad", "max_plus_one", \
    "score of window tokens: max_plus_one (kvpress) or max (DefensiveKV fork)", \
    snapkv_window_pad_names, offsetof(snapkv_config, window_pad))
#define SNAPKV_PARAM_FIRST_STAGE_RATIO POLICY_PARAM_F64("first_stage_ratio", "0.5", \
    "CriticalKV alpha: share of the budget chosen by attention alone in stage 1, [0, 1]", \
    0, 1, offsetof(snapkv_config, first_stage_ratio))
#define SNAPKV_PARAM_EPSILON POLICY_PARAM_F64("epsilon", "1e-4", \
    "added to the attention score in the stage-2 score (a+eps)*n, [0, 1]", \
    0, 1, offsetof(snapkv_config, epsilon))
#define SNAPKV_PARAM_ALPHA_SAFEGUARD POLICY_PARAM_F64("alpha_safeguard", "0.2", \
    "AdaKV safeguard: every head keeps at least int(n_keep*alpha_safeguard) of its best " \
    "tokens, [0, 1]", \
    0, 1, offsetof(snapkv_config, alpha_safeguard))
#define SNAPKV_PARAM_PROTECT_WINDOW POLICY_PARAM_U32("protect_window", "0", \
    "1 = never evict an observation-window token (the reference can, POLICIES.md §1.7); " \
    "0 = reference behaviour", \
    0, 1, offsetof(snapkv_config, protect_window))
#define SNAPKV_PARAM_BUDGET POLICY_PARAM_U32("budget", "0", \
    "extension, not in the papers: > 0 keeps min(budget, L) tokens per head instead of the " \
    "ratio rule, compressing again on every step that holds more; must exceed window; 0 = off", \
    0, UINT32_MAX / 2, offsetof(snapkv_config, budget))
/* clang-format on */

/* The state of one sequence: the configuration and a per-layer record. */
typedef struct snapkv_state snapkv_state;

/* Create from resolved parameters (ops->create of the policy `ops`, whose
 * spec parses them). */
int snapkv_family_create(const policy_params *p, const policy_geometry *g, snapkv_variant variant,
                         const policy_ops *ops, void **state, char *err, size_t errlen);

/*
 * ops->step. When a layer is compressed (POLICIES.md §1, kvpress "compress
 * once"):
 *   budget == 0: on a prefill step that carries window_attn (the worker
 *     reports it on the step that ends the prompt), if compression_ratio > 0.
 *   budget > 0: on any step that carries window_attn and holds more than
 *     budget tokens per head (ada variants: more than budget·kv_heads in all
 *     heads together). A decode step over budget without window_attn is an
 *     error; a prefill step without it waits for the end of the prompt.
 * A layer whose longest list has L <= window tokens is not compressed
 * (SnapKV rejects it, §1.7); describe() says so. Window tokens are the held
 * tokens whose position is >= appended − window.
 */
int snapkv_family_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                       policy_decision *d, char *err, size_t errlen);

/* ops->describe: one layer's record as a JSON object (malloc'd). */
char *snapkv_family_describe(void *state, uint32_t layer);

void snapkv_family_destroy(void *state);

/* ops->save, ops->restore and ops->discard (policy.h): the layer's record,
 * the only state step() changes. */
int snapkv_family_save(void *state, uint32_t layer, void **saved);
void snapkv_family_restore(void *state, uint32_t layer, void *saved);
void snapkv_family_discard(void *saved);

/*
 * ops->export_layer and ops->import_layer (policy.h): the layer's record,
 * as save() copies it, in bytes. The configuration and geometry are not in
 * them (the importing side creates the state from the same parameters);
 * nothing is outside the per-layer record. Little-endian, version 1:
 *
 *   offset  size  field
 *        0     4  magic "SKVF"
 *        4     1  version (1)
 *        5     1  variant (snapkv_variant of the policy that wrote them)
 *        6     1  E = length of the event text (< 192, no NUL byte)
 *        7     4  kv_heads
 *       11     4  layer
 *       15     8  compressions
 *       23     8  last_step
 *       31     E  event text
 *   then kv_heads x 16 bytes: held, prefix, kept, forced (u32 each;
 *       prefix, kept, forced <= held; all 0 before any compression)
 *   then per head, kept entries of each array in turn: positions (u32,
 *       strictly ascending), scores (f32 bits, finite), stage-2 scores (f32
 *       bits; not NaN for the criticalkv variants, 0 for the others),
 *       is_forced (u8, 0 or 1; at most `forced` of them 1).
 *
 * The length is exactly 31 + E + 16·kv_heads + 13·Σ kept. export returns
 * the bytes (malloc'd; the caller frees) or NULL when out of memory.
 * import refuses (-1, err names the field) bytes that break any rule above,
 * or were written by another variant, for another layer or kv_heads; the
 * state is then unchanged (the new record is built aside, then swapped in).
 */
#define SNAPKV_WIRE_VERSION 1
void *snapkv_family_export_layer(const void *state, uint32_t layer, size_t *len);
int snapkv_family_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                               size_t errlen);

#endif
