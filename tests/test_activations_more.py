"""leaky_relu, tanh, softmax (any dim) and add on every backend against the oracle, finite
differences and PyTorch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, host, needs_torch, numeric_grad, rand

shapes = st.lists(st.integers(1, 12), min_size=1, max_size=4).map(tuple)
slopes = st.sampled_from([0.01, 0.2, 1.5, -0.3])


def _dim(data, shape):
    return data.draw(st.integers(-len(shape), len(shape) - 1))


# ---------------------------------------------------------------------- oracle
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), slope=slopes, scale=st.sampled_from([1.0, 100.0]))
def test_leaky_relu_matches_oracle(backend, oracle, shape, seed, slope, scale):
    rng = np.random.default_rng(seed)
    x, dy = rand(rng, *shape, scale=scale), rand(rng, *shape)
    assert_close(F.leaky_relu(x, slope, backend=backend), oracle.leaky_relu_forward(x, slope), what="y")
    assert_close(F.leaky_relu_backward(x, dy, slope, backend=backend), oracle.leaky_relu_backward(x, dy, slope),
                 what="dx")


@given(shape=shapes, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 10.0, 100.0]))
def test_tanh_matches_oracle(backend, oracle, shape, seed, scale):
    rng = np.random.default_rng(seed)
    x, dy = rand(rng, *shape, scale=scale), rand(rng, *shape)
    y_ref = oracle.tanh_forward(x)
    y = F.tanh(x, backend=backend)
    assert_close(y, y_ref, rtol=1e-5, atol=1e-6, what="y")
    assert_close(F.tanh_backward(y_ref, dy, backend=backend), oracle.tanh_backward(y_ref, dy), what="dx")


def test_tanh_is_accurate_over_its_whole_range(backend):
    x = np.concatenate([np.linspace(-20, 20, 200_001), np.geomspace(1e-30, 0.7, 2001),
                        -np.geomspace(1e-30, 0.7, 2001)]).astype(np.float32)
    y = host(F.tanh(x, backend=backend))
    np.testing.assert_allclose(y, np.tanh(x.astype(np.float64)), rtol=1e-6, atol=0)
    special = np.array([np.inf, -np.inf, np.nan, -0.0], np.float32)
    y = host(F.tanh(special, backend=backend))
    np.testing.assert_array_equal(y[:2], [1.0, -1.0])
    assert np.isnan(y[2]) and y[3] == 0 and np.signbit(y[3])


@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 30.0]))
def test_softmax_matches_oracle(backend, oracle, data, shape, seed, scale):
    dim = _dim(data, shape)
    rng = np.random.default_rng(seed)
    x, dy = rand(rng, *shape, scale=scale), rand(rng, *shape)
    y_ref = oracle.softmax_forward(x, dim % len(shape))
    y = F.softmax(x, dim, backend=backend)
    assert_close(y, y_ref, rtol=1e-4, atol=1e-6, what="y")
    np.testing.assert_allclose(host(y).sum(axis=dim), 1.0, rtol=1e-5)
    dx_ref = oracle.softmax_backward(y_ref, dy, dim % len(shape))
    assert_close(F.softmax_backward(y_ref, dy, dim, backend=backend), dx_ref, rtol=1e-4, atol=1e-5, what="dx")


@pytest.mark.parametrize("shape,dim", [((2, 3, 700), 1), ((3, 600), 1), ((5, 1000), 0), ((4, 7, 33, 20), 1),
                                       ((50, 40, 30), 2)])
def test_softmax_matches_oracle_on_large_inputs(backend, oracle, shape, dim):
    """Several column tiles per block (openmp takes 256 columns at once) and two threads."""
    rng = np.random.default_rng(len(shape) + dim)
    x, dy = rand(rng, *shape, scale=4.0), rand(rng, *shape)
    with pc.num_threads(2):
        y = F.softmax(x, dim, backend=backend)
        dx = F.softmax_backward(y, dy, dim, backend=backend)
    y_ref = oracle.softmax_forward(x, dim)
    assert_close(y, y_ref, rtol=1e-4, atol=1e-6, what="y")
    assert_close(dx, oracle.softmax_backward(host(y), dy, dim), rtol=1e-4, atol=1e-5, what="dx")


def test_softmax_is_stable_for_large_inputs(backend):
    x = np.array([[1e4, 1e4 + 1, -1e4], [-1e30, 0.0, 1e30]], np.float32)
    y = host(F.softmax(x, -1, backend=backend))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0], [1 / (1 + np.e), np.e / (1 + np.e), 0.0], rtol=1e-5)
    np.testing.assert_allclose(y[1], [0.0, 0.0, 1.0])


@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_add_matches_oracle(backend, shape, seed):
    rng = np.random.default_rng(seed)
    a, b = rand(rng, *shape), rand(rng, *shape)
    out = F.add(a, b, backend=backend)
    np.testing.assert_array_equal(host(out), a + b)


@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_add_with_relu_is_relu_of_the_sum_bit_for_bit(backend, shape, seed):
    """A residual block's eval output in one op: the bits of add then relu, NaN passing, -0 kept."""
    rng = np.random.default_rng(seed)
    a, b = rand(rng, *shape), rand(rng, *shape)
    flat = a.reshape(-1)
    flat[:: 7] = -b.reshape(-1)[:: 7]  # exact zeros of the sum, +0 and -0
    if flat.size > 3:
        flat[1], flat[2], flat[3] = np.nan, np.inf, -np.inf
    fused = host(F.add(a, b, relu=True, backend=backend))
    apart = host(F.relu(F.add(a, b, backend=backend), backend=backend))
    np.testing.assert_array_equal(fused.view(np.uint32), apart.view(np.uint32))


def test_add_relu_flag_must_be_a_bool(backend):
    with pytest.raises(TypeError, match="relu must be a bool"):
        F.add(np.ones(3, np.float32), np.ones(3, np.float32), relu=1, backend=backend)


# ------------------------------------------------------------ finite differences
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1), slope=slopes)
def test_oracle_gradients_match_finite_differences(oracle, data, shape, seed, slope):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x[np.abs(x) < 1e-3] = 0.5  # keep leaky_relu away from its kink
    r = rng.standard_normal(shape)
    dim = _dim(data, shape) % len(shape)
    cases = {
        "leaky_relu": (lambda: oracle.leaky_relu_forward(x, slope), lambda: oracle.leaky_relu_backward(x, r, slope)),
        "tanh": (lambda: oracle.tanh_forward(x), lambda: oracle.tanh_backward(oracle.tanh_forward(x), r)),
        "softmax": (lambda: oracle.softmax_forward(x, dim),
                    lambda: oracle.softmax_backward(oracle.softmax_forward(x, dim), r, dim)),
    }
    for name, (fwd, bwd) in cases.items():
        dx = bwd()
        idx, num = numeric_grad(lambda: float((fwd() * r).sum()), x)
        rounding = 4 * np.finfo(np.float64).eps * float(np.abs(fwd() * r).sum()) / 1e-6
        np.testing.assert_allclose(dx.reshape(-1)[idx], num, rtol=1e-5, atol=1e-8 + rounding, err_msg=name)


# ----------------------------------------------------------------------- torch
@needs_torch
@given(data=st.data(), shape=shapes, seed=st.integers(0, 2**31 - 1), slope=slopes)
def test_activations_match_torch(backend, data, shape, seed, slope):
    import torch
    import torch.nn.functional as TF

    rng = np.random.default_rng(seed)
    x, dy = rand(rng, *shape, scale=3.0), rand(rng, *shape)
    dim = _dim(data, shape)
    cases = {
        "leaky_relu": (lambda t: TF.leaky_relu(t, slope), lambda: F.leaky_relu(x, slope, backend=backend),
                       lambda y: F.leaky_relu_backward(x, dy, slope, backend=backend)),
        "tanh": (torch.tanh, lambda: F.tanh(x, backend=backend), lambda y: F.tanh_backward(y, dy, backend=backend)),
        "softmax": (lambda t: torch.softmax(t, dim), lambda: F.softmax(x, dim, backend=backend),
                    lambda y: F.softmax_backward(y, dy, dim, backend=backend)),
    }
    for name, (tfn, fwd, bwd) in cases.items():
        xt = torch.tensor(x, requires_grad=True)
        yt = tfn(xt)
        yt.backward(torch.tensor(dy))
        y = fwd()
        assert_close(y, yt.detach().numpy(), rtol=1e-4, atol=1e-6, what=f"{name} y")
        assert_close(bwd(y), xt.grad.numpy(), rtol=1e-4, atol=1e-5, what=f"{name} dx")


# ---------------------------------------------------------------------- errors
def test_bad_arguments_raise_clear_errors(backend):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        F.leaky_relu(x, "0.1", backend=backend)
    with pytest.raises(ValueError, match="gradient dy"):
        F.leaky_relu_backward(x, np.ones((3, 2)), backend=backend)
    with pytest.raises(ValueError, match="gradient dy"):
        F.tanh_backward(x, np.ones(6), backend=backend)
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 2\)"):
        F.softmax(x, 2, backend=backend)
    with pytest.raises(TypeError, match="dim must be an int"):
        F.softmax(x, 1.0, backend=backend)
    with pytest.raises(ValueError, match="zero-sized"):
        F.softmax(np.ones((0, 3)), backend=backend)
    with pytest.raises(ValueError, match="same shape"):
        F.add(x, np.ones((3, 2)), backend=backend)
    with pytest.raises(TypeError, match="b must be real-valued"):
        F.add(x, x.astype(np.complex64), backend=backend)
