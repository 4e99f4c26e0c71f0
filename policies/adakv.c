/*
 * adakv.c - policy "adakv": AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache
 * Eviction by Adaptive Budget Allocation", 2024) on SnapKV scores, as
 * kvpress's AdaKVPress (POLICIES.md §1.9, §1.5 without the two stages).
 *
 * At the end of the prompt each layer keeps n_keep·kv_heads tokens in all:
 * every head first keeps its int(n_keep·alpha_safeguard) best (safeguard),
 * then the lowest SnapKV scores over all heads together are evicted. Heads
 * keep different token counts (per_head = 1). The algorithm lives in
 * snapkv_family.c. Parameter `budget` is a decode-time extension
 * (snapkv_family.h): budget·kv_heads tokens in all.
 */
#include "builtin.h"
#include "snapkv_family.h"

static const policy_param_spec adakv_params[] = {
    SNAPKV_PARAM_COMPRESSION_RATIO, SNAPKV_PARAM_WINDOW,     SNAPKV_PARAM_KERNEL,
    SNAPKV_PARAM_POOLING,           SNAPKV_PARAM_WINDOW_PAD, SNAPKV_PARAM_ALPHA_SAFEGUARD,
    SNAPKV_PARAM_PROTECT_WINDOW,    SNAPKV_PARAM_BUDGET,
};

static int adakv_create(const policy_params *p, const policy_geometry *g, void **state, char *err,
                        size_t errlen)
{
    return snapkv_family_create(p, g, SNAPKV_ADA, &policy_adakv, state, err, errlen);
}

const policy_ops policy_adakv = {
    .name = "adakv",
    .summary = "AdaKV on SnapKV scores (kvpress): at the end of the prompt one budget for all KV "
               "heads, per-head safeguard, heads keep different counts",
    .params = adakv_params,
    .nparams = sizeof(adakv_params) / sizeof(adakv_params[0]),
    .needs = POLICY_NEEDS_WINDOW_ATTN,
    .per_head = 1,
    .layers_concurrent = 1,
    .create = adakv_create,
    .step = snapkv_family_step,
    .describe = snapkv_family_describe,
    .destroy = snapkv_family_destroy,
    .save = snapkv_family_save,
    .restore = snapkv_family_restore,
    .discard = snapkv_family_discard,
    .export_layer = snapkv_family_export_layer,
    .import_layer = snapkv_family_import_layer,
};
