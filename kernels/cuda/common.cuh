/*
 * common.cuh - host and device helpers shared by the CUDA tier kernels
 * (internal to kernels/cuda).
 *
 * The host side turns segment lists into per-token tables, uploads them into
 * stream-ordered scratch and frees it after the launch; every exported
 * function synchronises stream 0 before it returns (kernels.h). The device
 * side reads and writes pool elements with kernels/elt.h, the very
 * conversions the CPU kernels use, and does its fp32 arithmetic with the
 * _rn intrinsics so that nvcc never contracts a*b + c into an FMA: the
 * results then equal the CPU kernels bit for bit.
 */
#ifndef KVSTASH_KERNELS_CUDA_COMMON_CUH
#define KVSTASH_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>

#include <atomic>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../elt.h"
#include "kernels.h"

namespace kvcuda
{

/* ---- device: pool addressing and elements ---- */

/* The geometry a kernel needs, by value. */
struct geom {
    unsigned long long block_bytes; /* kv_block_bytes */
    unsigned long long row;         /* head_dim * elt_size */
    unsigned heads, tokens, dim, elt;
};

inline geom make_geom(const kv_layout *l)
{
    geom g;
    g.block_bytes = kv_block_bytes(l);
    g.row = (unsigned long long)l->head_dim * l->elt_size;
    g.heads = l->kv_heads;
    g.tokens = l->block_tokens;
    g.dim = l->head_dim;
    g.elt = l->elt_size;
    return g;
}

/* Byte offset of the K (kv = 0) or V (kv = 1) row of (block, head, slot). */
__device__ __forceinline__ unsigned long long row_offset(const geom &g, unsigned block, unsigned kv,
                                                         unsigned head, unsigned slot)
{
    return block * g.block_bytes + kv * (g.block_bytes / 2) +
           ((unsigned long long)head * g.tokens + slot) * g.row;
}

__device__ __forceinline__ float load_elt(const uint8_t *p, int t)
{
    if (t == KV_FP32)
        return *reinterpret_cast<const float *>(p);
    uint16_t h = *reinterpret_cast<const uint16_t *>(p);
    return t == KV_FP16 ? kv_half_to_float(h) : kv_bf16_to_float(h);
}

__device__ __forceinline__ void store_elt(uint8_t *p, int t, float v)
{
    if (t == KV_FP32)
        *reinterpret_cast<float *>(p) = v;
    else
        *reinterpret_cast<uint16_t *>(p) = t == KV_FP16 ? kv_float_to_half(v) : kv_float_to_bf16(v);
}

/* ---- host: scratch, uploads, token tables ---- */

/* The current device's default memory pool gives its memory back to the
 * driver at every synchronisation unless told to keep some (its release
 * threshold is 0): each call's scratch, freed before the call synchronises,
 * would then be mapped afresh the next time, which costs more than most
 * moves themselves. Keep up to 64 MiB; once per device (ordinals below 64). */
inline void scratch_pool_keep()
{
    static std::atomic<unsigned long long> kept{0};
    int dev;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return;
    }
    if (kept.load(std::memory_order_relaxed) >> dev & 1)
        return;
    cudaMemPool_t pool;
    uint64_t keep = 64ull << 20; /* the attribute is a cuuint64_t */
    if (cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
        (void)cudaGetLastError(); /* no pool: scratch_alloc falls back to cudaMalloc */
    kept.fetch_or(1ull << dev, std::memory_order_relaxed);
}

/* Stream-ordered device scratch where supported (no device-wide sync). */
inline cudaError_t scratch_alloc(void **p, size_t n, bool *async)
{
    scratch_pool_keep();
    *p = nullptr;
    if (n == 0)
        n = 1;
    cudaError_t err = cudaMallocAsync(p, n, 0);
    *async = err == cudaSuccess;
    if (err == cudaErrorNotSupported) {
        (void)cudaGetLastError(); /* clear it: the fallback is fine */
        err = cudaMalloc(p, n);
    }
    return err;
}

inline cudaError_t scratch_free(void *p, bool async)
{
    return async ? cudaFreeAsync(p, 0) : cudaFree(p);
}

/* A list of device scratch buffers freed together. */
struct scratch {
    void *p[8];
    bool async[8];
    int n = 0;
    cudaError_t err = cudaSuccess;

    /* Device copy of `bytes` of host data (or uninitialised when src is
     * NULL); NULL after an error, which sticks in `err`. */
    void *put(const void *src, size_t bytes)
    {
        if (err != cudaSuccess || n == 8) {
            if (err == cudaSuccess)
                err = cudaErrorMemoryAllocation;
            return nullptr;
        }
        void *d = nullptr;
        err = scratch_alloc(&d, bytes, &async[n]);
        if (err != cudaSuccess)
            return nullptr;
        p[n++] = d;
        if (src != nullptr && bytes > 0)
            err = cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, 0);
        return err == cudaSuccess ? d : nullptr;
    }

    /* Check the launch, free everything, synchronise; the first error. */
    int finish()
    {
        if (err == cudaSuccess)
            err = cudaGetLastError();
        for (int i = 0; i < n; i++) {
            cudaError_t e = scratch_free(p[i], async[i]);
            if (err == cudaSuccess)
                err = e;
        }
        n = 0;
        cudaError_t e = cudaStreamSynchronize(0);
        return err != cudaSuccess ? err : e;
    }
};

/* (block, slot) of every token of a list, in order (malloc'd; NULL when
 * out of memory and n > 0). */
struct token {
    unsigned block, slot;
};

inline token *expand(const kv_segment *segs, size_t nsegs, size_t n)
{
    token *t = static_cast<token *>(malloc((n ? n : 1) * sizeof(token)));
    if (t == nullptr)
        return nullptr;
    size_t k = 0;
    for (size_t s = 0; s < nsegs && k < n; s++)
        for (uint32_t i = 0; i < segs[s].count && k < n; i++)
            t[k++] = token{segs[s].block, segs[s].first_slot + i};
    return t;
}

constexpr unsigned kThreads = 128;

/* The i-th token of qsegs moved to the i-th of dst, n of them: both lists
 * expanded and uploaded, launch(d_src, d_dst) called, the scratch freed.
 * Returns 0 or the first CUDA error (out of memory included). */
template <class Launch>
int with_token_pairs(const kv_segment *qsegs, size_t nqsegs, const kv_segment *dst, size_t ndst,
                     size_t n, Launch launch)
{
    token *src = expand(qsegs, nqsegs, n), *dt = expand(dst, ndst, n);
    int err = cudaErrorMemoryAllocation;
    if (src != nullptr && dt != nullptr) {
        scratch sc;
        const token *d_src = static_cast<const token *>(sc.put(src, n * sizeof(token)));
        const token *d_dst = static_cast<const token *>(sc.put(dt, n * sizeof(token)));
        if (sc.err == cudaSuccess)
            launch(d_src, d_dst);
        err = sc.finish();
    }
    free(src);
    free(dt);
    return err;
}

inline unsigned blocks_for(size_t n, unsigned per)
{
    return (unsigned)((n + per - 1) / per);
}

} // namespace kvcuda

#endif
