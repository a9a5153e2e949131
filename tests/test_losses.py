"""Softmax cross-entropy and BCE on every backend against the oracle, finite differences and PyTorch."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from conftest import assert_close, needs_torch, numeric_grad, rand

ce_case = st.tuples(st.integers(1, 64), st.integers(1, 30), st.sampled_from([1.0, 10.0, 1000.0]),
                    st.integers(0, 2**31 - 1))


def _ce_data(case):
    n, g, scale, seed = case
    rng = np.random.default_rng(seed)
    return rand(rng, n, g, scale=scale), rng.integers(0, g, n).astype(np.int32)


@given(ce_case)
def test_softmax_cross_entropy_matches_oracle(backend, oracle, case):
    logits, labels = _ce_data(case)
    loss_ref, probs_ref = oracle.softmax_cross_entropy_forward(logits, labels)
    L = backend.asarray(labels, np.int32)
    loss, probs = backend.softmax_cross_entropy_forward(backend.asarray(logits), L)
    assert isinstance(loss, float) and np.isfinite(loss)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-4, atol=1e-5)
    assert_close(probs, probs_ref, what="softmax")
    assert_close(backend.softmax_cross_entropy_backward(probs, L),
                 oracle.softmax_cross_entropy_backward(probs_ref, labels), what="dlogits")
    assert backend.count_correct(backend.asarray(logits), L) == oracle.count_correct(logits, labels)
    np.testing.assert_array_equal(np.asarray(backend.to_numpy(backend.argmax_rows(backend.asarray(logits)))),
                                  oracle.argmax_rows(logits))


@given(st.integers(1, 40), st.floats(100.0, 200.0), st.integers(0, 2**31 - 1))
def test_softmax_cross_entropy_flushes_denormals(backend, rows, gap, seed):
    """Probabilities below FLT_MIN (a confident row: exp(-gap) with gap > 87.3) come out as
    exact zeros, in the softmax and in its gradient, so no denormal reaches the layers below."""
    rng = np.random.default_rng(seed)
    logits = rng.uniform(-3.0, 3.0, (rows, 10)).astype(np.float32)
    logits[:, 0] += gap  # class 0 wins by exp(-gap): a denormal probability for the others
    labels = rng.integers(0, 10, rows).astype(np.int32)
    L = backend.asarray(labels, np.int32)
    loss, probs = backend.softmax_cross_entropy_forward(backend.asarray(logits), L)
    d = np.asarray(backend.to_numpy(backend.softmax_cross_entropy_backward(probs, L)))
    p = np.asarray(backend.to_numpy(probs))
    tiny = np.finfo(np.float32).tiny
    for what, a in (("probs", p), ("dlogits", d)):
        assert not ((a != 0) & (np.abs(a) < tiny)).any(), f"{what} holds denormal numbers"
    np.testing.assert_array_equal(p[:, 1:], 0.0)
    np.testing.assert_allclose(p[:, 0], 1.0)
    assert np.isfinite(loss)
    wrong = labels != 0  # -log p[label] = gap - ... for those rows
    np.testing.assert_allclose(loss, (logits[wrong, 0] - logits[wrong, labels[wrong]]).sum() / rows, rtol=1e-4,
                               atol=1e-4)


def test_softmax_cross_entropy_keeps_nan(backend):
    logits = np.array([[0.0, np.nan, 1.0], [1.0, 2.0, 3.0]], np.float32)
    L = backend.asarray(np.array([0, 2], np.int32), np.int32)
    _, probs = backend.softmax_cross_entropy_forward(backend.asarray(logits), L)
    d = np.asarray(backend.to_numpy(backend.softmax_cross_entropy_backward(probs, L)))
    assert np.isnan(d[0]).any() and np.isfinite(d[1]).all()


bce_case = st.tuples(st.lists(st.integers(1, 16), min_size=1, max_size=3).map(tuple), st.integers(0, 2**31 - 1))


@given(bce_case)
def test_bce_matches_oracle(backend, oracle, case):
    shape, seed = case
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.0, 1.0, shape).astype(np.float32)
    p.reshape(-1)[0] = 0.0  # exercises the eps clip
    t = (rng.random(shape) > 0.5).astype(np.float32)
    eps = 1e-7
    P, T = backend.asarray(p), backend.asarray(t)
    np.testing.assert_allclose(backend.bce_forward(P, T, eps), oracle.bce_forward(p, t, eps), rtol=1e-4)
    assert_close(backend.bce_backward(P, T, eps), oracle.bce_backward(p, t, eps), rtol=1e-4, atol=1e-5)


@given(st.tuples(st.integers(1, 5), st.integers(2, 6), st.integers(0, 2**31 - 1)))
def test_loss_oracle_gradients_match_finite_differences(oracle, case):
    n, g, seed = case
    rng = np.random.default_rng(seed)
    logits, labels = rng.standard_normal((n, g)), rng.integers(0, g, n)
    _, probs = oracle.softmax_cross_entropy_forward(logits, labels)
    d = oracle.softmax_cross_entropy_backward(probs, labels)
    idx, num = numeric_grad(lambda: oracle.softmax_cross_entropy_forward(logits, labels)[0], logits)
    np.testing.assert_allclose(d.reshape(-1)[idx], num, rtol=1e-5, atol=1e-8)
    p = rng.uniform(0.05, 0.95, (n, g))
    t = (rng.random((n, g)) > 0.5).astype(np.float64)
    dp = oracle.bce_backward(p, t, 1e-7)
    idx, num = numeric_grad(lambda: oracle.bce_forward(p, t, 1e-7), p)
    np.testing.assert_allclose(dp.reshape(-1)[idx], num, rtol=1e-5, atol=1e-8)


@needs_torch
@given(ce_case)
def test_losses_match_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    logits, labels = _ce_data(case)
    lt = torch.tensor(logits, requires_grad=True)
    loss_t = tF.cross_entropy(lt, torch.tensor(labels, dtype=torch.long))
    loss_t.backward()
    L = backend.asarray(labels, np.int32)
    loss, probs = backend.softmax_cross_entropy_forward(backend.asarray(logits), L)
    np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-4, atol=1e-5)
    assert_close(backend.softmax_cross_entropy_backward(probs, L), lt.grad.numpy())
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, logits.shape).astype(np.float32)
    t = (rng.random(logits.shape) > 0.5).astype(np.float32)
    pt = torch.tensor(p, requires_grad=True)
    bt = tF.binary_cross_entropy(pt, torch.tensor(t))
    bt.backward()
    P, T = backend.asarray(p), backend.asarray(t)
    np.testing.assert_allclose(backend.bce_forward(P, T, 1e-7), bt.item(), rtol=1e-4)
    assert_close(backend.bce_backward(P, T, 1e-7), pt.grad.numpy(), rtol=1e-4, atol=1e-6)
