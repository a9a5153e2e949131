"""Timing machinery of the benchmark suite: thread scopes, answer checks, interleaved repetitions.

A *config* is one implementation at one thread count (``openmp@2``,
``torch@1``, ``numpy@1``). A *runner* is one config bound to one case's
inputs: ``prepare()`` (untimed: restores the start state, e.g. the initial
weights of a training step), ``run()`` (the timed work), ``sync()`` (waits for
a device), ``answer()`` (host arrays of the last run, for the checks) and
optionally ``breakdown()`` (per-layer seconds of the last run).

Timing follows three rules:

* every config is checked against the NumPy oracle before it is timed, and a
  config whose answer is wrong is never timed;
* the compared configs are *interleaved*: repetition ``r`` runs every config
  once, in an order rotated by ``r``, so drifting machine load (other jobs,
  turbo, thermal) hits every config alike and per-repetition ratios are paired;
* the thread setting is applied outside the timed region, and every timed
  sample follows one untimed *settling* call of the same config: thread pools
  resize lazily on their first parallel region, and the previous config (often
  another library) leaves caches, page tables and the allocator in its own
  state, so the first call after a switch is not the steady state being measured.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from machine import matmul_seconds

#: normalised max error (max |got - ref| / max |ref|) an answer may have
DEFAULT_TOL = 1e-3
#: a bf16 answer against a float32 one (bf16 keeps 8 significant bits: 4e-3 of each value)
BF16_TOL = 3e-2


#: a Config's thread count meaning "none set": parconv's default (every core, each region's team
#: capped at the cores other processes leave free) and PyTorch's own default
DEFAULT_THREADS = -1
_torch_default_threads = None


@dataclass(frozen=True, order=True)
class Config:
    """One implementation at one thread count (0: a device backend that manages its own threads;
    DEFAULT_THREADS: the library's own choice, no count set)."""

    impl: str
    threads: int

    @property
    def label(self) -> str:
        if self.threads == DEFAULT_THREADS:
            return f"{self.impl}@default"
        return f"{self.impl}@{self.threads if self.threads else 'device'}"


@contextlib.contextmanager
def thread_scope(impl_kind: str, n: int):
    """Run the enclosed block with ``n`` threads for an implementation of ``impl_kind``.

    ``"parconv"``: :func:`parconv.num_threads` (the OpenMP backend reads it on
    every op); ``"torch"``: :func:`torch.set_num_threads`. The BLAS libraries
    threadpoolctl finds (NumPy's, SciPy's, MKL) are limited to ``n`` too, which
    is what makes ``numpy@n`` mean "NumPy matmul on n threads". ``n == 0``
    changes nothing (a device backend such as OpenCL schedules its own work).
    """
    from threadpoolctl import threadpool_limits

    import parconv as pc

    if n == 0:
        yield
        return
    if n == DEFAULT_THREADS:
        with (_torch_threads(None) if impl_kind == "torch" else pc.num_threads(None)):
            yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        with (_torch_threads(n) if impl_kind == "torch" else pc.num_threads(n)):
            yield


@contextlib.contextmanager
def _torch_threads(n):
    """PyTorch on ``n`` threads inside the block (None: its default, read before any config changed it)."""
    import torch

    global _torch_default_threads
    if _torch_default_threads is None:
        _torch_default_threads = torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(_torch_default_threads if n is None else n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- answers
def compare_answers(got: dict, ref: dict, tol: float | dict = DEFAULT_TOL) -> dict:
    """Compare two answers (dicts of arrays) key by key.

    The error of a key is ``max |got - ref| / max(max |ref|, 1e-12)``; an
    answer passes when every key is present with the reference's shape and
    an error of at most its tolerance: ``tol``, or ``tol[key]`` when ``tol`` is
    a dict (keys it lacks get :data:`DEFAULT_TOL`). Returns ``{"ok",
    "max_err", "worst_key", "message"}``; the worst key is the one furthest
    over (or least under) its tolerance.
    """
    def key_tol(key):
        return tol.get(key, DEFAULT_TOL) if isinstance(tol, dict) else tol

    worst, worst_key, worst_share = 0.0, None, -1.0
    for key, r in ref.items():
        if key not in got:
            return {"ok": False, "max_err": float("inf"), "worst_key": key, "message": f"missing output {key!r}"}
        a = np.asarray(got[key], dtype=np.float64)
        b = np.asarray(r, dtype=np.float64)
        if a.shape != b.shape:
            return {"ok": False, "max_err": float("inf"), "worst_key": key,
                    "message": f"{key}: shape {a.shape} != oracle shape {b.shape}"}
        if not np.all(np.isfinite(a)):
            return {"ok": False, "max_err": float("inf"), "worst_key": key, "message": f"{key}: non-finite values"}
        scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-12)
        err = float(np.max(np.abs(a - b))) / scale if a.size else 0.0
        share = err / key_tol(key) if key_tol(key) > 0 else (0.0 if err == 0 else float("inf"))
        if share > worst_share:
            worst, worst_key, worst_share = err, key, share
    t = key_tol(worst_key)
    ok = worst <= t
    msg = f"max normalised error {worst:.2e} ({worst_key})" + ("" if ok else f" > tolerance {t:g}")
    return {"ok": ok, "max_err": worst, "worst_key": worst_key, "message": msg}


# ----------------------------------------------------------------------------- noise
def _own_cpu_s() -> float:
    """CPU seconds of all this process's threads, at clock resolution (``os.times()`` counts 10 ms ticks)."""
    return time.process_time()


class BackgroundLoad:
    """CPU time other processes used while a block ran, in cores (Linux; None elsewhere).

    Other jobs on the machine steal cores from the timed code, and they hurt
    multi-threaded configs most (a parallel region waits for its slowest
    thread). ``(busy CPU time of the machine - this process's CPU time) /
    wall time`` says how many cores were busy with something else.
    """

    def __init__(self):
        self.cores = None

    @staticmethod
    def _machine_busy_s():
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._t0, self._busy0, self._self0 = time.perf_counter(), self._machine_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc):
        busy = self._machine_busy_s()
        wall = time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.cores = max(0.0, ((busy - self._busy0) - (_own_cpu_s() - self._self0)) / wall)
        return False


def wait_for_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 1.0) -> dict:
    """Sleep until other processes use fewer than ``threshold`` cores over ``window_s`` (at most ``max_wait_s``).

    Returns ``{"waited_s", "background_cores"}`` (the last window's load; None
    where /proc/stat is missing).
    """
    t0 = time.perf_counter()
    while True:
        with BackgroundLoad() as bg:
            time.sleep(window_s)
        if bg.cores is None or bg.cores < threshold or time.perf_counter() - t0 >= max_wait_s:
            return {"waited_s": time.perf_counter() - t0 - window_s, "background_cores": bg.cores}


def wait_own_threads_idle(max_wait_s: float = 0.5, threshold: float = 0.1, window_s: float = 0.004) -> float:
    """Sleep until this process's own threads use fewer than ``threshold`` cores (at most ``max_wait_s``).

    Runtimes keep their idle workers spinning after a parallel call: libgomp
    for a few milliseconds, OpenBLAS for about 2**28 cycles. A sample timed while another runtime's worker still spins loses a
    core to it, so the harness waits for this process to go quiet between
    configs. Quiet means two windows in a row: on a virtual machine a
    spinning worker's vCPU can be descheduled for one window. Returns the
    seconds waited.
    """
    t0 = time.perf_counter()
    quiet = 0
    while True:
        c0, w0 = _own_cpu_s(), time.perf_counter()
        time.sleep(window_s)
        c1, w1 = _own_cpu_s(), time.perf_counter()
        quiet = quiet + 1 if (c1 - c0) < threshold * (w1 - w0) else 0
        if quiet >= 2 or w1 - t0 >= max_wait_s:
            return w1 - t0


_probe_operands: dict = {}


def core_probe(n: int, size: int = 384, calls: int = 2) -> float | None:
    """How many cores' worth of speed ``n`` threads get at this moment.

    The BLAS's float32 matmul of two ``size`` x ``size`` matrices (cache
    resident, compute bound: it scales almost perfectly on idle cores) is timed
    on 1 and on ``n`` threads, fastest of ``calls`` calls each after an untimed
    one (:func:`machine.matmul_seconds`); returns ``t(1) / t(n)``. A few
    milliseconds at the default size. None for ``n < 2`` or where
    threadpoolctl finds no BLAS to limit.

    On a virtual machine the host may at times run two of the guest's vCPUs
    on the two hyperthreads of one physical core for stretches of a second or
    two; each thread then runs markedly slower than alone and this probe reads
    well under ``n`` (docs/performance-internals.md gives the figures). A
    multi-threaded sample timed then measures the host's placement, not the code.
    """
    if n < 2:
        return None
    ops = _probe_operands.get(size)
    if ops is None:
        rng = np.random.default_rng(0)
        ops = _probe_operands[size] = (rng.random((size, size), dtype=np.float32),
                                       rng.random((size, size), dtype=np.float32))
    one = matmul_seconds(*ops, 1, calls)
    many = matmul_seconds(*ops, n, calls)
    if one is None or many is None or min(many) <= 0:
        return None
    return min(one) / min(many)


def wait_for_cores(n: int, max_wait_s: float, share: float = 0.8, pause_s: float = 0.05,
                   probe=None) -> tuple[float, float | None]:
    """Sleep until ``n`` threads get at least ``share * n`` cores' worth of speed (at most ``max_wait_s``).

    Polls :func:`core_probe` (or ``probe(n)``), pausing ``pause_s`` between
    probes. Returns ``(seconds waited, the last probe's speedup)``; the speedup
    is None where it cannot be measured, and then nothing is waited for.
    """
    probe = probe or core_probe
    t0 = time.perf_counter()
    while True:
        sp = probe(n)
        waited = time.perf_counter() - t0
        if sp is None or sp >= share * n or waited >= max_wait_s:
            return waited, sp
        time.sleep(min(pause_s, max(0.0, max_wait_s - waited)))


# ----------------------------------------------------------------------------- stats
def summarize(times: list[float]) -> dict:
    """Median, min, max, mean and standard deviation (seconds) of a list of samples."""
    if not times:
        return {"n": 0, "median": None, "min": None, "max": None, "mean": None, "stdev": None}
    return {
        "n": len(times),
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "mean": statistics.fmean(times),
        "stdev": statistics.stdev(times) if len(times) > 1 else 0.0,
    }


def paired_ratio(num: list[float], den: list[float]) -> float | None:
    """Median over repetitions of ``num[r] / den[r]`` (samples of one interleaved run).

    Lists of different lengths (a config timed once only, see ``--serial-max-s``)
    are not paired: the ratio of the medians is returned.
    """
    if not num or not den:
        return None
    if len(num) != len(den):
        return statistics.median(num) / statistics.median(den)
    pairs = [a / b for a, b in zip(num, den) if b > 0]
    return statistics.median(pairs) if pairs else None


def median_ci(values: list[float], conf: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: order statistics ``(x_(k), x_(n-k+1))``.

    ``k`` is the largest rank with ``P(Binomial(n, 1/2) < k) <= (1 - conf) / 2``, so the
    interval covers the true median with probability at least ``conf`` (7 samples:
    min to max, 98.4%). None for fewer than 6 samples, where no such ``k`` exists.
    """
    xs = sorted(values)
    n = len(xs)
    tail, k, cum = (1.0 - conf) / 2.0, 0, 0.0
    while True:
        cum += math.comb(n, k) / 2.0 ** n  # P(B <= k)
        if cum > tail:
            break
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def paired_ratio_ci(num: list[float], den: list[float], conf: float = 0.95) -> tuple[float, float] | None:
    """:func:`median_ci` of the paired per-repetition ratios (None when not paired)."""
    if not num or not den or len(num) != len(den):
        return None
    return median_ci([a / b for a, b in zip(num, den) if b > 0], conf)


# ----------------------------------------------------------------------------- timing
@dataclass
class Timed:
    """Everything measured for one config of one case."""

    config: Config
    times: list = field(default_factory=list)  # seconds per call, one per repetition
    breakdowns: list = field(default_factory=list)  # per-layer dicts, one per repetition
    inner: int = 1  # calls averaged into one sample
    single: bool = False  # one untimed-loop call only (a slow serial baseline)
    probes: list = field(default_factory=list)  # core_probe before each sample (None: not probed)
    core_waits: list = field(default_factory=list)  # seconds waited for the cores before each sample


@contextlib.contextmanager
def gc_paused():
    """Run the block with Python's cyclic garbage collector off, as ``timeit`` does.

    A full collection walks every object of the process (PyTorch's modules
    and the suite's runners included) and can last longer than a whole
    sample, so whichever sample it lands in is ruined, and it lands more often
    in the faster configs (more calls, so more allocations, per sample).
    Collections still run, between samples, where the next allocation after
    the block triggers them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# PARCONV_BENCH_CLOCK=cpu times samples by the process's CPU time instead of the wall clock:
# for one-thread comparisons on a shared machine, where time slices given to other processes
# would otherwise land in some samples and not others.
_CLOCK = time.process_time if os.environ.get("PARCONV_BENCH_CLOCK", "") == "cpu" else time.perf_counter


def _one_sample(runner, inner: int) -> float:
    """Seconds per call of ``runner.run`` averaged over ``inner`` calls.

    A restartable runner (a training step) is prepared before every call, off
    the clock: its second call in a row would otherwise time a different step
    (other weights, other activations; after a loss spike, softmax
    probabilities so small that they are denormal numbers and a step markedly
    slower on some CPUs), and the same config would be measured on different
    work depending on how many calls fill ``min_time``.
    """
    if getattr(runner, "restartable", False):
        total = 0.0
        for _ in range(inner):
            runner.prepare()
            t0 = _CLOCK()
            runner.run()
            runner.sync()
            total += _CLOCK() - t0
        return total / inner
    runner.prepare()
    t0 = _CLOCK()
    for _ in range(inner):
        runner.run()
    runner.sync()
    return (_CLOCK() - t0) / inner


def interleaved(runners: dict, kinds: dict, repeat: int, warmup: int, min_time: float,
                settle: bool = True, gap: float = 0.0, idle_wait: float = 0.0, on_run=None,
                wait_cores: float = 0.0, cores: int | None = None, probe=None) -> dict:
    """Time every runner ``repeat`` times, interleaved.

    Parameters
    ----------
    runners : dict Config -> runner
        Already checked; each has been run at least once.
    kinds : dict impl name -> "parconv" | "torch"
    repeat, warmup : int
        Timed repetitions and untimed warm-up calls per config.
    min_time : float
        Seconds one sample should last at least; a shorter call is repeated
        ``inner`` times (fixed per config from the warm-up) and averaged.
    settle : bool
        Run one untimed call of the config right before each timed sample.
    gap : float
        Seconds to sleep between configs (untimed), so the idle threads of the
        previous runtime (OpenMP, BLAS and OpenCL pools spin-wait a while
        after their work) stop competing for cores before the next timing.
    idle_wait : float
        After the gap, wait up to this many seconds until this process's own
        threads are idle (:func:`wait_own_threads_idle`); 0 turns it off.
    on_run : callable, optional
        Called after every run (progress display).
    wait_cores : float
        Before each sample of a config on ``n > 1`` threads, wait up to this
        many seconds until ``min(n, cores)`` threads get at least 0.8 cores'
        worth of speed each (:func:`wait_for_cores`); 0 turns it off. The
        probe and the wait are recorded per sample (``Timed.probes``,
        ``Timed.core_waits``).
    cores : int, optional
        Physical cores the machine has (None: as many as threads asked for).
    probe : callable, optional
        Replaces :func:`core_probe` (tests).

    Returns
    -------
    dict Config -> Timed
    """
    configs = list(runners)
    out = {c: Timed(c) for c in configs}
    per_call = {}
    for c in configs:
        with thread_scope(kinds[c.impl], c.threads), gc_paused():
            t = float("inf")
            for _ in range(max(warmup, 1)):
                t = min(t, _one_sample(runners[c], 1))
                if on_run:
                    on_run()
        per_call[c] = t
        out[c].inner = max(1, int(np.ceil(min_time / t))) if min_time > 0 and t > 0 else 1
    for r in range(repeat):
        k = r % len(configs)
        for c in configs[k:] + configs[:k]:
            runner = runners[c]
            if gap > 0:
                time.sleep(gap)
            if wait_cores > 0 and c.threads > 1:
                n = min(c.threads, cores) if cores else c.threads
                waited, sp = wait_for_cores(n, wait_cores, probe=probe) if n > 1 else (0.0, None)
                out[c].probes.append(sp)
                out[c].core_waits.append(waited)
            if idle_wait > 0:
                # after the probe too: the BLAS's workers spin on after its last call
                wait_own_threads_idle(idle_wait)
            with thread_scope(kinds[c.impl], c.threads), gc_paused():
                if settle:
                    # as long as a sample: after the pauses above, a virtual machine's idle vCPUs
                    # wake slowly until the host sees them busy again, as in a user's loop
                    settle_end = time.perf_counter() + min_time
                    restart = getattr(runner, "restartable", False)
                    runner.prepare()
                    while True:
                        runner.run()
                        runner.sync()
                        if time.perf_counter() >= settle_end:
                            break
                        if restart:  # the same step each time, as _one_sample times it
                            runner.prepare()
                out[c].times.append(_one_sample(runner, out[c].inner))
                bd = runner.breakdown() if hasattr(runner, "breakdown") else None
                if bd is not None:
                    out[c].breakdowns.append(bd)
            if on_run:
                on_run()
    return out


def case_rows(timed: dict, flops: float | None, items: int | None) -> list[dict]:
    """Per-config result rows: stats, GFLOP/s, throughput, speedup/efficiency vs 1 thread, ratios.

    ``speedup`` is the paired median of ``t(impl@1)[r] / t(impl@n)[r]``;
    ``vs_<other>`` the paired median of ``t(other@n)[r] / t(impl@n)[r]``
    (> 1: this config is faster), falling back to the other implementation's
    only config when it has one (the serial NumPy baseline, a device backend)
    and, for a device backend, to the others' largest thread count.
    """
    by_impl: dict[str, dict[int, Timed]] = {}
    for c, t in timed.items():
        by_impl.setdefault(c.impl, {})[c.threads] = t
    rows = []
    for c in sorted(timed, key=lambda c: (c.impl, c.threads if c.threads >= 0 else 1 << 30)):
        t = timed[c]
        s = summarize(t.times)
        row = {"config": c.label, "impl": c.impl, "threads": c.threads, "times_s": t.times, "inner": t.inner, **s}
        if t.single:
            row["single_call"] = True  # too slow to repeat: the one full-size check call, not interleaved
        med = s["median"]
        row["gflops"] = flops / med / 1e9 if flops and med else None
        row["items_per_s"] = items / med if items and med else None
        one = by_impl[c.impl].get(1)
        if one is not None and t.times and c.threads > 0:
            sp = paired_ratio(one.times, t.times)
            row["speedup"] = sp
            row["speedup_ci"] = paired_ratio_ci(one.times, t.times)
            row["efficiency"] = sp / c.threads if sp is not None else None
        else:
            row["speedup"] = row["efficiency"] = None
        for other, runs in by_impl.items():
            if other == c.impl:
                continue
            if c.threads in runs:
                ref = runs[c.threads]
            elif len(runs) == 1:  # a serial baseline or a device backend: one config only
                ref = next(iter(runs.values()))
            elif c.threads == 0:  # a device backend vs the others at their most threads
                ref = runs[max(runs)]
            else:
                ref = None
            row[f"vs_{other}"] = paired_ratio(ref.times, t.times) if ref is not None and t.times else None
        if any(p is not None for p in t.probes):
            row["core_probe"] = t.probes  # core_probe before each sample, in the order of times_s
            row["core_wait_s"] = sum(t.core_waits)
        if t.breakdowns:
            keys = list(t.breakdowns[0])
            row["breakdown_s"] = {k: statistics.median(b[k] for b in t.breakdowns if k in b) for k in keys}
        rows.append(row)
    return rows
