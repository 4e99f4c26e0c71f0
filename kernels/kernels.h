/*
 * kernels.h - the data-moving math of kvstash, once per backend.
 *
 * Kernels move memory and never decide: callers pass explicit buffers, a
 * layout and a list of segments. Each kernel has a plain reference (`_ref`),
 * a fast CPU version (same declaration without suffix) and, when the build
 * has CUDA (KVSTASH_HAVE_CUDA), a `_cuda` twin in kernels/cuda/ that takes
 * device pointers and runs on the current device and stream 0.
 *
 * Pool layout (DESIGN.md "Memory"): a pool is an arena of fixed blocks; block
 * b starts at b * block_bytes. A block holds block_tokens tokens of one layer:
 * first K, then V, each laid out [kv_heads][block_tokens][head_dim] elements
 * of elt_size bytes.
 */
#ifndef KVSTASH_KERNELS_H
#define KVSTASH_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The shape of one pool's blocks. */
typedef struct kv_layout {
    uint32_t kv_heads;
    uint32_t block_tokens;
    uint32_t head_dim;
    uint32_t elt_size; /* bytes per element: 2 (fp16, bf16) or 4 (fp32) */
} kv_layout;

/* A run of `count` consecutive tokens in block `block`, slots first_slot.. */
typedef struct kv_segment {
    uint32_t block;
    uint32_t first_slot;
    uint32_t count;
} kv_segment;

/* Bytes of one block: K and V for every head and slot. */
size_t kv_block_bytes(const kv_layout *l);

/* Byte offset, from the pool base, of the K row of (block, kv head, slot);
 * the V row is at that plus kv_block_bytes(l) / 2. */
size_t kv_key_offset(const kv_layout *l, uint32_t block, uint32_t head, uint32_t slot);

/* Total tokens in a segment list. */
size_t kv_segments_tokens(const kv_segment *segs, size_t nsegs);

/*
 * kv_gather: copy the tokens of a segmented layer out of the pool into two
 * contiguous buffers laid out [kv_heads][ntokens][head_dim], where ntokens is
 * kv_segments_tokens(segs, nsegs). k_out and v_out must not overlap the pool.
 */
void kv_gather_ref(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                   uint8_t *k_out, uint8_t *v_out);
void kv_gather(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
               uint8_t *k_out, uint8_t *v_out);

/*
 * kv_scatter: the inverse of kv_gather. Writes contiguous [kv_heads][ntokens]
 * [head_dim] K and V into the slots named by the segments.
 */
void kv_scatter_ref(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                    const uint8_t *k_in, const uint8_t *v_in);
void kv_scatter(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                const uint8_t *k_in, const uint8_t *v_in);

/*
 * kv_copy_tokens: block copy between two block tables of the same pool: the
 * i-th token of `src` (in segment order) goes to the i-th slot of `dst`, K and
 * V, every head. Both lists must hold the same number of tokens; source and
 * destination slots must not overlap (the daemon always copies into fresh
 * blocks).
 */
void kv_copy_tokens_ref(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                        const kv_segment *dst, size_t ndst);
void kv_copy_tokens(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                    const kv_segment *dst, size_t ndst);

/* Element types of a pool (the values of the proto's DType). */
typedef enum kv_dtype { KV_FP16 = 1, KV_BF16 = 2, KV_FP32 = 3 } kv_dtype;

/* One element as float, and back (round to nearest even; fp16 overflows to
 * infinity). */
float kv_elt_load(const uint8_t *p, kv_dtype t);
void kv_elt_store(uint8_t *p, kv_dtype t, float v);

/*
 * kv_merge_value: WeightedKV's convex value merge (POLICIES.md §4.1):
 * V[into] = (w_from*V[from] + w_into*V[into]) / (w_from + w_into) for every
 * head of the layout, in fp32; both weights 0 give the plain average (§4.2).
 * Keys are untouched. (block, slot) name one token of the layout.
 */
void kv_merge_value(const kv_layout *l, kv_dtype t, uint8_t *pool, uint32_t from_block,
                    uint32_t from_slot, uint32_t into_block, uint32_t into_slot, float w_from,
                    float w_into);

/*
 * Symmetric INT8 of one group of n values (POLICIES.md §5.4): scale
 * s = max|x| / 127 (1 for an all-zero group), codes round_half_even(x / s)
 * clamped to [-127, 127]. Returns s. Round trip error per value <= s / 2.
 */
float kv_quantize_group_ref(const float *x, size_t n, int8_t *q);
void kv_dequantize_group_ref(const int8_t *q, size_t n, float s, float *x);

/*
 * kv_decode_attention: one new query token's attention over the tokens of
 * one list in the pool, by blocks with an online softmax (no scratch of the
 * list's length). q is [q_heads][head_dim] fp32, RoPE already applied; out
 * receives [q_heads][head_dim] fp32. With the pool layout (all-heads list),
 * query head h reads KV head h / (q_heads / kv_heads); with a per-head list
 * (layout with kv_heads = 1, kv_heads * block_tokens rows per block) pass the
 * q_heads of that KV head's group. scores = q.k * scale. If probs is not
 * NULL it receives the softmax probabilities [q_heads][ntokens] (the
 * statistics policies need). Elements are read through kv_elt_load.
 */
void kv_decode_attention_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const float *q,
                             uint32_t q_heads, float scale, float *out, float *probs);
void kv_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, const float *q, uint32_t q_heads,
                         float scale, float *out, float *probs);

#ifdef KVSTASH_HAVE_CUDA
/* CUDA twins: pool, outputs and inputs are device pointers; segment lists are
 * host arrays (copied to the device by the call). Return 0 or a CUDA error
 * code (cudaError_t as int); they synchronise before returning. */
int kv_gather_cuda(const kv_layout *l, const uint8_t *pool, const kv_segment *segs, size_t nsegs,
                   uint8_t *k_out, uint8_t *v_out);
int kv_scatter_cuda(const kv_layout *l, uint8_t *pool, const kv_segment *segs, size_t nsegs,
                    const uint8_t *k_in, const uint8_t *v_in);
int kv_copy_tokens_cuda(const kv_layout *l, uint8_t *pool, const kv_segment *src, size_t nsrc,
                        const kv_segment *dst, size_t ndst);
#endif

#ifdef __cplusplus
}
#endif
#endif
