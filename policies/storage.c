#include "storage.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "reviver.h"

static const policy_param_spec storage_spec[] = {
    {"int8", "off", "demote held tokens to INT8 (POLICIES.md §5.4): on, off"},
    {"int8_window", "32", "newest held tokens per list that int8=on keeps at full precision"},
    {"victims", "evict",
     "where evicted tokens go: evict (dropped), sketch (offloaded to the list's count-sketch, "
     "revivable), int8 (kept as INT8 out of the table, revivable; dropped first under memory "
     "pressure)"},
    {"sketch_rows", "3", "rows of the offload sketch (hash functions), 1..32"},
    {"sketch_buckets", "64", "buckets per row of the offload sketch, 1..65536"},
    {"sketch_seed", "0", "seed of the offload sketch's hash family (POLICIES.md §3.2)"},
};

const policy_param_spec *policy_storage_spec(size_t *count)
{
    *count = sizeof storage_spec / sizeof storage_spec[0];
    return storage_spec;
}

int policy_storage_parse(const policy_params *p, policy_storage *out, char *err, size_t errlen)
{
    static const char *const on_off[] = {"off", "on", NULL};
    static const char *const victims[] = {"evict", "sketch", "int8", NULL};
    unsigned int8 = 0, v = 0;
    uint32_t seed_hi = 0;
    if (policy_params_choice(p, "int8", on_off, &int8, err, errlen) != 0 ||
        policy_params_uint(p, "int8_window", 0, 1u << 24, &out->int8_window, err, errlen) != 0 ||
        policy_params_choice(p, "victims", victims, &v, err, errlen) != 0 ||
        policy_params_uint(p, "sketch_rows", 1, 32, &out->sketch_rows, err, errlen) != 0 ||
        policy_params_uint(p, "sketch_buckets", 1, 65536, &out->sketch_buckets, err, errlen) != 0 ||
        policy_params_uint(p, "sketch_seed", 0, UINT32_MAX, &seed_hi, err, errlen) != 0)
        return -1;
    out->int8 = (int)int8;
    out->victims = (policy_victims)v;
    out->sketch_seed = seed_hi;
    return 0;
}

void policy_storage_sketch_geometry(const policy_storage *s, uint32_t layer,
                                    policy_sketch_geometry *out)
{
    out->rows = s->sketch_rows;
    out->buckets = s->sketch_buckets;
    out->layer_seed = reviver_layer_seed(s->sketch_seed, layer);
    out->key_mean = 0;
    out->value_mean = 0;
}

uint32_t policy_storage_demote(const policy_storage *s, uint8_t *tier, uint32_t tokens)
{
    if (!s->int8)
        return 0;
    uint32_t held = 0, demoted = 0;
    for (uint32_t i = tokens; i-- > 0;) {
        if (tier[i] != POLICY_FULL && tier[i] != POLICY_INT8)
            continue;
        if (held++ < s->int8_window)
            continue;
        if (tier[i] == POLICY_FULL) {
            tier[i] = POLICY_INT8;
            demoted++;
        }
    }
    return demoted;
}
