"""Layers: they hold parameters and cached activations; the maths is in :mod:`parconv.functional`.

Weight layouts match PyTorch's: ``Conv2d.weight`` is (O, C, K, K),
``Linear.weight`` is (out, in). Initialisation follows PyTorch's defaults
(uniform in ``±1/sqrt(fan_in)``), drawn from :func:`parconv.manual_seed`'s
generator unless a layer is given its own ``rng``.
"""

from __future__ import annotations

import math

import numpy as np

from . import backends as _backends
from . import functional as F
from ._validation import Where, check_int, shape_of, to_backend_array

__all__ = ["Parameter", "Layer", "Conv2d", "MaxPool2d", "Linear", "ReLU", "Sigmoid", "Flatten"]

_global_rng = np.random.default_rng()


def manual_seed(seed: int) -> None:
    """Seed the generator that initialises new layers' weights (and ``fit``'s shuffling default)."""
    global _global_rng
    check_int(seed, "seed", "manual_seed", 0)
    _global_rng = np.random.default_rng(seed)


def _rng(rng) -> np.random.Generator:
    if rng is None:
        return _global_rng
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(check_int(rng, "rng", "layer", 0))


class Parameter:
    """A trainable tensor: ``data`` and ``grad`` are arrays of ``backend``.

    ``grad`` is None until the first backward; each backward overwrites it.
    """

    __slots__ = ("data", "grad", "backend")

    def __init__(self, data, backend):
        self.backend = _backends.get(backend)
        self.data = self.backend.asarray(np.array(data, dtype=np.float32, copy=True))  # never alias caller data
        self.grad = None

    @property
    def shape(self) -> tuple:
        return shape_of(self.data)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def numpy(self) -> np.ndarray:
        """A host copy of the data."""
        return np.array(self.backend.to_numpy(self.data), dtype=np.float32)

    def to(self, backend) -> "Parameter":
        """Move data (and grad) to another backend in place; returns self."""
        backend = _backends.get(backend)
        if backend is not self.backend:
            self.data = backend.asarray(self.backend.to_numpy(self.data))
            if self.grad is not None:
                self.grad = backend.asarray(self.backend.to_numpy(self.grad))
            self.backend = backend
        return self

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, backend={self.backend.name!r})"


class Layer:
    """Base layer: ``forward``/``__call__``, ``backward(dy) -> dx``, ``parameters()``, ``to(backend)``."""

    #: names of the parameters, in state-dict order
    param_names: tuple = ()

    def __init__(self, backend=None):
        self.backend = _backends.get(backend)
        self._cache = None

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, dy):  # pragma: no cover - abstract
        raise NotImplementedError

    def parameters(self) -> list:
        return [getattr(self, n) for n in self.param_names if getattr(self, n) is not None]

    def named_parameters(self) -> list:
        return [(n, getattr(self, n)) for n in self.param_names if getattr(self, n) is not None]

    def to(self, backend) -> "Layer":
        """Move the parameters to ``backend`` (name or object) in place; returns self."""
        self.backend = _backends.get(backend)
        for p in self.parameters():
            p.to(self.backend)
        self._cache = None
        return self

    def config(self) -> dict:
        """Constructor arguments, enough to rebuild the layer (used by ``save``/``load``)."""
        return {}

    def _input(self, x):
        return to_backend_array(x, self.backend, "x", Where(self))

    def _cached(self):
        if self._cache is None:
            raise ValueError(f"{self!r}: backward called before forward (call the layer on a batch first)")
        return self._cache

    def _check_dy(self, dy, expected: tuple):
        dy = to_backend_array(dy, self.backend, "dy", Where(self, ".backward"))
        if shape_of(dy) != tuple(expected):
            raise ValueError(f"{self!r}.backward: dy must have the output's shape {tuple(expected)}, got {shape_of(dy)}")
        return dy

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class Conv2d(Layer):
    """2-D convolution (cross-correlation) over (N, C, H, W) input.

    Parameters
    ----------
    in_channels, out_channels, kernel_size : int
    stride : int, default 1
    padding : int, default 0
    bias : bool, default True
    backend : str or Backend, optional
    rng : numpy Generator or int seed, optional

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> conv = pc.Conv2d(1, 4, kernel_size=3, padding=1, backend="numpy")
    >>> conv(np.zeros((2, 1, 8, 8))).shape
    (2, 4, 8, 8)
    """

    param_names = ("weight", "bias")

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, backend=None, rng=None):
        super().__init__(backend)
        where = "Conv2d"
        self.in_channels = check_int(in_channels, "in_channels", where, 1)
        self.out_channels = check_int(out_channels, "out_channels", where, 1)
        self.kernel_size = check_int(kernel_size, "kernel_size", where, 1)
        self.stride = check_int(stride, "stride", where, 1)
        self.padding = check_int(padding, "padding", where, 0)
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"Conv2d: bias must be a bool, got {type(bias).__name__}")
        g = _rng(rng)
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size**2)
        shape = (self.out_channels, self.in_channels, self.kernel_size, self.kernel_size)
        self.weight = Parameter(g.uniform(-bound, bound, shape), self.backend)
        self.bias = Parameter(g.uniform(-bound, bound, (self.out_channels,)), self.backend) if bias else None

    def config(self):
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, kernel_size=self.kernel_size,
                    stride=self.stride, padding=self.padding, bias=self.bias is not None)

    def output_shape(self, x_shape) -> tuple:
        return F.conv2d_output_shape(x_shape, self.weight.shape, self.stride, self.padding, Where(self))

    def forward(self, x):
        x = self._input(x)
        self.output_shape(shape_of(x))
        b = self.bias.data if self.bias is not None else None
        y = self.backend.conv2d_forward(x, self.weight.data, b, self.stride, self.padding)
        self._cache = x
        return y

    def backward(self, dy, need_dx: bool = True):
        """Fills ``weight.grad`` and ``bias.grad`` (overwritten) and returns dx (None unless ``need_dx``)."""
        x = self._cached()
        dy = self._check_dy(dy, self.output_shape(shape_of(x)))
        dx, dw, db = self.backend.conv2d_backward(x, self.weight.data, dy, self.stride, self.padding,
                                                  need_dx, self.bias is not None)
        self.weight.grad = dw
        if self.bias is not None:
            self.bias.grad = db
        return dx


class MaxPool2d(Layer):
    """Max pooling over ``kernel_size`` windows (stride defaults to the kernel size); argmax cached."""

    def __init__(self, kernel_size: int, stride: int | None = None, backend=None):
        super().__init__(backend)
        self.kernel_size = check_int(kernel_size, "kernel_size", "MaxPool2d", 1)
        self.stride = self.kernel_size if stride is None else check_int(stride, "stride", "MaxPool2d", 1)

    def config(self):
        return dict(kernel_size=self.kernel_size, stride=self.stride)

    def output_shape(self, x_shape) -> tuple:
        return F.maxpool2d_output_shape(x_shape, self.kernel_size, self.stride, Where(self))

    def forward(self, x):
        x = self._input(x)
        self.output_shape(shape_of(x))
        y, argmax = self.backend.maxpool2d_forward(x, self.kernel_size, self.stride)
        self._cache = (shape_of(x), argmax)
        return y

    def backward(self, dy, need_dx: bool = True):
        x_shape, argmax = self._cached()
        dy = self._check_dy(dy, shape_of(argmax))
        return self.backend.maxpool2d_backward(dy, argmax, x_shape)


class Linear(Layer):
    """Fully connected layer ``y = x @ weight.T + bias``; weight (out_features, in_features)."""

    param_names = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend=None, rng=None):
        super().__init__(backend)
        self.in_features = check_int(in_features, "in_features", "Linear", 1)
        self.out_features = check_int(out_features, "out_features", "Linear", 1)
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"Linear: bias must be a bool, got {type(bias).__name__}")
        g = _rng(rng)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = Parameter(g.uniform(-bound, bound, (self.out_features, self.in_features)), self.backend)
        self.bias = Parameter(g.uniform(-bound, bound, (self.out_features,)), self.backend) if bias else None

    def config(self):
        return dict(in_features=self.in_features, out_features=self.out_features, bias=self.bias is not None)

    def _check_x(self, x_shape):
        if len(x_shape) != 2:
            raise ValueError(f"{self!r}: x must be 2-D (N, in_features), got shape {x_shape}"
                             + (" (add a Flatten layer before it)" if len(x_shape) > 2 else ""))
        if x_shape[0] == 0:
            raise ValueError(f"{self!r}: x must not have a zero-sized batch, got shape {x_shape}")
        if x_shape[1] != self.in_features:
            raise ValueError(f"{self!r}: x has {x_shape[1]} features, expected in_features={self.in_features}")

    def forward(self, x):
        x = self._input(x)
        self._check_x(shape_of(x))
        b = self.bias.data if self.bias is not None else None
        y = self.backend.linear_forward(x, self.weight.data, b)
        self._cache = x
        return y

    def backward(self, dy, need_dx: bool = True):
        """Fills ``weight.grad``/``bias.grad`` (overwritten); returns dx (None unless ``need_dx``)."""
        x = self._cached()
        dy = self._check_dy(dy, (x.shape[0], self.out_features))
        dx, dw, db = self.backend.linear_backward(x, self.weight.data, dy, need_dx, self.bias is not None)
        self.weight.grad = dw
        if self.bias is not None:
            self.bias.grad = db
        return dx


class _Activation(Layer):
    _fwd = _bwd = ""

    def forward(self, x):
        x = self._input(x)
        if any(s == 0 for s in shape_of(x)):
            raise ValueError(f"{self!r}: x must not have a zero-sized dimension, got shape {shape_of(x)}")
        y = getattr(self.backend, self._fwd)(x)
        self._cache = y
        return y

    def backward(self, dy, need_dx: bool = True):
        y = self._cached()
        dy = self._check_dy(dy, shape_of(y))
        return getattr(self.backend, self._bwd)(y, dy)


class ReLU(_Activation):
    """``max(x, 0)`` elementwise."""

    _fwd, _bwd = "relu_forward", "relu_backward"


class Sigmoid(_Activation):
    """Logistic sigmoid elementwise (overflow-free)."""

    _fwd, _bwd = "sigmoid_forward", "sigmoid_backward"


class Flatten(Layer):
    """Flattens every dimension after the batch: (N, ...) -> (N, prod(...)). No copy."""

    def forward(self, x):
        x = self._input(x)
        shape = shape_of(x)
        if len(shape) < 2:
            raise ValueError(f"{self!r}: x must have a batch dimension and at least one more, got shape {shape}")
        self._cache = shape
        return self.backend.reshape(x, (shape[0], math.prod(shape[1:])))

    def backward(self, dy, need_dx: bool = True):
        shape = self._cached()
        dy = self._check_dy(dy, (shape[0], math.prod(shape[1:])))
        return self.backend.reshape(dy, shape)


LAYER_TYPES = {cls.__name__: cls for cls in (Conv2d, MaxPool2d, Linear, ReLU, Sigmoid, Flatten)}
