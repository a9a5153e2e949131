"""int8 rows of the ``nets`` workload (``bench/run.py --workloads nets --precision fp32,int8``).

For each zoo network (and the 784-512-512-10 MLP) at batch 1 and 64: parconv
fp32 inference, parconv int8 (:func:`parconv.quantization.quantize`), PyTorch
fp32 and PyTorch int8 (static quantization with the ``"x86"`` qconfig through
``torch.ao.quantization``'s FX graph mode for the CNNs; dynamic quantization
for the MLP), timed interleaved on the same threads. Every implementation's
answer is checked before it is timed: the fp32 twins against parconv's fp32
output, each int8 model against its fp32 model (arg-max agreement and largest
error), on calibrated random-weight networks. Outside ``--quick``, the
accuracy part trains each network briefly on the bundled MNIST sample and
reports the held-out accuracy of fp32 and int8 after calibration on 512
training images.
"""

from __future__ import annotations

import os
import time

import numpy as np

import harness
import twins  # imports torch only when a twin is built
import parconv as pc
from parconv import quantization as Q

NETS = ("lenet5", "vgg-small", "resnet20", "mobilenet-small", "mlp")
QUICK_NETS = ("lenet5", "resnet20", "mlp")
HERE = os.path.dirname(os.path.abspath(__file__))
#: an int8 answer passes when at least this share of arg-maxes agree with fp32 and the largest error is within
#: this share of the largest fp32 output
MIN_AGREEMENT, MAX_ERROR = 0.9, 0.05


def _mlp(backend, rng=0):
    model = pc.Sequential(pc.Flatten(), pc.Linear(784, 512, rng=rng), pc.ReLU(), pc.Linear(512, 512, rng=rng + 1),
                          pc.ReLU(), pc.Linear(512, 10, rng=rng + 2), backend=backend)
    model.input_shape = (1, 28, 28)
    return model


def build(name: str, backend, input_shape=None):
    if name == "mlp":
        return _mlp(backend)
    return pc.models.build(name, input_shape=input_shape, backend=backend, rng=0)


def _with_batchnorm_statistics(model, rng):
    """Running statistics from a few training-mode passes, so that folding them is not the identity."""
    model.train()
    with pc.no_grad():
        for _ in range(3):
            model(rng.random((32,) + model.input_shape, dtype=np.float32))
    return model.eval()


class _Call:
    """A runner of the harness protocol around one inference call."""

    restartable = False

    def __init__(self, fn):
        self.fn = fn

    def prepare(self):
        pass

    def run(self):
        self.fn()

    def sync(self):
        pass


def _torch_int8(twin, x_cal: np.ndarray, mlp: bool):
    import torch

    if mlp:
        return torch.ao.quantization.quantize_dynamic(twin, {torch.nn.Linear}, dtype=torch.qint8)
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = "x86"
    example = (torch.from_numpy(x_cal[:1]),)
    prepared = prepare_fx(twin, get_default_qconfig_mapping("x86"), example)
    with torch.inference_mode():
        for s in range(0, len(x_cal), 64):
            prepared(torch.from_numpy(x_cal[s:s + 64]))
    return convert_fx(prepared)


def _agreement(got: np.ndarray, want: np.ndarray) -> dict:
    err = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12))
    agree = float((got.argmax(1) == want.argmax(1)).mean())
    return {"agreement": agree, "error": err, "ok": bool(agree >= MIN_AGREEMENT and err <= MAX_ERROR)}


def run_int8(args, threads: list, with_torch: bool, log) -> dict:
    """Check and time fp32 vs int8 inference per network, batch and thread count; returns the results dict."""
    rng = np.random.default_rng(0)
    backend = "openmp" if "openmp" in pc.available_backends() else "numpy"
    nets = getattr(args, "nets", None) or (QUICK_NETS if args.quick else NETS)
    batches = (1, 4) if args.quick else (1, 64)
    out = {"int8_path": Q.int8_path(), "backend": backend, "batches": list(batches), "nets": [], "failed": False}
    log(f"int8 inference (parconv's int8 path: {out['int8_path']}; PyTorch int8: static x86 quantization for the "
        f"CNNs, dynamic for the MLP)")
    for name in nets:
        model = _with_batchnorm_statistics(build(name, backend), rng)
        shape = model.input_shape
        x_cal = rng.random((32 if args.quick else 512,) + shape, dtype=np.float32)
        x_chk = rng.random((64,) + shape, dtype=np.float32)
        qmodel = Q.quantize(model, x_cal)
        want = model.predict(x_chk)
        entry = {"net": name, "checks": {"parconv-int8": _agreement(qmodel.predict(x_chk), want)}, "rows": []}
        impls = {"parconv-fp32": "parconv", "parconv-int8": "parconv"}
        models = {"parconv-fp32": model, "parconv-int8": qmodel}
        if with_torch:
            import torch

            tf = twins.twin(model).eval()
            with torch.inference_mode():
                got = tf(torch.from_numpy(x_chk)).numpy()
            entry["checks"]["torch-fp32"] = dict(_agreement(got, want), ok=bool(np.abs(got - want).max()
                                                                                 <= 1e-3 * np.abs(want).max()))
            try:
                tq = _torch_int8(twins.twin(model).eval(), x_cal, name == "mlp")
                with torch.inference_mode():
                    entry["checks"]["torch-int8"] = _agreement(tq(torch.from_numpy(x_chk)).numpy(), want)
                models.update({"torch-fp32": tf, "torch-int8": tq})
                impls.update({"torch-fp32": "torch", "torch-int8": "torch"})
            except Exception as exc:  # noqa: BLE001 - PyTorch's quantization may not run here: say so
                entry["torch_int8_error"] = repr(exc)
                models["torch-fp32"], impls["torch-fp32"] = tf, "torch"
        for impl, check in entry["checks"].items():
            if not check["ok"]:
                out["failed"] = True
                log(f"  CHECK FAILED {name} {impl}: {check}")
        timed_impls = [i for i in models if entry["checks"].get(i, {"ok": True})["ok"]]
        for batch in batches:
            xb = rng.random((batch,) + shape, dtype=np.float32)
            runners = {}
            for impl in timed_impls:
                m = models[impl]
                if impls[impl] == "torch":
                    import torch

                    xt = torch.from_numpy(xb)

                    def fn(m=m, xt=xt):
                        with torch.inference_mode():
                            m(xt)
                else:
                    xa = m.backend.asarray(xb)

                    def fn(m=m, xa=xa):
                        with pc.no_grad():
                            m.forward(xa)
                for t in threads:
                    runners[harness.Config(impl, t)] = _Call(fn)
            for r in runners.values():  # each runner once before timing (the harness's contract)
                r.run()
            timed = harness.interleaved(runners, impls, args.repeat, args.warmup, args.min_time, settle=False,
                                        gap=args.gap, idle_wait=args.idle_wait)
            for t in threads:
                med = {i: harness.summarize(timed[harness.Config(i, t)].times)["median"] for i in timed_impls}
                row = {"batch": batch, "threads": t, "median_ms": {i: 1e3 * v for i, v in med.items()}}
                if "parconv-int8" in med:
                    row["int8_vs_fp32"] = med.get("parconv-fp32", 0) / med["parconv-int8"]
                    for other in ("torch-fp32", "torch-int8"):
                        if other in med:
                            row[f"int8_vs_{other}"] = med[other] / med["parconv-int8"]
                entry["rows"].append(row)
                cells = "  ".join(f"{i} {1e3 * v:8.3f} ms" for i, v in med.items())
                ratios = "  ".join(f"{k} {v:.2f}x" for k, v in row.items() if k.startswith("int8_vs"))
                log(f"  {name:16s} batch {batch:3d} @{t}  {cells}  | {ratios}")
        out["nets"].append(entry)
    if not args.quick:
        out["accuracy"] = accuracy(nets, log)
    return out


def accuracy(nets, log, epochs: int = 1) -> list:
    """Held-out accuracy on the bundled MNIST sample: fp32 after brief training, int8 after calibration."""
    x, y = pc.datasets.load_mnist("test")
    x_train, y_train, x_test, y_test = x[:6000], y[:6000], x[8000:], y[8000:]
    rows = []
    for name in nets:
        t0 = time.perf_counter()
        model = build(name, "openmp" if "openmp" in pc.available_backends() else "numpy", input_shape=(1, 28, 28))
        model.fit(x_train, y_train, epochs=epochs, batch_size=64, verbose=False, seed=0,
                  optimizer=pc.optim.Adam(model.parameters(), lr=2e-3))
        fp32 = model.evaluate(x_test, y_test)["accuracy"]
        qmodel = Q.quantize(model, x_train[:512])
        int8 = qmodel.evaluate(x_test, y_test)["accuracy"]
        row = {"net": name, "fp32": fp32, "int8": int8, "drop_points": 100 * (fp32 - int8),
               "train_images": len(x_train), "test_images": len(x_test), "calibration_images": 512,
               "epochs": epochs, "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"  accuracy {name:16s} fp32 {100 * fp32:6.2f}%  int8 {100 * int8:6.2f}%  "
            f"drop {row['drop_points']:+.2f} points")
    return rows


HEADING = "## int8 inference"


def docs_section(out: dict, command: str, note: str = "") -> list:
    """The "## int8 inference" section of docs/benchmarks.md from :func:`run_int8`'s results."""
    lines = [HEADING, "",
             "parconv int8 inference (`pc.quantization.quantize`, calibrated on random inputs for the timings) "
             "against parconv fp32, PyTorch fp32 and PyTorch's int8 (static quantization with the `x86` qconfig "
             "through `torch.ao.quantization`'s FX mode for the CNNs, dynamic for the MLP), timed interleaved on the "
             f"same threads; every int8 answer is checked against its fp32 model first. parconv's int8 path here: "
             f"**{out['int8_path']}**" + (" (the float kernels on integer-valued arrays: exact, and no faster than "
                                          "fp32; the native int8 kernels are what make int8 fast)"
                                          if out["int8_path"] == "float32 emulation" else "") + ".", ""]
    if note:
        lines += [f"*{note}*", ""]
    lines += [f"*`{command}`*", "",
              "| net | batch | threads | parconv fp32 ms | parconv int8 ms | PyTorch fp32 ms | PyTorch int8 ms "
              "| int8 / fp32 | int8 vs PyTorch fp32 | int8 vs PyTorch int8 |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    ratio = lambda v: "–" if v is None else f"{v:.2f}x"  # noqa: E731
    for entry in out["nets"]:
        for r in entry["rows"]:
            ms = r["median_ms"]
            lines.append(f"| {entry['net']} | {r['batch']} | {r['threads']} | {fmt(ms.get('parconv-fp32'))} | "
                         f"{fmt(ms.get('parconv-int8'))} | {fmt(ms.get('torch-fp32'))} | {fmt(ms.get('torch-int8'))} | "
                         f"{ratio(r.get('int8_vs_fp32'))} | {ratio(r.get('int8_vs_torch-fp32'))} | "
                         f"{ratio(r.get('int8_vs_torch-int8'))} |")
    lines += ["", "Answers (64 random inputs; error: largest difference over the largest fp32 output):", "",
              "| net | parconv int8: arg-max agreement | error | PyTorch int8: agreement | error |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for entry in out["nets"]:
        p, t = entry["checks"]["parconv-int8"], entry["checks"].get("torch-int8")
        lines.append(f"| {entry['net']} | {100 * p['agreement']:.1f}% | {p['error']:.4f} | "
                     + (f"{100 * t['agreement']:.1f}% | {t['error']:.4f} |" if t else "– | – |"))
    if out.get("accuracy"):
        a0 = out["accuracy"][0]
        lines += ["", f"Held-out accuracy on the bundled MNIST sample (1x28x28): each network trained "
                      f"{a0['epochs']} epoch(s) in fp32 on {a0['train_images']:,} images (Adam, lr 2e-3, batch 64), "
                      f"quantized with {a0['calibration_images']} of those images for calibration, both evaluated on "
                      f"{a0['test_images']:,} other images:", "",
                  "| net | fp32 | int8 | drop (points) |", "| --- | ---: | ---: | ---: |"]
        for a in out["accuracy"]:
            lines.append(f"| {a['net']} | {100 * a['fp32']:.2f}% | {100 * a['int8']:.2f}% | {a['drop_points']:+.2f} |")
    return lines + [""]


def main(argv=None) -> int:
    """``python bench/quantized.py``: the int8 rows alone (``bench/run.py --precision int8`` adds them to a
    nets run); ``--docs`` writes their section of docs/benchmarks.md."""
    import argparse
    import json
    import sys

    from machine import machine_info, summary_line
    from parconv._io import atomic_open

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny batches and two nets: checks answers only")
    p.add_argument("--no-accuracy", action="store_true", help="skip the MNIST-sample accuracy part")
    p.add_argument("--no-torch", action="store_true", help="parconv only")
    p.add_argument("--nets", default=None,
                   help=f"comma-separated subset of {','.join(NETS)} (default: all; --quick: {','.join(QUICK_NETS)})")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    if args.nets is not None:
        args.nets = tuple(n.strip() for n in args.nets.split(",") if n.strip())
        unknown = [n for n in args.nets if n not in NETS]
        if unknown or not args.nets:
            raise SystemExit(f"bench/quantized.py: --nets takes names from {', '.join(NETS)}, got "
                             f"{', '.join(unknown) or 'nothing'}")
    if args.repeat < 1 or args.warmup < 0 or not threads or min(threads) < 1:
        raise SystemExit("bench/quantized.py: --repeat >= 1, --warmup >= 0 and positive --threads, please")
    args.min_time, args.gap, args.idle_wait = (0.0, 0.0, 0.0) if args.quick else (0.05, 0.01, 0.5)
    try:
        import torch  # noqa: F401
        with_torch = not args.no_torch
    except ImportError:
        with_torch = False
    info = machine_info({"openmp": pc.backends.get("openmp")} if "openmp" in pc.available_backends() else {},
                        with_torch)
    print(summary_line(info))
    global accuracy
    if args.no_accuracy:
        accuracy = lambda nets, log, epochs=1: []  # noqa: E731
    out = run_int8(args, threads, with_torch, print)
    command = "python bench/quantized.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json:
        with atomic_open(args.json, "w") as f:
            json.dump({"command": command, "machine": info, "int8": out}, f, indent=1, default=float)
    if args.docs:
        from make_docs import hand_written_tail, replace_section

        page = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")
        with open(page, encoding="utf-8") as f:
            text = f.read()
        note = f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {summary_line(info)}"
        with atomic_open(page, "w") as f:
            body = docs_section(out, command, note)
            tail = hand_written_tail(text, HEADING)
            f.write(replace_section(text, HEADING, body + ([""] if tail and body[-1] != "" else []) + tail))
        print(f"wrote {page}")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
