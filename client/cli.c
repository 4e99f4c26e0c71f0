/*
 * cli.c - `kvstash`, the operator's command line for kvstashd.
 *
 *   kvstash [--socket PATH] status [--json]   what the daemon holds
 *   kvstash [--socket PATH] stats [--json]    the same as one JSON object
 *   kvstash [--socket PATH] policy list       the policies kvstashd knows
 *
 * Exit status: 0 on success, 1 when the daemon cannot be reached or refuses,
 * 2 on a usage error. Errors are one line on stderr starting with "kvstash: ".
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvstash.h"
#include "replay.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvstash [--socket PATH] COMMAND [OPTIONS]\n"
            "\n"
            "commands:\n"
            "  status [--json]   daemon version, uptime, pools (blocks free/used/retired),\n"
            "                    sessions, sequences and tiers\n"
            "  stats [--json]    the same, as the JSON object of StatsResponse\n"
            "  policy list       the policies kvstashd knows (also: policies) [--json]\n"
            "  replay --policy NAME [--set k=v]... < trace.jsonl\n"
            "                    run one policy on a recorded trace, without a daemon\n"
            "                    (kvstash replay --help; docs/replay.md)\n"
            "\n"
            "options:\n"
            "  --socket PATH     kvstashd's gRPC socket (default %s)\n"
            "  --help            this text\n",
            kvs_default_socket());
}

/* Integer member of a JSON object (0 if absent). */
static uint64_t ju(const json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    if (json_is_integer(v))
        return (uint64_t)json_integer_value(v);
    if (json_is_real(v))
        return (uint64_t)json_real_value(v);
    return 0;
}

static const char *js(const json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s != NULL ? s : "";
}

/* Human-readable bytes: "512 B", "3.0 KiB", "16.0 MiB". */
static const char *bytes_str(uint64_t b, char *buf, size_t len)
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

static const char *duration_str(uint64_t ms, char *buf, size_t len)
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

static const char *dtype_str(const char *e)
{
    if (strcmp(e, "DTYPE_FP16") == 0)
        return "fp16";
    if (strcmp(e, "DTYPE_BF16") == 0)
        return "bf16";
    if (strcmp(e, "DTYPE_FP32") == 0)
        return "fp32";
    return e;
}

static void print_pools(const json_t *pools)
{
    char b1[32];
    size_t i;
    json_t *p;
    printf("pools: %zu\n", json_array_size(pools));
    json_array_foreach(pools, i, p)
    {
        json_t *g = json_object_get(p, "geometry");
        printf("  pool %" PRIu64 " \"%s\": %" PRIu64 " layers, %" PRIu64 " q / %" PRIu64
               " kv heads, head_dim %" PRIu64 ", %s, %" PRIu64 " tokens/block, %s/block\n",
               ju(p, "pool_id"), js(p, "model"), ju(g, "layers"), ju(g, "q_heads"),
               ju(g, "kv_heads"), ju(g, "head_dim"), dtype_str(js(g, "dtype")),
               ju(g, "block_tokens"), bytes_str(ju(p, "block_bytes"), b1, sizeof b1));
        printf("    blocks: %" PRIu64 " total, %" PRIu64 " free, %" PRIu64 " used, %" PRIu64
               " retired; %s; %" PRIu64 " session(s)\n",
               ju(p, "blocks_total"), ju(p, "blocks_free"), ju(p, "blocks_used"),
               ju(p, "blocks_retired"), bytes_str(ju(p, "bytes_total"), b1, sizeof b1),
               ju(p, "sessions"));
    }
}

static void print_sessions(const json_t *sessions)
{
    char b1[32];
    size_t i;
    json_t *s;
    printf("sessions: %zu\n", json_array_size(sessions));
    json_array_foreach(sessions, i, s)
    {
        printf("  session %" PRIu64 ": pid %" PRIu64 ", uid %" PRIu64 ", \"%s\", pool %" PRIu64
               ", %" PRIu64 " sequence(s), attached %s, lease %s\n",
               ju(s, "session_id"), ju(s, "pid"), ju(s, "uid"), js(s, "worker_name"),
               ju(s, "pool_id"), ju(s, "sequences"),
               duration_str(ju(s, "attached_ms"), b1, sizeof b1),
               json_is_true(json_object_get(s, "lease_open")) ? "open" : "closed");
    }
}

static void print_sequences(const json_t *seqs)
{
    char b1[32];
    size_t i;
    json_t *q;
    printf("sequences: %zu\n", json_array_size(seqs));
    json_array_foreach(seqs, i, q)
    {
        const char *label = js(q, "label");
        printf("  seq %" PRIu64 " (session %" PRIu64 ", %s%s%s%s): epoch %" PRIu64
               ", appended %" PRIu64 ", holds %" PRIu64 " tokens in %" PRIu64 " blocks, %s\n",
               ju(q, "seq_id"), ju(q, "session_id"), js(q, "policy"), *label ? ", \"" : "", label,
               *label ? "\"" : "", ju(q, "epoch"), ju(q, "appended"), ju(q, "tokens"),
               ju(q, "blocks"), bytes_str(ju(q, "bytes"), b1, sizeof b1));
    }
}

static void print_status(const json_t *st)
{
    char b1[32];
    printf("kvstashd %s, up %s, backend %s, %" PRIu64 " events published\n", js(st, "version"),
           duration_str(ju(st, "uptime_ms"), b1, sizeof b1), js(st, "backend"),
           ju(st, "events_published"));
    json_t *pol = json_object_get(st, "policies");
    size_t i;
    json_t *v;
    printf("policies:");
    json_array_foreach(pol, i, v) printf("%s %s", i ? "," : "", json_string_value(v));
    printf("\n");
    print_pools(json_object_get(st, "pools"));
    print_sessions(json_object_get(st, "sessions"));
    print_sequences(json_object_get(st, "sequences"));
    json_t *tiers = json_object_get(st, "tiers");
    printf("tiers:\n");
    json_array_foreach(tiers, i, v)
    {
        printf("  %s: %" PRIu64 " tokens, %s\n", js(v, "tier"), ju(v, "tokens"),
               bytes_str(ju(v, "bytes"), b1, sizeof b1));
    }
}

/* Stats as a JSON object, or NULL after printing the one-line reason. */
static json_t *get_stats(const char *socket_path)
{
    char err[512], *text;
    int rc = kvs_stats_json(socket_path, &text, err, sizeof err);
    if (rc == KVS_ERR_UNAVAILABLE) {
        fprintf(stderr, "kvstash: cannot reach kvstashd at %s (is it running?): %s\n", socket_path,
                err);
        return NULL;
    }
    if (rc != KVS_OK) {
        fprintf(stderr, "kvstash: Stats failed: %s (%s)\n", err, kvs_strerror(rc));
        return NULL;
    }
    json_error_t jerr;
    json_t *st = json_loads(text, 0, &jerr);
    free(text);
    if (st == NULL)
        fprintf(stderr, "kvstash: cannot parse the Stats JSON: %s\n", jerr.text);
    return st;
}

static int cmd_policies(const char *socket_path, int as_json)
{
    json_t *st = get_stats(socket_path);
    if (st == NULL)
        return 1;
    json_t *pol = json_object_get(st, "policies");
    if (as_json) {
        char *text = json_dumps(pol, 0);
        if (text != NULL)
            printf("%s\n", text);
        free(text);
    } else {
        size_t i;
        json_t *v;
        json_array_foreach(pol, i, v) printf("%s\n", json_string_value(v));
    }
    json_decref(st);
    return fflush(stdout) == 0 ? 0 : 1;
}

static int cmd_status(const char *socket_path, int as_json)
{
    json_t *st = get_stats(socket_path);
    if (st == NULL)
        return 1;
    if (as_json) {
        char *pretty = json_dumps(st, JSON_INDENT(2));
        if (pretty != NULL)
            printf("%s\n", pretty);
        free(pretty);
    } else {
        print_status(st);
    }
    json_decref(st);
    return fflush(stdout) == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    /* `kvstash replay` runs a policy offline and has flags of its own. */
    if (argc > 1 && strcmp(argv[1], "replay") == 0)
        return replay_main(argc - 1, argv + 1);
    const char *socket_path = NULL, *cmd = NULL, *arg = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--socket") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvstash: --socket needs a path\n");
                return 2;
            }
            socket_path = argv[++i];
        } else if (strncmp(a, "--socket=", 9) == 0) {
            socket_path = a + 9;
        } else if (strcmp(a, "--json") == 0) {
            as_json = 1;
        } else if (a[0] == '-') {
            fprintf(stderr, "kvstash: unknown option %s (try --help)\n", a);
            return 2;
        } else if (cmd == NULL) {
            cmd = a;
        } else if (arg == NULL && strcmp(cmd, "policy") == 0) {
            arg = a;
        } else {
            fprintf(stderr, "kvstash: unexpected argument %s (try --help)\n", a);
            return 2;
        }
    }
    if (socket_path == NULL)
        socket_path = kvs_default_socket();
    if (cmd == NULL) {
        usage(stderr);
        return 2;
    }
    if (strcmp(cmd, "status") == 0)
        return cmd_status(socket_path, as_json);
    if (strcmp(cmd, "stats") == 0) /* JSON with or without --json */
        return cmd_status(socket_path, 1);
    if (strcmp(cmd, "policies") == 0 ||
        (strcmp(cmd, "policy") == 0 && arg != NULL && strcmp(arg, "list") == 0))
        return cmd_policies(socket_path, as_json);
    if (strcmp(cmd, "policy") == 0) {
        fprintf(stderr, "kvstash: policy wants a subcommand: list\n");
        return 2;
    }
    fprintf(stderr, "kvstash: unknown command %s (try --help)\n", cmd);
    return 2;
}
