"""Dropout by its statistics: dropped fraction, scale, the same mask in the backward and on
every backend for a seed, different masks for different seeds."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import BACKENDS, host, rand

seeds = st.integers(0, 2**64 - 1)


@given(seed=seeds, p=st.sampled_from([0.1, 0.25, 0.5, 0.9]))
def test_dropout_drops_a_fraction_p_and_scales_the_rest(backend, seed, p):
    n = 40_000
    x = np.random.default_rng(seed % 2**32).uniform(1.0, 2.0, n).astype(np.float32)  # never zero
    y = host(F.dropout(x, p, seed, backend=backend))
    kept = y != 0
    # the dropped count is binomial(n, p): within 5 standard deviations
    assert abs((~kept).sum() - n * p) < 5 * np.sqrt(n * p * (1 - p))
    np.testing.assert_array_equal(y[kept], x[kept] * np.float32(1 / (1 - p)))


@given(seed=seeds, p=st.floats(0.0, 0.95), shape=st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_dropout_backward_uses_the_forward_mask(backend, seed, p, shape):
    rng = np.random.default_rng(seed % 2**32)
    x = rng.uniform(0.5, 1.5, shape).astype(np.float32)
    dy = rand(rng, *shape)
    dy[dy == 0] = 1
    y = host(F.dropout(x, p, seed, backend=backend))
    dx = host(F.dropout_backward(dy, p, seed, backend=backend))
    np.testing.assert_array_equal(dx != 0, y != 0)
    keep = y != 0
    np.testing.assert_array_equal(dx[keep], dy[keep] * np.float32(1 / (1 - p)))


@given(seed=seeds, p=st.floats(0.0, 0.99), n=st.integers(1, 3000))
def test_dropout_gives_the_same_mask_on_every_backend(seed, p, n):
    x = np.arange(1, n + 1, dtype=np.float32)
    outs = [host(F.dropout(x, p, seed, backend=name)) for name in BACKENDS]
    for name, out in zip(BACKENDS[1:], outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=f"{name} vs {BACKENDS[0]}")


def test_dropout_masks_differ_between_seeds(backend):
    x = np.ones(10_000, np.float32)
    masks = [host(F.dropout(x, 0.5, seed, backend=backend)) != 0 for seed in (0, 1, 2**63, 2**64 - 1)]
    for i in range(len(masks)):
        for j in range(i):
            # independent masks agree on about half of the elements
            assert 0.45 < (masks[i] == masks[j]).mean() < 0.55


def test_dropout_edge_probabilities(backend):
    x = rand(np.random.default_rng(0), 3, 4, 5)
    np.testing.assert_array_equal(host(F.dropout(x, 0.0, 7, backend=backend)), x)
    np.testing.assert_array_equal(host(F.dropout(x, 1.0, 7, backend=backend)), np.zeros_like(x))
    np.testing.assert_array_equal(host(F.dropout_backward(x, 1.0, 7, backend=backend)), np.zeros_like(x))


def test_dropout_on_opencl_uploads_no_mask():
    if "opencl" not in pc.available_backends():
        pytest.skip("opencl backend not available")
    be = pc.backends.get("opencl")
    x = be.asarray(np.ones((64, 32), np.float32))
    be.transfers.reset()
    y = F.dropout(x, 0.3, 12345, backend=be)
    F.dropout_backward(y, 0.3, 12345, backend=be)
    assert be.transfers.h2d_count == 0 and be.transfers.d2h_count == 0, be.transfers


def test_dropout_rejects_bad_arguments(backend):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="p must be <= 1"):
        F.dropout(x, 1.5, 0, backend=backend)
    with pytest.raises(ValueError, match="p must be >= 0"):
        F.dropout(x, -0.1, 0, backend=backend)
    with pytest.raises(TypeError, match="p must be a real number"):
        F.dropout(x, "half", 0, backend=backend)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        F.dropout(x, 0.5, -1, backend=backend)
    with pytest.raises(ValueError, match="seed must be a uint64"):
        F.dropout_backward(x, 0.5, 2**64, backend=backend)
    with pytest.raises(TypeError, match="seed must be an int"):
        F.dropout(x, 0.5, 1.5, backend=backend)
    with pytest.raises(ValueError, match="zero-sized"):
        F.dropout(np.ones((0, 3)), 0.5, 1, backend=backend)
    # a seed drawn from a numpy Generator, as the layer does, is accepted
    seed = np.random.default_rng(0).integers(0, 2**64, dtype=np.uint64)
    assert host(F.dropout(x, 0.5, seed, backend=backend)).shape == (2, 3)
