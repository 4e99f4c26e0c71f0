/*
 * reviver.h - the pure pieces of KVReviver (POLICIES.md §3; policy "reviver"
 * in reviver.c): the per-layer compress step over the Recent / Candidate /
 * Vague stores, and what the daemon asks a live state.
 *
 * The policy only decides. It keeps, per layer, where every token lives
 * (Recent, Candidate or Vague) and answers with tiers:
 *   Recent, Candidate -> POLICY_FULL   (raw K/V)
 *   Vague             -> POLICY_SKETCH (K/V only in the layer's sketch)
 * A token that leaves Candidate for the sketch goes FULL -> SKETCH: the
 * daemon inserts its K/V into the layer's count-sketch and frees the raw
 * copy. A token swapped back goes SKETCH -> FULL: the daemon queries its
 * estimate, deletes that estimate from the sketch and stores the estimate as
 * the token's raw K/V ("revived lossy", §3.5). The sketch's arithmetic and
 * its hash family are the kernels' (kv_sketch_*_ref in kernels/kernels.h,
 * kernels/sketch_hash.h); the policy only names the geometry and the seed
 * (ops->sketch_geometry). Sketched tokens stay in the view's list: they are
 * still part of the sequence and are rebuilt for attention (Alg. 4). The
 * policy never evicts.
 *
 * Order matters when buckets are shared: a query sees every earlier insert
 * and delete. reviver_layer_ops() gives the step's operations in the order
 * of §3.5 (the pops, then per swap: revive, then sketch); a daemon that
 * applies them in that order (ops->tier_order) reproduces the paper exactly.
 *
 * The policy's per-layer state (stores, scores, the last step's operations)
 * moves with its sequence (ops->export_layer / import_layer; the byte
 * format and what import refuses are described in reviver.c).
 *
 * Nothing here allocates; nothing keeps global state.
 */
#ifndef KVSTASH_POLICIES_REVIVER_H
#define KVSTASH_POLICIES_REVIVER_H

#include <stddef.h>
#include <stdint.h>

/* Sketch rows r at most (§3.1): kernels.h's KV_SKETCH_MAX_ROWS. */
#define REVIVER_MAX_ROWS 32u

/* ---- §3.5 compress ---- */

/* Where a token of a layer lives. */
typedef enum reviver_loc {
    REVIVER_RECENT = 0,
    REVIVER_CANDIDATE = 1,
    REVIVER_VAGUE = 2,
} reviver_loc;

/* One sketch operation of a step, in the order the daemon applies them. */
typedef enum reviver_op_kind {
    REVIVER_OP_SKETCH = 0, /* FULL -> SKETCH: insert the raw K/V, free it */
    REVIVER_OP_REVIVE = 1, /* SKETCH -> FULL: query, delete the estimate, keep it raw */
} reviver_op_kind;

typedef struct reviver_op {
    uint32_t index; /* into the layer's token list (= position: reviver never evicts) */
    uint32_t kind;  /* reviver_op_kind */
} reviver_op;

/* The per-layer budgets of §3.5. */
typedef struct reviver_budgets {
    uint32_t recent;     /* R_b */
    uint32_t slack;      /* spill when |R| > R_b + slack */
    uint32_t candidate;  /* C_b */
    double replace_rate; /* >= 1 (reviver.c rejects less) */
} reviver_budgets;

/*
 * compress(T) of §3.5 over one layer of n tokens in age (= position) order,
 * the last new_tokens of which are the step's new tokens T. loc[0..n-new)
 * hold the stores after the previous step; loc of the new tokens is written
 * here. score[] are the accumulated scores, already including this step
 * (§3.4), all finite and >= 0.
 *   1. push T to R;
 *   2. if |R| > R_b + slack: move the |R| - R_b oldest of R to C;
 *   3. while |C| > C_b: pop C's minimum (ties: smaller index) into V;
 *   4. guard = |C| + |V|; while |C| > 0, |V| > 0, guard-- > 0 and
 *      min_C·replace_rate < max_V: revive V's maximum (ties: smaller index)
 *      into C, then pop C's minimum into V.
 * Every move into V appends REVIVER_OP_SKETCH to ops, every move out of V
 * REVIVER_OP_REVIVE, in the order above. With replace_rate >= 1 and scores
 * >= 0 a token moves at most once per call, so ops never needs more than n
 * entries. scratch needs 2n entries. Returns 0, or -1 when ops_cap would be
 * exceeded (ops then holds the first ops_cap operations).
 */
int reviver_compress(const reviver_budgets *b, uint32_t n, uint32_t new_tokens, const double *score,
                     uint8_t *loc, uint32_t *scratch, reviver_op *ops, size_t ops_cap,
                     size_t *nops);

/* ---- what the tests read from a live "reviver" state ---- */

/* The operations of the layer's last successful step, in application order
 * (valid until the layer's next step). *n receives their number; NULL with
 * *n = 0 when there were none or layer is out of range. */
const reviver_op *reviver_layer_ops(const void *state, uint32_t layer, size_t *n);

#endif
