/*
 * ov_block.h - OpenVINO GenAI KV-cache token eviction (POLICIES.md §2), the
 * policy "ov_block" (ov_block.c).
 *
 * Two faces:
 *  - the pure algorithm pieces that the §2.10 test vectors exercise (forward
 *    max-pool, counters, block scores and the tie rule, KVCrush, mt19937,
 *    rotation plan and coefficients); step() uses exactly these functions;
 *  - the state operations that `kvstash replay` drives directly with the
 *    OpenVINO semantics (register scores of a whole sequence, evict, read the
 *    accumulators and counters, rotation data). They act on the state that
 *    policy_ov_block.create() makes (the host's policy_host_state()).
 *
 * Indices: "tracked" tokens are the tokens after the start area (§2.3); a
 * layer's accumulator index i is the sequence's held token start_size + i.
 * Block indices returned to callers are absolute logical blocks (held index
 * / block size), as in OpenVINO's block tables.
 */
#ifndef KVSTASH_OV_BLOCK_H
#define KVSTASH_OV_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"

/* ---- mt19937 (POLICIES.md §2.6 RANDOM anchor, §6 #8) ------------------- */

/* The 32-bit Mersenne Twister of C++ std::mt19937 (same seeding and output). */
typedef struct ov_mt19937 {
    uint32_t mt[624];
    uint32_t idx;
} ov_mt19937;

void ov_mt19937_seed(ov_mt19937 *r, uint32_t seed);
uint32_t ov_mt19937_next(ov_mt19937 *r);

/* ---- score accumulation (§2.3) ------------------------------------------ */

/*
 * Forward-looking max-pool with a window that shrinks at the tail:
 * y[i] = max(x[i], ..., x[min(i + w, n) - 1]); w <= 1 copies x.
 * y must not alias x; scratch has room for n indices. O(n).
 */
void ov_fwd_maxpool(const double *x, size_t n, size_t w, double *y, size_t *scratch);

/*
 * NORM_SUM counter of tracked token i of n when the last k queries scored
 * them: min(k, n - i). This is §2.3's `[k]*(n-k) ++ [k, k-1, ..., 1]`
 * (initial registration with a SnapKV window, k = nsnap; in-window growth,
 * k = nreg) and `[n, ..., 1]` (no window, k >= n). For n < k the list is
 * `[n, ..., 1]`: [RECON] the reference indexes out of range there.
 */
uint64_t ov_counter(size_t i, size_t n, uint64_t k);

/* ---- block eviction (§2.5) ---------------------------------------------- */

/*
 * bs[j] = Σ_{t<B} acc[j*B+t] / c[j*B+t] (NORM_SUM), or Σ acc (cnt NULL:
 * SUM), for j < nblocks, summed in double in t order, where the counter
 * c[i] = cnt[i] + cnt_shift (mod 2^64: a layer keeps its counters so);
 * B >= 1.
 */
void ov_score_blocks(const double *acc, const uint64_t *cnt, uint64_t cnt_shift, size_t nblocks,
                     uint32_t B, double *bs);

/*
 * The k lowest of bs[0..n) as (score, index) pairs, lexicographically:
 * equal scores evict the lower block first (§2.5). Writes the chosen block
 * indices to out in ascending index order. Returns 0, or -1 out of memory.
 */
int ov_select_lowest(const double *bs, size_t n, size_t k, uint32_t *out);

/* ---- KVCrush (§2.6) ------------------------------------------------------ */

typedef enum ov_anchor_mode {
    OV_ANCHOR_RANDOM = 0,
    OV_ANCHOR_ZEROS = 1,
    OV_ANCHOR_ONES = 2,
    OV_ANCHOR_MEAN = 3,
    OV_ANCHOR_ALTERNATING = 4,
} ov_anchor_mode;

/* ind[i] = 1 for the n/2 (integer) indices with the largest acc[i] (ties:
 * lower index), else 0. Returns 0, or -1 out of memory. */
int ov_kvcrush_indicators(const double *acc, size_t n, uint8_t *ind);

/*
 * The anchor pattern of B bits. RANDOM draws B values from rng, bit =
 * (rng() >> 31) & 1 (§6 #8); MEAN: anchor[p] = 1 iff Σ_b ind[b*B+p] / nE
 * > 0.5 over all nE blocks; ALTERNATING: p mod 2. rng may be NULL unless
 * RANDOM.
 */
void ov_kvcrush_anchor(ov_anchor_mode mode, const uint8_t *ind, size_t nE, uint32_t B,
                       ov_mt19937 *rng, uint8_t *anchor);

/*
 * KVCrush_retain: of the score-based victims (relative block indices <
 * nE), the blocks to keep after all. acc holds at least nE*B raw
 * accumulated scores (never divided by counters, §6 #10). Victims are
 * ranked by Hamming distance of their indicator block to the anchor (ties:
 * lower block), and k = min(nv, budget) picks E[i * (nv / k)] are kept.
 * Writes them (ascending) to retain (room for budget) and their number to
 * *nretain. Returns 0, or -1 out of memory.
 */
int ov_kvcrush_retain(const double *acc, size_t nE, uint32_t B, const uint32_t *victims, size_t nv,
                      uint32_t budget, ov_anchor_mode mode, ov_mt19937 *rng, uint32_t *retain,
                      size_t *nretain);

/* ---- cache rotation (§2.8) ----------------------------------------------- */

typedef struct ov_rotation_step {
    uint32_t block; /* new logical block index (old index - shift) */
    uint32_t shift; /* in blocks; the rotation delta is shift * B tokens */
} ov_rotation_step;

/*
 * The blocks that move when the logical blocks in evicted[0..ne) (a set,
 * any order) are removed from nbefore blocks: every kept block after the
 * first evicted one, with its shift. out has room for nbefore entries.
 * Errors (-1, err set): an evicted block >= nbefore, or a shift >= nmax
 * (rows of the coefficient table; §6 #6 requires shift < Nmax).
 */
int ov_rotation_plan(const uint32_t *evicted, size_t ne, uint32_t nbefore, uint32_t nmax,
                     ov_rotation_step *out, size_t *nout, char *err, size_t errlen);

/*
 * One coefficient row for a rotation by delta tokens: for j < d/2, theta_j
 * = rope_theta^(-2j/d), cos_row[j] = cos(delta*theta_j) and sin_row[j] =
 * -sin(delta*theta_j) (the inverse rotation, as OpenVINO stores it). This is
 * the plan's description (positions and theta only, as OpenVINO's cache
 * manager hands it out); applying it to keys is K/V math, the daemon's
 * kv_rope_rerotate (kernels/kernels.h) with delta = -delta.
 */
void ov_rotation_row(uint32_t delta, uint32_t d, double rope_theta, double *sin_row,
                     double *cos_row);

/* ---- the policy state and its replay operations ------------------------- */

typedef struct ov_block ov_block; /* what policy_ov_block.create() makes */

/* What a registration did (the same for every layer of a sequence whose
 * layers hold equal lengths). */
typedef enum ov_reg_status {
    OV_REG_DONE = 0,          /* accumulated */
    OV_REG_SHORT = 1,         /* the vector holds no token after the start area */
    OV_REG_BEFORE_WINDOW = 2, /* initial registration with snapkv 0 while a SnapKV
                                 window is configured: ignored, as in OpenVINO */
} ov_reg_status;

/*
 * Register one raw score vector per layer (scores[l] has n[l] values, one
 * per held token including the start area), aggregating nsnap SnapKV-window
 * queries (§2.3). *status (may be NULL) reports the highest status of any
 * layer. Errors (-1, err set, state unchanged): nsnap would overfill the
 * SnapKV window, a vector shorter than the tokens the layer already tracks
 * (start_size + tracked), a non-finite score, out of memory.
 */
int ov_block_register(ov_block *st, const double *const *scores, const size_t *n, uint32_t nsnap,
                      ov_reg_status *status, char *err, size_t errlen);

/*
 * Evict one layer (§2.5 with §2.6): drops the victims from the layer's
 * accumulator and counters and returns their absolute logical block
 * indices, ascending, in *blocks (malloc'd, the caller frees; NULL when
 * none) and their number in *nblocks. Returns 0, or -1 out of memory.
 */
int ov_block_evict(ov_block *st, uint32_t layer, uint32_t **blocks, size_t *nblocks, char *err,
                   size_t errlen);

uint32_t ov_block_layers(const ov_block *st);
uint32_t ov_block_start_size(const ov_block *st);
uint32_t ov_block_snapkv_window(const ov_block *st);
uint32_t ov_block_block_size(const ov_block *st);
uint32_t ov_block_head_size(const ov_block *st);         /* resolved: head_size or head_dim */
uint32_t ov_block_snapkv_registered(const ov_block *st); /* nreg of §2.3 */

/* A layer's accumulated scores and NORM_SUM counters (NULL in SUM mode, or
 * out of memory: the layer keeps them as offsets from one shift, and this
 * writes them out), ov_block_tracked() values each; valid until the next
 * state operation. */
size_t ov_block_tracked(const ov_block *st, uint32_t layer);
const double *ov_block_scores(const ov_block *st, uint32_t layer);
const uint64_t *ov_block_counters(ov_block *st, uint32_t layer);

/* For the replay's evict: the next step() (of any layer) evicts exactly the
 * logical blocks blocks[0..n) of that layer instead of deciding, so that the
 * host's token list follows ov_block_evict(). blocks must stay valid until
 * that step. */
void ov_block_apply_next(ov_block *st, const uint32_t *blocks, size_t n);

/* policy_ops.replay of "ov_block" (ov_block_replay.c): the operations
 * scores, evict, rotation and state of docs/replay.md, in OpenVINO's terms,
 * on this state. */
struct policy_replay;
int ov_block_replay(const struct policy_replay *r, const char *op);

/* One shifted block with its coefficient rows (head_size/2 values each). */
typedef struct ov_rotation {
    uint32_t block, delta; /* new logical block; delta in tokens */
    const double *sin_row, *cos_row;
} ov_rotation;

/*
 * Rotation data (§2.8) for evicting the logical blocks evicted[0..ne) out of
 * blocks_before, with the policy's rope_theta and head size. *out is one
 * malloc'd block holding the entries and their rows (free() it; NULL when
 * no block moves), *nout their number. The coefficient table has
 * blocks_before + 1 rows, so the shift bound of §6 #6 holds by
 * construction. Errors (-1, err set): an evicted block >= blocks_before,
 * head size 0, out of memory.
 */
int ov_block_rotation(const ov_block *st, const uint32_t *evicted, size_t ne,
                      uint32_t blocks_before, ov_rotation **out, size_t *nout, char *err,
                      size_t errlen);

#endif
