/*
 * helper_cpus.h - start a call's helper threads on other CPUs than the
 * caller's (header only: the fast kernels' fork-join, kernels/cpu/
 * parallel.c, the policy host's layers on threads, policies/host.c, and
 * the ring threads' kept helpers, daemon/helper.c).
 *
 * Linux places a new thread by the load of the instant it is created, often
 * on its creator's CPU (the other CPUs busy with that moment's work: on a
 * 2-vCPU VM, the worker that just asked for the call, spinning on its
 * answer), and does not move a waiting thread to a CPU that frees up a
 * moment later: the helper then waits for the caller to finish the work
 * alone. Measured on such a VM (docs/bench.md "Helpers on another CPU"): a
 * Revive's INT8 dequantisation of 4,096 tokens took 1.2 ms on two threads
 * as on one, 0.67 ms placed; h2o's decode step at 32k tokens 2.3-2.6 ms,
 * 2.0 placed. A helper is only started elsewhere: once it runs it may go
 * to any of the caller's CPUs (helper_cpus_enter).
 *
 * The including file defines _GNU_SOURCE before any header (the CPU-set
 * calls are GNU extensions).
 */
#ifndef KVSTASH_HELPER_CPUS_H
#define KVSTASH_HELPER_CPUS_H

#ifndef _GNU_SOURCE
#error "helper_cpus.h needs _GNU_SOURCE defined before the first system header"
#endif

#include <pthread.h>
#include <sched.h>

typedef struct helper_cpus {
    cpu_set_t allowed; /* the caller's CPUs, which helpers return to */
    int placed;        /* helpers start off the caller's CPU */
} helper_cpus;

/* The caller's CPUs into c->allowed and all of them but the one it runs
 * on into *others; 0 when there are none (one CPU, or the calls fail). */
static inline int helper_cpus_others(helper_cpus *c, cpu_set_t *others)
{
    int me = sched_getcpu();
    c->placed = 0;
    if (me < 0 || pthread_getaffinity_np(pthread_self(), sizeof c->allowed, &c->allowed) != 0 ||
        !CPU_ISSET(me, &c->allowed) || CPU_COUNT(&c->allowed) < 2)
        return 0;
    *others = c->allowed;
    CPU_CLR(me, others);
    return 1;
}

/* Sets attr to start threads on any of the caller's CPUs but the one it
 * runs on; c->placed says whether it did (not when the caller has one CPU,
 * or the calls fail: then attr is as it was). */
static inline void helper_cpus_place(helper_cpus *c, pthread_attr_t *attr)
{
    cpu_set_t others;
    if (helper_cpus_others(c, &others))
        c->placed = pthread_attr_setaffinity_np(attr, sizeof others, &others) == 0;
}

/* The same for a thread kept asleep between calls (daemon/helper.h),
 * before it is woken: it wakes on another CPU than the caller's. */
static inline void helper_cpus_place_thread(helper_cpus *c, pthread_t thread)
{
    cpu_set_t others;
    if (helper_cpus_others(c, &others))
        c->placed = pthread_setaffinity_np(thread, sizeof others, &others) == 0;
}

/* First thing in a helper: the caller's CPUs again, for the scheduler to
 * move it among. */
static inline void helper_cpus_enter(const helper_cpus *c)
{
    if (c->placed)
        (void)pthread_setaffinity_np(pthread_self(), sizeof c->allowed, &c->allowed);
}

#endif
