/* The INT8 block geometry (kernels.h "INT8 tier"), and how many tokens an
 * INT8 block holds when it lives in a pool block. */
#include "kernels.h"

/* Bytes of the codes of one of K or V in an INT8 block: H*T*d. */
static size_t codes_bytes(const kv_layout *l)
{
    return (size_t)l->kv_heads * l->block_tokens * l->head_dim;
}

/* Offset of the K scales: both code arrays, rounded up to 16 bytes. */
static size_t scales_start(const kv_layout *l)
{
    return (2 * codes_bytes(l) + 15) & ~(size_t)15;
}

size_t kv_int8_block_bytes(const kv_layout *l)
{
    /* a multiple of 16, so 16-byte alignment of the arena carries to blocks */
    return (scales_start(l) + 8 * (size_t)l->kv_heads * l->head_dim + 15) & ~(size_t)15;
}

size_t kv_int8_code_offset(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head,
                           uint32_t slot)
{
    size_t row = (size_t)head * l->block_tokens + slot;
    return (size_t)block * kv_int8_block_bytes(l) + kv * codes_bytes(l) + row * l->head_dim;
}

size_t kv_int8_scale_offset(const kv_layout *l, uint32_t block, uint32_t kv, uint32_t head)
{
    size_t row = (size_t)kv * l->kv_heads + head;
    return (size_t)block * kv_int8_block_bytes(l) + scales_start(l) + row * l->head_dim * 4;
}

uint32_t kv_int8_tokens_per_block(const kv_layout *l)
{
    size_t room = kv_block_bytes(l);
    kv_layout q = *l;
    /* The INT8 block grows with T by 2*H*d bytes (plus rounding): start from
     * the estimate and step to the exact answer. */
    size_t per = 2 * (size_t)l->kv_heads * l->head_dim;
    q.block_tokens = per ? (uint32_t)(room / per) + 1 : 1;
    while (q.block_tokens > 0 && kv_int8_block_bytes(&q) > room)
        q.block_tokens--;
    return q.block_tokens;
}
