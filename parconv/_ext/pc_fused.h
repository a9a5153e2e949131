/* Backward of the fused relu(maxpool(conv2d(x))) for _conv_fused.pxi, stride-1 convolution.
 *
 * Shape legend: N batch, C in-channels, O filters, H, W input, Hp, Wp the
 * zero-padded input, P, Q the convolution output, PQp the pooled positions of
 * one plane, K kernel. y, argmax and dy are (N, O, PQp); argmax indexes the
 * (P, Q) plane.
 *
 * The gradient of the convolution output, dz, is nonzero only at the argmax of
 * a window whose pooled value is positive. The composed backward writes dz for
 * the whole batch (N*O*P*Q floats) and reads it back; here each (image, filter)
 * plane of dz is built in a P*Q scratch that stays in L1 and consumed at once:
 *
 *   dw[o, c, kh, kw] += sum_{p,q} dz[p, q] * xpad[c, p + kh, q + kw]
 *   dx[c, p + kh, q + kw] += w[o, c, kh, kw] * dz[p, q]      (padded, per image)
 *
 * The dw taps are contiguous dot products over the plane (see pcf_dw_images),
 * summed in float lanes per plane and in double across planes; the dx update
 * runs along rows. dw is summed in fixed blocks of images (their number set by
 * the shape, not the thread count) and the blocks' partials are added in
 * order, so every thread count gives the same bits.
 */
#ifndef PARCONV_PC_FUSED_H
#define PARCONV_PC_FUSED_H

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pc_common.h"   /* pc_sum_f32 */
#include "pc_conv.h"     /* pcc_pad_image */
#include "pc_dense.h"    /* pcd_linear_dx_rows: the pooled gradient from a linear head */

typedef ptrdiff_t pcf_idx;

/* dy where y > 0, else +0 (NaN y passes nothing, like relu_backward): a bit mask, not a branch,
 * since the sign of y is unpredictable. */
static inline float pcf_relu_grad(float y, float dy)
{
    uint32_t bits;
    memcpy(&bits, &dy, sizeof bits);
    bits &= (uint32_t)0 - (uint32_t)(y > 0.0f);
    float g;
    memcpy(&g, &bits, sizeof g);
    return g;
}

/* The scatter of pcf_dz_plane for one argmax type and map: a loop of its own, so that the
 * pointers stay in registers and the map's NULL test is made once. */
#define PCF_DZ_SCATTER(AM_T, INDEX)                                 \
    do {                                                            \
        const AM_T *restrict a_ = (const AM_T *)am + at;            \
        for (int j = 0; j < PQp; j++) {                             \
            const pcf_idx i_ = (pcf_idx)a_[j];                      \
            dz[INDEX] += g[j];                                      \
        }                                                           \
    } while (0)

/* One plane of dz (n elements, overwritten): the pooled gradient at each argmax, through the map
 * ``where`` from (P, Q) positions to dz's layout (NULL: the identity). The plane's argmax starts at
 * element ``at`` of am, uint16_t when am16 (planes of at most PC_POOL_U16_MAX positions), else int.
 * The gradients through the ReLU go to g (PQp floats) first, in a loop that vectorises, so the
 * scatter only adds; returns their sum (the plane's db share), taken from the PQp values of g
 * rather than the n of dz (at 2x2 pooling of a 26x26 plane, a quarter of the adds). */
static inline double pcf_dz_plane(const float *restrict y, const void *am, int am16, pcf_idx at,
                                  const float *restrict dy, int PQp, const int *restrict where,
                                  float *restrict g, float *restrict dz, pcf_idx n)
{
    for (int j = 0; j < PQp; j++)
        g[j] = pcf_relu_grad(y[j], dy[j]);
    memset(dz, 0, sizeof(float) * (size_t)n);
    if (am16 && where)
        PCF_DZ_SCATTER(uint16_t, where[i_]);
    else if (am16)
        PCF_DZ_SCATTER(uint16_t, i_);
    else if (where)
        PCF_DZ_SCATTER(int, where[i_]);
    else
        PCF_DZ_SCATTER(int, i_);
    return pc_sum_f32(g, PQp);
}

/* dst[p * ldd + q] += a * dz[p, q] */
static inline void pcf_rows_axpy(float a, const float *restrict dz, int P, int Q, float *restrict dst, pcf_idx ldd)
{
    for (int p = 0; p < P; p++) {
        const float *restrict d = dz + (pcf_idx)p * Q;
        float *restrict o = dst + (pcf_idx)p * ldd;
        for (int q = 0; q < Q; q++)
            o[q] = o[q] + a * d[q];
    }
}

/* sum_s a[s] * b[s] over n terms: four independent 16-float accumulators (no add
 * waits on the one before), combined in a fixed order. */
static inline double pcf_dot(const float *restrict a, const float *restrict b, pcf_idx n)
{
    float l0[16], l1[16], l2[16], l3[16];
    pcf_idx s = 0;
    for (int j = 0; j < 16; j++)
        l0[j] = l1[j] = l2[j] = l3[j] = 0.0f;
    for (; s + 64 <= n; s += 64)
        for (int j = 0; j < 16; j++) {
            l0[j] = l0[j] + a[s + j] * b[s + j];
            l1[j] = l1[j] + a[s + 16 + j] * b[s + 16 + j];
            l2[j] = l2[j] + a[s + 32 + j] * b[s + 32 + j];
            l3[j] = l3[j] + a[s + 48 + j] * b[s + 48 + j];
        }
    for (; s + 16 <= n; s += 16)
        for (int j = 0; j < 16; j++)
            l0[j] = l0[j] + a[s + j] * b[s + j];
    double r = 0.0;
    for (; s < n; s++)
        r += (double)a[s] * b[s];
    for (int j = 0; j < 16; j++)
        r += (double)((l0[j] + l1[j]) + (l2[j] + l3[j]));
    return r;
}

/* The nine taps of a 3x3 filter in one pass over dz: acc[t] += sum_s dz[s] * src[off[t] + s].
 * dz is loaded once for all nine products (nine 16-float accumulators), fused multiply-adds
 * where the hardware has them (PC_FMAF). */
static inline void pcf_dot9(const float *restrict dz, const float *restrict src, const pcf_idx *off, pcf_idx n,
                            double *restrict acc)
{
    float l[9][16];
    pcf_idx s = 0;
    const float *restrict r0 = src + off[0], *restrict r1 = src + off[1], *restrict r2 = src + off[2];
    const float *restrict r3 = src + off[3], *restrict r4 = src + off[4], *restrict r5 = src + off[5];
    const float *restrict r6 = src + off[6], *restrict r7 = src + off[7], *restrict r8 = src + off[8];
    for (int t = 0; t < 9; t++)
        for (int j = 0; j < 16; j++)
            l[t][j] = 0.0f;
    for (; s + 16 <= n; s += 16)
        for (int j = 0; j < 16; j++) {
            const float d = dz[s + j];
            l[0][j] = PC_FMAF(d, r0[s + j], l[0][j]);
            l[1][j] = PC_FMAF(d, r1[s + j], l[1][j]);
            l[2][j] = PC_FMAF(d, r2[s + j], l[2][j]);
            l[3][j] = PC_FMAF(d, r3[s + j], l[3][j]);
            l[4][j] = PC_FMAF(d, r4[s + j], l[4][j]);
            l[5][j] = PC_FMAF(d, r5[s + j], l[5][j]);
            l[6][j] = PC_FMAF(d, r6[s + j], l[6][j]);
            l[7][j] = PC_FMAF(d, r7[s + j], l[7][j]);
            l[8][j] = PC_FMAF(d, r8[s + j], l[8][j]);
        }
    for (int t = 0; t < 9; t++) {
        double r = 0.0;
        for (pcf_idx q = s; q < n; q++)
            r += (double)dz[q] * src[off[t] + q];
        for (int j = 0; j < 16; j++)
            r += (double)l[t][j];
        acc[t] += r;
    }
}

/* Scratch floats of pcf_dw_images for one thread (the position map counted as floats, pcf_dz_plane's
 * g as P * Q, at least the pooled plane); head_F > 0: room for four images' pooled gradients of
 * head_F floats each (see pcf_dw_images). */
static inline pcf_idx pcf_dw_scratch_floats(int C, int H, int W, int pad, int P, int Q, pcf_idx head_F)
{
    return (pcf_idx)C * (H + 2 * pad) * (W + 2 * pad) + (pcf_idx)P * (W + 2 * pad) + 2 * (pcf_idx)P * Q
           + 4 * head_F;
}

/* Partial dw and db sums of images n0..n1 for every filter, in double: acc[o * (kdim + 1) + k] for
 * the kdim = C*K*K taps, acc[o * (kdim + 1) + kdim] for the bias (overwritten). The images are
 * summed in order, so a block's partials do not depend on the thread that computes them.
 *
 * The pooled gradient dy is (N, O, PQp), or, when dyl is not NULL, it is not stored at all: the
 * pooled output feeds a linear head (flatten, then G <= PCD_NARROW_G outputs with weights wl of
 * (G, O * PQp)) whose output gradient is dyl (N, G), and each image's row of dyl @ wl is computed
 * into scratch as the image comes up (four images at a time, sharing each load of wl). That
 * spares writing the head's full-size dx and reading it back here.
 *
 * dz is laid out at the padded row stride Wp (zeros in the Wp - Q wrap-around
 * columns), so tap (c, kh, kw) is one contiguous dot product of
 * (P - 1) * Wp + Q terms against the padded image shifted by
 * c * Hp * Wp + kh * Wp + kw. A block reads each image's y, argmax and dy
 * planes as one contiguous run (all O filters). */
static void pcf_dw_images(const float *x, int C, int H, int W, int pad, int K, int P, int Q,
                          const float *y, const void *am, int am16, const float *dy, int O, int PQp, int n0, int n1,
                          const float *dyl, const float *wl, int G, double *acc, float *scratch)
{
    const int Hp = H + 2 * pad, Wp = W + 2 * pad;
    const pcf_idx kdim = (pcf_idx)C * K * K, PW = (pcf_idx)P * Wp;
    const pcf_idx span = (pcf_idx)(P - 1) * Wp + Q;
    float *xpad = scratch;
    float *dzw = xpad + (pcf_idx)C * Hp * Wp;           /* (P, Wp) */
    int *where = (int *)(dzw + PW);                     /* (p, q) of the plane -> p * Wp + q */
    float *g = (float *)(where + (pcf_idx)P * Q);       /* (PQp,): pcf_dz_plane's gradients */
    float *head = g + (pcf_idx)P * Q;                   /* (4, O * PQp): four images' pooled gradients */
    const pcf_idx F = (pcf_idx)O * PQp;
    memset(acc, 0, sizeof(double) * (size_t)O * (size_t)(kdim + 1));
    for (int p = 0; p < P; p++)
        for (int q = 0; q < Q; q++)
            where[(pcf_idx)p * Q + q] = p * Wp + q;
    pcf_idx off9[9];
    for (int t = 0; t < 9; t++)
        off9[t] = (pcf_idx)(t / 3) * Wp + t % 3;
    for (int n = n0; n < n1; n++) {
        const float *xn = x + (pcf_idx)n * C * H * W;   /* unpadded images are read in place */
        if (pad) {
            pcc_pad_image(xn, H, W, pad, Hp, Wp, 0, C, xpad);
            xn = xpad;
        }
        const float *dyn;
        if (dyl) {
            if ((n - n0) % 4 == 0)
                pcd_linear_dx_rows(dyl, wl, head, n, n + 4 < n1 ? n + 4 : n1, F, G);
            dyn = head + ((n - n0) % 4) * F;
        } else {
            dyn = dy + (pcf_idx)n * F;
        }
        for (int o = 0; o < O; o++) {
            const pcf_idx plane = ((pcf_idx)n * O + o) * PQp;
            double *a = acc + (pcf_idx)o * (kdim + 1);
            a[kdim] += pcf_dz_plane(y + plane, am, am16, plane, dyn + (pcf_idx)o * PQp, PQp, where, g, dzw, PW);
            for (int c = 0; c < C; c++) {
                const float *xc = xn + (pcf_idx)c * Hp * Wp;
                if (K == 3) {
                    pcf_dot9(dzw, xc, off9, span, a + (pcf_idx)c * 9);
                    continue;
                }
                for (int kh = 0; kh < K; kh++)
                    for (int kw = 0; kw < K; kw++)
                        a[((pcf_idx)c * K + kh) * K + kw] += pcf_dot(dzw, xc + (pcf_idx)kh * Wp + kw, span);
            }
        }
    }
}

/* dw (O, kdim) and db (NULL: skipped) from nblocks blocks of partial sums (pcf_dw_images,
 * per_block = O * (kdim + 1) doubles apart), added in block order. */
static void pcf_dw_reduce(const double *part, int nblocks, int O, pcf_idx kdim, float *dw, float *db)
{
    const pcf_idx per_block = (pcf_idx)O * (kdim + 1);
    for (int o = 0; o < O; o++)
        for (pcf_idx k = 0; k <= kdim; k++) {
            const pcf_idx e = (pcf_idx)o * (kdim + 1) + k;
            double s = part[e];
            for (int b = 1; b < nblocks; b++)
                s += part[(pcf_idx)b * per_block + e];
            if (k < kdim)
                dw[(pcf_idx)o * kdim + k] = (float)s;
            else if (db)
                db[o] = (float)s;
        }
}

/* Scratch floats of pcf_dx for one thread. */
static inline pcf_idx pcf_dx_scratch_floats(int C, int H, int W, int pad, int P, int Q)
{
    return (pcf_idx)C * (H + 2 * pad) * (W + 2 * pad) + 2 * (pcf_idx)P * Q;
}

/* dx of image n (C, H, W), overwritten: every filter's plane in order. */
static void pcf_dx(int n, int C, int H, int W, int pad, int K, int P, int Q, const float *w,
                   const float *y, const void *am, int am16, const float *dy, int O, int PQp, float *dx,
                   float *scratch)
{
    const int Hp = H + 2 * pad, Wp = W + 2 * pad;
    const pcf_idx PQ = (pcf_idx)P * Q;
    float *dxpad = scratch;
    float *dz = dxpad + (pcf_idx)C * Hp * Wp;
    float *g = dz + PQ;
    memset(dxpad, 0, sizeof(float) * (size_t)C * Hp * Wp);
    for (int o = 0; o < O; o++) {
        const pcf_idx plane = ((pcf_idx)n * O + o) * PQp;
        pcf_dz_plane(y + plane, am, am16, plane, dy + plane, PQp, NULL, g, dz, PQ);
        for (int c = 0; c < C; c++)
            for (int kh = 0; kh < K; kh++)
                for (int kw = 0; kw < K; kw++)
                    pcf_rows_axpy(w[(((pcf_idx)o * C + c) * K + kh) * K + kw], dz, P, Q,
                                  dxpad + ((pcf_idx)c * Hp + kh) * Wp + kw, Wp);
    }
    for (int c = 0; c < C; c++)
        for (int h = 0; h < H; h++)
            memcpy(dx + ((pcf_idx)n * C + c) * H * W + (pcf_idx)h * W,
                   dxpad + ((pcf_idx)c * Hp + h + pad) * Wp + pad, sizeof(float) * (size_t)W);
}

#endif
