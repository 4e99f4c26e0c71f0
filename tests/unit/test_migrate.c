/*
 * Unit tests of daemon/migrate.h: a sequence image (seq_export) built by
 * hand (2 layers x 2 heads: FULL, INT8, INT4 and INT2 tokens, victims in
 * their own INT8 blocks and in shared FULL slots, a FULL block holding only
 * victims, tails, attention and none, an empty list), seeded, with random
 * block bytes. Encoded: the manifest comes last, every key carries the hash
 * tag; decoded: the image equals the original field by field and the
 * blocks byte for byte. Then every way to be wrong is DATA_LOSS, never
 * success: a flipped byte and a truncation of each value, data values
 * swapped, stale values from another export (another uid, other bytes, an
 * older manifest), every manifest field missing, mistyped or unexpected,
 * absurd counts (2^31 tokens, 2^31 blocks), inconsistent entries; another
 * geometry, block size, quant_group or format is FAILED_PRECONDITION; and
 * seeded random mutations of the manifest never crash (run under ASan).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>

#include "kernels.h"
#include "migrate.h"
#include "policy.h"
#include "remote_value.h"

/* ---- helpers ------------------------------------------------------------- */

/* splitmix64: the tests' only randomness, seeded. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 2 layers, per-head lists of 2 KV heads: lists (l, k) at l * 2 + k. */
static const pool_geometry geom = {2, 4, 2, 8, 4, POOL_FP16, 10000.0f};
#define QG 4
#define NLISTS 4
#define APPENDED 160
#define NS "kvs-test"
#define TENANT "tenant-7"
#define UID "0123456789abcdef0123456789abcdef"
#define UID2 "fedcba9876543210fedcba9876543210"

static size_t bb(void)
{
    kv_layout l = {geom.kv_heads, geom.block_tokens, geom.head_dim, 2, 0};
    return kv_block_bytes(&l);
}

/* Nominal slots a block of each tier holds (the codec does not check). */
static const uint32_t tier_slots[POLICY_TIERS] = {8, 14, 0, 0, 24, 40};

typedef struct list_spec {
    uint32_t ntokens, nvictims;
    uint8_t tiers[2]; /* storage tiers the tokens pick from */
    int attn, tail;
    int victims_alone; /* victims in a FULL block of their own, else INT8 blocks / FULL slots */
    uint8_t demote_due;
    uint32_t sketch_cells; /* the list's sketch: 0 none */
    int sketch_victims;    /* victims in the sketch (victims=sketch) */
} list_spec;

/* A sketch cell of a per-head list: key and value rows of head_dim floats
 * and a count (tier_sketch_bytes_for(1, 1, head_dim)). */
#define CELL (2 * 4 * 8 + 4)

typedef struct builder {
    seq_export x;
    uint64_t rng;
    uint32_t open[NLISTS][POLICY_TIERS][2]; /* [shared, own] block, UINT32_MAX: none */
    uint32_t next[NLISTS][POLICY_TIERS][2];
} builder;

static uint32_t add_block(builder *b, uint32_t list, uint8_t tier)
{
    seq_export *x = &b->x;
    size_t i = x->nblocks++;
    x->blocks = realloc(x->blocks, x->nblocks * sizeof *x->blocks);
    x->block_tier = realloc(x->block_tier, x->nblocks);
    x->block_list = realloc(x->block_list, x->nblocks * sizeof *x->block_list);
    assert_non_null(x->blocks);
    assert_non_null(x->block_tier);
    assert_non_null(x->block_list);
    x->blocks[i] = 1000 + 3 * (uint32_t)i;
    x->block_tier[i] = tier;
    x->block_list[i] = list;
    return (uint32_t)i;
}

/* A slot of list's open block of tier in pool `own` (0: shared with held
 * tokens, 1: victims' own), opening a block when it is full. */
static tier_token place(builder *b, uint32_t list, uint8_t tier, int own)
{
    if (tier == POLICY_SKETCH) /* no block: seq.h seq_export_list */
        return (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH};
    uint32_t *open = &b->open[list][tier][own], *next = &b->next[list][tier][own];
    if (*open == UINT32_MAX || *next == tier_slots[tier]) {
        *open = add_block(b, list, tier);
        *next = 0;
        seq_export_list *ls = &b->x.lists[list];
        if (own && tier == POLICY_INT8) {
            ls->victim_blocks =
                realloc(ls->victim_blocks, (ls->nvictim_blocks + 1) * sizeof *ls->victim_blocks);
            assert_non_null(ls->victim_blocks);
            ls->victim_blocks[ls->nvictim_blocks++] = *open;
        }
    }
    return (tier_token){*open, (*next)++, tier};
}

static void build_list(builder *b, uint32_t li, const list_spec *sp)
{
    seq_export_list *ls = &b->x.lists[li];
    uint32_t m = sp->ntokens + sp->nvictims, all[APPENDED - 1];
    /* m distinct positions in [1, APPENDED), ascending; then which are victims. */
    for (uint32_t i = 0; i < APPENDED - 1; i++)
        all[i] = i + 1;
    for (uint32_t i = 0; i < m; i++) {
        uint32_t j = i + (uint32_t)(rng_next(&b->rng) % (APPENDED - 1 - i)), t = all[i];
        all[i] = all[j];
        all[j] = t;
    }
    for (uint32_t i = 1; i < m; i++)
        for (uint32_t j = i; j > 0 && all[j - 1] > all[j]; j--) {
            uint32_t t = all[j];
            all[j] = all[j - 1];
            all[j - 1] = t;
        }
    uint8_t victim[APPENDED] = {0};
    for (uint32_t v = 0; v < sp->nvictims;) {
        uint32_t i = (uint32_t)(rng_next(&b->rng) % m);
        if (!victim[i]) {
            victim[i] = 1;
            v++;
        }
    }
    ls->ntokens = sp->ntokens;
    ls->nvictims = sp->nvictims;
    if (m > 0) {
        ls->positions = malloc(sp->ntokens * sizeof *ls->positions + 1);
        ls->tiers = malloc(sp->ntokens + 1);
        ls->at = malloc(sp->ntokens * sizeof *ls->at + 1);
        ls->victims = malloc(sp->nvictims * sizeof *ls->victims + 1);
        ls->victim_at = malloc(sp->nvictims * sizeof *ls->victim_at + 1);
    }
    if (sp->attn)
        ls->attn = malloc(sp->ntokens * sizeof *ls->attn + 1);
    for (uint32_t i = 0, j = 0, v = 0; i < m; i++) {
        uint64_t r = rng_next(&b->rng);
        if (victim[i]) {
            ls->victims[v] = all[i];
            ls->victim_at[v++] = sp->sketch_victims  ? place(b, li, POLICY_SKETCH, 1)
                                 : sp->victims_alone ? place(b, li, POLICY_FULL, 1)
                                 : r & 1             ? place(b, li, POLICY_INT8, 1)
                                                     : place(b, li, POLICY_FULL, 0);
            continue;
        }
        uint8_t t = sp->tiers[r % 2];
        ls->positions[j] = all[i];
        ls->at[j] = place(b, li, t, 0);
        /* The host's tier may lead the storage's (a demotion not yet due). */
        ls->tiers[j] = t == POLICY_FULL && (r >> 8) % 5 == 0 ? POLICY_INT8 : t;
        if (ls->attn) {
            float a = (float)((int)((r >> 16) % 20001) - 10000) / 7.0f;
            ls->attn[j] = j == 0 ? -0.0f : j == 1 ? 1e-40f : a;
        }
        j++;
    }
    if (sp->tail && b->open[li][POLICY_FULL][0] != UINT32_MAX) {
        ls->has_tail = 1;
        ls->tail_block = b->open[li][POLICY_FULL][0];
        ls->tail_next_slot = b->next[li][POLICY_FULL][0];
    }
    ls->demote_due = sp->demote_due;
    if (sp->sketch_cells > 0) {
        ls->sketch_bytes = (size_t)sp->sketch_cells * CELL;
        ls->sketch = malloc(ls->sketch_bytes);
        assert_non_null(ls->sketch);
        for (size_t i = 0; i < ls->sketch_bytes; i++)
            ls->sketch[i] = (uint8_t)rng_next(&b->rng);
    }
}

/* The synthetic export of `seed`; `sketched`: with count-sketches (list
 * 0 holds tokens in one, list 1 has an empty one, list 2's victims are in
 * one, list 3 has none). */
static void build_with(seq_export *out, uint64_t seed, int sketched)
{
    builder b;
    memset(&b, 0, sizeof b);
    memset(b.open, 0xff, sizeof b.open);
    b.rng = seed;
    seq_export *x = &b.x;
    snprintf(x->policy, sizeof x->policy, "tova");
    snprintf(x->label, sizeof x->label,
             "run %llu: \xc3\xbc"
             "n\xc3\xaf"
             "code \"quoted\"",
             (unsigned long long)seed);
    static const char *const keys[] = {"window", "sink", "victims"};
    static const char *const values[] = {"64", "4", "int8"};
    x->params.count = 3;
    for (size_t i = 0; i < 3; i++) {
        x->params.key[i] = keys[i];
        snprintf(x->params.value[i], sizeof x->params.value[i], "%s", values[i]);
    }
    x->appended = APPENDED;
    x->unstepped = 3;
    x->host_steps = 41 + seed;
    const uint64_t moved[POLICY_TIERS] = {5, 7, 0, 0, 2, 1ull << 40};
    memcpy(x->moved, moved, sizeof moved);
    x->requantized = 9;
    x->victims_dropped = 1ull << 33;
    x->layers = geom.layers;
    x->heads = geom.kv_heads;
    x->lists = calloc(NLISTS, sizeof *x->lists);
    assert_non_null(x->lists);
    uint32_t r = (uint32_t)(rng_next(&b.rng) % 16);
    const list_spec plain[NLISTS] = {
        {30 + r, 7, {POLICY_FULL, POLICY_INT8}, 1, 1, 0, 0, 0, 0},
        {0, 0, {POLICY_FULL, POLICY_FULL}, 0, 0, 0, 0, 0, 0},
        {20 + r / 2, 0, {POLICY_FULL, POLICY_INT4}, 0, 1, 0, 1, 0, 0},
        {10, 5, {POLICY_INT8, POLICY_INT2}, 1, 0, 1, 3, 0, 0},
    };
    const list_spec with_sketch[NLISTS] = {
        {30 + r, 7, {POLICY_FULL, POLICY_SKETCH}, 1, 1, 0, 0, 12 + r, 0},
        {0, 0, {POLICY_FULL, POLICY_FULL}, 0, 0, 0, 0, 3, 0},
        {20 + r / 2, 9, {POLICY_FULL, POLICY_INT4}, 0, 1, 0, 1, 6, 1},
        {10, 5, {POLICY_INT8, POLICY_INT2}, 1, 0, 1, 3, 0, 0},
    };
    const list_spec *specs = sketched ? with_sketch : plain;
    /* Lists out of order, so that export indices interleave lists. */
    static const uint32_t order[NLISTS] = {2, 0, 3, 1};
    for (size_t i = 0; i < NLISTS; i++)
        build_list(&b, order[i], &specs[order[i]]);
    /* A policy's per-layer state: bytes of any value, one layer empty. */
    x->states = calloc(x->layers, sizeof *x->states);
    x->state_len = calloc(x->layers, sizeof *x->state_len);
    assert_true(x->states != NULL && x->state_len != NULL);
    for (uint32_t l = 0; l < x->layers; l++) {
        x->state_len[l] = l == 0 ? 0 : 1 + rng_next(&b.rng) % 100;
        x->states[l] = malloc(x->state_len[l] + 1);
        assert_non_null(x->states[l]);
        for (size_t i = 0; i < x->state_len[l]; i++)
            x->states[l][i] = (uint8_t)rng_next(&b.rng);
    }
    *out = b.x;
}

static void build(seq_export *out, uint64_t seed)
{
    build_with(out, seed, 0);
}

/* The synthetic export's arrays (each one malloc), or a decoded one's. */
static void export_free(seq_export *x)
{
    for (size_t i = 0; x->lists != NULL && i < (size_t)x->layers * x->heads; i++) {
        seq_export_list *ls = &x->lists[i];
        free(ls->positions);
        free(ls->tiers);
        free(ls->attn);
        free(ls->at);
        free(ls->victims);
        free(ls->victim_at);
        free(ls->victim_blocks);
        free(ls->sketch);
    }
    free(x->lists);
    for (uint32_t l = 0; x->states != NULL && l < x->layers; l++)
        free(x->states[l]);
    free(x->states);
    free(x->state_len);
    free(x->blocks);
    free(x->block_tier);
    free(x->block_list);
    memset(x, 0, sizeof *x);
}

static uint8_t *random_bytes(size_t n, uint64_t seed)
{
    uint8_t *p = malloc(n + 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(&seed);
    return p;
}

static void assert_at_equal(const tier_token *a, const tier_token *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(a[i].block, b[i].block);
        assert_int_equal(a[i].slot, b[i].slot);
        assert_int_equal(a[i].tier, b[i].tier);
    }
}

static void assert_export_equal(const seq_export *a, const seq_export *d)
{
    assert_string_equal(a->policy, d->policy);
    assert_string_equal(a->label, d->label);
    assert_int_equal(a->params.count, d->params.count);
    for (size_t i = 0; i < a->params.count; i++) {
        assert_string_equal(a->params.key[i], d->params.key[i]);
        assert_string_equal(a->params.value[i], d->params.value[i]);
    }
    assert_true(a->appended == d->appended);
    assert_int_equal(a->unstepped, d->unstepped);
    assert_true(a->host_steps == d->host_steps);
    assert_memory_equal(a->moved, d->moved, sizeof a->moved);
    assert_true(a->requantized == d->requantized);
    assert_true(a->victims_dropped == d->victims_dropped);
    assert_int_equal(a->layers, d->layers);
    assert_int_equal(a->heads, d->heads);
    assert_int_equal(a->nblocks, d->nblocks);
    assert_null(d->blocks); /* the writer's pool ids stay there */
    assert_int_equal(a->states == NULL, d->states == NULL);
    for (uint32_t l = 0; a->states != NULL && l < a->layers; l++) {
        assert_int_equal(a->state_len[l], d->state_len[l]);
        if (a->state_len[l] > 0)
            assert_memory_equal(a->states[l], d->states[l], a->state_len[l]);
    }
    if (a->nblocks > 0) {
        assert_memory_equal(a->block_tier, d->block_tier, a->nblocks);
        assert_memory_equal(a->block_list, d->block_list, a->nblocks * sizeof *a->block_list);
    }
    for (size_t li = 0; li < (size_t)a->layers * a->heads; li++) {
        const seq_export_list *x = &a->lists[li], *y = &d->lists[li];
        assert_int_equal(x->ntokens, y->ntokens);
        if (x->ntokens > 0) {
            assert_memory_equal(x->positions, y->positions, x->ntokens * sizeof *x->positions);
            assert_memory_equal(x->tiers, y->tiers, x->ntokens);
        }
        assert_at_equal(x->at, y->at, x->ntokens);
        assert_int_equal(x->attn == NULL, y->attn == NULL);
        if (x->attn != NULL && x->ntokens > 0) /* bit for bit: -0, denormals */
            assert_memory_equal(x->attn, y->attn, x->ntokens * sizeof *x->attn);
        assert_int_equal(x->nvictims, y->nvictims);
        if (x->nvictims > 0)
            assert_memory_equal(x->victims, y->victims, x->nvictims * sizeof *x->victims);
        assert_at_equal(x->victim_at, y->victim_at, x->nvictims);
        assert_int_equal(x->nvictim_blocks, y->nvictim_blocks);
        if (x->nvictim_blocks > 0)
            assert_memory_equal(x->victim_blocks, y->victim_blocks,
                                x->nvictim_blocks * sizeof *x->victim_blocks);
        assert_int_equal(x->has_tail, y->has_tail);
        assert_int_equal(x->tail_block, y->tail_block);
        assert_int_equal(x->tail_next_slot, y->tail_next_slot);
        assert_int_equal(x->demote_due, y->demote_due);
        assert_int_equal(x->sketch_bytes, y->sketch_bytes);
        if (x->sketch_bytes > 0) { /* byte for byte */
            assert_non_null(y->sketch);
            assert_memory_equal(x->sketch, y->sketch, x->sketch_bytes);
        } else {
            assert_null(y->sketch);
        }
    }
}

static void encode(const seq_export *x, const uint8_t *bytes, const char *uid, migrate_values *v)
{
    status st;
    status_code rc = migrate_encode(x, &geom, QG, bb(), bytes, NS, TENANT, uid, v, &st);
    if (rc != ST_OK)
        fail_msg("encode: %s", st.msg);
}

static const remote_kv *manifest_of(const migrate_values *v)
{
    return &v->kv[v->n - 1];
}

/* The value of v named key, NULL when none. */
static const remote_kv *find(const migrate_values *v, const char *key)
{
    for (size_t i = 0; i < v->n; i++)
        if (strcmp(v->kv[i].key, key) == 0)
            return &v->kv[i];
    return NULL;
}

/* Decode manifest m and every data value it names from v, as a reader
 * would; *bytes (malloc'd, 0xa5 where nothing was written) holds the blocks. */
static status_code decode_all(const migrate_values *v, const void *m, size_t mlen, uint32_t qg,
                              migrate_plan *p, uint8_t **bytes, status *st)
{
    *bytes = NULL;
    status_code rc = migrate_decode_manifest(m, mlen, &geom, qg, p, st);
    if (rc != ST_OK)
        return rc;
    size_t n = p->image.nblocks * p->block_bytes;
    *bytes = malloc(n + 1);
    assert_non_null(*bytes);
    memset(*bytes, 0xa5, n + 1);
    for (size_t i = 0; i < p->ndata; i++) {
        const remote_kv *kv = find(v, p->data[i].key);
        if (kv == NULL)
            return status_set(st, ST_NOT_FOUND, "%s", p->data[i].key);
        if ((rc = migrate_decode_data(p, i, kv->val, kv->len, *bytes, st)) != ST_OK)
            return rc;
    }
    return ST_OK;
}

/* A copy of value kv with byte `at` xor-ed with `mask`. */
static uint8_t *flipped(const remote_kv *kv, size_t at, uint8_t mask)
{
    uint8_t *c = malloc(kv->len);
    assert_non_null(c);
    memcpy(c, kv->val, kv->len);
    c[at] ^= mask;
    return c;
}

/* ---- manifest surgery ------------------------------------------------------ */

/* One edit of the manifest's JSON: field of the object root (in NULL),
 * or of root[in][idx]; set to value (not stolen), or deleted (NULL). */
typedef struct edit {
    const char *in;
    size_t idx;
    const char *field;
    json_t *value;
} edit;

typedef void (*mutator)(json_t *root, void *arg);

/* Edits until one whose field is NULL. */
static void apply_edits(json_t *root, void *arg)
{
    for (const edit *e = arg; e->field != NULL; e++) {
        json_t *o = e->in ? json_array_get(json_object_get(root, e->in), e->idx) : root;
        assert_non_null(o);
        if (e->value != NULL)
            assert_int_equal(json_object_set(o, e->field, e->value), 0);
        else
            assert_int_equal(json_object_del(o, e->field), 0);
    }
}

/* The manifest m with its JSON changed by fn, as a valid value (header and
 * checksum rewritten): what a buggy or hostile writer could store. */
static uint8_t *remanifest(const remote_kv *m, mutator fn, void *arg, size_t *len)
{
    remote_value_header h;
    const uint8_t *payload;
    status st;
    assert_int_equal(remote_value_decode(m->val, m->len, &h, NULL, &payload, &st), ST_OK);
    json_error_t e;
    json_t *root = json_loadb((const char *)payload, (size_t)h.payload_len, 0, &e);
    assert_non_null(root);
    fn(root, arg);
    char *text = json_dumps(root, JSON_COMPACT);
    assert_non_null(text);
    h.payload_len = strlen(text);
    *len = remote_value_size(&h);
    uint8_t *out = malloc(*len);
    assert_non_null(out);
    assert_int_equal(remote_value_encode(&h, NULL, text, out, *len, &st), ST_OK);
    free(text);
    json_decref(root);
    return out;
}

/* Decode the manifest edited by edits (and, if it decodes, the data):
 * the first failure's code. */
static status_code try_edits(const migrate_values *v, const edit *edits, status *st)
{
    size_t len;
    uint8_t *m = remanifest(manifest_of(v), apply_edits, (void *)edits, &len), *bytes;
    migrate_plan p;
    status_code rc = decode_all(v, m, len, QG, &p, &bytes, st);
    migrate_plan_free(&p);
    free(bytes);
    free(m);
    return rc;
}

/* A fixture: export of a seed, its bytes and values. */
typedef struct fixture {
    seq_export x;
    uint8_t *bytes;
    migrate_values v;
} fixture;

static void fixture_make_with(fixture *f, uint64_t seed, const char *uid, int sketched)
{
    build_with(&f->x, seed, sketched);
    f->bytes = random_bytes(f->x.nblocks * bb(), seed * 31 + 7);
    encode(&f->x, f->bytes, uid, &f->v);
}

static void fixture_make(fixture *f, uint64_t seed, const char *uid)
{
    fixture_make_with(f, seed, uid, 0);
}

static void fixture_free(fixture *f)
{
    migrate_values_free(&f->v);
    export_free(&f->x);
    free(f->bytes);
}

/* ---- round trips ----------------------------------------------------------- */

static void test_round_trip(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 24; seed++) {
        fixture f;
        fixture_make(&f, seed, UID);
        const migrate_values *v = &f.v;

        /* One data value per (list, tier) with blocks, then the manifest. */
        uint8_t has[NLISTS][POLICY_TIERS] = {{0}};
        size_t groups = 0, total = 0;
        for (size_t b = 0; b < f.x.nblocks; b++)
            groups += !has[f.x.block_list[b]][f.x.block_tier[b]]++;
        assert_int_equal(v->n, groups + 1);
        for (size_t i = 0; i < v->n; i++) {
            status st;
            remote_value_header h;
            const char *k = v->kv[i].key;
            assert_non_null(strstr(k, "{" TENANT ":" UID "}"));
            assert_int_equal(strncmp(k, "kvs:" NS ":{", strlen("kvs:" NS ":{")), 0);
            assert_int_equal(remote_value_decode(v->kv[i].val, v->kv[i].len, &h, NULL, NULL, &st),
                             ST_OK);
            int last = i == v->n - 1;
            assert_int_equal(h.kind, last ? REMOTE_VALUE_MANIFEST : REMOTE_VALUE_TOKENS);
            const char *part = strrchr(k, ':') + 1;
            if (last) {
                assert_string_equal(part, "manifest");
            } else {
                char want[64];
                snprintf(want, sizeof want, "l%u.h%u.%s", h.layer, h.head,
                         policy_tier_name(h.tier));
                assert_string_equal(part, want);
                assert_true(h.payload_len % bb() == 0);
            }
            total += v->kv[i].len;
        }
        assert_int_equal(v->bytes, total);
        /* List 3's FULL block holds only victims: a value with no positions. */
        char key[REMOTE_KEY_CAP];
        status st;
        assert_int_equal(remote_key(key, sizeof key, NS, TENANT, UID, "l1.h1.full", &st), ST_OK);
        const remote_kv *alone = find(v, key);
        assert_non_null(alone);
        remote_value_header h;
        assert_int_equal(remote_value_decode(alone->val, alone->len, &h, NULL, NULL, &st), ST_OK);
        assert_int_equal(h.ntokens, 0);
        assert_true(h.payload_len > 0);
        /* The empty list (l0.h1) has none. */
        assert_int_equal(remote_key(key, sizeof key, NS, TENANT, UID, "l0.h1.full", &st), ST_OK);
        assert_null(find(v, key));

        migrate_plan p;
        uint8_t *bytes;
        status_code rc =
            decode_all(v, manifest_of(v)->val, manifest_of(v)->len, QG, &p, &bytes, &st);
        if (rc != ST_OK)
            fail_msg("seed %llu: %s", (unsigned long long)seed, st.msg);
        assert_int_equal(p.ndata, v->n - 1);
        assert_int_equal(p.block_bytes, bb());
        assert_int_equal(migrate_plan_check_origin(&p, NS, TENANT, UID, &st), ST_OK);
        assert_export_equal(&f.x, &p.image);
        assert_memory_equal(bytes, f.bytes, f.x.nblocks * bb());
        assert_int_equal(bytes[f.x.nblocks * bb()], 0xa5); /* nothing past the end */
        /* The keys the image owns outlive nothing but the plan. */
        for (size_t i = 0; i < p.image.params.count; i++)
            assert_ptr_equal(p.image.params.key[i], p.param_keys[i]);
        free(bytes);
        migrate_plan_free(&p);
        migrate_plan_free(&p); /* zeroed: fine */
        fixture_free(&f);
    }
}

/* A sequence with nothing held: the manifest alone. */
static void test_empty(void **state)
{
    (void)state;
    seq_export x;
    memset(&x, 0, sizeof x);
    snprintf(x.policy, sizeof x.policy, "full");
    x.layers = geom.layers;
    x.heads = 1;
    x.lists = calloc(geom.layers, sizeof *x.lists);
    assert_non_null(x.lists);
    migrate_values v;
    encode(&x, NULL, UID, &v);
    assert_int_equal(v.n, 1);
    migrate_plan p;
    uint8_t *bytes;
    status st;
    assert_int_equal(decode_all(&v, v.kv[0].val, v.kv[0].len, QG, &p, &bytes, &st), ST_OK);
    assert_int_equal(p.ndata, 0);
    assert_export_equal(&x, &p.image);
    free(bytes);
    migrate_plan_free(&p);
    migrate_values_free(&v);
    export_free(&x);
}

/* ---- corruption ------------------------------------------------------------ */

/* A flipped byte (header, positions, payload) or a truncation of any value
 * (sketch values too): DATA_LOSS. */
static void flip_and_truncate(int sketched)
{
    fixture f;
    fixture_make_with(&f, 5, UID, sketched);
    const migrate_values *v = &f.v;
    migrate_plan good;
    status st;
    uint64_t rng = 99;
    const remote_kv *m = manifest_of(v);
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &good, &st), ST_OK);
    uint8_t *bytes = malloc(f.x.nblocks * bb());
    assert_non_null(bytes);
    for (size_t i = 0; i < v->n; i++) {
        const remote_kv *kv = &v->kv[i];
        int is_manifest = i == v->n - 1;
        size_t di = 0;
        while (!is_manifest && strcmp(good.data[di].key, kv->key) != 0)
            di++;
        for (int trial = 0; trial < 24; trial++) {
            size_t at = trial == 0   ? kv->len - 1
                        : trial == 1 ? 9
                                     : (size_t)(rng_next(&rng) % kv->len);
            uint8_t *c = flipped(kv, at, (uint8_t)(1u << (rng_next(&rng) % 8)));
            migrate_plan p;
            status_code rc = is_manifest ? migrate_decode_manifest(c, kv->len, &geom, QG, &p, &st)
                                         : migrate_decode_data(&good, di, c, kv->len, bytes, &st);
            if (rc != ST_DATA_LOSS)
                fail_msg("%s byte %zu flipped: %s", kv->key, at, status_name(rc));
            free(c);
        }
        const size_t cuts[] = {0, 3, REMOTE_VALUE_HEADER_LEN, kv->len / 2, kv->len - 1};
        for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
            migrate_plan p;
            status_code rc = is_manifest
                                 ? migrate_decode_manifest(kv->val, cuts[k], &geom, QG, &p, &st)
                                 : migrate_decode_data(&good, di, kv->val, cuts[k], bytes, &st);
            assert_int_equal(rc, ST_DATA_LOSS);
        }
    }
    /* A data value where the manifest should be, and the other way round. */
    migrate_plan p;
    assert_int_equal(migrate_decode_manifest(v->kv[0].val, v->kv[0].len, &geom, QG, &p, &st),
                     ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "not a manifest"));
    assert_int_equal(migrate_decode_data(&good, 0, m->val, m->len, bytes, &st), ST_DATA_LOSS);
    assert_int_equal(migrate_decode_data(&good, good.ndata, v->kv[0].val, v->kv[0].len, bytes, &st),
                     ST_INVALID_ARGUMENT);
    free(bytes);
    migrate_plan_free(&good);
    fixture_free(&f);
}

static void test_flip_and_truncate(void **state)
{
    (void)state;
    flip_and_truncate(0);
    flip_and_truncate(1);
}

/* Data value j given for data value i (a sketch value for another list's
 * sketch or for blocks, and the other way round): DATA_LOSS, naming the
 * key. */
static void swapped(int sketched)
{
    fixture f;
    fixture_make_with(&f, 6, UID, sketched);
    migrate_plan p;
    status st;
    const remote_kv *m = manifest_of(&f.v);
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &p, &st), ST_OK);
    uint8_t *bytes = malloc(f.x.nblocks * bb());
    assert_non_null(bytes);
    for (size_t i = 0; i < p.ndata; i++)
        for (size_t j = 0; j + 1 < f.v.n; j++) {
            const remote_kv *kv = &f.v.kv[j];
            if (strcmp(kv->key, p.data[i].key) == 0)
                continue;
            assert_int_equal(migrate_decode_data(&p, i, kv->val, kv->len, bytes, &st),
                             ST_DATA_LOSS);
            assert_non_null(strstr(st.msg, p.data[i].key));
        }
    free(bytes);
    migrate_plan_free(&p);
    fixture_free(&f);
}

static void test_swapped(void **state)
{
    (void)state;
    swapped(0);
    swapped(1);
}

/* Values of another export: DATA_LOSS. */
static void test_stale(void **state)
{
    (void)state;
    fixture now, other, older;
    fixture_make(&now, 7, UID);
    /* The same image, other bytes, another uid: a stale data value at a key
     * of this export (an earlier export under a reused uid, a copy). */
    build(&other.x, 7);
    other.bytes = random_bytes(other.x.nblocks * bb(), 12345);
    encode(&other.x, other.bytes, UID2, &other.v);
    /* An older state of the sequence under the same uid: its manifest with
     * this export's data values (a writer that died before the manifest). */
    fixture_make(&older, 8, UID);

    migrate_plan p;
    status st;
    uint8_t *bytes;
    const remote_kv *m = manifest_of(&now.v);
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &p, &st), ST_OK);
    bytes = malloc(now.x.nblocks * bb());
    assert_non_null(bytes);
    for (size_t i = 0; i < p.ndata; i++) {
        const char *part = strrchr(p.data[i].key, ':');
        for (size_t j = 0; j + 1 < other.v.n; j++)
            if (strcmp(strrchr(other.v.kv[j].key, ':'), part) == 0) {
                assert_int_equal(
                    migrate_decode_data(&p, i, other.v.kv[j].val, other.v.kv[j].len, bytes, &st),
                    ST_DATA_LOSS);
                assert_non_null(strstr(st.msg, "manifest says"));
            }
    }
    free(bytes);
    migrate_plan_free(&p);

    /* The other export's manifest, read under this export's key. */
    m = manifest_of(&other.v);
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &p, &st), ST_OK);
    assert_int_equal(migrate_plan_check_origin(&p, NS, TENANT, UID, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "uid"));
    assert_int_equal(migrate_plan_check_origin(&p, NS, "tenant-8", UID2, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "tenant"));
    assert_int_equal(migrate_plan_check_origin(&p, NS, TENANT, UID2, &st), ST_OK);
    migrate_plan_free(&p);

    /* The older manifest with the newer data values. */
    m = manifest_of(&older.v);
    assert_int_equal(decode_all(&now.v, m->val, m->len, QG, &p, &bytes, &st), ST_DATA_LOSS);
    free(bytes);
    migrate_plan_free(&p);

    fixture_free(&now);
    fixture_free(&other);
    fixture_free(&older);
}

/* Every field of the manifest missing, mistyped (true), and one too many:
 * DATA_LOSS naming it. */
static void test_manifest_fields(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, 9, UID);
    remote_value_header h;
    const uint8_t *payload;
    status st;
    const remote_kv *m = manifest_of(&f.v);
    assert_int_equal(remote_value_decode(m->val, m->len, &h, NULL, &payload, &st), ST_OK);
    json_t *root = json_loadb((const char *)payload, (size_t)h.payload_len, 0, NULL);
    assert_non_null(root);
    const char *const ins[] = {NULL, "data", "lists"};
    size_t tried = 0;
    for (size_t w = 0; w < 3; w++) {
        json_t *o = ins[w] ? json_array_get(json_object_get(root, ins[w]), 0) : root;
        const char *k;
        json_t *val;
        json_object_foreach(o, k, val)
        {
            (void)val;
            edit del[] = {{ins[w], 0, k, NULL}, {0}};
            assert_int_equal(try_edits(&f.v, del, &st), ST_DATA_LOSS);
            assert_non_null(strstr(st.msg, k));
            assert_non_null(strstr(st.msg, "missing"));
            edit bad[] = {{ins[w], 0, k, json_true()}, {0}};
            status_code rc = try_edits(&f.v, bad, &st);
            if (rc != ST_DATA_LOSS)
                fail_msg("%s.%s = true: %s", ins[w] ? ins[w] : "", k, status_name(rc));
            assert_non_null(strstr(st.msg, k));
            tried++;
        }
        json_t *one = json_integer(1);
        edit extra[] = {{ins[w], 0, "extra", one}, {0}};
        assert_int_equal(try_edits(&f.v, extra, &st), ST_DATA_LOSS);
        assert_non_null(strstr(st.msg, "extra"));
        json_decref(one);
    }
    assert_int_equal(tried, 21 + 6 + 11); /* format 1: no list has a sketch */
    json_decref(root);
    fixture_free(&f);
}

/* Counts no manifest of this pool can mean: refused before anything that
 * size is allocated. */
static void test_absurd_counts(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, 10, UID);
    status st;
    json_t *big = json_integer(1ll << 31), *huge = json_integer(1ll << 32),
           *over = json_integer((1ll << 32) + 1), *max = json_integer(INT64_MAX),
           *run = json_pack("[i,I]", 0, (json_int_t)1 << 31),
           *atrun = json_pack("[i,i,I]", 0, 0, (json_int_t)1 << 31),
           *blocks = json_pack("[i,I]", 0, (json_int_t)1 << 31),
           *tail = json_pack("[i,I]", 0, (json_int_t)1 << 32);
    assert_non_null(run);
    assert_non_null(atrun);
    edit cases[][5] = {
        {{"lists", 0, "ntokens", big}, {0}},
        {{"lists", 0, "nvictims", big}, {0}},
        {{NULL, 0, "appended", over}, {0}},
        /* 2^31 tokens in every way the runs can claim them. */
        {{NULL, 0, "appended", huge},
         {"lists", 0, "ntokens", big},
         {"lists", 0, "positions", run},
         {"lists", 0, "at", atrun},
         {0}},
        {{"lists", 0, "positions", run}, {0}},
        {{"lists", 0, "tiers", run}, {0}},
        {{"lists", 0, "at", atrun}, {0}},
        {{NULL, 0, "nblocks", big}, {0}},
        {{"data", 0, "blocks", blocks}, {0}},
        {{"data", 0, "size", max}, {0}},
        {{"lists", 0, "tail", tail}, {0}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        status_code rc = try_edits(&f.v, cases[c], &st);
        if (rc != ST_DATA_LOSS)
            fail_msg("case %zu: %s %s", c, status_name(rc), st.msg);
    }
    json_decref(big);
    json_decref(huge);
    json_decref(over);
    json_decref(max);
    json_decref(run);
    json_decref(atrun);
    json_decref(blocks);
    json_decref(tail);
    fixture_free(&f);
    /* A list with a sketch has no blocks to bound it: 2^31 tokens claimed
     * there are refused by the sketch lists' budget, before allocating. */
    fixture_make_with(&f, 24, UID, 1);
    big = json_integer(1ll << 31), huge = json_integer(1ll << 32);
    run = json_pack("[i,I]", 0, (json_int_t)1 << 31);
    edit sk[] = {{NULL, 0, "appended", huge},
                 {"lists", 0, "ntokens", big},
                 {"lists", 0, "positions", run},
                 {0}};
    assert_int_equal(try_edits(&f.v, sk, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "tokens in all"));
    json_decref(big);
    json_decref(huge);
    json_decref(run);
    fixture_free(&f);
}

/* Manifests that parse but contradict themselves or the data. */
static void test_inconsistent(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, 11, UID);
    status st;
    const remote_kv *m = manifest_of(&f.v);
    migrate_plan p;
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &p, &st), ST_OK);
    /* data[0]'s blocks with data[1]'s first block added: listed twice. */
    json_t *dup = json_array();
    for (size_t k = 0; k < p.data[0].nblocks; k++)
        json_array_append_new(dup, json_integer(p.data[0].blocks[k]));
    json_array_append_new(dup, json_integer(p.data[1].blocks[0]));
    /* Kept ascending (else that is the error found). */
    size_t n = json_array_size(dup);
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0; j--) {
            json_int_t a = json_integer_value(json_array_get(dup, j - 1)),
                       b = json_integer_value(json_array_get(dup, j));
            if (a <= b)
                break;
            json_array_set_new(dup, j - 1, json_integer(b));
            json_array_set_new(dup, j, json_integer(a));
        }
    char key[REMOTE_KEY_CAP];
    assert_int_equal(
        remote_key(key, sizeof key, NS, TENANT, UID2, strrchr(p.data[0].key, ':') + 1, &st), ST_OK);
    json_t *stale_key = json_string(key), *another = json_string(p.data[1].key),
           *tier = json_integer(p.data[0].tier == POLICY_FULL ? POLICY_INT8 : POLICY_FULL),
           *size = json_integer((json_int_t)p.data[0].size + 4),
           *list = json_integer(p.data[0].list ^ 1), *far = json_pack("[i,i,i]", 1000, 0, 1),
           *uid = json_string(UID2), *reversed = json_pack("[i,i,i,i]", 50, 1, 10, 1),
           *attn = json_string("AAAA"), *two = json_integer(3), *d256 = json_integer(256),
           *more = json_integer((json_int_t)p.image.nblocks + 1);
    /* lists[0]'s first position one lower: a valid list, not the data's. */
    json_t *shifted = json_array();
    const seq_export_list *l0 = &p.image.lists[0];
    assert_true(l0->ntokens > 0 && l0->positions[0] > 0);
    for (uint32_t j = 0; j < l0->ntokens; j++) {
        json_array_append_new(shifted, json_integer(l0->positions[j] - (j == 0)));
        json_array_append_new(shifted, json_integer(1));
    }
    /* Each edit, and what the error must say. */
    const struct {
        edit e[3];
        const char *says;
    } cases[] = {
        {{{"data", 0, "blocks", dup}, {0}}, "nblocks"},
        {{{"data", 0, "blocks", dup}, {NULL, 0, "nblocks", more}, {0}}, "listed twice"},
        {{{"data", 0, "key", stale_key}, {0}}, "data[0].key"},
        {{{"data", 0, "key", another}, {0}}, "data[0].key"},
        {{{"data", 0, "tier", tier}, {0}}, "data[0].key"},
        {{{"data", 0, "size", size}, {0}}, "data[0].size"},
        {{{"data", 0, "list", list}, {0}}, "data[0].key"},
        {{{"lists", 0, "at", far}, {0}}, "past nblocks"},
        {{{"lists", 0, "positions", reversed}, {0}}, "precedes"},
        {{{"lists", 0, "positions", shifted}, {0}}, "the manifest's list has"},
        {{{"lists", 0, "attn", attn}, {0}}, "attn"},
        {{{NULL, 0, "uid", uid}, {0}}, "data[0].key"},
        {{{"lists", 0, "demote_due", d256}, {0}}, "demote_due"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        status_code rc = try_edits(&f.v, cases[c].e, &st);
        if (rc != ST_DATA_LOSS || strstr(st.msg, cases[c].says) == NULL)
            fail_msg("case %zu: %s %s", c, status_name(rc), st.msg);
    }
    /* Another format is not corruption: a newer writer. */
    edit fmt[] = {{NULL, 0, "format", two}, {0}};
    assert_int_equal(try_edits(&f.v, fmt, &st), ST_FAILED_PRECONDITION);
    json_t *bbytes = json_integer((json_int_t)bb() * 2);
    edit blk[] = {{NULL, 0, "block_bytes", bbytes}, {0}};
    assert_int_equal(try_edits(&f.v, blk, &st), ST_FAILED_PRECONDITION);
    json_decref(bbytes);
    json_t *jv[] = {dup, stale_key, another, tier, size,    list, far,
                    uid, reversed,  attn,    two,  shifted, d256, more};
    for (size_t i = 0; i < sizeof jv / sizeof jv[0]; i++)
        json_decref(jv[i]);
    migrate_plan_free(&p);
    fixture_free(&f);
}

/* Another geometry or INT4/INT2 group: FAILED_PRECONDITION, nothing
 * allocated. */
static void test_geometry(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, 12, UID);
    const remote_kv *m = manifest_of(&f.v);
    status st;
    migrate_plan p;
    pool_geometry g = geom;
    g.head_dim = 16;
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &g, QG, &p, &st),
                     ST_FAILED_PRECONDITION);
    assert_non_null(strstr(st.msg, "head_dim"));
    g = geom;
    g.rope_theta = 500000.0f;
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &g, QG, &p, &st),
                     ST_FAILED_PRECONDITION);
    g = geom;
    g.dtype = POOL_BF16;
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &g, QG, &p, &st),
                     ST_FAILED_PRECONDITION);
    /* List 2 holds INT4 tokens: the group size matters. */
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG * 2, &p, &st),
                     ST_FAILED_PRECONDITION);
    assert_non_null(strstr(st.msg, "quant_group"));
    /* 0 is the default group, as in kv_layout: on both sides. */
    migrate_values v0;
    assert_int_equal(migrate_encode(&f.x, &geom, 0, bb(), f.bytes, NS, TENANT, UID, &v0, &st),
                     ST_OK);
    const uint32_t groups[] = {0, KV_LOWBIT_GROUP_DEFAULT};
    for (size_t i = 0; i < 2; i++) {
        uint8_t *out;
        assert_int_equal(
            decode_all(&v0, manifest_of(&v0)->val, manifest_of(&v0)->len, groups[i], &p, &out, &st),
            ST_OK);
        assert_memory_equal(out, f.bytes, f.x.nblocks * bb());
        free(out);
        migrate_plan_free(&p);
    }
    assert_int_equal(
        migrate_decode_manifest(manifest_of(&v0)->val, manifest_of(&v0)->len, &geom, QG, &p, &st),
        ST_FAILED_PRECONDITION);
    migrate_values_free(&v0);
    fixture_free(&f);

    /* Without INT4/INT2 data it does not. */
    seq_export x;
    build(&x, 12);
    for (size_t b = 0; b < x.nblocks; b++)
        if (x.block_tier[b] == POLICY_INT4 || x.block_tier[b] == POLICY_INT2)
            x.block_tier[b] = POLICY_INT8;
    for (size_t li = 0; li < NLISTS; li++)
        for (uint32_t j = 0; j < x.lists[li].ntokens; j++)
            x.lists[li].at[j].tier = x.block_tier[x.lists[li].at[j].block];
    uint8_t *bytes = random_bytes(x.nblocks * bb(), 1);
    migrate_values v;
    encode(&x, bytes, UID, &v);
    uint8_t *out;
    assert_int_equal(
        decode_all(&v, manifest_of(&v)->val, manifest_of(&v)->len, QG * 2, &p, &out, &st), ST_OK);
    assert_memory_equal(out, bytes, x.nblocks * bb());
    free(out);
    migrate_plan_free(&p);
    migrate_values_free(&v);
    free(bytes);
    export_free(&x);
}

/* What the encoder refuses: INVALID_ARGUMENT, nothing returned. */
static void test_encode_refuses(void **state)
{
    (void)state;
    seq_export x;
    build(&x, 13);
    uint8_t *bytes = random_bytes(x.nblocks * bb(), 2);
    migrate_values v;
    status st;
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, "a b", &v, &st),
                     ST_INVALID_ARGUMENT);
    assert_null(v.kv);
    assert_int_equal(migrate_encode(&x, &geom, QG, bb() + 1, bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), NULL, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    seq_export_list *ls = &x.lists[0];
    tier_token keep = ls->at[3];
    ls->at[3].tier = POLICY_SKETCH;
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "sketch"));
    ls->at[3].tier = keep.tier == POLICY_FULL ? POLICY_INT8 : POLICY_FULL; /* not its block's */
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    ls->at[3] = keep;
    ls->at[3].block = (uint32_t)x.nblocks;
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    ls->at[3] = keep;
    uint32_t pos = ls->positions[4];
    ls->positions[4] = ls->positions[3];
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    ls->positions[4] = pos;
    x.label[0] = (char)0xff; /* not UTF-8 */
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    x.label[0] = 'r';
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st), ST_OK);
    migrate_values_free(&v);
    free(bytes);
    export_free(&x);
}

/* ---- sketches (format 2) --------------------------------------------------- */

/* A manifest's JSON (the value's payload), parsed; the caller decrefs. */
static json_t *manifest_json(const remote_kv *m)
{
    remote_value_header h;
    const uint8_t *payload;
    status st;
    assert_int_equal(remote_value_decode(m->val, m->len, &h, NULL, &payload, &st), ST_OK);
    json_t *root = json_loadb((const char *)payload, (size_t)h.payload_len, 0, NULL);
    assert_non_null(root);
    return root;
}

/* Sketch tokens (held and victims) and sketches round trip: one sketch
 * value per list with a sketch (kind sketch, key part l<l>.h<h>.sketch,
 * positions: the list's held sketch tokens, payload: the cells), the
 * manifest naming it, sketch runs [4294967295, 0, count]; decoded, the
 * image equals the original field by field, the blocks and every sketch's
 * cells byte for byte. */
static void test_round_trip_sketch(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 12; seed++) {
        fixture f;
        fixture_make_with(&f, seed, UID, 1);
        const migrate_values *v = &f.v;
        uint8_t has[NLISTS][POLICY_TIERS] = {{0}};
        size_t groups = 0;
        for (size_t b = 0; b < f.x.nblocks; b++)
            groups += !has[f.x.block_list[b]][f.x.block_tier[b]]++;
        assert_int_equal(v->n, groups + 3 + 1); /* lists 0, 1, 2 have sketches */
        size_t sketches = 0;
        for (size_t i = 0; i + 1 < v->n; i++) {
            status st;
            remote_value_header h;
            const uint8_t *pos, *payload;
            assert_int_equal(
                remote_value_decode(v->kv[i].val, v->kv[i].len, &h, &pos, &payload, &st), ST_OK);
            if (h.kind != REMOTE_VALUE_SKETCH) {
                assert_int_equal(h.kind, REMOTE_VALUE_TOKENS);
                continue;
            }
            sketches++;
            const seq_export_list *ls = &f.x.lists[h.layer * geom.kv_heads + h.head];
            char want[64];
            snprintf(want, sizeof want, "l%u.h%u.sketch", h.layer, h.head);
            assert_string_equal(strrchr(v->kv[i].key, ':') + 1, want);
            assert_int_equal(h.tier, POLICY_SKETCH);
            assert_int_equal(h.payload_len, ls->sketch_bytes);
            assert_memory_equal(payload, ls->sketch, ls->sketch_bytes);
            uint32_t k = 0;
            for (uint32_t j = 0; j < ls->ntokens; j++)
                if (ls->at[j].tier == POLICY_SKETCH)
                    assert_int_equal(remote_value_position(pos, k++), ls->positions[j]);
            assert_int_equal(h.ntokens, k);
        }
        assert_int_equal(sketches, 3);
        /* The manifest: format 2, list 0's held sketch tokens as sentinel runs,
         * list 2's victims, list 3 without a sketch. */
        json_t *root = manifest_json(manifest_of(v));
        assert_int_equal(json_integer_value(json_object_get(root, "format")), 2);
        json_t *lists = json_object_get(root, "lists");
        int sentinel = 0;
        json_t *at = json_object_get(json_array_get(lists, 0), "at");
        for (size_t i = 0; i < json_array_size(at); i += 3)
            if (json_integer_value(json_array_get(at, i)) == 4294967295ll) {
                assert_int_equal(json_integer_value(json_array_get(at, i + 1)), 0);
                sentinel++;
            }
        assert_true(sentinel > 0);
        json_t *vat = json_object_get(json_array_get(lists, 2), "victim_at");
        assert_int_equal(json_array_size(vat), 3); /* one run: every victim */
        assert_int_equal(json_integer_value(json_array_get(vat, 0)), 4294967295ll);
        assert_int_equal(json_integer_value(json_array_get(vat, 2)), 9);
        assert_true(json_is_object(json_object_get(json_array_get(lists, 1), "sketch")));
        assert_true(json_is_null(json_object_get(json_array_get(lists, 3), "sketch")));
        json_decref(root);

        migrate_plan p;
        uint8_t *bytes;
        status st;
        status_code rc =
            decode_all(v, manifest_of(v)->val, manifest_of(v)->len, QG, &p, &bytes, &st);
        if (rc != ST_OK)
            fail_msg("seed %llu: %s", (unsigned long long)seed, st.msg);
        assert_int_equal(p.format, 2);
        assert_int_equal(p.ndata, v->n - 1);
        assert_export_equal(&f.x, &p.image);
        assert_memory_equal(bytes, f.bytes, f.x.nblocks * bb());
        free(bytes);
        migrate_plan_free(&p);
        fixture_free(&f);
    }
}

/* lists[li].sketch of the manifest m, with field set to value (stolen). */
typedef struct sketch_edit {
    size_t li;
    const char *field;
    json_t *value;
} sketch_edit;

static void apply_sketch_edit(json_t *root, void *arg)
{
    const sketch_edit *e = arg;
    json_t *sk = json_object_get(json_array_get(json_object_get(root, "lists"), e->li), "sketch");
    assert_true(json_is_object(sk));
    assert_int_equal(json_object_set(sk, e->field, e->value), 0);
}

static status_code try_sketch_edit(const migrate_values *v, sketch_edit *e, status *st)
{
    size_t len;
    uint8_t *m = remanifest(manifest_of(v), apply_sketch_edit, e, &len), *bytes;
    migrate_plan p;
    status_code rc = decode_all(v, m, len, QG, &p, &bytes, st);
    migrate_plan_free(&p);
    free(bytes);
    free(m);
    json_decref(e->value);
    return rc;
}

/* A sketch entry of another size, crc or key, a sketch token in a list
 * whose sketch is null (held or victim), a sketch run at a slot other
 * than 0, the sentinel in a format 1 manifest: DATA_LOSS naming the field
 * or the key. */
static void test_sketch_refused(void **state)
{
    (void)state;
    fixture f;
    fixture_make_with(&f, 21, UID, 1);
    status st;
    migrate_plan p;
    const remote_kv *m = manifest_of(&f.v);
    assert_int_equal(migrate_decode_manifest(m->val, m->len, &geom, QG, &p, &st), ST_OK);
    const migrate_data *d0 = NULL, *d1 = NULL;
    for (size_t i = 0; i < p.ndata; i++)
        if (p.data[i].tier == POLICY_SKETCH)
            *(p.data[i].list == 0 ? &d0 : &d1) = &p.data[i];
    assert_non_null(d0);
    assert_non_null(d1);
    const struct {
        size_t li;
        const char *field;
        json_t *value;
        const char *says;
    } cases[] = {
        /* Not whole cells: the manifest itself is wrong. */
        {0, "size", json_integer((json_int_t)d0->size + 1), "lists[0].sketch.size"},
        {0, "size", json_integer(REMOTE_VALUE_HEADER_LEN), "lists[0].sketch.size"},
        /* Whole cells, but not the value's size: the value is refused. */
        {0, "size", json_integer((json_int_t)d0->size + CELL), "manifest says"},
        {0, "crc", json_integer((json_int_t)(d0->crc ^ 1)), "manifest says"},
        {0, "key", json_string(d1->key), "lists[0].sketch.key"},
        {0, "key", json_string("kvs:" NS ":{" TENANT ":" UID "}:l0.h0.int8"),
         "lists[0].sketch.key"},
        {0, "extra", json_integer(1), "unexpected field"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sketch_edit e = {cases[c].li, cases[c].field, cases[c].value};
        status_code rc = try_sketch_edit(&f.v, &e, &st);
        if (rc != ST_DATA_LOSS || strstr(st.msg, cases[c].says) == NULL)
            fail_msg("case %zu: %s %s", c, status_name(rc), st.msg);
    }
    /* Another list's sketch value fetched for list 0's: refused by its key. */
    for (size_t i = 0; i + 1 < f.v.n; i++)
        if (strcmp(f.v.kv[i].key, d1->key) == 0) {
            uint8_t *b = malloc(f.x.nblocks * bb());
            assert_non_null(b);
            assert_int_equal(migrate_decode_data(&p, (size_t)(d0 - p.data), f.v.kv[i].val,
                                                 f.v.kv[i].len, b, &st),
                             ST_DATA_LOSS);
            assert_non_null(strstr(st.msg, d0->key));
            free(b);
        }
    assert_null(p.image.lists[0].sketch); /* nothing written */
    migrate_plan_free(&p);

    /* Sketch tokens where the sketch is null: list 0's held ones, list 2's
     * victims; list 3 (no sketch) given a sketch run. */
    json_t *null = json_null(), *one = json_pack("[I,i,i]", (json_int_t)4294967295ll, 0, 10),
           *slot1 = json_pack("[I,i,i]", (json_int_t)4294967295ll, 1, 9);
    const struct {
        edit e[2];
        const char *says;
    } nulls[] = {
        {{{"lists", 0, "sketch", null}, {0}}, "lists[0].at["},
        {{{"lists", 2, "sketch", null}, {0}}, "lists[2].victim_at[0] is in the sketch"},
        {{{"lists", 3, "at", one}, {0}}, "lists[3].at[0] is in the sketch, but lists[3].sketch"},
        {{{"lists", 2, "victim_at", slot1}, {0}}, "a slot not 0"},
    };
    for (size_t c = 0; c < sizeof nulls / sizeof nulls[0]; c++) {
        status_code rc = try_edits(&f.v, nulls[c].e, &st);
        if (rc != ST_DATA_LOSS || strstr(st.msg, nulls[c].says) == NULL)
            fail_msg("case %zu: %s %s", c, status_name(rc), st.msg);
    }
    json_decref(one);
    json_decref(slot1);
    fixture_free(&f);
}

/* Format 1 (no lists[].sketch, no sketch runs): what an older kvstashd
 * wrote, still read while its exports live (--remote-ttl-s). */
static void drop_sketches(json_t *root, void *arg)
{
    json_t *lists = json_object_get(root, "lists");
    for (size_t i = 0; i < json_array_size(lists); i++)
        json_object_del(json_array_get(lists, i), "sketch"); /* format 1 has none */
    json_object_set_new(root, "format", json_integer(arg ? *(int *)arg : 1));
}

static void test_format_1(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, 22, UID);
    /* Without a sketch the encoder writes format 1, which an older
     * kvstashd imports (a rolling upgrade). */
    json_t *root = manifest_json(manifest_of(&f.v));
    assert_int_equal(json_integer_value(json_object_get(root, "format")), 1);
    assert_null(json_object_get(json_array_get(json_object_get(root, "lists"), 0), "sketch"));
    json_decref(root);
    size_t len;
    uint8_t *m = remanifest(manifest_of(&f.v), drop_sketches, NULL, &len), *bytes;
    migrate_plan p;
    status st;
    status_code rc = decode_all(&f.v, m, len, QG, &p, &bytes, &st);
    if (rc != ST_OK)
        fail_msg("format 1: %s", st.msg);
    assert_int_equal(p.format, 1);
    assert_export_equal(&f.x, &p.image);
    assert_memory_equal(bytes, f.bytes, f.x.nblocks * bb());
    free(bytes);
    migrate_plan_free(&p);
    free(m);
    fixture_free(&f);
    /* With sketches, format 2: without lists[].sketch it is broken. */
    fixture_make_with(&f, 23, UID, 1);
    root = manifest_json(manifest_of(&f.v));
    assert_int_equal(json_integer_value(json_object_get(root, "format")), 2);
    json_decref(root);
    int two = 2;
    m = remanifest(manifest_of(&f.v), drop_sketches, &two, &len);
    assert_int_equal(decode_all(&f.v, m, len, QG, &p, &bytes, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "lists[0].sketch missing"));
    free(bytes);
    migrate_plan_free(&p);
    free(m);
    /* Format 1 with a sketch field, or a sketch run: not format 1. */
    json_t *fmt1 = json_integer(1);
    edit with_field[] = {{NULL, 0, "format", fmt1}, {0}};
    assert_int_equal(try_edits(&f.v, with_field, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "unexpected field \"sketch\""));
    m = remanifest(manifest_of(&f.v), drop_sketches, NULL, &len);
    assert_int_equal(decode_all(&f.v, m, len, QG, &p, &bytes, &st), ST_DATA_LOSS);
    assert_non_null(strstr(st.msg, "past nblocks")); /* the sentinel is no block */
    free(bytes);
    migrate_plan_free(&p);
    free(m);
    json_decref(fmt1);
    fixture_free(&f);
}

/* What the encoder refuses of sketches: INVALID_ARGUMENT. */
static void test_encode_refuses_sketch(void **state)
{
    (void)state;
    seq_export x;
    build_with(&x, 24, 1);
    uint8_t *bytes = random_bytes(x.nblocks * bb(), 3);
    migrate_values v;
    status st;
    seq_export_list *l0 = &x.lists[0], *l3 = &x.lists[3];
    l0->sketch_bytes--; /* not whole cells */
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "cells"));
    l0->sketch_bytes++;
    uint8_t *cells = l0->sketch;
    l0->sketch = NULL; /* cells not read */
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    l0->sketch = cells;
    size_t j = 0;
    while (l0->at[j].tier != POLICY_SKETCH)
        j++;
    l0->at[j].slot = 1;
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    l0->at[j].slot = 0;
    tier_token keep = l3->at[0];
    l3->at[0] = (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH}; /* list 3 has no sketch */
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st),
                     ST_INVALID_ARGUMENT);
    assert_non_null(strstr(st.msg, "list 3"));
    l3->at[0] = keep;
    assert_int_equal(migrate_encode(&x, &geom, QG, bb(), bytes, NS, TENANT, UID, &v, &st), ST_OK);
    migrate_values_free(&v);
    free(bytes);
    export_free(&x);
}

/* ---- random mutations ---------------------------------------------------- */

typedef struct fuzz_arg {
    uint64_t rng;
} fuzz_arg;

static void count_ints(json_t *j, size_t *n, json_t **pick, size_t want)
{
    if (json_is_integer(j)) {
        if (*n == want)
            *pick = j;
        (*n)++;
    } else if (json_is_array(j)) {
        for (size_t i = 0; i < json_array_size(j); i++)
            count_ints(json_array_get(j, i), n, pick, want);
    } else if (json_is_object(j)) {
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) count_ints(v, n, pick, want);
    }
}

/* Set a random integer of the manifest to a value near a boundary. */
static void mutate_int(json_t *root, void *arg)
{
    fuzz_arg *a = arg;
    size_t n = 0;
    json_t *pick = NULL;
    count_ints(root, &n, &pick, SIZE_MAX);
    count_ints(root, &(size_t){0}, &pick, (size_t)(rng_next(&a->rng) % n));
    json_int_t v = json_integer_value(pick);
    const json_int_t choices[] = {0,     1,         -1,        v + 1,           v - 1,
                                  v * 2, 1ll << 31, 1ll << 32, (1ll << 32) - 1, INT64_MAX,
                                  255,   256,       v + 64};
    json_integer_set(pick, choices[rng_next(&a->rng) % (sizeof choices / sizeof choices[0])]);
}

/* Any outcome but a crash, and success only with every data value
 * consistent: run under ASan, this is the decoder's bounds check. */
static void fuzz_manifest(int sketched)
{
    fixture f;
    fixture_make_with(&f, 14, UID, sketched);
    const remote_kv *m = manifest_of(&f.v);
    fuzz_arg a = {2024};
    size_t ok = 0;
    for (int iter = 0; iter < 600; iter++) {
        size_t len;
        uint8_t *buf;
        if (iter % 3 == 2) {
            /* Bytes of the JSON text flipped, the checksum made good. */
            remote_value_header h;
            const uint8_t *payload;
            status st;
            assert_int_equal(remote_value_decode(m->val, m->len, &h, NULL, &payload, &st), ST_OK);
            uint8_t *text = malloc(h.payload_len);
            assert_non_null(text);
            memcpy(text, payload, h.payload_len);
            for (int k = 0; k < 1 + iter % 4; k++)
                text[rng_next(&a.rng) % h.payload_len] = (uint8_t)rng_next(&a.rng);
            len = m->len;
            buf = malloc(len);
            assert_non_null(buf);
            assert_int_equal(remote_value_encode(&h, NULL, text, buf, len, &st), ST_OK);
            free(text);
        } else {
            buf = remanifest(m, mutate_int, &a, &len);
        }
        migrate_plan p;
        uint8_t *bytes;
        status st;
        status_code rc = decode_all(&f.v, buf, len, QG, &p, &bytes, &st);
        if (rc != ST_OK && rc != ST_DATA_LOSS && rc != ST_FAILED_PRECONDITION && rc != ST_NOT_FOUND)
            fail_msg("iteration %d: %s %s", iter, status_name(rc), st.msg);
        ok += rc == ST_OK;
        free(bytes);
        migrate_plan_free(&p);
        free(buf);
    }
    /* Some mutations change nothing that matters (a counter): those decode. */
    assert_true(ok > 0);
    fixture_free(&f);
}

static void test_fuzz_manifest(void **state)
{
    (void)state;
    fuzz_manifest(0);
    fuzz_manifest(1);
}

/* ---- spilled victims ------------------------------------------------------ */

/* A spilled part as seq_spill_plan names it: 5 victims of list (1, 1) in
 * an INT8 block (bb() bytes), or a sketch's cells (tier POLICY_SKETCH,
 * 1000 bytes), part 17; *want is what the sequence expects when it fetches
 * it back (seq_revive_remote), pointing at the same positions. */
static const uint32_t spill_pos[5] = {3, 9, 10, 41, 77};

static seq_spill_block spill_block(uint8_t tier, seq_remote_part *want)
{
    size_t bytes = tier == POLICY_SKETCH ? 1000 : bb();
    seq_spill_block b = {1,    1,  tier == POLICY_SKETCH ? TIER_NO_BLOCK : 42u,
                         tier, 17, (uint32_t *)spill_pos,
                         5,    0,  bytes,
                         0};
    *want = (seq_remote_part){17, tier, 1, 1, spill_pos, 5, bytes};
    return b;
}

/* Decoding value kv as want expects must fail with DATA_LOSS naming the
 * key (and `words`, when given). */
static void spill_refused(const remote_kv *kv, const void *buf, size_t len, const pool_geometry *g,
                          const seq_remote_part *want, const char *words)
{
    status st;
    const uint8_t *payload = NULL;
    status_code rc = migrate_decode_spill(buf, len, kv->key, g, QG, want, &payload, &st);
    if (rc != ST_DATA_LOSS)
        fail_msg("%s: %s (%s), want DATA_LOSS", words ? words : "", status_name(rc),
                 rc == ST_OK ? "" : st.msg);
    assert_non_null(strstr(st.msg, kv->key));
    if (words != NULL && strstr(st.msg, words) == NULL)
        fail_msg("'%s' does not say '%s'", st.msg, words);
    assert_null(payload);
}

/* migrate_encode_spill / migrate_decode_spill: a victim block and a
 * sketch round trip under key part "v<part>" (payload: the bytes, in
 * place in the fetched value); everything that differs from what the
 * sequence expects is DATA_LOSS naming the key: a flipped byte, a
 * truncation, another geometry, kind, tier, layer, head, positions or
 * size. */
static void test_spill_values(void **state)
{
    (void)state;
    const uint8_t tiers[] = {POLICY_INT8, POLICY_SKETCH};
    remote_kv kv[2];
    seq_remote_part want[2];
    uint8_t *bytes[2];
    status st;
    for (size_t t = 0; t < 2; t++) {
        seq_spill_block b = spill_block(tiers[t], &want[t]);
        bytes[t] = random_bytes(b.bytes, 40 + t);
        assert_int_equal(
            migrate_encode_spill(&geom, QG, &b, bytes[t], NS, TENANT, UID, &kv[t], &st), ST_OK);
        assert_string_equal(kv[t].key, "kvs:" NS ":{" TENANT ":" UID "}:v17");
        assert_int_equal(kv[t].len, REMOTE_VALUE_HEADER_LEN + 4 * 5 + b.bytes);
        const uint8_t *payload = NULL;
        assert_int_equal(migrate_decode_spill(kv[t].val, kv[t].len, kv[t].key, &geom, QG, &want[t],
                                              &payload, &st),
                         ST_OK);
        assert_ptr_equal(payload, (const uint8_t *)kv[t].val + REMOTE_VALUE_HEADER_LEN + 4 * 5);
        assert_memory_equal(payload, bytes[t], b.bytes);
        /* The header says what it is. */
        remote_value_header h;
        assert_int_equal(remote_value_decode(kv[t].val, kv[t].len, &h, NULL, &payload, &st), ST_OK);
        assert_int_equal(h.kind,
                         tiers[t] == POLICY_SKETCH ? REMOTE_VALUE_SKETCH : REMOTE_VALUE_TOKENS);
        assert_int_equal(h.tier, tiers[t]);
        assert_int_equal(h.layer, 1);
        assert_int_equal(h.head, 1);
        assert_int_equal(h.ntokens, 5);
    }
    for (size_t t = 0; t < 2; t++) {
        const remote_kv *k = &kv[t];
        /* A flipped byte: payload, position, header; a truncation. */
        const size_t at[] = {k->len - 1, REMOTE_VALUE_HEADER_LEN + 4 * 5,
                             REMOTE_VALUE_HEADER_LEN + 1, 40};
        for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
            uint8_t *c = flipped(k, at[i], 0x10);
            spill_refused(k, c, k->len, &geom, &want[t], NULL);
            free(c);
        }
        spill_refused(k, k->val, k->len - 1, &geom, &want[t], NULL);
        spill_refused(k, k->val, REMOTE_VALUE_HEADER_LEN, &geom, &want[t], NULL);
        /* Another geometry: the value was written for head_dim 8. */
        pool_geometry g = geom;
        g.head_dim = 16;
        spill_refused(k, k->val, k->len, &g, &want[t], "head_dim");
        g = geom;
        g.dtype = POOL_BF16;
        spill_refused(k, k->val, k->len, &g, &want[t], "dtype");
        /* Another list, size, positions. */
        seq_remote_part w = want[t];
        w.layer = 0;
        spill_refused(k, k->val, k->len, &geom, &w, "layer 1");
        w = want[t];
        w.head = 0;
        spill_refused(k, k->val, k->len, &geom, &w, "head 1");
        w = want[t];
        w.bytes--;
        spill_refused(k, k->val, k->len, &geom, &w, "payload bytes");
        w = want[t];
        w.npositions = 4;
        spill_refused(k, k->val, k->len, &geom, &w, "5 positions");
        const uint32_t other[5] = {3, 9, 11, 41, 77};
        w = want[t];
        w.positions = other;
        spill_refused(k, k->val, k->len, &geom, &w, "position 2 is 10");
    }
    /* Another tier of tokens; a sketch where tokens are expected and the
     * other way round (kind and tier). */
    seq_remote_part w = want[0];
    w.tier = POLICY_FULL;
    spill_refused(&kv[0], kv[0].val, kv[0].len, &geom, &w, "tier int8");
    w = want[0];
    w.tier = POLICY_SKETCH;
    spill_refused(&kv[0], kv[0].val, kv[0].len, &geom, &w, "kind 1");
    w = want[1];
    w.tier = POLICY_INT8;
    spill_refused(&kv[1], kv[1].val, kv[1].len, &geom, &w, "kind 2");
    for (size_t t = 0; t < 2; t++) {
        free((void *)kv[t].key);
        free((void *)kv[t].val);
        free(bytes[t]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_flip_and_truncate),
        cmocka_unit_test(test_swapped),
        cmocka_unit_test(test_stale),
        cmocka_unit_test(test_manifest_fields),
        cmocka_unit_test(test_absurd_counts),
        cmocka_unit_test(test_inconsistent),
        cmocka_unit_test(test_geometry),
        cmocka_unit_test(test_encode_refuses),
        cmocka_unit_test(test_fuzz_manifest),
        cmocka_unit_test(test_spill_values),
        cmocka_unit_test(test_round_trip_sketch),
        cmocka_unit_test(test_sketch_refused),
        cmocka_unit_test(test_format_1),
        cmocka_unit_test(test_encode_refuses_sketch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
