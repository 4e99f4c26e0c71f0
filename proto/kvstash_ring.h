/*
 * kvstash_ring.h - the per-step data plane: one shared-memory ring per session.
 *
 * gRPC costs ~70-100 µs a call here (C-STACK.md); a decode step cannot pay
 * that. So each session gets a memfd (from the fd socket: `RING`) holding one
 * request slot, one response slot and a data area, with futex doorbells. The
 * worker writes a request (and its statistics into the data area), bumps
 * req_seq and wakes the daemon; the daemon's ring thread for the session
 * handles it, writes the response, bumps resp_seq and wakes the worker. One
 * request is in flight at a time per session (a decode step is sequential).
 * Both sides spin briefly before sleeping on the futex, which is what keeps
 * the round trip near a raw socket's on two cores.
 *
 * Everything is little-endian host layout; both sides are on one host.
 * A side about to sleep sets its *_waiting flag, re-checks the counter, then
 * sleeps; the other side bumps the counter, then wakes it only if the flag is
 * set (sequentially consistent atomics on both sides: no lost wake-up, and no
 * futex syscall while the peer is still spinning). When the session ends the
 * daemon sets `closing` and wakes both futexes.
 *
 * The worker can write every byte of this header, so the daemon trusts none
 * of it: it never reads magic, bytes or `closing` back (its thread stops on
 * a flag of its own), bounds each futex sleep (50 ms), reads the request
 * once into private memory and checks every field there, and treats any
 * change of req_seq as one more request. A worker that scribbles on the
 * header can only get wrong answers or none, on its own session.
 */
#ifndef KVSTASH_RING_H
#define KVSTASH_RING_H

#include <stdint.h>

#define RING_MAGIC 0x6b767372696e6732ull /* "kvsring2" */
#define RING_BYTES_DEFAULT (8u << 20)    /* header + data area */
#define RING_MSG_LEN 256                 /* = STATUS_MSG_LEN */

typedef enum ring_op {
    RING_OP_PING = 1,   /* nothing: measures the round trip */
    RING_OP_APPEND = 2, /* room for `count` tokens; writes go to the data area */
    RING_OP_STEP = 3,   /* the step's statistics are in the data area */
    RING_OP_EPOCH = 4,  /* only report the sequence's table epoch */
    RING_OP_REVIVE = 5, /* Revive: ring_revive_request in, ring_revive_reply out (data area) */
    RING_OP_RELEASE_SCRATCH = 6, /* ReleaseScratch: a uint64 scratch id in, uint32 freed out */
    RING_OP_TABLE = 7, /* GetBlockTable: ring_table_request in, the table out (data area) */
} ring_op;

/*
 * REVIVE and RELEASE_SCRATCH carry gRPC's Revive and ReleaseScratch
 * (store.proto) through the ring, for a worker that revives a few tokens a
 * step: a round trip of microseconds, not gRPC's 100. The request is the
 * struct below at the start of the data area (data_bytes its size); the
 * REVIVE answer is a ring_revive_reply there, followed by uint32
 * block[nsegments], first_slot[nsegments], count[nsegments],
 * positions[tokens], then uint8 source_tier[tokens] (policy tiers). An
 * answer that would not fit the data area is refused (RESOURCE_EXHAUSTED)
 * and its scratch released: use gRPC's Revive.
 */
typedef struct ring_revive_request {
    uint32_t layer, head, first, count; /* count 0: to the end of the list */
    uint32_t skip_evicted, in_place;    /* ReviveRequest's */
} ring_revive_request;

typedef struct ring_revive_reply {
    uint64_t scratch_id; /* 0: an in-place Revive that took no scratch */
    uint32_t layer, head, per_head, tokens, nsegments;
    uint32_t pad;
    uint64_t epoch; /* ReviveResponse's */
} ring_revive_reply;

/*
 * TABLE carries gRPC's GetBlockTable through the ring: a worker whose
 * policy evicts every step reloads its table every step, and at 32k tokens
 * the table's positions through protobuf and gRPC cost as much as the step
 * (docs/bench.md, "A table through the ring"). The request is seq_id and
 * ack_epoch in ring_request and a ring_table_request at the start of the
 * data area; the epoch is in ring_response. The answer is a
 * ring_table_reply in the data area, then for each list (layer-major, as
 * GetBlockTable's layers) a ring_table_list followed by uint32
 * block[nsegments], first_slot[nsegments], count[nsegments],
 * positions[npositions], then uint8 tier[nsegments] (policy tiers), padded
 * to 4 bytes. A table that would not fit the data area is refused
 * (RESOURCE_EXHAUSTED) before anything is built: use gRPC's GetBlockTable.
 */
typedef struct ring_table_request {
    uint32_t with_positions;
    uint32_t pad;
} ring_table_request;

typedef struct ring_table_reply {
    uint64_t bytes; /* of the whole answer, this struct included */
    uint32_t nlists;
    uint32_t pad;
} ring_table_reply;

typedef struct ring_table_list {
    uint32_t layer, head, per_head, tokens, nsegments, npositions;
    uint32_t int8_block_tokens, int4_block_tokens, int2_block_tokens, quant_group;
} ring_table_list;

/*
 * STEP's answer, when removing tokens was all the step did to the lists
 * (ring_response.cuts = 1; daemon/seq.h seq_step_cuts): a ring_step_cuts
 * at the start of the data area, then uint32 count[nlists], then uint32
 * idx[total]. List i (layer-major, as the table) lost count[i] tokens,
 * whose indices in the list as it was at from_epoch are the next count[i]
 * of idx, ascending. A worker that holds the table of from_epoch cuts them
 * out and has the table of the answer's epoch without a TABLE round trip
 * (at 32k tokens × 32 layers the table is megabytes, the cuts of a decode
 * step 32 indices). Cuts that would not fit the data area are not written
 * (cuts = 0): read the table.
 */
typedef struct ring_step_cuts {
    uint64_t from_epoch;
    uint32_t nlists, total;
} ring_step_cuts;

/*
 * APPEND's answer, when a demotion published since the worker's ack_epoch
 * only moved runs of tokens to other storage (ring_response.moves = 1;
 * daemon/seq.h seq_demotion_moves): after the writes, a ring_append_moves
 * (8-byte aligned), then nruns ring_moved_run. Run i: tokens [first, first
 * + count) of list `list` (layer-major, as the table; indices, positions
 * and order unchanged) are now slots [first_slot, first_slot + count) of
 * `block`, stored in `tier` (LayerTable.tier). A worker that holds the
 * table of from_epoch applies them and has the table of to_epoch, which
 * the append's writes extend: a demotion every INT8 block's worth of
 * decode steps is a few runs a list, not a table of megabytes.
 */
typedef struct ring_append_moves {
    uint64_t from_epoch, to_epoch;
    uint32_t nruns, pad;
} ring_append_moves;

typedef struct ring_moved_run {
    uint32_t list, first, count, block, first_slot, tier;
} ring_moved_run;

typedef struct ring_request {
    uint32_t op;
    uint32_t arrays; /* STEP: which statistics arrays it carries (kvstash_step.h STEP_*) */
    uint64_t seq_id;
    uint64_t ack_epoch;
    int64_t count;           /* APPEND: tokens to add */
    uint32_t new_tokens;     /* STEP: tokens appended since the last step (0 = all of them) */
    uint32_t prefill;        /* STEP: 1 while the prompt is processed */
    uint32_t score_queries;  /* STEP: queries summed into score */
    uint32_t window_queries; /* STEP: queries averaged into window_attn */
    double confidence;       /* STEP: c_t in [0,1], or negative */
    uint64_t data_bytes;     /* bytes of the data area this request uses */
} ring_request;

typedef struct ring_response {
    int32_t code;             /* status code (gRPC numbering, daemon/status.h) */
    uint32_t evicted;         /* tokens the policy removed (all layers) */
    uint64_t epoch;           /* the sequence's table epoch after the request */
    uint32_t first_position;  /* APPEND: position of the first new token */
    uint32_t nsegments;       /* APPEND: segments in the data area */
    uint32_t lists_per_layer; /* APPEND: 1, or kv_heads for a per-head sequence */
    uint32_t cuts;            /* STEP: 1 when the data area holds the step's ring_step_cuts */
    uint32_t moves;           /* APPEND: 1 when a ring_append_moves follows the writes */
    char msg[RING_MSG_LEN];   /* error message when code != 0 */
} ring_response;

/*
 * The shared header at offset 0 of the ring memfd; the data area follows at
 * offset RING_DATA_OFFSET. Sequence counters are 32-bit because futexes are.
 *
 * STEP data: the step's statistics arrays, laid out as kvstash_step.h
 * defines (the one definition: packed by libkvstash, parsed by kvstashd).
 * APPEND response data: per list (layer-major; one list per layer, or one
 * per KV head when lists_per_layer > 1), its segment count (uint32) then that
 * many {block, first_slot, count} uint32 triples. A per-head list's slots
 * are rows of its one head (kvstash.v1.LayerTable.per_head).
 */
typedef struct ring_header {
    uint64_t magic;
    uint64_t bytes;                 /* size of the whole mapping */
    _Alignas(64) uint32_t req_seq;  /* bumped by the worker: futex word */
    _Alignas(64) uint32_t resp_seq; /* bumped by the daemon: futex word */
    _Alignas(64) uint32_t closing;  /* set by the daemon when the session ends (a hint) */
    uint32_t daemon_waiting;        /* the daemon sleeps on req_seq: wake it */
    uint32_t worker_waiting;        /* the worker sleeps on resp_seq: wake it */
    _Alignas(64) ring_request req;
    ring_response resp;
} ring_header;

#define RING_DATA_OFFSET 4096u

#endif
