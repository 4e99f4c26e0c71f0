/* metrics.c - see metrics.h. */
#include "metrics.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "util.h" /* policies/: policy_decision_span_of */

#include "kvstash_step.h"
#include "log.h"

/* gRPC status codes 0..16. */
#define RPC_CODES 17
#define HIST_MAX_BUCKETS 16

/* Bucket upper bounds. gRPC over UDS costs 70-100 us here (C-STACK.md); a
 * ring step a few us to a few ms, depending on the policy and the lists. */
static const double rpc_bounds[] = {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3,
                                    5e-3,  10e-3, 25e-3,  50e-3,  0.1,    0.25, 1.0};
static const double step_bounds[] = {2e-6,   5e-6, 10e-6,  25e-6, 50e-6, 100e-6, 250e-6,
                                     500e-6, 1e-3, 2.5e-3, 5e-3,  10e-3, 50e-3,  0.25};
static const double mass_bounds[] = {0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0};
/* INT8: POLICIES.md §5.4 bounds the error by 1/254 (0.0039) of the group's max. */
static const double int8_bounds[] = {1e-4, 5e-4, 1e-3, 2e-3, 3e-3, 3.95e-3, 0.01};
static const double sketch_bounds[] = {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0};
/* INT4 / INT2: half a group's step, the step at most the list's range / 15
 * (or / 3), and the range at most twice the largest |value| */
static const double int4_bounds[] = {1e-3, 5e-3, 0.01, 0.02, 0.035, 0.05, 0.067, 0.1};
static const double int2_bounds[] = {0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.34, 0.5};

/* Per-policy, per-tier counters: POLICY_TIERS entries a policy, by
 * policy_tier (the POLICY_EVICT one stays 0). */
#define TIER_SLOT(pi, t) ((size_t)(pi)*POLICY_TIERS + (size_t)(t))

#define NBOUNDS(a) (sizeof(a) / sizeof((a)[0]))

/* A histogram: counts per bucket (not cumulative; the last is +Inf) and the
 * sum of observations in units of 1e-9 (nanoseconds, or billionths). */
typedef struct hist {
    _Atomic uint64_t counts[HIST_MAX_BUCKETS + 1];
    _Atomic uint64_t sum_e9;
} hist;

/* The HTTP endpoint's limits (metrics_http_start). */
#define METRICS_HTTP_MAX_CONNS 512u
#define METRICS_HTTP_TIMEOUT_S 3u
#define METRICS_HTTP_MAX_PER_IP 16u

static const char *const reclaim_reasons[] = {"detach",   "lease-ended",   "fd-closed",
                                              "shutdown", "lease-timeout", "other"};
/* Why the fd socket shed a connection (metrics_fdsock_shed). */
static const char *const shed_reasons[METRICS_SHED_COUNT] = {"fd-limit", "pending-timeout",
                                                             "pending-cap"};
#define NREASONS (sizeof reclaim_reasons / sizeof reclaim_reasons[0])

struct metrics {
    const rpc_method *methods;
    size_t nmethods;
    _Atomic uint64_t *rpc_count; /* [nmethods * RPC_CODES] */
    hist *rpc_hist;              /* [nmethods] */
    const policy_ops *const *policies;
    size_t npolicies;
    _Atomic uint64_t *appended;        /* [npolicies] */
    _Atomic uint64_t *evicted;         /* [npolicies * 2]: by policy, by operator */
    _Atomic uint64_t *moved;           /* [TIER_SLOT]: by the tier moved to */
    _Atomic uint64_t *revived;         /* [TIER_SLOT]: by the tier revived from */
    _Atomic uint64_t *requantized;     /* [npolicies]: INT8 tokens re-quantised by compaction */
    _Atomic uint64_t *victims_dropped; /* [npolicies]: kept victims freed under pressure */
    hist *step_hist;                   /* [npolicies] */
    hist *mass_hist;                   /* [npolicies] */
    hist *int8_hist;                   /* [npolicies] */
    hist *sketch_hist;                 /* [npolicies] */
    hist *int4_hist, *int2_hist;       /* [npolicies] */
    _Atomic uint64_t reclaimed[NREASONS];
    _Atomic uint64_t shed[METRICS_SHED_COUNT];
    struct MHD_Daemon *http;
    metrics_source source; /* what /metrics and /healthz read */
    unsigned port;
};

static void hist_observe(hist *h, const double *bounds, size_t nb, double v)
{
    size_t b = 0;
    while (b < nb && v > bounds[b])
        b++;
    atomic_fetch_add_explicit(&h->counts[b], 1, memory_order_relaxed);
    if (v > 0)
        atomic_fetch_add_explicit(&h->sum_e9, (uint64_t)llround(v * 1e9), memory_order_relaxed);
}

metrics *metrics_create(const rpc_method *methods, size_t nmethods)
{
    metrics *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    m->methods = methods;
    m->nmethods = nmethods;
    m->policies = policy_list(&m->npolicies);
    m->rpc_count = calloc(nmethods * RPC_CODES + 1, sizeof *m->rpc_count);
    m->rpc_hist = calloc(nmethods + 1, sizeof *m->rpc_hist);
    m->appended = calloc(m->npolicies + 1, sizeof *m->appended);
    m->evicted = calloc(2 * m->npolicies + 1, sizeof *m->evicted);
    m->moved = calloc(POLICY_TIERS * m->npolicies + 1, sizeof *m->moved);
    m->revived = calloc(POLICY_TIERS * m->npolicies + 1, sizeof *m->revived);
    m->requantized = calloc(m->npolicies + 1, sizeof *m->requantized);
    m->victims_dropped = calloc(m->npolicies + 1, sizeof *m->victims_dropped);
    m->step_hist = calloc(m->npolicies + 1, sizeof *m->step_hist);
    m->mass_hist = calloc(m->npolicies + 1, sizeof *m->mass_hist);
    m->int8_hist = calloc(m->npolicies + 1, sizeof *m->int8_hist);
    m->sketch_hist = calloc(m->npolicies + 1, sizeof *m->sketch_hist);
    m->int4_hist = calloc(m->npolicies + 1, sizeof *m->int4_hist);
    m->int2_hist = calloc(m->npolicies + 1, sizeof *m->int2_hist);
    if (!m->int4_hist || !m->int2_hist || !m->rpc_count || !m->rpc_hist || !m->appended ||
        !m->evicted || !m->step_hist || !m->mass_hist || !m->moved || !m->revived ||
        !m->requantized || !m->victims_dropped || !m->int8_hist || !m->sketch_hist) {
        metrics_destroy(m);
        return NULL;
    }
    return m;
}

void metrics_destroy(metrics *m)
{
    if (m == NULL)
        return;
    metrics_http_stop(m);
    free(m->rpc_count);
    free(m->rpc_hist);
    free(m->appended);
    free(m->evicted);
    free(m->moved);
    free(m->revived);
    free(m->requantized);
    free(m->victims_dropped);
    free(m->step_hist);
    free(m->mass_hist);
    free(m->int8_hist);
    free(m->sketch_hist);
    free(m->int4_hist);
    free(m->int2_hist);
    free(m);
}

/* ---- hooks ---------------------------------------------------------------- */

static long policy_index(const metrics *m, const policy_ops *p)
{
    for (size_t i = 0; i < m->npolicies; i++)
        if (m->policies[i] == p)
            return (long)i;
    return -1;
}

void metrics_rpc(void *ctx, size_t method, int code, double seconds)
{
    metrics *m = ctx;
    if (m == NULL || method >= m->nmethods)
        return;
    if (code < 0 || code >= RPC_CODES)
        code = ST_UNKNOWN;
    atomic_fetch_add_explicit(&m->rpc_count[method * RPC_CODES + (size_t)code], 1,
                              memory_order_relaxed);
    hist_observe(&m->rpc_hist[method], rpc_bounds, NBOUNDS(rpc_bounds), seconds);
}

void metrics_appended(metrics *m, const policy_ops *p, uint64_t tokens)
{
    long i = m != NULL ? policy_index(m, p) : -1;
    if (i >= 0)
        atomic_fetch_add_explicit(&m->appended[i], tokens, memory_order_relaxed);
}

void metrics_evicted(metrics *m, const policy_ops *p, int by_operator, uint64_t tokens)
{
    long i = m != NULL && tokens > 0 ? policy_index(m, p) : -1;
    if (i >= 0)
        atomic_fetch_add_explicit(&m->evicted[2 * (size_t)i + (by_operator != 0)], tokens,
                                  memory_order_relaxed);
}

void metrics_step(metrics *m, const policy_ops *p, double seconds)
{
    long i = m != NULL ? policy_index(m, p) : -1;
    if (i >= 0)
        hist_observe(&m->step_hist[i], step_bounds, NBOUNDS(step_bounds), seconds);
}

void metrics_reclaimed(metrics *m, const char *reason)
{
    if (m == NULL)
        return;
    size_t i = 0;
    while (i + 1 < NREASONS && strcmp(reclaim_reasons[i], reason) != 0)
        i++;
    atomic_fetch_add_explicit(&m->reclaimed[i], 1, memory_order_relaxed);
}

void metrics_fdsock_shed(metrics *m, metrics_shed reason)
{
    if (m != NULL && reason < METRICS_SHED_COUNT)
        atomic_fetch_add_explicit(&m->shed[reason], 1, memory_order_relaxed);
}

/* ---- attention mass dropped by an eviction ------------------------------------ */

struct metrics_mass {
    uint32_t layers;
    double *frac; /* [layers]: the fraction dropped, or -1 where nothing was */
};

static step_shape shape_of(const metrics_lists *v, unsigned arrays)
{
    return (step_shape){v->layers, v->q_heads, v->kv_heads, v->heads, arrays & STEP_ARRAYS};
}

/* Where list k of layer l's decision may evict: its span, within the
 * list's n tokens. */
static policy_span evict_span(const metrics_lists *v, const policy_decision *d, uint32_t l,
                              uint32_t k)
{
    uint32_t n = v->ntokens[(size_t)l * v->heads + k];
    policy_span sp = policy_decision_span_of(d, k, n);
    return sp.hi <= n ? sp : (policy_span){0, n};
}

/* Whether layer l's decision evicts a token of its lists. */
static int layer_evicts(const metrics_lists *v, const policy_decision *d, uint32_t l)
{
    for (uint32_t k = 0; k < v->heads; k++) {
        policy_span sp = evict_span(v, d, l, k);
        if (sp.hi > sp.lo && memchr(d->tier[k] + sp.lo, POLICY_EVICT, sp.hi - sp.lo) != NULL)
            return 1;
    }
    return 0;
}

/* The attention of row `w` (n tokens of a list whose new tiers are `tier`,
 * any evicted ones within span sp) added to *total, and that on evicted
 * tokens (found by memchr: a decode step evicts one) to *dropped. The
 * total runs in four sums: one sum waits for each addition, a millisecond
 * a step at 32k tokens and 32 layers. */
static void row_mass(const float *w, const uint8_t *tier, uint32_t n, policy_span sp, double *total,
                     double *dropped)
{
    double t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        t0 += w[i];
        t1 += w[i + 1];
        t2 += w[i + 2];
        t3 += w[i + 3];
    }
    for (; i < n; i++)
        t0 += w[i];
    *total += (t0 + t1) + (t2 + t3);
    if (sp.hi == sp.lo)
        return; /* maybe an empty list, with no array to offset */
    const uint8_t *end = tier + sp.hi;
    for (const uint8_t *p = tier + sp.lo; (p = memchr(p, POLICY_EVICT, (size_t)(end - p))) != NULL;
         p++)
        *dropped += w[p - tier];
}

metrics_mass *metrics_mass_measure(metrics *m, const metrics_lists *lists, unsigned arrays,
                                   const float *data, size_t nfloats,
                                   const policy_decision *const *d)
{
    unsigned attn = STEP_SCORE | STEP_LAST_ATTN | STEP_WINDOW_ATTN;
    if (m == NULL || data == NULL || d == NULL || !(arrays & attn))
        return NULL;
    if ((arrays & STEP_SCORE) && lists->heads != 1)
        return NULL; /* seq_step refuses it */
    step_shape sh = shape_of(lists, arrays);
    if (step_floats(&sh, lists->ntokens) != nfloats)
        return NULL; /* seq_step refuses it too */
    metrics_mass *mm = calloc(1, sizeof *mm);
    double *dropped = calloc(lists->layers + 1, sizeof *dropped);
    double *total = calloc(lists->layers + 1, sizeof *total);
    uint8_t *evicts = calloc(lists->layers + 1, 1);
    if (mm == NULL || dropped == NULL || total == NULL || evicts == NULL) {
        free(mm), free(dropped), free(total), free(evicts);
        return NULL;
    }
    for (uint32_t l = 0; l < lists->layers; l++)
        evicts[l] = d[l] != NULL && layer_evicts(lists, d[l], l);
    /* Which array is the attention: score, else last_attn, else window_attn;
     * each of its rows reads one list (proto/kvstash_step.h). */
    unsigned use = arrays & STEP_SCORE       ? STEP_SCORE
                   : arrays & STEP_LAST_ATTN ? STEP_LAST_ATTN
                                             : STEP_WINDOW_ATTN;
    step_cursor c;
    step_cursor_init(&c, &sh, lists->ntokens);
    while (step_cursor_next(&c))
        if (c.kind == use && evicts[c.layer])
            row_mass(data + c.offset, d[c.layer]->tier[c.list], c.count,
                     evict_span(lists, d[c.layer], c.layer, c.list), &total[c.layer],
                     &dropped[c.layer]);
    mm->layers = lists->layers;
    mm->frac = dropped; /* becomes the fractions, layer by layer */
    for (uint32_t l = 0; l < lists->layers; l++) {
        if (!evicts[l] || !(total[l] > 0)) {
            mm->frac[l] = -1;
            continue;
        }
        double f = dropped[l] / total[l];
        mm->frac[l] = f < 0 ? 0 : f > 1 ? 1 : f;
    }
    free(total);
    free(evicts);
    return mm;
}

void metrics_mass_end(metrics *m, metrics_mass *mm, const policy_ops *p, int ok)
{
    if (mm == NULL)
        return;
    long pi = m != NULL && ok ? policy_index(m, p) : -1;
    for (uint32_t l = 0; pi >= 0 && l < mm->layers; l++)
        if (mm->frac[l] >= 0)
            hist_observe(&m->mass_hist[pi], mass_bounds, NBOUNDS(mass_bounds), mm->frac[l]);
    free(mm->frac);
    free(mm);
}

/* ---- the exposition --------------------------------------------------------- */

/* The gauges of policies, summed over a store snapshot's sequences. */
typedef struct policy_gauges {
    uint64_t *seqs;   /* [npolicies] */
    uint64_t *tokens; /* [TIER_SLOT] */
} policy_gauges;

static int policy_gauges_sum(const metrics *m, const snapshot *s, policy_gauges *g)
{
    g->seqs = calloc(m->npolicies + 1, sizeof *g->seqs);
    g->tokens = calloc(POLICY_TIERS * m->npolicies + 1, sizeof *g->tokens);
    if (g->seqs == NULL || g->tokens == NULL)
        return -1;
    for (size_t i = 0; i < s->nseqs; i++) {
        long pi = policy_index(m, s->seqs[i].policy);
        if (pi < 0)
            continue;
        g->seqs[pi]++;
        for (int t = 0; t < POLICY_TIERS; t++)
            g->tokens[TIER_SLOT(pi, t)] += s->seqs[i].tier_tokens[t];
    }
    return 0;
}

static void head(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One histogram series: cumulative buckets, sum and count. `labels` is
 * `key="v",...` without braces (may be ""). */
static void hist_print(FILE *f, const char *name, const char *labels, const hist *h,
                       const double *bounds, size_t nb)
{
    uint64_t cum = 0;
    const char *sep = labels[0] ? "," : "";
    for (size_t b = 0; b <= nb; b++) {
        cum += atomic_load_explicit(&h->counts[b], memory_order_relaxed);
        if (b < nb)
            fprintf(f, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep, bounds[b],
                    (unsigned long long)cum);
        else
            fprintf(f, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                    (unsigned long long)cum);
    }
    double sum = (double)atomic_load_explicit(&h->sum_e9, memory_order_relaxed) * 1e-9;
    fprintf(f, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels, sum, name, labels,
            (unsigned long long)cum);
}

/* The operator's limits and their use (docs/reliability.md). */
static void print_limits(FILE *f, const snapshot *s)
{
    head(f, "kvstash_daemon_memory_limit_bytes", "gauge",
         "--max-daemon-mb: daemon memory sequences may reserve for sketch cells (0 = none).");
    fprintf(f, "kvstash_daemon_memory_limit_bytes %llu\n", (unsigned long long)s->mem_limit);
    head(f, "kvstash_sketch_reserved_bytes", "gauge",
         "Daemon memory reserved for sequences' sketch cells (their worst case).");
    fprintf(f, "kvstash_sketch_reserved_bytes %llu\n", (unsigned long long)s->mem_reserved);
    head(f, "kvstash_session_quota", "gauge",
         "Per-session quotas: --session-max-seqs (sequences), --session-max-blocks (blocks); "
         "0 = none.");
    fprintf(f, "kvstash_session_quota{kind=\"sequences\"} %u\n", s->session_max_seqs);
    fprintf(f, "kvstash_session_quota{kind=\"blocks\"} %u\n", s->session_max_blocks);
    head(f, "kvstash_worker_blocks", "gauge",
         "Pool blocks a worker session holds (its sequences and revive scratch).");
    for (size_t i = 0; i < s->nsessions; i++)
        fprintf(f, "kvstash_worker_blocks{session=\"%llu\"} %u\n",
                (unsigned long long)s->sessions[i].id, s->sessions[i].blocks);
}

static void print_store(FILE *f, const metrics *m, const snapshot *s, const policy_gauges *g)
{
    head(f, "kvstash_build_info", "gauge", "kvstashd version and memory backend.");
    fprintf(f, "kvstash_build_info{version=\"%s\",backend=\"%s\"} 1\n", KVSTASH_VERSION,
            s->backend != NULL ? s->backend : "host");
    head(f, "kvstash_backend_info", "gauge",
         "Where pools live: backend, device (none, or the GPU's UUID), device_name, and how "
         "workers map them (ipc: memfd, vmm, legacy, or auto (unresolved) until the first "
         "pool).");
    const backend_info *bi = &s->backend_info;
    fprintf(f,
            "kvstash_backend_info{backend=\"%s\",device=\"%s\",device_name=\"%s\",ipc=\"%s\"} "
            "1\n",
            s->backend != NULL ? s->backend : "host", bi->device[0] ? bi->device : "none",
            bi->device_name, bi->ipc[0] ? bi->ipc : "memfd");
    head(f, "kvstash_serving", "gauge", "1 while serving, 0 once shutdown began.");
    fprintf(f, "kvstash_serving %d\n", s->serving);
    head(f, "kvstash_uptime_seconds", "gauge", "Seconds since kvstashd started.");
    fprintf(f, "kvstash_uptime_seconds %.3f\n", (double)s->uptime_ms / 1000);
    head(f, "kvstash_events_published_total", "counter", "Events published on the nanomsg feed.");
    fprintf(f, "kvstash_events_published_total %llu\n", (unsigned long long)s->events);
    head(f, "kvstash_pools", "gauge", "Model pools (one per geometry) alive.");
    fprintf(f, "kvstash_pools %zu\n", s->npools);
    head(f, "kvstash_pool_capacity_bytes", "gauge", "Size of a pool's shared-memory arena.");
    for (size_t i = 0; i < s->npools; i++)
        fprintf(f, "kvstash_pool_capacity_bytes{pool=\"%llu\",model=\"%s\"} %llu\n",
                (unsigned long long)s->pools[i].id, s->pools[i].model,
                (unsigned long long)s->pools[i].bytes);
    head(f, "kvstash_pool_block_bytes", "gauge", "Bytes per block of a pool.");
    for (size_t i = 0; i < s->npools; i++)
        fprintf(f, "kvstash_pool_block_bytes{pool=\"%llu\",model=\"%s\"} %llu\n",
                (unsigned long long)s->pools[i].id, s->pools[i].model,
                (unsigned long long)s->pools[i].block_bytes);
    head(f, "kvstash_pool_blocks", "gauge",
         "Blocks of a pool: free, used (in tables), retired (waiting for a worker's epoch ack), "
         "quarantined (an ended session's, until its worker's process exits).");
    for (size_t i = 0; i < s->npools; i++) {
        const snapshot_pool *p = &s->pools[i];
        uint32_t used =
            p->blocks_total - p->blocks_free - p->blocks_retired - p->blocks_quarantined;
        const char *states[4] = {"free", "used", "retired", "quarantined"};
        uint32_t v[4] = {p->blocks_free, used, p->blocks_retired, p->blocks_quarantined};
        for (int k = 0; k < 4; k++)
            fprintf(f, "kvstash_pool_blocks{pool=\"%llu\",model=\"%s\",state=\"%s\"} %u\n",
                    (unsigned long long)p->id, p->model, states[k], v[k]);
    }
    head(f, "kvstash_memory_bytes", "gauge",
         "Memory holding K/V, by tier: full (full precision in the pool's dtype: every block "
         "not free and not quantised, retired and revive scratch included), int8, int4, int2 "
         "(pool blocks holding blocks of that tier), sketch (count-sketch cells, daemon "
         "memory).");
    for (size_t i = 0; i < s->npools; i++) {
        const snapshot_pool *p = &s->pools[i];
        uint64_t used = (uint64_t)(p->blocks_total - p->blocks_free) * p->block_bytes;
        uint64_t v[POLICY_TIERS];
        memcpy(v, p->tier_bytes, sizeof v);
        v[POLICY_FULL] = used - v[POLICY_INT8] - v[POLICY_INT4] - v[POLICY_INT2];
        for (int k = 0; k < POLICY_STORED_TIERS; k++)
            fprintf(f, "kvstash_memory_bytes{pool=\"%llu\",model=\"%s\",tier=\"%s\"} %llu\n",
                    (unsigned long long)p->id, p->model, policy_tier_name(policy_stored_tiers[k]),
                    (unsigned long long)v[policy_stored_tiers[k]]);
    }
    head(f, "kvstash_quarantined_sessions", "gauge",
         "Sessions that ended without a detach whose blocks wait for their worker's process "
         "to exit (--lease-end quarantine).");
    fprintf(f, "kvstash_quarantined_sessions %u\n", s->quarantined_sessions);
    head(f, "kvstash_quarantined_blocks", "gauge",
         "Pool blocks those sessions hold (kvstash_pool_blocks state=quarantined, summed).");
    fprintf(f, "kvstash_quarantined_blocks %u\n", s->quarantined_blocks);
    head(f, "kvstash_workers", "gauge", "Attached worker sessions.");
    fprintf(f, "kvstash_workers %zu\n", s->nsessions);
    head(f, "kvstash_workers_pending", "gauge",
         "Sessions identified on the fd socket (HELLO) but not attached yet; they end after "
         "--pending-timeout-ms.");
    fprintf(f, "kvstash_workers_pending %u\n", s->pending);
    print_limits(f, s);
    head(f, "kvstash_sequences", "gauge", "Live sequences, by policy.");
    for (size_t i = 0; i < m->npolicies; i++)
        fprintf(f, "kvstash_sequences{policy=\"%s\"} %llu\n", m->policies[i]->name,
                (unsigned long long)g->seqs[i]);
    head(f, "kvstash_tokens", "gauge",
         "Held tokens summed over layers (and KV-head lists), by policy and by the tier they "
         "are stored in (sketch: in-list sketch tokens and offloaded victims).");
    for (size_t i = 0; i < m->npolicies; i++)
        for (int k = 0; k < POLICY_STORED_TIERS; k++)
            fprintf(f, "kvstash_tokens{policy=\"%s\",tier=\"%s\"} %llu\n", m->policies[i]->name,
                    policy_tier_name(policy_stored_tiers[k]),
                    (unsigned long long)g->tokens[TIER_SLOT(i, policy_stored_tiers[k])]);
}

void metrics_tiers(metrics *m, const policy_ops *p, const snapshot_tiers *t)
{
    long i = m != NULL ? policy_index(m, p) : -1;
    if (i < 0)
        return;
    for (size_t k = 0; k < POLICY_TIERS; k++)
        atomic_fetch_add_explicit(&m->moved[TIER_SLOT(i, k)], t->moved[k], memory_order_relaxed);
    atomic_fetch_add_explicit(&m->requantized[i], t->requantized, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->victims_dropped[i], t->victims_dropped, memory_order_relaxed);
    for (size_t k = 0; k < t->nobs; k++) {
        if (t->obs[k].kind == POLICY_INT8)
            hist_observe(&m->int8_hist[i], int8_bounds, NBOUNDS(int8_bounds), t->obs[k].value);
        else if (t->obs[k].kind == POLICY_INT4)
            hist_observe(&m->int4_hist[i], int4_bounds, NBOUNDS(int4_bounds), t->obs[k].value);
        else if (t->obs[k].kind == POLICY_INT2)
            hist_observe(&m->int2_hist[i], int2_bounds, NBOUNDS(int2_bounds), t->obs[k].value);
        else
            hist_observe(&m->sketch_hist[i], sketch_bounds, NBOUNDS(sketch_bounds),
                         t->obs[k].value);
    }
}

void metrics_revived(metrics *m, const policy_ops *p, const uint32_t by_tier[POLICY_TIERS])
{
    long i = m != NULL ? policy_index(m, p) : -1;
    for (int t = 0; i >= 0 && t < POLICY_TIERS; t++)
        atomic_fetch_add_explicit(&m->revived[TIER_SLOT(i, t)], by_tier[t], memory_order_relaxed);
}

/* One histogram per policy: name{policy="..."}, with its HELP line. */
static void print_policy_hist(FILE *f, const metrics *m, const char *name, const char *help,
                              const hist *h, const double *bounds, size_t nb)
{
    char labels[160];
    head(f, name, "histogram", help);
    for (size_t i = 0; i < m->npolicies; i++) {
        snprintf(labels, sizeof labels, "policy=\"%s\"", m->policies[i]->name);
        hist_print(f, name, labels, &h[i], bounds, nb);
    }
}

/* One counter per policy and stored tier: name{policy="...",<label>="<tier>"}. */
static void print_tier_counter(FILE *f, const metrics *m, const char *name, const char *help,
                               const char *label, _Atomic uint64_t *v)
{
    head(f, name, "counter", help);
    for (size_t i = 0; i < m->npolicies; i++)
        for (size_t k = 0; k < POLICY_STORED_TIERS; k++)
            fprintf(f, "%s{policy=\"%s\",%s=\"%s\"} %llu\n", name, m->policies[i]->name, label,
                    policy_tier_name(policy_stored_tiers[k]),
                    (unsigned long long)atomic_load(&v[TIER_SLOT(i, policy_stored_tiers[k])]));
}

/* One counter per policy: name{policy="..."}. */
static void print_policy_counter(FILE *f, const metrics *m, const char *name, const char *help,
                                 _Atomic uint64_t *v)
{
    head(f, name, "counter", help);
    for (size_t i = 0; i < m->npolicies; i++)
        fprintf(f, "%s{policy=\"%s\"} %llu\n", name, m->policies[i]->name,
                (unsigned long long)atomic_load(&v[i]));
}

static void print_counters(FILE *f, const metrics *m)
{
    print_tier_counter(f, m, "kvstash_tier_moves_total",
                       "Tokens moved between storage tiers (summed over lists), by policy and "
                       "destination: demoted to int8, int4 or int2, put into the sketch "
                       "(offloaded or swapped out), brought back to full precision (full: in the "
                       "pool's dtype).",
                       "to", m->moved);
    print_tier_counter(f, m, "kvstash_revived_tokens_total",
                       "Tokens rebuilt by Revive into scratch blocks, by policy and the tier they "
                       "were stored in.",
                       "from", m->revived);
    print_policy_counter(f, m, "kvstash_appended_tokens_total",
                         "Tokens appended (per layer), by policy.", m->appended);
    print_policy_counter(f, m, "kvstash_int8_requantized_tokens_total",
                         "INT8 tokens re-quantised into fresh INT8 blocks when evictions left "
                         "them spread over too many (POLICIES.md §5.4 compaction), by policy.",
                         m->requantized);
    print_policy_counter(f, m, "kvstash_victims_dropped_total",
                         "Victims kept by victims=int8 (summed over lists) that memory pressure "
                         "freed to make room for appends; Revive no longer has them.",
                         m->victims_dropped);
    head(f, "kvstash_evicted_tokens_total", "counter",
         "Tokens evicted (summed over lists), by policy and by whom: the policy or an operator.");
    for (size_t i = 0; i < m->npolicies; i++)
        for (int by = 0; by < 2; by++)
            fprintf(f, "kvstash_evicted_tokens_total{policy=\"%s\",by=\"%s\"} %llu\n",
                    m->policies[i]->name, by ? "operator" : "policy",
                    (unsigned long long)atomic_load(&m->evicted[2 * i + (size_t)by]));
    print_policy_hist(
        f, m, "kvstash_step_duration_seconds",
        "Time kvstashd takes to serve one worker step from the per-step ring (checks, policy, "
        "table change), by policy; the doorbell wake-up is not included.",
        m->step_hist, step_bounds, NBOUNDS(step_bounds));
    print_policy_hist(
        f, m, "kvstash_eviction_attention_dropped_ratio",
        "Per layer and step that evicted tokens: the fraction of the attention the worker "
        "reported in that step (score, else last_attn, else window_attn) that was on the "
        "evicted tokens. Only steps that carry attention are measured.",
        m->mass_hist, mass_bounds, NBOUNDS(mass_bounds));
    print_policy_hist(
        f, m, "kvstash_int8_roundtrip_error_ratio",
        "Per INT8 demotion or re-quantisation (one list, one batch of INT8 blocks): max "
        "|dequantised - original| over max |original| of the K and V quantised (POLICIES.md "
        "§5.4 bounds it by 1/254; a re-quantisation's original is the dequantised value).",
        m->int8_hist, int8_bounds, NBOUNDS(int8_bounds));
    print_policy_hist(
        f, m, "kvstash_int4_roundtrip_error_ratio",
        "Per INT4 demotion or re-quantisation (demote=int4; one list, one batch of INT4 "
        "blocks): max |dequantised - original| over max |original| of the K and V quantised "
        "(half a group's step: at most about 1/15 of the list's range, in practice far less).",
        m->int4_hist, int4_bounds, NBOUNDS(int4_bounds));
    print_policy_hist(
        f, m, "kvstash_int2_roundtrip_error_ratio",
        "Per INT2 demotion or re-quantisation (demote=int2), as the INT4 one (half a group's "
        "step: at most about 1/3 of the list's range).",
        m->int2_hist, int2_bounds, NBOUNDS(int2_bounds));
    print_policy_hist(
        f, m, "kvstash_sketch_reconstruction_error_ratio",
        "Per insertion into a count-sketch (one list, one step's tokens): ||sketch estimate - "
        "original||_2 / ||original||_2 of the inserted K and V, right after the insertion: "
        "what a Revive of them would return then. Later insertions into shared buckets make "
        "it worse.",
        m->sketch_hist, sketch_bounds, NBOUNDS(sketch_bounds));
    head(f, "kvstash_workers_reclaimed_total", "counter",
         "Worker sessions ended, by reason (detach, lease-ended, fd-closed, shutdown, "
         "lease-timeout).");
    for (size_t i = 0; i < NREASONS; i++)
        fprintf(f, "kvstash_workers_reclaimed_total{reason=\"%s\"} %llu\n", reclaim_reasons[i],
                (unsigned long long)atomic_load(&m->reclaimed[i]));
    head(f, "kvstash_fdsock_shed_total", "counter",
         "fd-socket connections kvstashd closed unasked, by reason: fd-limit (accepted and "
         "closed at once: kvstashd was out of file descriptors), pending-timeout (no Attach "
         "within --pending-timeout-ms), pending-cap (the oldest pending one, at --max-pending).");
    for (size_t i = 0; i < METRICS_SHED_COUNT; i++)
        fprintf(f, "kvstash_fdsock_shed_total{reason=\"%s\"} %llu\n", shed_reasons[i],
                (unsigned long long)atomic_load(&m->shed[i]));
}

/* "/kvstash.v1.Store/Attach" -> service "kvstash.v1.Store", method "Attach". */
static void split_path(const char *path, char *service, size_t slen, const char **method)
{
    const char *slash = strrchr(path, '/');
    const char *start = path[0] == '/' ? path + 1 : path;
    size_t n = slash != NULL && slash > start ? (size_t)(slash - start) : 0;
    snprintf(service, slen, "%.*s", (int)n, start);
    *method = slash != NULL ? slash + 1 : path;
}

static void print_rpc(FILE *f, const metrics *m)
{
    char service[96], labels[192];
    const char *method;
    head(f, "kvstash_rpc_requests_total", "counter",
         "gRPC calls finished, by service, method and status code.");
    for (size_t i = 0; i < m->nmethods; i++) {
        split_path(m->methods[i].path, service, sizeof service, &method);
        for (int c = 0; c < RPC_CODES; c++) {
            uint64_t n = atomic_load(&m->rpc_count[i * RPC_CODES + (size_t)c]);
            if (n == 0 && c != 0)
                continue;
            fprintf(f,
                    "kvstash_rpc_requests_total{service=\"%s\",method=\"%s\",code=\"%s\"} "
                    "%llu\n",
                    service, method, status_name((status_code)c), (unsigned long long)n);
        }
    }
    head(f, "kvstash_rpc_duration_seconds", "histogram",
         "Time from a gRPC call's arrival to its reply being queued, by service and method.");
    for (size_t i = 0; i < m->nmethods; i++) {
        split_path(m->methods[i].path, service, sizeof service, &method);
        snprintf(labels, sizeof labels, "service=\"%s\",method=\"%s\"", service, method);
        hist_print(f, "kvstash_rpc_duration_seconds", labels, &m->rpc_hist[i], rpc_bounds,
                   NBOUNDS(rpc_bounds));
    }
}

/* The remote tier as last seen (a call, or the probe), and what the
 * sequences spilled there: only with --remote. */
static void print_remote(FILE *f, const snapshot *s)
{
    const remote_tier_status *r = &s->remote;
    if (!r->configured)
        return;
    const remote_health *h = &r->health;
    uint64_t spilled_tokens = 0, spilled_bytes = 0;
    for (size_t i = 0; i < s->nseqs; i++) {
        spilled_tokens += s->seqs[i].spilled_tokens;
        spilled_bytes += s->seqs[i].spilled_bytes;
    }
    head(f, "kvstash_remote_spilled_tokens", "gauge",
         "Victims of live sequences spilled to the remote tier (kvstash seq spill).");
    fprintf(f, "kvstash_remote_spilled_tokens %llu\n", (unsigned long long)spilled_tokens);
    head(f, "kvstash_remote_spilled_bytes", "gauge",
         "Bytes of their victim blocks and sketch cells in the remote tier.");
    fprintf(f, "kvstash_remote_spilled_bytes %llu\n", (unsigned long long)spilled_bytes);
    head(f, "kvstash_remote_healthy", "gauge",
         "1 when the remote tier's last call or probe succeeded and every slot has a node; "
         "kvstashd serves its local tiers either way.");
    fprintf(f, "kvstash_remote_healthy %d\n", h->ok ? 1 : 0);
    head(f, "kvstash_remote_nodes", "gauge",
         "Masters of the remote cluster in the last topology (state=\"total\") and those "
         "that answered last (state=\"up\").");
    fprintf(f, "kvstash_remote_nodes{state=\"total\"} %u\nkvstash_remote_nodes{state=\"up\"} %u\n",
            h->nodes, h->nodes_up);
    head(f, "kvstash_remote_slots_covered", "gauge", "Slots of 16384 with a master.");
    fprintf(f, "kvstash_remote_slots_covered %u\n", h->slots_covered);
    head(f, "kvstash_remote_last_ok_age_seconds", "gauge",
         "Seconds since a remote call or probe last succeeded (-1: never).");
    if (r->last_ok_age_ms == UINT64_MAX)
        fprintf(f, "kvstash_remote_last_ok_age_seconds -1\n");
    else
        fprintf(f, "kvstash_remote_last_ok_age_seconds %.3f\n", (double)r->last_ok_age_ms / 1e3);
    const struct {
        const char *name, *help;
        uint64_t v;
    } counters[] = {
        {"kvstash_remote_calls_total", "Calls made to the remote store.", h->calls},
        {"kvstash_remote_errors_total", "Remote calls that failed.", h->errors},
        {"kvstash_remote_timeouts_total", "Remote calls that failed for a node's timeout.",
         h->timeouts},
        {"kvstash_remote_redirects_total", "MOVED and ASK answers followed.", h->redirects},
        {"kvstash_remote_refreshes_total", "Reloads of the cluster's topology.", h->refreshes},
        {"kvstash_remote_written_bytes_total", "Value bytes written to the remote store.",
         h->bytes_written},
        {"kvstash_remote_read_bytes_total", "Value bytes read from the remote store.",
         h->bytes_read},
        {"kvstash_remote_probes_total", "Probes of every node (--remote-probe-ms).", r->probes},
        {"kvstash_remote_probe_failures_total", "Probes that found a node or slot missing.",
         r->probe_failures},
    };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        head(f, counters[i].name, "counter", counters[i].help);
        fprintf(f, "%s %llu\n", counters[i].name, (unsigned long long)counters[i].v);
    }
}

char *metrics_render(metrics *m, const snapshot *s, size_t *len)
{
    policy_gauges g;
    char *buf = NULL;
    size_t n = 0;
    FILE *f = policy_gauges_sum(m, s, &g) == 0 ? open_memstream(&buf, &n) : NULL;
    if (f != NULL) {
        print_store(f, m, s, &g);
        print_counters(f, m);
        print_rpc(f, m);
        print_remote(f, s);
        if (fclose(f) != 0) {
            free(buf);
            buf = NULL;
        }
    }
    free(g.seqs);
    free(g.tokens);
    if (len != NULL)
        *len = buf != NULL ? n : 0;
    return buf;
}

/* ---- HTTP ------------------------------------------------------------------- */

static enum MHD_Result reply(struct MHD_Connection *c, unsigned code, char *body, size_t len,
                             enum MHD_ResponseMemoryMode mode, const char *type)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (r == NULL) {
        if (mode == MHD_RESPMEM_MUST_FREE)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned code, const char *text)
{
    return reply(c, code, (char *)text, strlen(text), MHD_RESPMEM_PERSISTENT,
                 "text/plain; charset=utf-8");
}

/* /healthz: serving or not, and the remote tier's line when there is one. */
static enum MHD_Result reply_health(struct MHD_Connection *c, metrics *m)
{
    int serving = m->source.serving(m->source.ctx);
    remote_tier_status r = {0};
    if (m->source.remote != NULL)
        m->source.remote(m->source.ctx, &r);
    if (!r.configured)
        return serving ? reply_text(c, 200, "serving\n") : reply_text(c, 503, "shutting down\n");
    char *body = NULL;
    int n = asprintf(&body, "%s\nremote: %s%s%s\n", serving ? "serving" : "shutting down",
                     r.health.ok ? "healthy" : "unhealthy",
                     r.health.ok || r.health.last_error[0] == '\0' ? "" : ": ",
                     r.health.ok ? "" : r.health.last_error);
    if (n < 0)
        return reply_text(c, 500, "out of memory\n");
    return reply(c, serving ? 200 : 503, body, (size_t)n, MHD_RESPMEM_MUST_FREE,
                 "text/plain; charset=utf-8");
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    (void)con_cls;
    metrics *m = cls;
    if (*upload_size != 0)
        return reply_text(c, 413, "no request body expected\n");
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return reply_text(c, 405, "only GET\n");
    if (strcmp(url, "/metrics") == 0) {
        size_t len;
        snapshot snap;
        char *text = NULL;
        if (m->source.snapshot(m->source.ctx, &snap) == 0)
            text = metrics_render(m, &snap, &len);
        snapshot_free(&snap);
        if (text == NULL)
            return reply_text(c, 500, "out of memory\n");
        return reply(c, 200, text, len, MHD_RESPMEM_MUST_FREE,
                     "text/plain; version=0.0.4; charset=utf-8");
    }
    if (strcmp(url, "/healthz") == 0)
        return reply_health(c, m);
    return reply_text(c, 404, "kvstashd serves /metrics and /healthz\n");
}

int metrics_parse_addr(const char *addr, void *storage, unsigned *len)
{
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || colon == addr || colon[1] == '\0')
        return -1;
    char *end;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (*end != '\0' || port > 65535 || colon[1] == '-' || colon[1] == '+')
        return -1;
    char host[64];
    size_t hl = (size_t)(colon - addr);
    if (hl >= sizeof host)
        return -1;
    memcpy(host, addr, hl);
    host[hl] = '\0';
    memset(storage, 0, sizeof(struct sockaddr_storage));
    if (host[0] == '[') {
        if (hl < 3 || host[hl - 1] != ']')
            return -1;
        host[hl - 1] = '\0';
        struct sockaddr_in6 *a = storage;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        if (inet_pton(AF_INET6, host + 1, &a->sin6_addr) != 1)
            return -1;
        *len = sizeof *a;
        return IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) ? 1 : 0;
    }
    struct sockaddr_in *a = storage;
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)port);
    if (strcmp(host, "localhost") == 0)
        snprintf(host, sizeof host, "127.0.0.1");
    if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
        return -1;
    *len = sizeof *a;
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127 ? 1 : 0;
}

status_code metrics_http_start(metrics *m, const metrics_source *source, const char *addr,
                               int allow_remote, status *s)
{
    struct sockaddr_storage sa;
    unsigned salen;
    int lo = metrics_parse_addr(addr, &sa, &salen);
    if (lo < 0)
        return status_set(s, ST_INVALID_ARGUMENT,
                          "--metrics wants HOST:PORT (e.g. 127.0.0.1:9464 or [::1]:9464), got "
                          "'%.64s'",
                          addr);
    if (lo == 0 && !allow_remote)
        return status_set(s, ST_INVALID_ARGUMENT,
                          "--metrics %.64s is not a loopback address; the endpoint has no "
                          "authentication, so kvstashd serves it beyond loopback only with "
                          "--metrics-allow-remote",
                          addr);
    m->source = *source;
    /* Slow clients must not hold /healthz down (docs/reliability.md):
     * epoll (no FD_SETSIZE ceiling) with room for many connections, each cut
     * after METRICS_HTTP_TIMEOUT_S without progress, and off loopback a cap
     * per client address (on loopback the prober shares the address with
     * everyone else, so a cap there would lock it out too). */
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD;
    if (sa.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    m->http = MHD_start_daemon(flags, 0, NULL, NULL, handle, m, MHD_OPTION_SOCK_ADDR,
                               (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT,
                               METRICS_HTTP_MAX_CONNS, MHD_OPTION_CONNECTION_TIMEOUT,
                               METRICS_HTTP_TIMEOUT_S, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                               lo ? 0u : METRICS_HTTP_MAX_PER_IP, MHD_OPTION_END);
    if (m->http == NULL)
        return status_set(s, ST_UNAVAILABLE, "cannot serve metrics on %.64s (port in use?)", addr);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->http, MHD_DAEMON_INFO_BIND_PORT);
    m->port = info != NULL ? info->port : 0;
    return ST_OK;
}

unsigned metrics_http_port(const metrics *m)
{
    return m != NULL ? m->port : 0;
}

void metrics_http_stop(metrics *m)
{
    if (m == NULL || m->http == NULL)
        return;
    MHD_stop_daemon(m->http);
    m->http = NULL;
    m->port = 0;
}
