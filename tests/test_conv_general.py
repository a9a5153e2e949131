"""Grouped, depthwise, dilated, rectangular, strided and "same"-padded conv2d on every backend.

Every backend against the NumPy oracle (run in float64), the oracle against
float64 finite differences, and everything against ``torch.nn.functional.conv2d``
when PyTorch is installed. The case generator and the reference are small
functions so an op table can reuse them.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, conv_shapes, needs_torch, numeric_grad, rand

ORACLE = pc.backends.get("numpy")


@st.composite
def conv_general_case(draw, max_n=3, max_hw=12):
    """(x shape, w shape, kwargs, bias, seed) of a general convolution."""
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cg, og = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if draw(st.booleans()):  # depthwise (with a channel multiplier)
        cg = 1
    n, h, w = draw(st.integers(1, max_n)), draw(st.integers(1, max_hw)), draw(st.integers(1, max_hw))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    mode = draw(st.sampled_from(["int", "pair", "same", "valid"]))
    stride = (1, 1) if mode == "same" else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = {"int": draw(st.integers(0, 2)), "pair": (draw(st.integers(0, 2)), draw(st.integers(0, 2))),
               "same": "same", "valid": "valid"}[mode]
    x_shape, w_shape, kwargs = conv_shapes(n, groups, cg, og, h, w, kh, kw, stride=stride, padding=padding,
                                           dilation=dilation)
    return x_shape, w_shape, kwargs, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def conv_general_arrays(case, dtype=np.float32):
    x_shape, w_shape, kwargs, bias, seed = case
    rng = np.random.default_rng(seed)
    fan_in = w_shape[1] * w_shape[2] * w_shape[3]
    x = rand(rng, *x_shape).astype(dtype)
    w = rand(rng, *w_shape, scale=1.0 / np.sqrt(fan_in)).astype(dtype)
    b = rand(rng, w_shape[0]).astype(dtype) if bias else None
    return rng, x, w, b


def conv_general_reference(x, w, b, stride=1, padding=0, dilation=1, groups=1, dy=None):
    """The oracle's forward (and with ``dy`` its gradients) in the dtype of ``x``."""
    _, stride, pads, dilation, groups = F._conv_args(x.shape, w.shape, stride, padding, dilation, groups, "test")
    y = ORACLE.conv2d_general_forward(x, w, b, stride, pads, dilation, groups)
    if dy is None:
        return y
    return y, ORACLE.conv2d_general_backward(x, w, dy, stride, pads, dilation, groups, True, b is not None)


@given(conv_general_case())
def test_conv2d_general_matches_oracle(backend, case):
    _, _, kwargs, bias, _ = case
    rng, x, w, b = conv_general_arrays(case)
    y = F.conv2d(x, w, b, backend=backend, **kwargs)
    dy = rand(rng, *y.shape)
    f64 = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    y_ref, (dx_ref, dw_ref, db_ref) = conv_general_reference(f64(x), f64(w), f64(b), dy=f64(dy), **kwargs)
    assert_close(y, y_ref, what="y")
    dx, dw, db = F.conv2d_backward(x, w, dy, backend=backend, need_db=bias, **kwargs)
    assert_close(dx, dx_ref, what="dx")
    assert_close(dw, dw_ref, atol=1e-4, what="dw")
    if bias:
        assert_close(db, db_ref, atol=1e-4, what="db")
    else:
        assert db is None
    dx2, dw2, _ = F.conv2d_backward(x, w, dy, backend=backend, need_dx=False, **kwargs)
    assert dx2 is None
    assert_close(dw2, dw_ref, atol=1e-4, what="dw without dx")


@given(conv_general_case(max_n=2, max_hw=7))
def test_conv2d_general_oracle_matches_finite_differences(case):
    _, _, kwargs, bias, _ = case
    rng, x, w, b = conv_general_arrays(case, np.float64)
    y = conv_general_reference(x, w, b, **kwargs)
    r = rng.standard_normal(y.shape)
    _, (dx, dw, db) = conv_general_reference(x, w, b, dy=r, **kwargs)
    loss = lambda: float((conv_general_reference(x, w, b, **kwargs) * r).sum())  # noqa: E731
    for arr, grad in ((x, dx), (w, dw)) + (((b, db),) if bias else ()):
        idx, num = numeric_grad(loss, arr, max_points=20, rng=rng)
        np.testing.assert_allclose(grad.reshape(-1)[idx], num, rtol=1e-5, atol=1e-6)


@needs_torch
@given(conv_general_case())
def test_conv2d_general_matches_torch(backend, case):
    import torch
    import torch.nn.functional as tF

    _, _, kwargs, bias, _ = case
    rng, x, w, b = conv_general_arrays(case)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if bias else None
    yt = tF.conv2d(xt, wt, bt, **kwargs)
    dy = rand(rng, *yt.shape)
    yt.backward(torch.tensor(dy))
    assert_close(F.conv2d(x, w, b, backend=backend, **kwargs), yt.detach().numpy(), what="y vs torch")
    dx, dw, db = F.conv2d_backward(x, w, dy, backend=backend, need_db=bias, **kwargs)
    assert_close(dx, xt.grad.numpy(), what="dx vs torch")
    assert_close(dw, wt.grad.numpy(), atol=1e-4, what="dw vs torch")
    if bias:
        assert_close(db, bt.grad.numpy(), atol=1e-4, what="db vs torch")


NAMED = {
    "depthwise": ((2, 6, 9, 9), (6, 1, 3, 3), dict(padding=1, groups=6)),
    "depthwise-x2-stride2": ((2, 4, 9, 8), (8, 1, 3, 3), dict(stride=2, padding=1, groups=4)),
    "depthwise-x3-dilated-same": ((2, 4, 9, 8), (12, 1, 3, 2), dict(padding="same", dilation=2, groups=4)),
    "depthwise-wide-padding": ((2, 3, 6, 6), (3, 1, 3, 3), dict(padding=(3, 2), groups=3)),
    "grouped": ((2, 4, 7, 7), (6, 2, 3, 3), dict(padding=1, groups=2)),
    "dilated": ((2, 3, 11, 10), (4, 3, 3, 3), dict(padding=2, dilation=2)),
    "rectangular-stride21": ((2, 3, 9, 7), (5, 3, 3, 1), dict(stride=(2, 1), padding=(1, 0))),
    "same-even": ((2, 3, 8, 7), (4, 3, 4, 2), dict(padding="same")),
    "same-dilated": ((1, 2, 9, 9), (3, 2, 2, 3), dict(padding="same", dilation=(2, 1))),
    "valid": ((2, 3, 6, 6), (2, 3, 3, 2), dict(padding="valid")),
    "pointwise-groups": ((3, 8, 5, 5), (8, 2, 1, 1), dict(groups=4)),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_conv2d_named_cases_match_oracle(backend, name):
    x_shape, w_shape, kwargs = NAMED[name]
    case = (x_shape, w_shape, kwargs, True, 7)
    rng, x, w, b = conv_general_arrays(case)
    y = F.conv2d(x, w, b, backend=backend, **kwargs)
    dy = rand(rng, *y.shape)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    y_ref, (dx_ref, dw_ref, db_ref) = conv_general_reference(f64(x), f64(w), f64(b), dy=f64(dy), **kwargs)
    assert_close(y, y_ref, what=f"{name} y")
    dx, dw, db = F.conv2d_backward(x, w, dy, backend=backend, **kwargs)
    assert_close(dx, dx_ref, what=f"{name} dx")
    assert_close(dw, dw_ref, atol=1e-4, what=f"{name} dw")
    assert_close(db, db_ref, atol=1e-4, what=f"{name} db")


def test_same_padding_keeps_the_size_and_pads_bottom_right(backend):
    """An even kernel pads the odd element on the bottom/right (PyTorch's 'same')."""
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 3, 3] = 1.0
    w = np.ones((1, 1, 2, 2), np.float32)
    y = pc.to_numpy(F.conv2d(x, w, padding="same", backend=backend))
    assert y.shape == (1, 1, 4, 4)
    expected = np.zeros((4, 4), np.float32)
    expected[2:, 2:] = 1.0  # taps at (p, q), (p, q+1), (p+1, q), (p+1, q+1)
    np.testing.assert_array_equal(y[0, 0], expected)


def test_int_arguments_keep_the_existing_path_bit_for_bit(backend):
    be = pc.backends.get(backend)
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, 2, 3, 9, 9), rand(rng, 4, 3, 3, 3), rand(rng, 4)
    dy = rand(rng, 2, 4, 5, 5)
    X, Wd, B = be.asarray(x), be.asarray(w), be.asarray(b)
    y_old = pc.to_numpy(be.conv2d_forward(X, Wd, B, 2, 1))
    for kwargs in (dict(stride=2, padding=1), dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=1)):
        np.testing.assert_array_equal(pc.to_numpy(F.conv2d(X, Wd, B, backend=be, **kwargs)), y_old)
        new = F.conv2d_backward(X, Wd, be.asarray(dy), backend=be, **kwargs)
        for a, o in zip(new, be.conv2d_backward(X, Wd, be.asarray(dy), 2, 1, True, True)):
            np.testing.assert_array_equal(pc.to_numpy(a), pc.to_numpy(o))


@pytest.mark.parametrize("x_shape, w_shape, kwargs, exc, match", [
    ((1, 4, 8, 8), (4, 2, 3, 3), dict(groups=3), ValueError, "groups=3 must divide both"),
    ((1, 4, 8, 8), (4, 1, 3, 3), dict(groups=2), ValueError, r"C/groups = 2 input channels"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(groups=0), ValueError, "groups must be >= 1, got 0"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(dilation=0), ValueError, "dilation must be >= 1"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(dilation=(1, 2, 3)), TypeError, "dilation must be an int"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(stride=(1, 0)), ValueError, r"stride must be >= 1, got \(1, 0\)"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(padding=(1, -1)), ValueError, "padding must be >= 0"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(padding="full"), ValueError, "padding must be an int, a pair"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(padding="same", stride=2), ValueError, "padding='same' needs stride 1"),
    ((1, 4, 8, 8), (4, 4, 3, 3), dict(groups=1.0), TypeError, "groups must be an int"),
    ((1, 4, 5, 5), (4, 4, 3, 3), dict(dilation=3), ValueError, r"dilated 7x7\) is larger than the padded input"),
])
def test_conv2d_rejects_bad_arguments(backend, x_shape, w_shape, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        F.conv2d(np.zeros(x_shape), np.zeros(w_shape), backend=backend, **kwargs)
    with pytest.raises(exc, match=match):
        F.conv2d_output_shape(x_shape, w_shape, **kwargs)


def test_conv2d_backward_rejects_a_dy_of_the_wrong_shape(backend):
    with pytest.raises(ValueError, match=r"dy must have the forward output's shape \(1, 4, 8, 8\)"):
        F.conv2d_backward(np.zeros((1, 4, 8, 8)), np.zeros((4, 1, 3, 3)), np.zeros((1, 4, 6, 6)), padding=1,
                          groups=4, backend=backend)


def test_output_shape_helper_keeps_positional_where():
    """Callers that pass ``where`` fifth (before dilation and groups existed) still name themselves."""
    with pytest.raises(ValueError, match="^mylayer: x has 2 channels"):
        F.conv2d_output_shape((1, 2, 5, 5), (3, 1, 3, 3), 1, 0, "mylayer")
    assert F.conv2d_output_shape((1, 2, 5, 5), (3, 2, 3, 3), 1, 0, "mylayer") == (1, 3, 3, 3)


def test_opencl_gpu_style_configuration_runs_the_general_kernels():
    """The wide work-groups (RED_WG up to 256) of a GPU-style configuration, on this device."""
    if "opencl" not in pc.available_backends():
        pytest.skip("no OpenCL backend here")
    from parconv.backends import opencl as ocl

    default = pc.backends.get("opencl")
    be = ocl.OpenCLBackend(config=ocl.device_config(default.device, kind="gpu"))
    for name in ("depthwise-x2-stride2", "grouped", "same-even"):
        x_shape, w_shape, kwargs = NAMED[name]
        rng, x, w, b = conv_general_arrays((x_shape, w_shape, kwargs, True, 11))
        y = F.conv2d(x, w, b, backend=be, **kwargs)
        dy = rand(rng, *y.shape)
        f64 = lambda a: a.astype(np.float64)  # noqa: E731
        y_ref, grads_ref = conv_general_reference(f64(x), f64(w), f64(b), dy=f64(dy), **kwargs)
        assert_close(y, y_ref, what=f"{name} y")
        for got, want, what in zip(F.conv2d_backward(x, w, dy, backend=be, **kwargs), grads_ref, "dx dw db".split()):
            assert_close(got, want, atol=1e-4, what=f"{name} {what}")


@pytest.mark.parametrize("w_shape, kwargs", [
    ((64, 1, 3, 3), dict(padding=1, groups=32)),            # depthwise, multiplier 2
    ((32, 16, 3, 3), dict(stride=(2, 1), padding=(1, 0), groups=2)),
])
def test_openmp_general_conv_is_reproducible_and_right_on_two_threads(w_shape, kwargs):
    """Shapes large enough to run parallel: 1 and 2 threads agree with the oracle, and a thread
    count gives the same bits every time (dw reduced in a fixed order)."""
    if "openmp" not in pc.available_backends():
        pytest.skip("no OpenMP backend here")
    rng = np.random.default_rng(4)
    x = rand(rng, 8, 32, 20, 20)
    w = rand(rng, *w_shape, scale=0.2)
    y_ref, grads_ref = conv_general_reference(x.astype(np.float64), w.astype(np.float64), np.zeros(w_shape[0]),
                                              dy=np.ones(F.conv2d_output_shape(x.shape, w.shape, **kwargs)),
                                              **kwargs)
    dy = np.ones(y_ref.shape, np.float32)
    for threads in (1, 2):
        with pc.num_threads(threads):
            first = F.conv2d_backward(x, w, dy, backend="openmp", **kwargs)
            again = F.conv2d_backward(x, w, dy, backend="openmp", **kwargs)
            assert_close(F.conv2d(x, w, backend="openmp", **kwargs), y_ref, what=f"y on {threads}")
        for a, b_, want, what in zip(first, again, grads_ref, "dx dw db".split()):
            np.testing.assert_array_equal(a, b_)
            assert_close(a, want, rtol=1e-4, atol=1e-3, what=f"{what} on {threads} threads")
