/*
 * test_gpu_kernels.c - the CUDA kernels against the CPU reference, then their
 * bandwidth against cudaMemcpy device-to-device.
 *
 * Plain C + the CUDA runtime API (no cmocka: the GPU machine has no package
 * registry; C-STACK.md "The GPU machine"). Seeded, so a failure reproduces.
 * With no usable device it prints "SKIP: no CUDA device (reason)" and exits 0
 * (ctest shows it as skipped). Exit 1 on any mismatch or CUDA error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "kernels.h"

/* ---- small helpers ---- */

static int g_failures;

#define CHECK_CUDA(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (cudaError_t)(call);                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "FAIL: %s:%d %s: %s\n", __FILE__, __LINE__, #call,                     \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "FAIL: out of host memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* splitmix64: deterministic, tiny. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rng_below(uint64_t *s, uint32_t n)
{
    return (uint32_t)(rng_next(s) % n);
}

static void fill_random(uint64_t *s, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(s);
}

static size_t row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

static size_t flat_bytes(const kv_layout *l, size_t ntokens)
{
    return (size_t)l->kv_heads * ntokens * row_bytes(l);
}

/* ---- segment lists (as tests/unit/test_kernels.c) ---- */

/* Cut blocks [lo, hi) into disjoint runs (mode 0 whole blocks, 1 single
 * tokens, 2 random cuts) and shuffle them. Returns the number of runs. */
static size_t cut_blocks(uint64_t *s, const kv_layout *l, uint32_t lo, uint32_t hi, int mode,
                         kv_segment *segs)
{
    size_t n = 0;
    for (uint32_t b = lo; b < hi; b++) {
        uint32_t start = 0;
        for (uint32_t t = 1; t <= l->block_tokens; t++) {
            if (t == l->block_tokens || mode == 1 || (mode == 2 && rng_below(s, 3) == 0)) {
                segs[n++] = (kv_segment){b, start, t - start};
                start = t;
            }
        }
    }
    for (size_t i = n; i > 1; i--) {
        size_t j = rng_below(s, (uint32_t)i);
        kv_segment tmp = segs[i - 1];
        segs[i - 1] = segs[j];
        segs[j] = tmp;
    }
    return n;
}

/* A random non-empty prefix of the shuffled runs of blocks [lo, hi). */
static size_t gen_disjoint(uint64_t *s, const kv_layout *l, uint32_t lo, uint32_t hi,
                           kv_segment *segs)
{
    size_t n = cut_blocks(s, l, lo, hi, (int)rng_below(s, 3), segs);
    return 1 + rng_below(s, (uint32_t)n);
}

/* Runs of blocks [lo, hi) naming exactly ntokens tokens. */
static size_t gen_exact(uint64_t *s, const kv_layout *l, uint32_t lo, uint32_t hi, size_t ntokens,
                        kv_segment *segs)
{
    size_t n = cut_blocks(s, l, lo, hi, (int)rng_below(s, 3), segs), have = 0, i = 0;
    for (; i < n && have < ntokens; i++) {
        if (segs[i].count > ntokens - have)
            segs[i].count = (uint32_t)(ntokens - have);
        have += segs[i].count;
    }
    return i;
}

/* ---- correctness: each CUDA kernel == the reference, byte for byte ---- */

#define N_BLOCKS 8u

/* Host and device copies of a pool and two flat buffers; device pointers are
 * offset by `skew` bytes from the allocation to exercise narrow chunks. */
typedef struct bufs {
    kv_layout l;
    size_t pool_bytes, flat_bytes, skew;
    uint8_t *h_pool, *h_pool2, *h_k, *h_v, *h_k2, *h_v2;
    uint8_t *d_pool_alloc, *d_k_alloc, *d_v_alloc;
    uint8_t *d_pool, *d_k, *d_v;
    kv_segment *segs, *segs2;
} bufs;

static void bufs_init(bufs *b, kv_layout l, size_t skew)
{
    b->l = l;
    b->skew = skew;
    b->pool_bytes = N_BLOCKS * kv_block_bytes(&l);
    b->flat_bytes = flat_bytes(&l, (size_t)N_BLOCKS * l.block_tokens);
    b->h_pool = xmalloc(b->pool_bytes);
    b->h_pool2 = xmalloc(b->pool_bytes);
    b->h_k = xmalloc(b->flat_bytes);
    b->h_v = xmalloc(b->flat_bytes);
    b->h_k2 = xmalloc(b->flat_bytes);
    b->h_v2 = xmalloc(b->flat_bytes);
    b->segs = xmalloc(N_BLOCKS * l.block_tokens * sizeof(kv_segment));
    b->segs2 = xmalloc(N_BLOCKS * l.block_tokens * sizeof(kv_segment));
    CHECK_CUDA(cudaMalloc((void **)&b->d_pool_alloc, b->pool_bytes + skew));
    CHECK_CUDA(cudaMalloc((void **)&b->d_k_alloc, b->flat_bytes + skew));
    CHECK_CUDA(cudaMalloc((void **)&b->d_v_alloc, b->flat_bytes + skew));
    b->d_pool = b->d_pool_alloc + skew;
    b->d_k = b->d_k_alloc + skew;
    b->d_v = b->d_v_alloc + skew;
}

static void bufs_free(bufs *b)
{
    free(b->h_pool);
    free(b->h_pool2);
    free(b->h_k);
    free(b->h_v);
    free(b->h_k2);
    free(b->h_v2);
    free(b->segs);
    free(b->segs2);
    CHECK_CUDA(cudaFree(b->d_pool_alloc));
    CHECK_CUDA(cudaFree(b->d_k_alloc));
    CHECK_CUDA(cudaFree(b->d_v_alloc));
}

static void h2d(uint8_t *d, const uint8_t *h, size_t n)
{
    CHECK_CUDA(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
}

static void d2h(uint8_t *h, const uint8_t *d, size_t n)
{
    CHECK_CUDA(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

/* Report (once per call) the first byte where a and b differ. */
static void expect_same(const uint8_t *a, const uint8_t *b, size_t n, const bufs *x,
                        const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (a[i] != b[i]) {
            fprintf(stderr,
                    "FAIL: %s: byte %zu of %zu differs, heads=%u block_tokens=%u head_dim=%u "
                    "elt=%u skew=%zu\n",
                    what, i, n, x->l.kv_heads, x->l.block_tokens, x->l.head_dim, x->l.elt_size,
                    x->skew);
            g_failures++;
            return;
        }
    }
}

static void check_gather(bufs *b, uint64_t *s)
{
    size_t n = gen_disjoint(s, &b->l, 0, N_BLOCKS, b->segs);
    fill_random(s, b->h_pool, b->pool_bytes);
    fill_random(s, b->h_k, b->flat_bytes); /* junk: untouched bytes must stay */
    memcpy(b->h_v, b->h_k, b->flat_bytes);
    h2d(b->d_pool, b->h_pool, b->pool_bytes);
    h2d(b->d_k, b->h_k, b->flat_bytes);
    h2d(b->d_v, b->h_v, b->flat_bytes);
    CHECK_CUDA(kv_gather_cuda(&b->l, b->d_pool, b->segs, n, b->d_k, b->d_v));
    kv_gather_ref(&b->l, b->h_pool, b->segs, n, b->h_k, b->h_v);
    d2h(b->h_k2, b->d_k, b->flat_bytes);
    d2h(b->h_v2, b->d_v, b->flat_bytes);
    expect_same(b->h_k, b->h_k2, b->flat_bytes, b, "gather K");
    expect_same(b->h_v, b->h_v2, b->flat_bytes, b, "gather V");
}

static void check_scatter(bufs *b, uint64_t *s)
{
    /* Disjoint slots only: overlapping writes race between thread blocks. */
    size_t n = gen_disjoint(s, &b->l, 0, N_BLOCKS, b->segs);
    fill_random(s, b->h_pool, b->pool_bytes);
    fill_random(s, b->h_k, b->flat_bytes);
    fill_random(s, b->h_v, b->flat_bytes);
    h2d(b->d_pool, b->h_pool, b->pool_bytes);
    h2d(b->d_k, b->h_k, b->flat_bytes);
    h2d(b->d_v, b->h_v, b->flat_bytes);
    CHECK_CUDA(kv_scatter_cuda(&b->l, b->d_pool, b->segs, n, b->d_k, b->d_v));
    kv_scatter_ref(&b->l, b->h_pool, b->segs, n, b->h_k, b->h_v);
    d2h(b->h_pool2, b->d_pool, b->pool_bytes);
    expect_same(b->h_pool, b->h_pool2, b->pool_bytes, b, "scatter pool");
}

static void check_copy(bufs *b, uint64_t *s)
{
    /* Sources in the first half, destinations in fresh blocks of the second. */
    size_t nsrc = gen_disjoint(s, &b->l, 0, N_BLOCKS / 2, b->segs);
    size_t ntok = kv_segments_tokens(b->segs, nsrc);
    size_t ndst = gen_exact(s, &b->l, N_BLOCKS / 2, N_BLOCKS, ntok, b->segs2);
    fill_random(s, b->h_pool, b->pool_bytes);
    h2d(b->d_pool, b->h_pool, b->pool_bytes);
    CHECK_CUDA(kv_copy_tokens_cuda(&b->l, b->d_pool, b->segs, nsrc, b->segs2, ndst));
    kv_copy_tokens_ref(&b->l, b->h_pool, b->segs, nsrc, b->segs2, ndst);
    d2h(b->h_pool2, b->d_pool, b->pool_bytes);
    expect_same(b->h_pool, b->h_pool2, b->pool_bytes, b, "copy_tokens pool");
}

static const uint32_t k_head_dims[] = {1, 3, 17, 64, 80, 128};
static const uint32_t k_block_tokens[] = {1, 3, 16};
static const uint32_t k_heads[] = {1, 5, 8};
static const uint32_t k_elts[] = {2, 4};
static const size_t k_skews[] = {0, 2, 4, 8}; /* 16-, 2-, 4- and 8-byte chunks */
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

static void check_all(void)
{
    uint64_t s = 42;
    int cases = 0;
    for (size_t a = 0; a < N_OF(k_head_dims); a++)
        for (size_t b = 0; b < N_OF(k_block_tokens); b++)
            for (size_t c = 0; c < N_OF(k_heads); c++)
                for (size_t d = 0; d < N_OF(k_elts); d++)
                    for (size_t e = 0; e < N_OF(k_skews); e++) {
                        kv_layout l = {k_heads[c], k_block_tokens[b], k_head_dims[a], k_elts[d], 0};
                        bufs x;
                        bufs_init(&x, l, k_skews[e]);
                        for (int t = 0; t < 3; t++, cases += 3) {
                            check_gather(&x, &s);
                            check_scatter(&x, &s);
                            check_copy(&x, &s);
                        }
                        bufs_free(&x);
                    }
    printf("correctness: %d kernel calls checked against the reference, %d failures\n", cases,
           g_failures);
}

/* ---- bandwidth: each kernel vs cudaMemcpy D2D of the same bytes ---- */

#define BENCH_ITERS 20

/* Median of BENCH_ITERS timings, in seconds, of fn(arg). */
typedef void (*bench_fn)(void *arg);

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double time_median(bench_fn fn, void *arg)
{
    float ms[BENCH_ITERS];
    cudaEvent_t t0, t1;
    CHECK_CUDA(cudaEventCreate(&t0));
    CHECK_CUDA(cudaEventCreate(&t1));
    fn(arg); /* warm-up: first launch, allocator pools */
    for (int i = 0; i < BENCH_ITERS; i++) {
        CHECK_CUDA(cudaEventRecord(t0, 0));
        fn(arg);
        CHECK_CUDA(cudaEventRecord(t1, 0));
        CHECK_CUDA(cudaEventSynchronize(t1));
        CHECK_CUDA(cudaEventElapsedTime(&ms[i], t0, t1));
    }
    CHECK_CUDA(cudaEventDestroy(t0));
    CHECK_CUDA(cudaEventDestroy(t1));
    qsort(ms, BENCH_ITERS, sizeof(float), cmp_float);
    return ms[BENCH_ITERS / 2] / 1e3;
}

typedef struct bench_ctx {
    kv_layout l;
    uint8_t *pool, *k, *v;
    kv_segment *segs, *segs2;
    size_t nsegs, nsegs2, moved; /* moved: bytes copied per call (K + V) */
} bench_ctx;

static void run_gather(void *p)
{
    bench_ctx *c = p;
    CHECK_CUDA(kv_gather_cuda(&c->l, c->pool, c->segs, c->nsegs, c->k, c->v));
}

static void run_scatter(void *p)
{
    bench_ctx *c = p;
    CHECK_CUDA(kv_scatter_cuda(&c->l, c->pool, c->segs, c->nsegs, c->k, c->v));
}

static void run_copy(void *p)
{
    bench_ctx *c = p;
    CHECK_CUDA(kv_copy_tokens_cuda(&c->l, c->pool, c->segs, c->nsegs, c->segs2, c->nsegs2));
}

/* The baseline: one D2D cudaMemcpy of the bytes a kernel call moves. */
static void run_memcpy(void *p)
{
    bench_ctx *c = p;
    CHECK_CUDA(cudaMemcpy(c->k, c->pool, c->moved, cudaMemcpyDeviceToDevice));
}

static void report(const char *name, bench_ctx *c, bench_fn fn, double t_memcpy)
{
    double t = time_median(fn, c);
    /* bytes read + written = 2 * moved, for the kernel and the memcpy alike */
    double bw = 2.0 * (double)c->moved / t, bw_m = 2.0 * (double)c->moved / t_memcpy;
    printf("bench op=%s segments=%zu bytes_moved=%zu time_us=%.1f rw_GBps=%.1f "
           "memcpy_rw_GBps=%.1f ratio=%.3f\n",
           name, c->nsegs, c->moved, t * 1e6, bw / 1e9, bw_m / 1e9, t_memcpy / t);
}

/* A Llama-like layer: 8 KV heads x 128 dims fp16, 16-token blocks (64 KiB a
 * block); the pool has 4096 blocks (256 MiB) and each call moves half of it. */
static void bench_all(void)
{
    uint64_t s = 7;
    bench_ctx c = {.l = {8, 16, 128, 2}};
    uint32_t nblocks = 4096;
    size_t pool_bytes = nblocks * kv_block_bytes(&c.l);
    c.segs = xmalloc(nblocks * c.l.block_tokens * sizeof(kv_segment));
    c.segs2 = xmalloc(nblocks * c.l.block_tokens * sizeof(kv_segment));
    CHECK_CUDA(cudaMalloc((void **)&c.pool, pool_bytes));
    /* A block of slack: random runs may overshoot half the pool by one. */
    size_t out_bytes = pool_bytes / 2 + kv_block_bytes(&c.l);
    CHECK_CUDA(cudaMalloc((void **)&c.k, out_bytes));
    CHECK_CUDA(cudaMalloc((void **)&c.v, out_bytes));
    CHECK_CUDA(cudaMemset(c.pool, 0x5a, pool_bytes));

    for (int mode = 0; mode <= 2; mode += 2) { /* whole blocks, then random cuts */
        const char *tag = mode == 0 ? "whole_blocks" : "random_runs";
        size_t n = cut_blocks(&s, &c.l, 0, nblocks, mode, c.segs);
        /* Half the pool's tokens, in shuffled order, for gather/scatter. */
        size_t want = (size_t)nblocks * c.l.block_tokens / 2, have = 0;
        for (c.nsegs = 0; c.nsegs < n && have < want; c.nsegs++)
            have += c.segs[c.nsegs].count;
        c.moved = 2 * flat_bytes(&c.l, have);
        double t_memcpy = time_median(run_memcpy, &c);
        char name[64];
        snprintf(name, sizeof name, "gather/%s", tag);
        report(name, &c, run_gather, t_memcpy);
        snprintf(name, sizeof name, "scatter/%s", tag);
        report(name, &c, run_scatter, t_memcpy);

        /* copy_tokens: all of the first half of the pool into fresh blocks
         * of the second, cut the same way (so the token counts match). */
        c.nsegs = cut_blocks(&s, &c.l, 0, nblocks / 2, mode, c.segs);
        c.nsegs2 = cut_blocks(&s, &c.l, nblocks / 2, nblocks, mode, c.segs2);
        c.moved = 2 * flat_bytes(&c.l, kv_segments_tokens(c.segs, c.nsegs));
        t_memcpy = time_median(run_memcpy, &c);
        snprintf(name, sizeof name, "copy_tokens/%s", tag);
        report(name, &c, run_copy, t_memcpy);
    }
    CHECK_CUDA(cudaFree(c.pool));
    CHECK_CUDA(cudaFree(c.k));
    CHECK_CUDA(cudaFree(c.v));
    free(c.segs);
    free(c.segs2);
}

int main(void)
{
    int ndev = 0;
    cudaError_t err = cudaGetDeviceCount(&ndev);
    if (err != cudaSuccess) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(err));
        return 0;
    }
    if (ndev == 0) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount found 0 devices)\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %zu MiB)\n", prop.name, prop.major, prop.minor,
           prop.totalGlobalMem >> 20);

    check_all();
    if (g_failures) {
        printf("FAIL: %d mismatches\n", g_failures);
        return 1;
    }
    bench_all();
    return 0;
}
