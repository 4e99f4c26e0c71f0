/*
 * table_edit.h - what kvstash.c needs of table_edit.c (kvs_table_extend and
 * kvs_table_cut are in kvstash.h).
 */
#ifndef KVSTASH_TABLE_EDIT_H
#define KVSTASH_TABLE_EDIT_H

#include <stdint.h>

#include "kvstash.h"

/* The positions of an empty list of a table read with positions: not
 * NULL, so that kvs_table_extend knows to add the new tokens'. */
extern uint32_t table_no_positions[1];

/* Free the arrays lists grew into (kvs_table_free). */
void table_room_free(kvs_table *t);

/* Give an append's writes the moves of a demotion published before it
 * (runs[0..n), which take a table of epoch `from` to epoch `to`), for
 * kvs_table_extend to apply first. -1 when out of memory (the writes then
 * carry none, and a table they would have moved is read again). */
int table_moves_attach(kvs_table *writes, uint64_t from, uint64_t to, const kvs_moved_run *runs,
                       size_t n);

#endif
