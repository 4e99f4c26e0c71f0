/* remote_tier.c - see remote_tier.h. */
#include "remote_tier.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "redis_cluster.h"

/* Connection attempts, at most one in this many ms (a dead cluster must
 * not turn every call into a connect timeout). */
#define REMOTE_RETRY_MS 1000

struct remote_tier {
    remote_tier_config cfg;
    char seeds[REMOTE_SEEDS_MAX];
    char ns[REMOTE_NAME_MAX + 1];

    pthread_mutex_t open_mu; /* store and the connection attempts */
    remote_store *store;     /* NULL until connected; then until close */
    uint64_t last_attempt_ms;

    pthread_mutex_t stat_mu; /* what status shows */
    remote_tier_status stat;
    uint64_t last_ok_ms; /* 0: never */

    pthread_mutex_t probe_mu; /* the probe thread's sleep and stop */
    pthread_cond_t probe_cv;
    int stopping;
    int probing; /* the thread runs */
    pthread_t probe_thread;
    /* Keys to delete (remote_tier_forget), under probe_mu: the probe
     * thread deletes them after its next probe. */
    char **forget;
    size_t nforget, forget_cap;
    uint64_t forget_dropped; /* keys not queued: the queue was full */
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The store's counters into the status, with the outcome of the latest
 * call. Takes stat_mu; the store's health may wait for a call in flight. */
static void refresh_status(remote_tier *t, remote_store *r, status_code code, const char *msg)
{
    remote_health h = {0};
    if (r != NULL)
        remote_health_get(r, &h);
    pthread_mutex_lock(&t->stat_mu);
    if (r != NULL) {
        t->stat.health = h;
        t->stat.connected = 1;
        snprintf(t->stat.backend, sizeof t->stat.backend, "%s", r->ops->name);
    }
    if (code == ST_OK) {
        t->last_ok_ms = now_ms();
    } else {
        t->stat.health.ok = 0;
        snprintf(t->stat.health.last_error, sizeof t->stat.health.last_error, "%s: %s",
                 status_name(code), msg);
    }
    pthread_mutex_unlock(&t->stat_mu);
}

/* Connect when not connected and the last attempt is old enough. Under
 * open_mu. */
static remote_store *connect_locked(remote_tier *t, status *st)
{
    if (t->store != NULL)
        return t->store;
    uint64_t now = now_ms();
    if (t->last_attempt_ms != 0 && now - t->last_attempt_ms < REMOTE_RETRY_MS) {
        status_set(st, ST_UNAVAILABLE, "remote tier not connected (%s); next attempt within %u ms",
                   t->seeds, REMOTE_RETRY_MS);
        return NULL;
    }
    t->last_attempt_ms = now;
    if (redis_cluster_open(t->seeds, t->cfg.timeout_ms, &t->store, st) != ST_OK) {
        t->store = NULL;
        return NULL;
    }
    log_info("remote_connected", "seeds=%s", t->seeds);
    return t->store;
}

remote_store *remote_tier_acquire(remote_tier *t, status *st)
{
    pthread_mutex_lock(&t->open_mu);
    int was = t->store != NULL;
    remote_store *r = connect_locked(t, st);
    pthread_mutex_unlock(&t->open_mu);
    if (r == NULL)
        refresh_status(t, NULL, st->code, st->msg);
    else if (!was)
        refresh_status(t, r, ST_OK, "");
    return r;
}

void remote_tier_note(remote_tier *t, const status *st, status_code code)
{
    pthread_mutex_lock(&t->open_mu);
    remote_store *r = t->store;
    pthread_mutex_unlock(&t->open_mu);
    refresh_status(t, r, code, code == ST_OK ? "" : st->msg);
}

status_code remote_tier_probe(remote_tier *t, status *st)
{
    remote_store *r = remote_tier_acquire(t, st);
    status_code rc = r != NULL ? remote_ping(r, st) : st->code;
    if (r != NULL)
        refresh_status(t, r, rc, st->msg);
    pthread_mutex_lock(&t->stat_mu);
    t->stat.probes++;
    t->stat.probe_failures += rc != ST_OK;
    pthread_mutex_unlock(&t->stat_mu);
    return rc;
}

static void forget_free(char **keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(keys[i]);
    free(keys);
}

int remote_tier_forget(remote_tier *t, const char *const *keys, size_t n)
{
    if (t == NULL || !t->probing)
        return -1;
    pthread_mutex_lock(&t->probe_mu);
    size_t queued = 0;
    if (t->nforget + n <= REMOTE_FORGET_MAX && t->nforget + n > t->forget_cap) {
        size_t cap = t->forget_cap ? t->forget_cap : 64;
        while (cap < t->nforget + n)
            cap *= 2;
        char **a = realloc(t->forget, cap * sizeof *a);
        if (a != NULL)
            t->forget = a, t->forget_cap = cap;
    }
    while (queued < n && t->nforget < t->forget_cap &&
           (t->forget[t->nforget] = strdup(keys[queued])))
        t->nforget++, queued++;
    t->forget_dropped += n - queued;
    pthread_mutex_unlock(&t->probe_mu);
    return queued == n ? 0 : -1;
}

/* Delete the keys remote_tier_forget queued (probe thread, probe_mu not
 * held). A failure leaves them to their time to live. */
static void forget_run(remote_tier *t)
{
    pthread_mutex_lock(&t->probe_mu);
    char **keys = t->forget;
    size_t n = t->nforget;
    t->forget = NULL;
    t->nforget = t->forget_cap = 0;
    pthread_mutex_unlock(&t->probe_mu);
    if (n == 0)
        return;
    status st = {ST_OK, ""};
    remote_store *r = remote_tier_acquire(t, &st);
    status_code rc = r != NULL ? remote_del(r, (const char *const *)keys, n, &st) : st.code;
    if (r != NULL)
        remote_tier_note(t, &st, rc);
    if (rc != ST_OK)
        log_warn("remote_forget_failed", "keys=%zu code=%s msg=\"%s\" (they expire with their ttl)",
                 n, status_name(rc), st.msg);
    forget_free(keys, n);
}

static void *probe_main(void *arg)
{
    remote_tier *t = arg;
    pthread_mutex_lock(&t->probe_mu);
    while (!t->stopping) {
        pthread_mutex_unlock(&t->probe_mu);
        status st = {ST_OK, ""};
        pthread_mutex_lock(&t->stat_mu);
        int was_ok = t->stat.health.ok || t->stat.probes == 0;
        pthread_mutex_unlock(&t->stat_mu);
        status_code rc = remote_tier_probe(t, &st);
        if (rc != ST_OK && was_ok)
            log_warn("remote_unhealthy", "code=%s msg=\"%s\"", status_name(rc), st.msg);
        if (rc == ST_OK)
            forget_run(t);
        pthread_mutex_lock(&t->probe_mu);
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)t->cfg.probe_ms * 1000000u;
        until.tv_sec += (time_t)(ns / 1000000000u);
        until.tv_nsec = (long)(ns % 1000000000u);
        while (!t->stopping &&
               pthread_cond_timedwait(&t->probe_cv, &t->probe_mu, &until) != ETIMEDOUT)
            ;
    }
    pthread_mutex_unlock(&t->probe_mu);
    return NULL;
}

static status_code check_config(const remote_tier_config *c, status *st)
{
    if (c->seeds == NULL || c->seeds[0] == '\0' || strlen(c->seeds) >= REMOTE_SEEDS_MAX)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote: give some nodes of the cluster as host:port[,host:port...] "
                          "(at most %d bytes)",
                          REMOTE_SEEDS_MAX - 1);
    if (c->ns == NULL || !remote_name_valid(c->ns, REMOTE_NAME_MAX))
        return status_set(st, ST_INVALID_ARGUMENT,
                          "remote-namespace must be 1 to %d of A-Z a-z 0-9 _ . -, got '%.64s'",
                          REMOTE_NAME_MAX, c->ns != NULL ? c->ns : "");
    if (c->timeout_ms == 0)
        return status_set(st, ST_INVALID_ARGUMENT, "remote-timeout-ms must be at least 1");
    return ST_OK;
}

static remote_tier *tier_new(const remote_tier_config *c)
{
    remote_tier *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->cfg = *c;
    snprintf(t->seeds, sizeof t->seeds, "%s", c->seeds);
    snprintf(t->ns, sizeof t->ns, "%s", c->ns);
    t->cfg.seeds = t->seeds;
    t->cfg.ns = t->ns;
    pthread_mutex_init(&t->open_mu, NULL);
    pthread_mutex_init(&t->stat_mu, NULL);
    pthread_mutex_init(&t->probe_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->probe_cv, &ca);
    pthread_condattr_destroy(&ca);
    t->stat.configured = 1;
    snprintf(t->stat.seeds, sizeof t->stat.seeds, "%s", t->seeds);
    snprintf(t->stat.ns, sizeof t->stat.ns, "%s", t->ns);
    t->stat.ttl_s = c->ttl_s;
    t->stat.timeout_ms = c->timeout_ms;
    return t;
}

status_code remote_tier_open(const remote_tier_config *c, remote_tier **out, status *st)
{
    *out = NULL;
    if (check_config(c, st) != ST_OK)
        return st->code;
    remote_tier *t = tier_new(c);
    if (t == NULL)
        return status_set(st, ST_INTERNAL, "out of memory");
    status cst = {ST_OK, ""};
    if (remote_tier_acquire(t, &cst) == NULL) {
        if (cst.code == ST_INVALID_ARGUMENT || cst.code == ST_FAILED_PRECONDITION ||
            cst.code == ST_INTERNAL) {
            remote_tier_close(t);
            return status_set(st, cst.code, "%s", cst.msg);
        }
        log_warn("remote_unavailable", "seeds=%s code=%s msg=\"%s\"", t->seeds,
                 status_name(cst.code), cst.msg);
    }
    if (c->probe_ms > 0) {
        if (pthread_create(&t->probe_thread, NULL, probe_main, t) != 0) {
            remote_tier_close(t);
            return status_set(st, ST_INTERNAL, "cannot start the remote tier's probe thread");
        }
        t->probing = 1;
    }
    *out = t;
    return ST_OK;
}

void remote_tier_close(remote_tier *t)
{
    if (t == NULL)
        return;
    if (t->probing) {
        pthread_mutex_lock(&t->probe_mu);
        t->stopping = 1;
        pthread_cond_signal(&t->probe_cv);
        pthread_mutex_unlock(&t->probe_mu);
        pthread_join(t->probe_thread, NULL);
    }
    if (t->nforget > 0)
        log_info("remote_forget_left", "keys=%zu (they expire with their ttl)", t->nforget);
    forget_free(t->forget, t->nforget);
    remote_close(t->store);
    pthread_cond_destroy(&t->probe_cv);
    pthread_mutex_destroy(&t->probe_mu);
    pthread_mutex_destroy(&t->stat_mu);
    pthread_mutex_destroy(&t->open_mu);
    free(t);
}

const char *remote_tier_namespace(const remote_tier *t)
{
    return t->ns;
}

uint32_t remote_tier_ttl(const remote_tier *t)
{
    return t->cfg.ttl_s;
}

void remote_tier_status_get(remote_tier *t, remote_tier_status *out)
{
    memset(out, 0, sizeof *out);
    if (t == NULL)
        return;
    pthread_mutex_lock(&t->stat_mu);
    *out = t->stat;
    out->last_ok_age_ms = t->last_ok_ms == 0 ? UINT64_MAX : now_ms() - t->last_ok_ms;
    pthread_mutex_unlock(&t->stat_mu);
}
