/*
 * test_gpu_tiers.c - the CUDA tier kernels (INT8, INT4, INT2, sketch, RoPE, value norm,
 * merges, decode attention) against the CPU reference, then their bandwidth
 * against cudaMemcpy device-to-device of the same bytes.
 *
 * Plain C + the CUDA runtime API, no cmocka (C-STACK.md "The GPU machine");
 * seeded, so a failure reproduces. Without a usable device it prints
 * "SKIP: no CUDA device (reason)" and exits 0. Exit 1 on any mismatch or
 * CUDA error; --check-only skips the bandwidth part. Every kernel but the
 * attention must equal the reference byte for byte (kernels.h); the
 * attention, on plain and tiered lists (FULL, INT8, INT4 and INT2 segments), is held to
 * 1e-5 absolute + 1e-4 relative on outputs and probabilities.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "../unit/test_kernels_harness.h"
#include "kernels.h"

static int g_failures, g_checks;

#define CHECK_CUDA(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (cudaError_t)(call);                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "FAIL: %s:%d %s: %s\n", __FILE__, __LINE__, #call,                     \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void *dalloc(size_t n)
{
    void *p = NULL;
    CHECK_CUDA(cudaMalloc(&p, n ? n : 1));
    return p;
}

static void *dup_to_dev(const void *h, size_t n)
{
    void *d = dalloc(n);
    if (n)
        CHECK_CUDA(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
}

static void to_host(void *h, const void *d, size_t n)
{
    if (n)
        CHECK_CUDA(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

static void same(const void *a, const void *b, size_t n, const char *what, const kv_layout *l,
                 kv_dtype t)
{
    g_checks++;
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) {
            fprintf(stderr,
                    "FAIL: %s: byte %zu of %zu differs (cpu %u, cuda %u), heads=%u tokens=%u "
                    "dim=%u %s\n",
                    what, i, n, x[i], y[i], l->kv_heads, l->block_tokens, l->head_dim,
                    dtype_name(t));
            g_failures++;
            return;
        }
}

#define NB 5u

/* ---- INT8, INT4, INT2 ---- */

static size_t quant_block_bytes(const kv_layout *l, uint32_t bits)
{
    return bits == 8 ? kv_int8_block_bytes(l) : kv_lowbit_block_bytes(l, bits);
}

static void quantize_ref(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t n, uint8_t *q, const uint32_t *qb,
                         size_t nq)
{
    if (bits == 8)
        kv_int8_quantize_ref(l, t, pool, segs, n, q, qb, nq);
    else
        kv_lowbit_quantize_ref(l, bits, t, pool, segs, n, q, qb, nq);
}

static int quantize_cuda(const kv_layout *l, uint32_t bits, kv_dtype t, const uint8_t *pool,
                         const kv_segment *segs, size_t n, uint8_t *q, const uint32_t *qb,
                         size_t nq)
{
    return bits == 8 ? kv_int8_quantize_cuda(l, t, pool, segs, n, q, qb, nq)
                     : kv_lowbit_quantize_cuda(l, bits, t, pool, segs, n, q, qb, nq);
}

static void dequantize_ref(const kv_layout *l, uint32_t bits, const uint8_t *q,
                           const kv_segment *qs, size_t nqs, kv_dtype t, uint8_t *o,
                           const kv_segment *ds, size_t nd)
{
    if (bits == 8)
        kv_int8_dequantize_ref(l, q, qs, nqs, t, l, o, ds, nd);
    else
        kv_lowbit_dequantize_ref(l, bits, q, qs, nqs, t, l, o, ds, nd);
}

static int dequantize_cuda(const kv_layout *l, uint32_t bits, const uint8_t *q,
                           const kv_segment *qs, size_t nqs, kv_dtype t, uint8_t *o,
                           const kv_segment *ds, size_t nd)
{
    return bits == 8 ? kv_int8_dequantize_cuda(l, q, qs, nqs, t, l, o, ds, nd)
                     : kv_lowbit_dequantize_cuda(l, bits, q, qs, nqs, t, l, o, ds, nd);
}

static void check_quantised(rng *r, kv_layout l, kv_dtype t, uint32_t bits)
{
    size_t pb = NB * kv_block_bytes(&l), qbb = quant_block_bytes(&l, bits);
    uint32_t nqa = NB + 1, qblocks[NB + 1];
    uint8_t *pool = xcalloc(pb), *q = xcalloc(nqa * qbb), *q2 = xcalloc(nqa * qbb);
    kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
    kv_segment *dsegs = xcalloc(NB * l.block_tokens * sizeof *dsegs);
    fill_pool(r, pool, pb, t, 3.0f);
    fill_bytes(r, q, nqa * qbb);
    for (uint32_t i = 0; i < nqa; i++)
        qblocks[i] = nqa - 1 - i;
    size_t n = gen_disjoint(r, &l, 0, NB, segs), ntok = kv_segments_tokens(segs, n);
    size_t nq = (ntok + l.block_tokens - 1) / l.block_tokens + 1;
    uint8_t *d_pool = dup_to_dev(pool, pb), *d_q = dup_to_dev(q, nqa * qbb);
    quantize_ref(&l, bits, t, pool, segs, n, q, qblocks, nq);
    CHECK_CUDA(quantize_cuda(&l, bits, t, d_pool, segs, n, d_q, qblocks, nq));
    to_host(q2, d_q, nqa * qbb);
    same(q, q2, nqa * qbb,
         bits == 8   ? "int8 quantize"
         : bits == 4 ? "int4 quantize"
                     : "int2 quantize",
         &l, t);

    /* dequantise those codes into a pool of another dtype */
    kv_dtype to = dtype_of(rng_below(r, 3));
    kv_layout lo = l;
    lo.elt_size = dtype_size(to);
    size_t ob = NB * kv_block_bytes(&lo);
    uint8_t *o1 = xcalloc(ob), *o2 = xcalloc(ob);
    fill_bytes(r, o1, ob);
    uint8_t *d_o = dup_to_dev(o1, ob);
    size_t nd = gen_exact(r, &lo, 0, NB, ntok, dsegs);
    /* the INT8 side: the tokens of the quantised blocks, in order */
    kv_segment *qs = xcalloc(nq * sizeof *qs);
    size_t nqs = 0, left = ntok;
    for (size_t b = 0; b < nq && left > 0; b++) {
        uint32_t c = left < l.block_tokens ? (uint32_t)left : l.block_tokens;
        qs[nqs++] = (kv_segment){qblocks[b], 0, c};
        left -= c;
    }
    dequantize_ref(&lo, bits, q, qs, nqs, to, o1, dsegs, nd);
    CHECK_CUDA(dequantize_cuda(&lo, bits, d_q, qs, nqs, to, d_o, dsegs, nd));
    to_host(o2, d_o, ob);
    same(o1, o2, ob, bits == 8 ? "int8 dequantize" : "low-bit dequantize", &lo, to);

    CHECK_CUDA(cudaFree(d_pool));
    CHECK_CUDA(cudaFree(d_q));
    CHECK_CUDA(cudaFree(d_o));
    free(pool);
    free(q);
    free(q2);
    free(o1);
    free(o2);
    free(segs);
    free(dsegs);
    free(qs);
}

/* ---- sketch ---- */

typedef struct dsketch {
    kv_sketch h, d; /* host arrays, device arrays */
    size_t cells;
} dsketch;

static void dsketch_init(dsketch *s, uint32_t rows, uint32_t buckets, uint32_t dim, kv_estimate ke,
                         kv_estimate ve)
{
    s->cells = (size_t)rows * buckets;
    s->h = (kv_sketch){rows,
                       buckets,
                       dim,
                       ke,
                       ve,
                       xcalloc(s->cells * dim * 4),
                       xcalloc(s->cells * dim * 4),
                       xcalloc(s->cells * 4)};
    s->d = s->h;
    s->d.key = dup_to_dev(s->h.key, s->cells * dim * 4);
    s->d.value = dup_to_dev(s->h.value, s->cells * dim * 4);
    s->d.count = dup_to_dev(s->h.count, s->cells * 4);
}

static void dsketch_same(const dsketch *s, const char *what, const kv_layout *l, kv_dtype t)
{
    size_t fb = s->cells * s->h.dim * 4;
    float *k = xcalloc(fb), *v = xcalloc(fb);
    int32_t *c = xcalloc(s->cells * 4);
    to_host(k, s->d.key, fb);
    to_host(v, s->d.value, fb);
    to_host(c, s->d.count, s->cells * 4);
    char w[96];
    snprintf(w, sizeof w, "%s: keys", what);
    same(s->h.key, k, fb, w, l, t);
    snprintf(w, sizeof w, "%s: values", what);
    same(s->h.value, v, fb, w, l, t);
    snprintf(w, sizeof w, "%s: counts", what);
    same(s->h.count, c, s->cells * 4, w, l, t);
    free(k);
    free(v);
    free(c);
}

static void dsketch_free(dsketch *s)
{
    free(s->h.key);
    free(s->h.value);
    free(s->h.count);
    CHECK_CUDA(cudaFree(s->d.key));
    CHECK_CUDA(cudaFree(s->d.value));
    CHECK_CUDA(cudaFree(s->d.count));
}

static void check_sketch(rng *r, kv_layout l, kv_dtype t, uint32_t rows, uint32_t buckets)
{
    uint32_t dim = l.kv_heads * l.head_dim;
    size_t pb = NB * kv_block_bytes(&l);
    uint8_t *pool = xcalloc(pb), *o1 = xcalloc(pb), *o2 = xcalloc(pb);
    kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
    kv_segment *os = xcalloc(NB * l.block_tokens * sizeof *os);
    fill_pool(r, pool, pb, t, 2.0f);
    size_t n = gen_disjoint(r, &l, 0, NB, segs), ntok = kv_segments_tokens(segs, n);
    uint64_t *pos = xcalloc(ntok * 8);
    for (size_t i = 0; i < ntok; i++)
        pos[i] = i * 7 + rng_below(r, 7);
    uint32_t *h = xcalloc(ntok * rows * 4);
    int8_t *g = xcalloc(ntok * rows);
    kv_sketch_hash_list(rng_next(r), rows, buckets, pos, ntok, h, g);
    dsketch s;
    dsketch_init(&s, rows, buckets, dim, (kv_estimate)rng_below(r, 2),
                 (kv_estimate)rng_below(r, 2));
    uint8_t *d_pool = dup_to_dev(pool, pb);

    kv_sketch_insert_ref(&s.h, &l, t, pool, segs, n, h, g);
    CHECK_CUDA(kv_sketch_insert_cuda(&s.d, &l, t, d_pool, segs, n, h, g));
    dsketch_same(&s, "sketch insert", &l, t);

    size_t nos = gen_exact(r, &l, 0, NB, ntok, os);
    fill_bytes(r, o1, pb);
    uint8_t *d_o = dup_to_dev(o1, pb);
    kv_sketch_query_ref(&s.h, h, g, &l, t, o1, os, nos);
    CHECK_CUDA(kv_sketch_query_cuda(&s.d, h, g, &l, t, d_o, os, nos));
    to_host(o2, d_o, pb);
    same(o1, o2, pb, "sketch query", &l, t);

    /* revive the first half, delete the rest */
    size_t half = ntok / 2;
    kv_segment *hs = xcalloc((nos + 1) * sizeof *hs);
    size_t nhs = 0, left = half;
    for (size_t i = 0; i < nos && left > 0; i++) {
        hs[nhs] = os[i];
        if (hs[nhs].count > left)
            hs[nhs].count = (uint32_t)left;
        left -= hs[nhs++].count;
    }
    kv_sketch_revive_ref(&s.h, h, g, &l, t, o1, hs, nhs);
    CHECK_CUDA(kv_sketch_revive_cuda(&s.d, h, g, &l, t, d_o, hs, nhs));
    to_host(o2, d_o, pb);
    same(o1, o2, pb, "sketch revive output", &l, t);
    dsketch_same(&s, "sketch revive", &l, t);
    kv_sketch_delete(&s.h, h + half * rows, g + half * rows, ntok - half);
    CHECK_CUDA(kv_sketch_delete_cuda(&s.d, h + half * rows, g + half * rows, ntok - half));
    dsketch_same(&s, "sketch delete", &l, t);

    dsketch_free(&s);
    CHECK_CUDA(cudaFree(d_pool));
    CHECK_CUDA(cudaFree(d_o));
    free(pool);
    free(o1);
    free(o2);
    free(segs);
    free(os);
    free(hs);
    free(pos);
    free(h);
    free(g);
}

/* ---- RoPE, merges ---- */

static void check_rope_merge(rng *r, kv_layout l, kv_dtype t)
{
    size_t pb = NB * kv_block_bytes(&l);
    uint8_t *p1 = xcalloc(pb), *p2 = xcalloc(pb);
    kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
    int32_t *delta = xcalloc(NB * l.block_tokens * 4);
    fill_pool(r, p1, pb, t, 2.0f);
    uint8_t *d_p = dup_to_dev(p1, pb);
    size_t n = gen_disjoint(r, &l, 0, NB, segs), ntok = kv_segments_tokens(segs, n);
    int32_t dl = 0;
    for (size_t i = 0; i < ntok; i++) {
        if (rng_below(r, 3) == 0)
            dl = (int32_t)rng_below(r, 20000) - 10000;
        delta[i] = dl;
    }
    kv_rope_pairing pairing = (kv_rope_pairing)rng_below(r, 2);
    if (l.head_dim % 2 == 0) {
        kv_rope_rerotate_ref(&l, t, p1, segs, n, delta, 10000.0, pairing);
        CHECK_CUDA(kv_rope_rerotate_cuda(&l, t, d_p, segs, n, delta, 10000.0, pairing));
        to_host(p2, d_p, pb);
        same(p1, p2, pb, "rope rerotate", &l, t);
    }

    uint32_t ntot = NB * l.block_tokens;
    kv_merge m[40];
    size_t nm = 1 + rng_below(r, 40);
    for (size_t i = 0; i < nm; i++) {
        uint32_t a = rng_below(r, ntot), b = rng_below(r, ntot);
        if (i > 0 && rng_below(r, 3) == 0)
            a = m[i - 1].into_block * l.block_tokens + m[i - 1].into_slot;
        m[i] = (kv_merge){a / l.block_tokens, a % l.block_tokens, b / l.block_tokens,
                          b % l.block_tokens, rng_float(r) + 1,   rng_float(r) + 1};
        if (rng_below(r, 8) == 0)
            m[i].w_from = m[i].w_into = 0;
    }
    CHECK_CUDA(cudaMemcpy(d_p, p1, pb, cudaMemcpyHostToDevice));
    kv_merge_values_ref(&l, t, p1, m, nm);
    CHECK_CUDA(kv_merge_values_cuda(&l, t, d_p, m, nm));
    to_host(p2, d_p, pb);
    same(p1, p2, pb, "merge values", &l, t);

    CHECK_CUDA(cudaFree(d_p));
    free(p1);
    free(p2);
    free(segs);
    free(delta);
}

/* ---- value norm ---- */

static void check_vnorm(rng *r, kv_layout l, kv_dtype t, uint32_t G, uint32_t hidden)
{
    uint32_t q_heads = G * l.kv_heads;
    size_t pb = NB * kv_block_bytes(&l), nw = (size_t)hidden * q_heads * l.head_dim;
    uint8_t *pool = xcalloc(pb);
    float *wo = xcalloc(nw * 4);
    kv_segment *segs = xcalloc(NB * l.block_tokens * sizeof *segs);
    fill_pool(r, pool, pb, t, 2.0f);
    for (size_t i = 0; i < nw; i++)
        wo[i] = rng_float(r);
    size_t n = gen_disjoint(r, &l, 0, NB, segs), ntok = kv_segments_tokens(segs, n);
    size_t no = ntok * l.kv_heads;
    float *o1 = xcalloc(no * 4), *o2 = xcalloc(no * 4);
    uint8_t *d_pool = dup_to_dev(pool, pb);
    float *d_wo = dup_to_dev(wo, nw * 4), *d_o = dalloc(no * 4);
    kv_vnorm_l1_ref(&l, t, pool, segs, n, wo, (size_t)q_heads * l.head_dim, q_heads, hidden, o1);
    CHECK_CUDA(kv_vnorm_l1_cuda(&l, t, d_pool, segs, n, d_wo, (size_t)q_heads * l.head_dim, q_heads,
                                hidden, d_o));
    to_host(o2, d_o, no * 4);
    same(o1, o2, no * 4, "vnorm", &l, t);
    CHECK_CUDA(cudaFree(d_pool));
    CHECK_CUDA(cudaFree(d_wo));
    CHECK_CUDA(cudaFree(d_o));
    free(pool);
    free(wo);
    free(segs);
    free(o1);
    free(o2);
}

/* ---- decode attention ---- */

static void close_enough(const float *ref, const float *got, size_t n, const char *what,
                         const kv_layout *l, kv_dtype t, size_t ntok)
{
    g_checks++;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)ref[i] - got[i]);
        if (!(e <= 1e-5 + 1e-4 * fabs(ref[i]))) {
            fprintf(stderr,
                    "FAIL: %s: element %zu of %zu: cpu %.9g cuda %.9g, heads=%u dim=%u %s "
                    "tokens=%zu\n",
                    what, i, n, ref[i], got[i], l->kv_heads, l->head_dim, dtype_name(t), ntok);
            g_failures++;
            return;
        }
    }
}

static void check_attention(rng *r, kv_layout l, kv_dtype t, uint32_t G, uint32_t nb)
{
    uint32_t q_heads = G * l.kv_heads, d = l.head_dim;
    size_t pb = nb * kv_block_bytes(&l);
    uint8_t *pool = xcalloc(pb);
    kv_segment *segs = xcalloc((size_t)nb * l.block_tokens * sizeof *segs);
    fill_pool(r, pool, pb, t, 1.0f);
    size_t n = gen_disjoint(r, &l, 0, nb, segs), ntok = kv_segments_tokens(segs, n);
    float *q = xcalloc((size_t)q_heads * d * 4);
    for (size_t i = 0; i < (size_t)q_heads * d; i++)
        q[i] = rng_float(r) * 2;
    float scale = 1.0f / sqrtf((float)d);
    float *o1 = xcalloc((size_t)q_heads * d * 4), *o2 = xcalloc((size_t)q_heads * d * 4);
    float *p1 = xcalloc((size_t)q_heads * ntok * 4), *p2 = xcalloc((size_t)q_heads * ntok * 4);
    uint8_t *d_pool = dup_to_dev(pool, pb);
    float *d_q = dup_to_dev(q, (size_t)q_heads * d * 4), *d_o = dalloc((size_t)q_heads * d * 4);
    float *d_p = dalloc((size_t)q_heads * ntok * 4);
    kv_decode_attention_ref(&l, t, pool, segs, n, NULL, q, q_heads, scale, o1, p1);
    CHECK_CUDA(
        kv_decode_attention_cuda(&l, t, d_pool, segs, n, NULL, d_q, q_heads, scale, d_o, d_p));
    to_host(o2, d_o, (size_t)q_heads * d * 4);
    to_host(p2, d_p, (size_t)q_heads * ntok * 4);
    close_enough(o1, o2, (size_t)q_heads * d, "attention out", &l, t, ntok);
    close_enough(p1, p2, (size_t)q_heads * ntok, "attention probs", &l, t, ntok);
    /* without probs: the same output */
    CHECK_CUDA(
        kv_decode_attention_cuda(&l, t, d_pool, segs, n, NULL, d_q, q_heads, scale, d_o, NULL));
    to_host(o2, d_o, (size_t)q_heads * d * 4);
    close_enough(o1, o2, (size_t)q_heads * d, "attention out (no probs)", &l, t, ntok);

    /* per-head lists: KV head g's rows as a kv_heads = 1 layout */
    kv_layout ph = {1, l.kv_heads * l.block_tokens, d, l.elt_size, 0};
    kv_segment *hs = xcalloc(n * sizeof *hs);
    for (uint32_t gk = 0; gk < l.kv_heads; gk++) {
        for (size_t s = 0; s < n; s++)
            hs[s] = (kv_segment){segs[s].block, gk * l.block_tokens + segs[s].first_slot,
                                 segs[s].count};
        CHECK_CUDA(kv_decode_attention_cuda(&ph, t, d_pool, hs, n, NULL, d_q + (size_t)gk * G * d,
                                            G, scale, d_o, NULL));
        to_host(o2, d_o, (size_t)G * d * 4);
        close_enough(o1 + (size_t)gk * G * d, o2, (size_t)G * d, "attention per-head list", &l, t,
                     ntok);
    }
    CHECK_CUDA(cudaFree(d_pool));
    CHECK_CUDA(cudaFree(d_q));
    CHECK_CUDA(cudaFree(d_o));
    CHECK_CUDA(cudaFree(d_p));
    free(pool);
    free(segs);
    free(hs);
    free(q);
    free(o1);
    free(o2);
    free(p1);
    free(p2);
}

/* Tiered lists (kernels.h: KV_TIER_FULL and KV_TIER_INT8 segments mixed,
 * gen_tiered): the CUDA twin against the CPU reference, with the pool
 * layout and with a per-head row layout (whose INT8 blocks the rows layout
 * defines); a tier the kernels do not read is refused. */
static void check_attention_tiered(rng *r, kv_layout l, kv_dtype t, uint32_t G, uint32_t nb)
{
    kv_layout rows = {1, l.kv_heads * l.block_tokens, l.head_dim, l.elt_size, l.quant_group};
    for (int per_head = 0; per_head < 2; per_head++) {
        kv_layout pl = per_head ? rows : l;
        uint32_t q_heads = per_head ? G : G * l.kv_heads, d = l.head_dim;
        uint32_t tmax = tier_tokens_max(&pl);
        size_t pb = nb * kv_block_bytes(&pl);
        uint8_t *pool = xcalloc(pb), *tiers = xcalloc((size_t)nb * tmax);
        kv_segment *segs = xcalloc((size_t)nb * tmax * sizeof *segs);
        fill_pool(r, pool, pb, t, 1.0f);
        size_t n = gen_tiered(r, &pl, t, pool, nb, segs, tiers);
        size_t ntok = kv_segments_tokens(segs, n), no = (size_t)q_heads * d;
        size_t np = (size_t)q_heads * ntok;
        float *q = xcalloc(no * 4), *o1 = xcalloc(no * 4), *o2 = xcalloc(no * 4);
        float *p1 = xcalloc(np * 4), *p2 = xcalloc(np * 4);
        for (size_t i = 0; i < no; i++)
            q[i] = rng_float(r) * 2;
        float scale = 1.0f / sqrtf((float)d);
        uint8_t *d_pool = dup_to_dev(pool, pb);
        float *d_q = dup_to_dev(q, no * 4), *d_o = dalloc(no * 4), *d_p = dalloc(np * 4);
        kv_decode_attention_ref(&pl, t, pool, segs, n, tiers, q, q_heads, scale, o1, p1);
        CHECK_CUDA(kv_decode_attention_cuda(&pl, t, d_pool, segs, n, tiers, d_q, q_heads, scale,
                                            d_o, d_p));
        to_host(o2, d_o, no * 4);
        to_host(p2, d_p, np * 4);
        close_enough(o1, o2, no,
                     per_head ? "tiered attention out (per-head list)" : "tiered attention out",
                     &pl, t, ntok);
        close_enough(p1, p2, np, "tiered attention probs", &pl, t, ntok);
        uint8_t was = tiers[0];
        tiers[0] = 2; /* a sketched token: the caller must revive it first */
        int rc = kv_decode_attention_cuda(&pl, t, d_pool, segs, n, tiers, d_q, q_heads, scale, d_o,
                                          NULL);
        tiers[0] = was;
        g_checks++;
        if (rc != cudaErrorInvalidValue) {
            fprintf(stderr, "FAIL: tier 2 gave %d, not cudaErrorInvalidValue\n", rc);
            g_failures++;
        }
        CHECK_CUDA(cudaFree(d_pool));
        CHECK_CUDA(cudaFree(d_q));
        CHECK_CUDA(cudaFree(d_o));
        CHECK_CUDA(cudaFree(d_p));
        free(pool);
        free(tiers);
        free(segs);
        free(q);
        free(o1);
        free(o2);
        free(p1);
        free(p2);
    }
}

static void check_all(void)
{
    rng r = {4242};
    static const uint32_t rows[] = {1, 2, 3, 5};
    static const uint32_t buckets[] = {1, 3, 7, 1000};
    for (size_t si = 0; si < KH_SHAPES; si++) {
        kv_dtype t;
        kv_layout l = kh_shape(si, &t);
        static const uint32_t groups[] = {0, 1, 3, 8};
        l.quant_group = groups[si % 4];
        check_quantised(&r, l, t, 8);
        check_quantised(&r, l, t, 4);
        check_quantised(&r, l, t, 2);
        check_rope_merge(&r, l, t);
        check_sketch(&r, l, t, rows[si % 4], buckets[(si / 4) % 4]);
        if (si % 3 == 0)
            check_vnorm(&r, l, t, 1 + (uint32_t)(si % 4), si % 2 ? 96 : 33);
        if (l.head_dim <= 512)
            check_attention(&r, l, t, 1 + (uint32_t)(si % 4), si % 5 == 0 ? 300 : 7);
        if (l.head_dim <= 512 && si % 2 == 0)
            check_attention_tiered(&r, l, t, 1 + (uint32_t)(si % 3), si % 10 == 0 ? 100 : 7);
    }
    printf("correctness: %d comparisons against the CPU reference, %d failures\n", g_checks,
           g_failures);
}

/* ---- bandwidth ---- */

#define ITERS 10

typedef void (*bench_fn)(void *);

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median of ITERS timings in seconds (CUDA events, the whole call). */
static double time_median(bench_fn fn, void *arg)
{
    float ms[ITERS];
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    fn(arg);
    for (int i = 0; i < ITERS; i++) {
        CHECK_CUDA(cudaEventRecord(a, 0));
        fn(arg);
        CHECK_CUDA(cudaEventRecord(b, 0));
        CHECK_CUDA(cudaEventSynchronize(b));
        CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
    }
    CHECK_CUDA(cudaEventDestroy(a));
    CHECK_CUDA(cudaEventDestroy(b));
    qsort(ms, ITERS, sizeof(float), cmp_float);
    return ms[ITERS / 2] / 1e3;
}

/* One benchmark: a Llama-like layer (8 KV heads x 128, fp16, 16-token
 * blocks) with 2048 blocks (128 MiB) of tokens. */
typedef struct bench {
    kv_layout l;
    uint32_t nb;
    uint8_t *pool, *pool2, *qpool, *scratch;
    kv_segment *segs;
    size_t nsegs, ntok;
    uint32_t *qblocks;
    kv_sketch sk;
    uint32_t *h, *hs;
    int8_t *g, *gs;
    size_t nrev;
    kv_segment revseg;
    int32_t *delta;
    float *wo, *vout, *q, *out, *probs;
    uint32_t q_heads, hidden;
    kv_merge *merges;
    size_t nmerges;
    size_t memcpy_bytes;  /* the baseline's copy: pool to scratch */
    double memcpy_rw_Bps; /* its bytes read + written a second, once measured */
} bench;

static void b_quant(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_int8_quantize_cuda(&b->l, KV_FP16, b->pool, b->segs, b->nsegs, b->qpool,
                                     b->qblocks, b->nb));
}

static void b_dequant(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_int8_dequantize_cuda(&b->l, b->qpool, b->segs, b->nsegs, KV_FP16, &b->l, b->pool2,
                                       b->segs, b->nsegs));
}

static void b_insert(void *p)
{
    bench *b = p;
    CHECK_CUDA(
        kv_sketch_insert_cuda(&b->sk, &b->l, KV_FP16, b->pool, b->segs, b->nsegs, b->h, b->g));
}

static void b_query(void *p)
{
    bench *b = p;
    CHECK_CUDA(
        kv_sketch_query_cuda(&b->sk, b->h, b->g, &b->l, KV_FP16, b->pool2, b->segs, b->nsegs));
}

static void b_revive(void *p)
{
    bench *b = p;
    /* revive then re-insert, so the sketch stays the same call after call */
    CHECK_CUDA(
        kv_sketch_revive_cuda(&b->sk, b->hs, b->gs, &b->l, KV_FP16, b->pool2, &b->revseg, 1));
    CHECK_CUDA(
        kv_sketch_insert_cuda(&b->sk, &b->l, KV_FP16, b->pool2, &b->revseg, 1, b->hs, b->gs));
}

static void b_rope(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_rope_rerotate_cuda(&b->l, KV_FP16, b->pool2, b->segs, b->nsegs, b->delta, 10000.0,
                                     KV_ROPE_HALF));
}

static void b_vnorm(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_vnorm_l1_cuda(&b->l, KV_FP16, b->pool, b->segs, b->nsegs, b->wo,
                                (size_t)b->q_heads * 128, b->q_heads, b->hidden, b->vout));
}

static void b_merge(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_merge_values_cuda(&b->l, KV_FP16, b->pool2, b->merges, b->nmerges));
}

static void b_attn(void *p)
{
    bench *b = p;
    CHECK_CUDA(kv_decode_attention_cuda(&b->l, KV_FP16, b->pool, b->segs, b->nsegs, NULL, b->q,
                                        b->q_heads, 0.088f, b->out, NULL));
}

static void b_memcpy(void *p)
{
    bench *b = p;
    CHECK_CUDA(cudaMemcpy(b->scratch, b->pool, b->memcpy_bytes, cudaMemcpyDeviceToDevice));
}

/* bytes = read + written by one call. The baseline is a device-to-device
 * copy of the whole pool (a call may count more bytes than any buffer
 * holds: a sketch query reads the same cells once per token). */
static void report(const char *name, bench *b, bench_fn fn, double bytes, const char *note)
{
    double t = time_median(fn, b);
    if (b->memcpy_rw_Bps == 0)
        b->memcpy_rw_Bps = 2.0 * (double)b->memcpy_bytes / time_median(b_memcpy, b);
    double rw = bytes / t;
    printf(
        "bench op=%s time_us=%.1f rw_bytes=%.0f rw_GBps=%.1f memcpy_rw_GBps=%.1f ratio=%.3f%s%s\n",
        name, t * 1e6, bytes, rw / 1e9, b->memcpy_rw_Bps / 1e9, rw / b->memcpy_rw_Bps,
        note ? " " : "", note ? note : "");
}

static void bench_all(void)
{
    rng r = {7};
    bench b = {.l = {8, 16, 128, 2}, .nb = 2048, .q_heads = 32, .hidden = 4096};
    const kv_layout *l = &b.l;
    size_t bb = kv_block_bytes(l), pb = b.nb * bb, qb = b.nb * kv_int8_block_bytes(l);
    uint32_t dim = l->kv_heads * l->head_dim, rows = 3, buckets = 1024;
    b.ntok = (size_t)b.nb * l->block_tokens;
    b.pool = dalloc(pb);
    b.pool2 = dalloc(pb);
    b.qpool = dalloc(qb);
    b.scratch = dalloc(pb);
    b.memcpy_bytes = pb;
    {
        uint8_t *h = xcalloc(pb);
        fill_pool(&r, h, pb, KV_FP16, 1.0f);
        CHECK_CUDA(cudaMemcpy(b.pool, h, pb, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(b.pool2, h, pb, cudaMemcpyHostToDevice));
        free(h);
    }
    b.segs = xcalloc(b.nb * sizeof *b.segs);
    b.qblocks = xcalloc(b.nb * 4);
    for (uint32_t i = 0; i < b.nb; i++) {
        b.segs[i] = (kv_segment){i, 0, l->block_tokens};
        b.qblocks[i] = i;
    }
    b.nsegs = b.nb;
    size_t fp = (size_t)b.ntok * dim * 2 * 2; /* K + V of every token, fp16 */
    size_t q8 = (size_t)b.nb * kv_int8_block_bytes(l);
    report("int8_quantize", &b, b_quant, (double)fp + q8, NULL);
    report("int8_dequantize", &b, b_dequant, (double)fp + q8, NULL);

    /* sketch: every token inserted into r = 3 rows of 1024 buckets */
    uint64_t *pos = xcalloc(b.ntok * 8);
    for (size_t i = 0; i < b.ntok; i++)
        pos[i] = i;
    b.h = xcalloc(b.ntok * rows * 4);
    b.g = xcalloc(b.ntok * rows);
    kv_sketch_hash_list(99, rows, buckets, pos, b.ntok, b.h, b.g);
    size_t cells = (size_t)rows * buckets;
    b.sk = (kv_sketch){rows,
                       buckets,
                       dim,
                       KV_ESTIMATE_SUM,
                       KV_ESTIMATE_SUM,
                       dalloc(cells * dim * 4),
                       dalloc(cells * dim * 4),
                       dalloc(cells * 4)};
    CHECK_CUDA(cudaMemset(b.sk.key, 0, cells * dim * 4));
    CHECK_CUDA(cudaMemset(b.sk.value, 0, cells * dim * 4));
    CHECK_CUDA(cudaMemset(b.sk.count, 0, cells * 4));
    double cell_rw = 2.0 * cells * dim * 4 * 2; /* every cell read and written, K and V */
    report("sketch_insert", &b, b_insert, (double)fp + cell_rw, "(r=3 b=1024, 32768 tokens)");
    double per_query = (double)rows * dim * 4 * 2 + dim * 2 * 2;
    report("sketch_query", &b, b_query, per_query * b.ntok, NULL);
    b.nrev = 16;
    b.hs = b.h;
    b.gs = b.g;
    b.revseg = (kv_segment){0, 0, 16};
    report("sketch_revive+insert", &b, b_revive,
           (per_query + rows * dim * 4 * 2) * 16 + (double)16 * dim * 4 + cell_rw * 0,
           "(16 tokens: latency-bound)");

    b.delta = xcalloc(b.ntok * 4);
    for (size_t i = 0; i < b.ntok; i++)
        b.delta[i] = -(int32_t)(16 * (i / 16 % 7));
    report("rope_rerotate", &b, b_rope, (double)b.ntok * dim * 2 * 2, NULL);

    size_t nw = (size_t)b.hidden * b.q_heads * 128;
    b.wo = dalloc(nw * 4);
    CHECK_CUDA(cudaMemset(b.wo, 0, nw * 4));
    b.vout = dalloc(b.ntok * l->kv_heads * 4);
    /* 4 tokens' worth is plenty for a compute-bound kernel */
    size_t keep = b.nsegs;
    b.nsegs = 16;
    report("vnorm_l1", &b, b_vnorm, (double)nw * 4 + 256.0 * dim * 2,
           "(256 tokens, Hq=32 D=4096: compute-bound, 2*256*32*128*4096 flop)");
    b.nsegs = keep;

    b.nmerges = 4096;
    b.merges = xcalloc(b.nmerges * sizeof *b.merges);
    for (size_t i = 0; i < b.nmerges; i++)
        b.merges[i] = (kv_merge){(uint32_t)(2 * i / 16),
                                 (uint32_t)(2 * i % 16),
                                 (uint32_t)((2 * i + 1) / 16),
                                 (uint32_t)((2 * i + 1) % 16),
                                 1,
                                 2};
    report("merge_values", &b, b_merge, 3.0 * b.nmerges * dim * 2, "(4096 merges)");

    b.q = dalloc((size_t)b.q_heads * 128 * 4);
    b.out = dalloc((size_t)b.q_heads * 128 * 4);
    CHECK_CUDA(cudaMemset(b.q, 0, (size_t)b.q_heads * 128 * 4));
    report("decode_attention", &b, b_attn, (double)fp, "(32768 tokens, 32 q heads)");

    CHECK_CUDA(cudaFree(b.pool));
    CHECK_CUDA(cudaFree(b.pool2));
    CHECK_CUDA(cudaFree(b.qpool));
    CHECK_CUDA(cudaFree(b.scratch));
    CHECK_CUDA(cudaFree(b.sk.key));
    CHECK_CUDA(cudaFree(b.sk.value));
    CHECK_CUDA(cudaFree(b.sk.count));
    CHECK_CUDA(cudaFree(b.wo));
    CHECK_CUDA(cudaFree(b.vout));
    CHECK_CUDA(cudaFree(b.q));
    CHECK_CUDA(cudaFree(b.out));
    free(b.segs);
    free(b.qblocks);
    free(pos);
    free(b.h);
    free(b.g);
    free(b.delta);
    free(b.merges);
}

/* --check-only skips the bandwidth part. */
int main(int argc, char **argv)
{
    int bench = !(argc > 1 && strcmp(argv[1], "--check-only") == 0);
    int ndev = 0;
    cudaError_t err = cudaGetDeviceCount(&ndev);
    if (err != cudaSuccess) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(err));
        return 0;
    }
    if (ndev == 0) {
        printf("SKIP: no CUDA device (cudaGetDeviceCount found 0 devices)\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %zu MiB)\n", prop.name, prop.major, prop.minor,
           prop.totalGlobalMem >> 20);
    check_all();
    if (g_failures) {
        printf("FAIL: %d mismatches\n", g_failures);
        return 1;
    }
    if (bench)
        bench_all();
    return 0;
}
