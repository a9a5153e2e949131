"""The command line: train, info, selftest."""

import re
import subprocess
import sys

import numpy as np
import pytest

import parconv as pc
from parconv.cli import main


def test_train_small_run_saves_a_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "cnn.npz"
    rc = main(["train", "--epochs", "1", "--train-size", "1000", "--filters", "8", "--quiet",
               "--checkpoint", str(ckpt), "--backend", "numpy"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "test accuracy:" in out and "images/s" in out and "wall time" in out
    acc = float(out.split("test accuracy:")[1].split("%")[0])
    assert acc > 70.0  # one epoch on 1,000 images
    model = pc.load(ckpt)
    assert isinstance(model[0], pc.Normalize)  # the input standardisation is the model's
    assert model[1].weight.shape == (8, 1, 3, 3)


def test_train_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--lr", "-1"])
    assert "expected a positive finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--threads", "0"])
    assert main(["train", "--backend", "nope", "--epochs", "1"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "parconv" in out and "openmp build:" in out and "numpy    available" in out
    assert re.search(r"kernels: (avx512|avx2|generic)\b", out), out
    default = pc._config._num_threads is None and pc._config._threads_from_env() is None
    # with no count chosen, the team cap under load is shown
    assert ("teams under load:" in out) == (default and pc._config._cpu_count() > 1), out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-P", "-m", "parconv.cli", "info"], capture_output=True, text=True, check=True)
    assert "backends:" in out.stdout
