"""The command line's rough edges: --version, help text, plurals, --resume with other settings,
file-system errors as one line."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys

import pytest

import parconv as pc
from parconv import _checkpoint
from parconv.cli import _plural, main, make_parser

# a run small enough for a test: 200 training images, 4 filters
SMALL = ["--train-size", "200", "--filters", "4", "--quiet", "--backend", pc._config.get_default_backend_name()]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"parconv {pc.__version__}"
    out = subprocess.run([sys.executable, "-P", "-m", "parconv.cli", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"parconv {pc.__version__}"


def _subparser(name):
    parser = make_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


@pytest.mark.parametrize("command", ["train", "selftest"])
def test_every_option_is_explained_and_shows_its_default_once(command):
    parser = _subparser(command)
    text = parser.format_help()
    assert "(default: None)" not in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and len(action.help) > 8, action.option_strings
        shown = formatter._expand_help(action)
        assert shown.count("default") <= 1, shown
        if action.default not in (None, False):
            assert "default" in shown, shown  # a value that is used when the option is left out is shown
        assert "\n" not in action.help


def test_train_help_shows_defaults_in_the_text(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    out = re.sub(r"\s+", " ", out)
    # the training options default to the model's recipe, listed once below the options
    for fragment in ("passes over the training images (default: the model's recipe)",
                     "cnn-mnist 10 epochs, batch 50, lr 0.02, none schedule",
                     "lenet5 20 epochs, batch 64, lr 0.1, onecycle schedule",
                     "(default: $PARCONV_BACKEND, else openmp)", "--force", "--version" and "--seed"):
        assert fragment in out, fragment


def test_plural():
    assert _plural(1, "epoch") == "1 epoch" and _plural(2, "epoch") == "2 epochs"
    assert _plural(1, "MPI rank") == "1 MPI rank" and _plural(0, "thread") == "0 threads"


def test_one_epoch_one_thread_in_the_singular(tmp_path, capsys):
    pytest.importorskip("parconv._ext._threads")
    rc = main(["train", "--epochs", "1", "--checkpoint", str(tmp_path / "ck.npz"), "--threads", "1",
               *SMALL[:-2], "--backend", "openmp"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "for 1 epoch)" in out and "1 thread |" in out
    assert "1 epochs" not in out and "1 threads" not in out


@pytest.fixture(scope="module")
def one_epoch_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ck.npz"
    assert main(["train", "--epochs", "1", "--checkpoint", str(path), *SMALL]) == 0
    return path


@pytest.mark.parametrize("option, value", [("--lr", "0.05"), ("--momentum", "0.5"), ("--batch-size", "20"),
                                           ("--weight-decay", "0.001")])
def test_resume_with_other_settings_is_refused(tmp_path, capsys, one_epoch_checkpoint, option, value):
    capsys.readouterr()
    rc = main(["train", "--epochs", "1", "--checkpoint", str(tmp_path / "out.npz"), "--resume",
               str(one_epoch_checkpoint), option, value, *SMALL])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "parconv train: error: --resume" in err
    assert f"{option} " in err and f", {float(value)!r} on the command line" in err.replace(", 20 on", ", 20.0 on")
    assert "--force" in err
    assert not (tmp_path / "out.npz").exists()


def test_resume_with_force_says_the_checkpoint_values_win(tmp_path, capsys, one_epoch_checkpoint):
    capsys.readouterr()
    out_path = tmp_path / "out.npz"
    rc = main(["train", "--epochs", "2", "--checkpoint", str(out_path), "--resume", str(one_epoch_checkpoint),
               "--lr", "0.05", "--batch-size", "20", "--force", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--force: continuing with the checkpoint's --lr 0.02, --batch-size 50" in out
    assert "sgd lr 0.02 | batch 50" in out
    state = _checkpoint.load_training_checkpoint(out_path)
    assert state.optimizer_state["hyper"]["lr"] == 0.02 and state.fit["batch_size"] == 50
    assert state.epoch == 3


def test_resume_cannot_change_the_training_set_or_optimizer_even_with_force(capsys, one_epoch_checkpoint):
    capsys.readouterr()
    rc = main(["train", "--epochs", "2", "--checkpoint", "", "--resume", str(one_epoch_checkpoint),
               "--optimizer", "adam", "--force", *SMALL[:1], "300", *SMALL[2:]])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--optimizer sgd in the checkpoint, adam on the command line" in err
    assert "--train-size 200 in the checkpoint, 300 on the command line" in err
    assert "cannot change within a run" in err


def test_checkpoint_directory_is_checked_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rc = main(["train", "--epochs", "1", "--checkpoint", str(tmp_path / "file" / "ck.npz"), *SMALL])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.err == f"parconv: error: {tmp_path / 'file'}: Not a directory\n"
    assert "test accuracy" not in captured.out and "parconv 0.1" not in captured.out  # nothing trained
    rc = main(["train", "--epochs", "1", "--checkpoint", str(tmp_path), *SMALL])
    assert rc == 1 and "is a directory" in capsys.readouterr().err


def test_read_only_directory_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / ".parconv-x.tmp"))

    monkeypatch.setattr("parconv._io.tempfile.mkstemp", refuse)
    rc = main(["train", "--epochs", "1", "--checkpoint", str(tmp_path / "ck.npz"), *SMALL])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.err == (f"parconv: error: {tmp_path / 'ck.npz'}: cannot write files in {tmp_path}: "
                            "Read-only file system\n")
    assert "test accuracy" not in captured.out


def test_disk_full_while_writing_a_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("parconv._io.os.fsync", full)
    path = tmp_path / "ck.npz"
    rc = main(["train", "--epochs", "1", "--checkpoint", str(path), *SMALL])
    assert rc == 1
    assert capsys.readouterr().err == f"parconv: error: {path}: No space left on device\n"
    assert not path.exists() and not list(tmp_path.iterdir())  # nor a temporary left behind


def test_missing_resume_file_is_one_line(tmp_path, capsys):
    rc = main(["train", "--epochs", "1", "--resume", str(tmp_path / "nope.npz"), *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "nope.npz" in err and "does not exist" in err


def _mpiexec():
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")  # the one matching this mpi4py first
    return here if os.path.exists(here) else shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(_mpiexec() is None, reason="mpiexec not found")
def test_distributed_resume_refusal_is_one_line_on_every_rank_without_an_abort(one_epoch_checkpoint):
    pytest.importorskip("mpi4py")
    if any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
        pytest.skip("starts its own MPI job: run it without mpiexec")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pc.__file__)))
    out = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-P", "-m", "parconv.cli", "train", "--distributed",
                          "--epochs", "1", "--resume", str(one_epoch_checkpoint), "--lr", "0.5", "--checkpoint", "",
                          *SMALL], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("parconv train: error: --resume") == 1, out.stderr
    assert "Traceback" not in out.stderr and "Abort" not in out.stderr


def test_quickstart_states_the_default_epoch_count():
    quickstart = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "quickstart.md")
    if not os.path.exists(quickstart):
        pytest.skip("documentation sources not present")
    with open(quickstart, encoding="utf-8") as f:
        text = re.sub(r"\s+", " ", f.read())
    from parconv.cli import RECIPES

    default = RECIPES["cnn-mnist"]["epochs"]  # what `parconv train` (the cnn-mnist default) trains for
    assert f"by default for {_plural(default, 'epoch')}" in text
