#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helper.h"
#include "kvstash_ring.h"
#include "store.h"
#include "util.h"

/* Spin this many polls before sleeping: a decode step's next request often
 * comes within microseconds, and a futex sleep + wake costs more. */
#define RING_SPIN 4000
/* The longest futex sleep before the thread looks at its stop flag again:
 * ring_close wakes it at once, but the worker shares the futex word and can
 * move it back, so the wake alone cannot be trusted to end a session. */
#define RING_WAIT_SLICE_NS (50 * 1000 * 1000)

struct ring {
    store *store;
    char token[STORE_TOKEN_LEN + 1];
    int fd;
    size_t bytes;
    ring_header *hdr;
    uint8_t *data;
    size_t data_bytes;
    float *scratch; /* private copy of a step's statistics */
    size_t scratch_cap;
    helper *helper; /* lent to decode steps, made by the first (helper.h) */
    int helper_failed;
    pthread_t thread;
    /* The daemon's own stop flag, in its own memory: the thread obeys this
     * alone. The shared header's `closing` is only a courtesy to the worker,
     * which can write it (issue 12: a worker that kept resetting it kept its
     * ring thread, and the fd-socket thread joining it, alive). */
    atomic_int stop;
    atomic_int ended; /* set by the thread as it returns: ring_join will not wait */
};

/* Sleep while *word == seen, for at most one slice (or until woken). */
static void futex_wait(_Atomic uint32_t *word, uint32_t seen)
{
    struct timespec slice = {0, RING_WAIT_SLICE_NS};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &slice, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Wait until req_seq moves past `seen` or the ring is stopped; returns
 * req_seq as read once. Every sleep is bounded by RING_WAIT_SLICE_NS, so a
 * stop is seen within a slice whatever the worker does to the header. */
static uint32_t wait_request(ring *rg, uint32_t seen)
{
    ring_header *h = rg->hdr;
    _Atomic uint32_t *req = (_Atomic uint32_t *)&h->req_seq;
    _Atomic uint32_t *waiter = (_Atomic uint32_t *)&h->daemon_waiting;
    for (int i = 0; i < RING_SPIN; i++) {
        uint32_t cur = atomic_load(req);
        if (cur != seen || atomic_load(&rg->stop))
            return cur;
        /* Yield now and then: if the worker shares our CPU, spinning alone
         * would only delay the request we wait for. */
        if (i % 32 == 31)
            sched_yield();
        else
            cpu_relax();
    }
    for (;;) {
        atomic_store(waiter, 1);
        uint32_t cur = atomic_load(req);
        if (cur != seen || atomic_load(&rg->stop)) {
            atomic_store(waiter, 0);
            return cur;
        }
        futex_wait(req, seen);
    }
}

static void respond(ring_response *r, status_code code, const char *msg)
{
    r->code = code;
    snprintf(r->msg, sizeof r->msg, "%s", code == ST_OK ? "" : msg);
}

/* After an append's writes, at `at` in the data area, the demotion's moves
 * it carries (proto/kvstash_ring.h ring_append_moves), when they fit. */
static void moves_put(ring *rg, ring_response *r, const store_table *w, size_t at)
{
    size_t room = rg->data_bytes > at ? rg->data_bytes - at : 0;
    if (w->nmoves == 0 || room < sizeof(ring_append_moves) ||
        w->nmoves > (room - sizeof(ring_append_moves)) / sizeof(ring_moved_run))
        return;
    ring_append_moves h = {w->moves_from, w->moves_to, (uint32_t)w->nmoves, 0};
    memcpy(rg->data + at, &h, sizeof h);
    ring_moved_run *run = (ring_moved_run *)(rg->data + at + sizeof h);
    for (size_t i = 0; i < w->nmoves; i++) {
        const seq_moved_run *m = &w->moves[i];
        run[i] = (ring_moved_run){m->list, m->first, m->count, m->block, m->first_slot, m->tier};
    }
    r->moves = 1;
}

/* APPEND: the new tokens' segments go to the data area, layer by layer. */
static void serve_append(ring *rg, const ring_request *q, ring_response *r)
{
    store_table w;
    status s;
    /* The answer below, refused before the append when it cannot fit. */
    store_reply_form f = {.limit = rg->data_bytes,
                          .list_bytes = 4,
                          .segment_bytes = 12,
                          .limit_name = "the ring's data area"};
    if (store_append_within(rg->store, rg->token, q->seq_id, q->count, q->ack_epoch, &f, &w, &s) !=
        ST_OK) {
        respond(r, s.code, s.msg);
        return;
    }
    size_t need = 0;
    for (uint32_t l = 0; l < w.nlists; l++)
        need += 4 + w.lists[l].nsegs * 12;
    if (need > rg->data_bytes) {
        /* The append happened; only the answer does not fit. */
        respond(r, ST_RESOURCE_EXHAUSTED, "append reply exceeds the ring; use GetBlockTable");
    } else {
        uint32_t *out = (uint32_t *)rg->data;
        for (uint32_t l = 0; l < w.nlists; l++) {
            *out++ = (uint32_t)w.lists[l].nsegs;
            memcpy(out, w.lists[l].segs, w.lists[l].nsegs * 12);
            out += w.lists[l].nsegs * 3;
            r->nsegments += (uint32_t)w.lists[l].nsegs;
        }
        r->lists_per_layer = w.nlists / (w.nlists ? w.lists[w.nlists - 1].layer + 1 : 1);
        moves_put(rg, r, &w, (need + 7) / 8 * 8);
        respond(r, ST_OK, "");
    }
    r->epoch = w.epoch;
    r->evicted = w.evicted;
    r->first_position = w.first_position;
    store_table_free(&w);
}

/* A step's answer when it only cut tokens out (proto/kvstash_ring.h
 * ring_step_cuts); the statistics in the data area were copied out. */
typedef struct cuts_put_ctx {
    ring *rg;
    ring_response *r;
} cuts_put_ctx;

static void cuts_put(void *ctx, const seq_cuts *c)
{
    cuts_put_ctx *x = ctx;
    uint64_t words = (uint64_t)c->nlists + c->total;
    if (words > (x->rg->data_bytes - sizeof(ring_step_cuts)) / sizeof(uint32_t))
        return;
    ring_step_cuts h = {c->from_epoch, (uint32_t)c->nlists, (uint32_t)c->total};
    memcpy(x->rg->data, &h, sizeof h);
    uint32_t *count = (uint32_t *)(x->rg->data + sizeof h), *idx = count + c->nlists;
    memcpy(count, c->count, c->nlists * sizeof *count);
    for (size_t i = 0; i < c->nlists; i++) {
        if (c->count[i] == 0) /* idx may be NULL: no step has cut yet */
            continue;
        memcpy(idx, c->idx + c->first[i], c->count[i] * sizeof *idx);
        idx += c->count[i];
    }
    x->r->cuts = 1;
}

/* The ring's helper for a decode step (helper.h), made the first time;
 * NULL when it cannot be. A prompt's decision may move to a background
 * thread at idle priority, which must not borrow this normal one. */
static const policy_helper *ring_helper(ring *rg)
{
    if (rg->helper == NULL && !rg->helper_failed) {
        rg->helper = helper_create();
        rg->helper_failed = rg->helper == NULL;
    }
    return rg->helper != NULL ? helper_lend(rg->helper) : NULL;
}

/* STEP: the statistics are copied out of shared memory before anything
 * reads them (seq_step_input.copy), or taken by a policy that takes them
 * itself, so a worker that scribbles on them while the daemon reads cannot
 * change what was checked. */
static void serve_step(ring *rg, const ring_request *q, ring_response *r)
{
    if (q->data_bytes > rg->data_bytes || q->data_bytes % sizeof(float) != 0) {
        respond(r, ST_INVALID_ARGUMENT, "data_bytes exceeds the ring or is not whole floats");
        return;
    }
    size_t n = q->data_bytes / sizeof(float);
    if (n > rg->scratch_cap) {
        float *grown = realloc(rg->scratch, n * sizeof *grown);
        if (grown == NULL) {
            respond(r, ST_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        rg->scratch = grown;
        rg->scratch_cap = n;
    }
    /* Copied out of the ring into scratch and checked as it is copied, a
     * layer's part before its policy step, on the threads that step the
     * layers (seq_step_input.copy): the worker cannot change what is
     * checked, and no thread copies it all before the step begins. A
     * policy that takes its statistics itself reads the ring instead. */
    seq_step_input in = {.arrays = q->arrays,
                         .new_tokens = q->new_tokens,
                         .prefill = (int)(q->prefill != 0),
                         .score_queries = q->score_queries,
                         .window_queries = q->window_queries,
                         .confidence = q->confidence,
                         .data = (const float *)rg->data,
                         .nfloats = n,
                         .copy = rg->scratch,
                         .helper = q->prefill ? NULL : ring_helper(rg)};
    status s;
    cuts_put_ctx cuts = {rg, r};
    if (store_step(rg->store, rg->token, q->seq_id, q->ack_epoch, &in, cuts_put, &cuts, &r->epoch,
                   &r->evicted, &s) != ST_OK)
        respond(r, s.code, s.msg);
    else
        respond(r, ST_OK, "");
}

/* The request struct a REVIVE or RELEASE_SCRATCH put at the start of the
 * data area, copied out once; 0 when data_bytes does not say its size. */
static int request_copy(const ring *rg, const ring_request *q, void *out, size_t size)
{
    if (q->data_bytes != size || size > rg->data_bytes)
        return 0;
    memcpy(out, rg->data, size);
    return 1;
}

/* A layer table's arrays as the REVIVE and TABLE answers hold them
 * (proto/kvstash_ring.h): uint32 block[n], first_slot[n], count[n], then
 * its first npos positions; returns the end. */
static uint8_t *table_arrays_put(uint8_t *p, const store_layer_table *t, uint32_t npos)
{
    uint32_t *u = (uint32_t *)p;
    size_t n = t->nsegs;
    for (size_t i = 0; i < n; i++) {
        u[i] = t->segs[i].block;
        u[n + i] = t->segs[i].first_slot;
        u[2 * n + i] = t->segs[i].count;
    }
    if (npos > 0)
        memcpy(u + 3 * n, t->positions, (size_t)npos * sizeof *u);
    return (uint8_t *)(u + 3 * n + npos);
}

/* REVIVE: store_revive, as gRPC's Revive; the answer to the data area
 * (proto/kvstash_ring.h), or refused with the scratch released when it
 * would not fit. */
static void serve_revive(ring *rg, const ring_request *q, ring_response *r)
{
    ring_revive_request in;
    if (!request_copy(rg, q, &in, sizeof in)) {
        respond(r, ST_INVALID_ARGUMENT, "data_bytes is not the size of a ring_revive_request");
        return;
    }
    seq_revive_request rq = {in.layer,        in.head, in.first, in.count, in.skip_evicted != 0,
                             in.in_place != 0};
    store_revive_result out;
    status s;
    if (store_revive(rg->store, rg->token, q->seq_id, &rq, &out, &s) != ST_OK) {
        respond(r, s.code, s.msg);
        return;
    }
    const store_layer_table *t = &out.table;
    size_t need = sizeof(ring_revive_reply) + t->nsegs * 12 + (size_t)t->tokens * 5;
    if (need > rg->data_bytes) {
        uint32_t freed;
        if (out.scratch_id != 0)
            store_scratch_release(rg->store, rg->token, out.scratch_id, &freed, &s);
        respond(r, ST_RESOURCE_EXHAUSTED, "revive reply exceeds the ring; use gRPC's Revive");
    } else {
        ring_revive_reply h = {
            out.scratch_id, t->layer,           t->head, (uint32_t)(t->per_head != 0),
            t->tokens,      (uint32_t)t->nsegs, 0,       out.epoch};
        uint8_t *p = rg->data;
        memcpy(p, &h, sizeof h);
        uint8_t *end = table_arrays_put(p + sizeof h, t, t->tokens);
        memcpy(end, out.src_tier, t->tokens);
        r->nsegments = (uint32_t)t->nsegs;
        respond(r, ST_OK, "");
    }
    store_revive_result_free(&out);
}

/* The bytes one list takes in a TABLE answer (proto/kvstash_ring.h). */
static size_t table_list_bytes(const store_layer_table *t)
{
    size_t npos = t->positions != NULL ? t->tokens : 0;
    return sizeof(ring_table_list) + (3 * t->nsegs + npos) * sizeof(uint32_t) +
           (t->nsegs + 3) / 4 * 4;
}

/* One list of a TABLE answer at p; returns the end. */
static uint8_t *table_list_put(uint8_t *p, const store_layer_table *t)
{
    uint32_t n = (uint32_t)t->nsegs, npos = t->positions != NULL ? t->tokens : 0;
    ring_table_list h = {t->layer,
                         t->head,
                         (uint32_t)(t->per_head != 0),
                         t->tokens,
                         n,
                         npos,
                         t->int8_block_tokens,
                         t->int4_block_tokens,
                         t->int2_block_tokens,
                         t->quant_group};
    memcpy(p, &h, sizeof h);
    uint8_t *tier = table_arrays_put(p + sizeof h, t, npos);
    for (uint32_t i = 0; i < n; i++)
        tier[i] = t->tiers != NULL ? t->tiers[i] : POLICY_FULL;
    return tier + (n + 3) / 4 * 4;
}

/* TABLE's store_table_reader: the lent table written into the data
 * area (ctx, the ring), with the answer's segment count. */
typedef struct table_answer {
    ring *rg;
    uint64_t epoch;
    uint32_t nsegments;
} table_answer;

static status_code table_put(void *ctx, const store_table *t, status *s)
{
    table_answer *a = ctx;
    /* store_lend_table bounded what is written (the same lists, under the
     * same lock); checked again, as the data area's end is not negotiable. */
    size_t need = sizeof(ring_table_reply);
    for (uint32_t l = 0; l < t->nlists; l++)
        need += table_list_bytes(&t->lists[l]);
    if (need > a->rg->data_bytes)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "table exceeds the ring; use GetBlockTable");
    ring_table_reply h = {need, t->nlists, 0};
    memcpy(a->rg->data, &h, sizeof h);
    a->epoch = t->epoch;
    uint8_t *p = a->rg->data + sizeof h;
    for (uint32_t l = 0; l < t->nlists; l++) {
        p = table_list_put(p, &t->lists[l]);
        a->nsegments += (uint32_t)t->lists[l].nsegs;
    }
    return ST_OK;
}

/* TABLE: store_get_table, as gRPC's GetBlockTable, refused before it is
 * built when it could not fit the data area, written straight into it. */
static void serve_table(ring *rg, const ring_request *q, ring_response *r)
{
    ring_table_request in;
    if (!request_copy(rg, q, &in, sizeof in)) {
        respond(r, ST_INVALID_ARGUMENT, "data_bytes is not the size of a ring_table_request");
        return;
    }
    /* A list: its header and at most 3 bytes of padding; a segment: three
     * uint32 and a tier byte. */
    store_reply_form f = {.limit = rg->data_bytes,
                          .fixed_bytes = sizeof(ring_table_reply),
                          .list_bytes = sizeof(ring_table_list) + 3,
                          .segment_bytes = 13,
                          .position_bytes = 4,
                          .limit_name = "the ring's data area (--ring-mb)"};
    table_answer a = {rg, 0, 0};
    status s;
    if (store_lend_table(rg->store, rg->token, q->seq_id, q->ack_epoch, in.with_positions != 0, &f,
                         table_put, &a, &s) != ST_OK) {
        respond(r, s.code, s.msg);
        return;
    }
    r->epoch = a.epoch;
    r->nsegments = a.nsegments;
    respond(r, ST_OK, "");
}

/* RELEASE_SCRATCH: store_scratch_release; the blocks freed to the data
 * area. */
static void serve_release(ring *rg, const ring_request *q, ring_response *r)
{
    uint64_t scratch_id;
    uint32_t freed;
    status s;
    if (!request_copy(rg, q, &scratch_id, sizeof scratch_id))
        respond(r, ST_INVALID_ARGUMENT, "data_bytes is not the size of a scratch id");
    else if (store_scratch_release(rg->store, rg->token, scratch_id, &freed, &s) != ST_OK)
        respond(r, s.code, s.msg);
    else {
        memcpy(rg->data, &freed, sizeof freed);
        respond(r, ST_OK, "");
    }
}

static void serve(ring *rg)
{
    ring_request q;
    memcpy(&q, (const void *)&rg->hdr->req, sizeof q);
    ring_response r;
    memset(&r, 0, sizeof r);
    status s;
    switch (q.op) {
    case RING_OP_PING:
        respond(&r, ST_OK, "");
        break;
    case RING_OP_EPOCH:
        if (store_epoch(rg->store, rg->token, q.seq_id, q.ack_epoch, &r.epoch, &s) != ST_OK)
            respond(&r, s.code, s.msg);
        else
            respond(&r, ST_OK, "");
        break;
    case RING_OP_APPEND:
        serve_append(rg, &q, &r);
        break;
    case RING_OP_STEP:
        serve_step(rg, &q, &r);
        break;
    case RING_OP_REVIVE:
        serve_revive(rg, &q, &r);
        break;
    case RING_OP_RELEASE_SCRATCH:
        serve_release(rg, &q, &r);
        break;
    case RING_OP_TABLE:
        serve_table(rg, &q, &r);
        break;
    default:
        respond(&r, ST_INVALID_ARGUMENT, "unknown ring op");
    }
    memcpy((void *)&rg->hdr->resp, &r, sizeof r);
}

static void *ring_thread(void *arg)
{
    ring *rg = arg;
    ring_header *h = rg->hdr;
    _Atomic uint32_t *resp = (_Atomic uint32_t *)&h->resp_seq;
    _Atomic uint32_t *worker_waiting = (_Atomic uint32_t *)&h->worker_waiting;
    /* The header starts zeroed; a worker may bump req_seq before this
     * thread first runs, so start from 0, not from what we see now. Any
     * other value the worker writes is just the next request: req_seq is
     * compared, never used as an index or a count. */
    uint32_t seen = 0;
    while (!atomic_load(&rg->stop)) {
        uint32_t cur = wait_request(rg, seen);
        if (cur == seen || atomic_load(&rg->stop))
            continue;
        seen = cur;
        serve(rg);
        atomic_store(resp, seen);
        if (atomic_load(worker_waiting))
            futex_wake(resp);
    }
    atomic_store(&rg->ended, 1);
    return NULL;
}

status_code ring_create(store *st, const char *token, size_t bytes, ring **out, status *s)
{
    *out = NULL;
    if (bytes < 2 * RING_DATA_OFFSET)
        return status_set(s, ST_INVALID_ARGUMENT, "a ring of %zu bytes has no data area", bytes);
    ring *rg = calloc(1, sizeof *rg);
    if (rg == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    rg->store = st;
    snprintf(rg->token, sizeof rg->token, "%s", token);
    rg->bytes = bytes;
    rg->fd = memfd_create("kvstash-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (rg->fd < 0 || ftruncate(rg->fd, (off_t)bytes) != 0 ||
        fcntl(rg->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        status_set(s, ST_INTERNAL, "cannot create the ring memfd: %s", strerror(errno));
        goto fail;
    }
    /* Populated up to the default size only: this runs under the store's
     * lock, and a large ring (--ring-mb) is paid for as steps touch it. */
    int populate = bytes <= RING_BYTES_DEFAULT ? MAP_POPULATE : 0;
    rg->hdr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | populate, rg->fd, 0);
    if (rg->hdr == MAP_FAILED) {
        rg->hdr = NULL;
        status_set(s, ST_INTERNAL, "cannot map the ring: %s", strerror(errno));
        goto fail;
    }
    rg->hdr->magic = RING_MAGIC;
    rg->hdr->bytes = bytes;
    rg->data = (uint8_t *)rg->hdr + RING_DATA_OFFSET;
    rg->data_bytes = bytes - RING_DATA_OFFSET;
    if (pthread_create(&rg->thread, NULL, ring_thread, rg) != 0) {
        status_set(s, ST_INTERNAL, "cannot start the ring thread");
        goto fail;
    }
    *out = rg;
    return ST_OK;
fail:
    if (rg->hdr != NULL)
        munmap(rg->hdr, bytes);
    if (rg->fd >= 0)
        close(rg->fd);
    free(rg);
    return s->code;
}

int ring_fd(const ring *r)
{
    return r->fd;
}

size_t ring_bytes(const ring *r)
{
    return r->bytes;
}

void ring_close(ring *r)
{
    atomic_store(&r->stop, 1);
    /* The worker's signal that no answer will come (it may overwrite it:
     * then only its own calls wait for their deadline). */
    atomic_store((_Atomic uint32_t *)&r->hdr->closing, 1);
    /* Move the futex word itself: a thread between its last check of
     * `stop` and FUTEX_WAIT would otherwise sleep a whole slice. */
    atomic_fetch_add((_Atomic uint32_t *)&r->hdr->req_seq, 1);
    futex_wake((_Atomic uint32_t *)&r->hdr->req_seq);
    /* A worker waiting for an answer learns that none will come. */
    atomic_fetch_add((_Atomic uint32_t *)&r->hdr->resp_seq, 1);
    futex_wake((_Atomic uint32_t *)&r->hdr->resp_seq);
}

int ring_ended(const ring *r)
{
    return atomic_load(&r->ended);
}

void ring_join(ring *r)
{
    pthread_join(r->thread, NULL);
    helper_destroy(r->helper);
    munmap(r->hdr, r->bytes);
    close(r->fd);
    free(r->scratch);
    free(r);
}

/* The ring as a store_transport. */
static void transport_close(void *r)
{
    ring_close(r);
}

static void transport_join(void *r)
{
    ring_join(r);
}

static int transport_ended(const void *r)
{
    return ring_ended(r);
}

static int transport_fd(const void *r)
{
    return ring_fd(r);
}

static size_t transport_bytes(const void *r)
{
    return ring_bytes(r);
}

status_code ring_transport_open(store *st, const char *token, size_t bytes, store_transport *out,
                                status *s)
{
    ring *r;
    if (ring_create(st, token, bytes, &r, s) != ST_OK)
        return s->code;
    *out = (store_transport){
        r, transport_close, transport_join, transport_fd, transport_bytes, transport_ended};
    return ST_OK;
}
