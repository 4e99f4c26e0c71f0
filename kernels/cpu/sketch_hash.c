/*
 * sketch_hash.c - POLICIES.md §3.2's hash and sign family, written out again
 * here because kernels/ links nothing of policies/ (tests/gpu builds the
 * kernels alone). tests/unit/test_kernels_sketch.c checks it against
 * reviver_hash() bit for bit.
 */
#include "kernels.h"

#define GOLDEN 0x9E3779B97F4A7C15ull

/* The splitmix64 finaliser. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}

void kv_sketch_hash(uint64_t layer_seed, uint32_t rows, uint32_t buckets, uint64_t J, uint32_t *h,
                    int8_t *g)
{
    for (uint32_t i = 0; i < rows; i++) {
        uint64_t s = GOLDEN * (2 * (uint64_t)i + 1) ^ layer_seed;
        uint64_t t = s ^ 0xD1B54A32D192ED03ull;
        h[i] = (uint32_t)(mix64(J ^ s) % buckets);
        g[i] = (mix64(J ^ t) >> 63) == 0 ? 1 : -1;
    }
}

void kv_sketch_hash_list(uint64_t layer_seed, uint32_t rows, uint32_t buckets, const uint64_t *pos,
                         size_t n, uint32_t *h, int8_t *g)
{
    for (size_t i = 0; i < n; i++)
        kv_sketch_hash(layer_seed, rows, buckets, pos[i], h + i * rows, g + i * rows);
}
