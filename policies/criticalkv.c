/*
 * criticalkv.c - policy "criticalkv": CriticalKV (Feng et al., "Identify
 * Critical KV Cache in LLM Inference from an Output Perturbation
 * Perspective", 2025) on SnapKV scores with a uniform per-head budget, as
 * kvpress's CriticalKVPress (POLICIES.md §1.4).
 *
 * At the end of the prompt each KV head keeps n_keep = int(L·(1 − cr))
 * tokens: stage 1 keeps the int((1 − cr)·L·first_stage_ratio) best SnapKV
 * scores a, stage 2 fills the rest by (a + epsilon)·n, n the projected value
 * L1 norm ‖V·W^O‖₁ (§1.2) that the worker reports as vnorm. Same count per
 * head, different tokens (per_head = 1). The algorithm lives in
 * snapkv_family.c. Parameter `budget` is a decode-time extension
 * (snapkv_family.h).
 */
#include "builtin.h"
#include "snapkv_family.h"

static const policy_param_spec criticalkv_params[] = {
    SNAPKV_PARAM_COMPRESSION_RATIO, SNAPKV_PARAM_WINDOW,         SNAPKV_PARAM_KERNEL,
    SNAPKV_PARAM_POOLING,           SNAPKV_PARAM_WINDOW_PAD,     SNAPKV_PARAM_FIRST_STAGE_RATIO,
    SNAPKV_PARAM_EPSILON,           SNAPKV_PARAM_PROTECT_WINDOW, SNAPKV_PARAM_BUDGET,
};

static int criticalkv_create(const policy_params *p, const policy_geometry *g, void **state,
                             char *err, size_t errlen)
{
    return snapkv_family_create(p, g, SNAPKV_CRITICAL, &policy_criticalkv, state, err, errlen);
}

const policy_ops policy_criticalkv = {
    .name = "criticalkv",
    .summary = "CriticalKV on SnapKV (kvpress): two-stage selection by attention, then by "
               "attention x projected value norm; same count per KV head",
    .params = criticalkv_params,
    .nparams = sizeof(criticalkv_params) / sizeof(criticalkv_params[0]),
    .needs = POLICY_NEEDS_WINDOW_ATTN | POLICY_NEEDS_VNORM,
    .per_head = 1,
    .layers_concurrent = 1,
    .create = criticalkv_create,
    .step = snapkv_family_step,
    .describe = snapkv_family_describe,
    .destroy = snapkv_family_destroy,
    .save = snapkv_family_save,
    .restore = snapkv_family_restore,
    .discard = snapkv_family_discard,
    .export_layer = snapkv_family_export_layer,
    .import_layer = snapkv_family_import_layer,
};
