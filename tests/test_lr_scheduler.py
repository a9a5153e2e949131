"""Learning-rate schedulers: PyTorch's sequences, state-dict round trips, argument checks."""

import json
import math

import numpy as np
import pytest

import parconv as pc
from conftest import needs_torch
from parconv.optim import lr_scheduler as ls

STEPS = 15


def _pc_opt(kind, lr=0.1):
    params = pc.Linear(2, 3, backend="numpy").parameters()
    if kind == "sgd":
        return pc.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return pc.optim.Adam(params, lr=lr)
    if kind == "adamw":
        return pc.optim.AdamW(params, lr=lr)
    return pc.optim.RMSprop(params, lr=lr)


def _torch_opt(kind, lr=0.1):
    import torch

    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.RMSprop(params, lr=lr)


def _momentum(opt):
    """(lr, momentum or beta1) of a parconv or torch optimizer."""
    if hasattr(opt, "param_groups"):
        g = opt.param_groups[0]
        return g["lr"], g["betas"][0] if "betas" in g else g["momentum"]
    return opt.lr, opt.betas[0] if hasattr(opt, "betas") else opt.momentum


def _run(opt, sched, steps, metrics=None):
    """The (lr, momentum, last_lr) after construction and after each of ``steps`` steps."""
    seq = [(*_momentum(opt), sched.get_last_lr()[0])]
    for k in range(steps):
        opt.step()
        if metrics is None:
            sched.step()
        else:
            sched.step(metrics[k])
        seq.append((*_momentum(opt), sched.get_last_lr()[0]))
    return seq


# name, constructor arguments, optimizer kind, steps
CASES = [
    ("StepLR", dict(step_size=3, gamma=0.5), "sgd", STEPS),
    ("StepLR", dict(step_size=1), "adam", 10),
    ("MultiStepLR", dict(milestones=[2, 5, 5, 9], gamma=0.3), "sgd", STEPS),
    ("CosineAnnealingLR", dict(T_max=5, eta_min=0.01), "sgd", 23),
    ("CosineAnnealingLR", dict(T_max=12), "rmsprop", STEPS),
    ("LinearLR", dict(), "sgd", 10),
    ("LinearLR", dict(start_factor=0.25, end_factor=0.5, total_iters=7), "adamw", STEPS),
    ("OneCycleLR", dict(max_lr=0.5, total_steps=20), "sgd", 20),
    ("OneCycleLR", dict(max_lr=0.05, total_steps=13, pct_start=0.4, anneal_strategy="linear", div_factor=10,
                        final_div_factor=100), "adam", 12),
    ("OneCycleLR", dict(max_lr=0.05, total_steps=11, cycle_momentum=False), "rmsprop", 11),
    ("OneCycleLR", dict(max_lr=0.2, epochs=3, steps_per_epoch=5), "sgd", 15),
    ("OneCycleLR", dict(max_lr=0.2, total_steps=21, three_phase=True, pct_start=0.25), "adamw", 21),
]


@needs_torch
@pytest.mark.parametrize("name,kwargs,kind,steps", CASES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_scheduler_matches_torch(name, kwargs, kind, steps):
    import torch

    opt, topt = _pc_opt(kind), _torch_opt(kind)
    got = _run(opt, getattr(ls, name)(opt, **kwargs), steps)
    want = _run(topt, getattr(torch.optim.lr_scheduler, name)(topt, **kwargs), steps)
    assert got == want  # the same formulas in the same order: equal floats


PLATEAU_METRICS = [1.0, 0.9, 0.95, 0.95, 0.91, 0.96, 0.97, 0.89, 0.9, 0.9, 0.9, 0.88, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1]
PLATEAU_CASES = [
    dict(patience=2),
    dict(patience=1, factor=0.5, cooldown=2, min_lr=0.004),
    dict(mode="max", patience=1, factor=0.3),
    dict(patience=0, threshold=0.05, threshold_mode="abs"),
    dict(mode="max", patience=2, threshold=0.02, threshold_mode="abs", cooldown=1),
]


@needs_torch
@pytest.mark.parametrize("kwargs", PLATEAU_CASES)
def test_reduce_lr_on_plateau_matches_torch(kwargs):
    import torch

    opt, topt = _pc_opt("sgd"), _torch_opt("sgd")
    got = _run(opt, ls.ReduceLROnPlateau(opt, **kwargs), len(PLATEAU_METRICS), PLATEAU_METRICS)
    want = _run(topt, torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kwargs), len(PLATEAU_METRICS),
                PLATEAU_METRICS)
    assert got == want
    assert len({g[0] for g in got}) > 1  # the case does reduce the learning rate


def test_schedules_against_closed_forms():
    """Without PyTorch: the recursive values agree with each schedule's closed form."""
    opt = _pc_opt("sgd", lr=0.2)
    s = ls.StepLR(opt, step_size=3, gamma=0.5)
    for e in range(12):
        assert math.isclose(s.get_last_lr()[0], 0.2 * 0.5 ** (e // 3), rel_tol=1e-12)
        s.step()
    opt = _pc_opt("sgd", lr=0.2)
    s = ls.CosineAnnealingLR(opt, T_max=10, eta_min=0.02)
    for e in range(11):
        want = 0.02 + (0.2 - 0.02) * (1 + math.cos(math.pi * e / 10)) / 2
        assert math.isclose(opt.lr, want, rel_tol=1e-9, abs_tol=1e-12)
        s.step()
    opt = _pc_opt("sgd", lr=0.2)
    s = ls.LinearLR(opt, start_factor=0.25, total_iters=4)
    lrs = [opt.lr] + [s.step() or opt.lr for _ in range(6)]
    np.testing.assert_allclose(lrs, [0.05, 0.0875, 0.125, 0.1625, 0.2, 0.2, 0.2], rtol=1e-12)
    opt = _pc_opt("sgd")
    s = ls.MultiStepLR(opt, milestones=[2, 4, 4])
    lrs = [opt.lr] + [s.step() or opt.lr for _ in range(5)]
    np.testing.assert_allclose(lrs, [0.1, 0.1, 0.01, 0.01, 1e-4, 1e-4], rtol=1e-12)


def test_one_cycle_shape():
    opt = _pc_opt("sgd")
    s = ls.OneCycleLR(opt, max_lr=1.0, total_steps=10, pct_start=0.3)
    lrs, moms = [opt.lr], [opt.momentum]
    for _ in range(9):
        s.step()
        lrs.append(opt.lr)
        moms.append(opt.momentum)
    assert lrs[0] == pytest.approx(1.0 / 25) and moms[0] == pytest.approx(0.95)
    assert lrs[2] == pytest.approx(1.0) and moms[2] == pytest.approx(0.85)  # peak at pct_start * total - 1
    assert lrs[-1] == pytest.approx(1.0 / 25 / 1e4) and moms[-1] == pytest.approx(0.95)
    s.step()  # PyTorch allows total_steps steps after construction ...
    with pytest.raises(ValueError, match="total_steps is 10"):
        s.step()  # ... and no more
    assert s.last_epoch == 10
    opt = _pc_opt("adam")
    s = ls.OneCycleLR(opt, max_lr=0.05, total_steps=13, pct_start=0.4, anneal_strategy="linear")
    for _ in range(13):
        s.step()
    assert opt.lr == 0.0  # the extrapolated extra step would be negative


def test_reduce_lr_on_plateau_by_hand():
    opt = _pc_opt("sgd", lr=1.0)
    s = ls.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    lrs = []
    for metric in [3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]:
        s.step(np.float32(metric))
        lrs.append(s.get_last_lr()[0])
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]
    assert opt.lr == 0.25


def test_scheduler_flags():
    for cls in (ls.StepLR, ls.MultiStepLR, ls.CosineAnnealingLR, ls.LinearLR):
        assert cls.per_batch is False and cls.needs_metric is False
    assert ls.OneCycleLR.per_batch is True and ls.OneCycleLR.needs_metric is False
    assert ls.ReduceLROnPlateau.per_batch is False and ls.ReduceLROnPlateau.needs_metric is True
    assert pc.optim.lr_scheduler is ls


ROUND_TRIP = [
    (ls.StepLR, dict(step_size=2, gamma=0.5), "sgd"),
    (ls.MultiStepLR, dict(milestones=[3, 6]), "sgd"),
    (ls.CosineAnnealingLR, dict(T_max=4, eta_min=1e-3), "adam"),
    (ls.LinearLR, dict(total_iters=8), "rmsprop"),
    (ls.OneCycleLR, dict(max_lr=0.3, total_steps=16), "adamw"),
    (ls.OneCycleLR, dict(max_lr=0.3, total_steps=16, three_phase=True, anneal_strategy="linear"), "rmsprop"),
    (ls.ReduceLROnPlateau, dict(patience=1, cooldown=1, factor=0.5), "sgd"),
]


@pytest.mark.parametrize("cls,kwargs,kind", ROUND_TRIP, ids=[c[0].__name__ for c in ROUND_TRIP])
def test_state_dict_round_trip(cls, kwargs, kind):
    """A scheduler and optimizer rebuilt from JSON'd state dicts continue exactly as the originals."""
    metrics = PLATEAU_METRICS if cls is ls.ReduceLROnPlateau else None
    opt = _pc_opt(kind)
    sched = cls(opt, **kwargs)
    _run(opt, sched, 5, metrics)
    o_state = opt.state_dict()
    s_state = json.loads(json.dumps(sched.state_dict(), allow_nan=False))
    o_state["hyper"] = json.loads(json.dumps(o_state["hyper"], allow_nan=False))
    rest = metrics[5:] if metrics else None
    want = _run(opt, sched, 8, rest)

    opt2 = _pc_opt(kind, lr=0.7)  # a different learning rate: the state dicts restore it
    sched2 = cls(opt2, **kwargs)
    sched2.step(0.0) if metrics else sched2.step()
    opt2.load_state_dict(o_state)
    sched2.load_state_dict(s_state)
    assert _run(opt2, sched2, 8, rest) == want


def test_scheduler_argument_errors():
    opt = _pc_opt("sgd")
    with pytest.raises(TypeError, match="optimizer must be a parconv.optim optimizer"):
        ls.StepLR(object(), step_size=1)
    with pytest.raises(ValueError, match="StepLR: step_size must be >= 1, got 0"):
        ls.StepLR(opt, step_size=0)
    with pytest.raises(TypeError, match="StepLR: step_size must be an int, got float"):
        ls.StepLR(opt, step_size=1.5)
    with pytest.raises(ValueError, match="StepLR: gamma must be >= 0.0"):
        ls.StepLR(opt, step_size=1, gamma=-1)
    with pytest.raises(ValueError, match="milestones must be increasing"):
        ls.MultiStepLR(opt, milestones=[5, 2])
    with pytest.raises(TypeError, match="milestones must be a sequence of ints"):
        ls.MultiStepLR(opt, milestones=3)
    with pytest.raises(ValueError, match="T_max must be >= 1"):
        ls.CosineAnnealingLR(opt, T_max=0)
    with pytest.raises(ValueError, match="start_factor must be > 0.0"):
        ls.LinearLR(opt, start_factor=0)
    with pytest.raises(ValueError, match="end_factor must be <= 1.0"):
        ls.LinearLR(opt, end_factor=1.5)
    with pytest.raises(ValueError, match="max_lr must be > 0.0"):
        ls.OneCycleLR(opt, max_lr=0, total_steps=10)
    with pytest.raises(ValueError, match="pct_start must be < 1.0"):
        ls.OneCycleLR(opt, max_lr=0.1, total_steps=10, pct_start=1.0)
    with pytest.raises(ValueError, match="anneal_strategy must be 'cos' or 'linear'"):
        ls.OneCycleLR(opt, max_lr=0.1, total_steps=10, anneal_strategy="exp")
    with pytest.raises(ValueError, match="total_steps must be >= 2"):
        ls.OneCycleLR(opt, max_lr=0.1, total_steps=1)
    with pytest.raises(ValueError, match="give total_steps, or epochs and steps_per_epoch"):
        ls.OneCycleLR(opt, max_lr=0.1, epochs=3)
    with pytest.raises(ValueError, match="not both"):
        ls.OneCycleLR(opt, max_lr=0.1, total_steps=10, epochs=3, steps_per_epoch=2)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        ls.ReduceLROnPlateau(opt, mode="up")
    with pytest.raises(ValueError, match="factor must be < 1.0"):
        ls.ReduceLROnPlateau(opt, factor=1.0)
    with pytest.raises(ValueError, match="threshold_mode must be 'rel' or 'abs'"):
        ls.ReduceLROnPlateau(opt, threshold_mode="pct")
    with pytest.raises(TypeError, match="metric must be a real number, got str"):
        ls.ReduceLROnPlateau(opt).step("low")
    s = ls.StepLR(opt, step_size=2)
    with pytest.raises(ValueError, match="missing \\['step_size'\\]"):
        s.load_state_dict({k: v for k, v in s.state_dict().items() if k != "step_size"})
    with pytest.raises(ValueError, match="the state is a MultiStepLR's"):
        s.load_state_dict(ls.MultiStepLR(opt, [1]).state_dict())
    with pytest.raises(ValueError, match="step_size must be >= 1"):
        s.load_state_dict({**s.state_dict(), "step_size": 0})
