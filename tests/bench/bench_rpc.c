/*
 * bench_rpc.c - what a control-plane call and a K/V write cost, each against
 * a baseline measured in the same run (DESIGN.md, "Performance budget").
 *
 *   (a) raw Unix-socket ping-pong: a forked echo child, 64-byte messages;
 *   (b) gRPC unary round trips through gRPC C core against a real kvstashd
 *       that this program starts on a temporary socket: Stats (no token), and
 *       Append of one token (with its own fd-socket handshake and token);
 *   (c) the per-step path of libkvstash, the session's shared-memory ring:
 *       an empty ping, an Append of one token, and a whole decode step of a
 *       "full" sequence (append + step report + epoch check);
 *   (d) worker write bandwidth: kvs_layer_write of K/V into the mapped pool
 *       versus memcpy of the same bytes between two private buffers.
 *
 * Usage: bench_rpc [--quick] [--pin CPU] [PATH_TO_KVSTASHD]
 * The daemon path defaults to $KVSTASHD, then ../../daemon/kvstashd next to
 * this binary. --pin runs everything (this process, the echo child and the
 * daemon with all its threads) on one CPU, which removes the cross-CPU
 * wake-ups from every round trip (C-STACK.md measured pinned). Prints a table and a final "ratios:"
 * line; exits non-zero if any part could not run (the ratios themselves never fail it).
 */
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "bench_daemon.h"
#include "kvstash.h"
#include "kvstash/v1/store.pb-c.h"
#include "pbgrpc.h"

#define MSG_BYTES 64
#define POOL_MB 192

typedef struct bench_cfg {
    size_t raw_n;       /* ping-pong round trips */
    size_t grpc_n;      /* Stats calls */
    size_t append_n;    /* one-token appends */
    size_t write_bytes; /* K+V bytes written per repetition */
    int reps;           /* bandwidth repetitions (median reported) */
} bench_cfg;

static int io_full(int fd, void *buf, size_t len, int writing)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t r = writing ? write(fd, p, len) : read(fd, p, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

/* (a) Round trips of MSG_BYTES through a forked echo child. */
static int bench_raw(size_t n, bench_latency *out)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        perror("socketpair");
        return -1;
    }
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return -1;
    }
    if (child == 0) {
        char buf[MSG_BYTES];
        close(sv[0]);
        while (io_full(sv[1], buf, sizeof buf, 0) == 0)
            if (io_full(sv[1], buf, sizeof buf, 1) != 0)
                break;
        _exit(0);
    }
    close(sv[1]);
    double *t = malloc(n * sizeof *t);
    char msg[MSG_BYTES];
    memset(msg, 'x', sizeof msg);
    int rc = 0;
    for (size_t i = 0; i < n / 10 + n && rc == 0; i++) { /* first n/10: warm-up */
        double t0 = bench_now_us();
        rc = io_full(sv[0], msg, sizeof msg, 1) || io_full(sv[0], msg, sizeof msg, 0);
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
    }
    close(sv[0]);
    waitpid(child, NULL, 0);
    if (rc == 0)
        *out = bench_summarize(t, n);
    else
        fprintf(stderr, "bench_rpc: raw ping-pong failed\n");
    free(t);
    return rc ? -1 : 0;
}

/* One unary call of `method`; returns the gRPC status (or -1 if the call
 * did not complete) and, on OK, the decoded reply in *resp. */
static int unary(grpc_channel *ch, grpc_completion_queue *cq, const char *method, const char *token,
                 const ProtobufCMessage *req, const ProtobufCMessageDescriptor *rdesc,
                 ProtobufCMessage **resp)
{
    grpc_metadata md;
    memset(&md, 0, sizeof md);
    if (token) {
        md.key = grpc_slice_from_static_string("kvstash-token");
        md.value = grpc_slice_from_static_string(token);
    }
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_seconds(5, GPR_TIMESPAN));
    grpc_call *call =
        grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                 grpc_slice_from_static_string(method), NULL, deadline, NULL);
    grpc_byte_buffer *send = pbgrpc_pack(req), *recv = NULL;
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = token ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = token ? &md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int rc = -1;
    if (grpc_call_start_batch(call, ops, 6, call, NULL) == GRPC_CALL_OK) {
        grpc_event ev = grpc_completion_queue_pluck(
            cq, call, gpr_time_add(deadline, gpr_time_from_seconds(1, GPR_TIMESPAN)), NULL);
        if (ev.type == GRPC_OP_COMPLETE && ev.success)
            rc = (int)status;
    }
    if (rc == GRPC_STATUS_OK && resp) {
        *resp = pbgrpc_unpack(rdesc, recv);
        if (*resp == NULL)
            rc = GRPC_STATUS_INTERNAL;
    }
    if (rc != GRPC_STATUS_OK && GRPC_SLICE_LENGTH(details) > 0) {
        char *d = grpc_slice_to_c_string(details);
        fprintf(stderr, "bench_rpc: %s: status %d: %s\n", method, rc, d);
        gpr_free(d);
    }
    grpc_byte_buffer_destroy(send);
    if (recv)
        grpc_byte_buffer_destroy(recv);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_call_unref(call);
    return rc;
}

static grpc_channel *channel_open(const char *sock)
{
    char target[PATH_MAX + 8];
    snprintf(target, sizeof target, "unix:%s", sock);
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(target, creds, NULL);
    grpc_channel_credentials_release(creds);
    return ch;
}

static void channel_close(grpc_channel *ch, grpc_completion_queue *cq)
{
    grpc_channel_destroy(ch);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
}

/* (b) Stats round trips; the first successful call (retried for up to 10 s
 * while the daemon comes up) also prints the daemon's version. */
static int bench_grpc(const char *sock, size_t n, bench_latency *out)
{
    grpc_channel *ch = channel_open(sock);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    Kvstash__V1__StatsRequest req = KVSTASH__V1__STATS_REQUEST__INIT;
    const char *m = "/kvstash.v1.Store/Stats";
    int rc = -1;
    for (int i = 0; i < 100 && rc != GRPC_STATUS_OK; i++) {
        ProtobufCMessage *resp = NULL;
        rc = unary(ch, cq, m, NULL, &req.base, &kvstash__v1__stats_response__descriptor, &resp);
        if (rc == GRPC_STATUS_OK) {
            Kvstash__V1__StatsResponse *s = (Kvstash__V1__StatsResponse *)resp;
            printf("kvstashd %s, backend %s, %zu policies\n", s->version, s->backend,
                   s->n_policies);
            protobuf_c_message_free_unpacked(resp, NULL);
        } else {
            usleep(100000);
        }
    }
    double *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n / 10 + n && rc == GRPC_STATUS_OK; i++) {
        ProtobufCMessage *resp = NULL;
        double t0 = bench_now_us();
        rc = unary(ch, cq, m, NULL, &req.base, &kvstash__v1__stats_response__descriptor, &resp);
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
    }
    if (rc == GRPC_STATUS_OK)
        *out = bench_summarize(t, n);
    else
        fprintf(stderr, "bench_rpc: gRPC Stats failed (status %d)\n", rc);
    free(t);
    channel_close(ch, cq);
    return rc == GRPC_STATUS_OK ? 0 : -1;
}

/* The geometry of the write benchmark: 4 layers, 8 KV heads of 128 fp16
 * channels, 16-token blocks: 16 KiB of K+V per token over all layers. */
static const kvs_geometry bench_geom = {.layers = 4,
                                        .q_heads = 32,
                                        .kv_heads = 8,
                                        .head_dim = 128,
                                        .block_tokens = 16,
                                        .dtype = KVS_FP16,
                                        .rope_theta = 0};

static size_t token_bytes(void)
{
    return (size_t)bench_geom.layers * 2 * bench_geom.kv_heads * bench_geom.head_dim * 2;
}

/* The fd-socket handshake of docs/protocol.md: "HELLO 1" -> "OK <token>".
 * Returns the connection (keep it open: closing it ends the session). */
static int fd_hello(const char *sock, char token[33])
{
    char path[PATH_MAX], buf[257];
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int fd = -1;
    if ((size_t)snprintf(path, sizeof path, "%s.fd", sock) >= sizeof path ||
        (size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path) >= sizeof addr.sun_path)
        goto fail;
    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        send(fd, "HELLO 1", 7, 0) != 7)
        goto fail;
    ssize_t n = recv(fd, buf, sizeof buf - 1, 0);
    if (n != 35 || memcmp(buf, "OK ", 3) != 0)
        goto fail;
    memcpy(token, buf + 3, 32);
    token[32] = '\0';
    return fd;
fail:
    fprintf(stderr, "bench_rpc: fd-socket handshake on %s failed\n", path);
    if (fd >= 0)
        close(fd);
    return -1;
}

/* (b) One-token Appends over gRPC, as a client without libkvstash would make
 * them: handshake, Attach, CreateSequence, then Append with the token. */
static int bench_grpc_append(const char *sock, size_t n, bench_latency *out)
{
    char token[33];
    int fd = fd_hello(sock, token);
    if (fd < 0)
        return -1;
    grpc_channel *ch = channel_open(sock);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    Kvstash__V1__Geometry g = KVSTASH__V1__GEOMETRY__INIT;
    g.layers = bench_geom.layers;
    g.q_heads = bench_geom.q_heads;
    g.kv_heads = bench_geom.kv_heads;
    g.head_dim = bench_geom.head_dim;
    g.dtype = KVSTASH__V1__DTYPE__DTYPE_FP16;
    g.block_tokens = bench_geom.block_tokens;
    Kvstash__V1__AttachRequest at = KVSTASH__V1__ATTACH_REQUEST__INIT;
    at.model = "bench";
    at.geometry = &g;
    at.worker_name = "bench_rpc-grpc";
    Kvstash__V1__CreateSequenceRequest cr = KVSTASH__V1__CREATE_SEQUENCE_REQUEST__INIT;
    cr.policy = "full";
    ProtobufCMessage *resp = NULL;
    uint64_t seq = 0, epoch = 0;
    int rc = unary(ch, cq, "/kvstash.v1.Store/Attach", token, &at.base,
                   &kvstash__v1__attach_response__descriptor, &resp);
    if (rc == GRPC_STATUS_OK) {
        protobuf_c_message_free_unpacked(resp, NULL);
        rc = unary(ch, cq, "/kvstash.v1.Store/CreateSequence", token, &cr.base,
                   &kvstash__v1__create_sequence_response__descriptor, &resp);
    }
    if (rc == GRPC_STATUS_OK) {
        seq = ((Kvstash__V1__CreateSequenceResponse *)resp)->seq_id;
        protobuf_c_message_free_unpacked(resp, NULL);
    }
    double *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n / 10 + n && rc == GRPC_STATUS_OK; i++) {
        Kvstash__V1__AppendRequest ap = KVSTASH__V1__APPEND_REQUEST__INIT;
        ap.seq_id = seq;
        ap.count = 1;
        ap.ack_epoch = epoch;
        double t0 = bench_now_us();
        rc = unary(ch, cq, "/kvstash.v1.Store/Append", token, &ap.base,
                   &kvstash__v1__append_response__descriptor, &resp);
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
        if (rc == GRPC_STATUS_OK) {
            epoch = ((Kvstash__V1__AppendResponse *)resp)->epoch;
            protobuf_c_message_free_unpacked(resp, NULL);
        }
    }
    if (rc == GRPC_STATUS_OK)
        *out = bench_summarize(t, n);
    else
        fprintf(stderr, "bench_rpc: gRPC Attach/CreateSequence/Append failed (status %d)\n", rc);
    free(t);
    if (rc == GRPC_STATUS_OK) {
        Kvstash__V1__DetachRequest dt = KVSTASH__V1__DETACH_REQUEST__INIT;
        rc = unary(ch, cq, "/kvstash.v1.Store/Detach", token, &dt.base,
                   &kvstash__v1__detach_response__descriptor, &resp);
        if (rc == GRPC_STATUS_OK)
            protobuf_c_message_free_unpacked(resp, NULL);
    }
    channel_close(ch, cq);
    close(fd);
    return rc == GRPC_STATUS_OK ? 0 : -1;
}

static void report_fail(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, "bench_rpc: %s: %s: %s\n", what, kvs_strerror(rc), kvs_session_error(s));
}

/* (c) Empty round trips on the session's ring. */
static int bench_ring_ping(kvs_session *s, size_t n, bench_latency *out)
{
    double *t = malloc(n * sizeof *t);
    int rc = 0;
    for (size_t i = 0; i < n / 10 + n && rc == 0; i++) {
        double t0 = bench_now_us();
        rc = kvs_ring_ping(s);
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
    }
    if (rc == 0)
        *out = bench_summarize(t, n);
    else
        report_fail(s, "kvs_ring_ping", rc);
    free(t);
    return rc == 0 ? 0 : -1;
}

/* (c) Decode steps of a "full" sequence as a worker makes them: append one
 * token, report the step (no score arrays: full needs none), check the epoch. */
static int bench_step(kvs_session *s, size_t n, bench_latency *out)
{
    uint64_t seq, epoch;
    int rc = kvs_seq_create(s, "full", NULL, 0, "bench-step", &seq);
    if (rc != 0) {
        report_fail(s, "kvs_seq_create", rc);
        return -1;
    }
    double *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n / 10 + n && rc == 0; i++) {
        kvs_table w;
        kvs_step st = {.new_tokens = 1, .confidence = -1};
        double t0 = bench_now_us();
        rc = kvs_seq_append(s, seq, 1, &w);
        if (rc == 0) {
            kvs_table_free(&w);
            rc = kvs_seq_step(s, seq, &st, NULL);
            if (rc == 0)
                rc = kvs_seq_epoch(s, seq, &epoch);
            else
                report_fail(s, "kvs_seq_step", rc);
        } else {
            report_fail(s, "kvs_seq_append", rc);
        }
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
    }
    if (rc == 0)
        *out = bench_summarize(t, n);
    free(t);
    int rr = kvs_seq_release(s, seq);
    return rc == 0 && rr == 0 ? 0 : -1;
}

/* (c) One-token appends through libkvstash on a fresh "full" sequence. */
static int bench_append(kvs_session *s, size_t n, bench_latency *out)
{
    uint64_t seq;
    int rc = kvs_seq_create(s, "full", NULL, 0, "bench-append", &seq);
    if (rc != 0) {
        fprintf(stderr, "bench_rpc: kvs_seq_create: %s: %s\n", kvs_strerror(rc),
                kvs_session_error(s));
        return -1;
    }
    double *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n / 10 + n && rc == 0; i++) {
        kvs_table w;
        memset(&w, 0, sizeof w);
        double t0 = bench_now_us();
        rc = kvs_seq_append(s, seq, 1, &w);
        if (i >= n / 10)
            t[i - n / 10] = bench_now_us() - t0;
        if (rc == 0)
            kvs_table_free(&w);
    }
    if (rc == 0)
        *out = bench_summarize(t, n);
    else
        fprintf(stderr, "bench_rpc: kvs_seq_append: %s: %s\n", kvs_strerror(rc),
                kvs_session_error(s));
    free(t);
    int rr = kvs_seq_release(s, seq);
    return rc == 0 && rr == 0 ? 0 : -1;
}

/* (d) kvs_layer_write into the pool vs memcpy between private buffers, same
 * source buffers and bytes. Bandwidths in GB/s of bytes written. */
static int bench_write(kvs_session *s, const bench_cfg *cfg, double *write_gbs, double *memcpy_gbs,
                       size_t *bytes)
{
    const kvs_geometry *g = &bench_geom;
    size_t tokens = cfg->write_bytes / token_bytes();
    size_t half = (size_t)g->kv_heads * tokens * g->head_dim * 2; /* K (or V) of one layer */
    *bytes = tokens * token_bytes();
    uint64_t seq;
    int rc = kvs_seq_create(s, "full", NULL, 0, "bench-write", &seq);
    if (rc != 0) {
        fprintf(stderr, "bench_rpc: kvs_seq_create: %s: %s\n", kvs_strerror(rc),
                kvs_session_error(s));
        return -1;
    }
    kvs_table w;
    memset(&w, 0, sizeof w);
    rc = kvs_seq_append(s, seq, (int64_t)tokens, &w);
    if (rc != 0) {
        fprintf(stderr, "bench_rpc: kvs_seq_append(%zu): %s: %s\n", tokens, kvs_strerror(rc),
                kvs_session_error(s));
        kvs_seq_release(s, seq);
        return -1;
    }
    uint8_t *k = malloc(half), *v = malloc(half), *dst = malloc(*bytes), *back = malloc(2 * half);
    for (size_t i = 0; i < half; i++) {
        k[i] = (uint8_t)(i * 31 + 7);
        v[i] = (uint8_t)(i * 17 + 3);
    }
    memset(dst, 0, *bytes);
    double tw[16], tm[16];
    for (int r = -1; r < cfg->reps; r++) { /* r = -1: warm-up, faults the pages in */
        double t0 = bench_now_us();
        for (uint32_t l = 0; l < g->layers; l++)
            kvs_layer_write(s, &w.layer[l], k, v);
        double t1 = bench_now_us();
        for (uint32_t l = 0; l < g->layers; l++) {
            memcpy(dst + (size_t)l * 2 * half, k, half);
            memcpy(dst + (size_t)l * 2 * half + half, v, half);
        }
        double t2 = bench_now_us();
        if (r >= 0) {
            tw[r] = t1 - t0;
            tm[r] = t2 - t1;
        }
    }
    /* The benchmark must have written the real thing: read a layer back. */
    kvs_layer_read(s, &w.layer[g->layers - 1], back, back + half);
    int ok = memcmp(back, k, half) == 0 && memcmp(back + half, v, half) == 0 &&
             dst[*bytes - 1] == v[half - 1];
    if (!ok)
        fprintf(stderr, "bench_rpc: K/V read back from the pool differ from what was written\n");
    *write_gbs = (double)*bytes / bench_median(tw, (size_t)cfg->reps) / 1e3;
    *memcpy_gbs = (double)*bytes / bench_median(tm, (size_t)cfg->reps) / 1e3;
    free(k);
    free(v);
    free(dst);
    free(back);
    kvs_table_free(&w);
    int rr = kvs_seq_release(s, seq);
    return ok && rr == 0 ? 0 : -1;
}

static void print_latency(const char *what, const bench_latency *l)
{
    printf("%-40s %8zu %10.1f %10.1f\n", what, l->n, l->p50_us, l->mean_us);
}

int main(int argc, char **argv)
{
    bench_cfg cfg = {20000, 2000, 2000, (size_t)64 << 20, 7};
    const char *daemon = NULL;
    int pin = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            cfg = (bench_cfg){5000, 500, 500, (size_t)16 << 20, 3};
        else if (strcmp(argv[i], "--pin") == 0 && i + 1 < argc)
            pin = atoi(argv[++i]);
        else if (argv[i][0] == '-') {
            fprintf(stderr, "usage: %s [--quick] [--pin CPU] [PATH_TO_KVSTASHD]\n", argv[0]);
            return 2;
        } else
            daemon = argv[i];
    }
    if (daemon == NULL)
        daemon = bench_default_daemon();
    signal(SIGPIPE, SIG_IGN);
    atexit(bench_daemon_cleanup);
    if (pin >= 0) { /* inherited by the echo child and the daemon */
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(pin, &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0) {
            perror("sched_setaffinity");
            return 2;
        }
    }
    printf("bench_rpc: %s run, %s\n", cfg.raw_n == 20000 ? "full" : "quick",
           pin >= 0 ? "all processes pinned to one CPU" : "processes not pinned");

    bench_latency raw = {0}, grpc = {0}, gapp = {0}, ping = {0}, app = {0}, step = {0};
    double wgbs = 0, mgbs = 0;
    size_t wbytes = 0;
    int failed = 0;

    /* Fork the echo child and the daemon before gRPC starts its threads. */
    failed |= bench_raw(cfg.raw_n, &raw) != 0;
    char sock[PATH_MAX];
    if (bench_daemon_start("bench_rpc", daemon, POOL_MB, NULL, sock, sizeof sock) != 0)
        return 1;
    grpc_init();
    failed |= bench_grpc(sock, cfg.grpc_n, &grpc) != 0;
    failed |= bench_grpc_append(sock, cfg.append_n, &gapp) != 0;

    kvs_session *s = NULL;
    char err[256] = "";
    int rc = kvs_session_attach(sock, "bench", &bench_geom, "bench_rpc", &s, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "bench_rpc: kvs_session_attach: %s: %s\n", kvs_strerror(rc), err);
        failed = 1;
    } else {
        failed |= bench_ring_ping(s, cfg.raw_n, &ping) != 0;
        failed |= bench_append(s, cfg.append_n, &app) != 0;
        failed |= bench_step(s, cfg.append_n, &step) != 0;
        failed |= bench_write(s, &cfg, &wgbs, &mgbs, &wbytes) != 0;
        if (kvs_session_detach(s) != 0)
            failed = 1;
    }
    grpc_shutdown();
    int ds = bench_daemon_stop();
    if (ds != 0) {
        fprintf(stderr, "bench_rpc: kvstashd exited with status %d\n", ds);
        failed = 1;
    }

    printf("\n%-40s %8s %10s %10s\n", "round trip", "n", "p50 us", "mean us");
    print_latency("raw UDS ping-pong (64 B)", &raw);
    print_latency("gRPC unary Stats", &grpc);
    print_latency("gRPC unary Append (1 token)", &gapp);
    print_latency("ring ping (kvs_ring_ping)", &ping);
    print_latency("ring append (kvs_seq_append, 1 token)", &app);
    print_latency("ring step (append + step + epoch)", &step);
    printf("\n%-40s %8s %10s\n", "write bandwidth", "MiB", "GB/s");
    printf("%-40s %8zu %10.2f\n", "memcpy private -> private", wbytes >> 20, mgbs);
    printf("%-40s %8zu %10.2f\n", "kvs_layer_write into pool", wbytes >> 20, wgbs);
    double r = raw.p50_us > 0 ? raw.p50_us : 1e300;
    printf("\nratios (p50 over raw UDS p50): grpc_stats %.2f, grpc_append %.2f, ring_ping %.2f, "
           "ring_append %.2f, ring_step %.2f; layer_write/memcpy %.2f\n",
           grpc.p50_us / r, gapp.p50_us / r, ping.p50_us / r, app.p50_us / r, step.p50_us / r,
           mgbs > 0 ? wgbs / mgbs : 0);
    if (failed)
        fprintf(stderr, "bench_rpc: some parts failed (see above)\n");
    return failed ? 1 : 0;
}
