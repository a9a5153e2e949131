"""int8 post-training quantization: the quantized ops on every backend against the NumPy model of the
arithmetic (bit-identical), BatchNorm folding, quantize() on every zoo network, accuracy after
calibration on the bundled MNIST sample, input validation, and the ONNX QDQ round trip."""

import os
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from parconv import quantization as Q
from conftest import BACKENDS, conv_shapes, rand

ORACLE = pc.backends.get("numpy")


# ----------------------------------------------------------------------------- the reference arithmetic
def test_quantize_per_tensor_rounds_half_to_even_and_saturates():
    x = np.array([-1.0, -0.25, 0.0, 0.25, 0.75, 1.25, 100.0, np.nan, np.inf, -np.inf], np.float32)
    q = Q.quantize_per_tensor(x, 0.5, 10)
    # -2 -> 8, -0.5 -> -0 -> 10, 0.5 -> 0 -> 10, 1.5 -> 2 -> 12, 2.5 -> 2 -> 12, 200 -> 210, nan -> zp
    assert q.tolist() == [8, 10, 10, 10, 12, 12, 210, 10, 255, 0]
    assert q.dtype == np.uint8


def test_min_max_observer_includes_zero_and_matches_pytorch_formula():
    obs = Q.MinMaxObserver()
    obs(np.array([0.5, 2.0], np.float32))
    obs(np.array([1.0, 3.0], np.float32))
    scale, zp = obs.calculate_qparams()
    assert scale == np.float32(3.0 / 255) and zp == 0  # range [0, 3]: zero included
    obs = Q.MinMaxObserver()
    obs(np.array([-1.0, 3.0], np.float32))
    scale, zp = obs.calculate_qparams()
    assert scale == np.float32(4.0 / 255) and zp == 64  # -rint(-1 / (4/255)) = rint(63.75)
    with pytest.raises(RuntimeError, match="no data"):
        Q.MinMaxObserver().calculate_qparams()


def test_percentile_observer_cuts_rare_outliers():
    rng = np.random.default_rng(0)
    data = [np.abs(rng.standard_normal(20_000)).astype(np.float32) for _ in range(3)]
    data[1][7] = 1000.0  # one outlier in 60,000 values, in a later batch: the histogram is re-binned
    mm, pct = Q.MinMaxObserver(), Q.PercentileObserver(99.99)
    for d in data:
        mm(d)
        pct(d)
    s_mm, z_mm = mm.calculate_qparams()
    s_pct, z_pct = pct.calculate_qparams()
    assert z_mm == z_pct == 0
    assert s_mm == np.float32(1000.0 / 255)
    q9999 = np.percentile(np.concatenate(data), 99.99)
    assert q9999 / 255 <= s_pct <= 1.02 * q9999 / 255 + 1000.0 / 2048 / 255  # within one histogram bin
    with pytest.raises(ValueError, match="percentile"):
        Q.PercentileObserver(20)
    with pytest.raises(RuntimeError, match="no data"):
        Q.PercentileObserver().calculate_qparams()


def test_quantize_takes_an_observer():
    rng = np.random.default_rng(0)
    model = pc.models.lenet5(backend="numpy", rng=0)
    x = rng.random((32, 1, 28, 28), dtype=np.float32)
    x[0, 0, 0, 0] = 50.0  # an outlier pixel
    wide = Q.quantize(model, x)
    cut = Q.quantize(model, x, observer="percentile")
    custom = Q.quantize(model, x, observer=lambda: Q.PercentileObserver(99.99))
    assert cut[0].input_scale[0] < wide[0].input_scale[0] / 10
    assert custom[0].input_scale[0] == cut[0].input_scale[0]
    want = model.predict(x[1:])
    assert np.abs(cut.predict(x[1:]) - want).max() < np.abs(wide.predict(x[1:]) - want).max()
    with pytest.raises(ValueError, match="observer must be"):
        Q.quantize(model, x, observer="entropy")
    with pytest.raises(TypeError, match="observer must be"):
        Q.quantize(model, x, observer=3)


def test_weight_quantization_is_symmetric_per_channel():
    w = np.array([[1.0, -0.5], [0.0, 0.0], [-2.0, 0.01]], np.float32)
    wq, ws = Q.quantize_weight_per_channel(w)
    assert wq.dtype == np.int8 and ws.dtype == np.float32
    assert wq.tolist() == [[127, -64], [0, 0], [-127, 1]]
    np.testing.assert_allclose(ws, [1 / 127, 1.0, 2 / 127], rtol=1e-7)


@st.composite
def qconv_case(draw):
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cg, og = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    if draw(st.booleans()):
        cg, og = 1, 1  # depthwise
    n, h, w = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    kh = draw(st.integers(1, 3))
    kw = kh if draw(st.booleans()) else draw(st.integers(1, 3))
    dilation = (1, 1) if draw(st.booleans()) else (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    mode = draw(st.sampled_from(["int", "int", "pair", "same"]))
    stride = 1 if mode == "same" else draw(st.integers(1, 2))
    padding = {"int": draw(st.integers(0, 2)), "pair": (draw(st.integers(0, 2)), draw(st.integers(0, 2))),
               "same": "same"}[mode]
    x_shape, w_shape, kwargs = conv_shapes(n, groups, cg, og, h, w, kh, kw, stride=stride, padding=padding,
                                           dilation=dilation)
    return x_shape, w_shape, kwargs, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def _qconv(case, backend):
    x_shape, w_shape, kwargs, bias, relu, seed = case
    rng = np.random.default_rng(seed)
    x = rand(rng, *x_shape) + np.float32(rng.uniform(-0.5, 0.5))
    conv = pc.Conv2d(x_shape[1], w_shape[0], w_shape[2:], bias=bias, rng=seed % 1000, backend=backend, **kwargs)
    obs = Q.MinMaxObserver()
    obs(x)
    scale, zp = obs.calculate_qparams()
    return x, Q.QuantizedConv2d.from_float(conv, scale, zp, relu=relu)


def _reference_conv(layer, x):
    """The NumPy model: quantize, exact int64 accumulation, fp32 requantisation."""
    xq = Q.quantize_per_tensor(x, layer.input_scale[0], layer.input_zero_point[0])
    acc = Q.conv2d_int8_reference(xq, layer.input_zero_point[0], layer.weight, layer.stride, layer.padding,
                                  layer.dilation, layer.groups)
    return Q.requantize(acc, layer.bias, layer.scale, layer.relu)


@given(case=qconv_case())
def test_quantized_conv2d_is_bit_identical_to_the_numpy_model_on_every_backend(case):
    for name in BACKENDS:
        x, layer = _qconv(case, name)
        want = _reference_conv(layer, x)
        got = pc.to_numpy(layer(x))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"backend {name}")


def test_reference_conv_agrees_with_dequantized_float_convolution():
    # the integer model is the float convolution of the dequantized operands, up to float rounding
    rng = np.random.default_rng(1)
    x = rand(rng, 2, 5, 7, 7)
    conv = pc.Conv2d(5, 4, 3, padding=1, stride=2, backend="numpy", rng=3)
    layer = Q.QuantizedConv2d.from_float(conv, *_observe(x))
    xq = Q.quantize_per_tensor(x, layer.input_scale[0], layer.input_zero_point[0])
    xd = (xq.astype(np.float64) - layer.input_zero_point[0]) * layer.input_scale[0]
    wd = layer.weight.astype(np.float64) * layer.weight_scale.reshape(-1, 1, 1, 1)
    bd = layer.bias.astype(np.float64) * layer.scale
    want = ORACLE.to_numpy(F.conv2d(xd.astype(np.float32), wd.astype(np.float32), bd.astype(np.float32), stride=2,
                                    padding=1, backend="numpy"))
    np.testing.assert_allclose(pc.to_numpy(layer(x)), want, rtol=1e-5, atol=1e-5)
    # and the float layer within the quantization error
    np.testing.assert_allclose(pc.to_numpy(layer(x)), pc.to_numpy(conv(x)), atol=0.05)


def _observe(x):
    obs = Q.MinMaxObserver()
    obs(x)
    return obs.calculate_qparams()


@given(n=st.integers(1, 5), f=st.integers(1, 40), g=st.integers(1, 12), bias=st.booleans(), relu=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_quantized_linear_is_bit_identical_to_the_numpy_model_on_every_backend(n, f, g, bias, relu, seed):
    rng = np.random.default_rng(seed)
    x = rand(rng, n, f)
    for name in BACKENDS:
        lin = pc.Linear(f, g, bias=bias, backend=name, rng=seed % 1000)
        layer = Q.QuantizedLinear.from_float(lin, *_observe(x), relu=relu)
        xq = Q.quantize_per_tensor(x, layer.input_scale[0], layer.input_zero_point[0])
        want = Q.requantize(Q.linear_int8_reference(xq, layer.input_zero_point[0], layer.weight), layer.bias,
                            layer.scale, relu)
        np.testing.assert_array_equal(pc.to_numpy(layer(x)), want, err_msg=f"backend {name}")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_wide_layers_stay_exact_where_float32_could_not_hold_the_sums(backend_name):
    # Kdim * 255 * 127 far beyond 2**24: the float path must split the reduction and still match exactly
    rng = np.random.default_rng(5)
    x = np.abs(rand(rng, 2, 4096)) * 3
    lin = pc.Linear(4096, 3, backend=backend_name, rng=1)
    lin.weight.data = lin.backend.asarray(np.sign(rand(rng, 3, 4096)).astype(np.float32))  # every |wq| = 127
    layer = Q.QuantizedLinear.from_float(lin, np.float32(3 * 4.5 / 255), 0)
    assert len(layer._prepare()[1]) > 1
    xq = Q.quantize_per_tensor(x, layer.input_scale[0], 0)
    want = Q.requantize(Q.linear_int8_reference(xq, 0, layer.weight), layer.bias, layer.scale)
    np.testing.assert_array_equal(pc.to_numpy(layer(x)), want)
    conv = pc.Conv2d(300, 2, 3, padding=1, backend=backend_name, rng=2)
    conv.weight.data = conv.backend.asarray(np.sign(rand(rng, 2, 300, 3, 3)).astype(np.float32))
    xc = np.abs(rand(rng, 1, 300, 4, 4))
    qc = Q.QuantizedConv2d.from_float(conv, *_observe(xc))
    assert len(qc._prepare()[1]) > 1
    np.testing.assert_array_equal(pc.to_numpy(qc(xc)), _reference_conv(qc, xc))


class _FakeInt8:
    """The int8 kernel contract (docs: LOWP), implemented with the NumPy model, to check the calls the layers make."""

    calls: list

    def __init__(self):
        self.calls = []

    def path(self):
        return "portable"

    def quantize(self, x, scale, zero_point, out, num_threads):
        self.calls.append("quantize")
        out[...] = Q.quantize_per_tensor(np.asarray(x), scale, zero_point)

    def pack_weights(self, wq):
        wq = np.asarray(wq)
        assert wq.dtype == np.int8 and wq.ndim == 2 and wq.flags.c_contiguous
        return wq[:, ::-1].copy(), wq.astype(np.int32).sum(axis=1).astype(np.int32)

    def _store(self, name, acc, bias_q, scale, relu, y, yq, yq_scale, yq_zero_point):
        out = Q.requantize(acc, bias_q, scale, relu)
        assert y is not None or yq is not None
        if y is not None:
            y[...] = out
        if yq is not None:  # the next layer's input, quantized as it stores
            assert yq.dtype == np.uint8 and yq.shape == out.shape and isinstance(yq_scale, float)
            yq[...] = Q.quantize_per_tensor(out, yq_scale, yq_zero_point)
            name += "+yq"
        self.calls.append(name)

    def conv2d_forward(self, xq, zx, packed, row_sums, O, K, stride, padding, scale, bias_q, y, relu, num_threads,
                       yq=None, yq_scale=1.0, yq_zero_point=0):
        c = xq.shape[1]
        wq = np.asarray(packed)[:, ::-1].reshape(O, c, K, K)
        assert np.array_equal(row_sums, wq.reshape(O, -1).sum(1))
        acc = Q.conv2d_int8_reference(xq, zx, wq, stride, padding)
        self._store("conv2d_forward", acc, bias_q, scale, relu, y, yq, yq_scale, yq_zero_point)

    def depthwise_forward(self, xq, zx, wq, sh, sw, ph, pw, scale, bias_q, y, relu, num_threads, yq=None,
                          yq_scale=1.0, yq_zero_point=0):
        acc = Q.conv2d_int8_reference(xq, zx, wq, (sh, sw), (ph, pw), 1, xq.shape[1])
        self._store("depthwise_forward", acc, bias_q, scale, relu, y, yq, yq_scale, yq_zero_point)

    def linear_forward(self, xq, zx, packed, row_sums, scale, bias_q, y, relu, num_threads, yq=None, yq_scale=1.0,
                       yq_zero_point=0):
        acc = Q.linear_int8_reference(xq, zx, np.asarray(packed)[:, ::-1])
        self._store("linear_forward", acc, bias_q, scale, relu, y, yq, yq_scale, yq_zero_point)


@pytest.mark.skipif("openmp" not in BACKENDS, reason="the native int8 kernels belong to the openmp backend")
def test_native_kernels_are_called_as_the_contract_says(monkeypatch):
    fake = _FakeInt8()
    monkeypatch.setattr(Q, "_int8_module", lambda: fake)
    assert Q.int8_path() == "portable"
    rng = np.random.default_rng(2)
    model = pc.models.mobilenet_small(backend="openmp", rng=0)
    x = rand(rng, 4, 3, 32, 32)
    monkeypatch.setattr(Q, "_int8_module", lambda: None)
    qmodel = Q.quantize(model, x)
    emulated = qmodel.predict(x)
    qmodel.to("openmp")  # drops what each layer prepared for the kernels it found
    monkeypatch.setattr(Q, "_int8_module", lambda: fake)
    np.testing.assert_array_equal(qmodel.predict(x), emulated)
    # mobilenet's layers feed each other: each kernel but the last stores the next one's uint8 input
    assert {"quantize", "conv2d_forward+yq", "depthwise_forward+yq", "conv2d_forward"} <= set(fake.calls)
    assert fake.calls.count("quantize") == 2  # the first layer's input and the head's (after the pooling)
    fake.calls.clear()
    for m in qmodel.modules():  # unfused: every layer quantizes its own input and stores float32
        if hasattr(m, "fuse"):
            m.fuse = False
    np.testing.assert_array_equal(qmodel.predict(x), emulated)
    assert not any(c.endswith("+yq") for c in fake.calls) and "linear_forward" in fake.calls


def _chain_steps(model) -> int:
    return sum(isinstance(s.step, Q._Int8Chain) for m in model.modules() if hasattr(m, "plan") for s in m.plan())


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
@pytest.mark.parametrize("batch", [1, 3, 20])
def test_chained_int8_layers_are_bit_identical_to_the_numpy_model(batch):
    # conv -> depthwise -> 1x1 conv -> Dropout -> Flatten -> linear -> linear, and a residual block whose body is a
    # chain: each native kernel stores the next layer's uint8 input instead of float32 (same bits)
    rng = np.random.default_rng(5)
    body = pc.Sequential(pc.Conv2d(8, 8, 3, padding=1, rng=3), pc.ReLU(), pc.Conv2d(8, 8, 3, padding=1, rng=4))
    model = pc.Sequential(
        pc.Conv2d(3, 8, 3, padding=1, rng=0), pc.BatchNorm2d(8), pc.ReLU(),
        pc.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, rng=1), pc.ReLU(),
        pc.Conv2d(8, 8, 1, rng=2), pc.ReLU(), pc.Residual(body), pc.ReLU(),
        pc.Conv2d(8, 6, 1, rng=5), pc.Dropout(0.5), pc.Flatten(), pc.Linear(6 * 5 * 5, 12, rng=6), pc.ReLU(),
        pc.Linear(12, 4, rng=7), backend="numpy")
    _trained_bn(model[1], rng)
    model.eval()
    x = rand(rng, batch, 3, 10, 10)
    qmodel = Q.quantize(model, rand(rng, 16, 3, 10, 10))
    want = qmodel.predict(x)
    assert _chain_steps(qmodel) == 0  # the NumPy model runs layer by layer
    qmodel.to("openmp")
    np.testing.assert_array_equal(qmodel.predict(x), want)
    # one chain from the stem through the residual block (and its ReLU) to the last linear layer; the block's
    # body, which the chain runs itself, still plans its own
    assert _chain_steps(qmodel) == 2
    chain = qmodel.plan()[0].step
    assert len(qmodel.plan()) == 1
    assert [type(m).__name__ for m in chain.layers if isinstance(m, (Q._Quantized, pc.Residual))] == \
        ["QuantizedConv2d"] * 3 + ["Residual", "QuantizedConv2d", "QuantizedLinear", "QuantizedLinear"]
    for m in qmodel.modules():
        if hasattr(m, "fuse"):
            m.fuse = False
    np.testing.assert_array_equal(qmodel.predict(x), want)
    assert _chain_steps(qmodel) == 0
    with pytest.raises(RuntimeError, match="inference only"):
        chain.backward(np.zeros((batch, 8, 5, 5), np.float32))


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
@pytest.mark.parametrize("batch", [1, 4])
def test_chains_stay_uint8_through_max_pooling(batch, monkeypatch):
    # conv -> ReLU -> MaxPool2d -> conv (VGG's stages; the pool 2x2 and a padded 3x3 stride 2 one) -> Flatten ->
    # linear: one chain, the pools run on the uint8 activations (the max of quantized values is the quantized
    # max), bit-identical to the NumPy model; a pool after the chain's last layer stays out of it
    rng = np.random.default_rng(9)
    model = pc.Sequential(
        pc.Conv2d(3, 8, 3, padding=1, rng=0), pc.BatchNorm2d(8), pc.ReLU(), pc.MaxPool2d(2),
        pc.Conv2d(8, 16, 3, padding=1, rng=1), pc.ReLU(), pc.MaxPool2d(3, stride=2, padding=1),
        pc.Conv2d(16, 16, 3, padding=1, rng=2), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Dropout(0.5),
        pc.Linear(16 * 1 * 2, 10, rng=3), pc.ReLU(), pc.Linear(10, 5, rng=4), backend="numpy")
    _trained_bn(model[1], rng)
    model.eval()
    x = rand(rng, batch, 3, 13, 15)  # odd sides: floor-mode pools drop a row and a column
    qmodel = Q.quantize(model, rand(rng, 16, 3, 13, 15))
    want = qmodel.predict(x)
    qmodel.to("openmp")
    seen = []
    real = Q._pool_u8
    monkeypatch.setattr(Q, "_pool_u8", lambda pool, xq, alloc, rec=None: seen.append(xq.dtype) or
                        real(pool, xq, alloc, rec))
    np.testing.assert_array_equal(qmodel.predict(x), want)
    assert _chain_steps(qmodel) == 1
    chain = qmodel.plan()[0].step
    assert [type(m).__name__ for m in chain.layers if type(m) in (pc.MaxPool2d, Q.QuantizedConv2d)] == \
        ["QuantizedConv2d", "MaxPool2d", "QuantizedConv2d", "MaxPool2d", "QuantizedConv2d", "MaxPool2d"]
    assert seen == [np.uint8] * 3
    # the last pool ends a chain: it runs in float32 on the last layer's output
    tail = pc.Sequential(pc.Conv2d(3, 8, 3, padding=1, rng=0), pc.ReLU(), pc.Conv2d(8, 8, 3, padding=1, rng=1),
                         pc.ReLU(), pc.MaxPool2d(2), backend="numpy").eval()
    qtail = Q.quantize(tail, rand(rng, 8, 3, 8, 8))
    want = qtail.predict(x[:, :, :8, :8])
    qtail.to("openmp")
    np.testing.assert_array_equal(qtail.predict(x[:, :, :8, :8]), want)
    assert [type(s.step).__name__ for s in qtail.plan()] == ["_Int8Chain", "Identity", "MaxPool2d"]


def test_maxpool2d_u8_matches_float_pooling_and_validates():
    native = Q._native("maxpool2d_u8")
    if native is None:
        pytest.skip("the native int8 kernels are not built")
    rng = np.random.default_rng(3)
    for (h, w), k, s, p in [((8, 8), (2, 2), (2, 2), (0, 0)), ((9, 37), (2, 2), (2, 2), (0, 0)),
                            ((5, 13), (2, 2), (2, 2), (0, 0)),
                            ((7, 11), (3, 3), (2, 2), (1, 1)), ((6, 5), (3, 2), (1, 3), (1, 0)),
                            ((1, 1), (1, 1), (1, 1), (0, 0)), ((5, 33), (2, 3), (2, 1), (0, 1))]:
        xq = rng.integers(0, 256, (2, 3, h, w), dtype=np.uint8)
        ref = np.asarray(F.maxpool2d(xq.astype(np.float32), k, s, padding=p, backend="numpy")).astype(np.uint8)
        for nt in (1, 2):
            y = np.empty(ref.shape, np.uint8)
            native(xq, k, s, p, y, nt)
            np.testing.assert_array_equal(y, ref, err_msg=f"{(h, w)} {k} {s} {p}")
    xq = np.zeros((1, 1, 4, 4), np.uint8)
    with pytest.raises(TypeError, match="xq must have dtype uint8"):
        native(xq.astype(np.float32), (2, 2), (2, 2), (0, 0), np.empty((1, 1, 2, 2), np.uint8), 1)
    with pytest.raises(ValueError, match="padding .* at most half"):
        native(xq, (2, 2), (2, 2), (2, 0), np.empty((1, 1, 4, 2), np.uint8), 1)
    with pytest.raises(ValueError, match=r"y must have shape \(1, 1, 2, 2\)"):
        native(xq, (2, 2), (2, 2), (0, 0), np.empty((1, 1, 3, 3), np.uint8), 1)
    with pytest.raises(ValueError, match="larger than the padded input"):
        native(xq, (5, 5), (1, 1), (0, 0), np.empty((1, 1, 1, 1), np.uint8), 1)
    with pytest.raises(TypeError, match="tuples"):
        native(xq, 2, 2, 0, np.empty((1, 1, 2, 2), np.uint8), 1)
def _residual_net(rng):
    """Residual blocks as parconv writes them: identity and projection shortcuts, the ReLU after a block nested with
    it or beside it, and a last block without one."""
    seeds = iter(range(100))

    def block(cin, cout, stride):
        body = pc.Sequential(pc.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, rng=next(seeds)),
                             pc.BatchNorm2d(cout), pc.ReLU(),
                             pc.Conv2d(cout, cout, 3, padding=1, bias=False, rng=next(seeds)), pc.BatchNorm2d(cout))
        short = None if stride == 1 and cin == cout else \
            pc.Sequential(pc.Conv2d(cin, cout, 1, stride=stride, bias=False, rng=next(seeds)), pc.BatchNorm2d(cout))
        return pc.Residual(body, short)

    model = pc.Sequential(pc.Conv2d(3, 8, 3, padding=1, rng=50), pc.BatchNorm2d(8), pc.ReLU(),
                          pc.Sequential(block(8, 8, 1), pc.ReLU()), block(8, 16, 2), pc.ReLU(),
                          pc.Sequential(block(16, 16, 1), pc.ReLU()), block(16, 16, 1),
                          pc.AdaptiveAvgPool2d(1), pc.Flatten(), pc.Linear(16, 5, rng=51), backend="numpy")
    model.train()
    with pc.no_grad():
        for _ in range(2):
            model(rand(rng, 8, 3, 12, 12))
    return model.eval()


def test_identity_shortcuts_add_the_input_as_the_quantized_layers_read_it():
    # QuantizeLinear -> DequantizeLinear on the block's input, with its body's first layer's parameters: the same
    # bits on every backend, fused or not, and in the exported QDQ graph
    rng = np.random.default_rng(12)
    qmodel = Q.quantize(_residual_net(rng), rand(rng, 16, 3, 12, 12))
    block = qmodel[3][0]
    assert isinstance(block.shortcut, Q.QuantDequant)
    assert np.float32(block.shortcut.scale) == block.body[0].input_scale[0]
    assert block.shortcut.zero_point == block.body[0].input_zero_point[0]
    assert isinstance(qmodel[4].shortcut[0], Q.QuantizedConv2d)  # a projection keeps its convolution
    x = rand(rng, 3, 8, 12, 12)
    want = block.body.forward(x) + Q.dequantize_per_tensor(
        Q.quantize_per_tensor(x, block.shortcut.scale, block.shortcut.zero_point), block.shortcut.scale,
        block.shortcut.zero_point)
    with pc.no_grad():
        np.testing.assert_array_equal(pc.to_numpy(block(x)), want)
    assert type(pc.layers.layer_from_spec(qmodel.spec(), "numpy")[3][0].shortcut).__name__ == "QuantDequant"


def test_requantize_adds_the_residual_before_the_relu():
    acc = np.array([[[-5], [3]]], np.int64)  # (1, 2, 1) channels on axis 1
    scale = np.array([0.5, 0.25], np.float32)
    r = np.array([[[2.0], [-1.0]]], np.float32)
    np.testing.assert_array_equal(Q.requantize(acc, None, scale, relu=True, residual=r), [[[0.0], [0.0]]])
    np.testing.assert_array_equal(Q.requantize(acc, np.array([1, 2], np.int32), scale, residual=r),
                                  [[[-0.0], [0.25]]])
    np.testing.assert_array_equal(Q.dequantize_per_tensor(np.array([0, 128, 255], np.uint8), 0.5, 128),
                                  np.array([-64.0, 0.0, 63.5], np.float32))


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
@pytest.mark.parametrize("batch", [1, 3, 20])
def test_residual_blocks_stay_uint8_inside_int8_chains(batch, monkeypatch):
    # every block's last convolution adds its shortcut (the uint8 input dequantized, or the projection's float32
    # output) and applies the block's ReLU as it stores the next block's uint8 input: one chain from the stem to
    # the pooling, one quantize pass (the stem's input), no float32 add; the same bits as the NumPy model (the calls
    # counted as the chain makes them, not recorded: a recorded quantize step runs without a Python call)
    monkeypatch.setattr(Q, "_PLAN_BYTES", -1)
    rng = np.random.default_rng(13)
    model = _residual_net(rng)
    qmodel = Q.quantize(model, rand(rng, 16, 3, 12, 12))
    x = rand(rng, batch, 3, 12, 12)
    want = qmodel.predict(x)
    qmodel.to("openmp")
    calls = {"quantize": 0, "add": 0, "quant_dequant": 0}
    quantize_input, add, qd = Q._Quantized.quantize_input, F.add, Q.QuantDequant.forward

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Q._Quantized, "quantize_input", counted("quantize", quantize_input))
    monkeypatch.setattr(F, "add", counted("add", add))
    monkeypatch.setattr(Q.QuantDequant, "forward", counted("quant_dequant", qd))
    np.testing.assert_array_equal(qmodel.predict(x), want)
    from parconv._ext import _int8

    for path in _int8._paths()[:-1]:  # the lower paths this CPU runs: float32 y, then quantized
        old = _int8._use_path(path)
        try:
            np.testing.assert_array_equal(qmodel.predict(x), want, err_msg=path)
        finally:
            _int8._use_path(old)
    for k in calls:
        calls[k] = 0
    np.testing.assert_array_equal(qmodel.predict(x), want)
    assert [type(s.step).__name__ for s in qmodel.plan()] == ["_Int8Chain", "AdaptiveAvgPool2d", "Flatten",
                                                             "QuantizedLinear"]
    assert calls == {"quantize": 2, "add": 0, "quant_dequant": 0}  # the stem's input and the head's
    links = qmodel.plan()[0].step.links
    assert [type(link).__name__ for link, _, _ in links] == ["QuantizedConv2d"] + ["_ResidualLink"] * 4
    assert [link.relu for link, _, _ in links[1:]] == [True, True, True, False]
    for k in calls:
        calls[k] = 0
    for m in qmodel.modules():  # layer by layer: float32 between the blocks
        if hasattr(m, "fuse"):
            m.fuse = False
    np.testing.assert_array_equal(qmodel.predict(x), want)
    assert calls["add"] == 4 and calls["quant_dequant"] == 3 and calls["quantize"] > 2


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
def test_max_pooling_on_uint8_and_residual_blocks_share_a_chain(monkeypatch):
    # where a uint8 max-pooling kernel is built, a pooling between a kernel and a residual block runs inside the
    # same chain (here a NumPy stand-in for it: the max of uint8 windows)
    def maxpool2d_u8(xq, kernel, stride, padding, y, num_threads):
        assert padding == (0, 0)
        n, c, p, q = y.shape
        windows = [xq[:, :, i:i + stride[0] * (p - 1) + 1:stride[0], j:j + stride[1] * (q - 1) + 1:stride[1]]
                   for i in range(kernel[0]) for j in range(kernel[1])]
        y[...] = np.max(windows, axis=0)

    native = Q._native
    monkeypatch.setattr(Q, "_native", lambda name: maxpool2d_u8 if name == "maxpool2d_u8" else native(name))
    rng = np.random.default_rng(15)
    net = _residual_net(rng)
    model = pc.Sequential(*net.layers[:3], pc.MaxPool2d(2), *net.layers[3:6], backend="numpy").eval()
    qmodel = Q.quantize(model, rand(rng, 16, 3, 12, 12))
    x = rand(rng, 3, 3, 12, 12)
    want = qmodel.predict(x)
    qmodel.to("openmp")
    np.testing.assert_array_equal(qmodel.predict(x), want)
    chain = qmodel.plan()[0].step
    assert len(qmodel.plan()) == 1 and [len(p) for p in chain.pools] == [1, 0, 0]
    assert [type(link).__name__ for link, _, _ in chain.links] == ["QuantizedConv2d", "_ResidualLink", "_ResidualLink"]


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
def test_blocks_that_cannot_stay_uint8_run_as_before():
    # a shortcut that quantizes its input unlike the body, a body that ends in a ReLU, an identity shortcut on the
    # float32 input: each block leaves the chain, and the results stay those of the NumPy model
    rng = np.random.default_rng(14)
    qmodel = Q.quantize(_residual_net(rng), rand(rng, 16, 3, 12, 12))
    qmodel[3][0].shortcut = Q.QuantDequant(qmodel[3][0].shortcut.scale * 2, 3)
    qmodel[4].body[3].relu = True
    qmodel[6][0].shortcut = qmodel[7].shortcut = None
    for m in qmodel.modules():
        if hasattr(m, "_plan_key"):
            m._plan_key = None
    x = rand(rng, 4, 3, 12, 12)
    want = qmodel.predict(x)
    qmodel.to("openmp")
    np.testing.assert_array_equal(qmodel.predict(x), want)
    assert not any(isinstance(link, Q._ResidualLink) for s in qmodel.plan() if isinstance(s.step, Q._Int8Chain)
                   for link, _, _ in s.step.links)


@pytest.mark.skipif("openmp" not in BACKENDS, reason="the openmp backend's buffer pool")
def test_recycled_outputs_never_overwrite_a_result_still_held():
    # the int8 layers' outputs and the uint8 activations between chained layers come from the backend's buffer
    # pool (512 KiB here: pooled); a result the caller still holds must survive the next call
    rng = np.random.default_rng(8)
    model = pc.Sequential(pc.Conv2d(3, 16, 3, padding=1, rng=0), pc.ReLU(), pc.Conv2d(16, 16, 3, padding=1, rng=1),
                          backend="numpy").eval()
    x1, x2 = rand(rng, 8, 3, 32, 32), rand(rng, 8, 3, 32, 32)
    qmodel = Q.quantize(model, x1)
    want1, want2 = qmodel.predict(x1), qmodel.predict(x2)
    qmodel.to("openmp")
    with pc.no_grad():
        y1 = qmodel(x1)
        y2 = qmodel(x2)
        y3 = qmodel(x1)
    np.testing.assert_array_equal(pc.to_numpy(y1), want1)
    np.testing.assert_array_equal(pc.to_numpy(y2), want2)
    np.testing.assert_array_equal(pc.to_numpy(y3), want1)
    qmodel.fuse = False  # layer by layer
    with pc.no_grad():
        z1, z2 = qmodel(x1), qmodel(x2)
    np.testing.assert_array_equal(pc.to_numpy(z1), want1)
    np.testing.assert_array_equal(pc.to_numpy(z2), want2)


# ----------------------------------------------------------------------------- BatchNorm folding
def _trained_bn(bn, rng):
    c = bn.num_features
    bn.running_mean = bn.backend.asarray(rand(rng, c))
    bn.running_var = bn.backend.asarray(np.abs(rand(rng, c)) + 0.5)
    bn.weight.data = bn.backend.asarray(rand(rng, c))
    bn.bias.data = bn.backend.asarray(rand(rng, c))


@pytest.mark.parametrize("groups,bias", [(1, True), (1, False), (4, False)])
def test_fuse_conv_bn_eval_matches_conv_then_batchnorm(groups, bias):
    rng = np.random.default_rng(0)
    conv = pc.Conv2d(4, 8, 3, padding=1, groups=groups, bias=bias, backend="numpy", rng=1)
    bn = pc.BatchNorm2d(8, backend="numpy")
    _trained_bn(bn, rng)
    model = pc.Sequential(conv, bn, backend="numpy", fuse=False).eval()
    x = rand(rng, 3, 4, 6, 6)
    want = pc.to_numpy(model(x)).astype(np.float64)
    fused = Q.fuse_conv_bn_eval(conv, bn)
    np.testing.assert_allclose(pc.to_numpy(fused(x)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert fused.bias is not None and (conv.bias is not None) == bias  # the inputs are untouched


def test_linear_batchnorm1d_is_folded_and_the_relu_fused():
    rng = np.random.default_rng(1)
    bn = pc.BatchNorm1d(16, backend="numpy")
    _trained_bn(bn, rng)
    model = pc.Sequential(pc.Flatten(), pc.Linear(12, 16, rng=0), bn, pc.ReLU(), pc.Linear(16, 3, rng=1),
                          backend="numpy").eval()
    x = rand(rng, 64, 3, 2, 2)
    qmodel = Q.quantize(model, x)
    assert [type(m).__name__ for m in qmodel] == ["Flatten", "QuantizedLinear", "Identity", "Identity",
                                                 "QuantizedLinear"]
    assert qmodel[1].relu and not qmodel[4].relu
    want = model.predict(x)
    assert np.abs(qmodel.predict(x) - want).max() < 0.03 * np.abs(want).max()


def test_fuse_conv_bn_eval_validates():
    conv = pc.Conv2d(2, 3, 1, backend="numpy")
    with pytest.raises(TypeError, match="bn must be a BatchNorm2d"):
        Q.fuse_conv_bn_eval(conv, pc.ReLU())
    with pytest.raises(ValueError, match="4 features"):
        Q.fuse_conv_bn_eval(conv, pc.BatchNorm2d(4, backend="numpy"))
    with pytest.raises(ValueError, match="running statistics"):
        Q.fuse_conv_bn_eval(conv, pc.BatchNorm2d(3, track_running_stats=False, backend="numpy"))
    with pytest.raises(TypeError, match="conv must be a parconv Conv2d"):
        Q.fuse_conv_bn_eval(pc.ReLU(), pc.BatchNorm2d(3))


# ----------------------------------------------------------------------------- quantize() on models
ZOO = ["cnn-mnist", "lenet5", "vgg-small", "resnet20", "mobilenet-small"]


def _zoo(name, backend, rng):
    model = pc.models.build(name, backend=backend, rng=0)
    x = rng.random((48,) + model.input_shape, dtype=np.float32)
    model.train()
    with pc.no_grad():
        model(x)  # BatchNorm running statistics that are not the identity
    return model.eval(), x


@pytest.mark.parametrize("name", ZOO)
def test_quantize_every_zoo_network(name):
    be = "openmp" if "openmp" in BACKENDS else "numpy"
    rng = np.random.default_rng(0)
    model, x = _zoo(name, be, rng)
    before = model.state_dict()
    qmodel = Q.quantize(model, x[:32], batch_size=16)
    assert qmodel is not model and not qmodel.training and not model.training
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # the input model is untouched
    kinds = {type(m).__name__ for m in qmodel.modules()}
    assert "Conv2d" not in kinds and "Linear" not in kinds and "BatchNorm2d" not in kinds
    assert {"QuantizedConv2d", "QuantizedLinear"} <= kinds
    yf, yq = model.predict(x[32:]), qmodel.predict(x[32:])
    assert (yf.argmax(1) == yq.argmax(1)).mean() >= 0.85
    assert np.abs(yq - yf).max() <= 0.03 * np.abs(yf).max()
    text = qmodel.summary(print_fn=None)
    assert "QuantizedConv2d" in text and "forward multiply-adds" in text


def test_relu_is_fused_and_residual_blocks_are_quantized():
    model = pc.models.resnet20(backend="numpy", rng=0).eval()
    qmodel = Q.quantize(model, np.random.default_rng(0).random((4, 3, 32, 32), dtype=np.float32))
    assert type(qmodel[0]).__name__ == "QuantizedConv2d" and qmodel[0].relu
    assert [type(m).__name__ for m in qmodel[1:3]] == ["Identity", "Identity"]  # BatchNorm and ReLU
    block = qmodel[6][0]  # a stride-2 block with a projection shortcut
    assert type(block).__name__ == "Residual"
    body = [type(m).__name__ for m in block.body]
    assert body == ["QuantizedConv2d", "Identity", "Identity", "QuantizedConv2d", "Identity"]
    assert block.body[0].relu and not block.body[3].relu  # the add comes before the block's ReLU
    assert type(block.shortcut[0]).__name__ == "QuantizedConv2d"
    assert type(qmodel[6][1]).__name__ == "ReLU"


def test_quantized_models_agree_across_backends():
    # the quantized ops are bit-identical (above); the float layers between them (pooling) round differently per
    # backend, which may move a value across a rounding boundary of the next layer's input: one step at most
    rng = np.random.default_rng(3)
    model, x = _zoo("mobilenet-small", "numpy", rng)
    want = Q.quantize(model, x).predict(x)
    for name in BACKENDS:
        got = Q.quantize(model.to(name), x).predict(x)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("name,epochs", [("lenet5", 3), pytest.param("mobilenet-small", 2, marks=pytest.mark.slow),
                                         pytest.param("resnet20", 3, marks=pytest.mark.slow)])
def test_accuracy_after_quantization_on_the_mnist_sample(name, epochs):
    # train briefly in fp32, calibrate on 512 training images, compare on 2,000 held-out images
    be = "openmp" if "openmp" in BACKENDS else "numpy"
    x, y = pc.datasets.load_mnist("test")
    x_train, y_train, x_test, y_test = x[:6000], y[:6000], x[8000:], y[8000:]
    model = pc.models.build(name, input_shape=(1, 28, 28), backend=be, rng=0)
    model.fit(x_train, y_train, epochs=epochs, batch_size=64, optimizer=pc.optim.Adam(model.parameters(), lr=2e-3),
              verbose=False, seed=0)
    fp32 = model.evaluate(x_test, y_test)["accuracy"]
    qmodel = Q.quantize(model, x_train[:512])
    int8 = qmodel.evaluate(x_test, y_test)["accuracy"]
    # the float32 run must have learnt (resnet20's three short epochs land at 0.91-0.96 depending on the ISA
    # level's rounding); the drop is the target
    assert fp32 > (0.88 if name == "resnet20" else 0.93), fp32
    assert fp32 - int8 <= 0.005, (fp32, int8)


def test_quantize_accepts_a_dataloader_and_iterables():
    rng = np.random.default_rng(0)
    model = pc.models.cnn_mnist(filters=4, backend="numpy", rng=0)
    x = rng.random((40, 1, 28, 28), dtype=np.float32)
    want = Q.quantize(model, x, batch_size=8)
    loader = pc.data.DataLoader(x, np.zeros(40, np.int64), batch_size=8, shuffle=False)
    for data in (loader, [x[:20], x[20:]], ((x[:20], None), (x[20:], None))):
        got = Q.quantize(model, data)
        assert got[0].input_scale[0] == want[0].input_scale[0]
        assert got[0].input_zero_point[0] == want[0].input_zero_point[0]
        np.testing.assert_array_equal(got.predict(x), want.predict(x))


def test_quantize_validates_its_arguments():
    model = pc.models.cnn_mnist(filters=4, backend="numpy", rng=0)
    x = np.zeros((4, 1, 28, 28), np.float32)
    with pytest.raises(TypeError, match="model must be a parconv"):
        Q.quantize("model", x)
    with pytest.raises(TypeError, match="calibration_data must be"):
        Q.quantize(model, 3)
    with pytest.raises(ValueError, match="calibration_data is empty"):
        Q.quantize(model, x[:0])
    with pytest.raises(ValueError, match="calibration_data"):
        Q.quantize(model, np.zeros((4, 3, 28, 28), np.float32))
    with pytest.raises(ValueError, match="NaN or Inf|finite"):
        Q.quantize(model, np.full((4, 1, 28, 28), np.nan, np.float32))
    with pytest.raises(ValueError, match="batch_size"):
        Q.quantize(model, x, batch_size=0)
    with pytest.raises(TypeError, match="progress"):
        Q.quantize(model, x, progress="yes")
    with pytest.raises(ValueError, match="no batches"):
        Q.quantize(model, iter([]))
    with pytest.raises(ValueError, match="no Conv2d or Linear"):
        Q.quantize(pc.Sequential(pc.ReLU(), backend="numpy"), x)
    qmodel = Q.quantize(model, x)
    with pytest.raises(ValueError, match="already quantized"):
        Q.quantize(qmodel, x)


def test_quantized_model_is_inference_only_and_saves_to_onnx_not_npz(tmp_path):
    model = pc.models.cnn_mnist(filters=4, backend="numpy", rng=0)
    x = np.random.default_rng(0).random((8, 1, 28, 28), dtype=np.float32)
    qmodel = Q.quantize(model, x)
    qmodel(x)
    with pytest.raises(RuntimeError, match="inference only"):
        qmodel.layers[0].backward(np.zeros((8, 4, 26, 26), np.float32))
    with pytest.raises(ValueError, match="inference only"):
        qmodel.fit(x, np.zeros(8, np.int64), epochs=1, verbose=False)
    with pytest.raises(ValueError, match="onnx.export"):
        qmodel.save(tmp_path / "q.npz")
    assert not (tmp_path / "q.npz").exists()
    with pytest.raises(ValueError, match="in_features=676"):
        qmodel.layers[-1](np.zeros((2, 5), np.float32))


def test_quantized_layer_state_is_checked():
    layer = Q.QuantizedLinear(3, 2)
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        layer.set_quantized(np.full((2, 3), -128), np.ones(2), np.zeros(2), 0.1, 0)
    with pytest.raises(ValueError, match="positive and finite"):
        layer.set_quantized(np.zeros((2, 3)), np.zeros(2), np.zeros(2), 0.1, 0)
    with pytest.raises(ValueError, match="0..255"):
        layer.set_quantized(np.zeros((2, 3)), np.ones(2), np.zeros(2), 0.1, 300)
    with pytest.raises(ValueError, match="shape"):
        layer.set_quantized(np.zeros((3, 3)), np.ones(2), np.zeros(2), 0.1, 0)
    state = layer.state_dict()
    assert state["weight"].dtype == np.int8 and state["bias"].dtype == np.int32
    layer.load_state_dict(state)


def test_int8_path_is_reported():
    assert Q.int8_path() in ("avx512_vnni", "avx_vnni", "avx2", "portable", "float32 emulation")
    assert pc.show_config(mode="dicts")["kernels"]["int8"] == Q.int8_path()
    from parconv._buildinfo import build_info, format_config

    assert f"int8 inference: {Q.int8_path()}" in format_config(build_info())


# ----------------------------------------------------------------------------- ONNX QDQ
def _small_int8():
    """Quantized conv (BatchNorm folded, ReLU fused), depthwise conv, a QuantDequant, pooling, quantized linear."""
    model = pc.Sequential(pc.Conv2d(2, 8, 3, padding=1, rng=1), pc.BatchNorm2d(8), pc.ReLU(),
                          pc.Conv2d(8, 8, 3, groups=8, rng=2), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(128, 5, rng=3),
                          backend="numpy")
    _trained_bn(model[1], np.random.default_rng(4))
    x = np.random.default_rng(0).standard_normal((16, 2, 10, 10)).astype(np.float32)
    qmodel = Q.quantize(model.eval(), x)
    qmodel.layers.insert(5, Q.QuantDequant(0.05, 128))
    return qmodel


def _int8_resnet():
    model, x = _zoo("resnet20", "numpy", np.random.default_rng(1))
    return Q.quantize(model, x[:16])


def _pooled_int8():
    """VGG's conv -> ReLU -> MaxPool2d -> conv stages and a 16-channel depthwise conv, on the openmp backend where
    built: chained through the pools in uint8, the depthwise in channel blocks."""
    model = pc.Sequential(pc.Conv2d(3, 16, 3, padding=1, rng=1), pc.ReLU(), pc.MaxPool2d(2),
                          pc.Conv2d(16, 16, 3, padding=1, rng=2), pc.ReLU(), pc.MaxPool2d(3, stride=2, padding=1),
                          pc.Conv2d(16, 16, 3, padding=1, groups=16, rng=3), pc.ReLU(), pc.Flatten(),
                          pc.Linear(16 * 4 * 4, 5, rng=4),
                          backend="openmp" if "openmp" in BACKENDS else "numpy")
    x = np.random.default_rng(2).standard_normal((16, 3, 16, 16)).astype(np.float32)
    return Q.quantize(model.eval(), x)


#: int8 models whose QDQ export is checked against onnxruntime and loaded back (tests/test_onnx_coverage.py reads it)
ONNX_MODELS = {"small": (_small_int8, (1, 2, 10, 10)), "resnet20": (_int8_resnet, (1, 3, 32, 32)),
               "pooled": (_pooled_int8, (1, 3, 16, 16))}


def _onnx():
    pytest.importorskip("onnx", reason="onnx not installed")
    return pytest.importorskip("onnxruntime", reason="onnxruntime not installed")


def _ort(ort, path, x, optimize: bool):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


@pytest.mark.parametrize("name", list(ONNX_MODELS))
def test_qdq_export_runs_in_onnxruntime_and_loads_back_bit_identical(tmp_path, name):
    ort = _onnx()
    import onnx

    make, shape = ONNX_MODELS[name]
    qmodel = make()
    path = tmp_path / f"{name}.onnx"
    pc.onnx.export(qmodel, path, shape)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    inits = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    first = next(k for k in inits if k.endswith("weight") and inits[k].data_type == onnx.TensorProto.INT8)
    assert first  # int8 weight initializers
    x = np.random.default_rng(5).standard_normal((3,) + shape[1:]).astype(np.float32)
    want = pc.to_numpy(qmodel(x))
    # the reference QDQ semantics (dequantize, float op): equal up to float32 rounding of the dequantized products,
    # which now and then moves a value across a rounding boundary of a QuantizeLinear (one step of that tensor; a
    # ResNet has two per block: the body's input and the identity shortcut's)
    exact = _ort(ort, path, x, optimize=False)
    np.testing.assert_allclose(exact, want, rtol=0, atol=5e-3 * np.abs(want).max())
    # fused into QLinearConv / QGemm, which requantise between layers in integers: one step of a layer's input
    fused = _ort(ort, path, x, optimize=True)
    np.testing.assert_allclose(fused, want, rtol=0, atol=1e-2 * np.abs(want).max())
    assert (fused.argmax(1) == want.argmax(1)).all()
    for backend in BACKENDS:
        loaded = pc.onnx.load(path, backend=backend)
        assert [type(m).__name__ for m in loaded.modules() if "Quant" in type(m).__name__] == \
            [type(m).__name__ for m in qmodel.modules() if "Quant" in type(m).__name__]
        got = pc.to_numpy(loaded(x))
        if name == "resnet20" and backend == "openmp" and Q.int8_path() != "float32 emulation":
            # the loaded blocks (an Add of two branches, the identity's Q/DQ pair) stay uint8 as the original's do
            links = [type(link).__name__ for link, _, _ in loaded.plan()[0].step.links]
            assert links.count("_ResidualLink") == 9, links
        if backend == qmodel.backend.name:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


def test_onnxruntime_quantize_static_qdq_graphs_load(tmp_path):
    ort = _onnx()
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    model, x = _zoo("mobilenet-small", "numpy", np.random.default_rng(2))
    pc.onnx.export(model, tmp_path / "f.onnx", (1, 3, 32, 32))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": x[i:i + 16]} for i in range(0, 32, 16)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    loaded = pc.onnx.load(tmp_path / "q.onnx", backend="numpy")
    kinds = [type(m).__name__ for m in loaded.modules()]
    assert kinds.count("QuantizedConv2d") == 13 and kinds.count("QuantizedLinear") == 1
    want = _ort(ort, tmp_path / "q.onnx", x[32:], optimize=False)
    np.testing.assert_allclose(loaded.predict(x[32:]), want, rtol=0, atol=1e-2 * np.abs(want).max())


def test_qdq_load_refuses_malformed_quantization(tmp_path):
    _onnx()
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def write(nodes, inits, name):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
                                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])],
                                  initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path

    base = {"s": np.array(0.1, np.float32), "z": np.array(3, np.uint8), "w": np.ones((3, 4), np.int8),
            "ws": np.full(3, 0.5, np.float32), "wz": np.zeros(3, np.int8)}
    dq_w = helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0)
    good = [helper.make_node("QuantizeLinear", ["input", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]), dq_w,
            helper.make_node("Gemm", ["d", "wf"], ["output"], transB=1)]
    loaded = pc.onnx.load(write(good, base, "good"), backend="numpy")
    assert type(loaded[0]).__name__ == "QuantizedLinear" and loaded[0].input_zero_point[0] == 3
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x), Q.requantize(Q.linear_int8_reference(
        Q.quantize_per_tensor(x, 0.1, 3), 3, base["w"]), None, Q.requant_scale(0.1, base["ws"])))
    bad_scale = dict(base, s=np.array(-1.0, np.float32))
    with pytest.raises(ValueError, match="positive finite"):
        pc.onnx.load(write(good, bad_scale, "neg"), backend="numpy")
    bad_axis = [good[0], good[1], helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=5), good[3]]
    with pytest.raises(ValueError, match="axis"):
        pc.onnx.load(write(bad_axis, base, "axis"), backend="numpy")
    bad_zp = dict(base, wz=np.zeros(2, np.int8))
    with pytest.raises(ValueError, match="zero point"):
        pc.onnx.load(write(good, bad_zp, "zp"), backend="numpy")
    mismatch = [good[0], helper.make_node("DequantizeLinear", ["q", "ws2", "z"], ["d"]), dq_w, good[3]]
    with pytest.raises(ValueError, match="other parameters"):
        pc.onnx.load(write(mismatch, dict(base, ws2=np.array(0.2, np.float32)), "mismatch"), backend="numpy")
    lonely = [helper.make_node("QuantizeLinear", ["input", "s", "z"], ["q"]),
              helper.make_node("Cast", ["q"], ["c"], to=TensorProto.FLOAT), dq_w,
              helper.make_node("Gemm", ["c", "wf"], ["output"], transB=1)]
    with pytest.raises(ValueError, match="Cast|other than DequantizeLinear"):
        pc.onnx.load(write(lonely, base, "lonely"), backend="numpy")
    with pytest.warns(UserWarning, match="-128"):
        loaded = pc.onnx.load(write(good, dict(base, w=np.full((3, 4), -128, np.int8)), "m128"), backend="numpy")
    assert [type(m).__name__ for m in loaded] == ["QuantDequant", "Linear"]


def test_dequantize_and_requantize_refuse_what_they_would_misread():
    q = np.array([0, 128, 255], np.uint8)
    with pytest.raises(TypeError, match="q must be uint8"):
        Q.dequantize_per_tensor(np.array([2.7, -5.0, 300.0]), 0.5, 128)
    for scale in (-0.5, 0.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            Q.dequantize_per_tensor(q, scale, 3)
    for zp in (3.9, -1, 256, True):
        with pytest.raises(ValueError, match="zero_point must be an int in 0..255"):
            Q.dequantize_per_tensor(q, 0.5, zp)
    acc = np.zeros((1, 2, 3, 3), np.int64)
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        Q.requantize(acc, None, np.ones(2, np.float32), residual=np.zeros((4, 2, 3, 3), np.float32))
    with pytest.raises(TypeError, match="dequantize a uint8 shortcut"):
        Q.requantize(acc, None, np.ones(2, np.float32), residual=np.full((1, 2, 3, 3), 200, np.uint8))


def _int8_mod():
    return Q._int8_module()


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
def test_chains_run_their_recorded_calls_with_the_bits_of_the_calls_themselves(monkeypatch):
    # a chain records its kernels' checked calls for an input shape and runs them again on its own buffers: the
    # same bits as the calls made one by one, recorded again whenever a layer, the thread count or the kernels'
    # path changes, every result a fresh array, and a batch too large to keep runs the calls themselves
    rng = np.random.default_rng(21)
    net = _residual_net(rng)
    model = pc.Sequential(*net.layers[:3], pc.MaxPool2d(2), *net.layers[3:], backend="numpy").eval()
    qmodel = Q.quantize(model, rand(rng, 16, 3, 12, 12))
    qmodel.to("openmp")
    chain = qmodel.plan()[0].step
    assert isinstance(chain, Q._Int8Chain)

    def run(x):
        with pc.no_grad():
            return qmodel.forward(x)

    def unplanned(x):
        with monkeypatch.context() as m:
            m.setattr(Q, "_PLAN_BYTES", -1)
            return run(x)

    x1, x2 = rand(rng, 2, 3, 12, 12), rand(rng, 2, 3, 12, 12)
    want1, want2 = unplanned(x1), unplanned(x2)
    assert not chain._plans
    y1 = run(x1)
    recorded = chain._plans[0]
    y2 = run(x2)
    assert recorded[2] is not None and chain._plans == [recorded]  # run again, not recorded again
    np.testing.assert_array_equal(y1, want1)  # not overwritten by the second call
    np.testing.assert_array_equal(y2, want2)
    np.testing.assert_array_equal(qmodel.predict(x1), want1)
    assert chain._plans == [recorded]
    for threads in (1, 3):
        with pc.num_threads(threads):
            np.testing.assert_array_equal(run(x1), want1)
            assert chain._plans[0][0][1] == threads  # recorded for this thread count
    int8 = _int8_mod()
    for use, value in ([(int8._use_path, p) for p in int8._paths()]
                       + [(int8._use_depthwise, mode) for mode in ("planes", "blocks")]):
        old = use(value)
        try:
            np.testing.assert_array_equal(run(x1), want1)
            assert chain._plans[0][0][2] == int8._state()  # recorded for this kernel path and depthwise layout
        finally:
            use(old)
    # a layer's new state (its bias) and a ReLU switched off: recorded again
    conv = next(m for m in qmodel.modules() if isinstance(m, Q.QuantizedConv2d) and m.bias is not None)
    run(x1)
    before = chain._plans[0]
    conv.set_quantized(-conv.weight, conv.weight_scale, conv.bias + 5, conv.input_scale, conv.input_zero_point)
    changed = unplanned(x1)
    assert not np.array_equal(changed, want1)
    np.testing.assert_array_equal(run(x1), changed)
    assert chain._plans[0] is not before
    relu = next(m for m in chain._quantized if m.relu)
    before = chain._plans[0]
    relu.relu = False  # (the next layer's zero point may clamp the same values: the bits need not change)
    np.testing.assert_array_equal(run(x1), unplanned(x1))
    assert chain._plans[0] is not before
    with pytest.raises(TypeError, match="relu must be a bool"):
        relu.relu = 1
    # two input shapes alternating (a batch and a last, smaller one): both stay recorded
    x3 = rand(rng, 3, 3, 12, 12)
    want3, want1 = unplanned(x3), unplanned(x1)
    run(x1)
    first = chain._plans[0]
    for _ in range(2):
        np.testing.assert_array_equal(run(x3), want3)
        np.testing.assert_array_equal(run(x1), want1)
    assert chain._plans[0] is first and len(chain._plans) == 2
    # too large to keep: the calls run themselves, nothing is recorded for that shape
    monkeypatch.setattr(Q, "_PLAN_BYTES", 1000)
    big = rand(rng, 4, 3, 12, 12)
    got = run(big)
    assert all(p[0][0] != big.shape for p in chain._plans)
    monkeypatch.setattr(Q, "_PLAN_BYTES", 16 << 20)
    np.testing.assert_array_equal(run(big), got)


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
def test_threads_sharing_a_quantized_model_get_their_own_results(monkeypatch):
    # the recorded calls share buffers: a second thread in the same chain runs the calls itself
    import threading

    rng = np.random.default_rng(22)
    qmodel = Q.quantize(_residual_net(rng), rand(rng, 16, 3, 12, 12))
    qmodel.to("openmp")
    xs = [rand(rng, 1, 3, 12, 12) for _ in range(4)]
    with monkeypatch.context() as m:
        m.setattr(Q, "_PLAN_BYTES", -1)  # the calls one by one
        wants = [qmodel.predict(x) for x in xs]
    bad = []

    def work(k):
        with pc.no_grad():
            for _ in range(60):
                if not np.array_equal(qmodel.forward(xs[k]), wants[k]):
                    bad.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


@pytest.mark.skipif(_int8_mod() is None or not hasattr(_int8_mod(), "Plan"), reason="the native int8 kernels")
def test_plan_checks_its_steps_and_inputs():
    int8 = _int8_mod()
    rng = np.random.default_rng(3)
    packed, row_sums = int8.pack_weights(rng.integers(-127, 128, (8, 16), dtype=np.int8))
    x = rand(rng, 1, 16, 4, 4)
    xq, y = np.empty(x.shape, np.uint8), np.empty((1, 8, 4, 4), np.float32)
    quant = int8.quantize(x.reshape(-1), 0.1, 3, xq.reshape(-1), 1, step=True)
    conv = int8.conv2d_forward(xq, 3, packed, row_sums, 8, 1, 1, 0, np.ones(8, np.float32), None, y, True, 1,
                               step=True)
    with pytest.raises(TypeError, match="prepared calls"):
        int8.Plan([quant, "conv"], x.shape, y.shape)
    with pytest.raises(ValueError, match="first step must be a quantize step"):
        int8.Plan([conv], x.shape, y.shape)
    yq = np.empty(y.shape, np.uint8)
    to_u8 = int8.conv2d_forward(xq, 3, packed, row_sums, 8, 1, 1, 0, np.ones(8, np.float32), None, None, True, 1,
                                yq=yq, yq_scale=0.5, yq_zero_point=0, step=True)
    with pytest.raises(ValueError, match="last step must write a float32 output"):
        int8.Plan([quant, to_u8], x.shape, y.shape)
    with pytest.raises(ValueError, match="must hold the first step's 256 inputs and the last step's 128 outputs"):
        int8.Plan([quant, conv], x.shape, (1, 1))
    with pytest.raises(ValueError, match="must hold the first step's 256 inputs"):
        int8.Plan([quant, conv], (1, 16, 2, 2), y.shape)
    with pytest.raises(TypeError, match="prepared calls"):
        int8.Plan([quant, type(conv)(), conv], x.shape, y.shape)  # an empty step
    with pytest.raises(TypeError, match="quantize: step must be True or False, got 1"):
        int8.quantize(x.reshape(-1), 0.1, 3, xq.reshape(-1), 1, step=1)
    plan = int8.Plan([quant, conv], x.shape, y.shape)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 16, 4, 4\)"):
        plan.run(x[:, :8], np.empty_like(y))
    with pytest.raises(TypeError, match="out must have dtype float32"):
        plan.run(x, np.empty(y.shape, np.float64))
    for x in (x, rand(rng, 1, 16, 4, 4)):  # each run reads the x it is given
        out = plan.run(x, np.empty_like(y))
        ref, xr = np.empty_like(y), np.empty_like(xq)
        int8.quantize(x.reshape(-1), 0.1, 3, xr.reshape(-1), 1)
        int8.conv2d_forward(xr, 3, packed, row_sums, 8, 1, 1, 0, np.ones(8, np.float32), None, ref, True, 1)
        np.testing.assert_array_equal(out, ref)


@pytest.mark.skipif("openmp" not in BACKENDS or Q.int8_path() == "float32 emulation",
                    reason="chains run the native int8 kernels of the openmp backend")
def test_recorded_linear_layers_pad_each_new_input():
    # a linear layer whose features are not a multiple of 4 copies its input into a padded buffer: in a recorded
    # chain that copy runs at every call, so a second input gives its own answer
    rng = np.random.default_rng(23)
    model = pc.Sequential(pc.Conv2d(3, 6, 3, rng=0), pc.ReLU(), pc.Flatten(), pc.Linear(6 * 3 * 3, 7, rng=1),
                          pc.ReLU(), pc.Linear(7, 3, rng=2), backend="numpy").eval()
    qmodel = Q.quantize(model, rand(rng, 16, 3, 5, 5))
    xs = [rand(rng, 2, 3, 5, 5) for _ in range(3)]
    wants = [qmodel.predict(x) for x in xs]
    qmodel.to("openmp")
    assert _chain_steps(qmodel) == 1
    chain = qmodel.plan()[0].step
    with pc.no_grad():
        for x, want in zip(xs + xs, wants + wants):
            np.testing.assert_array_equal(qmodel.forward(x), want)
    assert len(chain._plans) == 1 and chain._plans[0][2] is not None  # one recording, run six times
