"""linear on every backend against the oracle and PyTorch; oracle against finite differences."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_close, needs_torch, numeric_grad, rand

dense_case = st.tuples(st.integers(1, 64), st.integers(1, 300), st.integers(1, 40), st.booleans(),
                       st.integers(0, 2**31 - 1))


@given(dense_case)
def test_linear_matches_oracle(backend, oracle, case):
    n, f, g, bias, seed = case
    rng = np.random.default_rng(seed)
    x, w = rand(rng, n, f), rand(rng, g, f, scale=1.0 / np.sqrt(f))
    b = rand(rng, g) if bias else None
    f64 = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731 - oracle in float64
    y_ref = oracle.linear_forward(f64(x), f64(w), f64(b))
    X, Wd = backend.asarray(x), backend.asarray(w)
    y = backend.linear_forward(X, Wd, backend.asarray(b) if bias else None)
    assert_close(y, y_ref, atol=1e-4, what="linear y")
    dy = rand(rng, n, g)
    dx_ref, dw_ref, db_ref = oracle.linear_backward(f64(x), f64(w), f64(dy), True, bias)
    dx, dw, db = backend.linear_backward(X, Wd, backend.asarray(dy), True, bias)
    assert_close(dx, dx_ref, atol=1e-4, what="linear dx")
    assert_close(dw, dw_ref, atol=1e-4, what="linear dw")
    if bias:
        assert_close(db, db_ref, atol=1e-4, what="linear db")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,f,g", [(1, 1500, 700), (3, 1500, 1), (1, 1, 900), (1, 2047, 1), (2, 1, 3)])
def test_linear_vector_shapes_match_oracle(backend, oracle, n, f, g, threads):
    """Batch 1 (matrix-vector products), one output and one input feature: the openmp
    backend's sgemv and outer-product paths, large enough to split over threads."""
    import parconv as pc

    rng = np.random.default_rng(n * 7 + f + g)
    x, w, b, dy = rand(rng, n, f), rand(rng, g, f, scale=1.0 / np.sqrt(f)), rand(rng, g), rand(rng, n, g)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731 - oracle in float64
    with pc.num_threads(threads):
        y = backend.linear_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b))
        dx, dw, db = backend.linear_backward(backend.asarray(x), backend.asarray(w), backend.asarray(dy))
    assert_close(y, oracle.linear_forward(f64(x), f64(w), f64(b)), atol=1e-4, what="linear y")
    for got, want, what in zip((dx, dw, db), oracle.linear_backward(f64(x), f64(w), f64(dy), True, True),
                               ("dx", "dw", "db")):
        assert_close(got, want, atol=1e-4, what=f"linear {what}")


@given(st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1)))
def test_linear_oracle_gradients_match_finite_differences(oracle, case):
    n, f, g, seed = case
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((n, f)), rng.standard_normal((g, f)), rng.standard_normal(g)
    r = rng.standard_normal((n, g))
    dx, dw, db = oracle.linear_backward(x, w, r, True, True)

    def loss():
        return float((oracle.linear_forward(x, w, b) * r).sum())

    for arr, grad in ((x, dx), (w, dw), (b, db)):
        idx, num = numeric_grad(loss, arr)
        np.testing.assert_allclose(grad.reshape(-1)[idx], num, rtol=1e-6, atol=1e-8)


@needs_torch
@given(dense_case)
def test_linear_matches_torch(backend, case):
    import torch

    n, f, g, bias, seed = case
    rng = np.random.default_rng(seed)
    x, w = rand(rng, n, f), rand(rng, g, f, scale=1.0 / np.sqrt(f))
    b = rand(rng, g) if bias else None
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if bias else None
    yt = torch.nn.functional.linear(xt, wt, bt)
    dy = rand(rng, n, g)
    yt.backward(torch.tensor(dy))
    X, Wd = backend.asarray(x), backend.asarray(w)
    assert_close(backend.linear_forward(X, Wd, backend.asarray(b) if bias else None), yt.detach().numpy(), atol=1e-4)
    dx, dw, db = backend.linear_backward(X, Wd, backend.asarray(dy), True, bias)
    assert_close(dx, xt.grad.numpy(), atol=1e-4)
    assert_close(dw, wt.grad.numpy(), atol=1e-4)
    if bias:
        assert_close(db, bt.grad.numpy(), atol=1e-4)
