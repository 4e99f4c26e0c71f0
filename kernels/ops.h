/*
 * ops.h - the memory seam: every byte kvstashd or libkvstash moves in pool
 * or staging memory goes through one table of operations, one table per
 * memory backend (Redis's ae.c: one file per backend, the same few
 * functions, nothing above knowing which one runs).
 *
 * Two kinds of memory:
 *   - device memory: a pool's arena and what ops->alloc returns (staging
 *     buffers, sketch cells). Host code never dereferences it: with the
 *     `cuda` backend it is GPU memory, with `shadow` it faults.
 *   - host memory: everything else (segment lists, hashes, merge lists,
 *     the attention's query and outputs, the worker's own K/V buffers).
 * Each operation says which of its arguments are device memory; they are
 * the arguments the kernels' `_cuda` twins take as device pointers
 * (kernels.h), except the attention's q, out and probs, which are host
 * arrays here (a step's few KiB; a device backend stages them).
 *
 * Tables:
 *   kv_ops_cpu     the CPU kernels on host memory: device memory IS host
 *                  memory (malloc'd staging, the mapped pool).
 *   kv_ops_shadow  the same kernels, but device addresses live in reserved
 *                  PROT_NONE ranges (kv_shadow_map) and are translated to
 *                  the real mapping only inside these functions, so any
 *                  code that touches device memory directly segfaults, as
 *                  it would on a GPU. For tests: it proves the host code
 *                  goes through the seam; it proves nothing about a real
 *                  device (timing, alignment, IPC, asynchrony).
 *   kv_ops_cuda    (CUDA builds, KVSTASH_HAVE_CUDA) CUDA device memory:
 *                  cudaMalloc, cudaMemcpy(2D), the kernels' `_cuda` twins;
 *                  every operation has finished on the device when it
 *                  returns. One device per process (kv_ops_cuda_set_device).
 *
 * Every operation returns 0, or -1 when the backend failed (a device
 * error, out of device memory): the CPU kernels cannot fail, a device can.
 * The shadow table aborts with a message when a device argument is not
 * device memory (a bug in the caller, never an input error). Thread-safe.
 */
#ifndef KVSTASH_OPS_H
#define KVSTASH_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which sides of a copy are device memory. */
typedef enum kv_copy_dir {
    KV_HOST_TO_DEVICE = 0,
    KV_DEVICE_TO_HOST = 1,
    KV_DEVICE_TO_DEVICE = 2
} kv_copy_dir;

typedef struct kv_ops {
    const char *name; /* "cpu", "shadow", "cuda" */
    /* 1 when device memory is host memory (cpu, shadow): a copy is a
     * memcpy, so many small ones cost what their bytes cost; on a device
     * each is a call of microseconds. */
    int host_memory;

    /* Device memory of `bytes` (> 0), uninitialised; NULL when out of
     * memory. free(NULL) does nothing. */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    /* Set n bytes of device memory to `byte`. */
    int (*fill)(void *dev, int byte, size_t n);

    /* n bytes; the sides as `dir` says. */
    int (*copy)(kv_copy_dir dir, void *dst, const void *src, size_t n);
    /* `rows` rows of `width` bytes, rows dpitch / spitch bytes apart
     * (cudaMemcpy2D). */
    int (*copy_2d)(kv_copy_dir dir, void *dst, size_t dpitch, const void *src, size_t spitch,
                   size_t width, size_t rows);

    /* kernels.h kv_gather / kv_scatter / kv_copy_tokens: pool, k and v
     * are device memory. */
    int (*gather)(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                  uint8_t *k_out, uint8_t *v_out);
    int (*scatter)(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                   const uint8_t *k_in, const uint8_t *v_in);
    int (*copy_tokens)(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                       const kv_segment *dst, size_t ndst);

    /* INT8 tier: pool and qpool device memory; qblocks host. */
    int (*int8_quantize)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                         const uint32_t *qblocks, size_t nq);
    int (*int8_dequantize)(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                           size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                           const kv_segment *dst, size_t ndst);
    /* INT4 / INT2 tiers (bits 4 or 2): as the INT8 ones. */
    int (*lowbit_quantize)(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                           const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                           const uint32_t *qblocks, size_t nq);
    int (*lowbit_dequantize)(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                             const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                             const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                             size_t ndst);

    /* Count sketch: sk->key, value, count and pool are device memory; h
     * and g host (kv_sketch_hash_list). */
    int (*sketch_insert)(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g);
    int (*sketch_query)(const kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                        kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
    int (*sketch_revive)(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                         kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
    int (*sketch_delete)(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n);

    /* RoPE re-rotation and value merges: pool device memory, delta and m host. */
    int (*rope_rerotate)(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                         size_t nsegs, const int32_t *delta, double theta, kv_rope_pairing pairing);
    int (*merge_values)(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m, size_t n);

    /* kernels.h kv_elts_diff of n elements: got and ref device memory,
     * the sums into host *d. What a tier move cost, for metrics: four
     * numbers cross to the host, not the tokens. */
    int (*diff)(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d);

    /* Decode attention over a list in the pool (device); q, out and
     * probs are host arrays. */
    int (*decode_attention)(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                            const float *q, uint32_t q_heads, float scale, float *out,
                            float *probs);
} kv_ops;

extern const kv_ops kv_ops_cpu;
extern const kv_ops kv_ops_shadow;

#ifdef KVSTASH_HAVE_CUDA
extern const kv_ops kv_ops_cuda;

/*
 * kv_ops_cuda's device: every operation selects it (cudaSetDevice) on the
 * calling thread first, since the daemon and workers call the seam from
 * threads that never selected one. Set by the owner of the arena (the
 * daemon's cuda backend, libkvstash's import) before the first call; -1
 * (the default) leaves each thread's current device. One device per
 * process. kv_ops_cuda_last_error: the last failed operation's CUDA error
 * on this thread ("" when none), for the caller's log.
 */
void kv_ops_cuda_set_device(int device);
int kv_ops_cuda_device(void);
const char *kv_ops_cuda_last_error(void);
/* Wait on the table's device for `stream` (a cudaStream_t) to finish, or
 * for the whole device when stream is NULL: 0, or -1 (the error kept as
 * above). libkvstash's side of the ordering contract (kvstash.h): what a
 * worker queued on its streams has finished before the daemon acts. */
int kv_ops_cuda_synchronize(void *stream);
#endif

/* The table named `name` ("cpu", "shadow", "cuda" in CUDA builds); NULL
 * when there is none. */
const kv_ops *kv_ops_find(const char *name);

/*
 * Shadow device addresses (kv_ops_shadow). kv_shadow_map reserves a
 * PROT_NONE range of `bytes` standing for the real host memory `real`
 * (which the caller keeps mapped) and returns its address: kv_ops_shadow
 * reads and writes `real` when given an address in that range. NULL when
 * the range cannot be reserved. kv_shadow_unmap releases the range (not
 * `real`). kv_shadow_real translates one address, NULL when it is not in
 * a shadow range: for tests.
 */
void *kv_shadow_map(void *real, size_t bytes);
void kv_shadow_unmap(void *shadow);
void *kv_shadow_real(const void *shadow);

#ifdef __cplusplus
}
#endif
#endif
