/* Small C helpers shared by the Cython kernels in parconv/_ext.
 *
 * Shape legend: N batch, C in-channels, O out-channels, H, W input,
 * P, Q output, K kernel, F in-features, G out-features.
 *
 * The elementwise loops live here, not in Cython, so the compiler sees plain
 * pointer loops it can vectorise (`#pragma omp simd` where OpenMP is on,
 * -O3 auto-vectorisation otherwise). The setup.py flags keep IEEE semantics
 * (no -ffast-math, -ffp-contract=off), so every helper rounds exactly like
 * the NumPy reference that evaluates the same expression in float32.
 */
#ifndef PARCONV_PC_COMMON_H
#define PARCONV_PC_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef PARCONV_OPENMP
#define PARCONV_OPENMP 0
#endif

#if defined(_OPENMP)
#include <omp.h>
static inline int pc_omp_max_threads(void) { return omp_get_max_threads(); }
#define PC_SIMD _Pragma("omp simd")
#else
static inline int pc_omp_max_threads(void) { return 1; }
#define PC_SIMD
#endif

typedef ptrdiff_t pc_idx;

/* a * b + c with one rounding where the hardware has a fused multiply-add (x86 FMA3, AArch64),
 * else a product and a sum: without the instruction, fmaf is a libm call that emulates the
 * single rounding, and the fused backward's tap loop ran 17x slower on x86-64 without FMA
 * (34 against 2.0 ms at 32 filters, batch 100). The rounding then differs from build to build,
 * never between thread counts or between the code paths of one build. */
#if defined(__FMA__) || defined(__FP_FAST_FMAF) || defined(FP_FAST_FMAF) || defined(__ARM_FEATURE_FMA)
#define PC_FMAF(a, b, c) fmaf((a), (b), (c))
#else
#define PC_FMAF(a, b, c) ((a) * (b) + (c))
#endif

#define PC_COMMA ,

/* p rounded up to the next 64-byte boundary (NULL stays NULL): for a buffer malloc'ed
 * 64 bytes larger than needed; free the original pointer. */
static inline void *pc_align64(void *p)
{
    return p ? (void *)(((size_t)p + 63) & ~(size_t)63) : NULL;
}

/* ------------------------------------------------------------ activations */

/* y = max(x, 0); NaN passes through like np.maximum. */
static inline void pc_relu_fwd(const float *restrict x, float *restrict y, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

/* dx = dy where y > 0 else 0. */
static inline void pc_relu_bwd(const float *restrict y, const float *restrict dy, float *restrict dx, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* exp(t) for t <= 0, in a form that vectorises: t = n ln2 + r with |r| <= ln2/2 (Cody-Waite
 * split of ln2), exp(r) by the Cephes degree-6 polynomial (about 1 ulp), times 2^n built in
 * the exponent bits. Below -87.3 (where float32 exp turns subnormal) it returns
 * exp(-87.3) ~ 1.2e-38 instead. NaN in, NaN out. */
static inline float pc_exp_nonpos(float t)
{
    float c = t < -87.3f ? -87.3f : t;
    /* round to nearest by the 1.5 * 2^23 trick (no libm call, so it vectorises) */
    float nf = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = c - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int bits = ((int)nf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float e = p * scale;
    return t != t ? t : e;
}

/* y = 1 / (1 + exp(-x)) via exp(-|x|), so exp never overflows. */
static inline void pc_sigmoid_fwd(const float *restrict x, float *restrict y, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) {
        float v = x[i];
        float e = pc_exp_nonpos(-fabsf(v));
        float d = 1.0f + e;
        y[i] = (v >= 0.0f ? 1.0f : e) / d;
    }
}

/* dx = dy * y * (1 - y), evaluated left to right like NumPy. */
static inline void pc_sigmoid_bwd(const float *restrict y, const float *restrict dy, float *restrict dx, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

/* -------------------------------------------------------------- optimizer */

/* In-place SGD step (PyTorch's formulation, see Backend.sgd_update). v may be NULL. */
static inline void pc_sgd(float *restrict p, const float *restrict g, float *restrict v, pc_idx n,
                          float lr, float momentum, float weight_decay, int use_wd, int nesterov)
{
    if (v == NULL) {
        if (use_wd) {
            PC_SIMD
            for (pc_idx i = 0; i < n; i++) { float d = g[i] + weight_decay * p[i]; p[i] = p[i] - lr * d; }
        } else {
            PC_SIMD
            for (pc_idx i = 0; i < n; i++) p[i] = p[i] - lr * g[i];
        }
        return;
    }
    if (nesterov) {
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) {
            float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
            float vi = v[i] * momentum + d;
            v[i] = vi;
            p[i] = p[i] - lr * (d + momentum * vi);
        }
    } else {
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) {
            float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
            float vi = v[i] * momentum + d;
            v[i] = vi;
            p[i] = p[i] - lr * vi;
        }
    }
}

/* ----------------------------------------------------------------- pool */

/* Max pooling works one window tap at a time over many outputs, with y and am as the
 * running maximum and its flat input index: branch-free selects over a long flat loop
 * vectorise, whereas per-window compares are coin flips the branch predictor loses.
 * Rule (np.argmax): a strictly greater value replaces, so the first maximum stays; a NaN
 * replaces a number once and then stays. */
#define PC_POOL_SELECT(v, idx, yv, av)                              \
    do {                                                            \
        float b_ = (yv);                                            \
        int take_ = ((v) > b_) | (((v) != (v)) & (b_ == b_));       \
        (yv) = take_ ? (v) : b_;                                    \
        (av) = take_ ? (idx) : (av);                                \
    } while (0)

/* One tap over the n outputs of a row: input x[base + j*S]. PC_DEFINE_POOL_TAPS(SUF, AM_T) defines
 * the three for an argmax of type AM_T (int, or uint16_t for planes of at most PC_POOL_U16_MAX
 * positions), named with the suffix SUF. */
#define PC_DEFINE_POOL_TAP(NAME, AM_T, SDECL, SEXPR)                                         \
    static inline void NAME(const float *restrict x, float *restrict y, AM_T *restrict am,   \
                            int n, int base SDECL)                                           \
    {                                                                                        \
        for (int j = 0; j < n; j++) {                                                        \
            int idx = base + j * (SEXPR);                                                    \
            float v = x[idx];                                                                \
            PC_POOL_SELECT(v, idx, y[j], am[j]);                                             \
        }                                                                                    \
    }
#define PC_DEFINE_POOL_TAPS(SUF, AM_T)                                \
    PC_DEFINE_POOL_TAP(pc_pool_tap_s1##SUF, AM_T, , 1)                \
    PC_DEFINE_POOL_TAP(pc_pool_tap_s2##SUF, AM_T, , 2)                \
    PC_DEFINE_POOL_TAP(pc_pool_tap_sn##SUF, AM_T, PC_COMMA int S, S)
PC_DEFINE_POOL_TAPS(, int)
PC_DEFINE_POOL_TAPS(_u16, uint16_t)

/* Flat input index of the first element of each output window: base[p*Q + q] = p*S*W + q*S. */
static inline void pc_pool_bases(int W, int S, int P, int Q, int *restrict base)
{
    for (int p = 0; p < P; p++)
        for (int q = 0; q < Q; q++) base[p * Q + q] = p * S * W + q * S;
}

/* 2x2 windows at stride 2, 16 windows of a pooled row at a time (AVX-512): the two input rows'
 * 32 floats in masked loads, split into the windows' four taps by two permutes each, then the
 * selects of PC_POOL_SELECT in the same order, so y and am are the generic loop's bits. am is
 * uint16_t when am16, else int. AVX2 (without AVX-512) takes the same steps 8 windows at a time.
 * Per 26x26 / 32x32 / 64x64 plane on one Xeon core, against the generic loops below (which gather
 * for rows of fewer than 16 outputs and go tap by tap along longer rows) in the same build:
 * AVX-512 0.083 / 0.099 / 0.456 us against 0.153 / 1.253 / 3.69 us, AVX2 0.193 / 0.253 / 0.930 us
 * against 0.290 / 1.377 / 4.04 us. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PC_POOL22_SIMD 1
static inline void pc_pool22_avx512(const float *restrict x, int W, int P, int Q, float *restrict y,
                                    void *restrict am, int am16, int relu)
{
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i ev = _mm512_add_epi32(lane, lane), od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    const __m512 zero = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        const float *r0 = x + (pc_idx)(2 * p) * W, *r1 = r0 + W;
        for (int q0 = 0; q0 < Q; q0 += 16) {
            const int n = Q - q0 < 16 ? Q - q0 : 16, w2 = 2 * n;
            const __mmask16 mlo = (__mmask16)(w2 >= 16 ? 0xFFFFu : (1u << w2) - 1u);
            const __mmask16 mhi = (__mmask16)(w2 <= 16 ? 0u : (w2 == 32 ? 0xFFFFu : (1u << (w2 - 16)) - 1u));
            const __mmask16 mn = (__mmask16)(n == 16 ? 0xFFFFu : (1u << n) - 1u);
            const __m512 a0 = _mm512_maskz_loadu_ps(mlo, r0 + 2 * q0);
            const __m512 a1 = _mm512_maskz_loadu_ps(mhi, r0 + 2 * q0 + 16);
            const __m512 b0 = _mm512_maskz_loadu_ps(mlo, r1 + 2 * q0);
            const __m512 b1 = _mm512_maskz_loadu_ps(mhi, r1 + 2 * q0 + 16);
            const __m512 v1 = _mm512_permutex2var_ps(a0, od, a1);
            const __m512 v2 = _mm512_permutex2var_ps(b0, ev, b1);
            const __m512 v3 = _mm512_permutex2var_ps(b0, od, b1);
            const __m512i base = _mm512_add_epi32(_mm512_set1_epi32(2 * p * W + 2 * q0), ev);
            __m512 m = _mm512_permutex2var_ps(a0, ev, a1);
            __m512i k = base;
            __mmask16 t;
            /* take v where v > m, or v is NaN and m is not (PC_POOL_SELECT) */
#define PC_POOL22_SELECT(v, off)                                                                      \
            t = _mm512_cmp_ps_mask((v), m, _CMP_GT_OQ)                                                \
                | (_mm512_cmp_ps_mask((v), (v), _CMP_UNORD_Q) & _mm512_cmp_ps_mask(m, m, _CMP_ORD_Q)); \
            m = _mm512_mask_mov_ps(m, t, (v));                                                        \
            k = _mm512_mask_mov_epi32(k, t, _mm512_add_epi32(base, _mm512_set1_epi32(off)))
            PC_POOL22_SELECT(v1, 1);
            PC_POOL22_SELECT(v2, W);
            PC_POOL22_SELECT(v3, W + 1);
#undef PC_POOL22_SELECT
            if (relu)  /* y < 0 -> 0; a NaN stays */
                m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, zero, _CMP_LT_OQ), zero);
            _mm512_mask_storeu_ps(y + (pc_idx)p * Q + q0, mn, m);
            if (am16)
                _mm256_mask_storeu_epi16((uint16_t *)am + (pc_idx)p * Q + q0, mn, _mm512_cvtepi32_epi16(k));
            else
                _mm512_mask_storeu_epi32((int *)am + (pc_idx)p * Q + q0, mn, k);
        }
    }
}
#define PC_POOL22_CALL pc_pool22_avx512
#elif defined(__AVX2__)
#include <immintrin.h>
#define PC_POOL22_SIMD 1
/* The AVX2 form: 8 windows at a time, masks as vectors, the taps split by shuffles. */
static inline void pc_pool22_avx2(const float *restrict x, int W, int P, int Q, float *restrict y,
                                  void *restrict am, int am16, int relu)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i ev = _mm256_add_epi32(lane, lane);
    const __m256 zero = _mm256_setzero_ps();
    for (int p = 0; p < P; p++) {
        const float *r0 = x + (pc_idx)(2 * p) * W, *r1 = r0 + W;
        for (int q0 = 0; q0 < Q; q0 += 8) {
            /* a whole chunk reads 16 floats of each row, all inside the 2Q <= W the windows cover,
             * so only the last, partial chunk of a row needs masks (slow stores on Zen 4) */
            const int n = Q - q0 < 8 ? Q - q0 : 8, w2 = 2 * n;
            __m256 a0, a1, b0, b1;
            __m256i mn = _mm256_setzero_si256();
            if (n == 8) {
                a0 = _mm256_loadu_ps(r0 + 2 * q0), a1 = _mm256_loadu_ps(r0 + 2 * q0 + 8);
                b0 = _mm256_loadu_ps(r1 + 2 * q0), b1 = _mm256_loadu_ps(r1 + 2 * q0 + 8);
            } else {
                const __m256i mlo = _mm256_cmpgt_epi32(_mm256_set1_epi32(w2), lane);
                const __m256i mhi = _mm256_cmpgt_epi32(_mm256_set1_epi32(w2 - 8), lane);
                mn = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
                a0 = _mm256_maskload_ps(r0 + 2 * q0, mlo), a1 = _mm256_maskload_ps(r0 + 2 * q0 + 8, mhi);
                b0 = _mm256_maskload_ps(r1 + 2 * q0, mlo), b1 = _mm256_maskload_ps(r1 + 2 * q0 + 8, mhi);
            }
            /* within each 128-bit lane, then the 64-bit quarters back in order */
#define PC_POOL22_SPLIT(lo, hi, sel) \
            _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps((lo), (hi), (sel))), 0xD8))
            const __m256 v1 = PC_POOL22_SPLIT(a0, a1, 0xDD);
            const __m256 v2 = PC_POOL22_SPLIT(b0, b1, 0x88), v3 = PC_POOL22_SPLIT(b0, b1, 0xDD);
            __m256 m = PC_POOL22_SPLIT(a0, a1, 0x88);
#undef PC_POOL22_SPLIT
            const __m256i base = _mm256_add_epi32(_mm256_set1_epi32(2 * p * W + 2 * q0), ev);
            __m256i k = base;
            __m256 t;
#define PC_POOL22_SELECT(v, off)                                                                      \
            t = _mm256_or_ps(_mm256_cmp_ps((v), m, _CMP_GT_OQ),                                       \
                             _mm256_and_ps(_mm256_cmp_ps((v), (v), _CMP_UNORD_Q), _mm256_cmp_ps(m, m, _CMP_ORD_Q))); \
            m = _mm256_blendv_ps(m, (v), t);                                                          \
            k = _mm256_blendv_epi8(k, _mm256_add_epi32(base, _mm256_set1_epi32(off)), _mm256_castps_si256(t))
            PC_POOL22_SELECT(v1, 1);
            PC_POOL22_SELECT(v2, W);
            PC_POOL22_SELECT(v3, W + 1);
#undef PC_POOL22_SELECT
            if (relu)
                m = _mm256_blendv_ps(m, zero, _mm256_cmp_ps(m, zero, _CMP_LT_OQ));
            if (n == 8)
                _mm256_storeu_ps(y + (pc_idx)p * Q + q0, m);
            else
                _mm256_maskstore_ps(y + (pc_idx)p * Q + q0, mn, m);
            if (am16) {
                /* indices < 65536: the unsigned saturating pack keeps them; 8 of them in order */
                const __m128i pk = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(k, k), 0x08));
                uint16_t *ao = (uint16_t *)am + (pc_idx)p * Q + q0;
                if (n == 8) {
                    _mm_storeu_si128((__m128i *)ao, pk);
                } else {
                    uint16_t tmp[8];
                    _mm_storeu_si128((__m128i *)tmp, pk);
                    memcpy(ao, tmp, sizeof(uint16_t) * (size_t)n);
                }
            } else if (n == 8) {
                _mm256_storeu_si256((__m256i *)((int *)am + (pc_idx)p * Q + q0), k);
            } else {
                _mm256_maskstore_epi32((int *)am + (pc_idx)p * Q + q0, mn, k);
            }
        }
    }
}
#define PC_POOL22_CALL pc_pool22_avx2
#else
#define PC_POOL22_SIMD 0
#define PC_POOL22_CALL(...) ((void)0)
#endif

/* Max pooling of one (H, W) plane: K x K windows, stride S, P x Q outputs, window origins in
 * base (pc_pool_bases). am gets the flat index h*W + w of each window's first maximum, as int
 * (pc_pool_plane) or, for planes of at most PC_POOL_U16_MAX positions, as uint16_t
 * (pc_pool_plane_u16: half the bytes to write and read back); relu: y = max(window max, 0)
 * (the argmax still of the window itself). 2x2 windows at stride 2 go to the vector form above
 * where the build has one; otherwise rows of 16 or more outputs go tap by tap along each row
 * (plain or permuted loads), shorter rows tap by tap over the whole plane through base
 * (gathers). */
#define PC_POOL_U16_MAX 65536
#define PC_DEFINE_POOL_PLANE(SUF, AM_T)                                                              \
    static inline void pc_pool_plane##SUF(const float *restrict x, const int *restrict base, int W, \
                                          int K, int S, int P, int Q, float *restrict y,            \
                                          AM_T *restrict am, int relu)                              \
    {                                                                                               \
        pc_idx PQ = (pc_idx)P * Q;                                                                  \
        if (PC_POOL22_SIMD && K == 2 && S == 2) {                                                   \
            PC_POOL22_CALL(x, W, P, Q, y, am, sizeof(AM_T) == 2, relu);                             \
            return;                                                                                 \
        }                                                                                           \
        if (Q >= 16) {                                                                              \
            for (int p = 0; p < P; p++) {                                                           \
                float *yr = y + (pc_idx)p * Q;                                                      \
                AM_T *ar = am + (pc_idx)p * Q;                                                      \
                for (int q = 0; q < Q; q++) {                                                       \
                    ar[q] = (AM_T)(p * S * W + q * S);                                              \
                    yr[q] = x[p * S * W + q * S];                                                   \
                }                                                                                   \
                for (int kh = 0; kh < K; kh++) {                                                    \
                    for (int kw = kh == 0 ? 1 : 0; kw < K; kw++) {                                  \
                        int b0 = (p * S + kh) * W + kw;                                             \
                        if (S == 1) pc_pool_tap_s1##SUF(x, yr, ar, Q, b0);                          \
                        else if (S == 2) pc_pool_tap_s2##SUF(x, yr, ar, Q, b0);                     \
                        else pc_pool_tap_sn##SUF(x, yr, ar, Q, b0, S);                              \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        } else {                                                                                    \
            for (pc_idx t = 0; t < PQ; t++) {                                                       \
                am[t] = (AM_T)base[t];                                                              \
                y[t] = x[base[t]];                                                                  \
            }                                                                                       \
            for (int kh = 0; kh < K; kh++) {                                                        \
                for (int kw = kh == 0 ? 1 : 0; kw < K; kw++) {                                      \
                    int off = kh * W + kw;                                                          \
                    for (pc_idx t = 0; t < PQ; t++) {                                               \
                        int idx = base[t] + off;                                                    \
                        float v = x[idx];                                                           \
                        PC_POOL_SELECT(v, idx, y[t], am[t]);                                        \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        if (relu) {                                                                                 \
            for (pc_idx t = 0; t < PQ; t++) y[t] = y[t] < 0.0f ? 0.0f : y[t];                      \
        }                                                                                           \
    }
PC_DEFINE_POOL_PLANE(, int)
PC_DEFINE_POOL_PLANE(_u16, uint16_t)

/* ----------------------------------------------------------------- conv */

/* First and one-past-last output column q whose input column q*S + kw - pad lies in [0, W). */
static inline void pc_valid_q(int W, int Q, int S, int kw, int pad, int *q_lo, int *q_hi)
{
    int off = kw - pad;  /* w = q*S + off */
    int lo = off >= 0 ? 0 : (-off + S - 1) / S;
    int hi = (W - 1 - off) >= 0 ? (W - 1 - off) / S + 1 : 0;
    if (hi > Q) hi = Q;
    if (lo > hi) lo = hi;
    *q_lo = lo;
    *q_hi = hi;
}

/* im2col for channels [c0, c1) and output rows [p0, p1) of one image.
 * x: one image (C, H, W); cols: ((c1-c0)*K*K, (p1-p0)*Q) with row stride T >= (p1-p0)*Q, overwritten. */
static inline void pc_im2col(const float *restrict x, int H, int W, int K, int S, int pad, int Q,
                             int c0, int c1, int p0, int p1, float *restrict cols, pc_idx T)
{
    float *row = cols;
    for (int c = c0; c < c1; c++) {
        const float *xc = x + (pc_idx)c * H * W;
        for (int kh = 0; kh < K; kh++) {
            for (int kw = 0; kw < K; kw++, row += T) {
                int q_lo, q_hi;
                pc_valid_q(W, Q, S, kw, pad, &q_lo, &q_hi);
                for (int p = p0; p < p1; p++) {
                    float *dst = row + (pc_idx)(p - p0) * Q;
                    int h = p * S + kh - pad;
                    if (h < 0 || h >= H) {
                        memset(dst, 0, sizeof(float) * (size_t)Q);
                        continue;
                    }
                    const float *src = xc + (pc_idx)h * W + (kw - pad);
                    for (int q = 0; q < q_lo; q++) dst[q] = 0.0f;
                    if (S == 1) {
                        memcpy(dst + q_lo, src + q_lo, sizeof(float) * (size_t)(q_hi - q_lo));
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[q] = src[(pc_idx)q * S];
                    }
                    for (int q = q_hi; q < Q; q++) dst[q] = 0.0f;
                }
            }
        }
    }
}

/* col2im, accumulating: dx[c] += scatter(dcols) for channels [c0, c1) and output rows [p0, p1).
 * dx: one image (C, H, W); dcols: ((c1-c0)*K*K, (p1-p0)*Q). */
static inline void pc_col2im(const float *restrict dcols, int H, int W, int K, int S, int pad, int Q,
                             int c0, int c1, int p0, int p1, float *restrict dx)
{
    pc_idx T = (pc_idx)(p1 - p0) * Q;
    const float *row = dcols;
    for (int c = c0; c < c1; c++) {
        float *dxc = dx + (pc_idx)c * H * W;
        for (int kh = 0; kh < K; kh++) {
            for (int kw = 0; kw < K; kw++, row += T) {
                int q_lo, q_hi;
                pc_valid_q(W, Q, S, kw, pad, &q_lo, &q_hi);
                for (int p = p0; p < p1; p++) {
                    int h = p * S + kh - pad;
                    if (h < 0 || h >= H) continue;
                    const float *src = row + (pc_idx)(p - p0) * Q;
                    float *dst = dxc + (pc_idx)h * W + (kw - pad);
                    if (S == 1) {
                        PC_SIMD
                        for (int q = q_lo; q < q_hi; q++) dst[q] += src[q];
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[(pc_idx)q * S] += src[q];
                    }
                }
            }
        }
    }
}

/* Sum of n floats, in double: 16 float partial sums (vectorisable), then added in double. */
static inline double pc_sum_f32(const float *restrict p, pc_idx n)
{
    float acc[16] = {0.0f};
    pc_idx i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += p[i + j];
    double s = 0.0;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += p[i];
    return s;
}

/* y[o, s] += b[o] for a tile of T spatial positions with row stride ld. */
static inline void pc_add_bias(float *restrict y, const float *restrict b, int O, pc_idx T, pc_idx ld)
{
    for (int o = 0; o < O; o++) {
        float bo = b[o];
        float *yo = y + (pc_idx)o * ld;
        PC_SIMD
        for (pc_idx s = 0; s < T; s++) yo[s] += bo;
    }
}

#endif /* PARCONV_PC_COMMON_H */
