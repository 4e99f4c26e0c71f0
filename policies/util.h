/*
 * util.h - small helpers every policy file needs, shared (policy-internal;
 * not part of policy.h's interface).
 */
#ifndef KVSTASH_POLICIES_UTIL_H
#define KVSTASH_POLICIES_UTIL_H

#include <stddef.h>

/* printf into err[errlen] (no-op when err is NULL or errlen is 0). */
void policy_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#include <stdint.h>

/*
 * Keep in a[0..k) the k entries of a[0..m) (indices into s) that come first
 * in eviction order: lower s[] first; equal scores to the lower index when
 * ties_to_lower, else to the higher. The set is exact, its order inside
 * a[0..k) is not. A bounded max-heap: O(m log k).
 */
void policy_select_evict_first(uint32_t *a, uint32_t m, uint32_t k, const double *s,
                               int ties_to_lower);

/*
 * For ops->save: a malloc'd array with room for `room` elements of `size`
 * bytes whose first `used` (<= room) are copied from src (src may be NULL
 * when used is 0). At least one byte is allocated, so NULL always means out
 * of memory. The caller frees.
 */
void *policy_array_copy(const void *src, size_t used, size_t room, size_t size);

#endif
