/*
 * metrics.h - Prometheus metrics of kvstashd, and the HTTP endpoint that
 * serves them (libmicrohttpd, `kvstashd --metrics 127.0.0.1:PORT`).
 *
 * Two kinds of numbers:
 *   - counters and histograms that the daemon bumps as it works (RPCs,
 *     appended and evicted tokens, policy steps, the attention mass that
 *     evictions dropped, reclaimed workers): lock-free atomics, so the hooks
 *     cost a few nanoseconds on the CQ and ring threads;
 *   - gauges read from a snapshot of the store when /metrics is scraped
 *     (pools, blocks, memory, workers, sequences, tokens per tier): plain
 *     data the store copies out under its lock (snapshot.h); metrics never
 *     sees the store, a session or a sequence.
 * Every metric is listed in README.md, "Operating kvstash".
 *
 * Every hook accepts m == NULL and then does nothing: the store runs without
 * metrics in the unit tests and when --metrics is not given.
 */
#ifndef KVSTASH_METRICS_H
#define KVSTASH_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "policy.h"
#include "rpc.h"
#include "snapshot.h"
#include "status.h"

typedef struct metrics metrics;

/* Counters for the gRPC methods of `methods` (the table must outlive m) and
 * every registered policy. NULL when out of memory. Free with
 * metrics_destroy (after metrics_http_stop and after the hooks' callers
 * stopped). */
metrics *metrics_create(const rpc_method *methods, size_t nmethods);
void metrics_destroy(metrics *m);

/* rpc_observe_fn for rpc_config: one finished call of method index `method`
 * with its status code and the handler's duration. */
void metrics_rpc(void *m, size_t method, int code, double seconds);

/* Tokens appended to a sequence of policy p (per layer, as AppendRequest.count). */
void metrics_appended(metrics *m, const policy_ops *p, uint64_t tokens);

/* Tokens evicted from a sequence of policy p, summed over its lists; by the
 * policy's own decision or by an operator (EvictRequest). */
void metrics_evicted(metrics *m, const policy_ops *p, int by_operator, uint64_t tokens);

/* Count a sequence of policy p's tier report (seq_tier_report): tokens
 * demoted to INT8, put into the sketch, brought back to full precision,
 * re-quantised, victims dropped, and the measurements' histograms. */
void metrics_tiers(metrics *m, const policy_ops *p, const snapshot_tiers *t);

/* A Revive of a sequence of policy p rebuilt by_tier[t] tokens that were
 * stored in tier t (policy_tier FULL, INT8, SKETCH). */
void metrics_revived(metrics *m, const policy_ops *p, const uint32_t by_tier[POLICY_TIERS]);

/* One worker step (ring STEP) of a sequence of policy p, served in `seconds`
 * (store_step: the lock wait, the checks, the policy and the table change). */
void metrics_step(metrics *m, const policy_ops *p, double seconds);

/* A session was reclaimed; reason as in the worker.reclaimed event. */
void metrics_reclaimed(metrics *m, const char *reason);

/* The fd socket closed a connection unasked (kvstash_fdsock_shed_total). */
typedef enum metrics_shed {
    METRICS_SHED_FD_LIMIT,        /* accepted and closed at once: no fds left */
    METRICS_SHED_PENDING_TIMEOUT, /* not attached within --pending-timeout-ms */
    METRICS_SHED_PENDING_CAP,     /* the oldest pending one, at --max-pending */
    METRICS_SHED_COUNT
} metrics_shed;
void metrics_fdsock_shed(metrics *m, metrics_shed reason);

/*
 * The attention mass an eviction dropped. Between a step's decision and its
 * application, metrics_mass_measure computes, for every layer whose decision
 * evicts tokens, the fraction of that layer's reported attention (score,
 * else last_attn summed over the query heads of each list, else
 * window_attn; the layout of proto/kvstash_step.h) that sits on them: one
 * read of that attention and of the decisions' tiers, d[l]->tier[k][i] for
 * token i of list k as the lists were when the step began (`lists`). NULL
 * when there is nothing to measure (no metrics, no attention in the step,
 * sizes that do not match the lists: seq_step refuses those, or no
 * decision). metrics_mass_end observes the fractions for policy p when the
 * step succeeded (ok), and frees them.
 */
typedef struct metrics_lists {
    uint32_t layers, q_heads, kv_heads;
    uint32_t heads;          /* lists per layer: 1, or kv_heads */
    const uint32_t *ntokens; /* [layers * heads], list k of layer l at l * heads + k */
} metrics_lists;

typedef struct metrics_mass metrics_mass;
metrics_mass *metrics_mass_measure(metrics *m, const metrics_lists *lists, unsigned arrays,
                                   const float *data, size_t nfloats,
                                   const policy_decision *const *d);
void metrics_mass_end(metrics *m, metrics_mass *mm, const policy_ops *p, int ok);

/*
 * The exposition text (Prometheus text format 0.0.4) of everything above
 * plus the gauges of a store snapshot. Returns a malloc'd string (caller
 * frees) and its length, or NULL when out of memory.
 */
char *metrics_render(metrics *m, const snapshot *s, size_t *len);

/* Where the endpoint reads the store: a snapshot per scrape (0, or -1 when
 * out of memory; *out must be freeable with snapshot_free either way), and
 * whether it is serving, and the remote tier's state (never waiting for the
 * network; configured 0 without one), for /healthz. Called from the HTTP
 * thread. */
typedef struct metrics_source {
    void *ctx;
    int (*snapshot)(void *ctx, snapshot *out);
    int (*serving)(void *ctx);
    void (*remote)(void *ctx, remote_tier_status *out);
} metrics_source;

/*
 * Serve GET /metrics (and GET /healthz: 200 "serving" or 503 "shutting
 * down", then, with a remote tier, a line "remote: healthy" or "remote:
 * unhealthy: <last error>": kvstashd serves its local tiers either way) on `addr`, "HOST:PORT" with
 * HOST an IPv4 address, "[IPv6]" or "localhost"; PORT 0 picks a free port (metrics_http_port tells
 * which). A HOST that is not loopback is refused (INVALID_ARGUMENT) unless allow_remote: the
 * endpoint has no authentication and no TLS.
 */
status_code metrics_http_start(metrics *m, const metrics_source *source, const char *addr,
                               int allow_remote, status *s);

/* The port the endpoint listens on (0 when not started). */
unsigned metrics_http_port(const metrics *m);

/* Stop serving (waits for a scrape in progress). No-op when not started. */
void metrics_http_stop(metrics *m);

/* Whether "HOST:PORT" names a loopback host; fills the socket address.
 * Returns 1 loopback, 0 not loopback, -1 not an address we understand. */
int metrics_parse_addr(const char *addr, void *sockaddr_storage, unsigned *len);

#endif
