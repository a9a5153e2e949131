"""PyTorch habits that work: ``to("cpu")``/``cpu()``, ``no_grad`` and friends, ``zero_grad``,
``load_state_dict(strict=False)``, ``CrossEntropyLoss`` and an argument-less ``summary()``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import parconv as pc
from conftest import assert_close, host, needs_torch
from parconv._grad import NOT_SAVED


def _net(backend, seed=0):
    """Every kind of cached activation: a fused conv+ReLU+pool, BatchNorm+ReLU, a residual block with a
    tail BatchNorm, Dropout, an activation keeping its output and a Linear keeping its input."""
    g = np.random.default_rng(seed)
    body = pc.Sequential(pc.Conv2d(4, 4, 3, padding=1, bias=False, rng=g), pc.BatchNorm2d(4), pc.ReLU(),
                         pc.Conv2d(4, 4, 3, padding=1, bias=False, rng=g), pc.BatchNorm2d(4))
    return pc.Sequential(
        pc.Conv2d(1, 4, 3, padding=1, rng=g), pc.ReLU(), pc.MaxPool2d(2),
        pc.Residual(body), pc.ReLU(), pc.Conv2d(4, 4, 1, rng=g), pc.BatchNorm2d(4), pc.ReLU(),
        pc.Flatten(), pc.Dropout(0.25, rng=1), pc.Linear(64, 8, rng=g), pc.Tanh(), pc.Linear(8, 3, rng=g),
        backend=backend)


def _holders(model):
    """Every object with a ``_cache``: the layers and the fused steps of the last plan."""
    return list(model.modules()) + [s.step for s in model.plan()]


def _x(n=4, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 1, 8, 8)).astype(np.float32)


# ---------------------------------------------------------------------------- to("cpu") / cpu()
def test_cpu_is_the_default_cpu_backend(backend):
    expected = "openmp" if "openmp" in pc.available_backends() else "numpy"
    assert pc.backends.get("cpu").name == expected
    model = _net(backend).eval()
    ref = host(model(_x()))
    assert model.to("cpu") is model and model.backend.name == expected
    assert all(p.backend.name == expected for p in model.parameters())
    assert_close(model(_x()), ref, rtol=1e-4, atol=1e-5)
    model.to(backend)
    assert model.cpu() is model and model.backend.name == expected
    layer = pc.Linear(3, 2, backend=backend).cpu()
    assert layer.weight.backend.name == expected
    assert pc.Sequential(pc.Linear(3, 2), backend="cpu").backend.name == expected


# ---------------------------------------------------------------------------- no_grad
def test_no_grad_forward_keeps_nothing_and_backward_says_why(backend):
    model = _net(backend)
    x = _x()
    model.eval()
    with pc.no_grad():
        assert not pc.is_grad_enabled()
        y_eval = host(model(x))
    assert_close(model(x), y_eval, rtol=1e-5, atol=1e-6)  # the same outputs as with gradients on
    model.train()
    with pc.no_grad():
        model(x)
    assert pc.is_grad_enabled()
    for h in _holders(model):
        assert h._cache is None or h._cache is NOT_SAVED, (h, type(h._cache))
    assert any(h._cache is NOT_SAVED for h in _holders(model))
    dy = np.ones((4, 3), np.float32)
    with pytest.raises(RuntimeError, match=r"no_grad\(\).*outside no_grad"):
        model.backward(dy)
    # backward works again after a forward pass with gradients on
    model.train()
    model(x)
    model.backward(dy)
    assert all(p.grad is not None for p in model.parameters())


def test_no_grad_losses_keep_nothing(backend):
    loss_fn = pc.CrossEntropyLoss()
    logits = backend.asarray(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))
    with pc.no_grad():
        value = loss_fn(logits, [0, 1, 2, 0])
    assert value == pytest.approx(loss_fn(logits, [0, 1, 2, 0]))
    with pc.no_grad():
        loss_fn(logits, [0, 1, 2, 0])
    with pytest.raises(RuntimeError, match="no_grad"):
        loss_fn.backward()


def test_predict_and_evaluate_hold_no_activations(backend):
    model = _net(backend)
    x, y = _x(8), np.arange(8) % 3
    out = model.predict(x, batch_size=4)
    assert out.shape == (8, 3)
    model.evaluate(x, y, batch_size=4)
    for h in _holders(model):
        assert h._cache is None or h._cache is NOT_SAVED, (h, type(h._cache))
    assert model.training  # mode restored


def test_fit_refuses_to_run_under_no_grad(backend):
    model = pc.Sequential(pc.Flatten(), pc.Linear(64, 3), backend=backend)
    with pc.no_grad(), pytest.raises(RuntimeError, match="fit: called under parconv.no_grad"):
        model.fit(_x(8), np.arange(8) % 3, epochs=1, batch_size=4, verbose=False)
    model.fit(_x(8), np.arange(8) % 3, epochs=1, batch_size=4, verbose=False)


def test_grad_mode_context_managers_and_decorators():
    assert pc.is_grad_enabled()

    @pc.no_grad
    def bare():
        return pc.is_grad_enabled()

    @pc.no_grad()
    def called():
        return pc.is_grad_enabled()

    @pc.no_grad()
    def gen():
        yield pc.is_grad_enabled()
        yield pc.is_grad_enabled()

    assert bare() is False and called() is False and pc.is_grad_enabled()
    g = gen()
    assert next(g) is False
    assert pc.is_grad_enabled()  # the caller runs with its own mode between the generator's steps
    assert next(g) is False
    with pc.no_grad():
        with pc.enable_grad():
            assert pc.is_grad_enabled()
        assert not pc.is_grad_enabled()
        ctx = pc.no_grad()
        with ctx:
            with ctx:  # reentrant
                assert not pc.is_grad_enabled()
        assert not pc.is_grad_enabled()
    assert pc.is_grad_enabled()
    with pc.set_grad_enabled(False):
        assert not pc.is_grad_enabled()
    assert pc.is_grad_enabled()
    try:
        pc.set_grad_enabled(False)  # a plain call lasts
        assert not pc.is_grad_enabled()
    finally:
        pc.set_grad_enabled(True)

    @pc.set_grad_enabled(False)
    def off():
        return pc.is_grad_enabled()

    assert pc.is_grad_enabled() and off() is False and pc.is_grad_enabled()
    with pytest.raises(TypeError, match="mode must be a bool"):
        pc.set_grad_enabled("no")
    with pytest.raises(TypeError, match="can decorate a function"):
        pc.no_grad()(3)


def test_grad_mode_is_per_thread():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        seen["worker_start"] = pc.is_grad_enabled()
        with pc.no_grad():
            inside.set()
            release.wait(10)
            seen["worker_inside"] = pc.is_grad_enabled()

    t = threading.Thread(target=worker)
    with pc.no_grad():
        t.start()
        assert inside.wait(10)
        assert not pc.is_grad_enabled()
    seen["main_while_worker_in_no_grad"] = pc.is_grad_enabled()
    release.set()
    t.join(10)
    assert seen == {"worker_start": True, "worker_inside": False, "main_while_worker_in_no_grad": True}


# ---------------------------------------------------------------------------- zero_grad
def test_zero_grad_on_models_and_layers(backend):
    model = _net(backend)
    model(_x())
    model.backward(np.ones((4, 3), np.float32))
    params = model.parameters()
    assert all(p.grad is not None for p in params)
    model.zero_grad(set_to_none=False)
    for p in params:
        assert np.all(host(p.grad) == 0) and host(p.grad).shape == p.shape
    grads = [p.grad for p in params]
    model(_x())
    model.backward(np.ones((4, 3), np.float32))
    model.zero_grad(set_to_none=False)
    assert all(host(p.grad).max() == 0 for p in params)
    model.layers[-1].zero_grad()  # one layer: only its own
    assert model.layers[-1].weight.grad is None and model.layers[0].weight.grad is not None
    model.zero_grad()  # PyTorch's default: set_to_none=True, as Optimizer.zero_grad
    assert all(p.grad is None for p in params)
    assert len(grads) == len(params)
    with pytest.raises(TypeError, match="set_to_none must be a bool"):
        model.zero_grad(set_to_none=0)


def test_optimizer_zero_grad_takes_set_to_none_too(backend):
    model = _net(backend)
    opt = pc.optim.SGD(model.parameters(), lr=0.1)
    model(_x())
    model.backward(np.ones((4, 3), np.float32))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not host(p.grad).any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="SGD.zero_grad: set_to_none must be a bool"):
        opt.zero_grad(set_to_none=None)


def test_zero_grad_set_to_none_false_zeroes_in_place():
    layer = pc.Linear(3, 2, backend="numpy")
    layer(np.ones((2, 3), np.float32))
    layer.backward(np.ones((2, 2), np.float32))
    g = layer.weight.grad
    layer.zero_grad(set_to_none=False)
    assert layer.weight.grad is g and not g.any()


# ---------------------------------------------------------------------------- load_state_dict
def test_load_state_dict_strict_false_reports_keys(backend):
    model = _net(backend)
    other = _net(backend, seed=5)
    state = other.state_dict()
    state.pop("0.bias")
    state.pop("6.running_var")
    state["head.weight"] = np.ones(3, np.float32)
    before = model.state_dict()
    result = model.load_state_dict(state, strict=False)
    assert result == (["0.bias", "6.running_var"], ["head.weight"])
    assert result.missing_keys == ["0.bias", "6.running_var"] and result.unexpected_keys == ["head.weight"]
    after = model.state_dict()
    np.testing.assert_array_equal(after["0.weight"], state["0.weight"])
    np.testing.assert_array_equal(after["0.bias"], before["0.bias"])  # missing: left as it was
    np.testing.assert_array_equal(after["6.running_var"], before["6.running_var"])
    np.testing.assert_array_equal(after["6.running_mean"], state["6.running_mean"])


def test_load_state_dict_strict_raises_on_both_and_returns_empty_keys(backend):
    model = _net(backend)
    state = model.state_dict()
    result = model.load_state_dict(state)
    assert result == ([], []) and repr(result) == "<All keys matched successfully>"
    bad = dict(state)
    bad.pop("0.bias")
    bad["extra"] = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match=r"missing keys \['0.bias'\] and unexpected keys \['extra'\]"):
        model.load_state_dict(bad)
    wrong = dict(state)
    wrong["0.weight"] = np.zeros((4, 1, 2, 2), np.float32)
    with pytest.raises(ValueError, match="0.weight"):
        model.load_state_dict(wrong, strict=False)  # shapes are checked even when not strict
    np.testing.assert_array_equal(model.state_dict()["0.weight"], state["0.weight"])
    with pytest.raises(TypeError, match="strict must be a bool"):
        model.load_state_dict(state, strict="no")


# ---------------------------------------------------------------------------- CrossEntropyLoss
def test_cross_entropy_loss_is_softmax_cross_entropy(backend):
    assert pc.CrossEntropyLoss is pc.SoftmaxCrossEntropy
    logits = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    labels = np.array([0, 3, 1, 2, 3])
    a = pc.CrossEntropyLoss(label_smoothing=0.1)
    b = pc.SoftmaxCrossEntropy(label_smoothing=0.1)
    assert a(backend.asarray(logits), labels) == pytest.approx(b(backend.asarray(logits), labels), rel=1e-6)
    assert_close(a.backward(), host(b.backward()))


@needs_torch
def test_cross_entropy_loss_matches_torch():
    import torch

    logits = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    labels = np.array([0, 4, 1, 2, 3, 0])
    for s in (0.0, 0.2):
        ours = pc.CrossEntropyLoss(label_smoothing=s)(logits, labels)
        theirs = torch.nn.CrossEntropyLoss(label_smoothing=s)(torch.from_numpy(logits), torch.from_numpy(labels))
        assert ours == pytest.approx(float(theirs), rel=1e-5)


# ---------------------------------------------------------------------------- summary()
@pytest.mark.parametrize("name", sorted(pc.models.ZOO))
def test_zoo_models_summarise_without_an_argument(name, capsys):
    builder, shape = pc.models.ZOO[name]
    model = builder(backend="numpy", rng=0)
    assert model.input_shape == shape
    assert model.summary() is None  # printed, not also returned: a REPL shows it once
    printed = capsys.readouterr().out
    assert printed.count("forward multiply-adds") == 1
    assert printed == model.summary(shape, print_fn=None) + "\n"
    assert pc.models.build(name, (3, 24, 24) if shape[0] == 3 else (1, 28, 28), rng=0).input_shape[1:] == \
        ((24, 24) if shape[0] == 3 else (28, 28))


def test_summary_input_shape_errors_and_persistence(tmp_path, capsys):
    model = pc.Sequential(pc.Flatten(), pc.Linear(12, 3), backend="numpy")
    assert model.input_shape is None
    with pytest.raises(ValueError, match="does not know its input shape"):
        model.summary()
    lines = []
    assert model.summary((3, 2, 2), print_fn=lines.append) is None and len(lines) == 1
    with pytest.raises(TypeError, match="print_fn must be a callable"):
        model.summary((3, 2, 2), print_fn="stdout")
    model.input_shape = (3, 2, 2)
    model.summary()
    assert capsys.readouterr().out.count("parameters:") == 1
    model.save(tmp_path / "m.npz")
    assert pc.load(tmp_path / "m.npz").input_shape == (3, 2, 2)
    for bad in ((0, 2, 2), (1, 3, 2, 2), (2.0,), "1,2,2"):
        with pytest.raises((ValueError, TypeError), match="input_shape"):
            model.input_shape = bad
