/*
 * ref_tokens.h - the reference kernels' token walk (internal to the
 * *_ref.c files of kernels/cpu): the (block, slot) of the i-th token of a
 * segment list by linear search, obviously right, for the short lists of
 * tests.
 * The fast kernels walk lists with tokens.h's cursor instead.
 */
#ifndef KVSTASH_KERNELS_REF_TOKENS_H
#define KVSTASH_KERNELS_REF_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* Returns 1 with *block and *slot set, or 0 past the end of the list. */
static inline int kv_ref_nth_token(const kv_segment *segs, size_t nsegs, size_t i, uint32_t *block,
                                   uint32_t *slot)
{
    for (size_t s = 0; s < nsegs; s++) {
        if (i < segs[s].count) {
            *block = segs[s].block;
            *slot = segs[s].first_slot + (uint32_t)i;
            return 1;
        }
        i -= segs[s].count;
    }
    return 0;
}

#endif
