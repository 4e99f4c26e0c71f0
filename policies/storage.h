/*
 * storage.h - the storage options every policy accepts, next to its own
 * parameters: where a policy's victims go, and INT8 demotion of old tokens
 * (DESIGN.md "Policies compose with the tiers").
 *
 *   demote=off|int8|int4|int2
 *                      demote held tokens to INT8 (POLICIES.md §5.4) or to
 *                      INT4 / INT2 groups (KIVI; kernels.h "Low-bit
 *                      tiers"), all but the newest int8_window of each list
 *   int8=on|off        the same as demote=int8 (the older key; it may not
 *                      contradict demote)
 *   int8_window=N      newest held tokens per list kept at full precision
 *                      when demoting, whatever the precision (KIVI's
 *                      residual window)
 *   demote_keep=F      precision by importance (ZipCache): of the held
 *                      tokens older than the window, the share F (0..1)
 *                      with the highest mean attention stays at full
 *                      precision and only the rest is demoted. The mean
 *                      attention of a token is what the worker's step
 *                      statistics gave it (score, else last_attn, else
 *                      window_attn, summed over the list's query heads)
 *                      over the queries since it arrived; a step without
 *                      them adds nothing. 0 (the default): by age alone
 *   victims=evict|sketch|int8
 *                      a token the policy evicts is dropped, or kept out of
 *                      the table but revivable with Revive: offloaded into
 *                      its list's count-sketch (POLICIES.md §3.3), or
 *                      quantised to INT8 (§5.4; memory pressure drops these
 *                      first)
 *   sketch_rows, sketch_buckets, sketch_seed
 *                      that sketch's geometry (policies with their own
 *                      sketch, like reviver, bring theirs: ops->sketch_geometry)
 *
 * The policy host applies int8 to each decision (so `kvstash replay` shows
 * it); the daemon applies victims when it moves memory. A policy never sees
 * these keys.
 */
#ifndef KVSTASH_POLICY_STORAGE_H
#define KVSTASH_POLICY_STORAGE_H

#include "policy.h"

typedef enum policy_victims {
    POLICY_VICTIMS_EVICT = 0,
    POLICY_VICTIMS_SKETCH = 1,
    POLICY_VICTIMS_INT8 = 2,
} policy_victims;

typedef struct policy_storage {
    uint8_t demote; /* POLICY_FULL (off), POLICY_INT8, POLICY_INT4 or POLICY_INT2 */
    uint32_t int8_window;
    double demote_keep;
    policy_victims victims;
    uint32_t sketch_rows, sketch_buckets;
    uint64_t sketch_seed;
} policy_storage;

/* The storage keys with their defaults, in the order policy_params_resolve
 * appends them after a policy's own keys. */
const policy_param_spec *policy_storage_spec(size_t *count);

/* Parse the storage keys of a resolved parameter set. Returns 0, or -1 with
 * err naming the parameter. */
int policy_storage_parse(const policy_params *p, policy_storage *out, char *err, size_t errlen);

/* The sketch geometry of `layer` when the policy brings none: the storage
 * options, with the per-layer seed derivation of kernels/sketch_hash.h
 * (POLICIES.md §3.2), as reviver's. */
void policy_storage_sketch_geometry(const policy_storage *s, uint32_t layer,
                                    policy_sketch_geometry *out);

/*
 * Demotion of one list after a decision: of the tokens the decision keeps
 * in full precision or quantised (tier FULL, INT8, INT4 or INT2), the
 * newest int8_window stay as decided. Of the older ones (the candidates),
 * floor(demote_keep x candidates) may stay FULL: the FULL candidates with
 * the highest importance[] (ties: the newer stays), the other FULL ones get
 * the demote tier. A token once demoted is not promoted back by this rule.
 * importance may be NULL when demote_keep is 0; scratch has room for
 * policy_storage_demote_scratch(tokens) bytes (unused when demote_keep is
 * 0). Returns the number of tokens demoted. No-op when demote is off.
 */
uint32_t policy_storage_demote(const policy_storage *s, uint8_t *tier, uint32_t tokens,
                               const double *importance, void *scratch);
size_t policy_storage_demote_scratch(uint32_t tokens);

#endif
