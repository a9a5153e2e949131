"""Layers: they hold parameters, buffers and cached activations; the maths is in :mod:`parconv.functional`.

Weight layouts, argument names, defaults and state-dict keys match PyTorch's:
``Conv2d.weight`` is (O, C/groups, kH, kW), ``Linear.weight`` is (out, in),
``BatchNorm2d`` keeps ``running_mean``, ``running_var`` and
``num_batches_tracked`` as buffers. Initialisation follows PyTorch's defaults
(uniform in ``±1/sqrt(fan_in)``), drawn from :func:`parconv.manual_seed`'s
generator unless a layer is given its own ``rng``.

Every layer has ``forward``/``__call__``, ``backward(dy, need_dx=...)``,
``parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()``,
``state_dict()``/``load_state_dict()``, ``to(backend)``, ``train()``/``eval()``
and ``training``. Containers (:class:`Residual`, :class:`parconv.Sequential`)
nest: their children's keys are prefixed with the child's name (``"2.0.weight"``,
``"3.body.1.running_mean"``).
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from . import backends as _backends
from . import functional as F
from ._grad import NOT_SAVED, SavedForBackward, no_grad_error
from .amp import current_precision
from ._shapes import check_geometry
from ._weights import weights_changed
from ._validation import Where, check_float, check_int, shape_of, state_array, to_backend_array

__all__ = [
    "Parameter", "Layer", "Conv2d", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "Linear", "BatchNorm1d",
    "BatchNorm2d", "Dropout", "ReLU", "LeakyReLU", "ELU", "Sigmoid", "Tanh", "Softmax", "Flatten", "Identity",
    "Residual", "manual_seed",
    "Normalize",
]

_global_rng = np.random.default_rng()
_F32 = np.dtype(np.float32)

#: every Layer subclass by class name (filled by ``Layer.__init_subclass__``); ``pc.load`` rebuilds from it
LAYER_TYPES: dict[str, type] = {}


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


def _check_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _pair(value, name: str, where: str, minimum: int) -> tuple:
    """An int or a pair of ints -> ``(h, w)``, each ``>= minimum``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{where}: {name} must be an int or a pair (h, w), got {tuple(value)!r}")
        items = (check_int(value[0], f"{name}[0]", where, minimum), check_int(value[1], f"{name}[1]", where, minimum))
    else:
        v = check_int(value, name, where, minimum)
        items = (v, v)
    check_geometry(items, value, name, where)
    return items


def _scalar_or_pair(pair: tuple):
    """The int functional takes for a square value, else the pair (keeps the square fast paths)."""
    return pair[0] if pair[0] == pair[1] else pair


class Parameter:
    """A trainable tensor: ``data`` and ``grad`` are arrays of ``backend``.

    ``grad`` is None until the first backward; each backward overwrites it.
    """

    __slots__ = ("_data", "grad", "backend")

    def __init__(self, data, backend):
        self.backend = _backends.get(backend)
        self.data = self.backend.asarray(np.array(data, dtype=np.float32, copy=True))  # never alias caller data
        self.grad = None

    @property
    def data(self):
        """The values (an array of ``backend``). Assigning a new array tells the caches derived from
        the weights (eval-mode BatchNorm folds) to rebuild; after writing into the array in place,
        call :func:`parconv.weights_changed`."""
        return self._data

    @data.setter
    def data(self, value) -> None:
        # fused steps read the layer's geometry from its parameters' arrays: a new array must keep the shape
        if hasattr(self, "_data") and shape_of(value) != shape_of(self._data):
            raise ValueError(f"Parameter.data: expected an array of shape {shape_of(self._data)}, got "
                             f"{shape_of(value)}; assign an array of the same shape (or build a new layer)")
        self._data = value
        weights_changed()

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


class IncompatibleKeys(namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])):
    """What :meth:`Layer.load_state_dict` returns: the keys the model has but the state lacked, and the
    keys the state has but the model lacks (PyTorch's ``_IncompatibleKeys``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return super().__repr__()


def _zero_grads(params, set_to_none: bool, where: str) -> None:
    """Drop the gradients of ``params`` (``set_to_none``) or fill them with zeros in place."""
    set_to_none = _check_bool(set_to_none, "set_to_none", where)
    for p in params:
        if set_to_none or p.grad is None:
            p.grad = None
        else:
            p.backend.copy_into(p.grad, p.backend.zeros(p.shape))


class Layer:
    """Base layer.

    Subclasses list their parameters in :attr:`param_names` and their buffers
    (state that is saved but not trained, e.g. BatchNorm's running statistics)
    in :attr:`buffer_names`; containers return their sub-layers from
    :meth:`children`. Float buffers are backend arrays; integer counters are
    host ``int64`` arrays.
    """

    #: names of the parameters, in state-dict order
    param_names: tuple = ()
    #: names of the buffers, in state-dict order (after the parameters, as PyTorch)
    buffer_names: tuple = ()
    #: what the last forward pass kept for backward (nothing under :class:`parconv.no_grad`)
    _cache = SavedForBackward()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):
            LAYER_TYPES[cls.__name__] = cls

    def __init__(self, backend=None):
        self.backend = _backends.get(backend)
        self._cache = None
        self.training = True

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, dy, need_dx: bool = True):  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------- structure
    def children(self) -> list:
        """``[(name, layer), ...]`` of the direct sub-layers (containers only)."""
        return []

    def modules(self) -> list:
        """This layer and every layer below it, depth first."""
        out = [self]
        for _, child in self.children():
            out.extend(child.modules())
        return out

    def named_parameters(self, prefix: str = "") -> list:
        """``[(name, Parameter), ...]`` with PyTorch's names."""
        out = [(prefix + n, p) for n in self.param_names if (p := getattr(self, n)) is not None]
        for name, child in self.children():
            out.extend(child.named_parameters(f"{prefix}{name}."))
        return out

    def parameters(self) -> list:
        if not self.param_names and not self.children():
            return []
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> list:
        """``[(name, array), ...]`` of the buffers (backend arrays; counters as host int64)."""
        out = [(prefix + n, b) for n in self.buffer_names if (b := getattr(self, n)) is not None]
        for name, child in self.children():
            out.extend(child.named_buffers(f"{prefix}{name}."))
        return out

    def buffers(self) -> list:
        return [b for _, b in self.named_buffers()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ------------------------------------------------------------- modes
    def train(self, mode: bool = True) -> "Layer":
        """Set training mode (``mode=False``: eval mode) here and in every sub-layer; returns self."""
        mode = _check_bool(mode, "mode", f"{type(self).__name__}.train")
        for layer in self.modules():
            layer.training = mode
        weights_changed()  # entering eval mode folds the BatchNorm statistics afresh
        return self

    def eval(self) -> "Layer":
        """Eval mode: BatchNorm uses its running statistics, Dropout is the identity. Returns self."""
        return self.train(False)

    def to(self, backend) -> "Layer":
        """Move the parameters and buffers to ``backend`` (name or object) in place; returns self.

        ``"cpu"`` is the default CPU backend (``openmp``, else ``numpy``), as :meth:`cpu`.
        """
        backend = _backends.get(backend)
        for layer in self.modules():
            old = layer.backend
            layer.backend = backend
            for p in layer.param_names:
                if getattr(layer, p) is not None:
                    getattr(layer, p).to(backend)
            for n in layer.buffer_names:
                b = getattr(layer, n)
                if b is None or (isinstance(b, np.ndarray) and b.dtype != np.float32):
                    continue  # host counters stay on the host
                setattr(layer, n, backend.asarray(np.array(old.to_numpy(b), dtype=np.float32)))
            layer._cache = None
            layer._moved()
        return self

    def cpu(self) -> "Layer":
        """Move to the default CPU backend (``openmp``, else ``numpy``) in place; returns self. Same as ``to("cpu")``."""
        return self.to("cpu")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter here and below.

        ``set_to_none=True`` (the default, as PyTorch's) drops them: ``p.grad`` becomes None, as
        :meth:`parconv.optim.Optimizer.zero_grad` does. ``set_to_none=False`` fills them with
        zeros in place (parameters without a gradient keep None). A backward pass overwrites
        the gradients either way; this is for code that reads or accumulates them.
        """
        _zero_grads(self.parameters(), set_to_none, f"{type(self).__name__}.zero_grad")

    def _moved(self) -> None:
        """Hook: drop whatever a layer keeps that is tied to its old backend."""

    # ------------------------------------------------------------- state
    def _state_entries(self, prefix: str = "") -> list:
        """``[(key, owner, attribute, kind), ...]`` with kind "param" or "buffer", in state-dict order."""
        out = [(prefix + n, self, n, "param") for n in self.param_names if getattr(self, n) is not None]
        out += [(prefix + n, self, n, "buffer") for n in self.buffer_names if getattr(self, n) is not None]
        for name, child in self.children():
            out.extend(child._state_entries(f"{prefix}{name}."))
        return out

    def _state_value(self, attr: str) -> np.ndarray:
        """Host copy of one entry of this layer's own state."""
        value = getattr(self, attr)
        if isinstance(value, Parameter):
            return value.numpy()
        if isinstance(value, np.ndarray):
            return value.copy()
        return np.array(self.backend.to_numpy(value), copy=True)

    def _state_shape(self, attr: str) -> tuple:
        """The shape ``load_state_dict`` expects for ``attr`` (a layer that splits a weight takes the full one)."""
        value = getattr(self, attr)
        return value.shape if isinstance(value, Parameter) else shape_of(value)

    def _set_state(self, attr: str, value: np.ndarray) -> None:
        """Write a checked host array into ``attr``."""
        old = getattr(self, attr)
        if isinstance(old, Parameter):
            old.data = old.backend.asarray(np.array(value, dtype=np.float32, order="C", copy=True))
            old.grad = None
        elif isinstance(old, np.ndarray) and old.dtype != np.float32:
            setattr(self, attr, np.array(value, dtype=old.dtype, copy=True))
        else:
            setattr(self, attr, self.backend.asarray(np.array(value, dtype=np.float32, order="C", copy=True)))

    def state_dict(self) -> dict:
        """Host copies of every parameter and buffer, keyed like PyTorch (``"0.weight"``, ``"1.running_mean"``)."""
        return {key: owner._state_value(attr) for key, owner, attr, _ in self._state_entries()}

    def load_state_dict(self, state: dict, strict: bool = True) -> "IncompatibleKeys":
        """Copy arrays from ``state`` (e.g. a PyTorch ``state_dict`` as NumPy) into parameters and buffers.

        Every key is checked before anything is written, so a failed load
        leaves the model unchanged. As PyTorch's: with ``strict=True`` (the
        default) a key of the model that ``state`` lacks, or a key of ``state`` the
        model lacks, raises ``ValueError``; with
        ``strict=False`` the keys present in both are loaded and the others
        reported. A shape that differs from the model's raises either way.

        Returns
        -------
        IncompatibleKeys
            The named tuple ``(missing_keys, unexpected_keys)`` (both empty
            after a strict load).

        Examples
        --------
        >>> import numpy as np, parconv as pc
        >>> model = pc.Sequential(pc.Linear(2, 2), backend="numpy")
        >>> model.load_state_dict({"0.weight": np.eye(2), "head.weight": np.ones(2)}, strict=False)
        IncompatibleKeys(missing_keys=['0.bias'], unexpected_keys=['head.weight'])
        """
        where = "load_state_dict"
        if not hasattr(state, "keys"):
            raise TypeError(f"{where}: state must be a mapping of name -> array, got {type(state).__name__}")
        strict = _check_bool(strict, "strict", where)
        entries = self._state_entries()
        names = [e[0] for e in entries]
        known = set(names)
        missing = [k for k in names if k not in state]
        unexpected = [k for k in state if k not in known]
        if strict and (missing or unexpected):
            problems = ([f"missing keys {missing}"] if missing else []) + \
                       ([f"unexpected keys {unexpected}"] if unexpected else [])
            raise ValueError(f"{where}: {' and '.join(problems)} (model expects {names}; "
                             "strict=False loads the keys that match)")
        staged = []
        for key, owner, attr, _ in entries:
            if key not in state:
                continue
            value = state_array(state[key], key, owner._state_shape(attr), where)
            owner._check_state(attr, value, key, where)
            staged.append((owner, attr, np.array(value, copy=True)))  # never alias caller data
        for owner, attr, value in staged:
            owner._set_state(attr, value)
        weights_changed()
        return IncompatibleKeys(missing, unexpected)

    def _check_state(self, attr: str, value: np.ndarray, key: str, where: str) -> None:
        """Refuse a state entry whose values (not only its shape) the layer cannot use; a no-op by default."""

    # ------------------------------------------------------------- config
    def config(self) -> dict:
        """Constructor arguments, enough to rebuild the layer (used by ``save``/``load``)."""
        return {}

    def spec(self) -> dict:
        """``{"type": class name, "config": ...}``: what :func:`layer_from_spec` rebuilds."""
        return {"type": type(self).__name__, "config": self.config()}

    @classmethod
    def from_config(cls, config: dict, backend=None) -> "Layer":
        return cls(**config, backend=backend)

    # ------------------------------------------------------------- shapes for summary()
    def output_shape(self, x_shape) -> tuple:
        """Output shape for an input of ``x_shape`` (validating it); elementwise layers keep it."""
        return tuple(x_shape)

    def macs(self, x_shape) -> int:
        """Multiply-adds of one forward pass over an input of ``x_shape``."""
        return 0

    # ------------------------------------------------------------- helpers
    def _input(self, x):
        return to_backend_array(x, self.backend, "x", Where(self))

    def _cached(self):
        cache = self._cache
        if cache is None:
            raise ValueError(f"{self!r}: backward called before forward (call the layer on a batch first)")
        if cache is NOT_SAVED:
            raise no_grad_error(repr(self))
        return cache

    def _check_dy(self, dy, expected: tuple):
        dy = to_backend_array(dy, self.backend, "dy", Where(self, ".backward"))
        if shape_of(dy) != tuple(expected):
            raise ValueError(f"{self!r}.backward: dy must have the output's shape {tuple(expected)}, got {shape_of(dy)}")
        return dy

    def _extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config().items())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._extra_repr()})"


def layer_from_spec(spec, backend=None) -> Layer:
    """Rebuild a layer (or container) from :meth:`Layer.spec` output."""
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str) or not isinstance(spec.get("config"), dict):
        raise ValueError(f"invalid layer spec {spec!r:.200}: expected {{'type': name, 'config': {{...}}}}")
    cls = LAYER_TYPES.get(spec["type"])
    if cls is None:
        raise ValueError(f"unknown layer type {spec['type']!r} (known: {sorted(LAYER_TYPES)})")
    try:
        return cls.from_config(spec["config"], backend=backend)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"invalid config for {spec['type']}: {type(exc).__name__}: {exc}") from None


# ============================================================ convolution
class Conv2d(Layer):
    """2-D convolution (cross-correlation) over (N, C, H, W) input.

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size : int or (kh, kw)
    stride : int or (sh, sw), default 1
    padding : int, (ph, pw), "same" or "valid", default 0
        "same" needs stride 1; an odd total is padded one more at the bottom/right, as PyTorch.
    dilation : int or (dh, dw), default 1
    groups : int, default 1
        ``in_channels`` and ``out_channels`` must be multiples; ``groups=in_channels`` is depthwise.
        Kernel size, stride, padding and dilation are each at most 65536 (``ValueError`` beyond).
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

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, backend=None, rng=None):
        super().__init__(backend)
        where = "Conv2d"
        self.in_channels = check_int(in_channels, "in_channels", where, 1)
        self.out_channels = check_int(out_channels, "out_channels", where, 1)
        self.kernel_size = _pair(kernel_size, "kernel_size", where, 1)
        self.stride = _pair(stride, "stride", where, 1)
        self.dilation = _pair(dilation, "dilation", where, 1)
        self.groups = check_int(groups, "groups", where, 1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"{where}: padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
            if padding == "same" and self.stride != (1, 1):
                raise ValueError(f"{where}: padding='same' needs stride 1, got stride={self.stride}")
            self.padding = padding
        else:
            self.padding = _pair(padding, "padding", where, 0)
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"{where}: in_channels ({self.in_channels}) and out_channels ({self.out_channels}) "
                             f"must both be divisible by groups ({self.groups})")
        _check_bool(bias, "bias", where)
        g = _rng(rng)
        kh, kw = self.kernel_size
        fan_in = self.in_channels // self.groups * kh * kw
        bound = 1.0 / math.sqrt(fan_in)
        shape = (self.out_channels, self.in_channels // self.groups, kh, kw)
        self.weight = Parameter(g.uniform(-bound, bound, shape), self.backend)
        self.bias = Parameter(g.uniform(-bound, bound, (self.out_channels,)), self.backend) if bias else None
        self._fargs = self._functional_args()

    @property
    def simple(self) -> bool:
        """A square kernel with one int stride/padding, no dilation, one group: the fused kernels' case."""
        return isinstance(self._fargs.get("stride"), int) and len(self._fargs) == 2

    def _functional_args(self) -> dict:
        """Keyword arguments for ``functional.conv2d``: ints where the square fast paths apply."""
        square = self.kernel_size[0] == self.kernel_size[1]
        pad = "valid" if self.padding == "valid" else self.padding
        if pad == "valid":
            pad = (0, 0)
        if pad == "same" and self.stride == (1, 1) and self.dilation == (1, 1) and all(k % 2 for k in self.kernel_size):
            pad = ((self.kernel_size[0] - 1) // 2, (self.kernel_size[1] - 1) // 2)  # the same pads, as ints
        if (square and pad != "same" and self.stride[0] == self.stride[1] and pad[0] == pad[1]
                and self.dilation == (1, 1) and self.groups == 1):
            return {"stride": self.stride[0], "padding": pad[0]}
        return {"stride": _scalar_or_pair(self.stride), "padding": pad if pad == "same" else _scalar_or_pair(pad),
                "dilation": _scalar_or_pair(self.dilation), "groups": self.groups}

    def config(self):
        return dict(in_channels=self.in_channels, out_channels=self.out_channels,
                    kernel_size=_scalar_or_pair(self.kernel_size), stride=_scalar_or_pair(self.stride),
                    padding=self.padding if isinstance(self.padding, str) else _scalar_or_pair(self.padding),
                    dilation=_scalar_or_pair(self.dilation), groups=self.groups, bias=self.bias is not None)

    def _extra_repr(self) -> str:
        c = self.config()
        defaults = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "bias": True}
        return ", ".join(f"{k}={v!r}" for k, v in c.items() if defaults.get(k, object()) != v)

    def output_shape(self, x_shape) -> tuple:
        return F.conv2d_output_shape(x_shape, self.weight.shape, **self._fargs, where=Where(self))

    def macs(self, x_shape) -> int:
        n, o, p, q = self.output_shape(x_shape)
        return n * o * p * q * math.prod(self.weight.shape[1:])

    def forward(self, x):
        x = self._input(x)
        b = self.bias.data if self.bias is not None else None
        precision = current_precision()
        y = F.conv2d(x, self.weight.data, b, **self._fargs, precision=precision, backend=self.backend)
        self._cache = (x, precision)  # the backward runs in the forward's precision, inside autocast or not
        return y

    def backward(self, dy, need_dx: bool = True):
        """Fills ``weight.grad`` and ``bias.grad`` (overwritten) and returns dx (None unless ``need_dx``)."""
        x, precision = self._cached()
        dy = self._check_dy(dy, self.output_shape(shape_of(x)))
        dx, dw, db = F.conv2d_backward(x, self.weight.data, dy, **self._fargs, need_dx=need_dx,
                                       need_db=self.bias is not None, precision=precision, backend=self.backend)
        self.weight.grad = dw
        if self.bias is not None:
            self.bias.grad = db
        return dx


class Linear(Layer):
    """Fully connected layer ``y = x @ weight.T + bias``; weight (out_features, in_features)."""

    param_names = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend=None, rng=None):
        super().__init__(backend)
        self.in_features = check_int(in_features, "in_features", "Linear", 1)
        self.out_features = check_int(out_features, "out_features", "Linear", 1)
        _check_bool(bias, "bias", "Linear")
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

    def output_shape(self, x_shape) -> tuple:
        self._check_x(tuple(x_shape))
        return (x_shape[0], self.out_features)

    def macs(self, x_shape) -> int:
        return x_shape[0] * self.in_features * self.out_features

    # (x.shape, weight.shape, bias shape) of the last float32 forward whose arrays F.linear accepted
    # as they were: the same shapes again skip its checks (the backend still guards the kernel)
    _fwd_checked = None

    def forward(self, x):
        w = self.weight.data
        b = self.bias.data if self.bias is not None else None
        precision = current_precision()
        key = None
        if (type(x) is np.ndarray and x.dtype is _F32 and type(w) is np.ndarray and w.dtype is _F32
                and (b is None or (type(b) is np.ndarray and b.dtype is _F32)) and precision == "fp32"
                and x.flags.c_contiguous and self.backend.host_arrays):
            key = (x.shape, w.shape, None if b is None else b.shape)
            if key == self._fwd_checked:
                y = F._linear_checked(x, w, b, self.backend)
                self._cache = (x, precision)
                return y
        x = self._input(x)
        try:  # functional checks the shapes; on a bad one, the layer's own message says more
            y = F.linear(x, w, b, precision=precision, backend=self.backend)
        except ValueError:
            self._check_x(shape_of(x))
            raise
        if key is not None:
            self._fwd_checked = key
        self._cache = (x, precision)  # the backward runs in the forward's precision, inside autocast or not
        return y

    def backward(self, dy, need_dx: bool = True):
        """Fills ``weight.grad``/``bias.grad`` (overwritten); returns dx (None unless ``need_dx``)."""
        x, precision = self._cached()
        try:
            dx, dw, db = F.linear_backward(x, self.weight.data, dy, need_dx=need_dx,
                                           need_db=self.bias is not None, precision=precision,
                                           backend=self.backend)
        except (TypeError, ValueError):
            self._check_dy(dy, (x.shape[0], self.out_features))
            raise
        self.weight.grad = dw
        if self.bias is not None:
            self.bias.grad = db
        return dx


# ============================================================ pooling
class _Pool2d(Layer):
    _name = ""

    def __init__(self, kernel_size, stride=None, padding=0, backend=None):
        super().__init__(backend)
        where = type(self).__name__
        kh, kw = _pair(kernel_size, "kernel_size", where, 1)
        sh, sw = (kh, kw) if stride is None else _pair(stride, "stride", where, 1)
        ph, pw = _pair(padding, "padding", where, 0)
        if ph > kh // 2 or pw > kw // 2:
            raise ValueError(f"{where}: padding {(ph, pw)} must be at most half the kernel size {(kh, kw)}")
        # PyTorch keeps the arguments as given (an int stays an int)
        self.kernel_size = kernel_size if isinstance(kernel_size, int) else (kh, kw)
        self.stride = self.kernel_size if stride is None else (stride if isinstance(stride, int) else (sh, sw))
        self.padding = padding if isinstance(padding, int) else (ph, pw)
        square = kh == kw and sh == sw and ph == pw
        self._fargs = {"kernel_size": kh if square else (kh, kw), "stride": sh if square else (sh, sw)}
        if ph or pw:
            self._fargs["padding"] = ph if square else (ph, pw)

    @property
    def simple(self) -> bool:
        """A square window, one stride, no padding: the fused kernels' case."""
        return isinstance(self._fargs["kernel_size"], int) and "padding" not in self._fargs

    def config(self):
        return dict(kernel_size=self.kernel_size, stride=self.stride, padding=self.padding)

    def output_shape(self, x_shape) -> tuple:
        return F.pool2d_output_shape(x_shape, **self._fargs, where=Where(self))

    def macs(self, x_shape) -> int:
        kh, kw = _pair(self.kernel_size, "kernel_size", "", 1)
        return math.prod(self.output_shape(x_shape)) * kh * kw


class MaxPool2d(_Pool2d):
    """Max pooling over ``kernel_size`` windows (stride defaults to the kernel size); argmax cached.

    ``padding`` pads with -inf (never selected), at most half the kernel.
    """

    def __init__(self, kernel_size, stride=None, padding=0, backend=None):
        super().__init__(kernel_size, stride, padding, backend)
        if self.simple:  # the historical call, without the padding argument
            self._fargs.pop("padding", None)

    def output_shape(self, x_shape) -> tuple:
        if self.simple:
            return F.maxpool2d_output_shape(x_shape, self._fargs["kernel_size"], self._fargs["stride"], Where(self))
        return super().output_shape(x_shape)

    def forward(self, x):
        x = self._input(x)
        y, argmax = F.maxpool2d(x, **self._fargs, return_indices=True, backend=self.backend)
        self._cache = (shape_of(x), argmax)
        return y

    def backward(self, dy, need_dx: bool = True):
        x_shape, argmax = self._cached()
        dy = self._check_dy(dy, shape_of(argmax))
        return F.maxpool2d_backward(dy, argmax, x_shape, backend=self.backend)


class AvgPool2d(_Pool2d):
    """Average pooling; padded zeros count in the average (PyTorch's ``count_include_pad=True``)."""

    def forward(self, x):
        x = self._input(x)
        y = F.avgpool2d(x, **self._fargs, backend=self.backend)
        self._cache = shape_of(x)
        return y

    def backward(self, dy, need_dx: bool = True):
        x_shape = self._cached()
        dy = self._check_dy(dy, self.output_shape(x_shape))
        return F.avgpool2d_backward(dy, x_shape, **self._fargs, backend=self.backend)


class AdaptiveAvgPool2d(Layer):
    """Average pooling to a fixed ``output_size`` (int or (h, w)); ``1`` is global average pooling."""

    def __init__(self, output_size, backend=None):
        super().__init__(backend)
        self._size = _pair(output_size, "output_size", "AdaptiveAvgPool2d", 1)
        self.output_size = output_size if isinstance(output_size, int) else self._size

    def config(self):
        return dict(output_size=self.output_size)

    def output_shape(self, x_shape) -> tuple:
        x_shape = tuple(x_shape)
        if len(x_shape) != 4:
            raise ValueError(f"{self!r}: x must be 4-D (N, C, H, W), got shape {x_shape}")
        return (x_shape[0], x_shape[1]) + self._size

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def forward(self, x):
        x = self._input(x)
        y = F.adaptive_avgpool2d(x, self._size, backend=self.backend)
        self._cache = shape_of(x)
        return y

    def backward(self, dy, need_dx: bool = True):
        x_shape = self._cached()
        dy = self._check_dy(dy, self.output_shape(x_shape))
        return F.adaptive_avgpool2d_backward(dy, x_shape, self._size, backend=self.backend)


# ============================================================ normalisation
class _BatchNorm(Layer):
    param_names = ("weight", "bias")
    buffer_names = ("running_mean", "running_var", "num_batches_tracked")
    _ndims: tuple = ()
    _layout = ""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, backend=None):
        super().__init__(backend)
        where = type(self).__name__
        self.num_features = check_int(num_features, "num_features", where, 1)
        self.eps = check_float(eps, "eps", where, 0.0, min_inclusive=False)
        self.momentum = None if momentum is None else check_float(momentum, "momentum", where, 0.0, 1.0)
        self.affine = _check_bool(affine, "affine", where)
        self.track_running_stats = _check_bool(track_running_stats, "track_running_stats", where)
        c = self.num_features
        self.weight = Parameter(np.ones(c), self.backend) if affine else None
        self.bias = Parameter(np.zeros(c), self.backend) if affine else None
        if self.track_running_stats:
            self.running_mean = self.backend.asarray(np.zeros(c, np.float32))
            self.running_var = self.backend.asarray(np.ones(c, np.float32))
            self.num_batches_tracked = np.zeros((), np.int64)
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def config(self):
        return dict(num_features=self.num_features, eps=self.eps, momentum=self.momentum, affine=self.affine,
                    track_running_stats=self.track_running_stats)

    def _extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, " \
               f"track_running_stats={self.track_running_stats}"

    def _check_x(self, x_shape):
        if len(x_shape) not in self._ndims:
            raise ValueError(f"{self!r}: x must be {self._layout}, got shape {x_shape}")
        if x_shape[1] != self.num_features:
            raise ValueError(f"{self!r}: x has {x_shape[1]} channels, expected num_features={self.num_features}")

    def output_shape(self, x_shape) -> tuple:
        self._check_x(tuple(x_shape))
        return tuple(x_shape)

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def _uses_batch_stats(self) -> bool:
        return self.training or self.running_mean is None

    def _check_state(self, attr: str, value: np.ndarray, key: str, where: str) -> None:
        # NaN or negative statistics would make every eval-mode output NaN, silently
        if attr in ("running_mean", "running_var"):
            bad = ~np.isfinite(value) if attr == "running_mean" else ~(np.isfinite(value) & (value >= 0))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                expected = "finite" if attr == "running_mean" else "finite and non-negative"
                raise ValueError(f"{where}: {key} must be {expected} (it is a BatchNorm running statistic), got "
                                 f"{value.reshape(-1)[i]} at index {i} ({int(bad.sum())} bad value(s) of "
                                 f"{value.size})")

    def forward(self, x, relu: bool = False, residual=None):
        """Normalise x; ``relu`` applies ``max(., 0)`` in the same pass, after adding ``residual`` (an
        array of x's shape: ``relu(bn(x) + residual)``, the end of a residual block) when given.

        With a residual the gradient :meth:`backward` receives must already be
        masked by the ReLU (the caller, :class:`Residual`, masks it once for both
        of its branches).
        """
        x = self._input(x)
        self._check_x(shape_of(x))
        batch_stats = self._uses_batch_stats()
        if batch_stats and math.prod(shape_of(x)) // self.num_features < 2:
            # checked before num_batches_tracked moves: the usual cause is a last batch of one sample
            raise ValueError(f"{self!r}: normalising with batch statistics needs more than 1 value per channel, "
                             f"got x of shape {shape_of(x)}; a last batch of 1 sample? pass drop_last=True to the "
                             "DataLoader, or pick a batch_size that does not leave one sample over")
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked = np.array(self.num_batches_tracked + 1, dtype=np.int64)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        update = self.training and self.track_running_stats
        w = self.weight.data if self.weight is not None else None
        b = self.bias.data if self.bias is not None else None
        rm = self.running_mean if (update or not batch_stats) else None
        rv = self.running_var if (update or not batch_stats) else None
        y, saved = F.batch_norm(x, w, b, rm, rv, training=batch_stats, momentum=factor, eps=self.eps, relu=relu,
                                residual=residual, backend=self.backend)
        if residual is not None and relu:
            saved = F.BatchNormSaved(saved.training, saved.mean, saved.invstd, None)
        self._cache = (x, saved)
        return y

    def backward(self, dy, need_dx: bool = True):
        x, saved = self._cached()
        dy = self._check_dy(dy, shape_of(x))
        dx, dw, db = F.batch_norm_backward(x, self.weight.data if self.weight is not None else None, dy, saved,
                                           need_dx=need_dx, backend=self.backend)
        if self.weight is not None:
            self.weight.grad, self.bias.grad = dw, db
        return dx


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) input, per channel (PyTorch semantics and state-dict keys).

    Training mode normalises with the batch statistics and updates
    ``running_mean``/``running_var`` (unbiased variance) with ``momentum``
    (``None``: a cumulative average); eval mode uses the running statistics.
    """

    _ndims, _layout = (4,), "4-D (N, C, H, W)"


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) input, per feature (PyTorch semantics)."""

    _ndims, _layout = (2, 3), "2-D (N, C) or 3-D (N, C, L)"


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with the statistics of the global batch over MPI ranks (PyTorch's name).

    In training mode every rank's per-channel count, sum and sum of squares
    are summed over the ranks (one ``Allreduce`` of ``2C + 1`` float64 values
    per layer), so each rank normalises its shard with the mean and variance
    of the whole batch and the running statistics are the global batch's on
    every rank; the backward sums ``sum(dy)`` and ``sum(dy * xhat)`` over the
    ranks the same way (one more ``Allreduce``), so gradients equal those of
    :class:`BatchNorm2d` on the global batch. Unlike PyTorch's, it runs on CPUs
    (any backend: only the ``(C,)`` sums travel through the host).

    On one process, without MPI, and in eval mode it is exactly
    :class:`BatchNorm2d`/:class:`BatchNorm1d` (2-D, 3-D or 4-D input). Every
    rank must call it on every step (each needs the others' sums); ``fit``
    sees to that when a rank's share of a batch is empty.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats
        As :class:`BatchNorm2d`.
    comm : mpi4py communicator, optional
        The ranks to reduce over (PyTorch's ``process_group``). Default: the
        communicator of the :class:`parconv.distributed.DataParallel` that
        trains the model, else ``MPI.COMM_WORLD`` once ``mpi4py`` is imported;
        without either it normalises per process.

    Examples
    --------
    >>> import parconv as pc
    >>> model = pc.Sequential(pc.Conv2d(1, 4, 3), pc.BatchNorm2d(4), pc.ReLU(), backend="numpy")
    >>> model = pc.SyncBatchNorm.convert_sync_batchnorm(model)
    >>> type(model.layers[1]).__name__
    'SyncBatchNorm'
    """

    _ndims, _layout = (2, 3, 4), "2-D (N, C), 3-D (N, C, L) or 4-D (N, C, H, W)"

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, comm=None, backend=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, backend)
        if comm is not None and not (hasattr(comm, "Allreduce") and hasattr(comm, "Get_size")):
            raise TypeError(f"SyncBatchNorm: comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or None, "
                            f"got {type(comm).__name__}")
        self.comm = comm
        self._dp = None  # the DataParallel training this layer: its comm and this rank's share of the batch

    # ------------------------------------------------------------ the ranks
    def _group(self):
        """The communicator to reduce over, or None when this process is alone."""
        import sys

        comm = self.comm
        if comm is None and self._dp is not None:
            comm = self._dp.comm
        if comm is None:
            mpi = sys.modules.get("mpi4py.MPI")
            comm = None if mpi is None else mpi.COMM_WORLD
        return comm if comm is not None and comm.Get_size() > 1 else None

    def _share(self, size: int) -> float:
        """This rank's weight in the global gradient: the DataParallel's while it reduces, else 1 / size."""
        dp = self._dp
        if dp is not None and getattr(dp, "_active", False):
            return float(dp._weight)
        return 1.0 / size

    @staticmethod
    def _allreduce(comm, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, [values, MPI.DOUBLE], op=MPI.SUM)
        return values

    def _local_sums(self, x, count: int):
        """Host float64 ``(sum, sum of squares)`` per channel of x (count values each)."""
        C = self.num_features
        # a shard of one value per channel (one sample on this rank) has no batch statistics of its own
        # for the device's kernel to compute; its sums are exact on the host
        if self.backend.host_arrays or count < 2:
            x3 = np.asarray(x if self.backend.host_arrays else self.backend.to_numpy(x)).reshape(x.shape[0], C, -1)
            s = x3.sum(axis=(0, 2), dtype=np.float64)
            d = x3 - (s / count).astype(np.float32)[None, :, None]
            m2 = np.square(d, out=d).sum(axis=(0, 2), dtype=np.float64)
            return s, m2 + s * s / count
        # a device backend: its own kernel reduces; only the (C,) statistics come back
        _, saved = F.batch_norm(x, None, None, None, None, training=True, eps=self.eps, backend=self.backend)
        mean = np.asarray(self.backend.to_numpy(saved.mean), dtype=np.float64)
        invstd = np.asarray(self.backend.to_numpy(saved.invstd), dtype=np.float64)
        var = np.maximum(1.0 / invstd**2 - self.eps, 0.0)
        return mean * count, (var + mean * mean) * count

    # ------------------------------------------------------------ forward / backward
    def forward(self, x, relu: bool = False, residual=None):
        comm = self._group() if self._uses_batch_stats() else None
        if comm is None:
            self._synced = None
            return super().forward(x, relu=relu, residual=residual)
        x = self._input(x)
        shape = shape_of(x)
        self._check_x(shape)
        C = self.num_features
        count = math.prod(shape) // C
        placeholder = self._dp is not None and getattr(self._dp, "_placeholder", False)
        stats = np.zeros(2 * C + 1, dtype=np.float64)
        if not placeholder:  # a rank holding no share of the batch adds nothing
            stats[0] = count
            stats[1:C + 1], stats[C + 1:] = self._local_sums(x, count)
        total = int(self._allreduce(comm, stats)[0])
        if total < 2:
            raise ValueError(f"{self!r}: training needs more than 1 value per channel over all ranks, got {total}")
        mean = stats[1:C + 1] / total
        var = np.maximum(stats[C + 1:] / total - mean * mean, 0.0)
        be = self.backend
        w = self.weight.data if self.weight is not None else None
        b = self.bias.data if self.bias is not None else None
        # the global statistics turn the normalisation into eval mode's per-channel affine map
        y, saved = F.batch_norm(x, w, b, be.asarray(mean.astype(np.float32)), be.asarray(var.astype(np.float32)),
                                training=False, eps=self.eps, relu=relu, residual=residual, backend=be)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = np.array(self.num_batches_tracked + 1, dtype=np.int64)
            f = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            rm = np.asarray(be.to_numpy(self.running_mean), dtype=np.float64)
            rv = np.asarray(be.to_numpy(self.running_var), dtype=np.float64)
            self.running_mean = be.asarray(((1 - f) * rm + f * mean).astype(np.float32))
            self.running_var = be.asarray(((1 - f) * rv + f * var * total / (total - 1)).astype(np.float32))
        keep_y = relu and residual is None  # with a residual the caller masks dy by the ReLU itself
        self._cache = (x, F.BatchNormSaved(True, saved.mean, saved.invstd, y if keep_y else None))
        self._synced = (comm, total, count, placeholder)
        return y

    def backward(self, dy, need_dx: bool = True):
        synced = getattr(self, "_synced", None)
        if synced is None:
            return super().backward(dy, need_dx=need_dx)
        comm, total, count, placeholder = synced
        x, saved = self._cached()
        be = self.backend
        dy = self._check_dy(dy, shape_of(x))
        C = self.num_features
        w = self.weight.data if self.weight is not None else be.asarray(np.ones(C, np.float32))
        # the local backward with the global mean and invstd: dw = sum(dy * xhat), db = sum(dy) over this shard
        dx, dw, db = F.batch_norm_backward(x, w, dy, saved, need_dx=need_dx, backend=be)
        if self.weight is not None:
            self.weight.grad, self.bias.grad = dw, db
        if not need_dx:
            return None
        # The loss is sum_r share_r * loss_r and the reducer scales this rank's gradients by share_r,
        # so the sums are weighted and dx divided by share_r: dx = w invstd (dy - (Sg + xhat Sgx) / (M share_r)).
        share = 0.0 if placeholder else self._share(comm.Get_size())
        sums = np.concatenate([np.asarray(be.to_numpy(db), np.float64), np.asarray(be.to_numpy(dw), np.float64)])
        sums *= share
        self._allreduce(comm, sums)
        unit_var = be.asarray(np.full(C, 1 - _UNIT_EPS, np.float32))
        if share == 0.0:  # its gradients are scaled by 0: they only need to be finite
            zeros = be.asarray(np.zeros(C, np.float32))
            return F.batch_norm(x, zeros, zeros, saved.mean, unit_var, training=False, eps=_UNIT_EPS, backend=be)[0]
        k = np.asarray(be.to_numpy(saved.invstd), np.float64) * np.asarray(be.to_numpy(w), np.float64)
        sg, sgx = sums[:C] / (total * share), sums[C:] / (total * share)
        local_g = np.asarray(be.to_numpy(db), np.float64) / count
        local_gx = np.asarray(be.to_numpy(dw), np.float64) / count
        # dx - dx_local = k * ((local_g - sg) + xhat * (local_gx - sgx)): a per-channel affine map of x,
        # applied (and added to dx_local) by the eval-mode normalisation with unit variance
        scale = k * (local_gx - sgx) * np.asarray(be.to_numpy(saved.invstd), np.float64)
        shift = k * (local_g - sg)
        out, _ = F.batch_norm(x, be.asarray(scale.astype(np.float32)), be.asarray(shift.astype(np.float32)),
                              saved.mean, unit_var, training=False, eps=_UNIT_EPS, residual=dx, backend=be)
        return out

    # ------------------------------------------------------------ conversion
    @classmethod
    def convert_sync_batchnorm(cls, module, comm=None):
        """Replace every :class:`BatchNorm1d`/:class:`BatchNorm2d` in ``module`` by a :class:`SyncBatchNorm`.

        The new layers share the old ones' parameters and buffers (an optimizer
        built before still updates them) and keep their mode. Returns
        ``module`` (or the new layer, when ``module`` is itself a BatchNorm).
        """
        if not isinstance(module, Layer):
            raise TypeError(f"SyncBatchNorm.convert_sync_batchnorm: module must be a parconv layer or Sequential, "
                            f"got {type(module).__name__}")

        def convert(bn):
            new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, comm=comm,
                      backend=bn.backend)
            for name in bn.param_names + bn.buffer_names:
                setattr(new, name, getattr(bn, name))
            new.training = bn.training
            return new

        if type(module) in (BatchNorm1d, BatchNorm2d):
            return convert(module)
        for parent in module.modules():
            if hasattr(parent, "layers") and isinstance(parent.layers, list):
                for i, child in enumerate(parent.layers):
                    if type(child) in (BatchNorm1d, BatchNorm2d):
                        parent.layers[i] = convert(child)
            else:
                for name, child in parent.children():
                    if type(child) in (BatchNorm1d, BatchNorm2d):
                        setattr(parent, name, convert(child))
            if hasattr(parent, "_plan_key"):
                parent._plan_key = None  # the fusion plan holds the old layers
        return module


#: eps of the unit-variance normalisation SyncBatchNorm's backward applies its correction with: (1 - eps) + eps is 1
_UNIT_EPS = 2.0**-10

__all__ += ["SyncBatchNorm"]


class Dropout(Layer):
    """Inverted dropout: in training mode each element is zeroed with probability ``p`` and the rest
    are scaled by ``1 / (1 - p)``; the identity in eval mode.

    Each call draws a fresh mask from the layer's generator (seeded from
    :func:`parconv.manual_seed` at construction unless ``rng`` is given); the
    backward pass reuses the same mask.
    """

    def __init__(self, p: float = 0.5, backend=None, rng=None):
        super().__init__(backend)
        self.p = check_float(p, "p", "Dropout", 0.0, 1.0)
        parent = _rng(rng)
        # a generator of its own, spawned from the given (or the global) one: masks do not shift
        # the draws of the layers built after it
        seeded = rng is not None and not isinstance(rng, np.random.Generator)
        self._gen = parent if seeded else np.random.default_rng(parent.integers(0, 2**63))

    def config(self):
        return dict(p=self.p)

    def forward(self, x):
        x = self._input(x)
        if not self.training or self.p == 0.0:
            self._cache = (None, shape_of(x))
            return x
        seed = int(self._gen.integers(0, 2**63))
        self._cache = (seed, shape_of(x))
        return F.dropout(x, self.p, seed, backend=self.backend)

    def backward(self, dy, need_dx: bool = True):
        seed, shape = self._cached()
        dy = self._check_dy(dy, shape)
        if seed is None:
            return dy
        return F.dropout_backward(dy, self.p, seed, backend=self.backend)


class Normalize(Layer):
    """Input preprocessing as a layer: ``(x - mean) / std`` per channel (torchvision's ``Normalize``).

    Put first in a model trained on standardised data, it makes the model
    take raw inputs: ``mean`` and ``std`` are buffers (state-dict keys
    ``"<i>.mean"``, ``"<i>.std"``), so :meth:`~parconv.Sequential.save`,
    :func:`parconv.load` and :func:`parconv.onnx.export` (as ``Sub`` and
    ``Div``) keep them. Nothing is trained; the gradient is ``dy / std``.

    Parameters
    ----------
    mean, std : float or sequence of floats
        One value per channel (dim 1 of the input), or one for all. ``std``
        must be positive.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> norm = pc.Normalize(mean=[0.5, 0.25], std=[0.5, 0.25], backend="numpy")
    >>> norm(np.ones((1, 2, 1, 1))).ravel()
    array([1., 3.], dtype=float32)
    """

    buffer_names = ("mean", "std")

    def __init__(self, mean, std, backend=None):
        super().__init__(backend)
        m, s = self._values(mean, "mean"), self._values(std, "std")
        if len(m) != len(s) and 1 not in (len(m), len(s)):
            raise ValueError(f"Normalize: mean has {len(m)} values and std {len(s)}; give one per channel for "
                             "both, or one for all")
        m, s = np.broadcast_arrays(m, s)
        F._normalize_std(s, self.backend, "Normalize")
        self.num_channels = len(m)
        self.mean = self.backend.asarray(np.array(m, np.float32))
        self.std = self.backend.asarray(np.array(s, np.float32))

    @staticmethod
    def _values(value, name: str) -> np.ndarray:
        try:
            a = np.array(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"Normalize: {name} must be a number or a sequence of numbers, got "
                            f"{type(value).__name__} {value!r:.80}") from None
        if a.ndim > 1 or a.size == 0 or not np.isfinite(a).all():
            raise ValueError(f"Normalize: {name} must be a finite number or a non-empty 1-D sequence of them "
                             f"(one per channel), got {value!r:.80}")
        return a.reshape(-1)

    def config(self):
        return dict(mean=[float(v) for v in self.backend.to_numpy(self.mean)],
                    std=[float(v) for v in self.backend.to_numpy(self.std)])

    def _extra_repr(self) -> str:
        c = self.config()
        return ", ".join(f"{k}=" + ("[" + ", ".join(f"{v:.4g}" for v in c[k]) + "]") for k in ("mean", "std"))

    def output_shape(self, x_shape) -> tuple:
        x_shape = tuple(x_shape)
        if len(x_shape) not in (2, 3, 4):
            raise ValueError(f"{self!r}: x must be 2-D (N, F), 3-D (N, C, L) or 4-D (N, C, H, W), got shape "
                             f"{x_shape}")
        if self.num_channels != 1 and x_shape[1] != self.num_channels:
            raise ValueError(f"{self!r}: x has {x_shape[1]} channels, expected {self.num_channels}")
        return x_shape

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def forward(self, x):
        x = self._input(x)
        self.output_shape(shape_of(x))
        self._cache = shape_of(x)
        return F.normalize(x, self.mean, self.std, backend=self.backend)

    def backward(self, dy, need_dx: bool = True):
        shape = self._cached()
        if not need_dx:
            return None  # nothing to train here: only the input's gradient, and none is wanted
        return F.normalize_backward(self._check_dy(dy, shape), self.std, backend=self.backend)


# ============================================================ activations
class _Activation(Layer):
    _fwd = _bwd = ""

    def forward(self, x):
        y = getattr(F, self._fwd)(x, backend=self.backend)  # functional converts and checks x
        self._cache = y
        return y

    def backward(self, dy, need_dx: bool = True):
        # functional checks dy against the cached output's shape
        return getattr(F, self._bwd)(self._cached(), dy, backend=self.backend)

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)


class ReLU(_Activation):
    """``max(x, 0)`` elementwise."""

    _fwd, _bwd = "relu", "relu_backward"


class Sigmoid(_Activation):
    """Logistic sigmoid elementwise (overflow-free)."""

    _fwd, _bwd = "sigmoid", "sigmoid_backward"


class Tanh(_Activation):
    """Hyperbolic tangent elementwise."""

    _fwd, _bwd = "tanh", "tanh_backward"


class LeakyReLU(Layer):
    """``x`` where ``x > 0``, else ``negative_slope * x``."""

    def __init__(self, negative_slope: float = 0.01, backend=None):
        super().__init__(backend)
        self.negative_slope = check_float(negative_slope, "negative_slope", "LeakyReLU")

    def config(self):
        return dict(negative_slope=self.negative_slope)

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def forward(self, x):
        x = self._input(x)
        y = F.leaky_relu(x, self.negative_slope, backend=self.backend)
        self._cache = x
        return y

    def backward(self, dy, need_dx: bool = True):
        x = self._cached()
        dy = self._check_dy(dy, shape_of(x))
        return F.leaky_relu_backward(x, dy, self.negative_slope, backend=self.backend)


class ELU(Layer):
    """Exponential linear unit: ``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""

    def __init__(self, alpha: float = 1.0, backend=None):
        super().__init__(backend)
        self.alpha = check_float(alpha, "alpha", "ELU")

    def config(self):
        return dict(alpha=self.alpha)

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def forward(self, x):
        y = F.elu(self._input(x), self.alpha, backend=self.backend)
        self._cache = y
        return y

    def backward(self, dy, need_dx: bool = True):
        y = self._cached()
        return F.elu_backward(y, self._check_dy(dy, shape_of(y)), self.alpha, backend=self.backend)


class Softmax(Layer):
    """Softmax along ``dim`` (default 1, the classes of (N, G) logits)."""

    def __init__(self, dim: int = 1, backend=None):
        super().__init__(backend)
        self.dim = check_int(dim, "dim", "Softmax", -(2**31))

    def config(self):
        return dict(dim=self.dim)

    def output_shape(self, x_shape) -> tuple:
        if not -len(x_shape) <= self.dim < len(x_shape):
            raise ValueError(f"{self!r}: dim {self.dim} is out of range for an input of shape {tuple(x_shape)}")
        return tuple(x_shape)

    def macs(self, x_shape) -> int:
        return math.prod(x_shape)

    def forward(self, x):
        x = self._input(x)
        self.output_shape(shape_of(x))
        y = F.softmax(x, self.dim, backend=self.backend)
        self._cache = y
        return y

    def backward(self, dy, need_dx: bool = True):
        y = self._cached()
        dy = self._check_dy(dy, shape_of(y))
        return F.softmax_backward(y, dy, self.dim, backend=self.backend)


class Flatten(Layer):
    """Flattens every dimension after the batch: (N, ...) -> (N, prod(...)). No copy."""

    def output_shape(self, x_shape) -> tuple:
        x_shape = tuple(x_shape)
        if len(x_shape) < 2:
            raise ValueError(f"{self!r}: x must have a batch dimension and at least one more, got shape {x_shape}")
        return (x_shape[0], math.prod(x_shape[1:]))

    def forward(self, x):
        x = self._input(x)
        shape = shape_of(x)
        out = self.output_shape(shape)
        self._cache = shape
        return F.reshape(x, out, backend=self.backend)

    def backward(self, dy, need_dx: bool = True):
        shape = self._cached()
        dy = self._check_dy(dy, (shape[0], math.prod(shape[1:])))
        return F.reshape(dy, shape, backend=self.backend)


class Identity(Layer):
    """Returns its input unchanged (a placeholder, e.g. an explicit identity shortcut)."""

    def forward(self, x):
        x = self._input(x)
        self._cache = shape_of(x)
        return x

    def backward(self, dy, need_dx: bool = True):
        return self._check_dy(dy, self._cached())


# ============================================================ containers
class Residual(Layer):
    """``body(x) + shortcut(x)``: a residual block (``shortcut=None`` is the identity).

    ``body`` and ``shortcut`` are layers or :class:`parconv.Sequential`\\ s;
    state-dict keys are ``"body.<j>.weight"`` and ``"shortcut.<j>.weight"``
    below the block's own prefix, as the equivalent PyTorch module with
    ``body``/``shortcut`` attributes.
    """

    def __init__(self, body, shortcut=None, backend=None):
        for name, part in (("body", body), ("shortcut", shortcut)):
            if part is not None and not isinstance(part, Layer):
                raise TypeError(f"Residual: {name} must be a parconv layer or Sequential, got {type(part).__name__}")
        super().__init__(body.backend if backend is None else backend)
        self.body, self.shortcut = body, shortcut
        names = {m.backend.name for m in self.modules()[1:]}
        if backend is not None or len(names) > 1:
            if backend is None:
                raise ValueError(f"Residual: body and shortcut live on different backends {sorted(names)}; "
                                 "pass backend=...")
            self.to(backend)

    def children(self) -> list:
        return [("body", self.body)] + ([("shortcut", self.shortcut)] if self.shortcut is not None else [])

    def spec(self) -> dict:
        return {"type": "Residual", "config": {"body": self.body.spec(),
                                               "shortcut": None if self.shortcut is None else self.shortcut.spec()}}

    @classmethod
    def from_config(cls, config: dict, backend=None) -> "Residual":
        shortcut = config.get("shortcut")
        return cls(layer_from_spec(config["body"], backend),
                   None if shortcut is None else layer_from_spec(shortcut, backend), backend=backend)

    def _extra_repr(self) -> str:
        return f"body={self.body!r}, shortcut={self.shortcut!r}"

    def output_shape(self, x_shape) -> tuple:
        a = _shape_through(self.body, x_shape)
        b = tuple(x_shape) if self.shortcut is None else _shape_through(self.shortcut, x_shape)
        if a != b:
            raise ValueError(f"Residual: body output {a} and shortcut output {b} differ for input {tuple(x_shape)} "
                             "(give the block a projection shortcut, e.g. a 1x1 strided Conv2d)")
        return a

    def macs(self, x_shape) -> int:
        body = _macs_through(self.body, x_shape)
        short = 0 if self.shortcut is None else _macs_through(self.shortcut, x_shape)
        return body + short + math.prod(self.output_shape(x_shape))

    def forward(self, x, relu: bool = False):
        """``body(x) + shortcut(x)``, then ``max(., 0)`` when ``relu``.

        With ``relu`` and a body whose last step is a BatchNorm on its own (the
        basic block of a ResNet in training mode), that BatchNorm adds the
        shortcut and applies the ReLU as it writes: one pass instead of three.
        """
        x = self._input(x)
        b = x if self.shortcut is None else self.shortcut.forward(x)
        split = self.body._forward_to_tail_norm(x) if relu and hasattr(self.body, "_forward_to_tail_norm") else None
        if split is not None:
            h, norm = split
            _check_branches(tuple(norm.output_shape(shape_of(h))), shape_of(b))
            y = norm.forward(h, relu=True, residual=b)
            self._cache = (shape_of(y), y, norm)
            return y
        a = self.body.forward(x)
        _check_branches(shape_of(a), shape_of(b))
        y = F.add(a, b, relu=relu, backend=self.backend)
        self._cache = (shape_of(a), y if relu else None, None)
        return y

    def backward(self, dy, need_dx: bool = True):
        shape, y, norm = self._cached()
        dy = self._check_dy(dy, shape)
        if y is not None:  # the fused ReLU's mask, once for both branches
            dy = F.relu_backward(y, dy, backend=self.backend)
        if norm is not None:
            dx_body = self.body._backward_before_tail_norm(norm.backward(dy, need_dx=True), need_dx)
        else:
            dx_body = self.body.backward(dy, need_dx=need_dx)
        if self.shortcut is None:
            return F.add(dx_body, dy, backend=self.backend) if need_dx else None
        dx_short = self.shortcut.backward(dy, need_dx=need_dx)
        return F.add(dx_body, dx_short, backend=self.backend) if need_dx else None


def _check_branches(a: tuple, b: tuple) -> None:
    if a != b:
        raise ValueError(f"Residual: body output {a} and shortcut output {b} differ "
                         "(give the block a projection shortcut, e.g. a 1x1 strided Conv2d)")


def _shape_through(layer, x_shape) -> tuple:
    return tuple(layer.output_shape(tuple(x_shape)))


def _macs_through(layer, x_shape) -> int:
    return int(layer.macs(tuple(x_shape)))
