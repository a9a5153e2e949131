/* Linear layers with few outputs (G <= PCD_NARROW_G) for _dense.pyx, and the linear head of the
 * fused conv-ReLU-maxpool layer (_conv_direct.pxi forward, _conv_fused.pxi backward).
 *
 * Shape legend: N batch, F in-features, G out-features; x (N, F), w (G, F),
 * dy (N, G), all row-major.
 *
 * A classifier head (F = 169 * d features -> 10 classes) is a GEMM whose
 * inner or outer dimension is 10: far too thin for a BLAS to block well, and
 * so cheap per element of x that it should run at the speed x streams from
 * memory. These kernels read x (and write dx) exactly once:
 *
 *   forward   y[r, g]  = b[g] + sum_f x[r, f] w[g, f]        (rows split over threads)
 *   backward  dx[r, f] = sum_g dy[r, g] w[g, f]              (columns split over threads)
 *             dw[g, f] = sum_r dy[r, g] x[r, f]
 *
 * The backward walks x by blocks of PCD_BWD_FB columns: the block's slice of
 * w and its dw accumulators stay in L1 while every row of the block streams
 * by, so dx and dw come out of one pass. Each column belongs to one thread and
 * sums its rows in order, so both passes give the same bits at every thread
 * count. G is made a compile-time constant (a switch over always-inlined
 * bodies), so the per-output accumulators live in registers.
 *
 * Without dx (the head of a fused first layer, whose pooled gradient the
 * fused backward computes itself with pcd_linear_dx_rows), dw takes rows in
 * fours, loading and storing each accumulator once per four rows (the same bits).
 *
 * Both backward walks read 1 KB of each row and jump F floats to the next, a
 * run too short for the hardware prefetcher; where x is larger than the L2s
 * (PCD_DW_PF_FLOATS) they prefetch the rows PCD_DW_PF ahead.
 */
#ifndef PARCONV_PC_DENSE_H
#define PARCONV_PC_DENSE_H

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "pc_common.h"
#include "pc_conv.h"   /* pcc_v: the vector type and its load / FMA / store / horizontal sum */

#define PCD_NARROW_G 16   /* largest G these kernels take */
#define PCD_LANES 16
#define PCD_DW_PF 8                 /* backward: rows ahead to prefetch ... */
#define PCD_DW_PF_FLOATS (1 << 20)  /* ... where x has more floats than this */
#define PCD_BWD_FB 256    /* backward: w's slice and the dw accumulators, 2 x G x FB floats, in L1 */

#if defined(__GNUC__)
#define PCD_INLINE static inline __attribute__((always_inline))
#else
#define PCD_INLINE static inline
#endif

/* ------------------------------------------------------------------ forward */

/* Up to four arbitrary rows of y = x @ w.T + b (b may be NULL), reading w once for all of them:
 * contiguous rows of a linear forward, or a fused first layer's head (each thread's last four
 * pooled images). Rows go through in column blocks of PCD_FWD4_SB: for each block of PCD_FWD4_GB
 * outputs, 4 x GB accumulators stay in registers while the block's slice of the rows stays in L1
 * for the next block of outputs. Each (row, output) sums in PCC_VEC float lanes, in column order,
 * then the lanes (PCC_HSUM) and the tail in double, whatever the other rows of its group, so a
 * row's bits never depend on the split. */
#define PCD_FWD4_SB 256
#if PCC_VEC == 16
#define PCD_FWD4_GB 5   /* 20 accumulators + 4 rows + 1 weight of 32 registers */
#else
#define PCD_FWD4_GB 2   /* 8 + 4 + 1 of 16 */
#endif

PCD_INLINE void pcd_fwd4_block(const float *restrict x0, const float *restrict x1, const float *restrict x2,
                               const float *restrict x3, const float *restrict w, pcc_v *restrict acc,
                               pc_idx s0, pc_idx s1, pc_idx F, int gb)
{
    pcc_v a0[PCD_FWD4_GB], a1[PCD_FWD4_GB], a2[PCD_FWD4_GB], a3[PCD_FWD4_GB];
    for (int g = 0; g < gb; g++) {
        a0[g] = acc[g];
        a1[g] = acc[gb + g];
        a2[g] = acc[2 * gb + g];
        a3[g] = acc[3 * gb + g];
    }
    for (pc_idx s = s0; s < s1; s += PCC_VEC) {
        const pcc_v v0 = PCC_LOADU(x0 + s), v1 = PCC_LOADU(x1 + s);
        const pcc_v v2 = PCC_LOADU(x2 + s), v3 = PCC_LOADU(x3 + s);
        for (int g = 0; g < gb; g++) {
            pcc_v wv = PCC_LOADU(w + (pc_idx)g * F + s);
            PCC_KEEP(wv);  /* one load for four rows */
            a0[g] = PCC_FMA(v0, wv, a0[g]);
            a1[g] = PCC_FMA(v1, wv, a1[g]);
            a2[g] = PCC_FMA(v2, wv, a2[g]);
            a3[g] = PCC_FMA(v3, wv, a3[g]);
        }
    }
    for (int g = 0; g < gb; g++) {
        acc[g] = a0[g];
        acc[gb + g] = a1[g];
        acc[2 * gb + g] = a2[g];
        acc[3 * gb + g] = a3[g];
    }
}

/* Rows rows[0..nr) (1 <= nr <= 4, any order, no repeats) of y = x @ w.T + b. */
PCD_INLINE void pcd_fwd_rows4_g(const float *restrict x, const float *restrict w, const float *restrict b,
                                float *restrict y, const pc_idx *rows, int nr, pc_idx F, int G)
{
    pc_idx r[4];
    for (int i = 0; i < 4; i++)
        r[i] = rows[i < nr ? i : nr - 1];  /* a short group repeats its last row and discards it */
    const float *xr[4];
    for (int i = 0; i < 4; i++)
        xr[i] = x + r[i] * F;
    /* output block g0 (size gb) keeps row i's accumulator for output g0 + g at acc[4 * g0 + i * gb + g] */
    pcc_v acc[4 * PCD_NARROW_G];
    for (int k = 0; k < 4 * G; k++)
        acc[k] = PCC_ZERO();
    const pc_idx Fv = F - F % PCC_VEC;
    const int full = G - G % PCD_FWD4_GB;
    for (pc_idx s0 = 0; s0 < Fv; s0 += PCD_FWD4_SB) {
        const pc_idx s1 = s0 + PCD_FWD4_SB < Fv ? s0 + PCD_FWD4_SB : Fv;
        for (int g0 = 0; g0 < full; g0 += PCD_FWD4_GB)
            pcd_fwd4_block(xr[0], xr[1], xr[2], xr[3], w + (pc_idx)g0 * F, acc + 4 * g0, s0, s1, F,
                           PCD_FWD4_GB);
        if (full < G)
            pcd_fwd4_block(xr[0], xr[1], xr[2], xr[3], w + (pc_idx)full * F, acc + 4 * full, s0, s1, F,
                           G - full);
    }
    for (int i = 0; i < nr; i++)
        for (int g = 0; g < G; g++) {
            const int g0 = g < full ? g - g % PCD_FWD4_GB : full;
            const int gb = g < full ? PCD_FWD4_GB : G - full;
            double s = (double)PCC_HSUM(acc[4 * g0 + i * gb + (g - g0)]);
            for (pc_idx t = Fv; t < F; t++)
                s += (double)xr[i][t] * w[(pc_idx)g * F + t];
            y[r[i] * G + g] = (float)s + (b ? b[g] : 0.0f);
        }
}

/* ----------------------------------------------------------------- backward */

/* Columns c0..c0+nb (nb <= PCD_BWD_FB) of dw (and of dx unless NULL), over all N rows: rows go in
 * pairs through the block, the dw accumulators (acc, G x PCD_BWD_FB floats) and w's slice in L1. */
PCD_INLINE void pcd_bwd_block_g(const float *restrict x, const float *restrict w, const float *restrict dy,
                                float *restrict dx, float *restrict dw, pc_idx N, pc_idx F, int G,
                                pc_idx c0, int nb, float (*restrict acc)[PCD_BWD_FB])
{
    const float *restrict wb = w + c0;
    const int nv = nb - nb % PCC_VEC;
    const int far = (size_t)N * (size_t)F > PCD_DW_PF_FLOATS;  /* as in pcd_dw_block_g */
    for (int g = 0; g < G; g++)
        memset(acc[g], 0, sizeof(float) * (size_t)nb);
    for (pc_idx r = 0; r < N; r += 2) {
        const int two = r + 1 < N;
        const float *restrict xa = x + r * F + c0;
        const float *restrict xb = two ? xa + F : xa;
        const float *pf = far && r + PCD_DW_PF + 2 <= N ? xa + PCD_DW_PF * F : NULL;
        float *restrict oa = dx ? dx + r * F + c0 : NULL;
        float da[PCD_NARROW_G], db[PCD_NARROW_G];
        for (int g = 0; g < G; g++) {
            da[g] = dy[r * G + g];
            db[g] = two ? dy[(r + 1) * G + g] : 0.0f;
        }
        for (int j = 0; j < nv; j += PCC_VEC) {
            if (pf && j % 16 == 0) {
                __builtin_prefetch(pf + j, 0, 3);
                __builtin_prefetch(pf + F + j, 0, 3);
            }
            const pcc_v va = PCC_LOADU(xa + j), vb = PCC_LOADU(xb + j);
            pcc_v sa = PCC_ZERO(), sb = PCC_ZERO();
            for (int g = 0; g < G; g++) {
                const pcc_v ga = PCC_SET1(da[g]), gb = PCC_SET1(db[g]);
                if (dx) {
                    pcc_v wv = PCC_LOADU(wb + (pc_idx)g * F + j);
                    PCC_KEEP(wv);
                    sa = PCC_FMA(ga, wv, sa);
                    sb = PCC_FMA(gb, wv, sb);
                }
                PCC_STOREU(&acc[g][j], PCC_FMA(gb, vb, PCC_FMA(ga, va, PCC_LOADU(&acc[g][j]))));
            }
            if (dx) {
                PCC_STOREU(oa + j, sa);
                if (two)
                    PCC_STOREU(oa + F + j, sb);
            }
        }
        for (int j = nv; j < nb; j++) {
            float sa = 0.0f, sb = 0.0f;
            for (int g = 0; g < G; g++) {
                const float wv = wb[(pc_idx)g * F + j];
                sa = PC_FMAF(da[g], wv, sa);
                sb = PC_FMAF(db[g], wv, sb);
                acc[g][j] = PC_FMAF(db[g], xb[j], PC_FMAF(da[g], xa[j], acc[g][j]));
            }
            if (dx) {
                oa[j] = sa;
                if (two)
                    oa[F + j] = sb;
            }
        }
    }
    for (int g = 0; g < G; g++)
        memcpy(dw + (pc_idx)g * F + c0, acc[g], sizeof(float) * (size_t)nb);
}

/* Columns c0..c0+nb of dw alone (no dx): rows go in fours, each accumulator loaded and stored once
 * per four rows. The products are added one row at a time, in row order, exactly as
 * pcd_bwd_block_g adds them, so both give the same bits. */
PCD_INLINE void pcd_dw_block_g(const float *restrict x, const float *restrict dy, float *restrict dw,
                               pc_idx N, pc_idx F, int G, pc_idx c0, int nb, float (*restrict acc)[PCD_BWD_FB])
{
    const int nv = nb - nb % PCC_VEC;
    /* x beyond the L2s comes from L3 or memory, 1 KB per row with a stride of F floats: too short a
     * run for the hardware prefetcher, so the rows PCD_DW_PF ahead are fetched by hand */
    const int far = (size_t)N * (size_t)F > PCD_DW_PF_FLOATS;
    for (int g = 0; g < G; g++)
        memset(acc[g], 0, sizeof(float) * (size_t)nb);
    pc_idx r = 0;
    for (; r + 4 <= N; r += 4) {
        const float *restrict x0 = x + r * F + c0;
        const float *restrict d0 = dy + r * G;
        const float *pf = far && r + PCD_DW_PF + 4 <= N ? x0 + PCD_DW_PF * F : NULL;
        for (int j = 0; j < nv; j += PCC_VEC) {
            if (pf && j % 16 == 0) {
                for (int k = 0; k < 4; k++)
                    __builtin_prefetch(pf + k * F + j, 0, 3);
            }
            const pcc_v v0 = PCC_LOADU(x0 + j), v1 = PCC_LOADU(x0 + F + j);
            const pcc_v v2 = PCC_LOADU(x0 + 2 * F + j), v3 = PCC_LOADU(x0 + 3 * F + j);
            for (int g = 0; g < G; g++) {
                pcc_v a = PCC_LOADU(&acc[g][j]);
                a = PCC_FMA(PCC_SET1(d0[g]), v0, a);
                a = PCC_FMA(PCC_SET1(d0[G + g]), v1, a);
                a = PCC_FMA(PCC_SET1(d0[2 * G + g]), v2, a);
                a = PCC_FMA(PCC_SET1(d0[3 * G + g]), v3, a);
                PCC_STOREU(&acc[g][j], a);
            }
        }
        for (int j = nv; j < nb; j++)
            for (int g = 0; g < G; g++) {
                float a = acc[g][j];
                for (int k = 0; k < 4; k++)
                    a = PC_FMAF(d0[k * G + g], x0[k * F + j], a);
                acc[g][j] = a;
            }
    }
    for (; r < N; r++) {
        const float *restrict x0 = x + r * F + c0;
        for (int j = 0; j < nv; j += PCC_VEC) {
            const pcc_v v0 = PCC_LOADU(x0 + j);
            for (int g = 0; g < G; g++)
                PCC_STOREU(&acc[g][j], PCC_FMA(PCC_SET1(dy[r * G + g]), v0, PCC_LOADU(&acc[g][j])));
        }
        for (int j = nv; j < nb; j++)
            for (int g = 0; g < G; g++)
                acc[g][j] = PC_FMAF(dy[r * G + g], x0[j], acc[g][j]);
    }
    for (int g = 0; g < G; g++)
        memcpy(dw + (pc_idx)g * F + c0, acc[g], sizeof(float) * (size_t)nb);
}

PCD_INLINE void pcd_bwd_cols_g(const float *restrict x, const float *restrict w, const float *restrict dy,
                               float *restrict dx, float *restrict dw, pc_idx N, pc_idx F, int G,
                               pc_idx f0, pc_idx f1, int fb)
{
    float acc[PCD_NARROW_G][PCD_BWD_FB];
    for (pc_idx c0 = f0; c0 < f1; c0 += fb) {
        const int nb = (int)(f1 - c0 < fb ? f1 - c0 : fb);
        if (dx)
            pcd_bwd_block_g(x, w, dy, dx, dw, N, F, G, c0, nb, acc);
        else
            pcd_dw_block_g(x, dy, dw, N, F, G, c0, nb, acc);
    }
}

/* Rows r0..r1 of dx = dy @ w alone (no dw), written to out + (r - r0) * F: rows in fours sharing
 * each load of w. Every element sums its G products in the order and with the rounding of
 * pcd_bwd_block_g's dx, so both give the same bits. */
PCD_INLINE void pcd_dx_rows_g(const float *restrict dy, const float *restrict w, float *restrict out,
                              pc_idx r0, pc_idx r1, pc_idx F, int G)
{
    for (pc_idx r = r0; r < r1; r += 4) {
        const int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
        float *restrict o = out + (r - r0) * F;
        float d[4][PCD_NARROW_G];
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < G; g++)
                d[i][g] = i < nr ? dy[(r + i) * G + g] : 0.0f;
        pc_idx j = 0;
        for (; j + PCC_VEC <= F; j += PCC_VEC) {
            pcc_v s0 = PCC_ZERO(), s1 = PCC_ZERO(), s2 = PCC_ZERO(), s3 = PCC_ZERO();
            for (int g = 0; g < G; g++) {
                pcc_v wv = PCC_LOADU(w + (pc_idx)g * F + j);
                PCC_KEEP(wv);
                s0 = PCC_FMA(PCC_SET1(d[0][g]), wv, s0);
                s1 = PCC_FMA(PCC_SET1(d[1][g]), wv, s1);
                s2 = PCC_FMA(PCC_SET1(d[2][g]), wv, s2);
                s3 = PCC_FMA(PCC_SET1(d[3][g]), wv, s3);
            }
            PCC_STOREU(o + j, s0);
            if (nr > 1)
                PCC_STOREU(o + F + j, s1);
            if (nr > 2)
                PCC_STOREU(o + 2 * F + j, s2);
            if (nr > 3)
                PCC_STOREU(o + 3 * F + j, s3);
        }
        for (; j < F; j++)
            for (int i = 0; i < nr; i++) {
                float sum = 0.0f;
                for (int g = 0; g < G; g++)
                    sum = PC_FMAF(d[i][g], w[(pc_idx)g * F + j], sum);
                o[i * F + j] = sum;
            }
    }
}

/* One copy of each body per G, so G is a constant inside it. */
#define PCD_CASES(CALL) \
    CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6) CALL(7) CALL(8) \
    CALL(9) CALL(10) CALL(11) CALL(12) CALL(13) CALL(14) CALL(15) CALL(16)

/* Rows rows[0..nr) (1 <= nr <= 4, no repeats) of the narrow forward, w read once; G must be
 * 1..PCD_NARROW_G (the caller checks both: out of range, y is left untouched). */
static void pcd_linear_fwd_rows4(const float *x, const float *w, const float *b, float *y,
                                 const pc_idx *rows, int nr, pc_idx F, int G)
{
    if (nr < 1 || nr > 4)
        return;
    switch (G) {
#define PCD_FWD4_CASE(K) case K: pcd_fwd_rows4_g(x, w, b, y, rows, nr, F, K); break;
        PCD_CASES(PCD_FWD4_CASE)
#undef PCD_FWD4_CASE
    default: break;
    }
}

/* Rows r0..r1 of the narrow forward, four per pass over w; G must be 1..PCD_NARROW_G. */
static void pcd_linear_fwd_rows(const float *x, const float *w, const float *b, float *y,
                                pc_idx r0, pc_idx r1, pc_idx F, int G)
{
    for (pc_idx r = r0; r < r1; r += 4) {
        const pc_idx rows[4] = {r, r + 1, r + 2, r + 3};
        pcd_linear_fwd_rows4(x, w, b, y, rows, r1 - r < 4 ? (int)(r1 - r) : 4, F, G);
    }
}

/* Columns f0..f1 of the narrow backward, in blocks of fb (<= PCD_BWD_FB) columns; dx may be NULL. */
static void pcd_linear_bwd_cols(const float *x, const float *w, const float *dy, float *dx, float *dw,
                                pc_idx N, pc_idx F, int G, pc_idx f0, pc_idx f1, int fb)
{
    if (fb < 1 || fb > PCD_BWD_FB)
        fb = PCD_BWD_FB;
    switch (G) {
#define PCD_BWD_CASE(K) \
    case K: \
        if (dx) pcd_bwd_cols_g(x, w, dy, dx, dw, N, F, K, f0, f1, fb); \
        else pcd_bwd_cols_g(x, w, dy, NULL, dw, N, F, K, f0, f1, fb); \
        break;
        PCD_CASES(PCD_BWD_CASE)
#undef PCD_BWD_CASE
    default: break;
    }
}

/* Rows r0..r1 of dx = dy @ w (G must be 1..PCD_NARROW_G) into out, row r at out + (r - r0) * F. */
static void pcd_linear_dx_rows(const float *dy, const float *w, float *out, pc_idx r0, pc_idx r1, pc_idx F, int G)
{
    switch (G) {
#define PCD_DX_CASE(K) case K: pcd_dx_rows_g(dy, w, out, r0, r1, F, K); break;
        PCD_CASES(PCD_DX_CASE)
#undef PCD_DX_CASE
    default: break;
    }
}

/* db[g] of a linear layer: column g of dy (N, G) summed in double, rows in order (the same bits
 * wherever it is called from: the linear backward and a fused first layer's head). */
static inline float pcd_bias_grad(const float *dy, pc_idx N, int G, int g)
{
    double s = 0.0;
    for (pc_idx r = 0; r < N; r++)
        s += dy[r * G + g];
    return (float)s;
}

#endif /* PARCONV_PC_DENSE_H */
