/*
 * vnorm.cu - CUDA twin of the projected value norm (kernels/cpu/vnorm.c).
 *
 * Equal to the CPU bit for bit: every dot product is the same sequence of
 * double operations over j (__dmul_rn / __dadd_rn, no FMA), every L1 sum
 * adds |dot| in the order of c, and the group sum adds heads in order.
 *  1. One thread block per (tile of TB tokens, query head h), TB x CC
 *     threads. The tile's values sit in shared memory; for each chunk of CC
 *     output features the W^O rows are staged in shared memory (coalesced
 *     along j), thread (t, cl) computes |dot| of token t and feature c0+cl,
 *     and then thread t adds the chunk's CC values to its running sum in
 *     feature order. The sum per (h, token) goes to scratch.
 *  2. One thread per (kv head, token): the group's sums in head order, / G.
 * Rows of the shared arrays are padded by one float against bank conflicts.
 */
#include "common.cuh"

using namespace kvcuda;

namespace
{

__global__ void vnorm_heads_kernel(geom g, int t, const uint8_t *pool, const token *tok,
                                   unsigned long long ntok, const float *wo,
                                   unsigned long long wo_stride, unsigned G, unsigned hidden,
                                   unsigned TB, unsigned CC, double *part)
{
    extern __shared__ double smem[];
    const unsigned d = g.dim, pad = d + 1, h = blockIdx.y, kvh = h / G, tid = threadIdx.x;
    double *s_sh = smem;                                     /* [TB][CC] */
    float *v_sh = reinterpret_cast<float *>(s_sh + TB * CC); /* [TB][pad] */
    float *w_sh = v_sh + TB * pad;                           /* [CC][pad] */
    const unsigned long long first = (unsigned long long)blockIdx.x * TB;
    const unsigned nt = (unsigned)min((unsigned long long)TB, ntok - first);

    for (unsigned idx = tid; idx < TB * d; idx += blockDim.x) {
        unsigned tt = idx / d, j = idx % d;
        float v = 0;
        if (tt < nt) {
            const token tk = tok[first + tt];
            v = load_elt(pool + row_offset(g, tk.block, 1, kvh, tk.slot) + j * g.elt, t);
        }
        v_sh[tt * pad + j] = v;
    }
    const unsigned my_t = tid % TB, my_c = tid / TB;
    double sum = 0; /* thread tid < TB: token tid's L1 sum */
    for (unsigned c0 = 0; c0 < hidden; c0 += CC) {
        __syncthreads(); /* v_sh ready; the last chunk's w_sh and s_sh consumed */
        for (unsigned idx = tid; idx < CC * d; idx += blockDim.x) {
            unsigned cl = idx / d, j = idx % d;
            w_sh[cl * pad + j] =
                c0 + cl < hidden ? wo[(unsigned long long)(c0 + cl) * wo_stride + h * d + j] : 0;
        }
        __syncthreads();
        double dot = 0;
        for (unsigned j = 0; j < d; j++)
            dot = __dadd_rn(dot,
                            __dmul_rn((double)v_sh[my_t * pad + j], (double)w_sh[my_c * pad + j]));
        s_sh[my_t * CC + my_c] = fabs(dot);
        __syncthreads();
        if (tid < TB)
            for (unsigned cl = 0; cl < CC && c0 + cl < hidden; cl++)
                sum = __dadd_rn(sum, s_sh[tid * CC + cl]);
    }
    if (tid < nt)
        part[(unsigned long long)h * ntok + first + tid] = sum;
}

__global__ void vnorm_group_kernel(const double *part, unsigned long long ntok, unsigned kv_heads,
                                   unsigned G, float *out)
{
    const unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= ntok * kv_heads)
        return;
    const unsigned long long gkv = k / ntok, i = k % ntok;
    double acc = 0;
    for (unsigned h = 0; h < G; h++)
        acc = __dadd_rn(acc, part[(gkv * G + h) * ntok + i]);
    out[k] = __double2float_rn(__ddiv_rn(acc, (double)G)); /* mean over the group */
}

} // namespace

extern "C" int kv_vnorm_l1_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, const float *wo,
                                size_t wo_stride, uint32_t q_heads, uint32_t hidden, float *out)
{
    size_t ntok = kv_segments_tokens(segs, nsegs);
    if (l->kv_heads == 0 || q_heads % l->kv_heads != 0 || q_heads > 65535u)
        return cudaErrorInvalidValue;
    if (ntok == 0)
        return cudaSuccess;
    unsigned TB = l->head_dim <= 256 ? 16 : 8, CC = TB;
    size_t smem = TB * CC * sizeof(double) + (size_t)(TB + CC) * (l->head_dim + 1) * sizeof(float);
    size_t tiles = (ntok + TB - 1) / TB;
    if (smem > 48 * 1024 || tiles > 0x7fffffffu)
        return cudaErrorInvalidValue; /* head_dim above 759 */
    token *tok = expand(segs, nsegs, ntok);
    if (tok == nullptr)
        return cudaErrorMemoryAllocation;
    scratch sc;
    const token *d_tok = static_cast<const token *>(sc.put(tok, ntok * sizeof(token)));
    double *d_part =
        static_cast<double *>(sc.put(nullptr, (size_t)q_heads * ntok * sizeof(double)));
    if (sc.err == cudaSuccess) {
        uint32_t G = q_heads / l->kv_heads;
        dim3 grid((unsigned)tiles, q_heads);
        vnorm_heads_kernel<<<grid, TB * CC, smem>>>(make_geom(l), t, pool, d_tok, ntok, wo,
                                                    wo_stride, G, hidden, TB, CC, d_part);
        size_t k = ntok * l->kv_heads;
        vnorm_group_kernel<<<blocks_for(k, 256), 256>>>(d_part, ntok, l->kv_heads, G, out);
    }
    int err = sc.finish();
    free(tok);
    return err;
}
