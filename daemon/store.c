#include "store.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "metrics.h"
#include "store_internal.h"

uint64_t store_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t store_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

store *store_create(const store_config *cfg, events *ev)
{
    store *st = calloc(1, sizeof *st);
    if (st == NULL)
        return NULL;
    st->cfg = *cfg;
    if (st->cfg.unlocked_decision_tokens == 0)
        st->cfg.unlocked_decision_tokens = STORE_UNLOCKED_DECISION_TOKENS;
    st->events = ev;
    st->start_ms = store_now_ms();
    st->serving = 1;
    st->next_pool_id = st->next_session_id = st->next_seq_id = st->next_scratch_id = 1;
    st->pools = calloc(cfg->max_pools ? cfg->max_pools : 1, sizeof *st->pools);
    /* Every session can have ended with a transport before the next join,
     * and as many again can still be ending (join_closed keeps those). */
    st->closed_cap = 2 * cfg->max_sessions + 1;
    st->closed = calloc(st->closed_cap, sizeof *st->closed);
    if (st->pools == NULL || st->closed == NULL) {
        free(st->pools);
        free(st->closed);
        free(st);
        return NULL;
    }
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->moved, NULL);
    pthread_mutex_init(&st->snap_lock, NULL);
    uid_t defaults[2] = {0, geteuid()};
    store_set_operators(st, defaults, 2);
    if (store_demoter_start(st) != 0) {
        store_destroy(st);
        return NULL;
    }
    /* NULL (copies on the serving thread) also when no thread can run at
     * that priority: a Revive works either way. */
    st->background = background_start(cfg->move_priority, STORE_BACKGROUND_THREADS);
    return st;
}

void store_set_metrics(store *st, struct metrics *m)
{
    st->metrics = m;
}

void store_set_remote(store *st, remote_tier *r)
{
    st->remote = r;
}

void store_remote_status(store *st, remote_tier_status *out)
{
    remote_tier_status_get(st->remote, out);
}

void store_set_operators(store *st, const uid_t *uids, size_t n)
{
    st->noperators = 0;
    for (size_t i = 0; i < n && st->noperators < STORE_MAX_OPERATORS; i++)
        if (!store_is_operator(st, uids[i]))
            st->operators[st->noperators++] = uids[i];
}

int store_is_operator(const store *st, uid_t uid)
{
    for (size_t i = 0; i < st->noperators; i++)
        if (st->operators[i] == uid)
            return 1;
    return 0;
}

size_t store_max_reply(const store *st)
{
    return st->cfg.max_reply_bytes; /* set at create, never changed: no lock */
}

const char *store_backend_name(const store *st)
{
    return (st->cfg.backend ? st->cfg.backend : &backend_host)->name;
}

void store_report_tiers(store *st, seq *q)
{
    metrics_tiers(st->metrics, seq_policy(q), seq_tier_report(q));
    seq_tier_report_clear(q);
}

void store_seq_snapshot(seq *q, snapshot_seq *out)
{
    *out = (snapshot_seq){.id = seq_id_of(q),
                          .session_id = seq_session_id(q),
                          .pool_id = seq_pool(q)->id,
                          .policy = seq_policy(q),
                          .epoch = seq_epoch(q),
                          .appended = seq_appended(q),
                          .tokens = seq_tokens_held(q),
                          .blocks = seq_blocks_held(q),
                          .retired = (uint32_t)seq_retired_count(q)};
    out->bytes = (uint64_t)out->blocks * seq_pool(q)->block_bytes;
    out->sketch_reserved = seq_sketch_reserved(q);
    out->spilled_tokens = seq_spilled_tokens(q);
    out->spilled_bytes = seq_spilled_bytes(q);
    snprintf(out->label, sizeof out->label, "%s", seq_label(q));
    seq_tier_usage(q, out->tier_tokens, out->tier_bytes);
}

static int snapshot_build(store *st, snapshot *out, uint64_t *gen);

/* Whether `who` may see session session_id's details (NULL: anyone). */
static int may_see(const store_caller *who, uint64_t session_id)
{
    return who == NULL || who->is_operator || who->session_id == session_id;
}

/* Copy pools, and the attached sessions and sequences `who` may see (NULL:
 * all), into *out; lock held. */
static void snapshot_fill(store *st, uint64_t now, const store_caller *who, snapshot *out)
{
    for (uint32_t i = 0; i < st->cfg.max_pools; i++) {
        const pool *p = st->pools[i];
        if (p == NULL)
            continue;
        snapshot_pool *ps = &out->pools[out->npools++];
        *ps = (snapshot_pool){.id = p->id,
                              .geom = p->geom,
                              .bytes = p->bytes,
                              .block_bytes = p->block_bytes,
                              .blocks_total = p->block_count,
                              .blocks_free = p->nfree,
                              .blocks_quarantined = p->nheld,
                              .sessions = p->sessions};
        snprintf(ps->model, sizeof ps->model, "%s", p->model);
        snprintf(ps->tenant, sizeof ps->tenant, "%s", p->tenant);
    }
    for (const session *se = st->sessions; se != NULL; se = se->next) {
        out->pending += !se->attached; /* counted for everyone: admission's queue */
        if (!se->attached || !may_see(who, se->id))
            continue;
        snapshot_session *ss = &out->sessions[out->nsessions++];
        *ss = (snapshot_session){.id = se->id,
                                 .pool_id = se->pool->id,
                                 .pid = (int32_t)se->pid,
                                 .uid = (uint32_t)se->uid,
                                 .nseqs = se->nseqs,
                                 .attached_age_ms = now - se->attached_ms,
                                 .lease_open = se->lease_open,
                                 .lease_age_ms = se->lease_open ? now - se->lease_ms : 0};
        snprintf(ss->name, sizeof ss->name, "%s", se->name);
        for (const store_scratch *sc = se->scratch; sc != NULL; sc = sc->next)
            ss->blocks += (uint32_t)sc->nblocks; /* its sequences' below */
    }
    for (size_t i = 0; i < st->nseqs; i++) {
        /* Every sequence counts in its pool's totals; only the visible
         * ones are listed (the slot is reused for the next otherwise). */
        snapshot_seq *qs = &out->seqs[out->nseqs];
        store_seq_snapshot(st->seqs[i], qs);
        for (size_t k = 0; k < out->npools; k++)
            if (out->pools[k].id == qs->pool_id) {
                out->pools[k].blocks_retired += qs->retired;
                for (int t = 0; t < POLICY_TIERS; t++)
                    if (t != POLICY_FULL)
                        out->pools[k].tier_bytes[t] += qs->tier_bytes[t];
            }
        for (size_t k = 0; k < out->nsessions; k++)
            if (out->sessions[k].id == qs->session_id)
                out->sessions[k].blocks += qs->blocks;
        if (may_see(who, qs->session_id))
            out->nseqs++;
    }
}

int store_snapshot(store *st, snapshot *out)
{
    return store_snapshot_for(st, NULL, out);
}

/* Copy `all` (everything) into *out as `who` may see it: the sessions and
 * sequences of others left out, the totals kept (snapshot_fill), the ages
 * `age` ms older. */
static int snapshot_copy_for(const snapshot *all, const store_caller *who, uint64_t age,
                             snapshot *out)
{
    *out = *all;
    out->uptime_ms += age;
    out->pools = malloc((all->npools + 1) * sizeof *out->pools);
    out->sessions = malloc((all->nsessions + 1) * sizeof *out->sessions);
    out->seqs = malloc((all->nseqs + 1) * sizeof *out->seqs);
    if (out->pools == NULL || out->sessions == NULL || out->seqs == NULL) {
        snapshot_free(out);
        return -1;
    }
    if (all->npools > 0)
        memcpy(out->pools, all->pools, all->npools * sizeof *out->pools);
    out->nsessions = out->nseqs = 0;
    for (size_t i = 0; i < all->nsessions; i++)
        if (may_see(who, all->sessions[i].id)) {
            snapshot_session *ss = &out->sessions[out->nsessions++];
            *ss = all->sessions[i];
            ss->attached_age_ms += age;
            ss->lease_age_ms += ss->lease_open ? age : 0;
        }
    for (size_t i = 0; i < all->nseqs; i++)
        if (may_see(who, all->seqs[i].session_id))
            out->seqs[out->nseqs++] = all->seqs[i];
    return 0;
}

int store_snapshot_for(store *st, const store_caller *who, snapshot *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&st->snap_lock);
    int rc = 0;
    /* Nothing changed since the last snapshot: it is what a new one would
     * be, but for the ages (below). A flood of Stats then walks the lists
     * under the lock once per change, not once per call (issue 12). */
    if (!st->snap_valid ||
        st->snap_gen != atomic_load_explicit(&st->generation, memory_order_relaxed)) {
        snapshot fresh;
        uint64_t gen;
        rc = snapshot_build(st, &fresh, &gen);
        if (rc == 0) {
            snapshot_free(&st->snap);
            st->snap = fresh;
            st->snap_gen = gen;
            st->snap_ms = st->start_ms + fresh.uptime_ms; /* its `now` */
            st->snap_valid = 1;
        }
    }
    if (rc == 0)
        rc = snapshot_copy_for(&st->snap, who, store_now_ms() - st->snap_ms, out);
    if (rc == 0) {
        out->events = events_count(st->events);
        remote_tier_status_get(st->remote, &out->remote); /* never waits for the network */
    }
    pthread_mutex_unlock(&st->snap_lock);
    return rc;
}

/* Everything, under the store's lock, and the generation it shows. */
static int snapshot_build(store *st, snapshot *out, uint64_t *gen)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&st->lock);
    store_wait_attached(st); /* every sequence's storage is read */
    *gen = atomic_load_explicit(&st->generation, memory_order_relaxed);
    size_t nsessions = 0;
    for (const session *se = st->sessions; se != NULL; se = se->next)
        nsessions++;
    out->pools = calloc(st->cfg.max_pools + 1, sizeof *out->pools);
    out->sessions = calloc(nsessions + 1, sizeof *out->sessions);
    out->seqs = calloc(st->nseqs + 1, sizeof *out->seqs);
    int rc = out->pools != NULL && out->sessions != NULL && out->seqs != NULL ? 0 : -1;
    if (rc == 0) {
        uint64_t now = store_now_ms();
        out->serving = st->serving;
        out->backend = store_backend_name(st);
        (st->cfg.backend ? st->cfg.backend : &backend_host)->describe(&out->backend_info);
        out->lease_end_quarantine = st->cfg.lease_end_quarantine;
        out->quarantined_sessions = st->nquarantined;
        for (const session *q = st->quarantined; q != NULL; q = q->next)
            out->quarantined_blocks += q->held_count;
        out->uptime_ms = now - st->start_ms;
        out->events = events_count(st->events);
        out->mem_limit = st->cfg.max_daemon_bytes;
        out->mem_reserved = st->sketch_reserved;
        out->max_reply = st->cfg.max_reply_bytes;
        out->session_max_seqs = st->cfg.session_max_seqs;
        out->session_max_blocks = st->cfg.session_max_blocks;
        snapshot_fill(st, now, NULL, out);
    }
    pthread_mutex_unlock(&st->lock);
    if (rc != 0)
        snapshot_free(out);
    return rc;
}

void store_lock(store *st)
{
    pthread_mutex_lock(&st->lock);
}

static int seq_moving(const store *st, uint64_t seq_id)
{
    for (size_t i = 0; i < st->nmoving; i++)
        if (st->moving[i] == seq_id)
            return 1;
    return 0;
}

void store_lock_seq(store *st, uint64_t seq_id)
{
    pthread_mutex_lock(&st->lock);
    while (seq_moving(st, seq_id))
        pthread_cond_wait(&st->moved, &st->lock);
}

/* store_lock for a call that may end sessions or release sequences of
 * any session: waits until no Revive copies without the lock. */
static void lock_no_moves(store *st)
{
    pthread_mutex_lock(&st->lock);
    st->move_waiters++;
    while (st->nmoving > 0)
        pthread_cond_wait(&st->moved, &st->lock);
    st->move_waiters--;
}

/* Lock held: whether a Revive of seq_id may copy without the lock; if so,
 * the sequence is marked moving until move_end. */
int store_move_begin(store *st, uint64_t seq_id)
{
    if (st->move_waiters > 0 || st->nmoving == STORE_MAX_MOVES)
        return 0;
    st->moving[st->nmoving++] = seq_id;
    return 1;
}

/* Lock held: seq_id's copy is done; wake whoever waits for it. */
void store_move_end(store *st, uint64_t seq_id)
{
    for (size_t i = 0; i < st->nmoving; i++)
        if (st->moving[i] == seq_id) {
            st->moving[i] = st->moving[--st->nmoving];
            break;
        }
    pthread_cond_broadcast(&st->moved);
}

int store_copy_unlocked(store *st, uint64_t seq_id, int (*copy)(void *), void *job)
{
    if (!store_move_begin(st, seq_id))
        return copy(job);
    store_unlock(st);
    int rc = copy(job);
    pthread_mutex_lock(&st->lock);
    store_move_end(st, seq_id);
    return rc;
}

int store_demote_fill(void *job)
{
    return seq_demote_fill(job);
}

/* Lock held: what q's step left due is quantised without the lock (seq.h
 * seq_demote_plan): planned, quantised and published by the demoter after
 * the step's reply, at the epoch after the one the reply gives
 * (store_demote.c); or, when the demoter cannot take it, now, sharing the
 * step's epoch when the step changed the tables (epoch0: q's epoch before
 * the step). A demotion that cannot run waits for the next step: the step
 * still succeeds. */
static void demote_due(store *st, seq *q, uint64_t epoch0, int prefill)
{
    if (!seq_demote_is_due(q) || store_demote_later(st, q, prefill))
        return;
    uint64_t epoch = seq_epoch(q) > epoch0 ? seq_epoch(q) : seq_epoch(q) + 1;
    seq_demote_job *job;
    status s = {0};
    if (seq_demote_plan(q, epoch, &job, &s) == ST_OK && job != NULL) {
        seq_step_cuts_forget(q); /* the step's answer is no longer its cuts alone */
        seq_demote_finish(job, store_copy_unlocked(st, seq_id_of(q), store_demote_fill, job), &s);
    }
    if (s.code != ST_OK)
        log_warn("demote_deferred", "seq=%llu reason=\"%s\"", (unsigned long long)seq_id_of(q),
                 s.msg);
}

/* Every unlock after which a snapshot may show something else bumps the
 * generation (store_snapshot_for); the reads unlock without. */
void store_unlock(store *st)
{
    atomic_fetch_add_explicit(&st->generation, 1, memory_order_relaxed);
    pthread_mutex_unlock(&st->lock);
}

void store_table_free(store_table *t)
{
    if (t->lists != NULL)
        for (uint32_t l = 0; l < t->nlists; l++) {
            free(t->lists[l].segs);
            free(t->lists[l].tiers);
            free(t->lists[l].positions);
        }
    free(t->lists);
    free(t->moves);
    memset(t, 0, sizeof *t);
}

/* ---- lookups (lock held) ---------------------------------------------- */

static session *find_session_by_token(store *st, const char *token)
{
    if (token == NULL)
        return NULL;
    for (session *s = st->sessions; s != NULL; s = s->next) {
        /* Constant-time compare: tokens are credentials. */
        unsigned diff = strlen(token) != STORE_TOKEN_LEN;
        for (size_t i = 0; i < STORE_TOKEN_LEN && !diff; i++)
            diff |= (unsigned)(s->token[i] ^ token[i]);
        if (!diff)
            return s;
    }
    return NULL;
}

static session *find_session_by_conn(store *st, int conn_id)
{
    session *se = st->sessions;
    while (se != NULL && se->conn_id != conn_id)
        se = se->next;
    return se;
}

static session *find_session_by_id(store *st, uint64_t id)
{
    session *se = st->sessions;
    while (se != NULL && se->id != id)
        se = se->next;
    return se;
}

status_code store_need_session_locked(store *st, const char *token, int attached, session **out,
                                      status *s)
{
    *out = NULL;
    if (!st->serving)
        return status_set(s, ST_UNAVAILABLE, "kvstashd is shutting down");
    if (token == NULL || token[0] == '\0')
        return status_set(s, ST_UNAUTHENTICATED,
                          "this call needs the kvstash-token metadata from the fd-socket "
                          "handshake (docs/protocol.md)");
    session *se = find_session_by_token(st, token);
    if (se == NULL)
        return status_set(s, ST_UNAUTHENTICATED,
                          "unknown session token (the session ended, or the token is wrong)");
    if (attached && !se->attached)
        return status_set(s, ST_FAILED_PRECONDITION, "session is not attached: call Attach first");
    se->active_ms = store_now_ms(); /* any call renews the lease */
    *out = se;
    return ST_OK;
}

static ssize_t find_seq_index(store *st, uint64_t seq_id)
{
    for (size_t i = 0; i < st->nseqs; i++)
        if (seq_id_of(st->seqs[i]) == seq_id)
            return (ssize_t)i;
    return -1;
}

seq *store_find_seq_locked(store *st, uint64_t seq_id)
{
    ssize_t i = find_seq_index(st, seq_id);
    return i < 0 ? NULL : st->seqs[i];
}

session *store_find_session_locked(store *st, const char *token)
{
    return find_session_by_token(st, token);
}

session *store_find_session_id_locked(store *st, uint64_t id)
{
    return find_session_by_id(st, id);
}

static status_code need_own_seq(store *st, session *se, uint64_t seq_id, size_t *index, status *s)
{
    ssize_t i = find_seq_index(st, seq_id);
    if (i < 0)
        return status_set(s, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)seq_id);
    if (seq_session_id(st->seqs[i]) != se->id)
        return status_set(s, ST_PERMISSION_DENIED, "sequence %llu belongs to another session",
                          (unsigned long long)seq_id);
    *index = (size_t)i;
    return ST_OK;
}

/* store_identify with the lock held. */
static status_code identify_locked(store *st, const char *token, store_caller *out, status *s)
{
    *out = (store_caller){0, geteuid(), 0};
    /* Not need_session: the views still answer while shutting down. */
    if (token != NULL) {
        session *se = find_session_by_token(st, token);
        if (se == NULL)
            return status_set(s, ST_UNAUTHENTICATED,
                              token[0] == '\0' ? "the kvstash-token metadata is empty"
                                               : "unknown session token (the session ended, or "
                                                 "the token is wrong)");
        out->session_id = se->id;
        out->uid = se->uid;
    }
    out->is_operator = store_is_operator(st, out->uid);
    return ST_OK;
}

status_code store_identify(store *st, const char *token, store_caller *out, status *s)
{
    pthread_mutex_lock(&st->lock);
    status_code rc = identify_locked(st, token, out, s);
    pthread_mutex_unlock(&st->lock);
    return rc;
}

status_code store_find_seq_visible_locked(store *st, const char *token, uint64_t seq_id, seq **out,
                                          status *s)
{
    store_caller who;
    *out = NULL;
    status_code rc = identify_locked(st, token, &who, s);
    seq *q = rc == ST_OK ? store_find_seq_locked(st, seq_id) : NULL;
    if (rc != ST_OK)
        return rc;
    if (q == NULL)
        return status_set(s, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)seq_id);
    if (!may_see(&who, seq_session_id(q)))
        return status_set(s, ST_PERMISSION_DENIED,
                          "sequence %llu belongs to another session; uid %u is not in "
                          "kvstashd's operator_uids",
                          (unsigned long long)seq_id, (unsigned)who.uid);
    *out = q;
    return ST_OK;
}

/* ---- reclaiming ------------------------------------------------------- */

/* The sequence at i out of the store, its blocks back in the pool; the
 * caller destroys it (seq_destroy), with the lock or after letting it go:
 * nothing else reaches it any more. */
static seq *unlink_seq_at(store *st, size_t i, uint32_t *blocks)
{
    seq *q = st->seqs[i];
    *blocks = seq_blocks_held(q);
    st->sketch_reserved -= seq_sketch_reserved(q);
    st->seqs[i] = st->seqs[--st->nseqs];
    store_spill_forget_locked(st, q);
    seq_give_back_blocks(q);
    return q;
}

static uint32_t release_seq_at(store *st, size_t i)
{
    uint32_t blocks;
    seq_destroy(unlink_seq_at(st, i, &blocks));
    return blocks;
}

/* A pool goes when no session is attached to it and no quarantine holds
 * its blocks: a worker of a quarantined session may still write into the
 * arena (docs/reliability.md, "Lease end"). */
void store_drop_pool_if_unused_locked(store *st, pool *p)
{
    if (p == NULL || p->sessions > 0 || p->holds > 0)
        return;
    for (uint32_t i = 0; i < st->cfg.max_pools; i++)
        if (st->pools[i] == p)
            st->pools[i] = NULL;
    log_info("pool_destroyed", "pool=%llu model=%s", (unsigned long long)p->id, p->model);
    pool_destroy(p);
}

static uint32_t scratch_free(pool *p, store_scratch *sc)
{
    uint32_t n = (uint32_t)sc->nblocks;
    for (size_t i = 0; i < sc->nblocks; i++)
        pool_free_block(p, sc->blocks[i]);
    free(sc->blocks);
    free(sc);
    return n;
}

/* Whether se's blocks wait for its process to exit when it ends without a
 * detach: quarantine is on, the worker mapped the pool, and a pidfd says
 * when its process is gone. */
static int quarantine_applies(const store *st, const session *se)
{
    return st->cfg.lease_end_quarantine && se->attached && se->mapped && se->pidfd >= 0;
}

/* se ended holding held_count blocks of its pool: keep it, and the pool,
 * until its process exits. */
static void quarantine_enter(store *st, session *se, const char *reason)
{
    se->pool->holds++;
    se->quarantined_ms = store_now_ms();
    se->next = st->quarantined;
    st->quarantined = se;
    st->nquarantined++;
    events_publish(st->events, "worker.quarantined",
                   json_pack("{sI sI sI ss sI}", "session", (json_int_t)se->id, "pid",
                             (json_int_t)se->pid, "pool", (json_int_t)se->pool->id, "reason",
                             reason, "blocks", (json_int_t)se->held_count));
    log_info("session_quarantined", "session=%llu pid=%d pool=%llu reason=%s blocks=%u",
             (unsigned long long)se->id, (int)se->pid, (unsigned long long)se->pool->id, reason,
             se->held_count);
}

/* Give a quarantined session's blocks back to its pool and forget it;
 * `why` is "process-exited" or "shutdown". */
static void quarantine_release(store *st, session *se, const char *why)
{
    pool *p = se->pool;
    pool_hold_free(p, se->held_first, se->held_count);
    for (session *o = st->quarantined; o != NULL; o = o->next)
        if (o->pool == p && o->held_first > se->held_first)
            o->held_first -= se->held_count; /* pool_hold_free moved them down */
    for (session **pp = &st->quarantined; *pp != NULL; pp = &(*pp)->next)
        if (*pp == se) {
            *pp = se->next;
            break;
        }
    st->nquarantined--;
    p->holds--;
    uint64_t held_ms = store_now_ms() - se->quarantined_ms;
    events_publish(st->events, "worker.released",
                   json_pack("{sI sI sI ss sI sI}", "session", (json_int_t)se->id, "pid",
                             (json_int_t)se->pid, "pool", (json_int_t)p->id, "reason", why,
                             "blocks", (json_int_t)se->held_count, "held_ms", (json_int_t)held_ms));
    log_info("quarantine_released",
             "session=%llu pid=%d pool=%llu reason=%s blocks=%u held_ms=%llu",
             (unsigned long long)se->id, (int)se->pid, (unsigned long long)p->id, why,
             se->held_count, (unsigned long long)held_ms);
    close(se->pidfd);
    free(se);
    store_drop_pool_if_unused_locked(st, p);
}

/* Release everything a session holds and forget it. A session that ends
 * without a detach (may_quarantine) whose blocks its worker may still
 * write is quarantined instead (quarantine_applies): its sequences and
 * scratch end as always, but their blocks stay out of the free stack. */
static void session_end(store *st, session *se, const char *reason, int may_quarantine)
{
    uint32_t nseqs = 0, blocks = 0;
    int hold = may_quarantine && quarantine_applies(st, se);
    uint32_t first = hold ? pool_hold_begin(se->pool) : 0;
    while (se->scratch != NULL) {
        store_scratch *next = se->scratch->next;
        blocks += scratch_free(se->pool, se->scratch);
        se->scratch = next;
    }
    for (size_t i = 0; i < st->nseqs;) {
        if (seq_session_id(st->seqs[i]) == se->id) {
            blocks += release_seq_at(st, i);
            nseqs++;
        } else {
            i++;
        }
    }
    if (hold) {
        se->held_first = first;
        se->held_count = pool_hold_end(se->pool, first);
        hold = se->held_count > 0;
    }
    for (session **pp = &st->sessions; *pp != NULL; pp = &(*pp)->next)
        if (*pp == se) {
            *pp = se->next;
            break;
        }
    if (se->transport.impl != NULL) {
        se->transport.close(se->transport.impl);
        if (st->nclosed < st->closed_cap)
            st->closed[st->nclosed++] = se->transport;
        else
            log_error("ring_leaked", "session=%llu", (unsigned long long)se->id);
    }
    if (se->attached) {
        metrics_reclaimed(st->metrics, reason); /* metrics hook */
        se->pool->sessions--;
        events_publish(st->events, "worker.reclaimed",
                       json_pack("{sI sI ss sI sI}", "session", (json_int_t)se->id, "pid",
                                 (json_int_t)se->pid, "reason", reason, "sequences",
                                 (json_int_t)nseqs, "blocks", (json_int_t)blocks));
        log_info("session_reclaimed", "session=%llu pid=%d reason=%s sequences=%u blocks=%u",
                 (unsigned long long)se->id, (int)se->pid, reason, nseqs, blocks);
        if (hold)
            quarantine_enter(st, se, reason);
        store_drop_pool_if_unused_locked(st, se->pool);
    }
    if (hold)
        return;
    if (se->pidfd >= 0)
        close(se->pidfd);
    free(se);
}

/* Join the closed transports whose threads have ended, or all of them when
 * `wait` (shutdown). Takes and drops the lock itself: a ring thread may be
 * waiting for it. Admission (the fd-socket thread) never waits here, so no
 * peer can hold it by keeping its ring thread busy (issue 12); a thread not
 * ended yet stays listed for a later call. */
static void join_closed(store *st, int wait)
{
    pthread_mutex_lock(&st->lock);
    size_t n = 0, kept = 0;
    store_transport *ended = malloc((st->nclosed ? st->nclosed : 1) * sizeof *ended);
    for (size_t i = 0; ended != NULL && i < st->nclosed; i++) {
        store_transport t = st->closed[i];
        if (wait || t.ended(t.impl))
            ended[n++] = t;
        else
            st->closed[kept++] = t;
    }
    if (ended != NULL)
        st->nclosed = kept;
    store_unlock(st);
    for (size_t i = 0; i < n; i++)
        ended[i].join(ended[i].impl);
    free(ended);
}

void store_destroy(store *st)
{
    if (st == NULL)
        return;
    store_demoter_stop(st);
    lock_no_moves(st);
    while (st->sessions != NULL)
        session_end(st, st->sessions, "shutdown", 0);
    while (st->quarantined != NULL)
        quarantine_release(st, st->quarantined, "shutdown");
    pthread_mutex_unlock(&st->lock);
    join_closed(st, 1);
    background_stop(st->background);
    free(st->closed);
    free(st->seqs);
    free(st->pools);
    snapshot_free(&st->snap);
    pthread_mutex_destroy(&st->snap_lock);
    pthread_cond_destroy(&st->moved);
    pthread_mutex_destroy(&st->lock);
    free(st);
}

void store_begin_shutdown(store *st)
{
    pthread_mutex_lock(&st->lock);
    st->serving = 0;
    store_unlock(st);
}

int store_serving(store *st)
{
    pthread_mutex_lock(&st->lock);
    int v = st->serving;
    pthread_mutex_unlock(&st->lock);
    return v;
}

/* ---- sessions ----------------------------------------------------------- */

static int make_token(char out[STORE_TOKEN_LEN + 1])
{
    unsigned char raw[STORE_TOKEN_LEN / 2];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
        return -1;
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return 0;
}

/* A pidfd of pid (close-on-exec, as pidfd_open makes every one), or -1
 * with errno set. */
static int open_pidfd(pid_t pid)
{
#ifdef SYS_pidfd_open
    if (pid > 0)
        return (int)syscall(SYS_pidfd_open, pid, 0);
    errno = ESRCH; /* SO_PEERCRED says 0 for a peer in another pid namespace */
#else
    (void)pid;
    errno = ENOSYS;
#endif
    return -1;
}

/* Lock held: se->pidfd for the lease-end quarantine, when it is on. */
static void session_watch_process(store *st, session *se)
{
    if (!st->cfg.lease_end_quarantine)
        return;
    se->pidfd = open_pidfd(se->pid);
    if (se->pidfd >= 0)
        return;
    int err = errno;
    /* Said once at warn (an old kernel says it for every session), then at debug. */
    if (!st->pidfd_warned)
        log_warn("pidfd_unavailable",
                 "session=%llu pid=%d err=\"%s\" lease_end=free why=\"pidfd_open failed: the "
                 "blocks of sessions without a pidfd are freed when they end, not quarantined\"",
                 (unsigned long long)se->id, (int)se->pid, strerror(err));
    else
        log_debug("pidfd_unavailable", "session=%llu pid=%d err=\"%s\" lease_end=free",
                  (unsigned long long)se->id, (int)se->pid, strerror(err));
    st->pidfd_warned = 1;
}

static uint32_t count_sessions(store *st)
{
    uint32_t n = 0;
    for (session *s = st->sessions; s != NULL; s = s->next)
        n++;
    return n;
}

status_code store_session_open(store *st, pid_t pid, uid_t uid, gid_t gid, int conn_id,
                               char token[STORE_TOKEN_LEN + 1], status *s)
{
    status_code rc = ST_OK;
    pthread_mutex_lock(&st->lock);
    session *se = NULL;
    if (!st->serving)
        rc = status_set(s, ST_UNAVAILABLE, "kvstashd is shutting down");
    else if (count_sessions(st) >= st->cfg.max_sessions)
        rc = status_set(s, ST_RESOURCE_EXHAUSTED, "too many sessions (%u)", st->cfg.max_sessions);
    else if ((se = calloc(1, sizeof *se)) == NULL)
        rc = status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    else if (make_token(se->token) != 0)
        rc = status_set(s, ST_INTERNAL, "getrandom failed");
    if (rc == ST_OK) {
        se->id = st->next_session_id++;
        se->pid = pid;
        se->uid = uid;
        se->gid = gid;
        se->conn_id = conn_id;
        se->pidfd = -1;
        session_watch_process(st, se);
        se->next = st->sessions;
        st->sessions = se;
        memcpy(token, se->token, sizeof se->token);
    } else {
        free(se);
    }
    store_unlock(st);
    return rc;
}

status_code store_transport_fd(store *st, int conn_id, store_transport_open open, size_t want_bytes,
                               int *fd, size_t *bytes, status *s)
{
    join_closed(st, 0); /* a cheap moment to reap ended sessions' threads */
    status_code rc = ST_OK;
    *fd = -1;
    pthread_mutex_lock(&st->lock);
    session *se = find_session_by_conn(st, conn_id);
    store_transport *t = se != NULL ? &se->transport : NULL;
    if (se != NULL)
        se->active_ms = store_now_ms(); /* renews the lease */
    if (se == NULL || !se->attached)
        rc = status_set(s, ST_FAILED_PRECONDITION, "not attached: call Attach first");
    else if (t->impl == NULL && (rc = open(st, se->token, want_bytes, t, s)) != ST_OK)
        *t = (store_transport){0};
    if (rc == ST_OK && (*fd = fcntl(t->fd(t->impl), F_DUPFD_CLOEXEC, 0)) < 0)
        rc = status_set(s, ST_INTERNAL, "cannot duplicate the ring fd");
    if (rc == ST_OK)
        *bytes = t->bytes(t->impl);
    store_unlock(st);
    return rc;
}

size_t store_attached_conns(store *st, int *ids, size_t cap)
{
    size_t n = 0;
    pthread_mutex_lock(&st->lock);
    for (const session *se = st->sessions; se != NULL; se = se->next)
        if (se->attached && n++ < cap)
            ids[n - 1] = se->conn_id;
    pthread_mutex_unlock(&st->lock);
    return n;
}

void store_set_lease_timeout(store *st, uint32_t ms)
{
    st->lease_timeout_ms = ms;
}

uint32_t store_expire_leases(store *st)
{
    uint32_t n = 0;
    lock_no_moves(st);
    uint64_t now = store_now_ms();
    for (session *se = st->sessions, *next; se != NULL; se = next) {
        next = se->next; /* session_end frees se */
        if (st->lease_timeout_ms == 0 || !se->attached ||
            now - se->active_ms <= st->lease_timeout_ms)
            continue;
        log_warn("lease_expired", "session=%llu pid=%d idle_ms=%llu lease_timeout_ms=%u",
                 (unsigned long long)se->id, (int)se->pid,
                 (unsigned long long)(now - se->active_ms), st->lease_timeout_ms);
        session_end(st, se, "lease-timeout", 1);
        n++;
    }
    store_unlock(st);
    /* Reap ended sessions' rings (threads, memfds) now rather than at the
     * next RING request, which may never come; never waits (join_closed). */
    join_closed(st, 0);
    return n;
}

/* Whether the process behind pidfd has exited: a pidfd polls readable
 * then (pidfd_open(2)); an error also ends the wait, rather than holding
 * the blocks for ever. */
static int process_exited(int pidfd)
{
    struct pollfd pf = {pidfd, POLLIN, 0};
    return poll(&pf, 1, 0) > 0;
}

uint32_t store_quarantine_reap(store *st)
{
    uint32_t n = 0;
    pthread_mutex_lock(&st->lock);
    if (st->quarantined == NULL) {
        pthread_mutex_unlock(&st->lock); /* nothing changed: no new snapshot */
        return 0;
    }
    for (session *se = st->quarantined, *next; se != NULL; se = next) {
        next = se->next; /* quarantine_release frees se */
        if (process_exited(se->pidfd)) {
            quarantine_release(st, se, "process-exited");
            n++;
        }
    }
    if (n > 0)
        store_unlock(st);
    else
        pthread_mutex_unlock(&st->lock);
    return n;
}

void store_session_conn_closed(store *st, int conn_id)
{
    lock_no_moves(st);
    session *se = find_session_by_conn(st, conn_id);
    if (se != NULL)
        session_end(st, se, "fd-closed", 1);
    store_unlock(st);
}

status_code store_pool_share(store *st, int conn_id, uint64_t pool_id, backend_share *sh, status *s)
{
    status_code rc = ST_OK;
    sh->fd = -1;
    pthread_mutex_lock(&st->lock);
    session *se = find_session_by_conn(st, conn_id);
    if (se != NULL)
        se->active_ms = store_now_ms(); /* renews the lease */
    if (se == NULL || !se->attached)
        rc = status_set(s, ST_FAILED_PRECONDITION, "not attached: call Attach first");
    else if (se->pool->id != pool_id)
        rc = status_set(s, ST_PERMISSION_DENIED, "session is attached to pool %llu, not %llu",
                        (unsigned long long)se->pool->id, (unsigned long long)pool_id);
    else if ((rc = pool_share(se->pool, sh, s)) == ST_OK)
        se->mapped = 1; /* its process can write the arena from now on */
    store_unlock(st);
    return rc;
}

/* ---- attach ------------------------------------------------------------- */

/* A model's or tenant's name: 1 to 64 of [A-Za-z0-9._-] (`what` names it;
 * a tenant may also be empty, the default). */
static status_code check_name(const char *what, const char *name, int may_be_empty, status *s)
{
    size_t n = strlen(name);
    if ((n == 0 && !may_be_empty) || n > 64)
        return status_set(s, ST_INVALID_ARGUMENT, "%s must be %s to 64 characters, got %zu", what,
                          may_be_empty ? "0" : "1", n);
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)name[i]) && !strchr("._-", name[i]))
            return status_set(s, ST_INVALID_ARGUMENT,
                              "%s may contain only letters, digits, '.', '_' and '-'", what);
    return ST_OK;
}

/* The pool of (tenant, model): one per tenant, so that a tenant's workers
 * never map another tenant's memfd. */
static status_code find_or_create_pool(store *st, const char *tenant, const char *model,
                                       const pool_geometry *g, pool **out, status *s)
{
    int free_slot = -1;
    for (uint32_t i = 0; i < st->cfg.max_pools; i++) {
        pool *p = st->pools[i];
        if (p == NULL) {
            if (free_slot < 0)
                free_slot = (int)i;
            continue;
        }
        if (strcmp(p->model, model) != 0 || strcmp(p->tenant, tenant) != 0)
            continue;
        if (!pool_geometry_equal(&p->geom, g)) {
            char have[192], want[192];
            pool_geometry_format(&p->geom, have, sizeof have);
            pool_geometry_format(g, want, sizeof want);
            return status_set(s, ST_FAILED_PRECONDITION,
                              "geometry mismatch: model '%s' is served with %s; the request has %s",
                              model, have, want);
        }
        *out = p;
        return ST_OK;
    }
    if (free_slot < 0)
        return status_set(s, ST_RESOURCE_EXHAUSTED,
                          "kvstashd already serves %u models (--max-pools)", st->cfg.max_pools);
    if (pool_create(st->next_pool_id, model, g, st->cfg.pool_bytes,
                    st->cfg.backend ? st->cfg.backend : &backend_host, out, s) != ST_OK)
        return s->code;
    st->next_pool_id++;
    (*out)->layout.quant_group = st->cfg.quant_group;
    (*out)->policy_threads = st->cfg.policy_threads;
    (*out)->policy_parallel_tokens = st->cfg.policy_parallel_tokens;
    st->pools[free_slot] = *out;
    snprintf((*out)->tenant, sizeof(*out)->tenant, "%s", tenant);
    log_info("pool_created", "pool=%llu model=%s tenant=%s blocks=%u block_bytes=%zu",
             (unsigned long long)(*out)->id, model, tenant, (*out)->block_count,
             (*out)->block_bytes);
    return ST_OK;
}

status_code store_attach(store *st, const char *token, const char *model,
                         const pool_geometry *geometry, const char *worker_name,
                         store_attach_result *out, status *s)
{
    return store_attach_tenant(st, token, "", model, geometry, worker_name, out, s);
}

status_code store_attach_tenant(store *st, const char *token, const char *tenant, const char *model,
                                const pool_geometry *geometry, const char *worker_name,
                                store_attach_result *out, status *s)
{
    pool_geometry g = *geometry;
    if (check_name("model", model, 0, s) != ST_OK || check_name("tenant", tenant, 1, s) != ST_OK ||
        pool_geometry_check(&g, s) != ST_OK)
        return s->code;
    if (strlen(worker_name) > 64)
        return status_set(s, ST_INVALID_ARGUMENT, "worker_name must be at most 64 bytes");
    pthread_mutex_lock(&st->lock);
    session *se;
    pool *p = NULL;
    status_code rc = store_need_session_locked(st, token, 0, &se, s);
    if (rc == ST_OK && se->attached)
        rc = status_set(s, ST_FAILED_PRECONDITION,
                        "session %llu is already attached; a token attaches once",
                        (unsigned long long)se->id);
    if (rc == ST_OK)
        rc = find_or_create_pool(st, tenant, model, &g, &p, s);
    if (rc == ST_OK) {
        se->attached = 1;
        se->pool = p;
        p->sessions++;
        snprintf(se->name, sizeof se->name, "%s", worker_name);
        se->attached_ms = store_now_ms();
        *out = (store_attach_result){se->id,         p->id,   p->bytes,        p->block_bytes,
                                     p->block_count, p->geom, p->backend->name};
        events_publish(st->events, "worker.attached",
                       json_pack("{sI sI sI sI ss}", "session", (json_int_t)se->id, "pid",
                                 (json_int_t)se->pid, "uid", (json_int_t)se->uid, "pool",
                                 (json_int_t)p->id, "name", se->name));
        log_info("session_attached", "session=%llu pid=%d uid=%u pool=%llu model=%s",
                 (unsigned long long)se->id, (int)se->pid, (unsigned)se->uid,
                 (unsigned long long)p->id, model);
    }
    store_unlock(st);
    return rc;
}

status_code store_lease_begin(store *st, const char *token, uint64_t *session_id, status *s)
{
    pthread_mutex_lock(&st->lock);
    session *se;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK && se->lease_open)
        rc = status_set(s, ST_FAILED_PRECONDITION, "session %llu already holds its lease",
                        (unsigned long long)se->id);
    if (rc == ST_OK) {
        se->lease_open = 1;
        se->lease_ms = store_now_ms();
        *session_id = se->id;
    }
    store_unlock(st);
    return rc;
}

void store_lease_end(store *st, uint64_t session_id)
{
    lock_no_moves(st);
    session *se = find_session_by_id(st, session_id);
    if (se != NULL)
        session_end(st, se, "lease-ended", 1);
    store_unlock(st);
}

status_code store_detach(store *st, const char *token, uint32_t *released, status *s)
{
    lock_no_moves(st);
    session *se;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK) {
        *released = 0;
        for (size_t i = 0; i < st->nseqs; i++)
            *released += seq_session_id(st->seqs[i]) == se->id;
        session_end(st, se, "detach", 0);
    }
    store_unlock(st);
    return rc;
}

/* ---- limits (docs/reliability.md) --------------------------------- */

static void format_bytes(uint64_t b, char *out, size_t len)
{
    if (b >= (1ull << 30))
        snprintf(out, len, "%.1f GiB", (double)b / (double)(1ull << 30));
    else
        snprintf(out, len, "%.1f MiB", (double)b / (double)(1ull << 20));
}

status_code store_sketch_reserve_locked(store *st, seq *q, status *s)
{
    if (seq_sketch_reserved(q) > 0)
        return ST_OK;
    size_t need = seq_sketch_bytes_max(q), limit = st->cfg.max_daemon_bytes;
    size_t left = limit > st->sketch_reserved ? limit - st->sketch_reserved : 0;
    if (limit != 0 && need > left) {
        char n[32], l[32], m[32];
        format_bytes(need, n, sizeof n);
        format_bytes(left, l, sizeof l);
        format_bytes(limit, m, sizeof m);
        return status_set(s, ST_RESOURCE_EXHAUSTED,
                          "sketches of %u lists need %s of daemon memory, %s left of "
                          "--max-daemon-mb (%s): lower sketch_rows/sketch_buckets or raise "
                          "--max-daemon-mb",
                          seq_layers(q) * seq_heads(q), n, l, m);
    }
    /* Without a limit the reservation is still counted, for Stats; what a
     * saturated sum could not add is not given back either. */
    size_t room = SIZE_MAX - st->sketch_reserved, taken = need < room ? need : room;
    st->sketch_reserved += taken;
    seq_set_sketch_reserved(q, taken);
    return ST_OK;
}

/* Pool blocks session se holds: its sequences' (tables and retired) and
 * its revive scratch. O(segments of its sequences). */
static uint64_t session_blocks(store *st, const session *se)
{
    uint64_t n = 0;
    for (size_t i = 0; i < st->nseqs; i++)
        if (seq_session_id(st->seqs[i]) == se->id)
            n += seq_blocks_held(st->seqs[i]);
    for (const store_scratch *sc = se->scratch; sc != NULL; sc = sc->next)
        n += sc->nblocks;
    return n;
}

/* RESOURCE_EXHAUSTED when `more` blocks would take se past
 * --session-max-blocks. */
status_code store_check_session_blocks_locked(store *st, const session *se, uint64_t more,
                                              const char *what, status *s)
{
    uint32_t quota = st->cfg.session_max_blocks;
    if (quota == 0 || more == 0)
        return ST_OK;
    uint64_t held = session_blocks(st, se);
    if (held + more <= quota)
        return ST_OK;
    return status_set(s, ST_RESOURCE_EXHAUSTED,
                      "%s needs %llu more pool blocks; session %llu holds %llu of "
                      "--session-max-blocks %u: release sequences or scratch, or raise it",
                      what, (unsigned long long)more, (unsigned long long)se->id,
                      (unsigned long long)held, quota);
}

/* Bytes of a protobuf varint holding v. */
static uint64_t varint_bytes(uint64_t v)
{
    uint64_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* The most bytes a position up to max_pos takes in form f. */
static uint64_t position_bytes(const store_reply_form *f, uint64_t max_pos)
{
    return f->position_bytes != 0 ? f->position_bytes : varint_bytes(max_pos);
}

/* An Append's reply bound in form f: the new tokens of every list, their
 * segments (per list, one in the tail block and one per fresh block), and
 * with positions each token's (service.c fills them for appends). */
static uint64_t append_reply_bytes(const seq *q, uint32_t count, const store_reply_form *f)
{
    uint64_t nlists = (uint64_t)seq_layers(q) * seq_heads(q);
    uint64_t segs = seq_append_blocks(q, count) + nlists;
    uint64_t max_pos = seq_appended(q) + count;
    return f->fixed_bytes + nlists * f->list_bytes + segs * f->segment_bytes +
           (f->positions ? nlists * count * position_bytes(f, max_pos) : 0);
}

/* RESOURCE_EXHAUSTED when an Append of count tokens to q would build a reply
 * above f's limit: gRPC's own status for a message over its limit, and the
 * worker's cue to split the append (the message says into what). */
static status_code check_append_reply(const seq *q, int64_t count, const store_reply_form *f,
                                      status *s)
{
    uint64_t bytes = append_reply_bytes(q, (uint32_t)count, f);
    if (f->limit == 0 || bytes <= f->limit)
        return ST_OK;
    uint32_t lo = 0, hi = (uint32_t)count; /* the largest count whose reply fits */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        if (append_reply_bytes(q, mid, f) <= f->limit)
            lo = mid;
        else
            hi = mid - 1;
    }
    return status_set(s, ST_RESOURCE_EXHAUSTED,
                      "an Append of %lld tokens could reply %llu bytes (%u lists), over %s "
                      "(%llu bytes): append at most %u tokens a call; nothing was appended",
                      (long long)count, (unsigned long long)bytes, seq_layers(q) * seq_heads(q),
                      f->limit_name, (unsigned long long)f->limit, lo);
}

store_reply_form store_reply_rpc(const store *st)
{
    /* LayerTable (service.c): fields and headers, three packed varints and
     * a tier a segment, a varint position a token. */
    return (store_reply_form){.limit = st->cfg.max_reply_bytes,
                              .fixed_bytes = 64,
                              .list_bytes = 64,
                              .segment_bytes = 3 * 5 + 1,
                              .positions = 1,
                              .limit_name = "--max-reply-mb"};
}

/* RESOURCE_EXHAUSTED when a table of q in form f could pass f's limit (its
 * positions, mostly). */
static status_code check_table_reply(seq *q, int with_positions, const store_reply_form *f,
                                     status *s)
{
    uint64_t bytes = f->fixed_bytes, per_pos = position_bytes(f, seq_appended(q));
    if (f->limit == 0)
        return ST_OK;
    for (uint32_t l = 0; l < seq_layers(q); l++)
        for (uint32_t k = 0; k < seq_heads(q); k++) {
            seq_list_view v;
            seq_list_view_get(q, l, k, &v);
            bytes += f->list_bytes + v.nsegs * f->segment_bytes +
                     (with_positions ? v.tokens * per_pos : 0);
        }
    if (bytes <= f->limit)
        return ST_OK;
    return status_set(s, ST_RESOURCE_EXHAUSTED,
                      "the block table of sequence %llu could take %llu bytes, over %s (%llu "
                      "bytes): %sraise %s",
                      (unsigned long long)seq_id_of(q), (unsigned long long)bytes, f->limit_name,
                      (unsigned long long)f->limit,
                      with_positions ? "ask without positions, or " : "", f->limit_name);
}

/* RESOURCE_EXHAUSTED when a Revive's reply (the scratch table with a
 * position and a source tier per token, a segment per token at most) could
 * pass --max-reply-mb: the request's range, or the list's held and
 * offloaded tokens when fewer. A layer or head out of range is seq_revive's
 * to refuse. */
static status_code check_revive_reply(store *st, seq *q, const seq_revive_request *req, status *s)
{
    uint64_t limit = st->cfg.max_reply_bytes;
    if (limit == 0 || req->layer >= seq_layers(q) || req->head >= seq_heads(q))
        return ST_OK;
    seq_list_view v;
    seq_list_view_get(q, req->layer, req->head, &v);
    uint64_t appended = seq_appended(q);
    uint64_t range = req->count != 0         ? req->count
                     : appended > req->first ? appended - req->first
                                             : 0;
    uint64_t have = (uint64_t)v.tokens + v.noffloaded;
    uint64_t tokens = range < have ? range : have, per = 3 * 5 + 1 + varint_bytes(appended) + 1;
    if (128 + tokens * per <= limit)
        return ST_OK;
    return status_set(s, ST_RESOURCE_EXHAUSTED,
                      "a Revive of up to %llu tokens could reply %llu bytes, over --max-reply-mb "
                      "(%llu bytes): revive at most %llu positions a call (first, count); "
                      "nothing was revived",
                      (unsigned long long)tokens, (unsigned long long)(128 + tokens * per),
                      (unsigned long long)limit, (unsigned long long)((limit - 128) / per));
}

/* ---- sequences ---------------------------------------------------------- */

static status_code check_label(const char *label, status *s)
{
    if (strlen(label) > 128)
        return status_set(s, ST_INVALID_ARGUMENT, "label must be at most 128 bytes");
    return ST_OK;
}

status_code store_seq_create(store *st, const char *token, const store_seq_request *req,
                             store_seq_created *out, status *s)
{
    const char *policy_name = req->policy, *label = req->label;
    policy_params *params = &out->params;
    const policy_ops *ops = policy_find(policy_name);
    char err[POLICY_ERR_LEN];
    if (ops == NULL)
        return status_set(s, ST_INVALID_ARGUMENT,
                          "unknown policy '%.64s' (kvstash policy list shows them)", policy_name);
    if (policy_params_resolve(ops, req->keys, req->values, req->nparams, params, err, sizeof err) !=
        0)
        return status_set(s, ST_INVALID_ARGUMENT, "%s", err);
    if (check_label(label, s) != ST_OK)
        return s->code;
    pthread_mutex_lock(&st->lock);
    session *se;
    seq *q = NULL;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK)
        rc = store_seq_room_locked(st, se, s);
    if (rc == ST_OK)
        rc = seq_create(st->next_seq_id, se->id, se->pool, ops, params, label, &q, s);
    /* A sequence whose own configuration fills sketches reserves their worst
     * case now, or is never seen (others reserve at an operator's offload). */
    if (rc == ST_OK && seq_sketches(q) && (rc = store_sketch_reserve_locked(st, q, s)) != ST_OK) {
        seq_destroy(q);
        q = NULL;
    }
    if (rc == ST_OK) {
        store_seq_add_locked(st, se, q, "seq.created");
        out->seq_id = seq_id_of(q);
        out->epoch = seq_epoch(q);
    }
    store_unlock(st);
    return rc;
}

status_code store_seq_room_locked(store *st, const session *se, status *s)
{
    if (st->nseqs >= st->cfg.max_seqs)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "too many sequences (%u)", st->cfg.max_seqs);
    if (st->cfg.session_max_seqs != 0 && se->nseqs >= st->cfg.session_max_seqs)
        return status_set(s, ST_RESOURCE_EXHAUSTED,
                          "session %llu holds %u sequences, --session-max-seqs: release one, or "
                          "raise it",
                          (unsigned long long)se->id, se->nseqs);
    if (st->nseqs == st->seqs_cap) {
        size_t cap = st->seqs_cap ? st->seqs_cap * 2 : 16;
        seq **grown = realloc(st->seqs, cap * sizeof *grown);
        if (grown == NULL)
            return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
        st->seqs = grown;
        st->seqs_cap = cap;
    }
    return ST_OK;
}

void store_seq_add_locked(store *st, session *se, seq *q, const char *event)
{
    seq_set_demote_after_step(q, 1); /* its quantisation without the lock (demote_due) */
    if (seq_id_of(q) >= st->next_seq_id)
        st->next_seq_id = seq_id_of(q) + 1;
    st->seqs[st->nseqs++] = q;
    se->nseqs++;
    events_publish(st->events, event,
                   json_pack("{sI sI ss}", "session", (json_int_t)se->id, "seq",
                             (json_int_t)seq_id_of(q), "policy", seq_policy(q)->name));
    log_debug("seq_created", "session=%llu seq=%llu policy=%s event=%s", (unsigned long long)se->id,
              (unsigned long long)seq_id_of(q), seq_policy(q)->name, event);
}

/* Look up the caller's own sequence and ack its epoch; lock held. */
static status_code own_seq_acked(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                                 seq **out, status *s)
{
    session *se;
    size_t i = 0;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK)
        rc = need_own_seq(st, se, seq_id, &i, s);
    if (rc == ST_OK) {
        *out = st->seqs[i];
        size_t retired = seq_retired_count(*out);
        seq_ack(*out, ack_epoch);
        /* Its callers are reads, which change nothing a snapshot shows
         * unless the ack freed blocks (store_unlock). */
        if (seq_retired_count(*out) != retired)
            atomic_fetch_add_explicit(&st->generation, 1, memory_order_relaxed);
    }
    return rc;
}

/* A table with one entry per list of q, labelled with layer and head. */
static status_code table_alloc(store_table *t, const seq *q, status *s)
{
    memset(t, 0, sizeof *t);
    t->nlists = seq_layers(q) * seq_heads(q);
    t->lists = calloc(t->nlists, sizeof *t->lists);
    if (t->lists == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (uint32_t i = 0; i < t->nlists; i++)
        t->lists[i] = (store_layer_table){
            .layer = i / seq_heads(q), .head = i % seq_heads(q), .per_head = seq_heads(q) > 1};
    return ST_OK;
}

status_code store_append(store *st, const char *token, uint64_t seq_id, int64_t count,
                         uint64_t ack_epoch, store_table *writes, status *s)
{
    store_reply_form f = store_reply_rpc(st);
    return store_append_within(st, token, seq_id, count, ack_epoch, &f, writes, s);
}

status_code store_append_within(store *st, const char *token, uint64_t seq_id, int64_t count,
                                uint64_t ack_epoch, const store_reply_form *form,
                                store_table *writes, status *s)
{
    memset(writes, 0, sizeof *writes);
    store_lock_seq(st, seq_id);
    session *se;
    size_t i = 0;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK)
        rc = need_own_seq(st, se, seq_id, &i, s);
    seq *q = rc == ST_OK ? st->seqs[i] : NULL;
    if (rc == ST_OK)
        rc = seq_append_check(q, count, s);
    /* Before the reply's arrays are allocated or a token is added. */
    if (rc == ST_OK)
        rc = check_append_reply(q, count, form, s);
    if (rc == ST_OK)
        rc = table_alloc(writes, q, s);
    kv_segment **segs = NULL;
    size_t *nsegs = NULL;
    if (rc == ST_OK) {
        segs = calloc(writes->nlists, sizeof *segs);
        nsegs = calloc(writes->nlists, sizeof *nsegs);
        int missing = segs == NULL || nsegs == NULL;
        /* Every list's array, not only the last: one that failed would be
         * written through by seq_append (test_faults). */
        for (uint32_t i = 0; !missing && i < writes->nlists; i++)
            missing =
                (writes->lists[i].segs = segs[i] = malloc((size_t)count * sizeof **segs)) == NULL;
        if (missing)
            rc = status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (rc == ST_OK) {
        /* The ack first: the blocks it frees no longer count to the quota. */
        seq_ack(q, ack_epoch);
        rc = store_check_session_blocks_locked(st, se, seq_append_blocks(q, (uint32_t)count),
                                               "this Append", s);
    }
    seq_moves mv;
    if (rc == ST_OK && seq_demotion_moves(q, &mv) && mv.from_epoch == ack_epoch && mv.n > 0 &&
        (writes->moves = malloc(mv.n * sizeof *writes->moves)) != NULL) {
        /* Without the memory the worker reads its table instead. */
        memcpy(writes->moves, mv.runs, mv.n * sizeof *writes->moves);
        writes->nmoves = mv.n;
        writes->moves_from = mv.from_epoch;
        writes->moves_to = mv.to_epoch;
    }
    if (rc == ST_OK) {
        uint32_t first = (uint32_t)seq_appended(q);
        uint64_t dropped = seq_victims_dropped(q);
        rc = seq_append(q, count, segs, nsegs, &writes->evicted, s);
        if (seq_victims_dropped(q) != dropped)
            log_warn("victims_dropped",
                     "seq=%llu tokens=%llu reason=pool-pressure pool=%llu free=%u",
                     (unsigned long long)seq_id_of(q),
                     (unsigned long long)(seq_victims_dropped(q) - dropped),
                     (unsigned long long)seq_pool(q)->id, seq_pool(q)->nfree);
        writes->epoch = seq_epoch(q);
        writes->first_position = first;
    }
    if (rc == ST_OK) {
        /* metrics hooks */
        metrics_appended(st->metrics, seq_policy(q), (uint64_t)count);
        metrics_evicted(st->metrics, seq_policy(q), 0, writes->evicted);
        store_report_tiers(st, q);
        for (uint32_t i = 0; i < writes->nlists; i++) {
            writes->lists[i].nsegs = nsegs[i];
            writes->lists[i].tokens = (uint32_t)count;
        }
        if (writes->evicted > 0)
            events_publish(st->events, "table.changed",
                           json_pack("{sI sI sI}", "seq", (json_int_t)seq_id_of(q), "epoch",
                                     (json_int_t)seq_epoch(q), "evicted",
                                     (json_int_t)writes->evicted));
    }
    store_unlock(st);
    free(segs);
    free(nsegs);
    if (rc != ST_OK)
        store_table_free(writes);
    return rc;
}

/* What a worker needs to read a list's quantised segments in place. */
static void table_tier_geometry(const seq *q, store_layer_table *out)
{
    out->int8_block_tokens = seq_block_tokens(q, POLICY_INT8);
    out->int4_block_tokens = seq_block_tokens(q, POLICY_INT4);
    out->int2_block_tokens = seq_block_tokens(q, POLICY_INT2);
    out->quant_group = seq_quant_group(q);
}

/* List out of q as it stands, lent: its arrays are the sequence's, read
 * only (store_layer_table's are its own in a copy, hence the casts). */
static void lend_list(seq *q, int with_positions, store_layer_table *out)
{
    seq_list_view ly;
    seq_list_view_get(q, out->layer, out->head, &ly);
    static const uint32_t none[1];
    out->tokens = ly.tokens;
    out->nsegs = ly.nsegs;
    table_tier_geometry(q, out);
    out->segs = (kv_segment *)ly.segs;
    out->tiers = (uint8_t *)ly.seg_tier;
    out->positions = !with_positions ? NULL
                     : ly.positions  ? (uint32_t *)ly.positions
                                     : (uint32_t *)none;
}

status_code store_lend_table(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                             int with_positions, const store_reply_form *form,
                             store_table_reader read, void *ctx, status *s)
{
    store_table t;
    memset(&t, 0, sizeof t);
    store_lock_seq(st, seq_id);
    seq *q;
    status_code rc = own_seq_acked(st, token, seq_id, ack_epoch, &q, s);
    if (rc == ST_OK)
        rc = check_table_reply(q, with_positions, form, s);
    if (rc == ST_OK)
        rc = table_alloc(&t, q, s);
    if (rc == ST_OK) {
        t.epoch = seq_epoch(q);
        for (uint32_t i = 0; i < t.nlists; i++)
            lend_list(q, with_positions, &t.lists[i]);
        rc = read(ctx, &t, s);
    }
    pthread_mutex_unlock(&st->lock);
    free(t.lists); /* the arrays were lent */
    return rc;
}

/* A store_table_reader that copies the lent table into the store_table
 * ctx (gRPC packs it after the lock is let go). */
static status_code copy_table(void *ctx, const store_table *t, status *s)
{
    store_table *out = ctx;
    *out = *t;
    out->lists = calloc(t->nlists, sizeof *out->lists);
    if (out->lists == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (uint32_t i = 0; i < t->nlists; i++) {
        const store_layer_table *in = &t->lists[i];
        store_layer_table *c = &out->lists[i];
        *c = *in;
        c->segs = malloc((in->nsegs ? in->nsegs : 1) * sizeof *c->segs);
        c->tiers = malloc(in->nsegs ? in->nsegs : 1);
        c->positions = in->positions != NULL
                           ? malloc((in->tokens ? in->tokens : 1) * sizeof *c->positions)
                           : NULL;
        if (c->segs == NULL || c->tiers == NULL ||
            (in->positions != NULL && c->positions == NULL)) {
            store_table_free(out);
            return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
        }
        if (in->nsegs > 0) { /* an empty list has no segment array yet */
            memcpy(c->segs, in->segs, in->nsegs * sizeof *c->segs);
            memcpy(c->tiers, in->tiers, in->nsegs);
        }
        if (in->positions != NULL && in->tokens > 0)
            memcpy(c->positions, in->positions, in->tokens * sizeof *c->positions);
    }
    return ST_OK;
}

status_code store_get_table(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                            int with_positions, store_table *out, status *s)
{
    memset(out, 0, sizeof *out);
    store_reply_form f = store_reply_rpc(st);
    return store_lend_table(st, token, seq_id, ack_epoch, with_positions, &f, copy_table, out, s);
}

status_code store_seq_release(store *st, const char *token, uint64_t seq_id, uint32_t *blocks_freed,
                              status *s)
{
    store_lock_seq(st, seq_id);
    session *se;
    size_t i = 0;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK)
        rc = need_own_seq(st, se, seq_id, &i, s);
    seq *gone = NULL;
    if (rc == ST_OK) {
        gone = unlink_seq_at(st, i, blocks_freed);
        se->nseqs--;
        events_publish(st->events, "seq.released",
                       json_pack("{sI sI sI}", "session", (json_int_t)se->id, "seq",
                                 (json_int_t)seq_id, "blocks", (json_int_t)*blocks_freed));
    }
    store_unlock(st);
    seq_destroy(gone); /* its memory, without the lock: a long one's takes a while */
    return rc;
}

/* The attention mass a decided step's eviction drops (metrics_mass_measure),
 * when metrics are on. */
static metrics_mass *step_mass(store *st, seq *q, const seq_step_input *in, const seq_step_job *job)
{
    if (st->metrics == NULL)
        return NULL;
    metrics_lists lists = {seq_layers(q), seq_pool(q)->geom.q_heads, seq_pool(q)->geom.kv_heads,
                           seq_heads(q), seq_step_list_tokens(job)};
    /* The statistics as the policy read them: the copy, every layer's part
     * of which the decision filled (seq_step_input.copy). */
    return metrics_mass_measure(st->metrics, &lists, in->arrays, in->copy ? in->copy : in->data,
                                in->nfloats, seq_step_decisions(job));
}

static int decide(void *job)
{
    seq_step_decide(job);
    return 0;
}

/* Work on a stepping sequence's policy host alone: its decision, and the
 * commit of it to the host's lists (seq_step_finish's runner). */
typedef struct host_work {
    store *st;
    seq *q;
    int prefill;
    int (*work)(void *);
    void *arg;
    int in_background;
} host_work;

/* On a background thread when there are some (store_move_copy: a
 * prompt's decision takes milliseconds, as a large copy). */
static int host_work_in_background(void *arg)
{
    host_work *w = arg;
    return store_move_copy(w->st, w->st->cfg.move_background_bytes, w->work, w->arg,
                           &w->in_background);
}

/* Lock held: work without the lock, q marked moving (the caller checked
 * that it may go). A prompt's runs at --move-priority; a decode step's,
 * which the worker waits for at every token, at the serving thread's. */
static int run_unlocked(host_work *w, int (*work)(void *), void *arg)
{
    store *st = w->st;
    if (!w->prefill)
        return store_copy_unlocked(st, seq_id_of(w->q), work, arg);
    w->work = work, w->arg = arg, w->in_background = 0;
    int rc = store_copy_unlocked(st, seq_id_of(w->q), host_work_in_background, w);
    st->background_moves += (uint64_t)w->in_background;
    return rc;
}

/* Lock held: the step's application to q's storage without the lock, q
 * detached from its pool (seq.h seq_detach), unless something waits for
 * every sequence to be attached or q stays attached; work that finds it
 * needs the lock runs again under it. Not with --session-max-blocks,
 * whose check counts the blocks of every sequence of a session in the
 * middle of other calls, where they cannot wait. */
static int run_detached(host_work *w, int (*work)(void *), void *arg)
{
    store *st = w->st;
    if (st->attach_waiters > 0 || st->cfg.session_max_blocks != 0 || seq_detach(w->q) != 0)
        return work(arg);
    st->ndetached++;
    st->detached_applications++;
    int rc = run_unlocked(w, work, arg);
    seq_attach(w->q);
    st->ndetached--;
    pthread_cond_broadcast(&st->moved);
    if (rc == SEQ_WORK_NEEDS_LOCK) {
        st->detached_retries++;
        rc = work(arg);
    }
    return rc;
}

/* Lock held: the work runs without the lock when q's lists are long
 * enough for it to hold up other sequences (issue 16 §3); a short one
 * costs less than letting go. So does a decode step's application (a
 * token or two a list, where detaching scans every decision). */
static int run_host_work(void *ctx, seq_work_kind kind, int (*work)(void *), void *arg)
{
    host_work *w = ctx;
    if (seq_tokens_held(w->q) < w->st->cfg.unlocked_decision_tokens)
        return work(arg);
    if (kind == SEQ_WORK_STORAGE)
        return w->prefill ? run_detached(w, work, arg) : work(arg);
    return run_unlocked(w, work, arg);
}

void store_wait_attached(store *st)
{
    st->attach_waiters++;
    while (st->ndetached > 0)
        pthread_cond_wait(&st->moved, &st->lock);
    st->attach_waiters--;
}

status_code store_step(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                       const seq_step_input *in, store_cuts_reader read_cuts, void *ctx,
                       uint64_t *epoch, uint32_t *evicted, status *s)
{
    uint64_t t0 = st->metrics != NULL ? store_now_ns() : 0;
    store_lock_seq(st, seq_id);
    seq *q;
    status_code rc = own_seq_acked(st, token, seq_id, ack_epoch, &q, s);
    if (rc == ST_OK) {
        metrics_mass *mm = NULL; /* metrics hook: the attention mass the eviction drops */
        uint64_t epoch0 = seq_epoch(q);
        seq_step_job *job;
        host_work w = {.st = st, .q = q, .prefill = in->prefill};
        seq_step_input mine = *in;
        mine.copy_always = st->metrics != NULL; /* step_mass reads the copy */
        rc = seq_step_plan(q, &mine, &job, s);
        if (rc == ST_OK) {
            run_host_work(&w, SEQ_WORK_HOST, decide, job);
            mm = step_mass(st, q, in, job);
            rc = seq_step_finish(job, run_host_work, &w, evicted, s);
        }
        if (rc == ST_OK)
            demote_due(st, q, epoch0, in->prefill);
        metrics_mass_end(st->metrics, mm, seq_policy(q), rc == ST_OK);
    }
    if (rc == ST_OK) {
        /* metrics hooks */
        metrics_evicted(st->metrics, seq_policy(q), 0, *evicted);
        store_report_tiers(st, q);
        if (st->metrics != NULL)
            metrics_step(st->metrics, seq_policy(q), (double)(store_now_ns() - t0) * 1e-9);
        *epoch = seq_epoch(q);
        seq_cuts cuts;
        if (read_cuts != NULL && seq_step_cuts(q, &cuts))
            read_cuts(ctx, &cuts);
        if (*evicted > 0)
            events_publish(st->events, "table.changed",
                           json_pack("{sI sI sI}", "seq", (json_int_t)seq_id_of(q), "epoch",
                                     (json_int_t)seq_epoch(q), "evicted", (json_int_t)*evicted));
    }
    store_unlock(st);
    return rc;
}

status_code store_epoch(store *st, const char *token, uint64_t seq_id, uint64_t ack_epoch,
                        uint64_t *epoch, status *s)
{
    store_lock_seq(st, seq_id);
    seq *q;
    status_code rc = own_seq_acked(st, token, seq_id, ack_epoch, &q, s);
    if (rc == ST_OK)
        *epoch = seq_epoch(q);
    pthread_mutex_unlock(&st->lock);
    return rc;
}

/* ---- revive ------------------------------------------------------------- */

void store_revive_result_free(store_revive_result *r)
{
    free(r->table.segs);
    free(r->table.positions);
    free(r->src_tier);
    memset(r, 0, sizeof *r);
}

/* Lock held: plan q's Revive and check it against the session's quota. */
static status_code revive_plan(store *st, session *se, seq *q, const seq_revive_request *req,
                               seq_revive_job **job, status *s)
{
    *job = NULL;
    if (check_revive_reply(st, q, req, s) != ST_OK || seq_revive_plan(q, req, job, s) != ST_OK)
        return s->code;
    status_code rc =
        store_check_session_blocks_locked(st, se, seq_revive_blocks(*job), "this Revive", s);
    if (rc != ST_OK) {
        seq_revived rv;
        seq_revive_finish(*job, -1, &rv, &(status){0}); /* the blocks back to the pool */
        *job = NULL;
    }
    return rc;
}

/* Lock held: the revived blocks become scratch `sc` of session se, and
 * the reply's table describes them. An in-place Revive that copied
 * nothing takes no scratch (id 0: nothing to release); returns whether
 * sc was taken. */
static int revive_publish(store *st, session *se, seq *q, const seq_revive_request *req,
                          seq_revived *rv, store_scratch *sc, store_revive_result *out)
{
    out->table.segs = rv->segs;
    out->table.nsegs = rv->nsegs;
    out->table.positions = rv->positions;
    out->src_tier = rv->src_tier;
    out->epoch = seq_epoch(q);
    int taken = !req->in_place || rv->nblocks > 0;
    if (taken) {
        *sc = (store_scratch){.id = st->next_scratch_id++,
                              .blocks = rv->blocks,
                              .nblocks = rv->nblocks,
                              .next = se->scratch};
        se->scratch = sc;
        out->scratch_id = sc->id;
    } else {
        free(rv->blocks);
    }
    out->table.layer = req->layer;
    out->table.head = req->head;
    out->table.per_head = seq_heads(q) > 1;
    out->table.tokens = (uint32_t)rv->ntokens;
    table_tier_geometry(q, &out->table);
    uint32_t by[POLICY_TIERS] = {0};
    for (size_t t = 0; t < rv->ntokens; t++)
        by[out->src_tier[t]]++;
    metrics_revived(st->metrics, seq_policy(q), by);
    log_info("revive",
             "seq=%llu layer=%u head=%u tokens=%zu full=%u int8=%u int4=%u int2=%u sketch=%u "
             "in_place=%d scratch_blocks=%zu",
             (unsigned long long)seq_id_of(q), req->layer, req->head, rv->ntokens, by[POLICY_FULL],
             by[POLICY_INT8], by[POLICY_INT4], by[POLICY_INT2], by[POLICY_SKETCH],
             req->in_place != 0, rv->nblocks);
    return taken;
}

int store_move_copy(const store *st, size_t bytes, int (*fill)(void *), void *job,
                    int *in_background)
{
    background *b = bytes >= st->cfg.move_background_bytes ? st->background : NULL;
    return background_run(b, fill, job, in_background);
}

static int revive_fill_job(void *job)
{
    return seq_revive_fill(job);
}

/* Lock held: fetch what a Revive needs from the remote tier and copy,
 * both without the lock when the sequence can be marked moving; *fill_rc
 * is the copy's (-1 when the fetch failed: its status is the result). A
 * Revive that needs the remote tier never waits for it under the lock. */
static status_code revive_copy(store *st, uint64_t seq_id, seq_revive_job *job, int *fill_rc,
                               status *s)
{
    const seq_remote_part *parts;
    int remote = seq_revive_remote(job, &parts) > 0;
    if (!store_move_begin(st, seq_id)) {
        *fill_rc = remote ? -1 : seq_revive_fill(job);
        return remote ? status_set(s, ST_UNAVAILABLE,
                                   "%d copies run without the lock already; this Revive needs "
                                   "the remote tier and does not wait for it under the lock: "
                                   "retry",
                                   STORE_MAX_MOVES)
                      : ST_OK;
    }
    store_unlock(st);
    status_code rc = store_revive_fetch(st, job, s);
    int in_background = 0;
    size_t bytes = seq_revive_blocks(job) * seq_pool(seq_revive_seq(job))->block_bytes;
    *fill_rc = rc == ST_OK ? store_move_copy(st, bytes, revive_fill_job, job, &in_background) : -1;
    pthread_mutex_lock(&st->lock);
    st->background_moves += (uint64_t)in_background;
    store_move_end(st, seq_id);
    return rc;
}

/* The copy runs without the store's lock (issue 16 §3): the sequence is
 * marked moving, so nothing changes it and no session ends meanwhile
 * (store_lock_seq, lock_no_moves), while every other sequence steps. */
status_code store_revive(store *st, const char *token, uint64_t seq_id,
                         const seq_revive_request *req, store_revive_result *out, status *s)
{
    memset(out, 0, sizeof *out);
    store_lock_seq(st, seq_id);
    session *se;
    size_t i = 0;
    seq_revive_job *job = NULL;
    store_scratch *sc = calloc(1, sizeof *sc);
    status_code rc = sc == NULL ? status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory") : ST_OK;
    if (rc == ST_OK)
        rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK)
        rc = need_own_seq(st, se, seq_id, &i, s);
    seq *q = rc == ST_OK ? st->seqs[i] : NULL;
    if (rc == ST_OK)
        rc = revive_plan(st, se, q, req, &job, s);
    if (rc == ST_OK) {
        seq_revived rv;
        status fs = {ST_OK, ""};
        int fill_rc;
        status_code frc = revive_copy(st, seq_id, job, &fill_rc, &fs);
        rc = seq_revive_finish(job, fill_rc, &rv, s);
        if (frc != ST_OK)
            *s = fs, rc = frc;
        if (rc == ST_OK && revive_publish(st, se, q, req, &rv, sc, out))
            sc = NULL;
    }
    store_unlock(st);
    free(sc);
    return rc;
}

uint64_t store_background_moves(store *st)
{
    pthread_mutex_lock(&st->lock);
    uint64_t n = st->background_moves;
    pthread_mutex_unlock(&st->lock);
    return n;
}

status_code store_scratch_release(store *st, const char *token, uint64_t scratch_id,
                                  uint32_t *blocks_freed, status *s)
{
    pthread_mutex_lock(&st->lock);
    session *se;
    status_code rc = store_need_session_locked(st, token, 1, &se, s);
    if (rc == ST_OK) {
        store_scratch **pp = &se->scratch;
        while (*pp != NULL && (*pp)->id != scratch_id)
            pp = &(*pp)->next;
        if (*pp == NULL) {
            rc = status_set(s, ST_NOT_FOUND, "no scratch %llu in this session (already released?)",
                            (unsigned long long)scratch_id);
        } else {
            store_scratch *sc = *pp;
            *pp = sc->next;
            *blocks_freed = scratch_free(se->pool, sc);
        }
    }
    store_unlock(st);
    return rc;
}
