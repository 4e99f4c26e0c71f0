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
 * offloaded victim), its position, and in here[] (when not NULL) whether
 * the list holds it at full precision, where an in-place Revive reads it. */
static size_t revive_select(const seq_list *ly, const uint32_t *pos, const tier_token *tok,
                            uint32_t n, uint32_t first, uint32_t end, tier_token *src, uint32_t *at,
                            uint8_t *here)
{
    size_t m = 0, j = 0, noff = ly->noffloaded;
    uint32_t i = 0;
    while (i < n || j < noff) {
        int held = j == noff || (i < n && pos[i] < ly->offloaded[j]);
        uint32_t p = held ? pos[i] : ly->offloaded[j];
        if (p >= first && p < end) {
            src[m] = held ? tok[i] : ly->offloaded_at[j];
            if (here != NULL)
                here[m] = held && tok[i].tier == POLICY_FULL;
            at[m++] = p;
        }
        held ? i++ : j++;
    }
    return m;
}

/* Where a revived token is read from: pool blocks (-2), the list's sketch
 * (-1), or spilled sketch i that the job fetched (i; plan_remote). */
static int64_t revive_source(const tier_token *t)
{
    if (t->tier != POLICY_SKETCH)
        return -2;
    return t->block == TIER_NO_BLOCK ? -1 : (int64_t)t->block;
}

/* Write the revived tokens into dst: FULL / INT8 tokens read back, sketch
 * tokens queried (from the list's sketch, or a spilled one, sk[i]). */
static int revive_fill(seq *s, seq_list *ly, tier_sketch *sk, const tier_token *src,
                       const uint32_t *at, size_t m, const tier_token *dst)
{
    for (size_t a = 0; a < m;) {
        int64_t from = revive_source(&src[a]);
        size_t b = a;
        while (b < m && revive_source(&src[b]) == from)
            b++;
        if (from == -2 ? tier_copy(&s->tier, src + a, b - a, dst + a) != 0
                       : tier_sketch_read(from == -1 ? &ly->sketch : &sk[from], &s->tier,
                                          s->pool->base, at + a, b - a, dst + a, 0) != 0)
            return -1;
        a = b;
    }
    return 0;
}

/* A Revive between seq_revive_plan and seq_revive_finish: the ncopy
 * tokens to rebuild (src, in position order at[]) and where to write them
 * (dst, in the blocks of `out`, which the plan allocated); tokens read in
 * place are in out's segments only. */
struct seq_revive_job {
    seq *s;
    seq_list *ly;
    tier_token *src, *dst;
    uint32_t *at;
    size_t ncopy;
    seq_revived out;
    /* Spilled victims to fetch (seq_revive_remote): part i is read into
     * pool block stage[i] (TIER_NO_BLOCK for a sketch), or into sketch
     * stage_sk[i]; the job owns both, finish frees them. */
    seq_remote_part *remote;
    uint32_t *stage;
    tier_sketch *stage_sk;
    uint32_t **remote_pos;
    size_t nremote;
};

/* Give back what the job staged spilled parts in. */
static void job_unstage(seq_revive_job *j)
{
    for (size_t i = j->nremote; i-- > 0;) {
        if (j->stage[i] != TIER_NO_BLOCK)
            seq_give_block(j->s, j->stage[i]);
        j->stage[i] = TIER_NO_BLOCK;
        tier_sketch_free(&j->stage_sk[i]);
    }
}

static void job_free(seq_revive_job *j)
{
    for (size_t i = 0; i < j->nremote; i++)
        free(j->remote_pos[i]);
    free(j->remote), free(j->stage), free(j->stage_sk), free(j->remote_pos);
    free(j->src);
    free(j->dst);
    free(j->at);
    free(j->out.segs), free(j->out.positions), free(j->out.src_tier), free(j->out.blocks);
    free(j);
}

/* The request's checks, with the positions to revive counted: *m tokens. */
static status_code revive_check(seq *s, const seq_revive_request *req, uint32_t *n,
                                const uint32_t **lpos, size_t *m, status *st)
{
    uint32_t layer = req->layer, head = req->head, first = req->first, count = req->count;
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
    uint32_t gap_first = 0, gap_count;
    *n = seq_list_tokens(s, layer, head, lpos);
    uint32_t missing = revive_gaps(*lpos, *n, ly->offloaded, ly->noffloaded, first, (uint32_t)end,
                                   &gap_first, &gap_count);
    if (missing > 0 && !req->skip_evicted)
        return status_set(st, ST_FAILED_PRECONDITION,
                          "%u of positions %u..%llu of layer %u were evicted outright, not "
                          "offloaded (first: %u..%u); nothing can revive them (create the "
                          "sequence with victims=sketch or victims=int8 to keep evicted "
                          "tokens, or ask with skip_evicted)",
                          missing, first, (unsigned long long)end - 1, layer, gap_first,
                          gap_first + gap_count - 1);
    *m = (size_t)(end - first) - missing;
    return ST_OK;
}

/* The distinct spilled parts among src[0..m), in order of first use. */
static size_t remote_parts(const tier_token *src, size_t m, uint32_t *parts)
{
    size_t np = 0;
    for (size_t t = 0; t < m; t++) {
        if (!tier_token_remote(&src[t]))
            continue;
        uint32_t part = src[t].block & ~SEQ_REMOTE_BLOCK;
        size_t i = 0;
        while (i < np && parts[i] != part)
            i++;
        if (i == np)
            parts[np++] = part;
    }
    return np;
}

/* Spilled sketches one Revive may stage at once (each as large as the
 * list's sketch): a wider range asks for a narrower one. */
#define REVIVE_MAX_SKETCHES 4

/* Part i's description: its tier, the positions its value must carry, its
 * payload's size. 0, or -1 out of memory. */
static int describe_part(seq_revive_job *j, size_t i, uint32_t part, const seq_revive_request *req)
{
    const seq_list *ly = j->ly;
    uint32_t ref = SEQ_REMOTE_BLOCK | part, *pos;
    if ((pos = j->remote_pos[i] = malloc((ly->noffloaded ? ly->noffloaded : 1) * sizeof *pos)) ==
        NULL)
        return -1;
    seq_remote_part *rp = &j->remote[i];
    *rp = (seq_remote_part){part, POLICY_INT8, req->layer, req->head, pos, 0, 0};
    for (size_t v = 0; v < ly->noffloaded; v++)
        if (ly->offloaded_at[v].block == ref) {
            rp->tier = ly->offloaded_at[v].tier;
            pos[rp->npositions++] = ly->offloaded[v];
        }
    rp->bytes = j->s->pool->block_bytes;
    if (rp->tier == POLICY_SKETCH) { /* tier_sketch_init's cells */
        policy_sketch_geometry g;
        const kv_layout *l = &j->s->tier.l;
        policy_host_sketch_geometry(j->s->host, req->layer, &g);
        rp->bytes = tier_sketch_bytes_for(g.rows, g.buckets, (size_t)l->kv_heads * l->head_dim);
    }
    return 0;
}

/* A staging sketch of the list's geometry for each spilled sketch part. */
static int stage_sketches(seq_revive_job *j)
{
    for (size_t i = 0; i < j->nremote; i++) {
        if (j->remote[i].tier != POLICY_SKETCH)
            continue;
        policy_sketch_geometry g;
        policy_host_sketch_geometry(j->s->host, j->remote[i].layer, &g);
        if (tier_sketch_init(&j->stage_sk[i], &j->s->tier, &g) != 0 ||
            tier_sketch_bytes(&j->stage_sk[i]) != j->remote[i].bytes)
            return -1;
    }
    return 0;
}

/* The spilled parts j's tokens need: a victim block gets a staging block
 * (beyond the `need` scratch blocks), a sketch a staging sketch of the
 * list's geometry; each part's value must carry its positions. The tokens
 * then read from the staging block as from any INT8 block, or from the
 * staging sketch (revive_source). */
static status_code plan_remote(seq_revive_job *j, const seq_revive_request *req, size_t m,
                               uint32_t need, status *st)
{
    seq *s = j->s;
    uint32_t *parts = malloc((m ? m : 1) * sizeof *parts);
    if (parts == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    size_t np = remote_parts(j->src, m, parts), nblocks = 0, nsketches = 0;
    j->remote = calloc(np ? np : 1, sizeof *j->remote);
    j->stage = malloc((np ? np : 1) * sizeof *j->stage);
    j->stage_sk = calloc(np ? np : 1, sizeof *j->stage_sk);
    j->remote_pos = calloc(np ? np : 1, sizeof *j->remote_pos);
    int ok = j->remote != NULL && j->stage != NULL && j->stage_sk != NULL && j->remote_pos != NULL;
    for (size_t i = 0; ok && i < np; i++)
        j->stage[i] = TIER_NO_BLOCK;
    j->nremote = ok ? np : 0;
    for (size_t i = 0; ok && i < np; i++) {
        ok = describe_part(j, i, parts[i], req) == 0;
        nsketches += j->remote[i].tier == POLICY_SKETCH;
    }
    nblocks = np - nsketches;
    status_code rc = ok ? ST_OK : status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (rc == ST_OK && nsketches > REVIVE_MAX_SKETCHES)
        rc = status_set(st, ST_RESOURCE_EXHAUSTED,
                        "positions %u.. of layer %u lie in %zu spilled sketches; a Revive reads "
                        "at most %d at once: ask for fewer positions (first, count)",
                        req->first, req->layer, nsketches, REVIVE_MAX_SKETCHES);
    if (rc == ST_OK && nsketches > 0 && stage_sketches(j) != 0)
        rc = status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory for %zu staging sketches",
                        nsketches);
    if (rc == ST_OK && nblocks > seq_free_blocks(s)) /* the scratch blocks are taken */
        rc = status_set(st, ST_RESOURCE_EXHAUSTED,
                        "reviving %zu tokens needs %u free blocks and %zu more to read "
                        "spilled victims into; pool '%s' has %u",
                        m, need, nblocks, s->pool->model, seq_free_blocks(s));
    for (size_t i = 0; rc == ST_OK && i < np; i++)
        if (j->remote[i].tier != POLICY_SKETCH)
            seq_take_block(s, &j->stage[i]); /* counted above */
    for (size_t t = 0; rc == ST_OK && t < m; t++)
        for (size_t i = 0; tier_token_remote(&j->src[t]) && i < np; i++)
            if ((j->src[t].block & ~SEQ_REMOTE_BLOCK) == parts[i])
                j->src[t].block = j->remote[i].tier == POLICY_SKETCH ? (uint32_t)i : j->stage[i];
    free(parts);
    if (rc != ST_OK)
        job_unstage(j);
    return rc;
}

/* The tokens j copies, first in src / at: those not read in place
 * (here[t]), in order; the rest of the arrays is left as it was. */
static size_t revive_copied(seq_revive_job *j, const uint8_t *here, size_t m)
{
    size_t c = 0;
    for (size_t t = 0; t < m; t++)
        if (here == NULL || !here[t]) {
            j->src[c] = j->src[t];
            j->at[c++] = j->out.positions[t];
        }
    return c;
}

/* The answer's segments, tokens in position order: the list's own slot
 * for a token read in place, the next scratch slot for a copied one (its
 * dst); the scratch blocks come from the pool (counted by the caller).
 * Before revive_copied, which moves src. */
static void revive_place(seq_revive_job *j, const uint8_t *here, size_t m, uint32_t need)
{
    uint32_t slots = j->s->block_slots;
    for (uint32_t b = 0; b < need; b++)
        seq_take_block(j->s, &j->out.blocks[b]);
    size_t c = 0, nsegs = 0;
    for (size_t t = 0; t < m; t++) {
        kv_segment g;
        if (here != NULL && here[t]) {
            g = (kv_segment){j->src[t].block, j->src[t].slot, 1};
        } else {
            j->dst[c] = (tier_token){j->out.blocks[c / slots], (uint32_t)(c % slots), POLICY_FULL};
            g = (kv_segment){j->dst[c].block, j->dst[c].slot, 1};
            c++;
        }
        nsegs = seq_push_run(j->out.segs, nsegs, g);
    }
    j->out.nsegs = nsegs;
}

static seq_revive_job *job_alloc(seq *s, seq_list *ly, size_t m, int in_place)
{
    seq_revive_job *j = calloc(1, sizeof *j);
    if (j == NULL)
        return NULL;
    *j = (seq_revive_job){.s = s, .ly = ly};
    size_t n = m ? m : 1, nb = (m + s->block_slots - 1) / s->block_slots;
    j->src = malloc(n * sizeof *j->src);
    j->dst = malloc(n * sizeof *j->dst);
    j->at = malloc(n * sizeof *j->at);
    j->out.positions = malloc(n * sizeof *j->out.positions);
    j->out.src_tier = malloc(n);
    j->out.blocks = malloc((nb ? nb : 1) * sizeof *j->out.blocks);
    /* Copied tokens fill whole scratch blocks; tokens read in place may
     * each be a segment of their own. */
    j->out.segs = malloc((in_place ? n : nb ? nb : 1) * sizeof *j->out.segs);
    if (!j->src || !j->dst || !j->at || !j->out.positions || !j->out.src_tier || !j->out.blocks ||
        !j->out.segs) {
        job_free(j);
        return NULL;
    }
    return j;
}

status_code seq_revive_plan(seq *s, const seq_revive_request *req, seq_revive_job **out, status *st)
{
    *out = NULL;
    uint32_t n = 0;
    const uint32_t *lpos = NULL;
    size_t m = 0;
    if (revive_check(s, req, &n, &lpos, &m, st) != ST_OK)
        return st->code;
    seq_list *ly = seq_list_at(s, req->layer, req->head);
    seq_revive_job *j = job_alloc(s, ly, m, req->in_place);
    tier_token *tok = list_expand(ly, n);
    uint8_t *here = req->in_place ? malloc(m ? m : 1) : NULL;
    if (j == NULL || tok == NULL || (req->in_place && here == NULL)) {
        free(tok), free(here);
        if (j != NULL)
            job_free(j);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    uint32_t end = req->count == 0 ? (uint32_t)s->appended : req->first + req->count;
    revive_select(ly, lpos, tok, n, req->first, end, j->src, j->out.positions, here);
    free(tok);
    size_t c = m;
    for (size_t t = 0; t < m; t++) {
        j->out.src_tier[t] = j->src[t].tier;
        c -= here != NULL && here[t];
    }
    uint32_t need = (uint32_t)((c + s->block_slots - 1) / s->block_slots);
    if (need > seq_free_blocks(s)) {
        free(here);
        job_free(j);
        return status_set(st, ST_RESOURCE_EXHAUSTED,
                          "reviving %zu tokens needs %u free blocks; pool '%s' has %u", c, need,
                          s->pool->model, seq_free_blocks(s));
    }
    revive_place(j, here, m, need);
    j->ncopy = revive_copied(j, here, m);
    free(here);
    if (plan_remote(j, req, c, need, st) != ST_OK) {
        for (uint32_t b = need; b-- > 0;)
            seq_give_block(s, j->out.blocks[b]);
        job_free(j);
        return st->code;
    }
    j->out.nblocks = need;
    j->out.ntokens = m;
    *out = j;
    return ST_OK;
}

size_t seq_revive_blocks(const seq_revive_job *j)
{
    return j->out.nblocks;
}

size_t seq_revive_remote(const seq_revive_job *j, const seq_remote_part **parts)
{
    *parts = j->remote;
    return j->nremote;
}

int seq_revive_supply(seq_revive_job *j, size_t i, const uint8_t *payload, size_t len)
{
    if (i >= j->nremote || len != j->remote[i].bytes)
        return -1;
    if (j->remote[i].tier == POLICY_SKETCH)
        return tier_sketch_load(&j->stage_sk[i], payload);
    return pool_write_blocks(j->s->pool, &j->stage[i], 1, payload);
}

seq *seq_revive_seq(const seq_revive_job *j)
{
    return j->s;
}

int seq_revive_fill(seq_revive_job *j)
{
    return revive_fill(j->s, j->ly, j->stage_sk, j->src, j->at, j->ncopy, j->dst);
}

status_code seq_revive_finish(seq_revive_job *j, int fill_rc, seq_revived *out, status *st)
{
    memset(out, 0, sizeof *out);
    job_unstage(j);
    if (fill_rc != 0) {
        /* Pushed back in reverse, the blocks lie on the free stack as before
         * the plan took them, unless the pool moved meanwhile. */
        for (size_t b = j->out.nblocks; b-- > 0;)
            seq_give_block(j->s, j->out.blocks[b]);
        job_free(j);
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    }
    *out = j->out;
    j->out = (seq_revived){0};
    job_free(j);
    return ST_OK;
}

status_code seq_revive(seq *s, const seq_revive_request *req, seq_revived *out, status *st)
{
    seq_revive_job *j;
    memset(out, 0, sizeof *out);
    if (seq_revive_plan(s, req, &j, st) != ST_OK)
        return st->code;
    if (j->nremote > 0) {
        seq_revive_finish(j, -1, out, st);
        return status_set(st, ST_FAILED_PRECONDITION,
                          "victims of layer %u are spilled to the remote tier: only the "
                          "store's Revive fetches them",
                          req->layer);
    }
    return seq_revive_finish(j, seq_revive_fill(j), out, st);
}
