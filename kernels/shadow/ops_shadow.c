/*
 * ops_shadow.c - kv_ops_shadow: the CPU kernels behind device addresses that
 * fault on direct access (ops.h).
 *
 * A shadow range is a PROT_NONE reservation the size of a real host
 * mapping; host code holds only shadow addresses, and the operations here
 * translate them to the real memory before calling the CPU kernels. Code
 * that reads or writes pool or staging memory without the seam segfaults,
 * exactly where it would with GPU memory, on any machine, in CI.
 *
 * The ranges are one table per process, like a device's address space:
 * the one piece of global state in kernels/, and only for this test
 * backend. A mutex guards it; translation is a scan of the few live ranges
 * (pools, staging buffers in flight, sketch cells).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ops.h"

typedef struct shadow_range {
    uintptr_t shadow;
    size_t bytes;    /* as asked for */
    size_t reserved; /* rounded up to pages */
    uint8_t *real;
    int owns_real; /* allocated by shadow_alloc: freed with the range */
} shadow_range;

static pthread_mutex_t shadow_lock = PTHREAD_MUTEX_INITIALIZER;
static shadow_range *ranges;
static size_t nranges, ranges_cap;

static size_t page_round(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

static void *shadow_register(void *real, size_t bytes, int owns_real)
{
    size_t reserved = page_round(bytes ? bytes : 1);
    void *shadow =
        mmap(NULL, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (shadow == MAP_FAILED)
        return NULL;
    pthread_mutex_lock(&shadow_lock);
    if (nranges == ranges_cap) {
        size_t cap = ranges_cap ? 2 * ranges_cap : 16;
        shadow_range *r = realloc(ranges, cap * sizeof *r);
        if (r == NULL) {
            pthread_mutex_unlock(&shadow_lock);
            munmap(shadow, reserved);
            return NULL;
        }
        ranges = r;
        ranges_cap = cap;
    }
    ranges[nranges++] = (shadow_range){(uintptr_t)shadow, bytes, reserved, real, owns_real};
    pthread_mutex_unlock(&shadow_lock);
    return shadow;
}

void *kv_shadow_map(void *real, size_t bytes)
{
    return shadow_register(real, bytes, 0);
}

/* Remove the range starting at `shadow`; its real memory if owned. */
static void shadow_release(void *shadow)
{
    if (shadow == NULL)
        return;
    shadow_range gone = {0};
    pthread_mutex_lock(&shadow_lock);
    for (size_t i = 0; i < nranges; i++)
        if (ranges[i].shadow == (uintptr_t)shadow) {
            gone = ranges[i];
            ranges[i] = ranges[--nranges];
            break;
        }
    pthread_mutex_unlock(&shadow_lock);
    if (gone.shadow == 0) {
        fprintf(stderr, "kv_ops_shadow: release of %p, which is not a shadow range\n", shadow);
        abort();
    }
    munmap(shadow, gone.reserved);
    if (gone.owns_real)
        free(gone.real);
}

void kv_shadow_unmap(void *shadow)
{
    shadow_release(shadow);
}

void *kv_shadow_real(const void *shadow)
{
    uintptr_t p = (uintptr_t)shadow;
    void *real = NULL;
    pthread_mutex_lock(&shadow_lock);
    for (size_t i = 0; i < nranges; i++)
        if (p >= ranges[i].shadow && p < ranges[i].shadow + ranges[i].reserved) {
            real = ranges[i].real + (p - ranges[i].shadow);
            break;
        }
    pthread_mutex_unlock(&shadow_lock);
    return real;
}

/* The real address of a device argument; a host address there is the
 * caller's bug, as it would be with cudaMemcpy: say which and stop. */
static void *dev(const void *p, const char *op)
{
    if (p == NULL)
        return NULL;
    void *real = kv_shadow_real(p);
    if (real == NULL) {
        fprintf(stderr, "kv_ops_shadow: %s was given %p as device memory, which it is not\n", op,
                p);
        abort();
    }
    return real;
}

static void *shadow_alloc(size_t bytes)
{
    void *real = malloc(bytes ? bytes : 1);
    if (real == NULL)
        return NULL;
    void *shadow = shadow_register(real, bytes, 1);
    if (shadow == NULL)
        free(real);
    return shadow;
}

static void shadow_free(void *p)
{
    shadow_release(p);
}

static int shadow_fill(void *d, int byte, size_t n)
{
    return kv_ops_cpu.fill(dev(d, "fill"), byte, n);
}

static int shadow_copy(kv_copy_dir dir, void *dst, const void *src, size_t n)
{
    if (dir != KV_DEVICE_TO_HOST)
        dst = dev(dst, "copy");
    if (dir != KV_HOST_TO_DEVICE)
        src = dev(src, "copy");
    return kv_ops_cpu.copy(dir, dst, src, n);
}

static int shadow_copy_2d(kv_copy_dir dir, void *dst, size_t dpitch, const void *src, size_t spitch,
                          size_t width, size_t rows)
{
    if (dir != KV_DEVICE_TO_HOST)
        dst = dev(dst, "copy_2d");
    if (dir != KV_HOST_TO_DEVICE)
        src = dev(src, "copy_2d");
    return kv_ops_cpu.copy_2d(dir, dst, dpitch, src, spitch, width, rows);
}

static int shadow_gather(const kv_layout *l, const uint8_t *pool, const kv_segment *segs,
                         size_t nsegs, uint8_t *k_out, uint8_t *v_out)
{
    return kv_ops_cpu.gather(l, dev(pool, "gather"), segs, nsegs, dev(k_out, "gather"),
                             dev(v_out, "gather"));
}

static int shadow_scatter(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                          const uint8_t *k_in, const uint8_t *v_in)
{
    return kv_ops_cpu.scatter(l, dev(pool, "scatter"), segs, nsegs, dev(k_in, "scatter"),
                              dev(v_in, "scatter"));
}

static int shadow_copy_tokens(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                              const kv_segment *dst, size_t ndst)
{
    return kv_ops_cpu.copy_tokens(l, dev(pool, "copy_tokens"), src, nsrc, dst, ndst);
}

static int shadow_int8_quantize(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                                const uint32_t *qblocks, size_t nq)
{
    return kv_ops_cpu.int8_quantize(l, t, dev(pool, "int8_quantize"), segs, nsegs,
                                    dev(qpool, "int8_quantize"), qblocks, nq);
}

static int shadow_lowbit_quantize(const kv_layout *l, uint32_t bits, kv_dtype t,
                                  const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                                  uint8_t *qpool, const uint32_t *qblocks, size_t nq)
{
    return kv_ops_cpu.lowbit_quantize(l, bits, t, dev(pool, "lowbit_quantize"), segs, nsegs,
                                      dev(qpool, "lowbit_quantize"), qblocks, nq);
}

static int shadow_lowbit_dequantize(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                                    const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                    const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                                    size_t ndst)
{
    return kv_ops_cpu.lowbit_dequantize(l, bits, dev(qpool, "lowbit_dequantize"), qsegs, nqsegs, t,
                                        dl, dev(pool, "lowbit_dequantize"), dst, ndst);
}

static int shadow_int8_dequantize(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                                  size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                                  const kv_segment *dst, size_t ndst)
{
    return kv_ops_cpu.int8_dequantize(l, dev(qpool, "int8_dequantize"), qsegs, nqsegs, t, dl,
                                      dev(pool, "int8_dequantize"), dst, ndst);
}

/* The sketch with its cells translated. */
static kv_sketch real_sketch(const kv_sketch *sk, const char *op)
{
    kv_sketch r = *sk;
    r.key = dev(sk->key, op);
    r.value = dev(sk->value, op);
    r.count = dev(sk->count, op);
    return r;
}

static int shadow_sketch_insert(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, const uint32_t *h,
                                const int8_t *g)
{
    kv_sketch r = real_sketch(sk, "sketch_insert");
    return kv_ops_cpu.sketch_insert(&r, l, t, dev(pool, "sketch_insert"), segs, nsegs, h, g);
}

static int shadow_sketch_query(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                               const kv_layout *l, kv_dtype t, uint8_t *pool,
                               const kv_segment *segs, size_t nsegs)
{
    kv_sketch r = real_sketch(sk, "sketch_query");
    return kv_ops_cpu.sketch_query(&r, h, g, l, t, dev(pool, "sketch_query"), segs, nsegs);
}

static int shadow_sketch_revive(kv_sketch *sk, const uint32_t *h, const int8_t *g,
                                const kv_layout *l, kv_dtype t, uint8_t *pool,
                                const kv_segment *segs, size_t nsegs)
{
    kv_sketch r = real_sketch(sk, "sketch_revive");
    return kv_ops_cpu.sketch_revive(&r, h, g, l, t, dev(pool, "sketch_revive"), segs, nsegs);
}

static int shadow_sketch_delete(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    kv_sketch r = real_sketch(sk, "sketch_delete");
    return kv_ops_cpu.sketch_delete(&r, h, g, n);
}

static int shadow_rope_rerotate(const kv_layout *l, kv_dtype t, uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, const int32_t *delta,
                                double theta, kv_rope_pairing pairing)
{
    return kv_ops_cpu.rope_rerotate(l, t, dev(pool, "rope_rerotate"), segs, nsegs, delta, theta,
                                    pairing);
}

static int shadow_merge_values(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                               size_t n)
{
    return kv_ops_cpu.merge_values(l, t, dev(pool, "merge_values"), m, n);
}

static int shadow_diff(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d)
{
    return kv_ops_cpu.diff(dev(got, "diff"), dev(ref, "diff"), t, n, d);
}

static int shadow_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                   const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                                   const float *q, uint32_t q_heads, float scale, float *out,
                                   float *probs)
{
    return kv_ops_cpu.decode_attention(l, t, dev(pool, "decode_attention"), segs, nsegs, tiers, q,
                                       q_heads, scale, out, probs);
}

const kv_ops kv_ops_shadow = {
    .name = "shadow",
    .host_memory = 1,
    .alloc = shadow_alloc,
    .free = shadow_free,
    .fill = shadow_fill,
    .copy = shadow_copy,
    .copy_2d = shadow_copy_2d,
    .gather = shadow_gather,
    .scatter = shadow_scatter,
    .copy_tokens = shadow_copy_tokens,
    .int8_quantize = shadow_int8_quantize,
    .int8_dequantize = shadow_int8_dequantize,
    .lowbit_quantize = shadow_lowbit_quantize,
    .lowbit_dequantize = shadow_lowbit_dequantize,
    .sketch_insert = shadow_sketch_insert,
    .sketch_query = shadow_sketch_query,
    .sketch_revive = shadow_sketch_revive,
    .sketch_delete = shadow_sketch_delete,
    .rope_rerotate = shadow_rope_rerotate,
    .merge_values = shadow_merge_values,
    .diff = shadow_diff,
    .decode_attention = shadow_decode_attention,
};
