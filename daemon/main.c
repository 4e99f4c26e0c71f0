/*
 * kvstashd - the KV-cache sidecar daemon: flags, start-up order, signals,
 * clean shutdown.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "events.h"
#include "fdsock.h"
#include "log.h"
#include "rpc.h"
#include "service.h"
#include "store.h"

typedef struct daemon_opts {
    char socket[PATH_MAX - 16];
    const char *listen;
    unsigned long pool_mb, max_pools, max_sessions, max_seqs, threads;
} daemon_opts;

static void usage(FILE *out)
{
    fprintf(out, "usage: kvstashd [options]\n"
                 "  --socket PATH      gRPC Unix socket (default $XDG_RUNTIME_DIR/kvstash/"
                 "kvstashd.sock,\n"
                 "                     or /run/kvstash/kvstashd.sock); PATH.fd, PATH.events and\n"
                 "                     PATH.lock are created beside it\n"
                 "  --listen ADDR      also serve gRPC on TCP ADDR (loopback only, e.g. "
                 "127.0.0.1:7070)\n"
                 "  --pool-mb N        shared memory per model pool in MiB (default 256)\n"
                 "  --max-pools N      models served at once (default 4)\n"
                 "  --max-sessions N   workers attached at once (default 256)\n"
                 "  --max-seqs N       sequences over all workers (default 65536)\n"
                 "  --threads N        gRPC completion-queue threads (default 2)\n"
                 "  --log-level L      debug, info, warn or error (default info)\n"
                 "  --version, --help\n");
}

static int parse_count(const char *flag, const char *text, unsigned long max, unsigned long *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-' || v == 0 || v > max) {
        fprintf(stderr, "kvstashd: %s must be an integer in [1, %lu], got '%s'\n", flag, max, text);
        return -1;
    }
    *out = v;
    return 0;
}

static void default_socket(char *buf, size_t len)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    snprintf(buf, len, "%s/kvstash/kvstashd.sock", xdg && *xdg ? xdg : "/run");
}

static int parse_opts(int argc, char **argv, daemon_opts *o)
{
    static const struct option longopts[] = {{"socket", required_argument, 0, 's'},
                                             {"listen", required_argument, 0, 'l'},
                                             {"pool-mb", required_argument, 0, 'p'},
                                             {"max-pools", required_argument, 0, 'P'},
                                             {"max-sessions", required_argument, 0, 'S'},
                                             {"max-seqs", required_argument, 0, 'Q'},
                                             {"threads", required_argument, 0, 't'},
                                             {"log-level", required_argument, 0, 'L'},
                                             {"version", no_argument, 0, 'V'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    *o = (daemon_opts){
        .pool_mb = 256, .max_pools = 4, .max_sessions = 256, .max_seqs = 65536, .threads = 2};
    default_socket(o->socket, sizeof o->socket);
    int c, level;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case 's':
            if (strlen(optarg) >= sizeof o->socket - 8 || optarg[0] == '\0') {
                fprintf(stderr, "kvstashd: --socket path is empty or too long\n");
                return -1;
            }
            snprintf(o->socket, sizeof o->socket, "%s", optarg);
            break;
        case 'l':
            o->listen = optarg;
            break;
        case 'p':
            bad = parse_count("--pool-mb", optarg, 1u << 20, &o->pool_mb);
            break;
        case 'P':
            bad = parse_count("--max-pools", optarg, 64, &o->max_pools);
            break;
        case 'S':
            bad = parse_count("--max-sessions", optarg, 4096, &o->max_sessions);
            break;
        case 'Q':
            bad = parse_count("--max-seqs", optarg, 1u << 24, &o->max_seqs);
            break;
        case 't':
            bad = parse_count("--threads", optarg, 64, &o->threads);
            break;
        case 'L':
            if ((level = log_parse_level(optarg)) < 0) {
                fprintf(stderr, "kvstashd: --log-level must be debug, info, warn or error\n");
                return -1;
            }
            log_set_level((log_level)level);
            break;
        case 'V':
            printf("kvstashd %s\n", KVSTASH_VERSION);
            exit(0);
        case 'h':
            usage(stdout);
            exit(0);
        default:
            usage(stderr);
            return -1;
        }
        if (bad)
            return -1;
    }
    if (optind < argc) {
        fprintf(stderr, "kvstashd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return -1;
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
    store store;
    events *events;
    fdsock *fdsock;
    rpc_server *rpc;
} daemon_parts;

static int start(const daemon_opts *o, daemon_parts *d)
{
    store_config cfg = {(size_t)o->pool_mb << 20, (uint32_t)o->max_pools, (uint32_t)o->max_sessions,
                        (uint32_t)o->max_seqs};
    char path[PATH_MAX + 16];
    status st;
    snprintf(path, sizeof path, "ipc://%s.events", o->socket);
    if (events_open(path, &d->events, &st) != ST_OK) {
        log_error("start_failed", "what=events msg=\"%s\"", st.msg);
        return -1;
    }
    if (store_init(&d->store, &cfg, d->events) != 0) {
        log_error("start_failed", "what=store msg=\"%s\"", "out of memory");
        return -1;
    }
    snprintf(path, sizeof path, "%s.fd", o->socket);
    if (fdsock_start(path, &d->store, &d->fdsock, &st) != ST_OK) {
        log_error("start_failed", "what=fdsock msg=\"%s\"", st.msg);
        return -1;
    }
    size_t nmethods;
    const rpc_method *methods = service_methods(&nmethods);
    rpc_config rc = {o->socket, o->listen, (int)o->threads};
    unlink(o->socket); /* stale from a dead daemon: our lock proves it dead */
    if (rpc_server_start(&rc, methods, nmethods, &d->store, &d->rpc, &st) != ST_OK) {
        log_error("start_failed", "what=grpc msg=\"%s\"", st.msg);
        return -1;
    }
    return 0;
}

static void stop(daemon_parts *d)
{
    store_begin_shutdown(&d->store);
    rpc_server_stop(d->rpc); /* ends every lease: sessions are reclaimed */
    fdsock_stop(d->fdsock);
    store_destroy(&d->store);
    events_close(d->events);
}

int main(int argc, char **argv)
{
    daemon_opts o;
    if (parse_opts(argc, argv, &o) != 0)
        return 2;
    umask(0077); /* every socket and file we create is the daemon user's alone */
    if (make_socket_dir(o.socket) != 0) {
        fprintf(stderr, "kvstashd: cannot create the directory of %s: %s\n", o.socket,
                strerror(errno));
        return 1;
    }
    int lock_fd = take_lock(o.socket);
    if (lock_fd < 0)
        return 1;
    /* Block the signals before gRPC starts its threads, then sigwait. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    daemon_parts d = {0};
    if (start(&o, &d) != 0) {
        remove_files(o.socket);
        return 1;
    }
    log_info("ready", "socket=%s pool_mb=%lu version=%s pid=%d", o.socket, o.pool_mb,
             KVSTASH_VERSION, (int)getpid());
    int sig = 0;
    sigwait(&sigs, &sig);
    log_info("stopping", "signal=%s", sig == SIGTERM ? "TERM" : "INT");
    stop(&d);
    remove_files(o.socket);
    close(lock_fd);
    log_info("stopped", "%s", "clean=1");
    return 0;
}
