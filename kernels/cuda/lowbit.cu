/*
 * lowbit.cu - CUDA twins of the INT4 / INT2 tier kernels
 * (kernels/cpu/lowbit.c; kernels.h "Low-bit tiers").
 *
 * Quantise, in four launches: every destination block zeroed (unused
 * slots, bits and padding stay 0, as on the CPU); each block's shift
 * (kernels/lowbit.h: its largest |x|, a max over the block's threads, the
 * same max as the CPU's in any order); keys, one thread block
 * per (block, head, key group), a thread per byte of the code row: it
 * takes the range of its channels (8 / bits of them) over the group's
 * tokens, writes their parameters, then each token's byte of codes;
 * values, one thread block per (block, head, slot): threads take the
 * range of value groups into shared memory, then a thread per byte packs
 * the codes. Each output byte is written by one thread. The quantiser is
 * kernels/lowbit.h, the CPU's own (rintf for its rne, __fmul_rn so that
 * nvcc fuses nothing), so blocks equal the CPU's byte for byte.
 * Dequantise: one thread block per (token, head, K/V), threads over
 * channels.
 */
#include <math.h>

#include "../lowbit.h"
#include "common.cuh"

using namespace kvcuda;

namespace
{

/* A low-bit block's geometry (offsets from the block's start). */
struct lbgeom {
    unsigned long long block_bytes, v_codes, k_params, v_params, shift;
    unsigned tokens, row, group, nk, nv, bits;
};

lbgeom make_lbgeom(const kv_layout *l, uint32_t bits)
{
    lbgeom q;
    q.block_bytes = kv_lowbit_block_bytes(l, bits);
    q.v_codes = kv_lowbit_code_offset(l, bits, 0, 1, 0, 0);
    q.k_params = kv_lowbit_key_params_offset(l, bits, 0, 0, 0);
    q.v_params = kv_lowbit_value_params_offset(l, bits, 0, 0, 0);
    q.shift = kv_lowbit_shift_offset(l, bits, 0);
    q.tokens = l->block_tokens;
    q.row = (unsigned)(((size_t)l->head_dim * bits + 7) / 8);
    q.group = kv_lowbit_group(l);
    q.nk = (l->block_tokens + q.group - 1) / q.group;
    q.nv = (l->head_dim + q.group - 1) / q.group;
    q.bits = bits;
    return q;
}

__device__ __forceinline__ void put_half(uint8_t *p, uint16_t h)
{
    *reinterpret_cast<uint16_t *>(p) = h;
}

__global__ void zero_kernel(lbgeom q, const uint32_t *qblocks, uint8_t *qpool)
{
    uint8_t *b = qpool + qblocks[blockIdx.x] * q.block_bytes;
    for (unsigned long long i = threadIdx.x; i < q.block_bytes; i += blockDim.x)
        b[i] = 0;
}

/* Tokens of block b that are filled. */
__device__ __forceinline__ unsigned filled(const lbgeom &q, unsigned b, unsigned long long ntok)
{
    const unsigned long long first = (unsigned long long)b * q.tokens;
    return ntok > first ? (unsigned)min((unsigned long long)q.tokens, ntok - first) : 0;
}

/* The block's shift, written at its place in the block: max |x| as float
 * bits (non-negative floats order as their bits; NaN is skipped as the
 * CPU's comparison skips it). */
__global__ void shift_kernel(geom g, lbgeom q, int t, const uint8_t *pool, const token *tok,
                             unsigned long long ntok, const uint32_t *qblocks, uint8_t *qpool)
{
    __shared__ unsigned amax;
    const unsigned b = blockIdx.x, m = filled(q, b, ntok);
    if (threadIdx.x == 0)
        amax = 0;
    __syncthreads();
    const unsigned long long per_token = 2ull * g.heads * g.dim, n = m * per_token;
    unsigned mine = 0;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        const token tk = tok[(unsigned long long)b * q.tokens + i / per_token];
        const unsigned r = (unsigned)(i % per_token), kv = r / (g.heads * g.dim);
        const unsigned h = r / g.dim % g.heads, c = r % g.dim;
        float a = fabsf(load_elt(pool + row_offset(g, tk.block, kv, h, tk.slot) + c * g.elt, t));
        if (a == a && __float_as_uint(a) > mine)
            mine = __float_as_uint(a);
    }
    atomicMax(&amax, mine);
    __syncthreads();
    if (threadIdx.x == 0)
        *reinterpret_cast<int32_t *>(qpool + qblocks[b] * q.block_bytes + q.shift) =
            kv_lowbit_shift(__uint_as_float(amax));
}

/* Element c of a row, shifted by the block's p = 2^-e. */
__device__ __forceinline__ float shifted(const uint8_t *row, unsigned c, const geom &g, int t,
                                         float p)
{
    return __fmul_rn(load_elt(row + c * g.elt, t), p);
}

__device__ __forceinline__ float block_p(const lbgeom &q, const uint8_t *qb)
{
    return kv_lowbit_pow2(-*reinterpret_cast<const int32_t *>(qb + q.shift));
}

__global__ void keys_kernel(geom g, lbgeom q, int t, const uint8_t *pool, const token *tok,
                            unsigned long long ntok, const uint32_t *qblocks, uint8_t *qpool)
{
    const unsigned b = blockIdx.x, head = blockIdx.y, kg = blockIdx.z;
    const unsigned m = filled(q, b, ntok), k0 = kg * q.group;
    if (k0 >= m)
        return;
    const unsigned n = min(q.group, m - k0), per = 8 / q.bits;
    const unsigned long long first = (unsigned long long)b * q.tokens + k0;
    uint8_t *qb = qpool + qblocks[b] * q.block_bytes;
    const float p = block_p(q, qb);
    uint8_t *par = qb + q.k_params + ((unsigned long long)head * q.nk + kg) * 4ull * g.dim;
    for (unsigned byte = threadIdx.x; byte < q.row; byte += blockDim.x) {
        float s[4], z[4]; /* per <= 4 channels a byte */
        for (unsigned k = 0; k < per; k++) {
            const unsigned c = byte * per + k;
            if (c >= g.dim)
                break;
            float lo = INFINITY, hi = -INFINITY;
            for (unsigned i = 0; i < n; i++) {
                const token tk = tok[first + i];
                float x = shifted(pool + row_offset(g, tk.block, 0, head, tk.slot), c, g, t, p);
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            uint16_t hs, hz;
            kv_lowbit_params(lo, hi, q.bits, &hs, &hz);
            put_half(par + 2ull * c, hs);
            put_half(par + 2ull * (g.dim + c), hz);
            s[k] = kv_half_to_float(hs);
            z[k] = kv_half_to_float(hz);
        }
        for (unsigned i = 0; i < n; i++) {
            const token tk = tok[first + i];
            const uint8_t *row = pool + row_offset(g, tk.block, 0, head, tk.slot);
            unsigned v = 0;
            for (unsigned k = 0; k < per && byte * per + k < g.dim; k++) {
                const unsigned c = byte * per + k;
                v |= kv_lowbit_code(shifted(row, c, g, t, p), s[k], z[k], q.bits) << (k * q.bits);
            }
            qb[((unsigned long long)head * q.tokens + k0 + i) * q.row + byte] = (uint8_t)v;
        }
    }
}

__global__ void values_kernel(geom g, lbgeom q, int t, const uint8_t *pool, const token *tok,
                              unsigned long long ntok, const uint32_t *qblocks, uint8_t *qpool)
{
    extern __shared__ float params[]; /* nv scales, then nv zero points */
    const unsigned b = blockIdx.x, head = blockIdx.y, i = blockIdx.z;
    if (i >= filled(q, b, ntok))
        return;
    const token tk = tok[(unsigned long long)b * q.tokens + i];
    const uint8_t *row = pool + row_offset(g, tk.block, 1, head, tk.slot);
    uint8_t *qb = qpool + qblocks[b] * q.block_bytes;
    const float p = block_p(q, qb);
    uint8_t *par = qb + q.v_params + ((unsigned long long)head * q.tokens + i) * 4ull * q.nv;
    for (unsigned k = threadIdx.x; k < q.nv; k += blockDim.x) {
        float lo = INFINITY, hi = -INFINITY;
        for (unsigned c = k * q.group; c < g.dim && c < (k + 1) * q.group; c++) {
            float x = shifted(row, c, g, t, p);
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
        }
        uint16_t hs, hz;
        kv_lowbit_params(lo, hi, q.bits, &hs, &hz);
        put_half(par + 2ull * k, hs);
        put_half(par + 2ull * (q.nv + k), hz);
        params[k] = kv_half_to_float(hs);
        params[q.nv + k] = kv_half_to_float(hz);
    }
    __syncthreads();
    const unsigned per = 8 / q.bits;
    uint8_t *out = qb + q.v_codes + ((unsigned long long)head * q.tokens + i) * q.row;
    for (unsigned byte = threadIdx.x; byte < q.row; byte += blockDim.x) {
        unsigned v = 0;
        for (unsigned k = 0; k < per && byte * per + k < g.dim; k++) {
            const unsigned c = byte * per + k, gi = c / q.group;
            v |= kv_lowbit_code(shifted(row, c, g, t, p), params[gi], params[q.nv + gi], q.bits)
                 << (k * q.bits);
        }
        out[byte] = (uint8_t)v;
    }
}

__device__ __forceinline__ float half_at(const uint8_t *p, unsigned long long i)
{
    return kv_half_to_float(*reinterpret_cast<const uint16_t *>(p + 2 * i));
}

/* g: the destination pool's geometry (the low-bit block's is q's). */
__global__ void dequantize_kernel(geom g, lbgeom q, int t, const uint8_t *qpool, const token *src,
                                  const token *dst, uint8_t *pool)
{
    const token s = src[blockIdx.x], d = dst[blockIdx.x];
    const unsigned head = blockIdx.y, kv = blockIdx.z;
    const uint8_t *qb = qpool + s.block * q.block_bytes;
    const uint8_t *codes =
        qb + (kv ? q.v_codes : 0) + ((unsigned long long)head * q.tokens + s.slot) * q.row;
    const uint8_t *kp =
        qb + q.k_params + ((unsigned long long)head * q.nk + s.slot / q.group) * 4ull * g.dim;
    const uint8_t *vp =
        qb + q.v_params + ((unsigned long long)head * q.tokens + s.slot) * 4ull * q.nv;
    uint8_t *out = pool + row_offset(g, d.block, kv, head, d.slot);
    const float p2 = kv_lowbit_pow2(*reinterpret_cast<const int32_t *>(qb + q.shift));
    for (unsigned c = threadIdx.x; c < g.dim; c += blockDim.x) {
        const unsigned code = kv_lowbit_get(codes, c, q.bits);
        float x = kv ? kv_lowbit_value(code, half_at(vp, c / q.group),
                                       half_at(vp, q.nv + c / q.group), p2)
                     : kv_lowbit_value(code, half_at(kp, c), half_at(kp, g.dim + c), p2);
        store_elt(out + c * g.elt, t, x);
    }
}

} // namespace

extern "C" int kv_lowbit_quantize_cuda(const kv_layout *l, uint32_t bits, kv_dtype t,
                                       const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                                       uint8_t *qpool, const uint32_t *qblocks, size_t nq)
{
    size_t ntok = kv_segments_tokens(segs, nsegs);
    if (bits != 4 && bits != 2)
        return cudaErrorInvalidValue;
    if (nq == 0 || l->kv_heads == 0 || l->head_dim == 0)
        return cudaSuccess;
    lbgeom q = make_lbgeom(l, bits);
    size_t shared = 2 * (size_t)q.nv * sizeof(float);
    if (ntok > nq * (size_t)l->block_tokens || nq > 0x7fffffffu || l->kv_heads > 65535u ||
        q.nk > 65535u || l->block_tokens > 65535u || shared > 48 * 1024)
        return cudaErrorInvalidValue;
    token *tok = expand(segs, nsegs, ntok);
    if (tok == nullptr)
        return cudaErrorMemoryAllocation;
    scratch sc;
    const token *d_tok = static_cast<const token *>(sc.put(tok, ntok * sizeof(token)));
    const uint32_t *d_qb = static_cast<const uint32_t *>(sc.put(qblocks, nq * sizeof(uint32_t)));
    if (sc.err == cudaSuccess) {
        geom g = make_geom(l);
        zero_kernel<<<(unsigned)nq, kThreads>>>(q, d_qb, qpool);
        shift_kernel<<<(unsigned)nq, kThreads>>>(g, q, t, pool, d_tok, ntok, d_qb, qpool);
        keys_kernel<<<dim3((unsigned)nq, l->kv_heads, q.nk), kThreads>>>(g, q, t, pool, d_tok, ntok,
                                                                         d_qb, qpool);
        values_kernel<<<dim3((unsigned)nq, l->kv_heads, l->block_tokens), kThreads, shared>>>(
            g, q, t, pool, d_tok, ntok, d_qb, qpool);
    }
    int err = sc.finish();
    free(tok);
    return err;
}

extern "C" int kv_lowbit_dequantize_cuda(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                                         const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                         const kv_layout *dl,
                                         uint8_t *pool, const kv_segment *dst, size_t ndst)
{
    size_t a = kv_segments_tokens(qsegs, nqsegs), b = kv_segments_tokens(dst, ndst);
    size_t n = a < b ? a : b;
    if (bits != 4 && bits != 2)
        return cudaErrorInvalidValue;
    if (n == 0 || l->kv_heads == 0 || l->head_dim == 0)
        return cudaSuccess;
    if (n > 0x7fffffffu || l->kv_heads > 65535u)
        return cudaErrorInvalidValue;
    return with_token_pairs(qsegs, nqsegs, dst, ndst, n, [&](const token *s, const token *d) {
        dim3 grid((unsigned)n, l->kv_heads, 2);
        dequantize_kernel<<<grid, kThreads>>>(make_geom(dl), make_lbgeom(l, bits), t, qpool, s, d,
                                              pool);
    });
}
