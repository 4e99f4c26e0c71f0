/* cli_seq.c - `kvstash seq show`, and `evict`, `demote`, `offload`,
 * `revive`: one Evict call each, with the tier the positions go to (cli.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "fdsock.h"
#include "kvstash.h"

#define MAP_WIDTH 64

static int inspect(const cli *c, uint64_t seq, int with_map, uint32_t max_runs,
                   Kvstash__V1__InspectResponse **out)
{
    Kvstash__V1__InspectRequest req = KVSTASH__V1__INSPECT_REQUEST__INIT;
    req.seq_id = seq;
    req.with_map = with_map;
    req.max_runs = max_runs;
    return cli_call_view(c, "Inspect", &req.base, &kvstash__v1__inspect_response__descriptor,
                         (ProtobufCMessage **)out);
}

static int parse_seq_id(const cli *c, const char *text, uint64_t *id)
{
    if (cli_uint(text, UINT64_MAX, id) != 0)
        return cli_fail(CLI_USAGE, "%s: sequence id must be a number, got '%s'", c->cmd, text);
    return CLI_OK;
}

/* ---- seq show --------------------------------------------------------------------- */

/* 0 full, 1 int8, 2 sketch, 3 evicted, 4 offloaded (out of the list, kept
 * revivable), 5 int4, 6 int2: a map cell shows the held tier with the most
 * positions by MAP_MARKS. */
#define MAP_KINDS 7
static const char MAP_MARKS[MAP_KINDS + 1] = "#8s.o42";

static int tier_index(const char *tier)
{
    return strcmp(tier, "int8") == 0        ? 1
           : strcmp(tier, "sketch") == 0    ? 2
           : strcmp(tier, "evicted") == 0   ? 3
           : strcmp(tier, "offloaded") == 0 ? 4
           : strcmp(tier, "int4") == 0      ? 5
           : strcmp(tier, "int2") == 0      ? 6
                                            : 0;
}

/* A bar of `width` cells over positions 0 .. appended-1: each cell shows the
 * state of most of its positions; ':' where held and gone tokens mix. */
static void print_bar(const Kvstash__V1__ListMap *m, uint64_t appended, unsigned width)
{
    if (appended == 0) {
        printf("    (no positions yet)\n");
        return;
    }
    if (appended < width)
        width = (unsigned)appended;
    char bar[MAP_WIDTH * 4 + 1];
    size_t r = 0;
    for (unsigned j = 0; j < width; j++) {
        uint64_t lo = appended * j / width, hi = appended * (j + 1) / width;
        uint64_t n[MAP_KINDS] = {0}; /* positions of the cell by tier_index */
        for (uint64_t p = lo; p < hi && r < m->n_runs;) {
            const Kvstash__V1__TierRun *run = m->runs[r];
            uint64_t end = (uint64_t)run->first_position + run->count;
            uint64_t take = (end < hi ? end : hi) - p;
            n[tier_index(run->tier)] += take;
            p += take;
            if (p >= end)
                r++;
        }
        uint64_t held = n[0] + n[1] + n[2] + n[5] + n[6];
        if (held == 0) {
            bar[j] = n[4] > n[3] ? 'o' : n[3] > 0 ? '.' : ' '; /* ' ': beyond --max-runs */
        } else if (n[3] + n[4] > 0) {
            bar[j] = ':';
        } else { /* the held tier with the most positions, the first of equals */
            static const int held_kinds[] = {0, 1, 5, 6, 2};
            int best = 0;
            for (size_t k = 1; k < sizeof held_kinds / sizeof held_kinds[0]; k++)
                if (n[held_kinds[k]] > n[best])
                    best = held_kinds[k];
            bar[j] = MAP_MARKS[best];
        }
    }
    bar[width] = '\0';
    printf("    |%s|\n", bar);
}

static void print_runs(const Kvstash__V1__ListMap *m)
{
    const size_t shown = 12;
    printf("    runs:");
    for (size_t i = 0; i < m->n_runs && i < shown; i++) {
        const Kvstash__V1__TierRun *r = m->runs[i];
        if (r->count == 1)
            printf("%s %u %s", i ? "," : "", r->first_position, r->tier);
        else
            printf("%s %u-%u %s", i ? "," : "", r->first_position, r->first_position + r->count - 1,
                   r->tier);
    }
    if (m->n_runs > shown)
        printf(", ... %zu more (--json shows them all)", m->n_runs - shown);
    if (m->truncated)
        printf(" [map cut at --max-runs]");
    printf("\n");
}

static void print_inspect(const Kvstash__V1__InspectResponse *r, unsigned width)
{
    const Kvstash__V1__SequenceStats *q = r->sequence;
    char b1[32];
    printf("seq %" PRIu64 ": session %" PRIu64 ", policy %s%s%s%s\n", q->seq_id, q->session_id,
           q->policy, q->label[0] ? ", label \"" : "", q->label, q->label[0] ? "\"" : "");
    printf("  appended %" PRIu64 " positions; holds %" PRIu64 " tokens (summed over layers) in "
           "%u blocks, %s\n",
           q->appended, q->tokens, q->blocks, cli_bytes(q->bytes, b1, sizeof b1));
    printf("  params:");
    if (r->n_params == 0)
        printf(" none");
    for (size_t i = 0; i < r->n_params; i++)
        printf(" %s=%s", r->params[i]->key, r->params[i]->value);
    printf("\n  table epoch %" PRIu64 "; retired blocks waiting for the worker's ack:", q->epoch);
    if (r->n_retired == 0)
        printf(" none");
    for (size_t i = 0; i < r->n_retired; i++)
        printf("%s %u at epoch %" PRIu64, i ? "," : "", r->retired[i]->blocks,
               r->retired[i]->epoch);
    printf("\n  map: # full  8 int8  4 int4  2 int2  s sketch  o offloaded  . evicted  : mixed "
           "(held tokens by the tier they are stored in)\n");
    for (size_t l = 0; l < r->n_layers; l++) {
        const Kvstash__V1__LayerInspect *ly = r->layers[l];
        uint32_t full =
            ly->tokens - ly->tokens_int8 - ly->tokens_int4 - ly->tokens_int2 - ly->tokens_sketch;
        printf("  layer %u: %u tokens (full %u, int8 %u, int4 %u, int2 %u, sketch %u) in %u "
               "blocks",
               ly->layer, ly->tokens, full, ly->tokens_int8, ly->tokens_int4, ly->tokens_int2,
               ly->tokens_sketch, ly->blocks);
        if (ly->tokens > 0)
            printf(", positions %u..%u", ly->first_position, ly->last_position);
        printf("\n");
        for (size_t k = 0; k < r->n_maps; k++) {
            const Kvstash__V1__ListMap *m = r->maps[k];
            if (m->layer != ly->layer)
                continue;
            if (m->per_head)
                printf("   head %u:\n", m->head);
            print_bar(m, q->appended, width);
            print_runs(m);
        }
    }
}

static int cmd_show(cli *c)
{
    static const char help[] =
        "usage: kvstash seq show ID [--max-runs N] [--width W] [--json] [--socket PATH]\n"
        "  One sequence: its policy, parameters, length, tokens, blocks and bytes, its\n"
        "  table epoch and the retired blocks waiting for its worker to acknowledge an\n"
        "  epoch, then per layer (and per KV head for per-head policies) a map of the\n"
        "  positions 0..appended-1: a bar of W cells (default 64) and the runs of\n"
        "  positions held in full (full precision, in the pool's dtype), int8 or sketch\n"
        "  (the tier each is stored in), offloaded (victims=sketch or victims=int8: out\n"
        "  of the list, kept in its sketch or as INT8, revivable) or evicted (by the\n"
        "  policy or an operator; merged-away tokens are evicted too).\n"
        "  --max-runs N: runs per list the daemon sends (default 1024).\n"
        "  --json: the Inspect reply with \"maps\" (every run) and \"retired\".\n";
    const char *pos[1], *max_runs = NULL, *width = NULL;
    const cli_opt opts[] = {{"max-runs", 1, &max_runs, NULL, NULL, NULL},
                            {"width", 1, &width, NULL, NULL, NULL}};
    int rc = cli_parse(c, opts, 2, pos, 1, 1, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    uint64_t id, runs = 0, w = MAP_WIDTH;
    if ((rc = parse_seq_id(c, pos[0], &id)) != CLI_OK)
        return rc;
    if (max_runs != NULL && (cli_uint(max_runs, 65536, &runs) != 0 || runs == 0))
        return cli_fail(CLI_USAGE, "seq show: --max-runs wants 1..65536, got '%s'", max_runs);
    if (width != NULL && (cli_uint(width, MAP_WIDTH * 4, &w) != 0 || w < 8))
        return cli_fail(CLI_USAGE, "seq show: --width wants 8..%d, got '%s'", MAP_WIDTH * 4, width);
    Kvstash__V1__InspectResponse *r;
    if ((rc = inspect(c, id, 1, (uint32_t)runs, &r)) != CLI_OK)
        return rc;
    if (c->json)
        rc = cli_print_message(&r->base, 1);
    else
        print_inspect(r, (unsigned)w);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

/* A subcommand whose one argument is a sequence id: parse it into
 * *seq_id of req, then call `method` as us (cli_call_as_us). Returns
 * cli_parse's negative "help printed", a CLI error, or CLI_OK with *resp
 * the caller's to free. */
static int call_on_seq(cli *c, const char *help, const char *method, ProtobufCMessage *req,
                       uint64_t *seq_id, const ProtobufCMessageDescriptor *resp_desc,
                       ProtobufCMessage **resp)
{
    const char *pos[1];
    int rc = cli_parse(c, NULL, 0, pos, 1, 1, NULL, help);
    if (rc != CLI_OK)
        return rc;
    if ((rc = parse_seq_id(c, pos[0], seq_id)) != CLI_OK)
        return rc;
    return cli_call_as_us(c, method, req, resp_desc, resp);
}

static int cmd_export(cli *c)
{
    static const char help[] =
        "usage: kvstash seq export ID [--json] [--socket PATH]\n"
        "  Write sequence ID to kvstashd's remote tier (kvstashd --remote: a Redis\n"
        "  Cluster; docs/remote.md) and print the uid that names the export: another\n"
        "  kvstashd on the same cluster and namespace imports it (kvstash seq import)\n"
        "  for a worker there to continue decoding. The sequence stays here: release it\n"
        "  to move it. Sequences move with every tier (count-sketches included) and\n"
        "  their policy's state, but not yet with victims spilled (kvstash seq spill).\n"
        "  --json: the ExportSequence reply (uid, bytes, values, blocks, tokens, ttl_s).\n";
    Kvstash__V1__ExportSequenceRequest req = KVSTASH__V1__EXPORT_SEQUENCE_REQUEST__INIT;
    Kvstash__V1__ExportSequenceResponse *r;
    int rc =
        call_on_seq(c, help, "ExportSequence", &req.base, &req.seq_id,
                    &kvstash__v1__export_sequence_response__descriptor, (ProtobufCMessage **)&r);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    uint64_t id = req.seq_id;
    char b1[32];
    if (c->json)
        rc = cli_print_message(&r->base, 1);
    else
        printf("%s\nexported sequence %" PRIu64 ": %" PRIu64 " tokens in %u blocks, %s in %u "
               "values under %s, for %u s\n",
               r->uid, id, r->tokens, r->blocks, cli_bytes(r->bytes, b1, sizeof b1), r->values,
               r->key_prefix, r->ttl_s);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

static int cmd_spill(cli *c)
{
    static const char help[] =
        "usage: kvstash seq spill ID [--json] [--socket PATH]\n"
        "  Move the evicted tokens sequence ID keeps revivable to kvstashd's remote tier\n"
        "  (kvstashd --remote; docs/remote.md): its victim blocks (victims=int8) go back\n"
        "  to the pool, its victims-only count-sketches (victims=sketch) are freed (new\n"
        "  victims start fresh ones). Revive still brings the victims back, fetching\n"
        "  them from the remote tier. A sequence without such victims spills nothing.\n"
        "  --json: the SpillSequence reply (uid, blocks, sketches, tokens, bytes,\n"
        "  dropped, spilled_tokens).\n";
    Kvstash__V1__SpillSequenceRequest req = KVSTASH__V1__SPILL_SEQUENCE_REQUEST__INIT;
    Kvstash__V1__SpillSequenceResponse *r;
    int rc =
        call_on_seq(c, help, "SpillSequence", &req.base, &req.seq_id,
                    &kvstash__v1__spill_sequence_response__descriptor, (ProtobufCMessage **)&r);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    uint64_t id = req.seq_id;
    char b1[32];
    if (c->json)
        rc = cli_print_message(&r->base, 1);
    else
        printf("spilled sequence %" PRIu64 ": %" PRIu64 " victims in %u blocks and %u sketches, "
               "%s in %u values under %s, for %u s (%u changed meanwhile, kept); %" PRIu64
               " victims are in the remote tier\n",
               id, r->tokens, r->blocks, r->sketches, cli_bytes(r->bytes, b1, sizeof b1), r->values,
               r->key_prefix, r->ttl_s, r->dropped, r->spilled_tokens);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

static int cmd_import(cli *c)
{
    static const char help[] =
        "usage: kvstash seq import UID --session ID [--json] [--socket PATH]\n"
        "  Rebuild the export UID (kvstash seq export on another kvstashd) from the\n"
        "  remote tier as a sequence of worker session ID (kvstash workers), whose pool\n"
        "  must have the export's geometry and tenant; an operator's uid may import\n"
        "  into any session. Prints the new sequence's id. Workers import their own\n"
        "  with kvs_seq_import.\n"
        "  --json: the ImportSequence reply (seq_id, epoch, appended, policy, params).\n";
    const char *pos[1], *session = NULL;
    const cli_opt opts[] = {{"session", 1, &session, NULL, NULL, NULL}};
    int rc = cli_parse(c, opts, 1, pos, 1, 1, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    uint64_t sid;
    if (session == NULL || cli_uint(session, UINT64_MAX, &sid) != 0 || sid == 0)
        return cli_fail(CLI_USAGE,
                        "seq import: --session wants the worker session to import into "
                        "(kvstash workers lists them), got '%s'",
                        session != NULL ? session : "nothing");
    Kvstash__V1__ImportSequenceRequest req = KVSTASH__V1__IMPORT_SEQUENCE_REQUEST__INIT;
    req.uid = (char *)pos[0];
    req.session_id = sid;
    Kvstash__V1__ImportSequenceResponse *r;
    if ((rc = cli_call_as_us(c, "ImportSequence", &req.base,
                             &kvstash__v1__import_sequence_response__descriptor,
                             (ProtobufCMessage **)&r)) != CLI_OK)
        return rc;
    char b1[32];
    if (c->json)
        rc = cli_print_message(&r->base, 1);
    else
        printf("imported %s as sequence %" PRIu64 " of session %" PRIu64 ": policy %s, %" PRIu64
               " tokens appended, %u blocks, %s read\n",
               pos[0], r->seq_id, sid, r->policy, r->appended, r->blocks,
               cli_bytes(r->bytes, b1, sizeof b1));
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

int cli_cmd_seq(cli *c)
{
    static const char help[] = "usage: kvstash seq show ID | export ID | import UID --session ID "
                               "| spill ID\n"
                               "  (kvstash seq SUBCOMMAND --help)\n";
    static const struct {
        const char *name, *cmd;
        int (*run)(cli *c);
    } subs[] = {{"show", "seq show", cmd_show},
                {"export", "seq export", cmd_export},
                {"import", "seq import", cmd_import},
                {"spill", "seq spill", cmd_spill}};
    for (size_t i = 0; c->argc > 0 && i < sizeof subs / sizeof subs[0]; i++)
        if (strcmp(c->argv[0], subs[i].name) == 0) {
            c->cmd = subs[i].cmd;
            c->argc--;
            c->argv++;
            return subs[i].run(c);
        }
    int rc = cli_parse(c, NULL, 0, NULL, 0, 0, NULL, help);
    if (rc != CLI_OK)
        return rc < 0 ? CLI_OK : rc;
    return cli_fail(CLI_USAGE,
                    "seq wants a subcommand: show ID, export ID, import UID --session ID or "
                    "spill ID (try "
                    "kvstash seq --help)");
}

/* ---- positions and layers ------------------------------------------------------- */

typedef struct targets {
    const cli *c;
    Kvstash__V1__PositionRange *ranges;
    size_t nranges, cap;
    uint32_t *layers;
    size_t nlayers;
    const char *to; /* --to: demote's precision */
} targets;

static void targets_free(targets *t)
{
    free(t->ranges);
    free(t->layers);
}

static int add_range(targets *t, uint64_t first, uint64_t last)
{
    if (t->nranges == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 16;
        Kvstash__V1__PositionRange *n = realloc(t->ranges, cap * sizeof *n);
        if (n == NULL)
            return cli_fail(CLI_ERROR, "out of memory");
        t->ranges = n;
        t->cap = cap;
    }
    Kvstash__V1__PositionRange *r = &t->ranges[t->nranges++];
    kvstash__v1__position_range__init(r);
    r->first = (uint32_t)first;
    r->count = (uint32_t)(last - first + 1);
    return CLI_OK;
}

/* "5", "10-19", "3,7,9-12". */
static int parse_positions(targets *t, const char *text)
{
    char *copy = strdup(text), *save = NULL;
    if (copy == NULL)
        return cli_fail(CLI_ERROR, "out of memory");
    int rc = CLI_OK;
    for (char *tok = strtok_r(copy, ",", &save); tok != NULL && rc == CLI_OK;
         tok = strtok_r(NULL, ",", &save)) {
        char *dash = strchr(tok, '-');
        uint64_t a, b;
        if (dash != NULL)
            *dash = '\0';
        if (cli_uint(tok, UINT32_MAX, &a) != 0 ||
            (dash != NULL ? cli_uint(dash + 1, UINT32_MAX, &b) != 0 : (b = a, 0)) || b < a)
            rc = cli_fail(CLI_USAGE,
                          "%s: positions are N, A-B or lists of them (3,7,9-12), got '%s'",
                          t->c->cmd, text);
        else
            rc = add_range(t, a, b);
    }
    free(copy);
    return rc;
}

static int add_layer(void *ctx, const char *value)
{
    targets *t = ctx;
    uint64_t l;
    if (cli_uint(value, UINT32_MAX, &l) != 0)
        return cli_fail(CLI_USAGE, "%s: --layer wants a layer number, got '%s'", t->c->cmd, value);
    uint32_t *n = realloc(t->layers, (t->nlayers + 1) * sizeof *n);
    if (n == NULL)
        return cli_fail(CLI_ERROR, "out of memory");
    t->layers = n;
    t->layers[t->nlayers++] = (uint32_t)l;
    return CLI_OK;
}

#define MAX_POS_ARGS 256

/* ID POSITIONS... [--layer L]...; returns CLI_OK, -1 (help) or an error. */
static int parse_targets(cli *c, const char *help, uint64_t *id, targets *t)
{
    const char *pos[MAX_POS_ARGS];
    size_t npos;
    const cli_opt opts[] = {{"layer", 1, NULL, NULL, add_layer, t},
                            {"to", 1, &t->to, NULL, NULL, NULL}};
    int rc = cli_parse(c, opts, 2, pos, 2, MAX_POS_ARGS, &npos, help);
    if (rc != CLI_OK)
        return rc;
    if (t->to != NULL && strcmp(c->cmd, "demote") != 0)
        return cli_fail(CLI_USAGE, "%s: --to is demote's option", c->cmd);
    if (t->to != NULL && strcmp(t->to, "int8") != 0 && strcmp(t->to, "int4") != 0 &&
        strcmp(t->to, "int2") != 0)
        return cli_fail(CLI_USAGE, "demote: --to wants int8, int4 or int2, got '%s'", t->to);
    if ((rc = parse_seq_id(c, pos[0], id)) != CLI_OK)
        return rc;
    for (size_t i = 1; i < npos && rc == CLI_OK; i++)
        rc = parse_positions(t, pos[i]);
    return rc;
}

/* ---- evict, demote, offload, revive --------------------------------------------- */

/* evict and the tier moves: one EvictRequest each, `to` apart. */
typedef struct evict_op {
    const char *name;         /* the command */
    const char *to;           /* EvictRequest.to */
    const char *verb, *where; /* text output: "demoted" N token(s) "to int8" */
    const char *what;         /* --help: what the command does */
} evict_op;

static const evict_op evict_ops[] = {
    {"evict", "evict", NULL, NULL,
     "  Drop original positions from sequence ID, for debugging, as if its policy had\n"
     "  evicted them: the tokens leave the lists and the block table.\n"},
    {"demote", "int8", "demoted", "to int8",
     "  Demote the held tokens at original positions of sequence ID to INT8 now\n"
     "  (symmetric, one scale per INT8 block, K/V, head and channel: POLICIES.md\n"
     "  §5.4), even fewer than an INT8 block holds (the last INT8 block is then\n"
     "  written partial); sketch tokens come out of the sketch first. Workers read\n"
     "  INT8 tokens in place, dequantised. --to int4|int2: into INT4 / INT2 blocks\n"
     "  instead (asymmetric groups: kernels.h \"Low-bit tiers\"); tokens of another\n"
     "  quantised tier come back to full precision first.\n"},
    {"offload", "sketch", "offloaded", "into the sketch",
     "  Move the held tokens at original positions of sequence ID into their list's\n"
     "  count-sketch (KVReviver): they stay in the list as sketch tokens, which a\n"
     "  worker cannot read in place (the Revive RPC rebuilds their estimate).\n"},
    {"revive", "full", "revived", "to full precision",
     "  Bring the quantised and sketch tokens at original positions of sequence ID\n"
     "  back to full precision in fresh slots: INT8 / INT4 / INT2 ones dequantised,\n"
     "  sketch ones as the\n"
     "  sketch's estimate, which leaves the sketch (KVReviver Alg. 3). Evicted\n"
     "  positions cannot come back.\n"},
};

static void evict_help(const evict_op *op, char *help, size_t len)
{
    snprintf(help, len,
             "usage: kvstash %s ID POSITIONS... [--layer L]... [--to T] [--json] [--socket PATH]\n"
             "%s"
             "  Blocks the tokens leave are retired until the worker acknowledges the new\n"
             "  epoch, and a table.changed event goes out.\n"
             "  POSITIONS: N, A-B, or comma lists (3,7,9-12). --layer L (repeatable)\n"
             "  limits it to those layers; default every layer. Works on policies that keep\n"
             "  no per-token state (full, streaming: see `kvstash policy list`); their own\n"
             "  rule runs first, as at the next step, so streaming may drop more, and the\n"
             "  command applies to the tokens it keeps. --json: the Evict reply (epoch,\n"
             "  evicted, requested, by_policy, not_held, moved).\n",
             op->name, op->what);
}

static void print_evict(const evict_op *op, const char *to, uint64_t id,
                        const Kvstash__V1__EvictResponse *r)
{
    char where[32];
    snprintf(where, sizeof where, "to %s", to != NULL ? to : "");
    printf("seq %" PRIu64 ": ", id);
    if (op->verb == NULL) {
        printf("evicted %u token(s) (%u at the requested positions, %u by the policy's own "
               "rule)",
               r->evicted, r->requested, r->by_policy);
    } else {
        printf("%s %u token(s) %s, of %u held at the requested positions", op->verb, r->moved,
               to != NULL ? where : op->where, r->requested);
        if (r->moved < r->requested)
            printf(" (%u were there already, or the pool lacks blocks for them)",
                   r->requested - r->moved);
        printf("; the policy's own rule evicted %u", r->evicted);
    }
    printf("; %u requested (list, position) pair(s) were not held; table epoch %" PRIu64 "\n",
           r->not_held, r->epoch);
}

int cli_cmd_evict(cli *c, const char *name)
{
    const evict_op *op = &evict_ops[0];
    for (size_t i = 0; i < sizeof evict_ops / sizeof evict_ops[0]; i++)
        if (strcmp(evict_ops[i].name, name) == 0)
            op = &evict_ops[i];
    char help[2048];
    evict_help(op, help, sizeof help);
    uint64_t id;
    targets t = {.c = c};
    int rc = parse_targets(c, help, &id, &t);
    if (rc != CLI_OK) {
        targets_free(&t);
        return rc < 0 ? CLI_OK : rc;
    }
    Kvstash__V1__PositionRange **ptrs = calloc(t.nranges + 1, sizeof *ptrs);
    if (ptrs == NULL) {
        targets_free(&t);
        return cli_fail(CLI_ERROR, "out of memory");
    }
    for (size_t i = 0; i < t.nranges; i++)
        ptrs[i] = &t.ranges[i];
    Kvstash__V1__EvictResponse *r = NULL;
    Kvstash__V1__EvictRequest req = KVSTASH__V1__EVICT_REQUEST__INIT;
    req.seq_id = id;
    req.ranges = ptrs;
    req.n_ranges = t.nranges;
    req.layers = t.layers;
    req.n_layers = t.nlayers;
    req.to = (char *)(t.to != NULL ? t.to : op->to);
    rc = cli_call_as_us(c, "Evict", &req.base, &kvstash__v1__evict_response__descriptor,
                        (ProtobufCMessage **)&r);
    if (rc == CLI_OK && c->json)
        rc = cli_print_message(&r->base, 1);
    else if (rc == CLI_OK)
        print_evict(op, t.to, id, r);
    if (r != NULL)
        protobuf_c_message_free_unpacked(&r->base, NULL);
    free(ptrs);
    targets_free(&t);
    return rc;
}
