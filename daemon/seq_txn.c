/*
 * seq_txn.c - a call's transaction: what a step, an append or an
 * operator's move changes in a sequence is saved just before it changes,
 * so that a failure halfway (an allocation, a kernel) puts back the
 * sequence, its policy host and its pool exactly as they were (seq.h
 * seq_begin). SQLite's rollback journal, on a small scale: saving is the
 * only part that allocates, and it runs before the change it protects;
 * rollback and end cannot fail.
 *
 * What is saved, and when:
 *   - the counters, at begin (no allocation);
 *   - a list (segments, tail, offloaded victims, victim blocks), before its
 *     first change (seq_txn_save_list): a copy of its arrays; when a decode
 *     step only cuts tokens out of its segments (seq_txn_save_cut), the
 *     few segments each cut replaces instead of a copy of all of them
 *     (thousands at long contexts, for every list at every step), the
 *     copy made from them if a later change needs it;
 *   - a list's sketch cells, before each write to them
 *     (seq_txn_save_sketch): on host memory, the cells the write's
 *     positions touch, copied, while they add up to less than half the
 *     sketch (a decode step's victim or revived token touches `rows`
 *     cells); past that, or on a device (where three copy calls a cell
 *     cost more than one of the whole), a copy of the whole sketch, after
 *     which nothing more is saved; "none" when the sketch did not exist;
 *   - token slots written in place in blocks the call did not take (value
 *     merges, key re-rotation, a revived token in the tail block), before
 *     the write (seq_txn_save_tokens): their bytes, staged;
 *   - the pool's free blocks (pool_savepoint; a detached sequence's
 *     reserve, seq_blocks.c) and the host's lists and policy state
 *     (policy_host_begin), by their own modules.
 * Blocks taken during the call need no record: the pool's savepoint (or
 * the reserve's) gives its free stack back as it was.
 */
#include <stdlib.h>
#include <string.h>

#include "seq_internal.h"

/* Cells of a list's sketch as they were before one write. */
typedef struct seq_saved_cells {
    uint32_t *cell;
    size_t n;
    uint8_t *save; /* tier_sketch_cells_save */
} seq_saved_cells;

/* One replacement of a list's segments (seq_txn_save_cut): [first,
 * first + nout) replaced [first, first + nold) of nsegs, which are kept
 * here with their tiers. */
typedef struct seq_saved_cut {
    size_t first, nold, nout, nsegs;
    kv_segment *segs;
    uint8_t *tier;
} seq_saved_cut;

/* A list as it was before the call changed it, its arrays copied; its
 * victims from index vfrom on only (was.offloaded and was.offloaded_at
 * hold [vfrom, was.noffloaded)): those before it stay as they are. Its
 * segments are was.segs when segs_saved, else the list's own with the
 * cuts undone, newest first. */
struct seq_saved_list {
    seq_list *at;
    seq_list was;
    size_t vfrom;
    int segs_saved;
    seq_saved_cut *cuts;
    size_t ncuts, cuts_cap;
    int sketch_saved; /* was.sketch is the sketch as it was: a copy, or none */
    /* Cell saves, oldest first, all older than the whole copy if any. */
    seq_saved_cells *cells;
    size_t ncells, cells_cap, cells_saved; /* cells_saved: cells in all of them */
};

/* Bytes of full-precision token slots as they were, staged: one segment a
 * token, made at save, so that writing them back allocates nothing. */
struct seq_saved_tokens {
    kv_segment *at;
    size_t n;
    uint8_t *stage;
};

static int txn_active(const seq *s)
{
    return s->txn.active;
}

void seq_begin(seq *s)
{
    seq_txn *t = &s->txn;
    t->active = 1;
    t->generation++;
    t->epoch = s->epoch;
    t->appended = s->appended;
    t->unstepped = s->unstepped;
    memcpy(t->moved, s->moved, sizeof t->moved);
    t->requantized = s->requantized;
    t->victims_dropped = s->victims_dropped;
    t->nretired = s->nretired;
    memcpy(t->report_moved, s->report.moved, sizeof t->report_moved);
    t->report_requantized = s->report.requantized;
    t->report_victims_dropped = s->report.victims_dropped;
    t->report_nobs = s->report.nobs;
    s->compacted = 0;
    seq_blocks_begin(s);
    policy_host_begin(s->host);
}

static void list_arrays_free(seq_list *ly)
{
    free(ly->segs);
    free(ly->seg_tier);
    free(ly->offloaded);
    free(ly->offloaded_at);
    free(ly->victim_blocks);
}

/* Copy n elements of elt bytes into a new array (NULL for none). */
static int copy_array(void **dst, const void *src, size_t n, size_t elt)
{
    *dst = NULL;
    if (n == 0)
        return 0;
    if ((*dst = malloc(n * elt)) == NULL)
        return -1;
    memcpy(*dst, src, n * elt);
    return 0;
}

static seq_saved_list *saved_list_of(seq_txn *t, const seq_list *ly);

/* Save victims [from, sv->vfrom) of list ly as well, ahead of the saved
 * ones: they are as they were, since changes only come after vfrom. */
static int save_victims_from(seq_saved_list *sv, const seq_list *ly, size_t from)
{
    seq_list *w = &sv->was;
    size_t ahead = sv->vfrom - from, saved = w->noffloaded - sv->vfrom;
    uint32_t *pos = malloc((ahead + saved) * sizeof *pos);
    tier_token *at = malloc((ahead + saved) * sizeof *at);
    if (pos == NULL || at == NULL) {
        free(pos);
        free(at);
        return -1;
    }
    memcpy(pos, ly->offloaded + from, ahead * sizeof *pos);
    memcpy(at, ly->offloaded_at + from, ahead * sizeof *at);
    if (saved > 0) {
        memcpy(pos + ahead, w->offloaded, saved * sizeof *pos);
        memcpy(at + ahead, w->offloaded_at, saved * sizeof *at);
    }
    free(w->offloaded);
    free(w->offloaded_at);
    w->offloaded = pos;
    w->offloaded_at = at;
    sv->vfrom = from;
    return 0;
}

/* Save list ly, not saved yet in this transaction: its fields, victim
 * blocks and victims from `from`, and its segments when copy_segs (else
 * its cuts will be, seq_txn_save_cut). */
static int saved_list_new(seq *s, seq_list *ly, size_t from, int copy_segs)
{
    seq_txn *t = &s->txn;
    if (seq_grow((void **)&t->lists, &t->lists_cap, t->nlists + 1, sizeof *t->lists) != 0)
        return -1;
    seq_saved_list *sv = &t->lists[t->nlists];
    sv->at = ly;
    sv->was = *ly;
    sv->vfrom = ly->noffloaded;
    sv->segs_saved = copy_segs;
    sv->cuts = NULL;
    sv->ncuts = sv->cuts_cap = 0;
    sv->cells = NULL;
    sv->ncells = sv->cells_cap = sv->cells_saved = 0;
    seq_list *w = &sv->was;
    w->segs = NULL, w->seg_tier = NULL, w->offloaded = NULL, w->offloaded_at = NULL;
    w->victim_blocks = NULL;
    size_t nsegs = copy_segs ? ly->nsegs : 0;
    if (copy_array((void **)&w->segs, ly->segs, nsegs, sizeof *ly->segs) != 0 ||
        copy_array((void **)&w->seg_tier, ly->seg_tier, nsegs, sizeof *ly->seg_tier) != 0 ||
        copy_array((void **)&w->victim_blocks, ly->victim_blocks, ly->nvictim_blocks,
                   sizeof *ly->victim_blocks) != 0 ||
        (from < sv->vfrom && save_victims_from(sv, ly, from) != 0)) {
        list_arrays_free(w);
        return -1;
    }
    w->segs_cap = nsegs;
    w->victim_blocks_cap = ly->nvictim_blocks;
    /* A sketch that does not exist yet is saved as it is: none. */
    sv->sketch_saved = ly->sketch.sk.key == NULL;
    memset(&w->sketch, 0, sizeof w->sketch);
    ly->saved_generation = t->generation;
    t->nlists++;
    return 0;
}

/* Put back, in segs and tier holding *nsegs segments (room for c->nsegs),
 * what cut c replaced. */
static void undo_cut(kv_segment *segs, uint8_t *tier, size_t *nsegs, const seq_saved_cut *c)
{
    size_t after = *nsegs - c->first - c->nout;
    memmove(segs + c->first + c->nold, segs + c->first + c->nout, after * sizeof *segs);
    memmove(tier + c->first + c->nold, tier + c->first + c->nout, after);
    if (c->nold > 0) { /* none: no saved arrays (copy_array) */
        memcpy(segs + c->first, c->segs, c->nold * sizeof *segs);
        memcpy(tier + c->first, c->tier, c->nold);
    }
    *nsegs = c->nsegs;
}

static void cuts_free(seq_saved_list *sv)
{
    for (size_t i = 0; i < sv->ncuts; i++) {
        free(sv->cuts[i].segs);
        free(sv->cuts[i].tier);
    }
    free(sv->cuts);
    sv->cuts = NULL;
    sv->ncuts = sv->cuts_cap = 0;
}

/* The saved list's segments copied after all, for a change other than a
 * cut: the list's own, its cuts undone on the copy. */
static int segs_from_cuts(seq_saved_list *sv, const seq_list *ly)
{
    size_t room = ly->nsegs, n = ly->nsegs;
    for (size_t i = 0; i < sv->ncuts; i++)
        room = sv->cuts[i].nsegs > room ? sv->cuts[i].nsegs : room;
    kv_segment *segs = malloc((room ? room : 1) * sizeof *segs);
    uint8_t *tier = malloc(room ? room : 1);
    if (segs == NULL || tier == NULL) {
        free(segs);
        free(tier);
        return -1;
    }
    if (n > 0) {
        memcpy(segs, ly->segs, n * sizeof *segs);
        memcpy(tier, ly->seg_tier, n);
    }
    for (size_t i = sv->ncuts; i-- > 0;)
        undo_cut(segs, tier, &n, &sv->cuts[i]);
    sv->was.segs = segs;
    sv->was.seg_tier = tier;
    sv->was.segs_cap = room;
    sv->segs_saved = 1;
    cuts_free(sv);
    return 0;
}

int seq_txn_save_list_from(seq *s, seq_list *ly, size_t from)
{
    seq_txn *t = &s->txn;
    if (!txn_active(s))
        return 0;
    if (ly->saved_generation != t->generation)
        return saved_list_new(s, ly, from, 1);
    seq_saved_list *sv = saved_list_of(t, ly);
    if (!sv->segs_saved && segs_from_cuts(sv, ly) != 0)
        return -1;
    return from < sv->vfrom ? save_victims_from(sv, ly, from) : 0;
}

int seq_txn_save_cut(seq *s, seq_list *ly, size_t first, size_t nold, size_t nout)
{
    seq_txn *t = &s->txn;
    if (!txn_active(s))
        return 0;
    if (ly->saved_generation != t->generation && saved_list_new(s, ly, ly->noffloaded, 0) != 0)
        return -1;
    seq_saved_list *sv =
        t->lists[t->nlists - 1].at == ly ? &t->lists[t->nlists - 1] : saved_list_of(t, ly);
    if (sv->segs_saved)
        return 0; /* the copy has them as they were */
    if (seq_grow((void **)&sv->cuts, &sv->cuts_cap, sv->ncuts + 1, sizeof *sv->cuts) != 0)
        return -1;
    seq_saved_cut *c = &sv->cuts[sv->ncuts];
    *c = (seq_saved_cut){first, nold, nout, ly->nsegs, NULL, NULL};
    if (copy_array((void **)&c->segs, ly->segs + first, nold, sizeof *ly->segs) != 0 ||
        copy_array((void **)&c->tier, ly->seg_tier + first, nold, 1) != 0) {
        free(c->segs);
        return -1;
    }
    sv->ncuts++;
    return 0;
}

int seq_txn_save_list(seq *s, seq_list *ly)
{
    return seq_txn_save_list_from(s, ly, 0);
}

static seq_saved_list *saved_list_of(seq_txn *t, const seq_list *ly)
{
    for (size_t i = 0; i < t->nlists; i++)
        if (t->lists[i].at == ly)
            return &t->lists[i];
    return NULL;
}

/* Save the cells that positions pos[0..n) touch in ly's existing sketch. */
static int save_cells(seq_saved_list *sv, const tier_sketch *now, const uint32_t *pos, size_t n)
{
    size_t nc = n * now->sk.rows;
    if (seq_grow((void **)&sv->cells, &sv->cells_cap, sv->ncells + 1, sizeof *sv->cells) != 0)
        return -1;
    seq_saved_cells *e = &sv->cells[sv->ncells];
    e->n = nc;
    e->cell = malloc((nc ? nc : 1) * sizeof *e->cell);
    if (e->cell == NULL || tier_sketch_cells(now, pos, n, e->cell) != 0 ||
        tier_sketch_cells_save(now, e->cell, nc, &e->save) != 0) {
        free(e->cell);
        return -1;
    }
    sv->ncells++;
    sv->cells_saved += nc;
    return 0;
}

int seq_txn_save_sketch(seq *s, seq_list *ly, const uint32_t *pos, size_t n)
{
    if (!txn_active(s))
        return 0;
    /* The list is saved for its sketch: what changes its victims saves
     * them (seq_txn_save_list_from). */
    if (seq_txn_save_list_from(s, ly, ly->noffloaded) != 0)
        return -1;
    seq_saved_list *sv = saved_list_of(&s->txn, ly);
    if (sv->sketch_saved)
        return 0;
    /* Cells one by one where copies are memcpys; on a device three calls
     * a cell would cost more than one copy of the whole. */
    size_t total = (size_t)ly->sketch.sk.rows * ly->sketch.sk.buckets;
    if (ly->sketch.ops->host_memory && 2 * (sv->cells_saved + n * ly->sketch.sk.rows) < total)
        return save_cells(sv, &ly->sketch, pos, n);
    const tier_sketch *now = &ly->sketch;
    tier_sketch *copy = &sv->was.sketch;
    size_t cells = (size_t)now->sk.rows * now->sk.buckets, vec = cells * now->sk.dim;
    const kv_ops *ops = now->ops;
    *copy = *now;
    copy->sk.key = ops->alloc(vec * sizeof(float));
    copy->sk.value = ops->alloc(vec * sizeof(float));
    copy->sk.count = ops->alloc(cells * sizeof(int32_t));
    if (copy->sk.key == NULL || copy->sk.value == NULL || copy->sk.count == NULL ||
        ops->copy(KV_DEVICE_TO_DEVICE, copy->sk.key, now->sk.key, vec * sizeof(float)) != 0 ||
        ops->copy(KV_DEVICE_TO_DEVICE, copy->sk.value, now->sk.value, vec * sizeof(float)) != 0 ||
        ops->copy(KV_DEVICE_TO_DEVICE, copy->sk.count, now->sk.count, cells * sizeof(int32_t)) !=
            0) {
        tier_sketch_free(copy);
        return -1;
    }
    sv->sketch_saved = 1;
    return 0;
}

int seq_txn_save_tokens(seq *s, const tier_token *at, size_t n)
{
    seq_txn *t = &s->txn;
    if (!txn_active(s) || n == 0)
        return 0;
    if (seq_grow((void **)&t->tokens, &t->tokens_cap, t->ntokens + 1, sizeof *t->tokens) != 0)
        return -1;
    seq_saved_tokens *sv = &t->tokens[t->ntokens];
    sv->n = n;
    sv->at = malloc(n * sizeof *sv->at);
    sv->stage = tier_stage_alloc(&s->tier, n);
    size_t half = n * tier_token_bytes(&s->tier) / 2;
    for (size_t i = 0; sv->at != NULL && i < n; i++)
        sv->at[i] = (kv_segment){at[i].block, at[i].slot, 1};
    if (sv->at == NULL || sv->stage == NULL ||
        s->tier.ops->gather(&s->tier.l, s->pool->base, sv->at, n, sv->stage, sv->stage + half) !=
            0) {
        free(sv->at);
        tier_stage_free(&s->tier, sv->stage);
        return -1;
    }
    t->ntokens++;
    return 0;
}

/* Forget what was saved: the lists' copies, the sketches', the tokens'. */
static void txn_clear(seq *s)
{
    seq_txn *t = &s->txn;
    for (size_t i = 0; i < t->nlists; i++) {
        seq_saved_list *sv = &t->lists[i];
        list_arrays_free(&sv->was);
        tier_sketch_free(&sv->was.sketch);
        cuts_free(sv);
        for (size_t j = 0; j < sv->ncells; j++) {
            free(sv->cells[j].cell);
            s->tier.ops->free(sv->cells[j].save);
        }
        free(sv->cells);
    }
    for (size_t i = 0; i < t->ntokens; i++) {
        free(t->tokens[i].at);
        tier_stage_free(&s->tier, t->tokens[i].stage);
    }
    t->nlists = t->ntokens = 0;
    t->active = 0;
}

void seq_end_storage(seq *s)
{
    seq_blocks_end(s);
    txn_clear(s);
}

void seq_end(seq *s)
{
    seq_end_storage(s);
    policy_host_end(s->host);
}

/* List ly as sv saved it. Segments saved whole come back as the saved
 * arrays, else as the list's own with the cuts undone (cuts only grew
 * them: room for every count they had). Victims saved whole come back as
 * the saved arrays; saved from vfrom, the list's own arrays keep those
 * before it, and the saved ones are written back after them: the call
 * changed nothing before vfrom, and only grew the arrays (room for all of
 * them). */
static void list_restore(seq_list *ly, seq_saved_list *sv)
{
    seq_list *w = &sv->was;
    kv_segment *segs = w->segs;
    uint8_t *seg_tier = w->seg_tier;
    size_t segs_cap = w->segs_cap;
    if (sv->segs_saved) {
        free(ly->segs);
        free(ly->seg_tier);
    } else {
        for (size_t i = sv->ncuts; i-- > 0;)
            undo_cut(ly->segs, ly->seg_tier, &ly->nsegs, &sv->cuts[i]);
        segs = ly->segs, seg_tier = ly->seg_tier, segs_cap = ly->segs_cap;
    }
    uint32_t *offloaded = w->offloaded;
    tier_token *offloaded_at = w->offloaded_at;
    size_t offloaded_cap = w->noffloaded; /* the saved arrays' size */
    if (sv->vfrom == 0) {
        free(ly->offloaded);
        free(ly->offloaded_at);
    } else {
        size_t saved = w->noffloaded - sv->vfrom;
        if (saved > 0) {
            memcpy(ly->offloaded + sv->vfrom, w->offloaded, saved * sizeof *ly->offloaded);
            memcpy(ly->offloaded_at + sv->vfrom, w->offloaded_at, saved * sizeof *ly->offloaded_at);
        }
        free(w->offloaded);
        free(w->offloaded_at);
        offloaded = ly->offloaded, offloaded_at = ly->offloaded_at;
        offloaded_cap = ly->offloaded_cap;
    }
    free(ly->victim_blocks);
    *ly = *w;
    ly->segs = segs, ly->seg_tier = seg_tier, ly->segs_cap = segs_cap;
    ly->offloaded = offloaded, ly->offloaded_at = offloaded_at;
    ly->offloaded_cap = offloaded_cap;
}

void seq_rollback_storage(seq *s)
{
    seq_txn *t = &s->txn;
    /* Bytes written in place, newest first: a slot written twice ends as
     * it was before the first write. */
    for (size_t i = t->ntokens; i-- > 0;) {
        seq_saved_tokens *sv = &t->tokens[i];
        size_t half = sv->n * tier_token_bytes(&s->tier) / 2;
        s->tier.ops->scatter(&s->tier.l, s->pool->base, sv->at, sv->n, sv->stage, sv->stage + half);
    }
    for (size_t i = 0; i < t->nlists; i++) {
        seq_saved_list *sv = &t->lists[i];
        seq_list *ly = sv->at;
        tier_sketch sketch = ly->sketch;
        if (sv->sketch_saved) {
            tier_sketch_free(&sketch);
            sketch = sv->was.sketch;
        }
        for (size_t j = sv->ncells; j-- > 0;)
            tier_sketch_cells_restore(&sketch, sv->cells[j].cell, sv->cells[j].n,
                                      sv->cells[j].save);
        list_restore(ly, sv);
        ly->sketch = sketch;
        /* The list owns them now: nothing for txn_clear to free. */
        memset(&sv->was, 0, sizeof sv->was);
    }
    s->epoch = t->epoch;
    s->appended = t->appended;
    s->unstepped = t->unstepped;
    memcpy(s->moved, t->moved, sizeof s->moved);
    s->requantized = t->requantized;
    s->victims_dropped = t->victims_dropped;
    s->nretired = t->nretired;
    memcpy(s->report.moved, t->report_moved, sizeof s->report.moved);
    s->report.requantized = t->report_requantized;
    s->report.victims_dropped = t->report_victims_dropped;
    s->report.nobs = t->report_nobs;
    seq_blocks_rollback(s);
    txn_clear(s);
}

void seq_rollback(seq *s)
{
    seq_rollback_storage(s);
    policy_host_rollback(s->host);
}

void seq_txn_free(seq *s)
{
    txn_clear(s);
    free(s->txn.lists);
    free(s->txn.tokens);
}
