#!/usr/bin/env python
"""Peak memory of a training step, parconv against PyTorch, each in a fresh process.

::

    python bench/peak_memory.py                          # resnet20, batch 128, 5 steps, 2 threads
    python bench/peak_memory.py --net vgg-small --batch 64 --steps 3 --threads 1

tracemalloc sees neither the kernels' buffers nor PyTorch's, so each
framework runs in its own subprocess and reports its resident set size
(RSS): after the imports, the model, the optimizer and the input are built
(the baseline), and its high-water mark after ``--steps`` training steps. On
Linux the high-water mark is reset to the current RSS at the baseline
(``/proc/self/clear_refs``), so what the imports touched and gave back does
not count; elsewhere ``ru_maxrss`` is used as it is. The figure compared is the
peak minus the baseline: the memory a training step needs on top of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

FRAMEWORKS = ("parconv", "torch")


def _status_kib(field: str) -> int | None:
    """A ``Vm*`` line of /proc/self/status in KiB (None where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux); whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_kib() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB elsewhere


def measure(framework: str, net: str, batch: int, steps: int, threads: int, backend: str = "openmp",
            size: int | None = None) -> dict:
    """Run ``steps`` training steps of ``net`` in this process; memory figures in MiB."""
    import numpy as np

    import workloads as W

    case = W.Nets()._case(net, "train", batch, size)
    inp = case.inputs(case.params)
    if framework == "torch":
        import torch

        torch.set_num_threads(threads)
        template, _ = W.build_net(net, "numpy", size=size)
        model = W.twins.twin(template, inp["state"])
        del template
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=W.NETS_LR, momentum=W.NETS_MOMENTUM)
        loss_fn = torch.nn.CrossEntropyLoss()
        x, y = torch.from_numpy(inp["x"]), torch.from_numpy(inp["y"].astype(np.int64))

        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
    elif framework == "parconv":
        import parconv as pc

        pc.set_num_threads(threads)
        be = pc.backends.get(backend)
        model, _ = W.build_net(net, be, size=size)
        model.load_state_dict(inp["state"])
        model.train()
        opt = pc.optim.SGD(model.parameters(), lr=W.NETS_LR, momentum=W.NETS_MOMENTUM)
        loss_fn = pc.SoftmaxCrossEntropy()
        x = be.asarray(inp["x"])
        y = loss_fn.prepare_target(inp["y"], batch, be)

        def step():
            loss = loss_fn.forward(model.forward(x), y, backend=be)
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
            be.synchronize()
            return loss
    else:
        raise ValueError(f"peak_memory: framework must be one of {FRAMEWORKS}, got {framework!r}")
    del inp
    import gc

    gc.collect()
    reset = _reset_peak()
    base = _status_kib("VmRSS") if reset else _maxrss_kib()
    losses = [float(step()) for _ in range(steps)]
    peak = _status_kib("VmHWM") if reset else _maxrss_kib()
    mib = 1.0 / 1024
    return {"framework": framework, "backend": backend if framework == "parconv" else None, "net": net,
            "batch": batch, "steps": steps, "threads": threads, "size": size,
            "baseline_mib": base * mib, "peak_mib": peak * mib, "step_mib": (peak - base) * mib,
            "method": "VmHWM reset at the baseline" if reset else "ru_maxrss", "last_loss": losses[-1]}


def run(net: str = "resnet20", batch: int = 128, steps: int = 5, threads: int = 2, backend: str = "openmp",
        size: int | None = None, frameworks=FRAMEWORKS, timeout: float = 900) -> dict:
    """Measure each framework in a fresh subprocess; ``{"rows": [...], "ratio": parconv / torch step memory}``.

    A framework that cannot run (PyTorch not installed) gets a row with ``error``.
    """
    rows = []
    for fw in frameworks:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw, "--net", net, "--batch", str(batch),
               "--steps", str(steps), "--threads", str(threads), "--backend", backend]
        if size is not None:
            cmd += ["--size", str(size)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            rows.append({"framework": fw, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]})
        else:
            rows.append(json.loads(lines[-1]))
    by = {r["framework"]: r for r in rows if "error" not in r}
    ratio = None
    if "parconv" in by and "torch" in by and by["torch"]["step_mib"] > 0:
        ratio = by["parconv"]["step_mib"] / by["torch"]["step_mib"]
    return {"net": net, "batch": batch, "steps": steps, "threads": threads, "rows": rows, "ratio": ratio}


def format_result(res: dict) -> str:
    lines = [f"peak memory | {res['net']} training step, batch {res['batch']}, {res['steps']} steps, "
             f"{res['threads']} threads, each framework in a fresh process"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"  {r['framework']:8s} failed: {r['error']}")
            continue
        name = r["framework"] + (f" ({r['backend']})" if r.get("backend") else "")
        lines.append(f"  {name:18s} baseline {r['baseline_mib']:8.1f} MiB  peak {r['peak_mib']:8.1f} MiB  "
                     f"step {r['step_mib']:8.1f} MiB  [{r['method']}]")
    if res.get("ratio") is not None:
        lines.append(f"  parconv step memory / PyTorch's = {res['ratio']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="resnet20", help="a zoo network or mlp (default resnet20)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="openmp", help="parconv backend (default openmp)")
    p.add_argument("--size", type=int, default=None, help="image side of the 3x32x32 networks (tiny runs)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--worker", choices=FRAMEWORKS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.threads < 1:
        raise SystemExit("peak_memory.py: --batch, --steps and --threads must be >= 1")
    if args.worker:
        print(json.dumps(measure(args.worker, args.net, args.batch, args.steps, args.threads, args.backend,
                                 args.size)))
        return 0
    res = run(args.net, args.batch, args.steps, args.threads, args.backend, args.size)
    print(format_result(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
