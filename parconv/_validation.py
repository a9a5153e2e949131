"""Input checks shared by functional, layers, losses and optimizers.

Every public entry point validates here, once, so the kernels (bounds checks
off) only ever see well-formed, contiguous float32 / int32 arrays.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


class Where:
    """Names the caller in an error message: ``f"{Where(layer, '.backward')}"`` is
    ``repr(layer) + ".backward"``, formatted only when a message is built, so the
    checks on every call do not pay for the repr."""

    __slots__ = ("obj", "suffix")

    def __init__(self, obj, suffix: str = ""):
        self.obj, self.suffix = obj, suffix

    def __str__(self) -> str:
        return f"{self.obj!r}{self.suffix}"


def shape_of(a) -> tuple:
    if type(a) is np.ndarray:
        return a.shape  # already a tuple of Python ints
    return tuple(map(int, a.shape))


def to_backend_array(x, backend, name: str, where: str):
    """Convert array-like ``x`` to a float32 backend array, rejecting what cannot be data.

    Host data of any real numeric dtype is accepted and converted (float64,
    int, non-contiguous views); complex, string and object data raise
    ``TypeError``. An array already on ``backend`` must be float32.
    """
    if type(x) is np.ndarray:
        # the common case on host backends: already a C-contiguous float32 array, used as it is
        if x.dtype == np.float32 and backend.host_arrays and x.flags.c_contiguous:
            return x
    elif backend.is_array(x) and not isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise TypeError(f"{where}: {name} must be float32, got {x.dtype}")
        return x
    if not isinstance(x, np.ndarray):
        if hasattr(x, "get") and hasattr(x, "shape") and hasattr(x, "dtype"):
            raise TypeError(
                f"{where}: {name} is an array of another backend ({type(x).__name__}); "
                f"move it with parconv.to_numpy(...) or the model with .to({backend.name!r})"
            )
        try:
            x = np.asarray(x)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{where}: {name} must be a numeric array-like, could not convert: {exc}") from None
    kind = x.dtype.kind
    if kind == "c":
        raise TypeError(f"{where}: {name} must be real-valued, got complex dtype {x.dtype}")
    if kind not in "biuf":
        raise TypeError(f"{where}: {name} must be a numeric array, got dtype {x.dtype}")
    return backend.asarray(x, np.float32)


def to_host_labels(y, name: str, where: str) -> np.ndarray:
    """Integer labels as a host int64 array (rejects floats, strings, bools)."""
    if hasattr(y, "get") and not isinstance(y, np.ndarray):
        y = y.get()
    try:
        y = np.asarray(y)
    except Exception as exc:
        raise TypeError(f"{where}: {name} must be an array of integer labels: {exc}") from None
    if y.dtype.kind not in "iu":
        raise TypeError(f"{where}: {name} must hold integers, got dtype {y.dtype}")
    return y.astype(np.int64, copy=False)


def check_ndim(shape: tuple, ndim: int, name: str, where: str, layout: str) -> None:
    if len(shape) != ndim:
        hint = ""
        if name == "x" and layout == "(N, C, H, W)" and len(shape) == 3:
            # the two usual mistakes: one (C, H, W) image, or an (N, H, W) batch of grey images
            hint = (f" (one image of shape (C, H, W)? pass x[None] for shape {(1,) + tuple(shape)}; a batch of "
                    f"single-channel images (N, H, W)? pass x[:, None] for shape "
                    f"{(shape[0], 1) + tuple(shape[1:])})")
        elif name == "x" and layout == "(N, C, H, W)" and len(shape) == 2:
            hint = " (a flat (N, features) batch? a convolution needs images: reshape to (N, C, H, W))"
        raise ValueError(f"{where}: {name} must be {ndim}-D {layout}, got shape {shape}{hint}")


def check_nonempty(shape: tuple, name: str, where: str) -> None:
    if 0 in shape:
        raise ValueError(f"{where}: {name} must not have a zero-sized dimension, got shape {shape}")


def check_int(value, name: str, where: str, minimum: int) -> int:
    if type(value) is int and value >= minimum:  # the common case, without the ABC checks below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def check_float(value, name: str, where: str, minimum: float | None = None, maximum: float | None = None,
                min_inclusive: bool = True, max_inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be finite, got {value}")
    if minimum is not None and (value < minimum or (not min_inclusive and value == minimum)):
        rel = ">=" if min_inclusive else ">"
        raise ValueError(f"{where}: {name} must be {rel} {minimum}, got {value}")
    if maximum is not None and (value > maximum or (not max_inclusive and value == maximum)):
        rel = "<=" if max_inclusive else "<"
        raise ValueError(f"{where}: {name} must be {rel} {maximum}, got {value}")
    return value


def check_grad_shape(dy_shape: tuple, expected: tuple, where: str) -> None:
    if dy_shape != expected:
        raise ValueError(f"{where}: gradient dy must have the forward output's shape {expected}, got {dy_shape}")


def state_array(value, key: str, shape: tuple, where: str, what: str = "") -> np.ndarray:
    """One state-dict entry (NumPy array, array-like or torch tensor) checked against ``shape``.

    Returns a host array (not yet copied); ``what`` qualifies the expected shape in the message.
    """
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    value = np.asarray(value)
    if value.dtype.kind not in "biuf":
        raise TypeError(f"{where}: {key} must be a real numeric array, got dtype {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where}: {key} has shape {tuple(value.shape)}, expected {what}{tuple(shape)}")
    return value
