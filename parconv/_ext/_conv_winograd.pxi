# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
#
# Winograd convolution of stride-1 3x3 layers, included by _conv.pyx (one module: its helpers, enums
# and cimports are shared).
#
# F(2x2, 3x3) (``pc_winograd.h``): where it applies (``winograd_applies``, ``winograd_dw_applies``
# and their thresholds), and the blocked drivers that both tile sizes run through, the transforms
# being the only difference (F(4x4, 3x3)'s, ``pc_winograd4.h``, and its thresholds are in
# _conv_winograd4.pxi):
#
# * forward ``_conv_winograd``: input and filter transforms, one GEMM per transform point on the
#   direct convolution's micro-kernels, output transform, block by block;
# * weight gradient ``_dw_winograd`` (entry point ``conv2d_backward_weights_winograd``): transforms
#   of x and dy, GEMMs dU[xi] += dM[xi] V[xi]^T (sgemm, or ``pcw4_dot_gemm`` for small F(4x4, 3x3)
#   products), groups of blocks added in group order, then the filter-gradient transform.


cdef enum:
    # transformed input + GEMM output of one block of tiles (bytes): about half an L2
    WINOGRAD_BLOCK_BYTES = 1 << 19
    # where F(2x2, 3x3) beats the direct micro-kernels for one image: at least 64 channels and
    # 32 filters, 36 tiles (12x12 outputs) and tiles x filters >= 2048, or 32 channels and
    # filters over 144 tiles (24x24 outputs). Narrower layers or fewer tiles leave the 16 GEMMs
    # too small for the transforms
    WINOGRAD_MIN_C = 64
    WINOGRAD_MIN_O = 32
    WINOGRAD_MIN_TILES = 36
    WINOGRAD_MIN_TILES_X_O = 2048
    WINOGRAD_NARROW_MIN_C = 32
    WINOGRAD_NARROW_MIN_TILES = 144
    # in a batch of at least this many images, each image is its own block and the blocks keep
    # every thread busy: 32 channels, 32 filters and 16 tiles (8x8 outputs) are enough
    # (16 channels into 16 filters still lose)
    WINOGRAD_BATCH_MIN_IMAGES = 4
    WINOGRAD_BATCH_MIN_C = 32
    WINOGRAD_BATCH_MIN_O = 32
    WINOGRAD_BATCH_MIN_TILES = 16
    WINOGRAD_BATCH_MIN_TILES_X_O = 512
    # the F(2x2, 3x3) forward puts several images in a block where one has fewer tiles (8x8
    # outputs and less): GEMMs this wide read the transformed filters from L2 a quarter as often
    WINOGRAD_IMAGES_BELOW_TILES = 64
    # the forward transforms its filters in at least this many runs (two a thread on larger teams, at
    # most one a filter): enough for the threads that are awake to share them, few enough that each
    # is worth a shared counter's step
    WINOGRAD_FILTER_RUNS = 16


# rules (min channels, min filters, min tiles, min tiles x filters), any of which takes Winograd:
# two for one image (wide layers; narrow ones over large maps), one for a batch
cdef int[12] _wino_limits = [WINOGRAD_MIN_C, WINOGRAD_MIN_O, WINOGRAD_MIN_TILES, WINOGRAD_MIN_TILES_X_O,
                             WINOGRAD_NARROW_MIN_C, WINOGRAD_MIN_O, WINOGRAD_NARROW_MIN_TILES,
                             WINOGRAD_MIN_TILES_X_O,
                             WINOGRAD_BATCH_MIN_C, WINOGRAD_BATCH_MIN_O, WINOGRAD_BATCH_MIN_TILES,
                             WINOGRAD_BATCH_MIN_TILES_X_O]


cdef inline bint _wino_rule(const int *lim, int C, int O, long tiles) noexcept nogil:
    return C >= lim[0] and O >= lim[1] and tiles >= lim[2] and tiles * O >= lim[3]


def winograd_applies(int C, int O, int K, int stride, int P, int Q, int N=1):
    """Whether :func:`conv2d_forward` takes the Winograd F(2x2, 3x3) path for this shape
    (``N`` images in the batch)."""
    cdef long tiles = <long>((P + 1) // 2) * ((Q + 1) // 2)
    if K != 3 or stride != 1:
        return False
    if N >= WINOGRAD_BATCH_MIN_IMAGES:
        return _wino_rule(&_wino_limits[8], C, O, tiles)
    return _wino_rule(&_wino_limits[0], C, O, tiles) or _wino_rule(&_wino_limits[4], C, O, tiles)


cdef inline Py_ssize_t _wino_plane_stride(int rows, Py_ssize_t ldt) noexcept nogil:
    """Floats between the 16 transform planes of a block (``rows`` channels or filters of ``ldt``
    tiles): a multiple of 16, so planes stay on cache lines in a 64-byte aligned buffer, plus 32,
    because the 16 points are written and read together and at a multiple of 4 KiB they would all
    share L1 sets and evict each other."""
    return ((<Py_ssize_t>rows * ldt + 15) & ~15) + 32


cdef inline int _image_groups(int N, int ipb, int mult) noexcept nogil:
    """Runs of whole images for blocks of at most ``ipb``: ceil(N / ipb), rounded up to a
    multiple of ``mult`` where the batch has that many images, so ``mult`` threads get equal
    shares. Run g holds images N g / n .. N (g + 1) / n (sizes differ by at most one)."""
    cdef int n = (N + ipb - 1) // ipb
    if mult > 1 and n % mult:
        n = min(N, n + mult - n % mult)
    return max(n, 1)


cdef Py_ssize_t _fwd_blocks(int N, int C, int O, int P, int Q, int nt, int *ipb, int *rb, int *bpi,
                           int *ng, bint f4) noexcept nogil:
    """Blocks of the Winograd forward (F(4x4, 3x3) with ``f4``, else F(2x2, 3x3)): ``ipb`` whole
    images per block where an F(4x4, 3x3) image's V and M fit WINOGRAD4_BLOCK_BYTES, or (F(2x2,
    3x3)) where two or more images of fewer than WINOGRAD_IMAGES_BELOW_TILES tiles fit
    WINOGRAD_BLOCK_BYTES (``bpi`` = 1), else ``bpi`` blocks of ``rb`` tile rows of one image;
    at least one block per thread where the batch allows. ``ng`` runs of images
    (:func:`_image_groups`, a multiple of the threads: the forward's bits do not depend on
    its blocks), ``ipb`` the longest. Returns the tiles of a full
    block (the GEMMs' width and the planes' row stride), for F(4x4, 3x3) rounded up to whole
    vectors of 8 (pcw4_input_block)."""
    cdef int m = 4 if f4 else 2
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef Py_ssize_t per_tile = 4 * (m + 2) * (m + 2) * (<Py_ssize_t>C + O)  # bytes of V and M for one tile
    cdef Py_ssize_t cap = max(<Py_ssize_t>1, (WINOGRAD4_BLOCK_BYTES if f4 else WINOGRAD_BLOCK_BYTES) // per_tile)
    cdef Py_ssize_t img_tiles = <Py_ssize_t>tH * tW
    if img_tiles <= cap:
        ipb[0] = <int>min(<Py_ssize_t>N, cap // img_tiles)
        ipb[0] = max(1, min(ipb[0], (N + nt - 1) // nt))
        # F(2x2, 3x3) takes whole images only where one has fewer tiles than WINOGRAD_IMAGES_BELOW_TILES
        # (its GEMMs would be too narrow), and then just enough of them
        if not f4:
            ipb[0] = <int>min(<Py_ssize_t>ipb[0], (WINOGRAD_IMAGES_BELOW_TILES + img_tiles - 1) // img_tiles)
        if f4 or ipb[0] >= 2:
            rb[0] = tH
            bpi[0] = 1
            ng[0] = _image_groups(N, ipb[0], nt)
            ipb[0] = (N + ng[0] - 1) // ng[0]
            return (<Py_ssize_t>ipb[0] * img_tiles + 7) & ~7 if f4 else <Py_ssize_t>ipb[0] * img_tiles
    ipb[0] = 1
    ng[0] = N
    rb[0] = <int>max(<Py_ssize_t>1, min(cap // tW, <Py_ssize_t>tH))
    bpi[0] = (tH + rb[0] - 1) // rb[0]
    if N * bpi[0] < nt:                   # a block for every thread
        bpi[0] = min(tH, (nt + N - 1) // N)
    rb[0] = (tH + bpi[0] - 1) // bpi[0]   # equal blocks
    bpi[0] = (tH + rb[0] - 1) // rb[0]
    return (<Py_ssize_t>rb[0] * tW + 7) & ~7 if f4 else <Py_ssize_t>rb[0] * tW


def _winograd_blocks(int N, int C, int O, int P, int Q, int num_threads, bint winograd4):
    """The Winograd forward's blocks for this shape (:func:`_fwd_blocks`, tests): (most images in a
    block, tile rows per block, blocks per image, runs of images, tiles of a full block)."""
    cdef int ipb, rb, bpi, ng
    cdef Py_ssize_t ldt = _fwd_blocks(N, C, O, P, Q, max(1, num_threads), &ipb, &rb, &bpi, &ng, winograd4)
    return ipb, rb, bpi, ng, ldt


cdef int _conv_winograd(const float *x, int N, int C, int H, int W, int pad,
                        const float *w, int O, const float *bias, float *y, int P, int Q, int nt,
                        const float *scale, bint relu, bint f4) noexcept:
    """Stride-1 3x3 forward by Winograd: F(4x4, 3x3) with ``f4`` (``pc_winograd4.h``, 36
    transform points), else F(2x2, 3x3) (``pc_winograd.h``, 16).

    Blocks (:func:`_fwd_blocks`: tile rows of one image, or whole images where an image has
    few tiles, since a block's tiles are the width of its GEMMs and the micro-kernels want
    whole panels) are split over threads; each thread transforms its
    block's input into private scratch, runs the GEMMs and transforms the result straight
    into y, so every output has the same bits at any thread count. The GEMMs are the
    convolution's register-blocked micro-kernels reading U and V in place: a block has a
    few dozen tiles, and a BLAS sgemm would pack all of U[xi] for each of them.
    ``scale``, ``relu``: as ``_conv_shifted``. Returns 1 when scratch could not be allocated.
    """
    cdef int m = 4 if f4 else 2, pts = 36 if f4 else 16
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef int ipb, rb, bpi, ng, nblocks
    cdef Py_ssize_t ldt = _fwd_blocks(N, C, O, P, Q, nt, &ipb, &rb, &bpi, &ng, f4)
    cdef Py_ssize_t ldxv, ldxm, HW = <Py_ssize_t>H * W, img_out = <Py_ssize_t>O * P * Q
    cdef Py_ssize_t rows_tiles, nb, scratch
    # scratch slots (pcw_scratch_get): 0 U, 1 each thread's V and M
    cdef float *U = <float *>pcw_scratch_get(0, sizeof(float) * pts * <size_t>O * C)
    cdef int *off = <int *>malloc(sizeof(int) * <size_t>C)
    cdef float *Vraw
    cdef float *V
    cdef float *M
    cdef float *scr
    cdef float *ct
    cdef int failed[1]
    cdef int blk, n, n0, n1, ty0, ty1, xi, o, nv, mr0, fr
    cdef int fruns = _min(O, max(<int>WINOGRAD_FILTER_RUNS, 2 * nt))
    cdef pc_gate gate
    pc_gate_init(&gate)
    failed[0] = 0
    if U == NULL or off == NULL:
        pcw_scratch_release(0, U)
        free(off)
        return 1
    nblocks = ng * bpi
    nt = _min(nt, nblocks)
    ldxv = _wino_plane_stride(C, ldt)
    ldxm = _wino_plane_stride(O, ldt)
    if f4:
        scratch = pcw4_input_images_scratch_floats(ipb, tW, rb) + pcw4_filter_scratch_floats(C)
    else:
        scratch = pcw_scratch_floats(tW, rb) + pcw_filter_scratch_floats(C)
    pcc_offsets_tile(C, <int>ldt, off)   # V[xi] row c: the micro-kernels' B(c, t) = V[xi][c * ldt + t]
    with nogil, parallel(num_threads=pc_cap(nt)):
        # V, M and the scratch start on a cache line (ldxv, ldxm are multiples of 16 floats),
        # so no 16-float store of a transform splits across two lines
        Vraw = <float *>pcw_scratch_get(1, sizeof(float) * (pts * <size_t>(ldxv + ldxm) + scratch
                                                           + PCC_MR_MAX * PCC_NR) + 64)
        V = <float *>pc_align64(Vraw)
        if V == NULL:
            failed[0] = 1
        else:
            # the last panel of a block reads whole vectors past its tiles: zeros, not stale floats
            memset(V, 0, sizeof(float) * pts * <size_t>ldxv)
        # the filters' transforms into U, in runs taken from the gate's counter: a thread that wakes
        # late finds them done and goes straight to the blocks, which wait for all of U
        while True:
            fr = pc_gate_take(&gate)
            if fr >= fruns:
                break
            if V != NULL:
                if f4:
                    pcw4_filters(w, O, C, O * fr // fruns, O * (fr + 1) // fruns, U, V + pts * ldxv)
                else:
                    pcw_filters(w, O, C, O * fr // fruns, O * (fr + 1) // fruns, U, V + pts * ldxv)
            pc_gate_done(&gate, fruns)
        if V != NULL:
            M = V + pts * ldxv
            ct = M + pts * ldxm
            scr = ct + PCC_MR_MAX * PCC_NR
        pc_gate_wait(&gate, fruns)  # every filter's transform in U before any block reads U
        for blk in prange(nblocks, schedule="dynamic"):
            if V != NULL:  # every thread must reach the loop; one without scratch skips its blocks
                n0 = <int>((<long>N * (blk // bpi)) // ng)
                n1 = <int>((<long>N * (blk // bpi + 1)) // ng)
                ty0 = (blk % bpi) * rb
                ty1 = _min(tH, ty0 + rb)
                rows_tiles = <Py_ssize_t>(ty1 - ty0) * tW
                nb = (n1 - n0) * rows_tiles
                nv = _min(PCC_NVMAX, <int>((nb + PCC_VEC - 1) // PCC_VEC))
                mr0 = pcc_main_mr(nv)
                if f4:
                    pcw4_input_images(x, n0, n1, C, H, W, pad, ty0, ty1, tW, V, ldxv, ldt, scr)
                else:  # each image's tiles after the previous one's along the planes' rows
                    for n in range(n0, n1):
                        pcw_input(x + n * C * HW, C, H, W, pad, ty0, ty1, tW, V + (n - n0) * rows_tiles, ldxv, ldt,
                                  scr)
                for xi in range(pts):
                    # M[xi] (O x nb) = U[xi] (O x C) @ V[xi] (C x nb): one row of nb positions
                    pcc_conv_panels(U + <Py_ssize_t>xi * O * C, O, C, mr0, nv, V + xi * ldxv, off,
                                    0, nb, <int>nb, <int>nb, M + xi * ldxm, ldt, NULL, NULL, 0, ct)
                if not f4:
                    for n in range(n0, n1):
                        pcw_output(M + (n - n0) * rows_tiles, ldxm, ldt, 0, O, ty0, ty1, tW, P, Q, bias, scale, relu,
                                   y + n * img_out, scr)
                elif tW % 8 == 0:  # whole vectors along each row, as the input transform
                    for n in range(n0, n1):
                        pcw4_output(M, ldxm, ldt, (n - n0) * rows_tiles, 0, O, ty0, ty1, tW, P, Q, bias, scale,
                                    relu, y + n * img_out, scr)
                else:
                    pcw4_output_block(M, ldxm, ldt, n0, n1, O, 0, O, ty0, ty1, tW, P, Q, bias, scale, relu, y, scr)
        pcw_scratch_release(1, Vraw)
    pcw_scratch_release(0, U)
    free(off)
    return failed[0]


cdef enum:
    # the Winograd weight gradient sums its blocks of tiles in at most this many groups, set by
    # the shape (each group's dU is 64 O C bytes, all of them at most WINOGRAD_DW_PARTIAL_BYTES):
    # groups are handed to threads as they come free and added in group order, so dw has the
    # same bits at every thread count
    WINOGRAD_DW_GROUPS = 16
    WINOGRAD_DW_PARTIAL_BYTES = 64 << 20
    # V and dM of one block of the Winograd weight gradient (bytes), and where it pays: it
    # loses for 32 filters, rows of 7 tiles with a half-empty last one, and GEMMs 64 tiles deep
    WINOGRAD_DW_BLOCK_BYTES = 1 << 21
    WINOGRAD_DW_MIN_O = 64
    WINOGRAD_DW_MIN_DEPTH = 96


cdef Py_ssize_t _dw_blocks(int N, int C, int O, int P, int Q, int *ipb, int *rb, int *bpi, int *ng,
                          bint f4=False, bint even=True) noexcept nogil:
    """Blocks of the Winograd weight gradient (F(4x4, 3x3) with ``f4``, else F(2x2, 3x3)):
    ``ipb`` whole images per block when an image's V and dM fit WINOGRAD_DW_BLOCK_BYTES
    (``bpi`` = 1, ``rb`` = all tile rows), else ``bpi`` blocks of ``rb`` tile rows per image
    (``ipb`` = 1). The ``ng`` runs of whole images (:func:`_image_groups`, ``ipb`` the longest)
    are an even number (with ``even``) where the batch allows, so two threads get equal shares; they set the
    bits of dw, so they depend on the shape only. Returns the tiles of a full block, the depth
    of its GEMMs; for F(4x4, 3x3) rounded up to whole vectors of 8 (the planes' row stride, see
    pcw4_input_block)."""
    cdef int m = 4 if f4 else 2
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef Py_ssize_t per_tile = 4 * (m + 2) * (m + 2) * (<Py_ssize_t>C + O)
    cdef Py_ssize_t per_image = per_tile * tH * tW, tiles
    if per_image <= WINOGRAD_DW_BLOCK_BYTES:
        ipb[0] = <int>min(<Py_ssize_t>max(N, 1), WINOGRAD_DW_BLOCK_BYTES // per_image)
        ng[0] = _image_groups(max(N, 1), ipb[0], 2 if even else 1)
        ipb[0] = (max(N, 1) + ng[0] - 1) // ng[0]
        rb[0] = tH
        bpi[0] = 1
        tiles = <Py_ssize_t>ipb[0] * tH * tW
    else:
        ipb[0] = 1
        ng[0] = N
        rb[0] = <int>max(1, min(WINOGRAD_DW_BLOCK_BYTES // (per_tile * tW), tH))
        bpi[0] = (tH + rb[0] - 1) // rb[0]
        rb[0] = (tH + bpi[0] - 1) // bpi[0]    # equal blocks
        bpi[0] = (tH + rb[0] - 1) // rb[0]
        tiles = <Py_ssize_t>rb[0] * tW
    return (tiles + 7) & ~7 if f4 else tiles


def _winograd_dw_blocks(int N, int C, int O, int P, int Q, bint winograd4):
    """The Winograd weight gradient's blocks for this shape (:func:`_dw_blocks`, tests): (most
    images in a block, tile rows per block, blocks per image, runs of images, tiles of a full
    block)."""
    cdef int ipb, rb, bpi, ng
    cdef Py_ssize_t ldt = _dw_blocks(N, C, O, P, Q, &ipb, &rb, &bpi, &ng, winograd4)
    return ipb, rb, bpi, ng, ldt


def winograd_dw_applies(int N, int C, int O, int K, int stride, int P, int Q):
    """Whether :func:`conv2d_backward_weights_winograd` pays for this layer: where the forward
    runs Winograd, with at least WINOGRAD_DW_MIN_O filters, rows of at least 8 tiles (the
    transforms' vectors) or of 4 to 7 whole tiles (an even Q from 8), and GEMMs at least
    WINOGRAD_DW_MIN_DEPTH tiles deep."""
    cdef int ipb, rb, bpi, ng
    if not winograd_applies(C, O, K, stride, P, Q, N) or O < WINOGRAD_DW_MIN_O:
        return False
    if (Q + 1) // 2 < 8 and (Q & 1 or Q < 8):  # short rows with a half-empty last tile lose
        return False
    return _dw_blocks(N, C, O, P, Q, &ipb, &rb, &bpi, &ng, False, False) >= WINOGRAD_DW_MIN_DEPTH


cdef int _dw_winograd(const float *x, int N, int C, int H, int W, int pad,
                      const float *dy, int O, int P, int Q, float *dw, int nt, bint f4) noexcept:
    """Stride-1 3x3 weight gradient by Winograd: F(4x4, 3x3) with ``f4`` (``pcw4_dy_block``,
    ``pcw4_filters_grad``, 36 transform points), else F(2x2, 3x3) (``pcw_dy``,
    ``pcw_filters_grad``, 16).

    A block is a run of whole images whose V and dM fit WINOGRAD_DW_BLOCK_BYTES, or
    when one image does not, a run of its tile rows: the GEMMs
    dU[xi] += dM[xi] V[xi]^T take the block's tiles as their depth, so the
    deeper the better. Blocks accumulate in their group's dU. Returns 1 when
    scratch could not be allocated.
    """
    cdef int m = 4 if f4 else 2, pts = 36 if f4 else 16
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef int ipb, rb, bpi, ng
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q, OC = <Py_ssize_t>O * C
    cdef Py_ssize_t ldt, ldxv, ldxm, rows_tiles, scratch
    cdef int nblocks, groups, g, blk, n, n0, n1, ty0, ty1, nb, xi, ldti, o
    cdef Py_ssize_t e
    cdef float *dU
    cdef float *Vraw
    cdef float *V
    cdef float *M
    cdef float *scr
    cdef float *acc
    cdef bint first, ok
    cdef float beta
    cdef int failed[1]
    cdef char tt = b'T', tn = b'N'
    cdef float one = 1.0
    cdef pc_sync sync
    pc_sync_init(&sync)
    failed[0] = 0
    ldt = _dw_blocks(N, C, O, P, Q, &ipb, &rb, &bpi, &ng, f4)
    nblocks = ng if bpi == 1 else N * bpi
    groups = <int>max(1, min(<Py_ssize_t>min(nblocks, WINOGRAD_DW_GROUPS),
                             WINOGRAD_DW_PARTIAL_BYTES // (4 * pts * OC)))
    ldti = <int>ldt
    ldxv = _wino_plane_stride(C, ldt)
    ldxm = _wino_plane_stride(O, ldt)
    if f4:
        scratch = max(pcw4_input_images_scratch_floats(ipb, tW, rb), pcw4_dy_scratch_floats(ipb, tW, rb))
    else:
        scratch = pcw_scratch_floats(tW, rb)
    # scratch slots (pcw_scratch_get): 0 dU, 1 each thread's V and dM, 2 its filter scratch
    dU = <float *>pcw_scratch_get(0, sizeof(float) * pts * <size_t>OC * groups)
    if dU == NULL:
        return 1
    # one region, three phases: the groups' blocks, their sums, the filters' transforms
    with nogil, parallel(num_threads=pc_cap(nt)):
        Vraw = <float *>pcw_scratch_get(1, sizeof(float) * (pts * <size_t>(ldxv + ldxm) + scratch) + 64)
        V = <float *>pc_align64(Vraw)
        if V == NULL:
            failed[0] = 1
        else:
            M = V + pts * ldxv
            scr = M + pts * ldxm
        for g in prange(groups, schedule="dynamic"):
            if V != NULL:
                acc = dU + <Py_ssize_t>g * pts * OC
                for blk in range(<int>((<long>nblocks * g) // groups), <int>((<long>nblocks * (g + 1)) // groups)):
                    if bpi == 1:   # images n0 .. n1, whole, one after the other along the tiles
                        n0 = <int>((<long>N * blk) // ng)
                        n1 = <int>((<long>N * (blk + 1)) // ng)
                        ty0 = 0
                        ty1 = tH
                    else:          # tile rows ty0 .. ty1 of one image
                        n0 = blk // bpi
                        n1 = n0 + 1
                        ty0 = (blk % bpi) * rb
                        ty1 = _min(tH, ty0 + rb)
                    rows_tiles = <Py_ssize_t>(ty1 - ty0) * tW
                    nb = <int>((n1 - n0) * rows_tiles)
                    if not f4:
                        for n in range(n0, n1):
                            pcw_input(x + n * C * HW, C, H, W, pad, ty0, ty1, tW, V + (n - n0) * rows_tiles,
                                      ldxv, ldt, scr)
                            pcw_dy(dy + n * O * PQ, O, P, Q, ty0, ty1, tW, M + (n - n0) * rows_tiles, ldxm, ldt,
                                   scr)
                    else:
                        pcw4_input_images(x, n0, n1, C, H, W, pad, ty0, ty1, tW, V, ldxv, ldt, scr)
                        pcw4_dy_block(dy, n0, n1, O, P, Q, ty0, ty1, tW, M, ldxm, ldt, scr)
                    first = blk == (<long>nblocks * g) // groups
                    beta = 0.0 if first else 1.0
                    for xi in range(pts):
                        # dU[xi] (O x C) += dM[xi] (O x nb) @ V[xi]^T (nb x C)
                        if f4 and OC <= WINOGRAD4_DW_DOT_MAX_OC:
                            pcw4_dot_gemm(O, C, nb, M + xi * ldxm, ldt, V + xi * ldxv, ldt,
                                          acc + xi * OC, C, not first)
                        else:  # column-major: dU[xi]^T (C x O) += (V[xi]^T)^T @ dM[xi]^T
                            sgemm(&tt, &tn, &C, &O, &nb, &one, V + xi * ldxv, &ldti, M + xi * ldxm, &ldti,
                                  &beta, acc + xi * OC, &C)
        pcw_scratch_release(1, Vraw)
        pc_sync_wait(&sync)
        # every thread reads the same value here (nothing writes failed until the next barrier):
        # after a failed allocation the loops below still run, on no data, for the team's sake
        ok = failed[0] == 0
        # the groups' sums, added in group order (into group 0), then G^T dU G per filter
        for e in prange(pts * OC, schedule="guided"):
            if ok:
                for g in range(1, groups):
                    dU[e] = dU[e] + dU[<Py_ssize_t>g * pts * OC + e]
        pc_sync_wait(&sync)
        scr = NULL
        if ok:
            scr = <float *>pcw_scratch_get(2, sizeof(float) * (pcw4_filters_grad_scratch_floats(C) if f4
                                                                  else pcw_filter_scratch_floats(C)))
            if scr == NULL:
                failed[0] = 1
        for o in prange(O, schedule="guided"):
            if scr != NULL:
                if f4:
                    pcw4_filters_grad(dU, O, C, o, o + 1, dw, scr)
                else:
                    pcw_filters_grad(dU, O, C, o, o + 1, dw, scr)
        pcw_scratch_release(2, scr)
    pcw_scratch_release(0, dU)
    return failed[0]


def conv2d_backward_weights_winograd(const float[:, :, :, ::1] x,   # IN  (N, C, H, W)
                                     const float[:, :, :, ::1] dy,  # IN  (N, O, P, Q)
                                     float[:, :, :, ::1] dw,        # OUT (O, C, 3, 3), overwritten
                                     float[::1] db,                 # OUT (O,) or None, overwritten
                                     int padding, int num_threads, bint winograd4=True):
    """dw of a stride-1 3x3 convolution by Winograd (F(4x4, 3x3) where :func:`winograd4_dw_applies`
    and ``winograd4``, else F(2x2, 3x3)), and ``db = sum dy`` as in :func:`conv2d_backward`; BLAS
    must be limited to one thread. dw has the same bits at every thread count (see
    ``WINOGRAD_DW_GROUPS``)."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = dy.shape[1], P = dy.shape[2], Q = dy.shape[3]
    if dy.shape[0] != N or P != H + 2 * padding - 2 or Q != W + 2 * padding - 2 or padding < 0:
        raise ValueError(f"conv2d_backward_weights_winograd: dy {(dy.shape[0], O, P, Q)} is not the 3x3 "
                         f"stride-1 output of x {(N, C, H, W)} with padding {padding}")
    if dw.shape[0] != O or dw.shape[1] != C or dw.shape[2] != 3 or dw.shape[3] != 3:
        raise ValueError(f"conv2d_backward_weights_winograd: dw must be {(O, C, 3, 3)}, "
                         f"got {(dw.shape[0], dw.shape[1], dw.shape[2], dw.shape[3])}")
    if db is not None and db.shape[0] != O:
        raise ValueError(f"conv2d_backward_weights_winograd: db must be ({O},), got ({db.shape[0]},)")
    if N == 0 or C == 0 or O == 0 or P <= 0 or Q <= 0:
        raise ValueError("conv2d_backward_weights_winograd: every dimension must be >= 1")
    cdef int failed
    pc_work(pc_conv_ns(<double>N * O * P * Q * C * 9 / WINOGRAD_MAC_GAIN))
    failed = _dw_winograd(&x[0, 0, 0, 0], N, C, H, W, padding, &dy[0, 0, 0, 0], O, P, Q, &dw[0, 0, 0, 0],
                          num_threads if num_threads > 0 else 1,
                          winograd4 and winograd4_dw_applies(N, C, O, 3, 1, P, Q))
    if failed:
        raise MemoryError("conv2d_backward_weights_winograd: could not allocate scratch")
    if db is not None:
        pc_work(pc_elems_ns(<double>N * O * P * Q))
        _sum_planes(dy, db, num_threads)
