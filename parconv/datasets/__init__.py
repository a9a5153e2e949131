"""Datasets: the IDX (MNIST) reader with a bundled real MNIST sample, and ``quadrants``.

Examples
--------
>>> import parconv as pc
>>> x, y = pc.datasets.load_mnist("test")
>>> x.shape, x.dtype, y[:5].tolist()
((10000, 1, 28, 28), dtype('float32'), [7, 2, 1, 0, 4])
"""

from .idx import IDXError, read_idx
from .mnist import MNIST_FILES, load_mnist, sample_path
from .quadrants import quadrants

__all__ = ["load_mnist", "read_idx", "quadrants", "IDXError", "MNIST_FILES", "sample_path"]
