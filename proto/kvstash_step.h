/*
 * kvstash_step.h - the layout of a step's statistics in the ring's data area
 * (RING_OP_STEP, kvstash_ring.h), defined once. libkvstash packs with it,
 * kvstashd parses with it (seq.c: what each policy reads) and measures with
 * it (metrics.c: the attention an eviction dropped), and the llama worker
 * asks it which list a head reads.
 *
 * Layer by layer (l = 0..layers-1), in this order, each array as float32:
 *   score      [n_l]                      if arrays & STEP_SCORE (one token list)
 *   last_attn  [q_heads][n_(l, list(h))]  if arrays & STEP_LAST_ATTN
 *   window_attn[q_heads][n_(l, list(h))]  if arrays & STEP_WINDOW_ATTN
 *   vnorm      [kv_heads][n_(l, list(g))] if arrays & STEP_VNORM (‖V·W^O‖₁; the
 *                                         worker computes it: it holds W^O)
 * where n is the number of tokens the layer's list (or KV head list) holds
 * in the table of the request's ack_epoch, i.e. after the step's appends;
 * list(h) is the layer's one list, or KV head h / (q_heads / kv_heads)'s list
 * for a per-head sequence (list(g) = g). A row is one (layer, array, head).
 *
 * The STEP_* bits are policy.h's POLICY_NEEDS_* bits (the daemon checks it at
 * compile time); this header stands alone so that a worker needs no policy.
 */
#ifndef KVSTASH_STEP_H
#define KVSTASH_STEP_H

#include <stddef.h>
#include <stdint.h>

#define STEP_SCORE (1u << 0)       /* Σ over query heads (and score_queries queries) */
#define STEP_LAST_ATTN (1u << 1)   /* the step's last query, per query head */
#define STEP_WINDOW_ATTN (1u << 2) /* the mean over the observation window, per query head */
#define STEP_VNORM (1u << 3)       /* per KV head */
#define STEP_ARRAYS 0xfu           /* every array bit */
#define STEP_KINDS 4               /* arrays per layer, in layout order */

/* What a step's data holds: the geometry, the lists, the arrays present. */
typedef struct step_shape {
    uint32_t layers;
    uint32_t q_heads, kv_heads; /* kv_heads divides q_heads */
    uint32_t lists;             /* lists per layer: 1, or kv_heads (a per-head sequence) */
    unsigned arrays;            /* STEP_* bits */
} step_shape;

/* The array bit of kind k (0 score, 1 last_attn, 2 window_attn, 3 vnorm). */
unsigned step_kind_bit(int k);

/* Rows of array `kind` (a STEP_* bit) in one layer: 1, q_heads or kv_heads. */
uint32_t step_kind_rows(const step_shape *sh, unsigned kind);

/* Which of a layer's lists row `row` of array `kind` reads. */
uint32_t step_row_list(const step_shape *sh, unsigned kind, uint32_t row);

/* Row slots of one layer in a step_parse table, present or not:
 * 1 + 2 * q_heads + kv_heads. */
size_t step_layer_slots(const step_shape *sh);

/* The slot of (layer, kind, row) in a step_parse table. */
size_t step_slot(const step_shape *sh, uint32_t layer, unsigned kind, uint32_t row);

/*
 * A walk over the rows present, in layout order. After step_cursor_init,
 * each step_cursor_next that returns 1 describes one row in the public
 * fields; it returns 0 after the last. `tokens` ([layers * lists], list i of
 * layer l at l * lists + i) must outlive the cursor.
 */
typedef struct step_cursor {
    /* public, read-only */
    uint32_t layer;
    unsigned kind;  /* one STEP_* bit */
    uint32_t row;   /* query head (last_attn, window_attn), KV head (vnorm), 0 (score) */
    uint32_t list;  /* of the layer's lists, the one the row reads */
    size_t offset;  /* floats before the row */
    uint32_t count; /* floats of the row: the tokens of its list */
    /* private */
    const step_shape *sh_;
    const uint32_t *tokens_;
    int k_, started_;
} step_cursor;

void step_cursor_init(step_cursor *c, const step_shape *sh, const uint32_t *tokens);
int step_cursor_next(step_cursor *c);

/* Floats the whole step holds. */
size_t step_floats(const step_shape *sh, const uint32_t *tokens);

/*
 * Pack: src[k] (k as step_kind_bit) is NULL when array k is absent, else
 * [layers * rows] row pointers (row r of layer l at l * rows + r), each
 * holding the tokens of its list. sh->arrays must say which are present.
 * Writes at most `room` floats to out; returns the floats written, or
 * (size_t)-1 when they do not fit (out then holds a partial copy). A row
 * already at its place in out is left as it is.
 */
size_t step_pack(const step_shape *sh, const uint32_t *tokens, const float *const *const src[4],
                 float *out, size_t room);

/*
 * Parse: point rows[step_slot(sh, l, kind, r)] at each row in data
 * (nfloats floats); the slots of absent arrays become NULL. `rows` has
 * room for layers * step_layer_slots(sh). Returns 0, or -1 when nfloats is
 * not exactly step_floats (nothing written then). A policy then reads
 * layer l's last_attn as &rows[step_slot(sh, l, STEP_LAST_ATTN, 0)].
 */
int step_parse(const step_shape *sh, const uint32_t *tokens, const float *data, size_t nfloats,
               const float **rows);

#endif
