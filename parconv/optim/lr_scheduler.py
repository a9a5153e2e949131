"""Learning-rate schedulers with PyTorch's semantics (``torch.optim.lr_scheduler``).

A scheduler sets ``optimizer.lr`` (OneCycleLR also ``momentum`` or ``betas[0]``).
Constructing one applies step 0, as PyTorch does: the optimizer's learning rate is the
schedule's first value before the first ``optimizer.step()``. Then call ``step()`` after
each epoch's optimizer steps (each batch's for :class:`OneCycleLR`;
``step(metric)`` for :class:`ReduceLROnPlateau`). The values are computed with PyTorch's
recursive formulas, so the sequence of learning rates equals PyTorch's.

The class attributes ``per_batch`` and ``needs_metric`` tell a training loop when to step
a scheduler: after every batch (``per_batch``), or after every epoch, with the monitored
metric when ``needs_metric``.

>>> import parconv as pc
>>> opt = pc.optim.SGD(pc.Linear(2, 1, backend="numpy").parameters(), lr=0.1)
>>> sched = pc.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
>>> for epoch in range(4):
...     opt.step()  # the epoch's updates
...     sched.step()
...     print(epoch, sched.get_last_lr())
0 [0.1]
1 [0.05]
2 [0.05]
3 [0.025]
"""

from __future__ import annotations

import math
import numbers
from collections import Counter

from .._validation import check_float

__all__ = ["LRScheduler", "StepLR", "MultiStepLR", "CosineAnnealingLR", "LinearLR", "OneCycleLR",
           "ReduceLROnPlateau"]


def _check_int(value, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_optimizer(optimizer, where: str):
    from . import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{where}: optimizer must be a parconv.optim optimizer, got {type(optimizer).__name__}")
    return optimizer


class LRScheduler:
    """Base class of the epoch/batch-indexed schedulers.

    Subclasses implement :meth:`get_lr` (the learning rate at ``last_epoch`` from the
    current one, PyTorch's chainable form) and list their state in ``_state_keys``.
    """

    #: step after every batch (True) or every epoch (False)
    per_batch: bool = False
    #: ``step`` takes the monitored metric
    needs_metric: bool = False
    _state_keys: tuple = ()

    def __init__(self, optimizer):
        self.optimizer = _check_optimizer(optimizer, type(self).__name__)
        self.base_lrs = [float(optimizer.lr)]
        self.last_epoch = -1
        self._last_lr = [float(optimizer.lr)]
        self.step()

    def get_lr(self) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self) -> None:
        """Advance the schedule by one and set the optimizer's learning rate."""
        self.last_epoch += 1
        lr = self.get_lr()[0]
        self.optimizer.lr = lr
        self._last_lr = [float(self.optimizer.lr)]

    def get_last_lr(self) -> list:
        """The learning rate set by the last step, as a one-element list (as PyTorch's, one per group)."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """JSON-able state: ``last_epoch``, ``base_lrs``, ``last_lr`` and the scheduler's settings."""
        out = {"type": type(self).__name__, "last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs),
               "last_lr": list(self._last_lr)}
        for key in self._state_keys:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (checked before anything changes).

        As in PyTorch the optimizer's learning rate is not touched: restore the optimizer
        from its own state dict.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: state must be a dict (from state_dict()), got {type(state).__name__}")
        if state.get("type", type(self).__name__) != type(self).__name__:
            raise ValueError(f"{where}: the state is a {state['type']}'s")
        missing = [k for k in ("last_epoch", "base_lrs", "last_lr", *self._state_keys) if k not in state]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        last_epoch = _check_int(state["last_epoch"], "last_epoch", where, -1)
        lists = {}
        for key in ("base_lrs", "last_lr"):
            value = state[key]
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                raise ValueError(f"{where}: {key} must be a list of one float, got {value!r}")
            lists[key] = [check_float(value[0], f"{key}[0]", where)]
        values = self._check_state({k: state[k] for k in self._state_keys}, where)
        self.last_epoch = last_epoch
        self.base_lrs = lists["base_lrs"]
        self._last_lr = lists["last_lr"]
        for key, value in values.items():
            setattr(self, key, value)

    def _check_state(self, values: dict, where: str) -> dict:
        """Checked settings of a state dict; the default takes the ones the constructor checks."""
        return values

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_epoch={self.last_epoch}, last_lr={self._last_lr[0]!r})"


class StepLR(LRScheduler):
    """Multiply the learning rate by ``gamma`` every ``step_size`` epochs.

    Parameters
    ----------
    optimizer : Optimizer
    step_size : int
        ``>= 1``.
    gamma : float, default 0.1
        ``>= 0``.
    """

    _state_keys = ("step_size", "gamma")

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1):
        self.step_size = _check_int(step_size, "step_size", "StepLR", 1)
        self.gamma = check_float(gamma, "gamma", "StepLR", 0.0)
        super().__init__(optimizer)

    def get_lr(self):
        lr = self.optimizer.lr
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [lr]
        return [lr * self.gamma]

    def _check_state(self, values, where):
        return dict(step_size=_check_int(values["step_size"], "step_size", where, 1),
                    gamma=check_float(values["gamma"], "gamma", where, 0.0))


class MultiStepLR(LRScheduler):
    """Multiply the learning rate by ``gamma`` at each milestone epoch.

    Parameters
    ----------
    optimizer : Optimizer
    milestones : sequence of int
        Epoch indices (``>= 1``, increasing); a repeated milestone applies ``gamma`` once per repeat.
    gamma : float, default 0.1
    """

    _state_keys = ("milestones", "gamma")

    def __init__(self, optimizer, milestones, gamma: float = 0.1):
        self.milestones = self._check_milestones(milestones, "MultiStepLR")
        self.gamma = check_float(gamma, "gamma", "MultiStepLR", 0.0)
        super().__init__(optimizer)

    @staticmethod
    def _check_milestones(milestones, where):
        if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
            raise TypeError(f"{where}: milestones must be a sequence of ints, got {type(milestones).__name__}")
        out = [_check_int(m, f"milestones[{i}]", where, 1) for i, m in enumerate(milestones)]
        if out != sorted(out):
            raise ValueError(f"{where}: milestones must be increasing, got {out}")
        return out

    def get_lr(self):
        lr = self.optimizer.lr
        count = Counter(self.milestones)[self.last_epoch]
        if not count:
            return [lr]
        return [lr * self.gamma**count]

    def _check_state(self, values, where):
        return dict(milestones=self._check_milestones(values["milestones"], where),
                    gamma=check_float(values["gamma"], "gamma", where, 0.0))


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from the initial learning rate to ``eta_min`` over ``T_max`` epochs
    (SGDR without restarts; past ``T_max`` the cosine continues, as in PyTorch).

    Parameters
    ----------
    optimizer : Optimizer
    T_max : int
        Half period in epochs, ``>= 1``.
    eta_min : float, default 0
        ``>= 0``.
    """

    _state_keys = ("T_max", "eta_min")

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0):
        self.T_max = _check_int(T_max, "T_max", "CosineAnnealingLR", 1)
        self.eta_min = check_float(eta_min, "eta_min", "CosineAnnealingLR", 0.0)
        super().__init__(optimizer)

    def get_lr(self):
        lr, base, e, T = self.optimizer.lr, self.base_lrs[0], self.last_epoch, self.T_max
        if e == 0:
            return [lr]
        if (e - 1 - T) % (2 * T) == 0:
            return [lr + (base - self.eta_min) * (1 - math.cos(math.pi / T)) / 2]
        return [(1 + math.cos(math.pi * e / T)) / (1 + math.cos(math.pi * (e - 1) / T)) * (lr - self.eta_min)
                + self.eta_min]

    def _check_state(self, values, where):
        return dict(T_max=_check_int(values["T_max"], "T_max", where, 1),
                    eta_min=check_float(values["eta_min"], "eta_min", where, 0.0))


class LinearLR(LRScheduler):
    """Scale the learning rate linearly from ``start_factor`` to ``end_factor`` times the
    initial one over ``total_iters`` epochs (a warm-up), then keep it.

    Parameters
    ----------
    optimizer : Optimizer
    start_factor : float, default 1/3
        In ``(0, 1]``.
    end_factor : float, default 1.0
        In ``[0, 1]``.
    total_iters : int, default 5
        ``>= 0``.
    """

    _state_keys = ("start_factor", "end_factor", "total_iters")

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5):
        values = self._check_state(dict(start_factor=start_factor, end_factor=end_factor, total_iters=total_iters),
                                   "LinearLR")
        self.start_factor, self.end_factor, self.total_iters = (values["start_factor"], values["end_factor"],
                                                                values["total_iters"])
        super().__init__(optimizer)

    def get_lr(self):
        lr, e = self.optimizer.lr, self.last_epoch
        if e == 0:
            return [lr * self.start_factor]
        if e > self.total_iters:
            return [lr]
        return [lr * (1.0 + (self.end_factor - self.start_factor)
                      / (self.total_iters * self.start_factor + (e - 1) * (self.end_factor - self.start_factor)))]

    def _check_state(self, values, where):
        return dict(start_factor=check_float(values["start_factor"], "start_factor", where, 0.0, 1.0,
                                             min_inclusive=False),
                    end_factor=check_float(values["end_factor"], "end_factor", where, 0.0, 1.0),
                    total_iters=_check_int(values["total_iters"], "total_iters", where, 0))


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith & Topin), stepped after every batch.

    The learning rate rises from ``max_lr / div_factor`` to ``max_lr`` over the first
    ``pct_start`` of ``total_steps``, then anneals to ``max_lr / div_factor /
    final_div_factor``. With ``cycle_momentum`` the momentum (``momentum`` of SGD and
    RMSprop, ``betas[0]`` of Adam/AdamW) moves the opposite way between ``max_momentum``
    and ``base_momentum``, as PyTorch does (which also turns momentum on for an SGD or
    RMSprop built with ``momentum=0``; pass ``cycle_momentum=False`` to keep it off).

    Parameters
    ----------
    optimizer : Optimizer
    max_lr : float
        Peak learning rate, ``> 0``.
    total_steps : int
        Number of learning rates in the cycle (epochs x batches per epoch), ``>= 2``: the
        one set at construction and ``total_steps - 1`` steps. As PyTorch, one more
        ``step()`` is allowed (it extrapolates the last phase; a negative learning rate is
        set to 0) and stepping further raises ``ValueError``.
    epochs, steps_per_epoch : int, optional
        In place of ``total_steps``: ``total_steps = epochs * steps_per_epoch``.
    pct_start : float, default 0.3
        Fraction of the cycle spent rising, in ``(0, 1)``.
    anneal_strategy : {"cos", "linear"}, default "cos"
    cycle_momentum : bool, default True
    base_momentum, max_momentum : float, default 0.85, 0.95
    div_factor : float, default 25
        ``> 0``.
    final_div_factor : float, default 1e4
        ``> 0``.
    three_phase : bool, default False
        PyTorch's three-phase variant: back down to ``max_lr / div_factor`` symmetrically,
        then annihilate to the final rate.
    """

    per_batch = True
    _state_keys = ("total_steps", "pct_start", "anneal_strategy", "cycle_momentum", "three_phase", "base_momentum",
                   "max_momentum", "initial_lr", "max_lr", "min_lr")

    def __init__(self, optimizer, max_lr: float, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False):
        where = "OneCycleLR"
        optimizer = _check_optimizer(optimizer, where)
        self.max_lr = check_float(max_lr, "max_lr", where, 0.0, min_inclusive=False)
        if total_steps is None:
            if epochs is None or steps_per_epoch is None:
                raise ValueError(f"{where}: give total_steps, or epochs and steps_per_epoch")
            total_steps = _check_int(epochs, "epochs", where, 1) * _check_int(steps_per_epoch, "steps_per_epoch",
                                                                             where, 1)
        elif epochs is not None or steps_per_epoch is not None:
            raise ValueError(f"{where}: give total_steps or epochs and steps_per_epoch, not both")
        self.total_steps = _check_int(total_steps, "total_steps", where, 2)
        self.pct_start = check_float(pct_start, "pct_start", where, 0.0, 1.0, min_inclusive=False,
                                     max_inclusive=False)
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"{where}: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.anneal_strategy = anneal_strategy
        if not isinstance(cycle_momentum, bool):
            raise TypeError(f"{where}: cycle_momentum must be a bool, got {type(cycle_momentum).__name__}")
        self.cycle_momentum = cycle_momentum
        if not isinstance(three_phase, bool):
            raise TypeError(f"{where}: three_phase must be a bool, got {type(three_phase).__name__}")
        self.three_phase = three_phase
        self.base_momentum = check_float(base_momentum, "base_momentum", where, 0.0, 1.0, max_inclusive=False)
        self.max_momentum = check_float(max_momentum, "max_momentum", where, 0.0, 1.0, max_inclusive=False)
        div_factor = check_float(div_factor, "div_factor", where, 0.0, min_inclusive=False)
        final_div_factor = check_float(final_div_factor, "final_div_factor", where, 0.0, min_inclusive=False)
        self.initial_lr = self.max_lr / div_factor
        self.min_lr = self.initial_lr / final_div_factor
        if cycle_momentum and self._momentum_kind(optimizer) is None:
            raise ValueError(f"{where}: cycle_momentum=True needs an optimizer with momentum or betas "
                             f"(SGD, RMSprop, Adam, AdamW), got {type(optimizer).__name__}; "
                             "pass cycle_momentum=False")
        optimizer.lr = self.initial_lr
        if cycle_momentum:
            self._set_momentum(optimizer, self.max_momentum)
        super().__init__(optimizer)

    @staticmethod
    def _momentum_kind(optimizer):
        if "betas" in optimizer._hyper:
            return "betas"
        if "momentum" in optimizer._hyper:
            return "momentum"
        return None

    def _set_momentum(self, optimizer, value):
        if self._momentum_kind(optimizer) == "betas":
            optimizer.betas = (value, optimizer.betas[1])
        else:
            optimizer.momentum = value

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _phases(self):
        """``(end_step, start_lr, end_lr, start_momentum, end_momentum)`` of each phase, as PyTorch's."""
        if self.three_phase:
            return [(float(self.pct_start * self.total_steps) - 1, self.initial_lr, self.max_lr, self.max_momentum,
                     self.base_momentum),
                    (float(2 * self.pct_start * self.total_steps) - 2, self.max_lr, self.initial_lr,
                     self.base_momentum, self.max_momentum),
                    (self.total_steps - 1, self.initial_lr, self.min_lr, self.max_momentum, self.max_momentum)]
        return [(float(self.pct_start * self.total_steps) - 1, self.initial_lr, self.max_lr, self.max_momentum,
                 self.base_momentum),
                (self.total_steps - 1, self.max_lr, self.min_lr, self.base_momentum, self.max_momentum)]

    def _compute(self, step_num):
        if step_num > self.total_steps:
            raise ValueError(f"OneCycleLR: tried to step {step_num} times; total_steps is {self.total_steps}")
        start_step = 0.0
        phases = self._phases()
        for i, (end_step, lr0, lr1, m0, m1) in enumerate(phases):
            if step_num <= end_step or i == len(phases) - 1:
                pct = (step_num - start_step) / (end_step - start_step)
                return self._anneal(lr0, lr1, pct), self._anneal(m0, m1, pct)
            start_step = end_step
        raise AssertionError("unreachable")

    def get_lr(self):
        return [self._compute(self.last_epoch)[0]]

    def step(self) -> None:
        """Advance one batch: set the learning rate (and momentum with ``cycle_momentum``)."""
        lr, momentum = self._compute(self.last_epoch + 1)
        self.last_epoch += 1
        # the last step PyTorch allows (step total_steps) extrapolates past min_lr: below 0 with linear annealing
        self.optimizer.lr = max(lr, 0.0)
        if self.cycle_momentum:
            self._set_momentum(self.optimizer, momentum)
        self._last_lr = [float(self.optimizer.lr)]

    def _check_state(self, values, where):
        out = dict(values)
        out["total_steps"] = _check_int(values["total_steps"], "total_steps", where, 2)
        for key in ("pct_start", "base_momentum", "max_momentum", "initial_lr", "max_lr", "min_lr"):
            out[key] = check_float(values[key], key, where, 0.0)
        if values["anneal_strategy"] not in ("cos", "linear"):
            raise ValueError(f"{where}: anneal_strategy must be 'cos' or 'linear', got {values['anneal_strategy']!r}")
        for key in ("cycle_momentum", "three_phase"):
            if not isinstance(values[key], bool):
                raise TypeError(f"{where}: {key} must be a bool, got {values[key]!r}")
        return out


class ReduceLROnPlateau:
    """Divide the learning rate by ``1 / factor`` when a metric stops improving.

    ``step(metric)`` after each epoch (typically with the validation loss). After more than
    ``patience`` epochs without improvement (by ``threshold``, relative or absolute), the
    learning rate becomes ``max(lr * factor, min_lr)``, then ``cooldown`` epochs pass before
    bad epochs count again. Constructing it leaves the learning rate as it is.

    Parameters
    ----------
    optimizer : Optimizer
    mode : {"min", "max"}, default "min"
        Whether the metric should fall (loss) or rise (accuracy).
    factor : float, default 0.1
        In ``[0, 1)``.
    patience : int, default 10
        ``>= 0``.
    threshold : float, default 1e-4
        ``>= 0``.
    threshold_mode : {"rel", "abs"}, default "rel"
    cooldown : int, default 0
        ``>= 0``.
    min_lr : float, default 0
        ``>= 0``.
    eps : float, default 1e-8
        Changes of the learning rate smaller than this are skipped.
    """

    per_batch = False
    needs_metric = True
    _state_keys = ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps",
                   "best", "num_bad_epochs", "cooldown_counter", "last_epoch", "last_lr")

    def __init__(self, optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0,
                 eps: float = 1e-8):
        self.optimizer = _check_optimizer(optimizer, "ReduceLROnPlateau")
        settings = self._check_settings(dict(mode=mode, factor=factor, patience=patience, threshold=threshold,
                                             threshold_mode=threshold_mode, cooldown=cooldown, min_lr=min_lr,
                                             eps=eps), "ReduceLROnPlateau")
        for key, value in settings.items():
            setattr(self, key, value)
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.last_epoch = 0
        self._last_lr = [float(optimizer.lr)]

    @staticmethod
    def _check_settings(s, where):
        if s["mode"] not in ("min", "max"):
            raise ValueError(f"{where}: mode must be 'min' or 'max', got {s['mode']!r}")
        if s["threshold_mode"] not in ("rel", "abs"):
            raise ValueError(f"{where}: threshold_mode must be 'rel' or 'abs', got {s['threshold_mode']!r}")
        return dict(mode=s["mode"], threshold_mode=s["threshold_mode"],
                    factor=check_float(s["factor"], "factor", where, 0.0, 1.0, max_inclusive=False),
                    patience=_check_int(s["patience"], "patience", where, 0),
                    threshold=check_float(s["threshold"], "threshold", where, 0.0),
                    cooldown=_check_int(s["cooldown"], "cooldown", where, 0),
                    min_lr=check_float(s["min_lr"], "min_lr", where, 0.0),
                    eps=check_float(s["eps"], "eps", where, 0.0))

    def _is_better(self, a: float, best: float) -> bool:
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min":
            return a < best - self.threshold
        if self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def step(self, metric) -> None:
        """Record one epoch's ``metric`` (a real number) and reduce the learning rate if it has plateaued."""
        if isinstance(metric, bool) or not isinstance(metric, numbers.Real):
            if hasattr(metric, "item"):  # a NumPy scalar or 0-d array
                metric = metric.item()
            if isinstance(metric, bool) or not isinstance(metric, numbers.Real):
                raise TypeError(f"ReduceLROnPlateau.step: metric must be a real number, got "
                                f"{type(metric).__name__} {metric!r}")
        current = float(metric)
        self.last_epoch += 1
        if self._is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            old = float(self.optimizer.lr)
            new = max(old * self.factor, self.min_lr)
            if old - new > self.eps:
                self.optimizer.lr = new
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = [float(self.optimizer.lr)]

    @property
    def last_lr(self) -> list:
        return list(self._last_lr)

    @last_lr.setter
    def last_lr(self, value) -> None:
        self._last_lr = list(value)

    def get_last_lr(self) -> list:
        """The current learning rate, as a one-element list (as PyTorch's, one per group)."""
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """JSON-able state (``best`` is None until a metric has been recorded)."""
        out = {"type": "ReduceLROnPlateau"}
        for key in self._state_keys:
            out[key] = getattr(self, key)
        if math.isinf(out["best"]):
            out["best"] = None
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (checked before anything changes; the
        optimizer's learning rate is not touched, as in PyTorch)."""
        where = "ReduceLROnPlateau.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: state must be a dict (from state_dict()), got {type(state).__name__}")
        if state.get("type", "ReduceLROnPlateau") != "ReduceLROnPlateau":
            raise ValueError(f"{where}: the state is a {state['type']}'s")
        missing = [k for k in self._state_keys if k not in state]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        values = self._check_settings(state, where)
        best = state["best"]
        if best is None:
            best = math.inf if values["mode"] == "min" else -math.inf
        if isinstance(best, bool) or not isinstance(best, numbers.Real) or math.isnan(best):
            raise TypeError(f"{where}: best must be a real number or None, got {best!r}")
        values["best"] = float(best)
        for key in ("num_bad_epochs", "cooldown_counter", "last_epoch"):
            values[key] = _check_int(state[key], key, where, 0)
        last_lr = state["last_lr"]
        if not isinstance(last_lr, (list, tuple)) or len(last_lr) != 1:
            raise ValueError(f"{where}: last_lr must be a list of one float, got {last_lr!r}")
        values["last_lr"] = [check_float(last_lr[0], "last_lr[0]", where)]
        for key, value in values.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"ReduceLROnPlateau(mode={self.mode!r}, best={self.best!r}, last_lr={self._last_lr[0]!r})"
