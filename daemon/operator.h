/*
 * operator.h - what an operator may do to a sequence by hand (the `kvstash`
 * CLI's evict), beside what its worker and its policy do.
 *
 * Evict drops original positions from some or all layers of a sequence, as
 * if the policy had decided it: the policy host's lists lose the tokens, the
 * block table loses their slots, blocks left with no token are retired until
 * the worker acknowledges the new epoch (DESIGN.md "Memory": RCU-style), and a
 * table.changed event goes out. Demote, offload and revive need the INT8 and
 * sketch tiers, which this kvstashd does not have yet: there is nothing here
 * for them.
 */
#ifndef KVSTASH_OPERATOR_H
#define KVSTASH_OPERATOR_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "store.h"

#define OPERATOR_MAX_RANGES 65536

/* Original positions first .. first+count-1 (count >= 1). */
typedef struct operator_range {
    uint32_t first, count;
} operator_range;

typedef struct operator_evict_result {
    uint64_t epoch;     /* the sequence's table epoch afterwards */
    uint32_t evicted;   /* tokens removed, summed over the lists */
    uint32_t requested; /* of those, tokens at the requested positions */
    uint32_t by_policy; /* of those, tokens the policy's own rule removed */
    uint32_t not_held;  /* requested (list, position) pairs that were not held */
} operator_evict_result;

/* Whether operator eviction works on sequences of policy p: only for policies
 * that need no statistics and keep no per-token state (full, streaming). A
 * policy that tracks every token (h2o's accumulated scores, reviver's
 * sketch, ...) checks that the host's lists extend what it tracks and would
 * fail its next step after tokens vanished behind its back. */
int operator_can_evict(const policy_ops *p);

/*
 * Evict `ranges` from the layers listed in `layers` (nlayers == 0: every
 * layer) of sequence seq_id, for the caller holding `token` (a fd-socket
 * session; it need not be attached). The policy's own step runs first on
 * each of those layers, as it would at the sequence's next step (streaming
 * drops what is beyond its window), and the requested positions are added to
 * its decision.
 *
 * Errors (nothing changes): UNAVAILABLE (shutting down), UNAUTHENTICATED (no
 * or unknown token), NOT_FOUND (no such sequence), PERMISSION_DENIED (the
 * caller's uid is neither root, the daemon's, nor the owning worker's),
 * FAILED_PRECONDITION (the policy cannot take operator evictions),
 * INVALID_ARGUMENT (no ranges, too many, empty, overflowing or beyond the
 * appended positions; a layer out of range).
 */
status_code operator_evict(store *st, const char *token, uint64_t seq_id,
                           const operator_range *ranges, size_t nranges, const uint32_t *layers,
                           size_t nlayers, operator_evict_result *out, status *s);

#endif
