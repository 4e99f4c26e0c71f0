/*
 * test_table_edit.c - table_edit.c alone, without a daemon: what
 * kvs_table_extend does with a demotion's moves (table_moves_attach, as an
 * append's answer carries them). test_libkvstash follows a real daemon's
 * tables with the same functions.
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moves_then_writes),
        cmocka_unit_test(test_moves_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
