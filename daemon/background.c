/* background.c - see background.h. */
#define _GNU_SOURCE 1 /* SCHED_IDLE */
#include "background.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The nice value of BACKGROUND_LOW: the lowest. */
#define BACKGROUND_LOW_NICE 19

static const char *const names[] = {"normal", "low", "idle"};

const char *background_priority_name(background_priority p)
{
    return (unsigned)p < sizeof names / sizeof *names ? names[p] : NULL;
}

int background_priority_parse(const char *name, background_priority *out)
{
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strcmp(name, names[i]) == 0) {
            *out = (background_priority)i;
            return 0;
        }
    return -1;
}

/* A call of background_run, on its caller's stack until it is done. */
typedef struct background_job {
    int (*fn)(void *);
    void *arg;
    int result;
    int done;
    struct background_job *next;
} background_job;

struct background {
    background_priority priority;
    pthread_mutex_t lock;
    pthread_cond_t wake; /* a job queued, or stop */
    pthread_cond_t done; /* a job done, or a thread started or gave up */
    background_job *head, *tail;
    int stop;
    unsigned nthreads, started, lowered; /* threads made; of them, at b's priority */
    pthread_t *threads;
};

/* Lower the calling thread's priority to p; 0, or -1 when refused. */
static int lower_priority(background_priority p)
{
    if (p == BACKGROUND_IDLE) {
        struct sched_param none = {0};
        return pthread_setschedparam(pthread_self(), SCHED_IDLE, &none) == 0 ? 0 : -1;
    }
    /* PRIO_PROCESS with a thread id sets that thread's nice value alone
     * (setpriority(2), Linux). */
    return setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), BACKGROUND_LOW_NICE);
}

static void *background_main(void *arg)
{
    background *b = arg;
    int lowered = lower_priority(b->priority) == 0;
    pthread_mutex_lock(&b->lock);
    b->started++;
    b->lowered += (unsigned)lowered;
    pthread_cond_broadcast(&b->done);
    while (lowered) {
        while (b->head == NULL && !b->stop)
            pthread_cond_wait(&b->wake, &b->lock);
        background_job *j = b->head;
        if (j == NULL)
            break; /* stopped, nothing left */
        if ((b->head = j->next) == NULL)
            b->tail = NULL;
        pthread_mutex_unlock(&b->lock);
        int result = j->fn(j->arg);
        pthread_mutex_lock(&b->lock);
        j->result = result;
        j->done = 1;
        pthread_cond_broadcast(&b->done);
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

background *background_start(background_priority p, unsigned threads)
{
    if ((p != BACKGROUND_LOW && p != BACKGROUND_IDLE) || threads == 0)
        return NULL;
    background *b = calloc(1, sizeof *b);
    if (b == NULL || (b->threads = calloc(threads, sizeof *b->threads)) == NULL) {
        free(b);
        return NULL;
    }
    b->priority = p;
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->wake, NULL);
    pthread_cond_init(&b->done, NULL);
    while (b->nthreads < threads &&
           pthread_create(&b->threads[b->nthreads], NULL, background_main, b) == 0)
        b->nthreads++;
    pthread_mutex_lock(&b->lock);
    while (b->started < b->nthreads)
        pthread_cond_wait(&b->done, &b->lock);
    int none = b->lowered == 0;
    pthread_mutex_unlock(&b->lock);
    if (none) { /* every thread that started has ended already */
        background_stop(b);
        return NULL;
    }
    return b;
}

void background_stop(background *b)
{
    if (b == NULL)
        return;
    pthread_mutex_lock(&b->lock);
    b->stop = 1;
    pthread_cond_broadcast(&b->wake);
    pthread_mutex_unlock(&b->lock);
    for (unsigned i = 0; i < b->nthreads; i++)
        pthread_join(b->threads[i], NULL);
    pthread_cond_destroy(&b->done);
    pthread_cond_destroy(&b->wake);
    pthread_mutex_destroy(&b->lock);
    free(b->threads);
    free(b);
}

int background_run(background *b, int (*fn)(void *), void *arg, int *in_background)
{
    if (in_background != NULL)
        *in_background = b != NULL;
    if (b == NULL)
        return fn(arg);
    background_job j = {fn, arg, -1, 0, NULL};
    pthread_mutex_lock(&b->lock);
    if (b->tail != NULL)
        b->tail->next = &j;
    else
        b->head = &j;
    b->tail = &j;
    pthread_cond_signal(&b->wake);
    while (!j.done)
        pthread_cond_wait(&b->done, &b->lock);
    pthread_mutex_unlock(&b->lock);
    return j.result;
}
