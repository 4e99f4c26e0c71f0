/*
 * diff.cu - kv_elts_diff_cuda, the CUDA twin of kv_elts_diff (kernels.h):
 * what a tier move cost, for the daemon's metrics, without copying the
 * tokens to the host.
 *
 * One warp per chunk of 512 elements (the CPU's chunk): lane j reads
 * elements j, j + 32, ... (coalesced), keeps the max of |got - ref| and of
 * |ref| and the fp32 sums of their squares, and the warp reduces them
 * (max exactly; the sums in double). Each chunk writes four doubles to
 * scratch; the host adds the chunks in order. Only those 32 bytes per 512
 * elements cross to the host. The sums are within rounding of the CPU's,
 * not bit for bit (another summation order), which is all kv_elts_diff
 * promises (kernels.h).
 */
#include <math.h>

#include "common.cuh"

using namespace kvcuda;

namespace
{

constexpr unsigned kChunk = 512;
constexpr unsigned kWarpsPerBlock = 4;

struct chunk_sums {
    double max_diff, max_ref, sq_diff, sq_ref;
};

__global__ void diff_kernel(const uint8_t *got, const uint8_t *ref, int t, unsigned elt,
                            unsigned long long n, unsigned long long nchunks, chunk_sums *out)
{
    const unsigned lane = threadIdx.x & 31u;
    const unsigned long long c =
        (unsigned long long)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32u;
    if (c >= nchunks)
        return;
    const unsigned long long first = c * kChunk;
    const unsigned long long end = first + kChunk < n ? first + kChunk : n;
    float max_diff = 0, max_ref = 0, sq_diff = 0, sq_ref = 0;
    for (unsigned long long i = first + lane; i < end; i += 32) {
        float x = load_elt(ref + i * elt, t), y = load_elt(got + i * elt, t);
        float e = fabsf(__fsub_rn(y, x)), a = fabsf(x);
        max_diff = e > max_diff ? e : max_diff;
        max_ref = a > max_ref ? a : max_ref;
        sq_diff = __fadd_rn(sq_diff, __fmul_rn(e, e));
        sq_ref = __fadd_rn(sq_ref, __fmul_rn(a, a));
    }
    double sd = sq_diff, sr = sq_ref;
    for (int off = 16; off > 0; off >>= 1) {
        max_diff = fmaxf(max_diff, __shfl_down_sync(0xffffffffu, max_diff, off));
        max_ref = fmaxf(max_ref, __shfl_down_sync(0xffffffffu, max_ref, off));
        sd = __dadd_rn(sd, __shfl_down_sync(0xffffffffu, sd, off));
        sr = __dadd_rn(sr, __shfl_down_sync(0xffffffffu, sr, off));
    }
    if (lane == 0)
        out[c] = chunk_sums{max_diff, max_ref, sd, sr};
}

} // namespace

extern "C" int kv_elts_diff_cuda(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n,
                                 kv_diff *d)
{
    if (t != KV_FP16 && t != KV_BF16 && t != KV_FP32)
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    const unsigned long long nchunks = (n + kChunk - 1) / kChunk;
    const unsigned long long nblocks = (nchunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (nblocks > 0x7fffffffull)
        return cudaErrorInvalidValue;
    chunk_sums *host = static_cast<chunk_sums *>(malloc(nchunks * sizeof(chunk_sums)));
    if (host == nullptr)
        return cudaErrorMemoryAllocation;
    scratch s;
    chunk_sums *dev = static_cast<chunk_sums *>(s.put(nullptr, nchunks * sizeof(chunk_sums)));
    if (dev != nullptr) {
        diff_kernel<<<(unsigned)nblocks, kWarpsPerBlock * 32>>>(
            got, ref, (int)t, t == KV_FP32 ? 4u : 2u, (unsigned long long)n, nchunks, dev);
        if (s.err == cudaSuccess)
            s.err = cudaGetLastError();
        if (s.err == cudaSuccess)
            s.err =
                cudaMemcpyAsync(host, dev, nchunks * sizeof(chunk_sums), cudaMemcpyDeviceToHost, 0);
    }
    int err = s.finish();
    if (err == cudaSuccess)
        for (unsigned long long c = 0; c < nchunks; c++) {
            d->max_diff = host[c].max_diff > d->max_diff ? host[c].max_diff : d->max_diff;
            d->max_ref = host[c].max_ref > d->max_ref ? host[c].max_ref : d->max_ref;
            d->sq_diff += host[c].sq_diff;
            d->sq_ref += host[c].sq_ref;
        }
    free(host);
    return err;
}
