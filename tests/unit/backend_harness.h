/*
 * backend_harness.h - running one cmocka test on the host backend and
 * again on shadow (test_seq, test_seq_spill): shadow's pool memory faults
 * unless reached through the ops, so a test that passes there moves every
 * byte through the memory seam. Header-only; include it once, after
 * cmocka.h and backend.h.
 */
#ifndef KVSTASH_TEST_BACKEND_HARNESS_H
#define KVSTASH_TEST_BACKEND_HARNESS_H

#include "backend.h"

/* The backend a test runs on: its prestate (ON_SHADOW), host when none. */
static inline const backend *backend_of(void **state)
{
    return *state != NULL ? (const backend *)*state : &backend_host;
}

/* Test f again on the shadow backend, named "f/shadow". */
#define ON_SHADOW(f)                                                                               \
    {                                                                                              \
#f "/shadow", f, NULL, NULL, (void *)&backend_shadow                                       \
    }

#endif
