/* Losses, metrics and the reductions that bring one scalar back to the host.
 *
 * Shapes: logits and probs (N, G), labels (N,) int32 in [0, G); BCE p and t any shape
 * with n elements. Every mean is reduced on the device in two fixed-order stages:
 * a *_partial kernel leaves one partial per work-group (RED_WG work-items each), then
 * reduce_*_final adds the partials in one work-group. Only that scalar is read back.
 * Launch the partial kernels with local (RED_WG,) and any number of groups; how the
 * elements are split (RED_FOR) depends only on that number, which the host fixes per
 * device (deterministic).
 */
#include "common.h"
/* one rounding per NumPy operation (the oracle) */
#pragma OPENCL FP_CONTRACT OFF

/* Row-wise stable softmax: m = max, z = x - m, lse = log(sum exp z), logp = z - lse;
 * probs = exp(logp), below FLT_MIN flushed to zero, and row_loss[i] = -logp[label].
 * One work-item per row. */
__kernel void softmax_xent_rows(__global const float* restrict logits,  /* IN  (N, G) */
                                __global const int* restrict labels,    /* IN  (N,) */
                                __global float* restrict probs,         /* OUT (N, G) */
                                __global float* restrict row_loss,      /* OUT (N,) */
                                const int N, const int G)
{
    const int i = get_global_id(0);
    if (i >= N) return;
    __global const float* x = logits + (size_t)i * G;
    __global float* pr = probs + (size_t)i * G;
    float m = x[0];
    for (int j = 1; j < G; ++j) m = x[j] > m ? x[j] : m;
    float s = 0.0f;
    for (int j = 0; j < G; ++j) s += exp(x[j] - m);
    const float lse = log(s);
    for (int j = 0; j < G; ++j) {
        const float p = exp((x[j] - m) - lse);
        pr[j] = p < FLT_MIN ? 0.0f : p;  /* no denormals (see _losses.pyx); NaN stays NaN */
    }
    row_loss[i] = -((x[labels[i]] - m) - lse);
}

/* dlogits = (probs - onehot(labels)) / N, overwritten, entries in [0, FLT_MIN) flushed to zero.
 * One work-item per element. */
__kernel void softmax_xent_backward(__global const float* restrict probs,   /* IN  (N, G) */
                                    __global const int* restrict labels,    /* IN  (N,) */
                                    __global float* restrict dlogits,       /* OUT (N, G) */
                                    const int N, const int G)
{
    const int e = get_global_id(0);
    if (e >= N * G) return;
    const int i = e / G, j = e - i * G;
    const float v = (probs[e] - (j == labels[i] ? 1.0f : 0.0f)) / (float)N;
    dlogits[e] = (v >= 0.0f && v < FLT_MIN) ? 0.0f : v;
}

/* Partial sums of the BCE terms -(t log pc + (1 - t) log(1 - pc)), pc = clip(p, lo, hi). */
__kernel void bce_partial(__global const float* restrict p,    /* IN  (n,) */
                          __global const float* restrict t,    /* IN  (n,) */
                          __global float* restrict partial,    /* OUT (groups,) */
                          const int n, const float lo, const float hi)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    RED_FOR(i, get_global_id(0), get_global_size(0), n) {
        const float pi = p[i], ti = t[i];
        const float pc = pi < lo ? lo : (pi > hi ? hi : pi);
        s += -(ti * log(pc) + (1.0f - ti) * log(1.0f - pc));
    }
    s = wg_sum_float(scratch, s);
    if (get_local_id(0) == 0) partial[get_group_id(0)] = s;
}

/* dp = (pc - t) / (pc (1 - pc)) / n, zero where p was clipped. */
__kernel void bce_backward(__global const float* restrict p,    /* IN  (n,) */
                           __global const float* restrict t,    /* IN  (n,) */
                           __global float* restrict dp,         /* OUT (n,) */
                           const int n, const float lo, const float hi)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float pi = p[i];
    const float pc = pi < lo ? lo : (pi > hi ? hi : pi);
    const float g = ((pc - t[i]) / (pc * (1.0f - pc))) / (float)n;
    dp[i] = (pi < lo || pi > hi) ? 0.0f : g;
}

/* First index of the row maximum (NumPy's argmax: first on ties, first NaN wins). */
inline int row_argmax(__global const float* restrict x, const int G)
{
    float best = x[0];
    int bi = 0, nan = 0;
    for (int j = 1; j < G; ++j) ARGMAX_STEP_FAST(x[j], j, best, bi, nan);
    if (nan) {
        best = x[0];
        bi = 0;
        for (int j = 1; j < G; ++j) ARGMAX_STEP(x[j], j, best, bi);
    }
    return bi;
}

__kernel void argmax_rows(__global const float* restrict logits,  /* IN  (N, G) */
                          __global int* restrict out,             /* OUT (N,) */
                          const int N, const int G)
{
    const int i = get_global_id(0);
    if (i >= N) return;
    out[i] = row_argmax(logits + (size_t)i * G, G);
}

/* Partial counts of rows whose argmax equals the label. */
__kernel void count_correct_partial(__global const float* restrict logits,  /* IN  (N, G) */
                                    __global const int* restrict labels,    /* IN  (N,) */
                                    __global int* restrict partial,         /* OUT (groups,) */
                                    const int N, const int G)
{
    __local int scratch[RED_WG];
    int s = 0;
    RED_FOR(i, get_global_id(0), get_global_size(0), N)
        s += row_argmax(logits + (size_t)i * G, G) == labels[i];
    s = wg_sum_int(scratch, s);
    if (get_local_id(0) == 0) partial[get_group_id(0)] = s;
}

/* Partial counts of NaN and infinite elements (all_finite). */
__kernel void count_nonfinite_partial(__global const float* restrict x,   /* IN  (n,) */
                                      __global int* restrict partial,     /* OUT (groups,) */
                                      const int n)
{
    __local int scratch[RED_WG];
    int s = 0;
    RED_FOR(i, get_global_id(0), get_global_size(0), n) s += !IS_FINITE(x[i]);
    s = wg_sum_int(scratch, s);
    if (get_local_id(0) == 0) partial[get_group_id(0)] = s;
}

/* Partial sums of x (the per-row losses of the softmax cross-entropy). */
__kernel void sum_partial(__global const float* restrict x,       /* IN  (n,) */
                          __global float* restrict partial,       /* OUT (groups,) */
                          const int n)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    RED_FOR(i, get_global_id(0), get_global_size(0), n) s += x[i];
    s = wg_sum_float(scratch, s);
    if (get_local_id(0) == 0) partial[get_group_id(0)] = s;
}

/* out[0] = (sum of the partials) / divisor. One work-group of RED_WG. */
__kernel void reduce_float_final(__global const float* restrict partial,  /* IN  (groups,) */
                                 __global float* restrict out,            /* OUT (1,) */
                                 const int groups, const float divisor)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    for (int i = get_local_id(0); i < groups; i += RED_WG) s += partial[i];
    s = wg_sum_float(scratch, s);
    if (get_local_id(0) == 0) out[0] = s / divisor;
}

/* out[0] = sum of the partials. One work-group of RED_WG. */
__kernel void reduce_int_final(__global const int* restrict partial,   /* IN  (groups,) */
                               __global int* restrict out,             /* OUT (1,) */
                               const int groups)
{
    __local int scratch[RED_WG];
    int s = 0;
    for (int i = get_local_id(0); i < groups; i += RED_WG) s += partial[i];
    s = wg_sum_int(scratch, s);
    if (get_local_id(0) == 0) out[0] = s;
}

/* ---- MSE (p, t flat, n elements) and softmax cross-entropy with label smoothing: the
 * target row is `off` everywhere and `on` at the label (on = 1 - s + s / G, off = s / G). ---- */

/* Partial sums of (p - t)^2. */
__kernel void mse_partial(__global const float* restrict p,    /* IN  (n,) */
                          __global const float* restrict t,    /* IN  (n,) */
                          __global float* restrict partial,    /* OUT (groups,) */
                          const int n)
{
    __local float scratch[RED_WG];
    float s = 0.0f;
    RED_FOR(i, get_global_id(0), get_global_size(0), n) {
        const float d = p[i] - t[i];
        s += d * d;
    }
    s = wg_sum_float(scratch, s);
    if (get_local_id(0) == 0) partial[get_group_id(0)] = s;
}

/* dp = (p - t) * k, k = 2 / n rounded to float on the host. */
__kernel void mse_backward(__global const float* restrict p,    /* IN  (n,) */
                           __global const float* restrict t,    /* IN  (n,) */
                           __global float* restrict dp,         /* OUT (n,) */
                           const int n, const float k)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    dp[i] = (p[i] - t[i]) * k;
}

/* softmax_xent_rows against the smoothed target: row_loss[i] =
 * -(on logp[label] + off sum_{j != label} logp[j]). One work-item per row. */
__kernel void softmax_xent_smooth_rows(__global const float* restrict logits,  /* IN  (N, G) */
                                       __global const int* restrict labels,    /* IN  (N,) */
                                       __global float* restrict probs,         /* OUT (N, G) */
                                       __global float* restrict row_loss,      /* OUT (N,) */
                                       const int N, const int G, const float on, const float off)
{
    const int i = get_global_id(0);
    if (i >= N) return;
    __global const float* x = logits + (size_t)i * G;
    __global float* pr = probs + (size_t)i * G;
    float m = x[0];
    for (int j = 1; j < G; ++j) m = x[j] > m ? x[j] : m;
    float s = 0.0f, zsum = 0.0f;
    for (int j = 0; j < G; ++j) {
        s += exp(x[j] - m);
        zsum += x[j] - m;
    }
    const float lse = log(s);
    for (int j = 0; j < G; ++j) {
        const float p = exp((x[j] - m) - lse);
        pr[j] = p < FLT_MIN ? 0.0f : p;
    }
    const float lp = (x[labels[i]] - m) - lse;
    row_loss[i] = -(on * lp + off * ((zsum - (float)G * lse) - lp));
}

/* dlogits = (probs - target) / N, entries of magnitude below FLT_MIN flushed to zero. */
__kernel void softmax_xent_smooth_backward(__global const float* restrict probs,   /* IN  (N, G) */
                                           __global const int* restrict labels,    /* IN  (N,) */
                                           __global float* restrict dlogits,       /* OUT (N, G) */
                                           const int N, const int G, const float on, const float off)
{
    const int e = get_global_id(0);
    if (e >= N * G) return;
    const int i = e / G, j = e - i * G;
    const float v = (probs[e] - (j == labels[i] ? on : off)) / (float)N;
    dlogits[e] = (v < FLT_MIN && v > -FLT_MIN) ? 0.0f : v;
}
