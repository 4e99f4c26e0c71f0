/*
 * seq_list.c - the list and segment representation of a sequence's token
 * lists: segments, the tail block, offloaded victims, block sets, growth
 * (seq_internal.h).
 */
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

int seq_cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Drop repeats that follow each other; returns the new count. */
static size_t drop_runs(uint32_t *a, size_t m)
{
    size_t d = 0;
    for (size_t i = 0; i < m; i++)
        if (d == 0 || a[d - 1] != a[i])
            a[d++] = a[i];
    return d;
}

/* Sort and drop repeats; returns the new count. The ids of a list's tokens
 * come in list order, a block's repeated for each of its tokens and the
 * blocks mostly ascending: dropping runs first leaves about one id per
 * block, often sorted already, so a step does not sort one id per token. */
size_t seq_sort_unique(uint32_t *a, size_t m)
{
    m = drop_runs(a, m);
    size_t i = 1;
    while (i < m && a[i - 1] < a[i])
        i++;
    if (i < m) {
        qsort(a, m, sizeof *a, seq_cmp_u32);
        m = drop_runs(a, m);
    }
    return m;
}

/* Call visit(ctx, block) for every block of a list's offloaded victims
 * and (with segments) its segments stored in `tier` (any tier with a block
 * when tier < 0), with repeats (victims spilled to the remote tier have no
 * pool block); returns the sum of what visit returned. */
static size_t list_visit_blocks(const seq_list *ly, int tier, int segments,
                                int (*visit)(void *, uint32_t), void *ctx)
{
    size_t sum = 0;
    for (size_t i = 0; segments && i < ly->nsegs; i++)
        if (ly->seg_tier[i] != POLICY_SKETCH && (tier < 0 || ly->seg_tier[i] == tier))
            sum += (size_t)visit(ctx, ly->segs[i].block);
    for (size_t j = 0; j < ly->noffloaded; j++) {
        const tier_token *at = &ly->offloaded_at[j];
        if (at->tier != POLICY_SKETCH && !tier_token_remote(at) && (tier < 0 || at->tier == tier))
            sum += (size_t)visit(ctx, at->block);
    }
    return sum;
}

static int append_id(void *out, uint32_t block)
{
    uint32_t **next = out;
    *(*next)++ = block;
    return 1;
}

size_t list_fill_block_ids(const seq_list *ly, int tier, uint32_t *out)
{
    return list_visit_blocks(ly, tier, 1, append_id, &out);
}

static int mark(void *marks, uint32_t block)
{
    return block_mark(marks, block);
}

static int unmark(void *marks, uint32_t block)
{
    block_unmark(marks, block);
    return 0;
}

uint32_t list_count_blocks(const seq_list *ly, int tier, const seq *s)
{
    /* A block's segments need not be adjacent (revived and sketched tokens
     * interleave with others): count each block once by its mark. */
    size_t n = list_visit_blocks(ly, tier, 1, mark, s->marks);
    list_visit_blocks(ly, tier, 1, unmark, s->marks);
    return (uint32_t)n;
}

void list_free_blocks(seq_list *ly, pool *p)
{
    /* The list is being destroyed: its own arrays hold the block ids while
     * they are sorted, so that giving the blocks back needs no memory (a
     * sequence released while malloc fails lost them: test_faults). Segment
     * i's block is read before id i is written, 12 bytes vs 4 into it. */
    uint32_t *a = (uint32_t *)ly->segs, *b = ly->offloaded;
    size_t na = 0, nb = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        if (ly->seg_tier[i] != POLICY_SKETCH)
            a[na++] = ly->segs[i].block;
    for (size_t j = 0; j < ly->noffloaded; j++)
        if (ly->offloaded_at[j].tier != POLICY_SKETCH && !tier_token_remote(&ly->offloaded_at[j]))
            b[nb++] = ly->offloaded_at[j].block;
    na = na ? seq_sort_unique(a, na) : 0; /* a or b may be NULL when empty */
    nb = nb ? seq_sort_unique(b, nb) : 0;
    for (size_t i = 0; i < na; i++)
        pool_free_block(p, a[i]);
    for (size_t j = 0, i = 0; j < nb; j++) { /* those of b not in a */
        while (i < na && a[i] < b[j])
            i++;
        if (i == na || a[i] != b[j])
            pool_free_block(p, b[j]);
    }
    ly->nsegs = ly->noffloaded = ly->nfull_victims = 0;
    ly->blocks_at_most = 0;
    /* A tail block whose every token was evicted is retired, not in segs. */
}

int seq_grow(void **arr, size_t *cap, size_t need, size_t elt)
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

int list_reserve(seq_list *ly, size_t nsegs)
{
    size_t cap = ly->segs_cap;
    if (seq_grow((void **)&ly->segs, &cap, nsegs, sizeof *ly->segs) != 0)
        return -1;
    if (cap != ly->segs_cap) {
        uint8_t *t = realloc(ly->seg_tier, cap);
        if (t == NULL)
            return -1; /* segs grew; segs_cap stays, so the next call retries */
        ly->seg_tier = t;
        ly->segs_cap = cap;
    }
    return 0;
}

int seq_retire(seq *s, uint32_t block, uint64_t epoch)
{
    if (seq_grow((void **)&s->retired, &s->retired_cap, s->nretired + 1, sizeof *s->retired) != 0)
        return -1;
    s->retired[s->nretired++] = (seq_retired){block, epoch};
    return 0;
}

int list_tail_usable(const seq_list *ly, uint32_t block_slots)
{
    return ly->has_tail && ly->tail_next_slot < block_slots;
}

/* Expand a list's segments into one entry per token. */
tier_token *list_expand(const seq_list *ly, uint32_t n)
{
    tier_token *tok = malloc((n ? n : 1) * sizeof *tok);
    if (tok == NULL)
        return NULL;
    size_t t = 0;
    for (size_t i = 0; i < ly->nsegs; i++)
        for (uint32_t j = 0; j < ly->segs[i].count && t < n; j++)
            tok[t++] = (tier_token){ly->segs[i].block, ly->segs[i].first_slot + j, ly->seg_tier[i]};
    return tok;
}

/* Rebuild a list's segments from per-token storage (runs of one tier in one
 * block with consecutive slots; sketch runs have no block). */
int list_encode(seq_list *ly, const tier_token *tok, uint32_t n)
{
    if (list_reserve(ly, n ? n : 1) != 0)
        return -1;
    size_t out = 0;
    for (uint32_t i = 0; i < n; i++)
        out = list_push_run(ly->segs, ly->seg_tier, out, (kv_segment){tok[i].block, tok[i].slot, 1},
                            tok[i].tier);
    ly->nsegs = out;
    ly->blocks_at_most = SEQ_BLOCKS_UNKNOWN; /* not counted: no marks here */
    return 0;
}

size_t list_block_ids(const seq_list *ly, const tier_token *tok, uint32_t n, int with_tail,
                      uint32_t *out)
{
    size_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (tok[i].tier != POLICY_SKETCH && (m == 0 || out[m - 1] != tok[i].block))
            out[m++] = tok[i].block;
    uint32_t *next = out + m;
    m += list_visit_blocks(ly, -1, 0, append_id, &next);
    if (with_tail && ly->has_tail)
        out[m++] = ly->tail_block;
    return m;
}

/* A never-written full-precision slot at the list's tail (a new block when
 * the tail is full). Returns -1 when the pool has no free block. */
int list_take_slot(seq *s, seq_list *ly, tier_token *out)
{
    if (!list_tail_usable(ly, s->block_slots)) {
        if (seq_take_block(s, &ly->tail_block) != 0)
            return -1;
        ly->tail_next_slot = 0;
        ly->has_tail = 1;
        if (ly->blocks_at_most != SEQ_BLOCKS_UNKNOWN)
            ly->blocks_at_most++;
    }
    *out = (tier_token){ly->tail_block, ly->tail_next_slot++, POLICY_FULL};
    return 0;
}

int list_sketch_ready(seq *s, seq_list *ly, uint32_t layer)
{
    if (ly->sketch.sk.key != NULL)
        return 0;
    policy_sketch_geometry g;
    policy_host_sketch_geometry(s->host, layer, &g);
    return tier_sketch_init(&ly->sketch, &s->tier, &g);
}

int seq_stage_error_sample(seq *s, const tier_token *tok, const uint32_t *idx, size_t m,
                           uint32_t sidx[TIER_ERROR_SAMPLE], size_t *ns, uint8_t **stage)
{
    tier_token sel[TIER_ERROR_SAMPLE];
    *ns = tier_error_sample(m, sidx);
    for (size_t i = 0; i < *ns; i++) {
        sidx[i] = idx[sidx[i]];
        sel[i] = tok[sidx[i]];
    }
    *stage = tier_stage_alloc(&s->tier, *ns);
    size_t half = *ns * tier_token_bytes(&s->tier) / 2;
    if (*stage != NULL && tier_read(&s->tier, sel, *ns, *stage, *stage + half) == 0)
        return 0;
    tier_stage_free(&s->tier, *stage);
    *stage = NULL;
    return -1;
}

/* tier_error_ratio of tokens idx[0..m) of tok against their staged
 * originals. */
static int stage_error(seq *s, const tier_token *tok, const uint32_t *idx, size_t m,
                       const uint8_t *stage, double *ratio)
{
    tier_token sel[TIER_ERROR_SAMPLE];
    for (size_t i = 0; i < m; i++)
        sel[i] = tok[idx[i]];
    return tier_error_ratio(&s->tier, sel, m, stage, ratio);
}

int seq_quantize_into(seq *s, uint8_t qt, tier_token *tok, const uint32_t *idx, size_t m,
                      const uint32_t *qb, size_t nq, double *ratio)
{
    uint32_t t8 = tier_block_tokens(&s->tier, qt), sidx[TIER_ERROR_SAMPLE];
    size_t ns;
    uint8_t *orig;
    tier_token *src = malloc((m ? m : 1) * sizeof *src);
    *ratio = -1;
    if (src == NULL || seq_stage_error_sample(s, tok, idx, m, sidx, &ns, &orig) != 0) {
        free(src);
        return -1;
    }
    for (size_t j = 0; j < m; j++)
        src[j] = tok[idx[j]];
    int rc = tier_quantize(&s->tier, qt, src, m, qb, nq);
    for (size_t j = 0; rc == 0 && j < m; j++)
        tok[idx[j]] = (tier_token){qb[j / t8], (uint32_t)(j % t8), qt};
    if (rc == 0 && stage_error(s, tok, sidx, ns, orig, ratio) != 0)
        *ratio = -1;
    tier_stage_free(&s->tier, orig);
    free(src);
    return rc;
}

/* Keep a victim out of the list, stored at `at`. */
int list_offload_push(seq_list *ly, uint32_t position, tier_token at)
{
    size_t cap = ly->offloaded_cap;
    if (seq_grow((void **)&ly->offloaded, &cap, ly->noffloaded + 1, sizeof *ly->offloaded) != 0 ||
        seq_grow((void **)&ly->offloaded_at, &ly->offloaded_cap, ly->noffloaded + 1,
                 sizeof *ly->offloaded_at) != 0)
        return -1;
    /* Victims leave in position order within a step, but a step's victims
     * may be older than an earlier step's: keep the arrays sorted. */
    size_t i = ly->noffloaded;
    while (i > 0 && ly->offloaded[i - 1] > position) {
        ly->offloaded[i] = ly->offloaded[i - 1];
        ly->offloaded_at[i] = ly->offloaded_at[i - 1];
        i--;
    }
    ly->offloaded[i] = position;
    ly->offloaded_at[i] = at;
    ly->noffloaded++;
    ly->nfull_victims += at.tier == POLICY_FULL;
    return 0;
}

uint32_t list_blocks_needed(uint32_t count, uint32_t room, uint32_t block_tokens)
{
    return count <= room ? 0 : (count - room + block_tokens - 1) / block_tokens;
}

static void list_push(seq_list *ly, uint32_t block, uint32_t slot, uint32_t n)
{
    kv_segment *last = ly->nsegs ? &ly->segs[ly->nsegs - 1] : NULL;
    if (last != NULL && ly->seg_tier[ly->nsegs - 1] == POLICY_FULL && last->block == block &&
        last->first_slot + last->count == slot) {
        last->count += n;
    } else {
        ly->seg_tier[ly->nsegs] = POLICY_FULL;
        ly->segs[ly->nsegs++] = (kv_segment){block, slot, n};
    }
}

/* Put `count` new tokens at the list's tail; blocks were checked free. */
size_t list_grow(seq *s, seq_list *ly, uint32_t count, kv_segment *writes)
{
    uint32_t bt = s->block_slots;
    size_t nw = 0;
    while (count > 0) {
        if (!list_tail_usable(ly, bt)) {
            seq_take_block(s, &ly->tail_block); /* checked by the caller */
            ly->tail_next_slot = 0;
            ly->has_tail = 1;
            if (ly->blocks_at_most != SEQ_BLOCKS_UNKNOWN)
                ly->blocks_at_most++;
        }
        uint32_t n = bt - ly->tail_next_slot;
        if (n > count)
            n = count;
        list_push(ly, ly->tail_block, ly->tail_next_slot, n);
        writes[nw++] = (kv_segment){ly->tail_block, ly->tail_next_slot, n};
        ly->tail_next_slot += n;
        count -= n;
    }
    return nw;
}
