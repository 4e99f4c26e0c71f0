/*
 * seq_internal.h - what the files of the seq module share (seq.c,
 * seq_list.c, seq_apply.c, seq_revive.c): the sequence's structure and the
 * list helpers. Nothing outside daemon/seq*.c includes it: seq.h is the
 * module's interface, and struct seq is opaque behind it.
 */
#ifndef KVSTASH_SEQ_INTERNAL_H
#define KVSTASH_SEQ_INTERNAL_H

#include <string.h>

#include "seq.h"

enum { SEQ_DUE_TIERS = 1, SEQ_DUE_VICTIMS = 2 };

typedef struct seq_list {
    kv_segment *segs;
    uint8_t
        *seg_tier; /* [nsegs] how segment i is stored: POLICY_FULL, _INT8, _INT4, _INT2, _SKETCH */
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
    /* Of them, those still at full precision (victims=int8 quantises them
     * a block's worth at a time): a step that adds a victim tells from it
     * whether a block's worth waits, instead of reading every victim. */
    size_t nfull_victims;
    /* The INT8 blocks victims=int8 wrote for victims, oldest first: never in
     * a table, so memory pressure frees them at once (seq_append). */
    uint32_t *victim_blocks;
    size_t nvictim_blocks, victim_blocks_cap;
    uint64_t saved_generation; /* the transaction that saved it last (seq_txn.c) */
    /* A step left a whole quantised block's worth of tokens decided
     * quantised but stored at full precision (SEQ_DUE_TIERS), or of
     * victims at full precision (SEQ_DUE_VICTIMS), for seq_demote_plan;
     * another nonzero value (an import's) may be either. */
    uint8_t demote_due;
    /* At least as many blocks as the segments use (list_grow counts each it
     * takes, list_cut_rebuild counts them all), or SEQ_BLOCKS_UNKNOWN after
     * anything else rewrote the segments. While it is under list_compact's
     * rule, no compaction can be due and an eviction cuts in place
     * (seq_apply.c list_apply_evictions), however split the segments are. */
    uint32_t blocks_at_most;
    /* Where the list's next compaction window starts (an index into the
     * list; a hint, any value is safe: seq_apply.c list_compact). */
    uint32_t compact_next;
} seq_list;

#define SEQ_BLOCKS_UNKNOWN UINT32_MAX

/* Whether a victim is stored in the remote tier (seq.h SEQ_REMOTE_BLOCK:
 * its block names a spilled part, not a pool block; a sketch victim's is
 * TIER_NO_BLOCK while it is in the list's sketch). */
static inline int tier_token_remote(const tier_token *t)
{
    return t->block != TIER_NO_BLOCK && (t->block & SEQ_REMOTE_BLOCK) != 0;
}

/* Whether a victim is in the list's own sketch (not a spilled one). */
static inline int tier_token_local_sketch(const tier_token *t)
{
    return t->tier == POLICY_SKETCH && t->block == TIER_NO_BLOCK;
}

/* What the running step cut out of the lists (seq.h seq_step_cuts). */
typedef struct seq_cut_log {
    int valid;
    uint64_t from_epoch;
    uint32_t *count, *first; /* [nlists], allocated at the first step */
    uint32_t *idx;
    size_t n, cap;
} seq_cut_log;

/* Start the log of a step that begins at the current epoch. */
void seq_cuts_begin(seq *s);

/* seq_end's part that is not the policy host's: the pool's savepoint
 * released (one per pool: another sequence may take it as soon as the
 * store's lock is let go; none while detached) and the storage's saved
 * state dropped. The
 * host's transaction stays open until policy_host_end. */
void seq_end_storage(seq *s);

/* seq_rollback's part that is not the policy host's: the storage as it
 * was at seq_begin, the host's transaction still open. */
void seq_rollback_storage(seq *s);

/* seq_apply_decision without the host's commit: the storage follows the
 * decision, the host's lists stay as the decision saw them until the
 * caller commits (policy_host_commit), which cannot fail. */
status_code seq_apply_storage(seq *s, uint32_t l, const policy_decision *d, uint64_t epoch,
                              int *changed, status *st);

/* What the last demotion moved (seq.h seq_demotion_moves). */
typedef struct seq_move_log {
    int valid;
    uint64_t from_epoch, to_epoch;
    seq_moved_run *runs;
    size_t n, cap;
} seq_move_log;

typedef struct seq_saved_list seq_saved_list;
typedef struct seq_saved_tokens seq_saved_tokens;

/* The running call's transaction (seq_txn.c; seq.h seq_begin): the
 * counters as they were, the lists and token bytes saved since. */
typedef struct seq_txn {
    int active;
    uint64_t generation; /* counts transactions: which lists are saved */
    uint64_t epoch, appended;
    uint32_t unstepped;
    uint64_t moved[POLICY_TIERS], requantized, victims_dropped;
    size_t nretired;
    uint64_t report_moved[POLICY_TIERS], report_requantized, report_victims_dropped;
    size_t report_nobs;
    seq_saved_list *lists;
    size_t nlists, lists_cap;
    seq_saved_tokens *tokens;
    size_t ntokens, tokens_cap;
} seq_txn;

/*
 * A sequence's blocks while it is detached from its pool (seq_blocks.c;
 * seq.h seq_detach): a step that applies a long decision does so without
 * the store's lock, so it must not touch the pool, which other sequences'
 * calls change under that lock. It takes blocks from `reserve`, taken
 * from the pool under the lock beforehand, and what it gives back waits in
 * `given` until seq_attach returns both. A transaction (seq_txn.c) saves
 * both counts in place of the pool's savepoint.
 */
typedef struct seq_reserve {
    int on;
    int short_of;     /* a take found the reserve empty (seq_take_block) */
    uint32_t *blocks; /* reserve[0 .. n) free; taken from the top */
    uint32_t n, cap;  /* cap: as taken from the pool */
    uint32_t *given;  /* given[0 .. ngiven) */
    size_t ngiven, given_cap;
    uint32_t txn_n; /* at seq_begin */
    size_t txn_ngiven;
} seq_reserve;

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
    uint64_t moved[POLICY_TIERS]; /* tokens ever moved, by the tier they went to */
    uint64_t requantized;         /* quantised tokens re-quantised by compaction (§5.4) */
    uint64_t victims_dropped;     /* victims=int8 victims freed under memory pressure */
    snapshot_tiers report;        /* seq_tier_report */
    seq_txn txn;
    seq_reserve detached;
    /* A bit per block of the pool, for counting distinct blocks without
     * allocating (seq_mark); whoever marks clears every mark again. The
     * sequence's own: it marks only its own blocks, and may do so outside
     * the store's lock while another sequence marks its own. */
    uint8_t *marks;
    seq_cut_log cuts;
    seq_move_log moves;
    size_t sketch_reserved;  /* daemon memory the store reserved for the sketches (seq.h) */
    int demote_after_step;   /* seq.h seq_set_demote_after_step */
    int stepping;            /* inside seq_step (not an Append's step, nor an operator's move) */
    uint64_t compacted;      /* tokens list_compact copied in this call (seq_begin: 0) */
    uint64_t compact_budget; /* and may copy beyond its first list (SEQ_COMPACT_TOKENS) */
    uint32_t compact_window; /* full-precision tokens one compaction copies at most (too) */
    /* Between seq_step_plan and the end of seq_step_finish the policy host
     * is the decision's and then its commit's, which may run without the
     * store's lock: seq_tokens_held answers held_deciding, the lists'
     * tokens at the plan. */
    int deciding;
    uint64_t held_deciding;
    /* The remote tier (seq.h "Spilling victims"): the uid of its keys ("" until
     * the first spill), the parts ever planned (numbered 0 .. spill_parts-1,
     * some never written), the victims now stored there. */
    char remote_uid[SEQ_REMOTE_UID_CAP];
    uint32_t spill_parts;
    uint64_t spilled_tokens, spilled_blocks, spilled_bytes;
} seq;

/* Set block's bit in a bitmap of blocks; 1 if it was clear, 0 if set. */
static inline int block_mark(uint8_t *marks, uint32_t block)
{
    uint8_t bit = (uint8_t)(1u << (block % 8)), *byte = &marks[block / 8];
    int was_clear = !(*byte & bit);
    *byte |= bit;
    return was_clear;
}

static inline void block_unmark(uint8_t *marks, uint32_t block)
{
    marks[block / 8] &= (uint8_t) ~(1u << (block % 8));
}

/* The same in the sequence's marks. They are scratch, not the sequence's
 * state: a const sequence may mark. */
static inline int seq_mark(const seq *s, uint32_t block)
{
    return block_mark(s->marks, block);
}

static inline void seq_unmark(const seq *s, uint32_t block)
{
    block_unmark(s->marks, block);
}

/* seq_detach leaves a sequence attached unless its pool has this many
 * times the reserve free. */
#define SEQ_DETACH_FREE_FACTOR 4u

/* Whether a detached sequence's take found its reserve empty since
 * seq_detach (the work then needs the lock: seq.h SEQ_WORK_NEEDS_LOCK). */
int seq_detached_short(const seq *s);

/* A block of the sequence's pool (or of its reserve while detached): 0,
 * or -1 when there is none. Give it back with seq_give_block. */
int seq_take_block(seq *s, uint32_t *block);

/* Give a block back to the pool (while detached: at seq_attach). */
void seq_give_block(seq *s, uint32_t block);

/* Blocks seq_take_block can take now. */
uint32_t seq_free_blocks(const seq *s);

/* The transaction's part of the blocks (seq_txn.c): where the pool's
 * savepoint is taken, released and rolled back, or the reserve's counts
 * while detached. */
void seq_blocks_begin(seq *s);
void seq_blocks_end(seq *s);
void seq_blocks_rollback(seq *s);

/* Tokens a call's compactions copy, beyond its first list
 * (seq_apply.c list_compact): the lists of a sequence evict in step, so they
 * come due at the same step, and copying all of them there (a whole
 * 32-layer context at once) stalled that step for hundreds of
 * milliseconds; a list over the budget is compacted at a later call
 * instead, its slack exceeded meanwhile by a block or two. */
#define SEQ_COMPACT_TOKENS 4096u

static inline size_t seq_nlists(const seq *s)
{
    return (size_t)s->nlayers * s->heads;
}

/* List (layer l, KV head k; k = 0 for all-heads lists): the one place the
 * lists' index is computed. */
static inline seq_list *seq_list_at(const seq *s, uint32_t l, uint32_t k)
{
    return &s->lists[(size_t)l * s->heads + k];
}

/* Whether every segment of the list is stored at full precision: eight
 * tiers a test, without an early exit (every decode step asks it of every
 * list, thousands of segments each at long contexts; the daemon's -O2
 * does not vectorise a loop a byte at a time). */
static inline int seq_list_all_full(const seq_list *ly)
{
    const uint8_t *tier = ly->seg_tier;
    size_t n = ly->nsegs, i = 0;
    uint64_t other = 0, full = UINT64_C(0x0101010101010101) * POLICY_FULL;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, tier + i, sizeof w);
        other |= w ^ full;
    }
    for (; i < n; i++)
        other |= (uint8_t)(tier[i] ^ POLICY_FULL);
    return other == 0;
}

/* qsort's comparison of uint32_t. */
int seq_cmp_u32(const void *a, const void *b);

/* Sort and drop repeats; returns the new count. */
size_t seq_sort_unique(uint32_t *a, size_t m);

/* The blocks (with repeats) of a list's segments and offloaded victims
 * stored in `tier` (any tier with a block when tier < 0), written from
 * out[0] (room for nsegs + noffloaded). */
size_t list_fill_block_ids(const seq_list *ly, int tier, uint32_t *out);

/* The distinct blocks of a list's segments and offloaded victims stored in
 * `tier` (any tier with a block when tier < 0), counted without allocating
 * (seq_mark: s is the list's sequence). */
uint32_t list_count_blocks(const seq_list *ly, int tier, const seq *s);

/* Give every block of a list being destroyed back to p, needing no memory:
 * its segment and victim arrays serve as scratch and are left empty. */
void list_free_blocks(seq_list *ly, pool *p);

int seq_grow(void **arr, size_t *cap, size_t need, size_t elt);

int list_reserve(seq_list *ly, size_t nsegs);

int seq_retire(seq *s, uint32_t block, uint64_t epoch);

int list_tail_usable(const seq_list *ly, uint32_t block_slots);

/* Expand a list's segments into one entry per token. */
tier_token *list_expand(const seq_list *ly, uint32_t n);

/* Rebuild a list's segments from per-token storage (runs of one tier in one
 * block with consecutive slots; sketch runs have no block). */
int list_encode(seq_list *ly, const tier_token *tok, uint32_t n);

/* Append run g to segs[0..n), joined to the last segment when it
 * continues it (the next slots of the same block), as list_encode joins
 * tokens of one tier; returns the new count. */
static inline size_t seq_push_run(kv_segment *segs, size_t n, kv_segment g)
{
    kv_segment *last = n > 0 ? &segs[n - 1] : NULL;
    if (last != NULL && last->block == g.block && last->first_slot + last->count == g.first_slot) {
        last->count += g.count;
        return n;
    }
    segs[n] = g;
    return n + 1;
}

/* Append run g of tier t to segs[0..n) (their tiers in tiers[]), joined to
 * the last one when it continues it: the same tier, and the next slots of
 * the same block (any sketch run continues a sketch run). The one rule of
 * maximal segments (list_encode). Returns the new count. */
static inline size_t list_push_run(kv_segment *segs, uint8_t *tiers, size_t n, kv_segment g,
                                   uint8_t t)
{
    int sketch = t == POLICY_SKETCH;
    kv_segment *last = n > 0 && tiers[n - 1] == t ? &segs[n - 1] : NULL;
    if (last != NULL &&
        (sketch || (last->block == g.block && last->first_slot + last->count == g.first_slot))) {
        last->count += g.count;
        return n;
    }
    segs[n] = sketch ? (kv_segment){TIER_NO_BLOCK, 0, g.count} : g;
    tiers[n] = t;
    return n + 1;
}

/* The blocks the tokens and the list's offloaded victims use (and the tail
 * block, with_tail), written from out[0] (room for n + noffloaded + 1):
 * unsorted, with repeats, though a block's run of tokens gives one id. */
size_t list_block_ids(const seq_list *ly, const tier_token *tok, uint32_t n, int with_tail,
                      uint32_t *out);

/* A never-written full-precision slot at the list's tail (a new block when
 * the tail is full). Returns -1 when the pool has no free block. */
int list_take_slot(seq *s, seq_list *ly, tier_token *out);

int list_sketch_ready(seq *s, seq_list *ly, uint32_t layer);

/* The move-error sample of tokens idx[0..m) of tok (tier.h
 * tier_error_sample), FULL or quantised, before they move: their indices
 * into tok in sidx[0..*ns), their values staged into *stage (free with
 * tier_stage_free). Returns 0, or -1 out of memory. */
int seq_stage_error_sample(seq *s, const tier_token *tok, const uint32_t *idx, size_t m,
                           uint32_t sidx[TIER_ERROR_SAMPLE], size_t *ns, uint8_t **stage);

/* Count n tokens moved to tier t (moved[]) in the totals and the report. */
void seq_moved(seq *s, uint8_t t, uint64_t n);

/* Quantise tokens idx[0..m) of tok (FULL, or quantised read back
 * dequantised) into blocks qb[0..nq) of quantised tier qt, a block's worth
 * to a block and the last one partial: the tokens become qt tokens of those
 * blocks, and *ratio is the round trip's error (-1 when it could not be
 * measured). Reads s's pool memory, writes only qb's blocks and tok; the
 * caller took the blocks. */
int seq_quantize_into(seq *s, uint8_t qt, tier_token *tok, const uint32_t *idx, size_t m,
                      const uint32_t *qb, size_t nq, double *ratio);

/* Copy a list's full-precision tokens of kept[0..n) (its tokens, as they
 * will be) into fresh blocks when they are spread over too many
 * (seq_apply.c); kept[] then names the copies. Skipped when the pool lacks
 * the blocks. Returns -1 when out of memory or on a device error. */
int list_compact(seq *s, seq_list *ly, tier_token *kept, uint32_t n);

/* Whether list_compact's rule holds for the list as its segments are: its
 * full-precision tokens in more blocks than they fill plus the slack. A
 * list it would leave alone need not be expanded for it. */
int list_compact_due(seq *s, const seq_list *ly);

/* Retire at `epoch`, once each, the blocks of `before` that `after` lacks
 * (both with repeats, in any order): the blocks a list used before a change
 * and does not use after. The tail is forgotten when it goes. */
int list_retire_unused(seq *s, seq_list *ly, const uint32_t *before, size_t nb,
                       const uint32_t *after, size_t na, uint64_t epoch);

/* Keep a victim out of the list, stored at `at`. */
int list_offload_push(seq_list *ly, uint32_t position, tier_token at);

/* Free the oldest victim block of each list (memory pressure, seq_append):
 * its victims are gone for good. Returns the blocks freed. */
uint32_t seq_drop_victim_blocks(seq *s);

/* Save, in the running transaction (nothing outside one), what is about
 * to change: list ly (once per transaction), the cells of its sketch that
 * positions pos[0..n) touch (or the whole sketch, seq_txn.c), the bytes of
 * n full-precision token slots written in place. Each returns 0, or -1 when out
 * of memory (nothing changed: the caller fails before its change). */
int seq_txn_save_list(seq *s, seq_list *ly);

/* seq_txn_save_list when the call changes none of the list's victims
 * before index `from` (it may add victims after them, or change later
 * ones): only the victims from there on are copied, not every victim a
 * long decode has kept (victims=int8 and =sketch keep all of them), at
 * every step. A later save of the same call from an earlier index copies
 * the rest. */
int seq_txn_save_list_from(seq *s, seq_list *ly, size_t from);

/* seq_txn_save_list_from(s, ly, ly->noffloaded) for a change that only
 * replaces the list's segments [first, first + nold) with nout others
 * (list_apply_cuts): those nold are saved, not every segment of the list
 * (a decode step cuts one token of thousands out of every list). Any other
 * change saves the list as before, its copy made from these. */
int seq_txn_save_cut(seq *s, seq_list *ly, size_t first, size_t nold, size_t nout);
int seq_txn_save_sketch(seq *s, seq_list *ly, const uint32_t *pos, size_t n);
int seq_txn_save_tokens(seq *s, const tier_token *at, size_t n);

/* Free what the transaction keeps between calls (seq_destroy). */
void seq_txn_free(seq *s);

uint32_t list_blocks_needed(uint32_t count, uint32_t room, uint32_t block_tokens);

/* Put `count` new tokens at the list's tail; blocks were checked free. */
size_t list_grow(seq *s, seq_list *ly, uint32_t count, kv_segment *writes);

#endif
