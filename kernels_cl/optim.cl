/* Optimizer updates, in place, one work-item per parameter element (n elements).
 * Exactly the formulation of parconv.backends.numpy_ref (PyTorch's); the host folds
 * the scalar hyper-parameters (bias corrections, 1 - beta) in double precision and
 * passes them as float32, as NumPy does with Python floats.
 */
#include "common.h"
/* one rounding per NumPy operation, no fused multiply-adds */
#pragma OPENCL FP_CONTRACT OFF

/* d = g + weight_decay * p; v = momentum * v + d (when use_v);
 * direction = d + momentum * v (nesterov) or v; p -= lr * direction. */
__kernel void sgd_update(__global float* restrict p,         /* IN/OUT (n,) */
                         __global const float* restrict g,   /* IN     (n,) */
                         __global float* restrict v,         /* IN/OUT (n,), used when use_v */
                         const int n, const float lr, const float momentum, const float weight_decay,
                         const int use_wd, const int use_v, const int nesterov)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float pi = p[i];
    float d = g[i];
    if (use_wd) d = d + weight_decay * pi;
    if (use_v) {
        float vi = momentum * v[i];
        vi = vi + d;
        v[i] = vi;
        d = nesterov ? d + momentum * vi : vi;
    }
    p[i] = pi - lr * d;
}

/* d = g + weight_decay * p; m = beta1 m + (1 - beta1) d; v = beta2 v + (1 - beta2) d^2;
 * p -= step_size * m / (sqrt(v) / sqrt_bc2 + eps), step_size = lr / (1 - beta1^step),
 * sqrt_bc2 = sqrt(1 - beta2^step). */
__kernel void adam_update(__global float* restrict p,         /* IN/OUT (n,) */
                          __global const float* restrict g,   /* IN     (n,) */
                          __global float* restrict m,         /* IN/OUT (n,) */
                          __global float* restrict v,         /* IN/OUT (n,) */
                          const int n, const float beta1, const float one_minus_beta1,
                          const float beta2, const float one_minus_beta2,
                          const float step_size, const float sqrt_bc2, const float eps,
                          const float weight_decay, const int use_wd)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float pi = p[i];
    float d = g[i];
    if (use_wd) d = d + weight_decay * pi;
    float mi = beta1 * m[i];
    mi = mi + one_minus_beta1 * d;
    float vi = beta2 * v[i];
    vi = vi + (one_minus_beta2 * d) * d;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - (step_size * mi) / (sqrt(vi) / sqrt_bc2 + eps);
}
