/*
 * Unit tests of the lease-end quarantine (docs/reliability.md, "Lease
 * end"): the pool's holds (pool_hold_*), the store keeping an ended
 * session's blocks until its process exits (store_quarantine_reap, with
 * real child processes and their pidfds), and the lease-end config key.
 * Nothing here waits on time: a child's exit is waited for (waitpid)
 * before the store is asked.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "config.h"
#include "pool.h"
#include "store.h"
#include "store_harness.h"

/* ---- pool holds ----------------------------------------------------------- */

static pool *small_pool(uint32_t blocks)
{
    pool_geometry g = {1, 1, 1, 4, 4, POOL_FP32, 0};
    pool *p;
    status st;
    size_t block_bytes = 2 * 4 * 4 * 4; /* K and V of 4 tokens of 4 fp32 */
    assert_int_equal(pool_create(1, "m", &g, blocks * block_bytes, &backend_host, &p, &st), ST_OK);
    assert_int_equal(p->block_count, blocks);
    return p;
}

/* Whether the free stack holds each of the pool's blocks exactly once. */
static int all_free_once(const pool *p)
{
    if (p->nfree != p->block_count)
        return 0;
    uint8_t *seen = calloc(p->block_count, 1);
    int ok = 1;
    for (uint32_t i = 0; i < p->nfree; i++)
        ok &= p->free_stack[i] < p->block_count && !seen[p->free_stack[i]]++;
    free(seen);
    return ok;
}

static void test_holds_keep_freed_blocks_out_of_the_free_stack(void **state)
{
    (void)state;
    pool *p = small_pool(8);
    uint32_t b[8];
    for (int i = 0; i < 6; i++)
        assert_int_equal(pool_alloc_block(p, &b[i]), 0);
    /* Two holds (two sessions ending): blocks 0-2, then 3-4. */
    uint32_t first1 = pool_hold_begin(p);
    for (int i = 0; i < 3; i++)
        pool_free_block(p, b[i]);
    uint32_t n1 = pool_hold_end(p, first1);
    uint32_t first2 = pool_hold_begin(p);
    pool_free_block(p, b[3]);
    pool_free_block(p, b[4]);
    uint32_t n2 = pool_hold_end(p, first2);
    assert_int_equal(first1, 0);
    assert_int_equal(n1, 3);
    assert_int_equal(first2, 3);
    assert_int_equal(n2, 2);
    assert_int_equal(p->nheld, 5);
    assert_int_equal(p->nfree, 2); /* held blocks are not allocatable */
    /* Outside a hold, freeing frees. */
    pool_free_block(p, b[5]);
    assert_int_equal(p->nfree, 3);
    assert_int_equal(p->nheld, 5);
    /* The first hold goes first: the second moves down by its count. */
    pool_hold_free(p, first1, n1);
    assert_int_equal(p->nheld, 2);
    assert_int_equal(p->nfree, 6);
    assert_int_equal(p->held[0], b[3]);
    assert_int_equal(p->held[1], b[4]);
    pool_hold_free(p, first2 - n1, n2);
    assert_int_equal(p->nheld, 0);
    assert_true(all_free_once(p));
    pool_destroy(p);
}

/* ---- the store's quarantine ----------------------------------------------- */

/* A child process that waits until killed: a worker whose process lives on. */
static pid_t live_child(void)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        for (;;)
            pause();
    }
    return pid;
}

static void end_child(pid_t pid)
{
    kill(pid, SIGKILL);
    assert_int_equal(waitpid(pid, NULL, 0), pid);
}

static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};

typedef struct worker {
    char token[STORE_TOKEN_LEN + 1];
    int conn;
    uint64_t pool_id, seq_id;
} worker;

/* A session of process pid on connection conn, attached, with `tokens`
 * appended to a full-policy sequence; mapped when `map`. */
static void worker_start(store *st, pid_t pid, int conn, int map, int64_t tokens, worker *w)
{
    status s;
    w->conn = conn;
    assert_int_equal(store_session_open(st, pid, getuid(), getgid(), conn, w->token, &s), ST_OK);
    store_attach_result r;
    assert_int_equal(store_attach(st, w->token, "m", &geom, "w", &r, &s), ST_OK);
    w->pool_id = r.pool_id;
    if (map) {
        backend_share sh;
        assert_int_equal(store_pool_share(st, conn, r.pool_id, &sh, &s), ST_OK);
        close(sh.fd);
    }
    assert_int_equal(seq_create_for(st, w->token, "full", NULL, NULL, 0, &w->seq_id, &s), ST_OK);
    store_table t;
    assert_int_equal(store_append(st, w->token, w->seq_id, tokens, 0, &t, &s), ST_OK);
    store_table_free(&t);
}

typedef struct view {
    size_t npools, nsessions;
    uint32_t total, free, quarantined; /* of the first pool */
    uint32_t q_sessions, q_blocks;
} view;

static view look(store *st)
{
    snapshot sn;
    assert_int_equal(store_snapshot(st, &sn), 0);
    view v = {sn.npools, sn.nsessions, 0, 0, 0, sn.quarantined_sessions, sn.quarantined_blocks};
    if (sn.npools > 0) {
        v.total = sn.pools[0].blocks_total;
        v.free = sn.pools[0].blocks_free;
        v.quarantined = sn.pools[0].blocks_quarantined;
    }
    snapshot_free(&sn);
    return v;
}

static store *quarantine_store(int quarantine)
{
    store_config cfg = {.pool_bytes = 1 << 20,
                        .max_pools = 4,
                        .max_sessions = 16,
                        .max_seqs = 64,
                        .lease_end_quarantine = quarantine};
    store *st = store_create(&cfg, NULL);
    assert_non_null(st);
    return st;
}

/* 9 tokens of 4-token blocks in 2 layers: 3 blocks a layer. */
#define TOKENS 9
#define HELD 6

static void test_closed_session_is_quarantined_until_its_process_exits(void **state)
{
    (void)state;
    store *st = quarantine_store(1);
    pid_t child = live_child();
    worker w;
    worker_start(st, child, 1, 1, TOKENS, &w);
    view v = look(st);
    uint32_t total = v.total;
    assert_int_equal(v.free, total - HELD);
    store_session_conn_closed(st, w.conn);
    v = look(st);
    /* The session and its sequence are gone; its blocks and its pool stay. */
    assert_int_equal(v.nsessions, 0);
    assert_null(store_find_seq_locked(st, w.seq_id));
    assert_int_equal(v.npools, 1);
    assert_int_equal(v.quarantined, HELD);
    assert_int_equal(v.free, total - HELD);
    assert_int_equal(v.q_sessions, 1);
    assert_int_equal(v.q_blocks, HELD);
    assert_int_equal(store_quarantine_reap(st), 0); /* it lives */
    assert_int_equal(look(st).q_blocks, HELD);
    end_child(child);
    assert_int_equal(store_quarantine_reap(st), 1);
    v = look(st);
    assert_int_equal(v.q_sessions, 0);
    assert_int_equal(v.q_blocks, 0);
    assert_int_equal(v.npools, 0); /* no session, no quarantine: the pool goes */
    store_destroy(st);
}

/* Quarantines released in another order than they came: each releases
 * exactly its own blocks (pool_hold_free moves the later ones down). */
static void test_quarantines_release_in_any_order(void **state)
{
    (void)state;
    store *st = quarantine_store(1);
    pid_t a = live_child(), b = live_child();
    worker wa, wb, keep;
    worker_start(st, a, 1, 1, TOKENS, &wa);
    worker_start(st, b, 2, 1, 2 * TOKENS, &wb); /* 5 blocks a layer: 10 */
    worker_start(st, getpid(), 3, 0, 1, &keep); /* keeps the pool; 2 blocks */
    uint32_t total = look(st).total;
    store_session_conn_closed(st, wa.conn);
    store_session_conn_closed(st, wb.conn);
    view v = look(st);
    assert_int_equal(v.q_sessions, 2);
    assert_int_equal(v.quarantined, HELD + 10);
    assert_int_equal(v.free, total - HELD - 10 - 2);
    end_child(a); /* the first to come is the first to go */
    assert_int_equal(store_quarantine_reap(st), 1);
    v = look(st);
    assert_int_equal(v.quarantined, 10);
    assert_int_equal(v.free, total - 10 - 2);
    end_child(b);
    assert_int_equal(store_quarantine_reap(st), 1);
    v = look(st);
    assert_int_equal(v.quarantined, 0);
    assert_int_equal(v.free, total - 2);
    /* Every block can be had again, each once: fill the pool. */
    status s;
    store_table t;
    uint32_t left = (total - 2) / 2 * 4;
    assert_int_equal(store_append(st, keep.token, keep.seq_id, left, 0, &t, &s), ST_OK);
    store_table_free(&t);
    assert_int_equal(look(st).free, 0);
    store_destroy(st);
}

static void test_detach_unmapped_and_free_mode_free_at_once(void **state)
{
    (void)state;
    pid_t child = live_child();
    /* A clean Detach. */
    store *st = quarantine_store(1);
    worker w;
    uint32_t released;
    status s;
    worker_start(st, child, 1, 1, TOKENS, &w);
    assert_int_equal(store_detach(st, w.token, &released, &s), ST_OK);
    assert_int_equal(look(st).q_sessions, 0);
    assert_int_equal(look(st).npools, 0);
    /* A worker that never mapped the pool cannot write into it. */
    worker_start(st, child, 2, 0, TOKENS, &w);
    store_session_conn_closed(st, w.conn);
    assert_int_equal(look(st).q_sessions, 0);
    assert_int_equal(look(st).npools, 0);
    /* A session that ends holding no block leaves nothing to hold. */
    worker_start(st, child, 3, 1, 0 + 1, &w);
    status_code rc = store_seq_release(st, w.token, w.seq_id, &released, &s);
    assert_int_equal(rc, ST_OK);
    store_session_conn_closed(st, w.conn);
    assert_int_equal(look(st).q_sessions, 0);
    store_destroy(st);
    /* --lease-end free: as before quarantine existed. */
    st = quarantine_store(0);
    worker_start(st, child, 1, 1, TOKENS, &w);
    store_session_conn_closed(st, w.conn);
    assert_int_equal(look(st).q_sessions, 0);
    assert_int_equal(look(st).npools, 0);
    store_destroy(st);
    end_child(child);
}

/* Shutdown frees what is quarantined (ASan would see a leak otherwise). */
static void test_shutdown_releases_quarantines(void **state)
{
    (void)state;
    store *st = quarantine_store(1);
    pid_t child = live_child();
    worker w;
    worker_start(st, child, 1, 1, TOKENS, &w);
    store_session_conn_closed(st, w.conn);
    assert_int_equal(look(st).q_sessions, 1);
    store_destroy(st);
    end_child(child);
}

/* ---- the config key ------------------------------------------------------- */

static void test_lease_end_key(void **state)
{
    (void)state;
    daemon_config c;
    char err[512];
    config_defaults(&c);
    assert_string_equal(c.lease_end, "auto");
    assert_int_equal(config_lease_end_quarantine(&c), 0); /* host */
    assert_int_equal(config_set(&c, "backend", "shadow", err, sizeof err), 0);
    assert_int_equal(config_lease_end_quarantine(&c), 0);
    snprintf(c.backend, sizeof c.backend, "cuda"); /* builds without CUDA refuse the key */
    assert_int_equal(config_lease_end_quarantine(&c), 1);
    assert_int_equal(config_set(&c, "lease-end", "free", err, sizeof err), 0);
    assert_int_equal(config_lease_end_quarantine(&c), 0);
    snprintf(c.backend, sizeof c.backend, "host");
    assert_int_equal(config_set(&c, "lease_end", "quarantine", err, sizeof err), 0);
    assert_int_equal(config_lease_end_quarantine(&c), 1);
    static const char *const bad[] = {"", "Free", "quarantined", "auto ", "on"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = '\0';
        assert_int_equal(config_set(&c, "lease-end", bad[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "lease-end must be free, quarantine or auto"));
    }
    assert_string_equal(c.lease_end, "quarantine"); /* unchanged by the refusals */
}

/* --print-config writes the key; config_load reads it back. */
static void test_lease_end_round_trip(void **state)
{
    (void)state;
    static const char *const values[] = {"auto", "free", "quarantine"};
    for (size_t i = 0; i < 3; i++) {
        daemon_config c, back;
        char err[512], path[] = "/tmp/test_lease_end_XXXXXX";
        config_defaults(&c);
        assert_int_equal(config_set(&c, "lease-end", values[i], err, sizeof err), 0);
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        FILE *f = fdopen(fd, "w");
        config_print(&c, "test", f);
        fclose(f);
        config_defaults(&back);
        snprintf(back.lease_end, sizeof back.lease_end, "x");
        assert_int_equal(config_load(&back, path, err, sizeof err), 0);
        unlink(path);
        assert_string_equal(back.lease_end, values[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_holds_keep_freed_blocks_out_of_the_free_stack),
        cmocka_unit_test(test_closed_session_is_quarantined_until_its_process_exits),
        cmocka_unit_test(test_quarantines_release_in_any_order),
        cmocka_unit_test(test_detach_unmapped_and_free_mode_free_at_once),
        cmocka_unit_test(test_shutdown_releases_quarantines),
        cmocka_unit_test(test_lease_end_key),
        cmocka_unit_test(test_lease_end_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
