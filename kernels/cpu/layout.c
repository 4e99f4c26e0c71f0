/*
 * layout.c - the pool's block geometry (kernels.h "Pool layout").
 *
 * All sizes are computed in size_t: a block of 64 heads x 256 tokens x 256
 * dims x 4 bytes already overflows 32 bits once K and V are counted.
 */
#include "kernels.h"

/* Bytes of one K or V row: one head, one slot. */
static size_t row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

size_t kv_block_bytes(const kv_layout *l)
{
    return 2u * (size_t)l->kv_heads * l->block_tokens * row_bytes(l);
}

size_t kv_key_offset(const kv_layout *l, uint32_t block, uint32_t head, uint32_t slot)
{
    /* K part of a block is [kv_heads][block_tokens][head_dim]. */
    size_t row = (size_t)head * l->block_tokens + slot;
    return (size_t)block * kv_block_bytes(l) + row * row_bytes(l);
}

size_t kv_segments_tokens(const kv_segment *segs, size_t nsegs)
{
    size_t n = 0;
    for (size_t i = 0; i < nsegs; i++)
        n += segs[i].count;
    return n;
}
