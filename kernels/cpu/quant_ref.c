/* Symmetric INT8 quantisation of one group (POLICIES.md §5.4): the
 * reference the tiers' vectorised and CUDA kernels must equal. */
#include <math.h>

#include "kernels.h"

float kv_quantize_group_ref(const float *x, size_t n, int8_t *q)
{
    float amax = 0;
    for (size_t i = 0; i < n; i++)
        if (fabsf(x[i]) > amax)
            amax = fabsf(x[i]);
    /* §5.4 "if s == 0: s = 1": an all-zero group, or one whose max is so
     * small (fp32 or bf16 subnormals below 127 * 2^-149) that the scale
     * underflows, gets scale 1 and all-zero codes. */
    float s = amax / 127.0f;
    if (!(s > 0))
        s = 1.0f;
    for (size_t i = 0; i < n; i++) {
        /* nearbyintf rounds half to even in the default rounding mode, as
         * torch.round does. */
        float r = nearbyintf(x[i] / s);
        q[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
    }
    return s;
}

void kv_dequantize_group_ref(const int8_t *q, size_t n, float s, float *x)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)q[i] * s;
}
