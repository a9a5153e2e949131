"""The benchmark suite in --quick mode: every workload runs and every answer is checked.

Nothing here asserts a timing: the test machine is shared and tiny shapes
time nothing meaningful. What must hold is that the suite runs end to end,
checks each implementation against the NumPy oracle and writes its outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import parconv as pc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
LOCAL_WORKLOADS = ("conv-small", "conv-large", "cnn-mnist", "cnn-5-50-100", "mlp-quadrants", "linear")

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TORCH = False


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # the benchmark imports the same parconv as this process (installed or in place), never a bare source tree
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--threads", "1,2", "--out", str(out),
         "--no-progress", "--workloads", ",".join(LOCAL_WORKLOADS)],  # nets: its own tests below
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    return proc, out


def test_quick_run_exits_zero(quick_run):
    proc, _ = quick_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "QUICK MODE" in proc.stdout


def test_quick_run_checks_every_workload_against_the_oracle(quick_run):
    proc, out = quick_run
    path = out / "results.json"
    assert path.exists(), proc.stderr[-2000:]
    results = json.loads(path.read_text())
    assert results["quick"] is True
    assert results["checks_passed"] is True
    assert results["errors"] == []
    expected_impls = set(pc.available_backends()) | ({"torch"} if HAVE_TORCH else set())
    for name in LOCAL_WORKLOADS:
        wl = results["workloads"].get(name)
        assert wl is not None, f"workload {name} missing from results.json"
        assert wl["cases"], f"{name}: no cases"
        for case in wl["cases"]:
            where = f"{name} {case['name']}"
            assert case["checks"], f"{where}: no answer checks"
            failed = [c for c in case["checks"] if not c["ok"]]
            assert not failed, f"{where}: {failed}"
            assert case["skipped"] == [], f"{where}: {case['skipped']}"
            small = {c["config"] for c in case["checks"] if c["size"] == "small"}
            timed = {r["config"] for r in case["results"]}
            assert timed and timed <= small, f"{where}: timed {timed} without a small-size oracle check"
            assert {c.split("@")[0] for c in timed} == expected_impls, where


def test_quick_run_writes_machine_amdahl_and_plots(quick_run):
    _, out = quick_run
    results = json.loads((out / "results.json").read_text())
    m = results["machine"]
    for key in ("cpu", "logical_cpus", "python", "versions", "env", "blas"):
        assert key in m
    assert results["settings"]["threads"] == [1, 2]
    assert results["amdahl"], "no Amdahl analysis"
    for a in results["amdahl"]:
        assert 0.0 < a["p"] <= 1.0
        assert [r["threads"] for r in a["rows"]] == [1, 2]
    for name in results["plots"]:
        assert (out / name).stat().st_size > 0
    assert any(p.startswith("speedup_") for p in results["plots"])
    assert "layers_cnn-5-50-100.png" in results["plots"]
    assert "throughput_vs_batch_cnn-mnist.png" in results["plots"]


def test_docs_page_is_generated_from_the_results(quick_run, tmp_path):
    _, out = quick_run
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "make_docs.py"), str(out / "results.json"),
                           "--docs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks")
    for name in LOCAL_WORKLOADS:
        assert f"### {name}" in page
    pngs = os.listdir(tmp_path / "_static" / "bench")
    assert pngs and all(f"_static/bench/{p}" in page for p in pngs)


def test_amdahl_and_karp_flatt_formulas():
    sys.path.insert(0, BENCH)
    try:
        import amdahl
    finally:
        sys.path.remove(BENCH)
    assert amdahl.amdahl_bound(1.0, 8) == pytest.approx(8.0)
    assert amdahl.amdahl_bound(0.98, 2) == pytest.approx(1 / (0.02 + 0.49))
    # a measured speedup equal to the Amdahl bound gives back the serial fraction
    s = amdahl.amdahl_bound(0.9, 4)
    assert amdahl.karp_flatt(s, 4) == pytest.approx(0.1)
    assert amdahl.karp_flatt(2.0, 1) is None


def _bench_module(name):
    sys.path.insert(0, BENCH)
    try:
        return __import__(name)
    finally:
        sys.path.remove(BENCH)


def test_median_confidence_interval_uses_order_statistics():
    harness = _bench_module("harness")
    assert harness.median_ci([5.0, 1.0, 3.0, 2.0, 4.0, 7.0, 6.0]) == (1.0, 7.0)  # n=7: min..max (98.4%)
    assert harness.median_ci([float(i) for i in range(9)]) == (1.0, 7.0)
    assert harness.median_ci([1.0, 2.0, 3.0]) is None  # too few samples for 95%
    assert harness.paired_ratio_ci([2.0] * 7, [1.0] * 7) == (2.0, 2.0)
    assert harness.paired_ratio_ci([2.0] * 7, [1.0] * 6) is None


def test_never_slower_target_needs_a_measured_slowdown():
    targets = _bench_module("targets")

    def results(one, two):
        rows = [{"impl": "openmp", "threads": 1, "speedup": 1.0, "speedup_ci": [1.0, 1.0]}]
        rows.append({"impl": "openmp", "threads": 2, "speedup": two[0], "speedup_ci": two[1]})
        return {"workloads": {"linear": {"cases": [{"name": "forward, small", "params": {}, "results": rows}]}}}

    def verdict(speedup, ci):
        entries = [e for e in targets.evaluate(results(None, (speedup, ci)))
                   if e["target"].endswith("never slower than 1")]
        assert len(entries) == 1
        return entries[0]

    assert verdict(1.2, [1.1, 1.3])["ok"] is True
    e = verdict(0.99, [0.95, 1.02])  # the interval covers 1.0: equal within noise
    assert e["ok"] is True and e["within_noise"] == [0.95, 1.02]
    e = verdict(0.9, [0.85, 0.97])  # every pair slower: a real slowdown
    assert e["ok"] is False and "within_noise" not in e
    assert verdict(0.9, None)["ok"] is False  # no interval (too few repetitions): the median decides


def test_idle_wait_returns_when_quiet_and_gives_up_on_a_busy_thread():
    import threading

    harness = _bench_module("harness")
    assert harness.wait_own_threads_idle(max_wait_s=5.0) < 5.0  # nothing of ours runs: returns at once
    stop = threading.Event()

    def spin():  # stands in for a runtime's worker that spins after its parallel call
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        # still busy: waits the whole budget. A loaded host can starve the spinner for two windows
        # in a row, which reads as quiet, so one of three tries must wait it out
        assert max(harness.wait_own_threads_idle(max_wait_s=0.1) for _ in range(3)) >= 0.1
    finally:
        stop.set()
        worker.join()


def _run_bench(args, out):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--no-progress", "--no-plots",
                           "--no-amdahl", "--threads", "1,2", "--backends", "openmp", "--compare", "none",
                           "--out", str(out), *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_passes_split_the_repetitions_and_pool_them(tmp_path):
    proc = _run_bench(["--workloads", "conv-small,linear", "--repeat", "5", "--passes", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass 2 of 2" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["passes"] == 2 and results["settings"]["repeat_per_pass"] == [3, 2]
    for name in ("conv-small", "linear"):
        cases = results["workloads"][name]["cases"]
        assert cases, name
        for case in cases:
            # one pooled entry per case; every config timed 3 + 2 times, checked in both passes
            assert {c["pass"] for c in case["checks"]} == {1, 2}
            assert len(case["checks"]) == 2 * len([c for c in case["checks"] if c["pass"] == 1])
            for row in case["results"]:
                assert row["n"] == 5 and len(row["times_s"]) == 5, (name, case["name"], row["config"])
    assert len(results["workloads"]["conv-small"]["cases"]) == 2


def test_more_passes_than_repetitions_is_refused(tmp_path):
    proc = _run_bench(["--workloads", "linear", "--repeat", "2", "--passes", "3"], tmp_path)
    assert proc.returncode != 0
    assert "--passes must be between 1 and --repeat (2), got 3" in proc.stderr


def test_samples_run_with_the_garbage_collector_paused():
    import gc

    harness = _bench_module("harness")
    seen = []

    class Runner:  # records whether the collector was on while it ran
        restartable = True

        def prepare(self):
            pass

        def run(self):
            seen.append(gc.isenabled())

        def sync(self):
            pass

    assert gc.isenabled()
    config = harness.Config("openmp", 1)
    timed = harness.interleaved({config: Runner()}, {"openmp": "parconv"}, repeat=2, warmup=1, min_time=0.0,
                                settle=True)
    assert len(timed[config].times) == 2
    assert seen and not any(seen)
    assert gc.isenabled()  # restored
    gc.disable()
    try:
        with harness.gc_paused():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()


def test_wait_for_cores_polls_the_probe_until_the_threads_get_their_cores():
    harness = _bench_module("harness")
    readings = iter([1.1, 1.3, 1.9])  # two vCPUs on one core's hyperthreads, then on two cores
    calls = []

    def probe(n):
        calls.append(n)
        return next(readings)

    waited, sp = harness.wait_for_cores(2, max_wait_s=5.0, pause_s=0.001, probe=probe)
    assert calls == [2, 2, 2] and sp == 1.9 and 0.0 < waited < 5.0
    # the budget spent: the last reading is returned, whatever it says
    waited, sp = harness.wait_for_cores(2, max_wait_s=0.0, probe=lambda n: 1.1)
    assert sp == 1.1
    # nothing to measure (no BLAS to limit): no wait
    assert harness.wait_for_cores(2, max_wait_s=5.0, probe=lambda n: None)[1] is None


def test_core_probe_measures_a_speedup_or_says_it_cannot():
    harness = _bench_module("harness")
    assert harness.core_probe(1) is None  # one thread has nothing to compare
    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    sp = harness.core_probe(2, size=64, calls=1)
    assert sp is None or (isinstance(sp, float) and sp > 0.0)
    # the probe's thread limits are undone: the BLAS keeps the threads it had
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before


def test_interleaved_probes_the_cores_before_multi_threaded_samples_only():
    harness = _bench_module("harness")

    class Runner:
        restartable = True

        def prepare(self):
            pass

        def run(self):
            pass

        def sync(self):
            pass

    one, two = harness.Config("openmp", 1), harness.Config("openmp", 2)
    probed = []

    def probe(n):
        probed.append(n)
        return 1.95

    timed = harness.interleaved({one: Runner(), two: Runner()}, {"openmp": "parconv"}, repeat=3, warmup=1,
                                min_time=0.0, wait_cores=1.0, cores=2, probe=probe)
    assert probed == [2, 2, 2]
    assert timed[two].probes == [1.95] * 3 and len(timed[two].core_waits) == 3
    assert timed[one].probes == [] and timed[one].core_waits == []
    row = {r["config"]: r for r in harness.case_rows(timed, None, None)}
    assert row["openmp@2"]["core_probe"] == [1.95] * 3 and "core_probe" not in row["openmp@1"]
    # a machine of one core: two threads cannot get two cores, so there is nothing to wait for
    probed.clear()
    timed = harness.interleaved({two: Runner()}, {"openmp": "parconv"}, repeat=2, warmup=1, min_time=0.0,
                                wait_cores=1.0, cores=1, probe=probe)
    assert probed == [] and timed[two].probes == [None, None]


def test_negative_wait_cores_is_refused(tmp_path):
    proc = _run_bench(["--workloads", "linear", "--wait-cores", "-1"], tmp_path)
    assert proc.returncode != 0
    assert "--wait-cores >= 0" in proc.stderr


# ------------------------------------------------------------------------------ nets
# The nets workload at tiny sizes (quick mode: 16x16 images for the 3x32x32 networks, batch <= 4):
# every backend and the PyTorch twin agree with the NumPy oracle before anything would be timed.
NETS_CASES = ("lenet5 training step", "resnet20 training step", "vgg-small training step",
              "mobilenet-small inference batch=2", "mlp training step batch=1")
_NETS_ORACLE: dict = {}


def _nets_cases():
    W = _bench_module("workloads")
    cases = [c for c in W.WORKLOADS["nets"].cases(True, {}) if c.name.startswith(NETS_CASES)]
    assert len(cases) == len(NETS_CASES)
    return W, cases


def _nets_check(W, case, impl):
    harness = _bench_module("harness")
    if case.name not in _NETS_ORACLE:
        inp = case.inputs(case.check_params)
        ref = case.runner(W.Impl("numpy", "parconv", pc.backends.get("numpy")), case.check_params, inp)
        ref.prepare()
        ref.run()
        _NETS_ORACLE[case.name] = (inp, ref.answer())
    inp, oracle = _NETS_ORACLE[case.name]
    r = case.runner(impl, case.check_params, inp)
    r.prepare()
    r.run()
    r.sync()
    got = r.answer()
    assert set(got) == set(oracle), case.name
    cmp = harness.compare_answers(got, oracle, case.extra.get("tol") or harness.DEFAULT_TOL)
    assert cmp["ok"], f"{case.name} on {impl.name}: {cmp['message']}"
    return r, got


def test_nets_cases_agree_with_the_oracle_on_every_backend(backend):
    W, cases = _nets_cases()
    for case in cases:
        _nets_check(W, case, W.Impl(backend.name, "parconv", backend))


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch not installed (optional oracle)")
def test_nets_torch_twins_agree_with_the_oracle():
    W, cases = _nets_cases()
    for case in cases:
        _nets_check(W, case, W.Impl("torch", "torch"))


def test_nets_training_step_is_the_same_step_every_call_and_restores_dropout():
    W, cases = _nets_cases()
    case = next(c for c in cases if c.name.startswith("vgg-small"))
    r, first = _nets_check(W, case, W.Impl("openmp", "parconv", pc.backends.get("openmp")))
    assert r.restartable
    dropouts = [m for m in r.model.modules() if type(m).__name__ == "Dropout"]
    assert dropouts and all(d.p == 0.5 for d in dropouts)  # checked with p = 0, timed with the real p
    for d in dropouts:
        d.p = 0.0
    r._p = [(d, 0.5) for d in dropouts]  # one more checked step: prepare() must restore the start state
    r.prepare()
    r.run()
    again = r.answer()
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)


def test_nets_targets_follow_the_acceptance_table():
    targets = _bench_module("targets")

    def case(net, mode, n, vs_torch):
        return {"name": f"{net} {mode} batch={n}", "params": {"net": net, "mode": mode, "N": n},
                "results": [{"impl": "openmp", "threads": 2, "vs_torch": vs_torch}]}

    cases = [case("resnet20", "train", 128, 2.1), case("mobilenet-small", "train", 32, 1.9),
             case("lenet5", "infer", 1, 1.4), case("lenet5", "infer", 64, 2.0), case("lenet5", "infer", 16, 0.5),
             case("mlp", "train", 256, 1.2), case("mlp", "infer", 64, 1.1), case("mlp", "infer", 16, 0.5)]
    results = {"workloads": {"nets": {"cases": cases}},
               "memory": {"net": "resnet20", "batch": 128, "threads": 2, "ratio": 0.8}}
    got = {e["case"]: (e["threshold"], e["ok"]) for e in targets.evaluate(results) if e["workload"] == "nets"
           and "never slower" not in e["target"]}
    assert got == {"resnet20 train batch=128": (2.0, True), "mobilenet-small train batch=32": (2.0, False),
                   "lenet5 infer batch=1": (2.0, False), "lenet5 infer batch=64": (2.0, True),
                   "mlp train batch=256": (1.2, True), "mlp infer batch=64": (1.2, False),
                   "resnet20 training step batch=128 peak RSS": (1.0, True)}


def test_peak_memory_of_a_tiny_training_step():
    peak_memory = _bench_module("peak_memory")
    frameworks = peak_memory.FRAMEWORKS if HAVE_TORCH else ("parconv",)
    res = peak_memory.run("resnet20", batch=2, steps=1, threads=1, size=16, frameworks=frameworks, timeout=300)
    assert [r["framework"] for r in res["rows"]] == list(frameworks)
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["baseline_mib"] > 0 and r["peak_mib"] >= r["baseline_mib"] and r["step_mib"] >= 0
        assert np.isfinite(r["last_loss"])
    assert (res["ratio"] is not None) == HAVE_TORCH
    assert "peak memory | resnet20" in peak_memory.format_result(res)


def test_compare_revisions_drives_two_builds_in_lockstep(tmp_path):
    import argparse

    cr = _bench_module("compare_revisions")
    tree = os.path.dirname(os.path.dirname(pc.__file__))  # the same build on both sides: plumbing only
    args = argparse.Namespace(workloads=["mlp-quadrants"], quick=True, threads=[1], backend="openmp", repeat=2,
                              warmup=1, min_time=0.0, gap=0.0, idle_wait=0.0, wait_cores=0.0, threshold=0.0)
    res = cr.compare(tree, tree, args, lambda text: None)
    assert [r["case"] for r in res["rows"]] == ["hidden=16 batch=32", "hidden=4 batch=8, small"]
    for r in res["rows"]:
        assert r["check_ok"] and r["ok"], r
        assert len(r["times_old_s"]) == len(r["times_new_s"]) == 2 and r["ratio"] > 0


def test_make_docs_splices_a_revision_comparison_and_a_workload_into_an_existing_page():
    make_docs = _bench_module("make_docs")
    page = ("# Benchmarks\n\n## Results\n\n### conv-small\n\nold table\n\n### nets\n\nstale\n\n"
            "## Targets\n\nold targets\n")
    rev = {"old": "5db3609" + "0" * 33, "new": "abcdef1" + "0" * 33, "load_average": [0.5, 0.4, 0.3],
           "settings": {"threads": [2], "repeat": 7, "warmup": 2, "threshold": 0.97, "wait_cores": 5.0},
           "rows": [{"workload": "conv-large", "case": "forward", "backend": "openmp", "threads": 2,
                     "old_ms": 25.0, "new_ms": 24.0, "ratio": 1.04, "ratio_ci": [0.99, 1.08], "ok": True,
                     "check": "max normalised error 0.00e+00 (y)", "check_ok": True}]}
    case = {"name": "resnet20 training step batch=128", "params": {"net": "resnet20", "mode": "train", "N": 128},
            "note": "resnet20 input 3x32x32", "checks": [],
            "results": [{"config": "openmp@2", "impl": "openmp", "threads": 2, "median": 0.1, "vs_torch": 1.6},
                        {"config": "torch@2", "impl": "torch", "threads": 2, "median": 0.16}]}
    results = {"workloads": {"nets": {"title": "nets", "cases": [case]}}, "revisions": rev,
               "machine": {"date": "today", "load_average": [1.0, 1.0, 1.0]}}
    out = make_docs.splice(page, results, [])
    assert "old table" in out and "old targets" in out and "stale" not in out
    assert out.index("### nets") < out.index("## Revision comparison") < out.index("## Targets")
    assert "| conv-large | forward | openmp@2 | 25 | 24 | 1.040 (0.990–1.080) | ✅ |" in out
    assert "*Measured separately from the rest of this page: today" in out
    assert "| resnet20 training step batch=128 | 100 | 160 |" in out
    assert make_docs.splice(out, results, []) == out  # splicing again changes nothing


def test_compare_answers_takes_a_tolerance_per_key():
    harness = _bench_module("harness")
    ref = {"loss": np.array([1.0]), "grads": np.array([1.0, -2.0])}
    got = {"loss": np.array([1.0005]), "grads": np.array([1.02, -2.0])}
    assert not harness.compare_answers(got, ref)["ok"]  # grads 1e-2 over the default 1e-3
    res = harness.compare_answers(got, ref, {"grads": 5e-2})
    assert res["ok"] and res["worst_key"] == "loss"  # loss uses half its default, grads a fifth of theirs
    res = harness.compare_answers(got, ref, {"grads": 5e-2, "loss": 1e-4})
    assert not res["ok"] and res["worst_key"] == "loss" and "tolerance 0.0001" in res["message"]


def test_precision_section_survives_a_full_regeneration_and_its_subsections_each_other(tmp_path):
    """bench/precision.py writes "## Conv precision" (its Accuracy and Speed subsections separately);
    make_docs.write_docs, which renders the rest of the page afresh, keeps it."""
    make_docs = _bench_module("make_docs")
    precision = _bench_module("precision")
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Results\n\nold\n\n## Amdahl analysis\n\nA\n", encoding="utf-8")
    precision.write_section("Speed", ["| speed table |"], str(tmp_path))
    precision.write_section("Accuracy", ["| accuracy table |"], str(tmp_path))
    precision.write_section("Speed", ["| new speed table |"], str(tmp_path))
    text = page.read_text(encoding="utf-8")
    assert text.count("## Conv precision") == 1 and "| speed table |" not in text
    assert (text.index("## Results") < text.index("### Accuracy") < text.index("| accuracy table |")
            < text.index("### Speed") < text.index("| new speed table |") < text.index("## Amdahl analysis"))
    section = text[text.index("## Conv precision"):text.index("## Amdahl analysis")]
    kept = make_docs.keep_sections(text, "# Benchmarks\n\n## Results\n\nnew\n\n## Amdahl analysis\n\nB\n")
    assert section in kept and "\nnew\n" in kept and "\nold\n" not in kept
    assert kept.index("## Conv precision") < kept.index("## Amdahl analysis")
    assert make_docs.keep_sections(kept, kept) == kept


def test_the_isa_dispatch_measurements_survive_a_full_regeneration():
    """The speed and build-time comparisons of the ISA dispatch are taken by hand (two builds side by
    side), so make_docs.write_docs keeps them like the precision section."""
    make_docs = _bench_module("make_docs")
    heading = "## Kernel ISA dispatch: speed and build time"
    text = f"# Benchmarks\n\n## Results\n\nold\n\n{heading}\n\n| build | CPU s |\n\n## Amdahl analysis\n\nA\n"
    kept = make_docs.keep_sections(text, "# Benchmarks\n\n## Results\n\nnew\n\n## Amdahl analysis\n\nB\n")
    assert heading in kept and "| build | CPU s |" in kept and "\nold\n" not in kept
    assert make_docs.keep_sections(kept, kept) == kept


def test_a_generated_section_keeps_its_hand_written_tail_when_regenerated():
    """bench/quantized.py --docs rewrites "## int8 inference" but keeps what follows its HAND_WRITTEN
    marker (notes on what changed, runs on other hosts); a section without the marker is replaced whole."""
    make_docs = _bench_module("make_docs")
    heading = "## int8 inference"
    notes = [make_docs.HAND_WRITTEN, "", "still short: x", "", "### int8 on another host", "", "| t |"]
    text = "\n".join(["# Benchmarks", "", heading, "", "| old table |", ""] + notes + ["", "## Amdahl analysis", "", "A"])
    tail = make_docs.hand_written_tail(text, heading)
    assert tail[0] == make_docs.HAND_WRITTEN and "### int8 on another host" in tail and "| old table |" not in tail
    out = make_docs.replace_section(text, heading, [heading, "", "| new table |", ""] + tail)
    assert "| new table |" in out and "| old table |" not in out and "still short: x" in out
    assert out.index("| new table |") < out.index("### int8 on another host") < out.index("## Amdahl analysis")
    assert make_docs.hand_written_tail(out, heading) == make_docs.hand_written_tail(text, heading)
    assert make_docs.hand_written_tail(text.replace(make_docs.HAND_WRITTEN, ""), heading) == []


def test_precision_error_is_the_worst_tensor_scaled_by_its_largest_value():
    precision = _bench_module("precision")
    ref = {"a": np.array([1.0, -4.0]), "b": np.array([0.5, 0.0]), "z": np.zeros(2)}
    got = {"a": np.array([1.0, -3.0]), "b": np.array([0.25, 0.0]), "z": np.zeros(2)}
    assert precision.worst_error(got, ref) == (0.5, "b")
    assert precision.within_bound([1e-5, 2e-3], [1e-6, 1e-6]) is False  # worst above 10 x 1e-4
    assert precision.within_bound([1e-5, 9e-4], [1e-6, 1e-6]) is True
    assert precision.within_bound([0.1, 0.2], [0.02, 0.03]) is True
    assert precision.within_bound([0.5, 0.5], [0.02, 0.03]) is False  # median above 10 x 0.025


def test_busy_neighbours_spin_while_the_block_runs_and_are_killed_after():
    W = _bench_module("workloads")
    with pytest.raises(KeyboardInterrupt):
        with W.busy_neighbours(2, bound_s=60) as procs:
            assert len(procs) == 2 and all(p.poll() is None for p in procs)
            raise KeyboardInterrupt  # an interrupted suite leaves no spinning process behind
    assert all(p.poll() is not None for p in procs)
    with W.busy_neighbours(1, bound_s=0.2) as procs:  # bounded in time even if never killed
        procs[0].wait(timeout=30)
        assert procs[0].returncode == 0


def test_contended_workload_checks_and_times_with_busy_neighbours(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--no-progress", "--no-plots",
                           "--no-amdahl", "--threads", "1,2", "--backends", "openmp",
                           "--compare", "auto" if HAVE_TORCH else "none", "--workloads", "contended",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    cases = results["workloads"]["contended"]["cases"]
    assert {(c["params"]["net"], c["params"]["busy"]) for c in cases} == {
        ("cnn-mnist", 0), ("cnn-mnist", 1), ("resnet20", 0), ("resnet20", 1)}
    for case in cases:
        assert case["checks"] and all(c["ok"] for c in case["checks"]), case["name"]
        timed = {r["config"] for r in case["results"]}
        # the default: no thread count set (parconv caps its teams under load), PyTorch's own default
        assert {"openmp@1", "openmp@2", "openmp@default"} <= timed, timed
        assert not HAVE_TORCH or {"torch@2", "torch@default"} <= timed, timed
    # quick mode evaluates no targets; their shape: one "default vs the better of 1 and 2" per loaded case
    entries = [e for e in _bench_module("targets").evaluate(results) if e["workload"] == "contended"]
    slack = [e for e in entries if e["target"].startswith("default threads")]
    assert {e["case"] for e in slack} == {c["name"] for c in cases if c["params"]["busy"]}
    assert all(e["value"] is not None and e["threshold"] == 0.8 for e in slack), slack
    page = _bench_module("make_docs").render(results, [])
    assert "### contended" in page and "resnet20 training step batch=2, 1 busy" in page


def test_nets_table_has_training_steps_at_batch_32_and_128():
    W = _bench_module("workloads")
    names = {c.name for c in W.WORKLOADS["nets"].cases(False, {})}
    for net in pc.models.ZOO:
        assert {f"{net} training step batch=32", f"{net} training step batch=128"} <= names, net


def test_contended_targets_compare_with_the_same_load_and_the_quiet_margin():
    targets = _bench_module("targets")

    def case(net, busy, t1, t2, vs_torch):
        return {"name": f"{net} {busy} busy", "params": {"net": net, "busy": busy, "default_threads": 2},
                "results": [{"impl": "openmp", "threads": 1, "median": t1},
                            {"impl": "openmp", "threads": 2, "median": t2, "vs_torch": vs_torch}]}

    results = {"workloads": {"contended": {"cases": [
        case("resnet20", 0, 60.0, 40.0, 1.8), case("resnet20", 1, 80.0, 90.0, 2.0),
        case("resnet20", 2, 100.0, 130.0, 1.5)]}}}
    got = {(e["case"], e["target"].split()[0]): (round(e["value"], 3), e["threshold"], e["ok"])
           for e in targets.evaluate(results) if e["workload"] == "contended"}
    assert got == {("resnet20 1 busy", "default"): (0.889, 0.8, True), ("resnet20 1 busy", "vs"): (2.0, 1.8, True),
                   ("resnet20 2 busy", "default"): (0.769, 0.8, False), ("resnet20 2 busy", "vs"): (1.5, 1.8, False)}

    def case_default(busy, t1, t2, td, vs_torch):  # the run.py form: a row with no thread count set
        c = case("resnet20", busy, t1, t2, None)
        c["params"]["default_threads"] = -1
        c["results"].append({"impl": "openmp", "threads": -1, "median": td, "vs_torch": vs_torch})
        return c

    results = {"workloads": {"contended": {"cases": [case_default(0, 60.0, 40.0, 41.0, 1.8),
                                                     case_default(2, 100.0, 130.0, 110.0, 1.9)]}}}
    got = {(e["case"], e["target"].split()[0]): (round(e["value"], 3), e["threshold"], e["ok"], e["config"])
           for e in targets.evaluate(results) if e["workload"] == "contended"}
    assert got == {("resnet20 2 busy", "default"): (0.909, 0.8, True, "openmp@default"),
                   ("resnet20 2 busy", "vs"): (1.9, 1.8, True, "openmp@default")}


def test_a_run_of_some_cases_merges_its_rows_into_the_page_table():
    make_docs = _bench_module("make_docs")
    page = "\n".join(["# Benchmarks", "", "## Results", "", "### nets", "", "*Measured separately from the rest "
                      "of this page: day 1.*", "", "nets: batch 128.", "", "| case | a ms |", "| --- | ---: |",
                      "| lenet5 training step batch=128 | 2 |", "| lenet5 inference batch=1 | 1 |",
                      "| mlp training step batch=1 | 3 |", "", "Targets of this workload:", "", "## Targets", ""])
    fresh = ["### nets", "", "*Measured separately from the rest of this page: day 2.*", "", "nets: batch 32 and 128.",
             "", "| case | a ms |",
             "| --- | ---: |", "| lenet5 training step batch=32 | 9 |", "| mlp training step batch=1 | 4 |", ""]
    old = make_docs._sections(page)
    body = next(b for h, b in old if h == "### nets")
    merged = make_docs._merge_rows(body, fresh, ["training step"])
    rows = [line for line in merged if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| lenet5 training step batch=32 | 9 |", "| lenet5 training step batch=128 | 2 |",
                    "| lenet5 inference batch=1 | 1 |", "| mlp training step batch=1 | 4 |"]
    assert "*Rows of the cases matching 'training step' measured separately: day 2.*" in merged
    assert "*Measured separately from the rest of this page: day 1.*" in merged  # the rest keeps its run
    assert "Targets of this workload:" in merged
    assert "nets: batch 32 and 128." in merged and "nets: batch 128." not in merged
    other = make_docs._merge_rows(body, [line.replace("a ms", "b ms") for line in fresh], ["x"])
    assert "| lenet5 training step batch=32 | – |" in other  # a column the new run lacks
    assert make_docs._merge_rows(body, [line.replace("| case |", "| step |") for line in fresh], ["x"]) is None


def test_mpi_cost_model_hides_the_measured_window_only():
    """bench/mpi_bench.py's cost model: a flat overlap hides that share of every allreduce; a measured
    window hides at most ``overlap * window`` seconds, so a longer reduction at many ranks is exposed."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import mpi_bench
    finally:
        sys.path.pop(0)
    base = dict(compute_per_sample_s=1e-3, grad_bytes=4e6, batch_per_rank=10, bandwidth=1e9, latency=1e-5,
                ranks=[2, 1024])
    full = [r["allreduce_s"] for r in mpi_bench.cost_model(**base)]
    flat = [r["allreduce_s"] for r in mpi_bench.cost_model(**base, overlap=0.25)]
    np.testing.assert_allclose(flat, [0.75 * f for f in full])
    window = 0.5 * full[0]
    windowed = [r["allreduce_s"] for r in mpi_bench.cost_model(**base, overlap=0.8, overlap_window_s=window)]
    np.testing.assert_allclose(windowed, [f - 0.8 * min(f, window) for f in full])
    assert windowed[1] > full[1] - window  # the window, not a share of the reduction, is what is hidden


def test_cpu_clock_leaves_out_the_time_other_processes_take(monkeypatch):
    """PARCONV_BENCH_CLOCK=cpu (compare_revisions.py --clock cpu) times the process's CPU, not the wall."""
    import importlib
    import time

    class Sleeper:  # stands for a sample during which the scheduler runs someone else
        def prepare(self):
            pass

        def run(self):
            time.sleep(0.05)

        def sync(self):
            pass

    monkeypatch.syspath_prepend(BENCH)
    harness = _bench_module("harness")
    monkeypatch.setenv("PARCONV_BENCH_CLOCK", "cpu")
    try:
        assert importlib.reload(harness)._one_sample(Sleeper(), 2) < 0.02
    finally:
        monkeypatch.delenv("PARCONV_BENCH_CLOCK")
        importlib.reload(harness)
    assert harness._one_sample(Sleeper(), 1) >= 0.05
    cr = _bench_module("compare_revisions")
    with pytest.raises(SystemExit, match="--clock cpu times one thread only"):
        cr.main(["--old-tree", ".", "--new-tree", ".", "--clock", "cpu", "--threads", "1,2"])


def test_int8_rows_check_every_answer_before_timing(monkeypatch):
    # --precision int8 on the nets workload: parconv int8 against its fp32 model, PyTorch's fp32 twin and its
    # int8 model (where PyTorch runs) checked, then timed per batch and thread count
    import argparse

    sys.path.insert(0, BENCH)
    try:
        import quantized
    finally:
        sys.path.remove(BENCH)
    monkeypatch.setattr(quantized, "QUICK_NETS", ("lenet5", "mlp"))
    args = argparse.Namespace(quick=True, repeat=1, warmup=1, min_time=0.0, gap=0.0, idle_wait=0.0)
    lines = []
    out = quantized.run_int8(args, [1], HAVE_TORCH, lines.append)
    assert not out["failed"], lines
    assert [e["net"] for e in out["nets"]] == ["lenet5", "mlp"]
    for entry in out["nets"]:
        assert entry["checks"]["parconv-int8"]["ok"]
        if HAVE_TORCH:
            assert {"torch-fp32", "torch-int8"} <= set(entry["checks"]) or "torch_int8_error" in entry
        assert [(r["batch"], r["threads"]) for r in entry["rows"]] == [(1, 1), (4, 1)]
        assert all(r["int8_vs_fp32"] > 0 for r in entry["rows"])


def test_int8_rows_for_chosen_nets(monkeypatch):
    # bench/quantized.py --nets: only those networks (checked and timed as always); an unknown name is refused
    import argparse

    sys.path.insert(0, BENCH)
    try:
        import quantized
    finally:
        sys.path.remove(BENCH)
    args = argparse.Namespace(quick=True, repeat=1, warmup=1, min_time=0.0, gap=0.0, idle_wait=0.0, nets=("mlp",))
    lines = []
    out = quantized.run_int8(args, [1], False, lines.append)
    assert not out["failed"], lines
    assert [e["net"] for e in out["nets"]] == ["mlp"]
    with pytest.raises(SystemExit, match="--nets takes names from .*got resnet"):
        quantized.main(["--nets", "resnet", "--no-torch"])


def test_unknown_precision_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--precision", "fp8",
                           "--workloads", "nets", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "unknown --precision" in proc.stderr


# ------------------------------------------------------------------------------ --precision
def _run_bench_in_process(tmp_path, *argv):
    run = _bench_module("run")
    rc = run.main(["--quick", "--threads", "1", "--no-progress", "--no-plots", "--no-memory", "--no-amdahl",
                   "--out", str(tmp_path), *argv])
    return rc, json.loads((tmp_path / "results.json").read_text())


def test_precision_bf16_times_both_precisions_interleaved_and_checks_them(tmp_path, capsys):
    rc, results = _run_bench_in_process(tmp_path, "--workloads", "nets", "--backends", "openmp",
                                        "--precision", "fp32,bf16", "--cases",
                                        "cnn-mnist inference batch=2,resnet20 training step")
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert results["settings"]["precisions"] == ["fp32", "bf16"]
    assert results["settings"]["bf16"]["mode"] in ("native", "emulated")
    cases = results["workloads"]["nets"]["cases"]
    assert len(cases) == 2
    for case in cases:
        labels = {c["config"] for c in case["checks"]}
        want = {"openmp@1", "openmp-bf16@1"} | ({"torch@1", "torch-bf16@1"} if HAVE_TORCH else set())
        assert want <= labels, labels
        assert all(c["ok"] for c in case["checks"])
        # parconv's bf16 is checked against the NumPy model of its rounding, then against the float32 answer
        refs = {(c["config"], c["size"]): c.get("reference") for c in case["checks"]}
        assert refs[("openmp-bf16@1", "small")] == "numpy oracle (bf16)"
        assert {r["config"] for r in case["results"]} >= {"openmp@1", "openmp-bf16@1"}


def test_precision_bf16_check_fails_when_the_bf16_path_runs_fp32(tmp_path, capsys, monkeypatch):
    """A bf16 implementation that silently computes in float32 is caught, not timed."""
    from parconv.backends.openmp import OpenMPBackend

    monkeypatch.setattr(OpenMPBackend, "conv2d_forward_bf16", OpenMPBackend.conv2d_forward)
    monkeypatch.setattr(OpenMPBackend, "linear_forward_bf16", OpenMPBackend.linear_forward)
    rc, results = _run_bench_in_process(tmp_path, "--workloads", "nets", "--backends", "openmp", "--compare",
                                        "none", "--precision", "bf16", "--cases", "cnn-mnist inference batch=2")
    capsys.readouterr()
    assert rc == 1
    (case,) = results["workloads"]["nets"]["cases"]
    bad = [c for c in case["checks"] if not c["ok"]]
    assert bad and bad[0]["config"] == "openmp-bf16@1"
