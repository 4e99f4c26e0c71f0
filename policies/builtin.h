/*
 * builtin.h - the policies compiled into kvstash, for the registry only.
 *
 * Each policy file defines one `const policy_ops` object; registry.c lists
 * them. Everyone else finds a policy by name with policy_find().
 */
#ifndef KVSTASH_POLICIES_BUILTIN_H
#define KVSTASH_POLICIES_BUILTIN_H

#include "policy.h"

extern const policy_ops policy_full;      /* full.c: never evicts */
extern const policy_ops policy_streaming; /* streaming.c: sinks + recent window */

#endif
