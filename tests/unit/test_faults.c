/*
 * Allocation-failure injection (SQLite's fault simulation): every store
 * call that allocates runs again and again with the n-th allocation failing
 * (n = 0, 1, 2, ...) until it runs without reaching the failure. A call that
 * fails must answer RESOURCE_EXHAUSTED and leave the store exactly as it was:
 * the sequences (epoch, lists, segments, tiers, positions, offloaded
 * victims, sketch cells, retired blocks, counters, spilled parts), their
 * policy hosts, the sessions and their scratch, the pool's free blocks and
 * the bytes of every block in use. And as if it had not run: the same
 * call, run again with nothing failing, must lead to exactly the state it
 * leads to on a store that never saw the failure (so the policies' own
 * state, which no snapshot reads, was put back too). A call that absorbs a
 * failure (a metric it skips) must succeed with every block accounted for.
 * Each case runs twice: the n-th allocation alone fails (transient), and
 * every allocation from the n-th on fails (persistent). FAULTS_CASE="step*"
 * runs only some cases.
 *
 * The test links with -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc
 * (tests/CMakeLists.txt): the daemon's static libraries call the wrappers
 * below; cmocka, glibc and the other shared libraries do not.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvstash_ring.h"
#include "ring.h"
#include "store_operator.h"
#include "seq_internal.h"
#include "store_internal.h"
#include "store_harness.h"

/* The store decides without its lock from this many tokens, so that a case
 * reaches that path with lists a few hundred tokens long (kvstashd's own
 * threshold, STORE_UNLOCKED_DECISION_TOKENS, would make every one of the
 * case's thousands of runs step 34,000 tokens). */
#define FAULTS_UNLOCKED_DECISION_TOKENS 256

/* ---- the countdown ------------------------------------------------------ */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);

typedef struct fault_state {
    long countdown;  /* allocations that succeed before one fails; -1: off */
    int persistent;  /* after the first failure, every later one fails too */
    unsigned failed; /* allocations failed since armed */
} fault_state;

static fault_state faults = {-1, 0, 0};

static int fault_now(void)
{
    if (faults.countdown < 0)
        return 0;
    if (faults.countdown > 0) {
        faults.countdown--;
        return 0;
    }
    faults.failed++;
    if (!faults.persistent)
        faults.countdown = -1;
    return 1;
}

void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);

/* A failure sets errno as glibc's allocator does: the daemon tells out of
 * memory from a policy's other refusals by it. */
void *__wrap_malloc(size_t n)
{
    return fault_now() ? (errno = ENOMEM, NULL) : __real_malloc(n);
}

void *__wrap_calloc(size_t n, size_t size)
{
    return fault_now() ? (errno = ENOMEM, NULL) : __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t n)
{
    return fault_now() ? (errno = ENOMEM, NULL) : __real_realloc(p, n);
}

static void faults_arm(long n, int persistent)
{
    faults.failed = 0;
    faults.persistent = persistent;
    faults.countdown = n;
}

/* Turn the countdown off; returns how many allocations failed. */
static unsigned faults_disarm(void)
{
    faults.countdown = -1;
    return faults.failed;
}

/* A run's own checks in the middle of the call: allocations that are not
 * the call's (faults_pause) and must not count, then the countdown as it
 * was (faults_resume). */
static fault_state faults_pause(void)
{
    fault_state saved = faults;
    faults.countdown = -1;
    return saved;
}

static void faults_resume(fault_state saved)
{
    faults = saved;
}

/* ---- a store to fail in ------------------------------------------------- */

/* 2 layers, 2 KV heads, head_dim 8, 4 fp32 tokens a block: 512-byte blocks,
 * 12 INT8 tokens in one; a 64 KiB pool has 128 of them. */
static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP32, 0};

typedef struct fixture {
    store *st;
    char token[STORE_TOKEN_LEN + 1];
    char other[STORE_TOKEN_LEN + 1]; /* a second session, not attached */
    uint64_t seq_id;
    uint64_t scratch_id;
    float *stats; /* a step's statistics, made before the countdown starts */
    size_t nstats;
    unsigned arrays;
    int prefill; /* step() steps a prompt */
    /* prep_spilled_*: the parts a spill wrote, as the remote tier keeps
     * them, and the Revive of layer 0 before the spill (positions, source
     * tiers, K/V as tier_read reads them). */
    struct {
        uint32_t part;
        uint8_t *bytes;
        size_t len;
    } parts[16];
    size_t nparts;
    uint32_t *want_pos;
    uint8_t *want_tier, *want_kv;
    size_t want_n;
} fixture;

static void must(status_code rc, const status *s, const char *what)
{
    if (rc != ST_OK)
        fail_msg("%s: %s %s", what, status_name(rc), s->msg);
}

/* Pools of pool_bytes (128 blocks unless a case needs long lists). */
static void open_store_sized(fixture *f, size_t pool_bytes)
{
    memset(f, 0, sizeof *f);
    store_config cfg = {.pool_bytes = pool_bytes,
                        .max_pools = 2,
                        .max_sessions = 4,
                        .max_seqs = 64,
                        .unlocked_decision_tokens = FAULTS_UNLOCKED_DECISION_TOKENS};
    assert_non_null(f->st = store_create(&cfg, NULL));
    /* A step's demotion then runs inside the step, as the daemon runs it
     * when its demoter is busy (store.c demote_due): the same plan, fill
     * and finish, on this thread, so that the countdown meets the
     * demotion's allocations in one order and the snapshots never race a
     * demotion still running. */
    store_demoter_stop(f->st);
    status s;
    must(store_session_open(f->st, 100, 1000, 1000, 1, f->token, &s), &s, "session");
    must(store_session_open(f->st, 200, 1000, 1000, 2, f->other, &s), &s, "second session");
}

static void open_store(fixture *f)
{
    open_store_sized(f, 64 << 10);
}

static void attach(fixture *f, const char *token)
{
    store_attach_result r;
    status s;
    must(store_attach(f->st, token, "m", &geom, "w", &r, &s), &s, "attach");
}

/* CreateSequence with n parameters given as key, value pairs in kv. */
static status_code create_kv(fixture *f, const char *policy, const char *const *kv, size_t n,
                             uint64_t *id, status *s)
{
    const char *keys[8] = {NULL}, *values[8] = {NULL};
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++) {
        keys[i] = kv[2 * i];
        values[i] = kv[2 * i + 1];
    }
    return seq_create_for(f->st, f->token, policy, keys, values, n, id, s);
}

static void new_seq(fixture *f, const char *policy, const char *const *kv, size_t n)
{
    status s;
    must(create_kv(f, policy, kv, n, &f->seq_id, &s), &s, "create");
}

static seq *the_seq(fixture *f)
{
    seq *q = store_find_seq_locked(f->st, f->seq_id);
    assert_non_null(q);
    return q;
}

/* Append n tokens one at a time (each append ends the step before it). */
static void append_each(fixture *f, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        store_table w;
        status s;
        must(store_append(f->st, f->token, f->seq_id, 1, 0, &w, &s), &s, "append");
        store_table_free(&w);
    }
}

/* Ack everything, so that no retired block is left for the call to free. */
static void ack_all(fixture *f)
{
    uint64_t epoch;
    status s;
    must(store_epoch(f->st, f->token, f->seq_id, the_seq(f)->epoch, &epoch, &s), &s, "ack");
}

static void operator_call(fixture *f, policy_tier to, uint32_t first, uint32_t count)
{
    operator_range r = {first, count};
    operator_evict_result out;
    status s;
    must(operator_apply(f->st, f->token, f->seq_id, to, &r, 1, NULL, 0, &out, &s), &s, "operator");
}

/* Per-step statistics for every list: deterministic, finite, different per
 * token so that score-based policies have something to choose by. */
static void make_stats(fixture *f)
{
    seq *q = the_seq(f);
    f->arrays = q->policy->needs & ~(unsigned)POLICY_NEEDS_CONFIDENCE;
    f->nstats = seq_step_floats(q, f->arrays);
    assert_true(f->nstats != (size_t)-1);
    f->stats = malloc((f->nstats ? f->nstats : 1) * sizeof *f->stats);
    assert_non_null(f->stats);
    for (size_t i = 0; i < f->nstats; i++)
        f->stats[i] = (float)((i * 7) % 13) / 13.0f;
}

static status_code step(fixture *f, status *s)
{
    seq_step_input in = {.arrays = f->arrays,
                         .prefill = f->prefill,
                         .score_queries = 2,
                         .window_queries = 2,
                         .confidence = 0.5,
                         .data = f->stats,
                         .nfloats = f->nstats};
    uint64_t epoch;
    uint32_t evicted;
    return store_step(f->st, f->token, f->seq_id, the_seq(f)->epoch, &in, NULL, NULL, &epoch,
                      &evicted, s);
}

static void close_store(fixture *f)
{
    store_destroy(f->st);
    free(f->stats);
    for (size_t i = 0; i < f->nparts; i++)
        free(f->parts[i].bytes);
    free(f->want_pos);
    free(f->want_tier);
    free(f->want_kv);
}

/* ---- snapshots ------------------------------------------------------------ */

/* Everything a failed call must leave as it was, serialised, with labels to
 * say where two snapshots first differ. */
typedef struct snap {
    uint8_t *buf;
    size_t len, cap;
    size_t at[256];
    const char *label[256];
    int nlabels;
} snap;

static void put(snap *s, const void *p, size_t n)
{
    if (s->len + n > s->cap) {
        s->cap = (s->len + n) * 2;
        s->buf = __real_realloc(s->buf, s->cap);
        assert_non_null(s->buf);
    }
    if (n > 0)
        memcpy(s->buf + s->len, p, n);
    s->len += n;
}

#define PUT(s, v) put((s), &(v), sizeof(v))

static void section(snap *s, const char *label)
{
    if (s->nlabels < 256) {
        s->at[s->nlabels] = s->len;
        s->label[s->nlabels++] = label;
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static void snap_pool(snap *s, const pool *p)
{
    section(s, "pool: free blocks");
    PUT(s, p->nfree);
    uint32_t *ids = __real_malloc((p->nfree + 1) * sizeof *ids);
    memcpy(ids, p->free_stack, p->nfree * sizeof *ids);
    qsort(ids, p->nfree, sizeof *ids, cmp_u32);
    put(s, ids, p->nfree * sizeof *ids);
    section(s, "pool: bytes of blocks in use");
    size_t j = 0;
    for (uint32_t b = 0; b < p->block_count; b++) {
        if (j < p->nfree && ids[j] == b) {
            j++;
            continue;
        }
        put(s, p->base + (size_t)b * p->block_bytes, p->block_bytes);
    }
    free(ids);
}

/* What the policy host holds for list (l, k): the decision committed. */
static void snap_host(snap *s, seq *q, uint32_t l, uint32_t k)
{
    section(s, "list: the host's positions and tiers");
    const policy_layer_view *v = policy_host_view(q->host, l);
    PUT(s, v->tokens[k]);
    put(s, v->positions[k], v->tokens[k] * sizeof *v->positions[k]);
    put(s, v->tier[k], v->tokens[k]);
}

static void snap_list(snap *s, seq *q, uint32_t l, uint32_t k)
{
    const seq_list *ly = &q->lists[(size_t)l * q->heads + k];
    section(s, "list: segments and tiers");
    PUT(s, ly->nsegs);
    put(s, ly->segs, ly->nsegs * sizeof *ly->segs);
    put(s, ly->seg_tier, ly->nsegs);
    section(s, "list: tail");
    PUT(s, ly->has_tail);
    if (ly->has_tail) {
        PUT(s, ly->tail_block);
        PUT(s, ly->tail_next_slot);
    }
    section(s, "list: offloaded victims");
    PUT(s, ly->noffloaded);
    put(s, ly->offloaded, ly->noffloaded * sizeof *ly->offloaded);
    for (size_t i = 0; i < ly->noffloaded; i++) {
        PUT(s, ly->offloaded_at[i].block);
        PUT(s, ly->offloaded_at[i].slot);
        PUT(s, ly->offloaded_at[i].tier);
    }
    PUT(s, ly->nfull_victims);
    PUT(s, ly->nvictim_blocks);
    put(s, ly->victim_blocks, ly->nvictim_blocks * sizeof *ly->victim_blocks);
    section(s, "list: sketch cells");
    size_t bytes = tier_sketch_bytes(&ly->sketch);
    PUT(s, bytes);
    if (bytes > 0) {
        size_t cells = (size_t)ly->sketch.sk.rows * ly->sketch.sk.buckets;
        put(s, ly->sketch.sk.key, cells * ly->sketch.sk.dim * sizeof(float));
        put(s, ly->sketch.sk.value, cells * ly->sketch.sk.dim * sizeof(float));
        put(s, ly->sketch.sk.count, cells * sizeof(int32_t));
    }
    snap_host(s, q, l, k);
}

static void snap_seq(snap *s, seq *q)
{
    section(s, "seq: epoch, positions appended, unstepped");
    PUT(s, q->id);
    PUT(s, q->epoch);
    PUT(s, q->appended);
    PUT(s, q->unstepped);
    section(s, "seq: retired blocks");
    PUT(s, q->nretired);
    for (size_t i = 0; i < q->nretired; i++) {
        PUT(s, q->retired[i].block);
        PUT(s, q->retired[i].epoch);
    }
    section(s, "seq: tier move counters");
    put(s, q->moved, sizeof q->moved);
    PUT(s, q->requantized);
    PUT(s, q->victims_dropped);
    section(s, "seq: spilled parts and victims");
    PUT(s, q->spill_parts);
    PUT(s, q->spilled_tokens);
    PUT(s, q->spilled_blocks);
    PUT(s, q->spilled_bytes);
    for (uint32_t l = 0; l < q->nlayers; l++)
        for (uint32_t k = 0; k < q->heads; k++)
            snap_list(s, q, l, k);
}

static void snap_take(fixture *f, snap *s)
{
    memset(s, 0, sizeof *s);
    store *st = f->st;
    section(s, "store: sequences and ids");
    PUT(s, st->nseqs);
    PUT(s, st->next_seq_id);
    PUT(s, st->next_pool_id);
    PUT(s, st->next_scratch_id);
    section(s, "store: pools");
    for (uint32_t i = 0; i < st->cfg.max_pools; i++) {
        uint64_t id = st->pools[i] != NULL ? st->pools[i]->id : 0;
        PUT(s, id);
        if (st->pools[i] != NULL) {
            PUT(s, st->pools[i]->sessions);
            snap_pool(s, st->pools[i]);
        }
    }
    for (const session *se = st->sessions; se != NULL; se = se->next) {
        section(s, "session: attachment and sequences");
        PUT(s, se->id);
        PUT(s, se->attached);
        PUT(s, se->nseqs);
        int has_ring = se->transport.impl != NULL;
        PUT(s, has_ring);
        section(s, "session: scratch");
        for (const store_scratch *sc = se->scratch; sc != NULL; sc = sc->next) {
            PUT(s, sc->id);
            PUT(s, sc->nblocks);
            put(s, sc->blocks, sc->nblocks * sizeof *sc->blocks);
        }
    }
    for (size_t i = 0; i < st->nseqs; i++)
        snap_seq(s, st->seqs[i]);
}

/* The label of the section where a and b first differ. */
static const char *snap_diff(const snap *a, const snap *b)
{
    size_t n = a->len < b->len ? a->len : b->len, i = 0;
    while (i < n && a->buf[i] == b->buf[i])
        i++;
    if (i == n && a->len == b->len)
        return NULL;
    const char *label = "start";
    for (int j = 0; j < a->nlabels && a->at[j] <= i; j++)
        label = a->label[j];
    return label;
}

static void snap_free(snap *s)
{
    free(s->buf);
}

/* Every block of each pool is free, held or retired by a sequence, or in a
 * session's scratch, exactly once; and each list's segments hold as many
 * tokens as the host's list. */
static char current[160]; /* the case and allocation being failed, for messages */

static const char *accounting(fixture *f)
{
    static char why[160];
    store *st = f->st;
    for (uint32_t i = 0; i < st->cfg.max_pools; i++) {
        pool *p = st->pools[i];
        if (p == NULL)
            continue;
        uint64_t used = p->nfree;
        for (size_t j = 0; j < st->nseqs; j++)
            if (st->seqs[j]->pool == p)
                used += seq_blocks_held(st->seqs[j]);
        for (const session *se = st->sessions; se != NULL; se = se->next)
            for (const store_scratch *sc = se->scratch; se->pool == p && sc != NULL; sc = sc->next)
                used += sc->nblocks;
        if (used != p->block_count) {
            snprintf(why, sizeof why, "%llu of %u blocks accounted for", (unsigned long long)used,
                     p->block_count);
            return why;
        }
    }
    for (size_t j = 0; j < st->nseqs; j++) {
        seq *q = st->seqs[j];
        for (uint32_t l = 0; l < q->nlayers; l++)
            for (uint32_t k = 0; k < q->heads; k++) {
                const seq_list *ly = &q->lists[(size_t)l * q->heads + k];
                size_t segs = kv_segments_tokens(ly->segs, ly->nsegs);
                uint32_t host = seq_list_tokens(q, l, k, NULL);
                if (segs != host) {
                    snprintf(why, sizeof why,
                             "list (%u, %u) has %zu tokens in segments, %u in "
                             "the host",
                             l, k, segs, host);
                    return why;
                }
            }
    }
    return NULL;
}

/* ---- the cases ---------------------------------------------------------- */

typedef struct fault_case {
    const char *name;
    void (*prepare)(fixture *f);
    status_code (*run)(fixture *f, status *s);
} fault_case;

/* Attach */
static void prep_session(fixture *f)
{
    open_store(f);
}

/* The pool's K/V are all different values, as a worker's would be, so
 * that a call writing a slot in place shows in the snapshot. */
static void prep_pool_sized(fixture *f, size_t pool_bytes)
{
    open_store_sized(f, pool_bytes);
    attach(f, f->token);
    pool *p = f->st->pools[0];
    float *kv = (float *)p->base;
    for (size_t i = 0; i < p->bytes / sizeof *kv; i++)
        kv[i] = (float)((int)(i % 251) - 125) / 64.0f;
}

static void prep_pool(fixture *f)
{
    prep_pool_sized(f, 64 << 10);
}

static status_code run_attach(fixture *f, status *s)
{
    store_attach_result r;
    return store_attach(f->st, f->token, "m", &geom, "w", &r, s);
}

static status_code run_attach_other(fixture *f, status *s)
{
    store_attach_result r;
    return store_attach(f->st, f->other, "m", &geom, "w", &r, s);
}

/* The fd socket's RING: the session's ring is made on first use. */
static status_code run_ring(fixture *f, status *s)
{
    int fd = -1;
    size_t bytes;
    status_code rc =
        store_transport_fd(f->st, 1, ring_transport_open, RING_BYTES_DEFAULT, &fd, &bytes, s);
    if (fd >= 0)
        close(fd);
    return rc;
}

static status_code run_session_open(fixture *f, status *s)
{
    char token[STORE_TOKEN_LEN + 1];
    return store_session_open(f->st, 300, 1000, 1000, 3, token, s);
}

/* CreateSequence: the store's array grows on the first one. */
static const char *const kv_sketch_victims[] = {"n_sink", "1", "window", "4", "victims", "sketch"};
static const char *const kv_int8_victims[] = {"n_sink", "0", "window", "4", "victims", "int8"};
static const char *const kv_h2o[] = {"budget", "4", "recent", "2"};
static const char *const kv_h2o_int8[] = {"budget", "32", "recent",      "4",
                                          "int8",   "on", "int8_window", "2"};

static status_code create(fixture *f, const char *policy, const char *const *kv, size_t n,
                          status *s)
{
    uint64_t id;
    return create_kv(f, policy, kv, n, &id, s);
}

static status_code run_create_full(fixture *f, status *s)
{
    return create(f, "full", NULL, 0, s);
}

static status_code run_create_streaming(fixture *f, status *s)
{
    return create(f, "streaming", kv_sketch_victims, 3, s);
}

static status_code run_create_h2o(fixture *f, status *s)
{
    return create(f, "h2o", kv_h2o_int8, 4, s);
}

static status_code run_create_reviver(fixture *f, status *s)
{
    return create(f, "reviver", NULL, 0, s);
}

static status_code run_create_adakv(fixture *f, status *s)
{
    return create(f, "adakv", NULL, 0, s);
}

/* Append */
static void prep_full(fixture *f)
{
    prep_pool(f);
    new_seq(f, "full", NULL, 0);
}

static void prep_full_tail(fixture *f)
{
    prep_full(f);
    append_each(f, 3);
    ack_all(f);
}

/* streaming keeps sink 0 and a window of 4: the next append's step evicts. */
static void prep_streaming(fixture *f)
{
    prep_pool(f);
    new_seq(f, "streaming", (const char *const[]){"n_sink", "1", "window", "4"}, 2);
    append_each(f, 9);
    ack_all(f);
}

/* victims=sketch: the next append's step inserts its victims. */
static void prep_sketch_victims(fixture *f)
{
    prep_pool(f);
    new_seq(f, "streaming", kv_sketch_victims, 3);
    append_each(f, 9);
    ack_all(f);
}

/* victims=int8: 11 victims wait at full precision; the next append's step
 * adds the 12th, and an INT8 block's worth is quantised. */
static void prep_int8_victims(fixture *f)
{
    prep_pool(f);
    new_seq(f, "streaming", kv_int8_victims, 3);
    seq *q = the_seq(f);
    assert_int_equal(q->tier.l8.block_tokens, 12);
    while (q->lists[0].noffloaded < 11)
        append_each(f, 1);
    ack_all(f);
}

static status_code run_append(fixture *f, status *s)
{
    store_table w;
    status_code rc = store_append(f->st, f->token, f->seq_id, 6, 0, &w, s);
    store_table_free(&w);
    return rc;
}

/* Step: a sequence of `policy` with `tokens` appended in one call, acked,
 * and the statistics its next step needs ready. */
static void prep_stepped_sized(fixture *f, size_t pool_bytes, const char *policy,
                               const char *const *kv, size_t n, int64_t tokens)
{
    prep_pool_sized(f, pool_bytes);
    new_seq(f, policy, kv, n);
    store_table w;
    status s;
    must(store_append(f->st, f->token, f->seq_id, tokens, 0, &w, &s), &s, "append");
    store_table_free(&w);
    ack_all(f);
    make_stats(f);
}

static void prep_stepped(fixture *f, const char *policy, const char *const *kv, size_t n,
                         int64_t tokens)
{
    prep_stepped_sized(f, 64 << 10, policy, kv, n, tokens);
}

static void prep_h2o(fixture *f)
{
    prep_stepped(f, "h2o", kv_h2o, 2, 9);
}

/* Lists long enough that the step decides without the store's lock
 * (FAULTS_UNLOCKED_DECISION_TOKENS): 2 layers of 170 tokens cut to 160.
 * A failure after the decision rolls back its policy host. */
static void prep_h2o_long(fixture *f)
{
    static const char *const kv[] = {"budget", "160", "recent", "8"};
    prep_stepped_sized(f, 1 << 20, "h2o", kv, 2, 170);
    assert_true(seq_tokens_held(the_seq(f)) >= FAULTS_UNLOCKED_DECISION_TOKENS);
}

/* A prompt over lists long enough that its application runs detached from
 * the pool (seq.h seq_detach): 2 layers of 340 tokens cut to 160, the
 * survivors compacted into blocks of the reserve. */
static void prep_h2o_prompt(fixture *f)
{
    static const char *const kv[] = {"budget", "160", "recent", "8"};
    prep_stepped_sized(f, 1 << 20, "h2o", kv, 2, 340);
    f->prefill = 1;
}

/* The prompt's step; when nothing failed in it, it was applied detached. */
static status_code run_prompt_detached(fixture *f, status *s)
{
    uint64_t detached = f->st->detached_applications;
    unsigned failed = faults.failed;
    status_code rc = step(f, s);
    if (rc == ST_OK && faults.failed == failed)
        assert_int_equal(f->st->detached_applications, detached + 1);
    return rc;
}

/* int8=on keeps the 2 newest at full precision: 24 tokens decided INT8,
 * two INT8 blocks' worth, demoted at this step. */
static void prep_h2o_int8(fixture *f)
{
    prep_stepped(f, "h2o", kv_h2o_int8, 4, 26);
}

static void prep_reviver(fixture *f)
{
    prep_stepped(f, "reviver", (const char *const[]){"budget", "8"}, 1, 20);
}

static void prep_adakv(fixture *f)
{
    prep_stepped(f, "adakv", (const char *const[]){"window", "2", "budget", "4"}, 2, 12);
}

/* Value merges write a kept token's slot in place. */
static void prep_weightedkv(fixture *f)
{
    prep_stepped(f, "weightedkv",
                 (const char *const[]){"cache_size", "8", "n_init", "1", "n_recent", "2"}, 3, 12);
}

/* Key re-rotation writes kept tokens' keys in place. */
static void prep_ov_block(fixture *f)
{
    prep_stepped(f, "ov_block",
                 (const char *const[]){"start_size", "4", "recent_size", "4", "max_cache_size",
                                       "12", "apply_rotation", "1"},
                 4, 20);
}

static void prep_confkv(fixture *f)
{
    prep_stepped(f, "confkv",
                 (const char *const[]){"budget_tight", "4", "budget_loose", "6", "protect", "1"}, 3,
                 12);
}

static void prep_tova(fixture *f)
{
    prep_stepped(f, "tova", (const char *const[]){"budget", "5"}, 1, 12);
}

static void prep_criticalkv(fixture *f)
{
    prep_stepped(f, "criticalkv", (const char *const[]){"window", "2", "budget", "4"}, 2, 12);
}

static status_code run_step(fixture *f, status *s)
{
    return step(f, s);
}

/* h2o keeping its victims (victims=sketch, victims=int8): a step left
 * five victims a list, three tokens came, and the next step's victims are
 * older than some of the first ones: they go between them (the list's save
 * copies the victims from there on, seq_txn_save_list_from). */
static void prep_h2o_victims(fixture *f, const char *mode)
{
    const char *const kv[] = {"budget", "4", "recent", "2", "victims", mode};
    prep_stepped(f, "h2o", kv, 3, 9);
    status s;
    must(step(f, &s), &s, "step");
    store_table w;
    must(store_append(f->st, f->token, f->seq_id, 3, 0, &w, &s), &s, "append");
    store_table_free(&w);
    ack_all(f);
    free(f->stats);
    make_stats(f);
}

static void prep_h2o_sketch_victims(fixture *f)
{
    prep_h2o_victims(f, "sketch");
}

static void prep_h2o_int8_victims(fixture *f)
{
    prep_h2o_victims(f, "int8");
}

/* After a step: lists cut down, the policy's own state, INT8 blocks. */
static void prep_h2o_stepped(fixture *f)
{
    prep_h2o(f);
    status s;
    must(step(f, &s), &s, "step");
}

static void prep_h2o_int8_stepped(fixture *f)
{
    prep_h2o_int8(f);
    status s;
    must(step(f, &s), &s, "step");
}

static void prep_weightedkv_stepped(fixture *f)
{
    prep_weightedkv(f);
    status s;
    must(step(f, &s), &s, "step");
}

/* Every list of b has a's sketch cells (an import of a's export). */
static void assert_same_sketches(seq *a, seq *b)
{
    for (size_t i = 0; i < seq_nlists(a); i++) {
        const tier_sketch *x = &a->lists[i].sketch, *y = &b->lists[i].sketch;
        size_t bytes = tier_sketch_bytes(x);
        assert_int_equal(tier_sketch_bytes(y), bytes);
        if (bytes == 0)
            continue;
        size_t cells = (size_t)x->sk.rows * x->sk.buckets, fl = cells * x->sk.dim * sizeof(float);
        assert_memory_equal(x->sk.key, y->sk.key, fl);
        assert_memory_equal(x->sk.value, y->sk.value, fl);
        assert_memory_equal(x->sk.count, y->sk.count, cells * sizeof(int32_t));
    }
}

/* Export and import (seq.h seq_export_describe, seq_import), as the store
 * runs them for ExportSequence and ImportSequence but for the remote store:
 * the sequence described, its blocks copied into blocks of the same pool,
 * rebuilt there and dropped again. A failure anywhere leaves the sequence
 * and the pool as they were; so does success, the copy being dropped. */
static status_code run_move(fixture *f, status *s)
{
    seq *q = the_seq(f), *copy = NULL;
    pool *p = seq_pool(q);
    seq_export x;
    status_code rc = seq_export_describe(q, &x, s);
    if (rc != ST_OK)
        return rc;
    uint32_t *blocks = malloc((x.nblocks ? x.nblocks : 1) * sizeof *blocks);
    uint8_t *bytes = malloc(x.nblocks ? x.nblocks * p->block_bytes : 1);
    if (blocks == NULL || bytes == NULL || x.nblocks > p->nfree) {
        rc = status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        for (size_t i = 0; i < x.nblocks; i++)
            pool_alloc_block(p, &blocks[i]);
        assert_int_equal(pool_read_blocks(p, x.blocks, x.nblocks, bytes), 0);
        assert_int_equal(seq_export_read_sketches(q, &x), 0); /* as store_remote.c */
        assert_int_equal(pool_write_blocks(p, blocks, x.nblocks, bytes), 0);
        rc = seq_import(f->seq_id + 100, seq_session_id(q), p, &x, blocks, &copy, s);
        if (rc != ST_OK) { /* the blocks are still ours */
            for (size_t i = x.nblocks; i-- > 0;)
                pool_free_block(p, blocks[i]);
        } else {
            assert_int_equal(seq_appended(copy), seq_appended(q));
            assert_same_sketches(q, copy);
        }
        seq_destroy(copy); /* its blocks with it */
    }
    free(blocks);
    free(bytes);
    seq_export_free(&x);
    return rc;
}

/* Stats and /metrics: a snapshot copied out under the lock (service_stats.c
 * answers RESOURCE_EXHAUSTED when it fails). */
static status_code run_snapshot(fixture *f, status *s)
{
    snapshot sn;
    int rc = store_snapshot(f->st, &sn);
    snapshot_free(&sn);
    return rc == 0 ? ST_OK : status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
}

/* ReleaseSequence: it frees, but finding the blocks allocates. */
static status_code run_release(fixture *f, status *s)
{
    uint32_t freed;
    return store_seq_release(f->st, f->token, f->seq_id, &freed, s);
}

/* GetBlockTable (ack 0: nothing to free) */
static status_code run_get_table(fixture *f, status *s)
{
    store_table t;
    status_code rc = store_get_table(f->st, f->token, f->seq_id, 0, 1, &t, s);
    store_table_free(&t);
    return rc;
}

/* Revive: held full-precision tokens and sketch or INT8 victims. */
static void prep_revive_sketch(fixture *f)
{
    prep_sketch_victims(f);
    append_each(f, 1);
    ack_all(f);
}

static void prep_revive_int8(fixture *f)
{
    prep_int8_victims(f);
    append_each(f, 2);
    ack_all(f);
}

static status_code run_revive(fixture *f, status *s)
{
    store_revive_result r;
    status_code rc =
        store_revive(f->st, f->token, f->seq_id, &(seq_revive_request){1, 0, 0, 0, 0, 0}, &r, s);
    store_revive_result_free(&r);
    return rc;
}

static void prep_scratch(fixture *f)
{
    prep_revive_sketch(f);
    store_revive_result r;
    status s;
    must(store_revive(f->st, f->token, f->seq_id, &(seq_revive_request){0, 0, 0, 0, 0, 0}, &r, &s),
         &s, "revive");
    f->scratch_id = r.scratch_id;
    store_revive_result_free(&r);
}

static status_code run_scratch_release(fixture *f, status *s)
{
    uint32_t freed;
    return store_scratch_release(f->st, f->token, f->scratch_id, &freed, s);
}

/* Operator calls on a full-policy sequence of 20 tokens. */
static void prep_operator(fixture *f)
{
    prep_full(f);
    append_each(f, 20);
    ack_all(f);
}

/* Positions 0..11 INT8 and 12..15 in the sketch: a revive brings both back. */
static void prep_operator_tiers(fixture *f)
{
    prep_operator(f);
    operator_call(f, POLICY_INT8, 0, 12);
    operator_call(f, POLICY_SKETCH, 12, 4);
    ack_all(f);
}

/* 18 tokens, 0..11 INT8: the tail block has two never-written slots, which
 * the first two revived tokens take. */
static void prep_operator_tail(fixture *f)
{
    prep_full(f);
    append_each(f, 18);
    operator_call(f, POLICY_INT8, 0, 12);
    ack_all(f);
}

static status_code run_operator(fixture *f, policy_tier to, uint32_t first, uint32_t count,
                                status *s)
{
    operator_range r = {first, count};
    operator_evict_result out;
    return operator_apply(f->st, f->token, f->seq_id, to, &r, 1, NULL, 0, &out, s);
}

static status_code run_demote(fixture *f, status *s)
{
    return run_operator(f, POLICY_INT8, 0, 15, s);
}

static status_code run_offload(fixture *f, status *s)
{
    return run_operator(f, POLICY_SKETCH, 2, 9, s);
}

static status_code run_evict(fixture *f, status *s)
{
    return run_operator(f, POLICY_EVICT, 1, 10, s);
}

static status_code run_operator_revive(fixture *f, status *s)
{
    return run_operator(f, POLICY_FULL, 0, 20, s);
}

static status_code run_operator_revive_int8(fixture *f, status *s)
{
    return run_operator(f, POLICY_FULL, 0, 12, s);
}

/* victims=sketch with victims in the sketch (export carries its cells);
 * reviver after a step, its own sketch holding tokens of the lists. */
static void prep_move_sketch(fixture *f)
{
    prep_revive_sketch(f);
    assert_true(tier_sketch_bytes(&the_seq(f)->lists[0].sketch) > 0);
}

static void prep_reviver_stepped(fixture *f)
{
    prep_reviver(f);
    status s;
    must(step(f, &s), &s, "step");
    seq *q = the_seq(f);
    uint32_t tokens[POLICY_TIERS];
    seq_list_tier_tokens(q, 0, 0, tokens);
    assert_true(tokens[POLICY_SKETCH] > 0);
}

/* Spill (seq.h "Spilling victims to the remote tier"): victims=int8 with
 * two INT8 victim blocks a list; victims=sketch with victims in each
 * list's sketch. */
static void prep_spill_int8(fixture *f)
{
    prep_pool(f);
    new_seq(f, "streaming", kv_int8_victims, 3);
    while (the_seq(f)->lists[0].nvictim_blocks < 2)
        append_each(f, 1);
    ack_all(f);
    assert_int_equal(seq_spill_candidates(the_seq(f)), 4);
}

static void prep_spill_sketch(fixture *f)
{
    prep_revive_sketch(f);
    assert_int_equal(seq_spill_candidates(the_seq(f)), 2);
}

/* The spill store_spill.c runs: plan; the host copy (the store's own
 * buffer, not the call's: taken with the countdown paused, since a plan
 * that stands has numbered its parts, and a spill abandoned after it
 * wastes them, as the header says); read; the values "written" (kept by
 * the fixture with keep); commit, which needs no memory: it runs with
 * every allocation failing and must try none, and commits every part
 * (nothing changed meanwhile). */
static status_code spill(fixture *f, int keep, status *s)
{
    seq *q = the_seq(f);
    uint32_t parts = seq_spill_parts(q);
    seq_spill p;
    status_code rc = seq_spill_plan(q, &p, s);
    if (rc != ST_OK) {
        assert_int_equal(seq_spill_parts(q), parts); /* a failed plan wastes no part */
        return rc;
    }
    assert_true(p.n > 0);
    assert_int_equal(seq_spill_parts(q), parts + p.n);
    fault_state saved = faults_pause();
    uint8_t *host = malloc(p.bytes);
    assert_non_null(host);
    faults_resume(saved);
    if (seq_spill_read(q, &p, host) != 0) {
        rc = status_set(s, ST_RESOURCE_EXHAUSTED, "reading the victims failed");
    } else {
        saved = faults_pause();
        faults_arm(0, 1);
        seq_spill_commit(q, &p);
        unsigned tried = faults_disarm();
        faults_resume(saved);
        if (tried > 0)
            fail_msg("%s: seq_spill_commit tried %u allocations", current, tried);
        for (size_t i = 0; i < p.n; i++)
            assert_int_equal(p.blocks[i].committed, 1);
        for (size_t i = 0; keep && i < p.n; i++) {
            assert_true(f->nparts < sizeof f->parts / sizeof f->parts[0]);
            uint8_t *v = malloc(p.blocks[i].bytes);
            assert_non_null(v);
            memcpy(v, host + p.blocks[i].offset, p.blocks[i].bytes);
            f->parts[f->nparts].part = p.blocks[i].part;
            f->parts[f->nparts].bytes = v;
            f->parts[f->nparts++].len = p.blocks[i].bytes;
        }
    }
    saved = faults_pause();
    free(host);
    faults_resume(saved);
    seq_spill_free(&p);
    return rc;
}

static status_code run_spill(fixture *f, status *s)
{
    return spill(f, 0, s);
}

/* Revive after a spill: layer 0's positions, the spilled ones fetched. */
static const seq_revive_request revive_layer0 = {0, 0, 0, 0, 0, 0};

/* The K/V of what a Revive rebuilt, as tier_read reads them (malloc'd). */
static uint8_t *revived_kv(seq *q, const seq_revived *out)
{
    size_t n = out->ntokens, bytes = n * tier_token_bytes(&q->tier), t = 0;
    tier_token *tok = malloc((n ? n : 1) * sizeof *tok);
    uint8_t *stage = tier_stage_alloc(&q->tier, n), *kv = malloc(bytes ? bytes : 1);
    assert_non_null(tok);
    assert_non_null(stage);
    assert_non_null(kv);
    for (size_t i = 0; i < out->nsegs; i++)
        for (uint32_t j = 0; j < out->segs[i].count; j++)
            tok[t++] = (tier_token){out->segs[i].block, out->segs[i].first_slot + j, POLICY_FULL};
    assert_int_equal(t, n);
    assert_int_equal(tier_read(&q->tier, tok, n, stage, stage + bytes / 2), 0);
    assert_int_equal(q->pool->backend->ops->copy(KV_DEVICE_TO_HOST, kv, stage, bytes), 0);
    tier_stage_free(&q->tier, stage);
    free(tok);
    return kv;
}

/* Give a Revive's scratch blocks back, scribbled over first (so that a
 * later Revive into the same blocks shows what it wrote, not what this
 * one did), in reverse: the free stack as before the Revive. */
static void revived_release(seq *q, seq_revived *out)
{
    pool *p = seq_pool(q);
    for (size_t b = out->nblocks; b-- > 0;) {
        memset(p->base + (size_t)out->blocks[b] * p->block_bytes, 0x5a, p->block_bytes);
        pool_free_block(p, out->blocks[b]);
    }
    free(out->segs);
    free(out->positions);
    free(out->src_tier);
    free(out->blocks);
}

/* After prep: the Revive of layer 0 taken before any spill (what a Revive
 * after it must give), then a spill whose values the fixture keeps. */
static void prep_spilled(fixture *f, void (*prep)(fixture *f))
{
    prep(f);
    seq *q = the_seq(f);
    seq_revived out;
    status s;
    must(seq_revive(q, &revive_layer0, &out, &s), &s, "revive before the spill");
    f->want_n = out.ntokens;
    assert_non_null(f->want_pos = malloc(out.ntokens * sizeof *f->want_pos));
    assert_non_null(f->want_tier = malloc(out.ntokens));
    memcpy(f->want_pos, out.positions, out.ntokens * sizeof *f->want_pos);
    memcpy(f->want_tier, out.src_tier, out.ntokens);
    f->want_kv = revived_kv(q, &out);
    revived_release(q, &out);
    must(spill(f, 1, &s), &s, "spill");
    assert_true(seq_spilled_tokens(q) > 0);
}

static void prep_spilled_int8(fixture *f)
{
    prep_spilled(f, prep_spill_int8);
}

static void prep_spilled_sketch(fixture *f)
{
    prep_spilled(f, prep_spill_sketch);
}

/* The Revive the store runs for spilled victims: plan, each remote part
 * supplied with the bytes the spill wrote under its number, fill, finish
 * (with -1 when a supply or the fill failed). A failure gives every block
 * back, the free stack exactly as before the plan; a success rebuilds
 * what the Revive before the spill did, bit for bit. */
static status_code run_revive_spilled(fixture *f, status *s)
{
    seq *q = the_seq(f);
    pool *p = seq_pool(q);
    uint32_t nfree = p->nfree, stack[128];
    assert_true(nfree <= 128);
    memcpy(stack, p->free_stack, nfree * sizeof *stack);
    seq_revive_job *job;
    seq_revived out;
    status_code rc = seq_revive_plan(q, &revive_layer0, &job, s);
    if (rc == ST_OK) {
        const seq_remote_part *rp;
        size_t n = seq_revive_remote(job, &rp);
        assert_true(n > 0);
        int fill = 0;
        for (size_t i = 0; fill == 0 && i < n; i++) {
            size_t j = 0;
            while (j < f->nparts && f->parts[j].part != rp[i].part)
                j++;
            if (j == f->nparts)
                fail_msg("%s: part %u was never written", current, rp[i].part);
            fill = seq_revive_supply(job, i, f->parts[j].bytes, f->parts[j].len);
        }
        if (fill == 0)
            fill = seq_revive_fill(job);
        rc = seq_revive_finish(job, fill, &out, s);
    }
    if (rc != ST_OK) {
        if (p->nfree != nfree || memcmp(p->free_stack, stack, nfree * sizeof *stack) != 0)
            fail_msg("%s: a failed Revive left %u free blocks (%u before) or the free stack "
                     "in another order",
                     current, p->nfree, nfree);
        return rc;
    }
    fault_state saved = faults_pause();
    if (out.ntokens != f->want_n ||
        memcmp(out.positions, f->want_pos, f->want_n * sizeof *f->want_pos) != 0 ||
        memcmp(out.src_tier, f->want_tier, f->want_n) != 0)
        fail_msg("%s: revived other positions or tiers than before the spill", current);
    uint8_t *kv = revived_kv(q, &out);
    if (memcmp(kv, f->want_kv, f->want_n * tier_token_bytes(&q->tier)) != 0)
        fail_msg("%s: revived other K/V than before the spill", current);
    free(kv);
    revived_release(q, &out);
    faults_resume(saved);
    return ST_OK;
}

static const fault_case cases[] = {
    {"session_open", prep_session, run_session_open},
    {"attach: new pool", prep_session, run_attach},
    {"attach: existing pool", prep_pool, run_attach_other},
    {"ring: first use", prep_pool, run_ring},
    {"create: full", prep_pool, run_create_full},
    {"create: streaming victims=sketch", prep_pool, run_create_streaming},
    {"create: h2o int8=on", prep_pool, run_create_h2o},
    {"create: reviver", prep_pool, run_create_reviver},
    {"create: adakv", prep_pool, run_create_adakv},
    {"append: full, fresh", prep_full, run_append},
    {"append: full, tail", prep_full_tail, run_append},
    {"append: streaming evicts", prep_streaming, run_append},
    {"append: victims=sketch", prep_sketch_victims, run_append},
    {"append: victims=int8", prep_int8_victims, run_append},
    {"step: h2o evicts", prep_h2o, run_step},
    {"step: h2o int8=on demotes", prep_h2o_int8, run_step},
    {"step: h2o decided without the lock", prep_h2o_long, run_step},
    {"step: h2o prompt applied detached", prep_h2o_prompt, run_prompt_detached},
    {"step: h2o victims=sketch between victims", prep_h2o_sketch_victims, run_step},
    {"step: h2o victims=int8 between victims", prep_h2o_int8_victims, run_step},
    {"step: reviver", prep_reviver, run_step},
    {"step: adakv (per head)", prep_adakv, run_step},
    {"step: weightedkv merges", prep_weightedkv, run_step},
    {"step: ov_block re-rotates", prep_ov_block, run_step},
    {"step: confkv", prep_confkv, run_step},
    {"step: tova", prep_tova, run_step},
    {"step: criticalkv", prep_criticalkv, run_step},
    {"move: h2o", prep_h2o_stepped, run_move},
    {"move: weightedkv (per head)", prep_weightedkv_stepped, run_move},
    {"move: h2o int8=on", prep_h2o_int8_stepped, run_move},
    {"move: streaming victims=sketch", prep_move_sketch, run_move},
    {"move: reviver sketched", prep_reviver_stepped, run_move},
    {"spill: victims=int8", prep_spill_int8, run_spill},
    {"spill: victims=sketch", prep_spill_sketch, run_spill},
    {"revive: spilled int8 victims", prep_spilled_int8, run_revive_spilled},
    {"revive: spilled sketch victims", prep_spilled_sketch, run_revive_spilled},
    {"get_table", prep_operator, run_get_table},
    {"stats snapshot", prep_revive_sketch, run_snapshot},
    {"release: victims", prep_revive_int8, run_release},
    {"revive: sketch victims", prep_revive_sketch, run_revive},
    {"revive: int8 victims", prep_revive_int8, run_revive},
    {"scratch_release", prep_scratch, run_scratch_release},
    {"operator: demote", prep_operator, run_demote},
    {"operator: offload", prep_operator, run_offload},
    {"operator: evict", prep_operator, run_evict},
    {"operator: revive", prep_operator_tiers, run_operator_revive},
    {"operator: revive into the tail", prep_operator_tail, run_operator_revive_int8},
};

#define MAX_ALLOCATIONS 100000

/* The state the case's call leads to when nothing fails. */
static void reference(const fault_case *c, snap *out)
{
    fixture g;
    c->prepare(&g);
    status s;
    snprintf(current, sizeof current, "%s, nothing failing", c->name);
    must(c->run(&g, &s), &s, c->name);
    snap_take(&g, out);
    close_store(&g);
}

/* What one drive of a case saw. */
typedef struct tally {
    long absorbed; /* failures the call absorbed, succeeding */
    long failed;   /* failures the call answered RESOURCE_EXHAUSTED */
} tally;

/* NULL when the failed call left the store exactly as before and, run
 * again with nothing failing, leads where it leads without the failure;
 * else what differs. */
static const char *check_failed(const fault_case *c, fixture *f, const snap *before,
                                const snap *ref)
{
    static char why[320];
    snap after;
    snap_take(f, &after);
    const char *diff = snap_diff(before, &after);
    snap_free(&after);
    if (diff != NULL) {
        snprintf(why, sizeof why, "changed %s", diff);
        return why;
    }
    status s = {ST_OK, ""};
    status_code rc = c->run(f, &s);
    if (rc != ST_OK) {
        snprintf(why, sizeof why, "run again, answered %s \"%s\"", status_name(rc), s.msg);
        return why;
    }
    snap_take(f, &after);
    diff = snap_diff(ref, &after);
    snap_free(&after);
    if (diff != NULL) {
        snprintf(why, sizeof why, "run again, differs from the reference in %s", diff);
        return why;
    }
    return NULL;
}

/* Run one case with the n-th allocation failing, n = 0, 1, ...; returns
 * how many allocations the call makes. */
static long drive(const fault_case *c, int persistent, tally *t)
{
    const char *mode = persistent ? "persistent" : "transient";
    memset(t, 0, sizeof *t);
    snap ref;
    reference(c, &ref);
    for (long n = 0; n < MAX_ALLOCATIONS; n++) {
        fixture f;
        c->prepare(&f);
        snap before;
        snap_take(&f, &before);
        status s = {ST_OK, ""};
        snprintf(current, sizeof current, "%s, allocation %ld (%s)", c->name, n, mode);
        faults_arm(n, persistent);
        status_code rc = c->run(&f, &s);
        unsigned failed = faults_disarm();
        const char *why = NULL;
        char msg[480];
        if (failed == 0 && rc != ST_OK)
            fail_msg("%s: fails without a fault: %s %s", c->name, status_name(rc), s.msg);
        if (rc == ST_OK) {
            t->absorbed += failed > 0;
            why = accounting(&f);
        } else if (rc != ST_RESOURCE_EXHAUSTED) {
            snprintf(msg, sizeof msg, "answered %s \"%s\", not RESOURCE_EXHAUSTED", status_name(rc),
                     s.msg);
            why = msg;
        } else {
            t->failed++;
            why = check_failed(c, &f, &before, &ref);
            if (why != NULL) {
                snprintf(msg, sizeof msg, "failed (%s) and %s", s.msg, why);
                why = msg;
            }
        }
        if (why != NULL)
            fail_msg("%s: %s", current, why);
        snap_free(&before);
        close_store(&f);
        if (failed == 0) {
            snap_free(&ref);
            return n;
        }
    }
    fail_msg("%s: still allocating after %d allocations", c->name, MAX_ALLOCATIONS);
    return -1;
}

static void test_case(void **state)
{
    const fault_case *c = *state;
    faults_disarm(); /* a case that crashed may have left it armed */
    tally t, p;
    long n = drive(c, 0, &t);
    long m = drive(c, 1, &p);
    /* The call allocates the same whether or not an earlier run failed. */
    assert_int_equal(n, m);
    print_message("faults: %-34s %3ld allocations; failed %ld/%ld, absorbed %ld/%ld "
                  "(transient/persistent)\n",
                  c->name, n, t.failed, p.failed, t.absorbed, p.absorbed);
}

int main(void)
{
    /* FAULTS_CASE="append*" runs only the matching cases (cmocka's filter). */
    if (getenv("FAULTS_CASE") != NULL)
        cmocka_set_test_filter(getenv("FAULTS_CASE"));
    enum { N = sizeof cases / sizeof cases[0] };
    struct CMUnitTest tests[N];
    for (size_t i = 0; i < N; i++)
        tests[i] = (struct CMUnitTest){cases[i].name, test_case, NULL, NULL, (void *)&cases[i]};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
