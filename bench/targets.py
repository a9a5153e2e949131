"""The performance targets of the suite, evaluated on a results dict.

Every target compares configs measured in the same interleaved run (paired
per-repetition ratios, median over repetitions), at ``THREADS`` threads.

"Never slower with more threads" counts as missed only when the slowdown is
measured: a median ratio below 1.0 whose distribution-free 95% interval
(:func:`harness.median_ci`) also lies below 1.0. Tiny layers run the same
serial code at every thread count, and their ratio then scatters around 1.0;
such entries are kept with ``within_noise`` set to the interval.
"""

from __future__ import annotations

import statistics

THREADS = 2


def _cases(results, workload):
    wl = results.get("workloads", {}).get(workload)
    return [c for c in (wl or {}).get("cases", []) if c.get("results")]


def _row(case, impl, threads):
    for r in case["results"]:
        if r["impl"] == impl and r["threads"] == threads:
            return r
    return None


def _entry(target, workload, case, value, threshold, config):
    return {"target": target, "workload": workload, "case": case, "config": config, "value": value,
            "threshold": threshold, "ok": None if value is None else bool(value >= threshold)}


#: ``nets``: every zoo network's training step (batch 32 and 128) and inference (batch 1 and 64) vs PyTorch
NETS_ZOO = 2.0
NETS_ZOO_BATCHES = {"train": (32, 128), "infer": (1, 64)}
#: ``nets``: MLP 784-512-512-10 training step and inference vs PyTorch at these batches
NETS_MLP_BATCHES = (1, 64, 256)
NETS_MLP = 1.2


def _nets_target(net: str, mode: str, n: int) -> float | None:
    """The ``vs torch`` threshold of one ``nets`` case (None: no target)."""
    if net == "mlp":
        return NETS_MLP if n in NETS_MLP_BATCHES else None
    return NETS_ZOO if n in NETS_ZOO_BATCHES[mode] else None


def evaluate(results: dict, backend: str = "openmp", threads: int = THREADS) -> list[dict]:
    """One entry per (target, case): ``value``, ``threshold`` and ``ok`` (None when not measured)."""
    out = []
    cfg = f"{backend}@{threads}"
    for wl in ("conv-small", "conv-large"):
        for case in _cases(results, wl):
            need = 1.0 if case["name"] == "forward" else 0.9
            r = _row(case, backend, threads)
            out.append(_entry(f"{case['name']} >= {need}x PyTorch", wl, case["name"],
                              r and r.get("vs_torch"), need, cfg))
    for case in _cases(results, "cnn-mnist"):
        if case["params"]["N"] in (100, 1000):
            r = _row(case, backend, threads)
            out.append(_entry("training step >= 2x PyTorch", "cnn-mnist", case["name"],
                              r and r.get("vs_torch"), 2.0, cfg))
    for wl in ("conv-large", "cnn-mnist"):
        for case in _cases(results, wl):
            r = _row(case, backend, threads)
            e = _entry(f"speedup {threads} vs 1 thread >= 1.8", wl, case["name"], r and r.get("speedup"), 1.8, cfg)
            ref = (case.get("reference_speedup") or {}).get(str(threads))
            if ref is not None:
                e["reference"] = ref  # the BLAS's own speedup measured around this case
            probes = [p for p in ((r or {}).get("core_probe") or []) if p is not None]
            if probes:  # the core probe before each of the config's samples (run.py --wait-cores)
                e["core_probe"] = statistics.median(probes)
                e["core_wait_s"] = r.get("core_wait_s")
            out.append(e)
    for wl, wl_res in results.get("workloads", {}).items():
        if wl == "contended":
            continue  # busy neighbours: its own target allows the default CONTENDED_SLACK
        for case in (wl_res.get("cases", []) if isinstance(wl_res, dict) else []):
            if not case.get("results"):
                continue
            r = _row(case, backend, threads)
            e = _entry(f"{threads} threads never slower than 1", wl, case["name"],
                       r and r.get("speedup"), 1.0, cfg)
            ci = r and r.get("speedup_ci")
            if e["ok"] is False and ci and ci[1] >= 1.0:
                # "slower" must be a measured difference: when the interval of the paired
                # ratios covers 1.0 the two thread counts are equal within this run's noise
                e["ok"] = True
                e["within_noise"] = [ci[0], ci[1]]
            out.append(e)
    for case in _cases(results, "nets"):
        pr = case["params"]
        need = _nets_target(pr["net"], pr["mode"], pr["N"])
        if need is not None:
            what = "training step" if pr["mode"] == "train" else "inference"
            r = _row(case, backend, threads)
            out.append(_entry(f"{what} batch {pr['N']} >= {need}x PyTorch", "nets", case["name"],
                              r and r.get("vs_torch"), need, cfg))
    out += _contended(results, backend)
    mem = results.get("memory")
    if mem:
        ratio = mem.get("ratio")
        out.append(_entry("step memory <= PyTorch's (PyTorch / parconv >= 1)", "nets",
                          f"{mem['net']} training step batch={mem['batch']} peak RSS",
                          1.0 / ratio if ratio else None, 1.0, f"{backend}@{mem['threads']}"))
    for case in _cases(results, "linear"):
        if case["name"] == "forward":
            for n in sorted({r["threads"] for r in case["results"] if r["impl"] == backend}):
                r = _row(case, backend, n)
                out.append(_entry("linear forward >= 0.8x NumPy matmul (equal threads)", "linear", case["name"],
                                  r and r.get("vs_numpy"), 0.8, f"{backend}@{n}"))
    return out


#: ``contended``: with busy neighbours the default thread count is at most this much slower than the
#: better of 1 and 2 threads under the same load (the value is the inverse: better / default >= 0.8)
CONTENDED_SLACK = 1.25


def _contended(results: dict, backend: str) -> list[dict]:
    """Per loaded case: default threads within CONTENDED_SLACK of the better of 1 and 2 threads, and
    the margin over PyTorch at least the quiet one (the same network with no busy neighbour)."""
    out = []
    cases = _cases(results, "contended")
    quiet = {c["params"]["net"]: c for c in cases if not c["params"].get("busy")}
    for case in cases:
        pr = case["params"]
        if not pr.get("busy"):
            continue
        dflt = pr.get("default_threads", THREADS)
        cfg = f"{backend}@{'default' if dflt == -1 else dflt}"
        r = _row(case, backend, dflt)
        best = [x["median"] for x in (_row(case, backend, 1), _row(case, backend, 2)) if x and x.get("median")]
        value = min(best) / r["median"] if r and r.get("median") and best else None
        out.append(_entry(f"default threads <= {CONTENDED_SLACK}x the better of 1 and 2", "contended",
                          case["name"], value, round(1.0 / CONTENDED_SLACK, 3), cfg))
        q = quiet.get(pr["net"])
        qr = q and _row(q, backend, dflt)
        margin = qr and qr.get("vs_torch")
        if margin:
            out.append(_entry("vs PyTorch under load >= the quiet margin", "contended", case["name"],
                              r and r.get("vs_torch"), round(margin, 2), cfg))
    return out


def summary(entries: list[dict]) -> dict:
    """Counts of targets met, missed and not measured."""
    return {"met": sum(e["ok"] is True for e in entries), "missed": sum(e["ok"] is False for e in entries),
            "not_measured": sum(e["ok"] is None for e in entries)}
