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
 * dy (P, Q) with x (H, W); each tap's sum is a float row sum added in row order. */
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
            double s = 0.0;
            for (int p = p_lo; p < p_hi; p++) {
                const float *g = dy + (pc_idx)p * Q;
                const float *xr = x + (pc_idx)(p * SH + kh * DH - PT) * W + off;
                float acc = 0.0f;
                if (SW == 1) {
                    for (int q = q_lo; q < q_hi; q++) acc += g[q] * xr[q];
                } else {
                    for (int q = q_lo; q < q_hi; q++) acc += g[q] * xr[(pc_idx)q * SW];
                }
                s += acc;
            }
            dw[kh * KW + kw] += s;
        }
    }
}

#endif /* PARCONV_PC_CONV_GENERAL_H */
