/*
 * full.c - policy "full": keep every token (DESIGN.md "Policies", baseline).
 *
 * The reference every other policy's quality is measured against: the full
 * cache. It takes no parameters and holds no state (create() yields a NULL
 * state, which destroy() accepts).
 */
#include <string.h>

#include "builtin.h"

static int full_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                       size_t errlen)
{
    (void)p;
    (void)g;
    (void)err;
    (void)errlen;
    *state = NULL;
    return 0;
}

static int full_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                     policy_decision *d, char *err, size_t errlen)
{
    (void)state;
    (void)view;
    (void)stats;
    (void)d;
    (void)err;
    (void)errlen;
    return 0; /* the decision comes preset to "keep as is" */
}

static void full_destroy(void *state)
{
    (void)state;
}

const policy_ops policy_full = {
    .name = "full",
    .summary = "keep every token (no eviction); the full-cache baseline",
    .params = NULL,
    .nparams = 0,
    .create = full_create,
    .step = full_step,
    .destroy = full_destroy,
};
