# Shape legend: optimizer updates are elementwise over a parameter taken flat:
# p (parameter), g (gradient), v / m (state) all (n,) float32, updated in place.
"""SGD and Adam updates, in place, in PyTorch's formulation.

Scalars are rounded to float32 once, here, exactly as NumPy rounds a Python
float meeting a float32 array, and the loops (pc_common.h) evaluate the same
float32 expressions in the same order as the NumPy reference, so a step
matches it bit for bit.
"""

import math

from cython.parallel cimport prange

cdef extern from "pc_common.h":
    void pc_sgd(float *p, const float *g, float *v, Py_ssize_t n, float lr, float momentum,
                float weight_decay, int use_wd, int nesterov) noexcept nogil
    void pc_adam(float *p, const float *g, float *m, float *v, Py_ssize_t n, float beta1, float omb1,
                 float beta2, float omb2, float step_size, float sqrt_bc2, float eps,
                 float weight_decay, int use_wd) noexcept nogil

cdef enum:
    SERIAL_BELOW = 32768  # elements


cdef inline int _chunks(Py_ssize_t n, int num_threads) noexcept nogil:
    if n < SERIAL_BELOW or num_threads <= 1:
        return 1
    if num_threads > n // (SERIAL_BELOW // 2):
        return <int>max(1, n // (SERIAL_BELOW // 2))
    return num_threads


def sgd_update(float[::1] p,        # IN/OUT (n,) parameter
               const float[::1] g,  # IN     (n,) gradient
               float[::1] v,        # IN/OUT (n,) momentum buffer, or None when momentum == 0
               double lr, double momentum, double weight_decay, bint nesterov, int num_threads):
    """``g' = g + wd p``; ``v = momentum v + g'``; ``p -= lr (g' + momentum v if nesterov else v)``."""
    cdef Py_ssize_t n = p.shape[0], i, a, b
    cdef int nc = _chunks(n, num_threads)
    cdef float *vp = NULL
    cdef float lr32 = <float>lr, mom32 = <float>momentum, wd32 = <float>weight_decay
    cdef int use_wd = weight_decay != 0.0
    if v is not None:
        vp = &v[0]
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_sgd(&p[a], &g[a], vp + a if vp != NULL else NULL, b - a, lr32, mom32, wd32, use_wd, nesterov)


def adam_update(float[::1] p,        # IN/OUT (n,) parameter
                const float[::1] g,  # IN     (n,) gradient
                float[::1] m,        # IN/OUT (n,) first moment
                float[::1] v,        # IN/OUT (n,) second moment
                double lr, double beta1, double beta2, double eps, double weight_decay, long step,
                int num_threads):
    """Adam step ``step`` (counted from 1), bias-corrected like PyTorch."""
    cdef Py_ssize_t n = p.shape[0], i, a, b
    cdef int nc = _chunks(n, num_threads)
    bc1 = 1 - float(beta1) ** step
    bc2 = 1 - float(beta2) ** step
    cdef float b1 = <float>beta1, omb1 = <float>(1 - beta1)
    cdef float b2 = <float>beta2, omb2 = <float>(1 - beta2)
    cdef float step_size = <float>(lr / bc1)
    cdef float sqrt_bc2 = <float>math.sqrt(bc2)
    cdef float eps32 = <float>eps, wd32 = <float>weight_decay
    cdef int use_wd = weight_decay != 0.0
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            a = n * i // nc
            b = n * (i + 1) // nc
            pc_adam(&p[a], &g[a], &m[a], &v[a], b - a, b1, omb1, b2, omb2, step_size, sqrt_bc2,
                    eps32, wd32, use_wd)
