/* config.c - see config.h. */
#include "config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/un.h>
#include <unistd.h>

#include <ini.h>

#include "backend.h"
#include "background.h"
#include "log.h"
#include "remote_value.h"

/* The longest socket path: a sockaddr_un's, less ".events" and its NUL. */
#define CONFIG_SOCKET_MAX (sizeof(((struct sockaddr_un *)0)->sun_path) - 8)

static const config_option options[] = {
    {"socket", CONFIG_PATH, 0, 0,
     "gRPC Unix socket (default $XDG_RUNTIME_DIR/kvstash/kvstashd.sock, or "
     "/run/kvstash/kvstashd.sock); PATH.fd, PATH.events and PATH.lock sit beside it"},
    {"listen", CONFIG_ADDR, 0, 0,
     "also serve gRPC on TCP ADDR (e.g. 127.0.0.1:7070): loopback only unless tls-cert, "
     "tls-key and tls-client-ca are set; without a session token a call reaches only health"},
    {"pool-mb", CONFIG_COUNT, 1, 1u << 20, "shared memory per model pool in MiB (default 256)"},
    {"max-pools", CONFIG_COUNT, 1, 64, "models served at once (default 4)"},
    {"max-sessions", CONFIG_COUNT, 1, 4096, "workers attached at once (default 256)"},
    {"max-seqs", CONFIG_COUNT, 1, 1u << 24, "sequences over all workers (default 65536)"},
    {"max-daemon-mb", CONFIG_COUNT, 0, 1u << 24,
     "daemon memory in MiB that sequences may reserve beyond the pools (sketch cells, "
     "their worst case at CreateSequence); 0 = no limit (default 1024)"},
    {"session-max-seqs", CONFIG_COUNT, 0, 1u << 24,
     "sequences one worker session may hold; 0 = only --max-seqs (default 0)"},
    {"session-max-blocks", CONFIG_COUNT, 0, UINT32_MAX,
     "pool blocks one worker session may hold (its sequences and revive scratch); "
     "0 = no limit (default 0)"},
    {"max-reply-mb", CONFIG_COUNT, 1, 4096,
     "largest gRPC reply in MiB a call may build (Append, GetBlockTable, Revive, Inspect); "
     "a call whose reply could be larger is refused before it changes anything (default 64; "
     "4 protects clients that keep gRPC's default receive limit)"},
    {"quant-group", CONFIG_COUNT, 1, 4096,
     "tokens (keys) and channels (values) of a group of the INT4 / INT2 tiers "
     "(demote=int4|int2; kernels.h \"Low-bit tiers\"): smaller groups, less error and more "
     "bytes of scales (default 32)"},
    {"ring-mb", CONFIG_COUNT, 1, 4096,
     "each worker session's step ring in MiB: a decode step's statistics and an append's "
     "answer must fit (TOVA at 32 layers x 32 query heads reports 4 KiB a token: 128 MiB at "
     "32k tokens); memory beyond the first 8 MiB is taken as steps use it (default 8)"},
    {"pending-timeout-ms", CONFIG_COUNT, 100, 600000,
     "close an fd-socket connection not attached this long after it connected or its "
     "session ended: HELLO-only peers do not hold --max-sessions (default 5000)"},
    {"max-pending", CONFIG_COUNT, 1, 4096,
     "fd-socket connections without an attached session at once; a new one closes the "
     "oldest (default 64)"},
    {"lease-timeout-ms", CONFIG_COUNT, 0, 86400000,
     "reclaim an attached worker that made no call for this long, like a killed one "
     "(stopped, hung); workers must call at least this often (default 0: never)"},
    {"threads", CONFIG_COUNT, 1, 64, "gRPC completion-queue threads (default 2)"},
    {"policy-threads", CONFIG_COUNT, 1, 64,
     "threads one sequence's step may decide its layers on, for policies whose layers are "
     "independent (all but streaming, full and ov_block) and sequences of "
     "256k tokens or more over all layers; 1 = the step's own thread (default 2)"},
    {"move-priority", CONFIG_PRIORITY, 0, 0,
     "the priority of one sequence's long work: a Revive's copy of 1 MiB or more, a prompt's "
     "decision over 32k tokens or more and its demotion of 1 MiB or more; on threads of their "
     "own: idle (SCHED_IDLE: the CPUs no step wants; the default), low (nice 19) or normal "
     "(on the thread that serves the call or the demoter's, as every decode step). On a busy "
     "host, below normal the other workers' steps go first and that sequence's worker waits "
     "(docs/architecture.md)"},
    {"log-level", CONFIG_LEVEL, 0, 0, "debug, info, warn or error (default info)"},
    {"metrics", CONFIG_ADDR, 0, 0,
     "serve Prometheus /metrics and /healthz over HTTP on HOST:PORT (e.g. 127.0.0.1:9464; "
     "port 0 picks one); loopback only unless metrics-allow-remote"},
    {"metrics-allow-remote", CONFIG_BOOL, 0, 0,
     "let --metrics listen on a non-loopback address (no authentication, no TLS)"},
    {"backend", CONFIG_BACKEND, 0, 0,
     "where pools live: host (shared memory, the default), shadow (host memory behind "
     "addresses that fault on direct access: a test backend, README) or cuda (GPU memory "
     "shared by CUDA IPC, in builds with CUDA: docs/gpu.md)"},
    {"cuda-device", CONFIG_CUDA_DEVICE, 0, 0,
     "with --backend cuda, the GPU for every pool: a device number or, better (containers "
     "renumber devices), its UUID as nvidia-smi -L prints it (default 0)"},
    {"cuda-ipc", CONFIG_CUDA_IPC, 0, 0,
     "with --backend cuda, how workers map pools: vmm (a file descriptor passed only to "
     "checked peers), legacy (a cudaIpc handle) or auto (vmm where the device supports it, "
     "else legacy; the default)"},
    {"lease-end", CONFIG_LEASE_END, 0, 0,
     "what a worker that ended without a detach (fd socket closed, lease timeout) leaves: "
     "free (its blocks go back at once: a stopped worker resumed later could write into "
     "reused blocks) or quarantine (its blocks stay out of use until its process exits: a "
     "stopped worker holds them); auto (the default): quarantine on cuda, free on host and "
     "shadow (docs/reliability.md)"},
    {"drain-ms", CONFIG_COUNT, 0, 600000,
     "on SIGTERM, report NOT_SERVING (health, /healthz) this long before stopping "
     "(default 0; a second signal stops at once)"},
    {"dumpable", CONFIG_BOOL, 0, 0,
     "stay dumpable, for debugging only (core dumps, gdb, /proc/<pid>/fd and maps readable by "
     "kvstashd's uid): any process of that uid can then open the pools without connecting"},
    {"operator-uids", CONFIG_UIDS, 0, CONFIG_MAX_UIDS,
     "comma-separated uids whose sessions are operators': they may evict, demote, offload "
     "and revive any worker's sequences and see every sequence's label and parameters; "
     "other sessions act on and see only their own (default: root and kvstashd's uid; "
     "\"none\" for nobody)"},
    {"remote", CONFIG_NODES, 0, 0,
     "the remote tier (docs/remote.md): some nodes of a Redis Cluster as "
     "host:port[,host:port...]; kvstashd finds the rest and keeps serving its local tiers "
     "when the cluster is down (default none)"},
    {"remote-namespace", CONFIG_NAME, 0, 0,
     "the remote tier's key prefix for this deployment: daemons that share sequences share "
     "it (default kvstash)"},
    {"remote-ttl-s", CONFIG_COUNT, 0, 30u * 86400u,
     "seconds a value written to the remote tier lives; 0 = until deleted (default 86400)"},
    {"remote-timeout-ms", CONFIG_COUNT, 10, 600000,
     "how long the remote tier waits for one node's answer (default 500)"},
    {"remote-probe-ms", CONFIG_COUNT, 0, 3600000,
     "how often the remote tier asks every node whether it answers, for Stats, /metrics and "
     "/healthz; 0 = never (default 5000)"},
    {"remote-spill-below", CONFIG_COUNT, 0, 100,
     "percent of a pool's blocks: when fewer are free, kvstashd spills its sequences' "
     "revivable victims to the remote tier on its own (kvstash seq spill), instead of "
     "dropping them when the pool runs out; 0 = never (default 0; needs remote)"},
    {"tls-cert", CONFIG_FILE, 0, 0,
     "PEM certificate chain that --listen presents: with tls-key and tls-client-ca, TCP "
     "speaks only TLS and is allowed beyond loopback (default none)"},
    {"tls-key", CONFIG_FILE, 0, 0, "PEM private key of tls-cert (default none)"},
    {"tls-client-ca", CONFIG_FILE, 0, 0,
     "PEM CA certificate(s): a TCP client must present a certificate they signed; calls "
     "still need a session token for anything but health (default none)"},
};

#define NOPTIONS (sizeof options / sizeof options[0])

const config_option *config_options(size_t *count)
{
    *count = NOPTIONS;
    return options;
}

void config_defaults(daemon_config *c)
{
    memset(c, 0, sizeof *c);
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    snprintf(c->socket, sizeof c->socket, "%s/kvstash/kvstashd.sock", xdg && *xdg ? xdg : "/run");
    c->pool_mb = 256;
    c->max_pools = 4;
    c->max_sessions = 256;
    c->max_seqs = 65536;
    c->max_daemon_mb = 1024;
    c->max_reply_mb = 64;
    c->ring_mb = 8;
    c->quant_group = 32;
    c->pending_timeout_ms = 5000;
    c->max_pending = 64;
    c->threads = 2;
    c->policy_threads = 2;
    snprintf(c->log_level, sizeof c->log_level, "info");
    snprintf(c->backend, sizeof c->backend, "%s", backend_host.name);
    snprintf(c->cuda_device, sizeof c->cuda_device, "0");
    snprintf(c->cuda_ipc, sizeof c->cuda_ipc, "auto");
    snprintf(c->lease_end, sizeof c->lease_end, "auto");
    snprintf(c->move_priority, sizeof c->move_priority, "%s",
             background_priority_name(BACKGROUND_IDLE));
    snprintf(c->remote_namespace, sizeof c->remote_namespace, "kvstash");
    c->remote_ttl_s = 86400;
    c->remote_timeout_ms = 500;
    c->remote_probe_ms = 5000;
    c->operator_uids[c->n_operator_uids++] = 0;
    if (geteuid() != 0)
        c->operator_uids[c->n_operator_uids++] = geteuid();
}

/* "pool_mb" and "pool-mb" both name option "pool-mb". */
static const config_option *find_option(const char *key)
{
    for (size_t i = 0; i < NOPTIONS; i++) {
        const char *a = options[i].key, *b = key;
        while (*a && (*a == *b || (*a == '-' && *b == '_'))) {
            a++;
            b++;
        }
        if (*a == '\0' && *b == '\0')
            return &options[i];
    }
    return NULL;
}

static unsigned long *count_field(daemon_config *c, const char *key)
{
    if (strcmp(key, "pool-mb") == 0)
        return &c->pool_mb;
    if (strcmp(key, "max-pools") == 0)
        return &c->max_pools;
    if (strcmp(key, "max-sessions") == 0)
        return &c->max_sessions;
    if (strcmp(key, "max-seqs") == 0)
        return &c->max_seqs;
    if (strcmp(key, "threads") == 0)
        return &c->threads;
    if (strcmp(key, "policy-threads") == 0)
        return &c->policy_threads;
    if (strcmp(key, "max-daemon-mb") == 0)
        return &c->max_daemon_mb;
    if (strcmp(key, "session-max-seqs") == 0)
        return &c->session_max_seqs;
    if (strcmp(key, "session-max-blocks") == 0)
        return &c->session_max_blocks;
    if (strcmp(key, "max-reply-mb") == 0)
        return &c->max_reply_mb;
    if (strcmp(key, "ring-mb") == 0)
        return &c->ring_mb;
    if (strcmp(key, "quant-group") == 0)
        return &c->quant_group;
    if (strcmp(key, "pending-timeout-ms") == 0)
        return &c->pending_timeout_ms;
    if (strcmp(key, "max-pending") == 0)
        return &c->max_pending;
    if (strcmp(key, "lease-timeout-ms") == 0)
        return &c->lease_timeout_ms;
    if (strcmp(key, "remote-ttl-s") == 0)
        return &c->remote_ttl_s;
    if (strcmp(key, "remote-timeout-ms") == 0)
        return &c->remote_timeout_ms;
    if (strcmp(key, "remote-probe-ms") == 0)
        return &c->remote_probe_ms;
    if (strcmp(key, "remote-spill-below") == 0)
        return &c->remote_spill_below;
    return &c->drain_ms;
}

static int *bool_field(daemon_config *c, const char *key)
{
    if (strcmp(key, "dumpable") == 0)
        return &c->dumpable;
    return &c->metrics_allow_remote;
}

static char *file_field(daemon_config *c, const char *key, size_t *len)
{
    *len = sizeof c->tls_cert;
    if (strcmp(key, "tls-cert") == 0)
        return c->tls_cert;
    if (strcmp(key, "tls-key") == 0)
        return c->tls_key;
    return c->tls_client_ca;
}

static int parse_bool(const char *v, int *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no",
                                                                                "off"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(v, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(v, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

/* "0,1000" (spaces allowed around the commas), "" or "none". */
static int set_uids(daemon_config *c, const config_option *o, const char *v, char *err,
                    size_t errlen)
{
    uid_t uids[CONFIG_MAX_UIDS];
    size_t n = 0;
    const char *p = v;
    while (*p == ' ')
        p++;
    if (*p == '\0' || strcasecmp(p, "none") == 0)
        p = "";
    while (*p != '\0') {
        char *end;
        errno = 0;
        unsigned long u = strtoul(p, &end, 10);
        while (*end == ' ')
            end++;
        if (errno != 0 || end == p || *p < '0' || *p > '9' || u >= (uid_t)-1 ||
            (*end != ',' && *end != '\0') || n == o->max) {
            snprintf(err, errlen,
                     "%s must be at most %lu comma-separated uids, or none, got '%.64s'", o->key,
                     o->max, v);
            return -1;
        }
        uids[n++] = (uid_t)u;
        p = *end == ',' ? end + 1 : end;
        while (*p == ' ')
            p++;
    }
    memcpy(c->operator_uids, uids, n * sizeof *uids);
    c->n_operator_uids = n;
    return 0;
}

/* Whether config_load can read v back as config_print writes it: the INI
 * reader (inih) ends a value at a newline, trims blanks around it and cuts it
 * at an inline comment (" ;", and config_print writes "key = value": a
 * leading ';' too). fuzz_config found the round trip broken by such values
 * (tests/fuzz/corpus/fuzz_config/regress-*). */
static int text_printable(const char *v)
{
    size_t n = strlen(v);
    if (n > 0 && (v[0] == ' ' || v[0] == '\t' || v[n - 1] == ' ' || v[n - 1] == '\t'))
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)v[i];
        if (ch < 0x20 || ch == 0x7f ||
            (ch == ';' && (i == 0 || v[i - 1] == ' ' || v[i - 1] == '\t')))
            return 0;
    }
    return 1;
}

/* inih (Debian's libinih, built with its default max_line_length) reads
 * lines of at most this many bytes, newline and NUL included: a longer
 * "key = value" line printed by config_print would be read back cut in two
 * (fuzz_config: a 230-byte tls-key, corpus regress-tls-key-too-long). */
#define CONFIG_INI_LINE_MAX 200

static int set_text(char *dst, size_t len, const char *key, const char *v, char *err, size_t errlen)
{
    size_t line_room = CONFIG_INI_LINE_MAX - 2 - strlen(key) - strlen(" = ");
    if (line_room < len)
        len = line_room + 1;
    if (strlen(v) >= len) {
        snprintf(err, errlen, "%s is too long (at most %zu bytes)", key, len - 1);
        return -1;
    }
    if (!text_printable(v)) {
        snprintf(err, errlen,
                 "%s must be printable text without blanks around it or ' ;' in it, got '%.64s'",
                 key, v);
        return -1;
    }
    snprintf(dst, len, "%s", v);
    return 0;
}

/* "host:port[,host:port...]" with ports 1-65535 (whether the hosts answer
 * is kvstashd's start's to find out), or "" / "off" for none. */
static int set_nodes(char *dst, size_t len, const char *key, const char *v, char *err,
                     size_t errlen)
{
    if (strcmp(v, "off") == 0)
        v = "";
    for (const char *p = v; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        const char *colon = memrchr(p, ':', n);
        char *pend = NULL;
        unsigned long port = colon != NULL ? strtoul(colon + 1, &pend, 10) : 0;
        if (colon == NULL || colon == p || colon + 1 == p + n || pend != p + n || port == 0 ||
            port > 65535 || colon[1] == '-' || colon[1] == '+' || colon[1] == ' ') {
            snprintf(err, errlen, "%s must be host:port[,host:port...], got '%.*s' in '%.64s'", key,
                     (int)(n < 64 ? n : 64), p, v);
            return -1;
        }
        p = end != NULL ? end + 1 : p + n;
        if (end != NULL && *p == '\0') {
            snprintf(err, errlen, "%s ends with a comma: '%.64s'", key, v);
            return -1;
        }
    }
    return set_text(dst, len, key, v, err, errlen);
}

int config_set(daemon_config *c, const char *key, const char *value, char *err, size_t errlen)
{
    const config_option *o = find_option(key);
    if (o == NULL) {
        snprintf(err, errlen, "unknown option '%.64s' (kvstashd --help lists them)", key);
        return -1;
    }
    char *end;
    int b;
    switch (o->kind) {
    case CONFIG_PATH:
        if (value[0] == '\0') {
            snprintf(err, errlen, "%s is empty", o->key);
            return -1;
        }
        /* The gRPC socket and PATH.fd, PATH.events, PATH.lock beside it must
         * fit a sockaddr_un (and a config file line: fuzz_config found
         * longer paths printed that config_load could not read back). */
        return set_text(c->socket, CONFIG_SOCKET_MAX + 1, o->key, value, err, errlen);
    case CONFIG_ADDR:
        if (strcmp(value, "off") == 0)
            value = "";
        return set_text(strcmp(o->key, "listen") == 0 ? c->listen : c->metrics, sizeof c->metrics,
                        o->key, value, err, errlen);
    case CONFIG_COUNT: {
        errno = 0;
        unsigned long v = strtoul(value, &end, 10);
        if (errno != 0 || end == value || *end != '\0' || value[0] == '-' || v < o->min ||
            v > o->max) {
            snprintf(err, errlen, "%s must be an integer in [%lu, %lu], got '%.32s'", o->key,
                     o->min, o->max, value);
            return -1;
        }
        *count_field(c, o->key) = v;
        return 0;
    }
    case CONFIG_BOOL:
        if (parse_bool(value, &b) != 0) {
            snprintf(err, errlen, "%s must be true or false, got '%.32s'", o->key, value);
            return -1;
        }
        *bool_field(c, o->key) = b;
        return 0;
    case CONFIG_LEVEL:
        if (log_parse_level(value) < 0) {
            snprintf(err, errlen, "%s must be debug, info, warn or error, got '%.32s'", o->key,
                     value);
            return -1;
        }
        return set_text(c->log_level, sizeof c->log_level, o->key, value, err, errlen);
    case CONFIG_BACKEND:
        if (strcmp(value, "cuda") == 0 && backend_find(value) == NULL) {
            snprintf(err, errlen,
                     "%s cuda: this kvstashd was built without CUDA (configure with "
                     "-DKVSTASH_CUDA=ON where nvcc is installed; docs/gpu.md)",
                     o->key);
            return -1;
        }
        if (backend_find(value) == NULL) {
            snprintf(err, errlen, "%s must be one of %s, got '%.32s'", o->key, backend_names(),
                     value);
            return -1;
        }
        return set_text(c->backend, sizeof c->backend, o->key, value, err, errlen);
    case CONFIG_CUDA_DEVICE:
        if (backend_cuda_device_check(value, err, errlen) != 0)
            return -1;
        return set_text(c->cuda_device, sizeof c->cuda_device, o->key, value, err, errlen);
    case CONFIG_CUDA_IPC:
        if (backend_cuda_ipc_check(value, err, errlen) != 0)
            return -1;
        return set_text(c->cuda_ipc, sizeof c->cuda_ipc, o->key, value, err, errlen);
    case CONFIG_LEASE_END:
        if (strcmp(value, "auto") != 0 && strcmp(value, "free") != 0 &&
            strcmp(value, "quarantine") != 0) {
            snprintf(err, errlen,
                     "%s must be free, quarantine or auto (quarantine on cuda, free on host), "
                     "got '%.32s'",
                     o->key, value);
            return -1;
        }
        return set_text(c->lease_end, sizeof c->lease_end, o->key, value, err, errlen);
    case CONFIG_PRIORITY: {
        background_priority p;
        if (background_priority_parse(value, &p) != 0) {
            snprintf(err, errlen, "%s must be idle, low or normal, got '%.32s'", o->key, value);
            return -1;
        }
        return set_text(c->move_priority, sizeof c->move_priority, o->key, value, err, errlen);
    }
    case CONFIG_UIDS:
        return set_uids(c, o, value, err, errlen);
    case CONFIG_FILE: {
        size_t len;
        char *dst = file_field(c, o->key, &len);
        return set_text(dst, len, o->key, strcmp(value, "off") == 0 ? "" : value, err, errlen);
    }
    case CONFIG_NODES:
        return set_nodes(c->remote, sizeof c->remote, o->key, value, err, errlen);
    case CONFIG_NAME:
        if (!remote_name_valid(value, sizeof c->remote_namespace - 1)) {
            snprintf(err, errlen, "%s must be 1 to %zu of A-Z a-z 0-9 _ . -, got '%.64s'", o->key,
                     sizeof c->remote_namespace - 1, value);
            return -1;
        }
        return set_text(c->remote_namespace, sizeof c->remote_namespace, o->key, value, err,
                        errlen);
    }
    return -1;
}

typedef struct load_ctx {
    daemon_config *c;
    const char *path;
    char *err;
    size_t errlen;
    int failed;
} load_ctx;

static int on_entry(void *user, const char *section, const char *name, const char *value)
{
    load_ctx *x = user;
    char msg[256];
    if (x->failed)
        return 0;
    if (section[0] != '\0' && strcmp(section, "kvstashd") != 0) {
        snprintf(msg, sizeof msg, "unknown section [%.64s] (options go in [kvstashd])", section);
    } else if (config_set(x->c, name, value, msg, sizeof msg) == 0) {
        return 1;
    }
    snprintf(x->err, x->errlen, "%s", msg);
    x->failed = 1;
    return 0; /* inih reports the line */
}

int config_load(daemon_config *c, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    char msg[256] = "";
    load_ctx x = {c, path, msg, sizeof msg, 0};
    int line = ini_parse_file(f, on_entry, &x);
    fclose(f);
    if (line == 0)
        return 0;
    snprintf(err, errlen, "%s:%d: %s", path, line, msg[0] ? msg : "syntax error");
    return -1;
}

void config_print(const daemon_config *c, const char *source, FILE *f)
{
    fprintf(f, "# kvstashd %s: effective configuration (%s)\n[kvstashd]\n", KVSTASH_VERSION,
            source);
    for (size_t i = 0; i < NOPTIONS; i++) {
        const config_option *o = &options[i];
        char key[32];
        snprintf(key, sizeof key, "%s", o->key);
        for (char *p = key; *p; p++)
            if (*p == '-')
                *p = '_';
        switch (o->kind) {
        case CONFIG_PATH:
            fprintf(f, "%s = %s\n", key, c->socket);
            break;
        case CONFIG_ADDR:
            fprintf(f, "%s = %s\n", key, strcmp(o->key, "listen") == 0 ? c->listen : c->metrics);
            break;
        case CONFIG_COUNT:
            fprintf(f, "%s = %lu\n", key, *count_field((daemon_config *)c, o->key));
            break;
        case CONFIG_BOOL:
            fprintf(f, "%s = %s\n", key,
                    *bool_field((daemon_config *)c, o->key) ? "true" : "false");
            break;
        case CONFIG_LEVEL:
            fprintf(f, "%s = %s\n", key, c->log_level);
            break;
        case CONFIG_BACKEND:
            fprintf(f, "%s = %s\n", key, c->backend);
            break;
        case CONFIG_CUDA_DEVICE:
            fprintf(f, "%s = %s\n", key, c->cuda_device);
            break;
        case CONFIG_CUDA_IPC:
            fprintf(f, "%s = %s\n", key, c->cuda_ipc);
            break;
        case CONFIG_LEASE_END:
            fprintf(f, "%s = %s\n", key, c->lease_end);
            break;
        case CONFIG_PRIORITY:
            fprintf(f, "%s = %s\n", key, c->move_priority);
            break;
        case CONFIG_UIDS:
            fprintf(f, "%s = %s", key, c->n_operator_uids == 0 ? "none" : "");
            for (size_t u = 0; u < c->n_operator_uids; u++)
                fprintf(f, "%s%u", u ? "," : "", (unsigned)c->operator_uids[u]);
            fputc('\n', f);
            break;
        case CONFIG_FILE: {
            size_t len;
            fprintf(f, "%s = %s\n", key, file_field((daemon_config *)c, o->key, &len));
            break;
        }
        case CONFIG_NODES:
            fprintf(f, "%s = %s\n", key, c->remote);
            break;
        case CONFIG_NAME:
            fprintf(f, "%s = %s\n", key, c->remote_namespace);
            break;
        }
    }
}

background_priority config_move_priority(const daemon_config *c)
{
    background_priority p = BACKGROUND_NORMAL;
    background_priority_parse(c->move_priority, &p); /* checked as it was set */
    return p;
}

int config_lease_end_quarantine(const daemon_config *c)
{
    return strcmp(c->lease_end, "quarantine") == 0 ||
           (strcmp(c->lease_end, "auto") == 0 && strcmp(c->backend, "cuda") == 0);
}

int config_check(const daemon_config *c, char *err, size_t errlen)
{
    int n = (c->tls_cert[0] != '\0') + (c->tls_key[0] != '\0') + (c->tls_client_ca[0] != '\0');
    if (n != 0 && n != 3) {
        snprintf(err, errlen,
                 "tls-cert, tls-key and tls-client-ca go together: set all three or none "
                 "(tls-cert=%s tls-key=%s tls-client-ca=%s)",
                 c->tls_cert[0] ? "set" : "unset", c->tls_key[0] ? "set" : "unset",
                 c->tls_client_ca[0] ? "set" : "unset");
        return -1;
    }
    if (n == 3 && c->listen[0] == '\0') {
        snprintf(err, errlen, "tls-cert, tls-key and tls-client-ca are for --listen, which is off");
        return -1;
    }
    if (c->remote_spill_below > 0 && c->remote[0] == '\0') {
        snprintf(err, errlen,
                 "remote-spill-below=%lu spills to the remote tier, which is off: set remote "
                 "(a Redis Cluster) or remote-spill-below=0",
                 c->remote_spill_below);
        return -1;
    }
    return 0;
}
