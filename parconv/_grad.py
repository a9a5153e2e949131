"""Gradient mode: whether forward passes keep what a backward pass needs (PyTorch's ``no_grad``).

Layers, fused steps and losses keep their activations in a ``_cache``
attribute; :class:`SavedForBackward` is that attribute. Under :class:`no_grad`
it stores a marker instead of the arrays, so inference holds no activations
and a backward pass after it fails with a clear error. The mode is
thread-local, as PyTorch's: ``no_grad`` in one thread leaves the others
training.

>>> import numpy as np, parconv as pc
>>> layer = pc.Linear(3, 2, backend="numpy")
>>> with pc.no_grad():
...     y = layer(np.ones((4, 3)))
...     pc.is_grad_enabled()
False
>>> pc.is_grad_enabled()
True
"""

from __future__ import annotations

import functools
import inspect
import threading

import numpy as np

__all__ = ["no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled"]


class _Mode(threading.local):
    enabled = True


_mode = _Mode()


def is_grad_enabled() -> bool:
    """True when forward passes in this thread keep what backward needs (the default)."""
    return _mode.enabled


def _set(enabled: bool) -> None:
    _mode.enabled = enabled


class _GradModeContext:
    """Base of the context managers: usable as ``with ctx:`` and as a function decorator.

    A decorated function runs each call under a fresh context, so it is
    reentrant and thread-safe; a decorated generator function switches the
    mode only while its body runs, not while the caller consumes its values.
    """

    def _clone(self) -> "_GradModeContext":
        return type(self)()

    def __call__(self, fn):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: can decorate a function, got {type(fn).__name__}")
        if inspect.isgeneratorfunction(fn):
            return self._wrap_generator(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self._clone():
                return fn(*args, **kwargs)

        return wrapper

    def _wrap_generator(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            gen = fn(*args, **kwargs)
            try:
                with self._clone():
                    response = gen.send(None)
                while True:
                    try:
                        request = yield response
                    except GeneratorExit:
                        with self._clone():
                            gen.close()
                        raise
                    except BaseException as exc:  # noqa: BLE001 - thrown into the generator, as the caller meant
                        with self._clone():
                            response = gen.throw(exc)
                    else:
                        with self._clone():
                            response = gen.send(request)
            except StopIteration as stop:
                return stop.value

        return wrapper


class no_grad(_GradModeContext):
    """Context manager (and decorator) under which forward passes keep nothing for backward.

    For inference: layers do not hold their inputs, masks or outputs, so
    memory is freed as the forward pass goes. A ``backward`` after a forward
    pass run under ``no_grad`` raises ``RuntimeError``. BatchNorm in training
    mode still updates its running statistics, as PyTorch's does. The mode is
    per thread; ``predict`` and ``evaluate`` run under it.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> model = pc.Sequential(pc.Linear(3, 2), backend="numpy")
    >>> with pc.no_grad():
    ...     model(np.ones((4, 3))).shape
    (4, 2)
    >>> @pc.no_grad()
    ... def infer(x):
    ...     return model(x)
    >>> infer(np.ones((1, 3))).shape
    (1, 2)
    """

    def __new__(cls, orig_func=None):
        # ``@pc.no_grad`` without parentheses decorates too, as in PyTorch
        self = super().__new__(cls)
        if orig_func is None:
            return self
        return self(orig_func)

    def __init__(self, orig_func=None):
        self._prev = []

    def __enter__(self):
        self._prev.append(_mode.enabled)
        _set(False)

    def __exit__(self, *exc):
        _set(self._prev.pop())
        return False


class enable_grad(no_grad):
    """Context manager (and decorator) that turns gradient mode back on, e.g. inside :class:`no_grad`.

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.no_grad():
    ...     with pc.enable_grad():
    ...         pc.is_grad_enabled()
    True
    """

    def __enter__(self):
        self._prev.append(_mode.enabled)
        _set(True)


class set_grad_enabled(_GradModeContext):
    """Turn gradient mode on or off: as a call (lasting), or as a context manager or decorator (restored after).

    Parameters
    ----------
    mode : bool

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.set_grad_enabled(False):
    ...     pc.is_grad_enabled()
    False
    >>> pc.is_grad_enabled()
    True
    >>> _ = pc.set_grad_enabled(False); pc.is_grad_enabled()
    False
    >>> _ = pc.set_grad_enabled(True)
    """

    def __init__(self, mode: bool):
        if not isinstance(mode, (bool, np.bool_)):
            raise TypeError(f"set_grad_enabled: mode must be a bool, got {type(mode).__name__} {mode!r}")
        self.mode = bool(mode)
        self._prev = [_mode.enabled]
        _set(self.mode)  # takes effect now, as a plain call; __exit__ restores it

    def _clone(self) -> "set_grad_enabled":
        return set_grad_enabled(self.mode)

    def __call__(self, fn):
        _set(self._prev[0])  # as a decorator, the mode applies only while the function runs
        return super().__call__(fn)

    def __enter__(self):
        if not self._prev:
            self._prev.append(_mode.enabled)
        _set(self.mode)

    def __exit__(self, *exc):
        _set(self._prev.pop() if self._prev else True)
        return False


#: what a forward pass under no_grad leaves in place of its activations
NOT_SAVED = type("_NotSaved", (), {"__repr__": lambda self: "<not saved: forward ran under parconv.no_grad()>"})()


class SavedForBackward:
    """The ``_cache`` attribute of layers, fused steps and losses.

    Reading it gives what the last forward pass stored (None before one);
    storing anything but None under :class:`no_grad` stores :data:`NOT_SAVED`.
    One descriptor instead of a check in every ``forward``, so new layers get
    the behaviour without writing it.
    """

    def __set_name__(self, owner, name):
        self.key = f"_{name}_value"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.key)

    def __set__(self, obj, value):
        if value is not None and not _mode.enabled:
            value = NOT_SAVED
        obj.__dict__[self.key] = value


def no_grad_error(who: str) -> RuntimeError:
    """The error of a backward pass after a forward pass that ran under no_grad."""
    return RuntimeError(f"{who}: backward after a forward pass run under parconv.no_grad(), which keeps nothing "
                        "for backward; run the forward pass with gradients enabled (outside no_grad)")
