/* cli_common.c - option parsing, daemon calls, errors and formatting for the
 * `kvstash` commands (cli.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "cli.h"
#include "fdsock.h"
#include "kvstash.h"
#include "pbjson.h"
#include "rpc.h"

static int defer_errors;
static char deferred[1024];

void cli_defer_errors(int on)
{
    defer_errors = on;
}

const char *cli_deferred_error(void)
{
    return deferred;
}

int cli_fail(int code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* One line: a daemon message never breaks it. */
    for (char *p = msg; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    if (defer_errors) {
        snprintf(deferred, sizeof deferred, "%s", msg);
        return code;
    }
    fflush(stdout);
    fprintf(stderr, "kvstash: %s\n", msg);
    return code;
}

int cli_uint(const char *text, uint64_t max, uint64_t *out)
{
    char *end;
    if (text[0] < '0' || text[0] > '9')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

static const cli_opt *find_opt(const cli_opt *opts, size_t n, const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(opts[i].name) == len && strncmp(opts[i].name, name, len) == 0)
            return &opts[i];
    return NULL;
}

/* One "--name[=value]" of argv[*i]; advances *i past a separate value. */
static int parse_option(cli *c, const cli_opt *opts, size_t nopts, int *i)
{
    const char *a = c->argv[*i], *name = a + 2, *eq = strchr(name, '=');
    size_t len = eq != NULL ? (size_t)(eq - name) : strlen(name);
    const char *value = eq != NULL ? eq + 1 : NULL;
    /* The global options, wherever they stand on the line. */
    const char **globals[] = {&c->socket, &c->addr, &c->tls_ca, &c->tls_cert, &c->tls_key};
    static const char *const global_names[] = {"socket", "addr", "tls-ca", "tls-cert", "tls-key"};
    const char **global_dst = NULL;
    for (size_t g = 0; g < sizeof globals / sizeof globals[0]; g++)
        if (len == strlen(global_names[g]) && strncmp(name, global_names[g], len) == 0)
            global_dst = globals[g];
    int global = global_dst != NULL;
    const cli_opt *o = global ? NULL : find_opt(opts, nopts, name, len);
    if (!global && len == 4 && strncmp(name, "json", 4) == 0 && value == NULL) {
        c->json = 1;
        return CLI_OK;
    }
    if (!global && o == NULL)
        return cli_fail(CLI_USAGE, "%s: unknown option %.*s (try kvstash %s --help)", c->cmd,
                        (int)len + 2, a, c->cmd);
    if (!global && !o->has_arg) {
        if (value != NULL)
            return cli_fail(CLI_USAGE, "%s: --%s takes no value", c->cmd, o->name);
        *o->flag = 1;
        return CLI_OK;
    }
    if (value == NULL) {
        if (*i + 1 >= c->argc)
            return cli_fail(CLI_USAGE, "%s: --%.*s needs a value (try kvstash %s --help)", c->cmd,
                            (int)len, name, c->cmd);
        value = c->argv[++*i];
    }
    if (global) {
        *global_dst = value;
        return CLI_OK;
    }
    if (o->each != NULL)
        return o->each(o->ctx, value);
    *o->value = value;
    return CLI_OK;
}

int cli_parse(cli *c, const cli_opt *opts, size_t nopts, const char **pos, size_t min_pos,
              size_t max_pos, size_t *npos, const char *help)
{
    size_t n = 0;
    for (int i = 0; i < c->argc; i++) {
        const char *a = c->argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(help, stdout);
            return -1;
        }
        if (strcmp(a, "--") == 0) {
            for (i++; i < c->argc; i++) {
                if (n == max_pos)
                    return cli_fail(CLI_USAGE, "%s: unexpected argument %s (try kvstash %s --help)",
                                    c->cmd, c->argv[i], c->cmd);
                pos[n++] = c->argv[i];
            }
            break;
        }
        if (strncmp(a, "--", 2) == 0) {
            int rc = parse_option(c, opts, nopts, &i);
            if (rc != CLI_OK)
                return rc;
        } else if (a[0] == '-' && a[1] != '\0') {
            return cli_fail(CLI_USAGE, "%s: unknown option %s (try kvstash %s --help)", c->cmd, a,
                            c->cmd);
        } else if (n == max_pos) {
            return cli_fail(CLI_USAGE, "%s: unexpected argument %s (try kvstash %s --help)", c->cmd,
                            a, c->cmd);
        } else {
            pos[n++] = a;
        }
    }
    if (n < min_pos)
        return cli_fail(CLI_USAGE, "%s: missing argument (try kvstash %s --help)", c->cmd, c->cmd);
    if (npos != NULL)
        *npos = n;
    return CLI_OK;
}

/* Before gRPC (whose errors say little): is anything there, and may we
 * connect? Returns CLI_OK or the exit code after printing the reason. */
static int probe(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path)
        return cli_fail(CLI_USAGE, "socket path too long for a Unix socket: %s", path);
    struct stat st;
    if (stat(path, &st) != 0) {
        if (errno == EACCES)
            return cli_fail(CLI_DENIED,
                            "permission denied: cannot reach %s (its directory is closed to uid "
                            "%u; run as kvstashd's user or root)",
                            path, (unsigned)geteuid());
        if (errno == ENOENT || errno == ENOTDIR)
            return cli_fail(CLI_UNREACHABLE, "kvstashd is not running: no socket at %s", path);
        return cli_fail(CLI_UNREACHABLE, "cannot reach kvstashd at %s: %s", path, strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode))
        return cli_fail(CLI_UNREACHABLE, "%s is not a socket (is --socket right?)", path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return cli_fail(CLI_ERROR, "socket: %s", strerror(errno));
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    int e = errno;
    close(fd);
    if (rc == 0)
        return CLI_OK;
    if (e == EACCES || e == EPERM)
        return cli_fail(CLI_DENIED,
                        "permission denied: %s belongs to uid %u (mode %03o) and kvstashd admits "
                        "only its own user and root",
                        path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 0777));
    if (e == ECONNREFUSED)
        return cli_fail(CLI_UNREACHABLE,
                        "kvstashd is not running: nothing listens on %s (a stale socket)", path);
    return cli_fail(CLI_UNREACHABLE, "cannot reach kvstashd at %s: %s", path, strerror(e));
}

int cli_call(const cli *c, const char *method, const char *token, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    *resp = NULL;
    char path[128], err[512] = "";
    rpc_channel *ch;
    if (c->addr != NULL) {
        /* Flags win over the environment, file by file. */
        rpc_tls_paths tls;
        rpc_tls_from_env(&tls);
        tls.ca = c->tls_ca != NULL ? c->tls_ca : tls.ca;
        tls.cert = c->tls_cert != NULL ? c->tls_cert : tls.cert;
        tls.key = c->tls_key != NULL ? c->tls_key : tls.key;
        if ((ch = rpc_channel_open_tcp(c->addr, &tls, err, sizeof err)) == NULL)
            return cli_fail(CLI_ERROR, "%s", err);
    } else {
        int rc = probe(c->socket);
        if (rc != CLI_OK)
            return rc;
        if ((ch = rpc_channel_open(c->socket)) == NULL)
            return cli_fail(CLI_ERROR, "cannot create a gRPC channel to unix:%s", c->socket);
    }
    if (method[0] == '/') /* a full path: another service */
        snprintf(path, sizeof path, "%s", method);
    else
        snprintf(path, sizeof path, "/kvstash.v1.Store/%s", method);
    int r = rpc_unary(ch, path, token, req, desc, resp, err, sizeof err);
    rpc_channel_close(ch);
    switch (r) {
    case KVS_OK:
        return CLI_OK;
    case KVS_ERR_UNAVAILABLE:
        /* kvstashd answered, for its remote store (kvstashd --remote): it is
         * the cluster that does not. */
        if (strncmp(err, "remote tier: ", 13) == 0)
            return cli_fail(CLI_ERROR, "%s refused: %s", method, err);
        return cli_fail(CLI_UNREACHABLE, "kvstashd at %s did not answer %s: %s",
                        c->addr != NULL ? c->addr : c->socket, method, err);
    case KVS_ERR_NOT_FOUND:
        return cli_fail(CLI_NOT_FOUND, "%s", err);
    case KVS_ERR_PERMISSION:
        return cli_fail(CLI_DENIED, "permission denied: %s", err);
    default:
        return cli_fail(CLI_ERROR, "%s refused: %s (%s)", method, err, kvs_strerror(r));
    }
}

int cli_token(const cli *c, int *fd, char token[FDSOCK_TOKEN_LEN + 1])
{
    char err[512] = "";
    int rc = fdsock_connect(c->socket, fd, err, sizeof err);
    if (rc == KVS_OK && (rc = fdsock_hello(*fd, token, err, sizeof err)) != KVS_OK) {
        close(*fd);
        *fd = -1;
    }
    if (rc == KVS_OK)
        return CLI_OK;
    if (rc == KVS_ERR_PERMISSION || strstr(err, "permission denied") != NULL)
        return cli_fail(CLI_DENIED, "permission denied: %s", err);
    if (rc == KVS_ERR_UNAVAILABLE)
        return cli_fail(CLI_UNREACHABLE, "kvstashd is not running at %s: %s", c->socket, err);
    return cli_fail(CLI_ERROR, "fd-socket handshake failed: %s", err);
}

int cli_call_view(const cli *c, const char *method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    struct stat st;
    /* As the socket's owner a token would name the same uid: save the
     * handshake (and its place under --max-sessions). */
    if (stat(c->socket, &st) != 0 || st.st_uid == geteuid())
        return cli_call(c, method, NULL, req, desc, resp);
    return cli_call_as_us(c, method, req, desc, resp);
}

int cli_call_as_us(const cli *c, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc, ProtobufCMessage **resp)
{
    int fd = -1;
    char token[FDSOCK_TOKEN_LEN + 1];
    *resp = NULL;
    int rc = cli_token(c, &fd, token);
    if (rc == CLI_OK) {
        rc = cli_call(c, method, token, req, desc, resp);
        close(fd);
    }
    return rc;
}

int cli_stats(const cli *c, int with_tiers, Kvstash__V1__StatsResponse **out)
{
    Kvstash__V1__StatsRequest req = KVSTASH__V1__STATS_REQUEST__INIT;
    req.with_tiers = with_tiers;
    return cli_call_view(c, "Stats", &req.base, &kvstash__v1__stats_response__descriptor,
                         (ProtobufCMessage **)out);
}

int cli_print_json(json_t *j, int pretty)
{
    char *text = j != NULL ? json_dumps(j, pretty ? JSON_INDENT(2) : JSON_COMPACT) : NULL;
    json_decref(j);
    if (text == NULL)
        return cli_fail(CLI_ERROR, "out of memory writing JSON");
    printf("%s\n", text);
    free(text);
    return fflush(stdout) == 0 ? CLI_OK : cli_fail(CLI_ERROR, "cannot write to stdout");
}

int cli_print_message(const ProtobufCMessage *m, int pretty)
{
    return cli_print_json(pbjson_from_message(m), pretty);
}

const char *cli_bytes(uint64_t b, char *buf, size_t len)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", b);
    else
        snprintf(buf, len, "%.1f %s", v, unit[u]);
    return buf;
}

const char *cli_duration(uint64_t ms, char *buf, size_t len)
{
    uint64_t s = ms / 1000;
    if (s >= 86400)
        snprintf(buf, len, "%" PRIu64 "d %" PRIu64 "h %" PRIu64 "m", s / 86400, s / 3600 % 24,
                 s / 60 % 60);
    else if (s >= 3600)
        snprintf(buf, len, "%" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", s / 3600, s / 60 % 60, s % 60);
    else if (s >= 60)
        snprintf(buf, len, "%" PRIu64 "m %" PRIu64 "s", s / 60, s % 60);
    else
        snprintf(buf, len, "%.1fs", (double)ms / 1000);
    return buf;
}

const char *cli_dtype(Kvstash__V1__DType d)
{
    switch (d) {
    case KVSTASH__V1__DTYPE__DTYPE_FP16:
        return "fp16";
    case KVSTASH__V1__DTYPE__DTYPE_BF16:
        return "bf16";
    case KVSTASH__V1__DTYPE__DTYPE_FP32:
        return "fp32";
    default:
        return "?";
    }
}
