/*
 * parallel.c - a fork-join over pthreads for large kernel calls.
 *
 * Threads are created per call and joined before it returns: kernels keep no
 * state between calls (STYLE.md), and a call worth splitting (>= 2 MiB of
 * traffic) costs far more than the ~20 us of creating a thread.
 */
#include "parallel.h"

#include <pthread.h>
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

typedef struct share {
    kv_range_fn fn;
    void *ctx;
    size_t lo, hi;
} share;

static void *run_share(void *p)
{
    share *s = p;
    s->fn(s->ctx, s->lo, s->hi);
    return NULL;
}

void kv_parallel_for(size_t n, size_t bytes, kv_range_fn fn, void *ctx)
{
    unsigned nt = kv_parallel_threads(bytes);
    if (nt > n)
        nt = n < 1 ? 1u : (unsigned)n;
    if (nt <= 1) {
        fn(ctx, 0, n);
        return;
    }
    share sh[KV_MAX_THREADS];
    pthread_t tid[KV_MAX_THREADS];
    int started[KV_MAX_THREADS] = {0};
    for (unsigned i = 0; i < nt; i++)
        sh[i] = (share){fn, ctx, n * i / nt, n * (i + 1) / nt};
    for (unsigned i = 1; i < nt; i++)
        started[i] = pthread_create(&tid[i], NULL, run_share, &sh[i]) == 0;
    run_share(&sh[0]);
    for (unsigned i = 1; i < nt; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            run_share(&sh[i]);
    }
}
