/*
 * table_edit.c - a worker's table kept current without reading it again
 * (kvstash.h kvs_table_extend, kvs_table_cut): an append's writes added at
 * the lists' tails, a step's cuts taken out, the way the daemon changes
 * its own lists (daemon/seq.c list_grow, daemon/seq_apply.c
 * list_cut_in_place). Segments stay maximal, as the daemon keeps them: a
 * run that continues the one before it (same block and tier, the next
 * slot) joins it.
 *
 * A table that kvs_seq_table filled is one allocation in which each list's
 * arrays are exactly their length. A list that has to grow moves its
 * arrays to allocations of its own with room at both ends (struct
 * kvs_table_room); a cut near a list's front moves the entries before it,
 * not the thousands after (StreamingLLM evicts the oldest token after its
 * sinks). Every edit first checks and reserves what it needs, then edits,
 * which cannot fail: an error leaves the table as it was.
 */
#include <stdlib.h>
#include <string.h>

#include "kvstash.h"
#include "table_edit.h"

uint32_t table_no_positions[1];

/* The arrays a list grew into; a NULL base: the table's one allocation. */
typedef struct list_room {
    kvs_segment *seg_base;
    size_t seg_cap;
    uint32_t *pos_base;
    size_t pos_cap;
} list_room;

struct kvs_table_room {
    uint32_t lists;
    /* An append's writes: the moves of a demotion published before it
     * (table_moves_attach), runs in list order. */
    uint64_t moves_from, moves_to;
    kvs_moved_run *moves;
    size_t nmoves;
    list_room list[];
};

/* Cuts of more tokens than this in one list are applied in one pass that
 * rewrites its segments (a prefill chunk's), fewer one at a time. */
#define CUTS_ONE_BY_ONE 8

void table_room_free(kvs_table *t)
{
    if (t->room == NULL)
        return;
    for (uint32_t i = 0; i < t->room->lists; i++) {
        free(t->room->list[i].seg_base);
        free(t->room->list[i].pos_base);
    }
    free(t->room->moves);
    free(t->room);
    t->room = NULL;
}

static int room_get(kvs_table *t)
{
    if (t->room != NULL)
        return 0;
    t->room = calloc(1, sizeof *t->room + (size_t)t->layers * sizeof(list_room));
    if (t->room == NULL)
        return -1;
    t->room->lists = t->layers;
    return 0;
}

static size_t seg_room_after(const kvs_layer *ly, const list_room *r)
{
    return r->seg_base != NULL ? r->seg_cap - (size_t)(ly->segments - r->seg_base) - ly->nsegments
                               : 0;
}

static size_t pos_room_after(const kvs_layer *ly, const list_room *r)
{
    return r->pos_base != NULL ? r->pos_cap - (size_t)(ly->positions - r->pos_base) - ly->tokens
                               : 0;
}

/* Room for `extra` more segments after the list's last; -1 when out of memory. */
static int seg_reserve(kvs_layer *ly, list_room *r, size_t extra)
{
    if (seg_room_after(ly, r) >= extra)
        return 0;
    size_t cap = 2 * (ly->nsegments + extra) + 16;
    kvs_segment *g = malloc(cap * sizeof *g);
    if (g == NULL)
        return -1;
    if (ly->nsegments > 0)
        memcpy(g, ly->segments, ly->nsegments * sizeof *g);
    free(r->seg_base);
    r->seg_base = ly->segments = g;
    r->seg_cap = cap;
    return 0;
}

static int pos_reserve(kvs_layer *ly, list_room *r, size_t extra)
{
    if (ly->positions == NULL || pos_room_after(ly, r) >= extra)
        return 0;
    size_t cap = 2 * ((size_t)ly->tokens + extra) + 16;
    uint32_t *p = malloc(cap * sizeof *p);
    if (p == NULL)
        return -1;
    if (ly->tokens > 0)
        memcpy(p, ly->positions, ly->tokens * sizeof *p);
    free(r->pos_base);
    r->pos_base = ly->positions = p;
    r->pos_cap = cap;
    return 0;
}

/* Whether b continues a (daemon/seq_apply.c runs_push, list_encode). */
static int seg_continues(const kvs_segment *a, const kvs_segment *b)
{
    return a->block == b->block && a->tier == b->tier && a->first_slot + a->count == b->first_slot;
}

/* Remove segment j, moving the shorter side. */
static void seg_close(kvs_layer *ly, size_t j)
{
    kvs_segment *g = ly->segments;
    size_t after = ly->nsegments - j - 1;
    if (j < after) {
        memmove(g + 1, g, j * sizeof *g);
        ly->segments = g + 1;
    } else {
        memmove(g + j, g + j + 1, after * sizeof *g);
    }
    ly->nsegments--;
}

/* An empty entry after segment j (there is room after the last: reserved),
 * moving the entries before it when they are fewer and there is room. */
static void seg_open(kvs_layer *ly, const list_room *r, size_t j)
{
    kvs_segment *g = ly->segments;
    size_t after = ly->nsegments - j - 1;
    if (r->seg_base != NULL && g > r->seg_base && j + 1 < after) {
        memmove(g - 1, g, (j + 1) * sizeof *g);
        ly->segments = g - 1;
    } else {
        memmove(g + j + 2, g + j + 1, after * sizeof *g);
    }
    ly->nsegments++;
}

/* Take token x out of the segments (at most one more segment: reserved). */
static void seg_cut_one(kvs_layer *ly, const list_room *r, uint32_t x)
{
    kvs_segment *g = ly->segments;
    size_t j = 0;
    uint32_t base = 0;
    while (base + g[j].count <= x)
        base += g[j++].count;
    uint32_t t = x - base;
    if (g[j].count == 1) {
        seg_close(ly, j);
        g = ly->segments;
        if (j > 0 && j < ly->nsegments && seg_continues(&g[j - 1], &g[j])) {
            g[j - 1].count += g[j].count;
            seg_close(ly, j);
        }
    } else if (t == 0) {
        g[j].first_slot++;
        g[j].count--;
    } else if (t == g[j].count - 1) {
        g[j].count--;
    } else {
        seg_open(ly, r, j);
        g = ly->segments;
        g[j + 1] =
            (kvs_segment){g[j].block, g[j].first_slot + t + 1, g[j].count - t - 1, g[j].tier};
        g[j].count = t;
    }
}

/* The list's segments without the tokens at idx[0..m), into out (room for
 * nsegments + m); returns their count. */
static size_t seg_cut_all(const kvs_layer *ly, const uint32_t *idx, uint32_t m, kvs_segment *out)
{
    size_t n = 0, k = 0;
    uint32_t base = 0;
    for (size_t j = 0; j < ly->nsegments; j++) {
        kvs_segment g = ly->segments[j];
        for (uint32_t t = 0; t < g.count;) {
            uint32_t stop = k < m && idx[k] < base + g.count ? idx[k] - base : g.count;
            kvs_segment run = {g.block, g.first_slot + t, stop - t, g.tier};
            if (run.count > 0 && n > 0 && seg_continues(&out[n - 1], &run))
                out[n - 1].count += run.count;
            else if (run.count > 0)
                out[n++] = run;
            k += stop < g.count;
            t = stop + (stop < g.count);
        }
        base += g.count;
    }
    return n;
}

/* Take the tokens at idx[0..m) out of the positions, moving what lies
 * before the last cut or after the first, whichever is less. */
static void pos_cut(kvs_layer *ly, const uint32_t *idx, uint32_t m)
{
    uint32_t *p = ly->positions, n = ly->tokens;
    if (idx[m - 1] < n - idx[0]) { /* runs before each cut move up */
        uint32_t w = idx[m - 1] + 1;
        for (uint32_t k = m; k-- > 0;) {
            uint32_t start = k > 0 ? idx[k - 1] + 1 : 0, len = idx[k] - start;
            w -= len;
            memmove(p + w, p + start, len * sizeof *p);
        }
        ly->positions = p + m;
    } else { /* runs after each cut move down */
        uint32_t w = idx[0];
        for (uint32_t k = 0; k < m; k++) {
            uint32_t start = idx[k] + 1, end = k + 1 < m ? idx[k + 1] : n;
            memmove(p + w, p + start, (end - start) * sizeof *p);
            w += end - start;
        }
    }
}

/* Whether list i's cuts are ascending indices of its tokens. */
static int cuts_valid(const kvs_layer *ly, const uint32_t *idx, uint32_t m)
{
    for (uint32_t k = 0; k < m; k++)
        if (idx[k] >= ly->tokens || (k > 0 && idx[k] <= idx[k - 1]))
            return 0;
    return 1;
}

int kvs_table_cut(kvs_table *t, const kvs_step_result *r)
{
    if (t == NULL || r == NULL)
        return KVS_ERR_INVALID;
    if (r->cut_lists == 0 || t->epoch != r->cut_epoch)
        return KVS_ERR_PRECONDITION;
    if (r->cut_lists != t->layers || r->cut_start == NULL || r->cut_start[0] != 0)
        return KVS_ERR_INVALID;
    for (uint32_t i = 0; i < t->layers; i++) {
        uint32_t a = r->cut_start[i], b = r->cut_start[i + 1];
        if (b < a || b - a > t->layer[i].tokens || !cuts_valid(&t->layer[i], r->cut + a, b - a))
            return KVS_ERR_INVALID;
    }
    if (room_get(t) != 0)
        return KVS_ERR_SYSTEM;
    /* Reserve: room for a split a cut (one by one), or the rewritten
     * segments (all at once, swapped in below). */
    kvs_segment **fresh = calloc(t->layers ? t->layers : 1, sizeof *fresh);
    int rc = fresh != NULL ? KVS_OK : KVS_ERR_SYSTEM;
    for (uint32_t i = 0; rc == KVS_OK && i < t->layers; i++) {
        uint32_t m = r->cut_start[i + 1] - r->cut_start[i];
        kvs_layer *ly = &t->layer[i];
        if (m > CUTS_ONE_BY_ONE)
            fresh[i] = malloc((ly->nsegments + m) * sizeof **fresh);
        if (m > 0 &&
            (m > CUTS_ONE_BY_ONE ? fresh[i] == NULL : seg_reserve(ly, &t->room->list[i], m) != 0))
            rc = KVS_ERR_SYSTEM;
    }
    for (uint32_t i = 0; rc == KVS_OK && i < t->layers; i++) {
        const uint32_t *idx = r->cut + r->cut_start[i];
        uint32_t m = r->cut_start[i + 1] - r->cut_start[i];
        kvs_layer *ly = &t->layer[i];
        list_room *lr = &t->room->list[i];
        if (m == 0)
            continue;
        if (fresh[i] != NULL) {
            lr->seg_cap = ly->nsegments + m;
            ly->nsegments = seg_cut_all(ly, idx, m, fresh[i]);
            free(lr->seg_base);
            lr->seg_base = ly->segments = fresh[i];
            fresh[i] = NULL;
        } else {
            for (uint32_t k = m; k-- > 0;) /* the last first: earlier indices stay */
                seg_cut_one(ly, lr, idx[k]);
        }
        if (ly->positions != NULL)
            pos_cut(ly, idx, m);
        ly->tokens -= m;
    }
    for (uint32_t i = 0; fresh != NULL && i < t->layers; i++)
        free(fresh[i]);
    free(fresh);
    if (rc == KVS_OK)
        t->epoch = r->epoch;
    return rc;
}

int table_moves_attach(kvs_table *writes, uint64_t from, uint64_t to, const kvs_moved_run *runs,
                       size_t n)
{
    if (room_get(writes) != 0)
        return -1;
    struct kvs_table_room *r = writes->room;
    if ((r->moves = malloc((n ? n : 1) * sizeof *r->moves)) == NULL)
        return -1;
    memcpy(r->moves, runs, n * sizeof *runs);
    r->nmoves = n;
    r->moves_from = from;
    r->moves_to = to;
    return 0;
}

void kvs_table_moves(const kvs_table *writes, uint64_t *from, uint64_t *to,
                     const kvs_moved_run **runs, size_t *n)
{
    const struct kvs_table_room *r = writes != NULL ? writes->room : NULL;
    *n = r != NULL ? r->nmoves : 0;
    *from = *n > 0 ? r->moves_from : 0;
    *to = *n > 0 ? r->moves_to : 0;
    *runs = *n > 0 ? r->moves : NULL;
}

/* Whether run m fits table t: its list, its tokens, and for a quantised
 * tier the slots of one of its blocks (kvs_layer's *_block_tokens). */
static int run_fits(const kvs_table *t, const kvs_moved_run *m)
{
    if (m->list >= t->layers || m->at.count == 0)
        return 0;
    const kvs_layer *ly = &t->layer[m->list];
    uint32_t slots = m->at.tier == KVS_TIER_INT8   ? ly->int8_block_tokens
                     : m->at.tier == KVS_TIER_INT4 ? ly->int4_block_tokens
                     : m->at.tier == KVS_TIER_INT2 ? ly->int2_block_tokens
                     : m->at.tier == KVS_TIER_FULL ? UINT32_MAX
                                                   : 0;
    return m->first <= ly->tokens && m->at.count <= ly->tokens - m->first &&
           m->at.first_slot <= slots && m->at.count <= slots - m->at.first_slot;
}

/* Join segment i to segment i - 1 when it continues it. */
static int seg_join(kvs_layer *ly, size_t i)
{
    kvs_segment *g = ly->segments;
    if (i == 0 || i >= ly->nsegments || !seg_continues(&g[i - 1], &g[i]))
        return 0;
    g[i - 1].count += g[i].count;
    memmove(g + i, g + i + 1, (ly->nsegments - i - 1) * sizeof *g);
    ly->nsegments--;
    return 1;
}

/* The tokens of run m (run_fits) are stored where it says: the segments
 * they were in are cut around them (two more at most: room reserved), and
 * joined as the daemon joins them. */
static void run_apply(kvs_layer *ly, const kvs_moved_run *m)
{
    kvs_segment *g = ly->segments;
    size_t j = 0, k;
    uint32_t base = 0, end = m->first + m->at.count;
    while (base + g[j].count <= m->first)
        base += g[j++].count;
    uint32_t kbase = base;
    for (k = j; kbase + g[k].count < end;)
        kbase += g[k++].count;
    kvs_segment piece[3];
    size_t np = 0;
    if (m->first > base)
        piece[np++] = (kvs_segment){g[j].block, g[j].first_slot, m->first - base, g[j].tier};
    piece[np++] = m->at;
    if (end < kbase + g[k].count)
        piece[np++] = (kvs_segment){g[k].block, g[k].first_slot + (end - kbase),
                                    kbase + g[k].count - end, g[k].tier};
    memmove(g + j + np, g + k + 1, (ly->nsegments - k - 1) * sizeof *g);
    memcpy(g + j, piece, np * sizeof *g);
    ly->nsegments = ly->nsegments - (k - j + 1) + np;
    for (size_t i = j + np + 1; i-- > (j ? j : 1);)
        seg_join(ly, i);
}

int kvs_table_extend(kvs_table *t, const kvs_table *writes)
{
    if (t == NULL || writes == NULL)
        return KVS_ERR_INVALID;
    /* A demotion published before the append: its moves come first. */
    const struct kvs_table_room *wr = writes->room;
    size_t nmoves = wr != NULL && wr->nmoves > 0 && wr->moves_from == t->epoch ? wr->nmoves : 0;
    uint64_t from = nmoves > 0 ? wr->moves_to : t->epoch;
    if (writes->evicted != 0 || writes->epoch != from + 1)
        return KVS_ERR_PRECONDITION;
    if (writes->layers != t->layers || writes->heads != t->heads)
        return KVS_ERR_INVALID;
    for (size_t i = 0; i < nmoves; i++)
        if (!run_fits(t, &wr->moves[i]) || (i > 0 && wr->moves[i].list < wr->moves[i - 1].list))
            return KVS_ERR_INVALID;
    if (room_get(t) != 0)
        return KVS_ERR_SYSTEM;
    for (uint32_t i = 0, m = 0; i < t->layers; i++) {
        const kvs_layer *w = &writes->layer[i];
        kvs_layer *ly = &t->layer[i];
        size_t runs = 0;
        for (; m < nmoves && wr->moves[m].list == i; m++)
            runs++;
        if (w->tokens > UINT32_MAX - ly->tokens)
            return KVS_ERR_INVALID;
        if (seg_reserve(ly, &t->room->list[i], w->nsegments + 2 * runs) != 0 ||
            pos_reserve(ly, &t->room->list[i], w->tokens) != 0)
            return KVS_ERR_SYSTEM; /* lists only moved: the table is as it was */
    }
    for (size_t i = 0; i < nmoves; i++)
        run_apply(&t->layer[wr->moves[i].list], &wr->moves[i]);
    for (uint32_t i = 0; i < t->layers; i++) {
        const kvs_layer *w = &writes->layer[i];
        kvs_layer *ly = &t->layer[i];
        for (size_t j = 0; j < w->nsegments; j++) {
            kvs_segment *last = ly->nsegments > 0 ? &ly->segments[ly->nsegments - 1] : NULL;
            if (last != NULL && seg_continues(last, &w->segments[j]))
                last->count += w->segments[j].count;
            else
                ly->segments[ly->nsegments++] = w->segments[j];
        }
        for (uint32_t k = 0; ly->positions != NULL && k < w->tokens; k++)
            ly->positions[ly->tokens + k] =
                w->positions != NULL ? w->positions[k] : writes->first_position + k;
        ly->tokens += w->tokens;
    }
    t->epoch = writes->epoch;
    return KVS_OK;
}
