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

import math
import weakref
import numpy as np

from . import backends as _backends
from .amp import resolve_precision as _resolve_precision
from ._shapes import conv_pads, out_size, pair
from ._validation import (
    Where,
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
    "conv2d_output_shape",
    "pool2d_output_shape",
    "maxpool2d_output_shape",
    "conv2d",
    "conv2d_backward",
    "maxpool2d",
    "maxpool2d_backward",
    "avgpool2d",
    "avgpool2d_backward",
    "adaptive_avgpool2d",
    "adaptive_avgpool2d_backward",
    "conv2d_relu_maxpool2d",
    "conv2d_relu_maxpool2d_backward",
    "linear",
    "linear_backward",
    "fuses_linear_head",
    "conv2d_relu_maxpool2d_linear",
    "conv2d_relu_maxpool2d_linear_backward",
    "reshape",
    "relu",
    "relu_backward",
    "sigmoid",
    "sigmoid_backward",
    "softmax_cross_entropy",
    "softmax_cross_entropy_backward",
    "binary_cross_entropy",
    "binary_cross_entropy_backward",
    "elu",
    "elu_backward",
    "normalize",
    "normalize_backward",
]

BCE_EPS = 1e-7


# ----------------------------------------------------------------------- shapes
def _legacy_where(where, dilation, groups, default):
    """Callers written before ``dilation``/``groups`` existed pass ``where`` fifth, positionally."""
    if isinstance(dilation, (str, Where)) and groups == 1 and where == default:
        return 1, dilation
    return dilation, where


def _conv_args(x_shape, w_shape, stride, padding, dilation, groups, where):
    """Validate a convolution; returns ``(out_shape, (sh, sw), (top, bottom, left, right), (dh, dw), groups)``."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    stride = pair(stride, "stride", where, 1)
    dilation = pair(dilation, "dilation", where, 1)
    groups = check_int(groups, "groups", where, 1)
    check_ndim(x_shape, 4, "x", where, "(N, C, H, W)")
    check_ndim(w_shape, 4, "weight", where, "(O, C/groups, kH, kW)")
    check_nonempty(x_shape, "x", where)
    check_nonempty(w_shape, "weight", where)
    N, C, H, W = x_shape
    O, Cg, KH, KW = w_shape
    pads = conv_pads(padding, (KH, KW), dilation, stride, where)
    if C % groups or O % groups:
        raise ValueError(f"{where}: groups={groups} must divide both the {C} input channels and the {O} "
                         f"output channels (x shape {x_shape}, weight shape {w_shape})")
    if C // groups != Cg:
        if groups == 1:
            raise ValueError(f"{where}: x has {C} channels but weight expects {Cg} (x shape {x_shape}, "
                             f"weight shape {w_shape})")
        raise ValueError(f"{where}: x has {C} channels, so weight must have C/groups = {C // groups} "
                         f"input channels per filter, got weight shape {w_shape}")
    eh, ew = dilation[0] * (KH - 1) + 1, dilation[1] * (KW - 1) + 1
    Hp, Wp = H + pads[0] + pads[1], W + pads[2] + pads[3]
    if eh > Hp or ew > Wp:
        if dilation == (1, 1) and pads[0] == pads[1] == pads[2] == pads[3]:
            raise ValueError(f"{where}: kernel {KH}x{KW} is larger than the padded input {Hp}x{Wp} "
                             f"(input {H}x{W}, padding {pads[0]})")
        raise ValueError(f"{where}: kernel {KH}x{KW} (dilated {eh}x{ew}) is larger than the padded input "
                         f"{Hp}x{Wp} (input {H}x{W}, padding (top, bottom, left, right) {pads})")
    P = out_size(H, KH, stride[0], pads[0], pads[1], dilation[0])
    Q = out_size(W, KW, stride[1], pads[2], pads[3], dilation[1])
    return (N, O, P, Q), stride, pads, dilation, groups


def _conv_is_square(w_shape, stride, pads, dilation, groups) -> bool:
    """Whether this convolution takes the backends' square path (``conv2d_forward``/``conv2d_backward``:
    square kernel, one stride and padding, no dilation, one group) rather than the general one."""
    return (w_shape[2] == w_shape[3] and stride[0] == stride[1] and pads[0] == pads[1] == pads[2] == pads[3]
            and dilation == (1, 1) and groups == 1)


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups: int = 1,
                        where: str = "conv2d") -> tuple:
    """Output shape ``(N, O, P, Q)`` of a convolution, validating every size.

    ``stride``, ``dilation``: int or ``(h, w)``, each >= 1; ``padding``: int, ``(h, w)``,
    ``"same"`` (stride 1) or ``"valid"``; ``groups`` divides C and O, weight is
    ``(O, C/groups, kH, kW)``. Raises ``ValueError`` for a wrong ndim, a channel
    mismatch, zero sizes or a (dilated) kernel larger than the padded input,
    ``TypeError`` for a non-int argument.
    """
    dilation, where = _legacy_where(where, dilation, groups, "conv2d")
    return _conv_args(x_shape, w_shape, stride, padding, dilation, groups, where)[0]


def _pool_args(x_shape, kernel_size, stride, padding, dilation, where):
    """Validate a pooling; returns ``(out_shape, (kh, kw), (sh, sw), (ph, pw), (dh, dw))``."""
    x_shape = tuple(x_shape)
    kernel = pair(kernel_size, "kernel_size", where, 1)
    stride = kernel if stride is None else pair(stride, "stride", where, 1)
    pads = pair(padding, "padding", where, 0)
    dilation = pair(dilation, "dilation", where, 1)
    check_ndim(x_shape, 4, "x", where, "(N, C, H, W)")
    check_nonempty(x_shape, "x", where)
    if pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        raise ValueError(f"{where}: padding must be at most half the kernel_size, got padding {padding!r} "
                         f"for kernel_size {kernel_size!r}")
    N, C, H, W = x_shape
    eh, ew = dilation[0] * (kernel[0] - 1) + 1, dilation[1] * (kernel[1] - 1) + 1
    if eh > H + 2 * pads[0] or ew > W + 2 * pads[1]:
        if pads == (0, 0) and dilation == (1, 1) and kernel[0] == kernel[1]:
            raise ValueError(f"{where}: kernel_size {kernel[0]} is larger than the input {H}x{W}")
        raise ValueError(f"{where}: kernel_size {kernel_size!r} (dilated {eh}x{ew}) is larger than the padded "
                         f"input {H + 2 * pads[0]}x{W + 2 * pads[1]} (input {H}x{W}, padding {padding!r})")
    P = out_size(H, kernel[0], stride[0], pads[0], pads[0], dilation[0])
    Q = out_size(W, kernel[1], stride[1], pads[1], pads[1], dilation[1])
    return (N, C, P, Q), kernel, stride, pads, dilation


def pool2d_output_shape(x_shape, kernel_size, stride=None, padding=0, dilation=1, where: str = "pool2d") -> tuple:
    """Output shape ``(N, C, P, Q)`` of max or average pooling, validating every size.

    ``kernel_size``, ``stride`` (None: ``kernel_size``), ``padding`` and ``dilation`` are
    ints or ``(h, w)``; padding is at most half the kernel, as PyTorch requires. Floor mode.
    """
    return _pool_args(x_shape, kernel_size, stride, padding, dilation, where)[0]


def maxpool2d_output_shape(x_shape, kernel_size, stride=None, where: str = "maxpool2d", *, padding=0) -> tuple:
    """Output shape ``(N, C, P, Q)`` of max pooling, validating every size (see :func:`pool2d_output_shape`)."""
    return _pool_args(x_shape, kernel_size, stride, padding, 1, where)[0]


def _bias(b, n_out: int, be, where: str):
    if b is None:
        return None
    b = to_backend_array(b, be, "bias", where)
    if shape_of(b) != (n_out,):
        raise ValueError(f"{where}: bias must have shape ({n_out},), got {shape_of(b)}")
    return b


# ----------------------------------------------------------------------- conv2d
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1, *, precision=None,
           backend=None):
    """2-D cross-correlation (PyTorch's ``conv2d``).

    Parameters
    ----------
    x : array-like, (N, C, H, W)
    weight : array-like, (O, C/groups, kH, kW)
    bias : array-like (O,) or None
    stride, dilation : int or (h, w)
        Each >= 1.
    padding : int, (h, w), "same" or "valid"
        Zeros on both sides of each axis; ``"same"`` (stride 1 only) keeps H x W,
        the odd element of an even total on the bottom/right as PyTorch.
    groups : int
        Splits channels and filters into ``groups`` independent convolutions
        (``groups == C`` is depthwise).
    precision : {"fp32", "bf16"}, optional
        ``"bf16"``: x and weight rounded to bfloat16, float32 accumulation and bias
        (see :class:`parconv.autocast`). None (the default) follows the autocast
        mode of this thread.
    backend : str or Backend, optional

    Returns
    -------
    y : backend array (N, O, P, Q), float32
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "conv2d")
    w = to_backend_array(weight, be, "weight", "conv2d")
    _, stride, pads, dilation, groups = _conv_args(shape_of(x), shape_of(w), stride, padding, dilation, groups,
                                                   "conv2d")
    b = _bias(bias, w.shape[0], be, "conv2d")
    bf16 = _resolve_precision(precision, "conv2d") == "bf16"
    if _conv_is_square(w.shape, stride, pads, dilation, groups):
        if bf16:
            return be.conv2d_forward_bf16(x, w, b, stride[0], pads[0])
        return be.conv2d_forward(x, w, b, stride[0], pads[0])
    if bf16:
        return be.conv2d_general_forward_bf16(x, w, b, stride, pads, dilation, groups)
    return be.conv2d_general_forward(x, w, b, stride, pads, dilation, groups)


def conv2d_backward(x, weight, dy, stride=1, padding=0, dilation=1, groups: int = 1, *, need_dx: bool = True,
                    need_db: bool = True, precision=None, backend=None):
    """Gradients of :func:`conv2d`; returns ``(dx, dw, db)`` (overwritten, not accumulated).

    ``dx`` (N, C, H, W) is None unless ``need_dx``; ``dw`` (O, C/groups, kH, kW);
    ``db`` (O,) is None unless ``need_db``. Arguments as :func:`conv2d`; pass the
    ``precision`` the forward ran in (``"bf16"``: dx from bf16 dy and weight, dw from
    bf16 x and dy, db the float32 sum of dy; None follows the autocast mode).
    """
    be = _backends.get(backend)
    where = "conv2d_backward"
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    dy = to_backend_array(dy, be, "dy", where)
    out, stride, pads, dilation, groups = _conv_args(shape_of(x), shape_of(w), stride, padding, dilation, groups,
                                                     where)
    check_grad_shape(shape_of(dy), out, where)
    bf16 = _resolve_precision(precision, where) == "bf16"
    if _conv_is_square(w.shape, stride, pads, dilation, groups):
        if bf16:
            return be.conv2d_backward_bf16(x, w, dy, stride[0], pads[0], bool(need_dx), bool(need_db))
        return be.conv2d_backward(x, w, dy, stride[0], pads[0], bool(need_dx), bool(need_db))
    if bf16:
        return be.conv2d_general_backward_bf16(x, w, dy, stride, pads, dilation, groups, bool(need_dx),
                                               bool(need_db))
    return be.conv2d_general_backward(x, w, dy, stride, pads, dilation, groups, bool(need_dx), bool(need_db))


# -------------------------------------------------------------------- maxpool2d
def maxpool2d(x, kernel_size, stride=None, padding=0, *, return_indices: bool = False, backend=None):
    """Max pooling over ``kernel_size`` windows (floor mode; padded positions are never selected).

    ``kernel_size``, ``stride`` (None: ``kernel_size``) and ``padding`` (at most half the
    kernel) are ints or ``(h, w)``. Returns ``y`` (N, C, P, Q), or ``(y, argmax)`` with
    ``return_indices``: argmax is the flat index ``h * W + w`` inside each (H, W)
    input plane: int32, or uint16 where the backend stores indices of planes of at
    most 65,536 positions compactly (openmp does: half the bytes to write and read
    back).
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "maxpool2d")
    _, kernel, stride, pads, _ = _pool_args(shape_of(x), kernel_size, stride, padding, 1, "maxpool2d")
    if kernel[0] == kernel[1] and stride[0] == stride[1] and pads == (0, 0):
        y, argmax = be.maxpool2d_forward(x, kernel[0], stride[0])
    else:
        y, argmax = be.maxpool2d_general_forward(x, kernel, stride, pads)
    return (y, _produced(argmax)) if return_indices else y


#: argmax arrays our forward ops returned, by id: their backward skips the range scan
_PRODUCED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _produced(argmax):
    """Mark ``argmax`` as written by a forward op here (so trusted by the backward) and return it."""
    try:
        _PRODUCED[id(argmax)] = argmax
    except TypeError:  # an array type without weak references is simply checked every time
        pass
    return argmax


def _check_argmax(argmax, shape, plane: int, be, where: str, made_by: str) -> None:
    """argmax: the int32 or uint16 backend array of ``shape`` from ``made_by``.

    The kernels scatter through these indices with bounds checks off. Host
    backends' indices are checked to lie in ``[0, plane)`` here (no copy); a
    device backend's are not read back to the host: its kernels skip an index
    outside the plane instead.
    """
    if not be.is_array(argmax) or argmax.dtype not in (np.int32, np.uint16):
        raise TypeError(f"{where}: argmax must be the integer (int32 or uint16) backend array returned by "
                        f"{made_by}, got {getattr(argmax, 'dtype', type(argmax).__name__)}")
    if shape_of(argmax) != tuple(shape):
        raise ValueError(f"{where}: argmax shape {shape_of(argmax)} must equal {tuple(shape)}")
    if _PRODUCED.get(id(argmax)) is argmax:
        return  # written by one of our forward ops: in range by construction, no scan
    if getattr(be, "host_arrays", False) and isinstance(argmax, np.ndarray) and argmax.size:
        lo, hi = int(argmax.min()), int(argmax.max())
        if lo < 0 or hi >= plane:
            raise ValueError(f"{where}: argmax holds indices outside [0, {plane}) (min {lo}, max {hi}); "
                             f"pass the argmax {made_by} returned")


def maxpool2d_backward(dy, argmax, x_shape, *, backend=None):
    """Gradient of :func:`maxpool2d` from the cached ``argmax``; returns dx of ``x_shape`` (overwritten).

    Works for every kernel, stride and padding: argmax already names each
    window's input position.
    """
    be = _backends.get(backend)
    dy = to_backend_array(dy, be, "dy", "maxpool2d_backward")
    x_shape = _x_shape(x_shape, "maxpool2d_backward")
    check_ndim(shape_of(dy), 4, "dy", "maxpool2d_backward", "(N, C, P, Q)")
    if x_shape[:2] != shape_of(dy)[:2]:
        raise ValueError(f"maxpool2d_backward: x_shape {x_shape} does not match dy shape {shape_of(dy)}")
    _check_argmax(argmax, shape_of(dy), x_shape[2] * x_shape[3], be, "maxpool2d_backward", "maxpool2d")
    return be.maxpool2d_backward(dy, argmax, x_shape)


def _x_shape(x_shape, where: str) -> tuple:
    """``x_shape`` of a backward as a 4-tuple of positive ints."""
    try:
        x_shape = tuple(x_shape)
    except TypeError:
        raise TypeError(f"{where}: x_shape must be a tuple (N, C, H, W), got {x_shape!r}") from None
    x_shape = tuple(check_int(s, "x_shape", where, 1) for s in x_shape)
    check_ndim(x_shape, 4, "x_shape", where, "(N, C, H, W)")
    return x_shape


# -------------------------------------------------------------------- avgpool2d
def avgpool2d(x, kernel_size, stride=None, padding=0, *, backend=None):
    """Average pooling (PyTorch's defaults: zero padding counted in the average, floor mode).

    ``kernel_size``, ``stride`` (None: ``kernel_size``) and ``padding`` (at most half the
    kernel) are ints or ``(h, w)``. x (N, C, H, W) -> y (N, C, P, Q); every window
    is divided by ``kH * kW``.
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "avgpool2d")
    _, kernel, stride, pads, _ = _pool_args(shape_of(x), kernel_size, stride, padding, 1, "avgpool2d")
    return be.avgpool2d_forward(x, kernel, stride, pads)


def avgpool2d_backward(dy, x_shape, kernel_size, stride=None, padding=0, *, backend=None):
    """Gradient of :func:`avgpool2d`; returns dx of ``x_shape`` (overwritten)."""
    be = _backends.get(backend)
    where = "avgpool2d_backward"
    dy = to_backend_array(dy, be, "dy", where)
    x_shape = _x_shape(x_shape, where)
    out, kernel, stride, pads, _ = _pool_args(x_shape, kernel_size, stride, padding, 1, where)
    check_grad_shape(shape_of(dy), out, where)
    return be.avgpool2d_backward(dy, x_shape, kernel, stride, pads)


# ---------------------------------------------------------- adaptive_avgpool2d
def _adaptive_size(output_size, x_shape, where: str) -> tuple:
    out = pair(output_size, "output_size", where, 1)
    check_ndim(x_shape, 4, "x", where, "(N, C, H, W)")
    check_nonempty(x_shape, "x", where)
    return out


def adaptive_avgpool2d(x, output_size, *, backend=None):
    """Adaptive average pooling to ``output_size`` (int or ``(P, Q)``), PyTorch's windows.

    Output row ``i`` averages input rows ``floor(i H / P)`` to ``ceil((i + 1) H / P)``
    (exclusive), columns likewise; ``output_size=1`` is global average pooling.
    x (N, C, H, W) -> y (N, C, P, Q).
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "adaptive_avgpool2d")
    out = _adaptive_size(output_size, shape_of(x), "adaptive_avgpool2d")
    return be.adaptive_avgpool2d_forward(x, out)


def adaptive_avgpool2d_backward(dy, x_shape, output_size, *, backend=None):
    """Gradient of :func:`adaptive_avgpool2d`; returns dx of ``x_shape`` (overwritten)."""
    be = _backends.get(backend)
    where = "adaptive_avgpool2d_backward"
    dy = to_backend_array(dy, be, "dy", where)
    x_shape = _x_shape(x_shape, where)
    out = _adaptive_size(output_size, x_shape, where)
    check_grad_shape(shape_of(dy), x_shape[:2] + out, where)
    return be.adaptive_avgpool2d_backward(dy, x_shape, out)


# ------------------------------------------------------- fused conv+relu+maxpool
def _check_fused_ints(w_shape, stride, padding, pool_kernel, pool_stride, where) -> None:
    """The fused ops take a square kernel and int stride, padding and pooling arguments only."""
    check_int(stride, "stride", where, 1)
    check_int(padding, "padding", where, 0)
    check_int(pool_kernel, "pool_kernel", where, 1)
    if pool_stride is not None:
        check_int(pool_stride, "pool_stride", where, 1)
    if len(w_shape) == 4 and w_shape[2] != w_shape[3]:
        raise ValueError(f"{where}: the fused op takes a square kernel, got weight shape {w_shape}")


def conv2d_relu_maxpool2d(x, weight, bias=None, stride: int = 1, padding: int = 0, pool_kernel: int = 2,
                          pool_stride: int | None = None, *, precision=None, backend=None):
    """``maxpool2d(relu(conv2d(x)))`` in one pass; returns ``(y, argmax)``.

    Backends with a fused kernel never write the full (N, O, P, Q) convolution
    output; the maths equals the three unfused ops. With ``precision="bf16"`` (or
    under :class:`parconv.autocast`) the bf16 convolution runs and the three ops compose.
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "conv2d_relu_maxpool2d")
    w = to_backend_array(weight, be, "weight", "conv2d_relu_maxpool2d")
    _check_fused_ints(shape_of(w), stride, padding, pool_kernel, pool_stride, "conv2d_relu_maxpool2d")
    conv_shape = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, "conv2d_relu_maxpool2d")
    maxpool2d_output_shape(conv_shape, pool_kernel, pool_stride, "conv2d_relu_maxpool2d")
    b = _bias(bias, w.shape[0], be, "conv2d_relu_maxpool2d")
    pool_stride = pool_kernel if pool_stride is None else pool_stride
    if _resolve_precision(precision, "conv2d_relu_maxpool2d") == "bf16":
        y, argmax = be.conv2d_relu_maxpool2d_forward_bf16(x, w, b, int(stride), int(padding), int(pool_kernel),
                                                          int(pool_stride))
    else:
        y, argmax = be.conv2d_relu_maxpool2d_forward(x, w, b, int(stride), int(padding), int(pool_kernel),
                                                     int(pool_stride))
    return y, _produced(argmax)


def _pool_overlaps(pool_kernel, pool_stride, where) -> bool:
    """Whether the forward's pooling windows overlapped (unknown: assume they did)."""
    if pool_kernel is None:
        return True
    kernel = check_int(pool_kernel, "pool_kernel", where, 1)
    stride = kernel if pool_stride is None else check_int(pool_stride, "pool_stride", where, 1)
    return stride < kernel


def conv2d_relu_maxpool2d_backward(x, weight, y, argmax, dy, stride: int = 1, padding: int = 0, *,
                                   need_dx: bool = True, need_db: bool = True, precision=None,
                                   pool_kernel: int | None = None, pool_stride: int | None = None, backend=None):
    """Gradients of :func:`conv2d_relu_maxpool2d`; returns ``(dx, dw, db)`` (overwritten).

    ``precision``: the one the forward ran in (None follows the autocast mode).
    ``pool_kernel``, ``pool_stride``: the forward's pooling, where known; in bf16,
    windows that do not overlap let a backend run the gradient fused.
    """
    be = _backends.get(backend)
    where = "conv2d_relu_maxpool2d_backward"
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    dy = to_backend_array(dy, be, "dy", where)
    y = to_backend_array(y, be, "y", where)
    _check_fused_ints(shape_of(w), stride, padding, 2, None, where)
    N, O, P, Q = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, where)
    check_ndim(shape_of(y), 4, "y", where, "(N, O, PP, QQ)")
    if shape_of(y)[:2] != (N, O) or shape_of(y)[2] > P or shape_of(y)[3] > Q:
        raise ValueError(f"{where}: y shape {shape_of(y)} is not a pooled output of the ({N}, {O}, {P}, {Q}) "
                         "convolution")
    check_grad_shape(shape_of(dy), shape_of(y), where)
    _check_argmax(argmax, shape_of(y), P * Q, be, where, "conv2d_relu_maxpool2d")
    if _resolve_precision(precision, where) == "bf16":
        return be.conv2d_relu_maxpool2d_backward_bf16(x, w, y, argmax, dy, int(stride), int(padding),
                                                      bool(need_dx), bool(need_db),
                                                      _pool_overlaps(pool_kernel, pool_stride, where))
    return be.conv2d_relu_maxpool2d_backward(x, w, y, argmax, dy, int(stride), int(padding),
                                             bool(need_dx), bool(need_db))


# ----------------------------------------------------------------------- linear
def linear(x, weight, bias=None, *, precision=None, backend=None):
    """``y = x @ weight.T + bias``: x (N, F), weight (G, F), bias (G,) -> y (N, G).

    ``precision="bf16"``: x and weight rounded to bfloat16, float32 accumulation and
    bias; None (the default) follows the autocast mode (:class:`parconv.autocast`).
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "linear")
    w = to_backend_array(weight, be, "weight", "linear")
    _check_linear(shape_of(x), shape_of(w), "linear")
    b = _bias(bias, w.shape[0], be, "linear")
    if _resolve_precision(precision, "linear") == "bf16":
        return be.linear_forward_bf16(x, w, b)
    return be.linear_forward(x, w, b)


def _linear_checked(x, weight, bias, backend):
    """:func:`linear` in float32 on arrays that :func:`linear` already accepted with these shapes
    (a layer calling it again with the same shapes; the backend still guards its kernel)."""
    return backend.linear_forward(x, weight, bias)


def _check_linear(x_shape, w_shape, where):
    check_ndim(x_shape, 2, "x", where, "(N, F)")
    check_ndim(w_shape, 2, "weight", where, "(G, F)")
    check_nonempty(x_shape, "x", where)
    check_nonempty(w_shape, "weight", where)
    if x_shape[1] != w_shape[1]:
        raise ValueError(f"{where}: x has {x_shape[1]} features but weight expects {w_shape[1]} "
                         f"(x shape {x_shape}, weight shape {w_shape})")


def linear_backward(x, weight, dy, *, need_dx: bool = True, need_db: bool = True, precision=None, backend=None):
    """Gradients of :func:`linear`; returns ``(dx, dw, db)`` (overwritten).

    ``precision``: the one the forward ran in (``"bf16"``: dx from bf16 dy and weight,
    dw from bf16 x and dy, db the float32 sum of dy; None follows the autocast mode).
    """
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "linear_backward")
    w = to_backend_array(weight, be, "weight", "linear_backward")
    dy = to_backend_array(dy, be, "dy", "linear_backward")
    _check_linear(shape_of(x), shape_of(w), "linear_backward")
    check_grad_shape(shape_of(dy), (x.shape[0], w.shape[0]), "linear_backward")
    if _resolve_precision(precision, "linear_backward") == "bf16":
        return be.linear_backward_bf16(x, w, dy, bool(need_dx), bool(need_db))
    return be.linear_backward(x, w, dy, bool(need_dx), bool(need_db))


# ------------------------------------------- fused conv+relu+maxpool+flatten+linear
def fuses_linear_head(in_features: int, out_features: int, *, backend=None) -> bool:
    """Whether ``backend`` runs :func:`conv2d_relu_maxpool2d_linear` as one kernel for this head size."""
    return bool(_backends.get(backend).fuses_linear_head(int(in_features), int(out_features)))


def conv2d_relu_maxpool2d_linear(x, weight, bias, head_weight, head_bias=None, stride: int = 1, padding: int = 0,
                                 pool_kernel: int = 2, pool_stride: int | None = None, *, precision=None,
                                 backend=None):
    """``linear(flatten(maxpool2d(relu(conv2d(x)))))`` in one pass; returns ``(y, argmax, logits)``.

    ``y`` and ``argmax`` are the pooled activations and their indices (as
    :func:`conv2d_relu_maxpool2d` returns them); ``logits`` (N, G) the head's output.
    With ``precision="bf16"`` (or under :class:`parconv.autocast`) the bf16
    convolution and linear run and the ops compose.
    """
    be = _backends.get(backend)
    where = "conv2d_relu_maxpool2d_linear"
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    wl = to_backend_array(head_weight, be, "head_weight", where)
    conv_shape = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, where)
    pooled = maxpool2d_output_shape(conv_shape, pool_kernel, pool_stride, where)
    _check_linear((pooled[0], pooled[1] * pooled[2] * pooled[3]), shape_of(wl), where)
    b = _bias(bias, w.shape[0], be, where)
    bl = _bias(head_bias, wl.shape[0], be, where)
    pool_stride = pool_kernel if pool_stride is None else pool_stride
    if _resolve_precision(precision, where) == "bf16":
        y, argmax = be.conv2d_relu_maxpool2d_forward_bf16(x, w, b, int(stride), int(padding), int(pool_kernel),
                                                          int(pool_stride))
        logits = be.linear_forward_bf16(be.reshape(y, (y.shape[0], wl.shape[1])), wl, bl)
        return y, _produced(argmax), logits
    y, argmax, logits = be.conv2d_relu_maxpool2d_linear_forward(x, w, b, int(stride), int(padding),
                                                                int(pool_kernel), int(pool_stride), wl, bl)
    return y, _produced(argmax), logits


def conv2d_relu_maxpool2d_linear_backward(x, weight, y, argmax, head_weight, dlogits, stride: int = 1,
                                          padding: int = 0, *, need_dx: bool = True, need_db: bool = True,
                                          need_head_db: bool = True, precision=None, pool_kernel: int | None = None,
                                          pool_stride: int | None = None, backend=None):
    """Gradients of :func:`conv2d_relu_maxpool2d_linear` from the head's output gradient.

    Returns ``(dx, dw, db, head_dw, head_db)`` (overwritten, not accumulated).
    ``precision``, ``pool_kernel``, ``pool_stride``: as :func:`conv2d_relu_maxpool2d_backward`.
    """
    be = _backends.get(backend)
    where = "conv2d_relu_maxpool2d_linear_backward"
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    wl = to_backend_array(head_weight, be, "head_weight", where)
    dlogits = to_backend_array(dlogits, be, "dlogits", where)
    N, O, P, Q = conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, where)
    ys = shape_of(y)
    check_ndim(ys, 4, "y", where, "(N, O, PP, QQ)")
    if ys[:2] != (N, O) or ys[2] > P or ys[3] > Q:
        raise ValueError(f"{where}: y shape {ys} is not a pooled output of the ({N}, {O}, {P}, {Q}) convolution")
    _check_linear((ys[0], ys[1] * ys[2] * ys[3]), shape_of(wl), where)
    check_grad_shape(shape_of(dlogits), (ys[0], wl.shape[0]), where)
    _check_argmax(argmax, ys, P * Q, be, where, "conv2d_relu_maxpool2d_linear")
    if _resolve_precision(precision, where) == "bf16":
        yf = be.reshape(y, (ys[0], wl.shape[1]))
        dyf, dwl, dbl = be.linear_backward_bf16(yf, wl, dlogits, True, bool(need_head_db))
        dx, dw, db = be.conv2d_relu_maxpool2d_backward_bf16(x, w, y, argmax, be.reshape(dyf, ys), int(stride),
                                                            int(padding), bool(need_dx), bool(need_db),
                                                            _pool_overlaps(pool_kernel, pool_stride, where))
        return dx, dw, db, dwl, dbl
    return be.conv2d_relu_maxpool2d_linear_backward(x, w, y, argmax, wl, dlogits, int(stride), int(padding),
                                                    bool(need_dx), bool(need_db), bool(need_head_db))


# ----------------------------------------------------------------------- shapes
def reshape(x, shape, *, backend=None):
    """``x`` viewed with ``shape`` (same number of elements); no copy where the backend can avoid one."""
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", "reshape")
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != math.prod(shape_of(x)):
        raise ValueError(f"reshape: cannot view an array of shape {shape_of(x)} as {shape}")
    return be.reshape(x, shape)


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
def _check_labels(labels, n: int, n_classes: int, where: str) -> np.ndarray:
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


def softmax_cross_entropy(logits, labels, *, label_smoothing: float = 0.0, backend=None):
    """Mean softmax cross-entropy of (N, G) logits and (N,) integer labels.

    Returns ``(loss, probs)``: loss a Python float, probs the (N, G) softmax
    kept on the backend for :func:`softmax_cross_entropy_backward`.
    ``label_smoothing`` s in [0, 1] mixes the one-hot target with the uniform
    one, ``(1 - s) onehot + s / G`` (PyTorch's semantics).
    """
    be = _backends.get(backend)
    where = "softmax_cross_entropy"
    s = _check_label_smoothing(label_smoothing, where)
    logits = to_backend_array(logits, be, "logits", where)
    check_ndim(shape_of(logits), 2, "logits", where, "(N, classes)")
    check_nonempty(shape_of(logits), "logits", where)
    y = _check_labels(labels, logits.shape[0], logits.shape[1], where)
    if s:
        return be.softmax_cross_entropy_smoothed_forward(logits, be.asarray(y, np.int32), s)
    return be.softmax_cross_entropy_forward(logits, be.asarray(y, np.int32))


def softmax_cross_entropy_backward(probs, labels, *, label_smoothing: float = 0.0, backend=None):
    """``(probs - target) / N``: the gradient of the mean loss w.r.t. the logits, with target
    ``onehot(labels)``, or ``(1 - s) onehot + s / G`` for ``label_smoothing`` s."""
    be = _backends.get(backend)
    where = "softmax_cross_entropy_backward"
    s = _check_label_smoothing(label_smoothing, where)
    probs = to_backend_array(probs, be, "probs", where)
    check_ndim(shape_of(probs), 2, "probs", where, "(N, classes)")
    y = _check_labels(labels, probs.shape[0], probs.shape[1], where)
    if s:
        return be.softmax_cross_entropy_smoothed_backward(probs, be.asarray(y, np.int32), s)
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


# ==================================================================================
# Normalisation, dropout, more activations, add, MSE and label smoothing
# (x for batch norm: (N, C), (N, C, L) or (N, C, H, W); statistics over every dim but 1)
# ==================================================================================
__all__ += [
    "BatchNormSaved",
    "batch_norm",
    "conv2d_batch_norm_eval",
    "batch_norm_backward",
    "dropout",
    "dropout_backward",
    "leaky_relu",
    "leaky_relu_backward",
    "tanh",
    "tanh_backward",
    "softmax",
    "softmax_backward",
    "add",
    "mse_loss",
    "mse_loss_backward",
]


class BatchNormSaved(tuple):
    """What :func:`batch_norm` hands to :func:`batch_norm_backward`: ``(training, mean, invstd, y)``.

    ``mean`` and ``invstd`` (C,) are backend arrays (the statistics the forward
    normalised with); ``y`` is the forward output when a ReLU was fused, else None.
    """

    __slots__ = ()

    def __new__(cls, training, mean, invstd, y):
        return tuple.__new__(cls, (bool(training), mean, invstd, y))

    training = property(lambda self: self[0])
    mean = property(lambda self: self[1])
    invstd = property(lambda self: self[2])
    y = property(lambda self: self[3])


def _check_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _bn_input(x, be, where: str):
    x = to_backend_array(x, be, "x", where)
    shape = shape_of(x)
    if len(shape) not in (2, 3, 4):
        raise ValueError(f"{where}: x must be 2-D (N, C), 3-D (N, C, L) or 4-D (N, C, H, W), got shape {shape}")
    check_nonempty(shape, "x", where)
    return x


def _bn_channel_param(a, C: int, name: str, be, where: str, per: str = ""):
    """One entry per channel (``per``: what the C channels are, for the message; x's by default)."""
    if a is None:
        return None
    a = to_backend_array(a, be, name, where)
    if shape_of(a) != (C,):
        raise ValueError(f"{where}: {name} must have shape ({C},) {per or f'for x with {C} channels'}, "
                         f"got {shape_of(a)}")
    return a


def _bn_running(a, C: int, name: str, be, where: str):
    """A running statistic: updated in place, so it must already be a float32 (C,) backend array."""
    if not be.is_array(a) or a.dtype != np.float32:
        raise TypeError(f"{where}: {name} must be a float32 array of backend {be.name!r} (it is updated in "
                        f"place), got {type(a).__name__} {getattr(a, 'dtype', '')}")
    if shape_of(a) != (C,):
        raise ValueError(f"{where}: {name} must have shape ({C},) for x with {C} channels, got {shape_of(a)}")
    if be.host_arrays and not a.flags.c_contiguous:
        raise ValueError(f"{where}: {name} must be C-contiguous")
    return a


def batch_norm(x, weight, bias, running_mean, running_var, *, training, momentum: float = 0.1,
               eps: float = 1e-5, relu: bool = False, residual=None, backend=None):
    """Batch normalisation (PyTorch's ``F.batch_norm``), with an optional fused ReLU.

    Parameters
    ----------
    x : array-like, (N, C), (N, C, L) or (N, C, H, W)
        Statistics run over every dim but 1 (``M = N * L`` or ``N * H * W`` values per channel).
    weight, bias : array-like (C,) or None
        The affine transform; None is ``affine=False``.
    running_mean, running_var : backend float32 arrays (C,) or None
        ``training=True``: updated in place when given, ``running = (1 - momentum) *
        running + momentum * batch`` with the *unbiased* batch variance (as PyTorch).
        ``training=False``: the statistics x is normalised with (required).
    training : bool
        Normalise with the batch's mean and biased variance (needs ``M > 1``), or
        with the running statistics.
    momentum : float in [0, 1]
    eps : float > 0
    relu : bool
        Apply ``max(y, 0)`` after the transform (BatchNorm + ReLU in one pass).
    residual : array-like of x's shape, optional
        Added to the normalised values before the ReLU: a residual block's
        ``relu(bn(body) + shortcut)`` in one pass.

    Returns
    -------
    y : backend array, float32, the shape of x
    saved : BatchNormSaved
        The statistics (and y when ``relu``) that :func:`batch_norm_backward` needs.
    """
    where = "batch_norm"
    be = _backends.get(backend)
    training = _check_bool(training, "training", where)
    relu = _check_bool(relu, "relu", where)
    momentum = check_float(momentum, "momentum", where, 0.0, 1.0)
    eps = check_float(eps, "eps", where, 0.0, min_inclusive=False)
    x = _bn_input(x, be, where)
    C = x.shape[1]
    w = _bn_channel_param(weight, C, "weight", be, where)
    b = _bn_channel_param(bias, C, "bias", be, where)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{where}: running_mean and running_var must both be given or both be None")
    rm = None if running_mean is None else _bn_running(running_mean, C, "running_mean", be, where)
    rv = None if running_var is None else _bn_running(running_var, C, "running_var", be, where)
    r = None
    if residual is not None:
        r = to_backend_array(residual, be, "residual", where)
        if shape_of(r) != shape_of(x):
            raise ValueError(f"{where}: residual must have x's shape {shape_of(x)}, got {shape_of(r)}")
    if training:
        count = x.size // C
        if count < 2:
            raise ValueError(f"{where}: training needs more than 1 value per channel, got x of shape {shape_of(x)} "
                             "(a last batch of 1 sample? pass drop_last=True to the DataLoader)")
        y, mean, invstd = be.batch_norm_forward_train(x, w, b, rm, rv, momentum, eps, relu, r)
    else:
        if rm is None:
            raise ValueError(f"{where}: training=False normalises with running_mean and running_var, got None")
        y, mean, invstd = be.batch_norm_forward_eval(x, w, b, rm, rv, eps, relu, r)
    return y, BatchNormSaved(training, mean, invstd, y if relu else None)


def conv2d_batch_norm_eval(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, stride: int = 1,
                           padding: int = 0, *, eps: float = 1e-5, relu: bool = False, precision=None, backend=None):
    """``batch_norm(conv2d(x, weight, bias), training=False)``, then ReLU when ``relu``, in one op.

    Eval-mode batch norm is a per-channel affine map, so it folds into the
    convolution: ``y = conv2d(x, weight) * scale + shift`` with ``scale =
    bn_weight / sqrt(running_var + eps)`` and ``shift = bn_bias + (bias -
    running_mean) * scale``. The OpenMP backend applies it, and the ReLU, as the
    convolution stores its output (one pass over y instead of three); others
    compose the two ops. Square kernel, int stride and padding, one group; the
    weights themselves are never modified.

    Parameters
    ----------
    x : array-like (N, C, H, W)
    weight : array-like (O, C, K, K); bias : (O,) or None
        The convolution.
    bn_weight, bn_bias : array-like (O,) or None
        The batch norm's affine transform (None: ``affine=False``).
    running_mean, running_var : array-like (O,)
        The statistics to normalise with.
    stride, padding : int
    eps : float > 0
    relu : bool
    precision : {"fp32", "bf16"}, optional
        ``"bf16"`` runs the bf16 convolution and then the (float32) batch norm; None
        follows the autocast mode (:class:`parconv.autocast`).
    """
    where = "conv2d_batch_norm_eval"
    be = _backends.get(backend)
    x = to_backend_array(x, be, "x", where)
    w = to_backend_array(weight, be, "weight", where)
    _check_fused_ints(shape_of(w), stride, padding, 1, None, where)
    conv2d_output_shape(shape_of(x), shape_of(w), stride, padding, where)
    eps = check_float(eps, "eps", where, 0.0, min_inclusive=False)
    relu = _check_bool(relu, "relu", where)
    O = shape_of(w)[0]
    b = _bias(bias, O, be, where)
    if (bn_weight is None) != (bn_bias is None):
        raise ValueError(f"{where}: bn_weight and bn_bias must both be given or both be None (affine=False)")
    if running_mean is None or running_var is None:
        raise ValueError(f"{where}: running_mean and running_var are required (eval mode normalises with them)")
    per = f"(one entry per filter of weight {shape_of(w)})"
    g, beta, rm, rv = (_bn_channel_param(a, O, name, be, where, per)
                       for name, a in (("bn_weight", bn_weight), ("bn_bias", bn_bias),
                                       ("running_mean", running_mean), ("running_var", running_var)))
    if _resolve_precision(precision, where) == "bf16":
        z = be.conv2d_forward_bf16(x, w, b, int(stride), int(padding))
        return be.batch_norm_forward_eval(z, g, beta, rm, rv, eps, relu)[0]
    return be.conv2d_batch_norm_eval_forward(x, w, b, g, beta, rm, rv, eps, int(stride), int(padding), relu)


def batch_norm_backward(x, weight, dy, saved, *, need_dx: bool = True, backend=None):
    """Gradients of :func:`batch_norm`; returns ``(dx, dweight, dbias)`` (overwritten).

    ``saved`` is what the forward returned. In training mode the batch
    statistics depend on x and their gradient flows into dx; in eval mode they
    are constants. dx is None unless ``need_dx``; dweight and dbias (C,) are
    None when ``weight`` is None.
    """
    where = "batch_norm_backward"
    be = _backends.get(backend)
    if not isinstance(saved, BatchNormSaved):
        raise TypeError(f"{where}: saved must be the BatchNormSaved that batch_norm returned, "
                        f"got {type(saved).__name__}")
    x = _bn_input(x, be, where)
    C = x.shape[1]
    w = _bn_channel_param(weight, C, "weight", be, where)
    dy = to_backend_array(dy, be, "dy", where)
    check_grad_shape(shape_of(dy), shape_of(x), where)
    for name, a in (("mean", saved.mean), ("invstd", saved.invstd)):
        if not be.is_array(a) or shape_of(a) != (C,):
            raise ValueError(f"{where}: saved.{name} must be a ({C},) array of backend {be.name!r}; pass the "
                             "saved value batch_norm returned for this x")
    y = saved.y
    if y is not None and (not be.is_array(y) or shape_of(y) != shape_of(x)):
        raise ValueError(f"{where}: saved.y must be the forward output of shape {shape_of(x)}")
    return be.batch_norm_backward(x, w, dy, saved.mean, saved.invstd, y, saved.training, bool(need_dx))


def _dropout_args(p, seed, where: str):
    p = check_float(p, "p", where, 0.0, 1.0)
    seed = check_int(seed, "seed", where, 0)
    if seed >= 1 << 64:
        raise ValueError(f"{where}: seed must be a uint64 (< 2**64), got {seed}")
    return p, seed


def dropout(x, p: float, seed: int, *, backend=None):
    """Inverted dropout: each element kept with probability ``1 - p`` and scaled by ``1 / (1 - p)``.

    The keep mask is a counter-based hash of ``(seed, flat index)``, the same on
    every backend, so no mask is stored: :func:`dropout_backward` recomputes it.

    Parameters
    ----------
    x : array-like, any shape
    p : float in [0, 1]
        Drop probability (1 gives zeros).
    seed : int in [0, 2**64)
        Draw a fresh one per call (e.g. ``rng.integers(2**64, dtype=np.uint64)``).

    Returns
    -------
    y : backend array, float32, the shape of x
    """
    be = _backends.get(backend)
    p, seed = _dropout_args(p, seed, "dropout")
    return be.dropout_forward(_elementwise("dropout", x, be), p, seed)


def dropout_backward(dy, p: float, seed: int, *, backend=None):
    """Gradient of :func:`dropout` with the same ``p`` and ``seed``: ``dy`` through the same mask."""
    be = _backends.get(backend)
    p, seed = _dropout_args(p, seed, "dropout_backward")
    dy = to_backend_array(dy, be, "dy", "dropout_backward")
    check_nonempty(shape_of(dy), "dy", "dropout_backward")
    return be.dropout_backward(dy, p, seed)


def _slope(negative_slope, where):
    return check_float(negative_slope, "negative_slope", where)


def leaky_relu(x, negative_slope: float = 0.01, *, backend=None):
    """``x if x > 0 else negative_slope * x`` elementwise."""
    be = _backends.get(backend)
    slope = _slope(negative_slope, "leaky_relu")
    return be.leaky_relu_forward(_elementwise("leaky_relu", x, be), slope)


def leaky_relu_backward(x, dy, negative_slope: float = 0.01, *, backend=None):
    """Gradient of :func:`leaky_relu` from its *input* ``x``."""
    be = _backends.get(backend)
    slope = _slope(negative_slope, "leaky_relu_backward")
    x = to_backend_array(x, be, "x", "leaky_relu_backward")
    dy = to_backend_array(dy, be, "dy", "leaky_relu_backward")
    check_grad_shape(shape_of(dy), shape_of(x), "leaky_relu_backward")
    return be.leaky_relu_backward(x, dy, slope)


def tanh(x, *, backend=None):
    """Hyperbolic tangent elementwise."""
    be = _backends.get(backend)
    return be.tanh_forward(_elementwise("tanh", x, be))


def tanh_backward(y, dy, *, backend=None):
    """Gradient of :func:`tanh` from its output ``y``: ``dy * (1 - y**2)``."""
    be = _backends.get(backend)
    y = to_backend_array(y, be, "y", "tanh_backward")
    dy = to_backend_array(dy, be, "dy", "tanh_backward")
    check_grad_shape(shape_of(dy), shape_of(y), "tanh_backward")
    return be.tanh_backward(y, dy)


def elu(x, alpha: float = 1.0, *, backend=None):
    """ELU elementwise: ``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    be = _backends.get(backend)
    alpha = check_float(alpha, "alpha", "elu")
    return be.elementwise_forward("elu", _elementwise("elu", x, be), (alpha,))


def elu_backward(y, dy, alpha: float = 1.0, *, backend=None):
    """Gradient of :func:`elu` from its output ``y``: ``dy`` where ``y > 0``, else ``dy * (y + alpha)``."""
    be = _backends.get(backend)
    alpha = check_float(alpha, "alpha", "elu_backward")
    y = to_backend_array(y, be, "y", "elu_backward")
    dy = to_backend_array(dy, be, "dy", "elu_backward")
    check_grad_shape(shape_of(dy), shape_of(y), "elu_backward")
    return be.elementwise_backward("elu", y, dy, (alpha,))


def _softmax_dim(dim, ndim: int, where: str) -> int:
    dim = check_int(dim, "dim", where, -(1 << 62))
    if not -ndim <= dim < ndim:
        raise ValueError(f"{where}: dim must be in [{-ndim}, {ndim}) for a {ndim}-D input, got {dim}")
    return dim % ndim


def softmax(x, dim: int = 1, *, backend=None):
    """Numerically stable softmax along ``dim`` (negative counts from the end) of x of any rank."""
    be = _backends.get(backend)
    x = _elementwise("softmax", x, be)
    return be.softmax_forward(x, _softmax_dim(dim, len(shape_of(x)), "softmax"))


def softmax_backward(y, dy, dim: int = 1, *, backend=None):
    """Gradient of :func:`softmax` from its output ``y``: ``y * (dy - sum(dy * y, dim))``."""
    be = _backends.get(backend)
    y = to_backend_array(y, be, "y", "softmax_backward")
    dy = to_backend_array(dy, be, "dy", "softmax_backward")
    check_nonempty(shape_of(y), "y", "softmax_backward")
    check_grad_shape(shape_of(dy), shape_of(y), "softmax_backward")
    return be.softmax_backward(y, dy, _softmax_dim(dim, len(shape_of(y)), "softmax_backward"))


def add(a, b, *, relu: bool = False, backend=None):
    """``a + b`` as a new array; a and b have equal shapes (no broadcasting). With ``relu``,
    ``max(a + b, 0)`` in one op (``Backend.add_relu``: the same values as :func:`relu` of the sum)."""
    be = _backends.get(backend)
    a = to_backend_array(a, be, "a", "add")
    b = to_backend_array(b, be, "b", "add")
    if shape_of(a) != shape_of(b):
        raise ValueError(f"add: a and b must have the same shape, got {shape_of(a)} and {shape_of(b)}")
    if _check_bool(relu, "relu", "add"):
        return be.add_relu(a, b)
    return be.add(a, b)


def _mse_args(pred, target, be, where):
    pred = to_backend_array(pred, be, "pred", where)
    check_nonempty(shape_of(pred), "pred", where)
    target = to_backend_array(target, be, "target", where)
    if shape_of(target) != shape_of(pred):
        raise ValueError(f"{where}: target shape {shape_of(target)} must equal pred's shape {shape_of(pred)}")
    return pred, target


def mse_loss(pred, target, *, backend=None) -> float:
    """Mean squared error over every element of ``pred`` and ``target`` (same shape); a float."""
    be = _backends.get(backend)
    return be.mse_forward(*_mse_args(pred, target, be, "mse_loss"))


def mse_loss_backward(pred, target, *, backend=None):
    """Gradient of :func:`mse_loss` w.r.t. ``pred``: ``2 (pred - target) / numel`` (overwritten)."""
    be = _backends.get(backend)
    return be.mse_backward(*_mse_args(pred, target, be, "mse_loss_backward"))


def _check_label_smoothing(value, where: str) -> float:
    """``label_smoothing`` as a float in [0, 1]."""
    return check_float(value, "label_smoothing", where, 0.0, 1.0)


# ------------------------------------------------------------------ input normalisation
# normalize runs on batch norm's eval path with running_var = std**2: a tiny eps keeps 1/sqrt(var + eps)
# equal to 1/std in float32 (var >= 1e-30 for the stds accepted, so eps is below var's last bit)
_NORMALIZE_EPS = 1e-37
_NORMALIZE_STD_RANGE = (1e-15, 1e19)


def _normalize_std(std, be, where: str) -> np.ndarray:
    """``std`` as a host float32 (C,) array, checked positive and in the range float32 squares safely."""
    host = np.asarray(be.to_numpy(std) if be.is_array(std) and not isinstance(std, np.ndarray) else std)
    if host.dtype.kind not in "iuf":
        raise TypeError(f"{where}: std must be real numbers, got dtype {host.dtype}")
    host = host.astype(np.float32)
    lo, hi = _NORMALIZE_STD_RANGE
    bad = ~((host >= lo) & (host <= hi))  # NaN fails both comparisons
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: std must be positive, between {lo:g} and {hi:g}; std[{i}] is "
                         f"{float(host.reshape(-1)[i])!r}")
    return host


def _normalize_args(x, mean, std, be, where: str):
    """``(x, mean, std_host, view shape or None)``: x viewed as (N, C, ...) with C the statistics' length."""
    x = to_backend_array(x, be, "x", where)
    shape = shape_of(x)
    if len(shape) not in (2, 3, 4):
        raise ValueError(f"{where}: x must be 2-D (N, F), 3-D (N, C, L) or 4-D (N, C, H, W), got shape {shape}")
    check_nonempty(shape, "x", where)
    mean = to_backend_array(mean, be, "mean", where)
    std_host = _normalize_std(std, be, where)
    c = shape_of(mean)
    if len(c) != 1 or std_host.shape != c:
        raise ValueError(f"{where}: mean and std must be 1-D arrays of one length, got shapes {c} and "
                         f"{std_host.shape}")
    if c[0] == 1 and shape[1] != 1:
        return x, mean, std_host, (shape[0], 1, math.prod(shape[1:]))  # one statistic for every value
    if c[0] != shape[1]:
        raise ValueError(f"{where}: x has {shape[1]} channels but mean and std have {c[0]} entries; give one "
                         f"per channel, or one for all")
    return x, mean, std_host, None


def normalize(x, mean, std, *, backend=None):
    """``(x - mean) / std`` per channel (torchvision's ``Normalize``): the input preprocessing of a model.

    Parameters
    ----------
    x : array-like, (N, F), (N, C, L) or (N, C, H, W)
    mean, std : array-like (C,) or (1,)
        One entry per channel (dim 1 of x), or one for every value. ``std``
        must be positive (between 1e-15 and 1e19, where float32 squares it exactly enough).

    Returns
    -------
    y : backend array, float32, the shape of x

    Examples
    --------
    >>> import numpy as np, parconv.functional as F
    >>> F.normalize(np.full((1, 2, 1, 1), 3.0), [1.0, 2.0], [2.0, 0.5], backend="numpy").ravel()
    array([1., 2.], dtype=float32)
    """
    where = "normalize"
    be = _backends.get(backend)
    x, mean, std_host, view = _normalize_args(x, mean, std, be, where)
    var = be.asarray(np.square(std_host))
    xv = be.reshape(x, view) if view is not None else x
    # an eval-mode batch norm without affine part is exactly (x - mean) / sqrt(var + eps)
    y, _, _ = be.batch_norm_forward_eval(xv, None, None, mean, var, _NORMALIZE_EPS, False, None)
    return be.reshape(y, shape_of(x)) if view is not None else y


def normalize_backward(dy, std, *, backend=None):
    """Gradient of :func:`normalize` w.r.t. x: ``dy / std`` per channel (overwritten; mean is a constant)."""
    where = "normalize_backward"
    be = _backends.get(backend)
    zeros = np.zeros(np.shape(std) if not be.is_array(std) or isinstance(std, np.ndarray) else shape_of(std),
                     np.float32)
    dy, _, std_host, view = _normalize_args(dy, zeros, std, be, where)
    c = std_host.shape[0]
    mean = be.asarray(np.zeros(c, np.float32))
    invstd = be.asarray((1.0 / std_host.astype(np.float64)).astype(np.float32))
    dyv = be.reshape(dy, view) if view is not None else dy
    # eval-mode batch norm backward without weight: dx = dy * invstd (x only feeds the absent dweight)
    dx, _, _ = be.batch_norm_backward(dyv, None, dyv, mean, invstd, None, False, True)
    return be.reshape(dx, shape_of(dy)) if view is not None else dx
