"""Process-wide settings: the default backend and the OpenMP thread count."""

from __future__ import annotations

import contextlib
import os
import threading

_lock = threading.Lock()
_default_backend: str | None = None
_num_threads: int | None = None


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
