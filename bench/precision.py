#!/usr/bin/env python
"""Gradient accuracy of a zoo network against float64, per backend and conv precision setting.

One training-mode forward and backward of ``resnet20`` (or another zoo net) on
random images; every parameter gradient is compared with PyTorch's float64
gradient of the same network (or, without PyTorch, parconv's NumPy backend in
float64). A run's error is that of its worst tensor, each tensor's largest
difference scaled by its largest reference value: BatchNorm amplifies a
convolution's rounding, so this is where a less accurate algorithm shows.

Examples
--------
::

    python bench/precision.py                                  # batches 4,32,128, 8 seeds
    python bench/precision.py --batches 4 --seeds 3 --no-torch
    python bench/precision.py --speed --threads 2 --repeat 7   # training step per setting
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

try:  # prefer the installed parconv; fall back to this checkout when it is not installed
    import parconv as pc
except ImportError:
    sys.path.insert(1, ROOT)
    import parconv as pc

import twins  # noqa: E402


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def data(batch: int, seed: int, shape=(3, 32, 32), classes: int = 10):
    """Standard-normal images and uniform labels for one measurement."""
    rng = np.random.default_rng(10_000 + seed)
    return rng.standard_normal((batch,) + tuple(shape)).astype(np.float32), rng.integers(0, classes, batch)


def build(net: str, seed: int, shape=None):
    """The zoo net ``net`` with the weights of ``seed``, on the NumPy backend, in training mode."""
    shape = pc.models.ZOO[net][1] if shape is None else shape
    model = pc.models.build(net, shape, backend="numpy", rng=seed)
    model.train()
    return model


def parconv_grads(model, state: dict, x, y, backend, precision: str | None = None) -> dict:
    """Parameter gradients of one training-mode step of ``model`` (weights ``state``) on ``backend``
    under conv precision ``precision`` (None: the current setting), as float32 NumPy arrays."""
    model.load_state_dict(state)
    model.to(backend)
    loss_fn = pc.SoftmaxCrossEntropy()
    scope = pc.conv_precision(precision) if precision is not None else contextlib.nullcontext()
    with scope:
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
    return {name: np.array(pc.to_numpy(p.grad), dtype=np.float64) for name, p in model.named_parameters()}


def numpy64_grads(model, state: dict, x, y) -> dict:
    """The NumPy reference backend's gradients with float64 weights and images (the oracle
    without PyTorch): the reference ops keep their inputs' dtype, so the convolutions, the
    batch norms and their gradients run in float64 (within 3e-6 of PyTorch's float64)."""
    from parconv.backends.numpy_ref import NumpyBackend

    be = NumpyBackend()
    model.load_state_dict(state)
    model.to(be)
    for _, p in model.named_parameters():
        p.data = np.asarray(p.data, dtype=np.float64)
    loss_fn = pc.SoftmaxCrossEntropy()
    out = model(x.astype(np.float64))
    loss_fn(out, y)
    model.backward(loss_fn.backward())
    grads = {name: np.array(p.grad, dtype=np.float64) for name, p in model.named_parameters()}
    model.load_state_dict(state)  # back to float32
    return grads


def torch_grads(model, state: dict, x, y, dtype: str) -> dict:
    """PyTorch's gradients of the twin of ``model`` (weights ``state``) in ``dtype`` ('float32'/'float64')."""
    import torch

    tm = twins.twin(model, state)
    tm = tm.double() if dtype == "float64" else tm.float()
    tm.train()
    xt = torch.from_numpy(x).to(torch.float64 if dtype == "float64" else torch.float32)
    loss = torch.nn.functional.cross_entropy(tm(xt), torch.from_numpy(np.asarray(y, dtype=np.int64)))
    loss.backward()
    return {k: p.grad.detach().double().numpy() for k, p in tm.named_parameters()}


def worst_error(grads: dict, ref: dict) -> tuple[float, str]:
    """The worst tensor's ``max |g - ref| / max |ref|`` and its name."""
    worst, where = 0.0, ""
    for k, r in ref.items():
        scale = float(np.abs(r).max())
        err = float(np.abs(grads[k] - r).max()) / (scale if scale > 0 else 1.0)
        if err > worst:
            worst, where = err, k
    return worst, where


def accuracy(net: str, batches, seeds: int, settings, use_torch: bool, use_numpy: bool, log=print) -> dict:
    """``{batch: {column: [worst-tensor error per seed]}}`` for PyTorch float32 (with ``use_torch``),
    parconv's float32 NumPy backend (with ``use_numpy``) and openmp under each conv precision."""
    shape = pc.models.ZOO[net][1]
    table = {}
    for batch in batches:
        cols = (["pytorch fp32"] if use_torch else []) + (["numpy"] if use_numpy else []) + \
            [f"openmp {s}" for s in settings]
        rows = {c: [] for c in cols}
        for seed in range(seeds):
            model = build(net, seed)
            state = model.state_dict()
            x, y = data(batch, seed, shape)
            ref = torch_grads(model, state, x, y, "float64") if use_torch else numpy64_grads(model, state, x, y)
            if use_torch:
                rows["pytorch fp32"].append(worst_error(torch_grads(model, state, x, y, "float32"), ref)[0])
            if use_numpy:
                rows["numpy"].append(worst_error(parconv_grads(model, state, x, y, "numpy"), ref)[0])
            for s in settings:
                rows[f"openmp {s}"].append(worst_error(parconv_grads(model, state, x, y, "openmp", s), ref)[0])
            log(f"batch {batch} seed {seed}: " + "  ".join(f"{c} {rows[c][-1]:.1e}" for c in cols))
        table[batch] = rows
    return table


def within_bound(errors, torch_errors, factor: float = 10.0, floor: float = 1e-4) -> bool:
    """The acceptance rule: the median and the worst over the seeds each within ``factor`` times
    PyTorch float32's (its median and worst), neither bound below ``factor * floor``."""
    return (statistics.median(errors) <= factor * max(statistics.median(torch_errors), floor)
            and max(errors) <= factor * max(max(torch_errors), floor))


def speed(net: str, batches, settings, threads: int, repeat: int, log=print) -> dict:
    """``{batch: {setting: [seconds per training step]}}``: forward, backward and an SGD step of
    ``net`` on openmp, the settings interleaved (repetition r runs each once, in an order rotated
    by r), after each setting's gradients were checked against the NumPy reference."""
    shape = pc.models.ZOO[net][1]
    out = {}
    with pc.num_threads(threads):
        for batch in batches:
            x, y = data(batch, 0, shape)
            model = build(net, 0)
            state = model.state_dict()
            ref = parconv_grads(model, state, x, y, "numpy")
            runs = {}
            for s in settings:
                m = build(net, 0)
                got = parconv_grads(m, state, x, y, "openmp", s)
                err = worst_error(got, ref)[0]
                if err > 0.2:  # a flipped ReLU moves a tensor by 1e-2; a wrong kernel by O(1)
                    raise AssertionError(f"openmp under {s!r} disagrees with numpy: worst tensor {err:.1e}")
                loss_fn = pc.SoftmaxCrossEntropy()
                opt = pc.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                runs[s] = (m, loss_fn, opt, [])

            def step(s):
                m, loss_fn, opt, times = runs[s]
                with pc.conv_precision(s):
                    t0 = time.perf_counter()
                    loss_fn(m(x), y)
                    m.backward(loss_fn.backward())
                    opt.step()
                    opt.zero_grad()
                    times.append(time.perf_counter() - t0)

            for s in settings:  # warm-up
                step(s)
                runs[s][3].clear()
            for r in range(repeat):
                for k in range(len(settings)):
                    step(settings[(r + k) % len(settings)])
            out[batch] = {s: runs[s][3] for s in settings}
            med = {s: statistics.median(v) for s, v in out[batch].items()}
            log(f"batch {batch}, {threads} threads, median of {repeat}: "
                + "  ".join(f"{s} {1e3 * med[s]:.1f} ms" for s in settings))
    return out


def _fmt(v: float) -> str:
    return f"{v:.1e}"


def markdown(table: dict, seeds: int) -> str:
    """The accuracy table for docs/benchmarks.md: median and worst over the seeds per column."""
    cols = list(next(iter(table.values())))
    lines = ["| batch | " + " | ".join(f"{c} (median / worst)" for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for batch, rows in table.items():
        lines.append(f"| {batch} | " + " | ".join(f"{_fmt(statistics.median(rows[c]))} / {_fmt(max(rows[c]))}"
                                                  for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="resnet20", choices=sorted(pc.models.ZOO))
    ap.add_argument("--batches", default="4,32,128", help="comma-separated batch sizes")
    ap.add_argument("--seeds", type=int, default=8, help="weights and data per batch size (accuracy)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", default=",".join(pc._config.CONV_PRECISIONS),
                    help="conv precisions of the openmp backend to measure")
    ap.add_argument("--no-torch", action="store_true", help="float64 oracle from the NumPy backend")
    ap.add_argument("--no-numpy", action="store_true", help="leave out parconv's float32 NumPy backend")
    ap.add_argument("--speed", action="store_true", help="time training steps instead of measuring accuracy")
    ap.add_argument("--repeat", type=int, default=7, help="timed steps per setting (--speed)")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches: expected comma-separated positive integers, got {args.batches!r}")
    if not batches or min(batches) < 1 or args.seeds < 1 or args.repeat < 1 or args.threads < 1:
        ap.error("--batches, --seeds, --repeat and --threads must be positive")
    settings = [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in pc._config.CONV_PRECISIONS:
            ap.error(f"--settings: {s!r} is not one of {', '.join(pc._config.CONV_PRECISIONS)}")
    log = lambda text: print(text, flush=True)  # noqa: E731
    if args.speed:
        out = speed(args.net, batches, settings, args.threads, args.repeat, log)
        base = settings[0]
        for batch, runs in out.items():
            for s in settings[1:]:
                ratios = [a / b for a, b in zip(runs[s], runs[base])]
                log(f"batch {batch}: {s} / {base} step time, median of paired ratios {statistics.median(ratios):.3f}")
        return 0
    use_torch = have_torch() and not args.no_torch
    pc.set_num_threads(args.threads)
    table = accuracy(args.net, batches, args.seeds, settings, use_torch, not args.no_numpy, log)
    log(f"\n{args.net}, worst-tensor gradient error vs float64 "
        f"({'PyTorch' if use_torch else 'NumPy reference'}), {args.seeds} seeds\n")
    log(markdown(table, args.seeds))
    if use_torch:
        for batch, rows in table.items():
            for c in rows:
                if c.startswith("openmp"):
                    ok = within_bound(rows[c], rows["pytorch fp32"])
                    log(f"batch {batch}: {c} {'within' if ok else 'NOT within'} 10x PyTorch float32 (floor 1e-4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
