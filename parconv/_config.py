"""Process-wide settings: the default backend, the OpenMP thread count and the convolution precision."""

from __future__ import annotations

import contextlib
import os
import threading

_lock = threading.Lock()
_default_backend: str | None = None
_num_threads: int | None = None
_conv_precision: str = "high"

#: the values of :func:`set_conv_precision`, most accurate first
CONV_PRECISIONS = ("highest", "high", "medium")


_cores: int | None = None  # the cores this process may run on, read once (see _cpu_count)


def _cpu_count() -> int:
    """Cores this process may run on (its affinity mask on Linux).

    Read once and kept: the default thread count is asked for on every op,
    and the affinity system call cost more than a small op's Python. A fork's
    child and ``set_num_threads(None)`` read it again.
    """
    global _cores
    n = _cores
    if n is None:
        try:
            n = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            n = max(1, os.cpu_count() or 1)
        _cores = n
    return n


def _forget_cores() -> None:
    global _cores
    _cores = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_cores)


def _threads_from_env() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS")
    if not value:
        return None
    value = value.split(",")[0].strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def _check_threads(n, name: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, (int,)) and not hasattr(n, "__index__"):
        raise TypeError(f"{name} must be a positive int or None, got {type(n).__name__} {n!r}")
    n = int(n.__index__())
    if n < 1:
        raise ValueError(f"{name} must be a positive int or None, got {n}")
    return n


def set_num_threads(n: int | None) -> None:
    """Set the number of threads the CPU backends use.

    Parameters
    ----------
    n : int or None
        A positive thread count, or ``None`` to go back to the default:
        ``OMP_NUM_THREADS`` when it is set, else every core this process may
        run on (read again by this call, e.g. after ``os.sched_setaffinity``).

    Raises
    ------
    TypeError, ValueError
        If ``n`` is not a positive integer or ``None``.
    """
    global _num_threads
    value = None if n is None else _check_threads(n)
    if value is None:
        _forget_cores()
    with _lock:
        _num_threads = value


def get_num_threads() -> int:
    """Return the thread count the CPU backends use for the next call."""
    n = _num_threads
    if n is not None:
        return n
    return _threads_from_env() or _cpu_count()


@contextlib.contextmanager
def num_threads(n: int | None):
    """Context manager that sets the thread count inside a ``with`` block.

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.num_threads(1):
    ...     pc.get_num_threads()
    1
    """
    global _num_threads
    value = None if n is None else _check_threads(n)
    previous = _num_threads
    with _lock:
        _num_threads = value
    try:
        yield
    finally:
        with _lock:
            _num_threads = previous


def _check_precision(precision, name: str = "precision") -> str:
    if not isinstance(precision, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, CONV_PRECISIONS))}, "
                        f"got {type(precision).__name__} {precision!r}")
    if precision not in CONV_PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, CONV_PRECISIONS))}, got {precision!r}")
    return precision


def set_conv_precision(precision: str) -> None:
    """Choose how accurately the CPU backend computes 3x3 stride-1 convolutions.

    parconv's counterpart of ``torch.set_float32_matmul_precision``: faster
    algorithms round more, and the setting says how much rounding is acceptable.
    It applies to the ``openmp`` backend (the ``numpy`` reference and the
    ``opencl`` kernels always sum directly) and is read at every call.

    Parameters
    ----------
    precision : {"highest", "high", "medium"}
        ``"highest"``: direct summation everywhere, the results of the direct
        kernels (no Winograd). ``"high"`` (the default): Winograd F(2x2, 3x3) or
        direct summation in the forward, F(4x4, 3x3) only for the gradients dx
        and dw, whose error (a few times float32 rounding) reaches no ReLU's
        decision. ``"medium"``: F(4x4, 3x3) in the forward as well, the
        fastest; its forward error (up to 8e-6 of a layer's largest output)
        flips ReLUs whose input lies that close to zero, and BatchNorm in training mode can turn one
        flip into a gradient error of 1e-2 (see the docs' "Convolution
        precision" section for the measured errors).

    Raises
    ------
    TypeError
        If ``precision`` is not a string.
    ValueError
        If it is not one of the values above.
    """
    global _conv_precision
    value = _check_precision(precision)
    with _lock:
        _conv_precision = value


def get_conv_precision() -> str:
    """Return the convolution precision the CPU backend uses for the next call
    (``"highest"``, ``"high"`` or ``"medium"``; see :func:`set_conv_precision`)."""
    return _conv_precision


@contextlib.contextmanager
def conv_precision(precision: str):
    """Context manager that sets the convolution precision inside a ``with`` block
    (see :func:`set_conv_precision`).

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.conv_precision("highest"):
    ...     pc.get_conv_precision()
    'highest'
    >>> pc.get_conv_precision()
    'high'
    """
    global _conv_precision
    value = _check_precision(precision)
    previous = _conv_precision
    with _lock:
        _conv_precision = value
    try:
        yield
    finally:
        with _lock:
            _conv_precision = previous


def get_default_backend_name() -> str:
    """Name of the process default backend (``set_backend`` > ``PARCONV_BACKEND`` > best CPU)."""
    if _default_backend is not None:
        return _default_backend
    env = os.environ.get("PARCONV_BACKEND", "").strip()
    if env:
        return env
    from .backends import _best_cpu_backend

    return _best_cpu_backend()


def set_backend(name: str | None) -> None:
    """Set the process default backend by name (``None`` restores the default).

    The backend is loaded immediately, so an unknown or unavailable name fails
    here rather than at the first layer.
    """
    global _default_backend
    if name is None:
        _default_backend = None
        return
    from .backends import get

    backend = get(name)
    _default_backend = backend.name
