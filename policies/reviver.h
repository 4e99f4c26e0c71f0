/*
 * reviver.h - the pure pieces of KVReviver (POLICIES.md §3; policy "reviver"
 * in reviver.c): the hash and sign family, a reference count-sketch over
 * float vectors, and the per-layer compress step over the Recent /
 * Candidate / Vague stores.
 *
 * The policy only decides. It keeps, per layer, where every token lives
 * (Recent, Candidate or Vague) and answers with tiers:
 *   Recent, Candidate -> POLICY_FULL   (raw K/V)
 *   Vague             -> POLICY_SKETCH (K/V only in the layer's sketch)
 * A token that leaves Candidate for the sketch goes FULL -> SKETCH: the
 * daemon inserts its K/V (reviver_sketch_insert) and frees the raw copy. A
 * token swapped back goes SKETCH -> FULL: the daemon queries its estimate,
 * deletes that estimate from the sketch and stores the estimate as the
 * token's raw K/V ("revived lossy", §3.5). Sketched tokens stay in the
 * view's list: they are still part of the sequence and are rebuilt for
 * attention (Alg. 4). The policy never evicts.
 *
 * Order matters when buckets are shared: a query sees every earlier insert
 * and delete. reviver_layer_ops() gives the step's operations in the order
 * of §3.5 (the pops, then per swap: revive, then sketch); a daemon that
 * applies them in that order reproduces the paper exactly. The sketch
 * geometry and hash seeds of a layer come from reviver_layer_sketch().
 *
 * Nothing here allocates except reviver_sketch_init(); nothing keeps global
 * state. The kernels' sketch implementations are checked against the
 * reference functions below.
 */
#ifndef KVSTASH_POLICIES_REVIVER_H
#define KVSTASH_POLICIES_REVIVER_H

#include <stddef.h>
#include <stdint.h>

#define REVIVER_MAX_ROWS 32u

/* ---- §3.2 hashing and signs ([RECON] family) ---- */

/* The splitmix64 finaliser: x ^= x>>30; x *= 0xBF58476D1CE4E5B9;
 * x ^= x>>27; x *= 0x94D049BB133111EB; x ^= x>>31. */
uint64_t reviver_mix64(uint64_t x);

/* The layer_seed of §3.2 for layer `layer` of a sequence created with
 * parameter seed = `base`: the (layer+1)-th output of splitmix64 started
 * from state `base`, i.e. mix64(base + 0x9E3779B97F4A7C15·(layer+1)).
 * [RECON]: §3.2 leaves the per-layer seed open. */
uint64_t reviver_layer_seed(uint64_t base, uint32_t layer);

/* Buckets h[i] = mix64(J ^ S_i) mod buckets and signs g[i] = +1 when
 * mix64(J ^ T_i) >> 63 == 0 else -1, for rows i = 0..rows-1, with
 * S_i = 0x9E3779B97F4A7C15·(2i+1) ^ layer_seed and
 * T_i = S_i ^ 0xD1B54A32D192ED03 (§3.2). J is the token's absolute
 * position. buckets must be > 0; h and g have room for `rows` entries. */
void reviver_hash(uint64_t layer_seed, uint32_t rows, uint32_t buckets, uint64_t J, uint32_t *h,
                  int8_t *g);

/* ---- §3.3 reference sketch ---- */

/* How a row's cell becomes that row's estimate (§3.8). */
typedef enum reviver_estimate {
    REVIVER_ESTIMATE_SUM = 0,  /* the cell itself, as [S2] Alg. 2 */
    REVIVER_ESTIMATE_MEAN = 1, /* the cell divided by the bucket's token count */
} reviver_estimate;

/*
 * r rows x b buckets; each cell holds a key sum and a value sum of `dim`
 * floats (one token's per-layer K or V: kv_heads x head_dim) and a token
 * count. Layout: key[(row*buckets + bucket)*dim + c], same for value;
 * count[row*buckets + bucket]. All fields are public for tests and kernels.
 */
typedef struct reviver_sketch {
    uint32_t rows, buckets;
    size_t dim;
    reviver_estimate key_estimate, value_estimate;
    float *key;
    float *value;
    int32_t *count;
} reviver_sketch;

/* Zeroed sketch. rows in [1, REVIVER_MAX_ROWS], buckets >= 1, dim >= 1.
 * Returns 0, or -1 (bad sizes, out of memory; *s is then empty). Free with
 * reviver_sketch_free(). */
int reviver_sketch_init(reviver_sketch *s, uint32_t rows, uint32_t buckets, size_t dim,
                        reviver_estimate key_estimate, reviver_estimate value_estimate);

void reviver_sketch_free(reviver_sketch *s);

/* Alg. 1: for each row i, key cell h[i] += k (unsigned), value cell h[i] +=
 * g[i]·v, count h[i] += 1. h/g are the token's buckets and signs (from
 * reviver_hash(), or any table a test injects). */
void reviver_sketch_insert(reviver_sketch *s, const uint32_t *h, const int8_t *g, const float *k,
                           const float *v);

/* Alg. 2: per row the estimate kk[i] = key cell h[i], vv[i] = g[i]·value
 * cell h[i] (each divided by the cell's count in MEAN mode; a count <= 0,
 * which only a token never inserted can meet, divides by 1); k and v get the
 * element-wise median over the rows: the middle value for odd rows, the
 * LOWER middle for even rows (torch.median; [RECON] for even r). k or v may
 * be NULL to skip that half. Call it only for tokens in the sketch. */
void reviver_sketch_query(const reviver_sketch *s, const uint32_t *h, const int8_t *g, float *k,
                          float *v);

/* Alg. 3's delete: insert(-k_est, -v_est) and count -= 1, where k_est/v_est
 * are what reviver_sketch_query() returned for the token; the residual
 * error stays in the cells (§3.3, §6 #12). The counts keep track of the
 * tokens in each bucket for MEAN mode. */
void reviver_sketch_delete(reviver_sketch *s, const uint32_t *h, const int8_t *g,
                           const float *k_est, const float *v_est);

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

/* ---- what the daemon needs from a live "reviver" state ---- */

/* The sketch of one layer as the policy configured it. */
typedef struct reviver_layer_sketch_config {
    uint32_t rows, buckets;
    uint64_t layer_seed; /* for reviver_hash() */
    reviver_estimate key_estimate, value_estimate;
} reviver_layer_sketch_config;

/* state must come from policy "reviver"'s create(). Returns 0, or -1 when
 * layer is out of range. */
int reviver_layer_sketch(const void *state, uint32_t layer, reviver_layer_sketch_config *out);

/* The operations of the layer's last successful step, in application order
 * (valid until the layer's next step). *n receives their number; NULL with
 * *n = 0 when there were none or layer is out of range. */
const reviver_op *reviver_layer_ops(const void *state, uint32_t layer, size_t *n);

#endif
