/* General convolution helpers: im2col / col2im with rectangular kernels, (h, w) strides, dilation
 * and asymmetric padding, and the depthwise kernels (whole-plane taps on padded stride phases).
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

/* ------------------------------------------------------------------ depthwise on flat planes
 * The zero-padded plane (Hp x Wp, Hp = (P - 1) SH + DH (KH - 1) + 1 rows, Wp likewise: exactly the
 * extent the taps read) is split into SH x SW phase planes X[r][c] (i, j) = xp(i SH + r, j SW + c),
 * each Hh = ceil(Hp / SH) by Wh = ceil(Wp / SW). Tap (kh, kw) of output (p, q) then reads phase
 * (kh DH % SH, kw DW % SW) at (p + kh DH / SH, q + kw DW / SW): on a grid Wh wide, position
 * s = p Wh + q, a fixed offset for the whole plane. So each tap is one contiguous loop over
 * L = (P - 1) Wh + Q grid positions (long vector loops instead of P short rows per tap); the
 * Wh - Q columns past each row are computed and dropped. Stride 1 has one phase: the padded plane. */

/* The phase planes of x (H, W) padded by PT above and PL to the left, cut to Hp x Wp (the bottom
 * and right padding may be negative: rows and columns no tap reads are left out). */
static inline void pcg_pad_phases(const float *restrict x, int H, int W, int PT, int PL, int Hp, int Wp, int SH,
                                  int SW, int Hh, int Wh, float *restrict X)
{
    const int h1 = H < Hp - PT ? H : Hp - PT, w1 = W < Wp - PL ? W : Wp - PL;
    memset(X, 0, sizeof(float) * (size_t)SH * SW * Hh * Wh);
    if (h1 <= 0 || w1 <= 0) return;  /* padding so wide that no tap reads an input */
    if (SH == 1 && SW == 1) {
        for (int h = 0; h < h1; h++) memcpy(X + (pc_idx)(h + PT) * Wh + PL, x + (pc_idx)h * W, sizeof(float) * (size_t)w1);
        return;
    }
    for (int h = 0; h < h1; h++) {
        const int hp = h + PT;
        float *rowbase = X + ((pc_idx)(hp % SH) * SW * Hh + hp / SH) * Wh;
        const float *xr = x + (pc_idx)h * W;
        for (int c = 0; c < SW; c++) {
            /* phase c holds padded columns j SW + c: inputs w = j SW + c - PL in [0, w1) */
            float *dst = rowbase + (pc_idx)c * Hh * Wh;
            int j0 = PL - c > 0 ? (PL - c + SW - 1) / SW : 0;
            for (int j = j0, w = j0 * SW + c - PL; w < w1; j++, w += SW) dst[j] = xr[w];
        }
    }
}

/* Offset of tap (kh, kw) in the phase planes, as a flat index of X. */
static inline pc_idx pcg_tap_offset(int kh, int kw, int DH, int DW, int SH, int SW, int Hh, int Wh)
{
    const int rh = kh * DH, rw = kw * DW;
    return ((pc_idx)((rh % SH) * SW + rw % SW) * Hh + rh / SH) * Wh + rw / SW;
}

/* Scratch floats pcg_dw_flat_plane and pcg_dw_flat_weight_plane need: the phase planes and the grid. */
static inline pc_idx pcg_flat_scratch(int P, int Q, int KH, int KW, int SH, int SW, int DH, int DW)
{
    const int Hp = (P - 1) * SH + DH * (KH - 1) + 1, Wp = (Q - 1) * SW + DW * (KW - 1) + 1;
    const pc_idx Hh = (Hp + SH - 1) / SH, Wh = (Wp + SW - 1) / SW;
    return (pc_idx)SH * SW * Hh * Wh + (pc_idx)P * Wh;
}

/* out (P, Q) = bias + sum over the nin input planes i (H, W, in + i * in_stride) of their
 * correlation with kernel i (KH, KW, k + i * k_stride; rotated by 180 degrees when flip) at
 * strides SH, SW, taps in row order. scratch: pcg_flat_scratch floats. */
static inline void pcg_dw_flat_plane(const float *restrict in, pc_idx in_stride, const float *restrict k,
                                     pc_idx k_stride, int nin, int flip, float bias, int H, int W, int KH, int KW,
                                     int SH, int SW, int DH, int DW, int PT, int PL, int P, int Q,
                                     float *restrict scratch, float *restrict out)
{
    const int Hp = (P - 1) * SH + DH * (KH - 1) + 1, Wp = (Q - 1) * SW + DW * (KW - 1) + 1;
    const int Hh = (Hp + SH - 1) / SH, Wh = (Wp + SW - 1) / SW;
    float *X = scratch, *grid = scratch + (pc_idx)SH * SW * Hh * Wh;
    const pc_idx L = (pc_idx)(P - 1) * Wh + Q;
    for (pc_idx s = 0; s < L; s++) grid[s] = bias;
    for (int i = 0; i < nin; i++) {
        const float *ki = k + (pc_idx)i * k_stride;
        pcg_pad_phases(in + (pc_idx)i * in_stride, H, W, PT, PL, Hp, Wp, SH, SW, Hh, Wh, X);
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                const float kv = flip ? ki[(KH - 1 - kh) * KW + (KW - 1 - kw)] : ki[kh * KW + kw];
                const float *src = X + pcg_tap_offset(kh, kw, DH, DW, SH, SW, Hh, Wh);
                PC_SIMD
                for (pc_idx s = 0; s < L; s++) grid[s] = PC_FMAF(kv, src[s], grid[s]);
            }
        }
    }
    for (int p = 0; p < P; p++) memcpy(out + (pc_idx)p * Q, grid + (pc_idx)p * Wh, sizeof(float) * (size_t)Q);
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

/* dw (KH, KW) += the correlation of dy (P, Q) with x (H, W) at strides SH, SW: x split into its
 * phase planes, dy laid on the Wh-wide grid with zeros past column Q, then one dot product of
 * length L per tap (pcg_dot32), in double into dw. scratch: pcg_flat_scratch floats. */
static inline void pcg_dw_flat_weight_plane(const float *restrict x, const float *restrict dy, int H, int W,
                                            int KH, int KW, int SH, int SW, int DH, int DW, int PT, int PL,
                                            int P, int Q, float *restrict scratch, double *restrict dw)
{
    const int Hp = (P - 1) * SH + DH * (KH - 1) + 1, Wp = (Q - 1) * SW + DW * (KW - 1) + 1;
    const int Hh = (Hp + SH - 1) / SH, Wh = (Wp + SW - 1) / SW;
    float *X = scratch, *dyg = scratch + (pc_idx)SH * SW * Hh * Wh;
    const pc_idx L = (pc_idx)(P - 1) * Wh + Q;
    pcg_pad_phases(x, H, W, PT, PL, Hp, Wp, SH, SW, Hh, Wh, X);
    for (int p = 0; p < P; p++) {
        float *row = dyg + (pc_idx)p * Wh;
        memcpy(row, dy + (pc_idx)p * Q, sizeof(float) * (size_t)Q);
        for (int q = Q; q < Wh; q++) row[q] = 0.0f;
    }
    for (int kh = 0; kh < KH; kh++)
        for (int kw = 0; kw < KW; kw++)
            dw[kh * KW + kw] += (double)pcg_dot32(dyg, X + pcg_tap_offset(kh, kw, DH, DW, SH, SW, Hh, Wh), L);
}

#endif /* PARCONV_PC_CONV_GENERAL_H */
