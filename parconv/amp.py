"""Mixed precision: convolution and linear layers in bfloat16 (PyTorch's ``torch.autocast``).

Inside ``with pc.autocast("bf16"):`` every convolution (square and general,
depthwise and grouped included) and every linear layer, forward and backward,
rounds its inputs to bfloat16 (round to nearest, ties to even; NaN stays NaN)
and accumulates the products in float32; the bias is added in float32. Master
weights, gradients as stored, optimizer state, BatchNorm statistics, softmax
and the losses stay float32. A layer's backward runs in the precision its
forward ran in, whether ``backward`` is called inside the block or after it.

Where the CPU has AVX512_BF16 the openmp backend runs native bf16 dot products
(``vdpbf16ps``); elsewhere (and on the other backends) the same rounding is
emulated: inputs rounded to bf16, then the float32 direct kernels (never
Winograd, whose transforms lose more bits than bf16 keeps). :func:`bf16_support`
says which one this process runs, and why.

The mode is thread-local, as PyTorch's.

>>> import numpy as np, parconv as pc
>>> layer = pc.Linear(3, 2, backend="numpy")
>>> with pc.autocast("bf16"):
...     y = layer(np.ones((4, 3)))
...     pc.is_autocast_enabled()
True
>>> pc.is_autocast_enabled()
False
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from ._grad import _GradModeContext

__all__ = ["autocast", "is_autocast_enabled", "get_autocast_dtype", "bf16_support", "round_to_bf16"]

#: names :class:`autocast` and ``fit(precision=...)`` accept for bfloat16
_BF16_NAMES = ("bf16", "bfloat16")
#: the values of ``precision`` arguments (``fit``, the functional ops)
PRECISIONS = ("fp32", "bf16")


class _Mode(threading.local):
    enabled = False


_mode = _Mode()


def is_autocast_enabled() -> bool:
    """True inside ``autocast("bf16")`` in this thread (False by default and under ``enabled=False``)."""
    return _mode.enabled


def get_autocast_dtype() -> str:
    """The reduced precision :class:`autocast` runs in: ``"bf16"`` (the only one on CPUs, as PyTorch's default)."""
    return "bf16"


def current_precision() -> str:
    """``"bf16"`` inside an enabled :class:`autocast` block in this thread, else ``"fp32"``."""
    return "bf16" if _mode.enabled else "fp32"


def check_precision(precision, name: str = "precision", where: str = "parconv") -> str:
    """``precision`` as ``"fp32"`` or ``"bf16"`` ("float32"/"bfloat16" accepted); ValueError/TypeError otherwise."""
    if not isinstance(precision, str):
        raise TypeError(f"{where}: {name} must be a string, 'fp32' or 'bf16', got {type(precision).__name__} "
                        f"{precision!r}")
    value = precision.strip().lower()
    if value in ("fp32", "float32"):
        return "fp32"
    if value in _BF16_NAMES:
        return "bf16"
    raise ValueError(f"{where}: {name} must be 'fp32' or 'bf16', got {precision!r}")


def resolve_precision(precision, where: str) -> str:
    """The precision an op runs in: ``precision`` when given, else the autocast mode of this thread."""
    if precision is None:
        return current_precision()
    return check_precision(precision, "precision", where)


class autocast(_GradModeContext):
    """Run convolution and linear layers in bfloat16 with float32 accumulation inside a ``with`` block.

    parconv's counterpart of ``torch.autocast("cpu", dtype=torch.bfloat16)``:
    usable as a context manager and as a decorator, nestable (an inner
    ``autocast(enabled=False)`` returns to float32), thread-local, and the
    previous mode is restored when the block exits, also by an exception.

    Parameters
    ----------
    dtype : {"bf16", "bfloat16"}, default "bf16"
        The reduced precision; bfloat16 is the one CPUs run (PyTorch's CPU default).
    enabled : bool, default True
        False runs the block in float32 (to exclude a region from an outer block).

    Notes
    -----
    What runs in bf16: ``conv2d`` (every stride, padding, dilation and group count)
    and ``linear``, forward and backward, and the fused steps built on them. What
    stays float32: the weights and their gradients as stored, optimizer state,
    BatchNorm (statistics and normalisation), activations, pooling, softmax and the
    losses. A layer records the precision of its forward pass with its saved
    activations, so its backward matches it wherever ``backward`` is called.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> model = pc.Sequential(pc.Linear(3, 2), backend="numpy")
    >>> with pc.autocast("bf16"):
    ...     y = model(np.ones((4, 3)))
    ...     with pc.autocast(enabled=False):
    ...         pc.is_autocast_enabled()
    False
    >>> @pc.autocast("bf16")
    ... def infer(x):
    ...     return model(x)
    >>> infer(np.ones((1, 3))).shape
    (1, 2)
    """

    def __init__(self, dtype="bf16", enabled: bool = True):
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        if not isinstance(dtype, str):
            raise TypeError(f"autocast: dtype must be a string such as 'bf16', got {type(dtype).__name__} "
                            f"{dtype!r}")
        if dtype.strip().lower() not in _BF16_NAMES:
            hint = {"fp16": " (float16 has no fast CPU path; use 'bf16')",
                    "cpu": " (parconv's autocast takes the dtype, not torch.autocast's device_type: "
                           "pc.autocast('bf16'))"}.get(dtype.strip().lower().replace("float16", "fp16")
                                                       .replace("half", "fp16"), "")
            raise ValueError(f"autocast: dtype must be 'bf16' (or 'bfloat16'), got {dtype!r}{hint}; "
                             "autocast(enabled=False) runs a block in float32")
        self.dtype = "bf16"
        self.enabled = bool(enabled)
        self._prev = []

    def _clone(self) -> "autocast":
        return autocast(self.dtype, self.enabled)

    def __enter__(self):
        if self.enabled and not _checked_speed:
            _warn_if_slow()
        self._prev.append(_mode.enabled)
        _mode.enabled = self.enabled
        return self

    def __exit__(self, *exc):
        _mode.enabled = self._prev.pop()
        return False

    def __repr__(self) -> str:
        return f"autocast(dtype={self.dtype!r}, enabled={self.enabled})"


# ------------------------------------------------------------------ rounding
def round_to_bf16_numpy(x) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as float32 with the low 16 bits zero.

    The NumPy model of the kernels' rounding: every backend's bf16 ops and the
    tests are checked against it.
    """
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    with np.errstate(over="ignore"):
        r = (u + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
    nan = np.isnan(a)
    if nan.any():
        # truncating a NaN whose payload sits in the low bits would make it infinite: keep it quiet NaN
        r[nan] = (u[nan] & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
    return r.view(np.float32)


def round_to_bf16(x) -> np.ndarray:
    """Host array-like -> float32 NumPy array of ``x`` rounded to bfloat16 (RNE, NaN stays NaN).

    Uses the compiled ``_bf16.round_to_bf16`` where it is built, else the NumPy
    model (:func:`round_to_bf16_numpy`); both give the same bits.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> pc.amp.round_to_bf16(np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8], np.float32)).tolist()
    [1.0, 1.0, 1.015625]
    """
    from . import backends
    from ._validation import to_backend_array

    a = np.ascontiguousarray(to_backend_array(x, backends.get("numpy"), "x", "round_to_bf16"))
    kernel = _compiled_round()
    if kernel is None or a.size == 0:
        return round_to_bf16_numpy(a)
    out = np.empty_like(a)
    from ._config import get_num_threads

    kernel(a.reshape(-1), out.reshape(-1), get_num_threads())
    return out


def _bf16_module():
    try:
        from ._ext import _bf16
    except Exception:  # noqa: BLE001 - no compiled kernels, or PARCONV_ISA names a level this CPU lacks
        return None
    return _bf16


def _compiled_round():
    module = _bf16_module()
    return getattr(module, "round_to_bf16", None) if module is not None else None


def _amx_bf16() -> bool:
    """Whether the native bf16 products run on AMX tiles in this process."""
    module = _bf16_module()
    try:
        return bool(module is not None and module.amx())
    except Exception:  # noqa: BLE001 - a build without the tiles
        return False


def native_bf16() -> bool:
    """Whether the openmp backend runs native AVX512_BF16 kernels in this process."""
    module = _bf16_module()
    if module is None:
        return False
    try:
        return bool(module.native())
    except Exception:  # noqa: BLE001 - a placeholder build
        return False


#: below this ratio of VDPBF16PS's multiply-adds per second to an FMA's, bf16 convolutions lose to
#: float32 Winograd (a quarter or 4/9 of the multiplies) and a bf16 training step runs slower
SLOW_DOT_RATE = 1.5
_rate: list = []  # the probe's result, measured once per process


def _dot_rate():
    """VDPBF16PS over FMA multiply-adds per second on this core (``_bf16.dot_rate_vs_fma``), or None."""
    if not _rate:
        module = _bf16_module()
        try:
            _rate.append(module.dot_rate_vs_fma() if module is not None else None)
        except Exception:  # a build without the probe
            _rate.append(None)
    return _rate[0]


_checked_speed = False


def _warn_if_slow() -> None:
    """Once per process: a UserWarning where this CPU's bf16 products are no faster than float32's."""
    global _checked_speed
    _checked_speed = True
    info = bf16_support()
    if info.get("mode") == "native" and not info.get("faster_than_fp32", True):
        warnings.warn(f"autocast('bf16'): {info['why']} (parconv.amp.bf16_support(); `parconv info`)",
                      UserWarning, stacklevel=3)


def bf16_support() -> dict:
    """How bf16 convolution and linear run here: ``{"mode": "native"|"emulated", "why": str, ...}``.

    ``native``: the openmp backend's kernels use AVX512_BF16 (``vdpbf16ps``), or
    AMX-BF16's tiles (``tdpbf16ps``) where the CPU has them (``amx`` True).
    ``emulated``: inputs are rounded to bf16 and the float32 direct kernels
    compute (the same results to accumulation order; no speed-up). ``why`` says
    what decided it: the CPU's flags, the kernel level chosen (``PARCONV_ISA``),
    or the build. In native mode without AMX ``dot_rate`` is VDPBF16PS's multiply-adds per
    second over an FMA's, measured once per process, and
    ``faster_than_fp32`` is False where that rate is under
    :data:`SLOW_DOT_RATE`: such a core gains nothing from bf16 products and
    loses float32's Winograd, so bf16 training runs slower there.

    Examples
    --------
    >>> import parconv as pc
    >>> pc.amp.bf16_support()["mode"] in ("native", "emulated")
    True
    """
    from . import _ext

    state = getattr(_ext, "STATE", {})
    features = state.get("features", {}) or {}
    cpu = bool(features.get("avx512_bf16"))
    level = state.get("level")
    module = _bf16_module()
    info = {"cpu_avx512_bf16": cpu, "kernel_level": level,
            "compiled_rounding": _compiled_round() is not None}
    if native_bf16():
        if _amx_bf16():
            why = (f"the CPU has AMX-BF16 and the {level} kernels run every bf16 product on its tiles "
                   f"(TDPBF16PS, 16x the multiply-adds of a VDPBF16PS per instruction)")
            info.update(mode="native", why=why, amx=True, dot_rate=None, faster_than_fp32=True)
            return info
        rate = _dot_rate()
        why = f"the CPU has AVX512_BF16 and the {level} kernels use it"
        if rate is not None:
            why += f"; VDPBF16PS does {rate:.1f}x the multiply-adds per second of an FMA here"
            if rate < SLOW_DOT_RATE:
                why += (" (2x where the core issues both at one rate): at this rate bf16 training runs slower "
                        "than float32, whose 3x3 convolutions are Winograd; train in fp32 on this CPU")
        info.update(mode="native", why=why, amx=False, dot_rate=rate,
                    faster_than_fp32=rate is None or rate >= SLOW_DOT_RATE)
        return info
    info.update(mode="emulated", amx=False)
    if module is None:
        why = "no compiled kernels are loaded"
    elif not cpu:
        why = "this CPU has no AVX512_BF16"
    elif level != "avx512":
        why = (f"the {level} kernel level runs (the bf16 instructions are in the avx512 level only"
               f"{'; PARCONV_ISA=' + str(state.get('requested')) if state.get('requested') else ''})")
    else:
        why = "this build's avx512 kernels have no AVX512_BF16 path"
    info["why"] = why
    return info
