/* Optimizer updates, in place, one work-item per parameter element, and the gradient
 * norm of clip_grad_norm_ (partials per work-group, added in a fixed order).
 * Exactly the formulation of parconv.backends.numpy_ref (PyTorch's); the host folds
 * the scalar hyper-parameters (bias corrections, 1 - beta) in double precision and
 * passes them as float32, as NumPy does with Python floats.
 *
 * Shapes: p (parameter), g (gradient), m / v / sq / buf (state), (n,) float32 each.
 * Every update has a one-tensor kernel and a *_multi kernel that takes up to MULTI
 * tensors in one launch (their elements end to end; ends e0 <= ... <= e7 are the
 * cumulative sizes, unused slots repeat the last end and a dummy buffer), so a step of a
 * many-parameter network is a few launches instead of one per parameter.
 */
#include "common.h"
/* one rounding per NumPy operation, no fused multiply-adds */
#pragma OPENCL FP_CONTRACT OFF

#define MULTI 8
#define ARGS8(T, n) T n##0, T n##1, T n##2, T n##3, T n##4, T n##5, T n##6, T n##7
#define SEL8(n, j)                                                            \
    ((j) < 4 ? ((j) < 2 ? ((j) == 0 ? n##0 : n##1) : ((j) == 2 ? n##2 : n##3)) \
             : ((j) < 6 ? ((j) == 4 ? n##4 : n##5) : ((j) == 6 ? n##6 : n##7)))
#define ENDS8 const int e0, const int e1, const int e2, const int e3, const int e4, const int e5, \
              const int e6, const int e7
/* tensor j of element i of the concatenation, and k its index inside that tensor */
#define LOCATE8(i, j, k)                                                                         \
    const int j = ((i) >= e0) + ((i) >= e1) + ((i) >= e2) + ((i) >= e3) + ((i) >= e4) + ((i) >= e5) \
                  + ((i) >= e6);                                                                 \
    const int k = (i) - ((j) == 0 ? 0 : SEL8(e, (j) - 1))

/* d = g + weight_decay * p; v = momentum * v + d (when use_v);
 * direction = d + momentum * v (nesterov) or v; p -= lr * direction. */
inline void sgd_elem(__global float* p, __global const float* g, __global float* v, const int i,
                     const float lr, const float momentum, const float weight_decay, const int use_wd,
                     const int use_v, const int nesterov)
{
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

__kernel void sgd_update(__global float* restrict p,         /* IN/OUT (n,) */
                         __global const float* restrict g,   /* IN     (n,) */
                         __global float* restrict v,         /* IN/OUT (n,), used when use_v */
                         const int n, const float lr, const float momentum, const float weight_decay,
                         const int use_wd, const int use_v, const int nesterov)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    sgd_elem(p, g, v, i, lr, momentum, weight_decay, use_wd, use_v, nesterov);
}

__kernel void sgd_update_multi(ARGS8(__global float*, p),        /* IN/OUT */
                               ARGS8(__global const float*, g),  /* IN     */
                               ARGS8(__global float*, v),        /* IN/OUT, used when use_v */
                               ENDS8, const float lr, const float momentum, const float weight_decay,
                               const int use_wd, const int use_v, const int nesterov)
{
    const int i = get_global_id(0);
    if (i >= e7) return;
    LOCATE8(i, j, k);
    sgd_elem(SEL8(p, j), SEL8(g, j), SEL8(v, j), k, lr, momentum, weight_decay, use_wd, use_v, nesterov);
}

/* AdamW first scales p by decay = 1 - lr weight_decay (use_decay); Adam adds L2 decay (use_wd).
 * d = g + weight_decay * p; m = beta1 m + (1 - beta1) d; v = beta2 v + (1 - beta2) d^2;
 * p -= step_size * m / (sqrt(v) / sqrt_bc2 + eps), step_size = lr / (1 - beta1^step),
 * sqrt_bc2 = sqrt(1 - beta2^step). */
inline void adam_elem(__global float* p, __global const float* g, __global float* m, __global float* v,
                      const int i, const float beta1, const float one_minus_beta1, const float beta2,
                      const float one_minus_beta2, const float step_size, const float sqrt_bc2, const float eps,
                      const float weight_decay, const int use_wd, const float decay, const int use_decay)
{
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
    adam_elem(p, g, m, v, i, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, sqrt_bc2, eps,
              weight_decay, use_wd, decay, use_decay);
}

__kernel void adam_update_multi(ARGS8(__global float*, p),        /* IN/OUT */
                                ARGS8(__global const float*, g),  /* IN     */
                                ARGS8(__global float*, m),        /* IN/OUT */
                                ARGS8(__global float*, v),        /* IN/OUT */
                                ENDS8, const float beta1, const float one_minus_beta1,
                                const float beta2, const float one_minus_beta2,
                                const float step_size, const float sqrt_bc2, const float eps,
                                const float weight_decay, const int use_wd, const float decay,
                                const int use_decay)
{
    const int i = get_global_id(0);
    if (i >= e7) return;
    LOCATE8(i, j, k);
    adam_elem(SEL8(p, j), SEL8(g, j), SEL8(m, j), SEL8(v, j), k, beta1, one_minus_beta1, beta2,
              one_minus_beta2, step_size, sqrt_bc2, eps, weight_decay, use_wd, decay, use_decay);
}

/* RMSprop, centered=False: d = g + weight_decay * p; sq = alpha sq + (1 - alpha) d^2;
 * a = sqrt(sq) + eps; with momentum (use_buf) buf = momentum buf + d / a, p -= lr buf;
 * else p -= lr (d / a). */
inline void rmsprop_elem(__global float* p, __global const float* g, __global float* sq, __global float* buf,
                         const int i, const float lr, const float alpha, const float one_minus_alpha,
                         const float eps, const float weight_decay, const int use_wd, const float momentum,
                         const int use_buf)
{
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
    rmsprop_elem(p, g, sq, buf, i, lr, alpha, one_minus_alpha, eps, weight_decay, use_wd, momentum, use_buf);
}

__kernel void rmsprop_update_multi(ARGS8(__global float*, p),        /* IN/OUT */
                                   ARGS8(__global const float*, g),  /* IN     */
                                   ARGS8(__global float*, sq),       /* IN/OUT */
                                   ARGS8(__global float*, buf),      /* IN/OUT, used when use_buf */
                                   ENDS8, const float lr, const float alpha, const float one_minus_alpha,
                                   const float eps, const float weight_decay, const int use_wd,
                                   const float momentum, const int use_buf)
{
    const int i = get_global_id(0);
    if (i >= e7) return;
    LOCATE8(i, j, k);
    rmsprop_elem(SEL8(p, j), SEL8(g, j), SEL8(sq, j), SEL8(buf, j), k, lr, alpha, one_minus_alpha, eps,
                 weight_decay, use_wd, momentum, use_buf);
}

/* x *= factor */
__kernel void scale_multi(ARGS8(__global float*, x),  /* IN/OUT */
                          ENDS8, const float factor)
{
    const int i = get_global_id(0);
    if (i >= e7) return;
    LOCATE8(i, j, k);
    __global float* xj = SEL8(x, j);
    xj[k] = xj[k] * factor;
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

/* One group's partial of a norm of up to MULTI tensors taken end to end, into
 * partial[offset + group]: mode 0 the sum of x^2, mode 1 the sum of |x|^ord, mode 2 the
 * largest |x|. The host launches it once per MULTI tensors with consecutive offsets, then
 * reduces all the partials at once. */
__kernel void norm_partial_multi(ARGS8(__global const float*, x),  /* IN */
                                 ENDS8,
                                 __global float* restrict partial,  /* OUT (offset + groups,) */
                                 const int offset, const int mode, const float ord)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    RED_FOR(i, get_global_id(0), get_global_size(0), e7) {
        LOCATE8(i, j, k);
        const float a = fabs(SEL8(x, j)[k]);
        if (mode == 0) s += a * a;
        else if (mode == 1) s += pow(a, ord);
        else s = nan_max(s, a);
    }
    s = mode == 2 ? wg_max_float(scratch, s) : wg_sum_float(scratch, s);
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
