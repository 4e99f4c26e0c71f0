/*
 * test_libkvstash.c - libkvstash against a real kvstashd.
 *
 *   test_libkvstash /path/to/kvstashd
 *
 * Starts its own daemons (posix_spawn, in a fresh temporary directory) and
 * checks the parts of the library that the demo and kvs_test_worker do not
 * reach: error mapping and messages, another session's sequences, the block
 * layout behind kvs_key_ptr, one pool shared by two mappings, epoch acks
 * freeing retired blocks, events, tables kept by cuts, statistics written
 * into the ring (kvs_step_in_ring), a daemon that stops answering (deadline)
 * and one that shuts down under an attached session.
 * Exit status 0 iff every check passed.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "kvstash.h"

extern char **environ;

static int failures, checks;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        checks++;                                                                                  \
        if (!(cond)) {                                                                             \
            failures++;                                                                            \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                 \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

#define CHECK_RC(rc, want, s)                                                                      \
    CHECK((rc) == (want), "got %d (%s), want %d: %s", (rc), kvs_strerror(rc), (want),              \
          (s) != NULL ? kvs_session_error(s) : "")

typedef struct daemon_proc {
    pid_t pid;
    char dir[64];
    char sock[128];
} daemon_proc;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Start kvstashd on a socket in a new temporary directory with a pool and
 * session rings of the sizes given (MiB) and wait until it answers Stats. */
static int daemon_start_sized(const char *exe, daemon_proc *d, const char *pool_mb,
                              const char *ring_mb)
{
    snprintf(d->dir, sizeof d->dir, "/tmp/kvstest.XXXXXX");
    if (mkdtemp(d->dir) == NULL)
        return -1;
    snprintf(d->sock, sizeof d->sock, "%s/run/kvstashd.sock", d->dir);
    char *argv[] = {(char *)exe, "--socket",      d->sock,       "--pool-mb", (char *)pool_mb,
                    "--ring-mb", (char *)ring_mb, "--log-level", "warn",      NULL};
    if (posix_spawn(&d->pid, exe, NULL, NULL, argv, environ) != 0)
        return -1;
    for (int i = 0; i < 100; i++) {
        char *json, err[256];
        if (kvs_stats_json(d->sock, &json, err, sizeof err) == KVS_OK) {
            free(json);
            return 0;
        }
        sleep_ms(50);
    }
    return -1;
}

static int daemon_start(const char *exe, daemon_proc *d)
{
    return daemon_start_sized(exe, d, "4", "8");
}

static void daemon_stop(daemon_proc *d)
{
    if (d->pid > 0) {
        kill(d->pid, SIGCONT);
        kill(d->pid, SIGTERM);
        waitpid(d->pid, NULL, 0);
        d->pid = 0;
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d->dir);
    if (system(cmd) != 0)
        printf("warning: could not remove %s\n", d->dir);
}

/* An integer field of the pool `pool_id` in Stats (-1 if absent). */
static long long pool_stat(const char *sock, uint64_t pool_id, const char *field)
{
    char *text, err[256];
    if (kvs_stats_json(sock, &text, err, sizeof err) != KVS_OK)
        return -1;
    json_t *st = json_loads(text, 0, NULL);
    free(text);
    long long v = -1;
    size_t i;
    json_t *p;
    json_array_foreach(json_object_get(st, "pools"), i, p)
    {
        if ((uint64_t)json_integer_value(json_object_get(p, "pool_id")) == pool_id)
            v = json_integer_value(json_object_get(p, field));
    }
    json_decref(st);
    return v;
}

static const kvs_geometry geom = {
    .layers = 2, .q_heads = 2, .kv_heads = 2, .head_dim = 4, .block_tokens = 4, .dtype = KVS_FP32};

static kvs_session *attach(const char *sock, const char *name)
{
    kvs_session *s;
    char err[512];
    int rc = kvs_session_attach(sock, "t", &geom, name, &s, err, sizeof err);
    CHECK(rc == KVS_OK, "attach %s: %s", name, err);
    return rc == KVS_OK ? s : NULL;
}

static void test_no_daemon(void)
{
    kvs_session *s = (kvs_session *)1;
    char err[512];
    int rc = kvs_session_attach("/nonexistent/kvstashd.sock", "t", &geom, "x", &s, err, sizeof err);
    CHECK_RC(rc, KVS_ERR_UNAVAILABLE, (kvs_session *)NULL);
    CHECK(s == NULL, "out must be NULL on failure");
    CHECK(strstr(err, "/nonexistent/kvstashd.sock.fd") != NULL && strstr(err, "running") != NULL,
          "message: %s", err);
    char *json = (char *)1;
    rc = kvs_stats_json("/nonexistent/kvstashd.sock", &json, err, sizeof err);
    CHECK_RC(rc, KVS_ERR_UNAVAILABLE, (kvs_session *)NULL);
    CHECK(json == NULL && err[0] != '\0', "json %p, message %s", (void *)json, err);
    rc = kvs_session_attach("/nonexistent/kvstashd.sock", NULL, &geom, "x", &s, err, sizeof err);
    CHECK_RC(rc, KVS_ERR_INVALID, (kvs_session *)NULL);
}

/* Layout: kvs_key_ptr/kvs_value_ptr follow AttachResponse's formula, and
 * kvs_layer_read sees what kvs_key_ptr wrote. */
static void test_layout(kvs_session *a)
{
    const kvs_geometry *g = kvs_session_geometry(a);
    uint8_t *pool = kvs_session_pool(a);
    size_t bb = kvs_session_block_bytes(a), elt = 4;
    CHECK(bb == 2 * g->kv_heads * g->block_tokens * g->head_dim * elt, "block_bytes %zu", bb);
    CHECK(kvs_session_pool_bytes(a) >= (size_t)kvs_session_block_count(a) * bb, "pool too small");
    CHECK((uint8_t *)kvs_key_ptr(a, 3, 1, 2) ==
              pool + 3 * bb + (1 * g->block_tokens + 2) * g->head_dim * elt,
          "key_ptr");
    CHECK((uint8_t *)kvs_value_ptr(a, 3, 1, 2) == (uint8_t *)kvs_key_ptr(a, 3, 1, 2) + bb / 2,
          "value_ptr");

    uint64_t id;
    int rc = kvs_seq_create(a, "full", NULL, 0, "layout", &id);
    CHECK_RC(rc, KVS_OK, a);
    kvs_table w;
    rc = kvs_seq_append(a, id, 6, &w); /* spans two blocks of 4 */
    CHECK_RC(rc, KVS_OK, a);
    if (rc != KVS_OK)
        return;
    CHECK(w.layers == 2 && w.first_position == 0, "layers %u first %u", w.layers, w.first_position);
    for (uint32_t l = 0; l < w.layers; l++) {
        const kvs_layer *ly = &w.layer[l];
        CHECK(ly->tokens == 6, "tokens %u", ly->tokens);
        uint32_t t = 0;
        for (size_t i = 0; i < ly->nsegments; i++)
            for (uint32_t j = 0; j < ly->segments[i].count; j++, t++)
                for (uint32_t h = 0; h < g->kv_heads; h++) {
                    float *k =
                        kvs_key_ptr(a, ly->segments[i].block, h, ly->segments[i].first_slot + j);
                    float *v =
                        kvs_value_ptr(a, ly->segments[i].block, h, ly->segments[i].first_slot + j);
                    for (uint32_t c = 0; c < g->head_dim; c++) {
                        k[c] = (float)(l * 1000 + h * 100 + t * 10 + c);
                        v[c] = -k[c];
                    }
                }
        float kb[2 * 6 * 4], vb[2 * 6 * 4];
        kvs_layer_read(a, ly, kb, vb);
        int bad = 0;
        for (uint32_t h = 0; h < 2; h++)
            for (uint32_t tt = 0; tt < 6; tt++)
                for (uint32_t c = 0; c < 4; c++) {
                    float want = (float)(l * 1000 + h * 100 + tt * 10 + c);
                    bad += kb[(h * 6 + tt) * 4 + c] != want || vb[(h * 6 + tt) * 4 + c] != -want;
                }
        CHECK(bad == 0, "layer %u: %d values differ between key_ptr writes and layer_read", l, bad);
        /* And the way back: layer_write then key_ptr. */
        for (size_t i = 0; i < 2 * 6 * 4; i++)
            kb[i] += 0.5f, vb[i] -= 0.5f;
        kvs_layer_write(a, ly, kb, vb);
        float *k0 = kvs_key_ptr(a, ly->segments[0].block, 1, ly->segments[0].first_slot);
        CHECK(k0[2] == (float)(l * 1000 + 100 + 2) + 0.5f, "layer_write: %f", k0[2]);
    }
    kvs_table_free(&w);
    CHECK(w.layer == NULL && w.layers == 0, "kvs_table_free zeroes");
    rc = kvs_seq_release(a, id);
    CHECK_RC(rc, KVS_OK, a);
}

static void test_errors(const char *sock, kvs_session *a, kvs_session *b)
{
    uint64_t id;
    int rc = kvs_seq_create(a, "full", NULL, 0, NULL, &id);
    CHECK_RC(rc, KVS_OK, a);
    kvs_table t = {.layers = 99};
    const int64_t bad_counts[] = {0, -1, 65537, INT64_MIN};
    for (size_t i = 0; i < sizeof bad_counts / sizeof bad_counts[0]; i++) {
        rc = kvs_seq_append(a, id, bad_counts[i], &t);
        CHECK_RC(rc, KVS_ERR_INVALID, a);
        CHECK(t.layers == 0 && t.layer == NULL, "table zeroed on error");
        CHECK(kvs_session_error(a)[0] != '\0', "a message for count %" PRId64, bad_counts[i]);
    }
    rc = kvs_seq_append(a, 987654321, 1, &t);
    CHECK_RC(rc, KVS_ERR_NOT_FOUND, a);
    rc = kvs_seq_append(b, id, 1, &t);
    CHECK_RC(rc, KVS_ERR_PERMISSION, b);
    rc = kvs_seq_table(b, id, 1, &t);
    CHECK_RC(rc, KVS_ERR_PERMISSION, b);
    rc = kvs_seq_release(b, id);
    CHECK_RC(rc, KVS_ERR_PERMISSION, b);
    const kvs_param bad[] = {{"no_such_param", "1"}};
    uint64_t id2;
    rc = kvs_seq_create(a, "streaming", bad, 1, NULL, &id2);
    CHECK_RC(rc, KVS_ERR_INVALID, a);
    CHECK(strstr(kvs_session_error(a), "no_such_param") != NULL, "message names the key: %s",
          kvs_session_error(a));
    rc = kvs_seq_release(a, id);
    CHECK_RC(rc, KVS_OK, a);
    rc = kvs_seq_release(a, id);
    CHECK_RC(rc, KVS_ERR_NOT_FOUND, a);
    rc = kvs_seq_append(a, id, 1, &t);
    CHECK_RC(rc, KVS_ERR_NOT_FOUND, a);

    /* Another geometry for the same model. */
    kvs_geometry g2 = geom;
    g2.head_dim = 8;
    kvs_session *c = (kvs_session *)1;
    char err[512];
    rc = kvs_session_attach(sock, "t", &g2, "c", &c, err, sizeof err);
    CHECK_RC(rc, KVS_ERR_PRECONDITION, (kvs_session *)NULL);
    CHECK(c == NULL && strstr(err, "head_dim") != NULL, "message: %s", err);

    /* A host pool has no device streams; unregistering is always fine. */
    int stream_stand_in;
    rc = kvs_session_set_stream(a, &stream_stand_in);
    CHECK_RC(rc, KVS_ERR_PRECONDITION, a);
    char want[64];
    snprintf(want, sizeof want, "\"%s\" backend", kvs_session_backend(a));
    CHECK(strstr(kvs_session_error(a), want) != NULL, "message: %s", kvs_session_error(a));
    rc = kvs_session_set_stream(a, NULL);
    CHECK_RC(rc, KVS_OK, a);
    rc = kvs_session_set_stream(NULL, NULL);
    CHECK_RC(rc, KVS_ERR_INVALID, (kvs_session *)NULL);
}

/* Two sessions of one model map the same memory. */
static void test_shared_pool(kvs_session *a, kvs_session *b)
{
    CHECK(kvs_session_pool_id(a) == kvs_session_pool_id(b), "one pool per model");
    CHECK(kvs_session_pool(a) != kvs_session_pool(b), "two mappings");
    uint32_t last = kvs_session_block_count(a) - 1;
    float *pa = kvs_key_ptr(a, last, 1, 3), *pb = kvs_key_ptr(b, last, 1, 3);
    pa[0] = 42.25f;
    CHECK(pb[0] == 42.25f, "write through A visible through B: %f", pb[0]);
}

/* Tokens evicted by streaming retire their blocks; the next call acks the
 * epoch that retired them and they return to the free list. */
static void test_epochs(const char *sock, kvs_session *a)
{
    const kvs_param p[] = {{"n_sink", "0"}, {"window", "4"}};
    uint64_t id;
    int rc = kvs_seq_create(a, "streaming", p, 2, "epochs", &id);
    CHECK_RC(rc, KVS_OK, a);
    uint64_t pool = kvs_session_pool_id(a);
    long long max_retired = 0;
    uint64_t epoch = 0;
    for (int i = 0; i < 24 && rc == KVS_OK; i++) {
        kvs_table w;
        rc = kvs_seq_append(a, id, 1, &w);
        CHECK_RC(rc, KVS_OK, a);
        if (rc != KVS_OK)
            break;
        CHECK(w.epoch > epoch, "epochs grow: %" PRIu64 " after %" PRIu64, w.epoch, epoch);
        epoch = w.epoch;
        kvs_table_free(&w);
        long long r = pool_stat(sock, pool, "blocks_retired");
        if (r > max_retired)
            max_retired = r;
    }
    CHECK(max_retired > 0, "streaming over 24 tokens with a window of 4 retired no block");
    kvs_table t;
    rc = kvs_seq_table(a, id, 1, &t); /* acks the newest epoch */
    CHECK_RC(rc, KVS_OK, a);
    if (rc == KVS_OK) {
        CHECK(t.epoch == epoch, "table epoch %" PRIu64 ", last append %" PRIu64, t.epoch, epoch);
        /* The gRPC path runs the policy when the next Append begins, so the
         * newest append is held in full on top of the window. */
        uint32_t n = t.layer[0].tokens;
        CHECK(n >= 4 && n <= 5 && t.layer[0].positions[n - 1] == 23 &&
                  t.layer[0].positions[n - 4] == 20,
              "tokens %u, last position %u", n, n ? t.layer[0].positions[n - 1] : 0);
        kvs_table_free(&t);
    }
    CHECK(pool_stat(sock, pool, "blocks_retired") == 0, "retired blocks after the ack: %lld",
          pool_stat(sock, pool, "blocks_retired"));
    rc = kvs_seq_release(a, id);
    CHECK_RC(rc, KVS_OK, a);
}

/* Write 8 tokens' distinctive K/V (base + token) into list `ly` of 8. */
static void write_tokens(kvs_session *a, const kvs_layer *ly, float base)
{
    float k[2 * 8 * 4], v[2 * 8 * 4];
    for (size_t i = 0; i < 2 * 8 * 4; i++)
        k[i] = base + (float)i, v[i] = -base - (float)i;
    kvs_layer_write(a, ly, k, v);
}

/* Whether list `ly` of 8 tokens reads what write_tokens(base) wrote. */
static int reads_tokens(kvs_session *a, const kvs_layer *ly, float base)
{
    float k[2 * 8 * 4], v[2 * 8 * 4];
    if (ly->tokens != 8 || kvs_layer_read(a, ly, k, v) != KVS_OK)
        return 0;
    int same = 1;
    for (size_t i = 0; i < 2 * 8 * 4; i++)
        same &= k[i] == base + (float)i && v[i] == -base - (float)i;
    return same;
}

/*
 * KVS_REVIVE_IN_PLACE: a Revive of tokens held at full precision copies
 * nothing. Its table names the list's own slots (the table's segments),
 * it takes no scratch (scratch_id 0, release is local), and reads what a
 * copying Revive reads. Those slots stay readable as the table's do: an
 * append that evicts the revived tokens retires their blocks (new tokens
 * written meanwhile do not land there) until the session acks the newer
 * epoch. Unknown flags are refused.
 */
static void test_revive_in_place(const char *sock, kvs_session *a)
{
    const kvs_param p[] = {{"n_sink", "0"}, {"window", "8"}};
    uint64_t id, pool = kvs_session_pool_id(a);
    int rc = kvs_seq_create(a, "streaming", p, 2, "in place", &id);
    CHECK_RC(rc, KVS_OK, a);
    kvs_table w, t;
    if (rc != KVS_OK || (rc = kvs_seq_append(a, id, 8, &w)) != KVS_OK) {
        CHECK_RC(rc, KVS_OK, a);
        return;
    }
    write_tokens(a, &w.layer[0], 1000.0f);
    kvs_table_free(&w);
    rc = kvs_seq_table(a, id, 1, &t); /* acks the newest epoch */
    CHECK_RC(rc, KVS_OK, a);
    kvs_revive here, copy;
    rc = kvs_seq_revive(a, id, 0, 0, 0, 0, KVS_REVIVE_IN_PLACE, &here);
    CHECK_RC(rc, KVS_OK, a);
    CHECK_RC(kvs_seq_revive(a, id, 0, 0, 0, 0, 0, &copy), KVS_OK, a);
    if (rc == KVS_OK) {
        CHECK(here.scratch_id == 0 && copy.scratch_id != 0, "scratch ids %" PRIu64 ", %" PRIu64,
              here.scratch_id, copy.scratch_id);
        CHECK(here.epoch == t.epoch && copy.epoch == t.epoch,
              "revive epochs %" PRIu64 ", %" PRIu64 ", table %" PRIu64, here.epoch, copy.epoch,
              t.epoch);
        int same = here.layer->nsegments == t.layer[0].nsegments && here.from_full == 8;
        for (size_t i = 0; same && i < here.layer->nsegments; i++)
            same = here.layer->segments[i].block == t.layer[0].segments[i].block &&
                   here.layer->segments[i].first_slot == t.layer[0].segments[i].first_slot &&
                   here.layer->segments[i].count == t.layer[0].segments[i].count;
        CHECK(same, "the in-place revive's segments are not the table's");
        CHECK(reads_tokens(a, here.layer, 1000.0f) && reads_tokens(a, copy.layer, 1000.0f),
              "the revives do not read what was written");
        /* 8 more tokens, and a step that evicts the revived ones: their
         * blocks are retired, and still read the same, until the session
         * acks the step's epoch (its next call). */
        rc = kvs_seq_append(a, id, 8, &w);
        CHECK_RC(rc, KVS_OK, a);
        if (rc == KVS_OK) {
            write_tokens(a, &w.layer[0], 5000.0f);
            kvs_table_free(&w);
        }
        const uint32_t held[2] = {16, 16};
        kvs_step st = {.new_tokens = 8, .heads = 1, .tokens = held, .confidence = -1};
        kvs_step_result res;
        CHECK_RC(kvs_seq_step(a, id, &st, &res), KVS_OK, a);
        CHECK(res.epoch > here.epoch && res.evicted == 16, "step: epoch %" PRIu64 ", %u evicted",
              res.epoch, res.evicted);
        CHECK(pool_stat(sock, pool, "blocks_retired") == 4, "%lld blocks retired, want 4",
              pool_stat(sock, pool, "blocks_retired"));
        CHECK(reads_tokens(a, here.layer, 1000.0f), "the in-place revive changed before the ack");
        CHECK_RC(kvs_revive_release(a, &here), KVS_OK, a);
        uint64_t now;
        CHECK_RC(kvs_seq_epoch(a, id, &now), KVS_OK, a); /* acks the step's epoch */
        CHECK(pool_stat(sock, pool, "blocks_retired") == 0, "%lld blocks retired after the ack",
              pool_stat(sock, pool, "blocks_retired"));
        CHECK(here.layer == NULL && here.scratch_id == 0, "release zeroes");
        CHECK_RC(kvs_revive_release(a, &copy), KVS_OK, a);
    }
    kvs_table_free(&t);
    rc = kvs_seq_revive(a, id, 0, 0, 0, 0, 4, &here);
    CHECK_RC(rc, KVS_ERR_INVALID, a);
    CHECK(strstr(kvs_session_error(a), "KVS_REVIVE_IN_PLACE") != NULL, "message: %s",
          kvs_session_error(a));
    CHECK_RC(kvs_seq_release(a, id), KVS_OK, a);
}

/* Events: attach/create/evict/release/detach show up with a growing "n". */
static void test_events(const char *sock)
{
    int ev = kvs_events_open(sock);
    CHECK(ev >= 0, "kvs_events_open: %d", ev);
    if (ev < 0)
        return;
    /* nanomsg connects the SUB socket in the background, and a loaded
     * machine can take long: poke the daemon (attach + detach) until the
     * feed delivers, then drain, so the checks below see a live feed. */
    char *e;
    int live = 0;
    for (int i = 0; i < 50 && !live; i++) {
        kvs_session *probe = attach(sock, "events");
        if (probe != NULL)
            kvs_session_detach(probe);
        if (kvs_events_next(ev, 100, &e) == KVS_OK) {
            free(e);
            live = 1;
        }
    }
    CHECK(live, "the event feed delivered nothing within 50 attach/detach probes");
    while (kvs_events_next(ev, 300, &e) == KVS_OK)
        free(e);
    kvs_session *s = attach(sock, "events");
    if (s == NULL) {
        kvs_events_close(ev);
        return;
    }
    uint64_t id;
    kvs_table w;
    /* table.changed is published when a table loses tokens (the daemon does
     * not flood the feed with one event per decode step): evict one. */
    const kvs_param p[] = {{"n_sink", "0"}, {"window", "2"}};
    CHECK_RC(kvs_seq_create(s, "streaming", p, 2, NULL, &id), KVS_OK, s);
    for (int i = 0; i < 5; i++) {
        CHECK_RC(kvs_seq_append(s, id, 1, &w), KVS_OK, s);
        kvs_table_free(&w);
    }
    CHECK_RC(kvs_seq_release(s, id), KVS_OK, s);
    CHECK_RC(kvs_session_detach(s), KVS_OK, (kvs_session *)NULL);
    const char *want[] = {"worker.attached", "seq.created", "table.changed", "seq.released",
                          "worker.reclaimed"};
    size_t seen = 0;
    long long last_n = -1;
    while (seen < 5 && kvs_events_next(ev, 2000, &e) == KVS_OK) {
        const char *sp = strchr(e, ' ');
        json_t *j = sp != NULL ? json_loads(sp + 1, 0, NULL) : NULL;
        CHECK(j != NULL, "event is not \"topic {json}\": %s", e);
        long long n = json_integer_value(json_object_get(j, "n"));
        CHECK(n > last_n, "n grows: %lld after %lld", n, last_n);
        last_n = n;
        if (sp != NULL && strncmp(e, want[seen], (size_t)(sp - e)) == 0 &&
            strlen(want[seen]) == (size_t)(sp - e))
            seen++;
        json_decref(j);
        free(e);
    }
    CHECK(seen == 5, "saw %zu of the 5 expected topics in order (next: %s)", seen,
          seen < 5 ? want[seen] : "");
    CHECK(kvs_events_next(ev, 100, &e) == KVS_ERR_UNAVAILABLE, "timeout");
    kvs_events_close(ev);
}

/* A daemon that stops answering: calls end at the deadline, not never. */
static void test_deadline(daemon_proc *d, kvs_session *a)
{
    setenv("KVSTASH_RPC_TIMEOUT_MS", "500", 1);
    kill(d->pid, SIGSTOP);
    int wst;
    waitpid(d->pid, &wst, WUNTRACED); /* kill() returns before the stop takes effect */
    double t0 = now_s();
    uint64_t id;
    int rc = kvs_seq_create(a, "full", NULL, 0, NULL, &id);
    double dt = now_s() - t0;
    CHECK_RC(rc, KVS_ERR_UNAVAILABLE, a);
    CHECK(dt > 0.4 && dt < 3, "the call took %.2f s with a 0.5 s deadline", dt);
    kvs_session *s;
    char err[512];
    t0 = now_s();
    rc = kvs_session_attach(d->sock, "t", &geom, "late", &s, err, sizeof err);
    dt = now_s() - t0;
    CHECK_RC(rc, KVS_ERR_UNAVAILABLE, (kvs_session *)NULL);
    CHECK(dt < 3, "attach to a stopped daemon took %.2f s: %s", dt, err);
    kill(d->pid, SIGCONT);
    unsetenv("KVSTASH_RPC_TIMEOUT_MS");
    sleep_ms(200);
    rc = kvs_seq_create(a, "full", NULL, 0, NULL, &id);
    CHECK_RC(rc, KVS_OK, a);
}

/* The daemon stops under an attached session: calls fail cleanly and
 * detach still frees everything. */
/* Whether table a's layer l and b's hold the same segments. */
static int same_segments(const kvs_table *a, const kvs_table *b, uint32_t l)
{
    const kvs_layer *x = &a->layer[l], *y = &b->layer[l];
    if (x->tokens != y->tokens || x->nsegments != y->nsegments)
        return 0;
    for (size_t i = 0; i < x->nsegments; i++)
        if (x->segments[i].block != y->segments[i].block ||
            x->segments[i].first_slot != y->segments[i].first_slot ||
            x->segments[i].count != y->segments[i].count ||
            x->segments[i].tier != y->segments[i].tier)
            return 0;
    return 1;
}

/* Revive positions [first, end) of layer 0 (count 0: to the end of the
 * list) and check that `want` tokens came back, positions first.. in order. */
static void revive_rest(kvs_session *s, uint64_t id, uint32_t first, uint32_t want, unsigned flags)
{
    kvs_revive r;
    int rc = kvs_seq_revive(s, id, 0, 0, first, 0, flags, &r);
    CHECK_RC(rc, KVS_OK, s);
    if (rc != KVS_OK)
        return;
    uint32_t bad = 0;
    for (uint32_t i = 0; i < r.layer->tokens; i++)
        bad += r.layer->positions[i] != first + i;
    CHECK(r.layer->tokens == want && bad == 0 && r.from_full == want,
          "revive from %u to the end: %u tokens (%u from full precision, %u positions wrong), "
          "want %u",
          first, r.layer->tokens, r.from_full, bad, want);
    CHECK((r.scratch_id == 0) == ((flags & KVS_REVIVE_IN_PLACE) != 0),
          "revive from %u, flags %u: scratch %" PRIu64, first, flags, r.scratch_id);
    CHECK_RC(kvs_revive_release(s, &r), KVS_OK, s);
}

/* A Revive of the rest of a list (count 0) goes through the ring, whose
 * answer takes 5 bytes a token and 12 a segment: the last 50,000 of
 * 200,000 tokens fit the 1 MiB ring; all 200,000 do not, kvstashd refuses
 * them there, and libkvstash asks gRPC. */
static void revive_beyond_the_ring(kvs_session *s, uint64_t id)
{
    int rc = KVS_OK;
    for (int i = 0; rc == KVS_OK && i < 2; i++) {
        kvs_table w;
        rc = kvs_seq_append(s, id, 50000, &w);
        kvs_table_free(&w);
    }
    CHECK_RC(rc, KVS_OK, s);
    if (rc != KVS_OK)
        return;
    for (unsigned flags = 0; flags <= KVS_REVIVE_IN_PLACE; flags += KVS_REVIVE_IN_PLACE) {
        revive_rest(s, id, 150000, 50000, flags);
        revive_rest(s, id, 0, 200000, flags);
    }
}

/* kvs_seq_table reads the table through the session's ring, and through
 * gRPC when it would not fit the ring's data area: a 1 MiB ring holds a
 * 100,000-token sequence's segments (2 x 25,000) but not its positions
 * too; both answers are the sequence's table. */
static void test_table_beyond_the_ring(const char *exe)
{
    daemon_proc d = {0};
    if (daemon_start_sized(exe, &d, "64", "1") != 0) {
        CHECK(0, "cannot start kvstashd with --ring-mb 1");
        daemon_stop(&d);
        return;
    }
    kvs_session *s = attach(d.sock, "big");
    uint64_t id;
    int rc = s != NULL ? kvs_seq_create(s, "full", NULL, 0, NULL, &id) : KVS_ERR_INVALID;
    for (int i = 0; rc == KVS_OK && i < 2; i++) {
        kvs_table w;
        rc = kvs_seq_append(s, id, 50000, &w);
        kvs_table_free(&w);
    }
    kvs_table ring = {0}, rpc = {0};
    if (rc == KVS_OK)
        rc = kvs_seq_table(s, id, 0, &ring);
    if (rc == KVS_OK)
        rc = kvs_seq_table(s, id, 1, &rpc);
    CHECK_RC(rc, KVS_OK, s);
    for (uint32_t l = 0; rc == KVS_OK && l < ring.layers; l++) {
        CHECK(ring.layer[l].tokens == 100000 && ring.layer[l].nsegments == 25000,
              "layer %u: %u tokens in %zu segments", l, ring.layer[l].tokens,
              ring.layer[l].nsegments);
        CHECK(ring.layer[l].positions == NULL, "layer %u has positions unasked", l);
        CHECK(same_segments(&ring, &rpc, l), "layer %u: the two tables differ", l);
        uint32_t bad = 0;
        for (uint32_t i = 0; i < rpc.layer[l].tokens; i++)
            bad += rpc.layer[l].positions[i] != i;
        CHECK(bad == 0, "layer %u: %u positions wrong", l, bad);
    }
    kvs_table_free(&ring);
    kvs_table_free(&rpc);
    if (rc == KVS_OK)
        revive_beyond_the_ring(s, id);
    if (s != NULL)
        CHECK_RC(kvs_session_detach(s), KVS_OK, (kvs_session *)NULL);
    daemon_stop(&d);
}

/* Whether the table kept by kvs_table_extend and kvs_table_cut is the
 * daemon's: epoch, segments (tiers included) and positions. */
static int table_is_daemons(kvs_session *s, uint64_t id, const kvs_table *held, const char *what,
                            int step)
{
    kvs_table t;
    int rc = kvs_seq_table(s, id, 1, &t);
    CHECK_RC(rc, KVS_OK, s);
    if (rc != KVS_OK)
        return 0;
    int same = t.epoch == held->epoch && t.layers == held->layers && t.heads == held->heads;
    uint32_t i = 0;
    for (; same && i < t.layers; i++) {
        const kvs_layer *a = &t.layer[i], *b = &held->layer[i];
        same = a->tokens == b->tokens && a->nsegments == b->nsegments &&
               (a->nsegments == 0 ||
                memcmp(a->segments, b->segments, a->nsegments * sizeof *a->segments) == 0) &&
               (a->tokens == 0 ||
                memcmp(a->positions, b->positions, a->tokens * sizeof *a->positions) == 0);
    }
    CHECK(same,
          "%s, step %d: the table kept by cuts is not the daemon's (epoch %" PRIu64 " / %" PRIu64
          ", list %u: %u / %u tokens)",
          what, step, held->epoch, t.epoch, i ? i - 1 : 0,
          held->layers ? held->layer[i ? i - 1 : 0].tokens : 0,
          t.layers ? t.layer[i ? i - 1 : 0].tokens : 0);
    kvs_table_free(&t);
    return same;
}

/* Read the table again into *held. */
static int table_reread(kvs_session *s, uint64_t id, kvs_table *held)
{
    kvs_table_free(held);
    int rc = kvs_seq_table(s, id, 1, held);
    CHECK_RC(rc, KVS_OK, s);
    return rc;
}

/* Statistics for every list of `held`: one row a list (score), or one a
 * query head of its KV head's list (last_attn); pseudo-random, so that
 * the policy evicts all over the lists. */
static void cut_case_stats(const kvs_table *held, int per_query, uint32_t *tokens, float *rows,
                           const float **ptrs, uint32_t *seed)
{
    uint32_t q = geom.q_heads, group = q / geom.kv_heads;
    uint32_t nrows = per_query ? geom.layers * q : held->layers;
    for (uint32_t i = 0; i < held->layers; i++)
        tokens[i] = held->layer[i].tokens;
    for (uint32_t r = 0; r < nrows; r++) {
        uint32_t list =
            per_query ? (r / q) * held->heads + (held->heads > 1 ? (r % q) / group : 0) : r;
        ptrs[r] = rows + (size_t)r * 1024;
        for (uint32_t t = 0; t < tokens[list]; t++) {
            *seed = *seed * 1664525u + 1013904223u;
            rows[(size_t)r * 1024 + t] = (float)(*seed >> 8) / (float)(1u << 24);
        }
    }
}

/*
 * A worker keeps its table current without reading it again: prefill
 * chunks and decode steps of `policy`, each append added with
 * kvs_table_extend and each step's cuts applied with kvs_table_cut (or the
 * table read again when the answer has none), and after every step the
 * kept table must equal the daemon's. want_cuts: the least number of
 * steps answered with cuts (h2o and weightedkv evict from the middle of
 * the lists: segments split and go; streaming from the front); want_reads
 * of steps whose answer sends the worker to read the table; demotes: of
 * demotions published after a step's answer (a policy that demotes: the
 * worker then learns the new epoch from its next call, here kvs_seq_epoch).
 */
static void test_cuts_case(kvs_session *s, const char *policy, const kvs_param *p, size_t np,
                           int per_query, int want_cuts, int want_reads, int demotes)
{
    uint64_t id;
    int rc = kvs_seq_create(s, policy, p, np, "cuts", &id);
    CHECK_RC(rc, KVS_OK, s);
    kvs_table held = {0};
    if (rc != KVS_OK || table_reread(s, id, &held) != KVS_OK)
        return;
    uint32_t tokens[16], seed = 7;
    const float *ptrs[16];
    float *rows = malloc(16 * 1024 * sizeof *rows);
    int cuts = 0, reads = 0, demotions = 0, f0 = failures;
    for (int step = 0; step < 240 && failures == f0; step++) {
        int prefill = step < 6;
        uint32_t count = prefill ? 64 : 1;
        kvs_table w;
        rc = kvs_seq_append(s, id, count, &w);
        CHECK_RC(rc, KVS_OK, s);
        if (rc != KVS_OK)
            break;
        uint64_t was = held.epoch;
        rc = kvs_table_extend(&held, &w);
        CHECK(rc == KVS_OK || (rc == KVS_ERR_PRECONDITION && w.evicted > 0), "%s: extend: %d",
              policy, rc);
        /* A demotion published after the last step's answer came with the
         * append's answer, as the runs it moved, applied before the writes. */
        demotions += rc == KVS_OK && w.epoch != was + 1;
        kvs_table_free(&w);
        if (rc != KVS_OK && table_reread(s, id, &held) != KVS_OK)
            break;
        if (demotes)
            table_is_daemons(s, id, &held, policy, step);
        cut_case_stats(&held, per_query, tokens, rows, ptrs, &seed);
        kvs_step st = {.new_tokens = count,
                       .prefill = prefill,
                       .heads = held.heads,
                       .tokens = tokens,
                       .score = per_query ? NULL : ptrs,
                       .score_queries = 1,
                       .last_attn = per_query ? ptrs : NULL,
                       .confidence = -1};
        kvs_step_result res;
        rc = kvs_seq_step(s, id, &st, &res);
        CHECK_RC(rc, KVS_OK, s);
        if (rc != KVS_OK)
            break;
        if (res.cut_lists > 0) {
            cuts++;
            CHECK(res.cut_epoch == held.epoch,
                  "%s: cuts of epoch %" PRIu64 ", the table's %" PRIu64, policy, res.cut_epoch,
                  held.epoch);
            rc = kvs_table_cut(&held, &res);
            CHECK(rc == KVS_OK, "%s, step %d: kvs_table_cut: %d", policy, step, rc);
            /* Cuts apply once: the table is of their answer's epoch now. */
            CHECK(kvs_table_cut(&held, &res) ==
                      (res.epoch == res.cut_epoch ? KVS_OK : KVS_ERR_PRECONDITION),
                  "%s: cuts applied twice", policy);
        } else if (res.epoch != held.epoch) {
            reads++;
            if (table_reread(s, id, &held) != KVS_OK)
                break;
        }
        /* A demotion the step left due is published after its answer, at
         * the next epoch: the table is the daemon's again after the next
         * append (above). */
        if (!demotes)
            table_is_daemons(s, id, &held, policy, step);
    }
    CHECK(cuts >= want_cuts && reads >= want_reads && demotions >= demotes,
          "%s: %d steps answered with cuts (want >= %d), %d table reads (want >= %d), %d "
          "demotions published after a step and applied from an append's answer (want >= %d)",
          policy, cuts, want_cuts, reads, want_reads, demotions, demotes);
    printf("%s: %d steps cut, %d read the table, %d demotions after the step\n", policy, cuts,
           reads, demotions);
    free(rows);
    kvs_table_free(&held);
    CHECK_RC(kvs_seq_release(s, id), KVS_OK, s);
}

static void test_cuts(kvs_session *s)
{
    const kvs_param h2o[] = {{"budget", "300"}, {"recent", "10"}, {"sinks", "3"}};
    test_cuts_case(s, "h2o", h2o, 3, 0, 200, 0, 0);
    const kvs_param streaming[] = {{"n_sink", "5"}, {"window", "250"}};
    test_cuts_case(s, "streaming", streaming, 2, 0, 200, 0, 0);
    const kvs_param wkv[] = {
        {"cache_size", "150"}, {"n_init", "4"}, {"n_recent", "40"}, {"merge", "0"}};
    test_cuts_case(s, "weightedkv", wkv, 4, 1, 200, 0, 0);
    /* Demoted tokens: a decode step that keeps every token in its tier and
     * evicts some is answered with cuts, INT8 segments split and gone as
     * full-precision ones; a step that changes tiers (the prefill's
     * demotion) has none; a demotion a step only left due is published
     * after its answer. */
    const kvs_param demoting[] = {{"budget", "300"}, {"int8", "on"}, {"int8_window", "16"}};
    test_cuts_case(s, "h2o", demoting, 3, 0, 200, 1, 20);
}

/* Whether two tables hold the same lists: tokens, segments' tiers and
 * counts, positions (their blocks differ: two sequences). */
static int same_lists(const kvs_table *a, const kvs_table *b)
{
    if (a->layers != b->layers || a->heads != b->heads)
        return 0;
    for (uint32_t i = 0; i < a->layers; i++) {
        const kvs_layer *x = &a->layer[i], *y = &b->layer[i];
        if (x->tokens != y->tokens || x->nsegments != y->nsegments ||
            (x->tokens > 0 && memcmp(x->positions, y->positions, x->tokens * sizeof(uint32_t))))
            return 0;
        for (size_t g = 0; g < x->nsegments; g++)
            if (x->segments[g].count != y->segments[g].count ||
                x->segments[g].tier != y->segments[g].tier)
                return 0;
    }
    return 1;
}

/*
 * A step whose statistics the worker wrote into the ring itself
 * (kvs_step_in_ring) decides as one whose statistics kvs_seq_step copied
 * there: sessions `copy` and `ring` step a sequence each of `policy` with
 * the same values, one way each, and after every step their lists are the
 * same. per_query: last_attn (one row a query head) instead of score.
 */
static void test_step_in_ring_case(kvs_session *copy, kvs_session *ring, const char *policy,
                                   const kvs_param *p, size_t np, int per_query)
{
    kvs_session *s[2] = {copy, ring};
    uint64_t id[2];
    for (int i = 0; i < 2; i++)
        CHECK_RC(kvs_seq_create(s[i], policy, p, np, "in-ring", &id[i]), KVS_OK, s[i]);
    uint32_t tokens[16], seed = 11, q = geom.q_heads, group = q / geom.kv_heads;
    const float *ptrs[16];
    float *rows = malloc(16 * 1024 * sizeof *rows);
    int f0 = failures, evicted = 0;
    for (int step = 0; step < 120 && failures == f0; step++) {
        int prefill = step < 4;
        uint32_t count = prefill ? 64 : 1;
        kvs_table w, held[2] = {{0}, {0}};
        for (int i = 0; i < 2; i++) {
            CHECK_RC(kvs_seq_append(s[i], id[i], count, &w), KVS_OK, s[i]);
            kvs_table_free(&w);
        }
        if (table_reread(copy, id[0], &held[0]) != KVS_OK)
            break;
        cut_case_stats(&held[0], per_query, tokens, rows, ptrs, &seed);
        kvs_step_rows in;
        int rc = kvs_step_in_ring(ring, held[0].heads, tokens,
                                  per_query ? KVS_STEP_LAST_ATTN : KVS_STEP_SCORE, &in);
        CHECK_RC(rc, KVS_OK, ring);
        if (rc != KVS_OK) {
            kvs_table_free(&held[0]);
            break;
        }
        float **dst = per_query ? in.last_attn : in.score;
        uint32_t nrows = per_query ? geom.layers * q : held[0].layers;
        for (uint32_t r = 0; r < nrows; r++) {
            uint32_t list =
                per_query ? (r / q) * held[0].heads + (held[0].heads > 1 ? (r % q) / group : 0) : r;
            memcpy(dst[r], ptrs[r], tokens[list] * sizeof(float));
        }
        kvs_step st = {.new_tokens = count,
                       .prefill = prefill,
                       .heads = held[0].heads,
                       .tokens = tokens,
                       .score_queries = 1,
                       .confidence = -1};
        kvs_step_result res[2];
        for (int i = 0; i < 2; i++) {
            const float *const *arr = i == 0 ? ptrs : (const float *const *)dst;
            st.score = per_query ? NULL : arr;
            st.last_attn = per_query ? arr : NULL;
            CHECK_RC(kvs_seq_step(s[i], id[i], &st, &res[i]), KVS_OK, s[i]);
        }
        evicted += (int)res[0].evicted;
        CHECK(res[0].evicted == res[1].evicted, "%s, step %d: %u evicted copied, %u in the ring",
              policy, step, res[0].evicted, res[1].evicted);
        kvs_table_free(&held[0]);
        if (table_reread(copy, id[0], &held[0]) != KVS_OK)
            break;
        if (table_reread(ring, id[1], &held[1]) == KVS_OK) {
            CHECK(same_lists(&held[0], &held[1]),
                  "%s, step %d: the lists stepped from the ring differ from the copied ones",
                  policy, step);
            kvs_table_free(&held[1]);
        }
        kvs_table_free(&held[0]);
    }
    CHECK(evicted > 100, "%s: %d tokens evicted: the steps decided nothing", policy, evicted);
    free(rows);
    for (int i = 0; i < 2; i++)
        CHECK_RC(kvs_seq_release(s[i], id[i]), KVS_OK, s[i]);
}

/* kvs_step_in_ring's rows are laid out as proto/kvstash_step.h says, and
 * what it cannot lay out is refused, naming what to fix. */
static void test_step_in_ring(kvs_session *a, kvs_session *b)
{
    const uint32_t one[2] = {5, 7};
    kvs_step_rows r;
    int rc = kvs_step_in_ring(a, 1, one, KVS_STEP_SCORE | KVS_STEP_LAST_ATTN, &r);
    CHECK_RC(rc, KVS_OK, a);
    if (rc == KVS_OK) {
        float *base = r.score[0]; /* layer by layer: score, then last_attn per query head */
        CHECK(r.last_attn[0] == base + 5 && r.last_attn[1] == base + 10 &&
                  r.score[1] == base + 15 && r.last_attn[2] == base + 22 &&
                  r.last_attn[3] == base + 29 && r.window_attn == NULL && r.vnorm == NULL,
              "rows at %td %td %td %td %td", r.last_attn[0] - base, r.last_attn[1] - base,
              r.score[1] - base, r.last_attn[2] - base, r.last_attn[3] - base);
    }
    const uint32_t per_head[4] = {5, 6, 7, 8}; /* layer 0: lists 5, 6; layer 1: 7, 8 */
    rc = kvs_step_in_ring(a, geom.kv_heads, per_head, KVS_STEP_WINDOW_ATTN | KVS_STEP_VNORM, &r);
    CHECK_RC(rc, KVS_OK, a);
    if (rc == KVS_OK) {
        float *base = r.window_attn[0];
        CHECK(r.window_attn[1] == base + 5 && r.vnorm[0] == base + 11 && r.vnorm[1] == base + 16 &&
                  r.window_attn[2] == base + 22 && r.vnorm[3] == base + 22 + 15 + 7 &&
                  r.score == NULL && r.last_attn == NULL,
              "per-head rows at %td %td %td %td %td", r.window_attn[1] - base, r.vnorm[0] - base,
              r.vnorm[1] - base, r.window_attn[2] - base, r.vnorm[3] - base);
    }
    const uint32_t huge[2] = {3u << 20, 3u << 20}; /* 24 MiB of floats: the ring has 8 */
    CHECK_RC(kvs_step_in_ring(a, 1, huge, KVS_STEP_SCORE, &r), KVS_ERR_INVALID, a);
    CHECK(strstr(kvs_session_error(a), "--ring-mb") != NULL, "%s", kvs_session_error(a));
    CHECK_RC(kvs_step_in_ring(a, 1, NULL, KVS_STEP_SCORE, &r), KVS_ERR_INVALID, a);
    CHECK_RC(kvs_step_in_ring(a, 3, one, KVS_STEP_SCORE, &r), KVS_ERR_INVALID, a);
    CHECK_RC(kvs_step_in_ring(a, 1, one, 0, &r), KVS_ERR_INVALID, a);
    CHECK_RC(kvs_step_in_ring(a, 1, one, 1u << 4, &r), KVS_ERR_INVALID, a);
    CHECK_RC(kvs_step_in_ring(a, 1, one, KVS_STEP_SCORE, NULL), KVS_ERR_INVALID, a);

    const kvs_param h2o[] = {{"budget", "100"}, {"recent", "10"}};
    test_step_in_ring_case(a, b, "h2o", h2o, 2, 0);
    const kvs_param wkv[] = {{"cache_size", "90"}, {"n_recent", "20"}, {"merge", "0"}};
    test_step_in_ring_case(a, b, "weightedkv", wkv, 3, 1);
}

static void test_shutdown(const char *exe)
{
    daemon_proc d = {0};
    if (daemon_start(exe, &d) != 0) {
        CHECK(0, "cannot start a second kvstashd");
        daemon_stop(&d);
        return;
    }
    kvs_session *s = attach(d.sock, "doomed");
    kill(d.pid, SIGTERM);
    waitpid(d.pid, NULL, 0);
    d.pid = 0;
    if (s != NULL) {
        uint64_t id;
        int rc = kvs_seq_create(s, "full", NULL, 0, NULL, &id);
        CHECK_RC(rc, KVS_ERR_UNAVAILABLE, s);
        double t0 = now_s();
        rc = kvs_session_detach(s);
        CHECK(rc == KVS_ERR_UNAVAILABLE, "detach: %d", rc);
        CHECK(now_s() - t0 < 3, "detach took %.2f s", now_s() - t0);
    }
    daemon_stop(&d);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_libkvstash /path/to/kvstashd\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    test_no_daemon();
    daemon_proc d = {0};
    if (daemon_start(argv[1], &d) != 0) {
        printf("FAIL: cannot start %s\n", argv[1]);
        daemon_stop(&d);
        return 1;
    }
    kvs_session *a = attach(d.sock, "a"), *b = attach(d.sock, "b");
    if (a != NULL && b != NULL) {
        test_layout(a);
        test_errors(d.sock, a, b);
        test_shared_pool(a, b);
        test_epochs(d.sock, a);
        test_revive_in_place(d.sock, a);
        test_events(d.sock);
        test_cuts(a);
        test_step_in_ring(a, b);
        test_deadline(&d, a);
    }
    if (a != NULL)
        CHECK_RC(kvs_session_detach(a), KVS_OK, (kvs_session *)NULL);
    if (b != NULL)
        CHECK_RC(kvs_session_detach(b), KVS_OK, (kvs_session *)NULL);
    daemon_stop(&d);
    test_table_beyond_the_ring(argv[1]);
    test_shutdown(argv[1]);
    printf("%s: %d checks, %d failed\n", failures ? "FAILED" : "ok", checks, failures);
    return failures ? 1 : 0;
}
