"""MPI workloads of the benchmark suite, and the data-parallel cost model.

Workloads (run under ``mpiexec -n N``; every rank runs this module):

``data-parallel``
    cnn-mnist training steps (conv 3x3 x d + ReLU + maxpool 2 + FC -> 10,
    softmax, SGD) at each global batch of ``--dp-batch`` (default 100 and 1000,
    the two ends of cnn-mnist's sweep), or with ``--dp-model resnet20`` the
    zoo's ResNet-20 on 3x32x32 inputs (BatchNorm with per-rank statistics and
    rank 0's buffers broadcast every step, as PyTorch's DDP). Three configurations, interleaved
    repetition by repetition so machine noise hits them alike: 1 rank x T
    threads, 1 rank x N*T threads (the same cores used by threads instead of
    ranks) and N ranks x T threads with :class:`parconv.distributed.DataParallel`.
    Reports throughput, scaling efficiency against 1 rank x T threads, the
    ratio against 1 rank x N*T threads, and the share of the step spent in the
    gradient allreduce, and how much of the reduction is hidden behind the
    backward: the bucketed reduction timed alone (every rank in step) against
    what is left of it once the last rank has finished its backward.
``conv-large-mpi``
    The conv-large layer (x 64x128x32x32, 64 filters 3x3, pad 1; 4.8 G
    multiply-adds) forward, filter-parallel over N ranks
    (:class:`parconv.distributed.FilterParallelConv2d`, output assembly
    included, once with ``Allgatherv`` and once with the pairwise exchange)
    against one rank with T threads and with N*T threads.

While a single-rank configuration runs on rank 0 the other ranks sleep in a
polling barrier, so they do not steal its cores. Every workload checks its
answer against the NumPy oracle before it times anything.

Cost model: :func:`cost_model` projects data-parallel weak scaling to 8..1024
ranks from the compute time per sample measured here and an allreduce that
moves ``2 (N - 1) / N`` of the gradient bytes per rank plus a latency term;
the measured overlap hides up to the measured backward window of it.

Standalone::

    mpiexec -n 2 python bench/mpi_bench.py --workloads data-parallel,conv-large-mpi
    python bench/mpi_bench.py --cost-model-only --compute-per-sample 1e-4 --grad-bytes 217640

``bench/run.py`` imports :func:`run_mpi_workloads` and :func:`cost_model`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import numpy as np

try:  # prefer the installed parconv; fall back to this checkout when it is not installed
    import parconv  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parconv as pc  # noqa: E402
from parconv._io import atomic_open  # noqa: E402

WORKLOADS = ("data-parallel", "conv-large-mpi")
DEFAULTS = dict(repeats=7, threads_per_rank=1, backend=None, dp_batch="100,1000", dp_filters=32, dp_steps=20,
                conv_batch=64, conv_channels=128, conv_filters=64, conv_size=32, bandwidth_gbs=12.5,
                latency_us=2.0, cost_ranks="8,16,32,64,128,256,512,1024", overlap=None, algorithm="halving",
                dp_model="cnn-mnist", wait_cores=0.0, dp_bucket_mb=1.0, dp_progress="hooks")
DP_MODELS = ("cnn-mnist", "resnet20")


def _arg(args, name):
    return getattr(args, name, None) if getattr(args, name, None) is not None else DEFAULTS[name]


# ------------------------------------------------------------------ cost model
def allreduce_time(ranks: int, nbytes: float, bandwidth: float, latency: float, algorithm: str = "halving",
                   messages: int = 1) -> float:
    """Seconds for an allreduce of ``nbytes`` over ``ranks``: each rank moves ``2 (N-1)/N * nbytes``.

    The latency term is ``2 log2(N)`` messages per bucket for recursive halving/doubling
    (reduce-scatter + allgather, ``algorithm="halving"``) or ``2 (N - 1)`` for a ring; ``messages``
    counts the buckets. ``bandwidth`` in bytes/s, ``latency`` in seconds.
    """
    if ranks <= 1:
        return 0.0
    steps = 2 * math.ceil(math.log2(ranks)) if algorithm == "halving" else 2 * (ranks - 1)
    return messages * steps * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def cost_model(compute_per_sample_s: float, grad_bytes: float, batch_per_rank: int, bandwidth: float,
               latency: float, ranks=(8, 16, 32, 64, 128, 256, 512, 1024), overlap: float = 0.0,
               algorithm: str = "halving", buckets: int = 1, overlap_window_s: float | None = None) -> list[dict]:
    """Projected data-parallel weak scaling (fixed batch per rank).

    Parameters
    ----------
    compute_per_sample_s : float
        Forward + backward + update seconds per sample on one rank (measured).
    grad_bytes : float
        Bytes of gradient reduced per step (4 x parameters for float32).
    batch_per_rank : int
    bandwidth : float
        Bytes/s per link; ``latency`` seconds per message.
    ranks : iterable of int
    overlap : float in [0, 1]
        Share of the allreduce hidden behind the backward pass; with
        ``overlap_window_s``, the share of that window's length the reduction
        progresses by (the measured overlap efficiency).
    algorithm : {"halving", "ring"}
    buckets : int
        Allreduce calls per step (each pays the latency term).
    overlap_window_s : float, optional
        Seconds of backward that run after the first bucket is started (per
        rank; constant under weak scaling). The hidden part is then
        ``overlap * min(allreduce, window)``: a reduction longer than the
        window is exposed by the rest, as at many ranks.

    Returns
    -------
    list of dict
        Per rank count: ``step_s``, ``compute_s``, ``allreduce_s`` (exposed),
        ``efficiency`` (compute / step) and ``samples_per_s``.
    """
    compute = batch_per_rank * compute_per_sample_s
    rows = []
    for n in ranks:
        full = allreduce_time(n, grad_bytes, bandwidth, latency, algorithm, buckets)
        if overlap_window_s is None:
            ar = full * (1.0 - overlap)
        else:
            ar = full - overlap * min(full, overlap_window_s)
        step = compute + ar
        rows.append({"ranks": int(n), "compute_s": compute, "allreduce_s": ar, "step_s": step,
                     "efficiency": compute / step, "samples_per_s": n * batch_per_rank / step})
    return rows


def format_cost_model(rows, bandwidth, latency, batch_per_rank, compute_per_sample_s, grad_bytes,
                      algorithm="halving", source="measured", overlap=None, overlap_window_s=None) -> str:
    hidden = ""
    if overlap_window_s is not None:
        hidden = (f", overlap {100 * overlap:.0f}% of a {overlap_window_s * 1e3:.2f} ms backward window "
                  "(measured)")
    elif overlap:
        hidden = f", {100 * overlap:.0f}% of the allreduce hidden"
    lines = [f"cost model: data-parallel weak scaling, {batch_per_rank} samples/rank, "
             f"{compute_per_sample_s * 1e3:.3f} ms compute/sample ({source}), {grad_bytes / 1e3:.1f} kB gradients, "
             f"{bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us latency, {algorithm} allreduce{hidden}",
             f"{'ranks':>6} {'compute ms':>11} {'allreduce ms':>13} {'efficiency':>11} {'samples/s':>12}"]
    for r in rows:
        lines.append(f"{r['ranks']:>6} {r['compute_s'] * 1e3:>11.3f} {r['allreduce_s'] * 1e3:>13.3f} "
                     f"{100 * r['efficiency']:>10.1f}% {r['samples_per_s']:>12,.0f}")
    return "\n".join(lines)


# --------------------------------------------------------------- MPI plumbing
def _sleeping_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning, so idle ranks leave their cores to rank 0.

    The naps are long (10 ms): a rank waking every 0.5 ms preempted one of rank
    0's threads that often, and every parallel region then waited for it (one
    rank x 2 threads at batch 100 read 1.01x to 1.73x one thread across runs).
    The barrier's own latency is never timed.
    """
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def _limits(threads: int):
    """Scope: parconv threads and BLAS threads both set to ``threads``."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(pc.num_threads(threads))
    try:
        from threadpoolctl import threadpool_limits

        stack.enter_context(threadpool_limits(threads, user_api="blas"))
    except ImportError:  # pragma: no cover
        pass
    return stack


def _wait_cores(comm, cores: int, max_wait_s: float):
    """Rank 0 waits (at most ``max_wait_s``) until ``cores`` threads run a probe at 0.8x ``cores`` times
    one thread's speed (``harness.core_probe``: a busy or shared machine gives fewer); the other ranks
    sleep meanwhile. Returns rank 0's last probe (None when not probed)."""
    probe = None
    if comm.Get_rank() == 0 and max_wait_s > 0 and cores > 1:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        try:
            from harness import wait_for_cores
        finally:
            sys.path.pop(0)
        probe = wait_for_cores(cores, max_wait_s)[1]
    _sleeping_barrier(comm)
    return probe


def _summary(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


# ------------------------------------------------------------- data parallel
def _dp_batches(args) -> list[int]:
    """The global batches of the data-parallel run (``dp_batch``: an int or a comma-separated list)."""
    value = _arg(args, "dp_batch")
    batches = [int(b) for b in str(value).split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise ValueError(f"dp_batch must be positive global batch sizes, got {value!r}")
    return batches


def _dp_setup(args, backend):
    from parconv.cli import build_cnn

    batch, steps = max(_dp_batches(args)), _arg(args, "dp_steps")
    need = batch * (steps + 1)
    name = _arg(args, "dp_model")
    if name not in DP_MODELS:
        raise ValueError(f"dp_model must be one of {list(DP_MODELS)}, got {name!r}")
    if name == "resnet20":  # CIFAR-shaped inputs; the timing does not depend on the pixels
        rng = np.random.default_rng(0)
        x = rng.standard_normal((need, 3, 32, 32)).astype(np.float32)
        return x, rng.integers(0, 10, need), lambda: pc.models.resnet20(backend=backend, rng=0)
    x, y = pc.datasets.load_mnist("test")
    reps = -(-need // x.shape[0])
    x = np.concatenate([x] * reps)[:need]
    y = np.concatenate([y] * reps)[:need]
    x = (x - x.mean()) / x.std()
    filters = _arg(args, "dp_filters")
    return x.astype(np.float32), y, lambda: build_cnn(filters, backend=backend, seed=0)


def _train_steps(model, opt, x, y, batch, steps, dp=None, warmup=3):
    """Time ``steps`` optimizer steps after ``warmup`` untimed ones; returns seconds.

    Configs are interleaved, so a rank (or a thread) that sat idle in the config
    before starts this one cold; the untimed steps let every config reach its
    steady state alike before the clock starts.
    """
    return _train_steps_detail(model, opt, x, y, batch, steps, dp, warmup)[0]


def _train_steps_detail(model, opt, x, y, batch, steps, dp=None, warmup=3):
    """:func:`_train_steps` plus each timed step's seconds and (with ``dp``) its seconds in allreduce
    and its ``reduce_window`` (when every gradient was handed to the reduction, when it completed)."""
    loss_fn = pc.SoftmaxCrossEntropy()
    lo, hi = dp.shard(batch) if dp is not None else (0, batch)
    t0 = 0.0
    n = len(x) // batch
    step_s, allreduce_s, windows = [], [], []
    for s in range(steps + warmup):
        if s == warmup:
            if dp is not None:
                dp.comm.Barrier()
                dp.reset_timings()
            t0 = time.perf_counter()
        ts = time.perf_counter()
        ar0 = dp.timings["allreduce"] if dp is not None else 0.0
        b = s % n
        xb, yb = x[b * batch + lo:b * batch + hi], y[b * batch + lo:b * batch + hi]
        out = (dp or model)(xb)
        loss_fn(out, yb)
        (dp or model).backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        if s >= warmup:
            step_s.append(time.perf_counter() - ts)
            allreduce_s.append(dp.timings["allreduce"] - ar0 if dp is not None else 0.0)
            windows.append((*dp.reduce_window, dp.reduce_started, dp.hidden_share) if dp is not None else None)
    model.backend.synchronize()
    return time.perf_counter() - t0, step_s, allreduce_s, windows


def _split_allreduce(comm, allreduce_s, windows) -> tuple[float, float] | None:
    """This rank's seconds of allreduce split into (the reduction itself, waiting for the slowest rank).

    A step's reduction cannot complete before the last rank has handed over its
    gradients, so with every rank on one node (one monotonic clock) the time a
    rank spends between its own ``ready`` and the last rank's ``ready`` is load
    imbalance, and what follows -- plus the copies and launches inside the
    backward -- is the reduction. None when the ranks span several nodes.
    """
    if len(set(comm.allgather(socket.gethostname()))) != 1:
        return None
    ready = np.array(comm.allgather([w[0] for w in windows]))  # (ranks, steps)
    last = ready.max(axis=0)
    mine = ready[comm.Get_rank()]
    wait = np.minimum(last - mine, np.array(allreduce_s))
    return float(np.sum(np.array(allreduce_s) - wait)), float(np.sum(wait))


def _overlap(comm, windows) -> tuple[float, float] | None:
    """Median over steps of (seconds of reduction left once the last rank finished its backward, seconds
    of backward after the first bucket was started, share of the gradient whose reduction had completed
    by then); None when the ranks span several nodes."""
    if len(set(comm.allgather(socket.gethostname()))) != 1:
        return None
    w = np.array(comm.allgather([list(x) for x in windows]))  # (ranks, steps, [ready, done, started])
    last_ready = w[:, :, 0].max(axis=0)
    exposed = np.maximum(w[:, :, 1] - last_ready, 0.0).max(axis=0)
    window = (w[:, :, 0] - w[:, :, 2]).min(axis=0)
    hidden = w[:, :, 3].min(axis=0)  # a reduction is complete on every rank or on none
    return float(np.median(exposed)), float(np.median(window)), float(np.median(hidden))


def _buckets_alone(comm, sizes, repeats=30) -> float:
    """Median seconds of the bucketed reduction alone: one ``Iallreduce`` per bucket, then ``Waitall``,
    entered together by all ranks (what the backward would wait for if nothing were hidden)."""
    from parconv import distributed as dist

    bufs = [np.ones(n, dtype=np.float32) for n in sizes]
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        reqs = [comm.Iallreduce(dist.MPI.IN_PLACE, [b, dist.MPI.FLOAT], op=dist.MPI.SUM) for b in bufs]
        dist.MPI.Request.Waitall(reqs)
        times.append(comm.allreduce(time.perf_counter() - t0, op=dist.MPI.MAX))
    return statistics.median(times)


def _allreduce_alone(comm, nbytes, repeats=30) -> float:
    """Median seconds of one in-place float32 ``Allreduce`` of ``nbytes`` entered together by all ranks."""
    from parconv import distributed as dist

    buf = np.ones(nbytes // 4, dtype=np.float32)
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(dist.MPI.IN_PLACE, [buf, dist.MPI.FLOAT], op=dist.MPI.SUM)
        times.append(comm.allreduce(time.perf_counter() - t0, op=dist.MPI.MAX))
    return statistics.median(times)


def _check_dp(comm, make, x, y, batch):
    """One DataParallel step must equal one serial step on the global batch (checked on every rank).

    A BatchNorm network is checked with its layers converted to SyncBatchNorm (the global batch's
    statistics, as the serial step); it is timed as it is, with per-rank statistics. It is checked after
    one step, against the size of that step: through 20 BatchNorm backwards (which cancel terms,
    ``dy - mean(dy) - xhat mean(dy xhat)``) float32 rounding grows to ~2e-3 of the largest update on
    the OpenMP backend (resnet20, batch 128) -- as much as between its Winograd and direct kernels on
    one process -- while a wrong reduction (per-rank statistics) is off by ~10% of it.
    """
    from parconv import distributed as dist

    ref = make()
    deep = any(isinstance(m, pc.BatchNorm2d) for m in ref.modules())
    init = ref.state_dict()
    ref_opt = pc.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train_steps(ref, ref_opt, x, y, batch, 0, warmup=1 if deep else 3)
    model = pc.SyncBatchNorm.convert_sync_batchnorm(make())
    dp = dist.DataParallel(model, comm, threads=pc.get_num_threads())
    _train_steps(model, pc.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y, batch, 0, dp,
                 warmup=1 if deep else 3)
    got, want = model.state_dict(), ref.state_dict()
    if deep:
        params = [k for k, _ in ref.named_parameters()]
        step = max(float(np.abs(want[k] - init[k]).max()) for k in params)
        ok = max(float(np.abs(got[k] - want[k]).max()) for k in params) <= 1e-2 * step
    else:
        ok = all(np.allclose(got[k], v, rtol=1e-4, atol=1e-6) for k, v in want.items())
    if not all(comm.allgather(ok)):
        raise RuntimeError("data-parallel: DataParallel step does not match the serial step; not timing it")


def bench_data_parallel(comm, args) -> list[dict]:
    """Each global batch of ``dp_batch``: 1 rank x T threads, 1 rank x ranks*T threads, ranks x T threads."""
    backend = pc.backends.get(_arg(args, "backend"))
    x, y, make = _dp_setup(args, backend)
    results = []
    for batch in _dp_batches(args):
        results += _bench_data_parallel_batch(comm, args, backend, x, y, make, batch)
    return results


def _bench_data_parallel_batch(comm, args, backend, x, y, make, batch) -> list[dict]:
    from parconv import distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    T = _arg(args, "threads_per_rank")
    repeats, steps = _arg(args, "repeats"), _arg(args, "dp_steps")
    with _limits(T):
        _check_dp(comm, make, x, y, batch)
    configs = [("1 rank", 1, T), ("1 rank", 1, size * T), (f"{size} ranks", size, T)]
    if size == 1:
        configs = configs[:1]
    times = {i: [] for i in range(len(configs))}
    ar_share, ar_share_step, ar_reduce_share, ar_wait_share, exposed, window, hid = [], [], [], [], [], [], []
    models, probes = {}, []
    for i, (_, ranks, threads) in enumerate(configs):
        with _limits(threads):
            model = make()
            dp = dist.DataParallel(model, comm, threads=threads,
                                   bucket_cap_mb=_arg(args, "dp_bucket_mb"),
                                   progress=_arg(args, "dp_progress")) if ranks > 1 else None
            models[i] = (model, pc.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), dp)
    for _ in range(repeats):
        probes.append(_wait_cores(comm, size * T, _arg(args, "wait_cores")))
        for i, (_, ranks, threads) in enumerate(configs):
            model, opt, dp = models[i]
            if ranks == 1:
                if rank == 0:
                    with _limits(threads):
                        times[i].append(_train_steps(model, opt, x, y, batch, steps))
                _sleeping_barrier(comm)
            else:
                with _limits(threads):
                    seconds, step_s, step_ar, windows = _train_steps_detail(model, opt, x, y, batch, steps, dp)
                split = _split_allreduce(comm, step_ar, windows)
                # the step of a data-parallel run ends when its slowest rank ends
                seconds = comm.allreduce(seconds, op=dist.MPI.MAX)
                times[i].append(seconds)
                shares = comm.allgather(dp.timings["allreduce"] / seconds)
                ar_share.append(max(shares))
                if split is not None:
                    parts = comm.allgather((split[0] / seconds, split[1] / seconds))
                    ar_reduce_share.append(max(p[0] for p in parts))
                    ar_wait_share.append(max(p[1] for p in parts))
                # the typical step: median over steps of each rank's share, the larger of the ranks
                step_shares = comm.allgather(statistics.median(a / t for a, t in zip(step_ar, step_s)))
                ar_share_step.append(max(step_shares))
                hidden = _overlap(comm, windows)
                if hidden is not None:
                    exposed.append(hidden[0])
                    window.append(hidden[1])
                    hid.append(hidden[2])
            comm.Barrier()
    pure_ar = _allreduce_alone(comm, 4 * models[0][0].num_parameters()) if size > 1 else 0.0
    dp_last = models[len(configs) - 1][2]
    buckets_alone = _buckets_alone(comm, dp_last.bucket_sizes) if size > 1 else 0.0
    if rank != 0:
        return []
    base = statistics.median(times[0])
    results = []
    for i, (label, ranks, threads) in enumerate(configs):
        s = _summary(times[i])
        thr = batch * steps / s["median_s"]
        row = {"workload": "data-parallel", "backend": backend.name,
               "config": f"batch {batch}: {label} x {threads} thread(s)",
               "ranks": ranks, "threads_per_rank": threads, "global_batch": batch, "steps": steps, **s,
               "step_s": s["median_s"] / steps, "samples_per_s": thr,
               "speedup": base / s["median_s"], "efficiency": base / s["median_s"] / (ranks * threads / T)}
        if ranks > 1:
            share = statistics.median(ar_share)
            row["allreduce_fraction"] = share
            # the same per step: a noise spike on one rank makes the other wait in that step only
            row["allreduce_fraction_median_step"] = statistics.median(ar_share_step)
            # the same split into the reduction itself and waiting for the slowest rank (one node only)
            row["allreduce_reduce_fraction"] = statistics.median(ar_reduce_share) if ar_reduce_share else None
            row["allreduce_wait_fraction"] = statistics.median(ar_wait_share) if ar_wait_share else None
            row["allreduce_s_per_step"] = share * row["step_s"]
            row["compute_s_per_step"] = (1 - share) * row["step_s"]
            row["vs_1rank_same_cores"] = thr / (batch * steps / statistics.median(times[1]))
            row["grad_bytes"] = 4 * models[i][0].num_parameters()
            row["compute_per_sample_s"] = row["compute_s_per_step"] / (batch / ranks)
            # the reduction alone (ranks already in step): what the allreduce costs without load imbalance
            row["allreduce_alone_s"] = pure_ar
            row["allreduce_alone_fraction"] = pure_ar / row["step_s"]
            row["model"] = _arg(args, "dp_model")
            row["progress"] = dp_last.progress
            row["bucket_cap_mb"] = _arg(args, "dp_bucket_mb")
            row["buckets"] = len(dp_last.bucket_sizes)
            # overlap: the bucketed reduction alone against what is left of it after the last backward
            row["buckets_alone_s"] = buckets_alone
            if exposed:
                # what is left of the reduction once the last rank ends its backward (on a busy machine
                # this includes a descheduled rank's delay), and the backward after the first bucket starts
                row["exposed_after_backward_s"] = statistics.median(exposed)
                row["overlap_window_s"] = statistics.median(window)
                # hidden: the share of the gradient whose reduction had completed when the backward ended
                row["overlap_fraction"] = statistics.median(hid)
                hidden_s = row["overlap_fraction"] * buckets_alone
                cap = min(buckets_alone, row["overlap_window_s"])
                row["overlap_efficiency"] = min(1.0, hidden_s / cap) if cap > 0 else 0.0
        measured = [p for p in probes if p is not None]
        row["core_probe"] = statistics.median(measured) if measured else None
        results.append(row)
    if size == 1:
        results[0]["grad_bytes"] = 4 * models[0][0].num_parameters()
        results[0]["compute_per_sample_s"] = results[0]["step_s"] / batch
    return results


# --------------------------------------------------------------- conv-large
def bench_conv_large_mpi(comm, args) -> list[dict]:
    from parconv import distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    T, repeats = _arg(args, "threads_per_rank"), _arg(args, "repeats")
    backend = pc.backends.get(_arg(args, "backend"))
    N, C = _arg(args, "conv_batch"), _arg(args, "conv_channels")
    O, H = _arg(args, "conv_filters"), _arg(args, "conv_size")
    K, pad = 3, 1
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((N, C, H, H)).astype(np.float32)
    with _limits(T):
        convs = {a: dist.FilterParallelConv2d(C, O, K, padding=pad, comm=comm, backend=backend, rng=1, threads=T,
                                              assemble=a) for a in ("allgatherv", "p2p")}
    full = convs["allgatherv"].state_dict()
    serial = pc.Conv2d(C, O, K, padding=pad, backend=backend)
    serial.weight.data = backend.asarray(full["weight"])
    serial.bias.data = backend.asarray(full["bias"])
    # check against the oracle on a slice of the batch before timing anything
    want = pc.functional.conv2d(x_host[:2], full["weight"], full["bias"], padding=pad, backend="numpy")
    ok = True
    with _limits(T):
        for conv in convs.values():
            ok = ok and np.allclose(pc.to_numpy(conv(x_host[:2])), want, rtol=1e-4, atol=1e-4)
    if not all(comm.allgather(ok)):
        raise RuntimeError("conv-large-mpi: filter-parallel output does not match the NumPy oracle; not timing it")
    x = backend.asarray(x_host)
    # (label, ranks, threads per rank, assembly, direct kernels only)
    configs = [("1 rank", 1, T, None, False), ("1 rank", 1, size * T, None, False),
               (f"{size} ranks", size, T, "allgatherv", False), (f"{size} ranks", size, T, "p2p", False)]
    if size == 1:
        configs = configs[:1]
    # The full layer and each rank's slice may take different algorithms (Winograd needs
    # enough filters), and Winograd's input transform is repeated on every rank: the same
    # runs on the direct kernels show what the decomposition itself gains.
    has_winograd = hasattr(backend, "winograd")
    if has_winograd and size > 1:
        configs += [("1 rank", 1, T, None, True), (f"{size} ranks", size, T, "allgatherv", True),
                    (f"{size} ranks", size, T, "p2p", True)]
    times = {i: [] for i in range(len(configs))}
    comm_share = {i: [] for i in range(len(configs))}
    saved = getattr(backend, "winograd", None)
    for rep in range(repeats + 1):  # repetition 0 warms up
        for i, (_, ranks, threads, assemble, direct) in enumerate(configs):
            try:
                if has_winograd:
                    backend.winograd = saved and not direct
                if ranks == 1:
                    if rank == 0:
                        with _limits(threads):
                            t0 = time.perf_counter()
                            serial(x)
                            backend.synchronize()
                            if rep:
                                times[i].append(time.perf_counter() - t0)
                    _sleeping_barrier(comm)
                else:
                    conv = convs[assemble]
                    with _limits(threads):
                        comm.Barrier()
                        conv.timings = {"compute": 0.0, "comm": 0.0}
                        t0 = time.perf_counter()
                        conv(x)
                        backend.synchronize()
                        seconds = comm.allreduce(time.perf_counter() - t0, op=dist.MPI.MAX)
                    if rep:
                        times[i].append(seconds)
                        comm_share[i].append(max(comm.allgather(conv.timings["comm"] / seconds)))
            finally:
                if has_winograd:
                    backend.winograd = saved
            comm.Barrier()
    if rank != 0:
        return []
    flops = 2.0 * N * O * C * K * K * H * H
    base = statistics.median(times[0])
    base_direct = next((statistics.median(times[i]) for i, c in enumerate(configs) if c[1] == 1 and c[4]), None)
    results = []
    for i, (label, ranks, threads, assemble, direct) in enumerate(configs):
        s = _summary(times[i])
        config = f"{label} x {threads} thread(s)" + (f" {assemble}" if assemble else "")
        if direct:
            config += ", direct kernels"
        row = {"workload": "conv-large-mpi", "backend": backend.name, "config": config, "assemble": assemble,
               "direct_kernels": direct, "ranks": ranks, "threads_per_rank": threads, "shape": [N, C, H, H],
               "filters": O, **s, "gflops": flops / s["median_s"] / 1e9, "speedup": base / s["median_s"],
               "efficiency": base / s["median_s"] / (ranks * threads / T)}
        if ranks > 1:
            row["comm_fraction"] = statistics.median(comm_share[i])
            row["vs_1rank_same_cores"] = statistics.median(times[1]) / s["median_s"]
            if direct and base_direct:
                row["speedup_same_algorithm"] = base_direct / s["median_s"]
        results.append(row)
    return results


# ------------------------------------------------------------------- driver
def run_mpi_workloads(names, args=None) -> list[dict]:
    """Run the named MPI workloads on every rank of ``COMM_WORLD``; rank 0 gets the result rows.

    ``args`` is any object with the attributes of this module's command line
    (``repeats``, ``threads_per_rank``, ``backend``, ``dp_batch``, ...); missing
    ones take the defaults in :data:`DEFAULTS`. Collective: every rank must call it.
    """
    from parconv import distributed as dist

    comm = dist.MPI.COMM_WORLD
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown MPI workloads {unknown}; known: {list(WORKLOADS)}")
    results = []
    with dist.abort_on_error(comm, "bench/mpi_bench.py"):
        for name in names:
            fn = bench_data_parallel if name == "data-parallel" else bench_conv_large_mpi
            results += fn(comm, args)
            comm.Barrier()
    measured = [r for r in results if r["workload"] == "data-parallel" and "compute_per_sample_s" in r]
    if measured:
        _attach_cost_model(measured[-1], args)
    return results


def _attach_cost_model(row, args) -> None:
    """Project the measured data-parallel row to 8..1024 ranks (``row["cost_model"]``)."""
    ranks = [int(r) for r in str(_arg(args, "cost_ranks")).split(",") if r.strip()]
    per_rank = getattr(args, "batch_per_rank", None) or max(1, row["global_batch"] // row["ranks"])
    params = {"compute_per_sample_s": row["compute_per_sample_s"], "grad_bytes": row["grad_bytes"],
              "batch_per_rank": per_rank, "bandwidth": _arg(args, "bandwidth_gbs") * 1e9,
              "latency": _arg(args, "latency_us") * 1e-6, "algorithm": _arg(args, "algorithm"),
              "buckets": row.get("buckets", 1)}
    given = getattr(args, "overlap", None)
    if given is not None or "overlap_efficiency" not in row:
        params["overlap"] = 0.0 if given is None else float(given)
    else:  # the measured overlap: that efficiency over the measured backward window
        params["overlap"], params["overlap_window_s"] = row["overlap_efficiency"], row["overlap_window_s"]
    row["cost_model"] = {"params": params, "rows": cost_model(ranks=ranks, **params)}


def format_results(rows) -> str:
    lines = [f"{'workload':<15} {'config':<48} {'median s':>9} {'min s':>8} {'max s':>8} {'throughput':>14} "
             f"{'speedup':>8} {'effic.':>7} {'vs 1 rank same cores':>21} {'comm share':>11}"]
    for r in rows:
        thr = f"{r['samples_per_s']:,.0f} img/s" if "samples_per_s" in r else f"{r['gflops']:.1f} GFLOP/s"
        comm_share = r.get("allreduce_fraction", r.get("comm_fraction"))
        same = r.get("vs_1rank_same_cores")
        lines.append(f"{r['workload']:<15} {r['config']:<48} {r['median_s']:>9.3f} {r['min_s']:>8.3f} "
                     f"{r['max_s']:>8.3f} {thr:>14} {r['speedup']:>7.2f}x {100 * r['efficiency']:>6.1f}% "
                     f"{(f'{same:.2f}x' if same else '-'):>21} "
                     f"{(f'{100 * comm_share:.1f}%' if comm_share is not None else '-'):>11}")
    for r in rows:
        if "speedup_same_algorithm" in r:
            lines.append(f"conv-large-mpi {r['config']}: {r['speedup_same_algorithm']:.2f}x one rank x "
                         f"{r['threads_per_rank']} thread(s) on the direct kernels (the same algorithm on both sides)")
    for r in rows:
        if "allreduce_alone_s" in r:
            lines.append(f"data-parallel batch {r['global_batch']}: allreduce of {r['grad_bytes'] / 1e3:.1f} kB: "
                         f"{r['allreduce_s_per_step'] * 1e3:.2f} ms/step exposed in backward "
                         f"({100 * r['allreduce_fraction']:.1f}% of the step, waiting for the slowest rank "
                         f"included; median step {100 * r['allreduce_fraction_median_step']:.1f}%"
                         + (f"; the reduction itself {100 * r['allreduce_reduce_fraction']:.1f}%, waiting for "
                            f"the slowest rank {100 * r['allreduce_wait_fraction']:.1f}%"
                            if r.get("allreduce_reduce_fraction") is not None else "") + "); "
                         f"{r['allreduce_alone_s'] * 1e3:.3f} ms alone "
                         f"({100 * r['allreduce_alone_fraction']:.1f}%); compute {r['compute_s_per_step'] * 1e3:.2f} "
                         "ms/step")
    for r in rows:
        if "overlap_fraction" in r:
            lines.append(f"data-parallel batch {r['global_batch']} ({r['model']}, progress {r['progress']}): the "
                         f"reduction of {r['buckets']} bucket(s) takes {r['buckets_alone_s'] * 1e3:.3f} ms alone; "
                         f"{100 * r['overlap_fraction']:.0f}% of the gradient is reduced when the backward ends "
                         f"(hidden behind its last {r['overlap_window_s'] * 1e3:.2f} ms); the rest leaves "
                         f"{r['exposed_after_backward_s'] * 1e3:.3f} ms after the last rank's backward"
                         + (f"; core probe {r['core_probe']:.2f}x (median)" if r.get("core_probe") else ""))
    for r in rows:
        if "cost_model" in r:
            p = r["cost_model"]["params"]
            lines.append(format_cost_model(r["cost_model"]["rows"], p["bandwidth"], p["latency"], p["batch_per_rank"],
                                           p["compute_per_sample_s"], p["grad_bytes"], p["algorithm"],
                                           overlap=p.get("overlap"), overlap_window_s=p.get("overlap_window_s")))
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], help="timed repetitions (median reported)")
    p.add_argument("--threads-per-rank", type=int, default=DEFAULTS["threads_per_rank"])
    p.add_argument("--backend", default=None, help="default: the process default (openmp when built)")
    p.add_argument("--dp-batch", default=DEFAULTS["dp_batch"],
                   help="data-parallel global batch sizes, comma-separated (cnn-mnist's sweep runs 100 to 1000)")
    p.add_argument("--dp-filters", type=int, default=DEFAULTS["dp_filters"], help="cnn-mnist filters d")
    p.add_argument("--dp-bucket-mb", type=float, default=DEFAULTS["dp_bucket_mb"],
                   help="DataParallel's bucket_cap_mb in the timed data-parallel runs")
    p.add_argument("--dp-progress", choices=("thread", "hooks"), default=DEFAULTS["dp_progress"],
                   help="DataParallel's progress: a thread calling into MPI during the backward, or the hooks only")
    p.add_argument("--dp-model", choices=DP_MODELS, default=DEFAULTS["dp_model"],
                   help="the data-parallel network: cnn-mnist, or resnet20 on 3x32x32 inputs")
    p.add_argument("--dp-steps", type=int, default=DEFAULTS["dp_steps"], help="training steps per timing")
    p.add_argument("--conv-batch", type=int, default=DEFAULTS["conv_batch"])
    p.add_argument("--conv-channels", type=int, default=DEFAULTS["conv_channels"])
    p.add_argument("--conv-filters", type=int, default=DEFAULTS["conv_filters"])
    p.add_argument("--conv-size", type=int, default=DEFAULTS["conv_size"])
    p.add_argument("--bandwidth-gbs", type=float, default=DEFAULTS["bandwidth_gbs"],
                   help="cost model: link bandwidth in GB/s")
    p.add_argument("--latency-us", type=float, default=DEFAULTS["latency_us"], help="cost model: latency in us")
    p.add_argument("--cost-ranks", default=DEFAULTS["cost_ranks"])
    p.add_argument("--overlap", type=float, default=DEFAULTS["overlap"],
                   help="cost model: share of the allreduce hidden behind the backward (default: the measured "
                        "overlap over the measured backward window; 0 with --cost-model-only)")
    p.add_argument("--algorithm", choices=("halving", "ring"), default=DEFAULTS["algorithm"])
    p.add_argument("--cost-model-only", action="store_true", help="no MPI: just print the model")
    p.add_argument("--compute-per-sample", type=float, default=None, help="seconds (with --cost-model-only)")
    p.add_argument("--grad-bytes", type=float, default=None, help="bytes (with --cost-model-only)")
    p.add_argument("--batch-per-rank", type=int, default=None, help="cost model batch per rank")
    p.add_argument("--wait-cores", type=float, default=DEFAULTS["wait_cores"], metavar="SECONDS",
                   help="data-parallel: before each repetition, wait up to this long until ranks x threads "
                        "threads get 0.8x as many cores' speed (bench/run.py's core probe; 0: do not wait)")
    p.add_argument("--json", default=None, help="write the result rows here")
    return p


def _print_cost_model(args, compute_per_sample, grad_bytes, batch_per_rank, source="measured"):
    ranks = [int(r) for r in str(args.cost_ranks).split(",") if r.strip()]
    bw, lat = args.bandwidth_gbs * 1e9, args.latency_us * 1e-6
    rows = cost_model(compute_per_sample, grad_bytes, batch_per_rank, bw, lat, ranks, args.overlap or 0.0,
                      args.algorithm)
    print(format_cost_model(rows, bw, lat, batch_per_rank, compute_per_sample, grad_bytes, args.algorithm, source,
                            overlap=args.overlap))
    return rows


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    if args.cost_model_only:
        if args.compute_per_sample is None or args.grad_bytes is None:
            raise SystemExit("--cost-model-only needs --compute-per-sample and --grad-bytes")
        _print_cost_model(args, args.compute_per_sample, args.grad_bytes, args.batch_per_rank or 50, "given")
        return 0
    from parconv import distributed as dist

    comm = dist.MPI.COMM_WORLD
    dist.install_excepthook(comm)
    rows = run_mpi_workloads(args.workloads, args)
    if comm.Get_rank() == 0:
        print(f"parconv {pc.__version__} | {comm.Get_size()} ranks x {args.threads_per_rank} thread(s) | "
              f"{pc._config._cpu_count()} cores | {args.repeats} interleaved repetitions")
        print(format_results(rows))
        if args.json:
            with atomic_open(args.json, "w") as f:
                json.dump({"results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
