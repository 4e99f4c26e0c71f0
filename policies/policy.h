/*
 * policy.h - the interface every eviction policy implements.
 *
 * A policy decides and never touches memory (DESIGN.md "Parts"). After each
 * step of a sequence (a prefill chunk or a decode token), for each layer, the
 * policy host (policies/host.h) shows the policy what the layer holds (a
 * view) and what the worker measured in that step (stats); the policy
 * answers with a decision: a new tier for each token (keep in full
 * precision, demote to INT8, move to the sketch, bring back from the sketch,
 * evict) and, for WeightedKV, value merges. The daemon then moves memory to
 * match; `kvstash replay` applies the same decisions to a logical sequence.
 * Policies include no daemon, kernel or JSON header.
 *
 * Lifecycle: policy_find() by name -> policy_params_resolve() validates the
 * client's key=value pairs and fills defaults -> ops->create() (which reads
 * them with policy_params_parse() and its spec) -> ops->step() once per
 * layer per step -> ops->destroy().
 */
#ifndef KVSTASH_POLICY_H
#define KVSTASH_POLICY_H

#include <stddef.h>
#include <stdint.h>

#define POLICY_MAX_PARAMS 32
#define POLICY_ERR_LEN 256

/* How policy_params_parse() reads a parameter into a policy's config. */
typedef enum policy_param_type {
    POLICY_PARAM_TEXT = 0, /* not parsed: the policy reads the text itself */
    POLICY_PARAM_UINT,     /* uint32_t, decimal digits only, in [min, max] */
    POLICY_PARAM_DOUBLE,   /* double, finite, in [min, max] */
    POLICY_PARAM_CHOICE,   /* unsigned: the index of the value in choices */
} policy_param_type;

/*
 * One parameter a policy accepts, declared as data (nginx's directives): its
 * default as text and, for policy_params_parse(), its type, bounds and the
 * offset of its field in the policy's config struct. A UINT may also accept
 * one word instead of a number (h2o's recent=half, reviver's slack=-1),
 * stored as word_value.
 */
typedef struct policy_param_spec {
    const char *key;
    const char *def;
    const char *help;
    policy_param_type type;
    double min, max;            /* UINT, DOUBLE (UINT bounds are whole numbers) */
    const char *const *choices; /* CHOICE: NULL-terminated */
    size_t offset;              /* offsetof(config struct, field) */
    const char *word;           /* UINT: the word accepted instead of a number, or NULL */
    uint32_t word_value;        /* what the word stores */
} policy_param_spec;

/* Spec initialisers: key, default, help, bounds, field (offsetof). */
#define POLICY_PARAM_U32(k, d, h, lo, hi, off)                                                     \
    {                                                                                              \
        .key = (k), .def = (d), .help = (h), .type = POLICY_PARAM_UINT, .min = (lo), .max = (hi),  \
        .offset = (off)                                                                            \
    }
/* An unsigned integer that also accepts one word standing for word_val. */
#define POLICY_PARAM_U32_OR(k, d, h, lo, hi, off, w, word_val)                                     \
    {                                                                                              \
        .key = (k), .def = (d), .help = (h), .type = POLICY_PARAM_UINT, .min = (lo), .max = (hi),  \
        .offset = (off), .word = (w), .word_value = (word_val)                                     \
    }
#define POLICY_PARAM_F64(k, d, h, lo, hi, off)                                                     \
    {                                                                                              \
        .key = (k), .def = (d), .help = (h), .type = POLICY_PARAM_DOUBLE, .min = (lo),             \
        .max = (hi), .offset = (off)                                                               \
    }
#define POLICY_PARAM_ONE_OF(k, d, h, names, off)                                                   \
    {                                                                                              \
        .key = (k), .def = (d), .help = (h), .type = POLICY_PARAM_CHOICE, .choices = (names),      \
        .offset = (off)                                                                            \
    }

/* A resolved parameter set: every key of the policy, in spec order, with the
 * client's value or the default. */
typedef struct policy_params {
    size_t count;
    const char *key[POLICY_MAX_PARAMS];
    char value[POLICY_MAX_PARAMS][64];
} policy_params;

/* The model geometry a sequence's policy works for. */
typedef struct policy_geometry {
    uint32_t layers, q_heads, kv_heads, head_dim, block_tokens;
    float rope_theta;
} policy_geometry;

/* Where a token lives. A token in the sketch is still part of the sequence
 * (KVReviver reconstructs it for attention); an evicted token is gone. */
typedef enum policy_tier {
    POLICY_FULL = 0,   /* raw K/V in the pool's dtype */
    POLICY_INT8 = 1,   /* symmetric INT8 (POLICIES.md §5.4) */
    POLICY_SKETCH = 2, /* in the layer's count-sketch (POLICIES.md §3) */
    POLICY_EVICT = 3,  /* decision only: drop the token */
    POLICY_INT4 = 4,   /* 4-bit groups, KIVI-style (kernels.h "Low-bit tiers") */
    POLICY_INT2 = 5,   /* 2-bit groups, the same layout */
} policy_tier;

/* Per-tier counts are arrays of POLICY_TIERS indexed by policy_tier (the
 * POLICY_EVICT entry stays 0). The stored tiers' values are those of the
 * wire's LayerTable.tier and of the kernels' kv_tier. */
#define POLICY_TIERS 6

/* Whether tokens of tier t are quantised in blocks of their own. */
static inline int policy_tier_quantised(unsigned t)
{
    return t == POLICY_INT8 || t == POLICY_INT4 || t == POLICY_INT2;
}

/* The tiers a token can be stored in, in the order reports list them. */
#define POLICY_STORED_TIERS 5
static const uint8_t policy_stored_tiers[POLICY_STORED_TIERS] = {
    POLICY_FULL, POLICY_INT8, POLICY_INT4, POLICY_INT2, POLICY_SKETCH};

/* The name Stats, metrics, the CLI and operator moves use for tier t:
 * "full", "int8", "int4", "int2", "sketch" ("evict" for POLICY_EVICT). */
static inline const char *policy_tier_name(unsigned t)
{
    static const char *const names[POLICY_TIERS] = {"full",  "int8", "sketch",
                                                    "evict", "int4", "int2"};
    return t < POLICY_TIERS ? names[t] : "?";
}

/*
 * One layer of a sequence after the step's new tokens were appended.
 * A policy with ops->per_head set sees one token list per KV head (heads ==
 * kv_heads; the lists may differ); any other policy sees one list for all
 * heads (heads == 1). Tokens are in ascending original position.
 */
typedef struct policy_layer_view {
    uint32_t layer;
    uint32_t heads;
    const uint32_t *tokens;           /* [heads] tokens in each list */
    const uint32_t *const *positions; /* [heads][tokens[h]] original positions */
    const uint8_t *const *tier;       /* [heads][tokens[h]] current policy_tier */
    uint64_t appended;                /* tokens ever appended (= next position) */
    uint64_t step;                    /* steps so far, this one included (1-based) */
} policy_layer_view;

/*
 * What the worker measured in this step for this layer. Each array is NULL
 * when the worker did not report it (ops->needs says what a policy requires).
 * "list" below means the view's token list the array belongs to: the only
 * list when heads == 1, else the list of the KV head (query head h belongs to
 * KV head h / (q_heads / kv_heads), POLICIES.md "Common notation").
 */
typedef struct policy_stats {
    uint32_t new_tokens; /* tokens this step appended: the last new_tokens of each list */
    int prefill;         /* 1 while the prompt is being processed, 0 in decode */
    /* [tokens]: Σ over query heads and over the step's last score_queries
     * queries of softmax attention (OpenVINO §2.2, H2O, KVReviver §3.4).
     * Only when heads == 1. */
    const float *score;
    uint32_t score_queries;
    /* [q_heads] -> [list]: attention of the step's last query, per query head
     * (TOVA, Conf-KV §5.2, WeightedKV §4.1). */
    const float *const *last_attn;
    /* [q_heads] -> [list]: per query head, the mean over the observation
     * window's queries, before pooling (SnapKV §1.3). window_queries = w. */
    const float *const *window_attn;
    uint32_t window_queries;
    /* [kv_heads] -> [list]: projected value norm ‖V·W^O‖₁ (CriticalKV §1.2);
     * the daemon computes it from the stored values and the registered W^O. */
    const float *const *vnorm;
    /* Next-token confidence c_t in [0, 1] (Conf-KV §5.2); negative if none. */
    double confidence;
    /* Every float of the arrays above is known finite (the daemon checked
     * the worker's statistics as it took them): a policy need not check
     * them again. 0: it must (replay, tests, benchmarks). */
    int finite;
    /* score is memory the worker may write while the step runs (only for
     * a policy_ops.stats_in_place policy; finite is then 0): a value
     * checked in one read may differ in the next. The caller undoes a
     * step that fails (a transaction), so the policy may find a bad value
     * as it takes them rather than in a pass before it changes anything. */
    int in_place;
} policy_stats;

/* WeightedKV: v[into] = (w_from*v[from] + w_into*v[into]) / (w_from + w_into),
 * then `from` is evicted (its tier must be POLICY_EVICT). Indices are into
 * the view's list of `head` (0 when heads == 1). Applied in order. */
typedef struct policy_merge {
    uint32_t head, from, into;
    float w_from, w_into;
} policy_merge;

/* Entries [lo, hi) of a list (lo == hi: none). */
typedef struct policy_span {
    uint32_t lo, hi;
} policy_span;

/*
 * The policy's answer for one layer. tier[h][i] comes preset to the view's
 * current tier; the policy changes the entries it wants changed. For a
 * policy whose ops.merges is set, merges has room for `merges_cap` entries
 * (at least the total tokens of the view); for the others it is NULL and
 * merges_cap 0.
 * rerotate_keys asks the daemon to re-rotate the keys of tokens whose index
 * in the list shrank by the eviction (OpenVINO §2.8, kvpress
 * KeyRerotationPress): a token moved from index i to j gets RoPE at j - i
 * positions from where it was, with base rope_theta and the model's pairing
 * (rope_pairing: 0 = rotate-half (j, j + d/2), 1 = interleaved (2j, 2j + 1)).
 */
typedef struct policy_decision {
    uint8_t *const *tier;
    /*
     * [heads] (NULL: every span is the whole list): where list h's tiers
     * may differ from their preset. The host presets each span to the
     * whole list; a policy whose step changes a few tiers (a decode step
     * evicts one token of thousands) narrows it to them with
     * policy_decision_span() (util.h), and the host and the daemon then
     * look only there instead of at every token's tier, four or five
     * times a step. A policy narrows a span only to evict: the host keeps
     * it narrow only for a list whose every tier is POLICY_FULL and a
     * decision without merges or storage demotion, so that outside a
     * span every tier is, and stays, POLICY_FULL.
     */
    policy_span *span;
    policy_merge *merges;
    size_t nmerges, merges_cap;
    int rerotate_keys;
    double rope_theta;
    int rope_pairing;
} policy_decision;

/* The count-sketch of one layer (POLICIES.md §3.2-3.3) that the daemon keeps
 * for tokens in POLICY_SKETCH: rows x buckets, hashed with layer_seed, each
 * row's estimate the cell (sum) or the cell over its count (mean, §3.8). */
typedef struct policy_sketch_geometry {
    uint32_t rows, buckets;
    uint64_t layer_seed;
    int key_mean, value_mean;
} policy_sketch_geometry;

/* What a policy needs the worker to report (ops->needs). */
enum {
    POLICY_NEEDS_SCORE = 1u << 0,
    POLICY_NEEDS_LAST_ATTN = 1u << 1,
    POLICY_NEEDS_WINDOW_ATTN = 1u << 2,
    POLICY_NEEDS_VNORM = 1u << 3,
    POLICY_NEEDS_CONFIDENCE = 1u << 4,
};

struct policy_replay; /* policy_replay.h */

typedef struct policy_ops {
    const char *name;
    const char *summary; /* one line for `kvstash policy list` */
    const policy_param_spec *params;
    size_t nparams;
    unsigned needs; /* POLICY_NEEDS_* */
    /* Arrays that may stand in for all of `needs` (0: none): a step that
     * has every one of them needs none of needs'. TOVA ranks by the last
     * query's attention averaged over the query heads, which a worker may
     * send already summed (score with score_queries 1): q_heads times less
     * to send than last_attn, the same order. */
    unsigned needs_alt;
    int per_head; /* decides per KV head (views have heads == kv_heads) */
    int merges;   /* its decisions may merge tokens (policy_decision.merges) */
    /* Its step of one layer reads and writes only that layer's part of the
     * state (and the layer's view, stats and decision), or shared parts it
     * guards itself (ov_block's once-a-step count): the host may step
     * several layers at once, on threads (host.h policy_host_step_layers). */
    int layers_concurrent;
    /* Optional, with layers_concurrent: whether this state's layers may step
     * at once now (ov_block: not while KVCrush draws random anchors from the
     * sequence's generator, whose draws follow the layers' order). Asked
     * before the layers step; NULL: always. */
    int (*layers_concurrent_now)(const void *state);
    /* Its step may be handed stats.score in memory that the worker can
     * still write while the step runs (kvstashd's ring), instead of a copy
     * (issue 16 §2: the copy was an eighth of a decode step at 32k tokens).
     * It reads each value once, into memory of its own, and checks what it
     * took before anything depends on it (policy_copy_first_outside, a part
     * at a time while it is in L1), whatever stats.finite says; a value that
     * is not finite fails the step through policy_stats_refused, so that the
     * caller can tell the worker's statistics from the policy failing. Only
     * a step whose one array is score is handed so (kvstashd copies the
     * others). */
    int stats_in_place;

    /* Build the per-sequence state from resolved parameters. Returns 0, or -1
     * with a message in err naming the offending parameter. *state (may be
     * NULL for stateless policies) is released with destroy(). */
    int (*create)(const policy_params *p, const policy_geometry *g, void **state, char *err,
                  size_t errlen);

    /* One step of one layer: observe the stats, fill the decision, and update
     * the policy's own per-token state to match the decision (the host
     * applies it exactly). Returns 0, or -1 with err when the stats are
     * unusable (a required array missing, wrong sizes). */
    int (*step)(void *state, const policy_layer_view *view, const policy_stats *stats,
                policy_decision *decision, char *err, size_t errlen);

    /* Optional: the policy's state of one layer as one JSON object (malloc'd
     * text; the caller frees), for `kvstash replay` and Inspect. */
    char *(*describe)(void *state, uint32_t layer);

    void (*destroy)(void *state);

    /* Optional, for policies that send tokens to POLICY_SKETCH and model the
     * sketch themselves (reviver): the layer's sketch geometry. Returns 0, or
     * -1 for a layer out of range. Without it the storage options decide
     * (policies/storage.h). */
    int (*sketch_geometry)(const void *state, uint32_t layer, policy_sketch_geometry *out);

    /* Optional: the order in which the layer's last step's tier changes
     * must be applied, as indices into that step's view (only tokens whose
     * tier changed; SKETCH <-> FULL changes do not commute when buckets are
     * shared). *n receives the count. Without it, changes apply in list
     * order: revivals from the sketch first, then insertions. */
    const uint32_t *(*tier_order)(const void *state, uint32_t layer, size_t *n);

    /* Optional: `kvstash replay` operations in the policy's own terms
     * (policies/policy_replay.h; docs/replay.md), named in replay_ops
     * (NULL-terminated). A line with one of these fields runs replay(r, op)
     * instead of the generic operations; "state" among them replaces the
     * generic describe() answer. Returns 0, or -1 after r->fail(). */
    const char *const *replay_ops;
    int (*replay)(const struct policy_replay *r, const char *op);

    /* Optional, for policies whose step changes per-layer state (host.h
     * transactions): layer's state as it is now, in *saved (NULL allowed
     * when there is nothing to keep): a copy, or the state's own arrays
     * when its steps leave those as they were (weightedkv writes each
     * step's sums into a second buffer: save() marks the first kept,
     * discard() gives it back), or a note of how they are held when its
     * steps change only that (h2o folds the last step's attention into its
     * sums in place); the state is alive until every copy is discarded or
     * restored. State that is not per layer (an RNG, a counter) goes into
     * every layer's copy, and restore() of several copies in any order
     * puts back that of the oldest. Returns 0, or -1 when out of memory
     * (errno ENOMEM), changing nothing. */
    int (*save)(void *state, uint32_t layer, void **saved);
    /* Put layer's state back as it was at save(), consuming saved. Cannot
     * fail (no allocation: the copy's arrays are swapped in). */
    void (*restore)(void *state, uint32_t layer, void *saved);
    /* Free a copy that was not needed (the transaction kept its changes). */
    void (*discard)(void *saved);

    /* Optional, for policies with per-layer state (save != NULL), to move a
     * sequence to another daemon (issue 17, docs/remote.md "Export and
     * import"): layer's state as bytes in the policy's own little-endian
     * format, and back. export_layer returns the bytes (malloc'd, the
     * caller frees; *len their count), or NULL when out of memory. State
     * that is not per layer (an RNG, a counter) goes into every layer's
     * bytes, as with save. import_layer sets layer's state, in a state just
     * made by create() with the same parameters and geometry, to what the
     * bytes say, after checking every count and value in them against the
     * geometry and against themselves (the bytes come over the network):
     * 0, or -1 with err naming what is wrong, the state unchanged. A policy
     * reads back exactly what it wrote: a sequence exported, imported and
     * stepped on decides as the original would have. Without the pair, a
     * policy with save cannot move (FAILED_PRECONDITION). */
    void *(*export_layer)(const void *state, uint32_t layer, size_t *len);
    int (*import_layer)(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                        size_t errlen);
} policy_ops;

/* The registry: look a policy up by name (NULL if unknown). */
const policy_ops *policy_find(const char *name);

/* All registered policies, in a stable order; *count receives their number. */
const policy_ops *const *policy_list(size_t *count);

/*
 * Validate client parameters against ops->params and fill in defaults.
 * Returns 0, or -1 with err set to a message naming the parameter (unknown
 * key, duplicate key, value too long).
 */
int policy_params_resolve(const policy_ops *ops, const char *const *keys, const char *const *values,
                          size_t n, policy_params *out, char *err, size_t errlen);

/* The value of `key` in a resolved set (NULL if the policy has no such key). */
const char *policy_params_get(const policy_params *p, const char *key);

/*
 * Parse every typed entry of spec[0..n) (TEXT entries are skipped) from the
 * resolved set p into the config struct at `config`, each at its offset, in
 * spec order. Returns 0, or -1 with err naming the first bad parameter and
 * its range (the messages of the setters below); fields already parsed are
 * then written, the rest untouched. The one parser of policy parameters.
 */
int policy_params_parse(const policy_params *p, const policy_param_spec *spec, size_t n,
                        void *config, char *err, size_t errlen);

/* The setters policy_params_parse() uses, one per type. */

/* Parse `key` as an unsigned integer in [min, max]. Returns 0, or -1 with err
 * set to e.g. "parameter n_sink must be an integer in [0, 65536], got 'x'". */
int policy_params_uint(const policy_params *p, const char *key, uint32_t min, uint32_t max,
                       uint32_t *out, char *err, size_t errlen);

/* Parse `key` as a finite real number in [min, max]; same error style. */
int policy_params_double(const policy_params *p, const char *key, double min, double max,
                         double *out, char *err, size_t errlen);

/* Parse `key` as one of `choices` (NULL-terminated); *out = its index. */
int policy_params_choice(const policy_params *p, const char *key, const char *const *choices,
                         unsigned *out, char *err, size_t errlen);

#endif
