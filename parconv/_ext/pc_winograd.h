/* Winograd F(2x2, 3x3) transforms for the stride-1 3x3 convolution (_conv.pyx).
 *
 * Shape legend: C in-channels, O out-channels, H, W input, P, Q output, pad the
 * zero padding. The output is cut into 2x2 tiles, tH = ceil(P/2) rows of
 * tW = ceil(Q/2) tiles; tile (ty, tx) reads the 4x4 input patch whose corner is
 * (2 ty - pad, 2 tx - pad), zeros outside the image.
 *
 * With the 4x4 transforms (Lavin & Gray, "Fast Algorithms for Convolutional
 * Neural Networks", 2016)
 *
 *   U = G g G^T      (filter,  G   = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1])
 *   V = B^T d B      (patch,   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1])
 *   Y = A^T M A      (output,  A^T = [1 1 1 0; 0 1 -1 -1])
 *
 * each of the 16 points xi of the transformed domain is one GEMM over channels,
 * M[xi] (O x tiles) = U[xi] (O x C) @ V[xi] (C x tiles), 2.25x fewer multiplies
 * than the direct convolution. The caller runs those GEMMs; this file has the
 * three transforms, written so the compiler vectorises them along the tiles of
 * a row.
 *
 * Layouts (row-major): U[xi][o][c]; V[xi * ldx + c * ldt + t] and
 * M[xi * ldx + o * ldt + t] for the tiles t = (ty - ty0) * tW + tx of a block
 * of tile rows ty0..ty1 of one image.
 */
#ifndef PARCONV_PC_WINOGRAD_H
#define PARCONV_PC_WINOGRAD_H

#include <stddef.h>
#include <string.h>

typedef ptrdiff_t pcw_idx;

/* The loops below run along channels (filters) or along the tiles of a row with
 * restrict-qualified rows, so the compiler vectorises them. */

/* G applied to three rows: u = G [a0; a1; a2] (the filter transform, one axis). */
static inline void pcw_g(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                         float *restrict u0, float *restrict u1, float *restrict u2, float *restrict u3, int n)
{
    for (int i = 0; i < n; i++) {
        u0[i] = a0[i];
        u1[i] = 0.5f * ((a0[i] + a1[i]) + a2[i]);
        u2[i] = 0.5f * ((a0[i] - a1[i]) + a2[i]);
        u3[i] = a2[i];
    }
}

/* B^T applied to four rows (the input transform, one axis). */
static inline void pcw_bt(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                          const float *restrict a3, float *restrict v0, float *restrict v1,
                          float *restrict v2, float *restrict v3, int n)
{
    for (int i = 0; i < n; i++) {
        v0[i] = a0[i] - a2[i];
        v1[i] = a1[i] + a2[i];
        v2[i] = a2[i] - a1[i];
        v3[i] = a1[i] - a3[i];
    }
}

/* B^T along one padded input row held as its even (e[k] = row[2k]) and odd (o[k] = row[2k+1])
 * columns: tile i reads row[2i .. 2i+3] = e[i], o[i], e[i+1], o[i+1], all unit-stride. */
static inline void pcw_bt_row(const float *restrict e, const float *restrict o, float *restrict v0,
                              float *restrict v1, float *restrict v2, float *restrict v3, int n)
{
    for (int i = 0; i < n; i++) {
        float d0 = e[i], d1 = o[i], d2 = e[i + 1], d3 = o[i + 1];
        v0[i] = d0 - d2;
        v1[i] = d1 + d2;
        v2[i] = d2 - d1;
        v3[i] = d1 - d3;
    }
}

/* a[m] = x[2m], b[m] = x[2m + 1]: the even and odd elements of x[0..n) */
static inline void pcw_split(const float *restrict x, int n, float *restrict a, float *restrict b)
{
    for (int m = 0; m < n / 2; m++) {
        a[m] = x[2 * m];
        b[m] = x[2 * m + 1];
    }
    if (n & 1)
        a[n / 2] = x[n - 1];
}

/* A^T applied to four rows (the output transform, one axis). */
static inline void pcw_at(const float *restrict m0, const float *restrict m1, const float *restrict m2,
                          const float *restrict m3, float *restrict s0, float *restrict s1, int n)
{
    for (int i = 0; i < n; i++) {
        s0[i] = (m0[i] + m1[i]) + m2[i];
        s1[i] = (m1[i] - m2[i]) - m3[i];
    }
}

/* A^T along the tiles of one output row, plus the bias: tile i writes r[2i], r[2i+1]. */
static inline void pcw_at_row(const float *restrict s0, const float *restrict s1, const float *restrict s2,
                              const float *restrict s3, float bias, float *restrict r, int n)
{
    for (int i = 0; i < n; i++) {
        r[2 * i] = ((s0[i] + s1[i]) + s2[i]) + bias;
        r[2 * i + 1] = ((s1[i] - s2[i]) - s3[i]) + bias;
    }
}

/* Scratch floats pcw_filters needs for C channels. */
static inline pcw_idx pcw_filter_scratch_floats(int C)
{
    return 21 * (pcw_idx)C;
}

/* U for filters o0..o1 of w (O, C, 3, 3). */
static void pcw_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch)
{
    float *g = scratch;                 /* g[k * C + c] = w[o, c, k]: the 9 taps along channels */
    float *t = scratch + 9 * (pcw_idx)C; /* t[(i * 3 + j) * C + c] = (G g)[i][j] */
    for (int o = o0; o < o1; o++) {
        const float *wo = w + (pcw_idx)o * C * 9;
        for (int c = 0; c < C; c++)
            for (int k = 0; k < 9; k++)
                g[k * (pcw_idx)C + c] = wo[(pcw_idx)c * 9 + k];
        for (int j = 0; j < 3; j++)     /* G along the filter rows, each column j */
            pcw_g(g + j * (pcw_idx)C, g + (3 + j) * (pcw_idx)C, g + (6 + j) * (pcw_idx)C,
                  t + (0 + j) * (pcw_idx)C, t + (3 + j) * (pcw_idx)C, t + (6 + j) * (pcw_idx)C,
                  t + (9 + j) * (pcw_idx)C, C);
        for (int i = 0; i < 4; i++) {   /* G along the columns: U[i * 4 + j][o][c] */
            float *u = U + ((pcw_idx)(i * 4) * O + o) * C;
            const pcw_idx ux = (pcw_idx)O * C;
            pcw_g(t + (i * 3) * (pcw_idx)C, t + (i * 3 + 1) * (pcw_idx)C, t + (i * 3 + 2) * (pcw_idx)C,
                  u, u + ux, u + 2 * ux, u + 3 * ux, C);
        }
    }
}

/* Scratch floats pcw_input and pcw_output need for blocks of rb rows of tW tiles. */
static inline pcw_idx pcw_scratch_floats(int tW, int rb)
{
    return (pcw_idx)(2 * rb + 2) * (2 * tW + 2) + 16 * (pcw_idx)tW;
}

/* V of every channel of one image x (C, H, W), tile rows ty0..ty1 (at most rb of them).
 *
 * Each channel's input rows of the block are copied once into a zero-padded
 * plane, every row stored as its even and its odd columns (tW + 1 each), so
 * B^T along the rows (into h) reads unit-stride; B^T across the four rows of a
 * tile row then writes V. Margins are cleared once per call. */
static void pcw_input(const float *x, int C, int H, int W, int pad, int ty0, int ty1, int tW,
                      float *V, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const int half = tW + 1;                    /* even (or odd) columns of a padded row */
    const int Wt = 2 * half;                    /* floats of one stored row */
    const int nrows = 2 * (ty1 - ty0) + 2;      /* input rows the block reads */
    const int ih0 = 2 * ty0 - pad;
    float *plane = scratch;                     /* nrows x (even | odd) */
    float *h = scratch + (pcw_idx)nrows * Wt;   /* h[(r * 4 + k) * tW + i]: row r after B^T along it */
    /* padded column j = k + pad holds x[.., k]: the columns of x that land on even / odd slots */
    const int kmax = W < 2 * tW + 2 - pad ? W : 2 * tW + 2 - pad;   /* columns of x the tiles read */
    const int first_even = pad & 1;             /* x column whose padded index is even */
    memset(plane, 0, sizeof(float) * (size_t)nrows * Wt);
    for (int c = 0; c < C; c++) {
        const float *xc = x + (pcw_idx)c * H * W;
        for (int r = 0; r < nrows; r++) {
            const int ih = ih0 + r;
            float *e = plane + (pcw_idx)r * Wt, *o = e + half;
            if (ih < 0 || ih >= H)
                continue;                       /* stays zero: no channel writes it */
            if (kmax <= 0)
                continue;
            const float *xr = xc + (pcw_idx)ih * W;
            /* x[k] goes to e[(k + pad) / 2] when k + pad is even, else o[(k + pad) / 2] */
            if (first_even == 0)
                pcw_split(xr, kmax, e + pad / 2, o + pad / 2);
            else
                pcw_split(xr, kmax, o + pad / 2, e + (pad + 1) / 2);
        }
        for (int ty = ty0; ty < ty1; ty++) {
            const pcw_idx t0 = (pcw_idx)(ty - ty0) * tW + (pcw_idx)c * ldt;
            const float *rows = plane + (pcw_idx)(2 * (ty - ty0)) * Wt;
            for (int r = 0; r < 4; r++) {
                float *hr = h + (pcw_idx)r * 4 * tW;
                const float *e = rows + (pcw_idx)r * Wt;
                pcw_bt_row(e, e + half, hr, hr + tW, hr + 2 * tW, hr + 3 * tW, tW);
            }
            for (int k = 0; k < 4; k++)    /* B^T across the four rows: V[r' * 4 + k] */
                pcw_bt(h + (pcw_idx)(0 * 4 + k) * tW, h + (pcw_idx)(1 * 4 + k) * tW,
                       h + (pcw_idx)(2 * 4 + k) * tW, h + (pcw_idx)(3 * 4 + k) * tW,
                       V + (0 * 4 + k) * ldx + t0, V + (1 * 4 + k) * ldx + t0,
                       V + (2 * 4 + k) * ldx + t0, V + (3 * 4 + k) * ldx + t0, tW);
        }
    }
}

/* y (O, P, Q) of one image, filters o0..o1, tile rows ty0..ty1, from M; bias may be NULL. */
static void pcw_output(const float *M, pcw_idx ldx, pcw_idx ldt, int o0, int o1, int ty0, int ty1,
                       int tW, int P, int Q, const float *bias, float *y, float *scratch)
{
    float *s = scratch;                        /* s[(a * 4 + k) * tW + i]: A^T across rows, a = 0, 1 */
    float *r = scratch + 8 * (pcw_idx)tW;      /* an output row of 2 tW, when Q is odd */
    const int even = Q == 2 * tW;
    for (int o = o0; o < o1; o++) {
        const float bo = bias ? bias[o] : 0.0f;
        for (int ty = ty0; ty < ty1; ty++) {
            const float *m = M + (pcw_idx)o * ldt + (pcw_idx)(ty - ty0) * tW;
            for (int k = 0; k < 4; k++)
                pcw_at(m + (0 * 4 + k) * ldx, m + (1 * 4 + k) * ldx, m + (2 * 4 + k) * ldx,
                       m + (3 * 4 + k) * ldx, s + (pcw_idx)k * tW, s + (pcw_idx)(4 + k) * tW, tW);
            for (int a = 0; a < 2 && 2 * ty + a < P; a++) {
                float *yo = y + ((pcw_idx)o * P + 2 * ty + a) * Q;
                pcw_at_row(s + (pcw_idx)(a * 4) * tW, s + (pcw_idx)(a * 4 + 1) * tW,
                           s + (pcw_idx)(a * 4 + 2) * tW, s + (pcw_idx)(a * 4 + 3) * tW, bo,
                           even ? yo : r, tW);
                if (!even)
                    memcpy(yo, r, sizeof(float) * (size_t)Q);
            }
        }
    }
}

#endif
