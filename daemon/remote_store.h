/*
 * remote_store.h - the remote tier's store: a distributed key-value store
 * that holds bytes beyond this host (docs/remote.md).
 *
 * kvstashd keeps nothing of its own remotely: it writes values (the tier's
 * own bytes behind a header, remote_value.h) under keys (remote_value.h
 * remote_key) to an existing store and reads them back. This header is the
 * whole of what the daemon knows of that store, so that the client behind
 * it can be replaced (a packaged Redis Cluster client, another store)
 * without touching a caller. The one implementation today is
 * redis_cluster.h (Redis Cluster through hiredis, routed by slot).
 *
 * Keys are NUL-terminated strings; values are bytes. Every call is
 * synchronous, bounded by the store's timeout, and thread-safe (the
 * implementation serialises its calls): the daemon calls it without the
 * store's lock, so a slow or dead node stalls only the caller.
 *
 * Errors (status.h), with a message that names the node and what to fix:
 *   ST_UNAVAILABLE          no node answered, the cluster is down
 *                           (CLUSTERDOWN), or redirects did not settle
 *   ST_DEADLINE_EXCEEDED    a node did not answer within the timeout
 *   ST_RESOURCE_EXHAUSTED   the store is full (Redis: OOM, maxmemory)
 *   ST_INVALID_ARGUMENT     a key or value the store refuses
 *   ST_INTERNAL             out of memory here, or an answer of the wrong shape
 * A call over many keys that fails may have written some of them: callers
 * write a manifest last (docs/remote.md "Consistency").
 */
#ifndef KVSTASH_REMOTE_STORE_H
#define KVSTASH_REMOTE_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "status.h"

/* One value to write. */
typedef struct remote_kv {
    const char *key;
    const void *val;
    size_t len;
} remote_kv;

/* One value read: data is malloc'd and the caller's (free), NULL with
 * found = 0 when the key does not exist (expired, never written, lost). */
typedef struct remote_buf {
    void *data;
    size_t len;
    int found;
} remote_buf;

/* What an operator sees of the store (Stats, /metrics, health details):
 * counts since open, and the last error's message. */
typedef struct remote_health {
    int ok;                 /* the last call succeeded and every slot has a node */
    uint32_t nodes;         /* masters in the last topology */
    uint32_t nodes_up;      /* masters whose connection is open and answered */
    uint32_t slots_covered; /* of 16384 */
    uint64_t calls, errors; /* calls made, calls that failed */
    uint64_t timeouts;      /* calls that failed for a node's timeout */
    uint64_t redirects;     /* MOVED and ASK answers followed */
    uint64_t refreshes;     /* topology reloads (CLUSTER SLOTS) */
    uint64_t bytes_written, bytes_read;
    char last_error[STATUS_MSG_LEN];
} remote_health;

typedef struct remote_store remote_store;

typedef struct remote_store_ops {
    const char *name; /* "redis-cluster" */
    /* Write n values (pipelined where the store can), each with a time to
     * live of ttl_s seconds (0: none). */
    status_code (*put)(remote_store *r, const remote_kv *kv, size_t n, uint32_t ttl_s, status *st);
    /* Read n keys into out[0..n) (zeroed first; on failure nothing is left
     * allocated). */
    status_code (*get)(remote_store *r, const char *const *keys, size_t n, remote_buf *out,
                       status *st);
    /* Delete n keys; missing ones are not an error. */
    status_code (*del)(remote_store *r, const char *const *keys, size_t n, status *st);
    void (*health)(remote_store *r, remote_health *out);
    /* Ask every node of the topology whether it answers (refreshing the
     * topology first when one does not): OK when all do and every slot has
     * a node; it updates what health reports. */
    status_code (*ping)(remote_store *r, status *st);
    void (*close)(remote_store *r); /* frees r */
} remote_store_ops;

/* Implementations put this first in their own struct. */
struct remote_store {
    const remote_store_ops *ops;
};

static inline status_code remote_put(remote_store *r, const remote_kv *kv, size_t n, uint32_t ttl_s,
                                     status *st)
{
    return r->ops->put(r, kv, n, ttl_s, st);
}

static inline status_code remote_get(remote_store *r, const char *const *keys, size_t n,
                                     remote_buf *out, status *st)
{
    return r->ops->get(r, keys, n, out, st);
}

static inline status_code remote_del(remote_store *r, const char *const *keys, size_t n, status *st)
{
    return r->ops->del(r, keys, n, st);
}

static inline void remote_health_get(remote_store *r, remote_health *out)
{
    r->ops->health(r, out);
}

static inline status_code remote_ping(remote_store *r, status *st)
{
    return r->ops->ping(r, st);
}

static inline void remote_close(remote_store *r)
{
    if (r != NULL)
        r->ops->close(r);
}

/* Free the data of n bufs and zero them. */
static inline void remote_bufs_free(remote_buf *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(b[i].data);
        b[i] = (remote_buf){0};
    }
}

#endif
