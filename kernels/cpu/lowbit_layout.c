/* The low-bit block geometry (kernels.h "Low-bit tiers"), and how many
 * tokens a low-bit block holds when it lives in a pool block. */
#include "kernels.h"

uint32_t kv_lowbit_group(const kv_layout *l)
{
    return l->quant_group ? l->quant_group : KV_LOWBIT_GROUP_DEFAULT;
}

/* Bytes of one code row: d codes of `bits` bits. */
static size_t row_bytes(const kv_layout *l, uint32_t bits)
{
    return ((size_t)l->head_dim * bits + 7) / 8;
}

static size_t codes_bytes(const kv_layout *l, uint32_t bits)
{
    return (size_t)l->kv_heads * l->block_tokens * row_bytes(l, bits);
}

static size_t key_groups(const kv_layout *l)
{
    uint32_t g = kv_lowbit_group(l);
    return ((size_t)l->block_tokens + g - 1) / g;
}

static size_t value_groups(const kv_layout *l)
{
    uint32_t g = kv_lowbit_group(l);
    return ((size_t)l->head_dim + g - 1) / g;
}

static size_t key_params_start(const kv_layout *l, uint32_t bits)
{
    return (2 * codes_bytes(l, bits) + 15) & ~(size_t)15;
}

static size_t value_params_start(const kv_layout *l, uint32_t bits)
{
    return key_params_start(l, bits) + 4 * (size_t)l->kv_heads * key_groups(l) * l->head_dim;
}

/* The block's shift (an int32) follows the V parameters. */
static size_t shift_start(const kv_layout *l, uint32_t bits)
{
    return value_params_start(l, bits) +
           4 * (size_t)l->kv_heads * l->block_tokens * value_groups(l);
}

size_t kv_lowbit_block_bytes(const kv_layout *l, uint32_t bits)
{
    return (shift_start(l, bits) + 4 + 15) & ~(size_t)15;
}

size_t kv_lowbit_shift_offset(const kv_layout *l, uint32_t bits, uint32_t block)
{
    return (size_t)block * kv_lowbit_block_bytes(l, bits) + shift_start(l, bits);
}

size_t kv_lowbit_code_offset(const kv_layout *l, uint32_t bits, uint32_t block, uint32_t kv,
                             uint32_t head, uint32_t slot)
{
    size_t row = (size_t)head * l->block_tokens + slot;
    return (size_t)block * kv_lowbit_block_bytes(l, bits) + kv * codes_bytes(l, bits) +
           row * row_bytes(l, bits);
}

size_t kv_lowbit_key_params_offset(const kv_layout *l, uint32_t bits, uint32_t block, uint32_t head,
                                   uint32_t key_group)
{
    size_t row = (size_t)head * key_groups(l) + key_group;
    return (size_t)block * kv_lowbit_block_bytes(l, bits) + key_params_start(l, bits) +
           row * 4 * l->head_dim;
}

size_t kv_lowbit_value_params_offset(const kv_layout *l, uint32_t bits, uint32_t block,
                                     uint32_t head, uint32_t slot)
{
    size_t row = (size_t)head * l->block_tokens + slot;
    return (size_t)block * kv_lowbit_block_bytes(l, bits) + value_params_start(l, bits) +
           row * 4 * value_groups(l);
}

uint32_t kv_lowbit_tokens_per_block(const kv_layout *l, uint32_t bits)
{
    size_t room = kv_block_bytes(l);
    kv_layout q = *l;
    /* At least 2·H·d·bits/8 bytes a token: start above the answer and step
     * down to it (the key parameters grow by steps of G tokens). */
    size_t per = (2 * (size_t)l->kv_heads * l->head_dim * bits + 7) / 8;
    size_t start = per ? room / per + 1 : 1;
    q.block_tokens = start > UINT32_MAX ? UINT32_MAX : (uint32_t)start;
    while (q.block_tokens > 0 && kv_lowbit_block_bytes(&q, bits) > room)
        q.block_tokens--;
    return q.block_tokens;
}
