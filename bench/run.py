#!/usr/bin/env python
"""parconv benchmark suite: reproduce the studies' experiments and compare with PyTorch CPU.

Examples
--------
::

    python bench/run.py                                  # every workload, threads 1,2,4,..,cores
    python bench/run.py --threads 1,2 --backends openmp --workloads conv-large,cnn-mnist
    python bench/run.py --quick                          # tiny shapes, checks answers only (the test suite)
    python bench/run.py --docs                           # full run, then regenerate docs/benchmarks.md
    python bench/run.py --passes 3 --repeat 9            # 3 passes over the suite, 3 repetitions each
    python bench/run.py --wait-cores 5                   # a VM: time n threads only when they get n cores
    python bench/run.py --workloads nets --threads 1,2 --docs   # the zoo vs PyTorch; updates its docs section
    python bench/run.py --workloads nets --precision fp32,bf16  # + parconv and PyTorch bf16 autocast, interleaved
    mpiexec -n 4 python bench/run.py --workloads data-parallel,conv-large-mpi

For every case the suite checks each implementation against the NumPy oracle
on a small size, then at the timed size against the NumPy answer (or, when
NumPy is not timed, PyTorch's), warms up, and times the compared
implementations interleaved (repetition ``r`` runs every config once, in an
order rotated by ``r``). It reports median, min and max, GFLOP/s, speedup and
efficiency vs 1 thread and ratios vs the other implementations at equal
threads (paired per repetition). A config whose answer is wrong is not timed
and makes the exit status 1.

With ``--passes P`` the suite runs P times over every case and the ``--repeat``
repetitions are split between the passes (each pass checks and warms up
again); a case's samples are then pooled. Its repetitions lie minutes apart
instead of seconds, so a burst of load from outside the process (a busy
neighbour on a shared or virtualised machine) touches a few of them instead
of all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)

import numpy as np  # noqa: E402

try:  # prefer the installed parconv; fall back to this checkout when it is not installed
    import parconv as pc
except ImportError:
    sys.path.insert(1, ROOT)
    import parconv as pc

import harness  # noqa: E402
from parconv._io import atomic_open  # noqa: E402
import targets as targets_mod  # noqa: E402
import workloads as W  # noqa: E402
from harness import DEFAULT_THREADS, Config, compare_answers, thread_scope  # noqa: E402
from machine import machine_info, physical_cores, reference_scaling, scaling_line, summary_line  # noqa: E402

SCHEMA = 1


# ============================================================================ options
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def default_threads() -> list[int]:
    cores = pc._config._cpu_count()
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return sorted(set(out + [cores]))


def _cores() -> int:
    """Physical cores this process may use: what the core probe can expect threads to get."""
    n = pc._config._cpu_count()
    phys = physical_cores()
    return min(n, phys) if phys else n


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="workloads: " + ", ".join(W.LOCAL_WORKLOADS) + " (default: all of these); MPI (run under "
               "mpiexec): " + ", ".join(W.MPI_WORKLOADS))
    p.add_argument("--threads", type=_int_list, default=None,
                   help="thread counts, e.g. 1,2,4 (default: 1, 2, 4, ... and the core count; 1 is always added)")
    p.add_argument("--backends", type=_name_list, default=None,
                   help="parconv backends to time (default: every available one; unavailable ones are skipped)")
    p.add_argument("--workloads", type=_name_list, default=None, help="comma-separated workload names, or 'all'")
    p.add_argument("--precision", type=_name_list, default=["fp32"], metavar="fp32,bf16,int8",
                   help="precisions to time, comma-separated (default fp32): bf16 adds each parconv backend under "
                        "pc.autocast('bf16') and PyTorch under torch.autocast('cpu', dtype=torch.bfloat16), "
                        "timed interleaved with fp32 on the workloads that take it (nets) and checked against "
                        "a bf16 tolerance; int8 (with the nets workload) adds parconv int8 inference after "
                        "pc.quantization.quantize and PyTorch's int8 next to fp32 (bench/quantized.py)")
    p.add_argument("--compare", default="auto", choices=("auto", "torch", "none"),
                   help="time PyTorch CPU alongside (auto: when it is installed), and PyTorch CUDA "
                        "(float32, TF32 off) where a CUDA GPU is visible")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions per config (default 7; --quick: 1)")
    p.add_argument("--passes", type=int, default=1,
                   help="run the whole suite this many times and split --repeat between the passes, pooling "
                        "each case's samples, so its repetitions are spread over the run (default 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls per config (default 2; --quick: 1)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds one sample lasts at least; shorter calls are repeated and averaged "
                        "(default 0.05; --quick: 0)")
    p.add_argument("--no-settle", action="store_true",
                   help="time each sample without the untimed settling call of the same config before it "
                        "(halves the run time; the previous config's cache and allocator state then leak in)")
    p.add_argument("--gap", type=float, default=None,
                   help="untimed pause between configs in seconds, so the previous runtime's spinning idle "
                        "threads go to sleep (default 0.01; --quick: 0)")
    p.add_argument("--idle-wait", type=float, default=None, metavar="SECONDS",
                   help="before each sample, wait up to this long until this process's own threads are idle "
                        "(an OpenBLAS worker spins ~0.1 s after a call and would take a core from the next "
                        "config; default 0.5; --quick: 0)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before timing each case, wait up to this long until other processes use less than "
                        "0.2 cores (for shared machines; default 0: do not wait)")
    p.add_argument("--wait-cores", type=float, default=0.0, metavar="SECONDS",
                   help="before each sample on n > 1 threads, wait up to this long until a probe (the BLAS's "
                        "matmul on n threads against 1) runs at least 0.8n times faster: for virtual machines "
                        "whose host at times runs two vCPUs on one physical core (default 0: do not wait)")
    p.add_argument("--serial-max-s", type=float, default=1.0,
                   help="the serial NumPy baseline is timed with one call only where that call takes longer "
                        "than this many seconds (default 1.0)")
    p.add_argument("--cases", type=_name_list, default=None, metavar="TEXT,...",
                   help="time only the cases whose name contains one of these strings (e.g. 'training step "
                        "batch=32'); with --docs their rows replace or join those of the page's tables")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, one repetition: checks every answer, timings mean nothing (used by the tests)")
    p.add_argument("--filters", type=_int_list, default=None, help="cnn-mnist filter sweep (default 32,64,128,256)")
    p.add_argument("--batches", type=_int_list, default=None, help="cnn-mnist batch sweep (default 100,250,500,1000)")
    p.add_argument("--no-amdahl", action="store_true", help="skip the Amdahl analysis")
    p.add_argument("--no-memory", action="store_true",
                   help="with the nets workload: skip the peak-memory comparison of a resnet20 training step "
                        "(bench/peak_memory.py)")
    p.add_argument("--target-backend", default="openmp", help="backend the targets are evaluated for")
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="output directory (results.json, PNGs)")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--docs", action="store_true",
                   help="after the run, regenerate docs/benchmarks.md and docs/_static/bench/ from it (a run of "
                        "some workloads only replaces their sections of the page)")
    p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"), help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ============================================================================ console
class Progress:
    """A tqdm bar on stderr (a no-op when disabled); ``write`` prints above it."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True, leave=False)

    def step(self, n: int = 1):
        if self.bar is not None:
            self.bar.update(n)

    def describe(self, text: str):
        if self.bar is not None:
            self.bar.set_description(text, refresh=True)

    def write(self, text: str = ""):
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fmt(v, spec, none="-"):
    return none if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def format_case_table(workload: str, case: dict, impls: list[str]) -> str:
    flops = case.get("flops")
    head = f"{workload} | {case['name']}" + (f" | {case['note']}" if case.get("note") else "")
    if flops:
        head += f" | {flops / 1e9:.3g} GFLOP"
    checks = case.get("checks", [])
    n_ok = sum(c["ok"] for c in checks)
    head += f" | checks {n_ok}/{len(checks)} ok"
    if case.get("background_cores") is not None:
        head += f" | other processes used {case['background_cores']:.2f} cores"
    if case.get("reference_speedup"):
        head += " | machine reference " + ", ".join(f"{v:.2f}x@{t}" for t, v in case["reference_speedup"].items())
    probed = [r for r in case.get("results", []) if r.get("core_probe")]
    if probed:
        probes = [p for r in probed for p in r["core_probe"] if p is not None]
        head += (f" | core probe {statistics.median(probes):.2f}x (median), waited "
                 f"{sum(r.get('core_wait_s') or 0.0 for r in probed):.1f} s" if probes else "")
    lines = [head]
    others = [i for i in impls if any(f"vs_{i}" in r for r in case["results"])]
    cols = ["config", "median ms", "min ms", "max ms", "GFLOP/s", f"{case.get('item_unit', 'items')}/s",
            "speedup", "eff"] + [f"vs {o}" for o in others]
    table = [cols]
    for r in case["results"]:
        row = [r["config"] + (" (1 call)" if r.get("single_call") else ""),
               _fmt(r["median"] and 1e3 * r["median"], ".3f"), _fmt(r["min"] and 1e3 * r["min"], ".3f"),
               _fmt(r["max"] and 1e3 * r["max"], ".3f"),
               _fmt(r.get("gflops"), ".2f"), _fmt(r.get("items_per_s"), ".4g"),
               _fmt(r.get("speedup"), ".2f"), _fmt(r.get("efficiency"), ".2f")]
        row += [_fmt(r.get(f"vs_{o}"), ".2f") for o in others]
        table.append(row)
    widths = [max(len(str(t[i])) for t in table) for i in range(len(cols))]
    for t in table:
        lines.append("  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                                      enumerate(zip(t, widths))))
    for s in case.get("skipped", []):
        lines.append(f"  skipped {s['config']}: {s['reason']}")
    for c in checks:
        if not c["ok"]:
            lines.append(f"  CHECK FAILED {c['config']} ({c['size']} size): {c['message']}")
    breakdown = [r for r in case["results"] if r.get("breakdown_s")]
    if breakdown:
        keys = list(breakdown[0]["breakdown_s"])
        lines.append("  per-layer median ms: " + ", ".join(r["config"] for r in breakdown))
        w = max(len(k) for k in keys)
        for k in keys:
            lines.append(f"    {k.ljust(w)}  "
                     + "  ".join(f"{1e3 * r['breakdown_s'].get(k, 0.0):9.3f}" for r in breakdown))
    return "\n".join(lines)


def format_amdahl(a: dict) -> str:
    lines = [f"Amdahl | {a['workload']} {a['case']} [{a['impl']}] | parallel (kernel) fraction p = {a['p']:.4f}, "
             f"serial 1-p = {a['serial_fraction']:.4f}"]
    cols = ["threads", "step ms", "kernel ms", "serial ms", "kernel %", "measured S", "Amdahl S", "Karp-Flatt e"]
    table = [cols]
    for r in a["rows"]:
        table.append([str(r["threads"]), _fmt(1e3 * r["total_s"], ".3f"), _fmt(1e3 * r["kernel_s"], ".3f"),
                      _fmt(1e3 * r["serial_s"], ".3f"), _fmt(100 * r["kernel_fraction"], ".1f"),
                      _fmt(r["measured_speedup"], ".2f"), _fmt(r["amdahl_bound"], ".2f"),
                      _fmt(r["karp_flatt"], ".4f")])
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
    return "\n".join(lines)


def format_targets(entries: list[dict]) -> str:
    if not entries:
        return "targets: none evaluated"
    lines = ["targets (paired median ratios from one interleaved run):"]
    for e in entries:
        state = {True: "MET   ", False: "MISSED", None: "n/a   "}[e["ok"]]
        noise = e.get("within_noise")
        extra = f" equal within noise, 95% interval {noise[0]:.2f}-{noise[1]:.2f}" if noise else ""
        if e.get("reference") is not None:
            extra += f" (machine reference {e['reference']:.2f}x)"
        if e.get("core_probe") is not None:
            extra += f" (core probe {e['core_probe']:.2f}x, waited {e.get('core_wait_s') or 0.0:.1f} s)"
        lines.append(f"  {state} {e['workload']:13s} {e['case']:22s} {e['target']:45s} "
                     f"{_fmt(e['value'], '.2f'):>6s} (need >= {e['threshold']}) [{e['config']}]{extra}")
    s = targets_mod.summary(entries)
    lines.append(f"  {s['met']} met, {s['missed']} missed, {s['not_measured']} not measured")
    return "\n".join(lines)


# ============================================================================ running
#: the precision whose rows bench/quantized.py times (inference of a quantized model, not a scope)
INT8 = "int8"


def resolve_precisions(args, progress_print) -> tuple[list, list]:
    """The ``--precision`` entries this suite times (fp32 first) and the others, each with a reason."""
    wanted, skipped = [], []
    names = list(dict.fromkeys(p.lower() for p in getattr(args, "precision", ["fp32"])))
    for name in names:
        if name in W.PRECISIONS:
            wanted.append(name)
            continue
        if name == INT8:
            continue  # its own rows (run_int8_rows), next to the fp32 ones

        reason = (f"no {name} rows in this suite (timed precisions: {', '.join(W.PRECISIONS)})")
        skipped.append({"precision": name, "reason": reason})
        progress_print(f"skipping --precision {name}: {reason}")
    if not wanted and INT8 in names:
        wanted = ["fp32"]  # int8 alone: its rows and the float32 suite they are compared with
    return sorted(wanted, key=W.PRECISIONS.index), skipped


def _with_precisions(impls, precisions) -> list:
    """``impls`` in each precision: fp32 as they are, bf16 as ``<name>-bf16`` (CPU implementations, not the
    NumPy oracle, which is bf16's small-size reference instead).

    A new precision is a name in ``workloads.PRECISIONS``, a ``precision_scope`` (or runner) that computes
    in it, and the workloads whose ``precisions`` list it; its impls are named ``<name>-<precision>``.
    """
    out = [i for i in impls] if "fp32" in precisions else [i for i in impls if i.name == "numpy"]
    for precision in precisions:
        if precision == "fp32":
            continue
        out += [W.Impl(f"{i.name}-{precision}", i.kind, i.backend, i.device, precision) for i in impls
                if i.name != "numpy" and i.device == "cpu"]
    return out


def resolve_impls(args, progress_print) -> tuple[list, list]:
    """The implementations to time, and the ones skipped with a reason."""
    precisions, skipped = resolve_precisions(args, progress_print)
    if not precisions:
        raise SystemExit(f"bench/run.py: --precision {','.join(args.precision)} names no precision this suite "
                         f"times ({', '.join(W.PRECISIONS)})")
    impls, skipped_impls = _resolve_impls(args, progress_print)
    return _with_precisions(impls, precisions), skipped + skipped_impls


def _resolve_impls(args, progress_print) -> tuple[list, list]:
    impls, skipped = [], []
    names = args.backends if args.backends is not None else pc.backends.registered()
    for name in names:
        try:
            impls.append(W.Impl(name, "parconv", pc.backends.get(name)))
        except Exception as exc:  # noqa: BLE001 - an unavailable backend is skipped, not fatal
            reason = str(exc).split(". To install")[0]
            skipped.append({"impl": name, "reason": reason})
            if args.backends is not None:
                progress_print(f"skipping backend {name!r}: {reason}")
    if args.compare in ("auto", "torch"):
        try:
            import torch

            impls.append(W.Impl("torch", "torch"))
            if torch.cuda.is_available():  # the GPU comparison for the OpenCL backend
                impls.append(W.Impl("torch-cuda", "torch", device="cuda"))
        except ImportError:
            skipped.append({"impl": "torch", "reason": "PyTorch is not installed"})
            if args.compare == "torch":
                progress_print("skipping --compare torch: PyTorch is not installed")
    return impls, skipped


def configs_for(workload, impls, threads) -> list[Config]:
    out = []
    for impl in impls:
        if impl.precision not in workload.precisions:
            continue  # e.g. bf16 on a workload without bf16 runners
        if impl.name == "numpy" and not workload.numpy_timed:
            continue  # the small-size oracle only
        if (impl.kind == "parconv" and not impl.backend.host_arrays) or impl.device != "cpu":
            out.append(Config(impl.name, 0))  # a device: its own threads, one config
            continue
        serial = impl.name == "numpy" and not workload.numpy_all_threads
        for n in ([1] if serial else threads):
            out.append(Config(impl.name, n))
        if workload.times_default_threads and not serial:
            out.append(Config(impl.name, DEFAULT_THREADS))
    return out


def _kinds(impls):
    return {i.name: i.kind for i in impls}


def run_case(case, impls, threads, args, progress, repeat: int) -> tuple[dict, dict]:
    """Check and time one case with ``repeat`` repetitions: its result dict (no rows yet) and the
    :class:`harness.Timed` of every config (``harness.case_rows`` turns them into rows)."""
    wl = case.workload
    configs = configs_for(wl, impls, threads)
    by_name = {i.name: i for i in impls}
    kinds = _kinds(impls)
    numpy_impl = W.Impl("numpy", "parconv", pc.backends.get("numpy"))
    tol = case.extra.get("tol") or harness.DEFAULT_TOL
    full_tol = case.extra.get("full_tol") or tol
    bf16_tol = case.extra.get("bf16_tol") or harness.BF16_TOL

    def small_tol(c):
        # parconv's bf16 against the NumPy model of the same rounding (the workload says how closely);
        # PyTorch's autocast also rounds each layer's output to bf16, so it gets the bf16 tolerance
        impl = by_name[c.impl]
        if impl.precision == "fp32":
            return tol
        return bf16_tol if impl.kind == "torch" else case.extra.get("bf16_model_tol") or tol
    res = {"name": case.name, "params": case.params, "check_params": case.check_params, "note": case.note,
           "flops": case.flops, "items": case.items, "item_unit": case.item_unit, "checks": [], "skipped": [],
           "results": [], "full_size_reference": None, "tolerance": tol, "full_size_tolerance": full_tol}

    def skip(c, reason):
        res["skipped"].append({"config": c.label, "reason": reason})

    # 1. small size against the NumPy oracle
    progress.describe(f"{wl.name} {case.name}: checking")
    small_inp = case.inputs(case.check_params)
    oracle_ans = {}
    for precision in dict.fromkeys(by_name[c.impl].precision for c in configs):
        with thread_scope("parconv", 1):  # the NumPy oracle in each precision (bf16: the rounding model)
            oracle = case.runner(W.Impl("numpy", "parconv", numpy_impl.backend, precision=precision),
                                 case.check_params, small_inp)
            oracle.prepare()
            oracle.run()
            oracle_ans[precision] = oracle.answer()
        del oracle
    good = []
    for c in configs:
        try:
            with thread_scope(kinds[c.impl], c.threads):
                r = case.runner(by_name[c.impl], case.check_params, small_inp)
                r.prepare()
                r.run()
                r.sync()
                ans = r.answer()
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not stop the suite
            skip(c, f"{type(exc).__name__}: {exc}")
            res["checks"].append({"config": c.label, "size": "small", "ok": False, "max_err": None,
                                  "message": f"raised {type(exc).__name__}: {exc}"})
            continue
        precision = by_name[c.impl].precision
        cmp = compare_answers(ans, oracle_ans[precision], small_tol(c))
        res["checks"].append({"config": c.label, "size": "small", "reference": "numpy oracle"
                              + ("" if precision == "fp32" else f" ({precision})"), **cmp})
        if cmp["ok"]:
            good.append(c)
        else:
            skip(c, "wrong answer vs the NumPy oracle: " + cmp["message"])
        progress.step()
    del small_inp, oracle_ans

    # 2. timed size: build, run once, agree with the reference (NumPy when timed, else PyTorch)
    progress.describe(f"{wl.name} {case.name}: full-size check")
    inp = case.inputs(case.params)
    runners = {}
    for c in good:
        try:
            runners[c] = case.runner(by_name[c.impl], case.params, inp)
        except Exception as exc:  # noqa: BLE001
            skip(c, f"{type(exc).__name__} while building: {exc}")
    order = sorted(runners, key=lambda c: (by_name[c.impl].precision != "fp32", c.impl != "numpy",
                                           c.impl != "torch", c.threads, c.impl))
    ref_ans, ref_label = None, None
    first_call = {}
    for c in order:
        try:
            with thread_scope(kinds[c.impl], c.threads):
                runners[c].prepare()
                t0 = time.perf_counter()
                runners[c].run()
                runners[c].sync()
                first_call[c] = time.perf_counter() - t0
                ans = runners[c].answer()
        except Exception as exc:  # noqa: BLE001
            skip(c, f"{type(exc).__name__}: {exc}")
            del runners[c]
            continue
        progress.step()
        if ref_ans is None:
            ref_ans, ref_label = ans, c.label
            res["full_size_reference"] = ref_label
            continue
        # a bf16 answer against the float32 reference: within the bf16 tolerance
        cmp = compare_answers(ans, ref_ans, bf16_tol if by_name[c.impl].precision != "fp32" else full_tol)
        res["checks"].append({"config": c.label, "size": "full", "reference": ref_label, **cmp})
        if not cmp["ok"]:
            skip(c, f"full-size answer differs from {ref_label}: {cmp['message']}")
            del runners[c]
    del ref_ans

    # 3. interleaved timing; a serial NumPy baseline slower than --serial-max-s keeps its one call
    singles = {}
    for c in list(runners):
        if c.impl == "numpy" and not wl.numpy_all_threads and first_call.get(c, 0.0) > args.serial_max_s:
            singles[c] = harness.Timed(c, times=[first_call[c]], single=True)
            del runners[c]
            progress.step(max(args.warmup, 1) + repeat)
    timed = {}
    if runners:
        if args.wait_quiet > 0:
            progress.describe(f"{wl.name} {case.name}: waiting for other processes to go idle")
            res["quiet_wait"] = harness.wait_for_quiet(args.wait_quiet)
        progress.describe(f"{wl.name} {case.name}: timing")
        most = max(c.threads for c in runners)
        probe = not args.quick and most > 1
        before = reference_scaling([most], rounds=3) if probe else None
        opts = dict(gap=args.gap, idle_wait=args.idle_wait, wait_cores=args.wait_cores)
        if not args.quick:  # a workload's overrides are upper bounds on the command line's
            opts.update({k: min(opts[k], v) for k, v in wl.harness_overrides.items()})
        with wl.timing_context(case.params), harness.BackgroundLoad() as bg:
            timed = harness.interleaved(runners, kinds, repeat, args.warmup, args.min_time,
                                        settle=not (args.quick or args.no_settle), on_run=progress.step,
                                        cores=_cores(), **opts)
        res["background_cores"] = bg.cores
        if probe:
            # what the cores gave a well-scaling kernel just before and just after this case
            after = reference_scaling([most], rounds=3)
            res["reference_speedup"] = {t: min(before["speedup"][t], after["speedup"][t])
                                        for t in before["speedup"]} if before and after else None
    timed.update(singles)
    return res, timed


def merge_pass(pooled: tuple[dict, dict] | None, res: dict, timed: dict, n_pass: int) -> tuple[dict, dict]:
    """Add pass ``n_pass`` (from 1) of a case (``res``, ``timed``) to its pooled ``(res, timed)``.

    ``pooled`` is None for the case's first pass: ``(res, timed)`` then start the pool.
    Samples are appended per config, so repetition ``r`` of every config still comes
    from the same moment and the ratios stay paired. Checks and skips are kept with
    their pass; the machine reference is kept per pass and summarised by its median.
    Returns the pool.
    """
    for c in res["checks"]:
        c["pass"] = n_pass
    res["skipped"] = [dict(s, **{"pass": n_pass}) for s in res["skipped"]]
    if pooled is None:
        pooled = (res, timed)
        if res.get("reference_speedup") is not None:
            res["reference_speedup_passes"] = [res["reference_speedup"]]
        return pooled
    pres, ptimed = pooled
    pres["checks"] += res["checks"]
    pres["skipped"] += res["skipped"]
    for c, t in timed.items():
        if c in ptimed and not (t.single or ptimed[c].single):
            ptimed[c].times += t.times
            ptimed[c].breakdowns += t.breakdowns
            ptimed[c].probes += t.probes
            ptimed[c].core_waits += t.core_waits
        elif c not in ptimed:
            ptimed[c] = t
    if res.get("reference_speedup") is not None:
        pres.setdefault("reference_speedup_passes", []).append(res["reference_speedup"])
        per = pres["reference_speedup_passes"]
        pres["reference_speedup"] = {t: statistics.median(p[t] for p in per if t in p) for t in per[0]}
    if res.get("background_cores") is not None:
        pres["background_cores"] = max(pres.get("background_cores") or 0.0, res["background_cores"])
    return pooled


def run_amdahl(cases, impls, threads, args, progress) -> list[dict]:
    import amdahl

    out = []
    for case in cases:
        for impl in impls:
            if impl.kind != "parconv":
                continue
            progress.describe(f"amdahl {case.workload.name} {case.name} [{impl.name}]")
            try:
                a = amdahl.analyse(case, impl, threads, args.repeat, args.warmup,
                                   settle=not (args.quick or args.no_settle), on_run=progress.step)
            except Exception as exc:  # noqa: BLE001
                progress.write(f"Amdahl analysis of {case.workload.name} {case.name} on {impl.name} failed: {exc}")
                continue
            progress.write(format_amdahl(a) + "\n")
            out.append(a)
    return out


def run_mpi(names, args, log) -> dict:
    """Dispatch the MPI workloads to bench/mpi_bench.py (written separately), imported lazily."""
    try:
        import mpi_bench
    except ImportError as exc:
        msg = f"bench/mpi_bench.py is not available ({exc})"
        log(f"skipping {', '.join(names)}: {msg}")
        return {n: {"title": W.MPI_TITLES.get(n, n), "skipped": msg} for n in names}
    # mpi_bench reads its own option names; missing ones take its defaults
    mpi_args = argparse.Namespace(**vars(args))
    mpi_args.repeats = args.repeat
    if args.threads and len(args.threads) == 1:
        mpi_args.threads_per_rank = args.threads[0]
    if args.backends and len(args.backends) == 1:
        mpi_args.backend = args.backends[0]
    rows = mpi_bench.run_mpi_workloads(names, mpi_args) or []
    if rows and _mpi_rank() == 0 and hasattr(mpi_bench, "format_results"):
        log(mpi_bench.format_results(rows) + "\n")
    out = {}
    for item in rows:
        name = item.get("workload") or item.get("name") or "mpi"
        if "cases" in item:
            out[name] = item
        else:
            out.setdefault(name, {"title": W.MPI_TITLES.get(name, name), "mpi": True, "entries": []})[
                "entries"].append(item)
    for name in names:
        out.setdefault(name, {"title": W.MPI_TITLES.get(name, name), "skipped": "mpi_bench returned nothing for it"})
    return out


def run_memory(args, threads, with_torch: bool, log) -> dict:
    """Peak memory of a resnet20 training step, parconv's target backend and PyTorch, each in a fresh process."""
    import peak_memory

    n = targets_mod.THREADS if targets_mod.THREADS in threads else max(threads)
    size = 16 if args.quick else None
    batch, steps = (4, 1) if args.quick else (W.NETS_TRAIN_BATCH, 5)
    res = peak_memory.run("resnet20", batch, steps, n, args.target_backend, size,
                          peak_memory.FRAMEWORKS if with_torch else ("parconv",))
    log(peak_memory.format_result(res) + "\n")
    return res


def run_int8_rows(args, threads, with_torch: bool, local_names, results) -> bool:
    """The int8 rows (bench/quantized.py) into ``results["int8"]``; returns True when a check failed."""
    if "nets" not in local_names:
        raise SystemExit("bench/run.py: --precision int8 adds rows to the nets workload; add it to --workloads")
    from quantized import run_int8

    results["int8"] = run_int8(args, threads, with_torch, print)
    return results["int8"]["failed"]


def write_int8_docs(results: dict, docs_dir: str) -> None:
    """Put the int8 rows into docs/benchmarks.md as its "## int8 inference" section."""
    from make_docs import replace_section
    from quantized import HEADING, docs_section

    page = os.path.join(docs_dir, "benchmarks.md")
    with open(page, encoding="utf-8") as f:
        text = f.read()
    load = results["machine"].get("load_average")
    note = f"{results['machine'].get('cpu', '')}; load average at the start {load}" if load else ""
    text = replace_section(text, HEADING, docs_section(results["int8"], results["command"], note))
    with atomic_open(page, "w") as f:
        f.write(text)
    print(f"wrote {page} ({HEADING[3:]})")


def _mpi_rank() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_WORLD.Get_rank() if mpi is not None else 0


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    args.repeat = args.repeat if args.repeat is not None else (1 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.min_time = args.min_time if args.min_time is not None else (0.0 if args.quick else 0.05)
    args.gap = args.gap if args.gap is not None else (0.0 if args.quick else 0.01)
    args.idle_wait = args.idle_wait if args.idle_wait is not None else (0.0 if args.quick else 0.5)
    if (args.repeat < 1 or args.warmup < 0 or args.min_time < 0 or args.gap < 0 or args.idle_wait < 0
            or args.wait_cores < 0):
        raise SystemExit("bench/run.py: --repeat must be >= 1; --warmup, --min-time, --gap, --idle-wait and "
                         "--wait-cores >= 0")
    if args.passes < 1 or args.passes > args.repeat:
        raise SystemExit(f"bench/run.py: --passes must be between 1 and --repeat ({args.repeat}), got {args.passes}")
    # repetitions of each pass: --repeat split as evenly as it goes, the larger shares first
    per_pass = [args.repeat // args.passes + (k < args.repeat % args.passes) for k in range(args.passes)]
    unknown_precision = [p for p in args.precision if p not in ("fp32", "bf16", "int8")]
    if unknown_precision:
        raise SystemExit(f"bench/run.py: unknown --precision {unknown_precision}; known: fp32, bf16, int8")
    threads = args.threads or default_threads()
    if 1 not in threads:
        print("note: adding 1 thread (speedups are relative to it)")
        threads = sorted(set(threads) | {1})
    if args.workloads in (None, ["all"]):
        names = list(W.LOCAL_WORKLOADS) + (list(W.MPI_WORKLOADS) if args.workloads == ["all"] else [])
    else:
        names = args.workloads
    unknown = [n for n in names if n not in W.LOCAL_WORKLOADS and n not in W.MPI_WORKLOADS]
    if unknown:
        raise SystemExit(f"bench/run.py: unknown workloads {unknown}; known: "
                         f"{', '.join(W.LOCAL_WORKLOADS + W.MPI_WORKLOADS)}")
    t_start = time.perf_counter()
    results = {"schema": SCHEMA, "suite": "parconv bench/run.py", "quick": args.quick,
               "command": "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "settings": {"threads": threads, "repeat": args.repeat, "passes": args.passes,
                            "repeat_per_pass": per_pass, "warmup": args.warmup,
                            "min_time_s": args.min_time, "gap_s": args.gap, "idle_wait_s": args.idle_wait,
                            "wait_cores_s": args.wait_cores,
                            "interleaved": True,
                            "settle": not (args.quick or args.no_settle), "gc_paused": True,
                            "tolerance": harness.DEFAULT_TOL,
                            "target_backend": args.target_backend},
               "workloads": {}, "amdahl": [], "targets": [], "errors": []}

    mpi_names = [n for n in names if n in W.MPI_WORKLOADS]
    local_names = [n for n in names if n in W.LOCAL_WORKLOADS]
    if mpi_names:
        results["workloads"].update(run_mpi(mpi_names, args, print))
        if _mpi_rank() != 0:
            return 0

    impls, skipped = resolve_impls(args, print)
    results["skipped_impls"] = [s for s in skipped if "impl" in s]
    results["skipped_precisions"] = [s for s in skipped if "precision" in s]
    results["settings"]["precisions"] = sorted({i.precision for i in impls}, key=W.PRECISIONS.index)
    results["settings"]["bf16"] = pc.amp.bf16_support()
    kinds = _kinds(impls)
    fp32_backends = {i.name: i.backend for i in impls if i.kind == "parconv" and i.precision == "fp32"}
    results["machine"] = machine_info(fp32_backends, "torch" in kinds)
    print(f"parconv benchmarks | {summary_line(results['machine'])}")
    if not args.quick and len(threads) > 1:
        results["machine"]["reference_scaling_start"] = reference_scaling(threads)
        print(scaling_line(results["machine"]["reference_scaling_start"], "at the start"))
    in_passes = f", in {args.passes} passes" if args.passes > 1 else ""
    print(f"implementations: {', '.join(i.name for i in impls)} | threads {threads} | repeat {args.repeat} "
          f"(interleaved{in_passes}) | warm-up {args.warmup}" + (" | QUICK MODE: tiny shapes, timings mean nothing"
                                                                 if args.quick else ""))
    if "bf16" in results["settings"]["precisions"]:
        bf16 = results["settings"]["bf16"]
        print(f"bf16: parconv runs {bf16['mode']} ({bf16['why']})")
    if "numpy" not in kinds and "linear" in local_names:
        impls.insert(0, W.Impl("numpy", "parconv", pc.backends.get("numpy")))  # NumPy matmul is linear's baseline
    opts = {"filters": args.filters, "batches": args.batches}
    plan = [(name, W.WORKLOADS[name], W.WORKLOADS[name].cases(args.quick, opts)) for name in local_names]
    if args.cases:
        plan = [(name, wl, [c for c in cases if any(t in c.name for t in args.cases)]) for name, wl, cases in plan]
        if not any(cases for _, _, cases in plan):
            raise SystemExit(f"bench/run.py: no case of {', '.join(local_names)} matches --cases {args.cases}")
        results["cases_filter"] = args.cases

    # total runs for the progress bar
    total = 0
    amdahl_cases = []
    for name, wl, cases in plan:
        wl_impls = [i for i in impls if i.name != "numpy" or name == "linear" or "numpy" in kinds]
        n_cfg = len(configs_for(wl, wl_impls, threads))
        total += len(cases) * n_cfg * (args.passes * (2 + max(args.warmup, 1)) + args.repeat)
        amdahl_cases += [c for c in cases if c.amdahl]
    # Amdahl: the parallel backends (NumPy is the serial reference; analysed only when it is all there is)
    # (host backends only: a device backend's calls return before its kernels finish)
    parconv_impls = [i for i in impls if i.kind == "parconv" and i.backend.host_arrays and i.name != "numpy"
                     and i.precision == "fp32"] or [i for i in impls if i.kind == "parconv" and "numpy" in kinds]
    if not args.no_amdahl:
        total += len(amdahl_cases) * len(parconv_impls) * len(threads) * (max(args.warmup, 1) + args.repeat)
    progress = Progress(total, not args.no_progress)
    any_failed = False
    pooled = {}  # (workload, case index) -> (result dict, {Config: Timed}) over the passes so far
    try:
        for n_pass, repeat in enumerate(per_pass):
            if args.passes > 1:
                progress.write(f"--- pass {n_pass + 1} of {args.passes} ({repeat} repetition(s) per config)")
            for name, wl, cases in plan:
                wl_impls = [i for i in impls if i.name != "numpy" or name == "linear" or "numpy" in kinds]
                entry = results["workloads"].setdefault(
                    name, {"title": wl.title, "numpy_all_threads": wl.numpy_all_threads, "cases": []})
                for k, case in enumerate(cases):
                    try:
                        res, timed = run_case(case, wl_impls, threads, args, progress, repeat)
                    except Exception as exc:  # noqa: BLE001 - report and go on with the next case
                        tb = traceback.format_exc()
                        results["errors"].append({"workload": name, "case": case.name, "pass": n_pass + 1,
                                                  "error": repr(exc), "traceback": tb})
                        progress.write(f"ERROR in {name} {case.name}: {exc!r}\n{tb}")
                        any_failed = True
                        continue
                    checks_ok = all(c["ok"] for c in res["checks"])
                    any_failed |= not checks_ok
                    first = (name, k) not in pooled
                    pres, ptimed = pooled[name, k] = merge_pass(pooled.get((name, k)), res, timed, n_pass + 1)
                    if first:
                        entry["cases"].append(pres)
                    pres["results"] = harness.case_rows(ptimed, case.flops, case.items) if ptimed else []
                    if n_pass == args.passes - 1 or not checks_ok:
                        progress.write(format_case_table(name, pres, [i.name for i in wl_impls]) + "\n")
        if not args.no_amdahl and amdahl_cases:
            results["amdahl"] = run_amdahl(amdahl_cases, parconv_impls, threads, args, progress)
    finally:
        progress.close()
    if "nets" in local_names and not args.no_memory:
        results["memory"] = run_memory(args, threads, "torch" in kinds, print)
    if "int8" in args.precision:
        any_failed |= run_int8_rows(args, threads, "torch" in kinds, local_names, results)

    if args.quick:
        results["targets_note"] = "not evaluated in --quick mode (tiny shapes; timings mean nothing)"
    else:
        if len(threads) > 1:
            results["machine"]["reference_scaling_end"] = reference_scaling(threads)
            print(scaling_line(results["machine"]["reference_scaling_end"], "at the end"))
        results["targets"] = targets_mod.evaluate(results, args.target_backend)
        print(format_targets(results["targets"]))
    results["checks_passed"] = not any_failed
    results["elapsed_s"] = time.perf_counter() - t_start
    if results["machine"].get("load_average") is not None and hasattr(os, "getloadavg"):
        results["machine"]["load_average_end"] = list(os.getloadavg())

    os.makedirs(args.out, exist_ok=True)
    pngs = []
    if not args.no_plots:
        from plots import make_plots

        pngs = make_plots(results, args.out)
    results["plots"] = [os.path.basename(p) for p in pngs]
    path = os.path.join(args.out, "results.json")
    with atomic_open(path, "w") as f:  # an 18-minute run is not lost to a kill mid-write
        json.dump(results, f, indent=1, default=_json_default)
    print(f"wrote {path}" + (f" and {len(pngs)} plots" if pngs else "") + f" ({results['elapsed_s']:.0f} s)")
    if args.docs:
        from make_docs import splice_docs, write_docs

        if (set(local_names) >= set(W.LOCAL_WORKLOADS) and not args.cases) or not os.path.exists(
                os.path.join(args.docs_dir, "benchmarks.md")):
            page = write_docs(results, args.out, args.docs_dir)
        else:  # some workloads only: their sections replace those of the page, the rest stays
            page = splice_docs(results, args.docs_dir)
        print(f"wrote {page}")
        if "int8" in results:
            write_int8_docs(results, args.docs_dir)
    if any_failed:
        print("FAILED: some answers disagree with the NumPy oracle (see CHECK FAILED above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
