/* Elementwise activations, any shape (n elements), one work-item per element.
 * The backward takes the forward *output* y, as parconv.backends.base documents.
 */
#include "common.h"
/* NumPy evaluates a * b + c with two roundings; keep that so results match the oracle. */
#pragma OPENCL FP_CONTRACT OFF

/* y = max(x, 0); NaN propagates as in np.maximum. */
__kernel void relu_forward(__global const float* restrict x,   /* IN  (n,) */
                           __global float* restrict y,         /* OUT (n,) */
                           const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    y[i] = (v > 0.0f || IS_NAN(v)) ? v : 0.0f;
}

/* dx = dy * (y > 0) */
__kernel void relu_backward(__global const float* restrict y,    /* IN  (n,) forward output */
                            __global const float* restrict dy,   /* IN  (n,) */
                            __global float* restrict dx,         /* OUT (n,) */
                            const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* y = 1 / (1 + exp(-x)) through exp(-|x|), which never overflows. */
__kernel void sigmoid_forward(__global const float* restrict x,   /* IN  (n,) */
                              __global float* restrict y,         /* OUT (n,) */
                              const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    const float e = exp(v >= 0.0f ? -v : v);
    y[i] = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

/* dx = dy * y * (1 - y) */
__kernel void sigmoid_backward(__global const float* restrict y,    /* IN  (n,) forward output */
                               __global const float* restrict dy,   /* IN  (n,) */
                               __global float* restrict dx,         /* OUT (n,) */
                               const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float s = y[i];
    dx[i] = dy[i] * s * (1.0f - s);
}
