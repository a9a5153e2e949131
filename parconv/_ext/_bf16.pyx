# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output, K kernel,
# F in-features, G out-features; Kd = C*K*K (a convolution's reduction, k = c*K*K + kh*K + kw).
"""bfloat16 convolution and linear kernels (bf16 inputs, fp32 accumulation).

Every input of a product is rounded to bf16 (round to nearest, ties to even),
the products are exact and summed in fp32, a bias is added in fp32. On the
avx512 level of a CPU with AVX512_BF16 the products run on VDPBF16PS (see
pc_bf16.h); :func:`native` says whether they do, and the product kernels raise
:class:`RuntimeError` where they do not (the caller then emulates them through
:func:`round_to_bf16` and the fp32 kernels). :func:`round_to_bf16` runs on
every level.

Convolutions are GEMMs over im2col panels of one image's block of output rows,
built in bf16 pairs per block so a panel stays in L2:

* forward: y[o][pix] = w[o][k] cols[k][pix], pixels along the vector lanes;
* dx, stride 1 (padding < K): the forward of dy with the flipped, transposed
  filters; otherwise dcols = w^T dy per block, scattered back by col2im;
* dw: dw^T[k][o] = cols[k][pix] dy^T[pix][o], summed per group of images,
  the groups' partials added in group order.

Work is handed out in blocks, dynamically; every output element is summed by
one thread in an order fixed by the shape and the thread count, so results
repeat bit for bit at a fixed thread count.
"""

import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdint cimport uint16_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_team, pc_threads_for, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_product_ns, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)

cdef extern from "pc_bf16.h":
    ctypedef Py_ssize_t pc_idx
    int PCB_NATIVE
    int pcb_cpu_native() noexcept nogil
    int pcb_amx_init() noexcept nogil
    int pcb_amx_set(int on) noexcept nogil
    int pcb_amx_cpp(int C) noexcept nogil
    pc_idx pcb_amx_plane(int RR, int Wp, int K) noexcept nogil
    void pcb_amx_wpack(const float *w, int O, int C, int K, int cpp, uint32_t *wa) noexcept nogil
    void pcb_amx_cpimage(const float *x, int C, int H, int W, int pad, int S, int K, int p0, int RR, int cpp,
                         int Wg, pc_idx L, uint32_t *img) noexcept nogil
    void pcb_amx_conv_rows(const uint32_t *img, pc_idx L, int cpp, int S, int Wg, const uint32_t *wa, int O,
                           int K, const float *b, float *y, int P, int Q, int p0, int p1, float *cb) noexcept nogil
    unsigned pcb_amx_dx_wpack(const float *w, int O, int C, int K, int S, int pad, int cpp, float *wsub,
                              uint32_t *wa) noexcept nogil
    void pcb_amx_dx_interleave(const float *ph, pc_idx phase, int Qs, int C, int H, int W, int S, int i0, int n,
                               unsigned live, float *dx) noexcept nogil
    void pcb_amx_dw_block(const float *x, int m, int C, int H, int W, int K, int pad, int S, const float *dy,
                          int O, int P, int Q, int p0, int p1, pc_idx L, float *part, pc_idx ldo, uint16_t *xb,
                          uint32_t *dyt) noexcept nogil
    double pcb_issue_seconds(int dot, long iters) noexcept nogil
    void *pc_align64(void *p) noexcept nogil
    pc_idx pcb_up16(pc_idx n) noexcept nogil
    double pc_sum_f32(const float *p, pc_idx n) noexcept nogil
    void pcb_round(const float *x, float *out, pc_idx n) noexcept nogil
    void pcb_pack(int kind, const float *src, pc_idx lds, pc_idx rows, pc_idx cols,
                  uint32_t *dst, pc_idx ldd, pc_idx d0, pc_idx d1) noexcept nogil
    void pcb_gemm(const uint32_t *A, pc_idx lda, pc_idx rows, const uint32_t *B, pc_idx ldb, pc_idx kp,
                  float *Cm, pc_idx ldc, pc_idx cols, const float *brow, const float *bcol,
                  int accumulate) noexcept nogil
    void pcb_conv_fwd_block(const float *x, int C, int H, int W, const uint32_t *wr, int O, int K, int S,
                            int pad, const float *b, float *y, int P, int Q, int p0, int p1,
                            uint32_t *panel, uint16_t *xb) noexcept nogil
    void pcb_conv_dw_block(const float *x, int C, int H, int W, int K, int S, int pad, const float *dy,
                           int O, int P, int Q, int p0, int p1, float *part, pc_idx ldo,
                           uint32_t *cols, uint32_t *dyt, uint16_t *xb) noexcept nogil
    Py_ssize_t pcb_s1_pairs(int C, int K) noexcept nogil
    Py_ssize_t pcb_s1_len(int nr, int K, int Wp) noexcept nogil
    void pcb_s1_schedule(const float *w, int O, int C, int K, int Wp, Py_ssize_t L, Py_ssize_t *boff,
                         uint32_t *ws) noexcept nogil
    int pcb_s1_rows(int m, int p0, int p1, int K) noexcept nogil
    void pcb_s1_fwd_block(const float *x, int m, int C, int H, int W, int K, int pad, int S, const uint32_t *ws,
                          const Py_ssize_t *boff, int O, const float *b, float *y, int P, int Q, int p0, int p1,
                          Py_ssize_t L, uint16_t *xb, uint32_t *img, float *acc) noexcept nogil
    void pcb_s1_dw_rows(int C, int K, int Wp, Py_ssize_t L, const uint16_t *xb, const uint32_t **arow) noexcept nogil
    void pcb_s1_dw_block(const float *x, int m, int C, int H, int W, int K, int pad, int S, const float *dy, int O, int P,
                         int Q, int p0, int p1, Py_ssize_t L, float *part, Py_ssize_t ldo, uint16_t *xb,
                         const uint32_t **arow, uint32_t *dyt, Py_ssize_t *amap, int rows_outer) noexcept nogil
    void pcb_conv_dx_image(const uint32_t *wt, int C, int H, int W, int K, int S, int pad, const float *dy,
                           int O, int P, int Q, int rb, float *dx, uint32_t *panel, float *dcols) noexcept nogil

cdef enum:
    # packing layouts (pcb_pack)
    ALONG = 0
    DOWN = 1
    ALONG_T = 2
    DOWN_T = 3
    # an im2col panel (or a block's dcols) of at most this many bytes: with the filters it stays in L2
    PANEL_BYTES = 196608
    # the same for the stacked images of a weight gradient's block at stride 1: a longer reduction
    # per pass over the partial sums (Kd x O floats)
    DW_PANEL_BYTES = 524288
    # a block's channel-pair image on the AMX path stays in L2 with the filters
    AMX_IMAGE_BYTES = 524288
    # elements per block of round_to_bf16
    ROUND_CHUNK = 65536
    # linear: rows x columns of y (or dx, dw) per block handed to a thread
    LIN_ROWS = 32
    LIN_COLS = 256

cdef bint _NATIVE = PCB_NATIVE != 0 and pcb_cpu_native() != 0
# AMX-BF16 tiles take every product where the CPU has them and Linux lets the process use them
cdef bint _AMX = _NATIVE and pcb_amx_init() != 0
cdef Py_ssize_t _dw_panel_bytes = DW_PANEL_BYTES
cdef int _dw_rows_outer = 1


def _set_dw_tuning(Py_ssize_t panel_bytes, bint rows_outer):
    """Set the stride-1 weight gradient's block budget and tile order (tuning); returns the old pair."""
    global _dw_panel_bytes, _dw_rows_outer
    if panel_bytes < 1:
        raise ValueError(f"panel_bytes must be >= 1, got {panel_bytes}")
    old = (_dw_panel_bytes, bool(_dw_rows_outer))
    _dw_panel_bytes, _dw_rows_outer = panel_bytes, rows_outer
    return old


def native():
    """Whether this build level and CPU run the AVX512_BF16 instructions.

    True only on the ``avx512`` kernel level of a CPU with AVX512_BF16; the
    product kernels of this module raise :class:`RuntimeError` elsewhere.
    """
    return bool(_NATIVE)


def amx():
    """Whether the products run on AMX-BF16 tiles (TDPBF16PS) rather than on VDPBF16PS.

    True where :func:`native` is True, the CPU has AMX-TILE and AMX-BF16 and the operating system
    lets this process use the tile registers (Linux 5.16 or newer), unless :func:`_set_amx` turned
    them off.
    """
    return bool(_AMX and _amx_user)


cdef bint _amx_user = True


def _set_amx(bint on):
    """Use the AMX tiles (True) or VDPBF16PS (False) where the CPU has both; returns the old setting.

    For tests and benchmarks that compare the two paths; a no-op where the CPU has no AMX-BF16.
    """
    global _amx_user
    old = bool(_AMX and _amx_user)
    _amx_user = on
    pcb_amx_set(1 if (on and _AMX) else 0)
    return old


def dot_rate_vs_fma(int rounds=5, long iters=4000):
    """Multiply-adds per second of VDPBF16PS over those of a float32 FMA on this core, or None.

    VDPBF16PS does 32 multiply-adds per instruction, an FMA 16; where the core issues both at one
    rate this is 2 and bf16 products run twice as fast as float32 ones, where it issues VDPBF16PS at
    half the rate it is 1 and float32's Winograd convolutions beat every bf16 one. The better of
    ``rounds`` timings of ``iters`` rounds of 12 independent instructions each; None where
    :func:`native` is False.
    """
    if rounds < 1 or iters < 1:
        raise ValueError(f"dot_rate_vs_fma: rounds and iters must be >= 1, got {rounds} and {iters}")
    if not _NATIVE:
        return None
    cdef double dot = 1e300, fma = 1e300, t
    cdef int r
    with nogil:
        for r in range(rounds):
            t = pcb_issue_seconds(1, iters)
            if t < dot:
                dot = t
            t = pcb_issue_seconds(0, iters)
            if t < fma:
                fma = t
    if dot <= 0.0 or fma <= 0.0:
        return None
    return float((32.0 / dot) / (16.0 / fma))


# ------------------------------------------------------------------ validation

cdef str _shape(object a):
    return "(" + ", ".join(str(d) for d in a.shape) + ")"


cdef object _f32(str fn, str name, object a, int ndim, bint out, bint optional=False):
    """``a`` checked as a C-contiguous float32 ndarray of ``ndim`` dimensions (writable if ``out``)."""
    if a is None:
        if optional:
            return None
        raise TypeError(f"{fn}: {name} must be a float32 numpy array, got None")
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a float32 numpy array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {a.dtype}; convert it with "
                        f"{name}.astype(np.float32)")
    if a.ndim != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} dimension(s), got shape {_shape(a)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if out and not a.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only; pass a writable output array")
    return a


cdef void _expect(str fn, str name, object a, tuple shape) except *:
    if a is not None and tuple(a.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {_shape(a)}")


cdef void _disjoint(str fn, dict outs, dict ins) except *:
    """Outputs overlap no input and no other output (the kernels read inputs while writing)."""
    cdef list names = [k for k, v in outs.items() if v is not None]
    for i, o in enumerate(names):
        for other in names[i + 1:]:
            if np.may_share_memory(outs[o], outs[other]):
                raise ValueError(f"{fn}: {o} and {other} overlap in memory; pass separate arrays")
        for k, v in ins.items():
            if v is not None and np.may_share_memory(outs[o], v):
                raise ValueError(f"{fn}: output {o} overlaps input {k} in memory; pass a separate array")


cdef void _need_native(str fn) except *:
    if not _NATIVE:
        raise RuntimeError(f"{fn}: the native bf16 kernels need the avx512 kernel level on a CPU with "
                           f"AVX512_BF16 (parconv._ext._bf16.native() is False here); use the emulation "
                           f"(round_to_bf16 and the fp32 kernels) instead")


cdef void _conv_geometry(str fn, int stride, int padding, int H, int W, int K, int *P, int *Q) except *:
    if stride < 1:
        raise ValueError(f"{fn}: stride must be >= 1, got {stride}")
    if padding < 0:
        raise ValueError(f"{fn}: padding must be >= 0, got {padding}")
    if H + 2 * padding < K or W + 2 * padding < K:
        raise ValueError(f"{fn}: a {K}x{K} kernel does not fit the {H}x{W} input with padding {padding}")
    P[0] = (H + 2 * padding - K) // stride + 1
    Q[0] = (W + 2 * padding - K) // stride + 1


cdef inline int _imin(int a, int b) noexcept nogil:
    return a if a < b else b


cdef int _rows_per_block(Py_ssize_t bytes_per_pixel, int P, int Q, int N, int nt) noexcept nogil:
    """Output rows per block: the panel within PANEL_BYTES, and enough blocks for the team."""
    cdef Py_ssize_t rb = PANEL_BYTES // (bytes_per_pixel * Q) if bytes_per_pixel * Q > 0 else P
    cdef Py_ssize_t want = <Py_ssize_t>nt * PC_BLOCKS_PER_THREAD
    if rb < 1:
        rb = 1
    if rb > P:
        rb = P
    # a small batch: split each image more finely so every thread has blocks to take
    while rb > 1 and <Py_ssize_t>N * ((P + rb - 1) // rb) < want:
        rb = (rb + 1) // 2
    return <int>rb


cdef int _images_per_block(Py_ssize_t bytes_per_image, bint whole, int N, int nt,
                           Py_ssize_t budget=PANEL_BYTES) noexcept nogil:
    """Images stacked into one block where a whole image's panel is small: as many as fit the budget,
    leaving PC_BLOCKS_PER_THREAD blocks per thread."""
    cdef Py_ssize_t m
    if not whole or bytes_per_image <= 0:
        return 1
    m = budget // bytes_per_image
    if m > N // (<Py_ssize_t>nt * PC_BLOCKS_PER_THREAD):
        m = N // (<Py_ssize_t>nt * PC_BLOCKS_PER_THREAD)
    return <int>(m if m > 1 else 1)


cdef void _pack(int kind, const float *src, Py_ssize_t lds, Py_ssize_t rows, Py_ssize_t cols,
                uint32_t *dst, Py_ssize_t ldd, Py_ssize_t nd, int num_threads) noexcept nogil:
    """One packing of nd destination rows, split over a team in blocks of rows."""
    cdef Py_ssize_t nb = <Py_ssize_t>num_threads * PC_BLOCKS_PER_THREAD
    cdef Py_ssize_t i, d0, d1
    cdef int nt = pc_threads_for(rows * cols, nd, num_threads)
    if nb > nd:
        nb = nd
    if nt <= 1 or nb <= 1:
        pcb_pack(kind, src, lds, rows, cols, dst, ldd, 0, nd)
        return
    for i in prange(nb, schedule="dynamic", num_threads=pc_cap(nt)):
        d0 = nd * i // nb
        d1 = nd * (i + 1) // nb
        pcb_pack(kind, src, lds, rows, cols, dst, ldd, d0, d1)


cdef void _bias_sums(const float *dy, Py_ssize_t N, Py_ssize_t O, Py_ssize_t plane, float *db,
                     int num_threads) noexcept nogil:
    """db[o] = sum over n and the plane of dy[n][o] (unrounded), in double, one thread per o."""
    cdef Py_ssize_t o, n
    cdef double s
    cdef int nt = pc_threads_for(N * O * plane, O, num_threads)
    for o in prange(O, schedule="guided", num_threads=pc_cap(nt)):
        s = 0.0
        for n in range(N):
            s = s + pc_sum_f32(dy + (n * O + o) * plane, plane)
        db[o] = <float>s


cdef void _bias_cols(const float *dy, Py_ssize_t N, Py_ssize_t G, float *db, int num_threads) noexcept nogil:
    """db[g] = sum over n of dy[n][g], in double, rows in order."""
    cdef Py_ssize_t g, n
    cdef double s
    cdef int nt = pc_threads_for(N * G, G, num_threads)
    for g in prange(G, schedule="guided", num_threads=pc_cap(nt)):
        s = 0.0
        for n in range(N):
            s = s + dy[n * G + g]
        db[g] = <float>s


# ------------------------------------------------------------------ rounding

def round_to_bf16(x, out, int num_threads):
    """Round float32 values to bfloat16, round to nearest, ties to even.

    Parameters
    ----------
    x : float32 ndarray, 1-D, C-contiguous  # IN
    out : float32 ndarray, same length, C-contiguous  # OUT, overwritten; may be ``x`` itself
    num_threads : int

    Each ``out[i]`` is the bf16 value nearest ``x[i]`` stored as float32 (its low 16 bits zero).
    Overflow rounds to infinity, infinities stay, a NaN stays a NaN of the same sign (made quiet),
    subnormals round like any value. Runs on every kernel level.
    """
    fn = "round_to_bf16"
    _f32(fn, "x", x, 1, False)
    _f32(fn, "out", out, 1, True)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: out must have {x.shape[0]} elements like x, got {out.shape[0]}")
    if out.ctypes.data != x.ctypes.data and np.may_share_memory(x, out):
        raise ValueError(f"{fn}: out overlaps x without being x; pass x itself or a separate array")
    cdef Py_ssize_t n = x.shape[0]
    if n == 0:
        return
    cdef const float[::1] xv = x
    cdef float[::1] ov = out
    cdef const float *xp = &xv[0]
    cdef float *op = &ov[0]
    cdef Py_ssize_t nb = (n + ROUND_CHUNK - 1) // ROUND_CHUNK, i, s0, s1
    cdef int nt = pc_threads_for(n, nb, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        if nt <= 1:
            pcb_round(xp, op, n)
        else:
            for i in prange(nb, schedule="dynamic", num_threads=pc_cap(nt)):
                s0 = i * ROUND_CHUNK
                s1 = s0 + ROUND_CHUNK if s0 + ROUND_CHUNK < n else n
                pcb_round(xp + s0, op + s0, s1 - s0)


# ------------------------------------------------------------------ convolution

cdef int _conv_fwd_amx(const float *x, int N, int C, int H, int W, const float *w, int O, int K, int S,
                       int pad, const float *b, float *y, int P, int Q, int num_threads) noexcept nogil:
    """On the AMX tiles (pcb_amx_conv_rows) over blocks of (image, output rows), each block's channel-pair
    image (S x S phase images at stride S) within AMX_IMAGE_BYTES."""
    cdef int cpp = pcb_amx_cpp(C), Wg = (W + 2 * pad + S - 1) // S, ext = (K - 1) // S
    cdef Py_ssize_t kt = <Py_ssize_t>K * K * cpp, Op = (O + 15) // 16 * 16
    cdef int rb = P
    while rb > 1 and <Py_ssize_t>S * S * cpp * pcb_amx_plane(rb + ext, Wg, K) * 4 > AMX_IMAGE_BYTES:
        rb = (rb + 1) // 2
    # enough blocks for every thread where the batch is small
    while rb > 1 and <Py_ssize_t>N * ((P + rb - 1) // rb) < 2 * num_threads:
        rb = (rb + 1) // 2
    cdef int nbp = (P + rb - 1) // rb
    cdef Py_ssize_t L = pcb_amx_plane(rb + ext, Wg, K)
    cdef Py_ssize_t nblocks = <Py_ssize_t>N * nbp, blk
    cdef int nt = pc_team(nblocks, num_threads)
    cdef int failed[1]
    cdef int n, p0, p1
    cdef void *raw
    cdef uint32_t *img
    cdef uint32_t *wa = <uint32_t *>malloc(sizeof(uint32_t) * Op * kt)
    if wa == NULL:
        return 1
    pcb_amx_wpack(w, O, C, K, cpp, wa)
    failed[0] = 0
    raw, img = NULL, NULL
    with parallel(num_threads=pc_cap(nt)):
        raw = malloc(sizeof(uint32_t) * S * S * cpp * L + sizeof(float) * 32 * 32 + 128)
        img = <uint32_t *>pc_align64(raw)
        if raw == NULL:
            failed[0] = 1
        for blk in prange(nblocks, schedule="dynamic"):
            if raw != NULL:
                n = <int>(blk // nbp)
                p0 = <int>(blk % nbp) * rb
                p1 = _imin(P, p0 + rb)
                pcb_amx_cpimage(x + <Py_ssize_t>n * C * H * W, C, H, W, pad, S, K, p0, p1 - p0 + ext, cpp, Wg, L,
                                img)
                pcb_amx_conv_rows(img, L, cpp, S, Wg, wa, O, K, b, y + <Py_ssize_t>n * O * P * Q, P, Q, p0, p1,
                                  <float *>pc_align64(img + S * S * cpp * L))
        free(raw)
    free(wa)
    return failed[0]


cdef int _conv_fwd(const float *x, int N, int C, int H, int W, const float *w, int O, int K, int S, int pad,
                   const float *b, float *y, int P, int Q, int num_threads) noexcept nogil:
    """y = conv(x, w) + b over blocks of (image, output rows); w: (O, C, K, K) fp32, packed here."""
    if _AMX and _amx_user:
        return _conv_fwd_amx(x, N, C, H, W, w, O, K, S, pad, b, y, P, Q, num_threads)
    if S == 1 or (K == 1 and pad == 0):
        return _conv_fwd_s1(x, N, C, H, W, w, O, K, S, pad, b, y, P, Q, num_threads)
    cdef Py_ssize_t Kd = <Py_ssize_t>C * K * K, kp = (Kd + 1) // 2
    cdef int rb = _rows_per_block(kp * 4, P, Q, N, num_threads)
    cdef int nbp = (P + rb - 1) // rb
    cdef Py_ssize_t nblocks = <Py_ssize_t>N * nbp, blk
    cdef Py_ssize_t ldb = pcb_up16(<Py_ssize_t>rb * Q)
    # the block's rounded, padded input rows
    cdef Py_ssize_t xbn = <Py_ssize_t>C * ((rb - 1) * S + K) * (W + 2 * pad)
    cdef int nt = pc_team(nblocks, num_threads)
    cdef int failed[1]
    cdef int n, p0
    cdef void *raw
    cdef uint32_t *panel
    cdef uint32_t *wr = <uint32_t *>malloc(sizeof(uint32_t) * O * kp)
    if wr == NULL:
        return 1
    _pack(ALONG, w, Kd, O, Kd, wr, kp, O, num_threads)
    failed[0] = 0
    raw, panel = NULL, NULL  # private to each thread below; initialised for the firstprivate copy
    with parallel(num_threads=pc_cap(nt)):
        raw = malloc(sizeof(uint32_t) * kp * ldb + sizeof(uint16_t) * xbn + 64)
        panel = <uint32_t *>pc_align64(raw)
        if raw == NULL:
            failed[0] = 1
        for blk in prange(nblocks, schedule="dynamic"):
            if raw != NULL:  # every thread reaches the loop; one without scratch skips its blocks
                n = <int>(blk // nbp)
                p0 = <int>(blk % nbp) * rb
                pcb_conv_fwd_block(x + <Py_ssize_t>n * C * H * W, C, H, W, wr, O, K, S, pad, b,
                                   y + <Py_ssize_t>n * O * P * Q, P, Q, p0, _imin(P, p0 + rb), panel,
                                   <uint16_t *>(panel + kp * ldb))
        free(raw)
    free(wr)
    return failed[0]


cdef int _conv_fwd_s1(const float *x, int N, int C, int H, int W, const float *w, int O, int K, int S, int pad,
                      const float *b, float *y, int P, int Q, int num_threads) noexcept nogil:
    """Stride 1 (or a 1x1 kernel without padding) without im2col (pcb_s1_fwd_block): blocks of
    (image, output rows)."""
    cdef int Wp = Q + K - 1
    # per output pixel of a block: the flat input (2 bytes), its pair views (1.5 words) and the sums
    cdef Py_ssize_t per_pixel = <Py_ssize_t>C * 8 + O * 4
    cdef int rb = _rows_per_block(per_pixel, P, Wp, N, num_threads)
    cdef int m = _images_per_block(per_pixel * Wp * (P + K - 1), rb == P, N, num_threads)
    cdef int nbp = (P + rb - 1) // rb
    cdef Py_ssize_t nblocks = (N + m - 1) // m if m > 1 else <Py_ssize_t>N * nbp, blk
    cdef int nrf = pcb_s1_rows(m, 0, rb, K)
    cdef Py_ssize_t L = pcb_s1_len(nrf, K, Wp), kp = pcb_s1_pairs(C, K)
    cdef Py_ssize_t nimg = (C + (C + 1) // 2) * L, lda = pcb_up16(<Py_ssize_t>nrf * Wp)
    cdef int nt = pc_team(nblocks, num_threads)
    cdef int failed[1]
    cdef int n, p0, mm
    cdef void *raw
    cdef uint32_t *img
    cdef Py_ssize_t *boff = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * kp)
    cdef uint32_t *ws = <uint32_t *>malloc(sizeof(uint32_t) * O * kp)
    if boff == NULL or ws == NULL:
        free(boff)
        free(ws)
        return 1
    pcb_s1_schedule(w, O, C, K, Wp, L, boff, ws)
    failed[0] = 0
    raw, img = NULL, NULL
    with parallel(num_threads=pc_cap(nt)):
        raw = malloc(sizeof(uint32_t) * nimg + sizeof(float) * O * lda + sizeof(uint16_t) * C * L + 192)
        img = <uint32_t *>pc_align64(raw)
        if raw == NULL:
            failed[0] = 1
        for blk in prange(nblocks, schedule="dynamic"):
            if raw != NULL:
                if m > 1:  # whole images, stacked
                    n = <int>blk * m
                    p0 = 0
                    mm = _imin(m, N - n)
                else:
                    n = <int>(blk // nbp)
                    p0 = <int>(blk % nbp) * rb
                    mm = 1
                pcb_s1_fwd_block(x + <Py_ssize_t>n * C * H * W, mm, C, H, W, K, pad, S, ws, boff, O, b,
                                 y + <Py_ssize_t>n * O * P * Q, P, Q, p0, _imin(P, p0 + rb), L,
                                 <uint16_t *>pc_align64(<float *>pc_align64(img + nimg) + O * lda), img,
                                 <float *>pc_align64(img + nimg))
        free(raw)
    free(boff)
    free(ws)
    return failed[0]


def conv2d_forward(x, w, b, y, int stride, int padding, int num_threads):
    """Convolution forward in bf16 with fp32 accumulation: ``y = conv2d(bf16(x), bf16(w)) + b``.

    Parameters
    ----------
    x : float32 (N, C, H, W)  # IN
    w : float32 (O, C, K, K)  # IN
    b : float32 (O,) or None  # IN, added in fp32
    y : float32 (N, O, P, Q)  # OUT, overwritten; P = (H + 2 padding - K) // stride + 1, Q likewise
    stride, padding, num_threads : int

    Raises RuntimeError unless :func:`native`.
    """
    fn = "conv2d_forward"
    _need_native(fn)
    _f32(fn, "x", x, 4, False)
    _f32(fn, "w", w, 4, False)
    _f32(fn, "b", b, 1, False, True)
    _f32(fn, "y", y, 4, True)
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2], P, Q
    if w.shape[1] != C or w.shape[3] != K or K < 1 or O < 1:
        raise ValueError(f"{fn}: w must be (O, {C}, K, K) with O, K >= 1 for x of shape {_shape(x)}, "
                         f"got {_shape(w)}")
    _conv_geometry(fn, stride, padding, H, W, K, &P, &Q)
    _expect(fn, "b", b, (O,))
    _expect(fn, "y", y, (N, O, P, Q))
    _disjoint(fn, {"y": y}, {"x": x, "w": w, "b": b})
    if N == 0 or C == 0:
        y[...] = 0 if b is None else b.reshape(1, O, 1, 1)
        return
    cdef const float[:, :, :, ::1] xv = x
    cdef const float[:, :, :, ::1] wv = w
    cdef float[:, :, :, ::1] yv = y
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if b is not None:
        bv = b
        bp = &bv[0]
    cdef int failed = 1
    pc_work(pc_conv_ns(<double>N * O * P * Q * C * K * K))
    with nogil:
        failed = _conv_fwd(&xv[0, 0, 0, 0], N, C, H, W, &wv[0, 0, 0, 0], O, K, stride, padding, bp,
                           &yv[0, 0, 0, 0], P, Q, num_threads)
    if failed:
        raise MemoryError(f"{fn}: could not allocate scratch")


cdef bint _dx_phases_user = True
cdef int _scratch_fill = -1


def _fill_scratch(int byte):
    """Fill the AMX weight gradient's scratch with ``byte`` before each call (-1: leave it as malloc
    returns it); returns the old value. For tests: 0xFF makes every bf16 word NaN, so a word read
    before it is written shows in dw."""
    global _scratch_fill
    old = _scratch_fill
    _scratch_fill = byte
    return old


def _set_dx_phases(bint on):
    """Run strided input gradients on the tiles as S x S phase convolutions (True) or through col2im
    (False); returns the old setting. For tests and benchmarks that compare the two."""
    global _dx_phases_user
    old = bool(_dx_phases_user)
    _dx_phases_user = on
    return old


cdef inline bint _dx_amx_applies(int K, int S, int pad, int Q) noexcept nogil:
    """Whether _conv_dx_amx takes this strided layer: dy rows of 16 or more columns (on shorter ones
    the tiles' 32-column steps over the phase rows and their padding waste more than col2im costs),
    and a padding of at most S * ceil(K / S) - 1, which the phases' shared image needs."""
    return (_AMX and _amx_user and _dx_phases_user and S > 1 and Q >= 16
            and pad // S <= (K + S - 1) // S - 1)


cdef int _conv_dx_amx(const float *dy, int N, int O, int P, int Q, const float *w, int C, int H, int W,
                      int K, int S, int pad, float *dx, int num_threads) noexcept nogil:
    """dx of a strided layer on the AMX tiles: S x S stride-1 convolutions of dy (pcb_amx_dx_wpack), over
    blocks of (image, phase rows) whose dy image (one per block, each phase a shifted view of it) and
    phase outputs fit AMX_IMAGE_BYTES; each block interleaves its phases into its own rows of dx."""
    cdef int K2 = (K + S - 1) // S, emin = pad // S, spread = (S - 1 + pad) // S - pad // S
    cdef int padm = K2 - 1 - emin
    cdef int Pi = (H + S - 1) // S, Qs = (W + S - 1) // S
    cdef int Wg = Qs + K2 - 1 + spread, cpp = pcb_amx_cpp(O)
    cdef Py_ssize_t pack = <Py_ssize_t>(C + 15) // 16 * 16 * K2 * K2 * cpp
    cdef int rb = Pi
    while rb > 1 and (<Py_ssize_t>cpp * pcb_amx_plane(rb + K2 - 1 + spread, Wg, K2 + spread) * 4
                      + <Py_ssize_t>S * S * C * rb * Qs * 4) > AMX_IMAGE_BYTES:
        rb = (rb + 1) // 2
    while rb > 1 and <Py_ssize_t>N * ((Pi + rb - 1) // rb) < 2 * num_threads:
        rb = (rb + 1) // 2
    cdef int nbp = (Pi + rb - 1) // rb
    cdef Py_ssize_t L = pcb_amx_plane(rb + K2 - 1 + spread, Wg, K2 + spread)
    cdef Py_ssize_t nblocks = <Py_ssize_t>N * nbp, blk, phsz
    cdef int nt = pc_team(nblocks, num_threads)
    cdef int failed[1]
    cdef int n, i0, nr, r, q, ph
    cdef unsigned live
    cdef void *raw
    cdef uint32_t *img
    cdef float *outs
    cdef float *wsub = <float *>malloc(sizeof(float) * C * O * K2 * K2)
    cdef uint32_t *wa = <uint32_t *>malloc(sizeof(uint32_t) * S * S * pack)
    if wsub == NULL or wa == NULL:
        free(wsub)
        free(wa)
        return 1
    live = pcb_amx_dx_wpack(w, O, C, K, S, pad, cpp, wsub, wa)
    free(wsub)
    failed[0] = 0
    raw, img, outs = NULL, NULL, NULL
    with parallel(num_threads=pc_cap(nt)):
        raw = malloc(sizeof(uint32_t) * cpp * L + sizeof(float) * (S * S * C * rb * Qs + 32 * 32 + 16) + 128)
        img = <uint32_t *>pc_align64(raw)
        outs = <float *>pc_align64(img + cpp * L)
        if raw == NULL:
            failed[0] = 1
        for blk in prange(nblocks, schedule="dynamic"):
            if raw != NULL:
                n = <int>(blk // nbp)
                i0 = <int>(blk % nbp) * rb
                nr = _imin(rb, Pi - i0)
                phsz = <Py_ssize_t>C * nr * Qs
                pcb_amx_cpimage(dy + <Py_ssize_t>n * O * P * Q, O, P, Q, padm, 1, K2, i0, nr + K2 - 1 + spread, cpp,
                                Wg, L, img)
                for ph in range(S * S):
                    if live >> ph & 1u:
                        r = ph // S
                        q = ph % S
                        pcb_amx_conv_rows(img + ((r + pad) // S - emin) * Wg + (q + pad) // S - emin, L, cpp, 1, Wg,
                                          wa + ph * pack, C, K2, NULL, outs + ph * phsz, nr, Qs, 0, nr,
                                          <float *>pc_align64(outs + S * S * C * rb * Qs))
                pcb_amx_dx_interleave(outs, phsz, Qs, C, H, W, S, i0, nr, live, dx + <Py_ssize_t>n * C * H * W)
        free(raw)
    free(wa)
    return failed[0]


cdef int _conv_dx_gemm(const float *dy, int N, int O, int P, int Q, const uint32_t *wt, int C, int H, int W,
                       int K, int S, int pad, float *dx, int num_threads) noexcept nogil:
    """dx through col2im, one image per block (its row blocks scatter into the same dx)."""
    cdef Py_ssize_t Kd = <Py_ssize_t>C * K * K, op = (O + 1) // 2
    cdef int rb = _rows_per_block(Kd * 4 + op * 4, P, Q, N, 1)
    cdef Py_ssize_t npix = <Py_ssize_t>rb * Q, ldb = pcb_up16(npix)
    cdef int nt = pc_team(N, num_threads)
    cdef int failed[1]
    cdef Py_ssize_t n
    cdef void *raw
    cdef uint32_t *panel
    failed[0] = 0
    raw, panel = NULL, NULL
    with parallel(num_threads=pc_cap(nt)):
        raw = malloc(sizeof(uint32_t) * op * ldb + sizeof(float) * Kd * npix + 128)
        panel = <uint32_t *>pc_align64(raw)
        if raw == NULL:
            failed[0] = 1
        for n in prange(N, schedule="dynamic"):
            if raw != NULL:
                pcb_conv_dx_image(wt, C, H, W, K, S, pad, dy + n * O * P * Q, O, P, Q, rb,
                                  dx + n * C * H * W, panel,
                                  <float *>pc_align64(panel + op * ldb))
        free(raw)
    return failed[0]


cdef int _conv_dw(const float *x, int N, int C, int H, int W, int K, int S, int pad, const float *dy, int O,
                  int P, int Q, float *dw, int num_threads) noexcept nogil:
    """dw over groups of images, each group's partial (transposed, Kd x ldo) summed in its own order,
    then the partials added in group order: the same bits at a fixed thread count. Stride 1 reads
    im2col's rows as views of the input (pcb_s1_dw_block), other strides build them."""
    cdef Py_ssize_t Kd = <Py_ssize_t>C * K * K, ldo = pcb_up16(O)
    cdef int ng = 1 if num_threads <= 1 else _imin(N, num_threads * PC_BLOCKS_PER_THREAD)
    cdef bint s1 = S == 1 or (K == 1 and pad == 0)
    cdef bint amx = _AMX and _amx_user
    # the tiles take every stride through flat views (of S x S phase images where strided)
    cdef bint flat = s1 or amx
    cdef int nphase = 1 if s1 else S * S
    cdef int Wp = Q + K - 1 if s1 else ((W + 2 * pad + S - 1) // S if amx else W + 2 * pad)
    # per output pixel: im2col's row elements (or, at stride 1, two flat copies of the input) and dy's pairs.
    # The groups of images keep the team busy; the tiles (amx) load and store each partial sum once
    # per block, so they take whole images wherever the panel allows rather than rows of one.
    cdef int rb = (_rows_per_block(<Py_ssize_t>nphase * C * 4 + ldo * 2 + O * 2, P, Wp, N if amx else 1, 1)
                   if flat else _rows_per_block(Kd * 2 + ldo * 2, P, Q, 1, 1))
    # stride 1: whole small images stacked into one block (a longer reduction per partial sum)
    cdef int m = _images_per_block((<Py_ssize_t>nphase * C * 4 + ldo * 2 + O * 2) * Wp * (P + K - 1), rb == P,
                                   N, num_threads, _dw_panel_bytes) if flat else 1
    cdef int nbp = (P + rb - 1) // rb, ib, mm
    cdef int nrf = pcb_s1_rows(m, 0, rb, K)
    cdef Py_ssize_t L = pcb_s1_len(nrf, K, Wp)
    cdef Py_ssize_t npp = ((<Py_ssize_t>(nrf * Wp if flat else rb * Q)) + 1) // 2
    # the flat views: the input's planes (per phase) and their copy shifted by one element
    cdef Py_ssize_t xbn = 2 * nphase * C * L if flat else <Py_ssize_t>C * ((rb - 1) * S + K) * Wp
    # stride 1: the rows' pointers; else the im2col rows themselves
    cdef Py_ssize_t colsn = Kd * 2 if flat else Kd * npp
    cdef size_t scratch = (sizeof(uint32_t) * (colsn + npp * (ldo + 16 + O + 2) + 16 * ldo)
                           + sizeof(uint16_t) * xbn + 256)
    cdef float *part = <float *>malloc(sizeof(float) * ng * Kd * ldo)
    cdef int nt = pc_team(ng, num_threads)
    cdef int failed[1]
    cdef int g, n, n1, p1
    cdef Py_ssize_t k, o, gi
    cdef float s
    cdef void *raw
    cdef uint32_t *cols
    cdef uint32_t *dyt
    cdef uint16_t *xb
    cdef float *mine
    if part == NULL:
        return 1
    failed[0] = 0
    raw, cols, dyt, xb = NULL, NULL, NULL, NULL
    with parallel(num_threads=pc_cap(nt)):
        # the tiles' block writes every word it reads (tests fill its scratch with NaN bits first:
        # _fill_scratch), so its scratch is not zeroed; the VDPBF16PS kernels' is
        if amx:
            raw = malloc(scratch)
            if raw != NULL and _scratch_fill >= 0:
                memset(raw, _scratch_fill, scratch)
        else:
            raw = calloc(1, scratch)
        cols = <uint32_t *>pc_align64(raw)
        if raw == NULL:
            failed[0] = 1
        else:
            dyt = <uint32_t *>pc_align64(cols + colsn)
            xb = <uint16_t *>pc_align64(dyt + npp * (ldo + 16 + O) + (16 * ldo if amx else 0))
            if s1:
                pcb_s1_dw_rows(C, K, Wp, L, xb, <const uint32_t **>cols)
        for g in prange(ng, schedule="dynamic"):
            if raw != NULL:
                mine = part + g * Kd * ldo
                memset(mine, 0, sizeof(float) * Kd * ldo)
                n = <int>(<Py_ssize_t>N * g // ng)
                n1 = <int>(<Py_ssize_t>N * (g + 1) // ng)
                while n < n1:
                    mm = _imin(m, n1 - n)
                    for ib in range(nbp):
                        p1 = _imin(P, ib * rb + rb)
                        if flat and amx:
                            pcb_amx_dw_block(x + <Py_ssize_t>n * C * H * W, mm, C, H, W, K, pad, S,
                                             dy + <Py_ssize_t>n * O * P * Q, O, P, Q, ib * rb, p1, L, mine, ldo,
                                             xb, dyt)
                        elif s1:
                            pcb_s1_dw_block(x + <Py_ssize_t>n * C * H * W, mm, C, H, W, K, pad, S,
                                            dy + <Py_ssize_t>n * O * P * Q, O, P, Q, ib * rb, p1, L, mine, ldo,
                                            xb, <const uint32_t **>cols, dyt,
                                            <Py_ssize_t *>pc_align64(xb + xbn), _dw_rows_outer)
                        else:
                            pcb_conv_dw_block(x + <Py_ssize_t>n * C * H * W, C, H, W, K, S, pad,
                                              dy + <Py_ssize_t>n * O * P * Q, O, P, Q, ib * rb, p1,
                                              mine, ldo, cols, dyt, xb)
                    n = n + mm
        free(raw)
    if not failed[0]:
        for k in prange(Kd, schedule="guided", num_threads=pc_cap(pc_threads_for(ng * Kd * O, Kd, num_threads))):
            for o in range(O):
                s = part[k * ldo + o]
                for gi in range(1, ng):
                    s = s + part[(gi * Kd + k) * ldo + o]
                dw[o * Kd + k] = s
    free(part)
    return failed[0]


def conv2d_backward(x, w, dy, dx, dw, db, int stride, int padding, int num_threads):
    """Convolution backward in bf16 with fp32 accumulation; every gradient given is overwritten.

    Parameters
    ----------
    x : float32 (N, C, H, W)  # IN
    w : float32 (O, C, K, K)  # IN
    dy : float32 (N, O, P, Q)  # IN
    dx : float32 (N, C, H, W) or None  # OUT, from bf16(dy) and bf16(w)
    dw : float32 (O, C, K, K) or None  # OUT, from bf16(x) and bf16(dy)
    db : float32 (O,) or None  # OUT, the fp32 sum of the unrounded dy
    stride, padding, num_threads : int

    Raises RuntimeError unless :func:`native`.
    """
    fn = "conv2d_backward"
    _need_native(fn)
    _f32(fn, "x", x, 4, False)
    _f32(fn, "w", w, 4, False)
    _f32(fn, "dy", dy, 4, False)
    _f32(fn, "dx", dx, 4, True, True)
    _f32(fn, "dw", dw, 4, True, True)
    _f32(fn, "db", db, 1, True, True)
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], K = w.shape[2], P, Q
    if w.shape[1] != C or w.shape[3] != K or K < 1 or O < 1:
        raise ValueError(f"{fn}: w must be (O, {C}, K, K) with O, K >= 1 for x of shape {_shape(x)}, "
                         f"got {_shape(w)}")
    _conv_geometry(fn, stride, padding, H, W, K, &P, &Q)
    _expect(fn, "dy", dy, (N, O, P, Q))
    _expect(fn, "dx", dx, (N, C, H, W))
    _expect(fn, "dw", dw, (O, C, K, K))
    _expect(fn, "db", db, (O,))
    _disjoint(fn, {"dx": dx, "dw": dw, "db": db}, {"x": x, "w": w, "dy": dy})
    if N == 0 or C == 0:
        if dw is not None:
            dw[...] = 0
        if db is not None:
            db[...] = 0
        if dx is not None:
            dx[...] = 0
        return
    cdef const float[:, :, :, ::1] xv = x
    cdef const float[:, :, :, ::1] wv = w
    cdef const float[:, :, :, ::1] dyv = dy
    cdef float[:, :, :, ::1] dxv
    cdef float[:, :, :, ::1] dwv
    cdef float[::1] dbv
    cdef Py_ssize_t Kd = <Py_ssize_t>C * K * K
    cdef bint by_conv = stride == 1 and padding <= K - 1
    cdef bint dx_amx = not by_conv and _dx_amx_applies(K, stride, padding, Q)
    cdef uint32_t *wp = NULL
    cdef int failed = 0
    cdef float[:, :, :, ::1] wf
    pc_work(pc_conv_ns(<double>N * O * P * Q * Kd))  # dx, then dw: each the forward's multiply-adds
    if dx is not None:
        dxv = dx
        if by_conv:
            # dx = conv(dy, w flipped and transposed to (C, O, K, K), padding K - 1 - padding)
            wf = np.ascontiguousarray(np.asarray(w)[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        elif not dx_amx:
            wp = <uint32_t *>malloc(sizeof(uint32_t) * Kd * ((O + 1) // 2))
        if wp == NULL and not by_conv and not dx_amx:
            raise MemoryError(f"{fn}: could not allocate the packed filters")
        with nogil:
            if by_conv:
                failed = _conv_fwd(&dyv[0, 0, 0, 0], N, O, P, Q, &wf[0, 0, 0, 0], C, K, 1, K - 1 - padding, NULL,
                                   &dxv[0, 0, 0, 0], H, W, num_threads)
            elif dx_amx:
                failed = _conv_dx_amx(&dyv[0, 0, 0, 0], N, O, P, Q, &wv[0, 0, 0, 0], C, H, W, K, stride, padding,
                                      &dxv[0, 0, 0, 0], num_threads)
            else:
                _pack(DOWN_T, &wv[0, 0, 0, 0], Kd, O, Kd, wp, (O + 1) // 2, Kd, num_threads)
                failed = _conv_dx_gemm(&dyv[0, 0, 0, 0], N, O, P, Q, wp, C, H, W, K, stride, padding,
                                       &dxv[0, 0, 0, 0], num_threads)
        free(wp)
    if not failed and dw is not None:
        dwv = dw
        with nogil:
            failed = _conv_dw(&xv[0, 0, 0, 0], N, C, H, W, K, stride, padding, &dyv[0, 0, 0, 0], O, P, Q,
                              &dwv[0, 0, 0, 0], num_threads)
    if failed:
        raise MemoryError(f"{fn}: could not allocate scratch")
    if db is not None:
        dbv = db
        with nogil:
            _bias_sums(&dyv[0, 0, 0, 0], N, O, <Py_ssize_t>P * Q, &dbv[0], num_threads)


# ------------------------------------------------------------------ linear

cdef void _lin_gemm(const uint32_t *A, Py_ssize_t lda, Py_ssize_t rows, const uint32_t *B, Py_ssize_t ldb,
                    Py_ssize_t kp, float *Cm, Py_ssize_t cols, const float *bcol, int num_threads) noexcept nogil:
    """Cm (rows x cols, row stride cols) = A B (+ bcol), in blocks of LIN_ROWS x LIN_COLS, one per thread."""
    cdef Py_ssize_t rbk = (rows + LIN_ROWS - 1) // LIN_ROWS, cbk = (cols + LIN_COLS - 1) // LIN_COLS
    cdef Py_ssize_t nb = rbk * cbk, i, r0, c0
    cdef int nt = pc_threads_for(rows * cols * kp * 2, nb, num_threads)
    for i in prange(nb, schedule="dynamic", num_threads=pc_cap(nt)):
        r0 = (i // cbk) * LIN_ROWS
        c0 = (i % cbk) * LIN_COLS
        pcb_gemm(A + r0 * lda, lda, min(LIN_ROWS, rows - r0), B + c0, ldb, kp, Cm + r0 * cols + c0, cols,
                 min(LIN_COLS, cols - c0), NULL, (bcol + c0) if bcol != NULL else NULL, 0)


cdef void _check_linear(str fn, object x, object w) except *:
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: x has {x.shape[1]} features but w has {w.shape[1]} (w must be (G, F) "
                         f"for x (N, F))")


def linear_forward(x, w, b, y, int num_threads):
    """Linear forward in bf16 with fp32 accumulation: ``y = bf16(x) @ bf16(w).T + b``.

    Parameters
    ----------
    x : float32 (N, F)  # IN
    w : float32 (G, F)  # IN
    b : float32 (G,) or None  # IN, added in fp32
    y : float32 (N, G)  # OUT, overwritten
    num_threads : int

    Raises RuntimeError unless :func:`native`.
    """
    fn = "linear_forward"
    _need_native(fn)
    _f32(fn, "x", x, 2, False)
    _f32(fn, "w", w, 2, False)
    _f32(fn, "b", b, 1, False, True)
    _f32(fn, "y", y, 2, True)
    _check_linear(fn, x, w)
    cdef Py_ssize_t N = x.shape[0], F = x.shape[1], G = w.shape[0]
    _expect(fn, "b", b, (G,))
    _expect(fn, "y", y, (N, G))
    _disjoint(fn, {"y": y}, {"x": x, "w": w, "b": b})
    if N == 0 or G == 0:
        return
    if F == 0:
        y[...] = 0 if b is None else b
        return
    cdef const float[:, ::1] xv = x
    cdef const float[:, ::1] wv = w
    cdef float[:, ::1] yv = y
    pc_work(pc_product_ns(N, G, F))
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if b is not None:
        bv = b
        bp = &bv[0]
    cdef Py_ssize_t Fp = (F + 1) // 2, ldg = pcb_up16(G)
    cdef uint32_t *xr = <uint32_t *>malloc(sizeof(uint32_t) * N * Fp)
    cdef uint32_t *wt = <uint32_t *>malloc(sizeof(uint32_t) * Fp * ldg)
    if xr == NULL or wt == NULL:
        free(xr)
        free(wt)
        raise MemoryError(f"{fn}: could not allocate the packed operands")
    with nogil:
        _pack(ALONG, &xv[0, 0], F, N, F, xr, Fp, N, num_threads)
        _pack(ALONG_T, &wv[0, 0], F, G, F, wt, ldg, Fp, num_threads)
        _lin_gemm(xr, Fp, N, wt, ldg, Fp, &yv[0, 0], G, bp, num_threads)
    free(xr)
    free(wt)


def linear_backward(x, w, dy, dx, dw, db, int num_threads):
    """Linear backward in bf16 with fp32 accumulation; every gradient is overwritten.

    Parameters
    ----------
    x : float32 (N, F)  # IN
    w : float32 (G, F)  # IN
    dy : float32 (N, G)  # IN
    dx : float32 (N, F) or None  # OUT, ``bf16(dy) @ bf16(w)``
    dw : float32 (G, F)  # OUT, ``bf16(dy).T @ bf16(x)``
    db : float32 (G,) or None  # OUT, the fp32 sum of the unrounded dy over the batch
    num_threads : int

    Raises RuntimeError unless :func:`native`.
    """
    fn = "linear_backward"
    _need_native(fn)
    _f32(fn, "x", x, 2, False)
    _f32(fn, "w", w, 2, False)
    _f32(fn, "dy", dy, 2, False)
    _f32(fn, "dx", dx, 2, True, True)
    _f32(fn, "dw", dw, 2, True)
    _f32(fn, "db", db, 1, True, True)
    _check_linear(fn, x, w)
    cdef Py_ssize_t N = x.shape[0], F = x.shape[1], G = w.shape[0]
    _expect(fn, "dy", dy, (N, G))
    _expect(fn, "dx", dx, (N, F))
    _expect(fn, "dw", dw, (G, F))
    _expect(fn, "db", db, (G,))
    _disjoint(fn, {"dx": dx, "dw": dw, "db": db}, {"x": x, "w": w, "dy": dy})
    if N == 0 or G == 0 or F == 0:
        dw[...] = 0
        if dx is not None:
            dx[...] = 0
        if db is not None:
            db[...] = 0 if N == 0 else dy.sum(axis=0, dtype=np.float64).astype(np.float32)
        return
    cdef const float[:, ::1] xv = x
    cdef const float[:, ::1] wv = w
    cdef const float[:, ::1] dyv = dy
    pc_work(pc_product_ns(N, G, F) * (1 + (dx is not None)))
    cdef float[:, ::1] dxv
    cdef float[:, ::1] dwv = dw
    cdef float[::1] dbv
    cdef Py_ssize_t Gp = (G + 1) // 2, Np = (N + 1) // 2, ldf = pcb_up16(F)
    cdef uint32_t *a = <uint32_t *>malloc(sizeof(uint32_t) * max(N * Gp, G * Np))
    cdef uint32_t *bm = <uint32_t *>malloc(sizeof(uint32_t) * max(Gp, Np) * ldf)
    if a == NULL or bm == NULL:
        free(a)
        free(bm)
        raise MemoryError(f"{fn}: could not allocate the packed operands")
    if dx is not None:
        dxv = dx
        with nogil:
            # dx[n][f] = sum_g dy[n][g] w[g][f]: pairs of g along dy's rows and down w's columns
            _pack(ALONG, &dyv[0, 0], G, N, G, a, Gp, N, num_threads)
            _pack(DOWN, &wv[0, 0], F, G, F, bm, ldf, Gp, num_threads)
            _lin_gemm(a, Gp, N, bm, ldf, Gp, &dxv[0, 0], F, NULL, num_threads)
    with nogil:
        # dw[g][f] = sum_n dy[n][g] x[n][f]: pairs of n down dy's and x's columns
        _pack(DOWN_T, &dyv[0, 0], G, N, G, a, Np, G, num_threads)
        _pack(DOWN, &xv[0, 0], F, N, F, bm, ldf, Np, num_threads)
        _lin_gemm(a, Np, G, bm, ldf, Np, &dwv[0, 0], F, NULL, num_threads)
    free(a)
    free(bm)
    if db is not None:
        dbv = db
        with nogil:
            _bias_cols(&dyv[0, 0], N, G, &dbv[0], num_threads)


include "_team.pxi"
