"""Tests of the OpenMP kernels themselves: every op against the NumPy oracle,
the parallel paths (large inputs, both conv backward work splits), thread
count determinism, and the build/BLAS plumbing of the backend.

The generic per-op tests that run on every backend live elsewhere; these
focus on what only the OpenMP backend has. Data are scaled so outputs are
O(1), which makes rtol 1e-4 / atol 1e-5 meaningful for float32 sums.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("parconv._ext._conv", reason="OpenMP kernels not built")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parconv._config import conv_precision, num_threads  # noqa: E402
from parconv.backends.numpy_ref import NumpyBackend  # noqa: E402
from parconv.backends.openmp import OpenMPBackend, _blas_one_thread, omp_max_threads, openmp_enabled  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
SETTINGS = settings(max_examples=int(os.environ.get("PARCONV_HYPOTHESIS_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow])

omp = OpenMPBackend()
ref = NumpyBackend()


def close(actual, expected, rtol=RTOL, atol=ATOL):
    if expected is None:
        assert actual is None
        return
    assert actual.shape == expected.shape
    assert actual.dtype == np.float32
    # atol scales with the array's largest magnitude: an entry that cancels to near zero keeps the
    # rounding of the terms it came from (float32 sums in another order)
    finite = np.abs(expected[np.isfinite(expected)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * scale)


def close_to_torch_conv2d(y, x, w, b, padding):
    """y against PyTorch's stride-1 conv2d, a second oracle where it is installed."""
    try:
        import torch
    except ImportError:
        return
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                      None if b is None else torch.from_numpy(b), padding=padding)
    close(y, want.numpy())


def conv3x3_case(seed, N, C, O, H, W, P, Q):
    """x (N, C, H, W), 3x3 filters (O, C) and dy (N, O, P, Q), scaled as a layer would see them."""
    rng = np.random.default_rng(seed)
    return (uniform(rng, (N, C, H, W)), uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9)),
            uniform(rng, (N, O, P, Q), 1 / np.sqrt(N * P * Q)))


def uniform(rng, shape, scale=1.0):
    return (rng.uniform(-1, 1, size=shape) * scale).astype(np.float32)


@st.composite
def conv_cases(draw):
    N = draw(st.integers(1, 8))
    C = draw(st.integers(1, 16))
    O = draw(st.integers(1, 16))
    K = draw(st.integers(1, 7))
    stride = draw(st.integers(1, 3))
    padding = draw(st.integers(0, 3))
    lo = max(1, K - 2 * padding)  # the padded input must hold one kernel
    H = draw(st.integers(lo, 20))
    W = draw(st.integers(lo, 20))
    bias = draw(st.booleans())
    threads = draw(st.sampled_from([1, 2]))
    seed = draw(st.integers(0, 2**31 - 1))
    return N, C, O, H, W, K, stride, padding, bias, threads, seed


# ------------------------------------------------------------------ conv2d
@SETTINGS
@given(conv_cases())
def test_conv2d_forward_backward_match_reference(case):
    N, C, O, H, W, K, stride, padding, bias, threads, seed = case
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, K, K), 1 / np.sqrt(C * K * K))
    b = uniform(rng, (O,)) if bias else None
    with num_threads(threads):
        y = omp.conv2d_forward(x, w, b, stride, padding)
        close(y, ref.conv2d_forward(x, w, b, stride, padding))
        P, Q = y.shape[2:]
        dy = uniform(rng, y.shape, 1 / np.sqrt(N * P * Q))
        need_dx, need_db = bool(seed & 1), bool(seed & 2)
        got = omp.conv2d_backward(x, w, dy, stride, padding, need_dx, need_db)
        want = ref.conv2d_backward(x, w, dy, stride, padding, need_dx, need_db)
    for g, e in zip(got, want):
        close(g, e)


@st.composite
def winograd_cases(draw):
    N = draw(st.integers(1, 3))
    C = draw(st.integers(64, 80))
    O = draw(st.integers(32, 72))
    padding = draw(st.integers(0, 2))
    H = draw(st.integers(17, 24))  # >= 15x15 outputs: 64 tiles, enough for 32 filters
    # up to 20 tiles per row: the transforms' 16- and 8-tile vectors and their scalar tails
    W = draw(st.integers(17, 40))
    return N, C, O, H, W, padding, draw(st.booleans()), draw(st.sampled_from([1, 2])), draw(st.integers(0, 2**31 - 1))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(winograd_cases())
def test_conv2d_winograd_forward_matches_reference(case):
    """3x3 stride-1 layers with >= 64 channels and filters run Winograd F(2x2, 3x3)."""
    from parconv._ext import _conv

    N, C, O, H, W, padding, bias, threads, seed = case
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    assert _conv.winograd_applies(C, O, 3, 1, P, Q)
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,)) if bias else None
    with num_threads(threads):
        y = omp.conv2d_forward(x, w, b, 1, padding)
        close(y, ref.conv2d_forward(x, w, b, 1, padding))
        assert np.array_equal(y, omp.conv2d_forward(x, w, b, 1, padding))  # same threads, same bits
    close_to_torch_conv2d(y, x, w, b, padding)
    # the direct micro-kernels give the same result within float32 rounding
    direct = np.empty_like(y)
    _conv.conv2d_forward(x, w, b, direct, 1, padding, threads, 1 << 20, False)
    np.testing.assert_allclose(y, direct, rtol=1e-5, atol=2e-6)


@st.composite
def winograd_dx_cases(draw):
    N = draw(st.integers(1, 3))
    C = draw(st.integers(32, 48))  # dx's output channels
    O = draw(st.integers(64, 72))  # dx's input channels
    padding = draw(st.integers(0, 2))
    H = draw(st.integers(15, 20))
    W = draw(st.integers(15, 36))
    return N, C, O, H, W, padding, draw(st.booleans()), draw(st.sampled_from([1, 2])), draw(st.integers(0, 2**31 - 1))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(winograd_dx_cases())
def test_conv2d_backward_winograd_dx_matches_reference(case):
    """dx of a stride-1 3x3 layer with >= 64 filters is the Winograd convolution of dy with the
    flipped, transposed filters; dw and db stay on the direct kernels unless the layer's
    forward runs Winograd too (winograd_dw_applies)."""
    N, C, O, H, W, padding, need_db, threads, seed = case
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    assert omp._winograd_dx((N, C, H, W), (O, C, 3, 3), 1, padding)
    x, w, dy = conv3x3_case(seed, N, C, O, H, W, P, Q)
    with num_threads(threads):
        got = omp.conv2d_backward(x, w, dy, 1, padding, True, need_db)
    want = ref.conv2d_backward(x, w, dy, 1, padding, True, need_db)
    assert (got[2] is None) == (not need_db)
    for g, e in zip(got, want):
        if e is not None:
            close(g, e)
    try:  # PyTorch as a second oracle where it is installed
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        dx = torch.nn.grad.conv2d_input(x.shape, torch.from_numpy(w), torch.from_numpy(dy), padding=padding)
        close(got[0], dx.numpy())
    # the direct kernels give the same dx within float32 rounding
    omp.winograd = False
    try:
        with num_threads(threads):
            direct = omp.conv2d_backward(x, w, dy, 1, padding, True, need_db)
    finally:
        del omp.winograd
    np.testing.assert_allclose(got[0], direct[0], rtol=1e-5, atol=2e-6)
    from parconv._ext import _conv

    if _conv.winograd_dw_applies(N, C, O, 3, 1, P, Q):  # large single images: Winograd dw too
        close(got[1], direct[1])
    else:
        assert np.array_equal(got[1], direct[1])


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(winograd_cases())
def test_conv2d_backward_winograd_dw_matches_reference(case):
    """The Winograd weight gradient (16 GEMMs over the tiles) matches the oracles, with the same
    bits at 1, 2 and 3 threads; the backend's backward (Winograd dw where
    winograd_dw_applies) matches too."""
    from parconv._ext import _conv
    from parconv.backends.openmp import _blas_one_thread

    N, C, O, H, W, padding, need_dx, threads, seed = case
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    x, w, dy = conv3x3_case(seed, N, C, O, H, W, P, Q)
    want = ref.conv2d_backward(x, w, dy, 1, padding, need_dx, True)
    runs = []
    for t in (1, 2, 3):
        dw, db = np.empty_like(w), np.empty(O, np.float32)
        with _blas_one_thread:
            _conv.conv2d_backward_weights_winograd(x, dy, dw, db, padding, t)
        runs.append(dw)
    close(runs[0], want[1])
    assert all(np.array_equal(r, runs[0]) for r in runs)  # the same bits at any thread count
    close(db, want[2])
    try:  # PyTorch as a second oracle where it is installed
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        dw = torch.nn.grad.conv2d_weight(torch.from_numpy(x), w.shape, torch.from_numpy(dy), padding=padding)
        close(runs[0], dw.numpy())
    with num_threads(threads):
        got = omp.conv2d_backward(x, w, dy, 1, padding, need_dx, True)
    for g, e in zip(got, want):
        close(g, e)
    if _conv.winograd_dw_applies(N, C, O, 3, 1, P, Q):
        assert np.array_equal(got[1], runs[0])


@pytest.mark.parametrize("N, C, O, H, W, padding", [(9, 64, 64, 34, 34, 1),   # blocks of tile rows, 18
                                                    (80, 64, 64, 16, 16, 1),  # blocks of 4 whole images, 20
                                                    (4, 32, 64, 3, 13, 2)])   # dx too small for Winograd
def test_conv2d_backward_winograd_dw_sums_groups_of_blocks(monkeypatch, N, C, O, H, W, padding):
    """More blocks than groups: each group accumulates several blocks and the groups are added in
    order, so 1, 2 and 3 threads give the same bits; the backend takes this kernel for dw (and
    Winograd for dx only where the transposed convolution qualifies)."""
    from parconv._ext import _conv
    from parconv.backends import openmp as omp_mod

    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    rng = np.random.default_rng(21)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    dy = uniform(rng, (N, O, P, Q), 1 / np.sqrt(N * P * Q))
    assert _conv.winograd_dw_applies(N, C, O, 3, 1, P, Q)
    runs = []
    for t in (1, 2, 3):
        dw = np.empty_like(w)
        with omp_mod._blas_one_thread:
            _conv.conv2d_backward_weights_winograd(x, dy, dw, None, padding, t)
        runs.append(dw)
    assert all(np.array_equal(r, runs[0]) for r in runs)
    want = ref.conv2d_backward(x, w, dy, 1, padding, True, True)
    close(runs[0], want[1])
    calls = []
    real_dw, real_fwd = _conv.conv2d_backward_weights_winograd, _conv.conv2d_forward
    monkeypatch.setattr(omp_mod._conv, "conv2d_backward_weights_winograd",
                        lambda *a: calls.append("dw") or real_dw(*a))

    def forward_path(x_, w_, b_, y_, stride_, *rest, winograd=True, **k):
        # the kernel takes Winograd where it is allowed to and winograd_applies says so
        N_, C_, _, _ = x_.shape
        O_, _, K_, _ = w_.shape
        wino = winograd and _conv.winograd_applies(C_, O_, K_, stride_, y_.shape[2], y_.shape[3], N_)
        calls.append("dx winograd" if wino else "dx direct")
        return real_fwd(x_, w_, b_, y_, stride_, *rest, winograd=winograd, **k)

    monkeypatch.setattr(omp_mod._conv, "conv2d_forward", forward_path)
    with num_threads(2):
        got = omp.conv2d_backward(x, w, dy, 1, padding, True, True)
    dx_winograd = omp._winograd_dx(x.shape, w.shape, 1, padding)
    assert calls == ["dw", "dx winograd" if dx_winograd else "dx direct"]
    assert dx_winograd == (H > 10)
    assert np.array_equal(got[1], runs[0])
    for g, e in zip(got, want):
        close(g, e)


def test_conv2d_backward_winograd_dw_only_where_it_pays():
    from parconv._ext import _conv

    assert _conv.winograd_dw_applies(64, 128, 64, 3, 1, 32, 32)  # conv-large
    assert _conv.winograd_dw_applies(16, 128, 128, 3, 1, 28, 28)
    assert not _conv.winograd_dw_applies(100, 64, 32, 3, 1, 26, 26)  # 32 filters
    assert not _conv.winograd_dw_applies(100, 64, 64, 3, 1, 13, 13)  # rows of 7 tiles, the last half empty
    assert _conv.winograd_dw_applies(128, 64, 64, 3, 1, 8, 8)  # rows of 4 whole tiles: resnet20's last stage
    assert _conv.winograd_dw_applies(100, 64, 64, 3, 1, 14, 14)
    assert not _conv.winograd_dw_applies(8, 256, 256, 3, 1, 16, 16)  # GEMMs 64 tiles deep
    assert not _conv.winograd_dw_applies(64, 128, 64, 3, 2, 16, 16)  # strided
    assert not _conv.winograd_dw_applies(2, 32, 64, 3, 1, 16, 16)  # too few channels for 2 images of 64 tiles
    assert _conv.winograd_dw_applies(64, 32, 64, 3, 1, 32, 32)  # ... enough with 64 filters in a batch


def test_conv2d_backward_weights_winograd_checks_its_arguments():
    from parconv._ext import _conv

    x = np.zeros((2, 64, 16, 16), np.float32)
    dy = np.zeros((2, 32, 16, 16), np.float32)
    with pytest.raises(ValueError, match="not the 3x3 stride-1 output"):
        _conv.conv2d_backward_weights_winograd(x, np.zeros((2, 32, 15, 16), np.float32),
                                               np.zeros((32, 64, 3, 3), np.float32), None, 1, 1)
    with pytest.raises(ValueError, match="dw must be"):
        _conv.conv2d_backward_weights_winograd(x, dy, np.zeros((32, 64, 5, 5), np.float32), None, 1, 1)
    with pytest.raises(ValueError, match="db must be"):
        _conv.conv2d_backward_weights_winograd(x, dy, np.zeros((32, 64, 3, 3), np.float32),
                                               np.zeros(31, np.float32), 1, 1)
    with pytest.raises(ValueError, match="not the 3x3 stride-1 output"):
        _conv.conv2d_backward_weights_winograd(np.zeros((2, 64, 20, 20), np.float32), dy,
                                               np.zeros((32, 64, 3, 3), np.float32), None, -1, 1)
    with pytest.raises(ValueError, match=">= 1"):
        _conv.conv2d_backward_weights_winograd(np.zeros((0, 64, 16, 16), np.float32),
                                               np.zeros((0, 32, 16, 16), np.float32),
                                               np.zeros((32, 64, 3, 3), np.float32), None, 1, 1)


def test_conv2d_backward_winograd_dx_only_where_it_applies():
    assert omp._winograd_dx((64, 128, 32, 32), (64, 128, 3, 3), 1, 1)  # conv-large
    assert not omp._winograd_dx((64, 128, 32, 32), (64, 128, 3, 3), 2, 1)  # strided
    assert not omp._winograd_dx((64, 128, 32, 32), (64, 128, 3, 3), 1, 3)  # padding > K - 1
    assert not omp._winograd_dx((1, 128, 16, 16), (32, 128, 3, 3), 1, 1)  # 32 filters: dx has 32 in-channels
    assert omp._winograd_dx((1, 128, 32, 32), (32, 128, 3, 3), 1, 1)  # ... enough over 256 tiles
    assert omp._winograd_dx((64, 128, 32, 32), (32, 128, 3, 3), 1, 1)  # ... enough for 128 outputs in a batch
    assert omp._winograd_dx((64, 16, 32, 32), (32, 16, 3, 3), 1, 1)  # dx with 16 filters: F(4x4) in a batch
    assert not omp._winograd_dx((2, 16, 32, 32), (32, 16, 3, 3), 1, 1)  # ... not for 2 images
    assert not omp._winograd_dx((64, 8, 32, 32), (32, 8, 3, 3), 1, 1)  # ... nor 8 filters
    assert not omp._winograd_dx((64, 128, 32, 32), (64, 128, 5, 5), 1, 2)  # 5x5


@pytest.mark.parametrize("threads", [1, 2])
# dx_winograd: whether the transposed convolution (O in-channels, C filters) qualifies too: it needs
# 32 filters and 16 tiles in a batch: as the forward with channels and filters swapped
@pytest.mark.parametrize("N,C,O,H,dx_winograd", [(4, 32, 128, 8, True), (5, 128, 128, 7, True),
                                                 (6, 96, 160, 8, True)])
def test_conv2d_winograd_small_maps_in_a_batch_match_reference(N, C, O, H, dx_winograd, threads):
    """Maps of 16 tiles (8x8 or 7x7 outputs) run Winograd from a batch of 4 images: forward and dx."""
    rng = np.random.default_rng(N + C + O + H)
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,))
    dy = uniform(rng, (N, O, H, H))
    assert omp._winograd(C, O, 3, 1, H, H, N)
    assert omp._winograd_dx(x.shape, w.shape, 1, 1) == dx_winograd
    with num_threads(threads):
        close(omp.conv2d_forward(x, w, b, 1, 1), ref.conv2d_forward(x, w, b, 1, 1))
        for got, want in zip(omp.conv2d_backward(x, w, dy, 1, 1), ref.conv2d_backward(x, w, dy, 1, 1)):
            close(got, want)


@SETTINGS
@given(N=st.integers(1, 2), C=st.integers(24, 80), O=st.integers(9, 70), H=st.integers(3, 9),
       K=st.sampled_from([3, 5]), scaled=st.booleans(), seed=st.integers(0, 2**16))
# vgg_small's widest layer at batch 1: its filters split over the threads on every ISA level
@example(N=1, C=128, O=128, H=8, K=3, scaled=True, seed=0)
@example(N=1, C=64, O=128, H=8, K=3, scaled=False, seed=1)
def test_direct_conv_of_few_images_split_over_filters_keeps_bits(N, C, O, H, K, scaled, seed):
    """A batch of one or two images whose filters outweigh them (a wide layer at batch 1) is split
    over runs of whole register blocks of filters instead of over output rows: every output keeps
    its arithmetic, so each thread count gives the bits of one thread, near the reference; the
    input gradient (flipped filters) goes the same way."""
    rng = np.random.default_rng(seed)
    pad = K // 2
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, K, K), 1 / np.sqrt(C * K * K))
    b = uniform(rng, (O,))
    scale = uniform(rng, (O,)) if scaled else None
    dy = uniform(rng, (N, O, H, H))
    runs = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            with conv_precision("highest"):  # the direct kernels, no Winograd
                y = (omp.conv2d_scale_shift_forward(x, w, scale, b, 1, pad, True) if scaled
                     else omp.conv2d_forward(x, w, b, 1, pad))
                dx = omp.conv2d_backward(x, w, dy, 1, pad)[0]
        runs.append((y, dx))
    want = ref.conv2d_forward(x, w, None if scaled else b, 1, pad)
    if scaled:
        want = np.maximum(want * scale[None, :, None, None] + b[None, :, None, None], 0)
    close(runs[0][0], want)
    close(runs[0][1], ref.conv2d_backward(x, w, dy, 1, pad)[0])
    for y, dx in runs[1:]:
        assert np.array_equal(y, runs[0][0]) and np.array_equal(dx, runs[0][1])


@pytest.mark.parametrize("f4", [True, False])
def test_winograd_forward_shares_its_filter_transforms_and_keeps_bits_at_every_team(f4):
    """The Winograd forward's filter transforms are runs taken from a shared counter, the blocks wait
    for all of them (pc_gate): 1 to 6 threads (more than this machine's cores, so some wake late or
    not at all before the others finish) give the same bits, many calls in a row."""
    rng = np.random.default_rng(5)
    N, C, O, H = 8, 40, 48, 12
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,))
    assert omp._winograd(C, O, 3, 1, H, H, N)
    saved = omp._winograd4
    try:
        omp._winograd4 = lambda grad=False: f4
        with num_threads(1):
            want = omp.conv2d_forward(x, w, b, 1, 1)
        close(want, ref.conv2d_forward(x, w, b, 1, 1))
        for threads in (2, 3, 4, 6):
            with num_threads(threads):
                for _ in range(20):
                    assert np.array_equal(omp.conv2d_forward(x, w, b, 1, 1), want), threads
    finally:
        omp._winograd4 = saved


@st.composite
def winograd4_cases(draw, dx=False):
    """dx: the transposed convolution (dy to an H x W dx) must qualify too."""
    N = draw(st.integers(4, 9))
    C = draw(st.integers(16, 40))
    O = draw(st.integers(16, 40))
    padding = draw(st.integers(0, 2))
    # outputs from 8x8: rows of 2 to 10 tiles, whole vectors of 8 (32 columns) and not, and
    # partial last tiles
    lo = max(8, 10 - 2 * padding) if dx else 10 - 2 * padding
    H = draw(st.integers(lo, 24))
    W = draw(st.integers(lo, 40))
    epilogue = draw(st.sampled_from(["bias", "none", "scale", "scale+relu"]))
    return N, C, O, H, W, padding, epilogue, draw(st.integers(0, 2**31 - 1))


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 3))
@given(winograd4_cases())
def test_conv2d_winograd4_forward_matches_reference(case):
    """3x3 stride-1 layers of a batch with >= 16 channels and filters run Winograd F(4x4, 3x3):
    the NumPy and PyTorch oracles agree, every thread count gives the same bits, and the folded
    batch norm's scale and ReLU come out as the direct kernels apply them."""
    from parconv._ext import _conv

    N, C, O, H, W, padding, epilogue, seed = case
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    assert _conv.winograd4_applies(C, O, 3, 1, P, Q, N)
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,)) if epilogue != "none" else None
    scale = uniform(rng, (O,)) + 1.5 if epilogue.startswith("scale") else None
    relu = epilogue.endswith("relu")
    outs = []
    for threads in (1, 2, 3):
        y = np.empty((N, O, P, Q), np.float32)
        _conv.conv2d_forward(x, w, b, y, 1, padding, threads, 1 << 20, True, scale, relu)
        outs.append(y)
    for y in outs[1:]:
        assert np.array_equal(y, outs[0])  # blocks of images differ with the threads; the bits do not
    direct = np.empty_like(outs[0])
    _conv.conv2d_forward(x, w, b, direct, 1, padding, 2, 1 << 20, False, scale, relu)
    close(outs[0], direct)
    if scale is None:
        want = ref.conv2d_forward(x, w, b, 1, padding)
        close(outs[0], want)
        close(omp.conv2d_forward(x, w, b, 1, padding), want)
        close_to_torch_conv2d(outs[0], x, w, b, padding)


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 4))
@given(winograd4_cases(dx=True))
def test_conv2d_backward_winograd4_dx_matches_reference(case):
    """dx of a layer with >= 16 channels and filters in a batch is the F(4x4, 3x3) convolution of
    dy with the flipped filters; dw and db match too."""
    N, C, O, H, W, padding, _, seed = case
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    assert omp._winograd_dx((N, C, H, W), (O, C, 3, 3), 1, padding)
    x, w, dy = conv3x3_case(seed, N, C, O, H, W, P, Q)
    with num_threads(2):
        got = omp.conv2d_backward(x, w, dy, 1, padding)
    for g, e in zip(got, ref.conv2d_backward(x, w, dy, 1, padding)):
        close(g, e)


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 4))
@given(winograd4_cases())
def test_conv2d_backward_winograd4_dw_matches_reference(case):
    """With >= 32 channels and filters in a batch, dw is the F(4x4, 3x3) weight gradient (36 GEMMs
    over the tiles): it matches the oracle with the same bits at 1, 2 and 3 threads, and so does
    the backend's backward."""
    from parconv._ext import _conv

    N, C, O, H, W, padding, _, seed = case
    if seed % 3:  # >= 32 channels and filters, else narrow ones with the tile minimum lifted
        C, O = C + 16, O + 16
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    old = _conv._set_winograd4_dw_limits((32, 32, 16, 0))
    try:
        assert _conv.winograd4_dw_applies(N, C, O, 3, 1, P, Q)
        _check_winograd4_dw(N, C, O, H, W, P, Q, padding, seed)
    finally:
        _conv._set_winograd4_dw_limits(old)


def _check_winograd4_dw(N, C, O, H, W, P, Q, padding, seed):
    from parconv._ext import _conv

    x, w, dy = conv3x3_case(seed, N, C, O, H, W, P, Q)
    want = ref.conv2d_backward(x, w, dy, 1, padding)
    outs = []
    for t in (1, 2, 3):
        dw = np.empty((O, C, 3, 3), np.float32)
        db = np.empty(O, np.float32)
        with _blas_one_thread:
            _conv.conv2d_backward_weights_winograd(x, dy, dw, db, padding, t)
        outs.append(dw)
        close(db, want[2])
    for dw in outs[1:]:
        assert np.array_equal(dw, outs[0])
    close(outs[0], want[1])
    with num_threads(2):
        got = omp.conv2d_backward(x, w, dy, 1, padding)
    for g, e in zip(got, want):
        close(g, e)


@pytest.mark.parametrize("N,C,O,H,padding", [(4, 32, 32, 12, 1),   # dU on the dot-product kernel
                                              (5, 64, 48, 11, 0),   # ... on sgemm (O x C > 2048)
                                              (128, 16, 16, 16, 1)])  # narrow, over 2048 tiles
def test_conv2d_backward_winograd4_dw_both_products(N, C, O, H, padding):
    from parconv._ext import _conv

    P = H + 2 * padding - 2
    assert _conv.winograd4_dw_applies(N, C, O, 3, 1, P, P)
    _check_winograd4_dw(N, C, O, H, H, P, P, padding, N + C + O)


def test_conv2d_backward_winograd4_dw_ignores_stale_scratch():
    """A block of 198 tiles (not whole vectors of 8) after a call that left NaN in the scratch:
    the products read no column past the block's tiles, so dw stays finite and thread-invariant."""
    from parconv._ext import _conv

    N, C, O, H, W, padding = 7, 16, 40, 19, 39, 2
    P, Q = H + 2 * padding - 2, W + 2 * padding - 2
    old = _conv._set_winograd4_dw_limits((32, 32, 16, 0))
    try:
        assert _conv.winograd4_dw_applies(N, C, O, 3, 1, P, Q)
        x, w, dy = conv3x3_case(925629, N, C, O, H, W, P, Q)
        outs = []
        for t in (1, 2, 3):
            dw = np.empty((O, C, 3, 3), np.float32)
            with _blas_one_thread:
                _conv.conv2d_backward_weights_winograd(np.full_like(x, np.nan), np.full_like(dy, np.nan), dw, None,
                                                       padding, t)
                _conv.conv2d_backward_weights_winograd(x, dy, dw, None, padding, t)
            outs.append(dw)
    finally:
        _conv._set_winograd4_dw_limits(old)
    assert np.isfinite(outs[0]).all()
    for dw in outs[1:]:
        assert np.array_equal(dw, outs[0])
    close(outs[0], ref.conv2d_backward(x, w, dy, 1, padding)[1])


def test_conv2d_winograd4_only_where_it_applies():
    from parconv._ext import _conv

    assert _conv.winograd4_applies(16, 16, 3, 1, 32, 32, 128)  # resnet20's first stage
    assert _conv.winograd4_applies(64, 64, 3, 1, 8, 8, 128)  # ... and its last
    assert _conv.winograd4_applies(16, 16, 3, 1, 8, 8, 4)
    assert not _conv.winograd4_applies(16, 16, 3, 1, 32, 32, 3)  # 3 images: F(2x2) or direct
    assert not _conv.winograd4_applies(128, 128, 3, 1, 32, 32, 1)  # one image
    assert not _conv.winograd4_applies(15, 16, 3, 1, 32, 32, 128)  # 15 channels
    assert not _conv.winograd4_applies(16, 15, 3, 1, 32, 32, 128)  # 15 filters
    assert not _conv.winograd4_applies(16, 16, 3, 1, 7, 32, 128)  # 7 output rows
    assert not _conv.winograd4_applies(16, 16, 3, 2, 32, 32, 128)  # strided
    assert not _conv.winograd4_applies(16, 16, 5, 1, 32, 32, 128)  # 5x5
    old = _conv._set_winograd4_limits((32, 32, 8))
    try:
        assert not _conv.winograd4_applies(16, 16, 3, 1, 32, 32, 128)
        assert _conv._set_winograd4_limits() == (32, 32, 8)
    finally:
        _conv._set_winograd4_limits(old)
    with pytest.raises(ValueError, match="3 entries"):
        _conv._set_winograd4_limits((1, 2))
    assert _conv.winograd4_dw_applies(128, 32, 32, 3, 1, 16, 16)  # resnet20's second stage
    assert _conv.winograd4_dw_applies(128, 128, 128, 3, 1, 8, 8)  # vgg-small's last
    assert _conv.winograd4_dw_applies(4, 32, 32, 3, 1, 8, 8)  # 32 channels and filters: any batch
    assert _conv.winograd4_dw_applies(128, 16, 16, 3, 1, 32, 32)  # 16: over 8192 tiles (resnet20's first stage)
    assert not _conv.winograd4_dw_applies(8, 16, 16, 3, 1, 32, 32)  # ... not over 512
    assert not _conv.winograd4_dw_applies(128, 15, 32, 3, 1, 32, 32)  # 15 channels
    assert not _conv.winograd4_dw_applies(3, 64, 64, 3, 1, 32, 32)  # 3 images
    old = _conv._set_winograd4_dw_limits((64, 64, 64, 0))
    try:
        assert not _conv.winograd4_dw_applies(128, 32, 32, 3, 1, 16, 16)
        assert _conv.winograd4_dw_applies(128, 64, 64, 3, 1, 16, 16)
        assert _conv._set_winograd4_dw_limits() == (64, 64, 64, 0)
    finally:
        _conv._set_winograd4_dw_limits(old)
    with pytest.raises(ValueError, match="4 entries"):
        _conv._set_winograd4_dw_limits((1, 2, 3))


def test_conv2d_winograd_only_where_it_pays():
    from parconv._ext import _conv

    assert _conv.winograd_applies(128, 64, 3, 1, 32, 32)  # conv-small / conv-large
    assert not _conv.winograd_applies(1, 64, 3, 1, 26, 26)  # cnn-mnist first layer
    assert not _conv.winograd_applies(128, 64, 3, 2, 16, 16)  # strided
    assert not _conv.winograd_applies(128, 64, 5, 1, 28, 28)  # 5x5
    assert not _conv.winograd_applies(512, 512, 3, 1, 7, 7)  # 16 tiles: too few for the GEMMs
    assert not _conv.winograd_applies(128, 128, 3, 1, 8, 8, 1)  # 16 tiles of one image: too few
    assert _conv.winograd_applies(128, 128, 3, 1, 8, 8, 4)  # ... but a batch keeps every thread busy
    assert not _conv.winograd_applies(64, 64, 3, 1, 8, 8, 1)  # 16 tiles x 64 filters of one image
    assert _conv.winograd_applies(64, 64, 3, 1, 8, 8, 128)  # ... in a batch: resnet20's last stage
    assert not _conv.winograd_applies(32, 64, 3, 1, 16, 16)  # too few channels for 64 tiles of one image
    assert _conv.winograd_applies(32, 32, 3, 1, 24, 24)  # ... enough for 144
    assert _conv.winograd_applies(32, 32, 3, 1, 16, 16, 128)  # ... enough in a batch
    assert _conv.winograd_applies(32, 32, 3, 1, 8, 8, 4)
    assert not _conv.winograd_applies(16, 16, 3, 1, 32, 32, 128)  # 16 channels: never
    assert not _conv.winograd_applies(32, 16, 3, 1, 32, 32, 128)  # 16 filters: never
    assert not _conv.winograd_applies(64, 64, 3, 1, 6, 6, 128)  # 9 tiles
    assert _conv.winograd_applies(128, 32, 3, 1, 32, 32)  # a 2-rank slice of conv-large's filters
    assert not _conv.winograd_applies(64, 32, 3, 1, 13, 13)  # 49 tiles x 32 filters: too little GEMM work
    assert _conv.winograd_applies(64, 64, 3, 1, 13, 13)


@pytest.mark.parametrize(
    "N, C, H, K, stride, padding",
    [
        (1, 32, 16, 3, 1, 1),  # batch 1: backward split over channel blocks
        (3, 8, 12, 3, 2, 1),  # odd batch: channel blocks
        (4, 8, 12, 5, 1, 2),  # by image, private dw buffers reduced in thread order
        (5, 3, 10, 1, 1, 0),  # 1x1: im2col skipped
        (2, 1, 28, 3, 1, 0),  # one in-channel (first layer)
    ],
)
def test_conv2d_parallel_paths_and_determinism(N, C, H, K, stride, padding):
    rng = np.random.default_rng(7)
    O = 16
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, K, K), 1 / np.sqrt(C * K * K))
    b = uniform(rng, (O,))
    want_y = ref.conv2d_forward(x, w, b, stride, padding)
    dy = uniform(rng, want_y.shape, 1 / np.sqrt(want_y[:, 0].size))
    want = ref.conv2d_backward(x, w, dy, stride, padding)
    runs = {}
    for threads in (1, 2, 2):
        with num_threads(threads):
            y = omp.conv2d_forward(x, w, b, stride, padding)
            grads = omp.conv2d_backward(x, w, dy, stride, padding)
        close(y, want_y)
        for g, e in zip(grads, want):
            close(g, e)
        if threads in runs:  # same thread count: the same bits
            y0, g0 = runs[threads]
            assert np.array_equal(y, y0)
            for a, c in zip(grads, g0):
                assert np.array_equal(a, c)
        runs[threads] = (y, grads)
    (y1, g1), (y2, g2) = runs[1], runs[2]
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
    for a, c in zip(g2, g1):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_conv2d_large_batch_dw_reduction_deterministic():
    rng = np.random.default_rng(3)
    x = uniform(rng, (16, 4, 10, 10))
    w = uniform(rng, (8, 4, 3, 3), 1 / 6)
    dy = uniform(rng, (16, 8, 10, 10), 1 / 40)
    with num_threads(2):
        first = omp.conv2d_backward(x, w, dy, 1, 1)
        for _ in range(3):
            again = omp.conv2d_backward(x, w, dy, 1, 1)
            for a, c in zip(again, first):
                assert np.array_equal(a, c)
    with num_threads(1):
        serial = omp.conv2d_backward(x, w, dy, 1, 1)
    for a, c in zip(first, serial):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
    for a, c in zip(first, ref.conv2d_backward(x, w, dy, 1, 1)):
        close(a, c)


@SETTINGS
@given(conv_cases(), st.integers(1, 3), st.integers(1, 3))
def test_fused_conv_relu_maxpool_matches_composition(case, pool_kernel, pool_stride):
    N, C, O, H, W, K, stride, padding, bias, threads, seed = case
    P = (H + 2 * padding - K) // stride + 1
    Q = (W + 2 * padding - K) // stride + 1
    if min(P, Q) < pool_kernel:
        return
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, K, K), 1 / np.sqrt(C * K * K))
    b = uniform(rng, (O,)) if bias else None
    with num_threads(threads):
        y, am = omp.conv2d_relu_maxpool2d_forward(x, w, b, stride, padding, pool_kernel, pool_stride)
        y_ref, am_ref = ref.conv2d_relu_maxpool2d_forward(x, w, b, stride, padding, pool_kernel, pool_stride)
        close(y, y_ref)
        assert am.dtype == (np.uint16 if P * Q <= 65536 else np.int32)
        # the argmax may differ only where two window values tie within float32 rounding
        z = ref.conv2d_forward(x, w, b, stride, padding).reshape(N, O, -1)
        picked = np.take_along_axis(z, am.reshape(N, O, -1), axis=2)
        picked_ref = np.take_along_axis(z, am_ref.reshape(N, O, -1), axis=2)
        np.testing.assert_allclose(picked, picked_ref, rtol=RTOL, atol=ATOL)
        dy = uniform(rng, y.shape)
        got = omp.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, stride, padding)
        want = ref.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, stride, padding)
        # an int32 argmax (another backend's, or a composed forward's) takes the same path
        got32 = omp.conv2d_relu_maxpool2d_backward(x, w, y, am.astype(np.int32), dy, stride, padding)
    for g, g32, e in zip(got, got32, want):
        close(g, e)
        assert np.array_equal(g, g32)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_conv_relu_maxpool_mnist_shape(threads):
    rng = np.random.default_rng(4)
    x = uniform(rng, (6, 1, 28, 28))
    w = uniform(rng, (32, 1, 3, 3), 1 / 3)
    b = uniform(rng, (32,))
    with num_threads(threads):
        y, am = omp.conv2d_relu_maxpool2d_forward(x, w, b, 1, 0, 2, 2)
    y_ref, am_ref = ref.conv2d_relu_maxpool2d_forward(x, w, b, 1, 0, 2, 2)
    assert y.shape == (6, 32, 13, 13)
    close(y, y_ref)
    assert np.array_equal(am, am_ref)
    assert (y >= 0).all()


@pytest.mark.parametrize("N, O, fused", [(1, 8, True), (3, 16, True), (5, 4, True), (1, 512, False)])
def test_fused_forward_keeps_whole_images_when_the_split_is_uneven(N, O, fused):
    """Fewer (or an odd number of) images than threads: small layers stay fused with whole images
    per thread, large ones compose the unfused ops; both give the oracle's answer."""
    from parconv._ext import _conv

    rng = np.random.default_rng(N * 1000 + O)
    x = uniform(rng, (N, 1, 28, 28))
    w = uniform(rng, (O, 1, 3, 3), 1 / 3)
    b = uniform(rng, (O,))
    y = np.full((N, O, 13, 13), np.nan, np.float32)
    am = np.full(y.shape, -1, np.int32)
    assert _conv.conv2d_relu_maxpool2d_forward(x, w, b, y, am, 1, 0, 2, 2, 2) == fused
    y_ref, am_ref = ref.conv2d_relu_maxpool2d_forward(x, w, b, 1, 0, 2, 2)
    if fused:
        close(y, y_ref)
        assert np.array_equal(am, am_ref)
    else:  # nothing written: the backend composes instead
        assert np.isnan(y).all() and (am == -1).all()
    with num_threads(2):
        y2, am2 = omp.conv2d_relu_maxpool2d_forward(x, w, b, 1, 0, 2, 2)
    with num_threads(1):
        y1, am1 = omp.conv2d_relu_maxpool2d_forward(x, w, b, 1, 0, 2, 2)
    close(y2, y_ref)
    assert np.array_equal(am2, am_ref)
    np.testing.assert_allclose(y2, y1, rtol=1e-6, atol=1e-7)


def _fused_backward_kernel(x, w, y, am, dy, padding, need_dx, need_db, threads):
    """The fused backward kernel itself (the backend runs it only where it pays, see
    ``test_fused_backward_runs_where_it_pays``)."""
    from parconv._ext import _conv

    dx = np.empty_like(x) if need_dx else None
    dw = np.empty_like(w)
    db = np.empty(w.shape[0], np.float32) if need_db else None
    _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, dx, dw, db, padding, threads)
    return dx, dw, db


def test_fused_backward_runs_where_it_pays(monkeypatch):
    """The backend takes the fused backward only without dx and for at most
    FUSED_BWD_MAX_CHANNELS input channels; elsewhere it composes the unfused ops (the same
    answer, Winograd dx where that applies)."""
    from parconv._ext import _conv
    from parconv.backends import openmp as omp_mod

    calls = []
    real = _conv.conv2d_relu_maxpool2d_backward
    monkeypatch.setattr(omp_mod._conv, "conv2d_relu_maxpool2d_backward",
                        lambda *a: calls.append(a[0].shape[1]) or real(*a))
    rng = np.random.default_rng(13)
    limit = omp_mod.FUSED_BWD_MAX_CHANNELS
    for C in (1, limit, limit + 1):
        x = uniform(rng, (3, C, 10, 10))
        w = uniform(rng, (4, C, 3, 3), 1 / np.sqrt(C * 9))
        y, am = omp.conv2d_relu_maxpool2d_forward(x, w, None, 1, 1, 2, 2)
        dy = uniform(rng, y.shape)
        want = ref.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, 1, 1)
        for need_dx in (False, True):
            calls.clear()
            got = omp.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, 1, 1, need_dx, True)
            assert calls == ([C] if C <= limit and not need_dx else []), (C, need_dx)
            for g, e in zip(got, want):
                if g is not None:
                    np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("C, padding, pool", [(1, 0, (2, 2)), (3, 1, (2, 2)), (2, 2, (3, 2))])
def test_fused_backward_matches_composition_and_is_thread_count_independent(C, padding, pool):
    """The fused backward kernel never writes the full-size dz; dw sums each filter's images in
    order, so 1 and 2 threads give the same bits; every need_dx / need_db combination."""
    rng = np.random.default_rng(11)
    N, O, H = 5, 7, 13
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,))
    y, am = omp.conv2d_relu_maxpool2d_forward(x, w, b, 1, padding, *pool)
    dy = uniform(rng, y.shape)
    dy[0, 0] = np.nan  # a NaN gradient reaches dw/db only where the pooled value is positive
    want = ref.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, 1, padding)
    for need_dx in (True, False):
        for need_db in (True, False):
            runs = [_fused_backward_kernel(x, w, y, am, dy, padding, need_dx, need_db, threads)
                    for threads in (1, 2)]
            for got in runs:
                assert (got[0] is None) == (not need_dx) and (got[2] is None) == (not need_db)
                for g, e in zip(got, want):
                    if g is not None:
                        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)
            assert np.array_equal(runs[0][1], runs[1][1], equal_nan=True)


def test_fused_backward_sums_fixed_image_blocks_at_every_thread_count():
    """The fused backward's dw is summed in blocks of images fixed by the shape, handed out
    dynamically and added in block order: every thread count gives the bits of one thread,
    and any number of blocks agrees with the oracle."""
    from parconv._ext import _conv

    rng = np.random.default_rng(12)
    N, C, O, H = 16, 2, 24, 20  # 2.2 M multiply-adds: parallel
    x = uniform(rng, (N, C, H, H))
    w = uniform(rng, (O, C, 3, 3), 1 / np.sqrt(C * 9))
    b = uniform(rng, (O,))
    y, am = omp.conv2d_relu_maxpool2d_forward(x, w, b, 1, 1, 2, 2)
    dy = uniform(rng, y.shape)
    want = ref.conv2d_relu_maxpool2d_backward(x, w, y, am, dy, 1, 1)
    old = _conv._set_fused_backward_image_blocks(16)
    try:
        for blocks in (1, 3, 16, 100):  # one block up to one per image (at most N)
            _conv._set_fused_backward_image_blocks(blocks)
            serial = _fused_backward_kernel(x, w, y, am, dy, 1, True, True, 1)
            for g, e in zip(serial, want):
                np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)
            for threads in (2, 3):
                got = _fused_backward_kernel(x, w, y, am, dy, 1, True, True, threads)
                for g, s in zip(got, serial):
                    assert np.array_equal(g, s), (blocks, threads)
        with pytest.raises(ValueError, match=">= 1"):
            _conv._set_fused_backward_image_blocks(0)
    finally:
        _conv._set_fused_backward_image_blocks(old)



@pytest.mark.parametrize("N", [5, 24])
def test_fused_backward_with_head_gives_the_heads_gradients_bit_for_bit(N):
    """With head_dw / head_db the fused backward also writes the head's gradients, with the bits of
    the narrow linear_backward (which the composition runs) at every thread count; the
    convolution's gradients keep theirs."""
    from parconv._ext import _conv, _dense

    rng = np.random.default_rng(N)
    O, G = 16, 10
    x = uniform(rng, (N, 1, 28, 28))
    w = uniform(rng, (O, 1, 3, 3), 1 / 3)
    wl, bl = uniform(rng, (G, O * 169), 0.02), uniform(rng, (G,))
    y, am, _ = omp.conv2d_relu_maxpool2d_linear_forward(x, w, None, 1, 0, 2, 2, wl, bl)
    dl = uniform(rng, (N, G))
    want_dwl, want_dbl = np.empty_like(wl), np.empty(G, np.float32)
    _dense.linear_backward(y.reshape(N, -1), wl, dl, None, want_dwl, want_dbl, 1, True)
    want_dw, want_db = np.empty_like(w), np.empty(O, np.float32)
    _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, want_dw, want_db, 0, 1, wl, dl)
    for threads in (1, 2, 3):
        dw, db = np.empty_like(w), np.empty(O, np.float32)
        dwl, dbl = np.full_like(wl, np.nan), np.full(G, np.nan, np.float32)
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, db, 0, threads, wl, dl, dwl, dbl)
        for got, want in ((dw, want_dw), (db, want_db), (dwl, want_dwl), (dbl, want_dbl)):
            assert np.array_equal(got, want), threads
    close(want_dwl, dl.T @ y.reshape(N, -1))
    close(want_dbl, dl.sum(0))
    with pytest.raises(ValueError, match="head_dw must be"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, db, 0, 1, wl, dl, np.empty((G, O * 169 - 1), np.float32), dbl)
    with pytest.raises(ValueError, match="head_db must be"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, db, 0, 1, wl, dl, dwl, dbl[1:])
    with pytest.raises(ValueError, match="need head_w"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, y, None, dw, db, 0, 1, None, None, dwl, dbl)


# --------------------------------------------------------------- maxpool2d
@st.composite
def pool_cases(draw):
    N = draw(st.integers(1, 8))
    C = draw(st.integers(1, 16))
    K = draw(st.integers(1, 4))
    stride = draw(st.integers(1, 3))
    H = draw(st.integers(K, 20))
    W = draw(st.integers(K, 20))
    return N, C, H, W, K, stride, draw(st.sampled_from([1, 2])), draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(pool_cases())
def test_maxpool2d_matches_reference_with_ties(case):
    N, C, H, W, K, stride, threads, seed = case
    rng = np.random.default_rng(seed)
    # few distinct values: many ties, so "first maximum" is exercised
    x = rng.integers(-3, 3, size=(N, C, H, W)).astype(np.float32)
    with num_threads(threads):
        y, am = omp.maxpool2d_forward(x, K, stride)
        y_ref, am_ref = ref.maxpool2d_forward(x, K, stride)
        assert am.dtype == np.uint16  # planes of at most 65,536 positions
        assert np.array_equal(y, y_ref)
        assert np.array_equal(am, am_ref)
        dy = uniform(rng, y.shape)
        dx = omp.maxpool2d_backward(dy, am, x.shape)
        assert np.array_equal(omp.maxpool2d_backward(dy, am.astype(np.int32), x.shape), dx)
    close(dx, ref.maxpool2d_backward(dy, am_ref, x.shape))


@pytest.mark.parametrize("H, W, dtype", [(256, 256, np.uint16), (257, 256, np.int32)])
def test_argmax_is_uint16_exactly_where_every_index_fits(H, W, dtype):
    """maxpool2d indexes its input plane, the fused op its convolution plane: uint16 up to
    65,536 positions, int32 beyond, and the gradients are right on both sides of the line."""
    rng = np.random.default_rng(H)
    x = uniform(rng, (1, 1, H, W))
    y, am = omp.maxpool2d_forward(x, 2, 2)
    y_ref, am_ref = ref.maxpool2d_forward(x, 2, 2)
    assert am.dtype == dtype and np.array_equal(am, am_ref) and np.array_equal(y, y_ref)
    dy = uniform(rng, y.shape)
    close(omp.maxpool2d_backward(dy, am, x.shape), ref.maxpool2d_backward(dy, am_ref, x.shape))
    w = uniform(rng, (2, 1, 3, 3), 1 / 3)
    xp = uniform(rng, (1, 1, H + 2, W + 2))  # a 3x3 kernel, no padding: an (H, W) convolution plane
    y, am = omp.conv2d_relu_maxpool2d_forward(xp, w, None, 1, 0, 2, 2)
    y_ref, am_ref = ref.conv2d_relu_maxpool2d_forward(xp, w, None, 1, 0, 2, 2)
    assert am.dtype == dtype
    close(y, y_ref)
    dy = uniform(rng, y.shape)
    got = omp.conv2d_relu_maxpool2d_backward(xp, w, y, am, dy, 1, 0, need_dx=False)
    want = ref.conv2d_relu_maxpool2d_backward(xp, w, y, am, dy, 1, 0, need_dx=False)
    for g, e in zip(got[1:], want[1:]):
        close(g, e)


def test_maxpool2d_large_parallel_and_nan():
    rng = np.random.default_rng(1)
    x = uniform(rng, (8, 32, 26, 26))
    x[0, 0, 3, 4] = np.nan
    with num_threads(2):
        y, am = omp.maxpool2d_forward(x, 2, 2)
        y_ref, am_ref = ref.maxpool2d_forward(x, 2, 2)
        assert np.array_equal(am, am_ref)
        np.testing.assert_array_equal(y, y_ref)  # NaN == NaN for assert_array_equal
        dy = uniform(rng, y.shape)
        close(omp.maxpool2d_backward(dy, am, x.shape), ref.maxpool2d_backward(dy, am_ref, x.shape))
        # overlapping windows (stride < kernel) accumulate into shared inputs
        y, am = omp.maxpool2d_forward(x[:, :, :25, :25], 3, 1)
        dy = uniform(rng, y.shape)
        close(omp.maxpool2d_backward(dy, am, (8, 32, 25, 25)), ref.maxpool2d_backward(dy, am, (8, 32, 25, 25)))


@pytest.mark.parametrize("W", [2, 3, 15, 16, 17, 31, 32, 33, 34, 35, 64, 65])
def test_maxpool2x2_vector_path_keeps_the_generic_bits(W):
    """2x2 windows at stride 2 run 16 (AVX-512) or 8 (AVX2) windows at a time with masked loads:
    every width around those chunk sizes gives the reference's values and first-maximum indices,
    with ties, NaN and -0.0 in the data, unfused and fused (a 1x1 filter of weight 1 passes x
    through the convolution exactly, so the fused op's ReLU and pooling see x itself)."""
    rng = np.random.default_rng(W)
    x = rng.integers(-2, 3, size=(3, 2, 7, W)).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = np.nan
    x[rng.random(x.shape) < 0.05] = -0.0
    y, am = omp.maxpool2d_forward(x, 2, 2)
    y_ref, am_ref = ref.maxpool2d_forward(x, 2, 2)
    assert am.dtype == np.uint16 and np.array_equal(am, am_ref)
    assert np.array_equal(y.view(np.uint32), y_ref.view(np.uint32))  # NaN and -0.0 bit for bit
    w = np.ones((1, 1, 1, 1), np.float32)
    for threads in (1, 2):
        with num_threads(threads):
            yf, amf = omp.conv2d_relu_maxpool2d_forward(x[:, :1], w, None, 1, 0, 2, 2)
        assert np.array_equal(amf, am_ref[:, :1])
        want = ref.relu_forward(y_ref[:, :1])
        assert np.array_equal(yf.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ linear
@SETTINGS
@given(
    st.integers(1, 64), st.integers(1, 300), st.integers(1, 50), st.booleans(),
    st.sampled_from([1, 2]), st.integers(0, 2**31 - 1),
)
def test_linear_matches_reference(N, F, G, bias, threads, seed):
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, F))
    w = uniform(rng, (G, F), 1 / np.sqrt(F))
    b = uniform(rng, (G,)) if bias else None
    dy = uniform(rng, (N, G), 1 / np.sqrt(N))
    with num_threads(threads):
        close(omp.linear_forward(x, w, b), ref.linear_forward(x, w, b))
        need_dx, need_db = bool(seed & 1), bool(seed & 2)
        for g, e in zip(omp.linear_backward(x, w, dy, need_dx, need_db), ref.linear_backward(x, w, dy, need_dx, need_db)):
            close(g, e)


@pytest.mark.parametrize("N, F, G", [(256, 512, 128), (4, 2048, 512), (512, 64, 3)])
def test_linear_parallel_split_deterministic(N, F, G):
    rng = np.random.default_rng(5)
    x, w, b = uniform(rng, (N, F)), uniform(rng, (G, F), 1 / np.sqrt(F)), uniform(rng, (G,))
    dy = uniform(rng, (N, G), 1 / np.sqrt(N))
    out = {}
    for threads in (1, 2):
        with num_threads(threads):
            out[threads] = (omp.linear_forward(x, w, b),) + omp.linear_backward(x, w, dy)
            again = (omp.linear_forward(x, w, b),) + omp.linear_backward(x, w, dy)
        for a, c in zip(again, out[threads]):
            assert np.array_equal(a, c)
    want = (ref.linear_forward(x, w, b),) + ref.linear_backward(x, w, dy)
    for a, c, e in zip(out[1], out[2], want):
        close(a, e)
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


@settings(SETTINGS, max_examples=max(10, SETTINGS.max_examples // 2))
@given(
    st.integers(1, 37), st.integers(2048, 2600), st.integers(1, 16), st.booleans(),
    st.sampled_from([1, 2]), st.integers(0, 2**31 - 1),
)
def test_linear_narrow_kernels_match_reference(N, F, G, bias, threads, seed):
    """Few outputs over >= 2048 inputs take the narrow kernels: oracle, sgemm and thread-count checks."""
    from parconv._ext import _dense

    assert omp._narrow(np.empty((1, F), np.float32), np.empty((G, F), np.float32))
    rng = np.random.default_rng(seed)
    x = uniform(rng, (N, F))
    w = uniform(rng, (G, F), 1 / np.sqrt(F))
    b = uniform(rng, (G,)) if bias else None
    dy = uniform(rng, (N, G), 1 / np.sqrt(N))
    need_dx, need_db = bool(seed & 1), bool(seed & 2)
    with num_threads(threads):
        y = omp.linear_forward(x, w, b)
        grads = omp.linear_backward(x, w, dy, need_dx, need_db)
    close(y, ref.linear_forward(x, w, b))
    for g, e in zip(grads, ref.linear_backward(x, w, dy, need_dx, need_db)):
        close(g, e)
    # each row (forward) and each column (backward) belongs to one thread: the same bits at 1 thread
    with num_threads(1):
        assert np.array_equal(y, omp.linear_forward(x, w, b))
        for g, e in zip(grads, omp.linear_backward(x, w, dy, need_dx, need_db)):
            assert (g is None and e is None) or np.array_equal(g, e)
    # and the sgemm path agrees within float32 rounding
    sg = OpenMPBackend()
    sg.narrow_linear = False
    assert not sg._narrow(x, w)
    np.testing.assert_allclose(sg.linear_forward(x, w, b), y, rtol=1e-5, atol=1e-6)
    assert _dense.NARROW_MAX_G == 16


@pytest.mark.parametrize("N, F, G", [(1, 1, 1), (2, 15, 16), (3, 17, 5), (9, 40, 10), (33, 300, 7), (64, 1000, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_narrow_kernels_edge_shapes(N, F, G, threads):
    """The narrow kernels called directly on shapes the backend gives sgemm: odd rows, tails, tiny F."""
    from parconv._ext import _dense

    rng = np.random.default_rng(N * 1000 + F)
    x, w, b = uniform(rng, (N, F)), uniform(rng, (G, F), 1 / np.sqrt(F)), uniform(rng, (G,))
    dy = uniform(rng, (N, G), 1 / np.sqrt(N))
    y = np.full((N, G), np.nan, np.float32)
    dx, dw, db = (np.full(s, np.nan, np.float32) for s in ((N, F), (G, F), (G,)))
    _dense.linear_forward(x, w, b, y, threads, True)
    _dense.linear_backward(x, w, dy, dx, dw, db, threads, True)
    close(y, ref.linear_forward(x, w, b))
    for g, e in zip((dx, dw, db), ref.linear_backward(x, w, dy)):
        close(g, e)
    dw2 = np.full((G, F), np.nan, np.float32)
    _dense.linear_backward(x, w, dy, None, dw2, None, threads, True)
    assert np.array_equal(dw2, dw)
    with pytest.raises(ValueError, match="at most 16 outputs"):
        _dense.linear_forward(np.ones((2, 3), np.float32), np.ones((17, 3), np.float32), None,
                              np.empty((2, 17), np.float32), threads, True)


@pytest.mark.parametrize("runs", [1, 2, 4, 1000])
def test_linear_narrow_dw_runs_keep_bits(runs):
    """How the columns of the dw-only narrow backward are split over threads changes no bit."""
    from parconv._ext import _dense

    rng = np.random.default_rng(runs)
    x, w, dy = uniform(rng, (37, 5408)), uniform(rng, (10, 5408), 0.01), uniform(rng, (37, 10))
    want = np.empty((10, 5408), np.float32)
    _dense.linear_backward(x, w, dy, None, want, None, 1, True)
    old = _dense._set_narrow_dw_runs_per_thread(runs)
    try:
        got = np.full((10, 5408), np.nan, np.float32)
        _dense.linear_backward(x, w, dy, None, got, None, 2, True)
    finally:
        assert _dense._set_narrow_dw_runs_per_thread(old) == runs
    assert np.array_equal(got, want)
    close(got, ref.linear_backward(x, w, dy, False, False)[1])
    with pytest.raises(ValueError, match="runs per thread must be >= 1"):
        _dense._set_narrow_dw_runs_per_thread(0)


def test_linear_narrow_kernels_propagate_nan():
    x = np.zeros((4, 4096), np.float32)
    x[2, 100] = np.nan
    w = np.ones((10, 4096), np.float32)
    dy = np.ones((4, 10), np.float32)
    y = omp.linear_forward(x, w, None)
    assert np.isnan(y[2]).all() and not np.isnan(y[[0, 1, 3]]).any()
    dx, dw, _ = omp.linear_backward(x, w, dy)
    assert np.isnan(dw[:, 100]).all() and not np.isnan(np.delete(dw, 100, axis=1)).any()
    assert not np.isnan(dx).any()


# ------------------------------------------------------------- activations
@pytest.mark.parametrize("shape", [(3,), (7, 5), (4, 8, 33, 33)])  # the last one runs in parallel
@pytest.mark.parametrize("threads", [1, 2])
def test_activations_match_reference(shape, threads):
    rng = np.random.default_rng(11)
    x = uniform(rng, shape, 30)
    x.flat[0] = 1e4
    x.flat[-1] = -1e4
    dy = uniform(rng, shape)
    with num_threads(threads), np.errstate(over="raise", invalid="raise"):
        for op in ("relu", "sigmoid"):
            y = getattr(omp, f"{op}_forward")(x)
            y_ref = getattr(ref, f"{op}_forward")(x)
            assert np.all(np.isfinite(y))
            close(y, y_ref, rtol=1e-6, atol=1e-7)
            # the same forward output into both backwards: 1 - y near y = 1 amplifies any ulp
            close(getattr(omp, f"{op}_backward")(y_ref, dy), getattr(ref, f"{op}_backward")(y_ref, dy),
                  rtol=1e-6, atol=1e-7)
    assert y.shape == shape


def test_sigmoid_vectorised_exp_accuracy():
    # the kernel's own exp: within a few ulp of NumPy's over the whole range, saturating cleanly
    x = np.concatenate([np.linspace(-120, 120, 200_001, dtype=np.float32),
                        np.array([np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)])
    with num_threads(2), np.errstate(under="ignore"):
        y = omp.sigmoid_forward(x)
        y_ref = ref.sigmoid_forward(x)
    close(y, y_ref, rtol=1e-6, atol=1e-7)
    assert y[-4] == 1.0 and 0.0 <= y[-3] < 1e-37 and y[-2] == y[-1] == 0.5


def test_activations_propagate_nan():
    x = np.array([np.nan, -1.0, 2.0], dtype=np.float32)
    assert np.isnan(omp.relu_forward(x)[0]) and np.isnan(omp.sigmoid_forward(x)[0])


# ------------------------------------------------------------------ losses
@pytest.mark.parametrize("N, G", [(1, 1), (5, 10), (4000, 10)])
@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_cross_entropy_and_argmax(N, G, threads):
    rng = np.random.default_rng(N)
    logits = uniform(rng, (N, G), 50)
    logits[0, :] = 1000.0  # ties and a large constant: stable log-sum-exp, first index wins
    labels = rng.integers(0, G, N).astype(np.int32)
    with num_threads(threads):
        loss, probs = omp.softmax_cross_entropy_forward(logits, labels)
        loss_ref, probs_ref = ref.softmax_cross_entropy_forward(logits, labels)
        assert isinstance(loss, float)
        assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-6)
        close(probs, probs_ref)
        close(omp.softmax_cross_entropy_backward(probs_ref, labels), ref.softmax_cross_entropy_backward(probs_ref, labels))
        assert omp.count_correct(logits, labels) == ref.count_correct(logits, labels)
        am = omp.argmax_rows(logits)
        assert am.dtype == np.int32
        assert np.array_equal(am, ref.argmax_rows(logits))


def test_softmax_cross_entropy_nan_and_argmax_nan():
    logits = np.array([[0.0, np.nan, 1.0], [1.0, 2.0, 2.0]], dtype=np.float32)
    labels = np.array([0, 2], dtype=np.int32)
    loss, _ = omp.softmax_cross_entropy_forward(logits, labels)
    assert np.isnan(loss)
    assert np.array_equal(omp.argmax_rows(logits), ref.argmax_rows(logits))  # NaN counts as the max


@pytest.mark.parametrize("shape", [(7, 1), (300, 200)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bce_matches_reference_with_clipping(shape, threads):
    rng = np.random.default_rng(2)
    p = rng.uniform(0, 1, size=shape).astype(np.float32)
    p.flat[0], p.flat[1] = 0.0, 1.0  # clipped: finite loss, zero gradient
    t = (rng.uniform(size=shape) > 0.5).astype(np.float32)
    eps = 1e-7
    with num_threads(threads):
        loss = omp.bce_forward(p, t, eps)
        assert isinstance(loss, float) and np.isfinite(loss)
        assert loss == pytest.approx(ref.bce_forward(p, t, eps), rel=1e-5)
        close(omp.bce_backward(p, t, eps), ref.bce_backward(p, t, eps))


# --------------------------------------------------------------- optimizer
@pytest.mark.parametrize("n", [10, 100_003])
@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_sgd_update_bitwise_equal(n, momentum, nesterov, weight_decay):
    rng = np.random.default_rng(n)
    p, g = uniform(rng, (n,)), uniform(rng, (n,))
    v = uniform(rng, (n,)) if momentum else None
    p2, v2 = p.copy(), None if v is None else v.copy()
    with num_threads(2):
        omp.sgd_update(p, g, v, 0.1, momentum, weight_decay, nesterov)
    ref.sgd_update(p2, g, v2, 0.1, momentum, weight_decay, nesterov)
    assert np.array_equal(p, p2)
    if v is not None:
        assert np.array_equal(v, v2)


@pytest.mark.parametrize("n", [10, 100_003])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("step", [1, 10])
def test_adam_update_bitwise_equal(n, weight_decay, step):
    rng = np.random.default_rng(step)
    p, g = uniform(rng, (n,)), uniform(rng, (n,))
    m, v = uniform(rng, (n,), 0.1), np.abs(uniform(rng, (n,), 0.01))
    p2, m2, v2 = p.copy(), m.copy(), v.copy()
    with num_threads(2):
        omp.adam_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, weight_decay, step)
    ref.adam_update(p2, g, m2, v2, 1e-3, 0.9, 0.999, 1e-8, weight_decay, step)
    assert np.array_equal(p, p2) and np.array_equal(m, m2) and np.array_equal(v, v2)


# ---------------------------------------------------------------- plumbing
def test_build_info():
    assert isinstance(openmp_enabled(), bool)
    assert omp_max_threads() >= 1
    info = omp.info()
    assert info["openmp_enabled"] == openmp_enabled() == omp.openmp_enabled
    assert omp.name == "openmp" and omp.host_arrays


def test_blas_limit_is_restored():
    libs = _blas_one_thread._controllers()
    before = [lib.get_num_threads() for lib in libs]
    with _blas_one_thread:
        with _blas_one_thread:  # re-entrant
            assert all(lib.get_num_threads() == 1 for lib in libs)
        assert all(lib.get_num_threads() == 1 for lib in libs)
    assert [lib.get_num_threads() for lib in libs] == before


def test_blas_limit_restores_a_multi_thread_setting_even_on_error():
    from threadpoolctl import threadpool_limits

    libs = _blas_one_thread._controllers()
    with threadpool_limits(limits=2, user_api="blas"):
        before = [lib.get_num_threads() for lib in libs]
        with pytest.raises(KeyError):
            with _blas_one_thread:
                assert all(lib.get_num_threads() == 1 for lib in libs)
                raise KeyError("boom")
        assert [lib.get_num_threads() for lib in libs] == before
        # a kernel that calls sgemm leaves the setting as it found it too
        rng = np.random.default_rng(0)
        omp.linear_forward(rng.random((64, 256), dtype=np.float32), rng.random((128, 256), dtype=np.float32), None)
        assert [lib.get_num_threads() for lib in libs] == before


def test_blas_limit_hooks_reject_bad_use():
    from parconv._ext import _threads

    if not _threads.blas_hooked():
        pytest.skip("this BLAS goes through threadpoolctl")
    with pytest.raises(RuntimeError, match="without"):
        _threads.blas_limit_exit()
    with pytest.raises(ValueError, match="both"):
        _threads.blas_hooks(1, 0)


def test_registry_finds_openmp():
    from parconv.backends import get

    assert get("openmp").name == "openmp"


# ------------------------------------------------------------------ buffer pool
def test_buffer_pool_reuses_only_unreferenced_buffers():
    from parconv.backends.openmp import _BufferPool

    pool = _BufferPool(min_bytes=1024, max_bytes=64 * 1024)
    a = pool.empty((16, 64))  # 4 KiB: pooled
    a_ptr = a.__array_interface__["data"][0]
    a[...] = 1.0
    b = pool.empty((16, 64))
    assert b.__array_interface__["data"][0] != a_ptr  # a is alive: never handed out twice
    view = a[3:, ::2].T  # a view of a view still pins the buffer
    del a
    c = pool.empty((16, 64))
    assert c.__array_interface__["data"][0] != a_ptr
    assert np.all(view == 1.0)
    del view
    d = pool.empty((64, 16), np.int32)  # same bytes, any shape and dtype
    assert d.__array_interface__["data"][0] == a_ptr
    assert d.shape == (64, 16) and d.dtype == np.int32 and d.flags.c_contiguous and d.flags.writeable
    small = pool.empty((3, 5))  # under min_bytes: a plain array
    assert small.base is None
    del b, c, d
    assert pool.nbytes == 3 * 4096
    for _ in range(40):  # beyond max_bytes the least recently used buffers are forgotten
        pool.empty((1024 + _,), np.float32)
    assert pool.nbytes <= 64 * 1024
    pool.clear()
    assert pool.nbytes == 0


def test_backend_outputs_survive_later_ops():
    """Pooled outputs a caller still holds keep their values across later ops of the same size."""
    be = OpenMPBackend()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 256, 300), dtype=np.float32)  # 9.8 MB: pooled
    y1 = be.relu_forward(x)
    keep = y1.copy()
    y2 = be.relu_forward(-x)
    assert np.array_equal(y1, keep)
    assert not np.shares_memory(y1, y2)
    del y1
    y3 = be.relu_forward(x)  # reuses y1's buffer
    assert np.array_equal(y3, keep)
    assert be._pool.nbytes >= 2 * x.nbytes
    be.release_memory()
    assert be._pool.nbytes == 0
    assert np.array_equal(y3, keep)  # released buffers stay valid for whoever still holds them


def test_mid_size_outputs_and_gradients_come_from_the_pool():
    """Outputs from glibc's mmap threshold (128 KiB) up are pooled: a training step's fused outputs
    and head gradient get the same memory back every step instead of fresh pages."""
    from parconv.backends.openmp import POOL_MIN_BYTES

    assert POOL_MIN_BYTES <= 128 << 10
    be = OpenMPBackend()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((20, 1, 28, 28), dtype=np.float32)
    w = rng.standard_normal((32, 1, 3, 3), dtype=np.float32)
    wl = rng.standard_normal((10, 32 * 169), dtype=np.float32) * 0.01
    dl = rng.standard_normal((20, 10), dtype=np.float32)
    ptrs = []
    for _ in range(2):
        y, am = be.conv2d_relu_maxpool2d_forward(x, w, None, 1, 0, 2, 2)  # 433 KB each
        _, dw, _ = be.linear_backward(y.reshape(20, -1), wl, dl, False, False)  # 216 KB
        ptrs.append({a.__array_interface__["data"][0] for a in (y, am, dw)})
        close(dw, ref.linear_backward(y.reshape(20, -1), wl, dl, False, False)[1])
        del y, am, dw
    assert len(ptrs[0]) == 3 and ptrs[0] == ptrs[1]


@pytest.mark.parametrize("N, O, G", [(1, 16, 10), (6, 16, 10), (7, 16, 10), (16, 32, 3), (4, 13, 16), (9, 13, 7)])
@pytest.mark.parametrize("blocks", [None, 1])
def test_fused_linear_head_gives_the_bits_of_the_composition(N, O, G, blocks):
    """The fused head computes each image's logits with the narrow forward's row kernel and each
    image's pooled gradient with the narrow backward's arithmetic: the same bits as composing
    the fused layer with the narrow linear kernels, at 1 and 2 threads, odd batches included.
    With one image block the backward's pooled gradients go four images per pass, the last
    group short."""
    from parconv._ext import _conv, _dense

    rng = np.random.default_rng(N * 100 + O)
    x = uniform(rng, (N, 1, 28, 28))
    w = uniform(rng, (O, 1, 3, 3), 1 / 3)
    b = uniform(rng, (O,))
    F = O * 13 * 13
    wl = uniform(rng, (G, F), 1 / np.sqrt(F))
    bl = uniform(rng, (G,))
    dl = uniform(rng, (N, G))
    old = _conv._set_fused_backward_image_blocks(1)
    _conv._set_fused_backward_image_blocks(blocks or old)  # None: the default blocks
    try:
        for threads in (1, 2):
            y, am = np.empty((N, O, 13, 13), np.float32), np.empty((N, O, 13, 13), np.int32)
            logits = np.empty((N, G), np.float32)
            assert _conv.conv2d_relu_maxpool2d_forward(x, w, b, y, am, 1, 0, 2, 2, threads, wl, bl, logits)
            y0, am0 = np.empty_like(y), np.empty_like(am)
            assert _conv.conv2d_relu_maxpool2d_forward(x, w, b, y0, am0, 1, 0, 2, 2, threads)
            want_logits = np.empty_like(logits)
            _dense.linear_forward(y0.reshape(N, F), wl, bl, want_logits, threads, True)
            assert np.array_equal(y, y0) and np.array_equal(am, am0)
            assert np.array_equal(logits, want_logits)
            dy = np.empty((N, F), np.float32)
            _dense.linear_backward(y.reshape(N, F), wl, dl, dy, np.empty_like(wl), None, threads, True)
            want = _fused_backward_kernel(x, w, y, am, dy.reshape(y.shape), 0, False, True, threads)
            dw, db = np.empty_like(w), np.empty(O, np.float32)
            _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, db, 0, threads, wl, dl)
            assert np.array_equal(dw, want[1]) and np.array_equal(db, want[2])
    finally:
        _conv._set_fused_backward_image_blocks(old)


def test_fused_linear_head_kernel_checks_its_arguments():
    from parconv._ext import _conv

    rng = np.random.default_rng(5)
    x = uniform(rng, (2, 1, 8, 8))
    w = uniform(rng, (3, 1, 3, 3))
    y, am = omp.conv2d_relu_maxpool2d_forward(x, w, None, 1, 0, 2, 2)  # (2, 3, 3, 3): 27 features
    wl, dl = uniform(rng, (4, 27)), uniform(rng, (2, 4))
    dw = np.empty_like(w)
    with pytest.raises(ValueError, match="head_w must be"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, None, 0, 1, uniform(rng, (4, 26)), dl)
    with pytest.raises(ValueError, match="head_w must be"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, None, 0, 1, uniform(rng, (17, 27)),
                                             uniform(rng, (2, 17)))
    with pytest.raises(ValueError, match="together"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, None, 0, 1, wl, None)
    with pytest.raises(ValueError, match="together"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, y, None, dw, None, 0, 1, wl, dl)
    with pytest.raises(ValueError, match="no linear head"):
        _conv.conv2d_relu_maxpool2d_backward(x, w, y, am, None, None, dw, None, 0, 1)
    y2, am2 = np.empty_like(y), np.empty_like(am)
    with pytest.raises(ValueError, match="head_w must be"):
        _conv.conv2d_relu_maxpool2d_forward(x, w, None, y2, am2, 1, 0, 2, 2, 1, wl, None, np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="head_w must be"):
        _conv.conv2d_relu_maxpool2d_forward(x, w, None, y2, am2, 1, 0, 2, 2, 1, wl, None, None)


def test_fused_linear_head_runs_where_it_pays(monkeypatch):
    """The backend fuses narrow heads of at least NARROW_MIN_FEATURES inputs whose weights fit
    HEAD_MAX_WEIGHT_BYTES, and (backward) only where the fused backward itself runs; it
    composes elsewhere, with the same answer."""
    from parconv._ext import _conv
    from parconv.backends import openmp as omp_mod

    be = OpenMPBackend()
    assert be.fuses_linear_head(omp_mod.NARROW_MIN_FEATURES, 10)
    assert not be.fuses_linear_head(omp_mod.NARROW_MIN_FEATURES - 1, 10)
    assert not be.fuses_linear_head(4096, 17)
    assert not be.fuses_linear_head(omp_mod.HEAD_MAX_WEIGHT_BYTES // 40 + 1, 10)
    be.narrow_linear = False
    assert not be.fuses_linear_head(4096, 10)
    heads = []
    real_fwd, real_bwd = _conv.conv2d_relu_maxpool2d_forward, _conv.conv2d_relu_maxpool2d_backward
    monkeypatch.setattr(omp_mod._conv, "conv2d_relu_maxpool2d_forward",
                        lambda *a: heads.append(("fwd", len(a) > 10)) or real_fwd(*a))
    monkeypatch.setattr(omp_mod._conv, "conv2d_relu_maxpool2d_backward",
                        lambda *a: heads.append(("bwd", len(a) > 10)) or real_bwd(*a))
    rng = np.random.default_rng(21)
    x = uniform(rng, (3, 1, 28, 28))
    w = uniform(rng, (16, 1, 3, 3), 1 / 3)
    wl, dl = uniform(rng, (10, 2704), 0.02), uniform(rng, (3, 10))
    y_ref, _ = ref.conv2d_relu_maxpool2d_forward(x, w, None, 1, 0, 2, 2)
    for narrow, need_dx in ((True, False), (True, True), (False, False)):
        omp.narrow_linear = narrow
        heads.clear()
        try:
            y, am, logits = omp.conv2d_relu_maxpool2d_linear_forward(x, w, None, 1, 0, 2, 2, wl, None)
            dx, dw, db, dwl, dbl = omp.conv2d_relu_maxpool2d_linear_backward(x, w, y, am, wl, dl, 1, 0, need_dx,
                                                                             True, True)
        finally:
            omp.narrow_linear = True
        assert heads[0] == ("fwd", narrow)
        assert ("bwd", True) in heads if narrow and not need_dx else ("bwd", True) not in heads
        close(y, y_ref)
        close(logits, y_ref.reshape(3, -1) @ wl.T)
        want = ref.conv2d_relu_maxpool2d_backward(x, w, y, am, (dl @ wl).reshape(y.shape), 1, 0, need_dx, True)
        for g, e in zip((dx, dw, db, dwl, dbl), want + (dl.T @ y.reshape(3, -1), dl.sum(0))):
            close(g, e)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N, C, O, H, W, K, stride, padding", [
    (4, 16, 32, 32, 32, 3, 2, 1),   # resnet20's stride-2 layer
    (3, 5, 7, 13, 10, 3, 2, 0),     # odd sizes, no padding
    (2, 4, 6, 17, 19, 5, 3, 2),     # stride 3: nine phases
    (2, 8, 4, 9, 9, 2, 2, 1),       # kernel equal to the stride
    (1, 2, 1, 1, 1, 3, 3, 1),       # phases whose columns all lie in the padding
    (2, 3, 2, 5, 4, 3, 3, 2),
])
def test_conv2d_strided_on_phases_matches_reference(N, C, O, H, W, K, stride, padding, threads):
    """Strided layers run forward and dw on the images' phases (whole images per thread):
    both against the reference, and the phases hold every tap's input."""
    rng = np.random.default_rng(N * 100 + C + K)
    x = uniform(rng, (N, C, H, W))
    w = uniform(rng, (O, C, K, K), 1 / np.sqrt(C * K * K))
    b = uniform(rng, (O,))
    y = ref.conv2d_forward(x, w, b, stride, padding)
    dy = uniform(rng, y.shape)
    with num_threads(threads):
        close(omp.conv2d_forward(x, w, b, stride, padding), y)
        for got, want in zip(omp.conv2d_backward(x, w, dy, stride, padding),
                             ref.conv2d_backward(x, w, dy, stride, padding)):
            close(got, want)
