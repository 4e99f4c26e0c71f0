/*
 * ops_cpu.c - the memory seam on host memory: kv_ops_cpu, the fast CPU
 * kernels with device memory = host memory (ops.h).
 */
#include <stdlib.h>
#include <string.h>

#include "ops.h"

static void *cpu_alloc(size_t bytes)
{
    return malloc(bytes ? bytes : 1);
}

static void cpu_free(void *p)
{
    free(p);
}

static int cpu_fill(void *dev, int byte, size_t n)
{
    memset(dev, byte, n);
    return 0;
}

static int cpu_copy(kv_copy_dir dir, void *dst, const void *src, size_t n)
{
    (void)dir;
    if (n > 0)
        memcpy(dst, src, n);
    return 0;
}

static int cpu_copy_2d(kv_copy_dir dir, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t rows)
{
    (void)dir;
    uint8_t *d = dst;
    const uint8_t *s = src;
    if (width == dpitch && width == spitch)
        return cpu_copy(dir, dst, src, width * rows);
    for (size_t r = 0; r < rows; r++)
        memcpy(d + r * dpitch, s + r * spitch, width);
    return 0;
}

static int cpu_gather(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                      uint8_t *k_out, uint8_t *v_out)
{
    kv_gather(l, pool, segs, nsegs, k_out, v_out);
    return 0;
}

static int cpu_scatter(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                       const uint8_t *k_in, const uint8_t *v_in)
{
    kv_scatter(l, pool, segs, nsegs, k_in, v_in);
    return 0;
}

static int cpu_copy_tokens(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                           const kv_segment *dst, size_t ndst)
{
    kv_copy_tokens(l, pool, src, nsrc, dst, ndst);
    return 0;
}

static int cpu_int8_quantize(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                             const uint32_t *qblocks, size_t nq)
{
    kv_int8_quantize(l, t, pool, segs, nsegs, qpool, qblocks, nq);
    return 0;
}

static int cpu_lowbit_quantize(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                               const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                               const uint32_t *qblocks, size_t nq)
{
    kv_lowbit_quantize(l, bits, t, pool, segs, nsegs, qpool, qblocks, nq);
    return 0;
}

static int cpu_lowbit_dequantize(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                                 const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                                 const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                                 size_t ndst)
{
    kv_lowbit_dequantize(l, bits, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst);
    return 0;
}

static int cpu_int8_dequantize(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                               size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                               const kv_segment *dst, size_t ndst)
{
    kv_int8_dequantize(l, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst);
    return 0;
}

static int cpu_sketch_insert(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const uint32_t *h,
                             const int8_t *g)
{
    kv_sketch_insert(sk, l, t, pool, segs, nsegs, h, g);
    return 0;
}

static int cpu_sketch_query(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                            const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                            size_t nsegs)
{
    kv_sketch_query(sk, h, g, l, t, pool, segs, nsegs);
    return 0;
}

static int cpu_sketch_revive(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                             kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs)
{
    kv_sketch_revive(sk, h, g, l, t, pool, segs, nsegs);
    return 0;
}

static int cpu_sketch_delete(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    kv_sketch_delete(sk, h, g, n);
    return 0;
}

static int cpu_rope_rerotate(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                             size_t nsegs, const int32_t *delta, double theta,
                             kv_rope_pairing pairing)
{
    kv_rope_rerotate(l, t, pool, segs, nsegs, delta, theta, pairing);
    return 0;
}

static int cpu_merge_values(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                            size_t n)
{
    kv_merge_values(l, t, pool, m, n);
    return 0;
}

static int cpu_diff(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d)
{
    kv_elts_diff(got, ref, t, n, d);
    return 0;
}

static int cpu_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                                const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                                const float *q, uint32_t q_heads, float scale, float *out,
                                float *probs)
{
    kv_decode_attention(l, t, pool, segs, nsegs, tiers, q, q_heads, scale, out, probs);
    return 0;
}

const kv_ops kv_ops_cpu = {
    .name = "cpu",
    .host_memory = 1,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .fill = cpu_fill,
    .copy = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .gather = cpu_gather,
    .scatter = cpu_scatter,
    .copy_tokens = cpu_copy_tokens,
    .int8_quantize = cpu_int8_quantize,
    .int8_dequantize = cpu_int8_dequantize,
    .lowbit_quantize = cpu_lowbit_quantize,
    .lowbit_dequantize = cpu_lowbit_dequantize,
    .sketch_insert = cpu_sketch_insert,
    .sketch_query = cpu_sketch_query,
    .sketch_revive = cpu_sketch_revive,
    .sketch_delete = cpu_sketch_delete,
    .rope_rerotate = cpu_rope_rerotate,
    .merge_values = cpu_merge_values,
    .diff = cpu_diff,
    .decode_attention = cpu_decode_attention,
};

const kv_ops *kv_ops_find(const char *name)
{
    static const kv_ops *const tables[] = {&kv_ops_cpu, &kv_ops_shadow,
#ifdef KVSTASH_HAVE_CUDA
                                           &kv_ops_cuda
#endif
    };
    for (size_t i = 0; i < sizeof tables / sizeof *tables; i++)
        if (strcmp(tables[i]->name, name) == 0)
            return tables[i];
    return NULL;
}
