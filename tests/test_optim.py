"""SGD and Adam updates on every backend against the oracle and torch.optim."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
from conftest import assert_close, needs_torch, rand

sgd_case = st.tuples(st.integers(1, 500), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 1e-3]),
                     st.booleans(), st.integers(0, 2**31 - 1))


@given(sgd_case)
def test_sgd_update_matches_oracle(backend, oracle, case):
    n, momentum, wd, nesterov, seed = case
    nesterov = nesterov and momentum > 0
    rng = np.random.default_rng(seed)
    p, v = rand(rng, n), rand(rng, n)
    P, V = backend.asarray(p.copy()), backend.asarray(v.copy())  # asarray may alias host data
    for _ in range(3):
        g = rand(rng, n)
        oracle.sgd_update(p, g, v if momentum else None, 0.1, momentum, wd, nesterov)
        backend.sgd_update(P, backend.asarray(g), V if momentum else None, 0.1, momentum, wd, nesterov)
    assert_close(P, p, what="sgd p")
    if momentum:
        assert_close(V, v, what="sgd v")


@given(st.tuples(st.integers(1, 500), st.sampled_from([0.0, 1e-2]), st.integers(0, 2**31 - 1)))
def test_adam_update_matches_oracle(backend, oracle, case):
    n, wd, seed = case
    rng = np.random.default_rng(seed)
    p = rand(rng, n)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    P, M, V = backend.asarray(p.copy()), backend.zeros((n,)), backend.zeros((n,))
    for step in range(1, 4):
        g = rand(rng, n)
        oracle.adam_update(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, wd, step)
        backend.adam_update(P, backend.asarray(g), M, V, 1e-2, 0.9, 0.999, 1e-8, wd, step)
    assert_close(P, p, what="adam p")
    assert_close(M, m, what="adam m")
    assert_close(V, v, what="adam v")


@needs_torch
@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "adam"])
def test_optimizers_match_torch(backend, kind):
    import torch

    rng = np.random.default_rng(1)
    w0 = rand(rng, 7, 5)
    grads = [rand(rng, 7, 5) for _ in range(4)]
    layer = pc.Linear(5, 7, backend=backend)
    layer.weight.data = backend.asarray(w0)
    wt = torch.nn.Parameter(torch.tensor(w0))
    if kind == "adam":
        opt = pc.optim.Adam([layer.weight], lr=0.01, weight_decay=1e-3)
        topt = torch.optim.Adam([wt], lr=0.01, weight_decay=1e-3)
    else:
        nesterov = kind == "sgd-nesterov"
        opt = pc.optim.SGD([layer.weight], lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
        topt = torch.optim.SGD([wt], lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    for g in grads:
        layer.weight.grad = backend.asarray(g)
        wt.grad = torch.tensor(g)
        opt.step()
        topt.step()
    assert_close(layer.weight.data, wt.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_optimizer_state_dict_round_trip(backend):
    layer = pc.Linear(3, 2, backend=backend)
    opt = pc.optim.Adam(layer.parameters(), lr=0.1)
    for p in layer.parameters():
        p.grad = backend.asarray(np.ones(p.shape, np.float32))
    opt.step()
    state = opt.state_dict()
    opt2 = pc.optim.Adam(layer.parameters(), lr=0.1)
    opt2.load_state_dict(state)
    assert opt2.step_count == 1
    for k, v in opt2.state_dict().items():
        if k.startswith("state."):
            np.testing.assert_array_equal(v, state[k])


@given(st.lists(st.integers(0, 70000), min_size=1, max_size=5), st.sampled_from([0.0, 0.9]),
       st.sampled_from([0.0, 1e-3]), st.booleans(), st.integers(0, 2**31 - 1))
def test_sgd_update_many_matches_one_by_one(backend, oracle, sizes, momentum, wd, nesterov, seed):
    """Several parameters in one call (one parallel loop on openmp, split across the parameters'
    ends) give what updating them one by one gives."""
    nesterov = nesterov and momentum > 0
    rng = np.random.default_rng(seed)
    ps, gs, vs = [rand(rng, n) for n in sizes], [rand(rng, n) for n in sizes], [rand(rng, n) for n in sizes]
    P, G = [backend.asarray(p.copy()) for p in ps], [backend.asarray(g) for g in gs]
    V = [backend.asarray(v.copy()) for v in vs] if momentum else None
    for threads in (1, 2):
        with pc.num_threads(threads):
            backend.sgd_update_many(P, G, V, 0.1, momentum, wd, nesterov)
        for i in range(len(sizes)):
            oracle.sgd_update(ps[i], gs[i], vs[i] if momentum else None, 0.1, momentum, wd, nesterov)
            assert_close(P[i], ps[i], what=f"sgd p[{i}]")
            if momentum:
                assert_close(V[i], vs[i], what=f"sgd v[{i}]")


def test_sgd_update_many_rejects_mismatched_lists():
    from parconv._ext import _optim

    p, g = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="2 parameters, 1 gradients"):
        _optim.sgd_update_many([p, p], [g], None, 0.1, 0.0, 0.0, False, 1)
    with pytest.raises(ValueError, match="gradient 0 has 3 elements"):
        _optim.sgd_update_many([p], [g[:3]], None, 0.1, 0.0, 0.0, False, 1)
    with pytest.raises(ValueError, match="momentum buffer 0 has 2 elements"):
        _optim.sgd_update_many([p], [g], [g[:2].copy()], 0.1, 0.9, 0.0, False, 1)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_step_checks_every_gradient_before_updating(backend, kind):
    """A gradient of the wrong shape raises before any parameter (or the step count) changes."""
    layer = pc.Linear(3, 2, backend=backend)
    opt = pc.optim.SGD(layer.parameters(), lr=0.1) if kind == "sgd" else pc.optim.Adam(layer.parameters(), lr=0.1)
    before = [p.numpy().copy() for p in layer.parameters()]
    layer.weight.grad = backend.asarray(np.ones((2, 3), np.float32))
    layer.bias.grad = backend.asarray(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="gradient of shape"):
        opt.step()
    assert opt.step_count == 0
    for p, b in zip(layer.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
