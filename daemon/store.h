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
 * store_lock()/store_unlock().
 */
#ifndef KVSTASH_STORE_H
#define KVSTASH_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

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
} store_config;

typedef struct store store;
typedef struct session session; /* a worker's session: store_internal.h */

/*
 * A session's per-step transport (the ring, ring.h), which registers itself
 * through store_transport_fd. The store keeps it with the session and ends
 * it with the session: close() under the store's lock (it must not block),
 * then join() outside it (its thread may be waiting for the lock), which
 * frees it. `impl` is NULL when the session has none.
 */
typedef struct store_transport {
    void *impl;
    void (*close)(void *impl);
    void (*join)(void *impl);
    int (*fd)(const void *impl); /* the descriptor a worker maps (owned by impl) */
    size_t (*bytes)(const void *impl);
} store_transport;

/* Creates the transport that acts for the session holding `token`; called
 * with the store's lock held. */
typedef status_code (*store_transport_open)(store *st, const char *token, store_transport *out,
                                            status *s);

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
    uint32_t *positions;        /* NULL unless asked for */
} store_layer_table;

typedef struct store_table {
    uint64_t epoch;
    uint32_t first_position; /* appends: position of the first new token */
    uint32_t evicted;        /* appends: tokens removed by the policy */
    uint32_t nlists;
    store_layer_table *lists;
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

/* Reclaim every session (reason "shutdown") and free everything, st too. */
void store_destroy(store *st);

/* Stop taking new work (health turns NOT_SERVING). */
void store_begin_shutdown(store *st);
int store_serving(store *st);

/* The name of the backend pools live in (backend.h; a static string). */
const char *store_backend_name(const store *st);

/* Copy pools, attached sessions and sequences out under the lock (for
 * /metrics and Stats). 0, or -1 when out of memory (*out then empty);
 * free with snapshot_free. */
int store_snapshot(store *st, snapshot *out);

/* Under store_lock: sequence q as snapshot_seq (Inspect's summary). */
void store_seq_snapshot(seq *q, snapshot_seq *out);

/* Under store_lock: hand q's tier report to the metrics and clear it. */
void store_report_tiers(store *st, seq *q);

void store_lock(store *st);
void store_unlock(store *st);

/* fd socket: a peer identified by SO_PEERCRED gets a session and its token. */
status_code store_session_open(store *st, pid_t pid, uid_t uid, gid_t gid, int conn_id,
                               char token[STORE_TOKEN_LEN + 1], status *s);

/* fd socket RING: a dup of the descriptor of the session's transport, which
 * `open` creates on first use. The caller closes *fd. */
status_code store_transport_fd(store *st, int conn_id, store_transport_open open, int *fd,
                               size_t *bytes, status *s);

/* fd socket: the connection closed; reclaim its session, if any. */
void store_session_conn_closed(store *st, int conn_id);

/* fd socket MAP: a dup of the pool's memfd for the session on conn_id, if it
 * is attached to pool_id. The caller closes *fd. */
status_code store_pool_fd(store *st, int conn_id, uint64_t pool_id, int *fd, size_t *bytes,
                          status *s);

status_code store_attach(store *st, const char *token, const char *model,
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
 * (positions not filled: they are first_position + i). */
status_code store_append(store *st, const char *token, uint64_t seq_id, int64_t count,
                         uint64_t ack_epoch, store_table *writes, status *s);

status_code store_get_table(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                            int with_positions, store_table *out, status *s);

status_code store_seq_release(store *st, const char *token, uint64_t seq_id, uint32_t *blocks_freed,
                              status *s);

/* End a step of a sequence with the worker's statistics (seq_step). */
status_code store_step(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                       const seq_step_input *in, uint64_t *epoch, uint32_t *evicted, status *s);

/* The sequence's current table epoch (after acking ack_epoch). */
status_code store_epoch(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                        uint64_t *epoch, status *s);

/* What Revive returns: the scratch blocks' table (one list, positions
 * filled) and each token's tier before the revive. */
typedef struct store_revive_result {
    uint64_t scratch_id;
    store_layer_table table;
    uint8_t *src_tier; /* [table.tokens] */
} store_revive_result;

/* Revive positions [first, first + count) (count 0: to the end) of the
 * caller's sequence's list (layer, head) into scratch blocks (seq_revive).
 * Free *out with store_revive_result_free. */
status_code store_revive(store *st, const char *token, uint64_t seq_id,
                         const seq_revive_request *req, store_revive_result *out, status *s);
void store_revive_result_free(store_revive_result *r);

/* Give a Revive's scratch blocks back to the pool. */
status_code store_scratch_release(store *st, const char *token, uint64_t scratch_id,
                                  uint32_t *blocks_freed, status *s);

/* Under store_lock: look a sequence up for Inspect (no ownership check). */
seq *store_find_seq_locked(store *st, uint64_t seq_id);

#endif
