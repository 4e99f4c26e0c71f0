/*
 * store_remote.c - export and import of sequences through the remote tier
 * (store.h store_seq_export; docs/remote.md "Export and import").
 *
 * Neither call holds the store's lock while it waits for the remote store:
 * an export copies the sequence's blocks to host memory with the sequence
 * marked moving (only its own calls wait), then encodes and writes without
 * the lock; an import reads the manifest, takes the lock to take blocks,
 * reads, checks and writes every value into them without it (the pool
 * held, so that it outlives a session that ends meanwhile) and takes it
 * again to build and publish the sequence.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "migrate.h"
#include "store_internal.h"

/* The tenant part of remote keys: the pool's tenant, "default" for the
 * tenantless (remote_value.h: keys carry ids, never user text). */
const char *store_remote_tenant(const pool *p)
{
    return p->tenant[0] != '\0' ? p->tenant : "default";
}

status_code store_need_remote(const store *st, status *s)
{
    if (st->remote != NULL)
        return ST_OK;
    return status_set(s, ST_FAILED_PRECONDITION,
                      "kvstashd runs without a remote tier: start it with --remote "
                      "host:port[,...] (a Redis Cluster; docs/remote.md)");
}

/* A remote call's failure as the caller sees it: the store's code, its
 * message behind "remote tier: " (so that a client tells the remote store's
 * UNAVAILABLE from kvstashd's own: the CLI's exit status does). */
static status_code remote_failed(status *s)
{
    char msg[STATUS_MSG_LEN];
    snprintf(msg, sizeof msg, "%s", s->msg);
    return status_set(s, s->code, "remote tier: %s: %s", status_name(s->code), msg);
}

/* Write kv[0..n) with the remote tier's time to live, recording the outcome
 * in its status. */
status_code store_remote_write(remote_tier *t, const remote_kv *kv, size_t n, status *s)
{
    remote_store *r = remote_tier_acquire(t, s);
    if (r == NULL)
        return remote_failed(s);
    status_code rc = remote_put(r, kv, n, remote_tier_ttl(t), s);
    remote_tier_note(t, s, rc);
    return rc == ST_OK ? ST_OK : remote_failed(s);
}

status_code store_remote_read(remote_tier *t, const char *const *keys, size_t n, remote_buf *out,
                              status *s)
{
    remote_store *r = remote_tier_acquire(t, s);
    if (r == NULL)
        return remote_failed(s);
    status_code rc = remote_get(r, keys, n, out, s);
    remote_tier_note(t, s, rc);
    return rc == ST_OK ? ST_OK : remote_failed(s);
}

/* ---- export ---------------------------------------------------------------- */

/* What an export took from the store, for the part without the lock. */
typedef struct export_job {
    seq_export x;
    pool_geometry geom;
    uint32_t quant_group;
    size_t block_bytes;
    uint8_t *bytes; /* x.nblocks blocks */
    char tenant[65];
    uint64_t tokens;
    seq *q; /* the sequence, while its copy runs */
} export_job;

/* The copy of an export: its blocks and sketch cells to host memory. */
static int export_read(void *arg)
{
    export_job *j = arg;
    int rc = pool_read_blocks(seq_pool(j->q), j->x.blocks, j->x.nblocks, j->bytes);
    return rc == 0 ? seq_export_read_sketches(j->q, &j->x) : rc;
}

/* Lock held (store_lock_seq): describe q and copy its blocks and sketch
 * cells, without the lock when the sequence may be marked moving. */
static status_code export_copy(store *st, seq *q, export_job *j, status *s)
{
    if (seq_export_describe(q, &j->x, s) != ST_OK)
        return s->code;
    pool *p = seq_pool(q);
    j->geom = p->geom;
    j->quant_group = seq_quant_group(q);
    j->block_bytes = p->block_bytes;
    snprintf(j->tenant, sizeof j->tenant, "%s", store_remote_tenant(p));
    for (size_t i = 0; i < (size_t)j->x.layers * j->x.heads; i++)
        j->tokens += j->x.lists[i].ntokens;
    if (j->x.nblocks > SIZE_MAX / (j->block_bytes ? j->block_bytes : 1) ||
        (j->bytes = malloc(j->x.nblocks ? j->x.nblocks * j->block_bytes : 1)) == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory for %zu blocks of %zu bytes",
                          j->x.nblocks, j->block_bytes);
    j->q = q;
    uint64_t id = seq_id_of(q);
    return store_copy_unlocked(st, id, export_read, j) == 0
               ? ST_OK
               : status_set(s, ST_INTERNAL, "reading sequence %llu's blocks or sketches failed",
                            (unsigned long long)id);
}

status_code store_remote_seq_locked(store *st, const char *token, uint64_t seq_id, const char *what,
                                    seq **out, status *s)
{
    session *caller;
    seq *q = NULL;
    status_code rc = store_need_session_locked(st, token, 0, &caller, s);
    if (rc == ST_OK && (q = store_find_seq_locked(st, seq_id)) == NULL)
        rc = status_set(s, ST_NOT_FOUND, "no sequence %llu", (unsigned long long)seq_id);
    if (rc == ST_OK && seq_session_id(q) != caller->id && !store_is_operator(st, caller->uid))
        rc = status_set(s, ST_PERMISSION_DENIED,
                        "session %llu (uid %u) may not %s sequence %llu: it belongs to "
                        "another session, and only uids in kvstashd's operator_uids act on "
                        "other sessions' sequences",
                        (unsigned long long)caller->id, (unsigned)caller->uid, what,
                        (unsigned long long)seq_id);
    *out = rc == ST_OK ? q : NULL;
    return rc;
}

static status_code export_take(store *st, const char *token, uint64_t seq_id, export_job *j,
                               status *s)
{
    store_lock_seq(st, seq_id);
    seq *q;
    status_code rc = store_remote_seq_locked(st, token, seq_id, "export", &q, s);
    if (rc == ST_OK)
        rc = export_copy(st, q, j, s);
    store_unlock(st);
    return rc;
}

status_code store_seq_export(store *st, const char *token, uint64_t seq_id,
                             store_export_result *out, status *s)
{
    memset(out, 0, sizeof *out);
    if (store_need_remote(st, s) != ST_OK || remote_uid_new(out->uid, s) != ST_OK)
        return s->code;
    export_job j = {0};
    migrate_values v = {0};
    status_code rc = export_take(st, token, seq_id, &j, s);
    const char *ns = remote_tier_namespace(st->remote);
    if (rc == ST_OK)
        rc = migrate_encode(&j.x, &j.geom, j.quant_group, j.block_bytes, j.bytes, ns, j.tenant,
                            out->uid, &v, s);
    free(j.bytes);
    j.bytes = NULL;
    /* The manifest last: a reader that finds it finds every value it names. */
    if (rc == ST_OK && v.n > 1)
        rc = store_remote_write(st->remote, v.kv, v.n - 1, s);
    if (rc == ST_OK)
        rc = store_remote_write(st->remote, v.kv + v.n - 1, 1, s);
    if (rc == ST_OK) {
        for (size_t i = 0; i < v.n; i++)
            out->bytes += v.kv[i].len;
        out->values = (uint32_t)v.n;
        out->blocks = (uint32_t)j.x.nblocks;
        out->tokens = j.tokens;
        out->ttl_s = remote_tier_ttl(st->remote);
        snprintf(out->key_prefix, sizeof out->key_prefix, "kvs:%s:{%s:%s}:", ns, j.tenant,
                 out->uid);
        log_info("seq_exported", "seq=%llu uid=%s blocks=%u tokens=%llu bytes=%llu values=%u",
                 (unsigned long long)seq_id, out->uid, out->blocks, (unsigned long long)out->tokens,
                 (unsigned long long)out->bytes, out->values);
    }
    migrate_values_free(&v);
    seq_export_free(&j.x);
    return rc;
}

/* ---- import ---------------------------------------------------------------- */

/* The session an import fills and what the remote part needs of its pool. */
typedef struct import_target {
    uint64_t session_id, pool_id;
    pool_geometry geom;
    uint32_t quant_group;
    size_t block_bytes;
    char tenant[65];
} import_target;

/* Lock held: the caller's session, or session_id's for an operator. */
static status_code find_target(store *st, const char *token, uint64_t session_id, session **out,
                               status *s)
{
    session *caller = NULL;
    if (store_need_session_locked(st, token, session_id == 0, &caller, s) != ST_OK)
        return s->code;
    if (session_id == 0 || session_id == caller->id) {
        *out = caller;
        return caller->attached ? ST_OK
                                : status_set(s, ST_FAILED_PRECONDITION,
                                             "session is not attached: call Attach first");
    }
    if (!store_is_operator(st, caller->uid))
        return status_set(s, ST_PERMISSION_DENIED,
                          "session %llu (uid %u) may not import into session %llu: only uids in "
                          "kvstashd's operator_uids act on other sessions",
                          (unsigned long long)caller->id, (unsigned)caller->uid,
                          (unsigned long long)session_id);
    *out = store_find_session_id_locked(st, session_id);
    if (*out == NULL || !(*out)->attached)
        return status_set(s, ST_NOT_FOUND, "no attached session %llu",
                          (unsigned long long)session_id);
    return ST_OK;
}

static status_code import_target_get(store *st, const char *token, uint64_t session_id,
                                     import_target *t, status *s)
{
    pthread_mutex_lock(&st->lock);
    session *se = NULL;
    status_code rc = find_target(st, token, session_id, &se, s);
    if (rc == ST_OK) {
        *t = (import_target){.session_id = se->id,
                             .pool_id = se->pool->id,
                             .geom = se->pool->geom,
                             .quant_group = kv_lowbit_group(&se->pool->layout),
                             .block_bytes = se->pool->block_bytes};
        snprintf(t->tenant, sizeof t->tenant, "%s", store_remote_tenant(se->pool));
    }
    store_unlock(st);
    return rc;
}

/* The manifest, checked into plan. */
static status_code import_manifest(store *st, const import_target *t, const char *uid,
                                   migrate_plan *plan, uint64_t *read, status *s)
{
    char key[REMOTE_KEY_CAP];
    const char *ns = remote_tier_namespace(st->remote);
    if (remote_key(key, sizeof key, ns, t->tenant, uid, "manifest", s) != ST_OK)
        return s->code;
    const char *keys[1] = {key};
    remote_buf m = {0};
    if (store_remote_read(st->remote, keys, 1, &m, s) != ST_OK)
        return s->code;
    status_code rc = ST_OK;
    if (!m.found)
        rc = status_set(s, ST_NOT_FOUND,
                        "no exported sequence %s in namespace %s for tenant %s (never exported, "
                        "expired after its time to live, or another tenant's)",
                        uid, ns, t->tenant);
    if (rc == ST_OK)
        rc = migrate_decode_manifest(m.data, m.len, &t->geom, t->quant_group, plan, s);
    if (rc == ST_OK)
        rc = migrate_plan_check_origin(plan, ns, t->tenant, uid, s);
    *read = m.len;
    remote_bufs_free(&m, 1);
    return rc;
}

/* Every value the plan names, checked, its blocks written straight into
 * the pool blocks the import took (blocks[export index]): nobody else can
 * see them yet, so without the lock; a sketch's cells go to the image. */
static status_code import_values(store *st, const char *uid, migrate_plan *plan, pool *p,
                                 const uint32_t *blocks, uint64_t *read, status *s)
{
    remote_buf *vals = calloc(plan->ndata ? plan->ndata : 1, sizeof *vals);
    uint32_t *ids = malloc((plan->image.nblocks ? plan->image.nblocks : 1) * sizeof *ids);
    status_code rc = vals && ids ? ST_OK : status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    if (rc == ST_OK && plan->ndata > 0)
        rc = store_remote_read(st->remote, (const char *const *)plan->data_keys, plan->ndata, vals,
                               s);
    for (size_t i = 0; rc == ST_OK && i < plan->ndata; i++) {
        const uint8_t *payload = NULL;
        const migrate_data *d = &plan->data[i];
        *read += vals[i].len;
        if (!vals[i].found)
            rc = status_set(s, ST_DATA_LOSS,
                            "value %s of export %s is missing (expired, or lost in a failover "
                            "before it replicated): export the sequence again",
                            plan->data_keys[i], uid);
        else if (migrate_check_data(plan, i, vals[i].data, vals[i].len, &payload, s) != ST_OK)
            rc = s->code;
        for (size_t k = 0; rc == ST_OK && payload != NULL && k < d->nblocks; k++)
            ids[k] = blocks[d->blocks[k]];
        if (rc == ST_OK && payload != NULL && pool_write_blocks(p, ids, d->nblocks, payload) != 0)
            rc = status_set(s, ST_INTERNAL, "writing the imported blocks failed");
        free(vals[i].data); /* the peak is what was fetched, not twice it */
        vals[i].data = NULL;
    }
    if (vals != NULL)
        remote_bufs_free(vals, plan->ndata);
    free(vals);
    free(ids);
    return rc;
}

/* Lock held: the target session again (it may have gone meanwhile), its
 * quotas and the pool's blocks, taken. The pool is held (p->holds) so
 * that it outlives the session while the blocks are written without the
 * lock; import_publish lets it go. */
static status_code import_take(store *st, const import_target *t, const seq_export *x,
                               pool **pool_out, uint32_t **blocks_out, status *s)
{
    session *se = store_find_session_id_locked(st, t->session_id);
    if (se == NULL || !se->attached || se->pool->id != t->pool_id)
        return status_set(s, ST_NOT_FOUND, "session %llu ended during the import",
                          (unsigned long long)t->session_id);
    if (store_seq_room_locked(st, se, s) != ST_OK ||
        store_check_session_blocks_locked(st, se, x->nblocks, "this import", s) != ST_OK)
        return s->code;
    pool *p = se->pool;
    if (x->nblocks > p->nfree)
        return status_set(s, ST_RESOURCE_EXHAUSTED,
                          "the import needs %zu pool blocks, the pool has %u free", x->nblocks,
                          p->nfree);
    uint32_t *blocks = malloc((x->nblocks ? x->nblocks : 1) * sizeof *blocks);
    if (blocks == NULL)
        return status_set(s, ST_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < x->nblocks; i++)
        pool_alloc_block(p, &blocks[i]);
    p->holds++;
    *pool_out = p;
    *blocks_out = blocks;
    return ST_OK;
}

/* Whether an image has a sketch (tokens or victims in one, or cells). */
static int image_has_sketch(const seq_export *x)
{
    for (size_t i = 0; i < (size_t)x->layers * x->heads; i++)
        if (x->lists[i].sketch_bytes > 0)
            return 1;
    return 0;
}

/* Lock held, the blocks written (rc ST_OK) or not (rc and *s the
 * failure): the sequence built and published in the session, if it is
 * still there; else the blocks go back (and the pool, if nothing else
 * keeps it). */
static status_code import_publish(store *st, const import_target *t, const migrate_plan *plan,
                                  pool *p, uint32_t *blocks, status_code rc,
                                  store_import_result *out, status *s)
{
    const seq_export *x = &plan->image;
    p->holds--;
    session *se = store_find_session_id_locked(st, t->session_id);
    seq *q = NULL;
    if (rc != ST_OK)
        ; /* the values' failure stands */
    else if (se == NULL || !se->attached || se->pool != p)
        rc = status_set(s, ST_NOT_FOUND, "session %llu ended during the import",
                        (unsigned long long)t->session_id);
    else
        rc = seq_import(st->next_seq_id, se->id, p, x, blocks, &q, s);
    if (rc != ST_OK) {
        for (size_t i = x->nblocks; i-- > 0;)
            pool_free_block(p, blocks[i]);
        free(blocks);
        store_drop_pool_if_unused_locked(st, p);
        return rc;
    }
    free(blocks);
    /* As at CreateSequence: a sequence whose own configuration fills
     * sketches (victims=sketch, reviver) reserves their worst case now; so
     * does one that came with sketches of an operator's offload, as that
     * offload did (store_operator.c). */
    if ((seq_sketches(q) || image_has_sketch(x)) &&
        store_sketch_reserve_locked(st, q, s) != ST_OK) {
        seq_destroy(q); /* its blocks with it */
        return s->code;
    }
    store_seq_add_locked(st, se, q, "seq.imported");
    out->seq_id = seq_id_of(q);
    out->epoch = seq_epoch(q);
    out->appended = seq_appended(q);
    out->policy = seq_policy(q);
    out->params = *seq_params(q);
    out->blocks = (uint32_t)x->nblocks;
    return ST_OK;
}

status_code store_seq_import(store *st, const char *token, const char *uid, uint64_t session_id,
                             store_import_result *out, status *s)
{
    memset(out, 0, sizeof *out);
    if (store_need_remote(st, s) != ST_OK)
        return s->code;
    if (strlen(uid) != REMOTE_UID_LEN || strspn(uid, "0123456789abcdef") != REMOTE_UID_LEN)
        return status_set(s, ST_INVALID_ARGUMENT,
                          "uid must be the %d lowercase hex digits ExportSequence answered, got "
                          "'%.64s'",
                          REMOTE_UID_LEN, uid);
    import_target t;
    if (import_target_get(st, token, session_id, &t, s) != ST_OK)
        return s->code;
    migrate_plan plan = {0};
    status_code rc = import_manifest(st, &t, uid, &plan, &out->bytes, s);
    pool *p = NULL;
    uint32_t *blocks = NULL;
    if (rc == ST_OK) {
        pthread_mutex_lock(&st->lock);
        rc = import_take(st, &t, &plan.image, &p, &blocks, s);
        store_unlock(st);
    }
    if (rc == ST_OK) {
        rc = import_values(st, uid, &plan, p, blocks, &out->bytes, s);
        pthread_mutex_lock(&st->lock);
        rc = import_publish(st, &t, &plan, p, blocks, rc, out, s);
        store_unlock(st);
    }
    if (rc == ST_OK)
        log_info("seq_imported", "seq=%llu uid=%s session=%llu blocks=%u bytes=%llu",
                 (unsigned long long)out->seq_id, uid, (unsigned long long)t.session_id,
                 out->blocks, (unsigned long long)out->bytes);
    migrate_plan_free(&plan);
    return rc;
}
