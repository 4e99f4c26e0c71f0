/*
 * builtin.h - the policies compiled into kvstash, for the registry only.
 *
 * Each policy file defines one `const policy_ops` object; registry.c lists
 * them. Everyone else finds a policy by name with policy_find().
 */
#ifndef KVSTASH_POLICIES_BUILTIN_H
#define KVSTASH_POLICIES_BUILTIN_H

#include "policy.h"

extern const policy_ops policy_full;           /* full.c: never evicts */
extern const policy_ops policy_streaming;      /* streaming.c: sinks + recent window */
extern const policy_ops policy_confkv;         /* confkv.c: Conf-KV, POLICIES.md §5 */
extern const policy_ops policy_weightedkv;     /* weightedkv.c: WeightedKV, POLICIES.md §4 */
extern const policy_ops policy_reviver;        /* reviver.c: KVReviver, POLICIES.md §3 */
extern const policy_ops policy_h2o;            /* h2o.c: heavy hitters + recent window */
extern const policy_ops policy_tova;           /* tova.c: last-query attention, POLICIES.md §1.9 */
extern const policy_ops policy_snapkv;         /* snapkv.c: SnapKV, POLICIES.md §1.3 */
extern const policy_ops policy_adakv;          /* adakv.c: AdaKV, POLICIES.md §1.9 */
extern const policy_ops policy_criticalkv;     /* criticalkv.c: CriticalKV, POLICIES.md §1.4 */
extern const policy_ops policy_criticalkv_ada; /* criticalkv_ada.c: POLICIES.md §1.5 */
extern const policy_ops policy_ov_block; /* ov_block.c: OpenVINO GenAI eviction, POLICIES.md §2 */

#endif
