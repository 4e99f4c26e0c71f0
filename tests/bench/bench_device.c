/*
 * bench_device.c - a worker's and the daemon's moves of K/V on the pool's own
 * memory, each against the backend's device-to-device copy of the same bytes
 * in the same process and run (cudaMemcpy D2D on a cuda pool, memcpy on a
 * host pool). tests/gpu/run.sh runs it against kvstashd --backend cuda, once
 * per IPC kind (docs/gpu.md); on the host backend it is the dry run.
 *
 * Against a running kvstashd at --socket, a Llama-like geometry (2 layers,
 * 8 KV heads of 128 fp16 channels, 16-token blocks) and --tokens N tokens
 * (default 4096):
 *   write    kvs_layer_write_dev of one N-token layer from device buffers
 *            (the worker's writes into the imported arena)
 *   read     kvs_layer_read_dev of it into device buffers
 *   revive   kvs_seq_revive of the full-precision layer into scratch blocks
 *            (the daemon copies through its kv_ops)
 *   demote   the prefill step of `streaming int8=on int8_window=16` that
 *            quantises N - 16 tokens of both layers to INT8
 *   revive8  kvs_seq_revive of that INT8 layer (dequantised into scratch)
 * Each prints its median over --reps repetitions (the demotion once per
 * repetition, on a new sequence), its bandwidth in fp16 K+V bytes, and the
 * ratio of the D2D copy's time for the same bytes to it (1.0: as fast as
 * the copy). What was written is read back and checked (exactly at full
 * precision, within INT8's bound after revive8).
 *
 * Usage: bench_device --socket PATH [--tokens N] [--reps R] [--model NAME]
 * Exits 0 when every part ran and checked, 1 otherwise, 2 on usage errors.
 * The last line is "ratios: write=... read=... revive=... demote=...
 * revive8=..." (backend and IPC kind before it).
 */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_daemon.h"
#include "kernels.h"
#include "kvstash.h"
#include "ops.h"

#define INT8_WINDOW 16

static const kvs_geometry geom = {.layers = 2,
                                  .q_heads = 32,
                                  .kv_heads = 8,
                                  .head_dim = 128,
                                  .block_tokens = 16,
                                  .dtype = KVS_FP16};

typedef struct bench {
    kvs_session *s;
    const kv_ops *ops;
    uint32_t tokens;
    int reps;
    size_t half;      /* bytes of one side (K or V) of one layer */
    uint8_t *host_k;  /* what is written: finite fp16 values */
    uint8_t *host_v;  /* V = K's values, negated */
    uint8_t *dk, *dv; /* the worker's device buffers */
    uint8_t *ck, *cv; /* copy targets of the baseline and the reads */
    uint8_t *back;    /* a host buffer to check what came back */
    double copy_us;   /* D2D copy of both sides, median */
} bench;

typedef struct result {
    const char *name;
    double us;
    double bytes; /* fp16 K+V bytes moved */
    double ratio; /* the D2D copy's time for those bytes / us */
} result;

static int fail(const bench *b, const char *what, int rc)
{
    fprintf(stderr, "bench_device: %s: %s (%s)\n", what, b->s ? kvs_session_error(b->s) : "",
            kvs_strerror(rc));
    return -1;
}

/* Median of one timed operation over b->reps runs after a warm-up. */
#define TIME_MEDIAN(b, out_us, stmt)                                                               \
    do {                                                                                           \
        double *t_ = malloc((size_t)(b)->reps * sizeof *t_);                                       \
        int ok_ = t_ != NULL;                                                                      \
        for (int r_ = -1; ok_ && r_ < (b)->reps; r_++) {                                           \
            double t0_ = bench_now_us();                                                           \
            ok_ = (stmt) == 0;                                                                     \
            if (r_ >= 0)                                                                           \
                t_[r_] = bench_now_us() - t0_;                                                     \
        }                                                                                          \
        *(out_us) = ok_ ? bench_median(t_, (size_t)(b)->reps) : -1;                                \
        free(t_);                                                                                  \
    } while (0)

static int copy_both(const bench *b)
{
    return b->ops->copy(KV_DEVICE_TO_DEVICE, b->ck, b->dk, b->half) ||
           b->ops->copy(KV_DEVICE_TO_DEVICE, b->cv, b->dv, b->half);
}

static int setup(bench *b)
{
    b->half = (size_t)b->tokens * geom.kv_heads * geom.head_dim * 2;
    b->host_k = malloc(b->half), b->host_v = malloc(b->half), b->back = malloc(b->half);
    if (!b->host_k || !b->host_v || !b->back)
        return -1;
    for (size_t i = 0; i < b->half / 2; i++) {
        float x = (float)((i * 2654435761u >> 8) % 2001) / 1000.0f - 1.0f;
        kv_elt_store(b->host_k + 2 * i, KV_FP16, x);
        kv_elt_store(b->host_v + 2 * i, KV_FP16, -x);
    }
    b->dk = b->ops->alloc(b->half), b->dv = b->ops->alloc(b->half);
    b->ck = b->ops->alloc(b->half), b->cv = b->ops->alloc(b->half);
    if (!b->dk || !b->dv || !b->ck || !b->cv) {
        fprintf(stderr, "bench_device: the %s backend could not allocate 4 x %zu bytes\n",
                b->ops->name, b->half);
        return -1;
    }
    if (b->ops->copy(KV_HOST_TO_DEVICE, b->dk, b->host_k, b->half) ||
        b->ops->copy(KV_HOST_TO_DEVICE, b->dv, b->host_v, b->half))
        return -1;
    TIME_MEDIAN(b, &b->copy_us, copy_both(b));
    return b->copy_us > 0 ? 0 : -1;
}

/* Device memory `dev` of `n` bytes equals host `want` (or within INT8's
 * bound of the largest |x|, 1/127 of 1.0 here, when `lossy`). */
static int same(const bench *b, const uint8_t *dev, const uint8_t *want, size_t n, int lossy)
{
    if (b->ops->copy(KV_DEVICE_TO_HOST, b->back, dev, n) != 0)
        return 0;
    if (!lossy)
        return memcmp(b->back, want, n) == 0;
    for (size_t i = 0; i < n / 2; i++)
        if (fabsf(kv_elt_load(b->back + 2 * i, KV_FP16) - kv_elt_load(want + 2 * i, KV_FP16)) >
            1.0f / 127)
            return 0;
    return 1;
}

/* A sequence of b->tokens tokens whose layers hold the data, and its
 * prefill step timed into *step_us (when not NULL). */
static int seq_fill(bench *b, const char *policy, const kvs_param *p, size_t np, uint64_t *seq,
                    kvs_table *table, double *step_us)
{
    int rc = kvs_seq_create(b->s, policy, p, np, "bench-device", seq);
    if (rc != 0)
        return fail(b, "kvs_seq_create", rc);
    if ((rc = kvs_seq_append(b->s, *seq, b->tokens, table)) != 0)
        return fail(b, "kvs_seq_append", rc);
    for (uint32_t l = 0; l < table->layers && rc == 0; l++)
        rc = kvs_layer_write_dev(b->s, &table->layer[l], b->dk, b->dv);
    if (rc != 0)
        return fail(b, "kvs_layer_write_dev", rc);
    kvs_step st = {.new_tokens = b->tokens, .prefill = 1, .confidence = -1};
    kvs_step_result res;
    double t0 = bench_now_us();
    rc = kvs_seq_step(b->s, *seq, &st, &res);
    if (step_us != NULL)
        *step_us = bench_now_us() - t0;
    return rc == 0 ? 0 : fail(b, "kvs_seq_step", rc);
}

/* Revive layer 0 (all its positions), read the scratch into ck/cv, check
 * it, release. */
static int revive_once(bench *b, uint64_t seq, int lossy, double *revive_us)
{
    kvs_revive rv;
    double t0 = bench_now_us();
    int rc = kvs_seq_revive(b->s, seq, 0, 0, 0, 0, 0, &rv);
    *revive_us = bench_now_us() - t0;
    if (rc != 0)
        return fail(b, "kvs_seq_revive", rc);
    if (rv.layer->tokens != b->tokens || (rc = kvs_layer_read_dev(b->s, rv.layer, b->ck, b->cv)))
        fprintf(stderr, "bench_device: revived %u of %u tokens (%d)\n", rv.layer->tokens, b->tokens,
                rc);
    else if (!same(b, b->ck, b->host_k, b->half, lossy) ||
             !same(b, b->cv, b->host_v, b->half, lossy))
        fprintf(stderr, "bench_device: the revived layer differs from what was written\n");
    else
        rc = 1;
    int rr = kvs_revive_release(b->s, &rv);
    return rc == 1 && rr == 0 ? 0 : -1;
}

static int median_revive(bench *b, uint64_t seq, int lossy, double *us)
{
    double *t = malloc((size_t)b->reps * sizeof *t), one;
    int rc = t != NULL ? 0 : -1;
    for (int r = -1; rc == 0 && r < b->reps; r++) {
        rc = revive_once(b, seq, lossy, &one);
        if (r >= 0)
            t[r] = one;
    }
    *us = rc == 0 ? bench_median(t, (size_t)b->reps) : -1;
    free(t);
    return rc;
}

static int run_full(bench *b, result *res)
{
    uint64_t seq;
    kvs_table t;
    if (seq_fill(b, "full", NULL, 0, &seq, &t, NULL) != 0)
        return -1;
    const kvs_layer *l0 = &t.layer[0];
    double w, r, rv = -1;
    TIME_MEDIAN(b, &w, kvs_layer_write_dev(b->s, l0, b->dk, b->dv));
    TIME_MEDIAN(b, &r, kvs_layer_read_dev(b->s, l0, b->ck, b->cv));
    int ok = w > 0 && r > 0 && same(b, b->ck, b->host_k, b->half, 0) &&
             same(b, b->cv, b->host_v, b->half, 0);
    if (!ok)
        fprintf(stderr, "bench_device: the layer read back differs, or a copy failed\n");
    if (ok)
        ok = median_revive(b, seq, 0, &rv) == 0;
    kvs_table_free(&t);
    ok = kvs_seq_release(b->s, seq) == 0 && ok;
    double layer = 2.0 * (double)b->half;
    res[0] = (result){"write", w, layer, b->copy_us / w};
    res[1] = (result){"read", r, layer, b->copy_us / r};
    res[2] = (result){"revive", rv, layer, b->copy_us / rv};
    return ok ? 0 : -1;
}

static int run_int8(bench *b, result *res)
{
    const kvs_param p[] = {
        {"n_sink", "4"}, {"window", "1048576"}, {"int8", "on"}, {"int8_window", "16"}};
    double *t = malloc((size_t)b->reps * sizeof *t), step, rv = -1;
    int ok = t != NULL;
    uint64_t seq = 0;
    for (int r = -1; ok && r < b->reps; r++) {
        kvs_table tb;
        ok = seq_fill(b, "streaming", p, 4, &seq, &tb, &step) == 0;
        kvs_table_free(&tb);
        if (r >= 0)
            t[r] = step;
        if (ok && r + 1 < b->reps)
            ok = kvs_seq_release(b->s, seq) == 0;
    }
    double demote = ok ? bench_median(t, (size_t)b->reps) : -1;
    free(t);
    if (ok)
        ok = median_revive(b, seq, 1, &rv) == 0;
    if (seq != 0)
        kvs_seq_release(b->s, seq);
    /* The demotion moved (tokens - window) tokens of both layers. */
    double frac = (double)(b->tokens - INT8_WINDOW) / b->tokens * geom.layers;
    double layer = 2.0 * (double)b->half;
    res[0] = (result){"demote", demote, layer * frac, b->copy_us * frac / demote};
    res[1] = (result){"revive8", rv, layer, b->copy_us / rv};
    return ok ? 0 : -1;
}

static int usage(void)
{
    fprintf(stderr, "usage: bench_device --socket PATH [--tokens N] [--reps R] [--model NAME]\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *model = "bench-device";
    bench b = {.tokens = 4096, .reps = 10};
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--socket") == 0)
            sock = argv[i + 1];
        else if (strcmp(argv[i], "--tokens") == 0)
            b.tokens = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--reps") == 0)
            b.reps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--model") == 0)
            model = argv[i + 1];
        else
            return usage();
    }
    if (sock == NULL || argc % 2 == 0 || b.tokens <= INT8_WINDOW || b.tokens > 65536 ||
        b.reps < 1 || b.reps > 1000)
        return usage();
    char err[512];
    int rc = kvs_session_attach(sock, model, &geom, "bench-device", &b.s, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "bench_device: attach: %s\n", err);
        return 1;
    }
    b.ops = kvs_session_ops(b.s);
    result res[5] = {{"write", -1, 0, 0},
                     {"read", -1, 0, 0},
                     {"revive", -1, 0, 0},
                     {"demote", -1, 0, 0},
                     {"revive8", -1, 0, 0}};
    int ok = setup(&b) == 0;
    ok = ok && run_full(&b, res) == 0;
    ok = ok && run_int8(&b, res + 3) == 0;
    printf("bench_device: backend %s (ops %s), %u tokens x %u KV heads x %u fp16 channels, "
           "%.1f MiB of K+V per layer, median of %d\n",
           kvs_session_backend(b.s), b.ops->name, b.tokens, geom.kv_heads, geom.head_dim,
           2.0 * (double)b.half / 1048576, b.reps);
    printf("%-8s %10s %9s %7s\n", "move", "us", "GB/s", "ratio");
    printf("%-8s %10.1f %9.2f %7.3f\n", "d2d-copy", b.copy_us,
           2.0 * (double)b.half / b.copy_us / 1e3, 1.0);
    for (int i = 0; i < 5; i++)
        if (res[i].us > 0)
            printf("%-8s %10.1f %9.2f %7.3f\n", res[i].name, res[i].us,
                   res[i].bytes / res[i].us / 1e3, res[i].ratio);
    printf("ratios:");
    for (int i = 0; i < 5; i++)
        printf(" %s=%.3f", res[i].name, res[i].us > 0 ? res[i].ratio : 0.0);
    printf("%s\n", ok ? "" : " (FAILED: see stderr)");
    b.ops->free(b.dk), b.ops->free(b.dv), b.ops->free(b.ck), b.ops->free(b.cv);
    free(b.host_k), free(b.host_v), free(b.back);
    kvs_session_detach(b.s);
    return ok ? 0 : 1;
}
