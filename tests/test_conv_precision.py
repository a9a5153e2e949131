"""The convolution precision setting (``pc.set_conv_precision``): its API, what each value runs on
the OpenMP backend, and the accuracy of a whole network's gradients under the default.

The accuracy test is bench/precision.py's measurement at a small scale: resnet20 in training
mode at batch 4, the worst parameter gradient against float64 (PyTorch's where installed, else
the NumPy reference run in float64), next to PyTorch float32's error on the same inputs.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import parconv as pc
from conftest import HAVE_TORCH

pytest.importorskip("parconv._ext._conv", reason="OpenMP kernels not built")

from parconv._config import num_threads  # noqa: E402
from parconv._ext import _conv  # noqa: E402
from parconv.backends.openmp import OpenMPBackend  # noqa: E402

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if _BENCH not in sys.path:
    sys.path.append(_BENCH)

import precision  # noqa: E402  (bench/precision.py)

omp = OpenMPBackend()


@pytest.fixture(autouse=True)
def _default_precision():
    yield
    pc.set_conv_precision("high")


# ---------------------------------------------------------------------------------------- API
def test_default_is_high_and_set_get_round_trip():
    assert pc.get_conv_precision() == "high"
    for value in ("highest", "medium", "high"):
        pc.set_conv_precision(value)
        assert pc.get_conv_precision() == value


def test_scoped_form_restores_on_exit_and_on_error():
    with pc.conv_precision("highest"):
        assert pc.get_conv_precision() == "highest"
        with pc.conv_precision("medium"):
            assert pc.get_conv_precision() == "medium"
        assert pc.get_conv_precision() == "highest"
    assert pc.get_conv_precision() == "high"
    with pytest.raises(RuntimeError):
        with pc.conv_precision("medium"):
            raise RuntimeError("inside")
    assert pc.get_conv_precision() == "high"


@pytest.mark.parametrize("bad, exc", [("low", ValueError), ("HIGH", ValueError), ("", ValueError),
                                      (None, TypeError), (1, TypeError), (b"high", TypeError)])
def test_invalid_values_name_the_allowed_ones(bad, exc):
    for call in (pc.set_conv_precision, pc.conv_precision):
        with pytest.raises(exc, match="'highest', 'high', 'medium'"):
            with_ctx = call(bad)
            if hasattr(with_ctx, "__enter__"):
                with with_ctx:
                    pass
    assert pc.get_conv_precision() == "high"


# ------------------------------------------------------------- what each setting runs (bits)
def _case(seed, N, C, O, H, W):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((O, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
    dy = rng.standard_normal((N, O, H, W)).astype(np.float32)
    return x, w, dy


#: shapes of resnet20's three stages at batch 8: F(4x4, 3x3) applies to all of them, F(2x2, 3x3)
#: to the two wider ones, and the first takes F(4x4, 3x3)'s weight gradient
STAGES = [(8, 16, 16, 32, 32), (8, 32, 32, 16, 16), (8, 64, 64, 8, 8)]


def _direct(x, w, dy):
    """Forward and gradients of the direct kernels (the backend told not to run Winograd)."""
    omp.winograd = False
    try:
        return omp.conv2d_forward(x, w, None, 1, 1), omp.conv2d_backward(x, w, dy, 1, 1, True, True)
    finally:
        del omp.winograd


@pytest.mark.parametrize("shape", STAGES)
def test_highest_gives_the_direct_kernels_bits(shape):
    N, C, O, H, W = shape
    assert _conv.winograd4_applies(C, O, 3, 1, H, W, N)
    x, w, dy = _case(1, *shape)
    for threads in (1, 2):
        with num_threads(threads):
            y0, (dx0, dw0, db0) = _direct(x, w, dy)
            with pc.conv_precision("highest"):
                y, (dx, dw, db) = omp.conv2d_forward(x, w, None, 1, 1), omp.conv2d_backward(x, w, dy, 1, 1)
            # and not what the default computes: it would take Winograd somewhere on these shapes
            y1, (dx1, dw1, _) = omp.conv2d_forward(x, w, None, 1, 1), omp.conv2d_backward(x, w, dy, 1, 1)
        for got, want in ((y, y0), (dx, dx0), (dw, dw0), (db, db0)):
            assert np.array_equal(got, want)
        assert not (np.array_equal(dx1, dx0) and np.array_equal(dw1, dw0))


@pytest.mark.parametrize("shape", STAGES)
def test_high_keeps_f4_out_of_the_forward_only(shape):
    """"high" with gradients enabled: the forward as F(2x2, 3x3) or direct (never F(4x4, 3x3));
    dx and dw as "medium"."""
    N, C, O, H, W = shape
    x, w, dy = _case(2, *shape)
    with num_threads(2):
        y = omp.conv2d_forward(x, w, None, 1, 1)
        no_f4 = np.empty_like(y)
        _conv.conv2d_forward(x, w, None, no_f4, 1, 1, 2, winograd4=False)
        grads = omp.conv2d_backward(x, w, dy, 1, 1)
        with pc.conv_precision("medium"):
            y_medium = omp.conv2d_forward(x, w, None, 1, 1)
            grads_medium = omp.conv2d_backward(x, w, dy, 1, 1)
    assert np.array_equal(y, no_f4)
    assert not np.array_equal(y, y_medium)  # "medium" runs F(4x4, 3x3) here
    for got, want in zip(grads, grads_medium):
        assert np.array_equal(got, want)
    want = pc.backends.get("numpy").conv2d_forward(x.astype(np.float64), w.astype(np.float64), None, 1, 1)
    for got in (y, y_medium):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("shape", STAGES)
def test_high_runs_f4_in_forwards_under_no_grad(shape):
    """An inference forward has no gradient for BatchNorm to spread a flipped ReLU into: under
    ``no_grad``, "high" takes F(4x4, 3x3) as "medium" does, and leaves it again afterwards."""
    N, C, O, H, W = shape
    x, w, _ = _case(5, *shape)
    with num_threads(2):
        y_grad = omp.conv2d_forward(x, w, None, 1, 1).copy()
        with pc.no_grad():
            y_infer = omp.conv2d_forward(x, w, None, 1, 1).copy()
        with pc.conv_precision("medium"):
            y_medium = omp.conv2d_forward(x, w, None, 1, 1).copy()
        with pc.no_grad(), pc.conv_precision("highest"):
            y_highest = omp.conv2d_forward(x, w, None, 1, 1).copy()
        y_after = omp.conv2d_forward(x, w, None, 1, 1)
    assert np.array_equal(y_infer, y_medium)
    assert not np.array_equal(y_infer, y_grad)
    assert np.array_equal(y_after, y_grad)
    _direct_y, _ = _direct(x, w, np.zeros((N, O, H, W), np.float32))
    assert np.array_equal(y_highest, _direct_y)


def test_setting_reaches_the_folded_batch_norm_forward():
    N, C, O, H, W = STAGES[1]
    x, w, _ = _case(3, N, C, O, H, W)
    rng = np.random.default_rng(4)
    bn = [rng.uniform(0.5, 1.5, O).astype(np.float32), rng.standard_normal(O).astype(np.float32),
          rng.standard_normal(O).astype(np.float32) * 0.1, rng.uniform(0.5, 1.5, O).astype(np.float32)]
    out = {}
    for p in ("highest", "high", "medium"):
        with pc.conv_precision(p):
            out[p] = omp.conv2d_batch_norm_eval_forward(x, w, None, *bn, 1e-5, 1, 1, True)
    omp.winograd = False
    try:
        direct = omp.conv2d_batch_norm_eval_forward(x, w, None, *bn, 1e-5, 1, 1, True)
    finally:
        del omp.winograd
    assert np.array_equal(out["highest"], direct)
    assert not np.array_equal(out["high"], out["medium"])


# ------------------------------------------------------------------- a network's gradients
#: seeds whose training step, with F(4x4, 3x3) in the forward, flips a ReLU that float64 does not
#: and so misses float64's gradients by 3e-3 to 1e-1 (where PyTorch float32 is at 3e-6)
FLIP_SEEDS = (5, 6, 7)


@pytest.mark.slow
def test_resnet20_gradients_as_accurate_as_pytorch_float32_under_the_default():
    """The default conv precision keeps resnet20's training gradients (batch 4) within 10x of
    PyTorch float32's error against float64 (floor 1e-4), seed by seed; with the same bits at a
    fixed thread count."""
    shape = pc.models.ZOO["resnet20"][1]
    with num_threads(2):
        for seed in FLIP_SEEDS:
            model = precision.build("resnet20", seed)
            state = model.state_dict()
            x, y = precision.data(4, seed, shape)
            got = precision.parconv_grads(model, state, x, y, "openmp")
            again = precision.parconv_grads(model, state, x, y, "openmp")
            assert all(np.array_equal(got[k], again[k]) for k in got)
            ref64 = precision.numpy64_grads(model, state, x, y)
            err, where = precision.worst_error(got, ref64)
            assert err < 1e-3, f"seed {seed}: {where} off float64 (NumPy) by {err:.1e}"
            if HAVE_TORCH:
                ref = precision.torch_grads(model, state, x, y, "float64")
                err, where = precision.worst_error(got, ref)
                err32 = precision.worst_error(precision.torch_grads(model, state, x, y, "float32"), ref)[0]
                assert err <= 10 * max(err32, 1e-4), \
                    f"seed {seed}: {where} off float64 by {err:.1e}, PyTorch float32 by {err32:.1e}"
            highest = precision.parconv_grads(model, state, x, y, "openmp", "highest")
            assert precision.worst_error(highest, ref64)[0] < 1e-3
