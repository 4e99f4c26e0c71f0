/*
 * devmem.h - one arena of CUDA device memory, exported to and imported by
 * other processes (DESIGN.md "Memory", C-STACK.md "CUDA").
 *
 * The daemon's CUDA backend keeps its pool in one arena and lends it to
 * worker processes. Two kinds:
 *
 *   KV_DEVMEM_LEGACY  cudaMalloc + cudaIpcGetMemHandle: a 64-byte handle that
 *                     anyone who holds it can open; one fixed allocation.
 *   KV_DEVMEM_VMM     cuMemCreate (POSIX fd handle type) mapped into a
 *                     reserved VA range: exported as a file descriptor that
 *                     is passed with SCM_RIGHTS, so only the processes the
 *                     daemon chose (peer checked) can open it.
 *
 * The binary links only cudart. The driver entry points (cuMem*) are looked
 * up at run time with cudaGetDriverEntryPointByVersion, so a host without a
 * GPU or driver runs the same binary: kv_devmem_probe() says why there is no
 * device, and the caller then calls nothing else here (argument checks
 * aside, every other function would fail with KV_DEVMEM_ECUDA).
 *
 * Every function that can fail returns 0 or a negative KV_DEVMEM_E* code and
 * writes a message for an operator into err[0..errlen) (naming the CUDA call,
 * its arguments and CUDA's error name and text); err may be NULL. Functions
 * select the arena's device for the call and restore the caller's current
 * device before returning. Not thread-safe on one arena; distinct arenas may
 * be used from distinct threads.
 *
 * Available when the build has CUDA (KVSTASH_HAVE_CUDA); the header itself
 * needs no CUDA header.
 */
#ifndef KVSTASH_DEVMEM_H
#define KVSTASH_DEVMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error codes (0 = ok). */
#define KV_DEVMEM_EINVAL                                                                           \
    -1                       /* a bad argument or descriptor; no CUDA call made, or a check failed \
                              */
#define KV_DEVMEM_ENOTSUP -2 /* the device cannot do this kind (no VMM, no POSIX fd export) */
#define KV_DEVMEM_ECUDA -3   /* a CUDA call failed (no device, no driver, out of memory, ...) */

/* Bytes of a legacy cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE). */
#define KV_DEVMEM_IPC_HANDLE_BYTES 64

typedef enum kv_devmem_kind {
    KV_DEVMEM_NONE = 0, /* a zeroed arena: nothing held */
    KV_DEVMEM_LEGACY = 1,
    KV_DEVMEM_VMM = 2,
} kv_devmem_kind;

/*
 * An arena: the memory this process allocated, or a mapping of another
 * process's export. Plain data owned by the caller (on the stack or in a
 * larger struct); kv_devmem_release() undoes it. Read ptr, bytes and device;
 * the rest is bookkeeping for release.
 */
typedef struct kv_devmem_arena {
    kv_devmem_kind kind;
    int imported; /* 1: a mapping of another process's export */
    int device;   /* CUDA device ordinal in this process */
    void *ptr;    /* device address of byte 0 (NULL until complete) */
    size_t bytes; /* usable bytes; VMM: the request rounded up to granularity */
    /* VMM only */
    unsigned long long handle; /* CUmemGenericAllocationHandle (0 = none) */
    uint64_t va;               /* reserved VA range start (CUdeviceptr, 0 = none) */
    size_t va_bytes;           /* reserved range size (= bytes) */
    int mapped;                /* 1: handle mapped at va */
    size_t granularity;        /* CU_MEM_ALLOC_GRANULARITY_MINIMUM of the device */
} kv_devmem_arena;

/*
 * What one process hands another to import an arena. Everything but fd is
 * plain bytes to copy into a message; fd (VMM) travels as SCM_RIGHTS
 * ancillary data on a Unix socket, and the number itself means nothing in
 * the other process.
 */
typedef struct kv_devmem_desc {
    kv_devmem_kind kind;
    size_t bytes;                                      /* arena bytes to map */
    uint8_t legacy_handle[KV_DEVMEM_IPC_HANDLE_BYTES]; /* LEGACY: cudaIpcMemHandle_t */
    int fd;                                            /* VMM: POSIX fd; -1 otherwise */
} kv_devmem_desc;

/*
 * kv_devmem_probe: 1 when cudaGetDeviceCount finds at least one device (why
 * gets "N device(s)"), else 0 with the reason in why: the cudaGetDeviceCount
 * error text (no driver, no device node, driver too old) or "found 0
 * devices". The first CUDA call a process makes; touches no device. why may
 * be NULL.
 */
int kv_devmem_probe(char *why, size_t len);

/*
 * kv_devmem_alloc: allocate an arena of at least `bytes` on device `device`
 * into *a (overwritten; it should not hold an arena). LEGACY: cudaMalloc of
 * exactly bytes. VMM: checks that the device supports VMM and POSIX fd
 * export, rounds bytes up to the allocation granularity, then cuMemCreate,
 * cuMemAddressReserve, cuMemMap and cuMemSetAccess (read/write for the
 * device). The contents are undefined. On failure *a is zeroed and whatever
 * was done is undone. The caller owns the arena: kv_devmem_release().
 * Errors: EINVAL (bytes 0, bad kind, device < 0, size overflow), ENOTSUP,
 * ECUDA.
 */
int kv_devmem_alloc(kv_devmem_kind kind, int device, size_t bytes, kv_devmem_arena *a, char *err,
                    size_t errlen);

/*
 * kv_devmem_export: describe an arena this process allocated so another
 * process can import it. LEGACY: cudaIpcGetMemHandle (the handle opens the
 * whole allocation; send offsets, never pointers). VMM:
 * cuMemExportToShareableHandle to a new POSIX fd, which the caller owns and
 * must close (after sending it; the importer gets its own copy with
 * SCM_RIGHTS). Each call gives a new fd. Errors: EINVAL (no arena, or an
 * imported one), ECUDA. On error d->fd is -1.
 */
int kv_devmem_export(const kv_devmem_arena *a, kv_devmem_desc *d, char *err, size_t errlen);

/*
 * kv_devmem_import: map another process's export on device `device` (this
 * process's ordinal of the same GPU) into *a (overwritten). LEGACY:
 * cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess, then a check
 * (cuMemGetAddressRange) that the allocation holds d->bytes; the handle must
 * come from another process. VMM: cuMemImportFromShareableHandle of d->fd,
 * cuMemAddressReserve, cuMemMap, cuMemSetAccess; d->bytes must be a multiple
 * of the granularity. The fd stays the caller's: close it whenever import
 * returns (the imported allocation holds its own reference). The mapping
 * lives until kv_devmem_release(), even after the exporter releases its
 * arena or exits; a process that dies releases its mappings with it. On
 * failure *a is zeroed. Errors: EINVAL (bad kind, bytes 0, fd not open,
 * bytes not a multiple of the granularity, allocation smaller than bytes),
 * ENOTSUP, ECUDA.
 */
int kv_devmem_import(const kv_devmem_desc *d, int device, kv_devmem_arena *a, char *err,
                     size_t errlen);

/*
 * kv_devmem_release: undo kv_devmem_alloc or kv_devmem_import, then zero *a.
 * LEGACY: cudaFree (allocated) or cudaIpcCloseMemHandle (imported). VMM:
 * cuMemUnmap, cuMemAddressFree, cuMemRelease, each only if done. Safe on a
 * zeroed arena (returns 0, no CUDA call) and so safe to call twice. Every
 * step is tried; the first error is returned (ECUDA) and *a is zeroed anyway:
 * nothing more can be done with it. The caller must make sure no kernel or
 * copy still uses the memory (synchronise first), and an owner releases a
 * legacy arena only after every importer closed it (CUDA: cudaFree before
 * the importers' cudaIpcCloseMemHandle is undefined behaviour).
 */
int kv_devmem_release(kv_devmem_arena *a, char *err, size_t errlen);

/* A short name for an error code ("invalid argument", ...). */
const char *kv_devmem_strerror(int code);

/* "legacy", "vmm" or "none". */
const char *kv_devmem_kind_name(kv_devmem_kind kind);

#ifdef __cplusplus
}
#endif

#endif /* KVSTASH_DEVMEM_H */
