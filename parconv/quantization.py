"""Post-training static int8 quantization (PyTorch's ``torch.ao.quantization`` idea and vocabulary).

:func:`quantize` returns a new model whose convolutions and fully connected
layers compute with 8-bit integers: BatchNorm is folded into the convolution
before it, each weight is quantized per output channel (symmetric int8 in
``[-127, 127]``, scale ``s_w[o]``), each layer's input per tensor (asymmetric
uint8, scale ``s_x`` and zero point ``z_x`` from running calibration data
through the model), the bias to int32 at scale ``s_x * s_w[o]``; a ReLU that
follows is applied by the layer. The other layers (pooling, residual adds,
activations) run in float32 between them, as in an ONNX QDQ graph.

The arithmetic (one place, used by the layers and the tests)::

    xq  = clamp(rint(x / s_x) + z_x, 0, 255)                  # fp32 division, ties to even
    acc = sum over taps of (xq - z_x) * wq                     # exact integers; padding is xq = z_x
    y   = float32(acc + bias_q[o]) * float32(s_x * s_w[o])     # then max(y, 0) when a ReLU is fused

The integer accumulation is exact, so every path gives bit-identical results:
the native int8 kernels (:mod:`parconv._ext._int8`: AVX512-VNNI, AVX-VNNI, AVX2 or portable C)
where they exist for a layer's shape on the ``openmp`` backend, else the
backend's float32 kernels on integer-valued arrays (split over input channels
so that no partial sum can reach 2**24, where float32 stops counting exactly).

Examples
--------
>>> import numpy as np, parconv as pc
>>> model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3), pc.ReLU(), pc.Linear(3, 2), backend="numpy")
>>> x = np.random.default_rng(0).standard_normal((64, 1, 2, 2)).astype(np.float32)
>>> qmodel = pc.quantization.quantize(model, x)
>>> [type(layer).__name__ for layer in qmodel]
['Flatten', 'QuantizedLinear', 'Identity', 'QuantizedLinear']
>>> qmodel.layers[1].relu
True
>>> bool(np.abs(qmodel.predict(x) - model.predict(x)).max() < 0.05)
True
"""

from __future__ import annotations

import math
import os
import sys
import threading

import numpy as np

from . import functional as F
from ._config import conv_precision, get_num_threads
from ._shapes import conv_pads
from ._validation import Where, check_int, shape_of, to_backend_array
from ._fusion import _Fused
from .layers import BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Flatten, Identity, Layer, Linear, MaxPool2d, ReLU
from .layers import Residual
from .layers import SyncBatchNorm
from .layers import _check_bool, _pair, _scalar_or_pair, layer_from_spec

__all__ = [
    "quantize", "fuse_conv_bn_eval", "MinMaxObserver", "PercentileObserver", "QuantizedConv2d", "QuantizedLinear", "QuantDequant",
    "quantize_per_tensor", "dequantize_per_tensor", "quantize_weight_per_channel", "quantize_bias",
    "conv2d_int8_reference",
    "linear_int8_reference", "requantize", "requant_scale", "int8_path",
]

#: weights are symmetric int8 in [-QMAX_WEIGHT, QMAX_WEIGHT] (-128 is left out, as oneDNN and ONNX Runtime's
#: symmetric quantization do, so the range is symmetric about zero)
QMAX_WEIGHT = 127
# float32 counts integers exactly up to 2**24
_EXACT_F32 = 1 << 24
_INT32 = np.iinfo(np.int32)


# ======================================================================= the reference arithmetic
def quantize_per_tensor(x, scale, zero_point) -> np.ndarray:
    """ONNX ``QuantizeLinear`` to uint8: ``clamp(rint(x / scale) + zero_point, 0, 255)``.

    ``x / scale`` is computed in float32 and rounded half to even; NaN maps to
    ``zero_point``. Returns a uint8 array of ``x``'s shape.
    """
    return (_centred(x, scale, zero_point) + np.float32(zero_point)).astype(np.uint8)


def dequantize_per_tensor(q, scale, zero_point) -> np.ndarray:
    """ONNX ``DequantizeLinear`` from uint8: ``float32(q - zero_point) * float32(scale)`` (one rounding)."""
    q = np.asarray(q)
    if q.dtype != np.uint8:
        raise TypeError(f"dequantize_per_tensor: q must be uint8 (quantize_per_tensor's output), got {q.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"dequantize_per_tensor: scale must be a finite number > 0, got {scale!r}")
    if isinstance(zero_point, bool) or not isinstance(zero_point, (int, np.integer)) or not 0 <= zero_point <= 255:
        raise ValueError(f"dequantize_per_tensor: zero_point must be an int in 0..255, got {zero_point!r}")
    return ((q.astype(np.int32) - int(zero_point)).astype(np.float32) * np.float32(scale)).astype(np.float32)


def _centred(x, scale, zero_point) -> np.ndarray:
    """``quantize_per_tensor(x) - zero_point`` as integer-valued float32 (what the products read)."""
    x = np.asarray(x, dtype=np.float32)
    q = np.divide(x, np.float32(scale), dtype=np.float32)
    np.rint(q, out=q)
    nan = np.isnan(q)
    np.clip(q, -float(zero_point), 255.0 - float(zero_point), out=q)
    if nan.any():
        q[nan] = 0.0
    return q


def quantize_weight_per_channel(w) -> tuple:
    """Symmetric per-output-channel int8 quantization of a weight whose first axis is the output channel.

    Returns ``(wq int8 of w's shape, scale float32 (O,))`` with ``scale[o] = max|w[o]| / 127`` (1 for an
    all-zero channel) and ``wq = clamp(rint(w / scale), -127, 127)``.
    """
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1).astype(np.float64)
    scale = np.where(amax > 0, amax / QMAX_WEIGHT, 1.0).astype(np.float32)
    shape = (-1,) + (1,) * (w.ndim - 1)
    wq = np.clip(np.rint(w.astype(np.float64) / scale.reshape(shape)), -QMAX_WEIGHT, QMAX_WEIGHT).astype(np.int8)
    return wq, scale


def requant_scale(input_scale, weight_scale) -> np.ndarray:
    """``float32(s_x * s_w[o])``: the per-channel factor from int32 accumulators to float32 outputs."""
    return (np.float32(input_scale) * np.asarray(weight_scale, dtype=np.float32)).astype(np.float32)


def quantize_bias(bias, input_scale, weight_scale) -> np.ndarray:
    """int32 bias at scale ``s_x * s_w[o]`` (``rint``, saturated to int32), as ONNX QDQ stores it."""
    scale = requant_scale(input_scale, weight_scale).astype(np.float64)
    q = np.rint(np.asarray(bias, dtype=np.float64) / scale)
    return np.clip(q, _INT32.min, _INT32.max).astype(np.int32)


def requantize(acc, bias_q, scale, relu: bool = False, residual=None) -> np.ndarray:
    """``float32(acc + bias_q[o]) * scale[o]`` (then ReLU), with the channel on axis 1 of ``acc``.

    ``residual`` (float32, the output's shape), a residual block's shortcut, is added before the ReLU:
    ``max(float32(acc + bias_q[o]) * scale[o] + residual, 0)``, as the layers run one by one (the convolution,
    ``Add``, ``Relu``) compute it; a uint8 shortcut is :func:`dequantize_per_tensor`'d first.
    """
    acc = np.asarray(acc, dtype=np.int64)
    shape = (1, -1) + (1,) * (acc.ndim - 2)
    if bias_q is not None:
        acc = acc + np.asarray(bias_q, dtype=np.int64).reshape(shape)
    y = acc.astype(np.float32) * np.asarray(scale, dtype=np.float32).reshape(shape)
    if residual is not None:
        r = np.asarray(residual)
        if r.dtype.kind != "f":
            raise TypeError(f"requantize: residual must be float32 (dequantize a uint8 shortcut with "
                            f"dequantize_per_tensor first), got {r.dtype}")
        if r.shape != y.shape:
            raise ValueError(f"requantize: residual must have the output's shape {y.shape}, got {r.shape}")
        y = np.add(y, r.astype(np.float32, copy=False), dtype=np.float32)
    if relu:
        np.maximum(y, 0, out=y)
    return y


def conv2d_int8_reference(xq, x_zero_point, wq, stride=1, padding=0, dilation=1, groups=1) -> np.ndarray:
    """Exact int64 accumulators of a quantized convolution (im2col in NumPy; the tests' oracle).

    ``xq`` uint8 (N, C, H, W), ``wq`` int8 (O, C/groups, kH, kW); padded taps count
    as ``xq = x_zero_point`` (a real zero). Returns int64 (N, O, P, Q).
    """
    xq = np.asarray(xq)
    wq = np.asarray(wq)
    n, c, h, w = xq.shape
    o, cg, kh, kw = wq.shape
    stride, dilation = _pair(stride, "stride", "conv2d_int8_reference", 1), \
        _pair(dilation, "dilation", "conv2d_int8_reference", 1)
    top, bottom, left, right = conv_pads(padding, (kh, kw), dilation, stride, "conv2d_int8_reference")
    xi = np.zeros((n, c, h + top + bottom, w + left + right), np.int64)
    xi[:, :, top:top + h, left:left + w] = xq.astype(np.int64) - int(x_zero_point)
    p = (xi.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    q = (xi.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    cols = np.empty((n, c, kh, kw, p, q), np.int64)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilation[0], j * dilation[1]
            cols[:, :, i, j] = xi[:, :, r0:r0 + stride[0] * (p - 1) + 1:stride[0], c0:c0 + stride[1] * (q - 1) + 1:stride[1]]
    og = o // groups
    out = np.empty((n, o, p, q), np.int64)
    for g in range(groups):
        cg_cols = cols[:, g * cg:(g + 1) * cg].reshape(n, cg * kh * kw, p * q)
        wg = wq[g * og:(g + 1) * og].reshape(og, cg * kh * kw).astype(np.int64)
        out[:, g * og:(g + 1) * og] = np.einsum("ok,nkl->nol", wg, cg_cols).reshape(n, og, p, q)
    return out


def linear_int8_reference(xq, x_zero_point, wq) -> np.ndarray:
    """Exact int64 accumulators of a quantized fully connected layer: ``(xq - z_x) @ wq.T``."""
    xi = np.asarray(xq).astype(np.int64) - int(x_zero_point)
    return xi @ np.asarray(wq).astype(np.int64).T


# ======================================================================= native kernels
def _int8_module():
    try:
        from ._ext import _int8
    except Exception:  # a NumPy-only install, or a level this CPU cannot run
        return None
    return _int8


def int8_path() -> str:
    """Which int8 dot-product path runs quantized layers on the ``openmp`` backend.

    ``"avx512_vnni"``, ``"avx_vnni"``, ``"avx2"`` or ``"portable"`` (the native kernels, from
    :func:`parconv._ext._int8.path`) when they are built, else ``"float32
    emulation"`` (the float kernels on integer-valued arrays; the same results).
    """
    mod = _int8_module()
    if mod is None or not hasattr(mod, "conv2d_forward"):
        return "float32 emulation"
    return str(mod.path())


def _native(name: str):
    mod = _int8_module()
    return getattr(mod, name, None) if mod is not None else None


def _allocator(backend):
    """``empty(shape, dtype)`` for the native kernels' outputs: the openmp backend's buffer pool, which recycles
    large outputs between calls (a fresh mapping costs a page fault and a page clearing per 4 KiB every time)."""
    return getattr(backend, "_empty", None) or np.empty


def _pack(pack, wq2d):
    """``(packed, row_sums)`` from the native ``pack_weights``, or None where it is missing or refuses the
    layer (a reduction too long for its int32 sums): the float emulation then runs the layer."""
    if pack is None:
        return None
    try:
        return tuple(pack(np.ascontiguousarray(wq2d, dtype=np.int8)))
    except ValueError:
        return None


# ======================================================================= observers
class MinMaxObserver:
    """Running min and max of the tensors it sees; per-tensor affine uint8 parameters from them.

    As PyTorch's ``MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)``:
    the range always includes 0 (so that zero, e.g. padding, is exact), ``scale =
    (max - min) / 255`` (at least float32's eps) and ``zero_point = -rint(min / scale)``.
    """

    def __init__(self):
        self.min_val, self.max_val = math.inf, -math.inf
        self.count = 0

    def __call__(self, x) -> None:
        x = np.asarray(x)
        if x.size:
            self.min_val = min(self.min_val, float(x.min()))
            self.max_val = max(self.max_val, float(x.max()))
            self.count += int(x.shape[0]) if x.ndim else 1

    forward = __call__

    def calculate_qparams(self) -> tuple:
        """``(scale float32, zero_point int)``; raises ``RuntimeError`` before any data was seen."""
        if self.count == 0:
            raise RuntimeError("MinMaxObserver: no data was observed (the calibration data never reached this layer)")
        lo, hi = min(self.min_val, 0.0), max(self.max_val, 0.0)
        scale = np.float32(max((hi - lo) / 255.0, float(np.finfo(np.float32).eps)))
        zero_point = int(np.clip(-np.rint(lo / float(scale)), 0, 255))
        return scale, zero_point


class PercentileObserver(MinMaxObserver):
    """A histogram of the tensors it sees; the range is cut at percentiles, so rare outliers do not widen the
    quantization step of everything else (as PyTorch's ``HistogramObserver`` aims to, by a simpler rule).

    ``percentile`` (e.g. 99.99) keeps that share of the values inside the range at each end: the range is
    ``[q(100 - p), q(p)]``, widened to include 0. The histogram has ``bins`` bins over the running
    min/max; when a batch widens the range, the old counts move to the new bins at their bin centres.
    """

    def __init__(self, percentile: float = 99.99, bins: int = 2048):
        super().__init__()
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 < percentile <= 100:
            raise ValueError(f"PercentileObserver: percentile must be a number in (50, 100], got {percentile!r}")
        self.percentile = float(percentile)
        self.bins = check_int(bins, "bins", "PercentileObserver", 16)
        self.hist = None

    def __call__(self, x) -> None:
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if not x.size:
            return
        super().__call__(x)
        lo, hi = min(self.min_val, 0.0), max(self.max_val, 0.0)
        if hi == lo:
            hi = lo + 1.0
        if self.hist is not None and (lo, hi) != self.range:
            edges = np.linspace(*self.range, self.bins + 1)
            centres = (edges[:-1] + edges[1:]) / 2
            self.hist = np.histogram(centres, self.bins, (lo, hi), weights=self.hist)[0]
        elif self.hist is None:
            self.hist = np.zeros(self.bins)
        self.range = (lo, hi)
        self.hist = self.hist + np.histogram(x, self.bins, self.range)[0]

    forward = __call__

    def calculate_qparams(self) -> tuple:
        if self.count == 0:
            raise RuntimeError("PercentileObserver: no data was observed (the calibration data never reached this "
                               "layer)")
        cdf = np.cumsum(self.hist) / self.hist.sum()
        edges = np.linspace(*self.range, self.bins + 1)
        tail = 1.0 - self.percentile / 100.0
        lo = edges[min(int(np.searchsorted(cdf, tail, side="right")), self.bins)]
        hi = edges[min(int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1, self.bins)]
        lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
        scale = np.float32(max((hi - lo) / 255.0, float(np.finfo(np.float32).eps)))
        return scale, int(np.clip(-np.rint(lo / float(scale)), 0, 255))


# ======================================================================= quantized layers
class _Quantized(Layer):
    """Shared state and checks of the int8 layers: buffers live on the host (the quantization runs there)."""

    buffer_names = ("weight", "bias", "weight_scale", "input_scale", "input_zero_point")
    _kind = ""
    _int8_chains = True  # the fusion planner asks chain_plan about runs that start here

    @property
    def relu(self) -> bool:
        """Whether the layer applies a ReLU to its output."""
        return self._relu

    @relu.setter
    def relu(self, value) -> None:
        self._relu = _check_bool(value, "relu", self._kind)
        self._prepared = self._native_args = None  # an int8 chain's recorded calls captured the old value

    def _init_buffers(self, w_shape, bias: bool, relu: bool):
        self.relu = relu
        o = w_shape[0]
        self.weight = np.zeros(w_shape, np.int8)
        self.bias = np.zeros(o, np.int32) if bias else None
        self.weight_scale = np.ones(o, np.float32)
        self.input_scale = np.ones(1, np.float32)
        self.input_zero_point = np.zeros(1, np.uint8)
        self.training = False
        self._prepared = self._quantize_fn = self._native_args = self._shape_memo = None

    def set_quantized(self, weight, weight_scale, bias, input_scale, input_zero_point) -> "_Quantized":
        """Set the quantized state: int8 ``weight``, float32 ``weight_scale`` (O,), int32 ``bias`` (O,) or None,
        ``input_scale`` > 0 and ``input_zero_point`` in 0..255. Returns self."""
        where = f"{self._kind}.set_quantized"
        state = {"weight": weight, "weight_scale": weight_scale, "input_scale": np.reshape(input_scale, (1,)),
                 "input_zero_point": np.reshape(input_zero_point, (1,))}
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{where}: the layer was built with bias={self.bias is not None}, got "
                             f"{'no' if bias is None else 'a'} bias")
        if bias is not None:
            state["bias"] = bias
        for key, value in state.items():
            value = np.asarray(value)
            if value.shape != np.shape(getattr(self, key)):
                raise ValueError(f"{where}: {key} must have shape {np.shape(getattr(self, key))}, got {value.shape}")
            self._check_state(key, value, key, where)
        for key, value in state.items():
            self._set_state(key, np.asarray(value))
        return self

    def _check_state(self, attr: str, value: np.ndarray, key: str, where: str) -> None:
        v = np.asarray(value)
        if attr == "weight":
            if v.dtype.kind not in "iu" and not np.array_equal(v, np.rint(v)):
                raise ValueError(f"{where}: {key} must hold integers (int8 weights), got {v.dtype}")
            if v.size and (v.min() < -QMAX_WEIGHT or v.max() > QMAX_WEIGHT):
                raise ValueError(f"{where}: {key} must lie in [-{QMAX_WEIGHT}, {QMAX_WEIGHT}], got values in "
                                 f"[{v.min()}, {v.max()}]")
        elif attr == "bias":
            if v.dtype.kind not in "iu" and not np.array_equal(v, np.rint(v)):
                raise ValueError(f"{where}: {key} must hold integers (an int32 bias), got {v.dtype}")
            if v.size and (v.min() < _INT32.min or v.max() > _INT32.max):
                raise ValueError(f"{where}: {key} must fit in int32")
        elif attr in ("weight_scale", "input_scale"):
            if v.size and not (np.all(np.isfinite(v)) and np.all(v > 0)):
                raise ValueError(f"{where}: {key} must be positive and finite, got {v!r:.120}")
        elif attr == "input_zero_point":
            if v.size and (v.min() < 0 or v.max() > 255 or not np.array_equal(v, np.rint(v))):
                raise ValueError(f"{where}: {key} must be an integer in 0..255, got {v!r:.80}")

    def _set_state(self, attr: str, value: np.ndarray) -> None:
        old = getattr(self, attr)
        setattr(self, attr, np.array(value, dtype=old.dtype, order="C", copy=True).reshape(old.shape))
        self._prepared = self._quantize_fn = self._native_args = None

    def _moved(self) -> None:
        # Layer.to moves float32 buffers to the backend; the quantization state stays on the host
        from . import to_numpy

        for n in ("weight_scale", "input_scale"):
            setattr(self, n, np.ascontiguousarray(to_numpy(getattr(self, n)), dtype=np.float32))
        self._prepared = self._quantize_fn = self._native_args = None

    def backward(self, dy, need_dx: bool = True):
        raise RuntimeError(f"{self!r}: int8 quantized layers run inference only (no backward); train the float "
                           "model and quantize it again with parconv.quantization.quantize")

    @property
    def scale(self) -> np.ndarray:
        """``float32(s_x * s_w[o])``, the requantisation factor per output channel."""
        return requant_scale(self.input_scale[0], self.weight_scale)

    def quantize_input(self, x, rec=None) -> np.ndarray:
        """The layer's uint8 input: ``quantize_per_tensor(x, input_scale, input_zero_point)`` (native when built).
        With ``rec`` (a list; native only), the call is prepared and appended to it instead of run (_Int8Chain)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._quantize_fn is None:  # looked up once per layer and process (False: none)
            self._quantize_fn = (_native("quantize") if self.backend.name == "openmp" else None) or False
        fn = self._quantize_fn
        if not fn:
            return quantize_per_tensor(x, self.input_scale[0], self.input_zero_point[0])
        out = (np.empty if rec is not None else _allocator(self.backend))(x.shape, np.uint8)
        got = fn(x.reshape(-1), float(self.input_scale[0]), int(self.input_zero_point[0]), out.reshape(-1),
                 get_num_threads(), **_step(rec))
        if rec is not None:
            rec.append(got)
        return out

    def _chunks(self, wq2d: np.ndarray, unit: int) -> list:
        """Split the reduction axis (in blocks of ``unit`` columns: one input channel's taps) so that no partial
        sum of any output can reach 2**24: each chunk's ``max_o sum |wq| * max |xq - z_x|`` stays below it."""
        zx = int(self.input_zero_point[0])
        amax = max(zx, 255 - zx, 1)
        per_block = np.abs(wq2d.astype(np.int64)).reshape(wq2d.shape[0], -1, unit).sum(axis=2)  # (O, blocks)
        chunks, start, run = [], 0, np.zeros(wq2d.shape[0], np.int64)
        for b in range(per_block.shape[1]):
            nxt = run + per_block[:, b]
            if b > start and nxt.max() * amax >= _EXACT_F32:
                chunks.append((start, b))
                start, nxt = b, per_block[:, b].copy()
            run = nxt
        chunks.append((start, per_block.shape[1]))
        return chunks

    def _centred_input(self, x) -> np.ndarray:
        """``xq - z_x`` as integer-valued float32 (the float emulation's input)."""
        return _centred(x, self.input_scale[0], self.input_zero_point[0])

    def _bias_in_float(self, chunks, wq2d: np.ndarray):
        """The bias as float32 for the float kernels to add, when one chunk covers the reduction and
        ``max sum |wq| * max |xq - z_x| + max |bias_q| < 2**24``: every partial sum, bias included, is then an
        exact float32 integer and the kernel's output is exactly ``float32(acc + bias_q)``. Else None."""
        if len(chunks) != 1:
            return None
        zx = int(self.input_zero_point[0])
        bound = int(np.abs(wq2d.astype(np.int64)).sum(axis=1).max()) * max(zx, 255 - zx, 1)
        bmax = 0 if self.bias is None else int(np.abs(self.bias.astype(np.int64)).max())
        if bound + bmax >= _EXACT_F32:
            return None
        b = np.zeros(wq2d.shape[0], np.float32) if self.bias is None else self.bias.astype(np.float32)
        return self.backend.asarray(b)

    def _scaled(self, y):
        """``y * scale[o]`` (then ReLU) in place on the float kernels' exact ``float32(acc + bias_q)``."""
        y = np.asarray(self.backend.to_numpy(y)) if not isinstance(y, np.ndarray) else y
        if not y.flags.writeable:
            y = y.copy()
        y *= self.scale.reshape((1, -1) + (1,) * (y.ndim - 2))
        if self.relu:
            np.maximum(y, 0, out=y)
        return self.backend.asarray(y) if not self.backend.host_arrays else y

    def _output(self, acc, y_host=None):
        y = requantize(acc, self.bias, self.scale, self.relu) if y_host is None else y_host
        return self.backend.asarray(y) if not self.backend.host_arrays else y

    def _host_input(self, x):
        x = self._input(x)
        return x if isinstance(x, np.ndarray) else np.asarray(self.backend.to_numpy(x))


class QuantizedConv2d(_Quantized):
    """A 2-D convolution with int8 weights and uint8 input (built by :func:`quantize`; inference only).

    Same geometry arguments as :class:`parconv.Conv2d`; buffers ``weight`` (int8,
    ``(O, C/groups, kH, kW)``), ``weight_scale`` (float32 ``(O,)``), ``bias``
    (int32 ``(O,)`` at scale ``input_scale * weight_scale``, or None),
    ``input_scale`` (float32 ``(1,)``) and ``input_zero_point`` (uint8 ``(1,)``).
    ``relu=True`` applies a ReLU to the output. The output is float32.
    """

    _kind = "QuantizedConv2d"

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, relu: bool = False, backend=None):
        super().__init__(backend)
        geometry = Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                          groups=groups, bias=False, backend="numpy", rng=0)  # validates every argument
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, name, getattr(geometry, name))
        self._fargs = geometry._fargs
        self._init_buffers(geometry.weight.shape, _check_bool(bias, "bias", self._kind), relu)

    @classmethod
    def from_float(cls, conv: Conv2d, input_scale, input_zero_point, relu: bool = False) -> "QuantizedConv2d":
        """Quantize a float :class:`parconv.Conv2d` for inputs of the given per-tensor parameters."""
        c = conv.config()
        layer = cls(c["in_channels"], c["out_channels"], c["kernel_size"], stride=c["stride"], padding=c["padding"],
                    dilation=c["dilation"], groups=c["groups"], bias=c["bias"], relu=relu, backend=conv.backend)
        wq, ws = quantize_weight_per_channel(conv.weight.numpy())
        bq = None if conv.bias is None else quantize_bias(conv.bias.numpy(), input_scale, ws)
        return layer.set_quantized(wq, ws, bq, input_scale, input_zero_point)

    def config(self):
        return dict(in_channels=self.in_channels, out_channels=self.out_channels,
                    kernel_size=_scalar_or_pair(self.kernel_size), stride=_scalar_or_pair(self.stride),
                    padding=self.padding if isinstance(self.padding, str) else _scalar_or_pair(self.padding),
                    dilation=_scalar_or_pair(self.dilation), groups=self.groups, bias=self.bias is not None,
                    relu=self.relu)

    def output_shape(self, x_shape) -> tuple:
        return F.conv2d_output_shape(x_shape, self.weight.shape, **self._fargs, where=Where(self))

    def macs(self, x_shape) -> int:
        n, o, p, q = self.output_shape(x_shape)
        return n * o * p * q * math.prod(self.weight.shape[1:])

    def _pads(self) -> tuple:
        return conv_pads(self.padding, self.kernel_size, self.dilation, self.stride, Where(self))

    def _prepare(self):
        """Per-process compute state: the native kernel and its packed weights, or the float emulation's chunks
        (made again after the quantized state changes through set_quantized, load_state_dict or .to)."""
        if self._prepared is not None:
            return self._prepared
        kh, kw = self.kernel_size
        top, bottom, left, right = self._pads()
        native = None
        if self.backend.name == "openmp" and self.dilation == (1, 1) and (top, left) == (bottom, right):
            if self.groups == 1 and kh == kw and self.stride[0] == self.stride[1] and top == left:
                fn, pack = _native("conv2d_forward"), _native("pack_weights")
                packed = _pack(pack, self.weight.reshape(self.out_channels, -1)) if fn is not None else None
                if packed is not None:
                    native = ("conv", fn) + packed
            elif self.groups == self.in_channels == self.out_channels:
                fn = _native("depthwise_forward")
                if fn is not None:
                    native = ("depthwise", fn, np.ascontiguousarray(self.weight), None)
        wf = self.weight.astype(np.float32)
        chunks = None
        if self.groups == 1:
            chunks = self._chunks(self.weight.reshape(self.out_channels, -1), kh * kw)
        else:
            zx = int(self.input_zero_point[0])
            bound = np.abs(self.weight.astype(np.int64)).reshape(self.out_channels, -1).sum(1).max()
            chunks = [(0, self.weight.shape[1])] if bound * max(zx, 255 - zx, 1) < _EXACT_F32 else None
        wchunks = None if chunks is None else [self.backend.asarray(np.ascontiguousarray(wf[:, a:b]))
                                               for a, b in chunks]
        bias_f = None if chunks is None else self._bias_in_float(chunks, self.weight.reshape(self.out_channels, -1))
        self._requant, self._zx = self.scale, int(self.input_zero_point[0])
        self._alloc = _allocator(self.backend)
        self._prepared = (native, chunks, wchunks, bias_f)
        return self._prepared

    def _native_forward(self, xq, out_shape, next_q=None, shortcut=None, rec=None):
        """The native kernel on uint8 ``xq``: a float32 output of ``out_shape``, or with ``next_q`` (a quantized
        layer this output feeds) that layer's uint8 input, quantized by the kernel as it stores (same bits).

        ``shortcut`` (the last convolution of a residual block; a ``conv`` kernel only): ``(relu, kwargs)``, the
        ReLU after the block and the kernel's ``residual=`` or ``residual_q=`` arguments, added before it.
        ``rec`` (a list): the call is prepared on a fresh output and appended to it instead of run."""
        kind, fn, packed, row_sums = self._prepared[0]
        args = self._native_args
        if args is None:
            top, _, left, _ = self._pads()
            self._native_args = args = (
                (packed, row_sums, self.out_channels, self.kernel_size[0], self.stride[0], top) if kind == "conv"
                else (packed, self.stride[0], self.stride[1], top, left))
        relu, extra = (self.relu, None) if shortcut is None else shortcut
        alloc = self._alloc if rec is None else np.empty
        kw = _step(rec) if extra is None else {**extra, **_step(rec)}
        if next_q is None:
            y = alloc(out_shape, np.float32)
            got = fn(xq, self._zx, *args, self._requant, self.bias, y, relu, get_num_threads(), **kw)
        else:
            y = alloc(out_shape, np.uint8)
            got = fn(xq, self._zx, *args, self._requant, self.bias, None, relu, get_num_threads(), y,
                     float(next_q.input_scale[0]), int(next_q.input_zero_point[0]), **kw)
        if rec is not None:
            rec.append(got)
        return y

    def forward(self, x):
        x = self._host_input(x)
        shape, memo = shape_of(x), self._shape_memo
        if memo is None or memo[0] != shape:  # the geometry is fixed: checked once per input shape
            self._shape_memo = memo = (shape, self.output_shape(shape))
        out_shape = memo[1]
        native, chunks, wchunks, bias_f = self._prepare()
        zx = int(self.input_zero_point[0])
        if bias_f is not None and native is None:
            with conv_precision("highest"):  # direct summation: Winograd's transforms are not exact on integers
                y = F.conv2d(self.backend.asarray(self._centred_input(x)), wchunks[0], bias_f, **self._fargs,
                             backend=self.backend)
            return self._scaled(y)
        xq = self.quantize_input(x)
        if native is not None:
            return self._output(None, self._native_forward(xq, out_shape))
        if chunks is None:  # a grouped convolution whose per-group sums float32 cannot hold exactly
            acc = conv2d_int8_reference(xq, zx, self.weight, self.stride, self.padding, self.dilation, self.groups)
            return self._output(acc)
        xi = xq.astype(np.float32) - np.float32(zx)  # exact: integers in [-255, 255]
        acc = None
        with conv_precision("highest"):  # as above
            for (a, b), wc in zip(chunks, wchunks):
                part = xi if (a, b) == (0, self.weight.shape[1]) else np.ascontiguousarray(xi[:, a:b])
                y = F.conv2d(self.backend.asarray(part), wc, None, **self._fargs, backend=self.backend)
                y = np.asarray(self.backend.to_numpy(y)).astype(np.int64)
                acc = y if acc is None else acc + y
        return self._output(acc)


class QuantizedLinear(_Quantized):
    """A fully connected layer with int8 weights (out, in) and uint8 input (built by :func:`quantize`; inference
    only); buffers as :class:`QuantizedConv2d`'s."""

    _kind = "QuantizedLinear"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, relu: bool = False, backend=None):
        super().__init__(backend)
        self.in_features = check_int(in_features, "in_features", self._kind, 1)
        self.out_features = check_int(out_features, "out_features", self._kind, 1)
        self._init_buffers((self.out_features, self.in_features), _check_bool(bias, "bias", self._kind), relu)

    @classmethod
    def from_float(cls, linear: Linear, input_scale, input_zero_point, relu: bool = False) -> "QuantizedLinear":
        """Quantize a float :class:`parconv.Linear` for inputs of the given per-tensor parameters."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, relu=relu,
                    backend=linear.backend)
        wq, ws = quantize_weight_per_channel(linear.weight.numpy())
        bq = None if linear.bias is None else quantize_bias(linear.bias.numpy(), input_scale, ws)
        return layer.set_quantized(wq, ws, bq, input_scale, input_zero_point)

    def config(self):
        return dict(in_features=self.in_features, out_features=self.out_features, bias=self.bias is not None,
                    relu=self.relu)

    def output_shape(self, x_shape) -> tuple:
        return Linear.output_shape(self, x_shape)

    _check_x = Linear._check_x

    def macs(self, x_shape) -> int:
        return x_shape[0] * self.in_features * self.out_features

    def _prepare(self):
        if self._prepared is None:
            native = None
            fn, pack = _native("linear_forward"), _native("pack_weights")
            packed = _pack(pack, self.weight) if self.backend.name == "openmp" and fn is not None else None
            if packed is not None:
                native = (fn,) + packed
            chunks = self._chunks(self.weight, 1)
            wf = self.weight.astype(np.float32)
            wchunks = [self.backend.asarray(np.ascontiguousarray(wf[:, a:b])) for a, b in chunks]
            self._requant, self._zx = self.scale, int(self.input_zero_point[0])
            self._alloc = _allocator(self.backend)
            self._prepared = (native, chunks, wchunks, self._bias_in_float(chunks, self.weight))
        return self._prepared

    def _native_forward(self, xq, out_shape, next_q=None, rec=None):
        """As :meth:`QuantizedConv2d._native_forward`; ``xq`` is (N, in_features) uint8."""
        fn, packed, row_sums = self._prepared[0]
        alloc = self._alloc if rec is None else np.empty
        if next_q is None:
            y = alloc(out_shape, np.float32)
            got = fn(xq, self._zx, packed, row_sums, self._requant, self.bias, y, self.relu, get_num_threads(),
                     **_step(rec))
        else:
            y = alloc(out_shape, np.uint8)
            got = fn(xq, self._zx, packed, row_sums, self._requant, self.bias, None, self.relu, get_num_threads(),
                     y, float(next_q.input_scale[0]), int(next_q.input_zero_point[0]), **_step(rec))
        if rec is not None:
            rec.append(got)
        return y

    def forward(self, x):
        x = self._host_input(x)
        self._check_x(shape_of(x))
        native, chunks, wchunks, bias_f = self._prepare()
        zx = int(self.input_zero_point[0])
        if bias_f is not None and native is None:
            y = F.linear(self.backend.asarray(self._centred_input(x)), wchunks[0], bias_f, backend=self.backend)
            return self._scaled(y)
        xq = self.quantize_input(x)
        if native is not None:
            return self._output(None, self._native_forward(xq, (x.shape[0], self.out_features)))
        xi = xq.astype(np.float32) - np.float32(zx)
        acc = None
        for (a, b), wc in zip(chunks, wchunks):
            part = xi if (a, b) == (0, self.in_features) else np.ascontiguousarray(xi[:, a:b])
            y = F.linear(self.backend.asarray(part), wc, None, backend=self.backend)
            y = np.asarray(self.backend.to_numpy(y)).astype(np.int64)
            acc = y if acc is None else acc + y
        return self._output(acc)


class _ResidualLink:
    """A :class:`parconv.Residual` block inside an int8 chain: its body a run of chainable quantized layers that
    ends in a native convolution without a ReLU, its shortcut the :class:`QuantDequant` of the block's input or
    one chainable :class:`QuantizedConv2d`, both reading the block's input quantized alike. The last
    convolution adds the shortcut (the uint8 input dequantized, or the shortcut convolution's float32 output)
    and applies the ReLU after the block (``relu``) as it stores: the block never leaves uint8."""

    __slots__ = ("block", "body", "shortcut", "relu", "first")

    def __init__(self, block, body, shortcut, relu=False):
        self.block, self.body, self.shortcut, self.relu = block, body, shortcut, relu
        self.first = body[0]  # the block's input is quantized with this layer's input parameters

    def with_relu(self) -> "_ResidualLink":
        return _ResidualLink(self.block, self.body, self.shortcut, True)

    def output_shapes(self, shape) -> list:
        out = []
        for layer in self.body:
            shape = tuple(layer.output_shape(shape))
            out.append(shape)
        return out

    def forward(self, xq, shapes, next_q, rec=None):
        """The block (and its ReLU) on its uint8 input: ``next_q``'s uint8 input, or float32 without one
        (``rec``: as :meth:`QuantizedConv2d._native_forward`'s)."""
        body, short = self.body, self.shortcut
        if isinstance(short, QuantDequant):
            extra = {"residual_q": xq, "residual_scale": short.scale, "residual_zero_point": short.zero_point}
        else:
            extra = {"residual": short._native_forward(xq, shapes[-1], rec=rec)}
        h = xq
        for k in range(len(body) - 1):
            h = body[k]._native_forward(h, shapes[k], body[k + 1], rec=rec)
        return body[-1]._native_forward(h, shapes[-1], next_q, (self.relu, extra), rec=rec)


_FLATTEN, _RELU = "flatten", "relu"


class _Int8Chain(_Fused):
    """A run of quantized layers each feeding the next (through Identity, eval-mode Dropout or Flatten) as one
    step of a :class:`parconv.Sequential`'s plan: each native kernel stores its output already quantized with the
    next layer's input scale and zero point (the same ``quantize_per_tensor`` of the same float32 values, so the
    same bits as running the layers one by one), skipping a float32 write and a quantize pass per link. Residual
    blocks of quantized layers (:class:`_ResidualLink`), nested Sequentials of them and the ReLU after each run
    inside the chain, so that a ResNet's stages stay uint8 from block to block."""

    def __init__(self, start, layers, items):
        super().__init__(start, layers)
        self._memos = ()  # (input shape, each link's output shape(s), their bytes) of the latest input shapes
        # (layer or _ResidualLink, the quantized layer it feeds or None, flatten its output first?) per link
        compute = [k for k, it in enumerate(items) if _computes(it)]
        self.links = []
        for a, b in zip(compute, compute[1:] + [None]):
            nxt = items[b] if b is not None else None
            flat = _FLATTEN in items[a + 1:b if b is not None else len(items)]
            self.links.append((items[a], nxt.first if isinstance(nxt, _ResidualLink) else nxt, flat))
        # per link, the max poolings between it and the next, run on the uint8 activations (_pool_u8)
        self.pools = [[it for it in items[a + 1:b if b is not None else len(items)] if type(it) is MaxPool2d]
                      for a, b in zip(compute, compute[1:] + [None])]
        head = self.links[0][0]
        self.first = head.first if isinstance(head, _ResidualLink) else head
        # what the kernels' recorded calls (_int8.Plan) depend on: the quantized layers and the shortcuts' scales
        self._quantized, self._qdq = [], []
        for it in items:
            if isinstance(it, _ResidualLink):
                self._quantized += it.body
                (self._qdq if isinstance(it.shortcut, QuantDequant) else self._quantized).append(it.shortcut)
            elif isinstance(it, _Quantized):
                self._quantized.append(it)
        self._plans = []  # (key, the layers' prepared states, Plan or None, output shape), the latest first
        self._plan_lock = threading.Lock()

    def forward(self, x):
        first = self.first
        x = first._host_input(x)
        memos = self._memos
        memo = memos[0] if memos and memos[0][0] == x.shape else \
            (memos[1] if len(memos) > 1 and memos[1][0] == x.shape else None)
        if memo is None:
            self._check_input(x)  # the layers' own checks, once per input shape
            shapes, shape = [], x.shape
            for (link, _, flat), pools in zip(self.links, self.pools):  # each kernel's output shape(s)
                if isinstance(link, _ResidualLink):
                    out = link.output_shapes(shape)
                    shapes.append(out)
                    shape = out[-1]
                else:
                    shape = tuple(link.output_shape(shape))
                    shapes.append(shape)
                for pool in pools:  # the next kernel's input
                    shape = tuple(pool.output_shape(shape))
                if flat:
                    shape = (shape[0], math.prod(shape[1:]))
            memo = (x.shape, shapes, _plan_bytes(shapes))
            self._memos = (memo,) + memos[:_PLANS - 1]  # one assignment: another thread sees the old or the new
        for layer in self._quantized:  # (again after a layer's state changed)
            layer._prepare()
        # small inputs run the recorded calls (no per-call checks and set-up: at batch 1 those cost more than
        # the kernels); a second thread in the same chain runs the calls itself
        if x.shape[0] and memo[2] <= _PLAN_BYTES and self._plan_lock.acquire(blocking=False):
            try:
                y = self._planned(x, memo)
            finally:
                self._plan_lock.release()
            if y is not None:
                return first._output(None, y)
        return first._output(None, self._calls(x, memo))

    def _calls(self, x, memo, rec=None):
        """The chain's kernel calls on ``x`` (its output), or with ``rec`` (a list) their prepared forms."""
        first = self.first
        xq = first.quantize_input(x, rec)
        for (link, nxt, flat), shape, pools in zip(self.links, memo[1], self.pools):
            if isinstance(link, _ResidualLink):
                xq = link.forward(xq, shape, nxt, rec)
            else:
                xq = link._native_forward(xq, shape, nxt, rec=rec)
            for pool in pools:
                xq = _pool_u8(pool, xq, first._alloc, rec)
            if flat:
                xq = xq.reshape(xq.shape[0], -1)
        return xq

    def _planned(self, x, memo):
        """The chain's output on ``x`` from its recorded calls (recorded again where a layer, the thread count or
        the kernels' path changed since), or None where the kernels cannot record."""
        plan_cls, kernel_state = _native("Plan"), _native("_state")
        if plan_cls is None or kernel_state is None:
            return None
        x = np.ascontiguousarray(x, dtype=np.float32)
        state = [layer._prepared for layer in self._quantized]
        key = (x.shape, get_num_threads(), kernel_state(), [(q.scale, q.zero_point) for q in self._qdq])
        plans = self._plans
        for plan in plans:
            if plan[0] == key and all(a is b for a, b in zip(plan[1], state)):
                if plan is not plans[0]:  # the most recently used first
                    self._plans = [plan] + [p for p in plans if p is not plan]
                break
        else:
            rec = []
            try:
                out = self._calls(x, memo, rec)
                runner = plan_cls(rec, x.shape, out.shape)
            except TypeError:  # a kernel that cannot prepare its call (a stand-in): the calls run themselves,
                runner = out = None  # and raise again there if the arguments were at fault
            plan = (key, state, runner, None if out is None else out.shape)
            # two input shapes (a batch size and a last, smaller batch) run recorded without recording again
            self._plans = [plan] + [p for p in plans if p[0][0] != key[0]][:_PLANS - 1]
        if plan[2] is None:
            return None
        out = np.empty(plan[3], np.float32)
        plan[2].run(x, out)
        return out

    def backward(self, dy, need_dx: bool = True):
        return self.first.backward(dy, need_dx)


def _step(rec) -> dict:
    """The keyword that makes a native kernel return its prepared call instead of running it, when recording."""
    return _NO_STEP if rec is None else _STEP


_NO_STEP, _STEP = {}, {"step": True}

# an int8 chain keeps the recorded calls of up to _PLANS input shapes, each with its buffers (every activation of
# one input) up to about this size
_PLAN_BYTES, _PLANS = 16 << 20, 2


def _plan_bytes(shapes) -> int:
    """Bytes of the activations an int8 chain's recorded calls keep (float32 at most each) for ``shapes``."""
    return sum(_plan_bytes(s) if isinstance(s, list) else 4 * math.prod(s) for s in shapes)


def _pool_u8(pool, xq: np.ndarray, alloc, rec=None) -> np.ndarray:
    """``pool`` (a MaxPool2d) on uint8 activations: quantization is monotone, so the max of the quantized values is
    the quantized max, the same bits as pooling float32 and quantizing after (``rec``: prepared, not run)."""
    kh, kw = _pair(pool.kernel_size, "kernel_size", "MaxPool2d", 1)
    sh, sw = _pair(pool.stride, "stride", "MaxPool2d", 1)
    ph, pw = _pair(pool.padding, "padding", "MaxPool2d", 0)
    n, c, h, w = xq.shape
    y = (alloc if rec is None else np.empty)((n, c, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1),
                                             np.uint8)
    got = _native("maxpool2d_u8")(xq, (kh, kw), (sh, sw), (ph, pw), y, get_num_threads(), **_step(rec))
    if rec is not None and got is not None:
        rec.append(got)
    return y


def _pools_u8(layer) -> bool:
    """Whether a chain runs this layer on its uint8 activations: a max pooling with the native kernel."""
    return type(layer) is MaxPool2d and layer.backend.name == "openmp" and _native("maxpool2d_u8") is not None


def _computes(item) -> bool:
    """Whether a chain item runs a kernel (a quantized layer or a residual block), not a Flatten or a pooling."""
    return isinstance(item, (_Quantized, _ResidualLink))


def _chains(layer) -> bool:
    """Whether a quantized layer runs a native kernel that can take and emit uint8 (a chain member)."""
    if not isinstance(layer, _Quantized) or layer.training or layer.backend.name != "openmp":
        return False
    return layer._prepare()[0] is not None


def _same_input(a, b) -> bool:
    """Whether two layers quantize their input alike (so one uint8 tensor serves both)."""
    sa, za = (a.scale, a.zero_point) if isinstance(a, QuantDequant) else (a.input_scale[0], a.input_zero_point[0])
    sb, zb = (b.scale, b.zero_point) if isinstance(b, QuantDequant) else (b.input_scale[0], b.input_zero_point[0])
    return np.float32(sa) == np.float32(sb) and int(za) == int(zb)


def _only(layer):
    """The one layer that is not an Identity in a (nested) Sequential, or the layer itself; None for several."""
    while isinstance(getattr(layer, "layers", None), list):
        rest = [child for child in layer.layers if type(child) is not Identity]
        if len(rest) != 1:
            return None
        layer = rest[0]
    return layer


def _residual_link(block):
    """A :class:`_ResidualLink` for a Residual whose body and shortcut qualify (its docstring), else None."""
    if block.training or block.shortcut is None:  # an identity shortcut reads the float32 input
        return None
    body = _items(block.body)
    if not body or any(not isinstance(it, _Quantized) for it in body):
        return None
    last = body[-1]
    if not isinstance(last, QuantizedConv2d) or last.relu or last._prepare()[0][0] != "conv":
        return None
    short = _only(block.shortcut)
    if not (isinstance(short, QuantDequant) or (isinstance(short, QuantizedConv2d) and _chains(short)
                                                and not short.relu)):
        return None
    return _ResidualLink(block, body, short) if _same_input(short, body[0]) else None


def _items(layer):
    """The chain items of one layer (chainable quantized layers, _ResidualLinks, max poolings on uint8, _FLATTEN,
    _RELU), or None when it cannot run inside an int8 chain."""
    if _chains(layer):
        return [layer]
    kind = type(layer)
    if kind is Identity or (kind is Dropout and not layer.training):
        return []
    if kind is Flatten:
        return [_FLATTEN]
    if kind is ReLU:
        return [_RELU]
    if kind is Residual:
        link = _residual_link(layer)
        return None if link is None else [link]
    if _pools_u8(layer):
        return [layer]
    if isinstance(getattr(layer, "layers", None), list) and getattr(layer, "fuse", False) and not layer.training:
        out = []
        for child in layer.layers:
            got = _items(child)
            if got is None:
                return None
            out += got
        return out
    return None


def chain_plan(layers, i: int):
    """``(step, stop)`` when ``layers[i]`` starts a run of two or more chainable quantized layers or a residual
    block of them (nested Sequentials included), else None."""
    first = layers[i]
    if not (_chains(first) or type(first) is Residual or isinstance(getattr(first, "layers", None), list)):
        return None
    items, kept, stop = [], [], i
    for j in range(i, len(layers)):
        got = _items(layers[j])
        if got is None:
            break
        cand = list(items)
        for it in got:
            if it is _RELU:  # the ReLU after a residual block: applied by the block's last convolution
                if not (cand and isinstance(cand[-1], _ResidualLink) and not cand[-1].relu):
                    cand = None
                    break
                cand[-1] = cand[-1].with_relu()
            elif type(it) is MaxPool2d:  # pooled in uint8 after a kernel, before any Flatten
                before = [c for c in cand if type(c) is not MaxPool2d]
                if not before or before[-1] is _FLATTEN:
                    cand = None
                    break
                cand.append(it)
            else:
                cand.append(it)
        if cand is None:
            break
        items = cand
        if any(_computes(it) or it is _RELU for it in got):  # the chain ends after the last layer that computes
            kept, stop = items, j + 1
    compute = [it for it in kept if _computes(it)]
    if not compute or (len(compute) < 2 and not isinstance(compute[0], _ResidualLink)):
        return None
    return _Int8Chain(i, layers[i:stop], kept), stop


class QuantDequant(Layer):
    """Round to a per-tensor uint8 grid and back: ``(quantize_per_tensor(x, scale, zero_point) - zero_point) * scale``.

    An ONNX ``QuantizeLinear -> DequantizeLinear`` pair that feeds ops other than a
    convolution or a fully connected layer (e.g. the clamp that stands for a ReLU in
    ONNX Runtime's QDQ graphs) loads as this layer; it exports as that pair.
    """

    def __init__(self, scale: float, zero_point: int, backend=None):
        super().__init__(backend)
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"QuantDequant: scale must be positive and finite, got {scale!r}")
        self.scale = float(np.float32(scale))
        self.zero_point = check_int(zero_point, "zero_point", "QuantDequant", 0)
        if self.zero_point > 255:
            raise ValueError(f"QuantDequant: zero_point must be in 0..255, got {self.zero_point}")
        self.training = False  # inference only, as the quantized layers

    def config(self):
        return {"scale": self.scale, "zero_point": self.zero_point}

    def forward(self, x):
        x = self._host(x)
        y = dequantize_per_tensor(quantize_per_tensor(x, self.scale, self.zero_point), self.scale, self.zero_point)
        return y if self.backend.host_arrays else self.backend.asarray(y)

    def _host(self, x):
        x = self._input(x)
        return x if isinstance(x, np.ndarray) else np.asarray(self.backend.to_numpy(x))

    def backward(self, dy, need_dx: bool = True):
        raise RuntimeError(f"{self!r}: runs inference only (no backward)")


# ======================================================================= model transformation
def fuse_conv_bn_eval(conv: Conv2d, bn) -> Conv2d:
    """A new :class:`parconv.Conv2d` that computes ``bn(conv(x))`` with ``bn``'s running statistics (eval mode).

    PyTorch's ``torch.nn.utils.fusion.fuse_conv_bn_eval``: ``w' = w * g / sqrt(var + eps)`` per output
    channel, ``b' = (b - mean) * g / sqrt(var + eps) + beta`` (computed in float64, stored as float32).
    The new convolution always has a bias; ``conv`` and ``bn`` are left unchanged.
    """
    if not isinstance(conv, Conv2d):
        raise TypeError(f"fuse_conv_bn_eval: conv must be a parconv Conv2d, got {type(conv).__name__}")
    if not isinstance(bn, (BatchNorm2d, SyncBatchNorm)):
        raise TypeError(f"fuse_conv_bn_eval: bn must be a BatchNorm2d, got {type(bn).__name__}")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"fuse_conv_bn_eval: bn has {bn.num_features} features, the convolution "
                         f"{conv.out_channels} output channels")
    if getattr(bn, "running_mean", None) is None:
        raise ValueError("fuse_conv_bn_eval: bn has no running statistics (track_running_stats=False), so it "
                         "normalises with each batch's and cannot be folded")
    c = conv.config()
    c["bias"] = True
    fused = Conv2d(**c, backend=conv.backend, rng=0)
    fused.weight.data, fused.bias.data = _folded(conv, bn, fused.backend)
    return fused


def _folded(layer, bn, backend):
    from . import to_numpy

    w = layer.weight.numpy().astype(np.float64)
    o = w.shape[0]
    b = layer.bias.numpy().astype(np.float64) if layer.bias is not None else np.zeros(o)
    mean = to_numpy(bn.running_mean).astype(np.float64)
    var = to_numpy(bn.running_var).astype(np.float64)
    gamma = bn.weight.numpy().astype(np.float64) if bn.weight is not None else np.ones(o)
    beta = bn.bias.numpy().astype(np.float64) if bn.bias is not None else np.zeros(o)
    factor = gamma / np.sqrt(var + float(bn.eps))
    wf = (w * factor.reshape((-1,) + (1,) * (w.ndim - 1))).astype(np.float32)
    bf = ((b - mean) * factor + beta).astype(np.float32)
    return backend.asarray(np.ascontiguousarray(wf)), backend.asarray(bf)


def _fuse_linear_bn_eval(linear: Linear, bn) -> Linear:
    fused = Linear(linear.in_features, linear.out_features, bias=True, backend=linear.backend, rng=0)
    fused.weight.data, fused.bias.data = _folded(linear, bn, fused.backend)
    return fused


def _copy(model):
    """A new model of the same layers, weights and buffers (through the layers' specs: no pickle, no aliasing)."""
    try:
        new = layer_from_spec(model.spec(), model.backend)
    except ValueError as exc:
        raise ValueError(f"quantize: cannot copy the model to quantize it ({exc}); quantize works on models of "
                         "parconv's layers") from None
    new.load_state_dict(model.state_dict())
    if hasattr(model, "input_shape"):
        new.input_shape = model.input_shape
    return new


def _slots(container) -> list:
    """``[(getter, setter), ...]`` for each direct child slot of a container (a Sequential's list, a Residual's
    body and shortcut)."""
    if hasattr(container, "layers") and isinstance(container.layers, list):
        lst = container.layers
        return [((lambda i=i: lst[i]), (lambda v, i=i: lst.__setitem__(i, v))) for i in range(len(lst))]
    if isinstance(container, Residual):
        out = [((lambda: container.body), (lambda v: setattr(container, "body", v)))]
        if container.shortcut is not None:
            out.append(((lambda: container.shortcut), (lambda v: setattr(container, "shortcut", v))))
        return out
    return []


def _containers(model) -> list:
    return [m for m in model.modules() if _slots(m)]


def _fold_batchnorm(model) -> set:
    """Fold every eval-mode BatchNorm into the Conv2d/Linear before it (in place); the BatchNorm becomes an
    Identity, as PyTorch's ``fuse_modules`` does. Returns the ids of those Identities."""
    placeholders = set()
    for box in _containers(model):
        if not hasattr(box, "layers"):
            continue
        lst = box.layers
        for i in range(len(lst) - 1):
            a, b = lst[i], lst[i + 1]
            if getattr(b, "running_mean", None) is None:
                continue
            if type(a) is Conv2d and type(b) in (BatchNorm2d, SyncBatchNorm) and b.num_features == a.out_channels:
                lst[i] = fuse_conv_bn_eval(a, b)
            elif type(a) is Linear and type(b) is BatchNorm1d and b.num_features == a.out_features:
                lst[i] = _fuse_linear_bn_eval(a, b)
            else:
                continue
            lst[i + 1] = Identity(backend=b.backend)
            placeholders.add(id(lst[i + 1]))
    return placeholders


class _Observed(Layer):
    """A float Conv2d/Linear that records its inputs' range while calibration data runs through it."""

    def __init__(self, layer, observer):
        super().__init__(layer.backend)
        self.layer, self.observer = layer, observer()

    def children(self) -> list:
        return [("layer", self.layer)]

    def output_shape(self, x_shape) -> tuple:
        return self.layer.output_shape(x_shape)

    def forward(self, x):
        from . import to_numpy

        self.observer(to_numpy(x))
        return self.layer.forward(x)


def _calibration_batches(data, batch_size: int, where: str):
    """``(number of batches or None, iterator of float32 host batches)`` from an array, DataLoader or iterable."""
    from .training import _is_loader, as_host_float

    if _is_loader(data):
        def gen():
            for batch in data:
                yield batch[0] if isinstance(batch, tuple) else batch
        return len(data), gen()
    batch_list = isinstance(data, (list, tuple)) and len(data) > 0 and all(
        isinstance(b, (np.ndarray, tuple)) for b in data)
    if not batch_list and (isinstance(data, (np.ndarray, list)) or hasattr(data, "__array__")):
        x = as_host_float(data, "calibration_data", where)
        if x.ndim < 2:
            raise ValueError(f"{where}: calibration_data must be a batch of inputs (N, C, H, W) or (N, F), got "
                             f"shape {x.shape}")
        if x.shape[0] == 0:
            raise ValueError(f"{where}: calibration_data is empty (shape {x.shape}); pass some training inputs, "
                             "e.g. a few hundred images")
        n = -(-x.shape[0] // batch_size)
        return n, (x[s:s + batch_size] for s in range(0, x.shape[0], batch_size))
    if hasattr(data, "__iter__") and not isinstance(data, (str, bytes, dict)):
        def gen():
            for batch in data:
                yield batch[0] if isinstance(batch, tuple) else batch
        return (len(data) if hasattr(data, "__len__") else None), gen()
    raise TypeError(f"{where}: calibration_data must be an array (N, C, H, W) / (N, F), a parconv.data.DataLoader "
                    f"or an iterable of batches, got {type(data).__name__}")


def quantize(model, calibration_data, batch_size: int = 256, progress=None, observer="minmax"):
    """Post-training static int8 quantization: a new model whose Conv2d and Linear layers compute in int8.

    Parameters
    ----------
    model : Sequential or Layer
        A float model of parconv's layers (trained). It is copied and left
        unchanged (its mode included).
    calibration_data : array-like (N, C, H, W) / (N, F), DataLoader or iterable of batches
        Representative inputs (a few hundred training images are usually
        enough): each quantized layer's input range is their min and max, 0 included.
        A :class:`parconv.data.DataLoader` (or an iterable) may yield ``(x, y)`` pairs; ``y`` is ignored.
    batch_size : int, default 256
        Batch size for running an array through the model.
    progress : bool or None, default None
        Show a progress bar over the calibration batches; None shows one when
        there are more than 20 batches and standard error is a terminal.
    observer : {"minmax", "percentile"} or callable, default "minmax"
        How each layer's input range is taken from the calibration data:
        :class:`MinMaxObserver` (the whole range), :class:`PercentileObserver`
        (cut at the 0.01% tails, for inputs with rare outliers), or a callable
        returning a new observer (an object with ``__call__(x)`` and
        ``calculate_qparams() -> (scale, zero_point)``), e.g.
        ``lambda: PercentileObserver(99.9)``.

    Returns
    -------
    Sequential or Layer
        The quantized model, in eval mode (inference only). In order:
        every ``Conv2d -> BatchNorm2d`` (and ``Linear -> BatchNorm1d``) pair is folded into one layer
        (:func:`fuse_conv_bn_eval`; the BatchNorm becomes an ``Identity``); each Conv2d
        (any geometry, grouped and depthwise included) and Linear becomes a
        :class:`QuantizedConv2d` / :class:`QuantizedLinear` (per-output-channel symmetric int8 weights,
        per-tensor uint8 input from calibration, int32 bias); a ``ReLU`` right after
        one is applied by it (and becomes an ``Identity``). The other layers stay float32.
        It runs with ``predict``, ``evaluate``, ``summary`` and :func:`parconv.onnx.export` (as a QDQ
        graph); it cannot be trained or saved to ``.npz`` (export it to ONNX).

    Raises
    ------
    TypeError, ValueError
        For a model or argument of the wrong kind, calibration data of the
        wrong shape, empty or holding NaN or Inf.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> model = pc.models.lenet5(backend="numpy", rng=0)
    >>> x = np.random.default_rng(0).random((32, 1, 28, 28), dtype=np.float32)
    >>> qmodel = pc.quantization.quantize(model, x)
    >>> type(qmodel.layers[0]).__name__, qmodel.layers[0].relu, qmodel.training
    ('QuantizedConv2d', True, False)
    """
    where = "quantize"
    if not isinstance(model, Layer):
        raise TypeError(f"{where}: model must be a parconv Sequential or layer, got {type(model).__name__}")
    batch_size = check_int(batch_size, "batch_size", where, 1)
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(f"{where}: progress must be True, False or None, got {type(progress).__name__}")
    if isinstance(observer, str):
        if observer not in ("minmax", "percentile"):
            raise ValueError(f"{where}: observer must be 'minmax', 'percentile' or a callable returning an "
                             f"observer, got {observer!r}")
        make_observer = MinMaxObserver if observer == "minmax" else PercentileObserver
    elif callable(observer):
        make_observer = observer
    else:
        raise TypeError(f"{where}: observer must be 'minmax', 'percentile' or a callable returning an observer, "
                        f"got {type(observer).__name__}")
    if any(isinstance(m, _Quantized) for m in model.modules()):
        raise ValueError(f"{where}: the model is already quantized")
    qmodel = _copy(model).eval()
    placeholders = _fold_batchnorm(qmodel)
    if isinstance(qmodel, (Conv2d, Linear)):  # a bare layer: wrap it to reuse the container walk
        from .model import Sequential

        qmodel = Sequential(qmodel)
        bare = True
    else:
        bare = False
    observed = []
    for box in _containers(qmodel):
        for get, put in _slots(box):
            if type(get()) in (Conv2d, Linear):
                wrapped = _Observed(get(), make_observer)
                put(wrapped)
                observed.append((box, get, put, wrapped))
    if not observed:
        raise ValueError(f"{where}: the model has no Conv2d or Linear layer to quantize")
    _calibrate(qmodel, calibration_data, batch_size, progress, where)
    for box, get, put, wrapped in observed:
        scale, zp = wrapped.observer.calculate_qparams()
        relu = False
        if hasattr(box, "layers"):
            lst, i = box.layers, box.layers.index(wrapped)
            j = i + 1
            while j < len(lst) and id(lst[j]) in placeholders:
                j += 1
            if j < len(lst) and type(lst[j]) is ReLU:
                relu = True
                lst[j] = Identity(backend=lst[j].backend)
        cls = QuantizedConv2d if isinstance(wrapped.layer, Conv2d) else QuantizedLinear
        put(cls.from_float(wrapped.layer, scale, zp, relu=relu))
    for box in _containers(qmodel):
        # an identity shortcut adds the block's input as its quantized layers read it (QuantizeLinear then
        # DequantizeLinear, as a QDQ graph and PyTorch's quantized add do), so the block can run on uint8 alone
        first = _first_leaf(box.body) if isinstance(box, Residual) and box.shortcut is None else None
        if isinstance(first, _Quantized):
            box.shortcut = QuantDequant(first.input_scale[0], int(first.input_zero_point[0]), backend=box.backend)
    for box in _containers(qmodel):
        if hasattr(box, "_plan_key"):
            box._plan_key = None
    qmodel.eval()
    return qmodel.layers[0] if bare else qmodel


def _first_leaf(layer):
    """The first layer that runs in ``layer`` (through nested Sequentials, past Identity placeholders)."""
    while isinstance(getattr(layer, "layers", None), list):
        rest = [child for child in layer.layers if type(child) is not Identity]
        if not rest:
            return None
        layer = rest[0]
    return layer


def _calibrate(model, data, batch_size, progress, where) -> None:
    from ._grad import no_grad
    from .training import check_finite

    total, batches = _calibration_batches(data, batch_size, where)
    show = progress if progress is not None else (total is not None and total > 20 and sys.stderr.isatty()
                                                  and not os.environ.get("PARCONV_NO_PROGRESS"))
    bar = None
    if show:
        from .training import _progress_bar_class

        bar = _progress_bar_class()(total=total, desc="calibrating", unit="batch", leave=False)
    seen = 0
    try:
        with no_grad():
            for k, xb in enumerate(batches):
                xb = np.asarray(xb) if isinstance(xb, np.ndarray) or not model.backend.is_array(xb) else xb
                if isinstance(xb, np.ndarray):
                    check_finite(np.asarray(xb, dtype=np.float32), f"calibration_data (batch {k})", where)
                try:
                    model.forward(to_backend_array(xb, model.backend, "calibration_data", where))
                except ValueError as exc:
                    raise ValueError(f"{where}: calibration_data batch {k} of shape {shape_of(xb)} does not fit the "
                                     f"model: {exc}") from None
                seen += 1
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if seen == 0:
        raise ValueError(f"{where}: calibration_data yielded no batches; pass some representative inputs")
