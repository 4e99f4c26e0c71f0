#include "pbgrpc.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>

grpc_byte_buffer *pbgrpc_pack(const ProtobufCMessage *msg)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    grpc_slice slice = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
    grpc_byte_buffer *buf = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    return buf;
}

ProtobufCMessage *pbgrpc_unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buf)
{
    if (buf == NULL)
        return protobuf_c_message_unpack(desc, NULL, 0, (const uint8_t *)"");
    grpc_byte_buffer_reader reader;
    if (!grpc_byte_buffer_reader_init(&reader, buf))
        return NULL;
    grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    ProtobufCMessage *msg =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
    return msg;
}

/* RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF. */
static int utf8_valid(const unsigned char *s)
{
    while (*s) {
        unsigned c = *s++, n;
        uint32_t cp;
        if (c < 0x80)
            continue;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        for (unsigned i = 0; i < n; i++, s++) {
            if ((*s & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (*s & 0x3F);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
    }
    return 1;
}

int pbgrpc_strings_valid(const ProtobufCMessage *msg, char *bad_field, size_t len)
{
    const ProtobufCMessageDescriptor *d = msg->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        const char *base = (const char *)msg + f->offset;
        size_t n = 1;
        const void *const *items = (const void *const *)base;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)((const char *)msg + f->quantifier_offset);
            items = *(const void *const *const *)base;
        }
        for (size_t k = 0; k < n; k++) {
            const void *item = items[k];
            if (item == NULL)
                continue;
            int ok = f->type == PROTOBUF_C_TYPE_STRING ? utf8_valid(item)
                                                       : pbgrpc_strings_valid(item, bad_field, len);
            if (!ok) {
                if (f->type == PROTOBUF_C_TYPE_STRING)
                    snprintf(bad_field, len, "%s", f->name);
                return 0;
            }
        }
    }
    return 1;
}
