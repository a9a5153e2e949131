"""Fusion planning for a :class:`parconv.Sequential`: which runs of layers execute as one op.

A plan is a list of steps; each step has ``forward(x)`` and ``backward(dy,
need_dx)``. An unfused layer is its own step. A fused step holds its own
cached activations and writes only the gradients of its layers' parameters
(as the layers' own backward would), never another layer's private state.

Fusions:

* ``Conv2d -> ReLU -> MaxPool2d`` (square kernel, int stride/padding, one
  group; square pooling without padding): one convolution+ReLU+max-pooling
  op that never writes the full-size convolution output;
* the same followed by ``Flatten -> Linear`` where the backend fuses that
  classifier head too (:func:`parconv.functional.fuses_linear_head`);
* ``BatchNorm -> ReLU`` in training and eval mode: one normalisation pass
  that applies the ReLU as it writes;
* ``Linear -> ReLU`` in training and eval mode: the bias and the ReLU applied
  as the product is stored (each hidden activation written once), and the
  backward masks dy once, summing the bias gradient in the same pass
  (:class:`LinearReLU`);
* ``Residual -> ReLU`` in both modes: the ReLU applied by the block, and
  where the block's body ends in a BatchNorm, the shortcut added and the
  ReLU applied by that BatchNorm as it writes (one pass instead of three),
  elsewhere the add and the ReLU in one pass (``Backend.add_relu``);
* quantized layers (:mod:`parconv.quantization`) that feed each other through
  placeholders: each native int8 kernel stores the next one's uint8 input; residual
  blocks of them (and the ReLU after each, nested Sequentials included) run inside
  such a chain, the block's last convolution adding the shortcut as it stores;
* ``Conv2d -> BatchNorm2d (-> ReLU)`` in eval mode: the running statistics
  folded into the convolution once, rebuilt only when parconv changed a weight
  or statistic (:func:`parconv.weights_changed`). Square kernel, int
  stride/padding, one group: a per-filter scale and shift applied with the
  ReLU as the convolution stores its output (``conv2d_scale_shift_forward``).
  Every other convolution (depthwise, grouped, dilated, rectangular): the
  scale folded into the filters and the shift into the bias, the ReLU applied
  as the convolution stores (``conv2d_general_relu_forward``).

Nested containers plan their own runs.
"""

from __future__ import annotations

import numpy as np

from . import functional as F
from ._grad import NOT_SAVED, SavedForBackward, enable_grad, no_grad_error
from .amp import autocast, current_precision
from ._validation import shape_of, to_backend_array
from ._weights import weights_epoch
from .layers import BatchNorm1d, BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU, Residual, SyncBatchNorm

__all__ = ["plan", "PlanStep"]


class PlanStep:
    """One entry of a plan: ``step`` runs layers ``start .. stop - 1``; ``hooks`` are the layer
    indices whose parameters' gradients are final after ``step.backward``, in the order they are."""

    __slots__ = ("step", "start", "stop", "hooks")

    def __init__(self, step, start: int, stop: int, hooks: tuple):
        self.step, self.start, self.stop, self.hooks = step, start, stop, hooks


class _Fused:
    """Base of fused steps: the layers it runs and its own cache."""

    _cache = SavedForBackward()

    def __init__(self, start: int, layers: list):
        self.start, self.layers = start, layers
        self.backend = layers[0].backend
        self._cache = None
        self._checked = None  # the last input shape the layers accepted

    def release(self) -> None:
        self._cache = None

    def _check_input(self, x) -> None:
        """Run the layers' own shape checks (once per input shape), so that an error names the user's
        layer and its index in the Sequential rather than the fused op."""
        shape = shape_of(x)
        if shape == self._checked:
            return
        s = shape
        for k, layer in enumerate(self.layers):
            try:
                s = tuple(layer.output_shape(s))
            except ValueError as exc:
                raise ValueError(f"layer {self.start + k}: {exc}") from None
        self._checked = shape

    def _cached(self):
        cache = self._cache
        if cache is None or cache is NOT_SAVED:
            names = ", ".join(type(layer).__name__ for layer in self.layers)
            where = f"Sequential.backward: layers {self.start}..{self.start + len(self.layers) - 1} ({names})"
            if cache is NOT_SAVED:
                raise no_grad_error(where)
            raise ValueError(f"{where} have no forward pass to differentiate (call the model first)")
        return cache

    def _dy(self, dy, expected: tuple):
        dy = to_backend_array(dy, self.backend, "dy", "Sequential.backward")
        if shape_of(dy) != tuple(expected):
            raise ValueError(f"Sequential.backward: dy must have the output's shape {tuple(expected)}, "
                             f"got {shape_of(dy)}")
        return dy


class ConvReluMaxPool(_Fused):
    """``Conv2d -> ReLU -> MaxPool2d`` as one op."""

    def __init__(self, start, conv, relu, pool):
        super().__init__(start, [conv, relu, pool])
        self.conv, self.pool = conv, pool

    def forward(self, x):
        conv = self.conv
        self._check_input(x)
        b = conv.bias.data if conv.bias is not None else None
        precision = current_precision()  # bf16: the ops compose around the bf16 convolution (functional)
        y, argmax = F.conv2d_relu_maxpool2d(x, conv.weight.data, b, conv._fargs["stride"], conv._fargs["padding"],
                                            self.pool._fargs["kernel_size"], self.pool._fargs["stride"],
                                            precision=precision, backend=self.backend)
        self._cache = (x, y, argmax, precision)
        return y

    def backward(self, dy, need_dx: bool = True):
        conv = self.conv
        x, y, argmax, precision = self._cached()
        dy = self._dy(dy, shape_of(y))
        dx, dw, db = F.conv2d_relu_maxpool2d_backward(x, conv.weight.data, y, argmax, dy, conv._fargs["stride"],
                                                      conv._fargs["padding"], need_dx=need_dx,
                                                      need_db=conv.bias is not None, precision=precision,
                                                      pool_kernel=self.pool._fargs["kernel_size"],
                                                      pool_stride=self.pool._fargs["stride"], backend=self.backend)
        conv.weight.grad = dw
        if conv.bias is not None:
            conv.bias.grad = db
        return dx


class ConvReluMaxPoolHead(_Fused):
    """``Conv2d -> ReLU -> MaxPool2d -> Flatten -> Linear`` as one op (the classifier head fused)."""

    def __init__(self, start, conv, relu, pool, flatten, head):
        super().__init__(start, [conv, relu, pool, flatten, head])
        self.conv, self.pool, self.head = conv, pool, head

    def forward(self, x):
        conv, head = self.conv, self.head
        self._check_input(x)
        b = conv.bias.data if conv.bias is not None else None
        bl = head.bias.data if head.bias is not None else None
        precision = current_precision()
        y, argmax, logits = F.conv2d_relu_maxpool2d_linear(
            x, conv.weight.data, b, head.weight.data, bl, conv._fargs["stride"], conv._fargs["padding"],
            self.pool._fargs["kernel_size"], self.pool._fargs["stride"], precision=precision, backend=self.backend)
        self._cache = (x, y, argmax, precision)
        return logits

    def backward(self, dy, need_dx: bool = True):
        conv, head = self.conv, self.head
        x, y, argmax, precision = self._cached()
        dy = self._dy(dy, (shape_of(y)[0], head.out_features))
        dx, dw, db, dwl, dbl = F.conv2d_relu_maxpool2d_linear_backward(
            x, conv.weight.data, y, argmax, head.weight.data, dy, conv._fargs["stride"], conv._fargs["padding"],
            need_dx=need_dx, need_db=conv.bias is not None, need_head_db=head.bias is not None,
            precision=precision, pool_kernel=self.pool._fargs["kernel_size"], pool_stride=self.pool._fargs["stride"],
            backend=self.backend)
        head.weight.grad = dwl
        if head.bias is not None:
            head.bias.grad = dbl
        conv.weight.grad = dw
        if conv.bias is not None:
            conv.bias.grad = db
        return dx


class _LayerReLU(_Fused):
    """A layer whose ``forward(x, relu=True)`` applies the ReLU that follows it; its own backward
    then covers both."""

    def __init__(self, start, layer, relu):
        super().__init__(start, [layer, relu])
        self.layer = layer

    def forward(self, x):
        return self.layer.forward(x, relu=True)

    def backward(self, dy, need_dx: bool = True):
        return self.layer.backward(dy, need_dx=need_dx)

    def release(self) -> None:
        self.layer._cache = None


class BatchNormReLU(_LayerReLU):
    """``BatchNorm -> ReLU`` as one normalisation pass (training and eval mode)."""


class ConvBatchNormEval(_Fused):
    """``Conv2d -> BatchNorm2d -> ReLU`` in eval mode (or without the ReLU): the running statistics
    folded into the convolution as a per-filter scale and shift, applied with the ReLU as it stores.

    The forward keeps only its input: a backward pass (rare in eval mode, e.g.
    input gradients) reruns the layers one by one and back-propagates through them.
    """

    def __init__(self, start, conv, bn, relu=None):
        super().__init__(start, [conv, bn] if relu is None else [conv, bn, relu])
        self.conv, self.bn, self.relu = conv, bn, relu is not None
        self._fold = None  # (key, folded filters or scale, shift): see folded()
        self._args = None  # (input shape, its (stride, pads, dilation, groups))

    def _fold_key(self) -> tuple:
        conv, bn = self.conv, self.bn
        return (weights_epoch(), bn.eps, conv.weight.data, None if conv.bias is None else conv.bias.data,
                None if bn.weight is None else bn.weight.data, None if bn.bias is None else bn.bias.data,
                bn.running_mean, bn.running_var)

    def folded(self):
        """The batch norm folded into the convolution, built once and rebuilt when parconv changed a
        weight or statistic since (the count of :func:`parconv.weights_changed`, and the arrays
        themselves, must be the ones it was built from): ``(weight * scale, shift)`` for a general
        convolution (the scale in its filters), ``(scale, shift)`` for a square one-group one (applied
        by the convolution's store, ``Backend.conv2d_scale_shift_forward``)."""
        key, fold = self._fold_key(), self._fold
        if fold is not None and fold[0][:2] == key[:2] and all(a is b for a, b in zip(fold[0][2:], key[2:])):
            return fold[1], fold[2]
        conv, bn, be = self.conv, self.bn, self.backend
        host = lambda a: None if a is None else np.asarray(be.to_numpy(a), dtype=np.float64)  # noqa: E731
        w, rm, rv = host(conv.weight.data), host(bn.running_mean), host(bn.running_var)
        scale = 1.0 / np.sqrt(rv + float(bn.eps))
        if bn.weight is not None:
            scale = scale * host(bn.weight.data)
        shift = ((0.0 if conv.bias is None else host(conv.bias.data)) - rm) * scale
        if bn.bias is not None:
            shift = shift + host(bn.bias.data)
        o = conv.out_channels
        if np.shape(scale) != (o,) or np.shape(shift) != (o,):  # the kernels read o of each
            raise ValueError(f"{bn!r}: running_mean, running_var, weight and bias must have {o} entries "
                             f"(the convolution's out_channels) to fold into it")
        if conv.simple:
            wf = be.asarray(scale.astype(np.float32))
        else:
            wf = be.asarray(np.ascontiguousarray((w * scale[:, None, None, None]).astype(np.float32)))
        bf = be.asarray(shift.astype(np.float32))
        self._fold = (key, wf, bf)
        return wf, bf

    def _general_args(self, x) -> tuple:
        shape = shape_of(x)
        if self._args is None or self._args[0] != shape:
            f = self.conv._fargs
            args = F._conv_args(shape, self.conv.weight.shape, f.get("stride", 1), f.get("padding", 0),
                                f.get("dilation", 1), f.get("groups", 1), "Conv2d")[1:]
            self._args = (shape, args)
        return self._args[1]

    def forward(self, x):
        conv, bn = self.conv, self.bn
        self._check_input(x)
        precision = current_precision()
        if not conv.simple:
            be = self.backend
            if precision == "bf16":
                # bf16 rounds the layer's own filters: the bf16 convolution, then the float32 batch norm
                z = F.conv2d(x, conv.weight.data, conv.bias.data if conv.bias is not None else None, **conv._fargs,
                             precision="bf16", backend=be)
                y = be.batch_norm_forward_eval(z, bn.weight.data if bn.weight is not None else None,
                                               bn.bias.data if bn.bias is not None else None, bn.running_mean,
                                               bn.running_var, bn.eps, self.relu)[0]
            else:
                wf, bf = self.folded()
                args = self._general_args(x)
                y = (be.conv2d_general_relu_forward if self.relu else be.conv2d_general_forward)(x, wf, bf, *args)
            self._cache = (x, precision)
            return y
        args = (x, conv.weight.data, conv.bias.data if conv.bias is not None else None,
                bn.weight.data if bn.weight is not None else None, bn.bias.data if bn.bias is not None else None,
                bn.running_mean, bn.running_var)
        if precision == "bf16":
            # no backend folds batch norm into a bf16 convolution: the bf16 conv, then the float32 batch norm
            y = F.conv2d_batch_norm_eval(*args, conv._fargs["stride"], conv._fargs["padding"], eps=bn.eps,
                                         relu=self.relu, precision="bf16", backend=self.backend)
        else:
            # the layers' own arrays, shapes fixed by their constructors: straight to the backend
            scale, shift = self.folded()
            y = self.backend.conv2d_scale_shift_forward(x, conv.weight.data, scale, shift, conv._fargs["stride"],
                                                        conv._fargs["padding"], self.relu)
        self._cache = (x, precision)
        return y

    def backward(self, dy, need_dx: bool = True):
        h, precision = self._cached()
        # the layers' forward must keep what their backward reads, even inside no_grad, and run in the
        # precision of the fused forward, wherever this backward is called
        with enable_grad(), autocast(enabled=precision == "bf16"):
            for layer in self.layers:
                h = layer.forward(h)
        dy = self._dy(dy, shape_of(h))
        for k in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[k].backward(dy, need_dx=need_dx or k > 0)
        for layer in self.layers:
            layer._cache = None
        return dy


class LinearReLU(_Fused):
    """``Linear -> ReLU`` as one op (training and eval mode): ``backend.linear_relu_forward`` and
    ``linear_relu_backward``. Under bf16 autocast the layers run one by one."""

    def __init__(self, start, linear, relu):
        super().__init__(start, [linear, relu])
        self.linear, self.relu = linear, relu

    def forward(self, x):
        lin = self.linear
        precision = current_precision()
        if precision == "bf16":
            self._cache = (None, None, precision)
            return self.relu.forward(lin.forward(x))
        x = to_backend_array(x, self.backend, "x", "Sequential")
        self._check_input(x)
        b = lin.bias.data if lin.bias is not None else None
        y = self.backend.linear_relu_forward(x, lin.weight.data, b)
        self._cache = (x, y, precision)
        return y

    def backward(self, dy, need_dx: bool = True):
        lin = self.linear
        x, y, precision = self._cached()
        if precision == "bf16":
            return lin.backward(self.relu.backward(dy), need_dx=need_dx)
        dy = self._dy(dy, shape_of(y))
        dx, dw, db = self.backend.linear_relu_backward(x, lin.weight.data, y, dy, bool(need_dx),
                                                       lin.bias is not None)
        lin.weight.grad = dw
        if lin.bias is not None:
            lin.bias.grad = db
        return dx

    def release(self) -> None:
        self._cache = None
        self.linear._cache = None
        self.relu._cache = None


class ResidualReLU(_LayerReLU):
    """``Residual -> ReLU``: the block's output ``relu(body(x) + shortcut(x))`` in one op.

    Where the body's last step is a BatchNorm on its own (a ResNet basic block in
    training mode), that BatchNorm adds the shortcut and applies the ReLU as it
    writes, and the backward masks the gradient once for both branches.
    """


def _conv_bn_eval(layers, i) -> bool:
    if i + 2 > len(layers):
        return False
    conv, bn = layers[i:i + 2]
    return (type(conv) is Conv2d and type(bn) in (BatchNorm2d, SyncBatchNorm) and not bn._uses_batch_stats()
            and bn.num_features == conv.out_channels)


def _conv_pool(layers, i) -> bool:
    if i + 3 > len(layers):
        return False
    conv, relu, pool = layers[i:i + 3]
    return (type(conv) is Conv2d and type(relu) is ReLU and type(pool) is MaxPool2d and conv.simple
            and pool.simple)


def plan(layers: list, backend, fuse: bool) -> list:
    """The steps of one forward pass over ``layers`` (a Sequential's direct children)."""
    steps, i, n = [], 0, len(layers)
    while i < n:
        layer = layers[i]
        if fuse and _conv_pool(layers, i):
            head = layers[i + 4] if i + 5 <= n and type(layers[i + 3]) is Flatten and type(layers[i + 4]) is Linear \
                else None
            if head is not None and F.fuses_linear_head(head.in_features, head.out_features, backend=backend):
                steps.append(PlanStep(ConvReluMaxPoolHead(i, *layers[i:i + 5]), i, i + 5, (i + 4, i)))
                i += 5
                continue
            steps.append(PlanStep(ConvReluMaxPool(i, *layers[i:i + 3]), i, i + 3, (i,)))
            i += 3
            continue
        if fuse and _conv_bn_eval(layers, i):
            stop = i + 3 if i + 3 <= n and type(layers[i + 2]) is ReLU else i + 2
            steps.append(PlanStep(ConvBatchNormEval(i, *layers[i:stop]), i, stop, (i + 1, i)))
            i = stop
            continue
        if fuse and (getattr(layer, "_int8_chains", False) or type(layer) is Residual
                     or isinstance(getattr(layer, "layers", None), list)):
            from .quantization import chain_plan  # imported here: quantization builds on this module

            chain = chain_plan(layers, i)
            if chain is not None:
                steps.append(PlanStep(chain[0], i, chain[1], tuple(range(i, chain[1]))))
                i = chain[1]
                continue
        nxt = layers[i + 1] if i + 1 < n else None
        if fuse and type(layer) is Residual and type(nxt) is ReLU:
            steps.append(PlanStep(ResidualReLU(i, layer, nxt), i, i + 2, (i,)))
            i += 2
            continue
        if fuse and type(layer) is Linear and type(nxt) is ReLU:
            steps.append(PlanStep(LinearReLU(i, layer, nxt), i, i + 2, (i,)))
            i += 2
            continue
        if fuse and type(layer) in (BatchNorm1d, BatchNorm2d, SyncBatchNorm) and type(nxt) is ReLU:
            steps.append(PlanStep(BatchNormReLU(i, layer, nxt), i, i + 2, (i,)))
            i += 2
            continue
        steps.append(PlanStep(layer, i, i + 1, (i,)))
        i += 1
    return steps


def count_fused(steps: list) -> int:
    """How many steps of a plan are fused ops (for ``summary`` and tests)."""
    return sum(1 for s in steps if isinstance(s.step, _Fused))
