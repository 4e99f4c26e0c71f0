/*
 * bench_many_workers.c - many worker processes stepping their own sequences
 * on one kvstashd, with and without one more worker that revives and demotes
 * in a loop (issue 16 §3: the baseline before finer locking).
 *
 * Each of N worker processes attaches (its own session, one pool: 8 layers,
 * 32 query / 8 KV heads x 128, fp16, 16-token blocks), prefills a
 * `streaming` sequence of 1,024 tokens, then runs decode steps: a 1-token
 * kvs_seq_append, the K/V writes of every layer, kvs_seq_step. A step's
 * latency is those three, from the worker. With the mover, one more process
 * loops over a Revive of 4,096 INT8 tokens of one layer (and its release)
 * and the creation of a 1,024-token `full int8=on int8_window=0` sequence
 * whose prefill step demotes it all, released again, until the workers end;
 * --mover revive or --mover demote runs only that half of its loop.
 * --mover decide loops over a prompt's decision instead: a `snapkv`
 * sequence of DECIDE_TOKENS tokens (its K/V left unwritten: the decision
 * reads only the statistics), its prefill step with every query head's
 * window attention, and its release.
 *
 * Figures: aggregate steps per second (all workers' steps over the slowest
 * worker's time), the median of the workers' p50 and the worst worker's
 * p99; the baselines are the same N without the mover and N = 1.
 *
 * Usage: bench_many_workers [--quick] [--steps N] [--mover both|revive|demote|decide]
 *                           [PATH_TO_KVSTASHD]
 * (--steps: decode steps a worker, 1,000 by default, 50 with --quick)
 * Exits non-zero only if a part could not run.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "kernels.h"
#include "kvstash.h"

#define POOL_MB 2048
#define PREFILL 1024u
#define MOVER_TOKENS 4096u
/* A prompt whose decision (8 layers x 8 KV heads x 3,072 tokens) stays under
 * the daemon's POLICY_HOST_PARALLEL_TOKENS, so that it runs on one thread. */
#define DECIDE_TOKENS 3072u
#define MAX_WORKERS 8

static const kvs_geometry geom = {.layers = 8,
                                  .q_heads = 32,
                                  .kv_heads = 8,
                                  .head_dim = 128,
                                  .block_tokens = 16,
                                  .dtype = KVS_FP16};

/* What a worker reports to the parent through its pipe. */
typedef struct worker_result {
    int ok;
    uint32_t steps;
    double elapsed_us, p50_us, p99_us;
} worker_result;

static size_t token_bytes(void)
{
    return (size_t)geom.kv_heads * geom.head_dim * 2; /* K (or V) of a token of a layer */
}

static kvs_session *attach(const char *sock, const char *name)
{
    kvs_session *s = NULL;
    char err[256] = "";
    int rc = kvs_session_attach(sock, "many", &geom, name, &s, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "bench_many_workers: %s: attach: %s: %s\n", name, kvs_strerror(rc), err);
    return rc == 0 ? s : NULL;
}

static int fail(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, "bench_many_workers: %s: %s: %s\n", what, kvs_strerror(rc),
            kvs_session_error(s));
    return -1;
}

/* Append `count` tokens, write them (the same bytes in every layer) and end
 * the step. */
static int append_write_step(kvs_session *s, uint64_t seq, uint32_t count, int prefill,
                             const uint8_t *kv)
{
    kvs_table w;
    int rc = kvs_seq_append(s, seq, count, &w);
    if (rc != 0)
        return fail(s, "kvs_seq_append", rc);
    for (uint32_t l = 0; l < w.layers && rc == 0; l++)
        rc = kvs_layer_write(s, &w.layer[l], kv, kv);
    kvs_table_free(&w);
    kvs_step st = {.new_tokens = count, .prefill = prefill, .confidence = -1};
    kvs_step_result res;
    if (rc == 0)
        rc = kvs_seq_step(s, seq, &st, &res);
    return rc == 0 ? 0 : fail(s, "kvs_layer_write / kvs_seq_step", rc);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A stepping worker: waits for the start byte on `go`, runs `steps`
 * decode steps, writes its worker_result to `out`. */
static int run_worker(const char *sock, int go, int out, uint32_t steps, const uint8_t *kv)
{
    worker_result r = {0};
    double *t = malloc(steps * sizeof *t);
    kvs_session *s = attach(sock, "bench-many-worker");
    uint64_t seq = 0;
    const kvs_param p[] = {{"n_sink", "4"}, {"window", "1020"}};
    int rc = s != NULL && t != NULL ? 0 : -1;
    if (rc == 0 && (rc = kvs_seq_create(s, "streaming", p, 2, "bench-many", &seq)) != 0)
        fail(s, "kvs_seq_create", rc);
    if (rc == 0)
        rc = append_write_step(s, seq, PREFILL, 1, kv);
    char c;
    if (read(go, &c, 1) != 1)
        rc = -1;
    double t0 = bench_now_us();
    for (uint32_t i = 0; i < steps && rc == 0; i++) {
        double a = bench_now_us();
        rc = append_write_step(s, seq, 1, 0, kv);
        t[i] = bench_now_us() - a;
    }
    if (rc == 0) {
        r.elapsed_us = bench_now_us() - t0;
        qsort(t, steps, sizeof *t, cmp_double);
        r = (worker_result){1, steps, r.elapsed_us, t[steps / 2], t[(size_t)(steps * 0.99)]};
    }
    if (s != NULL && seq != 0 && kvs_seq_release(s, seq) != 0)
        r.ok = 0;
    if (s != NULL && kvs_session_detach(s) != 0)
        r.ok = 0;
    free(t);
    return write(out, &r, sizeof r) == (ssize_t)sizeof r && r.ok ? 0 : 1;
}

/* What the mover's loop does (--mover). */
enum { MOVE_REVIVE = 1, MOVE_DEMOTE = 2, MOVE_DECIDE = 4 };
static int mover_does = MOVE_REVIVE | MOVE_DEMOTE;

/* --mover decide's call: a prompt's decision over DECIDE_TOKENS tokens, every
 * query head's window attention `attn`. */
static int decide_prompt(kvs_session *s, const float *attn)
{
    const kvs_param p[] = {{"budget", "1024"}};
    uint64_t seq;
    int rc = kvs_seq_create(s, "snapkv", p, 1, "bench-many-decide", &seq);
    if (rc != 0)
        return fail(s, "kvs_seq_create", rc);
    kvs_table w;
    if ((rc = kvs_seq_append(s, seq, DECIDE_TOKENS, &w)) != 0) {
        fail(s, "kvs_seq_append", rc);
    } else {
        uint32_t tokens[8 * 8];    /* geom's layers x KV heads */
        const float *rows[8 * 32]; /* layers x query heads */
        for (uint32_t i = 0; i < geom.layers * w.heads; i++)
            tokens[i] = DECIDE_TOKENS;
        for (uint32_t i = 0; i < geom.layers * geom.q_heads; i++)
            rows[i] = attn + (size_t)(i % 7) * 64; /* rows of different values */
        kvs_step st = {.new_tokens = DECIDE_TOKENS,
                       .prefill = 1,
                       .heads = w.heads,
                       .tokens = tokens,
                       .window_attn = rows,
                       .window_queries = 64,
                       .confidence = -1};
        if ((rc = kvs_seq_step(s, seq, &st, NULL)) != 0)
            fail(s, "kvs_seq_step", rc);
        kvs_table_free(&w);
    }
    if (kvs_seq_release(s, seq) != 0)
        rc = -1;
    return rc;
}

/* The mover: revives and demotes (or decides) until `stop` becomes
 * readable (EOF). */
static int run_mover(const char *sock, int go, int stop, const uint8_t *kv)
{
    kvs_session *s = attach(sock, "bench-many-mover");
    const kvs_param p8[] = {{"int8", "on"}, {"int8_window", "0"}};
    uint64_t big = 0;
    int rc = s != NULL ? 0 : -1;
    if (rc == 0 && (rc = kvs_seq_create(s, "full", p8, 2, "bench-many-mover", &big)) != 0)
        fail(s, "kvs_seq_create", rc);
    for (uint32_t done = 0; rc == 0 && done < MOVER_TOKENS; done += PREFILL)
        rc = append_write_step(s, big, PREFILL, 1, kv);
    float *attn = malloc((DECIDE_TOKENS + 7 * 64) * sizeof *attn);
    if (attn == NULL)
        rc = -1;
    for (uint32_t i = 0; attn != NULL && i < DECIDE_TOKENS + 7 * 64; i++)
        attn[i] = (float)((i * 2654435761u) % 65536u) / 65536.0f;
    char c;
    if (read(go, &c, 1) != 1)
        rc = -1;
    uint64_t loops = 0;
    while (rc == 0 && read(stop, &c, 1) != 0) { /* non-blocking: EAGAIN until the end */
        if (mover_does & MOVE_DECIDE) {
            rc = decide_prompt(s, attn);
            loops++;
            continue;
        }
        kvs_revive rv;
        if ((mover_does & MOVE_REVIVE) &&
            (rc = kvs_seq_revive(s, big, 0, 0, 0, MOVER_TOKENS, 0, &rv)) != 0) {
            fail(s, "kvs_seq_revive", rc);
            break;
        }
        if ((mover_does & MOVE_REVIVE) && (rc = kvs_revive_release(s, &rv)) != 0) {
            fail(s, "kvs_revive_release", rc);
            break;
        }
        uint64_t seq;
        if ((mover_does & MOVE_DEMOTE) &&
            (rc = kvs_seq_create(s, "full", p8, 2, "bench-many-demote", &seq)) != 0) {
            fail(s, "kvs_seq_create", rc);
            break;
        }
        if (mover_does & MOVE_DEMOTE) {
            rc = append_write_step(s, seq, PREFILL, 1, kv);
            if (kvs_seq_release(s, seq) != 0)
                rc = -1;
        }
        loops++;
    }
    free(attn);
    if (s != NULL && kvs_session_detach(s) != 0)
        rc = -1;
    fprintf(stderr, "bench_many_workers: the mover ran %" PRIu64 " loops\n", loops);
    return rc == 0 ? 0 : 1;
}

typedef struct run_row {
    int n, mover;
    double steps_per_s, p50_us, p99_us;
    int ran;
} run_row;

/* N workers (and the mover): fork them, start them together, collect. */
static int run_config(const char *sock, int n, int mover, uint32_t steps, const uint8_t *kv,
                      run_row *row)
{
    int go[2], res[2], stop[2];
    if (pipe(go) != 0 || pipe(res) != 0 || pipe(stop) != 0)
        return -1;
    pid_t pids[MAX_WORKERS + 1];
    int np = 0;
    for (int i = 0; i < n + mover; i++) {
        pid_t pid = fork();
        if (pid < 0)
            break;
        if (pid == 0) {
            close(go[1]);
            close(res[0]);
            close(stop[1]);
            if (i == n) {
                fcntl(stop[0], F_SETFL, O_NONBLOCK);
                _exit(run_mover(sock, go[0], stop[0], kv));
            }
            close(stop[0]);
            _exit(run_worker(sock, go[0], res[1], steps, kv));
        }
        pids[np++] = pid;
    }
    close(go[0]);
    close(res[1]);
    close(stop[0]);
    /* Every process attaches and prefills before it reads its start byte. */
    for (int i = 0; i < np; i++)
        if (write(go[1], "g", 1) != 1)
            break;
    worker_result r[MAX_WORKERS];
    int got = 0;
    while (got < n && read(res[0], &r[got], sizeof r[got]) == (ssize_t)sizeof r[got])
        got++;
    close(stop[1]); /* the mover sees EOF */
    int failed = np != n + mover || got != n;
    for (int i = 0; i < np; i++) {
        int st;
        if (waitpid(pids[i], &st, 0) != pids[i] || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            failed = 1;
    }
    close(go[1]);
    close(res[0]);
    double p50[MAX_WORKERS], worst = 0, slowest = 0, total = 0;
    for (int i = 0; i < got; i++) {
        failed |= !r[i].ok;
        p50[i] = r[i].p50_us;
        worst = r[i].p99_us > worst ? r[i].p99_us : worst;
        slowest = r[i].elapsed_us > slowest ? r[i].elapsed_us : slowest;
        total += r[i].steps;
    }
    if (!failed) {
        *row =
            (run_row){n, mover, total / (slowest / 1e6), bench_median(p50, (size_t)got), worst, 1};
    }
    return failed ? -1 : 0;
}

int main(int argc, char **argv)
{
    uint32_t steps = 1000;
    const char *daemon = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            steps = 50;
        } else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
            char *end;
            unsigned long n = strtoul(argv[++i], &end, 10);
            if (*end != '\0' || n == 0 || n > 1000000) {
                fprintf(stderr, "bench_many_workers: --steps is 1..1000000, not %s\n", argv[i]);
                return 2;
            }
            steps = (uint32_t)n;
        } else if (strcmp(argv[i], "--mover") == 0 && i + 1 < argc) {
            const char *m = argv[++i];
            mover_does = strcmp(m, "revive") == 0   ? MOVE_REVIVE
                         : strcmp(m, "demote") == 0 ? MOVE_DEMOTE
                         : strcmp(m, "both") == 0   ? MOVE_REVIVE | MOVE_DEMOTE
                         : strcmp(m, "decide") == 0 ? MOVE_DECIDE
                                                    : 0;
            if (mover_does == 0) {
                fprintf(stderr,
                        "bench_many_workers: --mover is both, revive, demote or decide, not %s\n",
                        m);
                return 2;
            }
        } else if (argv[i][0] == '-') {
            fprintf(stderr,
                    "usage: %s [--quick] [--steps N] [--mover both|revive|demote|decide] "
                    "[PATH_TO_KVSTASHD]\n",
                    argv[0]);
            return 2;
        } else {
            daemon = argv[i];
        }
    }
    if (daemon == NULL)
        daemon = bench_default_daemon();
    signal(SIGPIPE, SIG_IGN);
    atexit(bench_daemon_cleanup);
    printf("bench_many_workers: %u layers, %u query / %u KV heads x %u, fp16; streaming, %u "
           "tokens held; %u decode steps per worker; mover: %s; %ld CPUs; kernels %s\n",
           geom.layers, geom.q_heads, geom.kv_heads, geom.head_dim, PREFILL, steps,
           mover_does == MOVE_REVIVE   ? "revive"
           : mover_does == MOVE_DEMOTE ? "demote"
           : mover_does == MOVE_DECIDE ? "a prompt's decision"
                                       : "revive and demote",
           sysconf(_SC_NPROCESSORS_ONLN), kv_kernel_isa());
    fflush(stdout);
    char sock[PATH_MAX];
    if (bench_daemon_start("bench_many_workers", daemon, POOL_MB, NULL, sock, sizeof sock) != 0)
        return 1;
    uint8_t *kv = calloc(PREFILL, token_bytes());
    if (kv == NULL)
        return 1;
    for (size_t i = 0; i < PREFILL * token_bytes() / 2; i++) /* finite fp16 values in [-1, 1) */
        kv_elt_store(kv + 2 * i, KV_FP16, (float)((int)(i % 251) - 125) / 126.f);
    static const int ns[] = {1, 2, 4, 8};
    run_row rows[8];
    memset(rows, 0, sizeof rows);
    int failed = 0;
    for (size_t i = 0; i < 4; i++)
        for (int m = 0; m < 2; m++) {
            fflush(stdout);
            if (run_config(sock, ns[i], m, steps, kv, &rows[2 * i + m]) != 0) {
                fprintf(stderr, "bench_many_workers: N=%d mover=%d failed\n", ns[i], m);
                failed = 1;
            }
        }
    free(kv);
    printf("\n%3s %6s %12s %10s %10s %16s %14s\n", "N", "mover", "steps/s", "p50 us", "p99 us",
           "steps/s vs N=1", "p99 vs idle");
    for (size_t i = 0; i < 8; i++) {
        const run_row *r = &rows[i];
        if (!r->ran)
            continue;
        const run_row *idle = &rows[i & ~(size_t)1], *one = &rows[i & 1];
        printf("%3d %6s %12.0f %10.1f %10.1f %16.2f %14.2f\n", r->n, r->mover ? "on" : "off",
               r->steps_per_s, r->p50_us, r->p99_us,
               one->ran ? r->steps_per_s / one->steps_per_s : 0,
               idle->ran ? r->p99_us / idle->p99_us : 0);
    }
    printf("\n(p50: the median of the workers' p50; p99: the worst worker's p99; steps/s: all "
           "workers' steps over the slowest worker's time; p99 vs idle: against the same N "
           "without the mover)\n");
    int ds = bench_daemon_stop();
    if (ds != 0) {
        fprintf(stderr, "bench_many_workers: kvstashd exited with status %d\n", ds);
        failed = 1;
    }
    return failed ? 1 : 0;
}
