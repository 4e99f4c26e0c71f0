/*
 * select.h - top-k selection without a sort, for every policy that keeps or
 * evicts the k best or worst tokens of a list (policy-internal; not part of
 * policy.h's interface).
 *
 * A policy maps each candidate's score to a key (policy_key) whose order is
 * the order it needs (lower keys first), and asks for the cut of the k
 * first: the keys below the cut's key are chosen, and of the keys equal to
 * it the first `ties` in the policy's tie order. policy_cut_mark then
 * visits the candidates once more, in tie order, and marks the chosen. So
 * the selection looks at 8-byte keys only, equal keys need no tie-breaking
 * id, and the chosen set is exactly the first k of a stable sort by key in
 * tie order, whatever the selection's own order.
 *
 * How the policies encode their rules (POLICIES.md "Common notation"):
 *   top-k, keep higher score, ties to the lower index:
 *     key policy_key(-score) (sign -1), visit in index order;
 *   bottom-k, evict lower score, ties to the lower index:
 *     key policy_key(score) (sign 1), visit in index order;
 *   bottom-k, ties to the higher index: visit in reverse index order;
 *   lists flattened head-major (ties to the lower head, then the lower
 *   index): visit head by head, one policy_cut_mark per head.
 * Negating a double is exact, so "-score" loses nothing.
 *
 * Keys: -0.0 equals +0.0 (as the == of doubles says); NaN comes after every
 * number, +inf included, whatever its sign bit, so a NaN is never chosen
 * before a number. (The policies reject non-finite statistics before they
 * rank anything; this only makes the order total.)
 */
#ifndef KVSTASH_POLICIES_SELECT_H
#define KVSTASH_POLICIES_SELECT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* x as an unsigned integer of the same order (see the top of the file). */
static inline uint64_t policy_key(double x)
{
    int nan = x != x;
    x += 0.0; /* -0.0 + 0.0 = +0.0: one zero */
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    /* IEEE order as unsigned order: negatives flip every bit, positives
     * only the sign (branch-free, so that key loops vectorise). */
    u ^= (0 - (u >> 63)) | (UINT64_C(1) << 63);
    return u | (0 - (uint64_t)nan); /* NaN: all ones, after everything */
}

/* The k first of a set of keys: those below `key`, and `ties` of those
 * equal to it. */
typedef struct policy_cut {
    uint64_t key;
    size_t ties;
} policy_cut;

/*
 * The cut of the k first (lowest) of keys[0..n). keys[] is working space:
 * its order afterwards is unspecified. k = 0 chooses nothing, k >= n
 * everything. Expected O(n): sampled bounds around the k-th key, then a
 * counting pass and a branch-free compaction of the keys between them,
 * repeated on ever fewer keys; allocates nothing.
 */
policy_cut policy_select_cut(uint64_t *keys, size_t n, size_t k);

/* The keys of policy_select_cut_rows(): policy_key(sign·score) (sign -1
 * for a top-k, 1 for a bottom-k), except where forced (one array a row, or
 * NULL for none) is not 0: forced_key there, 0 to come before every number
 * or UINT64_MAX to come after. */
typedef struct policy_score_keys {
    double sign;
    const uint8_t *const *forced;
    uint64_t forced_key;
} policy_score_keys;

/*
 * policy_select_cut over the keys of rows score[0..rows) of len[r] entries
 * each, flattened row by row, without writing them all first: the bounds of
 * a sample are found first, and one pass makes each key, counts those
 * below the bounds and keeps them in tmp[] (room for every entry) for a
 * compaction of those between. With the cut among the unforced entries
 * (k above the forced count with forced_key 0, or at most the unforced
 * count with UINT64_MAX), that is a class cut of one pass over the scores.
 */
policy_cut policy_select_cut_rows(const double *const *score, const uint32_t *len, uint32_t rows,
                                  const policy_score_keys *keys, size_t k, uint64_t *tmp);

/*
 * The second visit, over candidates that are an array of doubles:
 * chosen[i] = whether candidate i, key policy_key(sign·score[i]) (sign -1
 * for a top-k, 1 for a bottom-k; exact), is chosen by c. Candidate i is
 * among the cut's keys iff in == NULL or (in[i] != 0) == in_value; the
 * others get 0. Ties are taken in index order, or from the highest index
 * down when reverse. Two passes: one over the keys below the cut
 * (vectorised), one for the ties. chosen must not alias in.
 */
void policy_cut_mark(policy_cut *c, const double *score, double sign, const uint8_t *in,
                     int in_value, size_t n, int reverse, uint8_t *chosen);

/*
 * The bottom-1 of n > 0 numbers (no NaN), ties to the lower index: the
 * index of the first minimum, -0.0 equal to +0.0. What policy_select_cut
 * and policy_cut_mark choose for k = 1 and sign 1 in index order, in one
 * vectorised pass and a search, without keys: a decode step evicts one
 * token.
 */
size_t policy_first_min(const double *x, size_t n);

/* The same, ties to the higher index: the index of the last minimum (the
 * cut's choice for k = 1 in reverse index order). */
size_t policy_last_min(const double *x, size_t n);

/* policy_first_min of the sums x[i] + (double)add[i], each rounded as one
 * double addition, without writing them, a part at a time, for a caller
 * that offers each part of its arrays just after its own pass wrote it,
 * while it is in L1 (h2o, which keeps a decode step's attention apart
 * from its sums until the next): start from {0}, offer ranges [from, to)
 * of x and add in ascending order, none empty (at least one), then ask for
 * the first minimum's index. Each offer is summed a block at a time into a
 * buffer in L1; only the best block so far is kept (at most 512 entries,
 * summed again at the end). */
typedef struct policy_min_sum {
    double min;
    size_t at, len; /* the first block that holds min */
    int any;
} policy_min_sum;

void policy_min_sum_offer(policy_min_sum *m, const double *x, const float *add, size_t from,
                          size_t to);
size_t policy_min_sum_first(const policy_min_sum *m, const double *x, const float *add);

/* The largest of x[0..n) (-INFINITY when n is 0; with a NaN among them,
 * some unspecified value), in one vectorised pass. */
double policy_max(const double *x, size_t n);

#endif
