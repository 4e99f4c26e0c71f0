/*
 * parallel.c - a fork-join over pthreads for large kernel calls.
 *
 * Threads are created per call and joined before it returns: kernels keep no
 * state between calls (STYLE.md), and a call worth splitting (>= 2 MiB of
 * traffic) costs far more than the ~20 us of creating a thread.
 */
#define _GNU_SOURCE 1 /* sched_getcpu, CPU_SET, pthread_attr_setaffinity_np */

#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "kernels.h"

#define KV_MAX_THREADS 8u

unsigned kv_parallel_threads(size_t bytes)
{
    /* Most calls are small (the daemon moves a few tokens at a time): answer
     * them before sysconf, which reads /sys on every call. */
    size_t by_work = bytes / KV_PARALLEL_GRAIN;
    if (by_work <= 1)
        return 1;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned n = cpus < 1 ? 1u : cpus > (long)KV_MAX_THREADS ? KV_MAX_THREADS : (unsigned)cpus;
    const char *env = getenv("KVSTASH_KERNEL_THREADS");
    if (env != NULL && *env != '\0') {
        long v = strtol(env, NULL, 10);
        if (v >= 1 && (unsigned long)v < n)
            n = (unsigned)v;
    }
    if (by_work < n)
        n = (unsigned)by_work;
    return n;
}

/* A call's items, taken a chunk at a time by whichever thread is free. */
typedef struct chunks {
    kv_range_fn fn;
    void *ctx;
    size_t n, size;
    atomic_size_t next; /* first item not yet taken */
    cpu_set_t allowed;  /* the caller's CPUs, which helpers return to */
    int placed;         /* helpers were started off the caller's CPU */
} chunks;

static void take_chunks(chunks *c)
{
    for (;;) {
        size_t lo = atomic_fetch_add_explicit(&c->next, c->size, memory_order_relaxed);
        if (lo >= c->n)
            return;
        c->fn(c->ctx, lo, c->n - lo < c->size ? c->n : lo + c->size);
    }
}

static void *helper_main(void *p)
{
    chunks *c = p;
    if (c->placed) /* started elsewhere; from now on the scheduler's to move */
        (void)pthread_setaffinity_np(pthread_self(), sizeof c->allowed, &c->allowed);
    take_chunks(c);
    return NULL;
}

/*
 * Where helpers start: on any of the caller's CPUs but the one it runs on.
 * Linux places a new thread by the load of the instant it is created,
 * often on its creator's CPU (the other CPUs busy with that moment's
 * work: on a 2-vCPU VM, the worker that just asked for the call), and does
 * not move a waiting thread to a CPU that frees up a moment later: the
 * helper then waits for the caller to finish all the work (measured: a
 * Revive's dequantisation of 4,096 tokens took 1.2 ms on two threads, as
 * on one, and 0.67 ms placed). 0 when the caller has no other CPU.
 */
static int helpers_placement(chunks *c, pthread_attr_t *attr)
{
    int me = sched_getcpu();
    if (me < 0 || pthread_getaffinity_np(pthread_self(), sizeof c->allowed, &c->allowed) != 0 ||
        !CPU_ISSET(me, &c->allowed) || CPU_COUNT(&c->allowed) < 2)
        return 0;
    cpu_set_t others = c->allowed;
    CPU_CLR(me, &others);
    return pthread_attr_setaffinity_np(attr, sizeof others, &others) == 0;
}

/*
 * The items go in KV_CHUNKS_PER_THREAD chunks a thread, taken in order from
 * a shared counter rather than dealt out in fixed shares: a thread that
 * starts late (a busy host, or a VM's idle CPU that must first be woken)
 * takes fewer, and the call ends when the work does, not when the last
 * thread's share does. Where no thread starts, the caller takes every
 * chunk.
 */
#define KV_CHUNKS_PER_THREAD 8u

void kv_parallel_for(size_t n, size_t bytes, kv_range_fn fn, void *ctx)
{
    unsigned nt = kv_parallel_threads(bytes);
    if (nt > n)
        nt = n < 1 ? 1u : (unsigned)n;
    if (nt <= 1) {
        fn(ctx, 0, n);
        return;
    }
    size_t per = (size_t)nt * KV_CHUNKS_PER_THREAD;
    chunks c = {.fn = fn, .ctx = ctx, .n = n, .size = (n + per - 1) / per};
    atomic_init(&c.next, 0);
    pthread_attr_t attr;
    int have_attr = pthread_attr_init(&attr) == 0;
    c.placed = have_attr && helpers_placement(&c, &attr);
    pthread_t tid[KV_MAX_THREADS];
    int started[KV_MAX_THREADS] = {0};
    for (unsigned i = 1; i < nt; i++)
        started[i] = pthread_create(&tid[i], have_attr ? &attr : NULL, helper_main, &c) == 0;
    if (have_attr)
        pthread_attr_destroy(&attr);
    take_chunks(&c);
    for (unsigned i = 1; i < nt; i++)
        if (started[i])
            pthread_join(tid[i], NULL);
}
