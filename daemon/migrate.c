#include "migrate.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checksum.h"
#include "kernels.h"
#include "policy.h"

/* The tiers whose tokens live in blocks, in the order data values of a
 * list are written. */
#define BLOCK_TIERS 4
static const uint8_t block_tiers[BLOCK_TIERS] = {POLICY_FULL, POLICY_INT8, POLICY_INT4,
                                                 POLICY_INT2};

#define PART_CAP 40                /* "l4294967295.h4294967295.int8" and a NUL */
#define POSITIONS_END (1ull << 32) /* appended is at most this: positions are u32 */
#define JSON_INT_MAX ((uint64_t)INT64_MAX)

/* common */
static int tier_index(unsigned t);
static int lowbit(unsigned t);
static uint8_t value_kind(uint8_t tier);
static size_t geometry_block_bytes(const pool_geometry *g);
static size_t sketch_cell_bytes(const pool_geometry *g, uint32_t heads);
static uint32_t sketch_tokens(const seq_export_list *ls);
static uint64_t slots_max(const pool_geometry *g, size_t block_bytes);
static uint64_t list_cap(uint64_t blocks, uint64_t slots);
static void data_part(char *out, uint32_t list, uint32_t heads, uint8_t tier);
static remote_value_header header_of(const pool_geometry *g, uint8_t kind, uint8_t tier,
                                     uint32_t quant_group, uint32_t layer, uint32_t head,
                                     uint32_t ntokens, uint64_t payload_len);
static status_code restate(status *st, status_code code, const char *what);
static size_t b64_len(size_t n);
static void b64_encode(const uint8_t *in, size_t n, char *out);
static int b64_value(unsigned char c);
static int b64_decode(const char *in, size_t len, uint8_t *out, size_t n);
/* encode */
static void group_blocks(const seq_export *x, size_t *end, uint32_t *order);
static size_t group_of(const seq_export *x, size_t b);
static status_code encode_manifest(const seq_export *x, const pool_geometry *g,
                                   uint32_t quant_group, size_t block_bytes, const char *ns,
                                   const char *tenant, const char *uid, const char *key,
                                   json_t *entries, json_t *sketches, remote_kv *kv, status *st);
static status_code check_export(const seq_export *x, const pool_geometry *g, size_t block_bytes,
                                status *st);
static status_code check_list(const seq_export *x, uint32_t li, uint64_t nblocks_of_list,
                              uint64_t slots, size_t cell, status *st);
static status_code check_at(const seq_export *x, uint32_t li, const char *what, size_t j,
                            const tier_token *at, status *st);
static int utf8_ok(const char *s);
static status_code encode_data(const seq_export *x, const pool_geometry *g, uint32_t quant_group,
                               size_t block_bytes, const uint8_t *bytes, const char *ns,
                               const char *tenant, const char *uid, uint32_t li, uint8_t tier,
                               const uint32_t *blocks, size_t nb, remote_kv *kv, json_t **entry,
                               status *st);
static json_t *build_manifest(const seq_export *x, const char *ns, const char *tenant,
                              const char *uid, size_t block_bytes, uint32_t quant_group,
                              json_t *entries, json_t *sketches);
static json_t *build_list(const seq_export_list *ls, int format, json_t *sketch);
static json_t *runs_of_positions(const uint32_t *pos, size_t n);
static json_t *runs_of_tiers(const uint8_t *t, size_t n);
static json_t *runs_of_at(const tier_token *at, size_t n);
static json_t *attn_string(const float *attn, size_t n);
static int jpush(json_t *a, uint64_t v);
/* decode */
static status_code parse_manifest(json_t *root, migrate_plan *p, status *st);
static status_code parse_identity(json_t *root, migrate_plan *p, status *st);
static status_code parse_counters(json_t *root, seq_export *x, status *st);
static status_code parse_params(json_t *root, migrate_plan *p, status *st);
static status_code parse_data(json_t *root, migrate_plan *p, uint64_t *list_blocks, status *st);
static status_code parse_entry(json_t *e, size_t i, migrate_plan *p, uint8_t *seen, status *st);
static status_code parse_list(json_t *o, uint32_t li, migrate_plan *p, uint64_t list_blocks,
                              uint64_t *sketch_budget, status *st);
static status_code parse_attn(json_t *j, const char *where, seq_export_list *ls, status *st);
static status_code parse_list_rest(json_t *o, const char *where, seq_export_list *ls, status *st);
static status_code parse_sketch(json_t *j, const char *where, uint32_t li, migrate_plan *p,
                                status *st);
static const char *path(char *buf, const char *where, const char *name);
static status_code finish_data(migrate_plan *p, status *st);
static status_code fields(json_t *o, const char *where, const char *const *names, size_t n,
                          status *st);
static status_code get(json_t *o, const char *where, const char *name, json_t **out, status *st);
static status_code check_uint(json_t *j, const char *what, const char *sub, uint64_t max,
                              uint64_t *v, status *st);
static status_code get_uint(json_t *o, const char *where, const char *name, uint64_t max,
                            uint64_t *v, status *st);
static status_code get_string(json_t *o, const char *where, const char *name, size_t maxlen,
                              char *out, status *st);
static status_code elem_uint(json_t *a, size_t i, const char *what, uint64_t max, uint64_t *v,
                             status *st);
static status_code array_of(json_t *j, const char *what, size_t group, status *st);
static status_code runs_positions(json_t *a, const char *what, uint64_t limit, uint32_t *out,
                                  size_t n, status *st);
static status_code runs_tiers(json_t *a, const char *what, uint8_t *out, size_t n, status *st);
static status_code runs_at(json_t *a, const char *what, const migrate_plan *p, tier_token *out,
                           size_t n, status *st);
static status_code decode_sketch(migrate_plan *p, const migrate_data *d, const uint8_t *payload,
                                 status *st);

/* ---- common --------------------------------------------------------------- */

static int tier_index(unsigned t)
{
    for (int i = 0; i < BLOCK_TIERS; i++)
        if (block_tiers[i] == t)
            return i;
    return -1;
}

static int lowbit(unsigned t)
{
    return t == POLICY_INT4 || t == POLICY_INT2;
}

/* A data value's kind: sketch cells, or blocks of tokens. */
static uint8_t value_kind(uint8_t tier)
{
    return tier == POLICY_SKETCH ? REMOTE_VALUE_SKETCH : REMOTE_VALUE_TOKENS;
}

/* Bytes of one cell of a list's sketch (tier_sketch_bytes_for of one
 * cell): a list of per-head lists (heads > 1) holds one head's rows, an
 * all-heads list every head's (seq.c list_layout). A list's sketch is a
 * positive multiple of it. */
static size_t sketch_cell_bytes(const pool_geometry *g, uint32_t heads)
{
    size_t dim = (size_t)(heads > 1 ? 1 : g->kv_heads) * g->head_dim;
    return tier_sketch_bytes_for(1, 1, dim);
}

/* The list's held tokens in its sketch. */
static uint32_t sketch_tokens(const seq_export_list *ls)
{
    uint32_t n = 0;
    for (uint32_t j = 0; j < ls->ntokens; j++)
        n += ls->at[j].tier == POLICY_SKETCH;
    return n;
}

static size_t geometry_block_bytes(const pool_geometry *g)
{
    kv_layout l = {g->kv_heads, g->block_tokens, g->head_dim, (uint32_t)pool_dtype_size(g->dtype),
                   0};
    return kv_block_bytes(&l);
}

/* At most this many tokens (held and victims) in one pool block, whatever
 * its tier and layout: one head's K and V row takes at least 2 bits a
 * channel (INT2), so a block holds at most 8 * block_bytes / (4 * head_dim)
 * rows. A bound for allocations, not a check of slots (seq_import's). */
static uint64_t slots_max(const pool_geometry *g, size_t block_bytes)
{
    uint64_t s = 2 * (uint64_t)block_bytes / (g->head_dim ? g->head_dim : 1);
    return s ? s : 1;
}

/* Tokens and victims a list of `blocks` blocks can hold at most. */
static uint64_t list_cap(uint64_t blocks, uint64_t slots)
{
    uint64_t cap;
    return __builtin_mul_overflow(blocks, slots, &cap) ? UINT64_MAX : cap;
}

static void data_part(char *out, uint32_t list, uint32_t heads, uint8_t tier)
{
    snprintf(out, PART_CAP, "l%u.h%u.%s", list / heads, list % heads, policy_tier_name(tier));
}

static remote_value_header header_of(const pool_geometry *g, uint8_t kind, uint8_t tier,
                                     uint32_t quant_group, uint32_t layer, uint32_t head,
                                     uint32_t ntokens, uint64_t payload_len)
{
    return (remote_value_header){
        .kind = kind,
        .tier = tier,
        .dtype = (uint8_t)g->dtype,
        .layers = g->layers,
        .q_heads = g->q_heads,
        .kv_heads = g->kv_heads,
        .head_dim = g->head_dim,
        .block_tokens = g->block_tokens,
        .rope_theta = g->rope_theta,
        .quant_group = lowbit(tier) ? quant_group : 0,
        .layer = layer,
        .head = head,
        .ntokens = ntokens,
        .payload_len = payload_len,
    };
}

/* st's message behind "what: ", with another code. */
static status_code restate(status *st, status_code code, const char *what)
{
    char m[STATUS_MSG_LEN];
    snprintf(m, sizeof m, "%s", st->msg);
    return status_set(st, code, "%s: %s", what, m);
}

/* Base64 (RFC 4648 §4, padded) for attention: exact binary32 at 4/3
 * characters a byte, one JSON string a list. */
static const char b64_chars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static size_t b64_len(size_t n)
{
    return (n + 2) / 3 * 4;
}

static void b64_encode(const uint8_t *in, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        size_t take = n - i < 3 ? n - i : 3;
        uint32_t w = (uint32_t)in[i] << 16 | (take > 1 ? (uint32_t)in[i + 1] << 8 : 0) |
                     (take > 2 ? in[i + 2] : 0);
        out[o++] = b64_chars[w >> 18 & 63];
        out[o++] = b64_chars[w >> 12 & 63];
        out[o++] = take > 1 ? b64_chars[w >> 6 & 63] : '=';
        out[o++] = take > 2 ? b64_chars[w & 63] : '=';
    }
    out[o] = '\0';
}

static int b64_value(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* Decode exactly n bytes from in[0..len): 0, or -1 for any other length, a
 * character outside the alphabet, padding out of place, or stray bits
 * (one encoding per byte string). */
static int b64_decode(const char *in, size_t len, uint8_t *out, size_t n)
{
    if (len != b64_len(n))
        return -1;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        size_t take = n - o < 3 ? n - o : 3;
        uint32_t w = 0;
        for (size_t k = 0; k < 4; k++) {
            int v = k > take ? (in[i + k] == '=' ? 0 : -1) : b64_value((unsigned char)in[i + k]);
            if (v < 0)
                return -1;
            w = w << 6 | (uint32_t)v;
        }
        uint8_t b[3] = {(uint8_t)(w >> 16), (uint8_t)(w >> 8), (uint8_t)w};
        for (size_t k = take; k < 3; k++)
            if (b[k] != 0)
                return -1;
        memcpy(out + o, b, take);
        o += take;
    }
    return 0;
}

/* ---- encode --------------------------------------------------------------- */

status_code migrate_encode(const seq_export *x, const pool_geometry *g, uint32_t quant_group,
                           size_t block_bytes, const uint8_t *bytes, const char *ns,
                           const char *tenant, const char *uid, migrate_values *out, status *st)
{
    *out = (migrate_values){0};
    quant_group = quant_group ? quant_group : KV_LOWBIT_GROUP_DEFAULT;
    char key[REMOTE_KEY_CAP];
    if (remote_key(key, sizeof key, ns, tenant, uid, MIGRATE_MANIFEST_PART, st) != ST_OK ||
        check_export(x, g, block_bytes, st) != ST_OK)
        return st->code;
    if (x->nblocks > 0 && bytes == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: %zu blocks but no bytes", x->nblocks);

    size_t nlists = (size_t)x->layers * x->heads, ngroups = nlists * BLOCK_TIERS, nvalues = 1;
    size_t *end = calloc(ngroups, sizeof *end);
    uint32_t *order = malloc((x->nblocks ? x->nblocks : 1) * sizeof *order);
    json_t *entries = json_array(), *sketches = json_array();
    status_code rc = ST_OK;
    if (end == NULL || order == NULL || entries == NULL || sketches == NULL)
        goto oom;
    group_blocks(x, end, order);
    for (size_t k = 0; k < ngroups; k++)
        nvalues += end[k] > (k ? end[k - 1] : 0);
    for (size_t li = 0; li < nlists; li++)
        nvalues += x->lists[li].sketch_bytes > 0;
    if ((out->kv = calloc(nvalues, sizeof *out->kv)) == NULL)
        goto oom;
    for (size_t k = 0; k < ngroups && rc == ST_OK; k++) {
        size_t start = k ? end[k - 1] : 0;
        if (end[k] == start)
            continue;
        json_t *e = NULL;
        rc = encode_data(x, g, quant_group, block_bytes, bytes, ns, tenant, uid,
                         (uint32_t)(k / BLOCK_TIERS), block_tiers[k % BLOCK_TIERS], order + start,
                         end[k] - start, &out->kv[out->n], &e, st);
        out->n += rc == ST_OK;
        if (rc == ST_OK && json_array_append_new(entries, e) != 0)
            goto oom;
    }
    /* Each list's sketch: a value of its own, named by the list's entry. */
    for (size_t li = 0; li < nlists && rc == ST_OK; li++) {
        json_t *e = json_null();
        if (x->lists[li].sketch_bytes > 0) {
            rc = encode_data(x, g, quant_group, block_bytes, bytes, ns, tenant, uid, (uint32_t)li,
                             POLICY_SKETCH, NULL, 0, &out->kv[out->n], &e, st);
            out->n += rc == ST_OK;
        }
        if (rc == ST_OK && json_array_append_new(sketches, e) != 0)
            goto oom;
    }
    if (rc == ST_OK) {
        rc = encode_manifest(x, g, quant_group, block_bytes, ns, tenant, uid, key, entries,
                             sketches, &out->kv[out->n], st);
        entries = NULL; /* taken */
        out->n += rc == ST_OK;
    }
    goto done;
oom:
    rc = status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory encoding %zu blocks",
                    x->nblocks);
done:
    json_decref(entries);
    json_decref(sketches);
    free(order);
    free(end);
    for (size_t i = 0; i < out->n; i++)
        out->bytes += out->kv[i].len;
    if (rc != ST_OK)
        migrate_values_free(out);
    return rc;
}

/* The export indices of each (list, tier) group k = list * BLOCK_TIERS +
 * tier_index, ascending, in order[]: group k is order[end[k - 1] ..
 * end[k]) (from 0 for k = 0). A counting sort; end[] zeroed by the
 * caller. */
static void group_blocks(const seq_export *x, size_t *end, uint32_t *order)
{
    size_t ngroups = (size_t)x->layers * x->heads * BLOCK_TIERS;
    for (size_t b = 0; b < x->nblocks; b++)
        end[group_of(x, b)]++;
    for (size_t k = 1; k < ngroups; k++)
        end[k] += end[k - 1];
    /* Backwards, so that each group comes out ascending. */
    for (size_t b = x->nblocks; b-- > 0;)
        order[--end[group_of(x, b)]] = (uint32_t)b;
    /* end[k] is now group k's start: shift to ends. */
    for (size_t k = 0; k < ngroups; k++)
        end[k] = k + 1 < ngroups ? end[k + 1] : x->nblocks;
}

static size_t group_of(const seq_export *x, size_t b)
{
    return (size_t)x->block_list[b] * BLOCK_TIERS + (size_t)tier_index(x->block_tier[b]);
}

/* The manifest value into *kv, from its JSON (which takes entries, the
 * data values' entries), written in place behind the header. */
static status_code encode_manifest(const seq_export *x, const pool_geometry *g,
                                   uint32_t quant_group, size_t block_bytes, const char *ns,
                                   const char *tenant, const char *uid, const char *key,
                                   json_t *entries, json_t *sketches, remote_kv *kv, status *st)
{
    json_t *root = build_manifest(x, ns, tenant, uid, block_bytes, quant_group, entries, sketches);
    size_t tlen = root ? json_dumpb(root, NULL, 0, JSON_COMPACT) : 0;
    remote_value_header h = header_of(g, REMOTE_VALUE_MANIFEST, POLICY_FULL, 0, 0, 0, 0, tlen);
    size_t size = remote_value_size(&h);
    uint8_t *val = tlen == 0 || size == SIZE_MAX ? NULL : malloc(size);
    char *k = strdup(key);
    status_code rc = ST_OK;
    if (val == NULL || k == NULL)
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory for the manifest");
    else {
        uint8_t *payload = val + remote_value_payload_offset(&h);
        if (json_dumpb(root, (char *)payload, tlen, JSON_COMPACT) != tlen)
            rc = status_set(st, ST_INTERNAL, "migrate: the manifest's JSON changed size");
        else
            rc = remote_value_encode(&h, NULL, payload, val, size, st);
    }
    json_decref(root);
    if (rc != ST_OK) {
        free(val);
        free(k);
        return rc;
    }
    *kv = (remote_kv){k, val, size};
    return ST_OK;
}

void migrate_values_free(migrate_values *v)
{
    if (v == NULL)
        return;
    for (size_t i = 0; i < v->n; i++) {
        free((void *)v->kv[i].key);
        free((void *)v->kv[i].val);
    }
    free(v->kv);
    *v = (migrate_values){0};
}

/* What the encoding needs of x, and what makes sure that what it writes
 * decodes (the decoder's bounds). */
static status_code check_export(const seq_export *x, const pool_geometry *g, size_t block_bytes,
                                status *st)
{
    size_t want = geometry_block_bytes(g);
    if (block_bytes != want)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: block_bytes %zu, the geometry's blocks have %zu", block_bytes,
                          want);
    if (x->layers == 0 || x->heads == 0 || (uint64_t)x->layers * x->heads > UINT32_MAX ||
        x->lists == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: %u layers of %u lists, lists %s",
                          x->layers, x->heads, x->lists ? "set" : "NULL");
    if (strnlen(x->policy, sizeof x->policy) == 0 ||
        strnlen(x->policy, sizeof x->policy) == sizeof x->policy || !utf8_ok(x->policy))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: the policy name is empty, unterminated or not UTF-8");
    if (strnlen(x->label, sizeof x->label) == sizeof x->label || !utf8_ok(x->label))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: the label is unterminated or not UTF-8");
    if (x->params.count > POLICY_MAX_PARAMS)
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: %zu parameters, at most %d",
                          x->params.count, POLICY_MAX_PARAMS);
    for (size_t i = 0; i < x->params.count; i++) {
        const char *k = x->params.key[i], *v = x->params.value[i];
        size_t vl = strnlen(v, sizeof x->params.value[i]);
        if (k == NULL || k[0] == '\0' || strlen(k) >= sizeof x->params.value[i] || !utf8_ok(k) ||
            vl == sizeof x->params.value[i] || !utf8_ok(v))
            return status_set(st, ST_INVALID_ARGUMENT,
                              "migrate: parameter %zu: key or value empty, too long or not UTF-8",
                              i);
    }
    uint64_t big = x->host_steps | x->requantized | x->victims_dropped;
    for (size_t t = 0; t < POLICY_TIERS; t++)
        big |= x->moved[t];
    if (big > JSON_INT_MAX || x->appended > POSITIONS_END)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: a counter above 2^63, or %llu appended (at most 2^32)",
                          (unsigned long long)x->appended);
    size_t nlists = (size_t)x->layers * x->heads;
    if (x->nblocks > UINT32_MAX ||
        (x->nblocks > 0 && (x->block_tier == NULL || x->block_list == NULL)))
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: %zu blocks, or their arrays NULL",
                          x->nblocks);
    uint64_t *per_list = calloc(nlists, sizeof *per_list);
    if (per_list == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory");
    status_code rc = ST_OK;
    for (size_t b = 0; b < x->nblocks && rc == ST_OK; b++) {
        if (x->block_list[b] >= nlists || tier_index(x->block_tier[b]) < 0)
            rc = status_set(st, ST_INVALID_ARGUMENT,
                            "migrate: export block %zu: list %u of %zu, tier %u (want full, "
                            "int8, int4 or int2)",
                            b, x->block_list[b], nlists, x->block_tier[b]);
        else
            per_list[x->block_list[b]]++;
    }
    uint64_t slots = slots_max(g, block_bytes);
    size_t cell = sketch_cell_bytes(g, x->heads);
    for (uint32_t li = 0; li < nlists && rc == ST_OK; li++)
        rc = check_list(x, li, per_list[li], slots, cell, st);
    free(per_list);
    return rc;
}

static status_code check_list(const seq_export *x, uint32_t li, uint64_t nblocks_of_list,
                              uint64_t slots, size_t cell, status *st)
{
    const seq_export_list *ls = &x->lists[li];
    if ((ls->ntokens > 0 && (ls->positions == NULL || ls->tiers == NULL || ls->at == NULL)) ||
        (ls->nvictims > 0 && (ls->victims == NULL || ls->victim_at == NULL)) ||
        (ls->nvictim_blocks > 0 && ls->victim_blocks == NULL) ||
        (ls->sketch_bytes > 0 && ls->sketch == NULL))
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: list %u: an array is NULL", li);
    if (ls->sketch_bytes % cell != 0 || ls->sketch_bytes > JSON_INT_MAX / 2)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: list %u: a sketch of %zu bytes, not cells of %zu", li,
                          ls->sketch_bytes, cell);
    /* A sketch holds any number of tokens: only appended bounds its list. */
    uint64_t held = (uint64_t)ls->ntokens + ls->nvictims;
    if (held > x->appended || (ls->sketch_bytes == 0 && held > list_cap(nblocks_of_list, slots)))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: list %u: %u tokens and %zu victims, %llu appended, %llu "
                          "blocks",
                          li, ls->ntokens, ls->nvictims, (unsigned long long)x->appended,
                          (unsigned long long)nblocks_of_list);
    for (size_t pass = 0; pass < 2; pass++) {
        const uint32_t *pos = pass ? ls->victims : ls->positions;
        const tier_token *at = pass ? ls->victim_at : ls->at;
        size_t n = pass ? ls->nvictims : ls->ntokens;
        const char *what = pass ? "victim" : "token";
        for (size_t j = 0; j < n; j++) {
            if ((j > 0 && pos[j] <= pos[j - 1]) || pos[j] >= x->appended)
                return status_set(st, ST_INVALID_ARGUMENT,
                                  "migrate: list %u: %s %zu at position %u: positions must be "
                                  "strictly ascending and below %llu",
                                  li, what, j, pos[j], (unsigned long long)x->appended);
            if (check_at(x, li, what, j, &at[j], st) != ST_OK)
                return st->code;
        }
    }
    for (size_t k = 0; k < ls->nvictim_blocks; k++)
        if (ls->victim_blocks[k] >= x->nblocks || x->block_list[ls->victim_blocks[k]] != li)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "migrate: list %u: victim block %u is not one of its blocks", li,
                              ls->victim_blocks[k]);
    if (ls->has_tail && (ls->tail_block >= x->nblocks || x->block_list[ls->tail_block] != li))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: list %u: tail block %u is not one of its blocks", li,
                          ls->tail_block);
    return ST_OK;
}

static status_code check_at(const seq_export *x, uint32_t li, const char *what, size_t j,
                            const tier_token *at, status *st)
{
    if (at->tier == POLICY_SKETCH) {
        if (x->lists[li].sketch_bytes == 0 || at->block != MIGRATE_SKETCH_BLOCK || at->slot != 0)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "migrate: list %u: %s %zu is in the sketch at block %u slot %u: "
                              "want a list with a sketch, block TIER_NO_BLOCK, slot 0",
                              li, what, j, at->block, at->slot);
        return ST_OK;
    }
    if (at->block >= x->nblocks || x->block_list[at->block] != li ||
        x->block_tier[at->block] != at->tier || at->slot == UINT32_MAX)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "migrate: list %u: %s %zu at block %u slot %u tier %s: not a block of "
                          "the list in that tier",
                          li, what, j, at->block, at->slot, policy_tier_name(at->tier));
    return ST_OK;
}

/* Whether jansson takes s as a string: json_string refuses invalid UTF-8
 * (and fails out of memory), json_string_nocheck only out of memory. */
static int utf8_ok(const char *s)
{
    json_t *j = json_string(s);
    if (j == NULL && (j = json_string_nocheck(s)) != NULL) {
        json_decref(j);
        return 0;
    }
    json_decref(j);
    return 1; /* or out of memory: the manifest's builder says so */
}

/* The data value of list li's blocks of `tier` (their export indices
 * blocks[0..nb), ascending), or of its sketch (tier POLICY_SKETCH, no
 * blocks), into *kv, and its manifest entry into *entry (a new reference):
 * {key, list, tier, size, crc, blocks}, or a sketch's {key, size, crc}. */
static status_code encode_data(const seq_export *x, const pool_geometry *g, uint32_t quant_group,
                               size_t block_bytes, const uint8_t *bytes, const char *ns,
                               const char *tenant, const char *uid, uint32_t li, uint8_t tier,
                               const uint32_t *blocks, size_t nb, remote_kv *kv, json_t **entry,
                               status *st)
{
    const seq_export_list *ls = &x->lists[li];
    uint32_t npos = 0;
    for (uint32_t j = 0; j < ls->ntokens; j++)
        npos += ls->at[j].tier == tier;
    uint32_t *pos = malloc((npos ? npos : 1) * sizeof *pos);
    if (pos == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory");
    for (uint32_t j = 0, k = 0; j < ls->ntokens; j++)
        if (ls->at[j].tier == tier)
            pos[k++] = ls->positions[j];

    char part[PART_CAP], key[REMOTE_KEY_CAP];
    data_part(part, li, x->heads, tier);
    /* nb * block_bytes <= nblocks * block_bytes, the caller's buffer. */
    int sketch = tier == POLICY_SKETCH;
    uint64_t plen = sketch ? ls->sketch_bytes : (uint64_t)nb * block_bytes;
    remote_value_header h =
        header_of(g, value_kind(tier), tier, quant_group, li / x->heads, li % x->heads, npos, plen);
    size_t size = remote_value_size(&h);
    uint8_t *val = NULL;
    status_code rc = remote_key(key, sizeof key, ns, tenant, uid, part, st);
    if (rc != ST_OK)
        goto done;
    if (size == SIZE_MAX || (val = malloc(size)) == NULL) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory for %s", part);
        goto done;
    }
    uint8_t *payload = val + remote_value_payload_offset(&h);
    if (sketch)
        memcpy(payload, ls->sketch, ls->sketch_bytes);
    for (size_t k = 0; k < nb; k++)
        memcpy(payload + k * block_bytes, bytes + (size_t)blocks[k] * block_bytes, block_bytes);
    rc = remote_value_encode(&h, pos, payload, val, size, st);
    if (rc != ST_OK) {
        restate(st, ST_INVALID_ARGUMENT, part);
        goto done;
    }
    json_t *e = json_object();
    int bad = json_object_set_new(e, "key", json_string(key)) |
              json_object_set_new(e, "size", json_integer((json_int_t)size)) |
              json_object_set_new(e, "crc", json_integer((json_int_t)checksum_crc32(0, val, size)));
    if (!sketch) {
        json_t *jb = json_array();
        for (size_t k = 0; k < nb && !bad; k++)
            bad |= jpush(jb, blocks[k]);
        bad |= json_object_set_new(e, "list", json_integer(li)) |
               json_object_set_new(e, "tier", json_integer(tier)) |
               json_object_set_new(e, "blocks", jb);
    }
    char *k = strdup(key);
    if (bad || k == NULL) {
        json_decref(e);
        free(k);
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "migrate: out of memory for %s", part);
        goto done;
    }
    *kv = (remote_kv){k, val, size};
    *entry = e;
    val = NULL;
done:
    free(val);
    free(pos);
    return rc;
}

/* The manifest's JSON (migrate.h); takes entries (freed on failure too).
 * NULL when out of memory. */
/* Each layer's policy state as a base64 string; [] for a policy without. */
static json_t *states_array(const seq_export *x)
{
    json_t *a = json_array();
    for (uint32_t l = 0; a != NULL && x->states != NULL && l < x->layers; l++) {
        char *s = malloc(b64_len(x->state_len[l]) + 1);
        if (s != NULL)
            b64_encode(x->states[l], x->state_len[l], s);
        int bad = s == NULL || json_array_append_new(a, json_string(s)) != 0;
        free(s);
        if (bad) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *build_manifest(const seq_export *x, const char *ns, const char *tenant,
                              const char *uid, size_t block_bytes, uint32_t quant_group,
                              json_t *entries, json_t *sketches)
{
    json_t *o = json_object(), *params = json_array(), *moved = json_array(), *lists = json_array();
    int bad = 0;
    for (size_t i = 0; i < x->params.count; i++) {
        json_t *kv = json_array();
        bad |= json_array_append_new(kv, json_string(x->params.key[i])) |
               json_array_append_new(kv, json_string(x->params.value[i])) |
               json_array_append_new(params, kv);
    }
    for (size_t t = 0; t < POLICY_TIERS; t++)
        bad |= jpush(moved, x->moved[t]);
    /* Format 1 when no list has a sketch: a daemon not upgraded yet still
     * imports it (a rolling upgrade). */
    size_t nlists = (size_t)x->layers * x->heads;
    int format = 1;
    for (size_t li = 0; li < nlists; li++)
        if (json_is_object(json_array_get(sketches, li)))
            format = MIGRATE_FORMAT;
    for (size_t li = 0; li < nlists && !bad; li++)
        bad |= json_array_append_new(
            lists, build_list(&x->lists[li], format, json_array_get(sketches, li)));
    bad |= json_object_set_new(o, "format", json_integer(format)) |
           json_object_set_new(o, "ns", json_string(ns)) |
           json_object_set_new(o, "tenant", json_string(tenant)) |
           json_object_set_new(o, "uid", json_string(uid)) |
           json_object_set_new(o, "policy", json_string(x->policy)) |
           json_object_set_new(o, "params", params) |
           json_object_set_new(o, "label", json_string(x->label)) |
           json_object_set_new(o, "appended", json_integer((json_int_t)x->appended)) |
           json_object_set_new(o, "unstepped", json_integer(x->unstepped)) |
           json_object_set_new(o, "host_steps", json_integer((json_int_t)x->host_steps)) |
           json_object_set_new(o, "moved", moved) |
           json_object_set_new(o, "requantized", json_integer((json_int_t)x->requantized)) |
           json_object_set_new(o, "victims_dropped", json_integer((json_int_t)x->victims_dropped)) |
           json_object_set_new(o, "layers", json_integer(x->layers)) |
           json_object_set_new(o, "heads", json_integer(x->heads)) |
           json_object_set_new(o, "block_bytes", json_integer((json_int_t)block_bytes)) |
           json_object_set_new(o, "quant_group", json_integer(quant_group)) |
           json_object_set_new(o, "nblocks", json_integer((json_int_t)x->nblocks)) |
           json_object_set_new(o, "data", entries) | json_object_set_new(o, "lists", lists) |
           json_object_set_new(o, "states", states_array(x));
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* List ls's object in `format`; sketch (borrowed) its sketch's entry, or
 * null (format 2 only). */
static json_t *build_list(const seq_export_list *ls, int format, json_t *sketch)
{
    json_t *o = json_object(), *tail = json_null();
    int bad = 0;
    if (ls->has_tail) {
        tail = json_array();
        bad |= jpush(tail, ls->tail_block) | jpush(tail, ls->tail_next_slot);
    }
    json_t *vb = json_array();
    for (size_t k = 0; k < ls->nvictim_blocks && !bad; k++)
        bad |= jpush(vb, ls->victim_blocks[k]);
    bad |= json_object_set_new(o, "ntokens", json_integer(ls->ntokens)) |
           json_object_set_new(o, "positions", runs_of_positions(ls->positions, ls->ntokens)) |
           json_object_set_new(o, "tiers", runs_of_tiers(ls->tiers, ls->ntokens)) |
           json_object_set_new(o, "attn",
                               ls->attn ? attn_string(ls->attn, ls->ntokens) : json_null()) |
           json_object_set_new(o, "at", runs_of_at(ls->at, ls->ntokens)) |
           json_object_set_new(o, "nvictims", json_integer((json_int_t)ls->nvictims)) |
           json_object_set_new(o, "victims", runs_of_positions(ls->victims, ls->nvictims)) |
           json_object_set_new(o, "victim_at", runs_of_at(ls->victim_at, ls->nvictims)) |
           json_object_set_new(o, "victim_blocks", vb) | json_object_set_new(o, "tail", tail) |
           json_object_set_new(o, "demote_due", json_integer(ls->demote_due));
    if (format >= 2)
        bad |= json_object_set(o, "sketch", sketch ? sketch : json_null());
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static int jpush(json_t *a, uint64_t v)
{
    return json_array_append_new(a, json_integer((json_int_t)v));
}

/* [start, count, ...] over strictly ascending positions. */
static json_t *runs_of_positions(const uint32_t *pos, size_t n)
{
    json_t *a = json_array();
    int bad = 0;
    for (size_t j = 0, r; j < n && !bad; j += r) {
        for (r = 1; j + r < n && pos[j + r] == (uint64_t)pos[j] + r; r++)
            ;
        bad |= jpush(a, pos[j]) | jpush(a, r);
    }
    if (bad) {
        json_decref(a);
        return NULL;
    }
    return a;
}

/* [tier, count, ...]. */
static json_t *runs_of_tiers(const uint8_t *t, size_t n)
{
    json_t *a = json_array();
    int bad = 0;
    for (size_t j = 0, r; j < n && !bad; j += r) {
        for (r = 1; j + r < n && t[j + r] == t[j]; r++)
            ;
        bad |= jpush(a, t[j]) | jpush(a, r);
    }
    if (bad) {
        json_decref(a);
        return NULL;
    }
    return a;
}

/* [block, slot, count, ...]: count tokens at consecutive slots of block
 * (slots below UINT32_MAX: check_at), or count tokens in the sketch
 * [MIGRATE_SKETCH_BLOCK, 0, count]. */
static json_t *runs_of_at(const tier_token *at, size_t n)
{
    json_t *a = json_array();
    int bad = 0;
    for (size_t j = 0, r; j < n && !bad; j += r) {
        int sk = at[j].block == MIGRATE_SKETCH_BLOCK;
        for (r = 1; j + r < n && at[j + r].block == at[j].block &&
                    (sk || at[j + r].slot == (uint64_t)at[j].slot + r);
             r++)
            ;
        bad |= jpush(a, at[j].block) | jpush(a, at[j].slot) | jpush(a, r);
    }
    if (bad) {
        json_decref(a);
        return NULL;
    }
    return a;
}

/* Base64 of the floats' binary32 bits, little-endian. */
static json_t *attn_string(const float *attn, size_t n)
{
    uint8_t *raw = malloc(4 * n + 1);
    char *s = malloc(b64_len(4 * n) + 1);
    json_t *j = NULL;
    if (raw != NULL && s != NULL) {
        for (size_t i = 0; i < n; i++) {
            uint32_t w;
            memcpy(&w, &attn[i], sizeof w);
            for (int b = 0; b < 4; b++)
                raw[4 * i + (size_t)b] = (uint8_t)(w >> (8 * b));
        }
        b64_encode(raw, 4 * n, s);
        j = json_string(s);
    }
    free(raw);
    free(s);
    return j;
}

/* ---- decode --------------------------------------------------------------- */

status_code migrate_decode_manifest(const void *buf, size_t len, const pool_geometry *g,
                                    uint32_t quant_group, migrate_plan *out, status *st)
{
    memset(out, 0, sizeof *out);
    remote_value_header h;
    const uint8_t *payload;
    if (remote_value_decode(buf, len, &h, NULL, &payload, st) != ST_OK)
        return restate(st, ST_DATA_LOSS, "manifest");
    if (h.kind != REMOTE_VALUE_MANIFEST || h.ntokens != 0)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: a value of kind %u with %u positions, not a manifest (kind "
                          "%d, none)",
                          h.kind, h.ntokens, REMOTE_VALUE_MANIFEST);
    if (remote_value_check_geometry(&h, g, 0, st) != ST_OK) /* a manifest has no group */
        return restate(st, ST_FAILED_PRECONDITION, "manifest");
    json_error_t jerr;
    json_t *root =
        json_loadb((const char *)payload, (size_t)h.payload_len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return status_set(st,
                          json_error_code(&jerr) == json_error_out_of_memory ? ST_RESOURCE_EXHAUSTED
                                                                             : ST_DATA_LOSS,
                          "manifest: JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                          jerr.column);
    out->geom = *g;
    out->quant_group = quant_group ? quant_group : KV_LOWBIT_GROUP_DEFAULT;
    out->block_bytes = geometry_block_bytes(g);
    status_code rc = parse_manifest(root, out, st);
    json_decref(root);
    if (rc != ST_OK)
        migrate_plan_free(out);
    return rc;
}

/* "states": [] (a policy without state), or one base64 string a layer:
 * the bytes are the policy's to check (import_layer); here only their
 * encoding, and their size, which the manifest's own length bounds. */
static status_code parse_states(json_t *root, seq_export *x, status *st)
{
    json_t *a;
    if (get(root, "", "states", &a, st) || array_of(a, "states", 1, st))
        return st->code;
    size_t n = json_array_size(a);
    if (n == 0)
        return ST_OK;
    if (n != x->layers)
        return status_set(st, ST_DATA_LOSS, "manifest: states has %zu entries for %u layers", n,
                          x->layers);
    x->states = calloc(n, sizeof *x->states);
    x->state_len = calloc(n, sizeof *x->state_len);
    if (x->states == NULL || x->state_len == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    for (size_t l = 0; l < n; l++) {
        json_t *j = json_array_get(a, l);
        size_t len = json_is_string(j) ? json_string_length(j) : 1;
        const char *s = json_is_string(j) ? json_string_value(j) : "";
        size_t pad = len >= 2 && s[len - 1] == '=' ? (s[len - 2] == '=' ? 2 : 1) : 0;
        size_t bytes = len / 4 * 3 - (len % 4 == 0 ? pad : 0);
        x->states[l] = malloc(bytes ? bytes : 1);
        if (x->states[l] == NULL)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
        x->state_len[l] = bytes;
        if (!json_is_string(j) || len % 4 != 0 || b64_decode(s, len, x->states[l], bytes) != 0)
            return status_set(st, ST_DATA_LOSS, "manifest: states[%zu] is not base64 (RFC 4648)",
                              l);
    }
    return ST_OK;
}

static status_code parse_manifest(json_t *root, migrate_plan *p, status *st)
{
    static const char *const names[] = {"format",          "ns",         "tenant", "uid",
                                        "policy",          "params",     "label",  "appended",
                                        "unstepped",       "host_steps", "moved",  "requantized",
                                        "victims_dropped", "layers",     "heads",  "block_bytes",
                                        "quant_group",     "nblocks",    "data",   "lists",
                                        "states"};
    seq_export *x = &p->image;
    uint64_t v, qg;
    json_t *lists;
    if (fields(root, "", names, sizeof names / sizeof names[0], st) ||
        parse_identity(root, p, st) || parse_counters(root, x, st) ||
        get_uint(root, "", "block_bytes", JSON_INT_MAX, &v, st) ||
        get_uint(root, "", "quant_group", UINT32_MAX, &qg, st))
        return st->code;
    if (v != p->block_bytes)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "manifest: written for blocks of %llu bytes, this pool's have %zu",
                          (unsigned long long)v, p->block_bytes);
    if (get_uint(root, "", "layers", UINT32_MAX, &v, st))
        return st->code;
    x->layers = (uint32_t)v;
    if (get_uint(root, "", "heads", UINT32_MAX, &v, st) || get(root, "", "lists", &lists, st) ||
        array_of(lists, "lists", 1, st))
        return st->code;
    x->heads = (uint32_t)v;
    uint64_t nlists = (uint64_t)x->layers * x->heads;
    if (x->layers == 0 || x->heads == 0 || nlists > UINT32_MAX || json_array_size(lists) != nlists)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %u layers of %u lists, and %zu lists (want >= 1, and "
                          "layers * heads)",
                          x->layers, x->heads, json_array_size(lists));

    /* The data entries first: they bound the lists' counts (migrate.h). */
    uint64_t *list_blocks = calloc(nlists, sizeof *list_blocks);
    x->lists = calloc(nlists, sizeof *x->lists);
    if (list_blocks == NULL || x->lists == NULL) {
        free(list_blocks);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    }
    status_code rc = parse_data(root, p, list_blocks, st);
    for (size_t i = 0; i < p->ndata && rc == ST_OK; i++)
        if (lowbit(p->data[i].tier) && qg != p->quant_group)
            rc = status_set(st, ST_FAILED_PRECONDITION,
                            "manifest: written for quant_group %llu, this pool has %u",
                            (unsigned long long)qg, p->quant_group);
    uint64_t sketch_budget = MIGRATE_MAX_SKETCH_TOKENS;
    for (uint32_t li = 0; li < nlists && rc == ST_OK; li++)
        rc = parse_list(json_array_get(lists, li), li, p, list_blocks[li], &sketch_budget, st);
    free(list_blocks);
    if (rc == ST_OK)
        rc = parse_states(root, x, st);
    if (rc == ST_OK)
        rc = finish_data(p, st);
    return rc;
}

/* format, ns, tenant, uid, policy, label, params. */
static status_code parse_identity(json_t *root, migrate_plan *p, status *st)
{
    seq_export *x = &p->image;
    uint64_t v;
    if (get_uint(root, "", "format", JSON_INT_MAX, &v, st))
        return st->code;
    if (v < MIGRATE_FORMAT_OLDEST || v > MIGRATE_FORMAT)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "manifest: format %llu, this kvstashd reads formats %d to %d",
                          (unsigned long long)v, MIGRATE_FORMAT_OLDEST, MIGRATE_FORMAT);
    p->format = (uint32_t)v;
    if (get_string(root, "", "ns", REMOTE_NAME_MAX, p->ns, st) ||
        get_string(root, "", "tenant", REMOTE_NAME_MAX, p->tenant, st) ||
        get_string(root, "", "uid", REMOTE_NAME_MAX, p->uid, st))
        return st->code;
    if (!remote_name_valid(p->ns, REMOTE_NAME_MAX) ||
        !remote_name_valid(p->tenant, REMOTE_NAME_MAX) ||
        !remote_name_valid(p->uid, REMOTE_NAME_MAX))
        return status_set(st, ST_DATA_LOSS, "manifest: ns, tenant or uid is not a valid id");
    if (get_string(root, "", "policy", sizeof x->policy - 1, x->policy, st) ||
        get_string(root, "", "label", sizeof x->label - 1, x->label, st))
        return st->code;
    if (x->policy[0] == '\0')
        return status_set(st, ST_DATA_LOSS, "manifest: policy is empty");
    return parse_params(root, p, st);
}

/* appended, unstepped, host_steps, requantized, victims_dropped, moved. */
static status_code parse_counters(json_t *root, seq_export *x, status *st)
{
    uint64_t v;
    json_t *j;
    if (get_uint(root, "", "appended", POSITIONS_END, &x->appended, st) ||
        get_uint(root, "", "unstepped", UINT32_MAX, &v, st) ||
        get_uint(root, "", "host_steps", JSON_INT_MAX, &x->host_steps, st) ||
        get_uint(root, "", "requantized", JSON_INT_MAX, &x->requantized, st) ||
        get_uint(root, "", "victims_dropped", JSON_INT_MAX, &x->victims_dropped, st) ||
        get(root, "", "moved", &j, st) || array_of(j, "moved", 1, st))
        return st->code;
    x->unstepped = (uint32_t)v;
    if (json_array_size(j) != POLICY_TIERS)
        return status_set(st, ST_DATA_LOSS, "manifest: moved has %zu counters, not %d",
                          json_array_size(j), POLICY_TIERS);
    for (size_t t = 0; t < POLICY_TIERS; t++)
        if (elem_uint(j, t, "moved", JSON_INT_MAX, &x->moved[t], st))
            return st->code;
    return ST_OK;
}

static status_code parse_params(json_t *root, migrate_plan *p, status *st)
{
    policy_params *pp = &p->image.params;
    json_t *a;
    if (get(root, "", "params", &a, st) || array_of(a, "params", 1, st))
        return st->code;
    if (json_array_size(a) > POLICY_MAX_PARAMS)
        return status_set(st, ST_DATA_LOSS, "manifest: %zu params, at most %d", json_array_size(a),
                          POLICY_MAX_PARAMS);
    for (size_t i = 0; i < json_array_size(a); i++) {
        json_t *kv = json_array_get(a, i), *k = json_array_get(kv, 0), *v = json_array_get(kv, 1);
        if (!json_is_array(kv) || json_array_size(kv) != 2 || !json_is_string(k) ||
            !json_is_string(v) || json_string_length(k) == 0 ||
            json_string_length(k) >= sizeof pp->value[i] ||
            json_string_length(v) >= sizeof pp->value[i] ||
            strlen(json_string_value(k)) != json_string_length(k) ||
            strlen(json_string_value(v)) != json_string_length(v))
            return status_set(st, ST_DATA_LOSS,
                              "manifest: params[%zu] is not [key, value] (strings of 1..63 and "
                              "0..63 bytes)",
                              i);
        if ((p->param_keys[i] = strdup(json_string_value(k))) == NULL)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
        pp->key[i] = p->param_keys[i];
        memcpy(pp->value[i], json_string_value(v), json_string_length(v) + 1);
        pp->count = i + 1;
    }
    return ST_OK;
}

/* The data entries: which export blocks each value fills; every block in
 * exactly one (so nblocks is bounded by the manifest's length). Counts
 * each list's blocks into list_blocks. */
static status_code parse_data(json_t *root, migrate_plan *p, uint64_t *list_blocks, status *st)
{
    seq_export *x = &p->image;
    size_t nlists = (size_t)x->layers * x->heads;
    json_t *a;
    uint64_t nblocks, listed = 0;
    if (get_uint(root, "", "nblocks", UINT32_MAX, &nblocks, st) || get(root, "", "data", &a, st) ||
        array_of(a, "data", 1, st))
        return st->code;
    size_t nd = json_array_size(a);
    if (nd > nlists * BLOCK_TIERS)
        return status_set(st, ST_DATA_LOSS, "manifest: %zu data values for %zu lists", nd, nlists);
    /* Room for a sketch a list too (parse_sketch appends them). */
    p->data = calloc(nd + nlists, sizeof *p->data);
    p->data_keys = calloc(nd + nlists, sizeof *p->data_keys);
    uint8_t *seen = calloc(nlists * BLOCK_TIERS, 1);
    status_code rc = ST_OK;
    if (p->data == NULL || p->data_keys == NULL || seen == NULL) {
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
        goto done;
    }
    p->ndata = nd; /* zeroed entries: migrate_plan_free frees what parse_entry took */
    for (size_t i = 0; i < nd && rc == ST_OK; i++) {
        rc = parse_entry(json_array_get(a, i), i, p, seen, st);
        listed += p->data[i].nblocks;
    }
    if (rc == ST_OK && listed != nblocks)
        rc = status_set(st, ST_DATA_LOSS, "manifest: data values hold %llu blocks, nblocks is %llu",
                        (unsigned long long)listed, (unsigned long long)nblocks);
    if (rc == ST_OK && nblocks > SIZE_MAX / p->block_bytes)
        rc = status_set(st, ST_DATA_LOSS, "manifest: %llu blocks of %zu bytes overflow",
                        (unsigned long long)nblocks, p->block_bytes);
    if (rc != ST_OK)
        goto done;
    x->nblocks = (size_t)nblocks;
    if (nblocks > 0) {
        x->block_tier = malloc(nblocks * sizeof *x->block_tier);
        x->block_list = malloc(nblocks * sizeof *x->block_list);
        if (x->block_tier == NULL || x->block_list == NULL) {
            rc = status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
            goto done;
        }
        memset(x->block_list, 0xff, nblocks * sizeof *x->block_list); /* unclaimed */
    }
    for (size_t i = 0; i < nd && rc == ST_OK; i++) {
        const migrate_data *d = &p->data[i];
        for (size_t k = 0; k < d->nblocks && rc == ST_OK; k++) {
            uint32_t b = d->blocks[k];
            if (b >= nblocks || x->block_list[b] != UINT32_MAX)
                rc = status_set(st, ST_DATA_LOSS, "manifest: data[%zu].blocks[%zu]: block %u %s", i,
                                k, b, b >= nblocks ? "past nblocks" : "listed twice");
            else {
                x->block_list[b] = d->list;
                x->block_tier[b] = d->tier;
            }
        }
        list_blocks[d->list] += d->nblocks;
    }
done:
    free(seen);
    return rc;
}

/* Whether `key`, the key of data entry `where`, is part's under the
 * manifest's ns, tenant and uid (the only key it may have). */
static status_code check_data_key(const migrate_plan *p, const char *where, const char *key,
                                  const char *part, status *st)
{
    char want[REMOTE_KEY_CAP];
    if (remote_key(want, sizeof want, p->ns, p->tenant, p->uid, part, st) != ST_OK)
        return restate(st, ST_DATA_LOSS, "manifest");
    if (strcmp(key, want) != 0)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %s.key is not the key of %s under the manifest's ns, "
                          "tenant and uid",
                          where, part);
    return ST_OK;
}

static status_code parse_entry(json_t *e, size_t i, migrate_plan *p, uint8_t *seen, status *st)
{
    static const char *const names[] = {"key", "list", "tier", "size", "crc", "blocks"};
    const seq_export *x = &p->image;
    migrate_data *d = &p->data[i];
    char where[32], bwhat[48], part[PART_CAP], key[REMOTE_KEY_CAP];
    uint64_t list, tier, size, crc;
    json_t *a;
    snprintf(where, sizeof where, "data[%zu]", i);
    snprintf(bwhat, sizeof bwhat, "%s.blocks", where);
    if (fields(e, where, names, sizeof names / sizeof names[0], st) ||
        get_string(e, where, "key", sizeof key - 1, key, st) ||
        get_uint(e, where, "list", (uint64_t)x->layers * x->heads - 1, &list, st) ||
        get_uint(e, where, "tier", 255, &tier, st) ||
        get_uint(e, where, "size", JSON_INT_MAX, &size, st) ||
        get_uint(e, where, "crc", UINT32_MAX, &crc, st) || get(e, where, "blocks", &a, st) ||
        array_of(a, bwhat, 1, st))
        return st->code;
    int ti = tier_index((unsigned)tier);
    if (ti < 0)
        return status_set(st, ST_DATA_LOSS, "manifest: %s.tier %llu is not a tier with blocks",
                          where, (unsigned long long)tier);
    if (seen[list * BLOCK_TIERS + (size_t)ti]++)
        return status_set(st, ST_DATA_LOSS, "manifest: %s: a second value for list %llu tier %s",
                          where, (unsigned long long)list, policy_tier_name((unsigned)tier));
    data_part(part, (uint32_t)list, x->heads, (uint8_t)tier);
    if (check_data_key(p, where, key, part, st) != ST_OK)
        return st->code;
    size_t nb = json_array_size(a);
    if (nb == 0 || size > SIZE_MAX)
        return status_set(st, ST_DATA_LOSS, "manifest: %s: %zu blocks, %llu bytes", where, nb,
                          (unsigned long long)size);
    *d = (migrate_data){
        .list = (uint32_t)list, .tier = (uint8_t)tier, .size = (size_t)size, .crc = (uint32_t)crc};
    d->key = strdup(key);
    d->blocks = malloc(nb * sizeof *d->blocks);
    if (d->key == NULL || d->blocks == NULL) {
        free(d->key);
        free(d->blocks);
        *d = (migrate_data){0};
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    }
    d->nblocks = nb;
    p->data_keys[i] = d->key;
    for (size_t k = 0; k < nb; k++) {
        uint64_t b;
        if (elem_uint(a, k, bwhat, UINT32_MAX - 1, &b, st))
            return st->code;
        if (k > 0 && b <= d->blocks[k - 1])
            return status_set(st, ST_DATA_LOSS,
                              "manifest: %s.blocks[%zu] = %llu: not strictly ascending", where, k,
                              (unsigned long long)b);
        d->blocks[k] = (uint32_t)b;
    }
    return ST_OK;
}

static status_code parse_list(json_t *o, uint32_t li, migrate_plan *p, uint64_t list_blocks,
                              uint64_t *sketch_budget, status *st)
{
    /* Format 1 has no "sketch" (the last name). */
    static const char *const names[] = {
        "ntokens", "positions", "tiers",         "attn", "at",         "nvictims",
        "victims", "victim_at", "victim_blocks", "tail", "demote_due", "sketch"};
    size_t nnames = sizeof names / sizeof names[0] - (p->format < 2);
    seq_export_list *ls = &p->image.lists[li];
    char where[32];
    uint64_t nt, nv;
    snprintf(where, sizeof where, "lists[%u]", li);
    if (fields(o, where, names, nnames, st) || get_uint(o, where, "ntokens", UINT32_MAX, &nt, st) ||
        get_uint(o, where, "nvictims", UINT32_MAX, &nv, st))
        return st->code;
    json_t *sketch = p->format >= 2 ? json_object_get(o, "sketch") : NULL;
    int has_sketch = sketch != NULL && !json_is_null(sketch);
    /* The bounds before anything is allocated (migrate.h): a sketch holds
     * any number of tokens, so only appended bounds a list with one. */
    uint64_t cap =
        has_sketch ? UINT64_MAX : list_cap(list_blocks, slots_max(&p->geom, p->block_bytes));
    if (nt + nv > p->image.appended || nt + nv > cap)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %s: %llu tokens and %llu victims, but %llu appended and "
                          "%llu blocks",
                          where, (unsigned long long)nt, (unsigned long long)nv,
                          (unsigned long long)p->image.appended, (unsigned long long)list_blocks);
    /* ...and what all lists with a sketch hold together, MIGRATE_MAX_SKETCH_TOKENS. */
    if (has_sketch && nt + nv > *sketch_budget)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %s: %llu tokens and %llu victims take the lists with a "
                          "sketch past %u tokens in all",
                          where, (unsigned long long)nt, (unsigned long long)nv,
                          (unsigned)MIGRATE_MAX_SKETCH_TOKENS);
    if (has_sketch)
        *sketch_budget -= nt + nv;
    ls->ntokens = (uint32_t)nt;
    ls->nvictims = (size_t)nv;
    if (nt > 0) {
        ls->positions = malloc(nt * sizeof *ls->positions);
        ls->tiers = malloc(nt);
        ls->at = malloc(nt * sizeof *ls->at);
        if (ls->positions == NULL || ls->tiers == NULL || ls->at == NULL)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    }
    if (nv > 0) {
        ls->victims = malloc(nv * sizeof *ls->victims);
        ls->victim_at = malloc(nv * sizeof *ls->victim_at);
        if (ls->victims == NULL || ls->victim_at == NULL)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    }
    char w[5][64];
    uint64_t end = p->image.appended;
    if (runs_positions(json_object_get(o, "positions"), path(w[0], where, "positions"), end,
                       ls->positions, nt, st) ||
        runs_tiers(json_object_get(o, "tiers"), path(w[1], where, "tiers"), ls->tiers, nt, st) ||
        runs_at(json_object_get(o, "at"), path(w[2], where, "at"), p, ls->at, nt, st) ||
        runs_positions(json_object_get(o, "victims"), path(w[3], where, "victims"), end,
                       ls->victims, nv, st) ||
        runs_at(json_object_get(o, "victim_at"), path(w[4], where, "victim_at"), p, ls->victim_at,
                nv, st) ||
        parse_attn(json_object_get(o, "attn"), where, ls, st))
        return st->code;
    for (size_t pass = 0; pass < 2 && !has_sketch; pass++) {
        const tier_token *at = pass ? ls->victim_at : ls->at;
        for (size_t j = 0; j < (pass ? ls->nvictims : ls->ntokens); j++)
            if (at[j].tier == POLICY_SKETCH)
                return status_set(st, ST_DATA_LOSS,
                                  "manifest: %s.%s[%zu] is in the sketch, but %s.sketch is null",
                                  where, pass ? "victim_at" : "at", j, where);
    }
    if (has_sketch && parse_sketch(sketch, where, li, p, st) != ST_OK)
        return st->code;
    return parse_list_rest(o, where, ls, st);
}

/* A list's "sketch": {key, size, crc}, the list's sketch value, as a data
 * value the plan fetches (appended to p->data, tier POLICY_SKETCH, no
 * blocks); its payload, what the size leaves after the header and the
 * positions of the list's held sketch tokens, is whole cells. */
static status_code parse_sketch(json_t *j, const char *where, uint32_t li, migrate_plan *p,
                                status *st)
{
    static const char *const names[] = {"key", "size", "crc"};
    seq_export_list *ls = &p->image.lists[li];
    char w[48], part[PART_CAP], key[REMOTE_KEY_CAP];
    uint64_t size, crc;
    path(w, where, "sketch");
    if (fields(j, w, names, sizeof names / sizeof names[0], st) ||
        get_string(j, w, "key", sizeof key - 1, key, st) ||
        get_uint(j, w, "size", JSON_INT_MAX, &size, st) ||
        get_uint(j, w, "crc", UINT32_MAX, &crc, st))
        return st->code;
    data_part(part, li, p->image.heads, POLICY_SKETCH);
    if (check_data_key(p, w, key, part, st) != ST_OK)
        return st->code;
    uint32_t n = sketch_tokens(ls);
    uint64_t head = REMOTE_VALUE_HEADER_LEN + 4 * (uint64_t)n;
    size_t cell = sketch_cell_bytes(&p->geom, p->image.heads);
    if (size <= head || (size - head) % cell != 0 || size > SIZE_MAX)
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %s.size is %llu: not the header, %u positions and cells of "
                          "%zu bytes",
                          w, (unsigned long long)size, n, cell);
    migrate_data *d = &p->data[p->ndata];
    *d = (migrate_data){.list = li,
                        .tier = POLICY_SKETCH,
                        .size = (size_t)size,
                        .crc = (uint32_t)crc,
                        .ntokens = n};
    if ((d->key = strdup(key)) == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    p->data_keys[p->ndata++] = d->key;
    ls->sketch_bytes = (size_t)(size - head);
    return ST_OK;
}

/* attn: null, or base64 of ntokens binary32 (migrate.h). */
static status_code parse_attn(json_t *j, const char *where, seq_export_list *ls, status *st)
{
    size_t n = ls->ntokens;
    if (json_is_null(j))
        return ST_OK;
    if (!json_is_string(j))
        return status_set(st, ST_DATA_LOSS, "manifest: %s.attn is neither null nor a string",
                          where);
    if (json_string_length(j) != b64_len(4 * n))
        return status_set(st, ST_DATA_LOSS,
                          "manifest: %s.attn has %zu characters, %zu floats take %zu", where,
                          json_string_length(j), n, b64_len(4 * n));
    ls->attn = malloc(n ? n * sizeof *ls->attn : 1);
    uint8_t *raw = malloc(n ? 4 * n : 1);
    if (ls->attn == NULL || raw == NULL) {
        free(raw);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    }
    int bad = b64_decode(json_string_value(j), json_string_length(j), raw, 4 * n);
    for (size_t i = 0; i < n && !bad; i++) {
        uint32_t bits = remote_value_position(raw, i); /* a u32, little-endian */
        memcpy(&ls->attn[i], &bits, sizeof bits);
    }
    free(raw);
    if (bad)
        return status_set(st, ST_DATA_LOSS, "manifest: %s.attn is not base64 (RFC 4648)", where);
    return ST_OK;
}

/* victim_blocks, tail, demote_due. */
static status_code parse_list_rest(json_t *o, const char *where, seq_export_list *ls, status *st)
{
    char what[64];
    uint64_t v, b, s;
    json_t *j = json_object_get(o, "victim_blocks");
    if (array_of(j, path(what, where, "victim_blocks"), 1, st))
        return st->code;
    ls->nvictim_blocks = json_array_size(j);
    if (ls->nvictim_blocks > 0 &&
        (ls->victim_blocks = malloc(ls->nvictim_blocks * sizeof *ls->victim_blocks)) == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "manifest: out of memory");
    for (size_t k = 0; k < ls->nvictim_blocks; k++) {
        if (elem_uint(j, k, what, UINT32_MAX, &v, st))
            return st->code;
        ls->victim_blocks[k] = (uint32_t)v;
    }
    j = json_object_get(o, "tail");
    if (!json_is_null(j)) {
        if (array_of(j, path(what, where, "tail"), 2, st))
            return st->code;
        if (json_array_size(j) != 2)
            return status_set(st, ST_DATA_LOSS, "manifest: %s is not null or [block, next_slot]",
                              what);
        if (elem_uint(j, 0, what, UINT32_MAX, &b, st) || elem_uint(j, 1, what, UINT32_MAX, &s, st))
            return st->code;
        ls->has_tail = 1;
        ls->tail_block = (uint32_t)b;
        ls->tail_next_slot = (uint32_t)s;
    }
    if (get_uint(o, where, "demote_due", 255, &v, st))
        return st->code;
    ls->demote_due = (uint8_t)v;
    return ST_OK;
}

/* "where.name" into buf[64]. */
static const char *path(char *buf, const char *where, const char *name)
{
    snprintf(buf, 64, "%s.%s", where, name);
    return buf;
}

/* Each data value's positions (its list's held tokens of its tier) and
 * size, now that the lists are known. */
static status_code finish_data(migrate_plan *p, status *st)
{
    for (size_t i = 0; i < p->ndata; i++) {
        migrate_data *d = &p->data[i];
        if (d->tier == POLICY_SKETCH) /* checked as parsed */
            continue;
        const seq_export_list *ls = &p->image.lists[d->list];
        uint32_t n = 0;
        for (uint32_t j = 0; j < ls->ntokens; j++)
            n += ls->at[j].tier == d->tier;
        d->ntokens = n;
        /* nblocks * block_bytes fits (parse_data); 64 + 4 * 2^32 more fits a u64. */
        uint64_t want =
            REMOTE_VALUE_HEADER_LEN + 4 * (uint64_t)n + (uint64_t)d->nblocks * p->block_bytes;
        if (d->size != want)
            return status_set(st, ST_DATA_LOSS,
                              "manifest: data[%zu].size is %zu, its %u positions and %zu blocks "
                              "make %llu",
                              i, d->size, n, d->nblocks, (unsigned long long)want);
    }
    return ST_OK;
}

status_code migrate_plan_check_origin(const migrate_plan *p, const char *ns, const char *tenant,
                                      const char *uid, status *st)
{
    static const char *const names[3] = {"ns", "tenant", "uid"};
    const char *const mine[3] = {p->ns, p->tenant, p->uid}, *asked[3] = {ns, tenant, uid};
    for (size_t i = 0; i < 3; i++)
        if (asked[i] == NULL || strcmp(mine[i], asked[i]) != 0)
            return status_set(st, ST_DATA_LOSS,
                              "manifest: written for %s %s, read under %s (stale or misplaced)",
                              names[i], mine[i], asked[i] ? asked[i] : "(null)");
    return ST_OK;
}

status_code migrate_decode_data(migrate_plan *p, size_t i, const void *buf, size_t len,
                                uint8_t *bytes, status *st)
{
    const uint8_t *blocks;
    if (migrate_check_data(p, i, buf, len, &blocks, st) != ST_OK)
        return st->code;
    const migrate_data *d = &p->data[i];
    for (size_t k = 0; blocks != NULL && k < d->nblocks; k++)
        memcpy(bytes + (size_t)d->blocks[k] * p->block_bytes, blocks + k * p->block_bytes,
               p->block_bytes);
    return ST_OK;
}

status_code migrate_check_data(migrate_plan *p, size_t i, const void *buf, size_t len,
                               const uint8_t **blocks, status *st)
{
    *blocks = NULL;
    if (i >= p->ndata)
        return status_set(st, ST_INVALID_ARGUMENT, "migrate: data value %zu of %zu", i, p->ndata);
    const migrate_data *d = &p->data[i];
    const seq_export_list *ls = &p->image.lists[d->list];
    uint32_t layer = d->list / p->image.heads, head = d->list % p->image.heads;
    if (len != d->size)
        return status_set(st, ST_DATA_LOSS,
                          "%s: %zu bytes, the manifest says %zu (truncated, or stale)", d->key, len,
                          d->size);
    uint32_t crc = checksum_crc32(0, buf, len);
    if (crc != d->crc)
        return status_set(st, ST_DATA_LOSS,
                          "%s: crc 0x%08x, the manifest says 0x%08x (stale, or another value)",
                          d->key, crc, d->crc);
    remote_value_header h;
    const uint8_t *pos, *payload;
    if (remote_value_decode(buf, len, &h, &pos, &payload, st) != ST_OK)
        return restate(st, ST_DATA_LOSS, d->key);
    if (remote_value_check_geometry(&h, &p->geom, p->quant_group, st) != ST_OK)
        return restate(st, ST_DATA_LOSS, d->key);
    int sketch = d->tier == POLICY_SKETCH;
    size_t plen = sketch ? ls->sketch_bytes : d->nblocks * p->block_bytes;
    if (h.kind != value_kind(d->tier) || h.tier != d->tier || h.layer != layer || h.head != head ||
        h.ntokens != d->ntokens || h.payload_len != plen)
        return status_set(st, ST_DATA_LOSS,
                          "%s: kind %u tier %s layer %u head %u, %u positions, %llu payload "
                          "bytes; the manifest wants kind %u, %s, %u, %u, %u, %zu",
                          d->key, h.kind, policy_tier_name(h.tier), h.layer, h.head, h.ntokens,
                          (unsigned long long)h.payload_len, value_kind(d->tier),
                          policy_tier_name(d->tier), layer, head, d->ntokens, plen);
    for (uint32_t j = 0, k = 0; j < ls->ntokens; j++) {
        if (ls->at[j].tier != d->tier)
            continue;
        uint32_t got = remote_value_position(pos, k);
        if (got != ls->positions[j])
            return status_set(st, ST_DATA_LOSS, "%s: position %u is %u, the manifest's list has %u",
                              d->key, k, got, ls->positions[j]);
        k++;
    }
    if (sketch)
        return decode_sketch(p, d, payload, st);
    *blocks = payload;
    return ST_OK;
}

/* A list's sketch value, checked: its cells into the image (a fetched
 * value of that size exists, so the copy is bounded by what was read). */
static status_code decode_sketch(migrate_plan *p, const migrate_data *d, const uint8_t *payload,
                                 status *st)
{
    seq_export_list *ls = &p->image.lists[d->list];
    uint8_t *cells = malloc(ls->sketch_bytes);
    if (cells == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "%s: out of memory for %zu bytes", d->key,
                          ls->sketch_bytes);
    memcpy(cells, payload, ls->sketch_bytes);
    free(ls->sketch);
    ls->sketch = cells;
    return ST_OK;
}

void migrate_plan_free(migrate_plan *p)
{
    if (p == NULL)
        return;
    seq_export_free(&p->image);
    for (size_t i = 0; i < POLICY_MAX_PARAMS; i++)
        free(p->param_keys[i]);
    for (size_t i = 0; i < p->ndata; i++) {
        free(p->data[i].key);
        free(p->data[i].blocks);
    }
    free(p->data);
    free(p->data_keys); /* its strings are data[i].key */
    memset(p, 0, sizeof *p);
}

/* ---- JSON fields ---------------------------------------------------------- */

/* o is an object with exactly the fields names[0..n). */
static status_code fields(json_t *o, const char *where, const char *const *names, size_t n,
                          status *st)
{
    if (!json_is_object(o))
        return status_set(st, ST_DATA_LOSS, "manifest: %s is not an object",
                          where[0] ? where : "the top level");
    for (size_t i = 0; i < n; i++)
        if (json_object_get(o, names[i]) == NULL)
            return status_set(st, ST_DATA_LOSS, "manifest: %s%s%s missing", where,
                              where[0] ? "." : "", names[i]);
    if (json_object_size(o) != n) {
        const char *k;
        json_t *v;
        json_object_foreach(o, k, v)
        {
            size_t i = 0;
            while (i < n && strcmp(k, names[i]) != 0)
                i++;
            if (i == n)
                return status_set(st, ST_DATA_LOSS, "manifest: %s%sunexpected field \"%.40s\"",
                                  where, where[0] ? ": " : "", k);
        }
    }
    return ST_OK;
}

static status_code get(json_t *o, const char *where, const char *name, json_t **out, status *st)
{
    *out = json_object_get(o, name);
    if (*out == NULL)
        return status_set(st, ST_DATA_LOSS, "manifest: %s%s%s missing", where, where[0] ? "." : "",
                          name);
    return ST_OK;
}

/* An unsigned JSON integer in [0, max]. */
static status_code check_uint(json_t *j, const char *what, const char *sub, uint64_t max,
                              uint64_t *v, status *st)
{
    if (!json_is_integer(j))
        return status_set(st, ST_DATA_LOSS, "manifest: %s%s is not an integer", what, sub);
    json_int_t n = json_integer_value(j);
    if (n < 0 || (uint64_t)n > max)
        return status_set(st, ST_DATA_LOSS, "manifest: %s%s = %lld, out of [0, %llu]", what, sub,
                          (long long)n, (unsigned long long)max);
    *v = (uint64_t)n;
    return ST_OK;
}

static status_code get_uint(json_t *o, const char *where, const char *name, uint64_t max,
                            uint64_t *v, status *st)
{
    json_t *j;
    char what[96];
    if (get(o, where, name, &j, st))
        return st->code;
    snprintf(what, sizeof what, "%s%s%s", where, where[0] ? "." : "", name);
    return check_uint(j, what, "", max, v, st);
}

/* A string of at most maxlen bytes, no NUL, into out[maxlen + 1]. */
static status_code get_string(json_t *o, const char *where, const char *name, size_t maxlen,
                              char *out, status *st)
{
    json_t *j;
    if (get(o, where, name, &j, st))
        return st->code;
    if (!json_is_string(j) || json_string_length(j) > maxlen ||
        strlen(json_string_value(j)) != json_string_length(j))
        return status_set(st, ST_DATA_LOSS, "manifest: %s%s%s is not a string of at most %zu bytes",
                          where, where[0] ? "." : "", name, maxlen);
    memcpy(out, json_string_value(j), json_string_length(j) + 1);
    return ST_OK;
}

static status_code elem_uint(json_t *a, size_t i, const char *what, uint64_t max, uint64_t *v,
                             status *st)
{
    char sub[32];
    snprintf(sub, sizeof sub, "[%zu]", i);
    return check_uint(json_array_get(a, i), what, sub, max, v, st);
}

/* j is an array of groups of `group` elements. */
static status_code array_of(json_t *j, const char *what, size_t group, status *st)
{
    if (!json_is_array(j))
        return status_set(st, ST_DATA_LOSS, "manifest: %s is not an array", what);
    if (json_array_size(j) % group != 0)
        return status_set(st, ST_DATA_LOSS, "manifest: %s has %zu ints, not groups of %zu", what,
                          json_array_size(j), group);
    return ST_OK;
}

/* Exactly n positions from runs [start, count, ...]: count >= 1, ascending,
 * not overlapping, start + count <= limit (<= 2^32). */
static status_code runs_positions(json_t *a, const char *what, uint64_t limit, uint32_t *out,
                                  size_t n, status *st)
{
    if (array_of(a, what, 2, st))
        return st->code;
    size_t k = 0;
    uint64_t next = 0;
    for (size_t i = 0; i < json_array_size(a); i += 2) {
        uint64_t start, count;
        if (elem_uint(a, i, what, limit, &start, st) ||
            elem_uint(a, i + 1, what, limit, &count, st))
            return st->code;
        const char *why = count == 0              ? "is empty"
                          : start < next          ? "overlaps or precedes the run before"
                          : start + count > limit ? "ends past appended"
                          : count > n - k         ? "holds more than the count"
                                                  : NULL;
        if (why != NULL)
            return status_set(st, ST_DATA_LOSS, "manifest: %s: run %zu [%llu, %llu] %s (%zu)", what,
                              i / 2, (unsigned long long)start, (unsigned long long)count, why, n);
        for (uint64_t c = 0; c < count; c++)
            out[k++] = (uint32_t)(start + c);
        next = start + count;
    }
    if (k != n)
        return status_set(st, ST_DATA_LOSS, "manifest: %s: %zu positions, the count is %zu", what,
                          k, n);
    return ST_OK;
}

/* Exactly n tiers from runs [tier, count, ...]. */
static status_code runs_tiers(json_t *a, const char *what, uint8_t *out, size_t n, status *st)
{
    if (array_of(a, what, 2, st))
        return st->code;
    size_t k = 0;
    for (size_t i = 0; i < json_array_size(a); i += 2) {
        uint64_t t, count;
        if (elem_uint(a, i, what, 255, &t, st) || elem_uint(a, i + 1, what, n, &count, st))
            return st->code;
        if (count == 0 || count > n - k)
            return status_set(st, ST_DATA_LOSS,
                              "manifest: %s: run of %llu, empty or past the count %zu", what,
                              (unsigned long long)count, n);
        memset(out + k, (int)t, (size_t)count);
        k += (size_t)count;
    }
    if (k != n)
        return status_set(st, ST_DATA_LOSS, "manifest: %s: %zu tiers, the count is %zu", what, k,
                          n);
    return ST_OK;
}

/* Exactly n places from runs [block, slot, count, ...]; a place's tier is
 * its block's, so the block must be one of the export's. */
static status_code runs_at(json_t *a, const char *what, const migrate_plan *p, tier_token *out,
                           size_t n, status *st)
{
    if (array_of(a, what, 3, st))
        return st->code;
    size_t k = 0;
    for (size_t i = 0; i < json_array_size(a); i += 3) {
        uint64_t b, slot, count;
        if (elem_uint(a, i, what, UINT32_MAX, &b, st) ||
            elem_uint(a, i + 1, what, UINT32_MAX, &slot, st) ||
            elem_uint(a, i + 2, what, n, &count, st))
            return st->code;
        /* Format 2: [MIGRATE_SKETCH_BLOCK, 0, count] are tokens in the sketch. */
        int sketch = p->format >= 2 && b == MIGRATE_SKETCH_BLOCK;
        const char *why = sketch && slot != 0                ? "is in the sketch at a slot not 0"
                          : !sketch && b >= p->image.nblocks ? "names a block past nblocks"
                          : count == 0                       ? "is empty"
                          : count > n - k                    ? "holds more than the count"
                          : slot + count > UINT32_MAX        ? "runs past slot 2^32 - 2"
                                                             : NULL;
        if (why != NULL)
            return status_set(st, ST_DATA_LOSS,
                              "manifest: %s: run %zu [%llu, %llu, %llu] %s (%zu blocks, %zu "
                              "places)",
                              what, i / 3, (unsigned long long)b, (unsigned long long)slot,
                              (unsigned long long)count, why, p->image.nblocks, n);
        for (uint64_t c = 0; c < count; c++)
            out[k++] =
                sketch ? (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH}
                       : (tier_token){(uint32_t)b, (uint32_t)(slot + c), p->image.block_tier[b]};
    }
    if (k != n)
        return status_set(st, ST_DATA_LOSS, "manifest: %s: %zu places, the count is %zu", what, k,
                          n);
    return ST_OK;
}

/* ---- spilled victims --------------------------------------------------- */

status_code migrate_encode_spill(const pool_geometry *g, uint32_t quant_group,
                                 const seq_spill_block *b, const uint8_t *bytes, const char *ns,
                                 const char *tenant, const char *uid, remote_kv *out, status *st)
{
    *out = (remote_kv){0};
    char part[12], *key = malloc(REMOTE_KEY_CAP);
    seq_spill_key_part(b->part, part);
    if (key == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (remote_key(key, REMOTE_KEY_CAP, ns, tenant, uid, part, st) != ST_OK) {
        free(key);
        return st->code;
    }
    remote_value_header h = header_of(g, value_kind(b->tier), b->tier, quant_group, b->layer,
                                      b->head, (uint32_t)b->npositions, b->bytes);
    size_t size = remote_value_size(&h);
    uint8_t *val = size == SIZE_MAX ? NULL : malloc(size);
    if (val == NULL) {
        free(key);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory for a %zu-byte value", size);
    }
    if (remote_value_encode(&h, b->positions, bytes, val, size, st) != ST_OK) {
        free(val);
        free(key);
        return restate(st, ST_INVALID_ARGUMENT, part);
    }
    *out = (remote_kv){key, val, size};
    return ST_OK;
}

status_code migrate_decode_spill(const void *buf, size_t len, const char *key,
                                 const pool_geometry *g, uint32_t quant_group,
                                 const seq_remote_part *want, const uint8_t **payload, status *st)
{
    remote_value_header h;
    const uint8_t *pos, *pl;
    if (remote_value_decode(buf, len, &h, &pos, &pl, st) != ST_OK ||
        remote_value_check_geometry(&h, g, quant_group, st) != ST_OK)
        return restate(st, ST_DATA_LOSS, key);
    if (h.kind != value_kind(want->tier) || h.tier != want->tier || h.layer != want->layer ||
        h.head != want->head || h.ntokens != want->npositions || h.payload_len != want->bytes)
        return status_set(st, ST_DATA_LOSS,
                          "%s: kind %u tier %s layer %u head %u, %u positions, %llu payload "
                          "bytes; the sequence wants kind %u, %s, %u, %u, %zu, %zu",
                          key, h.kind, policy_tier_name(h.tier), h.layer, h.head, h.ntokens,
                          (unsigned long long)h.payload_len, value_kind(want->tier),
                          policy_tier_name(want->tier), want->layer, want->head, want->npositions,
                          want->bytes);
    for (size_t k = 0; k < want->npositions; k++) {
        uint32_t got = remote_value_position(pos, k);
        if (got != want->positions[k])
            return status_set(st, ST_DATA_LOSS,
                              "%s: position %zu is %u, the sequence's victim there is %u", key, k,
                              got, want->positions[k]);
    }
    *payload = pl;
    return ST_OK;
}
