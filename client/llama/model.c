/*
 * model.c - loading a llama2.c checkpoint and the forward pass pieces
 * (model.h). The arithmetic follows llama2.c's run.c (Karpathy, 2023) so
 * that perplexities compare with the numbers DESIGN.md quotes.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"

#define HEADER_BYTES 28u

static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (err != NULL && errlen > 0)
        vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Check the header's numbers and compute the floats the file must hold. */
static int config_check(const int32_t h[7], llm_config *c, uint64_t *floats, char *err,
                        size_t errlen)
{
    for (int i = 0; i < 7; i++)
        if (i != 5 && (h[i] <= 0 || h[i] > (1 << 20))) {
            set_err(err, errlen, "header field %d is %d (want 1..2^20)", i, h[i]);
            return -1;
        }
    if (h[5] == 0 || h[5] < -(1 << 20) || h[5] > (1 << 20)) {
        set_err(err, errlen, "vocab_size is %d", h[5]);
        return -1;
    }
    *c = (llm_config){(uint32_t)h[0],
                      (uint32_t)h[1],
                      (uint32_t)h[2],
                      (uint32_t)h[3],
                      (uint32_t)h[4],
                      (uint32_t)abs(h[5]),
                      (uint32_t)h[6],
                      0,
                      0,
                      h[5] > 0};
    if (c->dim % c->n_heads != 0 || c->n_heads % c->n_kv_heads != 0 ||
        (c->dim / c->n_heads) % 2 != 0) {
        set_err(err, errlen,
                "dim %u, n_heads %u, n_kv_heads %u: want dim = n_heads * an even head size "
                "and n_heads a multiple of n_kv_heads",
                c->dim, c->n_heads, c->n_kv_heads);
        return -1;
    }
    c->head_size = c->dim / c->n_heads;
    c->kv_dim = c->n_kv_heads * c->head_size;
    uint64_t D = c->dim, H = c->hidden_dim, L = c->n_layers, V = c->vocab_size, K = c->kv_dim;
    uint64_t n = V * D;                       /* token embedding */
    n += L * D * 2;                           /* rms_att, rms_ffn */
    n += L * (D * D * 2 + K * D * 2);         /* wq, wo, wk, wv */
    n += L * H * D * 3;                       /* w1, w2, w3 */
    n += D;                                   /* rms_final */
    n += (uint64_t)c->seq_len * c->head_size; /* two legacy RoPE tables */
    n += c->shared_classifier ? 0 : V * D;    /* wcls */
    *floats = n;
    return 0;
}

int llm_model_load(const char *path, llm_model *m, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        set_err(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    int32_t h[7];
    if (fstat(fd, &sb) != 0 || sb.st_size < (off_t)HEADER_BYTES ||
        pread(fd, h, sizeof h, 0) != (ssize_t)sizeof h) {
        set_err(err, errlen, "%s: not a llama2.c checkpoint (shorter than its header)", path);
        close(fd);
        return -1;
    }
    llm_config c;
    uint64_t floats;
    if (config_check(h, &c, &floats, err, errlen) != 0) {
        close(fd);
        return -1;
    }
    if ((uint64_t)sb.st_size != HEADER_BYTES + floats * 4) {
        set_err(err, errlen, "%s: %lld bytes, but its header describes %llu", path,
                (long long)sb.st_size, (unsigned long long)(HEADER_BYTES + floats * 4));
        close(fd);
        return -1;
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        set_err(err, errlen, "mmap %s: %s", path, strerror(errno));
        return -1;
    }
    m->c = c;
    m->map = map;
    m->map_bytes = (size_t)sb.st_size;
    size_t D = c.dim, H = c.hidden_dim, L = c.n_layers, V = c.vocab_size, K = c.kv_dim;
    const float *p = (const float *)((const char *)map + HEADER_BYTES);
    m->w.token_embedding = p, p += V * D;
    m->w.rms_att = p, p += L * D;
    m->w.wq = p, p += L * D * D;
    m->w.wk = p, p += L * K * D;
    m->w.wv = p, p += L * K * D;
    m->w.wo = p, p += L * D * D;
    m->w.rms_ffn = p, p += L * D;
    m->w.w1 = p, p += L * H * D;
    m->w.w2 = p, p += L * D * H;
    m->w.w3 = p, p += L * H * D;
    m->w.rms_final = p, p += D;
    p += (size_t)c.seq_len * c.head_size; /* freq_cis_real and _imag */
    m->w.wcls = c.shared_classifier ? m->w.token_embedding : p;
    return 0;
}

void llm_model_free(llm_model *m)
{
    if (m->map != NULL)
        munmap(m->map, m->map_bytes);
    memset(m, 0, sizeof *m);
}

int llm_state_init(llm_state *st, const llm_config *c)
{
    memset(st, 0, sizeof *st);
    st->x = calloc(c->dim, sizeof(float));
    st->xb = calloc(c->dim, sizeof(float));
    st->q = calloc(c->dim, sizeof(float));
    st->k = calloc(c->kv_dim, sizeof(float));
    st->v = calloc(c->kv_dim, sizeof(float));
    st->att = calloc(c->dim, sizeof(float));
    st->hb = calloc(c->hidden_dim, sizeof(float));
    st->hb2 = calloc(c->hidden_dim, sizeof(float));
    st->logits = calloc(c->vocab_size, sizeof(float));
    if (!st->x || !st->xb || !st->q || !st->k || !st->v || !st->att || !st->hb || !st->hb2 ||
        !st->logits) {
        llm_state_free(st);
        return -1;
    }
    return 0;
}

void llm_state_free(llm_state *st)
{
    free(st->x);
    free(st->xb);
    free(st->q);
    free(st->k);
    free(st->v);
    free(st->att);
    free(st->hb);
    free(st->hb2);
    free(st->logits);
    memset(st, 0, sizeof *st);
}

/* ---- arithmetic ---------------------------------------------------------- */

static void rmsnorm(float *o, const float *x, const float *w, uint32_t n)
{
    float ss = 0.0f;
    for (uint32_t j = 0; j < n; j++)
        ss += x[j] * x[j];
    ss /= (float)n;
    ss += 1e-5f;
    ss = 1.0f / sqrtf(ss);
    for (uint32_t j = 0; j < n; j++)
        o[j] = w[j] * (ss * x[j]);
}

/* Eight floats as one value: GCC's vector extension, lane-wise IEEE
 * arithmetic (an AVX register, or two SSE ones). */
typedef float v8sf __attribute__((vector_size(32)));

/* acc += row[j..j+8) * x[j..j+8), lane by lane (a macro: vectors are not
 * passed by value across functions, whose ABI depends on the target). */
#define MAC8(acc, row, x, j)                                                                       \
    do {                                                                                           \
        v8sf r_, x_;                                                                               \
        memcpy(&r_, (row) + (j), sizeof r_);                                                       \
        memcpy(&x_, (x) + (j), sizeof x_);                                                         \
        (acc) += r_ * x_;                                                                          \
    } while (0)

/* sum_j row[j] x[j] with 32 partial sums (four vectors, for instruction
 * level parallelism) in a fixed order, so that the result is the same for
 * every vector width and batch size. */
static inline float dot8(const float *row, const float *x, uint32_t n)
{
    v8sf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    uint32_t j = 0;
    for (; j + 32 <= n; j += 32) {
        MAC8(a0, row, x, j);
        MAC8(a1, row, x, j + 8);
        MAC8(a2, row, x, j + 16);
        MAC8(a3, row, x, j + 24);
    }
    for (; j + 8 <= n; j += 8)
        MAC8(a0, row, x, j);
    float tail = 0.0f;
    for (; j < n; j++)
        tail += row[j] * x[j];
    a0 = (a0 + a1) + (a2 + a3);
    return ((a0[0] + a0[4]) + (a0[1] + a0[5])) + ((a0[2] + a0[6]) + (a0[3] + a0[7])) + tail;
}

/* out_b[i] = sum_j w[i][j] x_b[j] for w [d][n] and nb inputs: each weight
 * row is read from memory once for the whole batch (the model does not fit
 * in cache, so one token at a time is bound by memory bandwidth). Cloned
 * for AVX2 (no FMA: the same roundings as the default clone). */
__attribute__((target_clones("avx2", "default"))) static void
matmul(float *const *out, const float *const *x, const float *w, uint32_t n, uint32_t d, size_t nb)
{
    for (uint32_t i = 0; i < d; i++) {
        const float *row = w + (size_t)i * n;
        for (size_t b = 0; b < nb; b++)
            out[b][i] = dot8(row, x[b], n);
    }
}

/* Pointer arrays of one buffer of every state in a batch. */
#define GATHER(arr, sts, nb, field)                                                                \
    float *arr[LLM_MAX_BATCH] = {0};                                                               \
    for (size_t b_ = 0; b_ < (nb); b_++)                                                           \
    arr[b_] = (sts)[b_]->field
void llm_embed(const llm_model *m, llm_state *st, uint32_t token)
{
    memcpy(st->x, m->w.token_embedding + (size_t)token * m->c.dim, m->c.dim * sizeof(float));
}

/* RoPE with interleaved pairs (i, i+1), base 10000, as llama2.c: q over all
 * of dim, k over kv_dim. */
static void rope(const llm_config *c, float *q, float *k, uint32_t pos)
{
    for (uint32_t i = 0; i < c->dim; i += 2) {
        uint32_t hd = i % c->head_size;
        float freq = 1.0f / powf(10000.0f, (float)hd / (float)c->head_size);
        float val = (float)pos * freq, fcr = cosf(val), fci = sinf(val);
        int rotn = i < c->kv_dim ? 2 : 1;
        for (int r = 0; r < rotn; r++) {
            float *vec = r == 0 ? q : k;
            float v0 = vec[i], v1 = vec[i + 1];
            vec[i] = v0 * fcr - v1 * fci;
            vec[i + 1] = v0 * fci + v1 * fcr;
        }
    }
}

void llm_layer_qkv(const llm_model *m, llm_state *const *st, size_t nb, uint32_t l,
                   const uint32_t *pos)
{
    const llm_config *c = &m->c;
    size_t D = c->dim, K = c->kv_dim;
    GATHER(xb, st, nb, xb);
    GATHER(q, st, nb, q);
    GATHER(k, st, nb, k);
    GATHER(v, st, nb, v);
    for (size_t b = 0; b < nb; b++)
        rmsnorm(st[b]->xb, st[b]->x, m->w.rms_att + l * D, c->dim);
    matmul(q, (const float *const *)xb, m->w.wq + l * D * D, c->dim, c->dim, nb);
    matmul(k, (const float *const *)xb, m->w.wk + l * K * D, c->dim, c->kv_dim, nb);
    matmul(v, (const float *const *)xb, m->w.wv + l * K * D, c->dim, c->kv_dim, nb);
    for (size_t b = 0; b < nb; b++)
        rope(c, st[b]->q, st[b]->k, pos[b]);
}

const float *llm_wo(const llm_model *m, uint32_t l)
{
    return m->w.wo + (size_t)l * m->c.dim * m->c.dim;
}

void llm_layer_finish(const llm_model *m, llm_state *const *st, size_t nb, uint32_t l)
{
    const llm_config *c = &m->c;
    size_t D = c->dim, H = c->hidden_dim;
    GATHER(xb, st, nb, xb);
    GATHER(att, st, nb, att);
    GATHER(hb, st, nb, hb);
    GATHER(hb2, st, nb, hb2);
    matmul(xb, (const float *const *)att, llm_wo(m, l), c->dim, c->dim, nb);
    for (size_t b = 0; b < nb; b++) {
        for (uint32_t i = 0; i < c->dim; i++)
            st[b]->x[i] += st[b]->xb[i];
        rmsnorm(st[b]->xb, st[b]->x, m->w.rms_ffn + l * D, c->dim);
    }
    matmul(hb, (const float *const *)xb, m->w.w1 + l * H * D, c->dim, c->hidden_dim, nb);
    matmul(hb2, (const float *const *)xb, m->w.w3 + l * H * D, c->dim, c->hidden_dim, nb);
    for (size_t b = 0; b < nb; b++)
        for (uint32_t i = 0; i < c->hidden_dim; i++) { /* SwiGLU: silu(w1 x) * (w3 x) */
            float v = st[b]->hb[i];
            st[b]->hb[i] = v * (1.0f / (1.0f + expf(-v))) * st[b]->hb2[i];
        }
    matmul(xb, (const float *const *)hb, m->w.w2 + l * D * H, c->hidden_dim, c->dim, nb);
    for (size_t b = 0; b < nb; b++)
        for (uint32_t i = 0; i < c->dim; i++)
            st[b]->x[i] += st[b]->xb[i];
}

void llm_logits(const llm_model *m, llm_state *const *st, size_t nb)
{
    GATHER(x, st, nb, x);
    GATHER(logits, st, nb, logits);
    for (size_t b = 0; b < nb; b++)
        rmsnorm(st[b]->x, st[b]->x, m->w.rms_final, m->c.dim);
    matmul(logits, (const float *const *)x, m->w.wcls, m->c.dim, m->c.vocab_size, nb);
}

double llm_logprob(const float *logits, uint32_t vocab, uint32_t token)
{
    double mx = logits[0], sum = 0;
    for (uint32_t i = 1; i < vocab; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (uint32_t i = 0; i < vocab; i++)
        sum += exp(logits[i] - mx);
    return logits[token] - mx - log(sum);
}

uint32_t llm_argmax(const float *logits, uint32_t vocab)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}
