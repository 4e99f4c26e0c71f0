/*
 * rope.cu - CUDA twin of the RoPE re-rotation (kernels/cpu/rope.c).
 *
 * cos and sin come from the host, computed with the CPU's double formula
 * once per run of equal deltas (a table row per run; a block of tokens
 * usually shares one delta), so the coefficients are the CPU's bits and the
 * rotation is the same fp32 expression: equal results. One thread block per
 * (token, kv head), threads over pairs.
 */
#include <math.h>

#include "common.cuh"

using namespace kvcuda;

namespace
{

__global__ void rope_kernel(geom g, int t, uint8_t *pool, const token *tok, const uint32_t *row_of,
                            const float *cs, int interleaved)
{
    const token tk = tok[blockIdx.x];
    const unsigned half = g.dim / 2;
    const float *c = cs + (unsigned long long)row_of[blockIdx.x] * 2 * half, *s = c + half;
    uint8_t *row = pool + row_offset(g, tk.block, 0, blockIdx.y, tk.slot);
    for (unsigned p = threadIdx.x; p < half; p += blockDim.x) {
        unsigned a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
        float x = load_elt(row + a * g.elt, t), y = load_elt(row + b * g.elt, t);
        float xo = __fsub_rn(__fmul_rn(x, c[p]), __fmul_rn(y, s[p]));
        float yo = __fadd_rn(__fmul_rn(x, s[p]), __fmul_rn(y, c[p]));
        store_elt(row + a * g.elt, t, xo);
        store_elt(row + b * g.elt, t, yo);
    }
}

} // namespace

extern "C" int kv_rope_rerotate_cuda(const kv_layout *l, kv_dtype t, uint8_t *pool,
                                     const kv_segment *segs, size_t nsegs, const int32_t *delta,
                                     double theta, kv_rope_pairing pairing)
{
    size_t n = kv_segments_tokens(segs, nsegs);
    uint32_t half = l->head_dim / 2;
    if (l->head_dim % 2 != 0 || n > 0x7fffffffu || l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    if (n == 0 || half == 0 || l->kv_heads == 0)
        return cudaSuccess;
    uint32_t *row_of = static_cast<uint32_t *>(malloc(n * sizeof(uint32_t)));
    token *tok = expand(segs, nsegs, n);
    size_t nrows = 0;
    for (size_t i = 0; row_of != nullptr && i < n; i++) {
        if (i == 0 || delta[i] != delta[i - 1])
            nrows++;
        row_of[i] = (uint32_t)(nrows - 1);
    }
    float *cs = static_cast<float *>(malloc((nrows ? nrows : 1) * 2 * half * sizeof(float)));
    int err = cudaErrorMemoryAllocation;
    if (row_of != nullptr && tok != nullptr && cs != nullptr) {
        for (size_t i = 0, r = 0; i < n; i++) {
            if (i > 0 && delta[i] == delta[i - 1])
                continue;
            float *c = cs + r++ * 2 * half, *s = c + half;
            for (uint32_t p = 0; p < half; p++) { /* kernels/cpu/rope.c coefficients() */
                double inv_freq = pow(theta, -(double)(2 * p) / (double)l->head_dim);
                double angle = (double)delta[i] * inv_freq;
                c[p] = (float)cos(angle);
                s[p] = (float)sin(angle);
            }
        }
        scratch sc;
        const token *d_tok = static_cast<const token *>(sc.put(tok, n * sizeof(token)));
        const uint32_t *d_row = static_cast<const uint32_t *>(sc.put(row_of, n * 4));
        const float *d_cs = static_cast<const float *>(sc.put(cs, nrows * 2 * half * 4));
        if (sc.err == cudaSuccess) {
            dim3 grid((unsigned)n, l->kv_heads);
            rope_kernel<<<grid, kThreads>>>(make_geom(l), t, pool, d_tok, d_row, d_cs,
                                            pairing == KV_ROPE_INTERLEAVED);
        }
        err = sc.finish();
    }
    free(row_of);
    free(tok);
    free(cs);
    return err;
}
