/*
 * kvs_tier_worker.c - a worker that drives one sequence through the storage
 * tiers and checks what Revive gives back (issue 4, acceptance 3).
 *
 * It creates a `streaming` sequence with the given storage options (int8 or
 * demote, victims, sketch_buckets), appends --tokens tokens one at a time
 * with seeded fp16 K/V, and after every append reads back every held
 * token: full precision tokens must be the bytes written, INT8 tokens
 * within the bound max|channel| / 254 plus fp16 rounding, INT4 / INT2
 * tokens within half a step of their group (kernels.h "Low-bit tiers": a
 * K group is a channel over a block's tokens, a V group a token's 16
 * channels; the step is the group's range / 15 or / 3) plus fp16
 * rounding. It keeps its own count-sketch: a
 * token that leaves the table was offloaded by the daemon with the values it
 * held then (raw, or dequantised INT8), so the worker inserts exactly those,
 * in the same order (victims=int8 keeps them as INT8 instead, or at full
 * precision while fewer than an INT8 block wait). At the end it revives
 * every layer and checks each
 * position by the tier it came from: raw byte-exact, INT8 within the bound,
 * sketch equal to its own sketch's query (and, with --exact, to the bytes
 * written: no collisions). With --rounds N it then prints REVIVING and,
 * until N rounds are done or its stdin ends, appends one more token (a
 * step that demotes one) and revives and checks every layer again
 * (test_concurrent_workers runs it so beside workers that step); with
 * --on-input each of those rounds waits for a line on stdin first, and
 * prints ROUND N when its revives passed (test_remote_spill spills the
 * victims between rounds). Then a
 * range revive, the release of the scratch, and a second release that
 * must fail.
 *
 * stdout, last two lines: the daemon's Stats as JSON (taken while the
 * sequence lives), then {"ok":true,"seq":ID,"full":N,"int8":N,"int4":N,
 * "int2":N,"sketch":N,"max_int8_err":E,"max_lowbit_err":E} (revived tokens
 * by source tier, over layers; the largest errors seen).
 * Exit 0 ok, 1 mismatch, 2 API error, 3 usage.
 */
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"
#include "kvstash.h"
#include "sketch_hash.h"

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 16
#define BLOCK_TOKENS 8
#define DIM (KV_HEADS * HEAD_DIM)
#define ROWS 3

typedef struct opts {
    const char *socket, *int8, *demote;
    uint32_t tokens, buckets, window;
    uint32_t rounds; /* --rounds: at most this many more appends and revives */
    int exact;
    const char *victims; /* evict, sketch or int8 */
    int on_input;        /* --on-input: each round after the first waits for a line on stdin */
} opts;

typedef struct sketch {
    float *key, *value; /* [ROWS][buckets][DIM] */
    uint64_t seed;
} sketch;

static void fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvs_tier_worker: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    printf("{\"ok\":false}\n");
    exit(code);
}

/* The value written for (layer, kv head, position, channel, K or V): seeded,
 * in [-4, 4), rounded to fp16. */
static float written(uint32_t l, uint32_t h, uint32_t p, uint32_t c, int v)
{
    uint64_t x = kv_mix64(((uint64_t)l << 48) ^ ((uint64_t)h << 40) ^ ((uint64_t)p << 16) ^
                          ((uint64_t)c << 1) ^ (uint64_t)v);
    float f = (float)((double)(x >> 11) / 9007199254740992.0 * 8.0 - 4.0);
    uint8_t b[2];
    kv_elt_store(b, KV_FP16, f);
    return kv_elt_load(b, KV_FP16);
}

/* fp16 of [KV_HEADS][n][HEAD_DIM] element (h, i, c). */
static float at16(const uint8_t *a, uint32_t n, uint32_t h, uint32_t i, uint32_t c)
{
    return kv_elt_load(a + (((size_t)h * n + i) * HEAD_DIM + c) * 2, KV_FP16);
}

static void api(kvs_session *s, int rc, const char *what)
{
    if (rc != KVS_OK)
        fail(2, "%s: %s (%s)", what, kvs_strerror(rc), kvs_session_error(s));
}

/* The INT8 bound of (layer, head, channel): max |x| over every position
 * written so far / 254 (a group's max is at most that), plus fp16 rounding of
 * the dequantised value. */
static float int8_bound(uint32_t l, uint32_t h, uint32_t c, int v, uint32_t upto, float got)
{
    float m = 0;
    for (uint32_t p = 0; p < upto; p++)
        m = fmaxf(m, fabsf(written(l, h, p, c, v)));
    return m / 254.0f * 1.0001f + fabsf(got) * 0x1p-11f;
}

/* The INT4 / INT2 bound (levels L = 15 or 3) of (layer, head, position,
 * channel): half the step of its group, the step at most the group's range
 * / L rounded up in fp16; a K group's range is at most the channel's over
 * every position written so far, a V group's is the token's over its
 * channels (all 16: the default group of 32 is wider); plus fp16 rounding
 * of the dequantised value. */
static float lowbit_bound(uint32_t l, uint32_t h, uint32_t p, uint32_t c, int v, uint32_t upto,
                          float L, float got)
{
    float lo = INFINITY, hi = -INFINITY;
    for (uint32_t i = 0; i < (v ? HEAD_DIM : upto); i++) {
        float x = v ? written(l, h, p, i, 1) : written(l, h, i, c, 0);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    return (hi - lo) / L / 2 * (1.0f + 1.0f / 512) + fabsf(got) * 0x1p-11f + 1e-6f;
}

/* The bound of a value stored in `tier` (0: full precision, exact). */
static float tier_bound(uint32_t tier, uint32_t l, uint32_t h, uint32_t p, uint32_t c, int v,
                        uint32_t upto, float got)
{
    switch (tier) {
    case KVS_TIER_INT8:
        return int8_bound(l, h, c, v, upto, got);
    case KVS_TIER_INT4:
        return lowbit_bound(l, h, p, c, v, upto, 15, got);
    case KVS_TIER_INT2:
        return lowbit_bound(l, h, p, c, v, upto, 3, got);
    default:
        return 0;
    }
}

static double worst_lowbit; /* the largest INT4 / INT2 error seen */

/* Check a list's held tokens (k, v as read) and remember them in `seen`
 * ([pos][2][DIM] fp32: what the daemon holds for each position now). */
static double check_held(const kvs_layer *ly, const uint8_t *k, const uint8_t *v, float *seen,
                         uint32_t upto)
{
    double worst = 0;
    uint32_t t = 0;
    for (size_t s = 0; s < ly->nsegments; s++)
        for (uint32_t j = 0; j < ly->segments[s].count; j++, t++) {
            uint32_t p = ly->positions[t];
            for (uint32_t h = 0; h < KV_HEADS; h++)
                for (uint32_t c = 0; c < HEAD_DIM; c++)
                    for (int isv = 0; isv < 2; isv++) {
                        float got = at16(isv ? v : k, ly->tokens, h, t, c);
                        float want = written(ly->layer, h, p, c, isv);
                        float err = fabsf(got - want);
                        uint32_t tier = ly->segments[s].tier;
                        if (err > tier_bound(tier, ly->layer, h, p, c, isv, upto, got))
                            fail(1,
                                 "layer %u position %u (tier %u) head %u channel %u: %g, wrote %g",
                                 ly->layer, p, tier, h, c, got, want);
                        if (tier == KVS_TIER_INT8 && err > worst)
                            worst = err;
                        if (tier != KVS_TIER_INT8 && err > worst_lowbit)
                            worst_lowbit = err;
                        seen[((size_t)p * 2 + isv) * DIM + h * HEAD_DIM + c] = got;
                    }
        }
    return worst;
}

static void sketch_insert(sketch *sk, uint32_t buckets, uint32_t p, const float *kv)
{
    uint32_t hb[ROWS];
    int8_t g[ROWS];
    kv_sketch_hash(sk->seed, ROWS, buckets, p, hb, g);
    for (uint32_t r = 0; r < ROWS; r++)
        for (uint32_t c = 0; c < DIM; c++) {
            sk->key[((size_t)r * buckets + hb[r]) * DIM + c] += kv[c];
            sk->value[((size_t)r * buckets + hb[r]) * DIM + c] += (float)g[r] * kv[DIM + c];
        }
}

static float median3(float a, float b, float c)
{
    return fmaxf(fminf(a, b), fminf(fmaxf(a, b), c));
}

/* POLICIES.md §3.3 query of channel c (K, or V with its signs), as fp16. */
static float sketch_query(const sketch *sk, uint32_t buckets, uint32_t p, uint32_t c, int isv)
{
    uint32_t hb[ROWS];
    int8_t g[ROWS];
    kv_sketch_hash(sk->seed, ROWS, buckets, p, hb, g);
    float e[ROWS];
    for (uint32_t r = 0; r < ROWS; r++) {
        size_t at = ((size_t)r * buckets + hb[r]) * DIM + c;
        e[r] = isv ? (float)g[r] * sk->value[at] : sk->key[at];
    }
    uint8_t b[2];
    kv_elt_store(b, KV_FP16, median3(e[0], e[1], e[2]));
    return kv_elt_load(b, KV_FP16);
}

/* Positions that left the table since the last look were offloaded, in
 * position order, with the values the daemon held then. */
static void track_offloads(const kvs_layer *ly, uint8_t *held, float *seen, sketch *sk,
                           uint32_t buckets, uint32_t upto)
{
    uint8_t *now = calloc(upto + 1, 1);
    for (uint32_t t = 0; t < ly->tokens; t++)
        now[ly->positions[t]] = 1;
    for (uint32_t p = 0; p < upto; p++) {
        if (held[p] && !now[p] && sk != NULL)
            sketch_insert(sk, buckets, p, seen + (size_t)p * 2 * DIM);
        held[p] = now[p];
    }
    free(now);
}

static void write_token(kvs_session *s, const kvs_table *w, uint32_t p)
{
    for (uint32_t l = 0; l < w->layers; l++) {
        uint8_t k[KV_HEADS * HEAD_DIM * 2], v[KV_HEADS * HEAD_DIM * 2];
        for (uint32_t h = 0; h < KV_HEADS; h++)
            for (uint32_t c = 0; c < HEAD_DIM; c++) {
                kv_elt_store(k + (h * HEAD_DIM + c) * 2, KV_FP16, written(l, h, p, c, 0));
                kv_elt_store(v + (h * HEAD_DIM + c) * 2, KV_FP16, written(l, h, p, c, 1));
            }
        api(s, kvs_layer_write(s, &w->layer[l], k, v), "write");
    }
}

/* Revive a whole layer and check every position by its source tier,
 * counted in counts[tier] unless counts is NULL. */
static void check_revive(kvs_session *s, uint64_t seq, uint32_t l, uint32_t n, const opts *o,
                         sketch *sk, uint32_t counts[6], double *worst)
{
    kvs_revive r;
    api(s, kvs_seq_revive(s, seq, l, 0, 0, 0, 0, &r), "revive");
    const kvs_layer *ly = r.layer;
    if (ly->tokens != n)
        fail(1, "layer %u: revived %u positions of %u", l, ly->tokens, n);
    size_t bytes = (size_t)KV_HEADS * ly->tokens * HEAD_DIM * 2;
    uint8_t *k = malloc(bytes), *v = malloc(bytes);
    api(s, kvs_layer_read(s, ly, k, v), "read revived");
    for (uint32_t t = 0; t < ly->tokens; t++) {
        uint32_t p = ly->positions[t], tier = r.source_tier[t];
        if (p != t)
            fail(1, "layer %u: revived token %u has position %u", l, t, p);
        if (tier >= 6)
            fail(1, "layer %u: revived token %u has source tier %u", l, t, tier);
        if (counts != NULL)
            counts[tier]++;
        for (uint32_t h = 0; h < KV_HEADS; h++)
            for (uint32_t c = 0; c < HEAD_DIM; c++)
                for (int isv = 0; isv < 2; isv++) {
                    float got = at16(isv ? v : k, ly->tokens, h, t, c);
                    float want = written(l, h, p, c, isv);
                    float err = fabsf(got - want);
                    int bad = tier == KVS_TIER_SKETCH
                                  ? got != sketch_query(sk, o->buckets, p, h * HEAD_DIM + c, isv) ||
                                        (o->exact && err != 0)
                                  : err > tier_bound(tier, l, h, p, c, isv, n, got);
                    if (tier == KVS_TIER_INT8 && err > *worst)
                        *worst = err;
                    if (bad)
                        fail(1,
                             "revive layer %u position %u (from tier %u) head %u ch %u: %g, wrote "
                             "%g",
                             l, p, tier, h, c, got, want);
                }
    }
    free(k);
    free(v);
    api(s, kvs_revive_release(s, &r), "release scratch");
}

static void check_range_and_release(kvs_session *s, uint64_t seq, uint32_t tokens)
{
    kvs_revive r;
    uint32_t first = tokens / 3, count = tokens / 4;
    api(s, kvs_seq_revive(s, seq, 1, 0, first, count, 0, &r), "range revive");
    if (r.layer->tokens != count || r.layer->positions[0] != first ||
        r.layer->positions[count - 1] != first + count - 1)
        fail(1, "range revive %u+%u gave %u tokens", first, count, r.layer->tokens);
    kvs_revive copy = r;
    api(s, kvs_revive_release(s, &r), "release");
    /* A second release names a scratch that is gone. */
    copy.table.layer = NULL;
    copy.source_tier = NULL;
    if (kvs_revive_release(s, &copy) != KVS_ERR_NOT_FOUND)
        fail(1, "releasing a scratch twice did not fail with NOT_FOUND");
    if (kvs_seq_revive(s, seq, 0, 0, tokens, 1, 0, &r) != KVS_ERR_INVALID)
        fail(1, "reviving past the end did not fail with INVALID_ARGUMENT");
}

static void parse(int argc, char **argv, opts *o)
{
    *o = (opts){NULL, "off", "off", 96, 4096, 16, 0, 0, "sketch", 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--exact") == 0 || strcmp(a, "--on-input") == 0) {
            *(a[2] == 'e' ? &o->exact : &o->on_input) = 1;
            continue;
        }
        if (v == NULL)
            fail(3, "%s needs a value", a);
        if (strcmp(a, "--socket") == 0)
            o->socket = v;
        else if (strcmp(a, "--int8") == 0)
            o->int8 = v;
        else if (strcmp(a, "--demote") == 0)
            o->demote = v;
        else if (strcmp(a, "--tokens") == 0)
            o->tokens = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--buckets") == 0)
            o->buckets = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--window") == 0)
            o->window = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--rounds") == 0)
            o->rounds = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--victims") == 0)
            o->victims = v;
        else
            fail(3, "unknown option %s", a);
        i++;
    }
}

/* One sequence and what the worker knows of it: per layer, what the daemon
 * holds for each position (seen) and whether the table holds it (held),
 * and its own sketch; room for cap positions. */
typedef struct run {
    kvs_session *s;
    uint64_t seq;
    const opts *o;
    uint32_t cap;
    sketch sk[LAYERS];
    float *seen[LAYERS];
    uint8_t *held[LAYERS];
    double worst;
} run;

/* Append position p, write it, and check every held token of every layer. */
static void append_checked(run *r, uint32_t p)
{
    kvs_table w, t;
    api(r->s, kvs_seq_append(r->s, r->seq, 1, &w), "append");
    write_token(r->s, &w, p);
    kvs_table_free(&w);
    api(r->s, kvs_seq_table(r->s, r->seq, 1, &t), "table");
    for (uint32_t l = 0; l < LAYERS; l++) {
        const kvs_layer *ly = &t.layer[l];
        track_offloads(ly, r->held[l], r->seen[l],
                       strcmp(r->o->victims, "sketch") == 0 ? &r->sk[l] : NULL, r->o->buckets,
                       p + 1);
        size_t bytes = (size_t)KV_HEADS * ly->tokens * HEAD_DIM * 2;
        uint8_t *k = malloc(bytes + 1), *v = malloc(bytes + 1);
        api(r->s, kvs_layer_read(r->s, ly, k, v), "read");
        double e = check_held(ly, k, v, r->seen[l], p + 1);
        r->worst = e > r->worst ? e : r->worst;
        free(k);
        free(v);
    }
    kvs_table_free(&t);
}

/* Whether stdin has ended: never waits, or with --on-input waits for a
 * line (a test that acts on the sequence between rounds). */
static int stdin_ended(const opts *o)
{
    if (o->on_input) {
        char line[64];
        return fgets(line, sizeof line, stdin) == NULL;
    }
    struct pollfd pf = {0, POLLIN, 0};
    char c;
    return poll(&pf, 1, 0) > 0 && ((pf.revents & POLLHUP) || read(0, &c, 1) <= 0);
}

/* Revive every layer (then, with --rounds, append and revive again): the
 * source tiers of the first round's tokens are counted. Returns the
 * positions appended in all. */
static uint32_t revive_rounds(run *r, uint32_t counts[6])
{
    uint32_t n = r->o->tokens;
    if (r->o->rounds > 0) {
        printf("REVIVING\n");
        fflush(stdout);
    }
    for (uint32_t round = 0; round <= r->o->rounds; round++) {
        if (round > 0) {
            if (stdin_ended(r->o))
                break;
            append_checked(r, n++);
        }
        uint32_t by[6] = {0};
        for (uint32_t l = 0; l < LAYERS; l++)
            check_revive(r->s, r->seq, l, n, r->o, &r->sk[l], round == 0 ? counts : by, &r->worst);
        if (r->o->on_input) {
            const uint32_t *c = round ? by : counts;
            printf("ROUND %u seq=%" PRIu64 " int8=%u sketch=%u full=%u\n", round, r->seq,
                   c[KVS_TIER_INT8], c[KVS_TIER_SKETCH], c[KVS_TIER_FULL]);
            fflush(stdout);
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    kvs_geometry g = {LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS, KVS_FP16, 0};
    run r = {.o = &o, .cap = o.tokens + o.rounds};
    char err[512];
    if (kvs_session_attach(o.socket, "tiers", &g, "kvs_tier_worker", &r.s, err, sizeof err) != 0)
        fail(2, "attach: %s", err);
    kvs_session *s = r.s;
    char win[16], buckets[16];
    snprintf(win, sizeof win, "%u", o.window);
    snprintf(buckets, sizeof buckets, "%u", o.buckets);
    kvs_param params[] = {{"n_sink", "4"},      {"window", win},
                          {"int8", o.int8},     {"demote", o.demote},
                          {"int8_window", "8"}, {"victims", o.victims},
                          {"sketch_rows", "3"}, {"sketch_buckets", buckets}};
    api(s, kvs_seq_create(s, "streaming", params, 8, "tiers", &r.seq), "create");
    for (uint32_t l = 0; l < LAYERS; l++) {
        r.sk[l] = (sketch){calloc((size_t)ROWS * o.buckets * DIM, sizeof(float)),
                           calloc((size_t)ROWS * o.buckets * DIM, sizeof(float)),
                           kv_sketch_layer_seed(0, l)};
        r.seen[l] = calloc((size_t)r.cap * 2 * DIM, sizeof(float));
        r.held[l] = calloc(r.cap, 1);
    }
    for (uint32_t p = 0; p < o.tokens; p++)
        append_checked(&r, p);
    uint32_t counts[6] = {0};
    if (strcmp(o.victims, "evict") != 0) {
        check_range_and_release(s, r.seq, revive_rounds(&r, counts));
    } else { /* victims dropped: Revive must say so, unless told to skip */
        kvs_revive rv;
        if (kvs_seq_revive(s, r.seq, 0, 0, 0, 0, 0, &rv) != KVS_ERR_PRECONDITION ||
            strstr(kvs_session_error(s), "evicted outright") == NULL)
            fail(1, "reviving evicted positions: %s", kvs_session_error(s));
        api(s, kvs_seq_revive(s, r.seq, 0, 0, 0, 0, KVS_REVIVE_SKIP_EVICTED, &rv),
            "revive skip_evicted");
        for (uint32_t t = 0; t < rv.layer->tokens; t++)
            counts[rv.source_tier[t]]++;
        api(s, kvs_revive_release(s, &rv), "release");
    }
    char *stats;
    if (kvs_stats_json(o.socket, &stats, err, sizeof err) != 0)
        fail(2, "stats: %s", err);
    printf("%s\n", stats);
    free(stats);
    printf("{\"ok\":true,\"seq\":%" PRIu64 ",\"full\":%u,\"int8\":%u,\"int4\":%u,"
           "\"int2\":%u,\"sketch\":%u,\"max_int8_err\":%.9g,\"max_lowbit_err\":%.9g}\n",
           r.seq, counts[KVS_TIER_FULL], counts[KVS_TIER_INT8], counts[KVS_TIER_INT4],
           counts[KVS_TIER_INT2], counts[KVS_TIER_SKETCH], r.worst, worst_lowbit);
    kvs_session_detach(s);
    for (uint32_t l = 0; l < LAYERS; l++) {
        free(r.sk[l].key);
        free(r.sk[l].value);
        free(r.seen[l]);
        free(r.held[l]);
    }
    return 0;
}
