"""Bad input fails with a clear ValueError/TypeError naming the argument, on every backend."""

import gzip
import struct

import numpy as np
import pytest

import parconv as pc
import parconv.functional as F


def cnn(backend):
    return pc.Sequential(pc.Conv2d(1, 2, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(2 * 3 * 3, 4),
                         backend=backend)


X = np.zeros((2, 1, 8, 8), np.float32)


@pytest.mark.parametrize("x, exc, match", [
    (np.zeros((1, 8, 8)), ValueError, r"x must be 4-D \(N, C, H, W\), got shape \(1, 8, 8\)"),
    (np.zeros((2, 3, 8, 8)), ValueError, "x has 3 channels but weight expects 1"),
    (np.zeros((2, 1, 8, 8), np.complex64), TypeError, "real-valued, got complex"),
    (np.array([["a"]]), TypeError, "numeric array, got dtype <U1"),
    (np.zeros((0, 1, 8, 8)), ValueError, "zero-sized"),
    (np.zeros((2, 1, 2, 2)), ValueError, "kernel 3x3 is larger than the padded input 2x2"),
])
def test_conv_layer_rejects_bad_input(backend, x, exc, match):
    with pytest.raises(exc, match=match):
        pc.Conv2d(1, 2, 3, backend=backend)(x)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(stride=0), ValueError, "stride must be >= 1, got 0"),
    (dict(stride=-1), ValueError, "stride must be >= 1, got -1"),
    (dict(padding=-1), ValueError, "padding must be >= 0, got -1"),
    (dict(stride=1.5), TypeError, "stride must be an int, got float"),
])
def test_functional_conv_rejects_bad_hyperparameters(backend, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        F.conv2d(X, np.zeros((2, 1, 3, 3)), backend=backend, **kwargs)


@pytest.mark.parametrize("args, exc, match", [
    ((1, 2, 3), ValueError, None),
    ((0, 2, 3), ValueError, "in_channels must be >= 1, got 0"),
    ((1, 0, 3), ValueError, "out_channels must be >= 1, got 0"),
    ((1, 2, 0), ValueError, "kernel_size must be >= 1, got 0"),
])
def test_conv_layer_constructor_checks(args, exc, match):
    if match is None:
        with pytest.raises(exc, match="stride must be >= 1"):
            pc.Conv2d(*args, stride=0)
        with pytest.raises(exc, match="padding must be >= 0"):
            pc.Conv2d(*args, padding=-2)
    else:
        with pytest.raises(exc, match=match):
            pc.Conv2d(*args)


def test_linear_and_pool_errors(backend):
    lin = pc.Linear(5, 3, backend=backend)
    with pytest.raises(ValueError, match="x has 4 features, expected in_features=5"):
        lin(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"x must be 2-D .* \(add a Flatten"):
        lin(np.zeros((2, 5, 1)))
    with pytest.raises(ValueError, match="kernel_size 3 is larger than the input 2x2"):
        pc.MaxPool2d(3, backend=backend)(np.zeros((1, 1, 2, 2)))
    with pytest.raises(ValueError, match="stride must be >= 1, got 0"):
        pc.MaxPool2d(2, stride=0)
    with pytest.raises(ValueError, match="in_features must be >= 1, got 0"):
        pc.Linear(0, 3)
    with pytest.raises(ValueError, match="zero-sized"):
        pc.ReLU(backend=backend)(np.zeros((0, 3)))


def test_pool_backward_argmax_is_checked_before_any_kernel_scatters_through_it(backend):
    """The kernels scatter through argmax with bounds checks off: bad indices, dtypes and shapes
    are refused at the functional boundary, for maxpool2d and the fused op."""
    be = pc.backends.get(backend)
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    y, am = F.maxpool2d(x, 2, return_indices=True, backend=backend)
    dy = be.asarray(np.ones((2, 3, 3, 3), np.float32))
    bad = pc.to_numpy(am).astype(np.int64)
    for value, dtype in ((36, np.int32), (-1, np.int32), (36, np.uint16), (65535, np.uint16)):
        bad[1, 2, 2, 2] = value
        if be.host_arrays:
            with pytest.raises(ValueError, match=r"argmax holds indices outside \[0, 36\)"):
                F.maxpool2d_backward(dy, be.asarray(bad.astype(dtype), dtype), (2, 3, 6, 6), backend=backend)
        else:
            # device indices are not copied to the host to be checked: the kernel skips them
            dx = pc.to_numpy(F.maxpool2d_backward(dy, be.asarray(bad.astype(dtype), dtype), (2, 3, 6, 6),
                                                  backend=backend))
            assert dx[1, 2].sum() == 8 and dx.sum() == 2 * 3 * 9 - 1
    with pytest.raises(TypeError, match=r"argmax must be the integer \(int32 or uint16\) backend array"):
        F.maxpool2d_backward(dy, be.asarray(pc.to_numpy(am).astype(np.float32)), (2, 3, 6, 6), backend=backend)
    with pytest.raises(ValueError, match="argmax shape"):
        F.maxpool2d_backward(dy, be.asarray(pc.to_numpy(am)[:1].copy(), np.int32), (2, 3, 6, 6), backend=backend)

    w = be.asarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    y, am = F.conv2d_relu_maxpool2d(x, w, padding=1, backend=backend)  # conv (2, 4, 6, 6) -> pooled 3x3
    dy = be.asarray(np.ones((2, 4, 3, 3), np.float32))
    bad = pc.to_numpy(am).copy()
    bad[0, 0, 0, 0] = 36
    if be.host_arrays:
        with pytest.raises(ValueError, match=r"argmax holds indices outside \[0, 36\)"):
            F.conv2d_relu_maxpool2d_backward(x, w, y, be.asarray(bad, np.int32), dy, padding=1, backend=backend)
    with pytest.raises(ValueError, match="is not a pooled output"):
        F.conv2d_relu_maxpool2d_backward(x, w, be.asarray(np.ones((2, 5, 3, 3), np.float32)), am, dy,
                                         padding=1, backend=backend)
    dx, dw, db = F.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, padding=1, backend=backend)
    assert shape_of_all(dx, dw, db) == [(2, 3, 6, 6), (4, 3, 3, 3), (4,)]


def shape_of_all(*arrays):
    return [tuple(a.shape) for a in arrays]


@pytest.mark.parametrize("labels, exc, match", [
    ([0, 4], ValueError, r"labels must be in \[0, 4\), found 4"),
    ([-1, 0], ValueError, r"labels must be in \[0, 4\), found -1"),
    ([0], ValueError, "got 1 labels for a batch of 2 logits"),
    ([0.0, 1.0], TypeError, "labels must hold integers, got dtype float64"),
    (["a", "b"], TypeError, "labels must hold integers"),
    ([[0, 1]], ValueError, "labels must be 1-D"),
])
def test_softmax_cross_entropy_rejects_bad_labels(backend, labels, exc, match):
    with pytest.raises(exc, match=match):
        pc.SoftmaxCrossEntropy()(backend.asarray(np.zeros((2, 4), np.float32)), labels)


def test_bce_target_errors(backend):
    p = backend.asarray(np.full((3, 1), 0.5, np.float32))
    with pytest.raises(ValueError, match=r"targets shape \(3,\) must equal the probabilities' shape \(3, 1\)"):
        pc.BCELoss()(p, np.zeros(3))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1\]"):
        pc.BCELoss()(p, np.full((3, 1), 2.0))
    with pytest.raises(ValueError, match="eps must be > 0.0"):
        pc.BCELoss(eps=0)


def test_backward_before_forward_and_wrong_gradient(backend):
    conv = pc.Conv2d(1, 2, 3, backend=backend)
    with pytest.raises(ValueError, match="backward called before forward"):
        conv.backward(np.zeros((2, 2, 6, 6)))
    conv(X)
    with pytest.raises(ValueError, match=r"dy must have the output's shape \(2, 2, 6, 6\), got \(2, 2, 5, 5\)"):
        conv.backward(np.zeros((2, 2, 5, 5)))
    model = cnn(backend)
    with pytest.raises(ValueError, match="no forward pass|before forward"):
        model.backward(np.zeros((2, 4)))
    model(X)
    with pytest.raises(ValueError, match=r"dy must have the output's shape \(2, 4\), got \(2, 5\)"):
        model.backward(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="backward called before the loss was computed"):
        pc.SoftmaxCrossEntropy().backward()


def test_load_state_dict_errors(backend):
    model = cnn(backend)
    state = model.state_dict()
    before = {k: v.copy() for k, v in state.items()}
    missing = dict(state)
    missing.pop("4.bias")
    with pytest.raises(ValueError, match=r"missing keys \['4.bias'\]"):
        model.load_state_dict(missing)
    wrong = dict(state, **{"0.weight": np.zeros((2, 1, 5, 5))})
    with pytest.raises(ValueError, match=r"0.weight has shape \(2, 1, 5, 5\), expected \(2, 1, 3, 3\)"):
        model.load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"unexpected keys \['9.weight'\]"):
        model.load_state_dict(dict(state, **{"9.weight": np.zeros(1)}))
    for k, v in model.state_dict().items():  # a failed load changes nothing
        np.testing.assert_array_equal(v, before[k])


def test_corrupt_and_truncated_checkpoints(tmp_path):
    model = cnn("numpy")
    good = tmp_path / "good.npz"
    model.save(good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.npz.*not a readable parconv checkpoint"):
        pc.load(truncated)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is not a zip file at all")
    with pytest.raises(ValueError, match="garbage.npz"):
        pc.load(garbage)
    plain = tmp_path / "plain.npz"
    np.savez(plain, a=np.zeros(3))
    with pytest.raises(ValueError, match="not a parconv checkpoint"):
        pc.load(plain)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pc.load(tmp_path / "missing.npz")
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, __parconv__=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="pickled.npz"):
        pc.load(pickled)


def _idx_bytes(arr, type_code=0x08):
    return struct.pack(">HBB", 0, type_code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def test_corrupt_and_truncated_idx_files(tmp_path):
    from parconv.datasets import IDXError, read_idx

    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    good = tmp_path / "good.idx"
    good.write_bytes(_idx_bytes(arr))
    np.testing.assert_array_equal(read_idx(good), arr)
    gz = tmp_path / "good.idx.gz"
    gz.write_bytes(gzip.compress(_idx_bytes(arr)))
    np.testing.assert_array_equal(read_idx(gz), arr)
    cases = {
        "short.idx": _idx_bytes(arr)[:-5],
        "long.idx": _idx_bytes(arr) + b"\0",
        "magic.idx": b"\x01\x02" + _idx_bytes(arr)[2:],
        "type.idx": _idx_bytes(arr)[:2] + b"\x42" + _idx_bytes(arr)[3:],
        "tiny.idx": b"\0\0",
        "bad.gz": gzip.compress(_idx_bytes(arr))[:-10],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(IDXError, match=name):
            read_idx(tmp_path / name)


def test_threads_and_optimizer_hyperparameters():
    with pytest.raises(ValueError, match="n must be a positive int or None, got 0"):
        pc.set_num_threads(0)
    with pytest.raises(TypeError, match="positive int or None"):
        pc.set_num_threads(1.5)
    params = pc.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match="lr must be >= 0.0, got -0.1"):
        pc.optim.SGD(params, lr=-0.1)
    with pytest.raises(ValueError, match="lr must be >= 0.0, got -1.0"):
        pc.optim.Adam(params, lr=-1.0)
    with pytest.raises(ValueError, match="lr must be finite"):
        pc.optim.SGD(params, lr=float("nan"))
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        pc.optim.SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"betas\[1\] must be < 1.0"):
        pc.optim.Adam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="params is empty"):
        pc.optim.SGD([], lr=0.1)


def test_fit_argument_errors(backend):
    model = cnn(backend)
    y = np.array([0, 1])
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        model.fit(X, y, batch_size=0, verbose=False)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        model.fit(X, y, epochs=0, verbose=False)
    with pytest.raises(ValueError, match=r"y must be \(N,\) = \(2,\) integer labels, got shape \(3,\)"):
        model.fit(X, [0, 1, 2], verbose=False)
    with pytest.raises(TypeError, match="y must hold integers"):
        model.fit(X, [0.5, 1.0], verbose=False)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 4\), found 7"):
        model.fit(X, [0, 7], verbose=False)
    with pytest.raises(TypeError, match="x must be real-valued"):
        model.fit(X.astype(np.complex64), y, verbose=False)


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*available here: \[.*'numpy'"):
        pc.set_backend("nope")
    with pytest.raises(TypeError, match="backend must be a str name"):
        pc.backends.get(3)


def test_backend_lacking_an_op_names_both():
    from parconv.backends.base import Backend

    class Partial(Backend):
        name = "partial"

    with pytest.raises(NotImplementedError, match="backend 'partial' does not implement conv2d_forward"):
        Partial().conv2d_forward(None, None, None, 1, 0)


# ------------------------------------------------------------------ what is reported is what users get

def bn_cnn(backend):
    return pc.Sequential(pc.Conv2d(1, 2, 3), pc.BatchNorm2d(2), pc.ReLU(), pc.Flatten(), pc.Linear(2 * 6 * 6, 4),
                         backend=backend)


@pytest.mark.parametrize("key, value, match", [
    ("1.running_mean", np.nan, r"1\.running_mean must be finite .*got nan at index 1"),
    ("1.running_var", np.nan, r"1\.running_var must be finite and non-negative .*got nan at index 1"),
    ("1.running_var", -0.5, r"1\.running_var must be finite and non-negative .*got -0\.5 at index 1"),
    ("1.running_var", np.inf, r"1\.running_var must be finite and non-negative .*got inf"),
])
def test_nan_or_negative_batchnorm_statistics_are_refused(tmp_path, backend, key, value, match):
    # they loaded silently, then evaluate gave loss nan and chance accuracy
    model = bn_cnn(backend)
    state = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    before = {k: v.copy() for k, v in state.items()}
    state[key][1] = value
    with pytest.raises(ValueError, match=match):
        model.load_state_dict(state)
    for k, v in model.state_dict().items():  # refused before anything was written
        np.testing.assert_array_equal(v, before[k])
    path = tmp_path / "bad-stats.npz"
    bn_cnn("numpy").save(path)
    import zipfile

    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, state[key])
    members[key + ".npy"] = buf.getvalue()
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    with pytest.raises(ValueError, match=rf"bad-stats\.npz.*{match}"):
        pc.load(path, backend=backend.name)
    state[key][1] = 0.0 if key.endswith("var") else 1.0  # zero variance is a valid statistic
    model.load_state_dict(state)


def test_nan_batchnorm_statistics_in_an_onnx_file_are_refused(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    inits = {"s": np.ones(2, np.float32), "b": np.zeros(2, np.float32), "m": np.zeros(2, np.float32),
             "v": np.array([1.0, -1.0], np.float32)}
    graph = helper.make_graph([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4, 4])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    path = tmp_path / "bn.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(ValueError, match=r"bn\.onnx.*0\.running_var must be finite and non-negative.*-1\.0"):
        pc.onnx.load(path, backend="numpy")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_evaluate_and_predict_refuse_non_finite_input(backend, bad):
    # only fit checked: evaluate returned loss nan, predict NaN rows, without a word
    model = cnn(backend)
    x = np.random.default_rng(0).standard_normal((5, 1, 8, 8)).astype(np.float32)
    x[3, 0, 2, 1] = bad
    y = np.arange(5) % 4
    with pytest.raises(ValueError, match=rf"Sequential\.evaluate: x holds {bad} at index \(3, 0, 2, 1\)"):
        model.evaluate(x, y)
    with pytest.raises(ValueError, match=rf"Sequential\.predict: x holds {bad} at index \(3, 0, 2, 1\)"):
        model.predict(x)
    loader = pc.data.DataLoader(x, y, batch_size=2)
    with pytest.raises(ValueError, match=rf"a DataLoader batch holds {bad}"):
        model.evaluate(loader)
    x[3, 0, 2, 1] = 0.0
    assert np.isfinite(model.evaluate(x, y)["loss"])


def test_evaluate_without_labels_says_so(backend):
    # complained "y must hold integers, got dtype object"
    model = cnn(backend)
    with pytest.raises(TypeError, match=r"Sequential\.evaluate: y is missing.*labels of shape \(2,\).*DataLoader"):
        model.evaluate(X)
    with pytest.raises(TypeError, match=r"Sequential\.fit: y is missing"):
        model.fit(X, verbose=False)


def test_fit_reports_the_array_shape_not_a_batch_shape(backend):
    # a (200, 28, 28) array was reported as "(32, 28, 28)" by the fused op of the first batch
    model = pc.Sequential(pc.Conv2d(1, 2, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(2 * 13 * 13, 10),
                          backend=backend)
    x = np.zeros((200, 28, 28), np.float32)
    y = np.arange(200) % 10
    for call in (lambda: model.fit(x, y, batch_size=32, verbose=False), lambda: model.evaluate(x, y),
                 lambda: model.predict(x)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "x of shape (200, 28, 28) does not fit the model: layer 0: Conv2d(" in message, message
        assert "x[:, None] for shape (200, 1, 28, 28)" in message, message
        assert "32" not in message.replace("x[None] for shape (1, 200", ""), message
    with pytest.raises(ValueError, match=r"x of shape \(200, 1, 28, 27\) does not fit the model: layer 4: Linear"):
        model.predict(np.zeros((200, 1, 28, 27), np.float32))


@pytest.mark.parametrize("layers, start", [
    (lambda: [pc.Conv2d(1, 2, 3), pc.ReLU(), pc.MaxPool2d(2)], 0),
    (lambda: [pc.Conv2d(1, 2, 3), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(2 * 3 * 3, 4)], 0),
    (lambda: [pc.Identity(), pc.Conv2d(1, 2, 3), pc.BatchNorm2d(2), pc.ReLU()], 1),
])
def test_errors_in_fused_steps_name_the_users_layer(backend, layers, start):
    # they named the fused op (conv2d_relu_maxpool2d) instead of the layer
    model = pc.Sequential(*layers(), backend=backend).eval()
    assert pc._fusion.count_fused(model.plan()) >= 1
    with pytest.raises(ValueError) as info:
        model(np.zeros((2, 3, 8, 8), np.float32))
    message = str(info.value)
    assert message.startswith(f"layer {start}: Conv2d(in_channels=1, out_channels=2, kernel_size=3): x has 3 "
                              "channels"), message
    assert "conv2d_relu_maxpool2d" not in message and "batch_norm" not in message
    model(np.zeros((2, 1, 8, 8), np.float32))  # and the same step runs once the input is right


def test_batchnorm_on_one_value_per_channel_points_at_drop_last(backend):
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 3), pc.BatchNorm1d(3), pc.ReLU(), pc.Linear(3, 2),
                          backend=backend)
    x = np.random.default_rng(0).standard_normal((33, 1, 2, 2)).astype(np.float32)
    y = np.arange(33) % 2
    with pytest.raises(ValueError, match=r"BatchNorm1d\(3.*more than 1 value per channel, got x of shape \(1, 3\); "
                                         r"a last batch of 1 sample\? pass drop_last=True"):
        model.fit(x, y, batch_size=32, verbose=False)
    bn = model[2]
    tracked = int(bn.num_batches_tracked)
    with pytest.raises(ValueError, match="drop_last=True"):
        bn.train()(np.zeros((1, 3), np.float32))
    assert int(bn.num_batches_tracked) == tracked  # the refused call changed nothing
    loader = pc.data.DataLoader(x, y, batch_size=32, drop_last=True)
    model.fit(loader, verbose=False)


def test_vgg_small_adapts_to_mnist_sized_images(backend):
    # failed "input_size must be a multiple of 8, got 28" although the CLI help says every model adapts
    model = pc.models.build("vgg-small", (1, 28, 28), backend=backend, rng=0)
    x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
    assert model.predict(x).shape == (4, 10)
    model.fit(x, np.arange(4), batch_size=4, verbose=False)
    assert pc.models.vgg_small(input_size=20, backend=backend)(np.zeros((1, 3, 20, 20), np.float32)).shape == (1, 10)
    with pytest.raises(ValueError, match="vgg_small: input_size must be >= 8, got 7"):
        pc.models.vgg_small(input_size=7)


def test_resuming_onecycle_with_more_epochs_says_what_to_do(tmp_path):
    # "OneCycleLR: tried to step 6 times" in the middle of the resumed epoch
    x = np.random.default_rng(0).standard_normal((8, 1, 2, 2)).astype(np.float32)
    y = np.arange(8) % 2

    def run(epochs, resume=None):
        model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
        opt = pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = pc.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=epochs * 2)
        return model.fit(x, y, epochs=epochs, batch_size=4, optimizer=opt, scheduler=sched, verbose=False,
                         checkpoint=tmp_path / "ck.npz", resume=resume, seed=0)

    run(2)
    with pytest.raises(ValueError, match=r"cannot resume from .*ck\.npz' with epochs=3: its OneCycleLR schedule has "
                                         r"total_steps=4 \(2 epochs of 2 steps\).*resume with epochs=2"):
        run(3, resume=tmp_path / "ck.npz")
    assert len(run(2, resume=tmp_path / "ck.npz")) == 2


def _read_only(monkeypatch):
    import errno

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(pc._io.tempfile, "mkstemp", refuse)


@pytest.mark.parametrize("make", [
    lambda d: pc.callbacks.ModelCheckpoint(d / "m.npz"),
    lambda d: pc.callbacks.ModelCheckpoint(d / "m-{epoch:02d}.npz"),
    lambda d: pc.callbacks.CSVLogger(d / "log.csv"),
])
def test_callbacks_check_their_target_before_training(tmp_path, monkeypatch, make):
    # ModelCheckpoint to a read-only directory failed only after the first epoch;
    # CSVLogger("file.py/log.csv") raised FileExistsError
    model = cnn("numpy")
    before = model.state_dict()
    (tmp_path / "file.py").write_text("")
    callback = make(tmp_path / "file.py")
    with pytest.raises(NotADirectoryError, match=rf"{type(callback).__name__}: cannot write .*file\.py.*: "
                                                 r".*file\.py is a file, not a directory"):
        model.fit(X, np.arange(2), verbose=False, callbacks=[callback])
    _read_only(monkeypatch)
    with pytest.raises(PermissionError, match=rf"{type(callback).__name__}: cannot write .*Permission denied"):
        model.fit(X, np.arange(2), verbose=False, callbacks=[make(tmp_path)])
    for k, v in model.state_dict().items():  # refused before the first step
        np.testing.assert_array_equal(v, before[k])


def test_selftest_and_train_exit_alike_for_an_unknown_backend(capsys):
    # selftest exited 1 (a failed check), train 2 (a usage error), for the same mistake
    from parconv.cli import main

    assert main(["selftest", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "parconv selftest: error: unknown backend 'cuda'" in err
    assert main(["train", "--backend", "cuda", "--epochs", "1"]) == 2
    assert "parconv train: error: unknown backend 'cuda'" in capsys.readouterr().err


def test_custom_layers_without_shape_arithmetic_are_not_prechecked(backend):
    # a user's layer that changes the shape but keeps Layer.output_shape must not make fit refuse the model
    class Pool(pc.Layer):
        def forward(self, x):
            return pc.functional.maxpool2d(x, 2, backend=self.backend)

        def backward(self, dy, need_dx=True):
            raise NotImplementedError

    model = pc.Sequential(Pool(backend=backend), pc.Flatten(), pc.Linear(4, 2), backend=backend)
    assert model.predict(np.zeros((3, 1, 4, 4), np.float32)).shape == (3, 2)
