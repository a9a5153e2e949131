"""Datasets: MNIST (a real sample bundled), Fashion-MNIST, CIFAR-10, the IDX reader, and ``quadrants``.

Examples
--------
>>> import parconv as pc
>>> x, y = pc.datasets.load_mnist("test")
>>> x.shape, x.dtype, y[:5].tolist()
((10000, 1, 28, 28), dtype('float32'), [7, 2, 1, 0, 4])
"""

from .cifar10 import CIFAR10_CLASSES, CIFAR10_FILES, CIFAR10_URL, load_cifar10
from .fashion_mnist import FASHION_MNIST_CLASSES, FASHION_MNIST_FILES, load_fashion_mnist
from .idx import IDXError, read_idx
from .mnist import MNIST_FILES, load_mnist, sample_path
from .quadrants import quadrants

__all__ = ["load_mnist", "read_idx", "quadrants", "IDXError", "MNIST_FILES", "sample_path",
           "load_fashion_mnist", "FASHION_MNIST_FILES", "FASHION_MNIST_CLASSES",
           "load_cifar10", "CIFAR10_FILES", "CIFAR10_CLASSES", "CIFAR10_URL"]
