/*
 * backend_cuda.c - pools in CUDA device memory (backend.h `cuda`): one
 * arena per pool from kernels/devmem.h, shared with workers by CUDA IPC,
 * bytes moved by kv_ops_cuda. Built only with CUDA (KVSTASH_HAVE_CUDA;
 * daemon/CMakeLists.txt leaves this file out otherwise).
 *
 * At start (`start`): kv_devmem_probe, so that a host without a usable
 * device stops kvstashd with the reason; then the device named by
 * --cuda-device (an ordinal, or the GPU's UUID, which containers do not
 * renumber) is looked up and its UUID kept for MAP answers. No context is
 * made here beyond what the runtime needs to count and describe devices:
 * the arena, and with it the context (hundreds of MiB), comes with the
 * first pool (arena_create), as ../shared/GPU.md asks.
 *
 * IPC kind (--cuda-ipc): vmm (a POSIX fd, sent with SCM_RIGHTS only to a
 * peer whose SO_PEERCRED identity passed), legacy (a 64-byte handle that
 * opens for anyone who reads it), or auto: VMM, and legacy where
 * kv_devmem_alloc says the device cannot (KV_DEVMEM_ENOTSUP). One pool is
 * one kind (legacy IPC fails on VMM memory).
 *
 * The chosen device is process state (one daemon, one backend, one device),
 * set once at start before any thread uses it; kv_ops_cuda selects it on
 * every thread that moves bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "backend.h"
#include "devmem.h"
#include "log.h"

static struct {
    int device;                           /* ordinal in this process */
    uint8_t uuid[KVSTASH_GPU_UUID_BYTES]; /* its UUID, for MAP answers */
    char uuid_text[KVSTASH_GPU_UUID_TEXT];
    char name[96];      /* its name, for Stats (backend_info) */
    kv_devmem_kind ipc; /* KV_DEVMEM_NONE = auto */
    /* The kind auto resolved to at the first arena (KV_DEVMEM_NONE before):
     * whether the device exports VMM memory is a property of the device,
     * so every later arena gets the same. */
    kv_devmem_kind resolved;
} cuda_cfg = {.device = -1};

/* The ordinal of the device `spec` names ("N" or "GPU-<uuid>") and its UUID. */
static status_code find_device(const char *spec, int count, status *st)
{
    uint8_t want[KVSTASH_GPU_UUID_BYTES];
    int by_uuid = strncmp(spec, "GPU-", 4) == 0;
    if (by_uuid && kvstash_gpu_uuid_parse(spec, want) != 0)
        return status_set(st, ST_INVALID_ARGUMENT, "--cuda-device: malformed GPU UUID '%.48s'",
                          spec);
    int want_ordinal = by_uuid ? -1 : atoi(spec);
    if (!by_uuid && want_ordinal >= count)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "--cuda-device %d: this host has %d CUDA device%s (0 to %d)",
                          want_ordinal, count, count == 1 ? "" : "s", count - 1);
    for (int i = 0; i < count; i++) {
        if (!by_uuid && i != want_ordinal)
            continue;
        struct cudaDeviceProp prop;
        cudaError_t e = cudaGetDeviceProperties(&prop, i);
        if (e != cudaSuccess)
            return status_set(st, ST_UNAVAILABLE, "cudaGetDeviceProperties(%d): %s (%s)", i,
                              cudaGetErrorName(e), cudaGetErrorString(e));
        if (by_uuid && memcmp(prop.uuid.bytes, want, sizeof want) != 0)
            continue;
        cuda_cfg.device = i;
        memcpy(cuda_cfg.uuid, prop.uuid.bytes, sizeof cuda_cfg.uuid);
        kvstash_gpu_uuid_format(cuda_cfg.uuid, cuda_cfg.uuid_text);
        snprintf(cuda_cfg.name, sizeof cuda_cfg.name, "%.95s", prop.name); /* a 256-byte field */
        log_info("cuda_device", "device=%d uuid=%s name=\"%s\" memory_mib=%zu ipc=%s", i,
                 cuda_cfg.uuid_text, prop.name, prop.totalGlobalMem >> 20,
                 cuda_cfg.ipc == KV_DEVMEM_NONE ? "auto" : kv_devmem_kind_name(cuda_cfg.ipc));
        return ST_OK;
    }
    return status_set(st, ST_INVALID_ARGUMENT,
                      "--cuda-device %s: no CUDA device of this host has that UUID "
                      "(nvidia-smi -L lists them; CUDA_VISIBLE_DEVICES may hide it)",
                      spec);
}

static status_code cuda_start(const backend_options *o, status *st)
{
    char why[256];
    if (!kv_devmem_probe(why, sizeof why))
        return status_set(st, ST_UNAVAILABLE, "--backend cuda: no usable CUDA device: %s", why);
    char err[256];
    if (backend_cuda_ipc_check(o->cuda_ipc, err, sizeof err) != 0 ||
        backend_cuda_device_check(o->cuda_device, err, sizeof err) != 0)
        return status_set(st, ST_INVALID_ARGUMENT, "%s", err);
    cuda_cfg.ipc = strcmp(o->cuda_ipc, "vmm") == 0      ? KV_DEVMEM_VMM
                   : strcmp(o->cuda_ipc, "legacy") == 0 ? KV_DEVMEM_LEGACY
                                                        : KV_DEVMEM_NONE;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return status_set(st, ST_UNAVAILABLE, "cudaGetDeviceCount: %s (%s)", cudaGetErrorName(e),
                          cudaGetErrorString(e));
    if (find_device(o->cuda_device, count, st) != ST_OK)
        return st->code;
    kv_ops_cuda_set_device(cuda_cfg.device);
    return ST_OK;
}

static status_code devmem_status(int rc, const char *err, status *st)
{
    return status_set(st, rc == KV_DEVMEM_ECUDA ? ST_RESOURCE_EXHAUSTED : ST_INTERNAL,
                      "cannot allocate the pool's device memory: %s", err);
}

static status_code cuda_arena_create(const char *model, size_t bytes, backend_arena *a, status *st)
{
    *a = (backend_arena){NULL, bytes, -1, NULL};
    if (cuda_cfg.device < 0)
        return status_set(st, ST_INTERNAL, "the cuda backend was not started");
    kv_devmem_arena *mem = calloc(1, sizeof *mem);
    if (mem == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    char err[512];
    kv_devmem_kind kind = cuda_cfg.ipc == KV_DEVMEM_NONE ? KV_DEVMEM_VMM : cuda_cfg.ipc;
    int rc = kv_devmem_alloc(kind, cuda_cfg.device, bytes, mem, err, sizeof err);
    if (rc == KV_DEVMEM_ENOTSUP && cuda_cfg.ipc == KV_DEVMEM_NONE) {
        log_info("cuda_ipc_fallback", "model=%s from=vmm to=legacy why=\"%s\"", model, err);
        kind = KV_DEVMEM_LEGACY;
        rc = kv_devmem_alloc(kind, cuda_cfg.device, bytes, mem, err, sizeof err);
    } else if (rc == KV_DEVMEM_ENOTSUP) {
        free(mem);
        return status_set(st, ST_FAILED_PRECONDITION,
                          "--cuda-ipc vmm: device %d cannot export VMM memory as a POSIX fd "
                          "(%s); start kvstashd with --cuda-ipc auto or legacy",
                          cuda_cfg.device, err);
    }
    if (rc != 0) {
        free(mem);
        return devmem_status(rc, err, st);
    }
    /* Zeroed like a fresh memfd, so that no pool starts with another's bytes. */
    if (kv_ops_cuda.fill(mem->ptr, 0, mem->bytes) != 0) {
        status_set(st, ST_INTERNAL, "cannot clear the pool's device memory: %s",
                   kv_ops_cuda_last_error());
        kv_devmem_release(mem, NULL, 0);
        free(mem);
        return st->code;
    }
    a->base = mem->ptr;
    a->priv = mem;
    cuda_cfg.resolved = kind; /* under the store's lock, as describe runs */
    log_info("cuda_arena", "model=%s bytes=%zu arena_bytes=%zu device=%d uuid=%s ipc=%s", model,
             bytes, mem->bytes, cuda_cfg.device, cuda_cfg.uuid_text, kv_devmem_kind_name(kind));
    return ST_OK;
}

/* The caller (pool_destroy) runs when no session holds the pool. */
static void cuda_arena_destroy(backend_arena *a)
{
    kv_devmem_arena *mem = a->priv;
    if (mem != NULL) {
        char err[512];
        if (kv_devmem_release(mem, err, sizeof err) != 0)
            log_warn("cuda_arena_release_failed", "err=\"%s\"", err);
        free(mem);
    }
    *a = (backend_arena){NULL, 0, -1, NULL};
}

static status_code cuda_arena_share(const backend_arena *a, backend_share *sh, status *st)
{
    memset(sh, 0, sizeof *sh);
    sh->fd = -1;
    const kv_devmem_arena *mem = a->priv;
    if (mem == NULL)
        return status_set(st, ST_INTERNAL, "the pool has no device arena");
    kv_devmem_desc d;
    char err[512];
    if (kv_devmem_export(mem, &d, err, sizeof err) != 0)
        return status_set(st, ST_INTERNAL, "cannot export the pool's device memory: %s", err);
    sh->map.bytes = d.bytes;
    memcpy(sh->map.gpu_uuid, cuda_cfg.uuid, sizeof sh->map.gpu_uuid);
    if (d.kind == KV_DEVMEM_VMM) {
        sh->map.kind = KVSTASH_MAP_CUDA_VMM;
        sh->fd = d.fd;
    } else {
        sh->map.kind = KVSTASH_MAP_CUDA_LEGACY;
        memcpy(sh->map.legacy_handle, d.legacy_handle, sizeof sh->map.legacy_handle);
    }
    return ST_OK;
}

static void cuda_describe(backend_info *out)
{
    const char *opt = cuda_cfg.ipc == KV_DEVMEM_NONE ? "auto" : kv_devmem_kind_name(cuda_cfg.ipc);
    backend_cuda_info(
        cuda_cfg.uuid_text, cuda_cfg.name, opt,
        cuda_cfg.resolved == KV_DEVMEM_NONE ? NULL : kv_devmem_kind_name(cuda_cfg.resolved), out);
}

const backend backend_cuda = {
    .name = "cuda",
    .ops = &kv_ops_cuda,
    .start = cuda_start,
    .arena_create = cuda_arena_create,
    .arena_destroy = cuda_arena_destroy,
    .arena_share = cuda_arena_share,
    .describe = cuda_describe,
};
