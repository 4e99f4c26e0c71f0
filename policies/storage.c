#include "storage.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

/* The per-layer seed derivation shared with reviver and the kernels (pure
 * integer functions; kernels/sketch_hash.h says why a policy includes it). */
#include "../kernels/sketch_hash.h"

static const char *const on_off[] = {"off", "on", NULL};
static const char *const victim_names[] = {"evict", "sketch", "int8", NULL};
static const char *const demote_names[] = {"off", "int8", "int4", "int2", NULL};
static const uint8_t demote_tiers[] = {POLICY_FULL, POLICY_INT8, POLICY_INT4, POLICY_INT2};

/* The storage keys as parsed (policy_params_parse). */
typedef struct storage_parsed {
    unsigned int8, demote, victims;
    uint32_t int8_window, sketch_rows, sketch_buckets, sketch_seed;
} storage_parsed;

static const policy_param_spec storage_spec[] = {
    POLICY_PARAM_ONE_OF("demote", "off",
                        "demote held tokens but the newest int8_window: off, int8 (POLICIES.md "
                        "§5.4), int4, int2 (KIVI groups)",
                        demote_names, offsetof(storage_parsed, demote)),
    POLICY_PARAM_ONE_OF("int8", "off", "the same as demote=int8: on, off", on_off,
                        offsetof(storage_parsed, int8)),
    POLICY_PARAM_U32("int8_window", "32",
                     "newest held tokens per list that demotion keeps at full precision", 0,
                     1u << 24, offsetof(storage_parsed, int8_window)),
    POLICY_PARAM_ONE_OF("victims", "evict",
                        "where evicted tokens go: evict (dropped), sketch (offloaded to the list's "
                        "count-sketch, revivable), int8 (kept as INT8 out of the table, revivable; "
                        "dropped first under memory pressure)",
                        victim_names, offsetof(storage_parsed, victims)),
    POLICY_PARAM_U32("sketch_rows", "3", "rows of the offload sketch (hash functions), 1..32", 1,
                     32, offsetof(storage_parsed, sketch_rows)),
    POLICY_PARAM_U32("sketch_buckets", "64", "buckets per row of the offload sketch, 1..65536", 1,
                     65536, offsetof(storage_parsed, sketch_buckets)),
    POLICY_PARAM_U32("sketch_seed", "0",
                     "seed of the offload sketch's hash family (POLICIES.md §3.2), 0..4294967295",
                     0, UINT32_MAX, offsetof(storage_parsed, sketch_seed)),
};

const policy_param_spec *policy_storage_spec(size_t *count)
{
    *count = sizeof storage_spec / sizeof storage_spec[0];
    return storage_spec;
}

int policy_storage_parse(const policy_params *p, policy_storage *out, char *err, size_t errlen)
{
    storage_parsed r;
    if (policy_params_parse(p, storage_spec, sizeof storage_spec / sizeof storage_spec[0], &r, err,
                            errlen) != 0)
        return -1;
    if (r.int8 && r.demote > 1) {
        snprintf(err, errlen, "int8=on and demote=%s disagree: give demote alone",
                 demote_names[r.demote]);
        return -1;
    }
    out->demote = demote_tiers[r.int8 ? 1 : r.demote];
    out->int8_window = r.int8_window;
    out->victims = (policy_victims)r.victims;
    out->sketch_rows = r.sketch_rows;
    out->sketch_buckets = r.sketch_buckets;
    out->sketch_seed = r.sketch_seed;
    return 0;
}

void policy_storage_sketch_geometry(const policy_storage *s, uint32_t layer,
                                    policy_sketch_geometry *out)
{
    out->rows = s->sketch_rows;
    out->buckets = s->sketch_buckets;
    out->layer_seed = kv_sketch_layer_seed(s->sketch_seed, layer);
    out->key_mean = 0;
    out->value_mean = 0;
}

uint32_t policy_storage_demote(const policy_storage *s, uint8_t *tier, uint32_t tokens)
{
    if (s->demote == POLICY_FULL)
        return 0;
    uint32_t held = 0, demoted = 0;
    for (uint32_t i = tokens; i-- > 0;) {
        if (tier[i] != POLICY_FULL && !policy_tier_quantised(tier[i]))
            continue;
        if (held++ < s->int8_window)
            continue;
        if (tier[i] == POLICY_FULL) {
            tier[i] = s->demote;
            demoted++;
        }
    }
    return demoted;
}
