# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
#
# The fused conv2d -> ReLU -> maxpool2d (-> flatten -> linear) layer, included by _conv.pyx: the
# forward (``conv2d_relu_maxpool2d_forward``: the direct convolution of _conv_direct.pxi pooling each
# image from thread-private scratch, with the narrow linear head of pc_dense.h) and the backward
# (``conv2d_relu_maxpool2d_backward``, ``pc_fused.h``), which never writes the full-size gradient of
# the convolution output.


# the argmax of a pooled plane: uint16 for planes of at most PC_POOL_U16_MAX positions (half the
# bytes of int32 for the forward to write and the backward to read back), else int32
ctypedef fused pool_index_t:
    int
    unsigned short


def conv2d_relu_maxpool2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                                  const float[:, :, :, ::1] w,  # IN  (O, C, K, K)
                                  const float[::1] b,           # IN  (O,) or None
                                  float[:, :, :, ::1] y,        # OUT (N, O, PP, QQ), overwritten
                                  pool_index_t[:, :, :, ::1] argmax,  # OUT (N, O, PP, QQ), overwritten
                                  int stride, int padding, int pool_kernel, int pool_stride,
                                  int num_threads,
                                  const float[:, ::1] head_w=None,  # IN  (G, O * PP * QQ) or None
                                  const float[::1] head_b=None,     # IN  (G,) or None
                                  float[:, ::1] logits=None):       # OUT (N, G) with head_w, overwritten
    """``relu(maxpool2d(conv2d(x)))`` without writing the convolution output.

    With ``head_w`` the pooled output also feeds ``flatten -> linear``
    (``G <= NARROW_MAX_G`` outputs, bias ``head_b`` or None) and ``logits``
    receives its output, each thread's pooled images passing through the head
    four at a time while they are still in its cache.

    Each thread convolves whole images into private scratch and pools from
    there; argmax indexes the (P, Q) convolution plane (uint16 only where
    ``P * Q <= PC_POOL_U16_MAX``, else int32). Where the images do
    not split evenly over the threads (fewer images than threads, or a
    remainder), whole images per thread are still taken while the busiest
    thread's extra work stays under ``FUSED_FWD_UNEVEN_MACS``; beyond that it
    returns False, having written nothing (as for stride > 1), and the caller
    composes the unfused ops, which split images.
    """
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = H + 2 * padding - K + 1, Q = W + 2 * padding - K + 1
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef const float *bp = NULL
    cdef int failed
    cdef double per_image = <double>O * C * K * K * P * Q
    # the busiest thread's images beyond an even share, in multiply-adds
    cdef double uneven = (((N + nt - 1) // nt) - <double>N / nt) * per_image
    cdef const float *hwp = NULL
    cdef const float *hbp = NULL
    cdef float *lp = NULL
    cdef int G = 0
    if head_w is not None:
        G = head_w.shape[0]
        if (logits is None or G < 1 or G > PCD_NARROW_G or head_w.shape[1] != <Py_ssize_t>O * y.shape[2] * y.shape[3]
                or logits.shape[0] != N or logits.shape[1] != G or (head_b is not None and head_b.shape[0] != G)):
            raise ValueError(f"conv2d_relu_maxpool2d_forward: head_w must be (G, {O * y.shape[2] * y.shape[3]}) "
                             f"with 1 <= G <= {PCD_NARROW_G}, head_b (G,) or None and logits ({N}, G)")
        hwp = &head_w[0, 0]
        lp = &logits[0, 0]
        if head_b is not None:
            hbp = &head_b[0]
    if pool_index_t is cython.ushort and <Py_ssize_t>P * Q > PC_POOL_U16_MAX:
        raise ValueError(f"conv2d_relu_maxpool2d_forward: a {P}x{Q} convolution plane needs an int32 argmax")
    if stride != 1:
        return False
    if b is not None:
        bp = &b[0]
    pc_work(pc_conv_ns(N * per_image))
    failed = _conv_shifted(&x[0, 0, 0, 0], N, C, H, W, padding, K, &w[0, 0, 0, 0], 0, O, bp,
                           &y[0, 0, 0, 0], P, Q, nt, pool_kernel, pool_stride, <void *>&argmax[0, 0, 0, 0],
                           pool_index_t is cython.ushort, uneven <= FUSED_FWD_UNEVEN_MACS, hwp, hbp, lp, G)
    pc_work(0)
    if failed == 1:
        raise MemoryError("conv2d_relu_maxpool2d_forward: could not allocate scratch")
    return failed == 0


cdef enum:
    # extra multiply-adds the busiest thread may take so that the fused forward keeps whole images:
    # below it, one fused thread beats the composed ops on two
    FUSED_FWD_UNEVEN_MACS = 1 << 20


cdef enum:
    # multiply-adds of the fused backward below which it runs on one thread
    FUSED_BWD_SERIAL_BELOW = 1 << 18
    # blocks of images the fused backward's dw is summed in: N // FUSED_BWD_BLOCK_IMAGES, at least
    # FUSED_BWD_MIN_BLOCKS and at most FUSED_BWD_IMAGE_BLOCKS (fewer when the batch is smaller or
    # their partial sums would pass FUSED_BWD_PARTIAL_BYTES). Fixed by the shape, so every thread
    # count gives the same bits; handed out dynamically, each block reads every image's planes as
    # one contiguous run (ranges of filters instead restart a strided walk over the planes of
    # every image). Blocks of four images shorten the last block two threads wait on.
    FUSED_BWD_IMAGE_BLOCKS = 32
    FUSED_BWD_MIN_BLOCKS = 16
    FUSED_BWD_BLOCK_IMAGES = 4
    FUSED_BWD_PARTIAL_BYTES = 1 << 26
    # ranges of the head's dw columns per thread (see conv2d_relu_maxpool2d_backward)
    FUSED_BWD_HEAD_RUNS_PER_THREAD = 4

cdef int _fused_bwd_image_blocks = FUSED_BWD_IMAGE_BLOCKS


def _set_fused_backward_image_blocks(int n):
    """Set the most image blocks the fused backward's dw is summed in (tuning and tests); returns the old value."""
    global _fused_bwd_image_blocks
    if n < 1:
        raise ValueError(f"image blocks must be >= 1, got {n}")
    old = _fused_bwd_image_blocks
    _fused_bwd_image_blocks = n
    return old


def conv2d_relu_maxpool2d_backward(const float[:, :, :, ::1] x,     # IN  (N, C, H, W)
                                   const float[:, :, :, ::1] w,     # IN  (O, C, K, K)
                                   const float[:, :, :, ::1] y,     # IN  (N, O, PP, QQ) fused forward output
                                   const pool_index_t[:, :, :, ::1] argmax,  # IN  (N, O, PP, QQ) (P, Q)-plane index
                                   const float[:, :, :, ::1] dy,    # IN  (N, O, PP, QQ), or None with a head
                                   float[:, :, :, ::1] dx,          # OUT (N, C, H, W) or None, overwritten
                                   float[:, :, :, ::1] dw,          # OUT (O, C, K, K), overwritten
                                   float[::1] db,                   # OUT (O,) or None, overwritten
                                   int padding, int num_threads,
                                   const float[:, ::1] head_w=None,   # IN  (G, O * PP * QQ) or None
                                   const float[:, ::1] head_dy=None,  # IN  (N, G) or None
                                   float[:, ::1] head_dw=None,        # OUT (G, O * PP * QQ) or None, overwritten
                                   float[::1] head_db=None):          # OUT (G,) or None, overwritten
    """Gradients of ``relu(maxpool2d(conv2d(x)))`` (stride-1 convolution) without a full-size dz.

    See ``pc_fused.h``. dw and db: blocks of images (their number set by the
    shape) handed out to threads dynamically, each block's partial sums in
    double, then added in block order (the same bits at every thread count
    and whichever thread takes a block); dx: images handed out dynamically.

    With ``head_w`` and ``head_dy`` (and ``dy`` None) the pooled output feeds
    ``flatten -> linear`` with ``G <= NARROW_MAX_G`` outputs: the pooled
    gradient ``head_dy @ head_w`` is computed image by image where it is
    used, never stored whole (dw and db only: ``dx`` must be None). With
    ``head_dw`` too, the head's weight gradient ``head_dy.T @ y`` (ranges of
    columns, each summing its rows in order: the bits of the narrow
    ``_dense.linear_backward``) runs in the same parallel loop, handed out
    after the blocks, and ``head_db`` (``head_dy`` summed over the batch in
    double) after it.
    """
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = H + 2 * padding - K + 1, Q = W + 2 * padding - K + 1
    cdef int PQp = y.shape[2] * y.shape[3]
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef double macs = <double>N * O * P * Q * C * K * K
    cdef Py_ssize_t kdim = <Py_ssize_t>C * K * K
    cdef Py_ssize_t per_block = <Py_ssize_t>O * (kdim + 1)
    cdef int failed[1]
    cdef int n, it, blk, hi, nblocks, nhead = 0, nitems, g
    cdef Py_ssize_t hcb = 0
    cdef float *scr
    cdef float *dbp = NULL
    cdef float *hdwp = NULL
    cdef double *part
    cdef Py_ssize_t dws = 0
    cdef const float *dyp = NULL
    cdef const float *hwp = NULL
    cdef const float *hdyp = NULL
    cdef int G = 0
    cdef Py_ssize_t head_F = 0
    cdef const void *amp = <const void *>&argmax[0, 0, 0, 0]
    cdef int am16 = pool_index_t is cython.ushort
    failed[0] = 0
    if db is not None:
        dbp = &db[0]
    if head_w is not None or head_dy is not None:
        if head_w is None or head_dy is None or dy is not None or dx is not None:
            raise ValueError("conv2d_relu_maxpool2d_backward: a linear head takes head_w and head_dy "
                             "together, with dy and dx None")
        G = head_w.shape[0]
        head_F = <Py_ssize_t>O * PQp
        if G < 1 or G > PCD_NARROW_G or head_w.shape[1] != head_F or head_dy.shape[0] != N or head_dy.shape[1] != G:
            raise ValueError(f"conv2d_relu_maxpool2d_backward: head_w must be (G, {head_F}) with 1 <= G <= "
                             f"{PCD_NARROW_G} and head_dy ({N}, G), got ({head_w.shape[0]}, {head_w.shape[1]}) and "
                             f"({head_dy.shape[0]}, {head_dy.shape[1]})")
        hwp = &head_w[0, 0]
        hdyp = &head_dy[0, 0]
        if head_dw is not None:
            if head_dw.shape[0] != G or head_dw.shape[1] != head_F:
                raise ValueError(f"conv2d_relu_maxpool2d_backward: head_dw must be ({G}, {head_F}), got "
                                 f"({head_dw.shape[0]}, {head_dw.shape[1]})")
            hdwp = &head_dw[0, 0]
        if head_db is not None and head_db.shape[0] != G:
            raise ValueError(f"conv2d_relu_maxpool2d_backward: head_db must be ({G},), got ({head_db.shape[0]},)")
    elif dy is None:
        raise ValueError("conv2d_relu_maxpool2d_backward: dy is None and no linear head is given")
    elif head_dw is not None or head_db is not None:
        raise ValueError("conv2d_relu_maxpool2d_backward: head_dw and head_db need head_w and head_dy")
    else:
        dyp = &dy[0, 0, 0, 0]
    if macs < FUSED_BWD_SERIAL_BELOW:
        nt = 1
    nblocks = _min(N, _min(_fused_bwd_image_blocks, max(FUSED_BWD_MIN_BLOCKS, N // FUSED_BWD_BLOCK_IMAGES)))
    nblocks = <int>max(1, min(<Py_ssize_t>nblocks, FUSED_BWD_PARTIAL_BYTES // (8 * per_block)))
    if hdwp != NULL:
        # the head's dw: ranges of its hcb column blocks (PCD_BWD_FB columns each), after the image
        # blocks, a few per thread: short items at the end even out the threads' finishing times
        hcb = (head_F + PCD_BWD_FB - 1) // PCD_BWD_FB
        nhead = <int>min(<Py_ssize_t>(1 if nt == 1 else FUSED_BWD_HEAD_RUNS_PER_THREAD * nt), hcb)
    nitems = nhead + nblocks
    part = <double *>malloc(sizeof(double) * <size_t>nblocks * per_block)
    if part == NULL:
        raise MemoryError("conv2d_relu_maxpool2d_backward: could not allocate the partial sums")
    dws = pcf_dw_scratch_floats(C, H, W, padding, P, Q, head_F)
    pc_work(pc_conv_ns(macs))  # dw, and dx after it: each the forward's multiply-adds
    with nogil:
        with parallel(num_threads=pc_cap(_min(nt, nitems))):
            scr = <float *>malloc(sizeof(float) * dws)
            if scr == NULL:
                failed[0] = 1
            for it in prange(nitems, schedule="dynamic"):
                if scr == NULL:
                    continue
                if it >= nblocks:
                    hi = it - nblocks
                    pcd_linear_bwd_cols(&y[0, 0, 0, 0], hwp, hdyp, NULL, hdwp, N, head_F, G,
                                        min(head_F, PCD_BWD_FB * ((hcb * hi) // nhead)),
                                        min(head_F, PCD_BWD_FB * ((hcb * (hi + 1)) // nhead)), PCD_BWD_FB)
                    continue
                blk = it
                pcf_dw_images(&x[0, 0, 0, 0], C, H, W, padding, K, P, Q, &y[0, 0, 0, 0], amp, am16,
                              dyp, O, PQp, <int>((<long>N * blk) // nblocks), <int>((<long>N * (blk + 1)) // nblocks),
                              hdyp, hwp, G, part + blk * per_block, scr)
            free(scr)
        if not failed[0]:
            pcf_dw_reduce(part, nblocks, O, kdim, &dw[0, 0, 0, 0], dbp)
        free(part)
        if head_db is not None:
            for g in range(G):
                head_db[g] = pcd_bias_grad(hdyp, N, G, g)
        if dx is not None and not failed[0]:
            dws = pcf_dx_scratch_floats(C, H, W, padding, P, Q)
            with parallel(num_threads=pc_cap(_min(nt, N))):
                scr = <float *>malloc(sizeof(float) * dws)
                if scr == NULL:
                    failed[0] = 1
                for n in prange(N, schedule="dynamic"):
                    if scr != NULL:
                        pcf_dx(n, C, H, W, padding, K, P, Q, &w[0, 0, 0, 0], &y[0, 0, 0, 0], amp, am16,
                               dyp, O, PQp, &dx[0, 0, 0, 0], scr)
                free(scr)
    pc_work(0)
    if failed[0]:
        raise MemoryError("conv2d_relu_maxpool2d_backward: could not allocate scratch")
