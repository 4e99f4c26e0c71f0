/*
 * Unit tests of the operator's side of the daemon: config.c (options, INI
 * files, --print-config round trip), metrics.c (addresses, hooks and the
 * exposition text) and store_operator.c (Evict on a store: what leaves the tables,
 * retired blocks, counts, and refusals that change nothing). No gRPC.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cmocka.h>

#include "config.h"
#include "metrics.h"
#include "store_operator.h"
#include "store.h"
#include "store_harness.h"

/* ---- config ---------------------------------------------------------------- */

static void test_config_set(void **state)
{
    (void)state;
    daemon_config c;
    char err[256];
    config_defaults(&c);
    assert_int_equal(c.pool_mb, 256);
    assert_int_equal(config_set(&c, "pool_mb", "12", err, sizeof err), 0);
    assert_int_equal(config_set(&c, "max-seqs", "7", err, sizeof err), 0);
    assert_int_equal(config_set(&c, "metrics_allow_remote", "yes", err, sizeof err), 0);
    assert_int_equal(config_set(&c, "metrics", "127.0.0.1:1", err, sizeof err), 0);
    assert_int_equal(config_set(&c, "listen", "off", err, sizeof err), 0);
    assert_int_equal(c.pool_mb, 12);
    assert_int_equal(c.max_seqs, 7);
    assert_int_equal(c.metrics_allow_remote, 1);
    assert_string_equal(c.metrics, "127.0.0.1:1");
    assert_string_equal(c.listen, "");
    assert_int_equal(config_set(&c, "pool_mb", "0", err, sizeof err), -1);
    assert_non_null(strstr(err, "pool-mb must be an integer in [1, 1048576]"));
    assert_int_equal(config_set(&c, "threads", "-1", err, sizeof err), -1);
    assert_int_equal(c.policy_threads, 2);
    assert_int_equal(config_set(&c, "policy_threads", "4", err, sizeof err), 0);
    assert_int_equal(c.policy_threads, 4);
    assert_int_equal(config_set(&c, "policy-threads", "0", err, sizeof err), -1);
    assert_non_null(strstr(err, "policy-threads must be an integer in [1, 64]"));
    assert_int_equal(config_set(&c, "policy-threads", "65", err, sizeof err), -1);
    assert_int_equal(c.policy_threads, 4);
    assert_string_equal(c.move_priority, "idle");
    assert_int_equal(config_move_priority(&c), BACKGROUND_IDLE);
    assert_int_equal(config_set(&c, "move_priority", "low", err, sizeof err), 0);
    assert_int_equal(config_move_priority(&c), BACKGROUND_LOW);
    assert_int_equal(config_set(&c, "move-priority", "nice", err, sizeof err), -1);
    assert_non_null(strstr(err, "move-priority must be idle, low or normal, got 'nice'"));
    assert_int_equal(config_move_priority(&c), BACKGROUND_LOW);
    assert_int_equal(config_set(&c, "move-priority", "normal", err, sizeof err), 0);
    assert_int_equal(config_move_priority(&c), BACKGROUND_NORMAL);
    assert_int_equal(config_set(&c, "log_level", "loud", err, sizeof err), -1);
    assert_int_equal(config_set(&c, "metrics_allow_remote", "maybe", err, sizeof err), -1);
    assert_int_equal(config_set(&c, "nope", "1", err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown option 'nope'"));
    assert_int_equal(c.pool_mb, 12); /* failures change nothing */
}

/* Text values that config_print could not write back as they are (the INI
 * reader trims blanks and control bytes, cuts " ;" comments and reads lines
 * of at most 200 bytes), and socket paths no sockaddr_un holds, are refused
 * (tests/fuzz/corpus/fuzz_config/regress-*: fuzz_config found them). */
static char *write_temp(const char *text);

static void test_config_text_that_cannot_round_trip(void **state)
{
    (void)state;
    daemon_config c;
    char err[256];
    config_defaults(&c);
    static const char *const bad[] = {"127.0.0.1:1\f",  " 127.0.0.1:1",  "127.0.0.1:1 ",
                                      "127.0.0.1:1 ;x", "127\n.0.0.1:1", "127.0.0.1:1\x7f",
                                      ";127.0.0.1:1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(config_set(&c, "metrics", bad[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "metrics must be printable text"));
        assert_int_equal(config_set(&c, "socket", bad[i], err, sizeof err), -1);
    }
    char path[128];
    memset(path, 'a', sizeof path - 1);
    path[0] = '/';
    path[100] = '\0'; /* 100 bytes: PATH.events still fits a sockaddr_un */
    assert_int_equal(config_set(&c, "socket", path, err, sizeof err), 0);
    path[100] = 'a';
    path[101] = '\0';
    assert_int_equal(config_set(&c, "socket", path, err, sizeof err), -1);
    assert_non_null(strstr(err, "socket is too long (at most 100 bytes)"));
    assert_int_equal(config_set(&c, "metrics", "127.0.0.1:1;x", err, sizeof err), 0);
    /* A config file line holds 200 bytes (inih): "tls_key = " and 188 of path. */
    char key_path[256];
    memset(key_path, 'k', sizeof key_path - 1);
    key_path[0] = '/';
    key_path[189] = '\0';
    assert_int_equal(config_set(&c, "tls-key", key_path, err, sizeof err), -1);
    assert_non_null(strstr(err, "tls-key is too long (at most 188 bytes)"));
    key_path[188] = '\0';
    assert_int_equal(config_set(&c, "tls-key", key_path, err, sizeof err), 0);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    config_print(&c, "test", f);
    fclose(f);
    char *conf = write_temp(text);
    free(text);
    daemon_config back;
    config_defaults(&back);
    assert_int_equal(config_load(&back, conf, err, sizeof err), 0);
    unlink(conf);
    assert_string_equal(back.tls_key, key_path);
}

static char *write_temp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvstash-test-conf.XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_config_file_round_trip(void **state)
{
    (void)state;
    daemon_config c, back;
    char err[256];
    config_defaults(&c);
    char *path = write_temp("; comment\n[kvstashd]\nsocket = /tmp/x/k.sock\npool-mb = 64\n"
                            "drain_ms = 250\nlog_level = debug\n");
    assert_int_equal(config_load(&c, path, err, sizeof err), 0);
    unlink(path);
    assert_string_equal(c.socket, "/tmp/x/k.sock");
    assert_int_equal(c.pool_mb, 64);
    assert_int_equal(c.drain_ms, 250);
    /* What --print-config writes reads back to the same configuration. */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    config_print(&c, "test", f);
    fclose(f);
    path = write_temp(text);
    free(text);
    config_defaults(&back);
    assert_int_equal(config_load(&back, path, err, sizeof err), 0);
    unlink(path);
    assert_memory_equal(&back, &c, sizeof c);
    path = write_temp("[kvstashd]\npool_mb = 64\nthreads = many\n");
    assert_int_equal(config_load(&c, path, err, sizeof err), -1);
    assert_non_null(strstr(err, ":3: threads must be an integer"));
    unlink(path);
    path = write_temp("[elsewhere]\npool_mb = 64\n");
    assert_int_equal(config_load(&c, path, err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown section [elsewhere]"));
    unlink(path);
    assert_int_equal(config_load(&c, "/nonexistent/k.conf", err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open /nonexistent/k.conf"));
}

/* ---- metrics ------------------------------------------------------------------- */

static void test_metrics_addresses(void **state)
{
    (void)state;
    struct sockaddr_storage sa;
    unsigned len;
    assert_int_equal(metrics_parse_addr("127.0.0.1:9464", &sa, &len), 1);
    assert_int_equal(metrics_parse_addr("127.1.2.3:0", &sa, &len), 1);
    assert_int_equal(metrics_parse_addr("localhost:80", &sa, &len), 1);
    assert_int_equal(metrics_parse_addr("[::1]:9464", &sa, &len), 1);
    assert_int_equal(metrics_parse_addr("0.0.0.0:9464", &sa, &len), 0);
    assert_int_equal(metrics_parse_addr("10.0.0.1:9464", &sa, &len), 0);
    assert_int_equal(metrics_parse_addr("[::]:9464", &sa, &len), 0);
    assert_int_equal(metrics_parse_addr("127.0.0.1", &sa, &len), -1);
    assert_int_equal(metrics_parse_addr("127.0.0.1:99999", &sa, &len), -1);
    assert_int_equal(metrics_parse_addr("example.com:80", &sa, &len), -1);
    assert_int_equal(metrics_parse_addr(":80", &sa, &len), -1);
    assert_int_equal(metrics_parse_addr("[::1:80", &sa, &len), -1);
}

/* ---- a store with one worker ---------------------------------------------------- */

typedef struct fixture {
    store *st;
    metrics *m;
    char token[STORE_TOKEN_LEN + 1];    /* the owning worker, uid 1000 */
    char operator[STORE_TOKEN_LEN + 1]; /* an operator session, never attached */
    char stranger[STORE_TOKEN_LEN + 1]; /* uid 2000 */
    uint64_t seq_full, seq_h2o;
} fixture;

static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0}; /* 4 tokens a block */
static const rpc_method no_methods[] = {{"/kvstash.v1.Store/Stats", NULL, NULL, NULL, NULL, 0}};

static int setup(void **state)
{
    static fixture f;
    memset(&f, 0, sizeof f);
    store_config cfg = {.pool_bytes = 1 << 20, .max_pools = 4, .max_sessions = 16, .max_seqs = 64};
    assert_non_null(f.st = store_create(&cfg, NULL));
    f.m = metrics_create(no_methods, 1);
    assert_non_null(f.m);
    store_set_metrics(f.st, f.m);
    status s;
    assert_int_equal(store_session_open(f.st, 100, 1000, 1000, 1, f.token, &s), ST_OK);
    assert_int_equal(store_session_open(f.st, 101, geteuid(), 0, 2, f.operator, & s), ST_OK);
    assert_int_equal(store_session_open(f.st, 102, 2000, 2000, 3, f.stranger, &s), ST_OK);
    store_attach_result r;
    assert_int_equal(store_attach(f.st, f.token, "m", &geom, "w", &r, &s), ST_OK);
    assert_int_equal(seq_create_for(f.st, f.token, "full", NULL, NULL, 0, &f.seq_full, &s), ST_OK);
    assert_int_equal(seq_create_for(f.st, f.token, "h2o", NULL, NULL, 0, &f.seq_h2o, &s), ST_OK);
    store_table w;
    assert_int_equal(store_append(f.st, f.token, f.seq_full, 16, 0, &w, &s), ST_OK);
    store_table_free(&w);
    assert_int_equal(store_append(f.st, f.token, f.seq_h2o, 4, 0, &w, &s), ST_OK);
    store_table_free(&w);
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    store_destroy(f->st);
    metrics_destroy(f->m);
    return 0;
}

static uint32_t held(fixture *f, uint64_t seq_id, uint32_t layer, const uint32_t **pos)
{
    return seq_list_tokens(store_find_seq_locked(f->st, seq_id), layer, 0, pos);
}

static void test_evict_drops_positions_and_retires_blocks(void **state)
{
    fixture *f = *state;
    status s;
    operator_evict_result r;
    seq *q = store_find_seq_locked(f->st, f->seq_full);
    uint64_t epoch = seq_epoch(q);
    uint32_t free_before = seq_pool(q)->nfree;
    /* Positions 4-7 are block 1 of each layer; 9 and 30 (not held) on layer 1 only. */
    const operator_range all[] = {{4, 4}};
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, all, 1, NULL, 0, &r, &s),
                     ST_OK);
    assert_int_equal(r.evicted, 8);
    assert_int_equal(r.requested, 8);
    assert_int_equal(r.by_policy, 0);
    assert_int_equal(r.not_held, 0);
    assert_int_equal(r.epoch, epoch + 1);
    assert_int_equal(seq_retired_count(q), 2); /* one block per layer, until acked */
    assert_int_equal(seq_pool(q)->nfree, free_before);
    const operator_range some[] = {{9, 1}, {5, 1}};
    const uint32_t layer1[] = {1};
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, some, 2, layer1, 1, &r, &s),
                     ST_OK);
    assert_int_equal(r.evicted, 1);
    assert_int_equal(r.not_held, 1);
    const uint32_t *pos;
    assert_int_equal(held(f, f->seq_full, 0, &pos), 12);
    assert_int_equal(held(f, f->seq_full, 1, &pos), 11);
    assert_int_equal(pos[3], 3);
    assert_int_equal(pos[4], 8);
    assert_int_equal(pos[5], 10);
    /* The worker's table agrees with the host, and acking frees the blocks. */
    store_table t;
    assert_int_equal(store_get_table(f->st, f->token, f->seq_full, r.epoch, 1, &t, &s), ST_OK);
    assert_int_equal(t.lists[1].tokens, 11);
    uint32_t segs_tokens = 0;
    for (size_t i = 0; i < t.lists[1].nsegs; i++)
        segs_tokens += t.lists[1].segs[i].count;
    assert_int_equal(segs_tokens, 11);
    store_table_free(&t);
    assert_int_equal(seq_retired_count(q), 0);
    assert_int_equal(seq_pool(q)->nfree, free_before + 2);
    /* The counters moved, by operator. */
    snapshot snap;
    assert_int_equal(store_snapshot(f->st, &snap), 0);
    char *text = metrics_render(f->m, &snap, NULL);
    snapshot_free(&snap);
    assert_non_null(text);
    assert_non_null(
        strstr(text, "kvstash_evicted_tokens_total{policy=\"full\",by=\"operator\"} 9"));
    assert_non_null(strstr(text, "kvstash_appended_tokens_total{policy=\"full\"} 16"));
    assert_non_null(strstr(text, "kvstash_tokens{policy=\"full\",tier=\"full\"} 23"));
    assert_non_null(strstr(text, "kvstash_workers 1\n"));
    free(text);
}

static void test_evict_refusals_change_nothing(void **state)
{
    fixture *f = *state;
    status s;
    operator_evict_result r;
    seq *q = store_find_seq_locked(f->st, f->seq_full);
    uint64_t epoch = seq_epoch(q);
    const operator_range one[] = {{1, 1}}, beyond[] = {{15, 2}}, empty[] = {{1, 0}};
    const uint32_t bad_layer[] = {2};
    assert_int_equal(operator_evict(f->st, NULL, f->seq_full, one, 1, NULL, 0, &r, &s),
                     ST_UNAUTHENTICATED);
    assert_int_equal(operator_evict(f->st, f->operator, 999, one, 1, NULL, 0, &r, &s),
                     ST_NOT_FOUND);
    if (geteuid() != 2000) {
        assert_int_equal(operator_evict(f->st, f->stranger, f->seq_full, one, 1, NULL, 0, &r, &s),
                         ST_PERMISSION_DENIED);
    }
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_h2o, one, 1, NULL, 0, &r, &s),
                     ST_FAILED_PRECONDITION);
    assert_non_null(strstr(s.msg, "per-token state"));
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, beyond, 1, NULL, 0, &r, &s),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, empty, 1, NULL, 0, &r, &s),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, NULL, 0, NULL, 0, &r, &s),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, one, 1, bad_layer, 1, &r, &s),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(seq_epoch(q), epoch);
    assert_int_equal(held(f, f->seq_full, 0, NULL), 16);
    /* The worker itself may evict from its own sequence. */
    assert_int_equal(operator_evict(f->st, f->token, f->seq_full, one, 1, NULL, 0, &r, &s), ST_OK);
    assert_int_equal(r.evicted, 2);
}

/* EvictRequest.to: the tiers by name, "" for evict, and "fp16", the full
 * tier's name before "full" (issue 15 item 1), still taken for it. */
static void test_evict_to_names(void **state)
{
    (void)state;
    static const struct {
        const char *to;
        status_code code;
        policy_tier tier;
    } cases[] = {
        {NULL, ST_OK, POLICY_EVICT},
        {"", ST_OK, POLICY_EVICT},
        {"evict", ST_OK, POLICY_EVICT},
        {"int8", ST_OK, POLICY_INT8},
        {"sketch", ST_OK, POLICY_SKETCH},
        {"full", ST_OK, POLICY_FULL},
        {"fp16", ST_OK, POLICY_FULL},
        {"fp32", ST_INVALID_ARGUMENT, POLICY_EVICT},
        {"FULL", ST_INVALID_ARGUMENT, POLICY_EVICT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        status s = {0};
        policy_tier t = POLICY_EVICT;
        assert_int_equal(operator_parse_to(cases[i].to, &t, &s), cases[i].code);
        assert_int_equal(t, cases[i].tier);
        if (cases[i].code != ST_OK)
            assert_non_null(strstr(s.msg, "\"full\" (or \"fp16\")"));
    }
}

/* --operator-uids: a list of uids, "none" or "" for none; defaults root
 * and the daemon's uid. */
static void test_config_operator_uids(void **state)
{
    (void)state;
    daemon_config c;
    char err[256];
    config_defaults(&c);
    assert_int_equal(c.n_operator_uids, geteuid() == 0 ? 1 : 2);
    assert_int_equal(c.operator_uids[0], 0);
    assert_int_equal(c.operator_uids[c.n_operator_uids - 1], geteuid());
    assert_int_equal(config_set(&c, "operator_uids", "0, 1000,65534", err, sizeof err), 0);
    assert_int_equal(c.n_operator_uids, 3);
    assert_int_equal(c.operator_uids[1], 1000);
    assert_int_equal(c.operator_uids[2], 65534);
    assert_int_equal(config_set(&c, "operator-uids", "none", err, sizeof err), 0);
    assert_int_equal(c.n_operator_uids, 0);
    assert_int_equal(config_set(&c, "operator-uids", "7", err, sizeof err), 0);
    const char *bad[] = {"root", "1,,2",       "-1",
                         "1 2",  "4294967295", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(config_set(&c, "operator-uids", bad[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "operator-uids must be at most 16 comma-separated uids"));
    }
    assert_int_equal(c.n_operator_uids, 1); /* failures change nothing */
    assert_int_equal(c.operator_uids[0], 7);
}

/* With operator_uids = {2000}: the stranger (uid 2000) acts on and sees
 * every sequence, the daemon-uid session and a token-less caller only their
 * own (none), the owner its own. */
static void test_operators_act_and_see_others(void **state)
{
    fixture *f = *state;
    status s;
    operator_evict_result r;
    const operator_range one[] = {{1, 1}};
    const uid_t ops[] = {2000};
    store_set_operators(f->st, ops, 1);
    seq *q;
    if (geteuid() != 2000) {
        assert_int_equal(operator_evict(f->st, f->operator, f->seq_full, one, 1, NULL, 0, &r, &s),
                         ST_PERMISSION_DENIED);
        assert_non_null(strstr(s.msg, "operator_uids"));
        store_lock(f->st);
        assert_int_equal(store_find_seq_visible_locked(f->st, f->operator, f->seq_full, &q, &s),
                         ST_PERMISSION_DENIED);
        assert_int_equal(store_find_seq_visible_locked(f->st, NULL, f->seq_full, &q, &s),
                         ST_PERMISSION_DENIED);
        store_unlock(f->st);
    }
    assert_int_equal(held(f, f->seq_full, 0, NULL), 16);
    store_lock(f->st);
    assert_int_equal(store_find_seq_visible_locked(f->st, f->stranger, f->seq_full, &q, &s), ST_OK);
    assert_ptr_equal(q, store_find_seq_locked(f->st, f->seq_full));
    assert_int_equal(store_find_seq_visible_locked(f->st, f->token, f->seq_h2o, &q, &s), ST_OK);
    assert_int_equal(store_find_seq_visible_locked(f->st, "0123", f->seq_full, &q, &s),
                     ST_UNAUTHENTICATED);
    assert_int_equal(store_find_seq_visible_locked(f->st, f->token, 999, &q, &s), ST_NOT_FOUND);
    store_unlock(f->st);
    /* Stats: the pools' totals count every sequence, the lists only what
     * the caller may see. */
    store_caller who;
    snapshot all, mine, none;
    assert_int_equal(store_identify(f->st, f->stranger, &who, &s), ST_OK);
    assert_true(who.is_operator);
    assert_int_equal(store_snapshot_for(f->st, &who, &all), 0);
    assert_int_equal(all.nseqs, 2);
    assert_int_equal(store_identify(f->st, f->token, &who, &s), ST_OK);
    assert_int_equal(who.uid, 1000);
    assert_false(who.is_operator);
    assert_int_equal(store_snapshot_for(f->st, &who, &mine), 0);
    assert_int_equal(mine.nseqs, 2);
    assert_int_equal(mine.nsessions, 1);
    assert_int_equal(store_identify(f->st, NULL, &who, &s), ST_OK);
    assert_int_equal(who.session_id, 0);
    assert_int_equal(who.is_operator, geteuid() == 2000);
    assert_int_equal(store_snapshot_for(f->st, &who, &none), 0);
    if (geteuid() != 2000) {
        assert_int_equal(none.nseqs, 0);
        assert_int_equal(none.nsessions, 0);
    }
    assert_int_equal(none.npools, 1);
    assert_int_equal(none.pools[0].blocks_free, all.pools[0].blocks_free);
    assert_int_equal(none.pools[0].blocks_retired, all.pools[0].blocks_retired);
    snapshot_free(&all);
    snapshot_free(&mine);
    snapshot_free(&none);
    assert_int_equal(store_identify(f->st, "", &who, &s), ST_UNAUTHENTICATED);
    /* The operator evicts the owner's positions. */
    assert_int_equal(operator_evict(f->st, f->stranger, f->seq_full, one, 1, NULL, 0, &r, &s),
                     ST_OK);
    assert_int_equal(r.evicted, 2);
    assert_int_equal(held(f, f->seq_full, 0, NULL), 15);
}

/* Pools are the (tenant, model)'s: another tenant gets another pool. */
static void test_tenants_get_their_own_pools(void **state)
{
    fixture *f = *state;
    status s;
    char t1[STORE_TOKEN_LEN + 1], t2[STORE_TOKEN_LEN + 1], t3[STORE_TOKEN_LEN + 1];
    assert_int_equal(store_session_open(f->st, 200, 1000, 1000, 10, t1, &s), ST_OK);
    assert_int_equal(store_session_open(f->st, 201, 1000, 1000, 11, t2, &s), ST_OK);
    assert_int_equal(store_session_open(f->st, 202, 1000, 1000, 12, t3, &s), ST_OK);
    store_attach_result plain, a, b;
    /* f->token attached to model "m" with the default tenant (setup). */
    assert_int_equal(store_attach_tenant(f->st, t1, "", "m", &geom, "w", &plain, &s), ST_OK);
    assert_int_equal(store_attach_tenant(f->st, t2, "acme", "m", &geom, "w", &a, &s), ST_OK);
    assert_int_equal(store_attach_tenant(f->st, t3, "initech", "m", &geom, "w", &b, &s), ST_OK);
    assert_true(plain.pool_id != a.pool_id && a.pool_id != b.pool_id && plain.pool_id != b.pool_id);
    backend_share sh;
    assert_int_equal(store_pool_share(f->st, 11, plain.pool_id, &sh, &s), ST_PERMISSION_DENIED);
    assert_int_equal(sh.fd, -1);
    char t4[STORE_TOKEN_LEN + 1];
    assert_int_equal(store_session_open(f->st, 203, 1000, 1000, 13, t4, &s), ST_OK);
    assert_int_equal(store_attach_tenant(f->st, t4, "a/b", "m", &geom, "w", &a, &s),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(s.msg, "tenant may contain only"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_set),
        cmocka_unit_test(test_config_text_that_cannot_round_trip),
        cmocka_unit_test(test_config_file_round_trip),
        cmocka_unit_test(test_metrics_addresses),
        cmocka_unit_test_setup_teardown(test_evict_drops_positions_and_retires_blocks, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_evict_refusals_change_nothing, setup, teardown),
        cmocka_unit_test(test_evict_to_names),
        cmocka_unit_test(test_config_operator_uids),
        cmocka_unit_test_setup_teardown(test_operators_act_and_see_others, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tenants_get_their_own_pools, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
