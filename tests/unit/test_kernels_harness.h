/*
 * test_kernels_harness.h - shared pieces of the tier-kernel tests
 * (test_kernels_*.c): seeded randomness, random pools of finite elements,
 * segment lists, and shape tables with odd sizes. Header-only; every test
 * program includes it once.
 */
#ifndef KVSTASH_TEST_KERNELS_HARNESS_H
#define KVSTASH_TEST_KERNELS_HARNESS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* ---- seeded randomness (splitmix64) ---- */

typedef struct rng {
    uint64_t s;
} rng;

static inline uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint32_t rng_below(rng *r, uint32_t n)
{
    return (uint32_t)(rng_next(r) % n);
}

/* Uniform in [-1, 1). */
static inline float rng_float(rng *r)
{
    return (float)((double)(rng_next(r) >> 11) * 0x1p-52 - 1.0);
}

static inline void fill_bytes(rng *r, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(r);
}

/* Every element of a pool a finite value of type t: mostly uniform in
 * [-scale, scale), with exact zeros, ties (k + 0.5) / 8 and tiny values
 * mixed in. */
static inline void fill_pool(rng *r, uint8_t *pool, size_t bytes, kv_dtype t, float scale)
{
    size_t es = t == KV_FP32 ? 4 : 2;
    for (size_t off = 0; off + es <= bytes; off += es) {
        uint32_t kind = rng_below(r, 16);
        float v = rng_float(r) * scale;
        if (kind == 0)
            v = 0;
        else if (kind == 1)
            v = ((float)rng_below(r, 64) - 32.0f + 0.5f) / 8.0f;
        else if (kind == 2)
            v *= 1e-6f;
        kv_elt_store(pool + off, t, v);
    }
}

/* ---- segment lists ---- */

/* Cut blocks [lo, hi) into runs (mode 0 whole blocks, 1 single tokens, 2
 * random cuts). segs needs room for every slot. */
static inline size_t cut_blocks(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi, int mode,
                                kv_segment *segs)
{
    size_t n = 0;
    for (uint32_t b = lo; b < hi; b++) {
        uint32_t start = 0;
        for (uint32_t s = 1; s <= l->block_tokens; s++) {
            if (s == l->block_tokens || mode == 1 || (mode == 2 && rng_below(r, 3) == 0)) {
                segs[n++] = (kv_segment){b, start, s - start};
                start = s;
            }
        }
    }
    return n;
}

/* A random permutation of [0, n) in out. */
static inline void permutation(rng *r, uint32_t *out, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = i;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = rng_below(r, i), x = out[i - 1];
        out[i - 1] = out[j];
        out[j] = x;
    }
}

static inline void shuffle_segs(rng *r, kv_segment *segs, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = rng_below(r, (uint32_t)i);
        kv_segment t = segs[i - 1];
        segs[i - 1] = segs[j];
        segs[j] = t;
    }
}

/* Disjoint runs of blocks [lo, hi), shuffled, a random non-empty prefix. */
static inline size_t gen_disjoint(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi,
                                  kv_segment *segs)
{
    size_t n = cut_blocks(r, l, lo, hi, (int)rng_below(r, 3), segs);
    shuffle_segs(r, segs, n);
    return 1 + rng_below(r, (uint32_t)n);
}

/* Disjoint runs of blocks [lo, hi) naming exactly ntokens tokens (which
 * must fit); returns the number of runs. */
static inline size_t gen_exact(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi, size_t ntokens,
                               kv_segment *segs)
{
    size_t n = cut_blocks(r, l, lo, hi, (int)rng_below(r, 3), segs), have = 0, i = 0;
    shuffle_segs(r, segs, n);
    for (; i < n && have < ntokens; i++) {
        if (segs[i].count > ntokens - have)
            segs[i].count = (uint32_t)(ntokens - have);
        have += segs[i].count;
    }
    return i;
}

/* How many tokens a pool block of layout l holds in this tier (0: the
 * tier does not fit). */
static inline uint32_t tier_tokens(const kv_layout *l, uint8_t tier)
{
    switch (tier) {
    case KV_TIER_INT8:
        return kv_int8_tokens_per_block(l);
    case KV_TIER_INT4:
        return kv_lowbit_tokens_per_block(l, 4);
    case KV_TIER_INT2:
        return kv_lowbit_tokens_per_block(l, 2);
    default:
        return l->block_tokens;
    }
}

/* The most tokens a pool block of layout l holds in any tier. */
static inline uint32_t tier_tokens_max(const kv_layout *l)
{
    static const uint8_t tiers[] = {KV_TIER_INT8, KV_TIER_INT4, KV_TIER_INT2};
    uint32_t m = l->block_tokens;
    for (size_t i = 0; i < sizeof tiers; i++)
        m = tier_tokens(l, tiers[i]) > m ? tier_tokens(l, tiers[i]) : m;
    return m;
}

/* Quantise one block's worth of random values into pool block `at` in
 * `tier` (layout q: l with that tier's block_tokens), filling a random
 * number of its slots (the rest stay empty). */
static inline void fill_quantised(rng *r, const kv_layout *q, kv_dtype t, uint8_t tier, uint8_t *at)
{
    uint8_t *stage = calloc(kv_block_bytes(q) + 1, 1);
    if (stage == NULL)
        abort();
    uint32_t zero = 0;
    kv_segment filled = {0, 0, 1 + rng_below(r, q->block_tokens)};
    fill_pool(r, stage, kv_block_bytes(q), t, 1.0f);
    if (tier == KV_TIER_INT8)
        kv_int8_quantize_ref(q, t, stage, &filled, 1, at, &zero, 1);
    else
        kv_lowbit_quantize_ref(q, tier == KV_TIER_INT4 ? 4 : 2, t, stage, &filled, 1, at, &zero, 1);
    free(stage);
}

/*
 * A tiered list (kernels.h kv_decode_attention) over pool blocks [0, nb) of
 * layout l, elements of type t, which the caller has filled: each block
 * stays full precision or becomes, when it fits, a block of the INT8, INT4
 * or INT2 tier (tier_tokens; quantised from random values, some slots left
 * empty), about equally often; the list is runs of every block (cut by its
 * tier's tokens), shuffled together with their tiers, a random non-empty
 * prefix. segs and tiers need room for nb * tier_tokens_max(l) runs.
 * Returns the number of runs.
 */
static inline size_t gen_tiered(rng *r, const kv_layout *l, kv_dtype t, uint8_t *pool, uint32_t nb,
                                kv_segment *segs, uint8_t *tiers)
{
    static const uint8_t kinds[] = {KV_TIER_FULL, KV_TIER_INT8, KV_TIER_INT4, KV_TIER_INT2};
    size_t n = 0;
    for (uint32_t b = 0; b < nb; b++) {
        uint8_t tier = kinds[rng_below(r, sizeof kinds)];
        kv_layout q = *l;
        q.block_tokens = tier_tokens(l, tier);
        if (q.block_tokens == 0) {
            tier = KV_TIER_FULL;
            q = *l;
        }
        if (tier != KV_TIER_FULL)
            fill_quantised(r, &q, t, tier, pool + b * kv_block_bytes(l));
        size_t k = cut_blocks(r, &q, b, b + 1, (int)rng_below(r, 3), segs + n);
        memset(tiers + n, tier, k);
        n += k;
    }
    for (size_t i = n; i > 1; i--) { /* shuffle runs and tiers together */
        size_t j = rng_below(r, (uint32_t)i);
        kv_segment s = segs[i - 1];
        uint8_t tr = tiers[i - 1];
        segs[i - 1] = segs[j];
        tiers[i - 1] = tiers[j];
        segs[j] = s;
        tiers[j] = tr;
    }
    return 1 + rng_below(r, (uint32_t)n);
}

static inline kv_dtype dtype_of(uint32_t i)
{
    static const kv_dtype types[3] = {KV_FP16, KV_BF16, KV_FP32};
    return types[i % 3];
}

static inline uint32_t dtype_size(kv_dtype t)
{
    return t == KV_FP32 ? 4 : 2;
}

static inline const char *dtype_name(kv_dtype t)
{
    return t == KV_FP16 ? "fp16" : t == KV_BF16 ? "bf16" : "fp32";
}

/* Odd shapes and one realistic one; index i picks (heads, tokens, dim). */
static const uint32_t kh_heads[] = {1, 2, 3, 8};
static const uint32_t kh_tokens[] = {1, 3, 7, 16};
static const uint32_t kh_dims[] = {2, 6, 18, 64, 130, 300};
#define KH_N(a) (sizeof(a) / sizeof((a)[0]))
#define KH_SHAPES (KH_N(kh_heads) * KH_N(kh_tokens) * KH_N(kh_dims) * 3)

/* Shape i and its dtype (elt_size set to match). */
static inline kv_layout kh_shape(size_t i, kv_dtype *t)
{
    kv_layout l;
    l.head_dim = kh_dims[i % KH_N(kh_dims)];
    i /= KH_N(kh_dims);
    l.block_tokens = kh_tokens[i % KH_N(kh_tokens)];
    i /= KH_N(kh_tokens);
    l.kv_heads = kh_heads[i % KH_N(kh_heads)];
    i /= KH_N(kh_heads);
    *t = dtype_of((uint32_t)i);
    l.elt_size = dtype_size(*t);
    return l;
}

static inline void *xcalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (p == NULL)
        abort();
    return p;
}

/* Run a cmocka group once per build of the fast kernels (kernels.h: the
 * generic build, forced by KVSTASH_KERNEL_ISA=generic, the AVX2 build
 * without its AVX-512 loops (KVSTASH_KERNEL_ISA=avx2) where the CPU has
 * more, then the one this CPU picks, when it differs). Only for files that
 * include <cmocka.h>. */
#ifdef cmocka_unit_test
static inline int run_each_isa(const struct CMUnitTest *tests, size_t n)
{
    setenv("KVSTASH_KERNEL_ISA", "generic", 1);
    int rc = _cmocka_run_group_tests("generic build", tests, n, NULL, NULL);
    unsetenv("KVSTASH_KERNEL_ISA");
    if (strcmp(kv_kernel_isa(), "avx2+f16c+avx512f") == 0) {
        setenv("KVSTASH_KERNEL_ISA", "avx2", 1);
        rc |= _cmocka_run_group_tests("avx2+f16c", tests, n, NULL, NULL);
        unsetenv("KVSTASH_KERNEL_ISA");
    }
    if (strcmp(kv_kernel_isa(), "generic") != 0)
        rc |= _cmocka_run_group_tests(kv_kernel_isa(), tests, n, NULL, NULL);
    return rc;
}
#endif

#endif
