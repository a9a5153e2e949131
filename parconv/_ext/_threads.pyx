# Shape legend (shared by every kernel file in parconv/_ext): N batch,
# C in-channels, O out-channels, H, W input, P, Q output, K kernel,
# F in-features, G out-features. This module has no array kernels: it reports
# how the extension was built.
"""Build information of the OpenMP kernels."""

cdef extern from "pc_common.h":
    int PARCONV_OPENMP
    int pc_omp_max_threads() noexcept nogil


def openmp_enabled():
    """Whether the kernels were compiled with OpenMP (the ``PARCONV_OPENMP`` macro from setup.py)."""
    return bool(PARCONV_OPENMP)


def omp_max_threads():
    """``omp_get_max_threads()`` of the OpenMP runtime, 1 in a serial build."""
    return int(pc_omp_max_threads())
