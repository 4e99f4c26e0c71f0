/*
 * seq_harness.h - what the sequence-level unit tests (test_seq,
 * test_seq_spill) share: running one cmocka test on the host backend and
 * again on shadow, whose pool memory faults unless reached through the
 * ops (so a test that passes there moves every byte through the memory
 * seam), and giving back what a Revive made. Header-only; include it
 * once, after cmocka.h.
 */
#ifndef KVSTASH_TEST_SEQ_HARNESS_H
#define KVSTASH_TEST_SEQ_HARNESS_H

#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "pool.h"
#include "seq.h"

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

/* A Revive's blocks back to pool p, its arrays freed, *out zeroed. */
static inline void revived_free(pool *p, seq_revived *out)
{
    for (size_t i = 0; i < out->nblocks; i++)
        pool_free_block(p, out->blocks[i]);
    free(out->segs);
    free(out->positions);
    free(out->src_tier);
    free(out->blocks);
    memset(out, 0, sizeof *out);
}

#endif
