"""Loss functions. ``loss_fn(pred, target)`` returns a Python float and caches
what ``loss_fn.backward()`` needs to return the gradient w.r.t. ``pred``.
"""

from __future__ import annotations

import numpy as np

from . import backends as _backends
from . import functional as F
from ._grad import NOT_SAVED, SavedForBackward, no_grad_error
from ._validation import check_float, check_ndim, check_nonempty, shape_of, to_backend_array

__all__ = ["Loss", "SoftmaxCrossEntropy", "CrossEntropyLoss", "BCELoss", "MSELoss"]


class Loss:
    """Base class: ``__call__(pred, target) -> float``, ``backward() -> dpred``."""

    _cache = SavedForBackward()

    def __init__(self):
        self._cache = None

    def __call__(self, pred, target) -> float:
        return self.forward(pred, target)

    def _cached(self):
        cache = self._cache
        if cache is None:
            raise ValueError(f"{type(self).__name__}.backward called before the loss was computed")
        if cache is NOT_SAVED:
            raise no_grad_error(f"{type(self).__name__}.backward")
        return cache

    def prepare_target(self, target, n: int, backend):
        """Validate targets on the host and move them to ``backend`` (used by ``fit``)."""
        raise NotImplementedError

    def count_correct(self, pred, target_b) -> int:
        """Correctly classified samples of a batch (target already prepared)."""
        raise NotImplementedError

    def config(self) -> dict:
        return {}

    def __repr__(self):
        return f"{type(self).__name__}()"


class SoftmaxCrossEntropy(Loss):
    """Softmax + cross-entropy on (N, classes) logits and (N,) integer labels, mean over the batch.

    ``label_smoothing`` s in [0, 1] trains against ``(1 - s) onehot + s / classes``
    instead of the one-hot target (PyTorch's ``CrossEntropyLoss(label_smoothing=s)``).

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> loss_fn = pc.SoftmaxCrossEntropy()
    >>> round(loss_fn(np.zeros((2, 4)), [0, 3]), 4)   # log(4)
    1.3863
    >>> loss_fn.backward().shape
    (2, 4)
    """

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.label_smoothing = F._check_label_smoothing(label_smoothing, "SoftmaxCrossEntropy")

    def config(self):
        return {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}

    def __repr__(self):
        return f"SoftmaxCrossEntropy(label_smoothing={self.label_smoothing})" if self.label_smoothing \
            else "SoftmaxCrossEntropy()"

    def forward(self, logits, labels, backend=None) -> float:
        be = _backends.get(backend) if backend is not None else _infer_backend(logits)
        where = "SoftmaxCrossEntropy"
        logits = to_backend_array(logits, be, "logits", where)
        check_ndim(shape_of(logits), 2, "logits", where, "(N, classes)")
        check_nonempty(shape_of(logits), "logits", where)
        y = self._labels_for(labels, logits, be)
        if self.label_smoothing:
            loss, probs = be.softmax_cross_entropy_smoothed_forward(logits, y, self.label_smoothing)
        else:
            loss, probs = be.softmax_cross_entropy_forward(logits, y)
        self._cache = (be, probs, y)
        return loss

    def prepare_target(self, labels, n, backend, n_classes=None):
        """Validate labels on the host and move them to ``backend`` as int32.

        Without ``n_classes`` the upper bound is checked later, in
        :meth:`forward`, against the logits' width (from the host maximum
        recorded here, so no transfer is needed).
        """
        backend = _backends.get(backend)
        where = "SoftmaxCrossEntropy"
        if backend.is_array(labels) and not isinstance(labels, np.ndarray):
            labels = backend.to_numpy(labels)  # device labels from elsewhere: validate them on the host
        y = F._check_labels(labels, n, n_classes if n_classes is not None else np.iinfo(np.int32).max, where)
        y_b = backend.asarray(y, np.int32)
        self._prepared = (y_b, int(y.max()) if y.size else -1)
        return y_b

    def _labels_for(self, labels, logits, be):
        n, n_classes = logits.shape
        prepared = getattr(self, "_prepared", None)
        if prepared is not None and labels is prepared[0]:
            if shape_of(labels) != (n,):
                raise ValueError(f"SoftmaxCrossEntropy: got {shape_of(labels)[0]} labels for a batch of {n} logits")
            if prepared[1] >= n_classes:
                raise ValueError(f"SoftmaxCrossEntropy: labels must be in [0, {n_classes}), found {prepared[1]}")
            return labels
        return self.prepare_target(labels, n, be, n_classes=n_classes)

    def backward(self):
        """Gradient w.r.t. the logits, ``(softmax - target) / N``."""
        be, probs, y = self._cached()
        if self.label_smoothing:
            return be.softmax_cross_entropy_smoothed_backward(probs, y, self.label_smoothing)
        return be.softmax_cross_entropy_backward(probs, y)

    def count_correct(self, logits, labels_b) -> int:
        return _infer_backend(logits).count_correct(logits, labels_b)


#: PyTorch's name for :class:`SoftmaxCrossEntropy` (the same class: logits and integer labels, mean over the
#: batch, ``label_smoothing``)
CrossEntropyLoss = SoftmaxCrossEntropy


class BCELoss(Loss):
    """Binary cross-entropy of probabilities (e.g. after ``Sigmoid``) and 0/1 targets of the same shape.

    ``eps`` clips the probabilities to ``[eps, 1 - eps]`` so the log stays finite.
    """

    def __init__(self, eps: float = F.BCE_EPS):
        super().__init__()
        self.eps = check_float(eps, "eps", "BCELoss", 0.0, 0.5, min_inclusive=False, max_inclusive=False)

    def config(self):
        return {"eps": self.eps}

    def forward(self, p, targets, backend=None) -> float:
        be = _backends.get(backend) if backend is not None else _infer_backend(p)
        p = to_backend_array(p, be, "probabilities", "BCELoss")
        check_nonempty(shape_of(p), "probabilities", "BCELoss")
        t = self.prepare_target(targets, shape_of(p), be)
        loss = be.bce_forward(p, t, self.eps)
        self._cache = (be, p, t)
        return loss

    def prepare_target(self, targets, shape, backend):
        backend = _backends.get(backend)
        shape = None if shape is None else tuple(shape)
        if backend.is_array(targets) and not isinstance(targets, np.ndarray):
            t = targets
        else:
            t_host = np.asarray(targets)
            if t_host.dtype.kind not in "biuf":
                raise TypeError(f"BCELoss: targets must be numeric 0/1 values, got dtype {t_host.dtype}")
            if t_host.size and (t_host.min() < 0 or t_host.max() > 1):
                raise ValueError(f"BCELoss: targets must lie in [0, 1], got values in [{t_host.min()}, {t_host.max()}]")
            t = backend.asarray(t_host, np.float32)
        if shape is not None and shape_of(t) != shape:
            raise ValueError(f"BCELoss: targets shape {shape_of(t)} must equal the probabilities' shape {shape}")
        return t

    def backward(self):
        """Gradient w.r.t. the probabilities."""
        be, p, t = self._cached()
        return be.bce_backward(p, t, self.eps)

    def count_correct(self, p, t_b) -> int:
        be = _infer_backend(p)
        pred = be.to_numpy(p) > 0.5
        return int((pred == (be.to_numpy(t_b) > 0.5)).all(axis=tuple(range(1, pred.ndim))).sum())


class MSELoss(Loss):
    """Mean squared error over every element of predictions and targets of the same shape.

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> loss_fn = pc.MSELoss()
    >>> loss_fn(np.array([[1.0, 2.0]]), np.array([[1.0, 4.0]]))
    2.0
    >>> pc.to_numpy(loss_fn.backward()).tolist()   # 2 (pred - target) / numel
    [[0.0, -2.0]]
    """

    #: regression: ``fit`` and ``evaluate`` report no accuracy for it
    reports_accuracy = False

    def forward(self, pred, target, backend=None) -> float:
        be = _backends.get(backend) if backend is not None else _infer_backend(pred)
        pred = to_backend_array(pred, be, "pred", "MSELoss")
        check_nonempty(shape_of(pred), "pred", "MSELoss")
        t = self.prepare_target(target, shape_of(pred), be)
        loss = be.mse_forward(pred, t)
        self._cache = (be, pred, t)
        return loss

    def prepare_target(self, target, shape, backend):
        """Validate real-valued targets and move them to ``backend`` as float32."""
        backend = _backends.get(backend)
        t = to_backend_array(target, backend, "target", "MSELoss")
        if shape is not None and shape_of(t) != tuple(shape):
            raise ValueError(f"MSELoss: target shape {shape_of(t)} must equal the predictions' shape {tuple(shape)}")
        return t

    def backward(self):
        """Gradient w.r.t. the predictions, ``2 (pred - target) / numel``."""
        be, pred, t = self._cached()
        return be.mse_backward(pred, t)

    def count_correct(self, pred, target_b) -> int:
        """Regression has no correct samples to count: always 0 (accuracy is not reported for it)."""
        return 0


def _infer_backend(a):
    """The loaded backend whose array type ``a`` is; host data goes to the default backend."""
    from .backends import _instances

    if not isinstance(a, np.ndarray):
        for be in list(_instances.values()):
            if not be.host_arrays and be.is_array(a):
                return be
    return _backends.get(None) if not isinstance(a, np.ndarray) else _host_backend()


def _host_backend():
    default = _backends.get(None)
    return default if default.host_arrays else _backends.get("numpy")
