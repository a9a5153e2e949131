/* Winograd F(4x4, 3x3) transforms for the stride-1 3x3 convolution (run by the drivers of
 * _conv_winograd.pxi where _conv_winograd4.pxi says so), and the small dU GEMM of its weight gradient.
 *
 * Shape legend as pc_winograd.h. The output is cut into 4x4 tiles, tH = ceil(P/4)
 * rows of tW = ceil(Q/4) tiles; tile (ty, tx) reads the 6x6 input patch whose
 * corner is (4 ty - pad, 4 tx - pad), zeros outside the image.
 *
 * With the 6x6 transforms (Lavin & Gray 2016, interpolation points 0, +-1, +-2, inf)
 *
 *   U = G g G^T   G   = [ 1/4     0     0  ]      B^T = [ 4  0 -5  0  1  0 ]
 *                       [-1/6  -1/6  -1/6  ]            [ 0 -4 -4  1  1  0 ]
 *                       [-1/6   1/6  -1/6  ]            [ 0  4 -4 -1  1  0 ]
 *                       [ 1/24  1/12  1/6  ]            [ 0 -2 -1  2  1  0 ]
 *                       [ 1/24 -1/12  1/6  ]            [ 0  2 -1 -2  1  0 ]
 *                       [ 0     0     1    ]            [ 0  4  0 -5  0  1 ]
 *   V = B^T d B
 *   Y = A^T M A   A^T = [ 1  1  1  1  1  0 ]
 *                       [ 0  1 -1  2 -2  0 ]
 *                       [ 0  1  1  4  4  0 ]
 *                       [ 0  1 -1  8 -8  1 ]
 *
 * each of the 36 points xi is one GEMM over channels, M[xi] (O x tiles) = U[xi] (O x C)
 * @ V[xi] (C x tiles): 4x fewer multiplies than the direct convolution, against
 * F(2x2, 3x3)'s 2.25x, and 2.25 instead of 4 transformed values per output to write and
 * read. The caller runs the GEMMs; the transforms run on vectors of 8 tiles, along a
 * row or, where rows are short, along a block of rows and images, with the same
 * operations in the same order in the scalar tails.
 *
 * Layouts (row-major): U[xi][o][c]; V[xi * ldx + c * ldt + t] and M[xi * ldx + o * ldt + t],
 * t the tile's index in the block (the caller's base plus (ty - ty0) * tW + tx).
 */
#ifndef PARCONV_PC_WINOGRAD4_H
#define PARCONV_PC_WINOGRAD4_H

#include <stddef.h>
#include <string.h>

#include "pc_winograd.h"  /* pcw_idx, pcw_v8 and its loads and stores, pcc_epilogue */

/* B^T applied to six values (one axis of the input transform). */
#define PCW4_BT(T, d0, d1, d2, d3, d4, d5, v)                  \
    do {                                                       \
        const T b14_ = (d1) * 4.0f, b2_ = (d2) * 4.0f;         \
        v[0] = ((d0) * 4.0f - (d2) * 5.0f) + (d4);             \
        v[1] = ((d3) + (d4)) - (b14_ + b2_);                   \
        v[2] = ((d4) - (d3)) + (b14_ - b2_);                   \
        v[3] = ((d4) - (d2)) + ((d3) - (d1)) * 2.0f;           \
        v[4] = ((d4) - (d2)) - ((d3) - (d1)) * 2.0f;           \
        v[5] = (b14_ - (d3) * 5.0f) + (d5);                    \
    } while (0)

/* B^T across the six rows h[r][k] of a patch (already transformed along the rows), stored
 * as V[(r * 6 + k) * ldx + t0]: the second axis of every input transform. */
#define PCW4_BT_ACROSS(T, ST, h, V, ldx, t0)                                                          \
    do {                                                                                              \
        for (int k_ = 0; k_ < 6; k_++) {                                                              \
            T v_[6];                                                                                  \
            PCW4_BT(T, h[0][k_], h[1][k_], h[2][k_], h[3][k_], h[4][k_], h[5][k_], v_);               \
            for (int r_ = 0; r_ < 6; r_++)                                                            \
                ST((V) + (r_ * 6 + k_) * (ldx) + (t0), v_[r_]);                                       \
        }                                                                                             \
    } while (0)

/* V of tiles i0 .. i0 + n of one tile row (n = 1, or 8 as one vector): rows is the
 * tile row's first padded input row, stored as its four column phases (q floats each,
 * Wt = 4 q per row); tile i reads row[4i .. 4i + 5] = p0[i], p1[i], p2[i], p3[i],
 * p0[i + 1], p1[i + 1] of six rows. */
#define PCW4_DEFINE_INPUT_TILES(NAME, T, LD, ST)                                                      \
    static inline void NAME(const float *rows, int Wt, int q, int i0, float *V, pcw_idx ldx)         \
    {                                                                                                 \
        T h[6][6];                                                                                    \
        for (int r = 0; r < 6; r++) {                                                                 \
            const float *p = rows + (pcw_idx)r * Wt + i0;                                             \
            const T d0 = LD(p), d1 = LD(p + q), d2 = LD(p + 2 * q), d3 = LD(p + 3 * q);               \
            const T d4 = LD(p + 1), d5 = LD(p + q + 1);                                               \
            PCW4_BT(T, d0, d1, d2, d3, d4, d5, h[r]);                                                 \
        }                                                                                             \
        PCW4_BT_ACROSS(T, ST, h, V, ldx, i0);                                                         \
    }

PCW4_DEFINE_INPUT_TILES(pcw4_input_tiles8, pcw_v8, pcw_ld8, pcw_st8)
PCW4_DEFINE_INPUT_TILES(pcw4_input_tile1, float, pcw_ld1, pcw_st1)

/* Scratch floats pcw4_filters needs for C channels. */
static inline pcw_idx pcw4_filter_scratch_floats(int C)
{
    return 27 * (pcw_idx)C;
}

/* G applied to three rows: six rows out (the filter transform, one axis). */
static inline void pcw4_g(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                          float *restrict u0, float *restrict u1, float *restrict u2, float *restrict u3,
                          float *restrict u4, float *restrict u5, int n)
{
    for (int i = 0; i < n; i++) {
        const float s = a0[i] + a2[i];
        u0[i] = a0[i] * 0.25f;
        u1[i] = (s + a1[i]) * (-1.0f / 6.0f);
        u2[i] = (s - a1[i]) * (-1.0f / 6.0f);
        u3[i] = (a0[i] * (1.0f / 24.0f) + a2[i] * (1.0f / 6.0f)) + a1[i] * (1.0f / 12.0f);
        u4[i] = (a0[i] * (1.0f / 24.0f) + a2[i] * (1.0f / 6.0f)) - a1[i] * (1.0f / 12.0f);
        u5[i] = a2[i];
    }
}

/* U (36 planes of O x C) for filters o0..o1 of w (O, C, 3, 3). */
static void pcw4_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch)
{
    float *g = scratch;                  /* g[k * C + c] = w[o, c, k]: the 9 taps along channels */
    float *t = scratch + 9 * (pcw_idx)C; /* t[(i * 3 + j) * C + c] = (G g)[i][j], i < 6 */
    const pcw_idx ux = (pcw_idx)O * C;
    for (int o = o0; o < o1; o++) {
        pcw_taps_by_channel(w + (pcw_idx)o * C * 9, C, g);
        for (int j = 0; j < 3; j++)      /* G along the filter rows, each column j */
            pcw4_g(g + j * (pcw_idx)C, g + (3 + j) * (pcw_idx)C, g + (6 + j) * (pcw_idx)C,
                   t + (0 + j) * (pcw_idx)C, t + (3 + j) * (pcw_idx)C, t + (6 + j) * (pcw_idx)C,
                   t + (9 + j) * (pcw_idx)C, t + (12 + j) * (pcw_idx)C, t + (15 + j) * (pcw_idx)C, C);
        for (int i = 0; i < 6; i++) {    /* G along the columns: U[i * 6 + j][o][c] */
            float *u = U + ((pcw_idx)(i * 6) * O + o) * C;
            pcw4_g(t + (i * 3) * (pcw_idx)C, t + (i * 3 + 1) * (pcw_idx)C, t + (i * 3 + 2) * (pcw_idx)C,
                   u, u + ux, u + 2 * ux, u + 3 * ux, u + 4 * ux, u + 5 * ux, C);
        }
    }
}

/* p_k[m] = x[4m + k], k < 4, for m < n: the four column phases of a padded row of 4 n
 * floats. With AVX2, 32 floats at a time by a lane permute and a 4x4 transpose per lane. */
static inline void pcw4_split(const float *restrict x, int n, float *restrict p0, float *restrict p1,
                              float *restrict p2, float *restrict p3)
{
    int m = 0;
#if defined(__AVX2__)
    for (; m + 8 <= n; m += 8) {
        const __m256 a = _mm256_loadu_ps(x + 4 * m), b = _mm256_loadu_ps(x + 4 * m + 8);
        const __m256 c = _mm256_loadu_ps(x + 4 * m + 16), d = _mm256_loadu_ps(x + 4 * m + 24);
        /* lanes: A = x0..3 | x16..19, B = x4..7 | x20..23, C = x8..11 | x24..27, D = x12..15 | x28..31 */
        const __m256 A = _mm256_permute2f128_ps(a, c, 0x20), B = _mm256_permute2f128_ps(a, c, 0x31);
        const __m256 C = _mm256_permute2f128_ps(b, d, 0x20), D = _mm256_permute2f128_ps(b, d, 0x31);
        const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(A, B)), t1 = _mm256_castps_pd(_mm256_unpackhi_ps(A, B));
        const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(C, D)), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(C, D));
        _mm256_storeu_ps(p0 + m, _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)));
        _mm256_storeu_ps(p1 + m, _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2)));
        _mm256_storeu_ps(p2 + m, _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3)));
        _mm256_storeu_ps(p3 + m, _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3)));
    }
#endif
    for (; m < n; m++) {
        p0[m] = x[4 * m];
        p1[m] = x[4 * m + 1];
        p2[m] = x[4 * m + 2];
        p3[m] = x[4 * m + 3];
    }
}

/* Scratch floats pcw4_input and pcw4_output need for blocks of rb rows of tW tiles. */
static inline pcw_idx pcw4_scratch_floats(int tW, int rb)
{
    const pcw_idx plane = (pcw_idx)(4 * rb + 3) * 4 * (tW + 1);   /* and one padded row */
    const pcw_idx out = 24 * (pcw_idx)tW + 4 * (pcw_idx)tW + 8;
    return plane > out ? plane : out;
}

/* V of every channel of one image x (C, H, W), tile rows ty0..ty1, written at tiles
 * t0 + (ty - ty0) * tW + tx of the block.
 *
 * Each channel's input rows of the block are copied once into a zero-padded plane,
 * every row stored as its four column phases (tW + 1 floats each), so a tile's six
 * values in a row are unit-stride loads for 8 tiles at a time. A row goes through one
 * zero-padded row (x's columns at pad ..) on its way. The margins stay zero: no
 * channel writes them. */
static void pcw4_input(const float *x, int C, int H, int W, int pad, int ty0, int ty1, int tW,
                       float *V, pcw_idx ldx, pcw_idx ldt, pcw_idx t0, float *scratch)
{
    const int q = tW + 1;                       /* floats of one phase of a padded row */
    const int Wt = 4 * q;                       /* floats of one stored row */
    const int nrows = 4 * (ty1 - ty0) + 2;      /* input rows the block reads */
    const int ih0 = 4 * ty0 - pad;
    float *plane = scratch;
    float *padded = scratch + (pcw_idx)nrows * Wt;   /* Wt floats: padded column j = k + pad holds x[.., k] */
    const int kmax = W < 4 * tW + 2 - pad ? W : 4 * tW + 2 - pad;   /* columns of x the tiles read */
    memset(plane, 0, sizeof(float) * (size_t)(nrows + 1) * Wt);
    for (int c = 0; c < C; c++) {
        const float *xc = x + (pcw_idx)c * H * W;
        pcw_prefetch_ahead(xc, c, C, H, W, ih0, nrows, kmax);
        for (int r = 0; r < nrows; r++) {
            const int ih = ih0 + r;
            if (ih < 0 || ih >= H || kmax <= 0)
                continue;
            float *row = plane + (pcw_idx)r * Wt;
            memcpy(padded + pad, xc + (pcw_idx)ih * W, sizeof(float) * (size_t)kmax);
            pcw4_split(padded, q, row, row + q, row + 2 * q, row + 3 * q);
        }
        for (int ty = ty0; ty < ty1; ty++) {
            float *vt = V + t0 + (pcw_idx)(ty - ty0) * tW + (pcw_idx)c * ldt;
            const float *rows = plane + (pcw_idx)(4 * (ty - ty0)) * Wt;
            int i = 0;
            for (; i + 8 <= tW; i += 8)
                pcw4_input_tiles8(rows, Wt, q, i, vt, ldx);
            for (; i < tW; i++)
                pcw4_input_tile1(rows, Wt, q, i, vt, ldx);
        }
    }
}

/* V of tiles t0 .. t0 + n (n = 1 or 8) from their six rows of six values gathered in A:
 * A[(r * 6 + k) * lda + t] is value k of row r of tile t's patch. */
#define PCW4_DEFINE_GATHERED_TILES(NAME, T, LD, ST)                                                   \
    static inline void NAME(const float *A, pcw_idx lda, pcw_idx t0, float *V, pcw_idx ldx)           \
    {                                                                                                 \
        T h[6][6];                                                                                    \
        for (int r = 0; r < 6; r++) {                                                                 \
            const float *p = A + (pcw_idx)(r * 6) * lda + t0;                                         \
            const T d0 = LD(p), d1 = LD(p + lda), d2 = LD(p + 2 * lda), d3 = LD(p + 3 * lda);         \
            const T d4 = LD(p + 4 * lda), d5 = LD(p + 5 * lda);                                       \
            PCW4_BT(T, d0, d1, d2, d3, d4, d5, h[r]);                                                 \
        }                                                                                             \
        PCW4_BT_ACROSS(T, ST, h, V, ldx, t0);                                                         \
    }

PCW4_DEFINE_GATHERED_TILES(pcw4_gathered_tiles8, pcw_v8, pcw_ld8, pcw_st8)
PCW4_DEFINE_GATHERED_TILES(pcw4_gathered_tile1, float, pcw_ld1, pcw_st1)

/* Scratch floats pcw4_input_block and pcw4_output_block need for blocks of ipb images
 * of rb rows of tW tiles. */
static inline pcw_idx pcw4_block_scratch_floats(int ipb, int tW, int rb)
{
    const pcw_idx nb = (pcw_idx)ipb * rb * tW + 8;
#if defined(__AVX2__)
    const pcw_idx in = (pcw_idx)ipb * (4 * rb + 2) * (4 * tW + 8) + nb;   /* padded planes, tile offsets */
#else
    const pcw_idx in = 36 * nb;
#endif
    const pcw_idx out = 24 * nb + 4 * nb + 8;
    return in > out ? in : out;
}

#if defined(__AVX2__)
/* The first six columns of the transpose of the 8 x 8 floats in r: c[k] holds element k
 * of every r[i]. */
static inline void pcw4_transpose8x6(const __m256 r[8], __m256 c[6])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
}

/* V of every channel of images n0..n1 of x (N, C, H, W), tile rows ty0..ty1, at tiles
 * t = (n - n0) * (ty1 - ty0) * tW + (ty - ty0) * tW + tx, for rows of fewer than 8 tiles,
 * where pcw4_input's vectors along a row would stay empty; ldt a multiple of 8 (the last
 * vector of tiles is stored whole).
 *
 * Per channel, each image's rows of the block are copied into a zero-padded plane (4 tW + 8
 * floats a row); then for 8 tiles at a time (in block order, across rows and images) each
 * of the six patch rows is eight 8-float loads transposed in registers, and both axes of
 * B^T run on those vectors: no gathered copy of the patches. */
static void pcw4_input_block(const float *x, int n0, int n1, int C, int H, int W, int pad, int ty0, int ty1,
                             int tW, float *V, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const int rows = 4 * (ty1 - ty0) + 2, pitch = 4 * tW + 8;
    const pcw_idx plane = (pcw_idx)rows * pitch;
    const pcw_idx rows_tiles = (pcw_idx)(ty1 - ty0) * tW;
    const pcw_idx nb = (pcw_idx)(n1 - n0) * rows_tiles;
    const pcw_idx HW = (pcw_idx)H * W;
    const int ih0 = 4 * ty0 - pad;
    const int kmax = W < pitch - pad ? W : pitch - pad;
    float *planes = scratch;
    int *off = (int *)(planes + (pcw_idx)(n1 - n0) * plane);   /* tile t's patch: planes + off[t] */
    (void)ldt;
    memset(planes, 0, sizeof(float) * (size_t)((n1 - n0) * plane));
    for (pcw_idx t = 0; t < nb; t++) {
        const pcw_idx n = t / rows_tiles, rt = t - n * rows_tiles;
        const pcw_idx ty = rt / tW, tx = rt - ty * tW;
        off[t] = (int)(n * plane + 4 * ty * pitch + 4 * tx);
    }
    for (pcw_idx t = nb; t < ((nb + 7) & ~(pcw_idx)7); t++)
        off[t] = off[nb - 1];                  /* the last vector repeats its last tile */
    for (int c = 0; c < C; c++) {
        for (int n = n0; n < n1; n++) {
            const float *xc = x + ((pcw_idx)n * C + c) * HW;
            float *pl = planes + (pcw_idx)(n - n0) * plane;
            /* the planes of a block's images are C H W floats apart: no hardware prefetcher
             * follows from one to the next */
            pcw_prefetch_ahead(xc, c, C, H, W, ih0, rows, kmax);
            for (int r = 0; r < rows; r++) {
                const int ih = ih0 + r;
                if (ih >= 0 && ih < H && kmax > 0)   /* other rows stay zero */
                    memcpy(pl + (pcw_idx)r * pitch + pad, xc + (pcw_idx)ih * W, sizeof(float) * (size_t)kmax);
            }
        }
        float *vc = V + (pcw_idx)c * ldt;
        for (pcw_idx t = 0; t < nb; t += 8) {
            pcw_v8 h[6][6];
            for (int r = 0; r < 6; r++) {
                __m256 rr[8], d[6];
                for (int i = 0; i < 8; i++)
                    rr[i] = _mm256_loadu_ps(planes + off[t + i] + (pcw_idx)r * pitch);
                pcw4_transpose8x6(rr, d);
                PCW4_BT(pcw_v8, (pcw_v8)d[0], (pcw_v8)d[1], (pcw_v8)d[2], (pcw_v8)d[3], (pcw_v8)d[4],
                        (pcw_v8)d[5], h[r]);
            }
            PCW4_BT_ACROSS(pcw_v8, pcw_st8, h, vc, ldx, t);
        }
    }
}
#else
/* V of every channel of images n0..n1 of x (N, C, H, W), tile rows ty0..ty1, at tiles
 * (n - n0) * (ty1 - ty0) * tW + (ty - ty0) * tW + tx: for rows of fewer than 8 tiles,
 * where pcw4_input's vectors along a row would stay empty. Every tile's 6x6 patch is
 * gathered along the whole block (A[(r * 6 + k) * nb + t], zeros outside the image), so
 * the transform runs on vectors of 8 tiles whatever the rows. */
static void pcw4_input_block(const float *x, int n0, int n1, int C, int H, int W, int pad, int ty0, int ty1,
                             int tW, float *V, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const pcw_idx rows_tiles = (pcw_idx)(ty1 - ty0) * tW;
    const pcw_idx nb = (pcw_idx)(n1 - n0) * rows_tiles;
    const pcw_idx HW = (pcw_idx)H * W;
    float *A = scratch;
    /* tiles i0 .. i1 of a row read only columns inside the image */
    const int i0 = (pad + 3) / 4;
    int i1 = (W - 6 + pad) >= 0 ? (W - 6 + pad) / 4 + 1 : 0;
    if (i1 > tW)
        i1 = tW;
    if (i1 < i0)
        i1 = i0;
    for (int c = 0; c < C; c++) {
        for (int n = n0; n < n1; n++) {
            const float *xc = x + ((pcw_idx)n * C + c) * HW;
            pcw_prefetch_ahead(xc, c, C, H, W, 4 * ty0 - pad, 4 * (ty1 - ty0) + 2, W);
            for (int ty = ty0; ty < ty1; ty++) {
                const pcw_idx tb = (pcw_idx)(n - n0) * rows_tiles + (pcw_idx)(ty - ty0) * tW;
                for (int r = 0; r < 6; r++) {
                    const int ih = 4 * ty + r - pad;
                    float *a = A + (pcw_idx)(r * 6) * nb + tb;
                    if (ih < 0 || ih >= H) {
                        for (int k = 0; k < 6; k++)
                            for (int i = 0; i < tW; i++)
                                a[k * nb + i] = 0.0f;
                        continue;
                    }
                    const float *xr = xc + (pcw_idx)ih * W;
                    for (int i = 0; i < tW; i++) {
                        if (i >= i0 && i < i1) {
                            const float *p = xr + (4 * i - pad);
                            a[i] = p[0];
                            a[nb + i] = p[1];
                            a[2 * nb + i] = p[2];
                            a[3 * nb + i] = p[3];
                            a[4 * nb + i] = p[4];
                            a[5 * nb + i] = p[5];
                        } else {
                            for (int k = 0; k < 6; k++) {
                                const int j = 4 * i + k - pad;
                                a[k * nb + i] = j >= 0 && j < W ? xr[j] : 0.0f;
                            }
                        }
                    }
                }
            }
        }
        float *vc = V + (pcw_idx)c * ldt;
        pcw_idx t = 0;
        for (; t + 8 <= nb; t += 8)
            pcw4_gathered_tiles8(A, nb, t, vc, ldx);
        for (; t < nb; t++)
            pcw4_gathered_tile1(A, nb, t, vc, ldx);
    }
}

#endif

/* Scratch floats pcw4_input_images needs for blocks of ipb images of rb rows of tW tiles. */
static inline pcw_idx pcw4_input_images_scratch_floats(int ipb, int tW, int rb)
{
    const pcw_idx row = pcw4_scratch_floats(tW, rb), block = pcw4_block_scratch_floats(ipb, tW, rb);
    return row > block ? row : block;
}

/* V of images n0..n1 of x (N, C, H, W), tile rows ty0..ty1, at tiles
 * (n - n0) * (ty1 - ty0) * tW + (ty - ty0) * tW + tx: along each row where rows are whole
 * vectors of 8 tiles (pcw4_input), else along the block (pcw4_input_block). */
static void pcw4_input_images(const float *x, int n0, int n1, int C, int H, int W, int pad, int ty0, int ty1,
                              int tW, float *V, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const pcw_idx rows_tiles = (pcw_idx)(ty1 - ty0) * tW;
    if (tW % 8 != 0) {
        pcw4_input_block(x, n0, n1, C, H, W, pad, ty0, ty1, tW, V, ldx, ldt, scratch);
        return;
    }
    for (int n = n0; n < n1; n++)
        pcw4_input(x + (pcw_idx)n * C * H * W, C, H, W, pad, ty0, ty1, tW, V, ldx, ldt, (n - n0) * rows_tiles,
                   scratch);
}

/* A^T applied to six values (one axis of the output transform). */
#define PCW4_AT(m0, m1, m2, m3, m4, m5, y)                         \
    do {                                                           \
        y[0] = (((m1) + (m2)) + ((m3) + (m4))) + (m0);             \
        y[1] = ((m1) - (m2)) + ((m3) - (m4)) * 2.0f;               \
        y[2] = ((m1) + (m2)) + ((m3) + (m4)) * 4.0f;               \
        y[3] = (((m1) - (m2)) + ((m3) - (m4)) * 8.0f) + (m5);      \
    } while (0)

/* A^T across the six rows of the tiles i0 .. i0 + n of one tile row (n = 1 or 8):
 * s[(a * 6 + k) * tW + i] for the four output rows a and the six columns k. */
#define PCW4_DEFINE_OUTPUT_COLS(NAME, T, LD, ST)                                           \
    static inline void NAME(const float *m, pcw_idx ldx, int i0, float *s, int tW)         \
    {                                                                                      \
        for (int k = 0; k < 6; k++) {                                                      \
            T y[4];                                                                        \
            PCW4_AT(LD(m + (0 * 6 + k) * ldx + i0), LD(m + (1 * 6 + k) * ldx + i0),        \
                    LD(m + (2 * 6 + k) * ldx + i0), LD(m + (3 * 6 + k) * ldx + i0),        \
                    LD(m + (4 * 6 + k) * ldx + i0), LD(m + (5 * 6 + k) * ldx + i0), y);    \
            for (int a = 0; a < 4; a++)                                                    \
                ST(s + (pcw_idx)(a * 6 + k) * tW + i0, y[a]);                              \
        }                                                                                  \
    }

PCW4_DEFINE_OUTPUT_COLS(pcw4_output_cols8, pcw_v8, pcw_ld8, pcw_st8)
PCW4_DEFINE_OUTPUT_COLS(pcw4_output_col1, float, pcw_ld1, pcw_st1)

/* A^T along the tiles of one output row from its six column sums s[k * tW + i], plus the
 * bias: tile i writes r[4i .. 4i + 3]. With AVX2 8 tiles at a time, transposed in
 * registers; the same operations in the same order as the scalar loop. */
static inline void pcw4_at_row(const float *restrict s, int tW, float bias, float *restrict r)
{
    int i = 0;
#if defined(__AVX2__)
    const __m256 vb = _mm256_set1_ps(bias);
    for (; i + 8 <= tW; i += 8) {
        __m256 y[4];
        const __m256 m0 = _mm256_loadu_ps(s + i), m1 = _mm256_loadu_ps(s + tW + i);
        const __m256 m2 = _mm256_loadu_ps(s + 2 * tW + i), m3 = _mm256_loadu_ps(s + 3 * tW + i);
        const __m256 m4 = _mm256_loadu_ps(s + 4 * tW + i), m5 = _mm256_loadu_ps(s + 5 * tW + i);
        const __m256 p12 = _mm256_add_ps(m1, m2), d12 = _mm256_sub_ps(m1, m2);
        const __m256 p34 = _mm256_add_ps(m3, m4), d34 = _mm256_sub_ps(m3, m4);
        y[0] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p12, p34), m0), vb);
        y[1] = _mm256_add_ps(_mm256_add_ps(d12, _mm256_mul_ps(d34, _mm256_set1_ps(2.0f))), vb);
        y[2] = _mm256_add_ps(_mm256_add_ps(p12, _mm256_mul_ps(p34, _mm256_set1_ps(4.0f))), vb);
        y[3] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(d12, _mm256_mul_ps(d34, _mm256_set1_ps(8.0f))), m5), vb);
        /* 4 x 8 transpose: tile i's four values become r[4i .. 4i + 3] */
        const __m256 a = _mm256_unpacklo_ps(y[0], y[1]), b = _mm256_unpackhi_ps(y[0], y[1]);
        const __m256 c = _mm256_unpacklo_ps(y[2], y[3]), d = _mm256_unpackhi_ps(y[2], y[3]);
        const __m256 t0 = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 t1 = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 t2 = _mm256_shuffle_ps(b, d, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 t3 = _mm256_shuffle_ps(b, d, _MM_SHUFFLE(3, 2, 3, 2));
        _mm256_storeu_ps(r + 4 * i, _mm256_permute2f128_ps(t0, t1, 0x20));
        _mm256_storeu_ps(r + 4 * i + 8, _mm256_permute2f128_ps(t2, t3, 0x20));
        _mm256_storeu_ps(r + 4 * i + 16, _mm256_permute2f128_ps(t0, t1, 0x31));
        _mm256_storeu_ps(r + 4 * i + 24, _mm256_permute2f128_ps(t2, t3, 0x31));
    }
#endif
    for (; i < tW; i++) {
        float y[4];
        PCW4_AT(s[i], s[tW + i], s[2 * tW + i], s[3 * tW + i], s[4 * tW + i], s[5 * tW + i], y);
        for (int j = 0; j < 4; j++)
            r[4 * i + j] = y[j] + bias;
    }
}

/* y (O, P, Q) of one image, filters o0..o1, tile rows ty0..ty1, from M at tiles
 * t0 + (ty - ty0) * tW + tx; bias may be NULL. With scale each output is
 * sum * scale[o] + bias[o]; relu then stores max(., 0). */
static void pcw4_output(const float *M, pcw_idx ldx, pcw_idx ldt, pcw_idx t0, int o0, int o1, int ty0,
                        int ty1, int tW, int P, int Q, const float *bias, const float *scale, int relu,
                        float *y, float *scratch)
{
    float *s = scratch;                        /* s[(a * 6 + k) * tW + i] */
    float *r = scratch + 24 * (pcw_idx)tW;     /* an output row of 4 tW, when Q is not 4 tW */
    const int whole = Q == 4 * tW;
    for (int o = o0; o < o1; o++) {
        const float bo = bias && !scale ? bias[o] : 0.0f;
        for (int ty = ty0; ty < ty1; ty++) {
            const float *m = M + t0 + (pcw_idx)o * ldt + (pcw_idx)(ty - ty0) * tW;
            int i = 0;
            for (; i + 8 <= tW; i += 8)
                pcw4_output_cols8(m, ldx, i, s, tW);
            for (; i < tW; i++)
                pcw4_output_col1(m, ldx, i, s, tW);
            for (int a = 0; a < 4 && 4 * ty + a < P; a++) {
                float *yo = y + ((pcw_idx)o * P + 4 * ty + a) * Q;
                pcw4_at_row(s + (pcw_idx)(a * 6) * tW, tW, bo, whole ? yo : r);
                if (!whole)
                    memcpy(yo, r, sizeof(float) * (size_t)Q);
                if (scale || relu)
                    pcc_epilogue(yo, Q, 1, Q, scale ? scale + o : NULL, scale && bias ? bias + o : NULL, relu);
            }
        }
    }
}

/* y (N, O, P, Q) of images n0..n1, filters o0..o1 of O, tile rows ty0..ty1, from M laid out
 * as pcw4_input_block's V (the partner of pcw4_input_block): both transforms run on
 * vectors of 8 tiles along the whole block, then each output row is one copy. */
static void pcw4_output_block(const float *M, pcw_idx ldx, pcw_idx ldt, int n0, int n1, int O, int o0,
                              int o1, int ty0, int ty1, int tW, int P, int Q, const float *bias,
                              const float *scale, int relu, float *y, float *scratch)
{
    const pcw_idx rows_tiles = (pcw_idx)(ty1 - ty0) * tW;
    const pcw_idx nb = (pcw_idx)(n1 - n0) * rows_tiles;
    float *s = scratch;                        /* s[(a * 6 + k) * nb + t] */
    float *R = scratch + 24 * nb;              /* one output row a of every tile: R[4 t + j] */
    for (int o = o0; o < o1; o++) {
        const float bo = bias && !scale ? bias[o] : 0.0f;
        const float *m = M + (pcw_idx)o * ldt;
        pcw_idx t = 0;
        for (; t + 8 <= nb; t += 8)
            pcw4_output_cols8(m, ldx, (int)t, s, (int)nb);
        for (; t < nb; t++)
            pcw4_output_col1(m, ldx, (int)t, s, (int)nb);
        for (int a = 0; a < 4; a++) {
            pcw4_at_row(s + (pcw_idx)(a * 6) * nb, (int)nb, bo, R);
            for (int n = n0; n < n1; n++) {
                for (int ty = ty0; ty < ty1 && 4 * ty + a < P; ty++) {
                    const pcw_idx tb = (pcw_idx)(n - n0) * rows_tiles + (pcw_idx)(ty - ty0) * tW;
                    float *yo = y + (((pcw_idx)n * O + o) * P + 4 * ty + a) * Q;
                    const float *src = R + 4 * tb;
                    for (int j = 0; j < Q; j++)   /* a few floats: a loop, not a call */
                        yo[j] = src[j];
                    if (scale || relu)
                        pcc_epilogue(yo, Q, 1, Q, scale ? scale + o : NULL, scale && bias ? bias + o : NULL, relu);
                }
            }
        }
    }
}

/* ------------------------------------------------------------ weight gradient
 *
 * As pc_winograd.h's: dM = A dY A^T (6x6 from each 4x4 tile of dy, A = (A^T)^T),
 * dU[xi] += dM[xi] V[xi]^T summed over the tiles (36 GEMMs whose depth is the tiles, run
 * by the caller), dg = G^T dU G (3x3 from 6x6, once per filter and channel). */

/* A applied to four values: six out (one axis of the output-gradient transform). */
#define PCW4_A(T, d0, d1, d2, d3, m)                               \
    do {                                                           \
        const T e_ = (d0) + (d2), f_ = (d1) + (d3);                \
        const T g_ = (d0) + (d2) * 4.0f, h_ = (d1) * 2.0f + (d3) * 8.0f; \
        m[0] = (d0);                                               \
        m[1] = e_ + f_;                                            \
        m[2] = e_ - f_;                                            \
        m[3] = g_ + h_;                                            \
        m[4] = g_ - h_;                                            \
        m[5] = (d3);                                               \
    } while (0)

/* Scratch floats pcw4_dy_block needs for blocks of ipb images of rb rows of tW tiles. */
static inline pcw_idx pcw4_dy_scratch_floats(int ipb, int tW, int rb)
{
    const pcw_idx nb8 = (((pcw_idx)ipb * rb * tW + 7) & ~(pcw_idx)7);
    return 16 * nb8 + 4 * (pcw_idx)tW + 8;
}

/* dM of every filter of images n0..n1 of dy (N, O, P, Q), tile rows ty0..ty1, laid out like
 * pcw4_input_block's V: dM[xi * ldx + o * ldt + t], outputs beyond P x Q counting as zero,
 * ldt a multiple of 8 (the last vector of tiles is stored whole, from zeros). Each tile's
 * 4x4 values are split along the whole block (D[(a * 4 + j) * nb8 + t]), then both axes of
 * A run on vectors of 8 tiles. */
static void pcw4_dy_block(const float *dy, int n0, int n1, int O, int P, int Q, int ty0, int ty1, int tW,
                          float *dM, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const pcw_idx rows_tiles = (pcw_idx)(ty1 - ty0) * tW;
    const pcw_idx nb = (pcw_idx)(n1 - n0) * rows_tiles;
    const pcw_idx nb8 = (nb + 7) & ~(pcw_idx)7;
    const pcw_idx PQ = (pcw_idx)P * Q;
    float *D = scratch;
    float *row = scratch + 16 * nb8;           /* a dy row padded with zeros to 4 tW */
    memset(D, 0, sizeof(float) * 16 * (size_t)nb8);
    memset(row, 0, sizeof(float) * 4 * (size_t)tW);
    for (int o = 0; o < O; o++) {
        for (int n = n0; n < n1; n++) {
            const float *dyo = dy + ((pcw_idx)n * O + o) * PQ;
            pcw_prefetch_ahead(dyo, o, O, P, Q, 4 * ty0, 4 * (ty1 - ty0), Q);
            for (int ty = ty0; ty < ty1; ty++) {
                const pcw_idx tb = (pcw_idx)(n - n0) * rows_tiles + (pcw_idx)(ty - ty0) * tW;
                for (int a = 0; a < 4; a++) {
                    float *d = D + (pcw_idx)(a * 4) * nb8 + tb;
                    if (4 * ty + a < P) {
                        memcpy(row, dyo + (pcw_idx)(4 * ty + a) * Q, sizeof(float) * (size_t)Q);
                        pcw4_split(row, tW, d, d + nb8, d + 2 * nb8, d + 3 * nb8);
                    } else {
                        for (int j = 0; j < 4; j++)
                            memset(d + j * nb8, 0, sizeof(float) * (size_t)tW);
                    }
                }
            }
        }
        float *m = dM + (pcw_idx)o * ldt;
        for (pcw_idx t = 0; t < nb8; t += 8) {
            pcw_v8 h[4][6];
            for (int a = 0; a < 4; a++) {
                const float *d = D + (pcw_idx)(a * 4) * nb8 + t;
                PCW4_A(pcw_v8, pcw_ld8(d), pcw_ld8(d + nb8), pcw_ld8(d + 2 * nb8), pcw_ld8(d + 3 * nb8), h[a]);
            }
            for (int k = 0; k < 6; k++) {
                pcw_v8 v[6];
                PCW4_A(pcw_v8, h[0][k], h[1][k], h[2][k], h[3][k], v);
                for (int r = 0; r < 6; r++)
                    pcw_st8(m + (r * 6 + k) * ldx + t, v[r]);
            }
        }
    }
}

/* G^T applied to six rows (the weight-gradient back-transform, one axis): three rows out. */
static inline void pcw4_gt(const float *restrict u0, const float *restrict u1, const float *restrict u2,
                           const float *restrict u3, const float *restrict u4, const float *restrict u5,
                           float *restrict w0, float *restrict w1, float *restrict w2, int n)
{
    for (int i = 0; i < n; i++) {
        const float s12 = u1[i] + u2[i], s34 = u3[i] + u4[i];
        w0[i] = (u0[i] * 0.25f - s12 * (1.0f / 6.0f)) + s34 * (1.0f / 24.0f);
        w1[i] = (u2[i] - u1[i]) * (1.0f / 6.0f) + (u3[i] - u4[i]) * (1.0f / 12.0f);
        w2[i] = (s34 - s12) * (1.0f / 6.0f) + u5[i];
    }
}

/* Scratch floats pcw4_filters_grad needs for C channels. */
static inline pcw_idx pcw4_filters_grad_scratch_floats(int C)
{
    return 27 * (pcw_idx)C;
}

/* dw (O, C, 3, 3), filters o0..o1, from dU[xi][o][c] (36 O C floats). */
static void pcw4_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch)
{
    float *t = scratch;                    /* t[(r * 3 + j) * C + c] = (dU G)[r][j], r < 6 */
    float *g = scratch + 18 * (pcw_idx)C;  /* g[(i * 3 + j) * C + c] = (G^T dU G)[i][j] */
    const pcw_idx ux = (pcw_idx)O * C;
    for (int o = o0; o < o1; o++) {
        const float *u = dU + (pcw_idx)o * C;
        for (int r = 0; r < 6; r++)        /* G along each row r of dU: columns 0..5 -> j = 0..2 */
            pcw4_gt(u + (pcw_idx)(r * 6 + 0) * ux, u + (pcw_idx)(r * 6 + 1) * ux, u + (pcw_idx)(r * 6 + 2) * ux,
                    u + (pcw_idx)(r * 6 + 3) * ux, u + (pcw_idx)(r * 6 + 4) * ux, u + (pcw_idx)(r * 6 + 5) * ux,
                    t + (r * 3 + 0) * (pcw_idx)C, t + (r * 3 + 1) * (pcw_idx)C, t + (r * 3 + 2) * (pcw_idx)C, C);
        for (int j = 0; j < 3; j++)        /* G^T across the rows */
            pcw4_gt(t + (0 * 3 + j) * (pcw_idx)C, t + (1 * 3 + j) * (pcw_idx)C, t + (2 * 3 + j) * (pcw_idx)C,
                    t + (3 * 3 + j) * (pcw_idx)C, t + (4 * 3 + j) * (pcw_idx)C, t + (5 * 3 + j) * (pcw_idx)C,
                    g + (0 * 3 + j) * (pcw_idx)C, g + (1 * 3 + j) * (pcw_idx)C, g + (2 * 3 + j) * (pcw_idx)C, C);
        pcw_taps_to_filter(g, C, dw + (pcw_idx)o * C * 9);
    }
}

/* Cout[o * ldc + c] = (beta ? Cout : 0) + sum_k A[o * lda + k] B[c * ldb + k] for o < O,
 * c < C, k < K: the weight gradient's dU[xi] += dM[xi] V[xi]^T, whose
 * operands both run along the tiles. Blocks of 3 rows of A by 4 rows of B keep 12 vector
 * sums in registers over the whole depth, each added up across its lanes in a fixed
 * order at the end: for small products (the caller's WINOGRAD4_DW_DOT_MAX_OC), where a
 * BLAS sgemm spends more time packing both operands than multiplying. */
static void pcw4_dot_gemm(int O, int C, pcw_idx K, const float *A, pcw_idx lda, const float *B, pcw_idx ldb,
                          float *Cout, pcw_idx ldc, int beta)
{
#if defined(__AVX512F__)
    /* 4 x 4 blocks of 16-lane sums: 16 of the 32 registers, 8 loads per 16 FMAs. The last
     * partial vector of the depth is a masked load (zeros add nothing), so every sum takes
     * the same path; the lanes are added in a fixed tree at the end. */
    const pcw_idx K16 = K & ~(pcw_idx)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
    for (int o0 = 0; o0 < O; o0 += 4) {
        const int mo = O - o0 < 4 ? O - o0 : 4;
        for (int c0 = 0; c0 < C; c0 += 4) {
            const int mc = C - c0 < 4 ? C - c0 : 4;
            __m512 acc[4][4];
            const float *a[4], *b[4];
            for (int i = 0; i < 4; i++) {
                a[i] = A + (pcw_idx)(o0 + (i < mo ? i : 0)) * lda;
                b[i] = B + (pcw_idx)(c0 + (i < mc ? i : 0)) * ldb;
                for (int j = 0; j < 4; j++)
                    acc[i][j] = _mm512_setzero_ps();
            }
            for (pcw_idx k = 0; k < K16; k += 16) {
                const __m512 a0 = _mm512_loadu_ps(a[0] + k), a1 = _mm512_loadu_ps(a[1] + k);
                const __m512 a2 = _mm512_loadu_ps(a[2] + k), a3 = _mm512_loadu_ps(a[3] + k);
                for (int j = 0; j < 4; j++) {
                    const __m512 bj = _mm512_loadu_ps(b[j] + k);
                    acc[0][j] = _mm512_fmadd_ps(a0, bj, acc[0][j]);
                    acc[1][j] = _mm512_fmadd_ps(a1, bj, acc[1][j]);
                    acc[2][j] = _mm512_fmadd_ps(a2, bj, acc[2][j]);
                    acc[3][j] = _mm512_fmadd_ps(a3, bj, acc[3][j]);
                }
            }
            if (tail) {
                const __m512 a0 = _mm512_maskz_loadu_ps(tail, a[0] + K16), a1 = _mm512_maskz_loadu_ps(tail, a[1] + K16);
                const __m512 a2 = _mm512_maskz_loadu_ps(tail, a[2] + K16), a3 = _mm512_maskz_loadu_ps(tail, a[3] + K16);
                for (int j = 0; j < 4; j++) {
                    const __m512 bj = _mm512_maskz_loadu_ps(tail, b[j] + K16);
                    acc[0][j] = _mm512_fmadd_ps(a0, bj, acc[0][j]);
                    acc[1][j] = _mm512_fmadd_ps(a1, bj, acc[1][j]);
                    acc[2][j] = _mm512_fmadd_ps(a2, bj, acc[2][j]);
                    acc[3][j] = _mm512_fmadd_ps(a3, bj, acc[3][j]);
                }
            }
            for (int i = 0; i < mo; i++)
                for (int j = 0; j < mc; j++) {
                    float l[16];
                    _mm512_storeu_ps(l, acc[i][j]);
                    const float sum = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])))
                                      + (((l[8] + l[9]) + (l[10] + l[11])) + ((l[12] + l[13]) + (l[14] + l[15])));
                    float *out = Cout + (pcw_idx)(o0 + i) * ldc + c0 + j;
                    *out = beta ? *out + sum : sum;
                }
        }
    }
#else
    int o0 = 0;
    for (; o0 < O; o0 += 3) {
        const int mo = O - o0 < 3 ? O - o0 : 3;
        for (int c0 = 0; c0 < C; c0 += 4) {
            const int mc = C - c0 < 4 ? C - c0 : 4;
            pcw_v8 acc[3][4];
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 4; j++)
                    acc[i][j] = (pcw_v8){0};
            const float *a[3], *b[4];
            for (int i = 0; i < 3; i++)
                a[i] = A + (pcw_idx)(o0 + (i < mo ? i : 0)) * lda;
            for (int j = 0; j < 4; j++)
                b[j] = B + (pcw_idx)(c0 + (j < mc ? j : 0)) * ldb;
            const pcw_idx K8 = K & ~(pcw_idx)7;   /* whole vectors; the rest below, one by one */
            for (pcw_idx k = 0; k < K8; k += 8) {
                const pcw_v8 a0 = pcw_ld8(a[0] + k), a1 = pcw_ld8(a[1] + k), a2 = pcw_ld8(a[2] + k);
                for (int j = 0; j < 4; j++) {
                    const pcw_v8 bj = pcw_ld8(b[j] + k);
#if defined(__FMA__) && defined(__AVX2__)
                    acc[0][j] = (pcw_v8)_mm256_fmadd_ps((__m256)a0, (__m256)bj, (__m256)acc[0][j]);
                    acc[1][j] = (pcw_v8)_mm256_fmadd_ps((__m256)a1, (__m256)bj, (__m256)acc[1][j]);
                    acc[2][j] = (pcw_v8)_mm256_fmadd_ps((__m256)a2, (__m256)bj, (__m256)acc[2][j]);
#else
                    acc[0][j] += a0 * bj;
                    acc[1][j] += a1 * bj;
                    acc[2][j] += a2 * bj;
#endif
                }
            }
            for (int i = 0; i < mo; i++)
                for (int j = 0; j < mc; j++) {
                    float l[8];
                    memcpy(l, &acc[i][j], sizeof l);
                    float sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
                    for (pcw_idx k = K8; k < K; k++)
                        sum += a[i][k] * b[j][k];
                    float *out = Cout + (pcw_idx)(o0 + i) * ldc + c0 + j;
                    *out = beta ? *out + sum : sum;
                }
        }
    }
#endif
}

#endif
