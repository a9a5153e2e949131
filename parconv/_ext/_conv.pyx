# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
"""conv2d kernels for square kernels, one stride and symmetric padding (``parconv.backends.openmp``).

This module holds the entry points (``conv2d_forward``, ``conv2d_backward``,
``fold_batch_norm``), which choose the algorithm for a shape: that choice is
made here and nowhere else. Each algorithm family is in its own file,
included here (one extension module per ISA level, sharing helpers, so the
compiler can inline across families as before), with the C kernels declared
once in ``pc_conv.pxd``:

* ``_conv_direct.pxi``: register-blocked micro-kernels (``pc_conv.h``) on
  shifted views of each zero-padded image, no im2col matrix. Forward ``y = w
  @ B``; input gradient as the stride-1 convolution of dy with the flipped,
  transposed filters (padding K - 1 - padding); weight gradient ``dw = dy @
  B^T``, vectorised along the filters or, for a small depth C*K*K, along the
  positions. Stride > 1 splits each image into its stride x stride phases
  (``pcc_pad_phases``), a stride-1 convolution for the same micro-kernels; a
  kernel narrower than the stride runs them on im2col tiles of a few output
  rows in thread-private scratch instead.
* ``_conv_winograd.pxi``: 3x3 stride-1 layers with many channels and filters
  (``winograd_applies``) by Winograd F(2x2, 3x3) (``pc_winograd.h``): input
  and filter transforms, 16 GEMMs per block of tiles on the same
  micro-kernels, output transform; the weight gradient's GEMMs (depth: the
  tiles) are sgemm calls. Its drivers also run F(4x4, 3x3).
* ``_conv_winograd4.pxi``: where Winograd F(4x4, 3x3) (``pc_winograd4.h``,
  36 points) takes over in a batch (``winograd4_applies``,
  ``winograd4_dw_applies``).
* ``_conv_blas.pxi``: the backward by im2col +
  ``scipy.linalg.cython_blas.sgemm`` where the direct one does not apply
  (row-major matrices go to the column-major BLAS as their transposes). The
  caller limits the BLAS library to one thread around those calls, since
  every sgemm here runs inside an OpenMP parallel region.
* ``_conv_fused.pxi``: conv2d_relu_maxpool2d, conv2d -> ReLU -> maxpool2d
  (-> linear) in one pass, forward and backward (``pc_fused.h``).

``fold_batch_norm`` turns an eval-mode BatchNorm after a convolution into the
``scale`` and bias every forward path applies in its store.

Work is split into chunks (images, rows or panels of output positions,
channel or tap blocks), never more threads than chunks, and every chunk
writes its own part of the output; weight-gradient partial sums live in
one buffer per block of a split fixed by the shape and the thread count,
added in block order, so a thread count always gives the same bits. Inputs are trusted: shapes, dtypes and contiguity are validated in
Python.
"""


cimport cython
from cython.parallel cimport parallel, prange
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from libc.math cimport sqrt
from scipy.linalg.cython_blas cimport sgemm

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_work_get, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns, pc_sync, pc_sync_init,
    pc_sync_wait, pc_gate, pc_gate_init, pc_gate_take, pc_gate_done, pc_gate_wait)
from .pc_pool cimport PC_POOL_U16_MAX, pc_pool_bases, pc_pool_plane, pc_pool_plane_u16
from .pc_conv cimport *


def kernel_isa():
    """Instruction set the convolution micro-kernels were compiled for."""
    return PCC_ISA.decode()


# ------------------------------------------------------------ helpers shared by the families

cdef enum:
    # a 3x3 stride-1 layer's multiply-adds over the multiplies its Winograd transform leaves
    # (2.25 for F(2x2, 3x3), 4 for F(4x4, 3x3), less the transforms): for pc_work's estimate
    WINOGRAD_MAC_GAIN = 3

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
        for o in prange(O, schedule="guided", num_threads=pc_cap(nt)):
            s = 0.0
            for n in range(N):
                s = s + pc_sum_f32(dyp + (n * <Py_ssize_t>O + o) * PQ, PQ)
            db[o] = <float>s


# ------------------------------------------------------------ the algorithm families
include "_conv_direct.pxi"
include "_conv_winograd.pxi"
include "_conv_winograd4.pxi"
include "_conv_blas.pxi"
include "_conv_fused.pxi"


# ------------------------------------------------------------ entry points: the algorithm chosen per shape

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
    cdef double macs = <double>N * O * P * Q * C * K * K
    cdef bint w4 = winograd and winograd4 and winograd4_applies(C, O, K, stride, P, Q, N)
    if w4 or (winograd and winograd_applies(C, O, K, stride, P, Q, N)):
        pc_work(pc_conv_ns(macs / WINOGRAD_MAC_GAIN))  # the transform leaves fewer multiplies
        failed = _conv_winograd(&x[0, 0, 0, 0], N, C, H, W, padding, &w[0, 0, 0, 0], O, bp,
                                &y[0, 0, 0, 0], P, Q, nt, sp, relu, w4)
    elif K >= stride or stride == 1:
        pc_work(pc_conv_ns(macs))
        # stride 1: the padded images; else their phases (every tap reads one; a narrower kernel
        # would leave phases unread)
        failed = _conv_shifted(&x[0, 0, 0, 0], N, C, H, W, padding, K, &w[0, 0, 0, 0], 0, O, bp,
                               &y[0, 0, 0, 0], P, Q, nt, 0, 0, NULL, False, False, NULL, NULL, NULL, 0, stride,
                               sp, relu)
    else:
        # a kernel narrower than its stride gathers its columns: the images' floats count as well
        pc_work(pc_conv_ns(macs) + pc_elems_ns(<double>N * (<double>C * H * W + <double>O * P * Q)))
        failed = _conv_tiled(&x[0, 0, 0, 0], N, C, H, W, stride, padding, K, &w[0, 0, 0, 0], O, bp,
                             &y[0, 0, 0, 0], P, Q, nt, tile_bytes, sp, relu)
    pc_work(0)
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
    # each product: the multiply-adds of the forward
    cdef double macs = <double>N * O * P * Q * C * K * K
    if dx is not None:
        dxp = &dx[0, 0, 0, 0]
    if dx_by_conv:
        pc_work(pc_conv_ns(macs))
        failed = _conv_shifted(dyp, N, O, P, Q, K - 1 - padding, K, wp, O, C, NULL, dxp, H, W, nt)
    if not failed and dw_by_kernel:
        pc_work(pc_conv_ns(macs))
        failed = _dw_shifted(xp, N, C, H, W, padding, K, dyp, O, P, Q, dwp, nt, stride)
    if not failed and (not dw_by_kernel or (dx is not None and not dx_by_conv)):
        # im2col reads the images and col2im zeroes and scatters into dx: their floats count as well
        pc_work(pc_conv_ns(macs * (2 - dw_by_kernel - (dx is None or dx_by_conv)))
                + pc_elems_ns(<double>N * (<double>C * H * W * ((not dw_by_kernel) + (dx is not None and not dx_by_conv))
                                           + <double>O * P * Q)))
        failed = _backward_blas(xp, N, C, H, W, wp, O, K, dyp, P, Q, stride, padding,
                                NULL if dx_by_conv else dxp, NULL if dw_by_kernel else dwp, nt, tile_bytes)
    pc_work(0)
    if failed:
        raise MemoryError("conv2d_backward: could not allocate scratch")
    if db is not None:
        pc_work(pc_elems_ns(<double>N * O * P * Q))
        _sum_planes(dy, db, num_threads)
        pc_work(0)


include "_team.pxi"
