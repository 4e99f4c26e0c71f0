#include "rpc.h"

#include <errno.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "pbgrpc.h"

/* Requests kept posted per method and completion queue, so that a burst of
 * calls never waits for a handler to re-post (C-STACK.md). */
#define RPC_POSTED_PER_METHOD 4
#define RPC_TOKEN_KEY "kvstash-token"
#define RPC_TOKEN_MAX 64
/* The one service every caller may use (health checkers, load balancers). */
#define RPC_PUBLIC_PREFIX "/grpc.health.v1.Health/"

typedef enum tag_kind {
    TAG_REQUESTED,   /* a registered call arrived */
    TAG_UNKNOWN,     /* a call to a method we do not serve arrived */
    TAG_REPLIED,     /* the final batch of a call completed */
    TAG_STREAM_SENT, /* a stream's first message went out */
    TAG_STREAM_DONE, /* a stream's RECV_CLOSE_ON_SERVER completed */
    TAG_SHUTDOWN,    /* grpc_server_shutdown_and_notify completed */
} tag_kind;

typedef struct rpc_call rpc_call;

/* Every tag is the address of one of these, so the kind tells what finished. */
typedef struct rpc_tag {
    tag_kind kind;
    rpc_call *call;
} rpc_tag;

struct rpc_call {
    rpc_tag requested, sent, done;
    rpc_server *srv;
    int cq_index;
    size_t method; /* index in srv->methods; unused for unknown methods */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details; /* unknown methods only */
    grpc_byte_buffer *payload;
    grpc_byte_buffer *reply;
    grpc_slice status_details;
    int has_details;
    int cancelled;
    uint64_t cookie;
    int pending; /* outstanding batches of a stream */
};

struct rpc_server {
    grpc_server *server;
    const rpc_method *methods;
    size_t nmethods;
    void **handles; /* registered method handles, one per method */
    void *app;
    rpc_observe_fn observe; /* metrics hook, may be NULL */
    void *observe_ctx;
    int nthreads;
    int own_cq; /* the CQ of the own_thread methods (rpc.h); -1: none */
    grpc_completion_queue **cqs;
    pthread_t *threads;
    rpc_tag shutdown_tag;
    atomic_int stopping;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int shutdown_seen;
};

/* ---- posting requests ---------------------------------------------------- */

static rpc_call *call_new(rpc_server *srv, int cq_index, size_t method)
{
    rpc_call *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->srv = srv;
    c->cq_index = cq_index;
    c->method = method;
    c->requested = (rpc_tag){TAG_REQUESTED, c};
    c->sent = (rpc_tag){TAG_STREAM_SENT, c};
    c->done = (rpc_tag){TAG_REPLIED, c};
    grpc_metadata_array_init(&c->md);
    return c;
}

static void call_free(rpc_call *c)
{
    grpc_metadata_array_destroy(&c->md);
    if (c->requested.kind == TAG_UNKNOWN)
        grpc_call_details_destroy(&c->details);
    if (c->payload != NULL)
        grpc_byte_buffer_destroy(c->payload);
    if (c->reply != NULL)
        grpc_byte_buffer_destroy(c->reply);
    if (c->has_details)
        grpc_slice_unref(c->status_details);
    if (c->call != NULL)
        grpc_call_unref(c->call);
    free(c);
}

static void post_registered(rpc_server *srv, int cq_index, size_t method)
{
    if (atomic_load(&srv->stopping))
        return;
    rpc_call *c = call_new(srv, cq_index, method);
    if (c == NULL) {
        log_error("rpc_oom", "what=%s", "posting a call");
        return;
    }
    grpc_completion_queue *cq = srv->cqs[cq_index];
    grpc_call_error e = grpc_server_request_registered_call(srv->server, srv->handles[method],
                                                            &c->call, &c->deadline, &c->md,
                                                            &c->payload, cq, cq, &c->requested);
    if (e != GRPC_CALL_OK) {
        log_error("rpc_post_failed", "method=%s err=%d", srv->methods[method].path, (int)e);
        call_free(c);
    }
}

static void post_unknown(rpc_server *srv, int cq_index)
{
    if (atomic_load(&srv->stopping))
        return;
    rpc_call *c = call_new(srv, cq_index, 0);
    if (c == NULL)
        return;
    c->requested.kind = TAG_UNKNOWN;
    grpc_call_details_init(&c->details);
    grpc_completion_queue *cq = srv->cqs[cq_index];
    if (grpc_server_request_call(srv->server, &c->call, &c->details, &c->md, cq, cq,
                                 &c->requested) != GRPC_CALL_OK)
        call_free(c);
}

/* ---- replying -------------------------------------------------------------- */

static void token_from_metadata(const grpc_metadata_array *md, char *out, size_t len, int *found)
{
    *found = 0;
    for (size_t i = 0; i < md->count; i++) {
        const grpc_slice *k = &md->metadata[i].key;
        if (GRPC_SLICE_LENGTH(*k) != strlen(RPC_TOKEN_KEY) ||
            memcmp(GRPC_SLICE_START_PTR(*k), RPC_TOKEN_KEY, GRPC_SLICE_LENGTH(*k)) != 0)
            continue;
        size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
        if (n >= len)
            n = len - 1; /* an over-long token simply will not match */
        memcpy(out, GRPC_SLICE_START_PTR(md->metadata[i].value), n);
        out[n] = '\0';
        *found = 1;
        return;
    }
}

/* Send the final batch: initial metadata always (an error-only batch is
 * never flushed in gRPC 1.51, C-STACK.md), the reply if any, the status. */
static void call_finish(rpc_call *c, status_code code, const char *details)
{
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->reply != NULL) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->reply;
    }
    c->status_details = grpc_slice_from_copied_string(details ? details : "");
    c->has_details = 1;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n++].data.send_status_from_server.status_details = &c->status_details;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
    c->done.kind = TAG_REPLIED;
    if (grpc_call_start_batch(c->call, ops, n, &c->done, NULL) != GRPC_CALL_OK) {
        log_error("rpc_reply_failed", "code=%d", (int)code);
        call_free(c);
    }
}

static void stream_start(rpc_call *c)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = c->reply;
    c->pending = 2;
    grpc_op close_op;
    memset(&close_op, 0, sizeof close_op);
    close_op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    close_op.data.recv_close_on_server.cancelled = &c->cancelled;
    c->done.kind = TAG_STREAM_DONE;
    /* Post the close first: that is how we learn the client went away. */
    if (grpc_call_start_batch(c->call, &close_op, 1, &c->done, NULL) != GRPC_CALL_OK) {
        /* We would never learn of the end: end the stream's work now. */
        c->srv->methods[c->method].stream_closed(c->srv->app, c->cookie);
        c->pending--;
    }
    if (grpc_call_start_batch(c->call, ops, 2, &c->sent, NULL) != GRPC_CALL_OK)
        c->pending--;
    if (c->pending == 0)
        call_free(c);
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static status_code serve_call(rpc_call *c);

/* Whether the call came over TCP: the Unix socket's peer is "unix:...". */
static int call_is_tcp(grpc_call *call)
{
    char *peer = grpc_call_get_peer(call);
    int tcp = peer == NULL || strncmp(peer, "unix:", 5) != 0;
    gpr_free(peer);
    return tcp;
}

/* Serve a call, telling the metrics hook (if any) its status and duration. */
static void handle_request(rpc_call *c)
{
    rpc_server *srv = c->srv;
    if (srv->observe == NULL) {
        serve_call(c);
        return;
    }
    size_t method = c->method; /* c may be freed by the time we return */
    double t0 = now_seconds();
    status_code code = serve_call(c);
    srv->observe(srv->observe_ctx, method, (int)code, now_seconds() - t0);
}

static status_code serve_call(rpc_call *c)
{
    rpc_server *srv = c->srv;
    const rpc_method *m = &srv->methods[c->method];
    char token[RPC_TOKEN_MAX + 1];
    int has_token;
    token_from_metadata(&c->md, token, sizeof token, &has_token);
    status st = {ST_OK, ""};
    /* Anyone on the host can reach the TCP port, and only the filesystem's
     * users (the daemon's uid, root) the Unix socket: over TCP only a
     * session's token opens more than health (rpc.h). */
    if (!has_token && strncmp(m->path, RPC_PUBLIC_PREFIX, strlen(RPC_PUBLIC_PREFIX)) != 0 &&
        call_is_tcp(c->call)) {
        status_set(&st, ST_UNAUTHENTICATED,
                   "over TCP, %s needs the kvstash-token metadata of a fd-socket session "
                   "(docs/protocol.md); without one only grpc.health.v1.Health answers",
                   m->path);
        log_info("rpc_unauthenticated", "method=%s", m->path);
        call_finish(c, st.code, st.msg);
        return st.code;
    }
    ProtobufCMessage *req = pbgrpc_unpack(m->request, c->payload);
    if (req == NULL) {
        status_set(&st, ST_INVALID_ARGUMENT, "request is not a valid %s message", m->request->name);
        log_info("rpc_bad_request", "method=%s", m->path);
        call_finish(c, st.code, st.msg);
        return st.code;
    }
    char field[64];
    if (!pbgrpc_strings_valid(req, field, sizeof field)) {
        status_set(&st, ST_INVALID_ARGUMENT, "%s is not valid UTF-8", field);
        protobuf_c_message_free_unpacked(req, NULL);
        call_finish(c, st.code, st.msg);
        return st.code;
    }
    status_code rc;
    const char *tok = has_token ? token : NULL;
    if (m->unary != NULL)
        rc = m->unary(srv->app, tok, req, &c->reply, &st);
    else
        rc = m->stream_open(srv->app, tok, req, &c->reply, &c->cookie, &st);
    protobuf_c_message_free_unpacked(req, NULL);
    if (rc != ST_OK) {
        char quoted[2 * STATUS_MSG_LEN];
        log_escape(st.msg, quoted, sizeof quoted);
        log_debug("rpc_error", "method=%s code=%s msg=\"%s\"", m->path, status_name(rc), quoted);
        if (c->reply != NULL) {
            grpc_byte_buffer_destroy(c->reply);
            c->reply = NULL;
        }
        call_finish(c, rc, st.msg);
    } else if (m->unary != NULL) {
        call_finish(c, ST_OK, "");
    } else {
        stream_start(c);
    }
    return rc;
}

static void stream_batch_done(rpc_call *c, tag_kind kind)
{
    if (kind == TAG_STREAM_DONE)
        c->srv->methods[c->method].stream_closed(c->srv->app, c->cookie);
    if (--c->pending == 0)
        call_free(c);
}

/* ---- the completion-queue threads ----------------------------------------- */

static void dispatch(rpc_server *srv, int cq_index, rpc_tag *tag, int ok)
{
    rpc_call *c = tag->call;
    switch (tag->kind) {
    case TAG_REQUESTED:
        if (!ok) { /* the server is shutting down */
            call_free(c);
            return;
        }
        post_registered(srv, cq_index, c->method);
        handle_request(c);
        return;
    case TAG_UNKNOWN:
        if (!ok) {
            call_free(c);
            return;
        }
        post_unknown(srv, cq_index);
        call_finish(c, ST_UNIMPLEMENTED, "kvstashd does not serve this method");
        return;
    case TAG_REPLIED:
        call_free(c);
        return;
    case TAG_STREAM_SENT:
    case TAG_STREAM_DONE:
        stream_batch_done(c, tag->kind);
        return;
    case TAG_SHUTDOWN:
        pthread_mutex_lock(&srv->lock);
        srv->shutdown_seen = 1;
        pthread_cond_broadcast(&srv->cond);
        pthread_mutex_unlock(&srv->lock);
        return;
    }
}

typedef struct thread_arg {
    rpc_server *srv;
    int cq_index;
} thread_arg;

static void *cq_thread(void *arg)
{
    thread_arg a = *(thread_arg *)arg;
    free(arg);
    grpc_completion_queue *cq = a.srv->cqs[a.cq_index];
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return NULL;
        if (ev.type == GRPC_OP_COMPLETE)
            dispatch(a.srv, a.cq_index, ev.tag, ev.success);
    }
}

/* ---- start and stop ------------------------------------------------------- */

int rpc_addr_is_loopback(const char *addr)
{
    return strncmp(addr, "127.", 4) == 0 || strncmp(addr, "localhost:", 10) == 0 ||
           strncmp(addr, "[::1]:", 6) == 0;
}

status_code rpc_tcp_allowed(const char *addr, const rpc_tls *tls, status *st)
{
    if (tls != NULL || rpc_addr_is_loopback(addr))
        return ST_OK;
    /* Off loopback anyone on the network could connect: only with TLS and
     * client certificates, which decide who may connect at all. */
    return status_set(st, ST_INVALID_ARGUMENT,
                      "--listen %s is not a loopback address; kvstashd serves TCP beyond "
                      "127.0.0.0/8 and [::1] only with TLS: set tls-cert, tls-key and "
                      "tls-client-ca",
                      addr);
}

/* The whole file at `path` as a NUL-terminated string, or NULL (errno set;
 * EINVAL: no PEM block in it). */
static char *read_pem(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t len = 0, cap = 4096;
    char *buf = malloc(cap);
    size_t n;
    while (buf != NULL && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (len + 1 == cap) {
            char *bigger = cap < (1u << 24) ? realloc(buf, cap * 2) : NULL;
            if (bigger == NULL) {
                free(buf);
                buf = NULL;
                errno = EFBIG;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    int failed = ferror(f);
    fclose(f);
    if (buf == NULL || failed) {
        free(buf);
        if (failed)
            errno = EIO;
        return NULL;
    }
    buf[len] = '\0';
    /* gRPC would only fail at the first handshake, far from the cause. */
    if (strstr(buf, "-----BEGIN ") == NULL) {
        free(buf);
        errno = EINVAL;
        return NULL;
    }
    return buf;
}

status_code rpc_tls_load(const char *cert_path, const char *key_path, const char *client_ca_path,
                         rpc_tls *out, status *st)
{
    const char *keys[3] = {"tls-cert", "tls-key", "tls-client-ca"};
    const char *paths[3] = {cert_path, key_path, client_ca_path};
    char **dst[3] = {&out->cert_pem, &out->key_pem, &out->client_ca_pem};
    memset(out, 0, sizeof *out);
    for (int i = 0; i < 3; i++) {
        if ((*dst[i] = read_pem(paths[i])) == NULL) {
            int e = errno;
            rpc_tls_free(out);
            return status_set(st, ST_INVALID_ARGUMENT, "%s %s: %s", keys[i], paths[i],
                              e == EINVAL ? "no PEM block in it" : strerror(e));
        }
    }
    return ST_OK;
}

void rpc_tls_free(rpc_tls *tls)
{
    if (tls == NULL)
        return;
    free(tls->cert_pem);
    /* The private key: leave no copy in freed heap memory. */
    if (tls->key_pem != NULL)
        memset(tls->key_pem, 0, strlen(tls->key_pem));
    free(tls->key_pem);
    free(tls->client_ca_pem);
    memset(tls, 0, sizeof *tls);
}

/* Credentials for the TCP port: plain, or TLS that requires a client
 * certificate signed by the client CA (the handshake fails without one). */
static grpc_server_credentials *tcp_credentials(const rpc_tls *tls)
{
    if (tls == NULL)
        return grpc_insecure_server_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = {tls->key_pem, tls->cert_pem};
    return grpc_ssl_server_credentials_create_ex(
        tls->client_ca_pem, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
        NULL);
}

static status_code add_ports(rpc_server *srv, const rpc_config *cfg, status *st)
{
    char uri[4200];
    snprintf(uri, sizeof uri, "unix:%s", cfg->unix_path);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    /* Socket mode 0600 comes from the daemon's umask (main.c). */
    int port = grpc_server_add_http2_port(srv->server, uri, creds);
    grpc_server_credentials_release(creds);
    if (port == 0)
        return status_set(st, ST_UNAVAILABLE, "cannot listen on %s", uri);
    if (cfg->tcp_addr == NULL)
        return ST_OK;
    if (rpc_tcp_allowed(cfg->tcp_addr, cfg->tls, st) != ST_OK)
        return st->code;
    creds = tcp_credentials(cfg->tls);
    port = creds != NULL ? grpc_server_add_http2_port(srv->server, cfg->tcp_addr, creds) : 0;
    if (creds != NULL)
        grpc_server_credentials_release(creds);
    if (port == 0)
        return status_set(st, ST_UNAVAILABLE, "cannot listen on %s%s", cfg->tcp_addr,
                          cfg->tls != NULL ? " with TLS (are tls-cert and tls-key a pair?)" : "");
    log_info("rpc_listening", "addr=%s tls=%d", cfg->tcp_addr, cfg->tls != NULL);
    return ST_OK;
}

static void server_free(rpc_server *srv)
{
    if (srv->server != NULL)
        grpc_server_destroy(srv->server);
    for (int i = 0; srv->cqs != NULL && i < srv->nthreads; i++)
        if (srv->cqs[i] != NULL)
            grpc_completion_queue_destroy(srv->cqs[i]);
    free(srv->cqs);
    free(srv->threads);
    free(srv->handles);
    pthread_mutex_destroy(&srv->lock);
    pthread_cond_destroy(&srv->cond);
    free(srv);
    grpc_shutdown();
}

/* Shut down a server that never started. gRPC asserts at destroy that a
 * server with a listener (the Unix port, when the TCP one then failed: port
 * taken, certificate and key not a pair) was shut down: kvstashd aborted. */
static void server_abandon(rpc_server *srv)
{
    if (srv->server == NULL || srv->cqs[0] == NULL)
        return;
    grpc_server_shutdown_and_notify(srv->server, srv->cqs[0], &srv->shutdown_tag);
    grpc_event ev;
    do
        ev = grpc_completion_queue_next(srv->cqs[0], gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    while (ev.type == GRPC_OP_COMPLETE && ev.tag != &srv->shutdown_tag);
}

static status_code server_create(rpc_server *srv, const rpc_config *cfg, status *st)
{
    /* gRPC sets SO_REUSEPORT by default: a second kvstashd (of our uid)
     * would share --listen and take half the clients, to its own store. */
    grpc_arg arg = {
        .type = GRPC_ARG_INTEGER, .key = (char *)GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0};
    grpc_channel_args args = {.num_args = 1, .args = &arg};
    srv->server = grpc_server_create(&args, NULL);
    for (size_t i = 0; i < srv->nmethods; i++)
        srv->handles[i] = grpc_server_register_method(srv->server, srv->methods[i].path, NULL,
                                                      GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    for (int i = 0; i < srv->nthreads; i++) {
        srv->cqs[i] = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(srv->server, srv->cqs[i], NULL);
    }
    return add_ports(srv, cfg, st);
}

status_code rpc_server_start(const rpc_config *cfg, const rpc_method *methods, size_t nmethods,
                             void *app, rpc_server **out, status *st)
{
    *out = NULL;
    grpc_init();
    rpc_server *srv = calloc(1, sizeof *srv);
    if (srv == NULL) {
        grpc_shutdown();
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    srv->methods = methods;
    srv->nmethods = nmethods;
    srv->app = app;
    srv->observe = cfg->observe;
    srv->observe_ctx = cfg->observe_ctx;
    srv->nthreads = cfg->threads > 0 ? cfg->threads : 1;
    srv->own_cq = -1;
    for (size_t m = 0; m < nmethods && srv->own_cq < 0; m++)
        if (methods[m].own_thread)
            srv->own_cq = srv->nthreads++;
    srv->shutdown_tag = (rpc_tag){TAG_SHUTDOWN, NULL};
    pthread_mutex_init(&srv->lock, NULL);
    pthread_cond_init(&srv->cond, NULL);
    srv->handles = calloc(nmethods, sizeof *srv->handles);
    srv->cqs = calloc((size_t)srv->nthreads, sizeof *srv->cqs);
    srv->threads = calloc((size_t)srv->nthreads, sizeof *srv->threads);
    if (srv->handles == NULL || srv->cqs == NULL || srv->threads == NULL) {
        server_free(srv);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (server_create(srv, cfg, st) != ST_OK) {
        server_abandon(srv);
        server_free(srv);
        return st->code;
    }
    grpc_server_start(srv->server);
    for (int q = 0; q < srv->nthreads; q++) {
        /* A method is requested on its own CQ or on all the others, and a
         * call only ever runs on a CQ that requested its method. */
        for (size_t m = 0; m < nmethods; m++) {
            if ((methods[m].own_thread != 0) != (q == srv->own_cq))
                continue;
            for (int k = 0; k < RPC_POSTED_PER_METHOD; k++)
                post_registered(srv, q, m);
        }
        if (q != srv->own_cq)
            post_unknown(srv, q);
    }
    for (int q = 0; q < srv->nthreads; q++) {
        thread_arg *a = malloc(sizeof *a);
        *a = (thread_arg){srv, q};
        pthread_create(&srv->threads[q], NULL, cq_thread, a);
    }
    *out = srv;
    return ST_OK;
}

void rpc_server_stop(rpc_server *srv)
{
    if (srv == NULL)
        return;
    atomic_store(&srv->stopping, 1);
    grpc_server_shutdown_and_notify(srv->server, srv->cqs[0], &srv->shutdown_tag);
    grpc_server_cancel_all_calls(srv->server);
    pthread_mutex_lock(&srv->lock);
    while (!srv->shutdown_seen)
        pthread_cond_wait(&srv->cond, &srv->lock);
    pthread_mutex_unlock(&srv->lock);
    for (int q = 0; q < srv->nthreads; q++)
        grpc_completion_queue_shutdown(srv->cqs[q]);
    for (int q = 0; q < srv->nthreads; q++)
        pthread_join(srv->threads[q], NULL);
    server_free(srv);
}
