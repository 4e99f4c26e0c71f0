#include "kernels.h"
size_t kv_block_bytes(const kv_layout *l) { return 2u * l->kv_heads * l->block_tokens * l->head_dim * l->elt_size; }
