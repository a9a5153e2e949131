/* Small C helpers shared by the Cython kernels in parconv/_ext.
 *
 * Shape legend: N batch, C in-channels, O out-channels, H, W input,
 * P, Q output, K kernel, F in-features, G out-features.
 *
 * The elementwise loops live here, not in Cython, so the compiler sees plain
 * pointer loops it can vectorise (`#pragma omp simd` where OpenMP is on,
 * -O3 auto-vectorisation otherwise). The setup.py flags keep IEEE semantics
 * (no -ffast-math, -ffp-contract=off), so every helper rounds exactly like
 * the NumPy reference that evaluates the same expression in float32.
 */
#ifndef PARCONV_PC_COMMON_H
#define PARCONV_PC_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef PARCONV_OPENMP
#define PARCONV_OPENMP 0
#endif

#if defined(_OPENMP)
#include <omp.h>
static inline int pc_omp_max_threads(void) { return omp_get_max_threads(); }
#define PC_SIMD _Pragma("omp simd")
#else
static inline int pc_omp_max_threads(void) { return 1; }
#define PC_SIMD
#endif

typedef ptrdiff_t pc_idx;

/* a * b + c with one rounding where the hardware has a fused multiply-add (x86 FMA3, AArch64),
 * else a product and a sum: without the instruction, fmaf is a libm call that emulates the
 * single rounding, far slower than the loop around it. The rounding then differs from build to
 * build, never between thread counts or between the code paths of one build. */
#if defined(__FMA__) || defined(__FP_FAST_FMAF) || defined(FP_FAST_FMAF) || defined(__ARM_FEATURE_FMA)
#define PC_FMAF(a, b, c) fmaf((a), (b), (c))
#else
#define PC_FMAF(a, b, c) ((a) * (b) + (c))
#endif

#define PC_COMMA ,

/* The most threads a parallel region of this module starts; 0: no cap. A region's split of its
 * work, and so every result's bits, comes from its thread-count argument alone: the cap only
 * shrinks the team that takes the chunks, so parconv can keep to the cores that other processes
 * leave free without changing an answer (parconv._config adapts it). Set with the GIL held. */
static int pc_team_limit = 0;

/* What starting a parallel region costs on this machine, in ns (parconv._config measures it: the
 * wake-up of sleeping threads and the join); 0: unknown. Set with the GIL held. */
static double pc_region_ns = 0;

/* The estimated one-thread time, in ns, of the kernel call running on this thread (pc_work): every
 * threaded kernel entry sets it before its first region; 0: unknown (the full team). A call whose
 * work would not pay for waking the team runs on fewer threads. */
#if defined(_MSC_VER)
static __declspec(thread) double pc_work_ns = 0;
#else
static __thread double pc_work_ns = 0;
#endif

/* A thread joins a region where its share is worth this many region starts: a region of W ns on
 * two threads takes about W/2 plus a start, and a start with work to share costs more than the
 * probe's empty one (the woken thread's caches are cold; each barrier inside costs another), so
 * two threads pay from a few starts of work on; the margin above that covers the estimates' error
 * (docs/performance-internals.md gives the measurements). */
#define PC_REGION_PAYBACK 2.0

/* Nominal one-thread rates of the kernels' inner loops, for pc_work's estimates: fp32
 * multiply-adds per ns of the own GEMM (two FMA pipes of this build's vector width at ~3 GHz:
 * it runs near that) and of a direct convolution (AVX-512: 0.6 of it, as its register blocks
 * keep the wide vectors less busy; AVX2: the GEMM's, which its narrower blocks reach; both set
 * against the direct forward kernels; layers with few channels run slower), and elements per ns
 * of a pass over cached arrays. A call whose estimate is too high pays wake-ups for one thread's
 * work, one too low leaves a core idle; they only decide the team, never the bits. */
#if defined(__AVX512F__)
#define PC_MACS_PER_NS 100.0
#define PC_CONV_MACS_PER_NS 60.0
#elif defined(__AVX2__)
#define PC_MACS_PER_NS 50.0
#define PC_CONV_MACS_PER_NS 50.0
#elif defined(__ARM_NEON)
#define PC_MACS_PER_NS 50.0
#define PC_CONV_MACS_PER_NS (50.0 / 3) /* not measured on NEON: the low rate, as before */
#else
#define PC_MACS_PER_NS 12.0
#define PC_CONV_MACS_PER_NS 7.2
#endif
#define PC_ELEMS_PER_NS 6.0

static inline int pc_cap(ptrdiff_t n)
{
    int limit = pc_team_limit, t;
    double work = pc_work_ns, start = pc_region_ns, fit;
    if (n < 1) return 1;
    t = (limit > 0 && n > limit) ? limit : (int)n;
    if (t > 1 && work > 0 && start > 0) {
        fit = work / (PC_REGION_PAYBACK * start);
        if (fit < t) t = fit < 1 ? 1 : (int)fit;
    }
    return t;
}

/* Set the current call's estimated one-thread ns (a call may set it again per phase). The team
 * follows it; the split of the work, and so the bits, never do. */
static inline void pc_work(double ns) { pc_work_ns = ns > 0 ? ns : 0; }
static inline double pc_work_get(void) { return pc_work_ns; }
static inline double pc_macs_ns(double macs) { return macs / PC_MACS_PER_NS; }
static inline double pc_conv_ns(double macs) { return macs / PC_CONV_MACS_PER_NS; }
static inline double pc_elems_ns(double elems) { return elems / PC_ELEMS_PER_NS; }
/* An optimizer's pass over every parameter, its gradient and its state: arrays the backward left in
 * another core's cache or in memory, so the memory system bounds it and a second thread gains little
 * or loses; counted at PC_UPDATE_SHARE of an element each, it takes a second thread only where it
 * is larger than a pass over cached arrays would need. */
#define PC_UPDATE_SHARE 0.5
static inline double pc_update_ns(double elems) { return pc_elems_ns(elems) * PC_UPDATE_SHARE; }

/* The estimate of (M x K) @ (K x N): its multiply-adds, or where it streams its operands once (a
 * matrix-vector product or an outer product at batch 1) the floats it moves. */
static inline double pc_product_ns(double M, double N, double K)
{
    double macs = pc_macs_ns(M * N * K), moved = pc_elems_ns(M * K + K * N + M * N);
    return macs > moved ? macs : moved;
}

/* An empty parallel region of n threads (each writes its number to sink), for the probe of what
 * starting one costs (_threads.region_start_ns): outside pc_cap, which it informs. */
static inline void pc_empty_region(int n, int *sink)
{
#if defined(_OPENMP)
    _Pragma("omp parallel num_threads(n)")
    sink[omp_get_thread_num()] = omp_get_thread_num();
#else
    (void)n;
    sink[0] = 0;
#endif
}

static inline void pc_set_region_ns(double ns) { pc_region_ns = ns > 0 ? ns : 0; }
static inline double pc_get_region_ns(void) { return pc_region_ns; }

static inline void pc_set_team_limit(int n) { pc_team_limit = n > 0 ? n : 0; }
static inline int pc_get_team_limit(void) { return pc_team_limit; }

/* A barrier for the team of the enclosing parallel region. Cython ends every prange inside a
 * `with parallel()` block with `omp for nowait`: where a later loop reads what an earlier one
 * wrote, every thread of the team must call pc_sync_wait between them (outside any branch, or in
 * one that every thread takes alike).
 * Under passive waiting a thread that reaches libgomp's barrier first sleeps at once, and its
 * wake-up costs the region tens of microseconds on a virtual machine, more than a small layer's
 * share. Inside a region every thread of the team is at work, so this one spins for a bounded time
 * (PC_SYNC_SPINS pause loops, tens of microseconds) and only then sleeps on a futex (Linux; other
 * systems use the runtime's barrier): a thread the OS descheduled costs its partners that much CPU
 * and no more. Between regions the runtime's own policy applies unchanged. One pc_sync per region,
 * set up with pc_sync_init before it starts. */
#define PC_SYNC_SPINS 2000

typedef struct {
    int arrived, gen, sleepers;
} pc_sync;

static inline void pc_sync_init(pc_sync *s) { memset(s, 0, sizeof(*s)); }

/* Whether this is the region's thread 0: between two pc_sync_wait calls it alone does a serial step
 * (adding the chunks' sums in order), whatever the team. */
static inline int pc_sync_first(void)
{
#if defined(_OPENMP)
    return omp_get_thread_num() == 0;
#else
    return 1;
#endif
}

/* a spin loop's pause (pc_sync_wait, pc_gate_wait) */
#if defined(__GNUC__) || defined(__clang__)
#if defined(__x86_64__) || defined(__i386__)
#define PC_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define PC_PAUSE() __asm__ __volatile__("yield" ::: "memory")
#else
#define PC_PAUSE() __asm__ __volatile__("" ::: "memory")
#endif
#endif

#if defined(_OPENMP) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
long syscall(long number, ...); /* declared by unistd.h only under _GNU_SOURCE */
static inline void pc_futex_wait(int *addr, int value)
{
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static inline void pc_futex_wake(int *addr) { syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

static inline void pc_sync_wait(pc_sync *s)
{
    const int n = omp_get_num_threads();
    if (n < 2)
        return;
    const int gen = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&s->arrived, 1, __ATOMIC_ACQ_REL) == n) {
        /* the last: reset the count for the next barrier before releasing the others */
        __atomic_store_n(&s->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&s->gen, gen + 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&s->sleepers, __ATOMIC_SEQ_CST))
            pc_futex_wake(&s->gen);
        return;
    }
    for (int i = 0; i < PC_SYNC_SPINS; i++) {
        if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) != gen)
            return;
        PC_PAUSE();
    }
    __atomic_add_fetch(&s->sleepers, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&s->gen, __ATOMIC_SEQ_CST) == gen)
        pc_futex_wait(&s->gen, gen);
    __atomic_sub_fetch(&s->sleepers, 1, __ATOMIC_SEQ_CST);
}

#else /* elsewhere the runtime's own barrier (no futex to sleep on after the spin) */
static inline void pc_sync_wait(pc_sync *s)
{
    (void)s;
#if defined(_OPENMP)
    _Pragma("omp barrier")
#endif
}
#endif

/* A first phase of n items whose results every item of the second phase reads (a layer's filter
 * transforms before its blocks): each thread of the region takes items from the shared counter
 * (pc_gate_take) until none is left, reports each one done (pc_gate_done), then waits for all n
 * (pc_gate_wait) and goes on to its share of the second phase. Unlike a barrier, no thread waits
 * for a partner that has not woken yet: the first thread at work takes every item itself and goes
 * straight on, and a late one finds none left. A thread waits only for items others took, spinning
 * PC_SYNC_SPINS pause loops before it sleeps (Linux; elsewhere it keeps spinning: the items are
 * short). One pc_gate per region, set up with pc_gate_init before it starts. */
typedef struct {
    int next, done, sleepers;
} pc_gate;

static inline void pc_gate_init(pc_gate *g) { memset(g, 0, sizeof(*g)); }

#if defined(__GNUC__) || defined(__clang__)
static inline int pc_gate_take(pc_gate *g) { return __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED); }

static inline void pc_gate_done(pc_gate *g, int n)
{
    if (__atomic_add_fetch(&g->done, 1, __ATOMIC_SEQ_CST) == n) {
#if defined(_OPENMP) && defined(__linux__)
        if (__atomic_load_n(&g->sleepers, __ATOMIC_SEQ_CST))
            pc_futex_wake(&g->done);
#endif
    }
}

static inline void pc_gate_wait(pc_gate *g, int n)
{
    int d;
    for (int i = 0; i < PC_SYNC_SPINS; i++) {
        if (__atomic_load_n(&g->done, __ATOMIC_ACQUIRE) >= n)
            return;
        PC_PAUSE();
    }
#if defined(_OPENMP) && defined(__linux__)
    __atomic_add_fetch(&g->sleepers, 1, __ATOMIC_SEQ_CST);
    while ((d = __atomic_load_n(&g->done, __ATOMIC_SEQ_CST)) < n)
        pc_futex_wait(&g->done, d);
    __atomic_sub_fetch(&g->sleepers, 1, __ATOMIC_SEQ_CST);
#else
    while ((d = __atomic_load_n(&g->done, __ATOMIC_ACQUIRE)) < n)
        PC_PAUSE();
#endif
}
#else /* compilers without GCC's atomics: OpenMP's (3.1) */
static inline int pc_gate_take(pc_gate *g)
{
    int i;
#if defined(_OPENMP)
#pragma omp atomic capture
#endif
    i = g->next++;
    return i;
}

static inline void pc_gate_done(pc_gate *g, int n)
{
    (void)n;
#if defined(_OPENMP)
#pragma omp atomic update
#endif
    g->done++;
}

static inline void pc_gate_wait(pc_gate *g, int n)
{
    for (;;) {
        int d;
#if defined(_OPENMP)
#pragma omp atomic read
#endif
        d = g->done;
        if (d >= n)
            break;
    }
#if defined(_OPENMP)
#pragma omp flush
#endif
}
#endif

/* p rounded up to the next 64-byte boundary (NULL stays NULL): for a buffer malloc'ed
 * 64 bytes larger than needed; free the original pointer. */
static inline void *pc_align64(void *p)
{
    return p ? (void *)(((size_t)p + 63) & ~(size_t)63) : NULL;
}

/* ------------------------------------------------------------ activations */

/* y = max(x, 0); NaN passes through like np.maximum. */
static inline void pc_relu_fwd(const float *restrict x, float *restrict y, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

/* dx = dy where y > 0 else 0. */
static inline void pc_relu_bwd(const float *restrict y, const float *restrict dy, float *restrict dx, pc_idx n)
{
    /* dy[i] read whatever y[i] is: a load under the condition cannot be vectorised without masked loads
     * (AVX2 has them, SSE and NEON not), and the branch it leaves mispredicts on a ReLU's random signs */
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) {
        const float d = dy[i];
        dx[i] = y[i] > 0.0f ? d : 0.0f;
    }
}

/* exp(t) for t <= 0, in a form that vectorises: t = n ln2 + r with |r| <= ln2/2 (Cody-Waite
 * split of ln2), exp(r) by the Cephes degree-6 polynomial (about 1 ulp), times 2^n built in
 * the exponent bits. Below -87.3 (where float32 exp turns subnormal) it returns
 * exp(-87.3) ~ 1.2e-38 instead. NaN in, NaN out. */
static inline float pc_exp_nonpos(float t)
{
    float c = t < -87.3f ? -87.3f : t;
    /* round to nearest by the 1.5 * 2^23 trick (no libm call, so it vectorises) */
    float nf = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = c - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int bits = ((int)nf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float e = p * scale;
    return t != t ? t : e;
}

/* y = 1 / (1 + exp(-x)) via exp(-|x|), so exp never overflows. */
static inline void pc_sigmoid_fwd(const float *restrict x, float *restrict y, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) {
        float v = x[i];
        float e = pc_exp_nonpos(-fabsf(v));
        float d = 1.0f + e;
        y[i] = (v >= 0.0f ? 1.0f : e) / d;
    }
}

/* dx = dy * y * (1 - y), evaluated left to right like NumPy. */
static inline void pc_sigmoid_bwd(const float *restrict y, const float *restrict dy, float *restrict dx, pc_idx n)
{
    PC_SIMD
    for (pc_idx i = 0; i < n; i++) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

/* -------------------------------------------------------------- optimizer */

/* In-place SGD step (PyTorch's formulation, see Backend.sgd_update). v may be NULL. */
static inline void pc_sgd(float *restrict p, const float *restrict g, float *restrict v, pc_idx n,
                          float lr, float momentum, float weight_decay, int use_wd, int nesterov)
{
    if (v == NULL) {
        if (use_wd) {
            PC_SIMD
            for (pc_idx i = 0; i < n; i++) { float d = g[i] + weight_decay * p[i]; p[i] = p[i] - lr * d; }
        } else {
            PC_SIMD
            for (pc_idx i = 0; i < n; i++) p[i] = p[i] - lr * g[i];
        }
        return;
    }
    if (nesterov) {
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) {
            float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
            float vi = v[i] * momentum + d;
            v[i] = vi;
            p[i] = p[i] - lr * (d + momentum * vi);
        }
    } else {
        PC_SIMD
        for (pc_idx i = 0; i < n; i++) {
            float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
            float vi = v[i] * momentum + d;
            v[i] = vi;
            p[i] = p[i] - lr * vi;
        }
    }
}

/* ----------------------------------------------------------------- conv */

/* First and one-past-last output column q whose input column q*S + kw - pad lies in [0, W). */
static inline void pc_valid_q(int W, int Q, int S, int kw, int pad, int *q_lo, int *q_hi)
{
    int off = kw - pad;  /* w = q*S + off */
    int lo = off >= 0 ? 0 : (-off + S - 1) / S;
    int hi = (W - 1 - off) >= 0 ? (W - 1 - off) / S + 1 : 0;
    if (hi > Q) hi = Q;
    if (lo > hi) lo = hi;
    *q_lo = lo;
    *q_hi = hi;
}

/* im2col for channels [c0, c1) and output rows [p0, p1) of one image.
 * x: one image (C, H, W); cols: ((c1-c0)*K*K, (p1-p0)*Q) with row stride T >= (p1-p0)*Q, overwritten. */
static inline void pc_im2col(const float *restrict x, int H, int W, int K, int S, int pad, int Q,
                             int c0, int c1, int p0, int p1, float *restrict cols, pc_idx T)
{
    float *row = cols;
    for (int c = c0; c < c1; c++) {
        const float *xc = x + (pc_idx)c * H * W;
        for (int kh = 0; kh < K; kh++) {
            for (int kw = 0; kw < K; kw++, row += T) {
                int q_lo, q_hi;
                pc_valid_q(W, Q, S, kw, pad, &q_lo, &q_hi);
                for (int p = p0; p < p1; p++) {
                    float *dst = row + (pc_idx)(p - p0) * Q;
                    int h = p * S + kh - pad;
                    if (h < 0 || h >= H) {
                        memset(dst, 0, sizeof(float) * (size_t)Q);
                        continue;
                    }
                    const float *src = xc + (pc_idx)h * W + (kw - pad);
                    for (int q = 0; q < q_lo; q++) dst[q] = 0.0f;
                    if (S == 1) {
                        memcpy(dst + q_lo, src + q_lo, sizeof(float) * (size_t)(q_hi - q_lo));
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[q] = src[(pc_idx)q * S];
                    }
                    for (int q = q_hi; q < Q; q++) dst[q] = 0.0f;
                }
            }
        }
    }
}

/* col2im, accumulating: dx[c] += scatter(dcols) for channels [c0, c1) and output rows [p0, p1).
 * dx: one image (C, H, W); dcols: ((c1-c0)*K*K, (p1-p0)*Q). */
static inline void pc_col2im(const float *restrict dcols, int H, int W, int K, int S, int pad, int Q,
                             int c0, int c1, int p0, int p1, float *restrict dx)
{
    pc_idx T = (pc_idx)(p1 - p0) * Q;
    const float *row = dcols;
    for (int c = c0; c < c1; c++) {
        float *dxc = dx + (pc_idx)c * H * W;
        for (int kh = 0; kh < K; kh++) {
            for (int kw = 0; kw < K; kw++, row += T) {
                int q_lo, q_hi;
                pc_valid_q(W, Q, S, kw, pad, &q_lo, &q_hi);
                for (int p = p0; p < p1; p++) {
                    int h = p * S + kh - pad;
                    if (h < 0 || h >= H) continue;
                    const float *src = row + (pc_idx)(p - p0) * Q;
                    float *dst = dxc + (pc_idx)h * W + (kw - pad);
                    if (S == 1) {
                        PC_SIMD
                        for (int q = q_lo; q < q_hi; q++) dst[q] += src[q];
                    } else {
                        for (int q = q_lo; q < q_hi; q++) dst[(pc_idx)q * S] += src[q];
                    }
                }
            }
        }
    }
}

/* Sum of n floats, in double: 16 float partial sums (vectorisable), then added in double. */
static inline double pc_sum_f32(const float *restrict p, pc_idx n)
{
    float acc[16] = {0.0f};
    pc_idx i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += p[i + j];
    double s = 0.0;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += p[i];
    return s;
}

#endif /* PARCONV_PC_COMMON_H */
