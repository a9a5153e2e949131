"""The OpenCL backend lets go of what it no longer needs: transfer records, programs, contexts."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from parconv import backends  # noqa: E402

if "opencl" not in backends.available():
    pytest.skip(f"opencl backend unavailable: {backends.why_unavailable('opencl')}", allow_module_level=True)

from parconv.backends import opencl as ocl  # noqa: E402


def test_transfer_log_keeps_totals_not_records_unless_asked():
    be = backends.get("opencl")
    log = be.transfers
    log.reset()
    x = np.arange(10, dtype=np.float32)
    for _ in range(500):
        be.to_numpy(be.asarray(x))
    assert (log.d2h_count, log.d2h_bytes, log.h2d_count, log.h2d_bytes) == (500, 500 * 40, 500, 500 * 40)
    assert log.device_to_host == [] and log.host_to_device == [] and log.d2h_reasons() == []
    with log.recording():
        be.to_numpy(be.asarray(x[:3]))
    assert log.d2h_reasons() == ["to_numpy"]
    assert [t.nbytes for t in log.host_to_device] == [12] and log.h2d_count == 1
    be.to_numpy(be.asarray(x))  # after the block: counted, not recorded
    assert log.record is False and log.d2h_count == 2 and len(log.device_to_host) == 1
    log.reset()
    assert log.d2h_count == 0 and log.device_to_host == []


def test_backends_on_one_device_share_its_context_and_programs():
    """A new backend builds nothing: the device's context, queue, pool and programs are made once."""
    first = ocl.OpenCLBackend()
    x = first.asarray(np.ones((2, 3, 6, 6), np.float32))
    first.to_numpy(first.conv2d_forward(x, first.zeros((4, 3, 3, 3)), None, 1, 1))
    gc.collect()
    programs = sum(len(v) for v in ocl._program_cache.values())
    contexts = len(ocl._program_cache)
    second = ocl.OpenCLBackend()
    assert second.context is first.context and second.queue is first.queue
    assert second.is_array(x)  # arrays move between backends of one device as they are
    np.testing.assert_array_equal(second.to_numpy(second.conv2d_forward(x, second.zeros((4, 3, 3, 3)), None, 1, 1)),
                                  np.zeros((2, 4, 6, 6), np.float32))
    del second
    gc.collect()
    assert len(ocl._program_cache) == contexts
    assert sum(len(v) for v in ocl._program_cache.values()) == programs


_CYCLES = """
import gc
import numpy as np
from parconv.backends.opencl import OpenCLBackend

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def cycle():
    be = OpenCLBackend()
    x = be.asarray(np.ones((4, 3, 8, 8), np.float32))
    be.to_numpy(be.linear_forward(be.reshape(be.conv2d_forward(x, be.zeros((5, 3, 3, 3)), None, 1, 1), (4, 320)),
                                  be.zeros((10, 320)), None))
    del be, x
    gc.collect()

for _ in range(2):
    cycle()
before = rss_mb()
for _ in range({n}):
    cycle()
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")
def test_backend_create_delete_cycles_keep_rss_flat():
    """200 create/use/delete cycles after a warm-up grow RSS by less than 10 MB (each leaked ~8 MB
    when every backend made its own context)."""
    out = subprocess.run([sys.executable, "-P", "-c", _CYCLES.format(n=200)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    growth = float(out.stdout.split()[-1])
    assert growth < 10, f"RSS grew {growth:.1f} MB over 200 backend cycles"
