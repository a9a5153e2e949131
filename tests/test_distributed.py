"""MPI tests of :mod:`parconv.distributed`: DataParallel, fit(distributed=True), FilterParallelConv2d,
and the failure behaviour (an exception on one rank ends the job, never a hang).

Run them directly with ``mpiexec -n 2 python -m pytest tests/test_distributed.py``. Under a plain
``pytest tests`` run, :func:`test_suite_under_mpiexec` re-launches this file under
``mpiexec -n 2`` (with a timeout) and the failure tests start their own small MPI jobs, so the
normal test run covers everything. Without mpi4py or mpiexec the module is skipped.

Every check inside the MPI run goes through :func:`on_all_ranks`, so a failure on one rank fails
the test on every rank and the ranks never fall out of step in their collectives.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import parconv as pc
from test_sync_batchnorm import bn_and_sync_bn

pytest.importorskip("mpi4py")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
UNDER_MPI = any(v in os.environ for v in MPI_ENV_VARS)
BACKENDS = pc.available_backends()
RTOL, ATOL = 1e-5, 1e-6
SUITE_TIMEOUT = 180  # seconds for the whole re-launched MPI run
FAIL_WITHIN = 20  # seconds an aborting job may take (startup included)


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _env():
    env = dict(os.environ)
    # child processes import the same parconv as this one (installed or in place), never a bare source tree
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pc.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for v in MPI_ENV_VARS:
        env.pop(v, None)
    return env


needs_launcher = pytest.mark.skipif(UNDER_MPI or _mpiexec() is None,
                                    reason="needs mpiexec, and not already running under MPI")
needs_mpi_run = pytest.mark.skipif(not UNDER_MPI, reason="runs under mpiexec (re-launched by test_suite_under_mpiexec)")


# ------------------------------------------------------------------ launcher side
def _mpi_suite(ranks, *select):
    """Run this file's MPI tests (``select``: more pytest arguments) under ``mpiexec -n ranks``; fail
    with their output if any fails or the run hangs."""
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, "-P", "-m", "pytest", os.path.abspath(__file__), "-q",
           "-x", "-p", "no:cacheprovider", "--noconftest", "-m", "mpi", *select]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=SUITE_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"MPI test run on {ranks} ranks hung (> {SUITE_TIMEOUT} s):\n{exc.stdout}\n{exc.stderr}")
    assert res.returncode == 0, f"mpiexec -n {ranks} pytest failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    assert " passed" in res.stdout and "failed" not in res.stdout, res.stdout


@needs_launcher
@pytest.mark.mpi
def test_suite_under_mpiexec():
    """Run the MPI tests of this file under ``mpiexec -n 2`` and fail with their output if any fails."""
    _mpi_suite(2)


@needs_launcher
@pytest.mark.mpi
def test_sync_batchnorm_and_loader_shards_under_4_ranks():
    """The tests whose point is about more than two ranks (SyncBatchNorm's reductions, a loader's shards,
    a batch smaller than the ranks) again under ``mpiexec -n 4`` (oversubscribed on small machines)."""
    _mpi_suite(4, "-k", "sync_batchnorm or shards")


def _run_job(tmp_path, body, args=(), ranks=2):
    """Run a script under ``mpiexec -n ranks``; returns (returncode, output, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, str(script), *args]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                             timeout=FAIL_WITHIN * 3)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job hung instead of aborting (> {FAIL_WITHIN * 3} s):\n{exc.stdout}\n{exc.stderr}")
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


FAILING_JOB = """
    import sys
    import numpy as np
    import parconv as pc
    from parconv import distributed as dist

    comm = dist.MPI.COMM_WORLD
    model = pc.Sequential(pc.Conv2d(1, 2, 3, rng=0), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                          pc.Linear(2 * 3 * 3, 3, rng=1), backend="numpy")
    dp = dist.DataParallel(model)
    x = np.zeros((4, 1, 8, 8), np.float32)
    case = sys.argv[1]
    if case == "library":
        # rank 1 hands backward a wrong dy while rank 0 waits in the gradient allreduce
        out = dp(x)
        dy = np.ones(out.shape, np.float32) if comm.rank == 0 else np.ones((3, 3), np.float32)
        dp.backward(dy)
    elif case == "user":
        # an uncaught exception in user code on rank 1; rank 0 goes on into a collective
        if comm.rank == 1:
            raise RuntimeError("boom in user code")
        dp.backward(np.ones(dp(x).shape, np.float32))
    elif case == "fit":
        def callback(epoch, metrics):
            if comm.rank == 1:
                raise KeyError("callback failed")
        rng = np.random.default_rng(0)
        model.fit(rng.standard_normal((16, 1, 8, 8)), rng.integers(0, 3, 16), epochs=3, batch_size=4,
                  verbose=False, distributed=True, callbacks=[callback])
    print("rank", comm.rank, "finished: the job should have been aborted", flush=True)
    comm.Barrier()
"""


@needs_launcher
@pytest.mark.mpi
@pytest.mark.parametrize("case, message", [("library", "dy must have the output's shape"),
                                           ("user", "boom in user code"),
                                           ("fit", "callback failed")])
def test_exception_on_one_rank_aborts_all(tmp_path, case, message):
    rc, out, seconds = _run_job(tmp_path, FAILING_JOB, [case])
    assert rc != 0, out
    assert seconds < FAIL_WITHIN, f"took {seconds:.1f} s to end:\n{out}"
    assert "rank 1 of 2" in out and message in out, out
    assert "finished" not in out, out


@needs_launcher
@pytest.mark.mpi
def test_cli_distributed_error_ends_job(tmp_path):
    """``parconv train --distributed --resume`` of a missing file fails on every rank, promptly."""
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-P", "-m", "parconv.cli", "train", "--distributed", "--quiet",
           "--backend", "numpy", "--train-size", "200", "--epochs", "1", "--checkpoint", "",
           "--resume", str(tmp_path / "missing.npz")]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=FAIL_WITHIN * 3)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert time.monotonic() - t0 < FAIL_WITHIN, out
    assert "missing.npz" in out and "does not exist" in out, out


def _write_mnist_sample(directory, n):
    """The bundled sample's first ``n`` images as the MNIST test split's IDX files in ``directory``."""
    import gzip
    import struct

    x, y = pc.datasets.load_mnist("test", normalize=False)
    images, labels = x[:n, 0].astype(np.uint8), y[:n].astype(np.uint8)
    for name, arr in (("t10k-images-idx3-ubyte.gz", images), ("t10k-labels-idx1-ubyte.gz", labels)):
        header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
        (directory / name).write_bytes(gzip.compress(header + arr.tobytes()))


@needs_launcher
@pytest.mark.mpi
def test_cli_distributed_sync_bn_prints_the_accuracy_of_the_saved_model(tmp_path):
    """``parconv train --distributed --model resnet20 --sync-bn``: the test accuracy it prints is the saved
    checkpoint's, evaluated serially with ``pc.load`` on the same held-out images."""
    import argparse
    import re

    from parconv import cli

    _write_mnist_sample(tmp_path, 260)
    args = ["train", "--model", "resnet20", "--data", str(tmp_path), "--train-size", "200", "--epochs", "1",
            "--batch-size", "32", "--no-augment", "--checkpoint", str(tmp_path / "ck.npz"), "--quiet"]
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-P", "-m", "parconv.cli", *args[:1], "--distributed",
           "--sync-bn", *args[1:]]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=SUITE_TIMEOUT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "21 SyncBatchNorm layers" in out, out
    printed = float(re.search(r"test accuracy: ([0-9.]+)% on 60 held-out images", out).group(1))
    ns = argparse.Namespace(dataset="mnist-sample", data=str(tmp_path), split="test", train_size=200)
    _, (xte, yte), _, _ = cli._load_data(ns)
    saved = pc.load(tmp_path / "ck.npz")
    assert type(saved.layers[0]).__name__ == "Normalize"  # evaluated on the raw pixels below
    assert sum(type(m).__name__ == "SyncBatchNorm" for m in saved.modules()) == 21
    assert printed == round(100 * saved.evaluate(xte, yte)["accuracy"], 2), out
    res = subprocess.run([sys.executable, "-P", "-m", "parconv.cli", "train", "--sync-bn", "--epochs", "1"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--sync-bn synchronises BatchNorm over MPI ranks; it needs --distributed" in \
        res.stderr, res.stdout + res.stderr


@needs_launcher
@pytest.mark.mpi
def test_mpi_benchmark_runs_and_checks_its_answers(tmp_path):
    """``mpiexec -n 2 python bench/mpi_bench.py`` on tiny shapes: both workloads check their answer
    against a serial run before timing, write their rows and the cost model. No timing is asserted."""
    out = tmp_path / "mpi.json"
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-P", os.path.join(ROOT, "bench", "mpi_bench.py"),
           "--workloads", "data-parallel,conv-large-mpi", "--repeats", "1", "--dp-steps", "2", "--dp-filters", "4",
           "--dp-batch", "20,40",
           "--conv-batch", "2", "--conv-channels", "8", "--conv-filters", "5", "--conv-size", "8",
           "--cost-ranks", "8,64", "--json", str(out)]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=SUITE_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(out.read_text())["results"]
    configs = {(r["workload"], r["config"]) for r in rows}
    for batch in (20, 40):  # every global batch asked for
        assert ("data-parallel", f"batch {batch}: 2 ranks x 1 thread(s)") in configs
    assert any(w == "conv-large-mpi" and "allgatherv" in c for w, c in configs)
    dp = [r for r in rows if r["workload"] == "data-parallel" and r["ranks"] == 2][-1]
    assert dp["global_batch"] == 40
    for key in ("allreduce_fraction", "allreduce_fraction_median_step", "allreduce_alone_s", "vs_1rank_same_cores",
                "allreduce_reduce_fraction", "allreduce_wait_fraction"):
        assert key in dp and dp[key] >= 0
    # both ranks on this machine: the allreduce splits into the reduction and the wait for the slowest rank
    for key in ("allreduce_reduce_fraction", "allreduce_wait_fraction"):
        assert dp[key] <= dp["allreduce_fraction"] + 1e-9
    assert [c["ranks"] for c in dp["cost_model"]["rows"]] == [8, 64]
    assert "cost model" in res.stdout
    # the overlap of the reduction with the backward, measured, and carried into the cost model
    assert 0.0 <= dp["overlap_fraction"] <= 1.0 and 0.0 <= dp["overlap_efficiency"] <= 1.0
    assert dp["buckets_alone_s"] > 0 and dp["exposed_after_backward_s"] >= 0 and dp["overlap_window_s"] >= 0
    assert dp["cost_model"]["params"]["overlap_window_s"] == dp["overlap_window_s"]
    assert "of the gradient is reduced when the backward ends" in res.stdout
    # resnet20: BatchNorm with per-rank statistics, checked with SyncBatchNorm against the serial step
    cmd = [_mpiexec(), "-n", "2", sys.executable, "-P", os.path.join(ROOT, "bench", "mpi_bench.py"),
           "--workloads", "data-parallel", "--dp-model", "resnet20", "--repeats", "1", "--dp-steps", "1",
           "--dp-batch", "4", "--cost-ranks", "8", "--overlap", "0.5", "--json", str(out)]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=SUITE_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    dp = [r for r in json.loads(out.read_text())["results"] if r["ranks"] == 2][-1]
    assert dp["model"] == "resnet20" and dp["buckets"] >= 1
    assert dp["cost_model"]["params"]["overlap"] == 0.5 and "overlap_window_s" not in dp["cost_model"]["params"]


# ------------------------------------------------------------------ MPI side
if UNDER_MPI:
    from parconv import distributed as dist

    COMM = dist.MPI.COMM_WORLD
    RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
else:  # pragma: no cover - only the launcher tests run here
    COMM, RANK, SIZE = None, 0, 1


def on_all_ranks(check):
    """Run ``check()``; if it fails on any rank, fail on every rank with all the messages."""
    try:
        check()
        err = None
    except AssertionError as exc:
        err = f"rank {RANK}: {exc}"
    errors = [e for e in COMM.allgather(err) if e]
    if errors:
        raise AssertionError("\n".join(errors))


def assert_same_on_all_ranks(arrays: dict):
    gathered = COMM.allgather({k: np.asarray(v) for k, v in arrays.items()})

    def check():
        for k, v in arrays.items():
            for r, other in enumerate(gathered):
                np.testing.assert_array_equal(other[k], v, err_msg=f"{k} differs on rank {r}")

    on_all_ranks(check)


def make_cnn(backend, seed):
    rng = np.random.default_rng(seed)
    return pc.Sequential(pc.Conv2d(1, 4, 3, rng=rng), pc.ReLU(), pc.MaxPool2d(2), pc.Flatten(),
                         pc.Linear(4 * 4 * 4, 8, rng=rng), pc.ReLU(), pc.Linear(8, 5, rng=rng), backend=backend)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 10, 10)).astype(np.float32), rng.integers(0, 5, n)


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bucket_cap_mb, progress", [(1.0, "thread"), (1e-4, "thread"), (1e-4, "hooks")])
def test_data_parallel_matches_single_process(backend, bucket_cap_mb, progress):
    """Several momentum-SGD steps over the ranks equal single-process steps on the global batch,
    although every rank starts from different weights (the broadcast fixes that)."""
    x, y = data(6 * SIZE * 5)
    loss_fn = pc.SoftmaxCrossEntropy()
    ref = make_cnn(backend, seed=0)  # rank 0's initial weights
    ref_opt = pc.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    model = make_cnn(backend, seed=RANK)
    dp = dist.DataParallel(model, bucket_cap_mb=bucket_cap_mb, progress=progress)
    assert dp.progress == progress  # mpi4py asks for MPI_THREAD_MULTIPLE, which MPICH gives
    opt = pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    if bucket_cap_mb < 1e-3:
        assert dp.num_buckets == 3  # one bucket per layer with parameters
    batch = 6 * SIZE
    for step in range(5):
        idx = np.arange(step * batch, (step + 1) * batch)
        loss_fn(ref(x[idx]), y[idx])
        ref.backward(loss_fn.backward())
        ref_opt.step()
        ref_opt.zero_grad()
        lo, hi = dp.shard(batch)
        loss_fn(dp(x[idx[lo:hi]]), y[idx[lo:hi]])
        dp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()

    def check():
        for name, want in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], want, rtol=RTOL, atol=ATOL, err_msg=name)

    on_all_ranks(check)
    assert_same_on_all_ranks(model.state_dict())
    assert dp.timings["allreduce"] <= dp.timings["backward"]
    assert 0.0 <= dp.hidden_share <= 1.0 and dp.reduce_started <= dp.reduce_window[0] <= dp.reduce_window[1]
    with pytest.raises(ValueError, match="progress must be 'thread' or 'hooks', got 'async'"):
        dist.DataParallel(model, progress="async")


@needs_mpi_run
@pytest.mark.mpi
def test_fit_distributed_in_bf16_follows_the_serial_bf16_fit_and_ranks_must_agree_on_it():
    x, y = data(48, seed=1)
    ref = make_cnn("numpy", seed=5)
    h_ref = ref.fit(x, y, epochs=2, batch_size=12, seed=11, verbose=False, precision="bf16",
                    optimizer=pc.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    model = make_cnn("numpy", seed=5 + RANK)
    seen = []
    h = model.fit(x, y, epochs=2, batch_size=12, seed=11 + RANK, verbose=False, precision="bf16",
                  optimizer=pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), distributed=True,
                  callbacks=[lambda epoch, logs: seen.append(pc.is_autocast_enabled())])

    def check():
        assert seen == [True, True]
        # the shards' gradient sums are added in another order, then rounded to bf16 again next step
        for name, want in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], want, rtol=1e-3, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-3)

    on_all_ranks(check)
    assert_same_on_all_ranks(model.state_dict())
    with pytest.raises(Exception, match="precision"):
        model.fit(x, y, epochs=1, batch_size=12, verbose=False, distributed=True,
                  precision="bf16" if RANK == 0 else "fp32")


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, batch_size", [(48, 12), (41, 10), (23, 7)])
def test_fit_distributed_matches_serial_fit(backend, n, batch_size):
    """fit(distributed=True) follows the serial fit with the same seed -- uneven shards and a last
    batch smaller than the number of ranks included -- and its metrics are the global ones."""
    x, y = data(n, seed=1)
    xv, yv = data(9, seed=2)
    ref = make_cnn(backend, seed=5)
    h_ref = ref.fit(x, y, epochs=2, batch_size=batch_size, seed=11, verbose=False, validation_data=(xv, yv),
                    optimizer=pc.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    model = make_cnn(backend, seed=5 + RANK)
    h = model.fit(x, y, epochs=2, batch_size=batch_size, seed=11 + RANK, verbose=False, validation_data=(xv, yv),
                  optimizer=pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), distributed=True)

    def check():
        for name, want in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
        for key in ("loss", "val_loss"):
            np.testing.assert_allclose(h[key], h_ref[key], rtol=1e-5, err_msg=key)
        for key in ("accuracy", "val_accuracy"):
            assert h[key] == h_ref[key], key

    on_all_ranks(check)
    assert_same_on_all_ranks(model.state_dict())


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("shuffle", [True, False])
def test_fit_distributed_from_a_loader_matches_serial_fit(shuffle):
    """A DataLoader with the same seed on every rank (drop_last included) trains as the serial fit; without
    shuffling its seed may differ between ranks, as it draws nothing."""
    x, y = data(45, seed=6)
    ref = make_cnn("numpy", seed=3)
    h_ref = ref.fit(pc.data.DataLoader(x, y, batch_size=10, shuffle=shuffle, drop_last=True, seed=8), epochs=2,
                    verbose=False, optimizer=pc.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    model = make_cnn("numpy", seed=3 + RANK)
    loader = pc.data.DataLoader(x, y, batch_size=10, shuffle=shuffle, drop_last=True, seed=8 if shuffle else RANK)
    h = model.fit(loader, epochs=2, verbose=False, distributed=True,
                  optimizer=pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def check():
        for name, want in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-5)

    on_all_ranks(check)
    assert_same_on_all_ranks(model.state_dict())


@needs_mpi_run
@pytest.mark.mpi
def test_data_parallel_evaluate_and_adam():
    x, y = data(37, seed=3)
    ref = make_cnn("numpy", seed=2)
    ref.fit(x, y, epochs=1, batch_size=9, seed=4, verbose=False, optimizer=pc.optim.Adam(ref.parameters(), lr=0.01))
    model = make_cnn("numpy", seed=2)
    dp = dist.DataParallel(model)
    dp.fit(x, y, epochs=1, batch_size=9, seed=4, verbose=False, optimizer=pc.optim.Adam(model.parameters(), lr=0.01))
    want, got = ref.evaluate(x, y), dp.evaluate(x, y)

    def check():
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        assert got["accuracy"] == want["accuracy"]
        for name, w in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], w, rtol=RTOL, atol=ATOL, err_msg=name)

    on_all_ranks(check)


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("assemble", ["allgatherv", "p2p"])
@pytest.mark.parametrize("C, O, N, K, stride, padding, bias", [
    (3, 5, 2, 3, 1, 1, True),    # 5 filters over 2 ranks: 3 + 2
    (2, 1, 3, 3, 2, 0, True),    # fewer filters than ranks: a rank computes nothing
    (4, 6, 1, 2, 1, 0, False),   # one sample (gathered straight into place), no bias
    (1, 7, 4, 5, 2, 2, True),
])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_filter_parallel_conv2d_matches_conv2d(backend, assemble, C, O, N, K, stride, padding, bias, precision):
    """Also under autocast: the forward in bf16, and the backward (after the block) in bf16 as the layer's."""
    rng = np.random.default_rng(C * 100 + O)
    x = rng.standard_normal((N, C, 9, 9)).astype(np.float32)
    ref = pc.Conv2d(C, O, K, stride, padding, bias=bias, backend=backend, rng=1)
    conv = dist.FilterParallelConv2d(C, O, K, stride, padding, bias=bias, backend=backend, rng=2 + RANK,
                                     assemble=assemble)
    counts = conv.filter_counts
    assert sum(counts) == O and max(counts) - min(counts) <= 1
    conv.load_state_dict({name: p.numpy() for name, p in ref.named_parameters()})
    with pc.autocast(enabled=precision == "bf16"):
        y_ref = ref(x)
        y = conv(x)
    dy = rng.standard_normal(pc.to_numpy(y_ref).shape).astype(np.float32)
    dx_ref = ref.backward(dy)
    dx = conv.backward(dy)
    state = conv.state_dict()
    sl = slice(conv.filter_offsets[RANK], conv.filter_offsets[RANK] + counts[RANK])

    def check():
        np.testing.assert_allclose(pc.to_numpy(y), pc.to_numpy(y_ref), rtol=1e-5, atol=1e-5, err_msg="y")
        np.testing.assert_allclose(pc.to_numpy(dx), pc.to_numpy(dx_ref), rtol=1e-5, atol=1e-5, err_msg="dx")
        np.testing.assert_allclose(pc.to_numpy(conv.weight.grad), pc.to_numpy(ref.weight.grad)[sl],
                                   rtol=1e-5, atol=1e-5, err_msg="dw slice")
        if bias:
            np.testing.assert_allclose(pc.to_numpy(conv.bias.grad), pc.to_numpy(ref.bias.grad)[sl],
                                       rtol=1e-5, atol=1e-5, err_msg="db slice")
        np.testing.assert_array_equal(state["weight"], ref.weight.numpy())
        assert ("bias" in state) == bias
        if bias:
            np.testing.assert_array_equal(state["bias"], ref.bias.numpy())
        assert conv.weight.shape == (counts[RANK], C, K, K)

    on_all_ranks(check)


@needs_mpi_run
@pytest.mark.mpi
def test_filter_parallel_conv2d_training_step_and_init():
    """Rank 0's initial weights are everyone's; a local SGD step on each slice equals a full step."""
    conv = dist.FilterParallelConv2d(2, 5, 3, padding=1, backend="numpy", rng=10 + RANK)
    full = conv.state_dict()
    assert_same_on_all_ranks(full)
    ref = pc.Conv2d(2, 5, 3, padding=1, backend="numpy")
    ref.weight.data[...] = full["weight"]
    ref.bias.data[...] = full["bias"]
    x = np.random.default_rng(0).standard_normal((3, 2, 6, 6)).astype(np.float32)
    for layer in (ref, conv):
        opt = pc.optim.SGD(layer.parameters(), lr=0.1, momentum=0.5)
        for _ in range(2):
            y = layer(x)
            layer.backward(np.asarray(pc.to_numpy(y)) * 2.0)
            opt.step()
            opt.zero_grad()
    after = conv.state_dict()

    def check():
        np.testing.assert_allclose(after["weight"], ref.weight.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(after["bias"], ref.bias.numpy(), rtol=1e-5, atol=1e-6)

    on_all_ranks(check)


@needs_mpi_run
@pytest.mark.mpi
def test_filter_parallel_load_state_dict_checks_shapes():
    conv = dist.FilterParallelConv2d(2, 5, 3, backend="numpy")
    with pytest.raises(ValueError, match="full"):
        conv.load_state_dict({"weight": np.zeros((3, 2, 3, 3)), "bias": np.zeros(5)})
    with pytest.raises(ValueError, match="missing"):
        conv.load_state_dict({"weight": np.zeros((5, 2, 3, 3))})


@needs_mpi_run
@pytest.mark.mpi
def test_filter_parallel_forward_refuses_different_shapes_per_rank():
    """Inputs of different batch sizes would be gathered into a partly unwritten output: every rank raises."""
    conv = dist.FilterParallelConv2d(2, 5, 3, backend="numpy", abort_on_error=False)
    x = np.zeros((3 + RANK, 2, 6, 6), np.float32)
    with pytest.raises(dist.DistributedArgumentError,
                       match=rf"its shape is \({3 + RANK}, 2, 6, 6\) on rank {RANK}, and over the ranks ranges "
                             rf"from \(3, 2, 6, 6\) to \({2 + SIZE}, 2, 6, 6\)"):
        conv(x)
    y = conv(np.ones((2, 2, 6, 6), np.float32))  # the layer still works once the ranks agree
    assert pc.to_numpy(y).shape == (2, 5, 4, 4)


LOAD_WITHOUT_MPI = """
import sys
import numpy as np
import parconv as pc
model = pc.load(sys.argv[1])
want = np.load(sys.argv[2])
assert "mpi4py" not in sys.modules, "pc.load imported mpi4py"
assert type(model.layers[0]) is pc.Conv2d, type(model.layers[0])
state = model.state_dict()
assert sorted(state) == sorted(want.files), (sorted(state), want.files)
for k in want.files:
    np.testing.assert_array_equal(state[k], want[k], err_msg=k)
print("loaded", type(model.layers[0]).__name__, tuple(state["0.weight"].shape))
"""


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequential_of_filter_parallel_conv2d_state_round_trip(backend):
    """Inside a Sequential, a FilterParallelConv2d takes the full weights (each rank keeps its slice),
    state_dict and save give the full weights back, and pc.load of the file -- on one process,
    without MPI -- is the same model with a plain Conv2d."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 3, 6, 6)).astype(np.float32)
    ref = pc.Sequential(pc.Conv2d(3, 5, 3, padding=1, rng=3), pc.ReLU(), pc.Flatten(),
                        pc.Linear(5 * 6 * 6, 4, rng=4), backend=backend)
    full = ref.state_dict()
    model = pc.Sequential(dist.FilterParallelConv2d(3, 5, 3, padding=1, rng=7 + RANK), pc.ReLU(), pc.Flatten(),
                          pc.Linear(5 * 6 * 6, 4, rng=9 + RANK), backend=backend)
    conv = model.layers[0]
    sl = slice(conv.filter_offsets[RANK], conv.filter_offsets[RANK] + conv.filter_counts[RANK])
    before = model.state_dict()
    local_slice = dict(full, **{"0.weight": full["0.weight"][sl]})
    with pytest.raises(ValueError, match=r"0\.weight.*\(5, 3, 3, 3\)"):
        model.load_state_dict(local_slice)
    unchanged = model.state_dict()  # collective: every rank gathers, whatever its checks find
    model.load_state_dict(full)
    state = model.state_dict()
    y, y_ref = pc.to_numpy(model(x)), pc.to_numpy(ref(x))
    directory = COMM.bcast(tempfile.mkdtemp(prefix="parconv-fp-") if RANK == 0 else None)
    path = os.path.join(directory, f"model-rank{RANK}.npz")
    model.save(path)
    loaded = pc.load(path, backend=backend)
    COMM.Barrier()
    child = None
    if RANK == 0 and backend == BACKENDS[0]:  # the file is the same whatever the backend: load it once
        np.savez(os.path.join(directory, "full.npz"), **full)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_"))}
        child = subprocess.run([sys.executable, "-P", "-c", LOAD_WITHOUT_MPI, path, os.path.join(directory, "full.npz")],
                               env=env, capture_output=True, text=True, timeout=120)
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)

    def check():
        for k, v in before.items():
            np.testing.assert_array_equal(unchanged[k], v, err_msg=f"{k} changed by a failed load")
        assert sorted(state) == sorted(full)
        for k, v in full.items():
            np.testing.assert_array_equal(state[k], v, err_msg=k)
        np.testing.assert_array_equal(pc.to_numpy(conv.weight.data), full["0.weight"][sl])
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5, err_msg="forward after the load")
        assert type(loaded.layers[0]) is pc.Conv2d
        for k, v in loaded.state_dict().items():
            np.testing.assert_array_equal(v, full[k], err_msg=f"{k} after save and pc.load")
        if child is not None:
            assert child.returncode == 0, child.stdout + child.stderr
            assert "loaded Conv2d (5, 3, 3, 3)" in child.stdout, child.stdout

    on_all_ranks(check)


@needs_mpi_run
@pytest.mark.mpi
def test_distributed_and_comm_arguments_are_checked():
    """A wrong ``distributed=`` or ``comm=`` is a TypeError naming it on every rank, before any collective."""
    model = make_cnn("numpy", seed=0)
    x, y = data(8)
    for bad in ("yes", 1, "COMM_WORLD"):
        with pytest.raises(TypeError, match="distributed must be True, an MPI communicator or a DataParallel"):
            model.fit(x, y, epochs=1, batch_size=4, verbose=False, distributed=bad)
    with pytest.raises(TypeError, match="DataParallel: comm must be an mpi4py communicator.*got str"):
        dist.DataParallel(model, comm="world")
    with pytest.raises(TypeError, match="FilterParallelConv2d: comm must be an mpi4py communicator.*got int"):
        dist.FilterParallelConv2d(2, 3, 3, comm=0)
    with pytest.raises(TypeError, match="configure_threads: comm must be"):
        dist.configure_threads(comm=[COMM])
    COMM.Barrier()


@needs_mpi_run
@pytest.mark.mpi
def test_helpers():
    assert dist.split_sizes(5, 2) == [3, 2]
    assert dist.split_sizes(1, 3) == [1, 0, 0]
    assert [dist.shard_bounds(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert dist.default_threads() >= 1
    seeds = COMM.allgather(dist.DataParallel(make_cnn("numpy", 0)).shared_seed(None))
    assert len(set(seeds)) == 1


@needs_mpi_run
@pytest.mark.mpi
def test_fit_distributed_divergence_raises_on_every_rank():
    """A non-finite loss on one rank is seen in the global loss, so every rank stops at the same step
    (no hang) and restores the same last good weights."""

    class NaNOnLastRankAtStep3(pc.SoftmaxCrossEntropy):
        calls = 0

        def forward(self, logits, labels, backend=None):
            value = super().forward(logits, labels, backend=backend)
            type(self).calls += 1
            return float("nan") if COMM.rank == COMM.size - 1 and self.calls == 3 else value

    x, y = data(24, seed=4)
    model = make_cnn("numpy", seed=0)
    opt = pc.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(pc.TrainingDivergedError, match="loss became nan at epoch 1, step 3;"):
        model.fit(x, y, epochs=5, batch_size=8, optimizer=opt, loss=NaNOnLastRankAtStep3(), verbose=False,
                  distributed=True)
    state = model.state_dict()

    def check():
        for name, value in state.items():
            assert np.isfinite(value).all(), f"{name} is not finite after the divergence"

    on_all_ranks(check)
    assert_same_on_all_ranks(state)


# ------------------------------------------------------------------ BatchNorm networks over MPI
def make_bn_net(backend, seed, sync=False, dropout=0.3, bn1d=True):
    """conv-BN-ReLU, a residual block ending in BatchNorm (its fused shortcut and ReLU), dropout, BN1d."""
    rng = np.random.default_rng(seed)
    body = pc.Sequential(pc.Conv2d(4, 4, 3, padding=1, bias=False, rng=rng), pc.BatchNorm2d(4), pc.ReLU(),
                         pc.Conv2d(4, 4, 3, padding=1, bias=False, rng=rng), pc.BatchNorm2d(4))
    shortcut = pc.Sequential(pc.Conv2d(4, 4, 1, bias=False, rng=rng), pc.BatchNorm2d(4))
    model = pc.Sequential(pc.Conv2d(1, 4, 3, rng=rng), pc.BatchNorm2d(4), pc.ReLU(), pc.MaxPool2d(2),
                          pc.Residual(body, shortcut), pc.ReLU(), pc.Flatten(), pc.Dropout(dropout, rng=seed),
                          pc.Linear(4 * 4 * 4, 8, rng=rng), pc.BatchNorm1d(8) if bn1d else pc.Identity(), pc.ReLU(), pc.Linear(8, 5, rng=rng),
                          backend=backend)
    return pc.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


@needs_mpi_run
@pytest.mark.mpi
def test_evaluate_runs_in_eval_mode_and_equals_serial_evaluate_of_saved_model():
    """DataParallel.evaluate (and so ``parconv train --distributed``) reports the accuracy of the model it
    saves: eval mode (running statistics, no dropout), running statistics untouched, mode restored."""
    x, y = data(40, seed=7)
    model = make_bn_net("numpy", seed=1)
    dp = dist.DataParallel(model)
    dp.fit(x, y, epochs=1, batch_size=8, seed=2, verbose=False,
           optimizer=pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    before = model.state_dict()
    assert model.training
    got = dp.evaluate(x, y, batch_size=7)
    after = model.state_dict()
    directory = COMM.bcast(tempfile.mkdtemp(prefix="parconv-ev-") if RANK == 0 else None)
    path = os.path.join(directory, "model.npz")
    if RANK == 0:
        model.save(path)
    COMM.Barrier()
    want = pc.load(path).evaluate(x, y)  # serial, on every rank
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)

    def check():
        assert model.training, "evaluate did not restore training mode"
        for k, v in before.items():
            np.testing.assert_array_equal(after[k], v, err_msg=f"{k} changed by evaluate")
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        assert got["accuracy"] == want["accuracy"]

    on_all_ranks(check)


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_equal_on_all_ranks_after_fit_and_every_forward(backend):
    """Per-rank BatchNorm statistics differ, but every rank holds rank 0's buffers (as DDP's
    broadcast_buffers): after fit, and at every DataParallel forward."""
    x, y = data(36, seed=8)
    model = make_bn_net(backend, seed=3)
    model.fit(x, y, epochs=2, batch_size=12, seed=5, verbose=False, distributed=True,
              optimizer=pc.optim.SGD(model.parameters(), lr=0.05))
    state = model.state_dict()
    assert any(k.endswith("running_mean") for k in state)
    assert_same_on_all_ranks(state)
    dp = model._dp_cache
    lo, hi = dp.shard(12)
    dp(x[lo:hi])  # each rank's running statistics move with its own shard ...
    dp(x[12 + lo:12 + hi])  # ... and the next forward starts from rank 0's again
    dp.broadcast_buffers()
    assert_same_on_all_ranks(model.state_dict())
    assert dist.DataParallel(make_bn_net(backend, seed=RANK), broadcast_buffers=False).sync_buffers is False
    with pytest.raises(TypeError, match="broadcast_buffers must be a bool"):
        dist.DataParallel(model, broadcast_buffers="yes")


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, mode, momentum, affine", [
    ((7, 3, 5, 4), "plain", 0.1, True),     # 7 samples: uneven shards on 2 and 4 ranks
    ((7, 3, 5, 4), "relu", 0.1, True),      # the fused BatchNorm -> ReLU
    ((6, 3, 4, 4), "residual", 0.1, True),  # a residual block's relu(bn(x) + shortcut)
    ((9, 5), "plain", None, False),         # BatchNorm1d-shaped, cumulative average, no affine
    ((5, 2, 6), "plain", 0.3, True),
    ((4, 3), "plain", 0.1, True),           # one sample per rank on 4 ranks: its own variance is 0
])
def test_sync_batchnorm_matches_global_batchnorm(backend, shape, mode, momentum, affine):
    """Forward output, dx, the gradients summed over ranks and the running statistics equal a
    single-process BatchNorm over the global batch (rtol 1e-5), step after step."""
    rng = np.random.default_rng(11)
    ref, sync = bn_and_sync_bn(shape, backend, momentum, affine)
    lo, hi = dist.shard_bounds(shape[0], SIZE, RANK)
    results = []
    for step in range(3):
        x = (rng.standard_normal(shape) * (2 + step) + step).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32) if mode == "residual" else None
        kwargs = {"relu": mode != "plain"}
        y_ref = pc.to_numpy(ref.forward(x, residual=r, **kwargs))
        y = pc.to_numpy(sync.forward(x[lo:hi], residual=None if r is None else r[lo:hi], **kwargs))
        g = np.where(y_ref > 0, dy, 0).astype(np.float32) if mode == "residual" else dy  # Residual masks
        dx_ref = pc.to_numpy(ref.backward(g))
        dx = pc.to_numpy(sync.backward(g[lo:hi]))
        grads = {}
        if affine:
            for name in ("weight", "bias"):
                local = np.asarray(pc.to_numpy(getattr(sync, name).grad), np.float64)
                grads[name] = (COMM.allreduce(local), pc.to_numpy(getattr(ref, name).grad))
        results.append((y, y_ref[lo:hi], dx, dx_ref[lo:hi], grads, sync.state_dict(), ref.state_dict()))

    def check():
        for step, (y, y_ref, dx, dx_ref, grads, state, state_ref) in enumerate(results):
            np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5, err_msg=f"y, step {step}")
            np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5, err_msg=f"dx, step {step}")
            for name, (got, want) in grads.items():
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}, step {step}")
            for k, v in state_ref.items():
                np.testing.assert_allclose(state[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {step}")

    on_all_ranks(check)
    sync.eval()
    x = rng.standard_normal(shape).astype(np.float32)
    ref.eval()
    np.testing.assert_allclose(pc.to_numpy(sync(x)), pc.to_numpy(ref(x)), rtol=1e-6, atol=1e-6)


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("n, batch_size, bn1d", [(24, 7, True), (22, 7, False)])
def test_fit_with_sync_batchnorm_matches_serial_fit(n, batch_size, bn1d):
    """A BatchNorm network converted to SyncBatchNorm trains data-parallel exactly as the serial network
    on the global batch -- uneven shards, and a last batch smaller than the ranks (a rank then runs a
    placeholder weighted 0) included -- with the same buffers on every rank; also from a DataLoader.
    (A batch of one sample needs a network without BatchNorm1d, which needs two values per feature.)"""
    x, y = data(n, seed=9)
    results = []
    for use_loader in (False, True):
        # dropout draws per rank: off for an exact comparison
        ref = make_bn_net("numpy", seed=4, dropout=0.0, bn1d=bn1d)
        model = make_bn_net("numpy", seed=4 + RANK, sync=True, dropout=0.0, bn1d=bn1d)
        dp = dist.DataParallel(model)
        assert dp.needs_every_rank == (SIZE > 1)
        runs = []
        for net, fit in ((ref, ref.fit), (model, dp.fit)):
            opt = pc.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            if use_loader:  # the distributed fit shards it: each rank reads only its share
                runs.append(fit(pc.data.DataLoader(x, y, batch_size=batch_size, seed=6, prefetch=1), epochs=2,
                                verbose=False, optimizer=opt))
            else:
                runs.append(fit(x, y, epochs=2, batch_size=batch_size, seed=6, verbose=False, optimizer=opt))
        results.append((ref.state_dict(), model.state_dict(), runs))

    def check():
        for want_state, state, (h_ref, h) in results:
            for name, want in want_state.items():
                np.testing.assert_allclose(state[name], want, rtol=2e-5, atol=2e-6, err_msg=name)
            np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-5)

    on_all_ranks(check)
    for _, state, _ in results:
        assert_same_on_all_ranks(state)


@needs_mpi_run
@pytest.mark.mpi
@pytest.mark.parametrize("n, batch_size, drop_last", [(23, 5, False), (23, 5, True), (6, 4, False)])
def test_loader_shards_disjointly_and_covers_the_data_once_per_epoch(n, batch_size, drop_last):
    """DataLoader(num_replicas, rank) as DistributedSampler: the same number of batches on every rank,
    shares of each global batch that are disjoint and cover it, a new order every epoch from the shared
    seed, and per-rank augmentation streams."""
    x = np.arange(n, dtype=np.float32).reshape(n, 1)
    y = np.arange(n)
    loader = pc.data.DataLoader(x, y, batch_size=batch_size, seed=3, drop_last=drop_last, num_replicas=SIZE,
                                rank=RANK, prefetch=0)
    full = pc.data.DataLoader(x, y, batch_size=batch_size, seed=3, drop_last=drop_last, prefetch=0)
    epochs = [[yb.tolist() for _, yb in loader.epoch(e)] for e in range(2)]
    everyone = COMM.allgather(epochs)

    def check():
        assert len(loader) == len(full) and all(len(e) == len(full) for e in epochs)
        for e in range(2):
            want = [yb.tolist() for _, yb in full.epoch(e)]
            for b, batch in enumerate(want):
                shares = [everyone[r][e][b] for r in range(SIZE)]
                assert sum(shares, []) == batch, f"epoch {e} batch {b}: shares {shares} of {batch}"
                assert max(map(len, shares)) - min(map(len, shares)) <= 1
            seen = sum((everyone[r][e][b] for r in range(SIZE) for b in range(len(want))), [])
            assert len(seen) == len(set(seen)) == (n // batch_size * batch_size if drop_last else n)
        assert [everyone[r][0] for r in range(SIZE)] != [everyone[r][1] for r in range(SIZE)], \
            "the order did not change between epochs"

    on_all_ranks(check)
    with pytest.raises(ValueError, match="num_replicas and rank must be given together"):
        pc.data.DataLoader(x, y, num_replicas=2)
    with pytest.raises(ValueError, match="rank must be < num_replicas=2, got 2"):
        pc.data.DataLoader(x, y, num_replicas=2, rank=2)
    model = make_cnn("numpy", seed=0)
    with pytest.raises(ValueError, match="the DataLoader is sharded as rank 0 of 3 ranks but this is a serial fit"):
        model.fit(pc.data.DataLoader(np.zeros((6, 1, 10, 10)), np.zeros(6, int), num_replicas=3, rank=0),
                  verbose=False)


@needs_mpi_run
@pytest.mark.mpi
def test_data_parallel_fit_and_evaluate_take_a_sharded_loader():
    """DataParallel.fit and evaluate accept a DataLoader (no y): each rank reads only its share of every
    batch (counted through the transform), and the run equals the serial fit on the loader."""
    x, y = data(30, seed=10)

    class Counting:
        rows = 0

        def __call__(self, xb):
            Counting.rows += len(xb)
            return xb

    ref = make_cnn("numpy", seed=2)
    ref.fit(pc.data.DataLoader(x, y, batch_size=8, seed=4), epochs=2, verbose=False,
            optimizer=pc.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9))
    want = ref.evaluate(x, y)
    model = make_cnn("numpy", seed=2 + RANK)
    dp = dist.DataParallel(model)
    dp.fit(pc.data.DataLoader(x, y, batch_size=8, seed=4, transform=Counting()), epochs=2, verbose=False,
           optimizer=pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    rows = Counting.rows
    got = dp.evaluate(pc.data.DataLoader(x, y, batch_size=7, seed=1))
    total_rows = COMM.allreduce(rows)

    def check():
        assert total_rows == 2 * 30, total_rows  # every sample read once per epoch, by one rank
        for name, w in ref.state_dict().items():
            np.testing.assert_allclose(model.state_dict()[name], w, rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        assert got["accuracy"] == want["accuracy"]

    on_all_ranks(check)
