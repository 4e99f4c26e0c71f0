/*
 * sketch_hash.h - POLICIES.md §3.2's hash family, written once: the
 * per-layer seed a policy derives from its `seed` parameter, and each row's
 * bucket and sign that the sketch kernels compute from that seed.
 *
 * Pure static inline integer functions; the only include is <stdint.h>.
 * That is why a policy may include this one kernels header (STYLE.md keeps
 * policies away from kernels.h): reviver and the storage options' offload
 * sketch must hand the daemon exactly the seed the kernels hash with, and a
 * second copy of the derivation could drift. Nothing here touches K/V.
 */
#ifndef KVSTASH_KERNELS_SKETCH_HASH_H
#define KVSTASH_KERNELS_SKETCH_HASH_H

#include <stdint.h>

#define KV_SKETCH_GOLDEN 0x9E3779B97F4A7C15ull

/* The splitmix64 finaliser: x ^= x>>30; x *= 0xBF58476D1CE4E5B9;
 * x ^= x>>27; x *= 0x94D049BB133111EB; x ^= x>>31. */
static inline uint64_t kv_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}

/* The layer_seed of §3.2 for layer `layer` of a sequence whose seed
 * parameter is `base`: the (layer+1)-th output of splitmix64 started from
 * state `base`, mix64(base + 0x9E3779B97F4A7C15·(layer+1)). [RECON]: §3.2
 * leaves the per-layer seed open. */
static inline uint64_t kv_sketch_layer_seed(uint64_t base, uint32_t layer)
{
    return kv_mix64(base + KV_SKETCH_GOLDEN * ((uint64_t)layer + 1));
}

/* Row i's bucket mix64(J ^ S_i) mod buckets (*h) and sign (*g: +1 when
 * mix64(J ^ T_i) >> 63 == 0, else -1) for the token at absolute position J,
 * with S_i = 0x9E3779B97F4A7C15·(2i+1) ^ layer_seed and
 * T_i = S_i ^ 0xD1B54A32D192ED03. buckets must be > 0. */
static inline void kv_sketch_hash_row(uint64_t layer_seed, uint32_t i, uint32_t buckets, uint64_t J,
                                      uint32_t *h, int8_t *g)
{
    uint64_t s = KV_SKETCH_GOLDEN * (2 * (uint64_t)i + 1) ^ layer_seed;
    uint64_t t = s ^ 0xD1B54A32D192ED03ull;
    *h = (uint32_t)(kv_mix64(J ^ s) % buckets);
    *g = (kv_mix64(J ^ t) >> 63) == 0 ? 1 : -1;
}

#endif
