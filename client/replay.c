/*
 * replay.c - `kvstash replay` (replay.h; the format is docs/replay.md).
 *
 * One sequence lives in a policy host (policies/host.h). Generic operations
 * (append, step, held, state) drive any policy exactly as the daemon does:
 * append the step's tokens, run the policy on every layer, apply its
 * decision. A policy may add operations in its own terms (ov_block: issue
 * 3's scores, evict, state, rotation) through policy_ops.replay; the replay
 * hands them the line through policies/policy_replay.h and knows none of
 * them.
 */
#include "replay.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "describe.h"
#include "host.h"
#include "policy.h"
#include "policy_replay.h"

#define EXIT_BAD 1   /* bad trace or invalid configuration */
#define EXIT_USAGE 2 /* bad command line */

/* ---- output text ---------------------------------------------------------- */

/* The JSON lines replay prints grow in a policy_text (describe.h). */
typedef policy_text text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    policy_text_vadd(t, fmt, ap);
    va_end(ap);
}

/* A double as JSON: the shortest text that reads back as v, and null for
 * what JSON cannot say (inf, nan). */
static void put_double(text *t, double v)
{
    if (v != v || v - v != 0)
        put(t, "null");
    else
        policy_text_double(t, v);
}

/* ---- the replay ------------------------------------------------------------ */

typedef struct replay {
    const policy_ops *ops; /* the policy the user named */
    policy_geometry g;
    policy_host *h;
    uint32_t heads; /* lists per layer */
    unsigned long line;
    uint64_t steps;
    FILE *out, *err;
    text t;
} replay;

static void report(replay *r, const char *kind, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* One message about the current line on the error stream. */
static void report(replay *r, const char *kind, const char *fmt, va_list ap)
{
    fprintf(r->err, "kvstash replay: line %lu: %s", r->line, kind);
    vfprintf(r->err, fmt, ap);
    fputc('\n', r->err);
}

static int fail(replay *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Report a bad trace line; returns -1. */
static int fail(replay *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(r, "", fmt, ap);
    va_end(ap);
    return -1;
}

/* Write the pending output line. */
static int emit(replay *r)
{
    if (r->t.failed)
        return fail(r, "out of memory");
    fwrite(r->t.buf, 1, r->t.len, r->out);
    fputc('\n', r->out);
    r->t.len = 0;
    return 0;
}

/* ---- JSON helpers ---------------------------------------------------------- */

/* A non-negative integer <= max. *out is set on every path (0 on error):
 * GCC at -O3 cannot otherwise prove that callers which return on error
 * never read it (-Wmaybe-uninitialized). */
static int get_uint(replay *r, json_t *v, uint64_t max, uint64_t *out, const char *what)
{
    json_int_t i = json_is_integer(v) ? json_integer_value(v) : -1;
    *out = 0;
    if (i < 0 || (uint64_t)i > max)
        return fail(r, "%s must be an integer in [0, %" PRIu64 "]", what, max);
    *out = (uint64_t)i;
    return 0;
}

static int get_true(replay *r, json_t *v, const char *op)
{
    if (!json_is_true(v))
        return fail(r, "%s: the value must be true", op);
    return 0;
}

/* Keys of an object other than those listed (NULL-terminated) are errors. */
static int only_keys(replay *r, json_t *obj, const char *const *keys, const char *what)
{
    const char *k;
    json_t *v;
    json_object_foreach(obj, k, v)
    {
        int known = 0;
        for (size_t i = 0; keys[i] != NULL; i++)
            known |= strcmp(k, keys[i]) == 0;
        if (!known)
            return fail(r, "%s: unknown field '%s'", what, k);
    }
    return 0;
}

/* Allocations of one operation, freed together. */
typedef struct arena {
    void **p;
    size_t n, cap;
} arena;

static void *arena_alloc(arena *a, size_t bytes)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 16;
        void **p = realloc(a->p, cap * sizeof *p);
        if (p == NULL)
            return NULL;
        a->p = p;
        a->cap = cap;
    }
    void *m = calloc(1, bytes ? bytes : 1);
    if (m != NULL)
        a->p[a->n++] = m;
    return m;
}

static void arena_free(arena *a)
{
    for (size_t i = 0; i < a->n; i++)
        free(a->p[i]);
    free(a->p);
    a->p = NULL;
    a->n = a->cap = 0;
}

/* arr must be an array of exactly n numbers; *out gets them as floats. */
static int float_list(replay *r, arena *a, json_t *arr, size_t n, float **out, const char *what)
{
    if (!json_is_array(arr))
        return fail(r, "%s must be an array of %zu numbers", what, n);
    if (json_array_size(arr) != n)
        return fail(r, "%s has %zu values, the list holds %zu tokens", what, json_array_size(arr),
                    n);
    float *f = arena_alloc(a, n * sizeof *f);
    if (f == NULL)
        return fail(r, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_number(v))
            return fail(r, "%s[%zu] is not a number", what, i);
        f[i] = (float)json_number_value(v);
    }
    *out = f;
    return 0;
}

/* arr must be an array of exactly n items. */
static int sized(replay *r, json_t *arr, size_t n, const char *what, const char *items)
{
    if (!json_is_array(arr) || json_array_size(arr) != n)
        return fail(r, "%s must be an array of %zu %s", what, n, items);
    return 0;
}

/* The length of the list that query head qh reads in layer l. */
static uint32_t qhead_list_len(replay *r, uint32_t l, uint32_t qh)
{
    const policy_layer_view *v = policy_host_view(r->h, l);
    uint32_t list = r->heads == 1 ? 0 : qh / (r->g.q_heads / r->g.kv_heads);
    return v->tokens[list];
}

/* [layers][q_heads][list] arrays (last_attn, window_attn). */
static int per_qhead(replay *r, arena *a, json_t *arr, const float *const **out, const char *name)
{
    char what[64];
    if (sized(r, arr, r->g.layers, name, "layer lists") != 0)
        return -1;
    for (uint32_t l = 0; l < r->g.layers; l++) {
        json_t *ly = json_array_get(arr, l);
        snprintf(what, sizeof what, "step: %s[%" PRIu32 "]", name, l);
        if (sized(r, ly, r->g.q_heads, what, "query-head lists") != 0)
            return -1;
        float **heads = arena_alloc(a, r->g.q_heads * sizeof *heads);
        if (heads == NULL)
            return fail(r, "out of memory");
        for (uint32_t q = 0; q < r->g.q_heads; q++) {
            snprintf(what, sizeof what, "step: %s[%" PRIu32 "][%" PRIu32 "]", name, l, q);
            if (float_list(r, a, json_array_get(ly, q), qhead_list_len(r, l, q), &heads[q], what) !=
                0)
                return -1;
        }
        out[l] = (const float *const *)heads;
    }
    return 0;
}

/* ---- generic operations ------------------------------------------------------ */

static int op_append(replay *r, json_t *obj)
{
    static const char *const keys[] = {"append", NULL};
    uint64_t n;
    if (only_keys(r, obj, keys, "append") != 0 ||
        get_uint(r, json_object_get(obj, "append"), UINT32_MAX, &n, "append") != 0)
        return -1;
    if (policy_host_append(r->h, (uint32_t)n) != 0)
        return fail(r, "append: cannot append %" PRIu64 " tokens (position range or memory)", n);
    return 0;
}

/* The stats of every layer of one step, parsed from the trace. */
typedef struct step_in {
    policy_stats base;
    const float **score;              /* [layers] or NULL */
    const float *const **last_attn;   /* [layers] or NULL */
    const float *const **window_attn; /* [layers] or NULL */
    const float *const **vnorm;       /* [layers] or NULL */
} step_in;

static int parse_step_arrays(replay *r, arena *a, json_t *s, step_in *in)
{
    uint32_t L = r->g.layers;
    char what[64];
    json_t *v;
    if ((v = json_object_get(s, "score")) != NULL) {
        if (r->heads != 1)
            return fail(r,
                        "step: score is for policies that decide per layer; %s decides per "
                        "KV head",
                        r->ops->name);
        in->score = arena_alloc(a, L * sizeof *in->score);
        if (in->score == NULL || sized(r, v, L, "step: score", "layer lists") != 0)
            return in->score == NULL ? fail(r, "out of memory") : -1;
        for (uint32_t l = 0; l < L; l++) {
            snprintf(what, sizeof what, "step: score[%" PRIu32 "]", l);
            float *f;
            if (float_list(r, a, json_array_get(v, l), policy_host_view(r->h, l)->tokens[0], &f,
                           what) != 0)
                return -1;
            in->score[l] = f;
        }
    }
    if ((v = json_object_get(s, "last_attn")) != NULL) {
        in->last_attn = arena_alloc(a, L * sizeof *in->last_attn);
        if (in->last_attn == NULL)
            return fail(r, "out of memory");
        if (per_qhead(r, a, v, in->last_attn, "last_attn") != 0)
            return -1;
    }
    if ((v = json_object_get(s, "window_attn")) != NULL) {
        in->window_attn = arena_alloc(a, L * sizeof *in->window_attn);
        if (in->window_attn == NULL)
            return fail(r, "out of memory");
        if (per_qhead(r, a, v, in->window_attn, "window_attn") != 0)
            return -1;
    }
    if ((v = json_object_get(s, "vnorm")) != NULL) {
        in->vnorm = arena_alloc(a, L * sizeof *in->vnorm);
        if (in->vnorm == NULL || sized(r, v, L, "step: vnorm", "layer lists") != 0)
            return in->vnorm == NULL ? fail(r, "out of memory") : -1;
        for (uint32_t l = 0; l < L; l++) {
            json_t *ly = json_array_get(v, l);
            snprintf(what, sizeof what, "step: vnorm[%" PRIu32 "]", l);
            if (sized(r, ly, r->g.kv_heads, what, "KV-head lists") != 0)
                return -1;
            float **heads = arena_alloc(a, r->g.kv_heads * sizeof *heads);
            if (heads == NULL)
                return fail(r, "out of memory");
            const policy_layer_view *view = policy_host_view(r->h, l);
            for (uint32_t k = 0; k < r->g.kv_heads; k++) {
                snprintf(what, sizeof what, "step: vnorm[%" PRIu32 "][%" PRIu32 "]", l, k);
                if (float_list(r, a, json_array_get(ly, k), view->tokens[r->heads == 1 ? 0 : k],
                               &heads[k], what) != 0)
                    return -1;
            }
            in->vnorm[l] = (const float *const *)heads;
        }
    }
    return 0;
}

static int parse_step(replay *r, arena *a, json_t *s, step_in *in)
{
    static const char *const keys[] = {
        "new_tokens",  "prefill",        "score", "score_queries", "last_attn",
        "window_attn", "window_queries", "vnorm", "confidence",    NULL};
    memset(in, 0, sizeof *in);
    in->base.score_queries = 1;
    in->base.confidence = -1.0;
    if (!json_is_object(s))
        return fail(r, "step: the value must be an object");
    if (only_keys(r, s, keys, "step") != 0)
        return -1;
    uint64_t n = 0;
    json_t *v;
    if ((v = json_object_get(s, "new_tokens")) != NULL &&
        get_uint(r, v, UINT32_MAX, &n, "step: new_tokens") != 0)
        return -1;
    in->base.new_tokens = (uint32_t)n;
    if ((v = json_object_get(s, "prefill")) != NULL) {
        if (!json_is_boolean(v))
            return fail(r, "step: prefill must be true or false");
        in->base.prefill = json_is_true(v);
    }
    if ((v = json_object_get(s, "score_queries")) != NULL) {
        if (get_uint(r, v, UINT32_MAX, &n, "step: score_queries") != 0)
            return -1;
        in->base.score_queries = (uint32_t)n;
    }
    if ((v = json_object_get(s, "window_queries")) != NULL) {
        if (get_uint(r, v, UINT32_MAX, &n, "step: window_queries") != 0)
            return -1;
        in->base.window_queries = (uint32_t)n;
    }
    if ((v = json_object_get(s, "confidence")) != NULL) {
        if (!json_is_number(v))
            return fail(r, "step: confidence must be a number");
        in->base.confidence = json_number_value(v);
    }
    /* The arrays are sized by the lists after this step's tokens arrived. */
    if (policy_host_append(r->h, in->base.new_tokens) != 0)
        return fail(r, "step: cannot append %" PRIu32 " tokens (position range or memory)",
                    in->base.new_tokens);
    return parse_step_arrays(r, a, s, in);
}

/* Run the policy on every layer, write the answer, apply the decisions. */
static int op_step(replay *r, json_t *obj)
{
    static const char *const keys[] = {"step", NULL};
    if (only_keys(r, obj, keys, "step") != 0)
        return -1;
    arena a = {0};
    step_in in;
    text ev = {0}, tiers = {0}, merges = {0};
    int rc = -1, rerotate = 0;
    if (parse_step(r, &a, json_object_get(obj, "step"), &in) != 0)
        goto out;
    r->steps++;
    put(&ev, "[");
    put(&tiers, "[");
    put(&merges, "[");
    for (uint32_t l = 0; l < r->g.layers; l++) {
        policy_stats st = in.base;
        st.score = in.score ? in.score[l] : NULL;
        st.last_attn = in.last_attn ? in.last_attn[l] : NULL;
        st.window_attn = in.window_attn ? in.window_attn[l] : NULL;
        st.vnorm = in.vnorm ? in.vnorm[l] : NULL;
        const policy_decision *d = NULL;
        char err[POLICY_ERR_LEN] = "";
        if (policy_host_step(r->h, l, &st, &d, err, sizeof err) != 0) {
            fail(r, "step: layer %" PRIu32 ": %s", l, err);
            goto out;
        }
        const policy_layer_view *v = policy_host_view(r->h, l);
        put(&ev, "%s%s", l ? "," : "", r->heads > 1 ? "[" : "");
        for (uint32_t k = 0; k < r->heads; k++) {
            put(&ev, "%s[", k ? "," : "");
            int first = 1;
            for (uint32_t i = 0; i < v->tokens[k]; i++) {
                uint8_t t = d->tier[k][i];
                if (t == POLICY_EVICT) {
                    put(&ev, "%s%" PRIu32, first ? "" : ",", v->positions[k][i]);
                    first = 0;
                } else if (t != v->tier[k][i]) {
                    put(&tiers,
                        "%s{\"layer\":%" PRIu32 ",\"head\":%" PRIu32 ",\"position\":%" PRIu32
                        ",\"tier\":\"%s\"}",
                        tiers.len > 1 ? "," : "", l, k, v->positions[k][i], policy_tier_name(t));
                }
            }
            put(&ev, "]");
        }
        if (r->heads > 1)
            put(&ev, "]");
        for (size_t m = 0; m < d->nmerges; m++) {
            const policy_merge *mg = &d->merges[m];
            if (mg->head >= r->heads || mg->from >= v->tokens[mg->head] ||
                mg->into >= v->tokens[mg->head]) {
                fail(r, "step: layer %" PRIu32 ": policy %s returned a merge outside the list", l,
                     r->ops->name);
                goto out;
            }
            put(&merges,
                "%s{\"layer\":%" PRIu32 ",\"head\":%" PRIu32 ",\"from\":%" PRIu32
                ",\"into\":%" PRIu32 ",\"w_from\":",
                merges.len > 1 ? "," : "", l, mg->head, v->positions[mg->head][mg->from],
                v->positions[mg->head][mg->into]);
            put_double(&merges, mg->w_from);
            put(&merges, ",\"w_into\":");
            put_double(&merges, mg->w_into);
            put(&merges, "}");
        }
        rerotate |= d->rerotate_keys;
        policy_host_commit(r->h, l);
    }
    put(&ev, "]");
    put(&tiers, "]");
    put(&merges, "]");
    if (ev.failed || tiers.failed || merges.failed) {
        fail(r, "out of memory");
        goto out;
    }
    put(&r->t, "{\"step\":%" PRIu64 ",\"evicted\":%s,\"tiers\":%s,\"merges\":%s%s}", r->steps,
        ev.buf, tiers.buf, merges.buf, rerotate ? ",\"rerotate_keys\":true" : "");
    rc = emit(r);
out:
    free(ev.buf);
    free(tiers.buf);
    free(merges.buf);
    arena_free(&a);
    return rc;
}

static int op_held(replay *r, json_t *obj)
{
    static const char *const keys[] = {"held", NULL};
    if (only_keys(r, obj, keys, "held") != 0 || get_true(r, json_object_get(obj, "held"), "held"))
        return -1;
    put(&r->t, "{\"held\":[");
    for (uint32_t l = 0; l < r->g.layers; l++) {
        const policy_layer_view *v = policy_host_view(r->h, l);
        put(&r->t, "%s%s", l ? "," : "", r->heads > 1 ? "[" : "");
        for (uint32_t k = 0; k < r->heads; k++) {
            put(&r->t, "%s[", k ? "," : "");
            for (uint32_t i = 0; i < v->tokens[k]; i++)
                put(&r->t, "%s%" PRIu32, i ? "," : "", v->positions[k][i]);
            put(&r->t, "]");
        }
        if (r->heads > 1)
            put(&r->t, "]");
    }
    put(&r->t, "]}");
    return emit(r);
}

/* Generic state: one describe() object per layer (null without describe). */
static int op_state_generic(replay *r)
{
    put(&r->t, "{\"state\":[");
    for (uint32_t l = 0; l < r->g.layers; l++) {
        char *s = r->ops->describe ? r->ops->describe(policy_host_state(r->h), l) : NULL;
        json_error_t je;
        json_t *j = s ? json_loads(s, 0, &je) : NULL;
        if (s != NULL && !json_is_object(j)) {
            json_decref(j);
            free(s);
            return fail(r, "state: policy %s described layer %" PRIu32 " with invalid JSON",
                        r->ops->name, l);
        }
        if (l)
            put(&r->t, ",");
        if (s == NULL) {
            put(&r->t, "null");
        } else if (strpbrk(s, "\r\n") == NULL) {
            put(&r->t, "%s", s); /* as the policy wrote it */
        } else {
            char *c = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(17));
            put(&r->t, "%s", c ? c : "null");
            free(c);
        }
        json_decref(j);
        free(s);
    }
    put(&r->t, "]}");
    return emit(r);
}

/* ---- a policy's own operations (policies/policy_replay.h) --------------------- */

/* The replay's side of policy_replay: jansson values and the replay's own
 * checks and output, behind the interface a policy sees. */
static const policy_replay_value *pr_field(void *ctx, const policy_replay_value *obj,
                                           const char *key)
{
    (void)ctx;
    return (const policy_replay_value *)json_object_get((const json_t *)obj, key);
}

static int pr_is_object(void *ctx, const policy_replay_value *v)
{
    (void)ctx;
    return json_is_object((const json_t *)v);
}

static size_t pr_array_size(void *ctx, const policy_replay_value *v)
{
    (void)ctx;
    return json_is_array((const json_t *)v) ? json_array_size((const json_t *)v) : SIZE_MAX;
}

static const policy_replay_value *pr_item(void *ctx, const policy_replay_value *arr, size_t i)
{
    (void)ctx;
    return (const policy_replay_value *)json_array_get((const json_t *)arr, i);
}

static int pr_number(void *ctx, const policy_replay_value *v, double *out)
{
    (void)ctx;
    if (!json_is_number((const json_t *)v))
        return -1;
    *out = json_number_value((const json_t *)v);
    return 0;
}

static int pr_only_keys(void *ctx, const policy_replay_value *obj, const char *const *keys,
                        const char *what)
{
    return only_keys(ctx, (json_t *)obj, keys, what);
}

static int pr_get_uint(void *ctx, const policy_replay_value *v, uint64_t max, uint64_t *out,
                       const char *what)
{
    return get_uint(ctx, (json_t *)v, max, out, what);
}

static int pr_get_true(void *ctx, const policy_replay_value *v, const char *op)
{
    return get_true(ctx, (json_t *)v, op);
}

static int pr_fail(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int pr_fail(void *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(ctx, "", fmt, ap);
    va_end(ap);
    return -1;
}

static void pr_note(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void pr_note(void *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(ctx, "note: ", fmt, ap);
    va_end(ap);
}

static void pr_put(void *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void pr_put(void *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    policy_text_vadd(&((replay *)ctx)->t, fmt, ap);
    va_end(ap);
}

static void pr_put_double(void *ctx, double v)
{
    put_double(&((replay *)ctx)->t, v);
}

static int pr_emit(void *ctx)
{
    return emit(ctx);
}

/* The policy's operation that `obj` names, or NULL. */
static const char *policy_op(const policy_ops *ops, json_t *obj)
{
    for (size_t i = 0; ops->replay_ops != NULL && ops->replay_ops[i] != NULL; i++)
        if (json_object_get(obj, ops->replay_ops[i]) != NULL)
            return ops->replay_ops[i];
    return NULL;
}

static int op_policy(replay *r, json_t *obj, const char *op)
{
    policy_replay pr = {
        .host = r->h,
        .layers = r->g.layers,
        .line = (const policy_replay_value *)obj,
        .ctx = r,
        .field = pr_field,
        .is_object = pr_is_object,
        .array_size = pr_array_size,
        .item = pr_item,
        .number = pr_number,
        .only_keys = pr_only_keys,
        .get_uint = pr_get_uint,
        .get_true = pr_get_true,
        .fail = pr_fail,
        .note = pr_note,
        .put = pr_put,
        .put_double = pr_put_double,
        .emit = pr_emit,
    };
    return r->ops->replay(&pr, op);
}

/* The policy that has operation k, when it is not the replayed one. */
static const policy_ops *owner_of(const replay *r, const char *k)
{
    size_t n;
    const policy_ops *const *all = policy_list(&n);
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0;
             all[i] != r->ops && all[i]->replay_ops != NULL && all[i]->replay_ops[j] != NULL; j++)
            if (strcmp(all[i]->replay_ops[j], k) == 0)
                return all[i];
    return NULL;
}

/* ---- dispatch -------------------------------------------------------------------- */

static int run_line(replay *r, const char *text)
{
    json_error_t je;
    json_t *obj = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (obj == NULL)
        return fail(r, "invalid JSON: %s (column %d)", je.text, je.column);
    int rc;
    const char *own = json_is_object(obj) ? policy_op(r->ops, obj) : NULL;
    if (!json_is_object(obj)) {
        rc = fail(r, "expected a JSON object with one operation");
    } else if (json_object_get(obj, "append") != NULL) {
        rc = op_append(r, obj);
    } else if (json_object_get(obj, "step") != NULL) {
        rc = op_step(r, obj);
    } else if (json_object_get(obj, "held") != NULL) {
        rc = op_held(r, obj);
    } else if (own != NULL) {
        rc = op_policy(r, obj, own);
    } else if (json_object_get(obj, "state") != NULL) {
        static const char *const keys[] = {"state", NULL};
        rc = only_keys(r, obj, keys, "state");
        if (rc == 0)
            rc = get_true(r, json_object_get(obj, "state"), "state");
        if (rc == 0)
            rc = op_state_generic(r);
    } else {
        const char *k = json_object_iter_key(json_object_iter(obj));
        const policy_ops *owner = k != NULL ? owner_of(r, k) : NULL;
        if (k == NULL)
            rc = fail(r, "empty object: expected an operation");
        else if (owner != NULL)
            rc = fail(r, "operation '%s' is only for policy %s", k, owner->name);
        else
            rc = fail(r, "unknown operation '%s'", k);
    }
    json_decref(obj);
    return rc;
}

/* ---- command line ------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f, "usage: kvstash replay --policy NAME [--set key=value ...] [--layers N]\n"
               "                      [--block-tokens B] [--q-heads Q] [--kv-heads H]\n"
               "                      [--head-dim D] < trace.jsonl\n"
               "Runs one policy over a JSON Lines trace (docs/replay.md) and writes one JSON line\n"
               "per answer. Defaults: --layers 1 --block-tokens 16 --q-heads 1 --kv-heads 1\n"
               "--head-dim 64.\n");
}

typedef struct options {
    const char *policy;
    const char *keys[POLICY_MAX_PARAMS], *values[POLICY_MAX_PARAMS];
    char *pairs[POLICY_MAX_PARAMS];
    size_t nset;
    uint32_t layers, block_tokens, q_heads, kv_heads, head_dim;
    int help;
} options;

static int usage_error(FILE *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int usage_error(FILE *err, const char *fmt, ...)
{
    va_list ap;
    fprintf(err, "kvstash replay: ");
    va_start(ap, fmt);
    vfprintf(err, fmt, ap);
    va_end(ap);
    fputc('\n', err);
    usage(err);
    return -1;
}

static int parse_u32(const char *s, uint32_t *out)
{
    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0' || errno != 0 || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static void options_free(options *o)
{
    for (size_t i = 0; i < o->nset; i++)
        free(o->pairs[i]);
}

static int parse_options(int argc, char **argv, options *o, FILE *err)
{
    memset(o, 0, sizeof *o);
    o->layers = 1;
    o->block_tokens = 16;
    o->q_heads = 1;
    o->kv_heads = 1;
    o->head_dim = 64;
    static const char *const nums[] = {"--layers", "--block-tokens", "--q-heads", "--kv-heads",
                                       "--head-dim"};
    uint32_t *dst[] = {&o->layers, &o->block_tokens, &o->q_heads, &o->kv_heads, &o->head_dim};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = NULL;
        char name[32];
        const char *eq = strchr(a, '=');
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            o->help = 1;
            return 0;
        }
        if (strncmp(a, "--", 2) != 0)
            return usage_error(err, "unexpected argument '%s'", a);
        if (eq != NULL && (size_t)(eq - a) < sizeof name) {
            memcpy(name, a, (size_t)(eq - a));
            name[eq - a] = '\0';
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a);
            if (i + 1 >= argc)
                return usage_error(err, "option %s needs a value", name);
            val = argv[++i];
        }
        if (strcmp(name, "--policy") == 0) {
            o->policy = val;
        } else if (strcmp(name, "--set") == 0) {
            const char *e = strchr(val, '=');
            if (e == NULL || e == val)
                return usage_error(err, "--set wants key=value, got '%s'", val);
            if (o->nset == POLICY_MAX_PARAMS)
                return usage_error(err, "at most %d --set options", POLICY_MAX_PARAMS);
            char *p = strdup(val);
            if (p == NULL)
                return usage_error(err, "out of memory");
            p[e - val] = '\0';
            o->pairs[o->nset] = p;
            o->keys[o->nset] = p;
            o->values[o->nset] = p + (e - val) + 1;
            o->nset++;
        } else {
            size_t k = 0;
            while (k < 5 && strcmp(name, nums[k]) != 0)
                k++;
            if (k == 5)
                return usage_error(err, "unknown option '%s'", name);
            if (parse_u32(val, dst[k]) != 0)
                return usage_error(err, "%s wants a non-negative integer, got '%s'", name, val);
        }
    }
    if (o->policy == NULL)
        return usage_error(err, "--policy is required");
    return 0;
}

/* Geometry checks and the policy's own validation; 0 or -1 (message printed). */
static int setup(replay *r, const options *o, FILE *err)
{
    if (o->layers == 0) {
        fprintf(err, "kvstash replay: invalid configuration: --layers must be at least 1 (zero "
                     "layers)\n");
        return -1;
    }
    if (o->block_tokens == 0 || o->kv_heads == 0 || o->q_heads == 0 ||
        o->q_heads % o->kv_heads != 0) {
        fprintf(err, "kvstash replay: invalid configuration: --block-tokens, --q-heads and "
                     "--kv-heads must be at least 1, and --q-heads a multiple of --kv-heads\n");
        return -1;
    }
    r->ops = policy_find(o->policy);
    if (r->ops == NULL) {
        size_t n;
        const policy_ops *const *all = policy_list(&n);
        fprintf(err,
                "kvstash replay: invalid configuration: unknown policy '%s' (known:", o->policy);
        for (size_t i = 0; i < n; i++)
            fprintf(err, " %s", all[i]->name);
        fprintf(err, ")\n");
        return -1;
    }
    r->g = (policy_geometry){.layers = o->layers,
                             .q_heads = o->q_heads,
                             .kv_heads = o->kv_heads,
                             .head_dim = o->head_dim,
                             .block_tokens = o->block_tokens,
                             .rope_theta = 10000.0f};
    policy_params p;
    char msg[POLICY_ERR_LEN] = "";
    if (policy_params_resolve(r->ops, o->keys, o->values, o->nset, &p, msg, sizeof msg) != 0) {
        fprintf(err, "kvstash replay: invalid configuration: %s\n", msg);
        return -1;
    }
    if (policy_host_create(r->ops, &p, &r->g, &r->h, msg, sizeof msg) != 0) {
        fprintf(err, "kvstash replay: invalid configuration: %s\n", msg);
        return -1;
    }
    r->heads = policy_host_heads(r->h);
    return 0;
}

static int blank(const char *s)
{
    for (; *s; s++)
        if (*s != ' ' && *s != '\t' && *s != '\r' && *s != '\n')
            return 0;
    return 1;
}

int replay_run(int argc, char **argv, FILE *in, FILE *out, FILE *err)
{
    options o;
    if (parse_options(argc, argv, &o, err) != 0) {
        options_free(&o);
        return EXIT_USAGE;
    }
    if (o.help) {
        usage(out);
        options_free(&o);
        return 0;
    }
    replay r = {.out = out, .err = err};
    int status = EXIT_BAD;
    char *line = NULL;
    size_t cap = 0;
    if (setup(&r, &o, err) != 0)
        goto done;
    for (;;) {
        errno = 0;
        ssize_t len = getline(&line, &cap, in);
        if (len < 0) {
            if (errno != 0 && !feof(in)) {
                fprintf(err, "kvstash replay: reading the trace: %s\n", strerror(errno));
                goto done;
            }
            break;
        }
        r.line++;
        if ((size_t)len != strlen(line)) {
            fail(&r, "the line holds a NUL byte");
            goto done;
        }
        if (blank(line))
            continue;
        if (run_line(&r, line) != 0)
            goto done;
    }
    status = 0;
done:
    fflush(out);
    free(line);
    free(r.t.buf);
    policy_host_destroy(r.h);
    options_free(&o);
    return status;
}

int replay_main(int argc, char **argv)
{
    return replay_run(argc, argv, stdin, stdout, stderr);
}
