"""``Sequential``: call, backward, fit/evaluate/predict, state dicts and checkpoints."""

from __future__ import annotations

import math
import time

import numpy as np

from . import backends as _backends
from ._io import save_npz
from ._validation import check_int, shape_of, state_array, to_backend_array
from .layers import LAYER_TYPES, Conv2d, Flatten, Layer, Linear, MaxPool2d, ReLU
from .losses import BCELoss, Loss, SoftmaxCrossEntropy

__all__ = ["Sequential", "History", "load", "TrainingDivergedError"]

FORMAT_VERSION = 1


class TrainingDivergedError(FloatingPointError):
    """The loss became NaN or infinite during ``fit``; the model holds the last good weights."""


class History:
    """What ``fit`` returns: ``history[metric]`` is a list with one value per epoch.

    Metrics: ``loss``, ``accuracy``, ``val_loss``, ``val_accuracy`` (when
    validation data was given), ``time`` (seconds) and ``samples_per_s``.
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

    def __repr__(self):
        last = {k: round(v[-1], 4) for k, v in self.history.items() if v}
        return f"History(epochs={len(self.epochs)}, last={last})"


def _as_host_float(x, name: str, where: str) -> np.ndarray:
    """Validate a dataset once on the host (numeric, real) and return a float32 array."""
    try:
        arr = np.asarray(x)
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
    return np.ascontiguousarray(arr, dtype=np.float32)


class Sequential:
    """A stack of layers applied in order.

    ``Conv2d -> ReLU -> MaxPool2d`` runs of layers are fused into one
    convolution+ReLU+max-pooling op (``fuse=False`` turns that off); the
    maths is the same, but a backend with a fused kernel never writes the
    full-size convolution output.

    Parameters
    ----------
    *layers : Layer
    backend : str or Backend, optional
        Move every layer there; by default the layers stay where they are
        (they must agree).
    fuse : bool, default True

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3), backend="numpy")
    >>> model(np.ones((2, 1, 2, 2))).shape
    (2, 3)
    >>> list(model.state_dict())
    ['1.weight', '1.bias']
    """

    def __init__(self, *layers, backend=None, fuse: bool = True):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        if not layers:
            raise ValueError("Sequential: needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential: argument {i} must be a parconv layer, got {type(layer).__name__}")
        self.layers = list(layers)
        self.fuse = bool(fuse)
        if backend is not None:
            self.to(backend)
        else:
            names = {layer.backend.name for layer in self.layers}
            if len(names) > 1:
                raise ValueError(f"Sequential: layers live on different backends {sorted(names)}; pass backend=...")
            self.backend = self.layers[0].backend
        self._plan_cache: dict = {}
        self._fwd_plan: list | None = None
        self._fused: dict[int, tuple] = {}
        self._grad_hooks: list = []

    # ------------------------------------------------------------------ basics
    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def __repr__(self):
        inner = ",\n".join(f"  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n) on {self.backend.name!r}"

    def __call__(self, x):
        return self.forward(x)

    def to(self, backend) -> "Sequential":
        """Move every layer to ``backend`` in place; returns self."""
        self.backend = _backends.get(backend)
        for layer in self.layers:
            layer.to(self.backend)
        self._fused, self._fwd_plan = {}, None
        return self

    def parameters(self) -> list:
        return [p for layer in self.layers for p in layer.parameters()]

    def named_parameters(self) -> list:
        """``[("0.weight", Parameter), ...]`` with PyTorch's ``nn.Sequential`` names."""
        return [(f"{i}.{n}", p) for i, layer in enumerate(self.layers) for n, p in layer.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ---------------------------------------------------------------- forward
    def _plan(self) -> list:
        """Steps of the forward pass: ``(start, stop)`` layer ranges.

        3-long ranges are ``Conv2d -> ReLU -> MaxPool2d`` run as one fused op;
        5-long ones add the ``Flatten -> Linear`` head that follows, where the
        backend fuses that head too (:meth:`Backend.fuses_linear_head`).
        """
        types = tuple(type(layer) for layer in self.layers)
        fused3 = [self.fuse and types[i:i + 3] == (Conv2d, ReLU, MaxPool2d) for i in range(len(types))]
        heads = tuple(
            i for i in range(len(types))
            if fused3[i] and types[i + 3:i + 5] == (Flatten, Linear)
            and self.backend.fuses_linear_head(self.layers[i + 4].in_features, self.layers[i + 4].out_features))
        key = (self.fuse, types, heads)
        plan = self._plan_cache.get(key)
        if plan is None:
            plan, i = [], 0
            while i < len(types):
                span = 5 if i in heads else 3 if fused3[i] else 1
                plan.append((i, i + span))
                i += span
            self._plan_cache[key] = plan
        return plan

    def forward(self, x):
        """Run every layer; returns the output as a backend array."""
        x = to_backend_array(x, self.backend, "x", "Sequential")
        self._fused = {}
        self._fwd_plan = plan = self._plan()
        for start, stop in plan:
            if stop - start == 5:
                x = self._fused_head_forward(start, x)
            elif stop - start == 3:
                x = self._fused_forward(start, x)
            else:
                x = self.layers[start].forward(x)
        return x

    def _fused_forward(self, i, x):
        conv, pool = self.layers[i], self.layers[i + 2]
        conv_shape = conv.output_shape(shape_of(x))
        pool.output_shape(conv_shape)
        b = conv.bias.data if conv.bias is not None else None
        y, argmax = self.backend.conv2d_relu_maxpool2d_forward(
            x, conv.weight.data, b, conv.stride, conv.padding, pool.kernel_size, pool.stride)
        for layer in self.layers[i:i + 3]:
            layer._cache = None  # the fused op owns this group's cache
        self._fused[i] = (x, y, argmax)
        return y

    def _fused_head_forward(self, i, x):
        """Layers i..i+4: ``Conv2d -> ReLU -> MaxPool2d -> Flatten -> Linear`` as one op."""
        conv, pool, flat, lin = self.layers[i], self.layers[i + 2], self.layers[i + 3], self.layers[i + 4]
        pooled = pool.output_shape(conv.output_shape(shape_of(x)))
        lin._check_x((pooled[0], math.prod(pooled[1:])))
        b = conv.bias.data if conv.bias is not None else None
        bl = lin.bias.data if lin.bias is not None else None
        y, argmax, logits = self.backend.conv2d_relu_maxpool2d_linear_forward(
            x, conv.weight.data, b, conv.stride, conv.padding, pool.kernel_size, pool.stride, lin.weight.data, bl)
        for layer in self.layers[i:i + 3]:
            layer._cache = None  # the fused op owns this group's cache
        # the head's caches are what its own forward would leave, so Linear.backward gives its gradients
        flat._cache = pooled
        lin._cache = self.backend.reshape(y, (pooled[0], lin.in_features))
        self._fused[i] = (x, y, argmax)
        return logits

    # --------------------------------------------------------------- backward
    def register_grad_hook(self, fn) -> None:
        """Call ``fn(layer_index, params)`` as soon as a layer's gradients are written in ``backward``.

        Used by data-parallel training to start gradient reductions while the
        rest of the backward pass runs.
        """
        if not callable(fn):
            raise TypeError(f"register_grad_hook: fn must be callable, got {type(fn).__name__}")
        self._grad_hooks.append(fn)

    def backward(self, dy, need_dx: bool = False):
        """Back-propagate ``dy`` (the loss gradient w.r.t. the output).

        Fills ``p.grad`` of every parameter (overwritten, not accumulated) and
        returns dx w.r.t. the input when ``need_dx`` (else None; the first
        layer then skips its dx computation).
        """
        # the steps the forward pass ran (what the caches hold), else today's
        plan = self._fwd_plan if self._fwd_plan is not None else self._plan()
        for start, stop in reversed(plan):
            want_dx = need_dx or start != 0
            if stop - start == 5:
                # the head's gradients and the convolution's from the head's dy, in one op
                dy = self._fused_backward(start, dy, want_dx, head=self.layers[start + 4])
                self._run_grad_hooks(start + 4)
            elif stop - start == 3:
                dy = self._fused_backward(start, dy, want_dx)
            else:
                dy = self.layers[start].backward(dy, need_dx=want_dx)
            self._run_grad_hooks(start)
        return dy if need_dx else None

    def _run_grad_hooks(self, idx):
        if self._grad_hooks:
            params = self.layers[idx].parameters()
            if params:
                for hook in self._grad_hooks:
                    hook(idx, params)

    def _fused_group(self, i):
        if i not in self._fused:
            raise ValueError(f"Sequential.backward: layers {i}..{i + 2} ({self.layers[i]!r}, ReLU, MaxPool2d) "
                             "have no forward pass to differentiate (call the model first)")
        return self._fused[i]

    def _fused_backward(self, i, dy, need_dx, head=None):
        """Gradients of the fused layers i..i+2 from dy, their output's gradient, or with ``head``
        (the Linear at i + 4) from dy, the head's output gradient."""
        conv = self.layers[i]
        x, y, argmax = self._fused_group(i)
        dy = to_backend_array(dy, self.backend, "dy", "Sequential.backward")
        if head is not None:
            if shape_of(dy) != (shape_of(y)[0], head.out_features):
                raise ValueError(f"Sequential.backward: dy must have the shape of layer {i + 4}'s output "
                                 f"{(shape_of(y)[0], head.out_features)}, got {shape_of(dy)}")
            dx, dw, db, dwl, dbl = self.backend.conv2d_relu_maxpool2d_linear_backward(
                x, conv.weight.data, y, argmax, head.weight.data, dy, conv.stride, conv.padding, need_dx,
                conv.bias is not None, head.bias is not None)
            head.weight.grad = dwl
            if head.bias is not None:
                head.bias.grad = dbl
        else:
            if shape_of(dy) != shape_of(y):
                raise ValueError(f"Sequential.backward: dy must have the shape of layer {i + 2}'s output "
                                 f"{shape_of(y)}, got {shape_of(dy)}")
            dx, dw, db = self.backend.conv2d_relu_maxpool2d_backward(
                x, conv.weight.data, y, argmax, dy, conv.stride, conv.padding, need_dx, conv.bias is not None)
        conv.weight.grad = dw
        if conv.bias is not None:
            conv.bias.grad = db
        return dx

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        """Host copies of every parameter, keyed like PyTorch (``"0.weight"``, ``"0.bias"``, ...)."""
        return {name: p.numpy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays from ``state`` (e.g. a PyTorch ``state_dict`` as NumPy) into the parameters.

        Every key is checked before anything is written, so a failed load
        leaves the model unchanged. ``strict`` rejects unexpected keys.
        """
        if not hasattr(state, "keys"):
            raise TypeError(f"load_state_dict: state must be a mapping of name -> array, got {type(state).__name__}")
        named = dict(self.named_parameters())
        missing = [k for k in named if k not in state]
        if missing:
            raise ValueError(f"load_state_dict: missing keys {missing} (model expects {list(named)})")
        unexpected = [k for k in state if k not in named]
        if strict and unexpected:
            raise ValueError(f"load_state_dict: unexpected keys {unexpected} (model expects {list(named)})")
        staged = {}
        for k, p in named.items():
            value = state_array(state[k], k, p.shape, "load_state_dict")
            staged[k] = np.array(value, dtype=np.float32, order="C", copy=True)  # never alias caller data
        for k, p in named.items():
            p.data = p.backend.asarray(staged[k])
            p.grad = None

    def config(self) -> dict:
        return {"layers": [{"type": type(layer).__name__, "config": layer.config()} for layer in self.layers],
                "fuse": self.fuse}

    @classmethod
    def from_config(cls, config: dict, backend=None) -> "Sequential":
        """Rebuild an (untrained) model from :meth:`config` output."""
        try:
            specs = config["layers"]
            layers = []
            for spec in specs:
                layer_cls = LAYER_TYPES[spec["type"]]
                layers.append(layer_cls(**spec["config"], backend=backend))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"invalid model config: {type(exc).__name__}: {exc}") from None
        return cls(*layers, backend=backend, fuse=config.get("fuse", True))

    def save(self, path, extra: dict | None = None) -> None:
        """Write architecture and weights to ``path`` (``.npz``) atomically; no pickle.

        ``extra`` holds further arrays (e.g. optimizer state) stored under
        ``extra.<name>``.
        """
        arrays = self.state_dict()
        for k, v in (extra or {}).items():
            arrays[f"extra.{k}"] = np.asarray(v)
        from . import __version__

        save_npz(path, arrays, {"format": FORMAT_VERSION, "parconv": __version__, "model": self.config()})

    # ------------------------------------------------------------------ training
    def _batches(self, n, batch_size, order):
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]

    def fit(self, x, y, epochs: int = 1, batch_size: int = 32, optimizer=None, loss: Loss | None = None,
            validation_data=None, shuffle: bool = True, seed: int | None = None, verbose: bool = True,
            callbacks=None, distributed=False, checkpoint=None, checkpoint_every: int | None = None,
            resume=None) -> History:
        """Train with mini-batch gradient descent.

        Parameters
        ----------
        x : array-like (N, ...)
            Inputs, converted to float32 once.
        y : array-like
            Targets: integer labels (N,) for ``SoftmaxCrossEntropy``, 0/1
            arrays shaped like the output for ``BCELoss``.
        epochs, batch_size : int
            ``epochs`` counts from the start of training, also when resuming.
            With ``distributed``, ``batch_size`` is the global batch.
        optimizer : Optimizer, optional
            Default ``SGD(lr=0.1)``.
        loss : Loss, optional
            Default ``SoftmaxCrossEntropy()``.
        validation_data : (x_val, y_val), optional
            Evaluated after every epoch.
        shuffle : bool, default True
        seed : int, optional
            Seed of the shuffling order (reproducible runs).
        verbose : bool, default True
            Show a progress bar and one line per epoch (rank 0 only when distributed).
        callbacks : list of callables, optional
            ``cb(epoch, metrics_dict)`` after every epoch.
        distributed : bool, communicator or DataParallel, default False
            Train data-parallel over MPI (:class:`parconv.distributed.DataParallel`;
            ``True`` means ``COMM_WORLD``). Every rank passes the same full
            ``x, y``; each epoch's shuffled order is the same on every rank
            (rank 0's seed) and each rank trains on its contiguous share of
            every global batch, so the run follows the serial one. Metrics are
            averaged over ranks; only rank 0 shows progress and writes
            checkpoints.
        checkpoint : path, optional
            Write a training checkpoint (weights, optimizer state, epoch, step,
            shuffling-generator state) here atomically after every epoch and
            every ``checkpoint_every`` steps.
        checkpoint_every : int, optional
            Steps between checkpoints within an epoch (needs ``checkpoint``).
        resume : path, optional
            Continue from a training checkpoint: the run then finishes with
            the same weights as one that was never stopped. The data,
            ``batch_size`` and ``shuffle`` must be those of the original run.

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

        where = "Sequential.fit"
        epochs = check_int(epochs, "epochs", where, 1)
        batch_size = check_int(batch_size, "batch_size", where, 1)
        loss = SoftmaxCrossEntropy() if loss is None else loss
        if not isinstance(loss, Loss):
            raise TypeError(f"{where}: loss must be a parconv loss, got {type(loss).__name__}")
        optimizer = SGD(self.parameters(), lr=0.1) if optimizer is None else optimizer
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{where}: optimizer must be a parconv optimizer, got {type(optimizer).__name__}")
        if checkpoint_every is not None:
            checkpoint_every = check_int(checkpoint_every, "checkpoint_every", where, 1)
            if checkpoint is None:
                raise ValueError(f"{where}: checkpoint_every={checkpoint_every} needs checkpoint=PATH")
        x = _as_host_float(x, "x", where)
        y = self._host_targets(y, x.shape[0], loss, "y")
        xv = yv = None
        if validation_data is not None:
            if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
                raise TypeError(f"{where}: validation_data must be a pair (x_val, y_val)")
            xv = _as_host_float(validation_data[0], "validation x", where)
            yv = self._host_targets(validation_data[1], xv.shape[0], loss, "validation y")
        dp = self._data_parallel(distributed)
        if dp is None:
            return self._fit_loop(x, y, xv, yv, epochs, batch_size, optimizer, loss, shuffle, seed, verbose,
                                  callbacks, None, checkpoint, checkpoint_every, resume)
        # any failure on one rank must end every rank (the others would wait in a collective);
        # a diverged loss is seen by all ranks at the same step and propagates normally
        with dp._guard("fit", passthrough=(TrainingDivergedError,)):
            return self._fit_loop(x, y, xv, yv, epochs, batch_size, optimizer, loss, shuffle, seed, verbose,
                                  callbacks, dp, checkpoint, checkpoint_every, resume)

    def _data_parallel(self, distributed):
        """The DataParallel wrapper ``fit(distributed=...)`` asks for (None when serial)."""
        if distributed is None or distributed is False:
            return None
        from .distributed import MPI, DataParallel

        if isinstance(distributed, DataParallel):
            if distributed.model is not self:
                raise ValueError("Sequential.fit: distributed= is a DataParallel wrapping another model")
            dp = distributed
        else:
            comm = MPI.COMM_WORLD if distributed is True else distributed
            dp = getattr(self, "_dp_cache", None)
            if dp is None or dp.comm is not comm:
                self._dp_cache = dp = DataParallel(self, comm)  # reused by later fits (one grad hook)
                return dp
        dp.broadcast_parameters()
        return dp

    def _fit_loop(self, x, y, xv, yv, epochs, batch_size, optimizer, loss, shuffle, seed, verbose, callbacks,
                  dp, checkpoint, checkpoint_every, resume) -> History:
        from . import _checkpoint

        where = "Sequential.fit"
        main = dp is None or dp.rank == 0
        if dp is not None:
            seed = dp.shared_seed(seed)
        rng = np.random.default_rng(seed)
        be = self.backend
        history = History()
        n = x.shape[0]
        steps_per_epoch = math.ceil(n / batch_size)
        fit_info = {"n": n, "batch_size": batch_size, "shuffle": bool(shuffle)}
        start_epoch, start_step, global_step, carried = 1, 0, 0, (0.0, 0)
        if resume is not None:
            state = self._read_resume(resume, dp)
            for key, value in fit_info.items():
                if key in state.fit and state.fit[key] != value:
                    raise ValueError(f"{where}: cannot resume from {state.path!r}: it was written with "
                                     f"{key}={state.fit[key]!r}, this run has {key}={value!r}")
            _checkpoint.apply_training_state(state, self, optimizer, rng, history)
            start_epoch, start_step, global_step = state.epoch, state.step, state.global_step
            carried = (state.loss_sum, state.correct)

        def save(epoch, step, rng_state, loss_sum, correct):
            if main:
                _checkpoint.save_training_checkpoint(
                    checkpoint, self, optimizer, epoch=epoch, step=step, global_step=global_step,
                    rng_state=rng_state, loss_sum=loss_sum, correct=correct, history=history, fit=fit_info)

        params = self.parameters()
        snapshot = [be.copy(p.data) for p in params]
        bar_cls = _progress_bar_class() if verbose and main else None
        for epoch in range(start_epoch, epochs + 1):
            epoch_rng_state = rng.bit_generator.state  # a checkpoint redraws this epoch's order from here
            order = rng.permutation(n) if shuffle else np.arange(n)
            skip = start_step if epoch == start_epoch else 0
            t0 = time.perf_counter()
            total_loss, correct = carried if epoch == start_epoch else (0.0, 0)
            bar = bar_cls(total=steps_per_epoch, initial=skip, desc=f"epoch {epoch}/{epochs}", unit="batch",
                          leave=True, dynamic_ncols=True) if bar_cls else None
            try:
                for step, idx in enumerate(self._batches(n, batch_size, order)):
                    if step < skip:
                        continue
                    step_loss, step_correct = self._train_step(x, y, idx, loss, optimizer, params, snapshot, dp,
                                                               epoch, step)
                    total_loss += step_loss
                    correct += step_correct
                    global_step += 1
                    if bar is not None:
                        bar.update(1)
                        if step % 10 == 0 or step == steps_per_epoch - 1:
                            bar.set_postfix(loss=f"{step_loss / len(idx):.4f}", refresh=False)
                    if checkpoint_every and global_step % checkpoint_every == 0 and step < steps_per_epoch - 1:
                        save(epoch, step + 1, epoch_rng_state, total_loss, correct)
            finally:
                if bar is not None:
                    bar.close()
            be.synchronize()
            elapsed = time.perf_counter() - t0
            done = n - min(n, skip * batch_size)
            metrics = {"loss": total_loss / n, "accuracy": correct / n, "time": elapsed,
                       "samples_per_s": done / elapsed if elapsed > 0 else float("inf")}
            if xv is not None:
                ev = self._evaluate_host(xv, yv, loss, max(batch_size, 256)) if dp is None \
                    else dp.evaluate(xv, yv, max(batch_size, 256), loss)
                metrics["val_loss"], metrics["val_accuracy"] = ev["loss"], ev["accuracy"]
            history.append(epoch, **metrics)
            if verbose and main:
                line = " - ".join(f"{k} {v:.4f}" if k != "samples_per_s" else f"{v:.0f} samples/s"
                                  for k, v in metrics.items() if k != "time")
                print(f"epoch {epoch}/{epochs}: {line} ({elapsed:.1f} s)", flush=True)
            for cb in callbacks or ():
                cb(epoch, metrics)
            if checkpoint is not None:
                save(epoch + 1, 0, rng.bit_generator.state, 0.0, 0)
        return history

    def _read_resume(self, path, dp):
        """Read a training checkpoint (rank 0 reads and broadcasts when distributed)."""
        from . import _checkpoint

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

    def _train_step(self, x, y, idx, loss, optimizer, params, snapshot, dp, epoch, step):
        """One optimizer step on global batch ``idx``; returns ``(loss * batch, correct)`` of the batch."""
        be = self.backend
        where = "Sequential.fit"
        if dp is not None:
            lo, hi = dp.shard(len(idx))
            local = idx[lo:hi]
            if len(local):
                xb = be.asarray(x[local])
                yb = self._prepare_target(loss, y[local], be)
                out = self.forward(xb)
                value = loss.forward(out, yb, backend=be)
                stats = [value * len(local), loss.count_correct(out, yb)]
                dy = loss.backward()
            else:  # a batch smaller than the number of ranks: this rank contributes zero gradients
                stats, dy = [0.0, 0.0], None
            req, total = dp.iallreduce_sum(stats)  # completes during the gradient reduction
            dp.backward(dy, weight=len(local) / len(idx))
            req.Wait()
            batch_loss, batch_correct = float(total[0]), int(round(total[1]))
            value = batch_loss / len(idx)
            if not math.isfinite(value):
                self._restore(params, snapshot)
                raise TrainingDivergedError(
                    f"{where}: loss became {value} at epoch {epoch}, step {step + 1}; training stopped and "
                    "the weights of the last finite-loss step were restored (lower the learning rate?)")
        else:
            xb = be.asarray(x[idx])
            yb = self._prepare_target(loss, y[idx], be)
            out = self.forward(xb)
            value = loss.forward(out, yb, backend=be)
            if not math.isfinite(value):
                self._restore(params, snapshot)
                raise TrainingDivergedError(
                    f"{where}: loss became {value} at epoch {epoch}, step {step + 1}; training stopped and "
                    "the weights of the last finite-loss step were restored (lower the learning rate?)")
            batch_correct = loss.count_correct(out, yb)
            batch_loss = value * len(idx)
            self.backward(loss.backward())
        for p, s in zip(params, snapshot):
            be.copy_into(s, p.data)
        optimizer.step()
        optimizer.zero_grad()
        return batch_loss, batch_correct

    def _restore(self, params, snapshot):
        for p, s in zip(params, snapshot):
            self.backend.copy_into(p.data, s)

    @staticmethod
    def _prepare_target(loss, y_host, be):
        if isinstance(loss, SoftmaxCrossEntropy):
            return loss.prepare_target(y_host, len(y_host), be)
        return loss.prepare_target(y_host, None, be)

    def _host_targets(self, y, n, loss, name):
        where = "Sequential.fit"
        if isinstance(loss, SoftmaxCrossEntropy):
            from ._validation import to_host_labels

            y = to_host_labels(y, name, where)
            if y.ndim != 1 or y.shape[0] != n:
                raise ValueError(f"{where}: {name} must be (N,) = ({n},) integer labels, got shape {y.shape}")
            if y.min() < 0:
                raise ValueError(f"{where}: {name} must be non-negative class indices, found {int(y.min())}")
            return y
        y = np.asarray(y)
        if y.shape[:1] != (n,):
            raise ValueError(f"{where}: {name} must have {n} rows like x, got shape {y.shape}")
        return y

    def _evaluate_host(self, x, y, loss, batch_size):
        be = self.backend
        total, correct = 0.0, 0
        for start in range(0, x.shape[0], batch_size):
            xb = be.asarray(x[start:start + batch_size])
            yb_host = y[start:start + batch_size]
            yb = loss.prepare_target(yb_host, len(yb_host), be) if isinstance(loss, SoftmaxCrossEntropy) \
                else loss.prepare_target(yb_host, None, be)
            out = self.forward(xb)
            total += loss.forward(out, yb, backend=be) * len(yb_host)
            correct += loss.count_correct(out, yb)
        self._fused = {}
        return {"loss": total / x.shape[0], "accuracy": correct / x.shape[0]}

    def evaluate(self, x, y, batch_size: int = 256, loss: Loss | None = None) -> dict:
        """Mean loss and accuracy over ``(x, y)``; returns ``{"loss": float, "accuracy": float}``."""
        batch_size = check_int(batch_size, "batch_size", "Sequential.evaluate", 1)
        loss = SoftmaxCrossEntropy() if loss is None else loss
        x = _as_host_float(x, "x", "Sequential.evaluate")
        y = self._host_targets(y, x.shape[0], loss, "y")
        return self._evaluate_host(x, y, loss, batch_size)

    def predict(self, x, batch_size: int = 256) -> np.ndarray:
        """Model outputs for ``x`` as a host NumPy array (batched)."""
        batch_size = check_int(batch_size, "batch_size", "Sequential.predict", 1)
        x = _as_host_float(x, "x", "Sequential.predict")
        outs = [self.backend.to_numpy(self.forward(self.backend.asarray(x[s:s + batch_size])))
                for s in range(0, x.shape[0], batch_size)]
        self._fused = {}
        return np.concatenate([np.asarray(o) for o in outs])


def _progress_bar_class():
    from tqdm.auto import tqdm

    return tqdm


def load(path, backend=None) -> Sequential:
    """Load a model written by :meth:`Sequential.save` (architecture and weights).

    Raises ``FileNotFoundError`` when ``path`` does not exist and one
    ``ValueError`` naming the file when it is corrupt, truncated, altered or
    inconsistent; nothing is unpickled.
    """
    from . import _checkpoint

    return _checkpoint.load_model(path, backend=backend)
