/*
 * backend_memfd.h - the memfd arena both host-memory backends use
 * (backend_host.c defines it, backend_shadow.c puts a shadow over it).
 * Internal to the backend files.
 */
#ifndef KVSTASH_BACKEND_MEMFD_H
#define KVSTASH_BACKEND_MEMFD_H

#include "backend.h"

/* A sealed memfd of `bytes`, mapped: a->base is the real mapping. */
status_code memfd_arena_create(const char *model, size_t bytes, backend_arena *a, status *st);
void memfd_arena_destroy(backend_arena *a);
status_code memfd_arena_share(const backend_arena *a, backend_share *sh, status *st);
/* Device "none", IPC "memfd". */
void memfd_describe(backend_info *out);

#endif
