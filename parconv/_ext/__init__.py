"""The compiled CPU kernels, chosen for this CPU once, at import.

setup.py compiles every kernel module once per instruction-set level into
``parconv/_ext/_isa_<level>/`` (x86-64: ``generic`` = the x86-64 baseline,
``avx2`` = x86-64-v3 with AVX2 and FMA, ``avx512`` = x86-64-v4; other targets:
``generic`` only, which is NEON on aarch64). Importing this package asks the CPU
what it runs (cpuid through the compiler's runtime, in ``_cpu``), picks the
highest level that is both built and supported, and binds ``parconv._ext._conv``
etc. to that level's modules: :data:`DISPATCH` is the one table every caller
goes through. ``PARCONV_ISA=generic|avx2|avx512`` asks for a lower level (for
tests and comparisons); a level the CPU cannot run (or that is not built) makes
every kernel import raise :class:`ISAError`, which says what the CPU has.

Before any kernel module loads libgomp (which reads ``OMP_WAIT_POLICY`` /
``GOMP_SPINCOUNT`` once, when it is loaded), this package sets the OpenMP wait
policy. Left alone, libgomp's idle threads spin for a while after every
parallel region; on a machine whose cores are shared (CI runners, notebooks on
shared servers, co-tenants) those spinning threads take the time the working
ones need, so parconv asks for passive waiting unless the user chose a policy.
See docs/performance-internals.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

LEVELS = ("generic", "avx2", "avx512")  # lowest first
KERNEL_MODULES = ("_activations", "_bf16", "_conv", "_conv_general", "_dense", "_int8", "_losses", "_norm", "_optim",
                  "_pool")
DESCRIPTION = {
    "generic": "portable C (x86-64 baseline: SSE2; NEON on aarch64)",
    "avx2": "x86-64-v3: AVX2 + FMA",
    "avx512": "x86-64-v4: AVX-512 F/BW/CD/DQ/VL",
}
# what each level needs from the CPU, where the compiler cannot ask for the psABI level itself
_NEEDS = {
    "avx2": ("avx", "avx2", "fma", "bmi1", "bmi2"),
    "avx512": ("avx", "avx2", "fma", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
_PSABI = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}

DISPATCH: dict = {}  # kernel module name -> the chosen level's module
STATE: dict = {}  # what was detected and chosen, and why (show_config reads it)

#: how the OpenMP wait policy was decided (``parconv info`` prints it)
WAIT_POLICY = {"policy": "", "source": ""}


def _gomp_loaded() -> bool:
    """Whether some libgomp is already mapped (then its wait policy is settled)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


def _choose_wait_policy() -> None:
    user = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    if user:
        WAIT_POLICY["policy"] = ", ".join(f"{k}={v}" for k, v in user.items())
        WAIT_POLICY["source"] = "set by the user"
        return
    if _gomp_loaded():
        # torch (or another library) loaded the shared libgomp first: its default stands
        WAIT_POLICY["policy"] = "OpenMP runtime default (threads spin after each region)"
        WAIT_POLICY["source"] = ("libgomp was loaded before parconv (by torch?); import parconv first or set "
                                 "OMP_WAIT_POLICY=PASSIVE in the environment")
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        from . import _threads  # noqa: F401  loads libgomp, which reads the policy now
    except ImportError:
        pass
    finally:
        # only this process's runtime: child processes and other programs keep their own default
        del os.environ["OMP_WAIT_POLICY"]
    WAIT_POLICY["policy"] = "PASSIVE"
    WAIT_POLICY["source"] = "parconv's default; OMP_WAIT_POLICY=ACTIVE makes idle threads spin"


class ISAError(RuntimeError):
    """``PARCONV_ISA`` asks for a level this CPU cannot run, or that was not built."""


def cpu_features() -> dict:
    """Feature name -> bool, as the CPU and OS report them (empty off x86 or without the probe)."""
    try:
        from . import _cpu
    except ImportError:
        return {}
    return _cpu.features()


def supported_levels(features: dict | None = None) -> list:
    """The levels this CPU can run, lowest first (``generic`` always)."""
    if features is None:
        features = cpu_features()
    out = ["generic"]
    for level in ("avx2", "avx512"):
        psabi = features.get(_PSABI[level])
        ok = psabi if psabi is not None else all(features.get(f, False) for f in _NEEDS[level])
        if not ok:
            break
        out.append(level)
    return out


def built_levels() -> list:
    """The levels whose every kernel module is installed, lowest first."""
    out = []
    for level in LEVELS:
        try:
            found = all(importlib.util.find_spec(f"{__name__}._isa_{level}.{m}") is not None for m in KERNEL_MODULES)
        except (ImportError, ValueError):
            found = False
        if found:
            out.append(level)
    return out


def _cpu_summary(features: dict) -> str:
    have = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                        "amx_bf16", "amx_int8") if features.get(f)]
    return ", ".join(have) if have else "no AVX2/AVX-512"


def choose(requested: str | None, supported: list, built: list, features: dict) -> tuple:
    """(level, why) for a ``PARCONV_ISA`` value (None or "" = the best); ISAError when impossible."""
    usable = [lv for lv in built if lv in supported]
    if requested:
        req = requested.strip().lower()
        if req not in LEVELS:
            raise ISAError(f"PARCONV_ISA={requested!r} is not a kernel level; use one of "
                           f"{', '.join(LEVELS)} (or unset it for the best this CPU runs)")
        if req not in supported:
            raise ISAError(f"PARCONV_ISA={req} asks for {DESCRIPTION[req]} kernels, but this CPU runs only "
                           f"{', '.join(supported)} (it has: {_cpu_summary(features)}); set PARCONV_ISA to "
                           f"one of those or unset it")
        if req not in built:
            raise ISAError(f"PARCONV_ISA={req}: this installation has no {req} kernels (built: "
                           f"{', '.join(built) or 'none'}); set PARCONV_ISA to one of those or unset it")
        return req, f"PARCONV_ISA={req}"
    if not usable:
        return None, "no kernel level is built" if not built else "no built level runs on this CPU"
    best = usable[-1]
    why = f"the highest built level this CPU runs (CPU runs {', '.join(supported)}; built: {', '.join(built)})"
    return best, why


def _bind() -> None:
    features = cpu_features()
    supported = supported_levels(features)
    built = built_levels()
    requested = os.environ.get("PARCONV_ISA", "").strip() or None
    STATE.update(features=features, supported=supported, built=built, requested=requested,
                 level=None, why=None, error=None)
    try:
        level, why = choose(requested, supported, built, features)
    except ISAError as exc:
        # importing a kernel module raises it (see __getattr__); this package stays importable
        # so that show_config / parconv info can say what the CPU has
        STATE["error"] = exc
        return
    STATE.update(level=level, why=why)
    if level is None:
        return  # no compiled kernels: the imports below fail with the reason (see __getattr__)
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}._isa_{level}.{name}")
        DISPATCH[name] = module
        sys.modules[f"{__name__}.{name}"] = module
        globals()[name] = module
    compiled_for = DISPATCH["_conv"].kernel_isa()
    if compiled_for != level:
        # e.g. a build whose level flags were overridden: say so instead of mislabelling it
        STATE["why"] += f"; its modules report {compiled_for!r} kernels"


def __getattr__(name):
    if name in KERNEL_MODULES:
        if STATE.get("error") is not None:
            raise ISAError(str(STATE["error"]))
        raise ImportError(f"parconv's compiled kernels are not available: {STATE.get('why')} "
                          f"(reinstall parconv with a C compiler, or use backend='numpy')")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_choose_wait_policy()  # first: the kernel modules below load libgomp
_bind()
