/*
 * test_kernels_parallel.c - the fast kernels' fork-join (kernels/cpu/
 * parallel.h): every item of a call is computed exactly once, in
 * contiguous ranges, whatever the number of items and threads; and the
 * helper threads take chunks while the caller is still busy (a helper that
 * only ran once the caller had taken everything would pass the first test
 * and make every call as slow as one thread).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "../../kernels/cpu/parallel.h"
#include "kernels.h"

#define MAX_ITEMS 5000u
#define BIG_CALL ((size_t)64 << 20) /* bytes: as many threads as allowed */

typedef struct counts {
    atomic_uint seen[MAX_ITEMS];
    atomic_uint calls;
} counts;

static void count_items(void *ctx, size_t lo, size_t hi)
{
    counts *c = ctx;
    assert_true(lo < hi && hi <= MAX_ITEMS);
    for (size_t i = lo; i < hi; i++)
        atomic_fetch_add(&c->seen[i], 1);
    atomic_fetch_add(&c->calls, 1);
}

static void test_each_item_once(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 2, 3, 7, 16, 17, 100, 1000, 4097, MAX_ITEMS};
    static const char *caps[] = {"1", "2", "3", "8"};
    counts *c = malloc(sizeof *c);
    assert_non_null(c);
    for (size_t k = 0; k < sizeof caps / sizeof *caps; k++) {
        setenv("KVSTASH_KERNEL_THREADS", caps[k], 1);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            size_t n = sizes[s];
            for (size_t i = 0; i < MAX_ITEMS; i++)
                atomic_init(&c->seen[i], 0);
            atomic_init(&c->calls, 0);
            kv_parallel_for(n, BIG_CALL, count_items, c);
            for (size_t i = 0; i < MAX_ITEMS; i++)
                if (atomic_load(&c->seen[i]) != (i < n ? 1u : 0u))
                    fail_msg("%zu items, threads <= %s: item %zu computed %u times", n, caps[k], i,
                             atomic_load(&c->seen[i]));
            /* a call of one thread is one range; else chunks */
            if (kv_parallel_threads(BIG_CALL) == 1 || n == 1)
                assert_int_equal(atomic_load(&c->calls), 1);
        }
    }
    unsetenv("KVSTASH_KERNEL_THREADS");
    free(c);
}

/* The caller's first chunk waits (up to 10 s) until another thread has
 * taken one: with two threads allowed, a helper must take chunks while
 * the caller is busy with its own. */
typedef struct race {
    pthread_t caller;
    atomic_uint by_caller, by_helpers;
} race;

static void wait_for_helper(void *ctx, size_t lo, size_t hi)
{
    race *r = ctx;
    (void)lo, (void)hi;
    if (!pthread_equal(pthread_self(), r->caller)) {
        atomic_fetch_add(&r->by_helpers, 1);
        return;
    }
    if (atomic_fetch_add(&r->by_caller, 1) > 0)
        return;
    struct timespec step = {0, 1000000};
    for (int i = 0; i < 10000 && atomic_load(&r->by_helpers) == 0; i++)
        nanosleep(&step, NULL);
}

static void test_helpers_take_chunks(void **state)
{
    (void)state;
    setenv("KVSTASH_KERNEL_THREADS", "2", 1);
    unsigned nt = kv_parallel_threads(BIG_CALL);
    if (nt < 2) {
        unsetenv("KVSTASH_KERNEL_THREADS");
        skip(); /* one CPU online: no helper to start */
    }
    race r = {.caller = pthread_self()};
    atomic_init(&r.by_caller, 0);
    atomic_init(&r.by_helpers, 0);
    kv_parallel_for(1000, BIG_CALL, wait_for_helper, &r);
    unsetenv("KVSTASH_KERNEL_THREADS");
    assert_true(atomic_load(&r.by_helpers) > 0);
    assert_int_equal(atomic_load(&r.by_caller) + atomic_load(&r.by_helpers), 4); /* 2 each */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_item_once),
        cmocka_unit_test(test_helpers_take_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
