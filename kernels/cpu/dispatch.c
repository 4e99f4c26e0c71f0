/*
 * dispatch.c - the kernels.h names of the fast CPU kernels, each picking
 * the generic or the AVX2 + F16C build of its file (isa.h; the attention's
 * also needs FMA). Off x86-64 the
 * second build is compiled without extra flags and never picked.
 */
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "kernels.h"

#if defined(KVSTASH_HAVE_AVX2_BUILD) && defined(__x86_64__)
#include <cpuid.h>
#include <stdatomic.h>

/* CPUID leaf 1, ECX: clang 14's __builtin_cpu_supports knows no "f16c" (the
 * fuzz build, tests/fuzz, is clang's), and this reads the same bit in both
 * compilers. */
static int cpu_has_f16c(void)
{
    /* Asked at every kernel call, and CPUID traps to the hypervisor in a VM
     * (6 us a call measured, most of an operator offload's time): read it
     * once. Racing first calls store the same answer. */
    static _Atomic int known = -1;
    int has = atomic_load_explicit(&known, memory_order_relaxed);
    if (has < 0) {
        unsigned a, b, c, d;
        has = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
        atomic_store_explicit(&known, has, memory_order_relaxed);
    }
    return has;
}
#endif

int kv_isa_avx2(void)
{
#if defined(KVSTASH_HAVE_AVX2_BUILD) && defined(__x86_64__)
    const char *env = getenv("KVSTASH_KERNEL_ISA");
    if (env != NULL && strcmp(env, "generic") == 0)
        return 0;
    return __builtin_cpu_supports("avx2") && cpu_has_f16c();
#else
    return 0;
#endif
}

int kv_isa_avx512(void)
{
#if defined(KVSTASH_HAVE_AVX2_BUILD) && defined(__x86_64__)
    const char *env = getenv("KVSTASH_KERNEL_ISA");
    if (env != NULL && strcmp(env, "avx2") == 0)
        return 0;
    return kv_isa_avx2() && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

int kv_isa_avx2_fma(void)
{
#if defined(KVSTASH_HAVE_AVX2_BUILD) && defined(__x86_64__)
    return kv_isa_avx2() && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

const char *kv_kernel_isa(void)
{
    if (kv_isa_avx512())
        return "avx2+f16c+avx512f";
    return kv_isa_avx2() ? "avx2+f16c" : "generic";
}

#define PICK(name) (kv_isa_avx2() ? name##_avx2 : name##_generic)

void kv_int8_quantize(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                      size_t nsegs, uint8_t *qpool, const uint32_t *qblocks, size_t nq)
{
    PICK(kv_int8_quantize)(l, t, pool, segs, nsegs, qpool, qblocks, nq);
}

void kv_int8_dequantize(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                        size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                        const kv_segment *dst, size_t ndst)
{
    PICK(kv_int8_dequantize)(l, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst);
}

void kv_lowbit_quantize(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                        const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                        const uint32_t *qblocks, size_t nq)
{
    PICK(kv_lowbit_quantize)(l, bits, t, pool, segs, nsegs, qpool, qblocks, nq);
}

void kv_lowbit_dequantize(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                          const kv_segment *qsegs, size_t nqsegs, kv_dtype t, const kv_layout *dl,
                          uint8_t *pool, const kv_segment *dst, size_t ndst)
{
    PICK(kv_lowbit_dequantize)(l, bits, qpool, qsegs, nqsegs, t, dl, pool, dst, ndst);
}

void kv_sketch_insert(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                      const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g)
{
    PICK(kv_sketch_insert)(sk, l, t, pool, segs, nsegs, h, g);
}

void kv_sketch_query(const kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                     kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs)
{
    PICK(kv_sketch_query)(sk, h, g, l, t, pool, segs, nsegs);
}

void kv_sketch_revive(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                      kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs)
{
    PICK(kv_sketch_revive)(sk, h, g, l, t, pool, segs, nsegs);
}

void kv_sketch_delete(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n)
{
    PICK(kv_sketch_delete)(sk, h, g, n);
}

void kv_rope_rerotate(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                      size_t nsegs, const int32_t *delta, double theta, kv_rope_pairing pairing)
{
    PICK(kv_rope_rerotate)(l, t, pool, segs, nsegs, delta, theta, pairing);
}

void kv_vnorm_l1(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                 size_t nsegs, const float *wo, size_t wo_stride, uint32_t q_heads, uint32_t hidden,
                 float *out)
{
    PICK(kv_vnorm_l1)(l, t, pool, segs, nsegs, wo, wo_stride, q_heads, hidden, out);
}

void kv_merge_values(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m, size_t n)
{
    PICK(kv_merge_values)(l, t, pool, m, n);
}

void kv_elts_diff(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d)
{
    PICK(kv_elts_diff)(got, ref, t, n, d);
}

void kv_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, const uint8_t *tiers, const float *q,
                         uint32_t q_heads, float scale, float *out, float *probs)
{
    /* the attention's AVX2 build uses FMA as well (isa.h) */
    (kv_isa_avx2_fma() ? kv_decode_attention_avx2 : kv_decode_attention_generic)(
        l, t, pool, segs, nsegs, tiers, q, q_heads, scale, out, probs);
}
