/* ListPolicies, Evict, Revive and ReleaseScratch: the policy registry, the
 * operator's manual eviction (store_operator.h) and rebuilding tokens from the
 * tiers (store_revive). */
#include <stdlib.h>

#include "kvstash/v1/store.pb-c.h"
#include "store_operator.h"
#include "pbgrpc.h"
#include "service.h"

static const struct {
    unsigned bit;
    const char *name;
} needs_names[] = {
    {POLICY_NEEDS_SCORE, "score"},
    {POLICY_NEEDS_LAST_ATTN, "last_attn"},
    {POLICY_NEEDS_WINDOW_ATTN, "window_attn"},
    {POLICY_NEEDS_VNORM, "vnorm"},
    {POLICY_NEEDS_CONFIDENCE, "confidence"},
};
#define NNEEDS (sizeof needs_names / sizeof needs_names[0])

status_code service_list_policies(void *app, const char *token, const ProtobufCMessage *m,
                                  grpc_byte_buffer **resp, status *st)
{
    (void)m;
    /* The registry is public, but a token that was given must be valid:
     * a wrong one answers nothing here either (rpc.h). */
    store_caller who;
    if (token != NULL && store_identify(app, token, &who, st) != ST_OK)
        return st->code;
    size_t n, nparams = 0, nstorage;
    const policy_ops *const *pol = policy_list(&n);
    const policy_param_spec *storage = policy_storage_spec(&nstorage);
    for (size_t i = 0; i < n; i++)
        nparams += pol[i]->nparams;
    nparams += nstorage;
    Kvstash__V1__PolicyInfo *info = calloc(n + 1, sizeof *info);
    Kvstash__V1__PolicyInfo **info_ptrs = calloc(n + 1, sizeof *info_ptrs);
    Kvstash__V1__PolicyParamSpec *specs = calloc(nparams + 1, sizeof *specs);
    Kvstash__V1__PolicyParamSpec **spec_ptrs = calloc(nparams + 1, sizeof *spec_ptrs);
    const char **needs = calloc(n * NNEEDS + 1, sizeof *needs);
    status_code rc = ST_OK;
    if (!info || !info_ptrs || !specs || !spec_ptrs || !needs) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
        goto out;
    }
    size_t k = 0;
    for (size_t j = 0; j < nstorage; j++, k++) {
        kvstash__v1__policy_param_spec__init(&specs[k]);
        specs[k].key = (char *)storage[j].key;
        specs[k].default_value = (char *)storage[j].def;
        specs[k].help = (char *)storage[j].help;
        spec_ptrs[k] = &specs[k];
    }
    for (size_t i = 0; i < n; i++) {
        const policy_ops *p = pol[i];
        Kvstash__V1__PolicyInfo *pi = &info[i];
        kvstash__v1__policy_info__init(pi);
        pi->name = (char *)p->name;
        pi->summary = (char *)(p->summary ? p->summary : "");
        pi->per_head = p->per_head != 0;
        pi->operator_evict = operator_can_evict(p);
        pi->params = &spec_ptrs[k];
        for (size_t j = 0; j < p->nparams; j++, k++) {
            kvstash__v1__policy_param_spec__init(&specs[k]);
            specs[k].key = (char *)p->params[j].key;
            specs[k].default_value = (char *)(p->params[j].def ? p->params[j].def : "");
            specs[k].help = (char *)(p->params[j].help ? p->params[j].help : "");
            spec_ptrs[k] = &specs[k];
        }
        pi->n_params = p->nparams;
        pi->needs = (char **)&needs[i * NNEEDS];
        for (size_t b = 0; b < NNEEDS; b++)
            if (p->needs & needs_names[b].bit)
                needs[i * NNEEDS + pi->n_needs++] = needs_names[b].name;
        info_ptrs[i] = pi;
    }
    Kvstash__V1__ListPoliciesResponse out = KVSTASH__V1__LIST_POLICIES_RESPONSE__INIT;
    out.policies = info_ptrs;
    out.n_policies = n;
    out.storage_params = spec_ptrs;
    out.n_storage_params = nstorage;
    *resp = pbgrpc_pack(&out.base);
out:
    free(info);
    free(info_ptrs);
    free(specs);
    free(spec_ptrs);
    free(needs);
    return rc;
}

status_code service_evict(void *app, const char *token, const ProtobufCMessage *m,
                          grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__EvictRequest *req = (const void *)m;
    policy_tier to;
    if (operator_parse_to(req->to, &to, st) != ST_OK)
        return st->code;
    if (req->n_ranges > OPERATOR_MAX_RANGES)
        return status_set(st, ST_INVALID_ARGUMENT, "at most %d position ranges, got %zu",
                          OPERATOR_MAX_RANGES, req->n_ranges);
    operator_range *r = malloc((req->n_ranges ? req->n_ranges : 1) * sizeof *r);
    if (r == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < req->n_ranges; i++)
        r[i] = (operator_range){req->ranges[i]->first, req->ranges[i]->count};
    operator_evict_result res;
    status_code rc = operator_apply(app, token, req->seq_id, to, r, req->n_ranges, req->layers,
                                    req->n_layers, &res, st);
    free(r);
    if (rc != ST_OK)
        return rc;
    Kvstash__V1__EvictResponse out = KVSTASH__V1__EVICT_RESPONSE__INIT;
    out.epoch = res.epoch;
    out.evicted = res.evicted;
    out.requested = res.requested;
    out.by_policy = res.by_policy;
    out.not_held = res.not_held;
    out.moved = res.moved;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

status_code service_revive(void *app, const char *token, const ProtobufCMessage *m,
                           grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__ReviveRequest *req = (const void *)m;
    store_revive_result r;
    seq_revive_request rq = {req->layer, req->head,         req->first,
                             req->count, req->skip_evicted, req->in_place};
    if (store_revive(app, token, req->seq_id, &rq, &r, st) != ST_OK)
        return st->code;
    Kvstash__V1__ReviveResponse out = KVSTASH__V1__REVIVE_RESPONSE__INIT;
    Kvstash__V1__LayerTable lt;
    size_t n = r.table.tokens;
    uint32_t *src = malloc((n ? n : 1) * sizeof *src);
    status_code rc = ST_OK;
    if (src == NULL || service_layer_table_fill(&lt, &r.table, -1) != 0) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        uint32_t by[POLICY_TIERS] = {0};
        for (size_t i = 0; i < n; i++)
            by[src[i] = r.src_tier[i]]++;
        out.scratch_id = r.scratch_id;
        out.epoch = r.epoch;
        out.table = &lt;
        out.source_tier = src;
        out.n_source_tier = n;
        out.from_full = by[POLICY_FULL];
        out.from_int8 = by[POLICY_INT8];
        out.from_sketch = by[POLICY_SKETCH];
        out.from_int4 = by[POLICY_INT4];
        out.from_int2 = by[POLICY_INT2];
        *resp = pbgrpc_pack(&out.base);
        service_layer_table_clear(&lt);
    }
    free(src);
    store_revive_result_free(&r);
    return rc;
}

status_code service_release_scratch(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__ReleaseScratchRequest *req = (const void *)m;
    uint32_t freed;
    if (store_scratch_release(app, token, req->scratch_id, &freed, st) != ST_OK)
        return st->code;
    Kvstash__V1__ReleaseScratchResponse out = KVSTASH__V1__RELEASE_SCRATCH_RESPONSE__INIT;
    out.blocks_freed = freed;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}
