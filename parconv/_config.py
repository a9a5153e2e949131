"""Process-wide settings: the default backend, the OpenMP thread count and the convolution precision."""

from __future__ import annotations

import contextlib
import os
import threading
import time

_lock = threading.Lock()
_default_backend: str | None = None
_num_threads: int | None = None
_conv_precision: str = "high"

#: the values of :func:`set_conv_precision`, most accurate first
CONV_PRECISIONS = ("highest", "high", "medium")


_cores: int | None = None  # the cores this process may run on, read once (see _cpu_count)
_cores_why: str = ""  # how _cores was found, for ``parconv info``

# Where the CPU quota is read from; tests point these at a fake tree.
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(base: str, rel: str) -> list[str]:
    """``base/rel`` and each ancestor up to ``base``: a parent's quota limits its children too.

    Inside a container the cgroup namespace makes ``rel`` "/" (its own cgroup is
    the mount root); on a host ``rel`` is the process's cgroup below the mount.
    Directories that are not there (a path from another namespace) are skipped.
    """
    parts = [p for p in rel.strip().split("/") if p and p != ".."]
    dirs = [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _cgroup_cpu_quota() -> tuple[int | None, str]:
    """CPUs the cgroup CPU quota allows, ceil(quota / period), or None; and where it came from.

    cgroup v2: ``cpu.max`` ("max 100000" or "200000 100000"); cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1 = none). The
    smallest limit on the way from the process's cgroup to the root wins, as
    the kernel enforces each of them.
    """
    lines = (_read_text(_PROC_CGROUP) or "").splitlines()
    v2_rel = None
    v1_rel = None
    v1_controllers = "cpu"
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hid, controllers, rel = fields
        if hid == "0" and controllers == "":
            v2_rel = rel
        elif "cpu" in controllers.split(","):
            v1_rel, v1_controllers = rel, controllers
    best: tuple[int, str] | None = None

    def consider(quota: int, period: int, what: str):
        nonlocal best
        if quota <= 0 or period <= 0:
            return
        cpus = max(1, -(-quota // period))
        if best is None or cpus < best[0]:
            best = (cpus, f"{what} {quota}/{period} -> {cpus}")

    if v1_rel is not None or not lines:
        for mount in dict.fromkeys((os.path.join(_CGROUP_ROOT, v1_controllers), os.path.join(_CGROUP_ROOT, "cpu"),
                                    os.path.join(_CGROUP_ROOT, "cpu,cpuacct"))):
            for d in _cgroup_dirs(mount, v1_rel or "/"):
                quota = _read_text(os.path.join(d, "cpu.cfs_quota_us"))
                period = _read_text(os.path.join(d, "cpu.cfs_period_us"))
                try:
                    consider(int(quota), int(period), "cgroup v1 cpu.cfs_quota_us/cfs_period_us")
                except (TypeError, ValueError):
                    continue
    if v2_rel is not None or not lines:
        for mount in (_CGROUP_ROOT, os.path.join(_CGROUP_ROOT, "unified")):
            for d in _cgroup_dirs(mount, v2_rel or "/"):
                text = _read_text(os.path.join(d, "cpu.max"))
                if not text:
                    continue
                fields = text.split()
                if len(fields) == 2 and fields[0] != "max":
                    try:
                        consider(int(fields[0]), int(fields[1]), "cgroup cpu.max")
                    except ValueError:
                        continue
    if best is None:
        return None, "no cgroup CPU quota"
    return best


def _count_cores() -> tuple[int, str]:
    """(cores this process may use, how that was found): affinity mask, capped by a cgroup CPU quota."""
    try:
        affinity = max(1, len(os.sched_getaffinity(0)))
        why = f"affinity {affinity} core{'s' if affinity != 1 else ''}"
    except AttributeError:  # not Linux
        affinity = max(1, os.cpu_count() or 1)
        why = f"os.cpu_count() {affinity}"
    try:
        quota, quota_why = _cgroup_cpu_quota()
    except Exception as exc:  # a malformed cgroup tree must never stop an import
        quota, quota_why = None, f"cgroup unreadable ({type(exc).__name__})"
    if quota is not None and quota < affinity:
        return quota, f"{why}, {quota_why}"
    return affinity, f"{why}, {quota_why}"


def _cpu_count() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota.

    A container limited to 2 CPUs on a 64-core host sees all 64 cores in its
    affinity mask but gets 2 cores' worth of time; more threads than that only
    wait for each other. Read once and kept: the default thread count is asked
    for on every op, and the system calls cost more than a small op's Python.
    A fork's child and ``set_num_threads(None)`` read it again.
    """
    global _cores, _cores_why
    n = _cores
    if n is None:
        n, _cores_why = _count_cores()
        _cores = n
    return n


def _cpu_count_why() -> str:
    """How :func:`_cpu_count` found its number (e.g. "affinity 64 cores, cgroup cpu.max 200000/100000 -> 2")."""
    _cpu_count()
    return _cores_why


def _forget_cores() -> None:
    global _cores
    _cores = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_cores)


def _threads_from_env() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS")
    if not value:
        return None
    value = value.split(",")[0].strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def _check_threads(n, name: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, (int,)) and not hasattr(n, "__index__"):
        raise TypeError(f"{name} must be a positive int or None, got {type(n).__name__} {n!r}")
    n = int(n.__index__())
    if n < 1:
        raise ValueError(f"{name} must be a positive int or None, got {n}")
    return n


def set_num_threads(n: int | None) -> None:
    """Set the number of threads the CPU backends use.

    Parameters
    ----------
    n : int or None
        A positive thread count, or ``None`` to go back to the default:
        ``OMP_NUM_THREADS`` when it is set, else every core this process may
        run on (read again by this call, e.g. after ``os.sched_setaffinity``).

    Raises
    ------
    TypeError, ValueError
        If ``n`` is not a positive integer or ``None``.
    """
    global _num_threads
    value = None if n is None else _check_threads(n)
    if value is None:
        _forget_cores()
    with _lock:
        _num_threads = value


def get_num_threads() -> int:
    """Return the thread count the CPU backends use for the next call.

    With no count chosen (no :func:`set_num_threads`, no ``OMP_NUM_THREADS``)
    this is every core the process may use, and each parallel region starts no
    more threads than the cores other processes leave free (see
    :func:`_watch_load`); the split of the work, and so every result, follows
    the number returned here.
    """
    n = _num_threads
    if n is None:
        n = _threads_from_env()
    if n is not None:
        if _team_limit:
            _set_team_limit(0)
        if n > 1 and (n != _region_threads or _region_pending):
            _measure_region(n)
        return n
    n = _cpu_count()
    if n > 1:
        if _adaptive and time.monotonic() >= _watch_next:
            _watch_load(n)
        if n != _region_threads or _region_pending:
            _measure_region(n)
    return n


# --- the team on a shared machine ---------------------------------------------------------------
# A parallel region waits for its slowest thread. When other processes keep the cores busy, a
# thread the OS has descheduled holds every region up by a time slice, and two threads on two
# busy cores run slower than one. So with no thread count chosen, parconv reads how many tasks
# are runnable besides its own (the run queue in /proc/loadavg, less this process's running
# threads) and caps each region's team at the cores left free. The cap changes who takes the
# chunks, never how the work is split: the results have the same bits whatever the load.

_LOAD_EVERY_S = 0.03  # seconds between readings of the run queue
_LOAD_READINGS = 3  # the cap follows the least (where idle threads spin: the most) busy of the last readings
_LOADAVG = "/proc/loadavg"  # tests point these at fakes
_TASKS = "/proc/self/task"

_adaptive = os.name == "posix"  # off for good once /proc cannot be read
_watch_next = 0.0
_readings: list = []
_team_limit = 0  # the cap set on the kernel modules now (0: none)


def _others_running(n: int = 1) -> int | None:
    """Runnable tasks on the machine that are not this process's threads; None without /proc.

    Where even counting every runnable task but the caller as another's would leave ``n`` cores
    free, returns 0 without reading this process's threads (one file each, and a process that
    imported torch has dozens).
    """
    try:
        with open(_LOADAVG, "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None
    if running <= 1 or (os.cpu_count() or 1) - (running - 1) >= n:  # no cap could follow
        return 0
    ours = 0
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        end = stat.rfind(b")")
        if stat[end + 2:end + 3] == b"R":
            ours += 1
    return max(0, running - ours)


def _watch_load(n: int) -> None:
    """Read the run queue and set the regions' team cap for ``n`` default threads."""
    global _adaptive, _watch_next
    _watch_next = time.monotonic() + _LOAD_EVERY_S
    others = _others_running(n)
    if others is None:
        _adaptive = False
        if _team_limit:
            _set_team_limit(0)
        return
    _readings.append(others)
    del _readings[:-_LOAD_READINGS]
    # busy tasks are spread over every online core; those left free are this process's to use.
    # Sleeping idle threads cost nothing while the cap is lifted too early, so the least busy reading
    # decides; spinning ones (the user's choice, or a runtime that torch loaded first) burn a core
    # after every region, so there the busiest reading decides.
    free = (os.cpu_count() or n) - (max(_readings) if _threads_spin() else min(_readings))
    limit = 0 if free >= n else max(1, free)
    if limit != _team_limit:
        _set_team_limit(limit)


_spin: list = []  # whether idle OpenMP threads spin in this process, decided once


def _threads_spin() -> bool:
    """Whether this process's idle OpenMP threads spin between regions (not parconv's passive default)."""
    if not _spin:
        from ._ext import WAIT_POLICY

        spins = WAIT_POLICY.get("policy") != "PASSIVE"  # parconv's default sleeps
        if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
            spins = False
        count = os.environ.get("GOMP_SPINCOUNT", "").strip()
        if count.isdigit() and int(count) == 0:
            spins = False
        _spin.append(spins)
    return _spin[0]


def _set_on_modules(setter: str, value) -> None:
    """Call ``setter(value)`` on every chosen kernel module that has it (a build from before a
    setter keeps its full teams)."""
    from ._ext import DISPATCH

    for module in DISPATCH.values():
        f = getattr(module, setter, None)
        if f is not None:
            f(value)


def _set_team_limit(limit: int) -> None:
    """Cap every chosen kernel module's parallel regions at ``limit`` threads (0: no cap)."""
    global _team_limit
    _set_on_modules("_set_team_limit", limit)
    _team_limit = limit


# --- calls too small for a team ----------------------------------------------------------------
# Starting a parallel region wakes the idle threads (they sleep under parconv's passive wait
# policy) and joins them: tens of microseconds on a virtual machine, where a layer at batch 1
# takes as long in all. parconv measures that cost for each thread count it runs, on free cores,
# and each kernel call starts only as many threads as its estimated work pays for (pc_common.h's
# pc_cap). Like the cap above this changes who takes the chunks, never the split: the bits stay
# the same.

_REGION_REPEAT = 15  # empty regions timed per probe; the median counts
_REGION_PROBES = 3  # probes per thread count, _REGION_EVERY_S apart: the largest counts (a probe
_REGION_EVERY_S = 1.0  # while another thread spins on the other core, e.g. a BLAS's, reads low)
_REGION_MAX_NS = 1e6  # a probe above this ran beside something busy: it is taken again
REGION_PAYBACK = 2.0  # pc_common.h's PC_REGION_PAYBACK: region starts a thread's share must be worth
_region_costs: dict = {}  # thread count -> (largest start cost probed, in ns; probes taken)
_region_threads = 0  # the thread count the kernel modules' region cost is for
_region_ns = 0.0
_region_next = 0.0  # no probe before this time.monotonic()
_region_pending = False  # the current thread count still has probes to take


def _measure_region(n: int) -> None:
    """Give the kernel modules what a region of ``n`` threads costs to start, probing it (at most
    every _REGION_EVERY_S seconds, _REGION_PROBES times) where no other process keeps cores busy:
    their time slices would count as wake-ups. 0 (full teams) until a probe succeeds."""
    global _region_threads, _region_ns, _region_next, _region_pending
    cost, probes = _region_costs.get(n, (0.0, 0))
    now = time.monotonic()
    if probes < _REGION_PROBES and now >= _region_next:
        _region_next = now + _REGION_EVERY_S
        from ._ext import _threads

        probe = getattr(_threads, "region_start_ns", None)  # None: a build from before the probe
        if probe is None:
            probes = _REGION_PROBES
        elif not (_others_running(n) if _adaptive else 0):
            ns = float(probe(n, _REGION_REPEAT))  # holds the GIL: no new kernel call starts meanwhile
            if ns <= _REGION_MAX_NS:
                cost = max(cost, ns)
                probes += 1
        _region_costs[n] = (cost, probes)
    if n != _region_threads or cost != _region_ns:
        _set_on_modules("_set_region_ns", cost)
        _region_threads, _region_ns = n, cost
    _region_pending = probes < _REGION_PROBES


def region_start_ns() -> float:
    """What starting a parallel region of the current thread count was measured to cost (ns; 0 before
    the first parallel call, and with one thread)."""
    return _region_ns if _region_threads == get_num_threads() else 0.0


def team_limit() -> int:
    """The cap on the threads a parallel region starts now, 0 when there is none (for ``parconv info``)."""
    return _team_limit


@contextlib.contextmanager
def num_threads(n: int | None):
    """Context manager that sets the thread count inside a ``with`` block.

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.num_threads(1):
    ...     pc.get_num_threads()
    1
    """
    global _num_threads
    value = None if n is None else _check_threads(n)
    previous = _num_threads
    with _lock:
        _num_threads = value
    try:
        yield
    finally:
        with _lock:
            _num_threads = previous


def _check_precision(precision, name: str = "precision") -> str:
    if not isinstance(precision, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, CONV_PRECISIONS))}, "
                        f"got {type(precision).__name__} {precision!r}")
    if precision not in CONV_PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, CONV_PRECISIONS))}, got {precision!r}")
    return precision


def set_conv_precision(precision: str) -> None:
    """Choose how accurately the CPU backend computes 3x3 stride-1 convolutions.

    parconv's counterpart of ``torch.set_float32_matmul_precision``: faster
    algorithms round more, and the setting says how much rounding is acceptable.
    It applies to the ``openmp`` backend (the ``numpy`` reference and the
    ``opencl`` kernels always sum directly) and is read at every call.

    Parameters
    ----------
    precision : {"highest", "high", "medium"}
        ``"highest"``: direct summation everywhere, the results of the direct
        kernels (no Winograd). ``"high"`` (the default): Winograd F(2x2, 3x3) or
        direct summation in the forward, F(4x4, 3x3) for the gradients dx
        and dw, whose error (a few times float32 rounding) reaches no ReLU's
        decision, and for forwards under :func:`parconv.no_grad` (inference),
        which no gradient follows. ``"medium"``: F(4x4, 3x3) in the forward as well, the
        fastest; its forward error (up to 8e-6 of a layer's largest output)
        flips ReLUs whose input lies that close to zero, and BatchNorm in training mode can turn one
        flip into a gradient error of 1e-2 (see the docs' "Convolution
        precision" section for the measured errors).

    Raises
    ------
    TypeError
        If ``precision`` is not a string.
    ValueError
        If it is not one of the values above.
    """
    global _conv_precision
    value = _check_precision(precision)
    with _lock:
        _conv_precision = value


def get_conv_precision() -> str:
    """Return the convolution precision the CPU backend uses for the next call
    (``"highest"``, ``"high"`` or ``"medium"``; see :func:`set_conv_precision`)."""
    return _conv_precision


@contextlib.contextmanager
def conv_precision(precision: str):
    """Context manager that sets the convolution precision inside a ``with`` block
    (see :func:`set_conv_precision`).

    Examples
    --------
    >>> import parconv as pc
    >>> with pc.conv_precision("highest"):
    ...     pc.get_conv_precision()
    'highest'
    >>> pc.get_conv_precision()
    'high'
    """
    global _conv_precision
    value = _check_precision(precision)
    previous = _conv_precision
    with _lock:
        _conv_precision = value
    try:
        yield
    finally:
        with _lock:
            _conv_precision = previous


def get_default_backend_name() -> str:
    """Name of the process default backend (``set_backend`` > ``PARCONV_BACKEND`` > best CPU)."""
    if _default_backend is not None:
        return _default_backend
    env = os.environ.get("PARCONV_BACKEND", "").strip()
    if env:
        return env
    from .backends import _best_cpu_backend

    return _best_cpu_backend()


def set_backend(name: str | None) -> None:
    """Set the process default backend by name (``None`` restores the default).

    The backend is loaded immediately, so an unknown or unavailable name fails
    here rather than at the first layer.
    """
    global _default_backend
    if name is None:
        _default_backend = None
        return
    from .backends import get

    backend = get(name)
    _default_backend = backend.name
