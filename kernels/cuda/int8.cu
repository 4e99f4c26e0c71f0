/*
 * int8.cu - CUDA twins of the INT8 tier kernels (kernels/cpu/int8.c).
 *
 * Quantise: one thread block per (INT8 block, kv head, K/V), threads over
 * channels; each thread takes its channel's max over the block's tokens,
 * then writes the scale and the codes. Reads and writes of a token row are
 * coalesced across the threads. x / s and max / 127 are IEEE divisions
 * (__fdiv_rn) and rintf rounds half to even, so codes and scales equal the
 * CPU's. Dequantise: one thread block per (token, kv head, K/V); code * s is
 * one rounding (__fmul_rn), stored with elt.h's conversions.
 */
#include "common.cuh"

using namespace kvcuda;

namespace
{

struct qgeom {
    unsigned long long block_bytes; /* kv_int8_block_bytes */
    unsigned long long codes;       /* H*T*d: bytes of K (or V) codes */
    unsigned long long scales;      /* offset of the K scales */
};

qgeom make_qgeom(const kv_layout *l)
{
    qgeom q;
    q.block_bytes = kv_int8_block_bytes(l);
    q.codes = (unsigned long long)l->kv_heads * l->block_tokens * l->head_dim;
    q.scales = kv_int8_scale_offset(l, 0, 0, 0);
    return q;
}

__device__ __forceinline__ unsigned long long code_offset(const geom &g, const qgeom &q,
                                                          unsigned block, unsigned kv,
                                                          unsigned head, unsigned slot)
{
    return block * q.block_bytes + kv * q.codes +
           ((unsigned long long)head * g.tokens + slot) * g.dim;
}

__device__ __forceinline__ unsigned long long
scale_offset(const geom &g, const qgeom &q, unsigned block, unsigned kv, unsigned head)
{
    return block * q.block_bytes + q.scales + ((unsigned long long)kv * g.heads + head) * g.dim * 4;
}

__global__ void quantize_kernel(geom g, qgeom q, int t, const uint8_t *pool, const token *tok,
                                unsigned long long ntok, const uint32_t *qblocks, uint8_t *qpool)
{
    const unsigned b = blockIdx.x, head = blockIdx.y, kv = blockIdx.z;
    const unsigned long long first = (unsigned long long)b * g.tokens;
    const unsigned m = ntok > first ? (unsigned)min((unsigned long long)g.tokens, ntok - first) : 0;
    const unsigned qb = qblocks[b];
    for (unsigned c = threadIdx.x; c < g.dim; c += blockDim.x) {
        float amax = 0;
        for (unsigned i = 0; i < m; i++) {
            const token tk = tok[first + i];
            float x = load_elt(pool + row_offset(g, tk.block, kv, head, tk.slot) + c * g.elt, t);
            float a = fabsf(x);
            amax = a > amax ? a : amax;
        }
        /* POLICIES.md §5.4: an all-zero group gets scale 1. */
        const float s0 = __fdiv_rn(amax, 127.0f); /* §5.4: a scale of 0 becomes 1 */
        const float s = s0 > 0 ? s0 : 1.0f;
        *reinterpret_cast<float *>(qpool + scale_offset(g, q, qb, kv, head) + 4ull * c) = s;
        for (unsigned i = 0; i < g.tokens; i++) {
            int8_t code = 0;
            if (i < m) {
                const token tk = tok[first + i];
                float x =
                    load_elt(pool + row_offset(g, tk.block, kv, head, tk.slot) + c * g.elt, t);
                float r = rintf(__fdiv_rn(x, s));
                r = r > 127 ? 127 : r;
                r = r < -127 ? -127 : r;
                code = (int8_t)(int)r;
            }
            qpool[code_offset(g, q, qb, kv, head, i) + c] = (uint8_t)code;
        }
    }
    if (head == 0 && kv == 0) { /* the padding bytes */
        uint8_t *base = qpool + (unsigned long long)qb * q.block_bytes;
        unsigned long long scales_end = q.scales + 8ull * g.heads * g.dim;
        for (unsigned long long i = 2 * q.codes + threadIdx.x; i < q.scales; i += blockDim.x)
            base[i] = 0;
        for (unsigned long long i = scales_end + threadIdx.x; i < q.block_bytes; i += blockDim.x)
            base[i] = 0;
    }
}

__global__ void dequantize_kernel(geom g, qgeom q, geom dg, int t, const uint8_t *qpool,
                                  const token *src, const token *dst, uint8_t *pool)
{
    const token s = src[blockIdx.x], d = dst[blockIdx.x];
    const unsigned head = blockIdx.y, kv = blockIdx.z;
    const int8_t *codes =
        reinterpret_cast<const int8_t *>(qpool + code_offset(g, q, s.block, kv, head, s.slot));
    const float *scales =
        reinterpret_cast<const float *>(qpool + scale_offset(g, q, s.block, kv, head));
    uint8_t *out = pool + row_offset(dg, d.block, kv, head, d.slot);
    for (unsigned c = threadIdx.x; c < g.dim; c += blockDim.x)
        store_elt(out + c * dg.elt, t, __fmul_rn((float)codes[c], scales[c]));
}

} // namespace

extern "C" int kv_int8_quantize_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                     const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                                     const uint32_t *qblocks, size_t nq)
{
    size_t ntok = kv_segments_tokens(segs, nsegs);
    if (nq == 0 || l->kv_heads == 0 || l->head_dim == 0)
        return cudaSuccess;
    if (ntok > nq * (size_t)l->block_tokens || nq > 0x7fffffffu || l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    token *tok = expand(segs, nsegs, ntok);
    if (tok == nullptr)
        return cudaErrorMemoryAllocation;
    scratch sc;
    const token *d_tok = static_cast<const token *>(sc.put(tok, ntok * sizeof(token)));
    const uint32_t *d_qb = static_cast<const uint32_t *>(sc.put(qblocks, nq * sizeof(uint32_t)));
    if (sc.err == cudaSuccess) {
        dim3 grid((unsigned)nq, l->kv_heads, 2);
        quantize_kernel<<<grid, kThreads>>>(make_geom(l), make_qgeom(l), t, pool, d_tok, ntok, d_qb,
                                            qpool);
    }
    int err = sc.finish();
    free(tok);
    return err;
}

extern "C" int kv_int8_dequantize_cuda(const kv_layout *l, const uint8_t *qpool,
                                       const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                       const kv_layout *dl,
                                       uint8_t *pool, const kv_segment *dst, size_t ndst)
{
    size_t a = kv_segments_tokens(qsegs, nqsegs), b = kv_segments_tokens(dst, ndst);
    size_t n = a < b ? a : b;
    if (n == 0 || l->kv_heads == 0 || l->head_dim == 0)
        return cudaSuccess;
    if (n > 0x7fffffffu || l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    return with_token_pairs(qsegs, nqsegs, dst, ndst, n, [&](const token *s, const token *d) {
        dim3 grid((unsigned)n, l->kv_heads, 2);
        dequantize_kernel<<<grid, kThreads>>>(make_geom(l), make_qgeom(l), make_geom(dl), t, qpool, s,
                                                d, pool);
    });
}
