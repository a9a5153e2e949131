"""Amdahl analysis of a training step: parallel kernel time vs serial time.

The MLP study profiled its training step and found 98% of the time in
parallel kernels. Here a :class:`TimedBackend` proxy wraps a backend and
accumulates the wall time spent inside its op methods (convolution, pooling,
linear, activations, losses, optimizer updates: the parallel kernels). The
rest of a step (layers, validation, the Sequential loop, Python) is serial.

With ``p`` the kernel fraction of a step on one thread:

* Amdahl bound ``S(n) = 1 / ((1 - p) + p / n)``;
* Karp–Flatt experimentally determined serial fraction
  ``e = (1 / S - 1 / n) / (1 - 1 / n)`` from the measured speedup ``S``
  (``e`` close to ``1 - p`` means the kernels scale and the serial part is
  what limits; ``e`` growing with ``n`` means parallel overhead).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from parconv.backends.base import Backend

from harness import gc_paused, paired_ratio, thread_scope
from workloads import Impl

#: Backend methods that are data operations (not kernels); they count as serial time
ARRAY_OPS = frozenset({"asarray", "to_numpy", "is_array", "empty", "zeros", "reshape", "copy", "copy_into",
                       "fill", "all_finite", "synchronize", "fuses_linear_head"})
KERNEL_OPS = tuple(
    name for name, value in vars(Backend).items()
    if callable(value) and not name.startswith("_") and name not in ARRAY_OPS
)


def _delegate(name: str, timed: bool):
    def method(self, *args, **kwargs):
        fn = getattr(self.inner, name)
        if not timed:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.kernel_s += dt
            self.per_op[name] += dt

    method.__name__ = name
    return method


class TimedBackend(Backend):
    """A backend proxy that times every kernel call of the backend it wraps.

    ``kernel_s`` accumulates seconds spent in kernel methods and ``per_op``
    splits them by op; :meth:`reset` zeroes both. Array operations pass
    through untimed. The proxy keeps the wrapped backend's arrays, so models
    built on it behave exactly like models on the backend itself.
    """

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = inner.name
        self.host_arrays = inner.host_arrays
        self.reset()

    def reset(self) -> None:
        self.kernel_s = 0.0
        self.per_op = defaultdict(float)

    def __getattr__(self, attr):  # backend-specific extras (info(), ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


for _name in KERNEL_OPS:
    setattr(TimedBackend, _name, _delegate(_name, True))
for _name in ARRAY_OPS:
    setattr(TimedBackend, _name, _delegate(_name, False))


def amdahl_bound(p: float, n: int) -> float:
    return 1.0 / ((1.0 - p) + p / n)


def karp_flatt(speedup: float, n: int) -> float | None:
    if n <= 1 or not speedup:
        return None
    return (1.0 / speedup - 1.0 / n) / (1.0 - 1.0 / n)


def analyse(case, impl: Impl, threads: list[int], repeat: int, warmup: int, settle: bool = True,
            on_run=None) -> dict:
    """Split ``case``'s training step on ``impl`` into kernel and serial time at each thread count.

    Repetitions are interleaved over the thread counts like the main timing
    (with an untimed settling step before each timed one when ``settle``).
    Returns a dict with ``p`` (kernel fraction at 1 thread) and one row per
    thread count: total / kernel / serial medians (s), the measured speedup
    (paired median vs 1 thread), the Amdahl bound and the Karp–Flatt serial
    fraction.
    """
    proxy = TimedBackend(impl.backend)
    inp = case.inputs(case.params)
    runner = case.runner(Impl(impl.name, "parconv", proxy), case.params, inp)
    totals, kernels = defaultdict(list), defaultdict(list)
    per_op = defaultdict(lambda: defaultdict(list))
    for n in threads:
        with thread_scope("parconv", n):
            for _ in range(max(warmup, 1)):
                runner.prepare()
                runner.run()
                runner.sync()
                if on_run:
                    on_run()
    for r in range(repeat):
        k = r % len(threads)
        for n in threads[k:] + threads[:k]:
            with thread_scope("parconv", n), gc_paused():
                if settle:
                    runner.prepare()
                    runner.run()
                    runner.sync()
                runner.prepare()
                proxy.reset()
                t0 = time.perf_counter()
                runner.run()
                runner.sync()
                totals[n].append(time.perf_counter() - t0)
                kernels[n].append(proxy.kernel_s)
                for op, s in proxy.per_op.items():
                    per_op[n][op].append(s)
            if on_run:
                on_run()
    base = 1 if 1 in threads else min(threads)
    p = statistics.median(k / t for k, t in zip(kernels[base], totals[base]))
    rows = []
    for n in threads:
        serial = [t - k for t, k in zip(totals[n], kernels[n])]
        measured = paired_ratio(totals[base], totals[n]) if base == 1 else None
        rows.append({
            "threads": n,
            "total_s": statistics.median(totals[n]),
            "kernel_s": statistics.median(kernels[n]),
            "serial_s": statistics.median(serial),
            "kernel_fraction": statistics.median(k / t for k, t in zip(kernels[n], totals[n])),
            "measured_speedup": measured,
            "amdahl_bound": amdahl_bound(p, n),
            "karp_flatt": karp_flatt(measured, n) if measured else None,
            "per_op_s": {op: statistics.median(v) for op, v in sorted(per_op[n].items())},
        })
    return {"workload": case.workload.name, "case": case.name, "impl": impl.name, "p": p,
            "serial_fraction": 1.0 - p, "repeat": repeat, "rows": rows}
