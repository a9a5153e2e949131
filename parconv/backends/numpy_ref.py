"""The NumPy reference backend: plain, serial and obviously correct.

It is the oracle of every test and the "serial" baseline of every benchmark,
so clarity wins over speed here. Every op works in the dtype it is given
(float32 in training, float64 in the finite-difference tests).

Shapes: N batch, C in-channels, O filters, H, W input, P, Q output, K kernel,
F in-features, G out-features.
"""

from __future__ import annotations

import math

import numpy as np

from .._shapes import out_size as _out_size
from .._weights import weights_changed
from .base import Backend


def _flush_denormals(a: np.ndarray) -> np.ndarray:
    """``a`` (floating) with entries of magnitude below its dtype's smallest normal number set to
    zero, in place. The softmax cross-entropy's probabilities and gradient are flushed so on every
    backend: denormal gradients make every layer below them slow on many CPUs."""
    a[np.abs(a) < np.finfo(a.dtype).tiny] = 0
    return a


class HostArrays:
    """Array methods of the backends whose arrays are C-contiguous NumPy arrays on the host."""

    host_arrays = True

    def asarray(self, x, dtype=np.float32):
        return np.ascontiguousarray(x, dtype=dtype)

    def to_numpy(self, a):
        return np.asarray(a)

    def is_array(self, a):
        return isinstance(a, np.ndarray)

    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def reshape(self, a, shape):
        return a.reshape(shape)

    def copy(self, a):
        return a.copy()

    def copy_into(self, dst, src):
        dst[...] = src
        weights_changed()  # dst may be a parameter or buffer: caches derived from them rebuild

    def fill(self, a, value):
        a.fill(value)

    def all_finite(self, a):
        return bool(np.isfinite(a).all())


class NumpyBackend(HostArrays, Backend):
    name = "numpy"

    # ------------------------------------------------------------------ conv2d
    @staticmethod
    def _pad(x, padding):
        if padding == 0:
            return x
        return np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))

    def conv2d_forward(self, x, w, b, stride, padding):
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = _out_size(H, K, stride, padding), _out_size(W, K, stride, padding)
        xp = self._pad(x, padding)
        y = np.zeros((N, O, P, Q), dtype=x.dtype)
        # one tap (kh, kw) of the kernel at a time: y[n,o,p,q] += sum_c x[n,c,p*s+kh,q*s+kw] w[o,c,kh,kw]
        for kh in range(K):
            for kw in range(K):
                patch = xp[:, :, kh : kh + stride * (P - 1) + 1 : stride, kw : kw + stride * (Q - 1) + 1 : stride]
                y += np.einsum("ncpq,oc->nopq", patch, w[:, :, kh, kw])
        if b is not None:
            y += b[None, :, None, None]
        return y

    def conv2d_backward(self, x, w, dy, stride, padding, need_dx=True, need_db=True):
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = dy.shape[2], dy.shape[3]
        xp = self._pad(x, padding)
        dxp = np.zeros_like(xp) if need_dx else None
        dw = np.zeros_like(w)
        for kh in range(K):
            for kw in range(K):
                hs = slice(kh, kh + stride * (P - 1) + 1, stride)
                ws = slice(kw, kw + stride * (Q - 1) + 1, stride)
                dw[:, :, kh, kw] = np.einsum("nopq,ncpq->oc", dy, xp[:, :, hs, ws])
                if need_dx:
                    dxp[:, :, hs, ws] += np.einsum("nopq,oc->ncpq", dy, w[:, :, kh, kw])
        dx = None
        if need_dx:
            dx = dxp[:, :, padding : padding + H, padding : padding + W] if padding else dxp
            dx = np.ascontiguousarray(dx)
        db = dy.sum(axis=(0, 2, 3)) if need_db else None
        return dx, dw, db

    # --------------------------------------------------------------- maxpool2d
    def maxpool2d_forward(self, x, kernel_size, stride):
        N, C, H, W = x.shape
        K = kernel_size
        P, Q = _out_size(H, K, stride), _out_size(W, K, stride)
        y = np.empty((N, C, P, Q), dtype=x.dtype)
        argmax = np.empty((N, C, P, Q), dtype=np.int32)
        for p in range(P):
            for q in range(Q):
                win = x[:, :, p * stride : p * stride + K, q * stride : q * stride + K].reshape(N, C, K * K)
                j = win.argmax(axis=2)  # first maximum on ties
                y[:, :, p, q] = np.take_along_axis(win, j[..., None], axis=2)[..., 0]
                argmax[:, :, p, q] = (p * stride + j // K) * W + (q * stride + j % K)
        return y, argmax

    def maxpool2d_backward(self, dy, argmax, x_shape):
        N, C, H, W = x_shape
        dx = np.zeros((N * C, H * W), dtype=dy.dtype)
        rows = np.repeat(np.arange(N * C), argmax.shape[2] * argmax.shape[3])
        np.add.at(dx, (rows, argmax.reshape(-1)), dy.reshape(-1))
        return dx.reshape(N, C, H, W)

    # ------------------------------------------------------------------ linear
    def linear_forward(self, x, w, b):
        y = x @ w.T
        if b is not None:
            y += b
        return y

    def linear_backward(self, x, w, dy, need_dx=True, need_db=True):
        dx = dy @ w if need_dx else None
        dw = dy.T @ x
        db = dy.sum(axis=0) if need_db else None
        return dx, dw, db

    # ------------------------------------------------------------- activations
    def relu_forward(self, x):
        return np.maximum(x, 0)

    def relu_backward(self, y, dy):
        return np.where(y > 0, dy, 0).astype(dy.dtype)

    def sigmoid_forward(self, x):
        # exp of a non-positive number only, so nothing overflows
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)

    def sigmoid_backward(self, y, dy):
        return dy * y * (1 - y)

    # ------------------------------------------------------------------ losses
    def softmax_cross_entropy_forward(self, logits, labels):
        m = logits.max(axis=1, keepdims=True)
        z = logits - m
        lse = np.log(np.exp(z).sum(axis=1, keepdims=True))
        logp = z - lse
        n = logits.shape[0]
        loss = -logp[np.arange(n), labels].mean()
        return float(loss), _flush_denormals(np.exp(logp))

    def softmax_cross_entropy_backward(self, probs, labels):
        d = probs.copy()
        n = probs.shape[0]
        d[np.arange(n), labels] -= 1
        return _flush_denormals(d / np.asarray(n, dtype=probs.dtype))

    def bce_forward(self, p, t, eps):
        pc = np.clip(p, eps, 1 - eps)
        return float(-(t * np.log(pc) + (1 - t) * np.log(1 - pc)).mean())

    def bce_backward(self, p, t, eps):
        pc = np.clip(p, eps, 1 - eps)
        g = (pc - t) / (pc * (1 - pc)) / np.asarray(p.size, dtype=p.dtype)
        # the clip has zero gradient outside [eps, 1 - eps], as in the forward's maths
        return np.where((p < eps) | (p > 1 - eps), 0, g).astype(p.dtype)

    def count_correct(self, logits, labels):
        return int((logits.argmax(axis=1) == labels).sum())

    def argmax_rows(self, logits):
        return logits.argmax(axis=1).astype(np.int32)

    # --------------------------------------------------------------- optimizer
    def sgd_update(self, p, g, v, lr, momentum, weight_decay, nesterov):
        d = g + weight_decay * p if weight_decay else g
        if v is not None:
            v *= momentum
            v += d
            d = d + momentum * v if nesterov else v
        p -= lr * d

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled=False):
        if decoupled:
            if weight_decay:
                p *= 1 - lr * weight_decay
            d = g
        else:
            d = g + weight_decay * p if weight_decay else g
        m *= beta1
        m += (1 - beta1) * d
        v *= beta2
        v += (1 - beta2) * d * d
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        p -= (lr / bc1) * m / (np.sqrt(v) / math.sqrt(bc2) + eps)

    def rmsprop_update(self, p, g, sq, buf, lr, alpha, eps, weight_decay, momentum):
        d = g + weight_decay * p if weight_decay else g
        sq *= alpha
        sq += (1 - alpha) * d * d
        avg = np.sqrt(sq) + eps
        if buf is not None:
            buf *= momentum
            buf += d / avg
            p -= lr * buf
        else:
            p -= lr * (d / avg)

    def norm_many(self, xs, norm_type):
        # float64 over the concatenation: the oracle the float32 device sums are checked against
        flat = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in xs]) if xs else np.zeros(0)
        if flat.size == 0:
            return 0.0
        if norm_type == math.inf:
            return float(np.abs(flat).max())
        if norm_type == 2.0:
            return float(np.sqrt(np.dot(flat, flat)))
        return float((np.abs(flat) ** norm_type).sum() ** (1.0 / norm_type))

    def scale_many(self, xs, factor):
        for x in xs:
            x *= np.float32(factor)

    # ------------------------------------ general convolution and pooling ops
    def conv2d_general_forward(self, x, w, b, stride, pads, dilation, groups):
        N, C, H, W = x.shape
        O, Cg, KH, KW = w.shape
        (sh, sw), (dh, dw_), G = stride, dilation, groups
        P = _out_size(H, KH, sh, pads[0], pads[1], dh)
        Q = _out_size(W, KW, sw, pads[2], pads[3], dw_)
        xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[1]), (pads[2], pads[3])))
        xg = xp.reshape(N, G, Cg, xp.shape[2], xp.shape[3])
        wg = w.reshape(G, O // G, Cg, KH, KW)
        y = np.zeros((N, G, O // G, P, Q), dtype=x.dtype)
        # one tap at a time: y[n,g,o,p,q] += sum_c x[n,g,c,p*sh+kh*dh,q*sw+kw*dw] w[g,o,c,kh,kw]
        for kh in range(KH):
            for kw in range(KW):
                h0, w0 = kh * dh, kw * dw_
                patch = xg[:, :, :, h0 : h0 + sh * (P - 1) + 1 : sh, w0 : w0 + sw * (Q - 1) + 1 : sw]
                y += np.einsum("ngcpq,goc->ngopq", patch, wg[:, :, :, kh, kw])
        y = y.reshape(N, O, P, Q)
        if b is not None:
            y += b[None, :, None, None]
        return y

    def conv2d_general_backward(self, x, w, dy, stride, pads, dilation, groups, need_dx=True, need_db=True):
        N, C, H, W = x.shape
        O, Cg, KH, KW = w.shape
        (sh, sw), (dh, dw_), G = stride, dilation, groups
        P, Q = dy.shape[2], dy.shape[3]
        xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[1]), (pads[2], pads[3])))
        Hp, Wp = xp.shape[2], xp.shape[3]
        xg = xp.reshape(N, G, Cg, Hp, Wp)
        wg = w.reshape(G, O // G, Cg, KH, KW)
        dyg = dy.reshape(N, G, O // G, P, Q)
        dxg = np.zeros_like(xg) if need_dx else None
        dw = np.zeros_like(wg)
        for kh in range(KH):
            for kw in range(KW):
                hs = slice(kh * dh, kh * dh + sh * (P - 1) + 1, sh)
                ws = slice(kw * dw_, kw * dw_ + sw * (Q - 1) + 1, sw)
                dw[:, :, :, kh, kw] = np.einsum("ngopq,ngcpq->goc", dyg, xg[:, :, :, hs, ws])
                if need_dx:
                    dxg[:, :, :, hs, ws] += np.einsum("ngopq,goc->ngcpq", dyg, wg[:, :, :, kh, kw])
        dx = None
        if need_dx:
            dx = np.ascontiguousarray(dxg.reshape(N, C, Hp, Wp)[:, :, pads[0] : pads[0] + H, pads[2] : pads[2] + W])
        db = dy.sum(axis=(0, 2, 3)) if need_db else None
        return dx, dw.reshape(w.shape), db

    def maxpool2d_general_forward(self, x, kernel, stride, pads):
        N, C, H, W = x.shape
        (KH, KW), (sh, sw), (ph, pw) = kernel, stride, pads
        P, Q = _out_size(H, KH, sh, ph), _out_size(W, KW, sw, pw)
        y = np.empty((N, C, P, Q), dtype=x.dtype)
        argmax = np.empty((N, C, P, Q), dtype=np.int32)
        for p in range(P):
            h0, h1 = max(p * sh - ph, 0), min(p * sh - ph + KH, H)
            for q in range(Q):
                # only the window's inputs compete: padding is never selected, even against -inf
                w0, w1 = max(q * sw - pw, 0), min(q * sw - pw + KW, W)
                win = x[:, :, h0:h1, w0:w1].reshape(N, C, -1)
                j = win.argmax(axis=2)  # first maximum on ties, first NaN if any
                y[:, :, p, q] = np.take_along_axis(win, j[..., None], axis=2)[..., 0]
                argmax[:, :, p, q] = (h0 + j // (w1 - w0)) * W + (w0 + j % (w1 - w0))
        return y, argmax

    def avgpool2d_forward(self, x, kernel, stride, pads):
        N, C, H, W = x.shape
        (KH, KW), (sh, sw), (ph, pw) = kernel, stride, pads
        P, Q = _out_size(H, KH, sh, ph), _out_size(W, KW, sw, pw)
        xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
        y = np.zeros((N, C, P, Q), dtype=x.dtype)
        for kh in range(KH):
            for kw in range(KW):
                y += xp[:, :, kh : kh + sh * (P - 1) + 1 : sh, kw : kw + sw * (Q - 1) + 1 : sw]
        return y / np.asarray(KH * KW, dtype=x.dtype)

    def avgpool2d_backward(self, dy, x_shape, kernel, stride, pads):
        N, C, H, W = x_shape
        (KH, KW), (sh, sw), (ph, pw) = kernel, stride, pads
        P, Q = dy.shape[2], dy.shape[3]
        g = dy / np.asarray(KH * KW, dtype=dy.dtype)
        dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw), dtype=dy.dtype)
        for kh in range(KH):
            for kw in range(KW):
                dxp[:, :, kh : kh + sh * (P - 1) + 1 : sh, kw : kw + sw * (Q - 1) + 1 : sw] += g
        return np.ascontiguousarray(dxp[:, :, ph : ph + H, pw : pw + W])

    @staticmethod
    def _adaptive_windows(size, out):
        """PyTorch's adaptive windows: [floor(i size / out), ceil((i + 1) size / out)) for each i."""
        return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]

    def adaptive_avgpool2d_forward(self, x, output_size):
        N, C, H, W = x.shape
        P, Q = output_size
        y = np.empty((N, C, P, Q), dtype=x.dtype)
        for p, (h0, h1) in enumerate(self._adaptive_windows(H, P)):
            for q, (w0, w1) in enumerate(self._adaptive_windows(W, Q)):
                y[:, :, p, q] = x[:, :, h0:h1, w0:w1].mean(axis=(2, 3))
        return y

    def adaptive_avgpool2d_backward(self, dy, x_shape, output_size):
        P, Q = output_size
        dx = np.zeros(x_shape, dtype=dy.dtype)
        for p, (h0, h1) in enumerate(self._adaptive_windows(x_shape[2], P)):
            for q, (w0, w1) in enumerate(self._adaptive_windows(x_shape[3], Q)):
                area = np.asarray((h1 - h0) * (w1 - w0), dtype=dy.dtype)
                dx[:, :, h0:h1, w0:w1] += (dy[:, :, p, q] / area)[:, :, None, None]
        return dx

    # ------------------------------------------------------------ batch norm
    # Statistics are accumulated in float64 and rounded once to the input's dtype, so the
    # oracle stays accurate for large N * H * W; the normalisation itself runs in that dtype.
    def batch_norm_forward_train(self, x, weight, bias, running_mean, running_var, momentum, eps, relu,
                                 residual=None):
        x3 = _bn_view(x)
        count = x3.shape[0] * x3.shape[2]
        mean64 = x3.mean(axis=(0, 2), dtype=np.float64)
        var64 = np.square(x3 - mean64[None, :, None]).mean(axis=(0, 2))
        mean = mean64.astype(x.dtype)
        invstd = (1.0 / np.sqrt(var64 + eps)).astype(x.dtype)
        if running_mean is not None:
            running_mean[...] = (1.0 - momentum) * running_mean + momentum * mean64
        if running_var is not None:
            running_var[...] = (1.0 - momentum) * running_var + momentum * (var64 * count / (count - 1))
        return _bn_apply(x, x3, weight, bias, mean, invstd, relu, residual), mean, invstd

    def batch_norm_forward_eval(self, x, weight, bias, running_mean, running_var, eps, relu, residual=None):
        mean = running_mean.astype(x.dtype, copy=True)
        invstd = (1 / np.sqrt(running_var.astype(x.dtype) + eps)).astype(x.dtype)
        return _bn_apply(x, _bn_view(x), weight, bias, mean, invstd, relu, residual), mean, invstd

    def batch_norm_backward(self, x, weight, dy, mean, invstd, y, training, need_dx=True):
        x3, dy3 = _bn_view(x), _bn_view(dy)
        g = dy3 if y is None else np.where(_bn_view(y) > 0, dy3, 0).astype(dy.dtype)
        xhat = (x3 - mean[None, :, None]) * invstd[None, :, None]
        sg = g.sum(axis=(0, 2), dtype=np.float64)
        sgx = (g * xhat).sum(axis=(0, 2), dtype=np.float64)
        dweight = dbias = None
        if weight is not None:
            dweight, dbias = sgx.astype(dy.dtype), sg.astype(dy.dtype)
        dx = None
        if need_dx:
            k = (invstd if weight is None else invstd * weight)[None, :, None]
            if training:
                count = x3.shape[0] * x3.shape[2]
                a = (sg / count).astype(dy.dtype)[None, :, None]
                b = (sgx / count).astype(dy.dtype)[None, :, None]
                dx = (((g - a) - xhat * b) * k).reshape(x.shape)
            else:
                dx = (g * k).reshape(x.shape)
        return dx, dweight, dbias

    # --------------------------------------------------------------- dropout
    def dropout_forward(self, x, p, seed):
        return _dropout_apply(x, p, seed)

    def dropout_backward(self, dy, p, seed):
        return _dropout_apply(dy, p, seed)

    # ------------------------------------------------------ more activations
    def leaky_relu_forward(self, x, negative_slope):
        return np.where(x > 0, x, x * negative_slope).astype(x.dtype)

    def leaky_relu_backward(self, x, dy, negative_slope):
        return np.where(x > 0, dy, dy * negative_slope).astype(dy.dtype)

    def elu_forward(self, x, alpha):
        return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))).astype(x.dtype)

    def elu_backward(self, y, dy, alpha):
        # from the forward output: d/dx alpha (exp(x) - 1) = y + alpha
        return np.where(y > 0, dy, dy * (y + alpha)).astype(dy.dtype)

    def tanh_forward(self, x):
        return np.tanh(x)

    def tanh_backward(self, y, dy):
        return dy * (1 - y * y)

    def softmax_forward(self, x, dim):
        e = np.exp(x - x.max(axis=dim, keepdims=True))
        return e / e.sum(axis=dim, keepdims=True)

    def softmax_backward(self, y, dy, dim):
        return y * (dy - (dy * y).sum(axis=dim, keepdims=True))

    def add(self, a, b):
        return a + b

    # ------------------------------------------------------------ more losses
    def mse_forward(self, pred, target):
        d = pred - target
        return float(np.mean(d * d, dtype=np.float64))

    def mse_backward(self, pred, target):
        return (pred - target) * np.asarray(2.0 / pred.size, dtype=pred.dtype)

    def softmax_cross_entropy_smoothed_forward(self, logits, labels, label_smoothing):
        n, g = logits.shape
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        on, off = smoothed_targets(label_smoothing, g)
        row = on * logp[np.arange(n), labels].astype(np.float64) + off * (logp.sum(axis=1, dtype=np.float64)
                                                                        - logp[np.arange(n), labels])
        return float(-row.mean()), _flush_denormals(np.exp(logp))

    def softmax_cross_entropy_smoothed_backward(self, probs, labels, label_smoothing):
        n, g = probs.shape
        on, off = smoothed_targets(label_smoothing, g)
        t = np.full_like(probs, off)
        t[np.arange(n), labels] = on
        return _flush_denormals((probs - t) / np.asarray(n, dtype=probs.dtype))


def smoothed_targets(label_smoothing: float, n_classes: int) -> tuple:
    """The smoothed target of the true class and of every other class, ``(1 - s + s / G, s / G)``,
    rounded to float32 once, so every backend subtracts the same two numbers."""
    off = label_smoothing / n_classes
    return float(np.float32(1.0 - label_smoothing + off)), float(np.float32(off))


def _bn_view(a):
    """(N, C, ...) as (N, C, L) with L the product of the trailing dims (1 for (N, C))."""
    return a.reshape(a.shape[0], a.shape[1], -1)


def _bn_apply(x, x3, weight, bias, mean, invstd, relu, residual=None):
    """``(x - mean) * (invstd * weight) + bias`` per channel (plus residual, then ReLU), shaped like x."""
    scale = invstd if weight is None else invstd * weight
    y = (x3 - mean[None, :, None]) * scale[None, :, None]
    if bias is not None:
        y = y + bias[None, :, None]
    if residual is not None:
        y = y.astype(x.dtype, copy=False) + _bn_view(residual)
    if relu:
        y = np.maximum(y, 0)
    return y.astype(x.dtype, copy=False).reshape(x.shape)


# Dropout's keep mask: splitmix64 of the counter (seed + (i + 1) * golden ratio), i the flat
# element index, as the Cython and OpenCL kernels compute it; the top 32 bits are compared
# with the threshold floor(p * 2**32).
DROPOUT_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
DROPOUT_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
DROPOUT_MIX2 = np.uint64(0x94D049BB133111EB)


def dropout_threshold(p: float) -> int:
    """Elements whose 32-bit hash is below this are dropped: ``floor(p * 2**32)``."""
    return min(1 << 32, int(math.floor(p * 4294967296.0)))


def dropout_scale(p: float) -> float:
    """The factor of the kept elements, ``1 / (1 - p)`` rounded to float32 (0 for p == 1)."""
    return 0.0 if p >= 1.0 else float(np.float32(1.0 / (1.0 - p)))


def dropout_keep(seed: int, n: int, p: float) -> np.ndarray:
    """Boolean keep mask of ``n`` elements for ``seed`` (a uint64) and drop probability ``p``."""
    z = np.uint64(seed) + (np.arange(n, dtype=np.uint64) + np.uint64(1)) * DROPOUT_GOLDEN
    z = (z ^ (z >> np.uint64(30))) * DROPOUT_MIX1
    z = (z ^ (z >> np.uint64(27))) * DROPOUT_MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(32)) >= np.uint64(dropout_threshold(p)) if p < 1.0 else np.zeros(n, dtype=bool)


def _dropout_apply(a, p, seed):
    keep = dropout_keep(seed, a.size, p).reshape(a.shape)
    return np.where(keep, a * np.asarray(dropout_scale(p), dtype=a.dtype), 0).astype(a.dtype)
