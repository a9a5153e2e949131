/* Register-blocked convolution micro-kernels (implicit GEMM) for _conv.pyx.
 *
 * Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
 * K kernel, S stride. kdim = C*K*K is the GEMM depth, one k = (c, kh, kw).
 *
 * The product is y[o, s] = sum_k w[o, k] * B(k, s) over output positions s.
 * B is never materialised as a matrix: B(k, s) = base[off[k] + s] through a
 * table of k offsets, which covers two layouts:
 *
 *  - stride 1, "wide grid": base is the zero-padded image (C, Hp, Wp) and s
 *    runs over p*Wp + q, q < Wp, so the input of tap (c, kh, kw) for output s
 *    is base[c*Hp*Wp + kh*Wp + kw + s]: a shifted view, no im2col at all. The
 *    Wp - Q columns per row that wrap around are computed and thrown away.
 *  - any stride: base is an im2col tile (kdim, ldb) and off[k] = k*ldb.
 *
 * Weights are packed once per call into blocks of MR filters, k-major
 * ([k][MR]), so the micro-kernel reads MR consecutive floats per k and
 * broadcasts each; it keeps MR x NR sums in registers (NR = NV vectors of
 * spatial positions) for the whole k loop and writes them once.
 *
 * FMAs are explicit intrinsics: setup.py builds with -ffp-contract=off so
 * elementwise kernels round like NumPy, which would otherwise forbid FMA here.
 */
#ifndef PARCONV_PC_CONV_H
#define PARCONV_PC_CONV_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef ptrdiff_t pcc_idx;

#if defined(__AVX512F__)
#include <immintrin.h>
#define PCC_VEC 16
#define PCC_NV 3
#define PCC_MR 8
typedef __m512 pcc_v;
#define PCC_ZERO() _mm512_setzero_ps()
#define PCC_LOADU(p) _mm512_loadu_ps(p)
#define PCC_SET1(x) _mm512_set1_ps(x)
#define PCC_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define PCC_STOREU(p, v) _mm512_storeu_ps((p), (v))
#define PCC_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PCC_VEC 8
#define PCC_NV 2
#define PCC_MR 6
typedef __m256 pcc_v;
#define PCC_ZERO() _mm256_setzero_ps()
#define PCC_LOADU(p) _mm256_loadu_ps(p)
#define PCC_SET1(x) _mm256_set1_ps(x)
#define PCC_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define PCC_STOREU(p, v) _mm256_storeu_ps((p), (v))
#define PCC_ISA "avx2"
#else
/* portable: GCC/clang vector extensions, 4 lanes, multiply then add */
#define PCC_VEC 4
#define PCC_NV 2
#define PCC_MR 6
typedef float pcc_v __attribute__((vector_size(16)));
static inline pcc_v pcc_loadu_(const float *p) { pcc_v v; memcpy(&v, p, sizeof v); return v; }
static inline void pcc_storeu_(float *p, pcc_v v) { memcpy(p, &v, sizeof v); }
#define PCC_ZERO() ((pcc_v){0.0f, 0.0f, 0.0f, 0.0f})
#define PCC_LOADU(p) pcc_loadu_(p)
#define PCC_SET1(x) ((pcc_v){0.0f, 0.0f, 0.0f, 0.0f} + (x))
#define PCC_FMA(a, b, c) ((a) * (b) + (c))
#define PCC_STOREU(p, v) pcc_storeu_((p), (v))
#define PCC_ISA "generic"
#endif

#define PCC_NR (PCC_VEC * PCC_NV)

/* ct[i*NR + j] = sum_k a[k*MR + i] * b[off[k] + j], i < MR, j < NR. */
#define PCC_DEFINE_UKERNEL(MR)                                                            \
    static inline void pcc_ukernel_##MR(int kdim, const float *restrict a,                \
                                        const float *restrict b, const int *restrict off, \
                                        float *restrict ct)                               \
    {                                                                                     \
        pcc_v acc[MR][PCC_NV];                                                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                             \
            _Pragma("GCC unroll 4") for (int j = 0; j < PCC_NV; j++) acc[i][j] = PCC_ZERO(); \
        for (int k = 0; k < kdim; k++) {                                                  \
            const float *bk = b + off[k];                                                 \
            const float *ak = a + (pcc_idx)k * MR;                                        \
            pcc_v bv[PCC_NV];                                                             \
            _Pragma("GCC unroll 4") for (int j = 0; j < PCC_NV; j++)                      \
                bv[j] = PCC_LOADU(bk + j * PCC_VEC);                                      \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                       \
                pcc_v av = PCC_SET1(ak[i]);                                               \
                _Pragma("GCC unroll 4") for (int j = 0; j < PCC_NV; j++)                  \
                    acc[i][j] = PCC_FMA(av, bv[j], acc[i][j]);                            \
            }                                                                             \
        }                                                                                 \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                             \
            _Pragma("GCC unroll 4") for (int j = 0; j < PCC_NV; j++)                      \
                PCC_STOREU(ct + i * PCC_NR + j * PCC_VEC, acc[i][j]);                     \
    }

PCC_DEFINE_UKERNEL(PCC_MR)
#if PCC_MR != 4
PCC_DEFINE_UKERNEL(4)
#endif
PCC_DEFINE_UKERNEL(2)
PCC_DEFINE_UKERNEL(1)

/* Width of the filter block starting at o0 (blocks of PCC_MR, then 4, 2, 1). */
static inline int pcc_block_width(int O, int o0)
{
    int rest = O - o0;
    int full = (O / PCC_MR) * PCC_MR;
    if (o0 < full) return PCC_MR;
    if (rest >= 4) return 4;
    if (rest >= 2) return 2;
    return 1;
}

/* Number of filter blocks of O rows. */
static inline int pcc_num_blocks(int O)
{
    int nb = O / PCC_MR, o0 = nb * PCC_MR;
    while (o0 < O) {
        o0 += pcc_block_width(O, o0);
        nb++;
    }
    return nb;
}

/* First row of block b. */
static inline int pcc_block_start(int O, int b)
{
    int full = O / PCC_MR;
    if (b <= full) return b * PCC_MR;
    int o0 = full * PCC_MR;
    for (int i = full; i < b; i++) o0 += pcc_block_width(O, o0);
    return o0;
}

/* Pack block b of w (O, kdim) row-major: rows [o0, o0 + mr) as [k][mr] at a + o0*kdim. */
static inline void pcc_pack_block(const float *restrict w, int O, int kdim, int b, float *restrict a)
{
    int o0 = pcc_block_start(O, b), mr = pcc_block_width(O, o0);
    float *restrict blk = a + (pcc_idx)o0 * kdim;
    const float *restrict w0 = w + (pcc_idx)o0 * kdim;
    for (int k = 0; k < kdim; k++)
        for (int i = 0; i < mr; i++) blk[(pcc_idx)k * mr + i] = w0[(pcc_idx)i * kdim + k];
}

/* Pack block b of the weights of the stride-1 input gradient, a convolution of dy with
 * wt[c, o, kh, kw] = w[o, c, K-1-kh, K-1-kw]: rows are in-channels c (C of them),
 * depth k = (o, kh, kw). w is (O, C, K, K). */
static inline void pcc_pack_block_flipped(const float *restrict w, int O, int C, int K, int b, float *restrict a)
{
    int KK = K * K, kdim = O * KK;
    int c0 = pcc_block_start(C, b), mr = pcc_block_width(C, c0);
    float *restrict blk = a + (pcc_idx)c0 * kdim;
    for (int o = 0; o < O; o++)
        for (int t = 0; t < KK; t++)
            for (int i = 0; i < mr; i++)
                blk[(pcc_idx)(o * KK + t) * mr + i] = w[((pcc_idx)o * C + c0 + i) * KK + KK - 1 - t];
}

/* Copy one image x (C, H, W) into the zero-padded buffer xp (C, Hp, Wp) with pad rows/cols
 * on every side (Hp = H + 2 pad, Wp = W + 2 pad), for channels [c0, c1). Negative pad crops. */
static inline void pcc_pad_image(const float *restrict x, int H, int W, int pad, int Hp, int Wp,
                                 int c0, int c1, float *restrict xp)
{
    for (int c = c0; c < c1; c++) {
        const float *xc = x + (pcc_idx)c * H * W;
        float *pc = xp + (pcc_idx)c * Hp * Wp;
        for (int hp = 0; hp < Hp; hp++) {
            float *dst = pc + (pcc_idx)hp * Wp;
            int h = hp - pad;
            if (h < 0 || h >= H) {
                memset(dst, 0, sizeof(float) * (size_t)Wp);
                continue;
            }
            const float *src = xc + (pcc_idx)h * W;
            int w_lo = pad > 0 ? pad : 0;            /* first wp holding data */
            int w_hi = W + pad < Wp ? W + pad : Wp;  /* one past the last */
            for (int wp = 0; wp < w_lo; wp++) dst[wp] = 0.0f;
            if (w_hi > w_lo) memcpy(dst + w_lo, src + (w_lo - pad), sizeof(float) * (size_t)(w_hi - w_lo));
            for (int wp = w_hi > w_lo ? w_hi : w_lo; wp < Wp; wp++) dst[wp] = 0.0f;
        }
    }
}

/* k offsets of the wide-grid layout: off[(c*K + kh)*K + kw] = c*Hp*Wp + kh*Wp + kw. */
static inline void pcc_offsets_shifted(int C, int K, int Hp, int Wp, int *restrict off)
{
    int k = 0;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < K; kh++)
            for (int kw = 0; kw < K; kw++) off[k++] = c * Hp * Wp + kh * Wp + kw;
}

/* k offsets of an im2col tile with leading dimension ldb. */
static inline void pcc_offsets_tile(int kdim, int ldb, int *restrict off)
{
    for (int k = 0; k < kdim; k++) off[k] = k * ldb;
}

/* Output positions [s_begin, s_end) of the grid of width Wg (q < Q valid) for all O rows:
 * y[o*ldy + p*Q + q] = sum_k a_o[k] B(k, s) (+ bias[o]) for s = p*Wg + q.
 * ct: scratch of PCC_MR * PCC_NR floats. B must be readable up to s_end - 1 + PCC_NR. */
static inline void pcc_conv_panels(const float *restrict a, int O, int kdim,
                                   const float *restrict b, const int *restrict off,
                                   pcc_idx s_begin, pcc_idx s_end, int Wg, int Q,
                                   float *restrict y, pcc_idx ldy, const float *restrict bias,
                                   float *restrict ct)
{
    /* row segments of one panel: positions [j0, j1) land at y + dst */
    int seg_j0[PCC_NR + 2], seg_j1[PCC_NR + 2];
    pcc_idx seg_dst[PCC_NR + 2];
    for (pcc_idx s0 = s_begin; s0 < s_end; s0 += PCC_NR) {
        int nseg = 0;
        pcc_idx s_stop = s0 + PCC_NR < s_end ? s0 + PCC_NR : s_end;
        pcc_idx s = s0;
        while (s < s_stop) {
            pcc_idx p = s / Wg, q = s - p * Wg;
            pcc_idx row_end = (p + 1) * Wg;
            pcc_idx valid_end = p * Wg + Q;
            if (q < Q) {
                pcc_idx e = valid_end < s_stop ? valid_end : s_stop;
                seg_j0[nseg] = (int)(s - s0);
                seg_j1[nseg] = (int)(e - s0);
                seg_dst[nseg] = p * Q + q;
                nseg++;
            }
            s = row_end;
        }
        for (int o0 = 0; o0 < O;) {
            int mr = pcc_block_width(O, o0);
            const float *ab = a + (pcc_idx)o0 * kdim;
            const float *bs = b + s0;
            switch (mr) {
            case PCC_MR: pcc_ukernel_PCC_MR(kdim, ab, bs, off, ct); break;
#if PCC_MR != 4
            case 4: pcc_ukernel_4(kdim, ab, bs, off, ct); break;
#endif
            case 2: pcc_ukernel_2(kdim, ab, bs, off, ct); break;
            default: pcc_ukernel_1(kdim, ab, bs, off, ct); break;
            }
            for (int i = 0; i < mr; i++) {
                float bo = bias ? bias[o0 + i] : 0.0f;
                float *yo = y + (pcc_idx)(o0 + i) * ldy;
                const float *ci = ct + i * PCC_NR;
                for (int g = 0; g < nseg; g++) {
                    float *dst = yo + seg_dst[g];
                    const float *src = ci + seg_j0[g];
                    int len = seg_j1[g] - seg_j0[g];
                    if (bias) {
                        for (int j = 0; j < len; j++) dst[j] = src[j] + bo;
                    } else {
                        for (int j = 0; j < len; j++) dst[j] = src[j];
                    }
                }
            }
            o0 += mr;
        }
    }
}

#endif /* PARCONV_PC_CONV_H */
