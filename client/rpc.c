/* rpc.c - see rpc.h. */
#include "rpc.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "kvstash.h"
#include "pbgrpc.h"

#define RPC_DEFAULT_TIMEOUT_MS 10000

struct rpc_channel {
    grpc_channel *ch;
    grpc_completion_queue *cq; /* unary calls; each plucks its own tag */
};

struct rpc_stream {
    grpc_call *call;
    grpc_completion_queue *cq;
    grpc_status_code status;
    grpc_slice details;
    grpc_metadata_array trailing;
};

/* Tags of the stream's batches (each stream has its own pluck CQ); unary
 * calls share their channel's CQ and use a pointer into their own frame. */
static char tag_batch, tag_status;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* grpc_init once per process, never shut down: grpc_init/grpc_shutdown pairs
 * would tear gRPC down under another session of the same process, and a
 * worker keeps its session until it exits anyway. */
static void rpc_init(void)
{
    grpc_init();
}

/* Block every asynchronous signal for the duration of a gRPC entry point
 * (see rpc.h); synchronous ones stay deliverable so faults still crash. */
static void sig_block(sigset_t *old)
{
    sigset_t all;
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGTRAP);
    sigdelset(&all, SIGSYS);
    pthread_sigmask(SIG_BLOCK, &all, old);
}

static void sig_restore(const sigset_t *old)
{
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

int rpc_timeout_ms(void)
{
    const char *env = getenv("KVSTASH_RPC_TIMEOUT_MS");
    if (env != NULL && *env != '\0') {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v > 0 && v <= 24L * 3600 * 1000)
            return (int)v;
    }
    return RPC_DEFAULT_TIMEOUT_MS;
}

int rpc_code_to_err(int code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return KVS_OK;
    case GRPC_STATUS_INVALID_ARGUMENT:
        return KVS_ERR_INVALID;
    case GRPC_STATUS_NOT_FOUND:
        return KVS_ERR_NOT_FOUND;
    case GRPC_STATUS_PERMISSION_DENIED:
    case GRPC_STATUS_UNAUTHENTICATED:
        return KVS_ERR_PERMISSION;
    case GRPC_STATUS_FAILED_PRECONDITION:
        return KVS_ERR_PRECONDITION;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return KVS_ERR_EXHAUSTED;
    case GRPC_STATUS_UNAVAILABLE:
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return KVS_ERR_UNAVAILABLE;
    case GRPC_STATUS_DATA_LOSS:
        return KVS_ERR_DATA_LOSS;
    default:
        return KVS_ERR_PROTOCOL;
    }
}

static const char *status_name(grpc_status_code code)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if ((unsigned)code < sizeof names / sizeof names[0])
        return names[code];
    return "UNKNOWN_STATUS";
}

/* The status details as the error message, or the code's name when the
 * server sent none. Returns the mapped kvs_err. */
static int status_message(const char *method, grpc_status_code code, grpc_slice details, char *err,
                          size_t errlen)
{
    int rc = rpc_code_to_err(code);
    size_t len = GRPC_SLICE_LENGTH(details);
    if (err == NULL || errlen == 0)
        return rc;
    if (len > 0)
        snprintf(err, errlen, "%.*s", (int)len, (const char *)GRPC_SLICE_START_PTR(details));
    else
        snprintf(err, errlen, "%s failed: %s", method, status_name(code));
    return rc;
}

__attribute__((format(printf, 3, 4))) static void set_err(char *err, size_t errlen, const char *fmt,
                                                          ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Shut down a pluck CQ whose events have all been plucked, and free it. */
static void cq_destroy(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
}

/* A channel to `target` over `creds` (released here); NULL if out of memory. */
static rpc_channel *channel_create(const char *target, grpc_channel_credentials *creds)
{
    rpc_channel *ch = calloc(1, sizeof *ch);
    if (ch == NULL || creds == NULL) {
        free(ch);
        if (creds != NULL)
            grpc_channel_credentials_release(creds);
        return NULL;
    }
    /* Tables with positions of long sequences can pass gRPC's 4 MiB default. */
    grpc_arg args[1];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = -1;
    grpc_channel_args chargs = {.num_args = 1, .args = args};
    ch->ch = grpc_channel_create(target, creds, &chargs);
    grpc_channel_credentials_release(creds);
    if (ch->ch != NULL)
        ch->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (ch->ch == NULL) {
        free(ch);
        return NULL;
    }
    return ch;
}

rpc_channel *rpc_channel_open(const char *socket_path)
{
    struct sockaddr_un sa;
    if (strlen(socket_path) >= sizeof sa.sun_path)
        return NULL;
    char *target = malloc(strlen(socket_path) + sizeof "unix:");
    if (target == NULL)
        return NULL;
    strcpy(target, "unix:");
    strcat(target, socket_path);
    sigset_t old;
    sig_block(&old);
    pthread_once(&init_once, rpc_init); /* grpc_init starts threads: signals blocked */
    rpc_channel *ch = channel_create(target, grpc_insecure_credentials_create());
    sig_restore(&old);
    free(target);
    return ch;
}

void rpc_tls_from_env(rpc_tls_paths *t)
{
    t->ca = getenv("KVSTASH_TLS_CA");
    t->cert = getenv("KVSTASH_TLS_CERT");
    t->key = getenv("KVSTASH_TLS_KEY");
}

/* The whole file at `path`, NUL-terminated (caller frees), or NULL. */
static char *read_file(const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long len = -1;
    if (f != NULL && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 &&
        fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)len + 1)) != NULL &&
        fread(buf, 1, (size_t)len, f) == (size_t)len) {
        buf[len] = '\0';
        fclose(f);
        return buf;
    }
    set_err(err, errlen, "cannot read %s: %s", path, f == NULL ? strerror(errno) : "read error");
    free(buf);
    if (f != NULL)
        fclose(f);
    return NULL;
}

rpc_channel *rpc_channel_open_tcp(const char *addr, const rpc_tls_paths *tls, char *err,
                                  size_t errlen)
{
    int with_tls = tls != NULL && (tls->ca != NULL || tls->cert != NULL || tls->key != NULL);
    if (with_tls && (tls->ca == NULL || tls->cert == NULL || tls->key == NULL)) {
        set_err(err, errlen,
                "TLS needs the CA, the certificate and the key together (KVSTASH_TLS_CA, "
                "KVSTASH_TLS_CERT, KVSTASH_TLS_KEY)");
        return NULL;
    }
    char *pem[3] = {NULL, NULL, NULL};
    const char *paths[3] = {with_tls ? tls->ca : NULL, with_tls ? tls->cert : NULL,
                            with_tls ? tls->key : NULL};
    rpc_channel *ch = NULL;
    for (int i = 0; with_tls && i < 3; i++)
        if ((pem[i] = read_file(paths[i], err, errlen)) == NULL)
            goto done;
    sigset_t old;
    sig_block(&old);
    pthread_once(&init_once, rpc_init);
    grpc_channel_credentials *creds;
    if (with_tls) {
        grpc_ssl_pem_key_cert_pair pair = {pem[2], pem[1]};
        creds = grpc_ssl_credentials_create(pem[0], &pair, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    ch = channel_create(addr, creds);
    sig_restore(&old);
    if (ch == NULL)
        set_err(err, errlen, "cannot create a gRPC channel to %s", addr);
done:
    for (int i = 0; i < 3; i++)
        free(pem[i]);
    return ch;
}

void rpc_channel_close(rpc_channel *ch)
{
    if (ch == NULL)
        return;
    sigset_t old;
    sig_block(&old);
    grpc_channel_destroy(ch->ch);
    cq_destroy(ch->cq);
    sig_restore(&old);
    free(ch);
}

static gpr_timespec deadline_in(int ms)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* Wait for `tag` until the call's own deadline plus a margin; if gRPC has
 * not completed it by then (it always should), cancel and wait for good. */
static grpc_event pluck(grpc_completion_queue *cq, grpc_call *call, void *tag, int ms)
{
    grpc_event ev = grpc_completion_queue_pluck(cq, tag, deadline_in(ms), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
        grpc_call_cancel(call, NULL);
        ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    }
    return ev;
}

static grpc_call *call_create(rpc_channel *ch, grpc_completion_queue *cq, const char *method,
                              gpr_timespec deadline)
{
    grpc_slice m = grpc_slice_from_static_string(method);
    return grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL, deadline,
                                    NULL);
}

/* Fill the send half of a batch (initial metadata with the token, the
 * message, close); returns the number of ops written. */
static size_t ops_send(grpc_op *ops, grpc_metadata *md, const char *token, grpc_byte_buffer *msg)
{
    memset(md, 0, sizeof *md);
    size_t n = 0;
    memset(ops, 0, 3 * sizeof *ops);
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (token != NULL) {
        md->key = grpc_slice_from_static_string("kvstash-token");
        md->value = grpc_slice_from_static_string(token);
        ops[n].data.send_initial_metadata.count = 1;
        ops[n].data.send_initial_metadata.metadata = md;
    }
    n++;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = msg;
    n++;
    ops[n].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    n++;
    return n;
}

int rpc_unary(rpc_channel *ch, const char *method, const char *token, const ProtobufCMessage *req,
              const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp, char *err,
              size_t errlen)
{
    *resp = NULL;
    int ms = rpc_timeout_ms();
    sigset_t old;
    sig_block(&old);

    grpc_completion_queue *cq = ch->cq;
    grpc_call *call = call_create(ch, cq, method, deadline_in(ms));
    grpc_byte_buffer *send = pbgrpc_pack(req);
    grpc_byte_buffer *recv = NULL;
    grpc_metadata md;
    grpc_metadata_array initial, trailing;
    grpc_metadata_array_init(&initial);
    grpc_metadata_array_init(&trailing);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    int rc;

    grpc_op ops[6];
    size_t n = ops_send(ops, &md, token, send);
    memset(&ops[n], 0, 3 * sizeof ops[0]);
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &initial;
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &recv;
    ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[n].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[n].data.recv_status_on_client.status = &status;
    ops[n++].data.recv_status_on_client.status_details = &details;

    void *tag = &status; /* unique per call in flight on the shared queue */
    grpc_call_error ce = grpc_call_start_batch(call, ops, n, tag, NULL);
    if (ce != GRPC_CALL_OK) {
        set_err(err, errlen, "gRPC refused the call: %s", grpc_call_error_to_string(ce));
        rc = KVS_ERR_PROTOCOL;
        goto out;
    }
    grpc_event ev = pluck(cq, call, tag, ms + 5000);
    if (!ev.success && status == GRPC_STATUS_OK)
        status = GRPC_STATUS_UNKNOWN;
    if (status != GRPC_STATUS_OK) {
        rc = status_message(method, status, details, err, errlen);
        goto out;
    }
    *resp = recv != NULL ? pbgrpc_unpack(resp_desc, recv) : NULL;
    if (*resp == NULL) {
        set_err(err, errlen, "%s: the reply is not a valid message (or missing)", method);
        rc = KVS_ERR_PROTOCOL;
        goto out;
    }
    rc = KVS_OK;
out:
    if (recv != NULL)
        grpc_byte_buffer_destroy(recv);
    grpc_byte_buffer_destroy(send);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&initial);
    grpc_metadata_array_destroy(&trailing);
    grpc_call_unref(call);
    sig_restore(&old);
    return rc;
}

/* Free a stream whose batches have all completed. */
static void stream_free(rpc_stream *st)
{
    grpc_slice_unref(st->details);
    grpc_metadata_array_destroy(&st->trailing);
    grpc_call_unref(st->call);
    cq_destroy(st->cq);
    free(st);
}

/* Post RECV_STATUS_ON_CLIENT on the stream under tag_status. */
static grpc_call_error stream_post_status(rpc_stream *st)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &st->trailing;
    op.data.recv_status_on_client.status = &st->status;
    op.data.recv_status_on_client.status_details = &st->details;
    return grpc_call_start_batch(st->call, &op, 1, &tag_status, NULL);
}

int rpc_stream_open(rpc_channel *ch, const char *method, const char *token,
                    const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                    ProtobufCMessage **first, rpc_stream **out, char *err, size_t errlen)
{
    *first = NULL;
    *out = NULL;
    rpc_stream *st = calloc(1, sizeof *st);
    if (st == NULL) {
        set_err(err, errlen, "%s: out of memory", method);
        return KVS_ERR_SYSTEM;
    }
    int ms = rpc_timeout_ms();
    sigset_t old;
    sig_block(&old);

    st->cq = grpc_completion_queue_create_for_pluck(NULL);
    st->call = call_create(ch, st->cq, method, gpr_inf_future(GPR_CLOCK_REALTIME));
    st->status = GRPC_STATUS_UNKNOWN;
    st->details = grpc_empty_slice();
    grpc_metadata_array_init(&st->trailing);

    grpc_byte_buffer *send = pbgrpc_pack(req);
    grpc_byte_buffer *recv = NULL;
    grpc_metadata md;
    grpc_metadata_array initial;
    grpc_metadata_array_init(&initial);
    grpc_op ops[5];
    size_t n = ops_send(ops, &md, token, send);
    memset(&ops[n], 0, 2 * sizeof ops[0]);
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &initial;
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &recv;

    int rc;
    grpc_call_error ce = grpc_call_start_batch(st->call, ops, n, &tag_batch, NULL);
    if (ce != GRPC_CALL_OK) {
        set_err(err, errlen, "gRPC refused the call: %s", grpc_call_error_to_string(ce));
        rc = KVS_ERR_PROTOCOL;
        goto fail;
    }
    grpc_event ev = grpc_completion_queue_pluck(st->cq, &tag_batch, deadline_in(ms), NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
        grpc_call_cancel(st->call, NULL);
        grpc_completion_queue_pluck(st->cq, &tag_batch, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        set_err(err, errlen, "%s: no answer from kvstashd in time (KVSTASH_RPC_TIMEOUT_MS)",
                method);
        rc = KVS_ERR_UNAVAILABLE;
        goto ended;
    }
    if (recv == NULL) {
        /* The server ended the stream before its first message: the
         * status says why. */
        rc = KVS_ERR_PROTOCOL;
        set_err(err, errlen, "%s: the stream ended without a message", method);
        if (stream_post_status(st) == GRPC_CALL_OK) {
            grpc_completion_queue_pluck(st->cq, &tag_status, gpr_inf_future(GPR_CLOCK_REALTIME),
                                        NULL);
            if (st->status != GRPC_STATUS_OK)
                rc = status_message(method, st->status, st->details, err, errlen);
        }
        goto fail;
    }
    *first = pbgrpc_unpack(resp_desc, recv);
    if (*first == NULL) {
        set_err(err, errlen, "%s: the first message is not valid", method);
        rc = KVS_ERR_PROTOCOL;
        grpc_call_cancel(st->call, NULL);
        goto ended;
    }
    ce = stream_post_status(st);
    if (ce != GRPC_CALL_OK) {
        set_err(err, errlen, "gRPC refused the status op: %s", grpc_call_error_to_string(ce));
        rc = KVS_ERR_PROTOCOL;
        protobuf_c_message_free_unpacked(*first, NULL);
        *first = NULL;
        grpc_call_cancel(st->call, NULL);
        goto fail;
    }
    *out = st;
    rc = KVS_OK;
    goto done;

ended:
    /* The call is cancelled: collect its status so that nothing is left
     * pending on the queue. */
    if (stream_post_status(st) == GRPC_CALL_OK)
        grpc_completion_queue_pluck(st->cq, &tag_status, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
fail:
    stream_free(st);
done:
    if (recv != NULL)
        grpc_byte_buffer_destroy(recv);
    grpc_byte_buffer_destroy(send);
    grpc_metadata_array_destroy(&initial);
    sig_restore(&old);
    return rc;
}

int rpc_stream_close(rpc_stream *st, char *err, size_t errlen)
{
    if (st == NULL)
        return KVS_OK;
    sigset_t old;
    sig_block(&old);
    /* Cancelling a call that has already ended does nothing, and its status
     * then is the server's. */
    grpc_call_cancel(st->call, NULL);
    grpc_completion_queue_pluck(st->cq, &tag_status, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    int rc = KVS_OK;
    if (st->status != GRPC_STATUS_OK && st->status != GRPC_STATUS_CANCELLED)
        rc = status_message("Lease", st->status, st->details, err, errlen);
    stream_free(st);
    sig_restore(&old);
    return rc;
}
