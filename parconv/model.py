"""``Sequential``: a container of layers (call, backward, state dicts, save/load).

Fusion planning lives in :mod:`parconv._fusion` and the training loop in
:mod:`parconv.training`; ``fit``/``evaluate``/``predict`` here only hand the
model to it.
"""

from __future__ import annotations

import numpy as np

from . import _fusion
from ._checkpoint import FORMAT_VERSION, read_model_file
from ._io import save_npz
from ._validation import to_backend_array
from .layers import Layer, _BatchNorm, layer_from_spec
from .training import History, TrainingDivergedError

__all__ = ["Sequential", "History", "load", "TrainingDivergedError"]


class Sequential(Layer):
    """A stack of layers applied in order; itself a layer, so it nests.

    Runs of layers that a backend executes faster as one op are fused (see
    :mod:`parconv._fusion`: ``Conv2d -> ReLU -> MaxPool2d`` and its classifier
    head, ``BatchNorm -> ReLU``); ``fuse=False`` turns that off. The maths is the same.

    Parameters
    ----------
    *layers : Layer
    backend : str or Backend, optional
        Move every layer there; by default the layers stay where they are
        (they must agree).
    fuse : bool, default True
    input_shape : tuple of int, optional
        One sample's shape, ``(C, H, W)`` or ``(F,)``, when the model is built
        for one (the zoo's builders set it): :meth:`summary` then needs no
        argument. Saved with the model.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3), backend="numpy")
    >>> model(np.ones((2, 1, 2, 2))).shape
    (2, 3)
    >>> list(model.state_dict())
    ['1.weight', '1.bias']
    """

    def __init__(self, *layers, backend=None, fuse: bool = True, input_shape=None):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        if not layers:
            raise ValueError("Sequential: needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential: argument {i} must be a parconv layer, got {type(layer).__name__}")
        self.layers = list(layers)
        self.fuse = bool(fuse)
        self.input_shape = input_shape
        self._plan_key = None
        self._steps: list = []
        self._ran: list | None = None
        self._grad_hooks: list = []
        self.stop_training = False
        if backend is not None:
            super().__init__(backend)
            self.to(backend)
        else:
            names = {m.backend.name for m in self.modules()[1:]}
            if len(names) > 1:
                raise ValueError(f"Sequential: layers live on different backends {sorted(names)}; pass backend=...")
            super().__init__(self.layers[0].backend)

    # ------------------------------------------------------------------ basics
    @property
    def input_shape(self) -> tuple | None:
        """One sample's shape, ``(C, H, W)`` or ``(F,)``, when known (zoo models); None otherwise. Settable."""
        return self._input_shape

    @input_shape.setter
    def input_shape(self, shape) -> None:
        self._input_shape = _sample_shape(shape)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Sequential(*self.layers[i], fuse=self.fuse)
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def children(self) -> list:
        return [(str(i), layer) for i, layer in enumerate(self.layers)]

    def __repr__(self):
        inner = ",\n".join("  ({}): {}".format(i, repr(layer).replace("\n", "\n  "))
                           for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n) on {self.backend.name!r}"

    def to(self, backend) -> "Sequential":
        """Move every layer to ``backend`` in place; returns self."""
        super().to(backend)
        self._plan_key, self._steps, self._ran = None, [], None
        return self

    def spec(self) -> dict:
        return {"type": "Sequential", "config": self.config()}

    def config(self) -> dict:
        config = {"layers": [layer.spec() for layer in self.layers], "fuse": self.fuse}
        if self.input_shape is not None:
            config["input_shape"] = list(self.input_shape)
        return config

    @classmethod
    def from_config(cls, config: dict, backend=None) -> "Sequential":
        """Rebuild an (untrained) model from :meth:`config` output."""
        try:
            specs = config["layers"]
            if not isinstance(specs, list):
                raise TypeError(f"'layers' must be a list, got {type(specs).__name__}")
            layers = [layer_from_spec(spec, backend) for spec in specs]
            fuse = config.get("fuse", True)
            input_shape = _sample_shape(config.get("input_shape"))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"invalid model config: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"invalid model config: {exc}") from None
        return cls(*layers, backend=backend, fuse=bool(fuse), input_shape=input_shape)

    def output_shape(self, x_shape) -> tuple:
        shape = tuple(x_shape)
        for layer in self.layers:
            shape = tuple(layer.output_shape(shape))
        return shape

    def macs(self, x_shape) -> int:
        total, shape = 0, tuple(x_shape)
        for layer in self.layers:
            total += int(layer.macs(shape))
            shape = tuple(layer.output_shape(shape))
        return total

    # ---------------------------------------------------------------- forward
    def plan(self) -> list:
        """The steps the next forward pass runs (:class:`parconv._fusion.PlanStep`), fused where it pays."""
        layers = self.layers
        key = (self.fuse, self.backend, tuple(map(id, layers)), tuple([layer.training for layer in layers]))
        if key != self._plan_key:
            self._steps = _fusion.plan(layers, self.backend, self.fuse)
            self._plan_key = key
        return self._steps

    def forward(self, x):
        """Run every layer; returns the output as a backend array."""
        x = to_backend_array(x, self.backend, "x", "Sequential")
        self._ran = steps = self.plan()
        for s in steps:
            x = s.step.forward(x)
        return x

    def release_caches(self) -> None:
        """Drop the fused steps' cached activations (after inference, to free memory)."""
        for s in self._steps:
            if s.step is not self.layers[s.start]:
                s.step.release()
        self._ran = None

    # --------------------------------------------------------------- backward
    def register_grad_hook(self, fn) -> None:
        """Call ``fn(layer_index, params)`` as soon as a layer's gradients are written in ``backward``.

        Used by data-parallel training to start gradient reductions while the
        rest of the backward pass runs.
        """
        if not callable(fn):
            raise TypeError(f"register_grad_hook: fn must be callable, got {type(fn).__name__}")
        self._grad_hooks.append(fn)

    def backward(self, dy, need_dx: bool = False):
        """Back-propagate ``dy`` (the loss gradient w.r.t. the output).

        Fills ``p.grad`` of every parameter (overwritten, not accumulated) and
        returns dx w.r.t. the input when ``need_dx`` (else None; the first
        layer then skips its dx computation).
        """
        # the steps the forward pass ran (what the caches hold), else today's
        steps = self._ran if self._ran is not None else self.plan()
        return self._backward_steps(steps, dy, need_dx)

    def _backward_steps(self, steps, dy, need_dx: bool):
        # layers without parameters at the front (an input Normalize) need no gradient: the step
        # after them skips its dx and they are not run backward
        frozen = 0 if need_dx else self._frozen_prefix()
        for s in reversed(steps):
            if s.start < frozen and dy is None:
                continue
            dy = s.step.backward(dy, need_dx=need_dx or s.start > frozen)
            self._run_hooks(s)
        return dy if need_dx else None

    def _frozen_prefix(self) -> int:
        """How many layers at the front have no parameters (nothing before them needs a gradient)."""
        n = 0
        while n < len(self.layers) - 1 and not self.layers[n].parameters():
            n += 1
        return n

    def _run_hooks(self, s) -> None:
        for i in s.hooks if self._grad_hooks else ():
            params = self.layers[i].parameters()
            if params:
                for hook in self._grad_hooks:
                    hook(i, params)

    # A Residual whose body ends in a BatchNorm runs that BatchNorm itself, with the shortcut
    # added and the ReLU applied (Residual.forward with relu): these two run the rest.
    def _forward_to_tail_norm(self, x):
        """When the plan's last step is a BatchNorm layer on its own, run every step before it and
        return ``(its input, the BatchNorm)``; else None, having run nothing."""
        steps = self.plan()
        last = steps[-1].step
        if not isinstance(last, _BatchNorm):
            return None
        x = to_backend_array(x, self.backend, "x", "Sequential")
        self._ran = steps
        for s in steps[:-1]:
            x = s.step.forward(x)
        return x, last

    def _backward_before_tail_norm(self, dy, need_dx: bool):
        """The backward of what :meth:`_forward_to_tail_norm` ran, from the gradient w.r.t. the
        BatchNorm's input (its own backward has run and written its gradients)."""
        steps = self._ran if self._ran is not None else self.plan()
        self._run_hooks(steps[-1])
        return self._backward_steps(steps[:-1], dy, need_dx)

    # ------------------------------------------------------------ save / load
    def save(self, path, extra: dict | None = None) -> None:
        """Write architecture, weights and buffers to ``path`` (``.npz``) atomically; no pickle.

        ``extra`` holds further arrays (e.g. optimizer state) stored under
        ``extra.<name>``.
        """
        quantized = self._quantized_layer()
        if quantized:
            raise ValueError(f"save: this model has int8 quantized layers ({quantized}), which the .npz format "
                             "does not hold; write it with parconv.onnx.export(model, path, input_shape) (a QDQ "
                             "graph that parconv.onnx.load reads back), or save the float model and quantize "
                             "after loading")
        arrays = self.state_dict()
        for k, v in (extra or {}).items():
            arrays[f"extra.{k}"] = np.asarray(v)
        from . import __version__

        save_npz(path, arrays, {"format": FORMAT_VERSION, "parconv": __version__, "model": self.config()})

    def _quantized_layer(self) -> str | None:
        """The class name of the first int8 layer (from :func:`parconv.quantization.quantize`), or None."""
        return next((type(m).__name__ for m in self.modules() if getattr(m, "_kind", "").startswith("Quantized")),
                    None)

    # ---------------------------------------------------------------- summary
    def summary(self, input_shape=None, print_fn=print):
        """Each layer's output shape, parameter count and forward multiply-adds, as a table.

        Prints the table and returns None (as Keras's ``summary``), so a
        REPL shows it once; with ``print_fn=None`` it prints nothing and
        returns the text instead. ``print_fn`` may be any callable taking
        one string (e.g. a logger's ``info``).

        Parameters
        ----------
        input_shape : tuple of int, optional
            One sample's shape, e.g. ``(1, 28, 28)``, or a batch's
            ``(N, 1, 28, 28)`` (multiply-adds are then for the batch). By
            default the model's :attr:`input_shape` (zoo models know theirs).
        print_fn : callable or None, default print

        Examples
        --------
        >>> import parconv as pc
        >>> model = pc.models.lenet5(backend="numpy")
        >>> model.input_shape
        (1, 28, 28)
        >>> text = model.summary(print_fn=None)
        >>> text.splitlines()[-1]
        'forward multiply-adds: ...'
        """
        from .training import summary_table

        if input_shape is None:
            input_shape = self.input_shape
            if input_shape is None:
                raise ValueError("summary: this model does not know its input shape; pass one sample's shape, "
                                 "e.g. model.summary((1, 28, 28)), or set model.input_shape")
        if print_fn is not None and not callable(print_fn):
            raise TypeError(f"summary: print_fn must be a callable or None, got {type(print_fn).__name__}")
        text = summary_table(self, input_shape)
        if print_fn is None:
            return text
        print_fn(text)
        return None

    # ------------------------------------------------------------------ training
    def fit(self, x, y=None, epochs: int = 1, batch_size: int = 32, optimizer=None, loss=None, **kwargs) -> History:
        """Train with mini-batch gradient descent; see :func:`parconv.training.fit`."""
        from .training import fit

        if self._quantized_layer():
            raise ValueError(f"fit: this model has int8 quantized layers ({self._quantized_layer()}), which run "
                             "inference only; train the float model and quantize it again with "
                             "parconv.quantization.quantize")

        return fit(self, x, y, epochs=epochs, batch_size=batch_size, optimizer=optimizer, loss=loss, **kwargs)

    def evaluate(self, x, y=None, batch_size: int = 256, loss=None) -> dict:
        """Mean loss and accuracy over ``(x, y)`` in eval mode; returns ``{"loss": float, "accuracy": float}``."""
        from .training import evaluate

        return evaluate(self, x, y, batch_size=batch_size, loss=loss)

    def predict(self, x, batch_size: int = 256) -> np.ndarray:
        """Model outputs for ``x`` in eval mode, as a host NumPy array (batched)."""
        from .training import predict

        return predict(self, x, batch_size=batch_size)


def _sample_shape(shape) -> tuple | None:
    """``input_shape`` checked: None, or one sample's shape ``(C, H, W)`` / ``(F,)`` of positive ints."""
    if shape is None:
        return None
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"Sequential: input_shape must be a tuple of ints such as (1, 28, 28), got {shape!r}")
    shape = tuple(shape)
    if len(shape) not in (1, 3) or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0
                                           for s in shape):
        raise ValueError(f"Sequential: input_shape must be one sample's shape without the batch dimension, "
                         f"(C, H, W) or (F,) of positive ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def load(path, backend=None) -> Sequential:
    """Load a model written by :meth:`Sequential.save` (architecture, weights and buffers).

    Raises ``ValueError`` naming the file when it is corrupt, truncated or
    inconsistent; nothing is unpickled.
    """
    import os

    path = os.fspath(path)
    config, state, _ = read_model_file(path)
    try:
        model = Sequential.from_config(config, backend=backend)
    except Exception as exc:  # layer constructors reject hostile configs with assorted exception types
        raise ValueError(f"{path!r}: invalid model description: {type(exc).__name__}: {exc}") from None
    try:
        model.load_state_dict(state)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path!r}: {exc}") from None
    return model
