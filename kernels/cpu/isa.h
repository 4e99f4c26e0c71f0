/*
 * isa.h - one source, two instruction sets (internal to kernels/cpu).
 *
 * Each fast kernel file is compiled twice on x86-64: as is (the baseline
 * ISA) and with -mavx2 -mf16c, where KV_ISA_AVX2 is defined (kernels/
 * CMakeLists.txt generates the second translation unit). KV_FAST(name)
 * gives the public function of that build its suffix, and dispatch.c defines
 * the unsuffixed kernels.h function, which picks the AVX2 build when the CPU
 * has AVX2 and F16C and KVSTASH_KERNEL_ISA is not "generic" (the tests run
 * every build the CPU has: test_kernels_harness.h run_each_isa). Both builds
 * do the same IEEE operations in the same order per element (ISO C: no
 * contraction into FMA), so their results are identical; only the vector
 * width and the fp16 conversions differ. A loop of the AVX2 build whose time
 * is instructions may have an AVX-512 twin in the same file (a function with
 * target("avx512f"), taken when kv_isa_avx512(); KVSTASH_KERNEL_ISA=avx2
 * leaves it out), with the same bytes again. The attention (attention.c) is
 * the one kernel with fused multiply-adds: its AVX2 build is also compiled
 * with -mfma and taken only when the CPU has FMA, while its generic build
 * multiplies and adds separately (fmaf would be a libm call on x86-64): the
 * attention's two builds agree within its tolerance (kernels.h), not bit for
 * bit.
 */
#ifndef KVSTASH_KERNELS_ISA_H
#define KVSTASH_KERNELS_ISA_H

#include "kernels.h"

#ifdef KV_ISA_AVX2
#define KV_FAST(name) name##_avx2
#else
#define KV_FAST(name) name##_generic
#endif

/* Declarations of one build's kernels (ISA = generic or avx2). */
#define KV_DECLARE_FAST(ISA)                                                                       \
    void kv_int8_quantize_##ISA(const kv_layout *l, kv_dtype t, const uint8_t *pool,               \
                                const kv_segment *segs, size_t nsegs, uint8_t *qpool,              \
                                const uint32_t *qblocks, size_t nq);                               \
    void kv_int8_dequantize_##ISA(                                                                 \
        const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs, size_t nqsegs,          \
        kv_dtype t, const kv_layout *dl, uint8_t *pool, const kv_segment *dst, size_t ndst);       \
    void kv_lowbit_quantize_##ISA(const kv_layout *l, uint32_t bits, kv_dtype t,                   \
                                  const uint8_t *pool, const kv_segment *segs, size_t nsegs,       \
                                  uint8_t *qpool, const uint32_t *qblocks, size_t nq);             \
    void kv_lowbit_dequantize_##ISA(const kv_layout *l, uint32_t bits, const uint8_t *qpool,       \
                                    const kv_segment *qsegs, size_t nqsegs, kv_dtype t,            \
                                    const kv_layout *dl, uint8_t *pool, const kv_segment *dst,     \
                                    size_t ndst);                                                  \
    void kv_sketch_insert_##ISA(kv_sketch *sk, const kv_layout *l, kv_dtype t,                     \
                                const uint8_t *pool, const kv_segment *segs, size_t nsegs,         \
                                const uint32_t *h, const int8_t *g);                               \
    void kv_sketch_query_##ISA(const kv_sketch *sk, const uint32_t *h, const int8_t *g,            \
                               const kv_layout *l, kv_dtype t, uint8_t *pool,                      \
                               const kv_segment *segs, size_t nsegs);                              \
    void kv_sketch_revive_##ISA(kv_sketch *sk, const uint32_t *h, const int8_t *g,                 \
                                const kv_layout *l, kv_dtype t, uint8_t *pool,                     \
                                const kv_segment *segs, size_t nsegs);                             \
    void kv_sketch_delete_##ISA(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n);      \
    void kv_rope_rerotate_##ISA(const kv_layout *l, kv_dtype t, uint8_t *pool,                     \
                                const kv_segment *segs, size_t nsegs, const int32_t *delta,        \
                                double theta, kv_rope_pairing pairing);                            \
    void kv_vnorm_l1_##ISA(const kv_layout *l, kv_dtype t, const uint8_t *pool,                    \
                           const kv_segment *segs, size_t nsegs, const float *wo,                  \
                           size_t wo_stride, uint32_t q_heads, uint32_t hidden, float *out);       \
    void kv_merge_values_##ISA(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,   \
                               size_t n);                                                          \
    void kv_decode_attention_##ISA(const kv_layout *l, kv_dtype t, const uint8_t *pool,            \
                                   const kv_segment *segs, size_t nsegs, const uint8_t *tiers,     \
                                   const float *q, uint32_t q_heads, float scale, float *out,      \
                                   float *probs);                                                  \
    void kv_elts_diff_##ISA(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n,          \
                            kv_diff *d);

KV_DECLARE_FAST(generic)
KV_DECLARE_FAST(avx2)

/* 1 when the AVX2 build is compiled in, the CPU runs it, and
 * KVSTASH_KERNEL_ISA does not ask for "generic". */
int kv_isa_avx2(void);

/* kv_isa_avx2() and the CPU has FMA: what the attention's AVX2 build needs. */
int kv_isa_avx2_fma(void);

/* kv_isa_avx2(), the CPU has AVX-512F, and KVSTASH_KERNEL_ISA does not ask
 * for "avx2": the AVX2 build's few loops written for AVX-512 as well
 * (functions with target("avx512f"), the same bytes) may run. */
int kv_isa_avx512(void);

#endif
