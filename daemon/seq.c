#include "seq.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

status_code seq_create(uint64_t id, uint64_t session_id, pool *pool, const policy_ops *policy,
                       const policy_params *params, const char *label, seq **out, status *st)
{
    *out = NULL;
    seq *s = calloc(1, sizeof *s);
    if (s == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    s->id = id;
    s->session_id = session_id;
    s->pool = pool;
    s->policy = policy;
    s->params = *params;
    snprintf(s->label, sizeof s->label, "%s", label ? label : "");
    s->nlayers = pool->geom.layers;
    s->layers = calloc(s->nlayers, sizeof *s->layers);
    if (s->layers == NULL) {
        free(s);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    char err[POLICY_ERR_LEN] = "";
    if (policy->create(&s->params, &s->policy_state, err, sizeof err) != 0) {
        status_set(st, ST_INVALID_ARGUMENT, "policy %s: %s", policy->name, err);
        free(s->layers);
        free(s);
        return st->code;
    }
    *out = s;
    return ST_OK;
}

static void layer_free_blocks(seq_layer *ly, pool *p)
{
    /* A block's segments are adjacent in the list (tokens arrive in order). */
    for (size_t i = 0; i < ly->nsegs; i++)
        if (i == 0 || ly->segs[i].block != ly->segs[i - 1].block)
            pool_free_block(p, ly->segs[i].block);
    /* A tail block whose every token was evicted is retired, not in segs. */
}

void seq_destroy(seq *s)
{
    if (s == NULL)
        return;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        layer_free_blocks(&s->layers[l], s->pool);
        free(s->layers[l].segs);
        free(s->layers[l].pos);
    }
    for (size_t i = 0; i < s->nretired; i++)
        pool_free_block(s->pool, s->retired[i].block);
    if (s->policy_state != NULL)
        s->policy->destroy(s->policy_state);
    free(s->retired);
    free(s->layers);
    free(s);
}

void seq_ack(seq *s, uint64_t ack_epoch)
{
    size_t kept = 0;
    for (size_t i = 0; i < s->nretired; i++) {
        if (s->retired[i].epoch <= ack_epoch)
            pool_free_block(s->pool, s->retired[i].block);
        else
            s->retired[kept++] = s->retired[i];
    }
    s->nretired = kept;
}

uint32_t seq_blocks_held(const seq *s)
{
    uint32_t n = (uint32_t)s->nretired;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        const seq_layer *ly = &s->layers[l];
        for (size_t i = 0; i < ly->nsegs; i++)
            if (i == 0 || ly->segs[i].block != ly->segs[i - 1].block)
                n++;
    }
    return n;
}

size_t seq_retired_count(const seq *s)
{
    return s->nretired;
}

uint64_t seq_tokens_held(const seq *s)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < s->nlayers; l++)
        n += s->layers[l].tokens;
    return n;
}

/* ---- growth helpers --------------------------------------------------- */

static int grow(void **arr, size_t *cap, size_t need, size_t elt)
{
    if (need <= *cap)
        return 0;
    size_t ncap = *cap ? *cap : 8;
    while (ncap < need)
        ncap *= 2;
    void *n = realloc(*arr, ncap * elt);
    if (n == NULL)
        return -1;
    *arr = n;
    *cap = ncap;
    return 0;
}

static int layer_reserve(seq_layer *ly, size_t nsegs, size_t ntokens)
{
    size_t pos_cap = ly->pos_cap;
    if (grow((void **)&ly->segs, &ly->segs_cap, nsegs, sizeof *ly->segs) != 0 ||
        grow((void **)&ly->pos, &pos_cap, ntokens, sizeof *ly->pos) != 0)
        return -1;
    ly->pos_cap = (uint32_t)pos_cap;
    return 0;
}

static int seq_retire(seq *s, uint32_t block, uint64_t epoch)
{
    if (grow((void **)&s->retired, &s->retired_cap, s->nretired + 1, sizeof *s->retired) != 0)
        return -1;
    s->retired[s->nretired++] = (seq_retired){block, epoch};
    return 0;
}

/* ---- eviction ----------------------------------------------------------- */

/* Whether any token of `block` survives the keep mask. */
static int block_survives(const seq_layer *ly, const uint8_t *keep, uint32_t block)
{
    size_t t = 0;
    for (size_t i = 0; i < ly->nsegs; t += ly->segs[i].count, i++) {
        if (ly->segs[i].block != block)
            continue;
        for (uint32_t j = 0; j < ly->segs[i].count; j++)
            if (keep[t + j])
                return 1;
    }
    return 0;
}

/* Whether the layer's tail block can take more tokens after the eviction. */
static int tail_usable(const seq_layer *ly, const uint8_t *keep, uint32_t block_tokens)
{
    return ly->has_tail && ly->tail_next_slot < block_tokens &&
           (keep == NULL || block_survives(ly, keep, ly->tail_block));
}

/* Drop the tokens keep[] rejects, in place (the segment list only shrinks or
 * splits; splitting needs room, reserved by the caller), and retire the
 * blocks left with no token. */
static int layer_evict(seq *s, seq_layer *ly, const uint8_t *keep, uint64_t epoch)
{
    size_t nsegs = ly->nsegs;
    kv_segment *old = malloc((nsegs ? nsegs : 1) * sizeof *old);
    if (old == NULL)
        return -1;
    memcpy(old, ly->segs, nsegs * sizeof *old);
    size_t out = 0, t = 0, kept_tokens = 0;
    int block_has_kept = 0;
    for (size_t i = 0; i < nsegs; i++) {
        const kv_segment *sg = &old[i];
        int run_open = 0;
        for (uint32_t j = 0; j < sg->count; j++, t++) {
            if (!keep[t]) {
                run_open = 0;
                continue;
            }
            ly->pos[kept_tokens++] = ly->pos[t];
            block_has_kept = 1;
            if (run_open) {
                ly->segs[out - 1].count++;
            } else {
                ly->segs[out++] = (kv_segment){sg->block, sg->first_slot + j, 1};
                run_open = 1;
            }
        }
        int block_ends = i + 1 == nsegs || old[i + 1].block != sg->block;
        if (block_ends) {
            if (!block_has_kept && seq_retire(s, sg->block, epoch) != 0) {
                free(old);
                return -1;
            }
            if (!block_has_kept && ly->has_tail && ly->tail_block == sg->block)
                ly->has_tail = 0;
            block_has_kept = 0;
        }
    }
    ly->nsegs = out;
    ly->tokens = (uint32_t)kept_tokens;
    free(old);
    return 0;
}

/* Upper bound of segments after eviction: each kept run is one segment. */
static size_t evicted_seg_bound(const seq_layer *ly, const uint8_t *keep)
{
    size_t runs = 0;
    for (uint32_t t = 0; t < ly->tokens; t++)
        if (keep[t] && (t == 0 || !keep[t - 1]))
            runs++;
    return runs + ly->nsegs;
}

/* ---- append ------------------------------------------------------------ */

static uint32_t blocks_needed(uint32_t count, uint32_t room, uint32_t block_tokens)
{
    return count <= room ? 0 : (count - room + block_tokens - 1) / block_tokens;
}

static void layer_push(seq_layer *ly, uint32_t block, uint32_t slot, uint32_t n)
{
    kv_segment *last = ly->nsegs ? &ly->segs[ly->nsegs - 1] : NULL;
    if (last != NULL && last->block == block && last->first_slot + last->count == slot)
        last->count += n;
    else
        ly->segs[ly->nsegs++] = (kv_segment){block, slot, n};
}

/* Put `count` new tokens at the layer's tail; blocks were checked free. */
static size_t layer_grow(seq *s, seq_layer *ly, uint32_t count, kv_segment *writes)
{
    uint32_t bt = s->pool->geom.block_tokens;
    size_t nw = 0;
    for (uint32_t i = 0; i < count; i++)
        ly->pos[ly->tokens + i] = (uint32_t)(s->appended + i);
    ly->tokens += count;
    while (count > 0) {
        if (!ly->has_tail || ly->tail_next_slot >= bt) {
            pool_alloc_block(s->pool, &ly->tail_block); /* checked by the caller */
            ly->tail_next_slot = 0;
            ly->has_tail = 1;
        }
        uint32_t n = bt - ly->tail_next_slot;
        if (n > count)
            n = count;
        layer_push(ly, ly->tail_block, ly->tail_next_slot, n);
        writes[nw++] = (kv_segment){ly->tail_block, ly->tail_next_slot, n};
        ly->tail_next_slot += n;
        count -= n;
    }
    return nw;
}

/* Ask the policy about every layer; fills keep[l] and the blocks needed. */
static status_code seq_plan(seq *s, uint32_t count, uint8_t **keep, uint32_t *evicted,
                            uint64_t *need, status *st)
{
    uint32_t bt = s->pool->geom.block_tokens;
    *evicted = 0;
    *need = 0;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        seq_layer *ly = &s->layers[l];
        keep[l] = malloc(ly->tokens ? ly->tokens : 1);
        if (keep[l] == NULL)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
        policy_layer_view view = {l, s->nlayers, ly->tokens, ly->pos, s->appended};
        s->policy->select(s->policy_state, &view, count, keep[l]);
        for (uint32_t t = 0; t < ly->tokens; t++) /* counted here, not trusted */
            *evicted += keep[l][t] == 0;
        uint32_t room = tail_usable(ly, keep[l], bt) ? bt - ly->tail_next_slot : 0;
        *need += blocks_needed(count, room, bt);
    }
    return ST_OK;
}

static status_code seq_commit(seq *s, uint32_t count, uint8_t *const *keep,
                              kv_segment *const *writes, size_t *nwrites, status *st)
{
    uint32_t bt = s->pool->geom.block_tokens;
    uint64_t epoch = s->epoch + 1;
    for (uint32_t l = 0; l < s->nlayers; l++) {
        seq_layer *ly = &s->layers[l];
        size_t seg_room = evicted_seg_bound(ly, keep[l]) + count / bt + 2;
        if (layer_reserve(ly, seg_room, (size_t)ly->tokens + count) != 0 ||
            layer_evict(s, ly, keep[l], epoch) != 0)
            return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
        nwrites[l] = layer_grow(s, ly, count, writes[l]);
    }
    s->appended += count;
    s->epoch = epoch;
    return ST_OK;
}

status_code seq_append(seq *s, int64_t count, kv_segment *const *writes, size_t *nwrites,
                       uint32_t *evicted, status *st)
{
    if (count < 1 || count > SEQ_MAX_APPEND)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "count must be between 1 and %d tokens per append, got %lld",
                          SEQ_MAX_APPEND, (long long)count);
    if (s->appended + (uint64_t)count > UINT32_MAX)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "sequence %llu would exceed 2^32-1 positions",
                          (unsigned long long)s->id);
    uint8_t **keep = calloc(s->nlayers, sizeof *keep);
    if (keep == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    uint64_t need = 0;
    status_code rc = seq_plan(s, (uint32_t)count, keep, evicted, &need, st);
    if (rc == ST_OK && need > s->pool->nfree)
        rc = status_set(st, ST_RESOURCE_EXHAUSTED,
                        "appending %lld tokens needs %llu free blocks; pool '%s' has %u of %u "
                        "free (release sequences or start kvstashd with a larger --pool-mb)",
                        (long long)count, (unsigned long long)need, s->pool->model,
                        s->pool->nfree, s->pool->block_count);
    if (rc == ST_OK)
        rc = seq_commit(s, (uint32_t)count, keep, writes, nwrites, st);
    for (uint32_t l = 0; l < s->nlayers; l++)
        free(keep[l]);
    free(keep);
    return rc;
}
