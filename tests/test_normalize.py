"""``pc.Normalize``: input preprocessing that a model carries (saved, loaded, exported to ONNX as Sub/Div),
and ``parconv train`` models that take raw pixels."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import parconv as pc
import parconv.functional as F
from conftest import BACKENDS, assert_close, host, needs_torch



def _ref(x, mean, std):
    x = np.asarray(x, np.float64)
    shape = (1, -1) + (1,) * (x.ndim - 2) if np.size(mean) > 1 else (1,) * x.ndim
    return (x - np.reshape(mean, shape)) / np.reshape(std, shape)


@pytest.mark.parametrize("shape, per_channel", [((3, 4, 5, 6), True), ((3, 4, 5, 6), False), ((5, 7), True),
                                                ((2, 3, 8), True), ((2, 3, 8), False)])
def test_functional_matches_reference(backend, shape, per_channel):
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    c = shape[1] if per_channel else 1
    mean, std = rng.standard_normal(c).astype(np.float32), (0.1 + rng.random(c)).astype(np.float32)
    assert_close(F.normalize(x, mean, std, backend=backend), _ref(x, mean, std), rtol=1e-6, atol=1e-6)
    assert_close(F.normalize_backward(dy, std, backend=backend), _ref(dy, 0 * mean, std), rtol=1e-6, atol=1e-6)


@needs_torch
def test_layer_matches_torch(backend):
    import torch

    rng = np.random.default_rng(1)
    x = rng.random((4, 3, 6, 6), dtype=np.float32)
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]  # CIFAR-10's
    xt = torch.tensor(x, requires_grad=True)
    yt = (xt - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    dy = rng.standard_normal(yt.shape).astype(np.float32)
    yt.backward(torch.tensor(dy))
    layer = pc.Normalize(mean, std, backend=backend)
    assert_close(layer(x), yt.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert_close(layer.backward(dy), xt.grad.numpy(), rtol=1e-6, atol=1e-6)
    assert layer.backward(dy, need_dx=False) is None


def test_layer_state_config_and_save_load(tmp_path, backend):
    model = pc.Sequential(pc.Normalize(0.1307, 0.3081), pc.Flatten(), pc.Linear(16, 3, rng=0), backend=backend)
    state = model.state_dict()
    assert list(state)[:2] == ["0.mean", "0.std"]
    np.testing.assert_array_equal(state["0.std"], np.float32([0.3081]))
    assert model.buffers() and not model[0].parameters()
    x = np.random.default_rng(2).random((5, 1, 4, 4), dtype=np.float32)
    path = tmp_path / "m.npz"
    model.save(path)
    loaded = pc.load(path, backend=backend)
    assert isinstance(loaded[0], pc.Normalize)
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))
    # the buffers are the state: a load_state_dict of other statistics changes the outputs
    other = dict(state, **{"0.mean": np.float32([0.5])})
    loaded.load_state_dict(other)
    assert not np.array_equal(loaded.predict(x), model.predict(x))
    moved = model.to("numpy")
    np.testing.assert_array_equal(host(moved[0].mean), np.float32([0.1307]))


def test_scalar_and_per_channel_broadcast():
    layer = pc.Normalize([0.5, 0.25, 0.0], 0.5, backend="numpy")
    np.testing.assert_array_equal(layer.std, np.float32([0.5, 0.5, 0.5]))
    y = layer(np.ones((1, 3, 1, 1), np.float32))
    np.testing.assert_allclose(y.ravel(), [1.0, 1.5, 2.0])
    assert re.fullmatch(r"Normalize\(mean=\[0.5, 0.25, 0\], std=\[0.5, 0.5, 0.5\]\)", repr(layer))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(mean=0.0, std=0.0), ValueError, r"Normalize: std must be positive.*std\[0\] is 0.0"),
    (dict(mean=0.0, std=[1.0, -2.0]), ValueError, r"std\[1\] is -2.0"),
    (dict(mean=[0.0, 1.0], std=[1.0, 1.0, 1.0]), ValueError, "mean has 2 values and std 3"),
    (dict(mean=float("nan"), std=1.0), ValueError, "mean must be a finite number"),
    (dict(mean=[[0.0]], std=1.0), ValueError, "non-empty 1-D sequence"),
    (dict(mean="a", std=1.0), TypeError, "mean must be a number or a sequence of numbers"),
])
def test_constructor_validates(kwargs, error, message):
    with pytest.raises(error, match=message):
        pc.Normalize(**kwargs, backend="numpy")


def test_forward_validates_input():
    layer = pc.Normalize([0.0, 0.0], [1.0, 1.0], backend="numpy")
    with pytest.raises(ValueError, match="x has 3 channels, expected 2"):
        layer(np.zeros((1, 3, 2, 2), np.float32))
    with pytest.raises(ValueError, match="x must be 2-D"):
        layer(np.zeros((4,), np.float32))
    with pytest.raises(ValueError, match="normalize: x has 3 channels but mean and std have 2 entries"):
        F.normalize(np.zeros((1, 3, 2, 2)), [0.0, 0.0], [1.0, 1.0], backend="numpy")
    with pytest.raises(ValueError, match="normalize: std must be positive"):
        F.normalize(np.zeros((1, 2)), [0.0, 0.0], [1.0, np.nan], backend="numpy")
    # a loaded std of 0 is caught where it is used
    layer.load_state_dict({"mean": np.zeros(2, np.float32), "std": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="std must be positive"):
        layer(np.zeros((1, 2, 2, 2), np.float32))


def test_training_a_model_behind_normalize_equals_training_on_normalised_data(backend):
    """Gradients behind a Normalize are those of the same net on standardised data, and the first
    trainable layer skips its dx (nothing before it needs one)."""
    rng = np.random.default_rng(3)
    x, y = rng.random((8, 1, 6, 6), dtype=np.float32), rng.integers(0, 3, 8)
    mean, std = float(x.mean()), float(x.std())

    def net():
        r = np.random.default_rng(0)
        return [pc.Conv2d(1, 4, 3, rng=r), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(16, 3, rng=r)]

    plain = pc.Sequential(*net(), backend=backend)
    front = pc.Sequential(pc.Normalize(mean, std), *net(), backend=backend)
    loss = pc.SoftmaxCrossEntropy()
    xs = ((x - np.float32(mean)) / np.float32(std)).astype(np.float32)
    loss(plain(xs), y)
    plain.backward(loss.backward())
    calls = []
    first = front.plan()[1].step
    real = first.backward
    first.backward = lambda dy, need_dx=True: calls.append(need_dx) or real(dy, need_dx=need_dx)
    loss(front(x), y)
    assert front.backward(loss.backward()) is None
    assert calls == [False]
    for (name, a), (_, b) in zip(front.named_parameters(), plain.named_parameters()):
        assert_close(a.grad, host(b.grad), rtol=1e-4, atol=1e-5, what=name)
    dx = front.backward(loss.backward(), need_dx=True)
    assert dx is not None and dx.shape == x.shape


# ------------------------------------------------------------------ ONNX
def _ort():
    pytest.importorskip("onnx")
    return pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("mean, std, shape", [(0.1307, 0.3081, (1, 1, 8, 8)),
                                              ([0.5, 0.2], [0.3, 0.1], (1, 2, 8, 8)),
                                              ([0.5, -1.0, 2.0], [2.0, 0.5, 4.0], (1, 3))])
def test_onnx_export_is_sub_div_and_loads_back(tmp_path, backend, mean, std, shape):
    ort = _ort()
    import onnx

    c = shape[1]
    head = [pc.Conv2d(c, 3, 3, rng=0), pc.ReLU(), pc.Flatten(), pc.Linear(3 * 6 * 6, 4, rng=1)] \
        if len(shape) == 4 else [pc.Linear(c, 4, rng=1)]
    model = pc.Sequential(pc.Normalize(mean, std), *head, backend=backend).eval()
    path = str(tmp_path / "m.onnx")
    pc.onnx.export(model, path, shape)
    graph = onnx.load(path).graph
    assert [n.op_type for n in graph.node[:2]] == ["Sub", "Div"]
    assert {"0.mean", "0.std"} <= {t.name for t in graph.initializer}
    x = np.random.default_rng(4).random((5,) + shape[1:], dtype=np.float32)
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert_close(got, model.predict(x), rtol=1e-5, atol=1e-5)
    loaded = pc.onnx.load(path, backend=backend)
    assert isinstance(loaded[0], pc.Normalize) and len(loaded) == len(model)
    assert list(loaded.state_dict()) == list(model.state_dict())
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))


@needs_torch
def test_onnx_load_of_a_torch_normalisation(tmp_path):
    """(x - mean) / std written by torch.onnx.export loads as one Normalize."""
    _ort()
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1))
            self.conv = torch.nn.Conv2d(3, 2, 3)

        def forward(self, x):
            return self.conv((x - self.mean) / self.std)

    net = Net().eval()
    path = str(tmp_path / "t.onnx")
    x = torch.rand(2, 3, 6, 6)
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), path, input_names=["input"], output_names=["output"], opset_version=17,
                          dynamo=False)
    model = pc.onnx.load(path, backend="numpy")
    assert [type(layer).__name__ for layer in model] == ["Normalize", "Conv2d"]
    assert_close(model.predict(x.numpy()), net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_onnx_load_refuses_a_sub_that_is_no_normalisation(tmp_path):
    _ort()
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("Sub", ["input", "c"], ["output"], name="sub")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 4, 4])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3, 4, 4])],
                              initializer=[numpy_helper.from_array(np.zeros((1, 3, 4, 1), np.float32), "c")])
    path = str(tmp_path / "bad.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ValueError, match=r"subtrahend has shape \(1, 3, 4, 1\); parconv loads a constant"):
        pc.onnx.load(path, backend="numpy")


# ------------------------------------------------------------------ parconv train: the saved model takes raw pixels
def _held_out(n_train):
    """The command line's held-out split of the bundled sample, as raw pixels."""
    x, y = pc.datasets.load_mnist("test")
    order = np.random.default_rng(1234).permutation(x.shape[0])
    return x[order[n_train:]], y[order[n_train:]]


@pytest.mark.slow
@pytest.mark.parametrize("model, extra", [("cnn-mnist", ("--filters", "4")), ("lenet5", ("--augment", "--batch-size", "16",
                                                                          "--scheduler", "none", "--lr", "0.05"))])
def test_cli_model_reaches_the_printed_accuracy_on_raw_pixels(tmp_path, capsys, model, extra):
    """What parconv train prints is what pc.load(...).predict, and the ONNX export in onnxruntime, give
    on the raw held-out images."""
    from parconv.cli import main

    n_train = 1000
    ck = tmp_path / "model.npz"
    backend = "openmp" if "openmp" in BACKENDS else "numpy"
    assert main(["train", "--model", model, *extra, "--train-size", str(n_train), "--epochs", "1", "--quiet",
                 "--backend", backend, "--checkpoint", str(ck)]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"test accuracy: ([0-9.]+)%", out).group(1))
    xte, yte = _held_out(n_train)
    loaded = pc.load(ck, backend=backend)
    acc = 100 * float(np.mean(loaded.predict(xte).argmax(axis=1) == yte))
    assert abs(acc - printed) <= 0.1, (acc, printed)
    assert type(loaded[0]).__name__ == "Normalize"
    assert printed > 30  # trained (one short epoch), not a chance-level model that would match either way

    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    onnx_path = tmp_path / "model.onnx"
    assert main(["export", str(ck), str(onnx_path), "--input-shape", "1,1,28,28"]) == 0
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": xte})[0]
    onnx_acc = 100 * float(np.mean(logits.argmax(axis=1) == yte))
    assert abs(onnx_acc - printed) <= 0.1, (onnx_acc, printed)
