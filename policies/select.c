/*
 * select.c - the cut of the k lowest keys (select.h).
 *
 * A policy's lists hold up to a million tokens and a decision selects from
 * every list of every layer (32 × 8 lists of 32,768 tokens at Llama-3-8B
 * shape), so the selection must cost about a pass over the keys: a
 * comparison sort of each list was three quarters of a SnapKV-family
 * decision (issue 16 §1), and even a quickselect's in-place partition is a
 * chain of dependent loads and stores.
 *
 * Here each round takes two bounds from an evenly spaced sample, a few
 * standard deviations of the sample's rank estimate either side of the k-th
 * key; one counting pass says which side of them the k-th key lies on, and
 * a branch-free compaction keeps only that part (usually the keys between
 * the bounds, an eighth of the list or less). Counts and compaction look at
 * key values only, so equal keys cost nothing special. A round that would
 * keep everything (all keys between the bounds) narrows to the one sample
 * key instead, which always drops at least that key's copies. The sample
 * and the last few hundred keys go to a small quickselect (nth).
 */
#include "select.h"

#include <math.h>

#include "util.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

enum {
    SAMPLE = 256,   /* sample size; at most this many keys go to nth() directly */
    MARGIN = 24,    /* sample ranks either side of the estimate: ~3.5 sigma */
    MAX_ROUNDS = 64 /* then nth() on what is left (a guard; never seen) */
};

static void sift_down(uint64_t *a, size_t root, size_t n)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n)
            return;
        if (child + 1 < n && a[child] < a[child + 1])
            child++;
        if (a[root] >= a[child])
            return;
        uint64_t t = a[root];
        a[root] = a[child];
        a[child] = t;
        root = child;
    }
}

static void heap_sort(uint64_t *a, size_t n)
{
    for (size_t i = n / 2; i-- > 0;)
        sift_down(a, i, n);
    for (size_t end = n; end-- > 1;) {
        uint64_t t = a[0];
        a[0] = a[end];
        a[end] = t;
        sift_down(a, 0, end);
    }
}

/* Put the key of rank t (from 0) of a[0..n) at a[t], smaller or equal keys
 * before it, larger or equal after: Hoare's quickselect, median-of-3
 * pivots, heapsort when a range does not shrink fast enough. For the
 * sample and the last few hundred keys only. */
static void nth(uint64_t *a, size_t n, size_t t)
{
    size_t lo = 0, hi = n; /* the range holding rank t */
    for (int rounds = 0; hi - lo > 16; rounds++) {
        if (rounds > 40) {
            heap_sort(a + lo, hi - lo);
            return;
        }
        size_t m = lo + (hi - lo) / 2;
        uint64_t x = a[lo], y = a[m], z = a[hi - 1];
        uint64_t p = x < y ? (y < z ? y : x < z ? z : x) : (x < z ? x : y < z ? z : y);
        size_t i = lo, j = hi - 1;
        for (;;) { /* stop on equal keys on both sides: duplicates split evenly */
            while (a[i] < p)
                i++;
            while (a[j] > p)
                j--;
            if (i >= j)
                break;
            uint64_t tmp = a[i];
            a[i++] = a[j];
            a[j--] = tmp;
        }
        /* a[lo..j] <= p <= a[j+1..hi) */
        if (t <= j)
            hi = j + 1;
        else
            lo = j + 1;
    }
    for (size_t i = lo + 1; i < hi; i++) { /* insertion sort of the rest */
        uint64_t x = a[i];
        size_t k = i;
        for (; k > lo && a[k - 1] > x; k--)
            a[k] = a[k - 1];
        a[k] = x;
    }
}

/* Copy the keys of src[0..n) in [lo, hi] to dst, in order; returns how
 * many. dst may be src or before it. */
static size_t compact_scalar(uint64_t *dst, const uint64_t *src, size_t n, uint64_t lo, uint64_t hi)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = src[i];
        dst[m] = x; /* dst + m <= src + i: never ahead of the reads */
        m += (x >= lo) & (x <= hi);
    }
    return m;
}

#if defined(__x86_64__) && defined(__GNUC__)
/*
 * The same four keys at a time with AVX2: the keys that stay are moved to
 * the front of the vector by a permutation looked up by their 4-bit mask,
 * and all four lanes stored at keys + m (m <= i, so the store never
 * passes what is still to be read). A compiler does not vectorise a
 * compaction, and the scalar loop's dependent store address costs a cycle
 * or two a key; the sampled cut compacts every key of a list once.
 */
static const uint32_t compact_perm[16][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}, {2, 3, 0, 1, 4, 5, 6, 7},
    {0, 1, 2, 3, 4, 5, 6, 7}, {4, 5, 0, 1, 2, 3, 6, 7}, {0, 1, 4, 5, 2, 3, 6, 7},
    {2, 3, 4, 5, 0, 1, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}, {6, 7, 0, 1, 2, 3, 4, 5},
    {0, 1, 6, 7, 2, 3, 4, 5}, {2, 3, 6, 7, 0, 1, 4, 5}, {0, 1, 2, 3, 6, 7, 4, 5},
    {4, 5, 6, 7, 0, 1, 2, 3}, {0, 1, 4, 5, 6, 7, 2, 3}, {2, 3, 4, 5, 6, 7, 0, 1},
    {0, 1, 2, 3, 4, 5, 6, 7},
};

__attribute__((target("avx2"))) static size_t compact_avx2(uint64_t *keys, size_t n, uint64_t lo,
                                                           uint64_t hi)
{
    /* Unsigned order as signed order: the sign bit flipped on both sides. */
    const __m256i flip = _mm256_set1_epi64x((long long)(UINT64_C(1) << 63));
    const __m256i vlo = _mm256_xor_si256(_mm256_set1_epi64x((long long)lo), flip);
    const __m256i vhi = _mm256_xor_si256(_mm256_set1_epi64x((long long)hi), flip);
    size_t m = 0, i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(keys + i));
        __m256i xf = _mm256_xor_si256(x, flip);
        __m256i out = _mm256_or_si256(_mm256_cmpgt_epi64(vlo, xf), _mm256_cmpgt_epi64(xf, vhi));
        unsigned mask = (unsigned)_mm256_movemask_pd(_mm256_castsi256_pd(out)) ^ 15u;
        __m256i perm = _mm256_loadu_si256((const __m256i *)compact_perm[mask]);
        _mm256_storeu_si256((__m256i *)(keys + m), _mm256_permutevar8x32_epi32(x, perm));
        m += (size_t)__builtin_popcount(mask);
    }
    return m + compact_scalar(keys + m, keys + i, n - i, lo, hi);
}

/* Keep the keys in [lo, hi] at the front, in place; returns how many. */
static size_t compact(uint64_t *keys, size_t n, uint64_t lo, uint64_t hi)
{
    if (__builtin_cpu_supports("avx2"))
        return compact_avx2(keys, n, lo, hi);
    return compact_scalar(keys, keys, n, lo, hi);
}
#else
/* Keep the keys in [lo, hi] at the front, in place; returns how many. */
static size_t compact(uint64_t *keys, size_t n, uint64_t lo, uint64_t hi)
{
    return compact_scalar(keys, keys, n, lo, hi);
}
#endif

/* Bounds lo <= hi around the key of rank t of n, from a sample of SAMPLE
 * of them taken evenly (s[], reordered). */
static void sample_bounds(uint64_t *s, size_t n, size_t t, uint64_t *lo, uint64_t *hi,
                          uint64_t *mid)
{
    size_t est = (size_t)((double)t / (double)n * SAMPLE);
    est = est < SAMPLE ? est : SAMPLE - 1;
    size_t a = est > MARGIN ? est - MARGIN : 0;
    size_t b = est + MARGIN < SAMPLE ? est + MARGIN : SAMPLE - 1;
    /* Three ranks of the sample, each selected in what the last left. */
    nth(s, SAMPLE, a);
    nth(s + a, SAMPLE - a, est - a);
    nth(s + est, SAMPLE - est, b - est);
    *lo = s[a];
    *mid = s[est];
    *hi = s[b];
}

/* The same from keys[0..n), n >= SAMPLE. */
static void bounds(const uint64_t *keys, size_t n, size_t t, uint64_t *lo, uint64_t *hi,
                   uint64_t *mid)
{
    uint64_t s[SAMPLE];
    size_t stride = n / SAMPLE;
    for (size_t j = 0; j < SAMPLE; j++)
        s[j] = keys[j * stride];
    sample_bounds(s, n, t, lo, hi, mid);
}

/* Which keys of n to keep for rank t, given bounds lo <= hi: below lo,
 * between them (band), or above hi. Updates n (kept count), t (rank in
 * what is kept) and *below (keys dropped below what is kept). Returns 1
 * when the band is one value, which is then the k-th key. */
POLICY_HOT static int narrow(uint64_t *keys, size_t *n, size_t *t, size_t *below, uint64_t lo,
                             uint64_t hi)
{
    size_t lt = 0, le = 0;
    for (size_t i = 0; i < *n; i++) {
        lt += keys[i] < lo;
        le += keys[i] <= hi;
    }
    if (*t < lt) {
        *n = compact(keys, *n, 0, lo - 1); /* lt > 0: some key < lo, so lo > 0 */
        return 0;
    }
    if (*t >= le) {
        *n = compact(keys, *n, hi + 1, UINT64_MAX); /* le < n: hi < UINT64_MAX */
        *t -= le;
        *below += le;
        return 0;
    }
    *t -= lt;
    *below += lt;
    if (lo == hi)
        return 1;
    *n = compact(keys, *n, lo, hi);
    return 0;
}

policy_cut policy_select_cut(uint64_t *keys, size_t n, size_t k)
{
    if (k == 0)
        return (policy_cut){0, 0};
    if (k >= n)
        return (policy_cut){UINT64_MAX, n};
    size_t t = k - 1, below = 0;
    for (int round = 0; n > SAMPLE && round < MAX_ROUNDS; round++) {
        uint64_t lo, hi, mid;
        bounds(keys, n, t, &lo, &hi, &mid);
        size_t before = n;
        if (narrow(keys, &n, &t, &below, lo, hi))
            return (policy_cut){lo, k - below};
        if (n == before) /* every key between the bounds: split at mid */
            if (narrow(keys, &n, &t, &below, mid, mid))
                return (policy_cut){mid, k - below};
    }
    nth(keys, n, t);
    uint64_t v = keys[t];
    size_t smaller = 0; /* keys[0..t) are <= v: count those below it */
    for (size_t i = 0; i < t; i++)
        smaller += keys[i] < v;
    return (policy_cut){v, k - (below + smaller)};
}

/* The key of entry i of a row, as policy_select_cut_rows() defines it. */
static inline uint64_t score_key(const double *score, const uint8_t *forced,
                                 const policy_score_keys *kd, size_t i)
{
    uint64_t key = policy_key(kd->sign * score[i]);
    if (forced == NULL)
        return key;
    uint64_t m = 0 - (uint64_t)(forced[i] != 0);
    return (key & ~m) | (kd->forced_key & m);
}

/* Every key of a row in tmp[], in one vectorised pass that also counts
 * those below lo (*below) and those up to hi (returned). Two loops, so
 * that neither branches on `forced`. */
POLICY_HOT static size_t keys_of_row(const double *score, const uint8_t *forced, double sign,
                                     uint64_t forced_key, size_t n, uint64_t lo, uint64_t hi,
                                     uint64_t *tmp, size_t *below)
{
    size_t lt = 0, le = 0;
    if (forced == NULL) {
        for (size_t i = 0; i < n; i++) {
            uint64_t key = policy_key(sign * score[i]);
            tmp[i] = key;
            lt += key < lo;
            le += key <= hi;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint64_t m = 0 - (uint64_t)(forced[i] != 0);
            uint64_t key = (policy_key(sign * score[i]) & ~m) | (forced_key & m);
            tmp[i] = key;
            lt += key < lo;
            le += key <= hi;
        }
    }
    *below = lt;
    return le;
}

/* The keys of the rows' entries flattened (row 0 first) into tmp[], with
 * the counts below lo (*below) and up to hi (returned). */
static size_t keys_of_rows(const double *const *score, const uint32_t *len, uint32_t rows,
                           const policy_score_keys *kd, uint64_t lo, uint64_t hi, uint64_t *tmp,
                           size_t *below)
{
    size_t le = 0, lt = 0, at = 0;
    for (uint32_t r = 0; r < rows; r++) {
        size_t row_below;
        le += keys_of_row(score[r], kd->forced != NULL ? kd->forced[r] : NULL, kd->sign,
                          kd->forced_key, len[r], lo, hi, tmp + at, &row_below);
        lt += row_below;
        at += len[r];
    }
    *below = lt;
    return le;
}

/* SAMPLE keys taken evenly from the flattened rows (n entries in all). */
static void sample_rows(const double *const *score, const uint32_t *len,
                        const policy_score_keys *kd, size_t n, uint64_t *s)
{
    size_t stride = n / SAMPLE, start = 0;
    uint32_t r = 0;
    for (size_t j = 0; j < SAMPLE; j++) {
        size_t at = j * stride;
        while (at - start >= len[r]) /* at < n: a row holds it */
            start += len[r++];
        s[j] = score_key(score[r], kd->forced != NULL ? kd->forced[r] : NULL, kd, at - start);
    }
}

policy_cut policy_select_cut_rows(const double *const *score, const uint32_t *len, uint32_t rows,
                                  const policy_score_keys *kd, size_t k, uint64_t *tmp)
{
    size_t n = 0;
    for (uint32_t r = 0; r < rows; r++)
        n += len[r];
    if (k == 0)
        return (policy_cut){0, 0};
    if (k >= n)
        return (policy_cut){UINT64_MAX, n};
    if (n <= 4 * SAMPLE) {
        keys_of_rows(score, len, rows, kd, 0, 0, tmp, &(size_t){0});
        return policy_select_cut(tmp, n, k);
    }
    /* The sample's bounds first, so that the pass that makes the keys also
     * counts them against the bounds: one pass fewer than
     * policy_select_cut's first round. */
    size_t t = k - 1, lt;
    uint64_t s[SAMPLE], lo, hi, mid;
    sample_rows(score, len, kd, n, s);
    sample_bounds(s, n, t, &lo, &hi, &mid);
    size_t le = keys_of_rows(score, len, rows, kd, lo, hi, tmp, &lt);
    if (t < lt || t >= le) /* the sample missed */
        return policy_select_cut(tmp, n, k);
    if (lo == hi)
        return (policy_cut){lo, k - lt};
    size_t m = compact(tmp, n, lo, hi); /* le - lt keys */
    if (k - lt < m)
        return policy_select_cut(tmp, m, k - lt);
    /* Every key of the band is chosen: the cut is its largest, all its
     * copies (policy_select_cut would answer "everything"). */
    uint64_t v = tmp[0];
    for (size_t i = 1; i < m; i++)
        v = tmp[i] > v ? tmp[i] : v;
    size_t ties = 0;
    for (size_t i = 0; i < m; i++)
        ties += tmp[i] == v;
    return (policy_cut){v, ties};
}

enum { TIE_BLOCK = 256 };

/* Whether candidate i is among the cut's keys and equal to it. */
static inline int is_tie(const double *score, double sign, const uint8_t *in, uint8_t want,
                         uint64_t cut, size_t i)
{
    int among = in == NULL || (in[i] != 0) == want;
    return among & (policy_key(sign * score[i]) == cut);
}

POLICY_HOT void policy_cut_mark(policy_cut *c, const double *score, double sign, const uint8_t *in,
                                int in_value, size_t n, int reverse, uint8_t *chosen)
{
    uint64_t cut = c->key;
    uint8_t want = in_value != 0;
    if (in == NULL)
        for (size_t i = 0; i < n; i++)
            chosen[i] = policy_key(sign * score[i]) < cut;
    else
        for (size_t i = 0; i < n; i++)
            chosen[i] = (uint8_t)(((in[i] != 0) == want) & (policy_key(sign * score[i]) < cut));
    /* The ties, in blocks: a vectorised count finds the blocks that hold
     * any, and only those are searched in tie order. */
    for (size_t b = 0; b < n && c->ties > 0; b += TIE_BLOCK) {
        size_t m = n - b < TIE_BLOCK ? n - b : TIE_BLOCK;
        size_t lo = reverse ? n - b - m : b, hits = 0;
        for (size_t i = lo; i < lo + m; i++)
            hits += is_tie(score, sign, in, want, cut, i);
        for (size_t j = 0; j < m && hits > 0 && c->ties > 0; j++) {
            size_t i = reverse ? lo + m - 1 - j : lo + j;
            if (is_tie(score, sign, in, want, cut, i)) {
                chosen[i] = 1;
                c->ties--;
                hits--;
            }
        }
    }
}

/* The minimum (want_max 0) or maximum (1) of x[0..n), n >= 1. One running
 * extreme waits on the one before it (a minpd's latency a vector, a
 * scalar maxsd's an element: gcc does not vectorise `m = x > m ? x : m`
 * on doubles, for the sake of NaN and -0.0); four independent vectors of
 * them keep the unit busy. The extreme is the same in any order (-0.0 and
 * +0.0 aside, which the callers treat as equal). GCC's vector extension,
 * so that each clone (POLICY_HOT) gets its own width. */
typedef double min_vec __attribute__((vector_size(32)));
typedef long long min_mask __attribute__((vector_size(32)));
#define MIN_VEC (sizeof(min_vec) / sizeof(double))
#define MIN_LANES (4 * MIN_VEC)

static inline double extreme_of(const double *x, size_t n, int want_max)
{
    double m = x[0];
    size_t i = 0;
    if (n >= MIN_LANES) {
        min_vec a[4], v;
        for (int j = 0; j < 4; j++)
            memcpy(&a[j], x + j * MIN_VEC, sizeof a[j]);
        for (i = MIN_LANES; i + MIN_LANES <= n; i += MIN_LANES)
            for (int j = 0; j < 4; j++) {
                memcpy(&v, x + i + j * MIN_VEC, sizeof v);
                min_mask win = want_max ? v > a[j] : v < a[j]; /* all ones where v wins */
                a[j] = (min_vec)(((min_mask)v & win) | ((min_mask)a[j] & ~win));
            }
        for (int j = 0; j < 4; j++)
            for (size_t k = 0; k < MIN_VEC; k++)
                m = (want_max ? a[j][k] > m : a[j][k] < m) ? a[j][k] : m;
    }
    for (; i < n; i++)
        m = (want_max ? x[i] > m : x[i] < m) ? x[i] : m;
    return m;
}

static inline double min_of(const double *x, size_t n)
{
    return extreme_of(x, n, 0);
}

/* select.h */
POLICY_HOT double policy_max(const double *x, size_t n)
{
    return n > 0 ? extreme_of(x, n, 1) : -INFINITY;
}

/* Whether x[0..MIN_LANES) holds m: four vector compares, or'd. */
#define MIN_SEARCH_BLOCK MIN_LANES

static inline int block_has(const double *x, double m)
{
    min_vec mv = (min_vec){0} + m, v;
    min_mask any = {0};
    for (int j = 0; j < 4; j++) {
        memcpy(&v, x + j * MIN_VEC, sizeof v);
        any |= v == mv; /* -0.0 == +0.0 */
    }
    long long hit = 0;
    for (size_t k = 0; k < MIN_VEC; k++)
        hit |= any[k];
    return hit != 0;
}

/* select.h */
POLICY_HOT size_t policy_first_min(const double *x, size_t n)
{
    double m = min_of(x, n);
    size_t i = 0;
    while (i + MIN_SEARCH_BLOCK <= n && !block_has(x + i, m))
        i += MIN_SEARCH_BLOCK;
    while (x[i] != m)
        i++;
    return i;
}

/* Sums a block at a time: 4 KiB, in L1. */
#define SUM_BLOCK 512

static inline void sum_block(double *restrict out, const double *restrict x,
                             const float *restrict add, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = x[i] + (double)add[i];
}

/* select.h */
POLICY_HOT void policy_min_sum_offer(policy_min_sum *m, const double *x, const float *add,
                                     size_t from, size_t to)
{
    double buf[SUM_BLOCK];
    for (size_t b = from; b < to; b += SUM_BLOCK) {
        size_t len = to - b < SUM_BLOCK ? to - b : SUM_BLOCK;
        sum_block(buf, x + b, add + b, len);
        double bm = min_of(buf, len);
        if (!m->any || bm < m->min)
            *m = (policy_min_sum){.min = bm, .at = b, .len = len, .any = 1};
    }
}

/* select.h */
POLICY_HOT size_t policy_min_sum_first(const policy_min_sum *m, const double *x, const float *add)
{
    double buf[SUM_BLOCK];
    sum_block(buf, x + m->at, add + m->at, m->len);
    for (size_t i = 0; i < m->len; i++)
        if (buf[i] == m->min)
            return m->at + i;
    return m->at; /* a NaN among the sums (none should be) */
}

/* select.h */
POLICY_HOT size_t policy_last_min(const double *x, size_t n)
{
    double m = min_of(x, n);
    size_t end = n; /* x[end..n) holds no m */
    while (end >= MIN_SEARCH_BLOCK && !block_has(x + end - MIN_SEARCH_BLOCK, m))
        end -= MIN_SEARCH_BLOCK;
    size_t i = end - 1;
    while (x[i] != m)
        i--;
    return i;
}
