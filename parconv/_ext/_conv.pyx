# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
"""conv2d kernels.

Forward (and, for stride 1, the input gradient, which is the convolution of
dy with the flipped, transposed filters) runs register-blocked micro-kernels
(``pc_conv.h``) on weights packed once per call:

* stride 1: straight from a zero-padded copy of the image ("wide grid",
  no im2col);
* stride > 1: from an im2col tile of a few output rows in thread-private
  scratch sized to stay in L2.

The weight gradient (and the input gradient for stride > 1) uses im2col +
``scipy.linalg.cython_blas.sgemm``. Row-major matrices go to the
column-major BLAS as their transposes: a row-major (r, c) array is a
column-major (c, r) one. The caller (``parconv.backends.openmp``) limits the
BLAS library to one thread around these calls, since every sgemm here runs
inside an OpenMP parallel region.

Work is split into chunks (images, tiles of output positions or channel
blocks), never more threads than chunks, and every chunk writes its own part
of the output. Inputs are trusted: shapes, dtypes and contiguity are
validated in Python.
"""

from cython.parallel cimport parallel, prange, threadid
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from scipy.linalg.cython_blas cimport sgemm

cdef extern from "pc_common.h":
    void pc_im2col(const float *x, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *cols, Py_ssize_t ld) noexcept nogil
    void pc_col2im(const float *dcols, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *dx) noexcept nogil

cdef extern from "pc_conv.h":
    int PCC_NR
    const char *PCC_ISA
    int pcc_num_blocks(int O) noexcept nogil
    void pcc_pack_block(const float *w, int O, int kdim, int b, float *a) noexcept nogil
    void pcc_pack_block_flipped(const float *w, int O, int C, int K, int b, float *a) noexcept nogil
    void pcc_pad_image(const float *x, int H, int W, int pad, int Hp, int Wp, int c0, int c1,
                       float *xp) noexcept nogil
    void pcc_offsets_shifted(int C, int K, int Hp, int Wp, int *off) noexcept nogil
    void pcc_offsets_tile(int kdim, int ldb, int *off) noexcept nogil
    void pcc_conv_panels(const float *a, int O, int kdim, const float *b, const int *off,
                         Py_ssize_t s_begin, Py_ssize_t s_end, int Wg, int Q, float *y, Py_ssize_t ldy,
                         const float *bias, float *ct) noexcept nogil

# one extra micro-kernel width of readable floats after every B operand
cdef int SLACK = PCC_NR + 16


def kernel_isa():
    """Instruction set the convolution micro-kernels were compiled for."""
    return PCC_ISA.decode()


cdef inline int _min(int a, int b) noexcept nogil:
    return a if a < b else b


cdef inline bint _even_split(int n, int nt) noexcept nogil:
    """Whether n equal chunks keep nt threads evenly busy."""
    return n % nt == 0 or n >= 4 * nt


cdef int _tile_rows(int P, int Q, Py_ssize_t depth, Py_ssize_t budget) noexcept:
    """Output rows per tile so that a (depth, rows*Q) float scratch fits in ``budget`` bytes."""
    cdef Py_ssize_t per_row = depth * Q * 4
    cdef Py_ssize_t rows = budget // per_row if per_row > 0 else P
    if rows < 1:
        rows = 1
    if rows > P:
        rows = P
    return <int>rows


cdef int _balance_tiles(int N, int P, int tp, int nt) noexcept:
    """Shrink the tile height so N * tiles spreads evenly over nt threads."""
    cdef int t = (P + tp - 1) // tp
    if nt <= 1:
        return tp
    while t < P and not _even_split(N * t, nt):
        t += 1
    return (P + t - 1) // t


cdef inline void _pack_block(const float *w, int O, int kdim, int flip_O, int K, int b,
                             float *a) noexcept nogil:
    """Pack filter block b; flip_O > 0: w is (flip_O, O, K, K), packed flipped and transposed."""
    if flip_O > 0:
        pcc_pack_block_flipped(w, flip_O, O, K, b, a)
    else:
        pcc_pack_block(w, O, kdim, b, a)


cdef inline int _pack_threads(int O, int kdim, int nb, int nt) noexcept nogil:
    """Threads for packing O x kdim weights in nb blocks (one when it is small)."""
    if <Py_ssize_t>O * kdim < 16384:
        return 1
    return _min(nt, nb)


cdef int _conv_shifted(const float *x, int N, int C, int H, int W, int pad, int K,
                       const float *w, int flip_O, int O, const float *bias,
                       float *y, int P, int Q, int nt) noexcept:
    """Stride-1 convolution from zero-padded images ("wide grid").

    w is (O, C, K, K), or with ``flip_O > 0`` the (flip_O, O, K, K) filters of
    the forward whose input gradient this is. ``pad`` may be negative (the
    padded image is then a crop). Returns 1 when scratch could not be
    allocated, else 0.
    """
    cdef int Hp = H + 2 * pad, Wp = W + 2 * pad
    cdef int kdim = C * K * K
    cdef Py_ssize_t img = <Py_ssize_t>C * Hp * Wp, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef Py_ssize_t s_end = <Py_ssize_t>(P - 1) * Wp + Q
    cdef int panels = <int>((s_end + PCC_NR - 1) // PCC_NR)
    cdef int cpi = 1  # chunks (of whole panels) per image
    cdef int failed[1]
    cdef int *off = <int *>malloc(sizeof(int) * kdim)
    cdef float *shared = NULL
    cdef float *buf = NULL
    cdef float *ct = NULL
    cdef int nb = pcc_num_blocks(O)
    cdef float *a = <float *>malloc(sizeof(float) * <Py_ssize_t>O * kdim)
    cdef int it, n, ch, pa, pb
    cdef Py_ssize_t i
    failed[0] = 0
    if off == NULL or a == NULL:
        free(off)
        free(a)
        return 1
    pcc_offsets_shifted(C, K, Hp, Wp, off)
    if nt > 1 and not (N >= nt and _even_split(N, nt)):
        cpi = (nt + N - 1) // N
        while cpi < panels and not _even_split(N * cpi, nt):
            cpi += 1
        cpi = _min(cpi, panels)
    nt = _min(nt, N * cpi)
    if cpi == 1:
        with nogil:
            for i in prange(nb, schedule="static", num_threads=_pack_threads(O, kdim, nb, nt)):
                _pack_block(w, O, kdim, flip_O, K, <int>i, a)
        # whole images per chunk: each thread pads the image it works on into private scratch
        with nogil, parallel(num_threads=nt):
            buf = <float *>malloc(sizeof(float) * (img + SLACK))
            ct = <float *>malloc(sizeof(float) * 16 * PCC_NR)
            if buf == NULL or ct == NULL:
                failed[0] = 1
            else:
                memset(buf + img, 0, sizeof(float) * SLACK)
            for n in prange(N, schedule="static"):
                if failed[0]:
                    continue
                pcc_pad_image(x + n * C * HW, H, W, pad, Hp, Wp, 0, C, buf)
                pcc_conv_panels(a, O, kdim, buf, off, 0, s_end, Wp, Q, y + n * O * PQ, PQ, bias, ct)
            free(buf)
            free(ct)
    else:
        # few images: pad them all once (in parallel), then split each image's panels
        shared = <float *>malloc(sizeof(float) * (N * img + SLACK))
        if shared == NULL:
            free(off)
            free(a)
            return 1
        memset(shared + N * img, 0, sizeof(float) * SLACK)
        with nogil:
            # one pass packs the filter blocks and pads the planes
            for i in prange(nb + <Py_ssize_t>N * C, schedule="static", num_threads=nt):
                if i < nb:
                    _pack_block(w, O, kdim, flip_O, K, <int>i, a)
                else:
                    pcc_pad_image(x + ((i - nb) // C) * C * HW, H, W, pad, Hp, Wp, <int>((i - nb) % C),
                                  <int>((i - nb) % C) + 1, shared + ((i - nb) // C) * img)
        with nogil, parallel(num_threads=nt):
            ct = <float *>malloc(sizeof(float) * 16 * PCC_NR)
            if ct == NULL:
                failed[0] = 1
            for it in prange(N * cpi, schedule="static"):
                if failed[0]:
                    continue
                n = it // cpi
                ch = it % cpi
                pa = <int>((<long>panels * ch) // cpi)
                pb = <int>((<long>panels * (ch + 1)) // cpi)
                pcc_conv_panels(a, O, kdim, shared + n * img, off, <Py_ssize_t>pa * PCC_NR,
                                min(<Py_ssize_t>pb * PCC_NR, s_end), Wp, Q, y + n * O * PQ, PQ, bias, ct)
            free(ct)
        free(shared)
    free(off)
    free(a)
    return failed[0]


cdef int _conv_tiled(const float *x, int N, int C, int H, int W, int S, int pad, int K,
                     const float *w, int O, const float *bias,
                     float *y, int P, int Q, int nt, Py_ssize_t tile_bytes) noexcept:
    """Any-stride convolution from im2col tiles of output rows in thread-private scratch."""
    cdef int kdim = C * K * K
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int tp = _balance_tiles(N, P, _tile_rows(P, Q, kdim, tile_bytes), nt)
    cdef int tiles = (P + tp - 1) // tp
    cdef int ldb = tp * Q
    cdef int failed[1]
    cdef int *off = <int *>malloc(sizeof(int) * kdim)
    cdef float *cols = NULL
    cdef float *ct = NULL
    cdef int nb = pcc_num_blocks(O)
    cdef float *a = <float *>malloc(sizeof(float) * <Py_ssize_t>O * kdim)
    cdef int it, n, t, p0, p1, i
    failed[0] = 0
    if off == NULL or a == NULL:
        free(off)
        free(a)
        return 1
    pcc_offsets_tile(kdim, ldb, off)
    nt = _min(nt, N * tiles)
    with nogil:
        for i in prange(nb, schedule="static", num_threads=_pack_threads(O, kdim, nb, nt)):
            _pack_block(w, O, kdim, 0, K, i, a)
    with nogil, parallel(num_threads=nt):
        cols = <float *>malloc(sizeof(float) * (<Py_ssize_t>kdim * ldb + SLACK))
        ct = <float *>malloc(sizeof(float) * 16 * PCC_NR)
        if cols == NULL or ct == NULL:
            failed[0] = 1
        else:
            memset(cols, 0, sizeof(float) * (<Py_ssize_t>kdim * ldb + SLACK))
        for it in prange(N * tiles, schedule="static"):
            if failed[0]:
                continue
            n = it // tiles
            t = it % tiles
            p0 = t * tp
            p1 = _min(P, p0 + tp)
            pc_im2col(x + n * C * HW, H, W, K, S, pad, Q, 0, C, p0, p1, cols, ldb)
            pcc_conv_panels(a, O, kdim, cols, off, 0, <Py_ssize_t>(p1 - p0) * Q, Q, Q,
                            y + n * O * PQ + p0 * Q, PQ, bias, ct)
        free(cols)
        free(ct)
    free(off)
    free(a)
    return failed[0]


def conv2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                   const float[:, :, :, ::1] w,  # IN  (O, C, K, K)
                   const float[::1] b,           # IN  (O,) or None
                   float[:, :, :, ::1] y,        # OUT (N, O, P, Q), overwritten
                   int stride, int padding, int num_threads,
                   Py_ssize_t tile_bytes=1048576):
    """Convolution forward, parallel over images or, for small batches, tiles of output positions."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = y.shape[2], Q = y.shape[3]
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef const float *bp = NULL
    cdef int failed
    if b is not None:
        bp = &b[0]
    if stride == 1:
        failed = _conv_shifted(&x[0, 0, 0, 0], N, C, H, W, padding, K, &w[0, 0, 0, 0], 0, O, bp,
                               &y[0, 0, 0, 0], P, Q, nt)
    else:
        failed = _conv_tiled(&x[0, 0, 0, 0], N, C, H, W, stride, padding, K, &w[0, 0, 0, 0], O, bp,
                             &y[0, 0, 0, 0], P, Q, nt, tile_bytes)
    if failed:
        raise MemoryError("conv2d_forward: could not allocate scratch")


def conv2d_backward(const float[:, :, :, ::1] x,   # IN  (N, C, H, W)
                    const float[:, :, :, ::1] w,   # IN  (O, C, K, K)
                    const float[:, :, :, ::1] dy,  # IN  (N, O, P, Q)
                    float[:, :, :, ::1] dx,        # OUT (N, C, H, W) or None, overwritten
                    float[:, :, :, ::1] dw,        # OUT (O, C, K, K), overwritten
                    float[::1] db,                 # OUT (O,) or None, overwritten
                    int stride, int padding, int num_threads,
                    Py_ssize_t tile_bytes=4194304):
    """Convolution backward: ``dw = sum_n dy_n @ cols_n^T``, ``dx``, ``db = sum dy``.

    dx for stride 1 (and padding < K) is the stride-1 convolution of dy with
    the flipped, transposed filters and padding K - 1 - padding, run by the
    forward micro-kernels. Otherwise dx is ``col2im(w^T @ dy_n)``, computed
    alongside dw.

    dw is split one of two ways, both deterministic for a given thread count:

    * by image (enough images): each thread accumulates dw for its static
      block of images in a private buffer; the buffers are summed afterwards
      in thread order.
    * by in-channel block (fewer images than threads, e.g. batch 1): each
      thread owns the columns of dw (and planes of dx) of its channels, so
      there is nothing to reduce.

    db is summed per filter in double, by one thread per filter.
    """
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = dy.shape[2], Q = dy.shape[3]
    cdef int S = stride, pad = padding
    cdef int KK = K * K
    cdef int CKK = C * KK
    cdef Py_ssize_t PQ = <Py_ssize_t>P * Q, HW = <Py_ssize_t>H * W
    cdef Py_ssize_t wsize = <Py_ssize_t>O * CKK
    cdef bint direct = K == 1 and S == 1 and pad == 0
    cdef bint dx_by_conv = dx is not None and S == 1 and pad <= K - 1
    cdef bint need_dx = dx is not None and not dx_by_conv
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef bint by_image = nt == 1 or C < nt or (N >= nt and _even_split(N, nt))
    cdef int tp = P if direct else _tile_rows(P, Q, CKK, tile_bytes)
    cdef int tiles = (P + tp - 1) // tp
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef float *wp = <float *>&w[0, 0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = NULL
    cdef float *dwp = &dw[0, 0, 0, 0]
    if dx is not None:
        dxp = &dx[0, 0, 0, 0]
    cdef char tN = b'N', tT = b'T'
    cdef float one = 1.0, zero = 0.0
    cdef int failed[1]
    cdef float *acc = NULL      # (nt - 1) private dw buffers; thread 0 accumulates into dw
    cdef float *cols = NULL
    cdef float *dcols = NULL
    cdef float *dwt = NULL
    cdef float *a = NULL
    cdef float *dxn = NULL
    cdef int i, n, t, p0, p1, m, lda, ldc, c0, c1, cb, mk
    cdef int tid = 0
    cdef Py_ssize_t e, j
    failed[0] = 0

    if dx_by_conv:
        failed[0] = _conv_shifted(dyp, N, O, P, Q, K - 1 - pad, K, wp, O, C, NULL, dxp, H, W, nt)
        if failed[0]:
            raise MemoryError("conv2d_backward: could not allocate scratch")

    memset(dwp, 0, sizeof(float) * wsize)
    if by_image:
        nt = _min(nt, N)
        if nt > 1:
            acc = <float *>calloc(<size_t>(nt - 1) * wsize, sizeof(float))
            if acc == NULL:
                raise MemoryError("conv2d_backward: could not allocate dw accumulators")
        with nogil, parallel(num_threads=nt):
            tid = threadid()
            dwt = dwp if tid == 0 else acc + (tid - 1) * wsize
            cols = NULL
            dcols = NULL
            if not direct:
                cols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if need_dx:
                    dcols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if cols == NULL or (need_dx and dcols == NULL):
                    failed[0] = 1
            for n in prange(N, schedule="static"):
                if failed[0]:
                    continue
                dxn = NULL
                if need_dx:
                    dxn = dxp + n * <Py_ssize_t>C * HW
                    if not direct:
                        memset(dxn, 0, sizeof(float) * <size_t>C * HW)
                for t in range(tiles):
                    p0 = t * tp
                    p1 = _min(P, p0 + tp)
                    m = (p1 - p0) * Q
                    ldc = <int>PQ
                    if direct:
                        a = <float *>(xp + n * <Py_ssize_t>C * HW + <Py_ssize_t>p0 * Q)
                        lda = <int>PQ
                    else:
                        pc_im2col(xp + n * <Py_ssize_t>C * HW, H, W, K, S, pad, Q, 0, C, p0, p1, cols, m)
                        a = cols
                        lda = m
                    # dw^T (CKK x O) += cols (CKK x m) @ dy_n[:, tile]^T (m x O)
                    sgemm(&tT, &tN, &CKK, &O, &m, &one, a, &lda,
                          <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                          &one, dwt, &CKK)
                    if need_dx:
                        # dcols^T (m x CKK) = dy_n[:, tile]^T (m x O) @ w (O x CKK)
                        if direct:
                            sgemm(&tN, &tT, &m, &CKK, &O, &one,
                                  <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                  wp, &CKK, &zero, dxn + <Py_ssize_t>p0 * Q, &ldc)
                        else:
                            sgemm(&tN, &tT, &m, &CKK, &O, &one,
                                  <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                  wp, &CKK, &zero, dcols, &m)
                            pc_col2im(dcols, H, W, K, S, pad, Q, 0, C, p0, p1, dxn)
            free(cols)
            free(dcols)
        if nt > 1 and not failed[0]:
            # fixed thread order: dw = ((dw_0 + dw_1) + dw_2) + ...
            with nogil:
                for e in prange(wsize, schedule="static", num_threads=nt):
                    for j in range(nt - 1):
                        dwp[e] = dwp[e] + acc[j * wsize + e]
        free(acc)
    else:
        nt = _min(nt, C)
        with nogil, parallel(num_threads=nt):
            tid = threadid()
            cols = NULL
            dcols = NULL
            if not direct:
                cols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if need_dx:
                    dcols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if cols == NULL or (need_dx and dcols == NULL):
                    failed[0] = 1
            for i in prange(nt, schedule="static"):
                if failed[0]:
                    continue
                c0 = <int>((<long>C * i) // nt)
                c1 = <int>((<long>C * (i + 1)) // nt)
                cb = c1 - c0
                mk = cb * KK
                for n in range(N):
                    dxn = NULL
                    if need_dx:
                        dxn = dxp + n * <Py_ssize_t>C * HW
                        if not direct:
                            memset(dxn + c0 * HW, 0, sizeof(float) * <size_t>cb * HW)
                    for t in range(tiles):
                        p0 = t * tp
                        p1 = _min(P, p0 + tp)
                        m = (p1 - p0) * Q
                        ldc = <int>PQ
                        if direct:
                            a = <float *>(xp + (n * <Py_ssize_t>C + c0) * HW + <Py_ssize_t>p0 * Q)
                            lda = <int>PQ
                        else:
                            pc_im2col(xp + n * <Py_ssize_t>C * HW, H, W, K, S, pad, Q, c0, c1, p0, p1, cols, m)
                            a = cols
                            lda = m
                        # dw[:, channel block]^T (mk x O) += cols_block (mk x m) @ dy_n[:, tile]^T (m x O)
                        sgemm(&tT, &tN, &mk, &O, &m, &one, a, &lda,
                              <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                              &one, dwp + c0 * KK, &CKK)
                        if need_dx:
                            if direct:
                                sgemm(&tN, &tT, &m, &mk, &O, &one,
                                      <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                      wp + c0 * KK, &CKK, &zero, dxn + c0 * HW + <Py_ssize_t>p0 * Q, &ldc)
                            else:
                                sgemm(&tN, &tT, &m, &mk, &O, &one,
                                      <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                      wp + c0 * KK, &CKK, &zero, dcols, &m)
                                pc_col2im(dcols, H, W, K, S, pad, Q, c0, c1, p0, p1, dxn)
            free(cols)
            free(dcols)
    if failed[0]:
        raise MemoryError("conv2d_backward: could not allocate im2col scratch")
    if db is not None:
        _sum_planes(dy, db, num_threads)


cdef void _sum_planes(const float[:, :, :, ::1] dy, float[::1] db, int num_threads) noexcept:
    """db[o] = sum over n, p, q of dy[n, o, p, q], in double, one thread per filter."""
    cdef int N = dy.shape[0], O = dy.shape[1]
    cdef Py_ssize_t PQ = <Py_ssize_t>dy.shape[2] * dy.shape[3]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef const float *row
    cdef int o, n
    cdef Py_ssize_t j
    cdef double s
    cdef int nt = num_threads if num_threads > 0 else 1
    if <Py_ssize_t>N * O * PQ < 65536:
        nt = 1
    nt = _min(nt, O)
    with nogil:
        for o in prange(O, schedule="static", num_threads=nt):
            s = 0.0
            for n in range(N):
                row = dyp + (n * <Py_ssize_t>O + o) * PQ
                for j in range(PQ):
                    s = s + row[j]
            db[o] = <float>s
