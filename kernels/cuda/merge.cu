/*
 * merge.cu - CUDA twin of the batched value merge (kernels/cpu/
 * merge_list.c). Merges must apply in order (a merge may read what an
 * earlier one wrote), but each (head, channel) element only ever mixes with
 * the same element of another token: one thread per element walks the whole
 * list in order. The weights are normalised on the host exactly as merge.c
 * does, and a*x + b*y is rounded as the CPU rounds it (no FMA): equal bits.
 */
#include "common.cuh"

using namespace kvcuda;

namespace
{

struct dev_merge {
    unsigned from_block, from_slot, into_block, into_slot;
    float a, b;
};

__global__ void merge_kernel(geom g, int t, uint8_t *pool, const dev_merge *m, unsigned long long n)
{
    const unsigned head = blockIdx.y;
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= g.dim)
        return;
    for (unsigned long long i = 0; i < n; i++) {
        const dev_merge mm = m[i];
        const uint8_t *src = pool + row_offset(g, mm.from_block, 1, head, mm.from_slot) + c * g.elt;
        uint8_t *dst = pool + row_offset(g, mm.into_block, 1, head, mm.into_slot) + c * g.elt;
        float v = __fadd_rn(__fmul_rn(mm.a, load_elt(src, t)), __fmul_rn(mm.b, load_elt(dst, t)));
        store_elt(dst, t, v);
    }
}

} // namespace

extern "C" int kv_merge_values_cuda(const kv_layout *l, kv_dtype t, uint8_t *pool,
                                    const kv_merge *m, size_t n)
{
    if (n == 0 || l->kv_heads == 0 || l->head_dim == 0)
        return cudaSuccess;
    if (l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    dev_merge *dm = static_cast<dev_merge *>(malloc(n * sizeof(dev_merge)));
    if (dm == nullptr)
        return cudaErrorMemoryAllocation;
    for (size_t i = 0; i < n; i++) {
        float sum = m[i].w_from + m[i].w_into;
        /* POLICIES.md §4.2: both weights zero (underflow) -> the plain average. */
        float a = sum > 0 ? m[i].w_from / sum : 0.5f, b = sum > 0 ? m[i].w_into / sum : 0.5f;
        dm[i] = dev_merge{m[i].from_block, m[i].from_slot, m[i].into_block, m[i].into_slot, a, b};
    }
    scratch sc;
    const dev_merge *d_m = static_cast<const dev_merge *>(sc.put(dm, n * sizeof(dev_merge)));
    if (sc.err == cudaSuccess) {
        dim3 grid(blocks_for(l->head_dim, kThreads), l->kv_heads);
        merge_kernel<<<grid, kThreads>>>(make_geom(l), t, pool, d_m, n);
    }
    int err = sc.finish();
    free(dm);
    return err;
}
