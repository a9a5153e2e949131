"""ONNX export and import: onnxruntime runs exported models to parconv's outputs; graphs from both
PyTorch exporters load into parconv and give PyTorch's outputs on every backend."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
from conftest import HAVE_TORCH, assert_close, needs_torch

onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install 'parconv[onnx]')")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (test oracle)")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import parconv.onnx as pox  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


# ---------------------------------------------------------------- helpers
def randomize_state(model, seed=0):
    """Random weights and BatchNorm statistics (running_var > 0), so BN is not the identity."""
    rng = np.random.default_rng(seed)
    state = model.state_dict()
    for k, v in state.items():
        if k.endswith("num_batches_tracked"):
            continue
        if k.endswith("running_var") or k.endswith(".std"):  # BatchNorm variance, Normalize's std: > 0
            state[k] = rng.uniform(0.5, 2.0, v.shape).astype(np.float32)
        elif k.endswith("running_mean") or k.endswith(".bias"):
            state[k] = rng.uniform(-0.5, 0.5, v.shape).astype(np.float32)
        elif k.endswith(".weight") and v.ndim == 1:  # BatchNorm scale
            state[k] = rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
        else:
            state[k] = (rng.standard_normal(v.shape) / np.sqrt(max(1, v[0].size))).astype(np.float32)
    model.load_state_dict(state)
    return model


def run_ort(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: np.asarray(x, np.float32)})[0]


def parconv_out(model, x):
    return np.asarray(pc.to_numpy(model(x)))


def mlp():
    return pc.Sequential(pc.Linear(20, 32), pc.ReLU(), pc.Dropout(0.3), pc.Linear(32, 16), pc.Tanh(),
                         pc.Linear(16, 8), pc.layers.ELU(0.5), pc.Linear(8, 4), pc.Softmax(dim=1))


def cnn():
    return pc.Sequential(pc.Conv2d(1, 6, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(6 * 5 * 5, 10))


def resnet_like():
    block = pc.Residual(pc.Sequential(pc.Conv2d(8, 8, 3, padding=1, bias=False), pc.BatchNorm2d(8), pc.ReLU(),
                                      pc.Conv2d(8, 8, 3, padding=1, bias=False), pc.BatchNorm2d(8)))
    down = pc.Residual(pc.Sequential(pc.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), pc.BatchNorm2d(16),
                                     pc.LeakyReLU(0.1), pc.Conv2d(16, 16, 3, padding=1)),
                       pc.Sequential(pc.Conv2d(8, 16, 1, stride=2, bias=False), pc.BatchNorm2d(16)))
    # SyncBatchNorm on one process is BatchNorm2d, and exports as one
    return pc.Sequential(pc.Conv2d(3, 8, 3, padding=1, bias=False), pc.SyncBatchNorm(8), pc.ReLU(), block, pc.ReLU(),
                         down, pc.ReLU(), pc.AdaptiveAvgPool2d(1), pc.Flatten(), pc.Dropout(0.5), pc.Linear(16, 10))


def convs():
    """Input normalisation; grouped, depthwise, dilated, rectangular and asymmetric 'same' convolutions, padded pooling."""
    return pc.Sequential(
        pc.Normalize([0.1, 0.2, 0.3, 0.4], [0.5, 1.0, 1.5, 2.0]),
        pc.Conv2d(4, 8, (3, 2), stride=(1, 2), padding=(1, 0), groups=2), pc.Sigmoid(),
        pc.Conv2d(8, 8, 4, padding="same", groups=8), pc.BatchNorm2d(8),  # even kernel: pads 1 top, 2 bottom
        pc.Conv2d(8, 6, 3, padding="same", dilation=2), pc.Tanh(),
        pc.MaxPool2d(3, stride=2, padding=1), pc.AvgPool2d(3, stride=1, padding=1), pc.Identity(),
        pc.AdaptiveAvgPool2d((2, 1)), pc.Flatten(), pc.BatchNorm1d(12), pc.Linear(12, 5), pc.LeakyReLU(0.2))


MODELS = {
    "mlp": (mlp, (1, 20)),
    "cnn": (cnn, (1, 1, 12, 12)),
    "resnet_like": (resnet_like, (1, 3, 12, 12)),
    "convs": (convs, (1, 4, 12, 10)),
}

ZOO = {"cnn_mnist": (1, 28, 28), "lenet5": (1, 28, 28), "vgg_small": (3, 32, 32), "resnet20": (3, 32, 32),
       "mobilenet_small": (3, 32, 32)}


def zoo_params():
    models = getattr(pc, "models", None)
    return [pytest.param(name, marks=pytest.mark.skipif(not hasattr(models, name), reason=f"pc.models.{name} missing"))
            for name in ZOO]


def build(name, seed=0):
    if name in MODELS:
        pc.manual_seed(seed)
        model, shape = MODELS[name][0](), MODELS[name][1]
    else:
        model, shape = getattr(pc.models, name)(), (1,) + ZOO[name]
    return randomize_state(model.to("numpy"), seed).eval(), shape


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every test model exported once (at batch 1): name -> (model, path, input shape)."""
    cache = {}

    def get(name):
        if name not in cache:
            model, shape = build(name)
            path = tmp_path_factory.mktemp("onnx") / f"{name}.onnx"
            pox.export(model, path, shape)
            cache[name] = (model, path, shape)
        return cache[name]

    return get


def batch(shape, n=3, seed=1):
    return np.random.default_rng(seed).standard_normal((n,) + tuple(shape[1:])).astype(np.float32)


# ------------------------------------------------------------ export -> onnxruntime
@pytest.mark.parametrize("name", list(MODELS) + zoo_params())
def test_onnxruntime_matches_parconv_at_another_batch_size(exported, name):
    model, path, shape = exported(name)
    x = batch(shape, n=3)
    assert_close(run_ort(path, x), parconv_out(model, x), RTOL, ATOL, f"{name}: onnxruntime vs parconv")


@pytest.mark.parametrize("name", list(MODELS) + zoo_params())
def test_exported_file_loads_back_on_every_backend(exported, name, backend):
    model, path, shape = exported(name)
    x = batch(shape, n=2, seed=2)
    loaded = pox.load(path, backend=backend)
    assert loaded.backend is backend
    assert not loaded.training
    assert_close(parconv_out(loaded, x), parconv_out(model, x), RTOL, ATOL, f"{name} loaded on {backend.name}")


def test_export_from_every_backend(tmp_path, backend):
    model, shape = build("resnet_like", seed=6)
    model.to(backend)
    pox.export(model, tmp_path / "m.onnx", shape)
    x = batch(shape, n=2, seed=3)
    assert_close(run_ort(tmp_path / "m.onnx", x), parconv_out(model, x), RTOL, ATOL, backend.name)


def test_graph_names_keep_the_layer_structure(exported):
    model, path, _ = exported("resnet_like")
    proto = onnx.load(str(path))
    assert proto.opset_import[0].version == pox.OPSET == 17
    inits = {t.name for t in proto.graph.initializer}
    expected = {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    assert inits == expected, inits ^ expected
    names = [n.name for n in proto.graph.node]
    for want in ("0/Conv", "1/BatchNormalization", "3.body.0/Conv", "3.body.4/BatchNormalization", "3/Add",
                 "5.shortcut.0/Conv", "7/GlobalAveragePool", "9/Dropout", "10/Gemm"):
        assert want in names, names
    assert proto.graph.node[-1].name == "10/Gemm" and proto.graph.node[-1].output[0] == "output"
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and [d.dim_value for d in dims[1:]] == [3, 12, 12]
    out_dims = proto.graph.output[0].type.tensor_type.shape.dim
    assert out_dims[0].dim_param == "N" and out_dims[1].dim_value == 10


def test_state_dict_keys_survive_a_round_trip(exported):
    model, path, _ = exported("resnet_like")
    loaded = pox.load(path, backend="numpy")
    assert list(loaded.state_dict()) == list(model.state_dict())
    # a SyncBatchNorm exports as BatchNormalization and comes back as the BatchNorm2d it is on one process
    kinds = lambda m: ["BatchNorm2d" if type(x).__name__ == "SyncBatchNorm" else type(x).__name__  # noqa: E731
                       for x in m.modules()]
    assert kinds(loaded) == kinds(model)
    for k, v in model.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)


@given(k=st.integers(1, 4), stride=st.integers(1, 2), pad=st.integers(0, 2), dil=st.integers(1, 2),
       groups=st.sampled_from([1, 2]), same=st.booleans(), size=st.integers(6, 11), n=st.integers(1, 4))
def test_random_convolutions_export_and_load(tmp_path_factory, k, stride, pad, dil, groups, same, size, n):
    padding = "same" if same else min(pad, k // 2)
    stride = 1 if same else stride
    if not same and dil * (k - 1) + 1 > size + 2 * padding:
        return
    pc.manual_seed(k * 7 + size)
    model = pc.Sequential(pc.Conv2d(2, 4, k, stride=stride, padding=padding, dilation=dil, groups=groups),
                          pc.ReLU(), backend="numpy").eval()
    path = tmp_path_factory.mktemp("conv") / "conv.onnx"
    pox.export(model, path, (1, 2, size, size))
    x = batch((1, 2, size, size), n=n, seed=size)
    expected = parconv_out(model, x)
    assert_close(run_ort(path, x), expected, RTOL, ATOL, "onnxruntime")
    assert_close(parconv_out(pox.load(path, backend="numpy"), x), expected, RTOL, ATOL, "loaded")


# ------------------------------------------------------------------ export details
def test_training_mode_is_exported_as_eval_with_a_warning(tmp_path):
    pc.manual_seed(3)
    model = randomize_state(resnet_like().to("numpy"))
    assert model.training
    with pytest.warns(UserWarning, match="training mode"):
        pox.export(model, tmp_path / "m.onnx", (1, 3, 12, 12))
    assert model.training and all(m.training for m in model.modules())
    x = batch((1, 3, 12, 12), n=2)
    expected = parconv_out(model.eval(), x)
    assert_close(run_ort(tmp_path / "m.onnx", x), expected, RTOL, ATOL)


def test_eval_model_exports_without_a_warning(tmp_path):
    model, shape = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pox.export(model, tmp_path / "m.onnx", shape)


def test_export_writes_atomically_with_the_umask_mode(tmp_path):
    model, shape = build("mlp")
    old = os.umask(0o027)
    try:
        pox.export(model, tmp_path / "m.onnx", shape)
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "m.onnx").st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]
    before = (tmp_path / "m.onnx").read_bytes()
    bad = pc.Sequential(pc.Flatten(), pc.Linear(20, 3), pc.AdaptiveAvgPool2d(1), backend="numpy").eval()
    with pytest.raises(ValueError):
        pox.export(bad, tmp_path / "m.onnx", shape)
    assert (tmp_path / "m.onnx").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_adaptive_pool_sizes(tmp_path):
    model = pc.Sequential(pc.Conv2d(1, 2, 1), pc.AdaptiveAvgPool2d((3, 2)), backend="numpy").eval()
    pox.export(model, tmp_path / "ok.onnx", (1, 1, 9, 4))
    x = batch((1, 1, 9, 4), n=2)
    assert_close(run_ort(tmp_path / "ok.onnx", x), parconv_out(model, x), RTOL, ATOL)
    with pytest.raises(ValueError, match="AdaptiveAvgPool2d '1'.*output_size"):
        pox.export(model, tmp_path / "bad.onnx", (1, 1, 10, 4))
    assert not (tmp_path / "bad.onnx").exists()


def test_batchnorm_without_running_stats_normalises_with_the_batch(tmp_path):
    pc.manual_seed(2)
    model = randomize_state(pc.Sequential(
        pc.Conv2d(2, 3, 3), pc.BatchNorm2d(3, track_running_stats=False), pc.Flatten(), pc.Linear(48, 5),
        pc.BatchNorm1d(5, affine=False, track_running_stats=False), backend="numpy")).eval()
    pox.export(model, tmp_path / "m.onnx", (2, 2, 6, 6))  # batch statistics need a batch of 2 or more
    x = batch((1, 2, 6, 6), n=4)
    assert_close(run_ort(tmp_path / "m.onnx", x), parconv_out(model, x), RTOL, ATOL)
    with pytest.raises(ValueError, match="'ReduceMean'|not supported"):  # load takes running statistics only
        pox.load(tmp_path / "m.onnx")


@pytest.mark.parametrize("shape, error", [((1, 20, 0), ValueError), ((20,), ValueError), ("1,20", TypeError),
                                          ((1.0, 20), ValueError), (None, TypeError)])
def test_export_validates_input_shape(tmp_path, shape, error):
    model, _ = build("mlp")
    with pytest.raises(error, match="input_shape"):
        pox.export(model, tmp_path / "m.onnx", shape)


def test_export_validates_model_and_path(tmp_path):
    with pytest.raises(TypeError, match="model must be"):
        pox.export(object(), tmp_path / "m.onnx", (1, 2))
    with pytest.raises(TypeError, match="path must be"):
        pox.export(build("mlp")[0], 3, (1, 20))
    with pytest.raises(ValueError):  # the model does not take this shape
        pox.export(build("mlp")[0], tmp_path / "m.onnx", (1, 21))


# ---------------------------------------------------------------- PyTorch's exporters
if HAVE_TORCH:
    import torch
    from torch import nn

    class TorchResidual(nn.Module):
        def __init__(self, body, shortcut=None):
            super().__init__()
            self.body, self.shortcut = body, shortcut

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    class TorchNormalize(nn.Module):
        """torchvision's Normalize with parconv's buffer names, so state dicts match."""

        def __init__(self, channels):
            super().__init__()
            self.register_buffer("mean", torch.zeros(channels))
            self.register_buffer("std", torch.ones(channels))

        def forward(self, x):
            return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)

    def torch_twin(name):
        """The PyTorch model with parconv's test model's structure (state-dict keys match)."""
        if name == "mlp":
            return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 16), nn.Tanh(),
                                 nn.Linear(16, 8), nn.ELU(0.5), nn.Linear(8, 4), nn.Softmax(dim=1))
        if name == "cnn":
            return nn.Sequential(nn.Conv2d(1, 6, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(150, 10))
        if name == "resnet_like":
            block = TorchResidual(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                                nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                                nn.BatchNorm2d(8)))
            down = TorchResidual(
                nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                              nn.LeakyReLU(0.1), nn.Conv2d(16, 16, 3, padding=1)),
                nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16)))
            return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), block,
                                 nn.ReLU(), down, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5),
                                 nn.Linear(16, 10))
        # onnxruntime has no dilated auto_pad SAME Conv, which the TorchScript exporter writes for
        # padding="same" with dilation, so the dilated convolution here pads explicitly
        return nn.Sequential(
            TorchNormalize(4),
            nn.Conv2d(4, 8, (3, 2), stride=(1, 2), padding=(1, 0), groups=2), nn.Sigmoid(),
            nn.Conv2d(8, 8, 4, padding="same", groups=8), nn.BatchNorm2d(8),
            nn.Conv2d(8, 6, 3, padding=2, dilation=2), nn.Tanh(),
            nn.MaxPool2d(3, stride=2, padding=1), nn.AvgPool2d(3, stride=1, padding=1), nn.Identity(),
            nn.AdaptiveAvgPool2d((2, 1)), nn.Flatten(), nn.BatchNorm1d(12), nn.Linear(12, 5), nn.LeakyReLU(0.2))

    def torch_model(name, seed=0):
        pc_model, shape = build(name, seed)
        net = torch_twin(name)
        net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in pc_model.state_dict().items()},
                            strict=True)
        return net.eval(), shape


@pytest.fixture(scope="module")
def torch_exported(tmp_path_factory):
    """PyTorch twins of the test models exported once per (model, exporter, folding)."""
    cache = {}

    def get(name, dynamo, fold=True):
        key = (name, dynamo, fold)
        if key not in cache:
            net, shape = torch_model(name)
            path = tmp_path_factory.mktemp("torch") / f"{name}-{'dynamo' if dynamo else 'ts'}-{fold}.onnx"
            example = (torch.from_numpy(batch(shape, n=2, seed=5)),)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if dynamo:
                    pytest.importorskip("onnxscript", reason="the default torch.onnx exporter needs onnxscript")
                    torch.onnx.export(net, example, str(path), dynamo=True,
                                      dynamic_shapes=({0: torch.export.Dim("N", min=2, max=64)},),
                                      verbose=False)
                else:
                    torch.onnx.export(net, example, str(path), dynamo=False, opset_version=17,
                                      do_constant_folding=fold, input_names=["input"], output_names=["output"],
                                      dynamic_axes={"input": {0: "N"}, "output": {0: "N"}})
            cache[key] = (net, path, shape)
        return cache[key]

    return get


@needs_torch
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fold", [True, False], ids=["bn-folded", "bn-kept"])
def test_torchscript_export_loads_and_matches_pytorch(torch_exported, name, fold, backend):
    net, path, shape = torch_exported(name, dynamo=False, fold=fold)
    if not fold and name == "resnet_like":
        ops = {n.op_type for n in onnx.load(str(path)).graph.node}
        assert "BatchNormalization" in ops
    x = batch(shape, n=3, seed=6)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    assert_close(parconv_out(pox.load(path, backend=backend), x), expected, RTOL, ATOL, f"{name} on {backend.name}")


@needs_torch
@pytest.mark.parametrize("name", ["resnet_like"])  # the exporter takes seconds per model
def test_default_torch_exporter_loads_and_matches_pytorch(torch_exported, name):
    net, path, shape = torch_exported(name, dynamo=True)
    x = batch(shape, n=3, seed=7)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    for be in pc.available_backends():
        assert_close(parconv_out(pox.load(path, backend=be), x), expected, RTOL, ATOL, f"{name} on {be}")


@needs_torch
@pytest.mark.parametrize("name", zoo_params())
def test_zoo_twins_exported_by_pytorch_load_and_match(tmp_path_factory, name, backend, _zoo_cache={}):
    torch_twin = pytest.importorskip("torch_twin", reason="tests/torch_twin.py builds the zoo's PyTorch twins")
    if name not in _zoo_cache:  # one export per network, loaded on every backend
        model, shape = build(name, seed=4)
        net = torch_twin.twin(model).eval()
        x = batch(shape, n=3, seed=8)
        with torch.no_grad():
            expected = net(torch.from_numpy(x)).numpy()
        path = tmp_path_factory.mktemp("zoo") / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (torch.from_numpy(x[:1]),), str(path), dynamo=False, opset_version=17,
                              input_names=["input"], dynamic_axes={"input": {0: "N"}})
        _zoo_cache[name] = (path, x, expected)
    path, x, expected = _zoo_cache[name]
    assert_close(parconv_out(pox.load(path, backend=backend), x), expected, RTOL, ATOL, f"{name} on {backend.name}")


def _export_twin_with_default_exporter(name, path):
    """Export zoo network ``name``'s PyTorch twin to ``path`` with the default (torch.export-based)
    exporter; returns the input batch and the twin's logits for it."""
    pytest.importorskip("onnxscript", reason="the default torch.onnx exporter needs onnxscript")
    torch_twin = pytest.importorskip("torch_twin", reason="tests/torch_twin.py builds the zoo's PyTorch twins")
    model, shape = build(name, seed=5)
    net = torch_twin.twin(model).eval()
    x = batch(shape, n=2, seed=9)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.from_numpy(x),), str(path), dynamo=True, verbose=False)
    return x, expected


@needs_torch
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PARCONV_SLOW_TESTS"),
                    reason="the default exporter takes ~20 s on resnet20; set PARCONV_SLOW_TESTS=1 to run it")
@pytest.mark.parametrize("name", zoo_params())
def test_zoo_from_the_default_exporter(tmp_path, name):
    """Every zoo network's PyTorch twin through the default (torch.export-based) exporter."""
    x, expected = _export_twin_with_default_exporter(name, tmp_path / "net.onnx")
    for be in pc.available_backends():
        assert_close(parconv_out(pox.load(tmp_path / "net.onnx", backend=be), x), expected, RTOL, ATOL,
                     f"{name} on {be}")


@needs_torch
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PARCONV_SLOW_TESTS"),
                    reason="the default exporter takes ~20 s on resnet20; set PARCONV_SLOW_TESTS=1 to run it")
def test_zoo_resnet20_from_the_default_exporter(tmp_path):
    x, expected = _export_twin_with_default_exporter("resnet20", tmp_path / "r20.onnx")
    proto = onnx.load(str(tmp_path / "r20.onnx"))
    assert {"ReduceMean", "Add"} <= {n.op_type for n in proto.graph.node}
    loaded = pox.load(tmp_path / "r20.onnx", backend="numpy")
    assert sum(type(m).__name__ == "Residual" for m in loaded.modules()) == 9
    assert_close(parconv_out(loaded, x), expected, RTOL, ATOL)


@needs_torch
def test_gelu_from_pytorch_is_refused_naming_erf(tmp_path):
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(net, (torch.zeros(1, 4),), str(tmp_path / "gelu.onnx"), dynamo=False, opset_version=17)
    with pytest.raises(ValueError, match=r"'Erf'.*GELU.*supported ops: Conv"):
        pox.load(tmp_path / "gelu.onnx")


# ------------------------------------------------------------ hand-written graphs
def make_model(nodes, inits, in_shape, out_shape, opset=17, path=None):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
    return path


def test_matmul_add_and_a_dynamic_reshape_load(tmp_path):
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((12, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["mm"]),
        helper.make_node("Add", ["b", "mm"], ["y"]),  # bias first: still the bias
    ]
    inits = {"zero": np.array(0, np.int64), "axes0": np.array([0], np.int64), "minus1": np.array([-1], np.int64),
             "w": w, "b": b}
    path = make_model(nodes, inits, ["N", 3, 2, 2], ["N", 5], path=tmp_path / "mm.onnx")
    model = pox.load(path, backend="numpy")
    assert [type(m).__name__ for m in model.layers] == ["Flatten", "Linear"]
    x = batch((1, 3, 2, 2), n=4)
    assert_close(parconv_out(model, x), x.reshape(4, 12) @ w + b, RTOL, ATOL)
    assert_close(run_ort(path, x), x.reshape(4, 12) @ w + b, RTOL, ATOL)


def test_reduce_mean_and_squeeze_load_as_global_pooling(tmp_path):
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
             helper.make_node("Squeeze", ["m", "axes"], ["y"])]
    path = make_model(nodes, {"axes": np.array([-1, -2], np.int64)}, ["N", 3, 4, 5], ["N", 3], opset=18,
                      path=tmp_path / "rm.onnx")
    x = batch((1, 3, 4, 5), n=2)
    for be in pc.available_backends():
        assert_close(parconv_out(pox.load(path, backend=be), x), x.mean(axis=(2, 3)), RTOL, ATOL, be)


@pytest.mark.parametrize("node, inits, match", [
    (helper.make_node("Erf", ["x"], ["y"], name="gelu/Erf"), {}, r"node 'gelu/Erf' \(Erf\).*GELU.*supported ops"),
    (helper.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], ceil_mode=1), {},
     r"node 'p' \(MaxPool\): attribute ceil_mode=1 .*supported: 0"),
    (helper.make_node("AveragePool", ["x"], ["y"], name="p", kernel_shape=[3, 3], pads=[1, 1, 1, 1]), {},
     r"count_include_pad"),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c", pads=[0, 0, 2, 0]),
     {"w": np.ones((3, 3, 3, 3), np.float32)}, r"node 'c' \(Conv\): attribute pads=\[0, 0, 2, 0\]"),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c3"), {"w": np.ones((3, 3, 1), np.float32)}, r"2-D"),
    (helper.make_node("Mul", ["x", "x"], ["y"], name="sq"), {}, r"node 'sq' \(Mul\)"),
    (helper.make_node("Softmax", ["x"], ["y"], name="s", axis=1), {}, None),
])
def test_unsupported_ops_and_attributes_are_refused(tmp_path, node, inits, match):
    path = make_model([node], inits, ["N", 3, 6, 6], ["N", "C", "P", "Q"], path=tmp_path / "bad.onnx")
    if match is None:  # the control: a supported node loads
        assert type(pox.load(path, backend="numpy").layers[0]).__name__ == "Softmax"
        return
    with pytest.raises(ValueError, match=match) as err:
        pox.load(path, backend="numpy")
    assert "bad.onnx" in str(err.value)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "VALID"])
def test_conv_auto_pad(tmp_path, auto_pad):
    # the TorchScript exporter writes padding="same" with dilation as auto_pad=SAME_UPPER
    w = np.random.default_rng(3).standard_normal((2, 3, 4, 4)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, dilations=[2, 1])
    path = make_model([node], {"w": w}, ["N", 3, 9, 8], ["N", 2, "P", "Q"], path=tmp_path / "c.onnx")
    conv = pc.Conv2d(3, 2, 4, padding="same" if auto_pad == "SAME_UPPER" else "valid", dilation=(2, 1), bias=False,
                     backend="numpy")
    conv.load_state_dict({"weight": w})
    x = batch((1, 3, 9, 8), n=2)
    assert_close(parconv_out(pox.load(path, backend="numpy"), x), parconv_out(conv, x), RTOL, ATOL)


def test_a_join_other_than_add_is_refused(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("Sigmoid", ["x"], ["b"], name="s"),
             helper.make_node("MatMul", ["a", "b"], ["y"], name="gram")]
    path = make_model(nodes, {}, ["N", 4], ["N", 4], path=tmp_path / "gram.onnx")
    with pytest.raises(ValueError, match=r"node 'gram' \(MatMul\): joins the branches.*only an Add"):
        pox.load(path)


def test_add_of_x_and_x_is_a_residual(tmp_path):
    path = make_model([helper.make_node("Add", ["x", "x"], ["y"])], {}, ["N", 4], ["N", 4], path=tmp_path / "a.onnx")
    x = batch((1, 4), n=3)
    assert_close(parconv_out(pox.load(path, backend="numpy"), x), 2 * x, RTOL, ATOL)


# ------------------------------------------------------------------ bad files
def test_corrupt_and_truncated_files_are_clear_errors(tmp_path, exported):
    _, good, _ = exported("cnn")
    data = good.read_bytes()
    cases = {"empty.onnx": b"", "text.onnx": b"this is not a protobuf\n" * 20,
             "noise.onnx": np.random.default_rng(0).bytes(4000)}
    for cut in (1, 7, len(data) // 3, len(data) // 2, len(data) - 5):
        cases[f"cut{cut}.onnx"] = data[:cut]
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            pox.load(tmp_path / name, backend="numpy")
    with pytest.raises(FileNotFoundError):
        pox.load(tmp_path / "missing.onnx")
    with pytest.raises(TypeError, match="path must be"):
        pox.load(123)


# ------------------------------------------------------------------ packaging, CLI
def test_docstring_examples():
    result = doctest.testmod(pox, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.attempted > 0 and result.failed == 0


def test_import_parconv_does_not_import_onnx():
    code = "import sys, parconv; assert 'onnx' not in sys.modules; parconv.onnx; assert 'onnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_onnx_the_error_says_what_to_install():
    code = ("import sys; sys.modules['onnx'] = None\n"  # as if onnx were not installed
            "import parconv as pc\n"
            "try:\n    pc.onnx.load('m.onnx')\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert 'pip install "parconv[onnx]"' in out


def test_cli_export(tmp_path):
    from parconv.cli import main

    model, shape = build("cnn")
    model.save(tmp_path / "cnn.npz")
    assert main(["export", str(tmp_path / "cnn.npz"), str(tmp_path / "cnn.onnx"), "--input-shape", "1,1,12,12"]) == 0
    x = batch(shape, n=2)
    assert_close(run_ort(tmp_path / "cnn.onnx", x), parconv_out(model, x), RTOL, ATOL)
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "cnn.npz"), str(tmp_path / "x.onnx"), "--input-shape", "1,a"])
    assert main(["export", str(tmp_path / "cnn.npz"), str(tmp_path / "x.onnx"), "--input-shape", "1,1,2,2"]) == 2
    assert not (tmp_path / "x.onnx").exists()
