"""MSE and softmax cross-entropy with label smoothing on every backend against the oracle,
finite differences and PyTorch; the MSELoss and SoftmaxCrossEntropy(label_smoothing) classes."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, host, needs_torch, numeric_grad, rand

shapes = st.lists(st.integers(1, 12), min_size=1, max_size=4).map(tuple)
smoothing = st.sampled_from([0.05, 0.1, 0.5, 1.0])


def _logits(rng, n, g, scale=3.0):
    return rand(rng, n, g, scale=scale), rng.integers(0, g, n)


# ------------------------------------------------------------------------- MSE
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_mse_matches_oracle(backend, oracle, shape, seed):
    rng = np.random.default_rng(seed)
    p, t = rand(rng, *shape), rand(rng, *shape)
    assert F.mse_loss(p, t, backend=backend) == pytest.approx(oracle.mse_forward(p, t), rel=1e-5)
    assert_close(F.mse_loss_backward(p, t, backend=backend), oracle.mse_backward(p, t), what="dpred")


@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_mse_oracle_gradient_matches_finite_differences(oracle, shape, seed):
    rng = np.random.default_rng(seed)
    p, t = rng.standard_normal(shape), rng.standard_normal(shape)
    idx, num = numeric_grad(lambda: oracle.mse_forward(p, t), p)
    np.testing.assert_allclose(oracle.mse_backward(p, t).reshape(-1)[idx], num, rtol=1e-5, atol=1e-8)


@needs_torch
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_mse_matches_torch(backend, shape, seed):
    import torch
    import torch.nn.functional as TF

    rng = np.random.default_rng(seed)
    p, t = rand(rng, *shape), rand(rng, *shape)
    pt = torch.tensor(p, requires_grad=True)
    loss = TF.mse_loss(pt, torch.tensor(t))
    loss.backward()
    assert F.mse_loss(p, t, backend=backend) == pytest.approx(loss.item(), rel=1e-5)
    assert_close(F.mse_loss_backward(p, t, backend=backend), pt.grad.numpy())


def test_mse_loss_class(backend):
    rng = np.random.default_rng(0)
    p, t = rand(rng, 4, 3), rand(rng, 4, 3)
    loss_fn = pc.MSELoss()
    loss = loss_fn.forward(backend.asarray(p), backend.asarray(t), backend=backend)
    assert loss == pytest.approx(float(((p - t) ** 2).mean()), rel=1e-5)
    assert_close(loss_fn.backward(), 2 * (p - t) / p.size)
    with pytest.raises(ValueError, match="target shape"):
        loss_fn(backend.asarray(p), np.ones((3, 4)))
    with pytest.raises(ValueError, match="backward called before"):
        pc.MSELoss().backward()
    with pytest.raises(ValueError, match="target shape"):
        F.mse_loss(p, np.ones(3), backend=backend)
    with pytest.raises(ValueError, match="zero-sized"):
        F.mse_loss(np.ones((0, 2)), np.ones((0, 2)), backend=backend)


# ---------------------------------------------------------- label smoothing
@given(n=st.integers(1, 20), g=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), s=smoothing)
def test_label_smoothing_matches_oracle(backend, oracle, n, g, seed, s):
    rng = np.random.default_rng(seed)
    x, y = _logits(rng, n, g)
    loss_ref, probs_ref = oracle.softmax_cross_entropy_smoothed_forward(x, y, s)
    loss, probs = F.softmax_cross_entropy(x, y, label_smoothing=s, backend=backend)
    assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-6)
    assert_close(probs, probs_ref)
    assert_close(F.softmax_cross_entropy_backward(probs_ref, y, label_smoothing=s, backend=backend),
                 oracle.softmax_cross_entropy_smoothed_backward(probs_ref, y, s), what="dlogits")


@given(n=st.integers(1, 8), g=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), s=smoothing)
def test_label_smoothing_oracle_gradient_matches_finite_differences(oracle, n, g, seed, s):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n, g)), rng.integers(0, g, n)
    _, probs = oracle.softmax_cross_entropy_smoothed_forward(x, y, s)
    d = oracle.softmax_cross_entropy_smoothed_backward(probs, y, s)
    idx, num = numeric_grad(lambda: oracle.softmax_cross_entropy_smoothed_forward(x, y, s)[0], x)
    # the oracle's smoothed targets are rounded to float32
    np.testing.assert_allclose(d.reshape(-1)[idx], num, rtol=1e-5, atol=1e-7)


@needs_torch
@given(n=st.integers(1, 20), g=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), s=smoothing)
def test_label_smoothing_matches_torch(backend, n, g, seed, s):
    import torch
    import torch.nn.functional as TF

    rng = np.random.default_rng(seed)
    x, y = _logits(rng, n, g)
    xt = torch.tensor(x, requires_grad=True)
    loss_t = TF.cross_entropy(xt, torch.tensor(y), label_smoothing=s)
    loss_t.backward()
    loss_fn = pc.SoftmaxCrossEntropy(label_smoothing=s)
    loss = loss_fn.forward(backend.asarray(x), y, backend=backend)
    assert loss == pytest.approx(loss_t.item(), rel=1e-5, abs=1e-6)
    assert_close(loss_fn.backward(), xt.grad.numpy())


@given(n=st.integers(1, 20), g=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_zero_label_smoothing_keeps_the_unsmoothed_bits(backend, n, g, seed):
    rng = np.random.default_rng(seed)
    x, y = _logits(rng, n, g)
    xb, yb = backend.asarray(x), backend.asarray(y, np.int32)
    loss0, probs0 = backend.softmax_cross_entropy_forward(xb, yb)
    d0 = host(backend.softmax_cross_entropy_backward(probs0, yb))
    loss, probs = F.softmax_cross_entropy(xb, y, label_smoothing=0.0, backend=backend)
    assert loss == loss0
    np.testing.assert_array_equal(host(probs), host(probs0))
    np.testing.assert_array_equal(host(F.softmax_cross_entropy_backward(probs, y, backend=backend)), d0)
    loss_fn = pc.SoftmaxCrossEntropy()
    assert loss_fn.forward(xb, y, backend=backend) == loss0
    np.testing.assert_array_equal(host(loss_fn.backward()), d0)


def test_label_smoothing_arguments(backend):
    x = np.zeros((2, 4), np.float32)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="label_smoothing"):
            pc.SoftmaxCrossEntropy(label_smoothing=bad)
        with pytest.raises(ValueError, match="label_smoothing"):
            F.softmax_cross_entropy(x, [0, 1], label_smoothing=bad, backend=backend)
    with pytest.raises(TypeError, match="label_smoothing must be a real number"):
        pc.SoftmaxCrossEntropy(label_smoothing="0.1")
    loss_fn = pc.SoftmaxCrossEntropy(label_smoothing=0.1)
    assert loss_fn.config() == {"label_smoothing": 0.1}
    assert pc.SoftmaxCrossEntropy().config() == {}
    assert "label_smoothing=0.1" in repr(loss_fn)
    # uniform logits: every class has log-probability -log(4), whatever the smoothing
    assert loss_fn(x, [0, 3]) == pytest.approx(np.log(4), rel=1e-6)
