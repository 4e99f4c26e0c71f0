/*
 * registry.c - the table of built-in policies (policy.h "The registry").
 *
 * The order of the table is the order `kvstash policy list` shows; new
 * policies go at the end so the listing stays stable.
 */
#include <string.h>

#include "builtin.h"
#include "policy.h"

static const policy_ops *const registry[] = {
    &policy_full,    &policy_streaming,  &policy_confkv,         &policy_weightedkv,
    &policy_reviver, &policy_h2o,        &policy_tova,           &policy_snapkv,
    &policy_adakv,   &policy_criticalkv, &policy_criticalkv_ada, &policy_ov_block,
};

#define REGISTRY_COUNT (sizeof(registry) / sizeof(registry[0]))

const policy_ops *policy_find(const char *name)
{
    if (name == NULL)
        return NULL;
    for (size_t i = 0; i < REGISTRY_COUNT; i++) {
        if (strcmp(registry[i]->name, name) == 0)
            return registry[i];
    }
    return NULL;
}

const policy_ops *const *policy_list(size_t *count)
{
    if (count != NULL)
        *count = REGISTRY_COUNT;
    return registry;
}
