/*
 * test_kernels_sketch.c - the count-sketch kernels (kernels.h "Count
 * sketch") against POLICIES.md §3:
 * - the §3.2 hash family (kernels/sketch_hash.h): splitmix64 reference
 *   outputs, layer seeds, and h/g values computed by an independent Python
 *   transcription of §3.2; the list form equals the single form;
 * - T-KR1 (§3.7) through both kernels: every cell, every query, and the
 *   delete of J2 leaving J0, J1 and J3 unchanged; even-r lower median;
 * - a list equals its tokens one at a time (the reference, one-token
 *   segments): insert, query and revive, on seeded random tokens, for SUM
 *   and MEAN, 1..7 and 32 rows, every dtype, odd head sizes;
 * - a list split over threads gives the bytes of one thread;
 * - fast == reference (cells, counts and output bytes) for insert, query,
 *   revive and delete, and for three rows (the vector median) over NaNs,
 *   infinities, signed zeros and numbers fp16 cannot hold;
 * - with buckets enough that no token shares a cell, the round trip is
 *   exact, and deleting a token leaves every other estimate unchanged.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "sketch_hash.h"
#include "test_kernels_harness.h"

/* A sketch of zero cells and counts (free with sketch_free). */
static kv_sketch sketch_zeroed(uint32_t rows, uint32_t buckets, uint32_t dim, kv_estimate ke,
                               kv_estimate ve)
{
    size_t cells = (size_t)rows * buckets;
    return (kv_sketch){rows,
                       buckets,
                       dim,
                       ke,
                       ve,
                       xcalloc(cells * dim * sizeof(float)),
                       xcalloc(cells * dim * sizeof(float)),
                       xcalloc(cells * sizeof(int32_t))};
}

/* A deep copy into fresh arrays (free with sketch_free). */
static kv_sketch sketch_clone(const kv_sketch *s)
{
    size_t cells = (size_t)s->rows * s->buckets;
    kv_sketch c = *s;
    c.key = xcalloc(cells * s->dim * sizeof(float));
    c.value = xcalloc(cells * s->dim * sizeof(float));
    c.count = xcalloc(cells * sizeof(int32_t));
    memcpy(c.key, s->key, cells * s->dim * sizeof(float));
    memcpy(c.value, s->value, cells * s->dim * sizeof(float));
    memcpy(c.count, s->count, cells * sizeof(int32_t));
    return c;
}

static void sketch_free(kv_sketch *s)
{
    free(s->key);
    free(s->value);
    free(s->count);
}

static void expect_same_sketch(const kv_sketch *a, const kv_sketch *b, const char *what)
{
    size_t cells = (size_t)a->rows * a->buckets;
    if (memcmp(a->key, b->key, cells * a->dim * sizeof(float)) != 0 ||
        memcmp(a->value, b->value, cells * a->dim * sizeof(float)) != 0 ||
        memcmp(a->count, b->count, cells * sizeof(int32_t)) != 0)
        fail_msg("%s: sketches differ (rows %u buckets %u dim %u)", what, a->rows, a->buckets,
                 a->dim);
}

/* ---- hash ---- */

static void test_mix64_splitmix_reference(void **state)
{
    (void)state;
    /* splitmix64 seeded with 0: its first two outputs (Vigna's reference). */
    assert_true(kv_mix64(0x9E3779B97F4A7C15ull) == 0xE220A8397B1DCDAFull);
    assert_true(kv_mix64(0x3C6EF372FE94F82Aull) == 0x6E789E6AA1B965F4ull);
    assert_true(kv_mix64(0) == 0);
    /* layer_seed(base, l) = the (l+1)-th splitmix64 output from state base. */
    assert_true(kv_sketch_layer_seed(0, 0) == 0xE220A8397B1DCDAFull);
    assert_true(kv_sketch_layer_seed(0, 1) == 0x6E789E6AA1B965F4ull);
    assert_true(kv_sketch_layer_seed(7, 3) == 0x953AEB70673E29CBull);
}

static void test_hash_family(void **state)
{
    (void)state;
    /* h_i(J) = mix64(J ^ S_i) mod b, g_i(J) = +1 iff mix64(J ^ T_i) >> 63 == 0,
     * S_i = 0x9E37..15·(2i+1) ^ seed, T_i = S_i ^ 0xD1B5..03 (§3.2); values from
     * an independent Python transcription, r = 3, b = 6. */
    static const struct {
        uint64_t seed, J;
        uint32_t h[3];
        int8_t g[3];
    } v[] = {
        {0, 0, {1, 1, 1}, {-1, 1, -1}},
        {0, 1, {2, 1, 0}, {1, 1, 1}},
        {0, 1000, {4, 1, 5}, {1, -1, -1}},
        {0, 123456789, {0, 1, 3}, {-1, 1, -1}},
        {0x953AEB70673E29CBull, 0, {2, 5, 2}, {-1, 1, -1}},
        {0x953AEB70673E29CBull, 1, {4, 1, 0}, {1, -1, -1}},
        {0x953AEB70673E29CBull, 1000, {1, 2, 4}, {-1, -1, 1}},
        {0x953AEB70673E29CBull, 123456789, {3, 1, 4}, {1, -1, -1}},
    };
    for (size_t t = 0; t < sizeof v / sizeof v[0]; t++) {
        uint32_t h[3];
        int8_t g[3];
        kv_sketch_hash(v[t].seed, 3, 6, v[t].J, h, g);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(h[i], v[t].h[i]);
            assert_int_equal(g[i], v[t].g[i]);
        }
    }
}

/* The list form is the single form, token by token. */
static void test_hash_list(void **state)
{
    (void)state;
    uint64_t pos[5] = {0, 7, 1u << 20, 3, 7};
    uint32_t h[15], hh[3];
    int8_t g[15], gg[3];
    kv_sketch_hash_list(42, 3, 11, pos, 5, h, g);
    for (int i = 0; i < 5; i++) {
        kv_sketch_hash(42, 3, 11, pos[i], hh, gg);
        assert_memory_equal(h + 3 * i, hh, sizeof hh);
        assert_memory_equal(g + 3 * i, gg, sizeof gg);
    }
}

/* ---- T-KR1 through the kernels ---- */

static const uint32_t KR1_H[4][3] = {{0, 1, 2}, {1, 1, 0}, {2, 0, 2}, {0, 2, 1}};
static const int8_t KR1_G[4][3] = {{1, -1, 1}, {-1, 1, 1}, {1, 1, -1}, {1, -1, -1}};

/* One head of dim 2, fp32, 4 slots: block 0 holds J0..J3 (K then V);
 * block 1 receives queries. */
static const kv_layout KR1_L = {1, 4, 2, 4, 0};

static void kr1_pool(float pool[2][2][4][2])
{
    static const float K[4][2] = {{1, 0}, {0, 1}, {2, 2}, {-1, 1}};
    static const float V[4][2] = {{1, 2}, {3, -1}, {0, 1}, {2, 2}};
    memset(pool, 0, sizeof(float) * 32);
    memcpy(pool[0][0], K, sizeof K);
    memcpy(pool[0][1], V, sizeof V);
}

typedef void (*insert_fn)(kv_sketch *, const kv_layout *, kv_dtype, const uint8_t *,
                          const kv_segment *, size_t, const uint32_t *, const int8_t *);
typedef void (*query_fn)(const kv_sketch *, const uint32_t *, const int8_t *, const kv_layout *,
                         kv_dtype, uint8_t *, const kv_segment *, size_t);
typedef void (*revive_fn)(kv_sketch *, const uint32_t *, const int8_t *, const kv_layout *,
                          kv_dtype, uint8_t *, const kv_segment *, size_t);

/* Query token j (its h/g row) into block 1 slot 0; returns K and V there. */
static void kr1_query(query_fn q, const kv_sketch *s, float pool[2][2][4][2], int j, float *k,
                      float *v)
{
    kv_segment out = {1, 0, 1};
    q(s, KR1_H[j], KR1_G[j], &KR1_L, KV_FP32, (uint8_t *)pool, &out, 1);
    memcpy(k, pool[1][0][0], 8);
    memcpy(v, pool[1][1][0], 8);
}

static void expect2(const float *got, float a, float b)
{
    if (got[0] != a || got[1] != b)
        fail_msg("got [%g, %g], want [%g, %g]", (double)got[0], (double)got[1], (double)a,
                 (double)b);
}

static void kr1_run(insert_fn ins, query_fn q, revive_fn rev)
{
    float pool[2][2][4][2];
    float key[3 * 3 * 2] = {0}, value[3 * 3 * 2] = {0};
    int32_t count[9] = {0};
    kv_sketch s = {3, 3, 2, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM, key, value, count};
    kr1_pool(pool);
    kv_segment all = {0, 0, 4};
    ins(&s, &KR1_L, KV_FP32, (uint8_t *)pool, &all, 1, &KR1_H[0][0], &KR1_G[0][0]);
    /* §3.7 cells, rows x buckets x [2] */
    static const float CK[18] = {0, 1, 0, 1, 2, 2, 2, 2, 1, 1, -1, 1, 0, 1, -1, 1, 3, 2};
    static const float CV[18] = {3, 4, -3, 1, 0, 1, 0, 1, 2, -3, -2, -2, 3, -1, -2, -2, 1, 1};
    assert_memory_equal(key, CK, sizeof CK);
    assert_memory_equal(value, CV, sizeof CV);
    static const int32_t CNT[9] = {2, 1, 1, 1, 2, 1, 1, 1, 2};
    assert_memory_equal(count, CNT, sizeof CNT);

    float k[2], v[2];
    kr1_query(q, &s, pool, 0, k, v);
    expect2(k, 1, 1); /* true [1, 0] */
    expect2(v, 1, 3); /* true [1, 2] */
    kr1_query(q, &s, pool, 1, k, v);
    expect2(k, 0, 1);
    expect2(v, 3, -1);
    kr1_query(q, &s, pool, 2, k, v);
    expect2(k, 2, 2);
    expect2(v, 0, 1);
    kr1_query(q, &s, pool, 3, k, v);
    expect2(k, -1, 1);
    expect2(v, 2, 2);

    /* delete(J2, query(J2)): revive writes J2's estimate and subtracts it */
    kv_segment out = {1, 1, 1};
    rev(&s, KR1_H[2], KR1_G[2], &KR1_L, KV_FP32, (uint8_t *)pool, &out, 1);
    expect2(pool[1][0][1], 2, 2);
    expect2(pool[1][1][1], 0, 1);
    kr1_query(q, &s, pool, 0, k, v);
    expect2(k, 1, 1);
    expect2(v, 1, 3);
    kr1_query(q, &s, pool, 1, k, v);
    expect2(k, 0, 1);
    expect2(v, 3, -1);
    kr1_query(q, &s, pool, 3, k, v);
    expect2(k, -1, 1);
    expect2(v, 2, 2);
    static const int32_t CNT2[9] = {2, 1, 0, 0, 2, 1, 1, 1, 1};
    assert_memory_equal(count, CNT2, sizeof CNT2);
}

static void test_tkr1_ref(void **state)
{
    (void)state;
    kr1_run(kv_sketch_insert_ref, kv_sketch_query_ref, kv_sketch_revive_ref);
}

static void test_tkr1_fast(void **state)
{
    (void)state;
    kr1_run(kv_sketch_insert, kv_sketch_query, kv_sketch_revive);
}

/* Even r takes the lower middle (torch.median): 2 and 4 rows, one channel. */
static void test_even_rows_lower_median(void **state)
{
    (void)state;
    kv_layout l = {1, 1, 1, 4, 0};
    for (uint32_t rows = 2; rows <= 4; rows += 2) {
        float key[4] = {5, -1, 3, 9}, value[4] = {0}, pool[2] = {0, 0};
        int32_t count[4] = {1, 1, 1, 1};
        kv_sketch s = {rows, 1, 1, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM, key, value, count};
        uint32_t h[4] = {0, 0, 0, 0};
        int8_t g[4] = {1, 1, 1, 1};
        kv_segment seg = {0, 0, 1};
        kv_sketch_query(&s, h, g, &l, KV_FP32, (uint8_t *)pool, &seg, 1);
        /* rows 2: {5, -1} -> -1; rows 4: {5, -1, 3, 9} -> 3 */
        assert_true(pool[0] == (rows == 2 ? -1.0f : 3.0f));
        kv_sketch_query_ref(&s, h, g, &l, KV_FP32, (uint8_t *)pool, &seg, 1);
        assert_true(pool[0] == (rows == 2 ? -1.0f : 3.0f));
    }
}

/* ---- random: a list == its tokens, fast == ref ---- */

typedef struct setup {
    kv_layout l;
    kv_dtype t;
    uint32_t nb;
    uint8_t *pool;
    kv_segment *segs;
    size_t nsegs, ntok;
    uint32_t *h;
    int8_t *g;
} setup;

static void setup_make(setup *s, rng *r, kv_layout l, kv_dtype t, uint32_t rows, uint32_t buckets)
{
    s->l = l;
    s->t = t;
    s->nb = 4;
    s->pool = xcalloc(s->nb * kv_block_bytes(&l));
    s->segs = xcalloc(s->nb * l.block_tokens * sizeof *s->segs);
    fill_pool(r, s->pool, s->nb * kv_block_bytes(&l), t, 2.0f);
    s->nsegs = gen_disjoint(r, &l, 0, s->nb, s->segs);
    s->ntok = kv_segments_tokens(s->segs, s->nsegs);
    uint64_t *pos = xcalloc(s->ntok * sizeof *pos);
    for (size_t i = 0; i < s->ntok; i++)
        pos[i] = rng_below(r, 1000) + i * 1000; /* distinct positions */
    s->h = xcalloc(s->ntok * rows * sizeof *s->h);
    s->g = xcalloc(s->ntok * rows);
    kv_sketch_hash_list(rng_next(r), rows, buckets, pos, s->ntok, s->h, s->g);
    free(pos);
}

static void setup_free(setup *s)
{
    free(s->pool);
    free(s->segs);
    free(s->h);
    free(s->g);
}

/* The i-th token of the setup's list as a one-token segment. */
static kv_segment token_segment(const setup *s, size_t i)
{
    for (size_t q = 0; q < s->nsegs; q++) {
        if (i < s->segs[q].count)
            return (kv_segment){s->segs[q].block, s->segs[q].first_slot + (uint32_t)i, 1};
        i -= s->segs[q].count;
    }
    fail_msg("token %zu is past the list", i);
    return (kv_segment){0, 0, 0};
}

/* A list in one call (the fast kernel or the reference) equals the
 * reference called once per token, in list order: insert, then every query
 * (fp32 output), then revives of every other token. One sketch per side,
 * compared cell for cell. */
static void check_list_equals_tokens(rng *r, kv_layout l, kv_dtype t, uint32_t rows,
                                     uint32_t buckets, kv_estimate ke, kv_estimate ve, int fast)
{
    setup s;
    setup_make(&s, r, l, t, rows, buckets);
    uint32_t dim = l.kv_heads * l.head_dim;
    kv_sketch ka = sketch_zeroed(rows, buckets, dim, ke, ve);
    kv_sketch kb = sketch_clone(&ka);

    (fast ? kv_sketch_insert : kv_sketch_insert_ref)(&ka, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
    for (size_t i = 0; i < s.ntok; i++) {
        kv_segment one = token_segment(&s, i);
        kv_sketch_insert_ref(&kb, &l, t, s.pool, &one, 1, s.h + i * rows, s.g + i * rows);
    }
    expect_same_sketch(&ka, &kb, "list insert vs one token at a time");

    /* Queries into an fp32 pool of one block per token: kv_heads * 1 slot. */
    kv_layout lo = {l.kv_heads, 1, l.head_dim, 4, 0};
    size_t ob = kv_block_bytes(&lo);
    uint8_t *out = xcalloc(s.ntok * ob), *one_out = xcalloc(ob);
    kv_segment *os = xcalloc(s.ntok * sizeof *os);
    kv_segment at0 = {0, 0, 1};
    for (size_t i = 0; i < s.ntok; i++)
        os[i] = (kv_segment){(uint32_t)i, 0, 1};
    (fast ? kv_sketch_query : kv_sketch_query_ref)(&ka, s.h, s.g, &lo, KV_FP32, out, os, s.ntok);
    for (size_t i = 0; i < s.ntok; i++) {
        kv_sketch_query_ref(&kb, s.h + i * rows, s.g + i * rows, &lo, KV_FP32, one_out, &at0, 1);
        if (memcmp(out + i * ob, one_out, ob) != 0)
            fail_msg("query of token %zu differs from its query alone (rows %u, %s)", i, rows,
                     dtype_name(t));
    }

    /* Revive every other token, in order: the list vs token by token. */
    size_t nrev = 0;
    uint32_t *hr = xcalloc(s.ntok * rows * sizeof *hr);
    int8_t *gr = xcalloc(s.ntok * rows);
    for (size_t i = 0; i < s.ntok; i += 2, nrev++) {
        memcpy(hr + nrev * rows, s.h + i * rows, rows * sizeof *hr);
        memcpy(gr + nrev * rows, s.g + i * rows, rows);
    }
    memset(out, 0, s.ntok * ob);
    (fast ? kv_sketch_revive : kv_sketch_revive_ref)(&ka, hr, gr, &lo, KV_FP32, out, os, nrev);
    for (size_t i = 0; i < nrev; i++) {
        kv_sketch_revive_ref(&kb, hr + i * rows, gr + i * rows, &lo, KV_FP32, one_out, &at0, 1);
        if (memcmp(out + i * ob, one_out, ob) != 0)
            fail_msg("revive of token %zu differs from its revive alone", i);
    }
    expect_same_sketch(&ka, &kb, "list revive vs one token at a time");

    free(hr);
    free(gr);
    free(out);
    free(one_out);
    free(os);
    sketch_free(&ka);
    sketch_free(&kb);
    setup_free(&s);
}

static const uint32_t k_rows[] = {1, 2, 3, 4, 5, 7, 32};

static void test_list_equals_tokens(void **state)
{
    (void)state;
    rng r = {22};
    for (size_t si = 0; si < KH_SHAPES; si += 17) /* 23 shapes: every class of size */
        for (size_t ri = 0; ri < KH_N(k_rows); ri++)
            for (int mode = 0; mode < 4; mode++) {
                kv_dtype t;
                kv_layout l = kh_shape(si, &t);
                uint32_t buckets = 1 + rng_below(&r, 6);
                check_list_equals_tokens(&r, l, t, k_rows[ri], buckets, (kv_estimate)(mode & 1),
                                         (kv_estimate)(mode >> 1), (int)(si + ri) % 2);
            }
}

/* fast == ref for every operation, on the same random sketch state; the
 * query and revive outputs go to a pool of a random dtype. */
static void test_fast_equals_ref(void **state)
{
    (void)state;
    rng r = {23};
    for (size_t si = 0; si < KH_SHAPES; si += 3) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        uint32_t rows = k_rows[rng_below(&r, KH_N(k_rows))], buckets = 1 + rng_below(&r, 9);
        setup s;
        setup_make(&s, &r, l, t, rows, buckets);
        uint32_t dim = l.kv_heads * l.head_dim;
        kv_estimate ke = (kv_estimate)rng_below(&r, 2), ve = (kv_estimate)rng_below(&r, 2);
        kv_sketch a = sketch_zeroed(rows, buckets, dim, ke, ve);
        kv_sketch b = sketch_clone(&a);
        kv_sketch_insert_ref(&a, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
        kv_sketch_insert(&b, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
        expect_same_sketch(&a, &b, "insert");

        /* query and revive into a second pool of any dtype */
        kv_dtype to = dtype_of(rng_below(&r, 3));
        kv_layout lo = l;
        lo.elt_size = dtype_size(to);
        size_t ob = s.nb * kv_block_bytes(&lo);
        uint8_t *o1 = xcalloc(ob), *o2 = xcalloc(ob);
        kv_segment *os = xcalloc(s.nb * l.block_tokens * sizeof *os);
        size_t nos = gen_exact(&r, &lo, 0, s.nb, s.ntok, os);
        fill_bytes(&r, o1, ob);
        memcpy(o2, o1, ob);
        kv_sketch_query_ref(&a, s.h, s.g, &lo, to, o1, os, nos);
        kv_sketch_query(&b, s.h, s.g, &lo, to, o2, os, nos);
        assert_memory_equal(o1, o2, ob);
        expect_same_sketch(&a, &b, "query changed nothing");

        kv_sketch_revive_ref(&a, s.h, s.g, &lo, to, o1, os, nos);
        kv_sketch_revive(&b, s.h, s.g, &lo, to, o2, os, nos);
        assert_memory_equal(o1, o2, ob);
        expect_same_sketch(&a, &b, "revive");

        /* delete = revive without output, from the state after reinsert */
        kv_sketch_insert(&a, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
        kv_sketch_insert(&b, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
        kv_sketch_revive_ref(&a, s.h, s.g, &lo, to, NULL, os, nos);
        kv_sketch_delete(&b, s.h, s.g, s.ntok);
        expect_same_sketch(&a, &b, "delete");

        free(o1);
        free(o2);
        free(os);
        sketch_free(&a);
        sketch_free(&b);
        setup_free(&s);
    }
}

/* A cell element for test_median3_specials: mostly ordinary numbers, often
 * equal ones and zeros of either sign, and the values a conversion to fp16
 * treats apart: NaNs with payloads (quiet and signalling, either sign),
 * infinities, numbers past fp16's range and below its normals. */
static float special_float(rng *r)
{
    static const uint32_t bits[] = {
        0x7fc00123u, /* quiet NaN with a payload */
        0xffc00001u, /* the same, negative */
        0x7f800001u, /* signalling NaN */
        0xff812345u, /* signalling, negative */
        0x7f800000u, /* +inf */
        0xff800000u, /* -inf */
        0x00000000u, /* +0 */
        0x80000000u, /* -0 */
        0x47800000u, /* 65536: past fp16's largest, 65504 */
        0xc7c35000u, /* -1e5 */
        0x33d6bf95u, /* 1e-7: an fp16 subnormal */
        0x3f800000u, /* 1 */
        0xbf800000u, /* -1 */
    };
    uint32_t pick = rng_below(r, 3 * KH_N(bits));
    if (pick < KH_N(bits)) {
        float f;
        memcpy(&f, &bits[pick], sizeof f);
        return f;
    }
    return (float)((int)rng_below(r, 2001) - 1000) / 64.0f;
}

/* Whether two n-element arrays of IEEE floats of `elt` bytes (2: fp16, 4:
 * fp32) hold the same bits, any NaN matching any NaN. A revive adds
 * -1·estimate to each cell, and when both are NaN which one comes out (its
 * sign and payload) depends on the order the compiler puts the operands of
 * an addition in, and whether it folds -1·x into a negation: in the
 * reference as in the fast kernel, and apart at -O0 and -O2. */
static int same_or_both_nan(const void *a, const void *b, size_t n, size_t elt)
{
    uint32_t abs = elt == 2 ? 0x7fffu : 0x7fffffffu, inf = elt == 2 ? 0x7c00u : 0x7f800000u;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = 0, y = 0;
        memcpy(&x, (const uint8_t *)a + i * elt, elt);
        memcpy(&y, (const uint8_t *)b + i * elt, elt);
        if (x != y && !((x & abs) > inf && (y & abs) > inf))
            return 0;
    }
    return 1;
}

/* Three rows (the default) into fp16 and fp32 slots: the fast kernels'
 * vector median, and its fp16 store straight from registers, give the
 * reference's bytes for the special values above and for head sizes that
 * are and are not a multiple of the vector (a NaN median, which the vector
 * conversion would store with another payload, is stored the reference's
 * way). SUM and MEAN, query and revive (after which a NaN may be another
 * NaN: same_or_both_nan). */
static void test_median3_specials(void **state)
{
    (void)state;
    rng r = {25};
    static const uint32_t dims[] = {128, 16, 12, 40};
    for (size_t di = 0; di < KH_N(dims); di++)
        for (int mode = 0; mode < 4; mode++)
            for (int fp32 = 0; fp32 < 2; fp32++) {
                kv_dtype t = fp32 ? KV_FP32 : KV_FP16;
                kv_layout l = {2, 8, dims[di], fp32 ? 4u : 2u, 0};
                uint32_t rows = 3, buckets = 4, dim = l.kv_heads * l.head_dim;
                size_t cells = (size_t)rows * buckets, ntok = 2 * l.block_tokens;
                kv_sketch a = sketch_zeroed(rows, buckets, dim, (kv_estimate)(mode & 1),
                                            (kv_estimate)(mode >> 1));
                for (size_t i = 0; i < cells * dim; i++) {
                    a.key[i] = special_float(&r);
                    a.value[i] = special_float(&r);
                }
                for (size_t i = 0; i < cells; i++)
                    a.count[i] = (int32_t)rng_below(&r, 4);
                kv_sketch b = sketch_clone(&a);
                uint32_t *h = xcalloc(ntok * rows * sizeof *h);
                int8_t *g = xcalloc(ntok * rows);
                for (size_t i = 0; i < ntok * rows; i++) {
                    h[i] = rng_below(&r, buckets);
                    g[i] = rng_below(&r, 2) ? 1 : -1;
                }
                size_t pb = 2 * kv_block_bytes(&l);
                uint8_t *o1 = xcalloc(pb), *o2 = xcalloc(pb);
                kv_segment all[2] = {{0, 0, l.block_tokens}, {1, 0, l.block_tokens}};
                kv_sketch_query_ref(&a, h, g, &l, t, o1, all, 2);
                kv_sketch_query(&b, h, g, &l, t, o2, all, 2);
                assert_memory_equal(o1, o2, pb);
                kv_sketch_revive_ref(&a, h, g, &l, t, o1, all, 2);
                kv_sketch_revive(&b, h, g, &l, t, o2, all, 2);
                assert_true(same_or_both_nan(o1, o2, pb / l.elt_size, l.elt_size));
                assert_true(same_or_both_nan(a.key, b.key, cells * dim, 4));
                assert_true(same_or_both_nan(a.value, b.value, cells * dim, 4));
                assert_memory_equal(a.count, b.count, cells * sizeof *a.count);
                free(o1);
                free(o2);
                free(h);
                free(g);
                sketch_free(&a);
                sketch_free(&b);
            }
}

/* A list that splits over threads (insert: keys and values; query: tokens)
 * gives the cells and the bytes of one thread. */
static void test_threads_deterministic(void **state)
{
    (void)state;
    rng r = {26};
    kv_layout l = {8, 16, 128, 2, 0};
    uint32_t nb = 64, rows = 3, buckets = 16, dim = l.kv_heads * l.head_dim;
    size_t pb = nb * kv_block_bytes(&l), ntok = (size_t)nb * l.block_tokens;
    uint8_t *pool = xcalloc(pb), *o1 = xcalloc(pb), *o2 = xcalloc(pb);
    fill_pool(&r, pool, pb, KV_FP16, 4.0f);
    kv_segment *segs = xcalloc(nb * sizeof *segs);
    for (uint32_t b = 0; b < nb; b++)
        segs[b] = (kv_segment){nb - 1 - b, 0, l.block_tokens};
    uint64_t *pos = xcalloc(ntok * sizeof *pos);
    for (size_t i = 0; i < ntok; i++)
        pos[i] = i;
    uint32_t *h = xcalloc(ntok * rows * sizeof *h);
    int8_t *g = xcalloc(ntok * rows);
    kv_sketch_hash_list(9, rows, buckets, pos, ntok, h, g);
    kv_sketch a = sketch_zeroed(rows, buckets, dim, KV_ESTIMATE_SUM, KV_ESTIMATE_SUM);
    kv_sketch b = sketch_clone(&a);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_sketch_insert(&a, &l, KV_FP16, pool, segs, nb, h, g);
    kv_sketch_query(&a, h, g, &l, KV_FP16, o1, segs, nb);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_sketch_insert(&b, &l, KV_FP16, pool, segs, nb, h, g);
    kv_sketch_query(&b, h, g, &l, KV_FP16, o2, segs, nb);
    print_message("threads for this job: %u\n",
                  kv_parallel_threads(ntok * dim * (2 * 2 + 16 * rows)));
    expect_same_sketch(&a, &b, "threaded insert");
    assert_memory_equal(o1, o2, pb);
    free(pool);
    free(o1);
    free(o2);
    free(segs);
    free(pos);
    free(h);
    free(g);
    sketch_free(&a);
    sketch_free(&b);
}

/* fp16 buffers equal as numbers: bit for bit except that +0 and -0 match
 * (a cell starts at +0 and +0 + -0 = +0, and a value inserted with sign -1
 * comes back as -1 * (0 + -1 * v): zeros lose their sign, in the
 * reference as here). */
static void expect_same_halves(const uint8_t *a, const uint8_t *b, size_t bytes)
{
    for (size_t i = 0; i + 1 < bytes; i += 2) {
        uint16_t x = (uint16_t)(a[i] | a[i + 1] << 8), y = (uint16_t)(b[i] | b[i + 1] << 8);
        if (x != y && !((x | y) == 0x8000 && (x & y) == 0))
            fail_msg("fp16 element %zu: 0x%04x vs 0x%04x", i / 2, x, y);
    }
}

/* Buckets >> tokens: no two tokens share a cell in any row, so every query
 * returns exactly the inserted K/V (fp16 in, fp16 out; up to the sign of a
 * zero), and deleting tokens
 * leaves every other token's estimate unchanged. */
static void test_large_b_exact(void **state)
{
    (void)state;
    rng r = {24};
    for (int mode = 0; mode < 4; mode++) {
        kv_layout l = {3, 7, 18, 2, 0};
        setup s;
        uint32_t rows = 3, buckets = 1u << 16;
        setup_make(&s, &r, l, KV_FP16, rows, buckets);
        /* the premise: no shared cell */
        for (size_t i = 0; i < s.ntok; i++)
            for (size_t j = 0; j < i; j++)
                for (uint32_t q = 0; q < rows; q++)
                    assert_true(s.h[i * rows + q] != s.h[j * rows + q]);
        uint32_t dim = l.kv_heads * l.head_dim;
        kv_sketch sk =
            sketch_zeroed(rows, buckets, dim, (kv_estimate)(mode & 1), (kv_estimate)(mode >> 1));
        kv_sketch_insert(&sk, &l, KV_FP16, s.pool, s.segs, s.nsegs, s.h, s.g);
        size_t pb = s.nb * kv_block_bytes(&l);
        uint8_t *back = xcalloc(pb), *back2 = xcalloc(pb);
        kv_sketch_query(&sk, s.h, s.g, &l, KV_FP16, back, s.segs, s.nsegs);
        /* back holds exactly the listed slots of pool */
        kv_layout lk = l;
        uint8_t *k1 = xcalloc(pb), *v1 = xcalloc(pb), *k2 = xcalloc(pb), *v2 = xcalloc(pb);
        kv_gather(&lk, s.pool, s.segs, s.nsegs, k1, v1);
        kv_gather(&lk, back, s.segs, s.nsegs, k2, v2);
        size_t fb = (size_t)l.kv_heads * s.ntok * l.head_dim * 2;
        expect_same_halves(k1, k2, fb);
        expect_same_halves(v1, v2, fb);

        /* Delete the first half of the tokens; the rest query unchanged. */
        size_t nd = s.ntok / 2;
        kv_sketch_delete(&sk, s.h, s.g, nd);
        memset(back2, 0, pb);
        kv_sketch_query(&sk, s.h, s.g, &l, KV_FP16, back2, s.segs, s.nsegs);
        kv_gather(&lk, back2, s.segs, s.nsegs, k2, v2);
        for (uint32_t h = 0; h < l.kv_heads; h++) {
            size_t off = ((size_t)h * s.ntok + nd) * l.head_dim * 2;
            size_t len = (s.ntok - nd) * l.head_dim * 2;
            expect_same_halves(k1 + off, k2 + off, len);
            expect_same_halves(v1 + off, v2 + off, len);
        }
        free(k1);
        free(v1);
        free(k2);
        free(v2);
        free(back);
        free(back2);
        sketch_free(&sk);
        setup_free(&s);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mix64_splitmix_reference),
        cmocka_unit_test(test_hash_family),
        cmocka_unit_test(test_hash_list),
        cmocka_unit_test(test_tkr1_ref),
        cmocka_unit_test(test_tkr1_fast),
        cmocka_unit_test(test_even_rows_lower_median),
        cmocka_unit_test(test_list_equals_tokens),
        cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_median3_specials),
        cmocka_unit_test(test_threads_deterministic),
        cmocka_unit_test(test_large_b_exact),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
