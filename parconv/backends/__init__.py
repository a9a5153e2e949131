"""Backend registry.

A backend is one object implementing :class:`parconv.backends.base.Backend`,
found by name. Built-ins are imported lazily on first use; third-party
backends plug in through the ``parconv.backends`` entry-point group, whose
entries point at a factory (a class or a callable returning a backend)::

    [project.entry-points."parconv.backends"]
    mybackend = "mypackage.backend:MyBackend"

Examples
--------
>>> import parconv as pc
>>> "numpy" in pc.available_backends()
True
>>> pc.backends.get("numpy").name
'numpy'
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Callable

from .base import Backend

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "register",
    "get",
    "available",
    "registered",
]


class BackendUnavailableError(RuntimeError):
    """A registered backend cannot be loaded here (missing package, no device, ...)."""


# name -> factory (callable or "module:attr" string), install hint
_factories: dict[str, Callable[[], Backend] | str] = {}
_hints: dict[str, str] = {}
_instances: dict[str, Backend] = {}
_failures: dict[str, str] = {}
_entry_points_loaded = False
_lock = threading.RLock()

_BUILTINS = {
    "numpy": ("parconv.backends.numpy_ref:NumpyBackend", "always available"),
    "openmp": (
        "parconv.backends.openmp:OpenMPBackend",
        "reinstall parconv with a C compiler (pip install --force-reinstall --no-binary parconv parconv)",
    ),
    "opencl": (
        "parconv.backends.opencl:OpenCLBackend",
        'pip install "parconv[opencl]" (pyopencl + the PoCL CPU driver), or install your GPU vendor\'s OpenCL driver',
    ),
}


def register(name: str, factory: Callable[[], Backend] | str, *, install_hint: str = "") -> None:
    """Register a backend factory under ``name``.

    Parameters
    ----------
    name : str
        The name users pass to ``set_backend`` / ``backend=``.
    factory : callable or str
        Called with no arguments on first use; returns a :class:`Backend`.
        A ``"module:attr"`` string is imported lazily.
    install_hint : str, optional
        Shown when the backend cannot be loaded.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory must be a callable or a 'module:attr' string, got {factory!r}")
    with _lock:
        _factories[name] = factory
        _hints[name] = install_hint
        _instances.pop(name, None)
        _failures.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="parconv.backends"):
        if ep.name not in _factories:
            _factories[ep.name] = ep.value
            _hints[ep.name] = f"provided by the '{ep.value.split(':')[0]}' package"


def _ensure_builtins() -> None:
    for name, (path, hint) in _BUILTINS.items():
        _factories.setdefault(name, path)
        _hints.setdefault(name, hint)
    _load_entry_points()


def registered() -> list[str]:
    """Every registered backend name, loadable here or not."""
    with _lock:
        _ensure_builtins()
        return list(_factories)


def _instantiate(name: str) -> Backend:
    factory = _factories[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    backend = factory()
    if not isinstance(backend, Backend):
        raise TypeError(f"backend factory for {name!r} returned {type(backend).__name__}, not a parconv Backend")
    return backend


def get(name: str | Backend | None = None) -> Backend:
    """Return the backend called ``name`` (``None``: the process default).

    ``"cpu"`` is the default CPU backend, as in PyTorch's ``model.to("cpu")``:
    ``openmp`` where its kernels built, else ``numpy``.

    Raises
    ------
    ValueError
        If no backend of that name is registered.
    BackendUnavailableError
        If it is registered but cannot be loaded here; the message says why
        and how to install it.
    """
    if isinstance(name, Backend):
        return name
    if name is None:
        from .._config import get_default_backend_name

        name = get_default_backend_name()
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str name, a Backend or None, got {type(name).__name__}")
    if name == "cpu" and "cpu" not in _factories:
        name = _best_cpu_backend()
    with _lock:
        backend = _instances.get(name)
        if backend is not None:
            return backend
        _ensure_builtins()
        if name not in _factories:
            raise ValueError(
                f"unknown backend {name!r}; registered backends: {sorted(_factories)} "
                f"(available here: {available()})"
            )
        if name in _failures:
            raise BackendUnavailableError(_failures[name])
        try:
            backend = _instantiate(name)
        except Exception as exc:  # noqa: BLE001 - reported with context below
            msg = (
                f"backend {name!r} is not available: {type(exc).__name__}: {exc}. "
                f"To install it: {_hints.get(name) or 'see its documentation'}. "
                f"Available backends: {available()}"
            )
            _failures[name] = msg
            raise BackendUnavailableError(msg) from exc
        _instances[name] = backend
        return backend


def available() -> list[str]:
    """Names of the backends that load on this machine, in registration order."""
    with _lock:
        _ensure_builtins()
        names = []
        for name in list(_factories):
            if name in _instances:
                names.append(name)
                continue
            if name in _failures:
                continue
            try:
                get(name)
            except Exception:  # noqa: BLE001 - recorded in _failures
                continue
            names.append(name)
        return names


def why_unavailable(name: str) -> str | None:
    """The reason ``name`` failed to load, or ``None`` when it loads."""
    try:
        get(name)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


def _best_cpu_backend() -> str:
    """Default backend: the OpenMP one when it built, else NumPy."""
    try:
        get("openmp")
        return "openmp"
    except Exception:  # noqa: BLE001
        if os.environ.get("PARCONV_ISA", "").strip():
            raise  # kernels asked for by name: falling back to NumPy would hide the mistake
        return "numpy"
