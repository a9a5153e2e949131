# Shape legend: optimizer updates are elementwise over a parameter taken flat:
# p (parameter), g (gradient), v / m / sq / buf (state) all (n,) float32, updated in place.
"""SGD, Adam/AdamW and RMSprop updates, in place, in PyTorch's formulation, and gradient norms.

Scalars are rounded to float32 once, here, exactly as NumPy rounds a Python
float meeting a float32 array, and the loops (pc_common.h, pc_optim.h) evaluate the same
float32 expressions in the same order as the NumPy reference, so a step
matches it bit for bit.
"""

import math

from cython.parallel cimport prange

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_team, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_update_ns, pc_get_region_ns, pc_set_region_ns)
from libc.math cimport INFINITY, isnan, pow as c_pow
from libc.stdlib cimport malloc, free

cdef extern from "pc_common.h":
    void pc_sgd(float *p, const float *g, float *v, Py_ssize_t n, float lr, float momentum,
                float weight_decay, int use_wd, int nesterov) noexcept nogil

cdef enum:
    SERIAL_BELOW = 32768  # elements


cdef inline int _chunks(Py_ssize_t n, int num_threads) noexcept nogil:
    """Contiguous chunks of n elements: a few per thread (handed out dynamically), each at least
    SERIAL_BELOW / 2 elements."""
    if n < SERIAL_BELOW or num_threads <= 1:
        return 1
    return <int>max(1, min(<Py_ssize_t>num_threads * PC_BLOCKS_PER_THREAD, n // (SERIAL_BELOW // 2)))


def sgd_update(float[::1] p,        # IN/OUT (n,) parameter
               const float[::1] g,  # IN     (n,) gradient
               float[::1] v,        # IN/OUT (n,) momentum buffer, or None when momentum == 0
               double lr, double momentum, double weight_decay, bint nesterov, int num_threads):
    """``g' = g + wd p``; ``v = momentum v + g'``; ``p -= lr (g' + momentum v if nesterov else v)``."""
    cdef Py_ssize_t n = p.shape[0], i, a, b
    cdef int nc = _chunks(n, num_threads)
    pc_work(pc_update_ns(<double>n))
    cdef float *vp = NULL
    cdef float lr32 = <float>lr, mom32 = <float>momentum, wd32 = <float>weight_decay
    cdef int use_wd = weight_decay != 0.0
    if v is not None:
        vp = &v[0]
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
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
        pc_work(pc_update_ns(<double>total))
        with nogil:
            for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
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


# ------------------------------------------------- Adam/AdamW, RMSprop, norms
# Every function below runs one parallel loop over the elements of all the parameters taken
# end to end (as sgd_update_many): small parameters share threads with large ones.

cdef extern from "pc_optim.h":
    void pc_adam_step(float *p, const float *g, float *m, float *v, Py_ssize_t n, float beta1, float omb1,
                      float beta2, float omb2, float step_size, float sqrt_bc2, float eps, float weight_decay,
                      int use_wd, float decay, int use_decay) noexcept nogil
    void pc_rmsprop_step(float *p, const float *g, float *sq, float *buf, Py_ssize_t n, float lr, float alpha,
                         float oma, float eps, float weight_decay, int use_wd, float momentum) noexcept nogil
    double pc_sumsq(const float *g, Py_ssize_t n) noexcept nogil
    double pc_sumpow(const float *g, Py_ssize_t n, double ord) noexcept nogil
    double pc_absmax(const float *g, Py_ssize_t n, double best) noexcept nogil
    void pc_scale(float *x, Py_ssize_t n, float factor) noexcept nogil

cdef enum:
    NORM_BLOCK = 16384  # elements per partial of a norm: fixed, so the sum does not depend on the threads


cdef struct Flat:
    Py_ssize_t k           # arrays per list
    Py_ssize_t *start      # (k + 1,) offsets of each array in the concatenation
    float **a              # (k,) the written arrays (parameters)
    const float **g        # (k,) the read arrays (gradients)
    float **s1             # (k,) first state buffers, or NULLs
    float **s2             # (k,) second state buffers, or NULLs


cdef void _flat_free(Flat *f) noexcept:
    free(f.start)
    free(f.a)
    free(f.g)
    free(f.s1)
    free(f.s2)


cdef int _flat_init(Flat *f, str where, list ps, list gs, list s1, list s2, str s1_name, str s2_name) except -1:
    """Fill ``f`` with the data pointers of the lists, checking that every list has one array per
    parameter with the parameter's element count. Any list may be None but not both ``ps`` and
    ``gs``; without ``ps`` the sizes come from the (read-only) ``gs``."""
    cdef Py_ssize_t k = len(ps if ps is not None else gs), i, n
    cdef float[::1] mv
    cdef const float[::1] cmv
    f.k = k
    f.start = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * (k + 1))
    f.a = <float **>malloc(sizeof(float *) * (k + 1))
    f.g = <const float **>malloc(sizeof(float *) * (k + 1))
    f.s1 = <float **>malloc(sizeof(float *) * (k + 1))
    f.s2 = <float **>malloc(sizeof(float *) * (k + 1))
    if f.start == NULL or f.a == NULL or f.g == NULL or f.s1 == NULL or f.s2 == NULL:
        raise MemoryError()
    for name, lst in (("gradient", gs), (s1_name, s1), (s2_name, s2)):
        if lst is not None and len(lst) != k:
            raise ValueError(f"{where}: got {k} parameters and {len(lst)} {name}s")
    f.start[0] = 0
    for i in range(k):
        f.a[i] = NULL
        if ps is not None:
            mv = ps[i]
            n = mv.shape[0]
            f.a[i] = &mv[0] if n else NULL
        else:
            n = len(gs[i])
        f.start[i + 1] = f.start[i] + n
        f.g[i] = NULL
        f.s1[i] = NULL
        f.s2[i] = NULL
        if gs is not None:
            cmv = gs[i]
            if cmv.shape[0] != n:
                raise ValueError(f"{where}: gradient {i} has {cmv.shape[0]} elements, its parameter {n}")
            f.g[i] = &cmv[0] if n else NULL
        if s1 is not None:
            mv = s1[i]
            if mv.shape[0] != n:
                raise ValueError(f"{where}: {s1_name} {i} has {mv.shape[0]} elements, its parameter {n}")
            f.s1[i] = &mv[0] if n else NULL
        if s2 is not None:
            mv = s2[i]
            if mv.shape[0] != n:
                raise ValueError(f"{where}: {s2_name} {i} has {mv.shape[0]} elements, its parameter {n}")
            f.s2[i] = &mv[0] if n else NULL
    return 0


def adam_update_many(list ps,   # IN/OUT parameters, each (n_i,) float32
                     list gs,   # IN     their gradients, (n_i,) each
                     list ms,   # IN/OUT first moments, (n_i,) each
                     list vs,   # IN/OUT second moments, (n_i,) each
                     double lr, double beta1, double beta2, double eps, double weight_decay, bint decoupled,
                     long step, int num_threads):
    """Adam step ``step`` (counted from 1) of every parameter, bias-corrected like PyTorch.

    ``decoupled`` (AdamW): ``p *= 1 - lr * weight_decay`` before the step; otherwise (Adam)
    the gradient gets ``weight_decay * p`` added (L2).
    """
    cdef Flat f
    cdef Py_ssize_t total, i, j, a, b, lo, hi, o
    cdef int nc
    bc1 = 1 - float(beta1) ** step
    bc2 = 1 - float(beta2) ** step
    cdef float b1 = <float>beta1, omb1 = <float>(1 - beta1)
    cdef float b2 = <float>beta2, omb2 = <float>(1 - beta2)
    cdef float step_size = <float>(lr / bc1)
    cdef float sqrt_bc2 = <float>math.sqrt(bc2)
    cdef float eps32 = <float>eps, wd32 = <float>weight_decay
    cdef int use_wd = weight_decay != 0.0 and not decoupled
    cdef int use_decay = weight_decay != 0.0 and decoupled
    cdef float decay = <float>(1 - lr * weight_decay)
    f.start = NULL; f.a = NULL; f.g = NULL; f.s1 = NULL; f.s2 = NULL
    try:
        _flat_init(&f, "adam_update_many", ps, gs, ms, vs, "first moment", "second moment")
        total = f.start[f.k]
        nc = _chunks(total, num_threads)
        pc_work(pc_elems_ns(<double>total * 3))  # a square root and a division each
        with nogil:
            for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
                a = total * i // nc
                b = total * (i + 1) // nc
                for j in range(f.k):
                    lo = max(a, f.start[j])
                    hi = min(b, f.start[j + 1])
                    if lo < hi:
                        o = lo - f.start[j]
                        pc_adam_step(f.a[j] + o, f.g[j] + o, f.s1[j] + o, f.s2[j] + o, hi - lo, b1, omb1, b2,
                                     omb2, step_size, sqrt_bc2, eps32, wd32, use_wd, decay, use_decay)
    finally:
        _flat_free(&f)


def rmsprop_update_many(list ps,    # IN/OUT parameters, each (n_i,) float32
                        list gs,    # IN     their gradients, (n_i,) each
                        list sqs,   # IN/OUT running averages of the squared gradient, (n_i,) each
                        list bufs,  # IN/OUT momentum buffers, (n_i,) each, or None when momentum == 0
                        double lr, double alpha, double eps, double weight_decay, double momentum,
                        int num_threads):
    """RMSprop step (PyTorch's, ``centered=False``) of every parameter."""
    cdef Flat f
    cdef Py_ssize_t total, i, j, a, b, lo, hi, o
    cdef int nc
    cdef float lr32 = <float>lr, alpha32 = <float>alpha, oma = <float>(1 - alpha)
    cdef float eps32 = <float>eps, wd32 = <float>weight_decay, mom32 = <float>momentum
    cdef int use_wd = weight_decay != 0.0
    cdef bint with_buf = bufs is not None
    f.start = NULL; f.a = NULL; f.g = NULL; f.s1 = NULL; f.s2 = NULL
    try:
        _flat_init(&f, "rmsprop_update_many", ps, gs, sqs, bufs, "square average", "momentum buffer")
        total = f.start[f.k]
        nc = _chunks(total, num_threads)
        pc_work(pc_elems_ns(<double>total * 3))  # a square root and a division each
        with nogil:
            for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
                a = total * i // nc
                b = total * (i + 1) // nc
                for j in range(f.k):
                    lo = max(a, f.start[j])
                    hi = min(b, f.start[j + 1])
                    if lo < hi:
                        o = lo - f.start[j]
                        pc_rmsprop_step(f.a[j] + o, f.g[j] + o, f.s1[j] + o, f.s2[j] + o if with_buf else NULL,
                                        hi - lo, lr32, alpha32, oma, eps32, wd32, use_wd, mom32)
    finally:
        _flat_free(&f)


def norm_many(list xs,  # IN arrays, each (n_i,) float32
              double ord, int num_threads):
    """The ``ord``-norm of all the arrays taken as one vector (``ord`` > 0 or ``inf``), as a float.

    Partial sums in double over fixed blocks of NORM_BLOCK elements, added in block order: the
    result does not depend on the thread count.
    """
    cdef Flat f
    cdef Py_ssize_t total, nb, blk, j, a, b, lo, hi, o
    cdef double *part = NULL
    cdef double s, r
    cdef int mode = 0 if ord == 2.0 else (2 if ord == INFINITY else 1)
    f.start = NULL; f.a = NULL; f.g = NULL; f.s1 = NULL; f.s2 = NULL
    try:
        _flat_init(&f, "norm_many", None, xs, None, None, "", "")
        total = f.start[f.k]
        if total == 0:
            return 0.0
        nb = (total + NORM_BLOCK - 1) // NORM_BLOCK
        pc_work(pc_elems_ns(<double>total))
        part = <double *>malloc(sizeof(double) * nb)
        if part == NULL:
            raise MemoryError()
        with nogil:
            for blk in prange(nb, schedule="dynamic", num_threads=pc_cap(pc_team(nb, num_threads))):
                a = blk * NORM_BLOCK
                b = min(total, a + NORM_BLOCK)
                s = 0.0
                for j in range(f.k):
                    lo = max(a, f.start[j])
                    hi = min(b, f.start[j + 1])
                    if lo < hi:
                        o = lo - f.start[j]
                        if mode == 0:
                            s = s + pc_sumsq(f.g[j] + o, hi - lo)
                        elif mode == 1:
                            s = s + pc_sumpow(f.g[j] + o, hi - lo, ord)
                        else:
                            s = pc_absmax(f.g[j] + o, hi - lo, s)
                part[blk] = s
        r = 0.0
        for blk in range(nb):
            if mode == 2:
                if isnan(part[blk]) or part[blk] > r:
                    r = part[blk]
                    if isnan(r):
                        break
            else:
                r += part[blk]
        if mode == 0:
            return math.sqrt(r)
        if mode == 1:
            return c_pow(r, 1.0 / ord)
        return r
    finally:
        free(part)
        _flat_free(&f)


def scale_many(list xs,  # IN/OUT arrays, each (n_i,) float32
               double factor, int num_threads):
    """``x *= factor`` (rounded to float32 once) for every array."""
    cdef Flat f
    cdef Py_ssize_t total, i, j, a, b, lo, hi
    cdef int nc
    cdef float f32 = <float>factor
    f.start = NULL; f.a = NULL; f.g = NULL; f.s1 = NULL; f.s2 = NULL
    try:
        _flat_init(&f, "scale_many", xs, None, None, None, "", "")
        total = f.start[f.k]
        nc = _chunks(total, num_threads)
        pc_work(pc_elems_ns(<double>total))
        with nogil:
            for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
                a = total * i // nc
                b = total * (i + 1) // nc
                for j in range(f.k):
                    lo = max(a, f.start[j])
                    hi = min(b, f.start[j + 1])
                    if lo < hi:
                        pc_scale(f.a[j] + (lo - f.start[j]), hi - lo, f32)
    finally:
        _flat_free(&f)


include "_team.pxi"
