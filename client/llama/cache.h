/*
 * cache.h - the KV cache of kvstash-llama: either kvstashd (through
 * libkvstash) or a plain in-process array (the reference, --no-daemon).
 *
 * Per token the forward pass calls, in order:
 *   cache_token_begin  make room for the token (kvstashd: ring APPEND);
 *   cache_layer        per layer: store k and v of the token, then attend
 *                      over the cache with q, into st->att;
 *   cache_token_end    report the step's statistics to the policy (ring
 *                      STEP) and follow the table's epoch.
 *
 * With kvstashd the cache keeps a copy of the sequence's table (segments and
 * positions of each list) and re-reads it from the daemon only when the epoch
 * moves past what its own appends explain. Attention runs with the store's
 * kv_decode_attention over each list's segments, so evicted, compacted and
 * merged tokens are exactly what the model sees. The statistics sent are the
 * ones the policy's registry entry asks for (policy.h POLICY_NEEDS_*):
 *   score        Σ over query heads of this query's attention (one list)
 *   last_attn    this query's attention per query head
 *   window_attn  mean over the last `window` queries (running sums by
 *                position), decode steps and the step that ends a prompt
 *   vnorm        ‖V·W^O‖₁ per token and KV head, computed once when written
 *                (kv_vnorm_l1)
 *   confidence   confkv_confidence_logits of the step's logits
 *
 * Not thread-safe; one cache per thread. Errors: -1 with cache_error().
 */
#ifndef KVSTASH_LLAMA_CACHE_H
#define KVSTASH_LLAMA_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "kvstash.h"
#include "model.h"

#define CACHE_MAX_PARAMS 32

typedef struct cache_opts {
    const char *socket;     /* NULL = kvs_default_socket() */
    const char *model_name; /* the pool's model name */
    const char *policy;
    kvs_param params[CACHE_MAX_PARAMS]; /* sent with every sequence */
    size_t nparams;
    uint32_t block_tokens;
    kvs_dtype dtype;
} cache_opts;

typedef struct llm_cache llm_cache;

/* The in-process reference: [layer][position][kv_dim] fp32 arrays and a
 * plain softmax attention, no eviction. NULL when out of memory. */
llm_cache *cache_plain(const llm_model *m);

/* Attach to kvstashd for model m. On failure *out is NULL and err says why. */
int cache_kvstash(const llm_model *m, const cache_opts *o, llm_cache **out, char *err,
                  size_t errlen);

/* Start a new sequence (kvstashd: CreateSequence under the policy); the
 * previous one, if any, must have ended. */
int cache_seq_begin(llm_cache *c, const char *label);
/* Release the sequence. */
int cache_seq_end(llm_cache *c);

/*
 * Moving a sequence to another kvstashd (kvs_seq_export / kvs_seq_import,
 * through their shared remote tier). cache_seq_export writes the open
 * sequence to the remote tier and puts its name in uid; the sequence stays
 * open (release it with cache_seq_end). cache_seq_import opens the export
 * `uid` instead of a new sequence (none may be open): *appended is the
 * tokens it had appended, i.e. the position of the next cache_token_begin.
 * The cache re-reads the table (lists, positions, epoch) from the daemon and
 * counts `evicted` from the import on. The sequence's policy must be this
 * cache's (the statistics the steps carry depend on it). Both fail on the
 * plain cache.
 *
 * The worker's own state: the daemon moves the policy's state, but the
 * statistics of the SnapKV family (the observation window's queries) and of
 * criticalkv (value norms) are kept here, over earlier tokens. When the
 * policy needs them (cache_has_worker_state), cache_seq_export also writes
 * them to the file worker_path (replacing it whole; format in cache.c
 * "worker state"), and cache_seq_import reads them back from worker_path,
 * after checking it describes export `uid` of this model, policy and window,
 * and before importing anything: a missing, corrupted or mismatching file
 * fails with nothing imported. worker_path is not used (may be NULL) for
 * other policies.
 */
int cache_has_worker_state(const llm_cache *c);
int cache_seq_export(llm_cache *c, const char *worker_path, char uid[KVS_EXPORT_UID_LEN + 1]);
int cache_seq_import(llm_cache *c, const char *uid, const char *worker_path, uint32_t *appended);

/* Room for the token at position pos (positions are 0, 1, 2, ...). */
int cache_token_begin(llm_cache *c, uint32_t pos);

/* Layer l: store st->k, st->v for the token, attend with st->q into st->att
 * (reviving the list's sketch tokens first, if it has any). Returns 0, or -1
 * with cache_error set. */
int cache_layer(llm_cache *c, uint32_t l, llm_state *st);

/*
 * What the token ends. A prompt is one step: its tokens but the last are
 * `defer`red (appended and attended, no step), and its last token ends the
 * step with prefill set, reporting its own query's statistics (and the
 * window's mean). kvstashd asks for every statistic the policy needs in every
 * step, and the SnapKV family compresses on any step with window_attn, so a
 * prompt cannot be one step per token. Decode tokens are a step each.
 */
typedef struct cache_step {
    int prefill;         /* the step ends a prompt */
    int defer;           /* a prompt token before the last: no step yet */
    const float *logits; /* the step's next-token logits (confidence) */
} cache_step;

/* Report the step to the policy; re-read the table if it changed. */
int cache_token_end(llm_cache *c, const cache_step *s);

/* What the cache held when the last token attended. */
typedef struct cache_usage {
    uint64_t tokens;  /* summed over the lists of every layer */
    uint64_t bytes;   /* what the sequence holds: whole pool blocks of every tier,
                       * sketch cells, offloaded victims (cache.c usage_now) */
    uint64_t evicted; /* tokens the policy removed in this sequence so far */
} cache_usage;

void cache_get_usage(const llm_cache *c, cache_usage *u);

/* The daemon's Stats JSON object of the current sequence (caller frees), or
 * NULL (plain cache, no sequence, or the call failed). */
char *cache_seq_stats_json(llm_cache *c);

const char *cache_error(const llm_cache *c);
void cache_free(llm_cache *c);

#endif
