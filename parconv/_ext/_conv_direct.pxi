# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
#
# Direct convolution on the register-blocked micro-kernels of pc_conv.h (implicit GEMM), included by
# _conv.pyx (one module: its helpers, enums and cimports are shared).
#
# * forward ``_conv_shifted``: y = w @ B with B(k, s) a shifted view of each zero-padded image (stride
#   1) or of its stride x stride phases (``pcc_pad_grid``, stride > 1 with the kernel at least the
#   stride), no im2col matrix; also the input gradient (dy convolved with the flipped, transposed
#   filters) and, with a pooling window, the store of the fused conv-ReLU-maxpool(+linear) forward;
# * forward ``_conv_tiled``: a kernel narrower than the stride, on im2col tiles of a few output rows
#   in thread-private scratch;
# * weight gradient ``_dw_shifted``: dw = dy @ B^T, vectorised along the filters (dy packed
#   transposed), on the padded images or their phases; ``_dw_dot`` along the positions for a small
#   depth C*K*K.
#
# ``_plan_walk`` chooses the panel width and walk of the micro-kernels for a shape.


cdef int _balance_tiles(int N, int P, int tp, int nt) noexcept:
    """Shrink the tile height so N * tiles spreads evenly over nt threads."""
    cdef int t = (P + tp - 1) // tp
    if nt <= 1:
        return tp
    while t < P and not _even_split(N * t, nt):
        t += 1
    return (P + t - 1) // t


# relative speed of the micro-kernels by panel width (nv vectors): narrow panels
# load more per multiply-add
cdef double[5] _NV_SPEED = [1.0, 0.92, 0.98, 1.0, 1.0]


cdef int _chunks_per_image(int N, int units, int nt) noexcept:
    """Chunks to cut each image's work units into so that N * chunks keeps nt threads busy."""
    cdef int cpi = 1
    if nt > 1 and not (N >= nt and _even_split(N, nt)):
        cpi = (nt + N - 1) // N
        while cpi < units and not _even_split(N * cpi, nt):
            cpi += 1
        cpi = _min(cpi, units)
    return cpi


cdef int _plan_walk(int N, int P, int Q, int Wg, int nt, bint allow_rows, int kdim, int *plan) noexcept:
    """Pick the panel width nv (returned), the walk (plan[0]: 1 row walk, 0 panel walk) and the
    chunks per image (plan[1]) that minimise the work of the busiest thread: positions times
    (kdim multiply-adds + the cost of storing, higher when panels go through scratch)."""
    cdef int nv, rows, units, cpi, per_unit, nr
    cdef Py_ssize_t s_end = <Py_ssize_t>(P - 1) * Wg + Q
    cdef double cost, best = 1e300
    cdef int best_nv = 1
    plan[0] = 0
    plan[1] = 1
    for nv in range(1, PCC_NVMAX + 1):
        nr = nv * PCC_VEC
        for rows in range(2 if allow_rows else 1):
            if rows:
                units = P
                per_unit = (Q + nr - 1) // nr * nr
            else:
                units = <int>((s_end + nr - 1) // nr)
                per_unit = nr
            cpi = _chunks_per_image(N, units, nt)
            # busiest thread: its share of chunks times the units of the biggest chunk
            cost = (<double>((N * cpi + nt - 1) // nt) * ((units + cpi - 1) // cpi) * per_unit
                    * (kdim + (2 if rows or Wg == Q else 8))) / _NV_SPEED[nv]
            if cost < best:
                best, best_nv, plan[0], plan[1] = cost, nv, rows, cpi
    return best_nv


cdef int _conv_shifted(const float *x, int N, int C, int H, int W, int pad, int K,
                       const float *w, int flip_O, int O, const float *bias,
                       float *y, int P, int Q, int nt,
                       int pk=0, int ps=0, void *am=NULL, bint am16=False, bint whole_images=False,
                       const float *hw=NULL, const float *hb=NULL, float *logits=NULL, int G=0,
                       int stride=1, const float *scale=NULL, bint relu=False) noexcept:
    """Stride-1 convolution straight from zero-padded images (or, with ``stride > 1`` and a kernel
    at least the stride, from the images' phases: ``pcc_pad_phases``; no pooling then).

    w is (O, C, K, K), or with ``flip_O > 0`` the (flip_O, O, K, K) filters of
    the forward whose input gradient this is. ``pad`` may be negative (the
    padded image is then a crop). Work is split into chunks of output rows
    (row walk) or panels (panel walk) of each image; where images are cut into
    chunks and the filters outweigh the images, into runs of whole register
    blocks of filters over the whole image instead (a thread reads its share of
    the filters; every output keeps its arithmetic).

    With ``pk > 0`` the convolution of each image goes to thread-private
    scratch and only ``relu(maxpool(., pk, ps))`` is written: y is then the
    (N, O, PP, QQ) pooled output and am its argmax in the (P, Q) plane (uint16
    when ``am16``, else int). This
    needs whole images per chunk; when the best split would cut images it
    returns 2 having done nothing, unless ``whole_images``: then each thread
    takes whole images even where the threads get unequal shares. Returns 1
    when scratch could not be allocated, else 0.

    With ``hw`` (pooling only) the pooled output also feeds a linear head of
    ``G <= PCD_NARROW_G`` outputs, weights hw (G, O * PP * QQ) and bias hb (or
    NULL): each thread holds back the images it pools until it has four,
    whichever they are (and the rest at the end of its loop), then computes
    their ``logits`` rows while their pooled planes are still in cache, in
    one pass over hw (``pcd_linear_fwd_rows4``: the same bits as
    ``linear_forward``). hw is G x F floats, which no longer stay in a core's
    L2 next to the scratch once F reaches about 20,000.

    With ``scale`` each output is ``conv * scale[o] + bias[o]`` (an eval-mode
    BatchNorm folded in), then ``max(., 0)`` with ``relu``; not with ``pk``.
    """
    cdef int Hp = H + 2 * pad, Wp = W + 2 * pad
    cdef int sd = stride if stride > 1 else 1
    cdef int Wg = (Wp + sd - 1) // sd, Hg = (Hp + sd - 1) // sd   # the grid: padded image or phases
    cdef int kdim = C * K * K
    cdef Py_ssize_t img = <Py_ssize_t>C * sd * sd * Hg * Wg, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef Py_ssize_t s_end = <Py_ssize_t>(P - 1) * Wg + Q
    cdef int slack = PCC_NR + K + 16
    cdef int plan[2]
    cdef int nv = _plan_walk(N, P, Q, Wg, nt, True, kdim, plan)
    cdef bint by_rows = plan[0]
    cdef int cpi = plan[1]  # chunks (of whole rows or panels) per image
    cdef int mr0 = pcc_main_mr(nv)
    cdef int nr = nv * PCC_VEC
    cdef int nf
    cdef int units = P if by_rows else <int>((s_end + nr - 1) // nr)
    cdef int failed[1]
    cdef int *off = <int *>malloc(sizeof(int) * kdim)
    cdef float *shared = NULL
    cdef float *buf = NULL
    cdef float *ct = NULL
    cdef const float *a = w
    cdef float *wt = NULL
    cdef int it, n, ch, ua, ub, o, oa, ob, blocks
    cdef bint by_filters
    cdef Py_ssize_t i
    cdef double work
    cdef int PP = (P - pk) // ps + 1 if pk > 0 else 0
    cdef int QQ = (Q - pk) // ps + 1 if pk > 0 else 0
    cdef Py_ssize_t PPQQ = <Py_ssize_t>PP * QQ
    cdef float *z = NULL
    cdef int *pool_base = NULL
    cdef Py_ssize_t *pend = NULL  # with a head, per thread: up to 4 pooled images, then their count
    failed[0] = 0
    if pk > 0 and cpi != 1:
        if not whole_images:
            free(off)
            return 2
        nv = _plan_walk(N, P, Q, Wg, 1, True, kdim, plan)  # the walk for one image per thread
        by_rows, cpi = plan[0], 1
        mr0 = pcc_main_mr(nv)
        nr = nv * PCC_VEC
        units = P if by_rows else <int>((s_end + nr - 1) // nr)
    if pk > 0:
        pool_base = <int *>malloc(sizeof(int) * PPQQ)
        if pool_base == NULL:
            free(off)
            return 1
        pc_pool_bases(Q, ps, PP, QQ, pool_base)
    if flip_O > 0:
        wt = <float *>malloc(sizeof(float) * <Py_ssize_t>O * kdim)
        a = wt
    if off == NULL or (flip_O > 0 and wt == NULL):
        free(off)
        free(wt)
        free(pool_base)
        return 1
    pcc_offsets_grid(C, K, sd, Hg, Wg, off)
    nt = _min(nt, N * cpi)
    if cpi == 1:
        # whole images per chunk: each thread pads the image it works on into private scratch
        if flip_O > 0:
            work = pc_work_get()
            pc_work(pc_elems_ns(<double>O * kdim))  # a region of its own, as the copies below
            with nogil:
                for it in prange(O, schedule="guided", num_threads=pc_cap(_min(nt, O) if <Py_ssize_t>O * kdim > 16384 else 1)):
                    pcc_flip_filters(w, flip_O, O, K, it, it + 1, wt)
            pc_work(work)
        with nogil, parallel(num_threads=pc_cap(nt)):
            buf = <float *>malloc(sizeof(float) * (img + slack))
            ct = <float *>malloc(sizeof(float) * PCC_MR_MAX * PCC_NR)
            z = NULL
            pend = NULL
            if pk > 0:
                z = <float *>malloc(sizeof(float) * O * PQ)
            if hw != NULL:
                pend = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * 5)
            if buf == NULL or ct == NULL or (pk > 0 and z == NULL) or (hw != NULL and pend == NULL):
                failed[0] = 1
            else:
                memset(buf + img, 0, sizeof(float) * slack)
                if pend != NULL:
                    pend[4] = 0
            # dynamic: every image is computed alone, so a thread whose core is shared with another
            # process takes fewer images and the result keeps its bits
            for n in prange(N, schedule="dynamic"):
                if failed[0]:
                    continue
                pcc_pad_grid(x + n * C * HW, H, W, pad, sd, Hg, Wg, 0, C, buf)
                if pk > 0:
                    # conv of this image into scratch, then only the pooled maxima leave
                    if by_rows:
                        pcc_conv_rows(a, O, kdim, mr0, nv, buf, off, 0, P, Wg, Q, z, PQ, bias, NULL, 0, ct)
                    else:
                        pcc_conv_panels(a, O, kdim, mr0, nv, buf, off, 0, s_end, Wg, Q, z, PQ, bias, NULL, 0,
                                        ct)
                    for o in range(O):
                        if am16:
                            pc_pool_plane_u16(z + o * PQ, pool_base, Q, pk, ps, PP, QQ, y + (n * O + o) * PPQQ,
                                              <unsigned short *>am + (n * O + o) * PPQQ, 1)
                        else:
                            pc_pool_plane(z + o * PQ, pool_base, Q, pk, ps, PP, QQ, y + (n * O + o) * PPQQ,
                                          <int *>am + (n * O + o) * PPQQ, 1)
                    if hw != NULL:
                        pend[pend[4]] = n
                        pend[4] = pend[4] + 1
                        if pend[4] == 4:
                            pcd_linear_fwd_rows4(y, hw, hb, logits, pend, 4, O * PPQQ, G)
                            pend[4] = 0
                elif by_rows:
                    pcc_conv_rows(a, O, kdim, mr0, nv, buf, off, 0, P, Wg, Q, y + n * O * PQ, PQ, bias, scale,
                                  relu, ct)
                else:
                    pcc_conv_panels(a, O, kdim, mr0, nv, buf, off, 0, s_end, Wg, Q, y + n * O * PQ, PQ, bias,
                                    scale, relu, ct)
            if pend != NULL and not failed[0] and pend[4] > 0:
                pcd_linear_fwd_rows4(y, hw, hb, logits, pend, <int>pend[4], O * PPQQ, G)
            free(buf)
            free(ct)
            free(z)
            free(pend)
    else:
        # few images: pad them all once (in parallel), then split each image's rows or panels
        shared = <float *>malloc(sizeof(float) * (N * img + slack))
        if shared == NULL:
            free(off)
            free(wt)
            return 1
        memset(shared + N * img, 0, sizeof(float) * slack)
        nf = O if flip_O > 0 else 0
        # the copies are a region of their own: its team follows their work, not the product's (a
        # layer at batch 1 would otherwise wake the team twice)
        work = pc_work_get()
        pc_work(pc_elems_ns(<double>N * img + <double>nf * kdim))
        with nogil:
            # one pass flips the filters (input gradient) and pads the planes
            for i in prange(nf + <Py_ssize_t>N * C, schedule="guided", num_threads=pc_cap(nt)):
                if i < nf:
                    pcc_flip_filters(w, flip_O, O, K, <int>i, <int>i + 1, wt)
                else:
                    pcc_pad_grid(x + ((i - nf) // C) * C * HW, H, W, pad, sd, Hg, Wg, <int>((i - nf) % C),
                                  <int>((i - nf) % C) + 1, shared + ((i - nf) // C) * img)
        pc_work(work)
        # filters that outweigh the images (a wide layer at batch 1): each chunk takes a run of whole
        # register blocks of filters over the whole image, so a thread reads its share of the filters
        # instead of all of them; every output row keeps its block width, so the bits are the same
        blocks = O // mr0
        by_filters = blocks >= cpi and <Py_ssize_t>O * kdim > <Py_ssize_t>N * img
        with nogil, parallel(num_threads=pc_cap(nt)):
            ct = <float *>malloc(sizeof(float) * PCC_MR_MAX * PCC_NR)
            if ct == NULL:
                failed[0] = 1
            for it in prange(N * cpi, schedule="dynamic"):
                if failed[0]:
                    continue
                n = it // cpi
                ch = it % cpi
                if by_filters:
                    # the run's ends at the block boundaries nearest ch / cpi of the filters: even shares,
                    # and with blocks >= cpi no run is empty
                    oa = mr0 * <int>((<long>O * ch + cpi * mr0 // 2) // (<long>cpi * mr0))
                    ob = O if ch == cpi - 1 else mr0 * <int>((<long>O * (ch + 1) + cpi * mr0 // 2) // (<long>cpi * mr0))
                    ua = 0
                    ub = units
                else:
                    oa = 0
                    ob = O
                    ua = <int>((<long>units * ch) // cpi)
                    ub = <int>((<long>units * (ch + 1)) // cpi)
                if by_rows:
                    pcc_conv_rows(a + <Py_ssize_t>oa * kdim, ob - oa, kdim, mr0, nv, shared + n * img, off, ua, ub,
                                  Wg, Q, y + n * O * PQ + oa * PQ, PQ, NULL if bias == NULL else bias + oa,
                                  NULL if scale == NULL else scale + oa, relu, ct)
                else:
                    pcc_conv_panels(a + <Py_ssize_t>oa * kdim, ob - oa, kdim, mr0, nv, shared + n * img, off,
                                    <Py_ssize_t>ua * nr, min(<Py_ssize_t>ub * nr, s_end), Wg, Q,
                                    y + n * O * PQ + oa * PQ, PQ, NULL if bias == NULL else bias + oa,
                                    NULL if scale == NULL else scale + oa, relu, ct)
            free(ct)
        free(shared)
    free(off)
    free(wt)
    free(pool_base)
    return failed[0]


cdef int _conv_tiled(const float *x, int N, int C, int H, int W, int S, int pad, int K,
                     const float *w, int O, const float *bias,
                     float *y, int P, int Q, int nt, Py_ssize_t tile_bytes, const float *scale=NULL,
                     bint relu=False) noexcept:
    """Any-stride convolution from im2col tiles of output rows in thread-private scratch
    (``scale``, ``relu``: as ``_conv_shifted``)."""
    cdef int kdim = C * K * K
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int tp = _balance_tiles(N, P, _tile_rows(P, Q, kdim, tile_bytes), nt)
    cdef int tiles = (P + tp - 1) // tp
    cdef int ldb = tp * Q
    cdef int plan[2]
    cdef int nv = _plan_walk(1, tp, Q, Q, 1, False, kdim, plan)
    cdef int mr0 = pcc_main_mr(nv)
    cdef int failed[1]
    cdef int *off = <int *>malloc(sizeof(int) * kdim)
    cdef float *cols = NULL
    cdef float *ct = NULL
    cdef int it, n, t, p0, p1
    failed[0] = 0
    if off == NULL:
        return 1
    pcc_offsets_tile(kdim, ldb, off)
    nt = _min(nt, N * tiles)
    with nogil, parallel(num_threads=pc_cap(nt)):
        cols = <float *>malloc(sizeof(float) * (<Py_ssize_t>kdim * ldb + PCC_NR + 16))
        ct = <float *>malloc(sizeof(float) * PCC_MR_MAX * PCC_NR)
        if cols == NULL or ct == NULL:
            failed[0] = 1
        else:
            memset(cols, 0, sizeof(float) * (<Py_ssize_t>kdim * ldb + PCC_NR + 16))
        for it in prange(N * tiles, schedule="dynamic"):
            if failed[0]:
                continue
            n = it // tiles
            t = it % tiles
            p0 = t * tp
            p1 = _min(P, p0 + tp)
            pc_im2col(x + n * C * HW, H, W, K, S, pad, Q, 0, C, p0, p1, cols, ldb)
            pcc_conv_panels(w, O, kdim, mr0, nv, cols, off, 0, <Py_ssize_t>(p1 - p0) * Q, Q, Q,
                            y + n * O * PQ + p0 * Q, PQ, bias, scale, relu, ct)
        free(cols)
        free(ct)
    free(off)
    return failed[0]


cdef enum:
    # below this depth C*K*K the weight gradient runs along s (no transposed copy of dy)
    DW_DOT_MAX_KDIM = 32
    # the direct weight gradient over images sums runs of consecutive images in at most this many
    # groups (each its own dw^T, all of them at most DW_PARTIAL_BYTES), handed to threads as
    # they come free and added in group order: a thread slowed by a shared core takes fewer
    # groups, and dw has the same bits at every thread count
    DW_GROUPS = 16
    DW_PARTIAL_BYTES = 16 << 20


cdef int _dw_dot(const float *x, int N, int C, int H, int W, int pad, int K,
                 const float *dy, int O, int P, int Q, float *dw, int nt) noexcept:
    """Stride-1 weight gradient for a small depth C*K*K (see ``pcc_dwdot_accumulate``).

    Blocks of images (a few per thread, fixed by N and the thread count) are
    handed out as threads come free; each sums into its own dw (block 0 into
    dw itself) and the buffers are added in block order, so whichever thread
    takes a block the bits are the same. Returns 1 when scratch could not be
    allocated.
    """
    cdef int Hp = H + 2 * pad, Wp = W + 2 * pad
    cdef int kdim = C * K * K
    cdef int blk[2]
    cdef int variant = pcc_dwdot_choose(O, kdim, &blk[0], &blk[1])
    cdef int Opad = (O + blk[0] - 1) // blk[0] * blk[0]
    cdef int kpad = (kdim + blk[1] - 1) // blk[1] * blk[1]
    cdef Py_ssize_t lds = (<Py_ssize_t>P * Wp + PCC_VEC - 1) // PCC_VEC * PCC_VEC
    cdef Py_ssize_t img = <Py_ssize_t>C * Hp * Wp, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef Py_ssize_t wsize = <Py_ssize_t>O * kdim, dyw_size = <Py_ssize_t>Opad * lds
    cdef int slack = PCC_NR + K + 16
    cdef int failed[1]
    cdef int *off = <int *>calloc(kpad, sizeof(int))
    cdef float *acc = NULL
    cdef float *buf = NULL
    cdef float *dyw = NULL
    cdef float *dwt = NULL
    cdef int n, g, groups
    cdef Py_ssize_t e, j
    failed[0] = 0
    if off == NULL:
        return 1
    pcc_offsets_shifted(C, K, Hp, Wp, off)
    memset(dw, 0, sizeof(float) * wsize)
    nt = _min(nt, N)
    groups = 1 if nt <= 1 else _min(N, nt * PC_BLOCKS_PER_THREAD)
    if groups > 1:
        acc = <float *>calloc(<size_t>(groups - 1) * wsize, sizeof(float))
        if acc == NULL:
            free(off)
            return 1
    with nogil, parallel(num_threads=pc_cap(nt)):
        buf = <float *>malloc(sizeof(float) * (img + slack))
        dyw = <float *>malloc(sizeof(float) * dyw_size)
        if buf == NULL or dyw == NULL:
            failed[0] = 1
        else:
            memset(buf + img, 0, sizeof(float) * slack)
        for g in prange(groups, schedule="dynamic"):
            if failed[0]:
                continue
            dwt = dw if g == 0 else acc + (g - 1) * wsize
            for n in range(<int>((<long>N * g) // groups), <int>((<long>N * (g + 1)) // groups)):
                pcc_pad_image(x + n * C * HW, H, W, pad, Hp, Wp, 0, C, buf)
                pcc_dy_wide(dy + n * O * PQ, O, Opad, P, Q, Wp, lds, dyw)
                pcc_dwdot_accumulate(variant, dyw, lds, O, buf, off, kdim, lds, dwt)
        free(buf)
        free(dyw)
    if groups > 1 and not failed[0]:
        # fixed block order: dw = ((dw_0 + dw_1) + dw_2) + ...
        with nogil:
            for e in prange(wsize, schedule="guided", num_threads=pc_cap(nt if wsize > 16384 else 1)):
                for j in range(groups - 1):
                    dw[e] = dw[e] + acc[j * wsize + e]
    free(acc)
    free(off)
    return failed[0]


cdef int _dw_shifted(const float *x, int N, int C, int H, int W, int pad, int K,
                     const float *dy, int O, int P, int Q, float *dw, int nt, int stride=1) noexcept:
    """Stride-1 weight gradient dw (O, C*K*K) (overwritten) on the wide grid of the padded images.

    The sums are built transposed, dw^T (kpad, Opad), by ``pcc_dw_accumulate``.
    Enough images: runs of consecutive images (``DW_GROUPS``) sum into their own
    dw^T, taken by threads as they come free; the buffers are added in group order. Fewer images than
    threads: all images are padded once and each thread owns a range of dw^T
    rows. With ``stride > 1`` the grid is that of the image's phases (``pcc_pad_grid``, as in
    ``_conv_shifted``; the kernel must be at least the stride and C*K*K above DW_DOT_MAX_KDIM).
    Returns 1 when scratch could not be allocated.
    """
    cdef int Hp = H + 2 * pad, Wp = W + 2 * pad
    cdef int sd = stride if stride > 1 else 1
    cdef int Hg = (Hp + sd - 1) // sd, Wg = (Wp + sd - 1) // sd   # the grid: padded image or phases
    cdef int kdim = C * K * K
    cdef int kpad = (kdim + PCC_KR_MAX - 1) // PCC_KR_MAX * PCC_KR_MAX
    cdef Py_ssize_t ldd = (O + PCC_VEC - 1) // PCC_VEC * PCC_VEC
    cdef Py_ssize_t S = <Py_ssize_t>P * Wg
    cdef Py_ssize_t img = <Py_ssize_t>C * sd * sd * Hg * Wg, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef Py_ssize_t tsize = <Py_ssize_t>kpad * ldd, dyt_size = S * ldd
    cdef int slack = PCC_NR + K + 16
    cdef int nkb = kpad // PCC_KR_MAX
    cdef bint by_image = nt == 1 or (N >= nt and _even_split(N, nt)) or nkb < nt
    cdef int groups = <int>max(1, min(<Py_ssize_t>min(N, DW_GROUPS), DW_PARTIAL_BYTES // (4 * tsize)))
    cdef int g
    cdef int failed[1]
    cdef int *off = <int *>calloc(kpad, sizeof(int))
    cdef float *acc = NULL
    cdef float *buf = NULL
    cdef float *dyT = NULL
    cdef float *dwt = NULL
    cdef float *shared = NULL
    cdef int n, tid = 0, i, k0, k1, o, kb
    cdef Py_ssize_t e, j, pl
    failed[0] = 0
    if kdim <= DW_DOT_MAX_KDIM and sd == 1:
        free(off)
        return _dw_dot(x, N, C, H, W, pad, K, dy, O, P, Q, dw, nt)
    if off == NULL:
        return 1
    pcc_offsets_grid(C, K, sd, Hg, Wg, off)
    if by_image:
        groups = max(groups, _min(nt, N))   # memory caps the groups, never below one per thread
        nt = _min(nt, groups)
        acc = <float *>malloc(sizeof(float) * <size_t>groups * tsize)
        if acc == NULL:
            free(off)
            return 1
        with nogil, parallel(num_threads=pc_cap(nt)):
            buf = <float *>malloc(sizeof(float) * (img + slack))
            dyT = <float *>malloc(sizeof(float) * dyt_size)
            if buf == NULL or dyT == NULL:
                failed[0] = 1
            else:
                memset(buf + img, 0, sizeof(float) * slack)
            for g in prange(groups, schedule="dynamic"):
                if failed[0]:
                    continue
                dwt = acc + g * tsize
                memset(dwt, 0, sizeof(float) * tsize)
                for n in range(<int>((<long>N * g) // groups), <int>((<long>N * (g + 1)) // groups)):
                    pcc_pad_grid(x + n * C * HW, H, W, pad, sd, Hg, Wg, 0, C, buf)
                    pcc_dy_transposed(dy + n * O * PQ, O, P, Q, Wg, ldd, dyT)
                    pcc_dw_accumulate(dyT, ldd, buf, off, 0, kdim, S, dwt)
            free(buf)
            free(dyT)
        if not failed[0]:
            with nogil:
                if groups > 1:
                    # fixed group order: dw^T = ((dw^T_0 + dw^T_1) + dw^T_2) + ...
                    for e in prange(tsize, schedule="guided", num_threads=pc_cap(nt if tsize > 16384 else 1)):
                        for j in range(1, groups):
                            acc[e] = acc[e] + acc[j * tsize + e]
                pcc_dw_untranspose(acc, ldd, O, kdim, dw)
        free(acc)
    else:
        nt = _min(nt, nkb)
        kb = _min(nkb, nt * PC_BLOCKS_PER_THREAD)
        shared = <float *>malloc(sizeof(float) * (N * (img + dyt_size) + tsize + slack))
        if shared == NULL:
            free(off)
            return 1
        dwt = shared + N * (img + dyt_size)
        memset(dwt, 0, sizeof(float) * (tsize + slack))
        with nogil:
            for pl in prange(<Py_ssize_t>N * (C + 1), schedule="guided", num_threads=pc_cap(nt)):
                n = <int>(pl // (C + 1))
                i = <int>(pl % (C + 1))
                if i < C:
                    pcc_pad_grid(x + n * C * HW, H, W, pad, sd, Hg, Wg, i, i + 1, shared + n * img)
                else:
                    pcc_dy_transposed(dy + n * O * PQ, O, P, Q, Wg, ldd, shared + N * img + n * dyt_size)
            # blocks of dw^T rows, a few per thread, handed out as threads come free; every row sums
            # its images in order on whichever thread, so the blocks do not change the bits
            for i in prange(kb, schedule="dynamic", num_threads=pc_cap(nt)):
                k0 = PCC_KR_MAX * <int>((<long>nkb * i) // kb)
                k1 = _min(kdim, PCC_KR_MAX * <int>((<long>nkb * (i + 1)) // kb))
                for n in range(N):
                    pcc_dw_accumulate(shared + N * img + n * dyt_size, ldd, shared + n * img, off, k0, k1, S,
                                      dwt)
            pcc_dw_untranspose(dwt, ldd, O, kdim, dw)
        free(shared)
    free(off)
    return failed[0]
