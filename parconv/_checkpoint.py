"""Training checkpoints: everything a stopped ``fit`` needs to finish as if it never stopped.

One ``.npz`` written atomically through :mod:`parconv._io` (no pickle):

* arrays: the model's state dict (``"0.weight"``, ...) and the optimizer's
  buffers as ``"extra.optim.state.<i>.<name>"`` -- so :func:`parconv.load`
  reads a training checkpoint as a plain model file too;
* metadata (JSON): the model config, the optimizer type, hyper-parameters
  and step count, and the training position: ``epoch`` (1-based, the epoch
  in progress or the next to run), ``step`` (batches of that epoch already
  applied), ``global_step``, the shuffling generator's ``bit_generator.state``
  *at the start of that epoch* (so the epoch's order is drawn again on
  resume), the epoch's partial loss sum and correct count, the history of
  finished epochs, and the fit settings it was written under.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ._io import load_npz, save_npz

KIND = "training-checkpoint"
OPTIM_PREFIX = "extra.optim."

__all__ = ["TrainingState", "save_training_checkpoint", "load_training_checkpoint", "apply_training_state"]


@dataclass
class TrainingState:
    """A training checkpoint read back from disk (host arrays and plain Python values)."""

    path: str
    model_state: dict
    optimizer_type: str
    optimizer_state: dict
    epoch: int
    step: int
    global_step: int
    rng_state: dict
    loss_sum: float = 0.0
    correct: int = 0
    history: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)


def save_training_checkpoint(path, model, optimizer, *, epoch: int, step: int, global_step: int, rng_state: dict,
                             loss_sum: float = 0.0, correct: int = 0, history=None, fit: dict | None = None) -> None:
    """Write a training checkpoint to ``path`` atomically (a kill mid-write keeps the previous file)."""
    from . import __version__
    from .model import FORMAT_VERSION

    arrays = model.state_dict()
    opt = optimizer.state_dict()
    for key, value in opt.items():
        if key.startswith("state."):
            arrays[OPTIM_PREFIX + key] = np.asarray(value, dtype=np.float32)
    hist = {"epochs": list(history.epochs), "history": {k: list(v) for k, v in history.history.items()}} \
        if history is not None else {"epochs": [], "history": {}}
    meta = {
        "format": FORMAT_VERSION,
        "parconv": __version__,
        "kind": KIND,
        "model": model.config(),
        "training": {
            "optimizer": {"type": type(optimizer).__name__, "step": int(opt["step"]), "hyper": opt["hyper"]},
            "epoch": int(epoch),
            "step": int(step),
            "global_step": int(global_step),
            "rng_state": _jsonable(rng_state),
            "loss_sum": float(loss_sum),
            "correct": int(correct),
            "history": hist,
            "fit": dict(fit or {}),
        },
    }
    save_npz(path, arrays, meta)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def load_training_checkpoint(path) -> TrainingState:
    """Read a checkpoint written by :func:`save_training_checkpoint`.

    Raises ``FileNotFoundError`` when ``path`` does not exist and
    ``ValueError`` naming the file when it is corrupt or not a training
    checkpoint (a plain ``model.save`` file has no training position).
    """
    path = os.fspath(path)
    arrays, meta = load_npz(path)
    if not isinstance(meta, dict) or meta.get("kind") != KIND or "training" not in meta:
        raise ValueError(f"{path!r} is not a parconv training checkpoint (written by fit(checkpoint=...)); "
                         "a model saved with Sequential.save has no optimizer state or training position")
    t = meta["training"]
    try:
        opt_meta = t["optimizer"]
        optimizer_state = {"step": int(opt_meta["step"]), "hyper": opt_meta.get("hyper", {})}
        for key, value in arrays.items():
            if key.startswith(OPTIM_PREFIX):
                optimizer_state[key[len(OPTIM_PREFIX):]] = value
        return TrainingState(
            path=path,
            model_state={k: v for k, v in arrays.items() if not k.startswith("extra.")},
            optimizer_type=str(opt_meta["type"]),
            optimizer_state=optimizer_state,
            epoch=int(t["epoch"]),
            step=int(t["step"]),
            global_step=int(t["global_step"]),
            rng_state=dict(t["rng_state"]),
            loss_sum=float(t.get("loss_sum", 0.0)),
            correct=int(t.get("correct", 0)),
            history=dict(t.get("history", {})),
            fit=dict(t.get("fit", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path!r}: corrupt training checkpoint metadata: {type(exc).__name__}: {exc}") from None


def apply_training_state(state: TrainingState, model, optimizer, rng: np.random.Generator, history) -> None:
    """Load weights, optimizer state, generator state and history from ``state``.

    Everything is checked before anything is written where it can be (model
    keys and shapes, optimizer type); a mismatch raises ``ValueError`` naming
    the checkpoint.
    """
    where = f"resume from {state.path!r}"
    if type(optimizer).__name__ != state.optimizer_type:
        raise ValueError(f"{where}: the checkpoint holds {state.optimizer_type} state but the optimizer is "
                         f"{type(optimizer).__name__}")
    name = type(rng.bit_generator).__name__
    if state.rng_state.get("bit_generator") != name:
        raise ValueError(f"{where}: the checkpoint's generator is {state.rng_state.get('bit_generator')!r}, "
                         f"fit uses {name!r}")
    try:
        model.load_state_dict(state.model_state)
        optimizer.load_state_dict(state.optimizer_state)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    rng.bit_generator.state = state.rng_state
    history.epochs[:] = list(state.history.get("epochs", []))
    history.history = {k: list(v) for k, v in state.history.get("history", {}).items()}
