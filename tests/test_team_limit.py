"""The team cap on a shared machine: fewer threads take the same chunks, so the bits never change.

With no thread count chosen, parconv caps each parallel region's team at the cores other
processes leave free (``parconv._config._watch_load``). The work split still follows the thread
count, so a capped run must give the bits of an uncapped one, op by op and through whole
training steps.
"""

import contextlib
import os

import numpy as np
import pytest

import parconv as pc
from parconv import _config

pytestmark = pytest.mark.skipif("openmp" not in pc.available_backends(), reason="needs the openmp backend")


@contextlib.contextmanager
def capped(limit):
    """Every chosen kernel module's regions capped at ``limit`` threads (the Python-side state untouched)."""
    from parconv._ext import DISPATCH

    for module in DISPATCH.values():
        module._set_team_limit(limit)
    try:
        yield
    finally:
        for module in DISPATCH.values():
            module._set_team_limit(0)


def _batch(net, n, seed):
    rng = np.random.default_rng(seed)
    if net == "mlp":
        return rng.standard_normal((n, 784)).astype(np.float32), rng.integers(0, 10, n)
    if net in ("cnn-mnist", "lenet5", "general"):
        return rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n)
    return rng.standard_normal((n, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, n)


def _model(net):
    rng = np.random.default_rng(0)
    if net == "mlp":
        return pc.Sequential(pc.Linear(784, 512, rng=rng), pc.ReLU(), pc.Linear(512, 512, rng=rng), pc.ReLU(),
                             pc.Linear(512, 10, rng=rng), backend="openmp")
    if net == "general":  # grouped, dilated, rectangular and strided: the general conv kernels
        return pc.Sequential(pc.Conv2d(1, 8, (3, 5), padding=(1, 2), rng=rng), pc.BatchNorm2d(8), pc.ReLU(),
                             pc.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2, rng=rng), pc.ReLU(),
                             pc.Conv2d(8, 16, 3, stride=2, padding=1, rng=rng), pc.AvgPool2d(2), pc.Flatten(),
                             pc.Linear(16 * 7 * 7, 10, rng=rng), backend="openmp")
    return pc.models.build(net, backend="openmp", rng=rng)


def _steps(net, n, steps=2, eval_batch=None):
    """Weights after ``steps`` SGD steps in training mode, and the eval-mode logits after them."""
    model = _model(net)
    opt = pc.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = pc.SoftmaxCrossEntropy()
    for s in range(steps):
        x, y = _batch(net, n, s)
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
    out = {k: np.array(v) for k, v in model.state_dict().items()}
    model.eval()
    out["eval logits"] = pc.to_numpy(model(_batch(net, eval_batch or n, 99)[0])).copy()
    return out


@pytest.mark.parametrize("net, n", [("cnn-mnist", 32), ("lenet5", 16), ("vgg-small", 8), ("resnet20", 8),
                                    ("mobilenet-small", 16), ("mlp", 64), ("general", 16)])
@pytest.mark.parametrize("threads, limit", [(2, 1), (3, 2)])
def test_a_capped_team_gives_the_uncapped_bits(net, n, threads, limit):
    with pc.num_threads(threads):
        want = _steps(net, n)
        with capped(limit):
            got = _steps(net, n)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@contextlib.contextmanager
def region_cost(ns):
    """Every chosen kernel module told that starting a region costs ``ns`` (restored after)."""
    from parconv._ext import DISPATCH

    old = {name: module._get_region_ns() for name, module in DISPATCH.items()}
    for module in DISPATCH.values():
        module._set_region_ns(ns)
    try:
        yield
    finally:
        for name, module in DISPATCH.items():
            module._set_region_ns(old[name])


@pytest.mark.parametrize("net, n", [("cnn-mnist", 32), ("lenet5", 16), ("vgg-small", 8), ("resnet20", 8),
                                    ("mobilenet-small", 16), ("mlp", 64), ("general", 16)])
@pytest.mark.parametrize("threads", [2, 3])
def test_calls_too_small_for_a_team_give_the_full_team_bits(net, n, threads):
    # a region cost of 1 s sends every call to one thread, 0 gives every call its whole team
    with pc.num_threads(threads):
        with region_cost(0):
            want = _steps(net, n)
        with region_cost(1e9):
            got = _steps(net, n)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_call_starts_a_thread_per_payback_of_its_work():
    from parconv._ext import DISPATCH

    payback = _config.REGION_PAYBACK
    for name, module in DISPATCH.items():
        with capped(0), region_cost(10_000):
            assert module._team_for(4, 0) == 4, name  # no estimate: the whole team
            assert module._team_for(4, 1_000) == 1, name
            assert module._team_for(4, payback * 10_000 * 1.99) == 1, name
            assert module._team_for(4, payback * 10_000 * 2.01) == 2, name
            assert module._team_for(4, payback * 10_000 * 3.5) == 3, name
            assert module._team_for(4, 1e12) == 4, name
            assert module._team_for(1, 1e12) == 1, name
            with capped(2):
                assert module._team_for(4, 1e12) == 2, name  # the load cap still bounds it
        with capped(0), region_cost(0):
            assert module._team_for(4, 1_000) == 4, name  # cost unknown: the whole team


@pytest.mark.region_sizing
def test_the_region_cost_is_probed_on_free_cores_and_the_largest_probe_counts(fake_proc, monkeypatch):
    from parconv._ext import DISPATCH, _threads

    readings = iter([30_000.0, 5e6, 50_000.0, 8_000.0])
    calls = []

    def probe(n, repeat):
        calls.append(n)
        return next(readings)

    monkeypatch.setattr(_threads, "region_start_ns", probe)
    for name, value in [("_region_costs", {}), ("_region_threads", 0), ("_region_ns", 0.0),
                        ("_region_next", 0.0), ("_region_pending", False), ("_REGION_EVERY_S", 0.0)]:
        monkeypatch.setattr(_config, name, value)
    with region_cost(0):
        fake_proc(running=9)  # busy neighbours: a wake-up would count their time slices
        _read(2)
        assert calls == []
        assert _config.region_start_ns() == 0.0
        assert {m._get_region_ns() for m in DISPATCH.values()} == {0.0}  # full teams meanwhile
        fake_proc(running=1)
        _read(1)
        assert calls == [4]
        assert _config._region_ns == 30_000.0
        assert {m._get_region_ns() for m in DISPATCH.values()} == {30_000.0}
        _read(1)
        assert calls == [4, 4]
        assert _config._region_ns == 30_000.0  # 5 ms: beside something busy, taken again
        _read(6)
        assert calls == [4, 4, 4, 4]  # three probes that count, then no more
        assert _config.region_start_ns() == 50_000.0  # the largest: a probe while the other core spins reads low
        assert {m._get_region_ns() for m in DISPATCH.values()} == {50_000.0}
        with pc.num_threads(1):
            assert _config.region_start_ns() == 0.0  # one thread starts no team
        assert calls == [4, 4, 4, 4]


def test_region_start_ns_checks_its_arguments():
    from parconv._ext import _threads

    assert _threads.region_start_ns(1) == 0.0
    if _threads.openmp_enabled():
        assert 0.0 < _threads.region_start_ns(2, 3, 0.0) < 1e9
    for bad in [dict(num_threads=0), dict(num_threads=2, repeat=0), dict(num_threads=2, repeat=5000),
                dict(num_threads=2, gap_ns=-1.0), dict(num_threads=2, gap_ns=float("nan"))]:
        with pytest.raises(ValueError, match=next(k for k in bad if k != "num_threads" or len(bad) == 1)):
            _threads.region_start_ns(**bad)
    from parconv._ext import DISPATCH

    for module in DISPATCH.values():
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="ns"):
                module._set_region_ns(bad)


def test_int8_and_bf16_kernels_give_the_uncapped_bits_under_a_cap():
    x, _ = _batch("resnet20", 8, 0)
    with pc.num_threads(2):
        model = _model("resnet20")
        model.eval()
        q = pc.quantization.quantize(model, x)
        want_q = pc.to_numpy(q(x)).copy()
        model.train()
        with pc.autocast("bf16"):
            want_b = pc.to_numpy(model(x)).copy()
        with capped(1):
            got_q = pc.to_numpy(q(x)).copy()
            with pc.autocast("bf16"):
                got_b = pc.to_numpy(model(x)).copy()
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(got_b, want_b)


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """A fake /proc/loadavg and /proc/self/task; returns set(running=, ours_running=, ours_sleeping=)."""
    loadavg = tmp_path / "loadavg"
    tasks = tmp_path / "task"
    tasks.mkdir()

    def set_(running, ours_running=1, ours_sleeping=1):
        loadavg.write_text(f"0.50 0.40 0.30 {running}/321 4242\n")
        for f in tasks.iterdir():
            (f / "stat").unlink()
            f.rmdir()
        for i in range(ours_running + ours_sleeping):
            (tasks / str(100 + i)).mkdir()
            state = "R" if i < ours_running else "S"
            (tasks / str(100 + i) / "stat").write_text(f"{100 + i} (python (x)) {state} 1 2 3\n")

    monkeypatch.setattr(_config, "_LOADAVG", str(loadavg))
    monkeypatch.setattr(_config, "_TASKS", str(tasks))
    monkeypatch.setattr(_config, "_adaptive", True)
    monkeypatch.setattr(_config, "_spin", [False])  # parconv's passive default, whatever loaded libgomp here
    monkeypatch.setattr(_config, "_readings", [])
    monkeypatch.setattr(_config, "_num_threads", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_config, "_cores", 4)
    monkeypatch.setattr(_config.os, "cpu_count", lambda: 4)
    yield set_
    _config._set_team_limit(0)


def _read(times=_config._LOAD_READINGS):
    for _ in range(times):
        _config._watch_next = 0.0
        assert pc.get_num_threads() == 4  # the split never follows the load


def test_busy_neighbours_cap_the_team_and_a_quiet_machine_lifts_the_cap(fake_proc):
    from parconv._ext import DISPATCH

    fake_proc(running=1)
    _read()
    assert _config.team_limit() == 0
    fake_proc(running=4, ours_running=1)  # three others on four cores: one left free
    _read()
    assert _config.team_limit() == 1
    assert {m._get_team_limit() for m in DISPATCH.values()} == {1}
    fake_proc(running=3, ours_running=2)  # our own running threads are not neighbours
    _read()
    assert _config.team_limit() == 3
    fake_proc(running=1)
    _read()
    assert _config.team_limit() == 0
    assert {m._get_team_limit() for m in DISPATCH.values()} == {0}


def test_one_quiet_reading_does_not_lift_the_cap_nor_a_blip_set_it(fake_proc):
    fake_proc(running=1)
    _read()
    fake_proc(running=9)  # a blip: one reading of a full run queue
    _read(1)
    assert _config.team_limit() == 0
    _read(_config._LOAD_READINGS - 1)
    assert _config.team_limit() == 1
    fake_proc(running=1)
    _read(1)
    assert _config.team_limit() == 0  # the least busy reading decides: free cores are used at once


def test_a_chosen_thread_count_is_never_capped(fake_proc, monkeypatch):
    fake_proc(running=9)
    _read()
    assert _config.team_limit() == 1
    from parconv._ext import DISPATCH

    assert {m._get_team_limit() for m in DISPATCH.values()} == {1}
    with pc.num_threads(2):
        assert pc.get_num_threads() == 2
        assert _config.team_limit() == 0
        assert {m._get_team_limit() for m in DISPATCH.values()} == {0}  # the kernels' caps, not only the record
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _config._set_team_limit(1)
    assert pc.get_num_threads() == 3
    assert _config.team_limit() == 0


def test_without_proc_the_team_is_left_alone(fake_proc, monkeypatch):
    fake_proc(running=9)
    monkeypatch.setattr(_config, "_LOADAVG", os.devnull + "-missing")
    _read(1)
    assert _config.team_limit() == 0
    assert _config._adaptive is False


def test_with_spinning_idle_threads_the_busiest_reading_decides(fake_proc, monkeypatch):
    # spinning threads burn a core after every region: engage at the first busy reading, lift only
    # when every recent reading is quiet
    monkeypatch.setattr(_config, "_spin", [True])
    fake_proc(running=1)
    _read()
    fake_proc(running=9)
    _read(1)
    assert _config.team_limit() == 1
    fake_proc(running=1)
    _read(_config._LOAD_READINGS - 1)
    assert _config.team_limit() == 1
    _read(1)
    assert _config.team_limit() == 0


@pytest.mark.parametrize("env, spins", [({}, False), ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
                                        ({"GOMP_SPINCOUNT": "5000"}, True), ({"GOMP_SPINCOUNT": "0"}, False),
                                        ({"OMP_WAIT_POLICY": "passive"}, False)])
def test_the_watcher_knows_whether_idle_threads_spin(env, spins):
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import parconv\nfrom parconv import _config\nprint(_config._threads_spin())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(pc.__file__)))
    out = subprocess.run([sys.executable, "-P", "-c", code], env=dict(base, **env, PYTHONPATH=root),
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(spins), (env, out.stdout, out.stderr)
