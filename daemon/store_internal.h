/*
 * store_internal.h - the store's own structures, for daemon/store*.c only
 * (store.c, store_operator.c) and the store's fault tests; everyone else
 * sees the opaque handles of store.h.
 */
#ifndef KVSTASH_STORE_INTERNAL_H
#define KVSTASH_STORE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "events.h"
#include "pool.h"
#include "seq.h"
#include "store.h"

/* Blocks a Revive filled for a worker to read; the worker releases them
 * (ReleaseScratch), or they go with its session. */
typedef struct store_scratch {
    uint64_t id;
    uint32_t *blocks;
    size_t nblocks;
    struct store_scratch *next;
} store_scratch;

/* A worker: identified on the fd socket, attached to one pool by Attach. */
struct session {
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
    /* store_now_ms() of the session's last call, which renews its lease */
    uint64_t active_ms;
    uint32_t nseqs;
    store_transport transport; /* the per-step ring, once the worker asked for it */
    store_scratch *scratch;
    /* Lease-end quarantine (store_config.lease_end_quarantine): a pidfd of
     * the peer's process, opened at HELLO while it surely lives (-1: none),
     * and whether a MAP gave it the pool (a worker that never mapped the
     * pool cannot write into it). A session that ended without a detach
     * moves, with its blocks held by its pool (pool_hold_begin:
     * pool->held[held_first, + held_count)), to the store's quarantine list
     * until the pidfd turns readable (store_quarantine_reap). */
    int pidfd;
    int mapped;
    uint32_t held_first, held_count;
    uint64_t quarantined_ms; /* store_now_ms() when it entered quarantine */
    struct session *next;
};

/* Moves (a Revive's copy, a demotion, a step's decision) without the
 * lock at once; more run under the lock as before. */
#define STORE_MAX_MOVES 16

/* A queued demotion: its sequence, and whether its quantisation may run
 * on the background threads (store_move_copy): a prompt's, which is
 * large; a decode step's, which the worker's next call waits for, runs
 * at the demoter's own priority. */
typedef struct store_demotion {
    seq *q;
    int background;
} store_demotion;

struct store {
    pthread_mutex_t lock;
    /* The sequences moving without the lock (a Revive's copy, a demotion,
     * a step's decision: store_copy_unlocked):
     * nothing changes them (store_lock_seq), and no session ends
     * (lock_no_moves), until `moved` says their copy is done. While a
     * thread waits for no moves at all (move_waiters), moves run under the
     * lock, so that such a wait ends. */
    uint64_t moving[STORE_MAX_MOVES];
    size_t nmoving;
    uint32_t move_waiters;
    pthread_cond_t moved;
    /* Of them, the sequences detached from their pool (seq.h seq_detach)
     * whose steps apply without the lock: whatever reads every sequence's
     * storage (a snapshot) waits until none is (store_wait_attached), and
     * meanwhile (attach_waiters) no other detaches, so that the wait ends;
     * detached_applications counts the applications detached, and
     * detached_retries those that found they needed the lock after all
     * (seq.h SEQ_WORK_NEEDS_LOCK). */
    uint32_t ndetached, attach_waiters;
    uint64_t detached_applications, detached_retries;
    /* The threads of store_config.move_priority (NULL: none), and the
     * work they ran (store_background_moves). */
    background *background;
    uint64_t background_moves;
    /* Sequences whose steps left demotions due, planned and quantised by
     * the demoter thread after the step's reply (store_demote.c): a FIFO of
     * at most STORE_MAX_MOVES, each marked moving. */
    store_demotion *demotions;
    size_t ndemotions, demotions_head;
    int demoter_running, demoter_stop;
    pthread_cond_t demote_wake;
    pthread_t demoter;
    store_config cfg;
    events *events; /* may be NULL */
    /* Counters for /metrics (metrics.h); NULL = none. Set once before the
     * store serves anyone (main.c), never changed afterwards. */
    struct metrics *metrics;
    /* The remote tier (store_set_remote); NULL = none. Set once before the
     * store serves anyone. Its calls never run under the lock. */
    remote_tier *remote;
    /* The operators' uids (store_set_operators): set before the store serves
     * anyone, read without the lock. */
    uid_t operators[STORE_MAX_OPERATORS];
    size_t noperators;
    uint64_t start_ms;
    /* store_set_lease_timeout: reclaim sessions idle this long; 0 = never */
    uint32_t lease_timeout_ms;
    int serving;  /* 0 once shutdown began: new work gets UNAVAILABLE */
    pool **pools; /* cfg.max_pools slots, NULL when free */
    session *sessions;
    session *quarantined; /* ended sessions whose blocks wait for their process to exit */
    uint32_t nquarantined;
    int pidfd_warned; /* pidfd_open failed once: said so in the log */
    seq **seqs;
    size_t nseqs, seqs_cap;
    store_transport *closed; /* transports of ended sessions, joined outside the lock */
    size_t nclosed, closed_cap;
    uint64_t next_pool_id, next_session_id, next_seq_id, next_scratch_id;
    size_t sketch_reserved; /* sum of the sequences' seq_sketch_reserved */
    /* Bumped, lock held, by every unlock after which what a snapshot shows
     * may differ (store_unlock); read without the lock. */
    _Atomic uint64_t generation;
    /* Stats and /metrics share a snapshot (store_snapshot_for): snap was
     * built at generation snap_gen (snap_valid), at time snap_ms. Under
     * snap_lock, which is never taken with `lock` held. */
    pthread_mutex_t snap_lock;
    snapshot snap;
    uint64_t snap_gen, snap_ms;
    int snap_valid;
};

/* Lock held: the session holding `token` (attached or not) or with id `id`;
 * NULL if none. */
session *store_find_session_locked(store *st, const char *token);
session *store_find_session_id_locked(store *st, uint64_t id);

/* Lock held: reserve the worst case of q's sketch cells (seq_sketch_bytes_max)
 * against the daemon memory budget, unless q holds a reservation already.
 * RESOURCE_EXHAUSTED naming the bytes needed, those left and
 * --max-daemon-mb when they do not fit. Released with q. */
status_code store_sketch_reserve_locked(store *st, seq *q, status *s);

/* Lock held: the session holding `token`, attached when `attached`
 * (renewing its lease); UNAVAILABLE while shutting down, UNAUTHENTICATED,
 * FAILED_PRECONDITION. */
status_code store_need_session_locked(store *st, const char *token, int attached, session **out,
                                      status *s);

/* Lock held: RESOURCE_EXHAUSTED when `more` blocks would take se past
 * --session-max-blocks (`what` names the call in the message). */
status_code store_check_session_blocks_locked(store *st, const session *se, uint64_t more,
                                              const char *what, status *s);

/* Lock held: room for one more sequence of se (--max-seqs,
 * --session-max-seqs, the array); then store_seq_add_locked adds q (made
 * with id st->next_seq_id), publishing `event` ("seq.created"). */
status_code store_seq_room_locked(store *st, const session *se, status *s);
void store_seq_add_locked(store *st, session *se, seq *q, const char *event);

/* Lock held: destroy p when no session is attached to it and nothing
 * holds it (p->holds: a quarantine, an import writing its blocks). */
void store_drop_pool_if_unused_locked(store *st, pool *p);

/* Lock held: whether seq_id may copy without the lock; if so it is marked
 * moving (its own calls and calls that end sessions wait) until
 * store_move_end, which wakes them. */
int store_move_begin(store *st, uint64_t seq_id);
void store_move_end(store *st, uint64_t seq_id);

/* The remote tier's helpers (store_remote.c), shared by export, import,
 * spill and revive. The tenant part of p's remote keys ("default" for the
 * tenantless); FAILED_PRECONDITION without a remote tier; write kv[0..n)
 * with the tier's time to live, or read n keys, recording the outcome in
 * the tier's status, a failure's message prefixed "remote tier: CODE: ".
 * None takes the store's lock: call them without it. */
const char *store_remote_tenant(const pool *p);
status_code store_need_remote(const store *st, status *s);
status_code store_remote_write(remote_tier *t, const remote_kv *kv, size_t n, status *s);
status_code store_remote_read(remote_tier *t, const char *const *keys, size_t n, remote_buf *out,
                              status *s);

/* Lock held: sequence seq_id, which the caller's session may move to the
 * remote tier (`what`: "export", "spill"): its own, or any for an
 * operator. NOT_FOUND, PERMISSION_DENIED, or the session's errors. */
status_code store_remote_seq_locked(store *st, const char *token, uint64_t seq_id, const char *what,
                                    seq **out, status *s);

/* Lock held: queue the deletion of q's spilled values (store_spill.c),
 * when it has any, before it is destroyed. */
void store_spill_forget_locked(store *st, seq *q);

/* Without the lock, q marked moving: fetch the spilled victims a Revive
 * needs (seq_revive_remote) and supply them to the job. ST_OK, or the
 * remote tier's error (DATA_LOSS for a missing or corrupt value). */
status_code store_revive_fetch(store *st, seq_revive_job *job, status *s);

/* Lock held (store_lock_seq): run copy(job), a copy of seq_id's that
 * writes only memory it took and reads only seq_id's (or a step's
 * decision, which changes only seq_id's policy host), without the lock
 * when it may (store_move_begin), so that no other sequence waits for it
 * (issue 16 §3); returns copy's result, the lock held again. */
int store_copy_unlocked(store *st, uint64_t seq_id, int (*copy)(void *), void *job);

/* Lock held: wait until no sequence is detached from its pool (seq.h
 * seq_detach), before reading every sequence's storage; the lock may be
 * let go meanwhile, so call it before looking anything up. */
void store_wait_attached(store *st);

/*
 * The demoter (store_demote.c): a step's demotion off the step's critical
 * path (issue 16 §4). store_demoter_start runs the thread (store_create;
 * returns 0 or -1) and store_demoter_stop lets it finish what is queued
 * and joins it (store_destroy, before anything waits for moves).
 * store_demote_later, lock held, queues the demotion q's step left due
 * and marks q moving until the demoter has planned, quantised and
 * published it; 0 when it cannot (no room, or a thread waits for no
 * moves: the caller demotes now).
 */
int store_demoter_start(store *st);
void store_demoter_stop(store *st);
int store_demote_later(store *st, seq *q, int background);

/* Whether uid is an operator's (store_set_operators). */
int store_is_operator(const store *st, uid_t uid);

/* Not under the lock: a move's copy or quantisation fill(job) of `bytes`
 * (what it reads at full precision), or a long decision, on a background
 * thread when it is large enough to be worth one
 * (store_config.move_priority, move_background_bytes); returns fill's
 * result, *in_background (may be NULL) whether it ran there. */
int store_move_copy(const store *st, size_t bytes, int (*fill)(void *), void *job,
                    int *in_background);

/* seq_demote_fill(job), as a copy for store_copy_unlocked and
 * store_move_copy. */
int store_demote_fill(void *job);

#endif
