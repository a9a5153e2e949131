"""Optimizers. They update parameters in place through the parameters' backend,
so the update runs where the data lives (no host copies on a device backend).
"""

from __future__ import annotations

import numpy as np

from .._validation import check_float

__all__ = ["Optimizer", "SGD", "Adam"]


class Optimizer:
    """Base class: ``step()``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()``."""

    _state_names: tuple = ()

    def __init__(self, params, where: str):
        params = list(params)
        from ..layers import Parameter

        if not params:
            raise ValueError(f"{where}: params is empty (pass model.parameters())")
        for i, p in enumerate(params):
            if not isinstance(p, Parameter):
                raise TypeError(f"{where}: params[{i}] must be a parconv Parameter, got {type(p).__name__}")
        self.params = params
        self.step_count = 0
        # per parameter: dict name -> backend array (created lazily where the parameter lives)
        self._state: list[dict] = [{} for _ in params]

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (the next backward writes fresh ones)."""
        for p in self.params:
            p.grad = None

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

    def _apply(self, todo: list) -> None:
        """Update the parameters at indices ``todo`` (their gradients checked)."""
        for i in todo:
            self._update(i, self.params[i])

    def _update(self, i, p):  # pragma: no cover - abstract
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """Host copy of the optimizer state: ``{"step": int, "hyper": {...}, "state.<i>.<name>": ndarray}``."""
        out = {"step": self.step_count, "hyper": self.hyperparameters()}
        for i, st in enumerate(self._state):
            for name, buf in st.items():
                out[f"state.{i}.{name}"] = np.array(self.params[i].backend.to_numpy(buf))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (shapes checked)."""
        if "step" not in state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing 'step'")
        new_state: list[dict] = [{} for _ in self.params]
        for key, value in state.items():
            if not key.startswith("state."):
                continue
            _, idx, name = key.split(".", 2)
            i = int(idx)
            if i >= len(self.params) or name not in self._state_names:
                raise ValueError(f"{type(self).__name__}.load_state_dict: unexpected entry {key!r}")
            value = np.asarray(value, dtype=np.float32)
            if value.shape != self.params[i].shape:
                raise ValueError(f"{type(self).__name__}.load_state_dict: {key} has shape {value.shape}, "
                                 f"parameter has {self.params[i].shape}")
            new_state[i][name] = self.params[i].backend.asarray(value)
        self._state = new_state
        self.step_count = int(state["step"])


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

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, "SGD")
        self.lr = check_float(lr, "lr", "SGD", 0.0)
        self.momentum = check_float(momentum, "momentum", "SGD", 0.0)
        self.weight_decay = check_float(weight_decay, "weight_decay", "SGD", 0.0)
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"SGD: nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and self.momentum == 0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        self.nesterov = bool(nesterov)

    def hyperparameters(self):
        return dict(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, nesterov=self.nesterov)

    def _apply(self, todo):
        # the parameters of each backend in one call (one parallel loop on openmp)
        groups: dict = {}
        for i in todo:
            p = self.params[i]
            ps, gs, vs = groups.setdefault(p.backend, ([], [], []))
            ps.append(p.data)
            gs.append(p.grad)
            if self.momentum:
                vs.append(self._buffer(i, "momentum"))
        for be, (ps, gs, vs) in groups.items():
            be.sgd_update_many(ps, gs, vs if self.momentum else None, self.lr, self.momentum, self.weight_decay,
                               self.nesterov)


class Adam(Optimizer):
    """Adam (Kingma & Ba), PyTorch's formulation, with optional L2 ``weight_decay``.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    weight_decay : float, default 0
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, "Adam")
        self.lr = check_float(lr, "lr", "Adam", 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"Adam: betas must be a pair of floats, got {betas!r}")
        self.betas = tuple(check_float(b, f"betas[{k}]", "Adam", 0.0, 1.0, max_inclusive=False)
                           for k, b in enumerate(betas))
        self.eps = check_float(eps, "eps", "Adam", 0.0, min_inclusive=False)
        self.weight_decay = check_float(weight_decay, "weight_decay", "Adam", 0.0)

    def hyperparameters(self):
        return dict(lr=self.lr, betas=list(self.betas), eps=self.eps, weight_decay=self.weight_decay)

    def _update(self, i, p):
        m = self._buffer(i, "exp_avg")
        v = self._buffer(i, "exp_avg_sq")
        p.backend.adam_update(p.data, p.grad, m, v, self.lr, self.betas[0], self.betas[1], self.eps,
                              self.weight_decay, self.step_count)
