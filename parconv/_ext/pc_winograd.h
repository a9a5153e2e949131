/* Winograd F(2x2, 3x3) transforms for the stride-1 3x3 convolution (_conv_winograd.pxi).
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

#include "pc_conv.h"  /* pcc_epilogue: the folded batch norm, as the direct kernels apply it */

typedef ptrdiff_t pcw_idx;

/* Scratch that outlives a call: each thread keeps its largest buffer per slot.
 *
 * The Winograd drivers need a few MB per call (transformed blocks, partial sums). glibc
 * maps such blocks fresh or trims them back to the system on free whenever their sizes
 * fall just so against its adaptive mmap and trim thresholds, and then every call faults
 * in and zeroes each page again.
 * Buffers up to PCW_SCRATCH_MAX bytes are kept, per thread and slot, until the thread
 * ends; larger ones are malloc'd and freed as before. */
#include <pthread.h>
#include <stdlib.h>

#define PCW_SCRATCH_SLOTS 4
#define PCW_SCRATCH_MAX ((size_t)16 << 20)

typedef struct {
    void *p[PCW_SCRATCH_SLOTS];
    size_t n[PCW_SCRATCH_SLOTS];
} pcw_scratch_cache;

static pthread_key_t pcw_scratch_key;
static pthread_once_t pcw_scratch_once = PTHREAD_ONCE_INIT;
static int pcw_scratch_ok;

static inline void pcw_scratch_drop(void *v)
{
    pcw_scratch_cache *s = (pcw_scratch_cache *)v;
    for (int i = 0; i < PCW_SCRATCH_SLOTS; i++)
        free(s->p[i]);
    free(s);
}

static inline void pcw_scratch_init(void)
{
    pcw_scratch_ok = pthread_key_create(&pcw_scratch_key, pcw_scratch_drop) == 0;
}

static inline pcw_scratch_cache *pcw_scratch_mine(int create)
{
    pthread_once(&pcw_scratch_once, pcw_scratch_init);
    if (!pcw_scratch_ok)
        return NULL;
    pcw_scratch_cache *s = (pcw_scratch_cache *)pthread_getspecific(pcw_scratch_key);
    if (s == NULL && create) {
        s = (pcw_scratch_cache *)calloc(1, sizeof *s);
        if (s != NULL && pthread_setspecific(pcw_scratch_key, s) != 0) {
            free(s);
            s = NULL;
        }
    }
    return s;
}

/* bytes of scratch (uninitialised) for slot of this thread; NULL when out of memory. Give
 * it back with pcw_scratch_release before the thread asks for the slot again. */
static inline void *pcw_scratch_get(int slot, size_t bytes)
{
    pcw_scratch_cache *s = bytes <= PCW_SCRATCH_MAX ? pcw_scratch_mine(1) : NULL;
    if (s == NULL)
        return malloc(bytes > 0 ? bytes : 1);
    if (s->n[slot] < bytes) {
        free(s->p[slot]);
        s->p[slot] = malloc(bytes > 0 ? bytes : 1);
        s->n[slot] = s->p[slot] != NULL ? bytes : 0;
    }
    return s->p[slot];
}

static inline void pcw_scratch_release(int slot, void *p)
{
    pcw_scratch_cache *s = pcw_scratch_mine(0);
    if (p != NULL && (s == NULL || s->p[slot] != p))
        free(p);
}

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

/* B^T d B of the tiles i0 .. i0 + n of one tile row, n = 1 (float) or 16 (a vector of
 * 16 tiles): rows is the tile row's first padded input row, stored as even | odd
 * columns (half floats each, Wt per row); tile i reads row[2i .. 2i + 3] = e[i],
 * o[i], e[i + 1], o[i + 1] of four rows. B^T along each row gives h[r][k], B^T
 * across the rows V[r' * 4 + k]: the same operations in the same order for both
 * widths, all in registers. */
#define PCW_DEFINE_INPUT_TILES(NAME, T, LD, ST)                                                       \
    static inline void NAME(const float *rows, int Wt, int half, int i0, float *V, pcw_idx ldx)      \
    {                                                                                                 \
        T h[4][4];                                                                                    \
        for (int r = 0; r < 4; r++) {                                                                 \
            const float *e = rows + (pcw_idx)r * Wt + i0, *o = e + half;                              \
            const T d0 = LD(e), d1 = LD(o), d2 = LD(e + 1), d3 = LD(o + 1);                           \
            h[r][0] = d0 - d2;                                                                        \
            h[r][1] = d1 + d2;                                                                        \
            h[r][2] = d2 - d1;                                                                        \
            h[r][3] = d1 - d3;                                                                        \
        }                                                                                             \
        for (int k = 0; k < 4; k++) {                                                                 \
            ST(V + (0 * 4 + k) * ldx + i0, h[0][k] - h[2][k]);                                       \
            ST(V + (1 * 4 + k) * ldx + i0, h[1][k] + h[2][k]);                                       \
            ST(V + (2 * 4 + k) * ldx + i0, h[2][k] - h[1][k]);                                       \
            ST(V + (3 * 4 + k) * ldx + i0, h[1][k] - h[3][k]);                                       \
        }                                                                                             \
    }

/* 16 floats as one value: GCC/clang lower it to AVX-512, pairs of AVX registers or
 * narrower, whatever the target has */
typedef float pcw_v16 __attribute__((vector_size(64)));
static inline pcw_v16 pcw_ld16(const float *p) { pcw_v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void pcw_st16(float *p, pcw_v16 v) { memcpy(p, &v, sizeof v); }
typedef float pcw_v8 __attribute__((vector_size(32)));
static inline pcw_v8 pcw_ld8(const float *p) { pcw_v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void pcw_st8(float *p, pcw_v8 v) { memcpy(p, &v, sizeof v); }
static inline float pcw_ld1(const float *p) { return *p; }
static inline void pcw_st1(float *p, float v) { *p = v; }
PCW_DEFINE_INPUT_TILES(pcw_input_tiles16, pcw_v16, pcw_ld16, pcw_st16)
PCW_DEFINE_INPUT_TILES(pcw_input_tiles8, pcw_v8, pcw_ld8, pcw_st8)
PCW_DEFINE_INPUT_TILES(pcw_input_tile1, float, pcw_ld1, pcw_st1)

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* a[m] = x[2m], b[m] = x[2m + 1]: the even and odd elements of x[0..n). Compilers
 * leave this strided loop scalar, so with AVX-512 two permutes split 32 floats at a
 * time, with AVX2 two shuffles and two lane permutes 16 (the tail stays scalar). */
static inline void pcw_split(const float *restrict x, int n, float *restrict a, float *restrict b)
{
    int m = 0;
#if defined(__AVX512F__)
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (; 2 * m + 32 <= n; m += 16) {
        const __m512 lo = _mm512_loadu_ps(x + 2 * m), hi = _mm512_loadu_ps(x + 2 * m + 16);
        _mm512_storeu_ps(a + m, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(b + m, _mm512_permutex2var_ps(lo, odd, hi));
    }
#elif defined(__AVX2__)
    for (; 2 * m + 16 <= n; m += 8) {
        const __m256 lo = _mm256_loadu_ps(x + 2 * m), hi = _mm256_loadu_ps(x + 2 * m + 8);
        /* per 128-bit lane: lo's evens then hi's evens; the 64-bit permute puts lo's first */
        const __m256 ev = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 od = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(a + m, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xd8)));
        _mm256_storeu_ps(b + m, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xd8)));
    }
#endif
    for (; m < n / 2; m++) {
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

/* A^T along the tiles of one output row, plus the bias: tile i writes r[2i], r[2i+1].
 * With AVX-512 16 tiles at a time, interleaved by two permutes (AVX2: 8 tiles, two
 * unpacks and two lane permutes); the same
 * operations in the same order as the scalar loop, so the same bits. */
static inline void pcw_at_row(const float *restrict s0, const float *restrict s1, const float *restrict s2,
                              const float *restrict s3, float bias, float *restrict r, int n)
{
    int i = 0;
#if defined(__AVX512F__)
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 vb = _mm512_set1_ps(bias);
    for (; i + 16 <= n; i += 16) {
        const __m512 a0 = _mm512_loadu_ps(s0 + i), a1 = _mm512_loadu_ps(s1 + i);
        const __m512 a2 = _mm512_loadu_ps(s2 + i), a3 = _mm512_loadu_ps(s3 + i);
        const __m512 ev = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), a2), vb);
        const __m512 od = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(a1, a2), a3), vb);
        _mm512_storeu_ps(r + 2 * i, _mm512_permutex2var_ps(ev, first, od));
        _mm512_storeu_ps(r + 2 * i + 16, _mm512_permutex2var_ps(ev, second, od));
    }
#elif defined(__AVX2__)
    const __m256 vb = _mm256_set1_ps(bias);
    for (; i + 8 <= n; i += 8) {
        const __m256 a0 = _mm256_loadu_ps(s0 + i), a1 = _mm256_loadu_ps(s1 + i);
        const __m256 a2 = _mm256_loadu_ps(s2 + i), a3 = _mm256_loadu_ps(s3 + i);
        const __m256 ev = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), vb);
        const __m256 od = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(a1, a2), a3), vb);
        const __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);
        _mm256_storeu_ps(r + 2 * i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(r + 2 * i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
#endif
    for (; i < n; i++) {
        r[2 * i] = ((s0[i] + s1[i]) + s2[i]) + bias;
        r[2 * i + 1] = ((s1[i] - s2[i]) - s3[i]) + bias;
    }
}

/* g[k * C + c] = wo[c * 9 + k]: one filter's 9 taps along its C channels (filter transforms). */
static inline void pcw_taps_by_channel(const float *wo, int C, float *g)
{
    for (int c = 0; c < C; c++)
        for (int k = 0; k < 9; k++)
            g[k * (pcw_idx)C + c] = wo[(pcw_idx)c * 9 + k];
}

/* wo[c * 9 + k] = g[k * C + c]: the inverse of pcw_taps_by_channel (weight gradients). */
static inline void pcw_taps_to_filter(const float *g, int C, float *wo)
{
    for (int c = 0; c < C; c++)
        for (int k = 0; k < 9; k++)
            wo[(pcw_idx)c * 9 + k] = g[k * (pcw_idx)C + c];
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
        pcw_taps_by_channel(w + (pcw_idx)o * C * 9, C, g);
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
    return (pcw_idx)(2 * rb + 2) * (2 * tW + 2) + 10 * (pcw_idx)tW;
}

/* How many channels ahead pcw_input prefetches. A block reads a few rows of each channel
 * plane, the planes H W floats apart: the hardware prefetchers do not follow that, so
 * without it every channel waits on DRAM (measurements: docs/performance-internals.md). */
#ifndef PCW_PREFETCH_CHANNELS
#define PCW_PREFETCH_CHANNELS 4
#endif

/* Prefetch rows ih0 .. ih0 + nrows (those inside the plane), kmax floats each, of plane xc (H, W). */
static inline void pcw_prefetch_rows(const float *xc, int H, int W, int ih0, int nrows, int kmax)
{
    for (int r = 0; r < nrows; r++) {
        const int ih = ih0 + r;
        if (ih < 0 || ih >= H)
            continue;
        const char *a = (const char *)(xc + (pcw_idx)ih * W);
        for (pcw_idx k = 0; k < (pcw_idx)kmax * 4; k += 64)
            __builtin_prefetch(a + k, 0, 3);
        __builtin_prefetch(a + (pcw_idx)kmax * 4 - 1, 0, 3);
    }
}

/* Prefetch the rows ih0 .. ih0 + nrows of the channel PCW_PREFETCH_CHANNELS after c of an
 * image's planes (xc: channel c's plane), while the input transforms work on channel c. */
static inline void pcw_prefetch_ahead(const float *xc, int c, int C, int H, int W, int ih0, int nrows, int kmax)
{
    if (c + PCW_PREFETCH_CHANNELS < C && kmax > 0)
        pcw_prefetch_rows(xc + (pcw_idx)PCW_PREFETCH_CHANNELS * H * W, H, W, ih0, nrows, kmax);
}

/* V of every channel of one image x (C, H, W), tile rows ty0..ty1 (at most rb of them).
 *
 * Each channel's input rows of the block are copied once into a zero-padded
 * plane, every row stored as its even and its odd columns (tW + 1 each), so
 * the four values of a tile in a row are unit-stride loads for 16 (8) tiles at
 * a time; B^T along and across the rows stays in registers until V is written.
 * Margins are cleared once per call. */
static void pcw_input(const float *x, int C, int H, int W, int pad, int ty0, int ty1, int tW,
                      float *V, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    const int half = tW + 1;                    /* even (or odd) columns of a padded row */
    const int Wt = 2 * half;                    /* floats of one stored row */
    const int nrows = 2 * (ty1 - ty0) + 2;      /* input rows the block reads */
    const int ih0 = 2 * ty0 - pad;
    float *plane = scratch;                     /* nrows x (even | odd) */
    /* padded column j = k + pad holds x[.., k]: the columns of x that land on even / odd slots */
    const int kmax = W < 2 * tW + 2 - pad ? W : 2 * tW + 2 - pad;   /* columns of x the tiles read */
    const int first_even = pad & 1;             /* x column whose padded index is even */
    memset(plane, 0, sizeof(float) * (size_t)nrows * Wt);
    for (int c = 0; c < C; c++) {
        const float *xc = x + (pcw_idx)c * H * W;
        pcw_prefetch_ahead(xc, c, C, H, W, ih0, nrows, kmax);
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
            int i = 0;
            for (; i + 16 <= tW; i += 16)
                pcw_input_tiles16(rows, Wt, half, i, V + t0, ldx);
            for (; i + 8 <= tW; i += 8)
                pcw_input_tiles8(rows, Wt, half, i, V + t0, ldx);
            for (; i < tW; i++)
                pcw_input_tile1(rows, Wt, half, i, V + t0, ldx);
        }
    }
}

/* y (O, P, Q) of one image, filters o0..o1, tile rows ty0..ty1, from M; bias may be NULL.
 * With scale each output is sum * scale[o] + bias[o]; relu then stores max(., 0). */
static void pcw_output(const float *M, pcw_idx ldx, pcw_idx ldt, int o0, int o1, int ty0, int ty1,
                       int tW, int P, int Q, const float *bias, const float *scale, int relu, float *y,
                       float *scratch)
{
    float *s = scratch;                        /* s[(a * 4 + k) * tW + i]: A^T across rows, a = 0, 1 */
    float *r = scratch + 8 * (pcw_idx)tW;      /* an output row of 2 tW, when Q is odd */
    const int even = Q == 2 * tW;
    for (int o = o0; o < o1; o++) {
        const float bo = bias && !scale ? bias[o] : 0.0f;
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
                if (scale || relu)
                    pcc_epilogue(yo, Q, 1, Q, scale ? scale + o : NULL, scale && bias ? bias + o : NULL, relu);
            }
        }
    }
}

/* ------------------------------------------------------------ weight gradient
 *
 * With M = U (.) V per transform point (the forward), the gradients of one tile are
 *
 *   dM = A dY A^T        (4x4 from the 2x2 output gradient, A = (A^T)^T)
 *   dU[xi] += dM[xi] V[xi]^T     summed over tiles: 16 GEMMs whose depth is the tiles
 *   dg = G^T dU G        (3x3 from 4x4, once per filter and channel at the end)
 *
 * 2.25x fewer multiplies than the direct weight gradient, as in the forward. */

/* dM of every filter of one image's dy (O, P, Q), tile rows ty0..ty1, laid out like M:
 * dM[xi * ldx + o * ldt + t]. Outputs beyond P x Q count as zero. scratch: 4 tW floats. */
static void pcw_dy(const float *dy, int O, int P, int Q, int ty0, int ty1, int tW,
                   float *dM, pcw_idx ldx, pcw_idx ldt, float *scratch)
{
    float *e0 = scratch, *o0 = scratch + tW, *e1 = scratch + 2 * (pcw_idx)tW, *o1 = scratch + 3 * (pcw_idx)tW;
    for (int o = 0; o < O; o++) {
        const float *dyo = dy + (pcw_idx)o * P * Q;
        for (int ty = ty0; ty < ty1; ty++) {
            const int r0 = 2 * ty, r1 = 2 * ty + 1;
            /* the two output rows of the tile row as even | odd columns, zero beyond P x Q:
             * pcw_split fills all tW even columns and Q / 2 odd ones */
            pcw_split(dyo + (pcw_idx)r0 * Q, Q, e0, o0);
            if (r1 < P)
                pcw_split(dyo + (pcw_idx)r1 * Q, Q, e1, o1);
            else
                memset(e1, 0, sizeof(float) * 2 * (size_t)tW);
            if (Q & 1)
                o0[tW - 1] = o1[tW - 1] = 0.0f;
            float *m = dM + (pcw_idx)o * ldt + (pcw_idx)(ty - ty0) * tW;
            for (int i = 0; i < tW; i++) {
                const float a0 = e0[i], a1 = o0[i], b0 = e1[i], b1 = o1[i];
                /* A along each row: h[r] = (d0, d0 + d1, d0 - d1, -d1) */
                const float h0[4] = {a0, a0 + a1, a0 - a1, -a1};
                const float h1[4] = {b0, b0 + b1, b0 - b1, -b1};
                for (int k = 0; k < 4; k++) {   /* A across the rows */
                    m[(0 * 4 + k) * ldx + i] = h0[k];
                    m[(1 * 4 + k) * ldx + i] = h0[k] + h1[k];
                    m[(2 * 4 + k) * ldx + i] = h0[k] - h1[k];
                    m[(3 * 4 + k) * ldx + i] = -h1[k];
                }
            }
        }
    }
}

/* G^T applied to four rows (the weight-gradient back-transform, one axis): three rows out. */
static inline void pcw_gt(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                          const float *restrict a3, float *restrict u0, float *restrict u1, float *restrict u2, int n)
{
    for (int i = 0; i < n; i++) {
        u0[i] = a0[i] + 0.5f * (a1[i] + a2[i]);
        u1[i] = 0.5f * (a1[i] - a2[i]);
        u2[i] = 0.5f * (a1[i] + a2[i]) + a3[i];
    }
}

/* dw (O, C, 3, 3), filters o0..o1, from dU[xi][o][c] (16 O C floats). scratch: 21 C floats
 * (pcw_filter_scratch_floats). */
static void pcw_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch)
{
    float *t = scratch;                  /* t[(k' * 3 + j) * C + c] = (dU G)[k'][j] */
    float *g = scratch + 12 * (pcw_idx)C;  /* g[(i * 3 + j) * C + c] = (G^T dU G)[i][j] */
    const pcw_idx ux = (pcw_idx)O * C;
    for (int o = o0; o < o1; o++) {
        const float *u = dU + (pcw_idx)o * C;
        for (int k = 0; k < 4; k++)      /* G along each row k' of dU: columns 0..3 -> j = 0..2 */
            pcw_gt(u + (pcw_idx)(k * 4 + 0) * ux, u + (pcw_idx)(k * 4 + 1) * ux, u + (pcw_idx)(k * 4 + 2) * ux,
                   u + (pcw_idx)(k * 4 + 3) * ux, t + (k * 3 + 0) * (pcw_idx)C, t + (k * 3 + 1) * (pcw_idx)C,
                   t + (k * 3 + 2) * (pcw_idx)C, C);
        for (int j = 0; j < 3; j++)      /* G^T across the rows */
            pcw_gt(t + (0 * 3 + j) * (pcw_idx)C, t + (1 * 3 + j) * (pcw_idx)C, t + (2 * 3 + j) * (pcw_idx)C,
                   t + (3 * 3 + j) * (pcw_idx)C, g + (0 * 3 + j) * (pcw_idx)C, g + (1 * 3 + j) * (pcw_idx)C,
                   g + (2 * 3 + j) * (pcw_idx)C, C);
        pcw_taps_to_filter(g, C, dw + (pcw_idx)o * C * 9);
    }
}

#endif
