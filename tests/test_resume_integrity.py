"""Resume is exact and refuses another network.

* a layer's own generator (Dropout's masks) is saved in a training checkpoint
  and restored, so a run stopped mid-epoch and resumed is bit-identical to one
  that never stopped;
* a checkpoint resumes only into the network it was written from: the first
  differing layer is named, and ``parconv train --force`` does not override it;
* every ``parconv train --model`` writes its own default checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest

import parconv as pc
from parconv import _checkpoint
from parconv.cli import main

from conftest import BACKENDS


def _dropout_net(backend, act=None, extra_dropout=False):
    """A small VGG-style network with two Dropout layers."""
    rng = np.random.default_rng(0)
    layers = [pc.Conv2d(1, 4, 3, padding=1, rng=rng), (act or pc.ReLU)(), pc.MaxPool2d(2), pc.Dropout(0.3, rng=1),
              pc.Flatten(), pc.Linear(4 * 3 * 3, 8, rng=rng), pc.ReLU(), pc.Dropout(0.5, rng=2)]
    layers.append(pc.Linear(8, 3, rng=rng))
    if extra_dropout:
        layers.append(pc.Dropout(0.2, rng=3))
    return pc.Sequential(*layers, backend=backend)


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((40, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 40)


class _Stop(Exception):
    pass


def _fit_until(model, path, epoch, step_min=1, **kw):
    """fit with checkpoints every 2 steps, stopped by an exception right after the first checkpoint written
    mid-way through ``epoch``."""
    real = _checkpoint.save_training_checkpoint

    def save_then_stop(*args, **kwargs):
        real(*args, **kwargs)
        if kwargs["epoch"] == epoch and kwargs["step"] >= step_min:
            raise _Stop

    _checkpoint.save_training_checkpoint = save_then_stop
    try:
        with pytest.raises(_Stop):
            model.fit(*_data(), checkpoint=path, checkpoint_every=2, **kw)
    finally:
        _checkpoint.save_training_checkpoint = real


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_with_dropout_is_bit_identical(tmp_path, backend):
    x, y = _data()
    kw = dict(epochs=3, batch_size=8, seed=3, verbose=False)
    ref = _dropout_net(backend)
    ref.fit(x, y, optimizer=pc.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), **kw)

    path = tmp_path / "ck.npz"
    part = _dropout_net(backend)
    _fit_until(part, path, epoch=2, optimizer=pc.optim.SGD(part.parameters(), lr=0.05, momentum=0.9), **kw)
    assert set(_checkpoint.load_training_checkpoint(path).generators) == {"3", "7"}

    resumed = _dropout_net(backend)  # fresh generators: only the checkpoint can put them where they were
    resumed.fit(x, y, optimizer=pc.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9), resume=path, **kw)
    want, got = ref.state_dict(), resumed.state_dict()
    differing = [k for k in want if not np.array_equal(want[k], got[k])]
    assert differing == []
    # and the generators are where the uninterrupted run's are
    for name, gen in _checkpoint.layer_generators(ref).items():
        assert _checkpoint.layer_generators(resumed)[name].bit_generator.state == gen.bit_generator.state


def test_generators_of_nested_layers_are_saved(tmp_path):
    body = pc.Sequential(pc.Linear(4, 4, rng=0), pc.Dropout(0.5, rng=1))
    model = pc.Sequential(pc.Flatten(), pc.Residual(body), pc.Linear(4, 2, rng=0), backend="numpy")
    assert list(_checkpoint.layer_generators(model)) == ["1.body.1"]
    x, y = np.ones((4, 1, 2, 2), np.float32), np.zeros(4, np.int64)
    path = tmp_path / "ck.npz"
    model.fit(x, y, epochs=1, batch_size=4, optimizer=pc.optim.SGD(model.parameters(), lr=0.1), verbose=False,
              checkpoint=path)
    state = _checkpoint.load_training_checkpoint(path)
    assert state.generators["1.body.1"] == body[1]._gen.bit_generator.state


def test_corrupt_generator_state_is_refused(tmp_path):
    from parconv._io import load_npz, save_npz

    model = _dropout_net("numpy")
    path = tmp_path / "ck.npz"
    model.fit(*_data(), epochs=1, batch_size=8, optimizer=pc.optim.SGD(model.parameters(), lr=0.1),
              verbose=False, checkpoint=path)
    arrays, meta = load_npz(path)
    meta["training"]["generators"]["3"] = {"bit_generator": "PCG64", "state": "nonsense"}
    save_npz(path, arrays, meta)
    with pytest.raises(ValueError, match=r"generators\.3"):
        _checkpoint.load_training_checkpoint(path)


# ------------------------------------------------------------------ another network
def _checkpoint_of(tmp_path, model):
    path = tmp_path / "ck.npz"
    model.fit(*_data(), epochs=1, batch_size=8, optimizer=pc.optim.SGD(model.parameters(), lr=0.1),
              verbose=False, checkpoint=path)
    return path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("other, message", [
    (dict(act=pc.Tanh), "layer 1: checkpoint has ReLU, model has Tanh"),
    (dict(extra_dropout=True), r"layer 9: Dropout\(p=0.2\) is only in the model \(the checkpoint's network has 9 layers, the model 10\)"),
])
def test_resume_refuses_another_network(tmp_path, backend, other, message):
    path = _checkpoint_of(tmp_path, _dropout_net(backend))
    model = _dropout_net(backend, **other)  # the same parameter keys and shapes: load_state_dict alone accepts it
    before = model.state_dict()
    with pytest.raises(ValueError, match=message):
        model.fit(*_data(), epochs=2, batch_size=8, optimizer=pc.optim.SGD(model.parameters(), lr=0.1),
                  verbose=False, resume=path)
    for key, value in before.items():  # nothing was loaded
        np.testing.assert_array_equal(model.state_dict()[key], value)


def test_architecture_difference_names_config_and_nested_layers():
    a = pc.Sequential(pc.Conv2d(1, 4, 3), pc.Residual(pc.Sequential(pc.ReLU(), pc.Identity())), backend="numpy")
    b = pc.Sequential(pc.Conv2d(1, 4, 3), pc.Residual(pc.Sequential(pc.ReLU(), pc.Tanh())), backend="numpy")
    c = pc.Sequential(pc.Conv2d(1, 8, 3), pc.Residual(pc.Sequential(pc.ReLU(), pc.Identity())), backend="numpy")
    assert _checkpoint.architecture_difference(a.config(), a) is None
    assert _checkpoint.architecture_difference(a.config(), pc.Sequential(*a.layers, fuse=False)) is None
    assert _checkpoint.architecture_difference(a.config(), b) == "layer 1.body.1: checkpoint has Identity, model has Tanh"
    assert _checkpoint.architecture_difference(a.config(), c) == \
        "layer 0 (Conv2d): checkpoint has out_channels=4, model has out_channels=8"


# ------------------------------------------------------------------ the command line
def _train_args(tmp_path, *extra):
    return ["train", "--train-size", "200", "--epochs", "1", "--batch-size", "50", "--quiet",
            "--backend", "numpy" if "openmp" not in BACKENDS else "openmp", *extra]


def test_cli_resume_with_another_model_names_the_layer_even_with_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ck = str(tmp_path / "cnn.npz")
    assert main(_train_args(tmp_path, "--filters", "4", "--checkpoint", ck)) == 0
    capsys.readouterr()
    # other lr and batch size (which --force would take from the checkpoint) and another network
    code = main(_train_args(tmp_path, "--model", "lenet5", "--resume", ck, "--checkpoint", ck, "--force",
                            "--lr", "0.5"))
    err = capsys.readouterr().err
    assert code == 2
    assert ("the checkpoint holds another network than --model lenet5 builds: layer 1 (Conv2d): checkpoint has "
            "out_channels=4, kernel_size=3, padding=0, model has out_channels=6, kernel_size=5, padding=2") in err, err
    assert "--force" in err and "missing keys" not in err, err
    # the same network with other filters: named as a config difference
    code = main(_train_args(tmp_path, "--filters", "6", "--resume", ck, "--checkpoint", ck, "--force"))
    err = capsys.readouterr().err
    assert code == 2 and "layer 1 (Conv2d): checkpoint has out_channels=4, model has out_channels=6" in err, err


def test_cli_default_checkpoint_is_per_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(_train_args(tmp_path, "--filters", "4")) == 0
    assert main(_train_args(tmp_path, "--model", "lenet5", "--no-augment")) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["parconv-cnn-mnist.npz", "parconv-lenet5.npz"]
    assert "checkpoint: parconv-lenet5.npz" in out
    assert pc.load(tmp_path / "parconv-cnn-mnist.npz")[1].out_channels == 4
    assert type(pc.load(tmp_path / "parconv-lenet5.npz")[1]).__name__ == "Conv2d"


def test_checkpoint_without_generator_states_warns(tmp_path):
    """A checkpoint written before generator states were saved still resumes, saying what is lost."""
    from parconv._io import load_npz, save_npz

    model = _dropout_net("numpy")
    path = _checkpoint_of(tmp_path, model)
    arrays, meta = load_npz(path)
    del meta["training"]["generators"]
    save_npz(path, arrays, meta)
    resumed = _dropout_net("numpy")
    with pytest.warns(UserWarning, match=r"no generator state for layers \['3', '7'\]"):
        resumed.fit(*_data(), epochs=2, batch_size=8, optimizer=pc.optim.SGD(resumed.parameters(), lr=0.1),
                    verbose=False, resume=path)
