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

typedef struct seq_retired {
    uint32_t block;
    uint64_t epoch;
} seq_retired;

typedef struct seq seq; /* opaque: seq_internal.h */

/* What a sequence is, read-only. */
uint64_t seq_id_of(const seq *s);
uint64_t seq_session_id(const seq *s);
pool *seq_pool(const seq *s);
const policy_ops *seq_policy(const seq *s);
const policy_params *seq_params(const seq *s); /* resolved at create */
const char *seq_label(const seq *s);
uint64_t seq_epoch(const seq *s);    /* the tables' current epoch */
uint64_t seq_appended(const seq *s); /* tokens ever appended; the next position */
uint32_t seq_layers(const seq *s);
uint32_t seq_heads(const seq *s); /* lists per layer: 1, or kv_heads (per-head policy) */
/* Tokens of a block of quantised tier t in one pool block (tier.h; 0: the
 * tier does not fit), for tables. */
uint32_t seq_block_tokens(const seq *s, uint8_t t);
/* The INT4 / INT2 groups' size of its lists (kernels.h "Low-bit tiers"). */
uint32_t seq_quant_group(const seq *s);
/* Lifetime totals: tokens moved, by the tier they went to (policy_tier:
 * demoted to INT8 / INT4 / INT2, into the sketch, back to full);
 * victims=int8 victims dropped under memory pressure. */
void seq_moved_totals(const seq *s, uint64_t moved[POLICY_TIERS]);
uint64_t seq_victims_dropped(const seq *s);
/* The blocks retired and not yet acknowledged, with the epoch each waits
 * for; *out is the sequence's (valid until it changes). */
size_t seq_retired_blocks(const seq *s, const seq_retired **out);

/*
 * A read-only view of list (layer, head), valid until the sequence
 * changes: its tokens' original positions in list order, the segments
 * holding them (parallel to the positions) with each segment's storage
 * tier (POLICY_FULL, _INT8, _SKETCH; sketch segments have no block), and
 * the positions of the victims kept out of the list, ascending.
 */
typedef struct seq_list_view {
    uint32_t tokens;
    const uint32_t *positions;
    const kv_segment *segs;
    const uint8_t *seg_tier;
    size_t nsegs;
    const uint32_t *offloaded;
    size_t noffloaded;
} seq_list_view;

void seq_list_view_get(seq *s, uint32_t layer, uint32_t head, seq_list_view *v);

/* An operator's move on layer l starts from the policy's own step over the
 * tokens appended since its last one, with no statistics (store_operator.c
 * amends the decision, then seq_apply_decision applies it). *d is the
 * host's (policy_host_step), its spans whole lists. INTERNAL or
 * RESOURCE_EXHAUSTED when the policy fails. */
status_code seq_policy_layer_step(seq *s, uint32_t l, const policy_decision **d, status *st);

/* The tables changed at `epoch` (seq_epoch + 1, the epoch the changes
 * were applied at): publish it. */
void seq_publish_epoch(seq *s, uint64_t epoch);

/*
 * Transactions. A call that changes a sequence in many parts (a step over
 * every layer, an append that ends a step, an operator's move) runs between
 * seq_begin and seq_end; when a part fails (out of memory, a device error,
 * a policy's refusal), seq_rollback leaves the sequence, its policy host
 * (lists and policy state) and its pool's free blocks exactly as they were
 * at seq_begin, as if the call had not run. seq_step and seq_append take
 * their own; an operator's move takes one around its layers. None of the
 * three can fail. Transactions do not nest, and one pool has one at a time
 * (the store's lock).
 */
void seq_begin(seq *s);
void seq_rollback(seq *s);
void seq_end(seq *s);

/* Create a sequence on `pool` with a policy and its resolved parameters; the
 * policy's create() validates them. Caller frees with seq_destroy. */
status_code seq_create(uint64_t id, uint64_t session_id, pool *pool, const policy_ops *policy,
                       const policy_params *params, const char *label, seq **out, status *st);

/* Free every block (held and retired) back to the pool and the sequence. */
void seq_destroy(seq *s);

/* seq_destroy's part that touches the pool: every block given back (lock
 * held). The sequence is then empty and only for seq_destroy, which frees
 * its memory without touching the pool: a caller may let the store's lock
 * go before it (a long sequence's memory takes a while to give back). */
void seq_give_back_blocks(seq *s);

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

/* Whether `count` tokens may be appended: 1 .. SEQ_MAX_APPEND, and the
 * positions stay below 2^32. INVALID_ARGUMENT naming the limit otherwise.
 * seq_append checks it; a caller that allocates for count first does too. */
status_code seq_append_check(const seq *s, int64_t count, status *st);

/*
 * Append `count` tokens to every layer. First, if the policy needs no
 * statistics from the worker, the step of the tokens appended before ends
 * here: the policy decides and evicted tokens leave (their emptied blocks are
 * retired). Then, if the pool has the blocks, the new tokens get slots; if it
 * has not, RESOURCE_EXHAUSTED and no token is added, but the step stays (its
 * retired blocks are what an ack frees for a retry). Any other failure (out
 * of memory) leaves everything as it was. Each change bumps the epoch.
 * *evicted is the number of tokens removed (all lists), and writes[i]
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
    const float *data; /* the caller's, read during the step only */
    size_t nfloats;
    /* data[0..nfloats) is known finite (the caller checked its copy as it
     * made it: policy_copy_first_outside); 0: seq_step checks it. */
    int finite;
    /* NULL: data is private to the daemon. Else data is memory a worker may
     * write while the daemon reads it (the ring's), and copy, nfloats floats
     * of the caller's, receives it a layer at a time, each layer's part
     * copied and checked (finite must be 0) just before its policy step
     * reads the copy: nothing the worker writes afterwards reaches the
     * policy, and the policy reads its statistics from cache. A policy that
     * reads them in place (policy_host_stats_in_place: it takes and checks
     * each value itself) is handed data instead, and copy is not written. */
    float *copy;
    /* A thread the caller lends to the policy's layers (daemon/helper.h),
     * or NULL: the policy host starts its own. */
    const policy_helper *helper;
    /* With copy: every layer's part is copied, even for a policy that
     * reads in place (the caller reads copy after the step: metrics). */
    int copy_always;
} seq_step_input;

/*
 * End a step: check the statistics against what the policy needs and what
 * the layers hold, run the policy on every layer, and apply its decisions.
 * Bumps the epoch when anything changed. Returns INVALID_ARGUMENT (sizes,
 * non-finite values) or FAILED_PRECONDITION (a needed array is missing) and
 * changes nothing when the input is wrong.
 */
status_code seq_step(seq *s, const seq_step_input *in, uint32_t *evicted, status *st);

/*
 * seq_step in three parts, so that the store can let its lock go while the
 * policy decides (issue 16 §3: a prompt's decision over a long context
 * takes tens of milliseconds). seq_step_plan checks the input as seq_step
 * does (and changes nothing when it is wrong) and parses it; in->data must
 * outlive the job. seq_step_decide runs the policy: it changes only the
 * sequence's policy host, so it may run without the lock while nothing
 * else calls into the sequence (the store marks it moving) and nothing
 * reads its host (seq_tokens_held answers the count at the plan).
 * seq_step_finish applies the decisions in a transaction, or rolls the
 * host back when the decision failed, and frees the job: after a plan,
 * always exactly one finish, called with the lock held. Once the storage
 * follows the decisions, the host's commit of them (as long as the
 * decision at a prompt: its lists' entries compacted) changes only the
 * host. finish hands both parts to run(ctx, kind, work, arg) (NULL:
 * finish calls them), which must call work(arg) and may let the lock go
 * around it while the sequence is marked moving: around SEQ_WORK_HOST
 * (the commit) as it is; around SEQ_WORK_STORAGE (the application to the
 * storage) only with the sequence detached from its pool (seq_detach
 * before, seq_attach after, both under the lock). Detached, work may
 * find that it needs the lock after all (a decision that quantises: it
 * takes blocks beyond the reserve) and return SEQ_WORK_NEEDS_LOCK having
 * changed nothing; run then attaches the sequence and calls work(arg)
 * again under the lock. seq_tokens_held answers the count at the plan
 * until finish returns.
 */
typedef struct seq_step_job seq_step_job;
typedef enum seq_work_kind { SEQ_WORK_HOST, SEQ_WORK_STORAGE } seq_work_kind;
#define SEQ_WORK_NEEDS_LOCK 1
typedef int (*seq_step_runner)(void *ctx, seq_work_kind kind, int (*work)(void *), void *arg);
status_code seq_step_plan(seq *s, const seq_step_input *in, seq_step_job **job, status *st);
void seq_step_decide(seq_step_job *job);
status_code seq_step_finish(seq_step_job *job, seq_step_runner run, void *ctx, uint32_t *evicted,
                            status *st);

/* Between seq_step_decide and seq_step_finish: the decision of every layer
 * (NULL when the decision failed), and each list's tokens as the decision
 * saw them ([layers * heads], list k of layer l at l * heads + k: the
 * length of d[l]->tier[k]). Both are the job's. */
const policy_decision *const *seq_step_decisions(const seq_step_job *job);
const uint32_t *seq_step_list_tokens(const seq_step_job *job);

/*
 * Detach a sequence from its pool (lock held, no transaction open): until
 * seq_attach (lock held again) it takes blocks from a reserve taken from
 * the pool now and keeps those it gives back, so that a step's
 * application (SEQ_WORK_STORAGE above) may run without the store's lock
 * while other sequences of the pool take and give blocks under it.
 * Nothing else may read the sequence's storage meanwhile: the store waits
 * for it (snapshots, a session's block count) or passes it by. Returns 0,
 * or -1 when it stays attached (memory, or a pool too full to spare the
 * reserve: the work then runs under the lock). seq_attach gives the
 * reserve's unused blocks and the given ones back to the pool.
 */
int seq_detach(seq *s);
void seq_attach(seq *s);
int seq_detached(const seq *s);

/*
 * The tokens the last seq_step removed from the lists, when removing them
 * was all it did to them: no token moved, changed tier or merged, no list
 * was compacted. A worker can then cut them out of the table it holds
 * instead of reading the table again (issue 16 §2: 32 lists of 32k
 * positions a step). List i (layer i / heads, head i % heads) lost
 * count[i] tokens, whose indices in the list as it was at from_epoch are
 * idx[first[i] .. first[i] + count[i]), ascending.
 */
typedef struct seq_cuts {
    uint64_t from_epoch;
    size_t nlists, total;
    const uint32_t *count, *first, *idx;
} seq_cuts;

/* 1 and *out (valid until the sequence next changes) when the last step
 * only cut tokens out of the lists, else 0. */
int seq_step_cuts(const seq *s, seq_cuts *out);

/* The lists changed after the step (a demotion at its epoch): its cuts no
 * longer describe the change. */
void seq_step_cuts_forget(seq *s);

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

/*
 * Demotion after the step (issue 16 §3: a step that demotes must not hold
 * up other sequences). With it on, the store's choice, seq_step quantises
 * nothing: what it would demote (and victims=int8's victims) stays at full
 * precision, as when the pool lacks the blocks, and the caller demotes it
 * right after, in three parts. The step an Append ends (seq_append)
 * still quantises in place, before the new tokens take their blocks, so
 * that under memory pressure the victims it quantises are there to give
 * way (append_fits). seq_demote_plan takes
 * the blocks (*job NULL: nothing is due); seq_demote_fill quantises,
 * reading only s's pool memory and writing only the plan's blocks, so it
 * may run while other sequences change, as long as nothing changes s or
 * frees its pool meanwhile; seq_demote_finish publishes the demoted lists,
 * retiring the blocks they left at `epoch` (an epoch the worker has not
 * seen: the step's own when the step changed the tables, else the next;
 * a demotion of victims=int8's victims alone changes no table, so it
 * retires at the sequence's epoch and publishes none), or gives the blocks back (fill_rc != 0, or
 * out of memory: the tokens stay at full precision, due again at the next step), and frees the job.
 * Plan and finish need what guards the pool. The quantised tokens, their blocks' contents and the
 * epochs are those the step would have given, but for where blocks lie: full-precision compaction
 * ran before the demotion. seq_demote_due runs all three.
 */
void seq_set_demote_after_step(seq *s, int on);
typedef struct seq_demote_job seq_demote_job;
status_code seq_demote_plan(seq *s, uint64_t epoch, seq_demote_job **job, status *st);
int seq_demote_fill(seq_demote_job *job);
size_t seq_demote_tokens(const seq_demote_job *job); /* the tokens it quantises */
status_code seq_demote_finish(seq_demote_job *job, int fill_rc, status *st);
status_code seq_demote_due(seq *s, uint64_t epoch, status *st);

/* Whether a step left lists due for seq_demote_plan (without planning). */
int seq_demote_is_due(const seq *s);

/*
 * What the last demotion did to the tables, when it only moved runs of
 * tokens to other storage (no list compacted): run i says that tokens
 * [first, first + count) of list `list` (layer-major, as the table; their
 * indices, positions and order unchanged) are now slots [first_slot,
 * first_slot + count) of `block`, stored in `tier`. A worker that holds
 * the table of from_epoch applies them and has the table of to_epoch, at
 * 32k tokens a list a few runs instead of a table of megabytes.
 */
typedef struct seq_moved_run {
    uint32_t list, first, count, block, first_slot, tier;
} seq_moved_run;

typedef struct seq_moves {
    uint64_t from_epoch, to_epoch;
    size_t n;
    const seq_moved_run *runs;
} seq_moves;

/* 1 and *out (valid until the sequence next changes) when the sequence's
 * epoch is the one a demotion published and the demotion only moved runs
 * (seq_moves), else 0. */
int seq_demotion_moves(const seq *s, seq_moves *out);

/* Storage per tier (by policy_tier, POLICY_TIERS of them) over every list: tokens
 * held and offloaded victims kept, by the tier they are stored in, and
 * bytes (pool blocks of that tier; sketch cells). */
void seq_tier_usage(const seq *s, uint64_t tokens[POLICY_TIERS], uint64_t bytes[POLICY_TIERS]);

/* Limits (store.c, --max-daemon-mb): the daemon memory the sketches of
 * all s's lists would take if every list allocated its sketch (rows x
 * buckets of each layer's geometry; SIZE_MAX when that overflows), and
 * whether s's own configuration sends tokens there (victims=sketch, or a
 * policy with its own sketch) rather than only an operator's offload. */
size_t seq_sketch_bytes_max(const seq *s);
int seq_sketches(const seq *s);

/* The bytes the store reserved for s's sketches (0 = none yet); the store
 * gives them back when it destroys s. */
size_t seq_sketch_reserved(const seq *s);
void seq_set_sketch_reserved(seq *s, size_t bytes);

/* Fresh pool blocks the new tokens of an append of `count` take (the
 * policy's step at the append aside): per list, what the tail block's
 * never-written slots cannot hold. For per-session quotas, checked before
 * anything changes. */
uint64_t seq_append_blocks(const seq *s, uint32_t count);

/* Tokens of list (layer, head) stored in each tier. */
void seq_list_tier_tokens(const seq *s, uint32_t layer, uint32_t head,
                          uint32_t tokens[POLICY_TIERS]);

/* What a Revive asks for: positions [first, first + count) (count 0: to
 * the end) of list (layer, head); with skip_evicted, positions evicted
 * outright are left out instead of refused. With in_place, tokens the
 * list holds at full precision are not copied: the answer's segments name
 * the list's own slots for them (read where they are, as the worker's
 * table names them: retired, not freed, until the worker acks a later
 * epoch), and scratch slots only for the tokens rebuilt. */
typedef struct seq_revive_request {
    uint32_t layer, head, first, count;
    int skip_evicted;
    int in_place;
} seq_revive_request;

/* What a Revive rebuilt: the segments of its tokens in list layout (the
 * scratch blocks', and with in_place the list's own for the tokens read
 * where they are), each token's position and its tier before the revive,
 * and the scratch blocks, which the caller now owns and frees with
 * pool_free_block. The arrays are malloc'd and the caller's. */
typedef struct seq_revived {
    kv_segment *segs;
    size_t nsegs;
    uint32_t *positions;
    uint8_t *src_tier;
    size_t ntokens;
    uint32_t *blocks;
    size_t nblocks;
} seq_revived;

/*
 * Revive (the RPC): rebuild the request's positions of the list in full
 * precision into fresh blocks of the pool: held tokens and offloaded
 * victims (raw copied, or with in_place read where they are; INT8
 * dequantised, sketch queried), in position order; the sketch is not
 * changed. Tokens evicted outright cannot come
 * back: FAILED_PRECONDITION naming them, unless skip_evicted. *out is
 * zeroed on failure.
 */
status_code seq_revive(seq *s, const seq_revive_request *req, seq_revived *out, status *st);

/*
 * seq_revive in three parts, so that the copy can run without the store's
 * lock (issue 16 §3: a Revive must not stall other sequences):
 * seq_revive_plan checks the request as seq_revive does, takes the scratch
 * blocks from the pool and chooses the sources; seq_revive_fill copies,
 * reading only s's lists and the pool's memory and writing only the plan's
 * blocks, so it may run while other sequences change, as long as nothing
 * changes s or frees its pool meanwhile; seq_revive_finish hands out the
 * result (fill_rc 0) or gives the blocks back (the fill failed: out of
 * memory), and frees the job. Plan and finish need what guards the pool.
 */
typedef struct seq_revive_job seq_revive_job;
status_code seq_revive_plan(seq *s, const seq_revive_request *req, seq_revive_job **job,
                            status *st);
size_t seq_revive_blocks(const seq_revive_job *job); /* the scratch blocks it took */
int seq_revive_fill(seq_revive_job *job);
status_code seq_revive_finish(seq_revive_job *job, int fill_rc, seq_revived *out, status *st);

/*
 * What a Revive needs from the remote tier (seq_revive_plan, for victims a
 * spill sent there): one spilled block per part, read into a scratch block
 * the plan took. Between plan and fill, the caller fetches each part's value
 * (remote_value.h: kind TOKENS, `tier`, list (layer, head), the positions
 * below, payload one pool block) and hands its payload to
 * seq_revive_supply, which writes it into that block, or into a sketch of
 * the list's geometry for a spilled sketch (-1: a backend error, or len
 * not the part's bytes). Parts not supplied leave fill's result undefined,
 * so a caller that cannot fetch one ends with seq_revive_finish(fill_rc
 * -1).
 */
typedef struct seq_remote_part {
    uint32_t part; /* the key's part: "v<part>" (seq_spill_key_part) */
    uint8_t tier;  /* of its slots; POLICY_SKETCH: sketch cells */
    uint32_t layer, head;
    const uint32_t *positions; /* [npositions] the victims it holds, ascending */
    size_t npositions;
    size_t bytes; /* its payload: one pool block, or the list's sketch cells */
} seq_remote_part;
size_t seq_revive_remote(const seq_revive_job *job, const seq_remote_part **parts);
int seq_revive_supply(seq_revive_job *job, size_t i, const uint8_t *payload, size_t len);
/* The sequence a job reads (for its remote keys). */
seq *seq_revive_seq(const seq_revive_job *job);

/*
 * Spilling victims to the remote tier (issue 17; docs/remote.md "Spill and
 * revive"). Victims are kept out of the lists, never in a table:
 * victims=int8 keeps them in whole INT8 blocks written once, victims=sketch
 * in the list's count-sketch. Both can leave for the remote tier: the
 * victims stay offloaded (Revive brings them back, seq_revive_remote), but
 * their bytes live there under part "v<part>" of the sequence's remote
 * uid: a victim block, or a list's sketch cells (only a list whose sketch
 * holds victims alone: a sketch the policy reads on its steps stays). A
 * spilled sketch is frozen there; the list's next victims go into a fresh
 * sketch, and a victim is read back from the sketch it went into. In
 * three steps, like an export: seq_spill_plan (lock held) names every
 * victim block and such sketch with a fresh part number; seq_spill_read
 * copies them into host memory (with nothing changing s, the lock may be
 * let go); the caller writes the values without the lock, then
 * seq_spill_commit (lock held) frees each planned block or sketch whose
 * victims are still the plan's (memory pressure may have dropped a block
 * meanwhile: seq_drop_victim_blocks; a step may have added victims to a
 * sketch) and marks its victims remote. A spilled victim's tier_token
 * keeps its tier and slot; its block is SEQ_REMOTE_BLOCK | part.
 */
#define SEQ_REMOTE_BLOCK 0x80000000u
#define SEQ_REMOTE_UID_CAP 33 /* remote_value.h REMOTE_UID_LEN + 1 */

typedef struct seq_spill_block {
    uint32_t layer, head;
    uint32_t block; /* the pool block; TIER_NO_BLOCK for a sketch */
    uint8_t tier;   /* of its slots; POLICY_SKETCH: the list's sketch cells */
    uint32_t part;
    uint32_t *positions; /* [npositions] its victims, ascending */
    size_t npositions;
    size_t offset, bytes; /* its bytes in seq_spill_read's host copy */
    int committed;        /* set by seq_spill_commit: the block or cells left */
} seq_spill_block;

typedef struct seq_spill {
    seq_spill_block *blocks;
    size_t n;
    size_t bytes; /* of seq_spill_read's host copy */
} seq_spill;

/* The remote uid of s's spilled parts ("" before the first spill); the
 * caller sets it once (remote_value.h remote_uid_new). */
const char *seq_remote_uid(const seq *s);
void seq_set_remote_uid(seq *s, const char *uid);
/* Victim blocks and victims-only sketches s holds in memory: what a spill
 * would take now. */
size_t seq_spill_candidates(const seq *s);
/* Parts ever planned: keys "v0" .. "v<n-1>" may exist. */
uint32_t seq_spill_parts(const seq *s);
/* Victims now in the remote tier, the pool blocks they left, and the
 * bytes of their parts there (blocks and sketch cells). */
uint64_t seq_spilled_tokens(const seq *s);
uint64_t seq_spilled_blocks(const seq *s);
uint64_t seq_spilled_bytes(const seq *s);
/* Part number p's key part, "v<p>", into out (room for 12). */
void seq_spill_key_part(uint32_t part, char out[12]);

/* Plan a spill of every victim block and victims-only sketch of s (*out
 * zeroed first; n 0 when there is none). RESOURCE_EXHAUSTED when out of memory; FAILED_PRECONDITION
 * when the part numbers ran out. */
status_code seq_spill_plan(seq *s, seq_spill *out, status *st);
/* Copy the plan's blocks and sketches into host[0..p->bytes). 0, or -1 (a
 * backend error). */
int seq_spill_read(seq *s, const seq_spill *p, uint8_t *host);
/* Free the planned blocks whose victims are still the plan's; sets their
 * `committed`. Needs no memory and cannot fail. */
void seq_spill_commit(seq *s, seq_spill *p);
void seq_spill_free(seq_spill *p);

/* The tier report: the tier moves (moved[], requantized, victims_dropped)
 * and their measurements since the last seq_tier_report_clear. The store
 * hands it to metrics_tiers (metrics.h), then clears it. */
const snapshot_tiers *seq_tier_report(const seq *s);
void seq_tier_report_clear(seq *s);

/* Floats a step must carry for `arrays` given the current lists (the
 * layout: proto/kvstash_step.h); (size_t)-1 when out of memory. */
size_t seq_step_floats(seq *s, unsigned arrays);

/*
 * A sequence as plain data, to move it to another daemon (issue 17,
 * docs/remote.md "Export and import"): everything seq_import needs to
 * rebuild it in another pool of the same geometry, but the bytes of its
 * blocks, which the caller copies. The export numbers the blocks it names
 * 0 .. nblocks-1 (blocks[i] is this pool's id of export block i; a block
 * belongs to one list and holds one tier); every tier_token and block
 * index below is in that numbering. Retired blocks are not part of it
 * (the worker's old tables are this daemon's business).
 */
typedef struct seq_export_list {
    uint32_t ntokens;
    uint32_t *positions; /* [ntokens] ascending: the host's list */
    uint8_t *tiers;      /* [ntokens] the host's tiers (what the policy decided) */
    float *attn;         /* [ntokens] demote_keep's attention; NULL when the policy has none */
    tier_token *at;      /* [ntokens] where each is stored (block: export index) */
    size_t nvictims;
    uint32_t *victims;     /* [nvictims] offloaded positions, ascending */
    tier_token *victim_at; /* [nvictims] where each is kept (block: export index) */
    size_t nvictim_blocks;
    uint32_t *victim_blocks; /* [nvictim_blocks] export indices, oldest first */
    int has_tail;
    uint32_t tail_block; /* export index */
    uint32_t tail_next_slot;
    uint8_t demote_due;
    /* The list's count-sketch (tier.h tier_sketch), 0 bytes when it has none:
     * its cells as tier_sketch_save writes them (key floats, value floats,
     * counts), sketch_bytes of them. A token or victim in it has tier
     * POLICY_SKETCH, block TIER_NO_BLOCK and slot 0. */
    size_t sketch_bytes;
    uint8_t *sketch; /* [sketch_bytes]; describe allocates it, seq_export_read_sketches fills it */
} seq_export_list;

typedef struct seq_export {
    char policy[64];
    policy_params params; /* resolved; keys point into the policy's static specs */
    char label[129];
    uint64_t appended;  /* tokens ever appended */
    uint32_t unstepped; /* appended since the policy's last step */
    uint64_t host_steps;
    uint64_t moved[POLICY_TIERS], requantized, victims_dropped;
    uint32_t layers, heads; /* lists: layers * heads, list (l, k) at l * heads + k */
    seq_export_list *lists;
    /* [layers] each layer's policy state (policy_host_export_state: the
     * policy's own bytes), state_len[l] bytes; NULL for a policy that keeps
     * none (no export_layer). */
    uint8_t **states;
    size_t *state_len;
    size_t nblocks;
    uint32_t *blocks;     /* [nblocks] this pool's block ids */
    uint8_t *block_tier;  /* [nblocks] the tier its slots hold */
    uint32_t *block_list; /* [nblocks] the list it belongs to */
} seq_export;

/* Describe s (its lists, victims, tails, counters, its policy's state,
 * which lists have a sketch and its size) into *out. Refuses with
 * FAILED_PRECONDITION what it cannot carry yet: a policy whose state cannot
 * be written out (policy_host_portable), victims spilled to the remote tier.
 * RESOURCE_EXHAUSTED when out of memory. *out is the caller's:
 * seq_export_free. The sketches' host buffers are allocated but not
 * filled: seq_export_read_sketches, as the blocks' bytes are the caller's
 * (pool_read_blocks). */
status_code seq_export_describe(seq *s, seq_export *out, status *st);
/* Copy s's sketch cells into x's lists (x: s's seq_export_describe, s not
 * changed since). Reads only s's memory: the store runs it with
 * pool_read_blocks, s marked moving. 0, or -1 (a backend error). */
int seq_export_read_sketches(seq *s, seq_export *x);
void seq_export_free(seq_export *x);

/*
 * Rebuild a sequence on `pool` from x: a new sequence (seq_create with x's
 * policy and parameters) whose lists, victims, tails and counters are x's,
 * with export block i at pool block blocks[i] (taken by the caller from
 * `pool`, their bytes already written; on success the sequence owns them,
 * on failure the caller still does), and each list's sketch allocated with
 * the policy's geometry (list_sketch_ready) and x's cells loaded into it
 * (tier_sketch_load). Checks x against itself (positions ascending and
 * below appended, every token's block of its list and tier, slots in range,
 * no slot used twice, sketch tokens only in a list with a sketch) and the
 * pool's geometry (a sketch's size is the one its policy's geometry makes
 * here): INVALID_ARGUMENT naming what is wrong, nothing created;
 * RESOURCE_EXHAUSTED when out of memory. Epoch 1. Reserving the sketches'
 * daemon memory is the caller's (store_sketch_reserve_locked).
 */
status_code seq_import(uint64_t id, uint64_t session_id, pool *pool, const seq_export *x,
                       const uint32_t *blocks, seq **out, status *st);

#endif
