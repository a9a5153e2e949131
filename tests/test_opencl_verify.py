"""A device that computes wrong results is refused loudly: ``OpenCLBackend.verify`` and ``parconv selftest``."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from parconv import backends  # noqa: E402

if "opencl" not in backends.available():
    pytest.skip(f"opencl backend unavailable: {backends.why_unavailable('opencl')}", allow_module_level=True)

from parconv.backends import opencl as ocl  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """The shared opencl backend with this process's record of verified devices emptied for the test."""
    monkeypatch.setattr(ocl, "_verified", set())
    return backends.get("opencl")


def test_verify_passes_quickly_and_runs_once_per_device_and_configuration(fresh, monkeypatch):
    calls = []
    real = type(fresh).conv2d_forward
    monkeypatch.setattr(fresh, "conv2d_forward", lambda *a: calls.append(1) or real(fresh, *a))
    t = time.perf_counter()
    fresh.verify()
    seconds = time.perf_counter() - t
    assert len(calls) == 2  # K=3 and K=7
    assert seconds < 2.0, f"verify took {seconds:.2f} s"
    fresh.verify()
    assert len(calls) == 2  # kept for the process


def _wrong(result):
    """The device array ``result`` with its first element changed in place."""
    host = np.asarray(result.get()).copy()
    host.flat[0] += 1.0
    result.set(host)
    return result


@pytest.mark.parametrize("method, op", [
    ("linear_forward", "linear_forward"),
    ("maxpool2d_forward", "maxpool2d_forward"),
])
def test_verify_names_the_device_and_the_wrong_op(fresh, monkeypatch, method, op):
    real = getattr(type(fresh), method)

    def broken(*args):
        out = real(fresh, *args)
        if isinstance(out, tuple):
            return (_wrong(out[0]),) + out[1:]
        return _wrong(out)

    monkeypatch.setattr(fresh, method, broken)
    with pytest.raises(RuntimeError) as info:
        fresh.verify()
    msg = str(info.value)
    assert fresh.device.name.strip() in msg and f"computes {op} wrongly" in msg and "PARCONV_OPENCL_DEVICE" in msg
    monkeypatch.setattr(fresh, method, real.__get__(fresh))
    fresh.verify()  # a failed check is not remembered as a pass; the repaired backend passes


def test_verify_catches_a_wrong_conv_with_k7_only(fresh, monkeypatch):
    """The K=7 case is checked on its own (rusticl returned garbage there and nowhere else)."""
    real = type(fresh).conv2d_forward

    def broken(x, w, b, stride, padding):
        out = real(fresh, x, w, b, stride, padding)
        return _wrong(out) if w.shape[2] == 7 else out

    monkeypatch.setattr(fresh, "conv2d_forward", broken)
    with pytest.raises(RuntimeError, match="computes conv2d_forward K=7 wrongly"):
        fresh.verify()


def test_selftest_fails_loudly_and_the_command_exits_nonzero(fresh, monkeypatch, capsys):
    from parconv.cli import main

    real = type(fresh).linear_forward
    monkeypatch.setattr(fresh, "linear_forward", lambda *a: _wrong(real(fresh, *a)))
    assert main(["selftest", "--backend", "opencl", "--random", "0"]) != 0
    out, err = capsys.readouterr()
    assert "FAILED" in out and "linear.y" in out
    assert "parconv selftest FAILED" in err and "linear.y" in err and "cannot be trusted" in err
