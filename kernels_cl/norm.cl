/* Batch normalisation and dropout.
 *
 * Shapes: batch norm views x as (N, C, L), L the product of the trailing dims (H * W, L, or
 * 1 for (N, C) input); M = N * L values make one channel's statistics; weight, bias, mean,
 * invstd, running_mean, running_var are (C,). Dropout takes x flat (n elements).
 *
 * The per-channel reductions (bn_forward_stats, bn_backward_sums) run one work-group of
 * RED_WG work-items per channel: launch (C * RED_WG,) with local (RED_WG,). Each work-item
 * sums its share of the channel (RED_FOR: contiguous on CPUs, strided and coalesced on GPUs)
 * with Kahan compensation, so float32 keeps its accuracy over millions of values, and the
 * group adds the shares in a fixed tree order (deterministic). The rest is elementwise.
 */
#include "common.h"
/* one rounding per NumPy operation (the oracle) */
#pragma OPENCL FP_CONTRACT OFF

/* s += v with the compensation term c (Kahan); needs IEEE arithmetic, which the host keeps. */
#define KAHAN_ADD(s, c, v)                       \
    do {                                         \
        const float y_ = (v) - (c);              \
        const float t_ = (s) + y_;               \
        (c) = (t_ - (s)) - y_;                   \
        (s) = t_;                                \
    } while (0)

/* Element e of channel c in an (N, C, L) array. */
#define BN_AT(a, e, c, C, L) ((a)[((size_t)((e) / (L)) * (C) + (c)) * (L) + (e) % (L)])

/* Batch mean and 1 / sqrt(biased variance + eps) of every channel (two passes: the
 * variance sums (x - mean)^2, which does not cancel); the running statistics are updated
 * in place when has_running (the variance unbiased by M / (M - 1), as PyTorch). */
__kernel void bn_forward_stats(__global const float* restrict x,      /* IN  (N, C, L) */
                               __global float* restrict mean,         /* OUT (C,) */
                               __global float* restrict invstd,       /* OUT (C,) */
                               __global float* restrict running_mean, /* IN/OUT (C,) if has_running */
                               __global float* restrict running_var,  /* IN/OUT (C,) if has_running */
                               const int has_running, const float momentum, const float eps,
                               const int N, const int C, const int L)
{
    __local float scratch[RED_WG];
    const int c = get_group_id(0), lid = get_local_id(0), M = N * L;
    float s = 0.0f, comp = 0.0f;
    RED_FOR(e, lid, RED_WG, M) KAHAN_ADD(s, comp, BN_AT(x, e, c, C, L));
    const float m = wg_sum_float(scratch, s) / (float)M;
    s = 0.0f;
    comp = 0.0f;
    RED_FOR(e, lid, RED_WG, M) {
        const float d = BN_AT(x, e, c, C, L) - m;
        KAHAN_ADD(s, comp, d * d);
    }
    const float var = wg_sum_float(scratch, s) / (float)M;
    if (lid == 0) {
        mean[c] = m;
        invstd[c] = 1.0f / sqrt(var + eps);
        if (has_running) {
            running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * m;
            running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (var * ((float)M / (float)(M - 1)));
        }
    }
}

/* Eval mode: the running statistics as (mean, invstd). One work-item per channel. */
__kernel void bn_eval_stats(__global const float* restrict running_mean, /* IN  (C,) */
                            __global const float* restrict running_var,  /* IN  (C,) */
                            __global float* restrict mean,               /* OUT (C,) */
                            __global float* restrict invstd,             /* OUT (C,) */
                            const float eps, const int C)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    mean[c] = running_mean[c];
    invstd[c] = 1.0f / sqrt(running_var[c] + eps);
}

/* y = (x - mean) * (invstd * weight) + bias (+ res), then max(y, 0) when relu (NaN stays).
 * One work-item per element. */
__kernel void bn_apply(__global const float* restrict x,       /* IN  (N, C, L) */
                       __global const float* restrict weight,  /* IN  (C,) if has_weight */
                       __global const float* restrict bias,    /* IN  (C,) if has_bias */
                       __global const float* restrict mean,    /* IN  (C,) */
                       __global const float* restrict invstd,  /* IN  (C,) */
                       __global const float* restrict res,     /* IN  (N, C, L) if has_res: added before the ReLU */
                       __global float* restrict y,             /* OUT (N, C, L) */
                       const int has_weight, const int has_bias, const int has_res, const int relu,
                       const int n, const int C, const int L)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const int c = (i / L) % C;
    const float scale = has_weight ? invstd[c] * weight[c] : invstd[c];
    float v = (x[i] - mean[c]) * scale;
    if (has_bias) v = v + bias[c];
    if (has_res) v = v + res[i];
    y[i] = (relu && !(v > 0.0f || IS_NAN(v))) ? 0.0f : v;
}

/* Per channel: sums[c] = sum(g), sums[C + c] = sum(g * xhat), g = dy masked by y > 0 when
 * has_y (a fused ReLU), xhat = (x - mean) * invstd; also dweight = sum(g xhat) and
 * dbias = sum(g) when has_weight. */
__kernel void bn_backward_sums(__global const float* restrict x,       /* IN  (N, C, L) */
                               __global const float* restrict dy,      /* IN  (N, C, L) */
                               __global const float* restrict y,       /* IN  (N, C, L) if has_y */
                               __global const float* restrict mean,    /* IN  (C,) */
                               __global const float* restrict invstd,  /* IN  (C,) */
                               __global float* restrict sums,          /* OUT (2, C) */
                               __global float* restrict dweight,       /* OUT (C,) if has_weight */
                               __global float* restrict dbias,         /* OUT (C,) if has_weight */
                               const int has_y, const int has_weight, const int N, const int C, const int L)
{
    __local float scratch[RED_WG];
    const int c = get_group_id(0), lid = get_local_id(0), M = N * L;
    const float m = mean[c], istd = invstd[c];
    float sg = 0.0f, cg = 0.0f, sgx = 0.0f, cgx = 0.0f;
    RED_FOR(e, lid, RED_WG, M) {
        const size_t at = ((size_t)(e / L) * C + c) * L + e % L;
        const float g = (!has_y || y[at] > 0.0f) ? dy[at] : 0.0f;
        KAHAN_ADD(sg, cg, g);
        KAHAN_ADD(sgx, cgx, g * ((x[at] - m) * istd));
    }
    sg = wg_sum_float(scratch, sg);
    sgx = wg_sum_float(scratch, sgx);
    if (lid == 0) {
        sums[c] = sg;
        sums[C + c] = sgx;
        if (has_weight) {
            dweight[c] = sgx;
            dbias[c] = sg;
        }
    }
}

/* dx = ((g - sum(g) / M) - xhat * sum(g xhat) / M) * invstd * weight in training mode,
 * g * invstd * weight in eval mode (the statistics were constants). One work-item per element. */
__kernel void bn_backward_dx(__global const float* restrict x,       /* IN  (N, C, L) */
                             __global const float* restrict dy,      /* IN  (N, C, L) */
                             __global const float* restrict y,       /* IN  (N, C, L) if has_y */
                             __global const float* restrict weight,  /* IN  (C,) if has_weight */
                             __global const float* restrict mean,    /* IN  (C,) */
                             __global const float* restrict invstd,  /* IN  (C,) */
                             __global const float* restrict sums,    /* IN  (2, C) if training */
                             __global float* restrict dx,            /* OUT (N, C, L) */
                             const int has_y, const int has_weight, const int training,
                             const int n, const int M, const int C, const int L)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const int c = (i / L) % C;
    const float k = has_weight ? invstd[c] * weight[c] : invstd[c];
    const float g = (!has_y || y[i] > 0.0f) ? dy[i] : 0.0f;
    if (training) {
        const float a = sums[c] / (float)M, b = sums[C + c] / (float)M;
        dx[i] = ((g - a) - ((x[i] - mean[c]) * invstd[c]) * b) * k;
    } else {
        dx[i] = g * k;
    }
}

/* Inverted dropout, forward and backward alike: y = x * scale where element i is kept,
 * 0 elsewhere. Kept: the top 32 bits of splitmix64(seed + (i + 1) * golden) reach
 * threshold = floor(p * 2^32), as parconv.backends.numpy_ref.dropout_keep. */
__kernel void dropout_apply(__global const float* restrict x,  /* IN  (n,) */
                            __global float* restrict y,        /* OUT (n,) */
                            const int n, const ulong seed, const ulong threshold, const float scale)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    ulong z = seed + ((ulong)i + 1UL) * 0x9E3779B97F4A7C15UL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
    z ^= z >> 31;
    y[i] = (z >> 32) >= threshold ? x[i] * scale : 0.0f;
}
