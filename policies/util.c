#include "util.h"

#include "policy.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void policy_set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

POLICY_HOT size_t policy_first_outside(const float *a, size_t n, float lo)
{
    /* NaN fails both comparisons; -0.0 >= 0 holds, as isfinite && !(x < 0)
     * says. */
    int ok = 1;
    for (size_t i = 0; i < n; i++)
        ok &= (a[i] >= lo) & (a[i] <= FLT_MAX);
    if (ok)
        return n;
    size_t i = 0;
    while (i < n && a[i] >= lo && a[i] <= FLT_MAX)
        i++;
    return i;
}

POLICY_HOT size_t policy_copy_first_outside(float *restrict dst, const float *restrict src,
                                            size_t n, float lo)
{
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        float x = src[i]; /* read once: what is stored is what is checked */
        dst[i] = x;
        ok &= (x >= lo) & (x <= FLT_MAX);
    }
    /* Nothing after this may read src in place of dst, believing them
     * equal (a policy_ops.stats_in_place step reads what it checked). */
    __asm__ volatile("" ::: "memory");
    return ok ? n : policy_first_outside(dst, n, lo);
}

int policy_stats_refused(char *err, size_t errlen, const char *policy, uint32_t layer, size_t at)
{
    snprintf(err, errlen, "%s: layer %" PRIu32 "'s stats.score[%zu] is not finite", policy, layer,
             at);
    errno = EBADMSG;
    return -1;
}

POLICY_HOT size_t policy_first_nonfinite(const double *x, size_t n)
{
    /* An exponent of all ones is an infinity or a NaN; the bits, not a
     * comparison, so that the loop has no early exit and vectorises. */
    uint64_t bad = 0, bits;
    for (size_t i = 0; i < n; i++) {
        memcpy(&bits, &x[i], sizeof bits);
        bad |= (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
    if (bad == 0)
        return n;
    size_t i = 0;
    while (isfinite(x[i]))
        i++;
    return i;
}

POLICY_HOT int policy_has_nan(const double *x, size_t n)
{
    int nan = 0;
    for (size_t i = 0; i < n; i++)
        nan |= x[i] != x[i];
    return nan;
}

/* Outputs summed at a time: their sums (4 KiB) stay in L1. */
#define MEAN_BLOCK 512

POLICY_HOT void policy_mean_rows(const float *const *rows, uint32_t nrows, size_t n, double *out)
{
    for (size_t b = 0; b < n; b += MEAN_BLOCK) {
        size_t m = n - b < MEAN_BLOCK ? n - b : MEAN_BLOCK;
        size_t ahead = n - b - m < MEAN_BLOCK ? n - b - m : MEAN_BLOCK;
        double *restrict acc = out + b;
        for (size_t i = 0; i < m; i++)
            acc[i] = 0.0;
        for (uint32_t r = 0; r < nrows; r++) {
            const float *restrict row = rows[r] + b;
            for (size_t i = 0; i < ahead; i += 16) /* this row's next block */
                __builtin_prefetch(row + m + i);
            for (size_t i = 0; i < m; i++)
                acc[i] += (double)row[i];
        }
        for (size_t i = 0; i < m; i++)
            acc[i] /= (double)nrows;
    }
}

POLICY_HOT void policy_evict_marked(uint8_t *restrict tier, const uint8_t *restrict mark,
                                    int evict_if, size_t n)
{
    uint8_t want = evict_if != 0;
    for (size_t i = 0; i < n; i++)
        tier[i] = (uint8_t)((mark[i] != 0) == want ? POLICY_EVICT : tier[i]);
}

POLICY_HOT int policy_tiers_count(const uint8_t *tier, size_t n, uint32_t counts[POLICY_TIERS])
{
    /* One counter a value, so that the loop is six compares and adds a
     * vector of tiers. */
    uint32_t c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0;
    uint8_t other = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t t = tier[i];
        c0 += t == 0;
        c1 += t == 1;
        c2 += t == 2;
        c3 += t == 3;
        c4 += t == 4;
        c5 += t == 5;
        other |= t >= POLICY_TIERS;
    }
    counts[0] += c0, counts[1] += c1, counts[2] += c2;
    counts[3] += c3, counts[4] += c4, counts[5] += c5;
    return other != 0;
}

POLICY_HOT int policy_tiers_keep_or_evict(const uint8_t *tier, size_t n, uint8_t keep,
                                          uint32_t *nevict)
{
    uint8_t other = 0;
    uint32_t evict = 0;
    for (size_t i = 0; i < n; i++) {
        other |= tier[i] != keep && tier[i] != POLICY_EVICT;
        evict += tier[i] == POLICY_EVICT;
    }
    *nevict = evict;
    return !other;
}

void *policy_array_copy(const void *src, size_t used, size_t room, size_t size)
{
    size_t bytes = room * size;
    void *a = malloc(bytes ? bytes : 1);
    if (a != NULL && used > 0)
        memcpy(a, src, used * size);
    return a;
}

uint8_t *policy_put_le(uint8_t *p, uint64_t v, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
    return p + n;
}

uint64_t policy_get_le(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = n; i-- > 0;)
        v = v << 8 | p[i];
    return v;
}

uint64_t policy_f64_bits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

double policy_bits_f64(uint64_t u)
{
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

uint32_t policy_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

float policy_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
