"""Optimizers (``SGD``, ``Adam``, ``AdamW``, ``RMSprop``), :func:`clip_grad_norm_` and the
learning-rate schedulers of :mod:`parconv.optim.lr_scheduler`.

They update parameters in place through the parameters' backend, so the update runs where
the data lives (no host copies on a device backend): one call per backend and step, which
is one parallel loop over the elements of every parameter on openmp.

Every optimizer follows PyTorch's formulation of the same name, so runs are comparable,
with one difference: the bias corrections of Adam count the optimizer's steps, where
PyTorch counts each parameter's (the same whenever every parameter has a gradient at
every step).
"""

from __future__ import annotations

import math

import numpy as np

from .._validation import check_float
from .._weights import weights_changed

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "clip_grad_norm_", "lr_scheduler"]


def _hyper(name: str, doc: str) -> property:
    """A hyper-parameter attribute: reads ``_hyper[name]``; assignment is validated."""

    def get(self):
        return self._hyper[name]

    def set(self, value):
        self._hyper = self._validate({**self._hyper, name: value})

    return property(get, set, doc=doc)


class Optimizer:
    """Base class: ``step()``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()``.

    Hyper-parameters are attributes (``opt.lr = 0.01``) checked on assignment; a
    learning-rate scheduler sets ``lr`` (and ``momentum`` or ``betas``) between steps.

    A subclass sets ``self._hyper = self._validate({...})`` in ``__init__``, implements
    ``_validate(hyper) -> dict`` (the checked hyper-parameters, raising on a bad one) and
    ``_apply(todo)`` (update the parameters at those indices, typically one backend call
    per group of :meth:`_groups`), and lists its buffer names in ``_state_names``.
    """

    _state_names: tuple = ()

    def __init__(self, params, where: str):
        from ..layers import Parameter

        if isinstance(params, Parameter):
            params = [params]
        try:
            params = list(params)
        except TypeError:
            raise TypeError(f"{where}: params must be an iterable of Parameters (model.parameters()), "
                            f"got {type(params).__name__}") from None
        if not params:
            raise ValueError(f"{where}: params is empty (pass model.parameters())")
        for i, p in enumerate(params):
            if not isinstance(p, Parameter):
                raise TypeError(f"{where}: params[{i}] must be a parconv Parameter, got {type(p).__name__}")
        self.params = params
        self.step_count = 0
        self._hyper: dict = {}
        # per parameter: dict name -> backend array (created lazily where the parameter lives)
        self._state: list[dict] = [{} for _ in params]

    lr = _hyper("lr", "Learning rate (settable, ``>= 0``).")

    def _validate(self, hyper: dict) -> dict:  # pragma: no cover - abstract
        """Checked copy of a full set of hyper-parameters (raises naming the bad one)."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (the next backward writes fresh ones), as PyTorch's default;
        ``set_to_none=False`` fills the gradients with zeros in place instead."""
        from ..layers import _zero_grads

        _zero_grads(self.params, set_to_none, f"{type(self).__name__}.zero_grad")

    def _buffer(self, i: int, name: str):
        p = self.params[i]
        st = self._state[i]
        buf = st.get(name)
        if buf is None or not p.backend.is_array(buf):  # first step, or the parameter moved backend
            host = None if buf is None else np.asarray(buf if isinstance(buf, np.ndarray) else buf.get())
            buf = p.backend.zeros(p.shape) if host is None else p.backend.asarray(host)
            st[name] = buf
        return buf

    def step(self) -> None:
        """Apply one update to every parameter that has a gradient.

        Every gradient's shape is checked before any parameter changes.
        """
        todo = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if tuple(p.grad.shape) != p.shape:
                raise ValueError(f"{type(self).__name__}.step: gradient of shape {tuple(p.grad.shape)} for a parameter of shape {p.shape}")
            todo.append(i)
        self.step_count += 1
        self._apply(todo)
        weights_changed()

    def _apply(self, todo: list) -> None:  # pragma: no cover - abstract
        """Update the parameters at indices ``todo`` (their gradients checked)."""
        raise NotImplementedError

    def _groups(self, todo: list, *state: str) -> dict:
        """``{backend: ([data], [grad], [state buffer] per name)}`` of the parameters in ``todo``."""
        groups: dict = {}
        for i in todo:
            p = self.params[i]
            lists = groups.get(p.backend)
            if lists is None:
                lists = groups[p.backend] = [[] for _ in range(2 + len(state))]
            lists[0].append(p.data)
            lists[1].append(p.grad)
            for k, name in enumerate(state):
                lists[2 + k].append(self._buffer(i, name))
        return groups

    def hyperparameters(self) -> dict:
        """The hyper-parameters as JSON-able values (``betas`` as a list)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._hyper.items()}

    def state_dict(self) -> dict:
        """Host copy of the optimizer state, without pickle.

        ``{"step": int, "hyper": {name: JSON-able value}, "state.<i>.<name>": ndarray}``
        with ``<i>`` the parameter's index and ``<name>`` its buffer (``"momentum"``,
        ``"exp_avg"``, ``"exp_avg_sq"``, ``"square_avg"``, ``"momentum_buffer"``).
        """
        out = {"step": self.step_count, "hyper": self.hyperparameters()}
        for i, st in enumerate(self._state):
            for name, buf in st.items():
                out[f"state.{i}.{name}"] = np.array(self.params[i].backend.to_numpy(buf))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output: step count, hyper-parameters (as PyTorch, the
        learning rate too) and buffers.

        Everything is checked (names, shapes, values) before anything changes.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: state must be a dict (from state_dict()), got {type(state).__name__}")
        if "step" not in state:
            raise ValueError(f"{where}: missing 'step'")
        step = state["step"]
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"{where}: 'step' must be an int >= 0, got {step!r}")
        hyper = state.get("hyper", {})
        if not isinstance(hyper, dict):
            raise TypeError(f"{where}: 'hyper' must be a dict, got {type(hyper).__name__}")
        unknown = sorted(set(hyper) - set(self._hyper))
        if unknown:
            raise ValueError(f"{where}: unknown hyper-parameters {unknown} for {type(self).__name__} "
                             f"(expected some of {sorted(self._hyper)})")
        new_hyper = self._validate({**self._hyper, **hyper})
        new_state: list[dict] = [{} for _ in self.params]
        for key, value in state.items():
            if key in ("step", "hyper"):
                continue
            parts = key.split(".", 2)
            if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
                raise ValueError(f"{where}: unexpected entry {key!r}")
            i, name = int(parts[1]), parts[2]
            if i >= len(self.params) or name not in self._state_names:
                raise ValueError(f"{where}: unexpected entry {key!r}")
            value = np.asarray(value, dtype=np.float32)
            if value.shape != self.params[i].shape:
                raise ValueError(f"{where}: {key} has shape {value.shape}, parameter has {self.params[i].shape}")
            new_state[i][name] = value
        self._state = [{name: self.params[i].backend.asarray(v.copy()) for name, v in st.items()}
                       for i, st in enumerate(new_state)]
        self._hyper = new_hyper
        self.step_count = int(step)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._hyper.items())
        return f"{type(self).__name__}({len(self.params)} parameters, {args})"


def _check_betas(betas, where: str) -> tuple:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{where}: betas must be a pair of floats, got {betas!r}")
    return tuple(check_float(b, f"betas[{k}]", where, 0.0, 1.0, max_inclusive=False) for k, b in enumerate(betas))


def _check_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and weight decay.

    Follows PyTorch's ``torch.optim.SGD`` formulation, so runs are comparable.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float
        Learning rate, ``>= 0``.
    momentum : float, default 0
    weight_decay : float, default 0
    nesterov : bool, default False
        Needs ``momentum > 0``.
    """

    _state_names = ("momentum",)

    momentum = _hyper("momentum", "Momentum factor (settable, ``>= 0``).")
    weight_decay = _hyper("weight_decay", "L2 penalty (settable, ``>= 0``).")
    nesterov = _hyper("nesterov", "Whether the step uses Nesterov momentum.")

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, "SGD")
        self._hyper = self._validate(dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))

    def _validate(self, h):
        h = dict(lr=check_float(h["lr"], "lr", "SGD", 0.0),
                 momentum=check_float(h["momentum"], "momentum", "SGD", 0.0),
                 weight_decay=check_float(h["weight_decay"], "weight_decay", "SGD", 0.0),
                 nesterov=_check_bool(h["nesterov"], "nesterov", "SGD"))
        if h["nesterov"] and h["momentum"] == 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        return h

    def _apply(self, todo):
        h = self._hyper
        momentum = h["momentum"]
        names = ("momentum",) if momentum else ()
        for be, (ps, gs, *vs) in self._groups(todo, *names).items():
            be.sgd_update_many(ps, gs, vs[0] if momentum else None, h["lr"], momentum, h["weight_decay"],
                               h["nesterov"])


class Adam(Optimizer):
    """Adam (Kingma & Ba), PyTorch's formulation, with optional L2 ``weight_decay``.

    The L2 penalty is added to the gradient (``g + weight_decay * p``) before the moments,
    as ``torch.optim.Adam`` does; :class:`AdamW` decouples it.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
        Each in ``[0, 1)``.
    eps : float, default 1e-8
        ``> 0``.
    weight_decay : float, default 0
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _decoupled = False

    betas = _hyper("betas", "``(beta1, beta2)`` (settable, each in ``[0, 1)``).")
    eps = _hyper("eps", "Term added to the denominator (settable, ``> 0``).")
    weight_decay = _hyper("weight_decay", "Weight decay (settable, ``>= 0``).")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, type(self).__name__)
        self._hyper = self._validate(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _validate(self, h):
        where = type(self).__name__
        return dict(lr=check_float(h["lr"], "lr", where, 0.0),
                    betas=_check_betas(h["betas"], where),
                    eps=check_float(h["eps"], "eps", where, 0.0, min_inclusive=False),
                    weight_decay=check_float(h["weight_decay"], "weight_decay", where, 0.0))

    def _apply(self, todo):
        h = self._hyper
        for be, (ps, gs, ms, vs) in self._groups(todo, "exp_avg", "exp_avg_sq").items():
            be.adam_update_many(ps, gs, ms, vs, h["lr"], h["betas"][0], h["betas"][1], h["eps"], h["weight_decay"],
                                self.step_count, self._decoupled)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), PyTorch's ``torch.optim.AdamW``.

    Each step first shrinks the parameter, ``p *= 1 - lr * weight_decay``, then takes the
    Adam step on the plain gradient.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    weight_decay : float, default 1e-2
    """

    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class RMSprop(Optimizer):
    """RMSprop (Hinton), PyTorch's ``torch.optim.RMSprop`` with ``centered=False``.

    ``g' = g + weight_decay * p``; ``square_avg = alpha * square_avg + (1 - alpha) * g'^2``;
    ``a = sqrt(square_avg) + eps``; with momentum
    ``buf = momentum * buf + g' / a`` and ``p -= lr * buf``, else ``p -= lr * g' / a``.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float, default 1e-2
    alpha : float, default 0.99
        Smoothing constant in ``[0, 1]``.
    eps : float, default 1e-8
        ``> 0``.
    weight_decay : float, default 0
    momentum : float, default 0
    """

    _state_names = ("square_avg", "momentum_buffer")

    alpha = _hyper("alpha", "Smoothing constant (settable, in ``[0, 1]``).")
    eps = _hyper("eps", "Term added to the denominator (settable, ``> 0``).")
    weight_decay = _hyper("weight_decay", "L2 penalty (settable, ``>= 0``).")
    momentum = _hyper("momentum", "Momentum factor (settable, ``>= 0``).")

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0):
        super().__init__(params, "RMSprop")
        self._hyper = self._validate(dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum))

    def _validate(self, h):
        return dict(lr=check_float(h["lr"], "lr", "RMSprop", 0.0),
                    alpha=check_float(h["alpha"], "alpha", "RMSprop", 0.0, 1.0),
                    eps=check_float(h["eps"], "eps", "RMSprop", 0.0, min_inclusive=False),
                    weight_decay=check_float(h["weight_decay"], "weight_decay", "RMSprop", 0.0),
                    momentum=check_float(h["momentum"], "momentum", "RMSprop", 0.0))

    def _apply(self, todo):
        h = self._hyper
        momentum = h["momentum"]
        names = ("square_avg", "momentum_buffer") if momentum else ("square_avg",)
        for be, (ps, gs, sqs, *bufs) in self._groups(todo, *names).items():
            be.rmsprop_update_many(ps, gs, sqs, bufs[0] if momentum else None, h["lr"], h["alpha"], h["eps"],
                                   h["weight_decay"], momentum)


def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale the gradients of ``params`` in place so that their total norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: the norm is taken over all the gradients as one
    vector; when it exceeds ``max_norm`` every gradient is multiplied by
    ``max_norm / (total_norm + 1e-6)``. Parameters without a gradient are skipped. The norm
    is computed on each parameter's backend (on OpenCL only the scalar leaves the device).

    Parameters
    ----------
    params : Parameter or iterable of Parameter
    max_norm : float
        ``>= 0``.
    norm_type : float, default 2.0
        ``> 0``, or ``inf`` (``float("inf")`` or ``"inf"``) for the largest absolute value.

    Returns
    -------
    float
        The total norm of the gradients before clipping (NaN if any gradient holds a NaN;
        the gradients are then scaled by NaN, as PyTorch does).

    Examples
    --------
    >>> import numpy as np, parconv as pc
    >>> layer = pc.Linear(2, 1, backend="numpy")
    >>> layer.weight.grad = np.array([[3.0, 4.0]], np.float32)
    >>> layer.bias.grad = np.zeros(1, np.float32)
    >>> pc.optim.clip_grad_norm_(layer.parameters(), max_norm=1.0)
    5.0
    >>> np.round(layer.weight.grad, 4)
    array([[0.6, 0.8]], dtype=float32)
    """
    from ..layers import Parameter

    where = "clip_grad_norm_"
    if isinstance(params, Parameter):
        params = [params]
    try:
        params = list(params)
    except TypeError:
        raise TypeError(f"{where}: params must be a Parameter or an iterable of Parameters, "
                        f"got {type(params).__name__}") from None
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TypeError(f"{where}: params[{i}] must be a parconv Parameter, got {type(p).__name__}")
    max_norm = check_float(max_norm, "max_norm", where, 0.0)
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float, np.integer, np.floating)) \
            or math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"{where}: norm_type must be a number > 0 or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    groups: dict = {}
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        if tuple(p.grad.shape) != p.shape:
            raise ValueError(f"{where}: params[{i}] has a gradient of shape {tuple(p.grad.shape)} for a parameter "
                             f"of shape {p.shape}")
        groups.setdefault(p.backend, []).append(p.grad)
    norms = [be.norm_many(gs, norm_type) for be, gs in groups.items()]
    if not norms:
        return 0.0
    if norm_type == math.inf:
        total = math.nan if any(math.isnan(n) for n in norms) else max(norms)
    else:
        total = math.fsum(n**norm_type for n in norms) ** (1.0 / norm_type) if len(norms) > 1 else norms[0]
    coef = max_norm / (total + 1e-6)
    if not coef >= 1.0:  # NaN scales too, as torch's clamp(coef, max=1) keeps it
        for be, gs in groups.items():
            be.scale_many(gs, coef)
    return float(total)


from . import lr_scheduler  # noqa: E402  (the schedulers need Optimizer)
