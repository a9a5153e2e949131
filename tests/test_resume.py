"""Kill-and-resume: a ``parconv train`` run stopped with SIGKILL mid-epoch and resumed with
``--resume`` ends with exactly the weights of a run that was never stopped (serial and under MPI).

The runs are real subprocesses of the command line on a small IDX copy of the
bundled MNIST sample, killed as soon as a mid-epoch checkpoint appears (so the
kill lands between two checkpoints, with steps to redo), twice per run.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import parconv as pc
from parconv import _checkpoint
from parconv._io import load_npz

if any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
    pytest.skip("starts its own processes and MPI jobs: run it without mpiexec", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = pc._config.get_default_backend_name()
N_TRAIN, N_TEST = 640, 160
TIMEOUT = 120


def _write_idx(path, array):
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.tobytes())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small raw-IDX "test" split cut from the bundled sample (fast to train and evaluate)."""
    from parconv.datasets.idx import read_idx
    from parconv.datasets.mnist import MNIST_FILES, sample_path

    d = tmp_path_factory.mktemp("mnist-small")
    img_name, lbl_name = MNIST_FILES["test"]
    n = N_TRAIN + N_TEST
    _write_idx(d / img_name[:-3], read_idx(os.path.join(sample_path(), img_name))[:n])
    _write_idx(d / lbl_name[:-3], read_idx(os.path.join(sample_path(), lbl_name))[:n])
    return d


def _env():
    env = dict(os.environ)
    # child processes import the same parconv as this one (installed or in place), never a bare source tree
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # reproducible per thread count; the same for every run here
    return env


# `parconv train`, pausing after each checkpoint it writes so that the poller in _run_and_kill
# sees every one, however fast the steps between them run (the pause changes no result)
_PAUSING_CLI = ("import sys, time\n"
                "from parconv import _checkpoint, cli\n"
                "save = _checkpoint.save_training_checkpoint\n"
                "def pausing(*args, **kwargs):\n"
                "    save(*args, **kwargs)\n"
                "    time.sleep(0.03)\n"
                "_checkpoint.save_training_checkpoint = pausing\n"
                "sys.exit(cli.main(sys.argv[1:]))\n")


def _train_cmd(data_dir, checkpoint, resume=None, mpi_ranks=0, extra=()):
    cmd = [sys.executable, "-P", "-c", _PAUSING_CLI, "train", "--data", str(data_dir), "--split", "test",
           "--train-size", str(N_TRAIN), "--epochs", "2", "--batch-size", "16", "--filters", "48",
           "--checkpoint", str(checkpoint), "--checkpoint-every", "3", "--seed", "7", "--quiet",
           "--backend", BACKEND, *extra]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    if mpi_ranks:
        cmd = [_mpiexec(), "-n", str(mpi_ranks)] + cmd + ["--distributed"]
    return cmd


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _descendants(pid):
    """Every live descendant of ``pid`` (from /proc), children first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _kill_tree(proc):
    """SIGKILL the process we started and everything it started (mpiexec puts ranks in their own sessions)."""
    victims = _descendants(proc.pid) + [proc.pid]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _position(path):
    try:
        _, meta = load_npz(path)
    except (OSError, ValueError):
        return None
    t = meta.get("training", {})
    return t.get("epoch"), t.get("step")


def _run(cmd, cwd):
    res = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res


def _run_and_kill(cmd, cwd, checkpoint, epoch):
    """Start ``cmd`` and SIGKILL it as soon as its checkpoint is mid-way through ``epoch``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            pos = _position(checkpoint)
            if pos is not None and pos[0] == epoch and pos[1] > 0:
                _kill_tree(proc)
                return pos
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace")
                pytest.fail(f"the run ended (rc {proc.returncode}) before a mid-epoch-{epoch} checkpoint "
                            f"appeared; last position {pos}:\n{out}")
            time.sleep(0.002)
        pytest.fail("no mid-epoch checkpoint appeared in time")
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
        proc.stdout.close()


def _check_kill_and_resume(tmp_path, data_dir, ranks, extra=()):
    ref = tmp_path / "ref.npz"
    _run(_train_cmd(data_dir, ref, mpi_ranks=ranks, extra=extra), tmp_path)

    ck = tmp_path / "run.npz"
    first = _run_and_kill(_train_cmd(data_dir, ck, mpi_ranks=ranks, extra=extra), tmp_path, ck, epoch=1)
    # resume, and kill the resumed run too, mid-way through the second epoch
    second = _run_and_kill(_train_cmd(data_dir, ck, resume=ck, mpi_ranks=ranks, extra=extra), tmp_path, ck, epoch=2)
    assert second > first
    _run(_train_cmd(data_dir, ck, resume=ck, mpi_ranks=ranks, extra=extra), tmp_path)

    want = _checkpoint.load_training_checkpoint(ref)
    got = _checkpoint.load_training_checkpoint(ck)
    assert (got.epoch, got.step, got.global_step) == (want.epoch, want.step, want.global_step) == (3, 0, 80)
    for name, value in want.model_state.items():
        np.testing.assert_array_equal(got.model_state[name], value, err_msg=name)
    for name, value in want.optimizer_state.items():
        if name.startswith("state."):
            np.testing.assert_array_equal(got.optimizer_state[name], value, err_msg=name)
    assert got.optimizer_state["step"] == want.optimizer_state["step"] == 80
    np.testing.assert_allclose(got.history["history"]["loss"], want.history["history"]["loss"], rtol=1e-12)
    assert got.rng_state == want.rng_state
    assert got.scheduler_state == want.scheduler_state
    assert got.optimizer_state["hyper"] == want.optimizer_state["hyper"]


def test_kill_and_resume_serial(tmp_path, data_dir):
    _check_kill_and_resume(tmp_path, data_dir, ranks=0)


def test_kill_and_resume_with_scheduler_and_augmenting_loader(tmp_path, data_dir):
    """A per-batch schedule (OneCycleLR), SGD momentum and a shuffling, augmenting DataLoader:
    the resumed run's weights, optimizer state and schedule are bit-identical too."""
    _check_kill_and_resume(tmp_path, data_dir, ranks=0, extra=("--scheduler", "onecycle", "--augment"))


@pytest.mark.mpi
@pytest.mark.skipif(_mpiexec() is None, reason="mpiexec not found")
def test_kill_and_resume_distributed(tmp_path, data_dir):
    pytest.importorskip("mpi4py")
    _check_kill_and_resume(tmp_path, data_dir, ranks=2)


def test_resume_rejects_model_only_file(tmp_path):
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2), backend="numpy")
    path = tmp_path / "model.npz"
    model.save(path)
    opt = pc.optim.SGD(model.parameters(), lr=0.1)
    x, y = np.zeros((4, 1, 2, 2), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="not a parconv training checkpoint"):
        model.fit(x, y, optimizer=opt, verbose=False, resume=path)


def test_resume_rejects_other_batch_size(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((12, 1, 2, 2)).astype(np.float32), rng.integers(0, 2, 12)
    model = pc.Sequential(pc.Flatten(), pc.Linear(4, 2, rng=0), backend="numpy")
    path = tmp_path / "ck.npz"
    model.fit(x, y, batch_size=4, optimizer=pc.optim.SGD(model.parameters(), lr=0.1), verbose=False,
              checkpoint=path)
    with pytest.raises(ValueError, match="batch_size=4"):
        model.fit(x, y, batch_size=3, epochs=2, optimizer=pc.optim.SGD(model.parameters(), lr=0.1),
                  verbose=False, resume=path)


def test_in_process_resume_matches_uninterrupted(tmp_path):
    """fit(checkpoint=, checkpoint_every=) then fit(resume=) from a mid-epoch checkpoint, with Adam."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((50, 1, 3, 3)).astype(np.float32), rng.integers(0, 3, 50)

    def make():
        model = pc.Sequential(pc.Flatten(), pc.Linear(9, 8, rng=0), pc.ReLU(), pc.Linear(8, 3, rng=1),
                              backend=BACKEND)
        return model, pc.optim.Adam(model.parameters(), lr=0.01)

    ref, opt = make()
    ref.fit(x, y, epochs=3, batch_size=8, optimizer=opt, seed=3, verbose=False)

    # a run whose checkpoint stops mid-way through epoch 2: train 1 epoch + 4 steps worth of checkpoints
    path = tmp_path / "ck.npz"
    part, opt = make()
    stops = []

    class Stop(Exception):
        pass

    real_save = _checkpoint.save_training_checkpoint

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        if kwargs["epoch"] == 2 and kwargs["step"] > 0:
            stops.append(kwargs["global_step"])
            raise Stop

    _checkpoint.save_training_checkpoint = save_then_stop
    try:
        with pytest.raises(Stop):
            part.fit(x, y, epochs=3, batch_size=8, optimizer=opt, seed=3, verbose=False, checkpoint=path,
                     checkpoint_every=2)
    finally:
        _checkpoint.save_training_checkpoint = real_save
    assert stops == [8]  # epoch 2, step 1 of 7
    resumed, opt = make()
    history = resumed.fit(x, y, epochs=3, batch_size=8, optimizer=opt, seed=None, verbose=False, resume=path)
    assert history.epochs == [1, 2, 3]
    for name, value in ref.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)
