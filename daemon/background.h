/*
 * background.h - work that must not take a CPU from the workers' steps.
 *
 * One sequence's long work (a Revive's copy: milliseconds for a few
 * thousand tokens; a long prompt's decision or demotion) competes for the
 * CPUs with every other worker's ring thread. On a host with fewer free CPUs than busy threads, a
 * step whose ring thread loses its CPU to such a copy waits for a scheduler slice, milliseconds,
 * though nothing it needs is locked (issue 16 §3). Run at a lower priority, the copy still has
 * every CPU no step wants, and gives one up as soon as a step does: the sequence that moves waits,
 * not the others.
 *
 * The work goes to a few threads that keep their priority for the
 * daemon's life: an unprivileged thread cannot raise its own again, and a
 * thread made for each call would start every copy on an equal footing
 * with the steps (the scheduler places a new thread with no debt), which
 * measured worse than no background at all (docs/bench.md).
 */
#ifndef KVSTASH_BACKGROUND_H
#define KVSTASH_BACKGROUND_H

typedef enum background_priority {
    BACKGROUND_NORMAL = 0, /* no threads: the work runs on the caller's, at its priority */
    BACKGROUND_LOW,        /* nice 19: 1/68 of a normal thread's share of a busy CPU */
    /* SCHED_IDLE: whatever no other thread wants; a waking thread of any
     * other policy takes its CPU at once (sched(7)) */
    BACKGROUND_IDLE,
} background_priority;

/* "normal", "low", "idle"; NULL for anything else. */
const char *background_priority_name(background_priority p);
/* The priority of that name: 0, or -1 for an unknown name. */
int background_priority_parse(const char *name, background_priority *out);

typedef struct background background;

/*
 * Start `threads` threads of priority p. NULL for BACKGROUND_NORMAL, or
 * when no thread could be started at that priority (out of memory, a
 * container that forbids it): background_run then runs the work on the
 * caller's thread, as it would without this module.
 */
background *background_start(background_priority p, unsigned threads);

/* Stop the threads (after the work queued has run) and free b; NULL is
 * nothing. No background_run may be in progress or follow. */
void background_stop(background *b);

/*
 * fn(arg) on one of b's threads, in the order of the calls, waiting for
 * it; returns fn's result. On the caller's thread when b is NULL.
 * *in_background (may be NULL) says which happened.
 */
int background_run(background *b, int (*fn)(void *), void *arg, int *in_background);

#endif
