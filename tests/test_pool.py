"""maxpool2d on every backend against the oracle and PyTorch; oracle against finite differences."""

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import assert_close, needs_torch, numeric_grad, rand


@st.composite
def pool_case(draw):
    n, c = draw(st.integers(1, 8)), draw(st.integers(1, 16))
    h, w = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    k, s = draw(st.integers(1, 7)), draw(st.integers(1, 3))
    assume(k <= h and k <= w)
    return n, c, h, w, k, s, draw(st.integers(0, 2**31 - 1))


@given(pool_case())
def test_maxpool2d_matches_oracle(backend, oracle, case):
    n, c, h, w, k, s, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, n, c, h, w)
    y_ref, am_ref = oracle.maxpool2d_forward(x, k, s)
    y, am = backend.maxpool2d_forward(backend.asarray(x), k, s)
    assert_close(y, y_ref, what="maxpool y")
    np.testing.assert_array_equal(np.asarray(backend.to_numpy(am)), am_ref)
    dy = rand(rng, *y_ref.shape)
    dx_ref = oracle.maxpool2d_backward(dy, am_ref, x.shape)
    dx = backend.maxpool2d_backward(backend.asarray(dy), am, x.shape)
    assert_close(dx, dx_ref, what="maxpool dx")


def test_maxpool2d_ties_pick_the_first(backend):
    x = np.zeros((1, 1, 2, 2), np.float32)
    y, am = backend.maxpool2d_forward(backend.asarray(x), 2, 2)
    assert int(np.asarray(backend.to_numpy(am)).ravel()[0]) == 0


@given(pool_case())
def test_maxpool2d_oracle_gradient_matches_finite_differences(oracle, case):
    n, c, h, w, k, s, seed = case
    rng = np.random.default_rng(seed)
    x = rng.permutation(n * c * h * w).reshape(n, c, h, w).astype(np.float64)  # distinct values: no ties
    y, am = oracle.maxpool2d_forward(x, k, s)
    r = rng.standard_normal(y.shape)
    dx = oracle.maxpool2d_backward(r, am, x.shape)
    idx, num = numeric_grad(lambda: float((oracle.maxpool2d_forward(x, k, s)[0] * r).sum()), x, eps=1e-3)
    np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-6, atol=1e-6)  # f is ~1e3, eps 1e-3


@needs_torch
@given(pool_case())
def test_maxpool2d_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    n, c, h, w, k, s, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, n, c, h, w)
    xt = torch.tensor(x, requires_grad=True)
    yt = tF.max_pool2d(xt, k, s)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    y, am = backend.maxpool2d_forward(backend.asarray(x), k, s)
    assert_close(y, yt.detach().numpy(), what="maxpool vs torch")
    assert_close(backend.maxpool2d_backward(backend.asarray(dy), am, x.shape), xt.grad.numpy(), what="dx vs torch")
