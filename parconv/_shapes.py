"""The one output-size formula of convolution and pooling, and argument normalisation.

Every module that needs the size of a convolved or pooled axis (functional,
the backends, the fused paths) calls :func:`out_size`, so the formula lives in
one place. The normalisers turn the int-or-pair arguments of the public API
into the tuples the backends take, naming the argument in their errors.
"""

from __future__ import annotations

import numbers


def out_size(size: int, k: int, stride: int = 1, pad_lo: int = 0, pad_hi: int | None = None,
             dilation: int = 1) -> int:
    """Output length of one axis: ``(size + pad_lo + pad_hi - dilation (k - 1) - 1) // stride + 1``.

    ``pad_hi`` defaults to ``pad_lo`` (symmetric padding). Floor mode, as PyTorch's default.
    """
    if pad_hi is None:
        pad_hi = pad_lo
    return (size + pad_lo + pad_hi - dilation * (k - 1) - 1) // stride + 1


#: the largest kernel size, stride, padding or dilation accepted: beyond it the kernels' index arithmetic
#: overflows, and no image is that large
MAX_GEOMETRY = 1 << 16


def check_geometry(items: tuple, value, name: str, where) -> None:
    """Raise ``ValueError`` when an entry of ``items`` is above :data:`MAX_GEOMETRY`."""
    if max(items) > MAX_GEOMETRY:
        raise ValueError(f"{where}: {name} must be <= {MAX_GEOMETRY} (larger values overflow the kernels' index "
                         f"arithmetic and no image is that large), got {value!r}")


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def pair(value, name: str, where, minimum: int) -> tuple:
    """``value`` (an int or a pair of ints, each ``>= minimum``) as ``(h, w)``."""
    if _is_int(value):
        items = (int(value), int(value))
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        items = (int(value[0]), int(value[1]))
    else:
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r} "
                        f"(a pair of ints (h, w) is accepted too)")
    if min(items) < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value!r}")
    check_geometry(items, value, name, where)
    return items


def conv_pads(padding, kernel: tuple, dilation: tuple, stride: tuple, where) -> tuple:
    """``padding`` (int, ``(h, w)``, ``"same"`` or ``"valid"``) as ``(top, bottom, left, right)``.

    ``"same"`` needs stride 1 and pads ``d (k - 1)`` in all, the odd element on the
    bottom/right, as PyTorch does.
    """
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(f"{where}: padding='same' needs stride 1, got stride {stride}")
            th, tw = dilation[0] * (kernel[0] - 1), dilation[1] * (kernel[1] - 1)
            return (th // 2, th - th // 2, tw // 2, tw - tw // 2)
        raise ValueError(f"{where}: padding must be an int, a pair (h, w), 'same' or 'valid', got {padding!r}")
    ph, pw = pair(padding, "padding", where, 0)
    return (ph, ph, pw, pw)
