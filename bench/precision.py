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


def parconv_grads(model, state: dict, x, y, backend, precision: str | None = None, bf16: bool = False) -> dict:
    """Parameter gradients of one training-mode step of ``model`` (weights ``state``) on ``backend``
    under conv precision ``precision`` (None: the current setting), inside ``pc.autocast("bf16")``
    when ``bf16``, as float64 NumPy arrays."""
    model.load_state_dict(state)
    model.to(backend)
    loss_fn = pc.SoftmaxCrossEntropy()
    scope = pc.conv_precision(precision) if precision is not None else contextlib.nullcontext()
    with scope, pc.autocast("bf16", enabled=bf16):
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
    """PyTorch's gradients of the twin of ``model`` (weights ``state``) in ``dtype``: 'float32',
    'float64', or 'bfloat16' (float32 weights under ``torch.autocast("cpu", dtype=torch.bfloat16)``)."""
    import torch

    tm = twins.twin(model, state)
    tm = tm.double() if dtype == "float64" else tm.float()
    tm.train()
    xt = torch.from_numpy(x).to(torch.float64 if dtype == "float64" else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        out = tm(xt)
    loss = torch.nn.functional.cross_entropy(out.float() if dtype == "bfloat16" else out,
                                             torch.from_numpy(np.asarray(y, dtype=np.int64)))
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


def relative_l2(grads: dict, ref: dict) -> float:
    """``||g - ref|| / ||ref||`` over every parameter gradient at once: the measure for bf16, whose
    largest single errors sit in the gradients behind a BatchNorm, where both frameworks' cancel to
    bf16's noise."""
    num = sum(float(np.sum((grads[k] - r) ** 2)) for k, r in ref.items())
    den = sum(float(np.sum(np.asarray(r, np.float64) ** 2)) for r in ref.values())
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


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
    """``{batch: {setting: ([wall seconds], [CPU seconds])}}`` per training step: forward, backward
    and an SGD step of ``net`` on openmp, the settings interleaved (repetition r runs each once,
    in an order rotated by r), after each setting's gradients were checked against the NumPy
    reference. The process's CPU time is the steadier figure on a machine that other work
    keeps busy: time waiting for a core is not in it (run with OMP_WAIT_POLICY=passive so
    that waiting threads do not spin)."""
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
                runs[s] = (m, loss_fn, opt, [], [])

            def step(s):
                m, loss_fn, opt, wall, cpu = runs[s]
                with pc.conv_precision(s):
                    t0, c0 = time.perf_counter(), time.process_time()
                    loss_fn(m(x), y)
                    m.backward(loss_fn.backward())
                    opt.step()
                    opt.zero_grad()
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)

            for s in settings:  # warm-up
                step(s)
                runs[s][3].clear()
                runs[s][4].clear()
            for r in range(repeat):
                for k in range(len(settings)):
                    step(settings[(r + k) % len(settings)])
            out[batch] = {s: (runs[s][3], runs[s][4]) for s in settings}
            log(f"batch {batch}, {threads} threads, median of {repeat}: "
                + "  ".join(f"{s} {1e3 * statistics.median(w):.1f} ms wall, {1e3 * statistics.median(c):.1f} ms CPU"
                            for s, (w, c) in out[batch].items()))
    return out


def _fmt(v: float) -> str:
    return f"{v:.1e}"


def markdown(table: dict, seeds: int) -> str:
    """The accuracy table for docs/benchmarks.md: median and worst over the seeds per column."""
    cols = list(next(iter(table.values())))
    lines = ["| batch | " + " | ".join(f"{c}" for c in cols) + " |",
             "| ---: |" + " --- |" * len(cols)]
    for batch, rows in table.items():
        lines.append(f"| {batch} | " + " | ".join(f"{_fmt(statistics.median(rows[c]))} / {_fmt(max(rows[c]))} "
                                                  f"({sum(e > 1e-4 for e in rows[c])}/{len(rows[c])})"
                                                  for c in cols) + " |")
    return "\n".join(lines)


SECTION = "## Conv precision"
INTRO = [
    SECTION, "",
    "What `pc.set_conv_precision` costs and buys (see the concepts page, \"Convolution precision\"): "
    "one training-mode forward and backward of resnet20 on standard-normal 3x32x32 images, every "
    "parameter gradient against PyTorch's float64 gradient of the same network and inputs; a run's "
    "error is its worst tensor's largest difference divided by that tensor's largest float64 value. "
    "Each seed draws new weights and images. Regenerate with `python bench/precision.py --docs` "
    "(accuracy) and `python bench/precision.py --speed --docs` (speed).",
    "",
    "An error of 3e-3 to 1e-1 is a ReLU whose input lay within rounding of zero and switched in "
    "float32 (BatchNorm in training mode spreads it over the batch); below 1e-4 no ReLU switched. "
    "Larger batches hold more inputs near zero, so at batch 32 and 128 most runs of every float32 "
    "implementation switch one, PyTorch's included: there the seeds' spread, not the algorithm, "
    "sets the figures. The acceptance rule checked below: the median and the worst over the seeds "
    "each within 10x of PyTorch float32's (bounds no lower than 1e-3).",
    "",
]


def _run_note(args_text: str) -> str:
    import datetime

    load = "/".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"*{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
            f"`python bench/precision.py {args_text}`, {os.cpu_count()} cores, load average at the start {load}.*")


def write_section(sub: str, lines: list[str], docs_dir: str) -> str:
    """Put ``lines`` (the ``### sub`` subsection) into docs/benchmarks.md's "Conv precision" section,
    keeping its other subsection; returns the page's path."""
    from make_docs import _top_sections, replace_section
    from parconv._io import atomic_open

    page = os.path.join(docs_dir, "benchmarks.md")
    with open(page, encoding="utf-8") as f:
        text = f.read()
    subs = {}
    for heading, body in _top_sections(text):
        if heading == SECTION:
            name = None
            for line in body:
                if line.startswith("### "):
                    name = line[4:].strip()
                    subs[name] = []
                if name is not None:
                    subs[name].append(line)
    subs[sub] = [f"### {sub}", ""] + lines
    body = list(INTRO)
    for name in ("Accuracy", "Speed"):
        if name in subs:
            body += [line for line in subs[name]] + ([""] if subs[name][-1] != "" else [])
    with atomic_open(page, "wb") as f:
        f.write(replace_section(text, SECTION, body).encode("utf-8"))
    return page


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
    ap.add_argument("--docs", action="store_true", help="write the results into docs/benchmarks.md")
    ap.add_argument("--json", help="also save the accuracy table to this file")
    ap.add_argument("--merge", help="comma-separated --json files to report (and with --docs, write) "
                    "instead of measuring: batches measured by separate processes")
    ap.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"))
    args = ap.parse_args(argv)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
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
        note = _run_note(args_text)
        out = speed(args.net, batches, settings, args.threads, args.repeat, log)
        base = "high" if "high" in settings else settings[0]
        wait = os.environ.get("OMP_WAIT_POLICY", "unset")
        lines = [note, "", f"{args.net} training step (forward, backward, SGD with momentum) on openmp at "
                 f"{args.threads} threads (OMP_WAIT_POLICY {wait}), the settings interleaved; median of "
                 f"{args.repeat} steps each in wall and in process CPU time, and the medians of the "
                 f"per-repetition ratios to `{base}` (the default).", "",
                 f"| batch | setting | wall ms | CPU ms | wall / {base} | CPU / {base} |",
                 "| ---: | --- | ---: | ---: | ---: | ---: |"]
        for batch, runs in out.items():
            for s in settings:
                rw = statistics.median([a / b for a, b in zip(runs[s][0], runs[base][0])])
                rc = statistics.median([a / b for a, b in zip(runs[s][1], runs[base][1])])
                lines.append(f"| {batch} | {s} | {1e3 * statistics.median(runs[s][0]):.1f} | "
                             f"{1e3 * statistics.median(runs[s][1]):.1f} | {rw:.3f} | {rc:.3f} |")
                log(f"batch {batch}: {s} / {base}, medians of paired ratios: wall {rw:.3f}, CPU {rc:.3f}")
        if args.docs:
            log(f"wrote {write_section('Speed', lines, args.docs_dir)}")
        return 0
    use_torch = have_torch() and not args.no_torch
    if args.docs and not use_torch:
        ap.error("--docs needs PyTorch (the float64 oracle and the float32 comparison)")
    note = _run_note(args_text)
    if args.merge:
        import json

        table, notes = {}, []
        for path in args.merge.split(","):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            notes.append(saved["note"])
            table.update({int(b): rows for b, rows in saved["table"].items()})
        note = "\n\n".join(notes)  # how each part was measured
        table = dict(sorted(table.items()))
        args.seeds = min(len(v) for rows in table.values() for v in rows.values())
    else:
        pc.set_num_threads(args.threads)
        if use_torch:
            import torch

            torch.set_num_threads(args.threads)
        table = accuracy(args.net, batches, args.seeds, settings, use_torch, not args.no_numpy, log)
    if args.json:
        import json

        from parconv._io import atomic_open

        with atomic_open(args.json, "wb") as f:
            f.write(json.dumps({"note": note, "table": table}).encode("utf-8"))
    title = (f"{args.net}, worst-tensor gradient error vs float64 "
             f"({'PyTorch' if use_torch else 'NumPy reference'}), {args.seeds} seed{'s' if args.seeds > 1 else ''} per batch size, "
             f"median / worst over the seeds (in brackets: the seeds above 1e-4, where a ReLU switched); openmp at {args.threads} thread{'s' if args.threads > 1 else ''}")
    lines = [note, "", title + ":", "", markdown(table, args.seeds), ""]
    if use_torch:
        verdicts = []
        for batch, rows in table.items():
            for c in rows:
                if c.startswith("openmp"):
                    ok = within_bound(rows[c], rows["pytorch fp32"])
                    verdicts.append(f"batch {batch} {c.split()[1]}: {'within' if ok else '**not** within'}")
        lines.append("Within 10x of PyTorch float32: " + "; ".join(verdicts) + ".")
    log("\n" + "\n".join(lines))
    if args.docs:
        log(f"wrote {write_section('Accuracy', lines, args.docs_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
