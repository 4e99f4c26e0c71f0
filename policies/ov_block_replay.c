/*
 * ov_block_replay.c - `kvstash replay` operations of policy "ov_block" in
 * OpenVINO's own terms (issue 3; docs/replay.md "ov_block"): register whole
 * score vectors, evict, read the accumulators and counters, and the
 * rotation data of an eviction. They call the state operations of
 * ov_block.h and keep the host's token lists in step with them, so that
 * the generic `held` stays true whichever operations a trace mixes.
 *
 * The trace line comes through policy_replay.h (the replay owns the JSON).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ov_block.h"
#include "policy_replay.h"

#define MAX_ROTATION_BLOCKS (1u << 20)

static ov_block *state_of(const policy_replay *r)
{
    return policy_host_state(r->host);
}

/* The layer vectors of a registration: L arrays of n numbers each (vals and
 * lens are [L]; vals[l] malloc'd). Errors are reported on the line. */
static int read_scores(const policy_replay *r, const policy_replay_value *s, double **vals,
                       size_t *lens, size_t *n_out)
{
    uint32_t L = r->layers;
    if (r->array_size(r->ctx, s) != L)
        return r->fail(r->ctx, "scores: expected an array of %" PRIu32 " layer vectors", L);
    size_t n = 0;
    for (uint32_t l = 0; l < L; l++) {
        size_t m = r->array_size(r->ctx, r->item(r->ctx, s, l));
        if (m == SIZE_MAX)
            return r->fail(r->ctx, "scores: layer %" PRIu32 " is not an array of numbers", l);
        if (l == 0)
            n = m;
        else if (m != n)
            return r->fail(r->ctx, "scores: layer %" PRIu32 " has %zu values, layer 0 has %zu", l,
                           m, n);
    }
    uint32_t held = policy_host_view(r->host, 0)->tokens[0];
    if (n < held)
        return r->fail(r->ctx,
                       "scores: a registration of %zu scores is shorter than the %" PRIu32
                       " tokens the sequence already holds (start area and tracked tokens)",
                       n, held);
    if (n > UINT32_MAX)
        return r->fail(r->ctx, "scores: too many values");
    for (uint32_t l = 0; l < L; l++) {
        const policy_replay_value *ly = r->item(r->ctx, s, l);
        vals[l] = malloc((n ? n : 1) * sizeof **vals);
        if (vals[l] == NULL)
            return r->fail(r->ctx, "out of memory");
        lens[l] = n;
        for (size_t i = 0; i < n; i++)
            if (r->number(r->ctx, r->item(r->ctx, ly, i), &vals[l][i]) != 0)
                return r->fail(r->ctx, "scores: layer %" PRIu32 " value %zu is not a number", l, i);
    }
    *n_out = n;
    return 0;
}

/* {"scores": [[...] per layer], "snapkv": n}: register, growing the
 * sequence to the vectors' length. */
static int op_scores(const policy_replay *r)
{
    static const char *const keys[] = {"scores", "snapkv", NULL};
    if (r->only_keys(r->ctx, r->line, keys, "scores") != 0)
        return -1;
    uint64_t nsnap = 0;
    const policy_replay_value *v = r->field(r->ctx, r->line, "snapkv");
    if (v != NULL && r->get_uint(r->ctx, v, UINT32_MAX, &nsnap, "scores: snapkv") != 0)
        return -1;
    double **vals = calloc(r->layers, sizeof *vals);
    size_t *lens = calloc(r->layers, sizeof *lens);
    size_t n = 0;
    int rc = -1;
    if (vals == NULL || lens == NULL) {
        r->fail(r->ctx, "out of memory");
        goto out;
    }
    if (read_scores(r, r->field(r->ctx, r->line, "scores"), vals, lens, &n) != 0)
        goto out;
    uint32_t held = policy_host_view(r->host, 0)->tokens[0];
    if (n > held && policy_host_append(r->host, (uint32_t)(n - held)) != 0) {
        r->fail(r->ctx, "scores: cannot append %zu tokens", n - held);
        goto out;
    }
    ov_block *st = state_of(r);
    ov_reg_status status;
    char err[POLICY_ERR_LEN] = "";
    if (ov_block_register(st, (const double *const *)vals, lens, (uint32_t)nsnap, &status, err,
                          sizeof err) != 0) {
        r->fail(r->ctx, "scores: %s", err);
        goto out;
    }
    if (status == OV_REG_BEFORE_WINDOW)
        r->note(r->ctx,
                "registration ignored: snapkv 0 while the SnapKV window (snapkv_window=%" PRIu32
                ") is open and nothing is tracked yet (OpenVINO skips prompt chunks before the "
                "window)",
                ov_block_snapkv_window(st));
    else if (status == OV_REG_SHORT)
        r->note(r->ctx,
                "registration ignored: %zu scores do not reach past the start area "
                "(start_size=%" PRIu32 ")",
                n, ov_block_start_size(st));
    rc = 0;
out:
    for (uint32_t l = 0; vals != NULL && l < r->layers; l++)
        free(vals[l]);
    free(vals);
    free(lens);
    return rc;
}

/* {"evict": true}: evict every layer; the host drops the same tokens. */
static int op_evict(const policy_replay *r)
{
    static const char *const keys[] = {"evict", NULL};
    if (r->only_keys(r->ctx, r->line, keys, "evict") != 0 ||
        r->get_true(r->ctx, r->field(r->ctx, r->line, "evict"), "evict") != 0)
        return -1;
    ov_block *st = state_of(r);
    r->put(r->ctx, "{\"evicted_blocks\":[");
    for (uint32_t l = 0; l < r->layers; l++) {
        uint32_t *b = NULL;
        size_t nb = 0;
        char err[POLICY_ERR_LEN] = "";
        if (ov_block_evict(st, l, &b, &nb, err, sizeof err) != 0)
            return r->fail(r->ctx, "evict: layer %" PRIu32 ": %s", l, err);
        r->put(r->ctx, "%s[", l ? "," : "");
        for (size_t i = 0; i < nb; i++)
            r->put(r->ctx, "%s%" PRIu32, i ? "," : "", b[i]);
        r->put(r->ctx, "]");
        const policy_decision *d;
        policy_stats none = {.confidence = -1.0};
        ov_block_apply_next(st, b, nb);
        int rc = policy_host_step(r->host, l, &none, &d, err, sizeof err);
        free(b);
        if (rc != 0)
            return r->fail(r->ctx, "evict: layer %" PRIu32 ": %s", l, err);
        policy_host_commit(r->host, l);
    }
    r->put(r->ctx, "]}");
    return r->emit(r->ctx);
}

/* {"state": true}: accumulators and NORM_SUM counters of every layer. */
static int op_state(const policy_replay *r)
{
    static const char *const keys[] = {"state", NULL};
    if (r->only_keys(r->ctx, r->line, keys, "state") != 0 ||
        r->get_true(r->ctx, r->field(r->ctx, r->line, "state"), "state") != 0)
        return -1;
    ov_block *st = state_of(r);
    r->put(r->ctx, "{\"scores\":[");
    for (uint32_t l = 0; l < r->layers; l++) {
        const double *acc = ov_block_scores(st, l);
        size_t n = ov_block_tracked(st, l);
        r->put(r->ctx, "%s[", l ? "," : "");
        for (size_t i = 0; i < n; i++) {
            if (i)
                r->put(r->ctx, ",");
            r->put_double(r->ctx, acc[i]);
        }
        r->put(r->ctx, "]");
    }
    r->put(r->ctx, "],\"counters\":[");
    for (uint32_t l = 0; l < r->layers; l++) {
        const uint64_t *c = ov_block_counters(st, l);
        size_t n = c ? ov_block_tracked(st, l) : 0;
        r->put(r->ctx, "%s[", l ? "," : "");
        for (size_t i = 0; i < n; i++)
            r->put(r->ctx, "%s%" PRIu64, i ? "," : "", c[i]);
        r->put(r->ctx, "]");
    }
    r->put(r->ctx, "]}");
    return r->emit(r->ctx);
}

/* The evicted block list of a rotation (malloc'd into *out). */
static int read_evicted(const policy_replay *r, const policy_replay_value *ev, uint32_t **out,
                        size_t *n)
{
    *out = NULL; /* set on every path: GCC at -O3 cannot see through r->fail */
    *n = 0;
    size_t ne = r->array_size(r->ctx, ev);
    if (ne == SIZE_MAX)
        return r->fail(r->ctx, "rotation: evicted must be an array of block indices");
    uint32_t *e = malloc((ne ? ne : 1) * sizeof *e);
    if (e == NULL)
        return r->fail(r->ctx, "out of memory");
    for (size_t i = 0; i < ne; i++) {
        uint64_t b;
        char what[48];
        snprintf(what, sizeof what, "rotation: evicted[%zu]", i);
        if (r->get_uint(r->ctx, r->item(r->ctx, ev, i), UINT32_MAX, &b, what) != 0) {
            free(e);
            return -1;
        }
        e[i] = (uint32_t)b;
    }
    *out = e;
    *n = ne;
    return 0;
}

/* One coefficient row as a JSON array. */
static void put_row(const policy_replay *r, const double *row, uint32_t half)
{
    for (uint32_t j = 0; j < half; j++) {
        if (j)
            r->put(r->ctx, ",");
        r->put_double(r->ctx, row[j]);
    }
}

/* {"rotation": {"evicted": [...], "blocks_before": n}}: the rotation data. */
static int op_rotation(const policy_replay *r)
{
    static const char *const keys[] = {"rotation", NULL};
    static const char *const rkeys[] = {"evicted", "blocks_before", NULL};
    if (r->only_keys(r->ctx, r->line, keys, "rotation") != 0)
        return -1;
    const policy_replay_value *rot = r->field(r->ctx, r->line, "rotation");
    if (!r->is_object(r->ctx, rot))
        return r->fail(r->ctx, "rotation: the value must be an object {\"evicted\": [...], "
                               "\"blocks_before\": n}");
    if (r->only_keys(r->ctx, rot, rkeys, "rotation") != 0)
        return -1;
    const policy_replay_value *nb = r->field(r->ctx, rot, "blocks_before");
    if (r->array_size(r->ctx, r->field(r->ctx, rot, "evicted")) == SIZE_MAX)
        return r->fail(r->ctx, "rotation: evicted must be an array of block indices");
    if (nb == NULL)
        return r->fail(r->ctx, "rotation: blocks_before is missing");
    uint64_t before;
    if (r->get_uint(r->ctx, nb, MAX_ROTATION_BLOCKS, &before, "rotation: blocks_before") != 0)
        return -1;
    uint32_t *e;
    size_t ne;
    if (read_evicted(r, r->field(r->ctx, rot, "evicted"), &e, &ne) != 0)
        return -1;
    ov_block *st = state_of(r);
    ov_rotation *rows = NULL;
    size_t n = 0;
    char err[POLICY_ERR_LEN] = "";
    int rc = ov_block_rotation(st, e, ne, (uint32_t)before, &rows, &n, err, sizeof err);
    free(e);
    if (rc != 0)
        return r->fail(r->ctx, "rotation: %s", err);
    uint32_t half = ov_block_head_size(st) / 2;
    r->put(r->ctx, "{\"rotated\":[");
    for (size_t i = 0; i < n; i++) {
        r->put(r->ctx, "%s{\"block\":%" PRIu32 ",\"delta\":%" PRIu32 ",\"sin\":[", i ? "," : "",
               rows[i].block, rows[i].delta);
        put_row(r, rows[i].sin_row, half);
        r->put(r->ctx, "],\"cos\":[");
        put_row(r, rows[i].cos_row, half);
        r->put(r->ctx, "]}");
    }
    r->put(r->ctx, "]}");
    free(rows);
    return r->emit(r->ctx);
}

int ov_block_replay(const policy_replay *r, const char *op)
{
    if (strcmp(op, "scores") == 0)
        return op_scores(r);
    if (strcmp(op, "evict") == 0)
        return op_evict(r);
    if (strcmp(op, "state") == 0)
        return op_state(r);
    if (strcmp(op, "rotation") == 0)
        return op_rotation(r);
    return r->fail(r->ctx, "unknown operation '%s'", op);
}
