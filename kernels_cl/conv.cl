/* conv2d: forward, dx, dw, db, and the fused conv2d + ReLU + maxpool2d forward.
 *
 * Shapes: x (N, C, H, W), w (O, C, K, K), b (O,), y and dy (N, O, P, Q),
 * P = (H + 2 pad - K) / stride + 1, Q likewise.
 *
 * Forward and dx share one direct-convolution tile routine (conv_tile). A work-group
 * owns a tile of BO filters x TP output rows x TQ output columns; for each chunk of CB
 * input channels it stages the input patch the tile reads and the BO x CB x K x K
 * weights in local memory, then every work-item runs 8 x 8 register micro-kernels
 * (8 filters x 8 output columns) out of local memory. Partial sums live in local
 * memory between chunks, so each output is reduced in a fixed order (deterministic).
 * dx is the same routine run on dy, dilated by the stride, against the flipped and
 * transposed weights (see conv2d_flip_weights). Tile shapes are chosen by the host per
 * device and per call; they are kernel arguments, the work-group size TILE_WG is a
 * build option.
 *
 * What these kernels rely on, and no more than OpenCL 1.2 promises: every barrier is
 * reached by all work-items of the group the same number of times (loop bounds are
 * kernel arguments or group ids); local memory keeps its contents across barriers of one
 * launch; every local element read was written earlier in the same launch (the first
 * channel chunk starts its sums from zero registers, not from cs); the local buffers the
 * host passes fit the device (checked before enqueueing). A driver that gets a K = 7
 * convolution wrong with these is at fault; OpenCLBackend.verify() checks that case.
 */
#include "common.h"

/* Patch layout: the patch column ic (input column q0 * stride - pad + ic) is stored at
 * (ic % stride) * pws + ic / stride, so the eight inputs of eight consecutive output
 * columns are consecutive in local memory for every stride ("phase-major" layout). */

/* Stage one input row of the patch. x_row points at the (undilated) input row, or is
 * unused when the row is padding. */
inline void load_patch_row(__global const float* restrict x_row, const bool row_ok,
                           const int w_origin, const int Wd, const int W, const int dil,
                           const int stride, const int pwc, const int pws,
                           __local float* restrict dst)
{
    if (!row_ok) {
        for (int i = 0; i < stride * pws; ++i) dst[i] = 0.0f;
        return;
    }
    if (stride == 1 && dil == 1) {
        /* contiguous: zeros, a straight copy, zeros */
        const int lo = ICLAMP(-w_origin, 0, pwc), hi = ICLAMP(W - w_origin, lo, pwc);
        for (int i = 0; i < lo; ++i) dst[i] = 0.0f;
        for (int i = lo; i < hi; ++i) dst[i] = x_row[w_origin + i];
        for (int i = hi; i < pws; ++i) dst[i] = 0.0f;
        return;
    }
    int ph = 0, m = 0;
    for (int ic = 0; ic < pwc; ++ic) {
        const int wd = w_origin + ic;
        float v = 0.0f;
        if (wd >= 0 && wd < Wd && (dil == 1 || wd % dil == 0)) v = x_row[wd / dil];
        dst[ph * pws + m] = v;
        if (++ph == stride) { ph = 0; ++m; }
    }
}

/* One 8 x 8 micro-tile of conv_tile: filters og*8.., output row r, columns qg*8..,
 * accumulated over the ncb staged channels into cs. */
inline void conv_micro(__local const float* restrict patch, __local const float* restrict wt,
                       __local float* restrict cs, const int og, const int r, const int qg,
                       const int first, const int ncb, const int K, const int stride, const int bo,
                       const int tp, const int tq, const int ph_rows, const int pws, const int rl)
{
    const int KK = K * K, plane = tp * tq;
    __local float* cp = cs + (og * 8 * tp + r) * tq + qg * 8;
    MICRO_DECL;
    if (first) {
        acc0 = acc1 = acc2 = acc3 = acc4 = acc5 = acc6 = acc7 = (float8)(0.0f);
    } else {
        MICRO_LOAD(cp, plane);
    }
    if (stride == 1) {
        /* the common case: consecutive taps are consecutive patch columns */
        for (int c = 0; c < ncb; ++c) {
            for (int kh = 0; kh < K; ++kh) {
                __local const float* prow = patch + (c * ph_rows + r + kh) * rl + qg * 8;
                __local const float* wrow = wt + (c * KK + kh * K) * bo + og * 8;
                for (int kw = 0; kw < K; ++kw) {
                    const float8 b = LD8(prow + kw);
                    const float8 a = LD8(wrow + kw * bo);
                    MICRO_FMA(a, b);
                }
            }
        }
    } else {
        for (int c = 0; c < ncb; ++c) {
            for (int kh = 0; kh < K; ++kh) {
                __local const float* prow = patch + (c * ph_rows + r * stride + kh) * rl + qg * 8;
                __local const float* wrow = wt + (c * KK + kh * K) * bo + og * 8;
                int ph = 0, m = 0;
                for (int kw = 0; kw < K; ++kw) {
                    const float8 b = LD8(prow + ph * pws + m);
                    const float8 a = LD8(wrow + kw * bo);
                    MICRO_FMA(a, b);
                    if (++ph == stride) { ph = 0; ++m; }
                }
            }
        }
    }
    MICRO_STORE(cp, plane);
}

/* One work-group computes cs[BO][TP][TQ] = sum over c, kh, kw of
 * w[o0 + o, c, kh, kw] * xd[n, c, (p0 + r) * stride - pad + kh, (q0 + q) * stride - pad + kw]
 * where xd is x dilated by dil (dil - 1 zeros between elements; dil = 1 for a plain conv).
 * bo and tq are multiples of 8. Local buffers (sizes from the host):
 *   patch  cb * ((tp - 1) * stride + K) * stride * (tq + (K - 1) / stride)
 *   wt     cb * K * K * bo
 *   cs     bo * tp * tq
 * Must be called by every work-item of the group. */
inline void conv_tile(__global const float* restrict x,   /* IN  (N, C, H, W) */
                      __global const float* restrict w,   /* IN  (O, C, K, K) */
                      const int C, const int H, const int W, const int O, const int K,
                      const int stride, const int pad, const int dil,
                      const int n, const int o0, const int p0, const int q0,
                      const int bo, const int tp, const int tq, const int cb,
                      __local float* restrict patch, __local float* restrict wt,
                      __local float* restrict cs)                 /* OUT (bo, tp, tq) */
{
    const int lid = get_local_id(0);
    const int KK = K * K;
    const int ph_rows = (tp - 1) * stride + K;
    const int pwc = (tq - 1) * stride + K;
    const int pws = tq + (K - 1) / stride;
    const int rl = stride * pws;
    const int Hd = (H - 1) * dil + 1, Wd = (W - 1) * dil + 1;
    const int h_origin = p0 * stride - pad, w_origin = q0 * stride - pad;
#if TILE_WG > 1
    const int nmt = (bo / 8) * tp * (tq / 8);
#endif

    /* cs needs no clearing: the first chunk's micro-tiles start from zero registers */
    for (int c0 = 0; c0 < C; c0 += cb) {
        const int ncb = IMIN(cb, C - c0);
        for (int rr = lid; rr < ncb * ph_rows; rr += TILE_WG) {
            const int c = rr / ph_rows, ih = rr - c * ph_rows;
            const int hd = h_origin + ih;
            const bool row_ok = hd >= 0 && hd < Hd && (dil == 1 || hd % dil == 0);
            __global const float* x_row = x + ((size_t)(n * C + c0 + c) * H + (row_ok ? hd / dil : 0)) * W;
            load_patch_row(x_row, row_ok, w_origin, Wd, W, dil, stride, pwc, pws, patch + rr * rl);
        }
        for (int e = lid; e < bo * ncb; e += TILE_WG) {
            const int o = e / ncb, c = e - o * ncb;
            if (o0 + o < O) {
                __global const float* src = w + ((size_t)(o0 + o) * C + c0 + c) * KK;
                for (int t = 0; t < KK; ++t) wt[(c * KK + t) * bo + o] = src[t];
            } else {
                for (int t = 0; t < KK; ++t) wt[(c * KK + t) * bo + o] = 0.0f;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* micro-tiles (og, r, qg) in order, dealt round-robin to the work-items */
#if TILE_WG == 1
        for (int og = 0; og < bo / 8; ++og)
            for (int r = 0; r < tp; ++r)
                for (int qg = 0; qg < tq / 8; ++qg)
                    conv_micro(patch, wt, cs, og, r, qg, c0 == 0, ncb, K, stride, bo, tp, tq, ph_rows, pws, rl);
#else
        for (int mt = lid; mt < nmt; mt += TILE_WG) {
            const int qg = mt % (tq / 8), rest = mt / (tq / 8);
            conv_micro(patch, wt, cs, rest / tp, rest % tp, qg, c0 == 0, ncb, K, stride, bo, tp, tq, ph_rows,
                       pws, rl);
        }
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

/* y = conv(x, w) + b, or (dx mode) the conv of a dilated input without bias.
 * Launch: local (TILE_WG, 1, 1), global (tiles_q * TILE_WG, tiles_p, N * tiles_o). */
__kernel void conv2d_direct(__global const float* restrict x,    /* IN  (N, C, H, W) */
                            __global const float* restrict w,    /* IN  (O, C, K, K) */
                            __global const float* restrict b,    /* IN  (O,), read when has_bias */
                            __global float* restrict y,          /* OUT (N, O, P, Q), overwritten */
                            const int C, const int H, const int W, const int O, const int P, const int Q,
                            const int K, const int stride, const int pad, const int dil, const int has_bias,
                            const int bo, const int tp, const int tq, const int cb, const int tiles_o,
                            __local float* patch, __local float* wt, __local float* cs)
{
    const int lid = get_local_id(0);
    const int q0 = get_group_id(0) * tq, p0 = get_group_id(1) * tp;
    const int n = get_group_id(2) / tiles_o, o0 = (get_group_id(2) % tiles_o) * bo;
    conv_tile(x, w, C, H, W, O, K, stride, pad, dil, n, o0, p0, q0, bo, tp, tq, cb, patch, wt, cs);
    const int rows = IMIN(tp, P - p0), cols = IMIN(tq, Q - q0);
    for (int orow = lid; orow < bo * tp; orow += TILE_WG) {
        const int o = orow / tp, r = orow - o * tp;
        if (o0 + o >= O || r >= rows) continue;
        const float bias = has_bias ? b[o0 + o] : 0.0f;
        __local const float* src = cs + orow * tq;
        __global float* dst = y + ((size_t)(n * O + o0 + o) * P + p0 + r) * Q + q0;
        for (int q = 0; q < cols; ++q) dst[q] = src[q] + bias;
    }
}

/* maxpool2d(relu(conv2d(x) + b)) without writing the conv output: each tile covers the
 * conv rows and columns of TPP x TQQ pooled outputs. argmax indexes the (P, Q) conv plane,
 * the first maximum of z = conv + b in window order, as maxpool2d_forward does on z.
 * Launch as conv2d_direct, with tiles counted in pooled outputs. */
__kernel void conv2d_relu_maxpool2d_forward(
        __global const float* restrict x,    /* IN  (N, C, H, W) */
        __global const float* restrict w,    /* IN  (O, C, K, K) */
        __global const float* restrict b,    /* IN  (O,), read when has_bias */
        __global float* restrict y,          /* OUT (N, O, PP, QQ) pooled, overwritten */
        __global int* restrict argmax,       /* OUT (N, O, PP, QQ), overwritten */
        const int C, const int H, const int W, const int O, const int P, const int Q,
        const int K, const int stride, const int pad, const int has_bias,
        const int pk, const int ps, const int PP, const int QQ, const int tpp, const int tqq,
        const int bo, const int tp, const int tq, const int cb, const int tiles_o,
        __local float* patch, __local float* wt, __local float* cs)
{
    const int lid = get_local_id(0);
    const int qq0 = get_group_id(0) * tqq, pp0 = get_group_id(1) * tpp;
    const int n = get_group_id(2) / tiles_o, o0 = (get_group_id(2) % tiles_o) * bo;
    const int p0 = pp0 * ps, q0 = qq0 * ps;
    conv_tile(x, w, C, H, W, O, K, stride, pad, 1, n, o0, p0, q0, bo, tp, tq, cb, patch, wt, cs);
    const int prow = IMIN(tpp, PP - pp0), pcol = IMIN(tqq, QQ - qq0);
    for (int orow = lid; orow < bo * tpp; orow += TILE_WG) {
        const int o = orow / tpp, rr = orow - o * tpp;
        if (o0 + o >= O || rr >= prow) continue;
        const float bias = has_bias ? b[o0 + o] : 0.0f;
        __local const float* plane = cs + o * tp * tq;
        const size_t out = ((size_t)(n * O + o0 + o) * PP + pp0 + rr) * QQ + qq0;
        for (int qq = 0; qq < pcol; ++qq) {
            /* the window scanned in order; bi is the flat index in the (P, Q) conv plane */
            __local const float* win = plane + (rr * ps) * tq + qq * ps;
            const int i0 = (p0 + rr * ps) * Q + q0 + qq * ps;
            float best = win[0] + bias;
            int bi = i0, nan = 0;
            if (pk == 2) {
                ARGMAX_STEP_FAST(win[1] + bias, i0 + 1, best, bi, nan);
                ARGMAX_STEP_FAST(win[tq] + bias, i0 + Q, best, bi, nan);
                ARGMAX_STEP_FAST(win[tq + 1] + bias, i0 + Q + 1, best, bi, nan);
            } else {
                for (int i = 0; i < pk; ++i)
                    for (int j = 0; j < pk; ++j)
                        ARGMAX_STEP_FAST(win[i * tq + j] + bias, i0 + i * Q + j, best, bi, nan);
            }
            if (nan) {
                best = win[0] + bias;
                bi = i0;
                for (int i = 0; i < pk; ++i)
                    for (int j = 0; j < pk; ++j) ARGMAX_STEP(win[i * tq + j] + bias, i0 + i * Q + j, best, bi);
            }
            y[out + qq] = (best > 0.0f || IS_NAN(best)) ? best : 0.0f;
            argmax[out + qq] = bi;
        }
    }
}

/* wt[c, o, kh, kw] = w[o, c, K - 1 - kh, K - 1 - kw]: the weights of the dx convolution. */
__kernel void conv2d_flip_weights(__global const float* restrict w,   /* IN  (O, C, K, K) */
                                  __global float* restrict wt,        /* OUT (C, O, K, K) */
                                  const int O, const int C, const int K)
{
    const int i = get_global_id(0);
    const int KK = K * K;
    if (i >= O * C * KK) return;
    const int t = i % KK, c = (i / KK) % C, o = i / (KK * C);
    wt[((size_t)c * O + o) * KK + (KK - 1 - t)] = w[i];
}

/* dw[o, c, kh, kw] = sum over n, p, q of dy[n, o, p, q] * x[n, c, p s - pad + kh, q s - pad + kw].
 *
 * A work-group owns BO filters x CBW channels (all K x K taps) and runs through its share
 * of the images (n_begin..n_end, one split) in chunks of TP output rows. Per chunk it
 * stages dy[n, o-block, rows, :] and the matching input patch in local memory; every
 * micro-kernel keeps 8 filters x 1 tap as float8 lanes over 8 output columns, so the
 * loads are contiguous for every stride (phase-major patch). Lane partial sums stay in
 * local memory; the lanes are added in a fixed order at the end (deterministic).
 * Writes dw_part[split] (O, C, K, K); with several splits conv2d_sum_splits adds them.
 * Launch: local (TILE_WG,1,1), global (tiles_c * TILE_WG, tiles_o, splits). Local buffers:
 *   patch  cbw * ((tp - 1) * stride + K) * stride * (q8 + (K - 1) / stride)
 *   dyt    bo * tp * q8
 *   cs     bo * cbw * K * K * 8 */
__kernel void conv2d_backward_weight(__global const float* restrict x,    /* IN  (N, C, H, W) */
                                     __global const float* restrict dy,   /* IN  (N, O, P, Q) */
                                     __global float* restrict dw_part,    /* OUT (splits, O, C, K, K) */
                                     const int N, const int C, const int H, const int W,
                                     const int O, const int P, const int Q, const int K,
                                     const int stride, const int pad,
                                     const int bo, const int cbw, const int tp, const int q8,
                                     const int n_per_split,
                                     __local float* patch, __local float* dyt, __local float* cs)
{
    const int lid = get_local_id(0);
    const int c0 = get_group_id(0) * cbw, o0 = get_group_id(1) * bo, split = get_group_id(2);
    const int KK = K * K;
    const int ncb = IMIN(cbw, C - c0);
    const int ntaps = ncb * KK;
    const int nmt = (bo / 8) * ntaps;
    const int ph_rows = (tp - 1) * stride + K;
    const int pwc = (q8 - 1) * stride + K;
    const int pws = q8 + (K - 1) / stride;
    const int rl = stride * pws;
    const int n_begin = split * n_per_split, n_end = IMIN(N, n_begin + n_per_split);

    for (int e = lid; e < nmt * 64; e += TILE_WG) cs[e] = 0.0f;

    for (int n = n_begin; n < n_end; ++n) {
        for (int p0 = 0; p0 < P; p0 += tp) {
            barrier(CLK_LOCAL_MEM_FENCE);
            for (int rr = lid; rr < bo * tp; rr += TILE_WG) {
                const int o = rr / tp, r = rr - o * tp;
                __local float* dst = dyt + rr * q8;
                if (o0 + o < O && p0 + r < P) {
                    __global const float* src = dy + ((size_t)(n * O + o0 + o) * P + p0 + r) * Q;
                    for (int q = 0; q < Q; ++q) dst[q] = src[q];
                    for (int q = Q; q < q8; ++q) dst[q] = 0.0f;
                } else {
                    for (int q = 0; q < q8; ++q) dst[q] = 0.0f;
                }
            }
            const int h_origin = p0 * stride - pad;
            for (int rr = lid; rr < ncb * ph_rows; rr += TILE_WG) {
                const int c = rr / ph_rows, ih = rr - c * ph_rows;
                const int h = h_origin + ih;
                const bool row_ok = h >= 0 && h < H;
                __global const float* x_row = x + ((size_t)(n * C + c0 + c) * H + (row_ok ? h : 0)) * W;
                load_patch_row(x_row, row_ok, -pad, W, W, 1, stride, pwc, pws, patch + rr * rl);
            }
            barrier(CLK_LOCAL_MEM_FENCE);

            const int rows = IMIN(tp, P - p0);
            for (int mt = lid; mt < nmt; mt += TILE_WG) {
                const int og = mt / ntaps, tap = mt - og * ntaps;
                const int c = tap / KK, kh = (tap % KK) / K, kw = tap % K;
                __local const float* xp = patch + (c * ph_rows + kh) * rl + (kw % stride) * pws + kw / stride;
                __local const float* dp = dyt + og * 8 * tp * q8;
                __local float* cp = cs + mt * 64;
                MICRO_DECL;
                MICRO_LOAD(cp, 8);
                for (int r = 0; r < rows; ++r) {
                    for (int qg = 0; qg < q8; qg += 8) {
                        const float8 xb = LD8(xp + r * stride * rl + qg);
                        __local const float* d = dp + r * q8 + qg;
                        const int ld = tp * q8;
                        acc0 += LD8(d + 0 * ld) * xb; acc1 += LD8(d + 1 * ld) * xb;
                        acc2 += LD8(d + 2 * ld) * xb; acc3 += LD8(d + 3 * ld) * xb;
                        acc4 += LD8(d + 4 * ld) * xb; acc5 += LD8(d + 5 * ld) * xb;
                        acc6 += LD8(d + 6 * ld) * xb; acc7 += LD8(d + 7 * ld) * xb;
                    }
                }
                MICRO_STORE(cp, 8);
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __global float* out = dw_part + (size_t)split * O * C * KK;
    for (int e = lid; e < bo * ntaps; e += TILE_WG) {
        const int o = e / ntaps, tap = e - o * ntaps;
        if (o0 + o >= O) continue;
        const int mt = (o / 8) * ntaps + tap;
        out[((size_t)(o0 + o) * C + c0) * KK + tap] = hsum8(LD8(cs + mt * 64 + (o % 8) * 8));
    }
}

/* out[i] = sum over s of part[s, i], in split order. */
__kernel void conv2d_sum_splits(__global const float* restrict part,  /* IN  (splits, len) */
                                __global float* restrict out,         /* OUT (len,) overwritten */
                                const int splits, const int len)
{
    const int i = get_global_id(0);
    if (i >= len) return;
    float s = 0.0f;
    for (int k = 0; k < splits; ++k) s += part[(size_t)k * len + i];
    out[i] = s;
}

/* db[o] = sum over n, p, q of dy[n, o, p, q]; one work-group of RED_WG per filter, each
 * work-item summing whole (contiguous) planes, then a fixed-order tree.
 * Launch: local (RED_WG,), global (O * RED_WG,). */
__kernel void conv2d_backward_bias(__global const float* restrict dy,   /* IN  (N, O, P, Q) */
                                   __global float* restrict db,         /* OUT (O,) overwritten */
                                   const int N, const int O, const int PQ)
{
    __local float scratch[RED_WG];
    const int o = get_group_id(0), lid = get_local_id(0);
    float s = 0.0f;
    RED_FOR(n, lid, RED_WG, N) s += sum_contiguous(dy + ((size_t)n * O + o) * PQ, PQ);
    s = wg_sum_float(scratch, s);
    if (lid == 0) db[o] = s;
}

/* ------------------------------------------------------------- general conv2d
 * Groups, dilation, rectangular kernels, (h, w) strides and asymmetric padding (depthwise is
 * Cg == 1). Shapes: x (N, C, H, W), w (O, Cg, KH, KW) with Cg = C / G, y and dy (N, O, P, Q);
 * filter o belongs to group o / Og (Og = O / G) and reads its channels g Cg .. g Cg + Cg.
 * Output (p, q) of tap (kh, kw) reads input (p SH + kh DH - PT, q SW + kw DW - PL).
 * Direct loops, every sum in a fixed order; no atomics. */

/* y: one work-item per output element. Launch: global (N * O * P * Q,) rounded up. */
__kernel void conv2d_general_forward(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                     __global const float* restrict w,   /* IN  (O, Cg, KH, KW) */
                                     __global const float* restrict b,   /* IN  (O,), read when use_bias */
                                     __global float* restrict y,         /* OUT (N, O, P, Q) */
                                     const int N, const int C, const int H, const int W, const int O,
                                     const int Cg, const int KH, const int KW, const int P, const int Q,
                                     const int SH, const int SW, const int PT, const int PL, const int DH,
                                     const int DW, const int Og, const int use_bias)
{
    const int i = get_global_id(0);
    if (i >= N * O * P * Q) return;
    const int q = i % Q, p = (i / Q) % P, o = (i / (P * Q)) % O, n = i / (O * P * Q);
    const int g = o / Og, h0 = p * SH - PT, w0 = q * SW - PL;
    float s = use_bias ? b[o] : 0.0f;
    for (int c = 0; c < Cg; ++c) {
        __global const float* xc = x + ((size_t)n * C + g * Cg + c) * H * W;
        __global const float* wc = w + ((size_t)o * Cg + c) * KH * KW;
        for (int kh = 0; kh < KH; ++kh) {
            const int h = h0 + kh * DH;
            if (h < 0 || h >= H) continue;
            for (int kw = 0; kw < KW; ++kw) {
                const int ww = w0 + kw * DW;
                if (ww >= 0 && ww < W) s = fma(wc[kh * KW + kw], xc[(size_t)h * W + ww], s);
            }
        }
    }
    y[i] = s;
}

/* dx: one work-item per input element, gathering the outputs whose taps read it (each tap
 * (kh, kw) names at most one output position). Launch: global (N * C * H * W,) rounded up. */
__kernel void conv2d_general_backward_input(__global const float* restrict dy,  /* IN  (N, O, P, Q) */
                                            __global const float* restrict w,   /* IN  (O, Cg, KH, KW) */
                                            __global float* restrict dx,        /* OUT (N, C, H, W) */
                                            const int N, const int C, const int H, const int W, const int O,
                                            const int Cg, const int KH, const int KW, const int P, const int Q,
                                            const int SH, const int SW, const int PT, const int PL,
                                            const int DH, const int DW, const int Og)
{
    const int i = get_global_id(0);
    if (i >= N * C * H * W) return;
    const int ww = i % W, h = (i / W) % H, c = (i / (H * W)) % C, n = i / (C * H * W);
    const int g = c / Cg, cg = c - g * Cg;
    float s = 0.0f;
    for (int og = 0; og < Og; ++og) {
        const int o = g * Og + og;
        __global const float* dyo = dy + ((size_t)n * O + o) * P * Q;
        __global const float* wo = w + ((size_t)o * Cg + cg) * KH * KW;
        for (int kh = 0; kh < KH; ++kh) {
            const int ph = h + PT - kh * DH;  /* p SH */
            if (ph < 0 || ph % SH) continue;
            const int p = ph / SH;
            if (p >= P) continue;
            for (int kw = 0; kw < KW; ++kw) {
                const int qw = ww + PL - kw * DW;
                if (qw < 0 || qw % SW) continue;
                const int q = qw / SW;
                if (q < Q) s = fma(wo[kh * KW + kw], dyo[(size_t)p * Q + q], s);
            }
        }
    }
    dx[i] = s;
}

/* dw: one work-group of RED_WG per weight element; its work-items take images n (RED_FOR)
 * and the group adds their sums in a fixed-order tree. Launch: local (RED_WG,),
 * global (O * Cg * KH * KW * RED_WG,). */
__kernel void conv2d_general_backward_weight(__global const float* restrict x,   /* IN  (N, C, H, W) */
                                             __global const float* restrict dy,  /* IN  (N, O, P, Q) */
                                             __global float* restrict dw,        /* OUT (O, Cg, KH, KW) */
                                             const int N, const int C, const int H, const int W, const int O,
                                             const int Cg, const int KH, const int KW, const int P, const int Q,
                                             const int SH, const int SW, const int PT, const int PL,
                                             const int DH, const int DW, const int Og)
{
    __local float scratch[RED_WG];
    const int e = get_group_id(0), lid = get_local_id(0);
    const int kw = e % KW, kh = (e / KW) % KH, cg = (e / (KH * KW)) % Cg, o = e / (Cg * KH * KW);
    const int c = (o / Og) * Cg + cg;
    /* output rows and columns whose tap (kh, kw) lies inside the input */
    const int offh = kh * DH - PT, offw = kw * DW - PL;
    const int p_lo = offh >= 0 ? 0 : (-offh + SH - 1) / SH;
    const int p_hi = IMIN(P, H - 1 - offh >= 0 ? (H - 1 - offh) / SH + 1 : 0);
    const int q_lo = offw >= 0 ? 0 : (-offw + SW - 1) / SW;
    const int q_hi = IMIN(Q, W - 1 - offw >= 0 ? (W - 1 - offw) / SW + 1 : 0);
    float s = 0.0f;
    RED_FOR(n, lid, RED_WG, N) {
        __global const float* xc = x + ((size_t)n * C + c) * H * W;
        __global const float* dyo = dy + ((size_t)n * O + o) * P * Q;
        for (int p = p_lo; p < p_hi; ++p) {
            __global const float* xr = xc + (size_t)(p * SH + offh) * W + offw;
            __global const float* gr = dyo + (size_t)p * Q;
            for (int q = q_lo; q < q_hi; ++q) s = fma(gr[q], xr[q * SW], s);
        }
    }
    s = wg_sum_float(scratch, s);
    if (lid == 0) dw[e] = s;
}
