/*
 * test_kernels_sketch.c - the count-sketch kernels (kernels.h "Count
 * sketch") against POLICIES.md §3 and policies/reviver.h:
 * - kv_sketch_hash == reviver_hash, bit for bit;
 * - T-KR1 (§3.7) through both kernels: every cell, every query, and the
 *   delete of J2 leaving J0, J1 and J3 unchanged; even-r lower median;
 * - the kernels equal reviver_sketch_insert / _query / _delete exactly on
 *   seeded random tokens (one set of arrays viewed as both structs), for
 *   SUM and MEAN, 1..7 and 32 rows, every dtype, odd head sizes;
 * - fast == reference (cells, counts and output bytes) for insert, query,
 *   revive and delete;
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
#include "reviver.h"
#include "test_kernels_harness.h"

/* ---- a kv_sketch view of a reviver_sketch (same arrays) ---- */

static kv_sketch view(const reviver_sketch *r)
{
    kv_sketch k = {r->rows,
                   r->buckets,
                   (uint32_t)r->dim,
                   (kv_estimate)r->key_estimate,
                   (kv_estimate)r->value_estimate,
                   r->key,
                   r->value,
                   r->count};
    return k;
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

static void test_hash_equals_reviver(void **state)
{
    (void)state;
    rng r = {21};
    for (int trial = 0; trial < 2000; trial++) {
        uint64_t seed = rng_next(&r), J = trial < 1000 ? (uint64_t)trial : rng_next(&r);
        uint32_t rows = 1 + rng_below(&r, KV_SKETCH_MAX_ROWS);
        uint32_t buckets = 1 + rng_below(&r, trial % 2 ? 7 : 100000);
        uint32_t h1[KV_SKETCH_MAX_ROWS], h2[KV_SKETCH_MAX_ROWS];
        int8_t g1[KV_SKETCH_MAX_ROWS], g2[KV_SKETCH_MAX_ROWS];
        reviver_hash(seed, rows, buckets, J, h1, g1);
        kv_sketch_hash(seed, rows, buckets, J, h2, g2);
        assert_memory_equal(h1, h2, rows * sizeof(uint32_t));
        assert_memory_equal(g1, g2, rows);
    }
    /* The list form is the single form, token by token. */
    uint64_t pos[5] = {0, 7, 1u << 20, 3, 7};
    uint32_t h[15], hh[3];
    int8_t g[15], gg[3];
    kv_sketch_hash_list(42, 3, 11, pos, 5, h, g);
    for (int i = 0; i < 5; i++) {
        reviver_hash(42, 3, 11, pos[i], hh, gg);
        assert_memory_equal(h + 3 * i, hh, sizeof hh);
        assert_memory_equal(g + 3 * i, gg, sizeof gg);
    }
}

/* ---- T-KR1 through the kernels ---- */

static const uint32_t KR1_H[4][3] = {{0, 1, 2}, {1, 1, 0}, {2, 0, 2}, {0, 2, 1}};
static const int8_t KR1_G[4][3] = {{1, -1, 1}, {-1, 1, 1}, {1, 1, -1}, {1, -1, -1}};

/* One head of dim 2, fp32, 4 slots: block 0 holds J0..J3 (K then V);
 * block 1 receives queries. */
static const kv_layout KR1_L = {1, 4, 2, 4};

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
    kv_layout l = {1, 1, 1, 4};
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

/* ---- random: kernels == reviver.h, fast == ref ---- */

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

/* The i-th token's K and V as [dim] float vectors, via kv_elt_load. */
static void token_vectors(const setup *s, size_t i, float *k, float *v)
{
    size_t n = i;
    uint32_t blk = 0, slot = 0;
    for (size_t q = 0; q < s->nsegs; q++) {
        if (n < s->segs[q].count) {
            blk = s->segs[q].block;
            slot = s->segs[q].first_slot + (uint32_t)n;
            break;
        }
        n -= s->segs[q].count;
    }
    size_t half = kv_block_bytes(&s->l) / 2;
    for (uint32_t h = 0; h < s->l.kv_heads; h++)
        for (uint32_t j = 0; j < s->l.head_dim; j++) {
            size_t off = kv_key_offset(&s->l, blk, h, slot) + (size_t)j * s->l.elt_size;
            k[h * s->l.head_dim + j] = kv_elt_load(s->pool + off, s->t);
            v[h * s->l.head_dim + j] = kv_elt_load(s->pool + off + half, s->t);
        }
}

/* Insert with the kernel into a reviver_sketch's own arrays and with
 * reviver_sketch_insert into another: equal. Then every query equal (fp32
 * output), then revives (kernel) vs query + delete (reviver) equal. */
static void check_against_reviver(rng *r, kv_layout l, kv_dtype t, uint32_t rows, uint32_t buckets,
                                  reviver_estimate ke, reviver_estimate ve, int fast)
{
    setup s;
    setup_make(&s, r, l, t, rows, buckets);
    uint32_t dim = l.kv_heads * l.head_dim;
    reviver_sketch a, b;
    assert_int_equal(reviver_sketch_init(&a, rows, buckets, dim, ke, ve), 0);
    assert_int_equal(reviver_sketch_init(&b, rows, buckets, dim, ke, ve), 0);
    kv_sketch ka = view(&a), kb = view(&b);
    float *k = xcalloc(dim * sizeof(float)), *v = xcalloc(dim * sizeof(float));
    float *k2 = xcalloc(dim * sizeof(float)), *v2 = xcalloc(dim * sizeof(float));

    (fast ? kv_sketch_insert : kv_sketch_insert_ref)(&ka, &l, t, s.pool, s.segs, s.nsegs, s.h, s.g);
    for (size_t i = 0; i < s.ntok; i++) {
        token_vectors(&s, i, k, v);
        reviver_sketch_insert(&b, s.h + i * rows, s.g + i * rows, k, v);
    }
    expect_same_sketch(&ka, &kb, "insert vs reviver_sketch_insert");

    /* Queries into an fp32 pool of one block per token: kv_heads * 1 slot. */
    kv_layout lo = {l.kv_heads, 1, l.head_dim, 4};
    uint8_t *out = xcalloc(s.ntok * kv_block_bytes(&lo));
    kv_segment *os = xcalloc(s.ntok * sizeof *os);
    for (size_t i = 0; i < s.ntok; i++)
        os[i] = (kv_segment){(uint32_t)i, 0, 1};
    (fast ? kv_sketch_query : kv_sketch_query_ref)(&ka, s.h, s.g, &lo, KV_FP32, out, os, s.ntok);
    for (size_t i = 0; i < s.ntok; i++) {
        reviver_sketch_query(&b, s.h + i * rows, s.g + i * rows, k, v);
        const uint8_t *blk = out + i * kv_block_bytes(&lo);
        if (memcmp(blk, k, dim * 4) != 0 || memcmp(blk + dim * 4, v, dim * 4) != 0)
            fail_msg("query of token %zu differs from reviver_sketch_query (rows %u, %s)", i, rows,
                     dtype_name(t));
    }

    /* Revive every other token, in order: kernel vs reviver query+delete. */
    size_t nrev = 0;
    uint32_t *hr = xcalloc(s.ntok * rows * sizeof *hr);
    int8_t *gr = xcalloc(s.ntok * rows);
    for (size_t i = 0; i < s.ntok; i += 2, nrev++) {
        memcpy(hr + nrev * rows, s.h + i * rows, rows * sizeof *hr);
        memcpy(gr + nrev * rows, s.g + i * rows, rows);
    }
    memset(out, 0, s.ntok * kv_block_bytes(&lo));
    (fast ? kv_sketch_revive : kv_sketch_revive_ref)(&ka, hr, gr, &lo, KV_FP32, out, os, nrev);
    for (size_t i = 0; i < nrev; i++) {
        reviver_sketch_query(&b, hr + i * rows, gr + i * rows, k, v);
        reviver_sketch_delete(&b, hr + i * rows, gr + i * rows, k, v);
        const uint8_t *blk = out + i * kv_block_bytes(&lo);
        if (memcmp(blk, k, dim * 4) != 0 || memcmp(blk + dim * 4, v, dim * 4) != 0)
            fail_msg("revive of token %zu differs from reviver query+delete", i);
    }
    expect_same_sketch(&ka, &kb, "revive vs reviver query+delete");

    free(hr);
    free(gr);
    free(out);
    free(os);
    free(k);
    free(v);
    free(k2);
    free(v2);
    reviver_sketch_free(&a);
    reviver_sketch_free(&b);
    setup_free(&s);
}

static const uint32_t k_rows[] = {1, 2, 3, 4, 5, 7, 32};

static void test_equals_reviver(void **state)
{
    (void)state;
    rng r = {22};
    for (size_t si = 0; si < KH_SHAPES; si += 17) /* 23 shapes: every class of size */
        for (size_t ri = 0; ri < KH_N(k_rows); ri++)
            for (int mode = 0; mode < 4; mode++) {
                kv_dtype t;
                kv_layout l = kh_shape(si, &t);
                uint32_t buckets = 1 + rng_below(&r, 6);
                check_against_reviver(&r, l, t, k_rows[ri], buckets, (reviver_estimate)(mode & 1),
                                      (reviver_estimate)(mode >> 1), (int)(si + ri) % 2);
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
        size_t cells = (size_t)rows * buckets;
        kv_sketch a = {rows,
                       buckets,
                       dim,
                       (kv_estimate)rng_below(&r, 2),
                       (kv_estimate)rng_below(&r, 2),
                       xcalloc(cells * dim * 4),
                       xcalloc(cells * dim * 4),
                       xcalloc(cells * 4)};
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

/* fp16 buffers equal as numbers: bit for bit except that +0 and -0 match
 * (a cell starts at +0 and +0 + -0 = +0, and a value inserted with sign -1
 * comes back as -1 * (0 + -1 * v): zeros lose their sign, in reviver.h's
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
        kv_layout l = {3, 7, 18, 2};
        setup s;
        uint32_t rows = 3, buckets = 1u << 16;
        setup_make(&s, &r, l, KV_FP16, rows, buckets);
        /* the premise: no shared cell */
        for (size_t i = 0; i < s.ntok; i++)
            for (size_t j = 0; j < i; j++)
                for (uint32_t q = 0; q < rows; q++)
                    assert_true(s.h[i * rows + q] != s.h[j * rows + q]);
        uint32_t dim = l.kv_heads * l.head_dim;
        size_t cells = (size_t)rows * buckets;
        kv_sketch sk = {rows,
                        buckets,
                        dim,
                        (kv_estimate)(mode & 1),
                        (kv_estimate)(mode >> 1),
                        xcalloc(cells * dim * 4),
                        xcalloc(cells * dim * 4),
                        xcalloc(cells * 4)};
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
        cmocka_unit_test(test_hash_equals_reviver), cmocka_unit_test(test_tkr1_ref),
        cmocka_unit_test(test_tkr1_fast),           cmocka_unit_test(test_even_rows_lower_median),
        cmocka_unit_test(test_equals_reviver),      cmocka_unit_test(test_fast_equals_ref),
        cmocka_unit_test(test_large_b_exact),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
