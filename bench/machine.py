"""What a benchmark result needs to be read later: CPU, cores, library versions, thread settings."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

THREAD_ENV = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
              "KMP_BLOCKTIME", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PARCONV_BACKEND")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import cpuinfo  # py-cpuinfo, the "bench" extra; slow (it may spawn a subprocess), so second choice

        return cpuinfo.get_cpu_info().get("brand_raw") or platform.processor()
    except Exception:  # noqa: BLE001 - optional
        return platform.processor() or "unknown"


def physical_cores() -> int | None:
    """Distinct (socket, core) pairs in /proc/cpuinfo (None where it cannot be read)."""
    try:
        seen = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        seen.add((phys, core))
                    phys = core = None
        return len(seen) or None
    except OSError:
        return None


def _flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in ("sse4_2", "avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni",
                                        "amx_tile", "amx_int8", "amx_bf16") if x in have]
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def machine_info(backends: dict, have_torch: bool) -> dict:
    """A JSON-able description of this machine and the software the results came from."""
    import numpy as np
    import scipy
    from threadpoolctl import threadpool_info

    import parconv as pc

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": _cpu_model(),
        "cpu_flags": _flags(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "affinity_cpus": affinity,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {"parconv": pc.__version__, "numpy": np.__version__, "scipy": scipy.__version__},
        "git_commit": _git_commit(),
        "env": {k: os.environ.get(k) for k in THREAD_ENV},
        "parconv_threads_default": pc.get_num_threads(),
        "blas": [{k: lib.get(k) for k in ("user_api", "internal_api", "version", "num_threads", "filepath")}
                 for lib in threadpool_info()],
        "backends": {},
    }
    from parconv.backends.base import Backend

    for name, be in backends.items():
        # whether the backend has its own fused conv+ReLU+maxpool kernel (else the composed default runs)
        entry = {"name": name, "fused_conv_relu_maxpool": type(be).conv2d_relu_maxpool2d_forward
                 is not Backend.conv2d_relu_maxpool2d_forward}
        if hasattr(be, "info"):
            try:
                entry.update(be.info())
            except Exception as exc:  # noqa: BLE001 - informational only
                entry["info_error"] = str(exc)
        info["backends"][name] = entry
    if have_torch:
        import torch

        info["versions"]["torch"] = torch.__version__
        info["torch"] = {"num_threads": torch.get_num_threads(),
                         "mkldnn": bool(torch.backends.mkldnn.is_available()),
                         "parallel_info": torch.__config__.parallel_info()}
    try:
        import matplotlib

        info["versions"]["matplotlib"] = matplotlib.__version__
    except ImportError:
        pass
    return info


def summary_line(info: dict) -> str:
    v = info["versions"]
    parts = [info["cpu"], f"{info['affinity_cpus']} cpus ({info.get('physical_cores') or '?'} physical cores)"]
    # the instructions the kernels dispatch on: which paths (and which PyTorch paths) this host measured
    flags = [f for f in info.get("cpu_flags") or [] if f in ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni",
                                                            "amx_int8", "amx_bf16")]
    if flags:
        parts.append("flags include " + ", ".join(flags))
    parts += [f"python {info['python']}", f"parconv {v['parconv']}", f"numpy {v['numpy']}"]
    if "torch" in v:
        parts.append(f"torch {v['torch']}")
    if info.get("load_average"):
        parts.append("load avg " + "/".join(f"{x:.2f}" for x in info["load_average"]))
    return " | ".join(parts)


_blas_controller = None


def _blas_limited(n: int):
    """A context limiting the BLAS libraries threadpoolctl finds to ``n`` threads (None: it finds none).

    One controller is made and kept: building one scans every loaded library,
    which costs milliseconds per call. The limit takes effect when the
    limiter is made and is undone when its ``with`` block ends, so it is only
    made for a ``with``.
    """
    global _blas_controller
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl comes with parconv's dependencies
        return None
    if _blas_controller is None:
        _blas_controller = ThreadpoolController()
    if not _blas_controller.select(user_api="blas").lib_controllers:
        return None
    return _blas_controller.limit(limits=n, user_api="blas")


def matmul_seconds(a, b, threads: int, calls: int) -> list[float] | None:
    """Seconds of each of ``calls`` timed ``a @ b`` on ``threads`` BLAS threads, after one untimed call.

    None where threadpoolctl finds no BLAS to limit (a thread count would mean nothing).
    """
    import time

    limited = _blas_limited(threads)
    if limited is None:
        return None
    out = []
    with limited:
        a @ b
        for _ in range(max(1, calls)):
            t0 = time.perf_counter()
            a @ b
            out.append(time.perf_counter() - t0)
    return out


def reference_scaling(threads: list[int], rounds: int = 7, size: tuple = (512, 2048, 1024)) -> dict | None:
    """Speedup of NumPy's float32 matmul (the BLAS) at each thread count over 1 thread, measured now.

    A compute-bound kernel that scales almost perfectly on idle cores: on a shared
    or virtualised machine it shows how much parallel speed the cores give at
    this moment, a reference for the speedups of the run. Interleaved rounds,
    median of the per-round ratios. None where threadpoolctl finds no BLAS.
    """
    import statistics

    import numpy as np

    m, k, n = size
    rng = np.random.default_rng(0)
    a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
    counts = sorted(set([1] + [int(t) for t in threads if int(t) > 0]))
    ratios = {t: [] for t in counts if t > 1}
    for _ in range(rounds):
        seconds = {}
        for t in counts:
            calls = matmul_seconds(a, b, t, 3)
            if calls is None:
                return None
            seconds[t] = sum(calls) / len(calls)
        for t in ratios:
            ratios[t].append(seconds[1] / seconds[t])
    return {"kernel": f"numpy float32 matmul {m}x{k} @ {k}x{n}", "rounds": rounds,
            "speedup": {str(t): statistics.median(r) for t, r in ratios.items()},
            "speedup_min": {str(t): min(r) for t, r in ratios.items()},
            "speedup_max": {str(t): max(r) for t, r in ratios.items()}}


def scaling_line(ref: dict | None, when: str) -> str:
    if not ref or not ref["speedup"]:
        return ""
    parts = [f"{t} threads {s:.2f}x (rounds {ref['speedup_min'][t]:.2f}-{ref['speedup_max'][t]:.2f})"
             for t, s in ref["speedup"].items()]
    return f"machine reference {when}: BLAS sgemm speedup over 1 thread " + ", ".join(parts)
