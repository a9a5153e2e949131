"""The training loop: ``fit``, ``evaluate``, ``predict`` and ``summary`` for any model.

The loop drives a model through its public methods (``forward``, ``backward``,
``parameters``, ``state_dict``, ``train``/``eval``). Data-parallel training
plugs in as a *gradient reducer*: an object that shards each batch, sums
statistics and gradients over ranks and guards collectives (see
:class:`parconv.distributed.DataParallel`). This module never imports MPI;
``parconv.distributed`` registers its reducer factory when imported.
"""

from __future__ import annotations

import importlib
import math
import time
import warnings

import numpy as np

from ._grad import is_grad_enabled, no_grad
from .amp import autocast, check_precision, current_precision
from ._validation import check_int, to_host_labels
from .losses import Loss, SoftmaxCrossEntropy

__all__ = ["fit", "evaluate", "predict", "History", "TrainingDivergedError", "register_reducer_factory",
           "summary_table"]

#: chunk of rows checked for NaN/Inf at a time (memmaps are read piecewise)
_FINITE_CHUNK = 1 << 14


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite during ``fit``; the model holds the last good weights."""


class History:
    """What ``fit`` returns: ``history[metric]`` is a list with one value per epoch.

    Metrics: ``loss``, ``accuracy``, ``val_loss``, ``val_accuracy`` (when
    validation data was given), ``lr``, ``time`` (seconds) and ``samples_per_s``.
    """

    def __init__(self):
        self.history: dict[str, list] = {}
        self.epochs: list[int] = []

    def append(self, epoch: int, **metrics) -> None:
        self.epochs.append(epoch)
        for k, v in metrics.items():
            self.history.setdefault(k, []).append(v)

    def __getitem__(self, key):
        return self.history[key]

    def __contains__(self, key) -> bool:
        return key in self.history

    def __len__(self) -> int:
        return len(self.epochs)

    def __repr__(self):
        last = {k: round(v[-1], 4) for k, v in self.history.items() if v}
        return f"History(epochs={len(self.epochs)}, last={last})"


# ------------------------------------------------------------------ reducers
_REDUCER_FACTORIES: list = []


def register_reducer_factory(factory) -> None:
    """Register ``factory(model, distributed) -> reducer or None``, consulted by ``fit(distributed=...)``."""
    if not callable(factory):
        raise TypeError(f"register_reducer_factory: factory must be callable, got {type(factory).__name__}")
    if factory not in _REDUCER_FACTORIES:
        _REDUCER_FACTORIES.append(factory)


def _reducer(model, distributed):
    """The gradient reducer ``fit(distributed=...)`` asks for (None when serial)."""
    if distributed is None or distributed is False:
        return None
    if not _REDUCER_FACTORIES:
        importlib.import_module("parconv.distributed")  # registers its factory (needs mpi4py)
    for factory in _REDUCER_FACTORIES:
        reducer = factory(model, distributed)
        if reducer is not None:
            return reducer
    raise TypeError(f"fit: distributed must be True, an MPI communicator or a DataParallel, "
                    f"got {type(distributed).__name__}")


# ------------------------------------------------------------------ data checks
def as_host_float(x, name: str, where: str) -> np.ndarray:
    """Validate a dataset once on the host (numeric, real) and return a float32 array."""
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{where}: {name} must be a numeric array-like: {exc}") from None
    if arr.dtype.kind == "c":
        raise TypeError(f"{where}: {name} must be real-valued, got complex dtype {arr.dtype}")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{where}: {name} must be numeric, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise ValueError(f"{where}: {name} must have a batch dimension and features, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{where}: {name} is empty (shape {arr.shape})")
    if isinstance(arr, np.memmap) and arr.dtype == np.float32:
        return arr  # batches are read from the file as they are needed
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_finite(x: np.ndarray, name: str, where: str) -> None:
    """Raise ``ValueError`` naming ``name`` and the first sample holding NaN or Inf (chunked: memmaps work)."""
    if x.dtype.kind != "f":
        return
    for start in range(0, x.shape[0], _FINITE_CHUNK):
        chunk = np.asarray(x[start:start + _FINITE_CHUNK])
        if not np.isfinite(chunk).all():
            bad = np.argwhere(~np.isfinite(chunk))[0]
            index = (start + int(bad[0]),) + tuple(int(i) for i in bad[1:])
            raise ValueError(f"{where}: {name} holds {chunk[tuple(bad)]} at index {index}; every input must be "
                             "finite (drop or impute those samples)")


def check_model_input(model, shape: tuple, name: str, where: str) -> None:
    """Check that ``model`` accepts inputs of ``shape`` (the whole array's) before any batch runs.

    The layers' own checks would report one batch's shape; this names the array the caller passed and
    the layer (by index) that refuses it. Layers without shape arithmetic are checked when they run.
    """
    from .layers import Layer

    layers = getattr(model, "layers", None)
    steps = list(enumerate(layers)) if isinstance(layers, (list, tuple)) else [(None, model)]
    s = tuple(shape)
    for i, layer in steps:
        output_shape = getattr(layer, "output_shape", None)
        if output_shape is None or (getattr(type(layer), "output_shape", None) is Layer.output_shape
                                    and not type(layer).__module__.startswith("parconv.")):
            return  # a user's layer that may change the shape without saying how: the rest is checked as it runs
        try:
            s = tuple(output_shape(s))
        except ValueError as exc:
            at = f"layer {i}: " if i is not None else ""
            raise ValueError(f"{where}: {name} of shape {tuple(shape)} does not fit the model: {at}{exc}") from None
        except Exception:  # noqa: BLE001 - a custom layer without shape arithmetic: checked when it runs
            return


def _warn_if_unscaled(x: np.ndarray, original_dtype, name: str, where: str) -> None:
    sample = np.asarray(x[:256])
    peak = float(np.abs(sample).max()) if sample.size else 0.0
    if original_dtype == np.uint8 or peak > 100.0:
        warnings.warn(f"{where}: {name} looks unscaled (largest magnitude {peak:g} in the first samples"
                      f"{', dtype uint8' if original_dtype == np.uint8 else ''}); divide images by 255 or "
                      "normalise the inputs, or the loss may blow up", UserWarning, stacklevel=4)


def host_targets(y, n: int, loss, name: str, where: str):
    """Targets checked against the loss: int labels (N,) for softmax cross-entropy, rows of ``n`` otherwise."""
    if y is None:
        raise TypeError(f"{where}: {name} is missing: pass the targets with the inputs ({name}=labels of shape "
                        f"({n},)), or a DataLoader that yields (x, y) batches")
    if isinstance(loss, SoftmaxCrossEntropy):
        y = to_host_labels(y, name, where)
        if y.ndim != 1 or y.shape[0] != n:
            raise ValueError(f"{where}: {name} must be (N,) = ({n},) integer labels, got shape {y.shape}")
        if y.size and y.min() < 0:
            raise ValueError(f"{where}: {name} must be non-negative class indices, found {int(y.min())}")
        return y
    y = np.asarray(y)
    if y.shape[:1] != (n,):
        raise ValueError(f"{where}: {name} must have {n} rows like x, got shape {y.shape}")
    return y


def _prepare_target(loss, y_host, be):
    if isinstance(loss, SoftmaxCrossEntropy):
        return loss.prepare_target(y_host, len(y_host), be)
    return loss.prepare_target(y_host, None, be)


def _is_loader(x) -> bool:
    return hasattr(x, "epoch") and hasattr(x, "__len__") and hasattr(x, "batch_size") and not hasattr(x, "shape")


# ------------------------------------------------------------------ evaluation
class _eval_mode:
    """Run a block in eval mode and restore each layer's previous mode."""

    def __init__(self, model, training: bool = False):
        self.model, self.mode = model, training

    def __enter__(self):
        self.saved = [(m, m.training) for m in self.model.modules()]
        self.model.train(self.mode)
        return self.model

    def __exit__(self, *exc):
        for m, mode in self.saved:
            m.training = mode
        return False


@no_grad()  # inference: the layers keep no activations
def evaluate_host(model, x, y, loss, batch_size: int) -> dict:
    """Mean loss and accuracy over host arrays (the model's current mode)."""
    be = model.backend
    total, correct = 0.0, 0
    for start in range(0, x.shape[0], batch_size):
        xb = be.asarray(x[start:start + batch_size])
        yb_host = y[start:start + batch_size]
        yb = _prepare_target(loss, yb_host, be)
        out = model.forward(xb)
        total += loss.forward(out, yb, backend=be) * len(yb_host)
        correct += loss.count_correct(out, yb)
    _release(model)
    return _metrics(loss, total / x.shape[0], correct / x.shape[0])


@no_grad()
def _evaluate_loader(model, loader, loss) -> dict:
    be = model.backend
    total, correct, n = 0.0, 0, 0
    for xb, yb_host in loader.epoch(0):
        yb_host = host_targets(yb_host, len(xb), loss, "y", "evaluate")
        check_finite(np.asarray(xb), "a DataLoader batch", "evaluate")
        yb = _prepare_target(loss, yb_host, be)
        out = model.forward(be.asarray(xb))
        total += loss.forward(out, yb, backend=be) * len(yb_host)
        correct += loss.count_correct(out, yb)
        n += len(yb_host)
    _release(model)
    return _metrics(loss, total / max(n, 1), correct / max(n, 1))


def _metrics(loss, mean_loss: float, accuracy: float) -> dict:
    """``{"loss", "accuracy"}``, without accuracy for a regression loss (MSE)."""
    if getattr(loss, "reports_accuracy", True):
        return {"loss": mean_loss, "accuracy": accuracy}
    return {"loss": mean_loss}


def _release(model) -> None:
    release = getattr(model, "release_caches", None)
    if release is not None:
        release()


def evaluate(model, x, y=None, batch_size: int = 256, loss: Loss | None = None) -> dict:
    """Mean loss and accuracy over ``(x, y)`` (or a DataLoader ``x``) in eval mode.

    Returns ``{"loss": float, "accuracy": float}`` (no accuracy for ``MSELoss``); the model's mode is
    restored.
    """
    where = f"{type(model).__name__}.evaluate"
    batch_size = check_int(batch_size, "batch_size", where, 1)
    loss = SoftmaxCrossEntropy() if loss is None else loss
    with _eval_mode(model):
        if _is_loader(x):
            return _evaluate_loader(model, x, loss)
        x = as_host_float(x, "x", where)
        y = host_targets(y, x.shape[0], loss, "y", where)
        check_finite(x, "x", where)
        check_model_input(model, x.shape, "x", where)
        return evaluate_host(model, x, y, loss, batch_size)


def predict(model, x, batch_size: int = 256) -> np.ndarray:
    """Model outputs for ``x`` in eval mode, as a host NumPy array (batched); the mode is restored."""
    where = f"{type(model).__name__}.predict"
    batch_size = check_int(batch_size, "batch_size", where, 1)
    x = as_host_float(x, "x", where)
    check_finite(x, "x", where)
    check_model_input(model, x.shape, "x", where)
    be = model.backend
    with _eval_mode(model), no_grad():
        outs = [be.to_numpy(model.forward(be.asarray(x[s:s + batch_size]))) for s in range(0, x.shape[0], batch_size)]
        _release(model)
    return np.concatenate([np.asarray(o) for o in outs])


# ------------------------------------------------------------------ summary
def summary_table(model, input_shape) -> str:
    """The text of ``model.summary(input_shape)``: one row per layer (nested ones indented)."""
    if isinstance(input_shape, (str, bytes)) or not hasattr(input_shape, "__iter__"):
        raise TypeError(f"summary: input_shape must be a tuple of ints such as (1, 28, 28), got {input_shape!r}")
    shape = tuple(input_shape)
    if not shape or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"summary: input_shape must hold positive ints, e.g. (1, 28, 28) for one sample or "
                         f"(N, 1, 28, 28) for a batch, got {input_shape!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) in (1, 3):  # one sample: add a batch of 1
        shape = (1,) + shape
    rows: list[tuple] = []

    def walk(layer, name, depth, in_shape):
        out = tuple(layer.output_shape(in_shape))
        own = sum(getattr(layer, n).size for n in layer.param_names if getattr(layer, n) is not None)
        kids = layer.children()
        macs = 0 if kids else int(layer.macs(in_shape))
        rows.append(("  " * depth + f"{name} {type(layer).__name__}", out, own, macs, bool(kids)))
        if kids:
            if type(layer).__name__ == "Residual":
                for child_name, child in kids:
                    walk(child, child_name, depth + 1, in_shape)
                rows.append(("  " * (depth + 1) + "+ add", out, 0, math.prod(out), False))
            else:
                s = in_shape
                for child_name, child in kids:
                    walk(child, child_name, depth + 1, s)
                    s = tuple(child.output_shape(s))
        return out

    out = in_shape = shape
    for i, layer in enumerate(model.layers):
        out = walk(layer, str(i), 0, in_shape)
        in_shape = out
    total_params = model.num_parameters()
    total_macs = sum(r[3] for r in rows)
    head = ("layer", "output shape", "params", "mult-adds")
    body = [(r[0], str(r[1]), f"{r[2]:,}" if r[2] or not r[4] else "", f"{r[3]:,}" if r[3] else "") for r in rows]
    widths = [max(len(head[c]), *(len(b[c]) for b in body)) for c in range(4)]
    line = "-" * (sum(widths) + 6)
    fmt = lambda r: f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"  # noqa: E731
    text = [fmt(head), line, *(fmt(b) for b in body), line,
            f"input {shape}, output {out}",
            f"parameters: {total_params:,} ({total_params * 4 / 2**20:.2f} MiB as float32)",
            f"forward multiply-adds: {total_macs:,} for a batch of {shape[0]}"]
    return "\n".join(text)


# ------------------------------------------------------------------ fit
def _progress_bar_class():
    from tqdm.auto import tqdm

    return tqdm


def _batches(n, batch_size, order):
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def _check_optimizer_params(model, optimizer, where: str) -> None:
    mine = {id(p) for p in model.parameters()}
    theirs = [p for p in optimizer.params]
    if theirs and not any(id(p) in mine for p in theirs):
        raise ValueError(f"{where}: the optimizer updates none of this model's parameters (it was built over "
                         "another model's); create it with optimizer(model.parameters(), ...)")


def fit(model, x, y=None, epochs: int = 1, batch_size: int = 32, optimizer=None, loss: Loss | None = None,
        validation_data=None, shuffle: bool = True, seed: int | None = None, verbose: bool = True,
        callbacks=None, scheduler=None, distributed=False, checkpoint=None, checkpoint_every: int | None = None,
        resume=None, precision: str | None = None) -> History:
    """Train ``model`` with mini-batch gradient descent, in training mode.

    Parameters
    ----------
    x : array-like (N, ...) or DataLoader
        Inputs, converted to float32 once (a float32 memmap is read batch by
        batch). A :class:`parconv.data.DataLoader` brings its own targets,
        batches, shuffling and transforms (``y``, ``batch_size``, ``shuffle``
        and ``seed`` are then ignored).
    y : array-like
        Targets: integer labels (N,) for ``SoftmaxCrossEntropy``, arrays shaped
        like the output for ``BCELoss``/``MSELoss``.
    epochs, batch_size : int
        ``epochs`` counts from the start of training, also when resuming.
        With ``distributed``, ``batch_size`` is the global batch.
    optimizer : Optimizer, optional
        Default ``SGD(lr=0.1)``; it must update this model's parameters.
    loss : Loss, optional
        Default ``SoftmaxCrossEntropy()``.
    validation_data : (x_val, y_val) or DataLoader, optional
        Evaluated in eval mode after every epoch.
    shuffle : bool, default True
    seed : int, optional
        Seed of the shuffling order (reproducible runs).
    verbose : bool, default True
        Show a progress bar and one line per epoch (rank 0 only when distributed).
    callbacks : list, optional
        Objects with any of ``on_train_begin(model)``, ``on_batch_end(step, logs)``,
        ``on_epoch_end(epoch, logs)``, ``on_train_end(history)``
        (:mod:`parconv.callbacks`), or plain callables ``cb(epoch, logs)``. A
        callback that sets ``model.stop_training = True`` ends training after
        the current epoch; the History of the epochs run is returned.
    scheduler : learning-rate scheduler, optional
        From :mod:`parconv.optim.lr_scheduler`: stepped after every batch
        (``OneCycleLR``), after every epoch with the monitored metric
        (``ReduceLROnPlateau``: ``val_loss`` when there is validation data,
        else ``loss``), or after every epoch (the others).
    distributed : bool, communicator or DataParallel, default False
        Train data-parallel over MPI (:class:`parconv.distributed.DataParallel`;
        ``True`` means ``COMM_WORLD``). Every rank passes the same full
        ``x, y``; each epoch's shuffled order is the same on every rank
        (rank 0's seed) and each rank trains on its contiguous share of
        every global batch, so the run follows the serial one. The training
        arguments are compared over ranks first. Metrics are averaged over
        ranks; only rank 0 shows progress and writes checkpoints.
    checkpoint : path, optional
        Write a training checkpoint (weights, buffers, optimizer and scheduler
        state, epoch, step, shuffling-generator state) here atomically after
        every epoch and every ``checkpoint_every`` steps.
    checkpoint_every : int, optional
        Steps between checkpoints within an epoch (needs ``checkpoint``).
    resume : path, optional
        Continue from a training checkpoint: the run then finishes with
        the same weights as one that was never stopped. The data,
        ``batch_size`` and ``shuffle`` must be those of the original run.
    precision : {"fp32", "bf16"}, optional
        ``"bf16"`` trains (and validates) under :class:`parconv.autocast`:
        convolution and linear layers in bf16 with float32 accumulation, the
        weights, optimizer state, BatchNorm statistics and loss in float32.
        ``"fp32"`` runs float32 even inside an autocast block; None (the default)
        follows the autocast mode of the calling thread.

    Returns
    -------
    History
        Also holds the epochs before a resume.

    Raises
    ------
    TrainingDivergedError
        When the loss becomes NaN or infinite; the model is left with the
        weights of the last step that gave a finite loss.
    """
    from .optim import SGD, Optimizer

    where = f"{type(model).__name__}.fit"
    if distributed is not None and distributed is not False and not _REDUCER_FACTORIES:
        # start MPI and its abort hook before the checks below: a bad input on one rank must end the job
        importlib.import_module("parconv.distributed")
    if not is_grad_enabled():
        raise RuntimeError(f"{where}: called under parconv.no_grad(), where forward passes keep nothing for "
                           "backward; call fit outside the no_grad block")
    epochs = check_int(epochs, "epochs", where, 1)
    if precision is not None:
        precision = check_precision(precision, "precision", where)
    loader = x if _is_loader(x) else None
    if loader is None:
        batch_size = check_int(batch_size, "batch_size", where, 1)
    loss = SoftmaxCrossEntropy() if loss is None else loss
    if not isinstance(loss, Loss):
        raise TypeError(f"{where}: loss must be a parconv loss, got {type(loss).__name__}")
    optimizer = SGD(model.parameters(), lr=0.1) if optimizer is None else optimizer
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{where}: optimizer must be a parconv optimizer, got {type(optimizer).__name__}")
    _check_optimizer_params(model, optimizer, where)
    if scheduler is not None and (not hasattr(scheduler, "step") or getattr(scheduler, "optimizer", optimizer)
                                  is not optimizer):
        raise ValueError(f"{where}: scheduler must be a learning-rate scheduler of this fit's optimizer")
    if checkpoint_every is not None:
        checkpoint_every = check_int(checkpoint_every, "checkpoint_every", where, 1)
        if checkpoint is None:
            raise ValueError(f"{where}: checkpoint_every={checkpoint_every} needs checkpoint=PATH")
    if loader is None:
        original_dtype = getattr(x, "dtype", None)
        x = as_host_float(x, "x", where)
        check_finite(x, "x", where)
        check_model_input(model, x.shape, "x", where)
        _warn_if_unscaled(x, original_dtype, "x", where)
        y = host_targets(y, x.shape[0], loss, "y", where)
    xv = yv = None
    if validation_data is not None:
        if _is_loader(validation_data):
            xv = validation_data
        else:
            if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
                raise TypeError(f"{where}: validation_data must be a pair (x_val, y_val) or a DataLoader")
            xv = as_host_float(validation_data[0], "validation x", where)
            check_finite(xv, "validation x", where)
            yv = host_targets(validation_data[1], xv.shape[0], loss, "validation y", where)
    if checkpoint is not None and (distributed is None or distributed is False):
        from ._io import check_writable_target

        # a read-only or unusable directory fails now, not after an epoch (distributed: rank 0 writes,
        # and the command line checks there)
        check_writable_target(checkpoint)
    from ._fitguard import verify_for_fit

    dp = _reducer(model, distributed)
    # a device that computes wrong results must fail (or switch to a configuration that is right) here,
    # not train to chance accuracy: every op of this run at its batch sizes, once per device, model and sizes
    verify_for_fit(model, x, loader, batch_size if loader is None else loader.batch_size, loss, xv, dp)
    run = _FitRun(model, x, y, loader, xv, yv, epochs, batch_size, optimizer, loss, shuffle, seed, verbose,
                  callbacks, scheduler, dp, checkpoint, checkpoint_every, resume)
    run.precision = precision if precision is not None else current_precision()
    with _eval_mode(model, training=True), autocast(enabled=run.precision == "bf16"):
        if dp is None:
            return run()
        # any failure on one rank must end every rank (the others would wait in a collective);
        # a diverged loss is seen by all ranks at the same step and propagates normally
        with dp._guard("fit", passthrough=(TrainingDivergedError, getattr(dp, "argument_error", ValueError))):
            dp.check_same_arguments(run.arguments(), where)
            return run()


class _FitRun:
    """One call of :func:`fit`: the loop and the state it carries between epochs."""

    #: "fp32" or "bf16": what the loop runs under (fit sets it; every rank must agree)
    precision = "fp32"

    def __init__(self, model, x, y, loader, xv, yv, epochs, batch_size, optimizer, loss, shuffle, seed, verbose,
                 callbacks, scheduler, dp, checkpoint, checkpoint_every, resume):
        from .callbacks import CallbackList

        self.model, self.x, self.y, self.loader = model, x, y, loader
        self.xv, self.yv = xv, yv
        self.epochs, self.optimizer, self.loss = epochs, optimizer, loss
        self.batch_size = loader.batch_size if loader is not None else batch_size
        self.shuffle, self.seed, self.verbose = shuffle, seed, verbose
        self.callbacks = CallbackList(callbacks)
        self.scheduler, self.dp = scheduler, dp
        self.checkpoint, self.checkpoint_every, self.resume = checkpoint, checkpoint_every, resume
        replicas = getattr(loader, "num_replicas", None)
        if replicas is not None and (dp is None or (replicas, loader.rank) != (dp.size, dp.rank)):
            where = f"{type(model).__name__}.fit"
            have = "a serial fit" if dp is None else f"rank {dp.rank} of {dp.size}"
            raise ValueError(f"{where}: the DataLoader is sharded as rank {loader.rank} of {replicas} ranks but "
                             f"this is {have}; leave num_replicas and rank out (a distributed fit shards the "
                             "loader over its ranks)")
        #: each rank reads only its share of a loader's batches
        self.sharded = (dp is not None and dp.size > 1 and loader is not None
                        and getattr(loader, "num_samples", None) is not None and hasattr(loader, "_shard_epoch"))

    def arguments(self) -> dict:
        """What every rank of a distributed fit must agree on."""
        n = self.loader.num_samples if self.loader is not None else self.x.shape[0]
        args = {"samples": n, "batch_size": self.batch_size, "epochs": self.epochs, "shuffle": bool(self.shuffle),
                "sample shape": list(self.x.shape[1:]) if self.loader is None else None,
                "loss": type(self.loss).__name__, "optimizer": type(self.optimizer).__name__,
                "validation samples": None if self.xv is None or self.loader is not None and self.yv is None
                else (self.xv.shape[0] if hasattr(self.xv, "shape") else getattr(self.xv, "num_samples", None)),
                "parameters": [list(p.shape) for p in self.model.parameters()]}
        # ranks that run different numbers of steps, or read a checkpoint alone, wait in a collective forever
        args["resume"] = self.resume is not None
        args["precision"] = self.precision
        if self.loader is not None:
            try:
                args["batches per epoch"] = len(self.loader)
            except TypeError:  # a generator source: its length is unknown on every rank
                args["batches per epoch"] = None
            # ranks drawing different orders would each train on their share of different batches
            shuffle = bool(getattr(self.loader, "shuffle", False))
            args["loader shuffle"] = shuffle
            args["loader seed (pass DataLoader(seed=...))"] = getattr(self.loader, "seed", None) if shuffle else None
        return args

    def __call__(self) -> History:
        from . import _checkpoint

        model, dp, loader = self.model, self.dp, self.loader
        where = f"{type(model).__name__}.fit"
        main = dp is None or dp.rank == 0
        seed = dp.shared_seed(self.seed) if dp is not None else self.seed
        rng = np.random.default_rng(seed)
        be = model.backend
        history = History()
        n = loader.num_samples if loader is not None else self.x.shape[0]
        batch_size = self.batch_size
        if n is None:  # a DataLoader over a generator: its length is known only once it is exhausted
            if self.resume is not None or self.checkpoint_every:
                raise ValueError(f"{where}: resume and checkpoint_every need a DataLoader over arrays (a batch "
                                 "generator cannot be replayed to the same position)")
            steps_per_epoch = None
        else:
            steps_per_epoch = len(loader) if loader is not None else math.ceil(n / batch_size)
        fit_info = {"n": n, "batch_size": batch_size, "shuffle": bool(self.shuffle)}
        start_epoch, start_step, global_step, carried = 1, 0, 0, (0.0, 0)
        optimizer, scheduler = self.optimizer, self.scheduler
        if self.resume is not None:
            state = self._read_resume(self.resume)
            for key, value in fit_info.items():
                if key in state.fit and state.fit[key] != value:
                    raise ValueError(f"{where}: cannot resume from {state.path!r}: it was written with "
                                     f"{key}={state.fit[key]!r}, this run has {key}={value!r}")
            _checkpoint.apply_training_state(state, model, optimizer, rng, history)
            if scheduler is not None and getattr(state, "scheduler_state", None):
                try:
                    scheduler.load_state_dict(state.scheduler_state)
                except (ValueError, TypeError, KeyError) as exc:
                    raise ValueError(f"{state.path!r}: the learning-rate scheduler's state does not fit "
                                     f"{type(scheduler).__name__}: {exc}") from None
                total = getattr(scheduler, "total_steps", None)
                if getattr(scheduler, "per_batch", False) and isinstance(total, int) and steps_per_epoch and \
                        total < self.epochs * steps_per_epoch:
                    # the restored schedule ends where the original run did; stepping past it fails mid-epoch
                    raise ValueError(
                        f"{where}: cannot resume from {state.path!r} with epochs={self.epochs}: its "
                        f"{type(scheduler).__name__} schedule has total_steps={total} ({total / steps_per_epoch:g} "
                        f"epochs of {steps_per_epoch} steps), fewer than the {self.epochs * steps_per_epoch} steps "
                        f"of {self.epochs} epochs; resume with epochs={total // steps_per_epoch} (a schedule "
                        "cannot be stretched mid-run), or start a new run")
            start_epoch, start_step, global_step = state.epoch, state.step, state.global_step
            carried = (state.loss_sum, state.correct)

        def save(epoch, step, rng_state, loss_sum, correct):
            if main:
                extra = {}
                if scheduler is not None and hasattr(scheduler, "state_dict"):
                    extra["scheduler_state"] = scheduler.state_dict()
                _checkpoint.save_training_checkpoint(
                    self.checkpoint, model, optimizer, epoch=epoch, step=step, global_step=global_step,
                    rng_state=rng_state, loss_sum=loss_sum, correct=correct, history=history, fit=fit_info,
                    **extra)

        params = model.parameters()
        snapshot = [be.copy(p.data) for p in params]
        per_batch = scheduler is not None and getattr(scheduler, "per_batch", False)
        batch_hooks = self.callbacks.wants_batch_end() if hasattr(self.callbacks, "wants_batch_end") else True
        model.stop_training = False
        self.callbacks.on_train_begin(model)
        bar_cls = _progress_bar_class() if self.verbose and main else None
        for epoch in range(start_epoch, self.epochs + 1):
            epoch_rng_state = rng.bit_generator.state  # a checkpoint redraws this epoch's order from here
            skip = start_step if epoch == start_epoch else 0
            if loader is not None and self.sharded:
                # each rank reads and transforms only its share of every batch (DistributedSampler-like)
                batches = loader._shard_epoch(epoch - 1, skip, dp.rank, dp.size, placeholder=True)
            elif loader is not None:
                batches = loader.epoch(epoch - 1, skip)
            else:
                order = rng.permutation(n) if self.shuffle else np.arange(n)
                batches = _batches(n, batch_size, order)
            t0 = time.perf_counter()
            total_loss, correct = carried if epoch == start_epoch else (0.0, 0)
            seen = 0
            bar = bar_cls(total=steps_per_epoch, initial=skip, desc=f"epoch {epoch}/{self.epochs}", unit="batch",
                          leave=True, dynamic_ncols=True) if bar_cls else None
            try:
                for step, batch in enumerate(batches, start=skip if loader is not None else 0):
                    if loader is None and step < skip:
                        continue
                    step_loss, step_correct, count = self._train_step(batch, params, snapshot, epoch, step)
                    total_loss += step_loss
                    correct += step_correct
                    seen += count
                    global_step += 1
                    if per_batch:
                        scheduler.step()
                    if bar is not None:
                        bar.update(1)
                        if step % 10 == 0 or step == (steps_per_epoch or 0) - 1:
                            bar.set_postfix(loss=f"{step_loss / count:.4f}", refresh=False)
                    if batch_hooks and len(self.callbacks):
                        self.callbacks.on_batch_end(global_step - 1, {"loss": step_loss / count,
                                                                      "lr": optimizer.lr})
                    if (self.checkpoint_every and global_step % self.checkpoint_every == 0
                            and step < (steps_per_epoch or 0) - 1):
                        save(epoch, step + 1, epoch_rng_state, total_loss, correct)
            finally:
                if bar is not None:
                    bar.close()
            if dp is not None and getattr(dp, "sync_buffers", False):
                dp.broadcast_buffers()  # every rank validates, saves and ends with rank 0's model
            be.synchronize()
            elapsed = time.perf_counter() - t0
            done = seen if loader is not None else n - min(n, skip * batch_size)
            denom = n if loader is None else max(seen + (skip * batch_size if epoch == start_epoch else 0), 1)
            metrics = _metrics(self.loss, total_loss / denom, correct / denom)
            if self.xv is not None:
                with _eval_mode(model):
                    if _is_loader(self.xv):
                        ev = _evaluate_loader(model, self.xv, self.loss)
                    elif dp is None:
                        ev = evaluate_host(model, self.xv, self.yv, self.loss, max(batch_size, 256))
                    else:
                        ev = dp.evaluate(self.xv, self.yv, max(batch_size, 256), self.loss)
                metrics["val_loss"] = ev["loss"]
                if "accuracy" in ev:
                    metrics["val_accuracy"] = ev["accuracy"]
            metrics["lr"] = optimizer.lr
            metrics["time"] = elapsed
            metrics["samples_per_s"] = done / elapsed if elapsed > 0 else float("inf")
            history.append(epoch, **metrics)
            if self.verbose and main:
                line = " - ".join(f"{k} {v:.4f}" if k != "samples_per_s" else f"{v:.0f} samples/s"
                                  for k, v in metrics.items() if k not in ("time", "lr"))
                print(f"epoch {epoch}/{self.epochs}: {line} ({elapsed:.1f} s)", flush=True)
            if scheduler is not None and not per_batch:
                if getattr(scheduler, "needs_metric", False):
                    scheduler.step(metrics["val_loss"] if "val_loss" in metrics else metrics["loss"])
                else:
                    scheduler.step()
            self.callbacks.on_epoch_end(epoch, dict(metrics))
            if self.checkpoint is not None:
                save(epoch + 1, 0, rng.bit_generator.state, 0.0, 0)
            stop = bool(getattr(model, "stop_training", False))
            if dp is not None:
                stop = dp.any_rank(stop)
            if stop:
                break
        self.callbacks.on_train_end(history)
        return history

    def _read_resume(self, path):
        """Read a training checkpoint (rank 0 reads and broadcasts when distributed)."""
        from . import _checkpoint

        dp = self.dp
        if dp is None:
            return _checkpoint.load_training_checkpoint(path)
        payload = None
        if dp.rank == 0:
            try:
                payload = (True, _checkpoint.load_training_checkpoint(path))
            except (OSError, ValueError) as exc:
                payload = (False, exc)
        ok, value = dp.bcast_object(payload)
        if not ok:
            raise value
        return value

    def _batch_arrays(self, batch):
        """Host ``(x, y)`` of one batch: from the loader, or the rows ``batch`` of the arrays."""
        if self.loader is not None:
            xb, yb = batch[0], batch[1]  # a shard's batches carry the global batch size third
            return np.ascontiguousarray(xb, dtype=np.float32), host_targets(yb, len(xb), self.loss, "y",
                                                                            "DataLoader batch")
        return None

    def _train_step(self, batch, params, snapshot, epoch, step):
        """One optimizer step on a global batch; returns ``(loss * batch, correct, batch size)``."""
        model, dp, loss, optimizer = self.model, self.dp, self.loss, self.optimizer
        be = model.backend
        where = f"{type(model).__name__}.fit"
        loaded = self._batch_arrays(batch)
        if dp is not None:
            if getattr(dp, "sync_buffers", False):
                dp.broadcast_buffers()  # as DDP: every forward starts from rank 0's buffers
            if loaded is None:
                count = len(batch)
                lo, hi = dp.shard(count)
                local = batch[lo:hi]
                xl, yl = (self.x[local], self.y[local]) if len(local) else (None, None)
            elif self.sharded:
                count = batch[2]
                lo, hi = dp.shard(count)
                xl, yl = loaded if hi > lo else (None, None)  # an empty share holds a placeholder sample
            else:
                count = len(loaded[0])
                lo, hi = dp.shard(count)
                xl, yl = (loaded[0][lo:hi], loaded[1][lo:hi]) if hi > lo else (None, None)
            if xl is not None:
                xb = be.asarray(xl)
                yb = _prepare_target(loss, yl, be)
                out = model.forward(xb)
                value = loss.forward(out, yb, backend=be)
                stats = [value * (hi - lo), loss.count_correct(out, yb)]
                dy = loss.backward()
            elif getattr(dp, "needs_every_rank", False):
                # a batch smaller than the number of ranks, and a model that reduces inside forward and
                # backward (SyncBatchNorm): this rank runs one sample of the batch weighted 0
                xp, yp = (self.x[batch[:1]], self.y[batch[:1]]) if loaded is None else (loaded[0][:1], loaded[1][:1])
                with dp.placeholder():
                    out = model.forward(be.asarray(xp))
                loss.forward(out, _prepare_target(loss, yp, be), backend=be)
                stats, dy = [0.0, 0.0], loss.backward()
            else:  # a batch smaller than the number of ranks: this rank contributes zero gradients
                stats, dy = [0.0, 0.0], None
            req, total = dp.iallreduce_sum(stats)  # completes during the gradient reduction
            dp.backward(dy, weight=(hi - lo) / count)
            req.Wait()
            batch_loss, batch_correct = float(total[0]), int(round(total[1]))
            value = batch_loss / count
            if not math.isfinite(value):
                self._restore(params, snapshot)
                raise TrainingDivergedError(
                    f"{where}: loss became {value} at epoch {epoch}, step {step + 1}; training stopped and "
                    "the weights of the last finite-loss step were restored (lower the learning rate?)")
        else:
            if loaded is None:
                count = len(batch)
                xb = be.asarray(self.x[batch])
                yb = _prepare_target(loss, self.y[batch], be)
            else:
                count = len(loaded[0])
                xb = be.asarray(loaded[0])
                yb = _prepare_target(loss, loaded[1], be)
            out = model.forward(xb)
            value = loss.forward(out, yb, backend=be)
            if not math.isfinite(value):
                self._restore(params, snapshot)
                raise TrainingDivergedError(
                    f"{where}: loss became {value} at epoch {epoch}, step {step + 1}; training stopped and "
                    "the weights of the last finite-loss step were restored (lower the learning rate?)")
            batch_correct = loss.count_correct(out, yb)
            batch_loss = value * count
            model.backward(loss.backward())
        for p, s in zip(params, snapshot):
            be.copy_into(s, p.data)
        optimizer.step()
        optimizer.zero_grad()
        return batch_loss, batch_correct, count

    def _restore(self, params, snapshot):
        for p, s in zip(params, snapshot):
            self.model.backend.copy_into(p.data, s)
