/*
 * model.h - a llama2.c checkpoint and the pieces of its forward pass
 * (DESIGN.md "Quality is measured on a real model"): RMSNorm, RoPE with
 * interleaved pairs (i, i+1), grouped-query attention, SwiGLU.
 *
 * The attention itself is not here: the caller gets q, k and v of a layer
 * from llm_layer_qkv, computes the attention output over its cache (an
 * in-process array, or kvstashd's pool), puts it in st->att and finishes the
 * layer with llm_layer_finish. That split lets the same pass run with any
 * cache.
 *
 * Checkpoint format: 7 little-endian int32 (dim, hidden_dim, n_layers,
 * n_heads, n_kv_heads, vocab_size -- negative means an unshared classifier
 * at the end --, seq_len), then fp32 arrays: token embedding, rms_att, wq,
 * wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, two legacy RoPE tables of
 * seq_len * head_size / 2 floats each (skipped), then wcls if unshared.
 */
#ifndef KVSTASH_LLAMA_MODEL_H
#define KVSTASH_LLAMA_MODEL_H

#include <stddef.h>
#include <stdint.h>

typedef struct llm_config {
    uint32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
    uint32_t head_size; /* dim / n_heads */
    uint32_t kv_dim;    /* n_kv_heads * head_size */
    int shared_classifier;
} llm_config;

/* Pointers into the mapped checkpoint; row-major [out][in] matrices. */
typedef struct llm_weights {
    const float *token_embedding; /* [vocab][dim] */
    const float *rms_att;         /* [layers][dim] */
    const float *wq;              /* [layers][dim][dim] */
    const float *wk, *wv;         /* [layers][kv_dim][dim] */
    const float *wo;              /* [layers][dim][dim]: o_proj.weight */
    const float *rms_ffn;         /* [layers][dim] */
    const float *w1, *w3;         /* [layers][hidden][dim] */
    const float *w2;              /* [layers][dim][hidden] */
    const float *rms_final;       /* [dim] */
    const float *wcls;            /* [vocab][dim] */
} llm_weights;

typedef struct llm_model {
    llm_config c;
    llm_weights w;
    void *map;
    size_t map_bytes;
} llm_model;

/*
 * Map the checkpoint at `path` read-only and check that its size matches its
 * header exactly. On failure returns -1 with a message in err (the model is
 * left zeroed). Free with llm_model_free.
 */
int llm_model_load(const char *path, llm_model *m, char *err, size_t errlen);
void llm_model_free(llm_model *m);

/* Activations of one token; every buffer is owned by the state. */
typedef struct llm_state {
    float *x;        /* [dim] residual stream */
    float *xb;       /* [dim] normalised input */
    float *q;        /* [dim] = [n_heads][head_size], RoPE applied */
    float *k, *v;    /* [kv_dim] = [n_kv_heads][head_size]; k with RoPE */
    float *att;      /* [dim]: the caller's attention output, per query head */
    float *hb, *hb2; /* [hidden_dim] */
    float *logits;   /* [vocab] */
} llm_state;

/* Allocate the buffers (-1 when out of memory, nothing allocated). */
int llm_state_init(llm_state *st, const llm_config *c);
void llm_state_free(llm_state *st);

/* x = the embedding of `token` (checked < vocab by the caller). */
void llm_embed(const llm_model *m, llm_state *st, uint32_t token);

/*
 * The batched steps: st[0..nb) are nb independent tokens (of different
 * sequences, or the same one at different times), nb <= LLM_MAX_BATCH. A
 * batch reads each weight once for all its tokens; every token's result is
 * bit for bit what nb = 1 gives.
 */
#define LLM_MAX_BATCH 64

/* Layer l: xb = rmsnorm(x), q/k/v = W xb, RoPE at position pos[b]. */
void llm_layer_qkv(const llm_model *m, llm_state *const *st, size_t nb, uint32_t l,
                   const uint32_t *pos);

/* x += wo * att, then the SwiGLU feed-forward block with its residual. */
void llm_layer_finish(const llm_model *m, llm_state *const *st, size_t nb, uint32_t l);

/* logits = wcls * rmsnorm(x). */
void llm_logits(const llm_model *m, llm_state *const *st, size_t nb);

/* The per-layer W^O ([dim][dim], o_proj.weight) for value norms. */
const float *llm_wo(const llm_model *m, uint32_t l);

/* log softmax(logits)[token], in double. */
double llm_logprob(const float *logits, uint32_t vocab, uint32_t token);

/* The index of the largest logit (the lowest index on ties). */
uint32_t llm_argmax(const float *logits, uint32_t vocab);

#endif
