"""maxpool2d with padding and rectangular windows, avgpool2d and adaptive_avgpool2d on every backend.

Every backend against the NumPy oracle, the oracle against float64 finite
differences, and everything against ``torch.nn.functional`` (``max_pool2d``,
``avg_pool2d``, ``adaptive_avg_pool2d``) when PyTorch is installed.
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, needs_torch, numeric_grad, rand

ORACLE = pc.backends.get("numpy")


@st.composite
def pool_general_case(draw, max_n=3, max_c=5, max_hw=14):
    """(x shape, kwargs, seed) of a max or average pooling."""
    n, c = draw(st.integers(1, max_n)), draw(st.integers(1, max_c))
    h, w = draw(st.integers(1, max_hw)), draw(st.integers(1, max_hw))
    kernel = draw(st.one_of(st.integers(1, 5), st.tuples(st.integers(1, 5), st.integers(1, 5))))
    stride = draw(st.one_of(st.none(), st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    padding = draw(st.one_of(st.integers(0, min(kh, kw) // 2),
                             st.tuples(st.integers(0, kh // 2), st.integers(0, kw // 2))))
    kwargs = dict(kernel_size=kernel, stride=stride, padding=padding)
    try:
        F.pool2d_output_shape((n, c, h, w), **kwargs)
    except ValueError:
        assume(False)
    return (n, c, h, w), kwargs, draw(st.integers(0, 2**31 - 1))


@st.composite
def adaptive_case(draw):
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    h, w = draw(st.integers(1, 14)), draw(st.integers(1, 14))
    out = draw(st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 6), st.integers(1, 6))))
    return (n, c, h, w), out, draw(st.integers(0, 2**31 - 1))


def _args(x_shape, kwargs):
    _, kernel, stride, pads, _ = F._pool_args(x_shape, kwargs["kernel_size"], kwargs["stride"],
                                              kwargs["padding"], 1, "test")
    return kernel, stride, pads


def maxpool_reference(x, kernel_size, stride=None, padding=0):
    return ORACLE.maxpool2d_general_forward(x, *_args(x.shape, dict(kernel_size=kernel_size, stride=stride,
                                                                       padding=padding)))


def avgpool_reference(x, kernel_size, stride=None, padding=0, dy=None):
    args = _args(x.shape, dict(kernel_size=kernel_size, stride=stride, padding=padding))
    if dy is not None:
        return ORACLE.avgpool2d_backward(dy, x.shape, *args)
    return ORACLE.avgpool2d_forward(x, *args)


def adaptive_reference(x, output_size, dy=None):
    out = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    if dy is not None:
        return ORACLE.adaptive_avgpool2d_backward(dy, x.shape, out)
    return ORACLE.adaptive_avgpool2d_forward(x, out)


# -------------------------------------------------------------------- maxpool2d
@given(pool_general_case())
def test_maxpool2d_general_matches_oracle(backend, case):
    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    y_ref, am_ref = maxpool_reference(x, **kwargs)
    y, am = F.maxpool2d(x, **kwargs, return_indices=True, backend=backend)
    assert_close(y, y_ref, what="maxpool y")
    np.testing.assert_array_equal(pc.to_numpy(am).astype(np.int64), am_ref)
    dy = rand(rng, *y_ref.shape)
    dx = F.maxpool2d_backward(dy, am, x_shape, backend=backend)
    assert_close(dx, ORACLE.maxpool2d_backward(dy, am_ref, x_shape), what="maxpool dx")


@given(pool_general_case(max_hw=8))
def test_maxpool2d_general_oracle_matches_finite_differences(case):
    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rng.permutation(int(np.prod(x_shape))).reshape(x_shape).astype(np.float64)  # no ties
    y, am = maxpool_reference(x, **kwargs)
    r = rng.standard_normal(y.shape)
    dx = ORACLE.maxpool2d_backward(r, am, x_shape)
    idx, num = numeric_grad(lambda: float((maxpool_reference(x, **kwargs)[0] * r).sum()), x, eps=1e-3)
    np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-6, atol=1e-6)


def test_maxpool2d_padding_is_never_selected(backend):
    x = -np.ones((1, 1, 3, 3), np.float32) * np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)
    y, am = F.maxpool2d(x, 3, stride=1, padding=1, return_indices=True, backend=backend)
    y, am = pc.to_numpy(y), pc.to_numpy(am)
    assert (y < 0).all()  # the zeros a zero padding would give never win
    np.testing.assert_array_equal(am[0, 0], [[0, 0, 1], [0, 0, 1], [3, 3, 4]])


@needs_torch
@given(pool_general_case())
def test_maxpool2d_general_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    xt = torch.tensor(x, requires_grad=True)
    yt = tF.max_pool2d(xt, **kwargs)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    y, am = F.maxpool2d(x, **kwargs, return_indices=True, backend=backend)
    assert_close(y, yt.detach().numpy(), what="maxpool vs torch")
    assert_close(F.maxpool2d_backward(dy, am, x_shape, backend=backend), xt.grad.numpy(), what="dx vs torch")


# -------------------------------------------------------------------- avgpool2d
@given(pool_general_case())
def test_avgpool2d_matches_oracle(backend, case):
    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    y_ref = avgpool_reference(x.astype(np.float64), **kwargs)
    assert_close(F.avgpool2d(x, **kwargs, backend=backend), y_ref, what="avgpool y")
    dy = rand(rng, *y_ref.shape)
    dx = F.avgpool2d_backward(dy, x_shape, **kwargs, backend=backend)
    assert_close(dx, avgpool_reference(x, dy=dy.astype(np.float64), **kwargs), what="avgpool dx")


@given(pool_general_case(max_hw=8))
def test_avgpool2d_oracle_matches_finite_differences(case):
    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape)
    r = rng.standard_normal(avgpool_reference(x, **kwargs).shape)
    dx = avgpool_reference(x, dy=r, **kwargs)
    idx, num = numeric_grad(lambda: float((avgpool_reference(x, **kwargs) * r).sum()), x)
    np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-6, atol=1e-8)


@needs_torch
@given(pool_general_case())
def test_avgpool2d_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    x_shape, kwargs, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    xt = torch.tensor(x, requires_grad=True)
    yt = tF.avg_pool2d(xt, **kwargs)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    assert_close(F.avgpool2d(x, **kwargs, backend=backend), yt.detach().numpy(), what="avgpool vs torch")
    assert_close(F.avgpool2d_backward(dy, x_shape, **kwargs, backend=backend), xt.grad.numpy(),
                 what="dx vs torch")


# ----------------------------------------------------------- adaptive_avgpool2d
@given(adaptive_case())
def test_adaptive_avgpool2d_matches_oracle(backend, case):
    x_shape, out, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    y_ref = adaptive_reference(x.astype(np.float64), out)
    assert_close(F.adaptive_avgpool2d(x, out, backend=backend), y_ref, what="adaptive y")
    dy = rand(rng, *y_ref.shape)
    dx = F.adaptive_avgpool2d_backward(dy, x_shape, out, backend=backend)
    assert_close(dx, adaptive_reference(x, out, dy=dy.astype(np.float64)), what="adaptive dx")


@given(adaptive_case())
def test_adaptive_avgpool2d_oracle_matches_finite_differences(case):
    x_shape, out, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape)
    r = rng.standard_normal(adaptive_reference(x, out).shape)
    dx = adaptive_reference(x, out, dy=r)
    idx, num = numeric_grad(lambda: float((adaptive_reference(x, out) * r).sum()), x)
    np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-6, atol=1e-8)


@needs_torch
@given(adaptive_case())
def test_adaptive_avgpool2d_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    x_shape, out, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape)
    xt = torch.tensor(x, requires_grad=True)
    yt = tF.adaptive_avg_pool2d(xt, out)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    assert_close(F.adaptive_avgpool2d(x, out, backend=backend), yt.detach().numpy(), what="adaptive vs torch")
    assert_close(F.adaptive_avgpool2d_backward(dy, x_shape, out, backend=backend), xt.grad.numpy(),
                 what="dx vs torch")


@pytest.mark.parametrize("x_shape", [(4, 16, 7, 7), (2, 3, 1, 1), (1, 64, 32, 32)])
def test_global_average_pooling(backend, x_shape):
    rng = np.random.default_rng(1)
    x = rand(rng, *x_shape)
    for out in (1, (1, 1)):
        y = F.adaptive_avgpool2d(x, out, backend=backend)
        assert_close(y, x.astype(np.float64).mean(axis=(2, 3), keepdims=True), what="global mean")
    dy = rand(rng, x_shape[0], x_shape[1], 1, 1)
    dx = F.adaptive_avgpool2d_backward(dy, x_shape, 1, backend=backend)
    assert_close(dx, np.broadcast_to(dy / (x_shape[2] * x_shape[3]), x_shape), what="global dx")


def test_int_maxpool_keeps_the_existing_path_bit_for_bit(backend):
    be = pc.backends.get(backend)
    x = be.asarray(rand(np.random.default_rng(2), 2, 3, 9, 8))
    y_old, am_old = be.maxpool2d_forward(x, 2, 2)
    for kwargs in (dict(kernel_size=2), dict(kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))):
        y, am = F.maxpool2d(x, **kwargs, return_indices=True, backend=be)
        np.testing.assert_array_equal(pc.to_numpy(y), pc.to_numpy(y_old))
        np.testing.assert_array_equal(pc.to_numpy(am), pc.to_numpy(am_old))


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("op", ["maxpool2d", "avgpool2d"])
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(kernel_size=2, padding=2), ValueError, "padding must be at most half the kernel_size"),
    (dict(kernel_size=(3, 2), padding=(1, 2)), ValueError, "padding must be at most half the kernel_size"),
    (dict(kernel_size=0), ValueError, "kernel_size must be >= 1, got 0"),
    (dict(kernel_size=2, stride=(1, 0)), ValueError, "stride must be >= 1"),
    (dict(kernel_size=2.0), TypeError, "kernel_size must be an int, got float"),
    (dict(kernel_size=(2, 2, 2)), TypeError, "kernel_size must be an int"),
    (dict(kernel_size=2, padding=-1), ValueError, "padding must be >= 0"),
    (dict(kernel_size=(9, 2)), ValueError, r"is larger than the padded input"),
])
def test_pooling_rejects_bad_arguments(backend, op, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        getattr(F, op)(np.zeros((1, 2, 6, 6)), backend=backend, **kwargs)


@pytest.mark.parametrize("output_size, exc, match", [
    (0, ValueError, "output_size must be >= 1, got 0"),
    ((2, 0), ValueError, "output_size must be >= 1"),
    ("1", TypeError, "output_size must be an int"),
    ((1, 2, 3), TypeError, "output_size must be an int"),
])
def test_adaptive_avgpool2d_rejects_bad_output_size(backend, output_size, exc, match):
    with pytest.raises(exc, match=match):
        F.adaptive_avgpool2d(np.zeros((1, 2, 6, 6)), output_size, backend=backend)


def test_pooling_backward_checks_shapes(backend):
    with pytest.raises(ValueError, match=r"dy must have the forward output's shape \(1, 2, 3, 3\)"):
        F.avgpool2d_backward(np.zeros((1, 2, 2, 2)), (1, 2, 6, 6), 2, backend=backend)
    with pytest.raises(ValueError, match=r"dy must have the forward output's shape \(1, 2, 2, 2\)"):
        F.adaptive_avgpool2d_backward(np.zeros((1, 2, 3, 3)), (1, 2, 6, 6), 2, backend=backend)
    with pytest.raises(ValueError, match=r"x_shape must be 4-D"):
        F.avgpool2d_backward(np.zeros((1, 2, 3, 3)), (2, 6, 6), 2, backend=backend)
    with pytest.raises(TypeError, match=r"x_shape must be a tuple"):
        F.adaptive_avgpool2d_backward(np.zeros((1, 2, 3, 3)), 6, 3, backend=backend)


def test_opencl_gpu_style_configuration_runs_the_pool_kernels():
    """The wide work-groups (RED_WG up to 256) of a GPU-style configuration, on this device."""
    if "opencl" not in pc.available_backends():
        pytest.skip("no OpenCL backend here")
    from parconv.backends import opencl as ocl

    be = ocl.OpenCLBackend(config=ocl.device_config(pc.backends.get("opencl").device, kind="gpu"))
    rng = np.random.default_rng(6)
    x = rand(rng, 3, 5, 17, 12)
    for out in (1, (1, 1), (3, 5)):
        assert_close(F.adaptive_avgpool2d(x, out, backend=be), adaptive_reference(x.astype(np.float64), out),
                     what=f"adaptive {out}")
    kwargs = dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1))
    assert_close(F.avgpool2d(x, **kwargs, backend=be), avgpool_reference(x.astype(np.float64), **kwargs),
                 what="avgpool")
    y, am = F.maxpool2d(x, **kwargs, return_indices=True, backend=be)
    np.testing.assert_array_equal(pc.to_numpy(am), maxpool_reference(x, **kwargs)[1])
