/*
 * test_policy_select.c - the top-k selection every policy uses
 * (policies/select.h) and the SnapKV pooling's blocked path.
 *
 * The selection is checked against an independent reference, a full qsort
 * by (key, place in tie order): the chosen set must be the sort's first k,
 * with ties taken in index order or in reverse (policy_cut_mark). Cases:
 * hand vectors with ties, k = 0, k = n, k > n, n = 0, candidates outside
 * the cut (in / in_value), sign -1 for a top-k; keys that
 * are NaN, ±0 and ±inf; seeded random lists large enough to take the
 * sampled rounds, with few distinct keys (many ties), one key almost
 * everywhere, sorted, reversed and constant inputs; and the key mapping's
 * order against the doubles' own.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy_harness.h"
#include "select.h"
#include "snapkv_family.h"

/* ---- the reference: sort everything ---- */

typedef struct keyed {
    uint64_t key;
    size_t pos; /* place in tie order */
} keyed;

static int cmp_keyed(const void *pa, const void *pb)
{
    const keyed *a = pa, *b = pb;
    if (a->key != b->key)
        return a->key < b->key ? -1 : 1;
    return (a->pos > b->pos) - (a->pos < b->pos);
}

/* chosen[i] = 1 for the k first of score[0..n) (keys policy_key(score)) by
 * the cut, ties in index order (or reverse index order when `reverse`). */
static void cut_choose(const double *score, size_t n, size_t k, int reverse, uint8_t *chosen)
{
    uint64_t *work = malloc((n ? n : 1) * sizeof *work);
    assert_non_null(work);
    for (size_t i = 0; i < n; i++)
        work[i] = policy_key(score[i]);
    policy_cut cut = policy_select_cut(work, n, k);
    policy_cut_mark(&cut, score, 1.0, NULL, 1, n, reverse, chosen);
    if (k < n)
        assert_int_equal(cut.ties, 0); /* every tie it promised was taken */
    free(work);
}

/* Select k of score[0..n) and check the set against a full stable sort. */
static void check_cut(const double *score, size_t n, size_t k, int reverse)
{
    keyed *sorted = malloc((n ? n : 1) * sizeof *sorted);
    uint8_t *want = calloc(n ? n : 1, 1), *got = malloc(n ? n : 1);
    assert_non_null(sorted);
    assert_non_null(want);
    assert_non_null(got);
    for (size_t i = 0; i < n; i++)
        sorted[i] = (keyed){policy_key(score[i]), reverse ? n - 1 - i : i};
    qsort(sorted, n, sizeof *sorted, cmp_keyed);
    for (size_t j = 0; j < k && j < n; j++)
        want[reverse ? n - 1 - sorted[j].pos : sorted[j].pos] = 1;
    cut_choose(score, n, k, reverse, got);
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("n=%zu k=%zu reverse=%d: entry %zu (%g) %s, the sort says %s", n, k, reverse,
                     i, score[i], got[i] ? "chosen" : "not chosen", want[i] ? "chosen" : "not");
    free(sorted);
    free(want);
    free(got);
}

/* ---- hand vectors ---- */

/* The indices of the k chosen of score[0..n), as text. */
static void chosen(const double *score, size_t n, size_t k, int reverse, char *buf, size_t len)
{
    uint8_t pick[16];
    assert_true(n <= 16);
    cut_choose(score, n, k, reverse, pick);
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n; i++)
        if (pick[i])
            o += (size_t)snprintf(buf + o, len - o, "%s%zu", o ? "," : "", i);
}

static void test_ties_in_visit_order(void **s)
{
    (void)s;
    char buf[128];
    /* Three-way tie at the boundary: the lower indices win it... */
    const double key[6] = {0.5, 0.2, 0.5, 0.1, 0.5, 0.9};
    chosen(key, 6, 3, 0, buf, sizeof buf);
    assert_string_equal(buf, "0,1,3"); /* 0.1, 0.2, then the first 0.5 */
    chosen(key, 6, 4, 0, buf, sizeof buf);
    assert_string_equal(buf, "0,1,2,3");
    /* ...or, visited in reverse, the higher ones (tova's eviction). */
    chosen(key, 6, 3, 1, buf, sizeof buf);
    assert_string_equal(buf, "1,3,4");
    /* Top-k by score as the policies ask for it: key -score. */
    const double neg[5] = {-0.3, -0.3, -0.7, -0.3, -0.1};
    chosen(neg, 5, 2, 0, buf, sizeof buf);
    assert_string_equal(buf, "0,2"); /* 0.7, then the lowest-index 0.3 */
}

static void test_k_edges(void **s)
{
    (void)s;
    char buf[128];
    const double key[4] = {3, 1, 2, 0};
    chosen(key, 4, 0, 0, buf, sizeof buf);
    assert_string_equal(buf, "");
    chosen(key, 4, 4, 0, buf, sizeof buf);
    assert_string_equal(buf, "0,1,2,3");
    chosen(key, 4, 9, 0, buf, sizeof buf); /* k > n: everything */
    assert_string_equal(buf, "0,1,2,3");
    chosen(key, 4, 1, 0, buf, sizeof buf);
    assert_string_equal(buf, "3");
    policy_cut none = policy_select_cut(NULL, 0, 3); /* n = 0 touches nothing */
    uint8_t one;
    policy_cut_mark(&none, (const double[]){1.0}, 1.0, NULL, 1, 1, 0, &one);
    assert_int_equal(one, 1);
    /* Candidates outside the cut (in[i] != in_value) are never chosen and
     * use up no tie; sign -1 makes it a top-k. */
    const double sc[5] = {1.0, 2.0, 2.0, 2.0, 0.5};
    const uint8_t in[5] = {1, 0, 1, 1, 1};
    uint64_t k4[4] = {policy_key(-1.0), policy_key(-2.0), policy_key(-2.0), policy_key(-0.5)};
    policy_cut c = policy_select_cut(k4, 4, 1); /* the best of {0, 2, 3, 4}: one 2.0 */
    uint8_t pick[5];
    policy_cut_mark(&c, sc, -1.0, in, 1, 5, 0, pick);
    assert_memory_equal(pick, ((const uint8_t[]){0, 0, 1, 0, 0}), 5);
    c = policy_select_cut(k4, 4, 1);
    policy_cut_mark(&c, sc, -1.0, in, 1, 5, 1, pick); /* ties from the top */
    assert_memory_equal(pick, ((const uint8_t[]){0, 0, 0, 1, 0}), 5);
    uint64_t k1[1] = {policy_key(-2.0)}; /* in_value 0: only entry 1 */
    c = policy_select_cut(k1, 1, 1);
    policy_cut_mark(&c, sc, -1.0, in, 0, 5, 0, pick);
    assert_memory_equal(pick, ((const uint8_t[]){0, 1, 0, 0, 0}), 5);
}

static void test_special_keys(void **s)
{
    (void)s;
    char buf[128];
    /* NaN (either sign) after +inf; -0.0 and +0.0 are one key (ties by
     * index); -inf first. */
    const double key[7] = {NAN, INFINITY, -0.0, 0.0, -INFINITY, -NAN, 1.0};
    chosen(key, 7, 1, 0, buf, sizeof buf);
    assert_string_equal(buf, "4");
    chosen(key, 7, 2, 0, buf, sizeof buf);
    assert_string_equal(buf, "2,4");
    chosen(key, 7, 3, 0, buf, sizeof buf);
    assert_string_equal(buf, "2,3,4");
    chosen(key, 7, 5, 0, buf, sizeof buf);
    assert_string_equal(buf, "1,2,3,4,6");
    chosen(key, 7, 6, 0, buf, sizeof buf);
    assert_string_equal(buf, "0,1,2,3,4,6"); /* the NaNs last, ties by index */
    assert_true(policy_key(-0.0) == policy_key(0.0));
    assert_true(policy_key(NAN) == policy_key(-NAN));
}

/* The key mapping keeps the order of doubles: a < b iff key(a) < key(b). */
static void test_key_order(void **s)
{
    (void)s;
    uint64_t seed = 11;
    const double fixed[] = {-INFINITY, -1e308, -1.0, -4.9e-324, -0.0,  0.0,
                            4.9e-324,  1e-300, 0.25, 1.0,       1e308, INFINITY};
    size_t nf = sizeof fixed / sizeof fixed[0];
    for (size_t a = 0; a < nf; a++)
        for (size_t b = 0; b < nf; b++)
            assert_int_equal(fixed[a] < fixed[b], policy_key(fixed[a]) < policy_key(fixed[b]));
    for (int t = 0; t < 100000; t++) {
        uint64_t ua = ph_rand(&seed), ub = ph_rand(&seed);
        double a, b;
        memcpy(&a, &ua, sizeof a);
        memcpy(&b, &ub, sizeof b);
        if (a != a || b != b)
            continue;
        assert_int_equal(a < b, policy_key(a) < policy_key(b));
        assert_int_equal(a == b, policy_key(a) == policy_key(b));
    }
}

/* ---- seeded random and structured lists against the full sort ---- */

typedef enum shape { RANDOM, FEW_KEYS, TWO_KEYS, ASCENDING, DESCENDING, CONSTANT, ORGAN } shape;

static double *make_list(shape sh, size_t n, uint64_t *seed)
{
    double *x = malloc((n ? n : 1) * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n; i++) {
        switch (sh) {
        case RANDOM:
            x[i] = ph_uniform(seed, -1, 1);
            break;
        case FEW_KEYS:
            x[i] = (double)ph_below(seed, 7) / 4;
            break;
        case TWO_KEYS: /* one value almost everywhere: the sample sees nothing else */
            x[i] = ph_below(seed, 1000) == 0 ? 1.0 : 0.5;
            break;
        case ASCENDING:
            x[i] = (double)i;
            break;
        case DESCENDING:
            x[i] = -(double)i;
            break;
        case CONSTANT:
            x[i] = 0.5;
            break;
        case ORGAN:
            x[i] = (double)(i < n / 2 ? i : n - i);
            break;
        }
    }
    return x;
}

/* check(x, n, seed) on every shape at every size, from `seed`. */
static void each_list(uint64_t seed, void (*check)(const double *x, size_t n, uint64_t *seed))
{
    const size_t sizes[] = {1, 2, 3, 17, 255, 256, 257, 1000, 5000, 40000};
    for (shape sh = RANDOM; sh <= ORGAN; sh++)
        for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; a++) {
            double *x = make_list(sh, sizes[a], &seed);
            check(x, sizes[a], &seed);
            free(x);
        }
}

static void cuts_against_sort(const double *x, size_t n, uint64_t *seed)
{
    const size_t ks[] = {0, 1, n / 4, n / 2, n - n / 4, n - 1, n, n + 1};
    for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++)
        check_cut(x, n, ks[b], (int)(b & 1));
    for (int t = 0; t < 3; t++)
        check_cut(x, n, ph_below(seed, (uint32_t)n + 1), t & 1);
}

/* policy_select_cut_rows against the sort of the keys it defines, ties in
 * flattened index order: x[0..n) cut into `rows` rows (the last ones
 * possibly empty), forced NULL or one flag an entry. */
static void check_cut_rows(const double *x, const uint8_t *forced, size_t n, uint32_t rows,
                           size_t k, double sign, uint64_t forced_key)
{
    keyed *sorted = malloc((n ? n : 1) * sizeof *sorted);
    uint64_t *tmp = malloc((n ? n : 1) * sizeof *tmp);
    uint8_t *want = calloc(n ? n : 1, 1);
    assert_non_null(sorted);
    assert_non_null(tmp);
    assert_non_null(want);
    for (size_t i = 0; i < n; i++)
        sorted[i] = (keyed){forced != NULL && forced[i] ? forced_key : policy_key(sign * x[i]), i};
    qsort(sorted, n, sizeof *sorted, cmp_keyed);
    for (size_t j = 0; j < k && j < n; j++)
        want[sorted[j].pos] = 1;
    const double *row[4];
    const uint8_t *row_forced[4];
    uint32_t len[4], at = 0;
    assert_true(rows <= 4);
    for (uint32_t r = 0; r < rows; r++) {
        len[r] = r + 1 < rows ? (uint32_t)(n - at) / 2 : (uint32_t)(n - at);
        row[r] = x + at;
        row_forced[r] = forced != NULL ? forced + at : NULL;
        at += len[r];
    }
    policy_score_keys kd = {sign, forced != NULL ? row_forced : NULL, forced_key};
    policy_cut cut = policy_select_cut_rows(row, len, rows, &kd, k, tmp);
    size_t ties = cut.ties;
    for (size_t i = 0; i < n; i++) {
        uint64_t key = forced != NULL && forced[i] ? forced_key : policy_key(sign * x[i]);
        int got = key < cut.key || (key == cut.key && ties > 0);
        if (key == cut.key && ties > 0)
            ties--;
        if (got != want[i])
            fail_msg("n=%zu rows=%u k=%zu sign=%g forced=%s (key %llx): entry %zu (%g) %s, the "
                     "sort says %s",
                     n, rows, k, sign, forced ? "yes" : "no", (unsigned long long)forced_key, i,
                     x[i], got ? "chosen" : "not chosen", want[i] ? "chosen" : "not");
    }
    if (k < n)
        assert_int_equal(ties, 0);
    free(sorted);
    free(tmp);
    free(want);
}

static void cuts_by_rows(const double *x, size_t n, uint64_t *seed)
{
    uint8_t *forced = malloc(n);
    assert_non_null(forced);
    size_t nf = 0;
    for (size_t i = 0; i < n; i++)
        nf += forced[i] = ph_below(seed, 10) == 0;
    const size_t ks[] = {0, 1, n / 4, n / 2, n - n / 4, n - 1, n, n + 1, nf, nf + 1, n - nf};
    for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
        uint32_t rows = 1 + (uint32_t)(b % 4);
        double sign = b & 1 ? -1.0 : 1.0;
        check_cut_rows(x, NULL, n, rows, ks[b], sign, 0);
        check_cut_rows(x, forced, n, rows, ks[b], -sign, 0);
        check_cut_rows(x, forced, n, rows, ks[b], sign, UINT64_MAX);
    }
    free(forced);
}

/* Distinct ascending keys, every k: the sampled bounds' every outcome
 * (the cut inside the band, at its last key, and the sample missing). */
static void test_cut_rows_every_k(void **s)
{
    (void)s;
    enum { N = 3000 };
    static double x[N];
    static uint64_t tmp[N];
    for (size_t i = 0; i < N; i++)
        x[i] = (double)i * 0.25 - 100;
    const double *row = x;
    uint32_t len = N;
    policy_score_keys up_keys = {1.0, NULL, 0}, down_keys = {-1.0, NULL, 0};
    for (size_t k = 1; k < N; k++) {
        policy_cut up = policy_select_cut_rows(&row, &len, 1, &up_keys, k, tmp);
        policy_cut down = policy_select_cut_rows(&row, &len, 1, &down_keys, k, tmp);
        if (up.key != policy_key(x[k - 1]) || up.ties != 1 || down.key != policy_key(-x[N - k]) ||
            down.ties != 1)
            fail_msg("k=%zu: cuts (%llx, %zu) and (%llx, %zu)", k, (unsigned long long)up.key,
                     up.ties, (unsigned long long)down.key, down.ties);
    }
}

static void test_cut_rows(void **s)
{
    (void)s;
    each_list(77, cuts_by_rows);
}

static void test_against_sort(void **s)
{
    (void)s;
    each_list(2026, cuts_against_sort);
}

/* policy_first_min (policy_last_min) is the cut of k = 1 in index order
 * (reverse order). */
static void min_against_cut(const double *x, size_t n, uint64_t *seed)
{
    (void)seed;
    uint8_t *got = malloc(n);
    assert_non_null(got);
    for (int reverse = 0; reverse < 2; reverse++) {
        cut_choose(x, n, 1, reverse, got);
        size_t min = reverse ? policy_last_min(x, n) : policy_first_min(x, n);
        for (size_t i = 0; i < n; i++)
            if (got[i] != (i == min))
                fail_msg("n=%zu reverse=%d: %s_min says %zu, the cut %s %zu", n, reverse,
                         reverse ? "last" : "first", min, got[i] ? "chooses" : "does not choose",
                         i);
    }
    free(got);
}

/* policy_max is the largest entry, whatever the length's remainder. */
static void max_against_loop(const double *x, size_t n, uint64_t *seed)
{
    (void)seed;
    for (size_t m = n > 40 ? n - 40 : 0; m <= n; m++) {
        double want = -INFINITY;
        for (size_t i = 0; i < m; i++)
            want = x[i] > want ? x[i] : want;
        if (policy_max(x, m) != want)
            fail_msg("n=%zu: policy_max %g, a loop %g", m, policy_max(x, m), want);
    }
}

/* policy_min_sum_offer / _first, the list offered whole and in random
 * parts (as h2o's pass offers it), is policy_first_min of the sums
 * written out: an addend that is often zero of either sign (ties across
 * blocks) or an eighth. */
static void min_sum_against_written(const double *x, size_t n, uint64_t *seed)
{
    float *add = malloc(n * sizeof *add);
    double *sum = malloc(n * sizeof *sum);
    assert_non_null(add);
    assert_non_null(sum);
    for (size_t i = 0; i < n; i++) {
        uint32_t r = ph_below(seed, 4);
        add[i] = r == 0 ? -0.0f : r == 1 ? 0.0f : (float)r * 0.125f;
        sum[i] = x[i] + (double)add[i];
    }
    size_t want = policy_first_min(sum, n);
    for (int parts = 0; parts < 2; parts++) {
        policy_min_sum m = {0};
        for (size_t from = 0; from < n;) {
            size_t len = parts ? 1 + ph_below(seed, 700) : n;
            size_t to = n - from < len ? n : from + len;
            policy_min_sum_offer(&m, x, add, from, to);
            from = to;
        }
        size_t got = policy_min_sum_first(&m, x, add);
        if (got != want)
            fail_msg("n=%zu (%s): the offers' first minimum %zu, the written sums' %zu", n,
                     parts ? "in parts" : "whole", got, want);
    }
    free(add);
    free(sum);
}

/* Every shape and size, and zeros of both signs (equal). */
static void test_first_min(void **s)
{
    (void)s;
    each_list(7, min_against_cut);
    each_list(9, min_sum_against_written);
    each_list(8, max_against_loop);
    const double zeros[] = {1.0, 0.0, -0.0, 2.0, -0.0};
    assert_int_equal(policy_first_min(zeros, 5), 1);
    assert_int_equal(policy_last_min(zeros, 5), 4);
    const double negzero[] = {3.0, -0.0, 0.0, -1e-300};
    assert_int_equal(policy_first_min(negzero, 4), 3);
}

/* ---- the SnapKV pool's blocked interior gives the naive loop's bits ---- */

/* Outputs of any magnitude: the pool divides by the kernel with a multiply
 * and two FMAs (Markstein's correction), which must give the bits of a
 * division for every finite sum. */
static void test_pool_division(void **s)
{
    (void)s;
    enum { N = 100000 };
    static double in[N], out[N];
    uint64_t seed = 12;
    const uint32_t kernels[] = {3, 5, 7, 9, 11, 25, 63};
    for (size_t b = 0; b < sizeof kernels / sizeof kernels[0]; b++) {
        uint32_t k = kernels[b], r = k / 2;
        for (size_t i = 0; i < N; i++)
            in[i] = ldexp(ph_uniform(&seed, 0, 1), -(int)ph_below(&seed, 900) + 60);
        snapkv_pool(in, N, k, SNAPKV_POOL_AVG, out);
        for (size_t i = r; i + r < N; i++) {
            double sum = 0;
            for (size_t j = i - r; j <= i + r; j++)
                sum += in[j];
            double want = sum / k;
            if (memcmp(&want, &out[i], sizeof want) != 0)
                fail_msg("k=%u i=%zu: %a, a division gives %a", k, i, out[i], want);
        }
    }
}

static void test_pool_bits(void **s)
{
    (void)s;
    uint64_t seed = 5;
    const size_t sizes[] = {1, 4, 5, 6, 11, 512, 513, 1037, 3000};
    const uint32_t kernels[] = {1, 3, 5, 7, 9};
    static double in[3000], out[3000];
    for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; a++)
        for (size_t b = 0; b < sizeof kernels / sizeof kernels[0]; b++) {
            size_t n = sizes[a];
            uint32_t k = kernels[b], r = k / 2;
            for (size_t i = 0; i < n; i++)
                in[i] = ph_uniform(&seed, -1, 1) * 1e-3;
            snapkv_pool(in, n, k, SNAPKV_POOL_AVG, out);
            for (size_t i = 0; i < n; i++) {
                size_t lo = i >= r ? i - r : 0, hi = i + r < n ? i + r : n - 1;
                double sum = 0;
                for (size_t j = lo; j <= hi; j++)
                    sum += in[j];
                double want = sum / k;
                if (memcmp(&want, &out[i], sizeof want) != 0 && !(want == 0 && out[i] == 0))
                    fail_msg("n=%zu k=%u i=%zu: %.17g, naive %.17g", n, k, i, out[i], want);
            }
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ties_in_visit_order), cmocka_unit_test(test_k_edges),
        cmocka_unit_test(test_special_keys),        cmocka_unit_test(test_key_order),
        cmocka_unit_test(test_against_sort),        cmocka_unit_test(test_pool_bits),
        cmocka_unit_test(test_first_min),           cmocka_unit_test(test_cut_rows),
        cmocka_unit_test(test_cut_rows_every_k),    cmocka_unit_test(test_pool_division),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
