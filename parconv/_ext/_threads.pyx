# Shape legend (shared by every kernel file in parconv/_ext): N batch,
# C in-channels, O out-channels, H, W input, P, Q output, K kernel,
# F in-features, G out-features. This module has no array kernels: it reports
# how the extension was built.
"""OpenMP build facts (openmp_enabled, omp_max_threads) and the BLAS thread-count hooks that limit
the BLAS library to one thread around the kernels' sgemm calls (blas_hooks, blas_limit_enter/exit),
and the probe of what starting a parallel region costs (region_start_ns)."""

from libc.stdlib cimport qsort
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef extern from "pc_common.h":
    int PARCONV_OPENMP
    int pc_omp_max_threads() noexcept nogil
    void pc_empty_region(int n, int *sink) noexcept nogil


def openmp_enabled():
    """Whether the kernels were compiled with OpenMP (the ``PARCONV_OPENMP`` macro from setup.py)."""
    return bool(PARCONV_OPENMP)


def omp_max_threads():
    """``omp_get_max_threads()`` of the OpenMP runtime, 1 in a serial build."""
    return int(pc_omp_max_threads())


cdef inline double _now_ns() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec * 1e9 + t.tv_nsec


cdef int _cmp_double(const void *a, const void *b) noexcept nogil:
    cdef double x = (<const double *>a)[0], y = (<const double *>b)[0]
    return (x > y) - (x < y)


def region_start_ns(int num_threads, int repeat=15, double gap_ns=20000.0):
    """Median ns an empty parallel region of ``num_threads`` threads takes, each started after
    ``gap_ns`` of one-thread work (as a kernel call follows the Python between two layers), so
    it counts what waking the idle threads and joining them costs under this process's wait
    policy. 0 with one thread or without OpenMP."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if not 1 <= repeat <= 1001:
        raise ValueError(f"repeat must be in [1, 1001], got {repeat}")
    if not 0 <= gap_ns <= 1e8:
        raise ValueError(f"gap_ns must be in [0, 1e8], got {gap_ns!r}")
    if num_threads == 1 or not PARCONV_OPENMP:
        return 0.0
    cdef double times[1001]
    cdef int sink[256]
    cdef int r, n = min(num_threads, 256)
    cdef double t0
    # with the GIL held: no other Python thread starts a kernel whose threads would slow the probe
    for r in range(repeat):
        t0 = _now_ns()
        while _now_ns() - t0 < gap_ns:
            pass
        t0 = _now_ns()
        pc_empty_region(n, sink)
        times[r] = _now_ns() - t0
    qsort(times, repeat, sizeof(double), _cmp_double)
    return times[repeat // 2]


# --- one-thread BLAS around the kernels that call sgemm ----------------------
# The OpenMP backend limits the BLAS to one thread while a kernel calls sgemm
# from inside its own parallel region. Through threadpoolctl that costs more per
# op than a small linear layer takes, so where the BLAS is OpenBLAS
# with its own pthreads pool the backend hands over the addresses of
# ``openblas_get_num_threads`` / ``openblas_set_num_threads`` and the limit is
# two C calls. Callers hold the GIL, which serialises the counter below.

ctypedef int (*_blas_get_fn)() noexcept nogil
ctypedef void (*_blas_set_fn)(int) noexcept nogil

cdef _blas_get_fn _blas_get = NULL
cdef _blas_set_fn _blas_set = NULL
cdef int _blas_depth = 0
cdef int _blas_saved = 1


def blas_hooks(size_t get_addr, size_t set_addr):
    """Install (or, with zeros, remove) the BLAS thread-count functions by address."""
    global _blas_get, _blas_set
    if _blas_depth != 0:
        raise RuntimeError("cannot change the BLAS hooks inside a limited section")
    if (get_addr == 0) != (set_addr == 0):
        raise ValueError("get_addr and set_addr must both be zero or both be set")
    _blas_get = <_blas_get_fn><void *>get_addr
    _blas_set = <_blas_set_fn><void *>set_addr


def blas_hooked():
    """Whether :func:`blas_hooks` installed the functions."""
    return _blas_get != NULL


def blas_limit_enter():
    """Limit the BLAS to one thread; nests, the outermost call saves the old count."""
    global _blas_depth, _blas_saved
    if _blas_get == NULL:
        raise RuntimeError("blas_hooks() was not called")
    if _blas_depth == 0:
        _blas_saved = _blas_get()
        if _blas_saved != 1:
            _blas_set(1)
    _blas_depth += 1


def blas_limit_exit():
    """Undo one :func:`blas_limit_enter`; the outermost restores the saved count."""
    global _blas_depth
    if _blas_depth <= 0:
        raise RuntimeError("blas_limit_exit() without blas_limit_enter()")
    _blas_depth -= 1
    if _blas_depth == 0 and _blas_saved != 1:
        _blas_set(_blas_saved)
