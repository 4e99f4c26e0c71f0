/*
 * kvs_hostile_ring.c - the worker sides of test_hostile_ring.py (issue 12,
 * problem 1): one hostile, two honest.
 *
 *   kvs_hostile_ring scribble BYTES FD...
 *       Map the ring memfds FD... (inherited from the test, which asked
 *       kvstashd for them over the fd socket) and, until killed, rewrite their
 *       headers as a hostile worker would: `closing` back to 0 in a tight
 *       loop, garbage in the request, the response, the magic and the
 *       waiting flags. It leaves req_seq alone: a daemon thread that sleeps
 *       on it checks `closing` only when woken. Several rings and several
 *       scribblers make the race of the unfixed daemon (does its thread look
 *       at `closing` before the scribbler resets it?) nearly always go the
 *       hostile way. Prints "SCRIBBLING" once it has started.
 *   kvs_hostile_ring honest SOCKET
 *       Attach (HELLO, Attach, lease, pool, ring), create a "full" sequence,
 *       append 4 tokens and end a step through the ring, release, detach.
 *       Prints "HONEST ok ms=<total>" and exits 0, or the error and exits 2.
 *   kvs_hostile_ring blocked SOCKET
 *       Attach and create a sequence, print "READY", wait for a line on
 *       stdin, then make one ring call (an append) and print
 *       "RESULT rc=<kvs_err> ms=<how long the call took>". The test stops
 *       kvstashd before that line and kills it while the call waits.
 *   kvs_hostile_ring racer SOCKET POLICY
 *       A sequence of POLICY (h2o, tova or ov_block, which read a step's
 *       summed score where the worker wrote it, policy_ops.stats_in_place)
 *       whose decode steps' statistics, written into the ring
 *       (kvs_step_in_ring), a second thread rewrites while each step is in
 *       flight: finite values, NaNs, infinities, huge and tiny ones. Every
 *       such step must be answered OK or INVALID_ARGUMENT (a value the
 *       daemon took was not finite); between them, every fourth step is
 *       clean and must be answered OK, and some start with a NaN and must
 *       be refused. Then the table must hold no more than the policy keeps. Prints "RACER ok
 * steps=<OK> refused=<INVALID_ARGUMENT>" and exits 0, or the error and exits 2.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvstash.h"
#include "kvstash_ring.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

#define MAX_RINGS 16

static int scribble(size_t bytes, int nfds, char **fds)
{
    ring_header *h[MAX_RINGS];
    for (int r = 0; r < nfds; r++) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, atoi(fds[r]), 0);
        if (p == MAP_FAILED) {
            perror("scribble: mmap");
            return 2;
        }
        h[r] = p;
    }
    printf("SCRIBBLING\n");
    fflush(stdout);
    uint64_t x = 0x9e3779b97f4a7c15ull; /* xorshift: fixed seed */
    for (int r = 0;; r = (r + 1) % nfds) {
        atomic_store((_Atomic uint32_t *)&h[r]->closing, 0);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        /* Everything in the header but the counters: magic and size, the
         * waiting flags, and 8 bytes somewhere in the request or response. */
        h[r]->magic = x;
        h[r]->bytes = x >> 3;
        h[r]->daemon_waiting = (uint32_t)x & 1;
        h[r]->worker_waiting = (uint32_t)(x >> 1) & 1;
        size_t span = sizeof *h[r] - offsetof(ring_header, req) - sizeof x;
        memcpy((uint8_t *)h[r] + offsetof(ring_header, req) + (x >> 16) % span, &x, sizeof x);
    }
}

static int api(kvs_session *s, int rc, const char *what)
{
    if (rc != KVS_OK)
        fprintf(stderr, "%s: %s: %s\n", what, kvs_strerror(rc), s ? kvs_session_error(s) : "");
    return rc;
}

static kvs_session *attach(const char *sock, uint64_t *seq)
{
    kvs_geometry g = {2, 4, 2, 8, 16, KVS_FP32, 0};
    kvs_session *s;
    char err[512];
    int rc = kvs_session_attach(sock, "wire", &g, "hostile-ring", &s, err, sizeof err);
    if (rc != KVS_OK) {
        fprintf(stderr, "attach: %s: %s\n", kvs_strerror(rc), err);
        return NULL;
    }
    if (api(s, kvs_seq_create(s, "full", NULL, 0, "ring", seq), "create") != KVS_OK) {
        kvs_session_detach(s);
        return NULL;
    }
    return s;
}

static int honest(const char *sock)
{
    double t0 = now_ms();
    uint64_t seq;
    kvs_session *s = attach(sock, &seq);
    if (s == NULL)
        return 2;
    kvs_table t;
    int rc = api(s, kvs_seq_append(s, seq, 4, &t), "append");
    if (rc == KVS_OK) {
        kvs_table_free(&t);
        kvs_step step = {.confidence = -1};
        rc = api(s, kvs_seq_step(s, seq, &step, NULL), "step");
    }
    if (rc == KVS_OK)
        rc = api(s, kvs_seq_release(s, seq), "release");
    kvs_session_detach(s);
    if (rc != KVS_OK)
        return 2;
    printf("HONEST ok ms=%.1f\n", now_ms() - t0);
    return 0;
}

static int blocked(const char *sock)
{
    uint64_t seq;
    kvs_session *s = attach(sock, &seq);
    if (s == NULL)
        return 2;
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL)
        return 2;
    kvs_table t;
    double t0 = now_ms();
    int rc = kvs_seq_append(s, seq, 1, &t);
    double ms = now_ms() - t0;
    if (rc == KVS_OK)
        kvs_table_free(&t);
    printf("RESULT rc=%d ms=%.1f\n", rc, ms);
    fflush(stdout);
    kvs_session_detach(s); /* fails, the daemon being gone, but frees the session */
    return 0;
}

/* The racer's second thread: while `racing`, rewrite the step's rows, a
 * pass at a time under `pass` (so that the step's caller, taking it, knows
 * no pass is under way once it has cleared `racing`). */
typedef struct race {
    float *const *rows; /* [layers] */
    uint32_t layers, tokens;
    pthread_mutex_t pass;
    atomic_int racing, stop;
} race;

static void *race_rows(void *arg)
{
    race *r = arg;
    static const float values[] = {0.5f, NAN, 1e30f, -INFINITY, 0.0f, -0.0f, 1e-30f, INFINITY};
    uint32_t k = 0;
    while (!atomic_load(&r->stop)) {
        pthread_mutex_lock(&r->pass);
        for (uint32_t l = 0; atomic_load(&r->racing) && l < r->layers; l++)
            for (uint32_t i = 0; i < r->tokens; i++, k++) {
                volatile float *row = r->rows[l];
                row[i] = values[(k * 7 + i) % (sizeof values / sizeof values[0])];
            }
        pthread_mutex_unlock(&r->pass);
        if (!atomic_load(&r->racing))
            sched_yield();
    }
    return NULL;
}

/* How a racer's round goes: its rows left alone, one of them a NaN from
 * the start, or rewritten while the step is in flight. */
enum { ROUND_CLEAN, ROUND_POISONED, ROUND_RACED };

/* One decode step: its answer, KVS_OK or KVS_ERR_INVALID (the one a clean
 * and a poisoned round must get, and either for a raced one), else -100. */
static int raced_step(kvs_session *s, uint64_t seq, race *r, uint32_t tokens, int how)
{
    uint32_t held[2] = {tokens, tokens};
    kvs_step_rows rows;
    int rc = api(s, kvs_step_in_ring(s, 1, held, KVS_STEP_SCORE, &rows), "step_in_ring");
    if (rc != KVS_OK)
        return -100;
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t i = 0; i < tokens; i++)
            rows.score[l][i] = 0.25f + (float)((i * 37 + l) % 11);
    if (how == ROUND_POISONED)
        rows.score[1][tokens / 2] = NAN;
    kvs_step step = {.heads = 1,
                     .tokens = held,
                     .score = (const float *const *)rows.score,
                     .score_queries = 1,
                     .confidence = -1};
    pthread_mutex_lock(&r->pass);
    r->rows = rows.score, r->layers = 2, r->tokens = tokens;
    atomic_store(&r->racing, how == ROUND_RACED);
    pthread_mutex_unlock(&r->pass);
    rc = kvs_seq_step(s, seq, &step, NULL);
    atomic_store(&r->racing, 0);
    pthread_mutex_lock(&r->pass); /* no pass under way: the next call's ring is left alone */
    pthread_mutex_unlock(&r->pass);
    if (how != ROUND_RACED && rc != (how == ROUND_CLEAN ? KVS_OK : KVS_ERR_INVALID))
        return -100;
    return rc == KVS_OK || rc == KVS_ERR_INVALID ? rc : -100;
}

static int racer(const char *sock, const char *policy)
{
    enum { BUDGET = 48, ROUNDS = 400 };
    kvs_geometry g = {2, 4, 2, 8, 16, KVS_FP32, 0};
    kvs_session *s;
    char err[512];
    if (kvs_session_attach(sock, "wire", &g, "hostile-racer", &s, err, sizeof err) != KVS_OK) {
        fprintf(stderr, "attach: %s\n", err);
        return 2;
    }
    kvs_param h2o[] = {{"budget", "48"}}, tova[] = {{"budget", "48"}};
    kvs_param ov[] = {{"start_size", "16"}, {"recent_size", "16"}, {"max_cache_size", "48"}};
    const kvs_param *params = strcmp(policy, "ov_block") == 0 ? ov
                              : strcmp(policy, "tova") == 0   ? tova
                                                              : h2o;
    size_t nparams = strcmp(policy, "ov_block") == 0 ? 3 : 1;
    uint64_t seq;
    if (api(s, kvs_seq_create(s, policy, params, nparams, "racer", &seq), "create") != KVS_OK)
        return 2;
    race r = {.pass = PTHREAD_MUTEX_INITIALIZER};
    pthread_t tid;
    if (pthread_create(&tid, NULL, race_rows, &r) != 0)
        return 2;
    uint32_t tokens = 0, ok = 0, refused = 0;
    int rc = KVS_OK;
    for (int round = 0; round < ROUNDS && rc == KVS_OK; round++) {
        kvs_table t;
        rc = api(s, kvs_seq_append(s, seq, round == 0 ? 64 : 1, &t), "append");
        if (rc != KVS_OK)
            break;
        kvs_table_free(&t);
        if ((rc = api(s, kvs_seq_table(s, seq, 0, &t), "table")) != KVS_OK)
            break;
        tokens = t.layer[0].tokens;
        kvs_table_free(&t);
        int how = round % 4 == 0 ? ROUND_CLEAN : round % 10 == 1 ? ROUND_POISONED : ROUND_RACED;
        int got = raced_step(s, seq, &r, tokens, how);
        if (got == -100) {
            fprintf(stderr, "round %d (%s): step: %s\n", round,
                    how == ROUND_CLEAN      ? "clean"
                    : how == ROUND_POISONED ? "poisoned"
                                            : "raced",
                    kvs_session_error(s));
            rc = KVS_ERR_PROTOCOL;
        }
        ok += got == KVS_OK;
        refused += got == KVS_ERR_INVALID;
    }
    atomic_store(&r.stop, 1);
    pthread_join(tid, NULL);
    kvs_table t;
    if (rc == KVS_OK && (rc = api(s, kvs_seq_table(s, seq, 0, &t), "table")) == KVS_OK) {
        tokens = t.layer[0].tokens;
        kvs_table_free(&t);
        float *row = calloc(tokens ? tokens : 1, sizeof *row);
        const float *score[2] = {row, row};
        uint32_t held[2] = {tokens, tokens};
        kvs_step step = {
            .heads = 1, .tokens = held, .score = score, .score_queries = 1, .confidence = -1};
        rc = api(s, kvs_seq_step(s, seq, &step, NULL), "clean step");
        free(row);
    }
    /* ov_block evicts whole blocks of 16 once past its cache size. */
    uint32_t most = BUDGET + (strcmp(policy, "ov_block") == 0 ? 15 : 0);
    if (rc == KVS_OK && (rc = api(s, kvs_seq_table(s, seq, 0, &t), "table")) == KVS_OK) {
        for (uint32_t l = 0; l < t.layers; l++)
            if (t.layer[l].tokens > most) {
                fprintf(stderr, "layer %u holds %u tokens, over the %u it may\n", l,
                        t.layer[l].tokens, most);
                rc = KVS_ERR_PROTOCOL;
            }
        kvs_table_free(&t);
    }
    kvs_session_detach(s);
    if (rc != KVS_OK || ok == 0 || refused == 0) {
        fprintf(stderr, "racer %s: rc %d, %u steps answered, %u refused\n", policy, rc, ok,
                refused);
        return 2;
    }
    printf("RACER ok steps=%u refused=%u\n", ok, refused);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 4 && argc - 3 <= MAX_RINGS && strcmp(argv[1], "scribble") == 0)
        return scribble((size_t)strtoull(argv[2], NULL, 10), argc - 3, argv + 3);
    if (argc == 3 && strcmp(argv[1], "honest") == 0)
        return honest(argv[2]);
    if (argc == 3 && strcmp(argv[1], "blocked") == 0)
        return blocked(argv[2]);
    if (argc == 4 && strcmp(argv[1], "racer") == 0)
        return racer(argv[2], argv[3]);
    fprintf(stderr, "usage: kvs_hostile_ring scribble BYTES FD... | honest SOCKET | blocked SOCKET "
                    "| racer SOCKET POLICY\n");
    return 3;
}
