"""The 2-D quadrants set of the MLP workload: XOR-like labels on the plane."""

from __future__ import annotations

import numpy as np

from .._validation import check_int


def quadrants(n: int, seed: int | None = 0, noise: float = 0.0):
    """``n`` points uniform in ``[-1, 1]^2``; label 1 in the first and third quadrants (``x0 * x1 > 0``).

    Returns ``(x, y)``: x (n, 2) float32, y (n, 1) float32 0/1 targets for
    ``BCELoss``. ``noise`` flips that fraction of labels at random.

    Examples
    --------
    >>> import parconv as pc
    >>> x, y = pc.datasets.quadrants(4, seed=0)
    >>> x.shape, y.shape
    ((4, 2), (4, 1))
    """
    n = check_int(n, "n", "quadrants", 1)
    noise = float(noise)
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"quadrants: noise must be in [0, 1], got {noise}")
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=(n, 2)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] > 0).astype(np.float32)
    if noise:
        flip = rng.random(n) < noise
        y[flip] = 1.0 - y[flip]
    return x, y[:, None]
