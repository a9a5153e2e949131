"""batch_norm (training and eval mode, affine or not, fused ReLU, running statistics) on every
backend against the oracle, the oracle against finite differences, and PyTorch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import parconv as pc
import parconv.functional as F
from conftest import assert_close, host, needs_torch, numeric_grad, rand

# (N, C) / (N, C, L) / (N, C, H, W) with at least two values per channel
bn_shapes = st.tuples(st.integers(1, 6), st.integers(1, 5),
                      st.lists(st.integers(1, 6), min_size=0, max_size=2)).map(
    lambda t: (t[0], t[1], *t[2])).filter(lambda s: int(np.prod(s)) // s[1] > 1)


def _params(rng, C, affine):
    if not affine:
        return None, None
    return (rng.uniform(0.5, 1.5, C).astype(np.float32), rand(rng, C))


def _running(rng, C):
    return rand(rng, C), rng.uniform(0.5, 2.0, C).astype(np.float32)


def _dev(backend, a):
    return None if a is None else backend.asarray(a)


def _dev_copy(backend, a):
    # running statistics are updated in place: every backend gets its own copy
    return backend.asarray(np.array(a, copy=True))


@given(shape=bn_shapes, seed=st.integers(0, 2**31 - 1), training=st.booleans(), affine=st.booleans(),
       relu=st.booleans(), track=st.booleans(), momentum=st.sampled_from([0.1, 0.5, 1.0]),
       offset=st.sampled_from([0.0, 5.0]))
def test_batch_norm_matches_oracle(backend, oracle, shape, seed, training, affine, relu, track, momentum, offset):
    rng = np.random.default_rng(seed)
    C = shape[1]
    x = rand(rng, *shape) + np.float32(offset)
    w, b = _params(rng, C, affine)
    rm, rv = _running(rng, C)
    track = track or not training  # eval mode needs the running statistics
    ref_rm, ref_rv = (rm.copy(), rv.copy()) if track else (None, None)
    be_rm, be_rv = (_dev_copy(backend, rm), _dev_copy(backend, rv)) if track else (None, None)
    kw = dict(training=training, momentum=momentum, eps=1e-5, relu=relu)
    y_ref, s_ref = F.batch_norm(x, w, b, ref_rm, ref_rv, backend=oracle, **kw)
    y, s = F.batch_norm(backend.asarray(x), _dev(backend, w), _dev(backend, b), be_rm, be_rv, backend=backend, **kw)
    assert_close(y, y_ref, what="y")
    assert_close(s.mean, s_ref.mean, what="mean")
    assert_close(s.invstd, s_ref.invstd, what="invstd")
    if track:
        assert_close(be_rm, ref_rm, what="running_mean")
        assert_close(be_rv, ref_rv, what="running_var")
    dy = rand(rng, *shape)
    g_ref = F.batch_norm_backward(x, w, dy, s_ref, backend=oracle)
    g = F.batch_norm_backward(backend.asarray(x), _dev(backend, w), backend.asarray(dy), s, backend=backend)
    scale = float(np.abs(g_ref[0]).max()) + 1.0
    assert_close(g[0], g_ref[0], atol=1e-5 * scale, what="dx")
    if affine:
        for got, want, name in zip(g[1:], g_ref[1:], ("dweight", "dbias")):
            assert_close(got, want, atol=1e-5 * (float(np.abs(want).max()) + 1.0), what=name)
    else:
        assert g[1] is None and g[2] is None
    g_nodx = F.batch_norm_backward(backend.asarray(x), _dev(backend, w), backend.asarray(dy), s,
                                   need_dx=False, backend=backend)
    assert g_nodx[0] is None


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("relu", [False, True])
@given(shape=bn_shapes, seed=st.integers(0, 2**31 - 1))
def test_batch_norm_oracle_gradient_matches_finite_differences(oracle, training, relu, shape, seed):
    rng = np.random.default_rng(seed)
    C = shape[1]
    x = rng.standard_normal(shape)
    w = rng.uniform(0.5, 1.5, C)
    b = rng.standard_normal(C)
    rm, rv = rng.standard_normal(C), rng.uniform(0.5, 2.0, C)
    r = rng.standard_normal(shape)

    def forward(fuse=relu):
        if training:
            return oracle.batch_norm_forward_train(x, w, b, None, None, 0.1, 1e-5, fuse)
        return oracle.batch_norm_forward_eval(x, w, b, rm, rv, 1e-5, fuse)

    if relu and np.abs(forward(False)[0]).min() < 1e-3:
        return  # an output too close to the ReLU's kink for central differences
    if training and x.reshape(shape[0], C, -1).transpose(1, 0, 2).reshape(C, -1).std(axis=1).min() < 0.05:
        return  # a channel of nearly equal values: its normalisation is too curved for the step
    y, mean, invstd = forward()
    dx, dw, db = oracle.batch_norm_backward(x, w, r, mean, invstd, y if relu else None, training)
    f = lambda: float((forward()[0] * r).sum())  # noqa: E731
    for arr, grad in ((x, dx), (w, dw), (b, db)):
        idx, num = numeric_grad(f, arr)
        np.testing.assert_allclose(grad.reshape(-1)[idx], num, rtol=1e-4, atol=1e-6)


def test_batch_norm_statistics_stay_accurate_for_large_channels(backend):
    # a channel of 2**19 values far from zero: float32 running sums would lose digits here
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((32, 2, 128, 128)) * 0.5 + 100.0).astype(np.float32)
    x64 = x.astype(np.float64)
    mean64 = x64.mean(axis=(0, 2, 3))
    var64 = x64.var(axis=(0, 2, 3))
    rm, rv = backend.asarray(np.zeros(2, np.float32)), backend.asarray(np.ones(2, np.float32))
    _, s = F.batch_norm(backend.asarray(x), None, None, rm, rv, training=True, momentum=1.0, backend=backend)
    assert_close(s.mean, mean64, rtol=1e-6, atol=0)
    assert_close(s.invstd, 1 / np.sqrt(var64 + 1e-5), rtol=1e-4, atol=0)
    assert_close(rv, var64 * x.size / 2 / (x.size / 2 - 1), rtol=1e-4, atol=0)


def test_openmp_batch_norm_is_reproducible():
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp backend not built")
    be = pc.backends.get("openmp")
    rng = np.random.default_rng(3)
    x, dy = rand(rng, 16, 8, 32, 32), rand(rng, 16, 8, 32, 32)
    w, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    with pc.num_threads(2):
        runs = []
        for _ in range(2):
            y, s = F.batch_norm(x, w, b, None, None, training=True, backend=be)
            runs.append((y, s.mean, s.invstd) + F.batch_norm_backward(x, w, dy, s, backend=be))
    for a, c in zip(*runs):
        np.testing.assert_array_equal(a, c)


@needs_torch
@given(shape=bn_shapes, seed=st.integers(0, 2**31 - 1), training=st.booleans(), affine=st.booleans(),
       relu=st.booleans(), momentum=st.sampled_from([0.1, 0.3]))
def test_batch_norm_matches_torch(backend, shape, seed, training, affine, relu, momentum):
    import torch
    import torch.nn.functional as TF

    rng = np.random.default_rng(seed)
    C = shape[1]
    x = rand(rng, *shape, scale=2.0)
    w, b = _params(rng, C, affine)
    rm, rv = _running(rng, C)
    xt = torch.tensor(x, requires_grad=True)
    wt = None if w is None else torch.tensor(w, requires_grad=True)
    bt = None if b is None else torch.tensor(b, requires_grad=True)
    rmt, rvt = torch.tensor(rm), torch.tensor(rv)
    yt = TF.batch_norm(xt, rmt, rvt, wt, bt, training=training, momentum=momentum, eps=1e-5)
    if relu:
        yt = torch.relu(yt)
    dy = rand(rng, *shape)
    yt.backward(torch.tensor(dy))
    be_rm, be_rv = _dev_copy(backend, rm), _dev_copy(backend, rv)
    y, s = F.batch_norm(x, w, b, be_rm, be_rv, training=training, momentum=momentum, relu=relu, backend=backend)
    assert_close(y, yt.detach().numpy(), rtol=1e-4, atol=1e-4, what="y")
    assert_close(be_rm, rmt.numpy(), what="running_mean")
    assert_close(be_rv, rvt.numpy(), what="running_var")
    dx, dw, db = F.batch_norm_backward(x, w, dy, s, backend=backend)
    scale = float(xt.grad.abs().max()) + 1.0
    assert_close(dx, xt.grad.numpy(), rtol=1e-3, atol=1e-4 * scale, what="dx")
    if affine:
        assert_close(dw, wt.grad.numpy(), rtol=1e-3, atol=1e-4 * (float(wt.grad.abs().max()) + 1), what="dweight")
        assert_close(db, bt.grad.numpy(), rtol=1e-3, atol=1e-4 * (float(bt.grad.abs().max()) + 1), what="dbias")


def test_batch_norm_on_opencl_stays_on_the_device():
    if "opencl" not in pc.available_backends():
        pytest.skip("opencl backend not available")
    be = pc.backends.get("opencl")
    rng = np.random.default_rng(0)
    x, dy = be.asarray(rand(rng, 4, 3, 5, 5)), be.asarray(rand(rng, 4, 3, 5, 5))
    w, b = be.asarray(np.ones(3, np.float32)), be.asarray(np.zeros(3, np.float32))
    rm, rv = be.asarray(np.zeros(3, np.float32)), be.asarray(np.ones(3, np.float32))
    be.transfers.reset()
    for training in (True, False):
        y, s = F.batch_norm(x, w, b, rm, rv, training=training, relu=True, backend=be)
        F.batch_norm_backward(x, w, dy, s, backend=be)
    assert be.transfers.d2h_count == 0 and be.transfers.h2d_count == 0, be.transfers


def test_batch_norm_rejects_bad_arguments(backend):
    x = np.ones((4, 3, 2, 2), np.float32)
    x[0] = 2
    w = np.ones(3, np.float32)
    rm, rv = backend.asarray(np.zeros(3, np.float32)), backend.asarray(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="x must be 2-D"):
        F.batch_norm(np.ones(4, np.float32), None, None, None, None, training=True, backend=backend)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        F.batch_norm(x, np.ones(2), None, None, None, training=True, backend=backend)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(np.ones((1, 3)), w, w, None, None, training=True, backend=backend)
    with pytest.raises(ValueError, match="training=False"):
        F.batch_norm(x, w, w, None, None, training=False, backend=backend)
    with pytest.raises(ValueError, match="both be given"):
        F.batch_norm(x, w, w, rm, None, training=True, backend=backend)
    with pytest.raises(TypeError, match="running_mean must be a float32 array"):
        F.batch_norm(x, w, w, [0.0, 0.0, 0.0], rv, training=True, backend=backend)
    with pytest.raises(ValueError, match="momentum"):
        F.batch_norm(x, w, w, rm, rv, training=True, momentum=1.5, backend=backend)
    with pytest.raises(ValueError, match="eps"):
        F.batch_norm(x, w, w, rm, rv, training=True, eps=0.0, backend=backend)
    with pytest.raises(TypeError, match="training must be a bool"):
        F.batch_norm(x, w, w, rm, rv, training="yes", backend=backend)
    y, s = F.batch_norm(x, w, w, rm, rv, training=True, backend=backend)
    with pytest.raises(TypeError, match="saved must be the BatchNormSaved"):
        F.batch_norm_backward(x, w, x, (True, None, None, None), backend=backend)
    with pytest.raises(ValueError, match="gradient dy"):
        F.batch_norm_backward(x, w, np.ones((4, 3, 2, 3)), s, backend=backend)
    with pytest.raises(ValueError, match=r"saved.mean must be a \(2,\)"):
        F.batch_norm_backward(np.ones((4, 2, 2, 2)), None, np.ones((4, 2, 2, 2)), s, backend=backend)
    assert host(y).shape == x.shape


def test_gpu_style_configuration_agrees_on_this_device(oracle):
    """The wide work-groups and strided reductions chosen for GPUs give the oracle's results too."""
    if "opencl" not in pc.available_backends():
        pytest.skip("opencl backend not available")
    import parconv.backends.opencl as ocl

    dev = pc.backends.get("opencl").device
    be = ocl.OpenCLBackend(config=ocl.device_config(dev, kind="gpu"))
    assert be.config.red_chunked == 0 and be.config.red_wg > 16
    rng = np.random.default_rng(11)
    for shape in [(3, 4, 5, 7), (37, 3), (2, 3, 300)]:
        C = shape[1]
        x, dy = rand(rng, *shape), rand(rng, *shape)
        w, b = _params(rng, C, True)
        rm, rv = _running(rng, C)
        for training in (True, False):
            be_rm, be_rv = _dev_copy(be, rm), _dev_copy(be, rv)
            ref_rm, ref_rv = rm.copy(), rv.copy()
            y, s = F.batch_norm(be.asarray(x), be.asarray(w), be.asarray(b), be_rm, be_rv, training=training,
                                relu=True, backend=be)
            y_ref, s_ref = F.batch_norm(x, w, b, ref_rm, ref_rv, training=training, relu=True, backend=oracle)
            assert_close(y, y_ref, what=f"{shape} y")
            assert_close(be_rv, ref_rv, what=f"{shape} running_var")
            grads = F.batch_norm_backward(be.asarray(x), be.asarray(w), be.asarray(dy), s, backend=be)
            for got, want in zip(grads, F.batch_norm_backward(x, w, dy, s_ref, backend=oracle)):
                assert_close(got, want, atol=1e-5 * (float(np.abs(want).max()) + 1.0), what=f"{shape} grads")
        np.testing.assert_array_equal(host(F.dropout(be.asarray(x), 0.3, 5, backend=be)),
                                      oracle.dropout_forward(x, 0.3, 5))
        assert F.mse_loss(be.asarray(x), be.asarray(dy), backend=be) == pytest.approx(oracle.mse_forward(x, dy),
                                                                                      rel=1e-5)


@pytest.mark.parametrize("shape", [(3, 5, 64, 64), (1, 7, 100, 100), (5000, 7), (2, 40000), (1, 40000),
                                   (9, 3, 2000)])
def test_openmp_batch_norm_chunks_agree_with_the_oracle(oracle, shape):
    """Shapes big enough to split over two threads: whole images per chunk, planes split
    inside one image, and (N, C) input in rows or split mid-row."""
    if "openmp" not in pc.available_backends():
        pytest.skip("openmp backend not built")
    be = pc.backends.get("openmp")
    rng = np.random.default_rng(sum(shape))
    C = shape[1]
    x, dy = rand(rng, *shape) + 3, rand(rng, *shape)
    w, b = _params(rng, C, True)
    rm, rv = _running(rng, C)
    with pc.num_threads(2):
        for training in (True, False)[int(np.prod(shape)) // C < 2:]:  # one value per channel: eval only
            kw = dict(training=training, relu=training)
            got_rm, got_rv, ref_rm, ref_rv = rm.copy(), rv.copy(), rm.copy(), rv.copy()
            y, s = F.batch_norm(x, w, b, got_rm, got_rv, backend=be, **kw)
            y_ref, s_ref = F.batch_norm(x, w, b, ref_rm, ref_rv, backend=oracle, **kw)
            assert_close(y, y_ref, what="y")
            assert_close(got_rv, ref_rv, what="running_var")
            grads = F.batch_norm_backward(x, w, dy, s, backend=be)
            for got, want in zip(grads, F.batch_norm_backward(x, w, dy, s_ref, backend=oracle)):
                assert_close(got, want, atol=1e-5 * (float(np.abs(want).max()) + 1.0))


@pytest.mark.parametrize("training", [True, False])
def test_fused_batch_norm_relu_matches_the_layers_in_both_modes(backend, training):
    """Sequential fuses BatchNorm2d -> ReLU in training and in eval mode: same output, input
    gradient, parameter gradients and running statistics as the unfused layers."""
    from parconv._fusion import count_fused

    def build(fuse):
        pc.manual_seed(11)
        model = pc.Sequential(pc.Conv2d(3, 4, 3, padding=1), pc.BatchNorm2d(4), pc.ReLU(), pc.Flatten(),
                              pc.Linear(4 * 5 * 5, 3), backend=backend, fuse=fuse)
        rng = np.random.default_rng(2)
        model[1].running_mean = backend.asarray(rand(rng, 4))
        model[1].running_var = backend.asarray(rng.uniform(0.5, 2.0, 4).astype(np.float32))
        return model.train(training)

    rng = np.random.default_rng(5)
    x, dy = rand(rng, 2, 3, 5, 5), rand(rng, 2, 3)
    fused, plain = build(True), build(False)
    outs = []
    for model in (fused, plain):
        y = model.forward(backend.asarray(x))
        dx = model.backward(backend.asarray(dy), need_dx=True)
        outs.append((host(y), host(dx), {k: host(p.grad) for k, p in model.named_parameters()},
                     {k: host(b) for k, b in model.named_buffers()}))
    assert count_fused(fused.plan()) == 1 and count_fused(plain.plan()) == 0
    (y1, dx1, g1, b1), (y2, dx2, g2, b2) = outs
    assert_close(y1, y2, what="y")
    assert_close(dx1, dx2, what="dx")
    for k in g2:
        assert_close(g1[k], g2[k], what=f"grad {k}")
    for k in b2:
        assert_close(b1[k], b2[k], what=f"buffer {k}")


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3), c=st.integers(1, 6), o=st.integers(1, 12),
       size=st.integers(3, 10), k=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]), bias=st.booleans(),
       affine=st.booleans(), relu=st.booleans())
def test_eval_conv_batch_norm_fold_matches_the_layers(backend, seed, n, c, o, size, k, stride, bias, affine, relu):
    """In eval mode Sequential folds Conv2d -> BatchNorm2d (-> ReLU) into one op: same output as the
    unfused layers; a backward pass after it (input gradients in eval mode) gives the layers' own
    gradients; training mode does not fold."""
    from parconv._fusion import ConvBatchNormEval

    def build(fuse):
        pc.manual_seed(seed % 1000)
        layers = [pc.Conv2d(c, o, k, stride=stride, padding=k // 2, bias=bias), pc.BatchNorm2d(o, affine=affine)]
        model = pc.Sequential(*layers, *([pc.ReLU()] if relu else []), backend=backend, fuse=fuse)
        r = np.random.default_rng(seed)
        model[1].running_mean = backend.asarray(rand(r, o))
        model[1].running_var = backend.asarray(r.uniform(0.3, 2.0, o).astype(np.float32))
        if affine:
            model[1].weight.data = backend.asarray(r.uniform(0.5, 1.5, o).astype(np.float32))
            model[1].bias.data = backend.asarray(rand(r, o))
        return model.eval()

    rng = np.random.default_rng(seed)
    x = rand(rng, n, c, size, size)
    fused, plain = build(True), build(False)
    steps = fused.plan()
    assert len(steps) == 1 and isinstance(steps[0].step, ConvBatchNormEval)
    assert steps[0].hooks == (1, 0)
    y1, y2 = fused.forward(x), plain.forward(x)
    assert_close(y1, host(y2), what="y")
    dy = rand(rng, *host(y2).shape)
    dx1, dx2 = fused.backward(dy, need_dx=True), plain.backward(dy, need_dx=True)
    assert_close(dx1, host(dx2), what="dx")
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        want = host(q.grad)
        assert_close(p.grad, want, atol=1e-5 * (float(np.abs(want).max()) + 1.0), what=f"grad {name}")
    assert not any(isinstance(s.step, ConvBatchNormEval) for s in fused.train().plan())


def test_eval_conv_batch_norm_fold_keeps_the_layers_errors(backend):
    model = pc.Sequential(pc.Conv2d(3, 4, 3), pc.BatchNorm2d(4), pc.ReLU(), backend=backend).eval()
    model(np.zeros((1, 3, 5, 5), np.float32))
    with pytest.raises(ValueError, match="in_channels=3"):
        model(np.zeros((1, 2, 5, 5), np.float32))
    with pytest.raises(ValueError, match="backward"):
        pc.Sequential(pc.Conv2d(3, 4, 3), pc.BatchNorm2d(4), backend=backend).eval().backward(
            np.zeros((1, 4, 3, 3), np.float32))


def test_conv2d_batch_norm_eval_functional(backend, oracle):
    rng = np.random.default_rng(3)
    x, w, b = rand(rng, 2, 3, 6, 6), rand(rng, 5, 3, 3, 3), rand(rng, 5)
    g, beta, rm = rng.uniform(0.5, 1.5, 5).astype(np.float32), rand(rng, 5), rand(rng, 5)
    rv = rng.uniform(0.5, 2.0, 5).astype(np.float32)
    got = F.conv2d_batch_norm_eval(x, w, b, g, beta, rm, rv, 1, 1, eps=1e-3, relu=True, backend=backend)
    z = F.conv2d(x, w, b, 1, 1, backend=oracle)
    want, _ = F.batch_norm(z, g, beta, oracle.asarray(rm), oracle.asarray(rv), training=False, eps=1e-3, relu=True,
                           backend=oracle)
    assert_close(got, host(want))
    with pytest.raises(ValueError, match=r"running_var must have shape \(5,\)"):
        F.conv2d_batch_norm_eval(x, w, b, g, beta, rm, rv[:4], backend=backend)
    with pytest.raises(ValueError, match="both be given"):
        F.conv2d_batch_norm_eval(x, w, b, g, None, rm, rv, backend=backend)
    with pytest.raises(ValueError, match="required"):
        F.conv2d_batch_norm_eval(x, w, b, g, beta, None, rv, backend=backend)
    with pytest.raises(ValueError, match="eps"):
        F.conv2d_batch_norm_eval(x, w, b, g, beta, rm, rv, eps=0.0, backend=backend)
    with pytest.raises(ValueError, match="square kernel"):
        F.conv2d_batch_norm_eval(x, rand(rng, 5, 3, 3, 2), b, g, beta, rm, rv, backend=backend)
