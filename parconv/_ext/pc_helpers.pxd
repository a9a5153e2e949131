# Inline helpers shared by the .pyx kernels (compiled into each module that cimports them).

cdef extern from "pc_common.h":
    # every parallel region's team: num_threads=pc_cap(n) (see pc_common.h and _team.pxi)
    int pc_cap(Py_ssize_t n) noexcept nogil
    void pc_set_team_limit(int n) noexcept nogil
    int pc_get_team_limit() noexcept nogil
    # the running call's estimated one-thread ns, which sizes its regions' teams (set by every threaded entry)
    void pc_work(double ns) noexcept nogil
    double pc_work_get() noexcept nogil
    double pc_macs_ns(double macs) noexcept nogil  # on the own GEMM
    double pc_conv_ns(double macs) noexcept nogil  # in a convolution kernel
    double pc_elems_ns(double elems) noexcept nogil
    double pc_update_ns(double elems) noexcept nogil  # an optimizer's pass over parameters and state
    double pc_product_ns(double M, double N, double K) noexcept nogil  # (M x K) @ (K x N) on the own GEMM
    void pc_set_region_ns(double ns) noexcept nogil
    double pc_get_region_ns() noexcept nogil
    ctypedef struct pc_sync:
        pass
    void pc_sync_init(pc_sync *s) noexcept nogil  # before the region (see pc_common.h)
    void pc_sync_wait(pc_sync *s) noexcept nogil  # between two pranges of one parallel block
    bint pc_sync_first() noexcept nogil  # thread 0: a serial step between two pc_sync_wait
    ctypedef struct pc_gate:
        pass
    void pc_gate_init(pc_gate *g) noexcept nogil  # before the region (see pc_common.h)
    int pc_gate_take(pc_gate *g) noexcept nogil  # the next first-phase item's index
    void pc_gate_done(pc_gate *g, int n) noexcept nogil  # one of the n first-phase items is done
    void pc_gate_wait(pc_gate *g, int n) noexcept nogil  # until all n are

cdef enum:
    # below this much work (multiply-adds or elements touched) one thread is faster than waking a team
    PC_SERIAL_BELOW_WORK = 32768


cdef inline int pc_threads_for(Py_ssize_t work, Py_ssize_t chunks, int num_threads) noexcept nogil:
    """Threads for ``work`` split into ``chunks``: one below PC_SERIAL_BELOW_WORK, never more than chunks."""
    cdef Py_ssize_t nt = num_threads if num_threads > 0 else 1
    if work < PC_SERIAL_BELOW_WORK:
        return 1
    if nt > chunks:
        nt = chunks
    return <int>(nt if nt > 0 else 1)


cdef inline double pc_sum_lanes(const float *v, Py_ssize_t n) noexcept nogil:
    """Sum of n contiguous floats in double, four lanes added in a fixed order (reproducible)."""
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    cdef Py_ssize_t d = 0
    while d + 4 <= n:
        s0 += v[d]
        s1 += v[d + 1]
        s2 += v[d + 2]
        s3 += v[d + 3]
        d += 4
    while d < n:
        s0 += v[d]
        d += 1
    return (s0 + s1) + (s2 + s3)


cdef enum:
    # blocks per thread of a loop over independent pieces, handed out dynamically: a thread whose
    # core another process takes holds up one small block, not a 1/nt share of the loop
    PC_BLOCKS_PER_THREAD = 4


cdef inline int pc_team(Py_ssize_t blocks, int num_threads) noexcept nogil:
    """Threads for a loop over ``blocks`` blocks: ``num_threads`` clamped to [1, blocks]."""
    cdef Py_ssize_t nt = num_threads if num_threads > 0 else 1
    if nt > blocks:
        nt = blocks
    return <int>(nt if nt > 0 else 1)
