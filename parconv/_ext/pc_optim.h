/* Optimizer updates and gradient norms over one flat chunk of a parameter.
 *
 * Shape legend: p (parameter), g (gradient), m / v / sq / buf (state), all (n,) float32,
 * updated in place. Each loop evaluates the same float32 expressions in the same order
 * as parconv.backends.numpy_ref, so a step matches the reference bit for bit (the build
 * turns FMA contraction off).
 */
#ifndef PC_OPTIM_H
#define PC_OPTIM_H

#include <math.h>
#include <stddef.h>

#ifndef PC_OPTIM_SIMD
#if defined(_OPENMP)
#define PC_OPTIM_SIMD _Pragma("omp simd")
#else
#define PC_OPTIM_SIMD
#endif
#endif

/* Adam (PyTorch's formulation). Decoupled decay (AdamW) scales p by `decay` = 1 - lr wd
 * before the step; L2 decay (Adam) adds wd p to the gradient instead. */
static inline void pc_adam_step(float *restrict p, const float *restrict g, float *restrict m,
                                float *restrict v, ptrdiff_t n, float beta1, float omb1, float beta2,
                                float omb2, float step_size, float sqrt_bc2, float eps, float weight_decay,
                                int use_wd, float decay, int use_decay)
{
    PC_OPTIM_SIMD
    for (ptrdiff_t i = 0; i < n; i++) {
        float pi = use_decay ? p[i] * decay : p[i];
        float d = use_wd ? g[i] + weight_decay * pi : g[i];
        float mi = m[i] * beta1 + omb1 * d;
        float vi = v[i] * beta2 + omb2 * d * d;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - step_size * mi / (sqrtf(vi) / sqrt_bc2 + eps);
    }
}

/* RMSprop, centered=False (PyTorch's formulation): sq = alpha sq + (1 - alpha) d^2,
 * avg = sqrt(sq) + eps; with momentum buf = momentum buf + d / avg, p -= lr buf;
 * without, p -= lr (d / avg). buf is NULL when momentum == 0. */
static inline void pc_rmsprop_step(float *restrict p, const float *restrict g, float *restrict sq,
                                   float *restrict buf, ptrdiff_t n, float lr, float alpha, float oma,
                                   float eps, float weight_decay, int use_wd, float momentum)
{
    if (buf == NULL) {
        PC_OPTIM_SIMD
        for (ptrdiff_t i = 0; i < n; i++) {
            float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
            float si = sq[i] * alpha + oma * d * d;
            sq[i] = si;
            p[i] = p[i] - lr * (d / (sqrtf(si) + eps));
        }
        return;
    }
    PC_OPTIM_SIMD
    for (ptrdiff_t i = 0; i < n; i++) {
        float d = use_wd ? g[i] + weight_decay * p[i] : g[i];
        float si = sq[i] * alpha + oma * d * d;
        sq[i] = si;
        float bi = buf[i] * momentum + d / (sqrtf(si) + eps);
        buf[i] = bi;
        p[i] = p[i] - lr * bi;
    }
}

/* Sum of squares in double (the float32 squares would lose the small terms of a long sum),
 * in four running sums added at the end: a fixed order, and four independent add chains
 * instead of one latency-bound chain. */
static inline double pc_sumsq(const float *restrict g, ptrdiff_t n)
{
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    ptrdiff_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)g[i] * (double)g[i];
        s1 += (double)g[i + 1] * (double)g[i + 1];
        s2 += (double)g[i + 2] * (double)g[i + 2];
        s3 += (double)g[i + 3] * (double)g[i + 3];
    }
    for (; i < n; i++) s0 += (double)g[i] * (double)g[i];
    return (s0 + s1) + (s2 + s3);
}

static inline double pc_sumpow(const float *restrict g, ptrdiff_t n, double ord)
{
    double s = 0.0;
    for (ptrdiff_t i = 0; i < n; i++) s += pow(fabs((double)g[i]), ord);
    return s;
}

/* Largest |g|; a NaN wins (as torch.max and np.max propagate it). */
static inline double pc_absmax(const float *restrict g, ptrdiff_t n, double best)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        double a = fabs((double)g[i]);
        best = (a > best || a != a) && best == best ? a : best;
    }
    return best;
}

static inline void pc_scale(float *restrict x, ptrdiff_t n, float factor)
{
    PC_OPTIM_SIMD
    for (ptrdiff_t i = 0; i < n; i++) x[i] = x[i] * factor;
}

#endif
