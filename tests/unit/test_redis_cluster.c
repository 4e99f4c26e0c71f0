/*
 * Tests of daemon/redis_cluster.h against a real Redis Cluster: 3 masters
 * with a replica each, started by tests/remote/cluster.py (its path in
 * KVSTASH_CLUSTER_PY) in the group setup and stopped in its teardown (and
 * by the fixture's watchdog if this process dies first).
 *
 * Cases, the destructive ones last: bad seeds and non-cluster nodes; a
 * fake node answering wrong shapes, errors and endless redirects; key
 * slots against CLUSTER KEYSLOT; put/get/del/ttl of 1,000 binary values
 * over every master, and from several threads; MOVED after a slot
 * migration; ASK in the middle of one; a node slower than the timeout
 * (DEBUG SLEEP); maxmemory (OOM); a master killed and its replica promoted.
 * Everything seeded; every wait bounded and polled.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "redis_cluster.h"

extern char **environ;

#define MAX_PORTS 16

static char g_py[PATH_MAX];    /* tests/remote/cluster.py */
static char g_dir[64];         /* the cluster's directory */
static int g_ports[MAX_PORTS]; /* every node, as started */
static int g_nports;
static remote_store *g_rs; /* one client for the whole group, timeout 2 s */

/* ---- helpers ---------------------------------------------------------------- */

/* Run `python3 cluster.py <args>`; its stdout and stderr in out. 0 when it
 * exits 0. */
static int fixture(char *out, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fixture(char *out, size_t len, const char *fmt, ...)
{
    char args[1024], cmd[PATH_MAX + 1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "python3 '%s' %s 2>&1", g_py, args);
    out[0] = '\0';
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        snprintf(out, len, "popen: %s", strerror(errno));
        return -1;
    }
    size_t n = 0;
    char buf[512];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, p)) > 0)
        for (size_t i = 0; i < got && n + 1 < len; i++)
            out[n++] = buf[i];
    out[n] = '\0';
    int rc = pclose(p);
    return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0 ? 0 : -1;
}

#define FIXTURE(out, ...)                                                                          \
    do {                                                                                           \
        if (fixture(out, sizeof out, __VA_ARGS__) != 0)                                            \
            fail_msg("cluster.py failed: %s", out);                                                \
    } while (0)

/* "PORTS a,b,c" in text into ports; returns the count. */
static int parse_ports(const char *text, int *ports, int max)
{
    const char *p = strstr(text, "PORTS ");
    if (p == NULL)
        return 0;
    p += 6;
    int n = 0;
    while (n < max && *p >= '0' && *p <= '9') {
        ports[n++] = (int)strtol(p, (char **)&p, 10);
        if (*p == ',')
            p++;
    }
    return n;
}

static int parse_port(const char *text)
{
    const char *p = strstr(text, "PORT ");
    return p != NULL ? atoi(p + 5) : 0;
}

/* One command to one node, outside the client under test; NULL when the
 * node does not answer. */
static redisReply *node_cmd_argv(int port, int argc, const char **argv, const size_t *lens)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c == NULL || c->err) {
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    redisReply *r = redisCommandArgv(c, argc, argv, lens);
    redisFree(c);
    return r;
}

static redisReply *node_cmd(int port, const char *fmt, ...)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c == NULL || c->err) {
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

/* The port of the master owning slot, as the first live node sees it. */
static int owner_of(unsigned slot)
{
    for (int i = 0; i < g_nports; i++) {
        redisReply *r = node_cmd(g_ports[i], "CLUSTER SLOTS");
        if (r == NULL)
            continue;
        int port = 0;
        for (size_t j = 0; r->type == REDIS_REPLY_ARRAY && j < r->elements; j++) {
            redisReply *e = r->element[j];
            if (e->element[0]->integer <= slot && slot <= (unsigned)e->element[1]->integer)
                port = (int)e->element[2]->element[1]->integer;
        }
        freeReplyObject(r);
        if (port != 0)
            return port;
    }
    fail_msg("no live node knows the owner of slot %u", slot);
    return 0;
}

static unsigned slot_of(const char *key)
{
    return redis_cluster_key_slot(key, strlen(key));
}

/* xorshift64*: every value of the test is from a seed. */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* len bytes of seeded content, with NULs in it. */
static void fill(unsigned char *p, size_t len, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < len; i++)
        p[i] = (i % 7 == 3) ? 0 : (unsigned char)(rng_next(&s) >> 56);
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static remote_health health(remote_store *rs)
{
    remote_health h;
    remote_health_get(rs, &h);
    return h;
}

/* n keys "<prefix>%d" (each a malloc'd string) and values of `size` bytes
 * seeded by `seed`: the shape most cases need. */
typedef struct kvset {
    size_t n;
    char **keys;
    unsigned char **vals;
    size_t *lens;
    remote_kv *kv;
} kvset;

static kvset kvset_make(const char *prefix, size_t n, size_t size, uint64_t seed)
{
    kvset s = {n, calloc(n, sizeof(char *)), calloc(n, sizeof(unsigned char *)),
               calloc(n, sizeof(size_t)), calloc(n, sizeof(remote_kv))};
    assert_non_null(s.keys);
    assert_non_null(s.vals);
    assert_non_null(s.lens);
    assert_non_null(s.kv);
    for (size_t i = 0; i < n; i++) {
        char k[128];
        snprintf(k, sizeof k, "%s%zu", prefix, i);
        s.keys[i] = strdup(k);
        s.lens[i] = size;
        s.vals[i] = malloc(size ? size : 1);
        assert_non_null(s.keys[i]);
        assert_non_null(s.vals[i]);
        fill(s.vals[i], size, seed + i);
        s.kv[i] = (remote_kv){s.keys[i], s.vals[i], size};
    }
    return s;
}

static void kvset_free(kvset *s)
{
    for (size_t i = 0; i < s->n; i++) {
        free(s->keys[i]);
        free(s->vals[i]);
    }
    free(s->keys);
    free(s->vals);
    free(s->lens);
    free(s->kv);
    *s = (kvset){0};
}

/* Read every key of s through rs and compare bytes. */
static void check_all(remote_store *rs, const kvset *s)
{
    remote_buf *out = calloc(s->n, sizeof *out);
    assert_non_null(out);
    status st;
    status_code code = remote_get(rs, (const char *const *)s->keys, s->n, out, &st);
    if (code != ST_OK)
        fail_msg("get of %zu keys: %s %s", s->n, status_name(code), st.msg);
    for (size_t i = 0; i < s->n; i++) {
        if (!out[i].found)
            fail_msg("key %s not found", s->keys[i]);
        assert_int_equal(out[i].len, s->lens[i]);
        assert_memory_equal(out[i].data, s->vals[i], s->lens[i]);
    }
    remote_bufs_free(out, s->n);
    free(out);
}

static void put_ok(remote_store *rs, const remote_kv *kv, size_t n, uint32_t ttl)
{
    status st;
    status_code code = remote_put(rs, kv, n, ttl, &st);
    if (code != ST_OK)
        fail_msg("put of %zu keys: %s %s", n, status_name(code), st.msg);
}

/* Another master than `port`. */
static int other_master(int port)
{
    char out[512];
    int ms[MAX_PORTS];
    FIXTURE(out, "masters %s", g_dir);
    int n = parse_ports(out, ms, MAX_PORTS);
    for (int i = 0; i < n; i++)
        if (ms[i] != port)
            return ms[i];
    fail_msg("no master but %d: %s", port, out);
    return 0;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* ---- group setup ---------------------------------------------------------- */

static int group_teardown(void **state);

static int group_setup(void **state)
{
    (void)state;
    const char *py = getenv("KVSTASH_CLUSTER_PY");
    if (py == NULL || py[0] == '\0') {
        print_error("KVSTASH_CLUSTER_PY is not set: run this test through ctest "
                    "(tests/CMakeLists.txt sets it to tests/remote/cluster.py)\n");
        return -1;
    }
    snprintf(g_py, sizeof g_py, "%s", py);
    if (system("command -v redis-server >/dev/null 2>&1 && "
               "command -v redis-cli >/dev/null 2>&1") != 0) {
        print_error("redis-server or redis-cli is not installed: run ops/setup.sh "
                    "(it installs redis-server and redis-tools)\n");
        return -1;
    }
    snprintf(g_dir, sizeof g_dir, "/tmp/kvstash-rc-XXXXXX");
    if (mkdtemp(g_dir) == NULL) {
        print_error("mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    /* cmocka skips the group teardown when this fails: clean up here. */
    char out[4096];
    if (fixture(out, sizeof out, "start %s --masters 3 --replicas 1 --owner %d", g_dir,
                (int)getpid()) != 0) {
        print_error("cluster.py start failed: %s\n", out);
        group_teardown(state);
        return -1;
    }
    g_nports = parse_ports(out, g_ports, MAX_PORTS);
    if (g_nports != 6) {
        print_error("cluster.py start: expected 6 ports: %s\n", out);
        group_teardown(state);
        return -1;
    }
    char seeds[128];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d,127.0.0.1:%d", g_ports[0], g_ports[1]);
    status st;
    if (redis_cluster_open(seeds, 2000, &g_rs, &st) != ST_OK) {
        print_error("redis_cluster_open(%s): %s %s\n", seeds, status_name(st.code), st.msg);
        group_teardown(state);
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    remote_close(g_rs);
    g_rs = NULL;
    int rc = 0;
    if (g_dir[0] != '\0') {
        char out[4096];
        if (fixture(out, sizeof out, "stop %s", g_dir) != 0) {
            print_error("cluster.py stop: %s\n", out);
            rc = -1;
        }
        nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    return rc;
}

/* ---- 8. bad input --------------------------------------------------------- */

static void expect_open(const char *seeds, uint32_t timeout_ms, status_code want,
                        const char *msg_part)
{
    static remote_store sentinel;
    remote_store *rs = &sentinel; /* open must reset it to NULL */
    status st = {0};
    status_code code = redis_cluster_open(seeds, timeout_ms, &rs, &st);
    if (code != want)
        fail_msg("open(\"%s\"): %s %s, want %s", seeds, status_name(code), st.msg,
                 status_name(want));
    assert_int_equal(st.code, want);
    assert_null(rs);
    if (strstr(st.msg, msg_part) == NULL)
        fail_msg("open(\"%s\"): message \"%s\" lacks \"%s\"", seeds, st.msg, msg_part);
}

/* A port on 127.0.0.1 with nothing listening (bound and closed again). */
static int dead_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void test_bad_input(void **state)
{
    (void)state;
    expect_open("nohost", 500, ST_INVALID_ARGUMENT, "\"nohost\" has no port");
    expect_open("h:0", 500, ST_INVALID_ARGUMENT, "\"h:0\": the port must be");
    expect_open("127.0.0.1:notaport", 500, ST_INVALID_ARGUMENT, "\"127.0.0.1:notaport\"");
    expect_open("", 500, ST_INVALID_ARGUMENT, "no remote seeds");
    expect_open("127.0.0.1:7000,,127.0.0.1:7001", 500, ST_INVALID_ARGUMENT, "empty entry");
    expect_open(":7000", 500, ST_INVALID_ARGUMENT, "has no host");
    expect_open("127.0.0.1:65536", 500, ST_INVALID_ARGUMENT, "1..65535");
    expect_open("127.0.0.1:7000", 0, ST_INVALID_ARGUMENT, "timeout_ms");

    char seeds[128];
    int dead = dead_port();
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", dead);
    expect_open(seeds, 500, ST_UNAVAILABLE, seeds);

    char out[4096];
    FIXTURE(out, "plain %s", g_dir);
    int plain = parse_port(out);
    assert_true(plain > 0);
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", plain);
    expect_open(seeds, 500, ST_FAILED_PRECONDITION, "not in cluster mode");

    /* The first seed that answers: a dead one first is skipped. */
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d, 127.0.0.1:%d", dead, g_ports[2]);
    remote_store *rs = NULL;
    status st;
    assert_int_equal(redis_cluster_open(seeds, 500, &rs, &st), ST_OK);
    assert_string_equal(rs->ops->name, "redis-cluster");
    remote_health h = health(rs);
    assert_int_equal(h.slots_covered, REDIS_CLUSTER_SLOTS);
    assert_int_equal(h.nodes, 3);
    assert_int_equal(h.ok, 1);
    assert_int_equal(h.calls, 0);
    remote_close(rs);
}

/* ---- 1. key slots ----------------------------------------------------------- */

static void check_slot(const char *key, size_t len)
{
    const char *argv[3] = {"CLUSTER", "KEYSLOT", key};
    size_t lens[3] = {7, 7, len};
    redisReply *r = node_cmd_argv(g_ports[0], 3, argv, lens);
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_INTEGER);
    uint16_t mine = redis_cluster_key_slot(key, len);
    if ((long long)mine != r->integer)
        fail_msg("slot of \"%.*s\" (%zu bytes): %u here, %lld on the server", (int)len, key, len,
                 mine, r->integer);
    freeReplyObject(r);
}

static void test_key_slot(void **state)
{
    (void)state;
    /* Redis Cluster specification, Appendix A: CRC16("123456789") = 0x31C3. */
    assert_int_equal(redis_cluster_key_slot("123456789", 9), 0x31C3 % 16384);
    assert_int_equal(redis_cluster_key_slot("123456789", 9), 12739);
    assert_int_equal(slot_of("{user1000}.following"), slot_of("user1000"));
    assert_int_equal(slot_of("{user1000}.followers"), slot_of("{user1000}.following"));
    assert_int_not_equal(slot_of("foo{}{bar}"), slot_of("bar")); /* empty tag: whole key */
    static const char *fixed[] = {
        "123456789",
        "{user1000}.following",
        "{user1000}.followers",
        "foo{}{bar}",
        "{}{x}",
        "foo{{bar}}zap",
        "foo{bar}{zap}",
        "{",
        "}",
        "{}",
        "}{",
        "a{b",
        "a}b{c}",
        "{a}",
        "",
        "kvstash:seq:42:block:7",
        "\xff\xfe{\x01}",
    };
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
        check_slot(fixed[i], strlen(fixed[i]));
    check_slot("a\0b{c\0}", 7); /* NULs inside, and inside the tag */
    /* Seeded random keys over an alphabet heavy in braces, NULs and high bytes. */
    static const char alpha[] = "{}{}ab\0\xff\x80:xyz";
    uint64_t s = 0x5EED;
    for (int i = 0; i < 200; i++) {
        char key[48];
        size_t len = 1 + rng_next(&s) % 40;
        for (size_t j = 0; j < len; j++)
            key[j] = (rng_next(&s) & 1) ? alpha[rng_next(&s) % (sizeof alpha - 1)]
                                        : (char)(rng_next(&s) >> 56);
        check_slot(key, len);
    }
}

/* ---- 2. put, get, del, ttl -------------------------------------------------- */

static void test_put_get(void **state)
{
    (void)state;
    enum { N = 1000 };
    kvset s = kvset_make("pg:", N, 0, 0);
    uint64_t r = 42, total = 0;
    for (size_t i = 0; i < N; i++) { /* 0 bytes to 1 MiB: a few big, most small */
        size_t len = i == 1        ? 0
                     : i == 0      ? (size_t)1 << 20
                     : i % 97 == 0 ? 512 * 1024 + rng_next(&r) % (512 * 1024)
                     : i % 10 == 0 ? rng_next(&r) % (64 * 1024)
                                   : rng_next(&r) % 2048;
        free(s.vals[i]);
        s.vals[i] = malloc(len ? len : 1);
        assert_non_null(s.vals[i]);
        fill(s.vals[i], len, 1000 + i);
        s.lens[i] = len;
        s.kv[i] = (remote_kv){s.keys[i], s.vals[i], len};
        total += len;
    }
    remote_health h0 = health(g_rs);
    put_ok(g_rs, s.kv, N, 0);
    check_all(g_rs, &s);
    remote_health h = health(g_rs);
    assert_int_equal(h.bytes_written - h0.bytes_written, total);
    assert_int_equal(h.bytes_read - h0.bytes_read, total);
    assert_int_equal(h.calls - h0.calls, 2);
    assert_int_equal(h.errors, h0.errors);
    assert_int_equal(h.nodes, 3);
    assert_int_equal(h.nodes_up, 3);
    assert_int_equal(h.slots_covered, REDIS_CLUSTER_SLOTS);
    assert_int_equal(h.ok, 1);

    /* Spread over all masters, and each key on its slot's master. */
    char out[512];
    int ms[MAX_PORTS];
    FIXTURE(out, "masters %s", g_dir);
    int nm = parse_ports(out, ms, MAX_PORTS);
    assert_int_equal(nm, 3);
    long long keys = 0;
    for (int i = 0; i < nm; i++) {
        redisReply *rr = node_cmd(ms[i], "DBSIZE");
        assert_non_null(rr);
        assert_true(rr->integer > 100);
        keys += rr->integer;
        freeReplyObject(rr);
    }
    assert_true(keys >= N);
    redisReply *rr = node_cmd(owner_of(slot_of("pg:7")), "STRLEN pg:7");
    assert_non_null(rr);
    assert_int_equal(rr->integer, s.lens[7]);
    freeReplyObject(rr);

    /* A missing key among found ones. */
    const char *mixed[3] = {"pg:5", "pg:missing", "pg:0"};
    remote_buf b[3];
    status st;
    assert_int_equal(remote_get(g_rs, mixed, 3, b, &st), ST_OK);
    assert_int_equal(b[0].found, 1);
    assert_int_equal(b[1].found, 0);
    assert_null(b[1].data);
    assert_int_equal(b[2].found, 1);
    assert_int_equal(b[2].len, (size_t)1 << 20);
    assert_memory_equal(b[2].data, s.vals[0], s.lens[0]);
    remote_bufs_free(b, 3);
    /* The empty value is found, with 0 bytes. */
    const char *empty[1] = {"pg:1"};
    assert_int_equal(remote_get(g_rs, empty, 1, b, &st), ST_OK);
    assert_int_equal(b[0].found, 1);
    assert_int_equal(b[0].len, 0);
    remote_bufs_free(b, 1);

    /* del the even keys: they are gone, the odd ones stay. */
    const char **even = calloc(N / 2, sizeof *even);
    assert_non_null(even);
    for (size_t i = 0; i < N / 2; i++)
        even[i] = s.keys[2 * i];
    assert_int_equal(remote_del(g_rs, even, N / 2, &st), ST_OK);
    assert_int_equal(remote_del(g_rs, even, N / 2, &st), ST_OK); /* missing: fine */
    remote_buf *all = calloc(N, sizeof *all);
    assert_non_null(all);
    assert_int_equal(remote_get(g_rs, (const char *const *)s.keys, N, all, &st), ST_OK);
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(all[i].found, i % 2);
        if (i % 2)
            assert_memory_equal(all[i].data, s.vals[i], s.lens[i]);
    }
    remote_bufs_free(all, N);
    free(all);
    free(even);
    assert_int_equal(remote_del(g_rs, (const char *const *)s.keys, N, &st), ST_OK);
    kvset_free(&s);

    /* ttl: EX 1 on the server, gone after it; ttl 0: no expiry. */
    kvset t = kvset_make("ttl:", 3, 100, 7);
    put_ok(g_rs, t.kv, 3, 1);
    put_ok(g_rs, t.kv + 2, 1, 0); /* the third again, without ttl */
    rr = node_cmd(owner_of(slot_of("ttl:0")), "PTTL ttl:0");
    assert_non_null(rr);
    assert_true(rr->integer > 0 && rr->integer <= 1000);
    freeReplyObject(rr);
    rr = node_cmd(owner_of(slot_of("ttl:2")), "PTTL ttl:2");
    assert_non_null(rr);
    assert_int_equal(rr->integer, -1);
    freeReplyObject(rr);
    check_all(g_rs, &t);
    sleep_ms(1100);
    int gone = 0;
    for (int i = 0; i < 40 && !gone; i++) { /* expiry is at most a few ms late */
        assert_int_equal(remote_get(g_rs, (const char *const *)t.keys, 3, b, &st), ST_OK);
        gone = !b[0].found && !b[1].found;
        assert_int_equal(b[2].found, 1);
        remote_bufs_free(b, 3);
        if (!gone)
            sleep_ms(50);
    }
    assert_true(gone);
    assert_int_equal(remote_del(g_rs, (const char *const *)t.keys, 3, &st), ST_OK);
    kvset_free(&t);
    assert_int_equal(remote_put(g_rs, NULL, 0, 0, &st), ST_OK); /* nothing: fine */
    assert_int_equal(remote_ping(g_rs, &st), ST_OK);
    h = health(g_rs);
    assert_int_equal(h.nodes_up, 3);
    assert_int_equal(h.ok, 1);
    remote_kv bad = {NULL, "x", 1};
    assert_int_equal(remote_put(g_rs, &bad, 1, 0, &st), ST_INVALID_ARGUMENT);
}

/* Several threads on one store: the mutex serialises them (TSan checks). */
typedef struct worker_arg {
    int id;
    int failures;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *a = p;
    for (int it = 0; it < 20; it++) {
        char key[32];
        unsigned char val[300], got_ok = 0;
        snprintf(key, sizeof key, "thr:%d:%d", a->id, it);
        fill(val, sizeof val, (uint64_t)a->id * 100 + (uint64_t)it);
        remote_kv kv = {key, val, sizeof val};
        status st;
        const char *keys[1] = {key};
        remote_buf b;
        if (remote_put(g_rs, &kv, 1, 0, &st) == ST_OK &&
            remote_get(g_rs, keys, 1, &b, &st) == ST_OK) {
            got_ok = b.found && b.len == sizeof val && memcmp(b.data, val, sizeof val) == 0;
            remote_bufs_free(&b, 1);
        }
        remote_del(g_rs, keys, 1, &st);
        remote_health h;
        remote_health_get(g_rs, &h);
        a->failures += !got_ok;
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    enum { T = 4 };
    pthread_t th[T];
    worker_arg args[T];
    for (int i = 0; i < T; i++) {
        args[i] = (worker_arg){i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].failures, 0);
    }
}

/* ---- 3. MOVED ----------------------------------------------------------------- */

static void test_moved(void **state)
{
    (void)state;
    kvset s = kvset_make("{moved}k", 20, 5000, 300);
    unsigned slot = slot_of("{moved}k0");
    put_ok(g_rs, s.kv, s.n, 0);
    int src = owner_of(slot), dst = other_master(src);
    char out[4096];
    FIXTURE(out, "migrate %s %u %d", g_dir, slot, dst);
    assert_int_equal(owner_of(slot), dst);

    remote_health h0 = health(g_rs);
    check_all(g_rs, &s); /* every key: MOVED from src, then dst */
    remote_health h1 = health(g_rs);
    assert_int_equal(h1.redirects - h0.redirects, s.n);
    assert_true(h1.refreshes > h0.refreshes);
    check_all(g_rs, &s); /* the map knows now: no more redirects */
    assert_int_equal(health(g_rs).redirects, h1.redirects);

    for (size_t i = 0; i < s.n; i++)
        fill(s.vals[i], s.lens[i], 400 + i);
    put_ok(g_rs, s.kv, s.n, 0);
    check_all(g_rs, &s);
    redisReply *r = node_cmd(dst, "CLUSTER COUNTKEYSINSLOT %u", slot);
    assert_non_null(r);
    assert_int_equal(r->integer, (long long)s.n);
    freeReplyObject(r);
    kvset_free(&s);
}

/* ---- 4. ASK ------------------------------------------------------------------- */

static void test_ask(void **state)
{
    (void)state;
    kvset s = kvset_make("{ask}k", 10, 3000, 500);
    unsigned slot = slot_of("{ask}k0");
    put_ok(g_rs, s.kv, s.n, 0);
    int src = owner_of(slot), dst = other_master(src);
    char out[4096];
    FIXTURE(out, "migrate-begin %s %u %d", g_dir, slot, dst);
    FIXTURE(out, "migrate-keys %s %u %d {ask}k0 {ask}k1 {ask}k2 {ask}k3 {ask}k4", g_dir, slot, dst);

    /* k0..k4 are on dst (src answers ASK), k5..k9 still on src. */
    remote_health h0 = health(g_rs);
    check_all(g_rs, &s);
    remote_health h1 = health(g_rs);
    assert_int_equal(h1.redirects - h0.redirects, 5);
    assert_int_equal(owner_of(slot), src); /* ASK does not move the slot */
    check_all(g_rs, &s);                   /* ASK again: the map did not change */
    assert_int_equal(health(g_rs).redirects - h1.redirects, 5);

    /* A new key of the migrating slot goes to dst (src: ASK). */
    unsigned char v[64];
    fill(v, sizeof v, 99);
    remote_kv nk = {"{ask}new", v, sizeof v};
    put_ok(g_rs, &nk, 1, 0);
    redisReply *r = node_cmd(dst, "CLUSTER COUNTKEYSINSLOT %u", slot);
    assert_non_null(r);
    assert_int_equal(r->integer, 6);
    freeReplyObject(r);

    FIXTURE(out, "migrate-finish %s %u %d", g_dir, slot, dst);
    assert_int_equal(owner_of(slot), dst);
    check_all(g_rs, &s);
    const char *keys[1] = {"{ask}new"};
    remote_buf b;
    status st;
    assert_int_equal(remote_get(g_rs, keys, 1, &b, &st), ST_OK);
    assert_int_equal(b.found, 1);
    assert_memory_equal(b.data, v, sizeof v);
    remote_bufs_free(&b, 1);
    kvset_free(&s);
}

/* ---- 7. a slow node --------------------------------------------------------- */

/* Whether the node on port does not answer PING within 100 ms. */
static int node_stalled(int port)
{
    struct timeval tv = {0, 100000};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c == NULL || c->err) {
        redisFree(c);
        return 0;
    }
    redisSetTimeout(c, tv);
    redisReply *r = redisCommand(c, "PING");
    int stalled = r == NULL;
    freeReplyObject(r);
    redisFree(c);
    return stalled;
}

static void set_no_failover(int master, const char *yes_no)
{
    char out[512];
    int rs[MAX_PORTS];
    FIXTURE(out, "replicas %s %d", g_dir, master);
    int n = parse_ports(out, rs, MAX_PORTS);
    for (int i = 0; i < n; i++) {
        redisReply *r = node_cmd(rs[i], "CONFIG SET cluster-replica-no-failover %s", yes_no);
        assert_non_null(r);
        assert_int_equal(r->type, REDIS_REPLY_STATUS);
        freeReplyObject(r);
    }
}

static pid_t g_sleeper;    /* redis-cli DEBUG SLEEP */
static int g_sleeper_port; /* the node it sleeps */

/* After test_slow_node, passed or not: the sleep over (redis-cli returns
 * then), the cluster ok again, failover allowed again. */
static int slow_node_recover(void **state)
{
    (void)state;
    int rc = 0;
    if (g_sleeper > 0) {
        int wst;
        rc |= waitpid(g_sleeper, &wst, 0) == g_sleeper ? 0 : -1;
        g_sleeper = 0;
    }
    if (g_sleeper_port > 0) {
        char out[4096];
        if (fixture(out, sizeof out, "wait-ok %s --timeout 20", g_dir) != 0) {
            print_error("cluster.py wait-ok: %s\n", out);
            rc = -1;
        }
        set_no_failover(g_sleeper_port, "no");
        g_sleeper_port = 0;
    }
    return rc;
}

static void test_slow_node(void **state)
{
    (void)state;
    kvset s = kvset_make("{slow}k", 1, 1000, 700);
    put_ok(g_rs, s.kv, 1, 0);
    int port = owner_of(slot_of("{slow}k0"));
    remote_store *rs = NULL;
    status st;
    char seeds[64];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", g_ports[0]);
    assert_int_equal(redis_cluster_open(seeds, 300, &rs, &st), ST_OK);
    check_all(rs, &s); /* connected to the node before it stalls */
    uint32_t up = health(rs).nodes_up;
    assert_true(up >= 1);

    /* Its replica must not take over while it sleeps (2 s > node timeout). */
    set_no_failover(port, "yes");
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    char *argv[] = {"redis-cli", "-p", port_s, "DEBUG", "SLEEP", "2", NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    g_sleeper_port = port;
    assert_int_equal(posix_spawnp(&g_sleeper, "redis-cli", &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    int stalled = 0;
    for (int i = 0; i < 40 && !(stalled = node_stalled(port)); i++)
        sleep_ms(10);
    assert_true(stalled);

    remote_buf b;
    const char *keys[1] = {s.keys[0]};
    status_code code = remote_get(rs, keys, 1, &b, &st);
    if (code != ST_DEADLINE_EXCEEDED)
        fail_msg("get on a sleeping node: %s %s", status_name(code), st.msg);
    assert_non_null(strstr(st.msg, port_s));
    assert_non_null(strstr(st.msg, "300 ms"));
    assert_int_equal(b.found, 0);
    assert_null(b.data);
    remote_health h = health(rs);
    assert_int_equal(h.timeouts, 1);
    assert_int_equal(h.errors, 1);
    assert_int_equal(h.ok, 0);
    assert_int_equal(h.nodes_up, up - 1); /* its connection was dropped */
    assert_non_null(strstr(h.last_error, port_s));

    assert_int_equal(slow_node_recover(NULL), 0);
    check_all(rs, &s);
    assert_int_equal(health(rs).ok, 1);
    remote_close(rs);
    kvset_free(&s);
}

/* ---- 6. maxmemory ------------------------------------------------------------- */

/* After test_maxmemory, passed or not. */
static int maxmemory_reset(void **state)
{
    (void)state;
    char out[4096];
    if (fixture(out, sizeof out, "maxmemory %s 0", g_dir) != 0) {
        print_error("cluster.py maxmemory: %s\n", out);
        return -1;
    }
    return 0;
}

static void test_maxmemory(void **state)
{
    (void)state;
    char out[4096];
    kvset s = kvset_make("oom:", 64, 64 * 1024, 900);
    FIXTURE(out, "maxmemory %s 1", g_dir);
    status st;
    status_code code = remote_put(g_rs, s.kv, s.n, 0, &st);
    assert_int_equal(maxmemory_reset(NULL), 0);
    if (code != ST_RESOURCE_EXHAUSTED)
        fail_msg("put over maxmemory: %s %s", status_name(code), st.msg);
    assert_non_null(strstr(st.msg, "maxmemory"));
    assert_non_null(strstr(st.msg, "remote tier full"));
    remote_health h = health(g_rs);
    assert_int_equal(h.ok, 0);
    assert_non_null(strstr(h.last_error, "maxmemory"));
    put_ok(g_rs, s.kv, s.n, 0);
    check_all(g_rs, &s);
    assert_int_equal(health(g_rs).ok, 1);
    assert_int_equal(remote_del(g_rs, (const char *const *)s.keys, s.n, &st), ST_OK);
    kvset_free(&s);
}

/* ---- 5. a master killed -------------------------------------------------------- */

static void test_node_kill(void **state)
{
    (void)state;
    char out[4096];
    kvset s = kvset_make("{kill}k", 50, 2000, 1100);
    unsigned slot = slot_of("{kill}k0");
    put_ok(g_rs, s.kv, s.n, 0);
    FIXTURE(out, "sync %s", g_dir); /* the replica has them */
    int dead = owner_of(slot);
    remote_health h0 = health(g_rs);
    remote_store *pinger = NULL; /* knows the map from before the kill */
    status st;
    char seeds[64];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", dead == g_ports[0] ? g_ports[1] : g_ports[0]);
    assert_int_equal(redis_cluster_open(seeds, 2000, &pinger, &st), ST_OK);
    assert_int_equal(remote_ping(pinger, &st), ST_OK);
    FIXTURE(out, "kill %s %d", g_dir, dead);
    FIXTURE(out, "wait-failover %s %d --timeout 30", g_dir, dead);
    int promoted = owner_of(slot);
    assert_int_not_equal(promoted, dead);

    check_all(g_rs, &s); /* the same client: a failed connection, a refresh */
    remote_health h1 = health(g_rs);
    assert_true(h1.refreshes > h0.refreshes);
    assert_int_equal(h1.nodes, 3);
    assert_int_equal(h1.slots_covered, REDIS_CLUSTER_SLOTS);
    assert_int_equal(h1.ok, 1);
    for (size_t i = 0; i < s.n; i++)
        fill(s.vals[i], s.lens[i], 1200 + i);
    put_ok(g_rs, s.kv, s.n, 0);
    check_all(g_rs, &s);
    redisReply *r = node_cmd(promoted, "CLUSTER COUNTKEYSINSLOT %u", slot);
    assert_non_null(r);
    assert_int_equal(r->integer, (long long)s.n);
    freeReplyObject(r);
    kvset_free(&s);

    /* ping: the dead master fails, the map is reloaded, the new one answers. */
    remote_health p0 = health(pinger);
    status_code code = remote_ping(pinger, &st);
    if (code != ST_OK)
        fail_msg("ping after the failover: %s %s", status_name(code), st.msg);
    remote_health p1 = health(pinger);
    assert_true(p1.refreshes > p0.refreshes);
    assert_int_equal(p1.nodes, 3);
    assert_int_equal(p1.nodes_up, 3);
    assert_int_equal(p1.ok, 1);
    remote_close(pinger);
}

/* ---- 9. a fake node: answers of the wrong shape, errors, loops ----------- */

/* A one-connection-at-a-time RESP server on 127.0.0.1 that claims every
 * slot and answers data commands by its mode: what a real cluster rarely
 * or never sends, so that each error path runs deterministically. */
typedef enum fake_mode {
    FAKE_SLOTS_SHORT,  /* CLUSTER SLOTS: a range without a node */
    FAKE_SLOTS_INT,    /* CLUSTER SLOTS: an integer */
    FAKE_WEIRD,        /* GET: an array; SET: an integer; DEL: a string */
    FAKE_GARBAGE,      /* not RESP at all */
    FAKE_CLUSTERDOWN,  /* -CLUSTERDOWN, always */
    FAKE_MOVED_LOOP,   /* -MOVED to itself, always */
    FAKE_ASK_LOOP,     /* -ASK to itself (empty host), always */
    FAKE_BAD_REDIRECT, /* -MOVED without an address */
    FAKE_EOF,          /* the connection closed at every data command */
    FAKE_ERR,          /* -ERR something odd */
    FAKE_OK,           /* GET: $-1; SET: +OK; DEL: :0 */
} fake_mode;

typedef struct fake_node {
    int lfd, port;
    pthread_t th;
    atomic_int mode, stop;
    atomic_int commands; /* GET, SET, DEL and ASKING received */
    atomic_int slots;    /* CLUSTER SLOTS received */
} fake_node;

static int fake_send(int fd, const char *text)
{
    size_t len = strlen(text), off = 0;
    while (off < len) {
        ssize_t w = send(fd, text + off, len - off, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        off += (size_t)w;
    }
    return 0;
}

/* One command at the front of buf[0..len): its argc (0: incomplete, -1:
 * not a command). */
static int fake_parse(const char *buf, size_t len, size_t *used, const char **argv, size_t *lens,
                      int max)
{
    const char *p = buf, *end = buf + len;
    if (p == end)
        return 0;
    if (*p != '*')
        return -1;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    if (nl == NULL)
        return 0;
    long argc = strtol(p + 1, NULL, 10);
    if (argc < 1 || argc > max)
        return -1;
    p = nl + 1;
    for (long i = 0; i < argc; i++) {
        if (p >= end)
            return 0;
        if (*p != '$')
            return -1;
        nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL)
            return 0;
        long n = strtol(p + 1, NULL, 10);
        if (n < 0 || end - (nl + 1) < n + 2)
            return n < 0 ? -1 : 0;
        argv[i] = nl + 1;
        lens[i] = (size_t)n;
        p = nl + 1 + n + 2;
    }
    *used = (size_t)(p - buf);
    return (int)argc;
}

static int arg_is(const char *a, size_t len, const char *word)
{
    return len == strlen(word) && strncasecmp(a, word, len) == 0;
}

/* The answer to one command; NULL: close the connection. */
static const char *fake_answer(fake_node *f, int argc, const char **argv, const size_t *lens,
                               char *out, size_t outlen)
{
    int mode = atomic_load(&f->mode);
    if (argc == 2 && arg_is(argv[0], lens[0], "CLUSTER") && arg_is(argv[1], lens[1], "SLOTS")) {
        atomic_fetch_add(&f->slots, 1);
        if (mode == FAKE_SLOTS_SHORT)
            return "*1\r\n*2\r\n:0\r\n:16383\r\n";
        if (mode == FAKE_SLOTS_INT)
            return ":5\r\n";
        snprintf(out, outlen,
                 "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$4\r\nfake\r\n",
                 f->port);
        return out;
    }
    if (arg_is(argv[0], lens[0], "PING"))
        return mode == FAKE_WEIRD ? ":1\r\n" : "+PONG\r\n";
    atomic_fetch_add(&f->commands, 1);
    if (arg_is(argv[0], lens[0], "ASKING"))
        return "+OK\r\n";
    unsigned slot = argc > 1 ? redis_cluster_key_slot(argv[1], lens[1]) : 0;
    int get = arg_is(argv[0], lens[0], "GET"), set = arg_is(argv[0], lens[0], "SET");
    switch (mode) {
    case FAKE_WEIRD:
        return get ? "*2\r\n:1\r\n$-1\r\n" : set ? ":1\r\n" : "$3\r\nabc\r\n";
    case FAKE_GARBAGE:
        return "!garbage\r\n";
    case FAKE_CLUSTERDOWN:
        return "-CLUSTERDOWN The cluster is down\r\n";
    case FAKE_MOVED_LOOP:
        snprintf(out, outlen, "-MOVED %u 127.0.0.1:%d\r\n", slot, f->port);
        return out;
    case FAKE_ASK_LOOP:
        snprintf(out, outlen, "-ASK %u :%d\r\n", slot, f->port);
        return out;
    case FAKE_BAD_REDIRECT:
        return "-MOVED 12\r\n";
    case FAKE_EOF:
        return NULL;
    case FAKE_ERR:
        return "-ERR something odd\r\n";
    default:
        return get ? "$-1\r\n" : set ? "+OK\r\n" : ":0\r\n";
    }
}

/* Serve one connection until it closes, the mode closes it, or stop. */
static void fake_serve(fake_node *f, int fd)
{
    static char buf[65536]; /* the fake's thread only */
    char out[256];
    size_t have = 0;
    while (!atomic_load(&f->stop)) {
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, 50) <= 0)
            continue;
        ssize_t r = recv(fd, buf + have, sizeof buf - have, 0);
        if (r <= 0)
            return;
        have += (size_t)r;
        for (;;) {
            const char *argv[8];
            size_t lens[8], used = 0;
            int argc = fake_parse(buf, have, &used, argv, lens, 8);
            if (argc < 0)
                return;
            if (argc == 0)
                break;
            const char *ans = fake_answer(f, argc, argv, lens, out, sizeof out);
            if (ans == NULL || fake_send(fd, ans) != 0)
                return;
            memmove(buf, buf + used, have - used);
            have -= used;
        }
        if (have == sizeof buf)
            return;
    }
}

static void *fake_main(void *p)
{
    fake_node *f = p;
    while (!atomic_load(&f->stop)) {
        struct pollfd pfd = {f->lfd, POLLIN, 0};
        if (poll(&pfd, 1, 50) <= 0)
            continue;
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        fake_serve(f, fd);
        close(fd);
    }
    return NULL;
}

static void fake_start(fake_node *f)
{
    memset(f, 0, sizeof *f);
    f->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(f->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(f->lfd, (struct sockaddr *)&a, &len), 0);
    assert_int_equal(listen(f->lfd, 8), 0);
    f->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
}

static void fake_stop(fake_node *f)
{
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
    close(f->lfd);
}

/* Open a store on the fake in `mode`, 200 ms timeout. */
static remote_store *fake_open(fake_node *f, fake_mode mode)
{
    atomic_store(&f->mode, mode);
    atomic_store(&f->commands, 0);
    atomic_store(&f->slots, 0);
    char seeds[64];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", f->port);
    remote_store *rs = NULL;
    status st;
    if (redis_cluster_open(seeds, 200, &rs, &st) != ST_OK)
        fail_msg("open on the fake node: %s %s", status_name(st.code), st.msg);
    return rs;
}

/* A get of 3 keys through a new store in `mode`: its code and message. */
static status_code fake_get(fake_node *f, fake_mode mode, status *st)
{
    remote_store *rs = fake_open(f, mode);
    const char *keys[3] = {"a", "{b}c", "d"};
    remote_buf b[3];
    status_code code = remote_get(rs, keys, 3, b, st);
    for (int i = 0; i < 3; i++) /* nothing left allocated on failure */
        assert_true(code == ST_OK || (b[i].data == NULL && b[i].found == 0));
    remote_bufs_free(b, 3);
    remote_close(rs);
    return code;
}

static void expect_code(status_code code, const status *st, status_code want, const char *part)
{
    if (code != want || strstr(st->msg, part) == NULL)
        fail_msg("got %s \"%s\", want %s with \"%s\"", status_name(code), st->msg,
                 status_name(want), part);
}

static void test_fake_node(void **state)
{
    (void)state;
    fake_node f;
    fake_start(&f);
    char seeds[64];
    snprintf(seeds, sizeof seeds, "127.0.0.1:%d", f.port);
    remote_store *rs = NULL;
    status st;

    atomic_store(&f.mode, FAKE_SLOTS_SHORT);
    expect_code(redis_cluster_open(seeds, 200, &rs, &st), &st, ST_INTERNAL, "malformed range");
    assert_null(rs);
    atomic_store(&f.mode, FAKE_SLOTS_INT);
    expect_code(redis_cluster_open(seeds, 200, &rs, &st), &st, ST_INTERNAL, "CLUSTER SLOTS");
    assert_null(rs);

    status_code code = fake_get(&f, FAKE_OK, &st); /* the fake works */
    assert_int_equal(code, ST_OK);
    code = fake_get(&f, FAKE_WEIRD, &st);
    expect_code(code, &st, ST_INTERNAL, "answered GET with a reply of type");
    code = fake_get(&f, FAKE_GARBAGE, &st);
    expect_code(code, &st, ST_INTERNAL, "malformed reply");
    code = fake_get(&f, FAKE_ERR, &st);
    expect_code(code, &st, ST_INTERNAL, "something odd");
    code = fake_get(&f, FAKE_BAD_REDIRECT, &st);
    expect_code(code, &st, ST_INTERNAL, "malformed redirect");

    code = fake_get(&f, FAKE_CLUSTERDOWN, &st); /* retried until the timeout */
    expect_code(code, &st, ST_UNAVAILABLE, "cluster down");
    assert_true(atomic_load(&f.commands) >= 6); /* 3 keys, at least twice */
    assert_true(atomic_load(&f.slots) >= 2);    /* and a refresh */

    code = fake_get(&f, FAKE_MOVED_LOOP, &st);
    expect_code(code, &st, ST_UNAVAILABLE, "redirects did not settle");
    assert_int_equal(atomic_load(&f.commands), 3 * (REDIS_CLUSTER_MAX_REDIRECTS + 1));
    code = fake_get(&f, FAKE_ASK_LOOP, &st); /* each: ASKING, GET */
    expect_code(code, &st, ST_UNAVAILABLE, "redirects did not settle");
    assert_int_equal(atomic_load(&f.commands), 3 + 3 * 2 * REDIS_CLUSTER_MAX_REDIRECTS);

    code = fake_get(&f, FAKE_EOF, &st); /* dropped, refreshed, retried once */
    expect_code(code, &st, ST_UNAVAILABLE, "after a topology refresh");
    assert_int_equal(atomic_load(&f.commands), 2);
    assert_true(atomic_load(&f.slots) >= 2);

    /* put and del see wrong shapes too; health counts the failures. */
    rs = fake_open(&f, FAKE_WEIRD);
    remote_kv kv = {"k", "v", 1};
    expect_code(remote_put(rs, &kv, 1, 5, &st), &st, ST_INTERNAL, "answered SET");
    const char *keys[1] = {"k"};
    expect_code(remote_del(rs, keys, 1, &st), &st, ST_INTERNAL, "answered DEL");
    remote_health h = health(rs);
    assert_int_equal(h.calls, 2);
    assert_int_equal(h.errors, 2);
    assert_int_equal(h.ok, 0);
    assert_int_equal(h.nodes, 1);
    assert_int_equal(h.slots_covered, REDIS_CLUSTER_SLOTS);
    assert_non_null(strstr(h.last_error, "answered DEL"));
    expect_code(remote_ping(rs, &st), &st, ST_UNAVAILABLE, "answered PING");
    atomic_store(&f.mode, FAKE_OK);
    assert_int_equal(remote_ping(rs, &st), ST_OK);
    assert_int_equal(health(rs).ok, 1);
    assert_int_equal(remote_put(rs, &kv, 1, 0, &st), ST_OK);
    assert_int_equal(health(rs).ok, 1);
    remote_close(rs);
    fake_stop(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_fake_node),
        cmocka_unit_test(test_key_slot),
        cmocka_unit_test(test_put_get),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_moved),
        cmocka_unit_test(test_ask),
        cmocka_unit_test_teardown(test_slow_node, slow_node_recover),
        cmocka_unit_test_teardown(test_maxmemory, maxmemory_reset),
        cmocka_unit_test(test_node_kill),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
