/*
 * kvs_policy_worker.c - a worker that runs one policy through kvstashd's
 * per-step ring, for the end-to-end policy tests (issue 3, acceptance 3).
 *
 * It attaches, creates a sequence under --policy, and runs a prefill of
 * --prefill tokens then --steps decode steps. Each step appends tokens (ring
 * APPEND), writes their K/V, reports seeded random attention statistics
 * (ring STEP) and checks what the daemon holds afterwards: every held token's
 * K (and V, unless the policy merges values) must be the one written for its
 * original position. It writes every step, with the exact statistics sent,
 * as a `kvstash replay` trace (--trace FILE), so a test can replay the same
 * trace offline and compare what the policy kept.
 *
 * stdout, last lines: {"held": ...} in replay's format, then
 * {"ok":true,"steps":N,"max_list":M,"checked":C,"blocks":B,"block_slots":S}
 * (B: distinct blocks the final tables use; S: tokens a block holds). Exit 0 ok, 1 mismatch,
 * 2 API error, 3 usage.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstash.h"

#define MAX_PARAMS 32

typedef struct opts {
    const char *socket, *model, *policy, *trace;
    kvs_geometry geom;
    kvs_param params[MAX_PARAMS];
    size_t nparams;
    uint32_t prefill, steps;
    uint64_t seed;
    int score, last, window, window_prefill_only, vnorm, conf, verify_values;
    int rope; /* keys carry RoPE (rotate-half pairs, theta 10000) at their index */
} opts;

typedef struct worker {
    const opts *o;
    kvs_session *s;
    uint64_t seq;
    uint64_t rng;
    FILE *trace;
    uint32_t heads; /* lists per layer, from the tables */
    /* --rope: the RoPE position each list's key of position p carries now:
     * p when written, then moved by every re-rotation (rope_at[list][p]). */
    int32_t **rope_at;
    uint32_t rope_lists, rope_cap;
    uint64_t checked;
    uint64_t int8_checked, sketched; /* of the checked token rows: INT8, skipped in the sketch */
    uint64_t lossy;        /* rows skipped: brought back from the sketch, they hold its estimate */
    uint8_t *was_sketched; /* [list * positions + position]: seen in a sketch segment */
    /* [list * positions + position]: the INT8 block the token was last seen
     * in (UINT32_MAX: not INT8 then) and the INT8 quantisations seen */
    uint32_t *int8_block;
    uint8_t *int8_rounds;
    uint32_t positions;
    const kvs_layer *lists; /* the table being verified (list index = entry - lists) */
    uint32_t max_list;
} worker;

/* Report a failed check or error and exit with `code` (1 mismatch, 2 API, 3 usage). */
static void fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvs_policy_worker: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    printf("{\"ok\":false}\n");
    exit(code);
}

static void api(worker *w, int rc, const char *what)
{
    if (rc != KVS_OK)
        fail(2, "%s: %s (%s)", what, kvs_session_error(w->s), kvs_strerror(rc));
}

/* xorshift64*: seeded, so the daemon run and its trace are reproducible. */
static float rnd(worker *w)
{
    w->rng ^= w->rng >> 12;
    w->rng ^= w->rng << 25;
    w->rng ^= w->rng >> 27;
    uint64_t x = w->rng * 0x2545F4914F6CDD1Dull;
    return (float)((x >> 40) + 1) / 16777217.0f; /* (0, 1] */
}

/* The K or V value written for (layer, kv head, position, channel): exact in
 * every dtype (small integers and halves). */
static float kv_value(uint32_t l, uint32_t h, uint32_t pos, uint32_t c, int is_v)
{
    return (float)((l * 7 + h * 5 + pos * 3 + c + (uint32_t)is_v * 11) % 251) - 125.0f;
}

static void store_elt(uint8_t *p, kvs_dtype t, float v)
{
    if (t == KVS_FP32) {
        memcpy(p, &v, 4);
        return;
    }
    uint32_t x;
    memcpy(&x, &v, 4);
    uint16_t h;
    if (t == KVS_BF16) {
        h = (uint16_t)(x >> 16); /* integers below 256 are exact */
    } else {                     /* fp16: exact for integers below 2048 */
        uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, man = x & 0x7fffff;
        h = exp == 0 ? (uint16_t)sign : (uint16_t)(sign | ((exp - 112) << 10) | (man >> 13));
    }
    memcpy(p, &h, 2);
}

static size_t elt_size(kvs_dtype t)
{
    return t == KVS_FP32 ? 4 : 2;
}

/* The key of (layer, head, position) with RoPE for `at` applied, rotate-half
 * pairs (j, j + d/2), theta 10000: what a model would have cached. */
static float roped_key(uint32_t l, uint32_t h, uint32_t pos, uint32_t c, uint32_t d, uint32_t at)
{
    uint32_t j = c % (d / 2), mate = c < d / 2 ? c + d / 2 : c - d / 2;
    double angle = (double)at * pow(10000.0, -2.0 * j / d), cs = cos(angle), sn = sin(angle);
    double x = kv_value(l, h, pos, c, 0), y = kv_value(l, h, pos, mate, 0);
    return (float)(c < d / 2 ? x * cs - y * sn : y * sn + x * cs);
}

/* K/V of a list's tokens, [heads][n][d], from their positions; with rope_at,
 * keys carry RoPE at rope_at[i] (the position when written, the index in the
 * list after a re-rotation). */
static void fill(const kvs_geometry *g, const kvs_layer *ly, const uint32_t *rope_at, uint8_t *k,
                 uint8_t *v)
{
    uint32_t h0 = ly->per_head ? ly->head : 0, nh = ly->per_head ? 1 : g->kv_heads;
    size_t e = elt_size(g->dtype), row = (size_t)g->head_dim * e;
    for (uint32_t hh = 0; hh < nh; hh++)
        for (uint32_t i = 0; i < ly->tokens; i++)
            for (uint32_t c = 0; c < g->head_dim; c++) {
                size_t off = ((size_t)hh * ly->tokens + i) * row + c * e;
                float key = rope_at ? roped_key(ly->layer, h0 + hh, ly->positions[i], c,
                                                g->head_dim, rope_at[i])
                                    : kv_value(ly->layer, h0 + hh, ly->positions[i], c, 0);
                store_elt(k + off, g->dtype, key);
                store_elt(v + off, g->dtype, kv_value(ly->layer, h0 + hh, ly->positions[i], c, 1));
            }
}

static size_t list_bytes(const kvs_geometry *g, const kvs_layer *ly)
{
    return (size_t)(ly->per_head ? 1 : g->kv_heads) * ly->tokens * g->head_dim * elt_size(g->dtype);
}

static void write_new(worker *w, const kvs_table *t)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    for (uint32_t i = 0; i < t->layers; i++) {
        size_t n = list_bytes(g, &t->layer[i]);
        uint8_t *k = malloc(n + 1), *v = malloc(n + 1);
        if (k == NULL || v == NULL)
            fail(2, "out of memory");
        fill(g, &t->layer[i], w->o->rope ? t->layer[i].positions : NULL, k, v);
        kvs_layer_write(w->s, &t->layer[i], k, v);
        free(k);
        free(v);
    }
}

static int floats_close(const float *a, const float *b, size_t n, float tol)
{
    for (size_t i = 0; i < n; i++)
        if (fabsf(a[i] - b[i]) > tol)
            return 0;
    return 1;
}

/* --rope: after a step, a kept key that moved from index a to b of its list
 * was re-rotated by b - a (OpenVINO §2.8); new keys carry their position. */
static void rope_track(worker *w, const kvs_table *before, const kvs_table *after)
{
    if (!w->o->rope)
        return;
    if (w->rope_at == NULL) {
        w->rope_lists = after->layers;
        w->rope_cap = w->o->prefill + w->o->steps + 1;
        w->rope_at = calloc(w->rope_lists, sizeof *w->rope_at);
        for (uint32_t i = 0; i < w->rope_lists; i++) {
            w->rope_at[i] = malloc(w->rope_cap * sizeof **w->rope_at);
            for (uint32_t p = 0; p < w->rope_cap; p++)
                w->rope_at[i][p] = (int32_t)p;
        }
    }
    for (uint32_t i = 0; i < after->layers; i++) {
        const kvs_layer *a = &before->layer[i], *b = &after->layer[i];
        uint32_t x = 0;
        for (uint32_t j = 0; j < b->tokens; j++) {
            while (x < a->tokens && a->positions[x] != b->positions[j])
                x++;
            w->rope_at[i][b->positions[j]] += (int32_t)j - (int32_t)x;
        }
    }
}

/* The largest |K| (or |V|) of (layer, kv head, channel) over every position
 * up to `last`: a bound on the max of any INT8 group of that channel, whose
 * tokens may have been evicted since it was quantised. */
static float channel_max(uint32_t l, uint32_t h, uint32_t c, uint32_t last, int is_v)
{
    float m = 0;
    for (uint32_t p = 0; p <= last; p++)
        m = fmaxf(m, fabsf(kv_value(l, h, p, c, is_v)));
    return m;
}

/* Count the INT8 quantisations the tokens of segment sg (first token t of
 * list ly) went through: one more each time one is seen in an INT8 block it
 * was not in at the last step (demoted, or re-quantised by compaction,
 * POLICIES.md §5.4; the daemon quantises a token at most once a step). A
 * full-precision token that was INT8 holds its dequantised values (a
 * WeightedKV merge brings it back). Returns the largest count among them. */
static uint8_t int8_rounds_seen(worker *w, const kvs_layer *ly, uint32_t t, kvs_segment sg)
{
    size_t at = (size_t)(ly - w->lists) * w->positions;
    uint8_t most = 0;
    for (uint32_t j = 0; j < sg.count; j++) {
        uint32_t p = ly->positions[t + j];
        uint32_t now = sg.tier == KVS_TIER_INT8 ? sg.block : UINT32_MAX;
        if (now != UINT32_MAX && now != w->int8_block[at + p] && w->int8_rounds[at + p] < 255)
            w->int8_rounds[at + p]++;
        w->int8_block[at + p] = now;
        if (w->int8_rounds[at + p] > most)
            most = w->int8_rounds[at + p];
    }
    return most;
}

/* A list stored in several tiers, segment by segment: full-precision tokens
 * exact (keys within the re-rotation tolerance), INT8 tokens within the
 * quantisation bound max|group| / 254 per quantisation they went through
 * (channel_max bounds every group's max, and a re-quantised group's max is
 * at most the largest dequantised value), sketch tokens skipped (they are
 * checked through Revive by integration/test_tiers). fp32 pools only.
 * Returns 0 or -1. */
static int verify_tiered(worker *w, const kvs_layer *ly, const float *wk, const float *wv)
{
    const kvs_geometry *g = kvs_session_geometry(w->s);
    uint32_t nh = ly->per_head ? 1 : g->kv_heads, d = g->head_dim, t = 0;
    uint32_t h0 = ly->per_head ? ly->head : 0, last = ly->positions[ly->tokens - 1];
    if (g->dtype != KVS_FP32)
        fail(3, "tiered lists are verified in fp32 pools only");
    for (size_t i = 0; i < ly->nsegments; t += ly->segments[i++].count) {
        kvs_segment sg = ly->segments[i];
        uint8_t *seen = w->was_sketched + (size_t)(ly - w->lists) * w->positions;
        if (sg.tier == KVS_TIER_SKETCH) {
            for (uint32_t j = 0; j < sg.count; j++)
                seen[ly->positions[t + j]] = 1;
            w->sketched += sg.count;
            continue;
        }
        float rounds = (float)int8_rounds_seen(w, ly, t, sg);
        kvs_layer one = *ly;
        one.tokens = sg.count;
        one.nsegments = 1;
        one.segments = &sg;
        float *k = malloc((size_t)nh * sg.count * d * sizeof *k);
        float *v = malloc((size_t)nh * sg.count * d * sizeof *v);
        if (k == NULL || v == NULL || kvs_layer_read(w->s, &one, k, v) != 0)
            fail(2, "reading segment %zu of layer %u: %s", i, ly->layer, kvs_session_error(w->s));
        w->int8_checked += sg.tier == KVS_TIER_INT8 ? sg.count : 0;
        for (uint32_t hh = 0; hh < nh; hh++)
            for (uint32_t j = 0; j < sg.count; j++)
                for (uint32_t c = 0; c < d; c++) {
                    if (seen[ly->positions[t + j]]) { /* KVReviver's lossy swap back */
                        w->lossy += hh == 0 && c == 0;
                        continue;
                    }
                    size_t at = ((size_t)hh * ly->tokens + t + j) * d + c;
                    size_t got = ((size_t)hh * sg.count + j) * d + c;
                    float tk = w->o->rope ? 2e-3f : 0, tv = 0;
                    if (rounds > 0) {
                        tk +=
                            channel_max(ly->layer, h0 + hh, c, last, 0) / 254.0f * rounds * 1.0001f;
                        tv +=
                            channel_max(ly->layer, h0 + hh, c, last, 1) / 254.0f * rounds * 1.0001f;
                    }
                    if (fabsf(k[got] - wk[at]) > tk ||
                        (w->o->verify_values && fabsf(v[got] - wv[at]) > tv)) {
                        free(k);
                        free(v);
                        return -1;
                    }
                }
        free(k);
        free(v);
    }
    return 0;
}

/* Whether a list holds a token stored in another tier, or one that was
 * (int8_rounds_seen), so that verify_tiered must check it. */
static int list_tiered(const worker *w, const kvs_layer *ly)
{
    for (size_t i = 0; i < ly->nsegments; i++)
        if (ly->segments[i].tier != KVS_TIER_FULL)
            return 1;
    size_t at = (size_t)(ly - w->lists) * w->positions;
    for (uint32_t t = 0; t < ly->tokens; t++)
        if (w->int8_rounds[at + ly->positions[t]] > 0)
            return 1;
    return 0;
}

/* Every held token's K (and V) must be what was written for its position. */
static void verify(worker *w, const kvs_table *t)
{
    if (w->was_sketched == NULL) {
        w->positions = w->o->prefill + w->o->steps + 1;
        size_t n = (size_t)t->layers * w->positions;
        w->was_sketched = calloc(n, 1);
        w->int8_rounds = calloc(n, 1);
        w->int8_block = malloc(n * sizeof *w->int8_block);
        if (w->was_sketched == NULL || w->int8_rounds == NULL || w->int8_block == NULL)
            fail(2, "out of memory");
        memset(w->int8_block, 0xff, n * sizeof *w->int8_block);
    }
    w->lists = t->layer;
    const kvs_geometry *g = kvs_session_geometry(w->s);
    for (uint32_t i = 0; i < t->layers; i++) {
        const kvs_layer *ly = &t->layer[i];
        size_t n = list_bytes(g, ly);
        uint8_t *k = malloc(n + 1), *v = malloc(n + 1), *wk = malloc(n + 1), *wv = malloc(n + 1);
        if (!k || !v || !wk || !wv)
            fail(2, "out of memory");
        uint32_t *at = NULL;
        if (w->o->rope) {
            at = malloc((ly->tokens + 1) * sizeof *at);
            for (uint32_t j = 0; at != NULL && j < ly->tokens; j++)
                at[j] = (uint32_t)w->rope_at[i][ly->positions[j]];
        }
        fill(g, ly, at, wk, wv);
        free(at);
        int keys_ok = 1, values_ok = 1;
        if (list_tiered(w, ly)) {
            keys_ok = verify_tiered(w, ly, (const float *)wk, (const float *)wv) == 0;
        } else {
            kvs_layer_read(w->s, ly, k, v);
            keys_ok = w->o->rope ? floats_close((float *)k, (float *)wk, n / 4, 2e-3f)
                                 : memcmp(k, wk, n) == 0;
            values_ok = !w->o->verify_values || memcmp(v, wv, n) == 0;
        }
        if (!keys_ok || !values_ok)
            fail(1, "MISMATCH layer %u head %u: held K/V differ from what was written", ly->layer,
                 ly->head);
        w->checked += ly->tokens;
        if (ly->tokens > w->max_list)
            w->max_list = ly->tokens;
        w->heads = t->heads;
        free(k);
        free(v);
        free(wk);
        free(wv);
    }
}

/* ---- statistics and the trace ------------------------------------------ */

typedef struct stats {
    float **score, **last, **window, **vnorm; /* NULL when not sent */
    uint32_t *tokens;
    double confidence;
} stats;

static float **rows_new(uint32_t nrows)
{
    float **r = calloc(nrows, sizeof *r);
    if (r == NULL)
        fail(2, "out of memory");
    return r;
}

/* A probability row: positive values summing to 1, like softmax output. */
static void attention_row(worker *w, float *row, uint32_t n)
{
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += row[i] = rnd(w);
    for (uint32_t i = 0; i < n; i++)
        row[i] = (float)(row[i] / sum);
}

static float **gen(worker *w, const kvs_table *t, uint32_t rows_per_layer, uint32_t per_list,
                   int softmax)
{
    uint32_t L = kvs_session_geometry(w->s)->layers;
    float **r = rows_new(L * rows_per_layer);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < rows_per_layer; h++) {
            uint32_t n = t->layer[l * t->heads + (t->heads > 1 ? h / per_list : 0)].tokens;
            float *row = r[l * rows_per_layer + h] = malloc((n ? n : 1) * sizeof *row);
            if (row == NULL)
                fail(2, "out of memory");
            if (softmax)
                attention_row(w, row, n);
            else
                for (uint32_t i = 0; i < n; i++)
                    row[i] = rnd(w) * 4.0f;
        }
    return r;
}

static void rows_free(float **r, uint32_t n)
{
    for (uint32_t i = 0; r != NULL && i < n; i++)
        free(r[i]);
    free(r);
}

/* Floats printed so that they read back as the very same value. */
static void trace_rows(FILE *f, const char *key, float **r, uint32_t layers, uint32_t rows,
                       const kvs_table *t, uint32_t per_list, int nested)
{
    fprintf(f, ",\"%s\":[", key);
    for (uint32_t l = 0; l < layers; l++) {
        fprintf(f, "%s%s", l ? "," : "", nested ? "[" : "");
        for (uint32_t h = 0; h < rows; h++) {
            uint32_t n = t->layer[l * t->heads + (t->heads > 1 ? h / per_list : 0)].tokens;
            fprintf(f, "%s[", h ? "," : "");
            for (uint32_t i = 0; i < n; i++)
                fprintf(f, "%s%.17g", i ? "," : "", (double)r[l * rows + h][i]);
            fprintf(f, "]");
        }
        fprintf(f, "%s", nested ? "]" : "");
    }
    fprintf(f, "]");
}

static void trace_step(worker *w, const kvs_table *t, const stats *st, uint32_t n, int prefill)
{
    if (w->trace == NULL)
        return;
    const kvs_geometry *g = kvs_session_geometry(w->s);
    uint32_t q = g->q_heads, kv = g->kv_heads;
    fprintf(w->trace, "{\"step\":{\"new_tokens\":%u,\"prefill\":%s,\"score_queries\":1", n,
            prefill ? "true" : "false");
    if (st->score)
        trace_rows(w->trace, "score", st->score, g->layers, 1, t, 1, 0);
    if (st->last)
        trace_rows(w->trace, "last_attn", st->last, g->layers, q, t, q / kv, 1);
    if (st->window)
        trace_rows(w->trace, "window_attn", st->window, g->layers, q, t, q / kv, 1);
    if (st->vnorm)
        trace_rows(w->trace, "vnorm", st->vnorm, g->layers, kv, t, 1, 1);
    fprintf(w->trace, ",\"confidence\":%.17g}}\n", st->confidence);
}

static void one_step(worker *w, uint32_t n, int prefill)
{
    const opts *o = w->o;
    const kvs_geometry *g = kvs_session_geometry(w->s);
    uint32_t q = g->q_heads, kv = g->kv_heads, L = g->layers;
    kvs_table wr, t;
    api(w, kvs_seq_append(w->s, w->seq, n, &wr), "append");
    write_new(w, &wr);
    kvs_table_free(&wr);
    api(w, kvs_seq_table(w->s, w->seq, 1, &t), "table");
    stats st = {0};
    st.tokens = calloc(t.layers, sizeof *st.tokens);
    for (uint32_t i = 0; i < t.layers; i++)
        st.tokens[i] = t.layer[i].tokens;
    if (o->score && t.heads == 1)
        st.score = gen(w, &t, 1, 1, 0);
    if (o->last)
        st.last = gen(w, &t, q, q / kv, 1);
    if (o->window && (prefill || !o->window_prefill_only))
        st.window = gen(w, &t, q, q / kv, 1);
    if (o->vnorm)
        st.vnorm = gen(w, &t, kv, 1, 0);
    st.confidence = o->conf && !prefill ? rnd(w) : -1.0;
    kvs_step step = {.new_tokens = n,
                     .prefill = prefill,
                     .heads = t.heads,
                     .tokens = st.tokens,
                     .score = (const float *const *)st.score,
                     .score_queries = 1,
                     .last_attn = (const float *const *)st.last,
                     .window_attn = (const float *const *)st.window,
                     .vnorm = (const float *const *)st.vnorm,
                     .confidence = st.confidence};
    trace_step(w, &t, &st, n, prefill);
    kvs_step_result res;
    api(w, kvs_seq_step(w->s, w->seq, &step, &res), "step");
    rows_free(st.score, L);
    rows_free(st.last, L * q);
    rows_free(st.window, L * q);
    rows_free(st.vnorm, L * kv);
    free(st.tokens);
    kvs_table after;
    api(w, kvs_seq_table(w->s, w->seq, 1, &after), "table");
    rope_track(w, &t, &after);
    verify(w, &after);
    kvs_table_free(&t);
    kvs_table_free(&after);
}

/* Prints the held positions; returns the distinct blocks the tables use. */
static uint32_t print_held(worker *w)
{
    kvs_table t;
    api(w, kvs_seq_table(w->s, w->seq, 1, &t), "table");
    uint32_t blocks = 0;
    for (uint32_t i = 0; i < t.layers; i++)
        for (size_t j = 0; j < t.layer[i].nsegments; j++)
            blocks += t.layer[i].segments[j].tier != KVS_TIER_SKETCH &&
                      (j == 0 || t.layer[i].segments[j].block != t.layer[i].segments[j - 1].block);
    uint32_t L = kvs_session_geometry(w->s)->layers;
    printf("{\"held\":[");
    for (uint32_t l = 0; l < L; l++) {
        printf("%s%s", l ? "," : "", t.heads > 1 ? "[" : "");
        for (uint32_t k = 0; k < t.heads; k++) {
            const kvs_layer *ly = &t.layer[l * t.heads + k];
            printf("%s[", k ? "," : "");
            for (uint32_t i = 0; i < ly->tokens; i++)
                printf("%s%u", i ? "," : "", ly->positions[i]);
            printf("]");
        }
        printf("%s", t.heads > 1 ? "]" : "");
    }
    printf("]}\n");
    kvs_table_free(&t);
    return blocks;
}

/* ---- options ------------------------------------------------------------ */

static uint32_t num(const char *flag, const char *v)
{
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x > 1000000)
        fail(3, "%s needs a number, got '%s'", flag, v);
    return (uint32_t)x;
}

static void parse(int argc, char **argv, opts *o)
{
    *o = (opts){.model = "policy-e2e",
                .policy = "full",
                .geom = {2, 4, 2, 8, 4, KVS_FP32, 0},
                .prefill = 24,
                .steps = 40,
                .seed = 1,
                .verify_values = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--window-prefill-only") == 0) {
            o->window_prefill_only = 1;
            continue;
        }
        if (strcmp(a, "--no-verify-values") == 0) {
            o->verify_values = 0;
            continue;
        }
        if (strcmp(a, "--rope") == 0) { /* fp32 pools only */
            o->rope = 1;
            continue;
        }
        if (v == NULL)
            fail(3, "%s needs a value", a);
        i++;
        if (strcmp(a, "--socket") == 0)
            o->socket = v;
        else if (strcmp(a, "--model") == 0)
            o->model = v;
        else if (strcmp(a, "--policy") == 0)
            o->policy = v;
        else if (strcmp(a, "--trace") == 0)
            o->trace = v;
        else if (strcmp(a, "--layers") == 0)
            o->geom.layers = num(a, v);
        else if (strcmp(a, "--q-heads") == 0)
            o->geom.q_heads = num(a, v);
        else if (strcmp(a, "--kv-heads") == 0)
            o->geom.kv_heads = num(a, v);
        else if (strcmp(a, "--head-dim") == 0)
            o->geom.head_dim = num(a, v);
        else if (strcmp(a, "--block-tokens") == 0)
            o->geom.block_tokens = num(a, v);
        else if (strcmp(a, "--prefill") == 0)
            o->prefill = num(a, v);
        else if (strcmp(a, "--steps") == 0)
            o->steps = num(a, v);
        else if (strcmp(a, "--seed") == 0)
            o->seed = num(a, v);
        else if (strcmp(a, "--arrays") == 0) {
            o->score = strstr(v, "score") != NULL;
            o->last = strstr(v, "last") != NULL;
            o->window = strstr(v, "window") != NULL;
            o->vnorm = strstr(v, "vnorm") != NULL;
            o->conf = strstr(v, "conf") != NULL;
        } else if (strcmp(a, "--set") == 0) {
            char *eq = strchr(v, '=');
            if (eq == NULL || o->nparams == MAX_PARAMS)
                fail(3, "--set wants key=value");
            *eq = '\0';
            o->params[o->nparams++] = (kvs_param){v, eq + 1};
        } else
            fail(3, "unknown option %s", a);
    }
}

int main(int argc, char **argv)
{
    opts o;
    parse(argc, argv, &o);
    worker w = {.o = &o, .rng = o.seed * 0x9E3779B97F4A7C15ull + 1};
    char err[256];
    int rc = kvs_session_attach(o.socket, o.model, &o.geom, o.policy, &w.s, err, sizeof err);
    if (rc != KVS_OK)
        fail(2, "attach: %s", err);
    api(&w, kvs_seq_create(w.s, o.policy, o.params, o.nparams, "e2e", &w.seq), "create");
    if (o.trace != NULL && (w.trace = fopen(o.trace, "w")) == NULL)
        fail(2, "cannot write %s", o.trace);
    if (o.prefill > 0)
        one_step(&w, o.prefill, 1);
    for (uint32_t i = 0; i < o.steps; i++)
        one_step(&w, 1, 0);
    if (w.trace != NULL)
        fclose(w.trace);
    uint32_t blocks = print_held(&w);
    printf("{\"ok\":true,\"steps\":%u,\"max_list\":%u,\"checked\":%" PRIu64
           ",\"int8_checked\":%" PRIu64 ",\"sketched\":%" PRIu64 ",\"lossy\":%" PRIu64
           ",\"blocks\":%u,\"block_slots\":%u}\n",
           o.steps, w.max_list, w.checked, w.int8_checked, w.sketched, w.lossy, blocks,
           o.geom.block_tokens * (w.heads > 1 ? o.geom.kv_heads : 1));
    kvs_session_detach(w.s);
    for (uint32_t i = 0; i < w.rope_lists; i++)
        free(w.rope_at[i]);
    free(w.rope_at);
    free(w.was_sketched);
    free(w.int8_block);
    free(w.int8_rounds);
    return 0;
}
