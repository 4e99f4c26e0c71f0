/*
 * service.h - the kvstash.v1.Store and grpc.health.v1.Health methods: each
 * decodes its request, calls the store, and encodes the reply. The `app`
 * pointer of every handler is the daemon's store.
 */
#ifndef KVSTASH_SERVICE_H
#define KVSTASH_SERVICE_H

#include "kvstash/v1/store.pb-c.h"
#include "rpc.h"
#include "store.h"

/* The method table for rpc_server_start (static storage). */
const rpc_method *service_methods(size_t *count);

/* Stats and Inspect (service_stats.c): read-only. An operator (store.h
 * store_set_operators) sees every session and sequence; anyone else its own
 * (a call without a token counts as the daemon's uid: store_identify). */
status_code service_stats(void *app, const char *token, const ProtobufCMessage *m,
                          grpc_byte_buffer **resp, status *st);
status_code service_inspect(void *app, const char *token, const ProtobufCMessage *m,
                            grpc_byte_buffer **resp, status *st);

/* ListPolicies (read-only, no token) and Evict (store_operator.h; needs a token)
 * (service_ops.c). */
status_code service_list_policies(void *app, const char *token, const ProtobufCMessage *m,
                                  grpc_byte_buffer **resp, status *st);
status_code service_evict(void *app, const char *token, const ProtobufCMessage *m,
                          grpc_byte_buffer **resp, status *st);

/* ExportSequence, ImportSequence and SpillSequence (service_remote.c): a
 * sequence, or its victims, to the remote tier and back (store_seq_export,
 * store_seq_import, store_seq_spill). */
status_code service_export_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st);
status_code service_import_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st);
status_code service_spill_sequence(void *app, const char *token, const ProtobufCMessage *m,
                                   grpc_byte_buffer **resp, status *st);

/* Revive and ReleaseScratch (service_ops.c): need the owning session. */
status_code service_revive(void *app, const char *token, const ProtobufCMessage *m,
                           grpc_byte_buffer **resp, status *st);
status_code service_release_scratch(void *app, const char *token, const ProtobufCMessage *m,
                                    grpc_byte_buffer **resp, status *st);

/* A LayerTable whose arrays are heap copies of src (service_layer_table_clear
 * frees them). Positions: copied from src->positions when not NULL, or
 * first_position + i when first_position >= 0 (append writes), else none.
 * Returns 0 or -1 (out of memory). */
int service_layer_table_fill(Kvstash__V1__LayerTable *lt, const store_layer_table *src,
                             int64_t first_position);
void service_layer_table_clear(Kvstash__V1__LayerTable *lt);

/* Shared conversions; the Param strings point into p. */
void service_geometry_to_proto(const pool_geometry *g, Kvstash__V1__Geometry *out);
void service_params_to_proto(const policy_params *p, Kvstash__V1__Param *storage,
                             Kvstash__V1__Param **ptrs);

#endif
