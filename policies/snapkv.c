/*
 * snapkv.c - policy "snapkv": SnapKV (Li et al., "SnapKV: LLM Knows What You
 * are Looking for Before Generation", 2024) as kvpress's SnapKVPress
 * (POLICIES.md §1.3; ScorerPress budget rule).
 *
 * At the end of the prompt (a prefill step carrying window_attn) each layer
 * keeps n_keep = int(L·(1 − compression_ratio)) tokens per KV head: the
 * observation-window tokens (scored max + 1) and the prefix tokens with the
 * highest pooled, group-averaged window attention. Every KV head keeps the
 * same count but its own token set, as kvpress's per-head topk does; so the
 * policy decides per KV head (per_head = 1) and the heads' lists diverge.
 * The algorithm lives in snapkv_family.c, shared with adakv, criticalkv and
 * criticalkv_ada. Parameter `budget` is a decode-time extension (see
 * snapkv_family.h).
 */
#include "builtin.h"
#include "snapkv_family.h"

static const policy_param_spec snapkv_params[] = {
    SNAPKV_PARAM_COMPRESSION_RATIO,
    SNAPKV_PARAM_WINDOW,
    SNAPKV_PARAM_KERNEL,
    SNAPKV_PARAM_POOLING,
    SNAPKV_PARAM_WINDOW_PAD,
    SNAPKV_PARAM_PROTECT_WINDOW,
    SNAPKV_PARAM_BUDGET,
};

static int snapkv_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                         size_t errlen)
{
    return snapkv_family_create(p, g, SNAPKV_PLAIN, &policy_snapkv, state, err, errlen);
}

const policy_ops policy_snapkv = {
    .name = "snapkv",
    .summary = "SnapKV (kvpress): at the end of the prompt keep, per KV head, the window and the "
               "tokens the observation window attends to most",
    .params = snapkv_params,
    .nparams = sizeof(snapkv_params) / sizeof(snapkv_params[0]),
    .needs = POLICY_NEEDS_WINDOW_ATTN,
    .per_head = 1,
    .layers_concurrent = 1,
    .create = snapkv_create,
    .step = snapkv_family_step,
    .describe = snapkv_family_describe,
    .destroy = snapkv_family_destroy,
    .save = snapkv_family_save,
    .restore = snapkv_family_restore,
    .discard = snapkv_family_discard,
    .export_layer = snapkv_family_export_layer,
    .import_layer = snapkv_family_import_layer,
};
