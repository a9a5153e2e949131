# Shape legend: N batch, C channels, H, W input, P, Q output, K window (K x K),
# S stride; no padding, floor mode: P = (H - K) // S + 1, Q likewise.
# A "plane" is one (n, c) pair: H*W inputs, P*Q outputs.
"""Pooling kernels, forward and backward, parallel over (n, c) planes: maxpool2d (square windows,
no padding; the general form with padding and rectangular windows as maxpool2d_general),
avgpool2d and adaptive_avgpool2d. The plane loops are in ``pc_pool.h``.

argmax holds the flat index ``h * W + w`` of each window's maximum inside its
(H, W) plane, the first one on ties and the first NaN when there is one
(exactly ``np.argmax``), as uint16 where the plane has at most
``POOL_U16_MAX`` positions (the caller's choice; half the bytes of int32),
else int32. Planes never share inputs, so the backward scatter is race-free
without atomics.
"""

cimport cython

from cython.parallel cimport prange
from libc.stdlib cimport malloc, free
from libc.string cimport memset

from .pc_helpers cimport (pc_threads_for, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)
from .pc_pool cimport (
    PC_POOL_U16_MAX,
    pc_adaptive_avgpool_backward_plane,
    pc_adaptive_avgpool_plane,
    pc_avgpool_backward_plane,
    pc_avgpool_plane,
    pc_maxpool_general_plane,
    pc_pool_bases,
    pc_pool_plane,
    pc_pool_plane_u16,
)

#: the largest plane (H * W) whose argmax may be uint16
POOL_U16_MAX = PC_POOL_U16_MAX

ctypedef fused pool_index_t:
    int
    unsigned short


def maxpool2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                      float[:, :, :, ::1] y,        # OUT (N, C, P, Q), overwritten
                      pool_index_t[:, :, :, ::1] argmax,  # OUT (N, C, P, Q), overwritten
                      int kernel_size, int stride, int num_threads):
    """Max pooling forward; one plane per chunk."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int P = y.shape[2], Q = y.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>N * C, HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * PQ * kernel_size * kernel_size, planes, num_threads)
    # its taps, or its input read once as a network hands it over (from L3, not L1: 1.5 elements
    # each) where that is more, plus a pooled row's setup (8 elements' worth): most on small planes
    pc_work(pc_elems_ns(<double>planes * (max(<double>PQ * kernel_size * kernel_size, HW * 1.5) + P * 8)))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef pool_index_t *ap = &argmax[0, 0, 0, 0]
    cdef int *base
    cdef Py_ssize_t i
    if pool_index_t is cython.ushort and HW > PC_POOL_U16_MAX:
        raise ValueError(f"maxpool2d_forward: a {H}x{W} plane needs an int32 argmax")
    base = <int *>malloc(sizeof(int) * PQ)
    if base == NULL:
        raise MemoryError("maxpool2d_forward: could not allocate window table")
    with nogil:
        pc_pool_bases(W, stride, P, Q, base)
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            if pool_index_t is cython.ushort:
                pc_pool_plane_u16(xp + i * HW, base, W, kernel_size, stride, P, Q, yp + i * PQ, ap + i * PQ, 0)
            else:
                pc_pool_plane(xp + i * HW, base, W, kernel_size, stride, P, Q, yp + i * PQ, ap + i * PQ, 0)
    free(base)


def maxpool2d_backward(const float[:, :, :, ::1] dy,  # IN  (N, C, P, Q)
                       const pool_index_t[:, :, :, ::1] argmax,  # IN  (N, C, P, Q)
                       float[:, :, :, ::1] dx,        # OUT (N, C, H, W), overwritten
                       int num_threads):
    """Max pooling backward: ``dx = 0`` then ``dx[plane][argmax] += dy`` (overlapping windows add up)."""
    cdef int N = dx.shape[0], C = dx.shape[1], H = dx.shape[2], W = dx.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>N * C, HW = <Py_ssize_t>H * W
    cdef Py_ssize_t PQ = <Py_ssize_t>dy.shape[2] * dy.shape[3]
    cdef int nt = pc_threads_for(planes * (HW + PQ), planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * (HW + PQ))))
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef const pool_index_t *ap = &argmax[0, 0, 0, 0]
    cdef float *dxp = &dx[0, 0, 0, 0]
    cdef float *dxi
    cdef const float *dyi
    cdef const pool_index_t *ai
    cdef Py_ssize_t i, j
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            dxi = dxp + i * HW
            dyi = dyp + i * PQ
            ai = ap + i * PQ
            memset(dxi, 0, sizeof(float) * HW)
            for j in range(PQ):
                dxi[ai[j]] += dyi[j]


# ------------------------------------------------ general max, average and adaptive pooling
# KH x KW windows, strides SH, SW, padding PH, PW on each side (pc_pool.h); one plane per chunk.
def maxpool2d_general_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                              float[:, :, :, ::1] y,        # OUT (N, C, P, Q), overwritten
                              int[:, :, :, ::1] argmax,     # OUT (N, C, P, Q), overwritten
                              int KH, int KW, int SH, int SW, int PH, int PW, int num_threads):
    """Max pooling with padding (never selected) and rectangular windows; argmax int32."""
    cdef int H = x.shape[2], W = x.shape[3], P = y.shape[2], Q = y.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>x.shape[0] * x.shape[1], HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * PQ * KH * KW, planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * PQ * KH * KW)))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef int *ap = &argmax[0, 0, 0, 0]
    cdef Py_ssize_t i
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            pc_maxpool_general_plane(xp + i * HW, H, W, KH, KW, SH, SW, PH, PW, P, Q, yp + i * PQ, ap + i * PQ)


def avgpool2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                      float[:, :, :, ::1] y,        # OUT (N, C, P, Q), overwritten
                      int KH, int KW, int SH, int SW, int PH, int PW, int num_threads):
    """Average pooling, zero padding counted in every window's KH * KW."""
    cdef int H = x.shape[2], W = x.shape[3], P = y.shape[2], Q = y.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>x.shape[0] * x.shape[1], HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * PQ * KH * KW, planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * PQ * KH * KW)))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef Py_ssize_t i
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            pc_avgpool_plane(xp + i * HW, H, W, KH, KW, SH, SW, PH, PW, P, Q, yp + i * PQ)


def avgpool2d_backward(const float[:, :, :, ::1] dy,  # IN  (N, C, P, Q)
                       float[:, :, :, ::1] dx,        # OUT (N, C, H, W), overwritten
                       int KH, int KW, int SH, int SW, int PH, int PW, int num_threads):
    """Gradient of :func:`avgpool2d_forward`."""
    cdef int H = dx.shape[2], W = dx.shape[3], P = dy.shape[2], Q = dy.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>dx.shape[0] * dx.shape[1], HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * (HW + PQ * KH * KW), planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * (HW + PQ * KH * KW))))
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = &dx[0, 0, 0, 0]
    cdef Py_ssize_t i
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            pc_avgpool_backward_plane(dyp + i * PQ, H, W, KH, KW, SH, SW, PH, PW, P, Q, dxp + i * HW)


def adaptive_avgpool2d_forward(const float[:, :, :, ::1] x,  # IN  (N, C, H, W)
                               float[:, :, :, ::1] y,        # OUT (N, C, P, Q), overwritten
                               int num_threads):
    """Adaptive average pooling (PyTorch's windows); (1, 1) is one streaming sum per plane."""
    cdef int H = x.shape[2], W = x.shape[3], P = y.shape[2], Q = y.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>x.shape[0] * x.shape[1], HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * (HW + PQ), planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * (HW + PQ))))
    cdef const float *xp = &x[0, 0, 0, 0]
    cdef float *yp = &y[0, 0, 0, 0]
    cdef Py_ssize_t i
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            pc_adaptive_avgpool_plane(xp + i * HW, H, W, P, Q, yp + i * PQ)


def adaptive_avgpool2d_backward(const float[:, :, :, ::1] dy,  # IN  (N, C, P, Q)
                                float[:, :, :, ::1] dx,        # OUT (N, C, H, W), overwritten
                                int num_threads):
    """Gradient of :func:`adaptive_avgpool2d_forward`."""
    cdef int H = dx.shape[2], W = dx.shape[3], P = dy.shape[2], Q = dy.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>dx.shape[0] * dx.shape[1], HW = <Py_ssize_t>H * W, PQ = <Py_ssize_t>P * Q
    cdef int nt = pc_threads_for(planes * (HW + PQ), planes, num_threads)
    pc_work(pc_elems_ns(<double>(planes * (HW + PQ))))
    cdef const float *dyp = &dy[0, 0, 0, 0]
    cdef float *dxp = &dx[0, 0, 0, 0]
    cdef Py_ssize_t i
    with nogil:
        for i in prange(planes, schedule="guided", num_threads=pc_cap(nt)):
            pc_adaptive_avgpool_backward_plane(dyp + i * PQ, H, W, P, Q, dxp + i * HW)


include "_team.pxi"
