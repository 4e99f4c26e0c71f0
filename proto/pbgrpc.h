/*
 * pbgrpc.h - protobuf-c messages in and out of gRPC byte buffers.
 *
 * The one place where the daemon and libkvstash convert between the two
 * libraries (C-STACK.md: always read through grpc_byte_buffer_reader, since
 * buffers may be multi-slice or compressed).
 */
#ifndef KVSTASH_PBGRPC_H
#define KVSTASH_PBGRPC_H

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

/* Pack `msg` into a new byte buffer (caller destroys it with
 * grpc_byte_buffer_destroy). Never NULL. */
grpc_byte_buffer *pbgrpc_pack(const ProtobufCMessage *msg);

/* Unpack a byte buffer as `desc` (NULL buffer = empty message). Returns the
 * message, to be freed with protobuf_c_message_free_unpacked, or NULL if the
 * bytes are not a valid message of that type. */
ProtobufCMessage *pbgrpc_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buf);

/* proto3 strings must be UTF-8, and protobuf-c does not check. Returns 1 if
 * every string field of `msg` (nested messages included) is valid UTF-8;
 * else 0 with the offending field's name in bad_field. */
int pbgrpc_strings_valid(const ProtobufCMessage *msg, char *bad_field, size_t len);

#endif
