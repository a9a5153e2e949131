"""Eval-mode Conv2d -> BatchNorm2d (-> ReLU) folding for every convolution (depthwise, grouped,
dilated): the fused forward against the unfused layers, the fold built once and rebuilt after
every weight change parconv makes, and against PyTorch when installed."""

import numpy as np
import pytest

import parconv as pc
from parconv import _fusion
from conftest import assert_close, needs_torch, rand


def _randomise_bn(model, rng):
    """Non-trivial running statistics and affine parameters (a fresh BatchNorm folds to the identity)."""
    for layer in model.modules():
        if isinstance(layer, pc.BatchNorm2d):
            c = layer.num_features
            layer.load_state_dict({"weight": rng.uniform(0.5, 1.5, c), "bias": rng.normal(0, 0.3, c),
                                   "running_mean": rng.normal(0, 0.3, c), "running_var": rng.uniform(0.3, 2.0, c),
                                   "num_batches_tracked": np.array(5)}, strict=False)


def _pair(backend="openmp", seed=0):
    """The same mobilenet_small twice: fused and unfused, in eval mode."""
    rng = np.random.default_rng(seed)
    fused = pc.models.mobilenet_small(backend=backend, rng=seed)
    _randomise_bn(fused, rng)
    plain = pc.models.mobilenet_small(backend=backend, rng=seed)
    plain.load_state_dict(fused.state_dict())
    plain.fuse = False
    return fused.eval(), plain.eval()


def _general_folds(model):
    return [s.step for s in model.plan() if isinstance(s.step, _fusion.ConvBatchNormEval) and not s.step.conv.simple]


@pytest.fixture(params=["openmp", "numpy"])
def be_name(request):
    if request.param not in pc.available_backends():
        pytest.skip(f"no {request.param} backend here")
    return request.param


def test_depthwise_conv_bn_relu_runs_folded_and_matches_the_unfused_layers(be_name):
    fused, plain = _pair(be_name)
    folds = _general_folds(fused)
    assert len(folds) == 6 and all(f.relu and f.conv.groups == f.conv.in_channels for f in folds)
    x = rand(np.random.default_rng(1), 3, 3, 32, 32)
    with pc.no_grad():
        assert_close(fused(x), pc.to_numpy(plain(x)), rtol=1e-4, atol=1e-4, what="logits")


def test_grouped_dilated_conv_without_relu_folds_too():
    rng = np.random.default_rng(2)
    layers = [pc.Conv2d(4, 6, (3, 2), padding=(2, 1), dilation=2, groups=2, rng=0), pc.BatchNorm2d(6)]
    fused, plain = pc.Sequential(*layers), pc.Sequential(*layers, fuse=False)
    _randomise_bn(fused, rng)
    fused.eval()
    (step,) = _general_folds(fused)
    assert not step.relu
    x = rand(rng, 2, 4, 9, 8)
    assert_close(fused(x), pc.to_numpy(plain(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["depthwise", "pointwise"])
def test_the_fold_is_built_once_and_rebuilt_after_each_weight_change(kind):
    fused, plain = _pair()
    rng = np.random.default_rng(3)
    x = rand(rng, 2, 3, 32, 32)
    folds = [s.step for s in fused.plan() if isinstance(s.step, _fusion.ConvBatchNormEval)]
    step = [f for f in folds if (f.conv.groups > 1) == (kind == "depthwise")][1]
    with pc.no_grad():
        fused(x)
        first = step.folded()
        fused(x)
        assert all(a is b for a, b in zip(step.folded(), first)), "refolded without a weight change"

    def check(what):
        plain.load_state_dict(fused.state_dict())
        with pc.no_grad():
            assert_close(fused(x), pc.to_numpy(plain(x)), rtol=1e-4, atol=1e-4, what=what)
        assert step.folded()[0] is not first[0], f"{what}: the fold was not rebuilt"

    conv, bn = step.conv, step.bn
    # assigning a parameter's array
    conv.weight.data = conv.weight.data * 1.5
    check("Parameter.data assignment")
    first = step.folded()
    # load_state_dict (the statistics)
    state = fused.state_dict()
    name = [k for k in state if k.endswith("running_var")][1]
    state[name] = state[name] * 3.0
    fused.load_state_dict(state)
    check("load_state_dict")
    first = step.folded()
    # an optimizer step (gradients from a backward in eval mode)
    opt = pc.optim.SGD(fused.parameters(), lr=0.5)
    out = fused(x)
    fused.backward(np.ones(pc.to_numpy(out).shape, np.float32))
    opt.step()
    check("optimizer step")
    first = step.folded()
    # a round trip through training mode (running statistics move in the training forward)
    fused.train()
    fused(x)
    fused.eval()
    check("train() then eval()")
    first = step.folded()
    # a backend copy into the parameter (what checkpoint restores and benchmarks do)
    be = fused.backend
    be.copy_into(conv.weight.data, be.asarray(pc.to_numpy(conv.weight.data) * 0.5))
    check("Backend.copy_into")
    first = step.folded()
    # written in place, then announced
    bn.bias.data[...] += 1.0
    pc.weights_changed()
    check("in-place write + weights_changed")


def test_folded_forward_repeats_bit_for_bit():
    fused, _ = _pair()
    x = rand(np.random.default_rng(4), 4, 3, 32, 32)
    with pc.num_threads(2), pc.no_grad():
        a = pc.to_numpy(fused(x)).copy()
        for _ in range(3):
            np.testing.assert_array_equal(pc.to_numpy(fused(x)), a)


def test_backward_through_a_folded_step_matches_the_unfused_layers():
    fused, plain = _pair()
    x = rand(np.random.default_rng(5), 2, 3, 32, 32)
    dy = np.ones((2, 10), np.float32)
    fused(x)
    plain(x)
    dx_f, dx_p = fused.backward(dy, need_dx=True), plain.backward(dy, need_dx=True)
    assert_close(dx_f, pc.to_numpy(dx_p), rtol=1e-3, atol=1e-4)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        assert_close(a.grad, pc.to_numpy(b.grad), rtol=1e-3, atol=1e-4, what=name)


@needs_torch
def test_folded_depthwise_block_matches_torch():
    import torch

    rng = np.random.default_rng(6)
    conv = pc.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, rng=0)
    bn = pc.BatchNorm2d(8)
    model = pc.Sequential(conv, bn, pc.ReLU())
    _randomise_bn(model, rng)
    model.eval()
    tconv = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
    tbn = torch.nn.BatchNorm2d(8)
    with torch.no_grad():
        tconv.weight.copy_(torch.from_numpy(conv.weight.numpy()))
        tconv.bias.copy_(torch.from_numpy(conv.bias.numpy()))
        for name in ("weight", "bias"):
            getattr(tbn, name).copy_(torch.from_numpy(getattr(bn, name).numpy()))
        tbn.running_mean.copy_(torch.from_numpy(np.asarray(bn.running_mean)))
        tbn.running_var.copy_(torch.from_numpy(np.asarray(bn.running_var)))
    tbn.eval()
    x = rand(rng, 2, 8, 11, 12)
    with torch.no_grad():
        want = torch.relu(tbn(tconv(torch.from_numpy(x)))).numpy()
    assert_close(model(x), want, rtol=1e-4, atol=1e-5)


def test_parameter_data_keeps_its_shape():
    # fused steps size their kernels from the layer; a weight of another shape would be read out of bounds
    lin = pc.Linear(64, 32, rng=0, backend="numpy")
    with pytest.raises(ValueError, match=r"Parameter.data: expected an array of shape \(32, 64\), got \(32, 8\)"):
        lin.weight.data = np.ones((32, 8), np.float32)
    with pytest.raises(ValueError, match=r"expected an array of shape \(32,\), got \(3,\)"):
        lin.bias.data = np.ones(3, np.float32)
    lin.weight.data = np.ones((32, 64), np.float32)  # the same shape is fine


def test_fold_refuses_statistics_of_another_length():
    model = pc.Sequential(pc.Conv2d(3, 4, 3, padding=1, bias=False, rng=0), pc.BatchNorm2d(4, affine=False),
                          backend="openmp" if "openmp" in pc.available_backends() else "numpy").eval()
    model[1].running_mean = np.zeros(1, np.float32)
    model[1].running_var = np.ones(1, np.float32)
    step = [s.step for s in model.plan() if isinstance(s.step, _fusion.ConvBatchNormEval)]
    if not step:
        pytest.skip("this backend does not fold")
    with pytest.raises(ValueError, match="must have 4 entries"):
        step[0].folded()


def test_same_padding_takes_the_square_kernels_path():
    conv = pc.Conv2d(16, 16, 3, padding="same", rng=0)
    assert conv.simple and conv._fargs == {"stride": 1, "padding": 1}
    assert not pc.Conv2d(16, 16, (3, 5), padding="same", rng=0).simple
    x = np.random.default_rng(0).standard_normal((2, 16, 7, 9)).astype(np.float32)
    ref = pc.Conv2d(16, 16, 3, padding=1, rng=0, backend=conv.backend)
    np.testing.assert_array_equal(pc.functional.conv2d(x, conv.weight.data, conv.bias.data, padding="same",
                                                       backend=conv.backend), conv(x))
    np.testing.assert_array_equal(ref(x), conv(x))
