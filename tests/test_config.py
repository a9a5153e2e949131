"""The default thread count: OMP_NUM_THREADS when set, else the cores this process may run on."""

import os

import pytest

import parconv as pc
from parconv import _config

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs sched_setaffinity and at least two usable cores")


@pytest.fixture
def default_threads(monkeypatch):
    """No explicit thread count, no OMP_NUM_THREADS; the affinity mask is restored afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pc.set_num_threads(None)
    try:
        yield
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)
        pc.set_num_threads(None)


def test_environment_is_read_on_every_call(default_threads, monkeypatch):
    cores = pc.get_num_threads()
    assert cores == _config._cpu_count() >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")
    assert pc.get_num_threads() == 3
    for junk in ("", " ", "x", "0", "-2"):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert pc.get_num_threads() == cores
    with pc.num_threads(2):
        assert pc.get_num_threads() == 2
    assert pc.get_num_threads() == cores


@needs_affinity
def test_core_count_is_kept_until_set_num_threads_none(default_threads):
    cores = pc.get_num_threads()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    assert pc.get_num_threads() == cores  # read once, kept
    pc.set_num_threads(None)
    assert pc.get_num_threads() == 1


@needs_affinity
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_reads_its_own_core_count(default_threads):
    cores = pc.get_num_threads()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a narrower mask, then the count it sees
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            os.write(write, str(pc.get_num_threads()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = os.read(read, 16)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert got == b"1"
    assert pc.get_num_threads() == cores


# ---------------------------------------------------------------- cgroup CPU quota
def _fake_cgroup(tmp_path, monkeypatch, proc_lines, files):
    """A cgroup tree under tmp_path: ``files`` maps paths below the root to their text."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    monkeypatch.setattr(_config, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(_config, "_PROC_CGROUP", str(proc))
    _config._forget_cores()


@pytest.fixture
def affinity():
    """The cores this process may run on (the count before any quota)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    yield n
    _config._forget_cores()


def test_cgroup_v2_cpu_max_caps_the_default_threads(tmp_path, monkeypatch, default_threads, affinity):
    # a container limited to 1.5 CPUs: ceil(150000 / 100000) = 2, then min with the affinity mask
    _fake_cgroup(tmp_path, monkeypatch, ["0::/"], {"cpu.max": "150000 100000\n"})
    assert _config._cgroup_cpu_quota()[0] == 2
    assert pc.get_num_threads() == min(2, affinity)
    assert "cgroup cpu.max 150000/100000 -> 2" in _config._cpu_count_why()
    _fake_cgroup(tmp_path / "b", monkeypatch, ["0::/"], {"cpu.max": "50000 100000"})
    assert pc.get_num_threads() == 1  # half a CPU still runs one thread
    assert _config._cpu_count_why().startswith(f"affinity {affinity} core")


def test_cgroup_v2_nested_groups_take_the_smallest_quota(tmp_path, monkeypatch, default_threads, affinity):
    files = {"a/cpu.max": "100000 100000", "a/b/cpu.max": "max 100000", "cpu.max": "400000 100000"}
    _fake_cgroup(tmp_path, monkeypatch, ["0::/a/b"], files)
    assert _config._cgroup_cpu_quota()[0] == 1
    assert pc.get_num_threads() == 1


def test_cgroup_v1_cfs_quota(tmp_path, monkeypatch, default_threads, affinity):
    files = {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "100000", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
             "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}
    _fake_cgroup(tmp_path, monkeypatch, ["4:memory:/docker/x", "3:cpu,cpuacct:/docker/x"], files)
    assert _config._cgroup_cpu_quota()[0] == 1
    assert pc.get_num_threads() == 1
    assert "cpu.cfs_quota_us/cfs_period_us 100000/100000 -> 1" in _config._cpu_count_why()


@pytest.mark.parametrize("files", [
    {},                                                   # no cgroup files at all
    {"cpu.max": "max 100000"},                            # v2, no limit
    {"cpu.max": "garbage"},                               # unreadable numbers are ignored
    {"cpu.max": "0 100000"},
    {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},  # v1, no limit
])
def test_no_cgroup_quota_leaves_the_affinity_count(tmp_path, monkeypatch, default_threads, affinity, files):
    _fake_cgroup(tmp_path, monkeypatch, ["1:cpu:/", "0::/"], files)
    assert _config._cgroup_cpu_quota()[0] is None
    assert pc.get_num_threads() == affinity
    assert "no cgroup CPU quota" in _config._cpu_count_why()


def test_quota_above_the_affinity_mask_changes_nothing(tmp_path, monkeypatch, default_threads, affinity):
    _fake_cgroup(tmp_path, monkeypatch, ["0::/"], {"cpu.max": f"{100000 * (affinity + 3)} 100000"})
    assert pc.get_num_threads() == affinity


def test_info_says_how_the_thread_count_was_found(tmp_path, monkeypatch, default_threads, affinity, capsys):
    from parconv.cli import main

    _fake_cgroup(tmp_path, monkeypatch, ["0::/"], {"cpu.max": "100000 100000"})
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "threads: 1 (affinity" in out and "cgroup cpu.max 100000/100000 -> 1" in out, out
    assert "openmp wait policy:" in out, out


# ---------------------------------------------------------------- OpenMP wait policy
def _package_parent() -> str:
    """The folder holding the parconv these tests import (children run with ``-P``, so a source
    checkout in the working directory cannot shadow an installed build)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(pc.__file__)))


def _gomp_env_report(env_extra: dict, first: str = "") -> tuple[str, str]:
    """(libgomp's OMP_DISPLAY_ENV report, what parconv recorded) in a fresh interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra, OMP_DISPLAY_ENV="VERBOSE")
    code = (f"{first}\nimport os, parconv\nfrom parconv._ext import WAIT_POLICY, _threads  # _threads loads libgomp\n"
            "print(WAIT_POLICY['policy'], '|', WAIT_POLICY['source'], '|', os.environ.get('OMP_WAIT_POLICY'))")
    env["PYTHONPATH"] = _package_parent()
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stderr, out.stdout.strip()


def _spincount(report: str) -> int:
    import re

    m = re.search(r"GOMP_SPINCOUNT = '(\d+)'", report)
    assert m, report
    return int(m.group(1))


@pytest.mark.skipif(not pc.backends.why_unavailable("openmp") is None, reason="needs the OpenMP kernels")
def test_idle_openmp_threads_sleep_unless_the_user_asks_for_spinning():
    from parconv._ext import _threads

    if not _threads.openmp_enabled():
        pytest.skip("serial build")
    report, recorded = _gomp_env_report({})
    assert _spincount(report) == 0, report          # passive: no spinning between regions
    assert recorded.startswith("PASSIVE |") and recorded.endswith("| None"), recorded  # children keep their own default
    report, recorded = _gomp_env_report({"OMP_WAIT_POLICY": "ACTIVE"})
    assert _spincount(report) > 0 and "set by the user" in recorded
    report, recorded = _gomp_env_report({"GOMP_SPINCOUNT": "5000"})
    assert _spincount(report) == 5000 and "set by the user" in recorded


def test_torch_loaded_first_keeps_its_runtime_and_says_so():
    pytest.importorskip("torch")
    from parconv._ext import _threads

    if not _threads.openmp_enabled():
        pytest.skip("serial build")
    # torch and parconv share one libgomp: whichever loads it first settles the policy
    report, recorded = _gomp_env_report({}, first="import torch")
    assert _spincount(report) > 0, report
    assert "loaded before parconv" in recorded, recorded
    report, recorded = _gomp_env_report({"OMP_WAIT_POLICY": "PASSIVE"}, first="import torch")
    assert _spincount(report) == 0 and "set by the user" in recorded


def test_importing_parconv_settles_the_policy_before_torch_loads_the_shared_runtime():
    pytest.importorskip("torch")
    import subprocess
    import sys

    from parconv._ext import _threads

    if not _threads.openmp_enabled():
        pytest.skip("serial build")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    env["PYTHONPATH"] = _package_parent()
    out = subprocess.run([sys.executable, "-P", "-c", "import parconv\nimport torch\ntorch.ones(2).sum()"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert _spincount(out.stderr) == 0, out.stderr
