# Shape legend: batch norm views x as (N, C, L): N batch, C channels, L the product of the
# trailing dims (H * W, or L, or 1 for (N, C) input); a "plane" is the L values of one
# (n, c), and M = N * L values make a channel's statistics. Dropout takes x flat, n elements.
"""Batch normalisation (forward in training and eval mode, backward) and dropout kernels.

The per-channel sums of batch norm run over contiguous chunks of planes, one chunk
per thread: each chunk sums its planes in double into a private row of partials, and
the rows are added in chunk order afterwards, so a thread count always gives the
same bits and a channel of millions of values keeps float64 accuracy. The variance
is a second pass over (x - mean)^2, not E[x^2] - mean^2, which cancels.

Dropout's keep mask is splitmix64 of (seed + (i + 1) * 0x9E3779B97F4A7C15), i the
flat index, compared on its top 32 bits with floor(p * 2^32): the function
``dropout_keep`` of the NumPy reference computes the same mask, so is the OpenCL
kernel; the backward recomputes it instead of storing it.
"""

from cython.parallel cimport prange
from libc.math cimport sqrt, sqrtf
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free

cdef enum:
    SERIAL_BELOW = 32768  # elements: below this, waking a team costs more than the loop


cdef inline int _chunks(Py_ssize_t units, Py_ssize_t work, int num_threads) noexcept nogil:
    """Contiguous chunks (= threads) for ``units`` planes holding ``work`` elements."""
    if work < SERIAL_BELOW or num_threads <= 1 or units <= 1:
        return 1
    if num_threads > units:
        return <int>units
    return num_threads


cdef inline double _plane_sum(const float *p, Py_ssize_t n) noexcept nogil:
    """Sum of n floats in double, four independent lanes added in a fixed order."""
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    cdef Py_ssize_t i = 0
    while i + 4 <= n:
        s0 += p[i]
        s1 += p[i + 1]
        s2 += p[i + 2]
        s3 += p[i + 3]
        i += 4
    while i < n:
        s0 += p[i]
        i += 1
    return (s0 + s1) + (s2 + s3)


cdef inline double _plane_sqdev(const float *p, Py_ssize_t n, double m) noexcept nogil:
    """Sum of (p[i] - m)^2 in double."""
    cdef double s0 = 0.0, s1 = 0.0, d0, d1
    cdef Py_ssize_t i = 0
    while i + 2 <= n:
        d0 = p[i] - m
        d1 = p[i + 1] - m
        s0 += d0 * d0
        s1 += d1 * d1
        i += 2
    if i < n:
        d0 = p[i] - m
        s0 += d0 * d0
    return s0 + s1


cdef void _merge(const double *part, double *out, int nc, Py_ssize_t C) noexcept nogil:
    """out[c] = sum over chunks of part[chunk, c], in chunk order."""
    cdef Py_ssize_t c
    cdef int i
    for c in range(C):
        out[c] = 0.0
        for i in range(nc):
            out[c] += part[i * C + c]


def batch_norm_forward_train(const float[:, :, ::1] x,   # IN  (N, C, L)
                             const float[::1] weight,     # IN  (C,) or None
                             const float[::1] bias,       # IN  (C,) or None
                             float[::1] running_mean,     # IN/OUT (C,) or None, updated in place
                             float[::1] running_var,      # IN/OUT (C,) or None, updated in place
                             float[:, :, ::1] y,          # OUT (N, C, L), overwritten
                             float[::1] mean,             # OUT (C,) batch mean
                             float[::1] invstd,           # OUT (C,) 1 / sqrt(biased var + eps)
                             double momentum, double eps, bint relu, int num_threads):
    """Normalise with the batch statistics (M = N * L > 1); see ``Backend.batch_norm_forward_train``."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, M = N * L, j, c, a, b
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    cdef double *part = <double *>calloc(nc * C + 3 * C, sizeof(double))
    cdef double *m64
    cdef double *v64
    cdef float *scale
    cdef float *shift
    cdef const float *xp = &x[0, 0, 0]
    cdef float *yp = &y[0, 0, 0]
    cdef float v
    if part == NULL:
        raise MemoryError()
    m64 = part + nc * C
    v64 = m64 + C
    scale = <float *>(v64 + C)       # C floats in the last C doubles' room
    shift = scale + C
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for j in range(planes * i // nc, planes * (i + 1) // nc):
                part[i * C + j % C] += _plane_sum(xp + j * L, L)
        _merge(part, m64, nc, C)
        for c in range(C):
            m64[c] = m64[c] / M
        for c in range(nc * C):
            part[c] = 0.0
        for i in prange(nc, schedule="static", num_threads=nc):
            for j in range(planes * i // nc, planes * (i + 1) // nc):
                part[i * C + j % C] += _plane_sqdev(xp + j * L, L, m64[j % C])
        _merge(part, v64, nc, C)
        for c in range(C):
            v64[c] = v64[c] / M
            mean[c] = <float>m64[c]
            invstd[c] = <float>(1.0 / sqrt(v64[c] + eps))
            scale[c] = invstd[c] * weight[c] if weight is not None else invstd[c]
            shift[c] = bias[c] if bias is not None else <float>0.0
            if running_mean is not None:
                running_mean[c] = <float>((1.0 - momentum) * running_mean[c] + momentum * m64[c])
                running_var[c] = <float>((1.0 - momentum) * running_var[c] + momentum * (v64[c] * M / (M - 1)))
        for i in prange(nc, schedule="static", num_threads=nc):
            for j in range(planes * i // nc, planes * (i + 1) // nc):
                _apply_plane(xp + j * L, yp + j * L, L, mean[j % C], scale[j % C], shift[j % C], relu)
    free(part)


cdef inline void _apply_plane(const float *x, float *y, Py_ssize_t n, float m, float s, float b,
                              bint relu) noexcept nogil:
    """y = (x - m) * s + b (then max(y, 0)), the oracle's order of operations."""
    cdef Py_ssize_t k
    cdef float v
    if relu:
        for k in range(n):
            v = (x[k] - m) * s + b
            y[k] = v if v > 0 or v != v else <float>0.0
    else:
        for k in range(n):
            y[k] = (x[k] - m) * s + b


def batch_norm_forward_eval(const float[:, :, ::1] x,   # IN  (N, C, L)
                            const float[::1] weight,     # IN  (C,) or None
                            const float[::1] bias,       # IN  (C,) or None
                            const float[::1] running_mean,  # IN (C,)
                            const float[::1] running_var,   # IN (C,)
                            float[:, :, ::1] y,          # OUT (N, C, L), overwritten
                            float[::1] mean,             # OUT (C,) copy of running_mean
                            float[::1] invstd,           # OUT (C,) 1 / sqrt(running_var + eps)
                            double eps, bint relu, int num_threads):
    """Normalise with the running statistics; see ``Backend.batch_norm_forward_eval``."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, j, c
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    cdef float *scale = <float *>calloc(2 * C, sizeof(float))
    cdef float *shift
    cdef const float *xp = &x[0, 0, 0]
    cdef float *yp = &y[0, 0, 0]
    cdef float feps = <float>eps
    if scale == NULL:
        raise MemoryError()
    shift = scale + C
    with nogil:
        for c in range(C):
            mean[c] = running_mean[c]
            invstd[c] = <float>1.0 / sqrtf(running_var[c] + feps)
            scale[c] = invstd[c] * weight[c] if weight is not None else invstd[c]
            shift[c] = bias[c] if bias is not None else <float>0.0
        for i in prange(nc, schedule="static", num_threads=nc):
            for j in range(planes * i // nc, planes * (i + 1) // nc):
                _apply_plane(xp + j * L, yp + j * L, L, mean[j % C], scale[j % C], shift[j % C], relu)
    free(scale)


cdef inline void _grad_sums(const float *x, const float *dy, const float *y, Py_ssize_t n, float m, float istd,
                            double *sg, double *sgx) noexcept nogil:
    """Adds sum(g) and sum(g * xhat) of one plane, g = dy (masked by y > 0 when y is given)."""
    cdef Py_ssize_t k
    cdef float g
    cdef double a = 0.0, b = 0.0
    for k in range(n):
        g = dy[k] if y == NULL or y[k] > 0 else <float>0.0
        a += g
        b += g * ((x[k] - m) * istd)
    sg[0] += a
    sgx[0] += b


def batch_norm_backward(const float[:, :, ::1] x,    # IN  (N, C, L)
                        const float[::1] weight,      # IN  (C,) or None
                        const float[:, :, ::1] dy,    # IN  (N, C, L)
                        const float[::1] mean,        # IN  (C,) from the forward
                        const float[::1] invstd,      # IN  (C,) from the forward
                        const float[:, :, ::1] y,     # IN  (N, C, L) fused-ReLU output, or None
                        float[:, :, ::1] dx,          # OUT (N, C, L) or None, overwritten
                        float[::1] dweight,           # OUT (C,) or None, overwritten
                        float[::1] dbias,             # OUT (C,) or None, overwritten
                        bint training, int num_threads):
    """Gradients of batch norm; see ``Backend.batch_norm_backward``."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, M = N * L, j, c, k
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    cdef double *part = <double *>calloc(2 * nc * C + 2 * C, sizeof(double))
    cdef double *sg
    cdef double *sgx
    cdef float *coef
    cdef const float *xp = &x[0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0]
    cdef const float *yp = &y[0, 0, 0] if y is not None else NULL
    cdef float *dxp = &dx[0, 0, 0] if dx is not None else NULL
    cdef bint sums = training or dweight is not None
    if part == NULL:
        raise MemoryError()
    sg = part + 2 * nc * C
    sgx = sg + C
    coef = <float *>calloc(3 * C, sizeof(float))  # per channel: k = w * invstd, sum(g) / M, sum(g xhat) / M
    if coef == NULL:
        free(part)
        raise MemoryError()
    with nogil:
        if sums:
            for i in prange(nc, schedule="static", num_threads=nc):
                for j in range(planes * i // nc, planes * (i + 1) // nc):
                    c = j % C
                    _grad_sums(xp + j * L, dyp + j * L, (yp + j * L) if yp != NULL else NULL, L, mean[c],
                               invstd[c], &part[2 * i * C + c], &part[(2 * i + 1) * C + c])
            for c in range(C):
                sg[c] = 0.0
                sgx[c] = 0.0
                for i in range(nc):
                    sg[c] += part[2 * i * C + c]
                    sgx[c] += part[(2 * i + 1) * C + c]
            if dweight is not None:
                for c in range(C):
                    dweight[c] = <float>sgx[c]
                    dbias[c] = <float>sg[c]
        if dxp != NULL:
            for c in range(C):
                coef[c] = invstd[c] * weight[c] if weight is not None else invstd[c]
                coef[C + c] = <float>(sg[c] / M)
                coef[2 * C + c] = <float>(sgx[c] / M)
            for i in prange(nc, schedule="static", num_threads=nc):
                for j in range(planes * i // nc, planes * (i + 1) // nc):
                    c = j % C
                    _dx_plane(xp + j * L, dyp + j * L, (yp + j * L) if yp != NULL else NULL, dxp + j * L, L,
                              mean[c], invstd[c], coef[c], coef[C + c], coef[2 * C + c], training)
    free(coef)
    free(part)


cdef inline void _dx_plane(const float *x, const float *dy, const float *y, float *dx, Py_ssize_t n, float m,
                           float istd, float k, float a, float b, bint training) noexcept nogil:
    """dx = ((g - a) - xhat * b) * k in training mode, g * k in eval mode."""
    cdef Py_ssize_t i
    cdef float g
    for i in range(n):
        g = dy[i] if y == NULL or y[i] > 0 else <float>0.0
        if training:
            dx[i] = ((g - a) - ((x[i] - m) * istd) * b) * k
        else:
            dx[i] = g * k


cdef inline bint _keep(uint64_t seed, uint64_t i, uint64_t threshold) noexcept nogil:
    """splitmix64 of the element's counter; kept when its top 32 bits reach the threshold."""
    cdef uint64_t z = seed + (i + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    z = z ^ (z >> 31)
    return (z >> 32) >= threshold


def dropout_apply(const float[::1] x,   # IN  (n,) x (forward) or dy (backward)
                  float[::1] y,         # OUT (n,), overwritten
                  uint64_t seed, uint64_t threshold, float scale, int num_threads):
    """``y = x * scale`` where the element is kept, 0 elsewhere (forward and backward alike)."""
    cdef Py_ssize_t n = x.shape[0], i, k
    cdef int nc = _chunks(n, n, num_threads)
    with nogil:
        for i in prange(nc, schedule="static", num_threads=nc):
            for k in range(n * i // nc, n * (i + 1) // nc):
                y[k] = x[k] * scale if _keep(seed, <uint64_t>k, threshold) else <float>0.0
