/* Stats and Inspect: snapshots of the store for operators, built under the
 * store's lock. */
#include <stdlib.h>
#include <string.h>

#include "kvstash/v1/store.pb-c.h"
#include "pbgrpc.h"
#include "service.h"

static void sequence_stats(seq *q, Kvstash__V1__SequenceStats *out)
{
    kvstash__v1__sequence_stats__init(out);
    out->seq_id = q->id;
    out->session_id = q->session_id;
    out->policy = (char *)q->policy->name;
    out->label = (char *)q->label;
    out->epoch = q->epoch;
    out->appended = q->appended;
    out->tokens = seq_tokens_held(q);
    out->blocks = seq_blocks_held(q);
    out->bytes = (uint64_t)out->blocks * q->pool->block_bytes;
}

static void pool_stats(const pool *p, Kvstash__V1__PoolStats *out, Kvstash__V1__Geometry *g,
                       uint32_t retired)
{
    kvstash__v1__pool_stats__init(out);
    service_geometry_to_proto(&p->geom, g);
    out->pool_id = p->id;
    out->model = (char *)p->model;
    out->geometry = g;
    out->block_bytes = p->block_bytes;
    out->blocks_total = p->block_count;
    out->blocks_free = p->nfree;
    out->blocks_retired = retired;
    out->blocks_used = p->block_count - p->nfree - retired;
    out->bytes_total = p->bytes;
    out->sessions = p->sessions;
}

static void session_stats(const session *se, uint64_t now, Kvstash__V1__SessionStats *out)
{
    kvstash__v1__session_stats__init(out);
    out->session_id = se->id;
    out->pid = se->pid;
    out->uid = se->uid;
    out->worker_name = (char *)se->name;
    out->pool_id = se->pool->id;
    out->sequences = se->nseqs;
    out->attached_ms = now - se->attached_ms;
    out->lease_open = se->lease_open;
}

typedef struct stats_buf {
    Kvstash__V1__PoolStats *pools, **pool_ptrs;
    Kvstash__V1__Geometry *geoms;
    Kvstash__V1__SessionStats *sessions, **session_ptrs;
    Kvstash__V1__SequenceStats *seqs, **seq_ptrs;
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
    return b->pools && b->pool_ptrs && b->geoms && b->sessions && b->session_ptrs && b->seqs &&
                   b->seq_ptrs && b->policies
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
    free(b->policies);
}

static uint32_t pool_retired(const store *st, const pool *p)
{
    uint32_t n = 0;
    for (size_t i = 0; i < st->nseqs; i++)
        if (st->seqs[i]->pool == p)
            n += (uint32_t)seq_retired_count(st->seqs[i]);
    return n;
}

static void fill_stats(store *st, stats_buf *b, Kvstash__V1__StatsResponse *out,
                       Kvstash__V1__TierStats *fp16)
{
    uint64_t now = store_now_ms();
    out->uptime_ms = now - st->start_ms;
    for (uint32_t i = 0; i < st->cfg.max_pools; i++)
        if (st->pools[i] != NULL) {
            size_t k = out->n_pools++;
            pool_stats(st->pools[i], &b->pools[k], &b->geoms[k], pool_retired(st, st->pools[i]));
            b->pool_ptrs[k] = &b->pools[k];
        }
    out->pools = b->pool_ptrs;
    for (session *se = st->sessions; se != NULL; se = se->next)
        if (se->attached) {
            size_t k = out->n_sessions++;
            session_stats(se, now, &b->sessions[k]);
            b->session_ptrs[k] = &b->sessions[k];
        }
    out->sessions = b->session_ptrs;
    for (size_t i = 0; i < st->nseqs; i++) {
        sequence_stats(st->seqs[i], &b->seqs[i]);
        b->seq_ptrs[i] = &b->seqs[i];
        fp16->tokens += b->seqs[i].tokens;
        fp16->bytes += b->seqs[i].bytes;
    }
    out->n_sequences = st->nseqs;
    out->sequences = b->seq_ptrs;
}

status_code service_stats(void *app, const char *token, const ProtobufCMessage *m,
                          grpc_byte_buffer **resp, status *st)
{
    (void)token;
    (void)m;
    store *s = app;
    size_t npolicies;
    const policy_ops *const *pol = policy_list(&npolicies);
    Kvstash__V1__StatsResponse out = KVSTASH__V1__STATS_RESPONSE__INIT;
    Kvstash__V1__TierStats tiers[3];
    Kvstash__V1__TierStats *tier_ptrs[3];
    const char *tier_names[3] = {"fp16", "int8", "sketch"};
    for (int i = 0; i < 3; i++) {
        kvstash__v1__tier_stats__init(&tiers[i]);
        tiers[i].tier = (char *)tier_names[i];
        tier_ptrs[i] = &tiers[i];
    }
    stats_buf b = {0};
    store_lock(s);
    size_t nsessions = 0;
    for (session *se = s->sessions; se != NULL; se = se->next)
        nsessions++;
    status_code rc = ST_OK;
    if (stats_buf_alloc(&b, s->cfg.max_pools, nsessions, s->nseqs, npolicies) != 0) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        out.version = KVSTASH_VERSION;
        out.backend = "host";
        fill_stats(s, &b, &out, &tiers[0]);
        for (size_t i = 0; i < npolicies; i++)
            b.policies[i] = pol[i]->name;
        out.policies = (char **)b.policies;
        out.n_policies = npolicies;
        out.tiers = tier_ptrs;
        out.n_tiers = 3;
        out.events_published = events_count(s->events);
        *resp = pbgrpc_pack(&out.base);
    }
    store_unlock(s);
    stats_buf_free(&b);
    return rc;
}

/* A layer summed over its lists (one, or one per KV head). */
static void layer_inspect(seq *q, uint32_t layer, Kvstash__V1__LayerInspect *out)
{
    kvstash__v1__layer_inspect__init(out);
    out->layer = layer;
    int any = 0;
    for (uint32_t k = 0; k < q->heads; k++) {
        const seq_list *ly = &q->lists[(size_t)layer * q->heads + k];
        const uint32_t *pos;
        uint32_t n = seq_list_tokens(q, layer, k, &pos);
        out->tokens += n;
        for (size_t i = 0; i < ly->nsegs; i++)
            out->blocks += i == 0 || ly->segs[i].block != ly->segs[i - 1].block;
        if (n == 0)
            continue;
        if (!any || pos[0] < out->first_position)
            out->first_position = pos[0];
        if (!any || pos[n - 1] > out->last_position)
            out->last_position = pos[n - 1];
        any = 1;
    }
}

status_code service_inspect(void *app, const char *token, const ProtobufCMessage *m,
                            grpc_byte_buffer **resp, status *st)
{
    (void)token;
    const Kvstash__V1__InspectRequest *req = (const void *)m;
    store *s = app;
    store_lock(s);
    seq *q = store_find_seq_locked(s, req->seq_id);
    status_code rc = ST_OK;
    Kvstash__V1__LayerInspect *layers = NULL;
    Kvstash__V1__LayerInspect **layer_ptrs = NULL;
    if (q == NULL) {
        rc = status_set(st, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)req->seq_id);
    } else {
        layers = calloc(q->nlayers, sizeof *layers);
        layer_ptrs = calloc(q->nlayers, sizeof *layer_ptrs);
        if (layers == NULL || layer_ptrs == NULL)
            rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (rc == ST_OK) {
        Kvstash__V1__InspectResponse out = KVSTASH__V1__INSPECT_RESPONSE__INIT;
        Kvstash__V1__SequenceStats ss;
        Kvstash__V1__Param params[POLICY_MAX_PARAMS];
        Kvstash__V1__Param *param_ptrs[POLICY_MAX_PARAMS];
        sequence_stats(q, &ss);
        out.sequence = &ss;
        service_params_to_proto(&q->params, params, param_ptrs);
        out.params = param_ptrs;
        out.n_params = q->params.count;
        for (uint32_t l = 0; l < q->nlayers; l++) {
            layer_inspect(q, l, &layers[l]);
            layer_ptrs[l] = &layers[l];
        }
        out.layers = layer_ptrs;
        out.n_layers = q->nlayers;
        *resp = pbgrpc_pack(&out.base);
    }
    store_unlock(s);
    free(layers);
    free(layer_ptrs);
    return rc;
}
