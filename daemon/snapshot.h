/*
 * snapshot.h - plain data that the daemon's parts hand over instead of their
 * structures: the store's state copied out under its lock (store_snapshot,
 * for /metrics and Stats), and a sequence's tier report (seq_tier_report,
 * for metrics_tiers). Readers of a snapshot never take the store's lock and
 * never see a store, session or sequence.
 */
#ifndef KVSTASH_SNAPSHOT_H
#define KVSTASH_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"
#include "pool.h"
#include "remote_tier.h"

/* A pool. blocks_retired and tier_bytes (quantised tiers and the sketch;
 * the FULL entry stays 0) are summed over its sequences
 * (seq_retired_count, seq_tier_usage). */
typedef struct snapshot_pool {
    uint64_t id;
    char model[65];
    char tenant[65];
    pool_geometry geom;
    uint64_t bytes, block_bytes;
    uint32_t blocks_total, blocks_free, blocks_retired;
    uint32_t blocks_quarantined; /* held for ended sessions (pool_hold_begin) */
    uint32_t sessions;           /* attached */
    uint64_t tier_bytes[POLICY_TIERS];
} snapshot_pool;

/* An attached session; ages in milliseconds at the snapshot's time. */
typedef struct snapshot_session {
    uint64_t id, pool_id;
    int32_t pid;
    uint32_t uid;
    char name[65];
    uint32_t nseqs;
    uint64_t attached_age_ms;
    int lease_open;
    uint64_t lease_age_ms; /* 0 when no lease is open */
    uint32_t blocks;       /* pool blocks its sequences and revive scratch hold */
} snapshot_session;

/* A sequence; tier_tokens and tier_bytes by policy_tier. */
typedef struct snapshot_seq {
    uint64_t id, session_id, pool_id;
    const policy_ops *policy;
    char label[129];
    uint64_t epoch, appended, tokens;
    uint32_t blocks, retired; /* held (tables and retired), retired */
    uint64_t bytes;           /* blocks * block_bytes */
    uint64_t tier_tokens[POLICY_TIERS], tier_bytes[POLICY_TIERS];
    uint64_t sketch_reserved; /* daemon memory reserved for its sketches (--max-daemon-mb) */
    uint64_t spilled_tokens, spilled_bytes; /* victims in the remote tier (seq.h) */
} snapshot_seq;

typedef struct snapshot {
    int serving;
    const char *backend;       /* static */
    backend_info backend_info; /* device, IPC kind (backend.h) */
    int lease_end_quarantine;  /* store_config's */
    uint32_t quarantined_sessions, quarantined_blocks;
    uint64_t uptime_ms, events;
    snapshot_pool *pools; /* in pool slot order */
    size_t npools;
    snapshot_session *sessions; /* attached ones, newest first */
    size_t nsessions;
    uint32_t pending; /* sessions identified on the fd socket, not attached yet */
    snapshot_seq *seqs;
    size_t nseqs;
    /* Limits (store_config): the daemon memory budget (0 = none) and what
     * sequences reserved of it, the per-session quotas (0 = none). */
    uint64_t mem_limit, mem_reserved, max_reply;
    uint32_t session_max_seqs, session_max_blocks;
    remote_tier_status remote; /* configured 0: no remote tier */
} snapshot;

/* Free a snapshot's arrays (store_snapshot fills it); safe on a zeroed one. */
void snapshot_free(snapshot *s);

/* A measurement of what a tier move cost: kind is the tier moved to, a
 * quantised one (tier_error_ratio of a demotion or re-quantisation) or
 * POLICY_SKETCH (tier_sketch_error of an insertion, right after it). */
typedef struct snapshot_obs {
    int kind;
    double value;
} snapshot_obs;

/* A sequence's tier report: tokens moved, by the tier they went to
 * (policy_tier), quantised tokens re-quantised, victims dropped under
 * memory pressure, and the measurements, all since the report was last
 * cleared. */
typedef struct snapshot_tiers {
    uint64_t moved[POLICY_TIERS];
    uint64_t requantized;
    uint64_t victims_dropped;
    snapshot_obs *obs;
    size_t nobs, obs_cap;
} snapshot_tiers;

/* Keep a measurement; dropped when out of memory (it is only a metric). */
void snapshot_tiers_observe(snapshot_tiers *t, int kind, double value);

/* Zero the counts and forget the measurements, keeping their memory. */
void snapshot_tiers_clear(snapshot_tiers *t);

/* Free the measurements' memory. */
void snapshot_tiers_free(snapshot_tiers *t);

#endif
