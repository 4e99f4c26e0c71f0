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

#endif
