/*
 * redis_cluster.c - a Redis Cluster client over hiredis 0.14 behind
 * remote_store.h (redis_cluster.h says what it does; the Redis Cluster
 * specification, "Redirection and resharding", says why).
 *
 * Nodes live in one table that only grows (an index stays valid for the
 * store's life, so the slot map holds indices): seeds, masters and replicas
 * of every map loaded, and nodes named by MOVED or ASK. A call routes each
 * of its keys to a node (an ASK target, else the slot's owner), sends every
 * node its commands, reads every reply, and repeats for the keys that were
 * redirected or whose node failed, until all are done or the call fails.
 */
#include "redis_cluster.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "log.h"

#define RC_HOST_MAX 256           /* a node's host, NUL included */
#define RC_MAX_NODES 1024         /* the table's bound (the slot map holds int16_t) */
#define RC_MAX_ROUNDS 64          /* rounds of one call: a guard, redirects bound it first */
#define RC_FLUSH_BYTES (1u << 20) /* a pipeline goes out in writes of about this */

typedef enum rc_op { RC_PUT, RC_GET, RC_DEL } rc_op;

typedef struct rc_node {
    char host[RC_HOST_MAX];
    int port;
    redisContext *ctx; /* NULL until first used, and after a failure */
    int master;        /* owns slots in the last map */
    int up;            /* ctx open and its last answer read */
} rc_node;

typedef struct redis_cluster {
    remote_store base;  /* first: remote_store.h */
    pthread_mutex_t mu; /* held by every call */
    uint32_t timeout_ms;
    char seeds[STATUS_MSG_LEN / 2]; /* as given, for messages (may be cut) */
    rc_node *nodes;
    size_t n_nodes, cap_nodes;
    int16_t owner[REDIS_CLUSTER_SLOTS];   /* node index per slot, -1: none */
    int16_t scratch[REDIS_CLUSTER_SLOTS]; /* a map being parsed */
    uint32_t slots_covered;
    int need_refresh; /* a MOVED or a failure asks for CLUSTER SLOTS */
    int last_ok;
    remote_health h; /* counters and last_error; the rest is computed */
} redis_cluster;

/* One key of a call. */
typedef struct rc_key {
    uint16_t slot;
    int16_t ask;  /* node of an ASK redirect, -1: none */
    int16_t node; /* node its command went to this round, -1: not sent */
    uint8_t redirs;
    uint8_t done;
} rc_key;

/* One call: its arguments, its keys, what the rounds found. */
typedef struct rc_call {
    redis_cluster *rc;
    rc_op op;
    const remote_kv *kv;     /* RC_PUT */
    const char *const *keys; /* RC_GET, RC_DEL */
    remote_buf *out;         /* RC_GET */
    size_t n;
    char ttl[16]; /* RC_PUT's EX argument, "" for none */
    rc_key *k;
    size_t pending;
    status fatal;     /* the first error that ends the call; ST_OK: none */
    int timed_out;    /* fatal is a node's timeout */
    int conn_failed;  /* a node's connection failed this round */
    status conn_err;  /* and what it said */
    int conn_retried; /* the one retry after a connection failure is spent */
    int retry_later;  /* CLUSTERDOWN, TRYAGAIN or LOADING this round */
    status retry_err; /* and what it said */
    uint64_t deadline_ns;
} rc_call;

static const remote_store_ops rc_ops;

/* ---- CRC16 and slots --------------------------------------------------- */

/* CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, no reflection,
 * as the Redis Cluster specification (Appendix A) uses. */
static uint16_t crc16_xmodem(const unsigned char *p, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

uint16_t redis_cluster_key_slot(const char *key, size_t len)
{
    /* Spec, "Hash tags": the bytes between the first '{' and the first '}'
     * after it, if that is not empty; otherwise the whole key. */
    if (len == 0)
        return 0; /* CRC16 of nothing */
    const char *open = memchr(key, '{', len);
    if (open != NULL) {
        size_t start = (size_t)(open - key) + 1;
        const char *close = memchr(key + start, '}', len - start);
        if (close != NULL && close > key + start)
            return crc16_xmodem((const unsigned char *)key + start,
                                (size_t)(close - (key + start))) &
                   (REDIS_CLUSTER_SLOTS - 1);
    }
    return crc16_xmodem((const unsigned char *)key, len) & (REDIS_CLUSTER_SLOTS - 1);
}

/* ---- time --------------------------------------------------------------- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ---- nodes -------------------------------------------------------------- */

/* The index of host:port, added when new; -1 when the table is full or out
 * of memory (st says which). */
static int node_find_or_add(redis_cluster *rc, const char *host, size_t host_len, int port,
                            status *st)
{
    if (host_len >= RC_HOST_MAX) {
        status_set(st, ST_INTERNAL, "node host \"%.64s...\" is longer than %d bytes", host,
                   RC_HOST_MAX - 1);
        return -1;
    }
    for (size_t i = 0; i < rc->n_nodes; i++)
        if (rc->nodes[i].port == port && strlen(rc->nodes[i].host) == host_len &&
            memcmp(rc->nodes[i].host, host, host_len) == 0)
            return (int)i;
    if (rc->n_nodes == RC_MAX_NODES) {
        status_set(st, ST_INTERNAL, "more than %d cluster nodes seen", RC_MAX_NODES);
        return -1;
    }
    if (rc->n_nodes == rc->cap_nodes) {
        size_t cap = rc->cap_nodes ? rc->cap_nodes * 2 : 16;
        rc_node *nodes = realloc(rc->nodes, cap * sizeof *nodes);
        if (nodes == NULL) {
            status_set(st, ST_INTERNAL, "out of memory for the cluster's node table");
            return -1;
        }
        rc->nodes = nodes;
        rc->cap_nodes = cap;
    }
    rc_node *nd = &rc->nodes[rc->n_nodes];
    memset(nd, 0, sizeof *nd);
    memcpy(nd->host, host, host_len);
    nd->host[host_len] = '\0';
    nd->port = port;
    return (int)rc->n_nodes++;
}

static void node_drop(rc_node *nd)
{
    if (nd->ctx != NULL)
        redisFree(nd->ctx);
    nd->ctx = NULL;
    nd->up = 0;
}

static struct timeval timeout_tv(const redis_cluster *rc)
{
    return (struct timeval){(time_t)(rc->timeout_ms / 1000),
                            (suseconds_t)(rc->timeout_ms % 1000) * 1000};
}

/* Open node i's connection if it has none. ST_UNAVAILABLE naming the node
 * when it refuses or does not answer; ST_INTERNAL when out of memory. */
static status_code node_connect(redis_cluster *rc, int i, status *st)
{
    rc_node *nd = &rc->nodes[i];
    if (nd->ctx != NULL)
        return ST_OK;
    struct timeval tv = timeout_tv(rc);
    redisContext *c = redisConnectWithTimeout(nd->host, nd->port, tv);
    if (c == NULL)
        return status_set(st, ST_INTERNAL, "out of memory connecting to node %s:%d", nd->host,
                          nd->port);
    if (c->err != 0) {
        status_set(st, ST_UNAVAILABLE, "node %s:%d: connect: %s", nd->host, nd->port, c->errstr);
        redisFree(c);
        return st->code;
    }
    if (redisSetTimeout(c, tv) != REDIS_OK) {
        status_set(st, ST_UNAVAILABLE, "node %s:%d: setting its %u ms timeout: %s", nd->host,
                   nd->port, rc->timeout_ms, c->errstr);
        redisFree(c);
        return st->code;
    }
    nd->ctx = c;
    return ST_OK;
}

/* A hiredis error on node i's connection (errno_saved: errno right after
 * it): the connection is dropped, and the status says whether it was the
 * timeout (ST_DEADLINE_EXCEEDED), a failure (ST_UNAVAILABLE), or a reply
 * hiredis could not parse or store (ST_INTERNAL). */
static status_code node_io_error(redis_cluster *rc, int i, int errno_saved, status *st)
{
    rc_node *nd = &rc->nodes[i];
    redisContext *c = nd->ctx;
    int timeout = c != NULL && c->err == REDIS_ERR_IO &&
                  (errno_saved == EAGAIN || errno_saved == EWOULDBLOCK ||
                   strstr(c->errstr, "Resource temporarily unavailable") != NULL);
    if (timeout)
        status_set(st, ST_DEADLINE_EXCEEDED,
                   "node %s:%d did not answer within %u ms (connection dropped)", nd->host,
                   nd->port, rc->timeout_ms);
    else if (c != NULL && c->err == REDIS_ERR_OOM)
        status_set(st, ST_INTERNAL, "out of memory reading from node %s:%d", nd->host, nd->port);
    else if (c != NULL && c->err == REDIS_ERR_PROTOCOL)
        status_set(st, ST_INTERNAL, "node %s:%d sent a malformed reply: %s", nd->host, nd->port,
                   c->errstr);
    else
        status_set(st, ST_UNAVAILABLE, "node %s:%d: %s", nd->host, nd->port,
                   c != NULL && c->errstr[0] ? c->errstr : "connection failed");
    log_warn("remote_node_dropped", "node=%s:%d code=%s timeout_ms=%u", nd->host, nd->port,
             status_name(st->code), rc->timeout_ms);
    node_drop(nd);
    return st->code;
}

/* ---- the slot map (CLUSTER SLOTS) ---------------------------------------- */

/* The node index of one CLUSTER SLOTS node entry [host, port, id, ...];
 * an empty host is the answering node's (spec: "unknown endpoint"). -1 when
 * the entry is malformed or the table full (st says which); -2 when the
 * host is "?" (an endpoint the node does not know yet: skipped). */
static int slots_entry_node(redis_cluster *rc, int from, const redisReply *e, status *st)
{
    if (e == NULL || e->type != REDIS_REPLY_ARRAY || e->elements < 2 || e->element[0] == NULL ||
        e->element[0]->type != REDIS_REPLY_STRING || e->element[1] == NULL ||
        e->element[1]->type != REDIS_REPLY_INTEGER || e->element[1]->integer < 1 ||
        e->element[1]->integer > 65535) {
        status_set(st, ST_INTERNAL, "node %s:%d answered CLUSTER SLOTS with a malformed node entry",
                   rc->nodes[from].host, rc->nodes[from].port);
        return -1;
    }
    const redisReply *h = e->element[0];
    if (h->len == 1 && h->str[0] == '?')
        return -2;
    int port = (int)e->element[1]->integer;
    if (h->len == 0) {
        char host[RC_HOST_MAX];
        snprintf(host, sizeof host, "%s", rc->nodes[from].host);
        return node_find_or_add(rc, host, strlen(host), port, st);
    }
    return node_find_or_add(rc, h->str, h->len, port, st);
}

/* Parse a CLUSTER SLOTS answer of node `from` into rc->scratch. */
static status_code slots_parse(redis_cluster *rc, int from, const redisReply *r, status *st)
{
    for (size_t s = 0; s < REDIS_CLUSTER_SLOTS; s++)
        rc->scratch[s] = -1;
    if (r->type != REDIS_REPLY_ARRAY)
        return status_set(st, ST_INTERNAL, "node %s:%d answered CLUSTER SLOTS with type %d",
                          rc->nodes[from].host, rc->nodes[from].port, r->type);
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e == NULL || e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0] == NULL ||
            e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1] == NULL ||
            e->element[1]->type != REDIS_REPLY_INTEGER || e->element[0]->integer < 0 ||
            e->element[1]->integer >= REDIS_CLUSTER_SLOTS ||
            e->element[0]->integer > e->element[1]->integer)
            return status_set(st, ST_INTERNAL,
                              "node %s:%d answered CLUSTER SLOTS with a malformed range",
                              rc->nodes[from].host, rc->nodes[from].port);
        /* Replicas (elements 3..) are remembered for later refreshes. */
        for (size_t j = 3; j < e->elements; j++)
            if (slots_entry_node(rc, from, e->element[j], st) == -1)
                return st->code;
        int m = slots_entry_node(rc, from, e->element[2], st);
        if (m == -1)
            return st->code;
        if (m == -2)
            continue;
        for (long long s = e->element[0]->integer; s <= e->element[1]->integer; s++)
            rc->scratch[s] = (int16_t)m;
    }
    return ST_OK;
}

/* Install rc->scratch as the map; masters are the nodes that own a slot. */
static void slots_commit(redis_cluster *rc)
{
    memcpy(rc->owner, rc->scratch, sizeof rc->owner);
    for (size_t i = 0; i < rc->n_nodes; i++)
        rc->nodes[i].master = 0;
    rc->slots_covered = 0;
    for (size_t s = 0; s < REDIS_CLUSTER_SLOTS; s++)
        if (rc->owner[s] >= 0) {
            rc->nodes[rc->owner[s]].master = 1;
            rc->slots_covered++;
        }
}

/* Ask node i for its map, into rc->scratch (not installed); *covered is
 * the slots it has a node for. ST_FAILED_PRECONDITION when the node is not
 * in cluster mode; ST_UNAVAILABLE or ST_DEADLINE_EXCEEDED when it does not
 * answer; ST_INTERNAL for an answer of the wrong shape. */
static status_code slots_load_from(redis_cluster *rc, int i, uint32_t *covered, status *st)
{
    if (node_connect(rc, i, st) != ST_OK)
        return st->code;
    rc_node *nd = &rc->nodes[i];
    redisReply *r = redisCommand(nd->ctx, "CLUSTER SLOTS");
    if (r == NULL)
        return node_io_error(rc, i, errno, st);
    nd->up = 1;
    status_code code = ST_OK;
    if (r->type == REDIS_REPLY_ERROR) {
        if (strstr(r->str, "cluster support disabled") != NULL)
            code = status_set(st, ST_FAILED_PRECONDITION,
                              "node %s:%d is not in cluster mode (cluster-enabled no): "
                              "the remote tier needs a Redis Cluster",
                              nd->host, nd->port);
        else
            code = status_set(st, ST_UNAVAILABLE, "node %s:%d: CLUSTER SLOTS: %.160s", nd->host,
                              nd->port, r->str);
    } else {
        code = slots_parse(rc, i, r, st);
        *covered = 0;
        for (size_t s = 0; code == ST_OK && s < REDIS_CLUSTER_SLOTS; s++)
            *covered += rc->scratch[s] >= 0;
    }
    freeReplyObject(r);
    return code;
}

static int is_oom(const status *st)
{
    return st->code == ST_INTERNAL && strstr(st->msg, "out of memory") != NULL;
}

/* Reload the map: masters with an open connection are asked first, then
 * other open ones, then masters, then the rest (seeds among them). The
 * first map that covers every slot is installed; failing that, the fullest
 * one. ST_OK when a map was installed; otherwise the old map stays and the
 * error is the first node that answered wrongly (ST_FAILED_PRECONDITION,
 * ST_INTERNAL), else the last that did not answer. Each node tried may
 * take up to the timeout. */
static status_code slots_refresh(redis_cluster *rc, status *st)
{
    rc->h.refreshes++;
    rc->need_refresh = 0;
    int16_t order[RC_MAX_NODES];
    size_t n = 0;
    for (int pass = 0; pass < 4; pass++)
        for (size_t i = 0; i < rc->n_nodes; i++)
            if ((rc->nodes[i].ctx != NULL) == (pass < 2) && rc->nodes[i].master == (pass % 2 == 0))
                order[n++] = (int16_t)i;
    int installed = 0;
    status bad = {ST_OK, ""};
    status_set(st, ST_UNAVAILABLE, "no cluster node known");
    for (size_t o = 0; o < n; o++) {
        uint32_t covered = 0;
        status_code code = slots_load_from(rc, order[o], &covered, st);
        if (code == ST_OK) {
            if (!installed || covered > rc->slots_covered) {
                slots_commit(rc);
                installed = 1;
                log_debug("remote_refresh", "node=%s:%d slots=%u", rc->nodes[order[o]].host,
                          rc->nodes[order[o]].port, covered);
            }
            if (covered == REDIS_CLUSTER_SLOTS)
                return ST_OK;
            continue;
        }
        if (is_oom(st))
            return st->code;
        if ((code == ST_FAILED_PRECONDITION || code == ST_INTERNAL) && bad.code == ST_OK)
            bad = *st;
    }
    if (installed)
        return ST_OK;
    if (bad.code != ST_OK)
        *st = bad;
    char esc[2 * STATUS_MSG_LEN];
    log_escape(st->msg, esc, sizeof esc);
    log_warn("remote_refresh_failed", "code=%s err=\"%s\"", status_name(st->code), esc);
    return st->code;
}

/* ---- seeds -------------------------------------------------------------- */

/* Add every "host:port" of `seeds` to the node table, in order. */
static status_code seeds_parse(redis_cluster *rc, const char *seeds, status *st)
{
    if (seeds == NULL || seeds[strspn(seeds, " \t")] == '\0')
        return status_set(st, ST_INVALID_ARGUMENT,
                          "no remote seeds: expected host:port[,host:port...]");
    const char *p = seeds;
    for (;;) {
        const char *end = strchr(p, ',');
        if (end == NULL)
            end = p + strlen(p);
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        const char *e = end;
        while (e > p && (e[-1] == ' ' || e[-1] == '\t'))
            e--;
        int len = (int)(e - p);
        if (len == 0)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote seeds \"%.100s\" have an empty entry: expected "
                              "host:port[,host:port...]",
                              seeds);
        const char *host = p, *colon;
        size_t host_len;
        if (*p == '[') { /* [v6]:port */
            const char *rb = memchr(p, ']', (size_t)len);
            if (rb == NULL || rb + 1 >= e || rb[1] != ':')
                return status_set(st, ST_INVALID_ARGUMENT,
                                  "remote seed \"%.*s\": expected [ipv6]:port", len, p);
            host = p + 1;
            host_len = (size_t)(rb - host);
            colon = rb + 1;
        } else {
            colon = NULL;
            for (const char *q = p; q < e; q++)
                if (*q == ':')
                    colon = q;
            if (colon == NULL)
                return status_set(st, ST_INVALID_ARGUMENT,
                                  "remote seed \"%.*s\" has no port: expected host:port", len, p);
            host_len = (size_t)(colon - p);
        }
        if (host_len == 0)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote seed \"%.*s\" has no host: expected host:port", len, p);
        long port = 0;
        const char *q = colon + 1;
        for (; q < e && *q >= '0' && *q <= '9' && port <= 65535; q++)
            port = port * 10 + (*q - '0');
        if (q == colon + 1 || q != e || port < 1 || port > 65535)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote seed \"%.*s\": the port must be a number in 1..65535", len,
                              p);
        if (host_len >= RC_HOST_MAX)
            return status_set(st, ST_INVALID_ARGUMENT,
                              "remote seed \"%.64s...\": the host is longer than %d bytes", p,
                              RC_HOST_MAX - 1);
        if (node_find_or_add(rc, host, host_len, (int)port, st) < 0)
            return st->code;
        if (*end == '\0')
            return ST_OK;
        p = end + 1;
    }
}

/* ---- a call ------------------------------------------------------------- */

static const char *call_key(const rc_call *c, size_t i)
{
    return c->op == RC_PUT ? c->kv[i].key : c->keys[i];
}

static const char *op_name(rc_op op)
{
    return op == RC_PUT ? "SET" : op == RC_GET ? "GET" : "DEL";
}

static void call_fail(rc_call *c, status_code code, const status *from)
{
    if (c->fatal.code == ST_OK) {
        c->fatal = *from;
        c->fatal.code = code;
    }
}

/* Append key i's command (after ASKING when it follows an ASK) to ctx. */
static int append_key(rc_call *c, redisContext *ctx, size_t i)
{
    if (c->k[i].ask >= 0 && redisAppendCommand(ctx, "ASKING") != REDIS_OK)
        return -1;
    const char *key = call_key(c, i);
    if (c->op == RC_PUT) {
        const char *argv[5] = {"SET", key, c->kv[i].val ? (const char *)c->kv[i].val : "", "EX",
                               c->ttl};
        size_t argvlen[5] = {3, strlen(key), c->kv[i].len, 2, strlen(c->ttl)};
        return redisAppendCommandArgv(ctx, c->ttl[0] ? 5 : 3, argv, argvlen) == REDIS_OK ? 0 : -1;
    }
    const char *argv[2] = {op_name(c->op), key};
    size_t argvlen[2] = {3, strlen(key)};
    return redisAppendCommandArgv(ctx, 2, argv, argvlen) == REDIS_OK ? 0 : -1;
}

/* Node j's connection failed this round (st says how): its unanswered keys
 * are routed again next round, after a refresh. */
static void round_node_failed(rc_call *c, int j, const status *st)
{
    for (size_t i = 0; i < c->n; i++)
        if (c->k[i].node == j) {
            c->k[i].node = -1;
            if (c->k[i].ask == j)
                c->k[i].ask = -1;
        }
    if (st->code == ST_DEADLINE_EXCEEDED) {
        c->timed_out = 1;
        call_fail(c, st->code, st);
    } else if (st->code != ST_UNAVAILABLE) {
        call_fail(c, st->code, st);
    } else if (!c->conn_failed) {
        c->conn_failed = 1;
        c->conn_err = *st;
    }
}

/* Parse "<slot> <host>:<port>" after MOVED or ASK; the host may be empty
 * (the answering node's). Returns the target node or -1. */
static int parse_redirect(rc_call *c, int from, const char *text, unsigned *slot, status *st)
{
    redis_cluster *rc = c->rc;
    char *end;
    unsigned long s = strtoul(text, &end, 10);
    const char *addr = end;
    while (*addr == ' ')
        addr++;
    const char *colon = strrchr(addr, ':');
    if (end == text || *end != ' ' || s >= REDIS_CLUSTER_SLOTS || colon == NULL) {
        status_set(st, ST_INTERNAL, "node %s:%d sent a malformed redirect: %.160s",
                   rc->nodes[from].host, rc->nodes[from].port, text);
        return -1;
    }
    char *pend;
    long port = strtol(colon + 1, &pend, 10);
    if (pend == colon + 1 || *pend != '\0' || port < 1 || port > 65535) {
        status_set(st, ST_INTERNAL, "node %s:%d sent a redirect with a bad port: %.160s",
                   rc->nodes[from].host, rc->nodes[from].port, text);
        return -1;
    }
    *slot = (unsigned)s;
    const char *host = addr;
    size_t host_len = (size_t)(colon - addr);
    char self[RC_HOST_MAX];
    if (host_len == 0) {
        snprintf(self, sizeof self, "%s", rc->nodes[from].host);
        host = self;
        host_len = strlen(self);
    } else if (host[0] == '[' && host_len >= 2 && host[host_len - 1] == ']') {
        host++;
        host_len -= 2;
    }
    return node_find_or_add(rc, host, host_len, (int)port, st);
}

/* An error reply to key i from node j. */
static void on_error_reply(rc_call *c, int j, size_t i, const redisReply *r)
{
    redis_cluster *rc = c->rc;
    rc_node *nd = &rc->nodes[j];
    rc_key *k = &c->k[i];
    status st;
    int moved = strncmp(r->str, "MOVED ", 6) == 0, ask = strncmp(r->str, "ASK ", 4) == 0;
    if (moved || ask) {
        unsigned slot;
        int to = parse_redirect(c, j, r->str + (moved ? 6 : 4), &slot, &st);
        if (to < 0) {
            call_fail(c, st.code, &st);
            return;
        }
        rc->h.redirects++;
        if (++k->redirs > REDIS_CLUSTER_MAX_REDIRECTS) {
            status_set(&st, ST_UNAVAILABLE,
                       "redirects did not settle: key of slot %u redirected %d times (last: "
                       "%.100s)",
                       k->slot, REDIS_CLUSTER_MAX_REDIRECTS, r->str);
            call_fail(c, st.code, &st);
            return;
        }
        if (moved) {
            /* Spec: a MOVED is lasting; fix this slot now, the rest with a
             * full reload before the next round. */
            rc->owner[slot] = (int16_t)to;
            rc->nodes[to].master = 1;
            rc->need_refresh = 1;
            k->ask = -1;
        } else {
            k->ask = (int16_t)to; /* this key, this once: the map stays */
        }
        return;
    }
    if (strncmp(r->str, "CLUSTERDOWN", 11) == 0 || strncmp(r->str, "TRYAGAIN", 8) == 0 ||
        strncmp(r->str, "LOADING", 7) == 0) {
        if (!c->retry_later)
            status_set(&c->retry_err, ST_UNAVAILABLE, "node %s:%d: %.160s", nd->host, nd->port,
                       r->str);
        c->retry_later = 1;
        return;
    }
    if (strncmp(r->str, "OOM", 3) == 0) {
        status_set(&st, ST_RESOURCE_EXHAUSTED,
                   "remote tier full: node %s:%d refuses writes (maxmemory): %.100s", nd->host,
                   nd->port, r->str);
        call_fail(c, st.code, &st);
        return;
    }
    status_set(&st, ST_INTERNAL, "node %s:%d answered %s with: %.160s", nd->host, nd->port,
               op_name(c->op), r->str);
    call_fail(c, st.code, &st);
}

/* A reply to key i from node j that is not an error. */
static void on_reply(rc_call *c, int j, size_t i, const redisReply *r)
{
    redis_cluster *rc = c->rc;
    rc_node *nd = &rc->nodes[j];
    status st;
    int ok = 0;
    switch (c->op) {
    case RC_PUT:
        ok = r->type == REDIS_REPLY_STATUS && r->len == 2 && memcmp(r->str, "OK", 2) == 0;
        if (ok)
            rc->h.bytes_written += c->kv[i].len;
        break;
    case RC_DEL:
        ok = r->type == REDIS_REPLY_INTEGER;
        break;
    case RC_GET:
        if (r->type == REDIS_REPLY_NIL) {
            ok = 1;
        } else if (r->type == REDIS_REPLY_STRING) {
            remote_buf *b = &c->out[i];
            b->data = malloc(r->len ? r->len : 1);
            if (b->data == NULL) {
                status_set(&st, ST_INTERNAL, "out of memory for a %zu-byte value from %s:%d",
                           r->len, nd->host, nd->port);
                call_fail(c, st.code, &st);
                return;
            }
            memcpy(b->data, r->str, r->len);
            b->len = r->len;
            b->found = 1;
            rc->h.bytes_read += r->len;
            ok = 1;
        }
        break;
    }
    if (!ok) {
        status_set(&st, ST_INTERNAL, "node %s:%d answered %s with a reply of type %d", nd->host,
                   nd->port, op_name(c->op), r->type);
        call_fail(c, st.code, &st);
        return;
    }
    c->k[i].done = 1;
    c->pending--;
}

/* Write what node j's connection holds; -1 (the round failed for j) on an
 * I/O error. */
static int node_flush(rc_call *c, int j)
{
    status st;
    int done = 0;
    while (!done)
        if (redisBufferWrite(c->rc->nodes[j].ctx, &done) != REDIS_OK) {
            node_io_error(c->rc, j, errno, &st);
            round_node_failed(c, j, &st);
            return -1;
        }
    return 0;
}

/* Send node j the commands of its keys. The pipeline goes out every
 * RC_FLUSH_BYTES rather than at the end: hiredis keeps it in one buffer
 * that doubles as it grows, and a 300-MB spill spent most of its time
 * copying it (docs/bench.md "Spill and revive"). The replies wait for
 * round_read either way. */
static void round_send(rc_call *c, int j)
{
    redis_cluster *rc = c->rc;
    status st;
    if (node_connect(rc, j, &st) != ST_OK) {
        round_node_failed(c, j, &st);
        return;
    }
    redisContext *ctx = rc->nodes[j].ctx;
    for (size_t i = 0; i < c->n; i++) {
        if (c->k[i].node != j)
            continue;
        if (append_key(c, ctx, i) != 0) {
            status_set(&st, ST_INTERNAL, "out of memory for a pipeline to node %s:%d",
                       rc->nodes[j].host, rc->nodes[j].port);
            node_drop(&rc->nodes[j]); /* a half-built pipeline cannot be sent */
            round_node_failed(c, j, &st);
            return;
        }
        if (sdslen(ctx->obuf) >= RC_FLUSH_BYTES && node_flush(c, j) != 0)
            return;
    }
    node_flush(c, j);
}

/* Read node j's replies, one per key sent (two after an ASK). */
static void round_read(rc_call *c, int j)
{
    redis_cluster *rc = c->rc;
    status st;
    for (size_t i = 0; i < c->n; i++) {
        if (c->k[i].node != j)
            continue;
        int replies = c->k[i].ask >= 0 ? 2 : 1;
        for (int n = 0; n < replies; n++) {
            redisReply *r = NULL;
            if (redisGetReply(rc->nodes[j].ctx, (void **)&r) != REDIS_OK || r == NULL) {
                node_io_error(rc, j, errno, &st);
                round_node_failed(c, j, &st);
                return;
            }
            rc->nodes[j].up = 1;
            if (n + 1 == replies) { /* ASKING's own answer is not the key's */
                c->k[i].ask = -1;   /* one ASKING per ASK; another ASK sets it again */
                if (r->type == REDIS_REPLY_ERROR && r->str != NULL)
                    on_error_reply(c, j, i, r);
                else if (c->fatal.code == ST_OK)
                    on_reply(c, j, i, r);
            }
            freeReplyObject(r);
        }
        c->k[i].node = -1;
    }
}

/* Route every pending key for this round: ST_OK, or the call fails (a slot
 * without a node even after a refresh). */
static status_code round_route(rc_call *c)
{
    redis_cluster *rc = c->rc;
    int refreshed = 0;
    status st;
    for (size_t i = 0; i < c->n; i++) {
        rc_key *k = &c->k[i];
        k->node = -1;
        if (k->done)
            continue;
        if (k->ask < 0 && rc->owner[k->slot] < 0 && !refreshed) {
            refreshed = 1;
            slots_refresh(rc, &st);
        }
        k->node = k->ask >= 0 ? k->ask : rc->owner[k->slot];
        if (k->node < 0) {
            status_set(&st, ST_UNAVAILABLE,
                       "slot %u has no node in the cluster's map (%u of %d slots covered)", k->slot,
                       rc->slots_covered, REDIS_CLUSTER_SLOTS);
            call_fail(c, st.code, &st);
            return st.code;
        }
    }
    return ST_OK;
}

/* After a round: whether to go on (ST_OK) or the call's error. */
static status_code round_after(rc_call *c)
{
    redis_cluster *rc = c->rc;
    status st;
    if (c->fatal.code != ST_OK)
        return c->fatal.code;
    if (c->conn_failed) {
        if (c->conn_retried) {
            status_set(&st, ST_UNAVAILABLE, "%.200s (after a topology refresh)", c->conn_err.msg);
            call_fail(c, st.code, &st);
            return st.code;
        }
        c->conn_retried = 1;
        c->conn_failed = 0;
        rc->need_refresh = 1;
    }
    if (c->retry_later) {
        c->retry_later = 0;
        uint64_t now = now_ns();
        if (now >= c->deadline_ns) {
            status_set(&st, ST_UNAVAILABLE, "cluster down for %u ms: %.180s", rc->timeout_ms,
                       c->retry_err.msg);
            call_fail(c, st.code, &st);
            return st.code;
        }
        uint64_t nap = 50000000u; /* 50 ms, or what is left */
        sleep_ns(nap < c->deadline_ns - now ? nap : c->deadline_ns - now);
        rc->need_refresh = 1;
    }
    return ST_OK;
}

/* SIGPIPE from a write to a closed connection is blocked in this thread for
 * the call and, if one came, taken before unblocking (the process may not
 * ignore it). */
typedef struct rc_sigpipe {
    sigset_t old;
    int pending_before;
} rc_sigpipe;

static void sigpipe_block(rc_sigpipe *s)
{
    sigset_t set, pend;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, &s->old);
    sigpending(&pend);
    s->pending_before = sigismember(&pend, SIGPIPE) == 1;
}

static void sigpipe_restore(rc_sigpipe *s)
{
    sigset_t set, pend;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigpending(&pend);
    if (!s->pending_before && sigismember(&pend, SIGPIPE) == 1) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&set, NULL, &zero) == -1 && errno == EINTR)
            ;
    }
    pthread_sigmask(SIG_SETMASK, &s->old, NULL);
}

static status_code call_validate(const rc_call *c, status *st)
{
    for (size_t i = 0; i < c->n; i++) {
        if (call_key(c, i) == NULL)
            return status_set(st, ST_INVALID_ARGUMENT, "remote key %zu is NULL", i);
        if (c->op == RC_PUT && c->kv[i].val == NULL && c->kv[i].len != 0)
            return status_set(st, ST_INVALID_ARGUMENT, "remote value %zu is NULL with %zu bytes", i,
                              c->kv[i].len);
    }
    return ST_OK;
}

/* The rounds of one call, under the store's lock. */
static status_code call_run(rc_call *c, status *st)
{
    redis_cluster *rc = c->rc;
    c->k = calloc(c->n, sizeof *c->k);
    if (c->k == NULL)
        return status_set(st, ST_INTERNAL, "out of memory for a call of %zu keys", c->n);
    for (size_t i = 0; i < c->n; i++) {
        const char *key = call_key(c, i);
        c->k[i].slot = redis_cluster_key_slot(key, strlen(key));
        c->k[i].ask = -1;
        c->k[i].node = -1;
    }
    c->pending = c->n;
    c->deadline_ns = now_ns() + (uint64_t)rc->timeout_ms * 1000000u;
    for (int round = 0; c->pending > 0; round++) {
        if (round == RC_MAX_ROUNDS) {
            status_set(st, ST_UNAVAILABLE, "the call did not settle in %d rounds", RC_MAX_ROUNDS);
            call_fail(c, st->code, st);
            break;
        }
        if (rc->need_refresh) {
            status rs; /* failing, the old map stays and the next error tells */
            slots_refresh(rc, &rs);
        }
        if (round_route(c) != ST_OK)
            break;
        for (size_t j = 0; j < rc->n_nodes; j++)
            for (size_t i = 0; i < c->n; i++)
                if (c->k[i].node == (int)j) {
                    round_send(c, (int)j);
                    break;
                }
        /* Every reply is read even after an error, so that the other
         * connections stay in step. */
        for (size_t j = 0; j < rc->n_nodes; j++)
            round_read(c, (int)j);
        if (round_after(c) != ST_OK)
            break;
    }
    free(c->k);
    c->k = NULL;
    if (c->fatal.code != ST_OK) {
        *st = c->fatal;
        return st->code;
    }
    return ST_OK;
}

/* Lock, count, run, record the outcome. */
static status_code call(rc_call *c, status *st)
{
    redis_cluster *rc = c->rc;
    if (call_validate(c, st) != ST_OK)
        return st->code;
    rc_sigpipe sp;
    sigpipe_block(&sp);
    pthread_mutex_lock(&rc->mu);
    rc->h.calls++;
    status_code code = c->n == 0 ? ST_OK : call_run(c, st);
    rc->last_ok = code == ST_OK;
    if (code != ST_OK) {
        rc->h.errors++;
        if (c->timed_out && code == ST_DEADLINE_EXCEEDED)
            rc->h.timeouts++;
        snprintf(rc->h.last_error, sizeof rc->h.last_error, "%s", st->msg);
    }
    pthread_mutex_unlock(&rc->mu);
    sigpipe_restore(&sp);
    return code;
}

/* ---- remote_store_ops ----------------------------------------------------- */

static status_code rc_put(remote_store *r, const remote_kv *kv, size_t n, uint32_t ttl_s,
                          status *st)
{
    rc_call c = {.rc = (redis_cluster *)r, .op = RC_PUT, .kv = kv, .n = n};
    if (ttl_s > 0)
        snprintf(c.ttl, sizeof c.ttl, "%u", ttl_s);
    return call(&c, st);
}

static status_code rc_get(remote_store *r, const char *const *keys, size_t n, remote_buf *out,
                          status *st)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (remote_buf){0};
    rc_call c = {.rc = (redis_cluster *)r, .op = RC_GET, .keys = keys, .out = out, .n = n};
    status_code code = call(&c, st);
    if (code != ST_OK)
        remote_bufs_free(out, n);
    return code;
}

static status_code rc_del(remote_store *r, const char *const *keys, size_t n, status *st)
{
    rc_call c = {.rc = (redis_cluster *)r, .op = RC_DEL, .keys = keys, .n = n};
    return call(&c, st);
}

static void rc_health(remote_store *r, remote_health *out)
{
    redis_cluster *rc = (redis_cluster *)r;
    pthread_mutex_lock(&rc->mu);
    *out = rc->h;
    out->nodes = out->nodes_up = 0;
    for (size_t i = 0; i < rc->n_nodes; i++)
        if (rc->nodes[i].master) {
            out->nodes++;
            out->nodes_up += rc->nodes[i].ctx != NULL && rc->nodes[i].up;
        }
    out->slots_covered = rc->slots_covered;
    out->ok = rc->last_ok && rc->slots_covered == REDIS_CLUSTER_SLOTS;
    pthread_mutex_unlock(&rc->mu);
}

/* PING node i: ST_OK on PONG (the node is up), else the node's failure
 * (its connection dropped). */
static status_code ping_node(redis_cluster *rc, int i, status *st)
{
    if (node_connect(rc, i, st) != ST_OK)
        return st->code;
    rc_node *nd = &rc->nodes[i];
    redisReply *r = redisCommand(nd->ctx, "PING");
    if (r == NULL)
        return node_io_error(rc, i, errno, st);
    status_code code = ST_OK;
    if (r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0)
        nd->up = 1;
    else
        code = status_set(st, ST_UNAVAILABLE, "node %s:%d answered PING with %.100s", nd->host,
                          nd->port, r->type == REDIS_REPLY_ERROR ? r->str : "something else");
    freeReplyObject(r);
    return code;
}

/* PING every master of the map; *first is the first failure. */
static int ping_masters(redis_cluster *rc, status *first)
{
    int failed = 0;
    for (size_t i = 0; i < rc->n_nodes; i++) {
        status ns;
        if (rc->nodes[i].master && ping_node(rc, (int)i, &ns) != ST_OK && failed++ == 0)
            *first = ns;
    }
    return failed;
}

/* remote_store ping: every master, and when one does not answer or a slot
 * has none, the map reloaded (a replica promoted by a failover takes the
 * dead master's slots) and every master of the new map asked again. */
static status_code rc_ping(remote_store *r, status *st)
{
    redis_cluster *rc = (redis_cluster *)r;
    rc_sigpipe sp;
    sigpipe_block(&sp);
    pthread_mutex_lock(&rc->mu);
    status first = {ST_OK, ""}, rs = {ST_OK, ""};
    int failed = rc->need_refresh ? 1 : ping_masters(rc, &first);
    if (failed > 0 || rc->slots_covered < REDIS_CLUSTER_SLOTS) {
        slots_refresh(rc, &rs); /* a failure keeps the old map, its message in rs */
        failed = ping_masters(rc, &first);
    }
    status_code code = ST_OK;
    if (failed > 0)
        code = status_set(st, first.code, "%d of the cluster's masters did not answer: %s", failed,
                          first.msg);
    else if (rc->slots_covered < REDIS_CLUSTER_SLOTS)
        code = status_set(st, ST_UNAVAILABLE, "%u of %u slots have no master%s%s",
                          REDIS_CLUSTER_SLOTS - rc->slots_covered, REDIS_CLUSTER_SLOTS,
                          rs.code != ST_OK ? ": " : "", rs.code != ST_OK ? rs.msg : "");
    rc->last_ok = code == ST_OK;
    if (code != ST_OK)
        snprintf(rc->h.last_error, sizeof rc->h.last_error, "%s", st->msg);
    pthread_mutex_unlock(&rc->mu);
    sigpipe_restore(&sp);
    return code;
}

static void rc_free(redis_cluster *rc)
{
    for (size_t i = 0; i < rc->n_nodes; i++)
        node_drop(&rc->nodes[i]);
    free(rc->nodes);
    pthread_mutex_destroy(&rc->mu);
    free(rc);
}

static void rc_close(remote_store *r)
{
    rc_free((redis_cluster *)r);
}

static const remote_store_ops rc_ops = {
    .name = "redis-cluster",
    .put = rc_put,
    .get = rc_get,
    .del = rc_del,
    .health = rc_health,
    .ping = rc_ping,
    .close = rc_close,
};

/* ---- open --------------------------------------------------------------- */

status_code redis_cluster_open(const char *seeds, uint32_t timeout_ms, remote_store **out,
                               status *st)
{
    *out = NULL;
    if (timeout_ms == 0)
        return status_set(st, ST_INVALID_ARGUMENT, "remote timeout_ms must be > 0");
    redis_cluster *rc = calloc(1, sizeof *rc);
    if (rc == NULL)
        return status_set(st, ST_INTERNAL, "out of memory for the remote store");
    if (pthread_mutex_init(&rc->mu, NULL) != 0) {
        free(rc);
        return status_set(st, ST_INTERNAL, "cannot create the remote store's mutex");
    }
    rc->base.ops = &rc_ops;
    rc->timeout_ms = timeout_ms;
    for (size_t s = 0; s < REDIS_CLUSTER_SLOTS; s++)
        rc->owner[s] = -1;
    if (seeds_parse(rc, seeds, st) != ST_OK)
        goto fail;
    snprintf(rc->seeds, sizeof rc->seeds, "%s", seeds);

    /* The seeds are all the nodes known: a refresh asks them in order. */
    if (slots_refresh(rc, st) != ST_OK) {
        if (st->code == ST_UNAVAILABLE || st->code == ST_DEADLINE_EXCEEDED) {
            status last = *st;
            status_set(st, ST_UNAVAILABLE, "no remote seed answered (seeds \"%.80s\"): %.140s",
                       rc->seeds, last.msg);
        }
        goto fail;
    }
    rc->last_ok = 1;
    if (rc->slots_covered < REDIS_CLUSTER_SLOTS)
        log_warn("remote_partial_map", "seeds=\"%s\" slots_covered=%u", rc->seeds,
                 rc->slots_covered);
    *out = &rc->base;
    return ST_OK;
fail:
    rc_free(rc);
    return st->code;
}
