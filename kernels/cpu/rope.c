/*
 * rope.c - fast CPU RoPE re-rotation (kernels.h "RoPE re-rotation").
 *
 * The coefficients depend only on the delta, which is usually shared by a
 * whole block of tokens and takes few values (OpenVINO rotates per block by
 * a multiple of the block size, §2.8): each thread keeps the rows of its last
 * RCACHE deltas, computed with the same double-precision formula as
 * rope_ref.c, and the rotation itself is the same fp32 arithmetic applied
 * across a row, so the result equals the reference exactly. Rows are
 * converted in chunks of KV_CHUNK channels; the coefficient table covers
 * RCHUNK pairs (every head_dim up to 2 * RCHUNK in one piece). Each row
 * rotated prefetches the matching row of the next run of the list (its
 * blocks are scattered). Splits over tokens (parallel.h).
 */
#include <assert.h>
#include <math.h>
#include <stdlib.h>

#include "../elt.h"
#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "tokens.h"

#define RCHUNK 512u /* pairs per coefficient table */

typedef struct rope_job {
    const kv_layout *l;
    kv_dtype t;
    uint8_t *pool;
    const kv_segment *segs;
    size_t nsegs;
    const int32_t *delta;
    double theta;
    kv_rope_pairing pairing;
} rope_job;

/* cos/sin of pairs [p0, p0 + np) for a delta, as rope_ref.c. */
static void coefficients(const rope_job *j, int32_t delta, uint32_t p0, uint32_t np, float *c,
                         float *s)
{
    double d = (double)j->l->head_dim;
    for (uint32_t p = 0; p < np; p++) {
        double inv_freq = pow(j->theta, -(double)(2 * (p0 + p)) / d);
        double angle = (double)delta * inv_freq;
        c[p] = (float)cos(angle);
        s[p] = (float)sin(angle);
    }
}

/* Rotate-half: x in [p0, p0+np), y in [half+p0, ...), in KV_CHUNK/2 pieces. */
static void rotate_half(const rope_job *j, uint8_t *row, uint32_t p0, uint32_t np, const float *c,
                        const float *s)
{
    size_t e = j->l->elt_size, half = j->l->head_dim / 2;
    float x[KV_CHUNK / 2], y[KV_CHUNK / 2], xo[KV_CHUNK / 2], yo[KV_CHUNK / 2];
    for (uint32_t q = 0; q < np; q += KV_CHUNK / 2) {
        uint32_t w = np - q < KV_CHUNK / 2 ? np - q : KV_CHUNK / 2;
        uint8_t *px = row + (p0 + q) * e, *py = row + (half + p0 + q) * e;
        kv_row_load(px, j->t, w, x);
        kv_row_load(py, j->t, w, y);
        for (uint32_t k = 0; k < w; k++) {
            xo[k] = x[k] * c[q + k] - y[k] * s[q + k];
            yo[k] = x[k] * s[q + k] + y[k] * c[q + k];
        }
        kv_row_store(px, j->t, w, xo);
        kv_row_store(py, j->t, w, yo);
    }
}

/* Interleaved: pairs (2p, 2p+1) for p in [p0, p0+np). */
static void rotate_interleaved(const rope_job *j, uint8_t *row, uint32_t p0, uint32_t np,
                               const float *c, const float *s)
{
    size_t e = j->l->elt_size;
    float v[KV_CHUNK], o[KV_CHUNK];
    for (uint32_t q = 0; q < np; q += KV_CHUNK / 2) {
        uint32_t w = np - q < KV_CHUNK / 2 ? np - q : KV_CHUNK / 2;
        uint8_t *p = row + 2 * (p0 + q) * e;
        kv_row_load(p, j->t, 2 * w, v);
        for (uint32_t k = 0; k < w; k++) {
            float x = v[2 * k], y = v[2 * k + 1];
            o[2 * k] = x * c[q + k] - y * s[q + k];
            o[2 * k + 1] = x * s[q + k] + y * c[q + k];
        }
        kv_row_store(p, j->t, 2 * w, o);
    }
}

/* Coefficient rows kept per thread: OpenVINO-style rotations use a handful
 * of deltas (one per shift), and recomputing a row costs d sin/cos pairs. */
#define RCACHE 8u

typedef struct coef_cache {
    float c[RCACHE][RCHUNK], s[RCACHE][RCHUNK];
    int32_t delta[RCACHE];
    uint32_t p0[RCACHE];
    uint32_t used, next;
} coef_cache;

/* The row for (delta, pairs from p0), computed on a miss. */
static uint32_t cache_row(const rope_job *j, coef_cache *cc, int32_t delta, uint32_t p0,
                          uint32_t np)
{
    for (uint32_t k = 0; k < cc->used; k++)
        if (cc->delta[k] == delta && cc->p0[k] == p0)
            return k;
    uint32_t k = cc->next;
    cc->next = (cc->next + 1) % RCACHE;
    if (cc->used < RCACHE)
        cc->used++;
    coefficients(j, delta, p0, np, cc->c[k], cc->s[k]);
    cc->delta[k] = delta;
    cc->p0[k] = p0;
    return k;
}

/* Tokens [lo, hi) of the list, a run of consecutive slots at a time and
 * head by head within it, so that each head's rows are read in address
 * order (a run's rows of one head are contiguous in the block). */
static void rope_tokens(void *ctx, size_t lo, size_t hi)
{
    const rope_job *j = ctx;
    const kv_layout *l = j->l;
    uint32_t npairs = l->head_dim / 2;
    size_t row = (size_t)l->head_dim * l->elt_size;
    coef_cache *cc = malloc(sizeof *cc);
    float one_c[RCHUNK], one_s[RCHUNK]; /* out of memory: no cache */
    kv_cursor cur;
    uint32_t blk, slot, run;
    if (cc != NULL)
        cc->used = cc->next = 0;
    kv_cursor_init(&cur, j->segs, j->nsegs, lo);
    for (size_t n = lo; n < hi && (run = kv_cursor_run(&cur, &blk, &slot)) != 0; n += run) {
        if (run > hi - n)
            run = (uint32_t)(hi - n);
        kv_cursor_skip(&cur, run);
        /* the next run's rows, prefetched a row for each row rotated: a
         * list's blocks are scattered, which the hardware prefetchers do not
         * follow */
        kv_cursor ahead = cur;
        uint32_t nblk, nslot, nrun = n + run < hi ? kv_cursor_run(&ahead, &nblk, &nslot) : 0;
        if (nrun > hi - n - run)
            nrun = (uint32_t)(hi - n - run);
        for (uint32_t h = 0; h < l->kv_heads; h++) {
            uint8_t *row0 = j->pool + kv_key_offset(l, blk, h, slot);
            const uint8_t *next0 = nrun > 0 ? j->pool + kv_key_offset(l, nblk, h, nslot) : NULL;
            for (uint32_t k = 0; k < run; k++) {
                for (size_t b = 0; k < nrun && b < row; b += 64)
                    __builtin_prefetch(next0 + k * row + b, 1);
                for (uint32_t p0 = 0; p0 < npairs; p0 += RCHUNK) {
                    uint32_t np = npairs - p0 < RCHUNK ? npairs - p0 : RCHUNK;
                    const float *c = one_c, *s = one_s;
                    if (cc != NULL) {
                        uint32_t e = cache_row(j, cc, j->delta[n + k], p0, np);
                        c = cc->c[e];
                        s = cc->s[e];
                    } else {
                        coefficients(j, j->delta[n + k], p0, np, one_c, one_s);
                    }
                    if (j->pairing == KV_ROPE_HALF)
                        rotate_half(j, row0 + k * row, p0, np, c, s);
                    else
                        rotate_interleaved(j, row0 + k * row, p0, np, c, s);
                }
            }
        }
    }
    free(cc);
}

void KV_FAST(kv_rope_rerotate)(const kv_layout *l, kv_dtype t, uint8_t *pool,
                               const kv_segment *segs, size_t nsegs, const int32_t *delta,
                               double theta, kv_rope_pairing pairing)
{
    assert(l->head_dim % 2 == 0);
    rope_job j = {l, t, pool, segs, nsegs, delta, theta, pairing};
    size_t n = kv_segments_tokens(segs, nsegs);
    size_t bytes = 2 * n * (size_t)l->kv_heads * l->head_dim * l->elt_size;
    kv_parallel_for(n, bytes, rope_tokens, &j);
}
