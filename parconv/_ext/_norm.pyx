# Shape legend: batch norm views x as (N, C, L): N batch, C channels, L the product of the
# trailing dims (H * W, or L, or 1 for (N, C) input); a "plane" is the L values of one
# (n, c), and M = N * L values make a channel's statistics. Dropout takes x flat, n elements.
"""Batch normalisation (batch_norm forward in training and eval mode, backward) and dropout kernels.

The per-channel sums of batch norm run over contiguous chunks of planes, a few per
thread, handed out as threads come free (a thread whose core another process takes
holds up one chunk, not its share of the loop): each chunk sums its planes in double
into its own row of partials, and the rows are added in chunk order afterwards. The
chunks are set by the shape and the thread count, so a thread count always gives the
same bits however busy the machine, and a channel of millions of values keeps float64
accuracy. The variance is a second pass over (x - mean)^2, not E[x^2] - mean^2, which cancels.

Dropout's keep mask is splitmix64 of (seed + (i + 1) * 0x9E3779B97F4A7C15), i the
flat index, compared on its top 32 bits with floor(p * 2^32): the function
``dropout_keep`` of the NumPy reference computes the same mask, so is the OpenCL
kernel; the backward recomputes it instead of storing it.
"""

from cython.parallel cimport parallel, prange
from libc.math cimport sqrt, sqrtf
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_team, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns, pc_sync,
    pc_sync_init, pc_sync_wait, pc_sync_first)

cdef extern from "pc_norm.h":
    int PCN_PLANE_STEP
    void pcn_sum_sq(const float *p, Py_ssize_t n, double k, double *s) noexcept nogil
    void pcn_grad_sums_relu(const float *x, const float *dy, const float *y, Py_ssize_t n, float m, float istd,
                            double *sg, double *sgx) noexcept nogil
    void pcn_dx_plane(const float *x, const float *dy, const float *y, float *dx, Py_ssize_t n, float m,
                      float istd, float k, float a, float b, int training) noexcept nogil

cdef enum:
    SERIAL_BELOW = 32768  # elements: below this, waking a team costs more than the loop
    BN_PLANE_MIN = 64  # pc_work counts a plane as at least this many values (each has a fixed cost)
    BN_TAIL_COST = 4  # and each value past its last whole vector step (PCN_PLANE_STEP) as this many more


cdef inline Py_ssize_t _max(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a > b else b


cdef inline int _chunks(Py_ssize_t units, Py_ssize_t work, int num_threads,
                        Py_ssize_t serial_below=SERIAL_BELOW) noexcept nogil:
    """Contiguous chunks for ``units`` planes holding ``work`` elements: a few per thread, set by the
    shape and the thread count only, so whichever thread sums a chunk the bits are the same."""
    if work < serial_below or num_threads <= 1 or units <= 1:
        return 1
    return <int>min(units, <Py_ssize_t>num_threads * PC_BLOCKS_PER_THREAD)



def _bn_chunks(Py_ssize_t N, Py_ssize_t C, Py_ssize_t L, int num_threads):
    """How many chunks batch norm splits an (N, C, L) input into at ``num_threads`` threads
    (1: one thread runs it; tests)."""
    return _chunks(N * C, N * C * L, num_threads)


def batch_norm_forward_train(const float[:, :, ::1] x,   # IN  (N, C, L)
                             const float[::1] weight,     # IN  (C,) or None
                             const float[::1] bias,       # IN  (C,) or None
                             float[::1] running_mean,     # IN/OUT (C,) or None, updated in place
                             float[::1] running_var,      # IN/OUT (C,) or None, updated in place
                             float[:, :, ::1] y,          # OUT (N, C, L), overwritten
                             float[::1] mean,             # OUT (C,) batch mean
                             float[::1] invstd,           # OUT (C,) 1 / sqrt(biased var + eps)
                             double momentum, double eps, bint relu, int num_threads,
                             const float[:, :, ::1] residual=None):  # IN (N, C, L) or None, added before the ReLU
    """Normalise with the batch statistics (M = N * L > 1); see ``Backend.batch_norm_forward_train``."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, M = N * L, c
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    pc_work(pc_elems_ns(<double>planes * _plane_values(L) * 2))  # two passes
    cdef const float *rp = _residual(residual, N, C, L)
    # per chunk and channel the sum and the sum of squares about k[c] (the mean of the channel's first
    # values), then the merged sums, k, and the affine coefficients
    cdef double *part = <double *>calloc(2 * nc * C + 4 * C, sizeof(double))
    cdef double *m64
    cdef double *v64
    cdef double *k64
    cdef float *scale
    cdef float *shift
    cdef const float *xp = &x[0, 0, 0]
    cdef float *yp = &y[0, 0, 0]
    cdef const float *wp = NULL if weight is None else &weight[0]
    cdef const float *bp = NULL if bias is None else &bias[0]
    cdef float *rmp = NULL if running_mean is None else &running_mean[0]
    cdef float *rvp = NULL if running_var is None else &running_var[0]
    cdef pc_sync sync
    if part == NULL:
        raise MemoryError()
    m64 = part + 2 * nc * C
    v64 = m64 + C
    k64 = v64 + C
    scale = <float *>(k64 + C)       # C floats in the last C doubles' room
    shift = scale + C
    # k: the mean of a channel's first values (up to 64, of the first planes), close to the channel's mean
    # unless the batch is far off its first image's start; one value alone could be an outlier
    for c in range(C):
        k64[c] = _first_mean(xp, N, C, L, c)
    pc_sync_init(&sync)
    # one region for the two passes; thread 0 merges the chunks' sums between them
    with nogil, parallel(num_threads=pc_cap(pc_team(nc, num_threads))):
        for i in prange(nc, schedule="dynamic"):
            _sum_sq_chunk(xp, _bound(N, C, i, nc), _bound(N, C, i + 1, nc), C, L, k64, part + 2 * i * C)
        pc_sync_wait(&sync)
        if pc_sync_first():
            _merge_sum_sq(part, k64, m64, v64, nc, C, M)
            _train_stats(m64, v64, C, M, eps, momentum, wp, bp, rmp, rvp, &mean[0], &invstd[0], scale, shift)
        pc_sync_wait(&sync)
        for i in prange(nc, schedule="dynamic"):
            _apply_chunk(xp, yp, _bound(N, C, i, nc), _bound(N, C, i + 1, nc), C, L, &mean[0], scale, shift, relu,
                         rp)
    free(part)


cdef double _first_mean(const float *x, Py_ssize_t N, Py_ssize_t C, Py_ssize_t L, Py_ssize_t c) noexcept nogil:
    """The mean of channel c's first min(N * L, 64) values in memory order (NaN and inf as they come)."""
    cdef Py_ssize_t n = 0, i, j
    cdef double s = 0.0
    for i in range(N):
        for j in range(L):
            if n == 64:
                return s / n
            s += x[(i * C + c) * L + j]
            n += 1
    return s / n


cdef void _sum_sq_chunk(const float *x, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t C, Py_ssize_t L, const double *k,
                        double *part) noexcept nogil:
    """part[2c], part[2c + 1] += the sum of planes [j0, j1)'s values less k[c], and of their squares."""
    cdef Py_ssize_t j, r, rr, c = j0 % C
    cdef double d
    if L == 1 and c == 0 and j1 % C == 0:
        for rr in range(j0 // C, j1 // C):
            r = rr * C
            for c in range(C):
                d = x[r + c] - k[c]
                part[2 * c] += d
                part[2 * c + 1] += d * d
        return
    for j in range(j0, j1):
        pcn_sum_sq(x + j * L, L, k[c], part + 2 * c)
        c += 1
        if c == C:
            c = 0


cdef void _merge_sum_sq(const double *part, const double *k, double *mean, double *sqdev, int nc, Py_ssize_t C,
                        Py_ssize_t M) noexcept nogil:
    """The chunks' shifted sums added in chunk order, as each channel's mean and the sum of its squared
    deviations from the mean (what the two-pass statistics compute): sum (x - k)^2 - (sum (x - k))^2 / M."""
    cdef Py_ssize_t c
    cdef int i
    cdef double s1, s2
    for c in range(C):
        s1 = 0.0
        s2 = 0.0
        for i in range(nc):
            s1 += part[2 * (i * C + c)]
            s2 += part[2 * (i * C + c) + 1]
        mean[c] = k[c] + s1 / M
        sqdev[c] = s2 - s1 * (s1 / M)
        if sqdev[c] < 0.0:  # rounding where every value is the same
            sqdev[c] = 0.0


cdef void _train_stats(const double *m64, double *v64, Py_ssize_t C, Py_ssize_t M, double eps, double momentum,
                       const float *weight, const float *bias, float *running_mean, float *running_var,
                       float *mean, float *invstd, float *scale, float *shift) noexcept nogil:
    """The batch statistics, the affine coefficients and the running statistics from the sums."""
    cdef Py_ssize_t c
    for c in range(C):
        v64[c] = v64[c] / M
        mean[c] = <float>m64[c]
        invstd[c] = <float>(1.0 / sqrt(v64[c] + eps))
        scale[c] = invstd[c] * weight[c] if weight != NULL else invstd[c]
        shift[c] = bias[c] if bias != NULL else <float>0.0
        if running_mean != NULL:
            running_mean[c] = <float>((1.0 - momentum) * running_mean[c] + momentum * m64[c])
            running_var[c] = <float>((1.0 - momentum) * running_var[c] + momentum * (v64[c] * M / (M - 1)))


cdef void _grad_coefs(const double *part, double *sg, double *sgx, int nc, Py_ssize_t C, Py_ssize_t M, bint sums,
                      float *dweight, float *dbias, const float *weight, const float *invstd,
                      float *coef) noexcept nogil:
    """The chunks' gradient sums in chunk order, dweight and dbias from them, and (coef not NULL)
    dx's per-channel coefficients."""
    cdef Py_ssize_t c
    cdef int i
    if sums:
        for c in range(C):
            sg[c] = 0.0
            sgx[c] = 0.0
            for i in range(nc):
                sg[c] += part[2 * i * C + c]
                sgx[c] += part[(2 * i + 1) * C + c]
        for c in range(C):
            if dweight != NULL:
                dweight[c] = <float>sgx[c]
            if dbias != NULL:
                dbias[c] = <float>sg[c]
    if coef != NULL:
        for c in range(C):
            coef[c] = invstd[c] * weight[c] if weight != NULL else invstd[c]
            coef[C + c] = <float>(sg[c] / M)
            coef[2 * C + c] = <float>(sgx[c] / M)


cdef const float *_residual(const float[:, :, ::1] r, Py_ssize_t N, Py_ssize_t C, Py_ssize_t L,
                            str name="residual") except? NULL:
    """r's data, or NULL for None; r must have x's shape (N, C, L)."""
    if r is None:
        return NULL
    if r.shape[0] != N or r.shape[1] != C or r.shape[2] != L:
        raise ValueError(f"batch_norm: {name} must have x's shape ({N}, {C}, {L}), "
                         f"got ({r.shape[0]}, {r.shape[1]}, {r.shape[2]})")
    return &r[0, 0, 0]


cdef inline void _apply_plane(const float *x, float *y, Py_ssize_t n, float m, float s, float b,
                              bint relu, const float *r) noexcept nogil:
    """y = (x - m) * s + b (+ r, then max(y, 0), NaN passing), the oracle's order of operations."""
    cdef Py_ssize_t k
    cdef float v
    if r != NULL:
        for k in range(n):
            v = ((x[k] - m) * s + b) + r[k]
            y[k] = (<float>0.0 if v < 0 else v) if relu else v
    elif relu:
        for k in range(n):
            v = (x[k] - m) * s + b
            y[k] = <float>0.0 if v < 0 else v
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
                            double eps, bint relu, int num_threads,
                            const float[:, :, ::1] residual=None):  # IN (N, C, L) or None, added before the ReLU
    """Normalise with the running statistics; see ``Backend.batch_norm_forward_eval``."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, c
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    # one pass that reads x and writes y, in loops the compiler vectorises whole (no scalar tail of
    # pcn_sum_sq's kind): a plane's fixed cost, no more
    pc_work(pc_elems_ns(<double>planes * _max(L, BN_PLANE_MIN) * 2))
    cdef const float *rp = _residual(residual, N, C, L)
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
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            _apply_chunk(xp, yp, _bound(N, C, i, nc), _bound(N, C, i + 1, nc), C, L, &mean[0], scale, shift, relu,
                         rp)
    free(scale)


def batch_norm_backward(const float[:, :, ::1] x,    # IN  (N, C, L)
                        const float[::1] weight,      # IN  (C,) or None
                        const float[:, :, ::1] dy,    # IN  (N, C, L) gradient of the normalised output
                        const float[::1] mean,        # IN  (C,) from the forward
                        const float[::1] invstd,      # IN  (C,) from the forward
                        float[:, :, ::1] dx,          # OUT (N, C, L) or None, overwritten (may be dy itself)
                        float[::1] dweight,           # OUT (C,) or None, overwritten
                        float[::1] dbias,             # OUT (C,) or None, overwritten
                        bint training, int num_threads,
                        const float[:, :, ::1] y=None):  # IN (N, C, L) or None: a fused ReLU's output
    """Gradients of batch norm; see ``Backend.batch_norm_backward``. With ``y`` (the output of a
    ReLU fused into the forward) the gradient is ``dy`` where ``y > 0``, else 0, masked inside both
    passes (vector selects) rather than in a pass of its own."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], L = x.shape[2]
    cdef Py_ssize_t planes = N * C, M = N * L, c
    cdef int nc = _chunks(planes, planes * L, num_threads), i
    # the sums' pass over x and dy, and dx's, which also writes: the forward's time and half again
    # with dx, three quarters of it without
    pc_work(pc_elems_ns(<double>planes * _plane_values(L) * (3.0 if dx is not None else 1.5)))
    cdef double *part = <double *>calloc(2 * nc * C + 2 * C, sizeof(double))
    cdef double *sg
    cdef double *sgx
    cdef float *coef
    cdef const float *xp = &x[0, 0, 0]
    cdef const float *dyp = &dy[0, 0, 0]
    cdef float *dxp = &dx[0, 0, 0] if dx is not None else NULL
    cdef float *dwp = NULL if dweight is None else &dweight[0]
    cdef float *dbp = NULL if dbias is None else &dbias[0]
    cdef const float *wp = NULL if weight is None else &weight[0]
    cdef bint sums = training or dweight is not None
    cdef const float *yp = _residual(y, N, C, L, "y")
    cdef pc_sync sync
    if part == NULL:
        raise MemoryError()
    sg = part + 2 * nc * C
    sgx = sg + C
    coef = <float *>calloc(3 * C, sizeof(float))  # per channel: k = w * invstd, sum(g) / M, sum(g xhat) / M
    if coef == NULL:
        free(part)
        raise MemoryError()
    pc_sync_init(&sync)
    # one region for both passes; thread 0 merges the chunks' sums between them
    with nogil, parallel(num_threads=pc_cap(pc_team(nc, num_threads))):
        if sums:
            for i in prange(nc, schedule="dynamic"):
                _grad_chunk(xp, dyp, yp, _bound(N, C, i, nc), _bound(N, C, i + 1, nc), C, L, &mean[0], &invstd[0],
                            part + 2 * i * C, part + (2 * i + 1) * C)
            pc_sync_wait(&sync)
        if pc_sync_first():
            _grad_coefs(part, sg, sgx, nc, C, M, sums, dwp, dbp, wp, &invstd[0], coef if dxp != NULL else NULL)
        if dxp != NULL:
            pc_sync_wait(&sync)
            for i in prange(nc, schedule="dynamic"):
                _dx_chunk(xp, dyp, yp, dxp, _bound(N, C, i, nc), _bound(N, C, i + 1, nc), C, L, &mean[0],
                          &invstd[0], coef, training)
    free(coef)
    free(part)


cdef inline double _plane_values(Py_ssize_t L) noexcept nogil:
    """What one plane of L values costs a pass, in values: at least BN_PLANE_MIN, and the ones its vector
    loop leaves to the scalar one several times over (a 4x4 plane runs wholly scalar on AVX-512)."""
    return <double>_max(L, BN_PLANE_MIN) + <double>BN_TAIL_COST * (L % PCN_PLANE_STEP)


cdef inline Py_ssize_t _bound(Py_ssize_t N, Py_ssize_t C, Py_ssize_t i, int nc) noexcept nogil:
    """First plane of chunk i of nc: whole images per chunk where there are at least nc of them."""
    if N >= nc:
        return C * (N * i // nc)
    return N * C * i // nc


# One chunk of planes [j0, j1) per call; the channel c = j % C advances with the plane, so
# no division runs per plane. (N, C) input (L == 1) in whole rows runs as loops over the C
# channels of each row instead, which vectorise.
cdef void _apply_chunk(const float *x, float *y, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t C, Py_ssize_t L,
                       const float *mean, const float *scale, const float *shift, bint relu,
                       const float *res) noexcept nogil:
    cdef Py_ssize_t j, r, rr, c = j0 % C
    cdef float v
    if L == 1 and c == 0 and j1 % C == 0:
        for rr in range(j0 // C, j1 // C):
            r = rr * C
            for c in range(C):
                v = (x[r + c] - mean[c]) * scale[c] + shift[c]
                if res != NULL:
                    v = v + res[r + c]
                y[r + c] = (<float>0.0 if v < 0 else v) if relu else v
        return
    for j in range(j0, j1):
        _apply_plane(x + j * L, y + j * L, L, mean[c], scale[c], shift[c], relu, NULL if res == NULL else res + j * L)
        c += 1
        if c == C:
            c = 0


cdef void _grad_chunk(const float *x, const float *dy, const float *y, Py_ssize_t j0, Py_ssize_t j1,
                      Py_ssize_t C, Py_ssize_t L, const float *mean, const float *invstd, double *sg,
                      double *sgx) noexcept nogil:
    """sum(g) and sum(g xhat) of planes [j0, j1) into sg, sgx; g = dy, masked by y > 0 with y."""
    cdef Py_ssize_t j, r, rr, c = j0 % C
    cdef float g
    if L == 1 and c == 0 and j1 % C == 0:
        for rr in range(j0 // C, j1 // C):
            r = rr * C
            for c in range(C):
                g = <float>0.0 if y != NULL and not (y[r + c] > 0) else dy[r + c]
                sg[c] += g
                sgx[c] += g * ((x[r + c] - mean[c]) * invstd[c])
        return
    for j in range(j0, j1):
        pcn_grad_sums_relu(x + j * L, dy + j * L, NULL if y == NULL else y + j * L, L, mean[c], invstd[c],
                           &sg[c], &sgx[c])
        c += 1
        if c == C:
            c = 0


cdef void _dx_chunk(const float *x, const float *dy, const float *y, float *dx, Py_ssize_t j0, Py_ssize_t j1,
                    Py_ssize_t C, Py_ssize_t L, const float *mean, const float *invstd, const float *coef,
                    bint training) noexcept nogil:
    """coef: (3, C) rows k = w * invstd, sum(g) / M, sum(g xhat) / M; g = dy, masked by y > 0 with y."""
    cdef Py_ssize_t j, r, rr, c = j0 % C
    cdef float g
    if L == 1 and c == 0 and j1 % C == 0:
        for rr in range(j0 // C, j1 // C):
            r = rr * C
            for c in range(C):
                g = <float>0.0 if y != NULL and not (y[r + c] > 0) else dy[r + c]
                if training:
                    dx[r + c] = ((g - coef[C + c]) - ((x[r + c] - mean[c]) * invstd[c]) * coef[2 * C + c]) * coef[c]
                else:
                    dx[r + c] = g * coef[c]
        return
    for j in range(j0, j1):
        pcn_dx_plane(x + j * L, dy + j * L, NULL if y == NULL else y + j * L, dx + j * L, L, mean[c], invstd[c],
                     coef[c], coef[C + c], coef[2 * C + c], training)
        c += 1
        if c == C:
            c = 0


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
    cdef Py_ssize_t n = x.shape[0], i
    cdef int nc = _chunks(n, n, num_threads)
    pc_work(pc_elems_ns(<double>n))
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            _dropout_range(&x[0], &y[0], n * i // nc, n * (i + 1) // nc, seed, threshold, scale)


cdef void _dropout_range(const float *x, float *y, Py_ssize_t a, Py_ssize_t b, uint64_t seed, uint64_t threshold,
                         float scale) noexcept nogil:
    """y[k] for k in [a, b): the product is formed before the select, so the loop has no
    conditional load and vectorises (the hash's 64-bit multiplies included, where the ISA has them)."""
    cdef Py_ssize_t k
    cdef float v
    for k in range(a, b):
        v = x[k] * scale
        y[k] = v if _keep(seed, <uint64_t>k, threshold) else <float>0.0


include "_team.pxi"
