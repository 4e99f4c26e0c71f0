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
    /* the INT4 / INT2 tiers' group size ("Low-bit tiers" below); 0 means
     * KV_LOWBIT_GROUP_DEFAULT. Full-precision and INT8 blocks ignore it. */
    uint32_t quant_group;
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

/* How far n elements `got` are from n elements `ref` (both of type t):
 * kv_elts_diff adds max |got - ref|, max |ref|, Σ (got - ref)² and Σ ref²
 * into *d (zeroed by the caller first; sums in fp32 per chunk, so within
 * rounding of a double-precision loop). For the daemon's measure of what a
 * tier move cost. */
typedef struct kv_diff {
    double max_diff, max_ref, sq_diff, sq_ref;
} kv_diff;
void kv_elts_diff(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d);

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
 * statistics policies need).
 *
 * tiers (NULL: every segment KV_TIER_FULL) gives each segment's tier:
 *  - KV_TIER_FULL: the segment's block holds elements of type t (their
 *    values as kv_elt_load gives them);
 *  - KV_TIER_INT8: the segment's block is a pool block holding one INT8
 *    block ("INT8 tier" below) of layout q8 = l with block_tokens =
 *    kv_int8_tokens_per_block(l), at INT8 block index 0 from the pool
 *    block's start (pool + block * kv_block_bytes(l)); first_slot and count
 *    name slots of that INT8 block (first_slot + count <= its
 *    block_tokens). Element c of a row is code * scale in fp32
 *    (kv_dequantize_group_ref), dequantised as it is read: the list is
 *    never copied. For a per-head list, q8 is derived from the per-head
 *    layout (one head of q8.block_tokens rows, one scale per channel).
 *  - KV_TIER_INT4 / KV_TIER_INT2: likewise, the pool block holds one
 *    low-bit block ("Low-bit tiers" below) of 4 / 2 bits and layout l with
 *    block_tokens = kv_lowbit_tokens_per_block(l, bits), at index 0; element
 *    c of a row is kv_lowbit_value of its code with its group's scale and
 *    zero point and its block's shift, in fp32. The fast version dequantises such rows into a
 *    small fp32 tile per chunk and attends over that.
 * The values are those of store.proto's LayerTable.tier (kvs_tier in
 * client/kvstash.h). Any other value (KVS_TIER_SKETCH, say) is a caller
 * error, asserted in debug builds: revive those tokens into the pool first.
 *
 * The reference computes in double and equals, exactly, dequantising the
 * INT8 segments into an fp32 pool and running it over that. The fast
 * version sums in fp32 in another order, with fused multiply-adds, and
 * uses a polynomial exp (attention.c): the tests hold its values and
 * probabilities to 2e-6 absolute of the reference (the bound did not need
 * widening for FMA), for inputs in [-1, 1] and lists of hundreds of tokens.
 * It splits over KV heads when the call is large ("Threads"). Its two ISA
 * builds do not give the same bits (the AVX2 one fuses multiply-adds, the
 * generic one does not): each is held to the same 2e-6 of the reference,
 * and the tests hold them to 2e-6 of each other. Within a build, the bits
 * depend only on the tokens in list order (not on segments or threads); an
 * INT8 segment does not give the bits of its dequantised fp32 copy (the
 * AVX2 build applies the block's scales once per block, not per element),
 * both within the 2e-6 of the reference. head_dim above 4096 takes the
 * reference.
 */
typedef enum kv_tier {
    KV_TIER_FULL = 0,
    KV_TIER_INT8 = 1,
    /* 2 is the sketch (kvs_tier), never attended; 3 a policy's "evict" */
    KV_TIER_INT4 = 4,
    KV_TIER_INT2 = 5,
} kv_tier;

void kv_decode_attention_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                             const float *q, uint32_t q_heads, float scale, float *out,
                             float *probs);
void kv_decode_attention(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t nsegs, const uint8_t *tiers, const float *q,
                         uint32_t q_heads, float scale, float *out, float *probs);

/*
 * ---- Threads ----
 *
 * kv_decode_attention and the fast CPU kernels below (not gather/scatter/
 * copy_tokens, which the daemon parallelises across sequences) split large
 * calls over threads: the threads take contiguous chunks of the output as
 * they come free, and each chunk is computed with exactly the operations
 * of a single-threaded run, so results never depend on the number of
 * threads or on which thread took what. Helper threads start on another
 * CPU than the caller's, then may go anywhere the caller may. The count is
 * min(online CPUs, 8), lowered so that every thread gets at least
 * KV_PARALLEL_GRAIN bytes of work; environment variable
 * KVSTASH_KERNEL_THREADS (read per call) sets the maximum, 1 turning
 * threads off. No state is kept between calls.
 */
#define KV_PARALLEL_GRAIN (1u << 20)

/* The number of threads a fast kernel would use for a call moving `bytes`
 * bytes, under the current environment. */
unsigned kv_parallel_threads(size_t bytes);

/*
 * The same fast kernels (kv_decode_attention too) are built for the
 * baseline ISA and, on x86-64, for AVX2 + F16C; each call runs the AVX2
 * build when the CPU has both (kv_decode_attention: and FMA) and
 * KVSTASH_KERNEL_ISA (read per call) is not "generic"; a few of its loops
 * have AVX-512 twins, taken when the CPU has AVX-512F and
 * KVSTASH_KERNEL_ISA is not "avx2". Every build gives the same bytes,
 * kv_decode_attention excepted (within its tolerance, above).
 * kv_kernel_isa() names the build calls take now: "avx2+f16c+avx512f",
 * "avx2+f16c" or "generic" (a static string).
 */
const char *kv_kernel_isa(void);

/*
 * ---- INT8 tier (POLICIES.md §5.4) ----
 *
 * An INT8 block holds the K and V of up to l->block_tokens tokens of one
 * layer, all KV heads, as symmetric INT8 codes with one fp32 scale per
 * (K or V, kv head, channel): the group of §5.4 is (layer, head, channel,
 * the tokens of one INT8 block). INT8 blocks live in their own arena
 * (`qpool`): block b starts at b * kv_int8_block_bytes(l). Inside a block,
 * with H = kv_heads, T = block_tokens, d = head_dim and C = H*T*d:
 *
 *   bytes [0, C)        K codes  int8  [H][T][d]   (the pool's row order)
 *   bytes [C, 2C)       V codes  int8  [H][T][d]
 *   bytes [S, S + 4Hd)  K scales fp32  [H][d]      S = 2C rounded up to 16
 *   bytes [S+4Hd, S+8Hd) V scales fp32 [H][d]
 *
 * kv_int8_block_bytes = S + 8Hd rounded up to a multiple of 16 (so 16-byte
 * alignment of the arena carries to every block). Against an fp16 block of
 * the same tokens (4C bytes) that is (T + 4) / (2T) when 2C and 8Hd are
 * already multiples of 16: 0.625 at T = 16, 0.5625 at T = 32, 0.53 at
 * T = 64 (half that against fp32). Quantisation writes every byte of its
 * blocks: a slot beyond the tokens a block was filled with holds code 0, and
 * the padding bytes are 0. The layout's elt_size never matters on the INT8
 * side.
 */
size_t kv_int8_block_bytes(const kv_layout *l);

/*
 * kv_int8_tokens_per_block: the largest T >= 1 such that an INT8 block of
 * layout l with block_tokens = T fits in one block of the pool,
 * kv_int8_block_bytes(T) <= kv_block_bytes(l); 0 when even T = 1 does not
 * fit (the scales alone take 8 * kv_heads * head_dim bytes: fp16 blocks of
 * 2 tokens or fewer, fp32 blocks of 1, layouts so small that the 16-byte
 * padding dominates). fp16, 8 heads x 128 channels, 16 tokens: 28; fp32:
 * 60.
 *
 * The daemon stores INT8 tokens in the pool itself (daemon/tier.h): an
 * INT8 segment's block is a pool block whose first bytes hold an INT8
 * block of layout l with block_tokens = kv_int8_tokens_per_block(l), at
 * INT8 block index 0. The INT8 kernels below are then called with that
 * layout, qpool = pool + block * kv_block_bytes(l) and qblocks / qsegs
 * naming block 0; the tiered kv_decode_attention reads such blocks
 * directly.
 */
uint32_t kv_int8_tokens_per_block(const kv_layout *l);

/* Byte offset, from the INT8 arena's base, of the code row of (block, kv = 0
 * for K / 1 for V, head, slot): head_dim int8 codes. */
size_t kv_int8_code_offset(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head,
                           uint32_t slot);

/* Byte offset of the scale row of (block, kv, head): head_dim floats. */
size_t kv_int8_scale_offset(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head);

/*
 * kv_int8_quantize: the tokens of `segs` (a list in `pool`, layout l with
 * elements of type t) fill INT8 blocks qblocks[0], qblocks[1], ... in list
 * order, l->block_tokens tokens each, from slot 0; the last block may be
 * partial, and its unused slots get code 0. Each (block, K/V, head, channel)
 * group gets the scale and codes of kv_quantize_group_ref over the tokens
 * written into that block: s = max|x| / 127 (1 for all zeros), codes
 * round_half_even(x / s) clamped to [-127, 127]. Requires
 * kv_segments_tokens(segs) <= nq * block_tokens, distinct qblocks, finite
 * inputs. The fast version equals the reference byte for byte.
 */
void kv_int8_quantize_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                          const uint32_t *qblocks, size_t nq);
void kv_int8_quantize(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                      size_t nsegs, uint8_t *qpool, const uint32_t *qblocks, size_t nq);

/*
 * kv_int8_dequantize: the i-th token of `qsegs` (segments of INT8 blocks of
 * layout l in qpool) goes to the i-th slot of `dst` (a list in `pool`, whose
 * blocks have layout dl), K and V, every head: x = code * scale in fp32,
 * stored through kv_elt_store as type t (round to nearest even for fp16 /
 * bf16). dl has l's kv_heads and head_dim; its block_tokens are the
 * destination's (a pool block's 16 where the INT8 block holds 28: a Revive
 * writes straight into the worker's blocks), and dl->elt_size must be the
 * size of t, which may differ from the dtype the tokens were quantised from
 * (revive into an fp32 scratch pool: elt_size 4). Both lists name the same
 * number of tokens; dst slots must be distinct. The error per value is at
 * most s/2 = max|group| / 254, plus the rounding of t.
 */
void kv_int8_dequantize_ref(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                            size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                            const kv_segment *dst, size_t ndst);
void kv_int8_dequantize(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                        size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                        const kv_segment *dst, size_t ndst);

/*
 * ---- Low-bit tiers: INT4 and INT2 (KIVI, Liu et al. 2024) ----
 *
 * A low-bit block holds the K and V of up to T = l->block_tokens tokens of
 * one layer, all KV heads, as unsigned codes of `bits` = 4 or 2 bits with
 * an fp16 scale s and zero point z per group, asymmetric (kernels/lowbit.h
 * is the quantiser: z <= every value <= z + s·(2^bits - 1), code =
 * rne((x - z) / s), value = code·s + z in fp32, both shifted by the
 * block's power of two). With G = the layout's
 * quant_group (0: KV_LOWBIT_GROUP_DEFAULT):
 *  - keys are grouped per channel over G consecutive slots of the block
 *    (slots [kG, kG + G) form key group k; the last one may be short), the
 *    outlier channels of keys keeping their own range;
 *  - values are grouped per token over G consecutive channels (the last
 *    group of a row may be short).
 * Only the tokens a block was filled with count: a short fill's groups
 * cover its tokens alone. With H = kv_heads, d = head_dim, R = ceil(d·bits
 * / 8) bytes per code row (channel c at bit c·bits of the row, low bits
 * first), nk = ceil(T / G) key groups and nv = ceil(d / G) value groups:
 *
 *   bytes [0, HTR)        K codes [H][T][R]
 *   bytes [HTR, 2HTR)     V codes [H][T][R]
 *   bytes [S, S + 4Hnk·d) K params [H][nk]: d fp16 scales, then d zeros
 *                          (S = 2HTR rounded up to 16)
 *   then 4HT·nv bytes     V params [H][T]: nv fp16 scales, then nv zeros
 *   then 4 bytes          the block's shift e (int32; kernels/lowbit.h:
 *                          values are stored as x·2^-e, e = 0 unless some
 *                          |x| of the block passes 32768)
 *
 * rounded up to a multiple of 16 (kv_lowbit_block_bytes). Quantisation
 * writes every byte: unused slots, bits, parameters and padding are 0.
 * Against fp16 tokens (4d bytes a token and head) that is about 1.25d
 * (INT4) and 0.75d (INT2) bytes at G = 32 and T >> G: 31% and 19%. Like
 * INT8 blocks, the daemon keeps them in pool blocks (block index 0 of a
 * low-bit arena at the pool block's start, T =
 * kv_lowbit_tokens_per_block).
 */
#define KV_LOWBIT_GROUP_DEFAULT 32u

/* The layout's group size (quant_group, or the default when 0). */
uint32_t kv_lowbit_group(const kv_layout *l);

size_t kv_lowbit_block_bytes(const kv_layout *l, uint32_t bits);

/* The largest T >= 1 whose low-bit block fits one pool block of layout l
 * (kv_block_bytes(l)); 0 when none does. fp16, 8 heads x 128 channels, 16
 * tokens a pool block, G = 32: 49 (INT4), 83 (INT2). */
uint32_t kv_lowbit_tokens_per_block(const kv_layout *l, uint32_t bits);

/* Byte offsets from the arena's base: the code row of (block, kv = 0 for K
 * / 1 for V, head, slot); the K params of (block, head, key group): d
 * scales then d zeros (fp16); the V params of (block, head, slot): nv
 * scales then nv zeros. */
size_t kv_lowbit_code_offset(const kv_layout *l, uint32_t bits, uint32_t block, uint32_t kv,
                             uint32_t head, uint32_t slot);
size_t kv_lowbit_key_params_offset(const kv_layout *l, uint32_t bits, uint32_t block, uint32_t head,
                                   uint32_t key_group);
size_t kv_lowbit_value_params_offset(const kv_layout *l, uint32_t bits, uint32_t block,
                                     uint32_t head, uint32_t slot);
/* The block's shift e: an int32. */
size_t kv_lowbit_shift_offset(const kv_layout *l, uint32_t bits, uint32_t block);

/*
 * kv_lowbit_quantize: as kv_int8_quantize, into low-bit blocks of `bits`
 * (4 or 2) of layout l: the tokens of `segs` fill qblocks[0], qblocks[1],
 * ... in list order, l->block_tokens each, from slot 0. The fast version
 * equals the reference byte for byte.
 * kv_lowbit_dequantize: as kv_int8_dequantize: the i-th token of qsegs
 * (slots of low-bit blocks) into the i-th slot of dst, x = (code·s + z)·2^e
 * stored as type t. The error per value is at most s·2^e/2 of its group
 * plus the fp32 rounding of code·s + z and the rounding of t (lowbit.h).
 */
void kv_lowbit_quantize_ref(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                            const uint32_t *qblocks, size_t nq);
void kv_lowbit_quantize(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                        const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                        const uint32_t *qblocks, size_t nq);
void kv_lowbit_dequantize_ref(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                              const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                              const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                              size_t ndst);
void kv_lowbit_dequantize(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                          const kv_segment *qsegs, size_t nqsegs, kv_dtype t, const kv_layout *dl,
                          uint8_t *pool, const kv_segment *dst, size_t ndst);

/*
 * ---- Count sketch (KVReviver's Vague store, POLICIES.md §3.2-3.3) ----
 *
 * One sketch per (sequence, layer): `rows` x `buckets` cells, each a key sum
 * and a value sum of dim = kv_heads * head_dim floats (one token's K or V,
 * [kv_heads][head_dim]) and a token count, laid out
 * key[(row * buckets + bucket) * dim + c], same for value, and
 * count[row * buckets + bucket]. The caller owns the arrays (host memory for
 * the CPU kernels, device memory for the CUDA twins). The `_ref` functions
 * are the one definition (the policy only decides which tokens go in); the
 * fast and CUDA versions equal them exactly, token by token.
 */
#define KV_SKETCH_MAX_ROWS 32u

/* The per-row estimate (§3.8): the cell itself (Alg. 2), or the cell divided
 * by its token count (a count <= 0 divides by 1). */
typedef enum kv_estimate { KV_ESTIMATE_SUM = 0, KV_ESTIMATE_MEAN = 1 } kv_estimate;

typedef struct kv_sketch {
    uint32_t rows;    /* 1 .. KV_SKETCH_MAX_ROWS */
    uint32_t buckets; /* >= 1 */
    uint32_t dim;     /* kv_heads * head_dim of the pools it reads and writes */
    kv_estimate key_estimate, value_estimate;
    float *key;     /* rows * buckets * dim */
    float *value;   /* rows * buckets * dim */
    int32_t *count; /* rows * buckets */
} kv_sketch;

/* §3.2's hash family for rows i < rows: kv_sketch_hash_row of
 * kernels/sketch_hash.h (the one definition, which also derives the
 * policies' layer seeds): S_i = 0x9E3779B97F4A7C15·(2i+1) ^ layer_seed,
 * T_i = S_i ^ 0xD1B54A32D192ED03, h[i] = mix64(J ^ S_i) mod buckets, g[i] =
 * +1 when mix64(J ^ T_i) >> 63 == 0 else -1, mix64 the splitmix64 finaliser. */
void kv_sketch_hash(uint64_t layer_seed, uint32_t rows, uint32_t buckets, uint64_t J, uint32_t *h,
                    int8_t *g);

/* kv_sketch_hash for n positions: h[i * rows + r], g[i * rows + r]. */
void kv_sketch_hash_list(uint64_t layer_seed, uint32_t rows, uint32_t buckets, const uint64_t *pos,
                         size_t n, uint32_t *h, int8_t *g);

/*
 * The sketch operations take a token list in a pool (layout l, elements of
 * type t, l->kv_heads * l->head_dim == sk->dim) and, per token i of the list
 * in order, its buckets h[i * rows ..] and signs g[i * rows ..] (from
 * kv_sketch_hash_list, or explicit tables in tests). Tokens are processed in
 * list order, so a token's query sees every earlier insert and delete.
 *
 * insert (Alg. 1): key cell h[r] += k, value cell h[r] += g[r]·v, count += 1.
 * query (Alg. 2): per channel, the lower median over rows of the row
 *   estimates (key cell; g[r]·value cell; each / count in MEAN mode), stored
 *   into the token's slot through kv_elt_store. The sketch is not changed.
 * revive (§3.5 swap, Alg. 3): per token, query as above, store the estimate,
 *   then delete that fp32 estimate: key cell -= k_est, value cell -=
 *   g[r]·v_est, count -= 1 (the residual error stays in the cells).
 * delete: revive without storing (pool and segs may be NULL; l and t are
 *   then unused and n gives the number of tokens).
 * Query and revive write every slot of the list (distinct slots).
 */
void kv_sketch_insert_ref(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g);
void kv_sketch_insert(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                      const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g);
void kv_sketch_query_ref(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                         const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                         size_t nsegs);
void kv_sketch_query(const kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                     kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
void kv_sketch_revive_ref(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                          kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
void kv_sketch_revive(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                      kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
void kv_sketch_delete(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n);

/*
 * ---- RoPE re-rotation (POLICIES.md §2.8) ----
 *
 * kv_rope_rerotate: the keys of the listed tokens, which carry RoPE at some
 * position p, are turned into RoPE at p + delta[i] (i-th token of the list;
 * negative after eviction shifts a token left, as OpenVINO's rotation by
 * -shift*B does). Values are untouched. For pair index j < d/2 (d =
 * head_dim, even), inv_freq_j = theta^(-2j/d) and angle = delta * inv_freq_j
 * in double; c = (float)cos(angle), s = (float)sin(angle); the pair (x, y)
 * becomes (x*c - y*s, x*s + y*c) in fp32, stored through kv_elt_store.
 * Pairs: KV_ROPE_HALF rotates (j, j + d/2) (HF rotate_half, OpenVINO);
 * KV_ROPE_INTERLEAVED rotates (2j, 2j + 1) (llama2.c, GPT-J). Distinct slots.
 */
typedef enum kv_rope_pairing { KV_ROPE_HALF = 0, KV_ROPE_INTERLEAVED = 1 } kv_rope_pairing;

void kv_rope_rerotate_ref(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                          size_t nsegs, const int32_t *delta, double theta,
                          kv_rope_pairing pairing);
void kv_rope_rerotate(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                      size_t nsegs, const int32_t *delta, double theta, kv_rope_pairing pairing);

/*
 * ---- Projected value norm (POLICIES.md §1.2) ----
 *
 * kv_vnorm_l1: out[g][i] = (1/G) Σ_{h in group(g)} Σ_{c < hidden}
 * |Σ_{j < d} V[g][i][j] · wo[c * wo_stride + h*d + j]| for the values of the
 * i-th token of the list and kv head g < l->kv_heads, G = q_heads /
 * l->kv_heads, group(g) = g*G .. g*G+G-1; out is [kv_heads][ntokens]. With
 * the pool layout pass wo = o_proj.weight and wo_stride = q_heads * d; for
 * a per-head list (kv_heads = 1) pass the group's q_heads and wo +
 * g*G*d with wo_stride = the model's q_heads * d. Sums in double in the
 * reference's order (vnorm_ref.c, the definition; the policies receive the
 * result as policy_stats.vnorm), so both CPU versions equal it exactly.
 */
void kv_vnorm_l1_ref(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                     size_t nsegs, const float *wo, size_t wo_stride, uint32_t q_heads,
                     uint32_t hidden, float *out);
void kv_vnorm_l1(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                 size_t nsegs, const float *wo, size_t wo_stride, uint32_t q_heads, uint32_t hidden,
                 float *out);

/*
 * ---- Value merges, batched ----
 *
 * kv_merge_values: m[0], m[1], ... applied in order, each exactly
 * kv_merge_value (a later merge sees the result of an earlier one).
 */
typedef struct kv_merge {
    uint32_t from_block, from_slot;
    uint32_t into_block, into_slot;
    float w_from, w_into;
} kv_merge;

void kv_merge_values_ref(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                         size_t n);
void kv_merge_values(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m, size_t n);

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

/* The tier kernels' twins (kernels/cuda/). Every one but the attention gives
 * the bytes of its CPU version (the same IEEE operations in the same order
 * per element, no FMA contraction; the RoPE coefficients are computed on
 * the host); kv_decode_attention_cuda uses expf and a split-list summation
 * order, within about 1e-6 relative of kv_decode_attention_ref. The
 * sketch's arrays (sk->key, value, count) are device pointers; h, g,
 * qblocks, delta, tiers and the merge list are host arrays. Pool elements
 * must be aligned to their size (cudaMalloc'd pools are). Limits (else
 * cudaErrorInvalidValue): kv_decode_attention_cuda head_dim <= 512, tiers
 * KV_TIER_FULL, INT8, INT4 or INT2 only, quantised segments inside their
 * block; kv_lowbit_* bits 4 or 2; kv_vnorm_l1_cuda head_dim <= 759; kv_heads and q_heads <= 65535.
 */
int kv_int8_quantize_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                          const uint32_t *qblocks, size_t nq);
int kv_int8_dequantize_cuda(const kv_layout *l, const uint8_t *qpool, const kv_segment *qsegs,
                            size_t nqsegs, kv_dtype t, const kv_layout *dl, uint8_t *pool,
                            const kv_segment *dst, size_t ndst);
int kv_lowbit_quantize_cuda(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, uint8_t *qpool,
                            const uint32_t *qblocks, size_t nq);
int kv_lowbit_dequantize_cuda(const kv_layout *l, uint32_t bits, const uint8_t *qpool,
                              const kv_segment *qsegs, size_t nqsegs, kv_dtype t,
                              const kv_layout *dl, uint8_t *pool, const kv_segment *dst,
                              size_t ndst);
int kv_sketch_insert_cuda(kv_sketch *sk, const kv_layout *l, kv_dtype t, const uint8_t *pool,
                          const kv_segment *segs, size_t nsegs, const uint32_t *h, const int8_t *g);
int kv_sketch_query_cuda(const kv_sketch *sk, const uint32_t *h, const int8_t *g,
                         const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                         size_t nsegs);
int kv_sketch_revive_cuda(kv_sketch *sk, const uint32_t *h, const int8_t *g, const kv_layout *l,
                          kv_dtype t, uint8_t *pool, const kv_segment *segs, size_t nsegs);
int kv_sketch_delete_cuda(kv_sketch *sk, const uint32_t *h, const int8_t *g, size_t n);
int kv_rope_rerotate_cuda(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_segment *segs,
                          size_t nsegs, const int32_t *delta, double theta,
                          kv_rope_pairing pairing);
int kv_vnorm_l1_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool, const kv_segment *segs,
                     size_t nsegs, const float *wo, size_t wo_stride, uint32_t q_heads,
                     uint32_t hidden, float *out);
int kv_merge_values_cuda(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m,
                         size_t n);
int kv_decode_attention_cuda(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                             const kv_segment *segs, size_t nsegs, const uint8_t *tiers,
                             const float *q, uint32_t q_heads, float scale, float *out,
                             float *probs);
/* kv_elts_diff on device arrays got and ref, the sums added into host *d:
 * per 512-element chunk reduced on the device, so 32 bytes per chunk cross
 * to the host; within rounding of kv_elts_diff (another summation order). */
int kv_elts_diff_cuda(const uint8_t *got, const uint8_t *ref, kv_dtype t, size_t n, kv_diff *d);
#endif

#ifdef __cplusplus
}
#endif
#endif
