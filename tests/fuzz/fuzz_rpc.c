/*
 * fuzz_rpc - every kvstash.v1.Store and grpc.health.v1.Health method, as
 * the gRPC server runs it (daemon/rpc.c): the request bytes go through the
 * protobuf-c <-> gRPC bridge (pbgrpc_unpack), the UTF-8 check, then the
 * method's real handler from service_methods() against a real store.
 *
 * Input: up to FUZZ_MAX_CALLS records, each
 *     [method % nmethods] [caller] [length: u16 little-endian] [request bytes]
 * where caller picks the token the call carries: none (the Unix socket),
 * session 0's, session 1's, an unknown one, or an empty one. A record whose
 * length runs past the input takes the rest. Lease streams that open are
 * closed after the last call, as the server does when the client goes.
 * tests/fuzz/make_corpus.py writes the seeds from the integration tests'
 * messages. KVSTASH_FUZZ_TRACE=1 prints each call's method and status (to
 * see which paths a seed reaches).
 */
#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <stddef.h>
#include <stdint.h>

#include "fuzz_store.h"
#include "pbgrpc.h"
#include "rpc.h"
#include "service.h"

#define FUZZ_MAX_CALLS 16

static int trace;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    grpc_init(); /* the daemon's byte buffers are gRPC's; rpc_server_start inits too */
    const char *env = getenv("KVSTASH_FUZZ_TRACE");
    trace = env != NULL && strcmp(env, "1") == 0;
    return 0;
}

/* The token a record's caller byte names (NULL: a call without one). */
static const char *caller_token(const fuzz_store *f, uint8_t caller)
{
    switch (caller % 5) {
    case 0:
        return NULL;
    case 1:
        return f->token[0];
    case 2:
        return f->token[1];
    case 3:
        return "0123456789abcdef0123456789abcdef"; /* well formed, unknown */
    default:
        return "";
    }
}

/* One call as rpc.c's call_start makes it, from the unpack to the reply. */
static void one_call(fuzz_store *f, const rpc_method *m, const char *token, const uint8_t *req,
                     size_t len, uint64_t *cookies, size_t *ncookies)
{
    grpc_slice slice = grpc_slice_from_copied_buffer((const char *)req, len);
    grpc_byte_buffer *payload = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    ProtobufCMessage *msg = pbgrpc_unpack(m->request, payload);
    grpc_byte_buffer_destroy(payload);
    if (msg == NULL) {
        if (trace)
            fprintf(stderr, "%s: not a valid request\n", m->path);
        return;
    }
    char field[64];
    if (!pbgrpc_strings_valid(msg, field, sizeof field)) {
        if (trace)
            fprintf(stderr, "%s: %s is not UTF-8\n", m->path, field);
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    grpc_byte_buffer *reply = NULL;
    status st;
    status_code rc;
    if (m->unary != NULL) {
        rc = m->unary(f->st, token, msg, &reply, &st);
    } else {
        uint64_t cookie = 0;
        rc = m->stream_open(f->st, token, msg, &reply, &cookie, &st);
        if (rc == ST_OK)
            cookies[(*ncookies)++] = cookie;
    }
    protobuf_c_message_free_unpacked(msg, NULL);
    if (trace)
        fprintf(stderr, "%s: %s %s\n", m->path, status_name(rc), rc == ST_OK ? "" : st.msg);
    if (rc == ST_OK && reply == NULL) {
        fprintf(stderr, "%s answered OK without a reply\n", m->path);
        abort();
    }
    if (reply != NULL)
        grpc_byte_buffer_destroy(reply);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t nmethods;
    const rpc_method *methods = service_methods(&nmethods);
    fuzz_store f;
    fuzz_store_open(&f, FUZZ_SESSIONS);
    uint64_t cookies[FUZZ_MAX_CALLS];
    size_t ncookies = 0;
    const rpc_method *streams[FUZZ_MAX_CALLS];
    for (int call = 0; call < FUZZ_MAX_CALLS && size >= 4; call++) {
        const rpc_method *m = &methods[data[0] % nmethods];
        const char *token = caller_token(&f, data[1]);
        size_t len = (size_t)data[2] | (size_t)data[3] << 8;
        data += 4;
        size -= 4;
        if (len > size)
            len = size;
        size_t before = ncookies;
        one_call(&f, m, token, data, len, cookies, &ncookies);
        if (ncookies > before)
            streams[before] = m;
        data += len;
        size -= len;
    }
    for (size_t i = 0; i < ncookies; i++)
        streams[i]->stream_closed(f.st, cookies[i]);
    fuzz_store_close(&f);
    return 0;
}
