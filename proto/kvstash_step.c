/* kvstash_step.c - see kvstash_step.h. */
#include "kvstash_step.h"

#include <string.h>

unsigned step_kind_bit(int k)
{
    return 1u << k;
}

uint32_t step_kind_rows(const step_shape *sh, unsigned kind)
{
    return kind == STEP_SCORE ? 1 : kind == STEP_VNORM ? sh->kv_heads : sh->q_heads;
}

uint32_t step_row_list(const step_shape *sh, unsigned kind, uint32_t row)
{
    if (sh->lists <= 1 || kind == STEP_SCORE)
        return 0;
    /* Query head h reads KV head h / group (POLICIES.md notation). */
    return kind == STEP_VNORM ? row : row / (sh->q_heads / sh->kv_heads);
}

size_t step_layer_slots(const step_shape *sh)
{
    return 1 + 2 * (size_t)sh->q_heads + sh->kv_heads;
}

size_t step_slot(const step_shape *sh, uint32_t layer, unsigned kind, uint32_t row)
{
    size_t base = (size_t)layer * step_layer_slots(sh);
    switch (kind) {
    case STEP_SCORE:
        return base;
    case STEP_LAST_ATTN:
        return base + 1 + row;
    case STEP_WINDOW_ATTN:
        return base + 1 + sh->q_heads + row;
    default:
        return base + 1 + 2 * (size_t)sh->q_heads + row;
    }
}

void step_cursor_init(step_cursor *c, const step_shape *sh, const uint32_t *tokens)
{
    memset(c, 0, sizeof *c);
    c->sh_ = sh;
    c->tokens_ = tokens;
}

/* The first present kind at or after k, or STEP_KINDS. */
static int present_from(const step_shape *sh, int k)
{
    while (k < STEP_KINDS && !(sh->arrays & step_kind_bit(k)))
        k++;
    return k;
}

/* Describe row c->row of kind c->k_ in c->layer. */
static void describe(step_cursor *c)
{
    c->kind = step_kind_bit(c->k_);
    c->list = step_row_list(c->sh_, c->kind, c->row);
    c->count = c->tokens_[(size_t)c->layer * (c->sh_->lists ? c->sh_->lists : 1) + c->list];
}

int step_cursor_next(step_cursor *c)
{
    const step_shape *sh = c->sh_;
    if (!c->started_) {
        c->started_ = 1;
        c->k_ = present_from(sh, 0);
        if (c->k_ == STEP_KINDS || sh->layers == 0)
            return 0;
        describe(c);
        return 1;
    }
    if (c->layer >= sh->layers)
        return 0;
    c->offset += c->count;
    if (++c->row >= step_kind_rows(sh, c->kind)) {
        c->row = 0;
        c->k_ = present_from(sh, c->k_ + 1);
        if (c->k_ == STEP_KINDS) {
            c->k_ = present_from(sh, 0);
            if (++c->layer >= sh->layers) {
                c->count = 0;
                return 0;
            }
        }
    }
    describe(c);
    return 1;
}

size_t step_floats(const step_shape *sh, const uint32_t *tokens)
{
    step_cursor c;
    size_t n = 0;
    step_cursor_init(&c, sh, tokens);
    while (step_cursor_next(&c))
        n += c.count;
    return n;
}

size_t step_pack(const step_shape *sh, const uint32_t *tokens, const float *const *const src[4],
                 float *out, size_t room)
{
    step_cursor c;
    step_cursor_init(&c, sh, tokens);
    size_t used = 0;
    while (step_cursor_next(&c)) {
        if (c.count > room - used)
            return (size_t)-1;
        const float *row = src[c.k_][(size_t)c.layer * step_kind_rows(sh, c.kind) + c.row];
        /* A row the worker wrote in place (kvs_step_in_ring) stays; one
         * elsewhere in the ring may overlap its place. */
        if (c.count > 0 && row != out + c.offset)
            memmove(out + c.offset, row, (size_t)c.count * sizeof *out);
        used += c.count;
    }
    return used;
}

int step_parse(const step_shape *sh, const uint32_t *tokens, const float *data, size_t nfloats,
               const float **rows)
{
    if (step_floats(sh, tokens) != nfloats)
        return -1;
    memset(rows, 0, (size_t)sh->layers * step_layer_slots(sh) * sizeof *rows);
    step_cursor c;
    step_cursor_init(&c, sh, tokens);
    while (step_cursor_next(&c) && data != NULL) /* no data: no rows (nfloats is 0) */
        rows[step_slot(sh, c.layer, c.kind, c.row)] = data + c.offset;
    return 0;
}
