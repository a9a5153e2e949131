# Shape legend: N batch, C in-channels, O out-channels, H, W input, P, Q output, K kernel,
# F in-features, G out-features; Kdim = C*K*K (conv) or F (linear), the reduction.
"""int8 convolution and linear kernels (uint8 activations, int8 weights, int32 accumulation).

Quantization scheme (post-training static, as PyTorch's x86 backend and ONNX QDQ): activations
per-tensor asymmetric uint8 (scale s_x, zero point z_x), weights per-output-channel symmetric
int8 in [-127, 127], bias int32 with scale s_x * s_w[o]. Each output is

    acc[o] = sum over taps of (xq - z_x) * wq[o]       (padded taps count as xq = z_x)
    y[o]   = float32(acc[o] + bias_q[o]) * scale[o]    (then ReLU if asked)

Integer sums are exact, so every path (:func:`path`: AVX512_VNNI ``vpdpbusd``, AVX2 int16
``vpmaddwd``, portable C) gives the same bits at every thread count. Between chained layers, max pooling
(:func:`maxpool2d_u8`) runs on the uint8 activations: quantization is monotone, so it gives the bits
of pooling float32 and quantizing after. The kernels are in
``pc_int8.h``; this module validates every argument (the kernels run without bounds checks)
and hands work out in blocks, dynamically.
"""

import math

import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
from libc.math cimport isfinite
from .pc_helpers cimport (pc_threads_for, pc_team, PC_BLOCKS_PER_THREAD, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)

cdef extern from "pc_int8.h":
    int PCI8_PORTABLE, PCI8_AVX2, PCI8_VNNI, PCI8_AVXVNNI, PCI8_TILE, PCI8_OB, PCI8_CB, PCI8_RB
    int pci8_best_path() noexcept nogil
    int pci8_path_runs(int p) noexcept nogil
    void pci8_quantize(const float *x, Py_ssize_t n, float scale, int zp, uint8_t *out) noexcept nogil
    int pci8_groups(int Kdim, int K) noexcept nogil
    void pci8_pack(const int8_t *raw, int O, int Kdim, int K, int O64, int8_t *p8, int16_t *p16) noexcept nogil
    void pci8_grid_group(const uint8_t *x, int C, int H, int W, int pad, int S, int nph, int Hg, int Wg, int cg,
                         uint8_t z, uint8_t *dst) noexcept nogil
    void pci8_conv_tiles(int path, const uint8_t *grid, const int *off, int Kg, const int8_t *w8,
                         const int16_t *w16, int O, int P, int Q, int Wg, Py_ssize_t s0, Py_ssize_t s1,
                         const int32_t *zb32, const int64_t *zb64, int wide, const float *scale, int relu,
                         float *y, int32_t *acc, uint8_t *yq, float qs, int qz) noexcept nogil
    int pci8_conv_tiles_quantize(int path, int wide) noexcept nogil
    void pci8_conv_tiles_res(int path, const uint8_t *grid, const int *off, int Kg, const int8_t *w8,
                             const int16_t *w16, int O, int P, int Q, int Wg, Py_ssize_t s0, Py_ssize_t s1,
                             const int32_t *zb32, const int64_t *zb64, int wide, const float *scale, int relu,
                             float *y, int32_t *acc, uint8_t *yq, float qs, int qz, const float *rf,
                             const uint8_t *rq, float rs, int rz) noexcept nogil
    void pci8_linear_block(int path, const uint8_t *x, Py_ssize_t ldx, Py_ssize_t r0, Py_ssize_t r1, int Kg,
                           const int8_t *w8, const int16_t *w16, int c0, int c1, int G, const int32_t *zb32,
                           const int64_t *zb64, int wide, const float *scale, int relu, float *y,
                           int32_t *acc) noexcept nogil
    Py_ssize_t pci8_dw_scratch(int H, int W, int KH, int KW, int SH, int SW, int PH, int PW, int P) noexcept nogil
    void pci8_dw_plane(const uint8_t *x, int H, int W, int z, const int8_t *w, int KH, int KW, int SH, int SW,
                       int PH, int PW, int P, int Q, int32_t zb32, int64_t zb64, int wide, float scale, int relu,
                       void *scratch, float *y, int keep_y, uint8_t *yq, float qs, int qz, const Py_ssize_t *off,
                       const int32_t *wp, int npairs) noexcept nogil
    int pci8_dw_pairs(const int8_t *w, int H, int W, int KH, int KW, int SH, int SW, int PH, int PW,
                      Py_ssize_t *off, int32_t *wp) noexcept nogil
    int PCI8_DW_MAXPAIRS, PCI8_DWB, PCI8_DWB_FAST, PCI8_DWB_TAPS
    void pci8_maxpool_plane(const uint8_t *x, int H, int W, int KH, int KW, int SH, int SW, int PH, int PW, int P,
                            int Q, uint8_t *y) noexcept nogil
    Py_ssize_t pci8_dwb_scratch(int H, int W, int PH, int PW, int P, int Q) noexcept nogil
    void pci8_dwb_block(const uint8_t *x, int nc, int H, int W, int z, const int16_t *wt, int KH, int KW, int SH,
                        int SW, int PH, int PW, int P, int Q, const int32_t *zb32, const int64_t *zb64, int wide,
                        const float *scale, int relu, void *scratch, float *y, uint8_t *yq, float qs,
                        int qz, int path) noexcept nogil

# the data pointer of an ndarray whose dtype, rank and contiguity were checked (or that was made here): a
# typed memoryview costs a buffer acquisition and an object per array on every call
cdef extern from *:
    """
    #include <numpy/arrayobject.h>
    static inline void *pci8_data(PyObject *a) { return PyArray_DATA((PyArrayObject *)a); }
    """
    void *pci8_data(object a)

_PATH_NAMES = {PCI8_VNNI: "avx512_vnni", PCI8_AVXVNNI: "avx_vnni", PCI8_AVX2: "avx2", PCI8_PORTABLE: "portable"}
# slowest first
_PATH_ORDER = (PCI8_PORTABLE, PCI8_AVX2, PCI8_AVXVNNI, PCI8_VNNI)
cdef int _best = pci8_best_path()
cdef int _path = _best

# the packed weights: a uint8 array, HEADER bytes of int32 fields, the raw (O, Kdim) weights, then
# the panels for one kernel size (int8, then the same widened to int16); see pc_int8.h
cdef enum:
    # int8 multiply-adds per fp32 one of a convolution or a linear layer in these kernels (VNNI:
    # four bytes a lane, less the layout), for pc_work
    INT8_MAC_GAIN = 3

cdef enum:
    HEADER = 64
    MAGIC = 0x38494350      # "PCI8"
    H_MAGIC = 0
    H_O = 1
    H_KDIM = 2
    H_O64 = 3
    H_KG_CAP = 4            # groups the panel space holds (the most any valid K needs)
    H_K = 5                 # kernel size the panels are laid out for
    H_KG = 6
    # int8 multiply-adds per unit of pc_threads_for's work: 64 per vpdpbusd, and below ~8M of
    # them one thread finishes before a woken team would
    WORK_PER_MAC = 256
    # largest reduction whose raw sums (|xq * wq| <= 255 * 127 each) fit int32
    MAX_KDIM = 2147483647 // (255 * 127)


# depthwise layout: per plane (pci8_dw_plane), channel blocks (pci8_dwb_block), or chosen by shape
_DW_MODES = ("auto", "planes", "blocks")
cdef str _dw_mode = "auto"


def _use_depthwise(name):
    """Force the depthwise kernel's layout (tests compare them in one process); returns the old mode."""
    global _dw_mode
    if name not in _DW_MODES:
        raise ValueError(f"depthwise mode must be one of {', '.join(_DW_MODES)}, got {name!r}")
    old = _dw_mode
    _dw_mode = name
    return old


def _state():
    """What prepared calls depend on besides their arguments: (path, depthwise mode); a Plan recorded under
    another state is recorded again."""
    return _path, _dw_mode


def path():
    """Which int8 dot-product path this build level and CPU run.

    Returns
    -------
    str
        ``"avx512_vnni"`` (VPDPBUSD on 16 lanes), ``"avx_vnni"`` (VPDPBUSD on 8 lanes, AVX-VNNI),
        ``"avx2"`` (int16 multiply-adds) or ``"portable"`` (C).
    """
    return _PATH_NAMES[_path]


def _paths():
    """The paths this build level and CPU run, slowest first (tests compare each with the NumPy model)."""
    return [_PATH_NAMES[p] for p in _PATH_ORDER if pci8_path_runs(p)]


def _use_path(name):
    """Run another path this build and CPU run (tests compare paths in one process); returns the old name."""
    global _path
    order = {v: k for k, v in _PATH_NAMES.items()}
    if name not in order:
        raise ValueError(f"path must be one of {', '.join(order)}, got {name!r}")
    if not pci8_path_runs(order[name]):
        raise ValueError(f"path {name!r} is not available here (this build and CPU run {', '.join(_paths())})")
    old = _PATH_NAMES[_path]
    _path = order[name]
    return old


# ----------------------------------------------------------------- validation

cdef object _array(object a, str fn, str name, object dtype, int ndim, str what):
    """``a`` as is when it is a C-contiguous ndarray of this dtype and rank, else a clear error."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray ({what}), got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{fn}: {name} must have dtype {np.dtype(dtype).name} ({what}), got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D ({what}), got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous (use numpy.ascontiguousarray), got strides "
                         f"{a.strides}")
    return a


cdef object _shaped(object a, str fn, str name, object dtype, tuple shape, str what):
    a = _array(a, fn, name, dtype, len(shape), what)
    if a.shape != shape:
        raise ValueError(f"{fn}: {name} must have shape {shape} ({what}), got {a.shape}")
    return a


cdef object _out(object a, str fn, str name, object dtype, tuple shape, str what):
    a = _shaped(a, fn, name, dtype, shape, what)
    if not a.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only; pass a writable array")
    return a


cdef int _zero_point(object z, str fn) except -1:
    if isinstance(z, (bool, np.bool_)) or not isinstance(z, (int, np.integer)):
        raise TypeError(f"{fn}: x_zero_point must be an int in 0..255, got {type(z).__name__}")
    if not 0 <= z <= 255:
        raise ValueError(f"{fn}: x_zero_point must be in 0..255 (uint8 activations), got {z}")
    return <int>z


cdef int _positive(object v, str fn, str name, int least) except -1:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v < least or v > 1 << 20:
        raise ValueError(f"{fn}: {name} must be in {least}..{1 << 20}, got {v}")
    return <int>v


cdef object _threads(object num_threads, str fn):
    if isinstance(num_threads, (bool, np.bool_)) or not isinstance(num_threads, (int, np.integer)):
        raise TypeError(f"{fn}: num_threads must be an int, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"{fn}: num_threads must be >= 1, got {num_threads}")
    return int(num_threads)


cdef object _requant_args(object yq, str fn, tuple shape, object yq_scale, object yq_zero_point):
    """Check the uint8 output of a kernel that requantizes its float32 result for the next layer."""
    yq = _out(yq, fn, "yq", np.uint8, shape, "uint8 " + str(shape) + ": the next layer's input")
    if isinstance(yq_scale, (bool, np.bool_)) or not isinstance(yq_scale, (float, int, np.floating, np.integer)):
        raise TypeError(f"{fn}: yq_scale must be a float, got {type(yq_scale).__name__}")
    cdef float s = <float>yq_scale
    if not (isfinite(s) and s > 0.0):
        raise ValueError(f"{fn}: yq_scale must be a finite float32 > 0, got {yq_scale!r}")
    if isinstance(yq_zero_point, (bool, np.bool_)) or not isinstance(yq_zero_point, (int, np.integer)):
        raise TypeError(f"{fn}: yq_zero_point must be an int in 0..255, got {type(yq_zero_point).__name__}")
    if not 0 <= yq_zero_point <= 255:
        raise ValueError(f"{fn}: yq_zero_point must be in 0..255 (uint8 activations), got {yq_zero_point}")
    return yq


cdef struct _Requant:
    uint8_t *p          # the uint8 output, or NULL for none
    float scale
    int zero_point


cdef _Requant _requant_target(object yq, object yq_scale, object yq_zero_point):
    """The raw form of a yq checked by _requant_args, for the kernels (None: NULL, 1.0, 0)."""
    cdef _Requant t
    t.p = NULL
    t.scale = 1.0
    t.zero_point = 0
    if yq is not None:
        t.p = <uint8_t *>pci8_data(yq)
        t.scale = <float>yq_scale
        t.zero_point = <int>yq_zero_point
    return t


cdef struct _Residual:
    const float *f      # a float32 shortcut, or NULL
    const uint8_t *q    # a uint8 one, or NULL
    float scale
    int zero_point


cdef _Residual _residual_target(str fn, tuple shape, object residual, object residual_q, object rs, object rz) except *:
    """Check a residual block's shortcut (float32 ``residual`` or uint8 ``residual_q`` with its scale and zero
    point, of the output's shape) and return its raw form (both NULL for none)."""
    cdef _Residual t
    t.f = NULL
    t.q = NULL
    t.scale = 1.0
    t.zero_point = 0
    if residual is not None and residual_q is not None:
        raise ValueError(f"{fn}: pass the shortcut as residual (float32) or residual_q (uint8), not both")
    if residual is not None:
        residual = _shaped(residual, fn, "residual", np.float32, shape, "float32 " + str(shape) + ": the shortcut")
        t.f = <const float *>pci8_data(residual)
    elif residual_q is not None:
        residual_q = _shaped(residual_q, fn, "residual_q", np.uint8, shape,
                             "uint8 " + str(shape) + ": the quantized shortcut")
        if isinstance(rs, (bool, np.bool_)) or not isinstance(rs, (float, int, np.floating, np.integer)):
            raise TypeError(f"{fn}: residual_scale must be a float, got {type(rs).__name__}")
        if not (isfinite(<float>rs) and <float>rs > 0.0):
            raise ValueError(f"{fn}: residual_scale must be a finite float32 > 0, got {rs!r}")
        if isinstance(rz, (bool, np.bool_)) or not isinstance(rz, (int, np.integer)):
            raise TypeError(f"{fn}: residual_zero_point must be an int in 0..255, got {type(rz).__name__}")
        if not 0 <= rz <= 255:
            raise ValueError(f"{fn}: residual_zero_point must be in 0..255 (uint8 activations), got {rz}")
        t.q = <const uint8_t *>pci8_data(residual_q)
        t.scale = <float>rs
        t.zero_point = <int>rz
    return t


cdef void _quantize_team(const float *x, Py_ssize_t n, float s, int z, uint8_t *out, int nt) noexcept nogil:
    """pci8_quantize over n values in blocks, on as many threads as pay."""
    cdef Py_ssize_t block = 1 << 16
    cdef Py_ssize_t nb = (n + block - 1) // block, b, lo, hi
    for b in prange(nb, schedule="dynamic", num_threads=pc_cap(pc_team(nb, pc_threads_for(n, nb, nt)))):
        lo = b * block
        hi = lo + block if lo + block < n else n
        pci8_quantize(x + lo, hi - lo, s, z, out + lo)


# ------------------------------------------------------------- prepared calls
# Each kernel entry checks its arguments and fills a _Step (raw pointers and sizes, with the arrays behind
# them kept alive), then runs it. A Plan keeps the steps of a chain of calls on buffers of its own and runs
# them again without the checks: at batch 1 the checks and array set-up cost more than the kernels.

cdef enum:
    _K_CONV = 1
    _K_DW = 2
    _K_DWB = 3
    _K_LINEAR = 4
    _K_POOL = 5
    _K_QUANT = 6


cdef struct _ConvRun:
    const uint8_t *xp
    uint8_t *gp
    const int *offv
    const int8_t *w8
    const int16_t *w16
    const float *sv
    const int32_t *z32
    const int64_t *z64
    float *yp
    _Requant rq
    _Residual res
    double work
    Py_ssize_t HW, PQ, plane, img, slack, per_img, run
    int N, C, H, W, O, K, S, pad, P, Q, nph, Hg, Wg, CG, kg, z, path, relu, wide, direct, nt, team


cdef struct _DwRun:
    const uint8_t *xp
    const int8_t *wp
    const float *sv
    const int32_t *z32
    const int64_t *z64
    float *yp
    _Requant rq
    Py_ssize_t *offv
    int32_t *wpv
    double work
    Py_ssize_t HW, PQ, KK, scratch_n, planes, chunk
    int C, H, W, KH, KW, SH, SW, PH, PW, P, Q, z, relu, wide, team, npairs


cdef struct _DwbRun:
    const uint8_t *xp
    const int16_t *wtp
    const int32_t *z32p
    const int64_t *z64p
    const float *scp
    float *yp
    _Requant rq
    double work
    Py_ssize_t HW, PQ, KK, scratch_n, jobs
    int C, CB, H, W, KH, KW, SH, SW, PH, PW, P, Q, z, relu, wide, team, path


cdef struct _LinRun:
    const uint8_t *xsrc     # the caller's (N, F) input
    uint8_t *xpad           # (N, ldx) with F % 4: xsrc copied in at every run; else NULL
    const int8_t *w8
    const int16_t *w16
    const float *sv
    const int32_t *z32
    const int64_t *z64
    float *yp
    _Requant rq
    double work
    Py_ssize_t N, F, ldx, rb, rblocks, jobs
    int G, kg, path, relu, wide, team, nt


cdef struct _PoolRun:
    const uint8_t *xp
    uint8_t *yp
    double work
    Py_ssize_t HW, PQ, planes, chunk
    int H, W, KH, KW, SH, SW, PH, PW, P, Q, team


cdef struct _QuantRun:
    const float *xp
    uint8_t *op
    double work
    Py_ssize_t n
    float s
    int z, nt


cdef class _Step:
    """One kernel call, checked and prepared (see above): ``run(args)`` does it, ``args`` pointing at the
    struct of its kind."""
    cdef int kind
    cdef str fn
    cdef list keep
    cdef int (*run)(void *) noexcept nogil
    cdef void *args
    cdef Py_ssize_t in_n, out_n  # elements of the input and of the output the call reads and writes
    cdef _ConvRun conv
    cdef _DwRun dw
    cdef _DwbRun dwb
    cdef _LinRun lin
    cdef _PoolRun pool
    cdef _QuantRun quant


cdef _Step _new_step(int kind, str fn, list keep):
    cdef _Step st = _Step.__new__(_Step)
    st.kind = kind
    st.fn = fn
    st.keep = keep
    if kind == _K_CONV:
        st.run, st.args = _conv_run, &st.conv
    elif kind == _K_DW:
        st.run, st.args = _dw_run, &st.dw
    elif kind == _K_DWB:
        st.run, st.args = _dwb_run, &st.dwb
    elif kind == _K_LINEAR:
        st.run, st.args = _lin_run, &st.lin
    elif kind == _K_POOL:
        st.run, st.args = _pool_run, &st.pool
    else:
        st.run, st.args = _quant_run, &st.quant
    return st


cdef int _quant_run(void *p) noexcept nogil:
    cdef _QuantRun *r = <_QuantRun *>p
    pc_work(r.work)
    _quantize_team(r.xp, r.n, r.s, r.z, r.op, r.nt)
    return 0


cdef int _run_step(_Step st) except -1:
    cdef int failed
    with nogil:
        failed = st.run(st.args)
    if failed:
        raise MemoryError(f"{st.fn}: could not allocate scratch")
    return 0


cdef object _done(_Step st, object step):
    """A kernel entry's end: the prepared call (step=True, for a Plan), or None after running it."""
    if step is not True and step is not False:
        raise TypeError(f"{st.fn}: step must be True or False, got {step!r}")
    if step:
        return st
    _run_step(st)


cdef class Plan:
    """Prepared kernel calls (the entries' ``step=True`` results) run in order: the first a :func:`quantize`
    of the float32 input, the last a call with a float32 output, the ones between on buffers the plan's
    steps share. ``run(x, out)`` points the first at ``x`` and the last at ``out`` (both float32,
    C-contiguous, of the recorded shapes) and runs them all, with none of the entries' checks or set-up.
    Not for concurrent use: the buffers between the steps are the plan's."""

    cdef list steps
    cdef tuple x_shape, out_shape

    def __init__(self, steps, x_shape, out_shape):
        cdef list kept = list(steps)
        cdef object one
        for one in kept:
            if not isinstance(one, _Step) or (<_Step>one).run == NULL:
                raise TypeError(f"Plan: steps must be prepared calls (a kernel entry's step=True result), got "
                                f"{type(one).__name__}")
        if not kept or (<_Step>kept[0]).kind != _K_QUANT:
            raise ValueError("Plan: the first step must be a quantize step (the plan's input)")
        cdef _Step first = <_Step>kept[0], last = <_Step>kept[len(kept) - 1]  # (no wraparound in this module)
        if not ((last.kind == _K_CONV and last.conv.yp != NULL) or (last.kind == _K_LINEAR and last.lin.yp != NULL)
                or (last.kind == _K_DW and last.dw.yp != NULL) or (last.kind == _K_DWB and last.dwb.yp != NULL)):
            raise ValueError("Plan: the last step must write a float32 output")
        x_shape, out_shape = tuple(int(d) for d in x_shape), tuple(int(d) for d in out_shape)
        if math.prod(x_shape) != first.in_n or math.prod(out_shape) != last.out_n:
            raise ValueError(f"Plan: x_shape {x_shape} and out_shape {out_shape} must hold the first step's "
                             f"{first.in_n} inputs and the last step's {last.out_n} outputs")
        self.steps = kept
        self.x_shape, self.out_shape = x_shape, out_shape

    def run(self, x, out):
        x = _shaped(x, "Plan.run", "x", np.float32, self.x_shape, "float32 " + str(self.x_shape))
        out = _out(out, "Plan.run", "out", np.float32, self.out_shape, "float32 " + str(self.out_shape))
        cdef _Step first = <_Step>self.steps[0], last = <_Step>self.steps[len(self.steps) - 1], st
        first.quant.xp = <const float *>pci8_data(x)
        cdef float *op = <float *>pci8_data(out)
        if last.kind == _K_CONV:
            last.conv.yp = op
        elif last.kind == _K_LINEAR:
            last.lin.yp = op
        elif last.kind == _K_DW:
            last.dw.yp = op
        else:
            last.dwb.yp = op
        for st in self.steps:
            _run_step(st)
        return out


cdef object _epilogue(str fn, int O, object scale, object bias_q, object row_sums, int z, Py_ssize_t kdim):
    """(scale, zb32, zb64, wide, finite): zb = bias_q - z * row_sums; wide where a sum may leave int32; finite
    where every scale is (the VNNI epilogues that quantize for the next layer then need no NaN test)."""
    scale = _shaped(scale, fn, "scale", np.float32, (O,), "float32 (O,): s_x * s_w[o]")
    cdef const float *sv = <const float *>pci8_data(scale)
    cdef int o
    cdef bint finite = True
    for o in range(O):
        finite = finite and isfinite(sv[o])
    if bias_q is not None:
        bias_q = _shaped(bias_q, fn, "bias_q", np.int32, (O,), "int32 (O,) or None")
    zb = np.empty(O, dtype=np.int64)
    zb32 = np.empty(O, dtype=np.int32)
    cdef int64_t *z64 = <int64_t *>pci8_data(zb)
    cdef int32_t *z32 = <int32_t *>pci8_data(zb32)
    cdef const int32_t *bv
    cdef const int32_t *rv
    cdef int64_t v, most = 0
    for o in range(O):
        z64[o] = 0
    if bias_q is not None:
        bv = <const int32_t *>pci8_data(bias_q)
        for o in range(O):
            z64[o] = bv[o]
    if row_sums is not None:
        rv = <const int32_t *>pci8_data(row_sums)
        for o in range(O):
            z64[o] -= <int64_t>z * rv[o]
    for o in range(O):
        v = z64[o] if z64[o] >= 0 else -z64[o]
        if v > most:
            most = v
        z32[o] = <int32_t>z64[o]
    # raw sums lie in +-kdim * 255 * 127; a fast int32 epilogue needs raw + zb inside int32
    wide = most + <int64_t>kdim * 255 * 127 >= (<int64_t>1 << 31)
    return scale, zb32, zb, wide, finite


cdef object _packed(object packed, object row_sums, str fn, int O, Py_ssize_t kdim, str kdim_what):
    """Check a pack_weights result against the layer it is used with."""
    packed = _array(packed, fn, "packed", np.uint8, 1, "the buffer pack_weights returned")
    if packed.shape[0] < HEADER:
        raise ValueError(f"{fn}: packed is not a pack_weights buffer ({packed.shape[0]} bytes)")
    cdef const int32_t *hdr = <const int32_t *>pci8_data(packed)
    if hdr[H_MAGIC] != MAGIC:
        raise ValueError(f"{fn}: packed is not a pack_weights buffer (bad header); pass the first value "
                         f"pack_weights(wq) returned")
    if packed.shape[0] != _packed_size(hdr[H_O], hdr[H_KDIM], hdr[H_O64], hdr[H_KG_CAP]):
        raise ValueError(f"{fn}: packed has {packed.shape[0]} bytes, not what its header says; pass the "
                         f"buffer pack_weights returned, unmodified")
    if hdr[H_O] != O:
        raise ValueError(f"{fn}: packed holds weights for {hdr[H_O]} output channels, but this layer has O={O}; "
                         f"pack this layer's own weights")
    if hdr[H_KDIM] != kdim:
        raise ValueError(f"{fn}: packed holds weights of reduction size {hdr[H_KDIM]}, but this layer needs "
                         f"{kdim_what} = {kdim}; pack this layer's own weights")
    if not packed.flags.writeable:
        raise ValueError(f"{fn}: packed is read-only; the kernels lay the panels out on first use")
    row_sums = _shaped(row_sums, fn, "row_sums", np.int32, (O,), "int32 (O,), the second value pack_weights returned")
    return packed


cdef Py_ssize_t _packed_size(Py_ssize_t O, Py_ssize_t kdim, Py_ssize_t O64, Py_ssize_t kg_cap):
    return HEADER + (O * kdim + 63) // 64 * 64 + O64 * kg_cap * 4 * 3


cdef int _layout(object packed, int K) except -1:
    """Lay the panels out for kernel size K if they are not already (under the GIL, once per K)."""
    cdef uint8_t *buf = <uint8_t *>pci8_data(packed)
    cdef int32_t *hdr = <int32_t *>buf
    if hdr[H_K] == K:
        return hdr[H_KG]
    cdef int O = hdr[H_O], kdim = hdr[H_KDIM], O64 = hdr[H_O64]
    cdef Py_ssize_t raw_bytes = (<Py_ssize_t>O * kdim + 63) // 64 * 64
    cdef Py_ssize_t p8 = HEADER + raw_bytes
    cdef int kg = pci8_groups(kdim, K)
    if kg > hdr[H_KG_CAP]:
        raise ValueError(f"packed: kernel size {K} does not divide the reduction size {kdim} into channels")
    # with the GIL held: another thread using the same buffer never sees half a layout
    pci8_pack(<const int8_t *>&buf[HEADER], O, kdim, K, O64, <int8_t *>&buf[p8],
              <int16_t *>&buf[p8 + <Py_ssize_t>O64 * hdr[H_KG_CAP] * 4])
    hdr[H_KG] = kg
    hdr[H_K] = K
    return kg


# --------------------------------------------------------------------- quantize

def quantize(x,            # IN  float32 (n,)
             scale,        # float > 0
             zero_point,   # int in 0..255
             out,          # OUT uint8 (n,), overwritten
             num_threads,
             step=False):  # as conv2d_forward's
    """Quantize float32 to uint8: ``out = clamp(rint(x / scale) + zero_point, 0, 255)``.

    ``x / scale`` is computed in float32 and rounded half to even (ONNX QuantizeLinear's rule);
    NaN maps to ``zero_point``, +-inf to 255 / 0.
    """
    fn = "quantize"
    x = _array(x, fn, "x", np.float32, 1, "float32 (n,)")
    out = _out(out, fn, "out", np.uint8, (x.shape[0],), "uint8, the length of x")
    cdef int nt = _threads(num_threads, fn)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (float, int, np.floating, np.integer)):
        raise TypeError(f"{fn}: scale must be a float, got {type(scale).__name__}")
    cdef float s = <float>scale
    if not (isfinite(s) and s > 0.0):
        raise ValueError(f"{fn}: scale must be a finite float32 > 0, got {scale!r}")
    cdef int z = _zero_point(zero_point, fn)
    cdef Py_ssize_t n = x.shape[0]
    cdef double work = pc_elems_ns(<double>n)
    pc_work(work)
    if n == 0 and not step:
        return
    cdef _Step st = _new_step(_K_QUANT, fn, [x, out])
    st.in_n = st.out_n = n
    st.quant.xp = <const float *>pci8_data(x)
    st.quant.op = <uint8_t *>pci8_data(out)
    st.quant.work = work
    st.quant.n, st.quant.s, st.quant.z, st.quant.nt = n, s, z, nt
    return _done(st, step)


# ---------------------------------------------------------------------- packing

def pack_weights(wq):
    """Pack int8 weights once for :func:`conv2d_forward` / :func:`linear_forward`.

    Parameters
    ----------
    wq : int8 (O, Kdim), C-contiguous
        Kdim = C*K*K in (c, kh, kw) order for a convolution, F for a linear layer; values in
        [-127, 127].

    Returns
    -------
    packed : uint8 ndarray
        Opaque; valid on every kernel level of this build (the panels are laid out for the
        kernel size on first use, in place).
    row_sums : int32 (O,)
        ``sum_k wq[o, k]`` (folds the activation zero point).
    """
    fn = "pack_weights"
    wq = _array(wq, fn, "wq", np.int8, 2, "int8 (O, Kdim)")
    cdef Py_ssize_t O = wq.shape[0], kdim = wq.shape[1]
    if O < 1 or kdim < 1:
        raise ValueError(f"{fn}: wq must have at least one row and column, got shape {wq.shape}")
    if kdim > MAX_KDIM:
        raise ValueError(f"{fn}: Kdim={kdim} is too large for int32 accumulation (at most {MAX_KDIM}); "
                         f"split the reduction")
    if O > 1 << 24:
        raise ValueError(f"{fn}: O={O} is too large (at most {1 << 24})")
    if wq.size and int(wq.min()) < -127:
        raise ValueError(f"{fn}: wq must lie in [-127, 127] (symmetric int8), found -128")
    cdef Py_ssize_t O64 = (O + 63) // 64 * 64
    # panel space for the largest layout any kernel size K (K*K dividing Kdim) asks for
    cdef Py_ssize_t kg_cap = 0, K = 1
    while K * K <= kdim:
        if kdim % (K * K) == 0:
            kg_cap = max(kg_cap, pci8_groups(<int>kdim, <int>K))
        K += 1
    packed = np.zeros(_packed_size(O, kdim, O64, kg_cap), dtype=np.uint8)
    hdr = packed[:HEADER].view(np.int32)
    hdr[H_MAGIC] = MAGIC
    hdr[H_O] = O
    hdr[H_KDIM] = kdim
    hdr[H_O64] = O64
    hdr[H_KG_CAP] = kg_cap
    hdr[H_K] = 0
    packed[HEADER:HEADER + O * kdim] = wq.reshape(-1).view(np.uint8)
    _layout(packed, 1)
    row_sums = wq.sum(axis=1, dtype=np.int64).astype(np.int32)
    return packed, row_sums


# ------------------------------------------------------------------------- conv

def conv2d_forward(xq,            # IN  uint8 (N, C, H, W)
                   x_zero_point,  # int in 0..255
                   packed,        # IN  pack_weights(wq (O, C*K*K))[0]
                   row_sums,      # IN  int32 (O,)
                   O, K, stride, padding,
                   scale,         # IN  float32 (O,)
                   bias_q,        # IN  int32 (O,) or None
                   y,             # OUT float32 (N, O, P, Q), overwritten; or None with yq
                   relu,
                   num_threads,
                   yq=None,       # OUT uint8 (N, O, P, Q) or None: y quantized for the next layer
                   yq_scale=1.0, yq_zero_point=0,
                   residual=None,    # IN float32 (N, O, P, Q) or None: a residual block's shortcut
                   residual_q=None,  # IN uint8 (N, O, P, Q) or None: the same, quantized
                   residual_scale=1.0, residual_zero_point=0,
                   step=False):       # True: return the checked call for a Plan instead of running it
    """Quantized 2-D convolution (groups 1, square K, dilation 1); see the module docstring.

    P = (H + 2 padding - K) // stride + 1, likewise Q; y is overwritten. With ``yq``, the
    float32 result is also quantized into it as :func:`quantize` would (``yq_scale``,
    ``yq_zero_point``: the next layer's input parameters) while it is still in cache; ``y`` may
    then be None (the float32 result is not kept).

    As the last convolution of a residual block, the shortcut is added before the ReLU:
    ``y = float32(acc + bias_q) * scale + r``, then ``max(y, 0)`` when ``relu``, where ``r`` is
    ``residual`` (float32) or ``float32(residual_q - residual_zero_point) * residual_scale``
    (uint8: the block's quantized input, dequantized as ONNX ``DequantizeLinear`` does); at most
    one of the two.
    """
    fn = "conv2d_forward"
    xq = _array(xq, fn, "xq", np.uint8, 4, "uint8 (N, C, H, W)")
    cdef int z = _zero_point(x_zero_point, fn)
    cdef int O_ = _positive(O, fn, "O", 1), K_ = _positive(K, fn, "K", 1)
    cdef int S = _positive(stride, fn, "stride", 1), pad = _positive(padding, fn, "padding", 0)
    cdef int nt = _threads(num_threads, fn)
    cdef int N = xq.shape[0], C = xq.shape[1], H = xq.shape[2], W = xq.shape[3]
    if C < 1:
        raise ValueError(f"{fn}: xq must have at least one channel, got shape {xq.shape}")
    if H + 2 * pad < K_ or W + 2 * pad < K_:
        raise ValueError(f"{fn}: kernel size K={K_} is larger than the padded input {H + 2 * pad}x{W + 2 * pad}")
    cdef Py_ssize_t kdim = <Py_ssize_t>C * K_ * K_
    packed = _packed(packed, row_sums, fn, O_, kdim, f"C*K*K = {C}*{K_}*{K_}")
    cdef int P = (H + 2 * pad - K_) // S + 1, Q = (W + 2 * pad - K_) // S + 1
    cdef double work = pc_conv_ns(<double>N * O_ * P * Q * kdim / INT8_MAC_GAIN)
    pc_work(work)
    if y is not None or yq is None:
        y = _out(y, fn, "y", np.float32, (N, O_, P, Q), "float32 (N, O, P, Q)")
    if yq is not None:
        yq = _requant_args(yq, fn, (N, O_, P, Q), yq_scale, yq_zero_point)
    scale, zb32, zb64, wide, finite = _epilogue(fn, O_, scale, bias_q, row_sums, z, kdim)
    cdef _Residual res = _residual_target(fn, (N, O_, P, Q), residual, residual_q, residual_scale,
                                          residual_zero_point)
    if N == 0:
        return
    cdef int kg = _layout(packed, K_)
    cdef const int32_t *hdr = <const int32_t *>pci8_data(packed)
    cdef int O64 = hdr[H_O64], kg_cap = hdr[H_KG_CAP]

    # the grid (pc_int8.h): padded, stride phases (only those a tap reads), channels in fours
    cdef int nph = S if S < K_ else K_
    cdef int Hg = (H + 2 * pad + S - 1) // S, Wg = (W + 2 * pad + S - 1) // S
    cdef int CG = (C + 3) // 4
    cdef Py_ssize_t plane = <Py_ssize_t>nph * nph * Hg * Wg          # pixels of one channel group
    cdef Py_ssize_t img = CG * plane                                  # pixels of one image's grid
    cdef Py_ssize_t s_end = <Py_ssize_t>(P - 1) * Wg + Q
    cdef Py_ssize_t tiles = (s_end + PCI8_TILE - 1) // PCI8_TILE
    # reads past an image's grid land in the next one's or in this slack (those pixels are dropped)
    cdef Py_ssize_t slack = (tiles * PCI8_TILE + Wg + 16) * 4 + 64 * K_ * K_ * 4
    cdef Py_ssize_t per_img = 1
    while N * per_img < <Py_ssize_t>nt * PC_BLOCKS_PER_THREAD and per_img < tiles:
        per_img *= 2
    if per_img > tiles:
        per_img = tiles
    # the batch's grids (a job with a whole image makes its own in scratch instead)
    grid = np.empty(<Py_ssize_t>N * img * 4 + slack if per_img > 1 else 1, dtype=np.uint8)
    if per_img > 1:
        grid[<Py_ssize_t>N * img * 4:] = z
    off = np.empty(kg, dtype=np.intc)
    cdef int *offv = <int *>pci8_data(off)
    cdef int cg, kh, kw, g = 0
    for cg in range(CG):
        for kh in range(K_):
            for kw in range(K_):
                offv[g] = cg * plane + ((kh % S) * nph + kw % S) * Hg * Wg + (kh // S) * Wg + kw // S
                g += 1

    cdef uint8_t *pv = <uint8_t *>pci8_data(packed)
    cdef const float *sv = <const float *>pci8_data(scale)
    cdef const int32_t *z32 = <const int32_t *>pci8_data(zb32)
    cdef const int64_t *z64 = <const int64_t *>pci8_data(zb64)
    # the tiles quantize for the next layer as they store (VNNI), or float32 results are quantized after them
    cdef int direct = yq is not None and finite and pci8_conv_tiles_quantize(_path, 1 if wide else 0)
    if y is None and per_img > 1 and not direct:
        y = np.empty((N, O_, P, Q), dtype=np.float32)  # whole-batch runs: quantized after the last run
    cdef float *yp = <float *>pci8_data(y) if y is not None else NULL
    cdef _Requant rq = _requant_target(yq, yq_scale, yq_zero_point)
    cdef const uint8_t *xp = <const uint8_t *>pci8_data(xq)
    cdef uint8_t *gp = <uint8_t *>pci8_data(grid)
    cdef Py_ssize_t p8 = HEADER + (<Py_ssize_t>O_ * kdim + 63) // 64 * 64
    cdef const int8_t *w8 = <const int8_t *>&pv[p8]
    cdef const int16_t *w16 = <const int16_t *>&pv[p8 + <Py_ssize_t>O64 * kg_cap * 4]
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int path_ = _path, relu_ = 1 if relu else 0, wide_ = 1 if wide else 0
    cdef Py_ssize_t jobs

    cdef Py_ssize_t run = (tiles + per_img - 1) // per_img * PCI8_TILE
    jobs = <Py_ssize_t>N * per_img
    cdef _Step st = _new_step(_K_CONV, fn, [xq, packed, scale, zb32, zb64, grid, off, y, yq, residual, residual_q])
    st.in_n, st.out_n = <Py_ssize_t>N * C * HW, <Py_ssize_t>N * O_ * PQ
    cdef _ConvRun *r = &st.conv
    r.xp, r.gp, r.offv, r.w8, r.w16 = xp, gp, offv, w8, w16
    r.sv, r.z32, r.z64, r.yp, r.rq, r.res = sv, z32, z64, yp, rq, res
    r.work = work
    r.HW, r.PQ, r.plane, r.img, r.slack, r.per_img, r.run = HW, PQ, plane, img, slack, per_img, run
    r.N, r.C, r.H, r.W, r.O, r.K, r.S, r.pad, r.P, r.Q = N, C, H, W, O_, K_, S, pad, P, Q
    r.nph, r.Hg, r.Wg, r.CG, r.kg, r.z = nph, Hg, Wg, CG, kg, z
    r.path, r.relu, r.wide, r.direct, r.nt = path_, relu_, wide_, direct, nt
    r.team = pc_team(jobs, pc_threads_for(<Py_ssize_t>N * PQ * O_ * kdim // WORK_PER_MAC, jobs, nt))
    return _done(st, step)


cdef int _conv_run(void *p) noexcept nogil:
    """conv2d_forward's work on a checked call; 1 where scratch could not be allocated."""
    cdef _ConvRun *r = <_ConvRun *>p
    pc_work(r.work)
    cdef int32_t *acc = NULL
    cdef uint8_t *own = NULL
    cdef float *ybuf = NULL
    cdef float *dst = NULL
    cdef Py_ssize_t i, n, jobs, rr
    cdef int cg
    cdef int failed[1]
    failed[0] = 0
    cdef Py_ssize_t img = r.img, slack = r.slack, plane = r.plane, PQ = r.PQ, HW = r.HW
    cdef int N = r.N, C = r.C, O_ = r.O, z = r.z, direct = r.direct
    cdef float *yp = r.yp
    cdef _Requant rq = r.rq
    cdef _Residual res = r.res
    if r.per_img == 1:
        # one image per job: the job lays out its image's grid in its own buffer (still in cache
        # when the tiles read it; no pass over the batch, no barrier)
        with parallel(num_threads=pc_cap(r.team)):
            acc = <int32_t *>malloc(sizeof(int32_t) * PCI8_OB * PCI8_TILE + 64)
            own = <uint8_t *>malloc(img * 4 + slack)
            # without y, one image's float32 result lives in this thread's buffer until it is quantized
            ybuf = <float *>malloc(sizeof(float) * O_ * PQ + 64) if yp == NULL and not direct else NULL
            if own != NULL:
                memset(own + img * 4, z, slack)
            for n in prange(N, schedule="dynamic"):
                if acc == NULL or own == NULL or (yp == NULL and ybuf == NULL and not direct):
                    failed[0] = 1
                    continue
                for cg in range(r.CG):
                    pci8_grid_group(r.xp + n * C * HW, C, r.H, r.W, r.pad, r.S, r.nph, r.Hg, r.Wg, cg, <uint8_t>z,
                                    own + cg * plane * 4)
                dst = yp + n * O_ * PQ if yp != NULL else ybuf
                pci8_conv_tiles_res(r.path, own, r.offv, r.kg, r.w8, r.w16, O_, r.P, r.Q, r.Wg, 0, r.run, r.z32,
                                    r.z64, r.wide, r.sv, r.relu, dst, acc,
                                    rq.p + n * O_ * PQ if direct else NULL, rq.scale, rq.zero_point,
                                    res.f + n * O_ * PQ if res.f != NULL else NULL,
                                    res.q + n * O_ * PQ if res.q != NULL else NULL, res.scale, res.zero_point)
                if rq.p != NULL and not direct:
                    pci8_quantize(dst, O_ * PQ, rq.scale, rq.zero_point, rq.p + n * O_ * PQ)
            free(acc)
            free(own)
            free(ybuf)
    else:
        # few images split into runs: their grids first (one thread below ~1 MB of grid: waking the
        # team costs more), then the runs
        jobs = <Py_ssize_t>N * r.CG
        for i in prange(jobs, schedule="dynamic",
                        num_threads=pc_cap(pc_team(jobs, pc_threads_for(N * img * 4 // 32, jobs, r.nt)))):
            n = i // r.CG
            pci8_grid_group(r.xp + n * C * HW, C, r.H, r.W, r.pad, r.S, r.nph, r.Hg, r.Wg, <int>(i - n * r.CG),
                            <uint8_t>z, r.gp + (n * img + (i - n * r.CG) * plane) * 4)
        jobs = <Py_ssize_t>N * r.per_img
        with parallel(num_threads=pc_cap(r.team)):
            acc = <int32_t *>malloc(sizeof(int32_t) * PCI8_OB * PCI8_TILE + 64)
            for i in prange(jobs, schedule="dynamic"):
                if acc == NULL:
                    failed[0] = 1
                    continue
                n = i // r.per_img
                rr = i - n * r.per_img
                pci8_conv_tiles_res(r.path, r.gp + n * img * 4, r.offv, r.kg, r.w8, r.w16, O_, r.P, r.Q, r.Wg,
                                    rr * r.run, (rr + 1) * r.run, r.z32, r.z64, r.wide, r.sv, r.relu,
                                    yp + n * O_ * PQ if yp != NULL else NULL, acc,
                                    rq.p + n * O_ * PQ if direct else NULL, rq.scale, rq.zero_point,
                                    res.f + n * O_ * PQ if res.f != NULL else NULL,
                                    res.q + n * O_ * PQ if res.q != NULL else NULL, res.scale, res.zero_point)
            free(acc)
        if rq.p != NULL and not direct and not failed[0]:
            _quantize_team(yp, <Py_ssize_t>N * O_ * PQ, rq.scale, rq.zero_point, rq.p, r.nt)
    return failed[0]


# -------------------------------------------------------------------- depthwise

def depthwise_forward(xq,            # IN  uint8 (N, C, H, W)
                      x_zero_point,  # int in 0..255
                      wq,            # IN  int8 (C, 1, KH, KW)
                      sh, sw, ph, pw,
                      scale,         # IN  float32 (C,)
                      bias_q,        # IN  int32 (C,) or None
                      y,             # OUT float32 (N, C, P, Q), overwritten; or None with yq
                      relu,
                      num_threads,
                      yq=None,       # OUT uint8 (N, C, P, Q) or None: y quantized for the next layer
                      yq_scale=1.0, yq_zero_point=0,
                      step=False):   # as conv2d_forward's
    """Quantized depthwise convolution (groups == C == O); see the module docstring.

    P = (H + 2 ph - KH) // sh + 1, Q = (W + 2 pw - KW) // sw + 1; y is overwritten. ``yq``,
    ``yq_scale``, ``yq_zero_point`` as in :func:`conv2d_forward` (each plane quantized as it
    is finished).
    """
    fn = "depthwise_forward"
    xq = _array(xq, fn, "xq", np.uint8, 4, "uint8 (N, C, H, W)")
    cdef int z = _zero_point(x_zero_point, fn)
    wq = _array(wq, fn, "wq", np.int8, 4, "int8 (C, 1, KH, KW)")
    cdef int SH = _positive(sh, fn, "sh", 1), SW = _positive(sw, fn, "sw", 1)
    cdef int PH = _positive(ph, fn, "ph", 0), PW = _positive(pw, fn, "pw", 0)
    cdef int nt = _threads(num_threads, fn)
    cdef int N = xq.shape[0], C = xq.shape[1], H = xq.shape[2], W = xq.shape[3]
    cdef int KH = wq.shape[2], KW = wq.shape[3]
    if wq.shape[0] != C or wq.shape[1] != 1 or KH < 1 or KW < 1:
        raise ValueError(f"{fn}: wq must have shape (C, 1, KH, KW) = ({C}, 1, KH, KW) for xq with C={C}, "
                         f"got {wq.shape}")
    if C < 1:
        raise ValueError(f"{fn}: xq must have at least one channel, got shape {xq.shape}")
    if H + 2 * PH < KH or W + 2 * PW < KW:
        raise ValueError(f"{fn}: kernel ({KH}, {KW}) is larger than the padded input ({H + 2 * PH}, {W + 2 * PW})")
    cdef const int8_t *wp = <const int8_t *>pci8_data(wq)
    cdef Py_ssize_t k
    for k in range(<Py_ssize_t>C * KH * KW):
        if wp[k] == -128:
            raise ValueError(f"{fn}: wq must lie in [-127, 127] (symmetric int8), found -128")
    cdef int P = (H + 2 * PH - KH) // SH + 1, Q = (W + 2 * PW - KW) // SW + 1
    cdef double work = pc_conv_ns(<double>N * C * P * Q * KH * KW)
    pc_work(work)
    if y is not None or yq is None:
        y = _out(y, fn, "y", np.float32, (N, C, P, Q), "float32 (N, C, P, Q)")
    if yq is not None:
        yq = _requant_args(yq, fn, (N, C, P, Q), yq_scale, yq_zero_point)
    scale, zb32, zb64, wide, finite = _epilogue(fn, C, scale, bias_q, None, z, <Py_ssize_t>KH * KW)
    if N == 0:
        return
    if _dw_mode == "blocks" or (_dw_mode == "auto" and _dw_blocks_pay(C, H, W, KH, KW, SH, SW, P, Q)):
        return _done(_depthwise_blocks(xq, z, wq, SH, SW, PH, PW, P, Q, scale, zb32, zb64, wide, finite, y, relu, nt,
                                       yq, yq_scale, yq_zero_point, work), step)
    cdef const float *sv = <const float *>pci8_data(scale)
    cdef const int32_t *z32 = <const int32_t *>pci8_data(zb32)
    cdef const int64_t *z64 = <const int64_t *>pci8_data(zb64)
    cdef float *yp = <float *>pci8_data(y) if y is not None else NULL
    cdef _Requant rq = _requant_target(yq, yq_scale, yq_zero_point)
    cdef const uint8_t *xp = <const uint8_t *>pci8_data(xq)
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q, KK = <Py_ssize_t>KH * KW
    cdef Py_ssize_t scratch_n = pci8_dw_scratch(H, W, KH, KW, SH, SW, PH, PW, P)
    cdef int relu_ = 1 if relu else 0, wide_ = 1 if wide else 0
    cdef Py_ssize_t planes = <Py_ssize_t>N * C, i, c
    cdef int team = pc_team(planes, pc_threads_for(planes * PQ * KK, planes, nt))
    # planes in runs of ~PC_BLOCKS_PER_THREAD per thread's share: one shared-counter step per plane costs as
    # much as a small plane's work
    cdef Py_ssize_t chunk = max(1, planes // (<Py_ssize_t>team * PC_BLOCKS_PER_THREAD * 4))
    # each channel's tap pairs once per call (their offsets are the same for every channel)
    offs = np.empty(PCI8_DW_MAXPAIRS, dtype=np.intp)
    wps = np.empty(<Py_ssize_t>C * PCI8_DW_MAXPAIRS, dtype=np.int32)
    cdef Py_ssize_t *offv = <Py_ssize_t *>pci8_data(offs)
    cdef int32_t *wpv = <int32_t *>pci8_data(wps)
    cdef int npairs = -1
    for c in range(C):
        npairs = pci8_dw_pairs(wp + c * KK, H, W, KH, KW, SH, SW, PH, PW, offv, wpv + c * PCI8_DW_MAXPAIRS)
    cdef _Step st = _new_step(_K_DW, fn, [xq, wq, scale, zb32, zb64, y, yq, offs, wps])
    st.in_n, st.out_n = planes * HW, planes * PQ
    cdef _DwRun *r = &st.dw
    r.xp, r.wp, r.sv, r.z32, r.z64, r.yp, r.rq, r.offv, r.wpv = xp, wp, sv, z32, z64, yp, rq, offv, wpv
    r.work = work
    r.HW, r.PQ, r.KK, r.scratch_n, r.planes, r.chunk = HW, PQ, KK, scratch_n, planes, chunk
    r.C, r.H, r.W, r.KH, r.KW, r.SH, r.SW, r.PH, r.PW, r.P, r.Q = C, H, W, KH, KW, SH, SW, PH, PW, P, Q
    r.z, r.relu, r.wide, r.team, r.npairs = z, relu_, wide_, team, npairs
    return _done(st, step)


cdef int _dw_run(void *p) noexcept nogil:
    """depthwise_forward's per-plane work on a checked call; 1 where scratch could not be allocated."""
    cdef _DwRun *r = <_DwRun *>p
    pc_work(r.work)
    cdef int16_t *scratch = NULL
    cdef float *ybuf = NULL
    cdef float *dst = NULL
    cdef Py_ssize_t i, c, PQ = r.PQ
    cdef float *yp = r.yp
    cdef _Requant rq = r.rq
    cdef int failed[1]
    failed[0] = 0
    with parallel(num_threads=pc_cap(r.team)):
        scratch = <int16_t *>malloc(sizeof(int16_t) * r.scratch_n + 64)
        ybuf = <float *>malloc(sizeof(float) * PQ + 64) if yp == NULL else NULL
        for i in prange(r.planes, schedule="dynamic", chunksize=r.chunk):
            if scratch == NULL or (yp == NULL and ybuf == NULL):
                failed[0] = 1
                continue
            c = i % r.C
            dst = yp + i * PQ if yp != NULL else ybuf
            pci8_dw_plane(r.xp + i * r.HW, r.H, r.W, r.z, r.wp + c * r.KK, r.KH, r.KW, r.SH, r.SW, r.PH, r.PW, r.P,
                          r.Q, r.z32[c], r.z64[c], r.wide, r.sv[c], r.relu, scratch, dst, 1 if yp != NULL else 0,
                          rq.p + i * PQ if rq.p != NULL else NULL, rq.scale, rq.zero_point, r.offv,
                          r.wpv + c * PCI8_DW_MAXPAIRS, r.npairs)
        free(scratch)
        free(ybuf)
    return failed[0]


cdef bint _dw_blocks_pay(int C, int H, int W, int KH, int KW, int SH, int SW, int P, int Q):
    """Whether the channel blocks beat the per-plane kernel for this shape (measured): a full block of channels,
    and output rows up to 48 wide or strided (on long stride-1 rows the plane kernel's 64-wide runs are full)."""
    return (PCI8_DWB_FAST and C >= PCI8_DWB and KH * KW <= PCI8_DWB_TAPS
            and (Q <= 48 or SH > 1 or SW > 1))


cdef _Step _depthwise_blocks(object xq, int z, object wq, int SH, int SW, int PH, int PW, int P, int Q,
                             object scale, object zb32, object zb64, object wide, bint finite, object y,
                             object relu, int nt, object yq, object yq_scale, object yq_zero_point, double work):
    """depthwise_forward's call (arguments checked there) over blocks of PCI8_DWB channels of one image each."""
    cdef int N = xq.shape[0], C = xq.shape[1], H = xq.shape[2], W = xq.shape[3]
    cdef int KH = wq.shape[2], KW = wq.shape[3]
    cdef Py_ssize_t KK = <Py_ssize_t>KH * KW, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int CB = (C + PCI8_DWB - 1) // PCI8_DWB
    # per block: each tap's weights on the lanes, and the epilogue's per-channel values (zero past C), in one
    # buffer: [CB][KK][16] int16 weights, then [CB * 16] int64, int32 and float32
    cdef Py_ssize_t lanes = <Py_ssize_t>CB * PCI8_DWB, wbytes = (lanes * KK * 2 + 7) // 8 * 8
    lanebuf = np.zeros(wbytes + lanes * (8 + 4 + 4), dtype=np.uint8)
    cdef uint8_t *lb = <uint8_t *>pci8_data(lanebuf)
    cdef int16_t *wtp = <int16_t *>lb
    cdef int64_t *z64p = <int64_t *>(lb + wbytes)
    cdef int32_t *z32p = <int32_t *>(lb + wbytes + lanes * 8)
    cdef float *scp = <float *>(lb + wbytes + lanes * 12)
    cdef const int8_t *wsrc = <const int8_t *>pci8_data(wq)
    cdef const int32_t *zs32 = <const int32_t *>pci8_data(zb32)
    cdef const int64_t *zs64 = <const int64_t *>pci8_data(zb64)
    cdef const float *ss = <const float *>pci8_data(scale)
    cdef Py_ssize_t c, k
    for c in range(C):
        for k in range(KK):
            wtp[((c // PCI8_DWB) * KK + k) * PCI8_DWB + c % PCI8_DWB] = wsrc[c * KK + k]
        z64p[c] = zs64[c]
        z32p[c] = zs32[c]
        scp[c] = ss[c]
    cdef Py_ssize_t jobs = <Py_ssize_t>N * CB
    cdef _Step st = _new_step(_K_DWB, "depthwise_forward", [xq, lanebuf, y, yq])
    st.in_n, st.out_n = <Py_ssize_t>N * C * HW, <Py_ssize_t>N * C * PQ
    cdef _DwbRun *r = &st.dwb
    r.xp = <const uint8_t *>pci8_data(xq)
    r.wtp, r.z32p, r.z64p, r.scp = wtp, z32p, z64p, scp
    r.yp = <float *>pci8_data(y) if y is not None else NULL
    r.rq = _requant_target(yq, yq_scale, yq_zero_point)
    r.work = work
    r.HW, r.PQ, r.KK, r.scratch_n, r.jobs = HW, PQ, KK, pci8_dwb_scratch(H, W, PH, PW, P, Q), jobs
    r.C, r.CB, r.H, r.W, r.KH, r.KW, r.SH, r.SW, r.PH, r.PW, r.P, r.Q = C, CB, H, W, KH, KW, SH, SW, PH, PW, P, Q
    # (the VNNI loop's epilogue takes finite scales only; the others quantize NaN to the zero point)
    r.z, r.relu, r.wide, r.path = z, 1 if relu else 0, 1 if wide else 0, _path if finite else PCI8_PORTABLE
    r.team = pc_team(jobs, pc_threads_for(<Py_ssize_t>N * C * PQ * KK, jobs, nt))
    return st


cdef int _dwb_run(void *p) noexcept nogil:
    """The channel blocks' work on a checked call; 1 where scratch could not be allocated."""
    cdef _DwbRun *r = <_DwbRun *>p
    pc_work(r.work)
    cdef void *scratch = NULL
    cdef Py_ssize_t i, n, b
    cdef int nc, CB = r.CB, C = r.C
    cdef Py_ssize_t KK = r.KK, PQ = r.PQ, HW = r.HW
    cdef float *yp = r.yp
    cdef _Requant rq = r.rq
    cdef int failed[1]
    failed[0] = 0
    with parallel(num_threads=pc_cap(r.team)):
        scratch = malloc(r.scratch_n + 64)
        for i in prange(r.jobs, schedule="dynamic"):
            if scratch == NULL:
                failed[0] = 1
                continue
            n = i // CB
            b = i - n * CB
            nc = C - <int>b * PCI8_DWB if C - <int>b * PCI8_DWB < PCI8_DWB else PCI8_DWB
            pci8_dwb_block(r.xp + (n * C + b * PCI8_DWB) * HW, nc, r.H, r.W, r.z, r.wtp + b * KK * PCI8_DWB, r.KH,
                           r.KW, r.SH, r.SW, r.PH, r.PW, r.P, r.Q, r.z32p + b * PCI8_DWB, r.z64p + b * PCI8_DWB,
                           r.wide, r.scp + b * PCI8_DWB, r.relu, scratch,
                           yp + (n * C + b * PCI8_DWB) * PQ if yp != NULL else NULL,
                           rq.p + (n * C + b * PCI8_DWB) * PQ if rq.p != NULL else NULL, rq.scale, rq.zero_point,
                           r.path)
        free(scratch)
    return failed[0]


# ----------------------------------------------------------------------- linear

def linear_forward(xq,            # IN  uint8 (N, F)
                   x_zero_point,  # int in 0..255
                   packed,        # IN  pack_weights(wq (G, F))[0]
                   row_sums,      # IN  int32 (G,)
                   scale,         # IN  float32 (G,)
                   bias_q,        # IN  int32 (G,) or None
                   y,             # OUT float32 (N, G), overwritten; or None with yq
                   relu,
                   num_threads,
                   yq=None,       # OUT uint8 (N, G) or None: y quantized for the next layer
                   yq_scale=1.0, yq_zero_point=0,
                   step=False):   # as conv2d_forward's
    """Quantized linear layer ``y = dequant(xq @ wq.T + bias_q)``; see the module docstring.

    ``yq``, ``yq_scale``, ``yq_zero_point`` as in :func:`conv2d_forward`.
    """
    fn = "linear_forward"
    xq = _array(xq, fn, "xq", np.uint8, 2, "uint8 (N, F)")
    cdef int z = _zero_point(x_zero_point, fn)
    cdef int nt = _threads(num_threads, fn)
    if y is None and yq is None:
        raise TypeError(f"{fn}: y must be a float32 (N, G) array (or None with a yq output), got None")
    out_ = _array(y if y is not None else yq, fn, "y" if y is not None else "yq",
                  np.float32 if y is not None else np.uint8, 2, "(N, G)")
    cdef Py_ssize_t N = xq.shape[0], F = xq.shape[1]
    cdef int G = out_.shape[1]
    cdef double work = max(pc_macs_ns(<double>N * F * G / INT8_MAC_GAIN), pc_elems_ns(<double>F * G / 4))  # or its weights' bytes
    pc_work(work)
    if F < 1:
        raise ValueError(f"{fn}: xq must have at least one feature, got shape {xq.shape}")
    packed = _packed(packed, row_sums, fn, G, F, f"F (xq.shape[1])")
    if y is not None:
        y = _out(y, fn, "y", np.float32, (N, G), "float32 (N, G)")
    if yq is not None:
        yq = _requant_args(yq, fn, (N, G), yq_scale, yq_zero_point)
        if y is None:
            y = np.empty((N, G), dtype=np.float32)  # quantized after the last block
    scale, zb32, zb64, wide, _ = _epilogue(fn, G, scale, bias_q, row_sums, z, F)
    if N == 0:
        return
    cdef int kg = _layout(packed, 1)
    cdef const int32_t *hdr = <const int32_t *>pci8_data(packed)
    cdef int O64 = hdr[H_O64], kg_cap = hdr[H_KG_CAP]
    cdef Py_ssize_t ldx = F
    xpad = None
    if F % 4:
        # whole 4-byte groups: the features padded with the zero point (their weights are zero; xq is copied in
        # at every run)
        xpad = np.full((N, kg * 4), z, dtype=np.uint8)
        ldx = kg * 4
    cdef uint8_t *pv = <uint8_t *>pci8_data(packed)
    cdef const float *sv = <const float *>pci8_data(scale)
    cdef const int32_t *z32 = <const int32_t *>pci8_data(zb32)
    cdef const int64_t *z64 = <const int64_t *>pci8_data(zb64)
    cdef Py_ssize_t p8 = HEADER + (<Py_ssize_t>G * F + 63) // 64 * 64
    cdef const int8_t *w8 = <const int8_t *>&pv[p8]
    cdef const int16_t *w16 = <const int16_t *>&pv[p8 + <Py_ssize_t>O64 * kg_cap * 4]
    cdef int path_ = _path, relu_ = 1 if relu else 0, wide_ = 1 if wide else 0
    # blocks of rows x blocks of 64 output channels: the rows split finer until every thread has
    # PC_BLOCKS_PER_THREAD blocks (a block of 4 rows is the least)
    cdef Py_ssize_t cblocks = (G + PCI8_CB - 1) // PCI8_CB, rb = (N + PCI8_RB - 1) // PCI8_RB * PCI8_RB
    while rb > PCI8_RB and ((N + rb - 1) // rb) * cblocks < <Py_ssize_t>nt * PC_BLOCKS_PER_THREAD:
        rb = (rb // 2 + PCI8_RB - 1) // PCI8_RB * PCI8_RB
    cdef Py_ssize_t rblocks = (N + rb - 1) // rb, jobs = rblocks * cblocks
    cdef _Step st = _new_step(_K_LINEAR, fn, [xq, xpad, packed, scale, zb32, zb64, y, yq])
    st.in_n, st.out_n = N * F, N * G
    cdef _LinRun *r = &st.lin
    r.xsrc = <const uint8_t *>pci8_data(xq)
    r.xpad = <uint8_t *>pci8_data(xpad) if xpad is not None else NULL
    r.w8, r.w16, r.sv, r.z32, r.z64 = w8, w16, sv, z32, z64
    r.yp = <float *>pci8_data(y)
    r.rq = _requant_target(yq, yq_scale, yq_zero_point)
    r.work = work
    r.N, r.F, r.ldx, r.rb, r.rblocks, r.jobs = N, F, ldx, rb, rblocks, jobs
    r.G, r.kg, r.path, r.relu, r.wide, r.nt = G, kg, path_, relu_, wide_, nt
    r.team = pc_team(jobs, pc_threads_for(N * G * F // WORK_PER_MAC, jobs, nt))
    return _done(st, step)


cdef int _lin_run(void *p) noexcept nogil:
    """linear_forward's work on a checked call; 1 where scratch could not be allocated."""
    cdef _LinRun *r = <_LinRun *>p
    pc_work(r.work)
    cdef const uint8_t *xp = r.xsrc
    cdef Py_ssize_t i, ri, ci, r1, N = r.N, G = r.G, rb = r.rb, rblocks = r.rblocks
    if r.xpad != NULL:
        for i in range(N):
            memcpy(r.xpad + i * r.ldx, r.xsrc + i * r.F, <size_t>r.F)
        xp = r.xpad
    cdef int32_t *acc = NULL
    cdef int failed[1]
    failed[0] = 0
    with parallel(num_threads=pc_cap(r.team)):
        acc = <int32_t *>malloc(sizeof(int32_t) * PCI8_RB * PCI8_CB + 64)
        for i in prange(r.jobs, schedule="dynamic"):
            if acc == NULL:
                failed[0] = 1
                continue
            ci = i // rblocks
            ri = i - ci * rblocks
            r1 = (ri + 1) * rb if (ri + 1) * rb < N else N
            pci8_linear_block(r.path, xp, r.ldx, ri * rb, r1, r.kg, r.w8, r.w16, <int>(ci * PCI8_CB),
                              <int>((ci + 1) * PCI8_CB if (ci + 1) * PCI8_CB < G else G), <int>G, r.z32, r.z64,
                              r.wide, r.sv, r.relu, r.yp, acc)
        free(acc)
    if r.rq.p != NULL and not failed[0]:
        _quantize_team(r.yp, N * G, r.rq.scale, r.rq.zero_point, r.rq.p, r.nt)
    return failed[0]


# ------------------------------------------------------------------ max pooling

def maxpool2d_u8(xq,          # IN  uint8 (N, C, H, W)
                 kernel_size,  # (KH, KW)
                 stride,       # (SH, SW)
                 padding,      # (PH, PW), at most half the kernel
                 y,            # OUT uint8 (N, C, P, Q), overwritten
                 num_threads,
                 step=False):  # as conv2d_forward's
    """Max pooling of uint8 activations (floor mode; padding never selected).

    Quantization is monotone, so pooling the uint8 input of the next layer gives the same bits as
    pooling float32 and quantizing after: chained int8 layers stay in uint8 through a max pool.
    P = (H + 2 PH - KH) // SH + 1, Q = (W + 2 PW - KW) // SW + 1.
    """
    fn = "maxpool2d_u8"
    xq = _array(xq, fn, "xq", np.uint8, 4, "uint8 (N, C, H, W)")
    cdef int nt = _threads(num_threads, fn)
    if not (isinstance(kernel_size, tuple) and isinstance(stride, tuple) and isinstance(padding, tuple)
            and len(kernel_size) == len(stride) == len(padding) == 2):
        raise TypeError(f"{fn}: kernel_size, stride and padding must be (h, w) tuples of ints, got "
                        f"{kernel_size!r}, {stride!r}, {padding!r}")
    cdef int KH = _positive(kernel_size[0], fn, "kernel_size[0]", 1), KW = _positive(kernel_size[1], fn,
                                                                                    "kernel_size[1]", 1)
    cdef int SH = _positive(stride[0], fn, "stride[0]", 1), SW = _positive(stride[1], fn, "stride[1]", 1)
    cdef int PH = _positive(padding[0], fn, "padding[0]", 0), PW = _positive(padding[1], fn, "padding[1]", 0)
    if PH > KH // 2 or PW > KW // 2:
        raise ValueError(f"{fn}: padding {(PH, PW)} must be at most half the kernel size {(KH, KW)}")
    cdef int N = xq.shape[0], C = xq.shape[1], H = xq.shape[2], W = xq.shape[3]
    if H + 2 * PH < KH or W + 2 * PW < KW:
        raise ValueError(f"{fn}: kernel ({KH}, {KW}) is larger than the padded input ({H + 2 * PH}, {W + 2 * PW})")
    cdef int P = (H + 2 * PH - KH) // SH + 1, Q = (W + 2 * PW - KW) // SW + 1
    y = _out(y, fn, "y", np.uint8, (N, C, P, Q), "uint8 (N, C, P, Q)")
    cdef Py_ssize_t planes = <Py_ssize_t>N * C, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    if planes == 0 or PQ == 0:
        return
    # a byte per output tap: below ~1M of them one thread finishes before a woken team would
    cdef int team = pc_team(planes, pc_threads_for(planes * PQ * KH * KW // 8, planes, nt))
    cdef double work = pc_elems_ns(<double>planes * PQ * KH * KW / 8)
    pc_work(work)
    cdef _Step st = _new_step(_K_POOL, fn, [xq, y])
    st.in_n, st.out_n = planes * HW, planes * PQ
    cdef _PoolRun *r = &st.pool
    r.xp = <const uint8_t *>pci8_data(xq)
    r.yp = <uint8_t *>pci8_data(y)
    r.work = work
    r.HW, r.PQ, r.planes = HW, PQ, planes
    r.chunk = max(1, planes // (<Py_ssize_t>team * PC_BLOCKS_PER_THREAD * 4))
    r.H, r.W, r.KH, r.KW, r.SH, r.SW, r.PH, r.PW, r.P, r.Q, r.team = H, W, KH, KW, SH, SW, PH, PW, P, Q, team
    return _done(st, step)


cdef int _pool_run(void *p) noexcept nogil:
    cdef _PoolRun *r = <_PoolRun *>p
    pc_work(r.work)
    cdef Py_ssize_t i
    for i in prange(r.planes, schedule="dynamic", chunksize=r.chunk, num_threads=pc_cap(r.team)):
        pci8_maxpool_plane(r.xp + i * r.HW, r.H, r.W, r.KH, r.KW, r.SH, r.SW, r.PH, r.PW, r.P, r.Q, r.yp + i * r.PQ)
    return 0


include "_team.pxi"

