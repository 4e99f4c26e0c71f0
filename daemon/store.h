/*
 * store.h - the daemon's state: pools, sessions and sequences, and every
 * operation on them, independent of gRPC.
 *
 * The RPC layer (service.c) and the fd socket (fdsock.c) call these
 * functions; each takes the store's one lock, validates everything the client
 * sent, and either changes the state completely or not at all, answering with
 * a status whose message says what to fix. Reads for Stats and Inspect hold
 * the lock through store_lock()/store_unlock() and walk the structures below.
 */
#ifndef KVSTASH_STORE_H
#define KVSTASH_STORE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "events.h"
#include "pool.h"
#include "ring.h"
#include "seq.h"
#include "status.h"

#define STORE_TOKEN_LEN 32 /* hex digits */

struct metrics; /* metrics.h */

typedef struct store_config {
    size_t pool_bytes;     /* arena size of each pool */
    uint32_t max_pools;    /* models served at once */
    uint32_t max_sessions; /* connected workers */
    uint32_t max_seqs;     /* sequences over all sessions */
} store_config;

/* Blocks a Revive filled for a worker to read; the worker releases them
 * (ReleaseScratch), or they go with its session. */
typedef struct store_scratch {
    uint64_t id;
    uint32_t *blocks;
    size_t nblocks;
    struct store_scratch *next;
} store_scratch;

/* A worker: identified on the fd socket, attached to one pool by Attach. */
typedef struct session {
    uint64_t id;
    char token[STORE_TOKEN_LEN + 1];
    pid_t pid;
    uid_t uid;
    gid_t gid;
    int conn_id; /* the fd-socket connection that identified it */
    int attached;
    pool *pool;
    char name[65];
    uint64_t attached_ms; /* store_now_ms() at Attach */
    int lease_open;
    uint64_t lease_ms; /* store_now_ms() when the lease opened (operators' "lease age") */
    uint32_t nseqs;
    ring *ring; /* the per-step ring, once the worker asked for it */
    store_scratch *scratch;
    struct session *next;
} session;

typedef struct store {
    pthread_mutex_t lock;
    store_config cfg;
    events *events; /* may be NULL */
    /* Counters for /metrics (metrics.h); NULL = none. Set once before the
     * store serves anyone (main.c), never changed afterwards. */
    struct metrics *metrics;
    uint64_t start_ms;
    int serving;  /* 0 once shutdown began: new work gets UNAVAILABLE */
    pool **pools; /* cfg.max_pools slots, NULL when free */
    session *sessions;
    seq **seqs;
    size_t nseqs, seqs_cap;
    ring **closed_rings; /* rings of ended sessions, joined outside the lock */
    size_t nclosed_rings, closed_rings_cap;
    uint64_t next_pool_id, next_session_id, next_seq_id, next_scratch_id;
} store;

/* What Attach returns. */
typedef struct store_attach_result {
    uint64_t session_id, pool_id, pool_bytes, block_bytes;
    uint32_t block_count;
    pool_geometry geometry;
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

/* Initialise a store; `events` may be NULL. Returns 0 or -1 (out of memory). */
int store_init(store *st, const store_config *cfg, events *events);

/* Reclaim every session (reason "shutdown") and free everything. */
void store_destroy(store *st);

/* Stop taking new work (health turns NOT_SERVING). */
void store_begin_shutdown(store *st);
int store_serving(store *st);

void store_lock(store *st);
void store_unlock(store *st);

/* fd socket: a peer identified by SO_PEERCRED gets a session and its token. */
status_code store_session_open(store *st, pid_t pid, uid_t uid, gid_t gid, int conn_id,
                               char token[STORE_TOKEN_LEN + 1], status *s);

/* fd socket RING: a dup of the session's ring memfd (created on first use).
 * The caller closes *fd. */
status_code store_ring_fd(store *st, int conn_id, int *fd, size_t *bytes, status *s);

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

/* Create a sequence; *params receives the resolved parameters. */
status_code store_seq_create(store *st, const char *token, const char *policy,
                             const char *const *keys, const char *const *values, size_t n,
                             const char *label, uint64_t *seq_id, uint64_t *epoch,
                             policy_params *params, status *s);

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
status_code store_revive(store *st, const char *token, uint64_t seq_id, uint32_t layer,
                         uint32_t head, uint32_t first, uint32_t count, int skip_evicted,
                         store_revive_result *out, status *s);
void store_revive_result_free(store_revive_result *r);

/* Give a Revive's scratch blocks back to the pool. */
status_code store_scratch_release(store *st, const char *token, uint64_t scratch_id,
                                  uint32_t *blocks_freed, status *s);

/* Under store_lock: look a sequence up for Inspect (no ownership check). */
seq *store_find_seq_locked(store *st, uint64_t seq_id);

/* Under store_lock: the session holding `token` (attached or not) or with id
 * `id`; NULL if none. Read-only lookups for the operator calls (operator.c). */
session *store_find_session_locked(store *st, const char *token);
session *store_find_session_id_locked(store *st, uint64_t id);

#endif
