"""The ``im2col`` backend: the NumPy reference backend with convolutions done as one GEMM.

Shapes: N batch, C in-channels, O filters, H, W input, P, Q output, K kernel.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from parconv.backends.numpy_ref import NumpyBackend


def _pad(x: np.ndarray, padding: int) -> np.ndarray:
    if padding == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))


def _windows(xp: np.ndarray, K: int, stride: int, P: int, Q: int) -> np.ndarray:
    """(N, C, P, Q, K, K) view of the K x K window under every output pixel (no copy)."""
    win = sliding_window_view(xp, (K, K), axis=(2, 3))
    return win[:, :, : stride * (P - 1) + 1 : stride, : stride * (Q - 1) + 1 : stride]


class Im2colBackend(NumpyBackend):
    """NumPy backend whose ``conv2d`` forward and backward are single matrix products.

    ``np.tensordot`` copies the windows into an (N*P*Q, C*K*K) matrix — the
    *im2col* matrix — and multiplies it with the (C*K*K, O) weights in one BLAS
    call. Every other op is inherited from the NumPy reference, including the
    fused conv+ReLU+maxpool op, which calls these convolutions.
    """

    name = "im2col"

    def conv2d_forward(self, x, w, b, stride, padding):
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = (H + 2 * padding - K) // stride + 1, (W + 2 * padding - K) // stride + 1
        cols = _windows(_pad(x, padding), K, stride, P, Q)  # (N, C, P, Q, K, K)
        y = np.tensordot(cols, w, axes=([1, 4, 5], [1, 2, 3]))  # (N, P, Q, O): one GEMM
        if b is not None:
            y += b
        return np.ascontiguousarray(y.transpose(0, 3, 1, 2), dtype=x.dtype)

    def conv2d_backward(self, x, w, dy, stride, padding, need_dx=True, need_db=True):
        """Returns ``(dx, dw, db)``, all freshly written (overwritten, not accumulated)."""
        N, C, H, W = x.shape
        O, _, K, _ = w.shape
        P, Q = dy.shape[2], dy.shape[3]
        xp = _pad(x, padding)
        cols = _windows(xp, K, stride, P, Q)
        dw = np.tensordot(dy, cols, axes=([0, 2, 3], [0, 2, 3])).astype(w.dtype)  # (O, C, K, K)
        db = dy.sum(axis=(0, 2, 3)) if need_db else None
        dx = None
        if need_dx:
            dcols = np.tensordot(dy, w, axes=([1], [0]))  # (N, P, Q, C, K, K): one GEMM
            dxp = np.zeros_like(xp)
            for kh in range(K):  # col2im: add every window's gradient back where it came from
                for kw in range(K):
                    dxp[:, :, kh : kh + stride * (P - 1) + 1 : stride, kw : kw + stride * (Q - 1) + 1 : stride] += \
                        dcols[:, :, :, :, kh, kw].transpose(0, 3, 1, 2)
            dx = np.ascontiguousarray(dxp[:, :, padding : padding + H, padding : padding + W])
        return dx, dw, db
