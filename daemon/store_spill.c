/*
 * store_spill.c - victims spilled to the remote tier and fetched back
 * (store.h store_seq_spill; docs/remote.md "Spill and revive").
 *
 * The store's lock is never held while the remote store answers: a spill
 * copies the victim blocks with the sequence marked moving, writes them
 * without the lock, and takes it again to free the blocks; a Revive
 * fetches what it needs while its sequence is marked moving (store.c
 * store_revive), as it copies.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "migrate.h"
#include "store_internal.h"

/* What a spill took from the store, for the part without the lock. */
typedef struct spill_job {
    seq_spill plan;
    pool_geometry geom;
    uint32_t quant_group;
    uint8_t *bytes; /* plan.bytes: the blocks and sketches (seq_spill_read) */
    char tenant[65], uid[REMOTE_UID_LEN + 1];
    seq *q; /* the sequence, while its copy runs */
} spill_job;

/* The copy of a spill: the planned blocks and sketches to host memory. */
static int spill_read(void *arg)
{
    spill_job *j = arg;
    return seq_spill_read(j->q, &j->plan, j->bytes);
}

/* Lock held (store_lock_seq): plan q's spill and copy its blocks and
 * sketches, without the lock when the sequence may be marked moving (the
 * commit frees only what did not change since). */
static status_code spill_copy(store *st, seq *q, spill_job *j, status *s)
{
    if (seq_remote_uid(q)[0] == '\0') {
        char uid[REMOTE_UID_LEN + 1];
        if (remote_uid_new(uid, s) != ST_OK)
            return s->code;
        seq_set_remote_uid(q, uid);
    }
    snprintf(j->uid, sizeof j->uid, "%s", seq_remote_uid(q));
    if (seq_spill_plan(q, &j->plan, s) != ST_OK || j->plan.n == 0)
        return s->code;
    pool *p = seq_pool(q);
    j->geom = p->geom;
    j->quant_group = seq_quant_group(q);
    snprintf(j->tenant, sizeof j->tenant, "%s", store_remote_tenant(p));
    if ((j->bytes = malloc(j->plan.bytes)) == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory for %zu bytes of victims",
                          j->plan.bytes);
    j->q = q;
    uint64_t id = seq_id_of(q);
    return store_copy_unlocked(st, id, spill_read, j) == 0
               ? ST_OK
               : status_set(s, ST_INTERNAL, "reading sequence %llu's victim blocks failed",
                            (unsigned long long)id);
}

/* Without the lock: j's values, in plan order (v->n of them, freed with
 * migrate_values_free). */
static status_code spill_encode(store *st, const spill_job *j, migrate_values *v, status *s)
{
    if ((v->kv = calloc(j->plan.n, sizeof *v->kv)) == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    const char *ns = remote_tier_namespace(st->remote);
    for (; v->n < j->plan.n; v->n++) {
        if (migrate_encode_spill(&j->geom, j->quant_group, &j->plan.blocks[v->n],
                                 j->bytes + j->plan.blocks[v->n].offset, ns, j->tenant, j->uid,
                                 &v->kv[v->n], s) != ST_OK)
            return s->code;
        v->bytes += v->kv[v->n].len;
    }
    return ST_OK;
}

/* Lock held: free the written blocks of seq_id, if it still lives; the
 * keys of those it did not free (dropped meanwhile, or the sequence gone)
 * are queued for deletion. */
static void spill_commit(store *st, uint64_t seq_id, spill_job *j, const remote_kv *kv,
                         store_spill_result *out)
{
    seq *q = store_find_seq_locked(st, seq_id);
    if (q != NULL)
        seq_spill_commit(q, &j->plan);
    for (size_t i = 0; i < j->plan.n; i++) {
        const seq_spill_block *b = &j->plan.blocks[i];
        if (!b->committed) {
            out->dropped++;
            remote_tier_forget(st->remote, &kv[i].key, 1);
            continue;
        }
        if (b->block == TIER_NO_BLOCK)
            out->sketches++;
        else
            out->blocks++;
        out->values++;
        out->tokens += b->npositions;
        out->bytes += kv[i].len;
    }
    if (q != NULL) {
        out->spilled_tokens = seq_spilled_tokens(q);
        out->spilled_blocks = seq_spilled_blocks(q);
    }
}

/* Spill seq_id for the caller holding `token`, or for the daemon itself
 * (token NULL: memory pressure). */
static status_code spill_seq(store *st, const char *token, uint64_t seq_id, store_spill_result *out,
                             status *s)
{
    memset(out, 0, sizeof *out);
    if (store_need_remote(st, s) != ST_OK)
        return s->code;
    spill_job j = {0};
    migrate_values v = {0};
    store_lock_seq(st, seq_id);
    seq *q = token == NULL ? store_find_seq_locked(st, seq_id) : NULL;
    status_code rc = ST_OK;
    if (token != NULL)
        rc = store_remote_seq_locked(st, token, seq_id, "spill", &q, s);
    else if (q == NULL)
        rc = status_set(s, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)seq_id);
    if (rc == ST_OK)
        rc = spill_copy(st, q, &j, s);
    if (rc == ST_OK && j.plan.n == 0) {
        out->spilled_tokens = seq_spilled_tokens(q);
        out->spilled_blocks = seq_spilled_blocks(q);
    }
    store_unlock(st);
    if (rc == ST_OK && j.plan.n > 0 && (rc = spill_encode(st, &j, &v, s)) == ST_OK &&
        (rc = store_remote_write(st->remote, v.kv, v.n, s)) != ST_OK)
        for (size_t i = 0; i < v.n; i++) /* some may have been written */
            remote_tier_forget(st->remote, &v.kv[i].key, 1);
    free(j.bytes);
    if (rc == ST_OK && j.plan.n > 0) {
        store_lock_seq(st, seq_id);
        spill_commit(st, seq_id, &j, v.kv, out);
        store_unlock(st);
    }
    if (rc == ST_OK) {
        snprintf(out->uid, sizeof out->uid, "%s", j.uid);
        snprintf(out->key_prefix, sizeof out->key_prefix,
                 "kvs:%s:{%s:%s}:", remote_tier_namespace(st->remote), j.tenant, j.uid);
        out->ttl_s = remote_tier_ttl(st->remote);
        log_info("seq_spilled",
                 "seq=%llu uid=%s blocks=%u sketches=%u tokens=%llu bytes=%llu dropped=%u "
                 "spilled_tokens=%llu",
                 (unsigned long long)seq_id, j.uid, out->blocks, out->sketches,
                 (unsigned long long)out->tokens, (unsigned long long)out->bytes, out->dropped,
                 (unsigned long long)out->spilled_tokens);
    }
    migrate_values_free(&v);
    seq_spill_free(&j.plan);
    return rc;
}

status_code store_seq_spill(store *st, const char *token, uint64_t seq_id, store_spill_result *out,
                            status *s)
{
    return spill_seq(st, token, seq_id, out, s);
}

/* Lock held: the sequences to spill for memory pressure, into *ids (*n of
 * them; malloc'd, the caller frees). -1 out of memory. */
static int pool_pressured(const pool *p, uint32_t below_pct)
{
    return (uint64_t)p->nfree * 100 < (uint64_t)below_pct * p->block_count;
}

static int pressured_seqs(store *st, uint32_t below_pct, uint64_t **ids, size_t *n)
{
    *n = 0;
    *ids = NULL;
    /* Every 50 ms under the lock: the sequences only when a pool asks. */
    int any = 0;
    for (uint32_t i = 0; i < st->cfg.max_pools && !any; i++)
        any = st->pools[i] != NULL && pool_pressured(st->pools[i], below_pct);
    if (!any || !st->serving)
        return 0;
    if ((*ids = malloc((st->nseqs ? st->nseqs : 1) * sizeof **ids)) == NULL)
        return -1;
    for (size_t i = 0; i < st->nseqs; i++) {
        seq *q = st->seqs[i];
        if (pool_pressured(seq_pool(q), below_pct) && !seq_detached(q) &&
            seq_spill_candidates(q) > 0) /* a detached one's lists change: next time */
            (*ids)[(*n)++] = seq_id_of(q);
    }
    return 0;
}

uint32_t store_spill_pressured(store *st, uint32_t below_pct, store_spill_result *sum,
                               status *first_error)
{
    memset(sum, 0, sizeof *sum);
    uint64_t *ids;
    size_t n;
    pthread_mutex_lock(&st->lock);
    int rc = pressured_seqs(st, below_pct, &ids, &n);
    pthread_mutex_unlock(&st->lock);
    if (rc != 0)
        return 0;
    uint32_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        store_spill_result r;
        status s = {ST_OK, ""};
        if (spill_seq(st, NULL, ids[i], &r, &s) != ST_OK) {
            if (failed++ == 0)
                *first_error = s;
            continue;
        }
        sum->blocks += r.blocks;
        sum->sketches += r.sketches;
        sum->tokens += r.tokens;
        sum->bytes += r.bytes;
        sum->values += r.values;
        sum->dropped += r.dropped;
    }
    free(ids);
    return failed;
}

void store_spill_forget_locked(store *st, seq *q)
{
    uint32_t n = seq_spill_parts(q);
    if (st->remote == NULL || n == 0)
        return;
    char tenant[65], part[12];
    snprintf(tenant, sizeof tenant, "%s", store_remote_tenant(seq_pool(q)));
    for (uint32_t i = 0; i < n; i++) {
        char key[REMOTE_KEY_CAP];
        const char *k = key;
        status s = {ST_OK, ""};
        seq_spill_key_part(i, part);
        if (remote_key(key, sizeof key, remote_tier_namespace(st->remote), tenant,
                       seq_remote_uid(q), part, &s) != ST_OK ||
            remote_tier_forget(st->remote, &k, 1) != 0) {
            log_warn("spill_forget_skipped", "seq=%llu parts=%u (they expire with their ttl)",
                     (unsigned long long)seq_id_of(q), n - i);
            return;
        }
    }
}

/* ---- revive ---------------------------------------------------------------- */

/* A value that does not decode, as the caller sees it: "remote tier: "
 * and the decoder's message naming the key. */
static status_code remote_data_loss(status *s)
{
    char m[STATUS_MSG_LEN];
    snprintf(m, sizeof m, "%s", s->msg);
    return status_set(s, ST_DATA_LOSS, "remote tier: %s", m);
}

status_code store_revive_fetch(store *st, seq_revive_job *job, status *s)
{
    const seq_remote_part *parts;
    size_t n = seq_revive_remote(job, &parts);
    if (n == 0)
        return ST_OK;
    if (store_need_remote(st, s) != ST_OK)
        return s->code;
    seq *q = seq_revive_seq(job);
    pool *p = seq_pool(q);
    char(*keys)[REMOTE_KEY_CAP] = malloc(n * sizeof *keys);
    const char **kp = malloc(n * sizeof *kp);
    remote_buf *bufs = calloc(n, sizeof *bufs);
    status_code rc =
        keys && kp && bufs ? ST_OK : status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; rc == ST_OK && i < n; i++) {
        char part[12];
        seq_spill_key_part(parts[i].part, part);
        rc = remote_key(keys[i], REMOTE_KEY_CAP, remote_tier_namespace(st->remote),
                        store_remote_tenant(p), seq_remote_uid(q), part, s);
        kp[i] = keys[i];
    }
    if (rc == ST_OK)
        rc = store_remote_read(st->remote, kp, n, bufs, s);
    for (size_t i = 0; rc == ST_OK && i < n; i++) {
        const uint8_t *payload;
        if (!bufs[i].found)
            rc = status_set(s, ST_DATA_LOSS,
                            "remote tier: %s is missing (expired after --remote-ttl-s, or "
                            "deleted): %zu spilled victims of layer %u are lost",
                            keys[i], parts[i].npositions, parts[i].layer);
        else if (migrate_decode_spill(bufs[i].data, bufs[i].len, keys[i], &p->geom,
                                      seq_quant_group(q), &parts[i], &payload, s) != ST_OK)
            rc = remote_data_loss(s);
        else if (seq_revive_supply(job, i, payload, parts[i].bytes) != 0)
            rc = status_set(s, ST_INTERNAL, "writing spilled victims into the pool failed");
    }
    if (bufs != NULL)
        remote_bufs_free(bufs, n);
    free(bufs), free(kp), free(keys);
    return rc;
}
