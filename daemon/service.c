#include "service.h"

#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kvstash/v1/store.pb-c.h"
#include "pbgrpc.h"
#include "policy.h"

#define MAX_PARAMS_PER_REQUEST POLICY_MAX_PARAMS

/* ---- conversions ---------------------------------------------------------- */

void service_geometry_to_proto(const pool_geometry *g, Kvstash__V1__Geometry *out)
{
    kvstash__v1__geometry__init(out);
    out->layers = g->layers;
    out->q_heads = g->q_heads;
    out->kv_heads = g->kv_heads;
    out->head_dim = g->head_dim;
    out->block_tokens = g->block_tokens;
    out->dtype = (Kvstash__V1__DType)g->dtype;
    out->rope_theta = g->rope_theta;
}

int service_layer_table_fill(Kvstash__V1__LayerTable *lt, const store_layer_table *src,
                             int64_t first_position)
{
    kvstash__v1__layer_table__init(lt);
    lt->layer = src->layer;
    lt->per_head = src->per_head;
    lt->head = src->head;
    lt->tokens = src->tokens;
    lt->int8_block_tokens = src->int8_block_tokens;
    lt->int4_block_tokens = src->int4_block_tokens;
    lt->int2_block_tokens = src->int2_block_tokens;
    lt->quant_group = src->quant_group;
    size_t n = src->nsegs;
    lt->block = malloc((n ? n : 1) * sizeof *lt->block);
    lt->first_slot = malloc((n ? n : 1) * sizeof *lt->first_slot);
    lt->count = malloc((n ? n : 1) * sizeof *lt->count);
    if (lt->block == NULL || lt->first_slot == NULL || lt->count == NULL)
        return -1;
    lt->n_block = lt->n_first_slot = lt->n_count = n;
    int tiered = 0;
    for (size_t i = 0; i < n; i++) {
        lt->block[i] = src->segs[i].block;
        lt->first_slot[i] = src->segs[i].first_slot;
        lt->count[i] = src->segs[i].count;
        tiered |= src->tiers != NULL && src->tiers[i] != POLICY_FULL;
    }
    if (tiered) { /* all-full lists leave the field empty */
        lt->tier = malloc(n * sizeof *lt->tier);
        if (lt->tier == NULL)
            return -1;
        lt->n_tier = n;
        for (size_t i = 0; i < n; i++)
            lt->tier[i] = src->tiers[i];
    }
    if (src->positions == NULL && first_position < 0)
        return 0;
    lt->positions = malloc((src->tokens ? src->tokens : 1) * sizeof *lt->positions);
    if (lt->positions == NULL)
        return -1;
    lt->n_positions = src->tokens;
    for (uint32_t i = 0; i < src->tokens; i++)
        lt->positions[i] = first_position >= 0 ? (uint32_t)first_position + i : src->positions[i];
    return 0;
}

void service_layer_table_clear(Kvstash__V1__LayerTable *lt)
{
    free(lt->tier);
    free(lt->block);
    free(lt->first_slot);
    free(lt->count);
    free(lt->positions);
}

/* Layer tables for a response; NULL on out of memory. */
static Kvstash__V1__LayerTable **layer_tables_new(const store_table *t, int consecutive,
                                                  Kvstash__V1__LayerTable **storage)
{
    *storage = calloc(t->nlists ? t->nlists : 1, sizeof **storage);
    Kvstash__V1__LayerTable **ptrs = calloc(t->nlists ? t->nlists : 1, sizeof *ptrs);
    if (*storage == NULL || ptrs == NULL) {
        free(*storage);
        free(ptrs);
        return NULL;
    }
    for (uint32_t l = 0; l < t->nlists; l++) {
        ptrs[l] = &(*storage)[l];
        service_layer_table_fill(ptrs[l], &t->lists[l],
                                 consecutive ? (int64_t)t->first_position : -1);
    }
    return ptrs;
}

static void layer_tables_free(Kvstash__V1__LayerTable **ptrs, Kvstash__V1__LayerTable *storage,
                              uint32_t n)
{
    for (uint32_t l = 0; storage != NULL && l < n; l++)
        service_layer_table_clear(&storage[l]);
    free(storage);
    free(ptrs);
}

static status_code oom(status *st)
{
    return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
}

void service_params_to_proto(const policy_params *p, Kvstash__V1__Param *storage,
                             Kvstash__V1__Param **ptrs)
{
    for (size_t i = 0; i < p->count; i++) {
        kvstash__v1__param__init(&storage[i]);
        storage[i].key = (char *)p->key[i];
        storage[i].value = (char *)p->value[i];
        ptrs[i] = &storage[i];
    }
}

/* ---- Store methods --------------------------------------------------------- */

static status_code do_attach(void *app, const char *token, const ProtobufCMessage *m,
                             grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__AttachRequest *req = (const Kvstash__V1__AttachRequest *)m;
    if (req->geometry == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "geometry is required");
    const Kvstash__V1__Geometry *g = req->geometry;
    pool_geometry geom = {g->layers,       g->q_heads,           g->kv_heads,  g->head_dim,
                          g->block_tokens, (pool_dtype)g->dtype, g->rope_theta};
    store_attach_result r;
    if (store_attach_tenant(app, token, req->tenant, req->model, &geom, req->worker_name, &r, st) !=
        ST_OK)
        return st->code;
    Kvstash__V1__AttachResponse out = KVSTASH__V1__ATTACH_RESPONSE__INIT;
    Kvstash__V1__Geometry og;
    service_geometry_to_proto(&r.geometry, &og);
    out.session_id = r.session_id;
    out.pool_id = r.pool_id;
    out.backend = (char *)r.backend;
    out.pool_bytes = r.pool_bytes;
    out.block_bytes = r.block_bytes;
    out.block_count = r.block_count;
    out.geometry = &og;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

static status_code do_lease_open(void *app, const char *token, const ProtobufCMessage *m,
                                 grpc_byte_buffer **first, uint64_t *cookie, status *st)
{
    (void)m;
    if (store_lease_begin(app, token, cookie, st) != ST_OK)
        return st->code;
    Kvstash__V1__LeaseMessage out = KVSTASH__V1__LEASE_MESSAGE__INIT;
    out.session_id = *cookie;
    out.state = "granted";
    *first = pbgrpc_pack(&out.base);
    return ST_OK;
}

static void do_lease_closed(void *app, uint64_t cookie)
{
    store_lease_end(app, cookie);
}

static status_code do_create_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                      grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__CreateSequenceRequest *req = (const void *)m;
    if (req->n_params > MAX_PARAMS_PER_REQUEST)
        return status_set(st, ST_INVALID_ARGUMENT, "at most %d params, got %zu",
                          MAX_PARAMS_PER_REQUEST, req->n_params);
    const char *keys[MAX_PARAMS_PER_REQUEST], *values[MAX_PARAMS_PER_REQUEST];
    for (size_t i = 0; i < req->n_params; i++) {
        keys[i] = req->params[i]->key;
        values[i] = req->params[i]->value;
    }
    store_seq_request sr = {req->policy, keys, values, req->n_params, req->label};
    store_seq_created created;
    if (store_seq_create(app, token, &sr, &created, st) != ST_OK)
        return st->code;
    Kvstash__V1__CreateSequenceResponse out = KVSTASH__V1__CREATE_SEQUENCE_RESPONSE__INIT;
    Kvstash__V1__Param storage[POLICY_MAX_PARAMS], *ptrs[POLICY_MAX_PARAMS];
    out.seq_id = created.seq_id;
    out.epoch = created.epoch;
    service_params_to_proto(&created.params, storage, ptrs);
    out.params = ptrs;
    out.n_params = created.params.count;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

static status_code do_append(void *app, const char *token, const ProtobufCMessage *m,
                             grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__AppendRequest *req = (const void *)m;
    store_table t;
    if (store_append(app, token, req->seq_id, req->count, req->ack_epoch, &t, st) != ST_OK)
        return st->code;
    Kvstash__V1__AppendResponse out = KVSTASH__V1__APPEND_RESPONSE__INIT;
    Kvstash__V1__LayerTable *storage;
    out.epoch = t.epoch;
    out.first_position = t.first_position;
    out.evicted = t.evicted;
    out.writes = layer_tables_new(&t, 1, &storage);
    out.n_writes = t.nlists;
    status_code rc = out.writes ? ST_OK : oom(st);
    if (rc == ST_OK)
        *resp = pbgrpc_pack(&out.base);
    layer_tables_free(out.writes, storage, t.nlists);
    store_table_free(&t);
    return rc;
}

static status_code do_get_block_table(void *app, const char *token, const ProtobufCMessage *m,
                                      grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__GetBlockTableRequest *req = (const void *)m;
    store_table t;
    if (store_get_table(app, token, req->seq_id, req->ack_epoch, req->with_positions, &t, st) !=
        ST_OK)
        return st->code;
    Kvstash__V1__GetBlockTableResponse out = KVSTASH__V1__GET_BLOCK_TABLE_RESPONSE__INIT;
    Kvstash__V1__LayerTable *storage;
    out.epoch = t.epoch;
    out.layers = layer_tables_new(&t, 0, &storage);
    out.n_layers = t.nlists;
    status_code rc = out.layers ? ST_OK : oom(st);
    if (rc == ST_OK)
        *resp = pbgrpc_pack(&out.base);
    layer_tables_free(out.layers, storage, t.nlists);
    store_table_free(&t);
    return rc;
}

static status_code do_release_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                       grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__ReleaseSequenceRequest *req = (const void *)m;
    uint32_t freed;
    if (store_seq_release(app, token, req->seq_id, &freed, st) != ST_OK)
        return st->code;
    Kvstash__V1__ReleaseSequenceResponse out = KVSTASH__V1__RELEASE_SEQUENCE_RESPONSE__INIT;
    out.blocks_freed = freed;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

static status_code do_detach(void *app, const char *token, const ProtobufCMessage *m,
                             grpc_byte_buffer **resp, status *st)
{
    (void)m;
    uint32_t released;
    if (store_detach(app, token, &released, st) != ST_OK)
        return st->code;
    Kvstash__V1__DetachResponse out = KVSTASH__V1__DETACH_RESPONSE__INIT;
    out.sequences_released = released;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

static status_code do_health_check(void *app, const char *token, const ProtobufCMessage *m,
                                   grpc_byte_buffer **resp, status *st)
{
    (void)token;
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    if (req->service[0] != '\0' && strcmp(req->service, "kvstash.v1.Store") != 0)
        return status_set(st, ST_NOT_FOUND, "unknown service '%.64s'", req->service);
    Grpc__Health__V1__HealthCheckResponse out = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    out.status = store_serving(app)
                     ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                     : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

static const rpc_method methods[] = {
    {"/kvstash.v1.Store/Attach", &kvstash__v1__attach_request__descriptor, do_attach, NULL, NULL,
     0},
    {"/kvstash.v1.Store/Lease", &kvstash__v1__lease_request__descriptor, NULL, do_lease_open,
     do_lease_closed, 0},
    {"/kvstash.v1.Store/CreateSequence", &kvstash__v1__create_sequence_request__descriptor,
     do_create_sequence, NULL, NULL, 0},
    {"/kvstash.v1.Store/Append", &kvstash__v1__append_request__descriptor, do_append, NULL, NULL,
     0},
    {"/kvstash.v1.Store/GetBlockTable", &kvstash__v1__get_block_table_request__descriptor,
     do_get_block_table, NULL, NULL, 0},
    {"/kvstash.v1.Store/ReleaseSequence", &kvstash__v1__release_sequence_request__descriptor,
     do_release_sequence, NULL, NULL, 0},
    {"/kvstash.v1.Store/Detach", &kvstash__v1__detach_request__descriptor, do_detach, NULL, NULL,
     0},
    {"/kvstash.v1.Store/Stats", &kvstash__v1__stats_request__descriptor, service_stats, NULL, NULL,
     0},
    {"/kvstash.v1.Store/Inspect", &kvstash__v1__inspect_request__descriptor, service_inspect, NULL,
     NULL, 0},
    {"/kvstash.v1.Store/ListPolicies", &kvstash__v1__list_policies_request__descriptor,
     service_list_policies, NULL, NULL, 0},
    /* An operator's move can take seconds: its own thread (rpc.h). */
    {"/kvstash.v1.Store/Evict", &kvstash__v1__evict_request__descriptor, service_evict, NULL, NULL,
     1},
    {"/kvstash.v1.Store/Revive", &kvstash__v1__revive_request__descriptor, service_revive, NULL,
     NULL, 0},
    {"/kvstash.v1.Store/ReleaseScratch", &kvstash__v1__release_scratch_request__descriptor,
     service_release_scratch, NULL, NULL, 0},
    /* These wait for the remote store: threads of their own. (A Revive of
     * spilled victims waits too, at most --remote-timeout-ms a node, on a
     * thread of the pool: most Revives never do.) */
    {"/kvstash.v1.Store/ExportSequence", &kvstash__v1__export_sequence_request__descriptor,
     service_export_sequence, NULL, NULL, 1},
    {"/kvstash.v1.Store/ImportSequence", &kvstash__v1__import_sequence_request__descriptor,
     service_import_sequence, NULL, NULL, 1},
    {"/kvstash.v1.Store/SpillSequence", &kvstash__v1__spill_sequence_request__descriptor,
     service_spill_sequence, NULL, NULL, 1},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor,
     do_health_check, NULL, NULL, 0},
};

const rpc_method *service_methods(size_t *count)
{
    *count = sizeof methods / sizeof methods[0];
    return methods;
}
