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
from libc.stdlib cimport malloc, free

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


def sgd_update_many(list ps,   # IN/OUT parameters, each (n_i,) float32
                    list gs,   # IN     their gradients, (n_i,) each
                    list vs,   # IN/OUT momentum buffers, (n_i,) each, or None when momentum == 0
                    double lr, double momentum, double weight_decay, bint nesterov, int num_threads):
    """:func:`sgd_update` on every parameter of the lists in one parallel loop: the elements of all
    of them, taken end to end, split evenly over the threads (elementwise, so the same bits)."""
    cdef Py_ssize_t k = len(ps), i, j, total = 0, a, b, lo, hi
    cdef float lr32 = <float>lr, mom32 = <float>momentum, wd32 = <float>weight_decay
    cdef int use_wd = weight_decay != 0.0
    cdef int nc
    cdef float[::1] mp
    cdef const float[::1] mg
    if len(gs) != k or (vs is not None and len(vs) != k):
        raise ValueError(f"sgd_update_many: got {k} parameters, {len(gs)} gradients and "
                         f"{'no' if vs is None else len(vs)} momentum buffers")
    if k == 0:
        return
    cdef float **pp = <float **>malloc(sizeof(float *) * k)
    cdef const float **gp = <const float **>malloc(sizeof(float *) * k)
    cdef float **vp = <float **>malloc(sizeof(float *) * k)
    cdef Py_ssize_t *start = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * (k + 1))
    try:
        if pp == NULL or gp == NULL or vp == NULL or start == NULL:
            raise MemoryError()
        for i in range(k):
            mp = ps[i]
            mg = gs[i]
            if mg.shape[0] != mp.shape[0]:
                raise ValueError(f"sgd_update_many: gradient {i} has {mg.shape[0]} elements, its parameter {mp.shape[0]}")
            start[i] = total
            total += mp.shape[0]
            pp[i] = &mp[0] if mp.shape[0] else NULL
            gp[i] = &mg[0] if mg.shape[0] else NULL
            vp[i] = NULL
            if vs is not None:
                mp = vs[i]
                if mp.shape[0] != mg.shape[0]:
                    raise ValueError(f"sgd_update_many: momentum buffer {i} has {mp.shape[0]} elements, "
                                     f"its parameter {mg.shape[0]}")
                vp[i] = &mp[0] if mp.shape[0] else NULL
        start[k] = total
        nc = _chunks(total, num_threads)
        with nogil:
            for i in prange(nc, schedule="static", num_threads=nc):
                a = total * i // nc
                b = total * (i + 1) // nc
                for j in range(k):
                    lo = max(a, start[j])
                    hi = min(b, start[j + 1])
                    if lo < hi:
                        pc_sgd(pp[j] + (lo - start[j]), gp[j] + (lo - start[j]),
                               vp[j] + (lo - start[j]) if vp[j] != NULL else NULL, hi - lo, lr32, mom32, wd32,
                               use_wd, nesterov)
    finally:
        free(pp)
        free(gp)
        free(vp)
        free(start)


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
