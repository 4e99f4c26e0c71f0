/*
 * sketch.cu - CUDA twins of the count-sketch kernels (kernels/cpu/sketch.c).
 *
 * Every cell element must receive its additions in token order (that is
 * what makes the result equal the CPU's, bit for bit), and each element is
 * independent of every other, so:
 *  - insert: the host sorts the tokens into cells (per row and bucket, in
 *    token order: a CSR list of the non-empty cells); one thread block per
 *    cell, threads over channels, each adding its channel of the cell's
 *    tokens in order. Counts: + the cell's token count.
 *  - query: read-only, one thread block per token, threads over channels;
 *    the lower median is the CPU's insertion sort.
 *  - revive / delete: a token's estimate depends on every earlier delete
 *    through the shared cells, so each thread owns one channel and walks the
 *    tokens in order (parallel over channels only). MEAN needs the count a
 *    cell has when the token is queried: the host counts, for each (token,
 *    row), the earlier tokens of the call in the same cell, and the kernel
 *    subtracts that from the count it reads; a second kernel then applies
 *    the decrements. (Revives are a few tokens per step.)
 * fp32 arithmetic uses the _rn intrinsics (no FMA contraction), with the
 * operand forms of the CPU code (cell + g*v, cell + (-1*g)*v, ...).
 */
#include "common.cuh"

using namespace kvcuda;

namespace
{

struct sk_dev {
    unsigned rows, buckets, dim;
    int key_mean, value_mean;
    float *key, *value;
    int32_t *count;
};

sk_dev make_sk(const kv_sketch *s)
{
    sk_dev d;
    d.rows = s->rows;
    d.buckets = s->buckets;
    d.dim = s->dim;
    d.key_mean = s->key_estimate == KV_ESTIMATE_MEAN;
    d.value_mean = s->value_estimate == KV_ESTIMATE_MEAN;
    d.key = s->key;
    d.value = s->value;
    d.count = s->count;
    return d;
}

/* Channel c of a token: byte offset of its K (V = + half) element. */
__device__ __forceinline__ unsigned long long chan_offset(const geom &g, token tk, unsigned c)
{
    unsigned head = c / g.dim, j = c % g.dim;
    return row_offset(g, tk.block, 0, head, tk.slot) + (unsigned long long)j * g.elt;
}

/* One cell's tokens (CSR: cell id, first entry, end). */
struct cell_run {
    unsigned long long cell; /* row * buckets + bucket */
    unsigned first, end;     /* into the entry list */
};

struct entry {
    unsigned token; /* index into the token table */
    float g;        /* the row's sign */
};

__global__ void insert_kernel(sk_dev s, geom g, int t, const uint8_t *pool, const token *tok,
                              const cell_run *runs, const entry *ent)
{
    const cell_run r = runs[blockIdx.x];
    const unsigned long long half = g.block_bytes / 2;
    for (unsigned c = blockIdx.y * blockDim.x + threadIdx.x; c < s.dim;
         c += gridDim.y * blockDim.x) {
        float *ck = s.key + r.cell * s.dim + c, *cv = s.value + r.cell * s.dim + c;
        float k = *ck, v = *cv;
        for (unsigned e = r.first; e < r.end; e++) {
            const unsigned long long off = chan_offset(g, tok[ent[e].token], c);
            k = __fadd_rn(k, load_elt(pool + off, t));
            v = __fadd_rn(v, __fmul_rn(ent[e].g, load_elt(pool + off + half, t)));
        }
        *ck = k;
        *cv = v;
    }
    if (blockIdx.y == 0 && threadIdx.x == 0)
        s.count[r.cell] += (int32_t)(r.end - r.first);
}

/* Lower median of x[0..n) by insertion sort (as the CPU). */
__device__ __forceinline__ float lower_median(float *x, unsigned n)
{
    for (unsigned i = 1; i < n; i++) {
        float v = x[i];
        unsigned j = i;
        for (; j > 0 && x[j - 1] > v; j--)
            x[j] = x[j - 1];
        x[j] = v;
    }
    return x[(n - 1) / 2];
}

/* Row estimate of one cell channel: x (times g for values), / count in
 * MEAN mode when count > 0. */
__device__ __forceinline__ float row_estimate(float x, float g, bool value, bool mean, int32_t cnt)
{
    if (value)
        x = __fmul_rn(x, g);
    if (mean && cnt > 0)
        x = __fdiv_rn(x, (float)cnt);
    return x;
}

/* Estimates of channel c of token i; dec[i*rows + r] (may be NULL) is
 * subtracted from the counts read. */
__device__ void estimate(const sk_dev &s, const uint32_t *h, const int8_t *gs, const int32_t *dec,
                         unsigned long long i, unsigned c, float *ke, float *ve)
{
    float kr[KV_SKETCH_MAX_ROWS], vr[KV_SKETCH_MAX_ROWS];
    for (unsigned r = 0; r < s.rows; r++) {
        unsigned long long cell = (unsigned long long)r * s.buckets + h[i * s.rows + r];
        int32_t cnt = s.count[cell] - (dec ? dec[i * s.rows + r] : 0);
        float g = (float)gs[i * s.rows + r];
        kr[r] = row_estimate(s.key[cell * s.dim + c], g, false, s.key_mean, cnt);
        vr[r] = row_estimate(s.value[cell * s.dim + c], g, true, s.value_mean, cnt);
    }
    *ke = lower_median(kr, s.rows);
    *ve = lower_median(vr, s.rows);
}

__global__ void query_kernel(sk_dev s, geom g, int t, const uint32_t *h, const int8_t *gs,
                             const token *out_tok, uint8_t *pool)
{
    const unsigned long long i = blockIdx.x;
    const unsigned long long half = g.block_bytes / 2;
    for (unsigned c = blockIdx.y * blockDim.x + threadIdx.x; c < s.dim;
         c += gridDim.y * blockDim.x) {
        float ke, ve;
        estimate(s, h, gs, nullptr, i, c, &ke, &ve);
        const unsigned long long off = chan_offset(g, out_tok[i], c);
        store_elt(pool + off, t, ke);
        store_elt(pool + off + half, t, ve);
    }
}

__global__ void revive_kernel(sk_dev s, geom g, int t, const uint32_t *h, const int8_t *gs,
                              const int32_t *dec, unsigned long long n, const token *out_tok,
                              uint8_t *pool)
{
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= s.dim)
        return;
    const unsigned long long half = g.block_bytes / 2;
    for (unsigned long long i = 0; i < n; i++) {
        float ke, ve;
        estimate(s, h, gs, dec, i, c, &ke, &ve);
        if (pool != nullptr) {
            const unsigned long long off = chan_offset(g, out_tok[i], c);
            store_elt(pool + off, t, ke);
            store_elt(pool + off + half, t, ve);
        }
        for (unsigned r = 0; r < s.rows; r++) {
            unsigned long long cell = (unsigned long long)r * s.buckets + h[i * s.rows + r];
            float gv = __fmul_rn(-1.0f, (float)gs[i * s.rows + r]);
            float *ck = s.key + cell * s.dim + c, *cv = s.value + cell * s.dim + c;
            *ck = __fadd_rn(*ck, __fmul_rn(-1.0f, ke));
            *cv = __fadd_rn(*cv, __fmul_rn(gv, ve));
        }
    }
}

/* Thread r walks row r: no two threads touch one cell. */
__global__ void count_down_kernel(sk_dev s, const uint32_t *h, unsigned long long n)
{
    const unsigned r = threadIdx.x;
    if (r >= s.rows)
        return;
    for (unsigned long long i = 0; i < n; i++)
        s.count[(unsigned long long)r * s.buckets + h[i * s.rows + r]] -= 1;
}

bool bad_sketch(const kv_sketch *s)
{
    return s->rows < 1 || s->rows > KV_SKETCH_MAX_ROWS || s->buckets < 1;
}

/* Query, revive or delete (out_segs NULL) n tokens. */
int query_common(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l, kv_dtype t,
                 uint8_t *pool, const kv_segment *segs, size_t nsegs, size_t n, bool del)
{
    if (bad_sketch(sk) || (pool != nullptr && sk->dim != l->kv_heads * l->head_dim))
        return cudaErrorInvalidValue;
    if (n == 0 || sk->dim == 0)
        return cudaSuccess;
    if (n > 0x7fffffffu)
        return cudaErrorInvalidValue;
    token *tok = pool != nullptr ? expand(segs, nsegs, n) : nullptr;
    int32_t *dec = nullptr;
    if (del) { /* earlier tokens of this call in the same cell, per (token, row) */
        dec = static_cast<int32_t *>(malloc(n * sk->rows * sizeof(int32_t)));
        int32_t *seen = static_cast<int32_t *>(calloc((size_t)sk->rows * sk->buckets, 4));
        if (dec != nullptr && seen != nullptr)
            for (size_t i = 0; i < n; i++)
                for (uint32_t r = 0; r < sk->rows; r++)
                    dec[i * sk->rows + r] = seen[(size_t)r * sk->buckets + h[i * sk->rows + r]]++;
        if (seen == nullptr) {
            free(dec);
            dec = nullptr;
        }
        free(seen);
    }
    if ((pool != nullptr && tok == nullptr) || (del && dec == nullptr)) {
        free(tok);
        free(dec);
        return cudaErrorMemoryAllocation;
    }
    scratch sc;
    const uint32_t *d_h = static_cast<const uint32_t *>(sc.put(h, n * sk->rows * 4));
    const int8_t *d_g = static_cast<const int8_t *>(sc.put(g, n * sk->rows));
    const token *d_tok =
        pool != nullptr ? static_cast<const token *>(sc.put(tok, n * sizeof(token))) : nullptr;
    const int32_t *d_dec =
        del ? static_cast<const int32_t *>(sc.put(dec, n * sk->rows * 4)) : nullptr;
    if (sc.err == cudaSuccess) {
        sk_dev s = make_sk(sk);
        geom gm = pool != nullptr ? make_geom(l) : geom{};
        if (del) {
            revive_kernel<<<blocks_for(sk->dim, kThreads), kThreads>>>(s, gm, t, d_h, d_g, d_dec, n,
                                                                       d_tok, pool);
            count_down_kernel<<<1, 32>>>(s, d_h, n);
        } else {
            dim3 grid((unsigned)n, (unsigned)blocks_for(sk->dim, kThreads) < 64
                                       ? blocks_for(sk->dim, kThreads)
                                       : 64);
            query_kernel<<<grid, kThreads>>>(s, gm, t, d_h, d_g, d_tok, pool);
        }
    }
    int err = sc.finish();
    free(tok);
    free(dec);
    return err;
}

} // namespace

extern "C" int kv_sketch_insert_cuda(kv_sketch *sk, const kv_layout *l, kv_dtype t,
                                     const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                                     const uint32_t *h, const int8_t *g)
{
    if (bad_sketch(sk) || sk->dim != l->kv_heads * l->head_dim)
        return cudaErrorInvalidValue;
    size_t n = kv_segments_tokens(segs, nsegs), cells = (size_t)sk->rows * sk->buckets;
    if (n == 0 || sk->dim == 0)
        return cudaSuccess;
    if (n * sk->rows > 0xffffffffu)
        return cudaErrorInvalidValue;
    /* CSR of the non-empty cells, entries in token order within a cell. */
    uint32_t *fill = static_cast<uint32_t *>(calloc(cells + 1, sizeof(uint32_t)));
    entry *ent = static_cast<entry *>(malloc(n * sk->rows * sizeof(entry)));
    cell_run *runs = static_cast<cell_run *>(malloc(n * sk->rows * sizeof(cell_run)));
    token *tok = expand(segs, nsegs, n);
    int err = cudaErrorMemoryAllocation;
    if (fill != nullptr && ent != nullptr && runs != nullptr && tok != nullptr) {
        for (size_t i = 0; i < n; i++)
            for (uint32_t r = 0; r < sk->rows; r++)
                fill[(size_t)r * sk->buckets + h[i * sk->rows + r] + 1]++;
        size_t nruns = 0;
        for (size_t c = 0; c < cells; c++) {
            if (fill[c + 1] > 0)
                runs[nruns++] = cell_run{c, fill[c], fill[c] + fill[c + 1]};
            fill[c + 1] += fill[c]; /* prefix: fill[c] = first entry of cell c */
        }
        for (size_t i = 0; i < n; i++)
            for (uint32_t r = 0; r < sk->rows; r++) {
                size_t c = (size_t)r * sk->buckets + h[i * sk->rows + r];
                ent[fill[c]++] = entry{(unsigned)i, (float)g[i * sk->rows + r]};
            }
        scratch sc;
        const token *d_tok = static_cast<const token *>(sc.put(tok, n * sizeof(token)));
        const cell_run *d_runs =
            static_cast<const cell_run *>(sc.put(runs, nruns * sizeof(cell_run)));
        const entry *d_ent = static_cast<const entry *>(sc.put(ent, n * sk->rows * sizeof(entry)));
        if (sc.err == cudaSuccess && nruns > 0x7fffffffu)
            sc.err = cudaErrorInvalidValue;
        if (sc.err == cudaSuccess) {
            unsigned cb = blocks_for(sk->dim, kThreads);
            dim3 grid((unsigned)nruns, cb < 64 ? cb : 64);
            insert_kernel<<<grid, kThreads>>>(make_sk(sk), make_geom(l), t, pool, d_tok, d_runs,
                                              d_ent);
        }
        err = sc.finish();
    }
    free(fill);
    free(ent);
    free(runs);
    free(tok);
    return err;
}

extern "C" int kv_sketch_query_cuda(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                                    const kv_layout *l, kv_dtype t, uint8_t *pool,
                                    const kv_segment *segs, size_t nsegs)
{
    kv_sketch copy = *sk; /* nothing is written through it: del = false */
    return query_common(&copy, h, g, l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs),
                        false);
}

extern "C" int kv_sketch_revive_cuda(kv_sketch *sk, const uint32_t *h, const int8_t *g,
                                     const kv_layout *l, kv_dtype t, uint8_t *pool,
                                     const kv_segment *segs, size_t nsegs)
{
    return query_common(sk, h, g, l, t, pool, segs, nsegs, kv_segments_tokens(segs, nsegs), true);
}

extern "C" int kv_sketch_delete_cuda(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    return query_common(sk, h, g, nullptr, KV_FP32, nullptr, nullptr, 0, n, true);
}
