"""Mesa rusticl on llvmpipe: a real driver that is wrong in one tile style, and the device guard of ``fit``.

Debian's ``mesa-opencl-icd`` (rusticl, ``RUSTICL_ENABLE=llvmpipe``) computes some tiles of the
CPU-style configuration wrongly (a 16 -> 10 channel 7x7 convolution returns zeros, cnn-mnist's
weight gradient at batch 50 is wrong) and the GPU-style ones right. The check runs in a process of
its own with rusticl as its only ICD (``OCL_ICD_VENDORS``), so the rest of the suite keeps its device;
it is skipped where rusticl is not installed.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyopencl")

_RUSTICL = ctypes.util.find_library("RusticlOpenCL")

_RUSTICL_SCRIPT = textwrap.dedent("""
    import warnings
    import numpy as np
    import parconv as pc
    from parconv.backends import opencl as ocl
    from parconv.backends.numpy_ref import NumpyBackend
    from parconv.selftest import run_selftest

    import sys
    try:
        be = pc.backends.get("opencl")
    except pc.backends.BackendUnavailableError as exc:
        print(exc)
        sys.exit(77)
    if be.device.platform.name.strip() != "rusticl":
        sys.exit(77)
    ref, rng = NumpyBackend(), np.random.default_rng(0)
    style = lambda: getattr(be, "config_style", "cpu")  # noqa: E731 - the tile style the backend runs now

    def bad(got, want):
        err = np.abs(be.to_numpy(got) - want)
        return int(np.sum(~(err <= 1e-5 * max(1.0, np.abs(want).max()) + 1e-4 * np.abs(want))))

    def wrong_now():
        # cnn-mnist's weight gradient at batch 50, and a 16 -> 10 channel 7x7 convolution
        x, w = rng.standard_normal((50, 1, 28, 28)), rng.standard_normal((32, 1, 3, 3)) / 3
        dy = rng.standard_normal((50, 32, 26, 26))
        f = lambda a: be.asarray(a.astype(np.float32))
        dw = be.conv2d_backward(f(x), f(w), f(dy), 1, 0, False, False)[1]
        x7, w7 = rng.standard_normal((2, 16, 20, 20)), rng.standard_normal((10, 16, 7, 7)) / 28
        y7 = be.conv2d_forward(f(x7), f(w7), None, 1, 3)
        x, w, dy, x7, w7 = (np.asarray(a, np.float32).astype(np.float64) for a in (x, w, dy, x7, w7))
        return bad(dw, ref.conv2d_backward(x, w, dy, 1, 0, False, False)[1]), bad(y7, ref.conv2d_forward(x7, w7, None, 1, 3))

    def fit_warnings(model, x, y, batch):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, epochs=1, batch_size=batch, verbose=False)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    assert style() == "cpu"
    gpu_ok = run_selftest(ocl.OpenCLBackend(config=ocl.device_config(be.device, "gpu")), n_random=0)
    cpu_ok = run_selftest(be, n_random=0)
    dw_bad, k7_bad = wrong_now()
    assert gpu_ok, "the GPU-style configuration must pass the selftest on rusticl"
    if k7_bad:
        assert not cpu_ok, "the selftest must catch the wrong 7x7 convolution"

    # the probe of the run alone (fixed checks passed) catches the weight gradient at batch 50
    be._fixed_failures = lambda: []
    x, y = pc.datasets.load_mnist("test")
    msgs = fit_warnings(pc.cli.build_cnn(32, backend="opencl"), x[:100], y[:100], 50)
    if dw_bad:
        assert style() == "gpu", msgs
        assert any("conv2d_relu_maxpool2d_backward result 1" in m and "switched to the gpu-style" in m
                   for m in msgs), msgs
    else:
        assert style() == "cpu" and not msgs, msgs
    assert wrong_now() == (0, 0), "the configuration fit left must compute both right"

    # a fresh start: the fixed checks alone catch the 7x7 convolution
    del be._fixed_failures
    ocl._verified.clear()
    be.config, be.config_style = ocl.device_config(be.device, "cpu"), "cpu"
    be._build_within_limits()
    msgs = fit_warnings(pc.Sequential(pc.Flatten(), pc.Linear(4, 2), backend="opencl"),
                        np.zeros((8, 4), np.float32), np.zeros(8, np.int64), 4)
    if k7_bad:
        assert style() == "gpu" and any("conv2d_forward K=7 x(2, 16" in m for m in msgs), msgs
    print("rusticl:", "cpu-style selftest", "passed" if cpu_ok else "FAILED", "| wrong dw/K=7 elements",
          (dw_bad, k7_bad), "| now", style())
""")


@pytest.mark.slow
@pytest.mark.skipif(_RUSTICL is None, reason="Mesa rusticl (Debian mesa-opencl-icd) is not installed")
def test_rusticl_cpu_style_is_switched_to_a_configuration_that_is_right(tmp_path):
    """The selftest catches the CPU style's wrong tiles, fit switches to the GPU style (the probe of the run alone
    catches the weight gradient at batch 50, the fixed checks alone the 7x7 convolution), and what it then runs is
    right."""
    import parconv

    home = os.path.dirname(os.path.dirname(os.path.abspath(parconv.__file__)))  # the parconv under test
    (tmp_path / "rusticl.icd").write_text(_RUSTICL + "\n")
    env = dict(os.environ, OCL_ICD_VENDORS=str(tmp_path), RUSTICL_ENABLE="llvmpipe", PARCONV_OPENCL_DEVICE="rusticl",
               PARCONV_OPENCL_CONFIG="cpu", PYTHONPATH=home)
    out = subprocess.run([sys.executable, "-P", "-c", "import parconv.cli\n" + _RUSTICL_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode == 77:
        pytest.skip(f"rusticl is installed but offers no device here: {out.stdout[-500:]}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout.splitlines()[-1])
