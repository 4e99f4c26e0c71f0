#include "pool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t pool_dtype_size(pool_dtype d)
{
    return d == POOL_FP32 ? 4 : 2;
}

static status_code check_range(status *st, const char *field, uint32_t v, uint32_t lo, uint32_t hi)
{
    if (v < lo || v > hi)
        return status_set(st, ST_INVALID_ARGUMENT, "geometry.%s must be in [%u, %u], got %u", field,
                          lo, hi, v);
    return ST_OK;
}

status_code pool_geometry_check(pool_geometry *g, status *st)
{
    if (check_range(st, "layers", g->layers, 1, 1024) ||
        check_range(st, "q_heads", g->q_heads, 1, 1024) ||
        check_range(st, "kv_heads", g->kv_heads, 1, 1024) ||
        check_range(st, "head_dim", g->head_dim, 1, 4096) ||
        check_range(st, "block_tokens", g->block_tokens, 1, 4096))
        return st->code;
    if (g->q_heads % g->kv_heads != 0)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "geometry.q_heads (%u) must be a multiple of geometry.kv_heads (%u)",
                          g->q_heads, g->kv_heads);
    if (g->dtype != POOL_FP16 && g->dtype != POOL_BF16 && g->dtype != POOL_FP32)
        return status_set(st, ST_INVALID_ARGUMENT,
                          "geometry.dtype must be DTYPE_FP16, DTYPE_BF16 or DTYPE_FP32, got %d",
                          (int)g->dtype);
    if (!isfinite(g->rope_theta) || g->rope_theta < 0)
        return status_set(st, ST_INVALID_ARGUMENT, "geometry.rope_theta must be >= 0, got %g",
                          (double)g->rope_theta);
    if (g->rope_theta == 0)
        g->rope_theta = 10000.0f;
    return ST_OK;
}

int pool_geometry_equal(const pool_geometry *a, const pool_geometry *b)
{
    return a->layers == b->layers && a->q_heads == b->q_heads && a->kv_heads == b->kv_heads &&
           a->head_dim == b->head_dim && a->block_tokens == b->block_tokens &&
           a->dtype == b->dtype && a->rope_theta == b->rope_theta;
}

void pool_geometry_format(const pool_geometry *g, char *buf, size_t len)
{
    static const char *const names[] = {"?", "fp16", "bf16", "fp32"};
    snprintf(buf, len,
             "layers=%u q_heads=%u kv_heads=%u head_dim=%u block_tokens=%u dtype=%s "
             "rope_theta=%g",
             g->layers, g->q_heads, g->kv_heads, g->head_dim, g->block_tokens,
             names[g->dtype <= POOL_FP32 ? g->dtype : 0], (double)g->rope_theta);
}

status_code pool_create(uint64_t id, const char *model, const pool_geometry *g, size_t max_bytes,
                        const backend *b, pool **out, status *st)
{
    *out = NULL;
    pool *p = calloc(1, sizeof *p);
    if (p == NULL)
        return status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory");
    p->id = id;
    snprintf(p->model, sizeof p->model, "%s", model);
    p->geom = *g;
    p->backend = b;
    p->arena.fd = -1;
    p->layout = (kv_layout){g->kv_heads, g->block_tokens, g->head_dim,
                            (uint32_t)pool_dtype_size(g->dtype), 0};
    p->block_bytes = kv_block_bytes(&p->layout);
    size_t count = max_bytes / p->block_bytes;
    if (count > UINT32_MAX)
        count = UINT32_MAX;
    if (count < g->layers) {
        status_set(st, ST_RESOURCE_EXHAUSTED,
                   "a pool of %zu bytes holds %zu blocks of %zu bytes, fewer than the model's "
                   "%u layers; start kvstashd with a larger --pool-mb",
                   max_bytes, count, p->block_bytes, g->layers);
        goto fail;
    }
    p->block_count = (uint32_t)count;
    p->bytes = count * p->block_bytes;
    p->free_stack = malloc(count * sizeof *p->free_stack);
    p->saved_stack = malloc(count * sizeof *p->saved_stack);
    p->held = malloc(count * sizeof *p->held);
    if (p->free_stack == NULL || p->saved_stack == NULL || p->held == NULL) {
        status_set(st, ST_RESOURCE_EXHAUSTED, "out of memory for %zu block ids", count);
        goto fail;
    }
    /* Pushed high to low so that allocation hands out block 0 first. */
    for (size_t i = 0; i < count; i++)
        p->free_stack[i] = (uint32_t)(count - 1 - i);
    p->nfree = p->block_count;
    if (b->arena_create(model, p->bytes, &p->arena, st) != ST_OK)
        goto fail;
    p->base = p->arena.base;
    *out = p;
    return ST_OK;
fail:
    pool_destroy(p);
    return st->code;
}

void pool_destroy(pool *p)
{
    if (p == NULL)
        return;
    if (p->base != NULL)
        p->backend->arena_destroy(&p->arena);
    free(p->free_stack);
    free(p->saved_stack);
    free(p->held);
    free(p);
}

int pool_read_blocks(const pool *p, const uint32_t *blocks, size_t n, uint8_t *host)
{
    const kv_ops *ops = p->backend->ops;
    for (size_t i = 0; i < n; i++)
        if (ops->copy(KV_DEVICE_TO_HOST, host + i * p->block_bytes,
                      p->base + (size_t)blocks[i] * p->block_bytes, p->block_bytes) != 0)
            return -1;
    return 0;
}

int pool_write_blocks(pool *p, const uint32_t *blocks, size_t n, const uint8_t *host)
{
    const kv_ops *ops = p->backend->ops;
    for (size_t i = 0; i < n; i++)
        if (ops->copy(KV_HOST_TO_DEVICE, p->base + (size_t)blocks[i] * p->block_bytes,
                      host + i * p->block_bytes, p->block_bytes) != 0)
            return -1;
    return 0;
}

status_code pool_share(const pool *p, backend_share *sh, status *st)
{
    return p->backend->arena_share(&p->arena, sh, st);
}

int pool_alloc_block(pool *p, uint32_t *block)
{
    if (p->nfree == 0)
        return -1;
    *block = p->free_stack[--p->nfree];
    /* Entries are popped one at a time: the first pop below the savepoint's
     * low-water mark reads an entry no push since has overwritten. */
    if (p->sp_active && p->nfree < p->sp_low)
        p->saved_stack[p->sp_low = p->nfree] = *block;
    return 0;
}

void pool_free_block(pool *p, uint32_t block)
{
    if (p->holding) /* room: a block in use is neither free nor held */
        p->held[p->nheld++] = block;
    else
        p->free_stack[p->nfree++] = block;
}

uint32_t pool_hold_begin(pool *p)
{
    p->holding = 1;
    return p->nheld;
}

uint32_t pool_hold_end(pool *p, uint32_t first)
{
    p->holding = 0;
    return p->nheld - first;
}

void pool_hold_free(pool *p, uint32_t first, uint32_t count)
{
    for (uint32_t i = 0; i < count; i++)
        p->free_stack[p->nfree++] = p->held[first + i];
    memmove(p->held + first, p->held + first + count,
            (size_t)(p->nheld - first - count) * sizeof *p->held);
    p->nheld -= count;
}

void pool_savepoint(pool *p)
{
    p->sp_mark = p->sp_low = p->nfree;
    p->sp_active = 1;
}

void pool_rollback(pool *p)
{
    memcpy(p->free_stack + p->sp_low, p->saved_stack + p->sp_low,
           (size_t)(p->sp_mark - p->sp_low) * sizeof *p->free_stack);
    p->nfree = p->sp_mark;
    p->sp_active = 0;
}

void pool_release(pool *p)
{
    p->sp_active = 0;
}
