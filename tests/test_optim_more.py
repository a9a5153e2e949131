"""AdamW, RMSprop, Adam with weight decay and clip_grad_norm_ on every backend, against the
NumPy oracle and torch.optim; optimizer state dicts; argument checks."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
from conftest import assert_close, needs_torch, rand

KINDS = ["adam-wd", "adamw", "rmsprop", "rmsprop-momentum-wd"]


def _make(kind, params, torch_mod=None):
    """The optimizer ``kind`` over ``params`` from parconv.optim or, given ``torch_mod``, torch.optim."""
    mod = torch_mod.optim if torch_mod is not None else pc.optim
    if kind == "adam-wd":
        return mod.Adam(params, lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)
    if kind == "adamw":
        return mod.AdamW(params, lr=0.01, weight_decay=0.1)
    if kind == "rmsprop":
        return mod.RMSprop(params, lr=0.01)
    if kind == "rmsprop-momentum-wd":
        return mod.RMSprop(params, lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.02, momentum=0.9)
    return mod.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)


def _layer(backend, rng):
    layer = pc.Linear(6, 4, backend=backend)
    layer.weight.data = backend.asarray(rand(rng, 4, 6))
    layer.bias.data = backend.asarray(rand(rng, 4))
    return layer


@needs_torch
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_matches_torch_after_5_steps(backend, kind):
    import torch

    rng = np.random.default_rng(3)
    layer = _layer(backend, rng)
    tparams = [torch.nn.Parameter(torch.tensor(p.numpy())) for p in layer.parameters()]
    opt, topt = _make(kind, layer.parameters()), _make(kind, tparams, torch)
    for _ in range(5):
        for p, tp in zip(layer.parameters(), tparams):
            g = rand(rng, *p.shape)
            p.grad = backend.asarray(g)
            tp.grad = torch.tensor(g)
        opt.step()
        topt.step()
    for p, tp in zip(layer.parameters(), tparams):
        assert_close(p.data, tp.detach().numpy(), rtol=1e-4, atol=1e-6, what=kind)


@pytest.mark.parametrize("kind", KINDS + ["sgd"])
def test_optimizer_matches_oracle(backend, oracle, kind):
    """The same steps on the NumPy backend and on ``backend`` give the same weights and state."""
    rng = np.random.default_rng(4)
    a, b = _layer(oracle, np.random.default_rng(5)), _layer(backend, np.random.default_rng(5))
    oa, ob = _make(kind, a.parameters()), _make(kind, b.parameters())
    for _ in range(4):
        for pa, pb in zip(a.parameters(), b.parameters()):
            g = rand(rng, *pa.shape)
            pa.grad, pb.grad = oracle.asarray(g), backend.asarray(g)
        oa.step()
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pb.data, pa.numpy(), rtol=1e-6, atol=1e-7, what=f"{kind} weights")
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if key.startswith("state."):
            assert_close(sb[key], sa[key], rtol=1e-6, atol=1e-7, what=key)


many_case = st.tuples(st.lists(st.integers(0, 70000), min_size=1, max_size=4), st.sampled_from([0.0, 0.05]),
                      st.booleans(), st.integers(0, 2**31 - 1))


@given(many_case)
def test_adam_update_many_matches_oracle(backend, oracle, case):
    """Several parameters in one call (split across their ends on openmp) match the reference."""
    sizes, wd, decoupled, seed = case
    rng = np.random.default_rng(seed)
    ps = [rand(rng, n) for n in sizes]
    ms, vs = [np.zeros(n, np.float32) for n in sizes], [np.zeros(n, np.float32) for n in sizes]
    P = [backend.asarray(p.copy()) for p in ps]
    M, V = [backend.zeros((n,)) for n in sizes], [backend.zeros((n,)) for n in sizes]
    for step, threads in ((1, 1), (2, 2), (3, 2)):
        gs = [rand(rng, n) for n in sizes]
        with pc.num_threads(threads):
            backend.adam_update_many(P, [backend.asarray(g) for g in gs], M, V, 1e-2, 0.9, 0.999, 1e-8, wd, step,
                                     decoupled)
        for p, g, m, v in zip(ps, gs, ms, vs):
            oracle.adam_update(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, wd, step, decoupled)
    for i in range(len(sizes)):
        assert_close(P[i], ps[i], rtol=1e-6, atol=1e-7, what=f"adam p[{i}]")
        assert_close(M[i], ms[i], rtol=1e-6, atol=1e-7, what=f"adam m[{i}]")
        assert_close(V[i], vs[i], rtol=1e-6, atol=1e-9, what=f"adam v[{i}]")


@given(many_case)
def test_rmsprop_update_many_matches_oracle(backend, oracle, case):
    sizes, wd, with_momentum, seed = case
    momentum = 0.9 if with_momentum else 0.0
    rng = np.random.default_rng(seed)
    ps = [rand(rng, n) for n in sizes]
    sqs, bufs = [np.zeros(n, np.float32) for n in sizes], [np.zeros(n, np.float32) for n in sizes]
    P = [backend.asarray(p.copy()) for p in ps]
    SQ, BUF = [backend.zeros((n,)) for n in sizes], [backend.zeros((n,)) for n in sizes]
    for threads in (1, 2, 2):
        gs = [rand(rng, n) for n in sizes]
        with pc.num_threads(threads):
            backend.rmsprop_update_many(P, [backend.asarray(g) for g in gs], SQ, BUF if momentum else None, 1e-2,
                                        0.99, 1e-8, wd, momentum)
        for p, g, sq, buf in zip(ps, gs, sqs, bufs):
            oracle.rmsprop_update(p, g, sq, buf if momentum else None, 1e-2, 0.99, 1e-8, wd, momentum)
    for i in range(len(sizes)):
        assert_close(P[i], ps[i], rtol=1e-6, atol=1e-7, what=f"rmsprop p[{i}]")
        assert_close(SQ[i], sqs[i], rtol=1e-6, atol=1e-9, what=f"rmsprop sq[{i}]")
        if momentum:
            assert_close(BUF[i], bufs[i], rtol=1e-6, atol=1e-7, what=f"rmsprop buf[{i}]")


@given(st.lists(st.integers(0, 50000), min_size=1, max_size=4), st.sampled_from([2.0, 1.0, 3.0, math.inf]),
       st.integers(0, 2**31 - 1))
def test_norm_many_matches_float64(backend, oracle, sizes, norm_type, seed):
    rng = np.random.default_rng(seed)
    xs = [rand(rng, n) for n in sizes]
    want = np.linalg.norm(np.concatenate(xs).astype(np.float64), norm_type) if sum(sizes) else 0.0
    assert oracle.norm_many(xs, norm_type) == pytest.approx(want, rel=1e-12)
    got = [backend.norm_many([backend.asarray(x) for x in xs], norm_type) for _ in range(2)]
    assert got[0] == got[1]  # a fixed reduction order: the same value every time
    assert got[0] == pytest.approx(want, rel=2e-6)
    if backend.name == "openmp":
        with pc.num_threads(1):
            assert backend.norm_many(xs, norm_type) == got[0]  # independent of the thread count


def test_norm_many_propagates_nan(backend):
    x = np.ones(1000, np.float32)
    x[321] = np.nan
    for norm_type in (2.0, 1.5, math.inf):
        assert math.isnan(backend.norm_many([backend.asarray(np.ones(3, np.float32)), backend.asarray(x)], norm_type))


def _grads(backend, rng, scale):
    layer = pc.Linear(30, 20, backend=backend)
    grads = [rand(rng, *p.shape, scale=scale) for p in layer.parameters()]
    for p, g in zip(layer.parameters(), grads):
        p.grad = backend.asarray(g.copy())  # asarray may alias host data, and clipping writes in place
    return layer, grads


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, "inf"])
@pytest.mark.parametrize("clips", [False, True])
def test_clip_grad_norm(backend, norm_type, clips):
    rng = np.random.default_rng(7)
    layer, grads = _grads(backend, rng, 1.0)
    nt = math.inf if norm_type == "inf" else norm_type
    total = np.linalg.norm(np.concatenate([g.reshape(-1) for g in grads]).astype(np.float64), nt)
    max_norm = total * (0.5 if clips else 2.0)
    got = pc.optim.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type)
    assert isinstance(got, float)
    assert got == pytest.approx(total, rel=2e-6)
    coef = min(1.0, max_norm / (got + 1e-6))
    for p, g in zip(layer.parameters(), grads):
        if clips:
            assert_close(p.grad, g * np.float32(coef), rtol=1e-6, atol=0, what="clipped grad")
        else:
            np.testing.assert_array_equal(pc.to_numpy(p.grad), g)


@needs_torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_grad_norm_matches_torch(backend, norm_type):
    import torch

    rng = np.random.default_rng(8)
    layer, grads = _grads(backend, rng, 1.0)
    tparams = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for tp, g in zip(tparams, grads):
        tp.grad = torch.tensor(g)
    want = torch.nn.utils.clip_grad_norm_(tparams, 0.5, norm_type=norm_type)
    got = pc.optim.clip_grad_norm_(layer.parameters(), 0.5, norm_type=norm_type)
    assert got == pytest.approx(float(want), rel=2e-6)
    for p, tp in zip(layer.parameters(), tparams):
        assert_close(p.grad, tp.grad.numpy(), rtol=1e-5, atol=1e-8, what="clipped grad vs torch")


def test_clip_grad_norm_skips_missing_grads_and_takes_one_parameter(backend):
    layer = pc.Linear(3, 2, backend=backend)
    assert pc.optim.clip_grad_norm_(layer.parameters(), 1.0) == 0.0
    layer.bias.grad = backend.asarray(np.array([3.0, 4.0], np.float32))
    assert pc.optim.clip_grad_norm_(layer.bias, 10.0) == pytest.approx(5.0)
    assert pc.optim.clip_grad_norm_(layer.parameters(), 1.0) == pytest.approx(5.0)
    assert_close(layer.bias.grad, np.array([0.6, 0.8], np.float32), rtol=1e-6, atol=0)


def test_opencl_step_and_clip_stay_on_device():
    """A clipped AdamW / RMSprop step on OpenCL copies nothing to the host but the norm scalar."""
    if "opencl" not in pc.available_backends():
        pytest.skip("OpenCL backend not available")
    be = pc.backends.get("opencl")
    rng = np.random.default_rng(9)
    for kind in ("adamw", "rmsprop-momentum-wd", "adam-wd"):
        layer, _ = _grads(be, rng, 1.0)
        opt = _make(kind, layer.parameters())
        opt.step()
        with be.transfers.recording() as log:
            pc.optim.clip_grad_norm_(layer.parameters(), 0.1)
            opt.step()
            be.synchronize()
        assert log.d2h_reasons() == ["norm_many"]
        assert log.d2h_bytes == 4
        assert log.h2d_count == 0


@pytest.mark.parametrize("kind", KINDS + ["sgd"])
def test_optimizer_state_dict_round_trip_continues_exactly(backend, kind):
    """An optimizer rebuilt from a (JSON'd) state dict continues bit for bit as the original."""
    rng = np.random.default_rng(10)
    a = _layer(backend, np.random.default_rng(11))
    opt = _make(kind, a.parameters())
    steps = [[rand(rng, *p.shape) for p in a.parameters()] for _ in range(6)]

    def run(o, layer, gs):
        for grads in gs:
            for p, g in zip(layer.parameters(), grads):
                p.grad = backend.asarray(g)
            o.step()

    run(opt, a, steps[:3])
    state = opt.state_dict()
    state["hyper"] = json.loads(json.dumps(state["hyper"], allow_nan=False))
    saved = [p.numpy() for p in a.parameters()]
    run(opt, a, steps[3:])

    b = _layer(backend, np.random.default_rng(12))
    for p, w in zip(b.parameters(), saved):
        p.data = backend.asarray(w)
    opt2 = _make(kind, b.parameters())
    opt2.lr = 0.5  # restored from the state dict
    opt2.load_state_dict(state)
    assert opt2.hyperparameters() == opt.hyperparameters() and opt2.step_count == 3
    run(opt2, b, steps[3:])
    for pa, pb in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(pb.numpy(), pa.numpy())


def test_hyperparameters_are_settable_and_checked():
    layer = pc.Linear(3, 2, backend="numpy")
    opt = pc.optim.AdamW(layer.parameters())
    assert opt.hyperparameters() == dict(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-2)
    opt.lr = 0.5
    opt.betas = (0.8, 0.9)
    assert opt.lr == 0.5 and opt.betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="AdamW: lr must be >= 0.0, got -1.0"):
        opt.lr = -1
    with pytest.raises(ValueError, match="AdamW: betas\\[0\\] must be < 1.0"):
        opt.betas = (1.0, 0.9)
    assert opt.lr == 0.5  # a rejected value leaves the old one
    rms = pc.optim.RMSprop(layer.parameters())
    assert rms.hyperparameters() == dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0)
    sgd = pc.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        sgd.momentum = 0.0


@pytest.mark.parametrize("call,exc,match", [
    (lambda ps: pc.optim.AdamW(ps, lr="0.1"), TypeError, "AdamW: lr must be a real number, got str"),
    (lambda ps: pc.optim.AdamW(ps, weight_decay=-0.1), ValueError, "AdamW: weight_decay must be >= 0.0"),
    (lambda ps: pc.optim.AdamW(ps, eps=0), ValueError, "AdamW: eps must be > 0.0"),
    (lambda ps: pc.optim.AdamW(ps, betas=0.9), TypeError, "AdamW: betas must be a pair of floats"),
    (lambda ps: pc.optim.Adam(ps, betas=(0.9, 1.5)), ValueError, "Adam: betas\\[1\\] must be < 1.0"),
    (lambda ps: pc.optim.RMSprop(ps, alpha=1.5), ValueError, "RMSprop: alpha must be <= 1.0"),
    (lambda ps: pc.optim.RMSprop(ps, momentum=-0.5), ValueError, "RMSprop: momentum must be >= 0.0"),
    (lambda ps: pc.optim.RMSprop(ps, lr=float("nan")), ValueError, "RMSprop: lr must be finite"),
    (lambda ps: pc.optim.RMSprop([], lr=0.1), ValueError, "RMSprop: params is empty"),
    (lambda ps: pc.optim.RMSprop(3), TypeError, "RMSprop: params must be an iterable of Parameters"),
    (lambda ps: pc.optim.RMSprop([np.zeros(3)]), TypeError, "RMSprop: params\\[0\\] must be a parconv Parameter"),
    (lambda ps: pc.optim.clip_grad_norm_(ps, -1.0), ValueError, "clip_grad_norm_: max_norm must be >= 0.0"),
    (lambda ps: pc.optim.clip_grad_norm_(ps, 1.0, norm_type=0), ValueError, "norm_type must be a number > 0 or inf"),
    (lambda ps: pc.optim.clip_grad_norm_(ps, 1.0, norm_type="two"), ValueError, "norm_type must be a number > 0"),
    (lambda ps: pc.optim.clip_grad_norm_([1.0], 1.0), TypeError, "clip_grad_norm_: params\\[0\\] must be a parconv"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(pc.Linear(3, 2, backend="numpy").parameters())


def test_load_state_dict_checks_before_changing_anything():
    layer = pc.Linear(3, 2, backend="numpy")
    opt = pc.optim.RMSprop(layer.parameters(), momentum=0.9)
    for p in layer.parameters():
        p.grad = np.ones(p.shape, np.float32)
    opt.step()
    good = opt.state_dict()
    bad_cases = [
        ({**good, "hyper": {**good["hyper"], "betas": [0.9, 0.99]}}, ValueError, "unknown hyper-parameters \\['betas'\\]"),
        ({**good, "hyper": {**good["hyper"], "alpha": 2.0}}, ValueError, "alpha must be <= 1.0"),
        ({**good, "state.0.exp_avg": good["state.0.square_avg"]}, ValueError, "unexpected entry 'state.0.exp_avg'"),
        ({**good, "state.0.square_avg": np.zeros(3)}, ValueError, "state.0.square_avg has shape \\(3,\\)"),
        ({**good, "step": -1}, ValueError, "'step' must be an int >= 0"),
        ({k: v for k, v in good.items() if k != "step"}, ValueError, "missing 'step'"),
    ]
    for state, exc, match in bad_cases:
        with pytest.raises(exc, match=match):
            opt.load_state_dict(state)
        after = opt.state_dict()
        assert after["hyper"] == good["hyper"] and after["step"] == 1
        for key in good:
            if key.startswith("state."):
                np.testing.assert_array_equal(after[key], good[key])


def test_many_updates_equal_one_by_one_bitwise(backend):
    """The one-call updates (8 parameters per launch on OpenCL, one loop on openmp) write the
    same bits as the one-parameter updates, so SGD's results do not depend on the path."""
    rng = np.random.default_rng(13)
    sizes = [1, 5000, 3, 0, 40000, 7, 8, 9, 10, 11, 12]
    ps, gs = [rand(rng, n) for n in sizes], [rand(rng, n) for n in sizes]
    s1, s2 = [np.abs(rand(rng, n)) for n in sizes], [np.abs(rand(rng, n)) for n in sizes]

    def arrays(host):
        return [backend.asarray(a.copy()) for a in host]

    for name in ("sgd", "adamw", "rmsprop"):
        one = [arrays(ps), arrays(s1), arrays(s2)]
        many = [arrays(ps), arrays(s1), arrays(s2)]
        G = arrays(gs)
        for i in range(len(sizes)):
            p, a, b = one[0][i], one[1][i], one[2][i]
            if name == "sgd":
                backend.sgd_update(p, G[i], a, 0.1, 0.9, 1e-3, True)
            elif name == "adamw":
                backend.adam_update(p, G[i], a, b, 1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True)
            else:
                backend.rmsprop_update(p, G[i], a, b, 1e-2, 0.99, 1e-8, 1e-3, 0.9)
        if name == "sgd":
            backend.sgd_update_many(many[0], G, many[1], 0.1, 0.9, 1e-3, True)
        elif name == "adamw":
            backend.adam_update_many(many[0], G, many[1], many[2], 1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True)
        else:
            backend.rmsprop_update_many(many[0], G, many[1], many[2], 1e-2, 0.99, 1e-8, 1e-3, 0.9)
        for k in range(3):
            for i in range(len(sizes)):
                np.testing.assert_array_equal(pc.to_numpy(many[k][i]), pc.to_numpy(one[k][i]), err_msg=f"{name} {k} {i}")
