"""conv2d: every backend against the NumPy oracle, the oracle against finite differences and PyTorch."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import assert_close, host, needs_torch, numeric_grad, rand


@st.composite
def conv_case(draw, max_n=8, max_c=16, max_hw=20):
    n = draw(st.integers(1, max_n))
    c = draw(st.integers(1, max_c))
    o = draw(st.integers(1, 16))
    h = draw(st.integers(1, max_hw))
    w = draw(st.integers(1, max_hw))
    k = draw(st.integers(1, 7))
    stride = draw(st.integers(1, 3))
    pad = draw(st.integers(0, 3))
    assume(k <= h + 2 * pad and k <= w + 2 * pad)
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return n, c, o, h, w, k, stride, pad, bias, seed


def _arrays(case, dtype=np.float32):
    n, c, o, h, w, k, stride, pad, bias, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, n, c, h, w).astype(dtype)
    wt = rand(rng, o, c, k, k, scale=1.0 / np.sqrt(c * k * k)).astype(dtype)  # PyTorch-like init scale
    b = rand(rng, o).astype(dtype) if bias else None
    return rng, x, wt, b


@given(conv_case())
def test_conv2d_forward_backward_match_oracle(backend, oracle, case):
    n, c, o, h, w, k, stride, pad, bias, seed = case
    rng, x, wt, b = _arrays(case)
    # the oracle runs in float64 so the comparison measures the backend's float32 error only
    x64, w64, b64 = x.astype(np.float64), wt.astype(np.float64), None if b is None else b.astype(np.float64)
    y_ref = oracle.conv2d_forward(x64, w64, b64, stride, pad)
    X, Wd = backend.asarray(x), backend.asarray(wt)
    B = backend.asarray(b) if bias else None
    y = backend.conv2d_forward(X, Wd, B, stride, pad)
    assert_close(y, y_ref, what="conv2d y")
    dy = rand(rng, *y_ref.shape)
    dx_ref, dw_ref, db_ref = oracle.conv2d_backward(x64, w64, dy.astype(np.float64), stride, pad, True, bias)
    dx, dw, db = backend.conv2d_backward(X, Wd, backend.asarray(dy), stride, pad, True, bias)
    assert_close(dx, dx_ref, what="conv2d dx")
    assert_close(dw, dw_ref, atol=1e-4, what="conv2d dw")  # sums up to N*P*Q = 3200 terms of O(1)
    if bias:
        assert_close(db, db_ref, atol=1e-4, what="conv2d db")
    else:
        assert db is None
    # need_dx=False still gives the same dw
    dx2, dw2, _ = backend.conv2d_backward(X, Wd, backend.asarray(dy), stride, pad, False, bias)
    assert dx2 is None
    assert_close(dw2, dw_ref, atol=1e-4, what="conv2d dw (no dx)")


@given(conv_case(max_n=2, max_c=3, max_hw=7))
def test_conv2d_oracle_gradients_match_finite_differences(oracle, case):
    n, c, o, h, w, k, stride, pad, bias, seed = case
    rng, x, wt, b = _arrays(case, np.float64)
    r = rng.standard_normal(oracle.conv2d_forward(x, wt, b, stride, pad).shape)

    def loss():
        return float((oracle.conv2d_forward(x, wt, b, stride, pad) * r).sum())

    dx, dw, db = oracle.conv2d_backward(x, wt, r, stride, pad, True, bias)
    for arr, grad in [(x, dx), (wt, dw)] + ([(b, db)] if bias else []):
        idx, num = numeric_grad(loss, arr)
        np.testing.assert_allclose(grad.reshape(-1)[idx], num, rtol=1e-5, atol=1e-7)


@needs_torch
@given(conv_case())
def test_conv2d_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    n, c, o, h, w, k, stride, pad, bias, seed = case
    rng, x, wt, b = _arrays(case)
    xt = torch.tensor(x, requires_grad=True)
    wtt = torch.tensor(wt, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if bias else None
    yt = tF.conv2d(xt, wtt, bt, stride=stride, padding=pad)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    X, Wd = backend.asarray(x), backend.asarray(wt)
    y = backend.conv2d_forward(X, Wd, backend.asarray(b) if bias else None, stride, pad)
    assert_close(y, yt.detach().numpy(), what="conv2d y vs torch")
    dx, dw, db = backend.conv2d_backward(X, Wd, backend.asarray(dy), stride, pad, True, bias)
    assert_close(dx, xt.grad.numpy(), what="dx vs torch")
    assert_close(dw, wtt.grad.numpy(), atol=1e-4, what="dw vs torch")
    if bias:
        assert_close(db, bt.grad.numpy(), atol=1e-4, what="db vs torch")


@st.composite
def fused_case(draw):
    n = draw(st.integers(1, 4))
    c = draw(st.integers(1, 6))
    o = draw(st.integers(1, 12))
    h = draw(st.integers(2, 16))
    w = draw(st.integers(2, 16))
    k = draw(st.integers(1, 5))
    stride = draw(st.integers(1, 2))
    pad = draw(st.integers(0, 2))
    pk = draw(st.integers(1, 3))
    ps = draw(st.integers(1, 3))
    assume(k <= h + 2 * pad and k <= w + 2 * pad)
    p_ = (h + 2 * pad - k) // stride + 1
    q_ = (w + 2 * pad - k) // stride + 1
    assume(pk <= p_ and pk <= q_)
    return n, c, o, h, w, k, stride, pad, pk, ps, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@given(fused_case())
def test_fused_conv_relu_maxpool_equals_unfused(backend, oracle, case):
    n, c, o, h, w, k, stride, pad, pk, ps, bias, seed = case
    rng = np.random.default_rng(seed)
    x, wt = rand(rng, n, c, h, w), rand(rng, o, c, k, k, scale=1.0 / np.sqrt(c * k * k))
    b = rand(rng, o) if bias else None
    z = oracle.conv2d_forward(x, wt, b, stride, pad)
    yp, am = oracle.maxpool2d_forward(oracle.relu_forward(z), pk, ps)
    X, Wd = backend.asarray(x), backend.asarray(wt)
    y, argmax = backend.conv2d_relu_maxpool2d_forward(X, Wd, backend.asarray(b) if bias else None,
                                                      stride, pad, pk, ps)
    assert_close(y, yp, what="fused y")
    # a window whose two largest values tie within float32 rounding may pick either: the
    # backend's pick must hold the window's maximum, and the gradient follows that pick
    got_am = np.asarray(backend.to_numpy(argmax)).astype(np.int64)
    zf = z.reshape(z.shape[0], z.shape[1], -1)
    picked = np.take_along_axis(zf, got_am.reshape(*got_am.shape[:2], -1), axis=2)
    picked_ref = np.take_along_axis(zf, np.asarray(am).reshape(*am.shape[:2], -1), axis=2)
    np.testing.assert_allclose(np.maximum(picked, 0), np.maximum(picked_ref, 0), rtol=1e-5, atol=1e-6)
    dy = rand(rng, *yp.shape)
    # ReLU's mask from the backend's own y: a convolution output within rounding of 0 may land on
    # either side of the kink in float32, and the gradient follows the backend's side
    dz = oracle.maxpool2d_backward(oracle.relu_backward(host(y), dy), got_am, z.shape)
    dx_ref, dw_ref, db_ref = oracle.conv2d_backward(x, wt, dz, stride, pad, True, bias)
    dx, dw, db = backend.conv2d_relu_maxpool2d_backward(X, Wd, y, argmax, backend.asarray(dy), stride, pad, True, bias)
    assert_close(dx, dx_ref, what="fused dx")
    assert_close(dw, dw_ref, atol=1e-4, what="fused dw")
    if bias:
        assert_close(db, db_ref, atol=1e-4, what="fused db")


def _head_case_check(backend, oracle, x, wt, b, stride, pad, pk, ps, G, head_bias, rng, need_dx):
    """The ``conv2d_relu_maxpool2d_linear_*`` pair against the oracle's composition."""
    y_ref, _ = oracle.conv2d_relu_maxpool2d_forward(x, wt, b, stride, pad, pk, ps)
    n, F = y_ref.shape[0], y_ref[0].size
    wl = rand(rng, G, F, scale=1.0 / np.sqrt(F))
    bl = rand(rng, G) if head_bias else None
    X, Wd, WL = backend.asarray(x), backend.asarray(wt), backend.asarray(wl)
    y, argmax, logits = backend.conv2d_relu_maxpool2d_linear_forward(
        X, Wd, None if b is None else backend.asarray(b), stride, pad, pk, ps, WL,
        None if bl is None else backend.asarray(bl))
    assert_close(y, y_ref, what="head y")
    yh = host(y).reshape(n, F).astype(np.float64)
    want_logits = yh @ wl.T.astype(np.float64) + (0 if bl is None else bl)
    assert_close(logits, want_logits.astype(np.float32), what="head logits")
    dl = rand(rng, n, G)
    dy = (dl.astype(np.float64) @ wl.astype(np.float64)).astype(np.float32).reshape(y_ref.shape)
    want = oracle.conv2d_relu_maxpool2d_backward(x, wt, host(y), host(argmax), dy, stride, pad, need_dx, b is not None)
    _, dwl, dbl = oracle.linear_backward(host(y).reshape(n, F), wl, dl, False, head_bias)
    got = backend.conv2d_relu_maxpool2d_linear_backward(X, Wd, y, argmax, WL, backend.asarray(dl), stride, pad,
                                                        need_dx, b is not None, head_bias)
    assert len(got) == 5
    for g, e, what in zip(got, want + (dwl, dbl), ("head dx", "head dw", "head db", "head's dw", "head's db")):
        if e is None:
            assert g is None, what
        else:
            assert_close(g, e, atol=1e-4, what=what)


@given(fused_case(), st.integers(1, 12), st.booleans(), st.booleans())
def test_fused_linear_head_pair_equals_composition(backend, oracle, case, G, head_bias, need_dx):
    """conv+ReLU+maxpool -> flatten -> linear as one op: the pooled output, the head's logits, and
    the convolution's gradients from the head's output gradient."""
    n, c, o, h, w, k, stride, pad, pk, ps, bias, seed = case
    rng = np.random.default_rng(seed)
    x, wt = rand(rng, n, c, h, w), rand(rng, o, c, k, k, scale=1.0 / np.sqrt(c * k * k))
    _head_case_check(backend, oracle, x, wt, rand(rng, o) if bias else None, stride, pad, pk, ps, G,
                     head_bias, rng, need_dx)


@pytest.mark.parametrize("n, G", [(1, 10), (5, 10), (4, 16), (3, 1)])
def test_fused_linear_head_pair_on_a_wide_head(backend, oracle, n, G):
    """A first layer whose head is wide enough for the OpenMP backend to fuse it (16 filters
    pooled to 13 x 13: 2704 features), odd and even batches."""
    rng = np.random.default_rng(100 + n * G)
    x, wt = rand(rng, n, 1, 28, 28), rand(rng, 16, 1, 3, 3, scale=1.0 / 3)
    _head_case_check(backend, oracle, x, wt, rand(rng, 16), 1, 0, 2, 2, G, True, rng, False)
