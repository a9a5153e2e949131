"""The pointwise (1x1, stride 1, no padding) convolution GEMM: forward with the per-filter scale,
bias and ReLU applied as it stores, and dx, against NumPy in float64 at every ISA level this host
runs (each in its own process); the backend's 1x1 path against the oracle; bit-for-bit repeats."""

import os
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, needs_torch, run_at_isa_level

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

from parconv._ext import _conv_general  # noqa: E402



def _run_case(n, c, o, h, w, bias, scale, relu, seed, threads=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((o, c, 1, 1)) / np.sqrt(c)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32) if bias else None
    sc = rng.uniform(0.5, 1.5, o).astype(np.float32) if scale else None
    dy = rng.standard_normal((n, o, h, w)).astype(np.float32)
    y = np.empty((n, o, h, w), np.float32)
    dx = np.empty_like(x)
    _conv_general.pointwise_forward(x, wt, b, y, threads, scale=sc, relu=relu)
    _conv_general.pointwise_backward_input(dy, wt, dx, threads)
    x64, w64 = x.astype(np.float64), wt[:, :, 0, 0].astype(np.float64)
    want = np.einsum("oc,nchw->nohw", w64, x64)
    if scale:
        want = want * sc[None, :, None, None]
    if bias:
        want = want + b[None, :, None, None]
    if relu:
        want = np.maximum(want, 0)
    want_dx = np.einsum("oc,nohw->nchw", w64, dy.astype(np.float64))
    return {"y": y, "dx": dx}, {"y": want, "dx": want_dx}


def _close(got, want):
    for key, value in want.items():
        scale = max(1.0, float(np.abs(value).max(initial=0.0)))
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=2e-5 * scale, err_msg=key)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12),
       st.booleans(), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_pointwise_matches_the_float64_oracle(n, c, o, h, w, bias, scale, relu, seed):
    _close(*_run_case(n, c, o, h, w, bias, scale, relu, seed))


@pytest.mark.parametrize("shape", [(2, 16, 32, 32, 32), (3, 64, 24, 8, 8), (2, 20, 9, 4, 4), (1, 8, 13, 5, 7)])
def test_pointwise_register_blocks_and_tails(shape):
    """Full 8 x 32 blocks, 16-position slabs, filter and position remainders."""
    _close(*_run_case(*shape, True, True, True, 1))


def test_pointwise_repeats_bit_for_bit_on_two_threads():
    first, _ = _run_case(8, 48, 40, 20, 20, True, False, True, 2, threads=2)
    for _ in range(3):
        again, _ = _run_case(8, 48, 40, 20, 20, True, False, True, 2, threads=2)
        for key in first:
            np.testing.assert_array_equal(first[key], again[key], err_msg=key)


def test_the_backend_runs_1x1_convolutions_on_the_pointwise_kernels():
    """conv2d and its backward, and the eval-mode BatchNorm fold, through the 1x1 path."""
    be = pc.backends.get("openmp")
    ref = pc.backends.get("numpy")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 24, 6, 7)).astype(np.float32)
    w = (rng.standard_normal((20, 24, 1, 1)) / 5).astype(np.float32)
    b = rng.standard_normal(20).astype(np.float32)
    dy = rng.standard_normal((3, 20, 6, 7)).astype(np.float32)
    f64 = np.float64
    assert_close(be.conv2d_forward(x, w, b, 1, 0), ref.conv2d_forward(x.astype(f64), w.astype(f64), b.astype(f64),
                                                                       1, 0), rtol=1e-5, atol=1e-5)
    for got, want in zip(be.conv2d_backward(x, w, dy, 1, 0),
                         ref.conv2d_backward(x.astype(f64), w.astype(f64), dy.astype(f64), 1, 0)):
        assert_close(got, want, rtol=1e-4, atol=1e-4)
    g, beta = rng.uniform(0.5, 1.5, 20).astype(np.float32), rng.standard_normal(20).astype(np.float32)
    rm, rv = rng.standard_normal(20).astype(np.float32), rng.uniform(0.5, 2, 20).astype(np.float32)
    got = be.conv2d_batch_norm_eval_forward(x, w, b, g, beta, rm, rv, 1e-5, 1, 0, True)
    want = ref.conv2d_batch_norm_eval_forward(*(a.astype(f64) for a in (x, w, b, g, beta, rm, rv)), 1e-5, 1, 0, True)
    assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_torch
def test_pointwise_conv_matches_torch():
    import torch

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 32, 9, 9)).astype(np.float32)
    w = (rng.standard_normal((48, 32, 1, 1)) / 6).astype(np.float32)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w)).numpy()
    assert_close(F.conv2d(x, w, backend="openmp"), want, rtol=1e-4, atol=1e-5)


def _child_code():
    return textwrap.dedent("""
        import json, sys
        import numpy as np
        sys.path.insert(0, %r)
        import test_pointwise as t
        from conftest import case_failures
        from parconv._ext import _conv_general
        rng = np.random.default_rng(12)
        cases = []
        for i in range(30):
            case = tuple(int(v) for v in rng.integers(1, [3, 40, 40, 12, 12])) + (bool(i %% 2), bool(i %% 3 == 0),
                                                                                bool(i %% 4 < 2), i)
            cases.append(case)
        fails = case_failures(t._run_case, t._close, cases)
        print(json.dumps({"level": _conv_general.__name__, "fails": fails}))
    """ % os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_every_isa_level_matches_the_oracle(level):
    result = run_at_isa_level(level, _child_code())
    assert result["level"] == f"parconv._ext._isa_{level}._conv_general"
    assert result["fails"] == []
