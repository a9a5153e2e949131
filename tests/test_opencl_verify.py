"""A device that computes wrong results is refused loudly: ``OpenCLBackend.verify`` and ``parconv selftest``."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from parconv import backends  # noqa: E402

if "opencl" not in backends.available():
    pytest.skip(f"opencl backend unavailable: {backends.why_unavailable('opencl')}", allow_module_level=True)

from parconv.backends import opencl as ocl  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """The shared opencl backend with this process's record of verified devices emptied for the test,
    back in its own tile configuration afterwards (a test may make it switch)."""
    monkeypatch.setattr(ocl, "_verified", set())
    be = backends.get("opencl")
    config, style = be.config, getattr(be, "config_style", None)
    yield be
    if (be.config, getattr(be, "config_style", None)) != (config, style):
        be.config, be.config_style = config, style
        be._build_within_limits()


def test_verify_passes_quickly_and_runs_once_per_device_and_configuration(fresh, monkeypatch):
    calls = []
    real = type(fresh).conv2d_forward
    monkeypatch.setattr(fresh, "conv2d_forward", lambda *a: calls.append(a[1].shape) or real(fresh, *a))
    t = time.perf_counter()
    fresh.verify()
    seconds = time.perf_counter() - t
    # K=3, K=7, K=7 over more channels than one staged chunk, and a batch above one dw work-group's share
    assert [shape[2] for shape in calls] == [3, 7, 7, 3]
    assert calls[2][1] > 8 and len(calls) == 4
    assert seconds < 2.0, f"verify took {seconds:.2f} s"
    fresh.verify()
    assert len(calls) == 4  # kept for the process


def _wrong(result):
    """The device array ``result`` with its first element changed in place."""
    host = np.asarray(result.get()).copy()
    host.flat[0] += 1.0
    result.set(host)
    return result


@pytest.mark.parametrize("method, op", [
    ("linear_forward", "linear_forward"),
    ("maxpool2d_forward", "maxpool2d_forward"),
])
def test_verify_names_the_device_and_the_wrong_op(fresh, monkeypatch, method, op):
    real = getattr(type(fresh), method)

    def broken(*args):
        out = real(fresh, *args)
        if isinstance(out, tuple):
            return (_wrong(out[0]),) + out[1:]
        return _wrong(out)

    monkeypatch.setattr(fresh, method, broken)
    with pytest.raises(RuntimeError) as info:
        fresh.verify()
    msg = str(info.value)
    assert fresh.device.name.strip() in msg and f"computes {op} wrongly" in msg and "PARCONV_OPENCL_DEVICE" in msg
    monkeypatch.setattr(fresh, method, real.__get__(fresh))
    fresh.verify()  # a failed check is not remembered as a pass; the repaired backend passes


def test_verify_catches_a_wrong_conv_with_k7_only(fresh, monkeypatch):
    """The K=7 case is checked on its own (rusticl returned garbage there and nowhere else)."""
    real = type(fresh).conv2d_forward

    def broken(x, w, b, stride, padding):
        out = real(fresh, x, w, b, stride, padding)
        return _wrong(out) if w.shape[2] == 7 else out

    monkeypatch.setattr(fresh, "conv2d_forward", broken)
    with pytest.raises(RuntimeError, match="computes conv2d_forward K=7, conv2d_forward K=7 x"):
        fresh.verify()


def test_selftest_fails_loudly_and_the_command_exits_nonzero(fresh, monkeypatch, capsys):
    from parconv.cli import main

    real = type(fresh).linear_forward
    monkeypatch.setattr(fresh, "linear_forward", lambda *a: _wrong(real(fresh, *a)))
    assert main(["selftest", "--backend", "opencl", "--random", "0"]) != 0
    out, err = capsys.readouterr()
    assert "FAILED" in out and "linear.y" in out
    assert "parconv selftest FAILED" in err and "linear.y" in err and "cannot be trusted" in err


# ------------------------------------------------------------ the guard of fit
import parconv as pc  # noqa: E402


def _other(style):
    return "gpu" if style == "cpu" else "cpu"


def _skip_unless_right_in(be, style):
    """Skip when this device is wrong in ``style`` for real (the test simulates a wrong one)."""
    probe = ocl.OpenCLBackend(config=ocl.device_config(be.device, kind=style))
    if probe._fixed_failures():
        pytest.skip(f"{be.device.name.strip()} is wrong in the {style}-style configuration itself")


def _k7_net():
    return pc.Sequential(pc.Conv2d(3, 4, 7, padding=3), pc.ReLU(), pc.Flatten(), pc.Linear(4 * 9 * 9, 3),
                         backend="opencl")


def _data(n=40, shape=(3, 9, 9)):
    rng = np.random.default_rng(1)
    return rng.standard_normal((n,) + shape).astype(np.float32), rng.integers(0, 3, n)


def test_fit_switches_to_the_other_style_when_a_k7_conv_is_wrong_in_this_one(fresh, monkeypatch):
    """A device whose K=7 convolution returns zeros in the configured style only: fit warns and trains in the other."""
    start = fresh.config_style
    if start is None:
        pytest.skip("the backend runs a configuration passed in; it is never replaced")
    _skip_unless_right_in(fresh, _other(start))
    real = type(fresh).conv2d_forward

    def zeros_for_k7(x, w, b, stride, padding):
        y = real(fresh, x, w, b, stride, padding)
        if w.shape[2] == 7 and fresh.config_style == start:
            y.fill(0.0)
        return y

    monkeypatch.setattr(fresh, "conv2d_forward", zeros_for_k7)
    model = _k7_net()
    x, y = _data()
    with pytest.warns(RuntimeWarning, match=f"computes conv2d_forward K=7.* wrongly in the {start}-style tile "
                                            f"configuration; this backend switched to the {_other(start)}-style"):
        history = model.fit(x, y, epochs=1, batch_size=16, verbose=False)
    assert fresh.config_style == _other(start)
    assert np.isfinite(history["loss"][-1])
    ref = pc.Sequential(pc.Conv2d(3, 4, 7, padding=3), backend="numpy")
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("0.")})
    np.testing.assert_allclose(fresh.to_numpy(model[0](x[:4])), ref(x[:4]), rtol=1e-4, atol=1e-4)


def _dw_wrong_above(fresh, monkeypatch, n_max, shape):
    """conv2d_backward returns a wrong weight gradient for ``shape`` filters at batches above ``n_max``, in every style."""
    real = type(fresh).conv2d_backward

    def broken(x, w, dy, *args, **kwargs):
        dx, dw, db = real(fresh, x, w, dy, *args, **kwargs)
        if x.shape[0] > n_max and tuple(w.shape) == shape:
            dw = dw * 0.5
        return dx, dw, db

    monkeypatch.setattr(fresh, "conv2d_backward", broken)


def test_fit_refuses_a_weight_gradient_that_is_wrong_only_at_the_runs_batch_size(fresh, monkeypatch):
    """Right at the small batches the fixed checks and the selftest try, wrong at the run's: the probe of the
    run's own model and batch size catches it, names the op, and nothing is trained."""
    _dw_wrong_above(fresh, monkeypatch, 16, (4, 3, 7, 7))
    fresh.verify()  # the fixed checks cannot see it
    start = (fresh.config_style, fresh.config)
    model = _k7_net()
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    x, y = _data()
    with pytest.raises(RuntimeError) as info:
        model.fit(x, y, epochs=1, batch_size=32, verbose=False)
    msg = str(info.value)
    assert "computes conv2d_backward result 1 wrongly" in msg and "32x3x9x9" in msg, msg
    assert fresh.device.name.strip() in msg and "PARCONV_OPENCL_DEVICE" in msg
    if fresh.config_style is not None:  # both styles were tried, and the backend is back in its own
        assert msg.count("-style configuration: ") == 2 and msg.count("conv2d_backward result 1: on (32x3x9x9") == 2
    assert (fresh.config_style, fresh.config) == start
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    # the same model at a batch the bug spares trains
    history = model.fit(x[:16], y[:16], epochs=1, batch_size=16, verbose=False)
    assert np.isfinite(history["loss"][-1])


def test_the_probe_covers_the_last_smaller_batch_and_the_validation_batches(fresh, monkeypatch):
    from parconv._fitguard import verify_for_fit

    fresh.verify()  # the fixed checks, kept
    seen = []
    real = type(fresh).linear_forward
    monkeypatch.setattr(fresh, "linear_forward", lambda x, w, b: seen.append(x.shape[0]) or real(fresh, x, w, b))
    model = _k7_net()
    x, y = _data(40)
    verify_for_fit(model, x, None, 16, pc.SoftmaxCrossEntropy(), x[:300], None)
    assert sorted(set(seen)) == [8, 16, 40]  # 40 = 2 x 16 + 8; validation: one batch of max(16, 256)
    # without validation data, eval mode's own fused ops (Conv2d -> BatchNorm2d folded) at the training batch
    folded = []
    real_bn = type(fresh).conv2d_scale_shift_forward
    monkeypatch.setattr(fresh, "conv2d_scale_shift_forward",
                        lambda x, *a: folded.append(x.shape[0]) or real_bn(fresh, x, *a))
    bn_net = pc.Sequential(pc.Conv2d(3, 4, 3, padding=1), pc.BatchNorm2d(4), pc.ReLU(), pc.Flatten(),
                           pc.Linear(4 * 9 * 9, 3), backend="opencl")
    verify_for_fit(bn_net, x, None, 16, pc.SoftmaxCrossEntropy(), None, None)
    assert folded == [16]


def test_the_probe_leaves_the_model_as_it_was_and_is_kept(fresh, monkeypatch):
    from parconv._fitguard import verify_for_fit

    model = pc.Sequential(pc.Conv2d(3, 4, 3, padding=1), pc.BatchNorm2d(4), pc.ReLU(), pc.Dropout(0.5), pc.Flatten(),
                          pc.Linear(4 * 9 * 9, 3), backend="opencl")
    model.eval()
    model[1].train()
    hooks = []
    model.register_grad_hook(lambda i, params: hooks.append(i))
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    gen_state = model[3]._gen.bit_generator.state
    x, _ = _data(20)
    verify_for_fit(model, x, None, 8, pc.SoftmaxCrossEntropy(), None, None)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    assert model[3]._gen.bit_generator.state == gen_state
    assert [m.training for m in model.modules()] == [False, False, True, False, False, False, False]
    assert hooks == []  # gradient hooks (data-parallel reductions) were not called
    calls = []
    real = type(fresh).conv2d_forward
    monkeypatch.setattr(fresh, "conv2d_forward", lambda *a: calls.append(1) or real(fresh, *a))
    verify_for_fit(model, x, None, 8, pc.SoftmaxCrossEntropy(), None, None)
    assert calls == []  # kept per device, configuration, model and sizes


def test_a_configuration_passed_in_is_refused_not_replaced(fresh, monkeypatch):
    be = ocl.OpenCLBackend(config=fresh.config)
    real = type(be).linear_forward
    monkeypatch.setattr(be, "linear_forward", lambda *a: _wrong(real(be, *a)))
    with pytest.raises(RuntimeError, match="in the given configuration: linear_forward: "):
        be.verify()
    assert be.config_style is None and be.config == fresh.config


def test_the_probe_sizes_follow_the_data_loader_and_the_ranks_share():
    from parconv._fitguard import batch_sizes, sample_shape

    class Ranks:  # this process is rank 1 of 3 (DataParallel.shard's split)
        def shard(self, n):
            base, rem = divmod(n, 3)
            start = base + min(1, rem)
            return start, start + base + (1 < rem)

    assert batch_sizes(40, 16) == (8, 16) and batch_sizes(40, 16, drop_last=True) == (16,)
    assert batch_sizes(10, 16) == (10,) and batch_sizes(None, 16) == ()
    assert batch_sizes(40, 16, dp=Ranks()) == (3, 5)  # 16 -> 5 + 6 + 5, 8 -> 3 + 3 + 2
    x, y = _data(10, (3, 12, 12))
    crop = pc.data.DataLoader(x, y, batch_size=4, transform=pc.data.transforms.RandomCrop(9))
    assert sample_shape(None, crop) == (3, 9, 9)
    assert sample_shape(None, pc.data.DataLoader(x, y, batch_size=4, transform=lambda b: b)) is None
    assert sample_shape(x, None) == (3, 12, 12)
