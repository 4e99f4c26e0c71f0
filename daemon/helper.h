/*
 * helper.h - a thread kept for a ring thread's parallel work.
 *
 * A decode step decides its layers on two threads (policies/host.h
 * policy_host_set_threads). A thread started and joined at every step
 * costs the ring thread ~55 us on a 2-vCPU VM (clone, placement, exit and
 * join) and starts working ~38 us after it is asked; a thread kept asleep
 * between steps is woken in a few. Each ring thread keeps one, its thread
 * started the first time a step uses it (a ring whose steps never decide
 * on threads has none), at the ring thread's own priority (the ring lends
 * it only to its decode steps: a prompt's decision may run at idle
 * priority on a background thread, which must not borrow a normal one).
 *
 * The helper starts its work on another CPU than the caller's, as a new
 * thread would (kernels/helper_cpus.h): Linux wakes a sleeping thread
 * where it last ran or next to its waker, often behind the caller.
 */
#ifndef KVSTASH_HELPER_H
#define KVSTASH_HELPER_H

#include "host.h" /* policies/ */

typedef struct helper helper;

/* The helper, its thread not yet started; NULL when out of memory: the
 * caller then runs without one. A start that cannot start the thread is
 * refused (policy_helper.start -1), as one while it is lent. */
helper *helper_create(void);

/* Stop the thread and free it; NULL is allowed. Not while lent work runs. */
void helper_destroy(helper *hp);

/* The helper as the policy host borrows it (policy_helper): valid until
 * helper_destroy. */
const policy_helper *helper_lend(helper *hp);

#endif
