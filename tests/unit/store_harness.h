/*
 * store_harness.h - what the store-level unit tests (test_store, test_ops,
 * test_ring, test_faults) share. Header-only; include it once.
 */
#ifndef KVSTASH_TEST_STORE_HARNESS_H
#define KVSTASH_TEST_STORE_HARNESS_H

#include <stdint.h>

#include "store.h"

/* store_seq_create with a policy's key/value parameters and no label; the
 * sequence's id in *id (undefined on failure). */
static inline status_code seq_create_for(store *st, const char *token, const char *policy,
                                         const char *const *keys, const char *const *values,
                                         size_t n, uint64_t *id, status *s)
{
    store_seq_request req = {policy, keys, values, n, ""};
    store_seq_created out = {0};
    status_code rc = store_seq_create(st, token, &req, &out, s);
    *id = out.seq_id;
    return rc;
}

#endif
