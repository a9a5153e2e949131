"""The model zoo against PyTorch twins: state dicts load with strict=True, eval-mode logits agree,
and two SGD-momentum steps in training mode give the same loss and weights."""

from __future__ import annotations

import numpy as np
import pytest

import parconv as pc
from conftest import HAVE_TORCH, needs_torch

ZOO = sorted(pc.models.ZOO)


def _randomise_bn(model, rng):
    """Non-trivial running statistics, so eval mode is really tested."""
    state = model.state_dict()
    for k in state:
        if k.endswith("running_mean"):
            state[k] = rng.standard_normal(state[k].shape).astype(np.float32) * 0.1
        elif k.endswith("running_var"):
            state[k] = rng.uniform(0.5, 1.5, state[k].shape).astype(np.float32)
    model.load_state_dict(state)


#: smaller images than the zoo's defaults keep the NumPy reference quick; the layers are the same
TEST_SHAPES = {"cnn-mnist": (1, 28, 28), "lenet5": (1, 28, 28), "vgg-small": (3, 16, 16), "resnet20": (3, 16, 16),
               "mobilenet-small": (3, 16, 16)}


def _build(name, rng):
    return pc.models.build(name, TEST_SHAPES[name], backend="numpy", rng=rng)


def _data(name, n, seed):
    shape = TEST_SHAPES[name]
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + shape).astype(np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_builds_and_summarises(name):
    model = pc.models.build(name, backend="numpy", rng=0)
    shape = pc.models.ZOO[name][1]
    text = model.summary(shape, print_fn=None)
    assert f"parameters: {model.num_parameters():,}" in text
    assert model.output_shape((2,) + shape) == (2, 10)
    assert model(np.zeros((2,) + shape, np.float32)).shape == (2, 10)
    if name == "resnet20":
        assert 0.26e6 < model.num_parameters() < 0.28e6


@pytest.mark.parametrize("name", ZOO)
def test_zoo_builders_validate(name):
    builder = pc.models.ZOO[name][0]
    with pytest.raises(ValueError, match="num_classes must be >= 1"):
        builder(num_classes=0)
    with pytest.raises(TypeError, match="in_channels must be an int"):
        builder(in_channels=1.5)


@needs_torch
@pytest.mark.parametrize("name", ZOO)
def test_zoo_eval_logits_match_torch(name, backend):
    import torch

    from torch_twin import twin

    model = _build(name, 1)
    _randomise_bn(model, np.random.default_rng(2))
    model.eval()
    tm = twin(model)
    model.to(backend)
    x, _ = _data(name, 3, 3)
    with torch.no_grad():
        expected = tm(torch.from_numpy(x)).numpy()
    got = pc.to_numpy(model(x))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@needs_torch
@pytest.mark.parametrize("name", ZOO)
def test_zoo_two_sgd_steps_match_torch(name, backend):
    import torch

    from torch_twin import to_pc_state, twin

    model = _build(name, 4)
    # two oracles: torch in float32 and in float64. A ReLU whose input lies within rounding of zero
    # may flip between them; parconv (float32) must agree with one of the two on every tensor
    oracles = [twin(model), twin(model).double()]
    model.to(backend)
    x, y = _data(name, 6, 5)
    if any(isinstance(m, pc.Dropout) for m in model.modules()):
        # Dropout masks come from different generators: compare with dropout off in both
        for m in model.modules():
            if isinstance(m, pc.Dropout):
                m.p = 0.0
        for tm in oracles:
            for m in tm.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
    opt = pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    topts = [torch.optim.SGD(tm.parameters(), lr=0.05, momentum=0.9) for tm in oracles]
    loss_fn = pc.SoftmaxCrossEntropy()
    for _ in range(2):
        loss = loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        tlosses = []
        for tm, topt in zip(oracles, topts):
            topt.zero_grad()
            dtype = next(tm.parameters()).dtype
            tloss = torch.nn.functional.cross_entropy(tm(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
            tloss.backward()
            topt.step()
            tlosses.append(float(tloss.detach()))
        assert any(loss == pytest.approx(t, rel=1e-3) for t in tlosses), (loss, tlosses)
    expected = [to_pc_state(tm) for tm in oracles]
    for k, v in model.state_dict().items():
        errors = []
        for e in expected:
            try:
                np.testing.assert_allclose(v, e[k], rtol=1e-3, atol=1e-4, err_msg=k)
                break
            except AssertionError as exc:
                errors.append(str(exc))
        else:
            raise AssertionError("\n".join(errors))


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch not installed (optional oracle)")
def test_nested_state_dict_loads_into_torch_strict():
    from torch_twin import module

    model = pc.Sequential(pc.Conv2d(1, 2, 3), pc.Sequential(pc.BatchNorm2d(2), pc.ReLU()),
                          pc.Residual(pc.Sequential(pc.Conv2d(2, 2, 3, padding=1)),
                                      pc.Sequential(pc.Conv2d(2, 2, 1))), backend="numpy")
    keys = list(model.state_dict())
    assert keys[:2] == ["0.weight", "0.bias"]
    assert "1.0.running_mean" in keys and "1.0.num_batches_tracked" in keys
    assert "2.body.0.weight" in keys and "2.shortcut.0.bias" in keys
    import torch

    tm = module(model)
    tm.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in model.state_dict().items()}, strict=True)
    assert list(tm.state_dict()) == keys
