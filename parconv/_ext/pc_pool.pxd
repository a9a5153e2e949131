# The pooling kernels of pc_pool.h, declared once for every .pyx that calls them (_pool, _conv).
# Shape legend as in pc_pool.h: H, W input plane, P, Q output, K (or KH x KW) window, S (SH, SW)
# stride, PH, PW padding; base holds each window's first flat input index (pc_pool_bases).

cdef extern from "pc_pool.h":
    int PC_POOL_U16_MAX
    void pc_pool_bases(int W, int S, int P, int Q, int *base) noexcept nogil
    void pc_pool_plane(const float *x, const int *base, int W, int K, int S, int P, int Q, float *y, int *am,
                       int relu) noexcept nogil
    void pc_pool_plane_u16(const float *x, const int *base, int W, int K, int S, int P, int Q, float *y,
                           unsigned short *am, int relu) noexcept nogil
    void pc_maxpool_general_plane(const float *x, int H, int W, int KH, int KW, int SH, int SW, int PH, int PW,
                                  int P, int Q, float *y, int *am) noexcept nogil
    void pc_avgpool_plane(const float *x, int H, int W, int KH, int KW, int SH, int SW, int PH, int PW,
                          int P, int Q, float *y) noexcept nogil
    void pc_avgpool_backward_plane(const float *dy, int H, int W, int KH, int KW, int SH, int SW, int PH, int PW,
                                   int P, int Q, float *dx) noexcept nogil
    void pc_adaptive_avgpool_plane(const float *x, int H, int W, int P, int Q, float *y) noexcept nogil
    void pc_adaptive_avgpool_backward_plane(const float *dy, int H, int W, int P, int Q, float *dx) noexcept nogil
