"""Agreement checks of a backend against the NumPy oracle (``parconv selftest``).

Every op of the :class:`~parconv.backends.base.Backend` protocol, forward and every
gradient, runs on the chosen backend over a fixed set of shapes plus ``n_random``
random ones, and is compared with :mod:`parconv.backends.numpy_ref` evaluated in
float64 on the same float32 inputs (so the reference's own rounding does not count
against the backend). An element passes when ``|a - b| <= atol * scale + rtol * |b|``
with ``rtol = 1e-4``, ``atol = 1e-5`` and ``scale = max(1, max |b|)`` over the array:
a sum of many terms is judged against its own magnitude. Indices (argmax, labels,
counts) must match exactly.

Works for any registered backend (numpy, openmp, opencl, third-party); a user can run
it on a new OpenCL device with ``parconv selftest --backend opencl``.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from .optable import ATOL, OPS, RTOL


__all__ = ["run_selftest", "opencl_devices_info", "RTOL", "ATOL", "Checker"]


# ----------------------------------------------------------------------- records
@dataclass
class _OpResult:
    """Running tally of one checked quantity (e.g. ``conv2d.dw``)."""

    cases: int = 0
    failures: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.cases > 0 and self.failures == 0


class _Checker:
    def __init__(self, backend):
        self.be = backend
        self.results: dict[str, _OpResult] = {}

    def _rec(self, name: str) -> _OpResult:
        return self.results.setdefault(name, _OpResult())

    def host(self, a) -> np.ndarray:
        if isinstance(a, (float, int, np.generic)):  # scalars (losses) are host values already
            return np.asarray(a)
        return np.asarray(self.be.to_numpy(a))

    def close(self, name: str, actual, expected, case: str) -> None:
        """Record the comparison of a backend array with a float64 reference."""
        rec = self._rec(name)
        rec.cases += 1
        try:
            a = self.host(actual).astype(np.float64)
        except Exception as exc:  # noqa: BLE001 - a broken readback is a failure to report
            rec.failures += 1
            rec.notes.append(f"{case}: cannot read result ({type(exc).__name__}: {exc})")
            return
        e = np.asarray(expected, dtype=np.float64)
        if a.shape != e.shape:
            rec.failures += 1
            rec.notes.append(f"{case}: shape {a.shape} != expected {e.shape}")
            return
        if e.size == 0:
            return
        err = np.abs(a - e)
        err = np.where(np.isnan(a) & np.isnan(e), 0.0, err)
        scale = max(1.0, float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)))
        bad = ~(err <= ATOL * scale + RTOL * np.abs(e))
        max_abs = float(np.nanmax(err)) if np.isfinite(err).any() else math.inf
        rel = max_abs / max(float(np.max(np.abs(e), initial=0.0)), np.finfo(np.float64).tiny)
        rec.max_abs = max(rec.max_abs, max_abs)
        rec.max_rel = max(rec.max_rel, rel)
        if bad.any():
            rec.failures += 1
            if len(rec.notes) < 3:
                i = np.unravel_index(int(np.argmax(np.where(bad, err, -1))), e.shape)
                rec.notes.append(f"{case}: {int(bad.sum())} of {e.size} elements off, worst at {i}: "
                                 f"{a[i]!r} vs {e[i]!r}")

    def equal(self, name: str, actual, expected, case: str) -> None:
        """Record an exact comparison (indices, counts)."""
        rec = self._rec(name)
        rec.cases += 1
        a = np.asarray(actual if np.isscalar(actual) or isinstance(actual, (bool, int)) else self.host(actual))
        e = np.asarray(expected)
        if a.shape != e.shape or not np.array_equal(a, e):
            rec.failures += 1
            if len(rec.notes) < 3:
                rec.notes.append(f"{case}: {a.ravel()[:8]} != expected {e.ravel()[:8]}")

    def fail(self, name: str, case: str, exc: BaseException) -> None:
        rec = self._rec(name)
        rec.cases += 1
        rec.failures += 1
        if len(rec.notes) < 3:
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rec.notes.append(f"{case}: raised {msg}")




# ------------------------------------------------------------------------- run
def run_selftest(backend_name, seed: int = 0, n_random: int = 20, file=None) -> bool:
    """Check every op of a backend against the NumPy oracle and print a pass/fail table.

    Parameters
    ----------
    backend_name : str or Backend
        A registered backend (``"numpy"``, ``"openmp"``, ``"opencl"``, ...), or a
        backend instance.
    seed : int
        Seed of the data and of the random shapes.
    n_random : int
        Random shapes per op on top of the fixed ones.
    file : text stream, optional
        Where the table goes; default ``sys.stdout`` at call time (so redirections and
        pytest's capture see it).

    Returns
    -------
    bool
        True when every check passed; False on any failure, including a backend that
        cannot be loaded or an op that raises.
    """
    from .backends import get
    from .backends.numpy_ref import NumpyBackend

    file = sys.stdout if file is None else file
    out = lambda *a: print(*a, file=file)  # noqa: E731
    try:
        be = get(backend_name)
    except Exception as exc:  # noqa: BLE001 - reported, then a failed run
        out(f"parconv selftest: backend {backend_name!r} cannot be loaded: {exc}")
        return False
    ref = NumpyBackend()
    rng = np.random.default_rng(seed)
    ck = _Checker(be)
    t0 = time.perf_counter()
    backend_name = be.name
    out(f"parconv selftest: backend {backend_name!r} ({be!r}) against the NumPy oracle in float64")
    out(f"seed {seed}, {len(OPS)} op families (parconv.optable), fixed shapes plus {n_random} random ones each; "
        f"pass: |a - b| <= {ATOL:g} * max(1, max|b|) + {RTOL:g} * |b|")

    def guarded(spec, *args):
        try:
            spec.check(ck, *args)
        except Exception as exc:  # noqa: BLE001 - a crash in a check is a failure of that op
            ck.fail(spec.name, str(args[-1]), exc)
            if len(ck.results[spec.name].notes) <= 1:
                traceback.print_exc(file=file)

    for spec in OPS:
        for case in spec.cases(rng, n_random):
            guarded(spec, ref, rng, case)

    ok = all(r.ok for r in ck.results.values())
    out("")
    width = max([24] + [len(name) for name in ck.results])
    out(f"{'op':{width}s} {'cases':>5s} {'max abs err':>12s} {'max rel err':>12s}  result")
    for name in sorted(ck.results):
        r = ck.results[name]
        out(f"{name:{width}s} {r.cases:5d} {r.max_abs:12.2e} {r.max_rel:12.2e}  {'pass' if r.ok else 'FAIL'}")
        for note in r.notes[:3]:
            out(f"    {note}")
    n_fail = sum(not r.ok for r in ck.results.values())
    out("")
    out(f"{'PASSED' if ok else 'FAILED'}: {len(ck.results) - n_fail} of {len(ck.results)} checks passed "
        f"on backend {backend_name!r} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        _report_failure(be, [name for name, r in sorted(ck.results.items()) if not r.ok], file)
    return ok


def _report_failure(be, failed: list, file) -> None:
    """A banner naming the failed checks, on the table's stream and on stderr when that is another stream."""
    shown = ", ".join(failed[:12]) + (f" and {len(failed) - 12} more" if len(failed) > 12 else "")
    banner = "\n".join([
        "=" * 78,
        f"parconv selftest FAILED on {be!r}: {len(failed)} checks gave wrong results or errors",
        f"  failed: {shown}",
        "  Results computed on this backend/device cannot be trusted: do not train on it.",
        "  OpenCL: choose another device (PARCONV_OPENCL_DEVICE) or use the openmp backend,",
        "  and report the table above with your driver's name and version.",
        "=" * 78,
    ])
    print(banner, file=file)
    if file is not sys.stderr:
        print(banner, file=sys.stderr)


# ---------------------------------------------------------------------- devices
def _device_type_name(cl, bits: int) -> str:
    """"GPU", "CPU", "ACCELERATOR" or "CUSTOM" from a device-type bitfield (drivers also set DEFAULT)."""
    names = [n for n in ("GPU", "CPU", "ACCELERATOR", "CUSTOM") if bits & getattr(cl.device_type, n, 0)]
    return " | ".join(names) or "UNKNOWN"


def opencl_devices_info() -> list[dict]:
    """Every OpenCL device visible here, for ``parconv info``; [] without pyopencl.

    Each dict has ``platform_index``, ``device_index``, ``platform``, ``name``,
    ``vendor``, ``type``, ``compute_units``, ``global_mem_bytes``,
    ``max_work_group_size``, ``local_mem_bytes`` and ``version``.
    """
    try:
        import pyopencl as cl
    except ImportError:
        return []
    try:
        platforms = cl.get_platforms()
    except Exception:  # noqa: BLE001 - no ICD / no platform: nothing to list
        return []
    info = []
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:  # noqa: BLE001
            continue
        for di, d in enumerate(devices):
            info.append({
                "platform_index": pi,
                "device_index": di,
                "platform": platform.name.strip(),
                "name": d.name.strip(),
                "vendor": d.vendor.strip(),
                "type": _device_type_name(cl, d.type),
                "compute_units": int(d.max_compute_units),
                "global_mem_bytes": int(d.global_mem_size),
                "max_work_group_size": int(d.max_work_group_size),
                "local_mem_bytes": int(d.local_mem_size),
                "version": d.version.strip(),
            })
    return info


#: the public name of the comparison recorder (parconv.optable's checks write into it)
Checker = _Checker
