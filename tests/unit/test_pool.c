/*
 * Unit tests of daemon/pool.h on its own: geometry checks and their
 * messages, the block size and count a pool gets, the free stack's order
 * (block 0 first, last freed first again), exhaustion, and the arena a
 * worker is given.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <fcntl.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pool.h"

/* 2 layers, 4 query heads over 2 KV heads, head_dim 8, 4 tokens a block,
 * fp32: a block is K and V of 2 heads x 4 tokens x 8 floats = 512 bytes. */
static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};

static void test_geometry_defaults_and_sizes(void **state)
{
    (void)state;
    pool_geometry g = geom;
    status st;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    assert_true(g.rope_theta == 10000.0f); /* 0 means Llama's default */
    g.rope_theta = 500000.0f;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    assert_true(g.rope_theta == 500000.0f); /* an explicit theta stays */
    assert_int_equal(pool_dtype_size(POOL_FP16), 2);
    assert_int_equal(pool_dtype_size(POOL_BF16), 2);
    assert_int_equal(pool_dtype_size(POOL_FP32), 4);
}

/* One table row per rejected geometry: what is changed, and the message. */
typedef struct bad_geometry {
    int id;
    void (*apply)(pool_geometry *g);
    const char *msg;
} bad_geometry;

static void no_layers(pool_geometry *g)
{
    g->layers = 0;
}
static void many_layers(pool_geometry *g)
{
    g->layers = 1025;
}
static void no_q_heads(pool_geometry *g)
{
    g->q_heads = 0;
}
static void many_kv_heads(pool_geometry *g)
{
    g->kv_heads = 1025;
}
static void wide_head(pool_geometry *g)
{
    g->head_dim = 4097;
}
static void no_block_tokens(pool_geometry *g)
{
    g->block_tokens = 0;
}
static void odd_group(pool_geometry *g)
{
    g->q_heads = 3;
}
static void bad_dtype(pool_geometry *g)
{
    g->dtype = (pool_dtype)7;
}
static void negative_theta(pool_geometry *g)
{
    g->rope_theta = -1.0f;
}
static void nan_theta(pool_geometry *g)
{
    g->rope_theta = NAN;
}

static const bad_geometry bad_geometries[] = {
    {1, no_layers, "geometry.layers must be in [1, 1024], got 0"},
    {2, many_layers, "geometry.layers must be in [1, 1024], got 1025"},
    {3, no_q_heads, "geometry.q_heads must be in [1, 1024], got 0"},
    {4, many_kv_heads, "geometry.kv_heads must be in [1, 1024], got 1025"},
    {5, wide_head, "geometry.head_dim must be in [1, 4096], got 4097"},
    {6, no_block_tokens, "geometry.block_tokens must be in [1, 4096], got 0"},
    {7, odd_group, "geometry.q_heads (3) must be a multiple of geometry.kv_heads (2)"},
    {8, bad_dtype, "geometry.dtype must be DTYPE_FP16, DTYPE_BF16 or DTYPE_FP32, got 7"},
    {9, negative_theta, "geometry.rope_theta must be >= 0, got -1"},
    {10, nan_theta, "geometry.rope_theta must be >= 0, got nan"},
};

static void test_geometry_rejections_name_the_field(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_geometries / sizeof bad_geometries[0]; i++) {
        const bad_geometry *b = &bad_geometries[i];
        pool_geometry g = geom;
        b->apply(&g);
        status st;
        if (pool_geometry_check(&g, &st) != ST_INVALID_ARGUMENT || st.code != ST_INVALID_ARGUMENT ||
            strcmp(st.msg, b->msg) != 0)
            fail_msg("case %d: got %s \"%s\", want INVALID_ARGUMENT \"%s\"", b->id,
                     status_name(st.code), st.msg, b->msg);
    }
}

static void test_geometry_equal_and_format(void **state)
{
    (void)state;
    pool_geometry a = geom, b = geom;
    status st;
    assert_int_equal(pool_geometry_check(&a, &st), ST_OK);
    assert_int_equal(pool_geometry_check(&b, &st), ST_OK);
    assert_true(pool_geometry_equal(&a, &b));
    b.block_tokens = 8;
    assert_false(pool_geometry_equal(&a, &b));
    b = a;
    b.rope_theta = 1e6f;
    assert_false(pool_geometry_equal(&a, &b));
    b = a;
    b.dtype = POOL_FP16;
    assert_false(pool_geometry_equal(&a, &b));
    char buf[192];
    pool_geometry_format(&a, buf, sizeof buf);
    assert_string_equal(buf, "layers=2 q_heads=4 kv_heads=2 head_dim=8 block_tokens=4 dtype=fp32 "
                             "rope_theta=10000");
    b.dtype = (pool_dtype)9; /* formatting never indexes past its names */
    pool_geometry_format(&b, buf, sizeof buf);
    assert_non_null(strstr(buf, "dtype=? "));
}

static pool *make_pool(size_t max_bytes)
{
    pool_geometry g = geom;
    status st;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    pool *p = NULL;
    if (pool_create(7, "m", &g, max_bytes, &backend_host, &p, &st) != ST_OK)
        fail_msg("pool_create: %s", st.msg);
    return p;
}

static void test_create_cuts_whole_blocks(void **state)
{
    (void)state;
    /* 16 blocks and a remainder that makes no block. */
    pool *p = make_pool(16 * 512 + 500);
    assert_int_equal(p->id, 7);
    assert_string_equal(p->model, "m");
    assert_int_equal(p->block_bytes, 512);
    assert_int_equal(p->block_count, 16);
    assert_int_equal(p->nfree, 16);
    assert_int_equal(p->bytes, 16 * 512);
    assert_int_equal(p->layout.kv_heads, 2);
    assert_int_equal(p->layout.block_tokens, 4);
    assert_int_equal(p->layout.head_dim, 8);
    assert_int_equal(p->layout.elt_size, 4);
    pool_destroy(p);
}

static void test_too_small_for_the_layers(void **state)
{
    (void)state;
    pool_geometry g = geom;
    status st;
    assert_int_equal(pool_geometry_check(&g, &st), ST_OK);
    pool *p = (pool *)&g; /* must be reset to NULL */
    /* One block, two layers: not even one token of each layer fits. */
    assert_int_equal(pool_create(1, "m", &g, 1023, &backend_host, &p, &st), ST_RESOURCE_EXHAUSTED);
    assert_null(p);
    assert_string_equal(st.msg, "a pool of 1023 bytes holds 1 blocks of 512 bytes, fewer than the "
                                "model's 2 layers; start kvstashd with a larger --pool-mb");
    /* Exactly one block per layer is enough. */
    assert_int_equal(pool_create(1, "m", &g, 1024, &backend_host, &p, &st), ST_OK);
    assert_int_equal(p->block_count, 2);
    pool_destroy(p);
}

static void test_alloc_order_exhaustion_and_reuse(void **state)
{
    (void)state;
    pool *p = make_pool(8 * 512);
    uint32_t b;
    /* Block 0 first, then upwards: a fresh pool fills from its start. */
    for (uint32_t i = 0; i < 8; i++) {
        assert_int_equal(pool_alloc_block(p, &b), 0);
        assert_int_equal(b, i);
        assert_int_equal(p->nfree, 7 - i);
    }
    b = 12345;
    assert_int_equal(pool_alloc_block(p, &b), -1);
    assert_int_equal(b, 12345); /* untouched when full */
    assert_int_equal(p->nfree, 0);
    /* Freed blocks come back last freed first (a stack). */
    pool_free_block(p, 5);
    pool_free_block(p, 2);
    pool_free_block(p, 6);
    assert_int_equal(p->nfree, 3);
    uint32_t got[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(pool_alloc_block(p, &got[i]), 0);
    assert_int_equal(got[0], 6);
    assert_int_equal(got[1], 2);
    assert_int_equal(got[2], 5);
    assert_int_equal(pool_alloc_block(p, &b), -1);
    /* All back: the pool is whole again, each block handed out once. */
    for (uint32_t i = 0; i < 8; i++)
        pool_free_block(p, i);
    assert_int_equal(p->nfree, 8);
    uint32_t seen = 0;
    while (pool_alloc_block(p, &b) == 0) {
        assert_true(b < 8);
        assert_false(seen & (1u << b));
        seen |= 1u << b;
    }
    assert_int_equal(seen, 0xff);
    pool_destroy(p);
}

/* What a worker maps: a descriptor of the whole arena, sealed so that no
 * worker can shrink it under the others (docs/protocol.md). */
static void test_shared_arena_is_sealed(void **state)
{
    (void)state;
    pool *p = make_pool(4 * 512);
    backend_share sh;
    status st;
    assert_int_equal(pool_share(p, &sh, &st), ST_OK);
    int fd = sh.fd;
    assert_true(fd >= 0);
    assert_int_equal(sh.map.kind, KVSTASH_MAP_MEMFD);
    assert_true(sh.map.bytes == 4 * 512);
    struct stat sb;
    assert_int_equal(fstat(fd, &sb), 0);
    assert_int_equal(sb.st_size, 4 * 512);
    int seals = fcntl(fd, F_GET_SEALS);
    assert_true(seals >= 0);
    assert_true(seals & F_SEAL_SHRINK);
    assert_true(seals & F_SEAL_GROW);
    assert_int_not_equal(ftruncate(fd, 512), 0);
    close(fd);
    pool_destroy(p);
    pool_destroy(NULL); /* allowed, like free */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_geometry_defaults_and_sizes),
        cmocka_unit_test(test_geometry_rejections_name_the_field),
        cmocka_unit_test(test_geometry_equal_and_format),
        cmocka_unit_test(test_create_cuts_whole_blocks),
        cmocka_unit_test(test_too_small_for_the_layers),
        cmocka_unit_test(test_alloc_order_exhaustion_and_reuse),
        cmocka_unit_test(test_shared_arena_is_sealed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
