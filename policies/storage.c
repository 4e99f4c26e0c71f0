#include "storage.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

/* The per-layer seed derivation shared with reviver and the kernels (pure
 * integer functions; kernels/sketch_hash.h says why a policy includes it). */
#include "../kernels/sketch_hash.h"
#include "select.h"
#include "util.h"

static const char *const on_off[] = {"off", "on", NULL};
static const char *const victim_names[] = {"evict", "sketch", "int8", NULL};
static const char *const demote_names[] = {"off", "int8", "int4", "int2", NULL};
static const uint8_t demote_tiers[] = {POLICY_FULL, POLICY_INT8, POLICY_INT4, POLICY_INT2};

/* The storage keys as parsed (policy_params_parse). */
typedef struct storage_parsed {
    unsigned int8, demote, victims;
    uint32_t int8_window, sketch_rows, sketch_buckets, sketch_seed;
    double demote_keep;
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
    POLICY_PARAM_F64("demote_keep", "0",
                     "share (0..1) of the held tokens older than int8_window that demotion keeps "
                     "at full precision: the most attended ones (ZipCache); 0: by age alone",
                     0, 1, offsetof(storage_parsed, demote_keep)),
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
    out->demote_keep = r.demote_keep;
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

size_t policy_storage_demote_scratch(uint32_t tokens)
{
    return (size_t)tokens * (sizeof(uint64_t) + 2);
}

static int held(uint8_t tier)
{
    return tier == POLICY_FULL || policy_tier_quantised(tier);
}

/* demote_keep: the FULL candidates (in[i]) beyond the share that may stay
 * FULL are demoted, lowest importance first, ties to the older (lower
 * index): a bottom-k in index order (select.h). */
static uint32_t demote_least_important(const policy_storage *s, uint8_t *tier, uint32_t tokens,
                                       const double *importance, uint8_t *in, uint32_t candidates,
                                       uint32_t full, void *scratch)
{
    uint32_t keep = (uint32_t)(s->demote_keep * candidates);
    if (full <= keep)
        return 0;
    uint64_t *keys = scratch;
    uint8_t *chosen = (uint8_t *)(keys + tokens);
    size_t m = 0;
    for (uint32_t i = 0; i < tokens; i++)
        if (in[i])
            keys[m++] = policy_key(importance[i]);
    policy_cut cut = policy_select_cut(keys, m, full - keep);
    policy_cut_mark(&cut, importance, 1.0, in, 1, tokens, 0, chosen);
    uint32_t demoted = 0;
    for (uint32_t i = 0; i < tokens; i++)
        if (chosen[i]) {
            tier[i] = s->demote;
            demoted++;
        }
    return demoted;
}

/* The full-precision tokens of tier[0..n) to `to`; returns how many: one
 * vectorised pass (the host runs the age rule over every list at every
 * step: a branch and a counter a token was a quarter of an int8=on decode
 * step at 32k tokens). */
POLICY_HOT static uint32_t demote_full(uint8_t *tier, uint32_t n, uint8_t to)
{
    uint32_t demoted = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t full = tier[i] == POLICY_FULL;
        tier[i] = full ? to : tier[i];
        demoted += full;
    }
    return demoted;
}

/* The age rule: every held token before the newest int8_window held ones
 * that is at full precision goes to s->demote. */
static uint32_t demote_by_age(const policy_storage *s, uint8_t *tier, uint32_t tokens)
{
    uint32_t i = tokens, seen = 0;
    while (i > 0 && seen < s->int8_window)
        seen += (uint32_t)held(tier[--i]);
    if (seen < s->int8_window)
        return 0; /* the window holds every held token */
    return demote_full(tier, i, s->demote);
}

uint32_t policy_storage_demote(const policy_storage *s, uint8_t *tier, uint32_t tokens,
                               const double *importance, void *scratch)
{
    if (s->demote == POLICY_FULL)
        return 0;
    if (s->demote_keep <= 0 || tokens == 0)
        return demote_by_age(s, tier, tokens);
    uint8_t *in = (uint8_t *)scratch + (size_t)tokens * (sizeof(uint64_t) + 1);
    uint32_t seen = 0, candidates = 0, full = 0;
    for (uint32_t i = tokens; i-- > 0;) {
        in[i] = 0;
        if (!held(tier[i]) || seen++ < s->int8_window)
            continue;
        candidates++;
        if (tier[i] == POLICY_FULL) {
            in[i] = 1;
            full++;
        }
    }
    return demote_least_important(s, tier, tokens, importance, in, candidates, full, scratch);
}
