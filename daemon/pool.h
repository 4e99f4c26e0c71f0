/*
 * pool.h - one model geometry's block arena.
 *
 * A pool is an arena of its backend (backend.h: a sealed memfd for `host`)
 * cut into fixed blocks of one layer's K and V for block_tokens tokens.
 * The arena's base is a device address: only the backend's ops
 * (pool->backend->ops, kernels/ops.h) read or write it. The allocator is a stack of free block ids:
 * O(1) alloc and free, no fragmentation since all blocks are equal.
 * Not thread-safe: the store's lock covers it.
 */
#ifndef KVSTASH_POOL_H
#define KVSTASH_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kernels.h"
#include "status.h"

typedef enum pool_dtype { POOL_FP16 = 1, POOL_BF16 = 2, POOL_FP32 = 3 } pool_dtype;

typedef struct pool_geometry {
    uint32_t layers, q_heads, kv_heads, head_dim, block_tokens;
    pool_dtype dtype;
    float rope_theta;
} pool_geometry;

typedef struct pool {
    uint64_t id;
    char model[65];
    char tenant[65]; /* "" or the tenant it serves: the store keys pools by (tenant, model) */
    pool_geometry geom;
    kv_layout layout;
    /* Its sequences' decisions over layers (store_config's policy_threads,
     * policy_parallel_tokens): set by the store, read by seq_create. */
    uint32_t policy_threads;
    uint64_t policy_parallel_tokens;
    size_t block_bytes;
    uint32_t block_count;
    uint32_t nfree;
    uint32_t *free_stack; /* free block ids; the top is free_stack[nfree-1] */
    /* The savepoint (pool_savepoint): free_stack[low..mark) as it was
     * there, saved as allocation first pops each entry below low. */
    uint32_t *saved_stack;
    uint32_t sp_mark, sp_low;
    int sp_active;
    /* Held blocks (pool_hold_begin): neither free nor any sequence's. */
    uint32_t *held; /* [block_count]; held[0..nheld) */
    uint32_t nheld;
    int holding;       /* pool_free_block holds instead of freeing */
    uint32_t sessions; /* sessions attached; the store destroys the pool when this */
    uint32_t holds;    /* and this (ended sessions whose blocks it holds) are 0 */
    const backend *backend;
    backend_arena arena;
    uint8_t *base; /* arena.base: a device address, for the ops only */
    size_t bytes;  /* block_count * block_bytes */
} pool;

/* Check a client-supplied geometry (ranges, q_heads % kv_heads, dtype) and
 * fill defaults (rope_theta 0 -> 10000). */
status_code pool_geometry_check(pool_geometry *g, status *st);

/* Bytes per element of a dtype. */
size_t pool_dtype_size(pool_dtype d);

/* Create a pool of at most max_bytes for `model` with a checked geometry,
 * its arena in backend b. The caller owns *out and frees it with
 * pool_destroy. */
status_code pool_create(uint64_t id, const char *model, const pool_geometry *g, size_t max_bytes,
                        const backend *b, pool **out, status *st);

/* What a worker needs to map the pool's arena (backend.h arena_share);
 * the caller closes sh->fd when it is not -1. */
status_code pool_share(const pool *p, backend_share *sh, status *st);

void pool_destroy(pool *p);

/* Pop a free block; returns 0, or -1 when the pool is full. */
int pool_alloc_block(pool *p, uint32_t *block);

/* Return a block to the free stack. */
void pool_free_block(pool *p, uint32_t block);

/*
 * Holding (the store's lease-end quarantine, docs/reliability.md): blocks a
 * worker may still write through its mapping after its session ended must
 * not be handed to anyone else until its process is gone. Between
 * pool_hold_begin and pool_hold_end every pool_free_block puts the block
 * in p->held instead of the free stack, so that whatever releases a
 * session's sequences and scratch holds exactly their blocks, without
 * knowing it and without memory (held has room for every block).
 * pool_hold_begin returns where this hold starts in held, pool_hold_end how
 * many blocks it holds. pool_hold_free gives held[first, first + count)
 * back to the free stack; the holds after it move down by count (their
 * `first`s must be lowered by count). Holds do not nest.
 */
uint32_t pool_hold_begin(pool *p);
uint32_t pool_hold_end(pool *p, uint32_t first);
void pool_hold_free(pool *p, uint32_t first, uint32_t count);

/*
 * A savepoint: pool_rollback gives the free stack back exactly as it was at
 * pool_savepoint (the same blocks free, in the same order), whatever was
 * allocated and freed since; pool_release keeps the changes. A call that
 * changes a sequence in many steps takes one (seq.h seq_begin), so that a
 * failure halfway leaves the pool as before. None of the three can fail:
 * the copy of the stack's changed part has room for every block, made at
 * pool_create. Savepoints do not nest.
 */
void pool_savepoint(pool *p);
void pool_rollback(pool *p);
void pool_release(pool *p);

/* Copy n blocks' whole bytes, blocks[i] to or from host[i * block_bytes],
 * through the backend's memory operations (a sequence's export and
 * import, seq.h seq_export). Returns 0, or -1 on a backend error. */
int pool_read_blocks(const pool *p, const uint32_t *blocks, size_t n, uint8_t *host);
int pool_write_blocks(pool *p, const uint32_t *blocks, size_t n, const uint8_t *host);

/* Whether two geometries describe the same cache. */
int pool_geometry_equal(const pool_geometry *a, const pool_geometry *b);

/* Describe a geometry for messages ("layers=2 q_heads=4 ..."). */
void pool_geometry_format(const pool_geometry *g, char *buf, size_t len);

#endif
