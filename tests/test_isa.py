"""Runtime ISA dispatch: one build carries every vector level, the CPU picks one at import.

Each level the host runs is loaded in its own process (``PARCONV_ISA``) and
checked against the NumPy reference on every op of the table; results at a
fixed level and thread count must repeat bit for bit. The baseline objects
must hold no AVX instruction, or the portable wheel would crash on older CPUs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

# the folder holding the imported parconv (a source tree or site-packages); the children run "-P"
# so that a source checkout in their working directory cannot shadow it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__))))
RUNNABLE = [lv for lv in ext.STATE["built"] if lv in ext.STATE["supported"]]


def _run(code, isa=None, timeout=600):
    env = dict(os.environ)
    env.pop("PARCONV_ISA", None)
    if isa is not None:
        env["PARCONV_ISA"] = isa
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_kernel_module_goes_through_the_one_table():
    import parconv._ext as e
    from parconv._ext import _conv

    level = e.STATE["level"]
    assert level in e.LEVELS
    assert set(e.DISPATCH) == set(e.KERNEL_MODULES)
    for name, module in e.DISPATCH.items():
        assert sys.modules[f"parconv._ext.{name}"] is module
        assert getattr(e, name) is module
        assert module.__name__ == f"parconv._ext._isa_{level}.{name}"
    assert _conv.kernel_isa() == level
    # without PARCONV_ISA the best level this CPU runs and the build has
    if not os.environ.get("PARCONV_ISA"):
        assert level == RUNNABLE[-1]


def _left_out():
    import parconv as pc

    return {lv for lv, why in pc.show_config(mode="dicts")["build"].get("not_built", {}).items()
            if "PARCONV_BUILD_LEVELS" in why}


def test_x86_builds_carry_every_level():
    import platform

    import parconv as pc

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 only")
    if _left_out():
        pytest.skip(f"levels {sorted(_left_out())} left out of this build by PARCONV_BUILD_LEVELS")
    built = ext.STATE["built"]
    assert built == ["generic", "avx2", "avx512"], f"levels built: {built}"
    build = pc.show_config(mode="dicts")["build"]
    assert sorted(build["levels"]) == ["avx2", "avx512", "generic"]
    # nothing tied to the build machine: a wheel from here runs on any x86-64
    assert not any("native" in f for f in build["levels"].values()), build["levels"]
    assert not any("native" in f for f in build["common_flags"]), build["common_flags"]


def test_supported_levels_follow_the_cpu_features():
    v3 = dict.fromkeys(("avx", "avx2", "fma", "bmi1", "bmi2"), True)
    v4 = dict(v3, **dict.fromkeys(("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"), True))
    assert ext.supported_levels({}) == ["generic"]
    assert ext.supported_levels(dict(v3, fma=False)) == ["generic"]
    assert ext.supported_levels(v3) == ["generic", "avx2"]
    assert ext.supported_levels(dict(v4, avx512bw=False)) == ["generic", "avx2"]
    assert ext.supported_levels(v4) == ["generic", "avx2", "avx512"]
    # the compiler's psABI answer wins over the list where it has one
    assert ext.supported_levels(dict(v4, **{"x86-64-v4": False})) == ["generic", "avx2"]


def test_choose_picks_the_best_and_honours_a_lower_request():
    feats = {"avx2": True, "fma": True}
    both, allb = ["generic", "avx2"], ["generic", "avx2", "avx512"]
    assert ext.choose(None, both, allb, feats)[0] == "avx2"
    assert ext.choose("generic", both, allb, feats) == ("generic", "PARCONV_ISA=generic")
    assert ext.choose(" AVX2 ", both, allb, feats)[0] == "avx2"
    assert ext.choose(None, allb, ["generic"], feats)[0] == "generic"
    assert ext.choose(None, both, [], feats)[0] is None


def test_choose_rejects_what_the_cpu_cannot_run_and_says_what_it_has():
    feats = {"avx2": True, "fma": True, "avx512f": False}
    with pytest.raises(ext.ISAError, match=r"PARCONV_ISA=avx512 .*runs only generic, avx2 .*has: avx2, fma"):
        ext.choose("avx512", ["generic", "avx2"], ["generic", "avx2", "avx512"], feats)
    with pytest.raises(ext.ISAError, match=r"'sse9' is not a kernel level; use one of generic, avx2, avx512"):
        ext.choose("sse9", ["generic"], ["generic"], feats)
    with pytest.raises(ext.ISAError, match=r"no avx2 kernels \(built: generic\)"):
        ext.choose("avx2", ["generic", "avx2"], ["generic"], feats)


def test_a_bad_request_fails_loudly_at_the_kernels_and_show_config_reports_it():
    r = _run("""
        import parconv as pc
        info = pc.show_config(mode="dicts")
        print("ERROR=" + str(info["kernels"]["error"]))
        try:
            from parconv._ext import _conv
        except RuntimeError as exc:
            print("IMPORT=" + type(exc).__name__)
        try:
            pc.get_backend()
        except Exception as exc:
            print("DEFAULT=" + type(exc).__name__)
    """, isa="sse9")
    assert r.returncode == 0, r.stderr
    assert "ERROR=PARCONV_ISA='sse9' is not a kernel level" in r.stdout
    assert "IMPORT=ISAError" in r.stdout
    # the default backend does not quietly fall back to NumPy when kernels were asked for by name
    assert "DEFAULT=" in r.stdout


@pytest.mark.parametrize("level", RUNNABLE)
def test_each_level_agrees_with_numpy_and_repeats_bit_for_bit(level):
    """The op table's fixed cases on the openmp backend at ``level``, and a training step run twice."""
    r = _run("""
        import json, numpy as np, parconv as pc
        from parconv._ext import _conv
        from parconv.backends.numpy_ref import NumpyBackend
        from parconv.optable import OPS
        from parconv.selftest import Checker

        be, ref = pc.backends.get("openmp"), NumpyBackend()
        ck = Checker(be)
        rng = np.random.default_rng(0)
        for spec in OPS:
            for case in spec.fixed:
                spec.check(ck, ref, rng, case)
        bad = {n: r.notes for n, r in ck.results.items() if not r.ok}

        def step():
            x = np.random.default_rng(1).standard_normal((4, 3, 12, 12)).astype(np.float32)
            y = np.array([0, 1, 2, 3])
            pc.manual_seed(3)
            m = pc.Sequential(pc.Conv2d(3, 8, 3, padding=1), pc.BatchNorm2d(8), pc.ReLU(), pc.MaxPool2d(2),
                              pc.Conv2d(8, 8, 3, padding=1), pc.ReLU(), pc.Flatten(), pc.Linear(8 * 36, 5),
                              backend="openmp")
            m.fit(x, y, loss=pc.SoftmaxCrossEntropy(), optimizer=pc.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                  epochs=2, batch_size=2, verbose=False, shuffle=False)
            return np.concatenate([pc.to_numpy(p.data).ravel() for p in m.parameters()])

        with pc.num_threads(2):
            a, b = step(), step()
        print(json.dumps({"isa": _conv.kernel_isa(), "checks": len(ck.results), "bad": bad,
                          "same": bool(np.array_equal(a, b)), "finite": bool(np.isfinite(a).all())}))
    """, isa=level)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["isa"] == level
    assert out["checks"] > 20
    assert not out["bad"], out["bad"]
    assert out["finite"] and out["same"], "a training step at a fixed level and thread count is not reproducible"


def test_show_config_and_parconv_info_name_the_level():
    import parconv as pc

    info = pc.show_config(mode="dicts")
    assert info["kernels"]["level"] == ext.STATE["level"]
    assert info["kernels"]["built"] == ext.STATE["built"]
    assert set(info["build"]["levels"]) == set(ext.STATE["built"])
    with pytest.raises(ValueError, match="mode must be 'stdout' or 'dicts'"):
        pc.show_config(mode="json")
    level = RUNNABLE[0]
    r = _run("import sys; from parconv.cli import main; sys.exit(main(['info']))", isa=level)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^kernels: {level} \(", r.stdout, re.M), r.stdout
    assert f"PARCONV_ISA={level}" in r.stdout


def _so(pattern):
    return sorted(glob.glob(os.path.join(os.path.dirname(ext.__file__), pattern)))


# VEX/EVEX-encoded instructions (every AVX, AVX2, FMA and AVX-512 one) and their registers
_AVX = re.compile(r"\t(v[a-z0-9]+|kmov[bwdq]|kor[bwdq]|kand[bwdq])\s|%[yz]mm\d")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump not installed")
def test_baseline_objects_hold_no_avx_instruction():
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 only")
    if {"generic", "avx512"} & _left_out():
        pytest.skip("the generic or avx512 level is left out of this build by PARCONV_BUILD_LEVELS")
    baseline = _so("_isa_generic/*.so") + _so("_threads*.so") + _so("_cpu*.so") + _so("_cyutility*.so")
    assert len(baseline) == len(ext.KERNEL_MODULES) + 3, baseline
    for path in baseline:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                             check=True).stdout
        hits = [line for line in asm.splitlines() if _AVX.search(line)]
        assert not hits, f"{os.path.basename(path)} has AVX instructions, e.g. {hits[:3]}"
    # and the test does see them where they belong
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _so("_isa_avx512/_conv*.so")[0]],
                         capture_output=True, text=True, check=True).stdout
    assert "%zmm" in asm
