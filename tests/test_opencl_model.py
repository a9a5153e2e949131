"""Whole-model behaviour on the OpenCL backend: residency, training parity with openmp, checkpoints."""

import numpy as np
import pytest

import parconv as pc

pytestmark = pytest.mark.skipif("opencl" not in pc.available_backends(), reason="no OpenCL device")


def test_training_steps_only_bring_back_loss_and_metrics():
    be = pc.backends.get("opencl")
    model = pc.Sequential(pc.Conv2d(1, 4, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(4 * 5 * 5, 10),
                          pc.Sigmoid(), pc.Linear(10, 10), backend="opencl")
    opt = pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = pc.SoftmaxCrossEntropy()
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 1, 12, 12)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(3)]
    with be.transfers.recording():
        for x, y in batches:
            loss = loss_fn(model(x), y)
            assert isinstance(loss, float)
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
    assert be.transfers.d2h_reasons() == ["softmax_cross_entropy_forward"] * 3
    # what went up: each batch's inputs and labels, and the optimizer's zero-initialised state on the first step
    assert be.transfers.h2d_bytes < 3 * (8 * 144 * 4 + 8 * 4) + 4 * sum(p.size for p in model.parameters()) + 4096


def test_fit_step_residency():
    """``fit`` itself brings back one loss and one accuracy count per step."""
    be = pc.backends.get("opencl")
    x, y = pc.datasets.load_mnist("test")
    model = pc.Sequential(pc.Conv2d(1, 4, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(4 * 13 * 13, 10),
                          backend="opencl")
    # fit checks the device first (once per device, model and batch sizes): its copies are not the steps'
    model.fit(x[:30], y[:30], epochs=1, batch_size=10, verbose=False, shuffle=False)
    with be.transfers.recording():
        model.fit(x[:30], y[:30], epochs=1, batch_size=10, verbose=False, shuffle=False)
    reasons = be.transfers.d2h_reasons()
    assert sorted(set(reasons)) == ["count_correct", "softmax_cross_entropy_forward"], reasons
    assert len(reasons) == 6


def test_one_epoch_cnn_mnist_matches_openmp_accuracy():
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp backend not built")
    from parconv.cli import build_cnn

    x, y = pc.datasets.load_mnist("test")
    order = np.random.default_rng(1234).permutation(len(x))
    tr, te = order[:8000], order[8000:]
    x = (x - x[tr].mean()) / x[tr].std()  # as parconv train does
    accs = {}
    for name in ("openmp", "opencl"):
        model = build_cnn(32, backend=name, seed=0)
        opt = pc.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        model.fit(x[tr], y[tr], epochs=1, batch_size=100, optimizer=opt, seed=0, verbose=False)
        accs[name] = model.evaluate(x[te], y[te])["accuracy"]
    assert accs["openmp"] > 0.93
    assert abs(accs["opencl"] - accs["openmp"]) <= 0.005, accs


def test_save_and_load_an_opencl_model(tmp_path):
    model = pc.Sequential(pc.Flatten(), pc.Linear(16, 3), backend="opencl")
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4)).astype(np.float32)
    ref = pc.to_numpy(model(x))
    model.save(tmp_path / "m.npz")
    loaded = pc.load(tmp_path / "m.npz", backend="opencl")
    assert loaded.backend.name == "opencl"
    np.testing.assert_allclose(pc.to_numpy(loaded(x)), ref, rtol=1e-6)
    on_cpu = pc.load(tmp_path / "m.npz", backend="numpy")
    np.testing.assert_allclose(on_cpu(x), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet20", "mobilenet-small", "vgg-small"])
def test_zoo_training_steps_stay_on_the_device(name):
    """BatchNorm (with its running statistics), Dropout, residual adds, depthwise and strided
    convolutions, adaptive pooling: a training step brings back only the loss, and uploads only
    the batch (and the optimizer's zero state once)."""
    be = pc.backends.get("opencl")
    model = pc.models.build(name, (3, 16, 16), backend="opencl", rng=0)
    opt = pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = pc.SoftmaxCrossEntropy()
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 4)) for _ in range(2)]
    with be.transfers.recording():
        for x, y in batches:
            assert isinstance(loss_fn(model(x), y), float)
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
    assert be.transfers.d2h_reasons() == ["softmax_cross_entropy_forward"] * 2
    params = sum(p.size for p in model.parameters())
    assert be.transfers.h2d_bytes < 2 * (4 * 3 * 16 * 16 * 4 + 4 * 4) + 4 * params + 4096


def test_fit_refuses_a_device_that_computes_wrong_results(monkeypatch):
    be = pc.backends.get("opencl")
    model = pc.Sequential(pc.Flatten(), pc.Linear(16, 3), backend="opencl")

    def broken(probe=None, key=None):
        raise RuntimeError(f"{be!r} computes linear wrongly")

    monkeypatch.setattr(be, "verify", broken)
    x, y = np.zeros((4, 1, 4, 4), np.float32), np.zeros(4, np.int64)
    before = model.state_dict()
    with pytest.raises(RuntimeError, match="computes linear wrongly"):
        model.fit(x, y, verbose=False, optimizer=pc.optim.SGD(model.parameters(), lr=0.1))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
