"""Shared fixtures: one test body runs on every available backend."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, settings

import parconv as pc
import parconv.functional as F

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "ci", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
    print_blob=True,
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "default"))

BACKENDS = pc.available_backends()
DEVICE_BACKENDS = [b for b in BACKENDS if b != "numpy"]

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _full_teams(request, monkeypatch):
    """Every kernel call on its full team: the tests of thread counts, races and barriers must run
    their small shapes on several threads, which parconv's sizing of calls by their work (one thread
    for a call below a few region starts) would not. Tests marked ``region_sizing`` keep it."""
    if request.node.get_closest_marker("region_sizing") or "openmp" not in BACKENDS:
        yield
        return
    from parconv import _config
    from parconv._ext import DISPATCH

    monkeypatch.setattr(_config, "_measure_region", lambda n: None)
    old = {name: m._get_region_ns() for name, m in DISPATCH.items() if hasattr(m, "_get_region_ns")}
    for name in old:
        DISPATCH[name]._set_region_ns(0.0)
    yield
    for name, ns in old.items():
        DISPATCH[name]._set_region_ns(ns)


def run_at_isa_level(level: str, code: str, timeout: int = 600) -> dict:
    """Run ``code`` in a fresh interpreter with ``PARCONV_ISA=level`` (this tree's parconv first on the path)
    and return the JSON object on the last line it prints; skips where the host or build cannot run ``level``."""
    import json
    import subprocess
    import sys

    from parconv import _ext

    if level not in [lv for lv in _ext.STATE["built"] if lv in _ext.STATE["supported"]]:
        pytest.skip(f"this host or build does not run the {level} level")
    env = dict(os.environ)
    env["PARCONV_ISA"] = level
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(pc.__file__))) + os.pathsep + \
        env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case_failures(run_case, close, cases) -> list:
    """Each case run twice (``run_case(*case)`` -> (got, want) dicts): a line per case whose result is
    not ``close`` to the oracle's or whose two runs differ in a bit (for the children of run_at_isa_level)."""
    fails = []
    for case in cases:
        try:
            got, want = run_case(*case)
            close(got, want)
            again, _ = run_case(*case)
            for key in got:
                if got[key] is not None and not np.array_equal(got[key], again[key]):
                    raise AssertionError(key + " differs between two runs")
        except AssertionError as exc:
            fails.append(repr(case) + ": " + str(exc)[:300])
    return fails


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request):
    """Every backend that loads on this machine (numpy, openmp, opencl, ...)."""
    return pc.backends.get(request.param)


@pytest.fixture(scope="session")
def oracle():
    return pc.backends.get("numpy")


def host(a):
    return np.asarray(pc.to_numpy(a))


def assert_close(actual, expected, rtol=RTOL, atol=ATOL, what=""):
    a, e = host(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TORCH = False

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch not installed (optional oracle)")


def numeric_grad(f, x, eps=1e-6, max_points=40, rng=None):
    """Central differences of scalar ``f`` w.r.t. float64 ``x`` at up to ``max_points`` coordinates.

    Returns (flat indices, numeric derivatives).
    """
    rng = rng or np.random.default_rng(0)
    flat = x.reshape(-1)
    idx = np.arange(flat.size) if flat.size <= max_points else rng.choice(flat.size, max_points, replace=False)
    out = []
    for i in idx:
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        out.append((fp - fm) / (2 * eps))
    return idx, np.array(out)


def conv_shapes(n, groups, cg, og, h, w, kh, kw, **kwargs):
    """(x shape, w shape, conv2d kwargs) of drawn sizes (cg input and og output channels a group); inside a
    hypothesis strategy, a draw whose convolution has no output is dropped."""
    x_shape, w_shape = (n, groups * cg, h, w), (groups * og, cg, kh, kw)
    kwargs = dict(kwargs, groups=groups)
    try:
        F.conv2d_output_shape(x_shape, w_shape, **kwargs)
    except ValueError:
        assume(False)
    return x_shape, w_shape, kwargs
