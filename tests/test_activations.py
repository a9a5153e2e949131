"""relu and sigmoid on every backend against the oracle, finite differences and PyTorch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_close, needs_torch, numeric_grad, rand

shapes = st.lists(st.integers(1, 20), min_size=1, max_size=4).map(tuple)
OPS = ["relu", "sigmoid"]


@pytest.mark.parametrize("op", OPS)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 10.0, 100.0]))
def test_activation_matches_oracle(backend, oracle, op, shape, seed, scale):
    rng = np.random.default_rng(seed)
    x = rand(rng, *shape, scale=scale)
    fwd, bwd = f"{op}_forward", f"{op}_backward"
    y_ref = getattr(oracle, fwd)(x)
    y = getattr(backend, fwd)(backend.asarray(x))
    assert_close(y, y_ref, what=f"{op} y")
    assert np.isfinite(np.asarray(backend.to_numpy(y))).all()
    dy = rand(rng, *shape)
    assert_close(getattr(backend, bwd)(y, backend.asarray(dy)), getattr(oracle, bwd)(y_ref, dy), what=f"{op} dx")


def test_sigmoid_has_no_overflow(backend):
    x = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], np.float32)
    y = np.asarray(backend.to_numpy(backend.sigmoid_forward(backend.asarray(x))))
    np.testing.assert_allclose(y, [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-30)


@pytest.mark.parametrize("op", OPS)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_activation_oracle_gradient_matches_finite_differences(oracle, op, shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x[np.abs(x) < 1e-3] = 0.5  # keep relu away from its kink
    r = rng.standard_normal(shape)
    fwd = getattr(oracle, f"{op}_forward")
    dx = getattr(oracle, f"{op}_backward")(fwd(x), r)
    idx, num = numeric_grad(lambda: float((fwd(x) * r).sum()), x)
    # the difference of two sums over every element loses about eps64 * sum|terms| / step to rounding
    rounding = 4 * np.finfo(np.float64).eps * float(np.abs(fwd(x) * r).sum()) / 1e-6
    np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-5, atol=1e-8 + rounding)


@needs_torch
@pytest.mark.parametrize("op", OPS)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_activation_matches_torch(backend, op, shape, seed):
    import torch

    rng = np.random.default_rng(seed)
    x = rand(rng, *shape, scale=5.0)
    xt = torch.tensor(x, requires_grad=True)
    yt = getattr(torch, op)(xt)
    dy = rand(rng, *shape)
    yt.backward(torch.tensor(dy))
    y = getattr(backend, f"{op}_forward")(backend.asarray(x))
    assert_close(y, yt.detach().numpy())
    assert_close(getattr(backend, f"{op}_backward")(y, backend.asarray(dy)), xt.grad.numpy())
