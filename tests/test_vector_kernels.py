"""Batch norm's vector plane sums (pc_norm.h), the Winograd weight gradient's dot GEMM
(pcw4_dot_gemm) and the F(2x2, 3x3) forward's blocks of several images at every ISA level,
each in its own process, against float64 NumPy.

Both change with the level: AVX-512 and AVX2 sum in vectors of doubles (floats for the
GEMM) of their own width, the baseline in four scalar lanes. Each level must stay within
float32 rounding of the float64 result and repeat bit for bit at a fixed thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import run_at_isa_level

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__))))

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from parconv._ext import _conv, _norm

    rng = np.random.default_rng(0)
    fails = []

    def check(name, got, want, tol):
        err = np.abs(np.asarray(got, np.float64) - want)
        if not np.all(err <= tol):
            i = int(np.argmax(err - tol))
            fails.append(f"{name}: max excess at {i}: got {np.ravel(got)[i]!r} want {np.ravel(want)[i]!r}")

    # batch norm: planes of every length around the vector steps (16 and 32 floats), the values
    # far from zero so the variance cancels unless the deviations are summed in double
    for N, C, L in ((3, 2, 1), (2, 3, 7), (4, 2, 15), (2, 2, 16), (3, 2, 17), (2, 3, 31), (2, 2, 32),
                    (3, 2, 33), (2, 2, 63), (5, 3, 64), (2, 4, 100), (4, 2, 1024)):
        x = (100.0 + rng.standard_normal((N, C, L)) * 0.01).astype(np.float32)
        w = rng.uniform(0.5, 1.5, C).astype(np.float32)
        b = rng.standard_normal(C).astype(np.float32)
        dy = rng.standard_normal((N, C, L)).astype(np.float32)
        x64 = x.astype(np.float64)
        m64 = x64.mean(axis=(0, 2))
        v64 = x64.var(axis=(0, 2))
        outs = []
        for threads in (2, 2, 1):
            y = np.empty_like(x)
            mean, invstd = np.empty(C, np.float32), np.empty(C, np.float32)
            _norm.batch_norm_forward_train(x, w, b, None, None, y, mean, invstd, 0.1, 1e-5, True, threads)
            dx, dw, db = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
            _norm.batch_norm_backward(x, w, dy, mean, invstd, dx, dw, db, True, threads, y)
            # the fused ReLU mask against the mask applied first
            g = np.where(y > 0, dy, np.float32(0))
            dx2, dw2, db2 = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
            _norm.batch_norm_backward(x, w, g, mean, invstd, dx2, dw2, db2, True, threads)
            if not (np.array_equal(dx, dx2) and np.array_equal(dw, dw2) and np.array_equal(db, db2)):
                fails.append(f"bn {(N, C, L)} threads {threads}: the fused mask differs from the mask applied first")
            outs.append((y, mean, invstd, dx, dw, db))
        if not all(np.array_equal(a, c) for a, c in zip(outs[0], outs[1])):
            fails.append(f"bn {(N, C, L)}: two runs at 2 threads differ")
        y, mean, invstd, dx, dw, db = outs[2]
        istd64 = 1.0 / np.sqrt(v64 + 1e-5)
        check(f"bn {(N, C, L)} mean", mean, m64, 1e-6 * np.abs(m64))
        check(f"bn {(N, C, L)} invstd", invstd, istd64, 1e-5 * istd64)
        xhat = (x64 - m64[None, :, None]) * istd64[None, :, None]
        y64 = np.maximum(xhat * w[None, :, None] + b[None, :, None], 0)
        check(f"bn {(N, C, L)} y", y, y64, 1e-3 + 1e-3 * np.abs(y64))  # xhat of values near 100: 1e-4 / 0.01
        g64 = np.where(y > 0, dy, 0).astype(np.float64)
        M = N * L
        sg = g64.sum(axis=(0, 2))
        sgx = (g64 * ((x64 - mean[None, :, None].astype(np.float64)) * invstd[None, :, None])).sum(axis=(0, 2))
        scale = np.sqrt(M) * np.abs(g64).max() + 1e-30
        check(f"bn {(N, C, L)} dbias", db, sg, 1e-6 * scale)
        check(f"bn {(N, C, L)} dweight", dw, sgx, 1e-4 * scale)
        dx64 = ((g64 - sg[None, :, None] / M) - ((x64 - mean[None, :, None]) * invstd[None, :, None])
                * (sgx[None, :, None] / M)) * (invstd * w)[None, :, None]
        check(f"bn {(N, C, L)} dx", dx, dx64, 1e-3 * np.abs(dx64).max() + 1e-6)

    # the dot GEMM: out = a @ b.T, every block edge (4 x 4 with AVX-512, 3 x 4 else) and depth
    # around the vector widths (8, 16) with its masked or scalar tail
    for O, Cn in ((1, 1), (3, 4), (4, 4), (5, 7), (9, 6), (16, 16), (17, 33)):
        for K in (1, 7, 8, 15, 16, 17, 33, 100):
            a = rng.standard_normal((O, K)).astype(np.float32)
            bm = rng.standard_normal((Cn, K)).astype(np.float32)
            want = a.astype(np.float64) @ bm.astype(np.float64).T
            bound = 2 * K * 2.0 ** -24 * (np.abs(a).astype(np.float64) @ np.abs(bm).astype(np.float64).T)
            out = np.full((O, Cn), np.nan, np.float32)
            _conv._dot_gemm(a, bm, out)
            check(f"dot {(O, Cn, K)}", out, want, bound + 1e-30)
            out2 = np.full((O, Cn), np.nan, np.float32)
            _conv._dot_gemm(a, bm, out2)
            if not np.array_equal(out, out2):
                fails.append(f"dot {(O, Cn, K)}: two runs differ")
            acc = rng.standard_normal((O, Cn)).astype(np.float32)
            base = acc.astype(np.float64)
            _conv._dot_gemm(a, bm, acc, True)
            check(f"dot {(O, Cn, K)} accumulate", acc, base + want, bound + 2.0 ** -23 * np.abs(base + want))
    # the F(2x2, 3x3) forward with several small images per block (odd sizes: a half-empty
    # last tile), against the float64 convolution; the same bits at 1, 2 and 3 threads
    from parconv.backends.numpy_ref import NumpyBackend
    for N, C, O, S in ((6, 32, 32, 8), (5, 32, 40, 7), (9, 64, 32, 8)):
        if not _conv.winograd_applies(C, O, 3, 1, S, S, N):
            fails.append(f"f2 {(N, C, O, S)}: the forward would not run Winograd")
        x = rng.standard_normal((N, C, S, S)).astype(np.float32)
        w = (rng.standard_normal((O, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
        b = rng.standard_normal(O).astype(np.float32)
        want = NumpyBackend().conv2d_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 1, 1)
        scale = NumpyBackend().conv2d_forward(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64), None, 1, 1)
        ys = []
        for threads in (1, 2, 3):
            if _conv._winograd_blocks(N, C, O, S, S, threads, False)[0] < 2:
                fails.append(f"f2 {(N, C, O, S)}: not several images per block at {threads} threads")
            y = np.empty((N, O, S, S), np.float32)
            _conv.conv2d_forward(x, w, b, y, 1, 1, threads, winograd=True, winograd4=False)
            ys.append(y)
        check(f"f2 {(N, C, O, S)}", ys[0], want, 1e-5 * scale + 1e-6)
        if not (np.array_equal(ys[0], ys[1]) and np.array_equal(ys[0], ys[2])):
            fails.append(f"f2 {(N, C, O, S)}: the bits change with the thread count")
    # the F(4x4, 3x3) weight gradient over runs of images: float64, the same bits at 1, 2, 3 threads
    for N, C, O, S in ((5, 32, 32, 8), (9, 32, 48, 12)):
        x = rng.standard_normal((N, C, S, S)).astype(np.float32)
        dy = rng.standard_normal((N, O, S, S)).astype(np.float32)
        if not _conv.winograd4_dw_applies(N, C, O, 3, 1, S, S):
            fails.append(f"f4 dw {(N, C, O, S)}: would not run Winograd")
        want = NumpyBackend().conv2d_backward(x.astype(np.float64), np.zeros((O, C, 3, 3)), dy.astype(np.float64),
                                              1, 1, False, False)[1]
        scale = NumpyBackend().conv2d_backward(np.abs(x).astype(np.float64), np.zeros((O, C, 3, 3)),
                                               np.abs(dy).astype(np.float64), 1, 1, False, False)[1]
        dws = []
        for threads in (1, 2, 3):
            dw = np.empty((O, C, 3, 3), np.float32)
            _conv.conv2d_backward_weights_winograd(x, dy, dw, None, 1, threads, True)
            dws.append(dw)
        check(f"f4 dw {(N, C, O, S)}", dws[0], want, 1e-4 * scale + 1e-6)
        if not (np.array_equal(dws[0], dws[1]) and np.array_equal(dws[0], dws[2])):
            fails.append(f"f4 dw {(N, C, O, S)}: the bits change with the thread count")
    print(json.dumps({"level": _conv.kernel_isa(), "fails": fails}))
""")


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_norm_sums_and_dot_gemm_agree_with_float64_at_every_level(level):
    result = run_at_isa_level(level, CHILD)
    assert result["level"] == level
    assert result["fails"] == []


def test_f2_forward_puts_small_images_together():
    from parconv._ext import _conv

    # resnet20's last stage (8x8 outputs, 16 tiles an image): four images a block, GEMMs 64 wide
    assert _conv._winograd_blocks(128, 64, 64, 8, 8, 2, False) == (4, 4, 1, 32, 64)
    # 64 tiles an image are wide enough on their own: one image, all its rows
    assert _conv._winograd_blocks(128, 32, 32, 16, 16, 2, False)[:4] == (1, 8, 1, 128)
    # one image on two threads still splits its rows
    assert _conv._winograd_blocks(1, 64, 64, 8, 8, 2, False) == (1, 2, 2, 1, 8)


@pytest.mark.parametrize("N, C, S, threads", [(32, 64, 8, 2), (32, 32, 16, 2), (128, 64, 8, 2), (32, 64, 8, 3),
                                              (128, 16, 32, 4)])
def test_winograd_blocks_share_images_evenly_between_threads(N, C, S, threads):
    from parconv._ext import _conv

    # the forward's runs of images: a multiple of the threads, sizes within one of each other
    ipb, _, bpi, ng, _ = _conv._winograd_blocks(N, C, C, S, S, threads, True)
    assert bpi == 1 and ng % threads == 0 and ipb == -(-N // ng)
    # the weight gradient's (its bits depend on them, so the shape alone sets them): an even number
    ipb, _, bpi, ng, _ = _conv._winograd_dw_blocks(N, C, C, S, S, True)
    assert bpi == 1 and ng % 2 == 0 and ipb == -(-N // ng)
    # batch 32, 64 channels: 28 images fit a block; two runs of 16, not 28 + 4
    assert _conv._winograd_dw_blocks(32, 64, 64, 8, 8, True)[:4] == (16, 2, 1, 2)


def test_batch_norm_chunks_follow_the_shape_and_the_thread_count():
    from parconv._ext import _norm

    # below 32,768 values one chunk; above, a few a thread (which threads take them is pc_cap's
    # call, from the estimate and what starting a region costs)
    assert _norm._bn_chunks(1, 16, 1024, 2) == 1
    assert _norm._bn_chunks(32, 16, 1024, 2) == 8
    assert _norm._bn_chunks(128, 64, 64, 2) == 8
    assert _norm._bn_chunks(128, 16, 1024, 1) == 1


def test_dot_gemm_checks_its_shapes():
    import numpy as np

    from parconv._ext import _conv

    with pytest.raises(ValueError, match="do not make out = a @ b.T"):
        _conv._dot_gemm(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), np.zeros((2, 4), np.float32))


def test_batch_norm_backward_checks_the_relu_output_shape():
    import numpy as np

    from parconv._ext import _norm

    x = np.zeros((2, 3, 4), np.float32)
    c = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="y must have x's shape"):
        _norm.batch_norm_backward(x, c, x, c, c, np.empty_like(x), None, None, True, 1, np.zeros((2, 3, 5), np.float32))


SCRATCH_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from parconv._ext import _conv
    from parconv.backends import openmp as omp_mod

    threads = int(sys.argv[1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 64, 8, 8)).astype(np.float32)
    dy = rng.standard_normal((32, 64, 8, 8)).astype(np.float32)
    w = rng.standard_normal((64, 64, 3, 3)).astype(np.float32)
    dw = np.empty_like(w)
    y = np.empty_like(dy)

    def calls():
        with omp_mod._blas_one_thread:
            for _ in range(10):
                _conv.conv2d_backward_weights_winograd(x, dy, dw, None, 1, threads, True)
                _conv.conv2d_forward(x, w, None, y, 1, 1, threads, winograd=True, winograd4=False)

    calls()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    calls()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults with getrusage (Linux)")
@pytest.mark.parametrize("threads", [1, 2])
def test_winograd_scratch_is_kept_between_calls(threads):
    """The Winograd drivers keep their MB of scratch per thread: once warm, a layer's forward and
    weight gradient fault in no fresh pages. In a fresh process (glibc's default mmap and trim
    thresholds) batch 32 of a 64-channel layer used to map and zero its scratch on every weight
    gradient."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-P", "-c", SCRATCH_CHILD, str(threads)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    faults = int(proc.stdout.strip().splitlines()[-1])
    # 20 calls; a few stray pages (Python's own allocations) allowed
    assert faults < 200, faults
