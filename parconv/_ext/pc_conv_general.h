/* General convolution helpers: im2col / col2im with rectangular kernels, (h, w) strides, dilation
 * and asymmetric padding, and the direct depthwise kernels.
 *
 * Shape legend: N batch, C in-channels, O out-channels, G groups (Cg = C / G, Og = O / G),
 * H, W input, P, Q output, KH x KW kernel, SH, SW strides, DH, DW dilation, PT, PL the padding
 * above and to the left (the bottom/right padding only shows in P and Q):
 * P = (H + PT + PB - DH (KH - 1) - 1) / SH + 1, Q likewise.
 * Output (p, q) of tap (kh, kw) reads input (p SH + kh DH - PT, q SW + kw DW - PL).
 */
#ifndef PARCONV_PC_CONV_GENERAL_H
#define PARCONV_PC_CONV_GENERAL_H

#include "pc_common.h"

/* First and one-past-last output index o whose input o*S + off lies in [0, n). */
static inline void pcg_valid(int n, int out, int S, int off, int *lo, int *hi)
{
    int a = off >= 0 ? 0 : (-off + S - 1) / S;
    int b = (n - 1 - off) >= 0 ? (n - 1 - off) / S + 1 : 0;
    if (b > out) b = out;
    if (a > b) a = b;
    *lo = a;
    *hi = b;
}

/* cols (Cg*KH*KW, P*Q) = the taps of channels x[0..Cg) of one image group, zeros where padded. */
static inline void pcg_im2col(const float *restrict x, int Cg, int H, int W, int KH, int KW, int SH, int SW,
                              int DH, int DW, int PT, int PL, int P, int Q, float *restrict cols)
{
    const pc_idx PQ = (pc_idx)P * Q;
    float *row = cols;
    for (int c = 0; c < Cg; c++) {
        const float *xc = x + (pc_idx)c * H * W;
        for (int kh = 0; kh < KH; kh++) {
            int p_lo, p_hi;
            pcg_valid(H, P, SH, kh * DH - PT, &p_lo, &p_hi);
            for (int kw = 0; kw < KW; kw++, row += PQ) {
                int q_lo, q_hi;
                const int off = kw * DW - PL;
                pcg_valid(W, Q, SW, off, &q_lo, &q_hi);
                memset(row, 0, sizeof(float) * (size_t)p_lo * Q);
                for (int p = p_lo; p < p_hi; p++) {
                    float *dst = row + (pc_idx)p * Q;
                    const float *src = xc + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                    for (int q = 0; q < q_lo; q++) dst[q] = 0.0f;
                    if (SW == 1) {
                        memcpy(dst + q_lo, src + q_lo, sizeof(float) * (size_t)(q_hi - q_lo));
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[q] = src[(pc_idx)q * SW];
                    }
                    for (int q = q_hi; q < Q; q++) dst[q] = 0.0f;
                }
                memset(row + (pc_idx)p_hi * Q, 0, sizeof(float) * (size_t)(P - p_hi) * Q);
            }
        }
    }
}

/* dx[0..Cg) += col2im(dcols): the adjoint of pcg_im2col (taps added in row order). */
static inline void pcg_col2im(const float *restrict dcols, int Cg, int H, int W, int KH, int KW, int SH, int SW,
                              int DH, int DW, int PT, int PL, int P, int Q, float *restrict dx)
{
    const pc_idx PQ = (pc_idx)P * Q;
    const float *row = dcols;
    for (int c = 0; c < Cg; c++) {
        float *dxc = dx + (pc_idx)c * H * W;
        for (int kh = 0; kh < KH; kh++) {
            int p_lo, p_hi;
            pcg_valid(H, P, SH, kh * DH - PT, &p_lo, &p_hi);
            for (int kw = 0; kw < KW; kw++, row += PQ) {
                int q_lo, q_hi;
                const int off = kw * DW - PL;
                pcg_valid(W, Q, SW, off, &q_lo, &q_hi);
                for (int p = p_lo; p < p_hi; p++) {
                    const float *src = row + (pc_idx)p * Q;
                    float *dst = dxc + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                    if (SW == 1) {
                        PC_SIMD
                        for (int q = q_lo; q < q_hi; q++) dst[q] += src[q];
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[(pc_idx)q * SW] += src[q];
                    }
                }
            }
        }
    }
}

/* Depthwise forward of one output plane: y (P, Q) = bias + sum over taps of w[kh, kw] * x (H, W)
 * shifted; taps are added in row order, the whole row at a time (vectorises along q). */
static inline void pcg_dw_forward_plane(const float *restrict x, const float *restrict w, float bias, int H,
                                        int W, int KH, int KW, int SH, int SW, int DH, int DW, int PT, int PL,
                                        int P, int Q, float *restrict y)
{
    const pc_idx PQ = (pc_idx)P * Q;
    for (pc_idx i = 0; i < PQ; i++) y[i] = bias;
    for (int kh = 0; kh < KH; kh++) {
        int p_lo, p_hi;
        pcg_valid(H, P, SH, kh * DH - PT, &p_lo, &p_hi);
        for (int kw = 0; kw < KW; kw++) {
            int q_lo, q_hi;
            const int off = kw * DW - PL;
            const float wv = w[kh * KW + kw];
            pcg_valid(W, Q, SW, off, &q_lo, &q_hi);
            for (int p = p_lo; p < p_hi; p++) {
                float *yr = y + (pc_idx)p * Q;
                const float *xr = x + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                if (SW == 1) {
                    PC_SIMD
                    for (int q = q_lo; q < q_hi; q++) yr[q] = PC_FMAF(wv, xr[q], yr[q]);
                } else {
                    for (int q = q_lo; q < q_hi; q++) yr[q] = PC_FMAF(wv, xr[(pc_idx)q * SW], yr[q]);
                }
            }
        }
    }
}

/* Depthwise input gradient of one input plane: dx (H, W) += the M output planes dy (M, P, Q) of
 * this channel through their filters w (M, KH, KW). dx must be zeroed by the caller. */
static inline void pcg_dw_backward_input_plane(const float *restrict dy, const float *restrict w, int M, int H,
                                               int W, int KH, int KW, int SH, int SW, int DH, int DW, int PT,
                                               int PL, int P, int Q, float *restrict dx)
{
    for (int m = 0; m < M; m++) {
        const float *dym = dy + (pc_idx)m * P * Q;
        const float *wm = w + (pc_idx)m * KH * KW;
        for (int kh = 0; kh < KH; kh++) {
            int p_lo, p_hi;
            pcg_valid(H, P, SH, kh * DH - PT, &p_lo, &p_hi);
            for (int kw = 0; kw < KW; kw++) {
                int q_lo, q_hi;
                const int off = kw * DW - PL;
                const float wv = wm[kh * KW + kw];
                pcg_valid(W, Q, SW, off, &q_lo, &q_hi);
                for (int p = p_lo; p < p_hi; p++) {
                    const float *g = dym + (pc_idx)p * Q;
                    float *dr = dx + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                    if (SW == 1) {
                        PC_SIMD
                        for (int q = q_lo; q < q_hi; q++) dr[q] = PC_FMAF(wv, g[q], dr[q]);
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dr[(pc_idx)q * SW] = PC_FMAF(wv, g[q], dr[(pc_idx)q * SW]);
                    }
                }
            }
        }
    }
}

/* Depthwise weight gradient of one (image, output plane): dw (KH, KW) += the correlation of
 * dy (P, Q) with x (H, W). Each tap sums its rows in 8 independent lanes plus a tail (a vector's
 * work, not one long chain of dependent adds), kept in registers across the rows; the lanes are
 * added in a fixed order once per tap and plane, in double into dw. */
static inline void pcg_dw_backward_weight_plane(const float *restrict x, const float *restrict dy, int H, int W,
                                                int KH, int KW, int SH, int SW, int DH, int DW, int PT, int PL,
                                                int P, int Q, double *restrict dw)
{
    for (int kh = 0; kh < KH; kh++) {
        int p_lo, p_hi;
        pcg_valid(H, P, SH, kh * DH - PT, &p_lo, &p_hi);
        for (int kw = 0; kw < KW; kw++) {
            int q_lo, q_hi;
            const int off = kw * DW - PL;
            pcg_valid(W, Q, SW, off, &q_lo, &q_hi);
            float l0 = 0.0f, l1 = 0.0f, l2 = 0.0f, l3 = 0.0f, l4 = 0.0f, l5 = 0.0f, l6 = 0.0f, l7 = 0.0f;
            float tail = 0.0f;
            for (int p = p_lo; p < p_hi; p++) {
                const float *g = dy + (pc_idx)p * Q;
                const float *xr = x + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                int q = q_lo;
                if (SW == 1) {
                    for (; q + 8 <= q_hi; q += 8) {
                        l0 = PC_FMAF(g[q], xr[q], l0);
                        l1 = PC_FMAF(g[q + 1], xr[q + 1], l1);
                        l2 = PC_FMAF(g[q + 2], xr[q + 2], l2);
                        l3 = PC_FMAF(g[q + 3], xr[q + 3], l3);
                        l4 = PC_FMAF(g[q + 4], xr[q + 4], l4);
                        l5 = PC_FMAF(g[q + 5], xr[q + 5], l5);
                        l6 = PC_FMAF(g[q + 6], xr[q + 6], l6);
                        l7 = PC_FMAF(g[q + 7], xr[q + 7], l7);
                    }
                }
                for (; q < q_hi; q++) tail = PC_FMAF(g[q], xr[(pc_idx)q * SW], tail);
            }
            dw[kh * KW + kw] += (double)((((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))) + tail);
        }
    }
}

/* ---------------------------------------------------------------- stride-1 depthwise on flat planes
 * A stride-1 tap reads the zero-padded plane (Hp x Wp) at a fixed offset kh DH Wp + kw DW from
 * output position s = p Wp + q of a grid Wp wide, so each tap is one contiguous loop over
 * L = (P - 1) Wp + Q grid positions: long vector loops instead of P short rows per tap. The
 * Wp - Q columns past each row are computed and dropped. */

/* xp (Hp, Wp) = x (H, W) with PT, PB rows and PL, PR columns of zeros around it. */
static inline void pcg_pad_plane(const float *restrict x, int H, int W, int PT, int PB, int PL, int PR,
                                 float *restrict xp)
{
    const int Wp = W + PL + PR;
    memset(xp, 0, sizeof(float) * (size_t)PT * Wp);
    float *row = xp + (pc_idx)PT * Wp;
    for (int h = 0; h < H; h++, row += Wp) {
        for (int i = 0; i < PL; i++) row[i] = 0.0f;
        memcpy(row + PL, x + (pc_idx)h * W, sizeof(float) * (size_t)W);
        for (int i = PL + W; i < Wp; i++) row[i] = 0.0f;
    }
    memset(row, 0, sizeof(float) * (size_t)PB * Wp);
}

/* out (P, Q) = bias + sum over the nin input planes i (H, W, in + i * in_stride) of their stride-1
 * correlation with kernel i (KH, KW, k + i * k_stride; rotated by 180 degrees when flip), taps
 * in row order. Padding PT, PB, PL, PR >= 0 with P = H + PT + PB - DH (KH - 1), Q likewise.
 * Scratch: xp (Hp Wp floats), grid (P Wp floats). */
static inline void pcg_dw_flat_plane(const float *restrict in, pc_idx in_stride, const float *restrict k,
                                     pc_idx k_stride, int nin, int flip, float bias, int H, int W, int KH, int KW,
                                     int DH, int DW, int PT, int PB, int PL, int PR, int P, int Q,
                                     float *restrict xp, float *restrict grid, float *restrict out)
{
    const int Wp = W + PL + PR;
    const pc_idx L = (pc_idx)(P - 1) * Wp + Q;
    for (pc_idx s = 0; s < L; s++) grid[s] = bias;
    for (int i = 0; i < nin; i++) {
        const float *ki = k + (pc_idx)i * k_stride;
        pcg_pad_plane(in + (pc_idx)i * in_stride, H, W, PT, PB, PL, PR, xp);
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                const float kv = flip ? ki[(KH - 1 - kh) * KW + (KW - 1 - kw)] : ki[kh * KW + kw];
                const float *src = xp + (pc_idx)kh * DH * Wp + (pc_idx)kw * DW;
                PC_SIMD
                for (pc_idx s = 0; s < L; s++) grid[s] = PC_FMAF(kv, src[s], grid[s]);
            }
        }
    }
    for (int p = 0; p < P; p++) memcpy(out + (pc_idx)p * Q, grid + (pc_idx)p * Wp, sizeof(float) * (size_t)Q);
}

/* sum over s < n of a[s] b[s]: 32 lanes (four 8-float vectors where the compiler has vector
 * extensions, so the multiply-adds are independent vector operations instead of one chain of
 * dependent scalar adds) plus a scalar tail, added in a fixed order: the same bits every run. */
#if defined(__GNUC__) || defined(__clang__)
typedef float pcg_v8 __attribute__((vector_size(32)));
static inline float pcg_dot32(const float *restrict a, const float *restrict b, pc_idx n)
{
    pcg_v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, va, vb;
    pc_idx i = 0;
    for (; i + 32 <= n; i += 32) {
        memcpy(&va, a + i, 32); memcpy(&vb, b + i, 32); s0 += va * vb;
        memcpy(&va, a + i + 8, 32); memcpy(&vb, b + i + 8, 32); s1 += va * vb;
        memcpy(&va, a + i + 16, 32); memcpy(&vb, b + i + 16, 32); s2 += va * vb;
        memcpy(&va, a + i + 24, 32); memcpy(&vb, b + i + 24, 32); s3 += va * vb;
    }
    pcg_v8 t = (s0 + s1) + (s2 + s3);
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return (((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]))) + tail;
}
#else
static inline float pcg_dot32(const float *restrict a, const float *restrict b, pc_idx n)
{
    float l[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    pc_idx i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail;
}
#endif

/* dw (KH, KW) += the stride-1 correlation of dy (P, Q) with x (H, W): x padded into xp, dy laid on
 * the Wp-wide grid with zeros past column Q, then one dot product of length L per tap
 * (pcg_dot32), in double into dw. Scratch: xp (Hp Wp), dyg (P Wp). */
static inline void pcg_dw_flat_weight_plane(const float *restrict x, const float *restrict dy, int H, int W,
                                            int KH, int KW, int DH, int DW, int PT, int PB, int PL, int PR,
                                            int P, int Q, float *restrict xp, float *restrict dyg,
                                            double *restrict dw)
{
    const int Wp = W + PL + PR;
    const pc_idx L = (pc_idx)(P - 1) * Wp + Q;
    pcg_pad_plane(x, H, W, PT, PB, PL, PR, xp);
    for (int p = 0; p < P; p++) {
        float *row = dyg + (pc_idx)p * Wp;
        memcpy(row, dy + (pc_idx)p * Q, sizeof(float) * (size_t)Q);
        for (int q = Q; q < Wp; q++) row[q] = 0.0f;
    }
    for (int kh = 0; kh < KH; kh++)
        for (int kw = 0; kw < KW; kw++)
            dw[kh * KW + kw] += (double)pcg_dot32(dyg, xp + (pc_idx)kh * DH * Wp + (pc_idx)kw * DW, L);
}

#endif /* PARCONV_PC_CONV_GENERAL_H */
