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

/* ---------------------------------------- general max, average and adaptive pooling
 * KH x KW windows, strides SH, SW, padding PH, PW on each side (at most half the window, so
 * every window holds an input). x and dx (N, C, H, W), y and dy (N, C, P, Q), NC = N * C.
 * One work-item per output element (forward) or input element (backward: it gathers from the
 * windows that hold it, so no atomics and a fixed order). */

/* Max pooling with padding: padded positions are never selected; argmax as maxpool2d_forward
 * (maxpool2d_backward takes it). Launch: global (NC * P * Q,) rounded up. */
__kernel void maxpool2d_general_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                        __global float* restrict y,         /* OUT (N, C, P, Q) */
                                        __global int* restrict argmax,      /* OUT (N, C, P, Q) */
                                        const int NC, const int H, const int W, const int P, const int Q,
                                        const int KH, const int KW, const int SH, const int SW,
                                        const int PH, const int PW)
{
    const int i = get_global_id(0);
    if (i >= NC * P * Q) return;
    const int q = i % Q, p = (i / Q) % P, plane = i / (P * Q);
    __global const float* xp = x + (size_t)plane * H * W;
    const int h0 = IMAX(p * SH - PH, 0), h1 = IMIN(p * SH - PH + KH, H);
    const int w0 = IMAX(q * SW - PW, 0), w1 = IMIN(q * SW - PW + KW, W);
    float best = xp[h0 * W + w0];
    int bi = h0 * W + w0;
    for (int h = h0; h < h1; ++h)
        for (int ww = w0; ww < w1; ++ww) ARGMAX_STEP(xp[h * W + ww], h * W + ww, best, bi);
    y[i] = best;
    argmax[i] = bi;
}

/* Average pooling, zero padding counted (every window divided by KH * KW).
 * Launch: global (NC * P * Q,) rounded up. */
__kernel void avgpool2d_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                __global float* restrict y,         /* OUT (N, C, P, Q) */
                                const int NC, const int H, const int W, const int P, const int Q,
                                const int KH, const int KW, const int SH, const int SW,
                                const int PH, const int PW)
{
    const int i = get_global_id(0);
    if (i >= NC * P * Q) return;
    const int q = i % Q, p = (i / Q) % P, plane = i / (P * Q);
    __global const float* xp = x + (size_t)plane * H * W;
    const int h0 = IMAX(p * SH - PH, 0), h1 = IMIN(p * SH - PH + KH, H);
    const int w0 = IMAX(q * SW - PW, 0), w1 = IMIN(q * SW - PW + KW, W);
    float s = 0.0f;
    for (int h = h0; h < h1; ++h)
        for (int ww = w0; ww < w1; ++ww) s += xp[h * W + ww];
    y[i] = s * (1.0f / (float)(KH * KW));
}

/* Gradient of avgpool2d_forward. Launch: global (NC * H * W,) rounded up. */
__kernel void avgpool2d_backward(__global const float* restrict dy,  /* IN  (N, C, P, Q) */
                                 __global float* restrict dx,        /* OUT (N, C, H, W) */
                                 const int NC, const int H, const int W, const int P, const int Q,
                                 const int KH, const int KW, const int SH, const int SW,
                                 const int PH, const int PW)
{
    const int i = get_global_id(0);
    if (i >= NC * H * W) return;
    const int ww = i % W, h = (i / W) % H, plane = i / (H * W);
    __global const float* g = dy + (size_t)plane * P * Q;
    /* windows p with p SH - PH <= h < p SH - PH + KH */
    const int p_lo = IMAX(0, (h + PH - KH + SH) / SH), p_hi = IMIN(P - 1, (h + PH) / SH);
    const int q_lo = IMAX(0, (ww + PW - KW + SW) / SW), q_hi = IMIN(Q - 1, (ww + PW) / SW);
    float s = 0.0f;
    for (int p = p_lo; p <= p_hi; ++p)
        for (int q = q_lo; q <= q_hi; ++q) s += g[p * Q + q] * (1.0f / (float)(KH * KW));
    dx[i] = s;
}

/* PyTorch's adaptive window of output o: [floor(o n / out), ceil((o + 1) n / out)). */
inline int adaptive_lo(const int o, const int n, const int out) { return (int)(((long)o * n) / out); }
inline int adaptive_hi(const int o, const int n, const int out) { return (int)(((long)(o + 1) * n + out - 1) / out); }

/* Adaptive average pooling. Launch: global (NC * P * Q,) rounded up. */
__kernel void adaptive_avgpool2d_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                         __global float* restrict y,         /* OUT (N, C, P, Q) */
                                         const int NC, const int H, const int W, const int P, const int Q)
{
    const int i = get_global_id(0);
    if (i >= NC * P * Q) return;
    const int q = i % Q, p = (i / Q) % P, plane = i / (P * Q);
    __global const float* xp = x + (size_t)plane * H * W;
    const int h0 = adaptive_lo(p, H, P), h1 = adaptive_hi(p, H, P);
    const int w0 = adaptive_lo(q, W, Q), w1 = adaptive_hi(q, W, Q);
    float s = 0.0f;
    for (int h = h0; h < h1; ++h)
        for (int ww = w0; ww < w1; ++ww) s += xp[h * W + ww];
    y[i] = s / (float)((h1 - h0) * (w1 - w0));
}

/* Gradient of adaptive_avgpool2d_forward: each input adds dy / area of the windows holding it.
 * Launch: global (NC * H * W,) rounded up. */
__kernel void adaptive_avgpool2d_backward(__global const float* restrict dy,  /* IN  (N, C, P, Q) */
                                          __global float* restrict dx,        /* OUT (N, C, H, W) */
                                          const int NC, const int H, const int W, const int P, const int Q)
{
    const int i = get_global_id(0);
    if (i >= NC * H * W) return;
    const int ww = i % W, h = (i / W) % H, plane = i / (H * W);
    __global const float* g = dy + (size_t)plane * P * Q;
    float s = 0.0f;
    for (int p = 0; p < P; ++p) {
        const int h0 = adaptive_lo(p, H, P), h1 = adaptive_hi(p, H, P);
        if (h < h0 || h >= h1) continue;
        for (int q = 0; q < Q; ++q) {
            const int w0 = adaptive_lo(q, W, Q), w1 = adaptive_hi(q, W, Q);
            if (ww >= w0 && ww < w1) s += g[p * Q + q] / (float)((h1 - h0) * (w1 - w0));
        }
    }
    dx[i] = s;
}

/* Global average pooling (adaptive to 1 x 1): one work-group of RED_WG per plane, each
 * work-item summing its share of the plane, then a fixed-order tree.
 * Launch: local (RED_WG,), global (NC * RED_WG,). */
__kernel void global_avgpool2d_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                       __global float* restrict y,         /* OUT (N, C, 1, 1) */
                                       const int HW)
{
    __local float scratch[RED_WG];
    const int plane = get_group_id(0), lid = get_local_id(0);
    __global const float* xp = x + (size_t)plane * HW;
    float s = 0.0f;
    RED_FOR(i, lid, RED_WG, HW) s += xp[i];
    s = wg_sum_float(scratch, s);
    if (lid == 0) y[plane] = s / (float)HW;
}
