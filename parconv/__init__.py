"""parconv: convolutional and fully connected networks, fast on every CPU core,
on any OpenCL device, and over MPI.

>>> import parconv as pc
>>> "numpy" in pc.available_backends()
True
"""

import numpy as _np

# loads libgomp now, with parconv's wait policy, before a library imported after parconv (torch
# shares the same libgomp.so.1) can load it with spinning idle threads
from . import _ext as _ext  # noqa: E402,F401

__version__ = "0.1.0"

from . import backends, datasets, functional, optim  # noqa: E402
from . import callbacks, data  # noqa: E402
from ._config import conv_precision, get_conv_precision, set_conv_precision  # noqa: E402
from ._config import get_num_threads, num_threads, set_backend, set_num_threads  # noqa: E402
from ._grad import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402
from . import amp  # noqa: E402
from .amp import autocast, get_autocast_dtype, is_autocast_enabled  # noqa: E402
from .backends import available as available_backends  # noqa: E402
from .layers import *  # noqa: E402,F403  (every layer, by layers.__all__)
from .layers import Layer, Parameter, manual_seed  # noqa: E402
from . import layers as _layers  # noqa: E402
from .losses import BCELoss, CrossEntropyLoss, MSELoss, SoftmaxCrossEntropy  # noqa: E402
from .model import History, Sequential, TrainingDivergedError, load  # noqa: E402
from . import models  # noqa: E402  (the zoo builds on Sequential)
from . import quantization  # noqa: E402  (its layers register for pc.load and onnx)
from ._buildinfo import show_config  # noqa: E402
from ._weights import weights_changed  # noqa: E402


def get_backend():
    """The process default backend object."""
    return backends.get(None)


def to_numpy(a) -> _np.ndarray:
    """Host NumPy copy (or view) of an array of any loaded backend.

    >>> import numpy as np, parconv as pc
    >>> pc.to_numpy(np.arange(3.0)).tolist()
    [0.0, 1.0, 2.0]
    """
    if isinstance(a, _np.ndarray):
        return a
    for be in list(backends._instances.values()):
        if be.is_array(a):
            return _np.asarray(be.to_numpy(a))
    if hasattr(a, "get"):
        return _np.asarray(a.get())
    return _np.asarray(a)


def __getattr__(name):
    # parconv.distributed needs mpi4py and parconv.onnx the onnx package: imported on first use only
    if name in ("distributed", "onnx"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'parconv' has no attribute {name!r}")


__all__ = [
    "__version__",
    "available_backends",
    "set_backend",
    "get_backend",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "no_grad",
    "enable_grad",
    "set_grad_enabled",
    "is_grad_enabled",
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "amp",
    "set_conv_precision",
    "get_conv_precision",
    "conv_precision",
    "to_numpy",
    "show_config",
    "weights_changed",
    "Sequential",
    "History",
    "load",
    "TrainingDivergedError",
    "SoftmaxCrossEntropy",
    "CrossEntropyLoss",
    "BCELoss",
    "MSELoss",
    "functional",
    "optim",
    "datasets",
    "backends",
    "distributed",
    "onnx",
    "callbacks",
    "data",
    "quantization",
]
__all__ += [name for name in _layers.__all__ if name not in __all__]
