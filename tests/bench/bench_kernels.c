/*
 * bench_kernels.c - every fast CPU kernel of kernels.h against memcpy of
 * the same bytes, in one run (DESIGN.md "Performance budget": kernels at
 * >= 50% of memcpy bandwidth, measured side by side).
 *
 * For each kernel, `bytes` is what one call reads plus writes (K/V rows,
 * INT8 codes and scales, sketch cells, W^O...), and the baseline is a
 * memcpy of bytes / 2 (which also reads plus writes `bytes`) between two
 * pre-faulted buffers, timed in the same run. The ratio is kernel bandwidth
 * over memcpy bandwidth. Each kernel runs single-threaded against a
 * single-threaded memcpy (KVSTASH_KERNEL_THREADS=1), then with the kernels'
 * threads against a memcpy split over as many threads (the columns after
 * "|", only where the call is large enough to split). Kernel and memcpy
 * calls alternate, one warm-up call each, and each side's time is the
 * median of its calls. Single-threaded times are CPU time of the calling
 * thread (CLOCK_THREAD_CPUTIME_ID: robust to sharing the machine), threaded
 * times wall clock.
 *
 * Layer geometry: Llama-like, 8 KV heads x 128 channels, fp16, 16-token
 * blocks (64 KiB a block); 1024 blocks (16384 tokens, 64 MiB of K/V) per
 * call unless a line says otherwise.
 *
 * Usage: bench_kernels [--quick] [--only NAME,NAME...]
 *   --quick: 256 blocks, 3 repetitions
 *   --only:  time only the named lines (e.g. --only int8_quantize,decode_attention)
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

static int g_reps = 7;
static const char *g_only; /* comma-separated line names, or NULL for all */

/* Whether line `name` is to be timed (--only). */
static int wanted(const char *name)
{
    size_t n = strlen(name);
    for (const char *p = g_only; p != NULL; p = strchr(p, ',')) {
        p += *p == ',';
        if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == '\0'))
            return 1;
    }
    return g_only == NULL;
}

/* Wall clock, or the calling thread's CPU time: single-threaded runs are
 * timed in CPU time, so that time spent descheduled on a shared machine does
 * not count against either side. */
static double now(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef void (*fn_t)(void *);

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    return t[n / 2];
}

/* Median times of fn(a) and gn(b), measured alternately (one warm-up call
 * of each first), so that both see the same machine. */
static void time_pair(clockid_t clk, fn_t fn, void *a, fn_t gn, void *b, double *tf, double *tg)
{
    double x[64], y[64];
    fn(a);
    gn(b);
    for (int i = 0; i < g_reps; i++) {
        double t0 = now(clk);
        fn(a);
        double t1 = now(clk);
        gn(b);
        double t2 = now(clk);
        x[i] = t1 - t0;
        y[i] = t2 - t1;
    }
    *tf = median(x, g_reps);
    *tg = median(y, g_reps);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "bench_kernels: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    memset(p, 0, n); /* fault the pages in */
    return p;
}

static uint64_t g_rng = 0x1234567;

static float frand(void)
{
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

/* ---- the memcpy baseline, one thread or split ---- */

typedef struct copy_job {
    uint8_t *dst;
    const uint8_t *src;
    size_t n;
} copy_job;

static void *copy_part(void *p)
{
    copy_job *j = p;
    memcpy(j->dst, j->src, j->n);
    return NULL;
}

typedef struct baseline {
    uint8_t *a, *b;
    size_t n;
    unsigned threads;
} baseline;

static void run_memcpy(void *p)
{
    baseline *m = p;
    if (m->threads <= 1) {
        memcpy(m->b, m->a, m->n);
        return;
    }
    pthread_t t[8];
    copy_job j[8];
    for (unsigned i = 0; i < m->threads; i++) {
        size_t lo = m->n * i / m->threads, hi = m->n * (i + 1) / m->threads;
        j[i] = (copy_job){m->b + lo, m->a + lo, hi - lo};
    }
    for (unsigned i = 1; i < m->threads; i++)
        pthread_create(&t[i], NULL, copy_part, &j[i]);
    copy_part(&j[0]);
    for (unsigned i = 1; i < m->threads; i++)
        pthread_join(t[i], NULL);
}

static uint8_t *g_ma, *g_mb;
static size_t g_mcap;

/* The baseline for n bytes over `threads` threads (buffers kept between
 * calls, faulted in once). */
static baseline baseline_for(size_t n, unsigned threads)
{
    if (n > g_mcap) {
        free(g_ma);
        free(g_mb);
        g_ma = xmalloc(n);
        g_mb = xmalloc(n);
        g_mcap = n;
    }
    return (baseline){g_ma, g_mb, n, threads};
}

/* ---- the kernels' state ---- */

typedef struct ctx {
    kv_layout l;
    uint32_t nb;
    size_t ntok;
    uint8_t *pool, *pool2, *qpool, *flat_k, *flat_v;
    kv_segment *segs, *segs2;
    size_t nsegs, nsegs2;
    uint32_t *qblocks;
    kv_sketch sk;
    uint32_t *h;
    int8_t *g;
    kv_segment small;
    int32_t *delta;
    float *wo, *vout, *q, *out;
    uint32_t q_heads, hidden;
    kv_merge *merges;
    size_t nmerges;
    kv_segment *qsegs; /* quantised blocks held in pool2's blocks (kernels.h tiers) */
    uint8_t *tiers;
    size_t nqsegs;
    uint32_t bits; /* the low-bit kernels' (4 or 2) */
    uint8_t *lpool;
} ctx;

static void k_gather(void *p)
{
    ctx *c = p;
    kv_gather(&c->l, c->pool, c->segs, c->nsegs, c->flat_k, c->flat_v);
}

static void k_scatter(void *p)
{
    ctx *c = p;
    kv_scatter(&c->l, c->pool2, c->segs, c->nsegs, c->flat_k, c->flat_v);
}

static void k_copy(void *p)
{
    ctx *c = p;
    /* first half of pool2's blocks into the second half */
    kv_copy_tokens(&c->l, c->pool2, c->segs, c->nsegs / 2, c->segs2, c->nsegs2);
}

static void k_quant(void *p)
{
    ctx *c = p;
    kv_int8_quantize(&c->l, KV_FP16, c->pool, c->segs, c->nsegs, c->qpool, c->qblocks, c->nb);
}

static void k_dequant(void *p)
{
    ctx *c = p;
    kv_int8_dequantize(&c->l, c->qpool, c->segs, c->nsegs, KV_FP16, &c->l, c->pool2, c->segs,
                       c->nsegs);
}

static void k_lowbit_quant(void *p)
{
    ctx *c = p;
    kv_lowbit_quantize(&c->l, c->bits, KV_FP16, c->pool, c->segs, c->nsegs, c->lpool, c->qblocks,
                       c->nb);
}

static void k_lowbit_dequant(void *p)
{
    ctx *c = p;
    kv_lowbit_dequantize(&c->l, c->bits, c->lpool, c->segs, c->nsegs, KV_FP16, &c->l, c->pool2,
                         c->segs, c->nsegs);
}

static void k_insert(void *p)
{
    ctx *c = p;
    kv_sketch_insert(&c->sk, &c->l, KV_FP16, c->pool, c->segs, c->nsegs, c->h, c->g);
}

static void k_query(void *p)
{
    ctx *c = p;
    kv_sketch_query(&c->sk, c->h, c->g, &c->l, KV_FP16, c->pool2, c->segs, c->nsegs);
}

static void k_revive(void *p)
{
    ctx *c = p;
    /* revive 16 tokens, then put them back: the sketch keeps its size */
    kv_sketch_revive(&c->sk, c->h, c->g, &c->l, KV_FP16, c->pool2, &c->small, 1);
    kv_sketch_insert(&c->sk, &c->l, KV_FP16, c->pool2, &c->small, 1, c->h, c->g);
}

static void k_rope(void *p)
{
    ctx *c = p;
    kv_rope_rerotate(&c->l, KV_FP16, c->pool2, c->segs, c->nsegs, c->delta, 10000.0, KV_ROPE_HALF);
}

static void k_merge(void *p)
{
    ctx *c = p;
    kv_merge_values(&c->l, KV_FP16, c->pool2, c->merges, c->nmerges);
}

static void k_vnorm(void *p)
{
    ctx *c = p;
    kv_vnorm_l1(&c->l, KV_FP16, c->pool, c->segs, 4, c->wo, (size_t)c->q_heads * 128, c->q_heads,
                c->hidden, c->vout);
}

static void k_attention(void *p)
{
    ctx *c = p;
    kv_decode_attention(&c->l, KV_FP16, c->pool, c->segs, c->nsegs, NULL, c->q, c->q_heads,
                        0.08838834764f, c->out, NULL);
}

static void k_attention_tiered(void *p)
{
    ctx *c = p;
    kv_decode_attention(&c->l, KV_FP16, c->pool2, c->qsegs, c->nqsegs, c->tiers, c->q, c->q_heads,
                        0.08838834764f, c->out, NULL);
}

/* The same tokens as blocks of quantised tier `tier`, one in each of
 * pool2's first blocks (the daemon's storage, kernels.h
 * kv_int8_tokens_per_block, kv_lowbit_tokens_per_block): segment i holds
 * tokens [i * T, (i + 1) * T) of the list. Returns the bytes the attention
 * then reads: the quantised blocks. */
static double make_quant_list(ctx *c, uint8_t tier)
{
    uint32_t bits = tier == KV_TIER_INT4 ? 4 : 2;
    kv_layout q8 = c->l;
    q8.block_tokens = tier == KV_TIER_INT8 ? kv_int8_tokens_per_block(&c->l)
                                           : kv_lowbit_tokens_per_block(&c->l, bits);
    size_t nq = (c->ntok + q8.block_tokens - 1) / q8.block_tokens, bb = kv_block_bytes(&c->l);
    uint8_t *flat_k = c->flat_k, *flat_v = c->flat_v;
    kv_gather(&c->l, c->pool, c->segs, c->nsegs, flat_k, flat_v); /* the list, contiguous */
    kv_layout stage_l = q8; /* fp16 rows, T8 slots: the quantiser's source */
    uint8_t *stage = xmalloc(kv_block_bytes(&stage_l));
    free(c->qsegs);
    free(c->tiers);
    c->qsegs = xmalloc(nq * sizeof *c->qsegs);
    c->tiers = xmalloc(nq);
    for (size_t i = 0; i < nq; i++) {
        uint32_t first = (uint32_t)(i * q8.block_tokens), zero = 0;
        uint32_t m =
            c->ntok - first < q8.block_tokens ? (uint32_t)(c->ntok - first) : q8.block_tokens;
        /* stage block: heads' rows [first, first + m) of the flat K and V */
        for (uint32_t h = 0; h < c->l.kv_heads; h++) {
            size_t row = (size_t)c->l.head_dim * 2, src = (size_t)h * c->ntok + first;
            memcpy(stage + kv_key_offset(&stage_l, 0, h, 0), flat_k + src * row, m * row);
            memcpy(stage + kv_key_offset(&stage_l, 0, h, 0) + kv_block_bytes(&stage_l) / 2,
                   flat_v + src * row, m * row);
        }
        kv_segment all = {0, 0, m};
        if (tier == KV_TIER_INT8)
            kv_int8_quantize(&q8, KV_FP16, stage, &all, 1, c->pool2 + i * bb, &zero, 1);
        else
            kv_lowbit_quantize(&q8, bits, KV_FP16, stage, &all, 1, c->pool2 + i * bb, &zero, 1);
        c->qsegs[i] = (kv_segment){(uint32_t)i, 0, m};
        c->tiers[i] = tier;
    }
    c->nqsegs = nq;
    free(stage);
    return (double)nq * (double)(tier == KV_TIER_INT8 ? kv_int8_block_bytes(&q8)
                                                      : kv_lowbit_block_bytes(&q8, bits));
}

/* Time fn single-threaded (CPU time) and threaded (wall clock) against
 * memcpy of bytes / 2; print one line. */
/* A benchmark must time kernels that do the right thing: the timed gather's
 * output must equal the reference's on the same pool, or the run fails. */
static void expect_gather_matches_ref(ctx *c, size_t pool_bytes)
{
    size_t half = pool_bytes / 2;
    uint8_t *rk = xmalloc(half), *rv = xmalloc(half);
    kv_gather_ref(&c->l, c->pool, c->segs, c->nsegs, rk, rv);
    k_gather(c);
    if (memcmp(rk, c->flat_k, half) != 0 || memcmp(rv, c->flat_v, half) != 0) {
        fprintf(stderr, "bench_kernels: FAIL: the timed gather differs from kv_gather_ref\n");
        exit(1);
    }
    free(rk);
    free(rv);
}

static void report(const char *name, ctx *c, fn_t fn, double bytes, int splits, const char *note)
{
    double t1, m1, tm, mm;
    if (!wanted(name))
        return;
    baseline b = baseline_for((size_t)(bytes / 2), 1);
    setenv("KVSTASH_KERNEL_THREADS", "1", 1);
    time_pair(CLOCK_THREAD_CPUTIME_ID, fn, c, run_memcpy, &b, &t1, &m1);
    unsetenv("KVSTASH_KERNEL_THREADS");
    unsigned nt = splits ? kv_parallel_threads((size_t)bytes) : 1;
    printf("%-22s %9.1f MB %9.3f ms %7.2f GB/s  memcpy %6.2f GB/s  ratio %5.2f", name, bytes / 1e6,
           t1 * 1e3, bytes / t1 / 1e9, bytes / m1 / 1e9, m1 / t1);
    if (nt > 1) {
        b.threads = nt;
        time_pair(CLOCK_MONOTONIC, fn, c, run_memcpy, &b, &tm, &mm);
        printf("  | %u threads %7.2f GB/s  memcpy %6.2f GB/s  ratio %5.2f", nt, bytes / tm / 1e9,
               bytes / mm / 1e9, mm / tm);
    }
    printf("%s%s\n", note ? "  " : "", note ? note : "");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    ctx c = {.l = {8, 16, 128, 2, 0}, .nb = 1024, .q_heads = 32, .hidden = 4096};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            c.nb = 256;
            g_reps = 3;
        } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
            g_only = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_kernels [--quick] [--only NAME,NAME...]\n");
            return 2;
        }
    }
    const kv_layout *l = &c.l;
    uint32_t T = l->block_tokens, dim = l->kv_heads * l->head_dim;
    size_t bb = kv_block_bytes(l), pb = c.nb * bb, qbb = kv_int8_block_bytes(l);
    c.ntok = (size_t)c.nb * T;
    c.pool = xmalloc(pb);
    c.pool2 = xmalloc(pb);
    c.qpool = xmalloc(c.nb * qbb);
    c.lpool = xmalloc(c.nb * kv_lowbit_block_bytes(l, 4));
    c.flat_k = xmalloc(pb / 2);
    c.flat_v = xmalloc(pb / 2);
    for (size_t i = 0; i < pb / 2; i++)
        kv_elt_store(c.pool + 2 * i, KV_FP16, frand());
    memcpy(c.pool2, c.pool, pb);
    /* the list: every block whole, in a shuffled order */
    c.segs = xmalloc(c.nb * sizeof *c.segs);
    c.segs2 = xmalloc(c.nb * sizeof *c.segs2);
    c.qblocks = xmalloc(c.nb * sizeof *c.qblocks);
    for (uint32_t i = 0; i < c.nb; i++) {
        c.segs[i] = (kv_segment){(i * 7919u) % c.nb, 0, T};
        c.qblocks[i] = i;
    }
    c.nsegs = c.nb;
    for (uint32_t i = 0; i < c.nb / 2; i++)
        c.segs2[i] = (kv_segment){c.nb / 2 + i, 0, T};
    c.nsegs2 = c.nb / 2;
    for (uint32_t i = 0; i < c.nb / 2; i++) /* copy sources: the first half */
        c.segs[i].block = i;

    printf("kvstash kernel bandwidth: %u blocks of 8 heads x 16 tokens x 128 fp16 (%.1f MiB), "
           "median of %d; bytes = read + written per call\n",
           c.nb, pb / 1048576.0, g_reps);
    double fp = (double)pb;                 /* K and V of every token, fp16 */
    double q8 = (double)c.nb * (double)qbb; /* their INT8 blocks */
    report("gather", &c, k_gather, 2 * fp, 0, NULL);
    expect_gather_matches_ref(&c, pb);
    report("scatter", &c, k_scatter, 2 * fp, 0, NULL);
    report("copy_tokens", &c, k_copy, fp, 0, "(half the blocks)");
    report("int8_quantize", &c, k_quant, fp + q8, 1, NULL);
    report("int8_dequantize", &c, k_dequant, fp + q8, 1, "(into fp16)");
    for (c.bits = 4; c.bits >= 2; c.bits -= 2) {
        double ql = (double)c.nb * (double)kv_lowbit_block_bytes(l, c.bits);
        report(c.bits == 4 ? "int4_quantize" : "int2_quantize", &c, k_lowbit_quant, fp + ql, 1,
               "(16-token blocks: groups of 16 keys)");
        report(c.bits == 4 ? "int4_dequantize" : "int2_dequantize", &c, k_lowbit_dequant, fp + ql,
               1, "(into fp16)");
    }

    /* sketch: r = 3 rows x 64 buckets, every token inserted / queried */
    uint32_t rows = 3, buckets = 64;
    size_t cells = (size_t)rows * buckets;
    c.sk = (kv_sketch){rows,
                       buckets,
                       dim,
                       KV_ESTIMATE_SUM,
                       KV_ESTIMATE_SUM,
                       xmalloc(cells * dim * 4),
                       xmalloc(cells * dim * 4),
                       xmalloc(cells * 4)};
    uint64_t *pos = xmalloc(c.ntok * 8);
    for (size_t i = 0; i < c.ntok; i++)
        pos[i] = i;
    c.h = xmalloc(c.ntok * rows * 4);
    c.g = xmalloc(c.ntok * rows);
    kv_sketch_hash_list(7, rows, buckets, pos, c.ntok, c.h, c.g);
    /* per token: its K/V once, and r cells of K and V read and written
     * (insert) or read (query) */
    double tok = (double)dim * 2 * 2, cell = (double)dim * 4 * 2;
    report("sketch_insert", &c, k_insert, c.ntok * (tok + 2 * rows * cell), 1,
           "(r=3, b=64: the cells stay in cache)");
    report("sketch_query", &c, k_query, c.ntok * (tok + rows * cell), 1, NULL);
    c.small = (kv_segment){0, 0, 16};
    report("sketch_revive+insert", &c, k_revive, 16 * (2 * tok + 4 * rows * cell), 0,
           "(16 tokens)");

    c.delta = xmalloc(c.ntok * 4);
    for (size_t i = 0; i < c.ntok; i++)
        c.delta[i] = -(int32_t)(16 * ((i / 16) % 5)); /* a delta per block */
    report("rope_rerotate", &c, k_rope, fp, 1, "(keys: read + written)");

    c.nmerges = c.ntok / 2;
    c.merges = xmalloc(c.nmerges * sizeof *c.merges);
    for (size_t i = 0; i < c.nmerges; i++) {
        uint32_t a = (uint32_t)(2 * i), b = a + 1;
        c.merges[i] = (kv_merge){a / T, a % T, b / T, b % T, 1.0f, 3.0f};
    }
    report("merge_values", &c, k_merge, c.nmerges * 3.0 * dim * 2, 0,
           "(values: 2 rows read, 1 written per merge)");

    size_t nw = (size_t)c.hidden * c.q_heads * 128;
    c.wo = xmalloc(nw * 4);
    for (size_t i = 0; i < nw; i++)
        c.wo[i] = frand();
    c.vout = xmalloc(64 * l->kv_heads * 4);
    /* 4 blocks = 64 tokens; W^O (64 MiB) is read once per 16-token tile */
    report("vnorm_l1", &c, k_vnorm, (64.0 / 16) * l->kv_heads * nw / l->kv_heads * 4, 1,
           "(64 tokens, Hq=32, D=4096: compute-bound, 64*32*128*4096 MACs in double)");

    c.q = xmalloc((size_t)c.q_heads * 128 * 4);
    c.out = xmalloc((size_t)c.q_heads * 128 * 4);
    for (size_t i = 0; i < (size_t)c.q_heads * 128; i++)
        c.q[i] = frand();
    report("decode_attention", &c, k_attention, fp, 1,
           "(32 query heads over every token: K and V read once)");
    double q8list = make_quant_list(&c, KV_TIER_INT8);
    report("decode_attention int8", &c, k_attention_tiered, q8list, 1,
           "(the same tokens as INT8 blocks in pool blocks, 28 a block)");
    double q4list = make_quant_list(&c, KV_TIER_INT4);
    report("decode_attention int4", &c, k_attention_tiered, q4list, 1,
           "(as INT4 blocks, 49 a block: rows dequantised into a tile)");
    double q2list = make_quant_list(&c, KV_TIER_INT2);
    report("decode_attention int2", &c, k_attention_tiered, q2list, 1,
           "(as INT2 blocks, 83 a block)");
    return 0;
}
