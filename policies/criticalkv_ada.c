/*
 * criticalkv_ada.c - policy "criticalkv_ada": CriticalKV with AdaKV budgets
 * on SnapKV scores, as kvpress's CriticalAdaKVPress (POLICIES.md §1.5).
 *
 * At the end of the prompt: every head forces its int(n_keep·
 * alpha_safeguard) best SnapKV scores (safeguard); the n_keep·kv_heads best
 * over all heads decide each head's budget B[g]; each head then runs the
 * two-stage selection with budget B[g] (stage 1: the
 * criticalkv_ada_stage1_size(B[g], first_stage_ratio) best by attention,
 * stage 2: (a + epsilon)·vnorm). Heads
 * keep different counts (per_head = 1). The algorithm lives in
 * snapkv_family.c. Parameter `budget` is a decode-time extension
 * (snapkv_family.h): budget·kv_heads tokens in all.
 */
#include "builtin.h"
#include "snapkv_family.h"

/*
 * kvpress computes stage 1 as (head_budgets * first_stage_ratio).to(int64)
 * (criticalkv_press.py:167): an int64 tensor times a Python float promotes
 * to torch's default dtype, float32, so both factors are rounded to float32,
 * multiplied in float32 and truncated. The product in double can land on the
 * other side of an integer: B = 50, α = 0.58 gives 29 in float32 but 28 in
 * double. The assignment to a float rounds even where the compiler keeps
 * wider intermediates (FLT_EVAL_METHOD != 0).
 */
size_t criticalkv_ada_stage1_size(size_t head_budget, double alpha)
{
    float product = (float)head_budget * (float)alpha;
    size_t b1 = (size_t)product;
    return b1 < head_budget ? b1 : head_budget;
}

static const policy_param_spec criticalkv_ada_params[] = {
    SNAPKV_PARAM_COMPRESSION_RATIO,
    SNAPKV_PARAM_WINDOW,
    SNAPKV_PARAM_KERNEL,
    SNAPKV_PARAM_POOLING,
    SNAPKV_PARAM_WINDOW_PAD,
    SNAPKV_PARAM_FIRST_STAGE_RATIO,
    SNAPKV_PARAM_EPSILON,
    SNAPKV_PARAM_ALPHA_SAFEGUARD,
    SNAPKV_PARAM_PROTECT_WINDOW,
    SNAPKV_PARAM_BUDGET,
};

static int criticalkv_ada_create(const policy_params *p, const policy_geometry *g, void **state,
                                 char *err, size_t errlen)
{
    return snapkv_family_create(p, g, SNAPKV_CRITICAL_ADA, &policy_criticalkv_ada, state, err,
                                errlen);
}

const policy_ops policy_criticalkv_ada = {
    .name = "criticalkv_ada",
    .summary = "CriticalKV on AdaKV budgets and SnapKV scores (kvpress CriticalAdaKVPress): "
               "per-head budgets, then two-stage selection with projected value norms",
    .params = criticalkv_ada_params,
    .nparams = sizeof(criticalkv_ada_params) / sizeof(criticalkv_ada_params[0]),
    .needs = POLICY_NEEDS_WINDOW_ATTN | POLICY_NEEDS_VNORM,
    .per_head = 1,
    .layers_concurrent = 1,
    .create = criticalkv_ada_create,
    .step = snapkv_family_step,
    .describe = snapkv_family_describe,
    .destroy = snapkv_family_destroy,
    .save = snapkv_family_save,
    .restore = snapkv_family_restore,
    .discard = snapkv_family_discard,
    .export_layer = snapkv_family_export_layer,
    .import_layer = snapkv_family_import_layer,
};
