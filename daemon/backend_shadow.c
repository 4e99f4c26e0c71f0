/*
 * backend_shadow.c - the host arena behind a shadow address (kernels/ops.h
 * kv_ops_shadow): the daemon holds only the PROT_NONE shadow, so a direct
 * access to pool memory anywhere in the daemon faults. Workers learn the
 * backend from AttachResponse.backend and put their own shadow over their
 * mapping (libkvstash).
 */
#include "backend.h"
#include "backend_memfd.h"

static status_code shadow_arena_create(const char *model, size_t bytes, backend_arena *a,
                                       status *st)
{
    if (memfd_arena_create(model, bytes, a, st) != ST_OK)
        return st->code;
    uint8_t *shadow = kv_shadow_map(a->base, bytes);
    if (shadow == NULL) {
        memfd_arena_destroy(a);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "cannot reserve %zu bytes of shadow range",
                          bytes);
    }
    a->priv = a->base;
    a->base = shadow;
    return ST_OK;
}

static void shadow_arena_destroy(backend_arena *a)
{
    if (a->priv != NULL) {
        kv_shadow_unmap(a->base);
        a->base = a->priv;
        a->priv = NULL;
    }
    memfd_arena_destroy(a);
}

const backend backend_shadow = {
    .name = "shadow",
    .ops = &kv_ops_shadow,
    .start = NULL,
    .arena_create = shadow_arena_create,
    .arena_destroy = shadow_arena_destroy,
    .arena_share = memfd_arena_share,
    .describe = memfd_describe,
};
