/*
 * Unit tests of the memory seam (kernels/ops.h): kv_ops_cpu and
 * kv_ops_shadow run the same script of every operation on the same seeded
 * inputs and must leave the same bytes; device memory of the shadow table
 * faults when touched directly, and its errors are loud.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "ops.h"
#include "test_kernels_harness.h"

enum { BLOCKS = 8, HEADS = 2, TOKENS = 8, DIM = 16, ROWS = 3, BUCKETS = 5 };

/* What one run of the script leaves: the pool, a staging pair and the
 * sketch, brought back to the host, and the attention's outputs. */
typedef struct script_out {
    uint8_t *pool, *stage;
    float *sketch;
    float out[4 * DIM], probs[4 * 32];
    kv_diff diff; /* block 5 (dequantised) against block 0 (its source) */
} script_out;

static const kv_layout lay = {HEADS, TOKENS, DIM, 2, 0};

static void run_script(const kv_ops *ops, uint64_t seed, script_out *r)
{
    size_t pool_bytes = BLOCKS * kv_block_bytes(&lay), half = (size_t)HEADS * 12 * DIM * 2;
    size_t dim = (size_t)HEADS * DIM, cells = (size_t)ROWS * BUCKETS;
    rng g = {seed};
    uint8_t *host = malloc(pool_bytes);
    fill_pool(&g, host, pool_bytes, KV_FP16, 1.0f);

    uint8_t *pool = ops->alloc(pool_bytes), *stage = ops->alloc(2 * half);
    kv_sketch sk = {ROWS,
                    BUCKETS,
                    (uint32_t)dim,
                    KV_ESTIMATE_SUM,
                    KV_ESTIMATE_MEAN,
                    ops->alloc(cells * dim * 4),
                    ops->alloc(cells * dim * 4),
                    ops->alloc(cells * 4)};
    assert_non_null(pool);
    assert_int_equal(ops->copy(KV_HOST_TO_DEVICE, pool, host, pool_bytes), 0);
    assert_int_equal(ops->fill(sk.key, 0, cells * dim * 4), 0);
    assert_int_equal(ops->fill(sk.value, 0, cells * dim * 4), 0);
    assert_int_equal(ops->fill(sk.count, 0, cells * 4), 0);

    /* 12 tokens over blocks 0 and 1 -> staging -> blocks 2 and 3. */
    kv_segment src[] = {{0, 1, 5}, {1, 0, 7}}, dst[] = {{2, 0, 8}, {3, 0, 4}};
    assert_int_equal(ops->gather(&lay, pool, src, 2, stage, stage + half), 0);
    assert_int_equal(ops->scatter(&lay, pool, dst, 2, stage, stage + half), 0);
    kv_segment from[] = {{2, 2, 3}}, to[] = {{3, 5, 3}};
    assert_int_equal(ops->copy_tokens(&lay, pool, from, 1, to, 1), 0);

    /* INT8: block 4 holds an INT8 block (of the pool's layout: it fits) of
     * block 0's tokens, dequantised into block 5. */
    kv_segment q0[] = {{0, 0, TOKENS}}, q8[] = {{0, 0, TOKENS}}, d5[] = {{5, 0, TOKENS}};
    const uint32_t zero = 0;
    uint8_t *qpool = pool + 4 * kv_block_bytes(&lay);
    assert_int_equal(ops->int8_quantize(&lay, KV_FP16, pool, q0, 1, qpool, &zero, 1), 0);
    assert_int_equal(ops->int8_dequantize(&lay, qpool, q8, 1, KV_FP16, &lay, pool, d5, 1), 0);
    /* INT4: block 6 holds an INT4 block of block 1's tokens, dequantised
     * into block 7. */
    kv_segment q1[] = {{1, 0, TOKENS}}, d7[] = {{7, 0, TOKENS}};
    uint8_t *lpool = pool + 6 * kv_block_bytes(&lay);
    assert_int_equal(ops->lowbit_quantize(&lay, 4, KV_FP16, pool, q1, 1, lpool, &zero, 1), 0);
    assert_int_equal(ops->lowbit_dequantize(&lay, 4, lpool, q8, 1, KV_FP16, &lay, pool, d7, 1), 0);

    /* RoPE and merges on block 2. */
    kv_segment rs[] = {{2, 0, 4}};
    int32_t delta[] = {-1, -2, 3, 0};
    assert_int_equal(ops->rope_rerotate(&lay, KV_FP16, pool, rs, 1, delta, 10000.0, KV_ROPE_HALF),
                     0);
    kv_merge m[] = {{2, 4, 2, 5, 0.25f, 0.75f}, {2, 5, 2, 6, 1.0f, 0.0f}};
    assert_int_equal(ops->merge_values(&lay, KV_FP16, pool, m, 2), 0);

    /* Sketch: insert block 1's tokens, query into block 3, revive one, delete one. */
    uint64_t pos[TOKENS];
    for (int i = 0; i < TOKENS; i++)
        pos[i] = 100 + (uint64_t)i;
    uint32_t h[TOKENS * ROWS];
    int8_t sg[TOKENS * ROWS];
    kv_sketch_hash_list(42, ROWS, BUCKETS, pos, TOKENS, h, sg);
    kv_segment b1[] = {{1, 0, TOKENS}}, b3[] = {{3, 0, TOKENS}}, one[] = {{3, 0, 1}};
    assert_int_equal(ops->sketch_insert(&sk, &lay, KV_FP16, pool, b1, 1, h, sg), 0);
    assert_int_equal(ops->sketch_query(&sk, h, sg, &lay, KV_FP16, pool, b3, 1), 0);
    assert_int_equal(ops->sketch_revive(&sk, h, sg, &lay, KV_FP16, pool, one, 1), 0);
    assert_int_equal(ops->sketch_delete(&sk, h + ROWS, sg + ROWS, 1), 0);

    /* Attention of 4 query heads over blocks 2 and 5 and the INT4 block 6. */
    float q[4 * DIM];
    for (size_t i = 0; i < 4 * DIM; i++)
        q[i] = rng_float(&g);
    kv_segment as[] = {{2, 0, 8}, {5, 0, 8}, {6, 0, 8}};
    const uint8_t tiers[] = {KV_TIER_FULL, KV_TIER_FULL, KV_TIER_INT4};
    assert_int_equal(
        ops->decode_attention(&lay, KV_FP16, pool, as, 3, tiers, q, 4, 0.25f, r->out, r->probs), 0);

    r->diff = (kv_diff){0, 0, 0, 0};
    size_t bb = kv_block_bytes(&lay);
    assert_int_equal(ops->diff(pool + 5 * bb, pool, KV_FP16, bb / 2, &r->diff), 0);

    r->pool = malloc(pool_bytes);
    r->stage = malloc(2 * half);
    r->sketch = malloc(cells * dim * 4);
    assert_int_equal(ops->copy(KV_DEVICE_TO_HOST, r->pool, pool, pool_bytes), 0);
    assert_int_equal(ops->copy(KV_DEVICE_TO_HOST, r->stage, stage, 2 * half), 0);
    assert_int_equal(ops->copy(KV_DEVICE_TO_HOST, r->sketch, sk.value, cells * dim * 4), 0);
    ops->free(pool);
    ops->free(stage);
    ops->free(sk.key);
    ops->free(sk.value);
    ops->free(sk.count);
    free(host);
}

static void free_out(script_out *r)
{
    free(r->pool);
    free(r->stage);
    free(r->sketch);
}

/* Every operation through the shadow leaves the bytes the CPU table leaves. */
static void test_shadow_equals_cpu(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 3; seed++) {
        script_out a, b;
        run_script(&kv_ops_cpu, seed, &a);
        run_script(&kv_ops_shadow, seed, &b);
        size_t pool_bytes = BLOCKS * kv_block_bytes(&lay);
        assert_memory_equal(a.pool, b.pool, pool_bytes);
        assert_memory_equal(a.stage, b.stage, (size_t)2 * HEADS * 12 * DIM * 2);
        assert_memory_equal(a.sketch, b.sketch, (size_t)ROWS * BUCKETS * HEADS * DIM * 4);
        assert_memory_equal(a.out, b.out, sizeof a.out);
        assert_memory_equal(&a.diff, &b.diff, sizeof a.diff);
        /* An INT8 round trip: off, within §5.4's max/254 plus fp16 rounding. */
        assert_true(a.diff.max_diff > 0 && a.diff.max_diff <= a.diff.max_ref / 254 * 1.01 + 1e-3);
        assert_memory_equal(a.probs, b.probs, 4 * 16 * sizeof(float));
        /* ... and the script did something: the pool changed from its input. */
        rng g = {seed};
        uint8_t *in = malloc(pool_bytes);
        fill_pool(&g, in, pool_bytes, KV_FP16, 1.0f);
        assert_true(memcmp(in, a.pool, pool_bytes) != 0);
        free(in);
        free_out(&a);
        free_out(&b);
    }
}

/* copy_2d moves `rows` runs between two pitches, nothing else. */
static void test_copy_2d(void **state)
{
    (void)state;
    const kv_ops *tables[] = {&kv_ops_cpu, &kv_ops_shadow};
    for (size_t t = 0; t < 2; t++) {
        const kv_ops *ops = tables[t];
        uint8_t src[40], back[64];
        for (int i = 0; i < 40; i++)
            src[i] = (uint8_t)(i + 1);
        uint8_t *d = ops->alloc(64);
        assert_int_equal(ops->fill(d, 0xEE, 64), 0);
        /* 3 rows of 5 bytes, from pitch 10 to pitch 16, at offset 1. */
        assert_int_equal(ops->copy_2d(KV_HOST_TO_DEVICE, d + 1, 16, src, 10, 5, 3), 0);
        assert_int_equal(ops->copy(KV_DEVICE_TO_HOST, back, d, 64), 0);
        for (int i = 0; i < 64; i++) {
            int r = (i - 1) / 16, c = (i - 1) % 16;
            uint8_t want = i >= 1 && r < 3 && c < 5 ? src[r * 10 + c] : 0xEE;
            assert_int_equal(back[i], want);
        }
        /* Device to device, then back with dense pitches. */
        uint8_t *e = ops->alloc(15), dense[15];
        assert_int_equal(ops->copy_2d(KV_DEVICE_TO_DEVICE, e, 5, d + 1, 16, 5, 3), 0);
        assert_int_equal(ops->copy_2d(KV_DEVICE_TO_HOST, dense, 5, e, 5, 5, 3), 0);
        for (int r = 0; r < 3; r++)
            assert_memory_equal(dense + r * 5, src + r * 10, 5);
        ops->free(d);
        ops->free(e);
    }
}

/* Touching shadow device memory directly faults; kv_shadow_real reaches it. */
static void test_shadow_faults(void **state)
{
    (void)state;
    uint8_t *d = kv_ops_shadow.alloc(4096);
    assert_non_null(d);
    assert_int_equal(kv_ops_shadow.fill(d, 7, 4096), 0);
    uint8_t *real = kv_shadow_real(d + 100);
    assert_non_null(real);
    assert_int_equal(real[0], 7);
    assert_null(kv_shadow_real(real));
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* cmocka's handler would carry on in the child */
        volatile uint8_t *p = d;
        _exit(p[100] == 7 ? 0 : 1); /* must not get here */
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGSEGV);
    kv_ops_shadow.free(d);
    assert_null(kv_shadow_real(d + 100));
}

/* A host address where device memory is expected stops the process with a
 * message: the caller's bug, never silently read. */
static void test_shadow_refuses_host_memory(void **state)
{
    (void)state;
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGABRT, SIG_DFL);
        close(STDERR_FILENO); /* the message is expected */
        uint8_t host[16] = {0}, out[16];
        kv_ops_shadow.copy(KV_DEVICE_TO_HOST, out, host, sizeof host);
        _exit(0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGABRT);
}

static void test_find(void **state)
{
    (void)state;
    assert_ptr_equal(kv_ops_find("cpu"), &kv_ops_cpu);
    assert_ptr_equal(kv_ops_find("shadow"), &kv_ops_shadow);
#ifdef KVSTASH_HAVE_CUDA
    assert_ptr_equal(kv_ops_find("cuda"), &kv_ops_cuda);
#else
    assert_null(kv_ops_find("cuda")); /* a build without CUDA has no such table */
#endif
    assert_null(kv_ops_find("gpu"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shadow_equals_cpu),
        cmocka_unit_test(test_copy_2d),
        cmocka_unit_test(test_shadow_faults),
        cmocka_unit_test(test_shadow_refuses_host_memory),
        cmocka_unit_test(test_find),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
