/* parconv OpenCL kernels: helpers shared by every kernel file.
 *
 * Shape legend (the same in every file and in parconv/backends/base.py):
 *   N batch, C in-channels, O out-channels (filters), H, W input height/width,
 *   P, Q output height/width, K kernel size (K x K), F in-features, G out-features.
 * Arrays are float32 (int32 for labels and argmax), C-contiguous, row-major.
 *
 * Build options, set per device by parconv/backends/opencl.py (never literals here):
 *   TILE_WG     work-items per work-group of the local-memory tiled kernels (conv, GEMM)
 *   GEMM_BM, GEMM_BN, GEMM_BK
 *               largest GEMM macro tile (rows x cols x reduction chunk) held in local memory;
 *               (GEMM_BM and GEMM_BN multiples of 8)
 *   RED_WG      work-items per work-group of the reductions (a power of two)
 *   RED_CHUNKED 1: each reduction work-item takes a contiguous chunk (CPUs, where a
 *               work-item runs alone on a core); 0: strided, coalesced (GPUs)
 *
 * The host includes this file textually (the line `#include "common.h"` of each .cl file
 * is replaced by it), so the kernel sources need no include path.
 */
#ifndef PARCONV_COMMON_H
#define PARCONV_COMMON_H

#ifndef TILE_WG
#define TILE_WG 1
#endif
#ifndef GEMM_BM
#define GEMM_BM 64
#endif
#ifndef GEMM_BN
#define GEMM_BN 64
#endif
#ifndef GEMM_BK
#define GEMM_BK 64
#endif
#ifndef RED_WG
#define RED_WG 64
#endif
#ifndef RED_CHUNKED
#define RED_CHUNKED 0
#endif

/* Loop i over the share of [0, n) that work-item `id` of `count` reduces. The split
 * depends only on n and count, so sums are reproducible. */
#if RED_CHUNKED
#define RED_FOR(i, id, count, n)                                                        \
    for (int i = (int)(((long)(n) * (id)) / (count)), i##_end = (int)(((long)(n) * ((id) + 1)) / (count)); \
         i < i##_end; ++i)
#else
#define RED_FOR(i, id, count, n) for (int i = (id); i < (n); i += (count))
#endif

/* Eight consecutive floats as a float8, and back.
 * Written element by element on purpose: some OpenCL runtimes (PoCL on CPUs) do not
 * inline the vload8/vstore8 builtins, and the resulting call spills every vector
 * register of the micro-kernel; the compilers fold these into one vector load. */
#define LD8(p) ((float8)((p)[0], (p)[1], (p)[2], (p)[3], (p)[4], (p)[5], (p)[6], (p)[7]))
#define ST8(v, p)                                                            \
    do {                                                                     \
        (p)[0] = (v).s0; (p)[1] = (v).s1; (p)[2] = (v).s2; (p)[3] = (v).s3;  \
        (p)[4] = (v).s4; (p)[5] = (v).s5; (p)[6] = (v).s6; (p)[7] = (v).s7;  \
    } while (0)

/* The 8 x 8 register micro-kernel of the tiled kernels: eight float8 accumulators
 * acc0..acc7 (rows) += a.si (one scalar per row) * b (eight columns). */
#define MICRO_DECL float8 acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7
#define MICRO_LOAD(p, ld)                                                            \
    acc0 = LD8((p) + 0 * (ld)); acc1 = LD8((p) + 1 * (ld)); acc2 = LD8((p) + 2 * (ld)); \
    acc3 = LD8((p) + 3 * (ld)); acc4 = LD8((p) + 4 * (ld)); acc5 = LD8((p) + 5 * (ld)); \
    acc6 = LD8((p) + 6 * (ld)); acc7 = LD8((p) + 7 * (ld))
#define MICRO_STORE(p, ld)                                                         \
    ST8(acc0, (p) + 0 * (ld)); ST8(acc1, (p) + 1 * (ld)); ST8(acc2, (p) + 2 * (ld)); \
    ST8(acc3, (p) + 3 * (ld)); ST8(acc4, (p) + 4 * (ld)); ST8(acc5, (p) + 5 * (ld)); \
    ST8(acc6, (p) + 6 * (ld)); ST8(acc7, (p) + 7 * (ld))
#define MICRO_FMA(a, b)                                              \
    acc0 += (a).s0 * (b); acc1 += (a).s1 * (b); acc2 += (a).s2 * (b); \
    acc3 += (a).s3 * (b); acc4 += (a).s4 * (b); acc5 += (a).s5 * (b); \
    acc6 += (a).s6 * (b); acc7 += (a).s7 * (b)

/* Sum of the eight lanes in a fixed order (deterministic). */
inline float hsum8(float8 v)
{
    float4 s = v.lo + v.hi;
    float2 t = s.lo + s.hi;
    return t.x + t.y;
}

/* Sum of n contiguous floats: eight running lanes (independent add chains), then the
 * tail, in a fixed order. */
inline float sum_contiguous(__global const float* restrict x, const int n)
{
    float8 acc = (float8)(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += LD8(x + i);
    float s = hsum8(acc);
    for (; i < n; ++i) s += x[i];
    return s;
}

/* Tree reduction of RED_WG floats in local memory; every work-item gets the total.
 * The order is fixed by RED_WG, so the result is the same on every run. */
inline float wg_sum_float(__local float* scratch, float v)
{
    const int lid = get_local_id(0);
    scratch[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = RED_WG / 2; span > 0; span >>= 1) {
        if (lid < span) scratch[lid] += scratch[lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

inline int wg_sum_int(__local int* scratch, int v)
{
    const int lid = get_local_id(0);
    scratch[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = RED_WG / 2; span > 0; span >>= 1) {
        if (lid < span) scratch[lid] += scratch[lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    int total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

/* NaN and finiteness tests written as comparisons: some runtimes (PoCL's CPU driver)
 * call out of line even for isnan/isfinite, which costs a call per element and stops
 * the work-item loop from vectorizing. Exact without -cl-fast-relaxed-math, which the
 * host never passes. */
#define IS_NAN(v) ((v) != (v))
/* the same reason for integer min/max/clamp in the kernels' index arithmetic */
#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))
#define ICLAMP(v, lo, hi) IMIN(IMAX((v), (lo)), (hi))
#define IS_FINITE(v) ((v) - (v) == 0.0f)

/* "a is a new maximum" with NumPy's argmax rules: the first maximum wins ties and
 * the first NaN wins over everything. */
inline bool beats(float a, float best)
{
    return IS_NAN(a) ? !IS_NAN(best) : (a > best);
}

/* Update (best, bi) with candidate (v, idx) under the rules of beats(); branch-free. */
#define ARGMAX_STEP(v, idx, best, bi)          \
    do {                                       \
        const float v_ = (v);                  \
        const bool take_ = beats(v_, (best));  \
        (best) = take_ ? v_ : (best);          \
        (bi) = take_ ? (idx) : (bi);           \
    } while (0)

/* The fast form of ARGMAX_STEP: a plain comparison, with `nan` collecting whether any
 * candidate was NaN; a window that saw one is rescanned with ARGMAX_STEP (NaN never
 * wins a plain comparison, so only then can the two disagree). */
#define ARGMAX_STEP_FAST(v, idx, best, bi, nan) \
    do {                                        \
        const float v_ = (v);                   \
        const int take_ = v_ > (best);          \
        (best) = take_ ? v_ : (best);           \
        (bi) = take_ ? (idx) : (bi);            \
        (nan) |= v_ != v_;                      \
    } while (0)

#endif /* PARCONV_COMMON_H */
