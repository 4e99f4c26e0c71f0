/*
 * demo_worker.c - `kvstash-demo`: a worker that shows what libkvstash does.
 *
 * It attaches a small fp16 model ("demo": 4 layers, 4 query / 2 KV heads,
 * head_dim 16, 16 tokens per block), creates one "streaming" sequence
 * (n_sink=4, window=32) and one "full" sequence, and grows both by a prefill
 * of 20 tokens and then one decode token per step. K and V values are a
 * function of (layer, head, position, channel), so after every step it reads
 * every held token back through the block table and checks that each one
 * still holds exactly the values of its original position. At the end it
 * prints what the daemon holds. Exit status 0 iff every check passed.
 *
 *   kvstash-demo [--socket PATH] [--tokens N] [--quiet]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvstash.h"
#include "ops.h"

#define PREFILL 20
#define N_SINK 4
#define WINDOW 32

typedef struct demo_seq {
    const char *policy;
    uint64_t id;
    uint64_t epoch;
    int via_ptr; /* write with kvs_key_ptr/kvs_value_ptr instead of kvs_layer_write */
} demo_seq;

static int quiet;

/* The fp16 bit pattern stored for (layer, head, position, channel, K or V):
 * a hash, masked to a finite positive half (exponent <= 14). */
static uint16_t value_of(uint32_t layer, uint32_t head, uint32_t pos, uint32_t ch, int is_v)
{
    uint64_t x = ((uint64_t)layer << 48) ^ ((uint64_t)head << 40) ^ ((uint64_t)pos << 8) ^
                 ((uint64_t)ch << 1) ^ (uint64_t)is_v;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return (uint16_t)(x & 0x3bff);
}

static int api_fail(kvs_session *s, const char *what, int rc)
{
    fprintf(stderr, "kvstash-demo: %s failed: %s (%s)\n", what, kvs_session_error(s),
            kvs_strerror(rc));
    return rc;
}

/* Write the new tokens described by `w` (positions w->first_position..). */
static void write_tokens(kvs_session *s, const demo_seq *q, const kvs_table *w)
{
    const kvs_geometry *g = kvs_session_geometry(s);
    for (uint32_t l = 0; l < w->layers; l++) {
        const kvs_layer *ly = &w->layer[l];
        if (q->via_ptr) {
            uint32_t t = 0;
            for (size_t i = 0; i < ly->nsegments; i++) {
                const kvs_segment *sg = &ly->segments[i];
                for (uint32_t j = 0; j < sg->count; j++, t++)
                    for (uint32_t h = 0; h < g->kv_heads; h++) {
                        /* Rows are device addresses: fill them through the
                         * backend's copy, as a GPU worker's kernel would. */
                        uint16_t k[64], v[64];
                        for (uint32_t c = 0; c < g->head_dim; c++) {
                            k[c] = value_of(l, h, w->first_position + t, c, 0);
                            v[c] = value_of(l, h, w->first_position + t, c, 1);
                        }
                        const kv_ops *ops = kvs_session_ops(s);
                        size_t row = g->head_dim * sizeof *k;
                        ops->copy(KV_HOST_TO_DEVICE,
                                  kvs_key_ptr(s, sg->block, h, sg->first_slot + j), k, row);
                        ops->copy(KV_HOST_TO_DEVICE,
                                  kvs_value_ptr(s, sg->block, h, sg->first_slot + j), v, row);
                    }
            }
            continue;
        }
        size_t n = (size_t)g->kv_heads * ly->tokens * g->head_dim;
        uint16_t *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
        if (k == NULL || v == NULL) {
            fprintf(stderr, "kvstash-demo: out of memory\n");
            exit(2);
        }
        for (uint32_t h = 0; h < g->kv_heads; h++)
            for (uint32_t t = 0; t < ly->tokens; t++)
                for (uint32_t c = 0; c < g->head_dim; c++) {
                    size_t i = ((size_t)h * ly->tokens + t) * g->head_dim + c;
                    k[i] = value_of(l, h, w->first_position + t, c, 0);
                    v[i] = value_of(l, h, w->first_position + t, c, 1);
                }
        kvs_layer_write(s, ly, k, v);
        free(k);
        free(v);
    }
}

/* Check one layer's held tokens; returns the number of mismatches. */
static int verify_layer(kvs_session *s, const demo_seq *q, uint32_t l, const kvs_layer *ly,
                        uint32_t appended)
{
    const kvs_geometry *g = kvs_session_geometry(s);
    int bad = 0;
    for (uint32_t t = 0; t < ly->tokens; t++) {
        uint32_t p = ly->positions[t];
        if (p >= appended || (t > 0 && p <= ly->positions[t - 1])) {
            printf("MISMATCH seq %" PRIu64 " layer %" PRIu32 ": token %" PRIu32
                   " has position %" PRIu32 " (out of order or never appended)\n",
                   q->id, l, t, p);
            return 1;
        }
    }
    if (strcmp(q->policy, "full") == 0 && ly->tokens != appended) {
        printf("MISMATCH seq %" PRIu64 " layer %" PRIu32 ": full holds %" PRIu32 " tokens, %" PRIu32
               " were appended\n",
               q->id, l, ly->tokens, appended);
        bad++;
    }
    if (strcmp(q->policy, "streaming") == 0) {
        uint32_t sinks = appended < N_SINK ? appended : N_SINK;
        for (uint32_t t = 0; t < sinks; t++)
            if (t >= ly->tokens || ly->positions[t] != t) {
                printf("MISMATCH seq %" PRIu64 " layer %" PRIu32 ": sink %" PRIu32 " is not held\n",
                       q->id, l, t);
                return bad + 1;
            }
        if (ly->tokens == 0 || ly->positions[ly->tokens - 1] != appended - 1) {
            printf("MISMATCH seq %" PRIu64 " layer %" PRIu32 ": newest token %" PRIu32
                   " is not held\n",
                   q->id, l, appended - 1);
            bad++;
        }
    }
    size_t n = (size_t)g->kv_heads * ly->tokens * g->head_dim;
    uint16_t *k = malloc(n * sizeof *k + 1), *v = malloc(n * sizeof *v + 1);
    if (k == NULL || v == NULL) {
        fprintf(stderr, "kvstash-demo: out of memory\n");
        exit(2);
    }
    kvs_layer_read(s, ly, k, v);
    for (uint32_t h = 0; h < g->kv_heads && bad < 10; h++)
        for (uint32_t t = 0; t < ly->tokens && bad < 10; t++)
            for (uint32_t c = 0; c < g->head_dim; c++) {
                size_t i = ((size_t)h * ly->tokens + t) * g->head_dim + c;
                uint32_t p = ly->positions[t];
                uint16_t ek = value_of(l, h, p, c, 0), ev = value_of(l, h, p, c, 1);
                if (k[i] != ek || v[i] != ev) {
                    printf("MISMATCH seq %" PRIu64 " layer %" PRIu32 " head %" PRIu32
                           " position %" PRIu32 " channel %" PRIu32
                           ": K %04x V %04x, expected K %04x V %04x\n",
                           q->id, l, h, p, c, k[i], v[i], ek, ev);
                    bad++;
                    break;
                }
            }
    free(k);
    free(v);
    return bad;
}

/* Distinct blocks in a layer's table. */
static uint32_t layer_blocks(const kvs_layer *ly)
{
    uint32_t n = 0;
    for (size_t i = 0; i < ly->nsegments; i++) {
        size_t j = 0;
        while (j < i && ly->segments[j].block != ly->segments[i].block)
            j++;
        n += j == i;
    }
    return n;
}

/* Print positions as ranges: "0-3, 68-99". */
static void print_positions(const kvs_layer *ly)
{
    for (uint32_t t = 0; t < ly->tokens;) {
        uint32_t u = t;
        while (u + 1 < ly->tokens && ly->positions[u + 1] == ly->positions[u] + 1)
            u++;
        printf("%s%" PRIu32, t ? ", " : "", ly->positions[t]);
        if (u > t)
            printf("-%" PRIu32, ly->positions[u]);
        t = u + 1;
    }
}

/* Read the whole table back and check it. *bad counts mismatches; returns
 * 0 or an API error. With `show`, print what the daemon holds. */
static int verify_seq(kvs_session *s, demo_seq *q, uint32_t appended, int show, int *bad,
                      uint64_t *checked)
{
    kvs_table t;
    int rc = kvs_seq_table(s, q->id, 1, &t);
    if (rc != KVS_OK)
        return api_fail(s, "kvs_seq_table", rc);
    q->epoch = t.epoch;
    uint32_t blocks = 0;
    for (uint32_t l = 0; l < t.layers; l++) {
        *bad += verify_layer(s, q, l, &t.layer[l], appended);
        *checked += t.layer[l].tokens;
        blocks += layer_blocks(&t.layer[l]);
    }
    if (show) {
        printf("  seq %" PRIu64 " (%s): epoch %" PRIu64 ", %" PRIu32 " appended, tokens per layer",
               q->id, q->policy, t.epoch, appended);
        for (uint32_t l = 0; l < t.layers; l++)
            printf(" %" PRIu32, t.layer[l].tokens);
        printf(", %" PRIu32 " blocks\n    positions held (layer 0): ", blocks);
        print_positions(&t.layer[0]);
        printf("\n");
    }
    kvs_table_free(&t);
    return KVS_OK;
}

/* Print the pool's block counts from Stats. */
static int show_pool(const char *socket_path, uint64_t pool_id)
{
    char err[512], *text;
    int rc = kvs_stats_json(socket_path, &text, err, sizeof err);
    if (rc != KVS_OK) {
        fprintf(stderr, "kvstash-demo: Stats failed: %s\n", err);
        return rc;
    }
    json_t *st = json_loads(text, 0, NULL);
    free(text);
    size_t i;
    json_t *p;
    json_array_foreach(json_object_get(st, "pools"), i, p)
    {
        if ((uint64_t)json_integer_value(json_object_get(p, "pool_id")) != pool_id)
            continue;
        printf("  pool %" PRIu64 " \"%s\": %" JSON_INTEGER_FORMAT " blocks, %" JSON_INTEGER_FORMAT
               " free, %" JSON_INTEGER_FORMAT " used, %" JSON_INTEGER_FORMAT " retired\n",
               pool_id, json_string_value(json_object_get(p, "model")),
               json_integer_value(json_object_get(p, "blocks_total")),
               json_integer_value(json_object_get(p, "blocks_free")),
               json_integer_value(json_object_get(p, "blocks_used")),
               json_integer_value(json_object_get(p, "blocks_retired")));
    }
    json_decref(st);
    return KVS_OK;
}

static int run(const char *socket_path, uint32_t tokens)
{
    kvs_geometry g = {.layers = 4,
                      .q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 16,
                      .block_tokens = 16,
                      .dtype = KVS_FP16,
                      .rope_theta = 0};
    char err[512];
    kvs_session *s;
    int rc = kvs_session_attach(socket_path, "demo", &g, "kvstash-demo", &s, err, sizeof err);
    if (rc != KVS_OK) {
        fprintf(stderr, "kvstash-demo: attach failed: %s (%s)\n", err, kvs_strerror(rc));
        return 2;
    }
    printf("attached: session %" PRIu64 ", pool %" PRIu64 " (%zu bytes, %" PRIu32
           " blocks of %zu bytes)\n",
           kvs_session_id(s), kvs_session_pool_id(s), kvs_session_pool_bytes(s),
           kvs_session_block_count(s), kvs_session_block_bytes(s));

    demo_seq seqs[2] = {{.policy = "streaming", .via_ptr = 0}, {.policy = "full", .via_ptr = 1}};
    const kvs_param stream_params[] = {{"n_sink", "4"}, {"window", "32"}};
    for (int i = 0; i < 2; i++) {
        int st = i == 0;
        rc = kvs_seq_create(s, seqs[i].policy, st ? stream_params : NULL, st ? 2 : 0,
                            st ? "demo streaming" : "demo full", &seqs[i].id);
        if (rc != KVS_OK) {
            api_fail(s, "kvs_seq_create", rc);
            kvs_session_detach(s);
            return 2;
        }
        printf("created seq %" PRIu64 ": policy %s%s\n", seqs[i].id, seqs[i].policy,
               st ? " (n_sink=4, window=32)" : "");
    }

    int bad = 0;
    uint64_t checked = 0;
    uint32_t appended = 0;
    for (int step = 1; appended < tokens && bad == 0; step++) {
        uint32_t n = step == 1 ? (tokens < PREFILL ? tokens : PREFILL) : 1;
        for (int i = 0; i < 2 && rc == KVS_OK; i++) {
            kvs_table w;
            rc = kvs_seq_append(s, seqs[i].id, n, &w);
            if (rc != KVS_OK) {
                api_fail(s, "kvs_seq_append", rc);
                break;
            }
            if (w.first_position != appended) {
                printf("MISMATCH seq %" PRIu64 ": append starts at position %" PRIu32
                       ", expected %" PRIu32 "\n",
                       seqs[i].id, w.first_position, appended);
                bad++;
            }
            write_tokens(s, &seqs[i], &w);
            if (!quiet)
                printf("step %d: seq %" PRIu64 " (%s) +%" PRIu32 " tokens at %" PRIu32
                       ", epoch %" PRIu64 ", evicted %" PRIu32 "\n",
                       step, seqs[i].id, seqs[i].policy, n, w.first_position, w.epoch, w.evicted);
            kvs_table_free(&w);
        }
        if (rc != KVS_OK)
            break;
        appended += n;
        for (int i = 0; i < 2 && rc == KVS_OK; i++)
            rc = verify_seq(s, &seqs[i], appended, 0, &bad, &checked);
    }
    if (rc == KVS_OK) {
        printf("what kvstashd holds after %" PRIu32 " tokens:\n", appended);
        for (int i = 0; i < 2 && rc == KVS_OK; i++)
            rc = verify_seq(s, &seqs[i], appended, 1, &bad, &checked);
    }
    if (rc == KVS_OK)
        rc = show_pool(socket_path, kvs_session_pool_id(s));
    if (rc != KVS_OK) {
        kvs_session_detach(s);
        return 2;
    }
    rc = kvs_session_detach(s);
    if (rc != KVS_OK) {
        fprintf(stderr, "kvstash-demo: detach failed (%s)\n", kvs_strerror(rc));
        return 2;
    }
    if (bad > 0) {
        printf("FAILED: %d mismatch(es)\n", bad);
        return 1;
    }
    printf("all checks passed: %" PRIu64 " token rows verified\n", checked);
    return 0;
}

int main(int argc, char **argv)
{
    const char *socket_path = NULL;
    long tokens = 100;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
            socket_path = argv[++i];
        } else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            char *end;
            tokens = strtol(argv[++i], &end, 10);
            if (*end != '\0' || tokens < 1 || tokens > 1000000) {
                fprintf(stderr, "kvstash-demo: --tokens wants 1..1000000\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--quiet") == 0) {
            quiet = 1;
        } else if (strcmp(argv[i], "--help") == 0) {
            printf("usage: kvstash-demo [--socket PATH] [--tokens N] [--quiet]\n");
            return 0;
        } else {
            fprintf(stderr, "kvstash-demo: unknown argument %s (try --help)\n", argv[i]);
            return 2;
        }
    }
    if (socket_path == NULL)
        socket_path = kvs_default_socket();
    return run(socket_path, (uint32_t)tokens);
}
