/*
 * kvs_test_worker.c - a worker process for the integration and fault tests.
 *
 * It attaches to kvstashd, creates --sequences sequences under --policy,
 * appends --tokens tokens to each, --step tokens per append, and writes K/V
 * values that are a function of (seed, sequence index, layer, head, original
 * position, channel). It verifies through the block tables and positions
 * that every held token has exactly the values of its original position:
 * after every --verify-every appends, at the end, and (with --hold) at each
 * line on stdin and again after being told to finish. A token stored in
 * another tier (an operator's `kvstash demote / offload / revive`) is
 * checked by what the worker has seen happen to it (track_tiers): within
 * max|x| / 254 per INT8 quantisation it went through (fp32 pools only), and
 * not at all once it was in the sketch (a revived estimate is not the token)
 * or was quantised beside such an estimate. So a test that moves tokens has
 * the worker verify after each move.
 *
 * stdout, one line each, flushed (a test may kill the worker at any time):
 *   ATTACHED session=<id> pool=<id>
 *   POKED <byte>              (--poke) the first pool byte, read by pointer
 *   APPENDED <n>              n tokens are now appended to every sequence
 *   READY                     (--hold) writing is done; waiting for stdin EOF (when
 *                             stdin is a pipe, socket or tty) or SIGTERM/SIGINT
 *   VERIFIED checked=<rows> int8=<rows> sketch=<rows>
 *                             (--hold) a line on stdin made it verify: rows held,
 *                             of which stored INT8, and in the sketch (skipped)
 *   MISMATCH <details>        a held token has wrong values or position
 *   {"ok":true,"seq_ids":[...],"tokens":N,"checked":M}   the last line
 * On failure the last line is {"ok":false,...} with "error" (and "code" for
 * API errors). "checked" counts (sequence, layer, token) rows verified.
 *
 * --dev-io moves K/V through device buffers of the pool's backend
 * (kvs_layer_write_dev / kvs_layer_read_dev), staged with its ops: on the
 * shadow backend a host pointer there would abort, on cuda the copies run
 * device to device.
 *
 * Exit status: 0 success, 1 a mismatch, 2 an API error (the message of
 * kvs_session_error on stderr), 3 a usage error.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvstash.h"
#include "ops.h"

#define MAX_PARAMS 32
#define ROUNDS_LOST 255 /* worker.rounds: the values are gone (track_tiers) */

typedef struct opts {
    const char *socket, *model, *policy, *name, *label;
    kvs_geometry geom;
    kvs_param params[MAX_PARAMS];
    size_t nparams;
    uint64_t tokens, step, seed, sleep_ms, verify_every, sequences;
    int hold;
    int poke;   /* read the pool by pointer, bypassing the ops (test_shadow) */
    int dev_io; /* K/V through device buffers: kvs_layer_write_dev / _read_dev */
} opts;

/* The range of a channel's values over the positions appended, extended
 * as they grow: the INT8 and INT4 / INT2 bounds need it for every element
 * checked, and a pass over every position each time made a verify cost
 * tokens^2 (minutes for 4096 tokens). */
typedef struct channel_range {
    float lo, hi;
    uint64_t upto; /* positions [0, upto) are in lo..hi */
} channel_range;

typedef struct worker {
    const opts *o;
    kvs_session *s;
    uint64_t *seq_ids;
    uint64_t appended; /* tokens appended to every sequence */
    uint64_t checked;
    uint64_t int8_rows, sketch_rows; /* of checked: stored INT8, in the sketch */
    /* [sequences][layers][tokens]: the kvs_tier each position was stored in
     * at the last verify, the block of its INT8 slot then, and the INT8
     * quantisations seen (or ROUNDS_LOST) */
    uint8_t *last_tier, *rounds;
    uint8_t *coarsest; /* the coarsest quantised tier a position went through */
    uint32_t *last_block;
    /* [sequences][layers][kv_heads][head_dim][K, V] */
    channel_range *ranges;
    size_t elt;
} worker;

static void usage(FILE *f)
{
    fprintf(f, "usage: kvs_test_worker [--socket P] [--model M] [--layers L] [--kv-heads H]\n"
               "         [--q-heads Q] [--head-dim D] [--block-tokens B] [--dtype fp32|fp16|bf16]\n"
               "         [--policy NAME] [--set k=v]... [--tokens N] [--step S] [--seed X]\n"
               "         [--sleep-ms MS] [--verify-every K] [--hold] [--sequences N]\n"
               "         [--name WORKER] [--label TEXT] [--poke] [--dev-io]\n");
}

/* The final JSON line for a failure, then exit. */
__attribute__((noreturn, format(printf, 3, 4))) static void die(int code, int api_rc,
                                                                const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (code == 2)
        fprintf(stderr, "kvs_test_worker: %s\n", msg);
    /* JSON-escape the message the simple way: drop quotes and control bytes. */
    for (char *p = msg; *p; p++)
        if (*p == '"' || *p == '\\' || (unsigned char)*p < 0x20)
            *p = '\'';
    if (api_rc != 0)
        printf("{\"ok\":false,\"error\":\"%s\",\"code\":%d}\n", msg, api_rc);
    else
        printf("{\"ok\":false,\"error\":\"%s\"}\n", msg);
    fflush(stdout);
    exit(code);
}

static void api_die(worker *w, const char *what, int rc)
{
    die(2, rc, "%s: %s (%s)", what, w->s != NULL ? kvs_session_error(w->s) : "", kvs_strerror(rc));
}

static uint64_t parse_u64(const char *flag, const char *v, uint64_t min, uint64_t max)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (v[0] == '-' || *end != '\0' || errno != 0 || x < min || x > max) {
        fprintf(stderr, "kvs_test_worker: %s wants an integer in %" PRIu64 "..%" PRIu64 "\n", flag,
                min, max);
        exit(3);
    }
    return x;
}

static void parse(int argc, char **argv, opts *o)
{
    *o = (opts){.model = "test",
                .policy = "full",
                .name = "kvs_test_worker",
                .label = "",
                .geom = {.layers = 2,
                         .q_heads = 4,
                         .kv_heads = 2,
                         .head_dim = 8,
                         .block_tokens = 16,
                         .dtype = KVS_FP32},
                .tokens = 64,
                .step = 1,
                .seed = 1,
                .verify_every = 1,
                .sequences = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--hold") == 0) {
            o->hold = 1;
            continue;
        }
        if (strcmp(a, "--poke") == 0) {
            o->poke = 1;
            continue;
        }
        if (strcmp(a, "--dev-io") == 0) {
            o->dev_io = 1;
            continue;
        }
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvs_test_worker: %s needs a value\n", a);
            usage(stderr);
            exit(3);
        }
        const char *v = argv[++i];
        if (strcmp(a, "--socket") == 0)
            o->socket = v;
        else if (strcmp(a, "--model") == 0)
            o->model = v;
        else if (strcmp(a, "--policy") == 0)
            o->policy = v;
        else if (strcmp(a, "--name") == 0)
            o->name = v;
        else if (strcmp(a, "--label") == 0)
            o->label = v;
        else if (strcmp(a, "--layers") == 0)
            o->geom.layers = (uint32_t)parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--kv-heads") == 0)
            o->geom.kv_heads = (uint32_t)parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--q-heads") == 0)
            o->geom.q_heads = (uint32_t)parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--head-dim") == 0)
            o->geom.head_dim = (uint32_t)parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--block-tokens") == 0)
            o->geom.block_tokens = (uint32_t)parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--tokens") == 0)
            o->tokens = parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--step") == 0)
            o->step = parse_u64(a, v, 1, 65536);
        else if (strcmp(a, "--seed") == 0)
            o->seed = parse_u64(a, v, 0, UINT64_MAX);
        else if (strcmp(a, "--sleep-ms") == 0)
            o->sleep_ms = parse_u64(a, v, 0, 3600 * 1000);
        else if (strcmp(a, "--verify-every") == 0)
            o->verify_every = parse_u64(a, v, 0, UINT32_MAX);
        else if (strcmp(a, "--sequences") == 0)
            o->sequences = parse_u64(a, v, 1, 4096);
        else if (strcmp(a, "--dtype") == 0) {
            if (strcmp(v, "fp32") == 0)
                o->geom.dtype = KVS_FP32;
            else if (strcmp(v, "fp16") == 0)
                o->geom.dtype = KVS_FP16;
            else if (strcmp(v, "bf16") == 0)
                o->geom.dtype = KVS_BF16;
            else {
                fprintf(stderr, "kvs_test_worker: --dtype wants fp32, fp16 or bf16\n");
                exit(3);
            }
        } else if (strcmp(a, "--set") == 0) {
            char *eq = strchr(v, '=');
            if (eq == NULL || eq == v || o->nparams == MAX_PARAMS) {
                fprintf(stderr, "kvs_test_worker: --set wants key=value (at most %d)\n",
                        MAX_PARAMS);
                exit(3);
            }
            *eq = '\0';
            o->params[o->nparams++] = (kvs_param){v, eq + 1};
        } else {
            fprintf(stderr, "kvs_test_worker: unknown option %s\n", a);
            usage(stderr);
            exit(3);
        }
    }
}

/* splitmix64 */
static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/*
 * The bytes stored for one element. fp32: an integer below 2^24, exact as a
 * float. fp16/bf16: a finite positive bit pattern. Every input goes through
 * the hash so a token in the wrong slot, head, layer or sequence shows.
 */
static void value_of(const worker *w, uint64_t seq, uint32_t layer, uint32_t head, uint64_t pos,
                     uint32_t ch, int is_v, void *out)
{
    uint64_t h = mix(w->o->seed);
    h = mix(h ^ seq);
    h = mix(h ^ ((uint64_t)layer << 32 | head));
    h = mix(h ^ pos);
    h = mix(h ^ ((uint64_t)ch << 1 | (uint64_t)is_v));
    if (w->elt == 4) {
        float f = (float)(h & 0xffffff);
        memcpy(out, &f, 4);
    } else {
        uint16_t b = (uint16_t)(h & 0x3bff);
        memcpy(out, &b, 2);
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL)
        die(2, 0, "out of memory (%zu bytes)", n);
    return p;
}

/* Move one layer's K/V between host buffers k, v of `bytes` each and the
 * pool: with --dev-io through device buffers of the pool's backend
 * (kvs_layer_write_dev / kvs_layer_read_dev, staged with the backend's
 * ops), else kvs_layer_write / kvs_layer_read. Dies on an API error. */
static void layer_io(worker *w, const kvs_layer *ly, uint8_t *k, uint8_t *v, size_t bytes,
                     int to_pool)
{
    const char *what = to_pool ? "kvs_layer_write" : "kvs_layer_read";
    int rc;
    if (!w->o->dev_io) {
        rc = to_pool ? kvs_layer_write(w->s, ly, k, v) : kvs_layer_read(w->s, ly, k, v);
        if (rc != KVS_OK)
            api_die(w, what, rc);
        return;
    }
    const kv_ops *ops = kvs_session_ops(w->s);
    uint8_t *dk = ops->alloc(bytes ? bytes : 1), *dv = ops->alloc(bytes ? bytes : 1);
    if (dk == NULL || dv == NULL)
        die(2, 0, "%s: the %s backend could not allocate 2 x %zu bytes", what, ops->name, bytes);
    if (to_pool) {
        if (ops->copy(KV_HOST_TO_DEVICE, dk, k, bytes) ||
            ops->copy(KV_HOST_TO_DEVICE, dv, v, bytes))
            die(2, 0, "staging K/V on the %s backend failed", ops->name);
        rc = kvs_layer_write_dev(w->s, ly, dk, dv);
    } else {
        rc = kvs_layer_read_dev(w->s, ly, dk, dv);
        if (rc == KVS_OK && (ops->copy(KV_DEVICE_TO_HOST, k, dk, bytes) ||
                             ops->copy(KV_DEVICE_TO_HOST, v, dv, bytes)))
            die(2, 0, "copying K/V back from the %s backend failed", ops->name);
    }
    ops->free(dk);
    ops->free(dv);
    if (rc != KVS_OK)
        api_die(w, to_pool ? "kvs_layer_write_dev" : "kvs_layer_read_dev", rc);
}

/* Fill the new tokens of one sequence, as laid out by the append's table. */
static void write_tokens(worker *w, uint64_t seq, const kvs_table *t)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    for (uint32_t l = 0; l < t->layers; l++) {
        const kvs_layer *ly = &t->layer[l];
        size_t row = (size_t)g->head_dim * w->elt;
        size_t bytes = (size_t)g->kv_heads * ly->tokens * row;
        uint8_t *k = xmalloc(bytes), *v = xmalloc(bytes);
        for (uint32_t h = 0; h < g->kv_heads; h++)
            for (uint32_t i = 0; i < ly->tokens; i++)
                for (uint32_t c = 0; c < g->head_dim; c++) {
                    size_t off = ((size_t)h * ly->tokens + i) * row + c * w->elt;
                    value_of(w, seq, l, h, (uint64_t)t->first_position + i, c, 0, k + off);
                    value_of(w, seq, l, h, (uint64_t)t->first_position + i, c, 1, v + off);
                }
        layer_io(w, ly, k, v, bytes, 1);
        free(k);
        free(v);
    }
}

/* Channel c's range in (sequence si, layer l, head h), K or V. */
static const channel_range *range_of(worker *w, uint64_t si, uint32_t l, uint32_t h, uint32_t c,
                                     int is_v)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    channel_range *r =
        &w->ranges[(((si * g->layers + l) * g->kv_heads + h) * g->head_dim + c) * 2 + (is_v != 0)];
    for (float x; r->upto < w->appended; r->upto++) {
        value_of(w, si, l, h, r->upto, c, is_v, &x);
        r->lo = r->upto == 0 || x < r->lo ? x : r->lo;
        r->hi = r->upto == 0 || x > r->hi ? x : r->hi;
    }
    return r;
}

/* Bound of `rounds` INT8 round trips of channel c of (sequence si, layer
 * l, head h): s / 2 = max|group| / 254 each (kernels.h), the group some of
 * the positions appended; a margin for the fp32 rounding of code * scale
 * and for a requantised group's max, grown by the errors before. */
static float int8_bound(worker *w, uint64_t si, uint32_t l, uint32_t h, uint32_t c, int is_v,
                        uint8_t rounds)
{
    const channel_range *r = range_of(w, si, l, h, c, is_v);
    float m = r->hi > -r->lo ? r->hi : -r->lo;
    return m / 254.0f * (float)rounds * (1.0f + (float)rounds / 100.0f);
}

/* Bound of `rounds` INT4 / INT2 round trips (L = 15 or 3 levels) of
 * channel c of position p: half a group's step, the step at most its range
 * / L rounded up in fp16 (kernels.h "Low-bit tiers"); a K group is the
 * channel over some of the positions appended, a V group some channels of
 * the token (within its whole row's range); the margin as int8_bound's. */
static float lowbit_bound(worker *w, uint64_t si, uint32_t l, uint32_t h, uint64_t p, uint32_t c,
                          int is_v, uint8_t rounds, float levels)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    float lo = 0, hi = 0, x;
    if (is_v) {
        for (uint32_t i = 0; i < g->head_dim; i++) {
            value_of(w, si, l, h, p, i, 1, &x);
            lo = i == 0 || x < lo ? x : lo;
            hi = i == 0 || x > hi ? x : hi;
        }
    } else {
        const channel_range *r = range_of(w, si, l, h, c, 0);
        lo = r->lo;
        hi = r->hi;
    }
    float step = (hi - lo) / levels * (1.0f + 1.0f / 512);
    return step / 2 * (float)rounds * (1.0f + (float)rounds / 100.0f) + 1e-6f;
}

/* Whether a value read back is right: exact for a token never quantised,
 * within the bound of its round trips (as coarse as the coarsest tier it
 * went through) for one that was. */
static int value_ok(worker *w, uint64_t si, uint32_t l, uint32_t h, uint64_t p, uint32_t c,
                    int is_v, const uint8_t *got, const uint8_t *want, uint8_t rounds,
                    uint8_t coarsest)
{
    if (rounds == 0)
        return memcmp(got, want, w->elt) == 0;
    float g, x;
    memcpy(&g, got, 4);
    memcpy(&x, want, 4);
    float b = coarsest == KVS_TIER_INT2   ? lowbit_bound(w, si, l, h, p, c, is_v, rounds, 3)
              : coarsest == KVS_TIER_INT4 ? lowbit_bound(w, si, l, h, p, c, is_v, rounds, 15)
                                          : int8_bound(w, si, l, h, c, is_v, rounds);
    return g - x <= b && x - g <= b; /* (no libm in this worker) */
}

/* Quantised tiers from finest to coarsest: 0 for any other. */
static int coarseness(uint32_t tier)
{
    return tier == KVS_TIER_INT8 ? 1 : tier == KVS_TIER_INT4 ? 2 : tier == KVS_TIER_INT2 ? 3 : 0;
}

static void print_mismatch(uint64_t id, uint32_t l, uint32_t i, uint32_t p, uint32_t h, uint32_t c,
                           int is_v, const uint8_t *got, const uint8_t *want, size_t elt)
{
    uint32_t gw = 0, ww = 0;
    memcpy(&gw, got, elt);
    memcpy(&ww, want, elt);
    printf("MISMATCH seq=%" PRIu64 " layer=%" PRIu32 " token=%" PRIu32 " position=%" PRIu32
           " head=%" PRIu32 " channel=%" PRIu32 " %s got=0x%08" PRIx32 " want=0x%08" PRIx32 "\n",
           id, l, i, p, h, c, is_v ? "V" : "K", gw, ww);
}

/* Positions in order and never beyond what was appended (and, for policy
 * full, every one of them). Returns mismatches. */
static int verify_positions(const worker *w, uint64_t id, uint32_t l, const kvs_layer *ly)
{
    int full = strcmp(w->o->policy, "full") == 0;
    if (full && ly->tokens != w->appended) {
        printf("MISMATCH seq=%" PRIu64 " layer=%" PRIu32 " tokens=%" PRIu32 " appended=%" PRIu64
               " (policy full keeps every token)\n",
               id, l, ly->tokens, w->appended);
        return 1;
    }
    for (uint32_t i = 0; i < ly->tokens; i++) {
        uint32_t p = ly->positions[i];
        if (p >= w->appended || (i > 0 && p <= ly->positions[i - 1]) || (full && p != i)) {
            printf("MISMATCH seq=%" PRIu64 " layer=%" PRIu32 " token=%" PRIu32 " position=%" PRIu32
                   " (out of order, or never appended: %" PRIu64 " appended)\n",
                   id, l, i, p, w->appended);
            return 1;
        }
    }
    return 0;
}

/* What happened to the tokens of a list since the last verify. One now in
 * the sketch loses its values for good (an estimate comes back); one now
 * quantised (INT8, INT4, INT2) that was not, or in another block than
 * before (re-quantised by compaction, POLICIES.md §5.4), went through one
 * more quantisation, whose error is bounded by the values of its group (a
 * scale per block and channel for INT8): if the list holds an estimate outside the sketch,
 * that may be in the block, and the token's values are lost too. The
 * daemon quantises a token at most once a step, and verify_now runs after
 * each operator move, so no round goes unseen. */
static void track_tiers(worker *w, uint64_t si, uint32_t l, const kvs_layer *ly)
{
    size_t at = (si * kvs_session_geometry(w->s)->layers + l) * w->o->tokens;
    uint8_t *last = w->last_tier + at, *rounds = w->rounds + at, *coarsest = w->coarsest + at;
    uint32_t *block = w->last_block + at;
    int estimates = 0;
    for (size_t s = 0, i = 0; s < ly->nsegments; i += ly->segments[s++].count)
        for (uint32_t j = 0; j < ly->segments[s].count; j++) {
            uint32_t p = ly->positions[i + j];
            if (ly->segments[s].tier == KVS_TIER_SKETCH)
                rounds[p] = ROUNDS_LOST;
            else
                estimates |= rounds[p] == ROUNDS_LOST;
        }
    for (size_t s = 0, i = 0; s < ly->nsegments; i += ly->segments[s++].count)
        for (uint32_t j = 0; j < ly->segments[s].count; j++) {
            uint32_t p = ly->positions[i + j], tier = ly->segments[s].tier;
            int again = last[p] != tier || block[p] != ly->segments[s].block;
            if (coarseness(tier) > 0 && again && rounds[p] != ROUNDS_LOST)
                rounds[p] = estimates || rounds[p] == ROUNDS_LOST - 1 ? ROUNDS_LOST : rounds[p] + 1;
            if (coarseness(tier) > coarseness(coarsest[p]))
                coarsest[p] = (uint8_t)tier;
            last[p] = (uint8_t)tier;
            block[p] = ly->segments[s].block;
        }
}

/* The tokens of one segment, first token t of the layer. Returns mismatches. */
static int verify_segment(worker *w, uint64_t si, uint64_t id, uint32_t l, const kvs_layer *ly,
                          uint32_t t, kvs_segment sg)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    const uint8_t *rounds = w->rounds + (si * g->layers + l) * w->o->tokens;
    w->int8_rows += sg.tier == KVS_TIER_INT8 ? sg.count : 0;
    if (sg.tier == KVS_TIER_SKETCH) { /* not readable in place */
        w->sketch_rows += sg.count;
        return 0;
    }
    kvs_layer one = *ly;
    one.tokens = sg.count;
    one.nsegments = 1;
    one.segments = &sg;
    one.positions = ly->positions + t;
    size_t row = (size_t)g->head_dim * w->elt, bytes = (size_t)g->kv_heads * sg.count * row;
    uint8_t *k = xmalloc(bytes), *v = xmalloc(bytes), want[8];
    layer_io(w, &one, k, v, bytes, 0);
    int bad = 0;
    for (uint32_t h = 0; h < g->kv_heads && !bad; h++)
        for (uint32_t j = 0; j < sg.count && !bad; j++) {
            uint32_t p = ly->positions[t + j];
            if (rounds[p] != 0 && w->elt != 4)
                die(3, 0, "tokens moved to INT8 or the sketch are verified in fp32 pools only");
            for (uint32_t c = 0; c < g->head_dim && rounds[p] != ROUNDS_LOST && !bad; c++)
                for (int kv = 0; kv < 2 && !bad; kv++) {
                    const uint8_t *got =
                        (kv ? v : k) + ((size_t)h * sg.count + j) * row + c * w->elt;
                    value_of(w, si, l, h, p, c, kv, want);
                    if (!value_ok(w, si, l, h, p, c, kv, got, want, rounds[p],
                                  w->coarsest[(si * g->layers + l) * w->o->tokens + p])) {
                        print_mismatch(id, l, t + j, p, h, c, kv, got, want, w->elt);
                        bad++;
                    }
                }
        }
    free(k);
    free(v);
    return bad;
}

/* Verify every held token of sequence index `si`; returns mismatches. */
static int verify_seq(worker *w, uint64_t si)
{
    uint64_t id = w->seq_ids[si];
    kvs_table t;
    int rc = kvs_seq_table(w->s, id, 1, &t);
    if (rc != KVS_OK)
        api_die(w, "kvs_seq_table", rc);
    int bad = 0;
    for (uint32_t l = 0; l < t.layers && bad == 0; l++) {
        const kvs_layer *ly = &t.layer[l];
        bad += verify_positions(w, id, l, ly);
        if (bad == 0)
            track_tiers(w, si, l, ly);
        uint32_t first = 0;
        for (size_t i = 0; i < ly->nsegments && bad == 0; first += ly->segments[i++].count)
            bad += verify_segment(w, si, id, l, ly, first, ly->segments[i]);
        w->checked += ly->tokens;
    }
    kvs_table_free(&t);
    fflush(stdout);
    return bad;
}

static void verify_all(worker *w)
{
    int bad = 0;
    for (uint64_t i = 0; i < w->o->sequences; i++)
        bad += verify_seq(w, i);
    if (bad > 0)
        die(1, 0, "%d mismatch(es) after %" PRIu64 " tokens", bad, w->appended);
}

static void sleep_ms(uint64_t ms)
{
    struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* A line on stdin while holding: verify now and say what was seen. */
static void verify_on_request(worker *w)
{
    uint64_t checked = w->checked, int8 = w->int8_rows, sketch = w->sketch_rows;
    verify_all(w);
    printf("VERIFIED checked=%" PRIu64 " int8=%" PRIu64 " sketch=%" PRIu64 "\n",
           w->checked - checked, w->int8_rows - int8, w->sketch_rows - sketch);
    fflush(stdout);
}

/* --hold: wait until stdin reaches EOF or a SIGTERM/SIGINT arrives (both
 * are blocked since start-up and read through a signalfd), verifying at each
 * line on stdin. Stdin counts only when it is a pipe, socket or terminal:
 * /dev/null or a file would end the wait at once, so then only the signal
 * does. */
static void hold(worker *w, const sigset_t *sigs)
{
    int sfd = signalfd(-1, sigs, SFD_CLOEXEC);
    if (sfd < 0)
        die(2, 0, "signalfd: %s", strerror(errno));
    struct stat st;
    int use_stdin =
        fstat(0, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) || isatty(0));
    struct pollfd pf[2] = {{.fd = use_stdin ? 0 : -1, .events = POLLIN},
                           {.fd = sfd, .events = POLLIN}};
    char buf[4096];
    for (;;) {
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            die(2, 0, "poll: %s", strerror(errno));
        }
        if (pf[1].revents)
            break;
        if (pf[0].revents) {
            ssize_t n = read(0, buf, sizeof buf);
            if (n <= 0)
                break;
            for (ssize_t i = 0; i < n; i++)
                if (buf[i] == '\n')
                    verify_on_request(w);
        }
    }
    close(sfd);
}

static void print_ok(const worker *w)
{
    printf("{\"ok\":true,\"seq_ids\":[");
    for (uint64_t i = 0; i < w->o->sequences; i++)
        printf("%s%" PRIu64, i ? "," : "", w->seq_ids[i]);
    printf("],\"tokens\":%" PRIu64 ",\"checked\":%" PRIu64 "}\n", w->appended, w->checked);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    worker w = {.o = &o, .elt = o.geom.dtype == KVS_FP32 ? 4 : 2};

    /* Block SIGTERM/SIGINT before anything starts threads, so --hold can
     * take them through a signalfd. Without --hold they keep killing us. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    if (o.hold)
        sigprocmask(SIG_BLOCK, &sigs, NULL);

    char err[512];
    int rc = kvs_session_attach(o.socket, o.model, &o.geom, o.name, &w.s, err, sizeof err);
    if (rc != KVS_OK)
        die(2, rc, "kvs_session_attach: %s (%s)", err, kvs_strerror(rc));
    printf("ATTACHED session=%" PRIu64 " pool=%" PRIu64 "\n", kvs_session_id(w.s),
           kvs_session_pool_id(w.s));
    fflush(stdout);
    if (o.poke) { /* what a worker must not do: faults on the shadow backend */
        const volatile uint8_t *pool = kvs_session_pool(w.s);
        printf("POKED %u\n", (unsigned)pool[0]);
        fflush(stdout);
    }

    w.seq_ids = xmalloc(o.sequences * sizeof *w.seq_ids);
    w.last_tier = calloc(o.sequences * o.geom.layers * o.tokens + 1, 1);
    w.rounds = calloc(o.sequences * o.geom.layers * o.tokens + 1, 1);
    w.coarsest = calloc(o.sequences * o.geom.layers * o.tokens + 1, 1);
    w.last_block = calloc(o.sequences * o.geom.layers * o.tokens + 1, sizeof *w.last_block);
    const kvs_geometry *sg = kvs_session_geometry(w.s);
    w.ranges = calloc(o.sequences * sg->layers * sg->kv_heads * sg->head_dim * 2, sizeof *w.ranges);
    if (w.last_tier == NULL || w.rounds == NULL || w.last_block == NULL || w.coarsest == NULL ||
        w.ranges == NULL)
        die(2, 0, "out of memory");
    for (uint64_t i = 0; i < o.sequences; i++) {
        rc = kvs_seq_create(w.s, o.policy, o.params, o.nparams, o.label, &w.seq_ids[i]);
        if (rc != KVS_OK)
            api_die(&w, "kvs_seq_create", rc);
    }

    for (uint64_t nappends = 1; w.appended < o.tokens; nappends++) {
        uint64_t n = o.tokens - w.appended < o.step ? o.tokens - w.appended : o.step;
        for (uint64_t i = 0; i < o.sequences; i++) {
            kvs_table t;
            rc = kvs_seq_append(w.s, w.seq_ids[i], (int64_t)n, &t);
            if (rc != KVS_OK)
                api_die(&w, "kvs_seq_append", rc);
            if (t.first_position != w.appended)
                die(1, 0,
                    "seq %" PRIu64 ": append starts at position %" PRIu32 ", expected %" PRIu64,
                    w.seq_ids[i], t.first_position, w.appended);
            write_tokens(&w, i, &t);
            kvs_table_free(&t);
        }
        w.appended += n;
        printf("APPENDED %" PRIu64 "\n", w.appended);
        fflush(stdout);
        if (o.verify_every > 0 && nappends % o.verify_every == 0)
            verify_all(&w);
        if (o.sleep_ms > 0 && w.appended < o.tokens)
            sleep_ms(o.sleep_ms);
    }
    verify_all(&w);

    if (o.hold) {
        printf("READY\n");
        fflush(stdout);
        hold(&w, &sigs);
        verify_all(&w);
    }

    rc = kvs_session_detach(w.s);
    w.s = NULL;
    if (rc != KVS_OK)
        die(2, rc, "kvs_session_detach: %s", kvs_strerror(rc));
    print_ok(&w);
    free(w.seq_ids);
    free(w.last_tier);
    free(w.last_block);
    free(w.ranges);
    free(w.rounds);
    free(w.coarsest);
    return 0;
}
