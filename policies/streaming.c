/*
 * streaming.c - policy "streaming": StreamingLLM (Xiao et al., "Efficient
 * Streaming Language Models with Attention Sinks", 2023), the sinks + window
 * baseline (DESIGN.md "Policies"; kvpress peer in POLICIES.md §1.9).
 *
 * Parameters: n_sink (default 4, 0..1048576) and window (default 1020,
 * 1..1048576). The cache holds the attention sinks, i.e. the tokens whose
 * original position is < n_sink, plus the `window` most recent tokens.
 *
 * select() runs before `incoming` tokens are appended. It keeps every held
 * token with position < n_sink, decided by position and not by index: after
 * earlier evictions index i need not be position i. Of the other held tokens
 * it keeps the last max(0, window - incoming). So after the append:
 *   - incoming <= window: exactly {p < n_sink} ∪ {p >= T - window} of all T
 *     positions so far are held;
 *   - incoming > window (a long prefill chunk): the sinks and all `incoming`
 *     new tokens are held; the next select() trims the overflow.
 * Positions are not re-rotated (as kvpress without KeyRerotationPress).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "builtin.h"

#define STREAMING_MAX 1048576u

typedef struct streaming_state {
    uint32_t n_sink;
    uint32_t window;
} streaming_state;

static const policy_param_spec streaming_params[] = {
    {"n_sink", "4",
     "tokens at the start of the sequence always kept (attention sinks), 0..1048576"},
    {"window", "1020", "most recent tokens kept after each append, 1..1048576"},
};

static int streaming_create(const policy_params *p, void **state, char *err, size_t errlen)
{
    streaming_state s;
    *state = NULL;
    if (policy_params_uint(p, "n_sink", 0, STREAMING_MAX, &s.n_sink, err, errlen) != 0)
        return -1;
    if (policy_params_uint(p, "window", 1, STREAMING_MAX, &s.window, err, errlen) != 0)
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

static size_t streaming_select(void *state, const policy_layer_view *view, uint32_t incoming,
                               uint8_t *keep)
{
    const streaming_state *st = state;
    uint32_t recent = incoming >= st->window ? 0 : st->window - incoming;

    /* Non-sinks are a suffix when positions ascend; counting them per token
     * keeps the answer correct even if they did not. */
    uint32_t others = 0;
    for (uint32_t i = 0; i < view->tokens; i++)
        others += view->positions[i] >= st->n_sink;

    uint32_t drop = others > recent ? others - recent : 0; /* oldest non-sinks to evict */
    size_t evicted = 0;
    for (uint32_t i = 0; i < view->tokens; i++) {
        int evict = view->positions[i] >= st->n_sink && evicted < drop;
        keep[i] = evict ? 0 : 1;
        evicted += (size_t)evict;
    }
    return evicted;
}

static void streaming_destroy(void *state)
{
    free(state);
}

const policy_ops policy_streaming = {
    .name = "streaming",
    .summary = "StreamingLLM: keep positions < n_sink (sinks) plus the most recent `window` "
               "tokens after each append",
    .params = streaming_params,
    .nparams = sizeof(streaming_params) / sizeof(streaming_params[0]),
    .create = streaming_create,
    .select = streaming_select,
    .destroy = streaming_destroy,
};
