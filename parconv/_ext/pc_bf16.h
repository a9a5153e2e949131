/* bfloat16 kernels for _bf16.pyx: bf16 inputs, fp32 accumulation.
 *
 * Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q
 * output, K kernel, F in-features, G out-features; Kd = C*K*K, the reduction
 * of a convolution, indexed k = c*K*K + kh*K + kw (the order of w's memory).
 *
 * Every product is a GEMM  Cm[rows][cols] (= or +=) A[rows][red] B[red][cols]
 * on VDPBF16PS, which multiplies PAIRS of bf16 along the reduction and adds
 * both products into one fp32 lane. So both operands are stored as uint32
 * pairs (low half: element 2t, high half: element 2t+1; an odd length ends
 * in a zero half):
 *   A  row-major [rows][lda] pairs; one pair per row is broadcast,
 *   B  row-major [red/2][ldb] pairs, ldb a multiple of 16: one zmm = 16
 *      output columns of one reduction pair,
 * so the output columns lie along the vector lanes and every store is a
 * contiguous row of Cm (pixels of an NCHW plane, features of a row). Each
 * product picks the orientation whose operands need no transpose of the
 * large side (see _bf16.pyx).
 *
 * Rounding to bf16 (round to nearest, ties to even; NaN stays NaN, made
 * quiet as the hardware conversion does) is done here in portable C, once
 * per element packed, so the native kernels and the emulation round alike.
 * VDPBF16PS treats bf16 subnormal inputs as zero and flushes subnormal
 * results (it ignores MXCSR); products that small are below fp32's
 * resolution of any sum they take part in unless every term is subnormal.
 */
#ifndef PC_BF16_H
#define PC_BF16_H

#include <stdint.h>
#include <string.h>

#include "pc_common.h"

/* ------------------------------------------------------------ rounding */

static inline uint32_t pcb_f2u(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* The bf16 nearest to v (ties to even) as its 16 bits; NaN keeps its sign and top payload and gets
 * the quiet bit, so a signalling NaN whose payload lies only in the dropped bits stays a NaN. */
static inline uint32_t pcb_bf16(float v)
{
    uint32_t u = pcb_f2u(v);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t q = (u | 0x00400000u) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? q : r;
}

/* out[i] = v rounded to bf16, as float32 with the low 16 bits zero; out may be x. */
static inline void pcb_round(const float *x, float *out, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) {
        uint32_t b = pcb_bf16(x[i]) << 16;
        float f;
        memcpy(&f, &b, sizeof f);
        out[i] = f;
    }
}

static inline pc_idx pcb_up16(pc_idx n) { return (n + 15) & ~(pc_idx)15; }

/* ------------------------------------------------------------ packing
 * Four layouts of a row-major float matrix src (rows x cols, row stride lds), each rounding
 * every element; destination rows [d0, d1) only, so a team can split one packing. */

/* Pairs along each row: dst[r][t] = (src[r][2t], src[r][2t+1]), t < ceil(cols/2); ldd pairs. */
static inline void pcb_pack_along(const float *restrict src, pc_idx lds, pc_idx cols,
                                  uint32_t *restrict dst, pc_idx ldd, pc_idx d0, pc_idx d1)
{
    pc_idx half = cols / 2;
    for (pc_idx r = d0; r < d1; r++) {
        const float *s = src + r * lds;
        uint32_t *d = dst + r * ldd;
        PC_SIMD
        for (pc_idx t = 0; t < half; t++) d[t] = pcb_bf16(s[2 * t]) | pcb_bf16(s[2 * t + 1]) << 16;
        if (cols & 1) d[half] = pcb_bf16(s[cols - 1]);
    }
}

/* Pairs down the columns: dst[t][c] = (src[2t][c], src[2t+1][c]), zero columns up to ldd. */
static inline void pcb_pack_down(const float *restrict src, pc_idx lds, pc_idx rows, pc_idx cols,
                                 uint32_t *restrict dst, pc_idx ldd, pc_idx d0, pc_idx d1)
{
    for (pc_idx t = d0; t < d1; t++) {
        const float *s0 = src + 2 * t * lds;
        uint32_t *d = dst + t * ldd;
        if (2 * t + 1 < rows) {
            const float *s1 = s0 + lds;
            PC_SIMD
            for (pc_idx c = 0; c < cols; c++) d[c] = pcb_bf16(s0[c]) | pcb_bf16(s1[c]) << 16;
        } else {
            PC_SIMD
            for (pc_idx c = 0; c < cols; c++) d[c] = pcb_bf16(s0[c]);
        }
        for (pc_idx c = cols; c < ldd; c++) d[c] = 0;
    }
}

/* Pairs along the rows, transposed: dst[t][r] = (src[r][2t], src[r][2t+1]), zero up to ldd. */
static inline void pcb_pack_along_t(const float *restrict src, pc_idx lds, pc_idx rows, pc_idx cols,
                                    uint32_t *restrict dst, pc_idx ldd, pc_idx d0, pc_idx d1)
{
    for (pc_idx t = d0; t < d1; t++) {
        uint32_t *d = dst + t * ldd;
        if (2 * t + 1 < cols) {
            for (pc_idx r = 0; r < rows; r++)
                d[r] = pcb_bf16(src[r * lds + 2 * t]) | pcb_bf16(src[r * lds + 2 * t + 1]) << 16;
        } else {
            for (pc_idx r = 0; r < rows; r++) d[r] = pcb_bf16(src[r * lds + 2 * t]);
        }
        for (pc_idx r = rows; r < ldd; r++) d[r] = 0;
    }
}

/* Pairs down the columns, transposed: dst[c][t] = (src[2t][c], src[2t+1][c]), t < ceil(rows/2). */
static inline void pcb_pack_down_t(const float *restrict src, pc_idx lds, pc_idx rows,
                                   uint32_t *restrict dst, pc_idx ldd, pc_idx d0, pc_idx d1)
{
    pc_idx half = rows / 2;
    for (pc_idx c = d0; c < d1; c++) {
        uint32_t *d = dst + c * ldd;
        for (pc_idx t = 0; t < half; t++)
            d[t] = pcb_bf16(src[2 * t * lds + c]) | pcb_bf16(src[(2 * t + 1) * lds + c]) << 16;
        if (rows & 1) d[half] = pcb_bf16(src[(rows - 1) * lds + c]);
    }
}

/* One packing of rows [d0, d1) of the destination, by layout: 0 along, 1 down, 2 along_t,
 * 3 down_t (a team splits one packing by destination rows). */
static inline void pcb_pack(int kind, const float *src, pc_idx lds, pc_idx rows, pc_idx cols,
                            uint32_t *dst, pc_idx ldd, pc_idx d0, pc_idx d1)
{
    switch (kind) {
    case 0: pcb_pack_along(src, lds, cols, dst, ldd, d0, d1); break;
    case 1: pcb_pack_down(src, lds, rows, cols, dst, ldd, d0, d1); break;
    case 2: pcb_pack_along_t(src, lds, rows, cols, dst, ldd, d0, d1); break;
    default: pcb_pack_down_t(src, lds, rows, dst, ldd, d0, d1); break;
    }
}

/* One row k = (c, kh, kw) of the im2col matrix of one image (C, H, W) for output rows [p0, p1),
 * rounded: dst[(p - p0) * Q + q] = bf16(x[c][p*S + kh - pad][q*S + kw - pad]), 0 outside. */
static inline void pcb_im2col_row(const float *restrict x, int H, int W, int K, int S, int pad, int Q,
                                  int p0, int p1, int k, uint16_t *restrict dst)
{
    int c = k / (K * K), kh = (k / K) % K, kw = k % K;
    int q_lo, q_hi;
    pc_valid_q(W, Q, S, kw, pad, &q_lo, &q_hi);
    const float *xc = x + (pc_idx)c * H * W;
    for (int p = p0; p < p1; p++) {
        uint16_t *d = dst + (pc_idx)(p - p0) * Q;
        int h = p * S + kh - pad;
        if (h < 0 || h >= H) {
            memset(d, 0, sizeof(uint16_t) * (size_t)Q);
            continue;
        }
        const float *s = xc + (pc_idx)h * W + (kw - pad);
        for (int q = 0; q < q_lo; q++) d[q] = 0;
        if (S == 1) {
            PC_SIMD
            for (int q = q_lo; q < q_hi; q++) d[q] = (uint16_t)pcb_bf16(s[q]);
        } else {
            for (int q = q_lo; q < q_hi; q++) d[q] = (uint16_t)pcb_bf16(s[(pc_idx)q * S]);
        }
        for (int q = q_hi; q < Q; q++) d[q] = 0;
    }
}

/* The B panel of a convolution's forward for output rows [p0, p1) of one image: pairs of im2col
 * rows interleaved, panel[t][j] = (row 2t, row 2t+1)[j], j < npix, zero up to ldb. tmp: 2 x ldb u16. */
static inline void pcb_im2col_pairs(const float *restrict x, int C, int H, int W, int K, int S, int pad,
                                    int Q, int p0, int p1, uint32_t *restrict panel, pc_idx ldb,
                                    uint16_t *restrict tmp)
{
    int Kd = C * K * K;
    pc_idx npix = (pc_idx)(p1 - p0) * Q;
    uint16_t *t0 = tmp, *t1 = tmp + ldb;
    for (int t = 0; 2 * t < Kd; t++) {
        uint32_t *d = panel + (pc_idx)t * ldb;
        pcb_im2col_row(x, H, W, K, S, pad, Q, p0, p1, 2 * t, t0);
        if (2 * t + 1 < Kd) {
            pcb_im2col_row(x, H, W, K, S, pad, Q, p0, p1, 2 * t + 1, t1);
            PC_SIMD
            for (pc_idx j = 0; j < npix; j++) d[j] = (uint32_t)t0[j] | (uint32_t)t1[j] << 16;
        } else {
            PC_SIMD
            for (pc_idx j = 0; j < npix; j++) d[j] = t0[j];
        }
        for (pc_idx j = npix; j < ldb; j++) d[j] = 0;
    }
}

/* ------------------------------------------------------------ native GEMM */

#if defined(__AVX512F__) && defined(__GNUC__)
#define PCB_NATIVE 1
#include <immintrin.h>

#define PCB_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
#define PCB_MR 8   /* rows per tile: 16 accumulators + 2 B vectors + 1 broadcast of 32 zmm */
#define PCB_NR 32  /* columns per tile: two zmm */

static int pcb_cpu_native(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
}

/* One tile: Cm[r][j] (= or +=) sum_t dot(A[r][t], B[t][j]) for r < rows <= PCB_MR, j < cols <= PCB_NR,
 * over kp reduction pairs. Stores add brow[r] (per row) or bcol[j] (per column) when given; with
 * accumulate, the sum is added to Cm instead. Rows past `rows` re-read row 0 and are not stored. */
PCB_TARGET static void pcb_tile(const uint32_t *restrict A, pc_idx lda, int rows,
                                const uint32_t *restrict B, pc_idx ldb, pc_idx kp,
                                float *restrict Cm, pc_idx ldc, int cols,
                                const float *restrict brow, const float *restrict bcol, int accumulate)
{
    const uint32_t *a[PCB_MR];
    __m512 c0[PCB_MR], c1[PCB_MR];
#pragma GCC unroll 8
    for (int r = 0; r < PCB_MR; r++) {
        a[r] = A + (r < rows ? (pc_idx)r * lda : 0);
        c0[r] = _mm512_setzero_ps();
        c1[r] = _mm512_setzero_ps();
    }
    if (cols > 16) {
        for (pc_idx t = 0; t < kp; t++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(B + t * ldb));
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512((const void *)(B + t * ldb + 16));
#pragma GCC unroll 8
            for (int r = 0; r < PCB_MR; r++) {
                const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r][t]);
                c0[r] = _mm512_dpbf16_ps(c0[r], ar, b0);
                c1[r] = _mm512_dpbf16_ps(c1[r], ar, b1);
            }
        }
    } else {
        for (pc_idx t = 0; t < kp; t++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(B + t * ldb));
#pragma GCC unroll 8
            for (int r = 0; r < PCB_MR; r++)
                c0[r] = _mm512_dpbf16_ps(c0[r], (__m512bh)_mm512_set1_epi32((int)a[r][t]), b0);
        }
    }
    const __mmask16 m0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1u);
    const __mmask16 m1 = cols >= 32 ? (__mmask16)0xffff : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1u) : 0;
    __m512 bc0 = _mm512_setzero_ps(), bc1 = _mm512_setzero_ps();
    if (bcol != NULL) {
        bc0 = _mm512_maskz_loadu_ps(m0, bcol);
        bc1 = _mm512_maskz_loadu_ps(m1, bcol + 16);
    }
    for (int r = 0; r < rows; r++) {
        float *cr = Cm + (pc_idx)r * ldc;
        __m512 v0 = c0[r], v1 = c1[r];
        if (accumulate) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cr), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cr + 16), v1);
        } else if (brow != NULL) {
            v0 = _mm512_add_ps(v0, _mm512_set1_ps(brow[r]));
            v1 = _mm512_add_ps(v1, _mm512_set1_ps(brow[r]));
        } else if (bcol != NULL) {
            v0 = _mm512_add_ps(v0, bc0);
            v1 = _mm512_add_ps(v1, bc1);
        }
        _mm512_mask_storeu_ps(cr, m0, v0);
        if (m1) _mm512_mask_storeu_ps(cr + 16, m1, v1);
    }
}

/* Cm (rows x cols) (= or +=) A B over kp pairs, in tiles: column blocks of PCB_NR outside, so one
 * block of B (kp x 32 pairs) stays in cache while every block of rows of A passes over it. */
PCB_TARGET static void pcb_gemm(const uint32_t *restrict A, pc_idx lda, pc_idx rows,
                                const uint32_t *restrict B, pc_idx ldb, pc_idx kp,
                                float *restrict Cm, pc_idx ldc, pc_idx cols,
                                const float *restrict brow, const float *restrict bcol, int accumulate)
{
    for (pc_idx j = 0; j < cols; j += PCB_NR) {
        int nc = (int)(cols - j < PCB_NR ? cols - j : PCB_NR);
        for (pc_idx r = 0; r < rows; r += PCB_MR) {
            int nr = (int)(rows - r < PCB_MR ? rows - r : PCB_MR);
            pcb_tile(A + r * lda, lda, nr, B + j, ldb, kp, Cm + r * ldc + j, ldc, nc,
                     brow ? brow + r : NULL, bcol ? bcol + j : NULL, accumulate);
        }
    }
}

#else
#define PCB_NATIVE 0
static int pcb_cpu_native(void) { return 0; }

/* this level has no VDPBF16PS: _bf16.pyx raises before any caller gets here */
static void pcb_gemm(const uint32_t *A, pc_idx lda, pc_idx rows, const uint32_t *B, pc_idx ldb, pc_idx kp,
                     float *Cm, pc_idx ldc, pc_idx cols, const float *brow, const float *bcol, int accumulate)
{
    (void)A; (void)lda; (void)rows; (void)B; (void)ldb; (void)kp;
    (void)Cm; (void)ldc; (void)cols; (void)brow; (void)bcol; (void)accumulate;
}
#endif

/* ------------------------------------------------------------ convolution blocks */

/* Forward for output rows [p0, p1) of one image: y[o][p][q] = b[o] + sum_k wr[o][k] cols[k][p, q].
 * wr: the rounded filters as pairs [O][kp] (kp = ceil(Kd/2)); panel: kp x ldb pairs, ldb =
 * up16(npix); tmp: 2 x ldb u16. y: the image's (O, P, Q) output. */
static inline void pcb_conv_fwd_block(const float *restrict x, int C, int H, int W, const uint32_t *restrict wr,
                                      int O, int K, int S, int pad, const float *restrict b,
                                      float *restrict y, int P, int Q, int p0, int p1,
                                      uint32_t *restrict panel, uint16_t *restrict tmp)
{
    pc_idx npix = (pc_idx)(p1 - p0) * Q, ldb = pcb_up16(npix), kp = ((pc_idx)C * K * K + 1) / 2;
    pcb_im2col_pairs(x, C, H, W, K, S, pad, Q, p0, p1, panel, ldb, tmp);
    pcb_gemm(wr, kp, O, panel, ldb, kp, y + (pc_idx)p0 * Q, (pc_idx)P * Q, npix, b, NULL, 0);
}

/* Weight gradient of output rows [p0, p1) of one image, added into part (Kd x ldo, transposed):
 * part[k][o] += sum_pix cols[k][pix] dy[o][pix]. cols: Kd x npp pairs (npp = ceil(npix/2)) along the
 * pixels, straight from im2col; dyt: npp x ldo pairs (ldo = up16(O)). */
static inline void pcb_conv_dw_block(const float *restrict x, int C, int H, int W, int K, int S, int pad,
                                     const float *restrict dy, int O, int P, int Q, int p0, int p1,
                                     float *restrict part, pc_idx ldo, uint32_t *restrict cols,
                                     uint32_t *restrict dyt)
{
    int Kd = C * K * K;
    pc_idx npix = (pc_idx)(p1 - p0) * Q, npp = (npix + 1) / 2;
    for (int k = 0; k < Kd; k++) {
        uint16_t *row = (uint16_t *)(cols + (pc_idx)k * npp);
        pcb_im2col_row(x, H, W, K, S, pad, Q, p0, p1, k, row);
        if (npix & 1) row[npix] = 0;
    }
    pcb_pack_along_t(dy + (pc_idx)p0 * Q, (pc_idx)P * Q, O, npix, dyt, ldo, 0, npp);
    pcb_gemm(cols, npp, Kd, dyt, ldo, npp, part, ldo, O, NULL, NULL, 1);
}

/* Input gradient of one image through im2col's transpose, for any stride and padding: per block of
 * output rows, dcols[k][pix] = sum_o w[o][k] dy[o][pix], scattered into dx (zeroed here).
 * wt: pairs down w's columns, transposed (Kd x op, op = ceil(O/2)); panel: op x up16(npix) pairs;
 * dcols: Kd x npix floats. */
static inline void pcb_conv_dx_image(const uint32_t *restrict wt, int C, int H, int W, int K, int S, int pad,
                                     const float *restrict dy, int O, int P, int Q, int rb, float *restrict dx,
                                     uint32_t *restrict panel, float *restrict dcols)
{
    int Kd = C * K * K;
    pc_idx op = (O + 1) / 2;
    memset(dx, 0, sizeof(float) * (size_t)C * H * W);
    for (int p0 = 0; p0 < P; p0 += rb) {
        int p1 = p0 + rb < P ? p0 + rb : P;
        pc_idx npix = (pc_idx)(p1 - p0) * Q, ldb = pcb_up16(npix);
        pcb_pack_down(dy + (pc_idx)p0 * Q, (pc_idx)P * Q, O, npix, panel, ldb, 0, op);
        pcb_gemm(wt, op, Kd, panel, ldb, op, dcols, npix, npix, NULL, NULL, 0);
        pc_col2im(dcols, H, W, K, S, pad, Q, 0, C, p0, p1, dx);
    }
}

#endif /* PC_BF16_H */
