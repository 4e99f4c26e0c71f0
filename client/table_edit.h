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

#endif
