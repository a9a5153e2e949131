/* maxpool2d: K x K windows, stride S, no padding, floor mode.
 *
 * Shapes: x (N, C, H, W), y, argmax and dy (N, C, P, Q), P = (H - K) / S + 1.
 * argmax is the flat index h * W + w of the window maximum inside its (H, W) plane
 * (the first one on ties, the first NaN if any), cached for the backward.
 * The backward scatters each plane's dy serially in output order, so overlapping
 * windows (S < K) are summed deterministically and without atomics.
 */
#include "common.h"

/* One work-item per output row (plane, p): the index arithmetic is done once per row
 * and the window scan uses selects rather than branches. */
__kernel void maxpool2d_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                __global float* restrict y,         /* OUT (N, C, P, Q) */
                                __global int* restrict argmax,      /* OUT (N, C, P, Q) */
                                const int NC, const int H, const int W, const int P, const int Q,
                                const int K, const int S)
{
    const int row = get_global_id(0);
    if (row >= NC * P) return;
    const int plane = row / P, p = row - plane * P;
    __global const float* xp = x + (size_t)plane * H * W;
    __global float* yr = y + (size_t)row * Q;
    __global int* ar = argmax + (size_t)row * Q;
    const int h0 = p * S;
    if (K == 2) {
        /* the common 2 x 2 window, unrolled */
        for (int q = 0; q < Q; ++q) {
            const int i0 = h0 * W + q * S;
            float best = xp[i0];
            int bi = i0, nan = 0;
            ARGMAX_STEP_FAST(xp[i0 + 1], i0 + 1, best, bi, nan);
            ARGMAX_STEP_FAST(xp[i0 + W], i0 + W, best, bi, nan);
            ARGMAX_STEP_FAST(xp[i0 + W + 1], i0 + W + 1, best, bi, nan);
            if (nan) {
                best = xp[i0];
                bi = i0;
                ARGMAX_STEP(xp[i0 + 1], i0 + 1, best, bi);
                ARGMAX_STEP(xp[i0 + W], i0 + W, best, bi);
                ARGMAX_STEP(xp[i0 + W + 1], i0 + W + 1, best, bi);
            }
            yr[q] = best;
            ar[q] = bi;
        }
        return;
    }
    for (int q = 0; q < Q; ++q) {
        const int i0 = h0 * W + q * S;
        float best = xp[i0];
        int bi = i0, nan = 0;
        for (int kh = 0; kh < K; ++kh)
            for (int kw = 0; kw < K; ++kw) ARGMAX_STEP_FAST(xp[i0 + kh * W + kw], i0 + kh * W + kw, best, bi, nan);
        if (nan) {
            best = xp[i0];
            bi = i0;
            for (int kh = 0; kh < K; ++kh)
                for (int kw = 0; kw < K; ++kw) ARGMAX_STEP(xp[i0 + kh * W + kw], i0 + kh * W + kw, best, bi);
        }
        yr[q] = best;
        ar[q] = bi;
    }
}

/* dx = zeros; dx[plane, argmax[j]] += dy[j] for the pooled outputs j of each plane in
 * order, each dy first multiplied by (y > 0) when use_relu (the fused ReLU + maxpool
 * backward, y being the pooled ReLU output). One work-item per (n, c) plane: the adds
 * happen in NumPy's np.add.at order, overlapping windows need no atomics, and the op
 * needs no kernel size or stride. An index outside [0, HW) is skipped. Overwrites dx. */
__kernel void maxpool2d_backward(__global const float* restrict dy,     /* IN  (N, C, P, Q) */
                                 __global const int* restrict argmax,   /* IN  (N, C, P, Q) */
                                 __global const float* restrict relu_y, /* IN  (N, C, P, Q), read when use_relu */
                                 __global float* restrict dx,           /* OUT (N, C, H, W) */
                                 const int NC, const int HW, const int PQ, const int use_relu)
{
    const int plane = get_global_id(0);
    if (plane >= NC) return;
    __global float* d = dx + (size_t)plane * HW;
    const size_t base = (size_t)plane * PQ;
    for (int i = 0; i < HW; ++i) d[i] = 0.0f;
    for (int j = 0; j < PQ; ++j) {
        const float g = dy[base + j];
        if (use_relu && !(relu_y[base + j] > 0.0f)) continue;
        /* argmax is not validated on the host (that would copy it back): skip what lies outside */
        const int a = argmax[base + j];
        if ((uint)a < (uint)HW) d[a] += g;
    }
}
