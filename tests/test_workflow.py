"""The training workflow through fit: modes, callbacks, schedulers, DataLoaders, summary, and the
new-user errors (non-finite data, a foreign optimizer, unscaled images, image shapes)."""

from __future__ import annotations

import csv
import warnings

import numpy as np
import pytest

import parconv as pc


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, 6, 6)).astype(np.float32)
    y = (x[:, 0, :3].sum(axis=(1, 2)) > 0).astype(np.int64)
    return x, y


def _net(backend, dropout=0.0, seed=0):
    return pc.Sequential(pc.Conv2d(1, 4, 3, padding=1, rng=seed), pc.BatchNorm2d(4), pc.ReLU(), pc.Flatten(),
                         pc.Dropout(dropout), pc.Linear(4 * 36, 2, rng=seed + 1), backend=backend)


def test_modes_fit_trains_evaluate_and_predict_restore(backend):
    model = _net(backend)
    x, y = _data()
    seen = []

    class Probe(pc.callbacks.Callback):
        def on_batch_end(self, step, logs):
            seen.append(model.training and model[1].training)

    model.eval()
    model.fit(x, y, epochs=1, batch_size=16, verbose=False, callbacks=[Probe()],
              optimizer=pc.optim.SGD(model.parameters(), lr=0.1))
    assert seen and all(seen)            # fit trained in training mode ...
    assert not model.training and not model[1].training  # ... and gave the previous mode back
    assert int(model[1].num_batches_tracked) == 4
    model.train()
    before = model.state_dict()["1.running_mean"].copy()
    model.evaluate(x, y)
    model.predict(x)
    assert model.training and model[1].training
    np.testing.assert_array_equal(model.state_dict()["1.running_mean"], before)  # eval mode: stats untouched


def test_early_stopping_checkpoint_and_csv_logger(backend, tmp_path):
    x, y = _data(96)
    model = _net(backend)
    stop = pc.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    best_path = tmp_path / "best.npz"
    ck = pc.callbacks.ModelCheckpoint(best_path, monitor="val_loss", save_best_only=True)
    log = pc.callbacks.CSVLogger(tmp_path / "log.csv")
    # a learning rate that makes the validation loss worse after a while
    opt = pc.optim.SGD(model.parameters(), lr=2.0, momentum=0.9)
    history = model.fit(x[:64], y[:64], epochs=30, batch_size=16, optimizer=opt, verbose=False,
                        validation_data=(x[64:], y[64:]), callbacks=[stop, ck, log])
    assert len(history.epochs) < 30 and stop.stopped_epoch == history.epochs[-1]
    best_epoch = int(np.argmin(history["val_loss"]))
    # restore_best_weights: the model now gives the best epoch's validation loss
    assert model.evaluate(x[64:], y[64:])["loss"] == pytest.approx(history["val_loss"][best_epoch], rel=1e-5)
    best = pc.load(best_path, backend=backend)
    assert best.evaluate(x[64:], y[64:])["loss"] == pytest.approx(history["val_loss"][best_epoch], rel=1e-5)
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(history.epochs)
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(history["val_loss"])


def test_stop_training_from_a_plain_callable_keeps_history(backend):
    x, y = _data()
    model = _net(backend)

    def stop_after_two(epoch, logs):
        if epoch == 2:
            model.stop_training = True

    history = model.fit(x, y, epochs=5, batch_size=32, verbose=False, callbacks=[stop_after_two],
                        optimizer=pc.optim.SGD(model.parameters(), lr=0.05))
    assert history.epochs == [1, 2] and len(history["loss"]) == 2


@pytest.mark.parametrize("kind", ["step", "onecycle", "plateau"])
def test_fit_steps_schedulers_at_the_right_moment(kind):
    x, y = _data(48)
    model = _net("numpy")
    opt = pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = pc.optim.lr_scheduler
    if kind == "step":
        s = sched.StepLR(opt, step_size=1, gamma=0.5)
        expected = [0.1, 0.05, 0.025]
    elif kind == "onecycle":
        s = sched.OneCycleLR(opt, max_lr=0.1, total_steps=9)
        expected = None
    else:
        s = sched.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    history = model.fit(x, y, epochs=3, batch_size=16, optimizer=opt, scheduler=s, verbose=False,
                        validation_data=(x, y))
    if kind == "step":
        assert history["lr"] == pytest.approx(expected)
    elif kind == "onecycle":
        assert s.last_epoch == 9  # stepped once per batch: 3 epochs x 3 batches
    else:
        lrs = history["lr"]
        assert all(b <= a for a, b in zip(lrs, lrs[1:]))


def test_fit_takes_a_dataloader_and_a_memmap(backend, tmp_path):
    x, y = _data(80)
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=x.shape)
    mm[:] = x
    mm.flush()
    ro = np.load(tmp_path / "x.npy", mmap_mode="r")
    model = _net(backend)
    h1 = model.fit(ro, y, epochs=1, batch_size=16, verbose=False, seed=1,
                   optimizer=pc.optim.SGD(model.parameters(), lr=0.05))
    assert np.isfinite(h1["loss"][0])
    loader = pc.data.DataLoader(ro, y, batch_size=16, shuffle=True, seed=3,
                                transform=pc.data.transforms.RandomCrop(6, padding=1))
    model2 = _net(backend)
    h2 = model2.fit(loader, epochs=2, verbose=False, optimizer=pc.optim.SGD(model2.parameters(), lr=0.05),
                    validation_data=pc.data.DataLoader(x, y, batch_size=32, shuffle=False))
    assert len(h2["loss"]) == 2 and np.isfinite(h2["val_loss"]).all()
    assert model2.evaluate(pc.data.DataLoader(x, y, batch_size=32, shuffle=False))["accuracy"] >= 0.0


@pytest.mark.parametrize("where", ["x", "validation"])
def test_non_finite_inputs_are_refused_before_training(backend, where):
    x, y = _data()
    bad = x.copy()
    bad[37, 0, 2, 4] = np.nan if where == "x" else np.inf
    model = _net(backend)
    before = model.state_dict()
    kwargs = dict(epochs=1, verbose=False, optimizer=pc.optim.SGD(model.parameters(), lr=0.1))
    name = "x" if where == "x" else "validation x"
    with pytest.raises(ValueError, match=rf"{name} holds .* at index \(37, 0, 2, 4\)"):
        if where == "x":
            model.fit(bad, y, **kwargs)
        else:
            model.fit(x, y, validation_data=(bad, y), **kwargs)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_optimizer_of_another_model_is_refused(backend):
    x, y = _data()
    model, other = _net(backend), _net(backend)
    with pytest.raises(ValueError, match="updates none of this model's parameters"):
        model.fit(x, y, verbose=False, optimizer=pc.optim.SGD(other.parameters(), lr=0.1))


def test_unscaled_images_warn_once(backend):
    x, y = _data()
    img = np.clip(np.abs(x) * 80, 0, 255).astype(np.uint8)
    model = _net(backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(img, y, epochs=1, verbose=False, optimizer=pc.optim.SGD(model.parameters(), lr=0.001))
    messages = [str(w.message) for w in caught if "looks unscaled" in str(w.message)]
    assert len(messages) == 1 and "divide images by 255" in messages[0]


def test_image_shape_mistakes_say_how_to_fix(backend):
    model = _net(backend)
    with pytest.raises(ValueError, match=r"got shape \(1, 6, 6\) .*x\[None\]"):
        model(np.zeros((1, 6, 6), np.float32))
    with pytest.raises(ValueError, match=r"x\[:, None\] for shape \(5, 1, 6, 6\)"):
        model(np.zeros((5, 6, 6), np.float32))


def test_summary_counts_shapes_parameters_and_multiply_adds():
    model = pc.Sequential(pc.Conv2d(1, 2, 3), pc.ReLU(), pc.Flatten(), pc.Linear(2 * 4 * 4, 3), backend="numpy")
    text = model.summary((1, 6, 6), print_fn=None)
    assert "(1, 2, 4, 4)" in text and "(1, 3)" in text
    assert f"parameters: {model.num_parameters():,}" in text
    conv_macs = 2 * 4 * 4 * 9
    assert f"{conv_macs:,}" in text
    assert f"forward multiply-adds: {conv_macs + 32 + 32 * 3:,}" in text
    with pytest.raises(TypeError, match="input_shape must be a tuple of ints"):
        model.summary("1,6,6")
    with pytest.raises(ValueError, match=r"input_shape must hold positive ints.*got \(1, 0, 6\)"):
        model.summary((1, 0, 6))


def test_public_namespace_is_clean():
    assert not hasattr(pc, "annotations")
    lazy = {"distributed", "onnx"}  # imported on first use: they need mpi4py / onnx
    for name in set(pc.__all__) - lazy:
        assert hasattr(pc, name), name


def test_regression_with_mse_reports_no_accuracy(backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3)).astype(np.float32)
    y = (x @ rng.standard_normal((3, 2))).astype(np.float32)
    model = pc.Sequential(pc.Linear(3, 8, rng=0), pc.Tanh(), pc.Linear(8, 2, rng=1), backend=backend)
    history = model.fit(x, y, epochs=3, batch_size=8, loss=pc.MSELoss(), verbose=False, validation_data=(x, y),
                        optimizer=pc.optim.SGD(model.parameters(), lr=0.05))
    assert "accuracy" not in history and "val_accuracy" not in history
    assert history["loss"][-1] < history["loss"][0]
    assert set(model.evaluate(x, y, loss=pc.MSELoss())) == {"loss"}
