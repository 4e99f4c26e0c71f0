/*
 * bench_step_context.c - what one decode step costs as the context grows
 * (issue 16 §2), through the real daemon at Llama-3-8B's shape: 32 layers,
 * 32 query heads, 8 KV heads, fp16, 16-token blocks.
 *
 * For each policy that runs every step (streaming, h2o, tova, confkv,
 * weightedkv, reviver, ov_block; tova_sum is tova with last_attn summed over
 * the query heads by the worker, its needs_alt; h2o_int8 is h2o with int8=on,
 * all but a list's newest 32 tokens held in INT8; streaming_sketch and
 * streaming_int8v are streaming whose evicted tokens go to the list's
 * count-sketch, or stay as INT8 victims) and each context N, one
 * sequence holds N
 * tokens per list (the policy's budget is N, so every decode step appends
 * one token and the policy gives one back), and a decode step is what a
 * worker does for one token:
 *
 *   append   kvs_seq_append of 1 token (the ring);
 *   step     kvs_seq_step with the statistics the policy needs, one float
 *            per held token per array (POLICY_NEEDS_*): packing them into the
 *            ring, the daemon's copy, the decision and the table change;
 *   table    keeping the worker's table (with positions) current: the
 *            append's writes added (kvs_table_extend) and the step's cuts
 *            taken out (kvs_table_cut), or, when the step's answer has no
 *            cuts (or with --reload, always), the table read again
 *            (kvs_seq_table) when the step changed it beyond the append.
 *
 * The worker's K/V writes are done but not timed; the prefill steps (chunks of
 * up to 65,536 tokens, each a step with its statistics) are timed apart.
 * Baselines in the same run:
 * memcpy of the step's statistics bytes (reading the inputs once: the bound
 * for a policy that reads them all) and an empty ring round trip.
 *
 * Usage: bench_step_context [--quick] [--contexts N,N,...] [--head-dim D]
 *                           [--policies P,P,...] [--steps N] [--reload] [--forward-us N]
 *                           [--in-ring] [--policy-threads N] [--metrics] [--csv FILE]
 *                           [PATH_TO_KVSTASHD]
 * --metrics: the daemon serves /metrics (--metrics 127.0.0.1:0), as an
 * operator would run it: each step then also measures the attention mass
 * its eviction drops.
 * --in-ring: the worker writes a decode step's statistics into the ring's
 * rows (kvs_step_in_ring; the write is its forward pass's, not timed, as
 * the write into its own buffer is without it), and kvs_seq_step does not
 * copy them; the step's time includes kvs_step_in_ring.
 * --forward-us N: a worker's forward pass between tokens, N microseconds
 * busy after each step and before the next append (not timed; an H100
 * takes 7-10 ms a token of an 8B model), during which what the daemon
 * does after a step's reply (the demoter) runs beside the worker, as it
 * would in serving; without it the next append lands on it.
 * The daemon path defaults to $KVSTASHD, then ../../daemon/kvstashd next to
 * this binary. The daemon is started once with a pool and a ring (--ring-mb)
 * sized for the largest context, and kvstashd's --policy-threads N when
 * given (its default otherwise). Prints a table per policy; exits non-zero
 * only if a part could not run (a time never fails it).
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_daemon.h"
#include "kernels.h"
#include "kvstash.h"

#define MAX_CONTEXTS 16
#define MAX_POLICIES 12
#define PREFILL_CHUNK 65536u /* SEQ_MAX_APPEND: longer prompts are prefilled in chunks */
#define RANDOM_FLOATS (1u << 20)

enum { NEEDS_SCORE = 1, NEEDS_LAST_ATTN = 2, NEEDS_CONFIDENCE = 4 };

/* A policy that runs every step and the statistics it needs (its
 * POLICY_NEEDS_*, or needs_alt's); policy_params holds it at N tokens per
 * list. label names the row. */
typedef struct bench_policy {
    const char *label, *name;
    unsigned needs;
    const char *key, *value; /* a storage option on top (NULL: none) */
} bench_policy;

static const bench_policy all_policies[] = {
    {"streaming", "streaming", 0, NULL, NULL},
    {"h2o", "h2o", NEEDS_SCORE, NULL, NULL},
    {"h2o_int8", "h2o", NEEDS_SCORE, "int8", "on"},
    {"streaming_sketch", "streaming", 0, "victims", "sketch"},
    {"streaming_int8v", "streaming", 0, "victims", "int8"},
    {"tova", "tova", NEEDS_LAST_ATTN, NULL, NULL},
    {"tova_sum", "tova", NEEDS_SCORE, NULL, NULL}, /* the rows summed by the worker (needs_alt) */
    {"confkv", "confkv", NEEDS_LAST_ATTN | NEEDS_CONFIDENCE, NULL, NULL},
    {"weightedkv", "weightedkv", NEEDS_LAST_ATTN, NULL, NULL},
    {"reviver", "reviver", NEEDS_SCORE, NULL, NULL},
    {"ov_block", "ov_block", NEEDS_SCORE, NULL, NULL},
};
#define NPOLICIES (sizeof all_policies / sizeof all_policies[0])

typedef struct bench_cfg {
    kvs_geometry geom;
    uint32_t contexts[MAX_CONTEXTS];
    size_t ncontexts;
    const bench_policy *policies[MAX_POLICIES];
    size_t npolicies;
    uint32_t steps;    /* timed decode steps per (policy, context) */
    uint32_t warmup;   /* untimed decode steps before them */
    int reload;        /* read the table again after each step that changed it, not cut it */
    int in_ring;       /* decode steps' statistics written into the ring (kvs_step_in_ring) */
    double forward_us; /* the worker's forward pass between steps (untimed) */
    const char *policy_threads; /* kvstashd --policy-threads, NULL: its default */
    int metrics;                /* kvstashd --metrics 127.0.0.1:0 */
    const char *csv;
} bench_cfg;

/* One (policy, context) run: medians over the timed steps. */
typedef struct step_row {
    uint32_t context;
    double append_us, step_us, table_us, total_us, stats_mib, memcpy_us;
    double p99_ms;        /* the 99th percentile of the timed steps' totals */
    double max_ms;        /* the slowest decode step's total, warm-up included */
    double prefill_ms;    /* the prefill steps (the chunks' kvs_seq_step), summed */
    uint32_t table_steps; /* timed steps that changed the table beyond the append */
    int ran;
} step_row;

/* What the worker side of the benchmark keeps for a sequence. */
typedef struct worker {
    kvs_session *s;
    const bench_cfg *cfg;
    const bench_policy *p;
    uint64_t seq;
    kvs_table held;   /* the sequence's table, with positions, kept current */
    uint32_t heads;   /* lists per layer */
    uint32_t *tokens; /* [layers * heads] tokens per list */
    const float **score, **last_attn;
    const float *random;   /* RANDOM_FLOATS + max context + 1 values in (0, 1] */
    uint8_t *k, *v;        /* fp16 K/V of up to PREFILL_CHUNK tokens of a layer */
    size_t random_n, kv_n; /* floats in random, tokens in k and v */
    double rows_us;        /* --in-ring: the last kvs_step_in_ring's time */
} worker;

static void report_fail(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, "bench_step_context: %s: %s: %s\n", what, kvs_strerror(rc),
            kvs_session_error(s));
}

static size_t token_kv_bytes(const kvs_geometry *g)
{
    return (size_t)g->kv_heads * g->head_dim * 2; /* K (or V) of one token of a layer, fp16 */
}

static uint64_t xorshift(uint64_t *x)
{
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

static int worker_data_make(worker *w, uint32_t max_context)
{
    const kvs_geometry *g = &w->cfg->geom;
    w->random_n = RANDOM_FLOATS + (size_t)max_context + 1;
    w->kv_n = max_context < PREFILL_CHUNK ? max_context : PREFILL_CHUNK;
    float *r = malloc(w->random_n * sizeof *r);
    w->k = malloc(w->kv_n * token_kv_bytes(g));
    w->v = malloc(w->kv_n * token_kv_bytes(g));
    size_t rows = (size_t)g->layers * g->q_heads;
    w->score = calloc(g->layers, sizeof *w->score);
    w->last_attn = calloc(rows, sizeof *w->last_attn);
    w->tokens = calloc((size_t)g->layers * g->kv_heads, sizeof *w->tokens);
    w->random = r;
    if (r == NULL || w->k == NULL || w->v == NULL || w->score == NULL || w->last_attn == NULL ||
        w->tokens == NULL)
        return -1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < w->random_n; i++) /* attention-like: (0, 1], no ties to speak of */
        r[i] = (float)((double)((xorshift(&x) >> 40) + 1) / (double)(1u << 24));
    for (size_t i = 0; i < w->kv_n * token_kv_bytes(g) / 2; i++) {
        uint64_t y = xorshift(&x);
        kv_elt_store(w->k + 2 * i, KV_FP16, (float)((double)(y >> 40) / (double)(1u << 23)) - 1.f);
        kv_elt_store(w->v + 2 * i, KV_FP16,
                     (float)((double)(y & 0xffffff) / (double)(1u << 23)) - 1.f);
    }
    return 0;
}

static void worker_data_free(worker *w)
{
    free((void *)w->random);
    free(w->k), free(w->v);
    free(w->score), free(w->last_attn), free(w->tokens);
}

/* The policy's parameters for N tokens held per list, into p (at most 4). */
static size_t policy_params(const bench_policy *bp, uint32_t n, char buf[4][24], kvs_param *p)
{
    const char *k[4] = {0};
    uint32_t val[4] = {0};
    size_t np = 0;
    if (strcmp(bp->name, "streaming") == 0) {
        k[0] = "n_sink", val[0] = 4, k[1] = "window", val[1] = n - 4, np = 2;
    } else if (strcmp(bp->name, "confkv") == 0) {
        k[0] = "budget_tight", val[0] = n, k[1] = "budget_loose", val[1] = n, np = 2;
    } else if (strcmp(bp->name, "weightedkv") == 0) {
        k[0] = "cache_size", val[0] = n, np = 1;
    } else if (strcmp(bp->name, "ov_block") == 0) {
        k[0] = "max_cache_size", val[0] = n, np = 1; /* start 32, recent 128: the defaults */
    } else {
        k[0] = "budget", val[0] = n, np = 1; /* h2o, tova, reviver */
    }
    for (size_t i = 0; i < np; i++) {
        snprintf(buf[i], sizeof buf[i], "%" PRIu32, val[i]);
        p[i] = (kvs_param){k[i], buf[i]};
    }
    if (bp->key != NULL)
        p[np++] = (kvs_param){bp->key, bp->value};
    return np;
}

/* Point every statistics row at `tokens` values of the random pool, at an
 * offset that moves with the step, so that each step's scores differ. */
static size_t stats_fill(worker *w, uint64_t step, kvs_step *st)
{
    const kvs_geometry *g = &w->cfg->geom;
    size_t floats = 0;
    uint32_t group = g->q_heads / g->kv_heads;
    for (uint32_t l = 0; l < g->layers; l++) {
        if (w->p->needs & NEEDS_SCORE) {
            uint32_t n = w->tokens[l * w->heads];
            w->score[l] = w->random + (step * 7919u + l * 104729u) % RANDOM_FLOATS;
            floats += n;
        }
        if (w->p->needs & NEEDS_LAST_ATTN)
            for (uint32_t h = 0; h < g->q_heads; h++) {
                uint32_t list = l * w->heads + (w->heads == 1 ? 0 : h / group);
                w->last_attn[l * g->q_heads + h] =
                    w->random + (step * 7919u + (l * g->q_heads + h) * 104729u) % RANDOM_FLOATS;
                floats += w->tokens[list];
            }
    }
    st->heads = w->heads;
    st->tokens = w->tokens;
    st->score = w->p->needs & NEEDS_SCORE ? w->score : NULL;
    st->score_queries = 1;
    st->last_attn = w->p->needs & NEEDS_LAST_ATTN ? w->last_attn : NULL;
    st->confidence = w->p->needs & NEEDS_CONFIDENCE ? 0.5 : -1;
    return floats * sizeof(float);
}

/* --in-ring: the ring's rows for st's arrays (kvs_step_in_ring, timed into
 * w->rows_us), filled with the values st points at (the forward pass's
 * writes), and st pointed at them, so that kvs_seq_step copies nothing. */
static int stats_into_ring(worker *w, kvs_step *st)
{
    const kvs_geometry *g = &w->cfg->geom;
    unsigned arrays = (st->score ? KVS_STEP_SCORE : 0) | (st->last_attn ? KVS_STEP_LAST_ATTN : 0);
    kvs_step_rows r;
    double t0 = bench_now_us();
    int rc = kvs_step_in_ring(w->s, st->heads, st->tokens, arrays, &r);
    w->rows_us = bench_now_us() - t0;
    if (rc != 0) {
        report_fail(w->s, "kvs_step_in_ring", rc);
        return rc;
    }
    uint32_t group = g->q_heads / g->kv_heads;
    for (uint32_t l = 0; l < g->layers; l++) {
        if (st->score != NULL)
            memcpy(r.score[l], st->score[l], w->tokens[l * w->heads] * sizeof(float));
        for (uint32_t h = 0; st->last_attn != NULL && h < g->q_heads; h++) {
            uint32_t list = l * w->heads + (w->heads == 1 ? 0 : h / group);
            memcpy(r.last_attn[l * g->q_heads + h], st->last_attn[l * g->q_heads + h],
                   w->tokens[list] * sizeof(float));
        }
    }
    st->score = (const float *const *)r.score;
    st->last_attn = (const float *const *)r.last_attn;
    return 0;
}

/* Write the new tokens of every list of an append (untimed, as a worker's
 * attention would). A per-head list's rows are [tokens][head_dim]. */
static int write_new(worker *w, const kvs_table *t)
{
    for (uint32_t i = 0; i < t->layers; i++) {
        if (t->layer[i].tokens > w->kv_n)
            return KVS_ERR_INVALID;
        int rc = kvs_layer_write(w->s, &t->layer[i], w->k, w->v);
        if (rc != 0)
            return rc;
    }
    return 0;
}

static void tokens_from_table(worker *w, const kvs_table *t)
{
    for (uint32_t i = 0; i < t->layers; i++)
        w->tokens[i] = t->layer[i].tokens;
}

/* Create the sequence and prefill N tokens in chunks of PREFILL_CHUNK, each
 * chunk a prefill step with its statistics; *step_ms is the steps' time. */
static int seq_prefill(worker *w, uint32_t n, double *step_ms)
{
    *step_ms = 0;
    char buf[4][24];
    kvs_param p[4];
    size_t np = policy_params(w->p, n, buf, p);
    int rc = kvs_seq_create(w->s, w->p->name, p, np, "bench-step-context", &w->seq);
    if (rc != 0) {
        report_fail(w->s, "kvs_seq_create", rc);
        return -1;
    }
    for (uint32_t held = 0; held < n && rc == 0;) {
        uint32_t c = n - held < PREFILL_CHUNK ? n - held : PREFILL_CHUNK;
        kvs_table t;
        if ((rc = kvs_seq_append(w->s, w->seq, c, &t)) != 0) {
            report_fail(w->s, "kvs_seq_append (prefill)", rc);
            break;
        }
        w->heads = t.heads;
        for (uint32_t i = 0; i < t.layers; i++)
            w->tokens[i] = held + c;
        rc = write_new(w, &t);
        kvs_table_free(&t);
        kvs_step st = {.new_tokens = c, .prefill = 1};
        stats_fill(w, held, &st);
        kvs_step_result res;
        double t0 = bench_now_us();
        if (rc == 0 && (rc = kvs_seq_step(w->s, w->seq, &st, &res)) != 0)
            report_fail(w->s, "kvs_layer_write / kvs_seq_step (prefill)", rc);
        *step_ms += (bench_now_us() - t0) / 1000.0;
        held += c;
    }
    if (rc == 0 && (rc = kvs_seq_table(w->s, w->seq, 1, &w->held)) == 0)
        tokens_from_table(w, &w->held);
    return rc == 0 ? 0 : -1;
}

/* Read the sequence's table again into w->held. */
static int table_reread(worker *w)
{
    kvs_table_free(&w->held);
    int rc = kvs_seq_table(w->s, w->seq, 1, &w->held);
    if (rc != 0)
        report_fail(w->s, "kvs_seq_table", rc);
    return rc;
}

/* One decode step; the times go to t[0..3) (append, step, table); *changed
 * says whether the table changed beyond the append. */
static int decode_step(worker *w, uint64_t step, double *t, size_t *stats_bytes, int *changed)
{
    kvs_table a;
    double t0 = bench_now_us();
    int rc = kvs_seq_append(w->s, w->seq, 1, &a);
    double t1 = bench_now_us();
    if (rc != 0) {
        report_fail(w->s, "kvs_seq_append", rc);
        return -1;
    }
    for (uint32_t i = 0; i < a.layers; i++)
        w->tokens[i]++;
    rc = write_new(w, &a);
    double t1w = bench_now_us(); /* the writes are not timed */
    int extended = !w->cfg->reload && kvs_table_extend(&w->held, &a) == KVS_OK;
    double t2 = bench_now_us();
    uint64_t epoch = a.epoch;
    kvs_table_free(&a);
    kvs_step st = {.new_tokens = 1};
    *stats_bytes = stats_fill(w, step, &st);
    kvs_step_result res;
    double rows_us = 0; /* --in-ring: kvs_step_in_ring; the rows' writes are the forward pass's */
    if (rc == 0 && w->cfg->in_ring && *stats_bytes > 0 && (rc = stats_into_ring(w, &st)) == 0)
        rows_us = w->rows_us;
    double t3 = bench_now_us();
    if (rc == 0 && (rc = kvs_seq_step(w->s, w->seq, &st, &res)) != 0)
        report_fail(w->s, "kvs_seq_step", rc);
    double t4 = bench_now_us();
    *changed = rc == 0 && res.epoch != epoch;
    if (rc == 0 && extended && res.cut_lists > 0)
        rc = kvs_table_cut(&w->held, &res);
    else if (rc == 0 && (*changed || (!extended && !w->cfg->reload)))
        rc = table_reread(w);
    double t5 = bench_now_us();
    if (rc == 0 && (*changed || extended))
        tokens_from_table(w, &w->held);
    t[0] = t1 - t0, t[1] = rows_us + (t4 - t3), t[2] = (t2 - t1w) + (t5 - t4);
    return rc == 0 ? 0 : -1;
}

static double memcpy_once_us(uint8_t *dst, const uint8_t *src, size_t bytes)
{
    double t0 = bench_now_us();
    memcpy(dst, src, bytes);
    return bench_now_us() - t0;
}

/* N tokens held: prefill, warm up, then the timed steps, each followed by a
 * memcpy of its statistics bytes (the baseline in the same run). */
static int run_context(worker *w, uint32_t n, uint8_t *mc_a, uint8_t *mc_b, step_row *row)
{
    const bench_cfg *cfg = w->cfg;
    memset(row, 0, sizeof *row);
    row->context = n;
    if (seq_prefill(w, n, &row->prefill_ms) != 0) {
        kvs_table_free(&w->held);
        kvs_seq_release(w->s, w->seq);
        return -1;
    }
    uint32_t steps = cfg->steps;
    double *t = malloc((size_t)steps * 5 * sizeof *t);
    int rc = t != NULL ? 0 : -1;
    size_t bytes = 0, max_bytes = 0;
    int changed = 0;
    double warm_max = 0; /* the first decode steps may do what the prefill left (Conf-KV) */
    for (uint32_t i = 0; i < cfg->warmup && rc == 0; i++) {
        double ts[3];
        rc = decode_step(w, i, ts, &bytes, &changed);
        warm_max = fmax(warm_max, ts[0] + ts[1] + ts[2]);
        bench_busy_us(cfg->forward_us);
    }
    for (uint32_t i = 0; i < steps && rc == 0; i++) {
        double ts[3];
        rc = decode_step(w, cfg->warmup + i, ts, &bytes, &changed);
        bench_busy_us(cfg->forward_us);
        t[i] = ts[0], t[steps + i] = ts[1], t[2 * steps + i] = ts[2];
        t[3 * steps + i] = ts[0] + ts[1] + ts[2];
        t[4 * steps + i] = bytes > 0 ? memcpy_once_us(mc_b, mc_a, bytes) : 0;
        row->table_steps += (uint32_t)changed;
        max_bytes = bytes > max_bytes ? bytes : max_bytes;
    }
    if (rc == 0) {
        row->append_us = bench_median(t, steps);
        row->step_us = bench_median(t + steps, steps);
        row->table_us = bench_median(t + 2 * steps, steps);
        row->total_us = bench_median(t + 3 * steps, steps);
        /* bench_median sorted them */
        row->p99_ms = t[3 * steps + (size_t)(0.99 * (steps - 1))] / 1000.0;
        row->max_ms = fmax(t[4 * steps - 1], warm_max) / 1000.0;
        row->memcpy_us = bench_median(t + 4 * steps, steps);
        row->stats_mib = (double)max_bytes / 1048576.0;
        row->ran = 1;
    }
    free(t);
    kvs_table_free(&w->held);
    if (kvs_seq_release(w->s, w->seq) != 0)
        rc = -1;
    return rc;
}

static void print_row(FILE *f, const char *policy, const step_row *r, int csv)
{
    if (csv) {
        fprintf(f, "%s,%" PRIu32 ",%.1f,%.1f,%.1f,%.1f,%.3f,%.1f,%" PRIu32 ",%.1f,%.1f,%.2f\n",
                policy, r->context, r->append_us, r->step_us, r->table_us, r->total_us,
                r->stats_mib, r->memcpy_us, r->table_steps, r->max_ms, r->prefill_ms, r->p99_ms);
        return;
    }
    char ratio[16] = "-";
    if (r->memcpy_us > 0)
        snprintf(ratio, sizeof ratio, "%.2f", r->total_us / r->memcpy_us);
    fprintf(f,
            "%-10s %8" PRIu32 " %9.1f %10.1f %9.1f %10.1f %9.2f %10.1f %7s %6" PRIu32
            " %7.2f %8.1f %10.1f\n",
            policy, r->context, r->append_us, r->step_us, r->table_us, r->total_us, r->stats_mib,
            r->memcpy_us, ratio, r->table_steps, r->p99_ms, r->max_ms, r->prefill_ms);
}

/* ---- options ----------------------------------------------------------- */

static int parse_contexts(const char *arg, bench_cfg *cfg)
{
    cfg->ncontexts = 0;
    const char *p = arg;
    while (*p != '\0') {
        char *end;
        unsigned long n = strtoul(p, &end, 10);
        if (end == p || n < 64 || n > (1u << 20) || n % 16 != 0 || cfg->ncontexts == MAX_CONTEXTS ||
            (*end != ',' && *end != '\0')) {
            fprintf(stderr,
                    "bench_step_context: --contexts: want up to %d multiples of 16 in "
                    "64..1048576, comma-separated; got '%s'\n",
                    MAX_CONTEXTS, arg);
            return -1;
        }
        cfg->contexts[cfg->ncontexts++] = (uint32_t)n;
        p = *end == ',' ? end + 1 : end;
    }
    return cfg->ncontexts > 0 ? 0 : -1;
}

static int parse_policies(const char *arg, bench_cfg *cfg)
{
    cfg->npolicies = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        const bench_policy *found = NULL;
        for (size_t i = 0; i < NPOLICIES; i++)
            if (strcmp(all_policies[i].label, tok) == 0)
                found = &all_policies[i];
        if (found == NULL || cfg->npolicies == MAX_POLICIES) {
            fprintf(stderr,
                    "bench_step_context: --policies: '%s' is not one of streaming, "
                    "streaming_sketch, streaming_int8v, h2o, h2o_int8, tova, tova_sum, confkv, "
                    "weightedkv, reviver, ov_block\n",
                    tok);
            return -1;
        }
        cfg->policies[cfg->npolicies++] = found;
    }
    return cfg->npolicies > 0 ? 0 : -1;
}

static int parse_args(int argc, char **argv, bench_cfg *cfg, const char **daemon)
{
    static const uint32_t full[] = {1024, 4096, 16384, 32768, 65536, 131072};
    *cfg = (bench_cfg){.geom = {.layers = 32,
                                .q_heads = 32,
                                .kv_heads = 8,
                                .head_dim = 128,
                                .block_tokens = 16,
                                .dtype = KVS_FP16},
                       .steps = 33,
                       .warmup = 4};
    memcpy(cfg->contexts, full, sizeof full);
    cfg->ncontexts = sizeof full / sizeof full[0];
    for (size_t i = 0; i < NPOLICIES; i++)
        cfg->policies[cfg->npolicies++] = &all_policies[i];
    for (int i = 1; i < argc; i++) {
        const char *next = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--quick") == 0) {
            cfg->geom.layers = 4, cfg->geom.head_dim = 16;
            cfg->contexts[0] = 256, cfg->contexts[1] = 1024, cfg->ncontexts = 2;
            cfg->steps = 9, cfg->warmup = 2;
        } else if (strcmp(argv[i], "--contexts") == 0 && next != NULL) {
            if (parse_contexts(argv[++i], cfg) != 0)
                return -1;
        } else if (strcmp(argv[i], "--policies") == 0 && next != NULL) {
            if (parse_policies(argv[++i], cfg) != 0)
                return -1;
        } else if (strcmp(argv[i], "--head-dim") == 0 && next != NULL) {
            unsigned long d = strtoul(argv[++i], NULL, 10);
            if (d < 2 || d > 256 || d % 2 != 0) {
                fprintf(stderr, "bench_step_context: --head-dim: want an even 2..256\n");
                return -1;
            }
            cfg->geom.head_dim = (uint32_t)d;
        } else if (strcmp(argv[i], "--csv") == 0 && next != NULL) {
            cfg->csv = argv[++i];
        } else if (strcmp(argv[i], "--steps") == 0 && next != NULL) {
            unsigned long n = strtoul(argv[++i], NULL, 10);
            if (n < 1 || n > 100000) {
                fprintf(stderr, "bench_step_context: --steps: want 1..100000 timed steps\n");
                return -1;
            }
            cfg->steps = (uint32_t)n;
        } else if (strcmp(argv[i], "--reload") == 0) {
            cfg->reload = 1;
        } else if (strcmp(argv[i], "--in-ring") == 0) {
            cfg->in_ring = 1;
        } else if (strcmp(argv[i], "--forward-us") == 0 && next != NULL) {
            cfg->forward_us = strtod(argv[++i], NULL);
            if (!(cfg->forward_us >= 0 && cfg->forward_us <= 1e6)) {
                fprintf(stderr, "bench_step_context: --forward-us: want 0..1000000\n");
                return -1;
            }
        } else if (strcmp(argv[i], "--policy-threads") == 0 && next != NULL) {
            cfg->policy_threads = argv[++i];
        } else if (strcmp(argv[i], "--metrics") == 0) {
            cfg->metrics = 1;
        } else if (argv[i][0] == '-') {
            fprintf(stderr,
                    "usage: %s [--quick] [--contexts N,N,...] [--head-dim D] [--policies P,...] "
                    "[--steps N] [--reload] [--forward-us N] [--in-ring] [--policy-threads N] "
                    "[--metrics] [--csv FILE] "
                    "[PATH_TO_KVSTASHD]\n",
                    argv[0]);
            return -1;
        } else {
            *daemon = argv[i];
        }
    }
    return 0;
}

/* ---- main -------------------------------------------------------------- */

int main(int argc, char **argv)
{
    bench_cfg cfg;
    const char *daemon = NULL;
    if (parse_args(argc, argv, &cfg, &daemon) != 0)
        return 2;
    if (daemon == NULL)
        daemon = bench_default_daemon();
    /* Long steps are measured, not failed: libkvstash's default deadline is
     * 10 s, and a prefill step of a long context may take longer (the
     * table says which). */
    setenv("KVSTASH_RPC_TIMEOUT_MS", "600000", 0);
    signal(SIGPIPE, SIG_IGN);
    atexit(bench_daemon_cleanup);
    const kvs_geometry *g = &cfg.geom;
    uint32_t max_n = 0;
    for (size_t i = 0; i < cfg.ncontexts; i++)
        max_n = cfg.contexts[i] > max_n ? cfg.contexts[i] : max_n;

    /* The pool: twice the longest context of every layer's K and V (a
     * list whose evictions leave holes that compaction cannot close yet,
     * as reviver's swaps do, holds up to twice its blocks; retired blocks
     * return only when the worker acks), and a block per list to spare;
     * the ring: one float per held token per query head and layer. */
    size_t block_bytes = (size_t)g->block_tokens * token_kv_bytes(g) * 2;
    size_t blocks = ((size_t)max_n / g->block_tokens + 2) * g->layers * 2;
    int pool_mb = (int)((blocks * block_bytes >> 20) + 16);
    size_t stats_max = ((size_t)max_n + 1) * g->layers * g->q_heads * sizeof(float);
    char ring_mb[16];
    snprintf(ring_mb, sizeof ring_mb, "%zu", (stats_max >> 20) + 2);
    /* A table with positions of 256 per-head lists of 128k tokens (weightedkv)
     * is 100 MB, over the default --max-reply-mb of 64. */
    const char *extra[10] = {"--ring-mb", ring_mb, "--max-reply-mb", "1024"};
    size_t nextra = 4;
    if (cfg.policy_threads != NULL) {
        extra[nextra++] = "--policy-threads";
        extra[nextra++] = cfg.policy_threads;
    }
    if (cfg.metrics) {
        extra[nextra++] = "--metrics";
        extra[nextra++] = "127.0.0.1:0";
    }

    printf("bench_step_context: %u layers, %u query / %u KV heads x %u, fp16, %u-token blocks; "
           "%u timed decode steps per cell (after %u), %.0f us of forward pass between them; "
           "statistics %s; pool %d MiB, ring %s MiB; metrics %s; kernels %s\n",
           g->layers, g->q_heads, g->kv_heads, g->head_dim, g->block_tokens, cfg.steps, cfg.warmup,
           cfg.forward_us, cfg.in_ring ? "written into the ring" : "copied by kvs_seq_step",
           pool_mb, ring_mb, cfg.metrics ? "on" : "off", kv_kernel_isa());
    fflush(stdout);
    char sock[PATH_MAX];
    if (bench_daemon_start("bench_step_context", daemon, pool_mb, extra, sock, sizeof sock) != 0)
        return 1;

    FILE *csv = NULL;
    if (cfg.csv != NULL && (csv = fopen(cfg.csv, "w")) == NULL) {
        perror(cfg.csv);
        return 1;
    }
    if (csv)
        fprintf(csv, "policy,context,append_us,step_us,table_us,total_us,stats_mib,memcpy_us,"
                     "table_steps,max_ms,prefill_ms,p99_ms\n");
    worker w = {.cfg = &cfg};
    uint8_t *mc_a = malloc(stats_max), *mc_b = malloc(stats_max);
    int failed = mc_a == NULL || mc_b == NULL || worker_data_make(&w, max_n) != 0;
    if (failed)
        fprintf(stderr, "bench_step_context: out of memory\n");
    else
        memset(mc_a, 0x3c, stats_max), memset(mc_b, 0, stats_max);
    char err[256] = "";
    int rc =
        failed ? 0
               : kvs_session_attach(sock, "bench", g, "bench_step_context", &w.s, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "bench_step_context: kvs_session_attach: %s: %s\n", kvs_strerror(rc), err);
        failed = 1;
    }
    double ping[101];
    for (int i = 0; i < 101 && !failed; i++) {
        double t0 = bench_now_us();
        failed |= kvs_ring_ping(w.s) != 0;
        ping[i] = bench_now_us() - t0;
    }
    if (!failed)
        printf("empty ring round trip: %.1f us (median of 101)\n", bench_median(ping, 101));
    printf("\n%-10s %8s %9s %10s %9s %10s %9s %10s %7s %6s %7s %8s %10s\n", "policy", "context",
           "append us", "step us", "table us", "total us", "stats MiB", "memcpy us", "ratio",
           "tables", "p99 ms", "max ms", "prefill ms");
    for (size_t p = 0; p < cfg.npolicies && !failed; p++) {
        w.p = cfg.policies[p];
        for (size_t c = 0; c < cfg.ncontexts; c++) {
            step_row row;
            if (run_context(&w, cfg.contexts[c], mc_a, mc_b, &row) != 0) {
                fprintf(stderr, "bench_step_context: %s at %" PRIu32 " tokens failed\n", w.p->label,
                        cfg.contexts[c]);
                failed = 1;
                break;
            }
            print_row(stdout, w.p->label, &row, 0);
            if (csv)
                print_row(csv, w.p->label, &row, 1);
            fflush(stdout);
        }
    }
    printf("\n(medians; total = append + step + table of the same step; ratio = total over a "
           "memcpy of the step's statistics bytes; tables = timed steps whose table changed "
           "beyond the append; p99 ms = the 99th percentile of the timed steps' totals; max ms = "
           "the slowest decode step, warm-up included; prefill ms = the "
           "prefill steps' time, appends and writes excluded)\n");
    if (w.s != NULL && kvs_session_detach(w.s) != 0)
        failed = 1;
    worker_data_free(&w);
    free(mc_a), free(mc_b);
    if (csv)
        fclose(csv);
    int ds = bench_daemon_stop();
    if (ds != 0) {
        fprintf(stderr, "bench_step_context: kvstashd exited with status %d\n", ds);
        failed = 1;
    }
    return failed ? 1 : 0;
}
