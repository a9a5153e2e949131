# Shape legend: activations are elementwise, so every array is taken flat:
# n = N * (everything else) elements, x, y, dy, dx all (n,).
"""relu and sigmoid kernels, forward and backward (backward from the forward output y).

The loops themselves are the vectorised C helpers in pc_common.h; here the
flat range is cut into one contiguous chunk per thread. Below SERIAL_BELOW
elements the whole range runs on the calling thread: waking a team costs more
than the loop.
"""

from cython.parallel cimport prange

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
