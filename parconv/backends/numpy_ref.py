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

from .base import Backend


def _flush_denormals(a: np.ndarray) -> np.ndarray:
    """``a`` (floating) with entries of magnitude below its dtype's smallest normal number set to
    zero, in place. The softmax cross-entropy's probabilities and gradient are flushed so on every
    backend: denormal gradients make every layer below them slow on many CPUs."""
    a[np.abs(a) < np.finfo(a.dtype).tiny] = 0
    return a


def _out_size(size: int, k: int, stride: int, padding: int = 0) -> int:
    return (size + 2 * padding - k) // stride + 1


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

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
        d = g + weight_decay * p if weight_decay else g
        m *= beta1
        m += (1 - beta1) * d
        v *= beta2
        v += (1 - beta2) * d * d
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        p -= (lr / bc1) * m / (np.sqrt(v) / math.sqrt(bc2) + eps)
