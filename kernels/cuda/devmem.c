/*
 * devmem.c - CUDA device-memory arenas exported and imported across
 * processes (see devmem.h). Plain C: the runtime API from libcudart, the
 * driver's cuMem* entry points looked up at run time (never -lcuda; C-STACK.md
 * "CUDA").
 */
#include "devmem.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <cudaTypedefs.h> /* PFN_* typedefs; includes cuda.h */
#include <cuda_runtime_api.h>

/* The driver ABI version asked for: every symbol below exists unchanged
 * since 10.2 (their PFN typedefs are _v10020 or older), and a CUDA 13
 * runtime only runs on a driver that is at least this new. */
#define DRV_ABI_VERSION 12000

/* ---- messages ---- */

static void msg(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* A runtime call failed: name it and its error, clear the (non-sticky) last
 * error so the next call does not see it. */
static int rt_fail(char *err, size_t errlen, const char *call, cudaError_t e)
{
    msg(err, errlen, "%s: %s (%s)", call, cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError();
    return KV_DEVMEM_ECUDA;
}

/* ---- driver entry points ---- */

/* The driver functions this module uses, looked up per call (allocation and
 * import are rare; no global state). */
typedef struct drv {
    PFN_cuGetErrorName_v6000 get_error_name;
    PFN_cuGetErrorString_v6000 get_error_string;
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_attr;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemAddressReserve_v10020 reserve;
    PFN_cuMemAddressFree_v10020 address_free;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
    PFN_cuMemExportToShareableHandle_v10020 export_handle;
    PFN_cuMemImportFromShareableHandle_v10020 import_handle;
    PFN_cuMemGetAddressRange_v3020 address_range;
} drv;

static int drv_sym(const char *name, void **fn, char *err, size_t errlen)
{
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    *fn = NULL;
    cudaError_t e =
        cudaGetDriverEntryPointByVersion(name, fn, DRV_ABI_VERSION, cudaEnableDefault, &q);
    if (e != cudaSuccess) {
        char call[128];
        snprintf(call, sizeof call, "cudaGetDriverEntryPointByVersion(%s, %d)", name,
                 DRV_ABI_VERSION);
        return rt_fail(err, errlen, call, e);
    }
    if (q != cudaDriverEntryPointSuccess || !*fn) {
        msg(err, errlen, "cudaGetDriverEntryPointByVersion(%s, %d): %s", name, DRV_ABI_VERSION,
            q == cudaDriverEntryPointVersionNotSufficent ? "driver version not sufficient"
                                                         : "symbol not found in the driver");
        *fn = NULL;
        return KV_DEVMEM_ECUDA;
    }
    return 0;
}

/* Converts the looked-up object pointer to the typed function pointer (POSIX
 * guarantees the conversion, as for dlsym). */
#define DRV_LOAD(d, field, type, name)                                                             \
    do {                                                                                           \
        void *p_;                                                                                  \
        int rc_ = drv_sym(name, &p_, err, errlen);                                                 \
        if (rc_)                                                                                   \
            return rc_;                                                                            \
        (d)->field = (type)p_;                                                                     \
    } while (0)

/* The runtime must have initialised the driver (a current context) first:
 * callers run this after dev_enter(). */
static int drv_load(drv *d, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    DRV_LOAD(d, get_error_name, PFN_cuGetErrorName_v6000, "cuGetErrorName");
    DRV_LOAD(d, get_error_string, PFN_cuGetErrorString_v6000, "cuGetErrorString");
    DRV_LOAD(d, device_get, PFN_cuDeviceGet_v2000, "cuDeviceGet");
    DRV_LOAD(d, device_attr, PFN_cuDeviceGetAttribute_v2000, "cuDeviceGetAttribute");
    DRV_LOAD(d, granularity, PFN_cuMemGetAllocationGranularity_v10020,
             "cuMemGetAllocationGranularity");
    DRV_LOAD(d, create, PFN_cuMemCreate_v10020, "cuMemCreate");
    DRV_LOAD(d, release, PFN_cuMemRelease_v10020, "cuMemRelease");
    DRV_LOAD(d, reserve, PFN_cuMemAddressReserve_v10020, "cuMemAddressReserve");
    DRV_LOAD(d, address_free, PFN_cuMemAddressFree_v10020, "cuMemAddressFree");
    DRV_LOAD(d, map, PFN_cuMemMap_v10020, "cuMemMap");
    DRV_LOAD(d, unmap, PFN_cuMemUnmap_v10020, "cuMemUnmap");
    DRV_LOAD(d, set_access, PFN_cuMemSetAccess_v10020, "cuMemSetAccess");
    DRV_LOAD(d, export_handle, PFN_cuMemExportToShareableHandle_v10020,
             "cuMemExportToShareableHandle");
    DRV_LOAD(d, import_handle, PFN_cuMemImportFromShareableHandle_v10020,
             "cuMemImportFromShareableHandle");
    DRV_LOAD(d, address_range, PFN_cuMemGetAddressRange_v3020, "cuMemGetAddressRange");
    return 0;
}

/* A driver call failed: name it with CUDA's error name and text. */
static int drv_fail(const drv *d, char *err, size_t errlen, const char *call, CUresult r)
{
    const char *name = NULL, *text = NULL;
    if (d->get_error_name)
        d->get_error_name(r, &name);
    if (d->get_error_string)
        d->get_error_string(r, &text);
    if (name)
        msg(err, errlen, "%s: %s (%s)", call, name, text ? text : "no description");
    else
        msg(err, errlen, "%s: CUresult %d", call, (int)r);
    return KV_DEVMEM_ECUDA;
}

/* ---- the current device ---- */

/* Make `device` current (cudaSetDevice initialises its primary context, which
 * the driver entry points then use; cudaFree(0) makes sure on any runtime)
 * and remember the caller's device in *prev. */
static int dev_enter(int device, int *prev, char *err, size_t errlen)
{
    char call[64];
    *prev = -1;
    if (cudaGetDevice(prev) != cudaSuccess) {
        *prev = -1;
        (void)cudaGetLastError();
    }
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        snprintf(call, sizeof call, "cudaSetDevice(%d)", device);
        return rt_fail(err, errlen, call, e);
    }
    e = cudaFree(NULL);
    if (e != cudaSuccess) {
        snprintf(call, sizeof call, "cudaFree(NULL) on device %d", device);
        return rt_fail(err, errlen, call, e);
    }
    return 0;
}

static void dev_leave(int device, int prev)
{
    if (prev >= 0 && prev != device && cudaSetDevice(prev) != cudaSuccess)
        (void)cudaGetLastError();
}

/* ---- VMM ---- */

/* The allocation properties both sides use: pinned device memory on `cudev`
 * that can be exported as a POSIX fd. */
static void vmm_prop(CUmemAllocationProp *p, CUdevice cudev)
{
    memset(p, 0, sizeof *p);
    p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->location.id = (int)cudev;
}

/* Checks the device can do VMM with POSIX fds; fills the properties and the
 * granularity. */
static int vmm_setup(const drv *d, int device, CUmemAllocationProp *prop, size_t *gran, char *err,
                     size_t errlen)
{
    char call[128];
    CUdevice cudev;
    CUresult r = d->device_get(&cudev, device);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuDeviceGet(%d)", device);
        return drv_fail(d, err, errlen, call, r);
    }
    static const struct {
        CUdevice_attribute attr;
        const char *name;
    } need[] = {
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
         "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"},
        {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
         "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"},
    };
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        int v = 0;
        r = d->device_attr(&v, need[i].attr, cudev);
        if (r != CUDA_SUCCESS) {
            snprintf(call, sizeof call, "cuDeviceGetAttribute(%s, device %d)", need[i].name,
                     device);
            return drv_fail(d, err, errlen, call, r);
        }
        if (!v) {
            msg(err, errlen, "device %d: CU_DEVICE_ATTRIBUTE_%s is 0 (use the legacy kind)", device,
                need[i].name);
            return KV_DEVMEM_ENOTSUP;
        }
    }
    vmm_prop(prop, cudev);
    r = d->granularity(gran, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemGetAllocationGranularity(device %d, MINIMUM)", device);
        return drv_fail(d, err, errlen, call, r);
    }
    if (*gran == 0) {
        msg(err, errlen, "cuMemGetAllocationGranularity(device %d): granularity 0", device);
        return KV_DEVMEM_ECUDA;
    }
    return 0;
}

/* Reserve a VA range for a->handle, map it and give the device read/write
 * access. Records each step in *a so vmm_undo can take it back. */
static int vmm_map(const drv *d, kv_devmem_arena *a, const CUmemLocation *loc, char *err,
                   size_t errlen)
{
    char call[160];
    CUdeviceptr va = 0;
    CUresult r = d->reserve(&va, a->bytes, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemAddressReserve(%zu bytes)", a->bytes);
        return drv_fail(d, err, errlen, call, r);
    }
    a->va = (uint64_t)va;
    a->va_bytes = a->bytes;
    r = d->map(va, a->bytes, 0, (CUmemGenericAllocationHandle)a->handle, 0);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemMap(%zu bytes)", a->bytes);
        return drv_fail(d, err, errlen, call, r);
    }
    a->mapped = 1;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = *loc; /* the device that reads and writes: ours */
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d->set_access(va, a->bytes, &acc, 1);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemSetAccess(%zu bytes, device %d, READWRITE)", a->bytes,
                 a->device);
        return drv_fail(d, err, errlen, call, r);
    }
    a->ptr = (void *)(uintptr_t)va;
    return 0;
}

/* One undo step's result: the first failure is the one reported. */
static void undo_step(const drv *d, CUresult r, const char *call, size_t bytes, int *rc, char *err,
                      size_t errlen)
{
    if (r == CUDA_SUCCESS || *rc != 0)
        return;
    char what[128];
    snprintf(what, sizeof what, "%s(%zu bytes)", call, bytes);
    *rc = drv_fail(d, err, errlen, what, r);
}

/* Unmap, free the range, release the handle: whichever were done. Every step
 * is tried; returns the first error. */
static int vmm_undo(const drv *d, kv_devmem_arena *a, char *err, size_t errlen)
{
    int rc = 0;
    if (a->mapped)
        undo_step(d, d->unmap((CUdeviceptr)a->va, a->va_bytes), "cuMemUnmap", a->va_bytes, &rc, err,
                  errlen);
    if (a->va)
        undo_step(d, d->address_free((CUdeviceptr)a->va, a->va_bytes), "cuMemAddressFree",
                  a->va_bytes, &rc, err, errlen);
    if (a->handle)
        undo_step(d, d->release((CUmemGenericAllocationHandle)a->handle), "cuMemRelease", a->bytes,
                  &rc, err, errlen);
    a->mapped = 0;
    a->va = 0;
    a->handle = 0;
    return rc;
}

/* The start of both alloc and import: the driver, the device's support, the
 * properties and granularity. */
static int vmm_open(drv *d, int device, CUmemAllocationProp *prop, kv_devmem_arena *a, char *err,
                    size_t errlen)
{
    int rc = drv_load(d, err, errlen);
    return rc ? rc : vmm_setup(d, device, prop, &a->granularity, err, errlen);
}

/* The end of both: a->handle is set; map it, or undo everything. */
static int vmm_finish(const drv *d, const CUmemAllocationProp *prop, kv_devmem_arena *a, char *err,
                      size_t errlen)
{
    int rc = vmm_map(d, a, &prop->location, err, errlen);
    if (rc)
        (void)vmm_undo(d, a, NULL, 0); /* keep the first message */
    return rc;
}

static int vmm_alloc(int device, size_t bytes, kv_devmem_arena *a, char *err, size_t errlen)
{
    drv d;
    CUmemAllocationProp prop;
    char call[128];
    int rc = vmm_open(&d, device, &prop, a, err, errlen);
    if (rc)
        return rc;
    size_t g = a->granularity;
    if (bytes > SIZE_MAX - (g - 1)) {
        msg(err, errlen, "kv_devmem_alloc: %zu bytes overflow when rounded to %zu", bytes, g);
        return KV_DEVMEM_EINVAL;
    }
    a->bytes = (bytes + g - 1) / g * g;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.create(&h, a->bytes, &prop, 0);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemCreate(%zu bytes, device %d, POSIX fd)", a->bytes,
                 device);
        return drv_fail(&d, err, errlen, call, r);
    }
    a->handle = (unsigned long long)h;
    return vmm_finish(&d, &prop, a, err, errlen);
}

static int vmm_import(const kv_devmem_desc *desc, int device, kv_devmem_arena *a, char *err,
                      size_t errlen)
{
    drv d;
    CUmemAllocationProp prop;
    char call[128];
    int rc = vmm_open(&d, device, &prop, a, err, errlen);
    if (rc)
        return rc;
    if (desc->bytes % a->granularity != 0) {
        msg(err, errlen, "kv_devmem_import: %zu bytes is not a multiple of the granularity %zu",
            desc->bytes, a->granularity);
        return KV_DEVMEM_EINVAL;
    }
    a->bytes = desc->bytes;
    CUmemGenericAllocationHandle h = 0;
    /* For POSIX fds the handle is the fd's value cast to a pointer (as
     * cuMemImportFromShareableHandle expects), not a pointer to an int. */
    CUresult r =
        d.import_handle(&h, (void *)(uintptr_t)desc->fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
        snprintf(call, sizeof call, "cuMemImportFromShareableHandle(fd %d)", desc->fd);
        return drv_fail(&d, err, errlen, call, r);
    }
    a->handle = (unsigned long long)h;
    return vmm_finish(&d, &prop, a, err, errlen);
}

/* A new POSIX fd for a->handle in *fd (-1 on error). */
static int vmm_export(const kv_devmem_arena *a, int *fd, char *err, size_t errlen)
{
    drv d;
    *fd = -1;
    int rc = drv_load(&d, err, errlen);
    if (rc)
        return rc;
    /* For POSIX fds the shareable handle written is an int. */
    int out = -1;
    CUresult r = d.export_handle(&out, (CUmemGenericAllocationHandle)a->handle,
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS)
        return drv_fail(&d, err, errlen, "cuMemExportToShareableHandle(POSIX fd)", r);
    *fd = out;
    return 0;
}

/* ---- legacy ---- */

static int legacy_alloc(int device, size_t bytes, kv_devmem_arena *a, char *err, size_t errlen)
{
    char call[96];
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        snprintf(call, sizeof call, "cudaMalloc(%zu bytes, device %d)", bytes, device);
        return rt_fail(err, errlen, call, e);
    }
    a->ptr = p;
    a->bytes = bytes;
    return 0;
}

static int legacy_import(const kv_devmem_desc *desc, int device, kv_devmem_arena *a, char *err,
                         size_t errlen)
{
    char call[96];
    drv d;
    int rc = drv_load(&d, err, errlen);
    if (rc)
        return rc;
    cudaIpcMemHandle_t h;
    memcpy(&h, desc->legacy_handle, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        snprintf(call, sizeof call, "cudaIpcOpenMemHandle(device %d)", device);
        return rt_fail(err, errlen, call, e);
    }
    /* The handle carries no size: check the allocation behind it holds what
     * the exporter claims, so no one maps past its end. */
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = d.address_range(&base, &size, (CUdeviceptr)(uintptr_t)p);
    if (r != CUDA_SUCCESS) {
        rc = drv_fail(&d, err, errlen, "cuMemGetAddressRange(imported pointer)", r);
    } else if (size - ((uintptr_t)p - (uintptr_t)base) < desc->bytes) {
        msg(err, errlen,
            "kv_devmem_import: the allocation holds %zu bytes, the descriptor says %zu",
            size - (size_t)((uintptr_t)p - (uintptr_t)base), desc->bytes);
        rc = KV_DEVMEM_EINVAL;
    }
    if (rc) {
        if (cudaIpcCloseMemHandle(p) != cudaSuccess)
            (void)cudaGetLastError();
        return rc;
    }
    a->ptr = p;
    a->bytes = desc->bytes;
    return 0;
}

/* ---- public ---- */

int kv_devmem_probe(char *why, size_t len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        msg(why, len, "cudaGetDeviceCount: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (n <= 0) {
        msg(why, len, "cudaGetDeviceCount found 0 devices");
        return 0;
    }
    msg(why, len, "%d device%s", n, n == 1 ? "" : "s");
    return 1;
}

static int check_kind(kv_devmem_kind kind, const char *fn, char *err, size_t errlen)
{
    if (kind == KV_DEVMEM_LEGACY || kind == KV_DEVMEM_VMM)
        return 0;
    msg(err, errlen, "%s: unknown kind %d", fn, (int)kind);
    return KV_DEVMEM_EINVAL;
}

int kv_devmem_alloc(kv_devmem_kind kind, int device, size_t bytes, kv_devmem_arena *a, char *err,
                    size_t errlen)
{
    if (!a) {
        msg(err, errlen, "kv_devmem_alloc: no arena");
        return KV_DEVMEM_EINVAL;
    }
    memset(a, 0, sizeof *a);
    int rc = check_kind(kind, "kv_devmem_alloc", err, errlen);
    if (rc)
        return rc;
    if (bytes == 0 || device < 0) {
        msg(err, errlen, "kv_devmem_alloc: %s (bytes %zu, device %d)",
            bytes == 0 ? "zero bytes" : "negative device", bytes, device);
        return KV_DEVMEM_EINVAL;
    }
    int prev;
    rc = dev_enter(device, &prev, err, errlen);
    if (rc == 0) {
        a->kind = kind;
        a->device = device;
        rc = kind == KV_DEVMEM_LEGACY ? legacy_alloc(device, bytes, a, err, errlen)
                                      : vmm_alloc(device, bytes, a, err, errlen);
    }
    dev_leave(device, prev);
    if (rc)
        memset(a, 0, sizeof *a);
    return rc;
}

int kv_devmem_export(const kv_devmem_arena *a, kv_devmem_desc *d, char *err, size_t errlen)
{
    if (!d) {
        msg(err, errlen, "kv_devmem_export: no descriptor");
        return KV_DEVMEM_EINVAL;
    }
    memset(d, 0, sizeof *d);
    d->fd = -1;
    if (!a || !a->ptr || check_kind(a->kind, "kv_devmem_export", NULL, 0)) {
        msg(err, errlen, "kv_devmem_export: no arena");
        return KV_DEVMEM_EINVAL;
    }
    if (a->imported) {
        msg(err, errlen, "kv_devmem_export: the arena is an import; only its owner exports it");
        return KV_DEVMEM_EINVAL;
    }
    int prev;
    int rc = dev_enter(a->device, &prev, err, errlen);
    if (rc == 0 && a->kind == KV_DEVMEM_LEGACY) {
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, a->ptr);
        if (e != cudaSuccess) {
            rc = rt_fail(err, errlen, "cudaIpcGetMemHandle", e);
        } else {
            _Static_assert(sizeof h == KV_DEVMEM_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t size");
            memcpy(d->legacy_handle, &h, sizeof h);
        }
    } else if (rc == 0) {
        rc = vmm_export(a, &d->fd, err, errlen);
    }
    dev_leave(a->device, prev);
    if (rc == 0) {
        d->kind = a->kind;
        d->bytes = a->bytes;
    }
    return rc;
}

int kv_devmem_import(const kv_devmem_desc *d, int device, kv_devmem_arena *a, char *err,
                     size_t errlen)
{
    if (!a || !d) {
        msg(err, errlen, "kv_devmem_import: no %s", a ? "descriptor" : "arena");
        return KV_DEVMEM_EINVAL;
    }
    memset(a, 0, sizeof *a);
    int rc = check_kind(d->kind, "kv_devmem_import", err, errlen);
    if (rc)
        return rc;
    if (d->bytes == 0 || device < 0) {
        msg(err, errlen, "kv_devmem_import: %s (bytes %zu, device %d)",
            d->bytes == 0 ? "zero bytes" : "negative device", d->bytes, device);
        return KV_DEVMEM_EINVAL;
    }
    /* A closed fd is caught here with errno's words, before CUDA sees it. */
    if (d->kind == KV_DEVMEM_VMM && (d->fd < 0 || fcntl(d->fd, F_GETFD) < 0)) {
        msg(err, errlen, "kv_devmem_import: fd %d is not open (%s)", d->fd,
            d->fd < 0 ? "negative" : strerror(errno));
        return KV_DEVMEM_EINVAL;
    }
    int prev;
    rc = dev_enter(device, &prev, err, errlen);
    if (rc == 0) {
        a->kind = d->kind;
        a->device = device;
        a->imported = 1;
        rc = d->kind == KV_DEVMEM_LEGACY ? legacy_import(d, device, a, err, errlen)
                                         : vmm_import(d, device, a, err, errlen);
    }
    dev_leave(device, prev);
    if (rc)
        memset(a, 0, sizeof *a);
    return rc;
}

int kv_devmem_release(kv_devmem_arena *a, char *err, size_t errlen)
{
    if (!a)
        return 0;
    if (a->kind == KV_DEVMEM_NONE || (a->kind == KV_DEVMEM_LEGACY && !a->ptr) ||
        (a->kind == KV_DEVMEM_VMM && !a->handle && !a->va && !a->mapped)) {
        memset(a, 0, sizeof *a);
        return 0;
    }
    int prev;
    int rc = dev_enter(a->device, &prev, err, errlen);
    if (rc == 0 && a->kind == KV_DEVMEM_LEGACY) {
        cudaError_t e = a->imported ? cudaIpcCloseMemHandle(a->ptr) : cudaFree(a->ptr);
        if (e != cudaSuccess)
            rc = rt_fail(err, errlen, a->imported ? "cudaIpcCloseMemHandle" : "cudaFree", e);
    } else if (rc == 0 && a->kind == KV_DEVMEM_VMM) {
        drv d;
        rc = drv_load(&d, err, errlen);
        if (rc == 0)
            rc = vmm_undo(&d, a, err, errlen);
    }
    dev_leave(a->device, prev);
    memset(a, 0, sizeof *a);
    return rc;
}

const char *kv_devmem_strerror(int code)
{
    switch (code) {
    case 0:
        return "ok";
    case KV_DEVMEM_EINVAL:
        return "invalid argument";
    case KV_DEVMEM_ENOTSUP:
        return "not supported by the device";
    case KV_DEVMEM_ECUDA:
        return "CUDA call failed";
    default:
        return "unknown error";
    }
}

const char *kv_devmem_kind_name(kv_devmem_kind kind)
{
    switch (kind) {
    case KV_DEVMEM_LEGACY:
        return "legacy";
    case KV_DEVMEM_VMM:
        return "vmm";
    default:
        return "none";
    }
}
