"""Stateless operations: validate once, resolve the backend, call one method.

Every function takes array-likes (host data is converted to float32 and moved
to the backend) and an optional ``backend`` (name or object; ``None`` is the
process default). Backward functions return freshly written gradients: they
overwrite, never accumulate.

Shapes: ``N`` batch, ``C`` in-channels, ``O`` out-channels, ``H, W`` input,
``P, Q`` output, ``K`` kernel, ``F`` in-features, ``G`` out-features.

Examples
--------
>>> import numpy as np
>>> import parconv.functional as F
>>> x = np.ones((1, 1, 4, 4), dtype=np.float32)
>>> w = np.ones((2, 1, 3, 3), dtype=np.float32)
>>> y = F.conv2d(x, w, padding=1, backend="numpy")
>>> y.shape
(1, 2, 4, 4)
>>> float(y[0, 0, 1, 1])
9.0
"""

from __future__ import annotations

import numpy as np

from . import backends as _backends
from ._validation import (
    check_float,
    check_grad_shape,
    check_int,
    check_ndim,
    check_nonempty,
    shape_of,
    to_backend_array,
    to_host_labels,
)

__all__ = [
    "conv2d",
    "conv2d_backward",
    "maxpool2d",
    "maxpool2d_backward",
    "conv2d_relu_maxpool2d",
    "conv2d_relu_maxpool2d_backward",
    "linear",
    "linear_backward",
    "relu",
    "relu_backward",
    "sigmoid",
    "sigmoid_backward",
    "softmax_cross_entropy",
    "softmax_cross_entropy_backward",
    "binary_cross_entropy",
    "binary_cross_entropy_backward",
    "conv2d_output_shape",
    "maxpool2d_output_shape",
]

BCE_EPS = 1e-7


# ----------------------------------------------------------------------- shapes
def conv2d_output_shape(x_shape, w_shape, stride: int = 1, padding: int = 0, where: str = "conv2d") -> tuple:
    """Output shape ``(N, O, P, Q)`` of a convolution, validating every size.

    Raises ``ValueError`` for a wrong ndim, a channel mismatch, zero sizes, a
    kernel larger than the padded input, ``stride <= 0`` or ``padding < 0``.
    """
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    stride = check_int(stride, "stride", where, 1)
    padding = check_int(padding, "padding", where, 0)
    check_ndim(x_shape, 4, "x", where, "(N, C, H, W)")
    check_ndim(w_shape, 4, "weight", where, "(O, C, K, K)")
    check_nonempty(x_shape, "x", where)
    check_nonempty(w_shape, "weight", where)
    N, C, H, W = x_shape
    O, Cw, KH, KW = w_shape
    if KH != KW:
        raise ValueError(f"{where}: kernel must be square, got weight shape {w_shape}")
    if C != Cw:
        raise ValueError(f"{where}: x has {C} channels but weight expects {Cw} (x shape {x_shape}, weight shape {w_shape})")
    if KH > H + 2 * padding or KW > W + 2 * padding:
        raise ValueError(
            f"{where}: kernel {KH}x{KW} is larger than the padded input {H + 2 * padding}x{W + 2 * padding} "
            f"(input {H}x{W}, padding {padding})"
        )
    return (N, O, (H + 2 * padding - KH) // stride + 1, (W + 2 * padding - KW) // stride + 1)


def maxpool2d_output_shape(x_shape, kernel_size: int, stride: int | None = None, where: str = "maxpool2d") -> tuple:
    """Output shape ``(N, C, P, Q)`` of max pooling, validating every size."""
    x_shape = tuple(x_shape)
    kernel_size = check_int(kernel_size, "kernel_size", where, 1)
    stride = kernel_size if stride is None else check_int(stride, "stride", where, 1)
    check_ndim(x_shape, 4, "x", where, "(N, C, H, W)")
    check_nonempty(x_shape, "x", where)
    N, C, H, W = x_shape
    if kernel_size > H or kernel_size > W:
        raise ValueError(f"{where}: kernel_size {kernel_size} is larger than the input {H}x{W}")
    return (N, C, (H - kernel_size) // stride + 1, (W - kernel_size) // stride + 1)


def _bias(b, n_out: int, be, where: str):
    if b is None:
        return None
    b = to_backend_array(b, be, "bias", where)
    if shape_of(b) != (n_out,):
        raise ValueError(f"{where}: bias must have shape ({n_out},), got {shape_of(b)}")
    return b


# ----------------------------------------------------------------------- conv2d
def conv2d(x, weight, bias=None, stride: int = 1, padding: int = 0, *, backend=None):
    """2-D cross-correlation (PyTorch's ``conv2d``).

    Parameters
    ----------
    x : array-like, (N, C, H, W)
    weight : array-like, (O, C, K, K)
    bias : array-like (O,) or None
    stride, padding : int
        ``stride >= 1``, ``padding >= 0`` (zeros on every side).
    backend : str or Backend, optional

    Returns
    -------
    y : backend array (N, O, P, Q), float32
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "conv2d")
    w = to_backend_array(weight, be, "weight", "conv2d")
    conv2d_output_shape(shape_of(x), shape_of(w), stride, padding)
    b = _bias(bias, w.shape[0], be, "conv2d")
    return be.conv2d_forward(x, w, b, int(stride), int(padding))


def conv2d_backward(x, weight, dy, stride: int = 1, padding: int = 0, *, need_dx: bool = True,
                    need_db: bool = True, backend=None):
    """Gradients of :func:`conv2d`; returns ``(dx, dw, db)`` (overwritten, not accumulated).

    ``dx`` is None unless ``need_dx``; ``db`` is None unless ``need_db``.
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "conv2d_backward")
    w = to_backend_array(weight, be, "weight", "conv2d_backward")
    dy = to_backend_array(dy, be, "dy", "conv2d_backward")
    out = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, "conv2d_backward")
    check_grad_shape(shape_of(dy), out, "conv2d_backward")
    return be.conv2d_backward(x, w, dy, int(stride), int(padding), bool(need_dx), bool(need_db))


# -------------------------------------------------------------------- maxpool2d
def maxpool2d(x, kernel_size: int, stride: int | None = None, *, return_indices: bool = False, backend=None):
    """Max pooling over ``kernel_size`` windows (no padding, floor mode).

    Returns ``y`` (N, C, P, Q), or ``(y, argmax)`` with ``return_indices``:
    argmax is the flat index ``h * W + w`` inside each (H, W) plane: int32, or
    uint16 where the backend stores indices of planes of at most 65,536
    positions compactly (openmp does: half the bytes to write and read back).
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "maxpool2d")
    maxpool2d_output_shape(shape_of(x), kernel_size, stride)
    stride = kernel_size if stride is None else stride
    y, argmax = be.maxpool2d_forward(x, int(kernel_size), int(stride))
    return (y, argmax) if return_indices else y


def _check_argmax(argmax, shape, plane: int, be, where: str, made_by: str) -> None:
    """argmax: the int32 or uint16 backend array of ``shape`` from ``made_by``, every index inside a plane.

    The kernels scatter through these indices with bounds checks off, so an
    index outside ``[0, plane)`` is refused here.
    """
    if not be.is_array(argmax) or argmax.dtype not in (np.int32, np.uint16):
        raise TypeError(f"{where}: argmax must be the integer (int32 or uint16) backend array returned by "
                        f"{made_by}, got {getattr(argmax, 'dtype', type(argmax).__name__)}")
    if shape_of(argmax) != tuple(shape):
        raise ValueError(f"{where}: argmax shape {shape_of(argmax)} must equal {tuple(shape)}")
    host = be.to_numpy(argmax)
    if host.size and (int(host.min()) < 0 or int(host.max()) >= plane):
        raise ValueError(f"{where}: argmax holds indices outside [0, {plane}) (min {int(host.min())}, "
                         f"max {int(host.max())}); pass the argmax {made_by} returned")


def maxpool2d_backward(dy, argmax, x_shape, *, backend=None):
    """Gradient of :func:`maxpool2d` from the cached ``argmax``; returns dx of ``x_shape``."""
    be = _backends.get(backend)
    dy = to_backend_array(dy, be, "dy", "maxpool2d_backward")
    x_shape = tuple(int(s) for s in x_shape)
    check_ndim(x_shape, 4, "x_shape", "maxpool2d_backward", "(N, C, H, W)")
    if x_shape[:2] != shape_of(dy)[:2]:
        raise ValueError(f"maxpool2d_backward: x_shape {x_shape} does not match dy shape {shape_of(dy)}")
    _check_argmax(argmax, shape_of(dy), x_shape[2] * x_shape[3], be, "maxpool2d_backward", "maxpool2d")
    return be.maxpool2d_backward(dy, argmax, x_shape)


# ------------------------------------------------------- fused conv+relu+maxpool
def conv2d_relu_maxpool2d(x, weight, bias=None, stride: int = 1, padding: int = 0, pool_kernel: int = 2,
                          pool_stride: int | None = None, *, backend=None):
    """``maxpool2d(relu(conv2d(x)))`` in one pass; returns ``(y, argmax)``.

    Backends with a fused kernel never write the full (N, O, P, Q) convolution
    output; the maths equals the three unfused ops.
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "conv2d_relu_maxpool2d")
    w = to_backend_array(weight, be, "weight", "conv2d_relu_maxpool2d")
    conv_shape = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, "conv2d_relu_maxpool2d")
    maxpool2d_output_shape(conv_shape, pool_kernel, pool_stride, "conv2d_relu_maxpool2d")
    b = _bias(bias, w.shape[0], be, "conv2d_relu_maxpool2d")
    pool_stride = pool_kernel if pool_stride is None else pool_stride
    return be.conv2d_relu_maxpool2d_forward(x, w, b, int(stride), int(padding), int(pool_kernel), int(pool_stride))


def conv2d_relu_maxpool2d_backward(x, weight, y, argmax, dy, stride: int = 1, padding: int = 0, *,
                                   need_dx: bool = True, need_db: bool = True, backend=None):
    """Gradients of :func:`conv2d_relu_maxpool2d`; returns ``(dx, dw, db)`` (overwritten)."""
    be = _backends.get(backend)
    where = "conv2d_relu_maxpool2d_backward"
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    dy = to_backend_array(dy, be, "dy", where)
    y = to_backend_array(y, be, "y", where)
    N, O, P, Q = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, where)
    check_ndim(shape_of(y), 4, "y", where, "(N, O, PP, QQ)")
    if shape_of(y)[:2] != (N, O) or shape_of(y)[2] > P or shape_of(y)[3] > Q:
        raise ValueError(f"{where}: y shape {shape_of(y)} is not a pooled output of the ({N}, {O}, {P}, {Q}) "
                         "convolution")
    check_grad_shape(shape_of(dy), shape_of(y), where)
    _check_argmax(argmax, shape_of(y), P * Q, be, where, "conv2d_relu_maxpool2d")
    return be.conv2d_relu_maxpool2d_backward(x, w, y, argmax, dy, int(stride), int(padding),
                                             bool(need_dx), bool(need_db))


# ----------------------------------------------------------------------- linear
def linear(x, weight, bias=None, *, backend=None):
    """``y = x @ weight.T + bias``: x (N, F), weight (G, F), bias (G,) -> y (N, G)."""
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "linear")
    w = to_backend_array(weight, be, "weight", "linear")
    _check_linear(shape_of(x), shape_of(w), "linear")
    b = _bias(bias, w.shape[0], be, "linear")
    return be.linear_forward(x, w, b)


def _check_linear(x_shape, w_shape, where):
    check_ndim(x_shape, 2, "x", where, "(N, F)")
    check_ndim(w_shape, 2, "weight", where, "(G, F)")
    check_nonempty(x_shape, "x", where)
    check_nonempty(w_shape, "weight", where)
    if x_shape[1] != w_shape[1]:
        raise ValueError(f"{where}: x has {x_shape[1]} features but weight expects {w_shape[1]} "
                         f"(x shape {x_shape}, weight shape {w_shape})")


def linear_backward(x, weight, dy, *, need_dx: bool = True, need_db: bool = True, backend=None):
    """Gradients of :func:`linear`; returns ``(dx, dw, db)`` (overwritten)."""
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "linear_backward")
    w = to_backend_array(weight, be, "weight", "linear_backward")
    dy = to_backend_array(dy, be, "dy", "linear_backward")
    _check_linear(shape_of(x), shape_of(w), "linear_backward")
    check_grad_shape(shape_of(dy), (x.shape[0], w.shape[0]), "linear_backward")
    return be.linear_backward(x, w, dy, bool(need_dx), bool(need_db))


# ------------------------------------------------------------------ activations
def _elementwise(name, x, be):
    x = to_backend_array(x, be, "x", name)
    check_nonempty(shape_of(x), "x", name)
    return x


def relu(x, *, backend=None):
    """``max(x, 0)`` elementwise."""
    be = _backends.get(backend)
    return be.relu_forward(_elementwise("relu", x, be))


def relu_backward(y, dy, *, backend=None):
    """Gradient of :func:`relu` from its output ``y``."""
    be = _backends.get(backend)
    y = to_backend_array(y, be, "y", "relu_backward")
    dy = to_backend_array(dy, be, "dy", "relu_backward")
    check_grad_shape(shape_of(dy), shape_of(y), "relu_backward")
    return be.relu_backward(y, dy)


def sigmoid(x, *, backend=None):
    """Logistic sigmoid, without overflow for large ``|x|``."""
    be = _backends.get(backend)
    return be.sigmoid_forward(_elementwise("sigmoid", x, be))


def sigmoid_backward(y, dy, *, backend=None):
    """Gradient of :func:`sigmoid` from its output ``y``."""
    be = _backends.get(backend)
    y = to_backend_array(y, be, "y", "sigmoid_backward")
    dy = to_backend_array(dy, be, "dy", "sigmoid_backward")
    check_grad_shape(shape_of(dy), shape_of(y), "sigmoid_backward")
    return be.sigmoid_backward(y, dy)


# ----------------------------------------------------------------------- losses
def check_labels(labels, n: int, n_classes: int, where: str) -> np.ndarray:
    """Validate integer class labels on the host: length ``n``, values in ``[0, n_classes)``."""
    y = to_host_labels(labels, "labels", where)
    if y.ndim != 1:
        raise ValueError(f"{where}: labels must be 1-D (N,), got shape {y.shape}")
    if y.shape[0] != n:
        raise ValueError(f"{where}: got {y.shape[0]} labels for a batch of {n} logits")
    if n and (y.min() < 0 or y.max() >= n_classes):
        bad = y[(y < 0) | (y >= n_classes)][0]
        raise ValueError(f"{where}: labels must be in [0, {n_classes}), found {int(bad)}")
    return y


def softmax_cross_entropy(logits, labels, *, backend=None):
    """Mean softmax cross-entropy of (N, G) logits and (N,) integer labels.

    Returns ``(loss, probs)``: loss a Python float, probs the (N, G) softmax
    kept on the backend for :func:`softmax_cross_entropy_backward`.
    """
    be = _backends.get(backend)
    where = "softmax_cross_entropy"
    logits = to_backend_array(logits, be, "logits", where)
    check_ndim(shape_of(logits), 2, "logits", where, "(N, classes)")
    check_nonempty(shape_of(logits), "logits", where)
    y = check_labels(labels, logits.shape[0], logits.shape[1], where)
    return be.softmax_cross_entropy_forward(logits, be.asarray(y, np.int32))


def softmax_cross_entropy_backward(probs, labels, *, backend=None):
    """``(probs - onehot(labels)) / N``: the gradient of the mean loss w.r.t. the logits."""
    be = _backends.get(backend)
    where = "softmax_cross_entropy_backward"
    probs = to_backend_array(probs, be, "probs", where)
    check_ndim(shape_of(probs), 2, "probs", where, "(N, classes)")
    y = check_labels(labels, probs.shape[0], probs.shape[1], where)
    return be.softmax_cross_entropy_backward(probs, be.asarray(y, np.int32))


def _bce_args(p, targets, be, where):
    p = to_backend_array(p, be, "probabilities", where)
    check_nonempty(shape_of(p), "probabilities", where)
    t = to_backend_array(targets, be, "targets", where)
    if shape_of(t) != shape_of(p):
        raise ValueError(f"{where}: targets shape {shape_of(t)} must equal the probabilities' shape {shape_of(p)}")
    return p, t


def binary_cross_entropy(p, targets, *, eps: float = BCE_EPS, backend=None):
    """Mean binary cross-entropy of probabilities ``p`` and 0/1 ``targets`` (same shape); a float."""
    be = _backends.get(backend)
    eps = check_float(eps, "eps", "binary_cross_entropy", 0.0, 0.5, min_inclusive=False, max_inclusive=False)
    p, t = _bce_args(p, targets, be, "binary_cross_entropy")
    return be.bce_forward(p, t, eps)


def binary_cross_entropy_backward(p, targets, *, eps: float = BCE_EPS, backend=None):
    """Gradient of :func:`binary_cross_entropy` w.r.t. ``p`` (overwritten)."""
    be = _backends.get(backend)
    eps = check_float(eps, "eps", "binary_cross_entropy_backward", 0.0, 0.5, min_inclusive=False, max_inclusive=False)
    p, t = _bce_args(p, targets, be, "binary_cross_entropy_backward")
    return be.bce_backward(p, t, eps)
