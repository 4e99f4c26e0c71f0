/*
 * ov_block.c - policy "ov_block": OpenVINO GenAI KV-cache token eviction
 * (POLICIES.md §2; [OV] cache_eviction.cpp, kvcrush.cpp, [OVK] rotation).
 *
 * A sequence keeps a start area (start_size tokens, never evicted), an
 * evictable area and a recent area (recent_size tokens). Every step the
 * worker reports, per layer, the attention each held token received (§2.2,
 * stats->score); they are forward max-pooled and accumulated per tracked
 * token (SUM, or NORM_SUM with per-token counters), with OpenVINO's SnapKV
 * window rules for the prompt (§2.3). After each decode step (prefill == 0)
 * each layer drops whole blocks of the evictable area, lowest score first,
 * ties to the lower block (§2.5), optionally sparing KVCrush's diverse
 * blocks (§2.6). With apply_rotation the decision asks the daemon to
 * re-rotate the shifted keys (§2.8).
 *
 * Everything the §2.10 vectors test is a function of ov_block.h; step() and
 * the replay state operations are built from those functions.
 */
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "describe.h"
#include "ov_block.h"
#include "select.h"
#include "util.h"

#define OV_MAX_TOKENS (1u << 30) /* bound on start/recent/max: 64-bit sums never wrap */
#define OV_MAX_WINDOW 1048576u

/* ---- mt19937 ------------------------------------------------------------- */

void ov_mt19937_seed(ov_mt19937 *r, uint32_t seed)
{
    r->mt[0] = seed;
    for (uint32_t i = 1; i < 624; i++)
        r->mt[i] = 1812433253u * (r->mt[i - 1] ^ (r->mt[i - 1] >> 30)) + i;
    r->idx = 624;
}

static void mt_twist(ov_mt19937 *r)
{
    for (uint32_t i = 0; i < 624; i++) {
        uint32_t y = (r->mt[i] & 0x80000000u) | (r->mt[(i + 1) % 624] & 0x7fffffffu);
        r->mt[i] = r->mt[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
    }
    r->idx = 0;
}

uint32_t ov_mt19937_next(ov_mt19937 *r)
{
    if (r->idx >= 624)
        mt_twist(r);
    uint32_t y = r->mt[r->idx++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

/* ---- score accumulation (§2.3) ------------------------------------------ */

/* Windows up to OV_MAXPOOL_SPANS tokens are pooled a block of
 * OV_MAXPOOL_BLOCK outputs at a time (4 KiB: every pass over a block reads
 * it from L1), by doubling spans: after pass p each value is the max of
 * 2^p inputs, and one last pass joins two overlapping spans into the
 * window, log2(w) + 1 passes in all (3 for the default 7, not 6); longer
 * windows by the deque. */
#define OV_MAXPOOL_SPANS 64
#define OV_MAXPOOL_BLOCK 512

/*
 * The pooling's passes over a block, for doubles (_d) and for a step's
 * floats (_f): a float widens to a double exactly and in order, so floats
 * pooled and then widened are the widened floats pooled, at twice the
 * values a vector. span_double: b[i] = the larger of a[i] and a[i + s]
 * (the earlier when equal), or a[i] where a ends first: the max over twice
 * a's span. span_join: y[i] = the larger of a[i] and a[i + d] (the earlier
 * when equal) for i < len, or a[i] where a (avail values) ends first.
 * pool_block: the pooled len values of a block whose inputs start at x,
 * in a or b.
 */
#define OV_POOL_PASSES(sfx, T)                                                                     \
    POLICY_HOT static void span_double_##sfx(T *restrict b, const T *restrict a, size_t n,         \
                                             size_t s)                                             \
    {                                                                                              \
        size_t i = 0;                                                                              \
        for (; i + s < n; i++)                                                                     \
            b[i] = a[i + s] > a[i] ? a[i + s] : a[i];                                              \
        for (; i < n; i++)                                                                         \
            b[i] = a[i];                                                                           \
    }                                                                                              \
    POLICY_HOT static void span_join_##sfx(T *restrict y, const T *restrict a, size_t len,         \
                                           size_t avail, size_t d)                                 \
    {                                                                                              \
        size_t i = 0, both = avail > d ? avail - d : 0;                                            \
        for (; i < len && i < both; i++)                                                           \
            y[i] = a[i + d] > a[i] ? a[i + d] : a[i];                                              \
        for (; i < len; i++)                                                                       \
            y[i] = a[i];                                                                           \
    }                                                                                              \
    static const T *pool_block_##sfx(const T *x, T *a, T *b, size_t len, size_t avail, size_t w)   \
    {                                                                                              \
        const T *cur = x;                                                                          \
        T *next = a;                                                                               \
        size_t s = 1;                                                                              \
        for (; 2 * s <= w; s *= 2) {                                                               \
            span_double_##sfx(next, cur, avail, s);                                                \
            cur = next;                                                                            \
            next = next == a ? b : a;                                                              \
        }                                                                                          \
        span_join_##sfx(next, cur, len, avail, w - s);                                             \
        return next;                                                                               \
    }

OV_POOL_PASSES(d, double)
OV_POOL_PASSES(f, float)

/* y[0..n) = x[0..n) as doubles. */
POLICY_HOT static void widen(double *restrict y, const float *restrict x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = x[i];
}

/* y[i] = add[from + i] + x[i] where from + i < nadd, 0.0 + x[i] beyond (a
 * new token's accumulator starts at zero, §2.3). */
POLICY_HOT static void add_scores(double *restrict y, const double *restrict x,
                                  const double *restrict add, size_t from, size_t n, size_t nadd)
{
    size_t i = 0, both = nadd <= from ? 0 : nadd - from < n ? nadd - from : n;
    for (; i < both; i++)
        y[i] = add[from + i] + x[i];
    for (; i < n; i++)
        y[i] = 0.0 + x[i];
}

/* add_scores() of floats, each widened. */
POLICY_HOT static void add_widened(double *restrict y, const float *restrict x,
                                   const double *restrict add, size_t from, size_t n, size_t nadd)
{
    size_t i = 0, both = nadd <= from ? 0 : nadd - from < n ? nadd - from : n;
    for (; i < both; i++)
        y[i] = add[from + i] + (double)x[i];
    for (; i < n; i++)
        y[i] = 0.0 + (double)x[i];
}

/* The forward max-pool of x[0..n) (or of xf, pooled as floats) into y,
 * windows up to OV_MAXPOOL_SPANS; with add, plus add as add_scores() does,
 * a block at a time (the pooled block never leaves L1). The earlier of two
 * equal spans stays, so each output is the first of its window's maxima,
 * as in one pass per offset. Returns the index of the first of the floats
 * taken that is not finite, or n. */
static size_t maxpool_spans(const double *x, const float *xf, size_t n, size_t w, double *y,
                            const double *add, size_t nadd)
{
    union {
        double d[2][OV_MAXPOOL_BLOCK + OV_MAXPOOL_SPANS];
        float f[3][OV_MAXPOOL_BLOCK + OV_MAXPOOL_SPANS];
    } buf;
    size_t bad = n;
    for (size_t k0 = 0; k0 < n; k0 += OV_MAXPOOL_BLOCK) {
        size_t len = n - k0 < OV_MAXPOOL_BLOCK ? n - k0 : OV_MAXPOOL_BLOCK;
        size_t avail = n - k0 < len + w - 1 ? n - k0 : len + w - 1; /* the block's inputs */
        if (xf != NULL) {
            /* Taken into L1 and checked there (policy_ops.stats_in_place). */
            size_t at = policy_copy_first_outside(buf.f[2], xf + k0, avail, -FLT_MAX);
            if (at < avail && k0 + at < bad)
                bad = k0 + at;
            const float *p = pool_block_f(buf.f[2], buf.f[0], buf.f[1], len, avail, w);
            if (add == NULL)
                widen(y + k0, p, len);
            else
                add_widened(y + k0, p, add, k0, len, nadd);
        } else {
            const double *p = pool_block_d(x + k0, buf.d[0], buf.d[1], len, avail, w);
            if (add == NULL)
                memcpy(y + k0, p, len * sizeof *y);
            else
                add_scores(y + k0, p, add, k0, len, nadd);
        }
    }
    return bad;
}

POLICY_HOT void ov_fwd_maxpool(const double *restrict x, size_t n, size_t w, double *restrict y,
                               size_t *dq)
{
    if (w <= OV_MAXPOOL_SPANS) {
        (void)maxpool_spans(x, NULL, n, w > 1 ? w : 1, y, NULL, 0);
        return;
    }
    /* Walk i downwards over the window [i, i + w): dq[head..tail) holds
     * indices ascending whose values ascend too (a later index with a value
     * <= x[i] can never be a window's max again), so the max is the last. */
    size_t head = n, tail = n; /* empty; the deque grows towards 0 */
    for (size_t k = n; k-- > 0;) {
        while (tail > head && dq[tail - 1] >= k + w)
            tail--;
        while (tail > head && x[dq[head]] <= x[k])
            head++;
        dq[--head] = k;
        y[k] = x[dq[tail - 1]];
    }
}

uint64_t ov_counter(size_t i, size_t n, uint64_t k)
{
    uint64_t left = (uint64_t)(n - i);
    return left < k ? left : k;
}

/* ---- block eviction (§2.5) ---------------------------------------------- */

/* Four at a time (GCC's vector extension). */
typedef double ov_f64x4 __attribute__((vector_size(32)));
typedef uint64_t ov_u64x4 __attribute__((vector_size(32)));
#define OV_X4 (sizeof(ov_f64x4) / sizeof(double))

/* Quotients of a chunk of tokens at a time: 8 KiB, in L1 for the sums. */
#define OV_QUOTIENTS 1024

/*
 * q[i] = acc[i] / (double)(cnt[i] + shift) for i < n. A uint64_t becomes a
 * double in two exact halves, high · 2^32 + low, added once: the same
 * rounding as the conversion (which AVX2 has no instruction for; the
 * scalar one branches). Each half is put in a double's mantissa under the
 * exponent of 2^52 and 2^52 taken away.
 */
POLICY_HOT static void counter_quotients(const double *restrict acc, const uint64_t *restrict cnt,
                                         uint64_t shift, size_t n, double *restrict q)
{
    const ov_u64x4 magic = (ov_u64x4){0} + 0x4330000000000000u, low = (ov_u64x4){0} + 0xffffffffu;
    const ov_f64x4 two52 = (ov_f64x4){0} + 4503599627370496.0, two32 = (ov_f64x4){0} + 4294967296.0;
    size_t i = 0;
    for (; i + OV_X4 <= n; i += OV_X4) {
        ov_u64x4 c;
        ov_f64x4 a;
        memcpy(&c, cnt + i, sizeof c);
        memcpy(&a, acc + i, sizeof a);
        c += shift;
        ov_f64x4 hi = (ov_f64x4)((c >> 32) | magic) - two52;
        ov_f64x4 lo = (ov_f64x4)((c & low) | magic) - two52;
        ov_f64x4 r = a / (hi * two32 + lo);
        memcpy(q + i, &r, sizeof r);
    }
    for (; i < n; i++)
        q[i] = acc[i] / (double)(cnt[i] + shift);
}

void ov_score_blocks(const double *acc, const uint64_t *cnt, uint64_t cnt_shift, size_t nblocks,
                     uint32_t B, double *bs)
{
    if (cnt == NULL) {
        for (size_t j = 0; j < nblocks; j++) {
            double s = 0.0;
            for (uint32_t t = 0; t < B; t++)
                s += acc[j * B + t];
            bs[j] = s;
        }
        return;
    }
    /* The quotients a chunk at a time, then each block's sum in t order. */
    double q[OV_QUOTIENTS];
    size_t total = nblocks * B, j = 0;
    uint32_t t = 0;
    double s = 0.0;
    for (size_t base = 0; base < total; base += OV_QUOTIENTS) {
        size_t m = total - base < OV_QUOTIENTS ? total - base : OV_QUOTIENTS;
        counter_quotients(acc + base, cnt + base, cnt_shift, m, q);
        for (size_t i = 0; i < m; i++) {
            s += q[i];
            if (++t == B) {
                bs[j++] = s;
                s = 0.0, t = 0;
            }
        }
    }
}

typedef struct scored {
    double s;
    uint32_t i;
} scored;

/* Ascending score, ties to the lower index. */
static int cmp_low_first(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    if (x->s != y->s)
        return x->s < y->s ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

int ov_select_lowest(const double *bs, size_t n, size_t k, uint32_t *out)
{
    if (k > n)
        k = n;
    if (k == 0)
        return 0;
    uint64_t *keys = malloc(n * sizeof *keys);
    if (keys == NULL)
        return -1;
    /* POLICIES.md §2.5: the nEvict smallest (score, index) pairs, written
     * out in index order. */
    for (size_t j = 0; j < n; j++)
        keys[j] = policy_key(bs[j]);
    policy_cut cut = policy_select_cut(keys, n, k);
    uint8_t *chosen = (uint8_t *)keys; /* the keys are spent: n bytes of room */
    policy_cut_mark(&cut, bs, 1.0, NULL, 1, n, 0, chosen);
    for (size_t j = 0, o = 0; j < n; j++)
        if (chosen[j])
            out[o++] = (uint32_t)j;
    free(keys);
    return 0;
}

/* ---- KVCrush (§2.6) ------------------------------------------------------ */

int ov_kvcrush_indicators(const double *acc, size_t n, uint8_t *ind)
{
    memset(ind, 0, n);
    if (n < 2)
        return 0;
    uint64_t *keys = malloc(n * sizeof *keys);
    if (keys == NULL)
        return -1;
    /* §6 #7: the reference's partial_sort leaves ties open; lower index wins. */
    for (size_t i = 0; i < n; i++)
        keys[i] = policy_key(-acc[i]);
    policy_cut cut = policy_select_cut(keys, n, n / 2);
    policy_cut_mark(&cut, acc, -1.0, NULL, 1, n, 0, ind);
    free(keys);
    return 0;
}

void ov_kvcrush_anchor(ov_anchor_mode mode, const uint8_t *ind, size_t nE, uint32_t B,
                       ov_mt19937 *rng, uint8_t *anchor)
{
    for (uint32_t p = 0; p < B; p++) {
        switch (mode) {
        case OV_ANCHOR_RANDOM:
            /* §6 #8: libstdc++'s uniform_int_distribution is not portable;
             * the top bit of each mt19937 draw is our documented choice. */
            anchor[p] = (uint8_t)((ov_mt19937_next(rng) >> 31) & 1u);
            break;
        case OV_ANCHOR_ZEROS:
            anchor[p] = 0;
            break;
        case OV_ANCHOR_ONES:
            anchor[p] = 1;
            break;
        case OV_ANCHOR_MEAN: {
            size_t ones = 0;
            for (size_t b = 0; b < nE; b++)
                ones += ind[b * B + p];
            anchor[p] = nE > 0 && (double)ones / (double)nE > 0.5; /* strict */
            break;
        }
        case OV_ANCHOR_ALTERNATING:
            anchor[p] = (uint8_t)(p % 2);
            break;
        }
    }
}

int ov_kvcrush_retain(const double *acc, size_t nE, uint32_t B, const uint32_t *victims, size_t nv,
                      uint32_t budget, ov_anchor_mode mode, ov_mt19937 *rng, uint32_t *retain,
                      size_t *nretain)
{
    *nretain = 0;
    size_t N = nE * B;
    uint8_t *ind = malloc(N > 0 ? N : 1);
    uint8_t *anchor = malloc(B > 0 ? B : 1);
    scored *e = malloc((nv > 0 ? nv : 1) * sizeof *e);
    int rc = -1;
    if (ind == NULL || anchor == NULL || e == NULL)
        goto out;
    if (ov_kvcrush_indicators(acc, N, ind) != 0)
        goto out;
    ov_kvcrush_anchor(mode, ind, nE, B, rng, anchor);
    for (size_t v = 0; v < nv; v++) {
        uint32_t b = victims[v], d = 0;
        for (uint32_t p = 0; p < B; p++)
            d += ind[(size_t)b * B + p] != anchor[p];
        e[v] = (scored){(double)d, b};
    }
    /* E = victims by distance ascending, ties to the lower block (§6 #7). */
    qsort(e, nv, sizeof *e, cmp_low_first);
    size_t k = nv < budget ? nv : budget;
    if (k > 0) {
        size_t step = nv / k;
        for (size_t i = 0; i < k; i++)
            retain[i] = e[i * step].i;
        qsort(retain, k, sizeof *retain, cmp_u32);
    }
    *nretain = k;
    rc = 0;
out:
    free(ind);
    free(anchor);
    free(e);
    return rc;
}

/* ---- cache rotation (§2.8) ----------------------------------------------- */

int ov_rotation_plan(const uint32_t *evicted, size_t ne, uint32_t nbefore, uint32_t nmax,
                     ov_rotation_step *out, size_t *nout, char *err, size_t errlen)
{
    *nout = 0;
    for (size_t i = 0; i < ne; i++) {
        if (evicted[i] >= nbefore) {
            policy_set_err(err, errlen,
                           "evicted block %" PRIu32 " is outside the %" PRIu32
                           " blocks before eviction",
                           evicted[i], nbefore);
            return -1;
        }
    }
    uint8_t *gone = calloc(nbefore > 0 ? nbefore : 1, 1);
    if (gone == NULL) {
        policy_set_err(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < ne; i++)
        gone[evicted[i]] = 1;
    uint32_t shift = 0;
    size_t n = 0;
    for (uint32_t b = 0; b < nbefore; b++) {
        if (gone[b]) {
            shift++;
        } else if (shift > 0) {
            if (shift >= nmax) { /* §6 #6: the reference's assert allows shift == Nmax */
                policy_set_err(err, errlen,
                               "rotation shift of %" PRIu32 " blocks needs more than the %" PRIu32
                               " coefficient rows",
                               shift, nmax);
                free(gone);
                return -1;
            }
            out[n++] = (ov_rotation_step){b - shift, shift};
        }
    }
    free(gone);
    *nout = n;
    return 0;
}

void ov_rotation_row(uint32_t delta, uint32_t d, double rope_theta, double *sin_row,
                     double *cos_row)
{
    for (uint32_t j = 0; j < d / 2; j++) {
        double theta_j = pow(rope_theta, -2.0 * (double)j / (double)d);
        double a = (double)delta * theta_j;
        cos_row[j] = cos(a);
        sin_row[j] = -sin(a); /* inverse rotation: RoPE(p) -> RoPE(p - delta) */
    }
}

/* ---- the policy state ---------------------------------------------------- */

/*
 * A layer's tokens. The accumulators are in two buffers, as h2o's (h2o.c
 * h2o_layer): a registration writes its sums into the spare one and makes
 * it current, so save() keeps the one it read without a copy (issue 16 §2:
 * 8 bytes a token, 8 MiB a decode step at 32k tokens × 32 layers). A buffer
 * a saved copy holds (pinned) is copied before anything writes it in place
 * (layer_own).
 *
 * Token i's NORM_SUM counter (kept in both modes) is cnt[i] + cnt_shift,
 * modulo 2^64. A registration's normal growth adds the same number to every
 * counter, so it moves cnt_shift and writes only the new tokens' entries:
 * no pass over the list a step. cnt is rewritten only inside the SnapKV
 * window and by an eviction, on an array of its own when a saved copy holds
 * the current one (cnt_pinned; cnt_reserve).
 */
typedef struct ov_layer {
    double *acc; /* [len] accumulated (pooled) scores of the tracked tokens */
    size_t len, cap;
    double *spare_acc;
    size_t spare_cap; /* 0: no spare */
    int pinned;
    uint64_t *cnt; /* [len] counters, less cnt_shift */
    size_t cnt_cap;
    uint64_t cnt_shift;
    int cnt_pinned;
} ov_layer;

static void layer_free(ov_layer *L)
{
    free(L->acc);
    free(L->cnt);
    free(L->spare_acc);
}

struct ov_block {
    uint32_t start, recent, max, B, layers;
    int norm_sum;
    uint32_t pool_w, snap_w, crush_budget, seed, head_size;
    ov_anchor_mode anchor;
    double rope_theta;
    int apply_rotation;
    unsigned rope_pairing; /* 0 half, 1 interleaved (policy.h) */

    uint32_t nreg; /* SnapKV-window scores registered so far (§2.3) */
    ov_mt19937 rng;
    ov_layer *ly;

    /* step(): the step whose nsnap was counted, and its value; the lock
     * orders the layers of a step that decide at once. */
    uint64_t reg_step;
    uint32_t reg_nsnap;
    pthread_mutex_t reg_lock;

    /* Scratch for one layer's vector. */
    double *raw, *x;
    size_t *dq;
    size_t scratch_cap;
    uint64_t *cnt_view; /* ov_block_counters() */

    /* ov_block_apply_next(): the next step() evicts these blocks. */
    const uint32_t *apply;
    size_t napply;
    int applying;

    /* Calls that may change the sequence-wide part above (nreg, rng,
     * reg_step, reg_nsnap, apply*): orders the copies ops->save takes.
     * Counted by the layers' steps, which may run at once. */
    _Atomic uint64_t gen;
};

static const char *const aggregation_names[] = {"sum", "norm_sum", NULL};
static const char *const anchor_names[] = {"random", "zeros", "ones", "mean", "alternating", NULL};
static const char *const pairings[] = {"half", "interleaved", NULL};

/* The parameters as parsed (policy_params_parse); ov_parse() checks them
 * together and fills the state. */
typedef struct ov_config {
    uint32_t start, recent, max, block_size, pool_w, snap_w, crush_budget, seed, head_size,
        apply_rotation;
    unsigned aggregation, anchor, rope_pairing;
    double rope_theta;
} ov_config;

#define OV_U32(k, d, h, lo, hi, field) POLICY_PARAM_U32(k, d, h, lo, hi, offsetof(ov_config, field))

static const policy_param_spec ov_params[] = {
    OV_U32("start_size", "32",
           "tokens at the start never evicted; a multiple of the block size (POLICIES.md §2.1)", 1,
           OV_MAX_TOKENS, start),
    OV_U32("recent_size", "128",
           "most recent tokens not evicted while in this area; a multiple of the block size "
           "(§2.1)",
           1, OV_MAX_TOKENS, recent),
    OV_U32("max_cache_size", "672",
           "start + evictable + recent tokens kept after eviction; > start_size + recent_size, a "
           "multiple of the block size (§2.1)",
           1, OV_MAX_TOKENS, max),
    POLICY_PARAM_U32_OR(
        "block_size", "0",
        "eviction granularity in tokens: must equal the sequence's block size; 0 or empty = "
        "the block size (§2.5)",
        0, OV_MAX_TOKENS, offsetof(ov_config, block_size), "", 0),
    POLICY_PARAM_ONE_OF("aggregation", "norm_sum",
                        "score aggregation: sum | norm_sum (sum divided by the number of steps "
                        "that scored the token) (§2.3)",
                        aggregation_names, offsetof(ov_config, aggregation)),
    OV_U32("max_pool_window", "7",
           "forward max-pool window over each registered score vector; 0 or 1 = none (§2.3, §6 "
           "#4)",
           0, OV_MAX_WINDOW, pool_w),
    OV_U32("snapkv_window", "8",
           "last prompt queries whose scores start the accumulator; 0 = off (§2.3, §2.4)", 0,
           OV_MAX_WINDOW, snap_w),
    OV_U32("kvcrush_budget", "0", "KVCrush: victim blocks kept for diversity; 0 = off (§2.6)", 0,
           OV_MAX_WINDOW, crush_budget),
    POLICY_PARAM_ONE_OF("kvcrush_anchor", "random",
                        "KVCrush anchor: random | zeros | ones | mean | alternating (§2.6)",
                        anchor_names, offsetof(ov_config, anchor)),
    OV_U32("kvcrush_seed", "0", "seed of the mt19937 stream of the random anchor (§2.6, §6 #8)", 0,
           UINT32_MAX, seed),
    POLICY_PARAM_F64("rope_theta", "10000", "RoPE base for re-rotating shifted keys (§2.8, §6 #5)",
                     1.0, 1e12, offsetof(ov_config, rope_theta)),
    OV_U32("head_size", "0",
           "head size of the rotation coefficients (even); 0 = the model's head_dim (§2.8)", 0,
           65536, head_size),
    OV_U32("apply_rotation", "0",
           "1 = ask the daemon to re-rotate the keys of shifted blocks (§2.8)", 0, 1,
           apply_rotation),
    POLICY_PARAM_ONE_OF("rope_pairing", "half",
                        "the model's RoPE pairs, for re-rotation: half (j, j+d/2; HF, OpenVINO) | "
                        "interleaved (2j, 2j+1; llama2.c)",
                        pairings, offsetof(ov_config, rope_pairing)),
};

#define OV_NPARAMS (sizeof(ov_params) / sizeof(ov_params[0]))

static void ov_destroy(void *state)
{
    ov_block *st = state;
    if (st == NULL)
        return;
    for (uint32_t l = 0; st->ly != NULL && l < st->layers; l++)
        layer_free(&st->ly[l]);
    free(st->ly);
    free(st->cnt_view);
    free(st->raw);
    free(st->x);
    free(st->dq);
    pthread_mutex_destroy(&st->reg_lock);
    free(st);
}

/* block_size: 0 (or "") means the geometry's block size. */
static int check_block_size(uint32_t v, const policy_geometry *g, uint32_t *B, char *err,
                            size_t errlen)
{
    if (g->block_tokens == 0) {
        policy_set_err(err, errlen,
                       "parameter block_size: the sequence has no block size (block_tokens "
                       "is 0)");
        return -1;
    }
    if (v != 0 && v != g->block_tokens) {
        policy_set_err(err, errlen,
                       "parameter block_size (%" PRIu32 ") must equal the sequence's block "
                       "size (%" PRIu32 ")",
                       v, g->block_tokens);
        return -1;
    }
    *B = g->block_tokens;
    return 0;
}

static int check_multiple(const char *key, uint32_t v, uint32_t B, char *err, size_t errlen)
{
    if (v % B == 0)
        return 0;
    policy_set_err(err, errlen,
                   "parameter %s (%" PRIu32 ") must be a multiple of the block size (%" PRIu32 ")",
                   key, v, B);
    return -1;
}

/* Parse and check every parameter into *s (§2.1 validation). */
static int ov_parse(const policy_params *p, const policy_geometry *g, ov_block *s, char *err,
                    size_t errlen)
{
    ov_config c;
    if (g->layers == 0) {
        policy_set_err(err, errlen, "layers: policy ov_block needs at least one layer, got 0");
        return -1;
    }
    if (policy_params_parse(p, ov_params, OV_NPARAMS, &c, err, errlen) != 0 ||
        check_block_size(c.block_size, g, &s->B, err, errlen) != 0)
        return -1;
    s->start = c.start;
    s->recent = c.recent;
    s->max = c.max;
    s->pool_w = c.pool_w;
    s->snap_w = c.snap_w;
    s->crush_budget = c.crush_budget;
    s->seed = c.seed;
    s->rope_theta = c.rope_theta;
    s->head_size = c.head_size;
    s->rope_pairing = c.rope_pairing;
    if ((uint64_t)s->max <= (uint64_t)s->start + s->recent) {
        policy_set_err(err, errlen,
                       "parameter max_cache_size (%" PRIu32 ") must be greater than "
                       "start_size + recent_size (%" PRIu64 ")",
                       s->max, (uint64_t)s->start + s->recent);
        return -1;
    }
    if (check_multiple("start_size", s->start, s->B, err, errlen) != 0 ||
        check_multiple("recent_size", s->recent, s->B, err, errlen) != 0 ||
        check_multiple("max_cache_size", s->max, s->B, err, errlen) != 0)
        return -1;
    if (s->head_size == 0)
        s->head_size = g->head_dim;
    if (s->head_size % 2 != 0) {
        policy_set_err(err, errlen,
                       "parameter head_size (%" PRIu32 ") must be even (rotation pairs "
                       "j with j + d/2)",
                       s->head_size);
        return -1;
    }
    if (c.apply_rotation && s->head_size == 0) {
        policy_set_err(err, errlen,
                       "parameter head_size: apply_rotation needs a head size and the "
                       "model's head_dim is 0");
        return -1;
    }
    s->norm_sum = c.aggregation == 1;
    s->anchor = (ov_anchor_mode)c.anchor;
    s->apply_rotation = (int)c.apply_rotation;
    return 0;
}

static int ov_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                     size_t errlen)
{
    *state = NULL;
    ov_block *st = calloc(1, sizeof *st);
    if (st == NULL || pthread_mutex_init(&st->reg_lock, NULL) != 0) {
        free(st);
        policy_set_err(err, errlen, "out of memory creating policy 'ov_block'");
        return -1;
    }
    if (ov_parse(p, g, st, err, errlen) != 0) {
        ov_destroy(st);
        return -1;
    }
    st->layers = g->layers;
    ov_mt19937_seed(&st->rng, st->seed);
    st->ly = calloc(st->layers, sizeof *st->ly);
    if (st->ly == NULL)
        goto oom;
    *state = st;
    return 0;
oom:
    ov_destroy(st);
    policy_set_err(err, errlen, "out of memory creating policy 'ov_block'");
    return -1;
}

static int grow_scratch(ov_block *st, size_t n)
{
    if (n <= st->scratch_cap)
        return 0;
    double *raw = realloc(st->raw, n * sizeof *raw);
    if (raw == NULL)
        return -1;
    st->raw = raw;
    double *x = realloc(st->x, n * sizeof *x);
    if (x == NULL)
        return -1;
    st->x = x;
    size_t *dq = realloc(st->dq, n * sizeof *dq);
    if (dq == NULL)
        return -1;
    st->dq = dq;
    st->scratch_cap = n;
    return 0;
}

static size_t cap_for(size_t cap, size_t n)
{
    cap = cap ? cap : 64;
    while (cap < n)
        cap *= 2;
    return cap;
}

/* Room for n tokens in the spare accumulators (their contents are not
 * kept). */
static int spare_reserve(ov_layer *L, size_t n)
{
    if (n <= L->spare_cap)
        return 0;
    size_t cap = cap_for(L->spare_cap, n);
    free(L->spare_acc);
    L->spare_acc = malloc(cap * sizeof *L->spare_acc);
    L->spare_cap = L->spare_acc != NULL ? cap : 0;
    return L->spare_cap != 0 ? 0 : -1;
}

/* The spare accumulators become current with len tokens; the current ones
 * the spare, unless a saved copy holds them. */
static void layer_swap(ov_layer *L, size_t len)
{
    double *acc = L->acc;
    size_t cap = L->cap;
    L->acc = L->spare_acc, L->cap = L->spare_cap, L->len = len;
    if (L->pinned) {
        L->spare_acc = NULL, L->spare_cap = 0;
        L->pinned = 0;
    } else {
        L->spare_acc = acc, L->spare_cap = cap;
    }
}

/* Room for n counters, the first `keep` kept; with `rewrite`, on an array
 * that no saved copy holds (the saved copy keeps the old one). -1 out of
 * memory. */
static int cnt_reserve(ov_layer *L, size_t n, size_t keep, int rewrite)
{
    if (n <= L->cnt_cap && !(rewrite && L->cnt_pinned))
        return 0;
    size_t cap = cap_for(L->cnt_cap, n);
    uint64_t *c = malloc(cap * sizeof *c);
    if (c == NULL)
        return -1;
    if (keep > 0)
        memcpy(c, L->cnt, keep * sizeof *c);
    if (!L->cnt_pinned)
        free(L->cnt);
    L->cnt = c, L->cnt_cap = cap, L->cnt_pinned = 0;
    return 0;
}

/* Before the current accumulators and counters are written in place: their
 * copies where a saved copy holds them. */
static int layer_own(ov_layer *L)
{
    if (cnt_reserve(L, L->len, L->len, 1) != 0)
        return -1;
    if (!L->pinned)
        return 0;
    if (spare_reserve(L, L->len) != 0)
        return -1;
    if (L->len > 0)
        memcpy(L->spare_acc, L->acc, L->len * sizeof *L->acc);
    layer_swap(L, L->len);
    return 0;
}

/* Are n scores, the first non-finite of them at index `bad` (n: none),
 * usable for layer l? (Checked before anything changes.) */
static int layer_check(const ov_block *st, uint32_t l, size_t n, size_t bad, char *err,
                       size_t errlen)
{
    const ov_layer *L = &st->ly[l];
    if (n > st->start && L->len > n - st->start) {
        policy_set_err(err, errlen,
                       "layer %" PRIu32 ": %zu scores are fewer than the %zu tokens the "
                       "layer already holds (start_size %" PRIu32 " + %zu tracked)",
                       l, n, (size_t)st->start + L->len, st->start, L->len);
        return -1;
    }
    if (bad < n) {
        policy_set_err(err, errlen, "layer %" PRIu32 ": score %zu is not a finite number", l, bad);
        return -1;
    }
    return 0;
}

/* §2.3 "if nreg < W_s: require nreg + nsnap <= W_s; nreg += nsnap". */
static int snapkv_count(ov_block *st, uint32_t nsnap, char *err, size_t errlen)
{
    if (st->nreg >= st->snap_w)
        return 0;
    if ((uint64_t)st->nreg + nsnap > st->snap_w) {
        policy_set_err(err, errlen,
                       "%" PRIu32 " SnapKV scores overfill the window: %" PRIu32 " of %" PRIu32
                       " already registered (snapkv_window)",
                       nsnap, st->nreg, st->snap_w);
        return -1;
    }
    st->nreg += nsnap;
    return 0;
}

/*
 * acc[0..m) = the forward max-pool of m scores, doubles (raw) or a step's
 * floats (rawf), plus add[i] for i < nadd and 0.0 beyond (add NULL: the
 * pool alone). Floats go straight into the pooling's blocks, converted
 * there, and each block's sums are taken while it is in L1, unless the
 * window needs the deque. Floats are taken once each into memory of the
 * policy's own and checked there: the first that is not finite (index), or
 * m.
 */
static size_t pool_scores(ov_block *st, const double *raw, const float *rawf, size_t m, double *acc,
                          const double *add, size_t nadd)
{
    size_t w = st->pool_w;
    if (w <= OV_MAXPOOL_SPANS)
        return maxpool_spans(raw, rawf, m, w > 1 ? w : 1, acc, add, nadd);
    size_t bad = m;
    if (rawf != NULL) {
        widen(st->raw, rawf, m);
        raw = st->raw;
        bad = policy_first_nonfinite(raw, m);
    }
    ov_fwd_maxpool(raw, m, w, st->x, st->dq);
    if (add != NULL)
        add_scores(acc, st->x, add, 0, m, nadd);
    else
        memcpy(acc, st->x, m * sizeof *acc);
    return bad;
}

/* layer_register's answer when a float it took is not finite. */
#define OV_REG_REFUSED (-2)

/*
 * §2.3 for one layer, after snapkv_count(): its n scores are raw (doubles)
 * or rawf (floats), the other NULL, checked by layer_check() (the floats,
 * read in place, are checked again as they are taken). Returns the layer's
 * status, -1 out of memory, or OV_REG_REFUSED with the score's index in
 * *bad, the layer's tokens unchanged.
 */
static int layer_register(ov_block *st, uint32_t l, const double *raw, const float *rawf, size_t n,
                          uint32_t nsnap, size_t *bad)
{
    ov_layer *L = &st->ly[l];
    if (n <= st->start)
        return OV_REG_SHORT;
    size_t m = n - st->start;
    /* A prompt chunk before the SnapKV window (nsnap 0) is ignored. */
    if (L->len == 0 && st->snap_w != 0 && nsnap == 0)
        return OV_REG_BEFORE_WINDOW;
    /* The shared scratch only for the deque's windows (ov_layers_concurrent). */
    if ((st->pool_w > OV_MAXPOOL_SPANS && grow_scratch(st, m) != 0) || spare_reserve(L, m) != 0)
        return -1;
    raw = raw != NULL ? raw + st->start : NULL;
    rawf = rawf != NULL ? rawf + st->start : NULL;
    if (L->len == 0) { /* initial registration */
        if (cnt_reserve(L, m, 0, 1) != 0)
            return -1;
        if ((*bad = pool_scores(st, raw, rawf, m, L->spare_acc, NULL, 0)) < m)
            return OV_REG_REFUSED;
        uint64_t k = st->snap_w == 0 ? m : nsnap;
        L->cnt_shift = 0;
        for (size_t i = 0; i < m; i++)
            L->cnt[i] = ov_counter(i, m, k);
        layer_swap(L, m);
        return OV_REG_DONE;
    }
    size_t old = L->len;
    if ((*bad = pool_scores(st, raw, rawf, m, L->spare_acc, L->acc, old)) < m)
        return OV_REG_REFUSED;
    if (st->snap_w == 0 || st->nreg == st->snap_w) { /* normal growth: every counter + delta */
        if (cnt_reserve(L, m, old, 0) != 0)
            return -1;
        uint64_t delta = m - old;
        L->cnt_shift += delta;
        for (size_t j = 0; j < delta; j++)
            L->cnt[old + j] = delta - j - L->cnt_shift;
    } else { /* still inside the SnapKV window */
        if (cnt_reserve(L, m, 0, 1) != 0)
            return -1;
        L->cnt_shift = 0;
        for (size_t i = 0; i < m; i++)
            L->cnt[i] = ov_counter(i, m, st->nreg);
    }
    layer_swap(L, m);
    return OV_REG_DONE;
}

int ov_block_register(ov_block *st, const double *const *scores, const size_t *n, uint32_t nsnap,
                      ov_reg_status *status, char *err, size_t errlen)
{
    st->gen++;
    if (status != NULL)
        *status = OV_REG_DONE;
    for (uint32_t l = 0; l < st->layers; l++)
        if (layer_check(st, l, n[l], policy_first_nonfinite(scores[l], n[l]), err, errlen) != 0)
            return -1;
    if (snapkv_count(st, nsnap, err, errlen) != 0)
        return -1;
    ov_reg_status worst = OV_REG_DONE;
    for (uint32_t l = 0; l < st->layers; l++) {
        size_t bad;
        int rc = layer_register(st, l, scores[l], NULL, n[l], nsnap, &bad);
        if (rc < 0) {
            policy_set_err(err, errlen, "out of memory registering scores");
            return -1;
        }
        if (rc > (int)worst)
            worst = (ov_reg_status)rc;
        /* The reference returns from the whole registration here, so the
         * later layers are skipped too (§2.3). */
        if (rc == OV_REG_SHORT)
            break;
    }
    if (status != NULL)
        *status = worst;
    return 0;
}

/* Drop the tokens of the relative blocks v[0..nv) (ascending) from L. */
static void layer_remove(ov_layer *L, const uint32_t *v, size_t nv, uint32_t B)
{
    size_t out = 0, k = 0;
    for (size_t i = 0; i < L->len; i++) {
        while (k < nv && (size_t)v[k] * B + B <= i)
            k++;
        if (k < nv && i >= (size_t)v[k] * B)
            continue;
        L->acc[out] = L->acc[i];
        L->cnt[out] = L->cnt[i];
        out++;
    }
    L->len = out;
}

/* Remove retain[0..nr) (ascending) from v[0..*nv) (ascending). */
static void set_minus(uint32_t *v, size_t *nv, const uint32_t *retain, size_t nr)
{
    size_t out = 0, k = 0;
    for (size_t i = 0; i < *nv; i++) {
        while (k < nr && retain[k] < v[i])
            k++;
        if (k < nr && retain[k] == v[i])
            continue;
        v[out++] = v[i];
    }
    *nv = out;
}

int ov_block_evict(ov_block *st, uint32_t layer, uint32_t **blocks, size_t *nblocks, char *err,
                   size_t errlen)
{
    *blocks = NULL;
    *nblocks = 0;
    st->gen++; /* KVCrush may draw from the rng */
    ov_layer *L = &st->ly[layer];
    uint32_t B = st->B;
    uint64_t seq = (uint64_t)st->start + L->len;
    uint64_t cap = (uint64_t)st->max + B - 1; /* max cache size after eviction */
    if (seq <= cap)
        return 0;
    uint64_t first = st->start / B;
    uint64_t last = seq / B - st->recent / B; /* exclusive: the partial block never goes */
    if (last <= first)
        return 0;
    size_t nE = (size_t)(last - first);
    size_t keepE = (st->max - st->start - st->recent + B - 1) / B;
    size_t nEvict = nE > keepE ? nE - keepE : 0;
    if (nEvict == 0)
        return 0;
    double *bs = malloc(nE * sizeof *bs);
    uint32_t *v = malloc(nEvict * sizeof *v);
    uint32_t *keep = malloc((st->crush_budget > 0 ? st->crush_budget : 1) * sizeof *keep);
    if (bs == NULL || v == NULL || keep == NULL)
        goto oom;
    ov_score_blocks(L->acc, st->norm_sum ? L->cnt : NULL, L->cnt_shift, nE, B, bs);
    if (ov_select_lowest(bs, nE, nEvict, v) != 0)
        goto oom;
    size_t nv = nEvict;
    if (st->crush_budget > 0 && nv >= st->crush_budget) {
        size_t nk;
        if (ov_kvcrush_retain(L->acc, nE, B, v, nv, st->crush_budget, st->anchor, &st->rng, keep,
                              &nk) != 0)
            goto oom;
        set_minus(v, &nv, keep, nk);
    }
    if (layer_own(L) != 0) /* only within a transaction, which rolls back */
        goto oom;
    layer_remove(L, v, nv, B);
    for (size_t i = 0; i < nv; i++)
        v[i] += (uint32_t)first;
    free(bs);
    free(keep);
    if (nv == 0) {
        free(v);
        return 0;
    }
    *blocks = v;
    *nblocks = nv;
    return 0;
oom:
    free(bs);
    free(v);
    free(keep);
    policy_set_err(err, errlen, "out of memory evicting layer %" PRIu32, layer);
    return -1;
}

uint32_t ov_block_layers(const ov_block *st)
{
    return st->layers;
}

uint32_t ov_block_start_size(const ov_block *st)
{
    return st->start;
}

uint32_t ov_block_snapkv_window(const ov_block *st)
{
    return st->snap_w;
}

uint32_t ov_block_block_size(const ov_block *st)
{
    return st->B;
}

uint32_t ov_block_head_size(const ov_block *st)
{
    return st->head_size;
}

uint32_t ov_block_snapkv_registered(const ov_block *st)
{
    return st->nreg;
}

size_t ov_block_tracked(const ov_block *st, uint32_t layer)
{
    return st->ly[layer].len;
}

const double *ov_block_scores(const ov_block *st, uint32_t layer)
{
    return st->ly[layer].acc;
}

const uint64_t *ov_block_counters(ov_block *st, uint32_t layer)
{
    const ov_layer *L = &st->ly[layer];
    if (!st->norm_sum)
        return NULL;
    uint64_t *c = realloc(st->cnt_view, (L->len ? L->len : 1) * sizeof *c);
    if (c == NULL)
        return NULL;
    st->cnt_view = c;
    for (size_t i = 0; i < L->len; i++)
        c[i] = L->cnt[i] + L->cnt_shift;
    return c;
}

int ov_block_rotation(const ov_block *st, const uint32_t *evicted, size_t ne,
                      uint32_t blocks_before, ov_rotation **out, size_t *nout, char *err,
                      size_t errlen)
{
    *out = NULL;
    *nout = 0;
    uint32_t d = st->head_size, half = d / 2;
    if (d == 0) {
        policy_set_err(err, errlen,
                       "parameter head_size: rotation needs a head size (set head_size)");
        return -1;
    }
    if ((uint64_t)blocks_before * st->B > UINT32_MAX) {
        policy_set_err(err, errlen,
                       "%" PRIu32 " blocks of %" PRIu32 " tokens exceed the position range",
                       blocks_before, st->B);
        return -1;
    }
    ov_rotation_step *plan = malloc((blocks_before > 0 ? blocks_before : 1) * sizeof *plan);
    if (plan == NULL) {
        policy_set_err(err, errlen, "out of memory");
        return -1;
    }
    size_t n;
    /* The table has a row for every shift up to blocks_before (§6 #6). */
    if (ov_rotation_plan(evicted, ne, blocks_before, blocks_before + 1, plan, &n, err, errlen) !=
        0) {
        free(plan);
        return -1;
    }
    if (n == 0) {
        free(plan);
        return 0;
    }
    ov_rotation *r = malloc(n * sizeof *r + 2 * n * half * sizeof(double) + 1);
    if (r == NULL) {
        free(plan);
        policy_set_err(err, errlen, "out of memory");
        return -1;
    }
    double *rows = (double *)(r + n);
    for (size_t i = 0; i < n; i++) {
        double *s = rows + 2 * i * half, *c = s + half;
        r[i].block = plan[i].block;
        r[i].delta = plan[i].shift * st->B;
        ov_rotation_row(r[i].delta, d, st->rope_theta, s, c);
        r[i].sin_row = s;
        r[i].cos_row = c;
    }
    free(plan);
    *out = r;
    *nout = n;
    return 0;
}

/* ---- step (the daemon's path) -------------------------------------------- */

void ov_block_apply_next(ov_block *st, const uint32_t *blocks, size_t n)
{
    st->gen++;
    st->apply = blocks;
    st->napply = n;
    st->applying = 1;
}

/* Evict the tokens of blocks[0..n) (each within the list), and say so in
 * the decision's span: most decode steps evict no block. */
static void evict_blocks(const ov_block *st, policy_decision *d, const uint32_t *blocks, size_t n)
{
    uint32_t lo = UINT32_MAX, hi = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t from = blocks[i] * st->B;
        memset(d->tier[0] + from, POLICY_EVICT, st->B);
        lo = from < lo ? from : lo;
        hi = from + st->B > hi ? from + st->B : hi;
    }
    policy_decision_span(d, 0, n > 0 ? lo : 0, n > 0 ? hi : 0);
}

/* The step after ov_block_apply_next(): evict exactly those blocks. */
static int apply_blocks(ov_block *st, const policy_layer_view *view, policy_decision *d, char *err,
                        size_t errlen)
{
    st->applying = 0;
    for (size_t i = 0; i < st->napply; i++) {
        uint64_t from = (uint64_t)st->apply[i] * st->B;
        if (from + st->B > view->tokens[0]) {
            policy_set_err(err, errlen, "block %" PRIu32 " is beyond the %" PRIu32 " held tokens",
                           st->apply[i], view->tokens[0]);
            return -1;
        }
    }
    evict_blocks(st, d, st->apply, st->napply);
    return 0;
}

/* nsnap counts once per step of the sequence, not once per layer: the
 * first of its layers to step counts it, under the lock (the layers may
 * step at once), and the others check they agree. */
static int step_count(ov_block *st, uint64_t step, uint32_t l, uint32_t nsnap, char *err,
                      size_t errlen)
{
    int rc = 0;
    pthread_mutex_lock(&st->reg_lock);
    if (st->reg_step != step) {
        rc = snapkv_count(st, nsnap, err, errlen);
        if (rc == 0) {
            st->reg_step = step;
            st->reg_nsnap = nsnap;
        }
    } else if (nsnap != st->reg_nsnap) {
        policy_set_err(err, errlen,
                       "score_queries %" PRIu32 " of layer %" PRIu32 " differs from %" PRIu32
                       " of an earlier layer in this step",
                       nsnap, l, st->reg_nsnap);
        rc = -1;
    }
    pthread_mutex_unlock(&st->reg_lock);
    return rc;
}

/* ops->layers_concurrent_now: a step's layers touch only their own state
 * but for the count above and gen, unless KVCrush draws random anchors
 * (the generator's draws follow the layers' order), the pooling window
 * needs the shared scratch of the deque, or a replay's apply is pending. */
static int ov_layers_concurrent(const void *state)
{
    const ov_block *st = state;
    return !(st->crush_budget > 0 && st->anchor == OV_ANCHOR_RANDOM) &&
           st->pool_w <= OV_MAXPOOL_SPANS && !st->applying;
}

static int ov_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                   policy_decision *d, char *err, size_t errlen)
{
    ov_block *st = state;
    uint32_t l = view->layer;
    st->gen++;
    if (view->heads != 1 || l >= st->layers) {
        policy_set_err(err, errlen,
                       "policy ov_block: bad view (layer %" PRIu32 ", %" PRIu32 " lists)", l,
                       view->heads);
        return -1;
    }
    if (st->applying)
        return apply_blocks(st, view, d, err, errlen);
    if (stats->score == NULL) {
        policy_set_err(err, errlen,
                       "policy ov_block needs stats score (per-token attention summed over "
                       "heads and the last score_queries queries)");
        return -1;
    }
    size_t n = view->tokens[0];
    /* In place, the pooling takes and checks each score it reads (a failed
     * step is undone), and the start area, never read, is checked here;
     * else a pass first, so that a refusal changes nothing. */
    size_t head = n < st->start ? n : st->start;
    size_t bad = stats->in_place ? policy_first_outside(stats->score, head, -FLT_MAX) : head;
    if (bad < head)
        return policy_stats_refused(err, errlen, "policy ov_block", l, bad);
    bad = stats->finite || stats->in_place ? n : policy_first_outside(stats->score, n, -FLT_MAX);
    if (layer_check(st, l, n, bad, err, errlen) != 0)
        return -1;
    if (step_count(st, view->step, l, stats->score_queries, err, errlen) != 0)
        return -1;
    int rc = layer_register(st, l, NULL, stats->score, n, stats->score_queries, &bad);
    if (rc == OV_REG_REFUSED)
        return policy_stats_refused(err, errlen, "policy ov_block", l, st->start + bad);
    if (rc < 0) {
        policy_set_err(err, errlen, "out of memory registering scores");
        return -1;
    }
    if (stats->prefill) { /* §2.5: never during prefill */
        policy_decision_span(d, 0, 0, 0);
        return 0;
    }
    uint32_t *blocks;
    size_t nb;
    if (ov_block_evict(st, l, &blocks, &nb, err, errlen) != 0)
        return -1;
    for (size_t i = 0; i < nb; i++) {
        size_t from = (size_t)blocks[i] * st->B;
        if (from + st->B > n) { /* cannot happen while acc mirrors the view */
            policy_set_err(err, errlen,
                           "policy ov_block: block %" PRIu32 " beyond the %zu held tokens",
                           blocks[i], n);
            free(blocks);
            return -1;
        }
    }
    evict_blocks(st, d, blocks, nb);
    free(blocks);
    d->rerotate_keys = st->apply_rotation && nb > 0;
    d->rope_theta = st->rope_theta;
    d->rope_pairing = (int)st->rope_pairing;
    return 0;
}

/* ---- transactions (host.h) ---------------------------------------------- */

/* A saved layer: its accumulators and counters in arrays of exactly len
 * (the copy's cap), and the sequence-wide part that any layer's step may
 * change, stamped with gen. raw, x and dq are scratch. */
typedef struct ov_saved {
    ov_layer *at;   /* the state's layer, for discard */
    ov_layer layer; /* its pair at save (acc, cnt, len, cap), pinned there */
    uint64_t gen;
    uint32_t nreg;
    ov_mt19937 rng;
    uint64_t reg_step;
    uint32_t reg_nsnap;
    const uint32_t *apply;
    size_t napply;
    int applying;
} ov_saved;

/* The pair saved: still current (no registration since), given back as
 * the spare, or freed. */
static void ov_discard(void *saved)
{
    ov_saved *c = saved;
    if (c == NULL)
        return;
    ov_layer *L = c->at;
    if (L->acc == c->layer.acc) {
        L->pinned = 0;
    } else if (L->spare_cap == 0) {
        L->spare_acc = c->layer.acc, L->spare_cap = c->layer.cap;
    } else {
        free(c->layer.acc);
    }
    if (L->cnt == c->layer.cnt)
        L->cnt_pinned = 0;
    else
        free(c->layer.cnt);
    free(c);
}

static int ov_save(void *state, uint32_t layer, void **saved)
{
    ov_block *st = state;
    ov_layer *L = &st->ly[layer];
    ov_saved *c = calloc(1, sizeof *c);
    if (c == NULL) {
        errno = ENOMEM;
        return -1;
    }
    c->at = L;
    c->layer = (ov_layer){.acc = L->acc,
                          .len = L->len,
                          .cap = L->cap,
                          .cnt = L->cnt,
                          .cnt_cap = L->cnt_cap,
                          .cnt_shift = L->cnt_shift};
    L->pinned = 1;
    L->cnt_pinned = 1;
    c->gen = st->gen;
    c->nreg = st->nreg;
    c->rng = st->rng;
    c->reg_step = st->reg_step;
    c->reg_nsnap = st->reg_nsnap;
    c->apply = st->apply;
    c->napply = st->napply;
    c->applying = st->applying;
    *saved = c;
    return 0;
}

/* The sequence-wide part comes back from the oldest copy restored (the
 * lowest gen), whatever the order of the restores: that copy was taken
 * before any of the steps being undone. */
static void ov_restore(void *state, uint32_t layer, void *saved)
{
    ov_block *st = state;
    ov_saved *c = saved;
    ov_layer *L = &st->ly[layer];
    if (L->acc != c->layer.acc) { /* the current accumulators become the spare */
        free(L->spare_acc);
        L->spare_acc = L->acc, L->spare_cap = L->cap;
        L->acc = c->layer.acc, L->cap = c->layer.cap;
    }
    if (L->cnt != c->layer.cnt) {
        free(L->cnt);
        L->cnt = c->layer.cnt, L->cnt_cap = c->layer.cnt_cap;
    }
    L->cnt_shift = c->layer.cnt_shift;
    L->cnt_pinned = 0;
    L->len = c->layer.len;
    L->pinned = 0;
    if (c->gen <= st->gen) {
        st->gen = c->gen;
        st->nreg = c->nreg;
        st->rng = c->rng;
        st->reg_step = c->reg_step;
        st->reg_nsnap = c->reg_nsnap;
        st->apply = c->apply;
        st->napply = c->napply;
        st->applying = c->applying;
    }
    free(c);
}

/* ---- moving a sequence (ops->export_layer / import_layer) ----------------
 *
 * A layer's state as bytes, little-endian, version 1:
 *     0  "ovb", then the version byte (1)
 *     4  u32 layer, layers, block size, start_size, snapkv_window,
 *        aggregation (0 sum, 1 norm_sum): what the bytes were written for,
 *        checked against the importing state (same parameters and geometry,
 *        as policy.h requires)
 *    28  u32 nreg (<= snapkv_window), u32 reg_nsnap, u64 reg_step
 *    44  u32 mt19937 index (<= 624), then its 624 u32 words
 *  2544  u64 tracked tokens (len)
 *  2552  len x u64 accumulated scores, each a double's IEEE bits (finite)
 *        len x u64 counters (>= 1, never rising along the list)
 * nreg, reg_* and the rng are sequence-wide: every layer's bytes carry
 * them, as save() does. Counters go in both modes (step() keeps them in
 * both, as save() copies them). Not carried: gen, which only orders
 * save()'s copies, and ov_block_apply_next()'s one-shot request, which
 * only `kvstash replay` makes, never a daemon's sequence. */

#define OV_STATE_VERSION 1
#define OV_STATE_ECHO 6    /* layer, layers, block size, start_size, snapkv_window, aggregation */
#define OV_STATE_WIDE 28   /* offset of nreg */
#define OV_STATE_RNG 44    /* offset of the mt19937 index */
#define OV_STATE_HEAD 2552 /* ... the rng's words and len */
#define OV_STATE_TOKEN 16  /* a score and a counter */
_Static_assert(OV_STATE_HEAD == OV_STATE_RNG + 4 + 4 * 624 + 8, "the header's layout");

static const char *const ov_echo_names[OV_STATE_ECHO] = {
    "layer", "layers", "block size", "start_size", "snapkv_window", "aggregation"};

static void state_echo(const ov_block *st, uint32_t layer, uint32_t echo[OV_STATE_ECHO])
{
    echo[0] = layer;
    echo[1] = st->layers;
    echo[2] = st->B;
    echo[3] = st->start;
    echo[4] = st->snap_w;
    echo[5] = (uint32_t)st->norm_sum;
}

static void *ov_export_layer(const void *state, uint32_t layer, size_t *len)
{
    const ov_block *st = state;
    const ov_layer *L = &st->ly[layer];
    size_t total = OV_STATE_HEAD + L->len * OV_STATE_TOKEN;
    uint8_t *b = malloc(total);
    if (b == NULL)
        return NULL;
    memcpy(b, "ovb", 3);
    b[3] = OV_STATE_VERSION;
    uint32_t echo[OV_STATE_ECHO];
    state_echo(st, layer, echo);
    for (int i = 0; i < OV_STATE_ECHO; i++)
        policy_put_le(b + 4 + 4 * i, echo[i], 4);
    policy_put_le(b + OV_STATE_WIDE, st->nreg, 4);
    policy_put_le(b + OV_STATE_WIDE + 4, st->reg_nsnap, 4);
    policy_put_le(b + OV_STATE_WIDE + 8, st->reg_step, 8);
    policy_put_le(b + OV_STATE_RNG, st->rng.idx, 4);
    for (int i = 0; i < 624; i++)
        policy_put_le(b + OV_STATE_RNG + 4 + 4 * i, st->rng.mt[i], 4);
    policy_put_le(b + OV_STATE_HEAD - 8, L->len, 8);
    uint8_t *acc = b + OV_STATE_HEAD, *cnt = acc + L->len * 8;
    for (size_t i = 0; i < L->len; i++) {
        policy_put_le(acc + i * 8, policy_f64_bits(L->acc[i]), 8);
        policy_put_le(cnt + i * 8, L->cnt[i] + L->cnt_shift, 8);
    }
    *len = total;
    return b;
}

/* Magic, version and what the bytes were written for, against st. */
static int state_head_check(const ov_block *st, uint32_t layer, const uint8_t *b, size_t len,
                            char *err, size_t errlen)
{
    if (len < OV_STATE_HEAD) {
        policy_set_err(err, errlen, "ov_block state: %zu bytes are shorter than its %d-byte header",
                       len, OV_STATE_HEAD);
        return -1;
    }
    if (memcmp(b, "ovb", 3) != 0) {
        policy_set_err(err, errlen, "ov_block state: bad magic (not ov_block's layer state)");
        return -1;
    }
    if (b[3] != OV_STATE_VERSION) {
        policy_set_err(err, errlen, "ov_block state: version %u, this build reads version %d",
                       (unsigned)b[3], OV_STATE_VERSION);
        return -1;
    }
    uint32_t echo[OV_STATE_ECHO];
    state_echo(st, layer, echo);
    for (int i = 0; i < OV_STATE_ECHO; i++) {
        uint32_t v = (uint32_t)policy_get_le(b + 4 + 4 * i, 4);
        if (v != echo[i]) {
            policy_set_err(err, errlen,
                           "ov_block state: written for %s %" PRIu32 ", this sequence has %" PRIu32,
                           ov_echo_names[i], v, echo[i]);
            return -1;
        }
    }
    return 0;
}

/* The sequence-wide part: nreg within the window (snapkv_count() never
 * passes it) and an mt19937 index the generator can hold. */
static int state_wide_check(const ov_block *st, const uint8_t *b, char *err, size_t errlen)
{
    uint32_t nreg = (uint32_t)policy_get_le(b + OV_STATE_WIDE, 4),
             idx = (uint32_t)policy_get_le(b + OV_STATE_RNG, 4);
    if (nreg > st->snap_w) {
        policy_set_err(err, errlen,
                       "ov_block state: %" PRIu32 " SnapKV scores registered exceed "
                       "snapkv_window %" PRIu32,
                       nreg, st->snap_w);
        return -1;
    }
    if (idx > 624) {
        policy_set_err(err, errlen, "ov_block state: mt19937 index %" PRIu32 " is beyond 624", idx);
        return -1;
    }
    return 0;
}

/* The tracked count against the length: *n receives it. A list holds at
 * most 2^32 - 1 tokens, start area included, which also bounds the
 * arithmetic; the exact length bounds the allocation by the bytes. */
static int state_len_check(const ov_block *st, const uint8_t *b, size_t len, size_t *n, char *err,
                           size_t errlen)
{
    uint64_t tracked = policy_get_le(b + OV_STATE_HEAD - 8, 8);
    if (tracked > (uint64_t)UINT32_MAX - st->start) {
        policy_set_err(err, errlen,
                       "ov_block state: %" PRIu64 " tracked tokens after a start area of %" PRIu32
                       " exceed a list's 2^32 - 1",
                       tracked, st->start);
        return -1;
    }
    uint64_t want = OV_STATE_HEAD + tracked * OV_STATE_TOKEN;
    if ((uint64_t)len != want) {
        policy_set_err(err, errlen,
                       "ov_block state: %zu bytes, but %" PRIu64 " tracked tokens take exactly "
                       "%" PRIu64,
                       len, tracked, want);
        return -1;
    }
    *n = (size_t)tracked;
    return 0;
}

/* Scores that layer_check() would have let in (finite) and counters as
 * layer_register() leaves them: each at least 1 (NORM_SUM divides by
 * them) and none above its predecessor (older tokens were scored at least
 * as often). */
static int state_tokens_check(const uint8_t *acc, const uint8_t *cnt, size_t n, char *err,
                              size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(policy_bits_f64(policy_get_le(acc + i * 8, 8)))) {
            policy_set_err(err, errlen, "ov_block state: score %zu is not finite", i);
            return -1;
        }
        uint64_t c = policy_get_le(cnt + i * 8, 8);
        if (c == 0 || (i > 0 && c > policy_get_le(cnt + (i - 1) * 8, 8))) {
            policy_set_err(err, errlen,
                           "ov_block state: counter %zu (%" PRIu64 ") is 0 or above the one "
                           "before it",
                           i, c);
            return -1;
        }
    }
    return 0;
}

/* Everything is checked and allocated before the layer is swapped in, so
 * a refusal leaves the state as it was. */
static int ov_import_layer(void *state, uint32_t layer, const void *buf, size_t len, char *err,
                           size_t errlen)
{
    ov_block *st = state;
    const uint8_t *b = buf;
    size_t n;
    if (layer >= st->layers) {
        policy_set_err(err, errlen, "ov_block state: layer %" PRIu32 " of %" PRIu32, layer,
                       st->layers);
        return -1;
    }
    if (state_head_check(st, layer, b, len, err, errlen) != 0 ||
        state_wide_check(st, b, err, errlen) != 0 ||
        state_len_check(st, b, len, &n, err, errlen) != 0)
        return -1;
    const uint8_t *acc = b + OV_STATE_HEAD, *cnt = acc + n * 8;
    if (state_tokens_check(acc, cnt, n, err, errlen) != 0)
        return -1;
    ov_layer L = {.len = n, .cap = n, .cnt_cap = n};
    L.acc = policy_array_copy(NULL, 0, n, sizeof *L.acc);
    L.cnt = policy_array_copy(NULL, 0, n, sizeof *L.cnt);
    if (L.acc == NULL || L.cnt == NULL) {
        free(L.acc);
        free(L.cnt);
        policy_set_err(err, errlen, "ov_block state: out of memory for %zu tokens", n);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        L.acc[i] = policy_bits_f64(policy_get_le(acc + i * 8, 8));
        L.cnt[i] = policy_get_le(cnt + i * 8, 8);
    }
    layer_free(&st->ly[layer]);
    st->ly[layer] = L;
    st->gen++; /* the sequence-wide part changes */
    st->nreg = (uint32_t)policy_get_le(b + OV_STATE_WIDE, 4);
    st->reg_nsnap = (uint32_t)policy_get_le(b + OV_STATE_WIDE + 4, 4);
    st->reg_step = policy_get_le(b + OV_STATE_WIDE + 8, 8);
    st->rng.idx = (uint32_t)policy_get_le(b + OV_STATE_RNG, 4);
    for (int i = 0; i < 624; i++)
        st->rng.mt[i] = (uint32_t)policy_get_le(b + OV_STATE_RNG + 4 + 4 * i, 4);
    return 0;
}

/* ---- describe ------------------------------------------------------------ */

static char *ov_describe(void *state, uint32_t layer)
{
    const ov_block *st = state;
    if (layer >= st->layers)
        return NULL;
    const ov_layer *L = &st->ly[layer];
    policy_text t = {0};
    policy_text_add(&t,
                    "{\"aggregation\":\"%s\",\"snapkv_registered\":%" PRIu32
                    ",\"tracked\":%zu,\"scores\":[",
                    st->norm_sum ? "norm_sum" : "sum", st->nreg, L->len);
    for (size_t i = 0; i < L->len; i++) {
        if (i > 0)
            policy_text_add(&t, ",");
        policy_text_double(&t, L->acc[i]);
    }
    policy_text_add(&t, "],\"counters\":[");
    for (size_t i = 0; st->norm_sum && i < L->len; i++)
        policy_text_add(&t, "%s%" PRIu64, i > 0 ? "," : "", L->cnt[i] + L->cnt_shift);
    policy_text_add(&t, "]}");
    return policy_text_finish(&t);
}

static const char *const ov_replay_ops[] = {"scores", "evict", "rotation", "state", NULL};

const policy_ops policy_ov_block = {
    .name = "ov_block",
    .summary = "OpenVINO GenAI eviction: start/evictable/recent areas, SUM or NORM_SUM scores "
               "with a SnapKV window, block eviction, KVCrush, key re-rotation",
    .params = ov_params,
    .nparams = OV_NPARAMS,
    .needs = POLICY_NEEDS_SCORE,
    .per_head = 0,
    .layers_concurrent = 1,
    .layers_concurrent_now = ov_layers_concurrent,
    .stats_in_place = 1,
    .create = ov_create,
    .step = ov_step,
    .describe = ov_describe,
    .destroy = ov_destroy,
    .replay_ops = ov_replay_ops,
    .replay = ov_block_replay,
    .save = ov_save,
    .restore = ov_restore,
    .discard = ov_discard,
    .export_layer = ov_export_layer,
    .import_layer = ov_import_layer,
};
