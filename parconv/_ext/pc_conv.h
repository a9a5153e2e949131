/* Register-blocked convolution micro-kernels (implicit GEMM) of the direct convolution
 * (_conv_direct.pxi), also the GEMMs of the Winograd forward (_conv_winograd.pxi); their vector
 * type serves pc_dense.h and pc_fused.h.
 *
 * Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
 * K kernel, S stride. kdim = C*K*K is the GEMM depth, one k = (c, kh, kw).
 *
 * The product is y[o, s] = sum_k w[o, k] * B(k, s) over output positions s.
 * B is never materialised as a matrix: B(k, s) = base[off[k] + s] through a
 * table of k offsets, which covers two layouts:
 *
 *  - stride 1: base is the zero-padded image (C, Hp, Wp) and output (p, q)
 *    sits at s = p*Wp + q, so the input of tap (c, kh, kw) is
 *    base[c*Hp*Wp + kh*Wp + kw + s]: a shifted view, no im2col at all.
 *  - any stride: base is an im2col tile (kdim, ldb) and off[k] = k*ldb.
 *
 * A micro-kernel keeps MR filters x NR positions (NR = NV vectors) of sums in
 * registers for the whole k loop. Positions are walked either as "panels" of
 * NR consecutive s (the Wp - Q wrap-around columns of each row computed and
 * thrown away) or "row by row" (panels start at q = 0 of every output row, so
 * there is no wrap-around, only the last panel of a row may be partial); the
 * caller picks the cheaper walk and NV.
 *
 * Filters are read in place, (O, kdim) row-major, in blocks of the kernel's main
 * MR rows, then 8, 4, 2, 1 for the rest (the input gradient's flipped,
 * transposed filters are built once per call in the same layout).
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
#define PCC_NVMAX 4
typedef __m512 pcc_v;
#define PCC_ZERO() _mm512_setzero_ps()
#define PCC_LOADU(p) _mm512_loadu_ps(p)
#define PCC_SET1(x) _mm512_set1_ps(x)
#define PCC_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define PCC_STOREU(p, v) _mm512_storeu_ps((p), (v))
/* the first n (0 < n < 16) lanes of v to p */
#define PCC_STORE_FIRST(p, v, n) _mm512_mask_storeu_ps((p), (__mmask16)((1u << (n)) - 1u), (v))
#define PCC_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PCC_VEC 8
#define PCC_NVMAX 2
typedef __m256 pcc_v;
#define PCC_ZERO() _mm256_setzero_ps()
#define PCC_LOADU(p) _mm256_loadu_ps(p)
#define PCC_SET1(x) _mm256_set1_ps(x)
#define PCC_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define PCC_STOREU(p, v) _mm256_storeu_ps((p), (v))
#define PCC_STORE_FIRST(p, v, n) pcc_store_first_((p), (v), (n))
#define PCC_ISA "avx2"
#else
/* portable: GCC/clang vector extensions, 4 lanes, multiply then add */
#define PCC_VEC 4
#define PCC_NVMAX 2
typedef float pcc_v __attribute__((vector_size(16)));
static inline pcc_v pcc_loadu_(const float *p) { pcc_v v; memcpy(&v, p, sizeof v); return v; }
static inline void pcc_storeu_(float *p, pcc_v v) { memcpy(p, &v, sizeof v); }
#define PCC_ZERO() ((pcc_v){0.0f, 0.0f, 0.0f, 0.0f})
#define PCC_LOADU(p) pcc_loadu_(p)
#define PCC_SET1(x) ((pcc_v){0.0f, 0.0f, 0.0f, 0.0f} + (x))
#define PCC_FMA(a, b, c) ((a) * (b) + (c))
#define PCC_STOREU(p, v) pcc_storeu_((p), (v))
#define PCC_STORE_FIRST(p, v, n) pcc_store_first_((p), (v), (n))
#define PCC_ISA "generic"
#endif

/* The first n lanes of v to p. AVX2: a masked store, not a copy through the address of v:
 * once inlined, that address is the address of a micro-kernel's accumulator array, which
 * GCC 12 then keeps in memory (every FMA a load and a store). The generic build's 4-float
 * kernels keep theirs in registers either way. */
#if defined(__AVX512F__)
#elif PCC_VEC == 8
static inline void pcc_store_first_(float *p, pcc_v v, int n)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane), v);
}
#else
static inline void pcc_store_first_(float *p, pcc_v v, int n)
{
    float t[PCC_VEC];
    memcpy(t, &v, sizeof t);
    memcpy(p, t, sizeof(float) * (size_t)n);
}
#endif

/* Keep v in a register: stops the compiler from re-loading a shared operand as a
 * memory operand of every FMA that uses it. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && PCC_VEC > 4
#define PCC_KEEP(v) __asm__("" : "+v"(v))
#else
#define PCC_KEEP(v) ((void)0)
#endif

/* widest panel, and the row stride of the ct scratch (PCC_MR_MAX rows) */
#define PCC_NR (PCC_VEC * PCC_NVMAX)
#define PCC_MR_MAX 24
/* main block height for NV vectors: MR * NV accumulators fill the register file */
#if PCC_VEC == 16
static inline int pcc_main_mr(int nv) { return nv == 1 ? 24 : nv == 2 ? 12 : nv == 3 ? 8 : 6; }
#else
static inline int pcc_main_mr(int nv) { return nv == 1 ? 12 : 6; }
#endif

/* max(v, 0) per lane; a NaN stays NaN (the second operand of max_ps is returned for a NaN) */
#if defined(__AVX512F__)
#define PCC_RELU(v) _mm512_max_ps(_mm512_setzero_ps(), (v))
#elif PCC_VEC == 8
#define PCC_RELU(v) _mm256_max_ps(_mm256_setzero_ps(), (v))
#else
static inline pcc_v pcc_relu_(pcc_v v)
{
    float t[PCC_VEC];
    memcpy(t, &v, sizeof t);
    for (int l = 0; l < PCC_VEC; l++) t[l] = t[l] < 0.0f ? 0.0f : t[l];
    memcpy(&v, t, sizeof v);
    return v;
}
#define PCC_RELU(v) pcc_relu_(v)
#endif

/* out[i*ldo + j] = bias[i] + sum_k a[i*lda + k] * b[off[k] + j] for i < MR, j < min(count, NV*VEC)
 * (bias may be NULL). */
#define PCC_DEFINE_UKERNEL(MR, NV)                                                          \
    static inline void pcc_ukernel_##MR##_##NV(int kdim, const float *restrict a, pcc_idx lda, \
                                               const float *restrict b,                     \
                                               const int *restrict off,                     \
                                               const float *restrict bias,                  \
                                               float *restrict out, pcc_idx ldo, int count) \
    {                                                                                       \
        pcc_v acc[MR][NV];                                                                  \
        _Pragma("GCC unroll 24") for (int i = 0; i < MR; i++) {                             \
            pcc_v b0 = bias ? PCC_SET1(bias[i]) : PCC_ZERO();                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) acc[i][j] = b0;            \
        }                                                                                   \
        for (int k = 0; k < kdim; k++) {                                                    \
            const float *bk = b + off[k];                                                   \
            const float *ak = a + k;                                                        \
            pcc_v bv[NV];                                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                            \
                bv[j] = PCC_LOADU(bk + j * PCC_VEC);                                        \
            _Pragma("GCC unroll 24") for (int i = 0; i < MR; i++) {                         \
                pcc_v av = PCC_SET1(ak[i * lda]);                                           \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                        \
                    acc[i][j] = PCC_FMA(av, bv[j], acc[i][j]);                              \
            }                                                                               \
        }                                                                                   \
        if (count >= NV * PCC_VEC) {                                                        \
            _Pragma("GCC unroll 24") for (int i = 0; i < MR; i++)                           \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                        \
                    PCC_STOREU(out + i * ldo + j * PCC_VEC, acc[i][j]);                     \
        } else {                                                                            \
            _Pragma("GCC unroll 24") for (int i = 0; i < MR; i++)                           \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) {                      \
                    int left = count - j * PCC_VEC;                                         \
                    if (left >= PCC_VEC) PCC_STOREU(out + i * ldo + j * PCC_VEC, acc[i][j]); \
                    else if (left > 0) PCC_STORE_FIRST(out + i * ldo + j * PCC_VEC, acc[i][j], left); \
                }                                                                           \
        }                                                                                   \
    }

#define PCC_DEFINE_TAIL_UKERNELS(NV) \
    PCC_DEFINE_UKERNEL(8, NV)        \
    PCC_DEFINE_UKERNEL(4, NV)        \
    PCC_DEFINE_UKERNEL(2, NV)        \
    PCC_DEFINE_UKERNEL(1, NV)

#if PCC_VEC == 16
PCC_DEFINE_UKERNEL(24, 1)
PCC_DEFINE_UKERNEL(12, 2)
PCC_DEFINE_UKERNEL(6, 4)
PCC_DEFINE_TAIL_UKERNELS(1)
PCC_DEFINE_TAIL_UKERNELS(2)
PCC_DEFINE_TAIL_UKERNELS(3)
PCC_DEFINE_TAIL_UKERNELS(4)
#else
PCC_DEFINE_UKERNEL(12, 1)
PCC_DEFINE_UKERNEL(6, 2)
PCC_DEFINE_TAIL_UKERNELS(1)
PCC_DEFINE_TAIL_UKERNELS(2)
#endif

/* Run the (mr, nv) micro-kernel. */
static inline void pcc_ukernel(int mr, int nv, int kdim, const float *a, pcc_idx lda, const float *b,
                               const int *off, const float *bias, float *out, pcc_idx ldo, int count)
{
#define PCC_CASE(MR, NV) \
    if (mr == MR && nv == NV) { pcc_ukernel_##MR##_##NV(kdim, a, lda, b, off, bias, out, ldo, count); return; }
#if PCC_VEC == 16
    PCC_CASE(24, 1) PCC_CASE(12, 2) PCC_CASE(8, 3) PCC_CASE(6, 4)
    PCC_CASE(8, 1) PCC_CASE(4, 1) PCC_CASE(2, 1) PCC_CASE(1, 1)
    PCC_CASE(8, 2) PCC_CASE(4, 2) PCC_CASE(2, 2) PCC_CASE(1, 2)
    PCC_CASE(4, 3) PCC_CASE(2, 3) PCC_CASE(1, 3)
    PCC_CASE(8, 4) PCC_CASE(4, 4) PCC_CASE(2, 4) PCC_CASE(1, 4)
#else
    PCC_CASE(12, 1) PCC_CASE(6, 2)
    PCC_CASE(8, 1) PCC_CASE(4, 1) PCC_CASE(2, 1) PCC_CASE(1, 1)
    PCC_CASE(8, 2) PCC_CASE(4, 2) PCC_CASE(2, 2) PCC_CASE(1, 2)
#endif
#undef PCC_CASE
}

/* Height of the filter block starting at o0 when the main blocks are mr0 high. */
static inline int pcc_block_width(int O, int o0, int mr0)
{
    int rest = O - o0;
    if (rest >= mr0) return mr0;
    if (rest >= 8 && mr0 > 8) return 8;
    if (rest >= 4) return 4;
    if (rest >= 2) return 2;
    return 1;
}

/* Rows [c0, c1) of the filters of the stride-1 input gradient, a convolution of dy with
 * wt[c, o, kh, kw] = w[o, c, K-1-kh, K-1-kw]: wt is (C, O*K*K) row-major, w is (O, C, K, K). */
static inline void pcc_flip_filters(const float *restrict w, int O, int C, int K, int c0, int c1,
                                    float *restrict wt)
{
    int KK = K * K;
    for (int c = c0; c < c1; c++) {
        float *dst = wt + (pcc_idx)c * O * KK;
        for (int o = 0; o < O; o++) {
            const float *src = w + ((pcc_idx)o * C + c) * KK;
            for (int t = 0; t < KK; t++) dst[o * KK + t] = src[KK - 1 - t];
        }
    }
}

/* Rows i < mr of out (stride ld), n floats each: v = v * scale[i] + shift[i], then max(v, 0) when
 * relu. Run on a block the micro-kernel has just stored (still in L1), so the kernels themselves
 * stay as they are for the plain convolution. */
#if defined(__GNUC__)
__attribute__((noinline, cold))
#endif
static void pcc_epilogue(float *restrict out, pcc_idx ld, int mr, int n, const float *restrict scale,
                         const float *restrict shift, int relu)
{
    for (int i = 0; i < mr; i++) {
        float *r = out + (pcc_idx)i * ld;
        const pcc_v sv = PCC_SET1(scale ? scale[i] : 1.0f), tv = PCC_SET1(shift ? shift[i] : 0.0f);
        int j = 0;
        for (; j + PCC_VEC <= n; j += PCC_VEC) {
            pcc_v v = PCC_FMA(PCC_LOADU(r + j), sv, tv);
            PCC_STOREU(r + j, relu ? PCC_RELU(v) : v);
        }
        if (j < n) {
            float t[PCC_VEC] = {0};
            memcpy(t, r + j, sizeof(float) * (size_t)(n - j));
            pcc_v v = PCC_FMA(PCC_LOADU(t), sv, tv);
            PCC_STOREU(t, relu ? PCC_RELU(v) : v);
            memcpy(r + j, t, sizeof(float) * (size_t)(n - j));
        }
    }
}

/* All O filters (a: (O, kdim) row-major) for one panel of nv vectors starting at position s0
 * (B at b + s0); the nseg segments [j0, j1) of the panel land at y + dst (+ o*ldy), bias added
 * (or scale and bias applied, then relu: see the micro-kernels).
 * A panel that is one segment from its first position is stored straight from the registers;
 * otherwise through ct, a PCC_MR_MAX x PCC_NR scratch. */
static inline void pcc_panel(const float *restrict a, int O, int kdim, int mr0, int nv,
                             const float *restrict b, const int *restrict off,
                             int nseg, const int *seg_j0, const int *seg_j1, const pcc_idx *seg_dst,
                             float *restrict y, pcc_idx ldy, const float *restrict bias,
                             const float *restrict scale, int relu, float *restrict ct)
{
    int direct = nseg == 1 && seg_j0[0] == 0;
    for (int o0 = 0; o0 < O;) {
        int mr = pcc_block_width(O, o0, mr0);
        /* with scale, bias is the shift applied after the scale, not the sums' starting value */
        const float *bo = bias && !scale ? bias + o0 : NULL;
        const int epi = scale || relu;
        if (direct) {
            float *yo = y + (pcc_idx)o0 * ldy + seg_dst[0];
            pcc_ukernel(mr, nv, kdim, a + (pcc_idx)o0 * kdim, kdim, b, off, bo, yo, ldy, seg_j1[0]);
            if (epi)
                pcc_epilogue(yo, ldy, mr, seg_j1[0], scale ? scale + o0 : NULL, scale && bias ? bias + o0 : NULL,
                             relu);
        } else if (nseg > 0) {
            pcc_ukernel(mr, nv, kdim, a + (pcc_idx)o0 * kdim, kdim, b, off, bo, ct, PCC_NR, nv * PCC_VEC);
            if (epi)
                pcc_epilogue(ct, PCC_NR, mr, nv * PCC_VEC, scale ? scale + o0 : NULL,
                             scale && bias ? bias + o0 : NULL, relu);
            for (int i = 0; i < mr; i++) {
                float *yo = y + (pcc_idx)(o0 + i) * ldy;
                const float *ci = ct + i * PCC_NR;
                for (int g = 0; g < nseg; g++)
                    memcpy(yo + seg_dst[g], ci + seg_j0[g], sizeof(float) * (size_t)(seg_j1[g] - seg_j0[g]));
            }
        }
        o0 += mr;
    }
}

/* Panel walk: positions [s_begin, s_end) of the grid of width Wg (q < Q valid), panels of
 * nv*VEC consecutive s: y[o*ldy + p*Q + q] = sum_k a_o[k] B(k, s) + bias[o] for s = p*Wg + q.
 * B must be readable up to s_end - 1 + nv*VEC. */
static inline void pcc_conv_panels(const float *restrict a, int O, int kdim, int mr0, int nv,
                                   const float *restrict b, const int *restrict off,
                                   pcc_idx s_begin, pcc_idx s_end, int Wg, int Q,
                                   float *restrict y, pcc_idx ldy, const float *restrict bias,
                                   const float *restrict scale, int relu, float *restrict ct)
{
    int nr = nv * PCC_VEC;
    int seg_j0[PCC_NR + 2], seg_j1[PCC_NR + 2];
    pcc_idx seg_dst[PCC_NR + 2];
    for (pcc_idx s0 = s_begin; s0 < s_end; s0 += nr) {
        int nseg = 0;
        pcc_idx s_stop = s0 + nr < s_end ? s0 + nr : s_end;
        for (pcc_idx s = s0; s < s_stop;) {
            pcc_idx p = s / Wg, q = s - p * Wg;
            pcc_idx valid_end = p * Wg + Q;
            if (q < Q) {
                pcc_idx e = valid_end < s_stop ? valid_end : s_stop;
                int j0 = (int)(s - s0);
                if (nseg > 0 && seg_j1[nseg - 1] == j0 && seg_dst[nseg - 1] + (j0 - seg_j0[nseg - 1]) == p * Q + q) {
                    seg_j1[nseg - 1] = (int)(e - s0);  /* contiguous in y too (Wg == Q): merge */
                } else {
                    seg_j0[nseg] = j0;
                    seg_j1[nseg] = (int)(e - s0);
                    seg_dst[nseg] = p * Q + q;
                    nseg++;
                }
            }
            s = (p + 1) * Wg;
        }
        pcc_panel(a, O, kdim, mr0, nv, b + s0, off, nseg, seg_j0, seg_j1, seg_dst, y, ldy, bias, scale, relu, ct);
    }
}

/* Row walk: output rows [p_begin, p_end) of the grid of width Wg, each in panels of nv*VEC
 * starting at q = 0. B must be readable up to (p_end - 1)*Wg + Q - 1 + nv*VEC. */
static inline void pcc_conv_rows(const float *restrict a, int O, int kdim, int mr0, int nv,
                                 const float *restrict b, const int *restrict off,
                                 int p_begin, int p_end, int Wg, int Q,
                                 float *restrict y, pcc_idx ldy, const float *restrict bias,
                                 const float *restrict scale, int relu, float *restrict ct)
{
    int nr = nv * PCC_VEC;
    int j0 = 0, j1;
    pcc_idx dst;
    for (int p = p_begin; p < p_end; p++) {
        for (int q0 = 0; q0 < Q; q0 += nr) {
            j1 = Q - q0 < nr ? Q - q0 : nr;
            dst = (pcc_idx)p * Q + q0;
            pcc_panel(a, O, kdim, mr0, nv, b + (pcc_idx)p * Wg + q0, off, 1, &j0, &j1, &dst, y, ldy, bias, scale,
                      relu, ct);
        }
    }
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

/* dst[j] = src[2 j] for j < n, in vectors of even lanes where the level has them: a phase row is
 * 4 to 32 floats, too short for a vector loop to get past its scalar tail. Masked loads never
 * touch a float past src[2 (n - 1)]. */
static inline void pcc_gather2(const float *restrict src, float *restrict dst, int n)
{
#if defined(__AVX512F__)
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int j = 0; j < n; j += 16) {
        const int k = n - j < 16 ? n - j : 16, need = 2 * k - 1;
        const __mmask16 lo = need >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << need) - 1u);
        const __mmask16 hi = need <= 16 ? (__mmask16)0 : (__mmask16)((1u << (need - 16)) - 1u);
        const __m512 a = _mm512_maskz_loadu_ps(lo, src + 2 * j), b = _mm512_maskz_loadu_ps(hi, src + 2 * j + 16);
        const __m512 v = _mm512_permutex2var_ps(a, even, b);
        if (k == 16)
            _mm512_storeu_ps(dst + j, v);
        else
            _mm512_mask_storeu_ps(dst + j, (__mmask16)((1u << k) - 1u), v);
    }
#elif PCC_VEC == 8
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < n; j += 8) {
        const int k = n - j < 8 ? n - j : 8, need = 2 * k - 1;
        const __m256 a = _mm256_maskload_ps(src + 2 * j, _mm256_cmpgt_epi32(_mm256_set1_epi32(need), lane));
        const __m256 b = _mm256_maskload_ps(src + 2 * j + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(need - 8), lane));
        /* a0 a2 b0 b2 | a4 a6 b4 b6, then the 64-bit pairs in order */
        const __m256 v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        if (k == 8)
            _mm256_storeu_ps(dst + j, v);
        else
            _mm256_maskstore_ps(dst + j, _mm256_cmpgt_epi32(_mm256_set1_epi32(k), lane), v);
    }
#else
    for (int j = 0; j < n; j++) dst[j] = src[2 * j];
#endif
}

/* The S x S phases of one image for a stride-S convolution, channels [c0, c1):
 * buf[(((c*S + a)*S + b)*Hph + i)*Wph + j] = xp[S*i + a][S*j + b], xp being x with pad zero
 * rows and columns on every side (zeros beyond it). Tap (c, kh, kw) of output (p, q) then reads
 * phase (kh % S, kw % S) at (p + kh / S, q + kw / S): the strided convolution is a stride-1 one
 * on the wide grid of width Wph, with no im2col copy. */
static inline void pcc_pad_phases(const float *restrict x, int H, int W, int pad, int S, int Hph,
                                  int Wph, int c0, int c1, float *restrict buf)
{
    for (int c = c0; c < c1; c++) {
        const float *xc = x + (pcc_idx)c * H * W;
        for (int a = 0; a < S; a++)
            for (int i = 0; i < Hph; i++) {
                const int h = S * i + a - pad;
                for (int b = 0; b < S; b++) {
                    float *dst = buf + ((((pcc_idx)c * S + a) * S + b) * Hph + i) * Wph;
                    if (h < 0 || h >= H) {
                        memset(dst, 0, sizeof(float) * (size_t)Wph);
                        continue;
                    }
                    /* columns j with 0 <= S j + b - pad < W: [j0, j1) */
                    const float *src = xc + (pcc_idx)h * W + (b - pad);
                    const int last = W - 1 - b + pad;   /* S j <= last (C division truncates: test the sign) */
                    int j0 = pad - b > 0 ? (pad - b + S - 1) / S : 0;
                    int j1 = last < 0 ? 0 : last / S + 1;
                    if (j1 > Wph) j1 = Wph;
                    if (j0 > j1) j0 = j1;
                    for (int j = 0; j < j0; j++) dst[j] = 0.0f;
                    if (S == 2)
                        pcc_gather2(src + 2 * j0, dst + j0, j1 - j0);
                    else
                        for (int j = j0; j < j1; j++) dst[j] = src[(pcc_idx)S * j];
                    for (int j = j1; j < Wph; j++) dst[j] = 0.0f;
                }
            }
    }
}

/* k offsets of the phase layout (pcc_pad_phases). */
static inline void pcc_offsets_phases(int C, int K, int S, int Hph, int Wph, int *restrict off)
{
    int k = 0;
    for (int c = 0; c < C; c++)
        for (int kh = 0; kh < K; kh++)
            for (int kw = 0; kw < K; kw++)
                off[k++] = (((c * S + kh % S) * S + kw % S) * Hph + kh / S) * Wph + kw / S;
}

/* One image on the grid a convolution of stride S walks: the zero-padded image for S = 1
 * (Hg = Hp, Wg = Wp), its phases otherwise. */
static inline void pcc_pad_grid(const float *restrict x, int H, int W, int pad, int S, int Hg, int Wg,
                                int c0, int c1, float *restrict buf)
{
    if (S > 1)
        pcc_pad_phases(x, H, W, pad, S, Hg, Wg, c0, c1, buf);
    else
        pcc_pad_image(x, H, W, pad, Hg, Wg, c0, c1, buf);
}

/* k offsets of that grid. */
static inline void pcc_offsets_grid(int C, int K, int S, int Hg, int Wg, int *restrict off)
{
    if (S > 1)
        pcc_offsets_phases(C, K, S, Hg, Wg, off);
    else
        pcc_offsets_shifted(C, K, Hg, Wg, off);
}

/* k offsets of an im2col tile with leading dimension ldb. */
static inline void pcc_offsets_tile(int kdim, int ldb, int *restrict off)
{
    for (int k = 0; k < kdim; k++) off[k] = k * ldb;
}


/* ----------------------------------------------------------- weight gradient
 *
 * dw^T[k, o] = sum_s B(k, s) * dy[o, s], computed as a GEMM with vectors along
 * the filters o: dy of one image is packed transposed (dyT[s, o], rows padded
 * to a whole number of vectors and zero where s is not a valid output position),
 * B(k, s) is broadcast straight from the padded image (b[off[k] + s]), and a
 * KR x OV block of vector sums stays in registers over the whole s loop. No
 * horizontal reductions; dw^T is accumulated in a (kpad, Opad) scratch.
 */

#if PCC_VEC == 16
#define PCC_OVMAX 4
#else
#define PCC_OVMAX 2
#endif

/* acc rows: taps k0 .. k0+KR-1; columns: OV vectors of filters starting at dyT + o0. */
#define PCC_DEFINE_DW_UKERNEL(KR, OV)                                                       \
    static inline void pcc_dw_ukernel_##KR##_##OV(const float *restrict dyT, pcc_idx ldd,  \
                                                   const float *restrict b,                 \
                                                   const int *restrict off, pcc_idx S,      \
                                                   float *restrict dwT, pcc_idx ldw)        \
    {                                                                                       \
        pcc_v acc[KR][OV];                                                                  \
        const float *bk[KR];                                                                \
        _Pragma("GCC unroll 24") for (int r = 0; r < KR; r++) {                             \
            bk[r] = b + off[r];                                                             \
            _Pragma("GCC unroll 4") for (int v = 0; v < OV; v++)                            \
                acc[r][v] = PCC_LOADU(dwT + r * ldw + v * PCC_VEC);                          \
        }                                                                                   \
        for (pcc_idx s = 0; s < S; s++) {                                                   \
            pcc_v dv[OV];                                                                   \
            _Pragma("GCC unroll 4") for (int v = 0; v < OV; v++)                            \
                dv[v] = PCC_LOADU(dyT + s * ldd + v * PCC_VEC);                              \
            _Pragma("GCC unroll 24") for (int r = 0; r < KR; r++) {                         \
                pcc_v bv = PCC_SET1(bk[r][s]);                                              \
                _Pragma("GCC unroll 4") for (int v = 0; v < OV; v++)                        \
                    acc[r][v] = PCC_FMA(bv, dv[v], acc[r][v]);                              \
            }                                                                               \
        }                                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < KR; r++)                               \
            _Pragma("GCC unroll 4") for (int v = 0; v < OV; v++)                            \
                PCC_STOREU(dwT + r * ldw + v * PCC_VEC, acc[r][v]);                          \
    }

#if PCC_VEC == 16
#define PCC_KR_MAX 24
PCC_DEFINE_DW_UKERNEL(6, 4)
PCC_DEFINE_DW_UKERNEL(8, 3)
PCC_DEFINE_DW_UKERNEL(12, 2)
PCC_DEFINE_DW_UKERNEL(24, 1)
static inline int pcc_dw_kr(int ov) { return ov == 4 ? 6 : ov == 3 ? 8 : ov == 2 ? 12 : 24; }
#else
#define PCC_KR_MAX 12
PCC_DEFINE_DW_UKERNEL(6, 2)
PCC_DEFINE_DW_UKERNEL(12, 1)
static inline int pcc_dw_kr(int ov) { return ov == 2 ? 6 : 12; }
#endif

/* dw^T rows [k_begin, k_end) (+)= over s < S of b[off[k] + s] * dyT[s, :].
 * dyT: (S, ldd) with ldd = Opad = O rounded up to a multiple of VEC; dwT: (kpad, ldd).
 * off must have valid entries up to k_end rounded up to PCC_KR_MAX (extra ones e.g. 0);
 * dwT rows past k_end are scratch. k_begin must be a multiple of PCC_KR_MAX. */
static inline void pcc_dw_accumulate(const float *restrict dyT, pcc_idx ldd, const float *restrict b,
                                     const int *restrict off, int k_begin, int k_end, pcc_idx S,
                                     float *restrict dwT)
{
    int nvec = (int)(ldd / PCC_VEC);
    for (int v0 = 0; v0 < nvec;) {
        int ov = nvec - v0 < PCC_OVMAX ? nvec - v0 : PCC_OVMAX;
        int kr = pcc_dw_kr(ov);
        for (int k0 = k_begin; k0 < k_end; k0 += kr) {
            const float *d = dyT + v0 * PCC_VEC;
            float *o = dwT + (pcc_idx)k0 * ldd + v0 * PCC_VEC;
#if PCC_VEC == 16
            switch (ov) {
            case 4: pcc_dw_ukernel_6_4(d, ldd, b, off + k0, S, o, ldd); break;
            case 3: pcc_dw_ukernel_8_3(d, ldd, b, off + k0, S, o, ldd); break;
            case 2: pcc_dw_ukernel_12_2(d, ldd, b, off + k0, S, o, ldd); break;
            default: pcc_dw_ukernel_24_1(d, ldd, b, off + k0, S, o, ldd); break;
            }
#else
            if (ov == 2) pcc_dw_ukernel_6_2(d, ldd, b, off + k0, S, o, ldd);
            else pcc_dw_ukernel_12_1(d, ldd, b, off + k0, S, o, ldd);
#endif
        }
        v0 += ov;
    }
}

#if defined(__AVX2__)
/* 8 rows of 8 floats (row i at src + i*lds) to 8 rows of 8 (row j at dst + j*ldd): dst[j][i] = src[i][j]. */
static inline void pcc_transpose8x8(const float *restrict src, pcc_idx lds, float *restrict dst, pcc_idx ldd)
{
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds);
    __m256 r2 = _mm256_loadu_ps(src + 2 * lds), r3 = _mm256_loadu_ps(src + 3 * lds);
    __m256 r4 = _mm256_loadu_ps(src + 4 * lds), r5 = _mm256_loadu_ps(src + 5 * lds);
    __m256 r6 = _mm256_loadu_ps(src + 6 * lds), r7 = _mm256_loadu_ps(src + 7 * lds);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

/* Pack dy (O, P, Q) of one image transposed onto the grid of width Wg:
 * dyT[(p*Wg + q)*ldd + o] = dy[o, p, q]; zero for q >= Q and for o >= O. Rows: P*Wg.
 * AVX2: 8 positions x 8 filters at a time through registers, instead of a strided gather
 * of one float per position and filter. */
static inline void pcc_dy_transposed(const float *restrict dy, int O, int P, int Q, int Wg, pcc_idx ldd,
                                     float *restrict dyT)
{
    pcc_idx PQ = (pcc_idx)P * Q;
    for (int p = 0; p < P; p++) {
        int q = 0;
#if defined(__AVX2__)
        for (; q + 8 <= Q; q += 8) {
            const float *src = dy + (pcc_idx)p * Q + q;
            float *dst = dyT + ((pcc_idx)p * Wg + q) * ldd;
            int o = 0;
            for (; o + 8 <= O; o += 8) pcc_transpose8x8(src + (pcc_idx)o * PQ, PQ, dst + o, ldd);
            for (int j = 0; j < 8; j++) {
                for (int oo = o; oo < O; oo++) dst[j * ldd + oo] = src[(pcc_idx)oo * PQ + j];
                for (int oo = O; oo < ldd; oo++) dst[j * ldd + oo] = 0.0f;
            }
        }
#endif
        for (; q < Wg; q++) {
            float *dst = dyT + ((pcc_idx)p * Wg + q) * ldd;
            if (q >= Q) {
                memset(dst, 0, sizeof(float) * (size_t)ldd);
                continue;
            }
            const float *src = dy + (pcc_idx)p * Q + q;
            int o = 0;
            for (; o < O; o++) dst[o] = src[(pcc_idx)o * PQ];
            for (; o < ldd; o++) dst[o] = 0.0f;
        }
    }
}

/* ------------------------------------------- weight gradient, small depth
 *
 * For a small kdim (one or a few input channels), packing dy transposed costs
 * more than the product itself, so dw[o, k] = sum_s dyw[o, s] * B(k, s) runs
 * with vectors along s instead: DMR x DNJ vector partial sums over the whole
 * image, each reduced horizontally once. dyw is dy on the same grid as B
 * (zeros where q >= Q and after the last row), rows padded to whole blocks.
 */

#if PCC_VEC == 16
#define PCC_HSUM(v) _mm512_reduce_add_ps(v)
#elif PCC_VEC == 8
static inline float pcc_hsum_(pcc_v v)
{
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    return _mm_cvtss_f32(t);
}
#define PCC_HSUM(v) pcc_hsum_(v)
#else
#define PCC_HSUM(v) (((v)[0] + (v)[1]) + ((v)[2] + (v)[3]))
#endif

/* dw[o*kdim + k] += sum over s < S (a multiple of VEC) of dyw[o*lds + s] * b[off[k] + s], o < O,
 * k < kdim, in blocks of MR filters x NJ taps. dyw has O rounded up to MR rows (the extra
 * ones zero); off has kdim rounded up to NJ entries (the extra ones 0). */
#define PCC_DEFINE_DWDOT(MR, NJ)                                                                   \
    static inline void pcc_dwdot_##MR##_##NJ(const float *restrict dyw, pcc_idx lds, int O,          \
                                             const float *restrict b, const int *restrict off,       \
                                             int kdim, pcc_idx S, float *restrict dw)                \
    {                                                                                                \
        for (int o0 = 0; o0 < O; o0 += MR) {                                                         \
            for (int k0 = 0; k0 < kdim; k0 += NJ) {                                                  \
                pcc_v acc[MR][NJ];                                                                   \
                const float *bj[NJ];                                                                 \
                _Pragma("GCC unroll 8") for (int j = 0; j < NJ; j++) bj[j] = b + off[k0 + j];        \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                 \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NJ; j++) acc[i][j] = PCC_ZERO();     \
                const float *d0 = dyw + (pcc_idx)o0 * lds;                                           \
                for (pcc_idx s = 0; s < S; s += PCC_VEC) {                                           \
                    pcc_v dv[MR];                                                                    \
                    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                           \
                        dv[i] = PCC_LOADU(d0 + i * lds + s);                                         \
                        PCC_KEEP(dv[i]);                                                             \
                    }                                                                                \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NJ; j++) {                           \
                        pcc_v bv = PCC_LOADU(bj[j] + s);                                             \
                        PCC_KEEP(bv);                                                                \
                        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                         \
                            acc[i][j] = PCC_FMA(dv[i], bv, acc[i][j]);                               \
                    }                                                                                \
                }                                                                                    \
                float out[MR][NJ]; /* registers stay registers: constant indices only */             \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                 \
                    _Pragma("GCC unroll 8") for (int j = 0; j < NJ; j++) out[i][j] = PCC_HSUM(acc[i][j]); \
                for (int i = 0; i < MR && o0 + i < O; i++)                                           \
                    for (int j = 0; j < NJ && k0 + j < kdim; j++)                                    \
                        dw[(pcc_idx)(o0 + i) * kdim + k0 + j] += out[i][j];                          \
            }                                                                                        \
        }                                                                                            \
    }

#if PCC_VEC == 16
PCC_DEFINE_DWDOT(4, 6)
PCC_DEFINE_DWDOT(4, 5)
PCC_DEFINE_DWDOT(8, 3)
PCC_DEFINE_DWDOT(6, 4)
#define PCC_DWDOT_VARIANTS 4
static const int pcc_dwdot_mr_[4] = {4, 4, 8, 6}, pcc_dwdot_nj_[4] = {6, 5, 3, 4};
#else
PCC_DEFINE_DWDOT(3, 4)
#define PCC_DWDOT_VARIANTS 1
static const int pcc_dwdot_mr_[1] = {3}, pcc_dwdot_nj_[1] = {4};
#endif

/* The (MR, NJ) variant computing the fewest padded filter x tap pairs for O x kdim. */
static inline int pcc_dwdot_choose(int O, int kdim, int *mr, int *nj)
{
    int best = 0;
    long best_cost = -1;
    for (int v = 0; v < PCC_DWDOT_VARIANTS; v++) {
        int m = pcc_dwdot_mr_[v], n = pcc_dwdot_nj_[v];
        long cost = (long)((O + m - 1) / m * m) * ((kdim + n - 1) / n * n);
        if (best_cost < 0 || cost < best_cost) {
            best = v;
            best_cost = cost;
        }
    }
    *mr = pcc_dwdot_mr_[best];
    *nj = pcc_dwdot_nj_[best];
    return best;
}

static inline void pcc_dwdot_accumulate(int variant, const float *dyw, pcc_idx lds, int O, const float *b,
                                        const int *off, int kdim, pcc_idx S, float *dw)
{
#if PCC_VEC == 16
    switch (variant) {
    case 0: pcc_dwdot_4_6(dyw, lds, O, b, off, kdim, S, dw); break;
    case 1: pcc_dwdot_4_5(dyw, lds, O, b, off, kdim, S, dw); break;
    case 2: pcc_dwdot_8_3(dyw, lds, O, b, off, kdim, S, dw); break;
    default: pcc_dwdot_6_4(dyw, lds, O, b, off, kdim, S, dw); break;
    }
#else
    (void)variant;
    pcc_dwdot_3_4(dyw, lds, O, b, off, kdim, S, dw);
#endif
}

/* Lay dy (O, P, Q) of one image on the grid of width Wg: dyw[o*lds + p*Wg + q] = dy[o, p, q];
 * zero for q >= Q, after the last row (up to lds >= P*Wg) and for the rows o in [O, O_pad). */
static inline void pcc_dy_wide(const float *restrict dy, int O, int O_pad, int P, int Q, int Wg, pcc_idx lds,
                               float *restrict dyw)
{
    for (int o = 0; o < O_pad; o++) {
        float *dst = dyw + (pcc_idx)o * lds;
        if (o >= O) {
            memset(dst, 0, sizeof(float) * (size_t)lds);
            continue;
        }
        const float *src = dy + (pcc_idx)o * P * Q;
        for (int p = 0; p < P; p++) {
            memcpy(dst + (pcc_idx)p * Wg, src + (pcc_idx)p * Q, sizeof(float) * (size_t)Q);
            if (Wg > Q) memset(dst + (pcc_idx)p * Wg + Q, 0, sizeof(float) * (size_t)(Wg - Q));
        }
        memset(dst + (pcc_idx)P * Wg, 0, sizeof(float) * (size_t)(lds - (pcc_idx)P * Wg));
    }
}

/* dw[o, k] (+)= dwT[k, o] for k < kdim, o < O. */
static inline void pcc_dw_untranspose(const float *restrict dwT, pcc_idx ldd, int O, int kdim, float *restrict dw)
{
    for (int o = 0; o < O; o++)
        for (int k = 0; k < kdim; k++) dw[(pcc_idx)o * kdim + k] = dwT[(pcc_idx)k * ldd + o];
}

#endif /* PARCONV_PC_CONV_H */
