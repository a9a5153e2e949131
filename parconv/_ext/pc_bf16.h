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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* d[q] = pcb_bf16(s[q]) for q < n, 16 lanes at a time with the tail masked: short rows go straight
 * to their place without a buffer and a copy. */
/* 16 lanes of fp32 bits rounded as pcb_bf16 does, each bf16 in its lane's low half. */
static inline __m512i pcb_bf16v(__m512i u)
{
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_srli_epi32(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), 16));
}

static inline void pcb_round_run(const float *restrict s, uint16_t *restrict d, int n)
{
    for (int q = 0; q < n; q += 16) {
        const __mmask16 m = n - q >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - q)) - 1u);
        _mm512_mask_cvtepi32_storeu_epi16(d + q, m, pcb_bf16v(_mm512_maskz_loadu_epi32(m, s + q)));
    }
}
#endif

/* dst[r][q] = bf16(src[r * w + q]) for r < nrows, q < w, dst rows ldd apart: with AVX-512 row by row
 * in masked vectors; elsewhere contiguous rows rounded as one vector loop (rows shorter than a vector
 * would leave it mostly idle), through a small buffer. */
static inline void pcb_round_rows(const float *restrict src, int nrows, int w, uint16_t *restrict dst, pc_idx ldd)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int r = 0; r < nrows; r++) pcb_round_run(src + (pc_idx)r * w, dst + (pc_idx)r * ldd, w);
#else
    enum { BUF = 2048 };
    uint16_t buf[BUF];
    if (w >= 64 || w > BUF) {
        for (int r = 0; r < nrows; r++) {
            const float *s = src + (pc_idx)r * w;
            uint16_t *d = dst + (pc_idx)r * ldd;
            PC_SIMD
            for (int q = 0; q < w; q++) d[q] = (uint16_t)pcb_bf16(s[q]);
        }
        return;
    }
    int per = BUF / w;
    for (int r0 = 0; r0 < nrows; r0 += per) {
        int n = nrows - r0 < per ? nrows - r0 : per;
        const float *s = src + (pc_idx)r0 * w;
        pc_idx cnt = (pc_idx)n * w;
        PC_SIMD
        for (pc_idx i = 0; i < cnt; i++) buf[i] = (uint16_t)pcb_bf16(s[i]);
        for (int r = 0; r < n; r++) memcpy(dst + (pc_idx)(r0 + r) * ldd, buf + (pc_idx)r * w, sizeof(uint16_t) * (size_t)w);
    }
#endif
}

/* Input rows [hp0, hp0 + R) of one image (C, H, W), in padded coordinates (row hp is x's row
 * hp - pad), rounded to bf16 and zero-padded: xb[c][r][Wp], Wp = W + 2 pad. Every im2col row of a
 * block of output rows is then a plain (strided) copy out of this small buffer, and each input
 * element is rounded once per block instead of once per tap. */
static inline void pcb_pad_rows(const float *restrict x, int C, int H, int W, int pad, int hp0, int R,
                                uint16_t *restrict xb)
{
    int Wp = W + 2 * pad;
    int r0 = pad - hp0 > 0 ? pad - hp0 : 0;                 /* rows [r0, r1) hold x's rows */
    int r1 = H + pad - hp0 < R ? H + pad - hp0 : R;
    if (r0 > R) r0 = R;                                    /* a block wholly inside padding >= K */
    if (r1 < r0) r1 = r0;
    for (int c = 0; c < C; c++) {
        uint16_t *dc = xb + (pc_idx)c * R * Wp;
        memset(dc, 0, sizeof(uint16_t) * (size_t)r0 * Wp);
        memset(dc + (pc_idx)r1 * Wp, 0, sizeof(uint16_t) * (size_t)(R - r1) * Wp);
        for (int r = r0; r < r1; r++)
            for (int q = 0; q < pad; q++) dc[(pc_idx)r * Wp + q] = dc[(pc_idx)r * Wp + pad + W + q] = 0;
        if (r1 > r0)
            pcb_round_rows(x + ((pc_idx)c * H + hp0 + r0 - pad) * W, r1 - r0, W, dc + (pc_idx)r0 * Wp + pad, Wp);
    }
}

/* The rows of pcb_pad_rows a block of output rows [p0, p1) reads. */
static inline int pcb_block_rows(int p0, int p1, int K, int S) { return (p1 - 1 - p0) * S + K; }

/* Where im2col row k = (c, kh, kw) of output row p starts in xb (the block's first row is p0). */
static inline const uint16_t *pcb_tap(const uint16_t *xb, int R, int Wp, int K, int S, int p0, int p, int k)
{
    int c = k / (K * K), kh = (k / K) % K, kw = k % K;
    return xb + ((pc_idx)c * R + (p - p0) * S + kh) * Wp + kw;
}

/* The B panel of a convolution's forward for output rows [p0, p1): pairs of im2col rows
 * interleaved, panel[t][j] = (row 2t, row 2t+1)[j], j < npix, zero up to ldb; xb from pcb_pad_rows. */
static inline void pcb_im2col_pairs(const uint16_t *restrict xb, int R, int Wp, int Kd, int K, int S,
                                    int Q, int p0, int p1, uint32_t *restrict panel, pc_idx ldb)
{
    pc_idx npix = (pc_idx)(p1 - p0) * Q;
    for (int t = 0; 2 * t < Kd; t++) {
        uint32_t *d = panel + (pc_idx)t * ldb;
        for (int p = p0; p < p1; p++, d += Q) {
            const uint16_t *s0 = pcb_tap(xb, R, Wp, K, S, p0, p, 2 * t);
            if (2 * t + 1 < Kd) {
                const uint16_t *s1 = pcb_tap(xb, R, Wp, K, S, p0, p, 2 * t + 1);
                if (S == 1) {
                    PC_SIMD
                    for (int q = 0; q < Q; q++) d[q] = (uint32_t)s0[q] | (uint32_t)s1[q] << 16;
                } else {
                    for (int q = 0; q < Q; q++) d[q] = (uint32_t)s0[q * S] | (uint32_t)s1[q * S] << 16;
                }
            } else {
                for (int q = 0; q < Q; q++) d[q] = s0[q * S];
            }
        }
        d = panel + (pc_idx)t * ldb;
        for (pc_idx j = npix; j < ldb; j++) d[j] = 0;
    }
}

/* ------------------------------------------------------------ native GEMM */

#define PCB_MR 8   /* rows per tile: 16 accumulators + 2 B vectors + 1 broadcast of 32 zmm */
#define PCB_NR 32  /* columns per tile: two zmm */

#if defined(__AVX512F__) && defined(__GNUC__)
#define PCB_NATIVE 1
#include <immintrin.h>
#include <time.h>

#define PCB_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

static int pcb_cpu_native(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
}

/* One tile: Cm[r][j] (= or +=) sum_t dot(a[r][t], B_t[j]) for r < rows <= PCB_MR, j < cols <= PCB_NR,
 * over kp reduction pairs; B_t = B + boff[t] where the rows of B lie apart (shifted views of one
 * image), else B + t * ldb. The 32 columns are B_t[0..32) (rs = 0), or output rows of 16 or 8
 * pixels lying rs words apart in B_t (rs > 0, cols per row `rq`): two rows of 16, or four of 8,
 * whose outputs are contiguous in Cm. Stores add brow[r] (per row) or bcol[j] (per column) when
 * given; with accumulate, the sum is added to Cm instead. Rows past `rows` re-read row 0 and are
 * not stored. With amap, pair t of A's rows is their element amap[t] (a weight gradient's
 * reduction over the valid pixels of views that also hold dropped ones). */
#define PCB_TILE_LOOP(BROW, LOAD0, LOAD1) PCB_TILE_LOOP_A(t, BROW, LOAD0, LOAD1)
#define PCB_TILE_LOOP_A(AI, BROW, LOAD0, LOAD1)                                                    \
    if (cols > 16) {                                                                               \
        for (pc_idx t = 0; t < kp; t++) {                                                          \
            const uint32_t *bt = BROW;                                                             \
            const pc_idx ai = AI;                                                                  \
            const __m512bh b0 = (__m512bh)(LOAD0);                                                 \
            const __m512bh b1 = (__m512bh)(LOAD1);                                                 \
            _Pragma("GCC unroll 8")                                                                \
            for (int r = 0; r < PCB_MR; r++) {                                                     \
                const __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r][ai]);                    \
                c0[r] = _mm512_dpbf16_ps(c0[r], ar, b0);                                           \
                c1[r] = _mm512_dpbf16_ps(c1[r], ar, b1);                                           \
            }                                                                                      \
        }                                                                                          \
    } else {                                                                                       \
        for (pc_idx t = 0; t < kp; t++) {                                                          \
            const uint32_t *bt = BROW;                                                             \
            const pc_idx ai = AI;                                                                  \
            const __m512bh b0 = (__m512bh)(LOAD0);                                                 \
            _Pragma("GCC unroll 8")                                                                \
            for (int r = 0; r < PCB_MR; r++)                                                       \
                c0[r] = _mm512_dpbf16_ps(c0[r], (__m512bh)_mm512_set1_epi32((int)a[r][ai]), b0);   \
        }                                                                                          \
    }

#define PCB_LD(p) _mm512_loadu_si512((const void *)(p))
/* 8 words at p in the low half, 8 at p + rs in the high half (two output rows of 8) */
#define PCB_LD2(p) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p))), \
                                      _mm256_loadu_si256((const __m256i *)((p) + rs)), 1)

/* Rows r < rows of a tile's outputs (v0[r]: columns 0-15, v1[r]: 16-31; cols of them kept) into Cm:
 * added to Cm (accumulate), or plus brow[r] (per row) or bcol[j] (per column) where given. */
PCB_TARGET static inline void pcb_store_rows(const __m512 *v0s, const __m512 *v1s, int rows, int cols,
                                             float *restrict Cm, pc_idx ldc, const float *restrict brow,
                                             const float *restrict bcol, int accumulate)
{
    const __mmask16 m0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1u);
    const __mmask16 m1 = cols >= 32 ? (__mmask16)0xffff : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1u) : 0;
    __m512 bc0 = _mm512_setzero_ps(), bc1 = _mm512_setzero_ps();
    if (bcol != NULL) {
        bc0 = _mm512_maskz_loadu_ps(m0, bcol);
        bc1 = _mm512_maskz_loadu_ps(m1, bcol + 16);
    }
    for (int r = 0; r < rows; r++) {
        float *cr = Cm + (pc_idx)r * ldc;
        __m512 v0 = v0s[r], v1 = v1s[r];
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

PCB_TARGET static void pcb_tile(const uint32_t *const *arow, const pc_idx *restrict amap, int rows,
                                const uint32_t *restrict B, const pc_idx *restrict boff, pc_idx ldb, pc_idx kp,
                                pc_idx rs, int rq, float *restrict Cm, pc_idx ldc, int cols,
                                const float *restrict brow, const float *restrict bcol, int accumulate)
{
    const uint32_t *a[PCB_MR];
    __m512 c0[PCB_MR], c1[PCB_MR];
#pragma GCC unroll 8
    for (int r = 0; r < PCB_MR; r++) {
        a[r] = arow[r < rows ? r : 0];
        c0[r] = _mm512_setzero_ps();
        c1[r] = _mm512_setzero_ps();
    }
    if (amap != NULL) {
        PCB_TILE_LOOP_A(amap[t], B + t * ldb, PCB_LD(bt), PCB_LD(bt + 16))
    } else if (boff == NULL) {
        PCB_TILE_LOOP(B + t * ldb, PCB_LD(bt), PCB_LD(bt + 16))
    } else if (rs == 0) {
        PCB_TILE_LOOP(B + boff[t], PCB_LD(bt), PCB_LD(bt + 16))
    } else if (rq == 16) {
        PCB_TILE_LOOP(B + boff[t], PCB_LD(bt), PCB_LD(bt + rs))
    } else {
        PCB_TILE_LOOP(B + boff[t], PCB_LD2(bt), PCB_LD2(bt + 2 * rs))
    }
    pcb_store_rows(c0, c1, rows, cols, Cm, ldc, brow, bcol, accumulate);
}

/* ------------------------------------------------------------ AMX tiles
 *
 * Where the CPU has AMX-BF16 (and the kernel lets this process use the tile registers), every
 * product of pcb_gemm_r runs on TDPBF16PS instead: one instruction multiplies a 16 x 16-pair tile
 * of A by a 16-pair x 16 tile of B into a 16 x 16 fp32 tile, 16x the work of a VDPBF16PS. The
 * layouts are the ones above (A's rows along the reduction in pairs, B's reduction pairs as rows of
 * columns), so a tile is a plain strided load. Operands whose rows lie apart (shifted views) and
 * every reduction tail are first copied into zero-padded blocks, so no tile reads past what the
 * VDPBF16PS kernel reads and padding multiplies only zeros; rows picked through amap stay on
 * VDPBF16PS. Each sum is
 * fp32, in a different order than the VDPBF16PS kernel's: the two paths agree within fp32 rounding,
 * and each repeats its own bits. */
#include "pc_amx.h"
#ifdef PC_AMX
#define PCB_AMX 1
#include <pthread.h>
#include <stdlib.h>

#define PCB_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl")))

static int pcb_amx_have = 0;  /* the CPU and OS run the tiles (pcb_amx_init) */
static int pcb_amx_on = 0;    /* pcb_gemm_r uses them */

typedef pc_tilecfg pcb_tilecfg;

/* Whether this process may run AMX-BF16 (pc_amx_request); turns the tiles on when it may. */
static int pcb_amx_init(void)
{
    if (!pc_amx_request(PC_AMX_BF16)) return 0;
    pcb_amx_have = pcb_amx_on = 1;
    return 1;
}

/* Turn the tiles on (1) or off (0) where the CPU has them; returns the previous setting. */
static int pcb_amx_set(int on)
{
    int old = pcb_amx_on;
    pcb_amx_on = on && pcb_amx_have;
    return old;
}

/* Per-thread staging memory, kept between calls (a product is called once per block of work) and
 * freed when its thread exits. */
static __thread uint32_t *pcb_amx_mem = NULL;
static __thread pc_idx pcb_amx_cap = 0;
static pthread_key_t pcb_amx_key;
static pthread_once_t pcb_amx_once = PTHREAD_ONCE_INIT;
static int pcb_amx_keyed = 0;

static void pcb_amx_key_init(void) { pcb_amx_keyed = pthread_key_create(&pcb_amx_key, free) == 0; }

static uint32_t *pcb_amx_scratch(pc_idx words)
{
    if (words > pcb_amx_cap) {
        void *p = NULL;
        pthread_once(&pcb_amx_once, pcb_amx_key_init);
        if (!pcb_amx_keyed || posix_memalign(&p, 64, (size_t)words * sizeof(uint32_t)) != 0) return NULL;
        if (pthread_setspecific(pcb_amx_key, p) != 0) {
            free(p);
            return NULL;
        }
        free(pcb_amx_mem);
        pcb_amx_mem = (uint32_t *)p;
        pcb_amx_cap = words;
    }
    return pcb_amx_mem;
}

#define PCB_AMX_FENCE() PC_AMX_FENCE()

/* The 2 x 2 block of tiles every kernel below runs: C tiles 0, 1 (rows of A tile 4) and 2, 3 (rows of
 * A tile 5) by the columns of B tiles 6 and 7; two_a / two_b say whether the second row / column of
 * tiles is used. One reduction chunk: A at a0 and a1, B at b0 and b0 + 16 words. */
PCB_AMX_TARGET static inline void pcb_amx_step(const void *a0, const void *a1, pc_idx as, const uint32_t *b0,
                                               pc_idx bs, int two_a, int two_b)
{
    _tile_loadd(4, a0, as);
    _tile_loadd(6, b0, bs);
    _tile_dpbf16ps(0, 4, 6);
    if (two_b) {
        _tile_loadd(7, b0 + 16, bs);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (two_a) {
        _tile_loadd(5, a1, as);
        _tile_dpbf16ps(2, 5, 6);
        if (two_b) _tile_dpbf16ps(3, 5, 7);
    }
}

PCB_AMX_TARGET static inline void pcb_amx_zero4(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* C tiles 0, 1 to c0 and c0 + 16, tiles 2, 3 to c1 and c1 + 16, rows cs bytes apart. */
PCB_AMX_TARGET static inline void pcb_amx_store4(float *c0, float *c1, pc_idx cs, int two_a, int two_b)
{
    _tile_stored(0, c0, cs);
    if (two_b) _tile_stored(1, c0 + 16, cs);
    if (two_a) {
        _tile_stored(2, c1, cs);
        if (two_b) _tile_stored(3, c1 + 16, cs);
    }
}

/* d[0..m) = s[0..m), m <= 32 words; masked loads never touch a word past s[m). */
PCB_AMX_TARGET static inline void pcb_amx_copy(uint32_t *restrict d, const uint32_t *restrict s, pc_idx m)
{
    for (pc_idx i = 0; i < m; i += 16) {
        pc_idx k = m - i < 16 ? m - i : 16;
        __mmask16 mk = k == 16 ? (__mmask16)0xffff : (__mmask16)((1u << k) - 1u);
        _mm512_mask_storeu_epi32(d + i, mk, _mm512_maskz_loadu_epi32(mk, s + i));
    }
}

/* Rows [r0, r0 + n) of A (arow or A + r * lda) as npad rows of kpp pairs, zero past n rows and past
 * kp pairs. */
PCB_AMX_TARGET static void pcb_amx_stage_a(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, pc_idx r0,
                                           pc_idx n, pc_idx npad, pc_idx kp, pc_idx kpp, uint32_t *restrict dst)
{
    for (pc_idx i = 0; i < npad; i++) {
        uint32_t *d = dst + i * kpp;
        if (i >= n) {
            memset(d, 0, sizeof(uint32_t) * (size_t)kpp);
            continue;
        }
        memcpy(d, arow != NULL ? arow[r0 + i] : A + (r0 + i) * lda, sizeof(uint32_t) * (size_t)kp);
        if (kpp > kp) memset(d + kp, 0, sizeof(uint32_t) * (size_t)(kpp - kp));
    }
}

/* Reduction pairs [t0, t1) of columns [j0, j0 + n) of B (pcb_tile's boff/rs/rq rules; j0 a multiple
 * of rq) as rows of ldd pairs, zero past n columns and past kp pairs. */
PCB_AMX_TARGET static void pcb_amx_stage_b(const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx rs, int rq,
                                           pc_idx j0, pc_idx n, pc_idx t0, pc_idx t1, pc_idx kp,
                                           uint32_t *restrict dst, pc_idx ldd)
{
    for (pc_idx t = t0; t < t1; t++) {
        uint32_t *d = dst + (t - t0) * ldd;
        pc_idx done = 0;
        if (t < kp) {
            const uint32_t *s = B + (boff != NULL ? boff[t] : t * ldb);
            if (rs == 0) {
                for (; done < n; done += 32) pcb_amx_copy(d + done, s + j0 + done, n - done < 32 ? n - done : 32);
                done = n;
            } else {
                for (pc_idx J = j0; J < j0 + n; J += rq)
                    pcb_amx_copy(d + (J - j0), s + J / rq * rs, j0 + n - J < rq ? j0 + n - J : rq);
                done = n;
            }
        }
        if (ldd > done) memset(d + done, 0, sizeof(uint32_t) * (size_t)(ldd - done));
    }
}

/* One block of at most 32 x 32 outputs: rows of A at `ab` (kpp pairs apart, zero-padded to whole
 * tiles), reduction chunk kc of B at bdir + kc * 16 * ldb for kc < kf (B itself) and at bst +
 * (kc - kf) * 16 * ldbs past that (staged); then pcb_tile's store rules. */
PCB_AMX_TARGET static void pcb_amx_block(const uint32_t *ab, pc_idx kpp, int nr, const uint32_t *bdir, pc_idx ldb,
                                         pc_idx kf, const uint32_t *bst, pc_idx ldbs, int nc, float *restrict Cm,
                                         pc_idx ldc, const float *brow, const float *bcol, int accumulate,
                                         float *restrict cb)
{
    const pc_idx nk = kpp / 16, as = kpp * (pc_idx)sizeof(uint32_t);
    const int two_a = nr > 16, two_b = nc > 16;
    pcb_amx_zero4();
    for (pc_idx kc = 0; kc < nk; kc++) {
        const uint32_t *a0 = ab + kc * 16;
        const uint32_t *b0 = kc < kf ? bdir + kc * 16 * ldb : bst + (kc - kf) * 16 * ldbs;
        pcb_amx_step(a0, a0 + 16 * kpp, as, b0, (kc < kf ? ldb : ldbs) * (pc_idx)sizeof(uint32_t), two_a, two_b);
    }
    pcb_amx_store4(cb, cb + 16 * 32, 128, two_a, two_b);
    __m512 v0[32], v1[32];
    for (int r = 0; r < nr; r++) {
        v0[r] = _mm512_load_ps(cb + r * 32);
        v1[r] = _mm512_load_ps(cb + r * 32 + 16);
    }
    pcb_store_rows(v0, v1, nr, nc, Cm, ldc, brow, bcol, accumulate);
}

/* pcb_gemm_r on the tiles; returns 0 (having done nothing) when its staging memory cannot be had.
 * The operand that the loop order passes over again is staged whole once; the other a block at a
 * time. B is read in place where its rows lie ldb apart. */
PCB_AMX_TARGET static int pcb_amx_gemm(const uint32_t *A, pc_idx lda, const uint32_t *const *arow,
                                       const pc_idx *amap, pc_idx rows, const uint32_t *B, const pc_idx *boff,
                                       pc_idx ldb, pc_idx kp, pc_idx rs, int rq, float *Cm, pc_idx ldc,
                                       pc_idx cols, const float *brow, const float *bcol, int accumulate,
                                       int rows_outer)
{
    const pc_idx kpp = (kp + 15) & ~(pc_idx)15, nk = kpp / 16;
    /* B is read in place where each block's 32 columns are contiguous and its rows ldb apart */
    const int bdirect = boff == NULL && (rs == 0 || rq % 32 == 0);
    const pc_idx kf = bdirect ? kp / 16 : 0;  /* chunks read from B itself */
    const pc_idx rows32 = (rows + 31) & ~(pc_idx)31, cols32 = (cols + 31) & ~(pc_idx)31;
    const pc_idx asz = rows_outer ? 32 * kpp : rows32 * kpp;
    const pc_idx ldbs = rows_outer ? cols32 : 32, bsz = (nk - kf) * 16 * ldbs;
    if (amap != NULL) return 0;  /* rows picked through amap: only the VDPBF16PS weight gradient has them */
    uint32_t *buf = pcb_amx_scratch(asz + bsz + 32 * 32);
    if (buf == NULL) return 0;
    uint32_t *As = buf, *Bs = buf + asz;
    float *cb = (float *)(Bs + bsz);  /* 64-byte aligned: asz and bsz are multiples of 16 words */
    pcb_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    if (rows_outer) {
        pcb_amx_stage_b(B, boff, ldb, rs, rq, 0, cols, kf * 16, kpp, kp, Bs, ldbs);
        for (pc_idx r = 0; r < rows; r += 32) {
            int nr = (int)(rows - r < 32 ? rows - r : 32);
            pcb_amx_stage_a(A, lda, arow, r, nr, 32, kp, kpp, As);
            PCB_AMX_FENCE();
            for (pc_idx j = 0; j < cols; j += 32) {
                int nc = (int)(cols - j < 32 ? cols - j : 32);
                pcb_amx_block(As, kpp, nr, B + (rs ? j / rq * rs : j), ldb, kf, Bs + j, ldbs, nc, Cm + r * ldc + j, ldc,
                              brow ? brow + r : NULL, bcol ? bcol + j : NULL, accumulate, cb);
            }
        }
    } else {
        pcb_amx_stage_a(A, lda, arow, 0, rows, rows32, kp, kpp, As);
        for (pc_idx j = 0; j < cols; j += 32) {
            int nc = (int)(cols - j < 32 ? cols - j : 32);
            pcb_amx_stage_b(B, boff, ldb, rs, rq, j, nc, kf * 16, kpp, kp, Bs, ldbs);
            PCB_AMX_FENCE();
            for (pc_idx r = 0; r < rows; r += 32) {
                int nr = (int)(rows - r < 32 ? rows - r : 32);
                pcb_amx_block(As + r * kpp, kpp, nr, B + (rs ? j / rq * rs : j), ldb, kf, Bs, ldbs, nc,
                              Cm + r * ldc + j, ldc,
                              brow ? brow + r : NULL, bcol ? bcol + j : NULL, accumulate, cb);
            }
        }
    }
    _tile_release();
    return 1;
}

/* Stride-1 convolution on the tiles, without im2col: the input is held as planes of CHANNEL pairs,
 * img[cp][r][w'] = (bf16 x[2cp], bf16 x[2cp + 1]) at padded row r and column w', so for one tap
 * (kh, kw) the 16 channel pairs of a B tile are 16 planes L words apart, read at the tap's offset
 * kh * Wp + kw: one strided tile load. The outputs run along the flat index j = row * Wp + q of the
 * padded width; the K - 1 columns past Q in each row are computed and dropped. The reduction runs
 * tap by tap, chunks of 16 channel pairs within a tap: the same order for every output whatever
 * the blocking or thread count. */

/* Channel pairs per tap as the tiles take them: all of them up to 16, else whole chunks of 16. */
static inline int pcb_amx_cpp(int C)
{
    int cpn = (C + 1) / 2;
    return cpn <= 16 ? cpn : (cpn + 15) & ~15;
}

/* Words per plane of a block's channel-pair image: RR padded rows and the reads past them. */
static inline pc_idx pcb_amx_plane(int RR, int Wp, int K) { return ((pc_idx)RR * Wp + K + 32 + 15) & ~(pc_idx)15; }

/* The filters as tile rows: wa[o][(kh * K + kw) * cpp + cp] = (bf16 w[o][2cp][kh][kw], bf16
 * w[o][2cp + 1][kh][kw]), zero past C and on the rows from O up to a multiple of 16. */
static void pcb_amx_wpack(const float *restrict w, int O, int C, int K, int cpp, uint32_t *restrict wa)
{
    pc_idx KK = (pc_idx)K * K, kt = KK * cpp, Op = ((pc_idx)O + 15) & ~(pc_idx)15;
    for (pc_idx o = 0; o < Op; o++)
        for (pc_idx k = 0; k < KK; k++)
            for (int cp = 0; cp < cpp; cp++) {
                uint32_t lo = 0, hi = 0;
                if (o < O && 2 * cp < C) lo = pcb_bf16(w[(o * C + 2 * cp) * KK + k]);
                if (o < O && 2 * cp + 1 < C) hi = pcb_bf16(w[(o * C + 2 * cp + 1) * KK + k]);
                wa[o * kt + k * cpp + cp] = lo | hi << 16;
            }
}

/* Lanes [q, q + 16) of s[i * S] (S 1 or 2), none past lane n; masked loads never touch a float past
 * s[(n - 1) * S]. */
PCB_AMX_TARGET static inline __m512i pcb_amx_gather_run(const float *s, int S, int q, int n)
{
    const int k = n - q >= 16 ? 16 : n - q;
    if (S == 1) return _mm512_maskz_loadu_epi32(k == 16 ? (__mmask16)0xffff : (__mmask16)((1u << k) - 1u), s + q);
    const int need = 2 * k - 1;  /* floats from s + 2q */
    const __mmask16 lo = need >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << need) - 1u);
    const __mmask16 hi = need <= 16 ? (__mmask16)0 : (__mmask16)((1u << (need - 16)) - 1u);
    const __m512i a = _mm512_maskz_loadu_epi32(lo, s + 2 * q), b = _mm512_maskz_loadu_epi32(hi, s + 2 * q + 16);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_epi32(a, even, b);
}

/* e[q] = bf16 s0[q S] | bf16 s1[q S] << 16 for q < n (S 1 or 2; s1 NULL: a zero high half), in masked
 * vectors: a short row (8 or 16 pixels) is one or two of them rather than a scalar loop tail. */
PCB_AMX_TARGET static inline void pcb_amx_pair_run(const float *restrict s0, const float *restrict s1, int S,
                                                   uint32_t *restrict e, int n)
{
    for (int q = 0; q < n; q += 16) {
        const int k = n - q >= 16 ? 16 : n - q;
        __m512i r = pcb_bf16v(pcb_amx_gather_run(s0, S, q, n));
        if (s1 != NULL) r = _mm512_or_si512(r, _mm512_slli_epi32(pcb_bf16v(pcb_amx_gather_run(s1, S, q, n)), 16));
        _mm512_mask_storeu_epi32(e + q, k == 16 ? (__mmask16)0xffff : (__mmask16)((1u << k) - 1u), r);
    }
}

/* A block's channel-pair image at stride S: S x S phase images, phase (a, b) holding padded pixel
 * (r * S + a, c * S + b) at row r - r0 and column c < Wg of its planes (r0 = p0, the block's first
 * output row), for RR rows; zero outside x (C, H, W), past C and up to L words per plane. Plane
 * (phase, cp) lies at ((a * S + b) * cpp + cp) * L; phases no tap reads (a or b >= K) are skipped. At
 * stride 1 the one phase is the padded image itself (Wg = W + 2 pad). */
PCB_AMX_TARGET static void pcb_amx_cpimage(const float *restrict x, int C, int H, int W, int pad, int S, int K,
                                           int p0, int RR, int cpp, int Wg, pc_idx L, uint32_t *restrict img)
{
    for (int a = 0; a < S && a < K; a++)
        for (int b = 0; b < S && b < K; b++)
            for (int cp = 0; cp < cpp; cp++) {
                uint32_t *plane = img + ((pc_idx)(a * S + b) * cpp + cp) * L, *d = plane;
                const float *x0 = 2 * cp < C ? x + (pc_idx)(2 * cp) * H * W : NULL;
                const float *x1 = 2 * cp + 1 < C ? x + (pc_idx)(2 * cp + 1) * H * W : NULL;
                /* the phase's columns that fall inside the input: c * S + b - pad in [0, W) */
                int c_lo = pad - b > 0 ? (pad - b + S - 1) / S : 0;
                int c_hi = W + pad - b > 0 ? (W + pad - b + S - 1) / S : 0;
                if (c_hi > Wg) c_hi = Wg;
                for (int r = 0; r < RR; r++, d += Wg) {
                    int h = (p0 + r) * S + a - pad;
                    if (x0 == NULL || h < 0 || h >= H || c_lo >= c_hi) {
                        memset(d, 0, sizeof(uint32_t) * (size_t)Wg);
                        continue;
                    }
                    for (int c = 0; c < c_lo; c++) d[c] = 0;
                    for (int c = c_hi; c < Wg; c++) d[c] = 0;
                    const float *s0 = x0 + (pc_idx)h * W + (pc_idx)c_lo * S + b - pad;
                    uint32_t *e = d + c_lo;
                    int n = c_hi - c_lo;
                    if (S <= 2) {
                        pcb_amx_pair_run(s0, x1 != NULL ? s0 + (pc_idx)H * W : NULL, S, e, n);
                    } else {
                        for (int q = 0; q < n; q++)
                            e[q] = pcb_bf16(s0[(pc_idx)q * S]) | (x1 != NULL ? pcb_bf16(s0[(pc_idx)H * W + (pc_idx)q * S]) << 16 : 0u);
                    }
                }
                memset(plane + (pc_idx)RR * Wg, 0, sizeof(uint32_t) * (size_t)(L - (pc_idx)RR * Wg));
            }
}

/* Output rows [p0, p1) of one image's y (O, P, Q) = conv(img, wa) + b at stride S: img from
 * pcb_amx_cpimage for the same p0 (RR = p1 - p0 + (K - 1) / S rows of Wg columns), wa from
 * pcb_amx_wpack; tap (kh, kw) reads phase (kh % S, kw % S) at (kh / S, kw / S). cb: 32 x 32 floats,
 * 64-byte aligned. */
PCB_AMX_TARGET static void pcb_amx_conv_rows(const uint32_t *img, pc_idx L, int cpp, int S, int Wg,
                                             const uint32_t *wa, int O, int K, const float *b, float *restrict y,
                                             int P, int Q, int p0, int p1, float *restrict cb)
{
    const int Wp = Wg, kc = cpp < 16 ? cpp : 16;
    const pc_idx KK = (pc_idx)K * K, kt = KK * cpp, npf = (pc_idx)(p1 - p0) * Wp, PQ = (pc_idx)P * Q;
    pcb_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) {  /* C */
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    for (int i = 4; i < 6; i++) {  /* A: 16 filters x kc pairs */
        cfg.colsb[i] = (uint16_t)(4 * kc);
        cfg.rows[i] = 16;
    }
    for (int i = 6; i < 8; i++) {  /* B: kc pairs x 16 outputs */
        cfg.colsb[i] = 64;
        cfg.rows[i] = (uint8_t)kc;
    }
    _tile_loadconfig(&cfg);
    const pc_idx as = kt * (pc_idx)sizeof(uint32_t), bs = L * (pc_idx)sizeof(uint32_t);
    PCB_AMX_FENCE();
    /* filters outside: a block's 32 filters of every tap (as tiles) are read again for each run of
     * 32 outputs, so they stay in L1 while the image passes */
    for (int o0 = 0; o0 < O; o0 += 32) {
        const int two_a = O - o0 > 16, nr = O - o0 < 32 ? O - o0 : 32;
        const uint32_t *wo = wa + (pc_idx)o0 * kt;
        for (pc_idx j0 = 0; j0 < npf; j0 += 32) {
            /* which of the 32 outputs are kept, and where the first kept one of each half goes */
            __mmask16 keep[2];
            pc_idx at[2];
            for (int h = 0; h < 2; h++) {
                pc_idx j = j0 + 16 * h, r = j / Wp, q = j % Wp;
                unsigned m = 0;
                for (int i = 0, qi = (int)q; i < 16; i++) {
                    if (j + i < npf && qi < Q) m |= 1u << i;
                    if (++qi == Wp) qi = 0;
                }
                keep[h] = (__mmask16)m;
                at[h] = (pc_idx)p0 * Q + r * Q + (q < Q ? q : Q);
            }
            const int two_b = keep[1] != 0;
            pcb_amx_zero4();
            for (int kh = 0; kh < K; kh++)
                for (int kw = 0; kw < K; kw++) {
                    const pc_idx tap = (pc_idx)kh * K + kw;
                    const uint32_t *bt = img + (pc_idx)((kh % S) * S + kw % S) * cpp * L +
                                         (pc_idx)(kh / S) * Wp + kw / S + j0;
                    for (int c0 = 0; c0 < cpp; c0 += 16) {
                        const uint32_t *a0 = wo + tap * cpp + c0;
                        pcb_amx_step(a0, a0 + 16 * kt, as, bt + (pc_idx)c0 * L, bs, two_a, two_b);
                    }
                }
            pcb_amx_store4(cb, cb + 16 * 32, 128, two_a, two_b);
            for (int h = 0; h < 2; h++) {
                if (!keep[h]) continue;
                const __mmask16 st = (__mmask16)((1u << __builtin_popcount(keep[h])) - 1u);
                for (int r = 0; r < nr; r++) {
                    __m512 v = _mm512_load_ps(cb + r * 32 + 16 * h);
                    if (b != NULL) v = _mm512_add_ps(v, _mm512_set1_ps(b[o0 + r]));
                    _mm512_mask_storeu_ps(y + (pc_idx)(o0 + r) * PQ + at[h], st, _mm512_maskz_compress_ps(keep[h], v));
                }
            }
        }
    }
    _tile_release();
}
#endif

PCB_TARGET static void pcb_gemm_r(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, const pc_idx *amap,
                                  pc_idx rows, const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp,
                                  pc_idx rs, int rq, float *Cm, pc_idx ldc, pc_idx cols,
                                  const float *brow, const float *bcol, int accumulate, int rows_outer);

/* Cm (rows x cols) (= or +=) A B over kp pairs, in tiles. Row r of A is arow[r] where given (rows
 * scattered over shifted views), else A + r * lda; B's rows as pcb_tile's. Column blocks of PCB_NR
 * outside (one block of B, kp x 32 pairs, stays in cache while every block of A's rows passes),
 * or with rows_outer, blocks of PCB_MR rows outside (8 rows of A stay in L1 while B passes: for a
 * weight gradient, whose A, im2col's rows, is the larger operand). */
PCB_TARGET static void pcb_gemm_o(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, pc_idx rows,
                                  const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp,
                                  float *Cm, pc_idx ldc, pc_idx cols,
                                  const float *brow, const float *bcol, int accumulate, int rows_outer)
{
    pcb_gemm_r(A, lda, arow, NULL, rows, B, boff, ldb, kp, 0, 0, Cm, ldc, cols, brow, bcol, accumulate, rows_outer);
}

/* pcb_gemm_o whose columns are output rows of rq (16 or 8) pixels lying rs words apart in B (see
 * pcb_tile; rs = 0: plain columns), and whose A elements may be picked through amap. */
PCB_TARGET static void pcb_gemm_r(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, const pc_idx *amap,
                                  pc_idx rows, const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp,
                                  pc_idx rs, int rq, float *Cm, pc_idx ldc, pc_idx cols,
                                  const float *brow, const float *bcol, int accumulate, int rows_outer)
{
#ifdef PCB_AMX
    if (pcb_amx_on && pcb_amx_gemm(A, lda, arow, amap, rows, B, boff, ldb, kp, rs, rq, Cm, ldc, cols, brow, bcol,
                                   accumulate, rows_outer))
        return;
#endif
    const uint32_t *rowp[PCB_MR];
    pc_idx nj = (cols + PCB_NR - 1) / PCB_NR, nr_ = (rows + PCB_MR - 1) / PCB_MR;
    for (pc_idx u = 0; u < nj * nr_; u++) {
        pc_idx j = (rows_outer ? u % nj : u / nr_) * PCB_NR, r = (rows_outer ? u / nj : u % nr_) * PCB_MR;
        int nc = (int)(cols - j < PCB_NR ? cols - j : PCB_NR);
        int nr = (int)(rows - r < PCB_MR ? rows - r : PCB_MR);
        const uint32_t *const *ap = arow + r;
        if (arow == NULL) {
            for (int i = 0; i < nr; i++) rowp[i] = A + (r + i) * lda;
            ap = rowp;
        }
        pcb_tile(ap, amap, nr, B + (rs ? j / rq * rs : j), boff, ldb, kp, rs, rq, Cm + r * ldc + j, ldc, nc,
                 brow ? brow + r : NULL, bcol ? bcol + j : NULL, accumulate);
    }
}

static inline void pcb_gemm_x(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, pc_idx rows,
                              const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp,
                              float *Cm, pc_idx ldc, pc_idx cols,
                              const float *brow, const float *bcol, int accumulate)
{
    pcb_gemm_o(A, lda, arow, rows, B, boff, ldb, kp, Cm, ldc, cols, brow, bcol, accumulate, 0);
}

static inline void pcb_gemm(const uint32_t *A, pc_idx lda, pc_idx rows, const uint32_t *B, pc_idx ldb, pc_idx kp,
                            float *Cm, pc_idx ldc, pc_idx cols, const float *brow, const float *bcol, int accumulate)
{
    pcb_gemm_x(A, lda, NULL, rows, B, NULL, ldb, kp, Cm, ldc, cols, brow, bcol, accumulate);
}

/* Seconds of `iters` rounds of 12 independent VDPBF16PS (dot = 1) or VFMADD231PS (dot = 0) on zmm
 * registers: their issue rate, not their latency. The operands are zero, so no value is denormal. */
PCB_TARGET static double pcb_issue_seconds(int dot, long iters)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m512 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    const __m512 x = _mm512_setzero_ps();
    const __m512bh h = (__m512bh)_mm512_setzero_si512();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (dot) {
        for (long i = 0; i < iters; i++) {
#define PCB_D(a) a = _mm512_dpbf16_ps(a, h, h); __asm__ volatile("" : "+v"(a));
            PCB_D(a0) PCB_D(a1) PCB_D(a2) PCB_D(a3) PCB_D(a4) PCB_D(a5)
            PCB_D(a6) PCB_D(a7) PCB_D(a8) PCB_D(a9) PCB_D(a10) PCB_D(a11)
#undef PCB_D
        }
    } else {
        for (long i = 0; i < iters; i++) {
#define PCB_F(a) a = _mm512_fmadd_ps(a, x, x); __asm__ volatile("" : "+v"(a));
            PCB_F(a0) PCB_F(a1) PCB_F(a2) PCB_F(a3) PCB_F(a4) PCB_F(a5)
            PCB_F(a6) PCB_F(a7) PCB_F(a8) PCB_F(a9) PCB_F(a10) PCB_F(a11)
#undef PCB_F
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

#else
#define PCB_NATIVE 0
static int pcb_cpu_native(void) { return 0; }
static double pcb_issue_seconds(int dot, long iters) { (void)dot; (void)iters; return 0.0; }

/* this level has no VDPBF16PS: _bf16.pyx raises before any caller gets here */
static void pcb_gemm_o(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, pc_idx rows,
                       const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp, float *Cm, pc_idx ldc,
                       pc_idx cols, const float *brow, const float *bcol, int accumulate, int rows_outer)
{
    (void)A; (void)lda; (void)arow; (void)rows; (void)B; (void)boff; (void)ldb; (void)kp;
    (void)Cm; (void)ldc; (void)cols; (void)brow; (void)bcol; (void)accumulate; (void)rows_outer;
}

static void pcb_gemm_r(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, const pc_idx *amap,
                       pc_idx rows, const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp, pc_idx rs, int rq,
                       float *Cm, pc_idx ldc, pc_idx cols, const float *brow, const float *bcol, int accumulate,
                       int rows_outer)
{
    (void)rs; (void)rq; (void)amap;
    pcb_gemm_o(A, lda, arow, rows, B, boff, ldb, kp, Cm, ldc, cols, brow, bcol, accumulate, rows_outer);
}

static inline void pcb_gemm_x(const uint32_t *A, pc_idx lda, const uint32_t *const *arow, pc_idx rows,
                              const uint32_t *B, const pc_idx *boff, pc_idx ldb, pc_idx kp, float *Cm, pc_idx ldc,
                              pc_idx cols, const float *brow, const float *bcol, int accumulate)
{
    pcb_gemm_o(A, lda, arow, rows, B, boff, ldb, kp, Cm, ldc, cols, brow, bcol, accumulate, 0);
}

static inline void pcb_gemm(const uint32_t *A, pc_idx lda, pc_idx rows, const uint32_t *B, pc_idx ldb, pc_idx kp,
                            float *Cm, pc_idx ldc, pc_idx cols, const float *brow, const float *bcol, int accumulate)
{
    pcb_gemm_x(A, lda, NULL, rows, B, NULL, ldb, kp, Cm, ldc, cols, brow, bcol, accumulate);
}
#endif

/* ------------------------------------------------------------ convolution blocks */

/* Forward for output rows [p0, p1) of one image: y[o][p][q] = b[o] + sum_k wr[o][k] cols[k][p, q].
 * wr: the rounded filters as pairs [O][kp] (kp = ceil(Kd/2)); panel: kp x ldb pairs, ldb =
 * up16(npix); xb: C x pcb_block_rows x (W + 2 pad) u16. y: the image's (O, P, Q) output. */
static inline void pcb_conv_fwd_block(const float *restrict x, int C, int H, int W, const uint32_t *restrict wr,
                                      int O, int K, int S, int pad, const float *restrict b,
                                      float *restrict y, int P, int Q, int p0, int p1,
                                      uint32_t *restrict panel, uint16_t *restrict xb)
{
    pc_idx npix = (pc_idx)(p1 - p0) * Q, ldb = pcb_up16(npix), kp = ((pc_idx)C * K * K + 1) / 2;
    int R = pcb_block_rows(p0, p1, K, S), Wp = W + 2 * pad;
    pcb_pad_rows(x, C, H, W, pad, p0 * S, R, xb);
    pcb_im2col_pairs(xb, R, Wp, C * K * K, K, S, Q, p0, p1, panel, ldb);
    pcb_gemm(wr, kp, O, panel, ldb, kp, y + (pc_idx)p0 * Q, (pc_idx)P * Q, npix, b, NULL, 0);
}

/* Weight gradient of output rows [p0, p1) of one image, added into part (Kd x ldo, transposed):
 * part[k][o] += sum_pix cols[k][pix] dy[o][pix]. cols: Kd x npp pairs (npp = ceil(npix/2)) along the
 * pixels, straight from im2col; dyt: npp x ldo pairs (ldo = up16(O)); xb as pcb_conv_fwd_block's. */
static inline void pcb_conv_dw_block(const float *restrict x, int C, int H, int W, int K, int S, int pad,
                                     const float *restrict dy, int O, int P, int Q, int p0, int p1,
                                     float *restrict part, pc_idx ldo, uint32_t *restrict cols,
                                     uint32_t *restrict dyt, uint16_t *restrict xb)
{
    int Kd = C * K * K, R = pcb_block_rows(p0, p1, K, S), Wp = W + 2 * pad;
    pc_idx npix = (pc_idx)(p1 - p0) * Q, npp = (npix + 1) / 2;
    pcb_pad_rows(x, C, H, W, pad, p0 * S, R, xb);
    for (int k = 0; k < Kd; k++) {
        uint16_t *row = (uint16_t *)(cols + (pc_idx)k * npp);
        for (int p = p0; p < p1; p++, row += Q) {
            const uint16_t *s = pcb_tap(xb, R, Wp, K, S, p0, p, k);
            if (S == 1) {
                memcpy(row, s, sizeof(uint16_t) * (size_t)Q);
            } else {
                for (int q = 0; q < Q; q++) row[q] = s[q * S];
            }
        }
        if (npix & 1) *row = 0;
    }
    pcb_pack_along_t(dy + (pc_idx)p0 * Q, (pc_idx)P * Q, O, npix, dyt, ldo, 0, npp);
    pcb_gemm(cols, npp, Kd, dyt, ldo, npp, part, ldo, O, NULL, NULL, 1);
}

/* ------------------------------------------------------------ stride 1 without im2col
 * (A 1x1 kernel without padding at stride S > 1 is the stride-1 convolution of the subsampled image,
 * so it takes this path too, with Wp = Q.)
 * At stride 1 every tap of a block of output rows [p0, p0 + nr) is a shifted view of the block's
 * padded input rows laid end to end: with the flat pixel index j = (p - p0) * Wp + q, q < Wp
 * (Wp = W + 2 pad; the K - 1 columns q >= Q are computed and dropped), tap (c, kh, kw) reads
 * xb[c][j + kh * Wp + kw]. Pairs of taps are then pairs of such views, built once per block
 * instead of once per output pixel and tap:
 *   hz[c][j] = (xb[c][j], xb[c][j + 1])   taps (kh, kw), (kh, kw + 1) of channel c, kw even < K - 1;
 *   cp[c/2][j] = (xb[c][j], xb[c + 1][j]) taps (kh, K - 1) of channels c and c + 1 (K odd; the last
 *                                         channel of an odd C pairs with a literal zero).
 * For K = 3 that is 4.5 pairs per channel, exactly the 9 taps, and 1.5 words per input element. */

/* Pairs of taps per convolution at stride 1 (the reduction length of the GEMM). */
static inline pc_idx pcb_s1_pairs(int C, int K)
{
    return (pc_idx)C * K * (K / 2) + (K & 1 ? (pc_idx)((C + 1) / 2) * K : 0);
}

/* Words per channel of a block's flat buffers for nr output rows: the nr + K - 1 input rows, a zero
 * row and slack for the last vector's reads past the end of a view; even, so u32 views of the u16
 * buffer stay aligned. */
static inline pc_idx pcb_s1_len(int nr, int K, int Wp) { return ((pc_idx)(nr + K) * Wp + K + 64 + 1) & ~(pc_idx)1; }

/* The pair schedule: boff[t] (where pair t's view starts in the block's images: hz at 0, cp at C*L
 * words) and the filters' matching pairs ws[o][t], rounded; by channel pairs, so the views a tile
 * reads in a row lie close. w: (O, C, K, K). */
static inline void pcb_s1_schedule(const float *restrict w, int O, int C, int K, int Wp, pc_idx L,
                                   pc_idx *restrict boff, uint32_t *restrict ws)
{
    pc_idx kp = pcb_s1_pairs(C, K), KK = (pc_idx)K * K;
    for (int o = 0; o < O; o++) {
        const float *wo = w + (pc_idx)o * C * KK;
        uint32_t *d = ws + (pc_idx)o * kp;
        pc_idx t = 0;
        for (int c0 = 0; c0 < C; c0 += 2) {
            for (int c = c0; c < C && c < c0 + 2; c++) {
                const float *wc = wo + c * KK;
                for (int kh = 0; kh < K; kh++)
                    for (int kw = 0; kw + 1 < K; kw += 2, t++) {
                        boff[t] = (pc_idx)c * L + (pc_idx)kh * Wp + kw;
                        d[t] = pcb_bf16(wc[kh * K + kw]) | pcb_bf16(wc[kh * K + kw + 1]) << 16;
                    }
            }
            if (K & 1)
                for (int kh = 0; kh < K; kh++, t++) {
                    boff[t] = (pc_idx)(C + c0 / 2) * L + (pc_idx)kh * Wp + K - 1;
                    uint32_t hi = c0 + 1 < C ? pcb_bf16(wo[(c0 + 1) * KK + kh * K + K - 1]) : 0;
                    d[t] = pcb_bf16(wo[c0 * KK + kh * K + K - 1]) | hi << 16;
                }
        }
        (void)kp;
    }
}

/* The block's flat input: m images' padded rows [p0, p1 + K - 1) (RR = p1 - p0 + K - 1 rows each) laid
 * end to end per channel, xb[c][(i * RR + r) * Wp + w'] = bf16(x_i[c][p0 + r - pad][w' - pad]), zero
 * elsewhere up to L. Stacking the images of a block (m > 1, whole images) turns small planes into
 * one long GEMM: the K - 1 rows between two images are output rows computed and dropped. */
static inline void pcb_s1_flat(const float *restrict x, int m, int C, int H, int W, int pad, int S, int p0, int p1,
                               int K, int Q, uint16_t *restrict xb, pc_idx L)
{
    int Wp = Q + K - 1, RR = p1 - p0 + K - 1;
    pc_idx used = (pc_idx)m * RR * Wp;
    pc_idx ahead = 1024 / ((pc_idx)H * W) > 2 ? 1024 / ((pc_idx)H * W) : 2;  /* planes, >= 4 KiB ahead */
    for (int i = 0; i < m; i++)  /* x in memory order */
        for (int c = 0; c < C; c++) {
            const float *xc = x + ((pc_idx)i * C + c) * H * W;
            uint16_t *d = xb + (pc_idx)c * L + (pc_idx)i * RR * Wp;
            if (S == 1) {
                /* the block's rows of the plane after next: a short plane is over before the hardware
                 * prefetcher has found its stream */
                if ((pc_idx)i * C + c + ahead < (pc_idx)m * C) {
                    int h0 = p0 - pad > 0 ? p0 - pad : 0, h1 = p0 - pad + RR < H ? p0 - pad + RR : H;
                    const float *nx = xc + ahead * (pc_idx)H * W;
                    for (pc_idx e = (pc_idx)h0 * W; e < (pc_idx)h1 * W; e += 16) __builtin_prefetch(nx + e);
                }
                pcb_pad_rows(xc, 1, H, W, pad, p0, RR, d);
                continue;
            }
            /* a 1x1 kernel without padding at stride S: the convolution of the subsampled image */
            for (int r = 0; r < RR; r++) {
                const float *s = xc + (pc_idx)(p0 + r) * S * W;
                for (int q = 0; q < Q; q++) d[(pc_idx)r * Wp + q] = (uint16_t)pcb_bf16(s[(pc_idx)q * S]);
            }
        }
    for (int c = 0; c < C; c++)
        memset(xb + (pc_idx)c * L + used, 0, sizeof(uint16_t) * (size_t)(L - used));
}

/* Output rows of a block in the flat index: (m - 1) * RR + p1 - p0. */
static inline int pcb_s1_rows(int m, int p0, int p1, int K) { return (m - 1) * (p1 - p0 + K - 1) + p1 - p0; }

/* Forward at stride 1 for output rows [p0, p1) of m images (see above). ws, boff: pcb_s1_schedule;
 * xb: C x L u16; img: (C + ceil(C/2)) x L words; acc: O x up16(rows * Wp) floats. Rows whose Q is a
 * whole number of vectors are multiplied straight into y (no dropped columns computed); others,
 * all rows of the block in one GEMM over the flat index, then copied out without the dropped ones. */
static inline void pcb_s1_fwd_block(const float *restrict x, int m, int C, int H, int W, int K, int pad, int S,
                                    const uint32_t *restrict ws, const pc_idx *restrict boff, int O,
                                    const float *restrict b, float *restrict y, int P, int Q, int p0, int p1,
                                    pc_idx L, uint16_t *restrict xb, uint32_t *restrict img, float *restrict acc)
{
    int Wp = Q + K - 1, RR = p1 - p0 + K - 1;
    pc_idx kp = pcb_s1_pairs(C, K), npf = (pc_idx)pcb_s1_rows(m, p0, p1, K) * Wp, lda = pcb_up16(npf);
    pcb_s1_flat(x, m, C, H, W, pad, S, p0, p1, K, Q, xb, L);
    if (K > 1) {
        for (int c = 0; c < C; c++) {
            const uint16_t *s = xb + (pc_idx)c * L;
            uint32_t *hz = img + (pc_idx)c * L;
            PC_SIMD
            for (pc_idx j = 0; j < L - 1; j++) hz[j] = (uint32_t)s[j] | (uint32_t)s[j + 1] << 16;
            hz[L - 1] = s[L - 1];
        }
    }
    if (K & 1) {
        for (int c = 0; c < C; c += 2) {
            const uint16_t *s0 = xb + (pc_idx)c * L;
            uint32_t *d = img + (pc_idx)(C + c / 2) * L;
            if (c + 1 < C) {
                const uint16_t *s1 = s0 + L;
                PC_SIMD
                for (pc_idx j = 0; j < L; j++) d[j] = (uint32_t)s0[j] | (uint32_t)s1[j] << 16;
            } else {
                PC_SIMD
                for (pc_idx j = 0; j < L; j++) d[j] = s0[j];
            }
        }
    }
    if (Q % 32 == 0) {  /* straight into y, one output row at a time */
        for (int i = 0; i < m; i++)
            for (int p = p0; p < p1; p++)
                pcb_gemm_x(ws, kp, NULL, O, img + ((pc_idx)i * RR + p - p0) * Wp, boff, 0, kp,
                           y + ((pc_idx)i * O * P + p) * Q, (pc_idx)P * Q, Q, b, NULL, 0);
        return;
    }
    if (Q == 16 || Q == 8) {  /* straight into y, two rows of 16 or four of 8 per tile */
        for (int i = 0; i < m; i++)
            pcb_gemm_r(ws, kp, NULL, NULL, O, img + (pc_idx)i * RR * Wp, boff, 0, kp, Wp, Q,
                       y + (pc_idx)i * O * P * Q + (pc_idx)p0 * Q, (pc_idx)P * Q, (pc_idx)(p1 - p0) * Q,
                       b, NULL, 0, 0);
        return;
    }
    pcb_gemm_x(ws, kp, NULL, O, img, boff, 0, kp, acc, lda, npf, NULL, NULL, 0);
    for (int i = 0; i < m; i++) for (int o = 0; o < O; o++) {
        float bo = b ? b[o] : 0.0f;
        for (int p = p0; p < p1; p++) {
            const float *s = acc + (pc_idx)o * lda + ((pc_idx)i * RR + p - p0) * Wp;
            float *d = y + (((pc_idx)i * O + o) * P + p) * Q;
            if (b) {
                PC_SIMD
                for (int q = 0; q < Q; q++) d[q] = s[q] + bo;
            } else {
                memcpy(d, s, sizeof(float) * (size_t)Q);
            }
        }
    }
}

/* Where im2col's rows start for pcb_s1_dw_block (the same for every block of a thread's buffers):
 * row k = (c, kh, kw) is the view of xb at c * L + kh * Wp + kw, read as pairs of pixels, from the
 * copy of xb shifted by one element (at xb + C * L) where that offset is odd. */
static inline void pcb_s1_dw_rows(int C, int K, int Wp, pc_idx L, const uint16_t *xb, const uint32_t **arow)
{
    const uint16_t *xb1 = xb + (pc_idx)C * L;
    pc_idx k = 0;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < K; kh++)
            for (int kw = 0; kw < K; kw++, k++) {
                pc_idx off = (pc_idx)c * L + (pc_idx)kh * Wp + kw;
                arow[k] = (const uint32_t *)(off & 1 ? xb1 + off - 1 : xb + off);
            }
}

/* Weight gradient at stride 1 of output rows [p0, p1) of one image, added into part (Kd x ldo,
 * transposed): im2col's row k is the view of xb at tap k's offset, read as pairs of pixels (from
 * a copy of xb shifted by one element where the offset is odd), so no im2col is built. The
 * dropped columns q >= Q carry dy = 0. xb: 2 x C x L u16; arow: pcb_s1_dw_rows; dyt: npp x up32(ldo) words
 * (npp = ceil(nr * Wp / 2)) and then O x npp words of scratch; amap: npp indices. */
static inline void pcb_s1_dw_block(const float *restrict x, int m, int C, int H, int W, int K, int pad, int S,
                                   const float *restrict dy, int O, int P, int Q, int p0, int p1, pc_idx L,
                                   float *restrict part, pc_idx ldo, uint16_t *restrict xb,
                                   const uint32_t **restrict arow, uint32_t *restrict dyt, pc_idx *restrict amap,
                                   int rows_outer)
{
    int Wp = Q + K - 1, Kd = C * K * K, RR = p1 - p0 + K - 1;
    pc_idx npf = (pc_idx)pcb_s1_rows(m, p0, p1, K) * Wp, npp = (npf + 1) / 2, CL = (pc_idx)C * L;
    uint16_t *xb1 = xb + CL;
    pcb_s1_flat(x, m, C, H, W, pad, S, p0, p1, K, Q, xb, L);
    if (K > 1) {  /* a 1x1 kernel's views all start at even offsets (L is even) */
        memcpy(xb1, xb + 1, sizeof(uint16_t) * (size_t)(CL - 1));
        xb1[CL - 1] = 0;
    }
    int cw = ldo < PCB_NR ? (int)ldo : PCB_NR;
    if (Wp % 2 == 0 && Q % 2 == 0) {
        /* Every row holds Q / 2 whole pairs of valid pixels and whole pairs of dropped ones, so the
         * valid pairs are dy's own pixel pairs in memory order: rounded and transposed into dyt in one
         * pass over dy (through an L1 tile), without the flat copy and its strided transposition. */
        enum { CH = 32 };
        uint16_t tile[PCB_NR][2 * CH];  /* rounded pixels; pixel pairs read as words (little-endian) */
        int nr = p1 - p0, hq = Q / 2;
        pc_idx half = (pc_idx)nr * hq, nv = (pc_idx)m * half, t = 0;
        for (int i = 0; i < m; i++)
            for (int r = 0; r < nr; r++) {
                pc_idx base = ((pc_idx)i * RR + r) * (Wp / 2);
                for (int qq = 0; qq < hq; qq++) amap[t++] = base + qq;
            }
        for (int o0 = 0; o0 < O; o0 += PCB_NR) {
            int n = O - o0 < cw ? O - o0 : cw;
            uint32_t *blk = dyt + (pc_idx)o0 * nv;
            for (int i = 0; i < m; i++)
                for (pc_idx u0 = 0; u0 < half; u0 += CH) {
                    int cnt = half - u0 < CH ? (int)(half - u0) : CH;
                    for (int o = 0; o < n; o++) {
                        const float *src = dy + (((pc_idx)i * O + o0 + o) * P + p0) * Q + 2 * u0;
                        uint16_t *tr = tile[o];
                        /* this filter's next chunk (here or in the next image): one of up to 32
                         * streams read in step */
                        const float *nxt = u0 + CH < half ? src + 2 * CH
                                           : i + 1 < m ? dy + (((pc_idx)(i + 1) * O + o0 + o) * P + p0) * Q : NULL;
                        if (nxt != NULL)
                            for (int l = 0; l < 2 * CH; l += 16) __builtin_prefetch(nxt + l);
                        PC_SIMD
                        for (int k = 0; k < 2 * cnt; k++) tr[k] = (uint16_t)pcb_bf16(src[k]);
                    }
                    uint32_t *d = blk + ((pc_idx)i * half + u0) * cw;
                    for (int k = 0; k < cnt; k++, d += cw) {
                        for (int o = 0; o < n; o++) d[o] = (uint32_t)tile[o][2 * k] | (uint32_t)tile[o][2 * k + 1] << 16;
                        for (int o = n; o < cw; o++) d[o] = 0;
                    }
                }
        }
        pcb_gemm_r(NULL, 0, arow, amap, Kd, dyt, NULL, cw, nv, nv * PCB_NR, PCB_NR, part, ldo, O, NULL, NULL, 1,
                   rows_outer);
        return;
    }
    /* dyt[jp][o] = (dy at flat pixel 2jp, at 2jp + 1), zero on the dropped columns and past the end:
     * each filter's rows rounded into flat rows first (vectorised), then one transposing pass of words */
    uint16_t *h = (uint16_t *)(dyt + npp * ((ldo + PCB_NR - 1) / PCB_NR * PCB_NR));
    for (int i = 0; i < m; i++) {  /* dy in memory order, so the hardware prefetcher follows */
        for (int o = 0; o < O; o++) {
            uint16_t *d = h + (pc_idx)o * 2 * npp + (pc_idx)i * RR * Wp;
            const float *s = dy + (((pc_idx)i * O + o) * P + p0) * Q;
            pcb_round_rows(s, p1 - p0, Q, d, Wp);
            for (int p = p0; p < p1; p++, d += Wp)
                for (int q = Q; q < Wp; q++) d[q] = 0;
            /* the rows between two images, and the odd pixel at the end */
            pc_idx end = i + 1 < m ? (pc_idx)(i + 1) * RR * Wp : 2 * npp;
            pc_idx at = (pc_idx)i * RR * Wp + (pc_idx)(p1 - p0) * Wp;
            if (end > at) memset(h + (pc_idx)o * 2 * npp + at, 0, sizeof(uint16_t) * (size_t)(end - at));
        }
    }
    /* the reduction runs over the pairs that hold a valid pixel only (amap), not the dropped columns
     * and the rows between stacked images */
    int nr = p1 - p0, nrow = (int)(npf / Wp);
    pc_idx nv = 0;
    for (pc_idx jp = 0; jp < npp; jp++) {
        pc_idx j = 2 * jp;
        int r0 = (int)(j / Wp), q0 = (int)(j % Wp), r1 = (int)((j + 1) / Wp), q1 = (int)((j + 1) % Wp);
        int v0 = r0 < nrow && r0 % RR < nr && q0 < Q, v1 = r1 < nrow && r1 % RR < nr && q1 < Q;
        if (v0 || v1) amap[nv++] = jp;
    }
    /* dyt in blocks of 32 filters, [O / 32][nv][cw]: each block's pairs one contiguous stream */
    const uint32_t *h32 = (const uint32_t *)h;
    for (int o0 = 0; o0 < O; o0 += PCB_NR) {
        int n = O - o0 < cw ? O - o0 : cw;
        uint32_t *d = dyt + (pc_idx)o0 * nv;
        for (pc_idx t = 0; t < nv; t++, d += cw) {
            pc_idx jp = amap[t];
            for (int o = 0; o < n; o++) d[o] = h32[(pc_idx)(o0 + o) * npp + jp];
            for (int o = n; o < cw; o++) d[o] = 0;
        }
    }
    pcb_gemm_r(NULL, 0, arow, amap, Kd, dyt, NULL, cw, nv, nv * PCB_NR, PCB_NR, part, ldo, O, NULL, NULL, 1,
               rows_outer);
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

#ifdef PCB_AMX
/* The weight gradient's flat input at stride S: for each phase (a, b) that a tap reads and each
 * channel, plane xb[((a * S + b) * C + c) * L] holds m images' phase rows stacked, RR rows of Wg
 * columns each: word (i * RR + r) * Wg + col = bf16 x_i[c][(p0 + r) * S + a - pad][col * S + b - pad],
 * zero outside x and up to L. */
PCB_AMX_TARGET static void pcb_amx_phase_flat(const float *restrict x, int m, int C, int H, int W, int pad, int S,
                                              int K, int p0, int RR, int Wg, pc_idx L, uint16_t *restrict xb)
{
    const pc_idx used = (pc_idx)m * RR * Wg;
    for (int a = 0; a < S && a < K; a++)
        for (int b = 0; b < S && b < K; b++) {
            int c_lo = pad - b > 0 ? (pad - b + S - 1) / S : 0;
            int c_hi = W + pad - b > 0 ? (W + pad - b + S - 1) / S : 0;
            if (c_hi > Wg) c_hi = Wg;
            for (int c = 0; c < C; c++) {
                uint16_t *plane = xb + ((pc_idx)(a * S + b) * C + c) * L;
                for (int i = 0; i < m; i++) {
                    const float *xc = x + ((pc_idx)i * C + c) * H * W;
                    for (int r = 0; r < RR; r++) {
                        uint16_t *d = plane + ((pc_idx)i * RR + r) * Wg;
                        int h = (p0 + r) * S + a - pad;
                        if (h < 0 || h >= H || c_lo >= c_hi) {
                            memset(d, 0, sizeof(uint16_t) * (size_t)Wg);
                            continue;
                        }
                        const float *src = xc + (pc_idx)h * W + (pc_idx)c_lo * S + b - pad;
                        for (int col = 0; col < c_lo; col++) d[col] = 0;
                        if (S == 2) {  /* masked vectors: rows of 4 to 16 columns are one of them */
                            const int n = c_hi - c_lo;
                            for (int q = 0; q < n; q += 16) {
                                const int k = n - q >= 16 ? 16 : n - q;
                                _mm512_mask_cvtepi32_storeu_epi16(d + c_lo + q, (__mmask16)(k == 16 ? 0xffffu : (1u << k) - 1u),
                                                                  pcb_bf16v(pcb_amx_gather_run(src, 2, q, n)));
                            }
                        } else {
                            for (int col = c_lo; col < c_hi; col++)
                                d[col] = (uint16_t)pcb_bf16(src[(pc_idx)(col - c_lo) * S]);
                        }
                        for (int col = c_hi; col < Wg; col++) d[col] = 0;
                    }
                }
                memset(plane + used, 0, sizeof(uint16_t) * (size_t)(L - used));
            }
        }
}

/* dst[j][i] = src[i][j] for a 16 x 16 block of words, in registers. */
PCB_AMX_TARGET static inline void pcb_tr16(const uint32_t *src, pc_idx lds, uint32_t *dst, pc_idx ldd)
{
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(src + i * lds));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(dst + i * ldd), r[i]);
}

/* Weight gradient at stride 1 on the tiles, for pcb_s1_dw_block's block (same arguments and
 * buffers): im2col's rows are the views of the flat input at each tap's offset, read as pixel pairs
 * (from the copy shifted by one element where the offset is odd), so the 16 channels of an A tile
 * lie L / 2 words apart and load in one strided read; B is dy's pixel pairs transposed, dyt[jp][o],
 * over every flat pair (dy = 0 on the dropped columns and between stacked images). Tiles of 32
 * channels x 32 filters per tap, loaded from part, summed over all the block's pairs and stored back.
 * An infinite or NaN input pixel meets the zero dy of the dropped columns here (0 x inf = NaN) where
 * the VDPBF16PS kernel skips those columns; with such an input the loss is not finite either.
 * dyt: up16(npp) x up16(O) words, then O x npp words of scratch. */
PCB_AMX_TARGET static void pcb_amx_dw_block(const float *restrict x, int m, int C, int H, int W, int K, int pad,
                                            int S, const float *restrict dy, int O, int P, int Q, int p0, int p1,
                                            pc_idx L, float *restrict part, pc_idx ldo, uint16_t *restrict xb,
                                            uint32_t *restrict dyt)
{
    /* stride 1 (and a 1x1 without padding, whose flat copy subsamples): one phase, the padded width;
     * other strides: S x S phase images of the block's rows, Wg columns each */
    const int flat1 = S == 1 || (K == 1 && pad == 0), Se = flat1 ? 1 : S;
    const int Wp = flat1 ? Q + K - 1 : (W + 2 * pad + S - 1) / S, ext = (K - 1) / Se;
    const int RR = p1 - p0 + ext, KK = K * K;
    const pc_idx npf = ((pc_idx)(m - 1) * RR + (p1 - p0)) * Wp, npp = (npf + 1) / 2;
    const pc_idx n16 = (npp + 15) & ~(pc_idx)15;
    const pc_idx ldt = ((pc_idx)O + 15) & ~(pc_idx)15;
    if (flat1)
        pcb_s1_flat(x, m, C, H, W, pad, S, p0, p1, K, Q, xb, L);
    else
        pcb_amx_phase_flat(x, m, C, H, W, pad, S, K, p0, RR, Wp, L, xb);
    /* dy's flat rows rounded (zero on the dropped columns, between images and past the end), then
     * transposed into pairs */
    uint16_t *h = (uint16_t *)(dyt + n16 * ldt);
    for (int i = 0; i < m; i++)
        for (int o = 0; o < O; o++) {
            uint16_t *d = h + (pc_idx)o * 2 * npp + (pc_idx)i * RR * Wp;
            pcb_round_rows(dy + (((pc_idx)i * O + o) * P + p0) * Q, p1 - p0, Q, d, Wp);
            for (int p = p0; p < p1; p++, d += Wp)
                for (int q = Q; q < Wp; q++) d[q] = 0;
            pc_idx end = i + 1 < m ? (pc_idx)(i + 1) * RR * Wp : 2 * npp;
            pc_idx at = (pc_idx)i * RR * Wp + (pc_idx)(p1 - p0) * Wp;
            if (end > at) memset(h + (pc_idx)o * 2 * npp + at, 0, sizeof(uint16_t) * (size_t)(end - at));
        }
    const uint32_t *h32 = (const uint32_t *)h;
    const pc_idx jfull = npp & ~(pc_idx)15, ofull = (pc_idx)O & ~(pc_idx)15;
    for (pc_idx jp = 0; jp < jfull; jp += 16)
        for (pc_idx o = 0; o < ofull; o += 16) pcb_tr16(h32 + o * npp + jp, npp, dyt + jp * ldt + o, ldt);
    for (pc_idx jp = 0; jp < n16; jp++) {  /* the edges: pairs past the last 16, filters past the last 16 */
        uint32_t *d = dyt + jp * ldt;
        for (pc_idx o = jp < jfull ? ofull : 0; o < ldt; o++) d[o] = jp < npp && o < O ? h32[o * npp + jp] : 0;
    }
    const pc_idx as = L * (pc_idx)sizeof(uint16_t), bs = ldt * (pc_idx)sizeof(uint32_t);
    PCB_AMX_FENCE();
    for (int c0 = 0; c0 < C; c0 += 32) {
        const int ra = C - c0 < 16 ? C - c0 : 16, rb2 = C - c0 - 16 < 16 ? C - c0 - 16 : 16;
        const int two_a = rb2 > 0;
        pcb_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) cfg.colsb[i] = 64;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)ra;
        cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(two_a ? rb2 : ra);
        cfg.rows[6] = cfg.rows[7] = 16;
        _tile_loadconfig(&cfg);
        /* a tap's A rows: the flat view at its offset, a byte address (a view at an odd offset pairs
         * the pixels (j + off, j + off + 1) with dy's pair (j, j + 1) all the same) */
#define PCB_DW_VIEW(k)                                                                                  \
    ((const char *)(xb + (pc_idx)((k) / K / Se) * Wp + (k) % K / Se +                                \
                    ((pc_idx)(((k) / K % Se) * Se + (k) % K % Se) * C + c0) * L))
        const pc_idx ps = (pc_idx)KK * ldo * (pc_idx)sizeof(float);
        int k = 0;
        if (!two_a && O <= 16)
            /* one tile of sums per tap: four taps at a time share each load of the dy tile (five tile
             * loads per four products instead of eight); the same sums in the same order */
            for (; k + 4 <= KK; k += 4) {
                const char *v0 = PCB_DW_VIEW(k), *v1 = PCB_DW_VIEW(k + 1), *v2 = PCB_DW_VIEW(k + 2),
                           *v3 = PCB_DW_VIEW(k + 3);
                float *q = part + ((pc_idx)c0 * KK + k) * ldo;
                _tile_loadd(0, q, ps);
                _tile_loadd(1, q + ldo, ps);
                _tile_loadd(2, q + 2 * ldo, ps);
                _tile_loadd(3, q + 3 * ldo, ps);
                for (pc_idx jp = 0; jp < n16; jp += 16) {
                    _tile_loadd(6, dyt + jp * ldt, bs);
                    _tile_loadd(4, v0 + 4 * jp, as);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(5, v1 + 4 * jp, as);
                    _tile_dpbf16ps(1, 5, 6);
                    _tile_loadd(4, v2 + 4 * jp, as);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_loadd(5, v3 + 4 * jp, as);
                    _tile_dpbf16ps(3, 5, 6);
                }
                _tile_stored(0, q, ps);
                _tile_stored(1, q + ldo, ps);
                _tile_stored(2, q + 2 * ldo, ps);
                _tile_stored(3, q + 3 * ldo, ps);
            }
        for (; k < KK; k++) {
            const char *a0 = PCB_DW_VIEW(k), *a1 = a0 + 16 * as;
            for (int o0 = 0; o0 < O; o0 += 32) {
                /* the sums go on from part's own rows (channels KK * ldo apart; the columns past O up
                 * to ldo are scratch) */
                const int two_b = O - o0 > 16;
                float *p0 = part + ((pc_idx)c0 * KK + k) * ldo + o0, *p1 = p0 + (pc_idx)16 * KK * ldo;
                _tile_loadd(0, p0, ps);
                if (two_b) _tile_loadd(1, p0 + 16, ps);
                if (two_a) {
                    _tile_loadd(2, p1, ps);
                    if (two_b) _tile_loadd(3, p1 + 16, ps);
                }
                for (pc_idx jp = 0; jp < n16; jp += 16)
                    pcb_amx_step(a0 + 4 * jp, a1 + 4 * jp, as, dyt + jp * ldt + o0, bs, two_a, two_b);
                pcb_amx_store4(p0, p1, ps, two_a, two_b);
            }
        }
#undef PCB_DW_VIEW
    }
    _tile_release();
}
/* The input gradient at stride S > 1 as S x S stride-1 convolutions of dy: dx's phase (r, s) (rows
 * h = S i + r, columns v = S j + s) is dy correlated with the taps kh = a + S t, kw = b + S u of w
 * (a = (r + pad) % S, b = (s + pad) % S), flipped and transposed, read e = (r + pad) / S rows and
 * (s + pad) / S columns further on; no col2im and no scatter of overlapping sums. Every phase has
 * K2 = ceil(K / S) taps a side (zero where kh or kw >= K). wsub: C x O x K2 x K2 floats of scratch;
 * wa: S * S packs of pcb_amx_wpack(C, O, K2). Returns a bit mask of the phases with any tap. */
static unsigned pcb_amx_dx_wpack(const float *restrict w, int O, int C, int K, int S, int pad, int cpp,
                                 float *restrict wsub, uint32_t *restrict wa)
{
    const int K2 = (K + S - 1) / S;
    const pc_idx pack = (((pc_idx)C + 15) & ~(pc_idx)15) * K2 * K2 * cpp;
    unsigned live = 0;
    for (int r = 0; r < S; r++)
        for (int s = 0; s < S; s++) {
            const int a = (r + pad) % S, b = (s + pad) % S;
            if (a < K && b < K) live |= 1u << (r * S + s);
            for (int c = 0; c < C; c++)
                for (int o = 0; o < O; o++)
                    for (int t = 0; t < K2; t++)
                        for (int u = 0; u < K2; u++) {
                            const int kh = a + S * (K2 - 1 - t), kw = b + S * (K2 - 1 - u);
                            wsub[(((pc_idx)c * O + o) * K2 + t) * K2 + u] =
                                kh < K && kw < K ? w[(((pc_idx)o * C + c) * K + kh) * K + kw] : 0.0f;
                        }
            pcb_amx_wpack(wsub, C, O, K2, cpp, wa + (pc_idx)(r * S + s) * pack);
        }
    return live;
}

/* dx rows S i + r of one image (C, H, W), i in [i0, i0 + n), from the phases' outputs ph[(r * S + s)]
 * [c][i - i0][j] (rows of Qs floats, phase s holding columns S j + s < W); the phases not in live are
 * zero. */
PCB_AMX_TARGET static void pcb_amx_dx_interleave(const float *restrict ph, pc_idx phase, int Qs, int C, int H,
                                                 int W, int S, int i0, int n, unsigned live, float *restrict dx)
{
    for (int c = 0; c < C; c++)
        for (int ii = 0; ii < n; ii++)
            for (int r = 0; r < S; r++) {
                const int h = S * (i0 + ii) + r;
                if (h >= H) continue;
                float *d = dx + ((pc_idx)c * H + h) * W;
                const pc_idx at = ((pc_idx)c * n + ii) * Qs;
                if (S == 2) {  /* the two phases of the row zipped in registers; a phase without taps is zero */
                    const float *e0 = live >> (2 * r) & 1u ? ph + (pc_idx)(2 * r) * phase + at : NULL;
                    const float *e1 = live >> (2 * r + 1) & 1u ? ph + (pc_idx)(2 * r + 1) * phase + at : NULL;
                    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
                    int v = 0;
                    for (; v + 32 <= W; v += 32) {
                        const __m512 p0 = e0 ? _mm512_loadu_ps(e0 + v / 2) : _mm512_setzero_ps();
                        const __m512 p1 = e1 ? _mm512_loadu_ps(e1 + v / 2) : _mm512_setzero_ps();
                        _mm512_storeu_ps(d + v, _mm512_permutex2var_ps(p0, lo, p1));
                        _mm512_storeu_ps(d + v + 16, _mm512_permutex2var_ps(p0, hi, p1));
                    }
                    for (; v < W; v++) {
                        const float *e = v & 1 ? e1 : e0;
                        d[v] = e ? e[v / 2] : 0.0f;
                    }
                    continue;
                }
                for (int v = 0; v < W; v++) {
                    const int s = v % S;
                    d[v] = live >> (r * S + s) & 1u ? ph[(pc_idx)(r * S + s) * phase + at + v / S] : 0.0f;
                }
            }
}
#endif

#ifndef PCB_AMX
/* no tiles on this level or platform: pcb_amx_init says so and _bf16.pyx calls nothing else */
static int pcb_amx_init(void) { return 0; }
static int pcb_amx_set(int on) { (void)on; return 0; }
static inline int pcb_amx_cpp(int C) { return (C + 1) / 2; }
static inline pc_idx pcb_amx_plane(int RR, int Wp, int K) { return (pc_idx)RR * Wp + K; }
static void pcb_amx_wpack(const float *w, int O, int C, int K, int cpp, uint32_t *wa)
{
    (void)w; (void)O; (void)C; (void)K; (void)cpp; (void)wa;
}
static void pcb_amx_cpimage(const float *x, int C, int H, int W, int pad, int S, int K, int p0, int RR, int cpp,
                            int Wg, pc_idx L, uint32_t *img)
{
    (void)x; (void)C; (void)H; (void)W; (void)pad; (void)S; (void)K; (void)p0; (void)RR; (void)cpp; (void)Wg;
    (void)L; (void)img;
}
static void pcb_amx_conv_rows(const uint32_t *img, pc_idx L, int cpp, int S, int Wg, const uint32_t *wa, int O,
                              int K, const float *b, float *y, int P, int Q, int p0, int p1, float *cb)
{
    (void)img; (void)L; (void)cpp; (void)S; (void)Wg; (void)wa; (void)O; (void)K; (void)b; (void)y; (void)P;
    (void)Q; (void)p0; (void)p1; (void)cb;
}
static unsigned pcb_amx_dx_wpack(const float *w, int O, int C, int K, int S, int pad, int cpp, float *wsub,
                                 uint32_t *wa)
{
    (void)w; (void)O; (void)C; (void)K; (void)S; (void)pad; (void)cpp; (void)wsub; (void)wa;
    return 0;
}
static void pcb_amx_dx_interleave(const float *ph, pc_idx phase, int Qs, int C, int H, int W, int S, int i0, int n,
                                  unsigned live, float *dx)
{
    (void)ph; (void)phase; (void)Qs; (void)C; (void)H; (void)W; (void)S; (void)i0; (void)n; (void)live; (void)dx;
}
static void pcb_amx_dw_block(const float *x, int m, int C, int H, int W, int K, int pad, int S, const float *dy,
                             int O, int P, int Q, int p0, int p1, pc_idx L, float *part, pc_idx ldo, uint16_t *xb,
                             uint32_t *dyt)
{
    (void)x; (void)m; (void)C; (void)H; (void)W; (void)K; (void)pad; (void)S; (void)dy; (void)O; (void)P;
    (void)Q; (void)p0; (void)p1; (void)L; (void)part; (void)ldo; (void)xb; (void)dyt;
}
#endif

#endif /* PC_BF16_H */
