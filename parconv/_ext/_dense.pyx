# Shape legend: N batch, F in-features, G out-features.
# y = x @ w.T + b with x (N, F), w (G, F), b (G,), y (N, G).
"""linear (fully connected) kernels: the register-blocked GEMM of ``pc_gemm.h`` (``gemm=True``:
the default where ``GEMM_PREFERRED``: the AVX-512 and AVX2 levels) or sgemm on blocks, one block
per thread; a layer with at most NARROW_MAX_G outputs (a classifier head) on the narrow kernels
of ``pc_dense.h`` instead, which stream x once.

The own GEMM splits C into fixed blocks handed out dynamically (a thread whose core is shared
takes fewer); every element of C sums its products in an order fixed by the shape alone, so it
gives the same bits at every thread count. It applies the bias and a following ReLU as it
stores (``relu=True``), and the backward of such a fused layer masks dy once (``y=``), summing
db in the same pass. ``gemm_linear_forward`` is its forward on checked ndarrays instead of typed
memoryviews (whose setup is a fair part of a layer's time at batch 1).

Each product is one column-major sgemm (a row-major (r, c) array is a
column-major (c, r) one) whose *output* is split into contiguous blocks of
rows or columns, one per thread. No two threads write the same element and
no block sums partial products of another, so dw needs no reduction and the
result does not depend on the thread count beyond BLAS kernel edge effects.

The caller limits the BLAS library to one thread around these calls.
"""

from cython.parallel cimport prange

from numpy import ndarray

from .pc_helpers cimport (PC_BLOCKS_PER_THREAD, pc_cap, pc_get_team_limit, pc_set_team_limit,
    pc_work, pc_work_get, pc_product_ns, pc_macs_ns, pc_conv_ns, pc_elems_ns, pc_get_region_ns, pc_set_region_ns)
from scipy.linalg.cython_blas cimport sgemm, sgemv

cdef extern from "pc_dense.h":
    int PCD_NARROW_G, PCD_BWD_FB
    void pcd_linear_fwd_rows(const float *x, const float *w, const float *b, float *y,
                             Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t F, int G) noexcept nogil
    void pcd_linear_bwd_cols(const float *x, const float *w, const float *dy, float *dx, float *dw,
                             Py_ssize_t N, Py_ssize_t F, int G, Py_ssize_t f0, Py_ssize_t f1,
                             int fb) noexcept nogil
    float pcd_bias_grad(const float *dy, Py_ssize_t N, int G, int g) noexcept nogil

cdef extern from "pc_gemm.h":
    int PCG_PREFERRED, PCG_BACKWARD_MIN_ROWS, PCG_MASK_GB
    void pcg_nt(const float *a, Py_ssize_t lda, const float *b, Py_ssize_t ldb, const float *bias, int relu,
                float *c, Py_ssize_t ldc, Py_ssize_t K, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0,
                Py_ssize_t j1) noexcept nogil
    void pcg_nn(const float *a, Py_ssize_t rsa, Py_ssize_t csa, const float *b, Py_ssize_t ldb, float *c,
                Py_ssize_t ldc, Py_ssize_t K, Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0,
                Py_ssize_t j1) noexcept nogil
    bint pcg_nt_transposed(Py_ssize_t M, Py_ssize_t N) noexcept nogil
    Py_ssize_t pcg_t_ld(Py_ssize_t M) noexcept nogil
    void pcg_transpose(const float *x, Py_ssize_t ldx, Py_ssize_t N, float *xt, Py_ssize_t ldt, Py_ssize_t k0,
                       Py_ssize_t k1) noexcept nogil
    void pcg_nnt(const float *w, Py_ssize_t F, const float *xt, Py_ssize_t ldt, const float *bias, int relu,
                 float *y, Py_ssize_t ldy, Py_ssize_t g0, Py_ssize_t g1, Py_ssize_t n0, Py_ssize_t n1) noexcept nogil
    void pcg_relu_mask_db(const float *dy, const float *y, float *dym, float *db, Py_ssize_t N, Py_ssize_t G,
                          Py_ssize_t g0, Py_ssize_t g1) noexcept nogil

# ndarray checks and data pointers without a typed memoryview: a memoryview costs a buffer acquisition
# and an object per array on every call, a fair part of a batch-1 layer's time
cdef extern from *:
    """
    #include <numpy/arrayobject.h>
    /* a: an ndarray (checked by the caller: PyArray_Check needs NumPy's C-API table) */
    static inline int pcd_f32_matrix(PyObject *a, Py_ssize_t rows, Py_ssize_t cols)
    {
        PyArrayObject *arr = (PyArrayObject *)a;
        if (PyArray_TYPE(arr) != NPY_FLOAT32 || !PyArray_IS_C_CONTIGUOUS(arr)) return 0;
        if (cols < 0) return PyArray_NDIM(arr) == 1 && PyArray_DIMS(arr)[0] == rows;
        return PyArray_NDIM(arr) == 2 && PyArray_DIMS(arr)[0] == rows && PyArray_DIMS(arr)[1] == cols;
    }
    static inline int pcd_writeable(PyObject *a) { return PyArray_ISWRITEABLE((PyArrayObject *)a); }
    static inline void *pcd_data(PyObject *a) { return PyArray_DATA((PyArrayObject *)a); }
    static inline Py_ssize_t pcd_dim(PyObject *a, int i) { return PyArray_DIMS((PyArrayObject *)a)[i]; }
    static inline int pcd_ndim(PyObject *a) { return PyArray_NDIM((PyArrayObject *)a); }
    """
    bint pcd_f32_matrix(object a, Py_ssize_t rows, Py_ssize_t cols)
    bint pcd_writeable(object a)
    void *pcd_data(object a)
    Py_ssize_t pcd_dim(object a, int i)
    int pcd_ndim(object a)


cdef enum:
    # blocks of C the own GEMM hands out: rows x columns (multiples of every level's tiles)
    GEMM_BM = 64
    GEMM_NT_BN = 32
    GEMM_NN_BN = 64
    # multiply-adds below which one thread beats waking a team
    SERIAL_BELOW_MACS = 1 << 20
    # the narrowest block of C's columns (rows) a parallel sgemm hands out: narrower ones repack A
    DENSE_MIN_BLOCK = 64
    # runs of rows (forward) or of column blocks (backward) per thread in the narrow kernels,
    # handed out dynamically
    NARROW_RUNS_PER_THREAD = 4
    # the same for the backward without dx (a fused first layer's head: dw alone): one run per
    # thread, each thread's columns one contiguous range. Where a thread's blocks interleave with
    # the other's, both cores prefetch into each other's rows
    NARROW_DW_RUNS_PER_THREAD = 1

cdef int _dw_runs = NARROW_DW_RUNS_PER_THREAD
# the own GEMM's forward runs on one thread below this many multiply-adds (see _set_gemm_serial_below)
cdef double _gemm_serial_below = SERIAL_BELOW_MACS


def _set_gemm_serial_below(double macs):
    """Set the multiply-adds below which the own GEMM's forward runs on one thread (tuning); returns
    the old value."""
    global _gemm_serial_below
    if not macs >= 0:
        raise ValueError(f"macs must be >= 0, got {macs}")
    old = _gemm_serial_below
    _gemm_serial_below = macs
    return old


def _set_narrow_dw_runs_per_thread(int n):
    """Set the runs of column blocks per thread of the narrow backward without dx (tuning); returns the old value."""
    global _dw_runs
    if n < 1:
        raise ValueError(f"runs per thread must be >= 1, got {n}")
    old = _dw_runs
    _dw_runs = n
    return old


#: the narrow kernels (pc_dense.h) take layers with at most this many outputs
NARROW_MAX_G = PCD_NARROW_G

#: whether this ISA level's own GEMM (pc_gemm.h) beats the BLAS sgemm on linear layers
GEMM_PREFERRED = bool(PCG_PREFERRED)
#: the smallest batch whose linear backward the own GEMM takes where GEMM_PREFERRED
GEMM_BACKWARD_MIN_ROWS = PCG_BACKWARD_MIN_ROWS


def gemm_scratch_shape(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K):
    """Shape of the float32 scratch ``gemm_nt`` (and the own-GEMM ``linear_forward``) takes for a
    product ``(M x K) @ (N x K)^T``, or None where it needs none."""
    return (K, pcg_t_ld(M)) if pcg_nt_transposed(M, N) else None


cdef void _gemm_nt(const float *a, const float *b, const float *bias, int relu, float *c,
                   Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int num_threads, float *xt) noexcept nogil:
    """Row-major ``C (M x N) = act(A (M x K) @ B (N x K)^T + bias)`` over fixed blocks of C; ``xt``: the
    scratch of ``gemm_scratch_shape`` where it has one."""
    cdef Py_ssize_t bm = GEMM_BM, bn = GEMM_NT_BN
    cdef Py_ssize_t mb = (M + bm - 1) // bm, nbn = (N + bn - 1) // bn, t, i0, j0, ldt, kb
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef double work
    if <double>M * N * K < _gemm_serial_below:
        nt = 1
    if pcg_nt_transposed(M, N):
        # C^T = B A^T in the broadcast form: A transposed once (rows of xt in blocks of 64),
        # then blocks of GEMM_BM outputs x GEMM_NT_BN rows of the batch
        ldt = pcg_t_ld(M)
        kb = (K + 63) // 64
        # the transposition is a region of its own: its team follows its own work
        work = pc_work_get()
        pc_work(pc_elems_ns(<double>M * K))
        for t in prange(kb, schedule="dynamic", num_threads=pc_cap(_team(nt, <int>min(kb, <Py_ssize_t>1 << 30)))):
            pcg_transpose(a, K, M, xt, ldt, t * 64, min(K, t * 64 + 64))
        pc_work(work)
        mb = (N + bm - 1) // bm
        nbn = (M + bn - 1) // bn
        for t in prange(mb * nbn, schedule="dynamic", num_threads=pc_cap(_team(nt, <int>min(mb * nbn, <Py_ssize_t>1 << 30)))):
            i0 = (t % mb) * bm
            j0 = (t // mb) * bn
            pcg_nnt(b, K, xt, ldt, bias, relu, c, N, i0, min(N, i0 + bm), j0, min(M, j0 + bn))
        return
    nt = _team(nt, <int>min(mb * nbn, <Py_ssize_t>1 << 30))
    # row blocks inner: threads that start together share a panel of B
    for t in prange(mb * nbn, schedule="dynamic", num_threads=pc_cap(nt)):
        i0 = (t % mb) * bm
        j0 = (t // mb) * bn
        pcg_nt(a, K, b, K, bias, relu, c, N, K, i0, min(M, i0 + bm), j0, min(N, j0 + bn))


cdef void _gemm_nn(const float *a, Py_ssize_t rsa, Py_ssize_t csa, const float *b, float *c,
                   Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int num_threads) noexcept nogil:
    """Row-major ``C (M x N) = A @ B (K x N)``, ``A[i, k] = a[i*rsa + k*csa]``, over fixed blocks of C."""
    cdef Py_ssize_t bm = GEMM_BM, bn = GEMM_NN_BN
    cdef Py_ssize_t mb = (M + bm - 1) // bm, nbn = (N + bn - 1) // bn, t, i0, j0
    cdef int nt = num_threads if num_threads > 0 else 1
    if <double>M * N * K < SERIAL_BELOW_MACS:
        nt = 1
    nt = _team(nt, <int>min(mb * nbn, <Py_ssize_t>1 << 30))
    for t in prange(mb * nbn, schedule="dynamic", num_threads=pc_cap(nt)):
        i0 = (t % mb) * bm
        j0 = (t // mb) * bn
        pcg_nn(a, rsa, csa, b, N, c, N, K, i0, min(M, i0 + bm), j0, min(N, j0 + bn))


cdef float *_scratch(object arr, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, list keep) except? NULL:
    """The data of ``arr`` (a C-contiguous float32 array of ``gemm_scratch_shape(M, N, K)``, or None: a new
    one, held in ``keep``), or NULL where the product needs no scratch."""
    cdef float[:, ::1] buf
    shape = gemm_scratch_shape(M, N, K)
    if shape is None:
        return NULL
    if arr is None:
        import numpy as np
        arr = np.empty(shape, dtype=np.float32)
    buf = arr
    if (buf.shape[0], buf.shape[1]) != shape:
        raise ValueError(f"the GEMM scratch must have shape {shape}, got {(buf.shape[0], buf.shape[1])}")
    keep.append(arr)
    return &buf[0, 0]


def gemm_linear_forward(x, w, b, y, int num_threads, bint relu, scratch):
    """``y = x @ w.T + b`` (then ``max(y, 0)`` where ``relu``) on the own GEMM: ``linear_forward(...,
    gemm=True)`` with ndarray checks instead of memoryviews (the cost that matters at batch 1).
    x (N, F), w (G, F), b (G,) or None, y (N, G): C-contiguous float32 ndarrays; scratch as
    ``gemm_scratch_shape(N, G, F)`` or None."""
    if not (isinstance(x, ndarray) and isinstance(w, ndarray) and isinstance(y, ndarray)
            and (b is None or isinstance(b, ndarray)) and (scratch is None or isinstance(scratch, ndarray))):
        raise TypeError("gemm_linear_forward: x, w, y (and b, scratch unless None) must be NumPy arrays")
    if pcd_ndim(x) != 2 or pcd_ndim(w) != 2:
        raise ValueError("gemm_linear_forward: x and w must be 2-D")
    cdef Py_ssize_t N = pcd_dim(x, 0), F = pcd_dim(x, 1), G = pcd_dim(w, 0)
    if not (pcd_f32_matrix(x, N, F) and pcd_f32_matrix(w, G, F) and pcd_f32_matrix(y, N, G) and pcd_writeable(y)
            and (b is None or pcd_f32_matrix(b, G, -1))):
        raise ValueError(f"gemm_linear_forward: expected C-contiguous float32 x (N, F), w (G, F) with the same "
                         f"F, b (G,) or None and a writeable y (N, G)")
    if N == 0 or G == 0:
        return
    if F == 0:
        raise ValueError("gemm_linear_forward: x must have at least one feature")
    cdef const float *bp = NULL if b is None else <const float *>pcd_data(b)
    cdef float *xt = NULL
    cdef Py_ssize_t ldt
    if pcg_nt_transposed(N, G):
        ldt = pcg_t_ld(N)
        if scratch is None or not (pcd_f32_matrix(scratch, F, ldt) and pcd_writeable(scratch)):
            raise ValueError(f"gemm_linear_forward: scratch must be a writeable float32 array of shape {(F, ldt)}")
        xt = <float *>pcd_data(scratch)
    cdef const float *xp = <const float *>pcd_data(x)
    cdef const float *wp = <const float *>pcd_data(w)
    cdef float *yp = <float *>pcd_data(y)
    pc_work(pc_product_ns(N, G, F))
    with nogil:
        _gemm_nt(xp, wp, bp, relu, yp, N, G, F, num_threads, xt)


_np_empty = None


def gemm_linear(x, w, b, int num_threads, bint relu, Py_ssize_t narrow_min_features):
    """The new ``y = x @ w.T + b`` (then ``max(y, 0)`` where ``relu``) on the own GEMM in one call, or
    None where this entry does not take the product and the caller's general path must: x, w (and
    b) not C-contiguous float32 ndarrays of shapes (N, F), (G, F) (and (G,)) with N, F, G > 0, a
    batch large enough for the transposed form (whose scratch comes from the caller's pool), or a
    narrow layer (G <= NARROW_MAX_G and F >= ``narrow_min_features``; pass -1 for none).

    Everything the kernel relies on is checked here, so a None costs the caller nothing but its
    own conversions; the answer is the bits of ``gemm_linear_forward``."""
    global _np_empty
    if not (isinstance(x, ndarray) and isinstance(w, ndarray) and (b is None or isinstance(b, ndarray))):
        return None
    if pcd_ndim(x) != 2 or pcd_ndim(w) != 2:
        return None
    cdef Py_ssize_t N = pcd_dim(x, 0), F = pcd_dim(x, 1), G = pcd_dim(w, 0)
    if N <= 0 or F <= 0 or G <= 0 or pcg_nt_transposed(N, G):
        return None
    if narrow_min_features >= 0 and G <= PCD_NARROW_G and F >= narrow_min_features:
        return None
    if not (pcd_f32_matrix(x, N, F) and pcd_f32_matrix(w, G, F) and (b is None or pcd_f32_matrix(b, G, -1))):
        return None
    if _np_empty is None:
        import numpy as np
        _np_empty = (np.empty, np.float32)
    y = _np_empty[0]((N, G), _np_empty[1])
    cdef const float *bp = NULL if b is None else <const float *>pcd_data(b)
    cdef const float *xp = <const float *>pcd_data(x)
    cdef const float *wp = <const float *>pcd_data(w)
    cdef float *yp = <float *>pcd_data(y)
    pc_work(pc_product_ns(N, G, F))
    with nogil:
        _gemm_nt(xp, wp, bp, relu, yp, N, G, F, num_threads, NULL)
    return y


def gemm_nt(const float[:, ::1] a, const float[:, ::1] b, const float[::1] bias, float[:, ::1] c, bint relu,
            int num_threads):
    """``c = a @ b.T + bias`` (bias may be None), then ``max(c, 0)`` where ``relu``; a (M, K), b (N, K),
    c (M, N) overwritten. The own GEMM of every ISA level (tests and tuning)."""
    cdef Py_ssize_t M = a.shape[0], K = a.shape[1], N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"gemm_nt: b must have a's {K} columns, got shape {(b.shape[0], b.shape[1])}")
    if c.shape[0] != M or c.shape[1] != N:
        raise ValueError(f"gemm_nt: c must have shape {(M, N)}, got {(c.shape[0], c.shape[1])}")
    if bias is not None and bias.shape[0] != N:
        raise ValueError(f"gemm_nt: bias must have {N} elements, got {bias.shape[0]}")
    if M == 0 or N == 0:
        return
    if K == 0:
        raise ValueError("gemm_nt: the inner dimension must be at least 1")
    cdef const float *bp = NULL
    cdef list keep = []
    cdef float *xt = _scratch(None, M, N, K, keep)
    if bias is not None:
        bp = &bias[0]
    pc_work(pc_product_ns(M, N, K))
    with nogil:
        _gemm_nt(&a[0, 0], &b[0, 0], bp, relu, &c[0, 0], M, N, K, num_threads, xt)


def gemm_nn(const float[:, ::1] a, const float[:, ::1] b, float[:, ::1] c, bint trans_a, int num_threads):
    """``c = a @ b`` (``a.T @ b`` where ``trans_a``); c overwritten. The own GEMM (tests and tuning)."""
    cdef Py_ssize_t M = a.shape[1] if trans_a else a.shape[0], K = a.shape[0] if trans_a else a.shape[1]
    cdef Py_ssize_t N = b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"gemm_nn: b must have {K} rows, got shape {(b.shape[0], b.shape[1])}")
    if c.shape[0] != M or c.shape[1] != N:
        raise ValueError(f"gemm_nn: c must have shape {(M, N)}, got {(c.shape[0], c.shape[1])}")
    if M == 0 or N == 0:
        return
    if K == 0:
        raise ValueError("gemm_nn: the inner dimension must be at least 1")
    pc_work(pc_product_ns(M, N, K))
    with nogil:
        if trans_a:
            _gemm_nn(&a[0, 0], 1, M, &b[0, 0], &c[0, 0], M, N, K, num_threads)
        else:
            _gemm_nn(&a[0, 0], K, 1, &b[0, 0], &c[0, 0], M, N, K, num_threads)


cdef inline int _team(int nt, int extent) noexcept nogil:
    """Threads for ``extent`` blocks: ``nt`` clamped to [1, extent]."""
    if nt > extent:
        nt = extent
    return nt if nt > 0 else 1


cdef inline int _nblocks(int extent, int nt) noexcept nogil:
    """Blocks of C's columns (or rows) for nt threads: a few per thread, handed out as threads come
    free, each at least DENSE_MIN_BLOCK wide; fixed by the shape and nt, so the bits are too."""
    cdef long nb
    if nt <= 1:
        return 1
    nb = min(<long>nt * PC_BLOCKS_PER_THREAD, max(<long>nt, extent // DENSE_MIN_BLOCK))
    return <int>min(nb, <long>extent)


cdef inline int _block(int extent, int nt, int i, int *s0) noexcept nogil:
    """Start (in s0) and length of thread i's contiguous block of ``extent`` items split nt ways."""
    s0[0] = <int>((<long>extent * i) // nt)
    return <int>((<long>extent * (i + 1)) // nt) - s0[0]


cdef void _par_sgemm(char ta, char tb, int m, int n, int k, const float *A, int lda,
                     const float *B, int ldb, float *C, int ldc, int num_threads) noexcept nogil:
    """Column-major ``C (m x n) = op(A) @ op(B)``, C's columns (or rows) split over threads."""
    cdef float one = 1.0, zero = 0.0
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef bint by_cols = n >= m
    cdef int extent = n if by_cols else m
    cdef int i, s0, cnt, nb
    cdef const float *a
    cdef const float *b
    cdef float *c
    if <double>m * n * k < SERIAL_BELOW_MACS:
        nt = 1
    if n == 1 or m == 1:
        # a matrix-vector product (batch 1): sgemm would pack the whole matrix for one column
        _par_sgemv(ta, tb, m, n, k, A, lda, B, ldb, C, ldc, nt)
        return
    if k == 1:
        # an outer product (the weight gradient at batch 1): no packing, one pass over C
        _par_outer(m, n, A, 1 if ta == b'N' else lda, B, ldb if tb == b'N' else 1, C, ldc, nt)
        return
    nt = _team(nt, extent)
    nb = _nblocks(extent, nt)
    for i in prange(nb, schedule="dynamic", num_threads=pc_cap(nt)):
        cnt = _block(extent, nb, i, &s0)
        if cnt <= 0:
            continue
        if by_cols:
            # columns s0..s1 of op(B) and of C
            b = B + (<Py_ssize_t>s0 * ldb if tb == b'N' else s0)
            c = C + <Py_ssize_t>s0 * ldc
            sgemm(&ta, &tb, &m, &cnt, &k, &one, <float *>A, &lda, <float *>b, &ldb, &zero, c, &ldc)
        else:
            # rows s0..s1 of op(A) and of C
            a = A + (s0 if ta == b'N' else <Py_ssize_t>s0 * lda)
            c = C + s0
            sgemm(&ta, &tb, &cnt, &n, &k, &one, <float *>a, &lda, <float *>B, &ldb, &zero, c, &ldc)


cdef void _par_sgemv(char ta, char tb, int m, int n, int k, const float *A, int lda,
                     const float *B, int ldb, float *C, int ldc, int nt) noexcept nogil:
    """``_par_sgemm`` where C is one column (n == 1) or one row (m == 1), as sgemv on each
    thread's block of C's elements."""
    cdef float one = 1.0, zero = 0.0
    cdef char tr
    cdef int i, s0, cnt, nb, rows, inc, incy, extent = m if n == 1 else n
    cdef const float *mat
    cdef const float *vec
    cdef int ld
    if n == 1:
        # C (m) = op(A) (m x k) @ op(B) (k); A is stored m x k ('N') or k x m ('T')
        mat, ld, tr, rows = A, lda, ta, (m if ta == b'N' else k)
        vec, inc, incy = B, (1 if tb == b'N' else ldb), 1
    else:
        # C^T (n) = op(B)^T (n x k) @ op(A)^T (k); B is stored k x n ('N') or n x k ('T')
        mat, ld, tr, rows = B, ldb, (b'T' if tb == b'N' else b'N'), (k if tb == b'N' else n)
        vec, inc, incy = A, (lda if ta == b'N' else 1), ldc
    nt = _team(nt, extent)
    nb = _nblocks(extent, nt)
    for i in prange(nb, schedule="dynamic", num_threads=pc_cap(nt)):
        cnt = _block(extent, nb, i, &s0)
        if cnt <= 0:
            continue
        if tr == b'N':  # this thread's rows of the stored matrix
            sgemv(&tr, &cnt, &k, &one, <float *>(mat + s0), &ld, <float *>vec, &inc, &zero,
                  C + <Py_ssize_t>s0 * incy, &incy)
        else:  # this thread's columns of the stored matrix
            sgemv(&tr, &rows, &cnt, &one, <float *>(mat + <Py_ssize_t>s0 * ld), &ld, <float *>vec, &inc,
                  &zero, C + <Py_ssize_t>s0 * incy, &incy)


cdef void _par_outer(int m, int n, const float *a, int inca, const float *b, int incb,
                     float *C, int ldc, int nt) noexcept nogil:
    """Column-major ``C (m x n) = a b^T``, C's columns split over threads."""
    cdef int i, j
    cdef float bj
    cdef float *c
    nt = _team(nt, n)
    for j in prange(n, schedule="guided", num_threads=pc_cap(nt)):
        bj = b[<Py_ssize_t>j * incb]
        c = C + <Py_ssize_t>j * ldc
        if inca == 1:
            for i in range(m):
                c[i] = a[i] * bj
        else:
            for i in range(m):
                c[i] = a[<Py_ssize_t>i * inca] * bj


def linear_forward(const float[:, ::1] x,  # IN  (N, F)
                   const float[:, ::1] w,  # IN  (G, F)
                   const float[::1] b,     # IN  (G,) or None
                   float[:, ::1] y,        # OUT (N, G), overwritten
                   int num_threads,
                   bint narrow=False,
                   bint relu=False,
                   bint gemm=False,
                   scratch=None):              # float32 (gemm_scratch_shape(N, G, F)) or None
    """``y = x @ w.T + b``, then ``max(y, 0)`` where ``relu``; ``narrow`` (G <= NARROW_MAX_G) streams
    x once, ``gemm`` runs the own GEMM (bias and ReLU applied as it stores), else sgemm and one
    pass adding the bias and applying the ReLU."""
    cdef int N = x.shape[0], F = x.shape[1], G = w.shape[0]
    cdef float *yp = &y[0, 0]
    cdef const float *bp = NULL
    cdef Py_ssize_t r, j, npairs, nrun, t
    cdef float v
    cdef int nt = num_threads if num_threads > 0 else 1
    pc_work(pc_product_ns(N, G, F))
    if b is not None:
        bp = &b[0]
    if narrow and relu:
        raise ValueError("linear_forward: the narrow kernels apply no ReLU (apply it after)")
    cdef list keep = []
    cdef float *xt
    if gemm:
        xt = _scratch(scratch, N, G, F, keep)
        with nogil:
            _gemm_nt(&x[0, 0], &w[0, 0], bp, relu, yp, N, G, F, num_threads, xt)
        return
    if narrow:
        if G > PCD_NARROW_G:
            raise ValueError(f"narrow linear_forward takes at most {PCD_NARROW_G} outputs, got {G}")
        if <double>N * F * G < SERIAL_BELOW_MACS:
            nt = 1
        npairs = (N + 1) // 2
        if nt > npairs:
            nt = <int>npairs
        # runs of row pairs, a few per thread, handed out dynamically; a run's rows pass over w
        # four at a time, but every row is summed alone, so any split gives the same bits
        nrun = 1 if nt == 1 else min(npairs, <Py_ssize_t>NARROW_RUNS_PER_THREAD * nt)
        with nogil:
            for t in prange(nrun, schedule="dynamic", num_threads=pc_cap(nt)):
                pcd_linear_fwd_rows(&x[0, 0], &w[0, 0], bp, yp, 2 * ((npairs * t) // nrun),
                                    min(N, 2 * ((npairs * (t + 1)) // nrun)), F, G)
        return
    with nogil:
        # y^T (G x N) = w (G x F, stored as F x G: 'T') @ x^T (F x N)
        _par_sgemm(b'T', b'N', G, N, F, &w[0, 0], F, &x[0, 0], F, yp, G, num_threads)
        if bp != NULL or relu:
            if <Py_ssize_t>N * G < 32768:
                nt = 1
            for r in prange(N, schedule="guided", num_threads=pc_cap(nt)):
                for j in range(G):
                    v = yp[r * G + j] + (bp[j] if bp != NULL else 0.0)
                    yp[r * G + j] = 0.0 if relu and v < 0.0 else v


def linear_backward(const float[:, ::1] x,   # IN  (N, F)
                    const float[:, ::1] w,   # IN  (G, F)
                    const float[:, ::1] dy,  # IN  (N, G)
                    float[:, ::1] dx,        # OUT (N, F) or None, overwritten
                    float[:, ::1] dw,        # OUT (G, F), overwritten
                    float[::1] db,           # OUT (G,) or None, overwritten
                    int num_threads,
                    bint narrow=False,
                    const float[:, ::1] y=None,  # IN (N, G): the output of a fused ReLU, or None
                    float[:, ::1] dym=None,      # SCRATCH (N, G) with y: dy masked by y > 0
                    bint gemm=False):
    """``dx = dy @ w``, ``dw = dy.T @ x``, ``db = dy.sum(0)`` (db summed in double).

    ``narrow`` (G <= NARROW_MAX_G): dx and dw in one pass over x, column blocks handed out to
    threads dynamically (each column sums its rows in order: the same bits on any thread).
    ``y``: the layer's output went through a ReLU (``linear_forward(relu=True)``); dy is masked
    by ``y > 0`` into ``dym`` in one pass that also sums db. ``gemm``: dx and dw on the own GEMM.
    """
    cdef int N = x.shape[0], F = x.shape[1], G = w.shape[0]
    cdef const float *dyp = &dy[0, 0]
    cdef float *dbp = NULL
    cdef float *dxp = NULL
    cdef int nt = num_threads if num_threads > 0 else 1
    cdef int g, fb
    cdef Py_ssize_t nblk, nrun, t
    cdef Py_ssize_t nmask
    cdef bint db_done = False
    pc_work(pc_product_ns(N, G, F) * (1 + (dx is not None)))
    if dx is not None:
        dxp = &dx[0, 0]
    if db is not None:
        dbp = &db[0]
    if y is not None:
        if dym is None or y.shape[0] != N or y.shape[1] != G or dym.shape[0] != N or dym.shape[1] != G:
            raise ValueError(f"linear_backward: y and dym must have dy's shape {(N, G)}")
        nmask = (G + PCG_MASK_GB - 1) // PCG_MASK_GB
        nt = num_threads if num_threads > 0 else 1
        if <Py_ssize_t>N * G < 32768:
            nt = 1
        pc_work(pc_elems_ns(<double>N * G))
        with nogil:
            for t in prange(nmask, schedule="dynamic", num_threads=pc_cap(_team(nt, <int>nmask))):
                pcg_relu_mask_db(&dy[0, 0], &y[0, 0], &dym[0, 0], dbp, N, G,
                                 t * PCG_MASK_GB, min(<Py_ssize_t>G, (t + 1) * PCG_MASK_GB))
        dyp = &dym[0, 0]
        db_done = True
        nt = num_threads if num_threads > 0 else 1
    if narrow:
        if G > PCD_NARROW_G:
            raise ValueError(f"narrow linear_backward takes at most {PCD_NARROW_G} outputs, got {G}")
        if <double>N * F * G < SERIAL_BELOW_MACS:
            nt = 1
        # column blocks of fb (a multiple of 16), at least one per thread where F allows
        fb = PCD_BWD_FB
        if <Py_ssize_t>fb * nt > F:
            fb = max(16, <int>(((F + nt - 1) // nt + 15) // 16 * 16))
        nblk = (F + fb - 1) // fb
        if nt > nblk:
            nt = <int>nblk
    # each product below takes N * F * G multiply-adds (the narrow pass makes dx and dw at once)
    pc_work(pc_product_ns(N, G, F) * (1 + (narrow and dxp != NULL)))
    if gemm and not narrow:
        with nogil:
            if dxp != NULL:
                # dx (N x F) = dy (N x G) @ w (G x F)
                _gemm_nn(dyp, G, 1, &w[0, 0], dxp, N, F, G, num_threads)
            # dw (G x F) = dy^T (G x N) @ x (N x F)
            _gemm_nn(dyp, 1, G, &x[0, 0], &dw[0, 0], G, F, N, num_threads)
    with nogil:
        if gemm and not narrow:
            pass
        elif narrow:
            # runs of column blocks, a few per thread, handed out dynamically (a thread whose core
            # is shared takes fewer); a run's blocks are adjacent, so each thread streams its dx rows
            nrun = 1 if nt == 1 else min(nblk, <Py_ssize_t>(_dw_runs if dxp == NULL else NARROW_RUNS_PER_THREAD) * nt)
            for t in prange(nrun, schedule="dynamic", num_threads=pc_cap(nt)):
                pcd_linear_bwd_cols(&x[0, 0], &w[0, 0], dyp, dxp, &dw[0, 0], N, F, G,
                                    min(F, fb * ((nblk * t) // nrun)), min(F, fb * ((nblk * (t + 1)) // nrun)), fb)
            nt = num_threads if num_threads > 0 else 1
        elif dxp != NULL:
            # dx^T (F x N) = w^T (F x G, stored so: 'N') @ dy^T (G x N)
            _par_sgemm(b'N', b'N', F, N, G, &w[0, 0], F, dyp, G, dxp, F, num_threads)
        if not narrow and not gemm:
            # dw^T (F x G) = x^T (F x N) @ dy (N x G, stored as G x N: 'T')
            _par_sgemm(b'N', b'T', F, G, N, &x[0, 0], F, dyp, G, &dw[0, 0], F, num_threads)
        if dbp != NULL and not db_done:
            pc_work(pc_elems_ns(<double>N * G))
            if <Py_ssize_t>N * G < 32768:
                nt = 1
            if nt > G:
                nt = G
            for g in prange(G, schedule="guided", num_threads=pc_cap(nt)):
                dbp[g] = pcd_bias_grad(dyp, N, G, g)


include "_team.pxi"
