/*
 * test_kernels_vnorm.c - the projected value norm kernels (kernels.h
 * "Projected value norm"): T-CK1 (POLICIES.md §1.8) through both versions;
 * both equal spec_vnorm (below: §1.2 transcribed over plain float vectors)
 * bit for bit on seeded random values of every dtype, odd head sizes, GQA
 * groups and hidden sizes, for the pool layout and for per-head lists;
 * threads change nothing.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels.h"
#include "test_kernels_harness.h"

/*
 * POLICIES.md §1.2 over plain vectors, the test's oracle:
 *   n[g][i] = (1/G) Σ_{h in group(g)} Σ_c | Σ_j V[g][i][j] · Wo[c][h·d + j] |
 * v is [kv_heads][tokens][d], wo is o_proj.weight [hidden][q_heads·d], out
 * is [kv_heads][tokens]; sums in double in this loop order, which the
 * kernels promise to keep.
 */
static void spec_vnorm(const float *v, const float *wo, uint32_t kv_heads, uint32_t q_heads,
                       uint32_t d, uint32_t hidden, size_t tokens, float *out)
{
    uint32_t G = q_heads / kv_heads;
    size_t row = (size_t)q_heads * d; /* one row of o_proj.weight */
    for (uint32_t g = 0; g < kv_heads; g++)
        for (size_t i = 0; i < tokens; i++) {
            const float *vi = v + ((size_t)g * tokens + i) * d;
            double acc = 0;
            for (uint32_t h = g * G; h < g * G + G; h++) {
                double s = 0;
                for (uint32_t c = 0; c < hidden; c++) {
                    const float *w = wo + (size_t)c * row + (size_t)h * d;
                    double dot = 0;
                    for (uint32_t j = 0; j < d; j++)
                        dot += (double)vi[j] * (double)w[j];
                    s += fabs(dot);
                }
                acc += s;
            }
            out[(size_t)g * tokens + i] = (float)(acc / G);
        }
}

typedef void (*vnorm_fn)(const kv_layout *, kv_dtype, const uint8_t *, const kv_segment *, size_t,
                         const float *, size_t, uint32_t, uint32_t, float *);

/* T-CK1: Hkv = 1, Hq = 2, d = 2, D = 3 -> n = [1.75, 5.0, 1.375, 2.75]. */
static void test_tck1(void **state)
{
    (void)state;
    const float wo[3][4] = {{1, 0, 0.5f, -1}, {0, 2, 0, 1}, {-1, 1, 1, 0}};
    float pool[16] = {0}; /* 1 head, 4 slots, dim 2, fp32: K then V */
    const float v[8] = {1, 0, 0, 2, 0.5f, 0.5f, 1, 1};
    memcpy(pool + 8, v, sizeof v);
    kv_layout l = {1, 4, 2, 4, 0};
    kv_segment seg = {0, 0, 4};
    const float want[4] = {1.75f, 5.0f, 1.375f, 2.75f};
    for (int fast = 0; fast < 2; fast++) {
        float n[4];
        (fast ? kv_vnorm_l1 : kv_vnorm_l1_ref)(&l, KV_FP32, (uint8_t *)pool, &seg, 1, &wo[0][0], 4,
                                               2, 3, n);
        for (int i = 0; i < 4; i++)
            assert_true(n[i] == want[i]);
    }
    float n2[4];
    spec_vnorm(v, &wo[0][0], 1, 2, 2, 3, 4, n2);
    assert_memory_equal(n2, want, sizeof want);
}

/* Values of a list as [kv_heads][ntok][d] fp32 (kv_elt_load). */
static float *gather_values(const kv_layout *l, kv_dtype t, const uint8_t *pool,
                            const kv_segment *segs, size_t nsegs, size_t ntok)
{
    float *v = xcalloc((size_t)l->kv_heads * ntok * l->head_dim * sizeof(float));
    size_t half = kv_block_bytes(l) / 2, i = 0;
    for (size_t s = 0; s < nsegs; s++)
        for (uint32_t k = 0; k < segs[s].count; k++, i++)
            for (uint32_t h = 0; h < l->kv_heads; h++)
                for (uint32_t j = 0; j < l->head_dim; j++)
                    v[((size_t)h * ntok + i) * l->head_dim + j] = kv_elt_load(
                        pool + kv_key_offset(l, segs[s].block, h, segs[s].first_slot + k) + half +
                            (size_t)j * l->elt_size,
                        t);
    return v;
}

static void test_equals_spec(void **state)
{
    (void)state;
    rng r = {41};
    const uint32_t groups[] = {1, 2, 3, 4};
    const uint32_t hiddens[] = {1, 7, 33, 96};
    for (size_t si = 0; si < KH_SHAPES; si += 2) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        if (l.head_dim > 64 && si % 3)
            continue; /* keep the run short: every shape class still appears */
        uint32_t G = groups[rng_below(&r, 4)], hidden = hiddens[rng_below(&r, 4)];
        uint32_t q_heads = G * l.kv_heads, nb = 3;
        size_t pb = nb * kv_block_bytes(&l);
        uint8_t *pool = xcalloc(pb);
        kv_segment *segs = xcalloc(nb * l.block_tokens * sizeof *segs);
        float *wo = xcalloc((size_t)hidden * q_heads * l.head_dim * sizeof(float));
        fill_pool(&r, pool, pb, t, 2.0f);
        for (size_t i = 0; i < (size_t)hidden * q_heads * l.head_dim; i++)
            wo[i] = rng_float(&r);
        size_t n = gen_disjoint(&r, &l, 0, nb, segs), ntok = kv_segments_tokens(segs, n);
        size_t no = (size_t)l.kv_heads * ntok;
        float *o1 = xcalloc(no * 4), *o2 = xcalloc(no * 4), *o3 = xcalloc(no * 4);
        float *v = gather_values(&l, t, pool, segs, n, ntok);
        spec_vnorm(v, wo, l.kv_heads, q_heads, l.head_dim, hidden, ntok, o1);
        kv_vnorm_l1_ref(&l, t, pool, segs, n, wo, (size_t)q_heads * l.head_dim, q_heads, hidden,
                        o2);
        kv_vnorm_l1(&l, t, pool, segs, n, wo, (size_t)q_heads * l.head_dim, q_heads, hidden, o3);
        if (memcmp(o1, o2, no * 4) != 0 || memcmp(o1, o3, no * 4) != 0)
            fail_msg("vnorm differs from spec_vnorm: heads %u dim %u G %u hidden %u %s", l.kv_heads,
                     l.head_dim, G, hidden, dtype_name(t));

        /* Per-head lists: kv head g's rows as a kv_heads = 1 layout with
         * kv_heads * block_tokens rows per block, and W^O from column
         * g*G*d with the model's row stride. */
        kv_layout ph = {1, l.kv_heads * l.block_tokens, l.head_dim, l.elt_size, 0};
        for (uint32_t g = 0; g < l.kv_heads; g++) {
            kv_segment *hs = xcalloc(n * sizeof *hs);
            for (size_t s = 0; s < n; s++)
                hs[s] = (kv_segment){segs[s].block, g * l.block_tokens + segs[s].first_slot,
                                     segs[s].count};
            float *oh = xcalloc(ntok * 4);
            kv_vnorm_l1(&ph, t, pool, hs, n, wo + (size_t)g * G * l.head_dim,
                        (size_t)q_heads * l.head_dim, G, hidden, oh);
            assert_memory_equal(oh, o1 + (size_t)g * ntok, ntok * 4);
            kv_vnorm_l1_ref(&ph, t, pool, hs, n, wo + (size_t)g * G * l.head_dim,
                            (size_t)q_heads * l.head_dim, G, hidden, oh);
            assert_memory_equal(oh, o1 + (size_t)g * ntok, ntok * 4);
            free(hs);
            free(oh);
        }
        free(pool);
        free(segs);
        free(wo);
        free(o1);
        free(o2);
        free(o3);
        free(v);
    }
}

static void test_threads_deterministic(void **state)
{
    (void)state;
    rng r = {42};
    kv_layout l = {2, 16, 64, 2, 0};
    uint32_t nb = 8, q_heads = 8, hidden = 512;
    size_t pb = nb * kv_block_bytes(&l), nw = (size_t)hidden * q_heads * l.head_dim;
    uint8_t *pool = xcalloc(pb);
    float *wo = xcalloc(nw * 4), *o1 = xcalloc(2 * nb * 16 * 4), *o2 = xcalloc(2 * nb * 16 * 4);
    kv_segment *segs = xcalloc(nb * 16 * sizeof *segs);
    fill_pool(&r, pool, pb, KV_FP16, 1.0f);
    for (size_t i = 0; i < nw; i++)
        wo[i] = rng_float(&r);
    size_t n = cut_blocks(&r, &l, 0, nb, 2, segs);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    kv_vnorm_l1(&l, KV_FP16, pool, segs, n, wo, (size_t)q_heads * 64, q_heads, hidden, o1);
    unsetenv("KVSTASH_KERNEL_THREADS");
    kv_vnorm_l1(&l, KV_FP16, pool, segs, n, wo, (size_t)q_heads * 64, q_heads, hidden, o2);
    assert_memory_equal(o1, o2, 2 * nb * 16 * 4);
    free(pool);
    free(wo);
    free(o1);
    free(o2);
    free(segs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tck1),
        cmocka_unit_test(test_equals_spec),
        cmocka_unit_test(test_threads_deterministic),
    };
    return run_each_isa(tests, sizeof tests / sizeof tests[0]);
}
