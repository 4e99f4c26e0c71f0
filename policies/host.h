/*
 * host.h - the policy host: one sequence's logical token lists, driven by a
 * policy, with no memory behind them.
 *
 * The host owns what a policy sees (per layer, one token list or one per KV
 * head, with original positions and tiers), runs the policy's step, and
 * applies its decision to those lists. The daemon runs a host beside each
 * sequence and moves memory to match each decision between
 * policy_host_step() and policy_host_commit(); `kvstash replay` runs the same
 * host alone. So what replay prints is what the daemon does.
 */
#ifndef KVSTASH_POLICY_HOST_H
#define KVSTASH_POLICY_HOST_H

#include "policy.h"
#include "storage.h"

typedef struct policy_host policy_host;

/* Create a host for a policy with resolved parameters. Returns 0, or -1 with
 * err set (the policy's create() message). Free with policy_host_destroy. */
int policy_host_create(const policy_ops *ops, const policy_params *params,
                       const policy_geometry *geometry, policy_host **out, char *err,
                       size_t errlen);

void policy_host_destroy(policy_host *h);

const policy_ops *policy_host_ops(const policy_host *h);
void *policy_host_state(const policy_host *h);    /* the policy's state, for describe() */
uint32_t policy_host_heads(const policy_host *h); /* lists per layer: 1 or kv_heads */

/* The sequence's storage options (demote, int8, victims, sketch_*; storage.h). */
const policy_storage *policy_host_storage(const policy_host *h);

/* The sketch geometry of `layer`: the policy's own (ops->sketch_geometry),
 * else the storage options'. */
void policy_host_sketch_geometry(const policy_host *h, uint32_t layer, policy_sketch_geometry *out);

/* The order to apply the pending decision's tier changes of `layer` in
 * (ops->tier_order; indices into the view), or NULL with *n = 0. */
const uint32_t *policy_host_tier_order(const policy_host *h, uint32_t layer, size_t *n);

/* Append n tokens (positions appended .. appended+n-1, tier FULL) to every
 * list of every layer. Returns 0, or -1 (and changes nothing) when out of
 * memory or when positions would pass 2^32-1. */
int policy_host_append(policy_host *h, uint32_t n);

/* The current view of a layer (valid until the next append, commit or
 * rollback). */
const policy_layer_view *policy_host_view(policy_host *h, uint32_t layer);

/*
 * Run the policy on one layer. On success *decision (owned by the host,
 * valid until commit) says what changes: its tier arrays are indexed like the
 * current view, with the storage option int8 applied (policy_storage_demote). Steps are counted per
 * call on layer 0. Returns 0, or -1 with err set when the policy refused the stats or answered with
 * a decision that cannot be applied (a tier out of range, a merge that is not "evicted token into
 * kept token"); nothing is then pending.
 */
int policy_host_step(policy_host *h, uint32_t layer, const policy_stats *stats,
                     const policy_decision **decision, char *err, size_t errlen);

/*
 * Every layer's step at once: policy_host_step of layers 0, 1, ... with
 * stats[layer], each decision in decisions[layer] (fetch, below, or NULL). When the host may use
 * threads (policy_host_set_threads), the policy steps layers concurrently
 * (ops->layers_concurrent) and the lists hold at least min_tokens, the
 * policy's steps of the layers run on up to that many threads, the calling
 * one included; the decisions are those of the steps one after another.
 * Returns 0, or -1 with err (and errno) of the lowest layer that failed;
 * the layers stepped are then pending (a transaction's rollback undoes
 * them), and with threads, layers after the failed one may have stepped.
 */
/* What policy_host_step_layers calls, when given, before each layer's
 * policy step: fn(ctx, layer) readies that layer's statistics (kvstashd
 * copies them out of the memory its worker shares then, so that nothing
 * the worker writes later reaches the policy, on the threads that step the
 * layers). On threads it runs just before each layer's step, for
 * different layers at once; on one thread for every layer before the
 * first step. Non-zero fails the step with err. */
typedef struct policy_stats_fetch {
    int (*fn)(void *ctx, uint32_t layer, char *err, size_t errlen);
    void *ctx;
} policy_stats_fetch;

/* A thread the caller lends to the call for one of its helpers (kvstashd:
 * one kept by each ring thread, daemon/helper.h), instead of one started
 * and joined for it: start(ctx, fn, arg) runs fn(arg) there and returns 0,
 * or -1 when it cannot (then the host starts a thread of its own); join
 * waits until fn has returned. NULL: threads are started for the call. */
typedef struct policy_helper {
    int (*start)(void *ctx, void (*fn)(void *arg), void *arg);
    void (*join)(void *ctx);
    void *ctx;
} policy_helper;

int policy_host_step_layers(policy_host *h, const policy_stats *stats,
                            const policy_stats_fetch *fetch, const policy_helper *helper,
                            const policy_decision **decisions, char *err, size_t errlen);

/* Whether a step's stats.score may be memory the worker can still write
 * (policy_ops.stats_in_place), read by nothing but the policy's step: not
 * when the storage options rank demotions by the attention observed,
 * which the host reads after the step. */
int policy_host_stats_in_place(const policy_host *h);

/* Threads policy_host_step_layers may use (0 and 1: the calling thread
 * only), and the tokens held over all lists below which it uses one. */
void policy_host_set_threads(policy_host *h, uint32_t threads, uint64_t min_tokens);

/* What a daemon passes as min_tokens: a step over fewer tokens than this
 * (32 layers of 8k tokens) costs less than starting a thread. */
#define POLICY_HOST_PARALLEL_TOKENS (256u * 1024u)

/* The pending decision of `layer` (policy_host_step's), its spans widened
 * to whole lists: for a caller that changes tiers the policy did not (an
 * operator's move). */
policy_decision *policy_host_decision_whole(policy_host *h, uint32_t layer);

/* Apply the pending decision of `layer` to its lists: evicted tokens leave,
 * other tiers change. Returns the number of tokens evicted. */
size_t policy_host_commit(policy_host *h, uint32_t layer);

/*
 * Transactions. A call that steps, commits and appends over several layers
 * either keeps all of it or none (the daemon: a step, an operator's move, an
 * append ending a step). Between begin and end the host saves what it is
 * about to change; rollback puts everything back as it was at begin: every
 * layer's lists (tokens, positions, tiers), the policy's state (ops->save),
 * the counters (appended, steps), nothing pending. Saving happens inside
 * policy_host_step, once per layer per transaction (the layer's lists and the
 * policy's save()), and can fail like any allocation (-1, errno ENOMEM,
 * nothing changed); commit, append's effect on rollback, rollback and end
 * cannot fail. Transactions do not nest: begin inside one does nothing.
 * begin drops decisions still pending (as append does): a decision is
 * committed in the transaction that made it. Outside a transaction nothing
 * is saved. The view of a layer is valid until the next rollback too.
 */
void policy_host_begin(policy_host *h);
void policy_host_rollback(policy_host *h);
void policy_host_end(policy_host *h); /* keep the changes, drop the saved copies */

/*
 * Moving a sequence to another daemon (issue 17): its host's counters,
 * lists and policy state out of one host and into a fresh one of the same
 * policy, parameters and geometry. A policy moves when its step keeps no
 * per-layer state (ops->save NULL: its state is its parameters) or it can
 * write and read that state (ops->export_layer and import_layer);
 * policy_host_portable says whether h's can.
 */
int policy_host_portable(const policy_host *h);
/* Layer's policy state as bytes (ops->export_layer; malloc'd, the caller
 * frees), *len their count: 0 bytes (not NULL) for a policy without state.
 * NULL when out of memory. */
void *policy_host_export_state(const policy_host *h, uint32_t layer, size_t *len);
uint64_t policy_host_appended(const policy_host *h);
uint64_t policy_host_steps(const policy_host *h);
/* demote_keep's attention of list (layer, head), parallel to its view;
 * NULL when the storage options keep none. */
const float *policy_host_attn(const policy_host *h, uint32_t layer, uint32_t head);

/* One list as restore takes it: positions ascending and below appended,
 * stored tiers (not EVICT), attention when the host keeps it (else
 * ignored; NULL: zeros). */
typedef struct policy_host_list_image {
    uint32_t tokens;
    const uint32_t *pos;
    const uint8_t *tier;
    const float *attn;
} policy_host_list_image;

/* One layer's policy state as policy_host_export_state wrote it. */
typedef struct policy_host_state_image {
    const void *buf;
    size_t len;
} policy_host_state_image;

/* Set a fresh host (nothing appended, no transaction open) to `appended`
 * tokens, `steps` steps, lists[l * heads + k] for every layer l and list
 * k, and states[l] as every layer's policy state (NULL: no state, for a
 * policy without). Returns 0, or -1 with err naming what is wrong (a host
 * that is not portable or not fresh, a list out of order, a tier that is
 * not stored, state the policy refuses, out of memory); the host must then
 * be destroyed. */
int policy_host_restore(policy_host *h, uint64_t appended, uint64_t steps,
                        const policy_host_list_image *lists, const policy_host_state_image *states,
                        char *err, size_t errlen);

#endif
