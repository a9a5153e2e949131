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
