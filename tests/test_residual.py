"""Residual blocks: ``Residual -> ReLU`` fused (the body's last BatchNorm adds the shortcut and
applies the ReLU) against the unfused layers on every backend, in both modes, with identity and
projection shortcuts; and against the NumPy oracle."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from parconv._fusion import ResidualReLU
from conftest import assert_close, host, rand


def _block(c, o, stride, tail_bn, seed, backend, fuse):
    pc.manual_seed(seed)
    body = [pc.Conv2d(c, o, 3, stride=stride, padding=1, bias=not tail_bn), pc.BatchNorm2d(o), pc.ReLU(),
            pc.Conv2d(o, o, 3, padding=1, bias=not tail_bn)]
    if tail_bn:
        body.append(pc.BatchNorm2d(o))
    shortcut = None
    if stride != 1 or c != o:
        shortcut = pc.Sequential(pc.Conv2d(c, o, 1, stride=stride, bias=False), pc.BatchNorm2d(o))
    model = pc.Sequential(pc.Residual(pc.Sequential(*body), shortcut), pc.ReLU(), pc.Flatten(), backend=backend,
                          fuse=fuse)
    rng = np.random.default_rng(seed)
    for m in model.modules():
        if isinstance(m, pc.BatchNorm2d):
            m.running_mean = backend.asarray(rand(rng, m.num_features))
            m.running_var = backend.asarray(rng.uniform(0.5, 2.0, m.num_features).astype(np.float32))
            m.weight.data = backend.asarray(rng.uniform(0.5, 1.5, m.num_features).astype(np.float32))
            m.bias.data = backend.asarray(rand(rng, m.num_features))
    for m in model.modules():
        if isinstance(m, pc.Sequential):
            m.fuse = fuse
    return model


def _run(model, x, dy, training):
    model.train(training)
    y = model.forward(x)
    dx = model.backward(dy, need_dx=True)
    return (host(y), host(dx), {k: host(p.grad) for k, p in model.named_parameters()},
            {k: host(b) for k, b in model.named_buffers()})


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 3), c=st.integers(1, 4), o=st.integers(1, 5),
       size=st.integers(2, 7), stride=st.sampled_from([1, 2]), tail_bn=st.booleans(), training=st.booleans())
def test_fused_residual_relu_matches_the_layers(backend, oracle, seed, n, c, o, size, stride, tail_bn, training):
    rng = np.random.default_rng(seed)
    x = rand(rng, n, c, size, size)
    fused = _block(c, o, stride, tail_bn, seed % 1000, backend, True)
    plain = _block(c, o, stride, tail_bn, seed % 1000, backend, False)
    ref = _block(c, o, stride, tail_bn, seed % 1000, oracle, False)
    p = (size - 1) // stride + 1
    dy = rand(rng, n, o * p * p)
    got, want, oracle_out = _run(fused, x, dy, training), _run(plain, x, dy, training), _run(ref, x, dy, training)
    assert isinstance(fused.plan()[0].step, ResidualReLU)
    block = fused[0]
    # the BatchNorm ends the body in training mode; in eval mode it is folded into its conv
    assert (block._cache[2] is not None) == (tail_bn and training)
    # With two or three values per channel the body's BatchNorm output hardly depends on its input:
    # the gradients through it are rounding noise times 1 / sqrt(var + eps), up to 316, and agree
    # with the float64 oracle in no digit; the unfused layers still have to give the same bits
    comparisons = ((want, 1e-6), (oracle_out, 1e-4)) if n * p * p >= 4 else ((want, 1e-6),)
    for other, tol in comparisons:
        assert_close(got[0], other[0], rtol=tol, what="y")
        assert_close(got[1], other[1], rtol=tol, atol=1e-5 * (float(np.abs(other[1]).max()) + 1.0), what="dx")
        for k in other[2]:
            assert_close(got[2][k], other[2][k], rtol=tol, atol=1e-5 * (float(np.abs(other[2][k]).max()) + 1.0),
                         what=f"grad {k}")
        for k in other[3]:
            assert_close(got[3][k], other[3][k], rtol=tol, what=f"buffer {k}")


def test_fused_residual_is_bit_identical_on_openmp():
    """Same operations in the same order as the unfused layers, so the same bits."""
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp backend unavailable")
    be = pc.backends.get("openmp")
    rng = np.random.default_rng(0)
    x, dy = rand(rng, 8, 4, 9, 9), rand(rng, 8, 8 * 5 * 5)
    got = _run(_block(4, 8, 2, True, 3, be, True), x, dy, True)
    want = _run(_block(4, 8, 2, True, 3, be, False), x, dy, True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    for k in want[2]:
        np.testing.assert_array_equal(got[2][k], want[2][k], err_msg=k)


def test_residual_shape_mismatch_is_reported_on_the_fused_path(backend):
    block = pc.Sequential(pc.Residual(pc.Sequential(pc.Conv2d(3, 4, 3, padding=1), pc.BatchNorm2d(4))), pc.ReLU(),
                          backend=backend)
    with pytest.raises(ValueError, match="projection shortcut"):
        block(np.zeros((2, 3, 5, 5), np.float32))


def test_batch_norm_residual_argument(backend):
    rng = np.random.default_rng(1)
    x, r = rand(rng, 4, 3, 5), rand(rng, 4, 3, 5)
    rm, rv = backend.asarray(np.zeros(3, np.float32)), backend.asarray(np.ones(3, np.float32))
    y, saved = F.batch_norm(x, None, None, rm, rv, training=True, relu=True, residual=r, backend=backend)
    z, _ = F.batch_norm(x, None, None, None, None, training=True, backend=backend)
    assert_close(y, np.maximum(host(z) + r, 0), what="relu(bn(x) + r)")
    with pytest.raises(ValueError, match=r"residual must have x's shape \(4, 3, 5\)"):
        F.batch_norm(x, None, None, rm, rv, training=True, residual=r[:2], backend=backend)


def test_grad_hooks_see_the_tail_batch_norm():
    """Data-parallel training reduces each layer's gradients as soon as a hook reports them."""
    be = pc.backends.get("numpy")
    model = _block(2, 3, 1, True, 0, be, True)
    body = model[0].body
    seen = []
    body.register_grad_hook(lambda i, params: seen.append(i))
    _run(model, rand(np.random.default_rng(0), 2, 2, 4, 4), rand(np.random.default_rng(1), 2, 48), True)
    assert seen[0] == 4 and sorted(seen) == [0, 1, 3, 4]
