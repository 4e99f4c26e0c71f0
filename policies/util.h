/*
 * util.h - small helpers every policy file needs, shared (not part of
 * policy.h's interface). The daemon uses the passes it makes over a
 * step's statistics and decisions (policy_first_outside,
 * policy_tiers_keep_or_evict, policy_tiers_count), so that they are
 * vectorised as these are.
 */
#ifndef KVSTASH_POLICIES_UTIL_H
#define KVSTASH_POLICIES_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"

/*
 * Hot loops over a decision's lists (pooling, keys, compactions, sums) are
 * compiled three times on x86-64, for x86-64-v4 (AVX-512: twice the lanes
 * of a pool or a sum, 15-18% off a SnapKV-family decision on Zen 5,
 * docs/bench.md), x86-64-v3 (AVX2 and FMA) and the baseline, and the
 * loader picks one for the CPU (GCC's target_clones, an ifunc). All do the
 * same IEEE operations in the same order (ISO C: no contraction into FMA;
 * an fma() the code asks for is the instruction in two and glibc's exact
 * fma in the baseline), so they give the same bits, as kernels/cpu/isa.h's
 * builds do.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&                             \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
/* GCC only: clang 14 emits no symbol under the plain name for an extern
 * target_clones function (callers in other files fail to link), and the
 * sanitizer builds check the code, not its speed (an ifunc resolver also
 * runs before their runtimes start). */
#define POLICY_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define POLICY_HOT
#endif

/* printf into err[errlen] (no-op when err is NULL or errlen is 0). */
void policy_set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/*
 * The index of the first of a[0..n) that is not a finite number >= lo
 * (NaN, an infinity, or below lo; lo = -FLT_MAX asks for finite only), or n
 * when every entry is. Checking a worker's statistics is a pass over
 * megabytes at long contexts: the all-good case is one branch-free
 * (vectorised) read, the index is looked for only when something is bad.
 */
size_t policy_first_outside(const float *a, size_t n, float lo);

/* The same for what is copied: dst[0..n) = src[0..n), and the index of
 * the first value copied that is not a finite number >= lo, or n. One
 * pass for a daemon that copies a worker's statistics out of shared memory
 * and checks the copy (the worker may change src meanwhile; what is
 * checked is what was written). dst and src do not overlap. */
size_t policy_copy_first_outside(float *dst, const float *src, size_t n, float lo);

/* A step that refuses its statistics (a value not finite, at index `at`
 * of the layer's stats.score): the message in err, errno EBADMSG (the
 * worker's input was bad, not the policy: policy_ops.stats_in_place);
 * returns -1. */
int policy_stats_refused(char *err, size_t errlen, const char *policy, uint32_t layer, size_t at);

/* The index of the first of x[0..n) that is not finite (NaN, an
 * infinity), or n: a vectorised pass, the index looked for only when
 * something is bad (as policy_first_outside for floats). */
size_t policy_first_nonfinite(const double *x, size_t n);

/* Whether x[0..n) holds a NaN, in one vectorised pass (before a selection
 * that assumes none, select.h policy_first_min). */
int policy_has_nan(const double *x, size_t n);

/*
 * out[i] = the mean of rows[0..nrows)[i] for i < n, summed in row order in
 * double and divided by nrows: a token's mean over a group of query heads.
 * Vectorised over blocks of outputs that stay in L1 while every row passes
 * over them; each row prefetches its next block, because 32 streams are
 * more than the hardware prefetcher follows. A non-finite input gives a
 * non-finite mean.
 */
void policy_mean_rows(const float *const *rows, uint32_t nrows, size_t n, double *out);

/* Say that list k's decision changes no tier outside [lo, hi) (policy.h
 * policy_decision.span; nothing where the caller gave no spans). */
static inline void policy_decision_span(policy_decision *d, uint32_t k, uint32_t lo, uint32_t hi)
{
    if (d->span != NULL)
        d->span[k] = (policy_span){lo, hi};
}

/* Evict token i of list k, the one change of its decision (a decode step
 * of a policy with a budget). */
static inline void policy_evict_one(policy_decision *d, uint32_t k, uint32_t i)
{
    d->tier[k][i] = POLICY_EVICT;
    policy_decision_span(d, k, i, i + 1);
}

/* The span of list k's decision: the whole of its n tokens without spans. */
static inline policy_span policy_decision_span_of(const policy_decision *d, uint32_t k, uint32_t n)
{
    return d->span != NULL ? d->span[k] : (policy_span){0, n};
}

/*
 * Whether a decision's n tiers only keep in tier `keep` or evict (every
 * one `keep` or POLICY_EVICT), and *nevict, how many evict: one vectorised
 * pass, for the daemon's common step (seq_apply.c), which asks it of every
 * list at every step (keep POLICY_FULL), and of each run of a stored tier
 * of a list with quantised segments before counting its tiers.
 */
int policy_tiers_keep_or_evict(const uint8_t *tier, size_t n, uint8_t keep, uint32_t *nevict);

/*
 * How many of the n tiers are each policy_tier, added to counts[]; 1 when
 * some value is not a policy_tier (counted nowhere), else 0. One
 * vectorised pass, for the daemon's step over a list with quantised
 * segments (seq_apply.c), which asks it of each run of a stored tier.
 */
int policy_tiers_count(const uint8_t *tier, size_t n, uint32_t counts[POLICY_TIERS]);

/*
 * tier[i] = POLICY_EVICT where (mark[i] != 0) == evict_if, else unchanged:
 * a selection's marks applied to a decision in one vectorised pass (with a
 * branch, random marks mispredict; through the decision's pointer, every
 * store reloads it).
 */
void policy_evict_marked(uint8_t *tier, const uint8_t *mark, int evict_if, size_t n);

/*
 * For ops->save: a malloc'd array with room for `room` elements of `size`
 * bytes whose first `used` (<= room) are copied from src (src may be NULL
 * when used is 0). At least one byte is allocated, so NULL always means out
 * of memory. The caller frees.
 */
void *policy_array_copy(const void *src, size_t used, size_t room, size_t size);

/*
 * A policy's exported layer state (policy_ops.export_layer) is its own
 * little-endian bytes: policy_put_le writes v's low n (1..8) bytes at p and
 * returns p + n; policy_get_le reads them back. Floats and doubles travel
 * as their exact bits, so that a moved sequence decides bit for bit as the
 * original would have.
 */
uint8_t *policy_put_le(uint8_t *p, uint64_t v, unsigned n);
uint64_t policy_get_le(const uint8_t *p, unsigned n);
uint64_t policy_f64_bits(double d);
double policy_bits_f64(uint64_t u);
uint32_t policy_f32_bits(float f);
float policy_bits_f32(uint32_t u);

#endif
