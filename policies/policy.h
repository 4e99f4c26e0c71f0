/*
 * policy.h - the interface every eviction policy implements.
 *
 * A policy decides and never touches memory (DESIGN.md "Parts"): the daemon
 * shows it what one layer of a sequence holds, the policy answers which of
 * those tokens survive, and the daemon frees, moves or demotes accordingly.
 * Policies include no daemon or kernel header.
 *
 * Lifecycle: policy_find() by name -> policy_params_resolve() validates the
 * client's key=value pairs and fills defaults -> ops->create() builds the
 * per-sequence state -> ops->select() before every append -> ops->destroy().
 */
#ifndef KVSTASH_POLICY_H
#define KVSTASH_POLICY_H

#include <stddef.h>
#include <stdint.h>

#define POLICY_MAX_PARAMS 32
#define POLICY_ERR_LEN 256

/* One parameter a policy accepts, with its default as text. */
typedef struct policy_param_spec {
    const char *key;
    const char *def;
    const char *help;
} policy_param_spec;

/* A resolved parameter set: every key of the policy, in spec order, with the
 * client's value or the default. Values point into storage owned by the set. */
typedef struct policy_params {
    size_t count;
    const char *key[POLICY_MAX_PARAMS];
    char value[POLICY_MAX_PARAMS][64];
} policy_params;

/* What one layer of a sequence holds right now, shown to select(). */
typedef struct policy_layer_view {
    uint32_t layer;
    uint32_t layers;           /* layers in the model */
    uint32_t tokens;           /* tokens held by this layer */
    const uint32_t *positions; /* original position of each held token, ascending */
    uint64_t appended;         /* tokens ever appended to the sequence */
} policy_layer_view;

typedef struct policy_ops {
    const char *name;
    const char *summary; /* one line for `kvstash policy list` */
    const policy_param_spec *params;
    size_t nparams;

    /* Build the per-sequence state from resolved parameters. Returns 0, or -1
     * with a message in err naming the offending parameter. *state is owned
     * by the caller and released with destroy(). */
    int (*create)(const policy_params *p, void **state, char *err, size_t errlen);

    /* Called before `incoming` tokens are appended to the layer. Sets keep[i]
     * to 1 for each held token that survives and 0 for each that is evicted
     * (keep has view->tokens entries). Returns the number evicted.
     * select() must not change the policy's state: the daemon may discard
     * its answer when the append cannot go through (pool full). */
    size_t (*select)(void *state, const policy_layer_view *view, uint32_t incoming,
                     uint8_t *keep);

    void (*destroy)(void *state);
} policy_ops;

/* The registry: look a policy up by name (NULL if unknown). */
const policy_ops *policy_find(const char *name);

/* All registered policies, in a stable order; *count receives their number. */
const policy_ops *const *policy_list(size_t *count);

/*
 * Validate client parameters against ops->params and fill in defaults.
 * Returns 0, or -1 with err set to a message naming the parameter (unknown
 * key, duplicate key, value too long).
 */
int policy_params_resolve(const policy_ops *ops, const char *const *keys,
                          const char *const *values, size_t n, policy_params *out, char *err,
                          size_t errlen);

/* The value of `key` in a resolved set (NULL if the policy has no such key). */
const char *policy_params_get(const policy_params *p, const char *key);

/* Parse `key` as an unsigned integer in [min, max]. Returns 0, or -1 with err
 * set to e.g. "parameter n_sink must be an integer in [0, 65536], got 'x'". */
int policy_params_uint(const policy_params *p, const char *key, uint32_t min, uint32_t max,
                       uint32_t *out, char *err, size_t errlen);

#endif
