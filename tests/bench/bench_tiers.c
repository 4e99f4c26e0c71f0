/*
 * bench_tiers.c - what kvstashd's storage-tier moves cost through the real
 * daemon, each against memcpy of the same K/V bytes measured in the same run
 * (DESIGN.md, "Performance budget"; docs/tiers.md for the tiers).
 *
 *   (a) Revive: kvs_seq_revive (a gRPC call: the daemon rebuilds the tokens
 *       in scratch blocks), kvs_layer_read of the scratch, kvs_revive_release
 *       (a gRPC call), for N tokens of one layer held at full precision,
 *       stored INT8 (`full int8=on int8_window=0`) and offloaded to the
 *       sketch (`streaming victims=sketch`), and the full-precision tokens
 *       again with KVS_REVIVE_IN_PLACE (no copy, no scratch); the revive of
 *       one block (16 tokens) gives the fixed cost; kvs_layer_read of the held full and
 *       INT8 lists in place is what a worker pays without a Revive.
 *   (b) demotion during a decode step: 1-token kvs_seq_append and
 *       kvs_seq_step through the session's ring on `streaming` (window
 *       larger than the run: nothing is evicted) with int8=off and int8=on
 *       (int8_window 32), a 500-us busy "forward pass" of the worker
 *       between tokens. With int8=on every INT8 block's worth of steps one
 *       step leaves a whole INT8 block per layer to quantise; what the
 *       worker waits for around a token (its step and the next append),
 *       p50 and p99, against int8=off's is the demotion's cost. And with
 *       victims=sketch (window 64 after the same prefill): every step
 *       offloads one token per layer into the sketch, against the int8=off
 *       step of the same run.
 *   (c) eviction during a step: one kvs_seq_step of `streaming` (n_sink 0,
 *       window 64) after N + 64 tokens were appended, and the kvs_seq_epoch
 *       after it that waits for its moves, evicts N tokens per layer, with victims=evict (dropped),
 * sketch and int8; the extra time over victims=evict is what keeping the victims costs.
 *
 * Usage: bench_tiers [--quick] [PATH_TO_KVSTASHD]
 * The daemon path defaults to $KVSTASHD, then ../../daemon/kvstashd next to
 * this binary. Prints a table and a final "ratios:" line; exits non-zero only
 * if a part could not run (a ratio never fails it).
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "kernels.h"
#include "kvstash.h"

#define POOL_MB 256
#define WINDOW 64        /* streaming window of the sketch and eviction runs */
#define INT8_WINDOW "32" /* full-precision tokens int8=on keeps in (b) */
#define PREFILL 256      /* tokens before the decode steps of (b) */
#define BLOCK_REVIVE 16  /* tokens of the fixed-cost revive: one block */
#define BLOCK_REVIVE_REPS 50
#define MEMCPY_SMALL_REPS 201

typedef struct bench_cfg {
    uint32_t n;     /* tokens per layer revived (a) and evicted (c) */
    int reps;       /* repetitions (median reported) of (a) and (c) */
    uint32_t steps; /* decode steps of (b), each run */
} bench_cfg;

/* Llama-like: 8 KV heads of 128 fp16 channels, 16-token blocks (64 KiB). Two
 * layers: a Revive is one layer's; steps move every layer. */
static const kvs_geometry geom = {.layers = 2,
                                  .q_heads = 32,
                                  .kv_heads = 8,
                                  .head_dim = 128,
                                  .block_tokens = 16,
                                  .dtype = KVS_FP16,
                                  .rope_theta = 0};

/* K+V bytes of one token of one layer. */
static size_t layer_token_bytes(void)
{
    return (size_t)2 * geom.kv_heads * geom.head_dim * 2;
}

/* Random fp16 K and V for `tokens` tokens of a layer: finite values in
 * (-1, 1), so that INT8 scales are normal as they are for real K/V. */
typedef struct kv_data {
    uint8_t *k, *v;
    uint32_t tokens;
} kv_data;

static int kv_data_make(kv_data *d, uint32_t tokens)
{
    size_t half = (size_t)tokens * layer_token_bytes() / 2;
    d->tokens = tokens;
    d->k = malloc(half);
    d->v = malloc(half);
    if (d->k == NULL || d->v == NULL)
        return -1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < half / 2; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        kv_elt_store(d->k + 2 * i, KV_FP16, (float)((double)(x >> 40) / (double)(1u << 23)) - 1.f);
        kv_elt_store(d->v + 2 * i, KV_FP16,
                     (float)((double)(x & 0xffffff) / (double)(1u << 23)) - 1.f);
    }
    return 0;
}

static void kv_data_free(kv_data *d)
{
    free(d->k);
    free(d->v);
}

static void report_fail(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, "bench_tiers: %s: %s: %s\n", what, kvs_strerror(rc), kvs_session_error(s));
}

static double gbs(size_t bytes, double us)
{
    return us > 0 ? (double)bytes / us / 1e3 : 0;
}

/* Create a sequence, append `count` tokens, write d's K/V into every layer,
 * and end the step (the policy runs: demotion, eviction). *evicted: tokens
 * the step evicted, summed over the layers. */
static int seq_fill(kvs_session *s, const char *policy, const kvs_param *params, size_t nparams,
                    uint32_t count, const kv_data *d, uint64_t *seq, uint32_t *evicted,
                    double *step_us)
{
    int rc = kvs_seq_create(s, policy, params, nparams, "bench-tiers", seq);
    if (rc != 0) {
        report_fail(s, "kvs_seq_create", rc);
        return -1;
    }
    kvs_table w;
    if ((rc = kvs_seq_append(s, *seq, count, &w)) != 0) {
        report_fail(s, "kvs_seq_append", rc);
        kvs_seq_release(s, *seq);
        return -1;
    }
    for (uint32_t l = 0; l < w.layers && rc == 0; l++)
        rc = kvs_layer_write(s, &w.layer[l], d->k, d->v);
    kvs_table_free(&w);
    kvs_step st = {.new_tokens = count, .prefill = 1, .confidence = -1};
    kvs_step_result res = {0};
    double t0 = bench_now_us();
    uint64_t epoch;
    if (rc == 0)
        rc = kvs_seq_step(s, *seq, &st, &res);
    /* Until the step's tier moves are done: kvstashd demotes (and stores
     * victims=int8's victims) after the step's reply, and the sequence's
     * next call waits for that. */
    if (rc == 0)
        rc = kvs_seq_epoch(s, *seq, &epoch);
    if (step_us)
        *step_us = bench_now_us() - t0;
    if (rc != 0) {
        report_fail(s, "kvs_layer_write / kvs_seq_step", rc);
        kvs_seq_release(s, *seq);
        return -1;
    }
    if (evicted)
        *evicted = res.evicted;
    return 0;
}

/* ---- (a) revive ---------------------------------------------------------- */

typedef struct revive_row {
    const char *name;
    uint32_t tokens;
    uint32_t from[3];                                /* source tiers of the tokens */
    double revive_us, read_us, release_us, total_us; /* medians */
    double memcpy_us;                                /* memcpy of the same K/V bytes, median */
    int ran;
    int fixed_cost; /* too few bytes for a bandwidth: no ratio */
} revive_row;

/* Revive positions [first, first + n) of layer 0, `reps` times after a
 * warm-up, alternating with a memcpy of the same bytes. With `orig`, the
 * revived tokens are compared with it: bit for bit (full), or within an
 * INT8 step of the group maximum (int8: POLICIES.md §5.4 bounds the error by
 * max|x| / 254; 2 / 127 is loose on purpose). */
static int time_revive(kvs_session *s, uint64_t seq, uint32_t first, uint32_t n, unsigned flags,
                       int reps, const kv_data *orig, revive_row *row)
{
    size_t half = (size_t)n * layer_token_bytes() / 2;
    uint8_t *k = malloc(half), *v = malloc(half), *mk = malloc(half), *mv = malloc(half);
    uint8_t *src = malloc(2 * half);
    double *t = malloc(5 * (size_t)reps * sizeof *t);
    int rc = k && v && mk && mv && src && t ? 0 : KVS_ERR_SYSTEM;
    if (rc == 0) {
        memset(src, 0x3c, 2 * half);
        memset(mk, 0, half), memset(mv, 0, half);
    }
    row->tokens = n;
    for (int r = -1; r < reps && rc == 0; r++) { /* r = -1: warm-up */
        kvs_revive rv;
        double t0 = bench_now_us();
        rc = kvs_seq_revive(s, seq, 0, 0, first, n, flags, &rv);
        double t1 = bench_now_us();
        if (rc != 0) {
            report_fail(s, "kvs_seq_revive", rc);
            break;
        }
        if (rv.layer->tokens != n) {
            fprintf(stderr, "bench_tiers: revived %u tokens, asked for %u\n", rv.layer->tokens, n);
            rc = KVS_ERR_PROTOCOL;
        }
        if (rc == 0 && (rc = kvs_layer_read(s, rv.layer, k, v)) != 0)
            report_fail(s, "kvs_layer_read (scratch)", rc);
        double t2 = bench_now_us();
        row->from[0] = rv.from_full, row->from[1] = rv.from_int8, row->from[2] = rv.from_sketch;
        int rr = kvs_revive_release(s, &rv);
        double t3 = bench_now_us();
        if (rr != 0 && rc == 0) {
            report_fail(s, "kvs_revive_release", rr);
            rc = rr;
        }
        double t4 = bench_now_us();
        memcpy(mk, src, half);
        memcpy(mv, src + half, half);
        double t5 = bench_now_us();
        if (r >= 0) {
            t[r] = t1 - t0, t[reps + r] = t2 - t1, t[2 * reps + r] = t3 - t2;
            t[3 * reps + r] = t3 - t0, t[4 * reps + r] = t5 - t4;
        }
    }
    if (rc == 0 && orig != NULL) { /* the last revive's tokens against what was written */
        double worst = 0;
        const uint16_t *a[2] = {(const uint16_t *)k, (const uint16_t *)v};
        const uint8_t *b[2] = {orig->k, orig->v};
        for (int kv = 0; kv < 2; kv++)
            for (size_t i = 0; i < half / 2; i++) {
                float x = kv_elt_load((const uint8_t *)&a[kv][i], KV_FP16);
                float y = kv_elt_load(b[kv] + 2 * i, KV_FP16);
                worst = fmax(worst, fabs((double)x - (double)y));
            }
        double tol = row->from[1] + row->from[2] > 0 ? 2.0 / 127 : 0;
        if (worst > tol) {
            fprintf(stderr, "bench_tiers: %s: revived K/V differ from what was written by %g\n",
                    row->name, worst);
            rc = KVS_ERR_PROTOCOL;
        }
    }
    if (rc == 0 && reps > 0) {
        row->revive_us = bench_median(t, (size_t)reps);
        row->read_us = bench_median(t + reps, (size_t)reps);
        row->release_us = bench_median(t + 2 * reps, (size_t)reps);
        row->total_us = bench_median(t + 3 * reps, (size_t)reps);
        row->memcpy_us = bench_median(t + 4 * reps, (size_t)reps);
        row->ran = 1;
    }
    free(k), free(v), free(mk), free(mv), free(src), free(t);
    return rc == 0 ? 0 : -1;
}

/* kvs_layer_read of layer 0 of the sequence's current table, in place. */
static int time_read(kvs_session *s, uint64_t seq, int reps, revive_row *row)
{
    kvs_table tb;
    int rc = kvs_seq_table(s, seq, 0, &tb);
    if (rc != 0) {
        report_fail(s, "kvs_seq_table", rc);
        return -1;
    }
    uint32_t n = tb.layer[0].tokens;
    size_t half = (size_t)n * layer_token_bytes() / 2;
    uint8_t *k = malloc(half), *v = malloc(half), *mk = malloc(half), *mv = malloc(half);
    uint8_t *src = malloc(2 * half);
    double *t = malloc(2 * (size_t)reps * sizeof *t);
    rc = k && v && mk && mv && src && t ? 0 : KVS_ERR_SYSTEM;
    if (rc == 0)
        memset(src, 0x3c, 2 * half), memset(mk, 0, half), memset(mv, 0, half);
    row->tokens = n;
    for (size_t i = 0; i < tb.layer[0].nsegments; i++)
        row->from[tb.layer[0].segments[i].tier < 3 ? tb.layer[0].segments[i].tier : 0] +=
            tb.layer[0].segments[i].count;
    for (int r = -1; r < reps && rc == 0; r++) {
        double t0 = bench_now_us();
        rc = kvs_layer_read(s, &tb.layer[0], k, v);
        double t1 = bench_now_us();
        memcpy(mk, src, half);
        memcpy(mv, src + half, half);
        double t2 = bench_now_us();
        if (r >= 0)
            t[r] = t1 - t0, t[reps + r] = t2 - t1;
    }
    if (rc != 0)
        report_fail(s, "kvs_layer_read (in place)", rc);
    else if (reps > 0) {
        row->read_us = row->total_us = bench_median(t, (size_t)reps);
        row->memcpy_us = bench_median(t + reps, (size_t)reps);
        row->ran = 1;
    }
    kvs_table_free(&tb);
    free(k), free(v), free(mk), free(mv), free(src), free(t);
    return rc == 0 ? 0 : -1;
}

enum { RV_FULL, RV_FULL_HERE, RV_INT8, RV_SKETCH, RD_FULL, RD_INT8, RV_BLOCK, RV_ROWS };

static int bench_revive(kvs_session *s, const bench_cfg *cfg, const kv_data *d, revive_row *rows)
{
    static const char *const names[RV_ROWS] = {"revive, full precision",
                                               "revive in place, full precision",
                                               "revive, INT8",
                                               "revive, sketch",
                                               "in-place read, full",
                                               "in-place read, INT8",
                                               "revive 1 block (16 tok, full)"};
    for (int i = 0; i < RV_ROWS; i++)
        rows[i] = (revive_row){.name = names[i], .fixed_cost = i == RV_BLOCK};
    uint32_t n = cfg->n;
    uint64_t seq;
    int failed = 0;

    /* Held at full precision: the revive copies (kv_gather + kv_scatter),
     * or with KVS_REVIVE_IN_PLACE names the list's slots. */
    if (seq_fill(s, "full", NULL, 0, n, d, &seq, NULL, NULL) == 0) {
        failed |= time_revive(s, seq, 0, n, 0, cfg->reps, d, &rows[RV_FULL]);
        failed |= time_revive(s, seq, 0, n, KVS_REVIVE_IN_PLACE, cfg->reps, d, &rows[RV_FULL_HERE]);
        failed |= time_read(s, seq, cfg->reps, &rows[RD_FULL]);
        failed |= time_revive(s, seq, 0, BLOCK_REVIVE, 0, BLOCK_REVIVE_REPS, NULL, &rows[RV_BLOCK]);
        failed |= kvs_seq_release(s, seq) != 0;
    } else {
        failed = 1;
    }

    /* INT8: every token but the last partial INT8 block's is demoted at the
     * fill's step; the revive dequantises them. */
    const kvs_param int8[] = {{"int8", "on"}, {"int8_window", "0"}};
    if (seq_fill(s, "full", int8, 2, n, d, &seq, NULL, NULL) == 0) {
        failed |= time_revive(s, seq, 0, n, 0, cfg->reps, d, &rows[RV_INT8]);
        failed |= time_read(s, seq, cfg->reps, &rows[RD_INT8]);
        failed |= kvs_seq_release(s, seq) != 0;
    } else {
        failed = 1;
    }

    /* Sketch: streaming keeps the newest WINDOW tokens; the N before go to
     * the list's count-sketch at the fill's step; the revive queries it. */
    const kvs_param sk[] = {{"n_sink", "0"}, {"window", "64"}, {"victims", "sketch"}};
    if (seq_fill(s, "streaming", sk, 3, n + WINDOW, d, &seq, NULL, NULL) == 0) {
        failed |= time_revive(s, seq, 0, n, 0, cfg->reps, NULL, &rows[RV_SKETCH]);
        failed |= kvs_seq_release(s, seq) != 0;
    } else {
        failed = 1;
    }
    if (!failed && (rows[RV_INT8].from[1] == 0 || rows[RV_SKETCH].from[2] != n)) {
        fprintf(stderr, "bench_tiers: the INT8 / sketch revives did not read those tiers\n");
        failed = 1;
    }
    return failed ? -1 : 0;
}

/* ---- (b) demotion during a step ------------------------------------------- */

typedef struct step_run {
    bench_latency append, step; /* every token's */
    /* A token's step and the append after it: what the worker waits for
     * around one forward pass; of the tokens whose step left a demotion
     * (demote) and of the others (plain). */
    bench_latency token, plain, demote;
    bench_latency demote_step; /* the steps that left a demotion, alone */
    uint32_t t8;               /* tokens of an INT8 block */
    uint64_t int8_tokens;      /* INT8 tokens of the list at the end */
    int ran;
} step_run;

enum { RUN_INT8_OFF, RUN_INT8_ON, RUN_VICTIMS_SKETCH };

/* The worker's forward pass between tokens: a 2-layer slice of the 7-10 ms
 * an H100 takes for a token of an 8B model's 32 layers (issue 16 §2). */
#define FORWARD_US 500.0

static void forward_pass(void)
{
    bench_busy_us(FORWARD_US);
}

/* The decode steps of (b) on `streaming` configured as `run` says. A step
 * demoted when the epoch moved without an eviction: at its reply (the
 * daemon quantised inside the step) or by the next append (after it). */
static int demote_run(kvs_session *s, uint32_t steps, int run, const kv_data *d, step_run *out)
{
    const int int8_on = run == RUN_INT8_ON, offload = run == RUN_VICTIMS_SKETCH;
    const kvs_param p[] = {{"n_sink", "4"},
                           {"window", offload ? "64" : "1048576"},
                           {"victims", offload ? "sketch" : "evict"},
                           {"int8", int8_on ? "on" : "off"},
                           {"int8_window", INT8_WINDOW}};
    uint64_t seq;
    memset(out, 0, sizeof *out);
    if (seq_fill(s, "streaming", p, 5, PREFILL, d, &seq, NULL, NULL) != 0)
        return -1;
    double *ta = calloc(steps + 1, sizeof *ta), *ts = calloc(steps, sizeof *ts);
    double *tt = calloc(steps, sizeof *tt), *tp = calloc(steps, sizeof *tp);
    double *td = calloc(steps, sizeof *td), *tds = calloc(steps, sizeof *tds);
    uint8_t *demoted = calloc(steps + 1, 1);
    size_t np = 0, nd = 0, stride = (size_t)geom.kv_heads * geom.head_dim * 2;
    uint64_t stepped = 0; /* the epoch the last step's reply gave */
    int rc = ta && ts && tt && tp && td && tds && demoted ? 0 : KVS_ERR_SYSTEM;
    for (uint32_t i = 0; i <= steps && rc == 0; i++) {
        kvs_table w;
        kvs_step st = {.new_tokens = 1, .confidence = -1};
        kvs_step_result res;
        const uint8_t *k = d->k + (i % (d->tokens - 1)) * stride;
        const uint8_t *v = d->v + (i % (d->tokens - 1)) * stride;
        double t0 = bench_now_us();
        if ((rc = kvs_seq_append(s, seq, 1, &w)) != 0) {
            report_fail(s, "kvs_seq_append", rc);
            break;
        }
        ta[i] = bench_now_us() - t0;
        if (i > 0 && w.epoch > stepped + 1 && !offload) /* an append moves it by one */
            demoted[i - 1] = 1;
        if (i == steps) { /* the last token's append, after the last step */
            kvs_table_free(&w);
            break;
        }
        for (uint32_t l = 0; l < w.layers && rc == 0; l++) /* as a worker would, not timed */
            rc = kvs_layer_write(s, &w.layer[l], k, v);
        double t2 = bench_now_us();
        if (rc == 0 && (rc = kvs_seq_step(s, seq, &st, &res)) != 0)
            report_fail(s, "kvs_seq_step", rc);
        ts[i] = bench_now_us() - t2;
        if (rc == 0 && res.evicted != 0 && !offload) {
            fprintf(stderr, "bench_tiers: streaming evicted %u tokens in (b)\n", res.evicted);
            rc = KVS_ERR_PROTOCOL;
        }
        if (rc == 0 && res.epoch > w.epoch && !offload)
            demoted[i] = 1;
        stepped = res.epoch;
        kvs_table_free(&w);
        forward_pass();
    }
    for (uint32_t i = 0; rc == 0 && i < steps; i++) {
        tt[i] = ts[i] + ta[i + 1];
        if (demoted[i])
            tds[nd] = ts[i], td[nd++] = tt[i];
        else
            tp[np++] = tt[i];
    }
    kvs_table tb;
    if (rc == 0 && (rc = kvs_seq_table(s, seq, 0, &tb)) == 0) {
        out->t8 = tb.layer[0].int8_block_tokens;
        for (uint32_t l = 0; l < tb.layers; l++)
            for (size_t j = 0; j < tb.layer[l].nsegments; j++)
                if (tb.layer[l].segments[j].tier == KVS_TIER_INT8)
                    out->int8_tokens += tb.layer[l].segments[j].count;
        kvs_table_free(&tb);
    }
    if (rc == 0) {
        out->append = bench_summarize(ta + 1, steps);
        out->step = bench_summarize(ts, steps);
        out->token = bench_summarize(tt, steps);
        out->plain = bench_summarize(tp, np);
        out->demote = bench_summarize(td, nd);
        out->demote_step = bench_summarize(tds, nd);
        out->ran = 1;
    }
    free(ta), free(ts), free(tt), free(tp), free(td), free(tds), free(demoted);
    int rr = kvs_seq_release(s, seq);
    if (rc == 0 && int8_on && nd == 0) {
        fprintf(stderr, "bench_tiers: int8=on demoted nothing in %u steps\n", steps);
        rc = KVS_ERR_PROTOCOL;
    }
    return rc == 0 && rr == 0 ? 0 : -1;
}

/* ---- (c) eviction during a step ------------------------------------------- */

enum { EV_EVICT, EV_SKETCH, EV_INT8, EV_MODES };
static const char *const ev_modes[EV_MODES] = {"evict", "sketch", "int8"};

/* Per victims mode, the median time of the step that evicts cfg->n tokens per
 * layer; the modes and a memcpy of the evicted K/V bytes (step_us[EV_MODES])
 * alternate within each repetition. */
static int bench_evict(kvs_session *s, const bench_cfg *cfg, const kv_data *d, double *step_us)
{
    size_t bytes = (size_t)cfg->n * geom.layers * layer_token_bytes();
    double *t = malloc((size_t)(EV_MODES + 1) * (size_t)cfg->reps * sizeof *t);
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    int rc = t && a && b ? 0 : -1;
    if (rc == 0)
        memset(a, 0x3c, bytes), memset(b, 0, bytes);
    for (int r = -1; r < cfg->reps && rc == 0; r++) { /* r = -1: warm-up */
        for (int m = 0; m < EV_MODES && rc == 0; m++) {
            const kvs_param p[] = {{"n_sink", "0"}, {"window", "64"}, {"victims", ev_modes[m]}};
            uint64_t seq;
            uint32_t evicted = 0;
            double us = 0;
            rc = seq_fill(s, "streaming", p, 3, cfg->n + WINDOW, d, &seq, &evicted, &us);
            if (rc != 0)
                break;
            if (evicted != cfg->n * geom.layers) {
                fprintf(stderr, "bench_tiers: victims=%s: the step evicted %u, expected %u\n",
                        ev_modes[m], evicted, cfg->n * geom.layers);
                rc = -1;
            }
            if (kvs_seq_release(s, seq) != 0)
                rc = -1;
            if (r >= 0)
                t[m * cfg->reps + r] = us;
        }
        double t0 = bench_now_us();
        memcpy(b, a, bytes);
        if (r >= 0)
            t[EV_MODES * cfg->reps + r] = bench_now_us() - t0;
    }
    for (int m = 0; m <= EV_MODES && rc == 0; m++)
        step_us[m] = bench_median(t + m * cfg->reps, (size_t)cfg->reps);
    free(t), free(a), free(b);
    return rc;
}

/* memcpy of `bytes` between two warm private buffers: the median of reps. */
static double memcpy_us(size_t bytes, int reps)
{
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    double *t = malloc((size_t)reps * sizeof *t), us = 0;
    if (a && b && t) {
        memset(a, 0x3c, bytes), memset(b, 0, bytes);
        for (int r = -1; r < reps; r++) {
            double t0 = bench_now_us();
            memcpy(b, a, bytes);
            double t1 = bench_now_us();
            if (r >= 0)
                t[r] = t1 - t0;
        }
        us = bench_median(t, (size_t)reps);
    }
    free(a), free(b), free(t);
    return us;
}

/* ---- report --------------------------------------------------------------- */

static void print_revive(const revive_row *r)
{
    if (!r->ran) {
        printf("%-32s (did not run)\n", r->name);
        return;
    }
    size_t bytes = (size_t)r->tokens * layer_token_bytes();
    double g = gbs(bytes, r->total_us), m = gbs(bytes, r->memcpy_us);
    char from[40], ratio[16] = "-";
    snprintf(from, sizeof from, "%u/%u/%u", r->from[0], r->from[1], r->from[2]);
    if (!r->fixed_cost)
        snprintf(ratio, sizeof ratio, "%.3f", m > 0 ? g / m : 0);
    printf("%-32s %6u %11s %9.0f %8.0f %8.0f %9.0f %7.2f %7.2f %6s\n", r->name, r->tokens, from,
           r->revive_us, r->read_us, r->release_us, r->total_us, g, m, ratio);
}

static void print_step(const char *what, const bench_latency *l)
{
    printf("%-48s %7zu %9.1f %9.1f %9.1f\n", what, l->n, l->p50_us, l->p99_us, l->mean_us);
}

/* Bandwidth of bytes moved in extra_us over memcpy's of the same bytes in
 * memcpy_us: memcpy_us / extra_us; 0 when there is no extra time. */
static double extra_ratio(double extra_us, double memcpy_us)
{
    return extra_us > 0 && memcpy_us > 0 ? memcpy_us / extra_us : 0;
}

/* What int8=on costs a worker at the 99th percentile: p99 of a token's step
 * and next append, over int8=off's (issue 16 §4: goal <= 2). */
static double demote_p99(const step_run *off, const step_run *on)
{
    return off->token.p99_us > 0 ? on->token.p99_us / off->token.p99_us : 0;
}

static void print_demotion(const step_run *off, const step_run *on, const step_run *sk,
                           double mc_us)
{
    printf("\n%-48s %7s %9s %9s %9s\n", "decode, 1 token, a 500-us forward between tokens", "n",
           "p50 us", "p99 us", "mean us");
    print_step("int8=off: kvs_seq_append", &off->append);
    print_step("int8=off: kvs_seq_step", &off->step);
    print_step("int8=off: step + next append", &off->token);
    print_step("int8=on:  kvs_seq_append", &on->append);
    print_step("int8=on:  kvs_seq_step", &on->step);
    print_step("int8=on:  step + next append", &on->token);
    print_step("int8=on:  step + next append, nothing demoted", &on->plain);
    char what[64];
    snprintf(what, sizeof what, "int8=on:  step + next append, demotes %u x %u", on->t8,
             geom.layers);
    print_step(what, &on->demote);
    print_step("int8=on:  kvs_seq_step of those alone", &on->demote_step);
    snprintf(what, sizeof what, "victims=sketch: step + next append, 1 x %u", geom.layers);
    print_step(what, &sk->token);
    size_t tokens = (size_t)on->t8 * geom.layers, bytes = tokens * layer_token_bytes();
    double extra = on->demote.p50_us - on->plain.p50_us;
    printf("demotion: %+.1f us a demoting token for the worker (p50 over the same run's other "
           "tokens); memcpy of its %zu KiB: %.1f us; %" PRIu64 " INT8 tokens at the end\n",
           extra, bytes >> 10, mc_us, on->int8_tokens);
    printf("int8=on p99 / int8=off p99 (step + next append): %.2f (goal <= 2)\n",
           demote_p99(off, on));
    printf("offload: a victims=sketch token costs %.2fx an int8=off token (p50, same run)\n",
           sk->token.p50_us / off->token.p50_us);
}

static void print_evict(const bench_cfg *cfg, const double *us)
{
    size_t tokens = (size_t)cfg->n * geom.layers, bytes = tokens * layer_token_bytes();
    printf("\n%-28s %9s %11s %11s %8s %8s %6s\n", "step evicting N per layer", "step us",
           "ns/token", "extra ns/tok", "GB/s", "memcpy", "ratio");
    for (int m = 0; m < EV_MODES; m++) {
        double extra = us[m] - us[EV_EVICT];
        char what[40];
        snprintf(what, sizeof what, "victims=%s", ev_modes[m]);
        if (m == EV_EVICT)
            printf("%-28s %9.0f %11.1f %11s %8s %8.2f %6s\n", what, us[m],
                   us[m] * 1e3 / (double)tokens, "-", "-", gbs(bytes, us[EV_MODES]), "-");
        else
            printf("%-28s %9.0f %11.1f %11.1f %8.2f %8.2f %6.3f\n", what, us[m],
                   us[m] * 1e3 / (double)tokens, extra * 1e3 / (double)tokens, gbs(bytes, extra),
                   gbs(bytes, us[EV_MODES]), extra_ratio(extra, us[EV_MODES]));
    }
}

int main(int argc, char **argv)
{
    bench_cfg cfg = {4096, 7, 28 * 100};
    const char *daemon = NULL;
    int quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            cfg = (bench_cfg){1024, 3, 28 * 25};
            quick = 1;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "usage: %s [--quick] [PATH_TO_KVSTASHD]\n", argv[0]);
            return 2;
        } else {
            daemon = argv[i];
        }
    }
    if (daemon == NULL)
        daemon = bench_default_daemon();
    signal(SIGPIPE, SIG_IGN);
    atexit(bench_daemon_cleanup);
    printf("bench_tiers: %s run, N = %u tokens per layer (%.1f MiB of fp16 K+V a layer), %u "
           "layers, %u KV heads x %u, %u-token blocks, kernels %s\n",
           quick ? "quick" : "full", cfg.n, (double)cfg.n * (double)layer_token_bytes() / 1048576.0,
           geom.layers, geom.kv_heads, geom.head_dim, geom.block_tokens, kv_kernel_isa());

    char sock[PATH_MAX];
    if (bench_daemon_start("bench_tiers", daemon, POOL_MB, NULL, sock, sizeof sock) != 0)
        return 1;
    kv_data d = {0};
    if (kv_data_make(&d, cfg.n + WINDOW) != 0) {
        fprintf(stderr, "bench_tiers: out of memory\n");
        kv_data_free(&d);
        return 1;
    }
    revive_row rows[RV_ROWS];
    memset(rows, 0, sizeof rows);
    step_run off = {0}, on = {0}, sk = {0};
    double ev_us[EV_MODES + 1] = {0}, demote_mc_us = 0;
    int failed = 0;
    kvs_session *s = NULL;
    char err[256] = "";
    int rc = kvs_session_attach(sock, "bench", &geom, "bench_tiers", &s, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "bench_tiers: kvs_session_attach: %s: %s\n", kvs_strerror(rc), err);
        failed = 1;
    } else {
        failed |= bench_revive(s, &cfg, &d, rows) != 0;
        failed |= demote_run(s, cfg.steps, RUN_INT8_OFF, &d, &off) != 0;
        failed |= demote_run(s, cfg.steps, RUN_INT8_ON, &d, &on) != 0;
        failed |= demote_run(s, cfg.steps, RUN_VICTIMS_SKETCH, &d, &sk) != 0;
        if (on.ran)
            demote_mc_us =
                memcpy_us((size_t)on.t8 * geom.layers * layer_token_bytes(), MEMCPY_SMALL_REPS);
        failed |= bench_evict(s, &cfg, &d, ev_us) != 0;
        if (kvs_session_detach(s) != 0)
            failed = 1;
    }
    kv_data_free(&d);
    int ds = bench_daemon_stop();
    if (ds != 0) {
        fprintf(stderr, "bench_tiers: kvstashd exited with status %d\n", ds);
        failed = 1;
    }

    printf("\n%-32s %6s %11s %9s %8s %8s %9s %7s %7s %6s\n", "one layer, N tokens", "tokens",
           "full/i8/sk", "revive us", "read us", "rel. us", "total us", "GB/s", "memcpy", "ratio");
    for (int i = 0; i < RV_ROWS; i++)
        print_revive(&rows[i]);
    if (off.ran && on.ran && sk.ran)
        print_demotion(&off, &on, &sk, demote_mc_us);
    if (ev_us[EV_MODES] > 0)
        print_evict(&cfg, ev_us);

    double r[RV_ROWS];
    for (int i = 0; i < RV_ROWS; i++)
        r[i] = rows[i].ran ? extra_ratio(rows[i].total_us, rows[i].memcpy_us) : 0;
    printf("\nratios (bandwidth over memcpy of the same bytes, same run): revive_full %.3f, "
           "revive_full_in_place %.3f, revive_int8 %.3f, revive_sketch %.3f, read_full %.3f, "
           "read_int8 %.3f; demote_step %.3f; victims_sketch %.3f, victims_int8 %.3f; demote_p99 "
           "%.2f (int8=on over off)\n",
           r[RV_FULL], r[RV_FULL_HERE], r[RV_INT8], r[RV_SKETCH], r[RD_FULL], r[RD_INT8],
           extra_ratio(on.demote.p50_us - on.plain.p50_us, demote_mc_us),
           extra_ratio(ev_us[EV_SKETCH] - ev_us[EV_EVICT], ev_us[EV_MODES]),
           extra_ratio(ev_us[EV_INT8] - ev_us[EV_EVICT], ev_us[EV_MODES]), demote_p99(&off, &on));
    if (failed)
        fprintf(stderr, "bench_tiers: some parts failed (see above)\n");
    return failed ? 1 : 0;
}
