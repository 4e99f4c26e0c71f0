/*
 * tier.h - moving one token list's tokens between storage tiers with the
 * kernels: full precision pool slots, INT8, INT4 and INT2 blocks, a
 * count-sketch.
 *
 * A quantised block lives in an ordinary pool block: its first bytes hold
 * one INT8 block (kernels.h "INT8 tier") of layout l8 = the list's layout
 * with block_tokens = kv_int8_tokens_per_block(l), or one INT4 / INT2 block
 * (kernels.h "Low-bit tiers") of layout l4 / l2 (block_tokens =
 * kv_lowbit_tokens_per_block), at block index 0. So the pool needs one
 * allocator, and demoting a block's worth of tokens frees most of their
 * bytes for any other use (at T = 16 fp16 tokens per block of 8 heads x
 * 128 channels an INT8 block holds 28, an INT4 one 49, an INT2 one 83).
 *
 * The kernels take one layout for source and destination; tokens change
 * layout through a contiguous staging copy ([kv_heads][n][head_dim] of the
 * pool's dtype). Pool and staging memory are device memory of the pool's
 * backend: every byte moves through the context's ops (kernels/ops.h), and
 * staging comes from tier_stage_alloc. They decide nothing: the caller
 * (seq.c) says which tokens move where. Not thread-safe (the store's lock).
 */
#ifndef KVSTASH_TIER_H
#define KVSTASH_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "ops.h"
#include "policy.h"

#define TIER_NO_BLOCK UINT32_MAX /* the block of a token in the sketch */

/* Where one token is stored: a pool slot (FULL), a slot of the quantised
 * block in pool block `block` (INT8, INT4, INT2), or the list's sketch
 * (SKETCH, no block). */
typedef struct tier_token {
    uint32_t block, slot;
    uint8_t tier; /* policy_tier: POLICY_FULL, _INT8, _INT4, _INT2 or _SKETCH */
} tier_token;

/* One list's storage: the pool it lives in and its layouts. */
typedef struct tier_ctx {
    const kv_ops *ops;  /* the pool's backend's memory operations */
    uint8_t *base;      /* the pool's arena (a device address) */
    size_t block_bytes; /* of the pool */
    kv_layout l;        /* the list's full-precision block layout */
    kv_layout l8;       /* l with block_tokens = INT8 tokens per pool block */
    kv_layout l4, l2;   /* the same for INT4 and INT2 (0 tokens: none fits) */
    kv_dtype dtype;
    /* Tokens tier_copy stages at a time (tier_ctx_init: what
     * TIER_COPY_CHUNK_BYTES of them take, at least 1). */
    size_t copy_chunk;
} tier_ctx;

/* What tier_copy stages at a time on a device (host memory copies without
 * staging): each chunk costs a few synchronous kernel calls of some 40 us
 * (docs/gpu.md), so chunks are large, and its staging (the contiguous
 * copy, and as much again of dequantised blocks) stays within a GPU's L2
 * cache (50 MB on an H100), so that the passes over it do not reach
 * memory. A 4096-token fp16 layer of 8 KV heads x 128 is two chunks. */
#define TIER_COPY_CHUNK_BYTES (8u << 20)

/* Fill l8, l4 and l2 from l, and copy_chunk; returns -1 when not even one
 * INT8 token fits in a block. */
int tier_ctx_init(tier_ctx *c, const kv_ops *ops, uint8_t *base, size_t block_bytes,
                  const kv_layout *l, kv_dtype dtype);

/* The layout of tier t's blocks (l for FULL), and the tokens one holds (0:
 * the tier does not fit this pool's blocks). */
const kv_layout *tier_layout(const tier_ctx *c, uint8_t t);
uint32_t tier_block_tokens(const tier_ctx *c, uint8_t t);

/* Bytes of one token's K and V in the contiguous staging layout. */
size_t tier_token_bytes(const tier_ctx *c);

/* Device staging for n tokens' K and V (n * tier_token_bytes; K in the
 * first half, V in the second), NULL when out of memory; freed with
 * tier_stage_free (NULL is fine). */
uint8_t *tier_stage_alloc(const tier_ctx *c, size_t n);
void tier_stage_free(const tier_ctx *c, uint8_t *stage);

/* Read n FULL or quantised tokens into contiguous k and v ([kv_heads][n]
 * [head_dim], pool dtype; quantised tokens dequantised; staging memory). Returns 0, or -1
 * out of memory or a backend error. Every function below that returns an
 * int fails the same way. */
int tier_read(const tier_ctx *c, const tier_token *tok, size_t n, uint8_t *k, uint8_t *v);

/* Copy n FULL or quantised tokens into FULL slots dst (distinct from src):
 * full-precision ones pool to pool (kv_copy_tokens). Quantised ones are
 * dequantised: in host memory a quantised block's run at a time into one
 * staging block, and from there into their slots; on a device (many small
 * copies are many calls there) a list with quantised tokens is read into
 * staging and written out copy_chunk tokens at a time. Returns 0, or -1
 * out of memory. */
int tier_copy(const tier_ctx *c, const tier_token *src, size_t n, const tier_token *dst);

/* Write n contiguous staged tokens into FULL slots (kv_scatter). */
int tier_write(const tier_ctx *c, const tier_token *dst, size_t n, const uint8_t *k,
               const uint8_t *v);

/* Quantise the n FULL or quantised tokens `src` (in order; they stay where
 * they are) into blocks qblocks[0..nq) of quantised tier t (pool blocks,
 * tier_block_tokens(t) tokens each, the last one partial; INT8: POLICIES.md
 * §5.4 scales per block; INT4 / INT2: groups of kernels.h "Low-bit
 * tiers"). A whole block of full-precision tokens is gathered straight
 * into the kernel's staging block; the others are read through a
 * contiguous copy. Returns 0, or -1 out of memory (or t not a quantised
 * tier that fits). */
int tier_quantize(const tier_ctx *c, uint8_t t, const tier_token *src, size_t n,
                  const uint32_t *qblocks, size_t nq);

/*
 * The move-error metrics below feed one histogram observation per move
 * (README "Metrics"). A move compares a sample of its tokens: at most
 * TIER_ERROR_SAMPLE, evenly spaced through it, the first included, all of
 * them when it has no more. The sample estimates the observation well;
 * comparing every token cost more than the move itself (docs/bench.md
 * "Tier moves"). tier_error_sample writes the sample's indices into idx
 * and returns their number.
 */
#define TIER_ERROR_SAMPLE 32
size_t tier_error_sample(size_t n, uint32_t idx[TIER_ERROR_SAMPLE]);

/* How far n tokens as now stored at `tok` (FULL or quantised) are from the
 * staged originals they were made from (`stage`, K then V as
 * tier_stage_alloc lays them out): *ratio = max |stored - original| /
 * max |original| (0 when every original is 0): for INT8,
 * POLICIES.md §5.4 bounds it by 1/254; INT4 / INT2 by about half a
 * group's range / 15 or / 3 (their groups are smaller, so the ratio to
 * the list's largest value is smaller still). Returns 0 or -1 (out of
 * memory). */
int tier_error_ratio(const tier_ctx *c, const tier_token *tok, size_t n, const uint8_t *stage,
                     double *ratio);

/* A list's count-sketch (kernels.h kv_sketch) with its hash family. */
typedef struct tier_sketch {
    const kv_ops *ops; /* the cells are its device memory */
    kv_sketch sk;
    uint64_t layer_seed;
} tier_sketch;

/* Allocate a zeroed sketch for tokens of c's layout. Returns 0 or -1. */
int tier_sketch_init(tier_sketch *s, const tier_ctx *c, const policy_sketch_geometry *g);
void tier_sketch_free(tier_sketch *s);
size_t tier_sketch_bytes(const tier_sketch *s); /* 0 when not allocated */
/* Bytes a sketch of rows x buckets cells of dim floats allocates
 * (tier_sketch_init); SIZE_MAX when that overflows. */
size_t tier_sketch_bytes_for(uint32_t rows, uint32_t buckets, size_t dim);

/* Insert the n FULL or quantised tokens `src` (they stay where they are)
 * at original positions pos (Alg. 1): full-precision ones straight from
 * the pool, quantised ones through a dequantised copy. */
int tier_sketch_insert(tier_sketch *s, const tier_ctx *c, const uint32_t *pos,
                       const tier_token *src, size_t n);

/* Query the tokens at pos into FULL slots dst of the pool at `base` (the
 * list's pool, or any with c's layout); with `remove`, delete each estimate
 * from the sketch after reading it (Alg. 3 swap). Returns 0 or -1. */
int tier_sketch_read(tier_sketch *s, const tier_ctx *c, uint8_t *base, const uint32_t *pos,
                     size_t n, const tier_token *dst, int remove);

/*
 * A transaction's undo of a few cells (seq_txn.c), cheaper than a copy of
 * the whole sketch when a step moves a few tokens: tier_sketch_cells names
 * the cells that positions pos[0..n) touch (rows each, into cells[0..n *
 * rows)); tier_sketch_cells_save copies those cells (key row, value row,
 * count) into new device memory *save (free with ops->free), and
 * tier_sketch_cells_restore writes them back. Save returns 0 or -1 (out
 * of memory); restore cannot fail on memory.
 */
int tier_sketch_cells(const tier_sketch *s, const uint32_t *pos, size_t n, uint32_t *cells);
int tier_sketch_cells_save(const tier_sketch *s, const uint32_t *cells, size_t nc, uint8_t **save);
void tier_sketch_cells_restore(tier_sketch *s, const uint32_t *cells, size_t nc,
                               const uint8_t *save);

/* The sketch's current estimate of the tokens at pos against their staged
 * originals (`stage`, as tier_error_ratio's): *rel = ||estimate -
 * original||_2 / ||original||_2 (0 when the originals are 0). The sketch is not changed. Returns
 * 0 or -1. */
int tier_sketch_error(const tier_sketch *s, const tier_ctx *c, const uint32_t *pos, size_t n,
                      const uint8_t *stage, double *rel);

/* The cells as bytes (key floats, value floats, counts: tier_sketch_bytes
 * of them, the device's byte order) into host memory, and back into an
 * allocated sketch of the same geometry: the remote tier's value of a
 * spilled sketch (seq.h "Spilling victims"). Return 0 or -1. */
int tier_sketch_save(const tier_sketch *s, uint8_t *host);
int tier_sketch_load(tier_sketch *s, const uint8_t *host);

/* Delete the estimates of the tokens at pos (dropping them for good). */
int tier_sketch_delete(tier_sketch *s, const uint32_t *pos, size_t n);

#endif
