/*
 * store_operator.h - what an operator may do to a sequence by hand (the `kvstash`
 * CLI's evict, demote, offload and revive), beside what its worker and its
 * policy do. One call, EvictRequest's, with the tier the positions go to.
 *
 * Evict drops original positions from some or all layers of a sequence, as
 * if the policy had decided it: the policy host's lists lose the tokens, the
 * block table loses their slots, blocks left with no token are retired until
 * the worker acknowledges the new epoch (DESIGN.md "Memory": RCU-style), and a
 * table.changed event goes out. Demote, offload and revive instead set the
 * positions' decided tier to INT8, SKETCH or FULL and let the sequence's
 * storage follow (seq.h seq_apply_decision: INT8 quantised, sketch inserted,
 * INT8 dequantised or sketch estimates taken back out of the sketch,
 * KVReviver Alg. 3); demote quantises at once even fewer tokens than an INT8
 * block holds (seq_demote_pending). Blocks the moves leave are retired the
 * same way, and a table.changed event says which operation ran.
 *
 * A store operation (daemon/store*.c): it takes the store's lock, checks the
 * caller's session and uid against the sequence's owner, and reports to the
 * store's metrics and events, so it sees the store's structures
 * (store_internal.h) like store.c does.
 */
#ifndef KVSTASH_STORE_OPERATOR_H
#define KVSTASH_STORE_OPERATOR_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"
#include "store.h"

#define OPERATOR_MAX_RANGES 65536

/* A call is applied in chunks of whole layers whose lists hold this many
 * tokens (at least one layer), the store's lock let go for
 * OPERATOR_CHUNK_PAUSE_NS between chunks: an offload runs at about a
 * microsecond a token, so no other caller waits much longer than some tens
 * of milliseconds behind one (issue 12; docs/reliability.md). */
#define OPERATOR_CHUNK_TOKENS 32768
#define OPERATOR_CHUNK_PAUSE_NS 50000

/* Original positions first .. first+count-1 (count >= 1). */
typedef struct operator_range {
    uint32_t first, count;
} operator_range;

typedef struct operator_evict_result {
    uint64_t epoch;   /* the sequence's table epoch afterwards */
    uint32_t evicted; /* tokens removed, summed over the lists */
    /* held (list, position) pairs at the requested positions the call
     * applied to (evict: tokens removed, counted in `evicted`) */
    uint32_t requested;
    uint32_t by_policy; /* of `evicted`, tokens the policy's own rule removed */
    /* requested (list, position) pairs that were not held (a tier move: or
     * that the policy's own rule removed first) */
    uint32_t not_held;
    uint32_t moved; /* of `requested`, tokens whose storage tier changed */
} operator_evict_result;

/* The tier EvictRequest.to names: "" or "evict" POLICY_EVICT, "int8"
 * POLICY_INT8, "int4" POLICY_INT4, "int2" POLICY_INT2, "sketch" POLICY_SKETCH, "full" (or its old
 * name "fp16", still accepted) POLICY_FULL. Anything else (NULL is "") is INVALID_ARGUMENT naming
 * the accepted values. */
status_code operator_parse_to(const char *to, policy_tier *out, status *s);

/* Whether operator eviction works on sequences of policy p: only for policies
 * that need no statistics and keep no per-token state (full, streaming). A
 * policy that tracks every token (h2o's accumulated scores, reviver's
 * sketch, ...) checks that the host's lists extend what it tracks and would
 * fail its next step after tokens vanished behind its back. */
int operator_can_evict(const policy_ops *p);

/*
 * Give the held tokens at `ranges` of the layers listed in `layers`
 * (nlayers == 0: every layer) of sequence seq_id tier `to`: POLICY_EVICT
 * drops them, POLICY_INT8 demotes them (now, a partial INT8 block
 * included), POLICY_SKETCH offloads them into their list's sketch (they stay
 * in the list as sketch tokens), POLICY_FULL brings INT8 and sketch tokens
 * back to full precision. For the caller holding `token` (a fd-socket
 * session; it need not be attached). The policy's own step runs first on
 * each of those layers, as it would at the sequence's next step (streaming
 * drops what is beyond its window); eviction adds the requested positions to
 * its decision, a tier move sets the tier of those it keeps. A move the pool
 * has no blocks for stays undone (out->moved counts what was done). The
 * epoch is bumped when a table changed.
 *
 * A sequence whose chosen lists hold more than OPERATOR_CHUNK_TOKENS tokens
 * is done a chunk of layers at a time, each chunk all or nothing and its
 * own epoch (and table.changed event), the lock let go in between and the
 * checks below run again before the next chunk. A failure after the first
 * chunk leaves the chunks before it applied and says so in its message
 * (how many of the chosen layers, and the epoch); *out is zeroed on any
 * error.
 *
 * Errors (nothing changes, but see chunks above): UNAVAILABLE (shutting down), UNAUTHENTICATED (no
 * or unknown token), NOT_FOUND (no such sequence), PERMISSION_DENIED (another
 * session's sequence, and the caller's uid is no operator's:
 * store_set_operators),
 * FAILED_PRECONDITION (the policy cannot take operator changes),
 * INVALID_ARGUMENT (no ranges, too many, empty, overflowing or beyond the
 * appended positions; a layer out of range; `to` not a policy_tier).
 */
status_code operator_apply(store *st, const char *token, uint64_t seq_id, policy_tier to,
                           const operator_range *ranges, size_t nranges, const uint32_t *layers,
                           size_t nlayers, operator_evict_result *out, status *s);

/* operator_apply with to = POLICY_EVICT. */
status_code operator_evict(store *st, const char *token, uint64_t seq_id,
                           const operator_range *ranges, size_t nranges, const uint32_t *layers,
                           size_t nlayers, operator_evict_result *out, status *s);

#endif
