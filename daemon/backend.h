/*
 * backend.h - where a pool's arena lives and how workers reach it.
 *
 * A backend creates, shares and destroys pool arenas and names the memory
 * operations (kernels/ops.h) that move bytes in them; nothing else in the
 * daemon knows which backend runs (Redis's ae.c: one file per backend,
 * backend_host.c, backend_shadow.c, the same few functions).
 *
 *   host    a sealed memfd, mapped by the daemon and by every worker
 *           (docs/protocol.md); ops kv_ops_cpu. The default.
 *   shadow  the host arena, but the daemon and its workers see it at a
 *           PROT_NONE shadow address (kv_ops_shadow): any access that
 *           bypasses the ops faults, as it would on a GPU. For tests
 *           (README, "The shadow backend").
 */
#ifndef KVSTASH_BACKEND_H
#define KVSTASH_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"
#include "status.h"

/* One pool's arena. `base` is a device address: only ops may touch it. */
typedef struct backend_arena {
    uint8_t *base;
    size_t bytes;
    int fd;     /* what workers map (a memfd); -1 when none */
    void *priv; /* the backend's own (the host mapping behind a shadow) */
} backend_arena;

typedef struct backend {
    const char *name; /* as in Stats, AttachResponse.backend and metrics */
    const kv_ops *ops;
    /* An arena of `bytes` for model `model`; *a is set on success. */
    status_code (*arena_create)(const char *model, size_t bytes, backend_arena *a, status *st);
    void (*arena_destroy)(backend_arena *a);
    /* A new descriptor of the arena for a worker; the caller closes it. */
    status_code (*arena_share)(const backend_arena *a, int *fd, status *st);
} backend;

extern const backend backend_host;
extern const backend backend_shadow;

/* The backend named `name`; NULL when there is none. */
const backend *backend_find(const char *name);

/* The names backend_find knows, "host|shadow" style, for messages. */
const char *backend_names(void);

#endif
