/*
 * The step layout (proto/kvstash_step.h): what libkvstash packs
 * (step_pack, kvs_seq_step) is what kvstashd parses (step_parse, seq.c's
 * policy_stats), float for float. Every float carries its own address
 * (layer, array, head, token), so a float that lands anywhere else than
 * where the policy reads it fails the comparison. The offsets are also
 * recomputed here from the layout as the header's comment states it, and
 * a real sequence (seq_step) hands a recording policy every float where
 * the worker put it, over lists of uneven lengths.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "backend.h"
#include "kvstash_step.h"
#include "policy.h"
#include "pool.h"
#include "seq.h"

/* The value a worker reports for token i of row `row` of array k of layer l:
 * exact in float32 for the sizes below. */
static float code(uint32_t l, int k, uint32_t row, uint32_t i)
{
    return (float)(l * 100000u + (uint32_t)k * 10000u + row * 100u + i);
}

typedef struct layout_case {
    const char *name;
    uint32_t layers, q_heads, kv_heads, lists;
    unsigned arrays;
} layout_case;

static const layout_case cases[] = {
    {"1 all-heads list, every array", 3, 8, 2, 1, STEP_ARRAYS},
    {"per-head lists, per-head arrays", 2, 4, 2, 2, STEP_LAST_ATTN | STEP_WINDOW_ATTN | STEP_VNORM},
    {"per-head lists, GQA 4:1", 2, 8, 2, 2, STEP_LAST_ATTN | STEP_VNORM},
    {"one layer, window only", 1, 2, 1, 1, STEP_WINDOW_ATTN},
    {"score and vnorm, MHA", 2, 3, 3, 1, STEP_SCORE | STEP_VNORM},
    {"no arrays", 2, 4, 2, 1, 0},
};

/* Rows of array k, from the layout's definition, not from the module. */
static uint32_t rows_of(const layout_case *c, int k)
{
    return k == 0 ? 1 : k == 3 ? c->kv_heads : c->q_heads;
}

static uint32_t list_of(const layout_case *c, int k, uint32_t row)
{
    if (c->lists == 1 || k == 0)
        return 0;
    return k == 3 ? row : row / (c->q_heads / c->kv_heads);
}

/* One case: uneven list lengths (one list empty), the client's row arrays,
 * pack, the offsets the definition implies, parse, and the policy's view. */
static void run_case(const layout_case *c)
{
    step_shape sh = {c->layers, c->q_heads, c->kv_heads, c->lists, c->arrays};
    size_t nlists = (size_t)c->layers * c->lists;
    uint32_t *tokens = calloc(nlists, sizeof *tokens);
    for (size_t i = 0; i < nlists; i++)
        tokens[i] = i == 1 ? 0 : (uint32_t)(3 + (i * 5) % 7);
    /* The worker's arrays, as kvs_step holds them: [layers * rows] rows. */
    float *rowbuf[STEP_KINDS] = {NULL};
    const float **rowp[STEP_KINDS] = {NULL};
    size_t want = 0;
    for (int k = 0; k < STEP_KINDS; k++) {
        if (!(c->arrays & (1u << k)))
            continue;
        uint32_t rows = rows_of(c, k);
        rowp[k] = calloc((size_t)c->layers * rows, sizeof *rowp[k]);
        rowbuf[k] = calloc((size_t)c->layers * rows * 16, sizeof *rowbuf[k]);
        for (uint32_t l = 0; l < c->layers; l++)
            for (uint32_t r = 0; r < rows; r++) {
                float *row = rowbuf[k] + ((size_t)l * rows + r) * 16;
                uint32_t n = tokens[(size_t)l * c->lists + list_of(c, k, r)];
                for (uint32_t i = 0; i < n; i++)
                    row[i] = code(l, k, r, i);
                rowp[k][(size_t)l * rows + r] = row;
                want += n;
            }
    }
    const float *const *const src[STEP_KINDS] = {rowp[0], rowp[1], rowp[2], rowp[3]};

    /* Client side: libkvstash's packing (kvs_seq_step calls step_pack). */
    assert_int_equal(step_floats(&sh, tokens), want);
    float *data = calloc(want + 1, sizeof *data);
    assert_int_equal(step_pack(&sh, tokens, src, data, want), want);
    if (want > 0)
        assert_int_equal(step_pack(&sh, tokens, src, data, want - 1), (size_t)-1);

    /* The wire: layer by layer, score, last_attn, window_attn, vnorm. */
    size_t off = 0;
    for (uint32_t l = 0; l < c->layers; l++)
        for (int k = 0; k < STEP_KINDS; k++) {
            if (!(c->arrays & (1u << k)))
                continue;
            for (uint32_t r = 0; r < rows_of(c, k); r++) {
                uint32_t n = tokens[(size_t)l * c->lists + list_of(c, k, r)];
                for (uint32_t i = 0; i < n; i++)
                    assert_true(data[off + i] == code(l, k, r, i));
                off += n;
            }
        }
    assert_int_equal(off, want);

    /* Daemon side: seq.c's parse, then what each policy reads per layer. */
    const float **rows = calloc((size_t)c->layers * step_layer_slots(&sh), sizeof *rows);
    if (want > 0)
        assert_int_equal(step_parse(&sh, tokens, data, want - 1, rows), -1);
    assert_int_equal(step_parse(&sh, tokens, data, want + 1, rows), -1);
    assert_int_equal(step_parse(&sh, tokens, data, want, rows), 0);
    for (uint32_t l = 0; l < c->layers; l++) {
        policy_stats ps = {0};
        if (c->arrays & STEP_SCORE)
            ps.score = rows[step_slot(&sh, l, STEP_SCORE, 0)];
        if (c->arrays & STEP_LAST_ATTN)
            ps.last_attn = &rows[step_slot(&sh, l, STEP_LAST_ATTN, 0)];
        if (c->arrays & STEP_WINDOW_ATTN)
            ps.window_attn = &rows[step_slot(&sh, l, STEP_WINDOW_ATTN, 0)];
        if (c->arrays & STEP_VNORM)
            ps.vnorm = &rows[step_slot(&sh, l, STEP_VNORM, 0)];
        const float *const *by_kind[3] = {ps.last_attn, ps.window_attn, ps.vnorm};
        for (uint32_t i = 0; ps.score != NULL && i < tokens[(size_t)l * c->lists]; i++)
            assert_true(ps.score[i] == code(l, 0, 0, i));
        for (int k = 1; k < STEP_KINDS; k++) {
            const float *const *view = by_kind[k - 1];
            assert_true((view != NULL) == ((c->arrays & (1u << k)) != 0));
            for (uint32_t r = 0; view != NULL && r < rows_of(c, k); r++) {
                uint32_t list = list_of(c, k, r);
                assert_int_equal(step_row_list(&sh, 1u << k, r), list);
                for (uint32_t i = 0; i < tokens[(size_t)l * c->lists + list]; i++)
                    assert_true(view[r][i] == code(l, k, r, i));
            }
        }
    }
    free(rows);
    free(data);
    for (int k = 0; k < STEP_KINDS; k++) {
        free(rowbuf[k]);
        free(rowp[k]);
    }
    free(tokens);
}

static void test_pack_parse(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        print_message("case %zu: %s\n", i, cases[i].name);
        run_case(&cases[i]);
    }
}

/* The cursor's rows in order, for one small per-head shape written out. */
static void test_cursor_order(void **state)
{
    (void)state;
    step_shape sh = {2, 4, 2, 2, STEP_LAST_ATTN | STEP_VNORM};
    const uint32_t tokens[4] = {5, 7, 2, 0};
    struct {
        uint32_t layer;
        unsigned kind;
        uint32_t row, list;
        size_t offset;
        uint32_t count;
    } want[] = {
        {0, STEP_LAST_ATTN, 0, 0, 0, 5},  {0, STEP_LAST_ATTN, 1, 0, 5, 5},
        {0, STEP_LAST_ATTN, 2, 1, 10, 7}, {0, STEP_LAST_ATTN, 3, 1, 17, 7},
        {0, STEP_VNORM, 0, 0, 24, 5},     {0, STEP_VNORM, 1, 1, 29, 7},
        {1, STEP_LAST_ATTN, 0, 0, 36, 2}, {1, STEP_LAST_ATTN, 1, 0, 38, 2},
        {1, STEP_LAST_ATTN, 2, 1, 40, 0}, {1, STEP_LAST_ATTN, 3, 1, 40, 0},
        {1, STEP_VNORM, 0, 0, 40, 2},     {1, STEP_VNORM, 1, 1, 42, 0},
    };
    step_cursor c;
    step_cursor_init(&c, &sh, tokens);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        assert_int_equal(step_cursor_next(&c), 1);
        assert_int_equal(c.layer, want[i].layer);
        assert_int_equal(c.kind, want[i].kind);
        assert_int_equal(c.row, want[i].row);
        assert_int_equal(c.list, want[i].list);
        assert_int_equal(c.offset, want[i].offset);
        assert_int_equal(c.count, want[i].count);
    }
    assert_int_equal(step_cursor_next(&c), 0);
    assert_int_equal(step_cursor_next(&c), 0);
    assert_int_equal(step_floats(&sh, tokens), 42);
}

/* ---- through seq_step: what a policy reads ------------------------------ */

/* What the recording policy saw; one sequence at a time. */
static struct {
    unsigned arrays;
    uint32_t q_heads, kv_heads;
    size_t checked, wrong; /* floats compared, floats not where expected */
} seen;

/* Values are coded by original position: a stale or shifted row shows. */
static float code_at(uint32_t l, int k, uint32_t row, uint32_t pos)
{
    return code(l, k, row, pos);
}

static int rec_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                      size_t errlen)
{
    (void)p, (void)g, (void)err, (void)errlen;
    *state = NULL;
    return 0;
}

static void rec_destroy(void *state)
{
    (void)state;
}

/* Compare every row the step carries with what the worker packed, then
 * evict positions p with p % (list + layer + 2) == 0 on the first step, so
 * that the next step's lists differ in length by layer and by head. */
static int rec_step(void *state, const policy_layer_view *v, const policy_stats *ps,
                    policy_decision *d, char *err, size_t errlen)
{
    (void)state, (void)err, (void)errlen;
    layout_case c = {"", 0, seen.q_heads, seen.kv_heads, v->heads, seen.arrays};
    const float *const *by_kind[STEP_KINDS] = {&ps->score, ps->last_attn, ps->window_attn,
                                               ps->vnorm};
    for (int k = 0; k < STEP_KINDS; k++) {
        if (!(seen.arrays & (1u << k)))
            continue;
        for (uint32_t r = 0; by_kind[k] != NULL && r < rows_of(&c, k); r++) {
            uint32_t list = list_of(&c, k, r);
            for (uint32_t i = 0; i < v->tokens[list]; i++) {
                seen.checked++;
                seen.wrong += by_kind[k][r][i] != code_at(v->layer, k, r, v->positions[list][i]);
            }
        }
        seen.wrong += by_kind[k] == NULL; /* an array the step carries is missing */
    }
    for (uint32_t h = 0; v->step == 1 && h < v->heads; h++)
        for (uint32_t i = 0; i < v->tokens[h]; i++)
            if (v->positions[h][i] % (h + v->layer + 2) == 0)
                d->tier[h][i] = POLICY_EVICT;
    return 0;
}

/* The worker's side of one step: rows from the sequence's lists as its
 * table shows them, packed by libkvstash's code; then seq_step. */
static void step_through_seq(seq *q, const step_shape *sh)
{
    size_t nlists = (size_t)sh->layers * sh->lists;
    uint32_t *tokens = calloc(nlists, sizeof *tokens);
    const uint32_t **pos = calloc(nlists, sizeof *pos);
    for (size_t i = 0; i < nlists; i++)
        tokens[i] =
            seq_list_tokens(q, (uint32_t)(i / sh->lists), (uint32_t)(i % sh->lists), &pos[i]);
    layout_case c = {"", sh->layers, sh->q_heads, sh->kv_heads, sh->lists, sh->arrays};
    float *rowbuf[STEP_KINDS] = {NULL};
    const float **rowp[STEP_KINDS] = {NULL};
    for (int k = 0; k < STEP_KINDS; k++) {
        if (!(sh->arrays & (1u << k)))
            continue;
        uint32_t rows = rows_of(&c, k);
        rowp[k] = calloc((size_t)sh->layers * rows, sizeof *rowp[k]);
        rowbuf[k] = calloc((size_t)sh->layers * rows * 64, sizeof *rowbuf[k]);
        for (uint32_t l = 0; l < sh->layers; l++)
            for (uint32_t r = 0; r < rows; r++) {
                size_t li = (size_t)l * sh->lists + list_of(&c, k, r);
                float *row = rowbuf[k] + ((size_t)l * rows + r) * 64;
                assert_true(tokens[li] <= 64);
                for (uint32_t i = 0; i < tokens[li]; i++)
                    row[i] = code_at(l, k, r, pos[li][i]);
                rowp[k][(size_t)l * rows + r] = row;
            }
    }
    const float *const *const src[STEP_KINDS] = {rowp[0], rowp[1], rowp[2], rowp[3]};
    size_t n = step_floats(sh, tokens);
    float *data = calloc(n + 1, sizeof *data);
    assert_int_equal(step_pack(sh, tokens, src, data, n), n);
    seq_step_input in = {.arrays = sh->arrays,
                         .score_queries = 1,
                         .window_queries = 1,
                         .confidence = -1.0,
                         .data = data,
                         .nfloats = n};
    uint32_t evicted;
    status st;
    if (seq_step(q, &in, &evicted, &st) != ST_OK)
        fail_msg("seq_step: %s", st.msg);
    free(data);
    for (int k = 0; k < STEP_KINDS; k++) {
        free(rowbuf[k]);
        free(rowp[k]);
    }
    free(pos);
    free(tokens);
}

static void append_through_seq(seq *q, size_t nlists, int64_t count)
{
    kv_segment **w = calloc(nlists, sizeof *w);
    size_t *nw = calloc(nlists, sizeof *nw);
    for (size_t i = 0; i < nlists; i++)
        w[i] = calloc((size_t)count, sizeof **w);
    uint32_t evicted;
    status st;
    if (seq_append(q, count, w, nw, &evicted, &st) != ST_OK)
        fail_msg("seq_append: %s", st.msg);
    for (size_t i = 0; i < nlists; i++)
        free(w[i]);
    free(w);
    free(nw);
}

static void run_seq_case(int per_head, unsigned arrays)
{
    const policy_ops ops = {.name = "record",
                            .summary = "checks where each float lands",
                            .needs = arrays,
                            .per_head = per_head,
                            .create = rec_create,
                            .step = rec_step,
                            .destroy = rec_destroy};
    pool_geometry g = {2, 8, 2, 8, 4, POOL_FP32, 10000.0f};
    pool *p;
    status st;
    if (pool_create(1, "m", &g, 1 << 20, &backend_host, &p, &st) != ST_OK)
        fail_msg("pool_create: %s", st.msg);
    policy_params params;
    char err[POLICY_ERR_LEN];
    assert_int_equal(policy_params_resolve(&ops, NULL, NULL, 0, &params, err, sizeof err), 0);
    seq *q;
    if (seq_create(1, 1, p, &ops, &params, "", &q, &st) != ST_OK)
        fail_msg("seq_create: %s", st.msg);
    seen.arrays = arrays;
    seen.q_heads = g.q_heads;
    seen.kv_heads = g.kv_heads;
    seen.checked = seen.wrong = 0;
    step_shape sh = {g.layers, g.q_heads, g.kv_heads, per_head ? g.kv_heads : 1, arrays};
    size_t nlists = (size_t)sh.layers * sh.lists;
    append_through_seq(q, nlists, 12);
    step_through_seq(q, &sh); /* equal lists; the policy evicts unevenly */
    append_through_seq(q, nlists, 5);
    step_through_seq(q, &sh); /* uneven lists */
    uint32_t a = seq_list_tokens(q, 0, 0, NULL), b = seq_list_tokens(q, 1, sh.lists - 1, NULL);
    assert_true(a != b);
    assert_true(seen.checked > 0);
    assert_int_equal(seen.wrong, 0);
    seq_destroy(q);
    pool_destroy(p);
}

static void test_seq_step_reads_what_was_packed(void **state)
{
    (void)state;
    run_seq_case(0, STEP_ARRAYS);
    run_seq_case(0, STEP_WINDOW_ATTN);
    run_seq_case(1, STEP_LAST_ATTN | STEP_WINDOW_ATTN | STEP_VNORM);
    run_seq_case(1, STEP_VNORM);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_parse),
        cmocka_unit_test(test_cursor_order),
        cmocka_unit_test(test_seq_step_reads_what_was_packed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
