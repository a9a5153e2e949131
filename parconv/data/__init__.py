"""The data pipeline: :class:`DataLoader` and batch-wise augmentation (:mod:`parconv.data.transforms`).

Examples
--------
>>> import numpy as np
>>> import parconv as pc
>>> from parconv.data import transforms as T
>>> x = np.random.default_rng(0).random((100, 3, 32, 32), dtype=np.float32)
>>> y = np.arange(100) % 10
>>> loader = pc.data.DataLoader(x, y, batch_size=32, seed=0,
...                             transform=T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]))
>>> [xb.shape[0] for xb, yb in loader]
[32, 32, 32, 4]
"""

from . import transforms
from .loader import DataLoader

__all__ = ["DataLoader", "transforms"]
