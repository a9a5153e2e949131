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

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
#include <arm_neon.h>
#endif

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

/* ------------------------------------------------------------------ direct 3x3 depthwise
 * 3x3 filters, dilation 1, strides 1 or 2 on each axis, one filter per channel: the plane is
 * copied once into zero-padded scratch, then row loops along the width (the vector axis) with
 * all nine taps in registers and no edge cases. Indices are pc_idx: the extension is built with
 * -fwrapv, and a wrapping 32-bit index keeps the vectoriser from striding the loads (it gathers). */

/* xp (Hp, Wp) = x (H, W) shifted down by PT and right by PL, zeros around (rows and columns past
 * Hp, Wp cut). */
static inline void pcg_dw3_pad(const float *restrict x, int H, int W, int PT, int PL, pc_idx Hp, pc_idx Wp,
                               float *restrict xp)
{
    /* plain loops, not memcpy/memset: the rows are short and the library calls cost more than them */
    const pc_idx j0 = PL < Wp ? PL : Wp, j1 = (pc_idx)PL + W < Wp ? (pc_idx)PL + W : Wp;
    for (pc_idx i = 0; i < Hp; i++) {
        float *restrict row = xp + i * Wp;
        const pc_idx h = i - PT;
        if (h < 0 || h >= H || j1 <= j0) {
            PC_SIMD
            for (pc_idx j = 0; j < Wp; j++) row[j] = 0.0f;
            continue;
        }
        const float *restrict xr = x + h * W - PL;
        for (pc_idx j = 0; j < j0; j++) row[j] = 0.0f;
        PC_SIMD
        for (pc_idx j = j0; j < j1; j++) row[j] = xr[j];
        for (pc_idx j = j1; j < Wp; j++) row[j] = 0.0f;
    }
}

/* Scratch floats of pcg_dw3_forward_plane: the padded plane and the grid of stride 1. */
static inline pc_idx pcg_dw3_fwd_scratch(int P, int Q, int SH, int SW)
{
    return ((pc_idx)(P - 1) * SH + 3) * ((pc_idx)(Q - 1) * SW + 3) + (pc_idx)P * (Q + 2);
}

/* out (P, Q) = bias + the stride-1 3x3 correlation of the padded plane xp (rows Wp = Q + 2 wide),
 * then the ReLU when relu: one loop over the plane on the padded grid (position p Wp + q), the two
 * columns past each row computed and dropped, then the rows stored. g: (P - 1) Wp + Q floats. */
static inline void pcg_dw3_grid1(const float *restrict xp, pc_idx Wp, const float *restrict k, float bias, int relu,
                                 int P, int Q, float *restrict g, float *restrict out)
{
    const float k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3], k4 = k[4], k5 = k[5], k6 = k[6], k7 = k[7], k8 = k[8];
    const float *restrict a = xp, *restrict b = xp + Wp, *restrict c = xp + 2 * Wp;
    const pc_idx L = (pc_idx)(P - 1) * Wp + Q, Qn = Q;
    PC_SIMD
    for (pc_idx q = 0; q < L; q++) {
        const float u = PC_FMAF(k2, a[q + 2], PC_FMAF(k1, a[q + 1], PC_FMAF(k0, a[q], bias)));
        const float v = PC_FMAF(k5, b[q + 2], PC_FMAF(k4, b[q + 1], b[q] * k3));
        const float w = PC_FMAF(k8, c[q + 2], PC_FMAF(k7, c[q + 1], c[q] * k6));
        g[q] = (u + v) + w;
    }
    for (pc_idx p = 0; p < P; p++) {
        const float *restrict gr = g + p * Wp;
        float *restrict o = out + p * Qn;
        if (relu) {
            PC_SIMD
            for (pc_idx q = 0; q < Qn; q++) o[q] = gr[q] < 0.0f ? 0.0f : gr[q];
        } else {
            PC_SIMD
            for (pc_idx q = 0; q < Qn; q++) o[q] = gr[q];
        }
    }
}

/* out (P, Q) = bias + the 3x3 correlation of x (H, W) with k at strides SH, SW, padded by PT above
 * and PL to the left (then the ReLU when relu). Each filter row is its own sum (the bias starts the
 * first), then the three add in order: three short dependency chains instead of one of nine. */
static inline void pcg_dw3_forward_plane(const float *restrict x, int H, int W, const float *restrict k, float bias,
                                         int relu, int SH, int SW, int PT, int PL, int P, int Q,
                                         float *restrict scratch, float *restrict out)
{
    const pc_idx Hp = (pc_idx)(P - 1) * SH + 3, Wp = (pc_idx)(Q - 1) * SW + 3, Qn = Q;
    const float k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3], k4 = k[4], k5 = k[5], k6 = k[6], k7 = k[7], k8 = k[8];
    pcg_dw3_pad(x, H, W, PT, PL, Hp, Wp, scratch);
    if (SH == 1 && SW == 1) {
        pcg_dw3_grid1(scratch, Wp, k, bias, relu, P, Q, scratch + Hp * Wp, out);
        return;
    }
    for (pc_idx p = 0; p < P; p++) {
        const float *restrict a = scratch + p * SH * Wp;
        const float *restrict b = a + Wp;
        const float *restrict c = b + Wp;
        float *restrict o = out + p * Qn;
        if (SW == 1) {
            PC_SIMD
            for (pc_idx q = 0; q < Qn; q++) {
                const float u = PC_FMAF(k2, a[q + 2], PC_FMAF(k1, a[q + 1], PC_FMAF(k0, a[q], bias)));
                const float v = PC_FMAF(k5, b[q + 2], PC_FMAF(k4, b[q + 1], b[q] * k3));
                const float w = PC_FMAF(k8, c[q + 2], PC_FMAF(k7, c[q + 1], c[q] * k6));
                o[q] = (u + v) + w;
            }
        } else {
            PC_SIMD
            for (pc_idx q = 0; q < Qn; q++) {
                const float u = PC_FMAF(k2, a[2 * q + 2], PC_FMAF(k1, a[2 * q + 1], PC_FMAF(k0, a[2 * q], bias)));
                const float v = PC_FMAF(k5, b[2 * q + 2], PC_FMAF(k4, b[2 * q + 1], b[2 * q] * k3));
                const float w = PC_FMAF(k8, c[2 * q + 2], PC_FMAF(k7, c[2 * q + 1], c[2 * q] * k6));
                o[q] = (u + v) + w;
            }
        }
        if (relu) {
            PC_SIMD
            for (pc_idx q = 0; q < Qn; q++) o[q] = o[q] < 0.0f ? 0.0f : o[q];
        }
    }
}

/* Scratch floats of pcg_dw3_dx_plane: the flipped filter, the padded plane and the grid. */
static inline pc_idx pcg_dw3_dx_scratch(int H, int W, int P, int Q, int SH, int SW)
{
    (void)P; (void)Q; (void)SH; (void)SW;
    return 16 + ((pc_idx)H + 2) * ((pc_idx)W + 2) + (pc_idx)H * (W + 2);
}

/* dx (H, W) = the input gradient of pcg_dw3_forward_plane (no bias, no ReLU) from dy (P, Q): the
 * stride-1 correlation of dy, dilated by the strides (zeros between its samples), with the filter
 * rotated by 180 degrees, padded by 2 - PT and 2 - PL: dy is written straight into that padded,
 * dilated plane. Needs PT, PL <= 2. */
static inline void pcg_dw3_dx_plane(const float *restrict dy, int P, int Q, const float *restrict k, int H, int W,
                                    int SH, int SW, int PT, int PL, float *restrict scratch, float *restrict dx)
{
    float *kf = scratch, *restrict U = scratch + 16;
    const pc_idx Hp = (pc_idx)H + 2, Wp = (pc_idx)W + 2, n = Hp * Wp;
    for (int t = 0; t < 9; t++) kf[t] = k[8 - t];
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) U[i] = 0.0f;
    /* dy (p, q) lands on (p SH + 2 - PT, q SW + 2 - PL); what falls past the plane reaches no dx */
    const pc_idx r0 = 2 - PT, c0 = 2 - PL;
    pc_idx qn = Q;
    if (c0 + (qn - 1) * SW >= Wp) qn = (Wp - 1 - c0) / SW + 1;
    for (pc_idx p = 0; p < P; p++) {
        const pc_idx r = p * SH + r0;
        if (r >= Hp) break;
        float *restrict u = U + r * Wp + c0;
        const float *restrict g = dy + p * Q;
        if (SW == 1) {
            PC_SIMD
            for (pc_idx q = 0; q < qn; q++) u[q] = g[q];
        } else {
            for (pc_idx q = 0; q < qn; q++) u[q * SW] = g[q];
        }
    }
    pcg_dw3_grid1(U, Wp, kf, 0.0f, 0, H, W, U + n, dx);
}

#define PCG_DW3_LANES 16

/* dy rows are padded to whole 16-lane blocks (Qr floats), x rows to every tap of them (Wd). */
static inline void pcg_dw3_dw_dims(int P, int Q, int SH, int SW, pc_idx *Qr, pc_idx *Hp, pc_idx *Wd)
{
    *Qr = ((pc_idx)Q + PCG_DW3_LANES - 1) / PCG_DW3_LANES * PCG_DW3_LANES;
    *Hp = (pc_idx)(P - 1) * SH + 3;
    *Wd = (*Qr - 1) * SW + 3 + (SW == 2 ? PCG_DW3_LANES : 0);
}

/* Scratch floats of pcg_dw3_dw_plane: the padded x plane and the padded dy plane. */
static inline pc_idx pcg_dw3_dw_scratch(int P, int Q, int SH, int SW)
{
    pc_idx Qr, Hp, Wd;
    pcg_dw3_dw_dims(P, Q, SH, SW, &Qr, &Hp, &Wd);
    return Hp * Wd + (pc_idx)P * Qr;
}

#if defined(__GNUC__) || defined(__clang__)
/* Vectors of the ISA level's native width: below AVX-512 a 16-float vector has no register of its own
 * (GCC keeps it in memory), so loops that hold several accumulators use these. */
#if defined(__AVX512F__)
#define PCG_VN 16
#define PCG_EVEN_IDX 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
typedef float pcg_vn __attribute__((vector_size(64)));
typedef int pcg_vni __attribute__((vector_size(64)));
#elif defined(__AVX__)
#define PCG_VN 8
#define PCG_EVEN_IDX 0, 2, 4, 6, 8, 10, 12, 14
typedef float pcg_vn __attribute__((vector_size(32)));
typedef int pcg_vni __attribute__((vector_size(32)));
#else
#define PCG_VN 4
#define PCG_EVEN_IDX 0, 2, 4, 6
typedef float pcg_vn __attribute__((vector_size(16)));
typedef int pcg_vni __attribute__((vector_size(16)));
#endif
#define PCG_NV16 (16 / PCG_VN) /* native vectors per 16 lanes */

static inline pcg_vn pcg_ldn(const float *p)
{
    pcg_vn v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline float pcg_hsum16f(const float *v)
{
    float s = 0.0f;
    for (int l = 0; l < 16; l += 4) s += (v[l] + v[l + 1]) + (v[l + 2] + v[l + 3]);
    return s;
}

/* p[0], p[2], ..., p[2 (PCG_VN - 1)] */
static inline pcg_vn pcg_ldn_even(const float *p)
{
    const pcg_vn lo = pcg_ldn(p), hi = pcg_ldn(p + PCG_VN);
#if defined(__clang__)
    return __builtin_shufflevector(lo, hi, PCG_EVEN_IDX);
#else
    const pcg_vni even = {PCG_EVEN_IDX};
    return __builtin_shuffle(lo, hi, even);
#endif
}
#endif

/* dw (3, 3) += the correlation of dy (P, Q) with x (H, W) at strides SH, SW: per filter row kh,
 * the three taps in 16-lane accumulators (two per tap, even and odd output rows), added in a
 * fixed order: the same bits for a given shape. */
static inline void pcg_dw3_dw_plane(const float *restrict x, const float *restrict dy, int H, int W, int SH, int SW,
                                    int PT, int PL, int P, int Q, float *restrict scratch, double *restrict dw)
{
    pc_idx Qr, Hp, Wd;
    pcg_dw3_dw_dims(P, Q, SH, SW, &Qr, &Hp, &Wd);
    float *X = scratch, *D = scratch + Hp * Wd;
    pcg_dw3_pad(x, H, W, PT, PL, Hp, Wd, X);
    for (pc_idx p = 0; p < P; p++) {
        memcpy(D + p * Qr, dy + p * Q, sizeof(float) * (size_t)Q);
        memset(D + p * Qr + Q, 0, sizeof(float) * (size_t)(Qr - Q));
    }
#if defined(__GNUC__) || defined(__clang__)
    /* each native vector's lanes in a pass of their own: every lane adds the same terms in the same order */
    for (int kh = 0; kh < 3; kh++) {
        float t0[16], t1[16], t2[16];
        for (int v = 0; v < PCG_NV16; v++) {
            const pc_idx o = (pc_idx)v * PCG_VN;
            pcg_vn a0 = {0}, a1 = {0}, a2 = {0}, b0 = {0}, b1 = {0}, b2 = {0};
            for (pc_idx p = 0; p < P; p++) {
                const float *g = D + p * Qr + o, *r = X + (p * SH + kh) * Wd + o * SW;
                for (pc_idx q0 = 0; q0 < Qr; q0 += PCG_DW3_LANES) {
                    const pcg_vn gv = pcg_ldn(g + q0);
                    pcg_vn x0, x1, x2;
                    if (SW == 1) {
                        x0 = pcg_ldn(r + q0);
                        x1 = pcg_ldn(r + q0 + 1);
                        x2 = pcg_ldn(r + q0 + 2);
                    } else {
                        x0 = pcg_ldn_even(r + 2 * q0);
                        x1 = pcg_ldn_even(r + 2 * q0 + 1);
                        x2 = pcg_ldn_even(r + 2 * q0 + 2);
                    }
                    if (p & 1) {
                        b0 += gv * x0;
                        b1 += gv * x1;
                        b2 += gv * x2;
                    } else {
                        a0 += gv * x0;
                        a1 += gv * x1;
                        a2 += gv * x2;
                    }
                }
            }
            a0 += b0;
            a1 += b1;
            a2 += b2;
            memcpy(t0 + o, &a0, sizeof(a0));
            memcpy(t1 + o, &a1, sizeof(a1));
            memcpy(t2 + o, &a2, sizeof(a2));
        }
        dw[kh * 3] += (double)pcg_hsum16f(t0);
        dw[kh * 3 + 1] += (double)pcg_hsum16f(t1);
        dw[kh * 3 + 2] += (double)pcg_hsum16f(t2);
    }
#else
    for (int t = 0; t < 9; t++) {
        const int kh = t / 3, kw = t % 3;
        float s = 0.0f;
        for (pc_idx p = 0; p < P; p++)
            for (pc_idx q = 0; q < Q; q++) s += D[p * Qr + q] * X[(p * SH + kh) * Wd + q * SW + kw];
        dw[t] += (double)s;
    }
#endif
}

/* ------------------------------------------------------------------ pointwise (1x1) convolution
 * Per image, y (O, S) = w (O, C) x (C, S) with S = H W: a GEMM whose register block is a few filters by
 * 16 or 32 positions (below), the positions' slab of x (C rows) staying in L1 while the filter blocks
 * pass over it. Each output is one sum over c in order: the same bits
 * whatever the thread count. The multiply-adds contract to FMA where the ISA level has it. */

#if defined(__GNUC__) && !defined(__clang__)
#define PCG_CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define PCG_CONTRACT
#endif

/* The register block: 8 filters by 32 positions fills AVX-512's 32 registers. Below AVX-512 a 16-float
 * vector has no register of its own (GCC keeps it in memory), so the other levels take 6 (AVX) or 2 (SSE)
 * filters by 16 positions in vectors of their native width. The blocking does not change any output's sum. */
#if defined(__AVX512F__)
#define PCG_PW_WIDE 1
#define PCG_PW_RB 8
#elif defined(__AVX__)
#define PCG_PW_WIDE 0
#define PCG_PW_RB 6
#else
#define PCG_PW_WIDE 0
#define PCG_PW_RB 2
#endif

#if defined(__GNUC__) || defined(__clang__)
/* v * scale + bias (scale optional), then max(., 0) when relu: the store's epilogue */
static inline void pcg_pw_store(float *p, pcg_vn v, float sc, float bi, int has_scale, int relu)
{
    /* one fused multiply-add where the level has FMA, spelled out: whether GCC contracts v * sc + bi in an
     * inlined copy depends on the copy, and every output of a layer must round the same way */
#if defined(__AVX512F__)
    if (has_scale) v = (pcg_vn)_mm512_fmadd_ps((__m512)v, _mm512_set1_ps(sc), _mm512_set1_ps(bi));
    else v = v + bi;
#elif defined(__FMA__) && defined(__AVX__)
    if (has_scale) v = (pcg_vn)_mm256_fmadd_ps((__m256)v, _mm256_set1_ps(sc), _mm256_set1_ps(bi));
    else v = v + bi;
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA) && !defined(__AVX__)
    if (has_scale) v = (pcg_vn)vfmaq_f32(vdupq_n_f32(bi), (float32x4_t)v, vdupq_n_f32(sc));
    else v = v + bi;
#else
    if (has_scale) v = v * sc;
    v = v + bi;
#endif
    if (relu) {
        const pcg_vn z = {0};
        const pcg_vni neg = v < z;  /* NaN stays, as the scalar x < 0 ? 0 : x */
        v = (pcg_vn)((pcg_vni)v & ~neg);
    }
    memcpy(p, &v, sizeof(v));
}

/* nr (a constant once inlined) filters from wo by the 16 packed positions at pack + h (rows L apart) */
PCG_CONTRACT static inline __attribute__((always_inline)) void
pcg_pw_rows16(const float *restrict wo, pc_idx C, const float *restrict pack, pc_idx L, pc_idx h, int nr,
              const float *restrict sc, const float *restrict bi, int hs, int relu, float *restrict y, pc_idx S)
{
    pcg_vn a[PCG_PW_RB][PCG_NV16];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < PCG_NV16; v++) a[r][v] = (pcg_vn){0};
    for (pc_idx c = 0; c < C; c++) {
        pcg_vn x[PCG_NV16];
        for (int v = 0; v < PCG_NV16; v++) x[v] = pcg_ldn(pack + L * c + h + v * PCG_VN);
        for (int r = 0; r < nr; r++) {
            const float wv = wo[r * C + c];
            for (int v = 0; v < PCG_NV16; v++) a[r][v] += wv * x[v];
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < PCG_NV16; v++)
            pcg_pw_store(y + r * S + h + v * PCG_VN, a[r][v], hs ? sc[r] : 1.0f, bi ? bi[r] : 0.0f, hs, relu);
}
#endif

/* y columns [s0, s1) of one image: y[o][s] = epilogue(sum_c w[o][c] x[c][s]) with x rows S apart,
 * w rows C apart, y rows S apart. b, scale: per filter, NULL for none. */
PCG_CONTRACT static void pcg_pw_cols(const float *restrict w, const float *restrict x, int C, int O, pc_idx S,
                                     pc_idx s0, pc_idx s1, const float *restrict b, const float *restrict scale,
                                     int relu, float *restrict pack, float *restrict y)
{
    pc_idx s = s0;
#if defined(__GNUC__) || defined(__clang__)
    const int hs = scale != NULL;
    for (; s + 16 <= s1;) {
        /* the slab's columns packed contiguously (rows of a wide image are a page apart) */
        const int wide = PCG_PW_WIDE && s + 32 <= s1;
        const pc_idx L = wide ? 32 : 16;
        for (pc_idx c = 0; c < C; c++) {
            memcpy(pack + c * L, x + c * S + s, sizeof(float) * (size_t)L);
        }
        int o = 0;
#if PCG_PW_WIDE
        if (wide)
            for (; o + 8 <= O; o += 8) {
                pcg_vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                pcg_vn c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, c4 = {0}, c5 = {0}, c6 = {0}, c7 = {0};
                const float *wo = w + (pc_idx)o * C;
                for (pc_idx c = 0; c < C; c++) {
                    const pcg_vn x0 = pcg_ldn(pack + 32 * c), x1 = pcg_ldn(pack + 32 * c + 16);
                    float v;
                    v = wo[c]; a0 += v * x0; c0 += v * x1;
                    v = wo[C + c]; a1 += v * x0; c1 += v * x1;
                    v = wo[2 * (pc_idx)C + c]; a2 += v * x0; c2 += v * x1;
                    v = wo[3 * (pc_idx)C + c]; a3 += v * x0; c3 += v * x1;
                    v = wo[4 * (pc_idx)C + c]; a4 += v * x0; c4 += v * x1;
                    v = wo[5 * (pc_idx)C + c]; a5 += v * x0; c5 += v * x1;
                    v = wo[6 * (pc_idx)C + c]; a6 += v * x0; c6 += v * x1;
                    v = wo[7 * (pc_idx)C + c]; a7 += v * x0; c7 += v * x1;
                }
                const pcg_vn *acc[16] = {&a0, &c0, &a1, &c1, &a2, &c2, &a3, &c3, &a4, &c4, &a5, &c5, &a6, &c6, &a7, &c7};
                for (int r = 0; r < 8; r++) {
                    const float sc = hs ? scale[o + r] : 1.0f, bi = b ? b[o + r] : 0.0f;
                    float *yr = y + (pc_idx)(o + r) * S + s;
                    pcg_pw_store(yr, *acc[2 * r], sc, bi, hs, relu);
                    pcg_pw_store(yr + 16, *acc[2 * r + 1], sc, bi, hs, relu);
                }
            }
#endif
        for (pc_idx h = 0; h < L; h += 16) {
            int o2 = o;
            for (; o2 + PCG_PW_RB <= O; o2 += PCG_PW_RB)
                pcg_pw_rows16(w + (pc_idx)o2 * C, C, pack, L, h, PCG_PW_RB, hs ? scale + o2 : NULL, b ? b + o2 : NULL,
                              hs, relu, y + (pc_idx)o2 * S + s, S);
            /* the last O % RB filters, by as many at once as fit */
            for (int nr = PCG_PW_RB - 1; nr >= 1; nr--)
                if (o2 + nr <= O) {
#define PCG_PW_TAIL(NR)                                                                                           \
    case NR:                                                                                                      \
        pcg_pw_rows16(w + (pc_idx)o2 * C, C, pack, L, h, NR, hs ? scale + o2 : NULL, b ? b + o2 : NULL, hs, relu, \
                      y + (pc_idx)o2 * S + s, S);                                                                 \
        break;
                    switch (nr) {
#if PCG_PW_RB > 7
                        PCG_PW_TAIL(7)
#endif
#if PCG_PW_RB > 6
                        PCG_PW_TAIL(6)
#endif
#if PCG_PW_RB > 5
                        PCG_PW_TAIL(5)
#endif
#if PCG_PW_RB > 4
                        PCG_PW_TAIL(4)
#endif
#if PCG_PW_RB > 3
                        PCG_PW_TAIL(3)
#endif
#if PCG_PW_RB > 2
                        PCG_PW_TAIL(2)
#endif
                        PCG_PW_TAIL(1)
                    }
#undef PCG_PW_TAIL
                    o2 += nr;
                }
        }
        s += L;
    }
#endif
    for (; s < s1; s++) {
        for (int o = 0; o < O; o++) {
            const float *wo = w + (pc_idx)o * C;
            float a = 0.0f;
            for (pc_idx c = 0; c < C; c++) a += wo[c] * x[c * S + s];
#if defined(__FMA__) || defined(__AVX512F__) || (defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA))
            /* rounded as pcg_pw_store rounds the vector columns */
            if (scale) a = __builtin_fmaf(a, scale[o], b ? b[o] : 0.0f);
            else a += b ? b[o] : 0.0f;
#else
            if (scale) a *= scale[o];
            a += b ? b[o] : 0.0f;
#endif
            y[(pc_idx)o * S + s] = relu && a < 0.0f ? 0.0f : a;
        }
    }
}

#endif /* PARCONV_PC_CONV_GENERAL_H */
