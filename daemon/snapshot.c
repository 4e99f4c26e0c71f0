/* snapshot.c - see snapshot.h. */
#include "snapshot.h"

#include <stdlib.h>
#include <string.h>

void snapshot_free(snapshot *s)
{
    free(s->pools);
    free(s->sessions);
    free(s->seqs);
    memset(s, 0, sizeof *s);
}

void snapshot_tiers_observe(snapshot_tiers *t, int kind, double value)
{
    if (t->nobs == t->obs_cap) {
        size_t cap = t->obs_cap ? 2 * t->obs_cap : 16;
        snapshot_obs *grown = realloc(t->obs, cap * sizeof *grown);
        if (grown == NULL)
            return;
        t->obs = grown;
        t->obs_cap = cap;
    }
    t->obs[t->nobs++] = (snapshot_obs){kind, value};
}

void snapshot_tiers_clear(snapshot_tiers *t)
{
    memset(t->moved, 0, sizeof t->moved);
    t->requantized = 0;
    t->victims_dropped = 0;
    t->nobs = 0;
}

void snapshot_tiers_free(snapshot_tiers *t)
{
    free(t->obs);
    memset(t, 0, sizeof *t);
}
