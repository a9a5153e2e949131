/* linear (dense) layers: one tiled GEMM serves the forward and both weight-side gradients.
 *
 * Shapes: x (N, F), w (G, F), b (G,), y and dy (N, G).
 *   forward  y  = x @ w.T + b      gemm(A = x,    B = w.T)
 *   dx          = dy @ w           gemm(A = dy,   B = w)
 *   dw          = dy.T @ x         gemm(A = dy.T, B = x)
 *   db          = column sums of dy (dense_column_sum)
 * Transposes are strides, never copies: A[i, k] = a[i * sa_i + k * sa_k] and
 * B[k, j] = b[k * sb_k + j * sb_j], one of each pair being 1.
 */
#include "common.h"

/* Stage rows x cols of a strided matrix into local memory as dst[k * ld + i]
 * (reduction index k major), zero-filling rows past `rows_valid`.
 * `along_k` is the element stride along k, `along_i` along i. */
inline void stage_tile(__global const float* restrict src, const int rows, const int rows_valid,
                       const int kc, const int along_i, const int along_k,
                       __local float* restrict dst, const int ld)
{
    const int lid = get_local_id(0);
    if (along_k == 1) {
        /* rows contiguous along k: one row per work-item */
        for (int i = lid; i < rows; i += TILE_WG) {
            if (i < rows_valid) {
                __global const float* s = src + (size_t)i * along_i;
                for (int k = 0; k < kc; ++k) dst[k * ld + i] = s[k];
            } else {
                for (int k = 0; k < kc; ++k) dst[k * ld + i] = 0.0f;
            }
        }
    } else {
        /* columns contiguous along i: one k per work-item */
        for (int k = lid; k < kc; k += TILE_WG) {
            __global const float* s = src + (size_t)k * along_k;
            for (int i = 0; i < rows_valid; ++i) dst[k * ld + i] = s[(size_t)i * along_i];
            for (int i = rows_valid; i < rows; ++i) dst[k * ld + i] = 0.0f;
        }
    }
}

/* c (M, N) = A @ B (+ bias[j] when has_bias), overwritten.
 * The work-group owns a bm x bn tile (multiples of 8, at most GEMM_BM x GEMM_BN) and
 * walks the reduction in chunks of GEMM_BK staged in local memory; each work-item runs
 * 8 x 8 register micro-kernels. Partial sums stay in local memory between chunks, so
 * every output is reduced in a fixed order.
 *
 * Split reduction: the third grid dimension cuts K into chunks of k_split (a multiple
 * of GEMM_BK); group s reduces k in [s * k_split, (s + 1) * k_split) into the partial
 * c + s * M * N, and gemm_sum_splits adds the partials in split order. A product with
 * few output tiles over a long reduction (a classifier head's forward: 100 x 10 outputs
 * over 43264 inputs) keeps the whole device busy that way instead of two groups.
 * Launch: local (TILE_WG, 1, 1), global (tiles_n * TILE_WG, tiles_m, splits). */
__kernel void gemm(__global const float* restrict a,     /* IN  A (M, K) through sa_i, sa_k */
                   __global const float* restrict b,     /* IN  B (K, N) through sb_k, sb_j */
                   __global const float* restrict bias,  /* IN  (N,), read when has_bias */
                   __global float* restrict c,           /* OUT (splits, M, N) */
                   const int M, const int N, const int K,
                   const int sa_i, const int sa_k, const int sb_k, const int sb_j,
                   const int has_bias, const int bm, const int bn, const int k_split)
{
    __local float As[GEMM_BK * GEMM_BM];
    __local float Bs[GEMM_BK * GEMM_BN];
    __local float Cs[GEMM_BM * GEMM_BN];
    const int lid = get_local_id(0);
    const int j0 = get_group_id(0) * bn, i0 = get_group_id(1) * bm, split = get_group_id(2);
    const int rows_valid = IMIN(bm, M - i0), cols_valid = IMIN(bn, N - j0);
    const int nmt = (bm / 8) * (bn / 8);
    const int k_begin = split * k_split, k_end = IMIN(K, k_begin + k_split);

    c += (size_t)split * M * N;
    for (int e = lid; e < bm * bn; e += TILE_WG) Cs[e] = 0.0f;
    for (int k0 = k_begin; k0 < k_end; k0 += GEMM_BK) {
        const int kc = IMIN(GEMM_BK, k_end - k0);
        barrier(CLK_LOCAL_MEM_FENCE);
        stage_tile(a + (size_t)i0 * sa_i + (size_t)k0 * sa_k, bm, rows_valid, kc, sa_i, sa_k, As, bm);
        stage_tile(b + (size_t)j0 * sb_j + (size_t)k0 * sb_k, bn, cols_valid, kc, sb_j, sb_k, Bs, bn);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int mt = lid; mt < nmt; mt += TILE_WG) {
            const int ig = mt / (bn / 8), jg = mt - ig * (bn / 8);
            __local float* cp = Cs + ig * 8 * bn + jg * 8;
            __local const float* ap = As + ig * 8;
            __local const float* bp = Bs + jg * 8;
            MICRO_DECL;
            MICRO_LOAD(cp, bn);
            for (int k = 0; k < kc; ++k) {
                const float8 av = LD8(ap + k * bm);
                const float8 bv = LD8(bp + k * bn);
                MICRO_FMA(av, bv);
            }
            MICRO_STORE(cp, bn);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = lid; i < rows_valid; i += TILE_WG) {
        __global float* dst = c + (size_t)(i0 + i) * N + j0;
        for (int j = 0; j < cols_valid; ++j) dst[j] = Cs[i * bn + j] + (has_bias ? bias[j0 + j] : 0.0f);
    }
}

/* c[i, j] = sum over s of part[s, i, j] in split order (+ bias[j] when has_bias). */
__kernel void gemm_sum_splits(__global const float* restrict part,  /* IN  (splits, M, N) */
                              __global const float* restrict bias,  /* IN  (N,), read when has_bias */
                              __global float* restrict c,           /* OUT (M, N) overwritten */
                              const int splits, const int M, const int N, const int has_bias)
{
    const int e = get_global_id(0);
    const size_t len = (size_t)M * N;
    if (e >= len) return;
    float s = 0.0f;
    for (int k = 0; k < splits; ++k) s += part[(size_t)k * len + e];
    c[e] = s + (has_bias ? bias[e % N] : 0.0f);
}

/* out[j] = sum over i of m[i, j] in row order (db of a linear layer). */
__kernel void dense_column_sum(__global const float* restrict m,   /* IN  (rows, cols) */
                               __global float* restrict out,       /* OUT (cols,) overwritten */
                               const int rows, const int cols)
{
    const int j = get_global_id(0);
    if (j >= cols) return;
    float s = 0.0f;
    for (int i = 0; i < rows; ++i) s += m[(size_t)i * cols + j];
    out[j] = s;
}
