"""ONNX interop: export a parconv model for onnxruntime (and any ONNX runtime), load ONNX graphs as parconv models.

:func:`export` writes an opset-17 ONNX file with a dynamic batch dimension,
the weights as initializers named like the state-dict keys (``"2.body.0.weight"``)
and node names that keep the layer structure (``"2.body.0/Conv"``).
:func:`load` builds a :class:`parconv.Sequential` from an ONNX graph of the
supported ops, including the patterns both PyTorch exporters emit for the
same layers (``Flatten`` or ``Reshape``, ``GlobalAveragePool`` or
``ReduceMean``, ``Gemm`` or ``MatMul`` + ``Add``, BatchNorm folded into the
convolution or not); an ``Add`` of two branches of a common input becomes a
:class:`parconv.Residual`.

Both need the ``onnx`` package (``pip install "parconv[onnx]"``); ``import
parconv`` never imports it, and this module imports it on first use.

Examples
--------
>>> import os, tempfile, numpy as np, parconv as pc
>>> model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3), backend="numpy").eval()
>>> path = os.path.join(tempfile.mkdtemp(), "mlp.onnx")
>>> pc.onnx.export(model, path, input_shape=(1, 1, 2, 2))
>>> loaded = pc.onnx.load(path, backend="numpy")
>>> loaded(np.ones((5, 1, 2, 2))).shape
(5, 3)
>>> [type(layer).__name__ for layer in loaded]
['Flatten', 'Linear']
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np

__all__ = ["export", "load", "OPSET", "SUPPORTED_LAYERS", "NOT_EXPORTED", "SUPPORTED_OPS"]

#: the opset :func:`export` writes
OPSET = 17
# IR version 8 is the one of opset 17 (onnx 1.12-1.13); runtimes that read opset 17 read it
_IR_VERSION = 8

#: ops :func:`load` turns into layers (constant subgraphs of other ops are folded first; see ``_FOLDABLE``)
SUPPORTED_OPS = (
    "Conv", "BatchNormalization", "Gemm", "MatMul", "Add", "Relu", "LeakyRelu", "Elu", "Sigmoid", "Tanh", "Softmax",
    "MaxPool", "AveragePool", "GlobalAveragePool", "ReduceMean", "Flatten", "Reshape", "Squeeze", "Dropout",
    "Identity", "Sub", "Div", "QuantizeLinear", "DequantizeLinear",
)

_HINTS = {
    "Erf": " (GELU exports as Erf; parconv has no GELU layer)",
    "Gelu": " (parconv has no GELU layer)",
    "Concat": " (parconv has no concatenation layer)",
}


def _import_onnx():
    try:
        import onnx
        import onnx.numpy_helper  # noqa: F401
    except ImportError:
        raise ImportError('parconv.onnx needs the onnx package: pip install "parconv[onnx]"') from None
    return onnx


def _kind(layer) -> str | None:
    """The parconv layer class ``layer`` is (or derives from), by name."""
    for cls in type(layer).__mro__:
        if cls.__module__.startswith("parconv.") and cls.__name__ in _EXPORTERS:
            return cls.__name__
    return None


def _children(layer) -> list:
    kind = _kind(layer)
    if kind == "Sequential":
        return list(layer.layers)
    if kind == "Residual":
        return [c for c in (layer.body, layer.shortcut) if c is not None]
    return []


def _all_layers(layer) -> list:
    out = [layer]
    for child in _children(layer):
        out.extend(_all_layers(child))
    return out


# ===================================================================== export
class _Graph:
    """Nodes and initializers of the graph being written; tensor names are unique."""

    def __init__(self, onnx):
        self.onnx, self.helper = onnx, onnx.helper
        self.nodes, self.inits, self._used = [], [], set()

    def name(self, wanted: str) -> str:
        name, i = wanted, 1
        while name in self._used:
            name, i = f"{wanted}_{i}", i + 1
        self._used.add(name)
        return name

    def init(self, name: str, value) -> str:
        name = self.name(name)
        self.inits.append(self.onnx.numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list, prefix: str, **attrs) -> str:
        scope = prefix or "model"
        out = self.name(f"{scope}/{op}_output")
        self.nodes.append(self.helper.make_node(op, inputs, [out], name=self.name(f"{scope}/{op}"), **attrs))
        return out


def _host(a) -> np.ndarray:
    from . import to_numpy

    return np.asarray(to_numpy(a))


def _param(layer, name: str):
    p = getattr(layer, name, None)
    if p is None:
        return None
    return np.asarray(p.numpy() if hasattr(p, "numpy") else _host(p), dtype=np.float32)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pool_attrs(layer, x_shape) -> dict:
    from ._shapes import pair

    where = f"onnx.export: {type(layer).__name__}"
    kernel = pair(layer.kernel_size, "kernel_size", where, 1)
    stride = kernel if getattr(layer, "stride", None) is None else pair(layer.stride, "stride", where, 1)
    ph, pw = pair(getattr(layer, "padding", 0), "padding", where, 0)
    attrs = dict(kernel_shape=list(kernel), strides=list(stride), pads=[ph, pw, ph, pw])
    dilation = pair(getattr(layer, "dilation", 1), "dilation", where, 1)
    if dilation != (1, 1):
        attrs["dilations"] = list(dilation)
    if getattr(layer, "ceil_mode", False):
        attrs["ceil_mode"] = 1
    return attrs


def _export_conv(g, layer, x, prefix, x_shape):
    from ._shapes import conv_pads, pair

    where = f"onnx.export: Conv2d {prefix!r}"
    w = _param(layer, "weight")
    stride = pair(getattr(layer, "stride", 1), "stride", where, 1)
    dilation = pair(getattr(layer, "dilation", 1), "dilation", where, 1)
    top, bottom, left, right = conv_pads(getattr(layer, "padding", 0), w.shape[2:], dilation, stride, where)
    inputs = [x, g.init(_key(prefix, "weight"), w)]
    b = _param(layer, "bias")
    if b is not None:
        inputs.append(g.init(_key(prefix, "bias"), b))
    return g.node("Conv", inputs, prefix, kernel_shape=list(w.shape[2:]), strides=list(stride),
                  pads=[top, left, bottom, right], dilations=list(dilation), group=int(getattr(layer, "groups", 1)))


def _export_linear(g, layer, x, prefix, x_shape):
    w = _param(layer, "weight")
    b = _param(layer, "bias")
    if b is None:  # Gemm's C is optional, but some runtimes mishandle a missing one; zeros are exact
        b = np.zeros(w.shape[0], np.float32)
        bias = g.init(_key(prefix, "bias_zeros"), b)
    else:
        bias = g.init(_key(prefix, "bias"), b)
    return g.node("Gemm", [x, g.init(_key(prefix, "weight"), w), bias], prefix, transB=1)


def _export_qdq_input(g, layer, x, prefix):
    """``QuantizeLinear -> DequantizeLinear`` of a quantized layer's input (per tensor, uint8)."""
    scale = g.init(_key(prefix, "input_scale"), np.float32(layer.input_scale[0]))
    zero = g.init(_key(prefix, "input_zero_point"), np.uint8(layer.input_zero_point[0]))
    return g.node("DequantizeLinear", [g.node("QuantizeLinear", [x, scale, zero], prefix), scale, zero], prefix)


def _export_dq_weights(g, layer, prefix):
    """Per-output-channel ``DequantizeLinear`` (axis 0) of the int8 weight and of the int32 bias (at scale
    ``s_x * s_w[o]``; zeros where the layer has none, which some runtimes need for their fused ops)."""
    o = layer.weight.shape[0]
    w = g.node("DequantizeLinear", [g.init(_key(prefix, "weight"), layer.weight),
                                    g.init(_key(prefix, "weight_scale"), layer.weight_scale),
                                    g.init(_key(prefix, "weight_zero_point"), np.zeros(o, np.int8))], prefix, axis=0)
    bias = layer.bias if layer.bias is not None else np.zeros(o, np.int32)
    b = g.node("DequantizeLinear", [g.init(_key(prefix, "bias" if layer.bias is not None else "bias_zeros"), bias),
                                    g.init(_key(prefix, "bias_scale"), layer.scale),
                                    g.init(_key(prefix, "bias_zero_point"), np.zeros(o, np.int32))], prefix, axis=0)
    return w, b


def _export_quantized_conv(g, layer, x, prefix, x_shape):
    from ._shapes import conv_pads

    where = f"onnx.export: QuantizedConv2d {prefix!r}"
    xd = _export_qdq_input(g, layer, x, prefix)
    w, b = _export_dq_weights(g, layer, prefix)
    top, bottom, left, right = conv_pads(layer.padding, layer.kernel_size, layer.dilation, layer.stride, where)
    y = g.node("Conv", [xd, w, b], prefix, kernel_shape=list(layer.kernel_size), strides=list(layer.stride),
               pads=[top, left, bottom, right], dilations=list(layer.dilation), group=int(layer.groups))
    return g.node("Relu", [y], prefix) if layer.relu else y


def _export_quant_dequant(g, layer, x, prefix, x_shape):
    scale = g.init(_key(prefix, "scale"), np.float32(layer.scale))
    zero = g.init(_key(prefix, "zero_point"), np.uint8(layer.zero_point))
    return g.node("DequantizeLinear", [g.node("QuantizeLinear", [x, scale, zero], prefix), scale, zero], prefix)


def _export_quantized_linear(g, layer, x, prefix, x_shape):
    xd = _export_qdq_input(g, layer, x, prefix)
    w, b = _export_dq_weights(g, layer, prefix)
    y = g.node("Gemm", [xd, w, b], prefix, transB=1)
    return g.node("Relu", [y], prefix) if layer.relu else y


def _export_batchnorm(g, layer, x, prefix, x_shape):
    c = int(layer.num_features)
    w, b = _param(layer, "weight"), _param(layer, "bias")
    scale = g.init(_key(prefix, "weight"), w) if w is not None else g.init(_key(prefix, "scale_ones"),
                                                                            np.ones(c, np.float32))
    bias = g.init(_key(prefix, "bias"), b) if b is not None else g.init(_key(prefix, "bias_zeros"),
                                                                         np.zeros(c, np.float32))
    if getattr(layer, "running_mean", None) is None:
        # without running statistics the layer normalises with the batch's, in eval mode too:
        # (x - mean) / sqrt(var + eps) over every axis but the channels, then the affine part
        axes = [0] + list(range(2, len(x_shape)))
        mean = g.node("ReduceMean", [x], prefix, axes=axes, keepdims=1)
        d = g.node("Sub", [x, mean], prefix)
        var = g.node("ReduceMean", [g.node("Mul", [d, d], prefix)], prefix, axes=axes, keepdims=1)
        eps = g.init(f"{prefix}/eps", np.array(layer.eps, np.float32))
        xhat = g.node("Div", [d, g.node("Sqrt", [g.node("Add", [var, eps], prefix)], prefix)], prefix)
        zeros = g.init(f"{prefix}/zeros", np.zeros(c, np.float32))
        ones = g.init(f"{prefix}/ones", np.ones(c, np.float32))
        return g.node("BatchNormalization", [xhat, scale, bias, zeros, ones], prefix, epsilon=0.0)
    mean = g.init(_key(prefix, "running_mean"), _param(layer, "running_mean"))
    var = g.init(_key(prefix, "running_var"), _param(layer, "running_var"))
    # ONNX's momentum weighs the old statistic, PyTorch's the new one; it only matters for training
    momentum = getattr(layer, "momentum", 0.1)
    return g.node("BatchNormalization", [x, scale, bias, mean, var], prefix, epsilon=float(layer.eps),
                  momentum=1.0 - float(momentum if momentum is not None else 0.1))


def _export_maxpool(g, layer, x, prefix, x_shape):
    return g.node("MaxPool", [x], prefix, **_pool_attrs(layer, x_shape))


def _export_avgpool(g, layer, x, prefix, x_shape):
    # PyTorch's AvgPool2d (and parconv's) divides by the whole window, padding included
    return g.node("AveragePool", [x], prefix, count_include_pad=1, **_pool_attrs(layer, x_shape))


def _export_adaptive(g, layer, x, prefix, x_shape):
    size = layer.output_size
    oh, ow = (size, size) if np.ndim(size) == 0 else tuple(size)
    h, w = x_shape[2], x_shape[3]
    oh, ow = h if oh is None else int(oh), w if ow is None else int(ow)
    if (oh, ow) == (1, 1):
        return g.node("GlobalAveragePool", [x], prefix)
    if h % oh or w % ow:
        raise ValueError(f"onnx.export: AdaptiveAvgPool2d {prefix!r} with output_size {layer.output_size!r} on a "
                         f"{h}x{w} input has windows of different sizes, which ONNX has no op for; "
                         f"use output_size 1 or one that divides the input ({h}x{w})")
    kh, kw = h // oh, w // ow
    return g.node("AveragePool", [x], prefix, kernel_shape=[kh, kw], strides=[kh, kw], pads=[0, 0, 0, 0])


def _export_leaky(g, layer, x, prefix, x_shape):
    return g.node("LeakyRelu", [x], prefix, alpha=float(layer.negative_slope))


def _export_elu(g, layer, x, prefix, x_shape):
    return g.node("Elu", [x], prefix, alpha=float(layer.alpha))


def _export_softmax(g, layer, x, prefix, x_shape):
    dim = getattr(layer, "dim", 1)
    return g.node("Softmax", [x], prefix, axis=int(1 if dim is None else dim))


def _unary(op):
    def emit(g, layer, x, prefix, x_shape):
        return g.node(op, [x], prefix)

    return emit


def _export_flatten(g, layer, x, prefix, x_shape):
    return g.node("Flatten", [x], prefix, axis=1)


def _export_dropout(g, layer, x, prefix, x_shape):
    # ONNX Dropout without a training_mode input is the identity (inference), as the layer in eval mode;
    # the node keeps the layer (and its p) in the graph, so a load gives back the same layer indices
    ratio = g.name(f"{prefix}/ratio")
    g.nodes.append(g.helper.make_node("Constant", [], [ratio], name=g.name(f"{prefix}/Constant"),
                                      value=g.onnx.numpy_helper.from_array(np.array(layer.p, np.float32))))
    return g.node("Dropout", [x, ratio], prefix)


def _export_normalize(g, layer, x, prefix, x_shape):
    # (x - mean) / std as Sub and Div of initializers shaped to broadcast over dim 1 (one value: a scalar)
    mean, std = _param(layer, "mean"), _param(layer, "std")
    shape = (1,) if mean.size == 1 else (1, mean.size) + (1,) * (len(x_shape) - 2)
    d = g.node("Sub", [x, g.init(_key(prefix, "mean"), mean.reshape(shape))], prefix)
    return g.node("Div", [d, g.init(_key(prefix, "std"), std.reshape(shape))], prefix)


def _export_identity(g, layer, x, prefix, x_shape):
    return g.node("Identity", [x], prefix)


_EXPORTERS = {
    "Conv2d": _export_conv,
    "Linear": _export_linear,
    "QuantizedConv2d": _export_quantized_conv,  # as QDQ: QuantizeLinear/DequantizeLinear around a float Conv
    "QuantizedLinear": _export_quantized_linear,
    "QuantDequant": _export_quant_dequant,
    "BatchNorm1d": _export_batchnorm,
    "BatchNorm2d": _export_batchnorm,
    "SyncBatchNorm": _export_batchnorm,  # exported in eval form: the same normalisation
    "MaxPool2d": _export_maxpool,
    "AvgPool2d": _export_avgpool,
    "AdaptiveAvgPool2d": _export_adaptive,
    "ReLU": _unary("Relu"),
    "LeakyReLU": _export_leaky,
    "ELU": _export_elu,
    "Sigmoid": _unary("Sigmoid"),
    "Tanh": _unary("Tanh"),
    "Softmax": _export_softmax,
    "Flatten": _export_flatten,
    "Dropout": _export_dropout,
    "Identity": _export_identity,
    "Normalize": _export_normalize,
    "Residual": None,  # handled by _emit (two branches and an Add)
    "Sequential": None,
}


def _emit(g, layer, x, prefix, value):
    """Append ``layer``'s nodes reading tensor ``x``; returns ``(output tensor, output value)``.

    ``value`` is a host batch of the input shape that is run through every
    layer, so each emitter knows its input's shape and the model is checked
    for that shape before anything is written.
    """
    kind = _kind(layer)
    if kind is None:
        raise ValueError(f"onnx.export: layer {prefix or 'model'!r} is a {type(layer).__name__}, which has no "
                         f"ONNX export; supported layers: {', '.join(sorted(_EXPORTERS))}")
    if kind == "Sequential":
        for i, child in enumerate(layer.layers):
            x, value = _emit(g, child, x, _key(prefix, str(i)), value)
        return x, value
    if kind == "Residual":
        body, body_value = _emit(g, layer.body, x, _key(prefix, "body"), value)
        if layer.shortcut is None:
            short, short_value = x, value
        else:
            short, short_value = _emit(g, layer.shortcut, x, _key(prefix, "shortcut"), value)
        if body_value.shape != short_value.shape:
            raise ValueError(f"onnx.export: Residual {prefix!r}: body output {body_value.shape} and shortcut "
                             f"output {short_value.shape} differ for input {value.shape}")
        return g.node("Add", [body, short], prefix), body_value + short_value
    y = _host(layer(value))  # the layer validates its input before its emitter reads the shape
    return _EXPORTERS[kind](g, layer, x, prefix, value.shape), y


def _set_mode(layer, mode: bool) -> None:
    if callable(getattr(layer, "train", None)):
        layer.train(mode)
    else:
        layer.training = mode


def _dims(shape) -> list:
    return ["N"] + [int(d) for d in shape[1:]]


def _check_input_shape(input_shape) -> tuple:
    if isinstance(input_shape, (str, bytes)) or not hasattr(input_shape, "__len__"):
        raise TypeError(f"onnx.export: input_shape must be a tuple of ints like (1, 1, 28, 28) or (1, 784), "
                        f"got {type(input_shape).__name__} {input_shape!r}")
    shape = tuple(input_shape)
    if len(shape) < 2 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1
                                 for d in shape):
        raise ValueError(f"onnx.export: input_shape must be (N, C, H, W) or (N, F): two or more positive ints, "
                         f"got {input_shape!r}")
    return tuple(int(d) for d in shape)


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and one rename; the mode follows the umask."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    # os.open's 0o666 is filtered by the umask, as for open(path, "wb"); mkstemp's 0o600 would not be
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export(model, path, input_shape) -> None:
    """Write ``model`` as an ONNX file (opset 17) that onnxruntime runs to the same outputs.

    Parameters
    ----------
    model : Sequential or Layer
        Any parconv model of the layers in ``parconv.onnx.SUPPORTED_LAYERS``:
        Conv2d (groups, dilation, asymmetric ``"same"`` padding), Linear,
        BatchNorm1d/2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d (output 1, or a
        size that divides the input), ReLU, LeakyReLU, ELU, Sigmoid, Tanh, Softmax,
        Flatten, Dropout, Identity, Normalize (as ``Sub`` and ``Div``), Residual and
        nested Sequential, and the int8 layers of :func:`parconv.quantization.quantize`
        (as QDQ: ``QuantizeLinear``/``DequantizeLinear`` around each quantized
        ``Conv``/``Gemm`` input, int8 weight initializers with a per-channel
        ``DequantizeLinear`` on axis 0, the int32 bias through a ``DequantizeLinear`` at
        scale ``input_scale * weight_scale``). A model in
        training mode is written in eval form (running BatchNorm statistics,
        no Dropout), with a warning; its mode is left as it was.
    path : str or os.PathLike
        Output file, written atomically (a temporary file beside it, then one
        rename), with the permissions the umask gives a new file.
    input_shape : tuple of int
        One input's shape ``(N, C, H, W)`` or ``(N, F)``. The batch dimension
        is dynamic in the file (named ``"N"``); the other dimensions are
        fixed. The model is run once on zeros of this shape to check it.

    Notes
    -----
    The graph reads ``"input"`` (float32) and writes ``"output"``. Weights
    are initializers named like the state-dict keys (``"0.weight"``,
    ``"3.body.1.running_mean"``); each node is named ``"<layer path>/<op>"``
    (``"3.body.0/Conv"``). Dropout writes an inference-mode ``Dropout`` node (the
    identity) and Identity an ``Identity`` node, so that :func:`load` gives
    back the same layers and state-dict keys; runtimes remove both.

    Raises
    ------
    ImportError
        Without the ``onnx`` package.
    TypeError, ValueError
        A model or argument of the wrong type, an input shape the model does
        not accept, or a layer ONNX cannot express (named in the message).
    """
    onnx = _import_onnx()
    from .layers import Layer
    from .model import Sequential

    if not isinstance(model, (Layer, Sequential)):
        raise TypeError(f"onnx.export: model must be a parconv Sequential or layer, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"onnx.export: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    shape = _check_input_shape(input_shape)
    layers = _all_layers(model)
    training = [layer for layer in layers if getattr(layer, "training", False)]
    if training:
        warnings.warn("onnx.export: the model is in training mode; it is exported in eval form (running "
                      "BatchNorm statistics, Dropout off) and left in training mode", UserWarning, stacklevel=2)
    modes = [(layer, layer.training) for layer in layers if hasattr(layer, "training")]
    for layer in training:
        _set_mode(layer, False)
    g = _Graph(onnx)
    try:
        g.name("input")
        out, value = _emit(g, model, "input", "", np.zeros(shape, np.float32))
    finally:
        for layer, mode in modes:  # parents before children: a parent's train() may set its children
            _set_mode(layer, mode)
    helper = onnx.helper
    for node in g.nodes:  # every layer writes a node, so the last one's output becomes "output"
        for i, t in enumerate(node.output):
            if t == out:
                node.output[i] = "output"
    graph = helper.make_graph(
        g.nodes, "parconv",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, _dims(shape))],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, _dims(value.shape))],
        initializer=g.inits,
    )
    from . import __version__

    proto = helper.make_model(graph, producer_name="parconv", producer_version=__version__,
                              opset_imports=[helper.make_opsetid("", OPSET)])
    proto.ir_version = _IR_VERSION
    onnx.checker.check_model(proto)
    _write_atomic(path, proto.SerializeToString())


#: the layers :func:`export` writes
SUPPORTED_LAYERS = tuple(sorted(_EXPORTERS))

#: what :func:`export` does not write, and why: op-table entries (:data:`parconv.optable.OPS`) that are no
#: layer of a model, and layers with no ONNX form. tests/test_onnx_coverage.py fails for an op or a layer
#: that is neither exported nor listed here, so a new one cannot be silently unexportable.
NOT_EXPORTED = {
    "arrays": "array plumbing (asarray, reshape, copy): no op of its own in a graph",
    "losses": "training losses: export the model, which ends in its logits or probabilities",
    "more_losses": "training losses: export the model, which ends in its logits or predictions",
    "optim": "optimizer updates: training only",
    "FilterParallelConv2d": "a convolution split over MPI ranks: load its full weights into a Conv2d to export",
}


# ======================================================================= load
# stands for the dynamic batch size in folded shape arithmetic (Shape -> Gather -> Concat -> Reshape)
_BATCH = -918273645

# how deeply Residuals (Adds of two branches) may nest: real networks nest a few levels; the walk and
# the model built from it recurse once per level
_MAX_NESTING = 100
# graphs with branches are walked with a bit set of reachable nodes per node (n**2 / 8 bytes): at most
# 20,000 nodes (50 MB); the largest networks parconv's layers express have a few hundred
_MAX_FORK_NODES = 20_000

# a folded constant may hold at most this many values, or as many as the file's initializers hold
# (shape arithmetic and transposed weights stay far below; ConstantOfShape([20000, 20000]) does not)
_MIN_FOLD_LIMIT = 1 << 20

_FOLDABLE = ("Constant", "Identity", "Cast", "Transpose", "Unsqueeze", "Squeeze", "Concat", "Gather", "Slice",
             "Reshape", "Shape", "ConstantOfShape", "Add", "Sub", "Mul", "Div", "Neg", "Sqrt", "QuantizeLinear",
             "DequantizeLinear")


class _Node:
    __slots__ = ("idx", "op", "name", "inputs", "outputs", "attrs")

    def __init__(self, idx, proto, attrs):
        self.idx, self.op, self.name = idx, proto.op_type, proto.name
        self.inputs, self.outputs, self.attrs = list(proto.input), list(proto.output), attrs

    def __str__(self) -> str:
        return f"{self.name or '#' + str(self.idx)!r} ({self.op})"

    def swapped(self) -> "_Node":
        """The same node with its two inputs swapped (for commutative ops)."""
        other = _Node.__new__(_Node)
        for slot in _Node.__slots__:
            setattr(other, slot, getattr(self, slot))
        other.inputs = self.inputs[::-1]
        return other


def _spec(kind: str, params: dict | None = None, **kwargs) -> dict:
    return {"type": kind, "kwargs": kwargs, "params": params or {}}


def _int_or_pair(h, w):
    return int(h) if h == w else (int(h), int(w))


class _Loader:
    """Turns the data path of an ONNX graph into nested layer specs (see :func:`load`)."""

    def __init__(self, onnx, proto, path):
        self.onnx, self.path = onnx, path
        graph = proto.graph
        self.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
        self.from_parconv = proto.producer_name == "parconv"
        self.consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        # DequantizeLinear of constants (quantized weights): tensor -> (integers, scale, zero point, axis)
        self.qconst = {}
        # QuantizeLinear of data: output -> (scale, uint8 zero point); DequantizeLinear of that: the same
        self.quantized, self.dequantized = {}, {}
        self.fold_limit = max(_MIN_FOLD_LIMIT, sum(int(v.size) for v in self.consts.values()))
        self.depth = 0
        inputs = [v for v in graph.input if v.name not in self.consts]
        if len(inputs) != 1 or len(graph.output) != 1:
            raise ValueError(f"{path!r}: parconv loads graphs with one data input and one output, this one has "
                             f"inputs {[v.name for v in inputs]} and outputs {[v.name for v in graph.output]}")
        self.x0, self.out = inputs[0].name, graph.output[0].name
        self.shapes = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(proto).graph
            infos = list(inferred.value_info) + list(inferred.input) + list(inferred.output)
        except Exception:  # shape inference is a help (for Shape and Reshape), not a requirement
            infos = list(graph.input) + list(graph.output)
        for v in infos:
            t = v.type.tensor_type
            if t.HasField("shape"):
                self.shapes[v.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        self.rank0 = len(self.shapes[self.x0]) if self.x0 in self.shapes else None
        self.unfoldable = {}
        self.nodes, data = [], {self.x0}
        for idx, proto_node in enumerate(graph.node):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto_node.attribute}
            node = _Node(idx, proto_node, attrs)
            if proto_node.domain not in ("", "ai.onnx"):
                self._unsupported(node, why=f"in the op domain {proto_node.domain!r}")
            data_in = [t for t in node.inputs if t in data]
            if not data_in or node.op == "Shape":
                self._fold(node)
                continue
            self.nodes.append(node)
            data.update(node.outputs)
        if self.out not in data:
            raise ValueError(f"{path!r}: the output {self.out!r} does not depend on the input {self.x0!r}")
        self.producer = {t: n for n in self.nodes for t in n.outputs}
        # only nodes on a path to the output count: a dead branch is not a fork
        live, todo = set(), [self.out]
        while todo:
            node = self.producer.get(todo.pop())
            if node is not None and node.idx not in live:
                live.add(node.idx)
                todo.extend(t for t in node.inputs if t in self.producer or t == self.x0)
        self.live = live
        bad = [n for n in self.nodes if n.idx in live and not hasattr(self, f"_op_{n.op}")]
        if bad:
            self._unsupported(*bad)
        self.consumers = {}
        for node in self.nodes:
            if node.idx in live:
                for t in dict.fromkeys(node.inputs):
                    self.consumers.setdefault(t, []).append(node)
        self._reach = {}

    # ------------------------------------------------------------------ errors
    def fail(self, node, message: str):
        raise ValueError(f"{self.path!r}: node {node}: {message}")

    def _unsupported(self, *nodes, why: str = ""):
        hints = "".join(dict.fromkeys(_HINTS.get(n.op, "") for n in nodes))
        what = "; ".join(f"node {n}: op {n.op!r}" for n in nodes)
        raise ValueError(f"{self.path!r}: {what}{' ' + why if why else ''} not supported by parconv{hints}; "
                         f"supported ops: {', '.join(SUPPORTED_OPS)} (and constant subgraphs of "
                         f"{', '.join(_FOLDABLE)})")

    def _bad_attr(self, node, attr: str, value, supported: str):
        self.fail(node, f"attribute {attr}={value!r} is not supported (supported: {supported})")

    # --------------------------------------------------------------- constants
    def const(self, node, name: str, what: str) -> np.ndarray:
        if name in self.consts:
            return self.consts[name]
        if name in self.unfoldable:
            self._unsupported(self.unfoldable[name], why="(in a constant subgraph)")
        self.fail(node, f"{what} {name!r} must be a constant (an initializer or a foldable constant subgraph)")

    def _static_shape(self, node, t) -> np.ndarray:
        shape = self.shapes.get(t)
        if shape is None or any(d is None for d in shape[1:]):
            self.fail(node, f"the shape of {t!r} is not known statically (only the batch dimension may be dynamic)")
        return np.array([_BATCH if shape[0] is None else shape[0], *shape[1:]], dtype=np.int64)

    def _fold(self, node):
        """Evaluate a node of constant inputs (or a Shape of a data tensor) with NumPy."""
        if node.op not in _FOLDABLE:
            for t in node.outputs:
                self.unfoldable[t] = node
            return
        if node.op == "Constant":
            if len(node.attrs) != 1:
                self.fail(node, f"a Constant needs exactly one value attribute, got {sorted(node.attrs)}")
            (key, value), = node.attrs.items()
            if key in ("value", "sparse_value"):
                value = self.onnx.numpy_helper.to_array(value)
            elif key not in ("value_float", "value_floats", "value_int", "value_ints"):
                self._bad_attr(node, key, value, "value, value_float(s), value_int(s)")
            self.consts[node.outputs[0]] = np.asarray(value, dtype=np.int64 if "int" in key else None)
            return
        try:
            self.consts[node.outputs[0]] = np.asarray(self._evaluate(node))
        except ValueError as exc:
            if str(exc).startswith(repr(self.path)):
                raise
            self.fail(node, f"cannot evaluate this constant subgraph: {exc}")

    def _evaluate(self, node):
        ins = []
        for t in node.inputs:
            if t == "":
                ins.append(None)
            elif node.op == "Shape" and t not in self.consts:
                ins.append(None)
            else:
                ins.append(self.const(node, t, "input"))
        a = node.attrs
        op = node.op
        x = ins[0] if ins else None
        self._check_fold_size(node, ins)

        def axes_of(default=None):
            if self.opset >= 13 and op in ("Unsqueeze", "Squeeze"):
                return None if len(ins) < 2 or ins[1] is None else [int(v) for v in np.ravel(ins[1])]
            return a.get("axes", default)

        if op == "Shape":
            shape = np.array(x.shape, dtype=np.int64) if x is not None else self._static_shape(node, node.inputs[0])
            out = shape[a.get("start", 0):a.get("end", None)]
        elif op == "Identity":
            out = x
        elif op == "Cast":
            out = x.astype(self.onnx.helper.tensor_dtype_to_np_dtype(a["to"]))
        elif op == "Transpose":
            out = np.transpose(x, a.get("perm"))
        elif op == "Unsqueeze":
            axes = axes_of()
            rank = x.ndim + len(axes)
            out = x
            for ax in sorted(v % rank for v in axes):
                out = np.expand_dims(out, ax)
        elif op == "Squeeze":
            axes = axes_of()
            out = np.squeeze(x) if axes is None else np.squeeze(x, tuple(v % x.ndim for v in axes))
        elif op == "Concat":
            out = np.concatenate([np.atleast_1d(v) for v in ins], axis=a["axis"])
        elif op == "Gather":
            out = np.take(x, ins[1], axis=a.get("axis", 0))
        elif op == "Slice":
            starts, ends = np.ravel(ins[1]), np.ravel(ins[2])
            axes = np.ravel(ins[3]) if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
            steps = np.ravel(ins[4]) if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
            index = [slice(None)] * x.ndim
            for s, e, ax, st in zip(starts, ends, axes, steps):
                index[int(ax)] = slice(int(s), int(e), int(st))
            out = x[tuple(index)]
        elif op == "Reshape":
            target = [int(v) for v in ins[1]]
            if not a.get("allowzero", 0):
                target = [x.shape[i] if v == 0 else v for i, v in enumerate(target)]
            out = np.reshape(x, target)
        elif op == "ConstantOfShape":
            fill = self.onnx.numpy_helper.to_array(a["value"]) if "value" in a else np.zeros(1, np.float32)
            out = np.full([int(v) for v in x], fill.ravel()[0], dtype=fill.dtype)
        elif op in ("QuantizeLinear", "DequantizeLinear"):
            out = self._qdq_const(node, ins)
        elif op == "Neg":
            out = -x
        elif op == "Sqrt":
            out = np.sqrt(x)
        else:
            y = ins[1]
            if op == "Div" and x.dtype.kind in "iu":
                out = (np.trunc(x / y)).astype(np.result_type(x, y))
            else:
                out = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op](x, y)
        return out

    def _check_fold_size(self, node, ins) -> None:
        """Refuse a constant node whose output would be larger than the file could justify, before allocating it."""
        op, x = node.op, ins[0] if ins else None
        if op == "ConstantOfShape":
            dims = [int(v) for v in np.ravel(x)]
            if any(d < 0 for d in dims):
                self.fail(node, f"asks for a constant of negative shape {dims}")
            shape = dims
        elif op in ("Add", "Sub", "Mul", "Div") and len(ins) == 2 and x is not None and ins[1] is not None:
            try:
                shape = np.broadcast_shapes(np.shape(x), np.shape(ins[1]))
            except ValueError:
                self.fail(node, f"inputs of shapes {np.shape(x)} and {np.shape(ins[1])} do not broadcast")
        elif op == "Gather" and x is not None and ins[1] is not None and np.ndim(x) > 0:
            axis = int(node.attrs.get("axis", 0))
            if not -np.ndim(x) <= axis < np.ndim(x):
                self.fail(node, f"attribute axis={axis} is out of range for an input of rank {np.ndim(x)}")
            shape = [*np.shape(x)[:axis % np.ndim(x)], *np.shape(ins[1]), *np.shape(x)[axis % np.ndim(x) + 1:]]
        else:
            return
        size = math.prod(shape)
        if size > self.fold_limit:
            self.fail(node, f"would make a constant of shape {tuple(shape)} ({size:,} values); parconv folds "
                            f"constants of at most {self.fold_limit:,} values (as many as the file's initializers "
                            f"hold, or {_MIN_FOLD_LIMIT:,})")

    # --------------------------------------------------------------- quantization
    def _qparams(self, node, ins, axis_size):
        """The scale and zero point of a QuantizeLinear/DequantizeLinear: per tensor, or one per index of the axis."""
        scale = np.asarray(ins[1])
        zero = np.asarray(ins[2]) if len(ins) > 2 and ins[2] is not None else np.zeros(scale.shape, np.uint8)
        if scale.dtype.kind != "f" or not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            self.fail(node, "needs positive finite float scales")
        if zero.dtype not in (np.uint8, np.int8, np.int32) or zero.size != scale.size or zero.ndim > 1:
            self.fail(node, f"needs a uint8, int8 or int32 zero point of the scale's shape {scale.shape}, got "
                            f"{zero.dtype} {zero.shape}")
        if scale.ndim > 1 or (scale.ndim == 1 and scale.size != axis_size and scale.size != 1):
            self.fail(node, f"has scales of shape {scale.shape}; parconv reads one per tensor or one per index of "
                            f"the axis ({axis_size})")
        return scale.astype(np.float32).reshape(scale.shape), zero.reshape(scale.shape)

    def _axis(self, node, x) -> int:
        axis = int(node.attrs.get("axis", 1))
        if not -max(x.ndim, 1) <= axis < max(x.ndim, 1):
            self._bad_attr(node, "axis", axis, f"an axis of the {x.ndim}-D input")
        return axis % max(x.ndim, 1)

    def _qdq_const(self, node, ins):
        """QuantizeLinear / DequantizeLinear of constants (weights and biases), keeping the integers."""
        x = np.asarray(ins[0])
        per_channel = np.ndim(ins[1]) == 1 and np.size(ins[1]) > 1
        axis = self._axis(node, x) if per_channel else 0  # ONNX ignores the axis of per-tensor parameters
        scale, zero = self._qparams(node, ins, x.shape[axis] if x.ndim else 1)
        shape = [1] * x.ndim
        if scale.ndim == 1 and x.ndim:
            shape[axis] = -1
        s, z = scale.reshape(shape), zero.astype(np.int64).reshape(shape)
        if node.op == "QuantizeLinear":
            if x.dtype.kind != "f":
                self.fail(node, f"quantizes {x.dtype} data; QuantizeLinear takes float")
            info = np.iinfo(zero.dtype)
            return np.clip(np.rint(x.astype(np.float32) / s) + z, info.min, info.max).astype(zero.dtype)
        if x.dtype not in (np.uint8, np.int8, np.int32) or x.dtype != zero.dtype:
            self.fail(node, f"dequantizes {x.dtype} data with a {zero.dtype} zero point; parconv reads uint8, int8 "
                            f"and int32 of the zero point's type")
        out = ((x.astype(np.int64) - z).astype(np.float32) * s).astype(np.float32)
        self.qconst[node.outputs[0]] = (x, scale, zero, axis)
        return out

    def _op_QuantizeLinear(self, node, a, specs, rank):
        # per-tensor quantization of the data: the next DequantizeLinear must undo it (QDQ); the pair becomes the
        # input quantization of the Conv/Gemm after it, or nothing before other ops (which run in float)
        scale, zero = self._qparams(node, [None] + [self.const(node, t, "scale or zero point")
                                                   for t in node.inputs[1:3] if t], 1)
        if scale.size != 1 or zero.dtype == np.int32:
            self.fail(node, "quantizes data per channel or to int32; parconv reads per-tensor uint8/int8 activations")
        zp = int(zero.reshape(-1)[0]) + (128 if zero.dtype == np.int8 else 0)  # int8 data is uint8 shifted by 128
        self.quantized[node.outputs[0]] = (np.float32(scale.reshape(-1)[0]), zp)
        if any(c.op != "DequantizeLinear" for c in self.consumers.get(node.outputs[0], [])):
            self.fail(node, "feeds integer data to an op other than DequantizeLinear; parconv loads QDQ graphs "
                            "(QuantizeLinear -> DequantizeLinear -> Conv/Gemm), not QLinear* ops")
        return rank

    def _op_DequantizeLinear(self, node, a, specs, rank):
        got = self.quantized.get(node.inputs[0])
        if got is None:
            self.fail(node, "dequantizes data that no QuantizeLinear of this graph produced")
        scale, zero = self._qparams(node, [None] + [self.const(node, t, "scale or zero point")
                                                   for t in node.inputs[1:3] if t], 1)
        zp = int(zero.reshape(-1)[0]) + (128 if zero.dtype == np.int8 else 0)
        if scale.size != 1 or (np.float32(scale.reshape(-1)[0]), zp) != got:
            self.fail(node, "dequantizes with other parameters than its QuantizeLinear quantized with")
        self.dequantized[node.outputs[0]] = got
        cons = self.consumers.get(node.outputs[0], [])
        if len(cons) != 1 or not self._absorbs(cons[0], node.outputs[0]):
            # the rounding and clamping matter to other consumers (a clamp is how QDQ graphs write a ReLU)
            specs.append(_spec("QuantDequant", scale=float(got[0]), zero_point=got[1]))
        return rank

    def _absorbs(self, node, x_name: str) -> bool:
        """Whether ``node`` becomes a quantized layer that quantizes its input ``x_name`` itself."""
        if node.op not in ("Conv", "Gemm", "MatMul") or not node.inputs or node.inputs[0] != x_name or \
                len(node.inputs) < 2:
            return False
        if node.op == "Gemm" and (float(node.attrs.get("alpha", 1.0)) != 1.0 or node.attrs.get("transA", 0)):
            return False
        axis = 0 if node.op == "Conv" or (node.op == "Gemm" and node.attrs.get("transB", 0)) else 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._quantized_weight(node, node.inputs[1], axis) is not None

    def _quantized_weight(self, node, name: str, out_axis: int):
        """``(int8 weight, float32 scale (O,))`` when tensor ``name`` is a symmetric int8 DequantizeLinear over
        the output channels (``out_axis``) within [-127, 127]; else None (the layer is then loaded in float)."""
        q = self.qconst.get(name)
        if q is None:
            return None
        x, scale, zero, axis = q
        o = x.shape[out_axis] if x.ndim > out_axis else 0
        if x.dtype != np.int8 or np.any(zero != 0) or (scale.size > 1 and axis != out_axis) or o == 0:
            return None
        if x.size and (x.min() < -127):
            warnings.warn(f"onnx.load: {self.path!r}: node {node}: int8 weights use -128, outside parconv's "
                          f"symmetric [-127, 127]; the layer is loaded in float32", UserWarning, stacklevel=4)
            return None
        return x, np.ascontiguousarray(np.broadcast_to(scale.reshape(-1), (o,)), dtype=np.float32)

    def _quantized_spec(self, node, spec, x_name, wq, bias_name):
        """Turn a float Conv2d/Linear spec into its quantized form when its input comes through QDQ."""
        qin = self.dequantized.get(x_name)
        if qin is None:
            return spec
        if wq is None:  # float weights: the QuantDequant before it keeps the rounding (_op_DequantizeLinear)
            return spec
        from .quantization import quantize_bias, requant_scale

        wq, ws = wq
        s_x, z_x = qin
        kind = "QuantizedConv2d" if spec["type"] == "Conv2d" else "QuantizedLinear"
        qb = None
        bq = self.qconst.get(bias_name) if bias_name else None
        scale = requant_scale(s_x, ws)
        if bq is not None and bq[0].dtype == np.int32 and np.all(bq[2] == 0) and np.array_equal(
                np.broadcast_to(bq[1].reshape(-1), scale.shape), scale):
            qb = bq[0].reshape(-1).astype(np.int32)
        elif spec["params"].get("bias") is not None:
            qb = quantize_bias(spec["params"]["bias"], s_x, ws)
        params = {"weight": wq.reshape(spec["params"]["weight"].shape), "weight_scale": ws, "bias": qb,
                  "input_scale": np.array([s_x], np.float32), "input_zero_point": np.array([z_x], np.uint8)}
        return {"type": kind, "kwargs": dict(spec["kwargs"]), "params": params}

    # ---------------------------------------------------------------- the walk
    def reach(self, node) -> int:
        """The live nodes reachable from ``node`` (itself included), as a bit set of node indices."""
        if not self._reach and len(self.nodes) > _MAX_FORK_NODES:
            # a bit set per node of every node after it: quadratic memory in the graph's size
            self.fail(node, f"forks a graph of {len(self.nodes):,} data nodes; parconv loads graphs with branches "
                            f"of at most {_MAX_FORK_NODES:,} nodes")
        if not self._reach:  # ONNX nodes are topologically sorted: consumers come later
            for n in reversed(self.nodes):
                bits = 1 << n.idx
                for t in n.outputs:
                    for c in self.consumers.get(t, []):
                        bits |= self._reach[c.idx]
                self._reach[n.idx] = bits
        return self._reach[node.idx]

    def chain(self, start: str, stop: str, first, rank):
        """Specs of the layers from tensor ``start`` to tensor ``stop``; returns ``(specs, rank)``."""
        specs, cur = [], start
        while cur != stop:
            if first is not None:
                node, first = first, None
            else:
                cons = self.consumers.get(cur, [])
                if not cons:
                    raise ValueError(f"{self.path!r}: tensor {cur!r} is not used on the way to {stop!r}")
                if len(cons) > 1:
                    spec, cur, rank = self.fork(cur, cons, rank)
                    specs.append(spec)
                    continue
                node = cons[0]
            cur, rank = self.step(node, cur, specs, rank)
        return specs, rank

    def fork(self, cur: str, cons: list, rank):
        """Two branches from ``cur`` joined by an Add: a Residual spec; returns ``(spec, join output, rank)``."""
        node_by_idx = {n.idx: n for n in self.nodes}
        if len(cons) != 2:
            raise ValueError(f"{self.path!r}: tensor {cur!r} feeds {len(cons)} nodes "
                             f"({', '.join(map(str, cons))}); parconv loads forks of two branches joined by an "
                             f"Add (a Residual)")
        common = self.reach(cons[0]) & self.reach(cons[1])
        if not common:
            raise ValueError(f"{self.path!r}: the branches from {cur!r} never join")
        join = node_by_idx[(common & -common).bit_length() - 1]  # the first node both branches reach
        data_in = [t for t in join.inputs if t in self.producer or t == self.x0]
        if join.op not in ("Add", "Sum") or len(join.inputs) != 2 or len(data_in) != 2:
            self.fail(join, f"joins the branches from {cur!r}; parconv loads only an Add of two branches "
                            f"(a Residual)")
        branches = []
        for t in join.inputs:
            if t == cur:
                branches.append((t, None))
                continue
            owners = [c for c in cons if self.reach(c) >> self.producer[t].idx & 1]
            if len(owners) != 1 or self.consumers.get(t) != [join]:
                self.fail(join, f"adds branches from {cur!r} that are not separate chains")
            branches.append((t, owners[0]))
        if branches[0][1] is branches[1][1]:
            self.fail(join, f"adds two tensors that come from one branch of {cur!r}")
        self.depth += 1
        if self.depth > _MAX_NESTING:
            self.fail(join, f"nests Residual branches (Adds of two branches) more than {_MAX_NESTING} deep; "
                            "parconv loads networks nested at most that deep")
        built = []
        for t, first in branches:
            if first is None:
                built.append((None, rank))
            else:
                built.append(self.chain(cur, t, first, rank))
        self.depth -= 1
        (a, rank_a), (b, rank_b) = built
        if a is None or (b is not None and len(b) > len(a)):
            a, b, rank_a = b, a, rank_b
        return {"type": "Residual", "body": a, "shortcut": b}, join.outputs[0], rank_a

    def step(self, node, cur: str, specs: list, rank):
        """Append the spec(s) of ``node`` (which reads ``cur``); returns ``(its output, rank)``."""
        op, a = node.op, node.attrs
        if op == "Add" and len(node.inputs) == 2 and node.inputs[1] == cur and node.inputs[0] in self.consts:
            node = node.swapped()  # bias + x is x + bias
        for t in node.inputs[1:]:
            if t == cur or t in self.producer:
                if op == "Add" and node.inputs == [cur, cur]:
                    specs.append({"type": "Residual", "body": [_spec("Identity")], "shortcut": None})
                    return node.outputs[0], rank
                self.fail(node, "reads a data tensor where parconv expects a constant (a join of two branches "
                                "must be an Add of branches that fork from one tensor)")
        if node.inputs[0] != cur:
            self.fail(node, f"reads {cur!r} as input {node.inputs.index(cur)}, expected input 0")
        for i, t in enumerate(node.outputs[1:], 1):
            if t and self.consumers.get(t):
                self.fail(node, f"output {i} ({t!r}) is used; parconv computes only the first output")
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            self._unsupported(node)
        return node.outputs[0], handler(node, a, specs, rank)

    def _need_rank(self, node, rank, allowed):
        if rank not in allowed:
            self.fail(node, f"needs a {' or '.join(map(str, allowed))}-D input, got "
                            f"{'an input of unknown rank' if rank is None else f'a {rank}-D input'}")

    def _check_geometry(self, node, a, **lists) -> None:
        """Strides, dilations, pads (and pooling kernels) within the bounds parconv's layers accept."""
        from ._shapes import MAX_GEOMETRY

        lists["pads"] = a.get("pads", [])
        for name, values in lists.items():
            values = [int(v) for v in values]
            if any(abs(v) > MAX_GEOMETRY for v in values):
                self._bad_attr(node, name, values, f"values of at most {MAX_GEOMETRY} in magnitude")

    def _pads2d(self, node, a, kernel, strides, dilations, allow_same: bool):
        pads = [int(v) for v in a.get("pads", [0, 0, 0, 0])]
        auto = a.get("auto_pad", b"NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        if auto == "VALID":
            return 0
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            if not allow_same or tuple(strides) != (1, 1):
                self._bad_attr(node, "auto_pad", auto, "NOTSET, VALID, SAME_UPPER with stride 1 on Conv")
            th, tw = dilations[0] * (kernel[0] - 1), dilations[1] * (kernel[1] - 1)
            if auto == "SAME_LOWER" and (th % 2 or tw % 2):
                self._bad_attr(node, "auto_pad", auto, "SAME_LOWER only with symmetric padding")
            return "same"
        if auto != "NOTSET":
            self._bad_attr(node, "auto_pad", auto, "NOTSET, VALID, SAME_UPPER")
        if len(pads) != 4:
            self._bad_attr(node, "pads", pads, "4 values for a 2-D op")
        top, left, bottom, right = pads
        if top == bottom and left == right:
            return _int_or_pair(top, left)
        th, tw = dilations[0] * (kernel[0] - 1), dilations[1] * (kernel[1] - 1)
        if allow_same and tuple(strides) == (1, 1) and (top, bottom, left, right) == (
                th // 2, th - th // 2, tw // 2, tw - tw // 2):
            return "same"
        self._bad_attr(node, "pads", pads, "symmetric pads, or PyTorch's padding='same' on a stride-1 Conv")

    # ---------------------------------------------------------------- handlers
    def _op_Conv(self, node, a, specs, rank):
        w = self.const(node, node.inputs[1], "weight").astype(np.float32)
        if w.ndim != 4:
            self.fail(node, f"weight has shape {w.shape}; parconv has 2-D convolutions only (a 4-D weight)")
        self._need_rank(node, rank, (4,))
        b = self.const(node, node.inputs[2], "bias").astype(np.float32) if len(node.inputs) > 2 and node.inputs[2] \
            else None
        kernel = list(a.get("kernel_shape", w.shape[2:]))
        if tuple(kernel) != w.shape[2:]:
            self._bad_attr(node, "kernel_shape", kernel, f"the weight's {w.shape[2:]}")
        strides = list(a.get("strides", [1, 1]))
        dilations = list(a.get("dilations", [1, 1]))
        groups = int(a.get("group", 1))
        self._check_geometry(node, a, strides=strides, dilations=dilations)
        padding = self._pads2d(node, a, kernel, strides, dilations, allow_same=True)
        kwargs = dict(in_channels=w.shape[1] * groups, out_channels=w.shape[0],
                      kernel_size=_int_or_pair(*kernel), bias=b is not None)
        if strides != [1, 1]:
            kwargs["stride"] = _int_or_pair(*strides)
        if padding != 0:
            kwargs["padding"] = padding
        if dilations != [1, 1]:
            kwargs["dilation"] = _int_or_pair(*dilations)
        if groups != 1:
            kwargs["groups"] = groups
        spec = _spec("Conv2d", {"weight": w, "bias": b}, **kwargs)
        specs.append(self._quantized_spec(node, spec, node.inputs[0], self._quantized_weight(node, node.inputs[1], 0),
                                          node.inputs[2] if len(node.inputs) > 2 else ""))
        return 4

    def _linear(self, node, w, b, specs):
        specs.append(_spec("Linear", {"weight": w, "bias": b}, in_features=w.shape[1], out_features=w.shape[0],
                           bias=b is not None))
        return 2

    def _op_Gemm(self, node, a, specs, rank):
        self._need_rank(node, rank, (2,))
        if a.get("transA", 0):
            self._bad_attr(node, "transA", a["transA"], "0")
        w = self.const(node, node.inputs[1], "B").astype(np.float32)
        if w.ndim != 2:
            self.fail(node, f"B has shape {w.shape}, expected 2-D")
        w = (w if a.get("transB", 0) else w.T) * np.float32(a.get("alpha", 1.0))
        b = None
        if len(node.inputs) > 2 and node.inputs[2]:
            c = self.const(node, node.inputs[2], "C").astype(np.float32) * np.float32(a.get("beta", 1.0))
            if c.size not in (1, w.shape[0]) or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
                self.fail(node, f"C has shape {c.shape}; parconv needs a bias of shape ({w.shape[0]},)")
            b = np.broadcast_to(c.reshape(-1), (w.shape[0],)).copy()
        rank = self._linear(node, np.ascontiguousarray(w), b, specs)
        wq = None
        if float(a.get("alpha", 1.0)) == 1.0:
            trans = bool(a.get("transB", 0))
            wq = self._quantized_weight(node, node.inputs[1], 0 if trans else 1)
            if wq is not None and not trans:
                wq = (np.ascontiguousarray(wq[0].T), wq[1])
        bias_name = node.inputs[2] if len(node.inputs) > 2 and float(a.get("beta", 1.0)) == 1.0 else ""
        specs[-1] = self._quantized_spec(node, specs[-1], node.inputs[0], wq, bias_name)
        return rank

    def _op_MatMul(self, node, a, specs, rank):
        self._need_rank(node, rank, (2,))
        w = self.const(node, node.inputs[1], "B").astype(np.float32)
        if w.ndim != 2:
            self.fail(node, f"B has shape {w.shape}, expected 2-D (in_features, out_features)")
        rank = self._linear(node, np.ascontiguousarray(w.T), None, specs)
        wq = self._quantized_weight(node, node.inputs[1], 1)
        if wq is not None:
            wq = (np.ascontiguousarray(wq[0].T), wq[1])
        specs[-1] = self._quantized_spec(node, specs[-1], node.inputs[0], wq, "")
        return rank

    def _op_Add(self, node, a, specs, rank):
        # a constant added to a Conv/Linear output is its bias (MatMul + Add, Conv + Add)
        c = self.const(node, node.inputs[1], "addend").astype(np.float32)
        last = specs[-1] if specs else None
        kind = last["type"] if last else None
        if kind in ("QuantizedConv2d", "QuantizedLinear"):
            return self._add_quantized_bias(node, last, c, rank)
        if kind in ("Conv2d", "Linear", "BatchNorm1d", "BatchNorm2d"):
            n = last["params"]["weight"].shape[0]
            want = {(n,), (1, n)} if kind == "Linear" or rank == 2 else {(n, 1, 1), (1, n, 1, 1)}
            if c.shape in want or c.size == 1:
                vec = np.broadcast_to(c.reshape(-1), (n,))
                old = last["params"].get("bias")
                last["params"]["bias"] = (vec if old is None else old + vec).astype(np.float32)
                if "bias" in last["kwargs"]:
                    last["kwargs"]["bias"] = True
                return rank
        self.fail(node, f"adds a constant of shape {c.shape} after {kind or 'the input'}; parconv loads an Add "
                        f"of a constant only as the bias of a Conv, Gemm/MatMul or BatchNormalization before it")

    def _add_quantized_bias(self, node, last, c, rank):
        """A float bias added after a quantized MatMul/Conv: quantized to int32 at the layer's scale."""
        from .quantization import quantize_bias, requant_scale

        params = last["params"]
        n = params["weight"].shape[0]
        if c.size not in (1, n):
            self.fail(node, f"adds a constant of shape {c.shape} after a quantized layer of {n} outputs")
        scale = requant_scale(params["input_scale"][0], params["weight_scale"]).astype(np.float64)
        old = 0.0 if params["bias"] is None else params["bias"].astype(np.float64) * scale
        params["bias"] = quantize_bias(old + np.broadcast_to(c.reshape(-1), (n,)), params["input_scale"][0],
                                       params["weight_scale"])
        last["kwargs"]["bias"] = True
        return rank

    def _op_Sum(self, node, a, specs, rank):
        self._unsupported(node, why="(outside an Add of two branches)")

    def _op_BatchNormalization(self, node, a, specs, rank):
        if a.get("training_mode", 0):
            self._bad_attr(node, "training_mode", a["training_mode"], "0 (inference)")
        self._need_rank(node, rank, (2, 3, 4))
        scale, bias, mean, var = (self.const(node, t, what).astype(np.float32)
                                  for t, what in zip(node.inputs[1:5], ("scale", "B", "mean", "var")))
        n = mean.shape[0]
        momentum = round(1.0 - float(a.get("momentum", 0.9)), 12)
        specs.append(_spec("BatchNorm2d" if rank == 4 else "BatchNorm1d",
                           {"weight": scale, "bias": bias, "running_mean": mean, "running_var": var},
                           num_features=n, eps=float(a.get("epsilon", 1e-5)), momentum=momentum))
        return rank

    def _op_Relu(self, node, a, specs, rank):
        last = specs[-1] if specs else None
        if last is not None and last["type"] in ("QuantizedConv2d", "QuantizedLinear") and \
                not last["kwargs"].get("relu"):
            last["kwargs"]["relu"] = True  # applied by the quantized layer, as quantize() fuses it
            return rank
        specs.append(_spec("ReLU"))
        return rank

    def _op_Sigmoid(self, node, a, specs, rank):
        specs.append(_spec("Sigmoid"))
        return rank

    def _op_Tanh(self, node, a, specs, rank):
        specs.append(_spec("Tanh"))
        return rank

    def _op_LeakyRelu(self, node, a, specs, rank):
        specs.append(_spec("LeakyReLU", negative_slope=float(a.get("alpha", 0.01))))
        return rank

    def _op_Elu(self, node, a, specs, rank):
        specs.append(_spec("ELU", alpha=float(a.get("alpha", 1.0))))
        return rank

    def _op_Softmax(self, node, a, specs, rank):
        axis = int(a.get("axis", -1 if self.opset >= 13 else 1))
        if rank is None:
            self.fail(node, "needs an input of known rank")
        if not -rank <= axis < rank:
            self._bad_attr(node, "axis", axis, f"an axis of the {rank}-D input, in [{-rank}, {rank - 1}]")
        axis %= rank
        if self.opset < 13 and axis != rank - 1:
            self._bad_attr(node, "axis", a.get("axis", 1), f"the last axis before opset 13 ({rank - 1})")
        specs.append(_spec("Softmax", dim=axis))
        return rank

    def _pool(self, node, a, kind):
        kernel = list(a["kernel_shape"]) if "kernel_shape" in a else self.fail(node, "has no kernel_shape")
        if len(kernel) != 2:
            self._bad_attr(node, "kernel_shape", kernel, "2-D pooling")
        if a.get("ceil_mode", 0):
            self._bad_attr(node, "ceil_mode", a["ceil_mode"], "0")
        dilations = list(a.get("dilations", [1, 1]))
        if dilations != [1, 1]:
            self._bad_attr(node, "dilations", dilations, "[1, 1]")
        strides = list(a.get("strides", [1, 1]))  # ONNX's default stride is 1, PyTorch's the kernel
        self._check_geometry(node, a, kernel_shape=kernel, strides=strides)
        padding = self._pads2d(node, a, kernel, strides, dilations, allow_same=False)
        kwargs = dict(kernel_size=_int_or_pair(*kernel), stride=_int_or_pair(*strides))
        if padding != 0:
            kwargs["padding"] = padding
        return _spec(kind, **kwargs), padding

    def _op_MaxPool(self, node, a, specs, rank):
        self._need_rank(node, rank, (4,))
        if a.get("storage_order", 0) and self.consumers.get(node.outputs[1] if len(node.outputs) > 1 else ""):
            self._bad_attr(node, "storage_order", a["storage_order"], "0")
        specs.append(self._pool(node, a, "MaxPool2d")[0])
        return 4

    def _op_AveragePool(self, node, a, specs, rank):
        self._need_rank(node, rank, (4,))
        spec, padding = self._pool(node, a, "AvgPool2d")
        if padding != 0 and not a.get("count_include_pad", 0):
            self._bad_attr(node, "count_include_pad", 0, "1 when padding (PyTorch's AvgPool2d default)")
        specs.append(spec)
        return 4

    def _op_GlobalAveragePool(self, node, a, specs, rank):
        self._need_rank(node, rank, (4,))
        specs.append(_spec("AdaptiveAvgPool2d", output_size=1))
        return 4

    def _op_ReduceMean(self, node, a, specs, rank):
        self._need_rank(node, rank, (4,))
        if self.opset >= 18 and len(node.inputs) > 1 and node.inputs[1]:
            axes = [int(v) for v in np.ravel(self.const(node, node.inputs[1], "axes"))]
        else:
            axes = a.get("axes")
        if axes is None or sorted(v % 4 for v in axes) != [2, 3]:
            self._bad_attr(node, "axes", axes, "[2, 3] (the spatial mean, global average pooling)")
        specs.append(_spec("AdaptiveAvgPool2d", output_size=1))
        if not a.get("keepdims", 1):
            specs.append(_spec("Flatten"))
            return 2
        return 4

    def _op_Flatten(self, node, a, specs, rank):
        if int(a.get("axis", 1)) != 1:
            self._bad_attr(node, "axis", a["axis"], "1 (keep the batch dimension)")
        specs.append(_spec("Flatten"))
        return 2

    def _op_Squeeze(self, node, a, specs, rank):
        axes = a.get("axes")
        if self.opset >= 13 and len(node.inputs) > 1 and node.inputs[1]:
            axes = [int(v) for v in np.ravel(self.const(node, node.inputs[1], "axes"))]
        if rank != 4 or axes is None or sorted(v % 4 for v in axes) != [2, 3]:
            self._bad_attr(node, "axes", axes, "[2, 3] of a 4-D tensor (after global average pooling)")
        specs.append(_spec("Flatten"))
        return 2

    def _op_Reshape(self, node, a, specs, rank):
        target = [int(v) for v in np.ravel(self.const(node, node.inputs[1], "shape"))]
        shape = self.shapes.get(node.inputs[0])
        features = math.prod(shape[1:]) if shape and all(d is not None for d in shape[1:]) else None
        batch = shape[0] if shape else None
        ok = len(target) == 2 and (
            target[0] in (_BATCH, batch) or (target[0] == 0 and not a.get("allowzero", 0))
            or (target[0] == -1 and target[1] > 0))
        if ok and target[1] != -1 and features is not None and target[1] != features:
            ok = False
        if not ok:
            self.fail(node, f"reshapes to {target} (batch {_BATCH} stands for the dynamic batch size); parconv "
                            f"loads a Reshape only as a Flatten to (N, features)")
        specs.append(_spec("Flatten"))
        return 2

    def _op_Dropout(self, node, a, specs, rank):
        if len(node.inputs) > 2 and node.inputs[2] and bool(np.ravel(self.const(node, node.inputs[2], "mode"))[0]):
            self._bad_attr(node, "training_mode", True, "False (inference)")
        p = float(np.ravel(self.const(node, node.inputs[1], "ratio"))[0]) if len(node.inputs) > 1 and \
            node.inputs[1] else float(a.get("ratio", 0.5))
        specs.append(_spec("Dropout", p=p))
        return rank

    def _op_Identity(self, node, a, specs, rank):
        # other producers write Identity nodes for plumbing; parconv writes one per Identity layer
        if self.from_parconv:
            specs.append(_spec("Identity"))
        return rank


    # ------------------------------------------------------------ input normalisation
    def _channel_vector(self, node, c, rank, what: str) -> np.ndarray:
        """A constant that broadcasts over dim 1 of the data (one value, or one per channel) as a 1-D array."""
        c = np.asarray(c, dtype=np.float32)
        if c.size == 1:
            return c.reshape(1)
        full = [1] * ((rank or 0) - c.ndim) + list(c.shape)
        if rank is None or c.ndim > rank or full[0] != 1 or any(d != 1 for d in full[2:]):
            self.fail(node, f"{what} has shape {c.shape}; parconv loads a constant {what} of one value or one per "
                            f"channel (shape (1, C, 1, 1) for a 4-D input) as a Normalize")
        return c.reshape(-1)

    def _op_Sub(self, node, a, specs, rank):
        # x - mean: the start of an input normalisation (torchvision's Normalize, parconv's)
        mean = self._channel_vector(node, self.const(node, node.inputs[1], "subtrahend"), rank, "subtrahend")
        specs.append(_spec("Normalize", {"mean": mean, "std": np.ones_like(mean)},
                           mean=mean.tolist(), std=[1.0] * mean.size))
        return rank

    def _op_Div(self, node, a, specs, rank):
        std = self._channel_vector(node, self.const(node, node.inputs[1], "divisor"), rank, "divisor")
        last = specs[-1] if specs else None
        if last is not None and last["type"] == "Normalize" and np.all(last["params"]["std"] == 1):
            specs.pop()  # (x - mean) / std: one Normalize
            mean = last["params"]["mean"]
        else:
            mean = np.zeros_like(std)
        if mean.size != std.size and 1 not in (mean.size, std.size):
            self.fail(node, f"divides by {std.size} values after subtracting {mean.size}; a Normalize needs one "
                            "value per channel for both, or one for all")
        mean, std = (np.ascontiguousarray(v, dtype=np.float32) for v in np.broadcast_arrays(mean, std))
        specs.append(_spec("Normalize", {"mean": mean, "std": std}, mean=mean.tolist(), std=std.tolist()))
        return rank


def _build(specs: list, backend):
    """Layers from specs; returns ``(Sequential, state dict entries)``."""
    from . import layers as _layers
    from .model import Sequential

    layers, state = [], {}
    for i, spec in enumerate(specs):
        if spec["type"] == "Residual":
            body, body_state = _build(spec["body"], backend)
            short, short_state = (None, {}) if spec["shortcut"] is None else _build(spec["shortcut"], backend)
            layer = _layers.Residual(body, short)
            sub = {f"body.{k}": v for k, v in body_state.items()}
            sub.update({f"shortcut.{k}": v for k, v in short_state.items()})
        else:
            cls = _layers.LAYER_TYPES[spec["type"]]  # parconv's layers, the quantized ones included
            layer = cls(**spec["kwargs"], backend=backend)
            sub = {k: v for k, v in spec["params"].items() if v is not None}
        layers.append(layer)
        state.update({f"{i}.{k}": v for k, v in sub.items()})
    return Sequential(*layers, backend=backend), state


def load(path, backend=None):
    """Build a :class:`parconv.Sequential` from an ONNX file of supported ops.

    Parameters
    ----------
    path : str or os.PathLike
        An ONNX model with one float32 input ``(N, C, H, W)`` or ``(N, F)``
        and one output, e.g. one written by :func:`export` or by
        ``torch.onnx.export`` (either exporter) from an equivalent PyTorch
        model.
    backend : str or Backend, optional
        Where the model lives; None is the process default.

    Returns
    -------
    Sequential
        In eval mode (an ONNX graph is an inference graph). Weights and
        BatchNorm statistics come from the initializers; an ``Add`` of two
        branches forked from one tensor becomes ``Residual(body, shortcut)``
        (each branch a Sequential; the longer branch is the body, an identity
        branch the ``None`` shortcut); a constant subgraph (shape arithmetic, a transposed
        weight) is folded first. A ``Sub`` and/or ``Div`` of constants of one value or
        one per channel (``(x - mean) / std``, an input normalisation) becomes a
        :class:`parconv.Normalize`. A QDQ graph (as :func:`export` writes for a quantized
        model, or ONNX Runtime's ``quantize_static`` in QDQ format) loads as int8 layers: a
        ``Conv``/``Gemm``/``MatMul`` whose input comes through ``QuantizeLinear ->
        DequantizeLinear`` (per tensor, uint8 or int8) and whose weight is a symmetric int8
        ``DequantizeLinear`` becomes a :class:`parconv.quantization.QuantizedConv2d` /
        :class:`~parconv.quantization.QuantizedLinear`; a pair before another op becomes a
        :class:`~parconv.quantization.QuantDequant`.

    Raises
    ------
    ValueError
        For a corrupt or truncated file (naming it), and for an op or
        attribute parconv has no layer for, naming the op, the node and what
        is supported (e.g. ``Erf``, which is how GELU exports).
    """
    onnx = _import_onnx()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"onnx.load: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"ONNX file {path!r} does not exist")
    from ._io import open_regular

    with open_regular(path, "the ONNX file"):  # a FIFO or a device would block or feed the parser forever
        pass
    try:
        proto = onnx.load(path)
        onnx.checker.check_model(proto)
    except Exception as exc:  # protobuf's DecodeError, onnx's ValidationError, external-data errors, ...
        raise ValueError(f"{path!r} is not a readable ONNX model (corrupt or truncated?): "
                         f"{type(exc).__name__}: {exc}") from None
    try:
        loader = _Loader(onnx, proto, path)
        specs, _ = loader.chain(loader.x0, loader.out, None, loader.rank0)
    except (KeyError, IndexError, TypeError, AttributeError, np.exceptions.AxisError) as exc:
        raise ValueError(f"{path!r}: malformed ONNX graph: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:  # NumPy's, on initializers of the wrong shape: name the file too
        if str(exc).startswith(repr(path)):
            raise
        raise ValueError(f"{path!r}: malformed ONNX graph: {exc}") from None
    if not specs:
        specs = [_spec("Identity")]
    try:  # a layer refuses what the graph asks of it (e.g. pooling padding over half the kernel)
        model, state = _build(specs, backend)
        full = model.state_dict()
        full.update(state)
        model.load_state_dict(full)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path!r}: the graph does not make a valid parconv model: {exc}") from None
    if callable(getattr(model, "eval", None)):
        model.eval()
    return model
