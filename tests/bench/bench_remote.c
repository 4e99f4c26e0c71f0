/*
 * bench_remote.c - the remote tier (issue 17) on a real Redis Cluster, each
 * figure against a baseline measured in the same run (docs/bench.md).
 *
 *   (1) Store bandwidth: for value sizes an export writes (one data value is
 *       one list's blocks of one tier: a 4k-token layer of Llama-3-8B shape
 *       at fp16 is 16 MiB), N values put and then got with our client
 *       (redis_cluster_open, remote_put / remote_get: one pipelined call of
 *       N keys with distinct hash tags, N / masters on each master), against
 *       the plainest client possible: raw RESP SET / GET pipelines written
 *       with hiredis (redisAppendCommandArgv, then redisBufferWrite, then
 *       redisGetReply) straight to each key's master, no routing or retry
 *       logic, the same keys, values and connection count; its GET keeps
 *       the N replies until the end, as ours returns N values. The keys are
 *       deleted between calls, and the two clients take turns going first.
 *       redis-benchmark --cluster (-c masters -P N/masters, the same shape;
 *       one key per master, overwritten) runs too and its MB/s are printed
 *       for reference only: its pipelined SETs of large values ran at a
 *       third to a half of the raw pipeline's rate on the same cluster (its
 *       client, then: the server is the same), so a ratio against it would
 *       flatter ours.
 *   (2) Migration: two kvstashd with --remote on that cluster, a worker
 *       session on each (Llama-3-8B: 32 layers x 8 KV heads x 128, fp16,
 *       16-token blocks), a `full` sequence of 4,096 tokens written on A;
 *       kvs_seq_export on A and kvs_seq_import on B (wall clock, median),
 *       against a memcpy of the same bytes and against putting and getting
 *       the same bytes (one value per layer, under one hash tag as an export
 *       is) with our client directly: the export's and import's own work
 *       (blocks out of and into the pool, encoding, crc32) shows as a ratio.
 *       The import is checked once: every layer read back on B
 *       (kvs_seq_table, kvs_layer_read) equals what was written on A.
 *   (3) Spill and revive: on A, a `streaming` sequence (n_sink=4, window=64,
 *       victims=int8) of that geometry and length, appended and stepped 256
 *       tokens at a time (--quick: window 16, 64 at a time), so that most
 *       tokens of each layer are INT8 victims; kvs_seq_spill (wall clock) against a raw SET
 * pipeline of as many values of the mean spilled value's size, under the spill's own hash tag (its
 * slot: one master, as the spill); and kvs_seq_revive + kvs_revive_release of every layer over
 * every position, before the spill (victims in the pool) and after it (fetched from the cluster):
 *       the difference, the remote part, against a raw GET pipeline of those
 *       values. A fresh sequence per repetition. Checked: the spill freed
 *       blocks, every revive gives every position of every layer, and (once)
 *       the last layer revived after the spill equals it revived before.
 *
 * Ratios are speeds: baseline time over ours (1.0 = as fast; goal for (1):
 * >= 0.7). MB are 10^6 bytes.
 *
 * The cluster (3 masters, no replicas) is started with tests/remote/cluster.py
 * ($KVSTASH_CLUSTER_PY, default the source tree's) with --owner this process,
 * and stopped at exit, on SIGINT / SIGTERM / SIGHUP, and by cluster.py's own
 * watchdog if this process is killed; the daemons die with it (PDEATHSIG).
 *
 * Usage: bench_remote [--quick] [--layers N] [--tokens N] [PATH_TO_KVSTASHD]
 * --quick: small sizes, one repetition (ctest bench/remote_quick): checks that
 * everything runs and round-trips, never a speed. The daemon path defaults to
 * $KVSTASHD, then ../../daemon/kvstashd next to this binary. Exits 1 if a
 * part fails or data does not round-trip; a ratio never fails it.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "bench_daemon.h"
#include "kvstash.h"
#include "redis_cluster.h"
#include "remote_store.h"
#include "remote_value.h"
#include "status.h"

#ifndef KVSTASH_CLUSTER_PY
#define KVSTASH_CLUSTER_PY "tests/remote/cluster.py"
#endif

#define PROG "bench_remote"
#define MAX_MASTERS 8
#define MAX_SIZES 4
#define TIMEOUT_MS 30000 /* our client's and the raw one's per-read/write bound */
#define MB 1e6

typedef struct store_size {
    size_t bytes; /* of one value */
    size_t n;     /* values per call */
} store_size;

typedef struct bench_cfg {
    int quick;
    int reps; /* timed repetitions (median); full runs add an untimed warm-up */
    store_size sizes[MAX_SIZES];
    size_t nsizes;
    kvs_geometry geom;
    uint32_t tokens;
    const char *daemon;
} bench_cfg;

/* ---- the process's resources, for the cleanup paths ---------------------- */

static char g_tmp[] = "/tmp/kvstash-bench-remote.XXXXXX";
static int g_tmp_made;
static char g_cluster_dir[PATH_MAX];
static const char *g_py;
static int g_cluster_started;
static pid_t g_daemons[2] = {-1, -1};
static volatile sig_atomic_t g_in_signal;

/* `python3 cluster.py stop DIR`, with fork and exec only (a signal handler
 * calls it). */
static void cluster_stop_raw(void)
{
    if (!g_cluster_started)
        return;
    pid_t p = fork();
    if (p == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0)
            dup2(fd, STDOUT_FILENO);
        char *const argv[] = {"python3", (char *)g_py, "stop", g_cluster_dir, NULL};
        execvp("python3", argv);
        _exit(127);
    }
    if (p > 0)
        while (waitpid(p, NULL, 0) < 0 && errno == EINTR)
            ;
    g_cluster_started = 0;
}

static void daemons_kill_raw(int sig)
{
    for (int i = 0; i < 2; i++)
        if (g_daemons[i] > 0)
            kill(g_daemons[i], sig);
}

static void on_signal(int sig)
{
    if (g_in_signal)
        _exit(128 + sig);
    g_in_signal = 1;
    daemons_kill_raw(SIGKILL);
    cluster_stop_raw();
    if (g_tmp_made) { /* rm -rf the temporary directory (nftw is not async-signal-safe) */
        pid_t p = fork();
        if (p == 0) {
            char *const argv[] = {"rm", "-rf", g_tmp, NULL};
            execvp("rm", argv);
            _exit(127);
        }
        if (p > 0)
            while (waitpid(p, NULL, 0) < 0 && errno == EINTR)
                ;
    }
    _exit(128 + sig);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

/* SIGTERM the daemon i and wait up to 10 s; its exit status (-1: killed). */
static int daemon_stop(int i)
{
    pid_t pid = g_daemons[i];
    if (pid <= 0)
        return 0;
    kill(pid, SIGTERM);
    int status = 0;
    for (int t = 0; t < 1000; t++) {
        if (waitpid(pid, &status, WNOHANG) == pid) {
            g_daemons[i] = -1;
            return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        }
        usleep(10000);
    }
    fprintf(stderr, PROG ": kvstashd %d ignored SIGTERM for 10 s; killing it\n", (int)pid);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    g_daemons[i] = -1;
    return -1;
}

static void cleanup(void)
{
    daemon_stop(0);
    daemon_stop(1);
    cluster_stop_raw();
    if (g_tmp_made) {
        nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        g_tmp_made = 0;
    }
}

/* ---- the cluster ---------------------------------------------------------- */

/* Run `python3 cluster.py ARGS`, its stdout and stderr into out. 0 if it exited 0. */
static int cluster_py(char *out, size_t len, const char *args)
{
    char cmd[3 * PATH_MAX];
    snprintf(cmd, sizeof cmd, "python3 '%s' %s 2>&1", g_py, args);
    out[0] = '\0';
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        snprintf(out, len, "popen: %s", strerror(errno));
        return -1;
    }
    size_t n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0 ? 0 : -1;
}

/* "PORTS a,b,c" in text into ports; returns the count. */
static int parse_ports(const char *text, int *ports, int max)
{
    const char *p = strstr(text, "PORTS ");
    if (p == NULL)
        return 0;
    p += 6;
    int n = 0;
    while (n < max && *p >= '0' && *p <= '9') {
        char *end;
        ports[n++] = (int)strtol(p, &end, 10);
        p = end;
        if (*p == ',')
            p++;
    }
    return n;
}

/* The cluster's map, asked of one node with hiredis: owner[slot] = port. */
static int slots_owners(int port, int *owner, int *masters, int *nmasters)
{
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c == NULL || c->err) {
        fprintf(stderr, PROG ": connect 127.0.0.1:%d: %s\n", port, c ? c->errstr : "no memory");
        redisFree(c);
        return -1;
    }
    redisReply *r = redisCommand(c, "CLUSTER SLOTS");
    int rc = -1;
    *nmasters = 0;
    for (int s = 0; s < REDIS_CLUSTER_SLOTS; s++)
        owner[s] = -1;
    if (r != NULL && r->type == REDIS_REPLY_ARRAY) {
        rc = 0;
        for (size_t i = 0; i < r->elements; i++) {
            redisReply *e = r->element[i];
            if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
                e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2) {
                rc = -1;
                break;
            }
            int p = (int)e->element[2]->element[1]->integer;
            for (long long s = e->element[0]->integer; s <= e->element[1]->integer; s++)
                if (s >= 0 && s < REDIS_CLUSTER_SLOTS)
                    owner[s] = p;
            int known = 0;
            for (int m = 0; m < *nmasters; m++)
                known |= masters[m] == p;
            if (!known && *nmasters < MAX_MASTERS)
                masters[(*nmasters)++] = p;
        }
    }
    for (int s = 0; rc == 0 && s < REDIS_CLUSTER_SLOTS; s++)
        if (owner[s] < 0)
            rc = -1;
    if (rc != 0)
        fprintf(stderr, PROG ": CLUSTER SLOTS on port %d: no full map\n", port);
    freeReplyObject(r);
    redisFree(c);
    return rc;
}

/* ---- the daemons ---------------------------------------------------------- */

/* Start kvstashd i on <tmp>/kvstashd-<i>.sock with the remote tier. */
static int daemon_start(int i, const char *path, int pool_mb, const char *seeds, const char *ns,
                        char *sock, size_t socklen)
{
    char log[PATH_MAX], pool[16];
    snprintf(sock, socklen, "%s/kvstashd-%c.sock", g_tmp, 'a' + i);
    snprintf(log, sizeof log, "%s/kvstashd-%c.log", g_tmp, 'a' + i);
    snprintf(pool, sizeof pool, "%d", pool_mb);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, STDERR_FILENO);
            close(fd);
        }
        const char *argv[] = {
            path,    "--socket", sock,  "--pool-mb",          pool, "--log-level",
            "warn",  "--remote", seeds, "--remote-namespace", ns,   "--remote-timeout-ms",
            "30000", NULL};
        execv(path, (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", path, strerror(errno));
        _exit(127);
    }
    g_daemons[i] = pid;
    for (int t = 0; t < 1000; t++) {
        struct stat st;
        if (stat(sock, &st) == 0 && S_ISSOCK(st.st_mode))
            return 0;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            g_daemons[i] = -1;
            fprintf(stderr, PROG ": %s exited (status %d) before creating %s (log: %s)\n", path,
                    WIFEXITED(status) ? WEXITSTATUS(status) : -1, sock, log);
            return -1;
        }
        usleep(10000);
    }
    fprintf(stderr, PROG ": %s did not create %s within 10 s\n", path, sock);
    return -1;
}

/* ---- data ----------------------------------------------------------------- */

/* Deterministic bytes for (seed): finite fp16 values (|x| < 1). */
static void fill(uint8_t *p, size_t len, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint64_t w = x & 0x3bff3bff3bff3bffull;
        memcpy(p + i, &w, 8);
    }
    for (; i < len; i++)
        p[i] = (uint8_t)(seed + i);
}

static double mbps(size_t bytes, double us)
{
    return us > 0 ? (double)bytes / MB / (us / 1e6) : 0;
}

static void report_status(const char *what, const status *st)
{
    fprintf(stderr, PROG ": %s: %s: %s\n", what, status_name(st->code), st->msg);
}

static void report_kvs(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, PROG ": %s: %s: %s\n", what, kvs_strerror(rc), s ? kvs_session_error(s) : "");
}

/* ---- (1) store bandwidth -------------------------------------------------- */

typedef struct raw_client {
    int nmasters;
    int ports[MAX_MASTERS];
    redisContext *c[MAX_MASTERS];
} raw_client;

static int raw_open(raw_client *rc, const int *masters, int nmasters)
{
    memset(rc, 0, sizeof *rc);
    rc->nmasters = nmasters;
    struct timeval tv = {TIMEOUT_MS / 1000, 0};
    for (int m = 0; m < nmasters; m++) {
        rc->ports[m] = masters[m];
        rc->c[m] = redisConnectWithTimeout("127.0.0.1", masters[m], tv);
        if (rc->c[m] == NULL || rc->c[m]->err || redisSetTimeout(rc->c[m], tv) != REDIS_OK) {
            fprintf(stderr, PROG ": raw connect 127.0.0.1:%d: %s\n", masters[m],
                    rc->c[m] ? rc->c[m]->errstr : "no memory");
            return -1;
        }
    }
    return 0;
}

static void raw_close(raw_client *rc)
{
    for (int m = 0; m < rc->nmasters; m++)
        if (rc->c[m] != NULL)
            redisFree(rc->c[m]);
    memset(rc, 0, sizeof *rc);
}

/* The baseline: SET (vals) or GET of every key, one pipeline per master
 * (node_of[i] is key i's master): append them all, write them all, then
 * read every reply. For GET, replies must be strings of `size` bytes, and
 * they are kept in got[i] (the caller frees them after timing: like ours,
 * the call ends with the N values in memory). */
static int raw_run(raw_client *rc, char **keys, const int *node_of, size_t n, const uint8_t *vals,
                   size_t size, redisReply **got)
{
    int bad = 0;
    for (int m = 0; m < rc->nmasters; m++) {
        redisContext *c = rc->c[m];
        for (size_t i = 0; i < n; i++) {
            if (node_of[i] != m)
                continue;
            const char *argv[3] = {vals ? "SET" : "GET", keys[i],
                                   vals ? (const char *)vals + i * size : NULL};
            size_t lens[3] = {3, strlen(keys[i]), size};
            if (redisAppendCommandArgv(c, vals ? 3 : 2, argv, lens) != REDIS_OK)
                return -1;
        }
        int done = 0;
        while (!done)
            if (redisBufferWrite(c, &done) != REDIS_OK) {
                fprintf(stderr, PROG ": raw write to %d: %s\n", rc->ports[m], c->errstr);
                return -1;
            }
    }
    for (int m = 0; m < rc->nmasters; m++)
        for (size_t i = 0; i < n; i++) {
            if (node_of[i] != m)
                continue;
            redisReply *r = NULL;
            if (redisGetReply(rc->c[m], (void **)&r) != REDIS_OK || r == NULL) {
                fprintf(stderr, PROG ": raw read from %d: %s\n", rc->ports[m], rc->c[m]->errstr);
                return -1;
            }
            if (vals ? r->type != REDIS_REPLY_STATUS
                     : r->type != REDIS_REPLY_STRING || r->len != size)
                bad++;
            if (vals == NULL)
                got[i] = r;
            else
                freeReplyObject(r);
        }
    if (bad)
        fprintf(stderr, PROG ": raw %s: %d unexpected replies\n", vals ? "SET" : "GET", bad);
    return bad ? -1 : 0;
}

/* redis-benchmark --cluster's SET and GET rates (requests per second) for
 * values of `size` bytes, as our client's shape: one connection and one
 * pipeline of n / masters per master. 0 when it did not run. */
static int rb_run(int port, size_t size, size_t n, int nmasters, double *set_rps, double *get_rps)
{
    *set_rps = *get_rps = 0;
    char cmd[512];
    size_t pipe = (n + (size_t)nmasters - 1) / (size_t)nmasters;
    snprintf(cmd, sizeof cmd,
             "redis-benchmark --cluster -h 127.0.0.1 -p %d -t set,get -d %zu -n %zu -c %d -P %zu "
             "--csv 2>&1",
             port, size, n, nmasters, pipe);
    FILE *p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    char line[512];
    while (fgets(line, sizeof line, p) != NULL) {
        double v;
        if (sscanf(line, "\"SET\",\"%lf\"", &v) == 1)
            *set_rps = v;
        else if (sscanf(line, "\"GET\",\"%lf\"", &v) == 1)
            *get_rps = v;
    }
    int rc = pclose(p);
    return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0 && *set_rps > 0 && *get_rps > 0 ? 0
                                                                                             : -1;
}

typedef struct store_row {
    store_size sz;
    double put_us, get_us, set_us, rget_us; /* medians: ours put/get, raw SET/GET */
    double rb_set, rb_get;                  /* redis-benchmark MB/s (0: did not run) */
    int ok;
} store_row;

/* Keys bench:{<i>.<t>} with t chosen so that key i lands on master i % nmasters. */
static char **spread_keys(size_t n, const int *owner, const int *masters, int nmasters,
                          int *node_of)
{
    char **keys = calloc(n, sizeof *keys);
    if (keys == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        int want = (int)(i % (size_t)nmasters);
        char k[64];
        for (unsigned t = 0;; t++) {
            snprintf(k, sizeof k, "bench:{%zu.%u}:v", i, t);
            if (owner[redis_cluster_key_slot(k, strlen(k))] == masters[want])
                break;
        }
        keys[i] = strdup(k);
        node_of[i] = want;
        if (keys[i] == NULL)
            return NULL; /* the process exits on it */
    }
    return keys;
}

/* The N values of one size and what both clients need of them. */
typedef struct store_data {
    size_t n, size;
    char **keys;
    int *node_of; /* key i's master, an index into masters */
    uint8_t *vals;
    remote_kv *kv;
    remote_buf *out;
    redisReply **got;
} store_data;

/* Ours: one remote_put of the N values, one remote_get of them (timed into
 * us[0], us[1]), checked, then deleted. */
static int ours_once(remote_store *rs, store_data *d, double us[2])
{
    status st;
    double t0 = bench_now_us();
    if (remote_put(rs, d->kv, d->n, 0, &st) != ST_OK) {
        report_status("remote_put", &st);
        return -1;
    }
    double t1 = bench_now_us();
    if (remote_get(rs, (const char *const *)d->keys, d->n, d->out, &st) != ST_OK) {
        report_status("remote_get", &st);
        return -1;
    }
    double t2 = bench_now_us();
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < d->n; i++)
        if (!d->out[i].found || d->out[i].len != d->size ||
            memcmp(d->out[i].data, d->vals + i * d->size, d->size) != 0) {
            fprintf(stderr, PROG ": value %s (%zu bytes) did not round-trip\n", d->keys[i],
                    d->size);
            rc = -1;
        }
    remote_bufs_free(d->out, d->n);
    if (rc == 0 && remote_del(rs, (const char *const *)d->keys, d->n, &st) != ST_OK) {
        report_status("remote_del", &st);
        rc = -1;
    }
    us[0] = t1 - t0, us[1] = t2 - t1;
    return rc;
}

/* The baseline: the same with raw pipelines (deleted with our client). */
static int raw_once(raw_client *raw, remote_store *rs, store_data *d, double us[2])
{
    double t0 = bench_now_us();
    if (raw_run(raw, d->keys, d->node_of, d->n, d->vals, d->size, NULL) != 0)
        return -1;
    double t1 = bench_now_us();
    int rc = raw_run(raw, d->keys, d->node_of, d->n, NULL, d->size, d->got);
    double t2 = bench_now_us();
    for (size_t i = 0; i < d->n; i++) {
        if (rc == 0 && memcmp(d->got[i]->str, d->vals + i * d->size, d->size) != 0) {
            fprintf(stderr, PROG ": raw GET of %s: not the value set\n", d->keys[i]);
            rc = -1;
        }
        if (d->got[i] != NULL)
            freeReplyObject(d->got[i]);
        d->got[i] = NULL;
    }
    status st;
    if (rc == 0 && remote_del(rs, (const char *const *)d->keys, d->n, &st) != ST_OK) {
        report_status("remote_del", &st);
        rc = -1;
    }
    us[0] = t1 - t0, us[1] = t2 - t1;
    return rc;
}

static int store_size_run(const bench_cfg *cfg, remote_store *rs, raw_client *raw, const int *owner,
                          const int *masters, int nmasters, store_row *row)
{
    store_data d = {.n = row->sz.n, .size = row->sz.bytes};
    size_t n = d.n, size = d.size;
    d.node_of = calloc(n, sizeof *d.node_of);
    d.keys = d.node_of ? spread_keys(n, owner, masters, nmasters, d.node_of) : NULL;
    d.vals = malloc(n * size);
    d.kv = calloc(n, sizeof *d.kv);
    d.out = calloc(n, sizeof *d.out);
    d.got = calloc(n, sizeof *d.got);
    double put[8], get[8], set[8], rget[8];
    int rc = 0;
    if (d.keys == NULL || d.vals == NULL || d.kv == NULL || d.out == NULL || d.got == NULL) {
        fprintf(stderr, PROG ": out of memory for %zu values of %zu bytes\n", n, size);
        rc = -1;
    }
    for (size_t i = 0; rc == 0 && i < n; i++) {
        fill(d.vals + i * size, size, (uint64_t)size * 131 + i);
        d.kv[i] = (remote_kv){d.keys[i], d.vals + i * size, size};
    }
    /* -1: the warm-up; the two clients take turns going first. */
    for (int r = cfg->quick ? 0 : -1; rc == 0 && r < cfg->reps; r++) {
        double ours[2] = {0, 0}, base[2] = {0, 0};
        for (int turn = 0; rc == 0 && turn < 2; turn++)
            rc = (turn == (r & 1)) ? ours_once(rs, &d, ours) : raw_once(raw, rs, &d, base);
        if (rc == 0 && r >= 0) {
            put[r] = ours[0], get[r] = ours[1];
            set[r] = base[0], rget[r] = base[1];
        }
    }
    if (rc == 0) {
        row->put_us = bench_median(put, (size_t)cfg->reps);
        row->get_us = bench_median(get, (size_t)cfg->reps);
        row->set_us = bench_median(set, (size_t)cfg->reps);
        row->rget_us = bench_median(rget, (size_t)cfg->reps);
        row->ok = 1;
    }
    free(d.vals), free(d.kv), free(d.out), free(d.got), free(d.node_of);
    for (size_t i = 0; d.keys != NULL && i < n; i++)
        free(d.keys[i]);
    free(d.keys);
    if (rc == 0 && system("command -v redis-benchmark >/dev/null 2>&1") == 0) {
        double s[8], g[8];
        int runs = 0;
        for (int r = 0; r < cfg->reps; r++) {
            if (rb_run(masters[0], size, n, nmasters, &s[runs], &g[runs]) != 0) {
                fprintf(stderr, PROG ": redis-benchmark -d %zu -n %zu failed\n", size, n);
                break;
            }
            runs++;
        }
        if (runs == cfg->reps) {
            row->rb_set = bench_median(s, (size_t)runs) * (double)size / MB;
            row->rb_get = bench_median(g, (size_t)runs) * (double)size / MB;
        }
    }
    return rc;
}

static void size_name(size_t bytes, char *buf, size_t len)
{
    if (bytes >= (1u << 20) && bytes % (1u << 20) == 0)
        snprintf(buf, len, "%zu MiB", bytes >> 20);
    else if (bytes >= 1024 && bytes % 1024 == 0)
        snprintf(buf, len, "%zu KiB", bytes >> 10);
    else
        snprintf(buf, len, "%zu B", bytes);
}

static void rb_cell(double rb, double ours_mbps, char *buf, size_t len)
{
    if (rb > 0)
        snprintf(buf, len, "%7.0f %5.2f", rb, ours_mbps / rb);
    else
        snprintf(buf, len, "%13s", "-");
}

static void store_print(const store_row *rows, size_t n, int nmasters, int quick)
{
    printf("\n(1) store bandwidth, %d masters, one pipelined call of N values (MB/s = 10^6 B/s; "
           "ratio = ours / baseline)\n",
           nmasters);
    printf("%-8s %5s | %8s %8s %6s | %8s %8s %6s | %-13s %-13s\n", "size", "N", "put", "raw SET",
           "ratio", "get", "raw GET", "ratio", "r-bench SET", "r-bench GET");
    double worst = 1e9;
    for (size_t i = 0; i < n; i++) {
        const store_row *r = &rows[i];
        char name[32];
        size_name(r->sz.bytes, name, sizeof name);
        if (!r->ok) {
            printf("%-8s %5zu | (did not run)\n", name, r->sz.n);
            continue;
        }
        size_t total = r->sz.bytes * r->sz.n;
        double put = mbps(total, r->put_us), set = mbps(total, r->set_us);
        double get = mbps(total, r->get_us), rget = mbps(total, r->rget_us);
        char rbs[32], rbg[32];
        rb_cell(r->rb_set, put, rbs, sizeof rbs);
        rb_cell(r->rb_get, get, rbg, sizeof rbg);
        printf("%-8s %5zu | %8.0f %8.0f %6.2f | %8.0f %8.0f %6.2f | %s %s\n", name, r->sz.n, put,
               set, put / set, get, rget, get / rget, rbs, rbg);
        worst = put / set < worst ? put / set : worst;
        worst = get / rget < worst ? get / rget : worst;
    }
    printf("ratios against raw hiredis pipelines (goal >= 0.7): lowest %.2f%s\n", worst,
           quick ? " (--quick: one cold repetition of a few MB, not a measurement)" : "");
    printf("(r-bench: redis-benchmark --cluster -c masters -P N/masters, MB/s and ours over it; "
           "reference only)\n");
}

/* ---- (2) migration -------------------------------------------------------- */

typedef struct mig_result {
    double memcpy_us, put_us, get_us, export_us, import_us;
    size_t bytes, values, value_bytes;
    int ok;
} mig_result;

static size_t layer_kv_bytes(const kvs_geometry *g, uint32_t tokens)
{
    return (size_t)g->kv_heads * tokens * g->head_dim * 2; /* K (or V) of one layer, fp16 */
}

/* Delete export uid's keys (a `full` sequence: one data value per layer). */
static int export_delete(remote_store *rs, const char *ns, const char *uid, uint32_t layers,
                         int check)
{
    char **keys = calloc(layers + 1, sizeof *keys);
    status st;
    int rc = keys ? 0 : -1;
    for (uint32_t l = 0; rc == 0 && l <= layers; l++) {
        char part[32];
        if (l < layers)
            snprintf(part, sizeof part, "l%u.h0.full", l);
        else
            snprintf(part, sizeof part, "manifest");
        keys[l] = malloc(REMOTE_KEY_CAP);
        if (keys[l] == NULL ||
            remote_key(keys[l], REMOTE_KEY_CAP, ns, "default", uid, part, &st) != ST_OK)
            rc = -1;
    }
    if (rc == 0 && check) { /* the keys are the export's: they exist */
        remote_buf b[2] = {{0}};
        const char *k2[2] = {keys[0], keys[layers]};
        if (remote_get(rs, k2, 2, b, &st) != ST_OK || !b[0].found || !b[1].found) {
            fprintf(stderr, PROG ": export %s's keys are not where expected (%s)\n", uid,
                    keys[layers]);
            rc = -1;
        }
        remote_bufs_free(b, 2);
    }
    if (rc == 0 && remote_del(rs, (const char *const *)keys, layers + 1, &st) != ST_OK) {
        report_status("remote_del (export)", &st);
        rc = -1;
    }
    for (uint32_t l = 0; keys != NULL && l <= layers; l++)
        free(keys[l]);
    free(keys);
    return rc;
}

/* Every layer of seq on s equals what layer_fill wrote. */
static int verify_layers(kvs_session *s, uint64_t seq, const kvs_geometry *g, uint32_t tokens,
                         uint8_t *k, uint8_t *v, uint8_t *ek, uint8_t *ev)
{
    kvs_table t = {0};
    int rc = kvs_seq_table(s, seq, 0, &t);
    if (rc != KVS_OK) {
        report_kvs(s, "kvs_seq_table (B)", rc);
        return -1;
    }
    size_t lb = layer_kv_bytes(g, tokens);
    int bad = t.layers != g->layers || t.heads != 1;
    for (uint32_t l = 0; !bad && l < g->layers; l++) {
        if (t.layer[l].tokens != tokens) {
            fprintf(stderr, PROG ": imported layer %u holds %u tokens, not %u\n", l,
                    t.layer[l].tokens, tokens);
            bad = 1;
            break;
        }
        if ((rc = kvs_layer_read(s, &t.layer[l], k, v)) != KVS_OK) {
            report_kvs(s, "kvs_layer_read (B)", rc);
            bad = 1;
            break;
        }
        fill(ek, lb, 2ull * l), fill(ev, lb, 2ull * l + 1);
        if (memcmp(k, ek, lb) != 0 || memcmp(v, ev, lb) != 0) {
            fprintf(stderr, PROG ": layer %u read on B differs from what A wrote\n", l);
            bad = 1;
        }
    }
    kvs_table_free(&t);
    return bad ? -1 : 0;
}

static int migration_run(const bench_cfg *cfg, remote_store *rs, const char *ns, const char *sock_a,
                         const char *sock_b, mig_result *res)
{
    const kvs_geometry *g = &cfg->geom;
    size_t lb = layer_kv_bytes(g, cfg->tokens);
    kvs_session *sa = NULL, *sb = NULL;
    uint8_t *k = malloc(lb), *v = malloc(lb), *ek = malloc(lb), *ev = malloc(lb);
    uint8_t *src = NULL, *dst = NULL;
    remote_kv *kv = NULL;
    remote_buf *out = NULL;
    char **keys = NULL;
    char err[512];
    int rc = k && v && ek && ev ? 0 : -1, krc;
    uint64_t seq_a = 0;
    memset(res, 0, sizeof *res);
    if (rc == 0 && (krc = kvs_session_attach_tenant(sock_a, "", "llama-3-8b-bench", g, PROG "-a",
                                                    &sa, err, sizeof err)) != KVS_OK) {
        fprintf(stderr, PROG ": attach A: %s: %s\n", kvs_strerror(krc), err);
        rc = -1;
    }
    if (rc == 0 && (krc = kvs_session_attach_tenant(sock_b, "", "llama-3-8b-bench", g, PROG "-b",
                                                    &sb, err, sizeof err)) != KVS_OK) {
        fprintf(stderr, PROG ": attach B: %s: %s\n", kvs_strerror(krc), err);
        rc = -1;
    }
    if (rc == 0 && (krc = kvs_seq_create(sa, "full", NULL, 0, PROG, &seq_a)) != KVS_OK) {
        report_kvs(sa, "kvs_seq_create (A)", krc);
        rc = -1;
    }
    kvs_table w = {0};
    if (rc == 0 && (krc = kvs_seq_append(sa, seq_a, cfg->tokens, &w)) != KVS_OK) {
        report_kvs(sa, "kvs_seq_append (A)", krc);
        rc = -1;
    }
    for (uint32_t l = 0; rc == 0 && l < g->layers; l++) {
        fill(k, lb, 2ull * l), fill(v, lb, 2ull * l + 1);
        if (w.layers != g->layers || w.layer[l].tokens != cfg->tokens) {
            fprintf(stderr, PROG ": the append gave %u layers, layer %u %u tokens\n", w.layers, l,
                    w.layers == g->layers ? w.layer[l].tokens : 0);
            rc = -1;
        } else if ((krc = kvs_layer_write(sa, &w.layer[l], k, v)) != KVS_OK) {
            report_kvs(sa, "kvs_layer_write (A)", krc);
            rc = -1;
        }
    }
    kvs_table_free(&w);

    /* The baselines' data: one value per layer of a list's bytes, under one hash tag. */
    size_t vb = 2 * lb, n = g->layers;
    res->bytes = vb * n, res->values = n, res->value_bytes = vb;
    if (rc == 0) {
        src = malloc(res->bytes), dst = malloc(res->bytes);
        kv = calloc(n, sizeof *kv), out = calloc(n, sizeof *out), keys = calloc(n, sizeof *keys);
        if (src == NULL || dst == NULL || kv == NULL || out == NULL || keys == NULL) {
            fprintf(stderr, PROG ": out of memory for 2 x %zu bytes\n", res->bytes);
            rc = -1;
        }
    }
    for (size_t i = 0; rc == 0 && i < n; i++) {
        char key[REMOTE_KEY_CAP];
        snprintf(key, sizeof key, "kvs:%s:{default:direct}:l%zu", ns, i);
        if ((keys[i] = strdup(key)) == NULL)
            rc = -1;
        else
            kv[i] = (remote_kv){keys[i], src + i * vb, vb};
    }
    if (rc == 0) {
        fill(src, res->bytes, 77);
        memset(dst, 1, res->bytes); /* fault it in */
    }
    double mc[8], put[8], get[8], ex[8], im[8];
    int first = cfg->quick ? 0 : -1; /* -1: the warm-up */
    for (int r = first; rc == 0 && r < cfg->reps; r++) {
        status st;
        double t0 = bench_now_us();
        memcpy(dst, src, res->bytes);
        double t1 = bench_now_us();
        if (memcmp(dst, src, 4096) != 0)
            rc = -1;
        double t2 = bench_now_us();
        if (rc == 0 && remote_put(rs, kv, n, 0, &st) != ST_OK) {
            report_status("remote_put (direct)", &st);
            rc = -1;
        }
        double t3 = bench_now_us();
        if (rc == 0 && remote_get(rs, (const char *const *)keys, n, out, &st) != ST_OK) {
            report_status("remote_get (direct)", &st);
            rc = -1;
        }
        double t4 = bench_now_us();
        for (size_t i = 0; rc == 0 && i < n; i++)
            if (!out[i].found || out[i].len != vb || memcmp(out[i].data, src + i * vb, vb) != 0) {
                fprintf(stderr, PROG ": direct value %s did not round-trip\n", keys[i]);
                rc = -1;
            }
        remote_bufs_free(out, n);
        if (rc == 0 && remote_del(rs, (const char *const *)keys, n, &st) != ST_OK) {
            report_status("remote_del (direct)", &st);
            rc = -1;
        }
        char uid[KVS_EXPORT_UID_LEN + 1] = "";
        uint64_t seq_b = 0, appended = 0;
        double t5 = bench_now_us();
        if (rc == 0 && (krc = kvs_seq_export(sa, seq_a, uid)) != KVS_OK) {
            report_kvs(sa, "kvs_seq_export (A)", krc);
            rc = -1;
        }
        double t6 = bench_now_us();
        if (rc == 0 && (krc = kvs_seq_import(sb, uid, &seq_b, &appended)) != KVS_OK) {
            report_kvs(sb, "kvs_seq_import (B)", krc);
            rc = -1;
        }
        double t7 = bench_now_us();
        if (rc == 0 && appended != cfg->tokens) {
            fprintf(stderr, PROG ": the import says %" PRIu64 " tokens appended, not %u\n",
                    appended, cfg->tokens);
            rc = -1;
        }
        if (rc == 0 && r == first)
            rc = verify_layers(sb, seq_b, g, cfg->tokens, k, v, ek, ev);
        if (seq_b != 0 && (krc = kvs_seq_release(sb, seq_b)) != KVS_OK) {
            report_kvs(sb, "kvs_seq_release (B)", krc);
            rc = -1;
        }
        if (uid[0] != '\0' && export_delete(rs, ns, uid, g->layers, r == first) != 0)
            rc = -1;
        if (rc == 0 && r >= 0) {
            mc[r] = t1 - t0, put[r] = t3 - t2, get[r] = t4 - t3;
            ex[r] = t6 - t5, im[r] = t7 - t6;
        }
    }
    if (rc == 0) {
        size_t reps = (size_t)cfg->reps;
        res->memcpy_us = bench_median(mc, reps), res->put_us = bench_median(put, reps);
        res->get_us = bench_median(get, reps), res->export_us = bench_median(ex, reps);
        res->import_us = bench_median(im, reps);
        res->ok = 1;
    }
    if (sa != NULL && seq_a != 0 && (krc = kvs_seq_release(sa, seq_a)) != KVS_OK) {
        report_kvs(sa, "kvs_seq_release (A)", krc);
        rc = -1;
    }
    if (sa != NULL && kvs_session_detach(sa) != KVS_OK)
        rc = -1;
    if (sb != NULL && kvs_session_detach(sb) != KVS_OK)
        rc = -1;
    for (size_t i = 0; keys != NULL && i < n; i++)
        free(keys[i]);
    free(keys), free(kv), free(out), free(src), free(dst);
    free(k), free(v), free(ek), free(ev);
    return rc;
}

/* ---- (3) spill and revive ------------------------------------------------- */

#define SPILL_SINKS 4

typedef struct spill_result {
    uint32_t window, chunk;
    kvs_spill reply;                  /* the last timed repetition's */
    size_t value_bytes;               /* reply.bytes / reply.values: the baselines' value size */
    uint64_t int8_before, int8_after; /* revived tokens that were INT8 victims (all layers) */
    /* medians: the spill, revive of every layer before and after it, their
     * difference (the remote part), raw SET and GET of the baseline values */
    double spill_us, before_us, after_us, remote_us, set_us, get_us;
    int ok;
} spill_result;

/* A `streaming` sequence with victims=int8 on s, cfg->tokens tokens
 * appended, written and stepped `chunk` at a time (each step evicts all but
 * the sinks and the window: the evicted become INT8 victims). */
static int spill_seq_build(kvs_session *s, const bench_cfg *cfg, uint32_t window, uint32_t chunk,
                           uint8_t *k, uint8_t *v, uint64_t *seq)
{
    const kvs_geometry *g = &cfg->geom;
    char sinks[16], win[16];
    snprintf(sinks, sizeof sinks, "%u", SPILL_SINKS);
    snprintf(win, sizeof win, "%u", window);
    const kvs_param params[] = {{"n_sink", sinks}, {"window", win}, {"victims", "int8"}};
    int krc = kvs_seq_create(s, "streaming", params, 3, PROG "-spill", seq);
    if (krc != KVS_OK) {
        report_kvs(s, "kvs_seq_create (streaming)", krc);
        return -1;
    }
    const kvs_step step = {.confidence = -1}; /* streaming needs no statistics */
    int rc = 0;
    for (uint32_t at = 0; rc == 0 && at < cfg->tokens; at += chunk) {
        uint32_t n = cfg->tokens - at < chunk ? cfg->tokens - at : chunk;
        size_t lb = layer_kv_bytes(g, n);
        kvs_table w = {0};
        if ((krc = kvs_seq_append(s, *seq, n, &w)) != KVS_OK) {
            report_kvs(s, "kvs_seq_append (streaming)", krc);
            return -1;
        }
        for (uint32_t l = 0; rc == 0 && l < g->layers; l++) {
            uint64_t seed = ((uint64_t)at << 20) + 2ull * l;
            fill(k, lb, seed), fill(v, lb, seed + 1);
            if (w.layers != g->layers || w.layer[l].tokens != n) {
                fprintf(stderr, PROG ": the append gave %u layers, layer %u %u tokens, not %u\n",
                        w.layers, l, w.layers == g->layers ? w.layer[l].tokens : 0, n);
                rc = -1;
            } else if ((krc = kvs_layer_write(s, &w.layer[l], k, v)) != KVS_OK) {
                report_kvs(s, "kvs_layer_write (streaming)", krc);
                rc = -1;
            }
        }
        kvs_table_free(&w);
        if (rc == 0 && (krc = kvs_seq_step(s, *seq, &step, NULL)) != KVS_OK) {
            report_kvs(s, "kvs_seq_step (streaming)", krc);
            rc = -1;
        }
    }
    return rc;
}

/* Revive every layer of seq over all its positions, releasing each scratch
 * at once, timed into *us; tokens[l]: what layer l gave, *int8: how many
 * of them were INT8 victims. */
static int revive_all(kvs_session *s, uint64_t seq, uint32_t layers, uint32_t *tokens,
                      uint64_t *int8, double *us)
{
    *int8 = 0;
    double t0 = bench_now_us();
    for (uint32_t l = 0; l < layers; l++) {
        kvs_revive r;
        int krc = kvs_seq_revive(s, seq, l, 0, 0, 0, 0, &r);
        if (krc != KVS_OK) {
            report_kvs(s, "kvs_seq_revive", krc);
            return -1;
        }
        tokens[l] = r.layer->tokens;
        *int8 += r.from_int8;
        if ((krc = kvs_revive_release(s, &r)) != KVS_OK) {
            report_kvs(s, "kvs_revive_release", krc);
            return -1;
        }
    }
    *us = bench_now_us() - t0;
    return 0;
}

/* Revive layer l of seq over all its `tokens` positions and read it into k, v. */
static int revive_read(kvs_session *s, uint64_t seq, uint32_t l, uint32_t tokens, uint8_t *k,
                       uint8_t *v)
{
    kvs_revive r;
    int krc = kvs_seq_revive(s, seq, l, 0, 0, 0, 0, &r);
    if (krc != KVS_OK) {
        report_kvs(s, "kvs_seq_revive (read)", krc);
        return -1;
    }
    int rc = 0;
    if (r.layer->tokens != tokens) {
        fprintf(stderr, PROG ": layer %u revived %u positions of %u\n", l, r.layer->tokens, tokens);
        rc = -1;
    } else if ((krc = kvs_layer_read(s, r.layer, k, v)) != KVS_OK) {
        report_kvs(s, "kvs_layer_read (revived)", krc);
        rc = -1;
    }
    if ((krc = kvs_revive_release(s, &r)) != KVS_OK) {
        report_kvs(s, "kvs_revive_release", krc);
        rc = -1;
    }
    return rc;
}

/* The spill's first value (part v0) is where its key says: under the
 * spill's hash tag, which the baseline's keys share. */
static int spill_key_check(remote_store *rs, const char *ns, const char *uid)
{
    char key[REMOTE_KEY_CAP];
    const char *kp = key;
    remote_buf b = {0};
    status st;
    if (remote_key(key, sizeof key, ns, "default", uid, "v0", &st) != ST_OK ||
        remote_get(rs, &kp, 1, &b, &st) != ST_OK) {
        report_status("remote_get (spilled value)", &st);
        return -1;
    }
    int found = b.found;
    remote_bufs_free(&b, 1);
    if (!found)
        fprintf(stderr, PROG ": spilled value %s is not in the cluster\n", key);
    return found ? 0 : -1;
}

/* The baseline of a spill: n values of `size` bytes under the spill's hash
 * tag ({default:uid}: its slot, so its master), one raw SET pipeline then
 * one raw GET pipeline (us[0], us[1]), checked, then deleted. */
static int spill_baseline(raw_client *raw, remote_store *rs, const char *ns, const char *uid,
                          const int *owner, size_t n, size_t size, double us[2])
{
    char **keys = calloc(n, sizeof *keys);
    int *node_of = calloc(n, sizeof *node_of);
    redisReply **got = calloc(n, sizeof *got);
    uint8_t *vals = malloc(n * size);
    status st;
    size_t built = 0; /* keys[0 .. built) exist */
    int rc = keys && node_of && got && vals ? 0 : -1;
    if (rc != 0)
        fprintf(stderr, PROG ": out of memory for %zu values of %zu bytes\n", n, size);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        char part[32];
        snprintf(part, sizeof part, "raw.%zu", i);
        if ((keys[i] = malloc(REMOTE_KEY_CAP)) == NULL ||
            remote_key(keys[i], REMOTE_KEY_CAP, ns, "default", uid, part, &st) != ST_OK) {
            fprintf(stderr, PROG ": baseline key %zu\n", i);
            rc = -1;
            break;
        }
        built = i + 1;
        int port = owner[redis_cluster_key_slot(keys[i], strlen(keys[i]))];
        node_of[i] = -1;
        for (int m = 0; m < raw->nmasters; m++)
            if (raw->ports[m] == port)
                node_of[i] = m;
        if (node_of[i] < 0) {
            fprintf(stderr, PROG ": no raw connection to the master of %s\n", keys[i]);
            rc = -1;
        }
        fill(vals + i * size, size, 991 + i);
    }
    double t0 = bench_now_us();
    if (rc == 0)
        rc = raw_run(raw, keys, node_of, n, vals, size, NULL);
    double t1 = bench_now_us();
    if (rc == 0)
        rc = raw_run(raw, keys, node_of, n, NULL, size, got);
    double t2 = bench_now_us();
    for (size_t i = 0; got != NULL && i < n; i++) {
        if (rc == 0 && memcmp(got[i]->str, vals + i * size, size) != 0) {
            fprintf(stderr, PROG ": raw GET of %s: not the value set\n", keys[i]);
            rc = -1;
        }
        if (got[i] != NULL)
            freeReplyObject(got[i]);
    }
    if (built > 0 && remote_del(rs, (const char *const *)keys, built, &st) != ST_OK) {
        report_status("remote_del (spill baseline)", &st);
        rc = -1;
    }
    us[0] = t1 - t0, us[1] = t2 - t1;
    for (size_t i = 0; keys != NULL && i < n; i++)
        free(keys[i]);
    free(keys), free(node_of), free(got), free(vals);
    return rc;
}

/* Both revives gave every position of every layer. */
static int revive_counts_check(const uint32_t *before, const uint32_t *after, uint32_t layers,
                               uint32_t tokens)
{
    for (uint32_t l = 0; l < layers; l++)
        if (before[l] != tokens || after[l] != tokens) {
            fprintf(stderr,
                    PROG ": layer %u revived %u positions before the spill and %u after, of %u\n",
                    l, before[l], after[l], tokens);
            return -1;
        }
    return 0;
}

/* One repetition: a fresh sequence, revived, spilled, revived, then the
 * baselines; checked, and (first) its last layer compared across the spill. */
static int spill_once(const bench_cfg *cfg, kvs_session *s, remote_store *rs, raw_client *raw,
                      const char *ns, const int *owner, int first, spill_result *res,
                      uint8_t *bufs[4], uint32_t *before, uint32_t *after, double us[5])
{
    const kvs_geometry *g = &cfg->geom;
    uint32_t last = g->layers - 1;
    uint64_t seq = 0;
    int krc, rc = spill_seq_build(s, cfg, res->window, res->chunk, bufs[0], bufs[1], &seq);
    if (rc == 0 && first)
        rc = revive_read(s, seq, last, cfg->tokens, bufs[0], bufs[1]);
    if (rc == 0)
        rc = revive_all(s, seq, g->layers, before, &res->int8_before, &us[1]);
    kvs_spill *sp = &res->reply;
    memset(sp, 0, sizeof *sp);
    double t0 = bench_now_us();
    if (rc == 0 && (krc = kvs_seq_spill(s, seq, sp)) != KVS_OK) {
        report_kvs(s, "kvs_seq_spill", krc);
        rc = -1;
    }
    us[0] = bench_now_us() - t0;
    if (rc == 0 && (sp->blocks == 0 || sp->values == 0 || sp->spilled_tokens != sp->tokens)) {
        fprintf(stderr,
                PROG ": the spill freed %u blocks, wrote %u values, %" PRIu64
                     " victims of which %" PRIu64 " are remote (%u dropped)\n",
                sp->blocks, sp->values, sp->tokens, sp->spilled_tokens, sp->dropped);
        rc = -1;
    }
    if (rc == 0)
        rc = revive_all(s, seq, g->layers, after, &res->int8_after, &us[2]);
    if (rc == 0)
        rc = revive_counts_check(before, after, g->layers, cfg->tokens);
    if (rc == 0 && first)
        rc = revive_read(s, seq, last, cfg->tokens, bufs[2], bufs[3]);
    if (rc == 0 && first) {
        size_t lb = layer_kv_bytes(g, cfg->tokens);
        if (memcmp(bufs[0], bufs[2], lb) != 0 || memcmp(bufs[1], bufs[3], lb) != 0) {
            fprintf(stderr, PROG ": layer %u revived after the spill differs from before it\n",
                    last);
            rc = -1;
        }
    }
    if (rc == 0 && first)
        rc = spill_key_check(rs, ns, sp->uid);
    if (rc == 0) {
        res->value_bytes = sp->bytes / sp->values;
        rc = spill_baseline(raw, rs, ns, sp->uid, owner, sp->values, res->value_bytes, &us[3]);
    }
    if (seq != 0 && (krc = kvs_seq_release(s, seq)) != KVS_OK) {
        report_kvs(s, "kvs_seq_release (streaming)", krc);
        rc = -1;
    }
    return rc;
}

static int spill_run(const bench_cfg *cfg, remote_store *rs, raw_client *raw, const char *ns,
                     const char *sock, const int *owner, spill_result *res)
{
    const kvs_geometry *g = &cfg->geom;
    size_t lb = layer_kv_bytes(g, cfg->tokens);
    memset(res, 0, sizeof *res);
    res->window = cfg->quick ? 16 : 64;
    res->chunk = cfg->quick ? 64 : 256;
    uint8_t *bufs[4] = {malloc(lb), malloc(lb), malloc(lb), malloc(lb)};
    uint32_t *before = calloc(g->layers, sizeof *before);
    uint32_t *after = calloc(g->layers, sizeof *after);
    kvs_session *s = NULL;
    char err[512];
    int rc = bufs[0] && bufs[1] && bufs[2] && bufs[3] && before && after ? 0 : -1, krc;
    if (rc == 0 && (krc = kvs_session_attach_tenant(sock, "", "llama-3-8b-bench", g, PROG "-spill",
                                                    &s, err, sizeof err)) != KVS_OK) {
        fprintf(stderr, PROG ": attach A (spill): %s: %s\n", kvs_strerror(krc), err);
        rc = -1;
    }
    double sp[8], bf[8], af[8], rm[8], set[8], get[8];
    int first = cfg->quick ? 0 : -1; /* -1: the warm-up */
    for (int r = first; rc == 0 && r < cfg->reps; r++) {
        double us[5] = {0}; /* spill, revive before, revive after, raw SET, raw GET */
        rc = spill_once(cfg, s, rs, raw, ns, owner, r == first, res, bufs, before, after, us);
        if (rc == 0 && r >= 0) {
            sp[r] = us[0], bf[r] = us[1], af[r] = us[2], rm[r] = us[2] - us[1];
            set[r] = us[3], get[r] = us[4];
        }
    }
    if (rc == 0) {
        size_t reps = (size_t)cfg->reps;
        res->spill_us = bench_median(sp, reps), res->before_us = bench_median(bf, reps);
        res->after_us = bench_median(af, reps), res->remote_us = bench_median(rm, reps);
        res->set_us = bench_median(set, reps), res->get_us = bench_median(get, reps);
        res->ok = 1;
    }
    if (s != NULL && kvs_session_detach(s) != KVS_OK)
        rc = -1;
    for (int i = 0; i < 4; i++)
        free(bufs[i]);
    free(before), free(after);
    return rc;
}

static void spill_print(const bench_cfg *cfg, const spill_result *r)
{
    const kvs_geometry *g = &cfg->geom;
    const kvs_spill *sp = &r->reply;
    printf("\n(3) spill and revive of a `streaming` sequence (n_sink=%u, window=%u, "
           "victims=int8): %u tokens x %u layers x %u KV heads x %u fp16, %u-token blocks, "
           "appended and stepped %u at a time, median of %d\n",
           SPILL_SINKS, r->window, cfg->tokens, g->layers, g->kv_heads, g->head_dim,
           g->block_tokens, r->chunk, cfg->reps);
    if (!r->ok) {
        printf("(did not run)\n");
        return;
    }
    char total[32];
    if (sp->bytes >= 1000000)
        snprintf(total, sizeof total, "%.1f MB", (double)sp->bytes / MB);
    else
        snprintf(total, sizeof total, "%" PRIu64 " bytes", sp->bytes);
    printf("spilled: %" PRIu64 " victims (%" PRIu64 " per layer) from %u pool blocks, %s in %u "
           "values of %zu bytes on average (one hash slot: one master); revived from INT8: "
           "%" PRIu64 " before, %" PRIu64 " after\n",
           sp->tokens, sp->tokens / g->layers, sp->blocks, total, sp->values, r->value_bytes,
           r->int8_before, r->int8_after);
    size_t bytes = sp->bytes;
    printf("%-52s %10s %8s\n", "", "ms", "MB/s");
    printf("%-52s %10.1f %8.0f\n", "kvs_seq_spill", r->spill_us / 1e3, mbps(bytes, r->spill_us));
    printf("%-52s %10.1f %8.0f\n", "raw SET pipeline of as many values (same slot)",
           r->set_us / 1e3, mbps(bytes, r->set_us));
    printf("%-52s %10.1f\n", "revive + release, every layer, before the spill", r->before_us / 1e3);
    printf("%-52s %10.1f\n", "revive + release, every layer, after the spill", r->after_us / 1e3);
    printf("%-52s %10.1f %8.0f\n", "  after - before: the remote part", r->remote_us / 1e3,
           mbps(bytes, r->remote_us));
    printf("%-52s %10.1f %8.0f\n", "raw GET pipeline of those values", r->get_us / 1e3,
           mbps(bytes, r->get_us));
    printf("ratios (baseline time over ours; goal >= 0.7): spill / raw SET %.2f, revive's "
           "remote part / raw GET %.2f; revive after / before %.2f%s\n",
           r->set_us / r->spill_us, r->remote_us > 0 ? r->get_us / r->remote_us : 0,
           r->after_us / r->before_us,
           cfg->quick ? " (--quick: one cold repetition, not a measurement)" : "");
}

static void migration_print(const bench_cfg *cfg, const mig_result *r)
{
    const kvs_geometry *g = &cfg->geom;
    char total[32], value[32];
    size_name(r->bytes, total, sizeof total);
    size_name(r->value_bytes, value, sizeof value);
    printf("\n(2) migration of a `full` sequence: %u tokens x %u layers x %u KV heads x %u "
           "fp16, %u-token blocks: %s of K+V in %zu data values of %s (one hash slot: one "
           "master), median of %d\n",
           cfg->tokens, g->layers, g->kv_heads, g->head_dim, g->block_tokens, total, r->values,
           value, cfg->reps);
    if (!r->ok) {
        printf("(did not run)\n");
        return;
    }
    printf("%-44s %10s %8s\n", "", "ms", "MB/s");
    printf("%-44s %10.1f %8.0f\n", "memcpy of the same bytes", r->memcpy_us / 1e3,
           mbps(r->bytes, r->memcpy_us));
    printf("%-44s %10.1f %8.0f\n", "remote_put of the same bytes (our client)", r->put_us / 1e3,
           mbps(r->bytes, r->put_us));
    printf("%-44s %10.1f %8.0f\n", "kvs_seq_export on A", r->export_us / 1e3,
           mbps(r->bytes, r->export_us));
    printf("%-44s %10.1f %8.0f\n", "remote_get of the same bytes (our client)", r->get_us / 1e3,
           mbps(r->bytes, r->get_us));
    printf("%-44s %10.1f %8.0f\n", "kvs_seq_import on B", r->import_us / 1e3,
           mbps(r->bytes, r->import_us));
    printf("ratios (baseline time over ours): export/put %.2f, import/get %.2f, export/memcpy "
           "%.3f, import/memcpy %.3f; migration (export + import) %.1f ms\n",
           r->put_us / r->export_us, r->get_us / r->import_us, r->memcpy_us / r->export_us,
           r->memcpy_us / r->import_us, (r->export_us + r->import_us) / 1e3);
}

/* ---- main ------------------------------------------------------------------ */

static int parse_u32(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || v == 0 || v > 65536)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int main(int argc, char **argv)
{
    bench_cfg cfg = {.reps = 3,
                     .sizes = {{64u << 10, 1536}, {1u << 20, 192}, {16u << 20, 24}},
                     .nsizes = 3,
                     .geom = {.layers = 32,
                              .q_heads = 32,
                              .kv_heads = 8,
                              .head_dim = 128,
                              .block_tokens = 16,
                              .dtype = KVS_FP16},
                     .tokens = 4096};
    uint32_t layers = 0, tokens = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            cfg.quick = 1;
        } else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc) {
            if (parse_u32(argv[++i], &layers) != 0)
                goto usage;
        } else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            if (parse_u32(argv[++i], &tokens) != 0)
                goto usage;
        } else if (argv[i][0] != '-' && cfg.daemon == NULL) {
            cfg.daemon = argv[i];
        } else {
            goto usage;
        }
    }
    if (cfg.quick) {
        cfg.reps = 1;
        cfg.sizes[0] = (store_size){64u << 10, 48};
        cfg.sizes[1] = (store_size){1u << 20, 12};
        cfg.nsizes = 2;
        cfg.geom = (kvs_geometry){.layers = 2,
                                  .q_heads = 2,
                                  .kv_heads = 2,
                                  .head_dim = 16,
                                  .block_tokens = 16,
                                  .dtype = KVS_FP16};
        cfg.tokens = 256;
    }
    if (layers)
        cfg.geom.layers = layers;
    if (tokens)
        cfg.tokens = tokens;
    if (cfg.daemon == NULL)
        cfg.daemon = bench_default_daemon();
    g_py = getenv("KVSTASH_CLUSTER_PY");
    if (g_py == NULL || g_py[0] == '\0')
        g_py = KVSTASH_CLUSTER_PY;
    setenv("KVSTASH_RPC_TIMEOUT_MS", "300000", 0); /* an export of 512 MiB on a busy machine */

    if (mkdtemp(g_tmp) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    g_tmp_made = 1;
    snprintf(g_cluster_dir, sizeof g_cluster_dir, "%s/cluster", g_tmp);
    atexit(cleanup);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);

    /* The cluster, then the daemons, before anything starts threads. */
    char out[4096], args[2 * PATH_MAX];
    snprintf(args, sizeof args, "start '%s' --masters 3 --replicas 0 --owner %d", g_cluster_dir,
             (int)getpid());
    g_cluster_started = 1; /* stop is safe whatever start got to */
    if (cluster_py(out, sizeof out, args) != 0) {
        fprintf(stderr,
                PROG ": cluster.py start failed (redis-server and redis-cli must be "
                     "installed: ops/setup.sh): %s\n",
                out);
        return 1;
    }
    int ports[MAX_MASTERS], masters[MAX_MASTERS], nmasters = 0;
    static int owner[REDIS_CLUSTER_SLOTS];
    int nports = parse_ports(out, ports, MAX_MASTERS);
    if (nports < 3 || slots_owners(ports[0], owner, masters, &nmasters) != 0) {
        fprintf(stderr, PROG ": cluster.py start: %s\n", out);
        return 1;
    }
    char seeds[128], ns[32];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d,127.0.0.1:%d", ports[0], ports[1]);
    snprintf(ns, sizeof ns, "bench%d", (int)getpid());
    size_t mig_bytes = 2 * layer_kv_bytes(&cfg.geom, cfg.tokens) * cfg.geom.layers;
    int pool_mb = (int)(mig_bytes >> 20) + (int)(mig_bytes >> 24) + 32;
    char sock_a[PATH_MAX], sock_b[PATH_MAX];
    if (daemon_start(0, cfg.daemon, pool_mb, seeds, ns, sock_a, sizeof sock_a) != 0 ||
        daemon_start(1, cfg.daemon, pool_mb, seeds, ns, sock_b, sizeof sock_b) != 0)
        return 1;

    char rv[128] = "?";
    FILE *p = popen("redis-server --version 2>/dev/null", "r");
    if (p != NULL) {
        if (fgets(rv, sizeof rv, p) != NULL)
            rv[strcspn(rv, "\n")] = '\0';
        pclose(p);
    }
    printf(PROG ": %s run, %ld CPUs, %s; cluster of %d masters (no replicas) on 127.0.0.1:%d,...; "
                "median of %d%s\n",
           cfg.quick ? "quick" : "full", sysconf(_SC_NPROCESSORS_ONLN), rv, nmasters, ports[0],
           cfg.reps, cfg.quick ? "" : " after a warm-up");
    fflush(stdout);

    remote_store *rs = NULL;
    status st;
    if (redis_cluster_open(seeds, TIMEOUT_MS, &rs, &st) != ST_OK) {
        report_status("redis_cluster_open", &st);
        return 1;
    }
    if (remote_ping(rs, &st) != ST_OK) { /* connects to every master, as raw_open does */
        report_status("remote_ping", &st);
        return 1;
    }
    raw_client raw;
    int raw_ok = raw_open(&raw, masters, nmasters) == 0, failed = !raw_ok;

    store_row rows[MAX_SIZES];
    memset(rows, 0, sizeof rows);
    for (size_t i = 0; !failed && i < cfg.nsizes; i++) {
        rows[i].sz = cfg.sizes[i];
        if (store_size_run(&cfg, rs, &raw, owner, masters, nmasters, &rows[i]) != 0)
            failed = 1;
    }
    store_print(rows, cfg.nsizes, nmasters, cfg.quick);
    fflush(stdout);

    mig_result mig = {0};
    if (migration_run(&cfg, rs, ns, sock_a, sock_b, &mig) != 0)
        failed = 1;
    migration_print(&cfg, &mig);
    fflush(stdout);

    spill_result spill = {0};
    if (raw_ok && spill_run(&cfg, rs, &raw, ns, sock_a, owner, &spill) != 0)
        failed = 1;
    spill_print(&cfg, &spill);
    raw_close(&raw);
    remote_close(rs);

    for (int i = 0; i < 2; i++) {
        int ds = daemon_stop(i);
        if (ds != 0) {
            fprintf(stderr, PROG ": kvstashd %c exited with status %d\n", 'a' + i, ds);
            failed = 1;
        }
    }
    if (failed)
        fprintf(stderr, PROG ": some parts failed (see above)\n");
    return failed ? 1 : 0;

usage:
    fprintf(stderr, "usage: %s [--quick] [--layers N] [--tokens N] [PATH_TO_KVSTASHD]\n", argv[0]);
    return 2;
}
