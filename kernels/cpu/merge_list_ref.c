/* merge_list_ref.c - reference batched value merges: kv_merge_value
 * (merge.c), the definition, once per merge in order. */
#include "kernels.h"

void kv_merge_values_ref(const kv_layout *l, kv_dtype t, uint8_t *pool, const kv_merge *m, size_t n)
{
    for (size_t i = 0; i < n; i++)
        kv_merge_value(l, t, pool, m[i].from_block, m[i].from_slot, m[i].into_block, m[i].into_slot,
                       m[i].w_from, m[i].w_into);
}
