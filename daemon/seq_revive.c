/*
 * seq_revive.c - rebuilding a range of a list in full precision into
 * scratch blocks (seq.h seq_revive).
 */
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

/* Positions [first, end) that are neither held nor offloaded: the first
 * such run in *gap_first / *gap_count, and how many in all. */
static uint32_t revive_gaps(const uint32_t *pos, uint32_t n, const uint32_t *off, size_t noff,
                            uint32_t first, uint32_t end, uint32_t *gap_first, uint32_t *gap_count)
{
    uint32_t i = 0, missing = 0;
    size_t j = 0;
    *gap_count = 0;
    for (uint32_t p = first; p < end; p++) {
        while (i < n && pos[i] < p)
            i++;
        while (j < noff && off[j] < p)
            j++;
        if ((i < n && pos[i] == p) || (j < noff && off[j] == p))
            continue;
        if (missing++ == 0)
            *gap_first = p;
        if (*gap_count == p - *gap_first)
            (*gap_count)++;
    }
    return missing;
}

/* The revived tokens in position order: where each is stored (held, or an
 * offloaded victim) and its position. */
static size_t revive_select(const seq_list *ly, const uint32_t *pos, const tier_token *tok,
                            uint32_t n, uint32_t first, uint32_t end, tier_token *src, uint32_t *at)
{
    size_t m = 0, j = 0, noff = ly->noffloaded;
    uint32_t i = 0;
    while (i < n || j < noff) {
        int held = j == noff || (i < n && pos[i] < ly->offloaded[j]);
        uint32_t p = held ? pos[i] : ly->offloaded[j];
        if (p >= first && p < end) {
            src[m] = held ? tok[i] : ly->offloaded_at[j];
            at[m++] = p;
        }
        held ? i++ : j++;
    }
    return m;
}

/* Write the revived tokens into dst: FULL / INT8 tokens read back, sketch
 * tokens queried. */
static int revive_fill(seq *s, seq_list *ly, const tier_token *src, const uint32_t *at, size_t m,
                       const tier_token *dst)
{
    for (size_t a = 0; a < m;) {
        int sketch = src[a].tier == POLICY_SKETCH;
        size_t b = a;
        while (b < m && (src[b].tier == POLICY_SKETCH) == sketch)
            b++;
        if (sketch) {
            if (tier_sketch_read(&ly->sketch, &s->tier, s->pool->base, at + a, b - a, dst + a, 0))
                return -1;
        } else if (tier_copy(&s->tier, src + a, b - a, dst + a) != 0) {
            return -1;
        }
        a = b;
    }
    return 0;
}

status_code seq_revive(seq *s, const seq_revive_request *req, seq_revived *out, status *st)
{
    memset(out, 0, sizeof *out);
    uint32_t layer = req->layer, head = req->head, first = req->first, count = req->count;
    int skip_evicted = req->skip_evicted;
    kv_segment **segs = &out->segs;
    uint32_t **pos = &out->positions, **blocks = &out->blocks;
    uint8_t **src_tier = &out->src_tier;
    if (layer >= s->nlayers || head >= s->heads)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "list (layer %u, head %u) does not exist: the sequence has %u layers "
                          "and %u list(s) per layer",
                          layer, head, s->nlayers, s->heads);
    uint64_t end = count == 0 ? s->appended : (uint64_t)first + count;
    if (s->appended == 0)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "the sequence holds no position yet: append before reviving");
    if (first >= s->appended)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "first position %u is not in the sequence (positions 0..%llu exist)",
                          first, (unsigned long long)s->appended - 1);
    if (end > s->appended)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "positions %u..%llu are not in the sequence (positions 0..%llu exist)",
                          first, (unsigned long long)end - 1, (unsigned long long)s->appended - 1);
    seq_list *ly = seq_list_at(s, layer, head);
    const uint32_t *lpos;
    uint32_t n = seq_list_tokens(s, layer, head, &lpos), gap_first = 0, gap_count;
    uint32_t missing = revive_gaps(lpos, n, ly->offloaded, ly->noffloaded, first, (uint32_t)end,
                                   &gap_first, &gap_count);
    if (missing > 0 && !skip_evicted)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "%u of positions %u..%llu of layer %u were evicted outright, not "
                          "offloaded (first: %u..%u); nothing can revive them (create the "
                          "sequence with victims=sketch or victims=int8 to keep evicted "
                          "tokens, or ask with skip_evicted)",
                          missing, first, (unsigned long long)end - 1, layer, gap_first,
                          gap_first + gap_count - 1);
    size_t m = (size_t)(end - first) - missing;
    uint32_t slots = s->block_slots, need = (uint32_t)((m + slots - 1) / slots);
    if (need > s->pool->nfree)
        return status_set(st, ST_RESOURCE_EXHAUSTED,
                          "reviving %zu tokens needs %u free blocks; pool '%s' has %u", m, need,
                          s->pool->model, s->pool->nfree);
    tier_token *tok = list_expand(ly, n), *dst = malloc((m ? m : 1) * sizeof *dst);
    tier_token *src = malloc((m ? m : 1) * sizeof *src);
    *pos = malloc((m ? m : 1) * sizeof **pos);
    *src_tier = malloc(m ? m : 1);
    *blocks = malloc((need ? need : 1) * sizeof **blocks);
    *segs = malloc((need ? need : 1) * sizeof **segs);
    int rc = tok && dst && src && *pos && *src_tier && *blocks && *segs ? 0 : -1;
    /* A failure gives the blocks back where they were (the free stack's
     * order too: the same call run again takes the same blocks). */
    pool_savepoint(s->pool);
    if (rc == 0) {
        revive_select(ly, lpos, tok, n, first, (uint32_t)end, src, *pos);
        for (uint32_t b = 0; b < need; b++) {
            pool_alloc_block(s->pool, &(*blocks)[b]); /* checked above */
            (*segs)[b] = (kv_segment){(*blocks)[b], 0,
                                      b + 1 < need ? slots : (uint32_t)(m - (size_t)b * slots)};
        }
        for (size_t j = 0; j < m; j++) {
            dst[j] = (tier_token){(*blocks)[j / slots], (uint32_t)(j % slots), POLICY_FULL};
            (*src_tier)[j] = src[j].tier;
        }
        rc = revive_fill(s, ly, src, *pos, m, dst);
    }
    free(tok);
    free(dst);
    free(src);
    if (rc != 0) {
        pool_rollback(s->pool);
        free(*segs), free(*pos), free(*src_tier), free(*blocks);
        *segs = NULL, *pos = NULL, *src_tier = NULL, *blocks = NULL;
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    pool_release(s->pool);
    out->nsegs = out->nblocks = need;
    out->ntokens = m;
    return ST_OK;
}
