/*
 * bench_policy_decision.c - one full policy decision at Llama-3-8B shape
 * (issue 16 §1): 32 layers x 8 KV heads (32 query heads) x 32,768 tokens,
 * keep 8,192, for snapkv (avg pooling, kernel 5, window 64), criticalkv (two
 * stages, the projected value norm given), adakv, h2o and tova, against
 *  (a) the same rule in PyTorch on the CPU (policy_decision_torch.py, run by
 *      /usr/bin/python3 in the same run on the same inputs, with the same
 *      number of threads), and
 *  (b) the bandwidth bound: a plain read of the decision's input bytes once
 *      (a sum of 64-bit words), timed in the same process.
 *
 * The statistics are what a worker reports on the step that ends the prompt
 * (window_attn and vnorm for the SnapKV family, the accumulated score for
 * h2o, the last query's attention for tova), and the policies run through
 * the policy host as the daemon runs them (policy_host_step_layers: every
 * layer's step, on as many threads as the row's). Timed: the 32 steps of
 * one decision, on a fresh host each repetition (h2o keeps state), median
 * of the repetitions. Times on one thread are the thread's CPU time on
 * both sides (robust to the other users of a shared machine), times on two
 * threads wall clock.
 *
 * Exactness: every input is an integer multiple of a power of two (window
 * attention a multiple of 5·2^-24), so pooling, group means and sums are
 * exact in double on both sides and ties are real ties, which both sides
 * break towards the lower index (the torch side fixes the boundary ties of
 * torch.topk, which leaves them open; see the script). The kept sets of C
 * and PyTorch must be equal, token for token; the benchmark exits 1 if not.
 *
 * Memory: a long-running daemon's heap is warm, while a fresh process
 * page-faults every large allocation (and on this kind of VM a fault costs
 * microseconds). So both processes keep freed memory in their heap
 * (mallopt here, MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ in the
 * script's environment) and the first decision of each side is a warm-up.
 *
 * Threads: C, PyTorch and the read bound get 1 and 2 threads. C's layers
 * go to the threads a layer at a time (kvstashd --policy-threads; the
 * policies here all step their layers independently), and the kept sets of
 * both rows are compared with PyTorch's.
 *
 * Usage: bench_policy_decision [--quick] [--reps N] [--torch SCRIPT]
 *                              [--python PATH] [--tmp DIR]
 *   --quick: 2 layers x 2 KV heads (8 query heads) x 2,048 tokens, keep 512
 */
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "host.h"
#include "policy.h"

#ifndef KVSTASH_BENCH_DIR
#define KVSTASH_BENCH_DIR "tests/bench"
#endif

enum { NPOLICIES = 5, MAX_THREADS = 2, MAX_REPS = 64 };

typedef struct shape {
    uint32_t layers, q_heads, kv_heads, tokens, keep, window, kernel;
} shape;

/* The inputs, as the worker reports them, all layers. */
typedef struct inputs {
    float *window_attn; /* [layers][q_heads][tokens] */
    float *vnorm;       /* [layers][kv_heads][tokens] */
    float *score;       /* [layers][tokens] (h2o) */
    float *last_attn;   /* [layers][q_heads][tokens] (tova) */
} inputs;

typedef struct policy_case {
    const char *name;
    int per_head; /* kept sets per KV head, else per layer */
    int reads_window, reads_vnorm, reads_score, reads_last;
} policy_case;

static const policy_case cases[NPOLICIES] = {
    {"snapkv", 1, 1, 0, 0, 0}, {"criticalkv", 1, 1, 1, 0, 0}, {"adakv", 1, 1, 0, 0, 0},
    {"h2o", 0, 0, 0, 1, 0},    {"tova", 0, 0, 0, 0, 1},
};

/* Wall clock, or the calling thread's CPU time: single-threaded work is
 * timed in CPU time, so that time spent descheduled on a shared machine does
 * not count (as bench_kernels does). */
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

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    return t[n / 2];
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "bench_policy_decision: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* ---- inputs ---- */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n floats k·unit, k uniform in [lo, lo + span). Few distinct values, so
 * that ties are common and their order is tested. */
static void fill(float *a, size_t n, uint64_t *seed, uint32_t lo, uint32_t span, double unit)
{
    for (size_t i = 0; i < n; i++)
        a[i] = (float)((double)(lo + splitmix(seed) % span) * unit);
}

static size_t n_window(const shape *s)
{
    return (size_t)s->layers * s->q_heads * s->tokens;
}

static size_t n_vnorm(const shape *s)
{
    return (size_t)s->layers * s->kv_heads * s->tokens;
}

static size_t n_score(const shape *s)
{
    return (size_t)s->layers * s->tokens;
}

static void make_inputs(const shape *s, inputs *in)
{
    uint64_t seed = 16;
    in->window_attn = xmalloc(n_window(s) * sizeof(float));
    in->vnorm = xmalloc(n_vnorm(s) * sizeof(float));
    in->score = xmalloc(n_score(s) * sizeof(float));
    in->last_attn = xmalloc(n_window(s) * sizeof(float));
    /* Window attention: multiples of 5·2^-24, so that the avg pool's sum
     * divided by 5 is exact. */
    fill(in->window_attn, n_window(s), &seed, 0, 4096, 5.0 / 16777216.0);
    fill(in->vnorm, n_vnorm(s), &seed, 1, 4095, 1.0 / 64.0);
    fill(in->score, n_score(s), &seed, 0, 65536, 1.0 / 1048576.0);
    fill(in->last_attn, n_window(s), &seed, 0, 4096, 1.0 / 16777216.0);
}

static int write_array(FILE *f, const float *a, size_t n)
{
    return fwrite(a, sizeof *a, n, f) == n ? 0 : -1;
}

static int write_inputs(const char *path, const shape *s, const inputs *in)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return -1;
    int rc = write_array(f, in->window_attn, n_window(s)) | write_array(f, in->vnorm, n_vnorm(s)) |
             write_array(f, in->score, n_score(s)) | write_array(f, in->last_attn, n_window(s));
    return fclose(f) != 0 ? -1 : rc;
}

/* ---- the C decision through the policy host ---- */

static policy_host *make_host(const shape *s, const policy_case *pc)
{
    char keep[32], window[32], kernel[32];
    snprintf(keep, sizeof keep, "%u", s->keep);
    snprintf(window, sizeof window, "%u", s->window);
    snprintf(kernel, sizeof kernel, "%u", s->kernel);
    /* keep = tokens / 4: compression_ratio 0.75 gives n_keep = int(L·0.25)
     * = keep exactly. */
    const char *keys[3], *vals[3];
    size_t n = 0;
    if (pc->reads_window) {
        keys[n] = "compression_ratio", vals[n++] = "0.75";
        keys[n] = "window", vals[n++] = window;
        keys[n] = "kernel", vals[n++] = kernel;
    } else {
        keys[n] = "budget", vals[n++] = keep;
    }
    const policy_ops *ops = policy_find(pc->name);
    policy_geometry g = {s->layers, s->q_heads, s->kv_heads, 128, 16, 500000.0f};
    policy_params p;
    policy_host *h = NULL;
    char err[POLICY_ERR_LEN] = "";
    if (ops == NULL || policy_params_resolve(ops, keys, vals, n, &p, err, sizeof err) != 0 ||
        policy_host_create(ops, &p, &g, &h, err, sizeof err) != 0 ||
        policy_host_append(h, s->tokens) != 0) {
        fprintf(stderr, "bench_policy_decision: %s: %s\n", pc->name, err);
        exit(1);
    }
    return h;
}

/* The stats of layer l, pointing into the inputs (rows holds the per-head
 * pointers: q_heads for window/last attention, then kv_heads for vnorm). */
static policy_stats layer_stats(const shape *s, const inputs *in, const policy_case *pc, uint32_t l,
                                const float **rows)
{
    policy_stats st = {.new_tokens = s->tokens, .prefill = 1, .confidence = -1.0};
    size_t L = s->tokens;
    const float **q = rows, **v = rows + s->q_heads;
    for (uint32_t h = 0; h < s->q_heads; h++)
        q[h] =
            (pc->reads_last ? in->last_attn : in->window_attn) + ((size_t)l * s->q_heads + h) * L;
    for (uint32_t g = 0; g < s->kv_heads; g++)
        v[g] = in->vnorm + ((size_t)l * s->kv_heads + g) * L;
    if (pc->reads_window) {
        st.window_attn = q;
        st.window_queries = s->window;
    }
    if (pc->reads_vnorm)
        st.vnorm = v;
    if (pc->reads_score) {
        st.score = in->score + (size_t)l * L;
        st.score_queries = 1;
    }
    if (pc->reads_last)
        st.last_attn = q;
    return st;
}

/* Lists per layer in the kept masks: KV heads, or one. */
static uint32_t lists(const shape *s, const policy_case *pc)
{
    return pc->per_head ? s->kv_heads : 1;
}

/* One decision: every layer's step, as the daemon runs them
 * (policy_host_step_layers), on `threads` threads. Returns its time: the
 * thread's CPU time on one thread, wall clock on more; keep[] gets the
 * kept mask [layers][lists][tokens], *commit_s the CPU time of committing
 * it to the host's lists (policy_host_commit, every layer), which the
 * daemon does under the store's lock as it applies the decision. */
static double decide(const shape *s, const inputs *in, const policy_case *pc, unsigned threads,
                     uint8_t *keep, double *commit_s)
{
    policy_host *h = make_host(s, pc);
    policy_host_set_threads(h, threads, 0);
    clockid_t clk = threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
    const float **rows = xmalloc(((size_t)s->q_heads + s->kv_heads) * s->layers * sizeof *rows);
    policy_stats *st = xmalloc(s->layers * sizeof *st);
    for (uint32_t l = 0; l < s->layers; l++)
        st[l] = layer_stats(s, in, pc, l, rows + (size_t)l * (s->q_heads + s->kv_heads));
    const policy_decision *d[64];
    char err[POLICY_ERR_LEN] = "";
    double t0 = now(clk);
    if (policy_host_step_layers(h, st, NULL, NULL, d, err, sizeof err) != 0) {
        fprintf(stderr, "bench_policy_decision: %s: %s\n", pc->name, err);
        exit(1);
    }
    double t = now(clk) - t0;
    uint32_t nl = lists(s, pc);
    for (uint32_t l = 0; l < s->layers; l++)
        for (uint32_t g = 0; g < nl; g++)
            for (uint32_t i = 0; i < s->tokens; i++)
                keep[((size_t)l * nl + g) * s->tokens + i] = d[l]->tier[g][i] != POLICY_EVICT;
    t0 = now(CLOCK_THREAD_CPUTIME_ID);
    for (uint32_t l = 0; l < s->layers; l++)
        policy_host_commit(h, l);
    *commit_s = now(CLOCK_THREAD_CPUTIME_ID) - t0;
    policy_host_destroy(h);
    free(rows);
    free(st);
    return t;
}

/* ---- the bandwidth bound: read the decision's inputs once ---- */

typedef struct read_share {
    const uint64_t *a;
    size_t n;
    uint64_t sum;
} read_share;

static void *read_words(void *p)
{
    read_share *r = p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= r->n; i += 4) {
        s0 += r->a[i];
        s1 += r->a[i + 1];
        s2 += r->a[i + 2];
        s3 += r->a[i + 3];
    }
    for (; i < r->n; i++)
        s0 += r->a[i];
    r->sum += s0 + s1 + s2 + s3;
    return NULL;
}

/* Read the arrays of the decision's inputs once, on `threads` threads,
 * each a contiguous share of each array. Returns the CPU time of one
 * thread, the wall time of more. */
static double read_bound(const shape *s, const inputs *in, const policy_case *pc, unsigned threads,
                         uint64_t *sink)
{
    const float *arr[4];
    size_t len[4], na = 0;
    if (pc->reads_window)
        arr[na] = in->window_attn, len[na++] = n_window(s);
    if (pc->reads_vnorm)
        arr[na] = in->vnorm, len[na++] = n_vnorm(s);
    if (pc->reads_score)
        arr[na] = in->score, len[na++] = n_score(s);
    if (pc->reads_last)
        arr[na] = in->last_attn, len[na++] = n_window(s);
    clockid_t clk = threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
    double t0 = now(clk);
    for (size_t a = 0; a < na; a++) {
        size_t words = len[a] / 2; /* two floats a word; every length is even */
        read_share sh[MAX_THREADS];
        pthread_t tid[MAX_THREADS];
        for (unsigned t = 0; t < threads; t++)
            sh[t] = (read_share){(const uint64_t *)(const void *)arr[a] + words * t / threads,
                                 words * (t + 1) / threads - words * t / threads, 0};
        for (unsigned t = 1; t < threads; t++)
            if (pthread_create(&tid[t], NULL, read_words, &sh[t]) != 0)
                exit(1);
        read_words(&sh[0]);
        for (unsigned t = 1; t < threads; t++)
            pthread_join(tid[t], NULL);
        for (unsigned t = 0; t < threads; t++)
            *sink += sh[t].sum;
    }
    return now(clk) - t0;
}

static size_t input_bytes(const shape *s, const policy_case *pc)
{
    return sizeof(float) *
           ((pc->reads_window ? n_window(s) : 0) + (pc->reads_vnorm ? n_vnorm(s) : 0) +
            (pc->reads_score ? n_score(s) : 0) + (pc->reads_last ? n_window(s) : 0));
}

/* ---- the PyTorch side ---- */

/* Run the script; it prints "time POLICY THREADS MS" lines and writes the
 * kept masks of every policy, in cases[] order, to masks_path. */
static int run_torch(const char *python, const char *script, const char *in_path,
                     const char *masks_path, const shape *s, int reps,
                     double torch_ms[NPOLICIES][MAX_THREADS])
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "'%s' '%s' --input '%s' --output '%s' --layers %u --q-heads %u --kv-heads %u "
             "--tokens %u --keep %u --window %u --kernel %u --reps %d --threads 1,2",
             python, script, in_path, masks_path, s->layers, s->q_heads, s->kv_heads, s->tokens,
             s->keep, s->window, s->kernel, reps);
    FILE *p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    char line[512];
    int seen = 0;
    while (fgets(line, sizeof line, p) != NULL) {
        char name[64];
        unsigned t;
        double ms;
        if (sscanf(line, "time %63s %u %lf", name, &t, &ms) != 3) {
            fputs(line, stdout); /* the script's own notes */
            continue;
        }
        for (int c = 0; c < NPOLICIES; c++)
            if (strcmp(name, cases[c].name) == 0 && t >= 1 && t <= MAX_THREADS) {
                torch_ms[c][t - 1] = ms;
                seen++;
            }
    }
    int rc = pclose(p);
    if (rc != 0 || seen != NPOLICIES * MAX_THREADS) {
        fprintf(stderr, "bench_policy_decision: %s failed (status %d, %d of %d timings)\n", script,
                rc, seen, NPOLICIES * MAX_THREADS);
        return -1;
    }
    return 0;
}

/* Compare C's kept mask with PyTorch's; print the first difference. */
static int same_sets(const shape *s, const policy_case *pc, const uint8_t *c, const uint8_t *t)
{
    uint32_t nl = lists(s, pc);
    size_t n = (size_t)s->layers * nl * s->tokens, diff = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if ((c[i] != 0) != (t[i] != 0) && diff++ == 0)
            first = i;
    if (diff == 0)
        return 1;
    size_t per_layer = (size_t)nl * s->tokens;
    printf("%s: kept sets DIFFER in %zu tokens; first: layer %zu list %zu token %zu (C %s, torch "
           "%s)\n",
           pc->name, diff, first / per_layer, first % per_layer / s->tokens, first % s->tokens,
           c[first] ? "keeps" : "evicts", t[first] ? "keeps" : "evicts");
    return 0;
}

static size_t mask_len(const shape *s, const policy_case *pc)
{
    return (size_t)s->layers * lists(s, pc) * s->tokens;
}

/* ---- main ---- */

typedef struct options {
    int quick, reps, no_torch;
    const char *script, *python, *tmp, *only;
} options;

static int parse_args(int argc, char **argv, options *o)
{
    *o = (options){.script = KVSTASH_BENCH_DIR "/policy_decision_torch.py",
                   .python = "/usr/bin/python3"};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            o->quick = 1;
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            o->reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--torch") == 0 && i + 1 < argc)
            o->script = argv[++i];
        else if (strcmp(argv[i], "--python") == 0 && i + 1 < argc)
            o->python = argv[++i];
        else if (strcmp(argv[i], "--tmp") == 0 && i + 1 < argc)
            o->tmp = argv[++i];
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            o->only = argv[++i];
        else if (strcmp(argv[i], "--no-torch") == 0)
            o->no_torch = 1;
        else {
            fprintf(stderr,
                    "usage: %s [--quick] [--reps N] [--torch SCRIPT] [--python PATH] [--tmp DIR] "
                    "[--only POLICY] [--no-torch]\n",
                    argv[0]);
            return -1;
        }
    }
    if (o->reps == 0)
        o->reps = o->quick ? 3 : 7;
    if (o->reps < 1 || o->reps > MAX_REPS) {
        fprintf(stderr, "--reps must be in [1, %d]\n", MAX_REPS);
        return -1;
    }
    if (o->tmp == NULL)
        o->tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    return 0;
}

static void print_header(const shape *s, const options *o)
{
    printf("policy decision: %u layers x %u KV heads (%u query heads) x %u tokens, keep %u; "
           "window %u, avg pool kernel %u; median of %d\n",
           s->layers, s->kv_heads, s->q_heads, s->tokens, s->keep, s->window, s->kernel, o->reps);
    printf("C: policy_host_step_layers (the layers on as many threads as torch); torch: %s; "
           "bound: one read of the inputs\n\n",
           o->script);
    printf("%-11s %7s %9s %10s %9s %9s %10s %9s %-6s %9s\n", "policy", "threads", "C ms",
           "torch ms", "bound ms", "input MB", "speed-up", "x bound", "sets", "commit ms");
}

/* Time one policy (C and the bound) and compare its kept sets with the
 * torch masks (kt, NULL without torch). Returns 1 if they are equal. */
static int bench_policy(const shape *s, const inputs *in, const options *o, int c,
                        const uint8_t *kt, const double torch_ms[MAX_THREADS], uint64_t *sink)
{
    const policy_case *pc = &cases[c];
    uint8_t *kc = xmalloc(mask_len(s, pc));
    double tc[MAX_THREADS][MAX_REPS], tb[MAX_THREADS][MAX_REPS], tm[MAX_THREADS][MAX_REPS];
    decide(s, in, pc, 1, kc, &tm[0][0]); /* warm-up */
    read_bound(s, in, pc, 1, sink);
    int same = 1;
    for (int r = 0; r < o->reps; r++)
        for (unsigned t = 1; t <= MAX_THREADS; t++) {
            tc[t - 1][r] = decide(s, in, pc, t, kc, &tm[t - 1][r]);
            same &= kt == NULL || same_sets(s, pc, kc, kt);
            tb[t - 1][r] = read_bound(s, in, pc, t, sink);
        }
    for (unsigned t = 1; t <= MAX_THREADS; t++) {
        double c_ms = median(tc[t - 1], o->reps) * 1e3;
        double b_ms = median(tb[t - 1], o->reps) * 1e3;
        printf("%-11s %7u %9.2f %10.2f %9.2f %9.1f %9.2fx %8.2fx %-6s %9.2f\n", pc->name, t, c_ms,
               torch_ms[t - 1], b_ms, input_bytes(s, pc) / 1e6, torch_ms[t - 1] / c_ms, c_ms / b_ms,
               kt == NULL ? "-"
               : same     ? "equal"
                          : "DIFFER",
               median(tm[t - 1], o->reps) * 1e3);
    }
    free(kc);
    return same;
}

int main(int argc, char **argv)
{
    options o;
    if (parse_args(argc, argv, &o) != 0)
        return 2;
    /* Warm heaps on both sides (see the top of the file): 32 MiB mmap threshold (glibc's maximum),
     * 1 GiB trim threshold. */
    mallopt(M_MMAP_THRESHOLD, 32 << 20); /* glibc's maximum */
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    setenv("MALLOC_MMAP_THRESHOLD_", "33554432", 1);
    setenv("MALLOC_TRIM_THRESHOLD_", "1073741824", 1);
    shape s = o.quick ? (shape){2, 8, 2, 2048, 512, 64, 5} : (shape){32, 32, 8, 32768, 8192, 64, 5};
    inputs in;
    make_inputs(&s, &in);
    char in_path[1024], masks_path[1024];
    snprintf(in_path, sizeof in_path, "%s/kvstash-policy-decision-%ld.in", o.tmp, (long)getpid());
    snprintf(masks_path, sizeof masks_path, "%s/kvstash-policy-decision-%ld.kept", o.tmp,
             (long)getpid());
    double torch_ms[NPOLICIES][MAX_THREADS] = {{0}};
    FILE *mf = NULL;
    if (!o.no_torch) {
        if (write_inputs(in_path, &s, &in) != 0) {
            fprintf(stderr, "bench_policy_decision: cannot write %s: %s\n", in_path,
                    strerror(errno));
            return 1;
        }
        int rc = run_torch(o.python, o.script, in_path, masks_path, &s, o.reps, torch_ms);
        unlink(in_path);
        if (rc != 0 || (mf = fopen(masks_path, "rb")) == NULL) {
            fprintf(stderr, "bench_policy_decision: no kept sets from %s\n", o.script);
            return 1;
        }
        unlink(masks_path);
    }
    print_header(&s, &o);
    int all_same = 1;
    uint64_t sink = 0;
    for (int c = 0; c < NPOLICIES; c++) {
        size_t ml = mask_len(&s, &cases[c]);
        uint8_t *kt = NULL;
        if (mf != NULL) {
            kt = xmalloc(ml);
            if (fread(kt, 1, ml, mf) != ml) {
                fprintf(stderr, "bench_policy_decision: %s: short mask file\n", cases[c].name);
                return 1;
            }
        }
        if (o.only == NULL || strcmp(o.only, cases[c].name) == 0)
            all_same &= bench_policy(&s, &in, &o, c, kt, torch_ms[c], &sink);
        free(kt);
    }
    if (mf != NULL)
        fclose(mf);
    printf("\nspeed-up = torch ms / C ms; x bound = C ms / bound ms; commit ms: the decision "
           "committed to the host's lists, one thread (checksum %" PRIu64 ")\n",
           sink & 0xff);
    free(in.window_attn);
    free(in.vnorm);
    free(in.score);
    free(in.last_attn);
    if (!all_same) {
        printf("FAIL: C and PyTorch kept different sets\n");
        return 1;
    }
    if (!o.no_torch)
        printf("kept sets equal (C and PyTorch) for every policy\n");
    return 0;
}
