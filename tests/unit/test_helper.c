/*
 * Unit tests of daemon/helper.h: the kept thread runs what it is lent on a
 * thread other than the caller's, the same one each time, while the caller
 * goes on; it refuses a second piece of work until the first is joined;
 * join returns only once the work has; many starts and joins in a row
 * lose no wake-up; destroy stops the thread whether it was lent or not.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "helper.h"

typedef struct work {
    pthread_t ran_on;
    atomic_int release; /* the work ends once the caller sets it */
    atomic_int done;
    int calls;
} work;

static void work_run(void *arg)
{
    work *w = arg;
    w->ran_on = pthread_self();
    while (!atomic_load(&w->release))
        nanosleep(&(struct timespec){0, 100000}, NULL);
    w->calls++;
    atomic_store(&w->done, 1);
}

static void test_lends_one_thread(void **unused)
{
    (void)unused;
    helper *hp = helper_create();
    assert_non_null(hp);
    const policy_helper *p = helper_lend(hp);
    work a = {0}, b = {0};
    assert_int_equal(p->start(p->ctx, work_run, &a), 0);
    /* Lent: a second piece of work is refused while the first runs. */
    assert_int_equal(p->start(p->ctx, work_run, &b), -1);
    atomic_store(&a.release, 1);
    p->join(p->ctx);
    assert_int_equal(atomic_load(&a.done), 1); /* join waited for it */
    assert_int_equal(a.calls, 1);
    assert_false(pthread_equal(a.ran_on, pthread_self()));
    /* Joined: free again, and the same thread runs the next. */
    atomic_store(&b.release, 1);
    assert_int_equal(p->start(p->ctx, work_run, &b), 0);
    p->join(p->ctx);
    assert_int_equal(b.calls, 1);
    assert_true(pthread_equal(a.ran_on, b.ran_on));
    assert_int_equal(a.calls, 1); /* not run again */
    helper_destroy(hp);
}

static void count_run(void *arg)
{
    (*(int *)arg)++;
}

static void test_many_in_a_row(void **unused)
{
    (void)unused;
    helper *hp = helper_create();
    assert_non_null(hp);
    const policy_helper *p = helper_lend(hp);
    int count = 0;
    for (int i = 0; i < 2000; i++) {
        assert_int_equal(p->start(p->ctx, count_run, &count), 0);
        p->join(p->ctx);
        assert_int_equal(count, i + 1); /* each run ended before its join returned */
    }
    helper_destroy(hp);
    helper_destroy(NULL);
    helper_destroy(helper_create()); /* never lent */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lends_one_thread),
        cmocka_unit_test(test_many_in_a_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
