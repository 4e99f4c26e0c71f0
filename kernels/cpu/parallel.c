/*
 * parallel.c - a fork-join over pthreads for large kernel calls.
 *
 * Threads are created per call and joined before it returns: kernels keep no
 * state between calls (STYLE.md), and a call worth splitting (>= 2 MiB of
 * traffic) costs far more than the ~20 us of creating a thread.
 */
#define _GNU_SOURCE 1 /* helper_cpus.h */

#include "parallel.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "../helper_cpus.h"
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
    helper_cpus cpus;
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
    helper_cpus_enter(&c->cpus);
    take_chunks(c);
    return NULL;
}

/*
 * The items go in KV_CHUNKS_PER_THREAD chunks a thread, taken in order from
 * a shared counter rather than dealt out in fixed shares: a thread that
 * starts late (a busy host, or a VM's idle CPU that must first be woken)
 * takes fewer, and the call ends when the work does, not when the last
 * thread's share does. Two, not more: a chunk costs some kernels a walk of
 * every token (the sketch's insert splits channels), and 8 a thread made a
 * victims=sketch step 25% slower (bench_tiers). Where no thread starts,
 * the caller takes every chunk.
 */
#define KV_CHUNKS_PER_THREAD 2u

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
    if (have_attr) /* helper_cpus.h: else they wait for the caller */
        helper_cpus_place(&c.cpus, &attr);
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
