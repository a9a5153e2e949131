/* int8 inference kernels for _int8.pyx: uint8 activations, int8 weights, int32 accumulation.
 *
 * Shape legend: N batch, C in-channels (C4: C rounded up to 4), O out-channels (O64: rounded up
 * to 64), H, W input, P, Q output, K kernel, S stride, F in-features, G out-features,
 * Kg the reduction in 4-byte groups.
 *
 * Every product is u8 x s8 summed exactly in int32, so every path (VNNI, AVX2, portable C) gives
 * the same integers; y = float32(acc + zb[o]) * scale[o] (then ReLU), where zb folds the bias and
 * the activation zero point (acc sums raw xq * wq; zb = bias_q - z_x * row_sums).
 *
 * Convolution is direct, on a "grid": the image padded with the zero point, channels interleaved
 * in fours ([C4/4][phase][Hg][Wg][4] bytes; stride S splits the padded image into S x S phases),
 * so the 4 bytes a VNNI lane needs (4 channels of one tap at one pixel) are contiguous and 16
 * output pixels of one tap are one 64-byte load: no im2col. Output pixel (p, q) is grid position
 * s = p * Wg + q; columns q >= Q of the grid are computed and dropped. Weights are packed into
 * panels of 16 output channels, [Kg][16][4], with g = (cg * K + kh) * K + kw (zeros past C);
 * pack_weights keeps the raw (O, Kdim) copy, since the order depends on K, which only the
 * convolution call knows: the panels are laid out for a K on its first use.
 * Linear uses the same panels with K = 1 and puts output channels on the vector lanes instead
 * (x rows broadcast), so y comes out row-major.
 */
#ifndef PARCONV_PC_INT8_H
#define PARCONV_PC_INT8_H

#include <stdint.h>
#include <string.h>

#include "pc_common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__GNUC__)
#define PCI8_VNNI_CODE 1
#define PCI8_VNNI_TARGET __attribute__((target("avx512vnni,avx512f,avx512bw")))
#endif
#if defined(__AVX2__)
#define PCI8_AVX2_CODE 1
#endif
/* AVX-VNNI (VEX vpdpbusd on 8 lanes): many CPUs without AVX-512 have it, so the AVX2 level's objects carry it,
 * chosen at run time */
#if defined(PCI8_AVX2_CODE) && defined(__has_include)
#if __has_include(<avxvnniintrin.h>)
#define PCI8_HAS_AVXVNNI_HEADER 1
#endif
#endif
#if defined(PCI8_HAS_AVXVNNI_HEADER)
#include <cpuid.h>
#define PCI8_AVXVNNI_CODE 1
#define PCI8_AVXVNNI_TARGET __attribute__((target("avxvnni,avx2")))
#endif

#define PCI8_TILE 32   /* output pixels per conv micro-tile (two 16-lane vectors) */
#define PCI8_OB 8      /* output channels per conv micro-tile */
#define PCI8_CB 64     /* output channels per linear micro-tile (four panels) */
#define PCI8_RB 4      /* x rows per linear micro-tile */

enum { PCI8_PORTABLE = 0, PCI8_AVX2 = 1, PCI8_VNNI = 2, PCI8_AVXVNNI = 3 };

/* Whether this CPU has AVX-VNNI (CPUID leaf 7, subleaf 1, EAX bit 4); the AVX2 code it extends only runs
 * where the OS keeps the YMM state. */
static inline int pci8_has_avxvnni(void)
{
#if defined(PCI8_AVXVNNI_CODE)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1u);
#else
    return 0;
#endif
}

/* Whether this object and CPU run path p. */
static inline int pci8_path_runs(int p)
{
    switch (p) {
    case PCI8_PORTABLE: return 1;
#if defined(PCI8_AVX2_CODE)
    case PCI8_AVX2: return 1;
#endif
#if defined(PCI8_AVXVNNI_CODE)
    case PCI8_AVXVNNI: return pci8_has_avxvnni();
#endif
#if defined(PCI8_VNNI_CODE)
    case PCI8_VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512vnni");
#endif
    default: return 0;
    }
}

/* The fastest path this object and CPU run. */
static inline int pci8_best_path(void)
{
    if (pci8_path_runs(PCI8_VNNI)) return PCI8_VNNI;
    if (pci8_path_runs(PCI8_AVXVNNI)) return PCI8_AVXVNNI;
    return pci8_path_runs(PCI8_AVX2) ? PCI8_AVX2 : PCI8_PORTABLE;
}

static inline int32_t pci8_ld32(const void *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline int64_t pci8_ld64(const void *p)
{
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---------------------------------------------------------------- quantize */

/* clamp(rint(v) + zp, 0, 255), NaN -> zp. v is clamped to +-1024 first (the result saturates
 * there anyway), so the 1.5 * 2^23 trick rounds half to even without a libm call and the loops
 * vectorise on every level. */
static inline uint8_t pci8_q1(float v, int zp)
{
    int nan = v != v;
    float c = nan ? 0.0f : (v < -1024.0f ? -1024.0f : (v > 1024.0f ? 1024.0f : v));
    float r = (c + 12582912.0f) - 12582912.0f;
    int q = (int)r + zp;
    q = q < 0 ? 0 : (q > 255 ? 255 : q);
    return (uint8_t)(nan ? zp : q);
}

#define PCI8_QBLOCK 256

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 lanes of pci8_quantize's vector path (its one definition: the quantize pass and the
 * epilogues that quantize for the next layer give the same bits): vcvtps2dq rounds half to even
 * in the default MXCSR mode; x * (1 / scale) unless a lane lies near a tie, then x / scale. */
static inline __m512i pci8_q16(__m512 xv, __m512 vr, __m512 vs, int fast, __m512i vz)
{
    const __m512 lo = _mm512_set1_ps(-1024.0f), hi = _mm512_set1_ps(1024.0f), tie = _mm512_set1_ps(0.499f);
    __m512 v = fast ? _mm512_mul_ps(xv, vr) : _mm512_div_ps(xv, vs);
    __m512 c = _mm512_min_ps(_mm512_max_ps(v, lo), hi); /* NaN -> -1024, replaced below */
    __m512i k = _mm512_cvtps_epi32(c);
    if (fast) {
        __m512 d = _mm512_abs_ps(_mm512_sub_ps(c, _mm512_cvtepi32_ps(k)));
        if (_mm512_cmp_ps_mask(d, tie, _CMP_GT_OQ)) {
            v = _mm512_div_ps(xv, vs);
            c = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            k = _mm512_cvtps_epi32(c);
        }
    }
    k = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(k, vz), _mm512_setzero_si512()), _mm512_set1_epi32(255));
    return _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), vz);
}

/* pci8_q16 on two vectors with one near-tie test and branch for both (a vector redone with the division
 * gives the same integers where the product was not near a tie, so redoing both changes no bit). */
static inline void pci8_q16x2(__m512 x0, __m512 x1, __m512 vr, __m512 vs, int fast, __m512i vz, __m512i *k0,
                              __m512i *k1)
{
    const __m512 lo = _mm512_set1_ps(-1024.0f), hi = _mm512_set1_ps(1024.0f), tie = _mm512_set1_ps(0.499f);
    __m512 v0 = fast ? _mm512_mul_ps(x0, vr) : _mm512_div_ps(x0, vs);
    __m512 v1 = fast ? _mm512_mul_ps(x1, vr) : _mm512_div_ps(x1, vs);
    __m512 c0 = _mm512_min_ps(_mm512_max_ps(v0, lo), hi), c1 = _mm512_min_ps(_mm512_max_ps(v1, lo), hi);
    __m512i i0 = _mm512_cvtps_epi32(c0), i1 = _mm512_cvtps_epi32(c1);
    if (fast) {
        __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(c0, _mm512_cvtepi32_ps(i0))), tie, _CMP_GT_OQ);
        __mmask16 m1 = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(c1, _mm512_cvtepi32_ps(i1))), tie, _CMP_GT_OQ);
        if (m0 | m1) {
            v0 = _mm512_div_ps(x0, vs);
            v1 = _mm512_div_ps(x1, vs);
            i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v0, lo), hi));
            i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v1, lo), hi));
        }
    }
    const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
    i0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(i0, vz), zero), top);
    i1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(i1, vz), zero), top);
    *k0 = _mm512_mask_mov_epi32(i0, _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), vz);
    *k1 = _mm512_mask_mov_epi32(i1, _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q), vz);
}

/* pci8_q16x2 for an epilogue's values where they cannot be NaN (float32(acc + zb) * scale with finite scales:
 * conv2d_forward and depthwise_forward take these epilogues only then), with a ReLU before it folded into the clamp: lo = 0 after a ReLU,
 * else -zp; hi = 255 - zp. rint is monotone and the bounds are integers, so clamping before rounding gives
 * pci8_q16x2's bits with five fewer operations a vector; a clamped value is an integer, never near a tie. */
static inline void pci8_q16x2_epi(__m512 x0, __m512 x1, __m512 vr, __m512 vs, int fast, __m512 lo, __m512 hi,
                                  __m512i vz, __m512i *k0, __m512i *k1)
{
    /* the product by the reciprocal lies within 1.8e-7 relative of the quotient, so inside the clamp's range
     * (|c| <= 255) within 4.6e-5: only a lane that close to a half-integer can round differently */
    const __m512 tie = _mm512_set1_ps(0.4999f);
    __m512 c0 = _mm512_min_ps(_mm512_max_ps(fast ? _mm512_mul_ps(x0, vr) : _mm512_div_ps(x0, vs), lo), hi);
    __m512 c1 = _mm512_min_ps(_mm512_max_ps(fast ? _mm512_mul_ps(x1, vr) : _mm512_div_ps(x1, vs), lo), hi);
    if (fast) {
#if defined(__AVX512DQ__)
        /* c - rint(c) in one instruction (round to nearest even, exceptions suppressed) */
        const __m512 d0 = _mm512_reduce_ps(c0, 0x08), d1 = _mm512_reduce_ps(c1, 0x08);
#else
        const __m512 d0 = _mm512_sub_ps(c0, _mm512_roundscale_ps(c0, 0x08));
        const __m512 d1 = _mm512_sub_ps(c1, _mm512_roundscale_ps(c1, 0x08));
#endif
        if (_mm512_cmp_ps_mask(_mm512_abs_ps(d0), tie, _CMP_GT_OQ) |
            _mm512_cmp_ps_mask(_mm512_abs_ps(d1), tie, _CMP_GT_OQ)) {
            c0 = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x0, vs), lo), hi);
            c1 = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x1, vs), lo), hi);
        }
    }
    *k0 = _mm512_add_epi32(_mm512_cvtps_epi32(c0), vz);
    *k1 = _mm512_add_epi32(_mm512_cvtps_epi32(c1), vz);
}

/* pci8_q16x2_epi on one vector. */
static inline __m512i pci8_q16_epi(__m512 x, __m512 vr, __m512 vs, int fast, __m512 lo, __m512 hi, __m512i vz)
{
    __m512 c = _mm512_min_ps(_mm512_max_ps(fast ? _mm512_mul_ps(x, vr) : _mm512_div_ps(x, vs), lo), hi);
    if (fast) {
#if defined(__AVX512DQ__)
        const __m512 d = _mm512_reduce_ps(c, 0x08);
#else
        const __m512 d = _mm512_sub_ps(c, _mm512_roundscale_ps(c, 0x08));
#endif
        if (_mm512_cmp_ps_mask(_mm512_abs_ps(d), _mm512_set1_ps(0.4999f), _CMP_GT_OQ)) /* as pci8_q16x2_epi */
            c = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, vs), lo), hi);
    }
    return _mm512_add_epi32(_mm512_cvtps_epi32(c), vz);
}
#endif

/* out = clamp(rint(x / scale) + zp, 0, 255), NaN -> zp, x / scale rounded in float32.
 * Division is several times slower than multiplication, so each block first uses x * (1 / scale):
 * within 3 * 2^-24 relative of x / scale (|x / scale| <= 1024 matters; beyond it saturates), it
 * rounds to the same integer unless it lies within 1e-3 of a half-integer; a block with such a
 * value is redone with the division. Scales whose reciprocal is not a normal float always divide. */
static inline void pci8_quantize(const float *restrict x, pc_idx n, float scale, int zp, uint8_t *restrict out)
{
    const float rcp = 1.0f / scale;
    const int fast = scale > 1e-37f && scale < 1e37f;
    pc_idx start = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same with vcvtps2dq (rounds half to even in the default MXCSR mode) and a division only
     * for a vector that holds a near-tie */
    {
        const __m512 vr = _mm512_set1_ps(rcp), vs = _mm512_set1_ps(scale);
        const __m512i vz = _mm512_set1_epi32(zp);
        for (; start + 16 <= n; start += 16)
            _mm_storeu_si128((__m128i *)(out + start),
                             _mm512_cvtepi32_epi8(pci8_q16(_mm512_loadu_ps(x + start), vr, vs, fast, vz)));
    }
#elif defined(__AVX2__)
    /* pci8_q16x2's steps on 8-lane vectors, 16 values at a time (GCC leaves the loop below scalar) */
    {
        const __m256 vr = _mm256_set1_ps(rcp), vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-1024.0f),
                     hi = _mm256_set1_ps(1024.0f), tie = _mm256_set1_ps(0.499f),
                     mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        const __m256i vz = _mm256_set1_epi32(zp), zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
        for (; start + 16 <= n; start += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + start), x1 = _mm256_loadu_ps(x + start + 8);
            __m256 v0 = fast ? _mm256_mul_ps(x0, vr) : _mm256_div_ps(x0, vs);
            __m256 v1 = fast ? _mm256_mul_ps(x1, vr) : _mm256_div_ps(x1, vs);
            /* max(v, lo) is lo where v is NaN; those lanes become zp below */
            const __m256 c0 = _mm256_min_ps(_mm256_max_ps(v0, lo), hi), c1 = _mm256_min_ps(_mm256_max_ps(v1, lo), hi);
            __m256i i0 = _mm256_cvtps_epi32(c0), i1 = _mm256_cvtps_epi32(c1);
            if (fast) {
                const __m256 d0 = _mm256_and_ps(_mm256_sub_ps(c0, _mm256_cvtepi32_ps(i0)), mag);
                const __m256 d1 = _mm256_and_ps(_mm256_sub_ps(c1, _mm256_cvtepi32_ps(i1)), mag);
                if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(d0, tie, _CMP_GT_OQ),
                                                    _mm256_cmp_ps(d1, tie, _CMP_GT_OQ)))) {
                    v0 = _mm256_div_ps(x0, vs);
                    v1 = _mm256_div_ps(x1, vs);
                    i0 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v0, lo), hi));
                    i1 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v1, lo), hi));
                }
            }
            i0 = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(i0, vz), zero), top);
            i1 = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(i1, vz), zero), top);
            i0 = _mm256_blendv_epi8(i0, vz, _mm256_castps_si256(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q)));
            i1 = _mm256_blendv_epi8(i1, vz, _mm256_castps_si256(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
            /* 0..255 in int32 -> bytes: packus works per 128-bit lane, the permute restores the order */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(i0, i1), 0xD8);
            _mm_storeu_si128((__m128i *)(out + start),
                             _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
        }
    }
#endif
    for (pc_idx i0 = start; i0 < n; i0 += PCI8_QBLOCK) {
        int m = n - i0 < PCI8_QBLOCK ? (int)(n - i0) : PCI8_QBLOCK;
        const float *xb = x + i0;
        uint8_t *ob = out + i0;
        int near = 1;
        if (fast) {
            near = 0;
            /* a count, not an `omp simd reduction(|:...)` of the comparisons: GCC's AVX2 code for
             * that reduction lost lanes (a near-tie in one lane of a block went undetected) */
            for (int i = 0; i < m; i++) {
                float v = xb[i] * rcp;
                float c = v != v ? 0.0f : (v < -1024.0f ? -1024.0f : (v > 1024.0f ? 1024.0f : v));
                float d = c - ((c + 12582912.0f) - 12582912.0f);
                near += d > 0.499f || d < -0.499f;
                ob[i] = pci8_q1(v, zp);
            }
        }
        if (near) {
            PC_SIMD
            for (int i = 0; i < m; i++) ob[i] = pci8_q1(xb[i] / scale, zp);
        }
    }
}

/* -------------------------------------------------------------- packing */

/* Groups of 4 bytes along the reduction for kernel size K: ceil(C / 4) * K * K, C = Kdim / (K*K). */
static inline int pci8_groups(int Kdim, int K)
{
    int KK = K * K, C = Kdim / KK;
    return (C + 3) / 4 * KK;
}

/* Lay raw (O, Kdim) int8 weights out as panels for kernel size K (see the top of the file):
 * p8 [O64/16][Kg][16][4] int8 and the same widened to int16 in p16 (the AVX2 path multiplies
 * int16 pairs). Channels past O and C are zero. */
static inline void pci8_pack(const int8_t *restrict raw, int O, int Kdim, int K, int O64, int8_t *restrict p8,
                             int16_t *restrict p16)
{
    int KK = K * K, C = Kdim / KK, Kg = pci8_groups(Kdim, K);
    pc_idx total = (pc_idx)O64 * Kg * 4;
    memset(p8, 0, (size_t)total);
    for (int o = 0; o < O; o++) {
        int8_t *panel = p8 + (pc_idx)(o / 16) * Kg * 64 + (o % 16) * 4;
        const int8_t *row = raw + (pc_idx)o * Kdim;
        for (int c = 0; c < C; c++)
            for (int t = 0; t < KK; t++)
                panel[(pc_idx)((c / 4) * KK + t) * 64 + (c % 4)] = row[c * KK + t];
    }
    for (pc_idx i = 0; i < total; i++) p16[i] = p8[i];
}

/* ------------------------------------------------------------------ grid */

#if defined(__SSE2__)
/* 16 pixels of four channel rows, bytewise interleaved into o[0..63] (pixel-major, channel-minor) */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void pci8_interleave4(__m128i r0, __m128i r1, __m128i r2, __m128i r3, uint8_t *o)
{
    __m128i l01 = _mm_unpacklo_epi8(r0, r1), h01 = _mm_unpackhi_epi8(r0, r1);
    __m128i l23 = _mm_unpacklo_epi8(r2, r3), h23 = _mm_unpackhi_epi8(r2, r3);
    _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi16(l01, l23));
    _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi16(l01, l23));
    _mm_storeu_si128((__m128i *)(o + 32), _mm_unpacklo_epi16(h01, h23));
    _mm_storeu_si128((__m128i *)(o + 48), _mm_unpackhi_epi16(h01, h23));
}
#endif

/* Column phase b of a row of width W padded by pad and split by stride S into Wg columns: the
 * columns gw whose input column gw * S + off (returned: b - pad) lies in [0, W) are [*lo, *hi). */
static inline int pci8_phase_cols(int b, int pad, int S, int W, int Wg, int *lo, int *hi)
{
    int off = b - pad;
    int l = off >= 0 ? 0 : (-off + S - 1) / S;
    int h = W - 1 - off >= 0 ? (W - 1 - off) / S + 1 : 0;
    if (h > Wg) h = Wg;
    *lo = l < h ? l : h;
    *hi = h;
    return off;
}

#define PCI8_ZROW 512 /* widest row a group of fewer than 4 channels pads with a row of z */

/* One channel group of one image's grid: channels 4cg..4cg+3 of x (C, H, W), padded by pad
 * with z, split into nph x nph stride phases of Hg x Wg, channels interleaved:
 * dst[((a * nph + b) * Hg + gh) * Wg + gw][j] = x[4cg + j][gh * S + a - pad][gw * S + b - pad]. */
static inline void pci8_grid_group(const uint8_t *restrict x, int C, int H, int W, int pad, int S, int nph, int Hg,
                                   int Wg, int cg, uint8_t z, uint8_t *restrict dst)
{
    const uint8_t *src[4];
    int nc = C - 4 * cg < 4 ? C - 4 * cg : 4;
    if (S == 1 && pad == 0) {
        /* one phase, rows unpadded (Wg == W): the group's planes are interleaved as one row, so
         * narrow maps (a pointwise layer's 8x8) still reach the 16-pixel vector loop */
        pc_idx n = (pc_idx)H * W, i = 0;
        for (int j = 0; j < nc; j++) src[j] = x + (pc_idx)(4 * cg + j) * n;
        if (nc == 4) {
#if defined(__SSE2__)
            for (; i + 16 <= n; i += 16)
                pci8_interleave4(_mm_loadu_si128((const __m128i *)(src[0] + i)),
                                 _mm_loadu_si128((const __m128i *)(src[1] + i)),
                                 _mm_loadu_si128((const __m128i *)(src[2] + i)),
                                 _mm_loadu_si128((const __m128i *)(src[3] + i)), dst + i * 4);
#endif
            for (; i < n; i++) {
                dst[i * 4] = src[0][i];
                dst[i * 4 + 1] = src[1][i];
                dst[i * 4 + 2] = src[2][i];
                dst[i * 4 + 3] = src[3][i];
            }
        } else {
            memset(dst, z, (size_t)n * 4);
            for (int j = 0; j < nc; j++)
                for (pc_idx k = 0; k < n; k++) dst[k * 4 + j] = src[j][k];
        }
        return;
    }
    /* a group of fewer than 4 channels (a first layer's 3) reads a row of z for the missing ones, so it
     * takes the vector loops too */
    uint8_t zrow[PCI8_ZROW];
    const int nv = nc < 4 && W <= PCI8_ZROW ? 4 : nc;
    if (nv != nc) memset(zrow, z, (size_t)W);
    for (int a = 0; a < nph; a++) {
        for (int b = 0; b < nph; b++) {
            int lo, hi, off = pci8_phase_cols(b, pad, S, W, Wg, &lo, &hi);
            for (int gh = 0; gh < Hg; gh++) {
                uint8_t *d = dst + (((pc_idx)a * nph + b) * Hg + gh) * Wg * 4;
                int h = gh * S + a - pad;
                if (h < 0 || h >= H || nv < 4) memset(d, z, (size_t)Wg * 4);
                if (h < 0 || h >= H) continue;
                for (int j = 0; j < nc; j++) src[j] = x + ((pc_idx)(4 * cg + j) * H + h) * W + off;
                for (int j = nc; j < nv; j++) src[j] = zrow + off; /* read at [off + lo, off + hi): inside */
                memset(d, z, (size_t)lo * 4);
                if (nv == 4 && S == 1) {
                    const uint8_t *s0 = src[0], *s1 = src[1], *s2 = src[2], *s3 = src[3];
                    int gw = lo;
#if defined(__SSE2__)
                    /* four rows interleaved bytewise, 16 pixels at a time */
                    for (; gw + 16 <= hi; gw += 16) {
                        __m128i r0 = _mm_loadu_si128((const __m128i *)(s0 + gw));
                        __m128i r1 = _mm_loadu_si128((const __m128i *)(s1 + gw));
                        __m128i r2 = _mm_loadu_si128((const __m128i *)(s2 + gw));
                        __m128i r3 = _mm_loadu_si128((const __m128i *)(s3 + gw));
                        pci8_interleave4(r0, r1, r2, r3, d + (pc_idx)gw * 4);
                    }
                    /* 8 at a time: rows of an 8x8 map (Wg 10 with padding) never reach the loop above */
                    for (; gw + 8 <= hi; gw += 8) {
                        __m128i l01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s0 + gw)),
                                                        _mm_loadl_epi64((const __m128i *)(s1 + gw)));
                        __m128i l23 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s2 + gw)),
                                                        _mm_loadl_epi64((const __m128i *)(s3 + gw)));
                        _mm_storeu_si128((__m128i *)(d + (pc_idx)gw * 4), _mm_unpacklo_epi16(l01, l23));
                        _mm_storeu_si128((__m128i *)(d + (pc_idx)gw * 4 + 16), _mm_unpackhi_epi16(l01, l23));
                    }
#endif
                    for (; gw < hi; gw++) {
                        d[gw * 4] = s0[gw];
                        d[gw * 4 + 1] = s1[gw];
                        d[gw * 4 + 2] = s2[gw];
                        d[gw * 4 + 3] = s3[gw];
                    }
                } else if (nv == 4) {
                    const uint8_t *s0 = src[0], *s1 = src[1], *s2 = src[2], *s3 = src[3];
                    int gw = lo;
#if defined(__SSE2__)
                    if (S == 2) {
                        /* even bytes of 32 (this phase's columns) from each row, then interleaved */
                        const __m128i even = _mm_set1_epi16(0x00FF);
                        /* the 32 bytes read stay in the row: from the first column when the odd byte
                         * after the last even one is in it, else from the byte before (the odd bytes) */
                        for (; gw + 16 <= hi; gw += 16) {
                            pc_idx w = (pc_idx)gw * 2;
                            if (2 * gw + off + 32 <= W) {
#define PCI8_EVEN(p) _mm_packus_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)((p) + w)), even), \
                                      _mm_and_si128(_mm_loadu_si128((const __m128i *)((p) + w + 16)), even))
                                __m128i r0 = PCI8_EVEN(s0), r1 = PCI8_EVEN(s1), r2 = PCI8_EVEN(s2),
                                        r3 = PCI8_EVEN(s3);
#undef PCI8_EVEN
                                pci8_interleave4(r0, r1, r2, r3, d + (pc_idx)gw * 4);
                            } else if (2 * gw + off >= 1) {
#define PCI8_ODD(p) _mm_packus_epi16(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)((p) + w - 1)), 8), \
                                     _mm_srli_epi16(_mm_loadu_si128((const __m128i *)((p) + w + 15)), 8))
                                __m128i r0 = PCI8_ODD(s0), r1 = PCI8_ODD(s1), r2 = PCI8_ODD(s2), r3 = PCI8_ODD(s3);
#undef PCI8_ODD
                                pci8_interleave4(r0, r1, r2, r3, d + (pc_idx)gw * 4);
                            } else {
                                break;
                            }
                        }
                    }
#endif
                    for (; gw < hi; gw++) {
                        pc_idx w = (pc_idx)gw * S;
                        uint32_t v = (uint32_t)s0[w] | (uint32_t)s1[w] << 8 | (uint32_t)s2[w] << 16 |
                                     (uint32_t)s3[w] << 24;
                        memcpy(d + (pc_idx)gw * 4, &v, 4);
                    }
                } else {
                    for (int j = 0; j < nc; j++) {
                        const uint8_t *s = src[j];
                        for (int gw = lo; gw < hi; gw++) d[gw * 4 + j] = s[(pc_idx)gw * S];
                    }
                }
                memset(d + (pc_idx)hi * 4, z, (size_t)(Wg - hi) * 4);
            }
        }
    }
}

/* ---------------------------------------------------------- epilogues */

/* out[i] = float32(a[i] + zb) * scale, ReLU'd if relu. wide: zb and the sum need int64
 * (else every sum fits int32 and the conversion is one vector instruction). */
static inline void pci8_epi_run(const int32_t *restrict a, int n, int32_t zb32, int64_t zb64, int wide, float scale,
                                int relu, float *restrict out)
{
    if (!wide) {
        if (relu) {
            PC_SIMD
            for (int i = 0; i < n; i++) {
                float v = (float)(a[i] + zb32) * scale;
                out[i] = v < 0.0f ? 0.0f : v;
            }
        } else {
            PC_SIMD
            for (int i = 0; i < n; i++) out[i] = (float)(a[i] + zb32) * scale;
        }
    } else {
        for (int i = 0; i < n; i++) {
            float v = (float)((int64_t)a[i] + zb64) * scale;
            out[i] = relu && v < 0.0f ? 0.0f : v;
        }
    }
}

/* out[o] = float32(a[o] + zb[o]) * scale[o] over n channels (a linear row). */
static inline void pci8_epi_row(const int32_t *restrict a, int n, const int32_t *restrict zb32,
                                const int64_t *restrict zb64, int wide, const float *restrict scale, int relu,
                                float *restrict out)
{
    if (!wide && relu) {
        PC_SIMD
        for (int i = 0; i < n; i++) {
            float v = (float)(a[i] + zb32[i]) * scale[i];
            out[i] = v < 0.0f ? 0.0f : v;
        }
    } else if (!wide) {
        PC_SIMD
        for (int i = 0; i < n; i++) out[i] = (float)(a[i] + zb32[i]) * scale[i];
    } else {
        for (int i = 0; i < n; i++) {
            float v = (float)((int64_t)a[i] + zb64[i]) * scale[i];
            out[i] = relu && v < 0.0f ? 0.0f : v;
        }
    }
}

/* The residual block's epilogue: out[i] = float32(a[i] + zb) * scale + r[i], then ReLU if relu, where
 * r[i] = rf[i] (a float32 shortcut) or float32(rq[i] - rz) * rs (a uint8 one, dequantized): the float32
 * operations of running the layers one by one (the convolution, DequantizeLinear, Add, Relu), in order. */
static inline void pci8_epi_run_res(const int32_t *restrict a, int n, int32_t zb32, int64_t zb64, int wide,
                                    float scale, int relu, const float *restrict rf, const uint8_t *restrict rq,
                                    float rs, int rz, float *restrict out)
{
    int i0 = 0;
#if defined(__AVX2__)
    /* runs are often one output row (8 or 16 pixels), too short for the 16-wide loop GCC makes of the ones
     * below; the same operations in the same order, 8 lanes at a time */
    if (!wide) {
        const __m256 vs = _mm256_set1_ps(scale), vrs = _mm256_set1_ps(rs), zero = _mm256_setzero_ps();
        const __m256i vzb = _mm256_set1_epi32(zb32), vrz = _mm256_set1_epi32(rz);
        for (; i0 + 8 <= n; i0 += 8) {
            __m256 v = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(a + i0)), vzb)), vs);
            const __m256 r =
                rf != NULL ? _mm256_loadu_ps(rf + i0)
                           : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(
                                               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rq + i0))), vrz)),
                                           vrs);
            v = _mm256_add_ps(v, r);
            if (relu) /* v < 0 ? 0 : v: NaN and -0 pass */
                v = _mm256_andnot_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ), v);
            _mm256_storeu_ps(out + i0, v);
        }
    }
#endif
    /* the ReLU tested outside the loops: GCC leaves a loop with `relu && v < 0` in its body scalar */
#define PCI8_RES_LOOP(SUM, R)                                      \
    do {                                                           \
        if (relu) {                                                \
            PC_SIMD                                                \
            for (int i = i0; i < n; i++) {                         \
                float v = (float)(SUM) * scale + (R);              \
                out[i] = v < 0.0f ? 0.0f : v;                      \
            }                                                      \
        } else {                                                   \
            PC_SIMD                                                \
            for (int i = i0; i < n; i++) out[i] = (float)(SUM) * scale + (R); \
        }                                                          \
    } while (0)
    if (rf != NULL) {
        if (!wide)
            PCI8_RES_LOOP(a[i] + zb32, rf[i]);
        else
            PCI8_RES_LOOP((int64_t)a[i] + zb64, rf[i]);
    } else {
        if (!wide)
            PCI8_RES_LOOP(a[i] + zb32, (float)((int)rq[i] - rz) * rs);
        else
            PCI8_RES_LOOP((int64_t)a[i] + zb64, (float)((int)rq[i] - rz) * rs);
    }
#undef PCI8_RES_LOOP
}

/* ------------------------------------------------ conv micro-kernels
 * acc[8][32] = raw sums over the Kg groups for 8 output channels and 32 grid pixels:
 * xg is the grid at the tile's first pixel, off[g] the pixel offset of group g, w (w16) the
 * panel at the first of the 8 channels (64 bytes, 64 int16, per group). */

static inline void pci8_px_portable(const uint8_t *restrict xg, const int *restrict off, int Kg,
                                    const int8_t *restrict w, int32_t *restrict acc)
{
    memset(acc, 0, sizeof(int32_t) * PCI8_OB * PCI8_TILE);
    for (int g = 0; g < Kg; g++) {
        const uint8_t *p = xg + (pc_idx)off[g] * 4;
        const int8_t *wg = w + (pc_idx)g * 64;
        for (int j = 0; j < PCI8_OB; j++) {
            const int w0 = wg[4 * j], w1 = wg[4 * j + 1], w2 = wg[4 * j + 2], w3 = wg[4 * j + 3];
            int32_t *a = acc + j * PCI8_TILE;
            for (int t = 0; t < PCI8_TILE; t++)
                a[t] += p[4 * t] * w0 + p[4 * t + 1] * w1 + p[4 * t + 2] * w2 + p[4 * t + 3] * w3;
        }
    }
}

#if defined(PCI8_AVX2_CODE)
/* vpmaddubsw would saturate (two 255 * 127 products exceed int16), so the bytes are widened to
 * int16 (vpmovzxbw; weights pre-widened) and multiplied in pairs into int32 by vpmaddwd: exact.
 * Each int32 lane holds one pixel's pair sum; the pairs are added when the tile is stored. */
__attribute__((noinline)) /* inlined, its 8 accumulators spill to the stack */
static void pci8_px_avx2(const uint8_t *restrict xg, const int *restrict off, int Kg,
                                const int16_t *restrict w16, int32_t *restrict acc)
{
    for (int q4 = 0; q4 < PCI8_OB / 4; q4++) {
        for (int st = 0; st < PCI8_TILE / 8; st++) {
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
                    a30 = a00, a31 = a00;
            const uint8_t *xs = xg + st * 32;
            const int16_t *ws = w16 + q4 * 16;
            for (int g = 0; g < Kg; g++) {
                const uint8_t *p = xs + (pc_idx)off[g] * 4;
                const int16_t *wg = ws + (pc_idx)g * 64;
                __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
                __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
                __m256i b = _mm256_set1_epi64x(pci8_ld64(wg));
                a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(x0, b));
                a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(x1, b));
                b = _mm256_set1_epi64x(pci8_ld64(wg + 4));
                a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(x0, b));
                a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(x1, b));
                b = _mm256_set1_epi64x(pci8_ld64(wg + 8));
                a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(x0, b));
                a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(x1, b));
                b = _mm256_set1_epi64x(pci8_ld64(wg + 12));
                a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(x0, b));
                a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(x1, b));
            }
            /* [p0 p0 p1 p1 | p2 p2 p3 p3] and the next four: hadd + lane fix -> p0..p7 */
            int32_t *d = acc + (q4 * 4) * PCI8_TILE + st * 8;
            _mm256_storeu_si256((__m256i *)d, _mm256_permute4x64_epi64(_mm256_hadd_epi32(a00, a01), 0xD8));
            _mm256_storeu_si256((__m256i *)(d + PCI8_TILE),
                                _mm256_permute4x64_epi64(_mm256_hadd_epi32(a10, a11), 0xD8));
            _mm256_storeu_si256((__m256i *)(d + 2 * PCI8_TILE),
                                _mm256_permute4x64_epi64(_mm256_hadd_epi32(a20, a21), 0xD8));
            _mm256_storeu_si256((__m256i *)(d + 3 * PCI8_TILE),
                                _mm256_permute4x64_epi64(_mm256_hadd_epi32(a30, a31), 0xD8));
        }
    }
}
#endif

#if defined(PCI8_AVXVNNI_CODE)
/* pci8_px_vnni's sums on 8-lane vectors (AVX-VNNI has 16 registers): 4 channels by 16 pixels a pass, each
 * lane one pixel's sum of its 4 (u8 x s8) products per group, exact. w: the int8 panel (pci8_px_vnni's). */
#define PCI8_AVXVNNI_STEP(j)                                                          \
    do {                                                                              \
        const __m256i b = _mm256_set1_epi32(pci8_ld32(wg + 4 * (j)));                 \
        a##j##0 = _mm256_dpbusd_avx_epi32(a##j##0, x0, b);                            \
        a##j##1 = _mm256_dpbusd_avx_epi32(a##j##1, x1, b);                            \
    } while (0)
PCI8_AVXVNNI_TARGET __attribute__((noinline))
static void pci8_px_avxvnni(const uint8_t *restrict xg, const int *restrict off, int Kg, const int8_t *restrict w,
                            int32_t *restrict acc)
{
    for (int q4 = 0; q4 < PCI8_OB / 4; q4++) {
        for (int st = 0; st < PCI8_TILE / 16; st++) {
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
                    a30 = a00, a31 = a00;
            const uint8_t *xs = xg + st * 64;
            const int8_t *ws = w + q4 * 16;
            for (int g = 0; g < Kg; g++) {
                const uint8_t *p = xs + (pc_idx)off[g] * 4;
                const int8_t *wg = ws + (pc_idx)g * 64;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)p);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(p + 32));
                PCI8_AVXVNNI_STEP(0);
                PCI8_AVXVNNI_STEP(1);
                PCI8_AVXVNNI_STEP(2);
                PCI8_AVXVNNI_STEP(3);
            }
            int32_t *d = acc + (q4 * 4) * PCI8_TILE + st * 16;
            _mm256_storeu_si256((__m256i *)d, a00);
            _mm256_storeu_si256((__m256i *)(d + 8), a01);
            _mm256_storeu_si256((__m256i *)(d + PCI8_TILE), a10);
            _mm256_storeu_si256((__m256i *)(d + PCI8_TILE + 8), a11);
            _mm256_storeu_si256((__m256i *)(d + 2 * PCI8_TILE), a20);
            _mm256_storeu_si256((__m256i *)(d + 2 * PCI8_TILE + 8), a21);
            _mm256_storeu_si256((__m256i *)(d + 3 * PCI8_TILE), a30);
            _mm256_storeu_si256((__m256i *)(d + 3 * PCI8_TILE + 8), a31);
        }
    }
}
#undef PCI8_AVXVNNI_STEP
#endif

#if defined(PCI8_VNNI_CODE)
/* vpdpbusd: 16 lanes x 4 (u8 x s8) products added into int32 exactly, one instruction. */
#define PCI8_VNNI_STEP(j)                                                             \
    do {                                                                              \
        __m512i b = _mm512_set1_epi32(pci8_ld32(wg + 4 * (j)));                       \
        a##j##0 = _mm512_dpbusd_epi32(a##j##0, x0, b);                                \
        a##j##1 = _mm512_dpbusd_epi32(a##j##1, x1, b);                                \
    } while (0)
/* Declares the 16 accumulators a00..a71 (8 channels x 32 pixels) in the caller and sums the Kg
 * groups of xg (at off[]) x w into them; a macro, not a function, so that every variant keeps
 * them in registers for its own epilogue. */
#define PCI8_VNNI_ACCUMULATE() PCI8_VNNI_ACCUMULATE_ROWS(64, 0)
/* The same with the tile's lanes taken from grid rows RS bytes apart: Q8 0, lanes 0-15 and 16-31 from
 * two rows (16-pixel outputs rows); Q8 1, four 8-pixel quarters from four rows (8-pixel output rows).
 * The tile then covers whole output rows and no padding column (PCI8_ROWS_OK). */
#define PCI8_VNNI_ACCUMULATE_ROWS(RS, Q8)                                                               \
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, \
            a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00, a70 = a00, a71 = a00; \
    for (int g = 0; g < Kg; g++) {                                                                      \
        const uint8_t *p = xg + (pc_idx)off[g] * 4;                                                     \
        const int8_t *wg = w + (pc_idx)g * 64;                                                          \
        __m512i x0, x1;                                                                                 \
        if (Q8) {                                                                                       \
            x0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),     \
                                    _mm256_loadu_si256((const __m256i *)(p + (RS))), 1);                \
            x1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2 * (RS)))), \
                                    _mm256_loadu_si256((const __m256i *)(p + 3 * (RS))), 1);            \
        } else {                                                                                        \
            x0 = _mm512_loadu_si512((const void *)p);                                                   \
            x1 = _mm512_loadu_si512((const void *)(p + (RS)));                                          \
        }                                                                                               \
        PCI8_VNNI_STEP(0);                                                                              \
        PCI8_VNNI_STEP(1);                                                                              \
        PCI8_VNNI_STEP(2);                                                                              \
        PCI8_VNNI_STEP(3);                                                                              \
        PCI8_VNNI_STEP(4);                                                                              \
        PCI8_VNNI_STEP(5);                                                                              \
        PCI8_VNNI_STEP(6);                                                                              \
        PCI8_VNNI_STEP(7);                                                                              \
    }                                                                                                   \
    (void)0
#define PCI8_VNNI_STORE(j)                                                            \
    do {                                                                              \
        _mm512_storeu_si512((void *)(acc + (j) * PCI8_TILE), a##j##0);                \
        _mm512_storeu_si512((void *)(acc + (j) * PCI8_TILE + 16), a##j##1);           \
    } while (0)

PCI8_VNNI_TARGET
static void pci8_px_vnni(const uint8_t *restrict xg, const int *restrict off, int Kg, const int8_t *restrict w,
                         int32_t *restrict acc)
{
    PCI8_VNNI_ACCUMULATE();
    PCI8_VNNI_STORE(0);
    PCI8_VNNI_STORE(1);
    PCI8_VNNI_STORE(2);
    PCI8_VNNI_STORE(3);
    PCI8_VNNI_STORE(4);
    PCI8_VNNI_STORE(5);
    PCI8_VNNI_STORE(6);
    PCI8_VNNI_STORE(7);
}

/* One tile's runs of real output pixels, as AVX-512 masked stores: run k writes lanes set in
 * m0[k] / m1[k] (lanes 0-15 / 16-31) to y + base[k] + lane. */
typedef struct {
    int n;
    pc_idx base[PCI8_TILE];
    __mmask16 m0[PCI8_TILE], m1[PCI8_TILE];
} pci8_runs;

/* The parts of one channel's epilogue on the registers: its two vectors of sums scaled ... */
#define PCI8_VNNI_SCALED(j)                                                                       \
    const __m512 sc = _mm512_set1_ps(scale[j]);                                                   \
    const __m512i zb = _mm512_set1_epi32(zb32[j]);                                                \
    __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a##j##0, zb)), sc);             \
    __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a##j##1, zb)), sc);

/* ... then the ReLU and the stores to the runs of output pixels: y (float32) and yq (the next
 * layer's input, pci8_quantize's arithmetic) where given. NAN_FREE: v cannot be NaN (no shortcut was
 * added), so yq takes pci8_q16x2_epi with the ReLU as its clamp's lower bound (vlo). */
#define PCI8_VNNI_FINISH(j, NAN_FREE)                                                             \
    __m512 u0 = v0, u1 = v1;                                                                      \
    if (relu && (y != NULL || !(NAN_FREE))) { /* max(0, v): NaN and -0 pass as v < 0 ? 0 : v */   \
        u0 = _mm512_max_ps(_mm512_setzero_ps(), v0);                                              \
        u1 = _mm512_max_ps(_mm512_setzero_ps(), v1);                                              \
    }                                                                                             \
    if (y != NULL) {                                                                              \
        float *yj = y + (j) * PQ;                                                                 \
        for (int k = 0; k < runs->n; k++) {                                                       \
            _mm512_mask_storeu_ps(yj + runs->base[k], runs->m0[k], u0);                           \
            _mm512_mask_storeu_ps(yj + runs->base[k] + 16, runs->m1[k], u1);                      \
        }                                                                                         \
    }                                                                                             \
    if (yq != NULL) {                                                                             \
        __m512i k0, k1;                                                                           \
        if (NAN_FREE)                                                                             \
            pci8_q16x2_epi(v0, v1, vr, vs, qfast, vlo, vhi, vz, &k0, &k1);                        \
        else                                                                                      \
            pci8_q16x2(u0, u1, vr, vs, qfast, vz, &k0, &k1);                                      \
        const __m128i b0 = _mm512_cvtepi32_epi8(k0);                                              \
        const __m128i b1 = _mm512_cvtepi32_epi8(k1);                                              \
        uint8_t *qj = yq + (j) * PQ;                                                              \
        for (int k = 0; k < runs->n; k++) {                                                       \
            _mm_mask_storeu_epi8(qj + runs->base[k], runs->m0[k], b0);                            \
            _mm_mask_storeu_epi8(qj + runs->base[k] + 16, runs->m1[k], b1);                       \
        }                                                                                         \
    }

#define PCI8_VNNI_EPI(j)                                                                          \
    do {                                                                                          \
        if ((j) < oe) {                                                                           \
            PCI8_VNNI_SCALED(j)                                                                   \
            PCI8_VNNI_FINISH(j, 1)                                                                \
        }                                                                                         \
    } while (0)

/* pci8_px_vnni with the epilogue on the registers (sums that fit int32 only): oe of the 8
 * channels are real; y points at the first one's output plane (PQ floats per channel), or is
 * NULL; yq (or NULL) likewise receives the values quantized with (qs, qz) for the next layer. */
#define PCI8_DEF_VNNI_EPI(NAME, RS, Q8)                                                                     \
    PCI8_VNNI_TARGET                                                                                        \
    static void NAME(const uint8_t *restrict xg, const int *restrict off, int Kg, const int8_t *restrict w,   \
                     int oe, const int32_t *restrict zb32, const float *restrict scale, int relu,              \
                     const pci8_runs *restrict runs, float *y, pc_idx PQ, uint8_t *yq, float qs, int qz,       \
                     pc_idx rs)                                                                             \
    {                                                                                                       \
        const int qfast = qs > 1e-37f && qs < 1e37f;                                                        \
        const __m512 vr = _mm512_set1_ps(1.0f / qs), vs = _mm512_set1_ps(qs);                              \
        const __m512i vz = _mm512_set1_epi32(qz);                                                          \
        const __m512 vlo = _mm512_set1_ps(relu ? 0.0f : (float)-qz), vhi = _mm512_set1_ps((float)(255 - qz));  \
        (void)rs;                                                                                           \
        PCI8_VNNI_ACCUMULATE_ROWS(RS, Q8);                                                                  \
        PCI8_VNNI_EPI(0);                                                                                   \
        PCI8_VNNI_EPI(1);                                                                                   \
        PCI8_VNNI_EPI(2);                                                                                   \
        PCI8_VNNI_EPI(3);                                                                                   \
        PCI8_VNNI_EPI(4);                                                                                   \
        PCI8_VNNI_EPI(5);                                                                                   \
        PCI8_VNNI_EPI(6);                                                                                   \
        PCI8_VNNI_EPI(7);                                                                                   \
    }
PCI8_DEF_VNNI_EPI(pci8_px_vnni_epi, 64, 0)
PCI8_DEF_VNNI_EPI(pci8_px_vnni_epi_rows, rs, 0)
PCI8_DEF_VNNI_EPI(pci8_px_vnni_epi_rows8, rs, 1)

/* PCI8_VNNI_EPI with the residual block's shortcut added before the ReLU (pci8_epi_run_res's arithmetic):
 * the shortcut's lanes come from the same runs of output pixels as the stores go to. */
#define PCI8_VNNI_EPI_RES(j)                                                                      \
    do {                                                                                          \
        if ((j) < oe) {                                                                           \
            PCI8_VNNI_SCALED(j)                                                                   \
            __m512 r0 = _mm512_setzero_ps(), r1 = r0;                                             \
            if (rf != NULL) {                                                                     \
                const float *rj = rf + (j) * PQ;                                                  \
                for (int k = 0; k < runs->n; k++) {                                               \
                    r0 = _mm512_mask_loadu_ps(r0, runs->m0[k], rj + runs->base[k]);               \
                    r1 = _mm512_mask_loadu_ps(r1, runs->m1[k], rj + runs->base[k] + 16);          \
                }                                                                                 \
            } else { /* all 32 lanes' bytes of a run in one masked load */                        \
                const uint8_t *rj = rq + (j) * PQ;                                                \
                __m256i b = _mm256_setzero_si256();                                               \
                for (int k = 0; k < runs->n; k++)                                                 \
                    b = _mm256_mask_loadu_epi8(b, m32[k], rj + runs->base[k]);                    \
                r0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(                           \
                         _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)), vrz)), vrs);            \
                r1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(                           \
                         _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)), vrz)), vrs);       \
            }                                                                                     \
            v0 = _mm512_add_ps(v0, r0);                                                           \
            v1 = _mm512_add_ps(v1, r1);                                                           \
            PCI8_VNNI_FINISH(j, 0)                                                                \
        }                                                                                         \
    } while (0)

/* pci8_px_vnni_epi for the last convolution of a residual block: the shortcut, rf (float32) or rq (uint8
 * with scale rs and zero point rz), at the first channel's plane as y, is added before the ReLU. */
#define PCI8_DEF_VNNI_EPI_RES(NAME, RS, Q8)                                                                 \
    PCI8_VNNI_TARGET                                                                                        \
    static void NAME(const uint8_t *restrict xg, const int *restrict off, int Kg, const int8_t *restrict w,   \
                     int oe, const int32_t *restrict zb32, const float *restrict scale, int relu,              \
                     const pci8_runs *restrict runs, float *y, pc_idx PQ, uint8_t *yq, float qs, int qz,       \
                     const float *rf, const uint8_t *rq, float rs, int rz, pc_idx rstride)                  \
    {                                                                                                       \
        const int qfast = qs > 1e-37f && qs < 1e37f;                                                        \
        const __m512 vr = _mm512_set1_ps(1.0f / qs), vs = _mm512_set1_ps(qs), vrs = _mm512_set1_ps(rs);    \
        const __m512i vz = _mm512_set1_epi32(qz), vrz = _mm512_set1_epi32(rz);                             \
        const __m512 vlo = _mm512_setzero_ps(), vhi = vlo; /* PCI8_VNNI_FINISH's NaN-free branch: unused */ \
        __mmask32 m32[PCI8_TILE];                                                                           \
        (void)rstride;                                                                                      \
        for (int k = 0; k < runs->n; k++) m32[k] = (__mmask32)runs->m0[k] | (__mmask32)runs->m1[k] << 16;  \
        PCI8_VNNI_ACCUMULATE_ROWS(RS, Q8);                                                                  \
        PCI8_VNNI_EPI_RES(0);                                                                               \
        PCI8_VNNI_EPI_RES(1);                                                                               \
        PCI8_VNNI_EPI_RES(2);                                                                               \
        PCI8_VNNI_EPI_RES(3);                                                                               \
        PCI8_VNNI_EPI_RES(4);                                                                               \
        PCI8_VNNI_EPI_RES(5);                                                                               \
        PCI8_VNNI_EPI_RES(6);                                                                               \
        PCI8_VNNI_EPI_RES(7);                                                                               \
    }
PCI8_DEF_VNNI_EPI_RES(pci8_px_vnni_epi_res, 64, 0)
PCI8_DEF_VNNI_EPI_RES(pci8_px_vnni_epi_res_rows, rstride, 0)
PCI8_DEF_VNNI_EPI_RES(pci8_px_vnni_epi_res_rows8, rstride, 1)
#endif

#if defined(PCI8_VNNI_CODE)
/* pci8_px_vnni_epi / pci8_px_vnni_epi_res for a tile whose lanes 16-31 all lie past the last output pixel
 * (the last tile of a small map: 8x8 outputs fill 2.4 tiles): half the multiply-adds, the same epilogue on
 * lanes 0-15 (runs->m1 are all zero). rf and rq NULL: no shortcut. */
#define PCI8_VNNI_STEP_HALF(j)                                                        \
    do {                                                                              \
        __m512i b = _mm512_set1_epi32(pci8_ld32(wg + 4 * (j)));                       \
        a##j = _mm512_dpbusd_epi32(a##j, x0, b);                                      \
    } while (0)
#define PCI8_VNNI_EPI_HALF(j)                                                                     \
    do {                                                                                          \
        if ((j) < oe) {                                                                           \
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a##j, _mm512_set1_epi32(zb32[j]))), \
                                     _mm512_set1_ps(scale[j]));                                   \
            if (rf != NULL) {                                                                     \
                __m512 r = _mm512_setzero_ps();                                                   \
                for (int k = 0; k < runs->n; k++)                                                 \
                    r = _mm512_mask_loadu_ps(r, runs->m0[k], rf + (j) * PQ + runs->base[k]);      \
                v = _mm512_add_ps(v, r);                                                          \
            } else if (rq != NULL) {                                                              \
                __m128i b = _mm_setzero_si128();                                                  \
                for (int k = 0; k < runs->n; k++)                                                 \
                    b = _mm_mask_loadu_epi8(b, runs->m0[k], rq + (j) * PQ + runs->base[k]);       \
                v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(                            \
                                         _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), vrz)), vrs));  \
            }                                                                                     \
            if (relu) v = _mm512_max_ps(_mm512_setzero_ps(), v);                                  \
            if (y != NULL)                                                                        \
                for (int k = 0; k < runs->n; k++)                                                 \
                    _mm512_mask_storeu_ps(y + (j) * PQ + runs->base[k], runs->m0[k], v);          \
            if (yq != NULL) {                                                                     \
                const __m128i q = _mm512_cvtepi32_epi8(pci8_q16(v, vr, vs, qfast, vz));           \
                for (int k = 0; k < runs->n; k++)                                                 \
                    _mm_mask_storeu_epi8(yq + (j) * PQ + runs->base[k], runs->m0[k], q);          \
            }                                                                                     \
        }                                                                                         \
    } while (0)

PCI8_VNNI_TARGET
static void pci8_px_vnni_epi_half(const uint8_t *restrict xg, const int *restrict off, int Kg,
                                  const int8_t *restrict w, int oe, const int32_t *restrict zb32,
                                  const float *restrict scale, int relu, const pci8_runs *restrict runs, float *y,
                                  pc_idx PQ, uint8_t *yq, float qs, int qz, const float *rf, const uint8_t *rq,
                                  float rs, int rz)
{
    const int qfast = qs > 1e-37f && qs < 1e37f;
    const __m512 vr = _mm512_set1_ps(1.0f / qs), vs = _mm512_set1_ps(qs), vrs = _mm512_set1_ps(rs);
    const __m512i vz = _mm512_set1_epi32(qz), vrz = _mm512_set1_epi32(rz);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int g = 0; g < Kg; g++) {
        const int8_t *wg = w + (pc_idx)g * 64;
        __m512i x0 = _mm512_loadu_si512((const void *)(xg + (pc_idx)off[g] * 4));
        PCI8_VNNI_STEP_HALF(0);
        PCI8_VNNI_STEP_HALF(1);
        PCI8_VNNI_STEP_HALF(2);
        PCI8_VNNI_STEP_HALF(3);
        PCI8_VNNI_STEP_HALF(4);
        PCI8_VNNI_STEP_HALF(5);
        PCI8_VNNI_STEP_HALF(6);
        PCI8_VNNI_STEP_HALF(7);
    }
    PCI8_VNNI_EPI_HALF(0);
    PCI8_VNNI_EPI_HALF(1);
    PCI8_VNNI_EPI_HALF(2);
    PCI8_VNNI_EPI_HALF(3);
    PCI8_VNNI_EPI_HALF(4);
    PCI8_VNNI_EPI_HALF(5);
    PCI8_VNNI_EPI_HALF(6);
    PCI8_VNNI_EPI_HALF(7);
}
#endif

/* Tiles of grid pixels [s0, s1) of one image (multiples of PCI8_TILE but s1 may pass s_end):
 * every output channel, then the epilogue into y (O, P, Q). acc: scratch [8][32].
 * pci8_conv_tiles_quantize(path, wide) says when the tiles also store yq (O, P, Q), the values
 * quantized with (qs, qz) for the next layer, themselves; y may then be NULL. */
static inline int pci8_conv_tiles_quantize(int path, int wide)
{
#if defined(PCI8_VNNI_CODE)
    return path == PCI8_VNNI && !wide;
#else
    (void)path; (void)wide;
    return 0;
#endif
}

/* The tiles with a residual block's shortcut added before the ReLU (pci8_epi_run_res): rf, float32
 * (O, P, Q), or rq, uint8 (O, P, Q) with scale rs and zero point rz, or both NULL for none. */
static inline void pci8_conv_tiles_res(int path, const uint8_t *restrict grid, const int *restrict off, int Kg,
                                       const int8_t *restrict w8, const int16_t *restrict w16, int O, int P, int Q,
                                       int Wg, pc_idx s0, pc_idx s1, const int32_t *restrict zb32,
                                       const int64_t *restrict zb64, int wide, const float *restrict scale, int relu,
                                       float *restrict y, int32_t *restrict acc, uint8_t *restrict yq, float qs,
                                       int qz, const float *restrict rf, const uint8_t *restrict rq, float rs, int rz)
{
    const int res = rf != NULL || rq != NULL;
    (void)yq; (void)qs; (void)qz;
    pc_idx s_end = (pc_idx)(P - 1) * Wg + Q, PQ = (pc_idx)P * Q;
    int seg_lane[PCI8_TILE], seg_len[PCI8_TILE];
    pc_idx seg_dst[PCI8_TILE];
    (void)w16;
#if defined(PCI8_VNNI_CODE)
    /* Output rows of 32, 16 or 8 pixels: a tile takes whole rows from the grid (1, 2 or 4, Wg * 4 bytes apart),
     * so no lane is spent on a padding column (an 8x8 map with padding 1: 64 lanes instead of 80). Without
     * padding columns (Wg == Q) the plain tiles are already dense. */
    if (path == PCI8_VNNI && !wide && s0 == 0 && s1 >= s_end && Wg != Q &&
        (Q == 32 || (Q == 16 && P % 2 == 0) || (Q == 8 && P % 4 == 0))) {
        const int rpt = PCI8_TILE / Q;
        pci8_runs runs;
        runs.n = 1;
        runs.m0[0] = runs.m1[0] = (__mmask16)0xFFFF;
        for (int p0 = 0; p0 < P; p0 += rpt) {
            const uint8_t *xt = grid + (pc_idx)p0 * Wg * 4;
            runs.base[0] = (pc_idx)p0 * Q; /* the tile's 32 lanes are outputs p0 * Q .. p0 * Q + 31 */
            if (res && p0 + rpt < P)
                for (int o = 0; o < O; o++) {
                    if (rf != NULL) {
                        __builtin_prefetch(rf + (pc_idx)o * PQ + runs.base[0] + PCI8_TILE);
                        __builtin_prefetch(rf + (pc_idx)o * PQ + runs.base[0] + PCI8_TILE + 16);
                    } else {
                        __builtin_prefetch(rq + (pc_idx)o * PQ + runs.base[0] + PCI8_TILE);
                    }
                }
            for (int o0 = 0; o0 < O; o0 += PCI8_OB) {
                const int8_t *wp = w8 + (pc_idx)(o0 / 16) * Kg * 64 + (o0 % 16) * 4;
                int oe = O - o0 < PCI8_OB ? O - o0 : PCI8_OB;
                float *yo = y != NULL ? y + (pc_idx)o0 * PQ : NULL;
                uint8_t *qo = yq != NULL ? yq + (pc_idx)o0 * PQ : NULL;
                const float *ro = rf != NULL ? rf + (pc_idx)o0 * PQ : NULL;
                const uint8_t *rqo = rq != NULL ? rq + (pc_idx)o0 * PQ : NULL;
                pc_idx rsb = Q == 32 ? 64 : (pc_idx)Wg * 4; /* the second vector: the row's next 16, or the next row */
                if (res && Q == 8)
                    pci8_px_vnni_epi_res_rows8(xt, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ, qo, qs,
                                               qz, ro, rqo, rs, rz, rsb);
                else if (res)
                    pci8_px_vnni_epi_res_rows(xt, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ, qo, qs,
                                              qz, ro, rqo, rs, rz, rsb);
                else if (Q == 8)
                    pci8_px_vnni_epi_rows8(xt, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ, qo, qs, qz,
                                           rsb);
                else
                    pci8_px_vnni_epi_rows(xt, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ, qo, qs, qz,
                                          rsb);
            }
        }
        return;
    }
#endif
    for (pc_idx s = s0; s < s1 && s < s_end; s += PCI8_TILE) {
        if (res) {
            /* the next tile's shortcut, one stream per channel plane (too many for the hardware prefetchers):
             * written a layer or two ago, it comes from L3 */
            pc_idx sn = s + PCI8_TILE, pn = sn / Wg, qn = sn - pn * Wg;
            pc_idx at = pn * Q + (qn < Q ? qn : Q - 1);
            if (pn < P) {
                for (int o = 0; o < O; o++) {
                    if (rf != NULL) {
                        __builtin_prefetch(rf + (pc_idx)o * PQ + at);
                        __builtin_prefetch(rf + (pc_idx)o * PQ + at + 16);
                        __builtin_prefetch(rf + (pc_idx)o * PQ + at + 31);
                    } else {
                        __builtin_prefetch(rq + (pc_idx)o * PQ + at);
                    }
                }
            }
        }
        /* the tile's runs of real output pixels: one per output row it crosses */
        int ns = 0;
        for (int lane = 0; lane < PCI8_TILE && s + lane < s_end;) {
            pc_idx si = s + lane;
            int p = (int)(si / Wg), q = (int)(si - (pc_idx)p * Wg);
            if (q >= Q) {
                lane += Wg - q;
                continue;
            }
            int len = Q - q < PCI8_TILE - lane ? Q - q : PCI8_TILE - lane;
            seg_lane[ns] = lane;
            seg_len[ns] = len;
            seg_dst[ns] = (pc_idx)p * Q + q;
            ns++;
            lane += len;
        }
#if defined(PCI8_VNNI_CODE)
        if (path == PCI8_VNNI && !wide) {
            pci8_runs runs;
            runs.n = ns;
            for (int k = 0; k < ns; k++) {
                uint32_t bits = (seg_len[k] >= 32 ? 0xFFFFFFFFu : ((1u << seg_len[k]) - 1u)) << seg_lane[k];
                runs.base[k] = seg_dst[k] - seg_lane[k];
                runs.m0[k] = (__mmask16)(bits & 0xFFFFu);
                runs.m1[k] = (__mmask16)(bits >> 16);
            }
            const int half = s + PCI8_TILE / 2 >= s_end;
            for (int o0 = 0; o0 < O; o0 += PCI8_OB) {
                const int8_t *wp = w8 + (pc_idx)(o0 / 16) * Kg * 64 + (o0 % 16) * 4;
                int oe = O - o0 < PCI8_OB ? O - o0 : PCI8_OB;
                float *yo = y != NULL ? y + (pc_idx)o0 * PQ : NULL;
                uint8_t *qo = yq != NULL ? yq + (pc_idx)o0 * PQ : NULL;
                if (half)
                    pci8_px_vnni_epi_half(grid + s * 4, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ,
                                          qo, qs, qz, rf != NULL ? rf + (pc_idx)o0 * PQ : NULL,
                                          rq != NULL ? rq + (pc_idx)o0 * PQ : NULL, rs, rz);
                else if (res)
                    pci8_px_vnni_epi_res(grid + s * 4, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ,
                                         qo, qs, qz, rf != NULL ? rf + (pc_idx)o0 * PQ : NULL,
                                         rq != NULL ? rq + (pc_idx)o0 * PQ : NULL, rs, rz, 64);
                else
                    pci8_px_vnni_epi(grid + s * 4, off, Kg, wp, oe, zb32 + o0, scale + o0, relu, &runs, yo, PQ, qo,
                                     qs, qz, 64);
            }
            continue;
        }
#endif
        for (int o0 = 0; o0 < O; o0 += PCI8_OB) {
            pc_idx pw = (pc_idx)(o0 / 16) * Kg * 64 + (o0 % 16) * 4;
#if defined(PCI8_VNNI_CODE)
            if (path == PCI8_VNNI) pci8_px_vnni(grid + s * 4, off, Kg, w8 + pw, acc);
            else
#endif
#if defined(PCI8_AVXVNNI_CODE)
            if (path == PCI8_AVXVNNI) pci8_px_avxvnni(grid + s * 4, off, Kg, w8 + pw, acc);
            else
#endif
#if defined(PCI8_AVX2_CODE)
            if (path == PCI8_AVX2) pci8_px_avx2(grid + s * 4, off, Kg, w16 + pw, acc);
            else
#endif
                pci8_px_portable(grid + s * 4, off, Kg, w8 + pw, acc);
            int oe = O - o0 < PCI8_OB ? O - o0 : PCI8_OB;
            for (int j = 0; j < oe; j++) {
                int o = o0 + j;
                for (int k = 0; k < ns; k++) {
                    pc_idx at = (pc_idx)o * PQ + seg_dst[k];
                    if (res)
                        pci8_epi_run_res(acc + j * PCI8_TILE + seg_lane[k], seg_len[k], zb32[o], zb64[o], wide,
                                         scale[o], relu, rf != NULL ? rf + at : NULL, rq != NULL ? rq + at : NULL, rs,
                                         rz, y + at);
                    else
                        pci8_epi_run(acc + j * PCI8_TILE + seg_lane[k], seg_len[k], zb32[o], zb64[o], wide, scale[o],
                                     relu, y + at);
                }
            }
        }
    }
}

/* pci8_conv_tiles_res without a shortcut. */
static inline void pci8_conv_tiles(int path, const uint8_t *restrict grid, const int *restrict off, int Kg,
                                   const int8_t *restrict w8, const int16_t *restrict w16, int O, int P, int Q,
                                   int Wg, pc_idx s0, pc_idx s1, const int32_t *restrict zb32,
                                   const int64_t *restrict zb64, int wide, const float *restrict scale, int relu,
                                   float *restrict y, int32_t *restrict acc, uint8_t *restrict yq, float qs, int qz)
{
    pci8_conv_tiles_res(path, grid, off, Kg, w8, w16, O, P, Q, Wg, s0, s1, zb32, zb64, wide, scale, relu, y, acc, yq,
                        qs, qz, NULL, NULL, 1.0f, 0);
}

/* ---------------------------------------------- linear micro-kernels
 * acc[4][64] = raw sums for 4 rows of x (row pointers, 4-byte groups) and 64 output channels:
 * w (w16) at the first of four panels, each panel Kg * 64 bytes (int16: elements) apart. */

static inline void pci8_cl_portable(const uint8_t *const *restrict xr, int Kg, const int8_t *restrict w,
                                    int32_t *restrict acc)
{
    memset(acc, 0, sizeof(int32_t) * PCI8_RB * PCI8_CB);
    for (int r = 0; r < PCI8_RB; r++) {
        int32_t *a = acc + r * PCI8_CB;
        for (int g = 0; g < Kg; g++) {
            const int x0 = xr[r][4 * g], x1 = xr[r][4 * g + 1], x2 = xr[r][4 * g + 2], x3 = xr[r][4 * g + 3];
            for (int k = 0; k < 4; k++) {
                const int8_t *wg = w + ((pc_idx)k * Kg + g) * 64;
                int32_t *ak = a + k * 16;
                for (int c = 0; c < 16; c++)
                    ak[c] += x0 * wg[4 * c] + x1 * wg[4 * c + 1] + x2 * wg[4 * c + 2] + x3 * wg[4 * c + 3];
            }
        }
    }
}

#if defined(PCI8_AVX2_CODE)
/* int16 widening as in pci8_px_avx2 (exact); a ymm holds 4 channels x 2 pair sums. */
__attribute__((noinline))
static void pci8_cl_avx2(const uint8_t *const *restrict xr, int Kg, const int16_t *restrict w16,
                                int32_t *restrict acc)
{
    for (int r = 0; r < PCI8_RB; r += 2) {
        const uint8_t *xa = xr[r], *xb = xr[r + 1];
        for (int k = 0; k < 4; k++) {
            const int16_t *wk = w16 + (pc_idx)k * Kg * 64;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int g = 0; g < Kg; g++) {
                const int16_t *wg = wk + (pc_idx)g * 64;
                __m256i va = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(pci8_ld32(xa + 4 * g))));
                __m256i vb = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(pci8_ld32(xb + 4 * g))));
                __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 16));
                __m256i w2 = _mm256_loadu_si256((const __m256i *)(wg + 32));
                __m256i w3 = _mm256_loadu_si256((const __m256i *)(wg + 48));
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, va));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, va));
                a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(w2, va));
                a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(w3, va));
                b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(w0, vb));
                b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(w1, vb));
                b2 = _mm256_add_epi32(b2, _mm256_madd_epi16(w2, vb));
                b3 = _mm256_add_epi32(b3, _mm256_madd_epi16(w3, vb));
            }
            int32_t *da = acc + r * PCI8_CB + k * 16, *db = da + PCI8_CB;
            _mm256_storeu_si256((__m256i *)da, _mm256_permute4x64_epi64(_mm256_hadd_epi32(a0, a1), 0xD8));
            _mm256_storeu_si256((__m256i *)(da + 8), _mm256_permute4x64_epi64(_mm256_hadd_epi32(a2, a3), 0xD8));
            _mm256_storeu_si256((__m256i *)db, _mm256_permute4x64_epi64(_mm256_hadd_epi32(b0, b1), 0xD8));
            _mm256_storeu_si256((__m256i *)(db + 8), _mm256_permute4x64_epi64(_mm256_hadd_epi32(b2, b3), 0xD8));
        }
    }
}
#endif

#if defined(PCI8_VNNI_CODE)
/* Declares w0..w3, group g's 4 bytes for each of 64 output channels (4 blocks of 16, ps apart):
 * what PCI8_CL_ROW multiplies every row by. */
#define PCI8_CL_LOAD_W()                                                              \
    const int8_t *wg = w + (pc_idx)g * 64;                                            \
    __m512i w0 = _mm512_loadu_si512((const void *)wg);                                \
    __m512i w1 = _mm512_loadu_si512((const void *)(wg + ps));                         \
    __m512i w2 = _mm512_loadu_si512((const void *)(wg + 2 * ps));                     \
    __m512i w3 = _mm512_loadu_si512((const void *)(wg + 3 * ps))
#define PCI8_CL_ROW(r)                                                                \
    do {                                                                              \
        __m512i v = _mm512_set1_epi32(pci8_ld32(x##r + 4 * (pc_idx)g));               \
        a##r##0 = _mm512_dpbusd_epi32(a##r##0, v, w0);                                \
        a##r##1 = _mm512_dpbusd_epi32(a##r##1, v, w1);                                \
        a##r##2 = _mm512_dpbusd_epi32(a##r##2, v, w2);                                \
        a##r##3 = _mm512_dpbusd_epi32(a##r##3, v, w3);                                \
    } while (0)
#define PCI8_CL_STORE(r)                                                              \
    do {                                                                              \
        _mm512_storeu_si512((void *)(acc + (r) * PCI8_CB), a##r##0);                  \
        _mm512_storeu_si512((void *)(acc + (r) * PCI8_CB + 16), a##r##1);             \
        _mm512_storeu_si512((void *)(acc + (r) * PCI8_CB + 32), a##r##2);             \
        _mm512_storeu_si512((void *)(acc + (r) * PCI8_CB + 48), a##r##3);             \
    } while (0)

PCI8_VNNI_TARGET
static void pci8_cl_vnni(const uint8_t *const *restrict xr, int Kg, const int8_t *restrict w,
                         int32_t *restrict acc)
{
    const uint8_t *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
    const pc_idx ps = (pc_idx)Kg * 64;
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int g = 0; g < Kg; g++) {
        PCI8_CL_LOAD_W();
        PCI8_CL_ROW(0);
        PCI8_CL_ROW(1);
        PCI8_CL_ROW(2);
        PCI8_CL_ROW(3);
    }
    PCI8_CL_STORE(0);
    PCI8_CL_STORE(1);
    PCI8_CL_STORE(2);
    PCI8_CL_STORE(3);
}
#endif

#if defined(PCI8_VNNI_CODE)
/* pci8_cl_vnni for one row (acc[0][64]): a short last block and batch 1 do not pay for four. */
PCI8_VNNI_TARGET
static void pci8_cl_vnni1(const uint8_t *restrict x0, int Kg, const int8_t *restrict w, int32_t *restrict acc)
{
    const pc_idx ps = (pc_idx)Kg * 64;
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00;
    for (int g = 0; g < Kg; g++) {
        PCI8_CL_LOAD_W();
        PCI8_CL_ROW(0);
    }
    PCI8_CL_STORE(0);
}
#endif

#if defined(PCI8_AVXVNNI_CODE)
/* pci8_cl_vnni's sums on 8-lane vectors: two rows by 32 output channels a pass (w: the int8 panels, blocks
 * of 16 channels ps apart, as pci8_cl_vnni reads them). */
PCI8_AVXVNNI_TARGET __attribute__((noinline))
static void pci8_cl_avxvnni(const uint8_t *const *restrict xr, int Kg, const int8_t *restrict w,
                            int32_t *restrict acc)
{
    const pc_idx ps = (pc_idx)Kg * 64;
    for (int r = 0; r < PCI8_RB; r += 2) {
        const uint8_t *xa = xr[r], *xb = xr[r + 1];
        for (int h = 0; h < 2; h++) {
            const int8_t *wk = w + (pc_idx)(2 * h) * ps;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int g = 0; g < Kg; g++) {
                const int8_t *wg = wk + (pc_idx)g * 64;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));
                const __m256i w2 = _mm256_loadu_si256((const __m256i *)(wg + ps));
                const __m256i w3 = _mm256_loadu_si256((const __m256i *)(wg + ps + 32));
                const __m256i va = _mm256_set1_epi32(pci8_ld32(xa + 4 * (pc_idx)g));
                const __m256i vb = _mm256_set1_epi32(pci8_ld32(xb + 4 * (pc_idx)g));
                a0 = _mm256_dpbusd_avx_epi32(a0, va, w0);
                a1 = _mm256_dpbusd_avx_epi32(a1, va, w1);
                a2 = _mm256_dpbusd_avx_epi32(a2, va, w2);
                a3 = _mm256_dpbusd_avx_epi32(a3, va, w3);
                b0 = _mm256_dpbusd_avx_epi32(b0, vb, w0);
                b1 = _mm256_dpbusd_avx_epi32(b1, vb, w1);
                b2 = _mm256_dpbusd_avx_epi32(b2, vb, w2);
                b3 = _mm256_dpbusd_avx_epi32(b3, vb, w3);
            }
            int32_t *da = acc + r * PCI8_CB + h * 32, *db = da + PCI8_CB;
            _mm256_storeu_si256((__m256i *)da, a0);
            _mm256_storeu_si256((__m256i *)(da + 8), a1);
            _mm256_storeu_si256((__m256i *)(da + 16), a2);
            _mm256_storeu_si256((__m256i *)(da + 24), a3);
            _mm256_storeu_si256((__m256i *)db, b0);
            _mm256_storeu_si256((__m256i *)(db + 8), b1);
            _mm256_storeu_si256((__m256i *)(db + 16), b2);
            _mm256_storeu_si256((__m256i *)(db + 24), b3);
        }
    }
}

/* pci8_cl_avxvnni for one row (acc[0][64]): batch 1 and a short last block do not pay for four rows. */
PCI8_AVXVNNI_TARGET __attribute__((noinline))
static void pci8_cl_avxvnni1(const uint8_t *restrict x0, int Kg, const int8_t *restrict w, int32_t *restrict acc)
{
    const pc_idx ps = (pc_idx)Kg * 64;
    __m256i a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_si256();
    for (int g = 0; g < Kg; g++) {
        const __m256i v = _mm256_set1_epi32(pci8_ld32(x0 + 4 * (pc_idx)g));
        const int8_t *wg = w + (pc_idx)g * 64;
        for (int k = 0; k < 8; k++) /* channels 8k..8k+7: block k / 2, its half k % 2 */
            a[k] = _mm256_dpbusd_avx_epi32(
                a[k], v, _mm256_loadu_si256((const __m256i *)(wg + (pc_idx)(k / 2) * ps + (k % 2) * 32)));
    }
    for (int k = 0; k < 8; k++) _mm256_storeu_si256((__m256i *)(acc + 8 * k), a[k]);
}
#endif

/* Rows [r0, r1) of x (ldx bytes apart, groups of 4 valid up to Kg) times output channels
 * [c0, c1) (c0 a multiple of 64), epilogue into y (N, G). acc: scratch [4][64]. */
static inline void pci8_linear_block(int path, const uint8_t *restrict x, pc_idx ldx, pc_idx r0, pc_idx r1, int Kg,
                                     const int8_t *restrict w8, const int16_t *restrict w16, int c0, int c1, int G,
                                     const int32_t *restrict zb32, const int64_t *restrict zb64, int wide,
                                     const float *restrict scale, int relu, float *restrict y,
                                     int32_t *restrict acc)
{
    (void)w16;
    for (int c = c0; c < c1; c += PCI8_CB) {
        pc_idx pw = (pc_idx)(c / 16) * Kg * 64;
        int ce = c1 - c < PCI8_CB ? c1 - c : PCI8_CB;
        for (pc_idx r = r0; r < r1; r += PCI8_RB) {
            const uint8_t *xr[PCI8_RB];
            int rn = r1 - r < PCI8_RB ? (int)(r1 - r) : PCI8_RB;
            /* a short last block repeats its last row; those results are dropped */
            for (int i = 0; i < PCI8_RB; i++) xr[i] = x + (r + (i < rn ? i : rn - 1)) * ldx;
#if defined(PCI8_AVXVNNI_CODE)
            if (path == PCI8_AVXVNNI && rn < PCI8_RB) {
                for (int i = 0; i < rn; i++) {
                    pci8_cl_avxvnni1(xr[i], Kg, w8 + pw, acc);
                    pci8_epi_row(acc, ce, zb32 + c, zb64 + c, wide, scale + c, relu, y + (r + i) * (pc_idx)G + c);
                }
                continue;
            }
#endif
#if defined(PCI8_VNNI_CODE)
            if (path == PCI8_VNNI && rn < PCI8_RB) {
                for (int i = 0; i < rn; i++) {
                    pci8_cl_vnni1(xr[i], Kg, w8 + pw, acc);
                    pci8_epi_row(acc, ce, zb32 + c, zb64 + c, wide, scale + c, relu, y + (r + i) * (pc_idx)G + c);
                }
                continue;
            }
            if (path == PCI8_VNNI) pci8_cl_vnni(xr, Kg, w8 + pw, acc);
            else
#endif
#if defined(PCI8_AVXVNNI_CODE)
            if (path == PCI8_AVXVNNI) pci8_cl_avxvnni(xr, Kg, w8 + pw, acc);
            else
#endif
#if defined(PCI8_AVX2_CODE)
            if (path == PCI8_AVX2) pci8_cl_avx2(xr, Kg, w16 + pw, acc);
            else
#endif
                pci8_cl_portable(xr, Kg, w8 + pw, acc);
            for (int i = 0; i < rn; i++)
                pci8_epi_row(acc + i * PCI8_CB, ce, zb32 + c, zb64 + c, wide, scale + c, relu,
                             y + (r + i) * (pc_idx)G + c);
        }
    }
}

/* ------------------------------------------------------------- depthwise */

#define PCI8_DW_SLACK 96      /* zeroed elements after the grid: the 64-wide blocks read past it */
#define PCI8_DW_MAXPAIRS 64   /* tap pairs the AVX-512 depthwise takes (larger kernels: the loop) */

/* Scratch of one depthwise plane in int16 elements (the grid, its tap pairs, the int32 sums). */
static inline pc_idx pci8_dw_scratch(int H, int W, int KH, int KW, int SH, int SW, int PH, int PW, int P)
{
    int ah = SH < KH ? SH : KH, aw = SW < KW ? SW : KW;
    pc_idx Hg = (H + 2 * PH + SH - 1) / SH, Wg = (W + 2 * PW + SW - 1) / SW;
    pc_idx grid = ((pc_idx)ah * aw * Hg * Wg + PCI8_DW_SLACK + 1) / 2 * 2;
    return grid + 2 * grid + 2 * ((pc_idx)P * Wg + 64) + 16;
}

/* The AVX-512 depthwise's tap pairs for one channel's filter w (KH, KW): off[k], the pair's offset in the
 * plane's grid (the same for every channel), and wp[k], its two int16 weights; returns their count, or
 * -1 where the plain loop runs (other levels, large kernels). Once per channel and call, not per plane. */
static inline int pci8_dw_pairs(const int8_t *restrict w, int H, int W, int KH, int KW, int SH, int SW, int PH,
                                int PW, pc_idx *restrict off, int32_t *restrict wp)
{
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (KW <= 64 && KH * (KW / 2 + SW + 1) <= PCI8_DW_MAXPAIRS) {
        int aw = SW < KW ? SW : KW;
        pc_idx Hg = (H + 2 * PH + SH - 1) / SH, Wg = (W + 2 * PW + SW - 1) / SW, plane = Hg * Wg;
        int np = 0;
        for (int kh = 0; kh < KH; kh++) {
            uint64_t used = 0;
            for (int kw = 0; kw < KW; kw++) {
                if (used >> kw & 1) continue;
                int w2 = 0;
                if (kw + SW < KW) {
                    w2 = w[kh * KW + kw + SW];
                    used |= (uint64_t)1 << (kw + SW);
                }
                off[np] = ((pc_idx)(kh % SH) * aw + kw % SW) * plane + (pc_idx)(kh / SH) * Wg + kw / SW;
                wp[np] = (int32_t)((uint32_t)(uint16_t)(int16_t)w[kh * KW + kw] | (uint32_t)(uint16_t)(int16_t)w2 << 16);
                np++;
            }
        }
        return np;
    }
#endif
    (void)w; (void)H; (void)W; (void)KH; (void)KW; (void)SH; (void)SW; (void)PH; (void)PW; (void)off; (void)wp;
    return -1;
}

/* One plane: x (H, W) uint8 with zero point z, w (KH, KW) int8, y (P, Q) overwritten.
 * The plane goes into scratch as an int16 grid of x - z (zeros for padding) split into stride
 * phases as in the convolution, so every tap is one long contiguous multiply-add over the
 * flattened output grid s = p * Wg + q (int16 x int16 -> int32, vectorised on every level);
 * columns q >= Q are dropped by the epilogue. */
static inline void pci8_dw_plane(const uint8_t *restrict x, int H, int W, int z, const int8_t *restrict w, int KH,
                                 int KW, int SH, int SW, int PH, int PW, int P, int Q, int32_t zb32, int64_t zb64,
                                 int wide, float scale, int relu, void *restrict scratch, float *restrict y,
                                 int keep_y, uint8_t *restrict yq, float qs, int qz, const pc_idx *restrict off,
                                 const int32_t *restrict wp, int np)
{
    int ah = SH < KH ? SH : KH, aw = SW < KW ? SW : KW;
    int Hg = (H + 2 * PH + SH - 1) / SH, Wg = (W + 2 * PW + SW - 1) / SW;
    pc_idx plane = (pc_idx)Hg * Wg, s_end = (pc_idx)(P - 1) * Wg + Q;
    int16_t *grid = (int16_t *)scratch;
    pc_idx gsize = ((pc_idx)ah * aw * plane + PCI8_DW_SLACK + 1) / 2 * 2;
    int32_t *pairs = (int32_t *)(grid + gsize);
    int32_t *acc = pairs + gsize;
    memset(grid, 0, sizeof(int16_t) * (size_t)gsize);
    for (int a = 0; a < ah; a++) {
        for (int b = 0; b < aw; b++) {
            /* phase (a, b) holds padded pixels (gh * SH + a, gw * SW + b) */
            int lo, hi, off = pci8_phase_cols(b, PW, SW, W, Wg, &lo, &hi);
            for (int gh = 0; gh < Hg; gh++) {
                int h = gh * SH + a - PH;
                if (h < 0 || h >= H) continue;
                const uint8_t *src = x + (pc_idx)h * W + off;
                int16_t *dst = grid + ((pc_idx)a * aw + b) * plane + (pc_idx)gh * Wg;
                if (SW == 1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
                    /* 32 pixels per masked load (rows of small planes are shorter than one vector) */
                    for (int gw = lo; gw < hi; gw += 32) {
                        const __mmask32 m = hi - gw >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (hi - gw)) - 1u);
                        const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, src + gw));
                        _mm512_mask_storeu_epi16(dst + gw, m, _mm512_sub_epi16(v, _mm512_set1_epi16((short)z)));
                    }
#else
                    PC_SIMD
                    for (int gw = lo; gw < hi; gw++) dst[gw] = (int16_t)(src[gw] - z);
#endif
                }
#if defined(__AVX512F__) && defined(__AVX512BW__)
                else if (SW == 2) {
                    /* 16 pixels from 31 bytes: widen to int16, keep the even ones (vpmovdw of each dword) */
                    for (int gw = lo; gw < hi; gw += 16) {
                        const int cnt = hi - gw < 16 ? hi - gw : 16;
                        const __mmask32 mb = (__mmask32)(0xFFFFFFFFu >> (33 - 2 * cnt));
                        const __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mb, src + (pc_idx)gw * 2));
                        const __m256i e = _mm512_cvtepi32_epi16(v); /* the low int16 of each pair */
                        _mm256_mask_storeu_epi16(dst + gw, (__mmask16)(0xFFFFu >> (16 - cnt)),
                                                 _mm256_sub_epi16(e, _mm256_set1_epi16((short)z)));
                    }
                }
#endif
                else {
                    for (int gw = lo; gw < hi; gw++) dst[gw] = (int16_t)(src[(pc_idx)gw * SW] - z);
                }
            }
        }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (np >= 0) {
        /* vpmaddwd on tap pairs (pci8_dw_pairs): taps kw and kw + SW read neighbouring elements of one
         * phase, so pairs[s] = (grid[s], grid[s + 1]) times (w[kw], w[kw + SW]) sums both in one instruction */
        for (pc_idx i = 0; i + 1 < gsize; i++)
            pairs[i] = (int32_t)((uint32_t)(uint16_t)grid[i] | (uint32_t)(uint16_t)grid[i + 1] << 16);
        pairs[gsize - 1] = 0;
        for (pc_idx s0 = 0; s0 < s_end; s0 += 64) {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            for (int k = 0; k < np; k++) {
                const int32_t *pp = pairs + off[k] + s0;
                const __m512i wv = _mm512_set1_epi32(wp[k]);
                a0 = _mm512_add_epi32(a0, _mm512_madd_epi16(_mm512_loadu_si512((const void *)pp), wv));
                a1 = _mm512_add_epi32(a1, _mm512_madd_epi16(_mm512_loadu_si512((const void *)(pp + 16)), wv));
                a2 = _mm512_add_epi32(a2, _mm512_madd_epi16(_mm512_loadu_si512((const void *)(pp + 32)), wv));
                a3 = _mm512_add_epi32(a3, _mm512_madd_epi16(_mm512_loadu_si512((const void *)(pp + 48)), wv));
            }
            _mm512_storeu_si512((void *)(acc + s0), a0);
            _mm512_storeu_si512((void *)(acc + s0 + 16), a1);
            _mm512_storeu_si512((void *)(acc + s0 + 32), a2);
            _mm512_storeu_si512((void *)(acc + s0 + 48), a3);
        }
    } else
#endif
    {
        memset(acc, 0, sizeof(int32_t) * (size_t)s_end);
        for (int kh = 0; kh < KH; kh++) {
            for (int kw = 0; kw < KW; kw++) {
                const int16_t *g = grid + ((pc_idx)(kh % SH) * aw + kw % SW) * plane + (pc_idx)(kh / SH) * Wg + kw / SW;
                const int32_t wv = w[kh * KW + kw];
                PC_SIMD
                for (pc_idx s = 0; s < s_end; s++) acc[s] += wv * g[s];
            }
        }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (yq != NULL && !wide) {
        /* the epilogue and the next layer's quantization in one pass over the registers (the float32
         * values are pci8_epi_run's, quantized by pci8_q16 as the quantize pass would) */
        const float rcp = 1.0f / qs;
        const int fast = qs > 1e-37f && qs < 1e37f;
        const __m512 vr = _mm512_set1_ps(rcp), vs = _mm512_set1_ps(qs), sc = _mm512_set1_ps(scale);
        const __m512i vz = _mm512_set1_epi32(qz), zb = _mm512_set1_epi32(zb32);
        for (int p = 0; p < P; p++) {
            const int32_t *a = acc + (pc_idx)p * Wg;
            for (int q0 = 0; q0 < Q; q0 += 16) {
                const __mmask16 m = Q - q0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (Q - q0)) - 1u);
                __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_maskz_loadu_epi32(m, a + q0), zb)),
                                         sc);
                if (relu) v = _mm512_max_ps(_mm512_setzero_ps(), v); /* as v < 0 ? 0 : v (NaN, -0 pass) */
                if (keep_y) _mm512_mask_storeu_ps(y + (pc_idx)p * Q + q0, m, v);
                _mm512_mask_cvtepi32_storeu_epi8(yq + (pc_idx)p * Q + q0, m, pci8_q16(v, vr, vs, fast, vz));
            }
        }
        return;
    }
#endif
    for (int p = 0; p < P; p++)
        pci8_epi_run(acc + (pc_idx)p * Wg, Q, zb32, zb64, wide, scale, relu, y + (pc_idx)p * Q);
    if (yq != NULL) pci8_quantize(y, (pc_idx)P * Q, qs, qz, yq);
}

/* ------------------------------------------------ depthwise, channel blocks
 * Small planes waste most of pci8_dw_plane's 64-wide blocks and pay its per-plane set-up (grid, tap
 * pairs) for few outputs, so they run 16 channels at a time with the channels on the vector lanes: the
 * 16 planes are transposed into one padded grid T[Hp][Wp][16] of int32 x - z (zeros for padding); every
 * tap is one 16-lane exact int32 multiply-add per output pixel with that tap's 16 weights (as the plane
 * kernel's sums); the epilogue runs on [P*Q][16] and one transpose puts the planes back (SSE2 byte
 * transposes). The pixel loop is AVX-512 (pci8_dwb_taps) or AVX2 (pci8_dwb_taps2) code; the plain C loop
 * (other levels, and AVX2's int64 epilogue for biases near the int32 limits) is exact but slow, and
 * depthwise_forward picks the blocks only where PCI8_DWB_FAST. */

#define PCI8_DWB 16       /* channels per block */
#define PCI8_DWB_TAPS 25  /* taps whose weights the AVX-512 block loop keeps in registers (up to 5x5) */
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__AVX2__)
#define PCI8_DWB_FAST 1   /* the block loop is the vectorised one: worth choosing over planes */
#else
#define PCI8_DWB_FAST 0
#endif

/* Scratch bytes of one channel block (pci8_dwb_block's layout). */
static inline pc_idx pci8_dwb_scratch(int H, int W, int PH, int PW, int P, int Q)
{
    pc_idx Hp = (pc_idx)H + 2 * PH, Wp = (pc_idx)W + 2 * PW, HW = (pc_idx)H * W, PQ = (pc_idx)P * Q;
    return (pc_idx)sizeof(int32_t) * Hp * Wp * PCI8_DWB + HW * PCI8_DWB + (pc_idx)sizeof(float) * PQ * PCI8_DWB +
           PQ * PCI8_DWB + 4 * 64;
}

#if defined(__SSE2__)
/* px[j] = bytes src[c * lds + j] for c = 0..15: a 16 x 16 tile of bytes transposed in registers. */
static inline __attribute__((always_inline)) void pci8_tr16_regs(const uint8_t *restrict src, pc_idx lds,
                                                                 __m128i *restrict px)
{
    __m128i r[16], a[16], b[16];
    for (int c = 0; c < 16; c++) r[c] = _mm_loadu_si128((const __m128i *)(src + c * lds));
    /* bytes: a[k] pixels 0-7, a[k + 8] pixels 8-15, of rows 2k and 2k + 1 */
    for (int k = 0; k < 8; k++) {
        a[k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
        a[k + 8] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
    }
    /* words: b[4g + m] pixels 4g..4g+3 of rows 4m..4m+3 */
    for (int h = 0; h < 2; h++)
        for (int m = 0; m < 4; m++) {
            b[8 * h + m] = _mm_unpacklo_epi16(a[8 * h + 2 * m], a[8 * h + 2 * m + 1]);
            b[8 * h + 4 + m] = _mm_unpackhi_epi16(a[8 * h + 2 * m], a[8 * h + 2 * m + 1]);
        }
    /* dwords, then qwords: whole pixels */
    for (int g = 0; g < 4; g++) {
        __m128i c0 = _mm_unpacklo_epi32(b[4 * g], b[4 * g + 1]), c1 = _mm_unpackhi_epi32(b[4 * g], b[4 * g + 1]);
        __m128i c2 = _mm_unpacklo_epi32(b[4 * g + 2], b[4 * g + 3]), c3 = _mm_unpackhi_epi32(b[4 * g + 2], b[4 * g + 3]);
        px[4 * g] = _mm_unpacklo_epi64(c0, c2);
        px[4 * g + 1] = _mm_unpackhi_epi64(c0, c2);
        px[4 * g + 2] = _mm_unpacklo_epi64(c1, c3);
        px[4 * g + 3] = _mm_unpackhi_epi64(c1, c3);
    }
}
#endif

/* dst[j * ldd + c] = src[c * lds + j] for a 16 x 16 tile of bytes. */
static inline void pci8_tr16(const uint8_t *restrict src, pc_idx lds, uint8_t *restrict dst, pc_idx ldd)
{
#if defined(__SSE2__)
    __m128i px[16];
    pci8_tr16_regs(src, lds, px);
    for (int j = 0; j < 16; j++) _mm_storeu_si128((__m128i *)(dst + j * ldd), px[j]);
#else
    for (int j = 0; j < 16; j++)
        for (int c = 0; c < 16; c++) dst[j * ldd + c] = src[c * lds + j];
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Each tap's weights as (w, 0) int16 pairs on the 16 lanes, and its offset in the grid T: vpmaddwd (or vpdpwssd)
 * of a grid lane (x - z as int32: low half x - z, high half its sign) with them is (x - z) * w exactly. */
static inline void pci8_dwb_tap_table(const int16_t *restrict wt, int KK, int KW, pc_idx Wp, __m512i *restrict wv,
                                      pc_idx *restrict toff)
{
    for (int k = 0; k < KK; k++) {
        wv[k] = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wt + (pc_idx)k * PCI8_DWB)));
        toff[k] = ((pc_idx)(k / KW) * Wp + k % KW) * PCI8_DWB;
    }
}

/* pci8_dwb_block's AVX-512 loop over the output pixels: the tap weights stay in registers; each output pixel
 * is one int32 vector of 16 channels (one vpmaddwd per tap, exact), then the epilogue and the next
 * layer's quantization (pci8_q16, as pci8_quantize) on that vector. Inlined with constant kernel sizes for
 * the common 3x3, so the taps unroll. */
#if defined(__GNUC__)
__attribute__((always_inline))
#endif
static inline void pci8_dwb_taps(const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int KH, int KW,
                                 int SH, int SW, int P, int Q, const int32_t *restrict zb32,
                                 const int64_t *restrict zb64, int wide, const float *restrict scale, int relu,
                                 float *restrict f, int keep_f, uint8_t *restrict fq, int want_q, float qs, int qz)
{
    __m512i wv[PCI8_DWB_TAPS];
    pc_idx toff[PCI8_DWB_TAPS];
    const int KK = KH * KW;
    pci8_dwb_tap_table(wt, KK, KW, Wp, wv, toff);
    const __m512i zb = _mm512_loadu_si512((const void *)zb32);
    const __m512 sc = _mm512_loadu_ps(scale);
    const float rcp = 1.0f / qs;
    const int fast = qs > 1e-37f && qs < 1e37f;
    const __m512 vr = _mm512_set1_ps(rcp), vs = _mm512_set1_ps(qs);
    const __m512i vz = _mm512_set1_epi32(qz);
    for (int p = 0; p < P; p++) {
        for (int q = 0; q < Q; q++) {
            const int32_t *t0 = T + (((pc_idx)p * SH) * Wp + (pc_idx)q * SW) * PCI8_DWB;
            __m512i a = _mm512_setzero_si512();
            for (int k = 0; k < KK; k++)
                a = _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_load_si512((const void *)(t0 + toff[k])), wv[k]));
            const pc_idx o = ((pc_idx)p * Q + q) * PCI8_DWB;
            if (!wide) {
                __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, zb)), sc);
                if (relu) v = _mm512_max_ps(_mm512_setzero_ps(), v); /* as v < 0 ? 0 : v */
                if (keep_f) _mm512_storeu_ps(f + o, v);
                if (want_q) _mm_storeu_si128((__m128i *)(fq + o), _mm512_cvtepi32_epi8(pci8_q16(v, vr, vs, fast, vz)));
            } else {
                int32_t acc[PCI8_DWB];
                _mm512_storeu_si512((void *)acc, a);
                for (int c = 0; c < PCI8_DWB; c++) {
                    float v = (float)((int64_t)acc[c] + zb64[c]) * scale[c];
                    f[o + c] = relu && v < 0.0f ? 0.0f : v;
                }
                if (want_q) pci8_quantize(f + o, PCI8_DWB, qs, qz, fq + o);
            }
        }
    }
}
#endif

#if defined(PCI8_VNNI_CODE)
/* pci8_dwb_taps (sums inside int32) on a VNNI CPU: vpdpwssd adds a tap's (x - z, its sign) x (w, 0) int16 pairs
 * to the sums in one instruction where vpmaddwd and vpaddd take two; four output pixels at a time, so that four
 * chains of that instruction (its latency is several cycles) are in flight. The sums start at zb (the order
 * of exact integer additions does not matter); the epilogue quantizes with pci8_q16_epi. */
PCI8_VNNI_TARGET
static inline __attribute__((always_inline)) void pci8_dwb_taps_vnni_body(
    const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int KH, int KW, int SH, int SW, int P, int Q,
    const int32_t *restrict zb32, const float *restrict scale, int relu, float *restrict f, int keep_f,
    uint8_t *restrict fq, int want_q, float qs, int qz)
{
    __m512i wv[PCI8_DWB_TAPS];
    pc_idx toff[PCI8_DWB_TAPS];
    const int KK = KH * KW;
    pci8_dwb_tap_table(wt, KK, KW, Wp, wv, toff);
    const __m512i zb = _mm512_loadu_si512((const void *)zb32);
    const __m512 sc = _mm512_loadu_ps(scale);
    const int fast = qs > 1e-37f && qs < 1e37f;
    const __m512 vr = _mm512_set1_ps(1.0f / qs), vs = _mm512_set1_ps(qs);
    const __m512 lo = _mm512_set1_ps(relu ? 0.0f : (float)-qz), hi = _mm512_set1_ps((float)(255 - qz));
    const __m512i vz = _mm512_set1_epi32(qz);
    const pc_idx step = (pc_idx)SW * PCI8_DWB;
#define PCI8_DWBV_OUT(A, Q_)                                                                                   \
    do {                                                                                                     \
        const pc_idx o = ((pc_idx)p * Q + (Q_)) * PCI8_DWB;                                                  \
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(A), sc);                                           \
        if (keep_f) _mm512_storeu_ps(f + o, relu ? _mm512_max_ps(_mm512_setzero_ps(), v) : v);               \
        if (want_q)                                                                                          \
            _mm_storeu_si128((__m128i *)(fq + o),                                                            \
                             _mm512_cvtepi32_epi8(pci8_q16_epi(v, vr, vs, fast, lo, hi, vz)));               \
    } while (0)
    /* two neighbouring pixels (their 16-lane blocks are adjacent in f and fq): one near-tie test and branch
     * for both, as in the 1x1 epilogues */
#define PCI8_DWBV_OUT2(A, B, Q_)                                                                               \
    do {                                                                                                     \
        const pc_idx o = ((pc_idx)p * Q + (Q_)) * PCI8_DWB;                                                  \
        const __m512 va = _mm512_mul_ps(_mm512_cvtepi32_ps(A), sc), vb = _mm512_mul_ps(_mm512_cvtepi32_ps(B), sc); \
        if (keep_f) {                                                                                        \
            _mm512_storeu_ps(f + o, relu ? _mm512_max_ps(_mm512_setzero_ps(), va) : va);                     \
            _mm512_storeu_ps(f + o + PCI8_DWB, relu ? _mm512_max_ps(_mm512_setzero_ps(), vb) : vb);          \
        }                                                                                                    \
        if (want_q) {                                                                                        \
            __m512i k0, k1;                                                                                  \
            pci8_q16x2_epi(va, vb, vr, vs, fast, lo, hi, vz, &k0, &k1);                                      \
            _mm_storeu_si128((__m128i *)(fq + o), _mm512_cvtepi32_epi8(k0));                                 \
            _mm_storeu_si128((__m128i *)(fq + o + PCI8_DWB), _mm512_cvtepi32_epi8(k1));                      \
        }                                                                                                    \
    } while (0)
    for (int p = 0; p < P; p++) {
        const int32_t *tp = T + (pc_idx)p * SH * Wp * PCI8_DWB;
        int q = 0;
        for (; q + 4 <= Q; q += 4) {
            const int32_t *t0 = tp + (pc_idx)q * step;
            __m512i a0 = zb, a1 = zb, a2 = zb, a3 = zb;
            for (int k = 0; k < KK; k++) {
                const int32_t *tk = t0 + toff[k];
                a0 = _mm512_dpwssd_epi32(a0, _mm512_load_si512((const void *)tk), wv[k]);
                a1 = _mm512_dpwssd_epi32(a1, _mm512_load_si512((const void *)(tk + step)), wv[k]);
                a2 = _mm512_dpwssd_epi32(a2, _mm512_load_si512((const void *)(tk + 2 * step)), wv[k]);
                a3 = _mm512_dpwssd_epi32(a3, _mm512_load_si512((const void *)(tk + 3 * step)), wv[k]);
            }
            PCI8_DWBV_OUT2(a0, a1, q);
            PCI8_DWBV_OUT2(a2, a3, q + 2);
        }
        for (; q < Q; q++) {
            const int32_t *t0 = tp + (pc_idx)q * step;
            __m512i a = zb;
            for (int k = 0; k < KK; k++)
                a = _mm512_dpwssd_epi32(a, _mm512_load_si512((const void *)(t0 + toff[k])), wv[k]);
            PCI8_DWBV_OUT(a, q);
        }
    }
#undef PCI8_DWBV_OUT
#undef PCI8_DWBV_OUT2
}

PCI8_VNNI_TARGET
static void pci8_dwb_taps_vnni(const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int KH, int KW,
                               int SH, int SW, int P, int Q, const int32_t *restrict zb32,
                               const float *restrict scale, int relu, float *restrict f, int keep_f,
                               uint8_t *restrict fq, int want_q, float qs, int qz)
{
    if (KH == 3 && KW == 3) /* constant taps: the tap loop unrolls */
        pci8_dwb_taps_vnni_body(T, Wp, wt, 3, 3, SH, SW, P, Q, zb32, scale, relu, f, keep_f, fq, want_q, qs, qz);
    else
        pci8_dwb_taps_vnni_body(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, scale, relu, f, keep_f, fq, want_q, qs, qz);
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
/* The AVX2 form of pci8_dwb_taps: two 8-lane halves per output pixel (vpmaddwd of the int32 grid lanes against
 * (w, 0) int16 pairs, exact; AVX-VNNI's vpdpwssd adds them in the same instruction), float32 results into f for
 * pci8_quantize (its own AVX2-level code, so the same bits as the quantize pass). NAME_3x3 has the common
 * kernel size as constants, so its taps unroll. */
static inline __m256i pci8_madd_add(__m256i a, __m256i t, __m256i w) { return _mm256_add_epi32(a, _mm256_madd_epi16(t, w)); }
#define PCI8_DEF_DWB_TAPS2(NAME, ATTR, ACC)                                                                         \
    ATTR static inline __attribute__((always_inline)) void NAME##_body(const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int KH, int KW, \
                                  int SH, int SW, int P, int Q, const int32_t *restrict zb32, const float *restrict scale, \
                                  int relu, float *restrict f) \
{ \
    __m256i wlo[PCI8_DWB_TAPS], whi[PCI8_DWB_TAPS]; \
    pc_idx toff[PCI8_DWB_TAPS]; \
    const int KK = KH * KW; \
    for (int k = 0; k < KK; k++) { \
        const __m256i w16 = _mm256_loadu_si256((const __m256i *)(wt + (pc_idx)k * PCI8_DWB)); \
        wlo[k] = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w16)); \
        whi[k] = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w16, 1)); \
        toff[k] = ((pc_idx)(k / KW) * Wp + k % KW) * PCI8_DWB; \
    } \
    const __m256i zl = _mm256_loadu_si256((const __m256i *)zb32), zh = _mm256_loadu_si256((const __m256i *)(zb32 + 8)); \
    const __m256 sl = _mm256_loadu_ps(scale), sh = _mm256_loadu_ps(scale + 8), zero = _mm256_setzero_ps(); \
    for (int p = 0; p < P; p++) { \
        for (int q = 0; q < Q; q++) { \
            const int32_t *t0 = T + (((pc_idx)p * SH) * Wp + (pc_idx)q * SW) * PCI8_DWB; \
            __m256i a = _mm256_setzero_si256(), b = a; \
            for (int k = 0; k < KK; k++) { \
                a = ACC(a, _mm256_load_si256((const __m256i *)(t0 + toff[k])), wlo[k]); \
                b = ACC(b, _mm256_load_si256((const __m256i *)(t0 + toff[k] + 8)), whi[k]); \
            } \
            __m256 va = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, zl)), sl); \
            __m256 vb = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(b, zh)), sh); \
            if (relu) { /* as v < 0 ? 0 : v (NaN and -0 pass: max returns its second operand then) */ \
                va = _mm256_max_ps(zero, va); \
                vb = _mm256_max_ps(zero, vb); \
            } \
            float *fo = f + ((pc_idx)p * Q + q) * PCI8_DWB; \
            _mm256_storeu_ps(fo, va); \
            _mm256_storeu_ps(fo + 8, vb); \
        } \
    } \
} \
    ATTR static void NAME(const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int KH, int KW, \
                                  int SH, int SW, int P, int Q, const int32_t *restrict zb32, const float *restrict scale, \
                                  int relu, float *restrict f) \
    { NAME##_body(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, scale, relu, f); } \
    ATTR static void NAME##_3x3(const int32_t *restrict T, pc_idx Wp, const int16_t *restrict wt, int SH, int SW, int P, \
                                int Q, const int32_t *restrict zb32, const float *restrict scale, int relu, \
                                float *restrict f) \
    { NAME##_body(T, Wp, wt, 3, 3, SH, SW, P, Q, zb32, scale, relu, f); }
PCI8_DEF_DWB_TAPS2(pci8_dwb_taps2, , pci8_madd_add)
#if defined(PCI8_AVXVNNI_CODE)
PCI8_DEF_DWB_TAPS2(pci8_dwb_taps2_avxvnni, PCI8_AVXVNNI_TARGET, _mm256_dpwssd_avx_epi32)
#endif
#endif

/* One block of nc <= 16 channels of one image: x points at the first plane (planes HW apart), wt holds
 * each tap's 16 weights ([KH * KW][16] int16, zero past nc), zb32 / zb64 / scale 16 lanes each.
 * y (P, Q planes, PQ apart) gets the float32 outputs when not NULL; yq the next layer's uint8 input
 * when not NULL (pci8_quantize of the same float32 values). */
static inline void pci8_dwb_block(const uint8_t *restrict x, int nc, int H, int W, int z,
                                  const int16_t *restrict wt, int KH, int KW, int SH, int SW, int PH, int PW,
                                  int P, int Q, const int32_t *restrict zb32, const int64_t *restrict zb64, int wide,
                                  const float *restrict scale, int relu, void *restrict scratch,
                                  float *restrict y, uint8_t *restrict yq, float qs, int qz, int path)
{
    const pc_idx Hp = (pc_idx)H + 2 * PH, Wp = (pc_idx)W + 2 * PW, HW = (pc_idx)H * W, PQ = (pc_idx)P * Q;
    /* 64-byte aligned (the caller's scratch has 64 bytes to spare): a pixel's 16 lanes are one cache line */
    uint8_t *base = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int32_t *T = (int32_t *)base;                                      /* [Hp][Wp][16] */
    uint8_t *xt = base + ((pc_idx)sizeof(int32_t) * Hp * Wp * PCI8_DWB + 63) / 64 * 64;   /* [HW][16] */
    float *f = (float *)(xt + (HW * PCI8_DWB + 63) / 64 * 64);                            /* [PQ][16] */
    uint8_t *fq = (uint8_t *)(f + PQ * PCI8_DWB);                                          /* [PQ][16] */

    int fused = 0;  /* the AVX-512 loop quantized as it stored */
#if defined(__AVX512F__) && defined(__AVX512BW__)
    fused = KH * KW <= PCI8_DWB_TAPS;
#endif
    int gridded = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (nc == PCI8_DWB) {
        /* the padded int32 grid of x - z straight from the transposed registers: each pixel's 16 channels are
         * one vpmovzxbd and one store (no channels-minor byte copy, no second pass to widen it) */
        for (pc_idx r = 0; r < Hp; r++) {
            int32_t *row = T + r * Wp * PCI8_DWB;
            if (r < PH || r >= PH + H) {
                memset(row, 0, sizeof(int32_t) * (size_t)(Wp * PCI8_DWB));
            } else {
                memset(row, 0, sizeof(int32_t) * (size_t)(PW * PCI8_DWB));
                memset(row + ((pc_idx)PW + W) * PCI8_DWB, 0, sizeof(int32_t) * (size_t)(PW * PCI8_DWB));
            }
        }
        const __m512i vz = _mm512_set1_epi32(z);
        int32_t *d = T + ((pc_idx)PH * Wp + PW) * PCI8_DWB; /* pixel (h, w)'s lanes */
        pc_idx i = 0;
        int w = 0;
        for (; i + 16 <= HW; i += 16) {
            __m128i px[16];
            pci8_tr16_regs(x + i, HW, px);
            for (int j = 0; j < 16; j++) {
                _mm512_store_si512((void *)d, _mm512_sub_epi32(_mm512_cvtepu8_epi32(px[j]), vz));
                d += PCI8_DWB;
                if (++w == W) { /* next row: past the padding columns */
                    w = 0;
                    d += 2 * (pc_idx)PW * PCI8_DWB;
                }
            }
        }
        for (; i < HW; i++) {
            for (int c = 0; c < PCI8_DWB; c++) d[c] = (int32_t)x[c * HW + i] - z;
            d += PCI8_DWB;
            if (++w == W) {
                w = 0;
                d += 2 * (pc_idx)PW * PCI8_DWB;
            }
        }
        gridded = 1;
    }
#endif
    /* the planes, channels minor */
    pc_idx i = 0;
    if (!gridded && nc == PCI8_DWB)
        for (; i + 16 <= HW; i += 16) pci8_tr16(x + i, HW, xt + i * PCI8_DWB, PCI8_DWB);
    if (!gridded)
        for (; i < HW; i++)
            for (int c = 0; c < PCI8_DWB; c++) xt[i * PCI8_DWB + c] = c < nc ? x[c * HW + i] : (uint8_t)z;

    /* the padded int32 grid of x - z (widened once here, not at every tap that reads it) */
    for (pc_idx r = 0; r < Hp && !gridded; r++) {
        int32_t *row = T + r * Wp * PCI8_DWB;
        pc_idx h = r - PH;
        if (h < 0 || h >= H) {
            memset(row, 0, sizeof(int32_t) * (size_t)(Wp * PCI8_DWB));
            continue;
        }
        memset(row, 0, sizeof(int32_t) * (size_t)(PW * PCI8_DWB));
        const uint8_t *src = xt + h * W * PCI8_DWB;
        int32_t *dst = row + (pc_idx)PW * PCI8_DWB;
        const pc_idx n = (pc_idx)W * PCI8_DWB;
        PC_SIMD
        for (pc_idx k = 0; k < n; k++) dst[k] = (int32_t)src[k] - z;
        memset(row + ((pc_idx)PW + W) * PCI8_DWB, 0, sizeof(int32_t) * (size_t)(PW * PCI8_DWB));
    }

    (void)path;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(PCI8_VNNI_CODE)
    if (fused && path == PCI8_VNNI && !wide)
        pci8_dwb_taps_vnni(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, scale, relu, f, y != NULL, fq, yq != NULL, qs, qz);
    else
#endif
    if (fused) {
        if (KH == 3 && KW == 3)
            pci8_dwb_taps(T, Wp, wt, 3, 3, SH, SW, P, Q, zb32, zb64, wide, scale, relu, f, y != NULL, fq, yq != NULL,
                          qs, qz);
        else
            pci8_dwb_taps(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, zb64, wide, scale, relu, f, y != NULL, fq,
                          yq != NULL, qs, qz);
    } else
#elif defined(__AVX2__)
    if (!wide && KH * KW <= PCI8_DWB_TAPS) {
        const int k3 = KH == 3 && KW == 3;
#if defined(PCI8_AVXVNNI_CODE)
        if (path == PCI8_AVXVNNI) {
            if (k3) pci8_dwb_taps2_avxvnni_3x3(T, Wp, wt, SH, SW, P, Q, zb32, scale, relu, f);
            else pci8_dwb_taps2_avxvnni(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, scale, relu, f);
        } else
#endif
        if (k3) pci8_dwb_taps2_3x3(T, Wp, wt, SH, SW, P, Q, zb32, scale, relu, f);
        else pci8_dwb_taps2(T, Wp, wt, KH, KW, SH, SW, P, Q, zb32, scale, relu, f);
    } else
#endif
    /* taps: 16 lanes each, exact int32 sums; then the epilogue of pci8_epi_run per lane */
    for (int p = 0; p < P; p++) {
        for (int q = 0; q < Q; q++) {
            const int32_t *t0 = T + (((pc_idx)p * SH) * Wp + (pc_idx)q * SW) * PCI8_DWB;
            int32_t acc[PCI8_DWB];
            for (int c = 0; c < PCI8_DWB; c++) acc[c] = 0;
            for (int kh = 0; kh < KH; kh++) {
                const int32_t *tr = t0 + (pc_idx)kh * Wp * PCI8_DWB;
                const int16_t *wr = wt + (pc_idx)kh * KW * PCI8_DWB;
                for (int kw = 0; kw < KW; kw++) {
                    PC_SIMD
                    for (int c = 0; c < PCI8_DWB; c++)
                        acc[c] += (int32_t)tr[kw * PCI8_DWB + c] * (int32_t)wr[kw * PCI8_DWB + c];
                }
            }
            float *fo = f + ((pc_idx)p * Q + q) * PCI8_DWB;
            if (!wide) {
                PC_SIMD
                for (int c = 0; c < PCI8_DWB; c++) {
                    float v = (float)(acc[c] + zb32[c]) * scale[c];
                    fo[c] = relu && v < 0.0f ? 0.0f : v;
                }
            } else {
                for (int c = 0; c < PCI8_DWB; c++) {
                    float v = (float)((int64_t)acc[c] + zb64[c]) * scale[c];
                    fo[c] = relu && v < 0.0f ? 0.0f : v;
                }
            }
        }
    }

    if (y != NULL)
        for (int c = 0; c < nc; c++) {
            float *yc = y + c * PQ;
            for (pc_idx k = 0; k < PQ; k++) yc[k] = f[k * PCI8_DWB + c];
        }
    if (yq != NULL) {
        /* elementwise, so quantizing [PQ][16] gives each plane's bits */
        if (!fused) pci8_quantize(f, PQ * PCI8_DWB, qs, qz, fq);
        pc_idx k = 0;
        if (nc == PCI8_DWB)
            for (; k + 16 <= PQ; k += 16) pci8_tr16(fq + k * PCI8_DWB, PCI8_DWB, yq + k, PQ);
        for (int c = 0; c < nc; c++)
            for (pc_idx kk = k; kk < PQ; kk++) yq[c * PQ + kk] = fq[kk * PCI8_DWB + c];
    }
}

/* ------------------------------------------------------------ max pooling
 * uint8 max pooling between chained layers: quantization is monotone, so the max of quantized values is
 * the quantized max (the same bits as pooling float32 and quantizing after). Padded taps are skipped
 * (-inf never wins); floor-mode windows always hold one real tap (padding is at most half the kernel). */

/* One plane x (H, W) -> y (P, Q). */
static inline void pci8_maxpool_plane(const uint8_t *restrict x, int H, int W, int KH, int KW, int SH, int SW,
                                      int PH, int PW, int P, int Q, uint8_t *restrict y)
{
    if (KH == 2 && KW == 2 && SH == 2 && SW == 2 && PH == 0 && PW == 0) {
        for (int p = 0; p < P; p++) {
            const uint8_t *r0 = x + (pc_idx)(2 * p) * W, *r1 = r0 + W;
            uint8_t *yr = y + (pc_idx)p * Q;
            int q = 0;
#if defined(__SSE2__)
            /* the rows' max, then the max of each byte pair (even and odd bytes as int16) */
            const __m128i lo = _mm_set1_epi16(0x00FF);
            for (; q + 8 <= Q; q += 8) {
                __m128i m = _mm_max_epu8(_mm_loadu_si128((const __m128i *)(r0 + 2 * q)),
                                         _mm_loadu_si128((const __m128i *)(r1 + 2 * q)));
                __m128i v = _mm_max_epi16(_mm_and_si128(m, lo), _mm_srli_epi16(m, 8));
                _mm_storel_epi64((__m128i *)(yr + q), _mm_packus_epi16(v, v));
            }
            /* short rows (8x8 planes): four outputs from 8 bytes of each row */
            for (; q + 4 <= Q; q += 4) {
                __m128i m = _mm_max_epu8(_mm_loadl_epi64((const __m128i *)(r0 + 2 * q)),
                                         _mm_loadl_epi64((const __m128i *)(r1 + 2 * q)));
                __m128i v = _mm_max_epi16(_mm_and_si128(m, lo), _mm_srli_epi16(m, 8));
                int32_t four = _mm_cvtsi128_si32(_mm_packus_epi16(v, v));
                memcpy(yr + q, &four, 4);
            }
#endif
            for (; q < Q; q++) {
                uint8_t a = r0[2 * q] > r0[2 * q + 1] ? r0[2 * q] : r0[2 * q + 1];
                uint8_t b = r1[2 * q] > r1[2 * q + 1] ? r1[2 * q] : r1[2 * q + 1];
                yr[q] = a > b ? a : b;
            }
        }
        return;
    }
    for (int p = 0; p < P; p++) {
        int h0 = p * SH - PH, h1 = h0 + KH;
        h0 = h0 < 0 ? 0 : h0;
        h1 = h1 > H ? H : h1;
        for (int q = 0; q < Q; q++) {
            int w0 = q * SW - PW, w1 = w0 + KW;
            w0 = w0 < 0 ? 0 : w0;
            w1 = w1 > W ? W : w1;
            uint8_t m = 0;
            for (int h = h0; h < h1; h++)
                for (int w = w0; w < w1; w++) m = x[(pc_idx)h * W + w] > m ? x[(pc_idx)h * W + w] : m;
            y[(pc_idx)p * Q + q] = m;
        }
    }
}

#endif /* PARCONV_PC_INT8_H */
