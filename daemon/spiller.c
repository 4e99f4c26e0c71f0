/* spiller.c - see spiller.h. */
#include "spiller.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "log.h"

struct spiller {
    store *st;
    uint32_t below_pct;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stopping;
    pthread_t thread;
};

/* One look: spill what pressure asks for, and say so; a failure is logged
 * when it starts, not every round while it lasts. */
static void spill_round(spiller *sp, int *failing)
{
    store_spill_result sum;
    status first = {ST_OK, ""};
    uint32_t failed = store_spill_pressured(sp->st, sp->below_pct, &sum, &first);
    if (sum.values > 0)
        log_info("spill_pressured",
                 "below_pct=%u blocks=%u sketches=%u tokens=%llu bytes=%llu dropped=%u",
                 sp->below_pct, sum.blocks, sum.sketches, (unsigned long long)sum.tokens,
                 (unsigned long long)sum.bytes, sum.dropped);
    if (failed > 0 && !*failing)
        log_warn("spill_pressured_failed", "sequences=%u code=%s msg=\"%s\"", failed,
                 status_name(first.code), first.msg);
    *failing = failed > 0;
}

static void *spiller_main(void *arg)
{
    spiller *sp = arg;
    int failing = 0;
    pthread_mutex_lock(&sp->mu);
    while (!sp->stopping) {
        pthread_mutex_unlock(&sp->mu);
        spill_round(sp, &failing);
        pthread_mutex_lock(&sp->mu);
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        long ns = until.tv_nsec + (long)SPILLER_INTERVAL_MS * 1000000L;
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        while (!sp->stopping && pthread_cond_timedwait(&sp->cv, &sp->mu, &until) != ETIMEDOUT)
            ;
    }
    pthread_mutex_unlock(&sp->mu);
    return NULL;
}

spiller *spiller_start(store *st, uint32_t below_pct)
{
    spiller *sp = calloc(1, sizeof *sp);
    if (sp == NULL) {
        log_error("spiller_failed", "msg=\"out of memory\"");
        return NULL;
    }
    sp->st = st;
    sp->below_pct = below_pct;
    pthread_mutex_init(&sp->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&sp->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&sp->thread, NULL, spiller_main, sp) != 0) {
        log_error("spiller_failed", "msg=\"cannot start the thread\"");
        pthread_cond_destroy(&sp->cv);
        pthread_mutex_destroy(&sp->mu);
        free(sp);
        return NULL;
    }
    return sp;
}

void spiller_stop(spiller *sp)
{
    if (sp == NULL)
        return;
    pthread_mutex_lock(&sp->mu);
    sp->stopping = 1;
    pthread_cond_signal(&sp->cv);
    pthread_mutex_unlock(&sp->mu);
    pthread_join(sp->thread, NULL);
    pthread_cond_destroy(&sp->cv);
    pthread_mutex_destroy(&sp->mu);
    free(sp);
}
