/*
 * gather.cu - CUDA twins of kernels/cpu/gather.c.
 *
 * Every kernel reduces to the same job: copy a list of contiguous runs, each
 * once per (kv head, K or V). The host turns segments into runs (source and
 * destination offsets of head 0 of K, and a length), copies the list to the
 * device, and launches one thread block per (run, head, K/V): grid
 * (nruns, kv_heads, 2). Threads of a block stride over the run in the widest
 * chunk (16, 8, 4, 2 or 1 bytes) that divides the row size and the alignment
 * of every base pointer; all offsets are multiples of the row size, so every
 * chunk access is aligned. Runs are at most block_tokens rows, so one block
 * per run keeps the loop short and needs no search for a token's segment.
 */
#include <cuda_runtime.h>

#include <stdlib.h>

#include "common.cuh"
#include "kernels.h"

namespace
{
using kvcuda::scratch_alloc;
using kvcuda::scratch_free;

/* One contiguous run: byte offsets of its head-0 rows, and its length. */
struct run {
    unsigned long long src_off;
    unsigned long long dst_off;
    unsigned long long bytes;
};

/* Where the K and V data of one side (source or destination) live:
 * base[0] for K, base[1] for V, and the distance between consecutive heads. */
struct side {
    const uint8_t *base[2];
    size_t head_stride;
};

struct mut_side {
    uint8_t *base[2];
    size_t head_stride;
};

constexpr int kThreads = 256;

template <typename T> __global__ void copy_runs_kernel(const run *runs, side src, mut_side dst)
{
    const run r = runs[blockIdx.x];
    const unsigned kv = blockIdx.z;
    const size_t head = blockIdx.y;
    const T *s = reinterpret_cast<const T *>(src.base[kv] + r.src_off + head * src.head_stride);
    T *d = reinterpret_cast<T *>(dst.base[kv] + r.dst_off + head * dst.head_stride);
    const size_t n = r.bytes / sizeof(T);
    for (size_t i = threadIdx.x; i < n; i += blockDim.x)
        d[i] = s[i];
}

size_t row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

/* Widest power-of-two chunk, at most 16 bytes, dividing `row` and the
 * address of every base pointer. */
size_t chunk_bytes(size_t row, const side &src, const mut_side &dst)
{
    uintptr_t bits = row | 16;
    for (int kv = 0; kv < 2; kv++)
        bits |= (uintptr_t)src.base[kv] | (uintptr_t)dst.base[kv];
    return (size_t)(bits & (~bits + 1)); /* lowest set bit */
}

template <typename T>
void launch_t(const run *d_runs, size_t nruns, uint32_t heads, side s, mut_side d)
{
    dim3 grid((unsigned)nruns, heads, 2);
    copy_runs_kernel<T><<<grid, kThreads>>>(d_runs, s, d);
}

void launch(size_t chunk, const run *d_runs, size_t nruns, uint32_t heads, side s, mut_side d)
{
    switch (chunk) {
    case 16:
        launch_t<uint4>(d_runs, nruns, heads, s, d);
        break;
    case 8:
        launch_t<uint2>(d_runs, nruns, heads, s, d);
        break;
    case 4:
        launch_t<uint32_t>(d_runs, nruns, heads, s, d);
        break;
    case 2:
        launch_t<uint16_t>(d_runs, nruns, heads, s, d);
        break;
    default:
        launch_t<uint8_t>(d_runs, nruns, heads, s, d);
        break;
    }
}

/* Copy `runs` to the device, run them, synchronise, free the device copy.
 * The caller keeps and frees `runs`. */
int run_all(const kv_layout *l, const run *runs, size_t nruns, side s, mut_side d)
{
    if (nruns == 0 || l->kv_heads == 0 || row_bytes(l) == 0)
        return cudaSuccess;
    /* Grid limits: x < 2^31, y <= 65535. */
    if (nruns > 0x7fffffffu || l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    run *d_runs = nullptr;
    bool async = false;
    cudaError_t err =
        scratch_alloc(reinterpret_cast<void **>(&d_runs), nruns * sizeof(run), &async);
    if (err != cudaSuccess)
        return err;
    err = cudaMemcpyAsync(d_runs, runs, nruns * sizeof(run), cudaMemcpyHostToDevice, 0);
    if (err == cudaSuccess) {
        launch(chunk_bytes(row_bytes(l), s, d), d_runs, nruns, l->kv_heads, s, d);
        err = cudaGetLastError();
    }
    cudaError_t ferr = scratch_free(d_runs, async);
    cudaError_t serr = cudaStreamSynchronize(0);
    if (err != cudaSuccess)
        return err;
    return ferr != cudaSuccess ? ferr : serr;
}

/* One run per non-empty segment between the pool and a flat
 * [kv_heads][ntokens][head_dim] buffer. `pool_is_src` picks the direction.
 * Returns the number of runs written to `out` (room for nsegs). */
size_t segment_runs(const kv_layout *l, const kv_segment *segs, size_t nsegs, int pool_is_src,
                    run *out)
{
    size_t n = 0, t = 0;
    for (size_t i = 0; i < nsegs; t += segs[i].count, i++) {
        if (segs[i].count == 0)
            continue;
        unsigned long long po = kv_key_offset(l, segs[i].block, 0, segs[i].first_slot);
        unsigned long long fo = t * row_bytes(l);
        out[n].src_off = pool_is_src ? po : fo;
        out[n].dst_off = pool_is_src ? fo : po;
        out[n].bytes = (unsigned long long)segs[i].count * row_bytes(l);
        n++;
    }
    return n;
}

/* Pool-side K/V bases and head stride. */
side pool_side(const kv_layout *l, const uint8_t *pool)
{
    return side{{pool, pool + kv_block_bytes(l) / 2}, (size_t)l->block_tokens * row_bytes(l)};
}

mut_side pool_mut_side(const kv_layout *l, uint8_t *pool)
{
    return mut_side{{pool, pool + kv_block_bytes(l) / 2}, (size_t)l->block_tokens * row_bytes(l)};
}

/* Shared body of gather and scatter. */
int flat_move(const kv_layout *l, const kv_segment *segs, size_t nsegs, int pool_is_src, side s,
              mut_side d)
{
    if (nsegs == 0)
        return cudaSuccess;
    run *runs = static_cast<run *>(malloc(nsegs * sizeof(run)));
    if (!runs)
        return cudaErrorMemoryAllocation;
    size_t n = segment_runs(l, segs, nsegs, pool_is_src, runs);
    int err = run_all(l, runs, n, s, d);
    free(runs);
    return err;
}

/* Runs contiguous in both lists, for copy_tokens: at most nsrc + ndst.
 * Same walk as kv_copy_tokens in kernels/cpu/gather.c. */
size_t copy_runs_of(const kv_layout *l, const kv_segment *src, size_t nsrc, const kv_segment *dst,
                    size_t ndst, run *out)
{
    size_t i = 0, j = 0, n = 0;
    uint32_t ui = 0, uj = 0;
    while (i < nsrc && j < ndst) {
        if (ui == src[i].count) {
            i++, ui = 0;
            continue;
        }
        if (uj == dst[j].count) {
            j++, uj = 0;
            continue;
        }
        uint32_t left_s = src[i].count - ui, left_d = dst[j].count - uj;
        uint32_t c = left_s < left_d ? left_s : left_d;
        out[n].src_off = kv_key_offset(l, src[i].block, 0, src[i].first_slot + ui);
        out[n].dst_off = kv_key_offset(l, dst[j].block, 0, dst[j].first_slot + uj);
        out[n].bytes = (unsigned long long)c * row_bytes(l);
        n++;
        ui += c;
        uj += c;
    }
    return n;
}

} // namespace

extern "C" int kv_gather_cuda(const kv_layout *l, const uint8_t *pool, const kv_segment *segs,
                              size_t nsegs, uint8_t *k_out, uint8_t *v_out)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    mut_side d{{k_out, v_out}, ntokens * row_bytes(l)};
    return flat_move(l, segs, nsegs, 1, pool_side(l, pool), d);
}

extern "C" int kv_scatter_cuda(const kv_layout *l, uint8_t *pool, const kv_segment *segs,
                               size_t nsegs, const uint8_t *k_in, const uint8_t *v_in)
{
    size_t ntokens = kv_segments_tokens(segs, nsegs);
    side s{{k_in, v_in}, ntokens * row_bytes(l)};
    return flat_move(l, segs, nsegs, 0, s, pool_mut_side(l, pool));
}

extern "C" int kv_copy_tokens_cuda(const kv_layout *l, uint8_t *pool, const kv_segment *src,
                                   size_t nsrc, const kv_segment *dst, size_t ndst)
{
    if (nsrc == 0 || ndst == 0)
        return cudaSuccess;
    run *runs = static_cast<run *>(malloc((nsrc + ndst) * sizeof(run)));
    if (!runs)
        return cudaErrorMemoryAllocation;
    size_t n = copy_runs_of(l, src, nsrc, dst, ndst, runs);
    int err = run_all(l, runs, n, pool_side(l, pool), pool_mut_side(l, pool));
    free(runs);
    return err;
}
