# The C kernels of the _conv module (its .pyx and the .pxi files it includes), declared once.
# Shape legend as in _conv.pyx; each header's top comment describes its kernels.


cdef extern from "pc_common.h":
    void pc_im2col(const float *x, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *cols, Py_ssize_t ld) noexcept nogil
    void pc_col2im(const float *dcols, int H, int W, int K, int S, int pad, int Q,
                   int c0, int c1, int p0, int p1, float *dx) noexcept nogil
    double pc_sum_f32(const float *p, Py_ssize_t n) noexcept nogil
    void *pc_align64(void *p) noexcept nogil

cdef extern from "pc_conv.h":
    int PCC_NR, PCC_VEC, PCC_NVMAX, PCC_MR_MAX, PCC_KR_MAX
    const char *PCC_ISA
    int pcc_main_mr(int nv) noexcept nogil
    void pcc_flip_filters(const float *w, int O, int C, int K, int c0, int c1, float *wt) noexcept nogil
    void pcc_pad_image(const float *x, int H, int W, int pad, int Hp, int Wp, int c0, int c1,
                       float *xp) noexcept nogil
    void pcc_offsets_shifted(int C, int K, int Hp, int Wp, int *off) noexcept nogil
    void pcc_offsets_tile(int kdim, int ldb, int *off) noexcept nogil
    void pcc_pad_grid(const float *x, int H, int W, int pad, int S, int Hg, int Wg, int c0, int c1,
                      float *buf) noexcept nogil
    void pcc_offsets_grid(int C, int K, int S, int Hg, int Wg, int *off) noexcept nogil
    void pcc_conv_panels(const float *a, int O, int kdim, int mr0, int nv, const float *b, const int *off,
                         Py_ssize_t s_begin, Py_ssize_t s_end, int Wg, int Q, float *y, Py_ssize_t ldy,
                         const float *bias, const float *scale, int relu, float *ct) noexcept nogil
    void pcc_conv_rows(const float *a, int O, int kdim, int mr0, int nv, const float *b, const int *off,
                       int p_begin, int p_end, int Wg, int Q, float *y, Py_ssize_t ldy,
                       const float *bias, const float *scale, int relu, float *ct) noexcept nogil
    void pcc_dw_accumulate(const float *dyT, Py_ssize_t ldd, const float *b, const int *off,
                           int k_begin, int k_end, Py_ssize_t S, float *dwT) noexcept nogil
    void pcc_dy_transposed(const float *dy, int O, int P, int Q, int Wg, Py_ssize_t ldd,
                           float *dyT) noexcept nogil
    void pcc_dw_untranspose(const float *dwT, Py_ssize_t ldd, int O, int kdim, float *dw) noexcept nogil
    int pcc_dwdot_choose(int O, int kdim, int *mr, int *nj) noexcept nogil
    void pcc_dwdot_accumulate(int variant, const float *dyw, Py_ssize_t lds, int O, const float *b,
                              const int *off, int kdim, Py_ssize_t S, float *dw) noexcept nogil
    void pcc_dy_wide(const float *dy, int O, int O_pad, int P, int Q, int Wg, Py_ssize_t lds,
                     float *dyw) noexcept nogil


cdef extern from "pc_winograd.h":
    void *pcw_scratch_get(int slot, size_t nbytes) noexcept nogil
    void pcw_scratch_release(int slot, void *p) noexcept nogil
    void pcw_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch) noexcept nogil
    Py_ssize_t pcw_filter_scratch_floats(int C) noexcept nogil
    Py_ssize_t pcw_scratch_floats(int tW, int rb) noexcept nogil
    void pcw_input(const float *x, int C, int H, int W, int pad, int ty0, int ty1, int tW,
                   float *V, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw_output(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, int o0, int o1, int ty0, int ty1,
                    int tW, int P, int Q, const float *bias, const float *scale, int relu, float *y,
                    float *scratch) noexcept nogil
    void pcw_dy(const float *dy, int O, int P, int Q, int ty0, int ty1, int tW,
                float *dM, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch) noexcept nogil


cdef extern from "pc_winograd4.h":
    void pcw4_filters(const float *w, int O, int C, int o0, int o1, float *U, float *scratch) noexcept nogil
    Py_ssize_t pcw4_filter_scratch_floats(int C) noexcept nogil
    void pcw4_output(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, Py_ssize_t t0, int o0, int o1, int ty0,
                     int ty1, int tW, int P, int Q, const float *bias, const float *scale, int relu, float *y,
                     float *scratch) noexcept nogil
    Py_ssize_t pcw4_input_images_scratch_floats(int ipb, int tW, int rb) noexcept nogil
    void pcw4_input_images(const float *x, int n0, int n1, int C, int H, int W, int pad, int ty0, int ty1,
                           int tW, float *V, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    void pcw4_output_block(const float *M, Py_ssize_t ldx, Py_ssize_t ldt, int n0, int n1, int O, int o0,
                           int o1, int ty0, int ty1, int tW, int P, int Q, const float *bias,
                           const float *scale, int relu, float *y, float *scratch) noexcept nogil
    Py_ssize_t pcw4_dy_scratch_floats(int ipb, int tW, int rb) noexcept nogil
    void pcw4_dy_block(const float *dy, int n0, int n1, int O, int P, int Q, int ty0, int ty1, int tW,
                       float *dM, Py_ssize_t ldx, Py_ssize_t ldt, float *scratch) noexcept nogil
    Py_ssize_t pcw4_filters_grad_scratch_floats(int C) noexcept nogil
    void pcw4_filters_grad(const float *dU, int O, int C, int o0, int o1, float *dw, float *scratch) noexcept nogil
    void pcw4_dot_gemm(int O, int C, Py_ssize_t K, const float *A, Py_ssize_t lda, const float *B, Py_ssize_t ldb,
                       float *Cout, Py_ssize_t ldc, int beta) noexcept nogil


cdef extern from "pc_dense.h":
    int PCD_NARROW_G, PCD_BWD_FB
    void pcd_linear_fwd_rows4(const float *x, const float *w, const float *b, float *y,
                              const Py_ssize_t *rows, int nr, Py_ssize_t F, int G) noexcept nogil
    void pcd_linear_bwd_cols(const float *x, const float *w, const float *dy, float *dx, float *dw,
                             Py_ssize_t N, Py_ssize_t F, int G, Py_ssize_t f0, Py_ssize_t f1, int fb) noexcept nogil
    float pcd_bias_grad(const float *dy, Py_ssize_t N, int G, int g) noexcept nogil


cdef extern from "pc_fused.h":
    Py_ssize_t pcf_dw_scratch_floats(int C, int H, int W, int pad, int P, int Q, Py_ssize_t head_F) noexcept nogil
    void pcf_dw_images(const float *x, int C, int H, int W, int pad, int K, int P, int Q,
                       const float *y, const void *am, int am16, const float *dy, int O, int PQp, int n0, int n1,
                       const float *dyl, const float *wl, int G, double *acc, float *scratch) noexcept nogil
    void pcf_dw_reduce(const double *part, int nblocks, int O, Py_ssize_t kdim, float *dw, float *db) noexcept nogil
    Py_ssize_t pcf_dx_scratch_floats(int C, int H, int W, int pad, int P, int Q) noexcept nogil
    void pcf_dx(int n, int C, int H, int W, int pad, int K, int P, int Q, const float *w,
                const float *y, const void *am, int am16, const float *dy, int O, int PQp, float *dx,
                float *scratch) noexcept nogil
