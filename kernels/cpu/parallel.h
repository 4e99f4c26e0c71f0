/*
 * parallel.h - the fast CPU kernels' thread helper (kernels.h "Threads").
 * Internal to kernels/cpu.
 */
#ifndef KVSTASH_KERNELS_PARALLEL_H
#define KVSTASH_KERNELS_PARALLEL_H

#include <stddef.h>

#include "kernels.h"

/* fn(ctx, lo, hi) computes items [lo, hi) of a job of n items. */
typedef void (*kv_range_fn)(void *ctx, size_t lo, size_t hi);

/*
 * Run fn over [0, n) split into contiguous chunks, which the calling thread
 * and the helpers it starts take in turn as each comes free. `bytes` is the
 * job's memory traffic, which bounds the thread count (kernels.h: at least
 * KV_PARALLEL_GRAIN bytes per thread). fn must compute each item the same
 * way whatever chunk it is in, which makes the result independent of the
 * thread count. When a thread cannot be started the others take its
 * chunks: never a partial result.
 */
void kv_parallel_for(size_t n, size_t bytes, kv_range_fn fn, void *ctx);

#endif
