# Shape legend: activations are elementwise, so every array is taken flat:
# n = N * (everything else) elements, x, y, dy, dx all (n,).
"""relu and sigmoid kernels, forward and backward (backward from the forward output y).

The loops themselves are the vectorised C helpers in pc_common.h; here the
flat range is cut into one contiguous chunk per thread. Below SERIAL_BELOW
elements the whole range runs on the calling thread: waking a team costs more
than the loop.
"""

from cython.parallel cimport prange
from libc.math cimport expm1f

cdef extern from "pc_common.h":
    void pc_relu_fwd(const float *x, float *y, Py_ssize_t n) noexcept nogil
    void pc_relu_bwd(const float *y, const float *dy, float *dx, Py_ssize_t n) noexcept nogil
    void pc_sigmoid_fwd(const float *x, float *y, Py_ssize_t n) noexcept nogil
    void pc_sigmoid_bwd(const float *y, const float *dy, float *dx, Py_ssize_t n) noexcept nogil

cdef enum:
    SERIAL_BELOW = 32768          # elements, for the cheap ops
    SERIAL_BELOW_EXP = 16384      # elements, for sigmoid (a vectorised exp each)


cdef inline int _chunks(Py_ssize_t n, Py_ssize_t serial_below, int num_threads) noexcept nogil:
    """Number of contiguous chunks (= threads) for n elements."""
    if n < serial_below or num_threads <= 1:
        return 1
    if num_threads > n // (serial_below // 2):
        return <int>max(1, n // (serial_below // 2))
    return num_threads


def relu_forward(const float[::1] x,  # IN  (n,)
                 float[::1] y,        # OUT (n,), overwritten
                 int num_threads):
    """``y = max(x, 0)``."""
    cdef Py_ssize_t n = x.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
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
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_relu_bwd(&y[a], &dy[a], &dx[a], b - a)


def sigmoid_forward(const float[::1] x,  # IN  (n,)
                    float[::1] y,        # OUT (n,), overwritten
                    int num_threads):
    """``y = 1 / (1 + exp(-x))`` without overflow for large ``|x|``."""
    cdef Py_ssize_t n = x.shape[0], i, a, b
    cdef int nc = _chunks(n, SERIAL_BELOW_EXP, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
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
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_sigmoid_bwd(&y[a], &dy[a], &dx[a], b - a)


# ----------------------------------------------------------------------------------
# leaky_relu, tanh, add (flat, n elements) and softmax: x viewed as (O, D, I), the
# softmax running along D for each of the O * I lines (stride I between its elements).
# ----------------------------------------------------------------------------------
from libc.math cimport copysignf, expf, fabsf


def leaky_relu_forward(const float[::1] x,  # IN  (n,)
                       float[::1] y,        # OUT (n,), overwritten
                       float negative_slope, int num_threads):
    """``y = x if x > 0 else negative_slope * x`` (NaN propagates)."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    cdef float v
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
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
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] if x[k] > 0 else dy[k] * negative_slope


cdef extern from "pc_common.h":
    float pc_exp_nonpos(float t) noexcept nogil


cdef inline float _tanh(float v) noexcept nogil:
    """tanh in a form that vectorises (libm's tanhf is a call per element, about 50x slower here):
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
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                y[k] = _tanh(x[k])


def tanh_backward(const float[::1] y,   # IN  (n,) forward output
                  const float[::1] dy,  # IN  (n,)
                  float[::1] dx,        # OUT (n,), overwritten
                  int num_threads):
    """``dx = dy * (1 - y * y)``."""
    cdef Py_ssize_t n = y.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] * (<float>1.0 - y[k] * y[k])


def elu_forward(const float[::1] x,  # IN  (n,)
                float[::1] y,        # OUT (n,), overwritten
                float alpha,
                int num_threads):
    """``y = x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW_EXP, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
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
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                dx[k] = dy[k] if y[k] > 0 else dy[k] * (y[k] + alpha)


def add(const float[::1] a,  # IN  (n,)
        const float[::1] b,  # IN  (n,)
        float[::1] out,      # OUT (n,), overwritten
        int num_threads):
    """``out = a + b``."""
    cdef Py_ssize_t n = a.shape[0], i, k
    cdef int nc = _chunks(n, SERIAL_BELOW, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                out[k] = a[k] + b[k]


cdef inline double _sum_lanes(const float *v, Py_ssize_t n) noexcept nogil:
    """Sum of n contiguous floats in double, four lanes added in a fixed order."""
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    cdef Py_ssize_t d = 0
    while d + 4 <= n:
        s0 += v[d]
        s1 += v[d + 1]
        s2 += v[d + 2]
        s3 += v[d + 3]
        d += 4
    while d < n:
        s0 += v[d]
        d += 1
    return (s0 + s1) + (s2 + s3)


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
    e = <float>_sum_lanes(y, D)
    for d in range(D):
        y[d] = y[d] / e


cdef inline void _softmax_line(const float *x, float *y, Py_ssize_t D, Py_ssize_t s) noexcept nogil:
    """Stable softmax of the D values x[0], x[s], x[2 s], ...; the sum in double."""
    cdef Py_ssize_t d
    cdef float m = x[0], e
    cdef double total = 0.0
    if s == 1:
        _softmax_row(x, y, D)
        return
    for d in range(1, D):
        if x[d * s] > m:
            m = x[d * s]
    for d in range(D):
        e = expf(x[d * s] - m)
        y[d * s] = e
        total += e
    e = <float>total
    for d in range(D):
        y[d * s] = y[d * s] / e


cdef inline void _softmax_bwd_line(const float *y, const float *dy, float *dx, Py_ssize_t D,
                                   Py_ssize_t s) noexcept nogil:
    """dx = y * (dy - sum(dy * y)) along one line; the sum in double."""
    cdef Py_ssize_t d
    cdef double t0 = 0.0, t1 = 0.0, total
    cdef float dot
    if s == 1:  # two independent chains
        d = 0
        while d + 2 <= D:
            t0 += dy[d] * y[d]
            t1 += dy[d + 1] * y[d + 1]
            d += 2
        if d < D:
            t0 += dy[d] * y[d]
        total = t0 + t1
    else:
        total = 0.0
        for d in range(D):
            total += dy[d * s] * y[d * s]
    dot = <float>total
    for d in range(D):
        dx[d * s] = y[d * s] * (dy[d * s] - dot)


def softmax_forward(const float[:, :, ::1] x,  # IN  (O, D, I)
                    float[:, :, ::1] y,        # OUT (O, D, I), overwritten
                    int num_threads):
    """Softmax along axis 1 of each (O, D, I) line, one contiguous range of lines per thread."""
    cdef Py_ssize_t O = x.shape[0], D = x.shape[1], I = x.shape[2], lines = O * I, l, i
    cdef int nc = _chunks(lines * D, SERIAL_BELOW_EXP, num_threads)
    if nc > lines:
        nc = <int>lines
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for l in range(lines * i // nc, lines * (i + 1) // nc):
                _softmax_line(&x[l // I, 0, l % I], &y[l // I, 0, l % I], D, I)


def softmax_backward(const float[:, :, ::1] y,   # IN  (O, D, I) forward output
                     const float[:, :, ::1] dy,  # IN  (O, D, I)
                     float[:, :, ::1] dx,        # OUT (O, D, I), overwritten
                     int num_threads):
    """``dx = y * (dy - sum(dy * y, axis=1))``."""
    cdef Py_ssize_t O = y.shape[0], D = y.shape[1], I = y.shape[2], lines = O * I, l, i
    cdef int nc = _chunks(lines * D, SERIAL_BELOW, num_threads)
    if nc > lines:
        nc = <int>lines
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for l in range(lines * i // nc, lines * (i + 1) // nc):
                _softmax_bwd_line(&y[l // I, 0, l % I], &dy[l // I, 0, l % I], &dx[l // I, 0, l % I], D, I)
