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
 *   cuda    (CUDA builds only) one arena of device memory per pool
 *           (kernels/devmem.h), VMM or legacy IPC; ops kv_ops_cuda. The
 *           device is chosen at start (--cuda-device), the arena made when
 *           the pool is (the first Attach of its model), never at start: a
 *           CUDA context costs hundreds of MiB (../shared/GPU.md).
 */
#ifndef KVSTASH_BACKEND_H
#define KVSTASH_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kvstash_map.h"
#include "ops.h"
#include "status.h"

/* One pool's arena. `base` is a device address: only ops may touch it. */
typedef struct backend_arena {
    uint8_t *base;
    size_t bytes;
    int fd;     /* what workers map (a memfd); -1 when none */
    void *priv; /* the backend's own (the host mapping behind a shadow) */
} backend_arena;

/*
 * What a worker is given to reach an arena (the fd socket's MAP answer,
 * proto/kvstash_map.h). arena_share used to return one fd, which is all a
 * memfd needs; a device arena also needs its IPC kind, its GPU's UUID and
 * either an fd (VMM) or a 64-byte handle (legacy), so it fills this instead
 * (issue 14). The host backends fill map.kind = KVSTASH_MAP_MEMFD, bytes and
 * fd, and the MAP answer they produce is the one they always did.
 */
typedef struct backend_share {
    kvstash_map_answer map; /* kind, bytes, GPU UUID, legacy handle */
    int fd; /* memfd or VMM fd, sent with SCM_RIGHTS; -1 when none; the caller closes it */
} backend_share;

/*
 * What Stats, `kvstash status` and the metrics say about where pools live
 * (issue 14), beside the backend's name: the device and how workers map an
 * arena. Plain text, copied into snapshots (snapshot.h).
 */
#define BACKEND_IPC_UNRESOLVED "auto (unresolved)"
typedef struct backend_info {
    char device[48];      /* "none" (host memory), or the GPU's UUID "GPU-xxxxxxxx-..." */
    char device_name[96]; /* the GPU's name as its driver reports it; "" for none */
    /* How workers map an arena: "memfd" (host, shadow), "vmm" or "legacy"
     * (cuda), or BACKEND_IPC_UNRESOLVED while --cuda-ipc auto has not been
     * resolved by a first arena (kv_devmem_alloc says whether the device
     * exports VMM memory only when it is asked to). */
    char ipc[24];
} backend_info;

/* Settings a backend reads at start (config.h keys). */
typedef struct backend_options {
    const char *cuda_device; /* "N" or "GPU-<uuid>" */
    const char *cuda_ipc;    /* "auto", "vmm" or "legacy" */
} backend_options;

typedef struct backend {
    const char *name; /* as in Stats, AttachResponse.backend and metrics */
    const kv_ops *ops;
    /* Once, at daemon start, before any arena; NULL when there is nothing
     * to check. A failure stops kvstashd (st says why). */
    status_code (*start)(const backend_options *o, status *st);
    /* An arena of `bytes` for model `model`; *a is set on success. */
    status_code (*arena_create)(const char *model, size_t bytes, backend_arena *a, status *st);
    void (*arena_destroy)(backend_arena *a);
    /* What a worker needs to map the arena: *sh filled, with a new fd (or
     * -1) that the caller closes once it is sent. */
    status_code (*arena_share)(const backend_arena *a, backend_share *sh, status *st);
    /* Fill *out (backend_info). Called under the store's lock, which
     * arena_create also runs under: what it reads cannot change meanwhile. */
    void (*describe)(backend_info *out);
} backend;

extern const backend backend_host;
extern const backend backend_shadow;
#ifdef KVSTASH_HAVE_CUDA
extern const backend backend_cuda;
#endif

/* The backend named `name`; NULL when there is none in this build. */
const backend *backend_find(const char *name);

/* The names backend_find knows, "host, shadow" style, for messages. */
const char *backend_names(void);

/* "vmm"/"legacy"/"auto" and "N"/"GPU-<uuid>" syntax checks for the config:
 * 0, or -1 with why in err (no CUDA call; the device is looked up at
 * start). */
int backend_cuda_ipc_check(const char *v, char *err, size_t errlen);
int backend_cuda_device_check(const char *v, char *err, size_t errlen);

/* The cuda backend's backend_info, from what it knows (device-free, so
 * that a unit test runs it anywhere): the device's UUID text ("" before
 * start: "unknown"), its name, the --cuda-ipc option and the IPC kind its
 * first arena resolved ("vmm"/"legacy", NULL before any arena). */
void backend_cuda_info(const char *uuid_text, const char *device_name, const char *ipc_option,
                       const char *resolved, backend_info *out);

#endif
