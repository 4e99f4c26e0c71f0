/*
 * test_table_edit.c - table_edit.c alone, without a daemon: what
 * kvs_table_extend does with a demotion's moves (table_moves_attach, as an
 * append's answer carries them), and kvs_table_cut's cuts one by one.
 * test_libkvstash follows a real daemon's tables with the same functions.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include <stdlib.h>

#include "kvstash.h"
#include "table_edit.h"

enum { A = 7, B = 8, C = 9, D = 10, W = 13 }; /* blocks */

/* A one-list table as kvs_seq_table fills one (a single allocation), its
 * positions 100, 101, ...; epoch 5, INT8 blocks of 12 slots. */
static kvs_table one_list(const kvs_segment *g, size_t n)
{
    uint32_t tokens = 0;
    for (size_t i = 0; i < n; i++)
        tokens += g[i].count;
    char *mem = calloc(1, sizeof(kvs_layer) + n * sizeof *g + tokens * sizeof(uint32_t) + 1);
    assert_non_null(mem);
    kvs_layer *ly = (kvs_layer *)mem;
    *ly = (kvs_layer){.tokens = tokens, .nsegments = n, .int8_block_tokens = 12};
    ly->segments = (kvs_segment *)(mem + sizeof *ly);
    ly->positions = (uint32_t *)(ly->segments + n);
    memcpy(ly->segments, g, n * sizeof *g);
    for (uint32_t i = 0; i < tokens; i++)
        ly->positions[i] = 100 + i;
    return (kvs_table){5, 0, 0, 1, 1, ly, NULL};
}

/* kvs_table_free's part that is table_edit.c's, and the one allocation. */
static void table_free(kvs_table *t)
{
    table_room_free(t);
    free(t->layer);
}

/* The list of A 0..9 and B 0..9, and the writes of one token at epoch 7
 * carrying the moves runs[0..n) of a demotion from epoch `from` to 6. */
static void held_and_writes(kvs_table *t, kvs_table *w, uint64_t from, const kvs_moved_run *runs,
                            size_t n)
{
    const kvs_segment held[] = {{A, 0, 10, KVS_TIER_FULL}, {B, 0, 10, KVS_TIER_FULL}};
    const kvs_segment wseg = {W, 0, 1, KVS_TIER_FULL};
    *t = one_list(held, 2);
    *w = one_list(&wseg, 1);
    w->epoch = 7;
    w->layer[0].positions[0] = 120;
    assert_int_equal(table_moves_attach(w, from, 6, runs, n), 0);
}

/* Runs cut the segments they fall in (a segment's middle, its front, its
 * end, across two), join the run they continue, leave the positions; the
 * writes then extend the table to the append's epoch. */
static void test_moves_then_writes(void **state)
{
    (void)state;
    const kvs_moved_run runs[] = {
        {0, 2, {C, 0, 3, KVS_TIER_INT8}},  /* tokens 2..4: the middle of A */
        {0, 5, {C, 3, 2, KVS_TIER_INT8}},  /* 5..6: continues the run before */
        {0, 8, {C, 5, 5, KVS_TIER_INT8}},  /* 8..12: A's end and B's front */
        {0, 17, {D, 0, 3, KVS_TIER_INT8}}, /* 17..19: B's end */
    };
    const kvs_segment want[] = {{A, 0, 2, KVS_TIER_FULL}, {C, 0, 5, KVS_TIER_INT8},
                                {A, 7, 1, KVS_TIER_FULL}, {C, 5, 5, KVS_TIER_INT8},
                                {B, 3, 4, KVS_TIER_FULL}, {D, 0, 3, KVS_TIER_INT8},
                                {W, 0, 1, KVS_TIER_FULL}};
    kvs_table t, w;
    held_and_writes(&t, &w, 5, runs, 4);
    uint64_t from, to;
    const kvs_moved_run *got;
    size_t n;
    kvs_table_moves(&w, &from, &to, &got, &n);
    assert_int_equal(from, 5);
    assert_int_equal(to, 6);
    assert_int_equal(n, 4);
    assert_memory_equal(got, runs, sizeof runs);
    assert_int_equal(kvs_table_extend(&t, &w), KVS_OK);
    const kvs_layer *ly = &t.layer[0];
    assert_int_equal(t.epoch, 7);
    assert_int_equal(ly->tokens, 21);
    assert_int_equal(ly->nsegments, sizeof want / sizeof *want);
    for (size_t i = 0; i < ly->nsegments; i++)
        if (memcmp(&ly->segments[i], &want[i], sizeof want[i]) != 0)
            fail_msg("segment %zu: block %u slot %u count %u tier %u", i, ly->segments[i].block,
                     ly->segments[i].first_slot, ly->segments[i].count, ly->segments[i].tier);
    for (uint32_t i = 0; i < 21; i++)
        assert_int_equal(ly->positions[i], 100 + i);
    table_free(&w);
    table_free(&t);
}

/* Moves of another epoch than the table's: the writes do not follow it
 * (KVS_ERR_PRECONDITION: read the table); a run past the list or past its
 * INT8 block, or runs out of list order: KVS_ERR_INVALID. The table stays
 * as it was. */
static void test_moves_refused(void **state)
{
    (void)state;
    const kvs_moved_run fine[] = {{0, 2, {C, 0, 3, KVS_TIER_INT8}}};
    const kvs_moved_run past_list[] = {{0, 18, {C, 0, 3, KVS_TIER_INT8}}};
    const kvs_moved_run past_block[] = {{0, 0, {C, 10, 3, KVS_TIER_INT8}}};
    const kvs_moved_run sketch[] = {{0, 0, {C, 0, 3, KVS_TIER_SKETCH}}};
    const kvs_moved_run other_list[] = {{1, 0, {C, 0, 3, KVS_TIER_INT8}}};
    const struct {
        uint64_t from;
        const kvs_moved_run *runs;
        int rc;
    } cases[] = {{4, fine, KVS_ERR_PRECONDITION},
                 {5, past_list, KVS_ERR_INVALID},
                 {5, past_block, KVS_ERR_INVALID},
                 {5, sketch, KVS_ERR_INVALID},
                 {5, other_list, KVS_ERR_INVALID}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        kvs_table t, w;
        held_and_writes(&t, &w, cases[c].from, cases[c].runs, 1);
        assert_int_equal(kvs_table_extend(&t, &w), cases[c].rc);
        assert_int_equal(t.epoch, 5);
        assert_int_equal(t.layer[0].nsegments, 2);
        assert_int_equal(t.layer[0].tokens, 20);
        assert_int_equal(t.layer[0].segments[0].count, 10);
        table_free(&w);
        table_free(&t);
    }
}

/* A list's tokens as (block, slot) pairs, in order. */
static uint32_t expand_slots(const kvs_layer *ly, uint64_t *out)
{
    uint32_t n = 0;
    for (size_t j = 0; j < ly->nsegments; j++)
        for (uint32_t c = 0; c < ly->segments[j].count; c++)
            out[n++] = (uint64_t)ly->segments[j].block << 32 | (ly->segments[j].first_slot + c);
    return n;
}

/*
 * kvs_table_cut of a few tokens of a list at a time (up to
 * CUTS_ONE_BY_ONE: taken out one by one, the last first): a list of 64
 * segments, cut anywhere, more often in its second half, must hold the
 * tokens and positions of a reference that removes the same indices.
 */
static void test_cuts_one_by_one(void **state)
{
    (void)state;
    enum { SEGS = 64, PER = 5, N = SEGS * PER };
    kvs_segment g[SEGS];
    for (uint32_t j = 0; j < SEGS; j++)
        g[j] = (kvs_segment){100 + j, 3, PER, KVS_TIER_FULL};
    kvs_table t = one_list(g, SEGS);
    static uint64_t want[N], got[N];
    static uint32_t want_pos[N];
    uint32_t n = expand_slots(&t.layer[0], want);
    memcpy(want_pos, t.layer[0].positions, n * sizeof *want_pos);
    uint64_t rng = 7;
    for (int round = 0; round < 30; round++) {
        uint32_t m = 2 + (uint32_t)(round % 7), idx[8], start[2] = {0, m};
        for (uint32_t k = 0; k < m; k++) { /* ascending, distinct */
            rng = rng * 6364136223846793005u + 1442695040888963407u;
            uint32_t lo = k == 0 ? 0 : idx[k - 1] + 1, span = n - (m - k) - lo + 1;
            uint32_t step = (uint32_t)(rng >> 33) % span;
            idx[k] = lo + (k == 0 && (rng & 3) != 0 ? step / 2 + span / 2 : step) % span;
        }
        kvs_step_result r = {.epoch = t.epoch + 1,
                             .cut_epoch = t.epoch,
                             .cut_lists = 1,
                             .cut_start = start,
                             .cut = idx};
        assert_int_equal(kvs_table_cut(&t, &r), KVS_OK);
        for (uint32_t k = m; k-- > 0;) {
            memmove(want + idx[k], want + idx[k] + 1, (n - idx[k] - 1) * sizeof *want);
            memmove(want_pos + idx[k], want_pos + idx[k] + 1, (n - idx[k] - 1) * sizeof *want_pos);
            n--;
        }
        assert_int_equal(t.layer[0].tokens, n);
        assert_int_equal(expand_slots(&t.layer[0], got), n);
        assert_memory_equal(got, want, n * sizeof *got);
        assert_memory_equal(t.layer[0].positions, want_pos, n * sizeof *want_pos);
    }
    table_free(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moves_then_writes),
        cmocka_unit_test(test_moves_refused),
        cmocka_unit_test(test_cuts_one_by_one),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
