/*
 * fuzz_store.h - what the daemon-side fuzz targets (fuzz_rpc, fuzz_ring,
 * fuzz_fdsock) share: a real store with a small pool, two worker sessions
 * attached to it, and one sequence each with a few tokens, built afresh for
 * every input so that a crash reproduces from its input alone.
 *
 * Header-only; include it once. A fixture that cannot be built is a bug of
 * the harness or the store, not of the input: it aborts (libFuzzer reports
 * it as a crash with the input that was running), it never exits.
 */
#ifndef KVSTASH_FUZZ_STORE_H
#define KVSTASH_FUZZ_STORE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "snapshot.h"
#include "store.h"

#define FUZZ_SESSIONS 2
#define FUZZ_CONN_BASE 100000
/* 256 blocks of fuzz_geometry (1 KiB each): room for every seed, and the
 * pool's memfd is allocated for every input (a 256 KiB pool made the kernel's
 * shmem work half of fuzz_rpc's time). */
#define FUZZ_POOL_BYTES (256u << 10)
/* Session 1's uid, the store's one operator (store_set_operators): session
 * 0 (the fuzzer's own uid) is a plain worker, so calls across sessions meet
 * both the owner's checks and the operator's rights. */
#define FUZZ_OPERATOR_UID 4242

typedef struct fuzz_store {
    store *st;
    char token[FUZZ_SESSIONS][STORE_TOKEN_LEN + 1];
    uint64_t seq_id[FUZZ_SESSIONS];
    uint64_t pool_id;
} fuzz_store;

/* The geometry test_ring and test_store use: small enough that a 256 KiB pool
 * holds many blocks, with more than one layer and KV head. */
static const pool_geometry fuzz_geometry = {2, 4, 2, 8, 4, POOL_FP32, 0};

static void fuzz_check(status_code rc, const status *s, const char *what)
{
    if (rc != ST_OK) {
        fprintf(stderr, "fuzz fixture: %s: %s\n", what, s->msg);
        abort();
    }
}

/* Open session i (conn id FUZZ_CONN_BASE + i: fuzz_fdsock's own
 * connections number from 1) on the store, attach it and give it one
 * sequence of `policy` with three tokens. */
static void fuzz_session(fuzz_store *f, int i, const char *policy)
{
    status s;
    uid_t uid = i == 1 ? FUZZ_OPERATOR_UID : geteuid();
    fuzz_check(
        store_session_open(f->st, getpid(), uid, getegid(), FUZZ_CONN_BASE + i, f->token[i], &s),
        &s, "session_open");
    store_attach_result ar;
    fuzz_check(store_attach(f->st, f->token[i], "m", &fuzz_geometry, "fuzz", &ar, &s), &s,
               "attach");
    f->pool_id = ar.pool_id;
    store_seq_request req = {policy, NULL, NULL, 0, "fuzz"};
    store_seq_created out = {0};
    fuzz_check(store_seq_create(f->st, f->token[i], &req, &out, &s), &s, "seq_create");
    f->seq_id[i] = out.seq_id;
    store_table w;
    fuzz_check(store_append(f->st, f->token[i], out.seq_id, 3, out.epoch, &w, &s), &s, "append");
    store_table_free(&w);
}

/* A store with `sessions` (0..FUZZ_SESSIONS) of the fixture's sessions:
 * session 0 holds a "full" sequence, session 1 (the operator) an "h2o"
 * one (a policy that keeps state and evicts). */
static void fuzz_store_open(fuzz_store *f, int sessions)
{
    memset(f, 0, sizeof *f);
    /* The store logs every refused request at info: the fuzzer's output is
     * for findings. */
    log_set_level(LOG_ERROR);
    store_config cfg = {.pool_bytes = FUZZ_POOL_BYTES,
                        .max_pools = 2,
                        .max_sessions = 4,
                        .max_seqs = 16,
                        .max_daemon_bytes = 16u << 20,
                        .max_reply_bytes = 4u << 20};
    f->st = store_create(&cfg, NULL);
    if (f->st == NULL) {
        fprintf(stderr, "fuzz fixture: store_create failed\n");
        abort();
    }
    static const uid_t operators[] = {FUZZ_OPERATOR_UID};
    store_set_operators(f->st, operators, 1);
    static const char *const policies[FUZZ_SESSIONS] = {"full", "h2o"};
    for (int i = 0; i < sessions && i < FUZZ_SESSIONS; i++)
        fuzz_session(f, i, policies[i]);
}

/* Whatever the input did, every block of each pool is free or held by an
 * attached session's sequences and scratch, exactly once: a leak or a double
 * free the sanitizers cannot see (blocks are ids, not allocations) aborts. */
static void fuzz_store_check_blocks(fuzz_store *f)
{
    snapshot sn;
    if (store_snapshot(f->st, &sn) != 0)
        return; /* out of memory: nothing to judge */
    for (size_t p = 0; p < sn.npools; p++) {
        uint64_t held = 0;
        for (size_t i = 0; i < sn.nsessions; i++)
            if (sn.sessions[i].pool_id == sn.pools[p].id)
                held += sn.sessions[i].blocks;
        uint64_t lent = sn.pools[p].blocks_total - sn.pools[p].blocks_free;
        if (lent != held) {
            fprintf(stderr, "fuzz: pool %llu lends %llu blocks, its sessions hold %llu\n",
                    (unsigned long long)sn.pools[p].id, (unsigned long long)lent,
                    (unsigned long long)held);
            abort();
        }
    }
    snapshot_free(&sn);
}

static void fuzz_store_close(fuzz_store *f)
{
    fuzz_store_check_blocks(f);
    store_destroy(f->st);
    f->st = NULL;
}

#endif
