# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
#
# The im2col + sgemm backward (``_backward_blas``), included by _conv.pyx: dw where the direct weight
# gradient does not apply (a kernel narrower than the stride, or a tiny depth at stride > 1) and dx
# where the input gradient is not a stride-1 convolution (stride > 1, or padding >= K).
# ``scipy.linalg.cython_blas.sgemm`` takes the row-major matrices as their column-major transposes;
# the caller limits the BLAS library to one thread, since every sgemm here runs inside an OpenMP
# parallel region.


cdef int _backward_blas(const float *xp, int N, int C, int H, int W, const float *wp, int O, int K,
                        const float *dyp, int P, int Q, int S, int pad, float *dxp, float *dwp,
                        int nt, Py_ssize_t tile_bytes) noexcept:
    """im2col + sgemm backward: dw (when dwp) and dx = col2im(w^T @ dy_n) (when dxp), overwritten.

    dw is split by blocks of images (a few per thread, handed out as threads
    come free, each into its own buffer; the buffers summed in block order) or,
    with fewer images than threads, by in-channel blocks (each owns its
    columns of dw and planes of dx). Returns 1 when scratch could not be
    allocated.
    """
    cdef int KK = K * K
    cdef int CKK = C * KK
    cdef Py_ssize_t PQ = <Py_ssize_t>P * Q, HW = <Py_ssize_t>H * W
    cdef Py_ssize_t wsize = <Py_ssize_t>O * CKK
    cdef bint direct = K == 1 and S == 1 and pad == 0
    cdef bint need_dx = dxp != NULL, need_dw = dwp != NULL
    cdef bint by_image = nt == 1 or C < nt or (N >= nt and _even_split(N, nt))
    cdef int tp = P if direct else _tile_rows(P, Q, CKK, tile_bytes)
    cdef int tiles = (P + tp - 1) // tp
    cdef char tN = b'N', tT = b'T'
    cdef float one = 1.0, zero = 0.0
    cdef int failed[1]
    cdef float *acc = NULL      # (groups - 1) dw buffers; block 0 accumulates into dw
    cdef float *cols = NULL
    cdef float *dcols = NULL
    cdef float *dwt = NULL
    cdef float *a = NULL
    cdef float *dxn = NULL
    cdef int i, n, t, p0, p1, m, lda, ldc, c0, c1, cb, mk
    cdef int g, groups = 1, nb
    cdef Py_ssize_t e, j
    failed[0] = 0
    if need_dw:
        memset(dwp, 0, sizeof(float) * wsize)
    if by_image:
        nt = _min(nt, N)
        if nt > 1:
            # memory caps the blocks' buffers, never below one per thread
            groups = _min(N, nt * PC_BLOCKS_PER_THREAD)
            if need_dw:
                groups = max(nt, <int>min(<Py_ssize_t>groups, DW_PARTIAL_BYTES // (4 * wsize)))
        if groups > 1 and need_dw:
            acc = <float *>calloc(<size_t>(groups - 1) * wsize, sizeof(float))
            if acc == NULL:
                return 1
        with nogil, parallel(num_threads=pc_cap(nt)):
            cols = NULL
            dcols = NULL
            if not direct:
                if need_dw:
                    cols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if need_dx:
                    dcols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if (need_dw and cols == NULL) or (need_dx and dcols == NULL):
                    failed[0] = 1
            for g in prange(groups, schedule="dynamic"):
                if failed[0]:
                    continue
                dwt = NULL
                if need_dw:
                    dwt = dwp if g == 0 else acc + (g - 1) * wsize
                for n in range(<int>((<long>N * g) // groups), <int>((<long>N * (g + 1)) // groups)):
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
                        if need_dw:
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
                                      <float *>wp, &CKK, &zero, dxn + <Py_ssize_t>p0 * Q, &ldc)
                            else:
                                sgemm(&tN, &tT, &m, &CKK, &O, &one,
                                      <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                      <float *>wp, &CKK, &zero, dcols, &m)
                                pc_col2im(dcols, H, W, K, S, pad, Q, 0, C, p0, p1, dxn)
            free(cols)
            free(dcols)
        if groups > 1 and need_dw and not failed[0]:
            # fixed block order: dw = ((dw_0 + dw_1) + dw_2) + ...
            with nogil:
                for e in prange(wsize, schedule="guided", num_threads=pc_cap(nt)):
                    for j in range(groups - 1):
                        dwp[e] = dwp[e] + acc[j * wsize + e]
        free(acc)
    else:
        nt = _min(nt, C)
        nb = _min(C, nt * PC_BLOCKS_PER_THREAD)
        with nogil, parallel(num_threads=pc_cap(nt)):
            cols = NULL
            dcols = NULL
            if not direct:
                if need_dw:
                    cols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if need_dx:
                    dcols = <float *>malloc(sizeof(float) * <size_t>CKK * tp * Q)
                if (need_dw and cols == NULL) or (need_dx and dcols == NULL):
                    failed[0] = 1
            for i in prange(nb, schedule="dynamic"):
                if failed[0]:
                    continue
                c0 = <int>((<long>C * i) // nb)
                c1 = <int>((<long>C * (i + 1)) // nb)
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
                        if need_dw:
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
                                      <float *>wp + c0 * KK, &CKK, &zero, dxn + c0 * HW + <Py_ssize_t>p0 * Q, &ldc)
                            else:
                                sgemm(&tN, &tT, &m, &mk, &O, &one,
                                      <float *>(dyp + n * <Py_ssize_t>O * PQ + <Py_ssize_t>p0 * Q), &ldc,
                                      <float *>wp + c0 * KK, &CKK, &zero, dcols, &m)
                                pc_col2im(dcols, H, W, K, S, pad, Q, c0, c1, p0, p1, dxn)
            free(cols)
            free(dcols)
    return failed[0]
