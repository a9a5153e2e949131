/* Optimizer updates, in place, one work-item per parameter element (n elements), and the
 * gradient norm of clip_grad_norm_ (partials per work-group, added in a fixed order).
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

/* AdamW first scales p by decay = 1 - lr weight_decay (use_decay); Adam adds L2 decay (use_wd).
 * d = g + weight_decay * p; m = beta1 m + (1 - beta1) d; v = beta2 v + (1 - beta2) d^2;
 * p -= step_size * m / (sqrt(v) / sqrt_bc2 + eps), step_size = lr / (1 - beta1^step),
 * sqrt_bc2 = sqrt(1 - beta2^step). */
__kernel void adam_update(__global float* restrict p,         /* IN/OUT (n,) */
                          __global const float* restrict g,   /* IN     (n,) */
                          __global float* restrict m,         /* IN/OUT (n,) */
                          __global float* restrict v,         /* IN/OUT (n,) */
                          const int n, const float beta1, const float one_minus_beta1,
                          const float beta2, const float one_minus_beta2,
                          const float step_size, const float sqrt_bc2, const float eps,
                          const float weight_decay, const int use_wd, const float decay, const int use_decay)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float pi = use_decay ? p[i] * decay : p[i];
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

/* RMSprop, centered=False: d = g + weight_decay * p; sq = alpha sq + (1 - alpha) d^2;
 * a = sqrt(sq) + eps; with momentum (use_buf) buf = momentum buf + d / a, p -= lr buf;
 * else p -= lr (d / a). */
__kernel void rmsprop_update(__global float* restrict p,         /* IN/OUT (n,) */
                             __global const float* restrict g,   /* IN     (n,) */
                             __global float* restrict sq,        /* IN/OUT (n,) */
                             __global float* restrict buf,       /* IN/OUT (n,), used when use_buf */
                             const int n, const float lr, const float alpha, const float one_minus_alpha,
                             const float eps, const float weight_decay, const int use_wd,
                             const float momentum, const int use_buf)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float pi = p[i];
    float d = g[i];
    if (use_wd) d = d + weight_decay * pi;
    float si = alpha * sq[i];
    si = si + (one_minus_alpha * d) * d;
    sq[i] = si;
    const float a = sqrt(si) + eps;
    if (use_buf) {
        float bi = momentum * buf[i];
        bi = bi + d / a;
        buf[i] = bi;
        p[i] = pi - lr * bi;
    } else {
        p[i] = pi - lr * (d / a);
    }
}

/* x *= factor */
__kernel void scale_inplace(__global float* restrict x,  /* IN/OUT (n,) */
                            const int n, const float factor)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    x[i] = x[i] * factor;
}

/* NaN-propagating max (as torch.max): once a NaN is seen it stays. */
inline float nan_max(float a, float b)
{
    return (a != a) ? a : ((b != b || b > a) ? b : a);
}

inline float wg_max_float(__local float* scratch, float v)
{
    const int lid = get_local_id(0);
    scratch[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = RED_WG / 2; span > 0; span >>= 1) {
        if (lid < span) scratch[lid] = nan_max(scratch[lid], scratch[lid + span]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

/* One group's partial of a norm of x into partial[offset + group]: mode 0 the sum of x^2,
 * mode 1 the sum of |x|^ord, mode 2 the largest |x|. The host launches this once per array
 * of a clip_grad_norm_ with consecutive offsets, then reduces all the partials at once. */
__kernel void norm_partial(__global const float* restrict x,    /* IN  (n,) */
                           __global float* restrict partial,    /* OUT (offset + groups,) */
                           const int n, const int offset, const int mode, const float ord)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    if (mode == 0) {
        RED_FOR(i, get_global_id(0), get_global_size(0), n) s += x[i] * x[i];
        s = wg_sum_float(scratch, s);
    } else if (mode == 1) {
        RED_FOR(i, get_global_id(0), get_global_size(0), n) s += pow(fabs(x[i]), ord);
        s = wg_sum_float(scratch, s);
    } else {
        RED_FOR(i, get_global_id(0), get_global_size(0), n) s = nan_max(s, fabs(x[i]));
        s = wg_max_float(scratch, s);
    }
    if (get_local_id(0) == 0) partial[offset + get_group_id(0)] = s;
}

/* out[0] = the largest of the partials (NaN if any is). One work-group of RED_WG. */
__kernel void reduce_max_final(__global const float* restrict partial,  /* IN  (groups,) */
                               __global float* restrict out,            /* OUT (1,) */
                               const int groups)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    for (int i = get_local_id(0); i < groups; i += RED_WG) s = nan_max(s, partial[i]);
    s = wg_max_float(scratch, s);
    if (get_local_id(0) == 0) out[0] = s;
}
