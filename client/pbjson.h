/*
 * pbjson.h - any protobuf-c message as a jansson JSON value.
 *
 * A generic walker over the message's descriptor, used by libkvstash
 * (kvs_stats_json) and the kvstash CLI, so a new field in the .proto shows
 * up in JSON output without code changes. The mapping:
 *
 *   - keys are the .proto field names (snake_case), in declaration order;
 *   - proto3 scalars are always present, defaults included; absent
 *     sub-messages and unset proto2-optional / oneof fields are omitted;
 *   - integers are JSON integers (uint64 too; a uint64 above INT64_MAX, which
 *     jansson cannot hold, becomes a JSON real); bools are true/false;
 *     floats are reals ("NaN", "Infinity", "-Infinity" as strings);
 *   - enums are their value names ("DTYPE_FP16"), or the number if unknown;
 *   - strings are strings; bytes are base64 strings (RFC 4648, padded);
 *   - repeated fields are arrays; nested messages are objects.
 */
#ifndef KVSTASH_CLIENT_PBJSON_H
#define KVSTASH_CLIENT_PBJSON_H

#include <jansson.h>
#include <protobuf-c/protobuf-c.h>

/* The message as a new JSON object (caller owns the reference: json_decref),
 * or NULL when out of memory. */
json_t *pbjson_from_message(const ProtobufCMessage *msg);

/* The message as compact JSON text in a malloc'd string (caller frees with
 * free()), or NULL when out of memory. `flags` are json_dumps flags
 * (e.g. JSON_INDENT(2)); 0 gives one compact line. */
char *pbjson_dumps(const ProtobufCMessage *msg, size_t flags);

#endif
