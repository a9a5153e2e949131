"""OpenCL kernels stay within a device's local-memory and work-group limits, whatever its type.

A stand-in device object describes a device that is not here (32 KiB of local memory, as
Oclgrind simulates; a GPU allowing 64 work-items per group); the configuration made for
it is built on the device that is here, and every kernel's local memory
(``CL_KERNEL_LOCAL_MEM_SIZE``, static plus the per-launch buffers) must fit the stand-in's
limit while the results still agree with the NumPy oracle.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from parconv import backends  # noqa: E402
from parconv.selftest import ATOL, RTOL  # noqa: E402

if "opencl" not in backends.available():
    pytest.skip(f"opencl backend unavailable: {backends.why_unavailable('opencl')}", allow_module_level=True)

from parconv.backends import opencl as ocl  # noqa: E402

REF = backends.get("numpy")
SMALL = 32 * 1024


def fake_device(kind="cpu", local_mem=SMALL, max_wg=4096, cus=2):
    return types.SimpleNamespace(type=cl.device_type.CPU if kind == "cpu" else cl.device_type.GPU,
                                 local_mem_size=local_mem, max_work_group_size=max_wg, max_compute_units=cus)


def agree(be, actual, expected, what):
    a = np.asarray(be.to_numpy(actual), dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, what
    np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(e).max(initial=0))), err_msg=what)


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("local_mem", [16 * 1024, SMALL, 64 * 1024])
def test_device_config_fits_the_reported_limits(kind, local_mem):
    cfg = ocl.device_config(fake_device(kind, local_mem, max_wg=64), kind=kind)
    assert ocl._gemm_local_bytes(cfg.gemm_bm, cfg.gemm_bn, cfg.gemm_bk) <= local_mem - ocl.LOCAL_RESERVE
    assert cfg.local_budget <= local_mem - ocl.LOCAL_RESERVE
    assert max(cfg.tile_wg, cfg.red_wg, cfg.elem_wg) <= 64
    assert cfg.local_mem == local_mem


def _launch_sizes(be, monkeypatch):
    """Record (kernel, bytes of local memory incl. static) of every checked launch."""
    seen = []
    check = be._check_local

    def spy(name, *nfloats):
        seen.append((name, be._static_local.get(name, 0) + sum(4 * max(1, n) for n in nfloats)))
        check(name, *nfloats)

    monkeypatch.setattr(be, "_check_local", spy)
    return seen


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_kernels_fit_32k_of_local_memory_and_stay_right(kind, monkeypatch):
    dev = backends.get("opencl").device
    max_wg = min(64, int(dev.max_work_group_size))
    be = ocl.OpenCLBackend(config=ocl.device_config(fake_device(kind, SMALL, max_wg), kind=kind))
    assert be.local_mem_limit == SMALL
    info = cl.kernel_work_group_info
    for name, k in be._k.items():
        assert k.get_work_group_info(info.LOCAL_MEM_SIZE, be.device) <= SMALL, name
    seen = _launch_sizes(be, monkeypatch)
    rng = np.random.default_rng(0)
    f32 = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    for n, c, o, h, k, s, p in ((2, 16, 24, 20, 7, 1, 3), (2, 8, 40, 17, 3, 1, 1), (1, 5, 9, 15, 5, 2, 2)):
        x, w, b = f32(n, c, h, h), f32(o, c, k, k, scale=1 / math.sqrt(c * k * k)), f32(o)
        X, W = be.asarray(x), be.asarray(w)
        y = be.conv2d_forward(X, W, be.asarray(b), s, p)
        agree(be, y, REF.conv2d_forward(f64(x), f64(w), f64(b), s, p), f"conv K={k} y")
        dy = f32(*y.shape)
        got = be.conv2d_backward(X, W, be.asarray(dy), s, p)
        for g, e, what in zip(got, REF.conv2d_backward(f64(x), f64(w), f64(dy), s, p), ("dx", "dw", "db")):
            agree(be, g, e, f"conv K={k} {what}")
        yp, _ = be.conv2d_relu_maxpool2d_forward(X, W, be.asarray(b), s, p, 2, 2)
        zp, _ = REF.maxpool2d_forward(REF.conv2d_forward(f64(x), f64(w), f64(b), s, p), 2, 2)
        agree(be, yp, np.maximum(zp, 0), f"fused K={k}")
    for n, f, g in ((100, 300, 70), (10, 4000, 10), (3, 7, 130)):
        x, w, b = f32(n, f), f32(g, f, scale=1 / math.sqrt(f)), f32(g)
        X, W = be.asarray(x), be.asarray(w)
        agree(be, be.linear_forward(X, W, be.asarray(b)), f64(x) @ f64(w).T + f64(b), f"linear {n}x{f}x{g}")
        dy = f32(n, g)
        got = be.linear_backward(X, W, be.asarray(dy))
        for gg, e, what in zip(got, REF.linear_backward(f64(x), f64(w), f64(dy)), ("dx", "dw", "db")):
            agree(be, gg, e, f"linear {what}")
    assert {name for name, _ in seen} == set(ocl._DYNAMIC_LOCAL_KERNELS)
    assert max(nbytes for _, nbytes in seen) <= SMALL
    # what the driver itself reports once the per-launch buffers are set
    for name in ocl._DYNAMIC_LOCAL_KERNELS:
        assert be._k[name].get_work_group_info(info.LOCAL_MEM_SIZE, be.device) <= SMALL, name


def test_a_launch_beyond_the_local_memory_is_refused():
    be = ocl.OpenCLBackend(config=ocl.device_config(fake_device("cpu", SMALL)))
    with pytest.raises(RuntimeError, match=r"conv2d_direct would need \d+ B of local memory"):
        be._check_local("conv2d_direct", SMALL // 4 - 8, 9)


def test_a_kernel_work_group_limit_below_the_device_maximum_shrinks_the_groups(monkeypatch):
    """A driver may allow a kernel fewer work-items than the device: the groups follow the kernel."""
    real = cl.Kernel.get_work_group_info

    def capped(self, param, device):
        value = real(self, param, device)
        return min(value, 32) if param == cl.kernel_work_group_info.WORK_GROUP_SIZE else value

    monkeypatch.setattr(cl.Kernel, "get_work_group_info", capped)
    dev = backends.get("opencl").device
    be = ocl.OpenCLBackend(config=ocl.device_config(dev, kind="gpu"))
    assert max(be.config.tile_wg, be.config.red_wg, be.config.elem_wg) <= 32
    assert f"-DRED_WG={be.config.red_wg}" in be.build_options
    rng = np.random.default_rng(1)
    logits, labels = rng.standard_normal((300, 7)).astype(np.float32), rng.integers(0, 7, 300).astype(np.int32)
    loss, _ = be.softmax_cross_entropy_forward(be.asarray(logits), be.asarray(labels, np.int32))
    assert math.isclose(loss, REF.softmax_cross_entropy_forward(logits.astype(np.float64), labels)[0], rel_tol=1e-5)


def test_the_configuration_style_can_be_chosen_by_environment(monkeypatch):
    """PARCONV_OPENCL_CONFIG picks the CPU- or GPU-style tiles (CI runs both on Oclgrind's device)."""
    monkeypatch.setenv("PARCONV_OPENCL_CONFIG", "gpu")
    assert ocl.OpenCLBackend().config.tile_wg > 1
    monkeypatch.setenv("PARCONV_OPENCL_CONFIG", "cpu")
    assert ocl.OpenCLBackend().config.tile_wg == 1
    monkeypatch.setenv("PARCONV_OPENCL_CONFIG", "fast")
    with pytest.raises(ValueError, match="PARCONV_OPENCL_CONFIG must be 'cpu' or 'gpu'"):
        ocl.OpenCLBackend()
