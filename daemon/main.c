/*
 * kvstashd - the KV-cache sidecar daemon: flags, start-up order, signals,
 * clean shutdown.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "events.h"
#include "fdsock.h"
#include "host.h"
#include "log.h"
#include "metrics.h"
#include "remote_tier.h"
#include "spiller.h"
#include "rpc.h"
#include "service.h"
#include "store.h"

/* `text` word-wrapped to 78 columns, each line indented by 6 spaces. */
static void print_wrapped(FILE *out, const char *text)
{
    const int width = 72;
    while (*text) {
        int len = (int)strlen(text);
        if (len > width) {
            len = width;
            while (len > 0 && text[len] != ' ')
                len--;
            if (len == 0)
                len = width;
        }
        fprintf(out, "      %.*s\n", len, text);
        text += len;
        while (*text == ' ')
            text++;
    }
}

static void usage(FILE *out)
{
    size_t n;
    const config_option *opt = config_options(&n);
    fprintf(out, "usage: kvstashd [--config FILE] [options]\n");
    for (size_t i = 0; i < n; i++) {
        const char *arg = opt[i].kind == CONFIG_BOOL          ? ""
                          : opt[i].kind == CONFIG_PATH        ? " PATH"
                          : opt[i].kind == CONFIG_ADDR        ? " ADDR"
                          : opt[i].kind == CONFIG_LEVEL       ? " L"
                          : opt[i].kind == CONFIG_BACKEND     ? " NAME"
                          : opt[i].kind == CONFIG_CUDA_DEVICE ? " N|GPU-UUID"
                          : opt[i].kind == CONFIG_CUDA_IPC    ? " auto|vmm|legacy"
                          : opt[i].kind == CONFIG_LEASE_END   ? " auto|free|quarantine"
                          : opt[i].kind == CONFIG_PRIORITY    ? " idle|low|normal"
                          : opt[i].kind == CONFIG_UIDS        ? " UID,..."
                          : opt[i].kind == CONFIG_FILE        ? " FILE"
                          : opt[i].kind == CONFIG_NODES       ? " HOST:PORT,..."
                          : opt[i].kind == CONFIG_NAME        ? " NAME"
                                                              : " N";
        fprintf(out, "  --%s%s\n", opt[i].key, arg);
        print_wrapped(out, opt[i].help);
    }
    fprintf(out, "  --config FILE\n"
                 "      read these options from an INI file first ([kvstashd] section, keys\n"
                 "      spelt like the flags: pool_mb = 1024); flags given here win over it\n"
                 "  --print-config\n"
                 "      print the effective configuration (defaults < FILE < flags) and exit\n"
                 "  --version, --help\n");
}

/* getopt_long's `val` for an option: its index in config_options(), or: */
enum { OPT_CONFIG = 1000, OPT_PRINT, OPT_VERSION, OPT_HELP };

/* Every config option as a flag, plus config, print-config, version, help.
 * The caller frees. */
static struct option *long_options(void)
{
    size_t n;
    const config_option *opt = config_options(&n);
    struct option *lo = calloc(n + 5, sizeof *lo);
    if (lo == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++)
        lo[i] = (struct option){
            opt[i].key, opt[i].kind == CONFIG_BOOL ? no_argument : required_argument, NULL, (int)i};
    lo[n] = (struct option){"config", required_argument, NULL, OPT_CONFIG};
    lo[n + 1] = (struct option){"print-config", no_argument, NULL, OPT_PRINT};
    lo[n + 2] = (struct option){"version", no_argument, NULL, OPT_VERSION};
    lo[n + 3] = (struct option){"help", no_argument, NULL, OPT_HELP};
    return lo;
}

/* First pass: --config, --help, --version and unknown flags. */
static int scan_opts(int argc, char **argv, const struct option *lo, const char **file)
{
    int ch;
    opterr = 1;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (ch == OPT_CONFIG)
            *file = optarg;
        else if (ch == OPT_HELP || ch == OPT_VERSION)
            return ch;
        else if (ch == '?')
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "kvstashd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    return 0;
}

/* Second pass: every other flag over the file's values. */
static int apply_flags(int argc, char **argv, const struct option *lo, daemon_config *c, int *print)
{
    size_t n;
    const config_option *opt = config_options(&n);
    char err[512];
    int ch;
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (ch == OPT_PRINT) {
            *print = 1;
        } else if (ch >= 0 && (size_t)ch < n &&
                   config_set(c, opt[ch].key, optarg != NULL ? optarg : "true", err, sizeof err) !=
                       0) {
            fprintf(stderr, "kvstashd: --%s\n", err);
            return 2;
        }
    }
    return 0;
}

/* Defaults, then the --config file, then the flags (config.h). Returns 0 to
 * run, 2 after a usage error (message printed), or -1 when it printed what
 * was asked (--help, --version, --print-config) and kvstashd exits 0. */
static int parse_opts(int argc, char **argv, daemon_config *c)
{
    struct option *lo = long_options();
    if (lo == NULL)
        return 2;
    const char *file = NULL;
    char err[512];
    int print = 0;
    config_defaults(c);
    int rc = scan_opts(argc, argv, lo, &file);
    if (rc == 0 && file != NULL && config_load(c, file, err, sizeof err) != 0) {
        fprintf(stderr, "kvstashd: %s\n", err);
        rc = 2;
    }
    if (rc == 0)
        rc = apply_flags(argc, argv, lo, c, &print);
    free(lo);
    if (rc == OPT_HELP)
        usage(stdout);
    else if (rc == OPT_VERSION)
        printf("kvstashd %s\n", KVSTASH_VERSION);
    else if (rc == 0 && print)
        config_print(c, file != NULL ? file : "defaults and flags", stdout);
    if (rc == OPT_HELP || rc == OPT_VERSION || (rc == 0 && print))
        return -1;
    if (rc == 0 && config_check(c, err, sizeof err) != 0) {
        fprintf(stderr, "kvstashd: %s\n", err);
        rc = 2;
    }
    if (rc == 0)
        log_set_level((log_level)log_parse_level(c->log_level));
    return rc;
}

/* The TLS files, read once at start so that a bad path stops kvstashd
 * before it serves, and --listen off loopback refused without them (rpc.h).
 * Returns 0 (*tls filled, or untouched when TLS is off) or 2 after a message. */
static int load_tls(const daemon_config *c, rpc_tls *tls, int *on)
{
    status st = {ST_OK, ""};
    *on = c->tls_cert[0] != '\0'; /* config_check: all three or none */
    if (*on && rpc_tls_load(c->tls_cert, c->tls_key, c->tls_client_ca, tls, &st) != ST_OK) {
        fprintf(stderr, "kvstashd: %s\n", st.msg);
        return 2;
    }
    if (c->listen[0] != '\0' && rpc_tcp_allowed(c->listen, *on ? tls : NULL, &st) != ST_OK) {
        fprintf(stderr, "kvstashd: %s\n", st.msg);
        rpc_tls_free(tls);
        return 2;
    }
    return 0;
}

/* mkdir -p for the socket's directory, mode 0700. */
static int make_socket_dir(const char *socket)
{
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", socket);
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir)
        return 0;
    *slash = '\0';
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(dir, 0700) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    return mkdir(dir, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* A second daemon would silently take over the live one's sockets
 * (C-STACK.md): hold an exclusive lock on PATH.lock for our whole life. */
static int take_lock(const char *socket)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s.lock", socket);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        fprintf(stderr, "kvstashd: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = "?";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        pid[n > 0 ? n : 1] = '\0';
        fprintf(stderr, "kvstashd: another kvstashd (pid %s) is serving %s\n", strtok(pid, "\n"),
                socket);
        close(fd);
        return -1;
    }
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n)
        fprintf(stderr, "kvstashd: warning: cannot write pid to %s\n", path);
    return fd;
}

static void remove_files(const char *socket)
{
    char path[PATH_MAX];
    unlink(socket);
    snprintf(path, sizeof path, "%s.events", socket);
    unlink(path);
    snprintf(path, sizeof path, "%s.lock", socket);
    unlink(path);
}

typedef struct daemon_parts {
    store *store;
    events *events;
    fdsock *fdsock;
    rpc_server *rpc;
    metrics *metrics;    /* NULL without --metrics */
    remote_tier *remote; /* NULL without --remote */
    spiller *spiller;    /* NULL without --remote-spill-below */
    const rpc_tls *tls;  /* NULL: plain TCP (or none); read by main before start */
} daemon_parts;

/* metrics_source: /metrics and /healthz read the store through these. */
static int source_snapshot(void *st, snapshot *out)
{
    return store_snapshot(st, out);
}

static int source_serving(void *st)
{
    return store_serving(st);
}

static void source_remote(void *st, remote_tier_status *out)
{
    store_remote_status(st, out);
}

/* Counters, and the HTTP endpoint, when --metrics asks for them. */
static int start_metrics(const daemon_config *o, daemon_parts *d)
{
    if (o->metrics[0] == '\0')
        return 0;
    size_t nmethods;
    const rpc_method *methods = service_methods(&nmethods);
    status st;
    if ((d->metrics = metrics_create(methods, nmethods)) == NULL) {
        log_error("start_failed", "what=metrics msg=\"%s\"", "out of memory");
        return -1;
    }
    store_set_metrics(d->store, d->metrics);
    metrics_source source = {d->store, source_snapshot, source_serving, source_remote};
    if (metrics_http_start(d->metrics, &source, o->metrics, o->metrics_allow_remote, &st) !=
        ST_OK) {
        log_error("start_failed", "what=metrics msg=\"%s\"", st.msg);
        return -1;
    }
    const char *colon = strrchr(o->metrics, ':');
    log_info("metrics_listening", "addr=%.*s:%u", (int)(colon - o->metrics), o->metrics,
             metrics_http_port(d->metrics));
    return 0;
}

/* The remote tier, when --remote names a cluster: bad settings stop the
 * start, a cluster that does not answer does not (remote_tier.h). */
static int start_remote(const daemon_config *o, daemon_parts *d)
{
    if (o->remote[0] == '\0')
        return 0;
    remote_tier_config rc = {.seeds = o->remote,
                             .ns = o->remote_namespace,
                             .ttl_s = (uint32_t)o->remote_ttl_s,
                             .timeout_ms = (uint32_t)o->remote_timeout_ms,
                             .probe_ms = (uint32_t)o->remote_probe_ms};
    status st;
    if (remote_tier_open(&rc, &d->remote, &st) != ST_OK) {
        log_error("start_failed", "what=remote msg=\"%s\"", st.msg);
        return -1;
    }
    store_set_remote(d->store, d->remote);
    if (o->remote_spill_below > 0 &&
        (d->spiller = spiller_start(d->store, (uint32_t)o->remote_spill_below)) == NULL)
        return -1;
    return 0;
}

static int start(const daemon_config *o, daemon_parts *d)
{

    store_config cfg = {.pool_bytes = (size_t)o->pool_mb << 20,
                        .max_pools = (uint32_t)o->max_pools,
                        .max_sessions = (uint32_t)o->max_sessions,
                        .max_seqs = (uint32_t)o->max_seqs,
                        .backend = backend_find(o->backend),
                        .max_daemon_bytes = (size_t)o->max_daemon_mb << 20,
                        .session_max_seqs = (uint32_t)o->session_max_seqs,
                        .session_max_blocks = (uint32_t)o->session_max_blocks,
                        .max_reply_bytes = (size_t)o->max_reply_mb << 20,
                        .lease_end_quarantine = config_lease_end_quarantine(o),
                        .quant_group = (uint32_t)o->quant_group,
                        .policy_threads = (uint32_t)o->policy_threads,
                        .policy_parallel_tokens = POLICY_HOST_PARALLEL_TOKENS,
                        .move_priority = config_move_priority(o),
                        .move_background_bytes = STORE_BACKGROUND_MOVE_BYTES};
    char path[PATH_MAX + 16];
    status st;
    snprintf(path, sizeof path, "ipc://%s.events", o->socket);
    if (events_open(path, &d->events, &st) != ST_OK) {
        log_error("start_failed", "what=events msg=\"%s\"", st.msg);
        return -1;
    }
    if ((d->store = store_create(&cfg, d->events)) == NULL) {
        log_error("start_failed", "what=store msg=\"%s\"", "out of memory");
        return -1;
    }
    store_set_operators(d->store, o->operator_uids, o->n_operator_uids);
    if (start_remote(o, d) != 0)
        return -1;
    if (start_metrics(o, d) != 0)
        return -1;
    snprintf(path, sizeof path, "%s.fd", o->socket);
    store_set_lease_timeout(d->store, (uint32_t)o->lease_timeout_ms);
    fdsock_config fc = {(uint32_t)o->pending_timeout_ms, (uint32_t)o->max_pending, d->metrics,
                        (size_t)o->ring_mb << 20};
    if (fdsock_start(path, d->store, &fc, &d->fdsock, &st) != ST_OK) {
        log_error("start_failed", "what=fdsock msg=\"%s\"", st.msg);
        return -1;
    }
    size_t nmethods;
    const rpc_method *methods = service_methods(&nmethods);
    rpc_config rc = {.unix_path = o->socket,
                     .tcp_addr = o->listen[0] ? o->listen : NULL,
                     .threads = (int)o->threads,
                     .observe = d->metrics != NULL ? metrics_rpc : NULL,
                     .observe_ctx = d->metrics,
                     .tls = d->tls};
    unlink(o->socket); /* stale from a dead daemon: our lock proves it dead */
    if (rpc_server_start(&rc, methods, nmethods, d->store, &d->rpc, &st) != ST_OK) {
        log_error("start_failed", "what=grpc msg=\"%s\"", st.msg);
        return -1;
    }
    return 0;
}

static void stop(daemon_parts *d)
{
    store_begin_shutdown(d->store);
    spiller_stop(d->spiller);
    rpc_server_stop(d->rpc); /* ends every lease: sessions are reclaimed */
    fdsock_stop(d->fdsock);
    metrics_http_stop(d->metrics); /* a scrape reads the store */
    store_destroy(d->store);
    remote_tier_close(d->remote);
    metrics_destroy(d->metrics);
    events_close(d->events);
}

/* SIGTERM/SIGINT arrived: report NOT_SERVING (gRPC health, /healthz) for
 * drain_ms and refuse new work, so that probes and load balancers see it
 * before the sockets go; a second signal cuts the wait short. */
static void drain(daemon_parts *d, const sigset_t *sigs, unsigned long drain_ms)
{
    store_begin_shutdown(d->store);
    if (drain_ms == 0)
        return;
    log_info("draining", "ms=%lu", drain_ms);
    uint64_t end = store_now_ms() + drain_ms;
    for (uint64_t now = store_now_ms(); now < end; now = store_now_ms()) {
        struct timespec left = {(time_t)((end - now) / 1000),
                                (long)((end - now) % 1000) * 1000000L};
        if (sigtimedwait(sigs, NULL, &left) >= 0 || errno != EINTR)
            break; /* a second signal, or the time is up (EAGAIN) */
    }
}

int main(int argc, char **argv)
{
    daemon_config o;
    int prc = parse_opts(argc, argv, &o);
    if (prc != 0)
        return prc < 0 ? 0 : prc;
    /* The backend's own checks (cuda: a usable device, the one named)
     * before anything is created: no sockets are left behind. */
    const backend *be = backend_find(o.backend);
    backend_options bo = {o.cuda_device, o.cuda_ipc};
    status bst = {ST_OK, ""};
    if (be != NULL && be->start != NULL && be->start(&bo, &bst) != ST_OK) {
        log_error("start_failed", "what=backend backend=%s msg=\"%s\"", be->name, bst.msg);
        return 1;
    }
    rpc_tls tls = {0};
    int tls_on;
    if (load_tls(&o, &tls, &tls_on) != 0)
        return 2;
    umask(0077); /* every socket and file we create is the daemon user's alone */
    /* Not dumpable: /proc/<pid>/fd, /proc/<pid>/mem and ptrace become root's
     * alone, so that a process of our uid cannot open the pools' memfds (or
     * read the session tokens) without connecting (issue 12). Root still can. */
    if (!o.dumpable && prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        fprintf(stderr, "kvstashd: warning: prctl(PR_SET_DUMPABLE, 0): %s\n", strerror(errno));
    /* Tier moves stage K/V in buffers of up to tens of MiB, allocated per
     * move: served by mmap, each would fault in fresh zeroed pages (a third
     * of a Revive's time, tests/bench/bench_tiers). From the heap, and left
     * there when freed, they are reused warm. */
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    if (make_socket_dir(o.socket) != 0) {
        fprintf(stderr, "kvstashd: cannot create the directory of %s: %s\n", o.socket,
                strerror(errno));
        rpc_tls_free(&tls);
        return 1;
    }
    int lock_fd = take_lock(o.socket);
    if (lock_fd < 0) {
        rpc_tls_free(&tls);
        return 1;
    }
    /* Block the signals before gRPC starts its threads, then sigwait. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    daemon_parts d = {.tls = tls_on ? &tls : NULL};
    int started = start(&o, &d);
    rpc_tls_free(&tls); /* gRPC's credentials keep their own copies */
    d.tls = NULL;
    if (started != 0) {
        remove_files(o.socket);
        return 1;
    }
    log_info("ready", "socket=%s pool_mb=%lu version=%s pid=%d backend=%s lease_end=%s", o.socket,
             o.pool_mb, KVSTASH_VERSION, (int)getpid(), o.backend,
             config_lease_end_quarantine(&o) ? "quarantine" : "free");
    int sig = 0;
    sigwait(&sigs, &sig);
    log_info("stopping", "signal=%s", sig == SIGTERM ? "TERM" : "INT");
    drain(&d, &sigs, o.drain_ms);
    stop(&d);
    remove_files(o.socket);
    close(lock_fd);
    log_info("stopped", "%s", "clean=1");
    return 0;
}
