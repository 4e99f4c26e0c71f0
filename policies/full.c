/*
 * full.c - policy "full": keep every token (DESIGN.md "Policies", baseline).
 *
 * The reference every other policy's quality is measured against: the full
 * cache. It takes no parameters and holds no state (create() yields a NULL
 * state, which destroy() accepts).
 */
#include <string.h>

#include "builtin.h"

static int full_create(const policy_params *p, void **state, char *err, size_t errlen)
{
    (void)p;
    (void)err;
    (void)errlen;
    *state = NULL;
    return 0;
}

static size_t full_select(void *state, const policy_layer_view *view, uint32_t incoming,
                          uint8_t *keep)
{
    (void)state;
    (void)incoming;
    if (view->tokens > 0)
        memset(keep, 1, view->tokens);
    return 0;
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
    .select = full_select,
    .destroy = full_destroy,
};
