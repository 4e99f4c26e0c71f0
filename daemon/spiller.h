/*
 * spiller.h - spilling on its own (kvstashd --remote-spill-below; docs/remote.md
 * "Spill and revive"): a thread that, while a pool has fewer than a given
 * percent of its blocks free, spills the revivable victims of its
 * sequences to the remote tier (store.h store_spill_pressured), so that
 * memory pressure moves them there before the pool runs out and has to
 * drop them. It decides only when; the store does the spill.
 */
#ifndef KVSTASH_SPILLER_H
#define KVSTASH_SPILLER_H

#include <stdint.h>

#include "store.h"

#define SPILLER_INTERVAL_MS 50 /* between looks at the pools */

typedef struct spiller spiller;

/* Start the thread over st (which must outlive spiller_stop); NULL when it
 * cannot start (logged). below_pct: 1..100. */
spiller *spiller_start(store *st, uint32_t below_pct);

/* Stop and join the thread, free sp (NULL allowed). */
void spiller_stop(spiller *sp);

#endif
