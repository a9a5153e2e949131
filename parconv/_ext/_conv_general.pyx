# Shape legend: N batch, C in-channels, O out-channels, G groups (Cg = C / G, Og = O / G),
# H, W input, P, Q output, KH x KW kernel, SH, SW strides, DH, DW dilation, PT, PL the
# top/left padding; KK = KH * KW, CgKK = Cg * KK the GEMM depth of one group.
"""General conv2d kernels (conv2d_general, depthwise, pointwise): groups, dilation, rectangular kernels,
(h, w) strides, asymmetric padding, and the 1x1 GEMM. Square kernels with one stride and symmetric
padding otherwise run in ``_conv``.

The paths (``pc_conv_general.h``):

* depthwise 3x3 (``Cg == 1``), dilation 1, strides 1 or 2 (:func:`depthwise_path` says
  ``"direct3x3"``): each plane copied once into zero-padded thread-private scratch, then
  stride 1 as one loop over the padded grid and stride 2 as row loops, the nine taps in
  registers; the ReLU optionally applied as it stores. The backward (multiplier 1, padding
  <= 2) does dx and dw of each plane together: dx is the same kernel on dy, dilated by the
  strides, with the flipped filter; dw sums three taps at a time in 16-lane vectors, and
  each plane's sums are added over the images in order in double afterwards.
* other depthwise shapes: no im2col. Each plane is zero-padded (and split into its stride
  phases) in thread-private scratch, so every tap is one contiguous vector loop over the
  plane. Forward and dx run one plane per chunk (dx of a strided layer on direct row
  loops); dw runs one filter per chunk and adds the images in order, in double, so its bits
  do not depend on the thread count.
* pointwise (1x1, stride 1, no padding; :func:`pointwise_forward`,
  :func:`pointwise_backward_input`): one GEMM per image on 8 filters x 32 positions of
  16-lane accumulators, the per-filter scale, bias and ReLU applied as it stores; each output
  one in-order sum over the channels.
* everything else: per (image, group) an im2col matrix in thread-private scratch and
  ``scipy.linalg.cython_blas.sgemm`` (row-major matrices go to the column-major BLAS as
  their transposes); dx is the col2im of ``w^T @ dy``. dw partial sums live in one buffer
  per part of a fixed split of the items, added in part order (a thread count always gives
  the same bits, whichever thread takes a part). The caller
  limits the BLAS to one thread: every sgemm here runs inside an OpenMP parallel region.

Inputs are trusted: shapes, dtypes and contiguity are validated in Python.
"""

from cython.parallel cimport parallel, prange
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from scipy.linalg.cython_blas cimport sgemm
from .pc_helpers cimport (pc_threads_for, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_product_ns, pc_get_region_ns, pc_set_region_ns, pc_sync,
    pc_sync_init, pc_sync_wait)

cdef extern from "pc_common.h":
    double pc_sum_f32(const float *p, Py_ssize_t n) noexcept nogil

cdef extern from "pc_conv_general.h":
    void pcg_im2col(const float *x, int Cg, int H, int W, int KH, int KW, int SH, int SW, int DH, int DW,
                    int PT, int PL, int P, int Q, float *cols) noexcept nogil
    void pcg_col2im(const float *dcols, int Cg, int H, int W, int KH, int KW, int SH, int SW, int DH, int DW,
                    int PT, int PL, int P, int Q, float *dx) noexcept nogil
    void pcg_dw_backward_input_plane(const float *dy, const float *w, int M, int H, int W, int KH, int KW,
                                     int SH, int SW, int DH, int DW, int PT, int PL, int P, int Q,
                                     float *dx) noexcept nogil
    Py_ssize_t pcg_flat_scratch(int P, int Q, int KH, int KW, int SH, int SW, int DH, int DW) noexcept nogil
    void pcg_dw_flat_plane(const float *inp, Py_ssize_t in_stride, const float *k, Py_ssize_t k_stride, int nin,
                           int flip, float bias, int H, int W, int KH, int KW, int SH, int SW, int DH, int DW,
                           int PT, int PL, int P, int Q, float *scratch, float *out) noexcept nogil
    void pcg_dw_flat_weight_plane(const float *x, const float *dy, int H, int W, int KH, int KW, int SH, int SW,
                                  int DH, int DW, int PT, int PL, int P, int Q, float *scratch,
                                  double *dw) noexcept nogil
    Py_ssize_t pcg_dw3_fwd_scratch(int P, int Q, int SH, int SW) noexcept nogil
    void pcg_dw3_forward_plane(const float *x, int H, int W, const float *k, float bias, int relu, int SH, int SW,
                               int PT, int PL, int P, int Q, float *scratch, float *out) noexcept nogil
    Py_ssize_t pcg_dw3_dx_scratch(int H, int W, int P, int Q, int SH, int SW) noexcept nogil
    void pcg_dw3_dx_plane(const float *dy, int P, int Q, const float *k, int H, int W, int SH, int SW, int PT,
                          int PL, float *scratch, float *dx) noexcept nogil
    Py_ssize_t pcg_dw3_dw_scratch(int P, int Q, int SH, int SW) noexcept nogil
    void pcg_dw3_dw_plane(const float *x, const float *dy, int H, int W, int SH, int SW, int PT, int PL, int P,
                          int Q, float *scratch, double *dw) noexcept nogil
    void pcg_pw_cols(const float *w, const float *x, int C, int O, Py_ssize_t S, Py_ssize_t s0, Py_ssize_t s1,
                     const float *b, const float *scale, int relu, float *pack, float *y) noexcept nogil


cdef enum:
    PCG_DW_PLANE_NS = 40  # a depthwise plane's fixed cost in its kernel call, for pc_work


cdef inline bint _direct3(int KH, int KW, int SH, int SW, int DH, int DW) noexcept nogil:
    """The direct 3x3 kernels' case: dilation 1, strides 1 or 2."""
    return KH == 3 and KW == 3 and DH == 1 and DW == 1 and (SH == 1 or SH == 2) and (SW == 1 or SW == 2)


def depthwise_path(int KH, int KW, int SH, int SW, int DH, int DW):
    """Which kernels a depthwise convolution of these filter sizes, strides and dilations runs on:
    ``"direct3x3"`` (row loops on the padded plane) or ``"planes"`` (taps on the padded plane's
    stride phases, every other shape)."""
    return "direct3x3" if _direct3(KH, KW, SH, SW, DH, DW) else "planes"


cdef inline float _bias_one(const float *dyp, int N, int O, Py_ssize_t PQ, Py_ssize_t o) noexcept nogil:
    """db[o]: the sum over images of each dy plane's sum (double, images in order)."""
    cdef Py_ssize_t n
    cdef double s = 0.0
    for n in range(N):
        s = s + pc_sum_f32(dyp + (n * O + o) * PQ, PQ)
    return <float>s


cdef void _bias_sum(const float *dyp, int N, int O, Py_ssize_t PQ, float *dbp, int nt) noexcept nogil:
    """db (O,) by _bias_one, filters split over the threads."""
    cdef Py_ssize_t o
    for o in prange(O, schedule="guided", num_threads=pc_cap(pc_threads_for(<Py_ssize_t>N * O * PQ, O, nt))):
        dbp[o] = _bias_one(dyp, N, O, PQ, o)


cdef inline double _dw_work(Py_ssize_t planes, Py_ssize_t HW, Py_ssize_t PQ, Py_ssize_t KK) noexcept nogil:
    """pc_work's estimate of one depthwise pass: a plane's fixed cost, its padded copy and its taps
    (on these small planes the kernels run far below the convolution rate)."""
    return planes * PCG_DW_PLANE_NS + pc_elems_ns(<double>planes * (HW + PQ * KK / 4))


def depthwise_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                      const float[:, :, :, ::1] w,  # IN  (O, 1, KH, KW), O = C * M
                      const float[::1] b,           # IN  (O,) or None
                      float[:, :, :, ::1] y,        # OUT (N, O, P, Q), overwritten
                      int SH, int SW, int PT, int PL, int DH, int DW, int num_threads, bint relu=False):
    """Depthwise convolution (groups == C): filter o reads channel o // (O / C); ``relu`` applies the
    ReLU as it stores (an eval-mode BatchNorm is folded into w and b by the caller)."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], KH = w.shape[2], KW = w.shape[3], P = y.shape[2], Q = y.shape[3]
    cdef int M = O // C
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q, KK = <Py_ssize_t>KH * KW
    cdef Py_ssize_t planes = <Py_ssize_t>N * O
    cdef int nt = pc_threads_for(planes * PQ * KK, planes, num_threads)
    pc_work(_dw_work(planes, HW, PQ, KK))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef const float *bp = NULL if b is None else &b[0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef Py_ssize_t i, n, o, k
    cdef float *scratch = NULL
    cdef int failed[1]
    failed[0] = 0
    if _direct3(KH, KW, SH, SW, DH, DW):
        with nogil, parallel(num_threads=pc_cap(nt)):
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_dw3_fwd_scratch(P, Q, SH, SW))
            for i in prange(planes, schedule="guided"):
                if scratch == NULL:
                    failed[0] = 1
                    continue
                n = i // O
                o = i - n * O
                pcg_dw3_forward_plane(xp + (n * C + o // M) * HW, H, W, wp + o * KK, 0.0 if bp == NULL else bp[o],
                                      relu, SH, SW, PT, PL, P, Q, scratch, yp + i * PQ)
            free(scratch)
        if failed[0]:
            raise MemoryError("depthwise_forward: could not allocate scratch")
        return
    # every other shape: whole-plane taps on the padded plane's phases (pc_conv_general.h)
    with nogil, parallel(num_threads=pc_cap(nt)):
        scratch = <float *>malloc(sizeof(float) * <size_t>pcg_flat_scratch(P, Q, KH, KW, SH, SW, DH, DW))
        for i in prange(planes, schedule="guided"):
            if scratch == NULL:
                failed[0] = 1
                continue
            n = i // O
            o = i - n * O
            pcg_dw_flat_plane(xp + (n * C + o // M) * HW, 0, wp + o * KK, 0, 1, 0, 0.0 if bp == NULL else bp[o],
                              H, W, KH, KW, SH, SW, DH, DW, PT, PL, P, Q, scratch, yp + i * PQ)
        free(scratch)
    if failed[0]:
        raise MemoryError("depthwise_forward: could not allocate scratch")
    if relu:
        with nogil:
            for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
                for k in range(PQ):
                    if yp[i * PQ + k] < 0.0:
                        yp[i * PQ + k] = 0.0


def depthwise_backward(const float[:, :, :, ::1] x,   # IN  (N, C, H, W)
                       const float[:, :, :, ::1] w,   # IN  (O, 1, KH, KW)
                       const float[:, :, :, ::1] dy,  # IN  (N, O, P, Q)
                       float[:, :, :, ::1] dx,        # OUT (N, C, H, W) or None, overwritten
                       float[:, :, :, ::1] dw,        # OUT (O, 1, KH, KW), overwritten
                       float[::1] db,                 # OUT (O,) or None, overwritten
                       int SH, int SW, int PT, int PL, int DH, int DW, int num_threads):
    """Gradients of :func:`depthwise_forward`: dx one input plane per chunk, dw one filter per chunk."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], KH = w.shape[2], KW = w.shape[3], P = dy.shape[2], Q = dy.shape[3]
    cdef int M = O // C
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q, KK = <Py_ssize_t>KH * KW
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = NULL if dx is None else &dx[0, 0, 0, 0]
    cdef float *dwp = &dw[0, 0, 0, 0]
    cdef double *acc = NULL
    cdef Py_ssize_t i, n, c, o, k
    cdef int failed[1]
    failed[0] = 0
    cdef int nt = pc_threads_for(<Py_ssize_t>N * O * PQ * KK, O, num_threads)
    cdef Py_ssize_t planes = <Py_ssize_t>N * O
    cdef int passes = 2 if dx is not None else 1  # dw, and dx
    pc_work(passes * _dw_work(planes, HW, PQ, KK))
    # the bottom/right padding the taps reach (floor mode may leave input rows unread)
    cdef int PB = (P - 1) * SH + DH * (KH - 1) + 1 - H - PT, PR = (Q - 1) * SW + DW * (KW - 1) + 1 - W - PL
    # dx as the stride-1 correlation of dy with the flipped kernels needs these paddings >= 0
    cdef int TT = DH * (KH - 1) - PT, TB = DH * (KH - 1) - PB, TL = DW * (KW - 1) - PL, TR = DW * (KW - 1) - PR
    cdef bint flat_dx = SH == 1 and SW == 1 and TT >= 0 and TB >= 0 and TL >= 0 and TR >= 0
    cdef bint direct = _direct3(KH, KW, SH, SW, DH, DW)
    cdef float *scratch = NULL
    cdef float *scratch2 = NULL
    cdef double *part = NULL
    cdef double sacc
    cdef float *dbp = NULL if db is None else &db[0]
    cdef pc_sync sync
    pc_sync_init(&sync)
    if direct and M == 1 and dxp != NULL and PT <= 2 and PL <= 2:
        # dx and dw of each plane together while it is in cache, parallel over planes; each plane's
        # dw sums kept apart and added over the images in order (the bits of the per-filter loop)
        part = <double *>calloc(<size_t>(N * C * KK), sizeof(double))
        if part == NULL:
            raise MemoryError("depthwise_backward: could not allocate scratch")
        nt = pc_threads_for(<Py_ssize_t>N * O * PQ * KK, <Py_ssize_t>N * C, num_threads)
        with nogil, parallel(num_threads=pc_cap(nt)):
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_dw3_dw_scratch(P, Q, SH, SW))
            scratch2 = <float *>malloc(sizeof(float) * <size_t>pcg_dw3_dx_scratch(H, W, P, Q, SH, SW))
            for i in prange(<Py_ssize_t>N * C, schedule="guided"):
                if scratch == NULL or scratch2 == NULL:
                    failed[0] = 1
                    continue
                c = i - (i // C) * C
                pcg_dw3_dw_plane(xp + i * HW, dyp + i * PQ, H, W, SH, SW, PT, PL, P, Q, scratch, part + i * KK)
                pcg_dw3_dx_plane(dyp + i * PQ, P, Q, wp + c * KK, H, W, SH, SW, PT, PL, scratch2, dxp + i * HW)
            free(scratch)
            free(scratch2)
            # in the same region (one wake-up): the planes' dw sums over the images, then db
            # (after a failed allocation these sum what is there; the caller raises)
            pc_sync_wait(&sync)
            for k in prange(<Py_ssize_t>C * KK, schedule="guided"):
                c = k // KK
                sacc = 0.0
                for n in range(N):
                    sacc = sacc + part[(n * C + c) * KK + (k - c * KK)]
                dwp[k] = <float>sacc
            pc_sync_wait(&sync)
            if dbp != NULL:
                for o in prange(O, schedule="guided"):
                    dbp[o] = _bias_one(dyp, N, O, PQ, o)
        free(part)
        if failed[0]:
            raise MemoryError("depthwise_backward: could not allocate scratch")
        return
    with nogil, parallel(num_threads=pc_cap(nt)):
        acc = <double *>malloc(sizeof(double) * KK)
        if direct:
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_dw3_dw_scratch(P, Q, SH, SW))
        else:
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_flat_scratch(P, Q, KH, KW, SH, SW, DH, DW))
        for o in prange(O, schedule="guided"):
            if acc == NULL or scratch == NULL:
                failed[0] = 1
                continue
            memset(acc, 0, sizeof(double) * KK)
            for n in range(N):
                if direct:
                    pcg_dw3_dw_plane(xp + (n * C + o // M) * HW, dyp + (n * O + o) * PQ, H, W, SH, SW, PT, PL, P,
                                     Q, scratch, acc)
                else:
                    pcg_dw_flat_weight_plane(xp + (n * C + o // M) * HW, dyp + (n * O + o) * PQ, H, W, KH, KW, SH,
                                             SW, DH, DW, PT, PL, P, Q, scratch, acc)
            for k in range(KK):
                dwp[o * KK + k] = <float>acc[k]
        free(acc)
        free(scratch)
    if failed[0]:
        raise MemoryError("depthwise_backward: could not allocate scratch")
    if dxp != NULL and direct and M == 1 and PT <= 2 and PL <= 2:
        # dx: dy (dilated by the strides) correlated with the flipped filters, on the direct kernel
        nt = pc_threads_for(<Py_ssize_t>N * O * PQ * KK, <Py_ssize_t>N * C, num_threads)
        with nogil, parallel(num_threads=pc_cap(nt)):
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_dw3_dx_scratch(H, W, P, Q, SH, SW))
            for i in prange(<Py_ssize_t>N * C, schedule="guided"):
                if scratch == NULL:
                    failed[0] = 1
                    continue
                c = i - (i // C) * C
                pcg_dw3_dx_plane(dyp + i * PQ, P, Q, wp + c * KK, H, W, SH, SW, PT, PL, scratch, dxp + i * HW)
            free(scratch)
        if failed[0]:
            raise MemoryError("depthwise_backward: could not allocate scratch")
    elif dxp != NULL and flat_dx:
        nt = pc_threads_for(<Py_ssize_t>N * O * PQ * KK, <Py_ssize_t>N * C, num_threads)
        with nogil, parallel(num_threads=pc_cap(nt)):
            scratch = <float *>malloc(sizeof(float) * <size_t>pcg_flat_scratch(H, W, KH, KW, 1, 1, DH, DW))
            for i in prange(<Py_ssize_t>N * C, schedule="guided"):
                if scratch == NULL:
                    failed[0] = 1
                    continue
                n = i // C
                c = i - n * C
                pcg_dw_flat_plane(dyp + (n * O + c * M) * PQ, PQ, wp + c * M * KK, KK, M, 1, 0.0, P, Q, KH, KW,
                                  1, 1, DH, DW, TT, TL, H, W, scratch, dxp + i * HW)
            free(scratch)
        if failed[0]:
            raise MemoryError("depthwise_backward: could not allocate scratch")
    elif dxp != NULL:
        nt = pc_threads_for(<Py_ssize_t>N * O * PQ * KK, <Py_ssize_t>N * C, num_threads)
        with nogil:
            for i in prange(<Py_ssize_t>N * C, schedule="guided", num_threads=pc_cap(nt)):
                n = i // C
                c = i - n * C
                memset(dxp + i * HW, 0, sizeof(float) * HW)
                pcg_dw_backward_input_plane(dyp + (n * O + c * M) * PQ, wp + c * M * KK, M, H, W, KH, KW,
                                            SH, SW, DH, DW, PT, PL, P, Q, dxp + i * HW)
    if db is not None:
        with nogil:
            _bias_sum(dyp, N, O, PQ, &db[0], num_threads)


def conv2d_general_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                           const float[:, :, :, ::1] w,  # IN  (O, Cg, KH, KW)
                           const float[::1] b,           # IN  (O,) or None
                           float[:, :, :, ::1] y,        # OUT (N, O, P, Q), overwritten
                           int SH, int SW, int PT, int PL, int DH, int DW, int groups, int num_threads):
    """y[n, group g] = w_g @ im2col(x[n, group g]) (+ b); one (image, group) per chunk."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3], P = y.shape[2], Q = y.shape[3]
    cdef int G = groups, Og = O // groups
    cdef int PQ = P * Q, CgKK = Cg * KH * KW
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, items = <Py_ssize_t>N * G
    cdef bint direct = KH == 1 and KW == 1 and SH == 1 and SW == 1 and PT == 0 and PL == 0 and P == H and Q == W
    cdef int nt = pc_threads_for(items * PQ * <Py_ssize_t>CgKK * Og, items, num_threads)
    pc_work(pc_conv_ns(<double>items * PQ * CgKK * Og))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef const float *bp = NULL if b is None else &b[0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef float *cols = NULL
    cdef const float *a
    cdef float *yg
    cdef float bo
    cdef char tN = b'N'
    cdef float one = 1.0, zero = 0.0
    cdef Py_ssize_t it, n, g, o, s
    cdef int failed[1]
    failed[0] = 0
    with nogil, parallel(num_threads=pc_cap(nt)):
        cols = NULL
        if not direct:
            cols = <float *>malloc(sizeof(float) * <size_t>CgKK * PQ)
        for it in prange(items, schedule="guided"):
            if not direct and cols == NULL:
                failed[0] = 1
                continue
            n = it // G
            g = it - n * G
            a = xp + (n * C + g * Cg) * HW
            if not direct:
                pcg_im2col(a, Cg, H, W, KH, KW, SH, SW, DH, DW, PT, PL, P, Q, cols)
                a = cols
            yg = yp + (n * O + g * Og) * <Py_ssize_t>PQ
            # y_g^T (PQ x Og) = cols^T (PQ x CgKK) @ w_g^T (CgKK x Og), column-major
            sgemm(&tN, &tN, &PQ, &Og, &CgKK, &one, <float *>a, &PQ, <float *>(wp + g * Og * <Py_ssize_t>CgKK),
                  &CgKK, &zero, yg, &PQ)
            if bp != NULL:
                for o in range(Og):
                    bo = bp[g * Og + o]
                    for s in range(PQ):
                        yg[o * PQ + s] = yg[o * PQ + s] + bo
        free(cols)
    if failed[0]:
        raise MemoryError("conv2d_general_forward: could not allocate im2col scratch")


def conv2d_general_backward(const float[:, :, :, ::1] x,   # IN  (N, C, H, W)
                            const float[:, :, :, ::1] w,   # IN  (O, Cg, KH, KW)
                            const float[:, :, :, ::1] dy,  # IN  (N, O, P, Q)
                            float[:, :, :, ::1] dx,        # OUT (N, C, H, W) or None, overwritten
                            float[:, :, :, ::1] dw,        # OUT (O, Cg, KH, KW), overwritten
                            float[::1] db,                 # OUT (O,) or None, overwritten
                            int SH, int SW, int PT, int PL, int DH, int DW, int groups, int num_threads):
    """dw_g += dy_ng @ cols^T per (image, group) into one buffer per part of a fixed split, added in part order;
    dx[n, group g] = col2im(w_g^T @ dy_ng)."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], Cg = w.shape[1], KH = w.shape[2], KW = w.shape[3], P = dy.shape[2], Q = dy.shape[3]
    cdef int G = groups, Og = O // groups
    cdef int PQ = P * Q, CgKK = Cg * KH * KW
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, items = <Py_ssize_t>N * G, wsize = <Py_ssize_t>O * CgKK
    cdef bint direct = KH == 1 and KW == 1 and SH == 1 and SW == 1 and PT == 0 and PL == 0 and P == H and Q == W
    cdef bint need_dx = dx is not None
    cdef int nt = pc_threads_for(items * PQ * <Py_ssize_t>CgKK * Og, items, num_threads)
    pc_work(pc_conv_ns(<double>items * PQ * CgKK * Og * (1 + need_dx)))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = NULL if dx is None else &dx[0, 0, 0, 0]
    cdef float *dwp = &dw[0, 0, 0, 0]
    cdef float *acc = NULL   # dw buffers of parts 1 .. nt - 1; part 0 accumulates into dw
    cdef float *cols = NULL
    cdef float *dcols = NULL
    cdef float *dwt = NULL
    cdef const float *a
    cdef float *dyg
    cdef float *dxg
    cdef char tN = b'N', tT = b'T'
    cdef float one = 1.0, zero = 0.0
    cdef Py_ssize_t it, n, g, e
    cdef int j
    cdef Py_ssize_t t, i0, i1
    cdef int failed[1]
    failed[0] = 0
    memset(dwp, 0, sizeof(float) * wsize)
    if nt > 1:
        acc = <float *>calloc(<size_t>(nt - 1) * wsize, sizeof(float))
        if acc == NULL:
            raise MemoryError("conv2d_general_backward: could not allocate dw buffers")
    with nogil, parallel(num_threads=pc_cap(nt)):
        cols = NULL
        dcols = NULL
        if not direct:
            cols = <float *>malloc(sizeof(float) * <size_t>CgKK * PQ)
            if need_dx:
                dcols = <float *>malloc(sizeof(float) * <size_t>CgKK * PQ)
        # part t sums its fixed run of items into dw buffer t (OpenMP's static split of nt), whichever
        # thread takes it: a smaller team, or a busy core, changes no bit
        for t in prange(nt, schedule="dynamic", chunksize=1):
            dwt = dwp if t == 0 else acc + (t - 1) * wsize
            i0 = (items // nt) * t + (t if t < items % nt else items % nt)
            i1 = i0 + items // nt + (1 if t < items % nt else 0)
            for it in range(i0, i1):
                if not direct and (cols == NULL or (need_dx and dcols == NULL)):
                    failed[0] = 1
                    break
                n = it // G
                g = it - n * G
                a = xp + (n * C + g * Cg) * HW
                if not direct:
                    pcg_im2col(a, Cg, H, W, KH, KW, SH, SW, DH, DW, PT, PL, P, Q, cols)
                    a = cols
                dyg = <float *>(dyp + (n * O + g * Og) * <Py_ssize_t>PQ)
                # dw_g^T (CgKK x Og) += cols (CgKK x PQ) @ dy_ng^T (PQ x Og), column-major
                sgemm(&tT, &tN, &CgKK, &Og, &PQ, &one, <float *>a, &PQ, dyg, &PQ, &one,
                      dwt + g * Og * <Py_ssize_t>CgKK, &CgKK)
                if need_dx:
                    dxg = dxp + (n * C + g * Cg) * HW
                    # dcols^T (PQ x CgKK) = dy_ng^T (PQ x Og) @ w_g (Og x CgKK), column-major
                    if direct:
                        sgemm(&tN, &tT, &PQ, &CgKK, &Og, &one, dyg, &PQ,
                              <float *>(wp + g * Og * <Py_ssize_t>CgKK), &CgKK, &zero, dxg, &PQ)
                    else:
                        sgemm(&tN, &tT, &PQ, &CgKK, &Og, &one, dyg, &PQ,
                              <float *>(wp + g * Og * <Py_ssize_t>CgKK), &CgKK, &zero, dcols, &PQ)
                        memset(dxg, 0, sizeof(float) * Cg * HW)
                        pcg_col2im(dcols, Cg, H, W, KH, KW, SH, SW, DH, DW, PT, PL, P, Q, dxg)
        free(cols)
        free(dcols)
    if failed[0]:
        free(acc)
        raise MemoryError("conv2d_general_backward: could not allocate im2col scratch")
    if nt > 1:
        # fixed part order: dw = ((dw_0 + dw_1) + dw_2) + ...
        with nogil:
            for e in prange(wsize, schedule="guided", num_threads=pc_cap(pc_threads_for(wsize * nt, wsize, nt))):
                for j in range(nt - 1):
                    dwp[e] = dwp[e] + acc[j * wsize + e]
        free(acc)
    if db is not None:
        with nogil:
            _bias_sum(dyp, N, O, PQ, &db[0], num_threads)


# ------------------------------------------------------------------ pointwise (1x1, stride 1, no padding)
DEF PW_COLS = 256  # positions per chunk: a multiple of the 32-column register block


cdef int _pointwise(const float *xp, const float *wp, const float *bp, const float *sp, bint relu, int N, int C,
                    int O, Py_ssize_t S, float *yp, int num_threads) noexcept nogil:
    """y[n] = epilogue(w @ x[n]) per (image, 256-position chunk); 1 when scratch ran out."""
    cdef Py_ssize_t chunks = (S + PW_COLS - 1) // PW_COLS, items = <Py_ssize_t>N * chunks, it, n, s0, s1
    cdef int nt = pc_threads_for(items * S * C * O // chunks, items, num_threads)
    cdef float *pack = NULL
    cdef int failed[1]
    failed[0] = 0
    with parallel(num_threads=pc_cap(nt)):
        pack = <float *>malloc(sizeof(float) * 32 * <size_t>C)
        for it in prange(items, schedule="guided"):
            if pack == NULL:
                failed[0] = 1
                continue
            n = it // chunks
            s0 = (it - n * chunks) * PW_COLS
            s1 = s0 + PW_COLS if s0 + PW_COLS < S else S
            pcg_pw_cols(wp, xp + n * C * S, C, O, S, s0, s1, bp, sp, relu, pack, yp + n * O * S)
        free(pack)
    return failed[0]


def pointwise_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                      const float[:, :, :, ::1] w,  # IN  (O, C, 1, 1)
                      const float[::1] b,           # IN  (O,) or None
                      float[:, :, :, ::1] y,        # OUT (N, O, H, W), overwritten
                      int num_threads, const float[::1] scale=None, bint relu=False):
    """A 1x1 convolution (stride 1, no padding) as one GEMM per image: ``y = w @ x`` (times ``scale``
    per filter when given), plus ``b``, then the ReLU when ``relu``, applied as it stores."""
    cdef int N = x.shape[0], C = x.shape[1], O = w.shape[0]
    cdef Py_ssize_t S = <Py_ssize_t>x.shape[2] * x.shape[3]
    if (w.shape[1] != C or w.shape[2] != 1 or w.shape[3] != 1 or y.shape[0] != N or y.shape[1] != O
            or y.shape[2] != x.shape[2] or y.shape[3] != x.shape[3] or (b is not None and b.shape[0] != O)
            or (scale is not None and scale.shape[0] != O)):
        raise ValueError("pointwise_forward: shapes do not match a 1x1 convolution")
    cdef const float *bp = NULL if b is None else &b[0]
    cdef const float *sp = NULL if scale is None else &scale[0]
    cdef int failed
    pc_work(N * pc_product_ns(O, S, C))  # its multiply-adds, or the floats it moves where more
    with nogil:
        failed = _pointwise(&x[0, 0, 0, 0], &w[0, 0, 0, 0], bp, sp, relu, N, C, O, S, &y[0, 0, 0, 0], num_threads)
    if failed:
        raise MemoryError("pointwise_forward: could not allocate scratch")


def pointwise_backward_input(const float[:, :, :, ::1] dy,  # IN  (N, O, H, W)
                             const float[:, :, :, ::1] w,   # IN  (O, C, 1, 1)
                             float[:, :, :, ::1] dx,        # OUT (N, C, H, W), overwritten
                             int num_threads):
    """dx of :func:`pointwise_forward` (no scale, no ReLU): ``dx[n] = w^T @ dy[n]`` on the forward's GEMM."""
    cdef int N = dy.shape[0], O = dy.shape[1], C = w.shape[1]
    cdef Py_ssize_t S = <Py_ssize_t>dy.shape[2] * dy.shape[3], o, c
    if (w.shape[0] != O or w.shape[2] != 1 or w.shape[3] != 1 or dx.shape[0] != N or dx.shape[1] != C
            or dx.shape[2] != dy.shape[2] or dx.shape[3] != dy.shape[3]):
        raise ValueError("pointwise_backward_input: shapes do not match a 1x1 convolution")
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef float *wt = <float *>malloc(sizeof(float) * <size_t>O * C)
    cdef int failed
    if wt == NULL:
        raise MemoryError("pointwise_backward_input: could not allocate scratch")
    pc_work(N * pc_product_ns(O, S, C))  # its multiply-adds, or the floats it moves where more
    with nogil:
        for o in range(O):
            for c in range(C):
                wt[c * O + o] = wp[o * C + c]
        failed = _pointwise(&dy[0, 0, 0, 0], wt, NULL, NULL, False, N, O, C, S, &dx[0, 0, 0, 0], num_threads)
    free(wt)
    if failed:
        raise MemoryError("pointwise_backward_input: could not allocate scratch")


include "_team.pxi"
