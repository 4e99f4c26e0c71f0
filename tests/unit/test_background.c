/*
 * Unit tests of daemon/background.h: the work runs on a thread of its own
 * at the priority asked for (SCHED_IDLE, or nice 19), the caller's own
 * untouched, and its result comes back, for many callers at once; without
 * background threads (BACKGROUND_NORMAL, unknown values) it runs on the
 * caller's thread. The names parse back.
 */
#define _GNU_SOURCE 1 /* SCHED_IDLE */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "background.h"

/* What the work saw of the thread it ran on. */
typedef struct seen {
    pid_t tid;
    int nice, policy;
    int calls;
} seen;

static pid_t thread_id(void)
{
    return (pid_t)syscall(SYS_gettid);
}

static int thread_nice(void)
{
    errno = 0;
    int n = getpriority(PRIO_PROCESS, (id_t)thread_id());
    assert_int_equal(errno, 0);
    return n;
}

static int thread_policy(void)
{
    int policy;
    struct sched_param sp;
    assert_int_equal(pthread_getschedparam(pthread_self(), &policy, &sp), 0);
    return policy;
}

static int look(void *arg)
{
    seen *s = arg;
    s->tid = thread_id();
    s->nice = thread_nice();
    s->policy = thread_policy();
    s->calls++;
    return 42 + s->calls;
}

static void test_idle(void **state)
{
    (void)state;
    int nice = thread_nice(), policy = thread_policy();
    background *b = background_start(BACKGROUND_IDLE, 2);
    assert_non_null(b);
    for (int call = 1; call <= 3; call++) {
        seen s = {.calls = call - 1};
        int in_background = -1;
        assert_int_equal(background_run(b, look, &s, &in_background), 42 + call);
        assert_int_equal(s.calls, call);
        assert_int_equal(in_background, 1);
        assert_int_not_equal(s.tid, thread_id());
        assert_int_equal(s.policy, SCHED_IDLE);
    }
    assert_int_equal(thread_policy(), policy); /* the caller's own are untouched */
    assert_int_equal(thread_nice(), nice);
    background_stop(b);
}

static void test_low(void **state)
{
    (void)state;
    int nice = thread_nice(), policy = thread_policy();
    if (nice >= 19)
        skip(); /* already at the lowest: nothing to lower */
    background *b = background_start(BACKGROUND_LOW, 1);
    assert_non_null(b);
    seen s = {0};
    int in_background = -1;
    assert_int_equal(background_run(b, look, &s, &in_background), 43);
    assert_int_equal(in_background, 1);
    assert_int_not_equal(s.tid, thread_id());
    assert_int_equal(s.nice, 19);
    assert_int_equal(s.policy, policy);
    assert_int_equal(thread_nice(), nice);
    background_stop(b);
}

static void test_on_the_caller(void **state)
{
    (void)state;
    assert_null(background_start(BACKGROUND_NORMAL, 2));
    assert_null(background_start(BACKGROUND_IDLE, 0));
    assert_null(background_start((background_priority)3, 2));
    seen s = {0};
    int in_background = -1;
    assert_int_equal(background_run(NULL, look, &s, &in_background), 43);
    assert_int_equal(in_background, 0);
    assert_int_equal(s.tid, thread_id());
    background_stop(NULL);
}

/* Callers on several threads at once, more than the background threads:
 * each gets its own work's result, and every call ran exactly once. */
enum { CALLERS = 6, CALLS = 200 };

typedef struct caller {
    background *b;
    int index;
    int wrong;
} caller;

static int triple(void *arg)
{
    int *v = arg;
    *v *= 3;
    return *v + 1;
}

static void *call_many(void *arg)
{
    caller *c = arg;
    for (int i = 0; i < CALLS; i++) {
        int v = c->index * 1000 + i, in_background = 0;
        int r = background_run(c->b, triple, &v, &in_background);
        c->wrong += v != 3 * (c->index * 1000 + i) || r != v + 1 || !in_background;
    }
    return NULL;
}

static void test_many_callers(void **state)
{
    (void)state;
    background *b = background_start(BACKGROUND_IDLE, 2);
    assert_non_null(b);
    pthread_t t[CALLERS];
    caller c[CALLERS];
    for (int i = 0; i < CALLERS; i++) {
        c[i] = (caller){b, i, 0};
        assert_int_equal(pthread_create(&t[i], NULL, call_many, &c[i]), 0);
    }
    for (int i = 0; i < CALLERS; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(c[i].wrong, 0);
    }
    background_stop(b);
}

static void test_names(void **state)
{
    (void)state;
    background_priority p = BACKGROUND_IDLE;
    for (int i = BACKGROUND_NORMAL; i <= BACKGROUND_IDLE; i++) {
        const char *name = background_priority_name((background_priority)i);
        assert_non_null(name);
        assert_int_equal(background_priority_parse(name, &p), 0);
        assert_int_equal(p, i);
    }
    assert_string_equal(background_priority_name(BACKGROUND_IDLE), "idle");
    assert_null(background_priority_name((background_priority)3));
    assert_int_equal(background_priority_parse("IDLE", &p), -1);
    assert_int_equal(background_priority_parse("", &p), -1);
    assert_int_equal(p, BACKGROUND_IDLE); /* unchanged by a refusal */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idle),          cmocka_unit_test(test_low),
        cmocka_unit_test(test_on_the_caller), cmocka_unit_test(test_many_callers),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
