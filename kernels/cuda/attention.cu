/*
 * attention.cu - kv_decode_attention_cuda, the CUDA twin of the decode
 * attention contract in kernels.h: one new query token's attention over a
 * list of the pool (all-heads list, or a per-head list: a kv_heads = 1
 * layout), blockwise online softmax, split over the list ("flash
 * decoding"):
 *  1. attn_partial: one thread block per (split of the list, kv head, group
 *     of up to GB query heads of that kv head). Each warp walks a contiguous
 *     share of the split's tokens; per token it reads the K row once (lane
 *     j holds channels j, j+32, ...), computes the GB scores with warp
 *     reductions, reads the V row once and updates GB running (max, sum,
 *     accumulator) triples. The warps' triples merge in shared memory into
 *     one per (split, query head), written to scratch. With probs, the raw
 *     scores are written to probs as they are computed.
 *  2. attn_combine: per query head, the splits' triples merge into the
 *     output; the global max and sum stay in scratch.
 *  3. attn_probs (only with probs): p = exp(score - max) / sum in place.
 * Scores are q.k * scale in fp32 with exp = expf; the CPU reference's
 * summation order differs, so results agree to about 1e-6 relative, not
 * bit for bit. head_dim up to 512 (registers hold ceil(d / 32) channels per
 * lane); an empty list writes zeros to out.
 *
 * Tiers (kernels.h): a segment of tier KV_TIER_INT8 names slots of the INT8
 * block that its pool block holds (layout q8 = l with block_tokens =
 * kv_int8_tokens_per_block(l), INT8 block 0 at the pool block's start); a
 * lane reads its channels' codes and scales and multiplies them in fp32
 * (__fmul_rn: the product is not fused into the dot product), so the
 * dequantised value is the CPU's. INT4 and INT2 segments (kernels.h
 * "Low-bit tiers") are read the same way: a lane unpacks its channels'
 * codes and applies their group's fp16 scale and zero point with
 * kernels/lowbit.h's kv_lowbit_value, the CPU's. The host checks the tiers
 * and that quantised segments stay inside their block (else
 * cudaErrorInvalidValue).
 */
#include <math.h>

#include "../lowbit.h"
#include "common.cuh"

using namespace kvcuda;

namespace
{

constexpr int kWarps = 4;

/* A segment with its tier and the list index of its first token. */
struct dev_seg {
    unsigned block, first_slot, count, tier;
    unsigned long long start;
};

/* The INT8 block inside an INT8 segment's pool block (kernels.h "INT8
 * tier"), as offsets from the pool block's start. */
struct q8geom {
    unsigned long long v_codes; /* V codes: K codes are at 0 */
    unsigned long long scales;  /* K scales; V scales follow heads * dim floats later */
    unsigned tokens;            /* kv_int8_tokens_per_block */
};

/* A low-bit block inside an INT4 / INT2 segment's pool block, as offsets
 * from the pool block's start (kernels.h "Low-bit tiers"). */
struct lbgeom {
    unsigned long long v_codes, k_params, v_params, shift;
    unsigned tokens, row, group, nk, nv;
};

lbgeom make_lbgeom(const kv_layout *l, uint32_t bits)
{
    kv_layout q = *l;
    q.block_tokens = kv_lowbit_tokens_per_block(l, bits);
    lbgeom g;
    g.v_codes = kv_lowbit_code_offset(&q, bits, 0, 1, 0, 0);
    g.k_params = kv_lowbit_key_params_offset(&q, bits, 0, 0, 0);
    g.v_params = kv_lowbit_value_params_offset(&q, bits, 0, 0, 0);
    g.shift = kv_lowbit_shift_offset(&q, bits, 0);
    g.tokens = q.block_tokens;
    g.row = (unsigned)(((size_t)l->head_dim * bits + 7) / 8);
    g.group = kv_lowbit_group(l);
    g.nk = (q.block_tokens + g.group - 1) / g.group;
    g.nv = (l->head_dim + g.group - 1) / g.group;
    return g;
}

__device__ __forceinline__ float half_at(const uint8_t *p, unsigned long long i)
{
    return kv_half_to_float(*reinterpret_cast<const uint16_t *>(p + 2 * i));
}

/* K and V element j of a low-bit token (kv head, slot) of block qb. */
__device__ __forceinline__ void load_lowbit(const lbgeom &q, unsigned bits, unsigned dim,
                                            const uint8_t *qb, unsigned kvh, unsigned slot,
                                            unsigned j, float *k, float *v)
{
    const unsigned long long row = ((unsigned long long)kvh * q.tokens + slot) * q.row;
    const uint8_t *kp =
        qb + q.k_params + ((unsigned long long)kvh * q.nk + slot / q.group) * 4ull * dim;
    const uint8_t *vp = qb + q.v_params + ((unsigned long long)kvh * q.tokens + slot) * 4ull * q.nv;
    const float p2 = kv_lowbit_pow2(*reinterpret_cast<const int32_t *>(qb + q.shift));
    *k =
        kv_lowbit_value(kv_lowbit_get(qb + row, j, bits), half_at(kp, j), half_at(kp, dim + j), p2);
    *v = kv_lowbit_value(kv_lowbit_get(qb + q.v_codes + row, j, bits), half_at(vp, j / q.group),
                         half_at(vp, q.nv + j / q.group), p2);
}

/* The quantised blocks' geometries a kernel needs. */
struct tiergeom {
    q8geom q8;
    lbgeom q4, q2;
};

/* K and V element j of (segment sg, kv head, slot) as fp32. */
__device__ __forceinline__ void load_kv(const geom &g, const tiergeom &tg, int t,
                                        const uint8_t *pool, const dev_seg &sg, unsigned kvh,
                                        unsigned slot, unsigned j, float *k, float *v)
{
    const q8geom &q8 = tg.q8;
    if (sg.tier == KV_TIER_FULL) {
        const uint8_t *krow = pool + row_offset(g, sg.block, 0, kvh, slot);
        *k = load_elt(krow + j * g.elt, t);
        *v = load_elt(krow + g.block_bytes / 2 + j * g.elt, t);
        return;
    }
    const uint8_t *qb = pool + sg.block * g.block_bytes;
    if (sg.tier == KV_TIER_INT4 || sg.tier == KV_TIER_INT2) {
        const bool four = sg.tier == KV_TIER_INT4;
        load_lowbit(four ? tg.q4 : tg.q2, four ? 4 : 2, g.dim, qb, kvh, slot, j, k, v);
        return;
    }
    const unsigned long long code = ((unsigned long long)kvh * q8.tokens + slot) * g.dim + j;
    const float *ks = reinterpret_cast<const float *>(qb + q8.scales) + (size_t)kvh * g.dim;
    const float *vs = ks + (size_t)g.heads * g.dim;
    *k = __fmul_rn((float)(int8_t)qb[code], ks[j]);
    *v = __fmul_rn((float)(int8_t)qb[q8.v_codes + code], vs[j]);
}

/* The segment holding list token i (binary search over starts). */
__device__ __forceinline__ unsigned find_seg(const dev_seg *segs, unsigned nsegs,
                                             unsigned long long i)
{
    unsigned lo = 0, hi = nsegs; /* segs[lo].start <= i < segs[hi].start */
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (segs[mid].start <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int EPL, int GB>
__global__ void attn_partial(geom g, tiergeom tg, int t, const uint8_t *pool, const dev_seg *segs,
                             unsigned nsegs, unsigned long long ntok, unsigned long long chunk,
                             const float *q, unsigned G, float scale, float *part_m, float *part_l,
                             float *part_acc, float *probs, unsigned q_heads)
{
    __shared__ float sh_m[kWarps][GB], sh_l[kWarps][GB];
    __shared__ float sh_acc[kWarps][GB][32 * EPL];
    const unsigned split = blockIdx.x, kvh = blockIdx.y, lane = threadIdx.x % 32,
                   warp = threadIdx.x / 32, d = g.dim;
    const unsigned h0 = kvh * G + blockIdx.z * GB; /* first query head of the CTA */
    const unsigned ng = min((unsigned)GB, kvh * G + G - h0);

    float qr[GB][EPL], acc[GB][EPL], m[GB], l[GB];
    for (int gi = 0; gi < GB; gi++) {
        m[gi] = -INFINITY;
        l[gi] = 0;
        for (int e = 0; e < EPL; e++) {
            unsigned j = lane + 32 * e;
            qr[gi][e] = gi < (int)ng && j < d ? q[(unsigned long long)(h0 + gi) * d + j] : 0;
            acc[gi][e] = 0;
        }
    }

    /* This warp's contiguous share of the split. */
    const unsigned long long s0 = split * chunk, s1 = min(ntok, s0 + chunk);
    const unsigned long long per = (s1 - s0 + kWarps - 1) / kWarps;
    const unsigned long long w0 = min(s1, s0 + warp * per), w1 = min(s1, w0 + per);
    unsigned si = w0 < w1 ? find_seg(segs, nsegs, w0) : 0;
    for (unsigned long long i = w0; i < w1; i++) {
        while (i >= segs[si].start + segs[si].count)
            si++;
        const unsigned slot = segs[si].first_slot + (unsigned)(i - segs[si].start);
        float k[EPL], v[EPL];
        for (int e = 0; e < EPL; e++) {
            unsigned j = lane + 32 * e;
            k[e] = v[e] = 0;
            if (j < d)
                load_kv(g, tg, t, pool, segs[si], kvh, slot, j, &k[e], &v[e]);
        }
        for (int gi = 0; gi < GB; gi++) {
            if (gi >= (int)ng)
                break;
            float part = 0;
            for (int e = 0; e < EPL; e++)
                part += qr[gi][e] * k[e];
            const float s = warp_sum(part) * scale;
            if (probs != nullptr && lane == 0)
                probs[(unsigned long long)(h0 + gi) * ntok + i] = s;
            const float mn = fmaxf(m[gi], s);
            const float corr = expf(m[gi] - mn), p = expf(s - mn);
            l[gi] = l[gi] * corr + p;
            for (int e = 0; e < EPL; e++)
                acc[gi][e] = acc[gi][e] * corr + p * v[e];
            m[gi] = mn;
        }
    }

    for (int gi = 0; gi < GB; gi++) {
        if (lane == 0) {
            sh_m[warp][gi] = m[gi];
            sh_l[warp][gi] = l[gi];
        }
        for (int e = 0; e < EPL; e++)
            sh_acc[warp][gi][lane + 32 * e] = acc[gi][e];
    }
    __syncthreads();
    /* Merge the warps: thread x handles (head gi, channel j) pairs. */
    for (unsigned x = threadIdx.x; x < ng * d; x += blockDim.x) {
        const unsigned gi = x / d, j = x % d;
        float mx = -INFINITY;
        for (int w = 0; w < kWarps; w++)
            mx = fmaxf(mx, sh_m[w][gi]);
        float ls = 0, a = 0;
        for (int w = 0; w < kWarps; w++) {
            const float f = sh_m[w][gi] == -INFINITY ? 0.0f : expf(sh_m[w][gi] - mx);
            ls += sh_l[w][gi] * f;
            a += sh_acc[w][gi][j] * f;
        }
        const unsigned long long ph = (unsigned long long)split * q_heads + h0 + gi;
        part_acc[ph * d + j] = a;
        if (j == 0) {
            part_m[ph] = mx;
            part_l[ph] = ls;
        }
    }
}

__global__ void attn_combine(unsigned nsplit, unsigned q_heads, unsigned d, const float *part_m,
                             const float *part_l, const float *part_acc, float *out, float *stat)
{
    const unsigned h = blockIdx.x;
    float mx = -INFINITY;
    for (unsigned s = 0; s < nsplit; s++)
        mx = fmaxf(mx, part_m[(unsigned long long)s * q_heads + h]);
    float ls = 0;
    for (unsigned s = 0; s < nsplit; s++) {
        const unsigned long long ph = (unsigned long long)s * q_heads + h;
        ls += part_m[ph] == -INFINITY ? 0.0f : part_l[ph] * expf(part_m[ph] - mx);
    }
    for (unsigned j = threadIdx.x; j < d; j += blockDim.x) {
        float a = 0;
        for (unsigned s = 0; s < nsplit; s++) {
            const unsigned long long ph = (unsigned long long)s * q_heads + h;
            if (part_m[ph] != -INFINITY)
                a += part_acc[ph * d + j] * expf(part_m[ph] - mx);
        }
        out[(unsigned long long)h * d + j] = a / ls;
    }
    if (threadIdx.x == 0) {
        stat[2 * h] = mx;
        stat[2 * h + 1] = ls;
    }
}

__global__ void attn_probs(unsigned long long ntok, const float *stat, float *probs)
{
    const unsigned h = blockIdx.y;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < ntok) {
        float *p = probs + (unsigned long long)h * ntok + i;
        *p = expf(*p - stat[2 * h]) / stat[2 * h + 1];
    }
}

template <int EPL, int GB>
void launch_partial(dim3 grid, const geom &g, const tiergeom &tg, int t, const uint8_t *pool,
                    const dev_seg *segs, unsigned nsegs, unsigned long long ntok,
                    unsigned long long chunk, const float *q, unsigned G, float scale, float *pm,
                    float *pl, float *pa, float *probs, unsigned q_heads)
{
    attn_partial<EPL, GB><<<grid, kWarps * 32>>>(g, tg, t, pool, segs, nsegs, ntok, chunk, q, G,
                                                 scale, pm, pl, pa, probs, q_heads);
}

} // namespace

extern "C" int kv_decode_attention_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                        const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                                        const float *q, uint32_t q_heads, float scale, float *out,
                                        float *probs)
{
    const uint32_t d = l->head_dim;
    if (l->kv_heads == 0 || q_heads == 0 || q_heads % l->kv_heads != 0 || d > 512 ||
        l->kv_heads > 65535u || q_heads > 65535u)
        return cudaErrorInvalidValue;
    kv_layout q8l = *l;
    q8l.block_tokens = kv_int8_tokens_per_block(l);
    const uint32_t slots4 = kv_lowbit_tokens_per_block(l, 4),
                   slots2 = kv_lowbit_tokens_per_block(l, 2);
    for (size_t i = 0; tiers != nullptr && i < nsegs; i++) {
        if (tiers[i] == KV_TIER_FULL || segs[i].count == 0)
            continue;
        uint32_t slots = tiers[i] == KV_TIER_INT8   ? q8l.block_tokens
                         : tiers[i] == KV_TIER_INT4 ? slots4
                         : tiers[i] == KV_TIER_INT2 ? slots2
                                                    : 0;
        if ((uint64_t)segs[i].first_slot + segs[i].count > slots)
            return cudaErrorInvalidValue;
    }
    size_t ntok = kv_segments_tokens(segs, nsegs);
    if (ntok == 0 || d == 0) {
        cudaError_t err = cudaMemsetAsync(out, 0, (size_t)q_heads * d * sizeof(float), 0);
        cudaError_t serr = cudaStreamSynchronize(0);
        return err != cudaSuccess ? err : serr;
    }
    const uint32_t G = q_heads / l->kv_heads;
    const int epl = d <= 32 ? 1 : d <= 64 ? 2 : d <= 128 ? 4 : d <= 256 ? 8 : 16;
    const unsigned gb = epl <= 4 ? 4 : 2, zg = (G + gb - 1) / gb;
    if (zg > 65535u)
        return cudaErrorInvalidValue;

    /* Splits: about 4 thread blocks per SM over the whole grid, at least 64
     * tokens each; every split gets at least one token. */
    int dev = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess)
        return err;
    size_t per_split_grid = (size_t)l->kv_heads * zg;
    size_t want = ((size_t)sms * 4 + per_split_grid - 1) / per_split_grid;
    size_t chunk = (ntok + want - 1) / want;
    if (chunk < 64)
        chunk = 64;
    size_t nsplit = (ntok + chunk - 1) / chunk;

    /* Non-empty segments with their first token's list index. */
    dev_seg *ds = static_cast<dev_seg *>(malloc(nsegs * sizeof(dev_seg)));
    if (ds == nullptr)
        return cudaErrorMemoryAllocation;
    unsigned nds = 0;
    unsigned long long start = 0;
    for (size_t i = 0; i < nsegs; i++) {
        if (segs[i].count == 0)
            continue;
        unsigned tier = tiers != nullptr ? tiers[i] : (unsigned)KV_TIER_FULL;
        ds[nds++] = dev_seg{segs[i].block, segs[i].first_slot, segs[i].count, tier, start};
        start += segs[i].count;
    }
    scratch sc;
    const dev_seg *d_segs = static_cast<const dev_seg *>(sc.put(ds, nds * sizeof(dev_seg)));
    size_t nph = nsplit * q_heads;
    float *pm = static_cast<float *>(sc.put(nullptr, nph * sizeof(float)));
    float *pl = static_cast<float *>(sc.put(nullptr, nph * sizeof(float)));
    float *pa = static_cast<float *>(sc.put(nullptr, nph * d * sizeof(float)));
    float *stat = static_cast<float *>(sc.put(nullptr, 2 * (size_t)q_heads * sizeof(float)));
    if (sc.err == cudaSuccess) {
        geom g = make_geom(l);
        tiergeom tg;
        tg.q8 = {kv_int8_code_offset(&q8l, 0, 1, 0, 0), kv_int8_scale_offset(&q8l, 0, 0, 0),
                 q8l.block_tokens};
        tg.q4 = make_lbgeom(l, 4);
        tg.q2 = make_lbgeom(l, 2);
        dim3 grid((unsigned)nsplit, l->kv_heads, zg);
        switch (epl) {
        case 1:
            launch_partial<1, 4>(grid, g, tg, t, pool, d_segs, nds, ntok, chunk, q, G, scale, pm,
                                 pl, pa, probs, q_heads);
            break;
        case 2:
            launch_partial<2, 4>(grid, g, tg, t, pool, d_segs, nds, ntok, chunk, q, G, scale, pm,
                                 pl, pa, probs, q_heads);
            break;
        case 4:
            launch_partial<4, 4>(grid, g, tg, t, pool, d_segs, nds, ntok, chunk, q, G, scale, pm,
                                 pl, pa, probs, q_heads);
            break;
        case 8:
            launch_partial<8, 2>(grid, g, tg, t, pool, d_segs, nds, ntok, chunk, q, G, scale, pm,
                                 pl, pa, probs, q_heads);
            break;
        default:
            launch_partial<16, 2>(grid, g, tg, t, pool, d_segs, nds, ntok, chunk, q, G, scale, pm,
                                  pl, pa, probs, q_heads);
            break;
        }
        attn_combine<<<q_heads, 128>>>((unsigned)nsplit, q_heads, d, pm, pl, pa, out, stat);
        if (probs != nullptr) {
            dim3 pg(blocks_for(ntok, 256), q_heads);
            attn_probs<<<pg, 256>>>(ntok, stat, probs);
        }
    }
    int rc = sc.finish();
    free(ds);
    return rc;
}
