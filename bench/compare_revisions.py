#!/usr/bin/env python
"""Time two revisions of parconv against each other, interleaved in one run (no-regression check).

::

    python bench/compare_revisions.py                       # 5db3609 (before the refactor) vs HEAD
    python bench/compare_revisions.py --old v0.1 --new HEAD --threads 1,2 --repeat 9 --wait-cores 5
    python bench/compare_revisions.py --new-tree .          # 5db3609 vs this checkout's in-place build
    python bench/compare_revisions.py --old-tree /tmp/native --new-tree .   # two builds of one commit
    python bench/compare_revisions.py --wait-cores 5 --docs # and put the table into docs/benchmarks.md

Each revision is exported with ``git archive`` into its own directory under
``--workdir`` (nothing in the repository or its work tree changes) and built
there in place with every Cython extension, under the same environment (so
the compiler flags and ``PARCONV_BUILD_LEVELS`` are the same for both; ``PARCONV_ISA``
reaches both workers). One worker
process per revision imports that build (``PYTHONPATH``) together with *this*
checkout's benchmark code, so both time the same workload code. The driver
then keeps the two workers in lockstep: every case is checked first (the two
revisions' answers must agree within the suite's tolerance), warmed up, and
timed ``--repeat`` times alternately (old, new, new, old, ...), each sample
after an untimed settling call, as ``bench/run.py`` times its configs. A row's
ratio is the median of the per-pair ratios ``t_old / t_new`` (> 1: the new
revision is faster); it passes at ``--threshold`` (default 0.97).

The default cases are those of the refactor's acceptance: cnn-mnist at
d = 32 and 256 and batch 100 and 1000, conv-large and mlp-quadrants, on the
openmp backend at 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

DEFAULT_OLD = "5db3609"
DEFAULT_WORKLOADS = ("cnn-mnist", "conv-large", "mlp-quadrants")
CNN_FILTERS = (32, 256)
CNN_BATCHES = (100, 1000)
THRESHOLD = 0.97
BUILT_MARK = ".parconv-bench-built"


# ============================================================================ building
def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The full commit id of ``rev``."""
    try:
        return _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"compare_revisions.py: {rev!r} is not a commit of {ROOT}: {exc.stderr.strip()}") from None


def export_and_build(sha: str, workdir: str, log) -> str:
    """Export commit ``sha`` into ``workdir/<sha[:12]>`` and build its extensions in place (once); its path."""
    dest = os.path.join(workdir, sha[:12])
    if os.path.exists(os.path.join(dest, BUILT_MARK)):
        log(f"{sha[:12]}: reusing the build in {dest}")
        return dest
    if os.path.exists(dest):
        shutil.rmtree(dest)  # an export or build that did not finish
    os.makedirs(dest)
    log(f"{sha[:12]}: exporting into {dest}")
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True, stdout=tar)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as tf:
            tf.extractall(dest, filter="data")
    env = {k: v for k, v in os.environ.items() if k != "PARCONV_BUILD_ONLY"}
    log(f"{sha[:12]}: building every extension in place (minutes)")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compare_revisions.py: building {sha[:12]} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(dest, BUILT_MARK), "w") as f:
        f.write(sha + "\n")
    log(f"{sha[:12]}: built in {time.perf_counter() - t0:.0f} s")
    return dest


# ============================================================================ worker
def _cases(names, quick):
    import workloads as W

    opts = {"filters": (4, 8) if quick else CNN_FILTERS, "batches": (8, 16) if quick else CNN_BATCHES}
    out = []
    for name in names:
        out += W.WORKLOADS[name].cases(quick, opts)
    return out


class Worker:
    """The worker side: one revision's parconv, this checkout's benchmark code; JSON lines on stdin/stdout."""

    def __init__(self):
        import parconv as pc

        import workloads as W

        self.pc, self.W = pc, W
        self.cases = []
        self.runner = self.config = None
        self.inner = 1
        self.outdir = tempfile.mkdtemp(prefix="parconv-rev-")

    def handle(self, msg: dict) -> dict:
        import numpy as np

        import harness

        cmd = msg["cmd"]
        if cmd == "hello":
            return {"parconv": os.path.abspath(self.pc.__file__), "version": getattr(self.pc, "__version__", "?")}
        if cmd == "cases":
            self.cases = _cases(msg["workloads"], msg["quick"])
            return {"cases": [[c.workload.name, c.name] for c in self.cases]}
        if cmd == "setup":
            # build, run once and hand the answer over (an .npz the driver compares)
            case = self.cases[msg["case"]]
            self.runner = None
            impl = self.W.Impl(msg["backend"], "parconv", self.pc.backends.get(msg["backend"]))
            self.threads = msg["threads"]
            with harness.thread_scope("parconv", self.threads):
                self.runner = case.runner(impl, case.params, case.inputs(case.params))
                self.runner.prepare()
                self.runner.run()
                self.runner.sync()
                ans = self.runner.answer()
            path = os.path.join(self.outdir, f"answer{msg['case']}.npz")
            np.savez(path, **{k: np.asarray(v) for k, v in ans.items()})
            return {"answer": path}
        if cmd == "warmup":
            with harness.thread_scope("parconv", self.threads), harness.gc_paused():
                t = min(harness._one_sample(self.runner, 1) for _ in range(max(msg["warmup"], 1)))
            self.inner = max(1, int(np.ceil(msg["min_time"] / t))) if msg["min_time"] > 0 and t > 0 else 1
            return {"per_call_s": t, "inner": self.inner}
        if cmd == "sample":
            probe = waited = None
            if msg.get("wait_cores", 0) > 0 and self.threads > 1:
                waited, probe = harness.wait_for_cores(min(self.threads, msg["cores"]), msg["wait_cores"])
            if msg.get("idle_wait", 0) > 0:
                harness.wait_own_threads_idle(msg["idle_wait"])
            with harness.thread_scope("parconv", self.threads), harness.gc_paused():
                self.runner.prepare()  # the settling call, untimed
                self.runner.run()
                self.runner.sync()
                t = harness._one_sample(self.runner, self.inner)
            return {"t": t, "probe": probe, "waited": waited}
        raise ValueError(f"unknown command {cmd!r}")


def worker_main() -> int:
    w = Worker()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        try:
            reply = w.handle(msg)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops
            import traceback

            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    shutil.rmtree(w.outdir, ignore_errors=True)
    return 0


# ============================================================================ driver
class Client:
    """One worker process for the parconv build in ``tree``."""

    def __init__(self, label: str, tree: str):
        self.label = label
        env = dict(os.environ, PYTHONPATH=tree + os.pathsep + HERE)
        # started outside both trees, so the current directory does not shadow the build
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=tempfile.gettempdir(),
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}: the worker exited (status {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def compare(old_tree: str, new_tree: str, args, log) -> dict:
    """Check and time every case on both builds in lockstep; the result dict (rows in ``rows``)."""
    import numpy as np

    import harness
    from machine import physical_cores

    clients = [Client("old", old_tree), Client("new", new_tree)]
    try:
        for c, tree in zip(clients, (old_tree, new_tree)):
            hello = c.ask(cmd="hello")
            if not hello["parconv"].startswith(os.path.abspath(tree) + os.sep):
                raise SystemExit(f"compare_revisions.py: the {c.label} worker imported {hello['parconv']}, "
                                 f"not the build in {tree}")
            c.path = hello["parconv"]
        listed = [c.ask(cmd="cases", workloads=args.workloads, quick=args.quick)["cases"] for c in clients]
        if listed[0] != listed[1]:
            raise SystemExit("compare_revisions.py: the two revisions list different cases")
        cores = min(os.cpu_count() or 1, physical_cores() or os.cpu_count() or 1)
        rows = []
        for k, (wl, name) in enumerate(listed[0]):
            for n in args.threads:
                label = f"{wl} | {name} | {args.backend}@{n}"
                answers = [np.load(c.ask(cmd="setup", case=k, backend=args.backend, threads=n)["answer"])
                           for c in clients]
                cmp = harness.compare_answers(dict(answers[1]), dict(answers[0]))
                row = {"workload": wl, "case": name, "backend": args.backend, "threads": n,
                       "check": cmp["message"], "check_ok": cmp["ok"]}
                if not cmp["ok"]:
                    log(f"{label}: CHECK FAILED, the new answer differs from the old: {cmp['message']}")
                    rows.append(row)
                    continue
                warm = [c.ask(cmd="warmup", warmup=args.warmup, min_time=args.min_time) for c in clients]
                times = {"old": [], "new": []}
                probes = []
                for r in range(args.repeat):
                    for c in (clients if r % 2 == 0 else clients[::-1]):
                        time.sleep(args.gap)
                        s = c.ask(cmd="sample", wait_cores=args.wait_cores, cores=cores, idle_wait=args.idle_wait)
                        times[c.label].append(s["t"])
                        if s["probe"] is not None:
                            probes.append(s["probe"])
                pairs = [o / nw for o, nw in zip(times["old"], times["new"])]
                row.update(old_ms=1e3 * statistics.median(times["old"]), new_ms=1e3 * statistics.median(times["new"]),
                           ratio=statistics.median(pairs), ratio_ci=harness.median_ci(pairs),
                           inner=[w["inner"] for w in warm], times_old_s=times["old"], times_new_s=times["new"],
                           core_probe=statistics.median(probes) if probes else None)
                row["ok"] = row["ratio"] >= args.threshold
                log(format_row(row, args.threshold))
                rows.append(row)
    finally:
        for c in clients:
            c.close()
    return {"rows": rows}


def format_row(row: dict, threshold: float) -> str:
    head = f"{row['workload']:13s} {row['case']:24s} {row['backend']}@{row['threads']}"
    if "ratio" not in row:
        return f"{head}  CHECK FAILED: {row['check']}"
    ci = row.get("ratio_ci")
    ci_s = f" (95% interval {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
    probe = f" core probe {row['core_probe']:.2f}x" if row.get("core_probe") is not None else ""
    return (f"{head}  old {row['old_ms']:9.3f} ms  new {row['new_ms']:9.3f} ms  old/new {row['ratio']:.3f}{ci_s}  "
            f"{'ok' if row['ok'] else 'REGRESSION'} (need >= {threshold}){probe}")


def format_table(res: dict) -> str:
    lines = [f"revision comparison: old {res.get('old_label') or res['old'][:12]} vs new {res['new_label']} | "
             f"repeat {res['settings']['repeat']} (interleaved pairs) | load average at start "
             + "/".join(f"{v:.2f}" for v in res.get("load_average") or [])]
    lines += [format_row(r, res["settings"]["threshold"]) for r in res["rows"]]
    timed = [r for r in res["rows"] if "ratio" in r]
    bad = [r for r in res["rows"] if not r.get("ok")]
    lines.append(f"{len(timed) - len([r for r in timed if not r['ok']])} of {len(res['rows'])} rows at or above "
                 f"{res['settings']['threshold']}" + (f"; {len(bad)} not" if bad else ""))
    return "\n".join(lines)


def _tree_label(tree: str) -> str:
    """How a ``--new-tree`` side is named in reports: its commit, and whether it had changes on top."""
    try:
        sha = _git("rev-parse", "--short=12", "HEAD", cwd=tree)
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=tree))
    except (subprocess.CalledProcessError, OSError):
        return "a working tree's in-place build"
    return f"the in-place build of a working tree at `{sha}`" + (" with uncommitted changes" if dirty else "")


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/compare_revisions.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=DEFAULT_OLD, help=f"the old revision (default {DEFAULT_OLD})")
    p.add_argument("--new", default="HEAD", help="the new revision (default HEAD)")
    p.add_argument("--new-tree", default=None,
                   help="time this directory's in-place build as the new side instead of building --new")
    p.add_argument("--old-tree", default=None,
                   help="time this directory's in-place build as the old side instead of building --old "
                        "(e.g. the same commit built with PARCONV_BUILD_LEVELS='avx512:-march=native')")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "parconv-revisions"),
                   help="where the revisions are exported and built (kept and reused; default %(default)s)")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma-separated bench/run.py workloads (default %(default)s)")
    p.add_argument("--backend", default="openmp")
    p.add_argument("--threads", type=_int_list, default=[2], help="thread counts (default 2)")
    p.add_argument("--repeat", type=int, default=7, help="interleaved (old, new) pairs per row (default 7)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.05,
                   help="seconds one sample lasts at least; shorter calls are repeated and averaged")
    p.add_argument("--gap", type=float, default=0.01, help="untimed pause before each sample (seconds)")
    p.add_argument("--idle-wait", type=float, default=0.5,
                   help="before each sample, wait up to this long until the worker's own threads are idle")
    p.add_argument("--wait-cores", type=float, default=0.0,
                   help="before each sample on n > 1 threads, wait up to this long until n threads get 0.8n "
                        "cores' worth of speed (as bench/run.py --wait-cores)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time samples by the wall clock or by the workers' CPU time (cpu: one-thread rows on "
                        "a machine shared with other work)")
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--quick", action="store_true", help="tiny shapes, checks and plumbing only (tests)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "revisions.json"), help="JSON output")
    p.add_argument("--docs", action="store_true",
                   help="after the run, put the table into docs/benchmarks.md (its 'Revision comparison' section)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main()
    if args.clock == "cpu":
        if any(t > 1 for t in args.threads):
            raise SystemExit("compare_revisions.py: --clock cpu times one thread only (use --threads 1)")
        os.environ["PARCONV_BENCH_CLOCK"] = "cpu"  # the workers inherit it
    import workloads as W

    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in W.LOCAL_WORKLOADS]
    if unknown:
        raise SystemExit(f"compare_revisions.py: unknown workloads {unknown}; known: {', '.join(W.LOCAL_WORKLOADS)}")
    if args.repeat < 1 or args.warmup < 0 or args.min_time < 0 or args.gap < 0 or args.wait_cores < 0:
        raise SystemExit("compare_revisions.py: --repeat must be >= 1; --warmup, --min-time, --gap and "
                         "--wait-cores >= 0")

    def log(text):
        print(text, flush=True)

    os.makedirs(args.workdir, exist_ok=True)
    if args.old_tree:
        old, old_tree = _tree_label(args.old_tree), os.path.abspath(args.old_tree)
    else:
        old = resolve(args.old)
        old_tree = export_and_build(old, args.workdir, log)
    if args.new_tree:
        new, new_label, new_tree = None, _tree_label(args.new_tree), os.path.abspath(args.new_tree)
    else:
        new = resolve(args.new)
        new_label, new_tree = new[:12], export_and_build(new, args.workdir, log)
    res = {"old": old, "old_label": old if args.old_tree else old[:12], "new": new, "new_label": new_label,
           "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "settings": {k: getattr(args, k) for k in ("workloads", "backend", "threads", "repeat", "warmup",
                                                      "min_time", "gap", "idle_wait", "wait_cores", "threshold", "clock",
                                                      "quick")}}
    res.update(compare(old_tree, new_tree, args, log))
    res["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print(format_table(res))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    if args.docs:
        from make_docs import splice_docs

        print(f"wrote {splice_docs({'revisions': res})}")
    return 0 if all(r.get("ok") for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
