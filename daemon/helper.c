/*
 * helper.c - a thread kept for a ring thread's parallel work (helper.h).
 *
 * One piece of work at a time: the caller starts it, does its own share
 * and joins it. A mutex and two condition variables: the wait is the
 * caller's rare case (it usually finishes its share last), and a wake
 * costs a few microseconds, against the ~55 of a thread started and
 * joined.
 */
#define _GNU_SOURCE 1 /* helper_cpus.h */

#include "helper.h"

#include <pthread.h>
#include <stdlib.h>

#include "helper_cpus.h" /* kernels/ */

struct helper {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    void (*fn)(void *arg);
    void *arg;
    int thread_started; /* at the first start: a ring that never lends it has none */
    int lent;           /* started and not yet joined */
    int running;        /* fn given and not yet returned */
    int quit;
    helper_cpus cpus; /* the caller's, which fn runs on */
    policy_helper as_policy;
};

static void *helper_main(void *p)
{
    helper *hp = p;
    pthread_mutex_lock(&hp->mu);
    for (;;) {
        while (!hp->running && !hp->quit)
            pthread_cond_wait(&hp->wake, &hp->mu);
        if (!hp->running)
            break;
        pthread_mutex_unlock(&hp->mu);
        helper_cpus_enter(&hp->cpus);
        hp->fn(hp->arg);
        pthread_mutex_lock(&hp->mu);
        hp->running = 0;
        pthread_cond_signal(&hp->done);
    }
    pthread_mutex_unlock(&hp->mu);
    return NULL;
}

/* policy_helper.start */
static int helper_start(void *ctx, void (*fn)(void *arg), void *arg)
{
    helper *hp = ctx;
    pthread_mutex_lock(&hp->mu);
    if (!hp->thread_started)
        hp->thread_started = pthread_create(&hp->thread, NULL, helper_main, hp) == 0;
    int free_now = hp->thread_started && !hp->lent;
    if (free_now) {
        hp->lent = hp->running = 1;
        hp->fn = fn, hp->arg = arg;
        helper_cpus_place_thread(&hp->cpus, hp->thread);
        pthread_cond_signal(&hp->wake);
    }
    pthread_mutex_unlock(&hp->mu);
    return free_now ? 0 : -1;
}

/* policy_helper.join */
static void helper_join(void *ctx)
{
    helper *hp = ctx;
    pthread_mutex_lock(&hp->mu);
    while (hp->running)
        pthread_cond_wait(&hp->done, &hp->mu);
    hp->lent = 0;
    pthread_mutex_unlock(&hp->mu);
}

helper *helper_create(void)
{
    helper *hp = calloc(1, sizeof *hp);
    if (hp == NULL)
        return NULL;
    int mu = pthread_mutex_init(&hp->mu, NULL) == 0;
    int wake = pthread_cond_init(&hp->wake, NULL) == 0;
    int done = pthread_cond_init(&hp->done, NULL) == 0;
    if (mu && wake && done) {
        hp->as_policy = (policy_helper){helper_start, helper_join, hp};
        return hp;
    }
    if (mu)
        pthread_mutex_destroy(&hp->mu);
    if (wake)
        pthread_cond_destroy(&hp->wake);
    if (done)
        pthread_cond_destroy(&hp->done);
    free(hp);
    return NULL;
}

void helper_destroy(helper *hp)
{
    if (hp == NULL)
        return;
    pthread_mutex_lock(&hp->mu);
    hp->quit = 1;
    pthread_cond_signal(&hp->wake);
    pthread_mutex_unlock(&hp->mu);
    if (hp->thread_started)
        pthread_join(hp->thread, NULL);
    pthread_mutex_destroy(&hp->mu);
    pthread_cond_destroy(&hp->wake);
    pthread_cond_destroy(&hp->done);
    free(hp);
}

const policy_helper *helper_lend(helper *hp)
{
    return &hp->as_policy;
}
