/*
 * seq_export.c - a sequence as plain data and back (seq.h seq_export), to
 * move it to another daemon (issue 17; docs/remote.md "Export and import").
 *
 * The image names blocks, not tokens' bytes: a block holds one tier of one
 * list (full-precision slots, or one INT8 / INT4 / INT2 block with its
 * scales), so copying blocks whole carries every tier bit for bit, and the
 * importing daemon's worker reads exactly what the exporting one did.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

void seq_export_free(seq_export *x)
{
    for (size_t i = 0; x->lists != NULL && i < (size_t)x->layers * x->heads; i++) {
        seq_export_list *e = &x->lists[i];
        free(e->positions), free(e->tiers), free(e->attn), free(e->at);
        free(e->victims), free(e->victim_at), free(e->victim_blocks);
        free(e->sketch);
    }
    free(x->lists);
    for (size_t l = 0; x->states != NULL && l < x->layers; l++)
        free(x->states[l]);
    free(x->states), free(x->state_len);
    free(x->blocks), free(x->block_tier), free(x->block_list);
    memset(x, 0, sizeof *x);
}

/* Export numbering: index[pool block] = export index + 1 (0: not yet). */
typedef struct numbering {
    uint32_t *index;
    seq_export *x;
    size_t cap;
} numbering;

/* The export index of pool block b, numbering it on first sight as a
 * block of `list` holding `tier`. -1 when out of memory, -2 when the block
 * was seen with another list or tier (a broken invariant). */
static long number_block(numbering *nb, uint32_t b, uint32_t list, uint8_t tier)
{
    seq_export *x = nb->x;
    if (nb->index[b] != 0) {
        uint32_t i = nb->index[b] - 1;
        return x->block_list[i] == list && x->block_tier[i] == tier ? (long)i : -2;
    }
    if (x->nblocks == nb->cap) {
        size_t cap = nb->cap ? 2 * nb->cap : 64;
        uint32_t *blocks = realloc(x->blocks, cap * sizeof *blocks);
        if (blocks != NULL)
            x->blocks = blocks;
        uint8_t *bt = realloc(x->block_tier, cap);
        if (bt != NULL)
            x->block_tier = bt;
        uint32_t *bl = realloc(x->block_list, cap * sizeof *bl);
        if (bl != NULL)
            x->block_list = bl;
        if (blocks == NULL || bt == NULL || bl == NULL)
            return -1;
        nb->cap = cap;
    }
    size_t i = x->nblocks++;
    x->blocks[i] = b;
    x->block_tier[i] = tier;
    x->block_list[i] = list;
    nb->index[b] = (uint32_t)i + 1;
    return (long)i;
}

/* Rename the blocks of n tokens to export indices; a token in the sketch
 * has none (TIER_NO_BLOCK, slot 0: seq.h seq_export_list). */
static int number_tokens(numbering *nb, tier_token *t, size_t n, uint32_t list)
{
    for (size_t i = 0; i < n; i++) {
        if (t[i].tier == POLICY_SKETCH) {
            t[i] = (tier_token){TIER_NO_BLOCK, 0, POLICY_SKETCH};
            continue;
        }
        long e = number_block(nb, t[i].block, list, t[i].tier);
        if (e < 0)
            return (int)e;
        t[i].block = (uint32_t)e;
    }
    return 0;
}

static void *dup_array(const void *src, size_t n, size_t elt)
{
    void *d = malloc(n ? n * elt : 1);
    if (d != NULL && n > 0)
        memcpy(d, src, n * elt);
    return d;
}

/* List (l, k) into e, its blocks numbered. 0, -1 out of memory, -2 broken. */
static int describe_list(seq *s, uint32_t l, uint32_t k, numbering *nb, seq_export_list *e)
{
    const policy_layer_view *v = policy_host_view(s->host, l);
    const seq_list *ly = seq_list_at(s, l, k);
    uint32_t list = l * s->heads + k, n = v->tokens[k];
    const float *attn = policy_host_attn(s->host, l, k);
    e->ntokens = n;
    e->positions = dup_array(v->positions[k], n, sizeof *e->positions);
    e->tiers = dup_array(v->tier[k], n, 1);
    e->attn = attn != NULL ? dup_array(attn, n, sizeof *e->attn) : NULL;
    e->at = list_expand(ly, n);
    e->nvictims = ly->noffloaded;
    e->victims = dup_array(ly->offloaded, ly->noffloaded, sizeof *e->victims);
    e->victim_at = dup_array(ly->offloaded_at, ly->noffloaded, sizeof *e->victim_at);
    e->nvictim_blocks = ly->nvictim_blocks;
    e->victim_blocks = dup_array(ly->victim_blocks, ly->nvictim_blocks, sizeof *e->victim_blocks);
    if (!e->positions || !e->tiers || (attn && !e->attn) || !e->at || !e->victims ||
        !e->victim_at || !e->victim_blocks)
        return -1;
    int rc = number_tokens(nb, e->at, n, list);
    if (rc == 0)
        rc = number_tokens(nb, e->victim_at, e->nvictims, list);
    for (size_t j = 0; rc == 0 && j < e->nvictim_blocks; j++) {
        long i = number_block(nb, e->victim_blocks[j], list, POLICY_INT8);
        rc = i < 0 ? (int)i : 0;
        e->victim_blocks[j] = (uint32_t)i;
    }
    /* A tail none of whose tokens is held was retired: new tokens then
     * start a new block here as there. */
    e->has_tail = ly->has_tail && nb->index[ly->tail_block] != 0;
    e->tail_block = e->has_tail ? nb->index[ly->tail_block] - 1 : 0;
    e->tail_next_slot = e->has_tail ? ly->tail_next_slot : 0;
    e->demote_due = ly->demote_due;
    /* The cells' host copy, filled by seq_export_read_sketches. */
    e->sketch_bytes = tier_sketch_bytes(&ly->sketch);
    if (rc == 0 && e->sketch_bytes > 0 && (e->sketch = malloc(e->sketch_bytes)) == NULL)
        rc = -1;
    return rc;
}

/* Every layer's policy state (policy_host_export_state). 0 or -1. */
static int describe_states(seq *s, seq_export *out)
{
    out->states = calloc(s->nlayers, sizeof *out->states);
    out->state_len = calloc(s->nlayers, sizeof *out->state_len);
    if (out->states == NULL || out->state_len == NULL)
        return -1;
    for (uint32_t l = 0; l < s->nlayers; l++)
        if ((out->states[l] = policy_host_export_state(s->host, l, &out->state_len[l])) == NULL)
            return -1;
    return 0;
}

status_code seq_export_describe(seq *s, seq_export *out, status *st)
{
    memset(out, 0, sizeof *out);
    if (!policy_host_portable(s->host))
        return status_set(st, ST_FAILED_PRECONDITION,
                          "policy %s keeps state of its own that it cannot write out yet",
                          s->policy->name);
    if (s->spilled_tokens > 0)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "%llu victims are spilled to the remote tier (seq spill), which "
                          "export does not carry yet",
                          (unsigned long long)s->spilled_tokens);
    snprintf(out->policy, sizeof out->policy, "%s", s->policy->name);
    out->params = s->params;
    snprintf(out->label, sizeof out->label, "%s", s->label);
    out->appended = s->appended;
    out->unstepped = s->unstepped;
    out->host_steps = policy_host_steps(s->host);
    memcpy(out->moved, s->moved, sizeof out->moved);
    out->requantized = s->requantized;
    out->victims_dropped = s->victims_dropped;
    out->layers = s->nlayers;
    out->heads = s->heads;
    numbering nb = {calloc(s->pool->block_count, sizeof *nb.index), out, 0};
    out->lists = calloc(seq_nlists(s), sizeof *out->lists);
    int rc = nb.index != NULL && out->lists != NULL ? 0 : -1;
    for (uint32_t l = 0; rc == 0 && l < s->nlayers; l++)
        for (uint32_t k = 0; rc == 0 && k < s->heads; k++)
            rc = describe_list(s, l, k, &nb, &out->lists[l * s->heads + k]);
    free(nb.index);
    if (rc == 0 && s->policy->export_layer != NULL)
        rc = describe_states(s, out);
    if (rc == 0)
        return ST_OK;
    seq_export_free(out);
    return rc == -1 ? status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory")
                    : status_set(st, ST_INTERNAL,
                                 "sequence %llu: a block is shared by two lists or tiers",
                                 (unsigned long long)s->id);
}

int seq_export_read_sketches(seq *s, seq_export *x)
{
    for (size_t i = 0; i < seq_nlists(s); i++) {
        seq_export_list *e = &x->lists[i];
        if (e->sketch_bytes == 0)
            continue;
        if (e->sketch_bytes != tier_sketch_bytes(&s->lists[i].sketch) || e->sketch == NULL ||
            tier_sketch_save(&s->lists[i].sketch, e->sketch) != 0)
            return -1;
    }
    return 0;
}

/* ---- import ----------------------------------------------------------------- */

/* Slots of a block of tier t in s's lists (0: not a tier blocks hold). */
static uint32_t tier_slots(const seq *s, uint8_t t)
{
    if (t == POLICY_FULL)
        return s->block_slots;
    if (t == POLICY_INT8 || t == POLICY_INT4 || t == POLICY_INT2)
        return tier_block_tokens(&s->tier, t);
    return 0;
}

/* The slots every export block's tokens use, one bit a slot, to refuse an
 * image that puts two tokens in one slot. */
typedef struct slot_map {
    uint8_t *bits;
    uint32_t stride; /* bytes a block */
    uint32_t *uses;  /* [nblocks] tokens naming the block */
} slot_map;

static status_code check_tokens(const seq *s, const seq_export *x, uint32_t list,
                                const tier_token *t, size_t n, slot_map *m, const char *what,
                                status *st)
{
    const seq_export_list *e = &x->lists[list];
    for (size_t i = 0; i < n; i++) {
        uint32_t b = t[i].block, slots = tier_slots(s, t[i].tier);
        if (t[i].tier == POLICY_SKETCH) {
            if (e->sketch_bytes == 0 || b != TIER_NO_BLOCK || t[i].slot != 0)
                return status_set(st, ST_INVALID_ARGUMENT,
                                  "import: list %u %s %zu is in a sketch (block %u slot %u), "
                                  "but the list has none, or not as TIER_NO_BLOCK slot 0",
                                  list, what, i, b, t[i].slot);
            continue;
        }
        if (b >= x->nblocks || x->block_list[b] != list || x->block_tier[b] != t[i].tier ||
            t[i].slot >= slots)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "import: list %u %s %zu names block %u slot %u of tier %u, not one "
                              "of its blocks",
                              list, what, i, b, t[i].slot, t[i].tier);
        uint8_t *byte = &m->bits[(size_t)b * m->stride + t[i].slot / 8];
        uint8_t bit = (uint8_t)(1u << (t[i].slot % 8));
        if (*byte & bit)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "import: list %u %s %zu shares block %u slot %u with another token",
                              list, what, i, b, t[i].slot);
        *byte |= bit;
        m->uses[b]++;
    }
    return ST_OK;
}

/* The size of list's sketch as s's policy makes it (tier_sketch_init's). */
static size_t sketch_bytes_here(const seq *s, uint32_t list)
{
    policy_sketch_geometry g;
    policy_host_sketch_geometry(s->host, list / s->heads, &g);
    return tier_sketch_bytes_for(g.rows, g.buckets,
                                 (size_t)s->list_layout.kv_heads * s->list_layout.head_dim);
}

static status_code check_list(const seq *s, const seq_export *x, uint32_t list, slot_map *m,
                              status *st)
{
    const seq_export_list *e = &x->lists[list];
    if (e->sketch_bytes > 0 && (e->sketch == NULL || e->sketch_bytes != sketch_bytes_here(s, list)))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "import: list %u's sketch has %zu bytes%s, policy %s's sketch geometry "
                          "makes %zu here",
                          list, e->sketch_bytes, e->sketch == NULL ? " (not read)" : "",
                          s->policy->name, sketch_bytes_here(s, list));
    if (check_tokens(s, x, list, e->at, e->ntokens, m, "token", st) != ST_OK ||
        check_tokens(s, x, list, e->victim_at, e->nvictims, m, "victim", st) != ST_OK)
        return st->code;
    for (size_t j = 0; j < e->nvictims; j++)
        if (e->victims[j] >= x->appended || (j > 0 && e->victims[j] <= e->victims[j - 1]))
            return status_set(
                st, ST_INVALID_ARGUMENT,
                "import: list %u victim %zu (position %u) is not ascending below %llu", list, j,
                e->victims[j], (unsigned long long)x->appended);
    for (size_t j = 0; j < e->nvictim_blocks; j++) {
        uint32_t b = e->victim_blocks[j];
        if (b >= x->nblocks || x->block_list[b] != list || x->block_tier[b] != POLICY_INT8)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "import: list %u victim block %zu is not one of its INT8 blocks",
                              list, j);
        m->uses[b]++;
    }
    if (e->has_tail &&
        (e->tail_block >= x->nblocks || x->block_list[e->tail_block] != list ||
         x->block_tier[e->tail_block] != POLICY_FULL || e->tail_next_slot > s->block_slots))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "import: list %u's tail is not one of its full-precision blocks", list);
    return ST_OK;
}

/* The image against itself and s's geometry: nothing is built from an
 * image this has not accepted. */
static status_code check_image(const seq *s, const seq_export *x, status *st)
{
    if (x->layers != s->nlayers || x->heads != s->heads)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "import: %u layers x %u lists, this pool's sequence has %u x %u",
                          x->layers, x->heads, s->nlayers, s->heads);
    if (x->appended > UINT32_MAX || x->unstepped > x->appended)
        return status_set(st, ST_INVALID_ARGUMENT, "import: %llu tokens appended, %u unstepped",
                          (unsigned long long)x->appended, x->unstepped);
    uint32_t most = 0; /* slots of the tier with the most a block */
    for (uint8_t t = 0; t < POLICY_TIERS; t++)
        most = tier_slots(s, t) > most ? tier_slots(s, t) : most;
    uint32_t stride = (most + 7) / 8;
    slot_map m = {calloc(x->nblocks ? x->nblocks * stride : 1, 1), stride,
                  calloc(x->nblocks ? x->nblocks : 1, sizeof *m.uses)};
    status_code rc = m.bits != NULL && m.uses != NULL
                         ? ST_OK
                         : status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (uint32_t i = 0; rc == ST_OK && i < seq_nlists(s); i++)
        rc = check_list(s, x, i, &m, st);
    for (size_t b = 0; rc == ST_OK && b < x->nblocks; b++)
        if (m.uses[b] == 0)
            rc = status_set(st, ST_INVALID_ARGUMENT, "import: block %zu holds no token", b);
    free(m.bits);
    free(m.uses);
    return rc;
}

/* The lists' storage from the image, blocks renamed to the pool's. On
 * failure the lists may hold some of it: the caller empties them. */
static int build_list(seq *s, const seq_export_list *e, const uint32_t *blocks, uint32_t layer,
                      seq_list *ly)
{
    /* The sketch first: its cells as they were, for the tokens below. */
    if (e->sketch_bytes > 0 &&
        (list_sketch_ready(s, ly, layer) != 0 || tier_sketch_load(&ly->sketch, e->sketch) != 0))
        return -1;
    tier_token *at = dup_array(e->at, e->ntokens, sizeof *at);
    if (at == NULL)
        return -1;
    for (uint32_t i = 0; i < e->ntokens; i++)
        if (at[i].tier != POLICY_SKETCH)
            at[i].block = blocks[at[i].block];
    int rc = list_encode(ly, at, e->ntokens);
    free(at);
    if (rc != 0)
        return -1;
    for (size_t j = 0; j < e->nvictims; j++) {
        tier_token v = e->victim_at[j];
        if (v.tier != POLICY_SKETCH)
            v.block = blocks[v.block];
        if (list_offload_push(ly, e->victims[j], v) != 0)
            return -1;
    }
    if (seq_grow((void **)&ly->victim_blocks, &ly->victim_blocks_cap, e->nvictim_blocks,
                 sizeof *ly->victim_blocks) != 0)
        return -1;
    for (size_t j = 0; j < e->nvictim_blocks; j++)
        ly->victim_blocks[j] = blocks[e->victim_blocks[j]];
    ly->nvictim_blocks = e->nvictim_blocks;
    ly->has_tail = e->has_tail;
    ly->tail_block = e->has_tail ? blocks[e->tail_block] : 0;
    ly->tail_next_slot = e->tail_next_slot;
    ly->demote_due = e->demote_due;
    return 0;
}

static status_code restore_host(seq *s, const seq_export *x, status *st)
{
    size_t n = seq_nlists(s);
    policy_host_list_image *im = calloc(n, sizeof *im);
    policy_host_state_image *states = x->states != NULL ? calloc(s->nlayers, sizeof *states) : NULL;
    if (im == NULL || (x->states != NULL && states == NULL)) {
        free(im);
        free(states);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        im[i] = (policy_host_list_image){x->lists[i].ntokens, x->lists[i].positions,
                                         x->lists[i].tiers, x->lists[i].attn};
    for (uint32_t l = 0; states != NULL && l < s->nlayers; l++)
        states[l] = (policy_host_state_image){x->states[l], x->state_len[l]};
    char err[POLICY_ERR_LEN] = "";
    errno = 0; /* out of memory leaves ENOMEM, as malloc sets it; the rest is the image's */
    int rc = policy_host_restore(s->host, x->appended, x->host_steps, im, states, err, sizeof err);
    int oom = rc != 0 && errno == ENOMEM;
    free(im);
    free(states);
    if (rc == 0)
        return ST_OK;
    return status_set(st, oom ? ST_RESOURCE_EXHAUSTED : ST_INVALID_ARGUMENT, "import: %s", err);
}

status_code seq_import(uint64_t id, uint64_t session_id, pool *pool, const seq_export *x,
                       const uint32_t *blocks, seq **out, status *st)
{
    *out = NULL;
    const policy_ops *ops = policy_find(x->policy);
    if (ops == NULL)
        return status_set(st, ST_INVALID_ARGUMENT, "import: this kvstashd has no policy '%.63s'",
                          x->policy);
    const char *values[POLICY_MAX_PARAMS];
    for (size_t i = 0; i < x->params.count; i++)
        values[i] = x->params.value[i];
    policy_params params;
    char err[POLICY_ERR_LEN] = "";
    if (x->params.count > POLICY_MAX_PARAMS ||
        policy_params_resolve(ops, x->params.key, values, x->params.count, &params, err,
                              sizeof err) != 0)
        return status_set(st, ST_INVALID_ARGUMENT, "import: policy %s: %s", ops->name, err);
    seq *s;
    if (seq_create(id, session_id, pool, ops, &params, x->label, &s, st) != ST_OK)
        return st->code;
    status_code rc = check_image(s, x, st);
    if (rc == ST_OK)
        rc = restore_host(s, x, st);
    for (size_t i = 0; rc == ST_OK && i < seq_nlists(s); i++)
        if (build_list(s, &x->lists[i], blocks, (uint32_t)(i / s->heads), &s->lists[i]) != 0)
            rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory for list %zu", i);
    if (rc != ST_OK) {
        for (size_t i = 0; i < seq_nlists(s); i++) /* the blocks stay the caller's */
            s->lists[i].nsegs = s->lists[i].noffloaded = s->lists[i].nvictim_blocks =
                s->lists[i].nfull_victims = 0;
        seq_destroy(s);
        return rc;
    }
    s->appended = x->appended;
    s->unstepped = x->unstepped;
    memcpy(s->moved, x->moved, sizeof s->moved);
    s->requantized = x->requantized;
    s->victims_dropped = x->victims_dropped;
    s->epoch = 1;
    *out = s;
    return ST_OK;
}
