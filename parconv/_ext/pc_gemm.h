/* Register-blocked float32 GEMM of the linear layers (_dense.pyx): forward with the bias and
 * ReLU applied as it stores, input and weight gradients. Row-major throughout.
 *
 * Shape legend: N batch, F in-features, G out-features; x (N, F), w (G, F), dy (N, G).
 *
 *   pcg_nt  C[i, j] = act(bias[j] + sum_k a[i*lda + k] * b[j*ldb + k])   forward: y = x w^T + b
 *   pcg_nn  C[i, j] = sum_k a[i*rsa + k*csa] * b[k*ldb + j]              dx = dy w, dw = dy^T x
 *
 * Both compute a caller-chosen rectangle of C, so the caller splits C into fixed blocks and
 * hands them to threads in any order: every element's arithmetic is fixed by the shape alone
 * (sums run over k in order, in the same lanes), so the bits do not depend on the block a
 * thread takes, on the thread count, or on the other rows of the batch.
 *
 * pcg_nt reads both operands along k in place (no packing: w is the large operand and changes
 * every training step, so packing it would cost a pass over it per call). A tile of
 * PCG_NT_MR rows of a by PCG_NT_NR rows of b keeps MR x NR vector sums in registers over the
 * whole of k (the last partial vector a masked load of zeros), then reduces the lanes of all
 * of them at once in a shuffle tree whose adds are the same for every element. Fewer than
 * PCG_NT_MR rows (a batch of one: a matrix-vector product) take a 1 x PCG_NT_ROW_NR tile: each
 * weight read once, no wasted lanes, the weight rows prefetched a few lines ahead (they stream
 * from L3: a layer's weights outgrow L2), and few enough rows at once for the streams to keep
 * up; two or three rows a 2 x RED/2 or 3 x RED/3 tile, so they too read each weight once. Their
 * reduction is the same tree, so their bits equal those of the batched rows.
 *
 * pcg_nn is the broadcast form: a tile keeps PCG_NN_MR rows x PCG_NN_NR columns of C in
 * registers; each k broadcasts MR values of a and loads NR contiguous values of b's row k. A block
 * of enough rows copies b's panel of NR columns (and, for dw, the block's values of a) in blocks of
 * the depth into contiguous buffers that every tile under it re-reads from L1; smaller blocks read
 * them in place. The last partial panel loads and stores under a mask; fewer than MR rows run
 * smaller tiles.
 *
 * FMAs are explicit (setup.py builds with -ffp-contract=off).
 */
#ifndef PARCONV_PC_GEMM_H
#define PARCONV_PC_GEMM_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "pc_common.h"
#include "pc_conv.h" /* pcc_v and its load / FMA / store macros for this ISA level */

#if defined(__GNUC__)
#define PCG_INLINE static inline __attribute__((always_inline))
#else
#define PCG_INLINE static inline
#endif

/* Whether this ISA level's kernels beat the BLAS sgemm on the linear layers, so that the backend takes
 * them by default: AVX-512 and AVX2 do (the sgemm packs the whole weight matrix on every call, most of a
 * small batch's time); the generic level keeps the BLAS. PCG_BACKWARD_MIN_ROWS: the smallest batch whose
 * backward they take, below it the sgemm's rank-1 update is faster at the AVX2 level. */
#if PCC_VEC >= 16
#define PCG_PREFERRED 1
#define PCG_BACKWARD_MIN_ROWS 1
#elif PCC_VEC == 8
#define PCG_PREFERRED 1
#define PCG_BACKWARD_MIN_ROWS 2
#else
#define PCG_PREFERRED 0
#define PCG_BACKWARD_MIN_ROWS 1
#endif

/* ------------------------------------------------------------ masked loads */

/* The first n (0 < n <= PCC_VEC) floats at p, the other lanes zero; nothing past p + n is read. */
#if defined(__AVX512F__)
PCG_INLINE pcc_v pcg_loadn(const float *p, int n)
{
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
#elif PCC_VEC == 8
PCG_INLINE pcc_v pcg_loadn(const float *p, int n)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
#else
PCG_INLINE pcc_v pcg_loadn(const float *p, int n)
{
    float t[PCC_VEC] = {0.0f};
    pcc_v v;
    memcpy(t, p, sizeof(float) * (size_t)n);
    memcpy(&v, t, sizeof v);
    return v;
}
#endif

/* ------------------------------------------------------------------ C = A B^T */

/* PCG_NT_RED sums reduced together; tiles are MR x NR = RED (batched) and 1 x RED (one row). */
#if PCC_VEC == 16
#define PCG_NT_RED 16
#define PCG_NT_MR 4
#define PCG_NT_NR 4
#elif PCC_VEC == 8
#define PCG_NT_RED 8
#define PCG_NT_MR 2
#define PCG_NT_NR 4
#else
#define PCG_NT_RED 8
#define PCG_NT_MR 2
#define PCG_NT_NR 4
#endif

/* The one-row tile's weight rows (at most PCG_NT_RED) and how far ahead (floats) it prefetches them. */
#define PCG_NT_ROW_NR 8
#define PCG_NT_PF 64

/* out[p] = the lane sum of v[p], p < PCG_NT_RED; per element (in 4-lane groups g and lanes l)
 * ((g0 + g2) + (g1 + g3)) then ((l0 + l2) + (l1 + l3)) on AVX-512, and
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) on AVX2, whatever p is. */
#if PCC_VEC == 16
PCG_INLINE void pcg_reduce(const pcc_v *v, float *out)
{
    __m512 s[8], t[4], u[2];
    for (int p = 0; p < 8; p++)
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++)  /* group r of t[q]: v[4q + r]'s four lanes */
        t[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xDD));
    for (int r = 0; r < 2; r++)
        u[r] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * r], t[2 * r + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * r], t[2 * r + 1], 0xEE));
    /* lane 4c + m holds v[4m + c] */
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    float t16[16];
    _mm512_storeu_ps(t16, w);
    for (int c = 0; c < 4; c++)
        for (int m = 0; m < 4; m++)
            out[4 * m + c] = t16[4 * c + m];
}
#elif PCC_VEC == 8
PCG_INLINE void pcg_reduce(const pcc_v *v, float *out)
{
    const __m256 h0 = _mm256_hadd_ps(v[0], v[1]), h1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h2 = _mm256_hadd_ps(v[4], v[5]), h3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31)));
}
#else
PCG_INLINE void pcg_reduce(const pcc_v *v, float *out)
{
    for (int p = 0; p < PCG_NT_RED; p++)
        out[p] = (v[p][0] + v[p][1]) + (v[p][2] + v[p][3]);
}
#endif

/* out[i * nr + j] = sum_k ar[i][k] * br[j][k] for i < mr, j < nr (mr * nr <= PCG_NT_RED; the
 * unused sums stay zero). Fewer than PCG_NT_MR rows prefetch the rows of b PCG_NT_PF floats ahead. */
PCG_INLINE void pcg_nt_tile(const float *const *ar, const float *const *br, int mr, int nr, pc_idx K, float *out)
{
    pcc_v acc[PCG_NT_RED];
    _Pragma("GCC unroll 16") for (int p = 0; p < PCG_NT_RED; p++)
        acc[p] = PCC_ZERO();
    const pc_idx Kv = K - K % PCC_VEC;
    for (pc_idx k = 0; k < Kv; k += PCC_VEC) {
        pcc_v av[PCG_NT_RED];
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)
            av[i] = PCC_LOADU(ar[i] + k);
        if (mr < PCG_NT_MR) {
            /* non-temporal: each weight is read once per call, so it should not push out what the
             * next layer reads; past the end of a row this touches the next one (never faults) */
            _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++)
                __builtin_prefetch(br[j] + k + PCG_NT_PF, 0, 0);
        }
        _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++) {
            pcc_v bv = PCC_LOADU(br[j] + k);
            PCC_KEEP(bv);
            _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)
                acc[i * nr + j] = PCC_FMA(av[i], bv, acc[i * nr + j]);
        }
    }
    if (Kv < K) {
        const int n = (int)(K - Kv);
        pcc_v av[PCG_NT_RED];
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)
            av[i] = pcg_loadn(ar[i] + Kv, n);
        _Pragma("GCC unroll 16") for (int j = 0; j < nr; j++) {
            pcc_v bv = pcg_loadn(br[j] + Kv, n);
            _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)
                acc[i * nr + j] = PCC_FMA(av[i], bv, acc[i * nr + j]);
        }
    }
    pcg_reduce(acc, out);
}

static void pcg_nt_tile_mn(const float *const *ar, const float *const *br, pc_idx K, float *out)
{
    pcg_nt_tile(ar, br, PCG_NT_MR, PCG_NT_NR, K, out);
}

static void pcg_nt_tile_1n(const float *const *ar, const float *const *br, pc_idx K, float *out)
{
    pcg_nt_tile(ar, br, 1, PCG_NT_ROW_NR, K, out);
}

#if PCG_NT_MR > 2
static void pcg_nt_tile_2n(const float *const *ar, const float *const *br, pc_idx K, float *out)
{
    pcg_nt_tile(ar, br, 2, PCG_NT_RED / 2, K, out);
}
#endif

#if PCG_NT_MR > 3
static void pcg_nt_tile_3n(const float *const *ar, const float *const *br, pc_idx K, float *out)
{
    pcg_nt_tile(ar, br, 3, PCG_NT_RED / 3, K, out);
}
#endif

/* Rows [i0, i1) x columns [j0, j1) of C = act(A B^T + bias): A (., K) with row stride lda, B
 * (., K) with row stride ldb, bias (j1) or NULL; relu: max(v, 0) (a NaN stays NaN). A tile at
 * the edge repeats its last row (column) and drops the copies. */
static void pcg_nt(const float *a, pc_idx lda, const float *b, pc_idx ldb, const float *bias, int relu, float *c,
                   pc_idx ldc, pc_idx K, pc_idx i0, pc_idx i1, pc_idx j0, pc_idx j1)
{
    /* fewer than MR rows overall (a small batch) take a tile of exactly that many rows */
    const int mr = i1 - i0 >= PCG_NT_MR ? PCG_NT_MR : (int)(i1 - i0);
    const int nr = mr == 1 ? PCG_NT_ROW_NR : PCG_NT_RED / mr;
    float out[PCG_NT_RED];
    const float *ar[PCG_NT_RED], *br[PCG_NT_RED];
    for (pc_idx j = j0; j < j1; j += nr) {
        const int nj = j1 - j < nr ? (int)(j1 - j) : nr;
        for (int t = 0; t < nr; t++)
            br[t] = b + (j + (t < nj ? t : nj - 1)) * ldb;
        for (pc_idx i = i0; i < i1; i += mr) {
            const int ni = i1 - i < mr ? (int)(i1 - i) : mr;
            for (int t = 0; t < mr; t++)
                ar[t] = a + (i + (t < ni ? t : ni - 1)) * lda;
            if (mr == 1)
                pcg_nt_tile_1n(ar, br, K, out);
#if PCG_NT_MR > 2
            else if (mr == 2)
                pcg_nt_tile_2n(ar, br, K, out);
#endif
#if PCG_NT_MR > 3
            else if (mr == 3)
                pcg_nt_tile_3n(ar, br, K, out);
#endif
            else
                pcg_nt_tile_mn(ar, br, K, out);
            for (int ii = 0; ii < ni; ii++) {
                float *cr = c + (i + ii) * ldc + j;
                for (int jj = 0; jj < nj; jj++) {
                    float v = out[ii * nr + jj] + (bias ? bias[j + jj] : 0.0f);
                    cr[jj] = relu && v < 0.0f ? 0.0f : v;
                }
            }
        }
    }
}

/* -------------------------------------------------------------------- C = A B */

#if PCC_VEC == 16
#define PCG_NN_MR 8
#elif PCC_VEC == 8
#define PCG_NN_MR 6
#else
#define PCG_NN_MR 4
#endif
#define PCG_NN_NR (2 * PCC_VEC)

/* C[i*ldc + j] = sum_k a[i*rsa + k*csa] * b[k*ldb + j] for i < MR, j < nj (nj <= PCG_NN_NR); with
 * acc_in the sums go on from C's values (the next block of the depth: the same chain of FMAs). */
#define PCG_DEFINE_NN_TILE(MR)                                                                           \
    static void pcg_nn_tile_##MR(const float *restrict a, pc_idx rsa, pc_idx csa, const float *restrict b, \
                                 pc_idx ldb, float *restrict c, pc_idx ldc, pc_idx K, int nj, int acc_in) \
    {                                                                                                    \
        pcc_v acc[MR][2];                                                                                \
        if (acc_in) {                                                                                    \
            const int m0 = nj < PCC_VEC ? nj : PCC_VEC, m1 = nj - m0;                                    \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
                acc[i][0] = pcg_loadn(c + i * ldc, m0);                                                  \
                acc[i][1] = m1 > 0 ? pcg_loadn(c + i * ldc + PCC_VEC, m1) : PCC_ZERO();                  \
            }                                                                                            \
        } else {                                                                                         \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = PCC_ZERO();   \
        }                                                                                                \
        if (nj == PCG_NN_NR) {                                                                           \
            for (pc_idx k = 0; k < K; k++) {                                                             \
                const float *bk = b + k * ldb, *ak = a + k * csa;                                        \
                const pcc_v b0 = PCC_LOADU(bk), b1 = PCC_LOADU(bk + PCC_VEC);                            \
                _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                  \
                    const pcc_v av = PCC_SET1(ak[i * rsa]);                                              \
                    acc[i][0] = PCC_FMA(av, b0, acc[i][0]);                                              \
                    acc[i][1] = PCC_FMA(av, b1, acc[i][1]);                                              \
                }                                                                                        \
            }                                                                                            \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
                PCC_STOREU(c + i * ldc, acc[i][0]);                                                      \
                PCC_STOREU(c + i * ldc + PCC_VEC, acc[i][1]);                                            \
            }                                                                                            \
            return;                                                                                      \
        }                                                                                                \
        const int n0 = nj < PCC_VEC ? nj : PCC_VEC, n1 = nj - n0;                                        \
        for (pc_idx k = 0; k < K; k++) {                                                                 \
            const float *bk = b + k * ldb, *ak = a + k * csa;                                            \
            const pcc_v b0 = pcg_loadn(bk, n0), b1 = n1 > 0 ? pcg_loadn(bk + PCC_VEC, n1) : PCC_ZERO();  \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
                const pcc_v av = PCC_SET1(ak[i * rsa]);                                                  \
                acc[i][0] = PCC_FMA(av, b0, acc[i][0]);                                                  \
                acc[i][1] = PCC_FMA(av, b1, acc[i][1]);                                                  \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                          \
            if (n0 == PCC_VEC) PCC_STOREU(c + i * ldc, acc[i][0]);                                       \
            else PCC_STORE_FIRST(c + i * ldc, acc[i][0], n0);                                            \
            if (n1 > 0) PCC_STORE_FIRST(c + i * ldc + PCC_VEC, acc[i][1], n1);                           \
        }                                                                                                \
    }

#if PCG_NN_MR == 8
PCG_DEFINE_NN_TILE(8)
#elif PCG_NN_MR == 6
PCG_DEFINE_NN_TILE(6)
#endif
PCG_DEFINE_NN_TILE(4)
PCG_DEFINE_NN_TILE(2)
PCG_DEFINE_NN_TILE(1)

/* Depth per block where a panel of B is packed, and the fewest rows of C that pay for the packing. */
#define PCG_NN_KC 128
#define PCG_NN_PACK_ROWS 32
#define PCG_NN_PACK_MAX_ROWS 64

/* Rows [i0, i1) of one panel (nj <= NR columns) of C = A B over depth [k0, k0 + kn), b pointing at
 * the panel's row k0 (row stride ldb); acc_in: C holds the sums of the depth before k0. */
static void pcg_nn_rows(const float *a, pc_idx rsa, pc_idx csa, const float *b, pc_idx ldb, float *c, pc_idx ldc,
                        pc_idx kn, pc_idx i0, pc_idx i1, int nj, int acc_in)
{
    pc_idx i = i0;
    for (; i + PCG_NN_MR <= i1; i += PCG_NN_MR)
#if PCG_NN_MR == 8
        pcg_nn_tile_8(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
#elif PCG_NN_MR == 6
        pcg_nn_tile_6(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
#else
        pcg_nn_tile_4(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
#endif
#if PCG_NN_MR > 4
    for (; i + 4 <= i1; i += 4)
        pcg_nn_tile_4(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
#endif
    for (; i + 2 <= i1; i += 2)
        pcg_nn_tile_2(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
    for (; i < i1; i++)
        pcg_nn_tile_1(a + i * rsa, rsa, csa, b, ldb, c + i * ldc, ldc, kn, nj, acc_in);
}

/* Rows [i0, i1) x columns [j0, j1) of C = A B, A(i, k) = a[i*rsa + k*csa] (dx: dy, rsa = G,
 * csa = 1; dw: dy^T, rsa = 1, csa = G), B (K, .) with row stride ldb. Panels of NR columns
 * outside, rows inside, so each panel of b is re-read from cache by every tile of rows. Where
 * enough rows share a panel, it is copied in blocks of PCG_NN_KC rows of the depth into a
 * contiguous buffer that stays in L1: read in place, rows of B a power-of-two apart (a layer of
 * 512 or 2048 features) all fall into the same few cache sets and the panel is fetched again for
 * every tile. Each element's FMAs run in the same order either way, so the bits are the same. */
static void pcg_nn(const float *a, pc_idx rsa, pc_idx csa, const float *b, pc_idx ldb, float *c, pc_idx ldc,
                   pc_idx K, pc_idx i0, pc_idx i1, pc_idx j0, pc_idx j1)
{
    if (i1 - i0 < PCG_NN_PACK_ROWS || i1 - i0 > PCG_NN_PACK_MAX_ROWS || K <= 1) {
        for (pc_idx j = j0; j < j1; j += PCG_NN_NR)
            pcg_nn_rows(a, rsa, csa, b + j, ldb, c + j, ldc, K, i0, i1, j1 - j < PCG_NN_NR ? (int)(j1 - j) : PCG_NN_NR, 0);
        return;
    }
    float pk[PCG_NN_KC * PCG_NN_NR] __attribute__((aligned(64)));
    float pa[PCG_NN_KC * PCG_NN_PACK_MAX_ROWS] __attribute__((aligned(64)));
    const pc_idx mi = i1 - i0;
    for (pc_idx k0 = 0; k0 < K; k0 += PCG_NN_KC) {
        const pc_idx kn = K - k0 < PCG_NN_KC ? K - k0 : PCG_NN_KC;
        /* A's rows along the depth (dw: columns of dy, G apart) as contiguous rows of the block's mi values,
         * shared by its panels */
        const float *ab = a + i0 * rsa + k0 * csa;
        pc_idx ra = rsa, ca = csa;
        if (csa != 1) {
            for (pc_idx k = 0; k < kn; k++)
                for (pc_idx i = 0; i < mi; i++) pa[k * mi + i] = ab[i * rsa + k * csa];
            ab = pa;
            ra = 1;
            ca = mi;
        }
        for (pc_idx j = j0; j < j1; j += PCG_NN_NR) {
            const int nj = j1 - j < PCG_NN_NR ? (int)(j1 - j) : PCG_NN_NR;
            for (pc_idx k = 0; k < kn; k++)
                memcpy(pk + k * PCG_NN_NR, b + (k0 + k) * ldb + j, sizeof(float) * (size_t)nj);
            pcg_nn_rows(ab - i0 * ra, ra, ca, pk, PCG_NN_NR, c + j, ldc, kn, i0, i1, nj, k0 > 0);
        }
    }
}

/* ------------------------------------------ C = act(A B^T + bias) as (B A^T)^T */

/* The forward of a batch of at least PCG_T_MIN_ROWS rows runs in the broadcast form, whose tiles
 * are faster than the dot form's: x is transposed once into xt (F x ldt, ldt = N rounded
 * up to PCG_NN_NR, the extra columns zero), y^T = w xt is computed by tiles of PCG_NN_MR outputs x
 * PCG_NN_NR rows of the batch, and each tile is stored transposed, with the bias and the ReLU. */
#define PCG_T_MIN_ROWS 32
#define PCG_T_MIN_COLS 64 /* fewer outputs: the transpose would cost more than the faster tiles save */

/* Whether an (M x N) output over depth K takes the transposed broadcast form (not at the generic
 * level, whose 4-float broadcast tiles are slower than its dot-form ones). */
static inline int pcg_nt_transposed(pc_idx M, pc_idx N)
{
    return PCC_VEC >= 8 && M >= PCG_T_MIN_ROWS && N >= PCG_T_MIN_COLS;
}

/* Columns of xt for an M-row x: M rounded up to a whole panel, plus half a panel where that lands
 * on a multiple of 1 KiB, so that a tile's walk down xt's rows does not map every row into the same
 * few cache sets (a power-of-two batch would otherwise evict its own panel). */
static inline pc_idx pcg_t_ld(pc_idx M)
{
    pc_idx ld = (M + PCG_NN_NR - 1) / PCG_NN_NR * PCG_NN_NR;
    return ld % 256 == 0 ? ld + PCG_NN_NR / 2 : ld;
}

/* Rows [k0, k1) of xt = x^T: xt[k*ldt + n] = x[n*ldx + k] for n < N, zero for N <= n < ldt. */
static void pcg_transpose(const float *restrict x, pc_idx ldx, pc_idx N, float *restrict xt, pc_idx ldt,
                          pc_idx k0, pc_idx k1)
{
    if (ldt > N)
        for (pc_idx k = k0; k < k1; k++)
            memset(xt + k * ldt + N, 0, sizeof(float) * (size_t)(ldt - N));
    for (pc_idx n0 = 0; n0 < N; n0 += 16) {
        const int nn = N - n0 < 16 ? (int)(N - n0) : 16;
        for (pc_idx k = k0; k < k1; k++) {
            float *dst = xt + k * ldt + n0;
            const float *src = x + n0 * ldx + k;
            for (int n = 0; n < nn; n++)
                dst[n] = src[n * ldx];
        }
    }
}

/* c[j*ldc + i] = act(bias[i] + sum_k a[i*lda + k] * b[k*ldb + j]) for i < MR, j < nj; b has
 * PCG_NN_NR readable columns (zero-padded). */
#define PCG_DEFINE_NNT_TILE(MR)                                                                          \
    static void pcg_nnt_tile_##MR(const float *restrict a, pc_idx lda, const float *restrict b, pc_idx ldb, \
                                  const float *restrict bias, int relu, float *restrict c, pc_idx ldc,    \
                                  pc_idx K, int nj)                                                      \
    {                                                                                                    \
        pcc_v acc[MR][2];                                                                                \
        float t[MR][PCG_NN_NR];                                                                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = PCC_ZERO();       \
        for (pc_idx k = 0; k < K; k++) {                                                                 \
            const float *bk = b + k * ldb, *ak = a + k;                                                  \
            const pcc_v b0 = PCC_LOADU(bk), b1 = PCC_LOADU(bk + PCC_VEC);                                \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                      \
                const pcc_v av = PCC_SET1(ak[i * lda]);                                                  \
                acc[i][0] = PCC_FMA(av, b0, acc[i][0]);                                                  \
                acc[i][1] = PCC_FMA(av, b1, acc[i][1]);                                                  \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                          \
            PCC_STOREU(t[i], acc[i][0]);                                                                 \
            PCC_STOREU(t[i] + PCC_VEC, acc[i][1]);                                                       \
        }                                                                                                \
        float bi[MR];                                                                                    \
        for (int i = 0; i < MR; i++) bi[i] = bias ? bias[i] : 0.0f;                                      \
        for (int j = 0; j < nj; j++)                                                                     \
            for (int i = 0; i < MR; i++) {                                                               \
                const float v = t[i][j] + bi[i];                                                         \
                c[j * ldc + i] = relu && v < 0.0f ? 0.0f : v;                                            \
            }                                                                                            \
    }

#if PCG_NN_MR == 8
PCG_DEFINE_NNT_TILE(8)
#elif PCG_NN_MR == 6
PCG_DEFINE_NNT_TILE(6)
#endif
PCG_DEFINE_NNT_TILE(4)
PCG_DEFINE_NNT_TILE(2)
PCG_DEFINE_NNT_TILE(1)

/* Outputs [g0, g1) x batch rows [n0, n1) of y (N x G, row stride ldy) = act(x w^T + bias), from
 * xt (F x ldt) = x^T zero-padded to ldt columns and w (G x F); bias (G) or NULL. */
static void pcg_nnt(const float *w, pc_idx F, const float *xt, pc_idx ldt, const float *bias, int relu, float *y,
                    pc_idx ldy, pc_idx g0, pc_idx g1, pc_idx n0, pc_idx n1)
{
    for (pc_idx n = n0; n < n1; n += PCG_NN_NR) {
        const int nj = n1 - n < PCG_NN_NR ? (int)(n1 - n) : PCG_NN_NR;
        const float *b = xt + n;
        float *yc = y + n * ldy;
        pc_idx g = g0;
#define PCG_NNT_CALL(MR) \
        pcg_nnt_tile_##MR(w + g * F, F, b, ldt, bias ? bias + g : NULL, relu, yc + g, ldy, F, nj)
        for (; g + PCG_NN_MR <= g1; g += PCG_NN_MR)
#if PCG_NN_MR == 8
            PCG_NNT_CALL(8);
#elif PCG_NN_MR == 6
            PCG_NNT_CALL(6);
#else
            PCG_NNT_CALL(4);
#endif
#if PCG_NN_MR > 4
        for (; g + 4 <= g1; g += 4)
            PCG_NNT_CALL(4);
#endif
        for (; g + 2 <= g1; g += 2)
            PCG_NNT_CALL(2);
        for (; g < g1; g++)
            PCG_NNT_CALL(1);
#undef PCG_NNT_CALL
    }
}

/* ------------------------------------------------------- ReLU mask and bias */

#define PCG_MASK_GB 64 /* columns per call of pcg_relu_mask_db */

/* Columns [g0, g1) (g1 - g0 <= PCG_MASK_GB) of dym = dy where y > 0, else 0 (the gradient through
 * a ReLU whose output is y), and db[g] = sum over rows of dym[., g] in double, rows in order (as
 * the unfused bias gradient sums), unless db is NULL. */
static void pcg_relu_mask_db(const float *restrict dy, const float *restrict y, float *restrict dym,
                             float *restrict db, pc_idx N, pc_idx G, pc_idx g0, pc_idx g1)
{
    double acc[PCG_MASK_GB];
    const int n = (int)(g1 - g0);
    for (int g = 0; g < n; g++)
        acc[g] = 0.0;
    for (pc_idx r = 0; r < N; r++) {
        const float *dr = dy + r * G + g0, *yr = y + r * G + g0;
        float *mr = dym + r * G + g0;
        for (int g = 0; g < n; g++) {
            const float d = dr[g]; /* read unconditionally, as pc_relu_bwd */
            const float v = yr[g] > 0.0f ? d : 0.0f;
            mr[g] = v;
            acc[g] += v;
        }
    }
    if (db)
        for (int g = 0; g < n; g++)
            db[g0 + g] = (float)acc[g];
}

#endif /* PARCONV_PC_GEMM_H */
