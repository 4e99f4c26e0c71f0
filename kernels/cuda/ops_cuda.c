/*
 * ops_cuda.c - kv_ops_cuda: the memory seam on CUDA device memory (ops.h).
 *
 * Device memory is cudaMalloc'd staging and sketch cells, and the pool's
 * arena (kernels/devmem.h: allocated by kvstashd, imported by workers).
 * Copies are cudaMemcpy / cudaMemcpy2D in the direction the caller names;
 * every kernel operation calls its `_cuda` twin (kernels.h), which
 * synchronises before it returns. The plain copies and fills synchronise
 * too, so that every operation is complete when it returns: the daemon
 * publishes an epoch only after its own kernels finished (issue 14's
 * ordering contract).
 *
 * Device selection. A thread that has not selected a device works on
 * device 0 (or fails with an invalid context on another thread's device,
 * LMCache #5168), and the daemon's operations run on gRPC, fd-socket and
 * ring threads alike. So the table serves one device per process, set once
 * by whoever owns the arena (the daemon's cuda backend at start, libkvstash
 * when it imports a pool) with kv_ops_cuda_set_device, and every operation
 * calls cudaSetDevice with it first (cheap when already current). Like the
 * shadow table's ranges, this is the one piece of process state in the
 * table; it decides nothing.
 *
 * Errors: an operation returns -1 and keeps the CUDA error's name and text
 * for kv_ops_cuda_last_error() (per thread), so the caller can log what the
 * device said.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "ops.h"

static atomic_int cuda_device = -1;
static _Thread_local char last_error[256];

void kv_ops_cuda_set_device(int device)
{
    atomic_store(&cuda_device, device);
}

int kv_ops_cuda_device(void)
{
    return atomic_load(&cuda_device);
}

const char *kv_ops_cuda_last_error(void)
{
    return last_error;
}

/* 0 on success; else -1 with the error kept for kv_ops_cuda_last_error. */
static int check(int err, const char *op)
{
    if (err == cudaSuccess)
        return 0;
    snprintf(last_error, sizeof last_error, "kv_ops_cuda %s: %s (%s)", op,
             cudaGetErrorName((cudaError_t)err), cudaGetErrorString((cudaError_t)err));
    return -1;
}

static int select_device(const char *op);

int kv_ops_cuda_synchronize(void *stream)
{
    if (select_device("synchronize") != 0)
        return -1;
    if (stream == NULL)
        return check(cudaDeviceSynchronize(), "synchronize");
    return check(cudaStreamSynchronize((cudaStream_t)stream), "synchronize");
}

/* Select the table's device on this thread; 0 or -1. */
static int select_device(const char *op)
{
    int device = atomic_load(&cuda_device);
    if (device < 0)
        return 0; /* not set: the thread's current device */
    return check(cudaSetDevice(device), op);
}

/* Wait for the legacy default stream, where the copies and kernels run. */
static int sync_device(int err, const char *op)
{
    cudaError_t s = cudaStreamSynchronize(0);
    return check(err != cudaSuccess ? err : (int)s, op);
}

static void *cuda_alloc(size_t bytes)
{
    void *p = NULL;
    if (select_device("alloc") != 0)
        return NULL;
    if (check(cudaMalloc(&p, bytes ? bytes : 1), "alloc") != 0)
        return NULL;
    return p;
}

static void cuda_free(void *p)
{
    if (p == NULL || select_device("free") != 0)
        return;
    check(cudaFree(p), "free");
}

static int cuda_fill(void *dev, int byte, size_t n)
{
    if (select_device("fill") != 0)
        return -1;
    if (n == 0)
        return 0;
    return sync_device(cudaMemset(dev, byte, n), "fill");
}

static enum cudaMemcpyKind kind_of(kv_copy_dir dir)
{
    return dir == KV_HOST_TO_DEVICE   ? cudaMemcpyHostToDevice
           : dir == KV_DEVICE_TO_HOST ? cudaMemcpyDeviceToHost
                                      : cudaMemcpyDeviceToDevice;
}

static int cuda_copy(kv_copy_dir dir, void *dst, const void *src, size_t n)
{
    if (select_device("copy") != 0)
        return -1;
    if (n == 0)
        return 0;
    return sync_device(cudaMemcpy(dst, src, n, kind_of(dir)), "copy");
}

static int cuda_copy_2d(kv_copy_dir dir, void *dst, size_t dpitch, const void *src, size_t spitch,
                        size_t width, size_t rows)
{
    if (select_device("copy_2d") != 0)
        return -1;
    if (width == 0 || rows == 0)
        return 0;
    if (width == dpitch && width == spitch)
        return sync_device(cudaMemcpy(dst, src, width * rows, kind_of(dir)), "copy_2d");
    cudaError_t err = cudaMemcpy2D(dst, dpitch, src, spitch, width, rows, kind_of(dir));
    if (err == cudaErrorInvalidPitchValue) {
        /* A pitch beyond the device's cudaDevAttrMaxPitch: row by row. */
        (void)cudaGetLastError();
        err = cudaSuccess;
        for (size_t r = 0; r < rows && err == cudaSuccess; r++)
            err = cudaMemcpyAsync((uint8_t *)dst + r * dpitch, (const uint8_t *)src + r * spitch,
                                  width, kind_of(dir), 0);
    }
    return sync_device(err, "copy_2d");
}

static int cuda_gather(const kv_layout *l, const uint8_t *pool, const kv_segment *segs,
                       size_t nsegs, uint8_t *k_out, uint8_t *v_out)
{
    if (select_device("gather") != 0)
        return -1;
    return check(kv_gather_cuda(l, pool, segs, nsegs, k_out, v_out), "gather");
}

static int cuda_scatter(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                        const uint8_t *k_in, const uint8_t *v_in)
{
    if (select_device("scatter") != 0)
        return -1;
    return check(kv_scatter_cuda(l, pool, segs, nsegs, k_in, v_in), "scatter");
}

static int cuda_copy_tokens(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                            const kv_segment *dst, size_t ndst)
{
    if (select_device("copy_tokens") != 0)
        return -1;
    return check(kv_copy_tokens_cuda(l, pool, src, nsrc, dst, ndst), "copy_tokens");
}

static int cuda_int8_quantize(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                              const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                              const uint32_t *qblocks, size_t nq)
{
    if (select_device("int8_quantize") != 0)
        return -1;
    return check(kv_int8_quantize_cuda(l, t, pool, segs, nsegs, qpool, qblocks, nq),
                 "int8_quantize");
}

static int cuda_lowbit_quantize(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                                const uint32_t *qblocks, size_t nq)
{
    if (select_device("lowbit_quantize") != 0)
        return -1;
    return check(kv_lowbit_quantize_cuda(l, bits, t, pool, segs, nsegs, qpool, qblocks, nq),
                 "lowbit_quantize");
}

static int cuda_lowbit_dequantize(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                                  const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                  const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                                  size_t ndst)
{
    if (select_device("lowbit_dequantize") != 0)
        return -1;
    return check(kv_lowbit_dequantize_cuda(l, bits, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst),
                 "lowbit_dequantize");
}

static int cuda_int8_dequantize(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                                size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                                const kv_segment *dst, size_t ndst)
{
    if (select_device("int8_dequantize") != 0)
        return -1;
    return check(kv_int8_dequantize_cuda(l, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst),
                 "int8_dequantize");
}

static int cuda_sketch_insert(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                              const kv_segment *segs, size_t nsegs, const uint32_t *h,
                              const int8_t *g)
{
    if (select_device("sketch_insert") != 0)
        return -1;
    return check(kv_sketch_insert_cuda(sk, l, t, pool, segs, nsegs, h, g), "sketch_insert");
}

static int cuda_sketch_query(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                             const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                             size_t nsegs)
{
    if (select_device("sketch_query") != 0)
        return -1;
    return check(kv_sketch_query_cuda(sk, h, g, l, t, pool, segs, nsegs), "sketch_query");
}

static int cuda_sketch_revive(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                              kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs)
{
    if (select_device("sketch_revive") != 0)
        return -1;
    return check(kv_sketch_revive_cuda(sk, h, g, l, t, pool, segs, nsegs), "sketch_revive");
}

static int cuda_sketch_delete(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    if (select_device("sketch_delete") != 0)
        return -1;
    return check(kv_sketch_delete_cuda(sk, h, g, n), "sketch_delete");
}

static int cuda_rope_rerotate(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                              size_t nsegs, const int32_t *delta, double theta,
                              kv_rope_pairing pairing)
{
    if (select_device("rope_rerotate") != 0)
        return -1;
    return check(kv_rope_rerotate_cuda(l, t, pool, segs, nsegs, delta, theta, pairing),
                 "rope_rerotate");
}

static int cuda_merge_values(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                             size_t n)
{
    if (select_device("merge_values") != 0)
        return -1;
    return check(kv_merge_values_cuda(l, t, pool, m, n), "merge_values");
}

static int cuda_diff(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d)
{
    if (select_device("diff") != 0)
        return -1;
    return check(kv_elts_diff_cuda(got, ref, t, n, d), "diff");
}

/* q, out and probs are host arrays here (ops.h) and device pointers for the
 * kernel: one device buffer holds the three for the call. */
static int cuda_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                 const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                                 const float *q, uint32_t q_heads, float scale, float *out,
                                 float *probs)
{
    if (select_device("decode_attention") != 0)
        return -1;
    size_t qn = (size_t)q_heads * l->head_dim;
    size_t pn = probs != NULL ? (size_t)q_heads * kv_segments_tokens(segs, nsegs) : 0;
    float *dq = NULL;
    if (check(cudaMalloc((void **)&dq, (2 * qn + pn + 1) * sizeof(float)), "decode_attention"))
        return -1;
    float *dout = dq + qn, *dprobs = probs != NULL ? dout + qn : NULL;
    int err = cudaMemcpy(dq, q, qn * sizeof(float), cudaMemcpyHostToDevice);
    if (err == cudaSuccess)
        err = kv_decode_attention_cuda(l, t, pool, segs, nsegs, tiers, dq, q_heads, scale, dout,
                                       dprobs);
    if (err == cudaSuccess)
        err = cudaMemcpy(out, dout, qn * sizeof(float), cudaMemcpyDeviceToHost);
    if (err == cudaSuccess && pn > 0)
        err = cudaMemcpy(probs, dprobs, pn * sizeof(float), cudaMemcpyDeviceToHost);
    cudaError_t ferr = cudaFree(dq);
    return check(err != cudaSuccess ? err : (int)ferr, "decode_attention");
}

const kv_ops kv_ops_cuda = {
    .name = "cuda",
    .alloc = cuda_alloc,
    .free = cuda_free,
    .fill = cuda_fill,
    .copy = cuda_copy,
    .copy_2d = cuda_copy_2d,
    .gather = cuda_gather,
    .scatter = cuda_scatter,
    .copy_tokens = cuda_copy_tokens,
    .int8_quantize = cuda_int8_quantize,
    .int8_dequantize = cuda_int8_dequantize,
    .lowbit_quantize = cuda_lowbit_quantize,
    .lowbit_dequantize = cuda_lowbit_dequantize,
    .sketch_insert = cuda_sketch_insert,
    .sketch_query = cuda_sketch_query,
    .sketch_revive = cuda_sketch_revive,
    .sketch_delete = cuda_sketch_delete,
    .rope_rerotate = cuda_rope_rerotate,
    .merge_values = cuda_merge_values,
    .diff = cuda_diff,
    .decode_attention = cuda_decode_attention,
};
