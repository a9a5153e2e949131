# Shape legend: N batch (rows), G classes / out-features (columns).
# softmax cross-entropy: logits (N, G) float32, labels (N,) int32, probs (N, G).
# BCE: p, t taken flat, n = p.size elements.
"""Loss kernels, forward and backward: softmax cross-entropy (with and without label smoothing:
softmax_cross_entropy_smoothed), binary cross-entropy (bce) and mean squared error (mse); and
the row argmax helpers of accuracy (argmax_rows, count_correct).

Losses are summed in double, one partial sum per chunk, and the partials are
added in chunk order, so a thread count always gives the same bits.

Softmax probabilities and their gradients below ``FLT_MIN`` (1.2e-38, the
smallest normal float32) are flushed to zero. A confident or diverging network
puts such denormal numbers in its loss gradient, and every multiply-add that
takes one in the layers below is slow on many CPUs (microcode assists), which
slows the steps after a loss spike (figures in docs/performance-internals.md). Row
argmax follows ``np.argmax``: the first maximum, and the first NaN if a row
has one.
"""

from cython.parallel cimport prange
from libc.float cimport FLT_MIN
from libc.math cimport expf, logf, log
from libc.stdlib cimport malloc, free

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_team, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)

cdef enum:
    SERIAL_BELOW = 32768  # elements
    LOSS_ELEMS = 4  # elements of a cheap pass a loss's element costs (most take a log or an exp; pc_work)


cdef inline int _chunks(Py_ssize_t rows, Py_ssize_t work, int num_threads) noexcept nogil:
    """One contiguous block of rows per thread; serial for small work."""
    if work < SERIAL_BELOW or num_threads <= 1:
        return 1
    if num_threads > rows:
        return <int>rows
    return num_threads


cdef inline int _blocks(Py_ssize_t rows, Py_ssize_t work, int num_threads) noexcept nogil:
    """Contiguous blocks of rows for a sum: a few per thread, each summed on its own and the blocks
    added in order, so the bits depend on the thread count only, not on which thread takes a block."""
    if work < SERIAL_BELOW or num_threads <= 1:
        return 1
    return <int>min(rows, <Py_ssize_t>num_threads * PC_BLOCKS_PER_THREAD)


cdef inline Py_ssize_t _row_argmax(const float *row, Py_ssize_t G) noexcept nogil:
    cdef Py_ssize_t j, best_j = 0
    cdef float best = row[0], v
    for j in range(1, G):
        v = row[j]
        if v > best or (v != v and best == best):
            best = v
            best_j = j
    return best_j


cdef double _xent_rows(const float *x, const int *lab, float *probs, Py_ssize_t r0, Py_ssize_t r1,
                       Py_ssize_t G) noexcept nogil:
    """Softmax of rows [r0, r1) into probs; returns the sum of -log p[label]."""
    cdef Py_ssize_t r, j
    cdef const float *row
    cdef float *pr
    cdef float m, lse, e, inv
    cdef double s, loss = 0.0
    for r in range(r0, r1):
        row = x + r * G
        pr = probs + r * G
        m = row[0]
        for j in range(1, G):
            if row[j] > m:
                m = row[j]
        s = 0.0
        for j in range(G):
            e = expf(row[j] - m)
            pr[j] = e
            s += e
        lse = <float>log(s)
        inv = <float>(1.0 / s)
        for j in range(G):
            e = pr[j] * inv
            pr[j] = <float>0.0 if e < FLT_MIN else e  # (a NaN stays NaN)
        loss -= (row[lab[r]] - m) - lse
    return loss


def softmax_cross_entropy_forward(const float[:, ::1] logits,  # IN  (N, G)
                                  const int[::1] labels,        # IN  (N,) in [0, G)
                                  float[:, ::1] probs,          # OUT (N, G), overwritten
                                  int num_threads):
    """Mean softmax cross-entropy with a stable log-sum-exp; returns the loss as a Python float."""
    cdef Py_ssize_t N = logits.shape[0], G = logits.shape[1]
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nc = _blocks(N, N * G, num_threads)
    cdef double *part = <double *>malloc(sizeof(double) * nc)
    cdef double total = 0.0
    cdef Py_ssize_t i
    if part == NULL:
        raise MemoryError()
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            part[i] = _xent_rows(&logits[0, 0], &labels[0], &probs[0, 0], N * i // nc, N * (i + 1) // nc, G)
    for i in range(nc):
        total += part[i]
    free(part)
    return total / N


def softmax_cross_entropy_backward(const float[:, ::1] probs,  # IN  (N, G)
                                   const int[::1] labels,       # IN  (N,)
                                   float[:, ::1] dlogits,       # OUT (N, G), overwritten
                                   int num_threads):
    """``dlogits = (probs - onehot(labels)) / N``, entries below ``FLT_MIN`` flushed to zero."""
    cdef Py_ssize_t N = probs.shape[0], G = probs.shape[1], r, j
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nt = _chunks(N, N * G, num_threads)
    cdef float fn = <float>N
    cdef float v
    with nogil:
        for r in prange(N, schedule="guided", num_threads=pc_cap(nt)):
            for j in range(G):
                v = probs[r, j] / fn
                dlogits[r, j] = <float>0.0 if v < FLT_MIN else v
            dlogits[r, labels[r]] = (probs[r, labels[r]] - <float>1.0) / fn


cdef double _bce_sum(const float *p, const float *t, Py_ssize_t a, Py_ssize_t b, float lo, float hi) noexcept nogil:
    cdef Py_ssize_t i
    cdef float pc, ti
    cdef double s = 0.0
    for i in range(a, b):
        pc = p[i]
        pc = lo if pc < lo else (hi if pc > hi else pc)
        ti = t[i]
        s += ti * logf(pc) + (<float>1.0 - ti) * logf(<float>1.0 - pc)
    return s


def bce_forward(const float[::1] p,  # IN  (n,) probabilities
                const float[::1] t,  # IN  (n,) 0/1 targets
                double eps, int num_threads):
    """Mean binary cross-entropy with p clipped to ``[eps, 1 - eps]``; returns a Python float."""
    cdef Py_ssize_t n = p.shape[0], i
    pc_work(pc_elems_ns(<double>n * LOSS_ELEMS))
    cdef int nc = _blocks(n, n, num_threads)
    cdef float lo = <float>eps, hi = <float>(1.0 - eps)
    cdef double *part = <double *>malloc(sizeof(double) * nc)
    cdef double total = 0.0
    if part == NULL:
        raise MemoryError()
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            part[i] = _bce_sum(&p[0], &t[0], n * i // nc, n * (i + 1) // nc, lo, hi)
    for i in range(nc):
        total += part[i]
    free(part)
    return -(total / n)


def bce_backward(const float[::1] p,  # IN  (n,)
                 const float[::1] t,  # IN  (n,)
                 float[::1] dp,       # OUT (n,), overwritten
                 double eps, int num_threads):
    """``dp = (pc - t) / (pc (1 - pc)) / n``, 0 where the clip is active (zero gradient there)."""
    cdef Py_ssize_t n = p.shape[0], i
    pc_work(pc_elems_ns(<double>n * LOSS_ELEMS))
    cdef int nt = _chunks(n, n, num_threads)
    cdef float lo = <float>eps, hi = <float>(1.0 - eps), fn = <float>n
    cdef float pc, pi
    with nogil:
        for i in prange(n, schedule="guided", num_threads=pc_cap(nt)):
            pi = p[i]
            if pi < lo or pi > hi:
                dp[i] = <float>0.0
            else:
                pc = pi
                dp[i] = (pc - t[i]) / (pc * (<float>1.0 - pc)) / fn


def count_correct(const float[:, ::1] logits,  # IN (N, G)
                  const int[::1] labels,        # IN (N,)
                  int num_threads):
    """Number of rows whose argmax equals the label."""
    cdef Py_ssize_t N = logits.shape[0], G = logits.shape[1], r
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nt = _chunks(N, N * G, num_threads)
    cdef long correct = 0
    with nogil:
        for r in prange(N, schedule="guided", num_threads=pc_cap(nt)):
            if _row_argmax(&logits[r, 0], G) == labels[r]:
                correct += 1
    return int(correct)


def argmax_rows(const float[:, ::1] logits,  # IN  (N, G)
                int[::1] out,                 # OUT (N,) int32, overwritten
                int num_threads):
    """Row argmax (first maximum, first NaN wins)."""
    cdef Py_ssize_t N = logits.shape[0], G = logits.shape[1], r
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nt = _chunks(N, N * G, num_threads)
    with nogil:
        for r in prange(N, schedule="guided", num_threads=pc_cap(nt)):
            out[r] = <int>_row_argmax(&logits[r, 0], G)


# ----------------------------------------------------------------------------------
# MSE (p, t flat, n elements) and softmax cross-entropy with label smoothing: the target
# row is `off` everywhere and `on` at the label (on = 1 - s + s / G, off = s / G, float32).
# ----------------------------------------------------------------------------------
cdef double _sq_sum(const float *p, const float *t, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef Py_ssize_t i
    cdef float d
    cdef double s = 0.0
    for i in range(a, b):
        d = p[i] - t[i]
        s += d * d
    return s


def mse_forward(const float[::1] p,  # IN  (n,) predictions
                const float[::1] t,  # IN  (n,) targets
                int num_threads):
    """Mean of ``(p - t)^2`` (squares in float32, summed in double per chunk, chunks in order)."""
    cdef Py_ssize_t n = p.shape[0], i
    pc_work(pc_elems_ns(<double>n * LOSS_ELEMS))
    cdef int nc = _blocks(n, n, num_threads)
    cdef double *part = <double *>malloc(sizeof(double) * nc)
    cdef double total = 0.0
    if part == NULL:
        raise MemoryError()
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            part[i] = _sq_sum(&p[0], &t[0], n * i // nc, n * (i + 1) // nc)
    for i in range(nc):
        total += part[i]
    free(part)
    return total / n


def mse_backward(const float[::1] p,  # IN  (n,)
                 const float[::1] t,  # IN  (n,)
                 float[::1] dp,       # OUT (n,), overwritten
                 int num_threads):
    """``dp = (p - t) * (2 / n)``."""
    cdef Py_ssize_t n = p.shape[0], i
    pc_work(pc_elems_ns(<double>n * LOSS_ELEMS))
    cdef int nt = _chunks(n, n, num_threads)
    cdef float k = <float>(2.0 / n)
    with nogil:
        for i in prange(n, schedule="guided", num_threads=pc_cap(nt)):
            dp[i] = (p[i] - t[i]) * k


cdef double _xent_smooth_rows(const float *x, const int *lab, float *probs, Py_ssize_t r0, Py_ssize_t r1,
                              Py_ssize_t G, double on, double off) noexcept nogil:
    """Softmax of rows [r0, r1) into probs (flushed as _xent_rows); returns the sum over the rows of
    -(on logp[label] + off sum_{j != label} logp[j])."""
    cdef Py_ssize_t r, j
    cdef const float *row
    cdef float *pr
    cdef float m, lse, e, inv
    cdef double s, zsum, loss = 0.0, lp_label
    for r in range(r0, r1):
        row = x + r * G
        pr = probs + r * G
        m = row[0]
        for j in range(1, G):
            if row[j] > m:
                m = row[j]
        s = 0.0
        zsum = 0.0
        for j in range(G):
            e = expf(row[j] - m)
            pr[j] = e
            s += e
            zsum += (row[j] - m)
        lse = <float>log(s)
        inv = <float>(1.0 / s)
        for j in range(G):
            e = pr[j] * inv
            pr[j] = <float>0.0 if e < FLT_MIN else e
        lp_label = (row[lab[r]] - m) - lse
        loss -= on * lp_label + off * ((zsum - G * <double>lse) - lp_label)
    return loss


def softmax_cross_entropy_smoothed_forward(const float[:, ::1] logits,  # IN  (N, G)
                                           const int[::1] labels,        # IN  (N,) in [0, G)
                                           float[:, ::1] probs,          # OUT (N, G), overwritten
                                           double on, double off, int num_threads):
    """Mean cross-entropy against the smoothed targets; returns the loss as a Python float."""
    cdef Py_ssize_t N = logits.shape[0], G = logits.shape[1]
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nc = _blocks(N, N * G, num_threads)
    cdef double *part = <double *>malloc(sizeof(double) * nc)
    cdef double total = 0.0
    cdef Py_ssize_t i
    if part == NULL:
        raise MemoryError()
    with nogil:
        for i in prange(nc, schedule="dynamic", num_threads=pc_cap(pc_team(nc, num_threads))):
            part[i] = _xent_smooth_rows(&logits[0, 0], &labels[0], &probs[0, 0], N * i // nc, N * (i + 1) // nc,
                                        G, on, off)
    for i in range(nc):
        total += part[i]
    free(part)
    return total / N


def softmax_cross_entropy_smoothed_backward(const float[:, ::1] probs,  # IN  (N, G)
                                            const int[::1] labels,       # IN  (N,)
                                            float[:, ::1] dlogits,       # OUT (N, G), overwritten
                                            float on, float off, int num_threads):
    """``dlogits = (probs - target) / N``, entries of magnitude below ``FLT_MIN`` flushed to zero."""
    cdef Py_ssize_t N = probs.shape[0], G = probs.shape[1], r, j
    pc_work(pc_elems_ns(<double>N * G * LOSS_ELEMS))
    cdef int nt = _chunks(N, N * G, num_threads)
    cdef float fn = <float>N
    cdef float v
    with nogil:
        for r in prange(N, schedule="guided", num_threads=pc_cap(nt)):
            for j in range(G):
                v = (probs[r, j] - (on if j == labels[r] else off)) / fn
                dlogits[r, j] = <float>0.0 if (v < FLT_MIN and v > -FLT_MIN) else v


include "_team.pxi"
