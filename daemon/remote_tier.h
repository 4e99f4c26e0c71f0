/*
 * remote_tier.h - kvstashd's remote tier: the connection to the remote store
 * (remote_store.h), the settings it runs under, and what operators see of
 * it (docs/remote.md).
 *
 * kvstashd starts and keeps serving whatever the remote store does: an
 * unreachable cluster at start is not an error (the tier connects on first
 * use or at the next probe), and a node that dies later makes calls that
 * need it fail with a precise status while the local tiers go on. A probe
 * thread asks every node whether it answers every probe_ms, so that Stats,
 * /metrics and /healthz show a dead cluster even when nothing uses it.
 *
 * Thread-safe. remote_tier_status never waits for the network (it copies
 * what the last call and probe saw), so Stats and /metrics stay quick while
 * a node hangs; remote_tier_acquire may wait for a connection attempt.
 */
#ifndef KVSTASH_REMOTE_TIER_H
#define KVSTASH_REMOTE_TIER_H

#include <stdint.h>

#include "remote_store.h"
#include "remote_value.h"
#include "status.h"

#define REMOTE_SEEDS_MAX 192

typedef struct remote_tier_config {
    const char *seeds;   /* "host:port[,host:port...]": some nodes of the cluster */
    const char *ns;      /* key namespace: one per deployment (remote_value.h remote_key) */
    uint32_t ttl_s;      /* time to live of every value written; 0 = none */
    uint32_t timeout_ms; /* one node's answer; longer is DEADLINE_EXCEEDED */
    uint32_t probe_ms;   /* between probes; 0 = no probe thread */
} remote_tier_config;

/* What Stats, /metrics and /healthz show, as last seen. */
typedef struct remote_tier_status {
    int configured;   /* 0: kvstashd runs without a remote tier */
    int connected;    /* a topology was loaded once */
    char backend[32]; /* remote_store_ops.name, "" before connecting */
    char seeds[REMOTE_SEEDS_MAX];
    char ns[REMOTE_NAME_MAX + 1];
    uint32_t ttl_s, timeout_ms;
    uint64_t probes, probe_failures; /* probes made, probes that failed */
    uint64_t last_ok_age_ms;         /* since a call or probe last succeeded; UINT64_MAX: never */
    remote_health health;            /* the store's counters; ok: healthy now */
} remote_tier_status;

typedef struct remote_tier remote_tier;

/*
 * Check the settings (seeds' syntax, the namespace's characters: an
 * INVALID_ARGUMENT names what to fix), try to connect once, and start the
 * probe thread. A cluster that does not answer leaves the tier
 * disconnected, not failed: *out is set and the error is what status
 * shows. The caller closes *out with remote_tier_close.
 */
status_code remote_tier_open(const remote_tier_config *c, remote_tier **out, status *st);

/* Stop the probe thread, close the connection, free t (NULL allowed). */
void remote_tier_close(remote_tier *t);

/* The store to call, connecting first when the tier is not connected (at
 * most one attempt a second); NULL with UNAVAILABLE in *st when it cannot.
 * The store stays valid until remote_tier_close. */
remote_store *remote_tier_acquire(remote_tier *t, status *st);

/* Record the outcome of a call made through remote_tier_acquire's store, so
 * that status shows it (code ST_OK, or the failure and its message). */
void remote_tier_note(remote_tier *t, const status *st, status_code code);

/* Probe now: connect if needed and ask every node (remote_store ping). */
status_code remote_tier_probe(remote_tier *t, status *st);

/* Delete keys in the background: copies them to a queue that the probe
 * thread deletes after its next successful probe (a sequence whose spilled
 * victims die with it; the caller may hold any lock). 0, or -1 when they
 * were not all queued (no probe thread, out of memory, more than
 * REMOTE_FORGET_MAX waiting): those expire with their time to live. */
#define REMOTE_FORGET_MAX 65536
int remote_tier_forget(remote_tier *t, const char *const *keys, size_t n);

/* The settings the tier runs under (the namespace and time to live that
 * callers write keys and values with). */
const char *remote_tier_namespace(const remote_tier *t);
uint32_t remote_tier_ttl(const remote_tier *t);

/* What was last seen; never blocks on the network. With t NULL,
 * *out says "not configured". */
void remote_tier_status_get(remote_tier *t, remote_tier_status *out);

#endif
