"""Batch-wise data augmentation on (N, C, H, W) float32 arrays.

The protocol
------------
A transform is a callable ``t(x, rng=None) -> x`` on a whole batch. Random
transforms draw from ``rng`` (a :class:`numpy.random.Generator`) when one is
given, which is how :class:`~parconv.data.DataLoader` makes every batch's
augmentation depend only on ``(seed, epoch, batch index)``; called as
``t(x)`` they draw from their own generator, seeded by ``seed=`` or, when
that is ``None``, from :func:`parconv.manual_seed`'s generator on the first
such call (so building a transform does not disturb the global generator). Every transform works on the whole batch at once (fancy
indexing, strided views), never image by image, and returns a new array:
the input is not modified.

Examples
--------
>>> import numpy as np
>>> from parconv.data import transforms as T
>>> augment = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
...                      T.Normalize(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])])
>>> x = np.full((8, 3, 32, 32), 0.5, np.float32)
>>> y = augment(x, rng=np.random.default_rng(0))
>>> y.shape, y.dtype, float(y.max()), float(y.min())
((8, 3, 32, 32), dtype('float32'), 0.0, -2.0)
"""

from __future__ import annotations

import numbers

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..layers import _rng as _global_rng

__all__ = ["Transform", "Compose", "Normalize", "RandomCrop", "RandomHorizontalFlip"]


def _batch(x, where: str, ndim: int | None = 4) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{where}: x must be a NumPy array batch, got {type(x).__name__}")
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{where}: x must be a numeric array, got dtype {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{where}: x must be a 4-D (N, C, H, W) batch, got shape {x.shape}")
    if ndim is None and x.ndim < 2:
        raise ValueError(f"{where}: x must be a batch (N, C, ...) with a channel axis, got shape {x.shape}")
    return x


def _pair(value, name: str, where: str, minimum: int) -> tuple:
    items = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(items) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in items):
        raise TypeError(f"{where}: {name} must be an int or a pair (h, w) of ints, got {value!r}")
    if any(v < minimum for v in items):
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value!r}")
    return int(items[0]), int(items[1])


class Transform:
    """Base class: a batch transform drawing from ``rng`` or its own generator.

    Subclasses implement ``apply(x, rng)``; ``__call__`` picks the generator.

    Parameters
    ----------
    seed : int, optional
        Seed of the generator used when no ``rng`` is passed; ``None`` draws
        one from the global generator (:func:`parconv.manual_seed`) the first
        time it is needed.
    """

    random = True  #: whether the transform draws random numbers

    def __init__(self, seed: int | None = None):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
            raise ValueError(f"{type(self).__name__}: seed must be an int >= 0 or None, got {seed!r}")
        self.seed = seed
        self._rng = None

    @property
    def rng(self) -> np.random.Generator:
        """The transform's own generator (created on first use)."""
        if self._rng is None:
            seed = self.seed if self.seed is not None else _global_rng(None).integers(2**63)
            self._rng = np.random.default_rng(seed)
        return self._rng

    def __call__(self, x, rng: np.random.Generator | None = None) -> np.ndarray:
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise TypeError(f"{type(self).__name__}: rng must be a numpy.random.Generator or None, "
                            f"got {type(rng).__name__}")
        if rng is None and self.random:
            rng = self.rng
        return self.apply(x, rng)

    def apply(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Transform batch ``x`` drawing from ``rng``; returns a new array."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply(x, rng)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Compose(Transform):
    """Apply transforms one after the other, all drawing from the same generator.

    Parameters
    ----------
    transforms : list
        :class:`Transform` objects, or plain callables ``f(x) -> x`` (those get
        no generator).
    """

    def __init__(self, transforms):
        super().__init__()
        if isinstance(transforms, Transform) or not hasattr(transforms, "__iter__"):
            raise TypeError(f"Compose: transforms must be a list of transforms, got {type(transforms).__name__}")
        self.transforms = list(transforms)
        for i, t in enumerate(self.transforms):
            if not callable(t):
                raise TypeError(f"Compose: transforms[{i}] must be callable, got {type(t).__name__}")
        self.random = any(getattr(t, "random", True) for t in self.transforms)

    def __call__(self, x, rng: np.random.Generator | None = None) -> np.ndarray:
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise TypeError(f"Compose: rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
        for t in self.transforms:
            x = t(x, rng) if isinstance(t, Transform) else t(x)
        return x

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(map(repr, self.transforms)) + "])"


class Normalize(Transform):
    """``(x - mean[c]) / std[c]`` for each channel ``c`` of a (N, C, ...) batch.

    Parameters
    ----------
    mean, std : float or sequence of C floats
        Per-channel statistics (a scalar applies to every channel);
        ``std`` > 0.

    Returns
    -------
    ndarray, float32, the shape of ``x``
    """

    random = False

    def __init__(self, mean, std):
        super().__init__()
        self.mean = self._vector(mean, "mean")
        self.std = self._vector(std, "std")
        if self.mean.size != self.std.size and 1 not in (self.mean.size, self.std.size):
            raise ValueError(f"Normalize: mean and std must have the same length, got {self.mean.size} "
                             f"and {self.std.size}")
        if np.any(self.std <= 0):
            raise ValueError(f"Normalize: std must be > 0, got {self.std.tolist()}")

    @staticmethod
    def _vector(value, name: str) -> np.ndarray:
        try:
            v = np.asarray(value, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise TypeError(f"Normalize: {name} must be a number or a sequence of numbers, got {value!r}") from None
        if v.size == 0 or not np.all(np.isfinite(v)):
            raise ValueError(f"Normalize: {name} must be finite and non-empty, got {value!r}")
        return v.astype(np.float32)

    def apply(self, x, rng=None):
        x = _batch(x, "Normalize", ndim=None)
        c = x.shape[1]
        for name, v in (("mean", self.mean), ("std", self.std)):
            if v.size not in (1, c):
                raise ValueError(f"Normalize: {name} has {v.size} values but x has {c} channels (shape {x.shape})")
        shape = (1, -1) + (1,) * (x.ndim - 2)
        out = np.subtract(x, self.mean.reshape(shape), dtype=np.float32)
        out /= self.std.reshape(shape)
        return out

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()})"


class RandomCrop(Transform):
    """Crop each image at a random position, after zero-padding its borders.

    Offsets are drawn as ``rng.integers(0, H + 2 * ph - h + 1, size=N)`` for
    the rows, then the same for the columns, one pair per image.

    Parameters
    ----------
    size : int or (h, w)
        Output height and width.
    padding : int or (ph, pw), default 0
        Zeros added on each side (top and bottom ``ph``, left and right ``pw``).
    seed : int, optional
        See :class:`Transform`.

    Returns
    -------
    ndarray (N, C, h, w) float32
    """

    def __init__(self, size, padding=0, seed: int | None = None):
        super().__init__(seed)
        self.size = _pair(size, "size", "RandomCrop", 1)
        self.padding = _pair(padding, "padding", "RandomCrop", 0)

    def apply(self, x, rng):
        x = _batch(x, "RandomCrop")
        n, c, height, width = x.shape
        (h, w), (ph, pw) = self.size, self.padding
        if h > height + 2 * ph or w > width + 2 * pw:
            raise ValueError(f"RandomCrop: size {self.size} is larger than the padded image "
                             f"({height + 2 * ph}, {width + 2 * pw}) of x with shape {x.shape}")
        top = rng.integers(0, height + 2 * ph - h + 1, size=n)
        left = rng.integers(0, width + 2 * pw - w + 1, size=n)
        if ph or pw:
            padded = np.zeros((n, c, height + 2 * ph, width + 2 * pw), np.float32)
            padded[:, :, ph:ph + height, pw:pw + width] = x
        else:
            padded = x
        # windows[i, :, r, s] is the (C, h, w) crop at offset (r, s) of image i: one gather, no copy of the windows
        windows = sliding_window_view(padded, (h, w), axis=(2, 3))
        return np.ascontiguousarray(windows[np.arange(n), :, top, left], dtype=np.float32)

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding})"


class RandomHorizontalFlip(Transform):
    """Mirror each image left-right with probability ``p``.

    One draw per image: ``rng.random(N) < p``.

    Parameters
    ----------
    p : float in [0, 1], default 0.5
    seed : int, optional
        See :class:`Transform`.

    Returns
    -------
    ndarray (N, C, H, W) float32
    """

    def __init__(self, p: float = 0.5, seed: int | None = None):
        super().__init__(seed)
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)

    def apply(self, x, rng):
        x = _batch(x, "RandomHorizontalFlip")
        flip = rng.random(x.shape[0]) < self.p
        out = np.array(x, dtype=np.float32, order="C", copy=True)
        out[flip] = x[flip, :, :, ::-1]
        return out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"
