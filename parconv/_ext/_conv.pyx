# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
"""conv2d kernels.

Stride 1 (the common case) runs entirely on register-blocked micro-kernels
(``pc_conv.h``) reading a zero-padded copy of each image in place, with no
im2col matrix:

* forward: ``y = w @ B`` with B(k, s) a shifted view of the padded image;
* input gradient: the stride-1 convolution of dy with the flipped,
  transposed filters (padding K - 1 - padding);
* weight gradient: ``dw = dy @ B^T``, vectorised along the filters (dy packed
  transposed) or, for a small depth C*K*K, along the positions.

3x3 stride-1 layers with many channels and filters (``winograd_applies``)
run the forward as Winograd F(2x2, 3x3) instead (``pc_winograd.h``): input and
filter transforms, 16 GEMMs per block of tiles on the same micro-kernels, output
transform. The Winograd weight gradient's GEMMs (depth: the tiles) are sgemm calls.

Stride > 1: the forward splits each image into its stride x stride phases
(``pcc_pad_phases``), which makes it a stride-1 convolution for the same
micro-kernels (``_conv_shifted`` on the phases' grid); a kernel narrower than
the stride runs them on im2col tiles of a few output rows in thread-private
scratch instead. The backward uses im2col +
``scipy.linalg.cython_blas.sgemm`` (row-major matrices go to the column-major
BLAS as their transposes). The caller (``parconv.backends.openmp``) limits
the BLAS library to one thread around those calls, since every sgemm here
runs inside an OpenMP parallel region.

Work is split into chunks (images, rows or panels of output positions,
channel or tap blocks), never more threads than chunks, and every chunk
writes its own part of the output; weight-gradient partial sums live in
per-thread buffers added in thread order, so a thread count always gives the
same bits. Inputs are trusted: shapes, dtypes and contiguity are validated in
Python.
"""

cimport cython
from cython.parallel cimport parallel, prange, threadid
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from libc.math cimport sqrt
from scipy.linalg.cython_blas cimport sgemm

from .pc_helpers cimport PC_BLOCKS_PER_THREAD
from .pc_pool cimport PC_POOL_U16_MAX, pc_pool_bases, pc_pool_plane, pc_pool_plane_u16

# the argmax of a pooled plane: uint16 for planes of at most PC_POOL_U16_MAX positions (half the
# bytes of int32 for the forward to write and the backward to read back), else int32
ctypedef fused pool_index_t:
    int
    unsigned short

cdef extern from "pc_common.h":
    void pc_im2col(const float *x, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *cols, Py_ssize_t ld) noexcept nogil
    void pc_col2im(const float *dcols, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *dx) noexcept nogil
    double pc_sum_f32(const float *p, Py_ssize_t n) noexcept nogil
    void *pc_align64(void *p) noexcept nogil

cdef extern from "pc_conv.h":
    int PCC_NR, PCC_VEC, PCC_NVMAX, PCC_MR_MAX, PCC_KR_MAX
    const char *PCC_ISA
    int pcc_main_mr(int nv) noexcept nogil
    void pcc_flip_filters(const float *w, int O, int C, int K, int c0, int c1, float *wt) noexcept nogil
    void pcc_pad_image(const float *x, int H, int W, int pad, int Hp, int Wp, int c0, int c1,
                       float *xp) noexcept nogil
    void pcc_offsets_shifted(int C, int K, int Hp, int Wp, int *off) noexcept nogil
    void pcc_offsets_tile(int kdim, int ldb, int *off) noexcept nogil
    void pcc_pad_grid(const float *x, int H, int W, int pad, int S, int Hg, int Wg, int c0, int c1,
                      float *buf) noexcept nogil
    void pcc_offsets_grid(int C, int K, int S, int Hg, int Wg, int *off) noexcept nogil
    void pcc_conv_panels(const float *a, int O, int kdim, int mr0, int nv, const float *b, const int *off,
                         Py_ssize_t s_begin, Py_ssize_t s_end, int Wg, int Q, float *y, Py_ssize_t ldy,
                         const float *bias, const float *scale, int relu, float *ct) noexcept nogil
    void pcc_conv_rows(const float *a, int O, int kdim, int mr0, int nv, const float *b, const int *off,
                       int p_begin, int p_end, int Wg, int Q, float *y, Py_ssize_t ldy,
                       const float *bias, const float *scale, int relu, float *ct) noexcept nogil
    void pcc_dw_accumulate(const float *dyT, Py_ssize_t ldd, const float *b, const int *off,
                           int k_begin, int k_end, Py_ssize_t S, float *dwT) noexcept nogil
    void pcc_dy_transposed(const float *dy, int O, int P, int Q, int Wg, Py_ssize_t ldd,
                           float *dyT) noexcept nogil
    void pcc_dw_untranspose(const float *dwT, Py_ssize_t ldd, int O, int kdim, float *dw) noexcept nogil
    int pcc_dwdot_choose(int O, int kdim, int *mr, int *nj) noexcept nogil
    void pcc_dwdot_accumulate(int variant, const float *dyw, Py_ssize_t lds, int O, const float *b,
                              const int *off, int kdim, Py_ssize_t S, float *dw) noexcept nogil
    void pcc_dy_wide(const float *dy, int O, int O_pad, int P, int Q, int Wg, Py_ssize_t lds,
                     float *dyw) noexcept nogil

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
    (row walk) or panels (panel walk) of each image.

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
    cdef int it, n, ch, ua, ub, o
    cdef Py_ssize_t i
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
            with nogil:
                for it in prange(O, schedule="guided", num_threads=_min(nt, O) if <Py_ssize_t>O * kdim > 16384 else 1):
                    pcc_flip_filters(w, flip_O, O, K, it, it + 1, wt)
        with nogil, parallel(num_threads=nt):
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
        with nogil:
            # one pass flips the filters (input gradient) and pads the planes
            for i in prange(nf + <Py_ssize_t>N * C, schedule="guided", num_threads=nt):
                if i < nf:
                    pcc_flip_filters(w, flip_O, O, K, <int>i, <int>i + 1, wt)
                else:
                    pcc_pad_grid(x + ((i - nf) // C) * C * HW, H, W, pad, sd, Hg, Wg, <int>((i - nf) % C),
                                  <int>((i - nf) % C) + 1, shared + ((i - nf) // C) * img)
        with nogil, parallel(num_threads=nt):
            ct = <float *>malloc(sizeof(float) * PCC_MR_MAX * PCC_NR)
            if ct == NULL:
                failed[0] = 1
            for it in prange(N * cpi, schedule="dynamic"):
                if failed[0]:
                    continue
                n = it // cpi
                ch = it % cpi
                ua = <int>((<long>units * ch) // cpi)
                ub = <int>((<long>units * (ch + 1)) // cpi)
                if by_rows:
                    pcc_conv_rows(a, O, kdim, mr0, nv, shared + n * img, off, ua, ub, Wg, Q,
                                  y + n * O * PQ, PQ, bias, scale, relu, ct)
                else:
                    pcc_conv_panels(a, O, kdim, mr0, nv, shared + n * img, off, <Py_ssize_t>ua * nr,
                                    min(<Py_ssize_t>ub * nr, s_end), Wg, Q, y + n * O * PQ, PQ, bias, scale,
                                    relu, ct)
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
    with nogil, parallel(num_threads=nt):
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


cdef extern from "pc_winograd.h":
    void pcw_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch) noexcept nogil
    Py_ssize_t pcw_filter_scratch_floats(int C) noexcept nogil
    Py_ssize_t pcw_scratch_floats(int tW, int rb) noexcept nogil
    void pcw_input(const float *x, int C, int H, int W, int pad, int ty0, int ty1, int tW,
                   float *V, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw_output(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, int o0, int o1, int ty0, int ty1,
                    int tW, int P, int Q, const float *bias, const float *scale, int relu, float *y,
                    float *scratch) noexcept nogil
    void pcw_dy(const float *dy, int O, int P, int Q, int ty0, int ty1, int tW,
                float *dM, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch) noexcept nogil


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


# rules (min channels, min filters, min tiles, min tiles x filters), any of which takes Winograd:
# two for one image (wide layers; narrow ones over large maps), one for a batch
cdef int[12] _wino_limits = [WINOGRAD_MIN_C, WINOGRAD_MIN_O, WINOGRAD_MIN_TILES, WINOGRAD_MIN_TILES_X_O,
                             WINOGRAD_NARROW_MIN_C, WINOGRAD_MIN_O, WINOGRAD_NARROW_MIN_TILES,
                             WINOGRAD_MIN_TILES_X_O,
                             WINOGRAD_BATCH_MIN_C, WINOGRAD_BATCH_MIN_O, WINOGRAD_BATCH_MIN_TILES,
                             WINOGRAD_BATCH_MIN_TILES_X_O]


cdef tuple _swap_limits(int *lim, int n, limits):
    """The n thresholds at lim, as a tuple taken before ``limits`` (n numbers, or None to keep
    them) replaces them: the shared body of the ``_set_*_limits`` functions."""
    old = tuple(lim[i] for i in range(n))
    if limits is not None:
        if len(limits) != n:
            raise ValueError(f"limits must have {n} entries, got {len(limits)}")
        for i in range(n):
            lim[i] = int(limits[i])
    return old


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


cdef extern from "pc_winograd4.h":
    void pcw4_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch) noexcept nogil
    Py_ssize_t pcw4_filter_scratch_floats(int C) noexcept nogil
    void pcw4_output(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, Py_ssize_t t0, int o0, int o1, int ty0,
                     int ty1, int tW, int P, int Q, const float *bias, const float *scale, int relu, float *y,
                     float *scratch) noexcept nogil
    Py_ssize_t pcw4_input_images_scratch_floats(int ipb, int tW, int rb) noexcept nogil
    void pcw4_input_images(const float *x, int n0, int n1, int C, int H, int W, int pad, int ty0, int ty1,
                           int tW, float *V, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw4_output_block(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, int n0, int n1, int O, int o0,
                           int o1, int ty0, int ty1, int tW, int P, int Q, const float *bias,
                           const float *scale, int relu, float *y, float *scratch) noexcept nogil
    Py_ssize_t pcw4_dy_scratch_floats(int ipb, int tW, int rb) noexcept nogil
    void pcw4_dy_block(const float *dy, int n0, int n1, int O, int P, int Q, int ty0, int ty1, int tW,
                       float *dM, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    Py_ssize_t pcw4_filters_grad_scratch_floats(int C) noexcept nogil
    void pcw4_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch) noexcept nogil
    void pcw4_dot_gemm(int O, int C, Py_ssize_t K, const float *A, Py_ssize_t lda, const float *B, Py_ssize_t ldb,
                       float *Cout, Py_ssize_t ldc, int beta) noexcept nogil


cdef enum:
    # transformed input + GEMM output of one F(4x4, 3x3) block of tiles (bytes)
    WINOGRAD4_BLOCK_BYTES = 1 << 19
    # F(4x4, 3x3) takes a batch of at least WINOGRAD_BATCH_MIN_IMAGES with this many channels
    # and filters and outputs at least this many rows and columns
    WINOGRAD4_MIN_C = 16
    WINOGRAD4_MIN_O = 16
    WINOGRAD4_MIN_SIDE = 8


cdef int[3] _wino4_limits = [WINOGRAD4_MIN_C, WINOGRAD4_MIN_O, WINOGRAD4_MIN_SIDE]


def _set_winograd4_limits(limits=None):
    """The thresholds of :func:`winograd4_applies` (min channels, min filters, min output side);
    with ``limits`` None they stay. Returns the previous ones (tests and tuning)."""
    return _swap_limits(_wino4_limits, 3, limits)


def winograd4_applies(int C, int O, int K, int stride, int P, int Q, int N=1):
    """Whether :func:`conv2d_forward` takes the Winograd F(4x4, 3x3) path for this shape
    (``N`` images in the batch): a 3x3 stride-1 layer in a batch, wide enough and over large
    enough maps that its blocks of whole images keep the 36 GEMMs deep."""
    return (K == 3 and stride == 1 and N >= WINOGRAD_BATCH_MIN_IMAGES and C >= _wino4_limits[0]
            and O >= _wino4_limits[1] and P >= _wino4_limits[2] and Q >= _wino4_limits[2])


cdef Py_ssize_t _fwd_blocks(int N, int C, int O, int P, int Q, int nt, int *ipb, int *rb, int *bpi,
                           bint f4) noexcept nogil:
    """Blocks of the Winograd forward (F(4x4, 3x3) with ``f4``, else F(2x2, 3x3)): ``ipb`` whole
    images per block where an F(4x4, 3x3) image's V and M fit WINOGRAD4_BLOCK_BYTES (``bpi`` =
    1), else ``bpi`` blocks of ``rb`` tile rows of one image (WINOGRAD_BLOCK_BYTES for F(2x2,
    3x3)); at least one block per thread where the batch allows. Returns the tiles of a full
    block (the GEMMs' width and the planes' row stride), for F(4x4, 3x3) rounded up to whole
    vectors of 8 (pcw4_input_block)."""
    cdef int m = 4 if f4 else 2
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef Py_ssize_t per_tile = 4 * (m + 2) * (m + 2) * (<Py_ssize_t>C + O)  # bytes of V and M for one tile
    cdef Py_ssize_t cap = max(<Py_ssize_t>1, (WINOGRAD4_BLOCK_BYTES if f4 else WINOGRAD_BLOCK_BYTES) // per_tile)
    cdef Py_ssize_t img_tiles = <Py_ssize_t>tH * tW
    if f4 and img_tiles <= cap:
        ipb[0] = <int>min(<Py_ssize_t>N, cap // img_tiles)
        ipb[0] = max(1, min(ipb[0], (N + nt - 1) // nt))
        rb[0] = tH
        bpi[0] = 1
        return (<Py_ssize_t>ipb[0] * img_tiles + 7) & ~7
    ipb[0] = 1
    rb[0] = <int>max(<Py_ssize_t>1, min(cap // tW, <Py_ssize_t>tH))
    bpi[0] = (tH + rb[0] - 1) // rb[0]
    if N * bpi[0] < nt:                   # a block for every thread
        bpi[0] = min(tH, (nt + N - 1) // N)
    rb[0] = (tH + bpi[0] - 1) // bpi[0]   # equal blocks
    bpi[0] = (tH + rb[0] - 1) // rb[0]
    return (<Py_ssize_t>rb[0] * tW + 7) & ~7 if f4 else <Py_ssize_t>rb[0] * tW


cdef int _conv_winograd(const float *x, int N, int C, int H, int W, int pad,
                        const float *w, int O, const float *bias, float *y, int P, int Q, int nt,
                        const float *scale, bint relu, bint f4) noexcept:
    """Stride-1 3x3 forward by Winograd: F(4x4, 3x3) with ``f4`` (``pc_winograd4.h``, 36
    transform points), else F(2x2, 3x3) (``pc_winograd.h``, 16).

    Blocks (:func:`_fwd_blocks`: tile rows of one image, or for F(4x4, 3x3) whole images
    where an image has few tiles, since a block's tiles are the width of its GEMMs and the
    micro-kernels want whole panels) are split over threads; each thread transforms its
    block's input into private scratch, runs the GEMMs and transforms the result straight
    into y, so every output has the same bits at any thread count. The GEMMs are the
    convolution's register-blocked micro-kernels reading U and V in place: a block has a
    few dozen tiles, and a BLAS sgemm would pack all of U[xi] for each of them.
    ``scale``, ``relu``: as ``_conv_shifted``. Returns 1 when scratch could not be allocated.
    """
    cdef int m = 4 if f4 else 2, pts = 36 if f4 else 16
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef int ipb, rb, bpi, nblocks
    cdef Py_ssize_t ldt = _fwd_blocks(N, C, O, P, Q, nt, &ipb, &rb, &bpi, f4)
    cdef Py_ssize_t ldxv, ldxm, HW = <Py_ssize_t>H * W, img_out = <Py_ssize_t>O * P * Q
    cdef Py_ssize_t rows_tiles, nb, scratch
    cdef float *U = <float *>malloc(sizeof(float) * pts * <size_t>O * C)
    cdef int *off = <int *>malloc(sizeof(int) * <size_t>C)
    cdef float *Vraw
    cdef float *V
    cdef float *M
    cdef float *scr
    cdef float *ct
    cdef int failed[1]
    cdef int blk, n, n0, n1, ty0, ty1, xi, o, nv, mr0
    failed[0] = 0
    if U == NULL or off == NULL:
        free(U)
        free(off)
        return 1
    nblocks = ((N + ipb - 1) // ipb) * bpi
    nt = _min(nt, nblocks)
    ldxv = _wino_plane_stride(C, ldt)
    ldxm = _wino_plane_stride(O, ldt)
    if f4:
        scratch = pcw4_input_images_scratch_floats(ipb, tW, rb) + pcw4_filter_scratch_floats(C)
    else:
        scratch = pcw_scratch_floats(tW, rb) + pcw_filter_scratch_floats(C)
    pcc_offsets_tile(C, <int>ldt, off)   # V[xi] row c: the micro-kernels' B(c, t) = V[xi][c * ldt + t]
    with nogil, parallel(num_threads=nt):
        # V, M and the scratch start on a cache line (ldxv, ldxm are multiples of 16 floats),
        # so no 16-float store of a transform splits across two lines
        Vraw = <float *>malloc(sizeof(float) * (pts * <size_t>(ldxv + ldxm) + scratch + PCC_MR_MAX * PCC_NR) + 64)
        V = <float *>pc_align64(Vraw)
        if V == NULL:
            failed[0] = 1
        else:
            # the last panel of a block reads whole vectors past its tiles: zeros, not stale floats
            memset(V, 0, sizeof(float) * pts * <size_t>ldxv)
        for o in prange(O, schedule="guided"):
            if V != NULL:
                if f4:
                    pcw4_filters(w, O, C, o, o + 1, U, V + pts * ldxv)
                else:
                    pcw_filters(w, O, C, o, o + 1, U, V + pts * ldxv)
        if V != NULL:
            M = V + pts * ldxv
            ct = M + pts * ldxm
            scr = ct + PCC_MR_MAX * PCC_NR
        for blk in prange(nblocks, schedule="dynamic"):
            if V != NULL:  # every thread must reach the loop; one without scratch skips its blocks
                n0 = (blk // bpi) * ipb
                n1 = _min(N, n0 + ipb)
                ty0 = (blk % bpi) * rb
                ty1 = _min(tH, ty0 + rb)
                rows_tiles = <Py_ssize_t>(ty1 - ty0) * tW
                nb = (n1 - n0) * rows_tiles
                nv = _min(PCC_NVMAX, <int>((nb + PCC_VEC - 1) // PCC_VEC))
                mr0 = pcc_main_mr(nv)
                if f4:
                    pcw4_input_images(x, n0, n1, C, H, W, pad, ty0, ty1, tW, V, ldxv, ldt, scr)
                else:
                    pcw_input(x + n0 * C * HW, C, H, W, pad, ty0, ty1, tW, V, ldxv, ldt, scr)
                for xi in range(pts):
                    # M[xi] (O x nb) = U[xi] (O x C) @ V[xi] (C x nb): one row of nb positions
                    pcc_conv_panels(U + <Py_ssize_t>xi * O * C, O, C, mr0, nv, V + xi * ldxv, off,
                                    0, nb, <int>nb, <int>nb, M + xi * ldxm, ldt, NULL, NULL, 0, ct)
                if not f4:
                    pcw_output(M, ldxm, ldt, 0, O, ty0, ty1, tW, P, Q, bias, scale, relu, y + n0 * img_out, scr)
                elif tW % 8 == 0:  # whole vectors along each row, as the input transform
                    for n in range(n0, n1):
                        pcw4_output(M, ldxm, ldt, (n - n0) * rows_tiles, 0, O, ty0, ty1, tW, P, Q, bias, scale,
                                    relu, y + n * img_out, scr)
                else:
                    pcw4_output_block(M, ldxm, ldt, n0, n1, O, 0, O, ty0, ty1, tW, P, Q, bias, scale, relu, y, scr)
        free(Vraw)
    free(U)
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


cdef Py_ssize_t _dw_blocks(int N, int C, int O, int P, int Q, int *ipb, int *rb, int *bpi,
                          bint f4=False) noexcept nogil:
    """Blocks of the Winograd weight gradient (F(4x4, 3x3) with ``f4``, else F(2x2, 3x3)):
    ``ipb`` whole images per block when an image's V and dM fit WINOGRAD_DW_BLOCK_BYTES
    (``bpi`` = 1, ``rb`` = all tile rows), else ``bpi`` blocks of ``rb`` tile rows per image
    (``ipb`` = 1). Returns the tiles of a full block, the depth of its GEMMs; for F(4x4, 3x3)
    rounded up to whole vectors of 8 (the planes' row stride, see pcw4_input_block)."""
    cdef int m = 4 if f4 else 2
    cdef int tH = (P + m - 1) // m, tW = (Q + m - 1) // m
    cdef Py_ssize_t per_tile = 4 * (m + 2) * (m + 2) * (<Py_ssize_t>C + O)
    cdef Py_ssize_t per_image = per_tile * tH * tW, tiles
    if per_image <= WINOGRAD_DW_BLOCK_BYTES:
        ipb[0] = <int>min(<Py_ssize_t>max(N, 1), WINOGRAD_DW_BLOCK_BYTES // per_image)
        rb[0] = tH
        bpi[0] = 1
        tiles = <Py_ssize_t>ipb[0] * tH * tW
    else:
        ipb[0] = 1
        rb[0] = <int>max(1, min(WINOGRAD_DW_BLOCK_BYTES // (per_tile * tW), tH))
        bpi[0] = (tH + rb[0] - 1) // rb[0]
        rb[0] = (tH + bpi[0] - 1) // bpi[0]    # equal blocks
        bpi[0] = (tH + rb[0] - 1) // rb[0]
        tiles = <Py_ssize_t>rb[0] * tW
    return (tiles + 7) & ~7 if f4 else tiles


def winograd_dw_applies(int N, int C, int O, int K, int stride, int P, int Q):
    """Whether :func:`conv2d_backward_weights_winograd` pays for this layer: where the forward
    runs Winograd, with at least WINOGRAD_DW_MIN_O filters, rows of at least 8 tiles (the
    transforms' vectors) or of 4 to 7 whole tiles (an even Q from 8), and GEMMs at least
    WINOGRAD_DW_MIN_DEPTH tiles deep."""
    cdef int ipb, rb, bpi
    if not winograd_applies(C, O, K, stride, P, Q, N) or O < WINOGRAD_DW_MIN_O:
        return False
    if (Q + 1) // 2 < 8 and (Q & 1 or Q < 8):  # short rows with a half-empty last tile lose
        return False
    return _dw_blocks(N, C, O, P, Q, &ipb, &rb, &bpi) >= WINOGRAD_DW_MIN_DEPTH


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
    cdef int ipb, rb, bpi
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
    cdef bint first
    cdef float beta
    cdef int failed[1]
    cdef char tt = b'T', tn = b'N'
    cdef float one = 1.0
    failed[0] = 0
    ldt = _dw_blocks(N, C, O, P, Q, &ipb, &rb, &bpi, f4)
    nblocks = (N + ipb - 1) // ipb if bpi == 1 else N * bpi
    groups = <int>max(1, min(<Py_ssize_t>min(nblocks, WINOGRAD_DW_GROUPS),
                             WINOGRAD_DW_PARTIAL_BYTES // (4 * pts * OC)))
    ldti = <int>ldt
    ldxv = _wino_plane_stride(C, ldt)
    ldxm = _wino_plane_stride(O, ldt)
    if f4:
        scratch = max(pcw4_input_images_scratch_floats(ipb, tW, rb), pcw4_dy_scratch_floats(ipb, tW, rb))
    else:
        scratch = pcw_scratch_floats(tW, rb)
    dU = <float *>malloc(sizeof(float) * pts * <size_t>OC * groups)
    if dU == NULL:
        return 1
    with nogil, parallel(num_threads=_min(nt, groups)):
        Vraw = <float *>malloc(sizeof(float) * (pts * <size_t>(ldxv + ldxm) + scratch) + 64)
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
                        n0 = blk * ipb
                        n1 = _min(N, n0 + ipb)
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
        free(Vraw)
    if failed[0]:
        free(dU)
        return 1
    with nogil:
        # the groups' sums, added in group order (into group 0), then G^T dU G per filter
        for e in prange(pts * OC, schedule="guided", num_threads=nt):
            for g in range(1, groups):
                dU[e] = dU[e] + dU[<Py_ssize_t>g * pts * OC + e]
    with nogil, parallel(num_threads=_min(nt, O)):
        scr = <float *>malloc(sizeof(float) * (pcw4_filters_grad_scratch_floats(C) if f4
                                               else pcw_filter_scratch_floats(C)))
        if scr == NULL:
            failed[0] = 1
        for o in prange(O, schedule="guided"):
            if scr != NULL:
                if f4:
                    pcw4_filters_grad(dU, O, C, o, o + 1, dw, scr)
                else:
                    pcw_filters_grad(dU, O, C, o, o + 1, dw, scr)
        free(scr)
    free(dU)
    return failed[0]


cdef enum:
    # where the F(4x4, 3x3) weight gradient takes a layer of a batch whose forward runs F(4x4,
    # 3x3): at least WINOGRAD4_DW_MIN_C channels and _O filters, or from WINOGRAD4_DW_NARROW_MIN
    # of each when the batch has WINOGRAD4_DW_NARROW_MIN_TILES output tiles (narrower layers
    # need deeper GEMMs to pay for the transforms)
    WINOGRAD4_DW_MIN_O = 32
    WINOGRAD4_DW_MIN_C = 32
    WINOGRAD4_DW_NARROW_MIN = 16
    WINOGRAD4_DW_NARROW_MIN_TILES = 2048
    # products dU[xi] of at most this many filters x channels run on pcw4_dot_gemm, larger
    # ones on sgemm (which packs its operands, and then blocks them better for the caches)
    WINOGRAD4_DW_DOT_MAX_OC = 2048


cdef int[4] _wino4_dw_limits = [WINOGRAD4_DW_MIN_C, WINOGRAD4_DW_MIN_O, WINOGRAD4_DW_NARROW_MIN,
                                 WINOGRAD4_DW_NARROW_MIN_TILES]


def _set_winograd4_dw_limits(limits=None):
    """The thresholds of :func:`winograd4_dw_applies` (min channels, min filters, narrow min
    channels and filters, narrow min tiles); with ``limits`` None they stay. Returns the previous
    ones (tests and tuning)."""
    return _swap_limits(_wino4_dw_limits, 4, limits)


def winograd4_dw_applies(int N, int C, int O, int K, int stride, int P, int Q):
    """Whether :func:`conv2d_backward_weights_winograd` computes this layer's dw by Winograd
    F(4x4, 3x3): where the forward runs F(4x4, 3x3) with at least WINOGRAD4_DW_MIN_C channels
    and WINOGRAD4_DW_MIN_O filters, or with WINOGRAD4_DW_NARROW_MIN of each over at least
    WINOGRAD4_DW_NARROW_MIN_TILES output tiles in the batch."""
    cdef long tiles = <long>N * ((P + 3) // 4) * ((Q + 3) // 4)
    if not winograd4_applies(C, O, K, stride, P, Q, N):
        return False
    if C >= _wino4_dw_limits[0] and O >= _wino4_dw_limits[1]:
        return True
    return C >= _wino4_dw_limits[2] and O >= _wino4_dw_limits[2] and tiles >= _wino4_dw_limits[3]


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
    failed = _dw_winograd(&x[0, 0, 0, 0], N, C, H, W, padding, &dy[0, 0, 0, 0], O, P, Q, &dw[0, 0, 0, 0],
                          num_threads if num_threads > 0 else 1,
                          winograd4 and winograd4_dw_applies(N, C, O, 3, 1, P, Q))
    if failed:
        raise MemoryError("conv2d_backward_weights_winograd: could not allocate scratch")
    if db is not None:
        _sum_planes(dy, db, num_threads)


def conv2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                   const float[:, :, :, ::1] w,  # IN  (O, C, K, K)
                   const float[::1] b,           # IN  (O,) or None
                   float[:, :, :, ::1] y,        # OUT (N, O, P, Q), overwritten
                   int stride, int padding, int num_threads,
                   Py_ssize_t tile_bytes=1048576, bint winograd=True,
                   const float[::1] scale=None,  # IN  (O,) or None
                   bint relu=False, bint winograd4=True):
    """Convolution forward, parallel over images or, for small batches, tiles of output positions.

    3x3 stride-1 layers run Winograd unless ``winograd`` is false: F(4x4, 3x3) in a
    batch with enough channels and filters (:func:`winograd4_applies`) unless ``winograd4``
    is false, else F(2x2, 3x3) where :func:`winograd_applies` says so. No BLAS call.

    With ``scale`` every output is ``conv * scale[o] + b[o]`` instead of
    ``conv + b[o]`` (an eval-mode BatchNorm folded into the store), and
    ``relu`` stores ``max(., 0)``: one pass over y for Conv2d -> BatchNorm -> ReLU.
    """
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = y.shape[2], Q = y.shape[3]
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef const float *bp = NULL
    cdef const float *sp = NULL
    cdef int failed
    if b is not None:
        bp = &b[0]
    if scale is not None:
        if scale.shape[0] != O or b is None or b.shape[0] != O:
            raise ValueError(f"conv2d_forward: scale and b must both have {O} entries with scale given")
        sp = &scale[0]
    if winograd and winograd4 and winograd4_applies(C, O, K, stride, P, Q, N):
        failed = _conv_winograd(&x[0, 0, 0, 0], N, C, H, W, padding, &w[0, 0, 0, 0], O, bp,
                                &y[0, 0, 0, 0], P, Q, nt, sp, relu, True)
    elif winograd and winograd_applies(C, O, K, stride, P, Q, N):
        failed = _conv_winograd(&x[0, 0, 0, 0], N, C, H, W, padding, &w[0, 0, 0, 0], O, bp,
                                &y[0, 0, 0, 0], P, Q, nt, sp, relu, False)
    elif K >= stride or stride == 1:
        # stride 1: the padded images; else their phases (every tap reads one; a narrower kernel
        # would leave phases unread)
        failed = _conv_shifted(&x[0, 0, 0, 0], N, C, H, W, padding, K, &w[0, 0, 0, 0], 0, O, bp,
                               &y[0, 0, 0, 0], P, Q, nt, 0, 0, NULL, False, False, NULL, NULL, NULL, 0, stride,
                               sp, relu)
    else:
        failed = _conv_tiled(&x[0, 0, 0, 0], N, C, H, W, stride, padding, K, &w[0, 0, 0, 0], O, bp,
                             &y[0, 0, 0, 0], P, Q, nt, tile_bytes, sp, relu)
    if failed:
        raise MemoryError("conv2d_forward: could not allocate scratch")


def fold_batch_norm(const float[::1] b, const float[::1] weight, const float[::1] bias,
                    const float[::1] running_mean, const float[::1] running_var, double eps,
                    float[::1] scale, float[::1] shift):
    """``scale``, ``shift`` (O,) (overwritten) of an eval-mode batch norm after a convolution with bias
    b (or None): ``bn(conv + b) = conv * scale + shift``, for :func:`conv2d_forward`'s ``scale``.

    ``scale = weight / sqrt(running_var + eps)``, ``shift = bias + (b - running_mean) * scale``
    (weight 1, bias 0 where None), in double precision, rounded once.
    """
    cdef Py_ssize_t O = scale.shape[0], o
    cdef double sc, sh
    if (shift.shape[0] != O or running_mean.shape[0] != O or running_var.shape[0] != O
            or (b is not None and b.shape[0] != O) or (weight is not None and weight.shape[0] != O)
            or (bias is not None and bias.shape[0] != O)):
        raise ValueError(f"fold_batch_norm: every array must have {O} entries")
    for o in range(O):
        sc = 1.0 / sqrt(<double>running_var[o] + eps)
        if weight is not None:
            sc = sc * weight[o]
        sh = ((<double>b[o] if b is not None else 0.0) - running_mean[o]) * sc
        if bias is not None:
            sh = sh + bias[o]
        scale[o] = <float>sc
        shift[o] = <float>sh


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
    with nogil, parallel(num_threads=nt):
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
            for e in prange(wsize, schedule="guided", num_threads=nt if wsize > 16384 else 1):
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
        with nogil, parallel(num_threads=nt):
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
                    for e in prange(tsize, schedule="guided", num_threads=nt if tsize > 16384 else 1):
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
            for pl in prange(<Py_ssize_t>N * (C + 1), schedule="guided", num_threads=nt):
                n = <int>(pl // (C + 1))
                i = <int>(pl % (C + 1))
                if i < C:
                    pcc_pad_grid(x + n * C * HW, H, W, pad, sd, Hg, Wg, i, i + 1, shared + n * img)
                else:
                    pcc_dy_transposed(dy + n * O * PQ, O, P, Q, Wg, ldd, shared + N * img + n * dyt_size)
            # blocks of dw^T rows, a few per thread, handed out as threads come free; every row sums
            # its images in order on whichever thread, so the blocks do not change the bits
            for i in prange(kb, schedule="dynamic", num_threads=nt):
                k0 = PCC_KR_MAX * <int>((<long>nkb * i) // kb)
                k1 = _min(kdim, PCC_KR_MAX * <int>((<long>nkb * (i + 1)) // kb))
                for n in range(N):
                    pcc_dw_accumulate(shared + N * img + n * dyt_size, ldd, shared + n * img, off, k0, k1, S,
                                      dwt)
            pcc_dw_untranspose(dwt, ldd, O, kdim, dw)
        free(shared)
    free(off)
    return failed[0]


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
        with nogil, parallel(num_threads=nt):
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
                for e in prange(wsize, schedule="guided", num_threads=nt):
                    for j in range(groups - 1):
                        dwp[e] = dwp[e] + acc[j * wsize + e]
        free(acc)
    else:
        nt = _min(nt, C)
        nb = _min(C, nt * PC_BLOCKS_PER_THREAD)
        with nogil, parallel(num_threads=nt):
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
    failed = _conv_shifted(&x[0, 0, 0, 0], N, C, H, W, padding, K, &w[0, 0, 0, 0], 0, O, bp,
                           &y[0, 0, 0, 0], P, Q, nt, pool_kernel, pool_stride, <void *>&argmax[0, 0, 0, 0],
                           pool_index_t is cython.ushort, uneven <= FUSED_FWD_UNEVEN_MACS, hwp, hbp, lp, G)
    if failed == 1:
        raise MemoryError("conv2d_relu_maxpool2d_forward: could not allocate scratch")
    return failed == 0


cdef enum:
    # extra multiply-adds the busiest thread may take so that the fused forward keeps whole images:
    # below it, one fused thread beats the composed ops on two
    FUSED_FWD_UNEVEN_MACS = 1 << 20


cdef extern from "pc_dense.h":
    int PCD_NARROW_G, PCD_BWD_FB
    void pcd_linear_fwd_rows4(const float *x, const float *w, const float *b, float *y,
                              const Py_ssize_t *rows, int nr, Py_ssize_t F, int G) noexcept nogil
    void pcd_linear_bwd_cols(const float *x, const float *w, const float *dy, float *dx, float *dw,
                             Py_ssize_t N, Py_ssize_t F, int G, Py_ssize_t f0, Py_ssize_t f1, int fb) noexcept nogil
    float pcd_bias_grad(const float *dy, Py_ssize_t N, int G, int g) noexcept nogil


cdef extern from "pc_fused.h":
    Py_ssize_t pcf_dw_scratch_floats(int C, int H, int W, int pad, int P, int Q, Py_ssize_t head_F) noexcept nogil
    void pcf_dw_images(const float *x, int C, int H, int W, int pad, int K, int P, int Q,
                       const float *y, const void *am, int am16, const float *dy, int O, int PQp, int n0, int n1,
                       const float *dyl, const float *wl, int G, double *acc, float *scratch) noexcept nogil
    void pcf_dw_reduce(const double *part, int nblocks, int O, Py_ssize_t kdim, float *dw, float *db) noexcept nogil
    Py_ssize_t pcf_dx_scratch_floats(int C, int H, int W, int pad, int P, int Q) noexcept nogil
    void pcf_dx(int n, int C, int H, int W, int pad, int K, int P, int Q, const float *w,
                const float *y, const void *am, int am16, const float *dy, int O, int PQp, float *dx,
                float *scratch) noexcept nogil


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
    with nogil:
        with parallel(num_threads=_min(nt, nitems)):
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
            with parallel(num_threads=_min(nt, N)):
                scr = <float *>malloc(sizeof(float) * dws)
                if scr == NULL:
                    failed[0] = 1
                for n in prange(N, schedule="dynamic"):
                    if scr != NULL:
                        pcf_dx(n, C, H, W, padding, K, P, Q, &w[0, 0, 0, 0], &y[0, 0, 0, 0], amp, am16,
                               dyp, O, PQp, &dx[0, 0, 0, 0], scr)
                free(scr)
    if failed[0]:
        raise MemoryError("conv2d_relu_maxpool2d_backward: could not allocate scratch")


def conv2d_backward(const float[:, :, :, ::1] x,   # IN  (N, C, H, W)
                    const float[:, :, :, ::1] w,   # IN  (O, C, K, K)
                    const float[:, :, :, ::1] dy,  # IN  (N, O, P, Q)
                    float[:, :, :, ::1] dx,        # OUT (N, C, H, W) or None, overwritten
                    float[:, :, :, ::1] dw,        # OUT (O, C, K, K), overwritten
                    float[::1] db,                 # OUT (O,) or None, overwritten
                    int stride, int padding, int num_threads,
                    Py_ssize_t tile_bytes=4194304):
    """Convolution backward: dx, dw and ``db = sum dy`` (all overwritten).

    Stride 1: dw by ``_dw_shifted`` (micro-kernels on the padded images), dx
    (padding < K) by ``_conv_shifted`` on dy with the flipped, transposed
    filters. Stride > 1: dw by ``_dw_shifted`` on the images' phases where the
    kernel is at least the stride. Otherwise im2col + sgemm (``_backward_blas``). db is summed per
    filter in double, one thread per filter.
    """
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2]
    cdef int P = dy.shape[2], Q = dy.shape[3]
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef const float *wp = &w[0, 0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = NULL
    cdef float *dwp = &dw[0, 0, 0, 0]
    cdef bint dx_by_conv = dx is not None and stride == 1 and padding <= K - 1
    # stride > 1: on the phases' grid where the kernel reads every phase and the depth is not tiny
    cdef bint dw_by_kernel = stride == 1 or (K >= stride and C * K * K > DW_DOT_MAX_KDIM)
    cdef int failed = 0
    if dx is not None:
        dxp = &dx[0, 0, 0, 0]
    if dx_by_conv:
        failed = _conv_shifted(dyp, N, O, P, Q, K - 1 - padding, K, wp, O, C, NULL, dxp, H, W, nt)
    if not failed and dw_by_kernel:
        failed = _dw_shifted(xp, N, C, H, W, padding, K, dyp, O, P, Q, dwp, nt, stride)
    if not failed and (not dw_by_kernel or (dx is not None and not dx_by_conv)):
        failed = _backward_blas(xp, N, C, H, W, wp, O, K, dyp, P, Q, stride, padding,
                                NULL if dx_by_conv else dxp, NULL if dw_by_kernel else dwp, nt, tile_bytes)
    if failed:
        raise MemoryError("conv2d_backward: could not allocate scratch")
    if db is not None:
        _sum_planes(dy, db, num_threads)


cdef void _sum_planes(const float[:, :, :, ::1] dy, float[::1] db, int num_threads) noexcept:
    """db[o] = sum over n, p, q of dy[n, o, p, q], in double, one thread per filter."""
    cdef int N = dy.shape[0], O = dy.shape[1]
    cdef Py_ssize_t PQ = <Py_ssize_t>dy.shape[2] * dy.shape[3]
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef int o, n
    cdef double s
    cdef int nt = num_threads if num_threads > 0 else 1
    if <Py_ssize_t>N * O * PQ < 65536:
        nt = 1
    nt = _min(nt, O)
    with nogil:
        for o in prange(O, schedule="guided", num_threads=nt):
            s = 0.0
            for n in range(N):
                s = s + pc_sum_f32(dyp + (n * <Py_ssize_t>O + o) * PQ, PQ)
            db[o] = <float>s
