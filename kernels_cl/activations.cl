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

/* ---- leaky_relu, tanh, add (flat, n elements) and softmax: x viewed as (O, D, I), the
 * softmax running along D for each of the O * I lines (elements I apart). ---- */

/* y = x if x > 0 else negative_slope * x (NaN propagates). */
__kernel void leaky_relu_forward(__global const float* restrict x,   /* IN  (n,) */
                                 __global float* restrict y,         /* OUT (n,) */
                                 const int n, const float negative_slope)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    y[i] = v > 0.0f ? v : v * negative_slope;
}

/* dx = dy if x > 0 else negative_slope * dy, from the forward *input* x. */
__kernel void leaky_relu_backward(__global const float* restrict x,    /* IN  (n,) forward input */
                                  __global const float* restrict dy,   /* IN  (n,) */
                                  __global float* restrict dx,         /* OUT (n,) */
                                  const int n, const float negative_slope)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    dx[i] = x[i] > 0.0f ? dy[i] : dy[i] * negative_slope;
}

/* tanh as the openmp kernel computes it: Cephes' odd polynomial below |x| = 0.625,
 * (1 - e) / (1 + e) with e = exp(-2|x|) above (some runtimes' tanh misses +-1 at +-inf). */
__kernel void tanh_forward(__global const float* restrict x,   /* IN  (n,) */
                           __global float* restrict y,         /* OUT (n,) */
                           const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i], a = fabs(v), z = a * a;
    const float p = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z
                      + 1.33314422036e-1f) * z - 3.33332819422e-1f) * z * a + a;
    const float e = exp(-2.0f * a);
    const float r = (1.0f - e) / (1.0f + e);
    y[i] = copysign(a < 0.625f ? p : r, v);
}

/* dx = dy * (1 - y * y) */
__kernel void tanh_backward(__global const float* restrict y,    /* IN  (n,) forward output */
                            __global const float* restrict dy,   /* IN  (n,) */
                            __global float* restrict dx,         /* OUT (n,) */
                            const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float t = y[i];
    dx[i] = dy[i] * (1.0f - t * t);
}

/* y = x where x > 0, else alpha * (exp(x) - 1) */
__kernel void elu_forward(__global const float* restrict x,   /* IN  (n,) */
                          __global float* restrict y,         /* OUT (n,) */
                          const int n,
                          const float alpha)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float v = x[i];
    y[i] = v > 0.0f ? v : alpha * expm1(v);
}

/* dx = dy where y > 0, else dy * (y + alpha): the derivative from the forward output */
__kernel void elu_backward(__global const float* restrict y,    /* IN  (n,) forward output */
                           __global const float* restrict dy,   /* IN  (n,) */
                           __global float* restrict dx,         /* OUT (n,) */
                           const int n,
                           const float alpha)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    dx[i] = y[i] > 0.0f ? dy[i] : dy[i] * (y[i] + alpha);
}

__kernel void add_forward(__global const float* restrict a,   /* IN  (n,) */
                          __global const float* restrict b,   /* IN  (n,) */
                          __global float* restrict out,       /* OUT (n,) */
                          const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    out[i] = a[i] + b[i];
}

/* Stable softmax of one line per work-item: max, exp(x - max), divide by the sum. */
__kernel void softmax_forward(__global const float* restrict x,   /* IN  (O, D, I) */
                              __global float* restrict y,         /* OUT (O, D, I) */
                              const int lines, const int D, const int I)
{
    const int l = get_global_id(0);
    if (l >= lines) return;
    const size_t base = (size_t)(l / I) * D * I + l % I;
    float m = x[base];
    for (int d = 1; d < D; ++d) m = x[base + (size_t)d * I] > m ? x[base + (size_t)d * I] : m;
    float s = 0.0f;
    for (int d = 0; d < D; ++d) {
        const float e = exp(x[base + (size_t)d * I] - m);
        y[base + (size_t)d * I] = e;
        s += e;
    }
    for (int d = 0; d < D; ++d) y[base + (size_t)d * I] = y[base + (size_t)d * I] / s;
}

/* dx = y * (dy - sum(dy * y)) along one line per work-item. */
__kernel void softmax_backward(__global const float* restrict y,    /* IN  (O, D, I) forward output */
                               __global const float* restrict dy,   /* IN  (O, D, I) */
                               __global float* restrict dx,         /* OUT (O, D, I) */
                               const int lines, const int D, const int I)
{
    const int l = get_global_id(0);
    if (l >= lines) return;
    const size_t base = (size_t)(l / I) * D * I + l % I;
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot += dy[base + (size_t)d * I] * y[base + (size_t)d * I];
    for (int d = 0; d < D; ++d) dx[base + (size_t)d * I] = y[base + (size_t)d * I] * (dy[base + (size_t)d * I] - dot);
}
