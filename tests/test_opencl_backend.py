"""The OpenCL backend: agreement with the NumPy oracle, program cache, residency, device choice.

Every op is checked forward and backward against :mod:`parconv.backends.numpy_ref`
evaluated in float64 on the same float32 inputs, with the criterion of
:mod:`parconv.selftest` (``|a - b| <= atol * max(1, max|b|) + rtol * |b|``, rtol 1e-4,
atol 1e-5); indices must match exactly. Hypothesis draws the shapes and a seed; the
data comes from the seed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parconv import backends  # noqa: E402
from parconv.selftest import ATOL, RTOL  # noqa: E402

if "opencl" not in backends.available():
    pytest.skip(f"opencl backend unavailable: {backends.why_unavailable('opencl')}", allow_module_level=True)

from parconv.backends import opencl as ocl  # noqa: E402

BE = backends.get("opencl")
REF = backends.get("numpy")
FEW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def host(a):
    return np.asarray(BE.to_numpy(a))


def agree(actual, expected, what=""):
    """The backend's float32 result against a float64 reference (see the module docstring)."""
    a = host(actual).astype(np.float64) if not np.isscalar(actual) else np.float64(actual)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    scale = max(1.0, float(np.abs(e).max(initial=0.0)))
    np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL * scale, err_msg=what)


def f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@st.composite
def conv_cases(draw, fused=False):
    n, c, o = draw(st.integers(1, 8)), draw(st.integers(1, 16)), draw(st.integers(1, 16))
    h, w = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    k, s, p = draw(st.integers(1, 7)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    assume(k <= h + 2 * p and k <= w + 2 * p)
    case = dict(n=n, c=c, o=o, h=h, w=w, k=k, s=s, p=p, bias=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))
    if fused:
        P, Q = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        pk = draw(st.integers(1, 3))
        assume(pk <= min(P, Q))
        case.update(pk=pk, ps=draw(st.integers(1, pk)))
    return case


def conv_data(cs):
    rng = np.random.default_rng(cs["seed"])
    x = randn(rng, cs["n"], cs["c"], cs["h"], cs["w"])
    w = randn(rng, cs["o"], cs["c"], cs["k"], cs["k"], scale=1 / math.sqrt(cs["c"] * cs["k"] ** 2))
    b = randn(rng, cs["o"]) if cs["bias"] else None
    return rng, x, w, b


# ------------------------------------------------------------------ conv2d
@SOME
@given(conv_cases())
def test_conv2d_forward_and_gradients_match_oracle(cs):
    rng, x, w, b = conv_data(cs)
    s, p = cs["s"], cs["p"]
    X, W = BE.asarray(x), BE.asarray(w)
    B = BE.asarray(b) if b is not None else None
    y_ref = REF.conv2d_forward(f64(x), f64(w), f64(b), s, p)
    agree(BE.conv2d_forward(X, W, B, s, p), y_ref, "conv2d y")
    dy = randn(rng, *y_ref.shape)
    dx_ref, dw_ref, db_ref = REF.conv2d_backward(f64(x), f64(w), f64(dy), s, p, True, True)
    dx, dw, db = BE.conv2d_backward(X, W, BE.asarray(dy), s, p, True, True)
    agree(dx, dx_ref, "conv2d dx")
    agree(dw, dw_ref, "conv2d dw")
    agree(db, db_ref, "conv2d db")
    dx2, dw2, db2 = BE.conv2d_backward(X, W, BE.asarray(dy), s, p, False, False)
    assert dx2 is None and db2 is None
    agree(dw2, dw_ref, "conv2d dw without dx")


@FEW
@given(conv_cases(fused=True))
def test_fused_conv_relu_maxpool_matches_unfused_oracle(cs):
    rng, x, w, b = conv_data(cs)
    s, p, pk, ps = cs["s"], cs["p"], cs["pk"], cs["ps"]
    X, W = BE.asarray(x), BE.asarray(w)
    B = BE.asarray(b) if b is not None else None
    y, am = BE.conv2d_relu_maxpool2d_forward(X, W, B, s, p, pk, ps)
    z = REF.conv2d_forward(f64(x), f64(w), f64(b), s, p)
    zp, am_ref = REF.maxpool2d_forward(z, pk, ps)
    agree(y, REF.relu_forward(zp), "fused y")
    am_h = host(am)
    # argmax may differ from the float64 oracle only where two window values tie to rounding
    picked = np.take_along_axis(z.reshape(z.shape[0], z.shape[1], -1), am_h.reshape(am_h.shape[0], am_h.shape[1], -1), 2)
    agree(picked.reshape(zp.shape), zp, "fused argmax picks a window maximum")
    assert np.mean(am_h == am_ref) > 0.99
    dy = randn(rng, *zp.shape)
    dx, dw, db = BE.conv2d_relu_maxpool2d_backward(X, W, y, am, BE.asarray(dy), s, p, True, cs["bias"])
    dz = REF.maxpool2d_backward(REF.relu_backward(REF.relu_forward(zp), f64(dy)), am_h, z.shape)
    dx_ref, dw_ref, db_ref = REF.conv2d_backward(f64(x), f64(w), dz, s, p, True, cs["bias"])
    agree(dx, dx_ref, "fused dx")
    agree(dw, dw_ref, "fused dw")
    if cs["bias"]:
        agree(db, db_ref, "fused db")


# --------------------------------------------------------------- maxpool2d
@SOME
@given(st.integers(1, 8), st.integers(1, 16), st.integers(1, 20), st.integers(1, 20), st.integers(1, 4),
       st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_maxpool2d_matches_oracle(n, c, h, w, k, s, seed):
    assume(k <= min(h, w))
    rng = np.random.default_rng(seed)
    x = randn(rng, n, c, h, w)
    y, am = BE.maxpool2d_forward(BE.asarray(x), k, s)
    y_ref, am_ref = REF.maxpool2d_forward(x, k, s)
    np.testing.assert_array_equal(host(y), y_ref)
    np.testing.assert_array_equal(host(am), am_ref)
    dy = randn(rng, *y_ref.shape)
    agree(BE.maxpool2d_backward(BE.asarray(dy), am, x.shape), REF.maxpool2d_backward(f64(dy), am_ref, x.shape),
          "maxpool dx")


def test_nan_follows_numpy_argmax_rules():
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 1, 0] = np.nan  # a second NaN in the same window: the first one wins
    x[1, 0, 3, 3] = np.nan
    y, am = BE.maxpool2d_forward(BE.asarray(x), 2, 2)
    y_ref, am_ref = REF.maxpool2d_forward(x, 2, 2)
    np.testing.assert_array_equal(host(am), am_ref)
    np.testing.assert_array_equal(np.isnan(host(y)), np.isnan(y_ref))
    logits = np.array([[1, np.nan, 3, np.nan], [5, 2, 5, 1]], dtype=np.float32)
    np.testing.assert_array_equal(host(BE.argmax_rows(BE.asarray(logits))), REF.argmax_rows(logits))
    assert np.isnan(host(BE.relu_forward(BE.asarray(np.array([np.nan, -1, 2], np.float32)))))[0]
    assert BE.all_finite(BE.asarray(x[1:, :, :3, :3]))
    assert not BE.all_finite(BE.asarray(x))
    assert not BE.all_finite(BE.asarray(np.array([1, np.inf], np.float32)))


# ------------------------------------------------------------------ linear
@SOME
@given(st.integers(1, 64), st.integers(1, 300), st.integers(1, 70), st.booleans(), st.integers(0, 2**31 - 1))
def test_linear_matches_oracle(n, f, g, bias, seed):
    rng = np.random.default_rng(seed)
    x, w = randn(rng, n, f), randn(rng, g, f, scale=1 / math.sqrt(f))
    b = randn(rng, g) if bias else None
    X, W = BE.asarray(x), BE.asarray(w)
    agree(BE.linear_forward(X, W, BE.asarray(b) if bias else None), REF.linear_forward(f64(x), f64(w), f64(b)), "y")
    dy = randn(rng, n, g)
    dx, dw, db = BE.linear_backward(X, W, BE.asarray(dy), True, bias)
    dx_ref, dw_ref, db_ref = REF.linear_backward(f64(x), f64(w), f64(dy), True, bias)
    agree(dx, dx_ref, "linear dx")
    agree(dw, dw_ref, "linear dw")
    if bias:
        agree(db, db_ref, "linear db")
    else:
        assert db is None


@FEW
@given(st.sampled_from(["features", "batch"]), st.integers(1, 40), st.integers(512, 4000), st.integers(1, 16),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_linear_split_reduction_matches_oracle(long_side, short, long, g, bias, seed):
    """Few output tiles over a long reduction run as split-K GEMMs (a classifier head's forward
    over many features, or dw over a large batch): partials added in order, bias once."""
    n, f = (short, long) if long_side == "features" else (long, short)
    rng = np.random.default_rng(seed)
    x, w = randn(rng, n, f), randn(rng, g, f, scale=1 / math.sqrt(f))
    b = randn(rng, g) if bias else None
    X, W = BE.asarray(x), BE.asarray(w)
    y = BE.linear_forward(X, W, BE.asarray(b) if bias else None)
    agree(y, REF.linear_forward(f64(x), f64(w), f64(b)), "y")
    dy = randn(rng, n, g)
    dx, dw, db = BE.linear_backward(X, W, BE.asarray(dy), True, bias)
    dx_ref, dw_ref, db_ref = REF.linear_backward(f64(x), f64(w), f64(dy), True, bias)
    agree(dx, dx_ref, "linear dx")
    agree(dw, dw_ref, "linear dw")
    # the partials are added in a fixed order: the same bits every time
    assert np.array_equal(host(BE.linear_forward(X, W, BE.asarray(b) if bias else None)), host(y))


# ------------------------------------------------------------- activations
@SOME
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_activations_match_oracle(shape, seed):
    rng = np.random.default_rng(seed)
    x, dy = randn(rng, *shape, scale=4.0), randn(rng, *shape)
    for op in ("relu", "sigmoid"):
        y_ref = getattr(REF, f"{op}_forward")(f64(x))
        y = getattr(BE, f"{op}_forward")(BE.asarray(x))
        agree(y, y_ref, f"{op} y")
        dx = getattr(BE, f"{op}_backward")(y, BE.asarray(dy))
        agree(dx, getattr(REF, f"{op}_backward")(f64(host(y)), f64(dy)), f"{op} dx")


def test_sigmoid_does_not_overflow():
    x = np.array([-1e4, -100, 0, 100, 1e4], np.float32)
    y = host(BE.sigmoid_forward(BE.asarray(x)))
    assert np.all(np.isfinite(y)) and y[0] == 0 and y[-1] == 1 and y[2] == 0.5


# ------------------------------------------------------------------ losses
@SOME
@given(st.integers(1, 300), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_losses_and_metrics_match_oracle(n, g, seed):
    rng = np.random.default_rng(seed)
    logits = randn(rng, n, g, scale=5.0)
    labels = rng.integers(0, g, n).astype(np.int32)
    L, Y = BE.asarray(logits), BE.asarray(labels, np.int32)
    loss, probs = BE.softmax_cross_entropy_forward(L, Y)
    loss_ref, probs_ref = REF.softmax_cross_entropy_forward(f64(logits), labels)
    assert isinstance(loss, float)
    agree(loss, loss_ref, "softmax xent loss")
    agree(probs, probs_ref, "softmax probs")
    agree(BE.softmax_cross_entropy_backward(probs, Y), REF.softmax_cross_entropy_backward(probs_ref, labels), "dlogits")
    n_ok = BE.count_correct(L, Y)
    assert isinstance(n_ok, int) and n_ok == REF.count_correct(logits, labels)
    np.testing.assert_array_equal(host(BE.argmax_rows(L)), REF.argmax_rows(logits))

    p = rng.uniform(0, 1, (n, g)).astype(np.float32)
    p.flat[::7] = rng.choice(np.array([0.0, 1.0], np.float32))  # exercise the clip
    t = rng.integers(0, 2, (n, g)).astype(np.float32)
    lo, hi = np.float64(np.float32(1e-7)), np.float64(np.float32(1 - 1e-7))
    agree(BE.bce_forward(BE.asarray(p), BE.asarray(t), 1e-7),
          REF.bce_forward(np.clip(f64(p), lo, hi), f64(t), 1e-7), "bce loss")
    pc = np.clip(f64(p), lo, hi)
    dp_ref = np.where((f64(p) < lo) | (f64(p) > hi), 0.0, (pc - t) / (pc * (1 - pc)) / p.size)
    agree(BE.bce_backward(BE.asarray(p), BE.asarray(t), 1e-7), dp_ref, "bce dp")


def test_softmax_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0, -1e4], [-1e4, -1e4, -1e4]], np.float32)
    labels = np.array([0, 2], np.int32)
    loss, probs = BE.softmax_cross_entropy_forward(BE.asarray(logits), BE.asarray(labels, np.int32))
    loss_ref, probs_ref = REF.softmax_cross_entropy_forward(logits, labels)
    assert math.isfinite(loss)
    agree(loss, loss_ref)
    agree(probs, probs_ref)


# --------------------------------------------------------------- optimizer
@FEW
@given(st.integers(1, 5000), st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 0.01]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_sgd_matches_oracle(n, momentum, wd, nesterov, seed):
    assume(momentum or not nesterov)
    rng = np.random.default_rng(seed)
    p, g, v = randn(rng, n), randn(rng, n), randn(rng, n)
    P, V = BE.asarray(p), (BE.asarray(v) if momentum else None)
    p64, v64 = f64(p), (f64(v) if momentum else None)
    for _ in range(3):
        BE.sgd_update(P, BE.asarray(g), V, 0.05, momentum, wd, nesterov)
        REF.sgd_update(p64, f64(g), v64, 0.05, momentum, wd, nesterov)
    agree(P, p64, "sgd p")
    if momentum:
        agree(V, v64, "sgd v")


@FEW
@given(st.integers(1, 5000), st.sampled_from([0.0, 0.01]), st.integers(0, 2**31 - 1))
def test_adam_matches_oracle(n, wd, seed):
    rng = np.random.default_rng(seed)
    p, g = randn(rng, n), randn(rng, n)
    P, M, V = BE.asarray(p), BE.zeros((n,)), BE.zeros((n,))
    p64, m64, v64 = f64(p), np.zeros(n), np.zeros(n)
    for step in range(1, 5):
        BE.adam_update(P, BE.asarray(g), M, V, 1e-2, 0.9, 0.999, 1e-8, wd, step)
        REF.adam_update(p64, f64(g), m64, v64, 1e-2, 0.9, 0.999, 1e-8, wd, step)
    agree(P, p64, "adam p")
    agree(M, m64, "adam m")
    agree(V, v64, "adam v")


# ------------------------------------------------------------------ arrays
def test_array_ops():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    a = BE.asarray(x)
    assert BE.is_array(a) and not BE.is_array(x) and a.dtype == np.float32 and a.shape == x.shape
    assert BE.asarray(a) is a
    r = BE.reshape(a, (6, 4))
    assert r.base_data == a.base_data and r.shape == (6, 4)  # a view, no copy
    c = BE.copy(a)
    BE.fill(a, -1.5)
    np.testing.assert_array_equal(host(c), x)
    np.testing.assert_array_equal(host(r), np.full((6, 4), -1.5, np.float32))
    BE.copy_into(a, c)
    np.testing.assert_array_equal(host(a), x)
    np.testing.assert_array_equal(host(BE.zeros((3, 2))), np.zeros((3, 2), np.float32))
    assert BE.empty((2, 2), np.int32).dtype == np.int32
    labels = BE.asarray([1, 2, 3], np.int32)
    assert labels.dtype == np.int32 and host(labels).tolist() == [1, 2, 3]
    assert BE.to_numpy(x) is x


def test_results_are_deterministic():
    rng = np.random.default_rng(3)
    x, w = BE.asarray(randn(rng, 16, 8, 12, 12)), BE.asarray(randn(rng, 16, 8, 3, 3))
    dy = BE.asarray(randn(rng, 16, 16, 12, 12))
    runs = [tuple(host(g) for g in BE.conv2d_backward(x, w, dy, 1, 1)) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    logits = BE.asarray(randn(rng, 500, 10))
    labels = BE.asarray(rng.integers(0, 10, 500), np.int32)
    assert BE.softmax_cross_entropy_forward(logits, labels)[0] == BE.softmax_cross_entropy_forward(logits, labels)[0]


# ----------------------------------------------------------- program cache
def test_programs_are_built_once_and_kernels_stored():
    t = time.perf_counter()
    program, kernels = BE.program("conv")
    first = time.perf_counter() - t
    t = time.perf_counter()
    program2, kernels2 = BE.program("conv")
    second = time.perf_counter() - t
    assert program2 is program and kernels2 is kernels
    assert second < 0.1, f"cached program lookup took {second:.3f} s"
    assert first < 0.1  # built when the backend was created, so this was a hit too
    assert BE._k["conv2d_direct"] is kernels["conv2d_direct"]  # the backend calls the stored objects
    for name in ("-DTILE_WG=", "-DGEMM_BM=", "-DRED_WG="):
        assert any(opt.startswith(name) for opt in BE.build_options)


def test_fresh_process_build_uses_the_disk_cache():
    """A second process finds the compiled kernels on disk (pyopencl's and PoCL's caches)."""
    code = ("import time; t = time.perf_counter(); from parconv.backends.opencl import OpenCLBackend; "
            "OpenCLBackend(); print(time.perf_counter() - t)")
    seconds = float(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True,
                                   timeout=300).stdout.split()[-1])
    assert seconds < 30


# ---------------------------------------------------------------- residency
def test_training_step_keeps_data_on_the_device():
    """forward + loss + backward + SGD through the backend: only the loss scalars come back."""
    rng = np.random.default_rng(0)
    n, d = 16, 4
    x = BE.asarray(randn(rng, n, 1, 12, 12))
    labels = BE.asarray(rng.integers(0, 10, n), np.int32)
    params = {"w1": BE.asarray(randn(rng, d, 1, 3, 3, scale=0.3)), "b1": BE.zeros((d,)),
              "w2": BE.asarray(randn(rng, 10, d * 5 * 5, scale=0.1)), "b2": BE.zeros((10,))}
    vel = {k: BE.zeros(p.shape) for k, p in params.items()}
    log = BE.transfers
    log.reset()
    log.record = True
    losses = []
    for _ in range(3):
        z = BE.conv2d_forward(x, params["w1"], params["b1"], 1, 0)
        a = BE.relu_forward(z)
        y, am = BE.maxpool2d_forward(a, 2, 2)
        f = BE.reshape(y, (n, d * 25))
        logits = BE.linear_forward(f, params["w2"], params["b2"])
        loss, probs = BE.softmax_cross_entropy_forward(logits, labels)
        losses.append(loss)
        dl = BE.softmax_cross_entropy_backward(probs, labels)
        df, dw2, db2 = BE.linear_backward(f, params["w2"], dl)
        da = BE.maxpool2d_backward(BE.reshape(df, y.shape), am, a.shape)
        _, dw1, db1 = BE.conv2d_backward(x, params["w1"], BE.relu_backward(a, da), 1, 0, need_dx=False)
        for k, g in (("w1", dw1), ("b1", db1), ("w2", dw2), ("b2", db2)):
            BE.sgd_update(params[k], g, vel[k], 0.1, 0.9, 0.0, False)
    assert log.d2h_reasons() == ["softmax_cross_entropy_forward"] * 3
    assert log.d2h_bytes == 3 * 4
    assert log.h2d_count == 0
    assert losses[-1] < losses[0]
    BE.to_numpy(params["w1"])
    assert log.d2h_reasons()[-1] == "to_numpy" and log.device_to_host[-1].nbytes == d * 9 * 4
    log.record = False
    log.reset()
    assert log.d2h_count == 0 and log.device_to_host == []


# ---------------------------------------------------------------- devices
def test_device_selection_by_index_and_name():
    import pyopencl as cl

    first = cl.get_platforms()[0].get_devices()[0]
    assert ocl.select_device("0:0").int_ptr == first.int_ptr
    word = first.name.split()[0][:4]
    assert word.lower() in ocl.select_device(word.upper()).name.lower()
    with pytest.raises(RuntimeError, match="matches no OpenCL device"):
        ocl.select_device("no-such-device-anywhere")
    with pytest.raises(RuntimeError, match="matches no OpenCL device"):
        ocl.select_device("99:0")


def test_device_env_var_is_honoured_and_never_prompts():
    code = "from parconv.backends import get; print(get('opencl').device.name)"
    env = dict(os.environ, PARCONV_OPENCL_DEVICE="0:0", PYOPENCL_CTX="")
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    import pyopencl as cl

    assert out.stdout.strip() == cl.get_platforms()[0].get_devices()[0].name
    env["PARCONV_OPENCL_DEVICE"] = "no-such-device-anywhere"
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0 and "matches no OpenCL device" in out.stderr


def test_importing_parconv_does_not_import_pyopencl_and_missing_pyopencl_is_explained():
    code = "import sys, parconv; assert 'pyopencl' not in sys.modules, 'parconv imported pyopencl'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)
    code = ("import sys; sys.modules['pyopencl'] = None\n"
            "from parconv.backends import get\n"
            "try:\n    get('opencl')\nexcept Exception as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert 'pip install "parconv[opencl]"' in out.stdout


def test_gpu_style_configuration_agrees_on_this_device():
    """The wide work-group, strided-reduction code paths (chosen for GPUs) run here too."""
    cfg = ocl.device_config(BE.device, kind="gpu")
    be = ocl.OpenCLBackend(config=cfg)
    assert be.config.tile_wg > 1 and be.config.red_chunked == 0
    rng = np.random.default_rng(5)
    x, w, b = randn(rng, 3, 5, 11, 9), randn(rng, 12, 5, 3, 3, scale=0.3), randn(rng, 12)
    X, W, B = be.asarray(x), be.asarray(w), be.asarray(b)
    agree_be = lambda a, e, what: agree(be.to_numpy(a), e, what)  # noqa: E731
    agree_be(be.conv2d_forward(X, W, B, 2, 1), REF.conv2d_forward(f64(x), f64(w), f64(b), 2, 1), "gpu-style y")
    dy = randn(rng, 3, 12, 6, 5)
    for got, want, what in zip(be.conv2d_backward(X, W, be.asarray(dy), 2, 1),
                               REF.conv2d_backward(f64(x), f64(w), f64(dy), 2, 1), ("dx", "dw", "db")):
        agree_be(got, want, "gpu-style " + what)
    lx, lw = randn(rng, 37, 70), randn(rng, 9, 70)
    agree_be(be.linear_forward(be.asarray(lx), be.asarray(lw), None), f64(lx) @ f64(lw).T, "gpu-style linear")
    logits, labels = randn(rng, 300, 7), rng.integers(0, 7, 300).astype(np.int32)
    agree(be.softmax_cross_entropy_forward(be.asarray(logits), be.asarray(labels, np.int32))[0],
          REF.softmax_cross_entropy_forward(f64(logits), labels)[0], "gpu-style loss")
    assert be.count_correct(be.asarray(logits), be.asarray(labels, np.int32)) == REF.count_correct(logits, labels)


# ---------------------------------------------------------------- selftest
@pytest.mark.parametrize("name", ["numpy", "opencl"])
def test_selftest_passes(name, capsys):
    from parconv.selftest import run_selftest

    assert run_selftest(name, seed=1, n_random=3)
    out = capsys.readouterr().out
    assert "PASSED" in out and "conv2d.dw" in out and "adam.p" in out


def test_selftest_reports_a_broken_backend(capsys):
    from parconv.backends.numpy_ref import NumpyBackend
    from parconv.selftest import run_selftest

    class Broken(NumpyBackend):
        name = "broken"

        def relu_forward(self, x):
            return np.abs(x)

    assert not run_selftest(Broken(), n_random=1)  # an instance works as well as a registered name
    assert "FAIL" in capsys.readouterr().out


def test_opencl_devices_info_lists_this_device():
    from parconv.selftest import opencl_devices_info

    info = opencl_devices_info()
    assert info and {"platform", "name", "vendor", "type", "compute_units", "global_mem_bytes",
                     "max_work_group_size", "platform_index", "device_index"} <= set(info[0])
    assert any(d["name"] == BE.device.name.strip() for d in info)


def test_division_and_square_root_are_correctly_rounded_where_the_device_offers_it():
    """OpenCL allows 2.5 ulp for float division and 3 ulp for sqrt by default, enough for the
    optimizers' state to drift from the NumPy reference on a GPU; the option asks for exact ones."""
    cl = BE._cl
    offered = bool(int(BE.device.single_fp_config) & int(cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT))
    assert ("-cl-fp32-correctly-rounded-divide-sqrt" in BE.build_options) == offered
    # every family is built with the same options, so the kernels the step runs have them
    assert all(opt in BE.build_options for opt in BE.config.build_options())
