# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output,
# K kernel (K x K), S stride. y = x * w + b with x (N, C, H, W), w (O, C, K, K),
# b (O,), y (N, O, P, Q), P = (H + 2 pad - K) // S + 1, Q likewise.
# kdim = C*K*K is the GEMM depth; T the spatial size of one tile of output rows;
# Hp, Wp the zero-padded input; NR the positions one micro-kernel call covers.
#
# Winograd F(4x4, 3x3) (``pc_winograd4.h``, 36 transform points), included by _conv.pyx: where it
# applies, forward (``winograd4_applies``) and weight gradient (``winograd4_dw_applies``), and the
# thresholds that decide it. The forward and weight-gradient drivers are shared with F(2x2, 3x3)
# (_conv_winograd.pxi), which runs them with ``f4`` set.


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


def _dot_gemm(const float[:, ::1] a, const float[:, ::1] b, float[:, ::1] out, bint accumulate=False):
    """``out (=|+=) a @ b.T`` by ``pcw4_dot_gemm``, the weight gradient's small-product kernel
    (kernel tests): a (O, K), b (C, K), out (O, C)."""
    if a.shape[1] != b.shape[1] or out.shape[0] != a.shape[0] or out.shape[1] != b.shape[0]:
        raise ValueError(f"_dot_gemm: a ({a.shape[0]}, {a.shape[1]}), b ({b.shape[0]}, {b.shape[1]}) and out "
                         f"({out.shape[0]}, {out.shape[1]}) do not make out = a @ b.T")
    if a.shape[0] == 0 or b.shape[0] == 0:
        return
    with nogil:
        pcw4_dot_gemm(<int>a.shape[0], <int>b.shape[0], a.shape[1], &a[0, 0], a.shape[1], &b[0, 0], b.shape[1],
                      &out[0, 0], out.shape[1], accumulate)


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
