"""Sequential end to end: training, fusion, determinism across threads, checkpoints, PyTorch interop."""

import contextlib
import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import parconv as pc
from conftest import assert_close, needs_torch


def small_cnn(backend, seed=0, fuse=True):
    rng = np.random.default_rng(seed)
    return pc.Sequential(pc.Conv2d(1, 4, 3, rng=rng), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                         pc.Linear(4 * 5 * 5, 10, rng=rng), backend=backend, fuse=fuse)


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 12, 12)).astype(np.float32), rng.integers(0, 10, n)


def train_steps(model, steps=3, opt_cls=pc.optim.SGD, n=8, **kw):
    opt = opt_cls(model.parameters(), **(kw or {"lr": 0.1, "momentum": 0.9}))
    loss_fn = pc.SoftmaxCrossEntropy()
    for s in range(steps):
        x, y = batch(n, seed=s)
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_training_step_matches_oracle(backend):
    ref = train_steps(small_cnn("numpy"))
    got = train_steps(small_cnn(backend))
    for k in ref:
        assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, what=k)


def test_fused_and_unfused_models_agree(backend):
    a = train_steps(small_cnn(backend, fuse=True))
    b = train_steps(small_cnn(backend, fuse=False))
    for k in a:
        assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, what=k)


@pytest.mark.parametrize("backend_name", [b for b in pc.available_backends() if b == "openmp"])
def test_thread_counts_agree_and_runs_are_bit_identical(backend_name):
    with pc.num_threads(1):
        one = train_steps(small_cnn(backend_name))
    with pc.num_threads(2):
        two = train_steps(small_cnn(backend_name))
        two_again = train_steps(small_cnn(backend_name))
    for k in one:
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_array_equal(two[k], two_again[k], err_msg=k)


@contextlib.contextmanager
def busy_neighbours(k: int, seconds: float = 60.0):
    """``k`` other processes spinning in pure Python (each stops by itself after ``seconds``)."""
    code = (f"import time\nend = time.monotonic() + {seconds}\nprint('ready', flush=True)\n"
            "while time.monotonic() < end:\n    pass\n")
    procs = []
    try:
        for _ in range(k):
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
        for p in procs:  # spinning before the block starts
            assert p.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def small_bn_cnn(backend, seed=0):
    """Big enough at batch 32 for every layer to run on two threads (batch norm, Winograd, pooling)."""
    rng = np.random.default_rng(seed)
    return pc.Sequential(pc.Conv2d(1, 16, 3, padding=1, rng=rng), pc.BatchNorm2d(16), pc.ReLU(),
                         pc.Conv2d(16, 16, 3, padding=1, rng=rng), pc.BatchNorm2d(16), pc.ReLU(), pc.MaxPool2d(2),
                         pc.Flatten(), pc.Linear(16 * 6 * 6, 64, rng=rng), pc.ReLU(), pc.Linear(64, 10, rng=rng),
                         backend=backend)


@pytest.mark.parametrize("backend_name", [b for b in pc.available_backends() if b == "openmp"])
@pytest.mark.parametrize("busy", [1, 2])
def test_runs_are_bit_identical_with_busy_neighbours(backend_name, busy):
    # blocks are handed to whichever thread is free; with other processes taking the cores the
    # assignment differs from run to run, the bits must not
    nets = ((small_cnn, 8), (small_bn_cnn, 32))
    with pc.num_threads(2):
        quiet = [train_steps(build(backend_name), n=n) for build, n in nets]
        with busy_neighbours(busy):
            loaded = [[train_steps(build(backend_name), n=n) for _ in range(4)] for build, n in nets]
    for want, runs in zip(quiet, loaded):
        for got in runs:
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.skipif("openmp" not in pc.available_backends() or not os.path.exists("/proc/loadavg"),
                    reason="needs the openmp backend and /proc")
def test_default_threads_cap_their_teams_under_load_and_keep_the_bits(monkeypatch):
    # no count chosen: with two busy neighbours each region runs on fewer threads than the count
    # (the cap is the online cores less the busy tasks), and the bits are those of that count on a
    # quiet machine
    from parconv import _config

    n = _config._cpu_count()
    if n < 2:
        pytest.skip("one core: nothing to cap")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    nets = ((small_cnn, 8), (small_bn_cnn, 32))
    with pc.num_threads(n):
        quiet = [train_steps(build("openmp"), n=k) for build, k in nets]
    caps = set()
    with pc.num_threads(None), busy_neighbours(2):
        deadline = time.monotonic() + 20  # the cap follows readings 30 ms apart: a few steps
        for i in itertools.count():
            if i >= 3 and (caps - {0} or time.monotonic() > deadline or (os.cpu_count() or n) != n):
                break
            loaded = []
            for build, k in nets:
                loaded.append(train_steps(build("openmp"), n=k))
                caps.add(_config.team_limit())
            for want, got in zip(quiet, loaded):
                for key in want:
                    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    if (os.cpu_count() or n) == n:  # two busy tasks leave fewer than n of the online cores free
        assert caps & set(range(1, n)), caps  # the cap did engage
    with pc.num_threads(n):
        assert pc.get_num_threads() == n  # the next op under a chosen count ...
        assert _config.team_limit() == 0  # ... lifts the cap


def test_backward_returns_dx_and_grads_overwrite(backend):
    model = small_cnn(backend)
    loss_fn = pc.SoftmaxCrossEntropy()
    x, y = batch()
    loss_fn(model(x), y)
    dx = model.backward(loss_fn.backward(), need_dx=True)
    assert tuple(dx.shape) == x.shape
    g1 = [pc.to_numpy(p.grad).copy() for p in model.parameters()]
    loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    for a, p in zip(g1, model.parameters()):
        # overwritten, not doubled; the two backwards may take different kernels for the first
        # layer's dw (with need_dx the fused one does not run), so they agree to rounding, not bits
        np.testing.assert_allclose(pc.to_numpy(p.grad), a, rtol=1e-5, atol=1e-7)


def test_fit_learns_quadrants_mlp(backend):
    x, y = pc.datasets.quadrants(512, seed=0)
    rng = np.random.default_rng(0)
    model = pc.Sequential(pc.Linear(2, 16, rng=rng), pc.ReLU(), pc.Linear(16, 1, rng=rng), pc.Sigmoid(),
                          backend=backend)
    opt = pc.optim.Adam(model.parameters(), lr=0.05)
    hist = model.fit(x, y, epochs=40, batch_size=64, optimizer=opt, loss=pc.BCELoss(), verbose=False, seed=0)
    assert hist["loss"][-1] < hist["loss"][0]
    assert hist["accuracy"][-1] > 0.9
    res = model.evaluate(x, y, loss=pc.BCELoss())
    assert res["accuracy"] > 0.9


def test_fit_with_validation_and_history(backend):
    x, y = pc.datasets.load_mnist("test")
    model = small_cnn(backend)
    xs = x[:300, :, 8:20, 8:20]
    hist = model.fit(xs, y[:300], epochs=2, batch_size=50, validation_data=(xs[:100], y[:100]), verbose=False)
    assert set(hist.history) >= {"loss", "accuracy", "val_loss", "val_accuracy", "samples_per_s"}
    assert len(hist["loss"]) == 2 and hist.epochs == [1, 2]
    pred = model.predict(xs[:7], batch_size=3)
    assert pred.shape == (7, 10) and isinstance(pred, np.ndarray)


def test_batch_size_one_and_noncontiguous_float64_inputs(backend):
    model = small_cnn(backend)
    x, y = batch(4)
    x64 = np.asfortranarray(x.astype(np.float64))
    out32 = pc.to_numpy(model(x))
    out64 = pc.to_numpy(model(x64))
    np.testing.assert_allclose(out64, out32, rtol=1e-6)
    strided = np.repeat(x, 2, axis=3)[:, :, :, ::2]  # a non-contiguous view equal to x
    np.testing.assert_allclose(pc.to_numpy(model(strided)), out32, rtol=1e-6)
    model.fit(x[:1], y[:1], epochs=1, batch_size=1, verbose=False)


def test_save_load_round_trip(backend, tmp_path):
    model = small_cnn(backend)
    train_steps(model, 1)
    path = tmp_path / "m.npz"
    model.save(path)
    loaded = pc.load(path, backend=backend)
    x, _ = batch()
    assert_close(loaded(x), pc.to_numpy(model(x)), rtol=1e-6, atol=1e-7)
    assert [type(a) for a in loaded] == [type(b) for b in model]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".parconv-")]  # no temp files left


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    model = small_cnn("numpy")
    path = tmp_path / "m.npz"
    model.save(path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(KeyboardInterrupt):
        model.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.npz"]


def test_model_moves_between_backends(backend):
    model = small_cnn("numpy")
    x, _ = batch()
    ref = pc.to_numpy(model(x)).copy()
    model.to(backend)
    assert model.backend is backend
    assert_close(model(x), ref, rtol=1e-5, atol=1e-6)


def test_non_finite_loss_stops_and_keeps_last_good_weights(backend):
    # Two stacked linear layers with no activation between them: each one's gradient grows with the
    # other's weights, so lr=1e12 overflows within a few steps on any machine (a ReLU could instead
    # die and leave a finite loss, depending on the rounding of the first step).
    rng = np.random.default_rng(0)
    model = pc.Sequential(pc.Flatten(), pc.Linear(144, 16, rng=rng), pc.Linear(16, 10, rng=rng), backend=backend)
    x, y = batch(16)
    opt = pc.optim.SGD(model.parameters(), lr=1e12)
    with pytest.raises(pc.TrainingDivergedError, match="loss became"):
        model.fit(x, y, epochs=5, batch_size=4, optimizer=opt, verbose=False)
    for p in model.parameters():
        assert np.isfinite(pc.to_numpy(p.data)).all()


@needs_torch
def test_state_dict_moves_to_and_from_torch(backend):
    import torch

    model = small_cnn(backend)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(100, 10))
    net.load_state_dict({k: torch.tensor(v) for k, v in model.state_dict().items()})
    x, _ = batch()
    assert_close(model(x), net(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    torch.manual_seed(3)
    net2 = torch.nn.Sequential(*[type(m)(*a) for m, a in [(net[0], (1, 4, 3)), (net[1], ()), (net[2], (2,)),
                                                           (net[3], ()), (net[4], (100, 10))]])
    model.load_state_dict(net2.state_dict())
    assert_close(model(x), net2(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def wide_head_cnn(backend, fuse=True):
    """A first layer whose 16 x 13 x 13 = 2704 pooled features feed a 10-class head: wide enough
    for the OpenMP backend to fuse the head into the convolution layer."""
    rng = np.random.default_rng(7)
    return pc.Sequential(pc.Conv2d(1, 16, 3, rng=rng), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                         pc.Linear(16 * 13 * 13, 10, rng=rng), backend=backend, fuse=fuse)


def test_fused_head_trains_like_the_unfused_model(backend):
    """Where the backend fuses the Flatten -> Linear head into the fused layer the steps run as
    one op (a 5-layer range of the plan); the weights after a few steps match the unfused model."""
    rng = np.random.default_rng(3)
    models = [wide_head_cnn(backend), wide_head_cnn(backend, fuse=False), wide_head_cnn("numpy", fuse=False)]
    be = models[0].backend
    assert [(s.start, s.stop) for s in models[0].plan()] == ([(0, 5)] if be.fuses_linear_head(2704, 10) else [(0, 3), (3, 4), (4, 5)])
    assert [(s.start, s.stop) for s in models[1].plan()] == [(i, i + 1) for i in range(5)]
    order = []
    models[0].register_grad_hook(lambda idx, params: order.append(idx))
    loss_fn = pc.SoftmaxCrossEntropy()
    opts = [pc.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(3):
        x = rng.standard_normal((5, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, 5)
        for m, opt in zip(models, opts):
            loss_fn(m(x), y)
            dx = m.backward(loss_fn.backward(), need_dx=step == 2)
            assert dx is None or tuple(dx.shape) == x.shape
            opt.step()
            opt.zero_grad()
    assert order == [4, 0] * 3  # the head's gradients are ready (and reduced) first
    want = models[2].state_dict()
    for m in models[:2]:
        got = m.state_dict()
        for k in want:
            assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, what=k)


def test_fused_head_backward_before_forward_is_an_error(backend):
    model = wide_head_cnn(backend)
    with pytest.raises(ValueError, match="forward"):
        model.backward(np.zeros((2, 10), np.float32))
    model(np.zeros((2, 1, 28, 28), np.float32))
    with pytest.raises(ValueError, match="dy must have"):
        model.backward(np.zeros((3, 10), np.float32))
