/*
 * streaming.c - policy "streaming": StreamingLLM (Xiao et al., "Efficient
 * Streaming Language Models with Attention Sinks", 2023), the sinks + window
 * baseline (DESIGN.md "Policies"; kvpress peer in POLICIES.md §1.9).
 *
 * Parameters: n_sink (default 4, 0..1048576) and window (default 1020,
 * 1..1048576). The cache holds the attention sinks, i.e. the tokens whose
 * original position is < n_sink, plus the `window` most recent tokens.
 *
 * step() runs after each step's tokens were appended. It keeps every held
 * token with position < n_sink, decided by position and not by index: after
 * earlier evictions index i need not be position i. Of the other held tokens
 * it keeps the last `window`. So after every step exactly
 * {p < n_sink} ∪ {p >= T - window} of all T positions so far are held.
 * Positions are not re-rotated (as kvpress without KeyRerotationPress).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"
#include "util.h"

#define STREAMING_MAX 1048576u

typedef struct streaming_state {
    uint32_t n_sink;
    uint32_t window;
} streaming_state;

static const policy_param_spec streaming_params[] = {
    POLICY_PARAM_U32("n_sink", "4",
                     "tokens at the start of the sequence always kept (attention sinks), "
                     "0..1048576",
                     0, STREAMING_MAX, offsetof(streaming_state, n_sink)),
    POLICY_PARAM_U32("window", "1020", "most recent tokens kept after each step, 1..1048576", 1,
                     STREAMING_MAX, offsetof(streaming_state, window)),
};

static int streaming_create(const policy_params *p, const policy_geometry *g, void **state,
                            char *err, size_t errlen)
{
    (void)g;
    streaming_state s;
    *state = NULL;
    if (policy_params_parse(p, streaming_params,
                            sizeof(streaming_params) / sizeof(streaming_params[0]), &s, err,
                            errlen) != 0)
        return -1;
    streaming_state *st = malloc(sizeof(*st));
    if (st == NULL) {
        if (err != NULL && errlen > 0)
            snprintf(err, errlen, "out of memory creating policy 'streaming'");
        return -1;
    }
    *st = s;
    *state = st;
    return 0;
}

static int streaming_step(void *state, const policy_layer_view *view, const policy_stats *stats,
                          policy_decision *d, char *err, size_t errlen)
{
    (void)stats;
    (void)err;
    (void)errlen;
    const streaming_state *st = state;
    uint32_t n = view->tokens[0];
    const uint32_t *pos = view->positions[0];
    /* Positions ascend (policy.h): the sinks are a prefix, found by
     * bisection, and the oldest non-sinks follow it, so a decode step
     * costs nothing per held token. */
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (pos[mid] < st->n_sink)
            lo = mid + 1;
        else
            hi = mid;
    }
    uint32_t others = n - lo;
    uint32_t drop = others > st->window ? others - st->window : 0; /* oldest non-sinks */
    if (drop > 0) /* an empty list may have no decision array yet */
        memset(d->tier[0] + lo, POLICY_EVICT, drop);
    policy_decision_span(d, 0, lo, lo + drop);
    return 0;
}

static void streaming_destroy(void *state)
{
    free(state);
}

const policy_ops policy_streaming = {
    .name = "streaming",
    .summary = "StreamingLLM: keep positions < n_sink (sinks) plus the most recent `window` "
               "tokens after each step",
    .params = streaming_params,
    .nparams = sizeof(streaming_params) / sizeof(streaming_params[0]),
    .create = streaming_create,
    .step = streaming_step,
    .destroy = streaming_destroy,
};
