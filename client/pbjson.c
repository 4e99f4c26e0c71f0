/* pbjson.c - see pbjson.h. */
#include "pbjson.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static json_t *from_float(double d)
{
    if (isnan(d))
        return json_string("NaN");
    if (isinf(d))
        return json_string(d > 0 ? "Infinity" : "-Infinity");
    return json_real(d);
}

static json_t *from_u64(uint64_t v)
{
    if (v > (uint64_t)INT64_MAX)
        return json_real((double)v);
    return json_integer((json_int_t)v);
}

static json_t *from_bytes(const ProtobufCBinaryData *b)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t outlen = (b->len + 2) / 3 * 4;
    char *out = malloc(outlen + 1);
    if (out == NULL)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < b->len; i += 3) {
        uint32_t v = (uint32_t)b->data[i] << 16;
        if (i + 1 < b->len)
            v |= (uint32_t)b->data[i + 1] << 8;
        if (i + 2 < b->len)
            v |= b->data[i + 2];
        out[o++] = tab[(v >> 18) & 63];
        out[o++] = tab[(v >> 12) & 63];
        out[o++] = i + 1 < b->len ? tab[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < b->len ? tab[v & 63] : '=';
    }
    out[o] = '\0';
    json_t *j = json_stringn(out, o);
    free(out);
    return j;
}

static json_t *from_enum(const ProtobufCEnumDescriptor *ed, int value)
{
    const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(ed, value);
    if (ev != NULL)
        return json_string(ev->name);
    return json_integer(value);
}

/* One value of field `f` stored at `p` (an element of a repeated field's
 * array, or the field itself). */
static json_t *from_value(const ProtobufCFieldDescriptor *f, const void *p)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        return json_integer(*(const int32_t *)p);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        return json_integer(*(const uint32_t *)p);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        return json_integer(*(const int64_t *)p);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return from_u64(*(const uint64_t *)p);
    case PROTOBUF_C_TYPE_FLOAT:
        return from_float(*(const float *)p);
    case PROTOBUF_C_TYPE_DOUBLE:
        return from_float(*(const double *)p);
    case PROTOBUF_C_TYPE_BOOL:
        return json_boolean(*(const protobuf_c_boolean *)p);
    case PROTOBUF_C_TYPE_ENUM:
        return from_enum(f->descriptor, *(const int *)p);
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        return s != NULL ? json_string(s) : json_string("");
    }
    case PROTOBUF_C_TYPE_BYTES:
        return from_bytes(p);
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *m = *(ProtobufCMessage *const *)p;
        return m != NULL ? pbjson_from_message(m) : json_null();
    }
    }
    return json_null();
}

/* Bytes of one element of a repeated field's array. */
static size_t elt_size(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_ENUM:
        return 4;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return 8;
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    }
    return 0;
}

/* Whether a non-repeated field is present (see pbjson.h for the rules). */
static int is_present(const ProtobufCMessage *msg, const ProtobufCFieldDescriptor *f)
{
    const char *base = (const char *)msg;
    const void *p = base + f->offset;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF)
        return *(const uint32_t *)(base + f->quantifier_offset) == f->id;
    if (f->type == PROTOBUF_C_TYPE_MESSAGE)
        return *(ProtobufCMessage *const *)p != NULL;
    if (f->label == PROTOBUF_C_LABEL_OPTIONAL) {
        if (f->type == PROTOBUF_C_TYPE_STRING)
            return *(char *const *)p != NULL;
        return *(const protobuf_c_boolean *)(base + f->quantifier_offset);
    }
    return 1; /* proto3 implicit presence, or proto2 required */
}

static json_t *from_repeated(const ProtobufCMessage *msg, const ProtobufCFieldDescriptor *f)
{
    const char *base = (const char *)msg;
    size_t n = *(const size_t *)(base + f->quantifier_offset);
    const char *arr = *(char *const *)(base + f->offset);
    size_t sz = elt_size(f->type);
    json_t *a = json_array();
    if (a == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        if (json_array_append_new(a, from_value(f, arr + i * sz)) != 0) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

json_t *pbjson_from_message(const ProtobufCMessage *msg)
{
    const ProtobufCMessageDescriptor *d = msg->descriptor;
    json_t *obj = json_object();
    if (obj == NULL)
        return NULL;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        json_t *v;
        if (f->label == PROTOBUF_C_LABEL_REPEATED)
            v = from_repeated(msg, f);
        else if (is_present(msg, f))
            v = from_value(f, (const char *)msg + f->offset);
        else
            continue;
        if (json_object_set_new(obj, f->name, v) != 0) {
            json_decref(obj);
            return NULL;
        }
    }
    return obj;
}

char *pbjson_dumps(const ProtobufCMessage *msg, size_t flags)
{
    json_t *j = pbjson_from_message(msg);
    if (j == NULL)
        return NULL;
    char *text = json_dumps(j, flags);
    json_decref(j);
    if (text == NULL)
        return NULL;
    /* jansson may use an application's allocator: hand back plain malloc. */
    json_malloc_t jmalloc;
    json_free_t jfree;
    json_get_alloc_funcs(&jmalloc, &jfree);
    char *out = strdup(text);
    jfree(text);
    return out;
}
