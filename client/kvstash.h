/*
 * kvstash.h - libkvstash, the library a worker links to keep its KV cache in
 * kvstashd.
 *
 * A session is one worker's attachment to one model's pool. Attach maps the
 * pool into the worker's address space; sequences are then created, grown
 * with kvs_seq_append (which says where to write K and V for each layer) and
 * read back through their block tables. All calls are blocking and a session
 * is not thread-safe: use one session per thread, or lock around it.
 *
 * Errors: every function returning int returns 0 on success or a negative
 * kvs_err code; kvs_session_error() holds the daemon's message for the last
 * failed call on that session.
 *
 * Every call to the daemon has a deadline: 10 s, or $KVSTASH_RPC_TIMEOUT_MS
 * milliseconds; a daemon that does not answer in time gives
 * KVS_ERR_UNAVAILABLE. While a call runs, the calling thread blocks its
 * asynchronous signals (so that the threads gRPC starts never take the
 * application's signals); signals that arrive meanwhile are delivered when
 * the call returns. Do not fork() and keep using a session in the child.
 */
#ifndef KVSTASH_H
#define KVSTASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvs_err {
    KVS_OK = 0,
    KVS_ERR_INVALID = -1,      /* INVALID_ARGUMENT: a value is out of range */
    KVS_ERR_NOT_FOUND = -2,    /* NOT_FOUND: no such sequence or pool */
    KVS_ERR_PERMISSION = -3,   /* PERMISSION_DENIED / UNAUTHENTICATED */
    KVS_ERR_PRECONDITION = -4, /* FAILED_PRECONDITION: e.g. geometry mismatch */
    KVS_ERR_EXHAUSTED = -5,    /* RESOURCE_EXHAUSTED: the pool is full */
    KVS_ERR_UNAVAILABLE = -6,  /* daemon not running, or shutting down */
    KVS_ERR_PROTOCOL = -7,     /* unexpected reply, or any other gRPC status */
    KVS_ERR_SYSTEM = -8,       /* a local system call failed (errno in the message) */
    KVS_ERR_DATA_LOSS = -9,    /* DATA_LOSS: a value in the remote tier is missing or corrupt */
} kvs_err;

/* A static description of an error code. */
const char *kvs_strerror(int err);

typedef enum kvs_dtype { KVS_FP16 = 1, KVS_BF16 = 2, KVS_FP32 = 3 } kvs_dtype;

typedef struct kvs_geometry {
    uint32_t layers, q_heads, kv_heads, head_dim, block_tokens;
    kvs_dtype dtype;
    float rope_theta; /* 0 = 10000 */
} kvs_geometry;

typedef struct kvs_session kvs_session;

/* The default gRPC socket path ($XDG_RUNTIME_DIR/kvstash/kvstashd.sock or
 * /run/kvstash/kvstashd.sock). Returns a static string. */
const char *kvs_default_socket(void);

/*
 * Connect to kvstashd at `socket_path` (NULL = default), identify over the fd
 * socket, Attach with `model` and `geometry`, open the lease and map the
 * pool. On failure *out is NULL and, if err is not NULL, a message is written
 * to err[errlen].
 */
int kvs_session_attach(const char *socket_path, const char *model, const kvs_geometry *geometry,
                       const char *worker_name, kvs_session **out, char *err, size_t errlen);

/*
 * kvs_session_attach into the pool of `tenant`: workers of one tenant and
 * model share a pool (one shared memory object, which each maps read-write:
 * a worker can write every block of its tenant's pool); another tenant's
 * workers get a pool of their own. tenant NULL: $KVSTASH_TENANT, or the
 * default tenant "" when unset (kvs_session_attach attaches so). A tenant
 * is "" or 1 to 64 of [A-Za-z0-9._-] (else KVS_ERR_INVALID).
 */
int kvs_session_attach_tenant(const char *socket_path, const char *tenant, const char *model,
                              const kvs_geometry *geometry, const char *worker_name,
                              kvs_session **out, char *err, size_t errlen);

/* Release every sequence, end the lease, unmap, and free the session. The
 * session is freed even when the Detach call fails (the daemon reclaims it
 * anyway when the lease and the fd socket close); the result is that call's. */
int kvs_session_detach(kvs_session *s);

/* The message of the last failed call on this session ("" if none). */
const char *kvs_session_error(const kvs_session *s);

uint64_t kvs_session_id(const kvs_session *s);
const kvs_geometry *kvs_session_geometry(const kvs_session *s);
/* Base of the pool: a device address of the pool's backend. With "host"
 * it is the mapped shared memory; with "shadow" (a test backend) and
 * device backends, reading or writing it directly faults: go through
 * kvs_session_ops (kernels/ops.h), kvs_layer_write and kvs_layer_read. */
uint8_t *kvs_session_pool(const kvs_session *s);
/* The memory operations of the pool's backend (kernels/ops.h, kv_ops):
 * what a worker uses to run kernels on, or copy into and out of, the pool
 * (kvs_key_ptr & co. are device addresses too). Owned by libkvstash. */
struct kv_ops;
const struct kv_ops *kvs_session_ops(const kvs_session *s);
/* The pool's backend, as AttachResponse.backend names it: "host", "shadow"
 * or "cuda" (GPU memory imported by CUDA IPC: kvs_session_pool and
 * kvs_key_ptr & co. are device addresses on the daemon's GPU, the device
 * kv_ops_cuda selects). A libkvstash built without CUDA refuses a cuda pool
 * at attach (KVS_ERR_PRECONDITION). Owned by the session. */
const char *kvs_session_backend(const kvs_session *s);
/* The CUDA device ordinal, in this process, of the GPU holding a cuda pool
 * (found by the UUID kvstashd sent: what torch.device("cuda", n) and
 * cudaSetDevice take); -1 for a pool in host memory. */
int kvs_session_device(const kvs_session *s);
size_t kvs_session_pool_bytes(const kvs_session *s);

/*
 * Ordering with kvstashd (it matters on a cuda pool, where the worker's
 * kernels run asynchronously; on host pools every access is over when it
 * returns). The daemon moves and reuses pool blocks whenever it serves a
 * request, so:
 *   1. Before any request to the daemon (append, step, table, epoch,
 *      revive, release, detach: every function here that takes a session
 *      and talks to kvstashd), every kernel of the worker that reads or
 *      writes the pool has finished. libkvstash synchronises the stream
 *      registered with kvs_session_set_stream before each request (and
 *      before kvs_layer_write_dev / kvs_layer_read_dev); work on other
 *      streams is the worker's to synchronise. kvs_session_detach waits for
 *      the whole device first.
 *   2. A request carries the newest table epoch the session has seen
 *      (ack_epoch): by 1, no kernel of the worker still reads a table older
 *      than that, and the daemon reuses the blocks an older table retired
 *      only then.
 *   3. The daemon publishes a new epoch (answers the request that changed
 *      a table) only after its own kernels on the pool finished: its tier
 *      moves run through kv_ops_cuda, whose operations complete before they
 *      return.
 * A worker that ends without detaching (crash, SIGKILL) leaves its blocks
 * quarantined until its process has exited, since a closed socket does not
 * prove its kernels stopped (docs/protocol.md, "Lease end").
 *
 * Register `stream` (a cudaStream_t; NULL unregisters) as the worker's
 * stream for rule 1. KVS_ERR_PRECONDITION on a pool that is not cuda.
 */
int kvs_session_set_stream(kvs_session *s, void *stream);
size_t kvs_session_block_bytes(const kvs_session *s);
uint64_t kvs_session_pool_id(const kvs_session *s);     /* the pool's id in Stats */
uint32_t kvs_session_block_count(const kvs_session *s); /* blocks in the pool */

/* A policy parameter for kvs_seq_create. */
typedef struct kvs_param {
    const char *key, *value;
} kvs_param;

/* Create a sequence under `policy` ("full", "streaming", ...). */
int kvs_seq_create(kvs_session *s, const char *policy, const kvs_param *params, size_t nparams,
                   const char *label, uint64_t *seq_id);

int kvs_seq_release(kvs_session *s, uint64_t seq_id);

/*
 * Moving a sequence to another kvstashd through their shared remote tier
 * (kvstashd --remote; docs/remote.md "Export and import").
 * kvs_seq_export writes sequence seq_id to the remote tier and puts in uid
 * the 32 hex digits that name the export; the sequence stays here (release
 * it to move it). kvs_seq_import rebuilds an export in this session (a pool
 * of the same geometry and tenant): *seq_id is the new sequence, read its
 * table as any other, and *appended the tokens appended so far (the next
 * token's position). KVS_ERR_PRECONDITION without a remote tier, for what
 * export cannot carry yet (victims spilled with kvs_seq_spill), or for
 * another geometry; KVS_ERR_NOT_FOUND for an unknown uid; KVS_ERR_DATA_LOSS
 * for a value missing or corrupt; the daemon's message says which
 * (kvs_last_error).
 */
#define KVS_EXPORT_UID_LEN 32
int kvs_seq_export(kvs_session *s, uint64_t seq_id, char uid[KVS_EXPORT_UID_LEN + 1]);
int kvs_seq_import(kvs_session *s, const char *uid, uint64_t *seq_id, uint64_t *appended);

/*
 * Spilling a sequence's victims to the remote tier (kvstashd --remote;
 * docs/remote.md "Spill and revive"). kvs_seq_spill moves the evicted
 * tokens sequence seq_id keeps revivable (its victim blocks, victims=int8;
 * store.proto SpillSequence says what else) to the remote tier and gives
 * their memory back; kvs_seq_revive still brings those victims back,
 * fetching them from the remote tier (it fails with KVS_ERR_DATA_LOSS when
 * a spilled value is missing or corrupt). A
 * sequence without such victims spills nothing (out->values 0). On success
 * *out says what moved (store.proto SpillSequenceResponse).
 * KVS_ERR_PRECONDITION without a remote tier; KVS_ERR_NOT_FOUND for an
 * unknown sequence, KVS_ERR_PERMISSION for another worker's; the remote
 * tier's own errors (KVS_ERR_EXHAUSTED when it is full, KVS_ERR_UNAVAILABLE
 * when it does not answer in time), and then nothing moved. The daemon's
 * message says which (kvs_session_error).
 */
typedef struct kvs_spill {
    uint32_t blocks;         /* pool blocks freed by this call */
    uint32_t values;         /* remote values (keys) written */
    uint32_t sketches;       /* lists' victims-only sketches freed by this call */
    uint32_t dropped;        /* victims' blocks dropped or changed meanwhile: not spilled */
    uint64_t tokens;         /* victims this call spilled */
    uint64_t bytes;          /* value bytes written */
    uint64_t spilled_tokens; /* the sequence's victims now in the remote tier, in all */
    char uid[KVS_EXPORT_UID_LEN + 1]; /* the sequence's remote uid ("" if it never spilled) */
} kvs_spill;
int kvs_seq_spill(kvs_session *s, uint64_t seq_id, kvs_spill *out);

/* How a segment is stored (store.proto LayerTable.tier). */
typedef enum kvs_tier {
    KVS_TIER_FULL = 0,   /* slots of a pool block in the pool's dtype */
    KVS_TIER_INT8 = 1,   /* slots of the INT8 block held in pool block `block` */
    KVS_TIER_SKETCH = 2, /* only in the daemon's sketch: kvs_seq_revive rebuilds it */
    KVS_TIER_INT4 = 4,   /* slots of the INT4 block held in pool block `block` (demote=int4) */
    KVS_TIER_INT2 = 5,   /* the same in 2 bits (demote=int2); kernels.h "Low-bit tiers" */
} kvs_tier;

#define KVS_NO_BLOCK UINT32_MAX /* the block of a sketch segment */

/* One run of tokens of one layer (see kernels.h kv_segment). */
typedef struct kvs_segment {
    uint32_t block, first_slot, count;
    uint32_t tier; /* kvs_tier; 0 (full precision) unless the policy demoted it */
} kvs_segment;

/* A layer's table: its segments and, when asked for, each token's original
 * position. Arrays are owned by the kvs_table that holds the layer. */
typedef struct kvs_layer {
    uint32_t tokens;
    size_t nsegments;
    kvs_segment *segments;
    uint32_t *positions; /* NULL unless requested */
    uint32_t layer;      /* the layer this list belongs to */
    /* per_head: the list of KV head `head` only, for policies that decide per
     * head. Its blocks hold kv_heads * block_tokens rows of that head and its
     * slots are rows (store.proto LayerTable); kvs_layer_write/read then take
     * [tokens][head_dim] instead of [kv_heads][tokens][head_dim]. */
    int per_head;
    uint32_t head;
    /* Slots of an INT8 block in one pool block (kernels.h
     * kv_int8_tokens_per_block of the list's layout), of an INT4 and an INT2
     * one (kv_lowbit_tokens_per_block; 0: none fits), and the INT4 / INT2
     * groups' size: the layout's quant_group for kv_decode_attention. */
    uint32_t int8_block_tokens;
    uint32_t int4_block_tokens, int2_block_tokens, quant_group;
} kvs_layer;

/*
 * A sequence's tables: `layers` entries, one per layer of the geometry.
 * Filled by kvs_seq_append and kvs_seq_table, which overwrite *out without
 * freeing it (and leave it zeroed on error); free with kvs_table_free.
 *
 * Epochs: each append or table call acknowledges (ack_epoch) the newest
 * epoch this session has seen for the sequence, which lets the daemon free
 * blocks it retired up to that epoch. So stop reading through tables older
 * than the newest one you got before making the next call on the sequence.
 */
typedef struct kvs_table {
    uint64_t epoch;
    uint32_t first_position; /* for appends: position of the first new token */
    uint32_t evicted;        /* for appends: tokens the policy removed */
    uint32_t layers;         /* entries in layer[]: layers x heads */
    uint32_t heads;          /* lists per layer: 1, or kv_heads for per-head policies */
    kvs_layer *layer;        /* entry i is layer i / heads, KV head i % heads */
    /* The library's: arrays of lists that kvs_table_extend and
     * kvs_table_cut grew (NULL until they do). */
    struct kvs_table_room *room;
} kvs_table;

/* Free the table's arrays and zero it (the kvs_table itself is the caller's). */
void kvs_table_free(kvs_table *t);

/*
 * Keeping a table current without reading it again (issue 16 §2: at 32k
 * tokens × 32 layers a table is megabytes, and a policy that evicts every
 * step changes it every step). Hold the table of kvs_seq_table; after each
 * kvs_seq_append add its writes (kvs_table_extend), after each
 * kvs_seq_step cut out what it removed (kvs_table_cut). Each leaves *t
 * exactly the daemon's table of the new epoch (segments, tiers, positions
 * when *t has them), or returns KVS_ERR_PRECONDITION and leaves *t
 * unchanged when it cannot (the append evicted, the step moved tokens or
 * changed tiers, *t is of another epoch): then read the table
 * (kvs_seq_table). A demotion the daemon published after a step's answer
 * (int8=on, demote=int4|int2) comes with the next append's writes, as the
 * runs of tokens it moved, and kvs_table_extend applies them first: *t of
 * the step's epoch becomes the table after the append. KVS_ERR_INVALID for a table or answer that
 * does not match *t's lists, KVS_ERR_SYSTEM when out of memory; *t unchanged.
 */
int kvs_table_extend(kvs_table *t, const kvs_table *writes);

/*
 * A run of tokens a demotion moved to other storage: tokens [first, first +
 * at.count) of list `list` (the table's order) are now stored at `at`;
 * their positions and their order do not change.
 */
typedef struct kvs_moved_run {
    uint32_t list, first;
    kvs_segment at;
} kvs_moved_run;

/*
 * The moves an append's writes carry (kvs_seq_append), for a worker that
 * keeps its table its own way (kvs_table_extend applies them itself): the
 * runs that take a table of *from to *to, which the writes then extend.
 * *n is 0 when it carries none. The array is the writes' until
 * kvs_table_free.
 */
void kvs_table_moves(const kvs_table *writes, uint64_t *from, uint64_t *to,
                     const kvs_moved_run **runs, size_t *n);

/*
 * Make room for `count` new tokens in every layer (through the session's
 * ring; the gRPC Append does the same for other clients). If the policy needs
 * nothing from the worker, the step of the previous tokens ends here first.
 * On success `writes`
 * describes, per layer, the segments where the new tokens go (in order);
 * write them with kvs_key_ptr/kvs_value_ptr or kvs_layer_write. count is
 * signed so that the daemon, not the C type, rejects bad values.
 */
int kvs_seq_append(kvs_session *s, uint64_t seq_id, int64_t count, kvs_table *writes);

/*
 * The statistics of one step (a prefill chunk or a decode token), reported
 * through the session's shared-memory ring, not gRPC: the policy decides on
 * them at once and the answer says whether the table changed. Arrays are
 * indexed by the layer's held tokens in table order; each is NULL when not
 * reported (kvstash policy list says what each policy needs).
 */
typedef struct kvs_step {
    uint32_t new_tokens;    /* tokens appended since the last step; 0 = all of them */
    int prefill;            /* 1 while the prompt is processed */
    uint32_t heads;         /* lists per layer, as the table says (kvs_table.heads) */
    const uint32_t *tokens; /* [layers * heads]: tokens each list holds (its table) */
    /* [layers] -> [tokens]: Σ query heads, Σ score_queries queries of attention;
     * only for one list per layer. */
    const float *const *score;
    uint32_t score_queries;
    /* [layers * q_heads] -> [tokens of the list query head h reads]. */
    const float *const *last_attn;   /* the step's last query */
    const float *const *window_attn; /* the mean over the observation window */
    uint32_t window_queries;         /* queries averaged into window_attn */
    /* [layers * kv_heads] -> [tokens of KV head g's list]: ‖V·W^O‖₁ per token
     * (CriticalKV; POLICIES.md §1.2). */
    const float *const *vnorm;
    double confidence; /* next-token confidence in [0, 1]; < 0 = none */
} kvs_step;

typedef struct kvs_step_result {
    uint64_t epoch;   /* the table epoch after the policy's decision */
    uint32_t evicted; /* tokens removed (all layers); 0 = the table did not shrink */
    /* When removing tokens was all the step did to the table: cut_lists
     * (the table's `layers` entries), and for list i the indices of the
     * tokens it lost, in the list as it was at cut_epoch, ascending:
     * cut[cut_start[i] .. cut_start[i + 1]). kvs_table_cut applies them.
     * cut_lists 0: no cuts (read the table if the epoch moved). The arrays
     * are the session's, valid until its next call. */
    uint64_t cut_epoch;
    uint32_t cut_lists;
    const uint32_t *cut_start; /* [cut_lists + 1] */
    const uint32_t *cut;
} kvs_step_result;

/* End a step: report its statistics; *out (may be NULL) says what changed.
 * A row already where the ring's layout puts it (kvs_step_in_ring) is
 * not copied. */
int kvs_seq_step(kvs_session *s, uint64_t seq_id, const kvs_step *step, kvs_step_result *out);

/* The arrays of a step, as bits (kvs_step_in_ring). */
#define KVS_STEP_SCORE (1u << 0)
#define KVS_STEP_LAST_ATTN (1u << 1)
#define KVS_STEP_WINDOW_ATTN (1u << 2)
#define KVS_STEP_VNORM (1u << 3)

/* A step's rows in the session's ring, each kvs_step array's row-pointer
 * table (NULL for an array not asked for). */
typedef struct kvs_step_rows {
    float **score;       /* [layers] */
    float **last_attn;   /* [layers * q_heads] */
    float **window_attn; /* [layers * q_heads] */
    float **vnorm;       /* [layers * kv_heads] */
} kvs_step_rows;

/*
 * Where kvs_seq_step would copy the statistics of a step with `arrays`
 * (KVS_STEP_* bits) over lists holding tokens[layers * heads] (as
 * kvs_step's heads and tokens): rows in the session's shared-memory ring,
 * for a worker that writes them there itself (its attention kernel, or its
 * copy from the GPU) and so spares kvs_seq_step the copy: at 32 layers ×
 * 32k tokens, 4 MiB a decode step of `score`, 128 MiB of `last_attn`. Pass
 * out's tables as the kvs_step's arrays, with the same heads and tokens.
 * The rows keep what the worker writes until the session's next call, the
 * kvs_seq_step that reports them (the ring's data area also carries the
 * answers: ask after the step's appends); the tables are the session's
 * until its next kvs_step_in_ring. KVS_ERR_INVALID when the rows do not fit the ring (start
 * kvstashd with a larger --ring-mb) or the arguments are wrong.
 */
int kvs_step_in_ring(kvs_session *s, uint32_t heads, const uint32_t *tokens, unsigned arrays,
                     kvs_step_rows *out);

/* Cut a step's removed tokens (r's cut_*) out of a table of cut_epoch, which
 * becomes the table of r->epoch (see kvs_table_extend). */
int kvs_table_cut(kvs_table *t, const kvs_step_result *r);

/* The sequence's current table epoch: "has my table changed?" in one ring
 * round trip. */
int kvs_seq_epoch(kvs_session *s, uint64_t seq_id, uint64_t *epoch);

/* One empty ring round trip (for benchmarks). */
int kvs_ring_ping(kvs_session *s);

/* The current tables of a sequence (all layers). */
int kvs_seq_table(kvs_session *s, uint64_t seq_id, int with_positions, kvs_table *out);

/* Device address (kvs_session_pool) of the K (or V) row of (block, kv head, slot),
 * for lists of all heads; for a per-head list, kvs_row_key_ptr and
 * kvs_row_value_ptr address row `row` of a block. */
void *kvs_row_key_ptr(const kvs_session *s, uint32_t block, uint32_t row);
void *kvs_row_value_ptr(const kvs_session *s, uint32_t block, uint32_t row);
void *kvs_key_ptr(const kvs_session *s, uint32_t block, uint32_t head, uint32_t slot);
void *kvs_value_ptr(const kvs_session *s, uint32_t block, uint32_t head, uint32_t slot);

/* Copy contiguous K and V in the worker's memory, each
 * [kv_heads][layer->tokens][head_dim] (or [layer->tokens][head_dim] for a
 * per-head list) of the pool's dtype, into the list's segments (write) or
 * out of them (read), through the backend's ops. Returns KVS_ERR_SYSTEM
 * when the backend fails. Reads dequantise INT8 segments; a list with sketch segments
 * cannot be read in place (KVS_ERR_PRECONDITION: use kvs_seq_revive).
 * Writes take full-precision segments only (an append's writes are). */
int kvs_layer_write(const kvs_session *s, const kvs_layer *layer, const void *k, const void *v);
int kvs_layer_read(const kvs_session *s, const kvs_layer *layer, void *k, void *v);
/* The same, but k and v are device memory of the pool's backend: on a cuda
 * pool, device pointers on the pool's GPU (the copies run device to device,
 * after the registered stream is synchronised); on "host", ordinary memory;
 * on "shadow", buffers of kvs_session_ops(s)->alloc (a host pointer there
 * aborts, as it would fault on a GPU). */
int kvs_layer_write_dev(const kvs_session *s, const kvs_layer *layer, const void *k, const void *v);
int kvs_layer_read_dev(const kvs_session *s, const kvs_layer *layer, void *k, void *v);

/* What kvs_seq_revive rebuilt: `layer` is a table of scratch blocks (all
 * full precision, positions filled) to read like any list; source_tier[i]
 * says where token i was stored (kvs_tier). Release with kvs_revive_release.
 * With KVS_REVIVE_IN_PLACE the tokens the list held at full precision are
 * the list's own slots in that table, readable until the session acks an
 * epoch after `epoch` (as the worker's table is), and scratch_id is 0 when
 * no token was rebuilt. */
typedef struct kvs_revive {
    uint64_t scratch_id;
    kvs_table table;      /* one entry: the revived list */
    kvs_layer *layer;     /* = &table.layer[0] */
    uint8_t *source_tier; /* [layer->tokens] */
    uint32_t from_full, from_int8, from_sketch;
    uint64_t epoch; /* the sequence's table epoch when it was revived */
} kvs_revive;

/* kvs_seq_revive's flags. */
#define KVS_REVIVE_SKIP_EVICTED 1u /* leave out positions evicted outright */
#define KVS_REVIVE_IN_PLACE 2u     /* do not copy tokens held at full precision */

/*
 * Rebuild original positions [first, first + count) (count 0: to the end)
 * of list (layer, head) in full precision into scratch blocks: raw tokens
 * copied, INT8 tokens dequantised, sketched and offloaded tokens as the
 * sketch's estimate (store.proto ReviveRequest). Positions evicted outright
 * give KVS_ERR_PRECONDITION unless KVS_REVIVE_SKIP_EVICTED. With
 * KVS_REVIVE_IN_PLACE, tokens the list holds at full precision are not
 * copied: the table names their slots in the list (read, never write
 * them), and only the rest is rebuilt into scratch. Other flag bits:
 * KVS_ERR_INVALID.
 */
int kvs_seq_revive(kvs_session *s, uint64_t seq_id, uint32_t layer, uint32_t head, uint32_t first,
                   uint32_t count, unsigned flags, kvs_revive *out);

/* Give the scratch blocks back to the daemon (none to give for scratch_id
 * 0) and free *r. */
int kvs_revive_release(kvs_session *s, kvs_revive *r);

/* Daemon statistics as the JSON object of StatsResponse, with every
 * sequence's tokens and bytes per storage tier (caller frees with free()).
 * Needs no session: socket_path NULL = default. */
int kvs_stats_json(const char *socket_path, char **json, char *err, size_t errlen);

/* Subscribe to the daemon's event feed. Returns a nanomsg socket (>= 0) to
 * read with kvs_events_next, or a negative kvs_err. */
int kvs_events_open(const char *socket_path);
/* Next event as "topic {json}" (caller frees), waiting up to timeout_ms
 * (negative = forever); returns 0, KVS_ERR_UNAVAILABLE on timeout or when a
 * signal interrupts the wait. */
int kvs_events_next(int sock, int timeout_ms, char **event);
void kvs_events_close(int sock);

#ifdef __cplusplus
}
#endif
#endif
