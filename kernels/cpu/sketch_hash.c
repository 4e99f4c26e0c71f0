/*
 * sketch_hash.c - kv_sketch_hash and kv_sketch_hash_list (kernels.h): the
 * rows of kernels/sketch_hash.h, the one definition of POLICIES.md §3.2's
 * family, for every row and every listed position.
 */
#include "sketch_hash.h"

#include "kernels.h"

void kv_sketch_hash(uint64_t layer_seed, uint32_t rows, uint32_t buckets, uint64_t J, uint32_t *h,
                    int8_t *g)
{
    for (uint32_t i = 0; i < rows; i++)
        kv_sketch_hash_row(layer_seed, i, buckets, J, &h[i], &g[i]);
}

void kv_sketch_hash_list(uint64_t layer_seed, uint32_t rows, uint32_t buckets, const uint64_t *pos,
                         size_t n, uint32_t *h, int8_t *g)
{
    for (size_t i = 0; i < n; i++)
        kv_sketch_hash(layer_seed, rows, buckets, pos[i], h + i * rows, g + i * rows);
}
