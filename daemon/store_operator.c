/* store_operator.c - see store_operator.h. */
#include "store_operator.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "metrics.h"
#include "store_internal.h"

int operator_can_evict(const policy_ops *p)
{
    return p->needs == 0;
}

/* The CLI's commands, by policy_tier (EvictRequest.to's words are
 * policy_tier_name). */
static const char *const op_names[POLICY_TIERS] = {"revive", "demote", "offload",
                                                   "evict",  "demote", "demote"};

status_code operator_parse_to(const char *to, policy_tier *out, status *s)
{
    if (to == NULL || to[0] == '\0')
        to = "evict";
    else if (strcmp(to, "fp16") == 0) /* the full tier's name before it was "full" */
        to = "full";
    for (int t = 0; t < POLICY_TIERS; t++)
        if (strcmp(to, policy_tier_name((unsigned)t)) == 0) {
            *out = (policy_tier)t;
            return ST_OK;
        }
    char esc[64];
    log_escape(to, esc, sizeof esc);
    return status_set(s, ST_INVALID_ARGUMENT,
                      "to must be \"evict\" (or empty), \"int8\", \"int4\", \"int2\", "
                      "\"sketch\" or \"full\" (or \"fp16\"), got \"%s\"",
                      esc);
}

/* ---- the block table side (the same rules as seq.c's eviction) ------------- */

static int range_cmp(const void *a, const void *b)
{
    const operator_range *x = a, *y = b;
    return x->first < y->first ? -1 : x->first > y->first;
}

/* Sort and merge overlapping or adjacent ranges in place; returns the count. */
static size_t ranges_normalise(operator_range *r, size_t n)
{
    qsort(r, n, sizeof *r, range_cmp);
    size_t out = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t end = (uint64_t)r[i].first + r[i].count;
        if (out > 0 && r[i].first <= (uint64_t)r[out - 1].first + r[out - 1].count) {
            uint64_t prev = (uint64_t)r[out - 1].first + r[out - 1].count;
            if (end > prev)
                r[out - 1].count = (uint32_t)(end - r[out - 1].first);
        } else {
            r[out++] = r[i];
        }
    }
    return out;
}

static status_code check_request(const operator_range *ranges, size_t nranges,
                                 const uint32_t *layers, size_t nlayers, const seq *q,
                                 policy_tier to, status *s)
{
    if (nranges == 0)
        return status_set(s, ST_INVALID_ARGUMENT, "no positions to %s: give at least one range",
                          op_names[to]);
    if (nranges > OPERATOR_MAX_RANGES)
        return status_set(s, ST_INVALID_ARGUMENT, "at most %d position ranges, got %zu",
                          OPERATOR_MAX_RANGES, nranges);
    for (size_t i = 0; i < nranges; i++) {
        uint64_t end = (uint64_t)ranges[i].first + ranges[i].count;
        if (ranges[i].count == 0)
            return status_set(s, ST_INVALID_ARGUMENT, "range %zu (first %u) is empty", i,
                              ranges[i].first);
        if (end > seq_appended(q))
            return status_set(s, ST_INVALID_ARGUMENT,
                              "positions %u..%llu are beyond sequence %llu's %llu appended "
                              "positions",
                              ranges[i].first, (unsigned long long)end - 1,
                              (unsigned long long)seq_id_of(q),
                              (unsigned long long)seq_appended(q));
    }
    for (size_t i = 0; i < nlayers; i++)
        if (layers[i] >= seq_layers(q))
            return status_set(s, ST_INVALID_ARGUMENT,
                              "layer %u is out of range: sequence %llu "
                              "has %u layers",
                              layers[i], (unsigned long long)seq_id_of(q), seq_layers(q));
    return ST_OK;
}

static status_code check_caller(store *st, const char *token, session **out, status *s)
{
    *out = store_find_session_locked(st, token);
    if (*out != NULL)
        return ST_OK;
    return status_set(s, ST_UNAUTHENTICATED,
                      token == NULL || token[0] == '\0'
                          ? "Evict needs the kvstash-token metadata from the fd-socket "
                            "handshake (docs/protocol.md)"
                          : "unknown session token (the session ended, or the token is wrong)");
}

/* A session acts on its own sequences; another session's takes an
 * operator's uid (store_set_operators). The uid alone is not enough: every
 * worker of the daemon's uid shares it, and one must not cut another's
 * cache (issue 12). */
static status_code check_permission(store *st, const session *caller, const seq *q, policy_tier to,
                                    status *s)
{
    if (seq_session_id(q) == caller->id || store_is_operator(st, caller->uid))
        return ST_OK;
    return status_set(s, ST_PERMISSION_DENIED,
                      "session %llu (uid %u) may not %s positions of sequence %llu: it belongs "
                      "to another session, and only uids in kvstashd's operator_uids act on "
                      "other sessions' sequences",
                      (unsigned long long)caller->id, (unsigned)caller->uid, op_names[to],
                      (unsigned long long)seq_id_of(q));
}

/* Positions of the normalised ranges that [pos] hits, walking both in order. */
static int in_ranges(const operator_range *r, size_t n, size_t *cursor, uint32_t pos)
{
    while (*cursor < n && (uint64_t)r[*cursor].first + r[*cursor].count <= pos)
        (*cursor)++;
    return *cursor < n && r[*cursor].first <= pos;
}

/* Tokens of list (l, k) at the ranges' positions stored in tier t. */
static uint32_t stored_in(seq *q, uint32_t l, uint32_t k, const operator_range *r, size_t nr,
                          policy_tier t)
{
    seq_list_view ly;
    seq_list_view_get(q, l, k, &ly);
    uint32_t i = 0, hit = 0;
    size_t cur = 0;
    for (size_t sg = 0; sg < ly.nsegs; sg++)
        for (uint32_t c = 0; c < ly.segs[sg].count && i < ly.tokens; c++, i++)
            hit += in_ranges(r, nr, &cur, ly.positions[i]) && ly.seg_tier[sg] == t;
    return hit;
}

/* The decision of list k of a layer with the requested positions on top:
 * evicted, or (a tier move) given tier `to` where the policy keeps them.
 * Returns the tokens it applied to; *already grows by those of them stored
 * in `to`. Segments run parallel to the host's list (seq.h). */
static uint32_t amend_list(seq *q, uint32_t l, uint32_t k, uint8_t *tier, policy_tier to,
                           const operator_range *r, size_t nr, uint32_t *already,
                           operator_evict_result *out)
{
    seq_list_view ly;
    seq_list_view_get(q, l, k, &ly);
    uint32_t i = 0, hit = 0;
    size_t cur = 0;
    for (size_t sg = 0; sg < ly.nsegs; sg++)
        for (uint32_t c = 0; c < ly.segs[sg].count && i < ly.tokens; c++, i++) {
            int asked = in_ranges(r, nr, &cur, ly.positions[i]);
            if (tier[i] == POLICY_EVICT && !(asked && to == POLICY_EVICT)) {
                out->by_policy++; /* the policy's own rule: it runs first */
            } else if (asked) {
                tier[i] = (uint8_t)to;
                *already += ly.seg_tier[sg] == to;
                hit++;
            }
        }
    return hit;
}

/* One layer: the policy's step, the requested positions on top, the block
 * table, then the host's commit; a demote then quantises what is pending. */
static status_code apply_layer(seq *q, uint32_t l, policy_tier to, const operator_range *r,
                               size_t nr, uint64_t span, uint64_t epoch, operator_evict_result *out,
                               status *s, int *changed)
{
    const policy_decision *d;
    if (seq_policy_layer_step(q, l, &d, s) != ST_OK)
        return s->code;
    /* Not for the policies operator_can_evict admits; refused rather than
     * half-applied. Nothing is committed: the host drops an uncommitted
     * decision at the layer's next step (host.h). */
    if (d->nmerges != 0 || d->rerotate_keys)
        return status_set(s, ST_INTERNAL,
                          "policy %s asked for %s, which an operator's %s does not apply",
                          seq_policy(q)->name, d->nmerges != 0 ? "value merges" : "key re-rotation",
                          op_names[to]);
    uint32_t already = 0, now = 0; /* requested tokens stored in `to`, before and after */
    for (uint32_t k = 0; k < seq_heads(q); k++) {
        uint32_t hit = amend_list(q, l, k, d->tier[k], to, r, nr, &already, out);
        out->requested += hit;
        out->not_held += (uint32_t)(span - hit);
    }
    size_t evicted = 0;
    status_code rc = seq_apply_decision(q, l, d, epoch, &evicted, changed, s);
    out->evicted += (uint32_t)evicted;
    if (rc == ST_OK && policy_tier_quantised(to))
        rc = seq_demote_pending(q, l, epoch, changed, s);
    if (rc != ST_OK || to == POLICY_EVICT)
        return rc;
    /* The requested tokens are all kept, and one stored in `to` before
     * stays there: the difference is what moved. */
    for (uint32_t k = 0; k < seq_heads(q); k++)
        now += stored_in(q, l, k, r, nr, to);
    out->moved += now - already;
    return ST_OK;
}

/* The checks of a call, in order; *out is the sequence when they pass. */
static status_code check_all(store *st, const char *token, uint64_t seq_id, policy_tier to,
                             const operator_range *r, size_t nranges, const uint32_t *layers,
                             size_t nlayers, seq **out, status *s)
{
    session *caller = NULL;
    seq *q = NULL;
    status_code rc = ST_OK;
    if (!st->serving)
        rc = status_set(s, ST_UNAVAILABLE, "kvstashd is shutting down");
    else
        rc = check_caller(st, token, &caller, s);
    if (rc == ST_OK && (q = store_find_seq_locked(st, seq_id)) == NULL)
        rc = status_set(s, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)seq_id);
    if (rc == ST_OK)
        rc = check_permission(st, caller, q, to, s);
    if (rc == ST_OK && !operator_can_evict(seq_policy(q)))
        rc =
            status_set(s, ST_FAILED_PRECONDITION,
                       "sequence %llu runs policy %s, which keeps per-token state that an "
                       "operator's %s would desynchronise; %s works on policies full and "
                       "streaming",
                       (unsigned long long)seq_id, seq_policy(q)->name, op_names[to], op_names[to]);
    if (rc == ST_OK)
        rc = check_request(r, nranges, layers, nlayers, q, to, s);
    /* Sketch cells only within the daemon memory budget (store_internal.h). */
    if (rc == ST_OK && to == POLICY_SKETCH)
        rc = store_sketch_reserve_locked(st, q, s);
    *out = q;
    return rc;
}

/* Metrics, the table.changed event and the log line of a call that ran. */
static void report(store *st, seq *q, policy_tier to, const operator_evict_result *out, int changed)
{
    metrics_evicted(st->metrics, seq_policy(q), 1, to == POLICY_EVICT ? out->requested : 0);
    metrics_evicted(st->metrics, seq_policy(q), 0, out->by_policy);
    store_report_tiers(st, q);
    if (out->evicted > 0 || changed)
        events_publish(st->events, "table.changed",
                       json_pack("{sI sI sI ss ss sI}", "seq", (json_int_t)seq_id_of(q), "epoch",
                                 (json_int_t)seq_epoch(q), "evicted", (json_int_t)out->evicted,
                                 "by", "operator", "op", op_names[to], "moved",
                                 (json_int_t)out->moved));
    log_info("operator",
             "op=%s seq=%llu policy=%s evicted=%u requested=%u by_policy=%u not_held=%u "
             "moved=%u epoch=%llu",
             op_names[to], (unsigned long long)seq_id_of(q), seq_policy(q)->name, out->evicted,
             out->requested, out->by_policy, out->not_held, out->moved,
             (unsigned long long)seq_epoch(q));
}

/* The end of the chunk of layers that starts at `from`: chosen layers
 * until their lists hold OPERATOR_CHUNK_TOKENS tokens, at least one. */
static uint32_t chunk_end(seq *q, const uint8_t *chosen, uint32_t from)
{
    uint64_t tokens = 0;
    uint32_t l = from;
    for (; l < seq_layers(q) && tokens < OPERATOR_CHUNK_TOKENS; l++)
        for (uint32_t k = 0; chosen[l] && k < seq_heads(q); k++)
            tokens += seq_list_tokens(q, l, k, NULL);
    return l;
}

static void result_add(operator_evict_result *sum, const operator_evict_result *part)
{
    sum->epoch = part->epoch;
    sum->evicted += part->evicted;
    sum->requested += part->requested;
    sum->by_policy += part->by_policy;
    sum->not_held += part->not_held;
    sum->moved += part->moved;
}

/* The chosen layers of [from, end) as one transaction (seq.h seq_begin):
 * all of them or none, published as one new epoch. Lock held. */
static status_code apply_chunk(store *st, seq *q, const uint8_t *chosen, uint32_t from,
                               uint32_t end, policy_tier to, const operator_range *r, size_t nr,
                               uint64_t span, operator_evict_result *out, status *s)
{
    operator_evict_result part = {0};
    uint64_t epoch = seq_epoch(q) + 1;
    int changed = 0;
    status_code rc = ST_OK;
    seq_begin(q);
    for (uint32_t l = from; l < end && rc == ST_OK; l++)
        if (chosen[l])
            rc = apply_layer(q, l, to, r, nr, span, epoch, &part, s, &changed);
    if (rc != ST_OK) {
        seq_rollback(q);
        return rc;
    }
    seq_end(q);
    if (part.evicted > 0 || changed)
        seq_publish_epoch(q, epoch);
    part.epoch = seq_epoch(q);
    report(st, q, to, &part, changed);
    result_add(out, &part);
    return ST_OK;
}

/* Between two chunks: the store's lock is let go so that callers waiting
 * for it (any worker's append or table read, of any model) run, then taken
 * again, and the checks of the call run again: the session may have ended,
 * the sequence been released, the daemon begun to shut down meanwhile. The
 * short sleep gives the waiters the lock: glibc's mutex is not fair, and an
 * unlock followed at once by a lock would mostly take it straight back. */
static status_code between_chunks(store *st, const char *token, uint64_t seq_id, policy_tier to,
                                  seq **q, status *s)
{
    store_unlock(st);
    nanosleep(&(struct timespec){0, OPERATOR_CHUNK_PAUSE_NS}, NULL);
    store_lock_seq(st, seq_id);
    session *caller = NULL;
    if (!st->serving)
        return status_set(s, ST_UNAVAILABLE, "kvstashd is shutting down");
    if (check_caller(st, token, &caller, s) != ST_OK)
        return s->code;
    if ((*q = store_find_seq_locked(st, seq_id)) == NULL)
        return status_set(s, ST_NOT_FOUND, "sequence %llu was released",
                          (unsigned long long)seq_id);
    return check_permission(st, caller, *q, to, s);
}

/* A failure after some chunks were applied: say how far the call got. */
static void note_partial(status *s, uint32_t done, uint32_t nchosen, uint64_t epoch)
{
    char was[STATUS_MSG_LEN];
    snprintf(was, sizeof was, "%s", s->msg);
    status_set(s, s->code,
               "%s (%u of the %u chosen layers were applied before this, as epoch %llu; the "
               "others are unchanged)",
               was, done, nchosen, (unsigned long long)epoch);
}

/* The first chosen layer at or after l (seq_layers: none). */
static uint32_t next_chosen(const seq *q, const uint8_t *chosen, uint32_t l)
{
    while (l < seq_layers(q) && !chosen[l])
        l++;
    return l;
}

status_code operator_apply(store *st, const char *token, uint64_t seq_id, policy_tier to,
                           const operator_range *ranges, size_t nranges, const uint32_t *layers,
                           size_t nlayers, operator_evict_result *out, status *s)
{
    memset(out, 0, sizeof *out);
    if (to >= POLICY_TIERS)
        return status_set(s, ST_INVALID_ARGUMENT, "to is %d, not a tier", (int)to);
    if (nranges > OPERATOR_MAX_RANGES)
        return status_set(s, ST_INVALID_ARGUMENT, "at most %d position ranges, got %zu",
                          OPERATOR_MAX_RANGES, nranges);
    operator_range *r = malloc((nranges ? nranges : 1) * sizeof *r);
    if (r == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (nranges > 0)
        memcpy(r, ranges, nranges * sizeof *r);
    uint8_t *chosen = NULL;
    store_lock_seq(st, seq_id);
    seq *q = NULL;
    status_code rc = check_all(st, token, seq_id, to, r, nranges, layers, nlayers, &q, s);
    if (rc == ST_OK && (chosen = calloc(seq_layers(q), 1)) == NULL)
        rc = status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (rc == ST_OK) {
        size_t nr = ranges_normalise(r, nranges);
        uint64_t span = 0;
        uint32_t nlayers_q = seq_layers(q), nchosen = 0, done = 0;
        for (size_t i = 0; i < nr; i++)
            span += r[i].count;
        for (uint32_t l = 0; l < nlayers_q; l++)
            chosen[l] = nlayers == 0;
        for (size_t i = 0; i < nlayers; i++)
            chosen[layers[i]] = 1;
        for (uint32_t l = 0; l < nlayers_q; l++)
            nchosen += chosen[l];
        /* A sequence whose chosen lists hold up to OPERATOR_CHUNK_TOKENS
         * tokens is one chunk: the call is all or nothing. A longer one goes
         * a chunk of layers at a time, the lock let go in between
         * (docs/reliability.md). */
        for (uint32_t from = next_chosen(q, chosen, 0), end; rc == ST_OK && from < nlayers_q;
             from = next_chosen(q, chosen, end)) {
            if (done > 0 && (rc = between_chunks(st, token, seq_id, to, &q, s)) != ST_OK)
                break;
            end = chunk_end(q, chosen, from);
            rc = apply_chunk(st, q, chosen, from, end, to, r, nr, span, out, s);
            for (uint32_t l = from; rc == ST_OK && l < end; l++)
                done += chosen[l];
        }
        if (rc != ST_OK && done > 0)
            note_partial(s, done, nchosen, out->epoch);
        if (rc != ST_OK)
            memset(out, 0, sizeof *out);
    }
    store_unlock(st);
    free(chosen);
    free(r);
    return rc;
}

status_code operator_evict(store *st, const char *token, uint64_t seq_id,
                           const operator_range *ranges, size_t nranges, const uint32_t *layers,
                           size_t nlayers, operator_evict_result *out, status *s)
{
    return operator_apply(st, token, seq_id, POLICY_EVICT, ranges, nranges, layers, nlayers, out,
                          s);
}
