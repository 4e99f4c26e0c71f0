/* Stats and Inspect for operators: Stats from a snapshot of the store
 * (store_snapshot), Inspect from one sequence under the store's lock. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstash/v1/store.pb-c.h"
#include "pbgrpc.h"
#include "service.h"

/* The storage tiers as Stats and Inspect name them (policy_tier_name, in
 * policy_stored_tiers order). "full" is full precision in the pool's dtype
 * (fp16, bf16 or fp32). */
#define NTIERS POLICY_STORED_TIERS

/* SequenceStats.tiers from NTIERS caller-provided entries: tokens and
 * bytes by storage tier. */
static void sequence_tiers(const snapshot_seq *q, Kvstash__V1__SequenceStats *out,
                           Kvstash__V1__TierStats *t, Kvstash__V1__TierStats **ptrs)
{
    for (int i = 0; i < NTIERS; i++) {
        uint8_t tier = policy_stored_tiers[i];
        kvstash__v1__tier_stats__init(&t[i]);
        t[i].tier = (char *)policy_tier_name(tier);
        t[i].tokens = q->tier_tokens[tier];
        t[i].bytes = q->tier_bytes[tier];
        ptrs[i] = &t[i];
    }
    out->tiers = ptrs;
    out->n_tiers = NTIERS;
}

/* The strings point into q. */
static void sequence_stats(const snapshot_seq *q, Kvstash__V1__SequenceStats *out)
{
    kvstash__v1__sequence_stats__init(out);
    out->seq_id = q->id;
    out->session_id = q->session_id;
    out->policy = (char *)q->policy->name;
    out->label = (char *)q->label;
    out->epoch = q->epoch;
    out->appended = q->appended;
    out->tokens = q->tokens;
    out->blocks = q->blocks;
    out->bytes = q->bytes;
    out->sketch_reserved_bytes = q->sketch_reserved;
    out->spilled_tokens = q->spilled_tokens;
    out->spilled_bytes = q->spilled_bytes;
}

static void pool_stats(const snapshot_pool *p, Kvstash__V1__PoolStats *out,
                       Kvstash__V1__Geometry *g)
{
    kvstash__v1__pool_stats__init(out);
    service_geometry_to_proto(&p->geom, g);
    out->pool_id = p->id;
    out->model = (char *)p->model;
    out->tenant = (char *)p->tenant;
    out->geometry = g;
    out->block_bytes = p->block_bytes;
    out->blocks_total = p->blocks_total;
    out->blocks_free = p->blocks_free;
    out->blocks_retired = p->blocks_retired;
    out->blocks_quarantined = p->blocks_quarantined;
    out->blocks_used = p->blocks_total - p->blocks_free - p->blocks_retired - p->blocks_quarantined;
    out->bytes_total = p->bytes;
    out->sessions = p->sessions;
}

static void session_stats(const snapshot_session *se, Kvstash__V1__SessionStats *out)
{
    kvstash__v1__session_stats__init(out);
    out->session_id = se->id;
    out->pid = se->pid;
    out->uid = se->uid;
    out->worker_name = (char *)se->name;
    out->pool_id = se->pool_id;
    out->sequences = se->nseqs;
    out->attached_ms = se->attached_age_ms;
    out->lease_open = se->lease_open;
    out->lease_ms = se->lease_age_ms;
    out->blocks = se->blocks;
}

/* The limits and their use; sketch cells allocated over every pool. */
/* The remote tier as last seen; NULL when there is none. */
static Kvstash__V1__RemoteTierStats *remote_stats(snapshot *sn, Kvstash__V1__RemoteTierStats *out)
{
    remote_tier_status *r = &sn->remote;
    if (!r->configured)
        return NULL;
    kvstash__v1__remote_tier_stats__init(out);
    out->backend = r->backend;
    out->seeds = r->seeds;
    out->key_namespace = r->ns;
    out->healthy = r->health.ok;
    out->connected = r->connected;
    out->nodes = r->health.nodes;
    out->nodes_up = r->health.nodes_up;
    out->slots_covered = r->health.slots_covered;
    out->calls = r->health.calls;
    out->errors = r->health.errors;
    out->timeouts = r->health.timeouts;
    out->redirects = r->health.redirects;
    out->refreshes = r->health.refreshes;
    out->bytes_written = r->health.bytes_written;
    out->bytes_read = r->health.bytes_read;
    out->probes = r->probes;
    out->probe_failures = r->probe_failures;
    out->last_error = r->health.last_error;
    out->last_ok_age_ms = r->last_ok_age_ms == UINT64_MAX ? -1 : (int64_t)r->last_ok_age_ms;
    out->ttl_s = r->ttl_s;
    out->timeout_ms = r->timeout_ms;
    return out;
}

static void limits_stats(const snapshot *sn, Kvstash__V1__Limits *out)
{
    kvstash__v1__limits__init(out);
    out->daemon_memory_bytes = sn->mem_limit;
    out->sketch_reserved_bytes = sn->mem_reserved;
    for (size_t k = 0; k < sn->npools; k++)
        out->sketch_allocated_bytes += sn->pools[k].tier_bytes[POLICY_SKETCH];
    out->session_max_seqs = sn->session_max_seqs;
    out->session_max_blocks = sn->session_max_blocks;
    out->max_reply_bytes = sn->max_reply;
}

typedef struct stats_buf {
    Kvstash__V1__PoolStats *pools, **pool_ptrs;
    Kvstash__V1__Geometry *geoms;
    Kvstash__V1__SessionStats *sessions, **session_ptrs;
    Kvstash__V1__SequenceStats *seqs, **seq_ptrs;
    Kvstash__V1__TierStats *seq_tiers, **seq_tier_ptrs; /* NTIERS per sequence, with_tiers */
    const char **policies;
} stats_buf;

static int stats_buf_alloc(stats_buf *b, size_t npools, size_t nsessions, size_t nseqs,
                           size_t npolicies)
{
    b->pools = calloc(npools + 1, sizeof *b->pools);
    b->pool_ptrs = calloc(npools + 1, sizeof *b->pool_ptrs);
    b->geoms = calloc(npools + 1, sizeof *b->geoms);
    b->sessions = calloc(nsessions + 1, sizeof *b->sessions);
    b->session_ptrs = calloc(nsessions + 1, sizeof *b->session_ptrs);
    b->seqs = calloc(nseqs + 1, sizeof *b->seqs);
    b->seq_ptrs = calloc(nseqs + 1, sizeof *b->seq_ptrs);
    b->policies = calloc(npolicies + 1, sizeof *b->policies);
    b->seq_tiers = calloc(NTIERS * nseqs + 1, sizeof *b->seq_tiers);
    b->seq_tier_ptrs = calloc(NTIERS * nseqs + 1, sizeof *b->seq_tier_ptrs);
    return b->pools && b->pool_ptrs && b->geoms && b->sessions && b->session_ptrs && b->seqs &&
                   b->seq_ptrs && b->policies && b->seq_tiers && b->seq_tier_ptrs
               ? 0
               : -1;
}

static void stats_buf_free(stats_buf *b)
{
    free(b->pools);
    free(b->pool_ptrs);
    free(b->geoms);
    free(b->sessions);
    free(b->session_ptrs);
    free(b->seqs);
    free(b->seq_ptrs);
    free(b->seq_tiers);
    free(b->seq_tier_ptrs);
    free(b->policies);
}

static void fill_stats(const snapshot *sn, stats_buf *b, int with_tiers,
                       Kvstash__V1__StatsResponse *out, Kvstash__V1__TierStats *total)
{
    out->uptime_ms = sn->uptime_ms;
    for (size_t k = 0; k < sn->npools; k++) {
        pool_stats(&sn->pools[k], &b->pools[k], &b->geoms[k]);
        b->pool_ptrs[k] = &b->pools[k];
    }
    out->n_pools = sn->npools;
    out->pools = b->pool_ptrs;
    for (size_t k = 0; k < sn->nsessions; k++) {
        session_stats(&sn->sessions[k], &b->sessions[k]);
        b->session_ptrs[k] = &b->sessions[k];
    }
    out->n_sessions = sn->nsessions;
    out->sessions = b->session_ptrs;
    for (size_t i = 0; i < sn->nseqs; i++) {
        sequence_stats(&sn->seqs[i], &b->seqs[i]);
        if (with_tiers)
            sequence_tiers(&sn->seqs[i], &b->seqs[i], &b->seq_tiers[NTIERS * i],
                           &b->seq_tier_ptrs[NTIERS * i]);
        b->seq_ptrs[i] = &b->seqs[i];
        for (int t = 0; t < NTIERS; t++) {
            total[t].tokens += sn->seqs[i].tier_tokens[policy_stored_tiers[t]];
            total[t].bytes += sn->seqs[i].tier_bytes[policy_stored_tiers[t]];
        }
    }
    out->n_sequences = sn->nseqs;
    out->sequences = b->seq_ptrs;
}

status_code service_stats(void *app, const char *token, const ProtobufCMessage *m,
                          grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__StatsRequest *req = (const void *)m;
    size_t npolicies;
    const policy_ops *const *pol = policy_list(&npolicies);
    Kvstash__V1__StatsResponse out = KVSTASH__V1__STATS_RESPONSE__INIT;
    Kvstash__V1__TierStats tiers[NTIERS];
    Kvstash__V1__TierStats *tier_ptrs[NTIERS];
    for (int i = 0; i < NTIERS; i++) {
        kvstash__v1__tier_stats__init(&tiers[i]);
        tiers[i].tier = (char *)policy_tier_name(policy_stored_tiers[i]);
        tier_ptrs[i] = &tiers[i];
    }
    stats_buf b = {0};
    snapshot sn = {0};
    Kvstash__V1__Limits limits;
    Kvstash__V1__RemoteTierStats remote;
    store_caller who; /* others' sessions and sequences are operators' to see */
    if (store_identify(app, token, &who, st) != ST_OK)
        return st->code;
    status_code rc = ST_OK;
    if (store_snapshot_for(app, &who, &sn) != 0 ||
        stats_buf_alloc(&b, sn.npools, sn.nsessions, sn.nseqs, npolicies) != 0) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        out.version = KVSTASH_VERSION;
        out.backend = (char *)sn.backend;
        out.device = sn.backend_info.device;
        out.device_name = sn.backend_info.device_name;
        out.ipc = sn.backend_info.ipc;
        out.lease_end = sn.lease_end_quarantine ? "quarantine" : "free";
        out.quarantined_sessions = sn.quarantined_sessions;
        out.quarantined_blocks = sn.quarantined_blocks;
        out.serving = sn.serving;
        out.pid = (int32_t)getpid();
        out.pending_sessions = sn.pending;
        limits_stats(&sn, &limits);
        out.limits = &limits;
        out.remote = remote_stats(&sn, &remote);
        fill_stats(&sn, &b, req->with_tiers, &out, tiers);
        for (size_t i = 0; i < npolicies; i++)
            b.policies[i] = pol[i]->name;
        out.policies = (char **)b.policies;
        out.n_policies = npolicies;
        out.tiers = tier_ptrs;
        out.n_tiers = NTIERS;
        out.events_published = sn.events;
        *resp = pbgrpc_pack(&out.base);
    }
    snapshot_free(&sn);
    stats_buf_free(&b);
    return rc;
}

/* A layer summed over its lists (one, or one per KV head). */
static void layer_inspect(seq *q, uint32_t layer, Kvstash__V1__LayerInspect *out)
{
    kvstash__v1__layer_inspect__init(out);
    out->layer = layer;
    int any = 0;
    for (uint32_t k = 0; k < seq_heads(q); k++) {
        seq_list_view ly;
        seq_list_view_get(q, layer, k, &ly);
        const uint32_t *pos = ly.positions;
        uint32_t n = ly.tokens;
        out->tokens += n;
        out->blocks += seq_list_blocks(q, layer, k);
        uint32_t by[POLICY_TIERS];
        seq_list_tier_tokens(q, layer, k, by);
        out->tokens_int8 += by[POLICY_INT8];
        out->tokens_int4 += by[POLICY_INT4];
        out->tokens_int2 += by[POLICY_INT2];
        out->tokens_sketch += by[POLICY_SKETCH];
        out->offloaded += (uint32_t)ly.noffloaded;
        if (n == 0)
            continue;
        if (!any || pos[0] < out->first_position)
            out->first_position = pos[0];
        if (!any || pos[n - 1] > out->last_position)
            out->last_position = pos[n - 1];
        any = 1;
    }
}

#define INSPECT_RUNS_DEFAULT 1024
#define INSPECT_RUNS_MAX 65536 /* per list, and over the whole response */

/* The maps and retired epochs of an InspectResponse, built under the lock. */
typedef struct inspect_buf {
    Kvstash__V1__LayerInspect *layers, **layer_ptrs;
    Kvstash__V1__ListMap *maps, **map_ptrs;
    Kvstash__V1__TierRun *runs, **run_ptrs; /* shared by the maps */
    size_t nruns, runs_cap;
    Kvstash__V1__RetiredEpoch *retired, **retired_ptrs;
} inspect_buf;

static void inspect_buf_free(inspect_buf *b)
{
    free(b->layers);
    free(b->layer_ptrs);
    free(b->maps);
    free(b->map_ptrs);
    free(b->runs);
    free(b->run_ptrs);
    free(b->retired);
    free(b->retired_ptrs);
}

/* Runs compare tier names by address. */
static const char evicted_tier[] = "evicted", offloaded_tier[] = "offloaded";

/* Append a run to map m, merging with its last run; 0, or -1 when full. */
static int map_add(inspect_buf *b, Kvstash__V1__ListMap *m, size_t cap, uint32_t first,
                   uint32_t count, const char *tier)
{
    Kvstash__V1__TierRun *last = m->n_runs ? m->runs[m->n_runs - 1] : NULL;
    if (last != NULL && last->tier == tier && last->first_position + last->count == first) {
        last->count += count;
        return 0;
    }
    if (m->n_runs >= cap || b->nruns >= b->runs_cap) {
        m->truncated = 1;
        return -1;
    }
    Kvstash__V1__TierRun *r = &b->runs[b->nruns];
    kvstash__v1__tier_run__init(r);
    r->first_position = first;
    r->count = count;
    r->tier = (char *)tier;
    b->run_ptrs[b->nruns++] = r;
    m->n_runs++;
    return 0;
}

/* Positions [from, to) that are not held: "offloaded" where the list's
 * offloaded array (from index *j on) has them, else "evicted". */
static int map_gap(inspect_buf *b, Kvstash__V1__ListMap *m, size_t cap, const seq_list_view *ly,
                   size_t *j, uint64_t from, uint64_t to)
{
    while (from < to) {
        while (*j < ly->noffloaded && ly->offloaded[*j] < from)
            (*j)++;
        int off = *j < ly->noffloaded && ly->offloaded[*j] == from;
        if (map_add(b, m, cap, (uint32_t)from, 1, off ? offloaded_tier : evicted_tier) != 0)
            return -1;
        from++;
    }
    return 0;
}

/* Runs over positions 0 .. appended-1 of list (l, k): held tokens by the
 * tier they are stored in, the gaps between them "offloaded" or "evicted". */
static void list_map(seq *q, uint32_t l, uint32_t k, size_t cap, inspect_buf *b,
                     Kvstash__V1__ListMap *m)
{
    kvstash__v1__list_map__init(m);
    m->layer = l;
    m->head = k;
    m->per_head = seq_heads(q) > 1;
    m->runs = &b->run_ptrs[b->nruns];
    seq_list_view ly;
    seq_list_view_get(q, l, k, &ly);
    const uint32_t *pos = ly.positions;
    uint32_t i = 0;
    uint64_t next = 0;
    size_t j = 0;
    for (size_t sg = 0; sg < ly.nsegs; sg++)
        for (uint32_t c = 0; c < ly.segs[sg].count && i < ly.tokens; c++, i++) {
            if (map_gap(b, m, cap, &ly, &j, next, pos[i]) != 0 ||
                map_add(b, m, cap, pos[i], 1, policy_tier_name(ly.seg_tier[sg])) != 0)
                return;
            next = (uint64_t)pos[i] + 1;
        }
    map_gap(b, m, cap, &ly, &j, next, seq_appended(q));
}

static int u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Retired blocks grouped by the epoch the worker must ack, oldest first. */
static int retired_epochs(const seq *q, inspect_buf *b, Kvstash__V1__InspectResponse *out)
{
    const seq_retired *retired;
    size_t n = seq_retired_blocks(q, &retired);
    uint64_t *ep = malloc((n ? n : 1) * sizeof *ep);
    b->retired = calloc(n + 1, sizeof *b->retired);
    b->retired_ptrs = calloc(n + 1, sizeof *b->retired_ptrs);
    if (ep == NULL || b->retired == NULL || b->retired_ptrs == NULL) {
        free(ep);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        ep[i] = retired[i].epoch;
    qsort(ep, n, sizeof *ep, u64_cmp);
    for (size_t i = 0; i < n; i++) {
        if (out->n_retired == 0 || b->retired[out->n_retired - 1].epoch != ep[i]) {
            Kvstash__V1__RetiredEpoch *r = &b->retired[out->n_retired];
            kvstash__v1__retired_epoch__init(r);
            r->epoch = ep[i];
            b->retired_ptrs[out->n_retired++] = r;
        }
        b->retired[out->n_retired - 1].blocks++;
    }
    out->retired = b->retired_ptrs;
    free(ep);
    return 0;
}

/* Runs a list's map may have (InspectRequest.max_runs). */
static size_t inspect_list_runs(const Kvstash__V1__InspectRequest *req)
{
    return req->max_runs == 0                 ? INSPECT_RUNS_DEFAULT
           : req->max_runs > INSPECT_RUNS_MAX ? INSPECT_RUNS_MAX
                                              : req->max_runs;
}

/* Runs q's maps may have in all, with `cap` a list. */
static size_t inspect_runs(seq *q, size_t cap)
{
    size_t nlists = (size_t)seq_layers(q) * seq_heads(q), runs = 0;
    /* A list of n tokens has at most 2n + 1 runs. */
    for (size_t i = 0; i < nlists && runs < INSPECT_RUNS_MAX; i++) {
        size_t most = 2 * (size_t)seq_list_tokens(q, (uint32_t)(i / seq_heads(q)),
                                                  (uint32_t)(i % seq_heads(q)), NULL) +
                      1;
        runs += most < cap ? most : cap;
    }
    return runs > INSPECT_RUNS_MAX ? INSPECT_RUNS_MAX : runs;
}

static int inspect_fill(seq *q, const Kvstash__V1__InspectRequest *req, inspect_buf *b,
                        Kvstash__V1__InspectResponse *out)
{
    size_t nlists = (size_t)seq_layers(q) * seq_heads(q);
    b->layers = calloc(seq_layers(q), sizeof *b->layers);
    b->layer_ptrs = calloc(seq_layers(q), sizeof *b->layer_ptrs);
    if (b->layers == NULL || b->layer_ptrs == NULL || retired_epochs(q, b, out) != 0)
        return -1;
    for (uint32_t l = 0; l < seq_layers(q); l++) {
        layer_inspect(q, l, &b->layers[l]);
        b->layer_ptrs[l] = &b->layers[l];
    }
    out->layers = b->layer_ptrs;
    out->n_layers = seq_layers(q);
    if (!req->with_map)
        return 0;
    size_t cap = inspect_list_runs(req);
    b->runs_cap = inspect_runs(q, cap);
    b->maps = calloc(nlists, sizeof *b->maps);
    b->map_ptrs = calloc(nlists, sizeof *b->map_ptrs);
    b->runs = calloc(b->runs_cap + 1, sizeof *b->runs);
    b->run_ptrs = calloc(b->runs_cap + 1, sizeof *b->run_ptrs);
    if (b->maps == NULL || b->map_ptrs == NULL || b->runs == NULL || b->run_ptrs == NULL)
        return -1;
    for (size_t i = 0; i < nlists; i++) {
        list_map(q, (uint32_t)(i / seq_heads(q)), (uint32_t)(i % seq_heads(q)), cap, b,
                 &b->maps[i]);
        b->map_ptrs[i] = &b->maps[i];
    }
    out->maps = b->map_ptrs;
    out->n_maps = nlists;
    return 0;
}

/* RESOURCE_EXHAUSTED when Inspect of q could reply more than the reply limit
 * (--max-reply-mb): its summary and parameters (4 KiB), a LayerInspect a
 * layer, and with the map a ListMap a list and its runs (at most
 * INSPECT_RUNS_MAX in all, a varint pair and a tier name each). */
static status_code inspect_check_reply(store *s, seq *q, const Kvstash__V1__InspectRequest *req,
                                       status *st)
{
    uint64_t limit = store_max_reply(s), nlists = (uint64_t)seq_layers(q) * seq_heads(q);
    uint64_t bytes = 4096 + (uint64_t)seq_layers(q) * 64 + seq_retired_count(q) * 16;
    if (req->with_map)
        bytes += nlists * 24 + (uint64_t)inspect_runs(q, inspect_list_runs(req)) * 32;
    if (limit == 0 || bytes <= limit)
        return ST_OK;
    return status_set(st, ST_RESOURCE_EXHAUSTED,
                      "Inspect of sequence %llu could reply %llu bytes, over --max-reply-mb "
                      "(%llu bytes)%s",
                      (unsigned long long)seq_id_of(q), (unsigned long long)bytes,
                      (unsigned long long)limit,
                      req->with_map ? ": ask without with_map, or raise --max-reply-mb"
                                    : ": raise --max-reply-mb");
}

status_code service_inspect(void *app, const char *token, const ProtobufCMessage *m,
                            grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__InspectRequest *req = (const void *)m;
    store *s = app;
    inspect_buf b = {0};
    status_code rc = ST_OK;
    store_lock_seq(s, req->seq_id); /* its host may be deciding without the lock */
    seq *q;
    Kvstash__V1__InspectResponse out = KVSTASH__V1__INSPECT_RESPONSE__INIT;
    rc = store_find_seq_visible_locked(s, token, req->seq_id, &q, st);
    if (rc == ST_OK)
        rc = inspect_check_reply(s, q, req, st);
    if (rc == ST_OK && inspect_fill(q, req, &b, &out) != 0)
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (rc == ST_OK) {
        Kvstash__V1__SequenceStats ss;
        Kvstash__V1__TierStats tiers[NTIERS], *tier_ptrs[NTIERS];
        Kvstash__V1__Param params[POLICY_MAX_PARAMS];
        Kvstash__V1__Param *param_ptrs[POLICY_MAX_PARAMS];
        snapshot_seq qs;
        store_seq_snapshot(q, &qs);
        sequence_stats(&qs, &ss);
        sequence_tiers(&qs, &ss, tiers, tier_ptrs);
        out.sequence = &ss;
        service_params_to_proto(seq_params(q), params, param_ptrs);
        out.params = param_ptrs;
        out.n_params = seq_params(q)->count;
        *resp = pbgrpc_pack(&out.base);
    }
    store_unlock(s);
    inspect_buf_free(&b);
    return rc;
}
