/* Pooling kernels of one (H, W) plane: max pooling with padding and rectangular windows, average
 * pooling and adaptive average pooling, forward and backward.
 *
 * Shape legend: H, W input plane, P, Q output plane, KH x KW window, SH, SW strides, PH, PW
 * padding on each side (at most half the window, so every window holds an input). Floor mode:
 * P = (H + 2 PH - KH) / SH + 1, Q likewise. Planes never share inputs, so the callers run one
 * plane per chunk and every backward here overwrites its own plane without races.
 */
#ifndef PARCONV_PC_POOL_H
#define PARCONV_PC_POOL_H

#include "pc_common.h"

/* First and one-past-last index of the window [o*S - pad, o*S - pad + K) inside [0, n). */
static inline void pc_pool_window(int o, int S, int pad, int K, int n, int *lo, int *hi)
{
    int a = o * S - pad, b = a + K;
    *lo = a < 0 ? 0 : a;
    *hi = b > n ? n : b;
}

/* Max pooling with padding: padded positions never win (they are -inf, and every window holds an
 * input). am gets the flat index h*W + w of the first maximum, the first NaN if any (np.argmax). */
static inline void pc_maxpool_general_plane(const float *restrict x, int H, int W, int KH, int KW, int SH,
                                            int SW, int PH, int PW, int P, int Q, float *restrict y,
                                            int *restrict am)
{
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            float best = x[(pc_idx)h0 * W + w0];
            int bi = h0 * W + w0;
            for (int h = h0; h < h1; h++) {
                for (int w = (h == h0 ? w0 + 1 : w0); w < w1; w++) {
                    int idx = h * W + w;
                    float v = x[idx];
                    PC_POOL_SELECT(v, idx, best, bi);
                }
            }
            y[(pc_idx)p * Q + q] = best;
            am[(pc_idx)p * Q + q] = bi;
        }
    }
}

/* Average pooling, zero padding counted: each window's sum of inputs times 1 / (KH KW).
 * Rows of the window are summed in order, so the result does not depend on the thread count. */
static inline void pc_avgpool_plane(const float *restrict x, int H, int W, int KH, int KW, int SH, int SW,
                                    int PH, int PW, int P, int Q, float *restrict y)
{
    const float scale = 1.0f / (float)(KH * KW);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            float s = 0.0f;
            for (int h = h0; h < h1; h++) {
                const float *xr = x + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) s += xr[w];
            }
            y[(pc_idx)p * Q + q] = s * scale;
        }
    }
}

/* Gradient of pc_avgpool_plane: dx = 0, then every window adds dy / (KH KW) to its inputs. */
static inline void pc_avgpool_backward_plane(const float *restrict dy, int H, int W, int KH, int KW, int SH,
                                             int SW, int PH, int PW, int P, int Q, float *restrict dx)
{
    const float scale = 1.0f / (float)(KH * KW);
    memset(dx, 0, sizeof(float) * (size_t)H * (size_t)W);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            const float g = dy[(pc_idx)p * Q + q] * scale;
            for (int h = h0; h < h1; h++) {
                float *dr = dx + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) dr[w] += g;
            }
        }
    }
}

/* PyTorch's adaptive window of output i: [floor(i n / out), ceil((i + 1) n / out)). */
static inline void pc_adaptive_window(int i, int n, int out, int *lo, int *hi)
{
    *lo = (int)(((long long)i * n) / out);
    *hi = (int)(((long long)(i + 1) * n + out - 1) / out);
}

/* Adaptive average pooling of one plane to P x Q (each window summed in double, then divided). */
static inline void pc_adaptive_avgpool_plane(const float *restrict x, int H, int W, int P, int Q,
                                             float *restrict y)
{
    if (P == 1 && Q == 1) {  /* global average pooling: one streaming sum */
        y[0] = (float)(pc_sum_f32(x, (pc_idx)H * W) / ((double)H * W));
        return;
    }
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_adaptive_window(p, H, P, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_adaptive_window(q, W, Q, &w0, &w1);
            double s = 0.0;
            for (int h = h0; h < h1; h++) {
                const float *xr = x + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) s += xr[w];
            }
            y[(pc_idx)p * Q + q] = (float)(s / ((double)(h1 - h0) * (w1 - w0)));
        }
    }
}

/* Gradient of pc_adaptive_avgpool_plane: dx = 0, then each window adds dy / area to its inputs. */
static inline void pc_adaptive_avgpool_backward_plane(const float *restrict dy, int H, int W, int P, int Q,
                                                      float *restrict dx)
{
    if (P == 1 && Q == 1) {
        const float g = (float)((double)dy[0] / ((double)H * W));
        pc_idx n = (pc_idx)H * W;
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) dx[i] = g;
        return;
    }
    memset(dx, 0, sizeof(float) * (size_t)H * (size_t)W);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_adaptive_window(p, H, P, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_adaptive_window(q, W, Q, &w0, &w1);
            const float g = (float)((double)dy[(pc_idx)p * Q + q] / ((double)(h1 - h0) * (w1 - w0)));
            for (int h = h0; h < h1; h++) {
                float *dr = dx + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) dr[w] += g;
            }
        }
    }
}

#endif /* PARCONV_PC_POOL_H */
