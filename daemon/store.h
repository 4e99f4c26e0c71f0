/*
 * store.h - the daemon's state: pools, sessions and sequences, and every
 * operation on them, independent of gRPC.
 *
 * The RPC layer (service.c) and the fd socket (fdsock.c) call these
 * functions; each takes the store's one lock, validates everything the client
 * sent, and either changes the state completely or not at all, answering with
 * a status whose message says what to fix. The store and its sessions are
 * opaque (store_internal.h, for daemon/store*.c only): Stats and /metrics
 * read a snapshot (store_snapshot), Inspect one sequence under
 * store_lock_seq()/store_unlock().
 */
#ifndef KVSTASH_STORE_H
#define KVSTASH_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "background.h"
#include "events.h"
#include "pool.h"
#include "seq.h"
#include "snapshot.h"
#include "status.h"

#define STORE_TOKEN_LEN 32 /* hex digits */

struct metrics; /* metrics.h */

typedef struct store_config {
    size_t pool_bytes;      /* arena size of each pool */
    uint32_t max_pools;     /* models served at once */
    uint32_t max_sessions;  /* connected workers */
    uint32_t max_seqs;      /* sequences over all sessions */
    const backend *backend; /* where pools live; NULL = backend_host */
    /* Limits (docs/reliability.md); 0 = none. Daemon memory that
     * requests may take beyond the pools (sequences' sketch cells, reserved
     * at create: --max-daemon-mb), sequences and pool blocks one session may
     * hold, and the largest reply a call may build (refused before it
     * changes anything). */
    size_t max_daemon_bytes;
    uint32_t session_max_seqs, session_max_blocks;
    size_t max_reply_bytes;
    /* Lease end (docs/reliability.md): 1 keeps the blocks of a session that
     * ended without a detach out of reuse until its worker's process has
     * exited (store_quarantine_reap); 0 frees them at once. */
    int lease_end_quarantine;
    /* The INT4 / INT2 tiers' group size of every pool (kernels.h "Low-bit
     * tiers"; 0 = KV_LOWBIT_GROUP_DEFAULT); tables carry it to workers. */
    uint32_t quant_group;
    /* The threads a sequence's step may decide its layers on, and the
     * tokens it must hold for more than one (policy_host_set_threads). */
    uint32_t policy_threads;
    uint64_t policy_parallel_tokens;
    /* A Revive's copy, and a prompt's demotion, of move_background_bytes
     * or more (at full precision), and a prompt's decision without the
     * lock (unlocked_decision_tokens), run on a thread of priority
     * move_priority (background.h: the workers' steps come first);
     * BACKGROUND_NORMAL (0) keeps them on the calling thread. A decode
     * step's work, which its worker waits for at every token, always
     * does. */
    background_priority move_priority;
    size_t move_background_bytes;
    /* The tokens a sequence's lists must hold for its step to decide
     * without the store's lock; 0 = STORE_UNLOCKED_DECISION_TOKENS. */
    uint64_t unlocked_decision_tokens;
} store_config;

/* kvstashd's unlocked_decision_tokens: about 0.1 ms of a one-pass policy's
 * decision on this class of CPU, about a hundred times what letting go of
 * the lock and taking it again costs. */
#define STORE_UNLOCKED_DECISION_TOKENS 32768

/* kvstashd's move_background_bytes: a copy of 1 MiB takes a few hundred
 * microseconds, a hand-over to a background thread and back tens. */
#define STORE_BACKGROUND_MOVE_BYTES (1u << 20)
/* The background threads: as many sequences' long work runs at once. */
#define STORE_BACKGROUND_THREADS 2

typedef struct store store;
typedef struct session session; /* a worker's session: store_internal.h */

/*
 * A session's per-step transport (the ring, ring.h), which registers itself
 * through store_transport_fd. The store keeps it with the session and ends
 * it with the session: close() under the store's lock (it must not block),
 * then join() outside it (its thread may be waiting for the lock), which
 * frees it. Only shutdown joins a transport before ended() says 1: the
 * fd-socket thread never waits on one. `impl` is NULL when the session has
 * none.
 */
typedef struct store_transport {
    void *impl;
    void (*close)(void *impl);
    void (*join)(void *impl);
    int (*fd)(const void *impl); /* the descriptor a worker maps (owned by impl) */
    size_t (*bytes)(const void *impl);
    int (*ended)(const void *impl); /* 1 once closed and its thread ended: join() won't wait */
} store_transport;

/* Creates the transport, of `bytes` bytes, that acts for the session holding
 * `token`; called with the store's lock held. */
typedef status_code (*store_transport_open)(store *st, const char *token, size_t bytes,
                                            store_transport *out, status *s);

/* What Attach returns. */
typedef struct store_attach_result {
    uint64_t session_id, pool_id, pool_bytes, block_bytes;
    uint32_t block_count;
    pool_geometry geometry;
    const char *backend; /* the pool's backend name (static) */
} store_attach_result;

/* A sequence's tables, copied out under the lock: one entry per list (per
 * layer, or per layer and KV head for per-head policies). Free with
 * store_table_free. */
typedef struct store_layer_table {
    uint32_t layer, head;
    int per_head; /* rows of one KV head (see seq.h), not tokens of all heads */
    uint32_t tokens;
    size_t nsegs;
    kv_segment *segs;
    uint8_t *tiers;             /* [nsegs] policy_tier of each segment; NULL = all full */
    uint32_t int8_block_tokens; /* tokens of an INT8 block in one pool block (tier.h) */
    uint32_t int4_block_tokens, int2_block_tokens; /* of INT4 and INT2 blocks (0: none fits) */
    uint32_t quant_group;                          /* the INT4 / INT2 groups' size */
    uint32_t *positions;                           /* NULL unless asked for */
} store_layer_table;

typedef struct store_table {
    uint64_t epoch;
    uint32_t first_position; /* appends: position of the first new token */
    uint32_t evicted;        /* appends: tokens removed by the policy */
    uint32_t nlists;
    store_layer_table *lists;
    /* Appends: the demotion published since the worker's ack, when it only
     * moved runs of tokens (seq.h seq_demotion_moves): what takes the
     * worker's table of moves_from to moves_to, which the append's writes
     * then extend. nmoves 0: none to give. */
    seq_moved_run *moves;
    size_t nmoves;
    uint64_t moves_from, moves_to;
} store_table;

void store_table_free(store_table *t);

uint64_t store_now_ms(void);
uint64_t store_now_ns(void); /* CLOCK_MONOTONIC in nanoseconds, for durations */

/* A new store; `events` may be NULL. NULL when out of memory. Free with
 * store_destroy. */
store *store_create(const store_config *cfg, events *events);

/* Count into m (metrics.h; NULL = none). Only before the store serves
 * anyone: the hooks read it without the lock. */
void store_set_metrics(store *st, struct metrics *m);

/* The remote tier (remote_tier.h; NULL = none), which main.c opens and
 * closes after store_destroy. Only before the store serves anyone. */
void store_set_remote(store *st, struct remote_tier *r);

/*
 * Export and import (docs/remote.md "Export and import"; the remote tier,
 * store_set_remote). store_seq_export writes sequence seq_id (the caller's
 * own, or any with an operator's uid) to the remote tier under a fresh
 * uid: the sequence is marked moving while its blocks are copied (its own
 * calls wait; no other sequence does), the remote writes run without the
 * lock, the manifest last. store_seq_import reads uid's manifest and
 * values (without the lock) and rebuilds the sequence in the session
 * session_id (0: the caller's; another's needs an operator's uid), whose
 * pool must have the export's geometry and tenant. Errors: those of
 * seq_export_describe and seq_import, the remote tier's (remote_store.h),
 * FAILED_PRECONDITION without a remote tier, NOT_FOUND for a uid without a
 * manifest, DATA_LOSS for a missing or corrupt value, RESOURCE_EXHAUSTED
 * for the pool's blocks or a quota.
 */
typedef struct store_export_result {
    char uid[REMOTE_UID_LEN + 1];
    char key_prefix[REMOTE_KEY_CAP];
    uint64_t bytes, tokens;
    uint32_t values, blocks, ttl_s;
} store_export_result;

typedef struct store_import_result {
    uint64_t seq_id, epoch, appended, bytes;
    uint32_t blocks;
    const policy_ops *policy;
    policy_params params;
} store_import_result;

status_code store_seq_export(store *st, const char *token, uint64_t seq_id,
                             store_export_result *out, status *s);
status_code store_seq_import(store *st, const char *token, const char *uid, uint64_t session_id,
                             store_import_result *out, status *s);

/*
 * Spill (issue 17; docs/remote.md "Spill and revive"): move sequence
 * seq_id's revivable victims (seq.h "Spilling victims": victim blocks of
 * victims=int8, victims-only sketches of victims=sketch) to the remote
 * tier and give their pool blocks and sketch cells back. Its own
 * sequence, or any with an operator's uid. They are copied with the
 * sequence marked moving, written without the lock, then freed: a block
 * that memory pressure dropped meanwhile, or a sketch a step added to, is
 * not, and its value is deleted. The victims stay revivable: store_revive
 * fetches them back (without the lock), DATA_LOSS when their value is
 * missing or corrupt. A sequence without such victims spills nothing (OK,
 * zero blocks). Errors: those of
 * export's lookup, FAILED_PRECONDITION without a remote tier, the remote
 * tier's (remote_store.h), RESOURCE_EXHAUSTED when out of memory.
 */
typedef struct store_spill_result {
    char uid[REMOTE_UID_LEN + 1]; /* the sequence's remote uid ("" when nothing spilled yet) */
    char key_prefix[REMOTE_KEY_CAP];
    uint64_t bytes, tokens;         /* this call's values' bytes, the victims they hold */
    uint32_t blocks, values, ttl_s; /* pool blocks freed, values written */
    uint32_t sketches;              /* lists' sketches freed */
    uint32_t dropped;               /* blocks dropped, sketches changed, before the spill ended */
    uint64_t spilled_tokens;        /* the sequence's victims now in the remote tier */
    uint64_t spilled_blocks;
} store_spill_result;

status_code store_seq_spill(store *st, const char *token, uint64_t seq_id, store_spill_result *out,
                            status *s);

/* Spill on its own (spiller.h): every sequence with revivable victims in
 * memory in a pool with fewer than below_pct percent of its blocks free,
 * as store_seq_spill for an operator. Skipped while shutting down. The
 * counts of what went are summed into *sum; returns the sequences that
 * failed (*first_error: the first one's status). Waits for the remote
 * tier without the lock. */
uint32_t store_spill_pressured(store *st, uint32_t below_pct, store_spill_result *sum,
                               status *first_error);

/* The remote tier as last seen (remote_tier_status_get): no lock, no wait
 * for the network; configured 0 without one. */
void store_remote_status(store *st, remote_tier_status *out);

#define STORE_MAX_OPERATORS 16

/* The uids whose sessions are operators' (kvstashd --operator-uids): they
 * may evict, demote, offload and revive any session's sequence and see every
 * session and sequence in Stats and Inspect; every other session acts on,
 * and sees the labels and parameters of, only its own sequences. Copies at
 * most STORE_MAX_OPERATORS uids (n == 0: no operators). Only before the store
 * serves anyone; until then the operators are root and the daemon's uid. */
void store_set_operators(store *st, const uid_t *uids, size_t n);

/* Who calls a read-only view (Stats, Inspect). */
typedef struct store_caller {
    uint64_t session_id; /* 0: no session (a call without a token) */
    uid_t uid;
    int is_operator; /* uid is in the operators' list: sees everything */
} store_caller;

/*
 * The caller holding `token` (a fd-socket session, attached or not). A
 * call without a token (NULL) comes over the Unix socket, which the
 * filesystem opens to root and the daemon's uid only (rpc.h: over TCP such a
 * call reaches no view); kvstashd cannot tell which of the two it is and
 * credits it with the daemon's uid, the lesser one. UNAUTHENTICATED (an
 * empty or unknown token); it answers while shutting down too.
 */
status_code store_identify(store *st, const char *token, store_caller *out, status *s);

/* Reclaim every session (reason "shutdown") and free everything, st too. */
void store_destroy(store *st);

/* Stop taking new work (health turns NOT_SERVING). */
void store_begin_shutdown(store *st);
int store_serving(store *st);

/* The largest reply a call may build (store_config.max_reply_bytes; 0 =
 * no limit): what Inspect checks its reply against, as Append does. */
size_t store_max_reply(const store *st);

/* The name of the backend pools live in (backend.h; a static string). */
const char *store_backend_name(const store *st);

/* Copy pools, attached sessions and sequences out under the lock (for
 * /metrics and Stats). 0, or -1 when out of memory (*out then empty);
 * free with snapshot_free. */
int store_snapshot(store *st, snapshot *out);

/* store_snapshot as `who` may see it (Stats): an operator everything; anyone
 * else only its own session and sequences, the pools' totals still counting
 * every sequence.
 *
 * Both are served from a snapshot of everything shared by all callers: one
 * is taken under the lock at most every STORE_SNAPSHOT_INTERVAL_MS
 * (store_internal.h), so what a call returns may be that much older than
 * the call; a call never waits for another's snapshot. */
int store_snapshot_for(store *st, const store_caller *who, snapshot *out);

/* Under store_lock: sequence q as snapshot_seq (Inspect's summary). */
void store_seq_snapshot(seq *q, snapshot_seq *out);

/* Under store_lock: hand q's tier report to the metrics and clear it. */
void store_report_tiers(store *st, seq *q);

void store_lock(store *st);
void store_unlock(store *st);

/* store_lock for a call that changes sequence seq_id: it also waits until
 * no Revive copies out of that sequence without the lock (store_revive),
 * so the copy reads the sequence as it was planned. */
void store_lock_seq(store *st, uint64_t seq_id);

/* fd socket: a peer identified by SO_PEERCRED gets a session and its token.
 * With store_config.lease_end_quarantine the store opens a pidfd of `pid`
 * here, while the peer that just spoke surely lives (no pid reuse); where
 * pidfd_open fails (a kernel before 5.3, no descriptor left) the session's
 * blocks are freed at its end, as without quarantine, and the log says so. */
status_code store_session_open(store *st, pid_t pid, uid_t uid, gid_t gid, int conn_id,
                               char token[STORE_TOKEN_LEN + 1], status *s);

/* fd socket RING: a dup of the descriptor of the session's transport, which
 * `open` creates on first use with `want_bytes`; *bytes is its size. The
 * caller closes *fd. */
status_code store_transport_fd(store *st, int conn_id, store_transport_open open, size_t want_bytes,
                               int *fd, size_t *bytes, status *s);

/* fd socket: the connection closed; reclaim its session, if any. */
void store_session_conn_closed(store *st, int conn_id);

/* fd socket: copy the connection ids of attached sessions into ids (at
 * most cap of them, in no order) and return how many there are; a
 * connection whose id is not among them is pending (no HELLO, or no Attach
 * yet) or idle (its session ended). */
size_t store_attached_conns(store *st, int *ids, size_t cap);

/*
 * Leases (docs/reliability.md): a session's lease is renewed by
 * every call on it (any gRPC call with its token, ring EPOCH, APPEND and
 * STEP, fd-socket MAP and RING); an attached session not renewed for
 * `ms` (0 = never, the default) is reclaimed by store_expire_leases like a
 * killed worker, reason "lease-timeout". Only before the store serves anyone.
 */
void store_set_lease_timeout(store *st, uint32_t ms);

/* Reclaim every attached session whose lease ran out (store_set_lease_timeout)
 * and reap the ended rings whose threads have stopped; returns how many
 * sessions it reclaimed. The fd-socket thread calls it every FDSOCK_TICK_MS. */
uint32_t store_expire_leases(store *st);

/*
 * Release the quarantined sessions (store_config.lease_end_quarantine)
 * whose worker's process has exited (its pidfd readable): their blocks go
 * back to the pool, event worker.released, and a pool left with no session
 * and no quarantine is destroyed. Never waits (poll with timeout 0).
 * Returns how many it released. The fd-socket thread calls it every
 * FDSOCK_TICK_MS.
 */
uint32_t store_quarantine_reap(store *st);

/* fd socket MAP: what the session on conn_id needs to map its pool's arena
 * (backend.h backend_share: a dup of the memfd for the host backends), if it
 * is attached to pool_id. The caller closes sh->fd when it is not -1. */
status_code store_pool_share(store *st, int conn_id, uint64_t pool_id, backend_share *sh,
                             status *s);

/* store_attach_tenant with the default tenant "". */
status_code store_attach(store *st, const char *token, const char *model,
                         const pool_geometry *geometry, const char *worker_name,
                         store_attach_result *out, status *s);

/* Attach the session holding `token` to the pool of (tenant, model),
 * created on first use: workers of one tenant and model share a pool (one
 * memfd that each maps read-write), another tenant gets its own. tenant is
 * "" (the default) or 1 to 64 of [A-Za-z0-9._-]; INVALID_ARGUMENT otherwise. */
status_code store_attach_tenant(store *st, const char *token, const char *tenant, const char *model,
                                const pool_geometry *geometry, const char *worker_name,
                                store_attach_result *out, status *s);

/* The lease stream opened; *session_id identifies it for store_lease_end. */
status_code store_lease_begin(store *st, const char *token, uint64_t *session_id, status *s);

/* The lease stream ended: reclaim the session (no-op if already gone). */
void store_lease_end(store *st, uint64_t session_id);

status_code store_detach(store *st, const char *token, uint32_t *released, status *s);

/* What CreateSequence asks for: a policy by name, its parameters as
 * key/value text, and the operator's label. */
typedef struct store_seq_request {
    const char *policy;
    const char *const *keys;
    const char *const *values;
    size_t nparams;
    const char *label;
} store_seq_request;

/* What it answers: the new sequence, its first epoch, and the parameters
 * resolved (defaults filled in). */
typedef struct store_seq_created {
    uint64_t seq_id, epoch;
    policy_params params;
} store_seq_created;

/* Create a sequence for the session holding `token`. */
status_code store_seq_create(store *st, const char *token, const store_seq_request *req,
                             store_seq_created *out, status *s);

/* Append: on success *writes holds, per layer, the segments of the new tokens
 * (positions not filled: they are first_position + i). RESOURCE_EXHAUSTED,
 * before anything changes, when the caller's reply could pass its limit:
 * store_append answers in a gRPC AppendResponse (store_reply_rpc). */
status_code store_append(store *st, const char *token, uint64_t seq_id, int64_t count,
                         uint64_t ack_epoch, store_table *writes, status *s);

/* How a caller encodes a reply that holds lists (an Append's, a table's),
 * so that one that could not fit is refused before anything changes or is
 * built: at most `limit` bytes (0 = no limit), with fixed_bytes,
 * list_bytes a list and at most segment_bytes a segment, and, where the
 * reply has positions (an Append's when `positions`, a table's when asked
 * for), position_bytes a position, or a varint (protobuf) when 0.
 * limit_name says in the refusal what sets the limit. */
typedef struct store_reply_form {
    uint64_t limit;
    uint32_t fixed_bytes, list_bytes, segment_bytes, position_bytes;
    int positions;
    const char *limit_name;
} store_reply_form;

/* The form of gRPC's AppendResponse and GetBlockTableResponse under
 * store_config.max_reply_bytes. */
store_reply_form store_reply_rpc(const store *st);

/* store_append for a caller whose reply takes `form` (the ring's data area). */
status_code store_append_within(store *st, const char *token, uint64_t seq_id, int64_t count,
                                uint64_t ack_epoch, const store_reply_form *form,
                                store_table *writes, status *s);

/* The sequence's whole table (GetBlockTable), after acking ack_epoch;
 * RESOURCE_EXHAUSTED, before it is built, when it could pass the limit of a
 * gRPC reply. */
status_code store_get_table(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                            int with_positions, store_table *out, status *s);

/* What store_lend_table lends a table to: t's arrays point into the
 * sequence, to be read (not freed) during the call, under the store's
 * lock. A status other than ST_OK is the call's answer. */
typedef status_code (*store_table_reader)(void *ctx, const store_table *t, status *s);

/* store_get_table for a caller whose reply takes `form` (the ring's data
 * area) and that writes the table straight into it: read(ctx, t, s) gets
 * the table as it stands, with no copy of its positions (megabytes at
 * long contexts, every step of a policy that evicts every step). */
status_code store_lend_table(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                             int with_positions, const store_reply_form *form,
                             store_table_reader read, void *ctx, status *s);

status_code store_seq_release(store *st, const char *token, uint64_t seq_id, uint32_t *blocks_freed,
                              status *s);

/* What store_step lends a step's cuts to (seq_step_cuts), under the
 * store's lock, when removing tokens was all the step did to the lists. */
typedef void (*store_cuts_reader)(void *ctx, const seq_cuts *cuts);

/* End a step of a sequence with the worker's statistics (seq_step);
 * read_cuts (may be NULL) gets its cuts when they are the whole change. */
status_code store_step(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                       const seq_step_input *in, store_cuts_reader read_cuts, void *ctx,
                       uint64_t *epoch, uint32_t *evicted, status *s);

/* The sequence's current table epoch (after acking ack_epoch). */
status_code store_epoch(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                        uint64_t *epoch, status *s);

/* What Revive returns: the revived tokens' table (one list, positions
 * filled: scratch blocks, and with in_place the list's own slots), each
 * token's tier before the revive, and the sequence's epoch then (slots
 * read in place stay the list's until the worker acks a later one).
 * scratch_id 0: an in-place Revive that took no scratch. */
typedef struct store_revive_result {
    uint64_t scratch_id;
    uint64_t epoch;
    store_layer_table table;
    uint8_t *src_tier; /* [table.tokens] */
} store_revive_result;

/* Revive positions [first, first + count) (count 0: to the end) of the
 * caller's sequence's list (layer, head) into scratch blocks (seq_revive).
 * Free *out with store_revive_result_free. */
status_code store_revive(store *st, const char *token, uint64_t seq_id,
                         const seq_revive_request *req, store_revive_result *out, status *s);
void store_revive_result_free(store_revive_result *r);

/* How many Revive copies, demotions and decisions have run on a
 * background thread (store_config.move_priority). */
uint64_t store_background_moves(store *st);

/* Give a Revive's scratch blocks back to the pool. */
status_code store_scratch_release(store *st, const char *token, uint64_t scratch_id,
                                  uint32_t *blocks_freed, status *s);

/* Under store_lock: look a sequence up (no ownership check). */
seq *store_find_seq_locked(store *st, uint64_t seq_id);

/* Under store_lock_seq(seq_id): sequence seq_id for Inspect by the caller
 * holding `token` (store_identify): its owner's session or an operator's. NOT_FOUND,
 * PERMISSION_DENIED (another session's, and the caller is no operator), or
 * store_identify's errors. */
status_code store_find_seq_visible_locked(store *st, const char *token, uint64_t seq_id, seq **out,
                                          status *s);

#endif
