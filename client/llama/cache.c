/*
 * cache.c - kvstash-llama's KV cache: kvstashd through libkvstash, or the
 * plain in-process reference (cache.h).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include <jansson.h>

#include "cache.h"
#include "confkv.h"
#include "kernels.h"
#include "ops.h"
#include "kvstash_step.h"
#include "policy.h"

/* One token list of a layer (or of one KV head of a layer), as the daemon's
 * table says: segments in order with their storage tier, and each token's
 * original position. */
typedef struct list {
    kv_segment *segs;
    uint8_t *tiers; /* [nsegs] kvs_tier */
    size_t nsegs, segs_cap;
    uint32_t *pos;
    uint32_t n, pos_cap;
    uint32_t sketched; /* tokens only in the daemon's sketch: revived for attention */
} list;

struct llm_cache {
    const llm_model *m;
    int plain;
    char err[512];
    uint32_t L, Q, KV, G, D, ctx;
    float scale;
    cache_usage usage;
    uint32_t pos;      /* the current token's position */
    uint32_t appended; /* tokens the sequence has appended (positions 0..appended-1) */

    /* plain: [layer][position][kv_dim] */
    float *pk, *pv, *att_scores;

    /* kvstashd */
    kvs_session *s;
    cache_opts o;
    const policy_ops *ops;
    policy_params params;
    unsigned needs;
    int have_seq;
    uint64_t seq, epoch;
    uint32_t heads; /* lists per layer: 1 or KV */
    list *lists;    /* [L * heads] */
    kvs_table held; /* the daemon's table, kept current: lists copy it */
    kvs_table writes;
    kv_layout lay, rows; /* the pool's layout, and a per-head list's row view */
    kv_dtype dtype;
    size_t elt;
    uint8_t *conv; /* k and v of one token in the pool's dtype */
    uint32_t *ids; /* scratch: one list's block ids (usage_now) */
    size_t ids_cap;
    /* statistics */
    float *probs;         /* [L][Q * ctx]: this query's attention, per list */
    const float **p_last; /* [L * Q] row pointers into probs */
    float *score;         /* [L][ctx] */
    const float **p_score;
    uint32_t window, wfill, wnext; /* observation window, queries held, next slot */
    float *whist;                  /* [L][Q][window][ctx] by position */
    float *wsum;                   /* [L][Q][ctx] by position */
    float *wout;                   /* [L][Q * ctx] per list, like probs */
    const float **p_window;
    float *vn;    /* [L][KV][ctx] by position */
    float *vnout; /* [L][KV][ctx] per list */
    const float **p_vnorm;
    uint32_t *tokens; /* [L * heads] */
    confkv_weights conf;
};

static int fail(llm_cache *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return -1;
}

const char *cache_error(const llm_cache *c)
{
    return c->err;
}

static llm_cache *cache_new(const llm_model *m)
{
    llm_cache *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->m = m;
    c->L = m->c.n_layers;
    c->Q = m->c.n_heads;
    c->KV = m->c.n_kv_heads;
    c->G = c->Q / c->KV;
    c->D = m->c.head_size;
    c->ctx = m->c.seq_len;
    c->scale = 1.0f / sqrtf((float)c->D);
    return c;
}

/* ---- the plain reference ------------------------------------------------- */

llm_cache *cache_plain(const llm_model *m)
{
    llm_cache *c = cache_new(m);
    if (c == NULL)
        return NULL;
    c->plain = 1;
    size_t n = (size_t)c->L * c->ctx * m->c.kv_dim;
    c->pk = malloc(n * sizeof(float));
    c->pv = malloc(n * sizeof(float));
    c->att_scores = malloc(c->ctx * sizeof(float));
    if (!c->pk || !c->pv || !c->att_scores) {
        cache_free(c);
        return NULL;
    }
    return c;
}

/* llama2.c's attention: scores, softmax, weighted sum, in float. */
static void plain_layer(llm_cache *c, uint32_t l, llm_state *st)
{
    uint32_t kvd = c->m->c.kv_dim, n = c->pos + 1;
    float *kl = c->pk + (size_t)l * c->ctx * kvd, *vl = c->pv + (size_t)l * c->ctx * kvd;
    memcpy(kl + (size_t)c->pos * kvd, st->k, kvd * sizeof(float));
    memcpy(vl + (size_t)c->pos * kvd, st->v, kvd * sizeof(float));
    for (uint32_t h = 0; h < c->Q; h++) {
        const float *q = st->q + (size_t)h * c->D;
        uint32_t off = (h / c->G) * c->D;
        float *a = c->att_scores, mx = -INFINITY, sum = 0.0f;
        for (uint32_t t = 0; t < n; t++) {
            const float *k = kl + (size_t)t * kvd + off;
            float dot = 0.0f;
            for (uint32_t i = 0; i < c->D; i++)
                dot += q[i] * k[i];
            a[t] = dot * c->scale;
            mx = a[t] > mx ? a[t] : mx;
        }
        for (uint32_t t = 0; t < n; t++)
            sum += a[t] = expf(a[t] - mx);
        float *o = st->att + (size_t)h * c->D;
        memset(o, 0, c->D * sizeof *o);
        for (uint32_t t = 0; t < n; t++) {
            const float *v = vl + (size_t)t * kvd + off;
            float p = a[t] / sum;
            for (uint32_t i = 0; i < c->D; i++)
                o[i] += p * v[i];
        }
    }
}

/* ---- kvstashd: setup ----------------------------------------------------- */

static int alloc_stats(llm_cache *c)
{
    size_t L = c->L, Q = c->Q, KV = c->KV, T = c->ctx;
    c->lists = calloc(L * c->heads, sizeof *c->lists);
    c->tokens = calloc(L * c->heads, sizeof *c->tokens);
    c->conv = malloc(2 * (size_t)KV * c->D * c->elt);
    c->probs = malloc(L * Q * T * sizeof(float));
    c->p_last = calloc(L * Q, sizeof *c->p_last);
    c->score = malloc(L * T * sizeof(float));
    c->p_score = calloc(L, sizeof *c->p_score);
    c->wout = malloc(L * Q * T * sizeof(float));
    c->p_window = calloc(L * Q, sizeof *c->p_window);
    c->vn = malloc(L * KV * T * sizeof(float));
    c->vnout = malloc(L * KV * T * sizeof(float));
    c->p_vnorm = calloc(L * KV, sizeof *c->p_vnorm);
    if (c->needs & POLICY_NEEDS_WINDOW_ATTN) {
        c->whist = calloc(L * Q * c->window * T, sizeof(float));
        c->wsum = calloc(L * Q * T, sizeof(float));
    }
    if (!c->lists || !c->tokens || !c->conv || !c->probs || !c->p_last || !c->score ||
        !c->p_score || !c->wout || !c->p_window || !c->vn || !c->vnout || !c->p_vnorm ||
        ((c->needs & POLICY_NEEDS_WINDOW_ATTN) && (!c->whist || !c->wsum)))
        return fail(c, "out of memory for the statistics of a %u-token context", c->ctx);
    return 0;
}

/* The policy's parameters as the daemon will resolve them: what the worker
 * needs to know (window, confidence weights) and an early, precise error. */
static int resolve_params(llm_cache *c)
{
    const char *keys[CACHE_MAX_PARAMS], *values[CACHE_MAX_PARAMS];
    char err[256];
    c->ops = policy_find(c->o.policy);
    if (c->ops == NULL)
        return fail(c, "unknown policy '%s' (kvstash policy list)", c->o.policy);
    /* Keys outside the policy's spec (a daemon-level setting such as the
     * INT8 tier) are for kvstashd to judge: resolve the others only. */
    size_t n = 0;
    for (size_t i = 0; i < c->o.nparams; i++)
        for (size_t k = 0; k < c->ops->nparams; k++)
            if (strcmp(c->ops->params[k].key, c->o.params[i].key) == 0) {
                keys[n] = c->o.params[i].key;
                values[n++] = c->o.params[i].value;
                break;
            }
    if (policy_params_resolve(c->ops, keys, values, n, &c->params, err, sizeof err))
        return fail(c, "%s", err);
    /* What a step sends: needs_alt where the policy has one (TOVA: the last
     * query's attention summed over the query heads, 1/Q of last_attn). */
    c->needs = c->ops->needs_alt != 0 ? c->ops->needs_alt : c->ops->needs;
    /* demote_keep grades precision by attention (policies/storage.h), which
     * the steps must carry even for a policy that needs none. */
    for (size_t i = 0; i < c->o.nparams; i++)
        if (strcmp(c->o.params[i].key, "demote_keep") == 0 &&
            strtod(c->o.params[i].value, NULL) > 0)
            c->needs |= c->ops->per_head ? POLICY_NEEDS_LAST_ATTN : POLICY_NEEDS_SCORE;
    c->heads = c->ops->per_head ? c->KV : 1;
    /* The SnapKV family's observation window (streaming's `window` is its
     * recent window, not this). More queries than the context cannot be. */
    c->window = 1;
    if ((c->needs & POLICY_NEEDS_WINDOW_ATTN) && policy_params_get(&c->params, "window") != NULL &&
        policy_params_uint(&c->params, "window", 1, 1u << 20, &c->window, err, sizeof err))
        return fail(c, "%s", err);
    if (c->window > c->ctx)
        c->window = c->ctx;
    /* The confidence's weights and margin mode are confkv's parameters
     * (the one policy that needs a confidence): its own parser reads them,
     * defaults and checks included. */
    if (c->needs & POLICY_NEEDS_CONFIDENCE) {
        confkv_config cc;
        if (confkv_config_parse(&c->params, &cc, err, sizeof err))
            return fail(c, "%s", err);
        c->conf = cc.weights;
    }
    return 0;
}

int cache_kvstash(const llm_model *m, const cache_opts *o, llm_cache **out, char *err,
                  size_t errlen)
{
    *out = NULL;
    llm_cache *c = cache_new(m);
    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    c->o = *o;
    c->dtype = (kv_dtype)o->dtype;
    c->elt = o->dtype == KVS_FP32 ? 4 : 2;
    c->lay = (kv_layout){c->KV, o->block_tokens, c->D, (uint32_t)c->elt, 0};
    c->rows = (kv_layout){1, o->block_tokens * c->KV, c->D, (uint32_t)c->elt, 0};
    if (resolve_params(c) != 0 || alloc_stats(c) != 0) {
        snprintf(err, errlen, "%s", c->err);
        cache_free(c);
        return -1;
    }
    kvs_geometry g = {c->L, c->Q, c->KV, c->D, o->block_tokens, o->dtype, 10000.0f};
    int rc = kvs_session_attach(o->socket, o->model_name, &g, "kvstash-llama", &c->s, err, errlen);
    if (rc != KVS_OK) {
        cache_free(c);
        return -1;
    }
    *out = c;
    return 0;
}

/* ---- kvstashd: the table --------------------------------------------------- */

static int list_reserve(llm_cache *c, list *ls, size_t segs, uint32_t toks)
{
    if (segs > ls->segs_cap) {
        size_t cap = segs * 2;
        kv_segment *p = realloc(ls->segs, cap * sizeof *p);
        if (p != NULL)
            ls->segs = p;
        uint8_t *t = p != NULL ? realloc(ls->tiers, cap) : NULL;
        if (t == NULL)
            return fail(c, "out of memory for a table");
        ls->tiers = t;
        ls->segs_cap = cap;
    }
    if (toks > ls->pos_cap) {
        uint32_t cap = toks * 2;
        uint32_t *p = realloc(ls->pos, cap * sizeof *p);
        if (p == NULL)
            return fail(c, "out of memory for a table");
        ls->pos = p;
        ls->pos_cap = cap;
    }
    return 0;
}

/* Make the lists what c->held says. */
static int lists_from_held(llm_cache *c)
{
    const kvs_table t = c->held;
    if (t.heads != c->heads || t.layers != c->L * c->heads)
        return fail(c, "the daemon's table has %u lists per layer; policy %s wants %u", t.heads,
                    c->o.policy, c->heads);
    for (uint32_t i = 0; i < t.layers; i++) {
        const kvs_layer *ly = &t.layer[i];
        list *ls = &c->lists[i];
        if (list_reserve(c, ls, ly->nsegments, ly->tokens) != 0)
            return -1;
        ls->sketched = 0;
        for (size_t k = 0; k < ly->nsegments; k++) {
            ls->segs[k] = (kv_segment){ly->segments[k].block, ly->segments[k].first_slot,
                                       ly->segments[k].count};
            ls->tiers[k] = (uint8_t)ly->segments[k].tier;
            ls->sketched += ly->segments[k].tier == KVS_TIER_SKETCH ? ly->segments[k].count : 0;
        }
        ls->nsegs = ly->nsegments;
        memcpy(ls->pos, ly->positions, ly->tokens * sizeof *ls->pos);
        ls->n = ly->tokens;
        /* the daemon's INT4 / INT2 group size (--quant-group): the
         * attention reads low-bit blocks with it */
        c->lay.quant_group = c->rows.quant_group = ly->quant_group;
    }
    c->epoch = t.epoch;
    return 0;
}

/* Replace the lists with the daemon's current table. */
static int table_reload(llm_cache *c)
{
    kvs_table_free(&c->held);
    if (kvs_seq_table(c->s, c->seq, 1, &c->held) != KVS_OK)
        return fail(c, "GetBlockTable: %s", kvs_session_error(c->s));
    return lists_from_held(c);
}

/* ---- sequences ------------------------------------------------------------- */

int cache_seq_begin(llm_cache *c, const char *label)
{
    c->usage = (cache_usage){0, 0, 0};
    c->pos = 0;
    c->appended = 0;
    if (c->plain)
        return 0;
    if (c->have_seq)
        return fail(c, "a sequence is already open");
    int rc = kvs_seq_create(c->s, c->o.policy, c->o.params, c->o.nparams, label, &c->seq);
    if (rc != KVS_OK)
        return fail(c, "CreateSequence: %s", kvs_session_error(c->s));
    c->have_seq = 1;
    for (uint32_t i = 0; i < c->L * c->heads; i++)
        c->lists[i].n = 0, c->lists[i].nsegs = 0;
    c->epoch = UINT64_MAX; /* unknown: the first append reads the table */
    c->wfill = c->wnext = 0;
    /* Both the sums and the queries they hold: a query of the previous
     * sequence left in whist would be subtracted from the new sums. */
    if (c->wsum != NULL) {
        memset(c->wsum, 0, (size_t)c->L * c->Q * c->ctx * sizeof(float));
        memset(c->whist, 0, (size_t)c->L * c->Q * c->window * c->ctx * sizeof(float));
    }
    return 0;
}

/* The policy the daemon's Stats name for the open sequence, into out
 * (empty when Stats did not answer). */
static void seq_policy(llm_cache *c, char *out, size_t len)
{
    out[0] = '\0';
    char *js = cache_seq_stats_json(c);
    if (js == NULL)
        return;
    json_t *seq = json_loads(js, 0, NULL);
    free(js);
    const char *p = json_string_value(json_object_get(seq, "policy"));
    snprintf(out, len, "%s", p ? p : "");
    json_decref(seq);
}

/* ---- worker state ---------------------------------------------------------- */

/*
 * The worker's statistics of a sequence that later steps read, in a file
 * beside the export (cache.h "The worker's own state"). Everything else the
 * steps carry is computed from the current query (score, last_attn,
 * confidence) or is the daemon's (the table, the policy's state).
 *
 * Format, version 1, every integer and float little-endian (floats as their
 * IEEE-754 binary32 bits, so they come back bit for bit):
 *
 *   offset  size  field
 *        0     8  magic "KVSLLWS\0"
 *        8     4  version = 1
 *       12     4  what it holds: bit 0 the observation window, bit 1 value norms
 *       16     4  L    layers              \
 *       20     4  Q    query heads          | the model's: checked on load
 *       24     4  KV   KV heads             |
 *       28     4  ctx  context (positions) /
 *       32     4  W    observation window (queries; 1 when bit 0 is clear)
 *       36     4  wfill  queries the window holds (0..W)
 *       40     4  wnext  the window's slot for the next query (0..W-1)
 *       44     4  n    tokens appended: rows below hold positions 0..n-1
 *       48    32  the export's uid (32 hex digits, no NUL)
 *       80    64  the policy's name, NUL-padded
 *      144    64  the pool's model name, NUL-padded
 *      208        bit 0: whist [L][Q][W][n] (each query's attention by
 *                 position), then wsum [L][Q][n] (their running sums: kept
 *                 as summed, not recomputed, whose rounding would differ)
 *                 bit 1: vn [L][KV][n] (each token's ‖V·W^O‖₁ by position)
 *    end-4     4  CRC-32 (zlib's crc32_z) of every byte before it
 *
 * Positions n.. hold nothing yet: zero in the window's arrays (a sequence
 * starts them zeroed and only held positions, all below n, are added), and
 * written before they are read in vn. The file's size is exactly what its
 * header implies.
 */
#define WS_MAGIC "KVSLLWS"
#define WS_VERSION 1u
#define WS_WINDOW 1u
#define WS_VNORM 2u
#define WS_NAME 64
#define WS_HEADER (48 + KVS_EXPORT_UID_LEN + 2 * WS_NAME)

static void put_u32(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(x >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The trailer's checksum of p[0..n). */
static uint32_t ws_crc(const uint8_t *p, size_t n)
{
    return (uint32_t)crc32_z(0L, p, n);
}

/* rows of `row` floats, `stride` apart, into p as binary32 bits; returns the end */
static uint8_t *put_rows(uint8_t *p, const float *x, size_t rows, size_t stride, size_t row)
{
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < row; i++, p += 4) {
            uint32_t u;
            memcpy(&u, &x[r * stride + i], 4);
            put_u32(p, u);
        }
    return p;
}

/* the inverse of put_rows, zeroing each row's positions row..stride-1 */
static const uint8_t *get_rows(const uint8_t *p, float *x, size_t rows, size_t stride, size_t row)
{
    for (size_t r = 0; r < rows; r++) {
        for (size_t i = 0; i < row; i++, p += 4) {
            uint32_t u = get_u32(p);
            memcpy(&x[r * stride + i], &u, 4);
        }
        memset(x + r * stride + row, 0, (stride - row) * sizeof *x);
    }
    return p;
}

static uint32_t ws_flags(const llm_cache *c)
{
    return (c->needs & POLICY_NEEDS_WINDOW_ATTN ? WS_WINDOW : 0) |
           (c->needs & POLICY_NEEDS_VNORM ? WS_VNORM : 0);
}

int cache_has_worker_state(const llm_cache *c)
{
    return !c->plain && ws_flags(c) != 0;
}

/* The file's size for this cache's dimensions, `flags` and n positions. */
static size_t ws_size(const llm_cache *c, uint32_t flags, uint32_t n)
{
    size_t L = c->L, Q = c->Q, size = WS_HEADER + 4;
    if (flags & WS_WINDOW)
        size += (L * Q * c->window + L * Q) * n * 4;
    if (flags & WS_VNORM)
        size += L * c->KV * n * 4;
    return size;
}

static void put_name(uint8_t *p, const char *s)
{
    memset(p, 0, WS_NAME);
    memcpy(p, s, strnlen(s, WS_NAME - 1));
}

/* Write the open sequence's worker state (export uid) to path, through
 * path.tmp and a rename: a reader sees the old file or the new one. */
static int ws_write(llm_cache *c, const char *uid, const char *path)
{
    uint32_t flags = ws_flags(c), n = c->appended;
    size_t size = ws_size(c, flags, n), LQ = (size_t)c->L * c->Q, T = c->ctx;
    size_t plen = strlen(path) + 5;
    uint8_t *buf = malloc(size);
    char *tmp = malloc(plen);
    if (buf == NULL || tmp == NULL) {
        free(buf);
        free(tmp);
        return fail(c, "out of memory for the worker state (%zu bytes)", size);
    }
    memcpy(buf, WS_MAGIC, 8);
    const uint32_t hdr[] = {WS_VERSION, flags,     c->L,     c->Q,     c->KV,
                            c->ctx,     c->window, c->wfill, c->wnext, n};
    for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++)
        put_u32(buf + 8 + 4 * i, hdr[i]);
    memcpy(buf + 48, uid, KVS_EXPORT_UID_LEN);
    put_name(buf + 48 + KVS_EXPORT_UID_LEN, c->o.policy);
    put_name(buf + 48 + KVS_EXPORT_UID_LEN + WS_NAME, c->o.model_name ? c->o.model_name : "");
    uint8_t *p = buf + WS_HEADER;
    if (flags & WS_WINDOW) {
        p = put_rows(p, c->whist, LQ * c->window, T, n);
        p = put_rows(p, c->wsum, LQ, T, n);
    }
    if (flags & WS_VNORM)
        p = put_rows(p, c->vn, (size_t)c->L * c->KV, T, n);
    put_u32(p, ws_crc(buf, size - 4));
    snprintf(tmp, plen, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    int ok = f != NULL && fwrite(buf, 1, size, f) == size;
    ok = f != NULL && fclose(f) == 0 && ok;
    ok = ok && rename(tmp, path) == 0;
    int e = errno;
    free(buf);
    if (!ok) {
        remove(tmp);
        free(tmp);
        return fail(c, "cannot write the worker state %s: %s", path, strerror(e));
    }
    free(tmp);
    return 0;
}

/* A worker state file read and checked (ws_read), not yet applied. */
typedef struct ws_file {
    uint8_t *buf;
    size_t len;
    uint32_t flags, wfill, wnext, n;
} ws_file;

static int ws_fail(llm_cache *c, ws_file *w, const char *path, const char *fmt, ...)
{
    char why[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    free(w->buf);
    w->buf = NULL;
    return fail(c, "worker state %s: %s", path, why);
}

/* Read path whole into w and check it is the worker state of export uid
 * for this cache (model, policy, window), intact. */
static int ws_read(llm_cache *c, const char *path, const char *uid, ws_file *w)
{
    memset(w, 0, sizeof *w);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return ws_fail(c, w, path,
                       "%s (policy %s's steps carry the worker's statistics of earlier tokens: "
                       "the export writes them there, beside the export file)",
                       strerror(errno), c->o.policy);
    size_t cap = 1 << 16;
    w->buf = malloc(cap);
    for (size_t got; w->buf != NULL && (got = fread(w->buf + w->len, 1, cap - w->len, f)) > 0;) {
        if ((w->len += got) == cap) {
            uint8_t *p = realloc(w->buf, cap *= 2);
            if (p == NULL)
                free(w->buf);
            w->buf = p;
        }
    }
    int rerr = ferror(f);
    fclose(f);
    if (w->buf == NULL)
        return ws_fail(c, w, path, "out of memory");
    if (rerr)
        return ws_fail(c, w, path, "read error");
    const uint8_t *b = w->buf;
    if (w->len < WS_HEADER + 4 || memcmp(b, WS_MAGIC, 8) != 0)
        return ws_fail(c, w, path, "not a kvstash-llama worker state file");
    if (get_u32(b + 8) != WS_VERSION)
        return ws_fail(c, w, path, "format version %u, this worker reads %u", get_u32(b + 8),
                       WS_VERSION);
    if (get_u32(b + w->len - 4) != ws_crc(b, w->len - 4))
        return ws_fail(c, w, path, "checksum mismatch (the file is corrupted or truncated)");
    char policy[WS_NAME], model[WS_NAME];
    snprintf(policy, sizeof policy, "%.*s", WS_NAME - 1, (const char *)b + 48 + KVS_EXPORT_UID_LEN);
    snprintf(model, sizeof model, "%.*s", WS_NAME - 1,
             (const char *)b + 48 + KVS_EXPORT_UID_LEN + WS_NAME);
    w->flags = get_u32(b + 12);
    uint32_t L = get_u32(b + 16), Q = get_u32(b + 20), KV = get_u32(b + 24), T = get_u32(b + 28),
             W = get_u32(b + 32);
    w->wfill = get_u32(b + 36);
    w->wnext = get_u32(b + 40);
    w->n = get_u32(b + 44);
    if (memcmp(b + 48, uid, KVS_EXPORT_UID_LEN) != 0)
        return ws_fail(c, w, path, "written for export %.*s, not %s", KVS_EXPORT_UID_LEN,
                       (const char *)b + 48, uid);
    if (strcmp(policy, c->o.policy) != 0 || w->flags != ws_flags(c))
        return ws_fail(c, w, path, "written for policy %s, not %s", policy, c->o.policy);
    const char *mine = c->o.model_name ? c->o.model_name : "";
    if (L != c->L || Q != c->Q || KV != c->KV || T != c->ctx || strncmp(model, mine, WS_NAME - 1))
        return ws_fail(c, w, path,
                       "written for model %s (%u layers, %u heads, %u KV heads, context %u), "
                       "not %s (%u, %u, %u, %u)",
                       model, L, Q, KV, T, mine, c->L, c->Q, c->KV, c->ctx);
    if (W != c->window)
        return ws_fail(c, w, path, "written for an observation window of %u queries, not %u", W,
                       c->window);
    if (w->n >= c->ctx || w->wfill > W || w->wnext >= W)
        return ws_fail(c, w, path, "n %u, wfill %u, wnext %u out of range", w->n, w->wfill,
                       w->wnext);
    size_t want = ws_size(c, w->flags, w->n);
    if (w->len != want)
        return ws_fail(c, w, path, "%zu bytes, its header says %zu", w->len, want);
    return 0;
}

/* Make w the open sequence's worker state; frees w's buffer. */
static void ws_apply(llm_cache *c, ws_file *w)
{
    size_t LQ = (size_t)c->L * c->Q, T = c->ctx;
    const uint8_t *p = w->buf + WS_HEADER;
    if (w->flags & WS_WINDOW) {
        p = get_rows(p, c->whist, LQ * c->window, T, w->n);
        p = get_rows(p, c->wsum, LQ, T, w->n);
        c->wfill = w->wfill;
        c->wnext = w->wnext;
    }
    if (w->flags & WS_VNORM)
        get_rows(p, c->vn, (size_t)c->L * c->KV, T, w->n);
    free(w->buf);
    w->buf = NULL;
}

/* ---- moving a sequence ------------------------------------------------------ */

int cache_seq_export(llm_cache *c, const char *worker_path, char uid[KVS_EXPORT_UID_LEN + 1])
{
    uid[0] = '\0';
    if (c->plain)
        return fail(c, "the in-process cache (--no-daemon) has no sequence to export");
    if (!c->have_seq)
        return fail(c, "no sequence is open to export");
    if (cache_has_worker_state(c) && worker_path == NULL)
        return fail(c, "policy %s's worker state needs a file to go to", c->o.policy);
    if (kvs_seq_export(c->s, c->seq, uid) != KVS_OK)
        return fail(c, "ExportSequence: %s", kvs_session_error(c->s));
    if (cache_has_worker_state(c))
        return ws_write(c, uid, worker_path);
    return 0;
}

int cache_seq_import(llm_cache *c, const char *uid, const char *worker_path, uint32_t *appended)
{
    *appended = 0;
    if (c->plain)
        return fail(c, "the in-process cache (--no-daemon) cannot import a sequence");
    if (c->have_seq)
        return fail(c, "a sequence is already open");
    /* window_attn is a mean over the last queries by position, vnorm is
     * computed as each token is written: the exporting worker's memory of
     * the tokens before the export, read back before anything is imported. */
    ws_file w = {0};
    if (cache_has_worker_state(c)) {
        if (worker_path == NULL)
            return fail(c,
                        "policy %s's steps carry the worker's statistics of earlier tokens: "
                        "importing needs the worker state the export wrote",
                        c->o.policy);
        if (ws_read(c, worker_path, uid, &w) != 0)
            return -1;
    }
    uint64_t seq, n;
    if (kvs_seq_import(c->s, uid, &seq, &n) != KVS_OK) {
        free(w.buf);
        return fail(c, "ImportSequence %s: %s", uid, kvs_session_error(c->s));
    }
    /* As cache_seq_begin, with the imported sequence. */
    c->seq = seq;
    c->have_seq = 1;
    c->usage = (cache_usage){0, 0, 0};
    c->pos = n > 0 ? (uint32_t)(n - 1) : 0; /* the last token appended */
    c->appended = n < c->ctx ? (uint32_t)n : c->ctx;
    c->wfill = c->wnext = 0;
    kvs_table_free(&c->writes);
    for (uint32_t i = 0; i < c->L * c->heads; i++)
        c->lists[i].n = 0, c->lists[i].nsegs = 0;
    c->epoch = UINT64_MAX;
    if (n >= c->ctx) {
        fail(c, "the imported sequence has %" PRIu64 " tokens; the model's context is %u", n,
             c->ctx);
        goto release;
    }
    char policy[64];
    seq_policy(c, policy, sizeof policy);
    if (policy[0] != '\0' && strcmp(policy, c->o.policy) != 0) {
        fail(c, "the imported sequence runs policy %s, not %s (--policy %s)", policy, c->o.policy,
             policy);
        goto release;
    }
    if (w.buf != NULL && w.n != n) {
        fail(c, "worker state %s: written at %u tokens, but the export has %" PRIu64, worker_path,
             w.n, n);
        goto release;
    }
    /* The lists, their positions and the epoch, as the daemon holds them
     * (also checks the lists per layer against the policy). */
    if (table_reload(c) != 0)
        goto release;
    if (w.buf != NULL)
        ws_apply(c, &w);
    *appended = (uint32_t)n;
    return 0;
release:
    free(w.buf);
    c->have_seq = 0;
    kvs_seq_release(c->s, c->seq); /* best effort: c->err keeps the reason */
    return -1;
}

int cache_seq_end(llm_cache *c)
{
    if (c->plain || !c->have_seq)
        return 0;
    c->have_seq = 0;
    kvs_table_free(&c->writes);
    kvs_table_free(&c->held);
    if (kvs_seq_release(c->s, c->seq) != KVS_OK)
        return fail(c, "ReleaseSequence: %s", kvs_session_error(c->s));
    return 0;
}

int cache_token_begin(llm_cache *c, uint32_t pos)
{
    if (pos >= c->ctx)
        return fail(c, "position %u is past the model's context (%u)", pos, c->ctx);
    c->pos = pos;
    if (c->plain)
        return 0;
    kvs_table_free(&c->writes);
    int rc = kvs_seq_append(c->s, c->seq, 1, &c->writes);
    if (rc != KVS_OK)
        return fail(c, "Append: %s", kvs_session_error(c->s));
    if (c->writes.heads != c->heads)
        return fail(c, "Append answered %u lists per layer, policy %s wants %u", c->writes.heads,
                    c->o.policy, c->heads);
    c->appended = pos + 1;
    c->usage.evicted += c->writes.evicted;
    /* An append is one epoch; anything more (a silent step evicted) means
     * the table changed under us: read it again. */
    if (c->epoch != UINT64_MAX && kvs_table_extend(&c->held, &c->writes) == KVS_OK)
        return lists_from_held(c);
    return table_reload(c);
}

/* ---- kvstashd: one layer --------------------------------------------------- */

/* k and v of KV heads [h0, h0 + nh) in the pool's dtype, into c->conv. */
static const uint8_t *to_pool_dtype(llm_cache *c, const float *x, uint32_t h0, uint32_t nh,
                                    int second)
{
    const float *src = x + (size_t)h0 * c->D;
    size_t n = (size_t)nh * c->D;
    if (c->dtype == KV_FP32)
        return (const uint8_t *)src;
    uint8_t *dst = c->conv + (second ? (size_t)c->KV * c->D * c->elt : 0);
    for (size_t i = 0; i < n; i++)
        kv_elt_store(dst + i * c->elt, c->dtype, src[i]);
    return dst;
}

/* ‖V·W^O‖₁ of the new token for every KV head (POLICIES.md §1.2), by
 * position; only depends on V and the static W^O, so once per token. The
 * kernel reads values from a block: the token's fp32 values go into the V
 * half of a one-slot block. */
static void vnorm_new(llm_cache *c, uint32_t l, const float *v)
{
    float o[256];
    size_t n = (size_t)c->KV * c->D;
    float *blk = c->KV <= 256 ? calloc(2 * n, sizeof *blk) : NULL;
    if (blk == NULL)
        return;
    memcpy(blk + n, v, n * sizeof *blk);
    kv_layout one = {c->KV, 1, c->D, 4, 0};
    kv_segment seg = {0, 0, 1};
    kv_vnorm_l1(&one, KV_FP32, (const uint8_t *)blk, &seg, 1, llm_wo(c->m, l), (size_t)c->Q * c->D,
                c->Q, c->m->c.dim, o);
    free(blk);
    for (uint32_t g = 0; g < c->KV; g++)
        c->vn[((size_t)l * c->KV + g) * c->ctx + c->pos] = o[g];
}

/*
 * Attention needs every token of a list, and sketch tokens cannot be read in
 * place: revive the positions the list keeps in the sketch (kvs_seq_revive,
 * into scratch blocks; the full-precision tokens between them stay where
 * they are, KVS_REVIVE_IN_PLACE), and point those tokens at their rebuilt
 * K/V. *out is the list's segments and tiers with sketch runs replaced;
 * release *rv after the attention. Lists without sketch tokens are used as
 * they are.
 */
static int list_resolve(llm_cache *c, uint32_t l, uint32_t head, const list *ls, list *out,
                        kvs_revive *rv)
{
    *out = *ls;
    memset(rv, 0, sizeof *rv);
    if (ls->sketched == 0)
        return 0;
    uint32_t lo = UINT32_MAX, hi = 0, t = 0;
    for (size_t k = 0; k < ls->nsegs; t += ls->segs[k++].count)
        if (ls->tiers[k] == KVS_TIER_SKETCH) {
            lo = ls->pos[t] < lo ? ls->pos[t] : lo;
            hi = ls->pos[t + ls->segs[k].count - 1];
        }
    if (kvs_seq_revive(c->s, c->seq, l, head, lo, hi - lo + 1,
                       KVS_REVIVE_SKIP_EVICTED | KVS_REVIVE_IN_PLACE, rv) != KVS_OK)
        return fail(c, "Revive: %s", kvs_session_error(c->s));
    out->segs = malloc((ls->nsegs + ls->sketched) * sizeof *out->segs);
    out->tiers = malloc(ls->nsegs + ls->sketched);
    if (out->segs == NULL || out->tiers == NULL) {
        free(out->segs);
        free(out->tiers);
        kvs_revive_release(c->s, rv);
        return fail(c, "out of memory for a revived list");
    }
    /* Revived tokens come in position order, like the list's. */
    const kvs_layer *r = rv->layer;
    size_t rs = 0, n = 0;
    uint32_t ri = 0, in_seg = 0;
    t = 0;
    for (size_t k = 0; k < ls->nsegs; t += ls->segs[k++].count) {
        if (ls->tiers[k] != KVS_TIER_SKETCH) {
            out->segs[n] = ls->segs[k];
            out->tiers[n++] = ls->tiers[k];
            continue;
        }
        for (uint32_t j = 0; j < ls->segs[k].count; j++) {
            while (ri < r->tokens && r->positions[ri] < ls->pos[t + j]) {
                ri++;
                if (++in_seg == r->segments[rs].count)
                    rs++, in_seg = 0;
            }
            out->segs[n] =
                (kv_segment){r->segments[rs].block, r->segments[rs].first_slot + in_seg, 1};
            out->tiers[n++] = KVS_TIER_FULL;
        }
    }
    out->nsegs = n;
    return 0;
}

static void list_resolved_free(llm_cache *c, const list *ls, list *out, kvs_revive *rv)
{
    if (out->segs == ls->segs)
        return;
    free(out->segs);
    free(out->tiers);
    kvs_revive_release(c->s, rv);
}

int cache_layer(llm_cache *c, uint32_t l, llm_state *st)
{
    if (c->plain) {
        plain_layer(c, l, st);
        return 0;
    }
    float *probs = c->probs + (size_t)l * c->Q * c->ctx;
    /* The pool is device memory of kvstashd's backend: attend through its ops. */
    uint8_t *pool = kvs_session_pool(c->s);
    const kv_ops *ops = kvs_session_ops(c->s);
    if (c->needs & POLICY_NEEDS_VNORM)
        vnorm_new(c, l, st->v);
    if (c->heads == 1) {
        const kvs_layer *w = &c->writes.layer[l];
        kvs_layer_write(c->s, w, to_pool_dtype(c, st->k, 0, c->KV, 0),
                        to_pool_dtype(c, st->v, 0, c->KV, 1));
        const list *ls = &c->lists[l];
        list use;
        kvs_revive rv;
        if (list_resolve(c, l, 0, ls, &use, &rv) != 0)
            return -1;
        int rc = ops->decode_attention(&c->lay, c->dtype, pool, use.segs, use.nsegs, use.tiers,
                                       st->q, c->Q, c->scale, st->att, probs);
        list_resolved_free(c, ls, &use, &rv);
        if (rc != 0)
            return -1;
        for (uint32_t h = 0; h < c->Q; h++)
            c->p_last[(size_t)l * c->Q + h] = probs + (size_t)h * ls->n;
        return 0;
    }
    size_t off = 0; /* per-head lists: the group's rows, list after list */
    for (uint32_t g = 0; g < c->KV; g++) {
        const kvs_layer *w = &c->writes.layer[l * c->heads + g];
        kvs_layer_write(c->s, w, to_pool_dtype(c, st->k, g, 1, 0),
                        to_pool_dtype(c, st->v, g, 1, 1));
        const list *ls = &c->lists[l * c->heads + g];
        size_t qo = (size_t)g * c->G * c->D;
        list use;
        kvs_revive rv;
        if (list_resolve(c, l, g, ls, &use, &rv) != 0)
            return -1;
        int rc = ops->decode_attention(&c->rows, c->dtype, pool, use.segs, use.nsegs, use.tiers,
                                       st->q + qo, c->G, c->scale, st->att + qo, probs + off);
        list_resolved_free(c, ls, &use, &rv);
        if (rc != 0)
            return -1;
        for (uint32_t j = 0; j < c->G; j++)
            c->p_last[(size_t)l * c->Q + g * c->G + j] = probs + off + (size_t)j * ls->n;
        off += (size_t)c->G * ls->n;
    }
    return 0;
}

/* ---- kvstashd: the step's statistics --------------------------------------- */

/* The list that row `row` of step array `kind` of layer l reads, as the
 * step layout defines it (proto/kvstash_step.h). */
static const list *list_of(const llm_cache *c, uint32_t l, unsigned kind, uint32_t row)
{
    step_shape sh = {c->L, c->Q, c->KV, c->heads, kind};
    return &c->lists[l * c->heads + step_row_list(&sh, kind, row)];
}

/* into: the step's rows in the ring (kvs_step_in_ring), or NULL for the
 * cache's own arrays; likewise stats_vnorm. */
static void stats_score(llm_cache *c, float *const *into)
{
    for (uint32_t l = 0; l < c->L; l++) {
        float *s = into != NULL ? into[l] : c->score + (size_t)l * c->ctx;
        uint32_t n = c->lists[l].n;
        for (uint32_t i = 0; i < n; i++) {
            float sum = 0.0f;
            for (uint32_t h = 0; h < c->Q; h++)
                sum += c->p_last[(size_t)l * c->Q + h][i];
            s[i] = sum;
        }
        c->p_score[l] = s;
    }
}

/* Fold this query into the window's running sums (dense by position), then
 * read the mean of the window's queries for every held token. */
static void stats_window(llm_cache *c, int send)
{
    size_t T = c->ctx, W = c->window;
    uint32_t slot = c->wnext;
    c->wnext = (c->wnext + 1) % c->window;
    if (c->wfill < c->window)
        c->wfill++;
    for (uint32_t l = 0; l < c->L; l++) {
        size_t off = 0;
        for (uint32_t h = 0; h < c->Q; h++) {
            size_t lh = (size_t)l * c->Q + h;
            float *hist = c->whist + (lh * W + slot) * T, *sum = c->wsum + lh * T;
            const list *ls = list_of(c, l, STEP_WINDOW_ATTN, h);
            for (size_t p = 0; p < T; p++) { /* the query leaving the window */
                sum[p] -= hist[p];
                hist[p] = 0.0f;
            }
            for (uint32_t i = 0; i < ls->n; i++) {
                hist[ls->pos[i]] = c->p_last[lh][i];
                sum[ls->pos[i]] += c->p_last[lh][i];
            }
            if (!send)
                continue;
            float *out = c->wout + (size_t)l * c->Q * T + off;
            for (uint32_t i = 0; i < ls->n; i++) {
                float m = sum[ls->pos[i]] / (float)c->wfill;
                out[i] = m > 0.0f ? m : 0.0f; /* running sums may drift below 0 */
            }
            c->p_window[lh] = out;
            off += ls->n;
        }
    }
}

static void stats_vnorm(llm_cache *c, float *const *into)
{
    for (uint32_t l = 0; l < c->L; l++)
        for (uint32_t g = 0; g < c->KV; g++) {
            const list *ls = list_of(c, l, STEP_VNORM, g);
            const float *vn = c->vn + ((size_t)l * c->KV + g) * c->ctx;
            float *out = into != NULL ? into[(size_t)l * c->KV + g]
                                      : c->vnout + ((size_t)l * c->KV + g) * c->ctx;
            for (uint32_t i = 0; i < ls->n; i++)
                out[i] = vn[ls->pos[i]];
            c->p_vnorm[(size_t)l * c->KV + g] = out;
        }
}

int cache_token_end(llm_cache *c, const cache_step *s)
{
    if (c->plain)
        return 0;
    if (c->needs & POLICY_NEEDS_WINDOW_ATTN)
        stats_window(c, !s->defer);
    if (s->defer)
        return 0;
    for (uint32_t i = 0; i < c->L * c->heads; i++)
        c->tokens[i] = c->lists[i].n;
    /* What is computed here goes straight into the step's rows in the ring
     * (no call to the daemon comes before the step); the query's attention
     * and the window's mean, made earlier, are copied there by the step. A
     * ring too small leaves them in the cache's arrays: the step says why. */
    kvs_step_rows rows = {0};
    if ((c->needs & (POLICY_NEEDS_SCORE | POLICY_NEEDS_VNORM)) &&
        kvs_step_in_ring(c->s, c->heads, c->tokens, c->needs & STEP_ARRAYS, &rows) != KVS_OK)
        rows = (kvs_step_rows){0};
    if (c->needs & POLICY_NEEDS_SCORE)
        stats_score(c, rows.score);
    if (c->needs & POLICY_NEEDS_VNORM)
        stats_vnorm(c, rows.vnorm);
    double conf = -1.0;
    if ((c->needs & POLICY_NEEDS_CONFIDENCE) && s->logits != NULL) {
        conf = confkv_confidence_logits(s->logits, c->m->c.vocab_size, &c->conf, NULL);
        if (!(conf >= 0.0 && conf <= 1.0))
            conf = -1.0;
    }
    kvs_step st = {
        .new_tokens = 0, /* every token appended since the last step */
        .prefill = s->prefill,
        .heads = c->heads,
        .tokens = c->tokens,
        .score = (c->needs & POLICY_NEEDS_SCORE) ? c->p_score : NULL,
        .score_queries = 1,
        .last_attn = (c->needs & POLICY_NEEDS_LAST_ATTN) ? c->p_last : NULL,
        .window_attn = (c->needs & POLICY_NEEDS_WINDOW_ATTN) ? c->p_window : NULL,
        .window_queries = 0, /* = the policy's window parameter */
        .vnorm = (c->needs & POLICY_NEEDS_VNORM) ? c->p_vnorm : NULL,
        .confidence = conf,
    };
    kvs_step_result res;
    if (kvs_seq_step(c->s, c->seq, &st, &res) != KVS_OK)
        return fail(c, "Step: %s", kvs_session_error(c->s));
    c->usage.evicted += res.evicted;
    /* Removing tokens was all the step did: cut them out of the held
     * table, as the daemon did, instead of reading it again. */
    if (res.cut_lists > 0 && kvs_table_cut(&c->held, &res) == KVS_OK)
        return lists_from_held(c);
    if (res.epoch != c->epoch)
        return table_reload(c);
    return 0;
}

/* ---- usage, stats, teardown ------------------------------------------------ */

/* Whether the sequence can hold bytes its table does not show: sketch cells
 * (a policy with its own sketch, or victims=sketch) and offloaded victims
 * (victims=sketch|int8, kept out of the lists). */
static int holds_beyond_table(const llm_cache *c)
{
    if (c->ops->sketch_geometry != NULL)
        return 1;
    for (size_t i = 0; i < c->o.nparams; i++)
        if (strcmp(c->o.params[i].key, "victims") == 0 && strcmp(c->o.params[i].value, "evict"))
            return 1;
    return 0;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Pool blocks list ls holds in tier `tier` (each counted once: a block's
 * segments need not be adjacent), with ids as scratch (room for nsegs). */
static uint64_t list_blocks(const list *ls, uint32_t tier, uint32_t *ids)
{
    size_t n = 0;
    for (size_t k = 0; k < ls->nsegs; k++)
        if (ls->tiers[k] == tier)
            ids[n++] = ls->segs[k].block;
    qsort(ids, n, sizeof *ids, cmp_u32);
    uint64_t distinct = 0;
    for (size_t i = 0; i < n; i++)
        distinct += i == 0 || ids[i] != ids[i - 1];
    return distinct;
}

/* The sequence's bytes by the daemon's own count (Stats: every tier's pool
 * blocks, sketch cells, offloaded victims), or -1 when Stats failed. */
static double daemon_bytes(llm_cache *c)
{
    char *js = cache_seq_stats_json(c);
    if (js == NULL)
        return -1;
    json_t *seq = json_loads(js, 0, NULL), *t;
    free(js);
    double bytes = 0;
    size_t i;
    json_array_foreach(json_object_get(seq, "tiers"), i, t)
    {
        json_t *b = json_object_get(t, "bytes");
        bytes += json_is_integer(b)  ? (double)json_integer_value(b)
                 : json_is_string(b) ? strtod(json_string_value(b), NULL)
                                     : 0;
    }
    json_decref(seq);
    return bytes;
}

/*
 * Held tokens and their bytes as stored (docs/quality/README.md "How bytes
 * are counted"): every pool block a list holds counts whole, partly filled
 * or not, full precision (the pool's dtype) or quantised (an INT8, INT4 or
 * INT2 block and its parameters fill one pool block: daemon/tier.h). Where the sequence can also
 * hold sketch cells or offloaded victims, which the table does not show,
 * the daemon's Stats count is taken instead (one gRPC call per token, so
 * only there). The plain cache holds fp32 arrays of every token.
 */
static void usage_now(llm_cache *c)
{
    uint64_t tokens = 0, blocks = 0;
    double bytes = 0;
    if (c->plain) {
        tokens = (uint64_t)(c->pos + 1) * c->L;
        bytes = (double)tokens * c->KV * 2 * c->D * sizeof(float);
    } else {
        for (uint32_t i = 0; i < c->L * c->heads; i++) {
            const list *ls = &c->lists[i];
            tokens += ls->n;
            if (ls->nsegs > c->ids_cap) {
                uint32_t *p = realloc(c->ids, ls->nsegs * 2 * sizeof *p);
                if (p == NULL)
                    continue; /* out of memory: the figure is low, the run goes on */
                c->ids = p;
                c->ids_cap = ls->nsegs * 2;
            }
            static const uint32_t in_pool[] = {KVS_TIER_FULL, KVS_TIER_INT8, KVS_TIER_INT4,
                                               KVS_TIER_INT2};
            for (size_t t = 0; t < sizeof in_pool / sizeof in_pool[0]; t++)
                blocks += list_blocks(ls, in_pool[t], c->ids);
        }
        bytes = (double)blocks * kv_block_bytes(&c->lay);
        double d = c->have_seq && holds_beyond_table(c) ? daemon_bytes(c) : -1;
        if (d >= 0)
            bytes = d;
    }
    c->usage.tokens = tokens;
    c->usage.bytes = (uint64_t)llround(bytes);
}

void cache_get_usage(const llm_cache *c, cache_usage *u)
{
    usage_now((llm_cache *)c);
    *u = c->usage;
}

char *cache_seq_stats_json(llm_cache *c)
{
    if (c->plain || !c->have_seq)
        return NULL;
    char *text = NULL, err[256];
    if (kvs_stats_json(c->o.socket, &text, err, sizeof err) != KVS_OK)
        return NULL;
    json_error_t je;
    json_t *root = json_loads(text, 0, &je), *seqs = json_object_get(root, "sequences"), *v;
    free(text);
    char *out = NULL;
    size_t i;
    json_array_foreach(seqs, i, v)
    {
        json_t *id = json_object_get(v, "seq_id");
        uint64_t sid = json_is_integer(id)  ? (uint64_t)json_integer_value(id)
                       : json_is_string(id) ? strtoull(json_string_value(id), NULL, 10)
                                            : 0;
        if (sid == c->seq) {
            out = json_dumps(v, JSON_COMPACT);
            break;
        }
    }
    json_decref(root);
    return out;
}

void cache_free(llm_cache *c)
{
    if (c == NULL)
        return;
    if (c->s != NULL) {
        if (c->have_seq)
            cache_seq_end(c);
        kvs_session_detach(c->s);
    }
    kvs_table_free(&c->writes);
    kvs_table_free(&c->held);
    for (uint32_t i = 0; c->lists != NULL && i < c->L * c->heads; i++) {
        free(c->lists[i].segs);
        free(c->lists[i].tiers);
        free(c->lists[i].pos);
    }
    free(c->lists);
    free(c->pk);
    free(c->pv);
    free(c->att_scores);
    free(c->tokens);
    free(c->conv);
    free(c->ids);
    free(c->probs);
    free(c->p_last);
    free(c->score);
    free(c->p_score);
    free(c->whist);
    free(c->wsum);
    free(c->wout);
    free(c->p_window);
    free(c->vn);
    free(c->vnout);
    free(c->p_vnorm);
    free(c);
}
