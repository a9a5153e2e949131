"""pc.callbacks against a small fake model (the fit integration is tested with fit itself)."""

import csv
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import parconv as pc
from parconv.callbacks import Callback, CallbackList, CSVLogger, EarlyStopping, ModelCheckpoint


class FakeModel:
    """What the callbacks use of a model: ``stop_training``, state dicts and ``save``."""

    def __init__(self):
        self.stop_training = False
        self.w = np.zeros(3, np.float32)
        self.saved = []
        self.loads = 0

    def state_dict(self):
        return {"0.weight": self.w}  # a live view, as the NumPy backend hands out

    def load_state_dict(self, state):
        self.w = np.array(state["0.weight"], copy=True)
        self.loads += 1

    def save(self, path):
        self.saved.append(path)
        np.save(path + ".npy" if not path.endswith(".npy") else path, self.w)


def run(callback, values, key="val_loss", model=None):
    """Drive ``callback`` like fit: weights become the epoch number; stop when asked."""
    model = model or FakeModel()
    callback.on_train_begin(model)
    ran = 0
    for epoch, v in enumerate(values, start=1):
        model.w[:] = epoch
        callback.on_epoch_end(epoch, {"loss": 1.0, key: v})
        ran = epoch
        if model.stop_training:
            break
    callback.on_train_end(None)
    return model, ran


# ------------------------------------------------------------------ EarlyStopping
@pytest.mark.parametrize("patience, expected_stop", [(0, 3), (1, 3), (2, 4), (3, 0)])
def test_early_stopping_patience(patience, expected_stop):
    # improves at epochs 1, 2, 5; as in Keras, patience 0 and 1 both stop at the first epoch without
    # improvement, and patience counts the epochs since the last improvement, that one included
    values = [1.0, 0.8, 0.9, 0.85, 0.7, 0.75, 0.71]
    cb = EarlyStopping(patience=patience)
    model, ran = run(cb, values)
    assert cb.stopped_epoch == expected_stop
    assert model.stop_training == (expected_stop > 0)
    assert ran == (expected_stop or len(values))
    assert cb.best == (0.8 if expected_stop in (3, 4) else 0.7)


def test_early_stopping_min_delta_and_max_mode():
    cb = EarlyStopping(monitor="val_accuracy", patience=1, min_delta=0.05)
    assert cb.mode == "max"
    # 0.52 and 0.54 are within min_delta of 0.5: no improvement
    _, ran = run(cb, [0.5, 0.52, 0.54], key="val_accuracy")
    assert cb.stopped_epoch == 2 and ran == 2 and cb.best == 0.5
    cb = EarlyStopping(monitor="loss_like", mode="max", patience=0)
    run(cb, [1.0, 2.0, 1.5], key="loss_like")
    assert cb.stopped_epoch == 3 and cb.best == 2.0


def test_early_stopping_baseline():
    values = [0.9, 0.8, 0.85, 0.7]
    cb = EarlyStopping(patience=2)
    run(cb, values)
    assert cb.stopped_epoch == 0
    cb = EarlyStopping(patience=2, baseline=0.5)
    _, ran = run(cb, values)  # the improvements never beat the baseline, so the count runs on
    assert cb.stopped_epoch == 3 and ran == 3 and cb.best == 0.8


@pytest.mark.parametrize("patience", [1, 10])
def test_restore_best_weights(patience):
    values = [1.0, 0.5, 0.6, 0.7, 0.8]
    cb = EarlyStopping(patience=patience, restore_best_weights=True)
    model, _ = run(cb, values)
    # the weights are the epoch number; epoch 2 was best, whether stopped or run to the end
    assert model.w.tolist() == [2.0, 2.0, 2.0]
    assert model.loads == 1 and cb.best_epoch == 2


def test_restore_first_epoch_when_nothing_improves():
    cb = EarlyStopping(patience=1, restore_best_weights=True)
    model, _ = run(cb, [float("nan"), float("nan"), float("nan")])
    assert cb.stopped_epoch == 2 and model.w.tolist() == [1.0, 1.0, 1.0]


def test_early_stopping_state_resets_per_run():
    cb = EarlyStopping(patience=0)
    run(cb, [1.0, 2.0])
    assert cb.stopped_epoch == 2
    model, ran = run(cb, [1.0, 0.5, 0.4])
    assert cb.stopped_epoch == 0 and not model.stop_training and ran == 3


def test_missing_monitor_names_available_keys():
    cb = EarlyStopping(monitor="val_loss")
    cb.on_train_begin(FakeModel())
    with pytest.raises(ValueError, match=r"monitor='val_loss' is not in the logs; available keys: "
                                         r"\['accuracy', 'loss'\]"):
        cb.on_epoch_end(1, {"loss": 1.0, "accuracy": 0.5})
    ck = ModelCheckpoint("m.npz", save_best_only=True)
    ck.on_train_begin(FakeModel())
    with pytest.raises(ValueError, match="available keys"):
        ck.on_epoch_end(1, {"loss": 1.0})


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"monitor": ""}, TypeError, "monitor must be a non-empty str"),
    ({"monitor": 3}, TypeError, "monitor must be"),
    ({"patience": -1}, ValueError, "patience must be an int >= 0, got -1"),
    ({"patience": 1.5}, ValueError, "patience must be an int"),
    ({"min_delta": float("nan")}, ValueError, "min_delta must be a finite number"),
    ({"mode": "up"}, ValueError, "mode must be 'auto', 'min' or 'max', got 'up'"),
    ({"baseline": "x"}, TypeError, "baseline must be a number"),
])
def test_early_stopping_validates(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EarlyStopping(**kwargs)


def test_non_numeric_monitored_value():
    cb = EarlyStopping(monitor="loss")
    cb.on_train_begin(FakeModel())
    with pytest.raises(TypeError, match=r"logs\['loss'\] must be a number, got str"):
        cb.on_epoch_end(1, {"loss": "low"})


# ------------------------------------------------------------------ ModelCheckpoint
def test_checkpoint_every_epoch_with_format_fields(tmp_path):
    ck = ModelCheckpoint(str(tmp_path / "m-{epoch:02d}-{val_loss:.2f}.npy"))
    model, _ = run(ck, [0.5, 0.25, 0.75])
    assert [os.path.basename(p) for p in model.saved] == ["m-01-0.50.npy", "m-02-0.25.npy", "m-03-0.75.npy"]
    assert ck.last_path == model.saved[-1]
    assert np.load(model.saved[1]).tolist() == [2.0, 2.0, 2.0]


def test_checkpoint_best_only(tmp_path):
    path = str(tmp_path / "best.npy")
    ck = ModelCheckpoint(path, monitor="val_accuracy", save_best_only=True)
    model, _ = run(ck, [0.5, 0.7, 0.6, 0.9, 0.8], key="val_accuracy")
    assert len(model.saved) == 3 and ck.best == 0.9
    assert np.load(path).tolist() == [4.0, 4.0, 4.0]  # epoch 4 was the best


def test_checkpoint_unknown_format_field(tmp_path):
    ck = ModelCheckpoint(str(tmp_path / "m-{val_acc}.npz"))
    ck.on_train_begin(FakeModel())
    with pytest.raises(ValueError, match=r"names the field 'val_acc'.*available: \['epoch', 'loss'"):
        ck.on_epoch_end(1, {"loss": 1.0, "val_loss": 0.5})


def test_checkpoint_validates():
    with pytest.raises(TypeError, match="path must be a str or path-like, got int"):
        ModelCheckpoint(3)
    with pytest.raises(ValueError, match="mode must be"):
        ModelCheckpoint("x.npz", mode="best")


def test_checkpoint_writes_a_loadable_model(tmp_path):
    pc.manual_seed(0)
    model = pc.Sequential(pc.Linear(4, 3), pc.ReLU(), pc.Linear(3, 2), backend="numpy")
    ck = ModelCheckpoint(tmp_path / "best.npz", save_best_only=True)
    ck.on_train_begin(model)
    ck.on_epoch_end(1, {"val_loss": 0.3})
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_array_equal(pc.to_numpy(pc.load(tmp_path / "best.npz", backend="numpy")(x)),
                                  pc.to_numpy(model(x)))


# ------------------------------------------------------------------ CSVLogger
def test_csv_logger_rows_and_header(tmp_path):
    path = tmp_path / "log" / "train.csv"
    log = CSVLogger(path)
    log.on_train_begin(FakeModel())
    log.on_epoch_end(1, {"loss": 0.5, "accuracy": 0.25, "val_loss": 1 / 3})
    with open(path) as f:  # flushed already, before training ends
        assert f.read().splitlines() == ["epoch,loss,accuracy,val_loss", f"1,0.5,0.25,{1 / 3!r}"]
    log.on_epoch_end(2, {"loss": np.float32(0.125), "val_loss": 0.0, "extra": 7})
    log.on_train_end(None)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[1] == {"epoch": "2", "loss": "0.125", "accuracy": "", "val_loss": "0.0"}
    assert float(rows[0]["val_loss"]) == 1 / 3


def test_csv_logger_append_keeps_columns(tmp_path):
    path = tmp_path / "train.csv"
    log = CSVLogger(path)
    log.on_train_begin(None)
    log.on_epoch_end(1, {"loss": 1.0, "accuracy": 0.5})
    log.on_train_end(None)
    resumed = CSVLogger(path, append=True)
    resumed.on_train_begin(None)
    resumed.on_epoch_end(2, {"accuracy": 0.75, "loss": 0.5})  # other key order: columns still line up
    resumed.on_train_end(None)
    assert path.read_text().splitlines() == ["epoch,loss,accuracy", "1,1.0,0.5", "2,0.5,0.75"]
    fresh = CSVLogger(path)
    fresh.on_train_begin(None)
    fresh.on_epoch_end(1, {"loss": 2.0})
    fresh.close()
    assert path.read_text().splitlines() == ["epoch,loss", "1,2.0"]


def test_csv_logger_survives_a_kill(tmp_path):
    path = tmp_path / "train.csv"
    script = textwrap.dedent(f"""
        import os, signal
        from parconv.callbacks import CSVLogger
        log = CSVLogger({str(path)!r})
        log.on_train_begin(None)
        for epoch in range(1, 4):
            log.on_epoch_end(epoch, {{"loss": 1.0 / epoch}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True)
    assert proc.returncode == -9
    assert path.read_text().splitlines() == ["epoch,loss", "1,1.0", "2,0.5", f"3,{1 / 3!r}"]


def test_csv_logger_validates(tmp_path):
    with pytest.raises(ValueError, match="separator must be a single character"):
        CSVLogger(tmp_path / "a.csv", separator=";;")
    with pytest.raises(RuntimeError, match="before on_train_begin"):
        CSVLogger(tmp_path / "a.csv").on_epoch_end(1, {"loss": 1.0})
    (tmp_path / "other.csv").write_text("step,value\n1,2\n")
    with pytest.raises(ValueError, match=r"cannot append to .*other.csv.*\['step', 'value'\] is not a header"):
        CSVLogger(tmp_path / "other.csv", append=True).on_train_begin(None)


# ------------------------------------------------------------------ CallbackList
def test_callback_list_dispatch():
    calls = []

    class Recorder(Callback):
        def on_train_begin(self, model):
            super().on_train_begin(model)
            calls.append(("begin", model))

        def on_batch_end(self, step, logs):
            calls.append(("batch", step))

        def on_train_end(self, history):
            calls.append(("end", history))

    class OnlyEpoch:
        def on_epoch_end(self, epoch, logs):
            calls.append(("object", epoch))

    rec = Recorder()
    cbs = CallbackList([rec, lambda epoch, logs: calls.append(("plain", epoch, logs["loss"])), OnlyEpoch()])
    assert len(cbs) == 3
    cbs.on_train_begin("model")
    cbs.on_batch_end(0, {"loss": 2.0})
    cbs.on_epoch_end(1, {"loss": 1.0})
    cbs.on_train_end("history")
    assert rec.model == "model"
    assert calls == [("begin", "model"), ("batch", 0), ("plain", 1, 1.0), ("object", 1), ("end", "history")]
    assert cbs.wants_batch_end()
    assert not CallbackList([EarlyStopping(), CSVLogger("unused.csv"), lambda epoch, logs: None]).wants_batch_end()


def test_callback_list_rejects():
    with pytest.raises(TypeError, match=r"callbacks\[1\] must have a hook"):
        CallbackList([Callback(), 3])
    with pytest.raises(TypeError, match="got a single EarlyStopping; wrap it in a list"):
        CallbackList(EarlyStopping())
    assert len(CallbackList(None)) == 0


def test_restore_best_weights_on_a_real_model():
    pc.manual_seed(1)
    model = pc.Sequential(pc.Linear(4, 3), pc.BatchNorm1d(3), pc.ReLU(), pc.Linear(3, 2), backend="numpy")
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    model(x)  # training mode: the BatchNorm running statistics move
    best = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    cb = EarlyStopping(patience=0, restore_best_weights=True)
    cb.on_train_begin(model)
    cb.on_epoch_end(1, {"val_loss": 0.5})
    for p in model.parameters():  # a worse epoch changes every parameter and buffer in place
        p.data[...] += 1.0
    model(x)
    cb.on_epoch_end(2, {"val_loss": 0.6})
    assert model.stop_training is True
    restored = model.state_dict()
    assert restored.keys() == best.keys() and any("running_mean" in k for k in best)
    for k, v in best.items():
        np.testing.assert_array_equal(restored[k], v, err_msg=k)
