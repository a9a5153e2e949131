"""Callbacks: code that ``fit`` runs at fixed points of training.

The protocol
------------
A callback is any object with some of these methods (every one optional);
``fit`` calls them in this order:

``on_train_begin(model)``
    once, before the first epoch, with the model being trained.
``on_batch_end(step, logs)``
    after every optimizer step; ``step`` counts steps from 0 over the whole
    run, ``logs`` holds at least ``"loss"`` (that batch's mean loss).
``on_epoch_end(epoch, logs)``
    after each epoch (and its validation); ``epoch`` is 1-based, as ``fit``
    numbers epochs, and ``logs`` is a dict such as ``{"loss": ...,
    "accuracy": ..., "val_loss": ..., "val_accuracy": ..., "lr": ...,
    "time": ...}`` (the ``val_`` keys only with validation data).
``on_train_end(history)``
    once, after the last epoch, also when training stopped early.

A callback ends training by setting ``model.stop_training = True``; ``fit``
finishes the current epoch, calls ``on_train_end`` and returns the History of
the epochs run. A plain callable ``cb(epoch, logs)`` is taken as an
``on_epoch_end`` hook. :class:`CallbackList` does this dispatch, so a
training loop needs only one object.

Examples
--------
>>> import parconv as pc
>>> stop = pc.callbacks.EarlyStopping(monitor="val_loss", patience=2)
>>> class Model:
...     stop_training = False
>>> model = Model()
>>> stop.on_train_begin(model)
>>> for epoch, val_loss in enumerate([0.9, 0.7, 0.8, 0.75], start=1):
...     stop.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})
>>> model.stop_training, stop.best, stop.stopped_epoch
(True, 0.7, 4)
"""

from __future__ import annotations

import csv
import io
import math
import numbers
import os

import numpy as np

__all__ = ["Callback", "CallbackList", "EarlyStopping", "ModelCheckpoint", "CSVLogger"]

_HOOKS = ("on_train_begin", "on_epoch_end", "on_batch_end", "on_train_end")


class Callback:
    """Base class of callbacks: every hook exists and does nothing.

    Subclasses override the hooks they need; one that overrides
    :meth:`on_train_begin` calls ``super().on_train_begin(model)`` so that
    ``self.model`` is set.

    Attributes
    ----------
    model : object or None
        The model passed to :meth:`on_train_begin`.
    """

    model = None

    def on_train_begin(self, model) -> None:
        """Called once before the first epoch; remembers ``model`` as ``self.model``."""
        self.model = model

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        """Called after each epoch (1-based ``epoch``) with that epoch's metrics."""

    def on_batch_end(self, step: int, logs: dict) -> None:
        """Called after each optimizer step (``step`` counts from 0 over the run)."""

    def on_train_end(self, history) -> None:
        """Called once after the last epoch run, with the ``History`` that ``fit`` returns."""


class CallbackList:
    """Calls a list of callbacks (objects with hooks, or plain ``cb(epoch, logs)`` callables) in order.

    Parameters
    ----------
    callbacks : iterable or None
        Objects with any of the hooks ``on_train_begin``, ``on_epoch_end``,
        ``on_batch_end``, ``on_train_end``, or callables taking
        ``(epoch, logs)``. ``None`` is an empty list.

    Raises
    ------
    TypeError
        When an item has none of the hooks and is not callable.
    """

    def __init__(self, callbacks=None):
        if callbacks is None:
            callbacks = []
        single = isinstance(callbacks, (Callback, str, bytes)) or not hasattr(callbacks, "__iter__")
        if single:
            raise TypeError(f"callbacks must be a list of callbacks, got a single {type(callbacks).__name__}; "
                            f"wrap it in a list")
        self.callbacks = list(callbacks)
        self._hooks = {name: [] for name in _HOOKS}
        for i, cb in enumerate(self.callbacks):
            found = [name for name in _HOOKS if callable(getattr(cb, name, None))]
            if found:
                for name in found:
                    # the base class's empty hooks are not called (on_train_begin sets .model, so it stays)
                    if name != "on_train_begin" and getattr(type(cb), name, None) is getattr(Callback, name):
                        continue
                    self._hooks[name].append(getattr(cb, name))
            elif callable(cb):
                self._hooks["on_epoch_end"].append(cb)
            else:
                raise TypeError(f"callbacks[{i}] must have a hook ({', '.join(_HOOKS)}) or be a callable "
                                f"cb(epoch, logs), got {type(cb).__name__}")

    def __len__(self) -> int:
        return len(self.callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def wants_batch_end(self) -> bool:
        """Whether any callback has an ``on_batch_end`` hook (a loop can skip building per-step logs)."""
        return bool(self._hooks["on_batch_end"])

    def on_train_begin(self, model) -> None:
        for hook in self._hooks["on_train_begin"]:
            hook(model)

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        for hook in self._hooks["on_epoch_end"]:
            hook(epoch, logs)

    def on_batch_end(self, step: int, logs: dict) -> None:
        for hook in self._hooks["on_batch_end"]:
            hook(step, logs)

    def on_train_end(self, history) -> None:
        for hook in self._hooks["on_train_end"]:
            hook(history)


def _check_mode(mode, monitor: str, where: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"{where}: mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode == "auto":
        # Keras' rule: accuracies (and AUC-like scores) grow, everything else is a loss
        return "max" if ("acc" in monitor or monitor.endswith("auc")) else "min"
    return mode


def _check_monitor(monitor, where: str) -> str:
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"{where}: monitor must be a non-empty str naming a key of the logs, got {monitor!r}")
    return monitor


def _monitored(logs, monitor: str, where: str) -> float:
    if not hasattr(logs, "keys"):
        raise TypeError(f"{where}: logs must be a dict of metrics, got {type(logs).__name__}")
    if monitor not in logs:
        raise ValueError(f"{where}: monitor={monitor!r} is not in the logs; available keys: "
                         f"{sorted(logs)} (the 'val_' keys need validation data)")
    value = logs[monitor]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) and not (
            isinstance(value, np.ndarray) and value.size == 1):
        raise TypeError(f"{where}: logs[{monitor!r}] must be a number, got {type(value).__name__}")
    return float(value)


def _copy_state(state: dict) -> dict:
    # state_dict may hand out views of live parameters (NumPy backend): keep private host copies
    return {k: np.array(v, copy=True) for k, v in state.items()}


class EarlyStopping(Callback):
    """Stop training when a monitored metric has stopped improving (Keras semantics).

    After each epoch the monitored value is compared with the best so far;
    an epoch improves when it beats the best by more than ``min_delta``.
    When ``patience`` epochs in a row did not improve, the callback sets
    ``model.stop_training = True``.

    Parameters
    ----------
    monitor : str, default "val_loss"
        Key of the epoch logs to watch.
    patience : int, default 0
        Epochs without improvement to tolerate; 0 stops at the first one.
    min_delta : float, default 0
        Smallest change (absolute, >= 0) that counts as an improvement.
    mode : {"auto", "min", "max"}, default "auto"
        Whether lower or higher is better; ``"auto"`` takes ``"max"`` for
        keys containing ``"acc"`` and ``"min"`` otherwise.
    restore_best_weights : bool, default False
        Keep host copies (``model.state_dict()``) of the weights of the best
        epoch and load them back (``model.load_state_dict()``) when training
        stops, or at the end of training if it ran to the last epoch.
    baseline : float, optional
        An epoch that improves on the best but not on ``baseline`` does not
        reset the patience count, so training stops at the first epoch
        without improvement once ``patience`` epochs have passed without
        beating the baseline.
    verbose : int, default 0
        1 prints a line when stopping and when restoring weights.

    Attributes
    ----------
    best : float
        Best monitored value seen (``inf`` / ``-inf`` before any).
    best_epoch : int
        Epoch of ``best`` (0 before any).
    stopped_epoch : int
        Epoch at which training was stopped (0 when it was not).
    wait : int
        Epochs since the last improvement.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0, mode: str = "auto",
                 restore_best_weights: bool = False, baseline: float | None = None, verbose: int = 0):
        where = "EarlyStopping"
        self.monitor = _check_monitor(monitor, where)
        if isinstance(patience, bool) or not isinstance(patience, numbers.Integral) or patience < 0:
            raise ValueError(f"{where}: patience must be an int >= 0, got {patience!r}")
        self.patience = int(patience)
        if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real) or not math.isfinite(min_delta):
            raise ValueError(f"{where}: min_delta must be a finite number, got {min_delta!r}")
        self.min_delta = abs(float(min_delta))  # Keras takes the sign from the mode, not from min_delta
        self.mode = _check_mode(mode, self.monitor, where)
        self.restore_best_weights = bool(restore_best_weights)
        if baseline is not None and (isinstance(baseline, bool) or not isinstance(baseline, numbers.Real)):
            raise TypeError(f"{where}: baseline must be a number or None, got {baseline!r}")
        self.baseline = None if baseline is None else float(baseline)
        self.verbose = int(verbose)
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best_epoch = 0
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_weights = None
        self._restored = False
        self._epochs_seen = 0

    def _improves(self, current: float, reference: float) -> bool:
        if self.mode == "min":
            return current < reference - self.min_delta
        return current > reference + self.min_delta

    def on_train_begin(self, model) -> None:
        super().on_train_begin(model)
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        current = _monitored(logs, self.monitor, "EarlyStopping")
        if self.restore_best_weights and self.best_weights is None:
            # until something improves, the first epoch's weights are the best there are
            self.best_weights = _copy_state(self.model.state_dict())
            self.best_epoch = epoch
        self.wait += 1
        self._epochs_seen += 1
        if self._improves(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = _copy_state(self.model.state_dict())
            if self.baseline is None or self._improves(current, self.baseline):
                self.wait = 0
            return
        # as Keras, never after the first epoch (only a NaN or a baseline could make it not improve)
        if self.wait >= self.patience and self._epochs_seen > 1:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.verbose:
                print(f"epoch {epoch}: early stopping ({self.monitor} best {self.best:.6g} at epoch "
                      f"{self.best_epoch})", flush=True)
            self._restore()

    def on_train_end(self, history) -> None:
        if not self._restored:
            self._restore()

    def _restore(self) -> None:
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose:
                print(f"restoring the weights of epoch {self.best_epoch}", flush=True)
            self.model.load_state_dict(self.best_weights)
            self._restored = True


def _check_target(where: str, path: str, probe: str | None = None) -> None:
    """Fail at the start of training, not after the first epoch, when ``path`` (or a file ``probe`` beside
    it, for a path with format fields) cannot be written."""
    from ._io import check_writable_target

    try:
        check_writable_target(path if probe is None else probe)
    except OSError as exc:
        if isinstance(exc, NotADirectoryError):
            why = f"{exc.filename} is a file, not a directory"
        elif isinstance(exc, IsADirectoryError):
            why = "it is a directory; give a file name"
        else:
            why = exc.strerror or str(exc)
        raise type(exc)(exc.errno, f"{where}: cannot write {path!r}: {why}") from None


class ModelCheckpoint(Callback):
    """Save the model after every epoch, or only when a monitored metric improves.

    Each save is ``model.save(path)``, which writes atomically: a kill during
    a save leaves the previous file intact.

    Parameters
    ----------
    path : str or path-like
        Where to write; may hold ``str.format`` fields ``{epoch}`` and any
        key of the logs, e.g. ``"ckpt-{epoch:03d}-{val_loss:.4f}.npz"``.
    monitor : str, default "val_loss"
        Key of the logs compared with ``save_best_only``.
    save_best_only : bool, default False
        Save only when ``monitor`` improves on the best so far (then a
        ``path`` without format fields always holds the best model).
    mode : {"auto", "min", "max"}, default "auto"
        As :class:`EarlyStopping`.
    verbose : int, default 0
        1 prints a line per save.

    Attributes
    ----------
    best : float
        Best monitored value seen (only tracked with ``save_best_only``).
    last_path : str or None
        The file most recently written.
    """

    def __init__(self, path, monitor: str = "val_loss", save_best_only: bool = False, mode: str = "auto",
                 verbose: int = 0):
        where = "ModelCheckpoint"
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise TypeError(f"{where}: path must be a str or path-like, got {type(path).__name__}") from None
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"{where}: path must be a non-empty str, got {path!r}")
        self.monitor = _check_monitor(monitor, where)
        self.save_best_only = bool(save_best_only)
        self.mode = _check_mode(mode, self.monitor, where)
        self.verbose = int(verbose)
        self.best = math.inf if self.mode == "min" else -math.inf
        self.last_path = None

    def on_train_begin(self, model) -> None:
        super().on_train_begin(model)
        self.best = math.inf if self.mode == "min" else -math.inf
        directory, name = os.path.split(self.path)
        if "{" not in directory:  # fields in the file name only: its directory is known now
            probe = None if "{" not in name else os.path.join(directory, "probe.npz")
            _check_target("ModelCheckpoint", self.path, probe)

    def _format(self, epoch: int, logs: dict) -> str:
        fields = dict(logs)
        fields["epoch"] = epoch
        try:
            return self.path.format(**fields)
        except KeyError as exc:
            raise ValueError(f"ModelCheckpoint: path {self.path!r} names the field {exc.args[0]!r}, which is not "
                             f"in the logs; available: {sorted(fields)}") from None
        except (ValueError, IndexError) as exc:
            raise ValueError(f"ModelCheckpoint: cannot format path {self.path!r}: {exc}") from None

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        if self.save_best_only:
            current = _monitored(logs, self.monitor, "ModelCheckpoint")
            better = current < self.best if self.mode == "min" else current > self.best
            if not better:
                return
            self.best = current
        target = self._format(epoch, logs)
        self.model.save(target)
        self.last_path = target
        if self.verbose:
            print(f"epoch {epoch}: saved the model to {target}", flush=True)


class CSVLogger(Callback):
    """Write one CSV row per epoch: the epoch number, then every key of the logs.

    The header comes from the first epoch's logs (in their order, after
    ``epoch``); a later key that was not in the header is left out, a missing
    one is written as an empty field. Each row goes out in one write and is
    flushed at once, so a process killed mid-training leaves a file of whole
    rows.

    Parameters
    ----------
    path : str or path-like
        The CSV file.
    append : bool, default False
        Add rows to an existing file (keeping its header and columns, e.g.
        when resuming); otherwise the file is overwritten when training begins.
    separator : str, default ","
        Field delimiter (one character).
    """

    def __init__(self, path, append: bool = False, separator: str = ","):
        where = "CSVLogger"
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise TypeError(f"{where}: path must be a str or path-like, got {type(path).__name__}") from None
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(f"{where}: separator must be a single character, got {separator!r}")
        self.append = bool(append)
        self.separator = separator
        self.keys = None
        self._file = None

    def on_train_begin(self, model) -> None:
        super().on_train_begin(model)
        self.close()
        self.keys = None
        _check_target("CSVLogger", self.path)
        if self.append and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            if not header or header[0] != "epoch":
                raise ValueError(f"CSVLogger: cannot append to {self.path!r}: its first row {header} is not a "
                                 f"header written by CSVLogger (it starts with 'epoch')")
            self.keys = header[1:]
            self._file = open(self.path, "a", newline="")
        else:
            self._file = open(self.path, "w", newline="")

    def _line(self, fields) -> str:
        buf = io.StringIO()
        csv.writer(buf, delimiter=self.separator, lineterminator="\n").writerow(fields)
        return buf.getvalue()

    @staticmethod
    def _cell(value) -> str:
        if isinstance(value, (float, np.floating)):
            return repr(float(value))  # shortest text that reads back to the same float
        if isinstance(value, np.ndarray) and value.size == 1:
            return repr(value.item())
        return str(value)

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        if self._file is None:
            raise RuntimeError(f"CSVLogger({self.path!r}): on_epoch_end before on_train_begin")
        if not hasattr(logs, "keys"):
            raise TypeError(f"CSVLogger: logs must be a dict of metrics, got {type(logs).__name__}")
        text = ""
        if self.keys is None:
            self.keys = [k for k in logs if k != "epoch"]
            text = self._line(["epoch", *self.keys])
        text += self._line([epoch, *(self._cell(logs[k]) if k in logs else "" for k in self.keys)])
        self._file.write(text)
        self._file.flush()

    def on_train_end(self, history) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (``on_train_end`` does this; safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self):
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()
