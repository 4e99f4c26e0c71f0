/* ExportSequence, ImportSequence and SpillSequence: a sequence, or its
 * victims, to the remote tier and back (store_seq_export, store_seq_import,
 * store_seq_spill; docs/remote.md). */
#include <stdlib.h>

#include "kvstash/v1/store.pb-c.h"
#include "pbgrpc.h"
#include "service.h"

status_code service_export_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__ExportSequenceRequest *req = (const void *)m;
    store_export_result r;
    if (store_seq_export(app, token, req->seq_id, &r, st) != ST_OK)
        return st->code;
    Kvstash__V1__ExportSequenceResponse out = KVSTASH__V1__EXPORT_SEQUENCE_RESPONSE__INIT;
    out.uid = r.uid;
    out.bytes = r.bytes;
    out.values = r.values;
    out.blocks = r.blocks;
    out.tokens = r.tokens;
    out.ttl_s = r.ttl_s;
    out.key_prefix = r.key_prefix;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

status_code service_import_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__ImportSequenceRequest *req = (const void *)m;
    store_import_result r;
    if (store_seq_import(app, token, req->uid, req->session_id, &r, st) != ST_OK)
        return st->code;
    Kvstash__V1__ImportSequenceResponse out = KVSTASH__V1__IMPORT_SEQUENCE_RESPONSE__INIT;
    Kvstash__V1__Param params[POLICY_MAX_PARAMS], *ptrs[POLICY_MAX_PARAMS];
    for (size_t i = 0; i < r.params.count; i++) {
        kvstash__v1__param__init(&params[i]);
        params[i].key = (char *)r.params.key[i];
        params[i].value = r.params.value[i];
        ptrs[i] = &params[i];
    }
    out.seq_id = r.seq_id;
    out.epoch = r.epoch;
    out.appended = r.appended;
    out.policy = (char *)r.policy->name;
    out.params = ptrs;
    out.n_params = r.params.count;
    out.bytes = r.bytes;
    out.blocks = r.blocks;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}

status_code service_spill_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                   grpc_byte_buffer **resp, status *st)
{
    const Kvstash__V1__SpillSequenceRequest *req = (const void *)m;
    store_spill_result r;
    if (store_seq_spill(app, token, req->seq_id, &r, st) != ST_OK)
        return st->code;
    Kvstash__V1__SpillSequenceResponse out = KVSTASH__V1__SPILL_SEQUENCE_RESPONSE__INIT;
    out.uid = r.uid;
    out.blocks = r.blocks;
    out.tokens = r.tokens;
    out.bytes = r.bytes;
    out.values = r.values;
    out.ttl_s = r.ttl_s;
    out.dropped = r.dropped;
    out.spilled_tokens = r.spilled_tokens;
    out.spilled_blocks = r.spilled_blocks;
    out.key_prefix = r.key_prefix;
    out.sketches = r.sketches;
    *resp = pbgrpc_pack(&out.base);
    return ST_OK;
}
