"""A distributed job never hangs: ranks that disagree, or one rank that exits, end every rank promptly.

Each case is a small script run under ``mpiexec -n 2`` with a timeout. Every rank prints ``READY``
with the wall-clock time once ``parconv.distributed`` is imported and both ranks have met (or, in
the script that leaves MPI to ``fit``, once ``parconv`` is imported), so the time the job takes to
end is measured from there (interpreter and import start-up excluded). A case passes
when the job exits non-zero within :data:`END_WITHIN` seconds of that point, never reaches its
last line, and shows the error of every rank that raised one.

These are launcher tests: they skip when this file itself runs under ``mpiexec`` or without
mpi4py and an ``mpiexec``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest


pytest.importorskip("mpi4py")

from test_distributed import UNDER_MPI, _env, _mpiexec  # the launcher's environment, shared

END_WITHIN = 10.0  # seconds from both ranks being ready to the end of the job
JOB_TIMEOUT = 60  # seconds for a whole job, start-up included: only a hang reaches it


pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(UNDER_MPI or _mpiexec() is None, reason="needs mpiexec, and not already running under MPI"),
]


JOB = """
    import os
    import sys
    import time

    import numpy as np

    import parconv as pc
    from parconv import distributed as dist

    comm = dist.MPI.COMM_WORLD
    rank = comm.rank
    case = sys.argv[1]
    comm.Barrier()
    os.write(1, f"READY {time.time():.6f}\\n".encode())  # one write: the ranks' lines never mix

    if case == "exception_before_any_collective":
        # no parconv collective has run: only the hook installed at import can end rank 0's Barrier
        if rank == 1:
            raise RuntimeError("rank 1 failed before any collective")
        comm.Barrier()

    n, batch_size, callbacks, fit_kwargs = 2000, 50, [], {}
    layers = [pc.Flatten(), pc.Linear(16, 3, rng=1)]
    if case == "samples_2000_1900":
        n = 2000 if rank == 0 else 1900
    elif case == "samples_2000_1990":  # the same number of batches: it would train, on different data
        n = 2000 if rank == 0 else 1990
    elif case == "batch_size_50_40":
        batch_size = 50 if rank == 0 else 40
    elif case == "exit_in_callback":
        class ExitOnRank1(pc.callbacks.Callback):
            def on_batch_end(self, step, logs):
                if rank == 1 and step == 3:
                    sys.exit(0)

        callbacks = [ExitOnRank1()]
    elif case == "exit_in_forward":
        class ExitingFlatten(pc.Flatten):
            calls = 0

            def forward(self, x):
                type(self).calls += 1
                if rank == 1 and self.calls == 3:
                    sys.exit(0)
                return super().forward(x)

        layers[0] = ExitingFlatten()
    elif case == "resume_on_one_rank":
        if rank == 0:
            pc.Sequential(*layers, backend="numpy").fit(
                np.zeros((n, 1, 4, 4), np.float32), np.zeros(n, np.int64), epochs=1, batch_size=batch_size,
                verbose=False, checkpoint="ck.npz")
        comm.Barrier()
        fit_kwargs["resume"] = "ck.npz" if rank == 0 else None

    model = pc.Sequential(*layers, backend="numpy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, n)
    if case == "loader_drop_last_on_one_rank":  # 1990 samples: 40 batches, or 39 without the last
        loader = pc.data.DataLoader(x[:1990], y[:1990], batch_size=batch_size, drop_last=rank == 1, seed=3)
        model.fit(loader, epochs=2, verbose=False, distributed=True)
    elif case == "loader_seed_per_rank":
        loader = pc.data.DataLoader(x, y, batch_size=batch_size, seed=rank)
        model.fit(loader, epochs=2, verbose=False, distributed=True)
    else:
        model.fit(x, y, epochs=2, batch_size=batch_size, verbose=False, distributed=True, callbacks=callbacks,
                  **fit_kwargs)
    print(f"rank {rank} finished", flush=True)
"""

# the script never imports parconv.distributed: fit(distributed=True) starts MPI itself
JOB_WITHOUT_IMPORT = """
    import os
    import time

    import numpy as np

    import parconv as pc

    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    os.write(1, f"READY {time.time():.6f}\\n".encode())  # one write: the ranks' lines never mix
    x = np.random.default_rng(0).standard_normal((200, 1, 4, 4)).astype(np.float32)
    if rank == 1:
        x[5, 0, 1, 1] = np.nan
    model = pc.Sequential(pc.Flatten(), pc.Linear(16, 3, rng=1), backend="numpy")
    model.fit(x, np.zeros(200, np.int64), epochs=1, batch_size=50, verbose=False, distributed=True)
    print(f"rank {rank} finished", flush=True)
"""

# a rank exits (cleanly or not) outside any parconv call while the other goes on into a collective
JOB_EXIT = """
    import os
    import sys
    import time

    import numpy as np

    import parconv as pc
    from parconv import distributed as dist

    comm = dist.MPI.COMM_WORLD
    rank = comm.rank
    case = sys.argv[1]
    comm.Barrier()
    os.write(1, f"READY {time.time():.6f}\\n".encode())
    status = 1 if case.startswith("exit1") else 0


    def exit_here(point):
        if rank == 1 and case.endswith(point):
            sys.exit(status)


    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 1, 4, 4)).astype(np.float32), rng.integers(0, 3, 40)
    model = pc.Sequential(pc.Flatten(), pc.Linear(16, 3, rng=1), backend="numpy")
    exit_here("before_data_parallel")
    dp = dist.DataParallel(model)
    dp.fit(x, y, epochs=1, batch_size=10, verbose=False)
    exit_here("between_fits")
    dp.fit(x, y, epochs=1, batch_size=10, verbose=False)
    exit_here("before_evaluate")
    dp.evaluate(x, y)
    exit_here("before_user_barrier")
    comm.Barrier()
    print(f"rank {rank} finished", flush=True)
"""

EXIT_CASES = {f"exit{status}_{point}": (0 if status == 0 else 1,
                                        f"rank 1 of 2 exited (sys.exit({status}))")
              for status in (0, 1)
              for point in ("before_data_parallel", "between_fits", "before_evaluate", "before_user_barrier")}

ARG_ERROR = "parconv.distributed.DistributedArgumentError: Sequential.fit: every rank must pass the same"

# case -> {rank: message that rank must print}
CASES = {
    "samples_2000_1900": {r: f"{ARG_ERROR} training arguments and data shapes; they differ in samples: "
                             "rank 0 has 2000, rank 1 has 1900" for r in (0, 1)},
    "samples_2000_1990": {r: "they differ in samples: rank 0 has 2000, rank 1 has 1990" for r in (0, 1)},
    "batch_size_50_40": {r: "they differ in batch_size: rank 0 has 50, rank 1 has 40" for r in (0, 1)},
    "exit_in_callback": {1: "SystemExit: 0"},
    "exit_in_forward": {1: "SystemExit: 0"},
    "exception_before_any_collective": {1: "RuntimeError: rank 1 failed before any collective"},
    "resume_on_one_rank": {r: "they differ in resume: rank 0 has True, rank 1 has False" for r in (0, 1)},
    "loader_drop_last_on_one_rank": {r: "they differ in batches per epoch: rank 0 has 40, rank 1 has 39"
                                     for r in (0, 1)},
    "loader_seed_per_rank": {r: "they differ in loader seed (pass DataLoader(seed=...)): rank 0 has 0, rank 1 has 1"
                             for r in (0, 1)},
    "bad_input_on_one_rank_before_mpi": {1: "ValueError: Sequential.fit: x holds nan at index (5, 0, 1, 1)"},
}


def _run(tmp_path, case, body=None, module=False):
    """Run the job for ``case``; returns (returncode, output, seconds from READY to the end)."""
    script = tmp_path / "job.py"
    if body is None:
        body = JOB_WITHOUT_IMPORT if case.endswith("before_mpi") else JOB
    script.write_text(textwrap.dedent(body))
    cmd = [_mpiexec(), "-n", "2", sys.executable, *(["-m", "mpi4py"] if module else []), str(script), case]
    # a session of its own, so a hung job is killed with every rank it started
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{case}: the job hung (killed after {JOB_TIMEOUT} s):\n{stdout}\n{stderr}")
    ended = time.time()
    out = stdout + stderr
    ready = [float(t) for t in re.findall(r"READY (\d+\.\d+)", stdout)]
    assert len(ready) == 2, f"{case}: the ranks did not both start:\n{out}"
    return proc.returncode, out, ended - max(ready)


@pytest.mark.parametrize("case", list(CASES))
def test_disagreeing_or_exiting_rank_ends_the_job(tmp_path, case):
    rc, out, seconds = _run(tmp_path, case)
    assert rc != 0, f"{case}: the job exited 0:\n{out}"
    assert seconds < END_WITHIN, f"{case}: took {seconds:.1f} s after start-up to end:\n{out}"
    assert "finished" not in out, f"{case}: a rank went past the failure:\n{out}"
    for rank, message in CASES[case].items():
        lines = [line for line in out.splitlines() if line.startswith(f"[rank {rank} of 2]")]
        assert any(message in line for line in lines), f"{case}: rank {rank} did not report {message!r}:\n{out}"


@pytest.mark.parametrize("case, module", [(case, False) for case in EXIT_CASES]
                         + [("exit0_between_fits", True), ("exit1_before_evaluate", True)])
def test_rank_exiting_outside_a_parconv_call_ends_the_job(tmp_path, case, module):
    """``sys.exit(0)`` or ``sys.exit(1)`` on rank 1 before DataParallel, between two fits, before evaluate
    or before the user's own Barrier: the job ends within seconds, a rank naming who exited and how."""
    rc, out, seconds = _run(tmp_path, case, JOB_EXIT, module)
    assert rc != 0, f"{case}: the job exited 0:\n{out}"
    assert seconds < END_WITHIN, f"{case}: took {seconds:.1f} s after start-up to end:\n{out}"
    assert "finished" not in out, f"{case}: a rank went past the failure:\n{out}"
    reporter, message = EXIT_CASES[case]
    lines = [line for line in out.splitlines() if line.startswith(f"[rank {reporter} of 2]")]
    assert any(message in line and "aborting all ranks" in line for line in lines), \
        f"{case}: rank {reporter} did not report {message!r}:\n{out}"


def test_ranks_ending_together_or_rank_0_working_on_alone_end_cleanly(tmp_path):
    """The exit watch never aborts a good job: rank 1 ends while rank 0 still saves the model (local work,
    no collective), then both end; exit status 0 and every rank's last line printed."""
    body = JOB_EXIT.replace('exit_here("before_user_barrier")\n    comm.Barrier()',
                            'if rank == 0:\n        time.sleep(1.0)\n        model.save("m.npz")\n'
                            '        time.sleep(1.0)')
    assert body != JOB_EXIT
    rc, out, _ = _run(tmp_path, "none", body)
    assert rc == 0, out
    assert "rank 0 finished" in out and "rank 1 finished" in out, out
    assert (tmp_path / "m.npz").exists()
