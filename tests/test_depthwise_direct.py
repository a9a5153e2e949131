"""The direct 3x3 depthwise kernels (dilation 1, strides 1 and 2): forward (with the ReLU applied
as it stores), dx and dw against the NumPy oracle in float64, at every ISA level this host runs
(each in its own process), bit-for-bit repeatable at a fixed thread count."""

import os
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parconv as pc
from conftest import run_at_isa_level

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

from parconv._ext import _conv_general  # noqa: E402

ORACLE = pc.backends.get("numpy")


def _out(n, k, s, lo, hi):
    return (n + lo + hi - k) // s + 1


def _run_case(n, c, m, h, w, stride, pads, bias, relu, seed, threads=1):
    """(got, want) dicts of one depthwise case: the kernels called directly, the oracle in float64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((c * m, 1, 3, 3)) / 3).astype(np.float32)
    b = rng.standard_normal(c * m).astype(np.float32) if bias else None
    P, Q = _out(h, 3, stride[0], pads[0], pads[1]), _out(w, 3, stride[1], pads[2], pads[3])
    dy = rng.standard_normal((n, c * m, P, Q)).astype(np.float32)
    args = (stride[0], stride[1], pads[0], pads[2], 1, 1, threads)
    y = np.empty((n, c * m, P, Q), np.float32)
    _conv_general.depthwise_forward(x, wt, b, y, *args, relu=relu)
    dx, dw = np.empty_like(x), np.empty_like(wt)
    db = np.empty(c * m, np.float32) if bias else None
    _conv_general.depthwise_backward(x, wt, dy, dx, dw, db, *args)
    f64 = np.float64
    want_y = ORACLE.conv2d_general_forward(x.astype(f64), wt.astype(f64), None if b is None else b.astype(f64),
                                          stride, pads, (1, 1), c)
    if relu:
        want_y = np.maximum(want_y, 0)
    want_dx, want_dw, want_db = ORACLE.conv2d_general_backward(x.astype(f64), wt.astype(f64), dy.astype(f64), stride,
                                                               pads, (1, 1), c, True, bias)
    return {"y": y, "dx": dx, "dw": dw, "db": db}, {"y": want_y, "dx": want_dx, "dw": want_dw, "db": want_db}


def _close(got, want):
    for key, value in want.items():
        if value is not None:
            scale = max(1.0, float(np.abs(value).max(initial=0.0)))
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=2e-5 * scale, err_msg=key)


@st.composite
def dw3_case(draw):
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pads = tuple(draw(st.integers(0, 3)) for _ in range(4))
    h, w = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    if h + pads[0] + pads[1] < 3 or w + pads[2] + pads[3] < 3:
        pads = (pads[0], pads[1] + 3, pads[2], pads[3] + 3)
    return (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 2)), h, w, stride, pads,
            draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))


def test_the_direct_kernels_take_3x3_strides_1_and_2_only():
    assert _conv_general.depthwise_path(3, 3, 1, 1, 1, 1) == "direct3x3"
    assert _conv_general.depthwise_path(3, 3, 2, 1, 1, 1) == "direct3x3"
    assert _conv_general.depthwise_path(3, 3, 2, 2, 1, 1) == "direct3x3"
    assert _conv_general.depthwise_path(3, 3, 3, 1, 1, 1) == "planes"
    assert _conv_general.depthwise_path(3, 3, 1, 1, 2, 1) == "planes"
    assert _conv_general.depthwise_path(5, 5, 1, 1, 1, 1) == "planes"


@settings(max_examples=60, deadline=None)
@given(dw3_case())
def test_direct_depthwise_matches_the_float64_oracle(case):
    _close(*_run_case(*case))


@pytest.mark.parametrize("stride", [(1, 1), (2, 2), (1, 2), (2, 1)])
def test_relu_is_applied_as_the_forward_stores(stride):
    got, want = _run_case(2, 5, 1, 9, 10, stride, (1, 1, 1, 1), True, True, 7)
    assert (got["y"] >= 0).all() and (got["y"] == 0).any()
    _close(got, want)


@pytest.mark.parametrize("stride", [(1, 1), (2, 2)])
def test_direct_depthwise_repeats_bit_for_bit_on_two_threads(stride):
    first, _ = _run_case(4, 24, 1, 20, 20, stride, (1, 1, 1, 1), True, False, 3, threads=2)
    for _ in range(3):
        again, _ = _run_case(4, 24, 1, 20, 20, stride, (1, 1, 1, 1), True, False, 3, threads=2)
        for key in first:
            np.testing.assert_array_equal(first[key], again[key], err_msg=key)


def _child_code():
    return textwrap.dedent("""
        import json, sys
        import numpy as np
        sys.path.insert(0, %r)
        import test_depthwise_direct as t
        from conftest import case_failures
        from parconv._ext import _conv_general
        rng = np.random.default_rng(11)
        cases = []
        for i in range(40):
            stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
            pads = tuple(int(v) for v in rng.integers(0, 3, 4))
            h, w = int(rng.integers(3, 19)), int(rng.integers(3, 19))
            case = (int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 3)), h, w, stride, pads,
                    bool(i %% 2), bool(i %% 3 == 0), i)
            cases.append(case)
        fails = case_failures(t._run_case, t._close, cases)
        print(json.dumps({"level": _conv_general.__name__, "fails": fails}))
    """ % os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_every_isa_level_matches_the_oracle(level):
    result = run_at_isa_level(level, _child_code())
    assert result["level"] == f"parconv._ext._isa_{level}._conv_general"
    assert result["fails"] == []
