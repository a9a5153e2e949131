# Shape legend: activations are elementwise, so every array is taken flat:
# n = N * (everything else) elements, x, y, dy, dx all (n,).
"""Elementwise activation kernels, forward and backward: relu, sigmoid, leaky_relu, tanh, elu,
and softmax (along the middle axis of an (O, D, I) view: any dim); plus ``add`` (the residual sum).

Backward passes take the forward output y where the derivative is a function of it
(relu, sigmoid, tanh, elu, softmax) and the input x where it is not (leaky_relu).

The loops themselves are the vectorised C helpers in pc_common.h; here the
flat range is cut into a few contiguous chunks per thread, handed out as
threads come free. Below SERIAL_BELOW elements the whole range runs on the
calling thread: waking a team costs more than the loop.
"""

from cython.parallel cimport prange
from libc.math cimport expm1f

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_sum_lanes, pc_team, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)

cdef extern from "pc_common.h":
    void pc_relu_fwd(const float *x, float *y, Py_ssize_t n) noexcept nogil
    void pc_relu_bwd(const float *y, const float *dy, float *dx, Py_ssize_t n) noexcept nogil
    void pc_sigmoid_fwd(const float *x, float *y, Py_ssize_t n) noexcept nogil
    void pc_sigmoid_bwd(const float *y, const float *dy, float *dx, Py_ssize_t n) noexcept nogil

cdef enum:
    SERIAL_BELOW = 32768          # elements, for the cheap ops
    SERIAL_BELOW_EXP = 16384      # elements, for sigmoid (a vectorised exp each)
    EXP_ELEMS = 4                 # an exp costs about this many elements of a cheap pass (pc_work)


cdef inline int _chunks(Py_ssize_t n, Py_ssize_t serial_below, int num_threads) noexcept nogil:
    """Number of contiguous chunks for n elements: a few per thread (handed out dynamically), each
    at least serial_below / 2 elements."""
    cdef Py_ssize_t cap = n // (serial_below // 2), want = <Py_ssize_t>num_threads * PC_BLOCKS_PER_THREAD
    if n < serial_below or num_threads <= 1:
        return 1
    return <int>max(1, min(want, cap))


def relu_forward(const float[::1] x,  # IN  (n,)
                 float[::1] y,        # OUT (n,), overwritten
                 int num_threads):
    """``y = max(x, 0)``."""
    cdef Py_ssize_t n = x.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_relu_fwd(&x[a], &y[a], b - a)


def relu_backward(const float[::1] y,   # IN  (n,) forward output
                  const float[::1] dy,  # IN  (n,)
                  float[::1] dx,        # OUT (n,), overwritten
                  int num_threads):
    """``dx = dy * (y > 0)``."""
    cdef Py_ssize_t n = y.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_relu_bwd(&y[a], &dy[a], &dx[a], b - a)


def sigmoid_forward(const float[::1] x,  # IN  (n,)
                    float[::1] y,        # OUT (n,), overwritten
                    int num_threads):
    """``y = 1 / (1 + exp(-x))`` without overflow for large ``|x|``."""
    cdef Py_ssize_t n = x.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW_EXP, num_threads)
    pc_work(pc_elems_ns(<double>n * EXP_ELEMS))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_sigmoid_fwd(&x[a], &y[a], b - a)


def sigmoid_backward(const float[::1] y,   # IN  (n,) forward output
                     const float[::1] dy,  # IN  (n,)
                     float[::1] dx,        # OUT (n,), overwritten
                     int num_threads):
    """``dx = dy * y * (1 - y)``."""
    cdef Py_ssize_t n = y.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_sigmoid_bwd(&y[a], &dy[a], &dx[a], b - a)


# ----------------------------------------------------------------------------------
# leaky_relu, tanh, add (flat, n elements) and softmax: x viewed as (O, D, I), the
# softmax running along D for each of the O * I lines (stride I between its elements).
# ----------------------------------------------------------------------------------
from libc.math cimport copysignf, fabsf


def leaky_relu_forward(const float[::1] x,  # IN  (n,)
                       float[::1] y,        # OUT (n,), overwritten
                       float negative_slope, int num_threads):
    """``y = x if x > 0 else negative_slope * x`` (NaN propagates)."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    cdef float v
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                v = x[k]
                y[k] = v if v > 0 else v * negative_slope


def leaky_relu_backward(const float[::1] x,   # IN  (n,) forward input
                        const float[::1] dy,  # IN  (n,)
                        float[::1] dx,        # OUT (n,), overwritten
                        float negative_slope, int num_threads):
    """``dx = dy if x > 0 else negative_slope * dy``."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] if x[k] > 0 else dy[k] * negative_slope


cdef extern from "pc_common.h":
    float pc_exp_nonpos(float t) noexcept nogil


cdef inline float _tanh(float v) noexcept nogil:
    """tanh in a form that vectorises (libm's tanhf is a call per element and keeps the loop scalar):
    Cephes' odd polynomial below |v| = 0.625, (1 - e) / (1 + e) with e = exp(-2|v|) above (no
    cancellation there); within 3 ulp. NaN propagates, +-inf gives +-1."""
    cdef float a = fabsf(v), z = a * a, e, r, p
    p = ((((<float>-5.70498872745e-3 * z + <float>2.06390887954e-2) * z - <float>5.37397155531e-2) * z
          + <float>1.33314422036e-1) * z - <float>3.33332819422e-1) * z * a + a
    e = pc_exp_nonpos(<float>-2.0 * a)
    r = (<float>1.0 - e) / (<float>1.0 + e)
    return copysignf(p if a < <float>0.625 else r, v)


def tanh_forward(const float[::1] x,  # IN  (n,)
                 float[::1] y,        # OUT (n,), overwritten
                 int num_threads):
    """``y = tanh(x)``."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW_EXP, num_threads)
    pc_work(pc_elems_ns(<double>n * EXP_ELEMS))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                y[k] = _tanh(x[k])


def tanh_backward(const float[::1] y,   # IN  (n,) forward output
                  const float[::1] dy,  # IN  (n,)
                  float[::1] dx,        # OUT (n,), overwritten
                  int num_threads):
    """``dx = dy * (1 - y * y)``."""
    cdef Py_ssize_t n = y.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] * (<float>1.0 - y[k] * y[k])


def elu_forward(const float[::1] x,  # IN  (n,)
                float[::1] y,        # OUT (n,), overwritten
                float alpha,
                int num_threads):
    """``y = x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW_EXP, num_threads)
    pc_work(pc_elems_ns(<double>n * EXP_ELEMS))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                y[k] = x[k] if x[k] > 0 else alpha * expm1f(x[k])


def elu_backward(const float[::1] y,   # IN  (n,) forward output
                 const float[::1] dy,  # IN  (n,)
                 float[::1] dx,        # OUT (n,), overwritten
                 float alpha,
                 int num_threads):
    """``dx = dy`` where ``y > 0``, else ``dy * (y + alpha)`` (the derivative from the output)."""
    cdef Py_ssize_t n = y.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] if y[k] > 0 else dy[k] * (y[k] + alpha)


def add(const float[::1] a,  # IN  (n,)
        const float[::1] b,  # IN  (n,)
        float[::1] out,      # OUT (n,), overwritten
        int num_threads):
    """``out = a + b``."""
    pc_work(pc_elems_ns(<double>a.shape[0]))
    _add(a, b, out, False, num_threads)


def add_relu(const float[::1] a,  # IN  (n,)
             const float[::1] b,  # IN  (n,)
             float[::1] out,      # OUT (n,), overwritten
             int num_threads):
    """``out = max(a + b, 0)`` in one pass, NaN passing: the bits of ``add`` then ``relu_forward``."""
    pc_work(pc_elems_ns(<double>a.shape[0]))
    _add(a, b, out, True, num_threads)


cdef void _add(const float[::1] a, const float[::1] b, float[::1] out, bint relu, int num_threads):
    cdef Py_ssize_t n = a.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    cdef float v
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for k in range(n * i // nc, n * (i + 1) // nc):
                v = a[k] + b[k]
                out[k] = (<float>0.0 if v < 0 else v) if relu else v


cdef inline void _softmax_row(const float *x, float *y, Py_ssize_t D) noexcept nogil:
    """Softmax of D contiguous values: the exp, the sum and the division in separate loops, so
    the first and the last vectorise (pc_exp_nonpos instead of libm's expf; below -87.3, where
    it stops following exp, the result is 0 as exp's would round to)."""
    cdef Py_ssize_t d
    cdef float m = x[0], t, e
    for d in range(1, D):
        if x[d] > m:
            m = x[d]
    for d in range(D):
        t = x[d] - m
        e = pc_exp_nonpos(t)
        y[d] = e if t >= <float>-87.3 else <float>0.0
    e = <float>pc_sum_lanes(y, D)
    for d in range(D):
        y[d] = y[d] / e


cdef enum:
    SOFTMAX_COLS = 256  # columns of an (O, D, I) block taken at once when the softmax runs along D


cdef void _softmax_cols(const float *x, float *y, Py_ssize_t D, Py_ssize_t I, Py_ssize_t w) noexcept nogil:
    """Softmax along D of w adjacent columns (x[d * I + k], k < w) of a (D, I) block: every loop
    runs along the contiguous columns, so each vectorises; the column sums in double."""
    cdef float m[SOFTMAX_COLS]
    cdef double total[SOFTMAX_COLS]
    cdef const float *row
    cdef float *out
    cdef float t, e
    cdef Py_ssize_t d, k
    for k in range(w):
        m[k] = x[k]
        total[k] = 0.0
    for d in range(1, D):
        row = x + d * I
        for k in range(w):
            m[k] = row[k] if row[k] > m[k] else m[k]
    for d in range(D):
        row = x + d * I
        out = y + d * I
        for k in range(w):
            t = row[k] - m[k]
            e = pc_exp_nonpos(t)
            e = e if t >= <float>-87.3 else <float>0.0
            out[k] = e
            total[k] += e
    for k in range(w):
        m[k] = <float>total[k]
    for d in range(D):
        out = y + d * I
        for k in range(w):
            out[k] = out[k] / m[k]


cdef void _softmax_bwd_row(const float *y, const float *dy, float *dx, Py_ssize_t D) noexcept nogil:
    """dx = y * (dy - sum(dy * y)) along D contiguous values; the sum in double, two chains."""
    cdef Py_ssize_t d = 0
    cdef double t0 = 0.0, t1 = 0.0
    cdef float dot
    while d + 2 <= D:
        t0 += dy[d] * y[d]
        t1 += dy[d + 1] * y[d + 1]
        d += 2
    if d < D:
        t0 += dy[d] * y[d]
    dot = <float>(t0 + t1)
    for d in range(D):
        dx[d] = y[d] * (dy[d] - dot)


cdef void _softmax_bwd_cols(const float *y, const float *dy, float *dx, Py_ssize_t D, Py_ssize_t I,
                            Py_ssize_t w) noexcept nogil:
    """The backward of _softmax_cols over w adjacent columns."""
    cdef double total[SOFTMAX_COLS]
    cdef float dot[SOFTMAX_COLS]
    cdef Py_ssize_t d, k
    for k in range(w):
        total[k] = 0.0
    for d in range(D):
        for k in range(w):
            total[k] += dy[d * I + k] * y[d * I + k]
    for k in range(w):
        dot[k] = <float>total[k]
    for d in range(D):
        for k in range(w):
            dx[d * I + k] = y[d * I + k] * (dy[d * I + k] - dot[k])


def softmax_forward(const float[:, :, ::1] x,  # IN  (O, D, I)
                    float[:, :, ::1] y,        # OUT (O, D, I), overwritten
                    int num_threads):
    """Softmax along axis 1. The work units are the O rows when I == 1, else the (D, SOFTMAX_COLS)
    column tiles of each of the O blocks; contiguous ranges of units, a few per thread."""
    cdef Py_ssize_t O = x.shape[0], D = x.shape[1], I = x.shape[2], u, i, o, i0
    cdef Py_ssize_t tiles = (I + SOFTMAX_COLS - 1) // SOFTMAX_COLS, units = O * tiles
    cdef int nc = _chunks(O * D * I, SERIAL_BELOW_EXP, num_threads)
    pc_work(pc_elems_ns(<double>O * D * I * EXP_ELEMS))
    cdef const float *xp = &x[0, 0, 0]
    cdef float *yp = &y[0, 0, 0]
    if nc > units:
        nc = <int>units
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for u in range(units * i // nc, units * (i + 1) // nc):
                o = u // tiles
                i0 = (u - o * tiles) * SOFTMAX_COLS
                if I == 1:
                    _softmax_row(xp + o * D, yp + o * D, D)
                else:
                    _softmax_cols(xp + o * D * I + i0, yp + o * D * I + i0, D, I, min(SOFTMAX_COLS, I - i0))


def softmax_backward(const float[:, :, ::1] y,   # IN  (O, D, I) forward output
                     const float[:, :, ::1] dy,  # IN  (O, D, I)
                     float[:, :, ::1] dx,        # OUT (O, D, I), overwritten
                     int num_threads):
    """``dx = y * (dy - sum(dy * y, axis=1))``, over the work units of ``softmax_forward``."""
    cdef Py_ssize_t O = y.shape[0], D = y.shape[1], I = y.shape[2], u, i, o, i0, at
    cdef Py_ssize_t tiles = (I + SOFTMAX_COLS - 1) // SOFTMAX_COLS, units = O * tiles
    cdef int nc = _chunks(O * D * I, SERIAL_BELOW, num_threads)
    pc_work(pc_elems_ns(<double>O * D * I))
    cdef const float *yp = &y[0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0]
    cdef float *dxp = &dx[0, 0, 0]
    if nc > units:
        nc = <int>units
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            for u in range(units * i // nc, units * (i + 1) // nc):
                o = u // tiles
                i0 = (u - o * tiles) * SOFTMAX_COLS
                at = o * D * I + i0
                if I == 1:
                    _softmax_bwd_row(yp + at, dyp + at, dxp + at, D)
                else:
                    _softmax_bwd_cols(yp + at, dyp + at, dxp + at, D, I, min(SOFTMAX_COLS, I - i0))


include "_team.pxi"
