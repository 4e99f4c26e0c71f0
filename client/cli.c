/*
 * cli.c - `kvstash`, the operator's command line for kvstashd: main, the
 * global options, and the read-only views (status, workers, seqs, policy
 * list). The other commands live in cli_seq.c and cli_live.c (cli.h).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "grpc/health/v1/health.pb-c.h"
#include "kvstash.h"
#include "pbjson.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvstash [--socket PATH] [--json] COMMAND [ARGS] [OPTIONS]\n"
            "\n"
            "commands:\n"
            "  status              daemon version, uptime, backend, pools, memory by tier\n"
            "  health              grpc.health.v1 check: exit 0 when serving, 1 when not\n"
            "  workers             attached workers: session, pid, uid, lease age\n"
            "  seqs                sequences: policy, length, tokens and bytes per tier\n"
            "  seq show ID         one sequence: per layer, a map of which positions are\n"
            "                      full / int8 / int4 / int2 / sketch / evicted, and its\n"
            "                      epochs\n"
            "  seq export ID       write a sequence to the remote tier (kvstashd --remote);\n"
            "                      prints the uid another kvstashd imports\n"
            "  seq import UID --session ID\n"
            "                      rebuild an export as a worker session's sequence\n"
            "  seq spill ID        move a sequence's revivable victims to the remote tier\n"
            "  policy list         the policies, their statistics, parameters and defaults\n"
            "  evict ID POSITIONS  drop positions from a sequence by hand (for debugging)\n"
            "  demote, offload, revive ID POSITIONS\n"
            "                      move positions to the int8 (--to int4|int2) /\n"
            "                      sketch / full tier\n"
            "  watch               live events from the daemon's feed\n"
            "  top                 a refreshing view of workers and sequences\n"
            "  replay --policy NAME < trace.jsonl\n"
            "                      run one policy on a recorded trace, without a daemon\n"
            "                      (docs/replay.md)\n"
            "  stats               the Stats reply as JSON (= status --json)\n"
            "\n"
            "options (anywhere on the line):\n"
            "  --socket PATH       kvstashd's gRPC socket (default %s)\n"
            "  --addr HOST:PORT    call kvstashd's TCP port (--listen) instead: health, and\n"
            "                      other calls only with a session's token\n"
            "  --tls-ca, --tls-cert, --tls-key FILE\n"
            "                      TLS for --addr: the CA of kvstashd's certificate, this\n"
            "                      client's certificate and key (default $KVSTASH_TLS_CA,\n"
            "                      $KVSTASH_TLS_CERT, $KVSTASH_TLS_KEY)\n"
            "  --json              machine-readable output: one JSON document, or JSON lines\n"
            "                      for watch and top\n"
            "  --help              this text; `kvstash COMMAND --help` for a command's own\n"
            "\n"
            "exit status: 0 ok, 1 the daemon refused (the reason is on stderr), 2 usage,\n"
            "3 kvstashd not running or not answering, 4 no such sequence, 5 permission\n"
            "denied. Errors are one line on stderr, starting with \"kvstash: \".\n",
            kvs_default_socket());
}

/* ---- status ---------------------------------------------------------------- */

static void print_pools(const Kvstash__V1__StatsResponse *st)
{
    char b1[32], b2[32];
    printf("pools: %zu\n", st->n_pools);
    for (size_t i = 0; i < st->n_pools; i++) {
        const Kvstash__V1__PoolStats *p = st->pools[i];
        const Kvstash__V1__Geometry *g = p->geometry;
        if (g != NULL)
            printf("  pool %" PRIu64 " \"%s\": %u layers, %u q / %u kv heads, head_dim %u, %s, "
                   "%u tokens/block, %s/block\n",
                   p->pool_id, p->model, g->layers, g->q_heads, g->kv_heads, g->head_dim,
                   cli_dtype(g->dtype), g->block_tokens, cli_bytes(p->block_bytes, b1, sizeof b1));
        printf(
            "    blocks: %u total, %u free, %u used, %u retired, %u quarantined; %s in use of "
            "%s; %u session(s)\n",
            p->blocks_total, p->blocks_free, p->blocks_used, p->blocks_retired,
            p->blocks_quarantined,
            cli_bytes((uint64_t)(p->blocks_total - p->blocks_free) * p->block_bytes, b1, sizeof b1),
            cli_bytes(p->bytes_total, b2, sizeof b2), p->sessions);
        if (p->tenant[0] != '\0') /* pools are per tenant and model */
            printf("    tenant: %s\n", p->tenant);
    }
}

/* "N" of a quota, or "no limit" for 0. */
static const char *cli_quota(uint64_t q, char *buf, size_t len)
{
    if (q == 0)
        return "no limit";
    snprintf(buf, len, "%" PRIu64, q);
    return buf;
}

/* The operator's limits (kvstashd --max-daemon-mb, --session-max-*,
 * --max-reply-mb) and each worker's use of its quotas. */
static void print_limits(const Kvstash__V1__StatsResponse *st)
{
    const Kvstash__V1__Limits *l = st->limits;
    if (l == NULL) /* an older kvstashd */
        return;
    char b1[32], b2[32], b3[32], b4[32], q1[24], q2[24];
    printf("limits: daemon memory %s (--max-daemon-mb), sketches reserved %s, allocated %s; "
           "replies up to %s\n",
           l->daemon_memory_bytes ? cli_bytes(l->daemon_memory_bytes, b1, sizeof b1) : "no limit",
           cli_bytes(l->sketch_reserved_bytes, b2, sizeof b2),
           cli_bytes(l->sketch_allocated_bytes, b3, sizeof b3),
           l->max_reply_bytes ? cli_bytes(l->max_reply_bytes, b4, sizeof b4) : "no limit");
    printf("  per worker: sequences %s (--session-max-seqs), blocks %s (--session-max-blocks)\n",
           cli_quota(l->session_max_seqs, q1, sizeof q1),
           cli_quota(l->session_max_blocks, q2, sizeof q2));
    for (size_t i = 0; i < st->n_sessions; i++) {
        const Kvstash__V1__SessionStats *s = st->sessions[i];
        printf("  worker %" PRIu64 " (%s): %u of %s sequences, %u of %s blocks\n", s->session_id,
               s->worker_name, s->sequences, cli_quota(l->session_max_seqs, q1, sizeof q1),
               s->blocks, cli_quota(l->session_max_blocks, q2, sizeof q2));
    }
}

/* Where pools live (device, IPC kind) and what ended sessions hold
 * (kvstashd --lease-end). An older kvstashd sends neither: nothing printed. */
static void print_backend(const Kvstash__V1__StatsResponse *st)
{
    if (st->ipc[0] != '\0') {
        printf("device: %s", st->device);
        if (st->device_name[0] != '\0')
            printf(" (%s)", st->device_name);
        printf(", ipc %s\n", st->ipc);
    }
    if (st->lease_end[0] != '\0')
        printf("lease end: %s; quarantined: %u session(s), %u block(s)\n", st->lease_end,
               st->quarantined_sessions, st->quarantined_blocks);
}

/* The remote tier (kvstashd --remote), as kvstashd last saw it; nothing
 * without one. */
static void print_remote(const Kvstash__V1__StatsResponse *st)
{
    const Kvstash__V1__RemoteTierStats *r = st->remote;
    if (r == NULL)
        return;
    char b1[32], b2[32], age[32];
    printf("remote: %s %s, namespace %s: %s, %u of %u nodes up, %u of 16384 slots\n",
           r->backend[0] ? r->backend : "(not connected)", r->seeds, r->key_namespace,
           r->healthy ? "healthy" : "UNHEALTHY", r->nodes_up, r->nodes, r->slots_covered);
    if (r->last_ok_age_ms < 0)
        snprintf(age, sizeof age, "never");
    else {
        cli_duration((uint64_t)r->last_ok_age_ms, age, sizeof age - 4);
        strcat(age, " ago");
    }
    printf("  %" PRIu64 " calls, %" PRIu64 " failed (%" PRIu64 " timeouts), %" PRIu64
           " redirects, %" PRIu64 " topology reloads; %s written, %s read; last ok %s\n",
           r->calls, r->errors, r->timeouts, r->redirects, r->refreshes,
           cli_bytes(r->bytes_written, b1, sizeof b1), cli_bytes(r->bytes_read, b2, sizeof b2),
           age);
    if (!r->healthy && r->last_error[0] != '\0')
        printf("  last error: %s\n", r->last_error);
}

static void print_status(const Kvstash__V1__StatsResponse *st)
{
    char b1[32];
    printf("kvstashd %s (pid %d), up %s, backend %s, %s, %" PRIu64 " events published\n",
           st->version, st->pid, cli_duration(st->uptime_ms, b1, sizeof b1), st->backend,
           st->serving ? "serving" : "shutting down", st->events_published);
    print_backend(st);
    printf("policies:");
    for (size_t i = 0; i < st->n_policies; i++)
        printf("%s %s", i ? "," : "", st->policies[i]);
    printf("\n");
    print_pools(st);
    printf("memory by tier:\n");
    for (size_t i = 0; i < st->n_tiers; i++)
        printf("  %-6s %" PRIu64 " tokens, %s\n", st->tiers[i]->tier, st->tiers[i]->tokens,
               cli_bytes(st->tiers[i]->bytes, b1, sizeof b1));
    printf("workers: %zu, sequences: %zu (kvstash workers, kvstash seqs)\n", st->n_sessions,
           st->n_sequences);
    /* Connected but not attached: many of these is a handshake flood, or
     * workers stuck between HELLO and Attach (kvstashd --pending-timeout-ms). */
    printf("pending workers: %u (connected, not attached yet)\n", st->pending_sessions);
    print_limits(st);
    print_remote(st);
}

static int cmd_status(cli *c, int always_json)
{
    static const char help[] =
        "usage: kvstash status [--json] [--socket PATH]\n"
        "  kvstashd's version, pid, uptime and backend (device, IPC kind), whether it is\n"
        "  serving, its lease-end mode and quarantined blocks, its policies, each pool\n"
        "  (geometry, blocks total/free/used/retired/quarantined, memory) and\n"
        "  held tokens and bytes by tier, and the remote tier's health (kvstashd\n"
        "  --remote). --json prints the whole Stats reply (with\n"
        "  workers and sequences); `kvstash stats` is the same as status --json.\n";
    int rc = cli_parse(c, NULL, 0, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    Kvstash__V1__StatsResponse *st;
    if ((rc = cli_stats(c, 0, &st)) != CLI_OK)
        return rc;
    if (c->json || always_json)
        rc = cli_print_message(&st->base, 1);
    else
        print_status(st);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* ---- health -------------------------------------------------------------------- */

static int cmd_health(cli *c)
{
    static const char help[] =
        "usage: kvstash health [--json] [--socket PATH]\n"
        "  Ask kvstashd's grpc.health.v1.Health service: prints SERVING or NOT_SERVING\n"
        "  (kvstashd is shutting down) and exits 0 or 1; 3 when kvstashd is not\n"
        "  running. For probes (ops/k8s). --json: {\"status\": \"SERVING\"}.\n";
    int rc = cli_parse(c, NULL, 0, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    Grpc__Health__V1__HealthCheckResponse *r;
    rc = cli_call(c, "/grpc.health.v1.Health/Check", NULL, &req.base,
                  &grpc__health__v1__health_check_response__descriptor, (ProtobufCMessage **)&r);
    if (rc != CLI_OK)
        return rc;
    int serving = r->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    if (c->json)
        rc = cli_print_message(&r->base, 0);
    else
        printf("%s\n", serving ? "SERVING" : "NOT_SERVING");
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc != CLI_OK ? rc : serving ? CLI_OK : CLI_ERROR;
}

/* ---- workers ----------------------------------------------------------------- */

static int cmd_workers(cli *c)
{
    static const char help[] =
        "usage: kvstash workers [--json] [--socket PATH]\n"
        "  The attached workers: session id, pid, uid, pool, sequences, whether the\n"
        "  lease stream is open, the lease's age and the time since Attach.\n"
        "  --json: {\"workers\": [SessionStats...]} (attached_ms and lease_ms are ages).\n";
    int rc = cli_parse(c, NULL, 0, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    Kvstash__V1__StatsResponse *st;
    if ((rc = cli_stats(c, 0, &st)) != CLI_OK)
        return rc;
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; i < st->n_sessions; i++)
            json_array_append_new(arr, pbjson_from_message(&st->sessions[i]->base));
        rc = cli_print_json(json_pack("{so}", "workers", arr), 1);
    } else {
        char b1[32], b2[32];
        printf("%7s %8s %6s %5s %5s %6s %10s %10s  %s\n", "SESSION", "PID", "UID", "POOL", "SEQS",
               "LEASE", "LEASE AGE", "ATTACHED", "NAME");
        for (size_t i = 0; i < st->n_sessions; i++) {
            const Kvstash__V1__SessionStats *s = st->sessions[i];
            printf("%7" PRIu64 " %8d %6u %5" PRIu64 " %5u %6s %10s %10s  %s\n", s->session_id,
                   s->pid, s->uid, s->pool_id, s->sequences, s->lease_open ? "open" : "closed",
                   s->lease_open ? cli_duration(s->lease_ms, b1, sizeof b1) : "-",
                   cli_duration(s->attached_ms, b2, sizeof b2), s->worker_name);
        }
        if (st->n_sessions == 0)
            printf("(no workers attached)\n");
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* ---- seqs -------------------------------------------------------------------- */

static uint64_t tier_tokens(const Kvstash__V1__SequenceStats *q, const char *tier)
{
    for (size_t i = 0; i < q->n_tiers; i++)
        if (strcmp(q->tiers[i]->tier, tier) == 0)
            return q->tiers[i]->tokens;
    return 0;
}

static int cmd_seqs(cli *c)
{
    static const char help[] =
        "usage: kvstash seqs [--json] [--socket PATH]\n"
        "  Every sequence: id, owning session, policy, length (tokens ever appended),\n"
        "  tokens held (summed over layers) and how many are stored in each tier\n"
        "  (full / int8 / int4 / int2 / sketch; offloaded victims count as sketch),\n"
        "  victims spilled to the remote tier (kvstash seq spill), blocks, bytes,\n"
        "  table epoch and label.\n"
        "  --json: {\"sequences\": [SequenceStats with \"tiers\"...]}.\n";
    int rc = cli_parse(c, NULL, 0, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    Kvstash__V1__StatsResponse *st;
    if ((rc = cli_stats(c, 1, &st)) != CLI_OK)
        return rc;
    if (c->json) {
        json_t *arr = json_array();
        for (size_t i = 0; i < st->n_sequences; i++)
            json_array_append_new(arr, pbjson_from_message(&st->sequences[i]->base));
        rc = cli_print_json(json_pack("{so}", "sequences", arr), 1);
    } else {
        char b1[32];
        printf("%6s %7s %-14s %9s %9s %9s %7s %7s %7s %7s %7s %6s %10s %6s  %s\n", "SEQ", "SESSION",
               "POLICY", "APPENDED", "TOKENS", "FULL", "INT8", "INT4", "INT2", "SKETCH", "REMOTE",
               "BLOCKS", "BYTES", "EPOCH", "LABEL");
        for (size_t i = 0; i < st->n_sequences; i++) {
            const Kvstash__V1__SequenceStats *q = st->sequences[i];
            printf("%6" PRIu64 " %7" PRIu64 " %-14s %9" PRIu64 " %9" PRIu64 " %9" PRIu64
                   " %7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64
                   " %6u %10s %6" PRIu64 "  %s\n",
                   q->seq_id, q->session_id, q->policy, q->appended, q->tokens,
                   tier_tokens(q, "full"), tier_tokens(q, "int8"), tier_tokens(q, "int4"),
                   tier_tokens(q, "int2"), tier_tokens(q, "sketch"), q->spilled_tokens, q->blocks,
                   cli_bytes(q->bytes, b1, sizeof b1), q->epoch, q->label);
        }
        if (st->n_sequences == 0)
            printf("(no sequences)\n");
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* ---- policy list ---------------------------------------------------------------- */

static void print_params(Kvstash__V1__PolicyParamSpec *const *params, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char kv[96];
        snprintf(kv, sizeof kv, "%s=%s", params[i]->key, params[i]->default_value);
        printf("    %-28s %s\n", kv, params[i]->help);
    }
}

static void print_policy(const Kvstash__V1__PolicyInfo *p)
{
    printf("%s\n  %s\n  needs:", p->name, p->summary);
    if (p->n_needs == 0)
        printf(" nothing from the worker");
    for (size_t i = 0; i < p->n_needs; i++)
        printf("%s %s", i ? "," : "", p->needs[i]);
    printf("; lists: %s; operator evict: %s\n", p->per_head ? "one per KV head" : "one per layer",
           p->operator_evict ? "yes" : "no");
    if (p->n_params == 0)
        printf("  parameters: none\n");
    print_params(p->params, p->n_params);
}

static int cmd_policy(cli *c)
{
    static const char help[] =
        "usage: kvstash policy list [--json] [--socket PATH]\n"
        "  The policies kvstashd knows, in registry order: a summary, the statistics a\n"
        "  worker must report each step, whether it keeps one token list per KV head,\n"
        "  whether `kvstash evict` works on its sequences, and every parameter as\n"
        "  key=default with its meaning (pass them as CreateSequence params); then the\n"
        "  storage keys every policy accepts (demote, int8, victims, sketch_*).\n"
        "  --json: the ListPolicies reply, {\"policies\": [{\"name\", \"summary\",\n"
        "  \"params\": [{\"key\", \"default_value\", \"help\"}], \"needs\", \"per_head\",\n"
        "  \"operator_evict\"}], \"storage_params\": [...]}.\n";
    const char *pos[1];
    size_t npos;
    int rc = cli_parse(c, NULL, 0, pos, 0, 1, &npos, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    if (strcmp(c->cmd, "policy") == 0 && (npos == 0 || strcmp(pos[0], "list") != 0))
        return cli_fail(CLI_USAGE, "policy: %s%s (try kvstash policy --help)",
                        npos ? "unknown subcommand " : "wants a subcommand: list",
                        npos ? pos[0] : "");
    if (strcmp(c->cmd, "policies") == 0 && npos > 0)
        return cli_fail(CLI_USAGE, "policies: unexpected argument %s", pos[0]);
    Kvstash__V1__ListPoliciesRequest req = KVSTASH__V1__LIST_POLICIES_REQUEST__INIT;
    Kvstash__V1__ListPoliciesResponse *r;
    rc = cli_call(c, "ListPolicies", NULL, &req.base,
                  &kvstash__v1__list_policies_response__descriptor, (ProtobufCMessage **)&r);
    if (rc != CLI_OK)
        return rc;
    if (c->json) {
        rc = cli_print_message(&r->base, 1);
    } else {
        for (size_t i = 0; i < r->n_policies; i++)
            print_policy(r->policies[i]);
        printf("storage keys, accepted by every policy (docs/tiers.md):\n");
        print_params(r->storage_params, r->n_storage_params);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

/* ---- main --------------------------------------------------------------------- */

/* Global options before the command; returns the command's index, or -1
 * with *rc set (help printed, or a usage error). */
static int globals(int argc, char **argv, cli *c, int *rc)
{
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            *rc = CLI_OK;
            return -1;
        } else if (strcmp(a, "--version") == 0) {
            printf("kvstash %s\n", KVSTASH_VERSION);
            *rc = CLI_OK;
            return -1;
        } else if (strcmp(a, "--json") == 0) {
            c->json = 1;
        } else if (strcmp(a, "--socket") == 0 && i + 1 < argc) {
            c->socket = argv[++i];
        } else if (strncmp(a, "--socket=", 9) == 0) {
            c->socket = a + 9;
        } else if (strcmp(a, "--addr") == 0 && i + 1 < argc) {
            c->addr = argv[++i];
        } else if (strcmp(a, "--tls-ca") == 0 && i + 1 < argc) {
            c->tls_ca = argv[++i];
        } else if (strcmp(a, "--tls-cert") == 0 && i + 1 < argc) {
            c->tls_cert = argv[++i];
        } else if (strcmp(a, "--tls-key") == 0 && i + 1 < argc) {
            c->tls_key = argv[++i];
        } else {
            *rc = cli_fail(CLI_USAGE, "unknown option %s (try kvstash --help)", a);
            return -1;
        }
    }
    if (i == argc) {
        usage(stderr);
        *rc = CLI_USAGE;
        return -1;
    }
    return i;
}

int main(int argc, char **argv)
{
    cli c = {.socket = NULL};
    int rc = CLI_OK;
    /* `kvstash replay` runs a policy offline and has options of its own. */
    int i = globals(argc, argv, &c, &rc);
    if (i < 0)
        return rc;
    const char *cmd = argv[i];
    if (strcmp(cmd, "replay") == 0)
        return cli_cmd_replay(argc - i, argv + i);
    if (c.socket == NULL)
        c.socket = kvs_default_socket();
    c.cmd = cmd;
    c.argc = argc - i - 1;
    c.argv = argv + i + 1;
    if (strcmp(cmd, "status") == 0)
        return cmd_status(&c, 0);
    if (strcmp(cmd, "stats") == 0)
        return cmd_status(&c, 1);
    if (strcmp(cmd, "health") == 0)
        return cmd_health(&c);
    if (strcmp(cmd, "workers") == 0)
        return cmd_workers(&c);
    if (strcmp(cmd, "seqs") == 0)
        return cmd_seqs(&c);
    if (strcmp(cmd, "policy") == 0 || strcmp(cmd, "policies") == 0)
        return cmd_policy(&c);
    if (strcmp(cmd, "seq") == 0)
        return cli_cmd_seq(&c);
    if (strcmp(cmd, "evict") == 0 || strcmp(cmd, "demote") == 0 || strcmp(cmd, "offload") == 0 ||
        strcmp(cmd, "revive") == 0)
        return cli_cmd_evict(&c, cmd);
    if (strcmp(cmd, "watch") == 0)
        return cli_cmd_watch(&c);
    if (strcmp(cmd, "top") == 0)
        return cli_cmd_top(&c);
    return cli_fail(CLI_USAGE, "unknown command %s (try kvstash --help)", cmd);
}
