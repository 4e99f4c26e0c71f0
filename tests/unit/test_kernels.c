/*
 * test_kernels.c - property tests for kernels/: the fast CPU kernels match the
 * references byte for byte on seeded random shapes and segment lists, the
 * round trips are identities, and labelled pools show that each element lands
 * exactly where kernels.h says (so a bug shared by fast and ref still fails).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"

/* ---- seeded randomness (splitmix64: tiny, deterministic everywhere) ---- */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform-enough in [0, n); n > 0. */
static uint32_t rng_below(rng *r, uint32_t n)
{
    return (uint32_t)(rng_next(r) % n);
}

static void fill_random(rng *r, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(r);
}

/* ---- shapes: every combination of the odd sizes the brief asks for ---- */

static const uint32_t k_head_dims[] = {1, 3, 17, 64, 80};
static const uint32_t k_block_tokens[] = {1, 3, 7, 16};
static const uint32_t k_heads[] = {1, 2, 5};
static const uint32_t k_elts[] = {2, 4};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
#define N_SHAPES (N_OF(k_head_dims) * N_OF(k_block_tokens) * N_OF(k_heads) * N_OF(k_elts))
#define N_BLOCKS 6u /* even: copy tests split the pool in two halves */
#define TRIALS 12

static kv_layout shape(size_t i)
{
    kv_layout l;
    l.head_dim = k_head_dims[i % N_OF(k_head_dims)];
    i /= N_OF(k_head_dims);
    l.block_tokens = k_block_tokens[i % N_OF(k_block_tokens)];
    i /= N_OF(k_block_tokens);
    l.kv_heads = k_heads[i % N_OF(k_heads)];
    i /= N_OF(k_heads);
    l.elt_size = k_elts[i % N_OF(k_elts)];
    return l;
}

static size_t row_bytes(const kv_layout *l)
{
    return (size_t)l->head_dim * l->elt_size;
}

/* Bytes of one [kv_heads][ntokens][head_dim] buffer. */
static size_t flat_bytes(const kv_layout *l, size_t ntokens)
{
    return (size_t)l->kv_heads * ntokens * row_bytes(l);
}

/* Fail with the shape and first differing byte when a and b differ. */
static void expect_same(const uint8_t *a, const uint8_t *b, size_t n, const kv_layout *l,
                        const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (a[i] != b[i])
            fail_msg("%s: byte %zu of %zu differs (%u vs %u), heads=%u block_tokens=%u "
                     "head_dim=%u elt=%u",
                     what, i, n, a[i], b[i], l->kv_heads, l->block_tokens, l->head_dim,
                     l->elt_size);
    }
}

/* ---- segment lists ---- */

/* Arbitrary segments, possibly overlapping: fine for gather (reads only).
 * Counts mix single tokens, whole blocks and random runs. */
static size_t gen_any(rng *r, const kv_layout *l, uint32_t nblocks, kv_segment *segs, size_t max)
{
    size_t n = 1 + rng_below(r, (uint32_t)max);
    for (size_t i = 0; i < n; i++) {
        uint32_t kind = rng_below(r, 3);
        segs[i].block = rng_below(r, nblocks);
        if (kind == 0) { /* whole block */
            segs[i].first_slot = 0;
            segs[i].count = l->block_tokens;
        } else {
            segs[i].first_slot = rng_below(r, l->block_tokens);
            uint32_t room = l->block_tokens - segs[i].first_slot;
            segs[i].count = kind == 1 ? 1 : 1 + rng_below(r, room);
        }
    }
    return n;
}

/* Cut the slots of blocks [lo, hi) into runs: mode 0 whole blocks, 1 single
 * tokens, 2 random cuts. Returns the number of runs in segs (room for every
 * slot). */
static size_t cut_blocks(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi, int mode,
                         kv_segment *segs)
{
    size_t n = 0;
    for (uint32_t b = lo; b < hi; b++) {
        uint32_t start = 0;
        for (uint32_t s = 1; s <= l->block_tokens; s++) {
            int cut = s == l->block_tokens || mode == 1 || (mode == 2 && rng_below(r, 3) == 0);
            if (cut) {
                segs[n++] = (kv_segment){b, start, s - start};
                start = s;
            }
        }
    }
    return n;
}

static void shuffle(rng *r, kv_segment *segs, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = rng_below(r, (uint32_t)i);
        kv_segment t = segs[i - 1];
        segs[i - 1] = segs[j];
        segs[j] = t;
    }
}

/* Disjoint segments in blocks [lo, hi), random order, a random non-empty
 * subset of the runs. */
static size_t gen_disjoint(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi, kv_segment *segs)
{
    size_t n = cut_blocks(r, l, lo, hi, (int)rng_below(r, 3), segs);
    shuffle(r, segs, n);
    return 1 + rng_below(r, (uint32_t)n);
}

/* Disjoint segments in blocks [lo, hi) naming exactly `ntokens` tokens (the
 * last run is truncated); ntokens must fit. */
static size_t gen_exact(rng *r, const kv_layout *l, uint32_t lo, uint32_t hi, size_t ntokens,
                        kv_segment *segs)
{
    size_t n = cut_blocks(r, l, lo, hi, (int)rng_below(r, 3), segs);
    size_t have = 0, i = 0;
    shuffle(r, segs, n);
    for (; i < n && have < ntokens; i++) {
        if (segs[i].count > ntokens - have)
            segs[i].count = (uint32_t)(ntokens - have);
        have += segs[i].count;
    }
    assert_int_equal(have, ntokens);
    return i;
}

/* ---- a per-shape workspace ---- */

typedef struct ws {
    kv_layout l;
    size_t pool_bytes, max_segs, max_flat;
    uint8_t *pool, *pool2, *pool3;
    uint8_t *k1, *v1, *k2, *v2;
    kv_segment *segs, *segs2;
} ws;

static void ws_init(ws *w, size_t shape_index)
{
    w->l = shape(shape_index);
    w->pool_bytes = N_BLOCKS * kv_block_bytes(&w->l);
    /* gen_any may name up to max_segs whole blocks, so size the flat buffers
     * for that many tokens. */
    w->max_segs = (size_t)N_BLOCKS * w->l.block_tokens;
    w->max_flat = flat_bytes(&w->l, w->max_segs * w->l.block_tokens);
    w->pool = malloc(w->pool_bytes);
    w->pool2 = malloc(w->pool_bytes);
    w->pool3 = malloc(w->pool_bytes);
    w->k1 = malloc(w->max_flat);
    w->v1 = malloc(w->max_flat);
    w->k2 = malloc(w->max_flat);
    w->v2 = malloc(w->max_flat);
    w->segs = malloc(w->max_segs * sizeof(kv_segment));
    w->segs2 = malloc(w->max_segs * sizeof(kv_segment));
    assert_true(w->pool && w->pool2 && w->pool3 && w->k1 && w->v1 && w->k2 && w->v2 && w->segs &&
                w->segs2);
}

static void ws_free(ws *w)
{
    free(w->pool);
    free(w->pool2);
    free(w->pool3);
    free(w->k1);
    free(w->v1);
    free(w->k2);
    free(w->v2);
    free(w->segs);
    free(w->segs2);
}

/* ---- labelled pools: element (b, kv, h, s, e) holds a 32-bit tag ---- */

static uint32_t tag(uint32_t b, uint32_t kv, uint32_t h, uint32_t s, uint32_t e)
{
    return 0x80000000u | b << 24 | kv << 23 | h << 16 | s << 8 | e;
}

/* Write tags walking the pool front to back in the nesting order of
 * kernels.h ([block][K,V][head][slot][elem]); elt_size must be 4. */
static void fill_tags(const kv_layout *l, uint32_t nblocks, uint8_t *pool)
{
    uint8_t *p = pool;
    for (uint32_t b = 0; b < nblocks; b++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t s = 0; s < l->block_tokens; s++)
                    for (uint32_t e = 0; e < l->head_dim; e++, p += 4) {
                        uint32_t t = tag(b, kv, h, s, e);
                        memcpy(p, &t, 4);
                    }
}

static uint32_t load32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- tests ---- */

static void test_layout_values(void **state)
{
    (void)state;
    kv_layout l = {.kv_heads = 3, .block_tokens = 5, .head_dim = 7, .elt_size = 2};
    /* row = 14 bytes; block = 2 * 3 * 5 * 14 */
    assert_int_equal(kv_block_bytes(&l), 420);
    assert_int_equal(kv_key_offset(&l, 0, 0, 0), 0);
    assert_int_equal(kv_key_offset(&l, 0, 0, 1), 14);
    assert_int_equal(kv_key_offset(&l, 0, 1, 0), 70);
    assert_int_equal(kv_key_offset(&l, 2, 1, 4), 840 + 9 * 14);

    /* 64 heads x 256 tokens x 256 dims x fp32: offsets past 4 GiB. */
    kv_layout big = {.kv_heads = 64, .block_tokens = 256, .head_dim = 256, .elt_size = 4};
    assert_int_equal(kv_block_bytes(&big), 33554432ull);
    assert_true(kv_key_offset(&big, 200, 63, 255) ==
                200ull * 33554432ull + (63ull * 256 + 255) * 1024);

    kv_segment segs[] = {{0, 0, 5}, {3, 2, 1}, {1, 4, 0}, {2, 1, 3}};
    assert_int_equal(kv_segments_tokens(segs, 4), 9);
    assert_int_equal(kv_segments_tokens(segs, 0), 0);
}

static void test_gather_matches_ref(void **state)
{
    (void)state;
    rng r = {1};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        for (int trial = 0; trial < TRIALS; trial++) {
            fill_random(&r, w.pool, w.pool_bytes);
            size_t n = gen_any(&r, &w.l, N_BLOCKS, w.segs, w.max_segs);
            size_t fb = flat_bytes(&w.l, kv_segments_tokens(w.segs, n));
            /* Same junk in both outputs so untouched bytes compare equal too. */
            fill_random(&r, w.k1, w.max_flat);
            memcpy(w.k2, w.k1, w.max_flat);
            memcpy(w.v1, w.k1, w.max_flat);
            memcpy(w.v2, w.k1, w.max_flat);
            kv_gather_ref(&w.l, w.pool, w.segs, n, w.k1, w.v1);
            kv_gather(&w.l, w.pool, w.segs, n, w.k2, w.v2);
            expect_same(w.k1, w.k2, w.max_flat, &w.l, "gather K");
            expect_same(w.v1, w.v2, w.max_flat, &w.l, "gather V");
            /* Bytes past the output are not written. */
            expect_same(w.k1 + fb, w.v1 + fb, w.max_flat - fb, &w.l, "gather tail");
        }
        ws_free(&w);
    }
}

/* Check a gathered [heads][ntokens][head_dim] buffer against the tags of the
 * named slots, walking segments in order. */
static void check_gathered_tags(const kv_layout *l, const kv_segment *segs, size_t n,
                                const uint8_t *out, uint32_t kv)
{
    const uint8_t *p = out;
    for (uint32_t h = 0; h < l->kv_heads; h++)
        for (size_t i = 0; i < n; i++)
            for (uint32_t j = 0; j < segs[i].count; j++)
                for (uint32_t e = 0; e < l->head_dim; e++, p += 4) {
                    uint32_t want = tag(segs[i].block, kv, h, segs[i].first_slot + j, e);
                    if (load32(p) != want)
                        fail_msg("kv=%u head=%u seg=%zu tok=%u e=%u: got %08x want %08x", kv, h, i,
                                 j, e, load32(p), want);
                }
}

static void test_gather_puts_each_element_in_place(void **state)
{
    (void)state;
    rng r = {2};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        if (w.l.elt_size == 4) {
            fill_tags(&w.l, N_BLOCKS, w.pool);
            for (int trial = 0; trial < TRIALS; trial++) {
                size_t n = gen_any(&r, &w.l, N_BLOCKS, w.segs, w.max_segs);
                kv_gather(&w.l, w.pool, w.segs, n, w.k1, w.v1);
                check_gathered_tags(&w.l, w.segs, n, w.k1, 0);
                check_gathered_tags(&w.l, w.segs, n, w.v1, 1);
                kv_gather_ref(&w.l, w.pool, w.segs, n, w.k2, w.v2);
                check_gathered_tags(&w.l, w.segs, n, w.k2, 0);
                check_gathered_tags(&w.l, w.segs, n, w.v2, 1);
            }
        }
        ws_free(&w);
    }
}

static void test_scatter_matches_ref(void **state)
{
    (void)state;
    rng r = {3};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        for (int trial = 0; trial < TRIALS; trial++) {
            /* Half the trials overlap: later segments win in both versions. */
            size_t n = trial % 2 ? gen_any(&r, &w.l, N_BLOCKS, w.segs, w.max_segs)
                                 : gen_disjoint(&r, &w.l, 0, N_BLOCKS, w.segs);
            size_t fb = flat_bytes(&w.l, kv_segments_tokens(w.segs, n));
            fill_random(&r, w.pool, w.pool_bytes);
            memcpy(w.pool2, w.pool, w.pool_bytes);
            fill_random(&r, w.k1, fb);
            fill_random(&r, w.v1, fb);
            kv_scatter_ref(&w.l, w.pool, w.segs, n, w.k1, w.v1);
            kv_scatter(&w.l, w.pool2, w.segs, n, w.k1, w.v1);
            expect_same(w.pool, w.pool2, w.pool_bytes, &w.l, "scatter pool");
        }
        ws_free(&w);
    }
}

/* gather then scatter into a scribbled copy restores the pool; scatter then
 * gather returns the input. */
static void test_round_trips(void **state)
{
    (void)state;
    rng r = {4};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        for (int trial = 0; trial < TRIALS; trial++) {
            size_t n = gen_disjoint(&r, &w.l, 0, N_BLOCKS, w.segs);
            size_t fb = flat_bytes(&w.l, kv_segments_tokens(w.segs, n));

            fill_random(&r, w.pool, w.pool_bytes);
            memcpy(w.pool2, w.pool, w.pool_bytes);
            kv_gather(&w.l, w.pool, w.segs, n, w.k1, w.v1);
            fill_random(&r, w.k2, fb); /* scribble over the named slots */
            fill_random(&r, w.v2, fb);
            kv_scatter(&w.l, w.pool2, w.segs, n, w.k2, w.v2);
            kv_scatter(&w.l, w.pool2, w.segs, n, w.k1, w.v1);
            expect_same(w.pool, w.pool2, w.pool_bytes, &w.l, "scatter(gather(pool))");

            fill_random(&r, w.k1, fb);
            fill_random(&r, w.v1, fb);
            kv_scatter(&w.l, w.pool, w.segs, n, w.k1, w.v1);
            kv_gather(&w.l, w.pool, w.segs, n, w.k2, w.v2);
            expect_same(w.k1, w.k2, fb, &w.l, "gather(scatter(K))");
            expect_same(w.v1, w.v2, fb, &w.l, "gather(scatter(V))");
        }
        ws_free(&w);
    }
}

/* Source in the first half of the pool, destination (fresh blocks, as the
 * daemon does) in the second, same number of tokens. Returns ndst. */
static size_t gen_copy_lists(rng *r, ws *w, size_t *nsrc)
{
    *nsrc = gen_disjoint(r, &w->l, 0, N_BLOCKS / 2, w->segs);
    size_t ntok = kv_segments_tokens(w->segs, *nsrc);
    return gen_exact(r, &w->l, N_BLOCKS / 2, N_BLOCKS, ntok, w->segs2);
}

static void test_copy_tokens_matches_ref(void **state)
{
    (void)state;
    rng r = {5};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        for (int trial = 0; trial < TRIALS; trial++) {
            size_t nsrc, ndst = gen_copy_lists(&r, &w, &nsrc);
            fill_random(&r, w.pool, w.pool_bytes);
            memcpy(w.pool2, w.pool, w.pool_bytes);
            memcpy(w.pool3, w.pool, w.pool_bytes);
            kv_copy_tokens_ref(&w.l, w.pool, w.segs, nsrc, w.segs2, ndst);
            kv_copy_tokens(&w.l, w.pool2, w.segs, nsrc, w.segs2, ndst);
            expect_same(w.pool, w.pool2, w.pool_bytes, &w.l, "copy_tokens pool");
            /* And something moved (random bytes: a source row equal to its
             * destination is a 1 in 2^16 chance at worst, and the seed is
             * fixed). */
            assert_memory_not_equal(w.pool, w.pool3, w.pool_bytes);
        }
        ws_free(&w);
    }
}

/* Map each destination (block, slot) to 1 + the index of its source token. */
static void dst_map(const kv_layout *l, const kv_segment *dst, size_t ndst, size_t *map)
{
    size_t t = 0;
    memset(map, 0, N_BLOCKS * l->block_tokens * sizeof(size_t));
    for (size_t i = 0; i < ndst; i++)
        for (uint32_t j = 0; j < dst[i].count; j++)
            map[(size_t)dst[i].block * l->block_tokens + dst[i].first_slot + j] = ++t;
}

/* The (block, slot) of token t (0-based) of a segment list. */
static kv_segment token_at(const kv_segment *segs, size_t n, size_t t)
{
    for (size_t i = 0; i < n; t -= segs[i].count, i++)
        if (t < segs[i].count)
            return (kv_segment){segs[i].block, segs[i].first_slot + (uint32_t)t, 1};
    fail_msg("token %zu past the list", t);
    return (kv_segment){0, 0, 0};
}

/* Every element of the pool after copy_tokens on a tagged pool: named
 * destinations hold their source's tag, everything else its own. */
static void check_copied_tags(const kv_layout *l, const uint8_t *pool, const kv_segment *src,
                              size_t nsrc, const size_t *map)
{
    const uint8_t *p = pool;
    for (uint32_t b = 0; b < N_BLOCKS; b++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t s = 0; s < l->block_tokens; s++) {
                    size_t m = map[(size_t)b * l->block_tokens + s];
                    kv_segment from = m ? token_at(src, nsrc, m - 1) : (kv_segment){b, s, 1};
                    for (uint32_t e = 0; e < l->head_dim; e++, p += 4) {
                        uint32_t want = tag(from.block, kv, h, from.first_slot, e);
                        if (load32(p) != want)
                            fail_msg("block=%u kv=%u head=%u slot=%u e=%u: got %08x want %08x", b,
                                     kv, h, s, e, load32(p), want);
                    }
                }
}

static void test_copy_tokens_moves_exactly_the_named_tokens(void **state)
{
    (void)state;
    rng r = {6};
    for (size_t si = 0; si < N_SHAPES; si++) {
        ws w;
        ws_init(&w, si);
        size_t *map = malloc(N_BLOCKS * w.l.block_tokens * sizeof(size_t));
        assert_non_null(map);
        for (int trial = 0; w.l.elt_size == 4 && trial < TRIALS; trial++) {
            size_t nsrc, ndst = gen_copy_lists(&r, &w, &nsrc);
            dst_map(&w.l, w.segs2, ndst, map);
            fill_tags(&w.l, N_BLOCKS, w.pool);
            kv_copy_tokens(&w.l, w.pool, w.segs, nsrc, w.segs2, ndst);
            check_copied_tags(&w.l, w.pool, w.segs, nsrc, map);
            fill_tags(&w.l, N_BLOCKS, w.pool);
            kv_copy_tokens_ref(&w.l, w.pool, w.segs, nsrc, w.segs2, ndst);
            check_copied_tags(&w.l, w.pool, w.segs, nsrc, map);
        }
        free(map);
        ws_free(&w);
    }
}

/* Empty lists and zero-count segments touch nothing. */
static void test_empty_lists_write_nothing(void **state)
{
    (void)state;
    rng r = {7};
    ws w;
    ws_init(&w, 17);
    kv_segment zero[] = {{1, 0, 0}, {2, w.l.block_tokens - 1, 0}};
    fill_random(&r, w.pool, w.pool_bytes);
    memcpy(w.pool2, w.pool, w.pool_bytes);
    fill_random(&r, w.k1, w.max_flat);
    memcpy(w.k2, w.k1, w.max_flat);

    kv_gather(&w.l, w.pool, zero, 2, w.k1, w.k1);
    kv_gather(&w.l, w.pool, NULL, 0, w.k1, w.k1);
    expect_same(w.k1, w.k2, w.max_flat, &w.l, "empty gather");
    kv_scatter(&w.l, w.pool, zero, 2, w.k1, w.k1);
    kv_copy_tokens(&w.l, w.pool, zero, 2, zero, 1);
    kv_copy_tokens(&w.l, w.pool, NULL, 0, NULL, 0);
    kv_copy_tokens_ref(&w.l, w.pool, zero, 2, zero, 1);
    expect_same(w.pool, w.pool2, w.pool_bytes, &w.l, "empty scatter/copy");
    ws_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_values),
        cmocka_unit_test(test_gather_matches_ref),
        cmocka_unit_test(test_gather_puts_each_element_in_place),
        cmocka_unit_test(test_scatter_matches_ref),
        cmocka_unit_test(test_round_trips),
        cmocka_unit_test(test_copy_tokens_matches_ref),
        cmocka_unit_test(test_copy_tokens_moves_exactly_the_named_tokens),
        cmocka_unit_test(test_empty_lists_write_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
