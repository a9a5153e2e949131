/* Per-plane sums of batch norm (_norm.pyx): the statistics of the forward and the two sums
 * of the backward, over the n contiguous floats of one (image, channel) plane.
 *
 * Every value is converted to double before it is added, so a channel of millions of values
 * keeps float64 accuracy. With AVX-512 (AVX2) the sums run in 4 vectors of 8 (4) doubles
 * each, taking 32 (16) floats per step; the last n % 32 (16) floats go one by one into a
 * scalar sum; the vectors' lanes are then added in a fixed tree and the scalar sum last.
 * The grouping is set by n alone, so a plane has the same bits whichever thread sums it.
 * The baseline build keeps four scalar lanes (portable C, no vector instructions). Each
 * element is rounded as the scalar code rounds it: differences and products of the
 * backward in float, as the NumPy reference evaluates them, sums in double, no FMA.
 */
#ifndef PARCONV_PC_NORM_H
#define PARCONV_PC_NORM_H

#include <stddef.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef ptrdiff_t pcn_idx;

#if defined(__AVX512F__)
#define PCN_STEP 32
typedef __m512d pcn_vd;
typedef __m512 pcn_vf;
/* the 16 floats at p as two vectors of 8 doubles */
#define PCN_CVT_LO(v) _mm512_cvtps_pd(_mm512_castps512_ps256(v))
#define PCN_CVT_HI(v) _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
static inline double pcn_hsum(pcn_vd a, pcn_vd b, pcn_vd c, pcn_vd d)
{
    double l[8];
    _mm512_storeu_pd(l, _mm512_add_pd(_mm512_add_pd(a, b), _mm512_add_pd(c, d)));
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
#elif defined(__AVX2__)
#define PCN_STEP 16
typedef __m256d pcn_vd;
typedef __m256 pcn_vf;
#define PCN_CVT_LO(v) _mm256_cvtps_pd(_mm256_castps256_ps128(v))
#define PCN_CVT_HI(v) _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))
static inline double pcn_hsum(pcn_vd a, pcn_vd b, pcn_vd c, pcn_vd d)
{
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(a, b), _mm256_add_pd(c, d)));
    return (l[0] + l[1]) + (l[2] + l[3]);
}
#elif (defined(__GNUC__) && __GNUC__ >= 9) || defined(__clang__)
/* the portable level (SSE2, NEON): 4-float and 2-double vectors of the compiler's vector extensions, so these
 * sums vectorise there too (the scalar lanes below are for other compilers) */
#include <string.h>
#define PCN_STEP 8
typedef float pcn_vf __attribute__((vector_size(16)));
typedef double pcn_vd __attribute__((vector_size(16)));
typedef float pcn_v2f __attribute__((vector_size(8)));
typedef int pcn_vi __attribute__((vector_size(16)));
static inline pcn_vf pcn_ldf(const float *p)
{
    pcn_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline pcn_vd pcn_cvt_lo(pcn_vf v)
{
    const pcn_v2f h = {v[0], v[1]};
    return __builtin_convertvector(h, pcn_vd);
}
static inline pcn_vd pcn_cvt_hi(pcn_vf v)
{
    const pcn_v2f h = {v[2], v[3]};
    return __builtin_convertvector(h, pcn_vd);
}
#define PCN_CVT_LO(v) pcn_cvt_lo(v)
#define PCN_CVT_HI(v) pcn_cvt_hi(v)
static inline double pcn_hsum(pcn_vd a, pcn_vd b, pcn_vd c, pcn_vd d)
{
    const pcn_vd s = (a + b) + (c + d);
    return s[0] + s[1];
}
#define PCN_LDF(p) pcn_ldf(p)
#define PCN_SUBF(a, b) ((a) - (b))
#define PCN_MULF(a, b) ((a) * (b))
#define PCN_SETF(x) ((pcn_vf){0.0f, 0.0f, 0.0f, 0.0f} + (float)(x))
#define PCN_ADDD(a, b) ((a) + (b))
#define PCN_SUBD(a, b) ((a) - (b))
#define PCN_MULD(a, b) ((a) * (b))
#define PCN_SETD(x) ((pcn_vd){0.0, 0.0} + (double)(x))
#define PCN_ZEROD() ((pcn_vd){0.0, 0.0})
#define PCN_HALF 4
/* lanes where y > 0 keep g (NaN in y masks) */
#define PCN_MASKF(g, y) ((pcn_vf)((pcn_vi)(g) & ((y) > (pcn_vf){0.0f, 0.0f, 0.0f, 0.0f})))
#endif

#if defined(__AVX512F__)
#define PCN_LDF(p) _mm512_loadu_ps(p)
#define PCN_SUBF _mm512_sub_ps
#define PCN_MULF _mm512_mul_ps
#define PCN_SETF _mm512_set1_ps
#define PCN_ADDD _mm512_add_pd
#define PCN_SUBD _mm512_sub_pd
#define PCN_MULD _mm512_mul_pd
#define PCN_SETD _mm512_set1_pd
#define PCN_ZEROD _mm512_setzero_pd
#define PCN_HALF 16
#elif defined(__AVX2__)
#define PCN_LDF(p) _mm256_loadu_ps(p)
#define PCN_SUBF _mm256_sub_ps
#define PCN_MULF _mm256_mul_ps
#define PCN_SETF _mm256_set1_ps
#define PCN_ADDD _mm256_add_pd
#define PCN_SUBD _mm256_sub_pd
#define PCN_MULD _mm256_mul_pd
#define PCN_SETD _mm256_set1_pd
#define PCN_ZEROD _mm256_setzero_pd
#define PCN_HALF 8
#endif

/* The values a plane's sums take a whole vector step at a time; those past its last whole step run one at a
 * time (for the work estimates of _norm.pyx). */
#if defined(PCN_STEP)
#define PCN_PLANE_STEP PCN_STEP
#else
#define PCN_PLANE_STEP 1
#endif

/* s[0] += sum of (p[i] - k), s[1] += sum of (p[i] - k)^2, in double: a batch norm's statistics in one
 * pass. k lies among the channel's values (the mean of its first ones), so the variance
 * s[1] / n - (s[0] / n)^2 cancels no more digits than the distance of k from the mean costs (a few of
 * double's 16 where k lies within a few deviations). */
static inline void pcn_sum_sq(const float *p, pcn_idx n, double k, double *s)
{
#if defined(PCN_STEP)
    const pcn_vd vk = PCN_SETD(k);
    pcn_vd a0 = PCN_ZEROD(), a1 = PCN_ZEROD(), a2 = PCN_ZEROD(), a3 = PCN_ZEROD();
    pcn_vd q0 = PCN_ZEROD(), q1 = PCN_ZEROD(), q2 = PCN_ZEROD(), q3 = PCN_ZEROD();
    pcn_idx i = 0;
    for (; i + PCN_STEP <= n; i += PCN_STEP) {
        const pcn_vf a = PCN_LDF(p + i), b = PCN_LDF(p + i + PCN_HALF);
        const pcn_vd d0 = PCN_SUBD(PCN_CVT_LO(a), vk), d1 = PCN_SUBD(PCN_CVT_HI(a), vk);
        const pcn_vd d2 = PCN_SUBD(PCN_CVT_LO(b), vk), d3 = PCN_SUBD(PCN_CVT_HI(b), vk);
        a0 = PCN_ADDD(a0, d0);
        a1 = PCN_ADDD(a1, d1);
        a2 = PCN_ADDD(a2, d2);
        a3 = PCN_ADDD(a3, d3);
        q0 = PCN_ADDD(q0, PCN_MULD(d0, d0));
        q1 = PCN_ADDD(q1, PCN_MULD(d1, d1));
        q2 = PCN_ADDD(q2, PCN_MULD(d2, d2));
        q3 = PCN_ADDD(q3, PCN_MULD(d3, d3));
    }
    double t = 0.0, u = 0.0;
    for (; i < n; i++) {
        const double d = p[i] - k;
        t += d;
        u += d * d;
    }
    s[0] += pcn_hsum(a0, a1, a2, a3) + t;
    s[1] += pcn_hsum(q0, q1, q2, q3) + u;
#else
    double t0 = 0.0, t1 = 0.0, u0 = 0.0, u1 = 0.0;
    pcn_idx i = 0;
    for (; i + 2 <= n; i += 2) {
        const double d0 = p[i] - k, d1 = p[i + 1] - k;
        t0 += d0;
        t1 += d1;
        u0 += d0 * d0;
        u1 += d1 * d1;
    }
    for (; i < n; i++) {
        const double d = p[i] - k;
        t0 += d;
        u0 += d * d;
    }
    s[0] += t0 + t1;
    s[1] += u0 + u1;
#endif
}

/* g = dy where y > 0, else 0: a fused ReLU's gradient mask (NaN in y masks, as relu_backward) */
#if defined(__AVX512F__)
#define PCN_MASKF(g, y) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((y), _mm512_setzero_ps(), _CMP_GT_OQ), (g))
#elif defined(__AVX2__)
#define PCN_MASKF(g, y) _mm256_and_ps((g), _mm256_cmp_ps((y), _mm256_setzero_ps(), _CMP_GT_OQ))
#endif

/* dy[k], masked by y[k] > 0 where y is given; dy[k] read unconditionally (as pc_relu_bwd) */
static inline float pcn_g(const float *dy, const float *y, pcn_idx k)
{
    const float d = dy[k];
    return y && !(y[k] > 0.0f) ? 0.0f : d;
}

/* sg += sum g[i], sgx += sum g[i] ((x[i] - m) istd): the product in float, the sums in double;
 * g is dy, or with y (not NULL) dy masked by y > 0 */
static inline void pcn_grad_sums_relu(const float *x, const float *dy, const float *y, pcn_idx n, float m,
                                      float istd, double *sg, double *sgx)
{
#if defined(PCN_STEP)
    const pcn_vf vm = PCN_SETF(m), vs = PCN_SETF(istd);
    pcn_vd a0 = PCN_ZEROD(), a1 = PCN_ZEROD(), a2 = PCN_ZEROD(), a3 = PCN_ZEROD();
    pcn_vd b0 = PCN_ZEROD(), b1 = PCN_ZEROD(), b2 = PCN_ZEROD(), b3 = PCN_ZEROD();
    pcn_idx i = 0;
    for (; i + PCN_STEP <= n; i += PCN_STEP) {
        pcn_vf g0 = PCN_LDF(dy + i), g1 = PCN_LDF(dy + i + PCN_HALF);
        if (y) {
            g0 = PCN_MASKF(g0, PCN_LDF(y + i));
            g1 = PCN_MASKF(g1, PCN_LDF(y + i + PCN_HALF));
        }
        const pcn_vf p0 = PCN_MULF(g0, PCN_MULF(PCN_SUBF(PCN_LDF(x + i), vm), vs));
        const pcn_vf p1 = PCN_MULF(g1, PCN_MULF(PCN_SUBF(PCN_LDF(x + i + PCN_HALF), vm), vs));
        a0 = PCN_ADDD(a0, PCN_CVT_LO(g0));
        a1 = PCN_ADDD(a1, PCN_CVT_HI(g0));
        a2 = PCN_ADDD(a2, PCN_CVT_LO(g1));
        a3 = PCN_ADDD(a3, PCN_CVT_HI(g1));
        b0 = PCN_ADDD(b0, PCN_CVT_LO(p0));
        b1 = PCN_ADDD(b1, PCN_CVT_HI(p0));
        b2 = PCN_ADDD(b2, PCN_CVT_LO(p1));
        b3 = PCN_ADDD(b3, PCN_CVT_HI(p1));
    }
    double ta = 0.0, tb = 0.0;
    for (; i < n; i++) {
        const float gi = pcn_g(dy, y, i);
        ta += gi;
        tb += gi * ((x[i] - m) * istd);
    }
    *sg += pcn_hsum(a0, a1, a2, a3) + ta;
    *sgx += pcn_hsum(b0, b1, b2, b3) + tb;
#else
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0, b0 = 0.0, b1 = 0.0, b2 = 0.0, b3 = 0.0;
    pcn_idx k = 0;
#define PCN_G(k) pcn_g(dy, y, k)
    for (; k + 4 <= n; k += 4) {
        const float g0 = PCN_G(k), g1 = PCN_G(k + 1), g2 = PCN_G(k + 2), g3 = PCN_G(k + 3);
        a0 += g0;
        a1 += g1;
        a2 += g2;
        a3 += g3;
        b0 += g0 * ((x[k] - m) * istd);
        b1 += g1 * ((x[k + 1] - m) * istd);
        b2 += g2 * ((x[k + 2] - m) * istd);
        b3 += g3 * ((x[k + 3] - m) * istd);
    }
    for (; k < n; k++) {
        const float g0 = PCN_G(k);
        a0 += g0;
        b0 += g0 * ((x[k] - m) * istd);
    }
#undef PCN_G
    *sg += (a0 + a1) + (a2 + a3);
    *sgx += (b0 + b1) + (b2 + b3);
#endif
}

/* dx = ((g - a) - xhat b) k in training mode, g k in eval mode, xhat = (x - m) istd, g = dy or
 * with y (not NULL) dy masked by y > 0; dx may be dy itself. Plain loops the compiler
 * vectorises; the mask is a select, not a branch. */
static inline void pcn_dx_plane(const float *x, const float *dy, const float *y, float *dx, pcn_idx n, float m,
                                float istd, float k, float a, float b, int training)
{
    if (training && y) {
        for (pcn_idx i = 0; i < n; i++) {
            const float d = dy[i], g = y[i] > 0.0f ? d : 0.0f;
            dx[i] = ((g - a) - ((x[i] - m) * istd) * b) * k;
        }
    } else if (training) {
        for (pcn_idx i = 0; i < n; i++)
            dx[i] = ((dy[i] - a) - ((x[i] - m) * istd) * b) * k;
    } else if (y) {
        for (pcn_idx i = 0; i < n; i++) {
            const float d = dy[i];
            dx[i] = (y[i] > 0.0f ? d : 0.0f) * k;
        }
    } else {
        for (pcn_idx i = 0; i < n; i++)
            dx[i] = dy[i] * k;
    }
}

#endif
