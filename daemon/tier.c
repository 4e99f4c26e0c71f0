#include "tier.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int tier_ctx_init(tier_ctx *c, const kv_ops *ops, uint8_t *base, size_t block_bytes,
                  const kv_layout *l, kv_dtype dtype)
{
    c->ops = ops;
    c->base = base;
    c->block_bytes = block_bytes;
    c->l = *l;
    c->l8 = c->l4 = c->l2 = *l;
    c->l8.block_tokens = kv_int8_tokens_per_block(l);
    c->l4.block_tokens = kv_lowbit_tokens_per_block(l, 4);
    c->l2.block_tokens = kv_lowbit_tokens_per_block(l, 2);
    c->dtype = dtype;
    c->copy_chunk = TIER_COPY_CHUNK_BYTES / tier_token_bytes(c);
    c->copy_chunk = c->copy_chunk > 0 ? c->copy_chunk : 1;
    return c->l8.block_tokens > 0 ? 0 : -1;
}

const kv_layout *tier_layout(const tier_ctx *c, uint8_t t)
{
    switch (t) {
    case POLICY_INT8:
        return &c->l8;
    case POLICY_INT4:
        return &c->l4;
    case POLICY_INT2:
        return &c->l2;
    default:
        return &c->l;
    }
}

uint32_t tier_block_tokens(const tier_ctx *c, uint8_t t)
{
    return tier_layout(c, t)->block_tokens;
}

size_t tier_token_bytes(const tier_ctx *c)
{
    return 2 * (size_t)c->l.kv_heads * c->l.head_dim * c->l.elt_size;
}

uint8_t *tier_stage_alloc(const tier_ctx *c, size_t n)
{
    return c->ops->alloc((n ? n : 1) * tier_token_bytes(c));
}

void tier_stage_free(const tier_ctx *c, uint8_t *stage)
{
    c->ops->free(stage);
}

/* The segments of a token list (kernels take segment lists, token by
 * token in list order): runs of consecutive slots of one block. *nsegs
 * receives their number. */
static kv_segment *token_segments(const tier_token *tok, size_t n, size_t *nsegs)
{
    kv_segment *sg = malloc((n ? n : 1) * sizeof *sg);
    size_t m = 0;
    for (size_t i = 0; sg != NULL && i < n; i++) {
        if (m > 0 && sg[m - 1].block == tok[i].block &&
            sg[m - 1].first_slot + sg[m - 1].count == tok[i].slot)
            sg[m - 1].count++;
        else
            sg[m++] = (kv_segment){tok[i].block, tok[i].slot, 1};
    }
    *nsegs = m;
    return sg;
}

/* The kernels of quantised tier t (INT8, INT4 or INT2), on layout ql:
 * the nq segments q of arena qpool into the nout segments out of `to`,
 * blocks of layout dl. */
static int quant_dequantize(const tier_ctx *c, uint8_t t, const kv_layout *ql, const uint8_t *qpool,
                            const kv_segment *q, size_t nq, const kv_layout *dl, uint8_t *to,
                            const kv_segment *out, size_t nout)
{
    if (t == POLICY_INT8)
        return c->ops->int8_dequantize(ql, qpool, q, nq, c->dtype, dl, to, out, nout);
    return c->ops->lowbit_dequantize(ql, t == POLICY_INT4 ? 4 : 2, qpool, q, nq, c->dtype, dl, to,
                                     out, nout);
}

/* Whether tier t's quantised blocks, each at the start of its pool block,
 * are exactly a pool block long: then the pool is an arena of them (pool
 * block b is quantised block b of an arena at the pool's base) and one
 * kernel call reads any number. So it is for INT8 when kv_heads x head_dim
 * is a multiple of 8 (kernels.h: T8 = T x elt_size - 4 tokens then fill
 * the block exactly), Llama's shapes among them. */
static int quant_blocks_tile_pool(const tier_ctx *c, uint8_t t)
{
    const kv_layout *ql = tier_layout(c, t);
    size_t qb = t == POLICY_INT8 ? kv_int8_block_bytes(ql)
                                 : kv_lowbit_block_bytes(ql, t == POLICY_INT4 ? 4 : 2);
    return qb == c->block_bytes;
}

static int quant_quantize(const tier_ctx *c, uint8_t t, const kv_layout *ql, const uint8_t *stage,
                          const kv_segment *sg, uint8_t *qpool)
{
    const uint32_t zero = 0;
    if (t == POLICY_INT8)
        return c->ops->int8_quantize(ql, c->dtype, stage, sg, 1, qpool, &zero, 1);
    return c->ops->lowbit_quantize(ql, t == POLICY_INT4 ? 4 : 2, c->dtype, stage, sg, 1, qpool,
                                   &zero, 1);
}

/* Device staging that a read keeps between calls (tier_copy reads a chunk
 * at a time): grown on demand, given back by read_stage_free. */
typedef struct read_stage {
    uint8_t *quant; /* blocks of a quantised tier's layout, dequantised */
    size_t quant_bytes;
    uint8_t *mixed; /* each tier class's tokens, before they are interleaved */
    size_t mixed_bytes;
} read_stage;

static uint8_t *read_stage_get(const tier_ctx *c, uint8_t **buf, size_t *have, size_t bytes)
{
    if (*have >= bytes)
        return *buf;
    c->ops->free(*buf);
    *buf = c->ops->alloc(bytes);
    *have = *buf != NULL ? bytes : 0;
    return *buf;
}

static void read_stage_free(const tier_ctx *c, read_stage *rs)
{
    c->ops->free(rs->quant);
    c->ops->free(rs->mixed);
}

/* Dequantise the tokens of tok in quantised tier t (in order) into
 * contiguous k, v of m tokens (device memory), through rs's staging blocks
 * of that tier. */
static int read_quantised(const tier_ctx *c, uint8_t t, const tier_token *tok, size_t n, size_t m,
                          uint8_t *k, uint8_t *v, read_stage *rs)
{
    const kv_ops *ops = c->ops;
    const kv_layout *ql = tier_layout(c, t);
    uint32_t tq = ql->block_tokens;
    size_t nblocks = (m + tq - 1) / tq, bbq = kv_block_bytes(ql);
    uint8_t *stage = read_stage_get(c, &rs->quant, &rs->quant_bytes, nblocks * bbq);
    int tiled = quant_blocks_tile_pool(c, t);
    kv_segment *dst = malloc(m * sizeof *dst);
    kv_segment *runs = tiled ? malloc(2 * m * sizeof *runs) : NULL; /* q, then out */
    int rc = stage != NULL && dst != NULL && (runs != NULL || !tiled) ? 0 : -1;
    /* A segment per run of consecutive slots of one quantised block, cut
     * where the staging block ends: all in one call where the quantised
     * blocks tile the pool, else one call per run (the kernel addresses
     * one arena per call, here a pool block). */
    size_t j = 0, nruns = 0;
    for (size_t i = 0; rc == 0 && i < n;) {
        if (tok[i].tier != t) {
            i++;
            continue;
        }
        uint32_t run = 1, room = tq - (uint32_t)(j % tq);
        while (i + run < n && run < room && tok[i + run].tier == t &&
               tok[i + run].block == tok[i].block && tok[i + run].slot == tok[i].slot + run)
            run++;
        kv_segment q = {tiled ? tok[i].block : 0, tok[i].slot, run};
        kv_segment out = {(uint32_t)(j / tq), (uint32_t)(j % tq), run};
        if (tiled) {
            runs[nruns] = q;
            runs[m + nruns++] = out;
        } else {
            rc = quant_dequantize(c, t, ql, c->base + (size_t)tok[i].block * c->block_bytes, &q, 1,
                                  ql, stage, &out, 1);
        }
        for (uint32_t r = 0; r < run; r++, j++)
            dst[j] = (kv_segment){(uint32_t)(j / tq), (uint32_t)(j % tq), 1};
        i += run;
    }
    if (rc == 0 && tiled)
        rc = quant_dequantize(c, t, ql, c->base, runs, nruns, ql, stage, runs + m, nruns);
    if (rc == 0)
        rc = ops->gather(ql, stage, dst, m, k, v);
    free(runs);
    free(dst);
    return rc;
}

/* The tokens of tier class t (POLICY_FULL or a quantised tier) of tok into
 * contiguous k, v of m tokens. */
static int read_tier(const tier_ctx *c, uint8_t t, const tier_token *tok, size_t n, size_t m,
                     uint8_t *k, uint8_t *v, read_stage *rs)
{
    if (t != POLICY_FULL)
        return read_quantised(c, t, tok, n, m, k, v, rs);
    kv_segment *sf = malloc((m ? m : 1) * sizeof *sf);
    if (sf == NULL)
        return -1;
    size_t j = 0;
    for (size_t i = 0; i < n; i++)
        if (tok[i].tier == POLICY_FULL)
            sf[j++] = (kv_segment){tok[i].block, tok[i].slot, 1};
    int rc = c->ops->gather(&c->l, c->base, sf, m, k, v);
    free(sf);
    return rc;
}

/* All n tokens at full precision: one gather, straight into k and v. */
static int read_full(const tier_ctx *c, const tier_token *tok, size_t n, uint8_t *k, uint8_t *v)
{
    size_t ns;
    kv_segment *sg = token_segments(tok, n, &ns);
    int rc = sg != NULL ? c->ops->gather(&c->l, c->base, sg, ns, k, v) : -1;
    free(sg);
    return rc;
}

/* The tiers tier_read tells apart, and their count. */
static const uint8_t read_tiers[] = {POLICY_FULL, POLICY_INT8, POLICY_INT4, POLICY_INT2};
#define READ_TIERS (sizeof read_tiers)

static size_t read_class(uint8_t t)
{
    for (size_t i = 0; i < READ_TIERS; i++)
        if (read_tiers[i] == t)
            return i;
    return 0;
}

/* Interleave the staged tokens of each tier (at kc[i], vc[i]: halves
 * [kv_heads][count[i]][head_dim]) back into list order in k, v: per run of
 * consecutive tokens of one tier, one strided copy of its kv_heads rows, K
 * then V. Tiers come in long runs (old tokens quantised, recent ones not);
 * a copy per token costs a synchronous call each on a GPU. */
static int interleave(const tier_ctx *c, const tier_token *tok, size_t n, uint8_t *const *kc,
                      uint8_t *const *vc, const size_t *count, uint8_t *k, uint8_t *v)
{
    size_t row = (size_t)c->l.head_dim * c->l.elt_size, at[READ_TIERS] = {0};
    int rc = 0;
    for (size_t i = 0, run; rc == 0 && i < n; i += run) {
        size_t cl = read_class(tok[i].tier), a = at[cl];
        for (run = 1; i + run < n && read_class(tok[i + run].tier) == cl; run++)
            ;
        at[cl] += run;
        const uint8_t *sk = kc[cl] + a * row, *sv = vc[cl] + a * row;
        rc = c->ops->copy_2d(KV_DEVICE_TO_DEVICE, k + i * row, n * row, sk, count[cl] * row,
                             run * row, c->l.kv_heads);
        if (rc == 0)
            rc = c->ops->copy_2d(KV_DEVICE_TO_DEVICE, v + i * row, n * row, sv, count[cl] * row,
                                 run * row, c->l.kv_heads);
    }
    return rc;
}

/* tier_read through rs's staging. */
static int read_staged(const tier_ctx *c, const tier_token *tok, size_t n, uint8_t *k, uint8_t *v,
                       read_stage *rs)
{
    size_t count[READ_TIERS] = {0}, kinds = 0, only = 0;
    for (size_t i = 0; i < n; i++)
        count[read_class(tok[i].tier)]++;
    for (size_t t = 0; t < READ_TIERS; t++)
        if (count[t] > 0)
            kinds++, only = t;
    if (kinds <= 1 && only == 0)
        return read_full(c, tok, n, k, v);
    if (kinds == 1)
        return read_quantised(c, read_tiers[only], tok, n, n, k, v, rs);
    size_t half = tier_token_bytes(c) / 2;
    uint8_t *buf = read_stage_get(c, &rs->mixed, &rs->mixed_bytes, n * tier_token_bytes(c));
    uint8_t *kc[READ_TIERS], *vc[READ_TIERS];
    int rc = buf != NULL ? 0 : -1;
    uint8_t *at = buf;
    for (size_t t = 0; t < READ_TIERS; t++) {
        kc[t] = at;
        vc[t] = at + count[t] * half;
        at += 2 * count[t] * half;
        if (rc == 0 && count[t] > 0)
            rc = read_tier(c, read_tiers[t], tok, n, count[t], kc[t], vc[t], rs);
    }
    return rc == 0 ? interleave(c, tok, n, kc, vc, count, k, v) : rc;
}

int tier_read(const tier_ctx *c, const tier_token *tok, size_t n, uint8_t *k, uint8_t *v)
{
    read_stage rs = {0};
    int rc = read_staged(c, tok, n, k, v, &rs);
    read_stage_free(c, &rs);
    return rc;
}

/* n full-precision tokens pool to pool (kv_copy_tokens), no staging. */
static int copy_full(const tier_ctx *c, const tier_token *src, size_t n, const tier_token *dst)
{
    size_t nfrom, nto;
    kv_segment *from = token_segments(src, n, &nfrom), *to = token_segments(dst, n, &nto);
    int rc =
        from != NULL && to != NULL ? c->ops->copy_tokens(&c->l, c->base, from, nfrom, to, nto) : -1;
    free(from);
    free(to);
    return rc;
}

/* Tokens src[0..n) of one tier: a run of full-precision ones, or of
 * consecutive slots of one quantised block (at most its block_tokens). */
static size_t copy_run_length(const tier_token *src, size_t n)
{
    size_t r = 1;
    if (src[0].tier == POLICY_FULL) {
        while (r < n && src[r].tier == POLICY_FULL)
            r++;
        return r;
    }
    while (r < n && src[r].tier == src[0].tier && src[r].block == src[0].block &&
           src[r].slot == src[0].slot + r)
        r++;
    return r;
}

/* The tokens of src[0..n) in quantised tier t dequantised straight into
 * their slots of dst (the pool's layout is the kernel's destination
 * layout): where the tier's blocks tile the pool, all in one kernel call,
 * which splits over threads; else a call per run of one quantised block
 * (the kernel addresses one arena per call, there a pool block). */
static int copy_quantised(const tier_ctx *c, uint8_t t, const tier_token *src, size_t n,
                          const tier_token *dst)
{
    const kv_layout *ql = tier_layout(c, t);
    int tiled = quant_blocks_tile_pool(c, t);
    kv_segment *q = malloc((n ? n : 1) * sizeof *q), *out = malloc((n ? n : 1) * sizeof *out);
    int rc = q != NULL && out != NULL ? 0 : -1;
    size_t nq = 0, nout = 0;
    for (size_t a = 0, r; rc == 0 && a < n; a += r) {
        r = copy_run_length(src + a, n - a);
        if (src[a].tier != t)
            continue;
        q[nq++] = (kv_segment){tiled ? src[a].block : 0, src[a].slot, (uint32_t)r};
        for (size_t i = a; i < a + r; i++) { /* dst's slots, runs joined */
            if (nout > 0 && out[nout - 1].block == dst[i].block &&
                out[nout - 1].first_slot + out[nout - 1].count == dst[i].slot)
                out[nout - 1].count++;
            else
                out[nout++] = (kv_segment){dst[i].block, dst[i].slot, 1};
        }
        if (!tiled) {
            rc = quant_dequantize(c, t, ql, c->base + (size_t)src[a].block * c->block_bytes, q, 1,
                                  &c->l, c->base, out, nout);
            nq = nout = 0;
        }
    }
    if (rc == 0 && nq > 0)
        rc = quant_dequantize(c, t, ql, c->base, q, nq, &c->l, c->base, out, nout);
    free(q);
    free(out);
    return rc;
}

/*
 * tier_copy in host memory: full-precision runs pool to pool, and each
 * quantised tier's tokens dequantised straight into their slots. The
 * tokens are read once from memory and written once, with no staging
 * between (issue 16 §4: a Revive from INT8). On a device each
 * non-tiling run would be a kernel call of microseconds: there the chunks
 * below.
 */
static int copy_host(const tier_ctx *c, const tier_token *src, size_t n, const tier_token *dst)
{
    int rc = 0;
    for (size_t a = 0, r; rc == 0 && a < n; a += r) {
        r = copy_run_length(src + a, n - a);
        if (src[a].tier == POLICY_FULL)
            rc = copy_full(c, src + a, r, dst + a);
    }
    for (uint8_t t = 0; rc == 0 && t < POLICY_TIERS; t++)
        if (policy_tier_quantised(t) && tier_block_tokens(c, t) > 0)
            rc = copy_quantised(c, t, src, n, dst);
    return rc;
}

int tier_copy(const tier_ctx *c, const tier_token *src, size_t n, const tier_token *dst)
{
    size_t nq = 0;
    for (size_t i = 0; i < n; i++)
        nq += policy_tier_quantised(src[i].tier);
    if (nq == 0) /* pool to pool, no staging */
        return copy_full(c, src, n, dst);
    if (c->ops->host_memory)
        return copy_host(c, src, n, dst);
    size_t tb = tier_token_bytes(c), chunk = c->copy_chunk < n ? c->copy_chunk : n;
    read_stage rs = {0};
    uint8_t *k = tier_stage_alloc(c, chunk);
    int rc = k != NULL ? 0 : -1;
    for (size_t a = 0; rc == 0 && a < n; a += chunk) {
        size_t cnt = n - a < chunk ? n - a : chunk, half = cnt * tb / 2;
        rc = read_staged(c, src + a, cnt, k, k + half, &rs);
        if (rc == 0)
            rc = tier_write(c, dst + a, cnt, k, k + half);
    }
    tier_stage_free(c, k);
    read_stage_free(c, &rs);
    return rc;
}

int tier_write(const tier_ctx *c, const tier_token *dst, size_t n, const uint8_t *k,
               const uint8_t *v)
{
    size_t ns;
    kv_segment *sg = token_segments(dst, n, &ns);
    int rc = sg != NULL ? c->ops->scatter(&c->l, c->base, sg, ns, k, v) : -1;
    free(sg);
    return rc;
}

static int all_full(const tier_token *tok, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (tok[i].tier != POLICY_FULL)
            return 0;
    return 1;
}

/* Tokens src[0..cnt) into slots 0..cnt of `block`, a staging block of
 * layout ql (cnt <= its block_tokens). A whole block of full-precision
 * tokens is one gather: its [kv_heads][cnt][head_dim] K and V are the
 * block's layout. Anything else is read contiguously into *rows
 * (allocated on first use, a block's worth) and scattered. */
static int stage_block(const tier_ctx *c, const kv_layout *ql, const tier_token *src, size_t cnt,
                       uint8_t *block, uint8_t **rows)
{
    if (cnt == ql->block_tokens && all_full(src, cnt)) {
        size_t ns;
        kv_segment *sg = token_segments(src, cnt, &ns);
        int rc = sg != NULL
                     ? c->ops->gather(&c->l, c->base, sg, ns, block, block + kv_block_bytes(ql) / 2)
                     : -1;
        free(sg);
        return rc;
    }
    if (*rows == NULL && (*rows = tier_stage_alloc(c, ql->block_tokens)) == NULL)
        return -1;
    size_t half = cnt * tier_token_bytes(c) / 2;
    kv_segment all = {0, 0, (uint32_t)cnt};
    int rc = tier_read(c, src, cnt, *rows, *rows + half);
    return rc == 0 ? c->ops->scatter(ql, block, &all, 1, *rows, *rows + half) : rc;
}

int tier_quantize(const tier_ctx *c, uint8_t t, const tier_token *src, size_t n,
                  const uint32_t *qblocks, size_t nq)
{
    const kv_layout *ql = tier_layout(c, t);
    uint32_t tq = ql->block_tokens;
    if (!policy_tier_quantised(t) || tq == 0)
        return -1;
    uint8_t *block = c->ops->alloc(kv_block_bytes(ql)), *rows = NULL;
    int rc = block != NULL ? 0 : -1;
    for (size_t b = 0; rc == 0 && b < nq; b++) {
        size_t j0 = b * tq, cnt = n - j0 < tq ? n - j0 : tq;
        kv_segment sg = {0, 0, (uint32_t)cnt};
        rc = stage_block(c, ql, src + j0, cnt, block, &rows);
        if (rc == 0)
            rc =
                quant_quantize(c, t, ql, block, &sg, c->base + (size_t)qblocks[b] * c->block_bytes);
    }
    c->ops->free(block);
    tier_stage_free(c, rows);
    return rc;
}

int tier_sketch_init(tier_sketch *s, const tier_ctx *c, const policy_sketch_geometry *g)
{
    memset(s, 0, sizeof *s);
    const kv_ops *ops = c->ops;
    size_t dim = (size_t)c->l.kv_heads * c->l.head_dim, cells = (size_t)g->rows * g->buckets;
    s->ops = ops;
    s->sk = (kv_sketch){g->rows,
                        g->buckets,
                        (uint32_t)dim,
                        g->key_mean ? KV_ESTIMATE_MEAN : KV_ESTIMATE_SUM,
                        g->value_mean ? KV_ESTIMATE_MEAN : KV_ESTIMATE_SUM,
                        ops->alloc(cells * dim * sizeof(float)),
                        ops->alloc(cells * dim * sizeof(float)),
                        ops->alloc(cells * sizeof(int32_t))};
    s->layer_seed = g->layer_seed;
    if (s->sk.key == NULL || s->sk.value == NULL || s->sk.count == NULL ||
        ops->fill(s->sk.key, 0, cells * dim * sizeof(float)) != 0 ||
        ops->fill(s->sk.value, 0, cells * dim * sizeof(float)) != 0 ||
        ops->fill(s->sk.count, 0, cells * sizeof(int32_t)) != 0) {
        tier_sketch_free(s);
        return -1;
    }
    return 0;
}

void tier_sketch_free(tier_sketch *s)
{
    if (s->ops != NULL) {
        s->ops->free(s->sk.key);
        s->ops->free(s->sk.value);
        s->ops->free(s->sk.count);
    }
    memset(s, 0, sizeof *s);
}

size_t tier_sketch_bytes(const tier_sketch *s)
{
    if (s->sk.key == NULL)
        return 0;
    return tier_sketch_bytes_for(s->sk.rows, s->sk.buckets, s->sk.dim);
}

size_t tier_sketch_bytes_for(uint32_t rows, uint32_t buckets, size_t dim)
{
    /* key and value cells (fp32 [dim] each) and a count per cell; the
     * numbers come from a client's parameters: saturate, never wrap. */
    size_t cells = (size_t)rows * buckets, per_cell, bytes;
    if (__builtin_mul_overflow(dim, 2 * sizeof(float), &per_cell) ||
        __builtin_add_overflow(per_cell, sizeof(int32_t), &per_cell) ||
        __builtin_mul_overflow(cells, per_cell, &bytes))
        return SIZE_MAX;
    return bytes;
}

/* Buckets and signs of n positions; the caller frees *h (g shares it). */
static int sketch_hash(const tier_sketch *s, const uint32_t *pos, size_t n, uint32_t **h,
                       int8_t **g)
{
    size_t r = s->sk.rows;
    uint64_t *p64 = malloc((n ? n : 1) * sizeof *p64);
    *h = malloc((n ? n : 1) * r * (sizeof **h + sizeof **g));
    if (p64 == NULL || *h == NULL) {
        free(p64);
        free(*h);
        return -1;
    }
    *g = (int8_t *)(*h + n * r);
    for (size_t i = 0; i < n; i++)
        p64[i] = pos[i];
    kv_sketch_hash_list(s->layer_seed, s->sk.rows, s->sk.buckets, p64, n, *h, *g);
    free(p64);
    return 0;
}

int tier_sketch_insert(tier_sketch *s, const tier_ctx *c, const uint32_t *pos,
                       const tier_token *src, size_t n)
{
    if (n == 0)
        return 0;
    uint32_t *h;
    int8_t *g;
    if (sketch_hash(s, pos, n, &h, &g) != 0)
        return -1;
    int rc = -1;
    if (all_full(src, n)) {
        size_t ns;
        kv_segment *sg = token_segments(src, n, &ns);
        if (sg != NULL)
            rc = c->ops->sketch_insert(&s->sk, &c->l, c->dtype, c->base, sg, ns, h, g);
        free(sg);
    } else {
        /* The kernel reads one block of n tokens of the list's layout: K
         * then V, as tier_read stages them. */
        kv_layout one = c->l;
        one.block_tokens = (uint32_t)n;
        kv_segment all = {0, 0, (uint32_t)n};
        uint8_t *stage = tier_stage_alloc(c, n);
        if (stage != NULL)
            rc = tier_read(c, src, n, stage, stage + n * tier_token_bytes(c) / 2);
        if (rc == 0)
            rc = c->ops->sketch_insert(&s->sk, &one, c->dtype, stage, &all, 1, h, g);
        tier_stage_free(c, stage);
    }
    free(h);
    return rc;
}

int tier_sketch_read(tier_sketch *s, const tier_ctx *c, uint8_t *base, const uint32_t *pos,
                     size_t n, const tier_token *dst, int remove)
{
    uint32_t *h;
    int8_t *g;
    size_t ns;
    kv_segment *sg = token_segments(dst, n, &ns);
    if (sg == NULL || sketch_hash(s, pos, n, &h, &g) != 0) {
        free(sg);
        return -1;
    }
    int rc = remove ? c->ops->sketch_revive(&s->sk, h, g, &c->l, c->dtype, base, sg, ns)
                    : c->ops->sketch_query(&s->sk, h, g, &c->l, c->dtype, base, sg, ns);
    free(sg);
    free(h);
    return rc;
}

int tier_sketch_delete(tier_sketch *s, const uint32_t *pos, size_t n)
{
    uint32_t *h;
    int8_t *g;
    if (n == 0)
        return 0;
    if (sketch_hash(s, pos, n, &h, &g) != 0)
        return -1;
    int rc = s->ops->sketch_delete(&s->sk, h, g, n);
    free(h);
    return rc;
}

/* Compare n staged tokens `got` with n staged originals `ref` (K then V
 * halves each), device memory, on the device: only the sums reach the
 * host. */
static int staged_diff(const tier_ctx *c, const uint8_t *got, const uint8_t *ref, size_t n,
                       kv_diff *d)
{
    size_t half = n * tier_token_bytes(c) / 2, elems = half / c->l.elt_size;
    int rc = c->ops->diff(got, ref, c->dtype, elems, d);
    return rc == 0 ? c->ops->diff(got + half, ref + half, c->dtype, elems, d) : rc;
}

int tier_sketch_cells(const tier_sketch *s, const uint32_t *pos, size_t n, uint32_t *cells)
{
    uint32_t *h;
    int8_t *g;
    if (sketch_hash(s, pos, n, &h, &g) != 0)
        return -1;
    for (size_t k = 0; k < n; k++)
        for (uint32_t i = 0; i < s->sk.rows; i++)
            cells[k * s->sk.rows + i] = i * s->sk.buckets + h[k * s->sk.rows + i];
    free(h);
    return 0;
}

/* Copy cells[0..nc) out of the sketch into `save` ([nc] key rows, [nc]
 * value rows, [nc] counts), or back (to_save 0). */
static int sketch_cells_copy(const tier_sketch *s, const uint32_t *cells, size_t nc, uint8_t *save,
                             int to_save)
{
    size_t row = s->sk.dim * sizeof(float);
    int rc = 0;
    for (size_t j = 0; rc == 0 && j < nc; j++) {
        uint8_t *cell[3] = {(uint8_t *)(s->sk.key + (size_t)cells[j] * s->sk.dim),
                            (uint8_t *)(s->sk.value + (size_t)cells[j] * s->sk.dim),
                            (uint8_t *)(s->sk.count + cells[j])};
        uint8_t *saved[3] = {save + j * row, save + (nc + j) * row,
                             save + 2 * nc * row + j * sizeof(int32_t)};
        const size_t bytes[3] = {row, row, sizeof(int32_t)};
        for (int a = 0; rc == 0 && a < 3; a++)
            rc = s->ops->copy(KV_DEVICE_TO_DEVICE, to_save ? saved[a] : cell[a],
                              to_save ? cell[a] : saved[a], bytes[a]);
    }
    return rc;
}

int tier_sketch_cells_save(const tier_sketch *s, const uint32_t *cells, size_t nc, uint8_t **save)
{
    *save = s->ops->alloc(nc * (2 * s->sk.dim * sizeof(float) + sizeof(int32_t)) + 1);
    if (*save != NULL && sketch_cells_copy(s, cells, nc, *save, 1) == 0)
        return 0;
    s->ops->free(*save);
    *save = NULL;
    return -1;
}

void tier_sketch_cells_restore(tier_sketch *s, const uint32_t *cells, size_t nc,
                               const uint8_t *save)
{
    sketch_cells_copy(s, cells, nc, (uint8_t *)save, 0);
}

size_t tier_error_sample(size_t n, uint32_t idx[TIER_ERROR_SAMPLE])
{
    size_t m = n < TIER_ERROR_SAMPLE ? n : TIER_ERROR_SAMPLE;
    for (size_t i = 0; i < m; i++)
        idx[i] = (uint32_t)(i * n / m);
    return m;
}

int tier_error_ratio(const tier_ctx *c, const tier_token *tok, size_t n, const uint8_t *stage,
                     double *ratio)
{
    size_t half = n * tier_token_bytes(c) / 2;
    uint8_t *got = tier_stage_alloc(c, n);
    kv_diff d = {0, 0, 0, 0};
    int rc = got != NULL ? tier_read(c, tok, n, got, got + half) : -1;
    if (rc == 0)
        rc = staged_diff(c, got, stage, n, &d);
    if (rc == 0)
        *ratio = d.max_ref > 0 ? d.max_diff / d.max_ref : 0;
    tier_stage_free(c, got);
    return rc;
}

int tier_sketch_error(const tier_sketch *s, const tier_ctx *c, const uint32_t *pos, size_t n,
                      const uint8_t *stage, double *rel)
{
    /* Query into a staging block of n tokens, laid out like the originals. */
    kv_layout one = c->l;
    one.block_tokens = (uint32_t)n;
    uint8_t *got = tier_stage_alloc(c, n);
    uint32_t *h;
    int8_t *g;
    kv_diff d = {0, 0, 0, 0};
    kv_segment all = {0, 0, (uint32_t)n};
    int rc = -1;
    if (got != NULL && sketch_hash(s, pos, n, &h, &g) == 0) {
        rc = c->ops->sketch_query(&s->sk, h, g, &one, c->dtype, got, &all, 1);
        free(h);
    }
    if (rc == 0)
        rc = staged_diff(c, got, stage, n, &d);
    if (rc == 0)
        *rel = d.sq_ref > 0 ? sqrt(d.sq_diff / d.sq_ref) : 0;
    tier_stage_free(c, got);
    return rc;
}

/* The three arrays one after another, as tier_sketch_bytes counts them:
 * saved into `out`, or loaded from `in` (the other NULL). */
static int sketch_copy(const tier_sketch *s, uint8_t *out, const uint8_t *in)
{
    size_t cells = (size_t)s->sk.rows * s->sk.buckets, fl = cells * s->sk.dim * sizeof(float);
    void *dev[3] = {s->sk.key, s->sk.value, s->sk.count};
    size_t len[3] = {fl, fl, cells * sizeof(int32_t)}, off = 0;
    for (int i = 0; i < 3; i++) {
        int rc = out != NULL ? s->ops->copy(KV_DEVICE_TO_HOST, out + off, dev[i], len[i])
                             : s->ops->copy(KV_HOST_TO_DEVICE, dev[i], in + off, len[i]);
        if (rc != 0)
            return -1;
        off += len[i];
    }
    return 0;
}

int tier_sketch_save(const tier_sketch *s, uint8_t *host)
{
    return s->sk.key == NULL ? -1 : sketch_copy(s, host, NULL);
}

int tier_sketch_load(tier_sketch *s, const uint8_t *host)
{
    return s->sk.key == NULL ? -1 : sketch_copy(s, NULL, host);
}
