"""bf16 mixed precision: ``pc.autocast``, the bf16 ops on every backend, ``fit(precision=)`` and the CLI flag.

The ops are checked against the NumPy model of the kernels' contract: every
input of a product rounded to bf16 (nearest, ties to even), products and sums
in float64 here, the bias unrounded, db the sum of the unrounded dy; a backend
passes when it is within 1e-5 of the sum of the terms' magnitudes (accumulation
order is free) and clearly farther from the float32 answer where the rounding
matters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from parconv.amp import round_to_bf16_numpy
from conftest import HAVE_TORCH, host
from test_conv_general import conv_general_case

ORACLE = pc.backends.get("numpy")
# the folder holding the imported parconv (a source tree or site-packages): children run it with "-P"
PARCONV_HOME = os.path.dirname(os.path.dirname(os.path.abspath(pc.__file__)))


def r16(a):
    return None if a is None else round_to_bf16_numpy(a).astype(np.float64)


def f64(a):
    return None if a is None else np.asarray(a, np.float64)


def assert_model(actual, expected, magnitude, what):
    """``|actual - expected| <= 1e-5 * magnitude + 1e-30`` elementwise (magnitude: the sum of |terms|)."""
    a = host(actual).astype(np.float64)
    assert a.shape == expected.shape, f"{what}: shape {a.shape} != {expected.shape}"
    err = np.abs(a - expected)
    bound = 1e-5 * magnitude + 1e-30
    worst = np.argmax(err - bound) if err.size else 0
    assert np.all(err <= bound), (f"{what}: error {err.flat[worst]:.3g} above {bound.flat[worst]:.3g} "
                                  f"(value {a.flat[worst]}, model {expected.flat[worst]})")


def general_args(x_shape, w_shape, kwargs):
    _, stride, pads, dilation, groups = F._conv_args(x_shape, w_shape, kwargs["stride"], kwargs["padding"],
                                                     kwargs["dilation"], kwargs["groups"], "test")
    return stride, pads, dilation, groups


def conv_model(x, w, b, dy, kwargs):
    """(y, dx, dw, db) of the bf16 model and the magnitudes their errors are measured against."""
    stride, pads, dilation, groups = general_args(x.shape, w.shape, kwargs)
    fwd = lambda a, c, bias: ORACLE.conv2d_general_forward(a, c, bias, stride, pads, dilation, groups)  # noqa: E731
    bwd = lambda a, c, d: ORACLE.conv2d_general_backward(a, c, d, stride, pads, dilation, groups)  # noqa: E731
    y = fwd(r16(x), r16(w), f64(b))
    y_mag = fwd(np.abs(r16(x)), np.abs(r16(w)), None if b is None else np.abs(f64(b)))
    dx, dw, _ = bwd(r16(x), r16(w), r16(dy))
    dx_mag, dw_mag, _ = bwd(np.abs(r16(x)), np.abs(r16(w)), np.abs(r16(dy)))
    db = f64(dy).sum(axis=(0, 2, 3))
    db_mag = np.abs(f64(dy)).sum(axis=(0, 2, 3))
    return (y, dx, dw, db), (y_mag, dx_mag, dw_mag, db_mag)


# ---------------------------------------------------------------------------- the context manager
def test_autocast_switches_the_mode_and_restores_it():
    assert not pc.is_autocast_enabled()
    assert pc.get_autocast_dtype() == "bf16"
    with pc.autocast("bf16") as ctx:
        assert pc.is_autocast_enabled()
        assert ctx.dtype == "bf16" and ctx.enabled
        with pc.autocast(enabled=False):
            assert not pc.is_autocast_enabled()
            with pc.autocast("bfloat16"):
                assert pc.is_autocast_enabled()
            assert not pc.is_autocast_enabled()
        assert pc.is_autocast_enabled()
    assert not pc.is_autocast_enabled()


def test_autocast_restores_the_mode_after_an_exception():
    with pytest.raises(KeyError):
        with pc.autocast("bf16"):
            with pc.autocast(enabled=False):
                raise KeyError("boom")
    assert not pc.is_autocast_enabled()
    with pc.autocast("bf16"):
        with pytest.raises(RuntimeError):
            with pc.autocast(enabled=False):
                raise RuntimeError
        assert pc.is_autocast_enabled()


def test_autocast_as_a_decorator_and_on_generators():
    @pc.autocast("bf16")
    def inside():
        return pc.is_autocast_enabled()

    @pc.autocast()
    def gen():
        yield pc.is_autocast_enabled()
        yield pc.is_autocast_enabled()

    assert inside() is True and not pc.is_autocast_enabled()
    it = gen()
    assert next(it) is True
    assert not pc.is_autocast_enabled()  # only while the generator's body runs
    assert next(it) is True
    with pytest.raises(TypeError, match="decorate a function"):
        pc.autocast("bf16")(3)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"dtype": "fp16"}, ValueError, "float16 has no fast CPU path"),
    ({"dtype": "int8"}, ValueError, "dtype must be 'bf16'"),
    ({"dtype": "cpu"}, ValueError, "takes the dtype, not torch.autocast's device_type"),
    ({"dtype": "float16"}, ValueError, "float16 has no fast CPU path"),
    ({"dtype": 16}, TypeError, "dtype must be a string"),
    ({"enabled": "yes"}, TypeError, "enabled must be a bool"),
])
def test_autocast_rejects_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        pc.autocast(**kwargs)
    assert not pc.is_autocast_enabled()


def test_autocast_is_thread_local():
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait(10)
        seen["other"] = pc.is_autocast_enabled()
        with pc.autocast("bf16"):
            seen["other_inside"] = pc.is_autocast_enabled()
            release.set()

    t = threading.Thread(target=other)
    t.start()
    with pc.autocast("bf16"):
        entered.set()
        release.wait(10)
        seen["main"] = pc.is_autocast_enabled()
    t.join(10)
    assert seen == {"other": False, "other_inside": True, "main": True}
    assert not pc.is_autocast_enabled()


def test_precision_arguments_are_validated():
    x, w = np.ones((1, 2)), np.ones((3, 2))
    with pytest.raises(ValueError, match="linear: precision must be 'fp32' or 'bf16', got 'fp16'"):
        F.linear(x, w, precision="fp16", backend="numpy")
    with pytest.raises(TypeError, match="precision must be a string"):
        F.conv2d(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)), precision=16, backend="numpy")


# ---------------------------------------------------------------------------- rounding
def test_rounding_model_rounds_to_nearest_even_and_keeps_nan():
    one = 1.0
    x = np.array([one, one + 2**-8, one + 3 * 2**-8, one + 2**-8 + 2**-20, -(one + 2**-8), 3.4e38, np.inf, -np.inf,
                  0.0, -0.0], np.float32)
    want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -1.0, np.inf, np.inf, -np.inf, 0.0, -0.0], np.float32)
    got = round_to_bf16_numpy(x)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    nans = np.array([0x7F800001, 0xFFC00000, 0x7FBFFFFF], np.uint32).view(np.float32)
    assert np.isnan(round_to_bf16_numpy(nans)).all()
    assert (round_to_bf16_numpy(np.random.default_rng(0).standard_normal(1000)).view(np.uint32) & 0xFFFF == 0).all()


def test_every_backend_rounds_like_the_model(backend):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(999).astype(np.float32) * 50,
                        np.array([1 + 2**-8, 1 + 3 * 2**-8, np.inf, np.nan], np.float32)])
    got = host(backend.round_to_bf16(backend.asarray(x))).astype(np.float32)
    want = round_to_bf16_numpy(x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert got[ok].view(np.uint32).tolist() == want[ok].view(np.uint32).tolist()
    assert pc.amp.round_to_bf16(x)[ok].view(np.uint32).tolist() == want[ok].view(np.uint32).tolist()


# ---------------------------------------------------------------------------- the ops under autocast
@st.composite
def square_conv_case(draw):
    n, c, o = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    k, s, p = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(0, 2))
    h = draw(st.integers(max(1, k - 2 * p), 10))
    return (n, c, h, h), (o, c, k, k), {"stride": s, "padding": p, "dilation": 1, "groups": 1}, \
        draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def _run_conv_case(backend, case):
    x_shape, w_shape, kwargs, bias, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32) if bias else None
    with pc.autocast("bf16"):
        y = F.conv2d(x, w, b, **kwargs, backend=backend)
    dy = rng.standard_normal(host(y).shape).astype(np.float32)
    with pc.autocast("bf16"):
        dx, dw, db = F.conv2d_backward(x, w, dy, **kwargs, need_db=bias, backend=backend)
    (my, mdx, mdw, mdb), mags = conv_model(x, w, b, dy, kwargs)
    assert_model(y, my, mags[0], "y")
    assert_model(dx, mdx, mags[1], "dx")
    assert_model(dw, mdw, mags[2], "dw")
    if bias:
        assert_model(db, mdb, mags[3], "db")
    else:
        assert db is None
    # explicit precision= gives the same as the mode; without autocast the op is float32 again
    y2 = F.conv2d(x, w, b, **kwargs, precision="bf16", backend=backend)
    np.testing.assert_array_equal(host(y2), host(y))


@given(square_conv_case())
def test_conv2d_square_under_autocast_matches_the_bf16_model(backend, case):
    _run_conv_case(backend, case)


@given(conv_general_case())
def test_conv2d_general_under_autocast_matches_the_bf16_model(backend, case):
    """Grouped, depthwise (with multipliers), dilated, rectangular, strided, "same" padding."""
    _run_conv_case(backend, case)


@given(st.integers(1, 9), st.integers(1, 70), st.integers(1, 12), st.booleans(), st.integers(0, 2**31 - 1))
def test_linear_under_autocast_matches_the_bf16_model(backend, n, f, g, bias, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, f)).astype(np.float32)
    w = (rng.standard_normal((g, f)) / np.sqrt(f)).astype(np.float32)
    b = rng.standard_normal(g).astype(np.float32) if bias else None
    dy = rng.standard_normal((n, g)).astype(np.float32)
    with pc.autocast("bf16"):
        y = F.linear(x, w, b, backend=backend)
        dx, dw, db = F.linear_backward(x, w, dy, need_db=bias, backend=backend)
    assert_model(y, r16(x) @ r16(w).T + (0 if b is None else f64(b)),
                 np.abs(r16(x)) @ np.abs(r16(w)).T + (0 if b is None else np.abs(f64(b))), "y")
    assert_model(dx, r16(dy) @ r16(w), np.abs(r16(dy)) @ np.abs(r16(w)), "dx")
    assert_model(dw, r16(dy).T @ r16(x), np.abs(r16(dy)).T @ np.abs(r16(x)), "dw")
    if bias:
        assert_model(db, f64(dy).sum(0), np.abs(f64(dy)).sum(0), "db")


def test_bf16_is_really_used(backend):
    """Inputs with bits below bf16's 8: the fp32 op keeps them, the bf16 op must not."""
    x = np.full((2, 64), 1 + 2**-9 + 2**-12, np.float32)  # rounds to 1.0 in bf16
    w = np.ones((3, 64), np.float32)
    y32 = host(F.linear(x, w, backend=backend))
    with pc.autocast("bf16"):
        y16 = host(F.linear(x, w, backend=backend))
    np.testing.assert_allclose(y16, 64.0, rtol=0, atol=1e-6)
    assert np.all(y32 > 64.1)
    # on the winograd-sized 3x3 layers the emulation must stay direct: exact for bf16-representable data
    rng = np.random.default_rng(0)
    xc = round_to_bf16_numpy(rng.integers(-4, 5, (4, 16, 12, 12)).astype(np.float32))
    wc = round_to_bf16_numpy(rng.integers(-2, 3, (16, 16, 3, 3)).astype(np.float32))
    with pc.autocast("bf16"):
        yc = host(F.conv2d(xc, wc, padding=1, backend=backend))
    exact = ORACLE.conv2d_forward(f64(xc), f64(wc), None, 1, 1)
    np.testing.assert_array_equal(yc, exact)


# ---------------------------------------------------------------------------- layers: the recorded precision
def _conv_layer(backend):
    layer = pc.Conv2d(3, 4, kernel_size=3, padding=1, backend=backend, rng=0)
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32) * (1 + 2**-10)
    dy = np.random.default_rng(3).standard_normal((2, 4, 6, 6)).astype(np.float32)
    return layer, x, dy


def test_backward_after_the_block_runs_in_the_forwards_precision(backend):
    layer, x, dy = _conv_layer(backend)
    w = host(layer.weight.data)
    want = [host(a) for a in F.conv2d_backward(x, w, dy, padding=1, precision="bf16", backend=backend)]
    want32 = [host(a) for a in F.conv2d_backward(x, w, dy, padding=1, precision="fp32", backend=backend)]
    assert not np.allclose(want[1], want32[1], rtol=1e-4, atol=1e-5)
    with pc.autocast("bf16"):
        layer(x)
    dx = layer.backward(dy)  # after the block: still bf16
    np.testing.assert_array_equal(host(dx), want[0])
    np.testing.assert_array_equal(host(layer.weight.grad), want[1])
    np.testing.assert_array_equal(host(layer.bias.grad), want[2])
    layer(x)  # float32 forward; a backward inside autocast stays float32
    with pc.autocast("bf16"):
        dx = layer.backward(dy)
    np.testing.assert_array_equal(host(layer.weight.grad), want32[1])
    with pc.autocast("bf16"):
        with pc.autocast(enabled=False):  # nested: float32 inside
            layer(x)
        layer.backward(dy)
    np.testing.assert_array_equal(host(layer.weight.grad), want32[1])


def test_linear_layer_records_its_precision(backend):
    layer = pc.Linear(40, 5, backend=backend, rng=0)
    x = np.random.default_rng(4).standard_normal((3, 40)).astype(np.float32)
    dy = np.random.default_rng(5).standard_normal((3, 5)).astype(np.float32)
    w = host(layer.weight.data)
    with pc.autocast("bf16"):
        y = layer(x)
    np.testing.assert_array_equal(host(y), host(F.linear(x, w, host(layer.bias.data), precision="bf16",
                                                           backend=backend)))
    layer.backward(dy)
    _, dw, _ = F.linear_backward(x, w, dy, precision="bf16", backend=backend)
    np.testing.assert_array_equal(host(layer.weight.grad), host(dw))


def _seq(backend, fuse, bn=False):
    rng = np.random.default_rng(0)
    layers = [pc.Conv2d(1, 4, kernel_size=3, rng=rng)]
    if bn:
        layers.append(pc.BatchNorm2d(4))
    layers += [pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(), pc.Linear(4 * 13 * 13, 3, rng=rng)]
    return pc.Sequential(*layers, backend=backend, fuse=fuse)


@pytest.mark.parametrize("bn", [False, True], ids=["conv-relu-pool-head", "conv-bn-eval"])
def test_fused_steps_run_bf16_under_autocast(backend, bn):
    """Fused conv+ReLU+maxpool(+linear head) and conv+BN folding compose around the bf16 conv, never fp32."""
    fused, plain = _seq(backend, True, bn), _seq(backend, False, bn)
    if bn:
        for m in (fused, plain):
            m.layers[1].running_mean[...] = backend.asarray(np.linspace(-0.2, 0.2, 4))
            m.layers[1].running_var[...] = backend.asarray(np.linspace(0.5, 2.0, 4))
            m.eval()
    assert pc._fusion.count_fused(fused.plan()) >= 1
    x = np.random.default_rng(6).standard_normal((3, 1, 28, 28)).astype(np.float32) * (1 + 2**-10)
    dy = np.random.default_rng(7).standard_normal((3, 3)).astype(np.float32)
    y32 = host(fused(x))
    with pc.autocast("bf16"):
        y_fused = host(fused(x))
        y_plain = host(plain(x))
    np.testing.assert_allclose(y_fused, y_plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y_fused, y32, rtol=1e-5, atol=1e-6)
    fused.backward(dy)  # after the block: bf16, as the unfused layers' backward
    plain.backward(dy)
    for pf, pp in zip(fused.parameters(), plain.parameters()):
        np.testing.assert_allclose(host(pf.grad), host(pp.grad), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- training
def _mnist(n_train, n_test):
    x, y = pc.datasets.load_mnist("test")
    return (x[:n_train], y[:n_train]), (x[-n_test:], y[-n_test:])


@pytest.mark.parametrize("name", ["openmp", pytest.param("numpy", marks=pytest.mark.slow)])
def test_bf16_training_reaches_fp32_accuracy(name):
    if name not in pc.available_backends():
        pytest.skip(f"{name} not available")
    (xtr, ytr), (xte, yte) = _mnist(2000, 1000)
    acc = {}
    for precision in ("fp32", "bf16"):
        model = pc.models.cnn_mnist(filters=8, rng=0).to(name)  # the same start whatever ran before
        seen = []
        hist = model.fit(xtr, ytr, epochs=3, batch_size=50, optimizer=pc.optim.SGD(model.parameters(), lr=0.05,
                                                                                      momentum=0.9),
                         seed=0, verbose=False, precision=precision,
                         callbacks=[lambda epoch, logs: seen.append(pc.is_autocast_enabled())])
        assert seen == [precision == "bf16"] * 3
        assert not pc.is_autocast_enabled()
        assert all(p.data.dtype == np.float32 for p in model.parameters())  # master weights stay fp32
        with pc.autocast(enabled=precision == "bf16"):
            acc[precision] = model.evaluate(xte, yte)["accuracy"]
        assert np.isfinite(hist["loss"]).all()
    assert acc["fp32"] > 0.8
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.02, acc


@pytest.mark.slow
@pytest.mark.parametrize("net", ["resnet20", "mobilenet-small"])  # no dropout: the same step in both
def test_bf16_network_gradients_as_accurate_as_pytorch_bf16(net):
    """A zoo network's training-mode gradients under bf16 (batch 8), on every bf16 kernel path this
    CPU runs, against float64: as close as the NumPy model of the same rounding and no farther than
    PyTorch's bf16 autocast; with the same bits at a fixed thread count. bf16 behind a BatchNorm
    leaves about a quarter of the gradient's norm as noise in both frameworks, so the measure is the
    relative L2 error of all gradients together."""
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp not available")
    from parconv._config import num_threads
    from test_conv_precision import precision  # bench/precision.py

    try:
        from parconv._ext import _bf16
        paths = [True, False] if _bf16.amx() else [None]
    except ImportError:
        _bf16, paths = None, [None]
    shape = pc.models.ZOO[net][1]
    for seed in (5, 8):
        model = precision.build(net, seed)
        state = model.state_dict()
        x, y = precision.data(8, seed, shape)
        ref = precision.numpy64_grads(model, state, x, y)
        model_err = precision.relative_l2(precision.parconv_grads(model, state, x, y, "numpy", bf16=True), ref)
        torch_err = None
        if HAVE_TORCH:
            torch_err = precision.relative_l2(precision.torch_grads(model, state, x, y, "bfloat16"), ref)
            assert precision.relative_l2(precision.torch_grads(model, state, x, y, "float64"), ref) < 1e-5
        for amx in paths:
            old = _bf16._set_amx(amx) if amx is not None else None
            try:
                with num_threads(2):
                    got = precision.parconv_grads(model, state, x, y, "openmp", bf16=True)
                    again = precision.parconv_grads(model, state, x, y, "openmp", bf16=True)
            finally:
                if old is not None:
                    _bf16._set_amx(old)
            assert all(np.array_equal(got[k], again[k]) for k in got)
            err = precision.relative_l2(got, ref)
            what = f"{net} seed {seed} ({'AMX' if amx else 'AVX-512' if amx is False else 'default'} path)"
            assert 1e-3 < err <= 1.1 * model_err + 0.01, f"{what}: {err:.3f} off float64, the model {model_err:.3f}"
            if torch_err is not None:
                assert err <= 1.1 * torch_err, f"{what}: {err:.3f} off float64, PyTorch bf16 {torch_err:.3f}"


def test_fit_precision_fp32_overrides_an_outer_autocast_and_is_validated():
    (xtr, ytr), _ = _mnist(40, 1)
    model = pc.Sequential(pc.Flatten(), pc.Linear(784, 10), backend="numpy")
    seen = []
    with pc.autocast("bf16"):
        model.fit(xtr, ytr, epochs=1, batch_size=20, verbose=False, precision="fp32",
                  callbacks=[lambda e, logs: seen.append(pc.is_autocast_enabled())])
        model.fit(xtr, ytr, epochs=1, batch_size=20, verbose=False,  # None: the caller's mode
                  callbacks=[lambda e, logs: seen.append(pc.is_autocast_enabled())])
    assert seen == [False, True]
    with pytest.raises(ValueError, match="fit: precision must be 'fp32' or 'bf16', got 'int8'"):
        model.fit(xtr, ytr, precision="int8", verbose=False)
    with pytest.raises(TypeError, match="precision must be a string"):
        model.fit(xtr, ytr, precision=16, verbose=False)


def test_bf16_checkpoint_weights_stay_fp32(tmp_path):
    (xtr, ytr), _ = _mnist(40, 1)
    model = pc.Sequential(pc.Flatten(), pc.Linear(784, 10), backend="numpy")
    model.fit(xtr, ytr, epochs=1, batch_size=20, verbose=False, precision="bf16")
    model.save(tmp_path / "m.npz")
    again = pc.load(tmp_path / "m.npz")
    for a, b in zip(model.parameters(), again.parameters()):
        assert b.data.dtype == np.float32
        np.testing.assert_array_equal(host(a.data), host(b.data))
    # the trained weights are not bf16-rounded: the master copy keeps every float32 bit
    w = host(model.layers[1].weight.data)
    assert (w.view(np.uint32) & 0xFFFF).any()


# ---------------------------------------------------------------------------- command line and reports
def test_cli_train_precision_flag(capsys):
    from parconv.cli import main

    rc = main(["train", "--precision", "bf16", "--epochs", "1", "--train-size", "200", "--filters", "4", "--quiet",
               "--checkpoint", ""])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bf16 autocast (" in out and "test accuracy" in out
    with pytest.raises(SystemExit) as exc:
        main(["train", "--precision", "fp16", "--quiet"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_show_config_and_info_say_how_bf16_runs(capsys):
    cfg = pc.show_config(mode="dicts")
    bf16 = cfg["kernels"]["bf16"]
    assert bf16["mode"] in ("native", "emulated") and bf16["why"]
    feats = pc._ext.STATE.get("features", {})
    if not feats.get("avx512_bf16"):
        assert bf16["mode"] == "emulated" and "AVX512_BF16" in bf16["why"]
    pc.show_config()
    assert "bf16 (autocast): " in capsys.readouterr().out
    from parconv.cli import main

    assert main(["info"]) == 0
    assert "bf16 (autocast): " in capsys.readouterr().out


_ISA_SCRIPT = r"""
import numpy as np, parconv as pc, parconv.functional as F
from parconv.amp import round_to_bf16_numpy as r
assert pc._ext.STATE["level"] == "{level}", pc._ext.STATE
be = pc.backends.get("openmp")
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 8, 10, 10)).astype(np.float32)
w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32) / 8
dy = rng.standard_normal((2, 16, 10, 10)).astype(np.float32)
with pc.autocast("bf16"):
    y = F.conv2d(x, w, padding=1, backend=be)
    dx, dw, db = F.conv2d_backward(x, w, dy, padding=1, backend=be)
    yd = F.conv2d(x, w[:8, :1], padding=1, groups=8, backend=be)
    wl = rng.standard_normal((16, 800)).astype(np.float32) / 30
    yl = F.linear(x.reshape(2, -1), wl, backend=be)
ref = pc.backends.get("numpy")
f = lambda a: r(a).astype(np.float64)
my = ref.conv2d_forward(f(x), f(w), None, 1, 1)
mdx, mdw, _ = ref.conv2d_backward(f(x), f(w), f(dy), 1, 1)
for got, want in ((y, my), (dx, mdx), (dw, mdw)):
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4), np.abs(got - want).max()
assert np.allclose(db, dy.sum((0, 2, 3)), rtol=1e-5, atol=1e-5)
myd = ref.conv2d_general_forward(f(x), f(w[:8, :1]), None, (1, 1), (1, 1, 1, 1), (1, 1), 8)
assert np.allclose(yd, myd, rtol=1e-5, atol=1e-5)
assert np.allclose(yl, f(x.reshape(2, -1)) @ f(wl).T, rtol=1e-5, atol=1e-4)
print("ok", pc.amp.bf16_support()["mode"])
"""


@pytest.mark.parametrize("level", ["generic", "avx2"])
def test_openmp_bf16_at_every_isa_level(level):
    """The openmp bf16 path (rounding kernel, emulation or native) at the lower kernel levels, in a child."""
    if level not in pc._ext.supported_levels() or level not in pc._ext.built_levels():
        pytest.skip(f"this CPU or build has no {level} level")
    env = dict(os.environ, PARCONV_ISA=level, PYTHONPATH=PARCONV_HOME + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-P", "-c", _ISA_SCRIPT.replace("{level}", level)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok emulated")  # the bf16 instructions are in the avx512 level only


# ---------------------------------------------------------------------------- openmp: native or float32 per layer
@pytest.mark.skipif(not pc._ext._bf16.native(), reason="the native bf16 kernels do not run here")
@pytest.mark.parametrize("c, o, h, k, s, p, native_fwd, native_dw", [
    (3, 8, 10, 3, 1, 1, False, True),   # an RGB first layer: 27 reduction terms, forward in float32
    (16, 8, 10, 3, 1, 1, True, True),
    (4, 8, 11, 3, 2, 1, True, None),    # stride 2 (3x3): dw on the AMX tiles where they run, else float32
    (32, 8, 11, 3, 2, 1, True, None),   # the same from 32 channels
    (40, 6, 9, 1, 2, 0, True, True),    # a 1x1 shortcut
])
def test_openmp_picks_native_or_float32_per_layer(monkeypatch, c, o, h, k, s, p, native_fwd, native_dw):
    """The openmp backend runs the native bf16 kernel or the float32 direct kernel on the rounded tensors
    per layer (whichever was measured faster); either way the result is the bf16 model's."""
    from parconv._ext import _bf16

    be = pc.backends.get("openmp")
    calls = []
    real_fwd, real_bwd = _bf16.conv2d_forward, _bf16.conv2d_backward
    monkeypatch.setattr(_bf16, "conv2d_forward", lambda *a: calls.append("fwd") or real_fwd(*a))
    monkeypatch.setattr(_bf16, "conv2d_backward",
                        lambda *a: calls.append("dw" if a[4] is not None else "dx") or real_bwd(*a))
    rng = np.random.default_rng(c * 31 + s)
    x = rng.standard_normal((3, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    kwargs = {"stride": s, "padding": p, "dilation": 1, "groups": 1}
    with pc.autocast("bf16"):
        y = F.conv2d(x, w, None, stride=s, padding=p, backend=be)
        dy = rng.standard_normal(host(y).shape).astype(np.float32)
        dx, dw, db = F.conv2d_backward(x, w, dy, stride=s, padding=p, backend=be)
        dx2, dw2, _ = F.conv2d_backward(x, w, dy, stride=s, padding=p, backend=be)
    if native_dw is None:  # the tiles read a strided layer's input as flat views of phase images
        native_dw = _bf16.amx()
    assert ("fwd" in calls) == native_fwd
    assert ("dw" in calls) == native_dw and ("dx" in calls) == (not native_dw)
    np.testing.assert_array_equal(dw, dw2)  # bit for bit at a fixed thread count, on either path
    np.testing.assert_array_equal(dx, dx2)
    (my, mdx, mdw, mdb), mags = conv_model(x, w, None, dy, kwargs)
    assert_model(y, my, mags[0], "y")
    assert_model(dx, mdx, mags[1], "dx")
    assert_model(dw, mdw, mags[2], "dw")
    assert_model(db, mdb, mags[3], "db")


def test_openmp_runs_the_fused_float32_kernels_on_rounded_inputs_under_autocast(monkeypatch):
    """cnn-mnist's fused first layer keeps its fused kernels in bf16 (on rounded x, w and dy: the same
    exact products and float32 sums as the bf16 model), and matches the composed bf16 ops."""
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp not available")
    from parconv.backends.openmp import OpenMPBackend

    calls = {"forward": 0, "backward": 0}
    fwd, bwd = OpenMPBackend._fused_forward_kernel, OpenMPBackend.conv2d_relu_maxpool2d_backward

    def spy_fwd(self, *args, **kwargs):
        out = fwd(self, *args, **kwargs)
        calls["forward"] += out is not None
        return out

    def spy_bwd(self, *args, **kwargs):
        calls["backward"] += 1
        return bwd(self, *args, **kwargs)

    monkeypatch.setattr(OpenMPBackend, "_fused_forward_kernel", spy_fwd)
    monkeypatch.setattr(OpenMPBackend, "conv2d_relu_maxpool2d_backward", spy_bwd)
    x = np.random.default_rng(8).standard_normal((6, 1, 28, 28)).astype(np.float32)
    t = np.arange(6) % 10
    grads = {}
    for fuse in (True, False):
        model = pc.models.cnn_mnist(filters=8, rng=0).to("openmp")
        if not fuse:
            model.fuse = False
        loss = pc.CrossEntropyLoss()
        with pc.autocast("bf16"):
            loss(model(x), t)
        model.backward(loss.backward())
        grads[fuse] = [host(p.grad).copy() for p in model.parameters()]
    assert calls["forward"] >= 1 and calls["backward"] >= 1
    for got, want in zip(grads[True], grads[False]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bad, exc", [("x", TypeError), ([1 + 2j], TypeError), ([[1.0], [1.0, 2.0]], TypeError)])
def test_round_to_bf16_names_a_bad_argument(bad, exc):
    with pytest.raises(exc, match="round_to_bf16: x must be"):
        pc.amp.round_to_bf16(bad)
    assert pc.amp.round_to_bf16([1.0, 2.0]).dtype == np.float32  # array-likes of numbers are taken


def test_the_dot_rate_probe_measures_where_the_kernels_are_native():
    from parconv._ext import _bf16

    with pytest.raises(ValueError, match="rounds and iters"):
        _bf16.dot_rate_vs_fma(0)
    rate = _bf16.dot_rate_vs_fma()
    if not _bf16.native():
        assert rate is None
        assert "dot_rate" not in pc.amp.bf16_support()
    else:
        assert 0.2 < rate < 8.0, rate  # 32 against 16 multiply-adds per instruction, at whatever issue rates
        info = pc.amp.bf16_support()
        if info["amx"]:  # the tiles take every product: the VDPBF16PS rate decides nothing
            assert info["dot_rate"] is None and info["faster_than_fp32"] and "AMX-BF16" in info["why"]
        else:
            assert info["dot_rate"] > 0 and "multiply-adds per second of an FMA" in info["why"]


def test_bf16_support_reports_the_amx_tiles_and_never_warns_on_them(monkeypatch):
    import warnings

    from parconv import amp

    monkeypatch.setattr(amp, "native_bf16", lambda: True)
    monkeypatch.setattr(amp, "_amx_bf16", lambda: True)
    monkeypatch.setattr(amp, "_rate", [0.5])  # a slow VDPBF16PS does not matter where the tiles run
    monkeypatch.setattr(amp, "_checked_speed", False)
    info = amp.bf16_support()
    assert info["mode"] == "native" and info["amx"] is True and info["faster_than_fp32"] is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pc.autocast("bf16"):
            pass
    assert not [w for w in caught if "slower than float32" in str(w.message)]


@pytest.mark.parametrize("rate, slow", [(1.0, True), (2.0, False)])
def test_autocast_warns_once_where_bf16_products_are_no_faster_than_float32(monkeypatch, rate, slow):
    # a core that issues VDPBF16PS at half an FMA's rate gains nothing from bf16 and loses Winograd
    import warnings

    from parconv import amp

    monkeypatch.setattr(amp, "native_bf16", lambda: True)
    monkeypatch.setattr(amp, "_amx_bf16", lambda: False)
    monkeypatch.setattr(amp, "_rate", [rate])
    monkeypatch.setattr(amp, "_checked_speed", False)
    info = amp.bf16_support()
    assert info["faster_than_fp32"] is (not slow)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pc.autocast("bf16"):
            pass
        with pc.autocast("bf16"):
            pass
    got = [w for w in caught if "bf16 training runs slower than float32" in str(w.message)]
    assert len(got) == (1 if slow else 0), [str(w.message) for w in caught]
    if slow:
        assert got[0].filename == __file__  # points at the user's with-statement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(amp, "_checked_speed", False)
        with pc.autocast("bf16", enabled=False):  # a disabled block checks nothing
            pass
    assert not caught
