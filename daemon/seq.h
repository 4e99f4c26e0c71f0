/*
 * seq.h - one sequence: block tables, epochs and the blocks retired until
 * the worker acknowledges a newer epoch.
 *
 * Each layer has one token list, or one per KV head when the policy decides
 * per head (policy_ops.per_head: AdaKV, CriticalKV, WeightedKV keep
 * different tokens per head, and the memory of what a head dropped must come
 * back). A list's tokens are segments (block, first slot, count) in order,
 * parallel to the policy host's list (positions and tiers live there, once).
 * A segment is stored in one tier (seg_tier): full precision slots, slots
 * of an INT8 block (tier.h), or the list's sketch (no block). The storage
 * tier follows the policy's decided tier (the host's), but may lag it: INT8
 * demotion waits until a whole INT8 block's worth of tokens is decided INT8
 * (an INT8 block is written once; its scales cover all its tokens; only an
 * operator's demote writes a partial one, seq_demote_pending), and a move
 * that needs blocks the pool lacks waits for the next step.
 * Blocks of an all-heads list hold block_tokens tokens of every KV head
 * (K, V: [kv_heads][block_tokens][head_dim]); blocks of a per-head list hold
 * kv_heads * block_tokens rows of their one head (K, V: [rows][head_dim]),
 * the same bytes seen as kv_heads = 1. A block belongs to one list.
 * The policy decides after each step; on the gRPC path a step ends at the
 * next Append. Eviction removes
 * tokens from the segments without moving data; a block none of whose slots
 * remain is retired, and returns to the pool once the worker acks an epoch at
 * or after the one that retired it (DESIGN.md "Memory": RCU-style).
 * New tokens go into the never-written slots of the layer's tail block, then
 * into fresh blocks: a slot that held an evicted token is never handed out
 * again while the sequence lives, so a worker reading an old table never sees
 * it overwritten. Not thread-safe: the store's lock covers it.
 */
#ifndef KVSTASH_SEQ_H
#define KVSTASH_SEQ_H

#include <stddef.h>
#include <stdint.h>

#include "host.h"
#include "kernels.h"
#include "policy.h"
#include "pool.h"
#include "snapshot.h"
#include "status.h"
#include "tier.h"

#define SEQ_MAX_APPEND 65536

typedef struct seq_list {
    kv_segment *segs;
    uint8_t *seg_tier; /* [nsegs] how segment i is stored: POLICY_FULL, _INT8, _SKETCH */
    size_t nsegs, segs_cap;
    uint32_t tail_block;     /* block that new tokens fill first */
    uint32_t tail_next_slot; /* its first never-written slot; slots per block = full */
    int has_tail;
    tier_sketch sketch; /* the list's count-sketch; sketch.sk.key NULL until used */
    /* Victims kept out of the list, revivable (storage option victims):
     * their positions, ascending, and where each is stored: the sketch
     * (victims=sketch), or a pool slot (victims=int8: an INT8 slot, or its
     * full-precision slot until an INT8 block's worth waits, seq.c
     * list_victims_quantize). */
    uint32_t *offloaded;
    tier_token *offloaded_at;
    size_t noffloaded, offloaded_cap;
    /* The INT8 blocks victims=int8 wrote for victims, oldest first: never in
     * a table, so memory pressure frees them at once (seq_append). */
    uint32_t *victim_blocks;
    size_t nvictim_blocks, victim_blocks_cap;
} seq_list;

typedef struct seq_retired {
    uint32_t block;
    uint64_t epoch;
} seq_retired;

typedef struct seq {
    uint64_t id;
    uint64_t session_id;
    pool *pool;
    const policy_ops *policy;
    policy_host *host; /* the logical lists and the policy's state */
    policy_params params;
    char label[129];
    uint64_t epoch;
    uint64_t appended;  /* tokens ever appended; the next token's position */
    uint32_t unstepped; /* tokens appended since the policy's last step */
    uint32_t nlayers;
    uint32_t heads;        /* lists per layer: 1, or kv_heads for per-head policies */
    uint32_t block_slots;  /* tokens (or rows) a block of one list holds */
    kv_layout list_layout; /* a list's block layout, for the kernels */
    tier_ctx tier;         /* the lists' storage: pool, layouts, dtype */
    seq_list *lists;       /* [nlayers * heads], list of (layer l, head k) at l * heads + k */
    seq_retired *retired;
    size_t nretired, retired_cap;
    uint64_t moved[3];        /* tokens ever moved: to INT8, into the sketch, back to full */
    uint64_t requantized;     /* INT8 tokens re-quantised by compaction (§5.4) */
    uint64_t victims_dropped; /* victims=int8 victims freed under memory pressure */
    snapshot_tiers report;    /* seq_tier_report */
} seq;

/* Create a sequence on `pool` with a policy and its resolved parameters; the
 * policy's create() validates them. Caller frees with seq_destroy. */
status_code seq_create(uint64_t id, uint64_t session_id, pool *pool, const policy_ops *policy,
                       const policy_params *params, const char *label, seq **out, status *st);

/* Free every block (held and retired) back to the pool and the sequence. */
void seq_destroy(seq *s);

/* Return retired blocks whose epoch is <= ack_epoch to the pool. */
void seq_ack(seq *s, uint64_t ack_epoch);

/* Tokens and original positions list (layer, head) holds (owned by the
 * sequence; valid until it changes). head is 0 for all-heads lists. */
uint32_t seq_list_tokens(seq *s, uint32_t layer, uint32_t head, const uint32_t **positions);

/* Distinct blocks list (layer, head) uses. */
uint32_t seq_list_blocks(const seq *s, uint32_t layer, uint32_t head);

/* Blocks in the layer tables and in the retired list. */
uint32_t seq_blocks_held(const seq *s);
size_t seq_retired_count(const seq *s);
uint64_t seq_tokens_held(seq *s);

/*
 * Append `count` tokens to every layer. First, if the policy needs no
 * statistics from the worker, the step of the tokens appended before ends
 * here: the policy decides and evicted tokens leave (their emptied blocks are
 * retired). Then, if the pool has the blocks, the new tokens get slots; if it
 * has not, RESOURCE_EXHAUSTED and no token is added. Each change bumps the
 * epoch. *evicted is the number of tokens removed (all lists), and writes[i]
 * (an array of nlayers * heads entries the caller provides, each with room
 * for `count` segments) receives the segments of the new tokens of list i.
 */
status_code seq_append(seq *s, int64_t count, kv_segment *const *writes, size_t *nwrites,
                       uint32_t *evicted, status *st);

/* The statistics of one step, as the worker laid them out (proto/kvstash_step.h). */
typedef struct seq_step_input {
    unsigned arrays;     /* POLICY_NEEDS_* bits present in data */
    uint32_t new_tokens; /* 0 = every token appended since the last step */
    int prefill;
    uint32_t score_queries, window_queries;
    double confidence;
    const float *data; /* private copy, owned by the caller */
    size_t nfloats;
} seq_step_input;

/*
 * End a step: check the statistics against what the policy needs and what
 * the layers hold, run the policy on every layer, and apply its decisions.
 * Bumps the epoch when anything changed. Returns INVALID_ARGUMENT (sizes,
 * non-finite values) or FAILED_PRECONDITION (a needed array is missing) and
 * changes nothing when the input is wrong.
 */
status_code seq_step(seq *s, const seq_step_input *in, uint32_t *evicted, status *st);

/* Apply a decision of layer l that policy_host_step returned (possibly
 * amended, as an operator eviction does): value merges, then per list:
 * victims offloaded to the sketch (storage option victims=sketch) or
 * dropped, tier moves (sketch insert / revive, dequantise), INT8
 * compaction (re-quantising survivors spread over too many INT8 blocks),
 * INT8 demotion in whole blocks, key re-rotation, full-precision
 * compaction; blocks no longer used
 * are retired at `epoch`; then the host's commit. *evicted grows by the
 * tokens removed, *changed is set when any list's table changed. */
status_code seq_apply_decision(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                               size_t *evicted, int *changed, status *st);

/* Quantise now every token of layer `layer`'s lists that the host decided
 * INT8 but that is still stored at full precision, fewer than an INT8
 * block's worth included (the last INT8 block is written partial and never
 * filled later): an operator's demote (store_operator.h), after
 * seq_apply_decision committed the decision. Tokens stay where they are
 * when the pool lacks the blocks. Blocks no longer used are retired at
 * `epoch`; *changed is set when a list's table changed. RESOURCE_EXHAUSTED
 * when out of memory. */
status_code seq_demote_pending(seq *s, uint32_t layer, uint64_t epoch, int *changed, status *st);

/* Storage per tier (POLICY_FULL, _INT8, _SKETCH) over every list: tokens
 * held and offloaded victims kept, by the tier they are stored in, and
 * bytes (pool blocks of that tier; sketch cells). */
void seq_tier_usage(const seq *s, uint64_t tokens[3], uint64_t bytes[3]);

/* Tokens of list (layer, head) stored in each tier. */
void seq_list_tier_tokens(const seq *s, uint32_t layer, uint32_t head, uint32_t tokens[3]);

/*
 * Revive (the RPC): rebuild positions [first, first + count) of list
 * (layer, head) in full precision into fresh blocks of the pool: held
 * tokens and offloaded victims (raw copied, INT8 dequantised, sketch
 * queried), in position order; the sketch is not changed. Tokens
 * evicted outright cannot come back: FAILED_PRECONDITION naming them,
 * unless skip_evicted. On success *segs (malloc'd) holds the scratch
 * blocks' segments in list layout, *pos (malloc'd) the positions and
 * *src_tier each token's tier; *blocks (malloc'd, *nblocks) the blocks the
 * caller now owns and frees with pool_free_block.
 */
status_code seq_revive(seq *s, uint32_t layer, uint32_t head, uint32_t first, uint32_t count,
                       int skip_evicted, kv_segment **segs, size_t *nsegs, uint32_t **pos,
                       uint8_t **src_tier, size_t *ntokens, uint32_t **blocks, size_t *nblocks,
                       status *st);

/* The tier report: the tier moves (moved[], requantized, victims_dropped)
 * and their measurements since the last seq_tier_report_clear. The store
 * hands it to metrics_tiers (metrics.h), then clears it. */
const snapshot_tiers *seq_tier_report(const seq *s);
void seq_tier_report_clear(seq *s);

/* Floats a step must carry for `arrays` given the current lists (the
 * layout: proto/kvstash_step.h); (size_t)-1 when out of memory. */
size_t seq_step_floats(seq *s, unsigned arrays);

#endif
