/*
 * store_demote.c - the demoter: a step's demotion after the step's reply.
 *
 * A decode step that demotes quantises an INT8 block's worth of tokens per
 * layer. Done inside the step, the worker's reply waited for it: one step
 * in 28 cost several times the others (issue 16 §4). Here store_step marks
 * the sequence moving and queues it; the step replies with its own epoch;
 * this thread plans the demotion under the lock (the INT8 blocks taken),
 * quantises without it and publishes the demoted lists under it at the
 * next epoch, which the worker learns from its next call, as it learns
 * any table change (the blocks it may still read are retired until it
 * acks that epoch: DESIGN.md "Memory"). The worker's next call on the
 * sequence waits until the demotion is published (store_lock_seq), so what
 * it sees is what a demotion inside the step gave; while the worker
 * computes its next token, the demotion runs beside it. Other sequences
 * never wait for it, nor, on a busy host, for a CPU a prompt's takes: its
 * quantisation, when large, runs on a background thread (store_move_copy).
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#include "log.h"
#include "store_internal.h"

/* Lock held: the oldest queued demotion, or 0 when none. */
static int demotion_pop(store *st, store_demotion *out)
{
    if (st->ndemotions == 0)
        return 0;
    *out = st->demotions[st->demotions_head];
    st->demotions_head = (st->demotions_head + 1) % STORE_MAX_MOVES;
    st->ndemotions--;
    return 1;
}

/* Lock held, and again on return: plan q's demotion, quantise without
 * the lock, publish under it and wake q's callers. q is moving: its epoch
 * is its step's, which the worker may hold, and the demotion publishes the
 * next. A demotion that cannot run (no blocks, no memory) waits for the
 * next step, its tokens still due. */
static void demotion_run(store *st, seq *q, int background)
{
    uint64_t seq_id = seq_id_of(q);
    seq_demote_job *job = NULL;
    status s = {ST_OK, ""};
    if (seq_demote_plan(q, seq_epoch(q) + 1, &job, &s) == ST_OK && job != NULL) {
        const pool *p = seq_pool(q);
        size_t token_bytes = p->block_bytes / p->geom.block_tokens;
        int in_background = 0;
        pthread_mutex_unlock(&st->lock);
        int rc = background ? store_move_copy(st, seq_demote_tokens(job) * token_bytes,
                                              store_demote_fill, job, &in_background)
                            : store_demote_fill(job);
        pthread_mutex_lock(&st->lock);
        st->background_moves += (uint64_t)in_background;
        seq_demote_finish(job, rc, &s);
    }
    if (s.code != ST_OK)
        log_warn("demote_deferred", "seq=%llu reason=\"%s\"", (unsigned long long)seq_id, s.msg);
    store_report_tiers(st, q);
    store_move_end(st, seq_id);
}

static void *demoter_main(void *arg)
{
    store *st = arg;
    /* SCHED_BATCH: a woken demoter does not preempt the thread that queued
     * it, which has a step's reply to send. */
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &none);
    store_demotion d;
    pthread_mutex_lock(&st->lock);
    for (;;) {
        if (demotion_pop(st, &d)) {
            demotion_run(st, d.q, d.background);
            store_unlock(st); /* a snapshot may show the demotion */
            pthread_mutex_lock(&st->lock);
        } else if (st->demoter_stop) {
            break;
        } else {
            pthread_cond_wait(&st->demote_wake, &st->lock);
        }
    }
    pthread_mutex_unlock(&st->lock);
    return NULL;
}

int store_demoter_start(store *st)
{
    st->demotions = calloc(STORE_MAX_MOVES, sizeof *st->demotions);
    if (st->demotions == NULL)
        return -1;
    pthread_cond_init(&st->demote_wake, NULL);
    if (pthread_create(&st->demoter, NULL, demoter_main, st) != 0) {
        pthread_cond_destroy(&st->demote_wake);
        free(st->demotions);
        st->demotions = NULL;
        return -1;
    }
    st->demoter_running = 1;
    return 0;
}

void store_demoter_stop(store *st)
{
    if (!st->demoter_running)
        return;
    pthread_mutex_lock(&st->lock);
    st->demoter_stop = 1;
    pthread_cond_signal(&st->demote_wake);
    pthread_mutex_unlock(&st->lock);
    pthread_join(st->demoter, NULL);
    st->demoter_running = 0;
    pthread_cond_destroy(&st->demote_wake);
    free(st->demotions);
    st->demotions = NULL;
}

int store_demote_later(store *st, seq *q, int background)
{
    if (!st->demoter_running || st->demoter_stop || !store_move_begin(st, seq_id_of(q)))
        return 0;
    size_t tail = (st->demotions_head + st->ndemotions) % STORE_MAX_MOVES;
    st->demotions[tail] = (store_demotion){q, background};
    st->ndemotions++;
    pthread_cond_signal(&st->demote_wake);
    return 1;
}
