#!/usr/bin/env python
"""Regenerate ``docs/benchmarks.md`` and ``docs/_static/bench/*.png`` from a benchmark run.

::

    python bench/run.py --docs                 # run the suite, then write the page (one command)
    python bench/make_docs.py                  # rewrite the page from bench/out/results.json

The page is MyST markdown: the machine, how the numbers were taken, one table
per workload, the Amdahl analysis, the targets and the plots (copied next to
the page, so the docs build does not depend on ``bench/out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from parconv._io import atomic_open  # noqa: E402

STATIC = os.path.join("_static", "bench")


def _f(v, spec, none="–"):
    return none if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _core_wait_total(results: dict) -> str:
    """'N s in all' over every case and config of a run with --wait-cores."""
    total = sum(r.get("core_wait_s") or 0.0 for wl in results.get("workloads", {}).values()
                for c in (wl.get("cases", []) if isinstance(wl, dict) else []) for r in c.get("results", []))
    return f"{total:.0f} s in all"


def _md_table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A pipe table; the first ``left`` columns are left-aligned, the rest (numbers) right-aligned."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " if i < left else " ---: " for i in
                                                         range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _configs(cases: list) -> list[str]:
    seen = {}
    for c in cases:
        for r in c["results"]:
            seen[r["config"]] = (r["impl"] != "numpy", r["impl"] == "torch", r["impl"],
                                 r["threads"] if r["threads"] >= 0 else 1 << 30)  # @default last
    return sorted(seen, key=seen.get)


def workload_table(name: str, wl: dict, target_backend: str) -> list[str]:
    cases = [c for c in wl.get("cases", []) if c.get("results")]
    if not cases:
        return [f"*{name}: no results.*"]
    cfgs = _configs(cases)
    tmax = max(r["threads"] for c in cases for r in c["results"] if r["impl"] == target_backend) \
        if any(r["impl"] == target_backend for c in cases for r in c["results"]) else None
    bg = any(c.get("background_cores") is not None for c in cases)
    probed = tmax and any((r.get("core_probe") or []) for c in cases for r in c["results"]
                          if r["config"] == f"{target_backend}@{tmax}")
    header = ["case"] + [f"{c} ms" for c in cfgs]
    extra = []
    if tmax:
        tb = f"{target_backend}@{tmax}"
        extra = [f"{tb} GFLOP/s", f"{tb} speedup", f"{tb} vs torch", f"{tb} vs numpy"]
    with_numpy = any(r["impl"] == "numpy" for c in cases for r in c["results"])
    if not with_numpy:
        extra = extra[:-1]  # NumPy was the small-size oracle only
    rows = []
    for c in cases:
        by = {r["config"]: r for r in c["results"]}
        row = [c["name"]]
        for cfg in cfgs:
            r = by.get(cfg)
            row.append(_f(r and r["median"] and 1e3 * r["median"], ".3g") + (" †" if r and r.get("single_call")
                                                                             else ""))
        if tmax:
            r = by.get(f"{target_backend}@{tmax}") or {}
            row += [_f(r.get("gflops"), ".3g"), _f(r.get("speedup"), ".2f"), _f(r.get("vs_torch"), ".2f")]
            row += [_f(r.get("vs_numpy"), ".3g")] if with_numpy else []
        if bg:
            row.append(_f(c.get("background_cores"), ".2f"))
        if probed:
            probes = [p for p in (by.get(f"{target_backend}@{tmax}") or {}).get("core_probe") or [] if p is not None]
            row.append(_f(statistics.median(probes) if probes else None, ".2f"))
        rows.append(row)
    table = _md_table(header + extra + (["other load (cores)"] if bg else [])
                      + ([f"core probe before {target_backend}@{tmax}"] if probed else []), rows)
    if any(r.get("single_call") for c in cases for r in c["results"]):
        table += ["", "† one call only (the serial NumPy baseline is not repeated where a call takes more than "
                      "`--serial-max-s` seconds)."]
    return table


def layer_table(wl: dict) -> list[str]:
    cases = [c for c in wl.get("cases", []) if c.get("results")]
    rows_with = [r for c in cases[:1] for r in c["results"] if r.get("breakdown_s")]
    if not rows_with:
        return []
    keys = list(rows_with[0]["breakdown_s"])
    header = ["layer, phase"] + [f"{r['config']} ms" for r in rows_with]
    rows = [[k] + [_f(1e3 * r["breakdown_s"].get(k, float("nan")), ".3g") for r in rows_with] for k in keys]
    return ["", f"Per-layer median times ({cases[0]['name']}):", ""] + _md_table(header, rows)


def mpi_table(entries: list) -> list[str]:
    """The rows bench/mpi_bench.py returns (one per ranks x threads configuration)."""
    if not entries:
        return ["*No results.*"]
    rows = []
    for e in entries:
        thr = (f"{e['samples_per_s']:,.0f} img/s" if e.get("samples_per_s") else
               f"{e['gflops']:.1f} GFLOP/s" if e.get("gflops") else "–")
        rows.append([str(e.get("config", "?")), _f(e.get("median_s"), ".4g"), _f(e.get("min_s"), ".4g"),
                     _f(e.get("max_s"), ".4g"), thr, _f(e.get("speedup"), ".2f"), _f(e.get("efficiency"), ".2f")])
    return _md_table(["config", "median s", "min s", "max s", "throughput", "speedup", "efficiency"], rows)


def amdahl_tables(entries: list) -> list[str]:
    out = []
    for a in entries:
        out += ["", f"**{a['workload']} {a['case']}** on `{a['impl']}`: parallel fraction "
                    f"$p = {a['p']:.4f}$ (serial {100 * a['serial_fraction']:.2f} %)", ""]
        rows = [[str(r["threads"]), _f(1e3 * r["total_s"], ".3g"), _f(1e3 * r["kernel_s"], ".3g"),
                 _f(1e3 * r["serial_s"], ".3g"), _f(r["measured_speedup"], ".2f"), _f(r["amdahl_bound"], ".2f"),
                 _f(r["karp_flatt"], ".4f")] for r in a["rows"]]
        out += _md_table(["threads", "step ms", "kernel ms", "serial ms", "measured speedup", "Amdahl bound",
                          "Karp–Flatt e"], rows)
    return out


def target_table(entries: list) -> list[str]:
    def measured(e):
        noise = e.get("within_noise")
        out = _f(e["value"], ".2f") + (f" (equal within noise: 95% interval {noise[0]:.2f}–{noise[1]:.2f})"
                                        if noise else "")
        if e.get("reference") is not None:
            out += f" (machine reference {e['reference']:.2f}x)"
        if e.get("core_probe") is not None:
            out += f" (core probe {e['core_probe']:.2f}x)"
        return out

    rows = [[{True: "✅ met", False: "❌ missed", None: "n/a"}[e["ok"]], e["workload"], e["case"], e["target"],
             e["config"], measured(e)] for e in entries]
    return _md_table(["", "workload", "case", "target", "config", "measured"], rows, left=5)


def memory_section(mem: dict) -> list[str]:
    """The peak-memory comparison of bench/peak_memory.py (run by the nets workload)."""
    lines = ["### Peak memory", "",
             f"{mem['net']} training step at batch {mem['batch']} ({mem['steps']} steps, {mem['threads']} threads), "
             "each framework in a fresh process: resident set size after the imports and the model, optimizer "
             "and input are built (baseline), and its high-water mark after the steps. *Step* is the difference: "
             "the memory a training step needs on top of the model (`python bench/peak_memory.py`).", ""]
    rows = []
    for r in mem.get("rows", []):
        if "error" in r:
            rows.append([r["framework"], "failed: " + r["error"], "", "", ""])
            continue
        name = r["framework"] + (f" ({r['backend']})" if r.get("backend") else "")
        rows.append([name, _f(r["baseline_mib"], ".1f"), _f(r["peak_mib"], ".1f"), _f(r["step_mib"], ".1f"),
                     r.get("method", "")])
    lines += _md_table(["framework", "baseline MiB", "peak MiB", "step MiB", "measured by"], rows)
    if mem.get("ratio") is not None:
        lines += ["", f"parconv's step memory is {mem['ratio']:.2f}x PyTorch's."]
    return lines + [""]


def revisions_section(rev: dict) -> list[str]:
    """The no-regression comparison of bench/compare_revisions.py."""
    st = rev.get("settings", {})
    lines = ["## Revision comparison", "",
             f"Old revision `{rev['old'][:12]}` against "
             f"{('new revision `' + rev['new'][:12] + '`') if rev.get('new') else rev.get('new_label')}, "
             f"both built in place under the same flags and timed by the same benchmark code in two worker "
             f"processes driven in lockstep: {st.get('repeat')} interleaved (old, new) pairs per row after "
             f"{st.get('warmup')} warm-up call(s), each sample after an untimed settling call. *old/new* is the "
             f"median of the per-pair ratios (> 1: the new revision is faster); a row passes at "
             f"{st.get('threshold')}. Load average at the start "
             + "/".join(f"{v:.2f}" for v in rev.get("load_average") or [])
             + (", at the end " + "/".join(f"{v:.2f}" for v in rev["load_average_end"])
                if rev.get("load_average_end") else "") + ".", "",
             "```bash", "python bench/compare_revisions.py --old " + rev["old"][:7]
             + (f" --new {rev['new'][:7]}" if rev.get("new") else " --new-tree .")
             + (" --threads " + ",".join(map(str, st["threads"])) if st.get("threads") else "")
             + (" --quick" if st.get("quick") else "")
             + f" --repeat {st.get('repeat')}" + (f" --wait-cores {st['wait_cores']:g}" if st.get("wait_cores")
                                                  else ""), "```", ""]
    if st.get("quick"):
        lines += ["```{warning}", "Quick mode: tiny shapes, timings mean nothing.", "```", ""]
    rows = []
    for r in rev.get("rows", []):
        if "ratio" not in r:
            rows.append([r["workload"], r["case"], f"{r['backend']}@{r['threads']}", "–", "–",
                         "answers differ: " + r["check"], "❌"])
            continue
        ci = r.get("ratio_ci")
        rows.append([r["workload"], r["case"], f"{r['backend']}@{r['threads']}", _f(r["old_ms"], ".3g"),
                     _f(r["new_ms"], ".3g"),
                     _f(r["ratio"], ".3f") + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""),
                     "✅" if r.get("ok") else "❌"])
    lines += _md_table(["workload", "case", "config", "old ms", "new ms", "old/new (95% interval)", ""], rows,
                       left=3)
    # measurements made beside the run (reruns, instruction counts), kept with its JSON as "notes"
    for note in rev.get("notes", []):
        lines += ["", note]
    return lines + [""]


def nets_targets(entries: list, workload: str = "nets") -> list[str]:
    """The targets of the nets (or contended) workload, shown with its table."""
    mine = [e for e in entries if e["workload"] == workload and "never slower" not in e["target"]]
    return ["", "Targets of this workload:", ""] + target_table(mine) if mine else []


NETS_NOTE = (
    "PyTorch runs in the same process, on the same libgomp as parconv, so it waits for work as parconv's "
    "runtime does (passively, unless the environment says otherwise; `env` in results.json records it). "
    "Where PyTorch runs alone its idle threads spin, and some of its times are shorter: performance "
    "internals, \"Idle threads wait passively\", has this table's main rows under both policies.")


CONTENDED_NOTE = (
    "Each case starts its busy processes (pure-Python loops, each bounded to 15 minutes and killed when the "
    "case's timing ends) before its timed samples, and times without the suite's wait for idle threads, as "
    "a user's loop runs. \"other load\" counts every process but this one, the busy ones included; the core "
    "probe is the BLAS's matmul on two threads against one just before each two-thread sample (2.00: two "
    "free cores). The @default columns set no thread count: parconv splits the work for every core and caps "
    "each parallel region's team at the cores the neighbours leave free (the same bits as @2); PyTorch runs "
    "its own default. The targets compare parconv's default with the better of @1 and @2 under the same load, "
    "and its margin over PyTorch's default with the quiet one.")


def render(results: dict, plots: list[str]) -> str:
    m = results.get("machine", {})
    v = m.get("versions", {})
    s = results.get("settings", {})
    tb = s.get("target_backend", "openmp")
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by bench/make_docs.py from bench/out/results.json; do not edit by hand -->",
        "",
        "The suite in `bench/run.py` reproduces the experiments of the studies parconv grew from "
        "(see the workloads in the design notes) and compares the backends with PyTorch CPU. Regenerate "
        "this page, tables and plots included, with one command:",
        "",
        "```bash",
        "python bench/run.py --docs            # add e.g. --threads 1,2,4,8 --backends openmp",
        "python bench/run.py --docs --passes 3 --repeat 9   # on a shared machine: repetitions spread over the run",
        "python bench/run.py --docs --passes 3 --repeat 9 --wait-cores 5   # a VM whose host moves its vCPUs",
        "python bench/run.py --docs --workloads nets --threads 1,2 --backends openmp --wait-cores 5"
        "   # only the nets section",
        "python bench/run.py --docs --workloads nets --cases 'training step batch=32' --threads 1,2"
        "   # some rows of it",
        "python bench/run.py --docs --workloads contended --threads 1,2 --wait-cores 0.001"
        "   # busy neighbours; the probe recorded, not waited for",
        "python bench/compare_revisions.py --docs --wait-cores 5   # the revision comparison section",
        "```",
        "",
    ]
    if results.get("quick"):
        lines += ["```{warning}", "These results come from `--quick` mode (tiny shapes, one repetition): they "
                  "only show that every answer was checked; the timings mean nothing.", "```", ""]
    lines += [
        "## How the numbers are taken",
        "",
        "- Every implementation is first checked against the NumPy oracle on a small size, then at the timed "
        "size against NumPy's (or, where NumPy is not timed, PyTorch's) answer; a wrong answer is never timed.",
        f"- Repetitions are **interleaved**: each of the {s.get('repeat')} repetition(s) runs every "
        "(implementation, threads) configuration once, in a rotating order, after "
        f"{s.get('warmup')} warm-up call(s)."
        + (f" The suite ran in {s['passes']} passes ({'+'.join(map(str, s.get('repeat_per_pass', [])))} "
           "repetitions), each checking and warming up again, and every case pools the samples of all "
           "passes: its repetitions lie minutes apart, so a burst of load from outside the process touches "
           "a few of them instead of all." if s.get("passes", 1) > 1 else "")
        + " Tables show the **median** in milliseconds; ratios (speedup vs "
        "1 thread, `vs torch`, `vs numpy`) are medians of per-repetition ratios, so they compare runs taken at "
        "the same moment."
        + (" Each sample follows untimed calls of the same configuration for as long as a sample lasts, so "
           "every sample is steady state, as in a user's loop: not disturbed by the previous configuration's "
           "cache and memory state, and with the threads' cores awake again after the pauses between "
           "samples (on a virtual machine a vCPU left idle wakes slowly at first: mobilenet_small inference "
           "at batch 64 on two threads read 5.1-7.0 ms after one untimed call, 4.8-5.0 ms in most runs after "
           "50 ms of them, and 4.8-4.9 ms in a loop)." if s.get("settle") else "")
        + (f" Calls shorter than {1e3 * s['min_time_s']:.0f} ms are repeated and averaged within one sample "
           "(a training step gets its starting weights back, off the clock, before each call, so every call "
           "times the same step)." if s.get("min_time_s") else "")
        + (f" Before each sample the harness waits (at most {s['idle_wait_s']:g} s) until the process's own "
           "threads are idle: the previous configuration's runtime keeps its idle workers spinning after a call "
           "(OpenBLAS for about 0.1 s, libgomp for a few ms) and would otherwise take a core from the sample."
           if s.get("idle_wait_s") else "")
        + (" Python's cyclic garbage collector is off while a sample runs, as in `timeit`: a full collection "
           "of the suite's process took 70 to 160 ms, more than a whole sample, and now runs between samples."
           if s.get("gc_paused") else "")
        + (f" Before each sample on n > 1 threads the harness waited (at most {s['wait_cores_s']:g} s per "
           f"sample, {_core_wait_total(results)}) until a probe, the BLAS's float32 384x384 matmul, ran at least "
           "0.8n times faster on n threads than on 1: the host of a virtual machine may run two of its vCPUs "
           "on the two hyperthreads of one physical core for a second or two at a time (two threads of "
           "multiply-adds then ran 1.65x slower each than one alone, measured on this kind of guest), and a "
           "sample taken then measures the host, not the code. Every sample's probe is kept in the JSON "
           "(`core_probe`)." if s.get("wait_cores_s") else ""),
        "- `opencl@device` (when present) runs on the OpenCL device, which schedules its own threads; it is "
        "compared with the others at their largest thread count.",
        "- Threads: `parconv.num_threads(n)` for parconv backends, `torch.set_num_threads(n)` for PyTorch, "
        "threadpoolctl for the BLAS of NumPy (`numpy@n` in the `linear` workload is NumPy matmul on n "
        "threads; elsewhere `numpy@1` is the serial reference backend).",
        "- GFLOP/s count 2 FLOPs per multiply-add of the convolution and linear layers only.",
        "- `vs X` > 1 means faster than X at the same thread count.",
        "- *other load* is the CPU time other processes used while a case was timed, in cores (from "
        "`/proc/stat`): where it is well above 0, the multi-threaded numbers of that case are pessimistic, "
        "because a parallel region waits for its slowest thread.",
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu', '?')} — {m.get('affinity_cpus', '?')} CPUs available "
        f"({m.get('physical_cores') or '?'} physical cores), flags {', '.join(m.get('cpu_flags', [])) or '?'}",
        f"- Software: Python {m.get('python', '?')}, parconv {v.get('parconv', '?')}, NumPy {v.get('numpy', '?')}, "
        f"SciPy {v.get('scipy', '?')}" + (f", PyTorch {v['torch']}" if "torch" in v else "")
        + (f" (commit {m['git_commit']})" if m.get("git_commit") else ""),
        f"- Threads measured: {', '.join(str(t) for t in s.get('threads', []))}; load average at start "
        f"{'/'.join(f'{x:.2f}' for x in m.get('load_average') or [])}"
        + (f", at end {'/'.join(f'{x:.2f}' for x in m['load_average_end'])}" if m.get("load_average_end") else ""),
        f"- Run on {m.get('date', '?')}; command `{results.get('command', 'python bench/run.py')}`; "
        f"{results.get('elapsed_s', 0):.0f} s.",
    ]
    for when in ("start", "end"):
        ref = m.get(f"reference_scaling_{when}")
        if ref and ref.get("speedup"):
            lines.append(f"- Machine reference at the {when}: the BLAS's own float32 matmul ran "
                         + ", ".join(f"{sp:.2f}x faster on {t} threads (rounds {ref['speedup_min'][t]:.2f}–"
                                     f"{ref['speedup_max'][t]:.2f})" for t, sp in ref["speedup"].items())
                         + " than on 1: what the cores gave a well-scaling kernel at that moment (a shared "
                         "or virtualised machine gives less when its neighbours are busy).")
    lines.append("")
    busy = [f"{name} {c['name']} ({c['background_cores']:.2f} cores)"
            for name, wl in results.get("workloads", {}).items() for c in wl.get("cases", [])
            if (c.get("background_cores") or 0) > 0.2]
    if busy:
        lines += ["```{note}", "Other processes used a noticeable share of the CPU while these cases were "
                  "timed, so their multi-threaded numbers are pessimistic: " + "; ".join(busy) + ".", "```", ""]
    lines += ["## Results", ""]
    for name, wl in results.get("workloads", {}).items():
        lines += [f"### {name}", "", f"{wl.get('title', name)}.", ""]
        if wl.get("skipped"):
            lines += [f"*Skipped: {wl['skipped']}*", ""]
            continue
        if "cases" not in wl:
            lines += mpi_table(wl.get("entries", [])) + [""]
            continue
        notes = sorted({c.get("note") for c in wl["cases"] if c.get("note")})
        if notes:
            lines += ["Shapes: " + "; ".join(notes) + ".", ""]
        lines += workload_table(name, wl, tb)
        lines += layer_table(wl)
        if name == "contended":
            lines += ["", CONTENDED_NOTE]
        if name == "nets":
            lines += ["", NETS_NOTE]
        if name in ("nets", "contended"):
            lines += nets_targets(results.get("targets") or [], name)
        for p in plots:
            base = os.path.basename(p)
            if base.endswith(f"_{name}.png") or (name in base and "throughput" in base):
                lines += ["", f"![{base}]({STATIC}/{base})"]
        lines.append("")
    if results.get("memory"):
        lines += memory_section(results["memory"])
    if results.get("revisions"):
        lines += revisions_section(results["revisions"])
    if results.get("amdahl"):
        lines += ["## Amdahl analysis", "",
                  "A proxy backend times every kernel call of a training step (the parallel part); the rest of "
                  "the step (layers, validation, Python) is serial. With $p$ the kernel fraction on one thread, "
                  "the Amdahl bound is $S(n) = 1 / ((1 - p) + p / n)$ and the Karp–Flatt serial fraction of a "
                  "measured speedup $S$ is $e = (1/S - 1/n) / (1 - 1/n)$.", ""]
        lines += amdahl_tables(results["amdahl"])
        if any(os.path.basename(p) == "amdahl.png" for p in plots):
            lines += ["", f"![amdahl.png]({STATIC}/amdahl.png)"]
        lines.append("")
    if results.get("targets"):
        lines += ["## Targets", "", f"Measured for `{tb}` at 2 threads unless stated (one interleaved run).", ""]
        lines += target_table(results["targets"])
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_docs(results: dict, out_dir: str, docs_dir: str = os.path.join(ROOT, "docs")) -> str:
    """Write ``docs_dir/benchmarks.md`` and copy the run's PNGs to ``docs_dir/_static/bench``."""
    static = os.path.join(docs_dir, STATIC)
    os.makedirs(static, exist_ok=True)
    plots = []
    for name in results.get("plots", []):
        src = os.path.join(out_dir, name)
        if os.path.exists(src):
            with open(src, "rb") as f_in, atomic_open(os.path.join(static, name), "wb") as f_out:
                f_out.write(f_in.read())
            plots.append(name)
    page = os.path.join(docs_dir, "benchmarks.md")
    text = render(results, plots)
    if os.path.exists(page):
        with open(page, encoding="utf-8") as f:
            text = keep_sections(f.read(), text)
    with atomic_open(page, "wb") as f:
        f.write(text.encode("utf-8"))
    for old in os.listdir(static):  # plots of an earlier run that this one did not draw
        if old.endswith(".png") and old not in plots:
            os.remove(os.path.join(static, old))
    return page


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """``[(heading, lines), ...]`` of a page split before every ``## `` and ``### `` heading."""
    out = [("", [])]
    for line in text.splitlines():
        if line.startswith(("## ", "### ")):
            out.append((line, []))
        out[-1][1].append(line)
    return out


#: sections another script writes (bench/precision.py, the int8 rows of bench/quantized.py, the bf16
#: rows): a full regeneration keeps them
KEPT_SECTIONS = ("## Conv precision", "## int8 inference", "## Mixed precision (bf16)")

#: and those of measurements taken by hand, two builds side by side (the ISA dispatch's speed and build time)
KEPT_SECTIONS += ("## Kernel ISA dispatch: speed and build time", "## Linear layers on an Intel Xeon")


def _top_sections(text: str) -> list[tuple[str, list[str]]]:
    """``[(heading, lines), ...]`` of a page split before every ``## `` heading only."""
    out = [("", [])]
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line, []))
        out[-1][1].append(line)
    return out


#: a line in a generated section after which the section's text is written by hand: regenerating the
#: section keeps everything from this line on (notes on what changed, runs on other hosts)
HAND_WRITTEN = "<!-- written by hand below: kept when the tables above are regenerated -->"


def hand_written_tail(page_text: str, heading: str) -> list[str]:
    """The lines of section ``heading`` from its HAND_WRITTEN marker on ([] without one)."""
    for head, lines in _top_sections(page_text):
        if head == heading and HAND_WRITTEN in lines:
            return lines[lines.index(HAND_WRITTEN):]
    return []


def replace_section(page_text: str, heading: str, body: list[str]) -> str:
    """``page_text`` with its ``## `` section ``heading`` (and its subsections) replaced by ``body``
    (which starts with the heading), or ``body`` added before "## Amdahl analysis" (else at the end)."""
    sections = _top_sections(page_text)
    heads = [h for h, _ in sections]
    body = list(body) + ([""] if body and body[-1] != "" else [])
    if heading in heads:
        sections[heads.index(heading)] = (heading, body)
    else:
        at = heads.index("## Amdahl analysis") if "## Amdahl analysis" in heads else len(heads)
        sections.insert(at, (heading, body))
    return "\n".join(line for _, lines in sections for line in lines).rstrip() + "\n"


def keep_sections(old_text: str, new_text: str) -> str:
    """``new_text`` with the KEPT_SECTIONS that ``old_text`` has put back in."""
    for heading, lines in _top_sections(old_text):
        if heading in KEPT_SECTIONS:
            new_text = replace_section(new_text, heading, lines)
    return new_text


def _table_rows(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the first markdown table in ``lines`` (0, 0 when there is none)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("| ")), None)
    if start is None:
        return 0, 0
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def _merge_rows(old_body: list[str], new_body: list[str], filters: list[str], extra: str = "") -> list[str] | None:
    """``old_body`` with the first table's rows for the new run's cases replaced or added, next to the
    rows of the same network, and a line saying when those rows were measured. The new rows take the
    page table's columns (by name; one the new run lacks reads "–"); None where the first columns
    differ (the new section then replaces the old one)."""
    o0, o1 = _table_rows(old_body)
    n0, n1 = _table_rows(new_body)
    cells = lambda row: [c.strip() for c in row.strip().strip("|").split("|")]  # noqa: E731
    if o1 - o0 < 2 or n1 - n0 < 2 or cells(old_body[o0])[0] != cells(new_body[n0])[0]:
        return None
    old_cols, new_cols = cells(old_body[o0]), cells(new_body[n0])
    rows = old_body[o0 + 2:o1]
    name = lambda row: cells(row)[0]  # noqa: E731
    for new_row in new_body[n0 + 2:n1]:
        by = dict(zip(new_cols, cells(new_row)))
        row = "| " + " | ".join(by.get(c, "–") for c in old_cols) + " |"
        names = [name(r) for r in rows]
        if name(row) in names:
            rows[names.index(name(row))] = row
            continue
        same_net = [i for i, n in enumerate(names) if n.split()[0] == name(row).split()[0]]
        rows.insert(same_net[0] if same_net else len(rows), row)
    # the workload's one-line description (e.g. "nets: ...") follows the new run
    titles = {line.split(":")[0]: line for line in new_body[:n0] if line.startswith(new_body[0][4:] + ":")}
    old_body = [titles.get(line.split(":")[0], line) if line.startswith(old_body[0][4:] + ":") else line
                for line in old_body]
    where = next((line for line in new_body if line.startswith("*Measured separately")), "")
    note = (f"*Rows of the cases matching {', '.join(repr(f) for f in filters)} measured separately: "
            + where[len("*Measured separately from the rest of this page: "):-1] + extra + "*" if where else "")
    head = old_body[:o0]
    if note:
        head = head + ([] if head and head[-1] == "" else [""]) + [note, ""]
    return head + old_body[o0:o0 + 2] + rows + old_body[o1:]


def splice(page_text: str, results: dict, plots: list[str]) -> str:
    """``page_text`` with the sections ``results`` renders (its workloads, peak memory, revision comparison)
    put in place of the sections of the same heading, or added at the end of "## Results".

    For a run of some workloads only (``--workloads nets``) or a revision comparison alone: the
    rest of the page, from an earlier full run, stays as it was.
    """
    fresh = [(h, body) for h, body in _sections(render(results, plots))
             if h.startswith("### ") or h == "## Revision comparison"]
    m = results.get("machine", {})
    if m:
        # the rest of the page describes another run: say when and how this section was measured
        where = (f"*Measured separately from the rest of this page: {m.get('date', '?')}, "
                 f"`{results.get('command', 'python bench/run.py')}`"
                 + (f", commit {m['git_commit']}" if m.get("git_commit") else "")
                 + (", load average at the start " + "/".join(f"{x:.2f}" for x in m["load_average"])
                    if m.get("load_average") else "") + ".*")
        fresh = [(h, body[:1] + ["", where] + body[1:]) if h.startswith("### ") else (h, body) for h, body in fresh]
    old = _sections(page_text)
    for h, body in fresh:
        heads = [x for x, _ in old]
        if body[-1] != "":
            body = body + [""]
        if h in heads and results.get("cases_filter"):
            # some cases only (run.py --cases): their rows replace or join the page's table
            wl = results.get("workloads", {}).get(h[4:], {})
            probes = [(c["name"], statistics.median(p)) for c in wl.get("cases", []) for r in c.get("results", [])
                      if r["impl"] != "torch" and r["threads"] > 1
                      for p in [[x for x in r.get("core_probe") or [] if x is not None]] if p]
            extra = (" Core probe before the two-thread samples (median): "
                     + ", ".join(f"{name} {v:.2f}" for name, v in probes) + ".") if probes else ""
            merged = _merge_rows(old[heads.index(h)][1], body, results["cases_filter"], extra)
            if merged is not None:
                old[heads.index(h)] = (h, merged)
                continue
        if h in heads:
            old[heads.index(h)] = (h, body)
            continue
        if h.startswith("### ") and "## Results" in heads:  # a new workload: at the end of "## Results"
            after = heads.index("## Results") + 1
            at = next((i for i in range(after, len(heads)) if heads[i].startswith("## ")), len(heads))
        else:
            at = heads.index("## Targets") if "## Targets" in heads else len(heads)
        old.insert(at, (h, body))
    return "\n".join(line for _, body in old for line in body).rstrip() + "\n"


def splice_docs(results: dict, docs_dir: str = os.path.join(ROOT, "docs")) -> str:
    """Rewrite ``docs_dir/benchmarks.md`` with :func:`splice` (plots are not copied); the page's path."""
    page = os.path.join(docs_dir, "benchmarks.md")
    with open(page, encoding="utf-8") as f:
        text = f.read()
    with atomic_open(page, "wb") as f:
        f.write(splice(text, results, []).encode("utf-8"))
    return page


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Regenerate docs/benchmarks.md from a bench/run.py results.json")
    p.add_argument("results", nargs="?", default=os.path.join(HERE, "out", "results.json"),
                   help="a bench/run.py results.json ('-': none, with --revisions)")
    p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"))
    p.add_argument("--revisions", default=None, help="a bench/compare_revisions.py JSON to add to the page")
    p.add_argument("--splice", action="store_true",
                   help="replace only the sections these results render in the existing page (a run of some "
                        "workloads, or a revision comparison alone), keeping the rest")
    args = p.parse_args(argv)
    results, out_dir = {}, HERE
    if args.results != "-":
        with open(args.results, encoding="utf-8") as f:
            results = json.load(f)
        out_dir = os.path.dirname(os.path.abspath(args.results))
    if args.revisions:
        with open(args.revisions, encoding="utf-8") as f:
            results["revisions"] = json.load(f)
    if not args.splice:
        if not results.get("workloads"):
            raise SystemExit("make_docs.py: a full page needs a bench/run.py results.json (or use --splice)")
        page = write_docs(results, out_dir, args.docs_dir)
    else:
        page = splice_docs(results, args.docs_dir)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
