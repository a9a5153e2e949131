/* Pooling kernels of one (H, W) plane: square-window max pooling (the tap loops, the vector 2x2
 * forms and the plane driver the fused conv+ReLU+maxpool kernel shares), max pooling with padding
 * and rectangular windows, average pooling and adaptive average pooling, forward and backward.
 *
 * Shape legend: H, W input plane, P, Q output plane, KH x KW window, SH, SW strides, PH, PW
 * padding on each side (at most half the window, so every window holds an input). Floor mode:
 * P = (H + 2 PH - KH) / SH + 1, Q likewise. Planes never share inputs, so the callers run one
 * plane per chunk and every backward here overwrites its own plane without races.
 */
#ifndef PARCONV_PC_POOL_H
#define PARCONV_PC_POOL_H

#include "pc_common.h"

/* ------------------------------------------------- square windows, no padding */

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
 * The generic loops below gather for rows of fewer than 16 outputs and go tap by tap along longer
 * rows, several times slower per plane. */
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
             * so only the last, partial chunk of a row needs masks (masked stores are slow on some CPUs) */
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

/* ----------------------------------------- padding, rectangular windows, averages */

/* First and one-past-last index of the window [o*S - pad, o*S - pad + K) inside [0, n). */
static inline void pc_pool_window(int o, int S, int pad, int K, int n, int *lo, int *hi)
{
    int a = o * S - pad, b = a + K;
    *lo = a < 0 ? 0 : a;
    *hi = b > n ? n : b;
}

/* Max pooling with padding: padded positions never win (they are -inf, and every window holds an
 * input). am gets the flat index h*W + w of the first maximum, the first NaN if any (np.argmax). */
static inline void pc_maxpool_general_plane(const float *restrict x, int H, int W, int KH, int KW, int SH,
                                            int SW, int PH, int PW, int P, int Q, float *restrict y,
                                            int *restrict am)
{
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            float best = x[(pc_idx)h0 * W + w0];
            int bi = h0 * W + w0;
            for (int h = h0; h < h1; h++) {
                for (int w = (h == h0 ? w0 + 1 : w0); w < w1; w++) {
                    int idx = h * W + w;
                    float v = x[idx];
                    PC_POOL_SELECT(v, idx, best, bi);
                }
            }
            y[(pc_idx)p * Q + q] = best;
            am[(pc_idx)p * Q + q] = bi;
        }
    }
}

/* Average pooling, zero padding counted: each window's sum of inputs times 1 / (KH KW).
 * Rows of the window are summed in order, so the result does not depend on the thread count. */
static inline void pc_avgpool_plane(const float *restrict x, int H, int W, int KH, int KW, int SH, int SW,
                                    int PH, int PW, int P, int Q, float *restrict y)
{
    const float scale = 1.0f / (float)(KH * KW);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            float s = 0.0f;
            for (int h = h0; h < h1; h++) {
                const float *xr = x + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) s += xr[w];
            }
            y[(pc_idx)p * Q + q] = s * scale;
        }
    }
}

/* Gradient of pc_avgpool_plane: dx = 0, then every window adds dy / (KH KW) to its inputs. */
static inline void pc_avgpool_backward_plane(const float *restrict dy, int H, int W, int KH, int KW, int SH,
                                             int SW, int PH, int PW, int P, int Q, float *restrict dx)
{
    const float scale = 1.0f / (float)(KH * KW);
    memset(dx, 0, sizeof(float) * (size_t)H * (size_t)W);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_pool_window(p, SH, PH, KH, H, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_pool_window(q, SW, PW, KW, W, &w0, &w1);
            const float g = dy[(pc_idx)p * Q + q] * scale;
            for (int h = h0; h < h1; h++) {
                float *dr = dx + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) dr[w] += g;
            }
        }
    }
}

/* PyTorch's adaptive window of output i: [floor(i n / out), ceil((i + 1) n / out)). */
static inline void pc_adaptive_window(int i, int n, int out, int *lo, int *hi)
{
    *lo = (int)(((long long)i * n) / out);
    *hi = (int)(((long long)(i + 1) * n + out - 1) / out);
}

/* Adaptive average pooling of one plane to P x Q (each window summed in double, then divided). */
static inline void pc_adaptive_avgpool_plane(const float *restrict x, int H, int W, int P, int Q,
                                             float *restrict y)
{
    if (P == 1 && Q == 1) {  /* global average pooling: one streaming sum */
        y[0] = (float)(pc_sum_f32(x, (pc_idx)H * W) / ((double)H * W));
        return;
    }
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_adaptive_window(p, H, P, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_adaptive_window(q, W, Q, &w0, &w1);
            double s = 0.0;
            for (int h = h0; h < h1; h++) {
                const float *xr = x + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) s += xr[w];
            }
            y[(pc_idx)p * Q + q] = (float)(s / ((double)(h1 - h0) * (w1 - w0)));
        }
    }
}

/* Gradient of pc_adaptive_avgpool_plane: dx = 0, then each window adds dy / area to its inputs. */
static inline void pc_adaptive_avgpool_backward_plane(const float *restrict dy, int H, int W, int P, int Q,
                                                      float *restrict dx)
{
    if (P == 1 && Q == 1) {
        const float g = (float)((double)dy[0] / ((double)H * W));
        pc_idx n = (pc_idx)H * W;
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) dx[i] = g;
        return;
    }
    memset(dx, 0, sizeof(float) * (size_t)H * (size_t)W);
    for (int p = 0; p < P; p++) {
        int h0, h1;
        pc_adaptive_window(p, H, P, &h0, &h1);
        for (int q = 0; q < Q; q++) {
            int w0, w1;
            pc_adaptive_window(q, W, Q, &w0, &w1);
            const float g = (float)((double)dy[(pc_idx)p * Q + q] / ((double)(h1 - h0) * (w1 - w0)));
            for (int h = h0; h < h1; h++) {
                float *dr = dx + (pc_idx)h * W;
                for (int w = w0; w < w1; w++) dr[w] += g;
            }
        }
    }
}

#endif /* PARCONV_PC_POOL_H */
