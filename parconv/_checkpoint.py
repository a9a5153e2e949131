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
  finished epochs, the fit settings it was written under, and the state of
  every layer's own generator (``Dropout`` masks) under ``generators``, keyed
  by the layer's state-dict prefix (``"3"``, ``"2.body.1"``).

Resuming compares the stored network (``model``) with the model being
trained, layer by layer, and names the first difference
(:func:`architecture_difference`).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from ._io import load_npz, save_npz

KIND = "training-checkpoint"
#: version of the file layout (model files and training checkpoints); readers refuse newer ones
FORMAT_VERSION = 1
OPTIM_PREFIX = "extra.optim."

__all__ = ["TrainingState", "save_training_checkpoint", "load_training_checkpoint", "apply_training_state",
           "read_model_file", "architecture_difference", "layer_generators"]


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
    scheduler_state: dict | None = None
    model_config: dict | None = None
    generators: dict = field(default_factory=dict)


def save_training_checkpoint(path, model, optimizer, *, epoch: int, step: int, global_step: int, rng_state: dict,
                             loss_sum: float = 0.0, correct: int = 0, history=None, fit: dict | None = None,
                             scheduler_state: dict | None = None) -> None:
    """Write a training checkpoint to ``path`` atomically (a kill mid-write keeps the previous file).

    ``scheduler_state`` is a learning-rate scheduler's JSON-able ``state_dict()``.
    """
    from . import __version__

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
    if scheduler_state is not None:
        meta["training"]["scheduler"] = _jsonable(scheduler_state)
    # a layer that draws random numbers (Dropout) goes on from the same point after a resume
    meta["training"]["generators"] = {name: _jsonable(g.bit_generator.state)
                                      for name, g in layer_generators(model).items()}
    save_npz(path, arrays, meta)


def layer_generators(model) -> dict:
    """``{state-dict prefix: numpy Generator}`` of every layer below ``model`` that draws from its own one."""
    out = {}

    def walk(layer, prefix):
        gen = getattr(layer, "_gen", None)
        if isinstance(gen, np.random.Generator):
            out[prefix.rstrip(".") or "model"] = gen
        for name, child in layer.children():
            walk(child, f"{prefix}{name}.")

    walk(model, "")
    return out


def _describe(spec) -> str:
    """A layer spec as ``Conv2d(in_channels=1, ...)``, for messages."""
    if not isinstance(spec, dict):
        return "no layer" if spec is None else f"an unreadable description {spec!r:.60}"
    kind, config = spec.get("type"), spec.get("config")
    if kind in ("Sequential", "Residual") or not isinstance(config, dict) or not config:
        return str(kind)
    return f"{kind}(" + ", ".join(f"{k}={v!r}" for k, v in config.items()) + ")"


def _layers_difference(saved, current, prefix: str) -> str | None:
    if not isinstance(saved, list):
        return f"layer {prefix.rstrip('.') or 'list'}: the checkpoint's description is unreadable"
    for i in range(max(len(saved), len(current))):
        name = f"{prefix}{i}"
        if i >= len(saved) or i >= len(current):
            where = "the model" if i >= len(saved) else "the checkpoint"
            extra = current[i] if i >= len(saved) else saved[i]
            return (f"layer {name}: {_describe(extra)} is only in {where} (the checkpoint's network has "
                    f"{len(saved)} layers{' there' if prefix else ''}, the model {len(current)})")
        diff = _spec_difference(saved[i], current[i], name)
        if diff:
            return diff
    return None


def _spec_difference(saved, current: dict, name: str) -> str | None:
    kind = saved.get("type") if isinstance(saved, dict) else None
    if kind != current["type"]:
        return f"layer {name}: checkpoint has {kind if kind else _describe(saved)}, model has {current['type']}"
    a, b = saved.get("config"), current["config"]
    if not isinstance(a, dict):
        return f"layer {name} ({kind}): the checkpoint's description is unreadable"
    if kind == "Sequential":
        return _layers_difference(a.get("layers"), b["layers"], f"{name}.")
    if kind == "Residual":
        for part in ("body", "shortcut"):
            pa, pb = a.get(part), b.get(part)
            if pa is None or pb is None:
                if pa is not pb:
                    return f"layer {name}.{part}: checkpoint has {_describe(pa)}, model has {_describe(pb)}"
                continue
            diff = _spec_difference(pa, pb, f"{name}.{part}")
            if diff:
                return diff
        return None
    keys = [k for k in list(b) + [k for k in a if k not in b] if a.get(k, "<unset>") != b.get(k, "<unset>")]
    if keys:
        def listing(c):
            return ", ".join(f"{k}={c.get(k, '<unset>')!r}" for k in keys)
        return f"layer {name} ({kind}): checkpoint has {listing(a)}, model has {listing(b)}"
    return None


def architecture_difference(saved_config, model) -> str | None:
    """The first difference between a stored model description and ``model``, or None when they agree.

    ``saved_config`` is what ``Sequential.config()`` wrote into a model file or
    checkpoint. The message names the layer by its state-dict prefix:
    ``"layer 1: checkpoint has ReLU, model has Tanh"``,
    ``"layer 0 (Conv2d): checkpoint has out_channels=32, model has out_channels=16"``.
    Fusion settings are not architecture and are not compared.
    """
    import json

    current = json.loads(json.dumps(model.spec()))  # tuples as lists, as the file stores them
    if not isinstance(saved_config, dict):
        return "the checkpoint's network description is unreadable"
    if isinstance(current["config"].get("layers"), list):
        return _layers_difference(saved_config.get("layers"), current["config"]["layers"], "")
    return _spec_difference({"type": current["type"], "config": saved_config}, current, "model")


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


def _fail(path, what: str) -> ValueError:
    return ValueError(f"{path!r}: corrupt checkpoint metadata: {what}")


def _is_int(value) -> bool:
    return type(value) is int  # JSON true/false must not pass as 1/0


def _is_number(value) -> bool:
    return type(value) in (int, float)


def _check_format(path, meta: dict) -> None:
    fmt = meta.get("format")
    if not _is_int(fmt) or fmt < 1:
        raise _fail(path, f"'format' must be a positive integer, got {fmt!r}")
    if fmt > FORMAT_VERSION:
        raise ValueError(f"{path!r}: checkpoint format {fmt} is newer than this parconv understands "
                         f"(it reads up to {FORMAT_VERSION})")
    if not isinstance(meta.get("model"), dict):
        raise _fail(path, f"'model' must be a JSON object describing the network, got {meta.get('model')!r:.80}")


def read_model_file(path) -> tuple[dict, dict, dict]:
    """Read and check a model file or training checkpoint: ``(model_config, state_arrays, meta)``.

    ``state_arrays`` holds the model's parameters (``"0.weight"``, ...);
    ``extra.*`` arrays are left out. Raises ``FileNotFoundError`` when
    ``path`` does not exist and one ``ValueError`` naming the file for any
    corruption or alteration of it.
    """
    path = os.fspath(path)
    arrays, meta = load_npz(path)
    _check_format(path, meta)
    state = {k: v for k, v in arrays.items() if not k.startswith("extra.")}
    for key, value in state.items():
        _check_state_array(path, key, value)
    _check_promised_sizes(path, meta["model"], state)
    return meta["model"], state, meta


def _promised_values(config: dict) -> int:
    """A lower bound on the parameter values a layer built from ``config`` allocates (0 when unknown)."""
    def size(name):
        v = config.get(name)
        if _is_int(v) and v > 0:
            return v
        if isinstance(v, list) and v and all(_is_int(d) and d > 0 for d in v):
            return math.prod(v)
        return None

    if size("in_features") and size("out_features"):
        return size("in_features") * size("out_features")
    if size("in_channels") and size("out_channels") and size("kernel_size"):
        k = size("kernel_size") ** (2 if _is_int(config["kernel_size"]) else 1)
        return size("in_channels") * size("out_channels") * k // (size("groups") or 1)
    if config.get("affine", True) is False and config.get("track_running_stats", True) is False:
        return 0  # a BatchNorm without weights or running statistics stores nothing
    return size("num_features") or 0


def _check_promised_sizes(path, model_config: dict, state: dict) -> None:
    """Refuse a description whose layers would allocate more values than the file holds, before any is built.

    Every parameter is stored with its full shape, so a valid file holds at least as many values as its
    layers allocate; an altered description (``Linear(30000, 30000)`` over a few bytes) fails here, not
    after gigabytes are drawn for the initial weights.
    """
    held = sum(int(v.size) for v in state.values())
    promised, todo = 0, [model_config]
    while todo:  # iterative: a hostile description may nest deeply
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("type"), str) and isinstance(item.get("config"), dict):
                need = _promised_values(item["config"])
                promised += need
                if promised > held:
                    raise ValueError(f"{path!r}: the model description promises more parameters than the file "
                                     f"holds: layer {item['type']} {item['config']!r:.200} alone needs {need:,} "
                                     f"values, the file stores {held:,} in all (an altered or mismatched "
                                     "description?)")
            todo.extend(item.values())


def _check_state_array(path, key: str, value: np.ndarray) -> None:
    # counters such as BatchNorm's num_batches_tracked are integers; everything else is float
    if value.dtype.kind != "f" and not (key.endswith("num_batches_tracked") and value.dtype.kind in "iu"):
        raise ValueError(f"{path!r}: parameter {key!r} holds {value.dtype} data, expected floating point")


_OPTIM_KEY = re.compile(r"state\.(0|[1-9][0-9]{0,8})\.[A-Za-z_][A-Za-z0-9_]*")
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937")


def _check_rng_state(path, rng_state) -> None:
    """The generator state must be one numpy accepts for its bit generator, tried on a scratch generator."""
    if not isinstance(rng_state, dict):
        raise _fail(path, f"'rng_state' must be an object, got {rng_state!r:.80}")
    name = rng_state.get("bit_generator")
    if name not in _BIT_GENERATORS:
        raise _fail(path, f"'rng_state' names bit generator {name!r:.80}, expected one of {_BIT_GENERATORS}")
    scratch = getattr(np.random, name)(0)
    try:
        scratch.state = rng_state
    except (ValueError, TypeError, KeyError, OverflowError, IndexError) as exc:
        raise _fail(path, f"'rng_state' is not a valid {name} state: {type(exc).__name__}: {exc}") from None


def _check_history(path, hist) -> None:
    if not isinstance(hist, dict):
        raise _fail(path, f"'history' must be an object, got {hist!r:.80}")
    epochs, series = hist.get("epochs", []), hist.get("history", {})
    if not isinstance(epochs, list) or not all(_is_int(e) for e in epochs):
        raise _fail(path, f"'history.epochs' must be a list of integers, got {epochs!r:.80}")
    if not isinstance(series, dict) or not all(
            isinstance(v, list) and all(_is_number(x) for x in v) for v in series.values()):
        raise _fail(path, f"'history.history' must map metric names to lists of numbers, got {series!r:.80}")


def _check_training(path, t) -> None:
    if not isinstance(t, dict):
        raise _fail(path, f"'training' must be an object, got {t!r:.80}")
    opt = t.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        raise _fail(path, f"'training.optimizer' must be an object with a 'type' name, got {opt!r:.80}")
    if not isinstance(opt.get("hyper", {}), dict):
        raise _fail(path, f"'training.optimizer.hyper' must be an object, got {opt.get('hyper')!r:.80}")
    for key, where in (("step", opt), ("epoch", t), ("step", t), ("global_step", t), ("correct", t)):
        value = where.get(key, 0) if key == "correct" else where.get(key)
        lowest = 1 if key == "epoch" else 0
        if not _is_int(value) or value < lowest:
            name = f"training.optimizer.{key}" if where is opt else f"training.{key}"
            raise _fail(path, f"'{name}' must be an integer >= {lowest}, got {value!r:.80}")
    if not _is_number(t.get("loss_sum", 0.0)):
        raise _fail(path, f"'training.loss_sum' must be a number, got {t.get('loss_sum')!r:.80}")
    _check_rng_state(path, t.get("rng_state"))
    _check_history(path, t.get("history", {}))
    if not isinstance(t.get("fit", {}), dict):
        raise _fail(path, f"'training.fit' must be an object, got {t.get('fit')!r:.80}")


def load_training_checkpoint(path) -> TrainingState:
    """Read a checkpoint written by :func:`save_training_checkpoint`.

    Raises ``FileNotFoundError`` when ``path`` does not exist and
    ``ValueError`` naming the file when it is corrupt, altered or not a
    training checkpoint (a plain ``model.save`` file has no training
    position). Everything :func:`apply_training_state` uses is checked here.
    """
    path = os.fspath(path)
    arrays, meta = load_npz(path)
    if meta.get("kind") != KIND or "training" not in meta:
        raise ValueError(f"{path!r} is not a parconv training checkpoint (written by fit(checkpoint=...)); "
                         "a model saved with Sequential.save has no optimizer state or training position")
    _check_format(path, meta)
    t = meta["training"]
    _check_training(path, t)
    opt_meta = t["optimizer"]
    optimizer_state = {"step": opt_meta["step"], "hyper": dict(opt_meta.get("hyper", {}))}
    model_state = {}
    for key, value in arrays.items():
        if key.startswith(OPTIM_PREFIX):
            name = key[len(OPTIM_PREFIX):]
            if not _OPTIM_KEY.fullmatch(name) or value.dtype.kind != "f":
                raise ValueError(f"{path!r}: unexpected optimizer array {key!r} ({value.dtype})")
            optimizer_state[name] = value
        elif not key.startswith("extra."):
            _check_state_array(path, key, value)
            model_state[key] = value
    hist = t.get("history", {})
    return TrainingState(
        path=path,
        model_state=model_state,
        optimizer_type=opt_meta["type"],
        optimizer_state=optimizer_state,
        epoch=t["epoch"],
        step=t["step"],
        global_step=t["global_step"],
        rng_state=dict(t["rng_state"]),
        loss_sum=float(t.get("loss_sum", 0.0)),
        correct=t.get("correct", 0),
        history={"epochs": list(hist.get("epochs", [])),
                 "history": {str(k): list(v) for k, v in hist.get("history", {}).items()}},
        fit=dict(t.get("fit", {})),
        scheduler_state=_scheduler_state(path, t.get("scheduler")),
        model_config=meta["model"],
        generators=_generator_states(path, t.get("generators", {})),
    )


def _generator_states(path, value) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, f"'generators' must map layer names to generator states, got {value!r:.80}")
    for name, state in value.items():
        try:
            _check_rng_state(path, state)
        except ValueError as exc:
            raise _fail(path, f"'generators.{name}': {exc}") from None
    return dict(value)


def _scheduler_state(path, value):
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(path, f"'scheduler' must be a JSON object, got {value!r:.80}")
    return dict(value)


def apply_training_state(state: TrainingState, model, optimizer, rng: np.random.Generator, history) -> None:
    """Load weights, optimizer state, generator state and history from ``state``.

    Everything is checked before anything is written where it can be (model
    keys and shapes, optimizer type); a mismatch raises ``ValueError`` naming
    the checkpoint.
    """
    where = f"resume from {state.path!r}"
    if state.model_config is not None:
        diff = architecture_difference(state.model_config, model)
        if diff:
            raise ValueError(f"{where}: the checkpoint holds another network: {diff}. Build the model the "
                             "checkpoint was written with, or start a new run")
    gens = layer_generators(model)
    if gens and not state.generators:
        warnings.warn(f"{where}: the checkpoint holds no generator state for layers {sorted(gens)} (it was written "
                      "by an older parconv): their random draws (Dropout masks) will differ from an uninterrupted "
                      "run's", UserWarning, stacklevel=3)
    if set(state.generators) - set(gens):
        raise ValueError(f"{where}: the checkpoint holds generator states for layers "
                         f"{sorted(set(state.generators) - set(gens))} that draw no random numbers in the model")
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
    for name, gen_state in state.generators.items():
        gen = gens[name]
        if type(gen.bit_generator).__name__ != gen_state.get("bit_generator"):
            gens[name] = gen = np.random.Generator(getattr(np.random, gen_state["bit_generator"])())
            _set_layer_generator(model, name, gen)
        gen.bit_generator.state = gen_state
    history.epochs[:] = list(state.history.get("epochs", []))
    history.history = {k: list(v) for k, v in state.history.get("history", {}).items()}


def _set_layer_generator(model, name: str, gen) -> None:
    layer = model
    for part in ([] if name == "model" else name.split(".")):
        layer = dict(layer.children())[part]
    layer._gen = gen
