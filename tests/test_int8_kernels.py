"""The int8 kernels (parconv._ext._int8) against NumPy int64 models of the same arithmetic.

Integer accumulation is exact, so every path (AVX512_VNNI, AVX2, portable C), every kernel level
and every thread count must give exactly the model's float32 y: the models sum in int64, add the
int32 bias, convert to float32 and multiply by the float32 scale, as the contract says. Extreme
inputs (uint8 0/255 against int8 -127/127) would saturate a vpmaddubsw-style int16 pair sum, so
they are drawn often.
"""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

from parconv._ext import _int8  # noqa: E402
from conftest import run_at_isa_level

# every path this build level and CPU run, slowest first
PATHS = _int8._paths()


# ------------------------------------------------------------------ NumPy models

def quantize_model(x, scale, zp):
    """clamp(rint(x / scale) + zp, 0, 255) with x / scale in float32, half to even; NaN -> zp."""
    with np.errstate(all="ignore"):
        v = np.asarray(x, np.float32) / np.float32(scale)
        nan = np.isnan(v)
        q = np.clip(np.rint(np.where(nan, 0, v)).astype(np.float64) + zp, 0, 255)
    return np.where(nan, zp, q).astype(np.uint8)


def _finish(acc, bias_q, scale, relu, axis):
    shape = [1] * acc.ndim
    shape[axis] = -1
    if bias_q is not None:
        acc = acc + bias_q.astype(np.int64).reshape(shape)
    y = acc.astype(np.float32) * scale.reshape(shape)
    return np.maximum(y, np.float32(0)) if relu else y


def _tap_patches(xq, z, KH, KW, sh, sw, ph, pw):
    """((P, Q), [(kh, kw, patch)]): per tap, the (N, C, P, Q) int64 values xq - z it meets (padding: 0)."""
    N, C, H, W = xq.shape
    xp = np.zeros((N, C, H + 2 * ph, W + 2 * pw), np.int64)
    xp[:, :, ph:ph + H, pw:pw + W] = xq.astype(np.int64) - z
    P, Q = (H + 2 * ph - KH) // sh + 1, (W + 2 * pw - KW) // sw + 1
    return (P, Q), [(kh, kw, xp[:, :, kh:kh + sh * (P - 1) + 1:sh, kw:kw + sw * (Q - 1) + 1:sw])
                    for kh in range(KH) for kw in range(KW)]


def conv_model(xq, z, wq, bias_q, scale, stride, pad, relu):
    """acc = sum over taps of (xq - z) * wq, padded taps as xq = z; wq (O, C, K, K)."""
    K = wq.shape[2]
    (P, Q), taps = _tap_patches(xq, z, K, K, stride, stride, pad, pad)
    acc = np.zeros((xq.shape[0], wq.shape[0], P, Q), np.int64)
    for kh, kw, patch in taps:
        acc += np.einsum("ncpq,oc->nopq", patch, wq[:, :, kh, kw].astype(np.int64))
    return _finish(acc, bias_q, scale, relu, 1)


def depthwise_model(xq, z, wq, sh, sw, ph, pw, bias_q, scale, relu):
    """Depthwise: channel c with filter wq[c, 0]."""
    (P, Q), taps = _tap_patches(xq, z, wq.shape[2], wq.shape[3], sh, sw, ph, pw)
    acc = np.zeros((xq.shape[0], xq.shape[1], P, Q), np.int64)
    for kh, kw, patch in taps:
        acc += patch * wq[:, 0, kh, kw].astype(np.int64)[None, :, None, None]
    return _finish(acc, bias_q, scale, relu, 1)


def linear_model(xq, z, wq, bias_q, scale, relu):
    acc = (xq.astype(np.int64) - z) @ wq.astype(np.int64).T
    return _finish(acc, bias_q, scale, relu, 1)


# -------------------------------------------------------------------- strategies

ZPS = st.one_of(st.sampled_from([0, 128, 255]), st.integers(0, 255))


def _uint8(rng, shape, extreme):
    if extreme:
        return rng.choice(np.array([0, 255], np.uint8), size=shape)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _int8w(rng, shape, extreme):
    if extreme:
        return rng.choice(np.array([-127, 127], np.int8), size=shape)
    return rng.integers(-127, 128, size=shape, dtype=np.int8)


def _epilogue_args(rng, O, bias_kind):
    scale = rng.uniform(1e-5, 1e-1, O).astype(np.float32)
    if bias_kind == "none":
        bias = None
    elif bias_kind == "small":
        bias = rng.integers(-10 ** 6, 10 ** 6, O).astype(np.int32)
    else:  # near the int32 limits: the epilogue must add in int64
        bias = rng.choice(np.array([2 ** 31 - 1, -2 ** 31, 2 ** 30], np.int64), O).astype(np.int32)
    return scale, bias


@st.composite
def conv_cases(draw):
    K = draw(st.sampled_from([1, 3, 5, 7]))
    S = draw(st.sampled_from([1, 2]))
    pad = draw(st.integers(0, K - 1))
    H = draw(st.integers(max(1, K - 2 * pad), 13))
    # wide rows reach the 16-pixel vector loops of the grid layout (and their tails)
    W = draw(st.one_of(st.integers(max(1, K - 2 * pad), 13), st.integers(30, 70)))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([1, 2, 3, 4, 5, 7, 9, 16, 17])),
                O=draw(st.sampled_from([1, 3, 8, 13, 16, 17, 33, 70])), H=H, W=W, K=K, S=S, pad=pad,
                z=draw(ZPS), extreme=draw(st.booleans()), relu=draw(st.booleans()),
                bias=draw(st.sampled_from(["none", "small", "huge"])), seed=draw(st.integers(0, 2 ** 31)))


def _run_conv(case, path, nt):
    rng = np.random.default_rng(case["seed"])
    N, C, O, H, W, K, S, pad = (case[k] for k in ("N", "C", "O", "H", "W", "K", "S", "pad"))
    xq = _uint8(rng, (N, C, H, W), case["extreme"])
    wq = _int8w(rng, (O, C, K, K), case["extreme"])
    scale, bias = _epilogue_args(rng, O, case["bias"])
    packed, row_sums = _int8.pack_weights(wq.reshape(O, -1))
    P, Q = (H + 2 * pad - K) // S + 1, (W + 2 * pad - K) // S + 1
    y = np.full((N, O, P, Q), np.nan, np.float32)
    old = _int8._use_path(path)
    try:
        _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, K, S, pad, scale, bias, y, case["relu"], nt)
    finally:
        _int8._use_path(old)
    return y, conv_model(xq, case["z"], wq, bias, scale, S, pad, case["relu"])


@settings(max_examples=60)
@given(case=conv_cases())
def test_conv2d_forward_is_exact_on_every_path_and_thread_count(case):
    for path in PATHS:
        for nt in (1, 2):
            y, ref = _run_conv(case, path, nt)
            np.testing.assert_array_equal(y, ref, err_msg=f"path {path}, {nt} threads, {case}")


def test_conv2d_extremes_do_not_saturate():
    # every product 255 * 127 with every tap: a saturating u8 x s8 pair sum would lose most of it
    for path in PATHS:
        for K, C in ((3, 64), (1, 256), (5, 9)):
            xq = np.full((1, C, 6, 6), 255, np.uint8)
            wq = np.full((16, C, K, K), 127, np.int8)
            wq[1::2] = -127
            packed, row_sums = _int8.pack_weights(wq.reshape(16, -1))
            scale = np.ones(16, np.float32)
            y = np.empty((1, 16, 6, 6), np.float32)
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, 0, packed, row_sums, 16, K, 1, K // 2, scale, None, y, False, 2)
            finally:
                _int8._use_path(old)
            np.testing.assert_array_equal(y, conv_model(xq, 0, wq, None, scale, 1, K // 2, False))
            assert y[0, 0, 3, 3] == C * K * K * 255 * 127


def test_conv2d_realistic_layers_every_path():
    # resnet-like shapes: 16..64 channels, 32x32..8x8, stride 1 and 2, 1x1 projections
    rng = np.random.default_rng(7)
    for (N, C, O, HW, K, S) in ((2, 16, 16, 32, 3, 1), (2, 16, 32, 32, 3, 2), (1, 32, 64, 16, 1, 2),
                                (3, 64, 64, 8, 3, 1), (1, 3, 16, 32, 3, 1)):
        xq = rng.integers(0, 256, (N, C, HW, HW), dtype=np.uint8)
        wq = rng.integers(-127, 128, (O, C, K, K), dtype=np.int8)
        scale, bias = _epilogue_args(rng, O, "small")
        packed, row_sums = _int8.pack_weights(wq.reshape(O, -1))
        ref = conv_model(xq, 131, wq, bias, scale, S, K // 2, True)
        for path in PATHS:
            y = np.empty_like(ref)
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, 131, packed, row_sums, O, K, S, K // 2, scale, bias, y, True, 2)
            finally:
                _int8._use_path(old)
            np.testing.assert_array_equal(y, ref, err_msg=path)


@st.composite
def pointwise_cases(draw):
    # 1x1 stride-1 layers lay each 4-channel group out as one row of H*W pixels: channel counts off
    # multiples of 4 and 16, pixel counts off multiples of 16 (the vector loop's tail), 1 and 2 images
    # (runs of one image over threads) and 9 (an image per job)
    return dict(N=draw(st.sampled_from([1, 2, 9])), C=draw(st.sampled_from([1, 3, 4, 7, 16, 17, 33, 64])),
                O=draw(st.sampled_from([1, 5, 16, 24, 40])), H=draw(st.integers(1, 9)), W=draw(st.integers(1, 23)),
                z=draw(ZPS), zq=draw(ZPS), relu=draw(st.booleans()), extreme=draw(st.booleans()),
                bias=draw(st.sampled_from(["none", "small", "huge"])), seed=draw(st.integers(0, 2 ** 31)))


@settings(max_examples=40, deadline=None)
@given(case=pointwise_cases())
def test_conv2d_pointwise_layers_are_exact(case):
    rng = np.random.default_rng(case["seed"])
    N, C, O, H, W = (case[k] for k in ("N", "C", "O", "H", "W"))
    xq = _uint8(rng, (N, C, H, W), case["extreme"])
    wq = _int8w(rng, (O, C, 1, 1), case["extreme"])
    scale, bias = _epilogue_args(rng, O, case["bias"])
    packed, row_sums = _int8.pack_weights(wq.reshape(O, -1))
    ref = conv_model(xq, case["z"], wq, bias, scale, 1, 0, case["relu"])
    want = quantize_model(ref, np.float32(0.0173), case["zq"])
    for path in PATHS:
        for nt in (1, 2):
            y, yq = np.full(ref.shape, np.nan, np.float32), np.full(ref.shape, 7, np.uint8)
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, 1, 1, 0, scale, bias, y, case["relu"], nt)
                _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, 1, 1, 0, scale, bias, None, case["relu"],
                                     nt, yq=yq, yq_scale=0.0173, yq_zero_point=case["zq"])
            finally:
                _int8._use_path(old)
            np.testing.assert_array_equal(y, ref, err_msg=f"path {path}, {nt} threads, {case}")
            np.testing.assert_array_equal(yq, want, err_msg=f"yq: path {path}, {nt} threads, {case}")


@st.composite
def row_tile_cases(draw):
    # output rows of 8, 16 or 32 pixels: with an image per job (N=9), VNNI tiles take whole rows from the grid
    # (8: P a multiple of 4, 16: P even, 32: any P; other P and N=1, runs of one image, take the usual tiles)
    H, W, K, S = draw(st.sampled_from([(8, 8, 3, 1), (12, 8, 3, 1), (10, 8, 3, 1), (8, 8, 1, 1), (16, 16, 3, 1),
                                       (6, 16, 3, 1), (7, 16, 3, 1), (32, 32, 3, 2), (16, 16, 3, 2), (4, 16, 1, 1), (3, 32, 3, 1),
                                       (2, 32, 1, 1), (5, 64, 3, 2)]))
    return dict(N=draw(st.sampled_from([1, 9])), C=draw(st.sampled_from([3, 5, 16, 17])),
                O=draw(st.sampled_from([5, 8, 13, 24])), H=H, W=W, K=K, S=S, z=draw(ZPS), zq=draw(ZPS),
                relu=draw(st.booleans()), out=draw(st.sampled_from(["y", "yq", "both"])),
                shortcut=draw(st.sampled_from(["none", "float", "uint8"])), seed=draw(st.integers(0, 2 ** 31)))


@settings(max_examples=40, deadline=None)
@given(case=row_tile_cases())
def test_conv2d_whole_row_tiles_are_exact(case):
    rng = np.random.default_rng(case["seed"])
    N, C, O, H, W, K, S = (case[k] for k in ("N", "C", "O", "H", "W", "K", "S"))
    pad = K // 2
    xq = _uint8(rng, (N, C, H, W), False)
    wq = _int8w(rng, (O, C, K, K), False)
    scale, bias = _epilogue_args(rng, O, "small")
    packed, row_sums = _int8.pack_weights(wq.reshape(O, -1))
    y0 = conv_model(xq, case["z"], wq, bias, scale, S, pad, False)
    rf = rq = None
    if case["shortcut"] == "float":
        rf = (rng.standard_normal(y0.shape) * np.abs(y0).max()).astype(np.float32)
    elif case["shortcut"] == "uint8":
        rq = rng.integers(0, 256, y0.shape, dtype=np.uint8)
    if case["shortcut"] == "none":
        ref = conv_model(xq, case["z"], wq, bias, scale, S, pad, case["relu"])
    else:
        ref = residual_model(y0, rf, rq, 0.031, 17, case["relu"])
    for path in PATHS:
        for nt in (1, 2):
            y = np.full(ref.shape, np.nan, np.float32) if case["out"] != "yq" else None
            yq = np.full(ref.shape, 7, np.uint8) if case["out"] != "y" else None
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, K, S, pad, scale, bias, y, case["relu"], nt,
                                     yq=yq, yq_scale=0.0173, yq_zero_point=case["zq"], residual=rf, residual_q=rq,
                                     residual_scale=0.031, residual_zero_point=17)
            finally:
                _int8._use_path(old)
            msg = f"path {path}, {nt} threads, {case}"
            if y is not None:
                np.testing.assert_array_equal(y, ref, err_msg=msg)
            if yq is not None:
                np.testing.assert_array_equal(yq, quantize_model(ref, np.float32(0.0173), case["zq"]), err_msg=msg)


def test_conv2d_requantizes_ties_exactly():
    # outputs on and next to half-integers of the next layer's scale: the epilogue's product by the reciprocal
    # is redone as a division for the pair of vectors holding such a lane, as the quantize pass does
    # (the clamp to the next layer's range, with or without the ReLU as its lower bound, and at zero points that
    # put either end of that range among the outputs)
    rng = np.random.default_rng(9)
    for sq, sc in ((2.0, 1.0), (0.1, 0.05), (0.3, 0.15), (1 / 3, 1 / 6)):
        for shortcut, relu, zq in ((False, True, 3), (True, True, 3), (False, False, 3), (False, False, 0),
                                   (False, True, 255), (False, False, 200), (True, False, 128)):
            xq = rng.integers(0, 256, (9, 4, 8, 8), dtype=np.uint8)
            wq = rng.integers(-3, 4, (11, 4, 3, 3), dtype=np.int8)
            scale = np.full(11, sc, np.float32)
            packed, row_sums = _int8.pack_weights(wq.reshape(11, -1))
            y0 = conv_model(xq, 128, wq, None, scale, 1, 1, False)
            rq = rng.integers(0, 256, y0.shape, dtype=np.uint8) if shortcut else None
            ref = residual_model(y0, None, rq, sc, 100, relu) if shortcut else (
                np.maximum(y0, np.float32(0)) if relu else y0)
            want = quantize_model(ref, np.float32(sq), zq)
            for path in PATHS:
                yq = np.empty(ref.shape, np.uint8)
                old = _int8._use_path(path)
                try:
                    _int8.conv2d_forward(xq, 128, packed, row_sums, 11, 3, 1, 1, scale, None, None, relu, 1, yq=yq,
                                         yq_scale=sq, yq_zero_point=zq, residual_q=rq, residual_scale=sc,
                                         residual_zero_point=100)
                finally:
                    _int8._use_path(old)
                np.testing.assert_array_equal(yq, want, err_msg=f"{path} sq={sq} shortcut={shortcut} relu={relu} "
                                                                f"zq={zq}")


def test_conv2d_partial_channel_groups_on_narrow_and_wide_rows():
    # a group of 1-3 channels (a first layer's RGB) fills the missing ones from a row of the zero point, up to
    # rows of 512 pixels; wider rows take the per-channel loop
    rng = np.random.default_rng(5)
    for W in (5, 37, 512, 513, 600):
        for C in (1, 2, 3, 6):
            for K, S, pad in ((3, 1, 1), (3, 2, 1), (2, 2, 0), (5, 1, 2)):
                xq = rng.integers(0, 256, (2, C, 3, W), dtype=np.uint8)
                wq = rng.integers(-127, 128, (5, C, K, K), dtype=np.int8)
                scale, bias = _epilogue_args(rng, 5, "small")
                packed, row_sums = _int8.pack_weights(wq.reshape(5, -1))
                ref = conv_model(xq, 201, wq, bias, scale, S, pad, True)
                for path in PATHS:
                    y = np.full(ref.shape, np.nan, np.float32)
                    old = _int8._use_path(path)
                    try:
                        _int8.conv2d_forward(xq, 201, packed, row_sums, 5, K, S, pad, scale, bias, y, True, 2)
                    finally:
                        _int8._use_path(old)
                    np.testing.assert_array_equal(y, ref, err_msg=f"{path} W={W} C={C} K={K} S={S} pad={pad}")


def test_conv2d_stride2_grid_rows_of_every_width_and_phase():
    # stride-2 grids take 16 columns of a phase from 32 bytes of the row: the even bytes, or the odd ones of the
    # window one byte earlier where the even window would pass the row's end; widths about 32 and 64 with
    # every padding meet both windows and the scalar tail (the last image's last row ends the input buffer)
    rng = np.random.default_rng(3)
    for W in (30, 31, 32, 33, 34, 63, 64, 65):
        for K, pad in ((3, 0), (3, 1), (3, 2), (5, 2), (2, 0), (1, 0)):
            for N, C in ((1, 4), (6, 8), (2, 5)):
                xq = rng.integers(0, 256, (N, C, 5, W), dtype=np.uint8)
                wq = rng.integers(-127, 128, (9, C, K, K), dtype=np.int8)
                scale, bias = _epilogue_args(rng, 9, "small")
                packed, row_sums = _int8.pack_weights(wq.reshape(9, -1))
                ref = conv_model(xq, 99, wq, bias, scale, 2, pad, False)
                for path in PATHS:
                    y = np.full(ref.shape, np.nan, np.float32)
                    old = _int8._use_path(path)
                    try:
                        _int8.conv2d_forward(xq, 99, packed, row_sums, 9, K, 2, pad, scale, bias, y, False, 1)
                    finally:
                        _int8._use_path(old)
                    np.testing.assert_array_equal(y, ref, err_msg=f"{path} W={W} K={K} pad={pad} N={N} C={C}")


@st.composite
def dw_cases(draw):
    KH, KW = draw(st.sampled_from([1, 3, 5])), draw(st.sampled_from([1, 3, 5]))
    ph, pw = draw(st.integers(0, KH - 1)), draw(st.integers(0, KW - 1))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.integers(1, 11)), KH=KH, KW=KW, ph=ph, pw=pw,
                H=draw(st.integers(max(1, KH - 2 * ph), 12)), W=draw(st.integers(max(1, KW - 2 * pw), 12)),
                sh=draw(st.sampled_from([1, 2, 3])), sw=draw(st.sampled_from([1, 2])), z=draw(ZPS),
                extreme=draw(st.booleans()), relu=draw(st.booleans()),
                bias=draw(st.sampled_from(["none", "small", "huge"])), seed=draw(st.integers(0, 2 ** 31)))


def _depthwise_case(case):
    """(xq, wq, scale, bias, the model's float32 output) of a drawn depthwise case."""
    rng = np.random.default_rng(case["seed"])
    N, C, H, W, KH, KW = (case[k] for k in ("N", "C", "H", "W", "KH", "KW"))
    xq = _uint8(rng, (N, C, H, W), case["extreme"])
    wq = _int8w(rng, (C, 1, KH, KW), case["extreme"])
    scale, bias = _epilogue_args(rng, C, case["bias"])
    ref = depthwise_model(xq, case["z"], wq, *(case[k] for k in ("sh", "sw", "ph", "pw")), bias, scale, case["relu"])
    return xq, wq, scale, bias, ref


@settings(max_examples=60)
@given(case=dw_cases())
def test_depthwise_forward_is_exact(case):
    xq, wq, scale, bias, ref = _depthwise_case(case)
    sh, sw, ph, pw = (case[k] for k in ("sh", "sw", "ph", "pw"))
    for nt in (1, 2):
        y = np.full(ref.shape, np.nan, np.float32)
        _int8.depthwise_forward(xq, case["z"], wq, sh, sw, ph, pw, scale, bias, y, case["relu"], nt)
        np.testing.assert_array_equal(y, ref, err_msg=f"{nt} threads, {case}")


@pytest.mark.parametrize("H,W,sh,sw,K", [(5, 70, 1, 1, 3), (4, 67, 2, 2, 3), (3, 33, 1, 2, 5), (6, 64, 2, 1, 3),
                                         (2, 31, 1, 2, 1)])
def test_depthwise_wide_rows_every_vector_tail(H, W, sh, sw, K):
    # rows longer than one vector (32 pixels at stride 1, 16 at stride 2) and their masked tails
    rng = np.random.default_rng(W)
    xq = rng.integers(0, 256, (2, 3, H, W), dtype=np.uint8)
    wq = rng.integers(-127, 128, (3, 1, K, K), dtype=np.int8)
    scale, bias = _epilogue_args(rng, 3, "small")
    ref = depthwise_model(xq, 77, wq, sh, sw, K // 2, K // 2, bias, scale, True)
    for nt in (1, 2):
        y, yq = np.full(ref.shape, np.nan, np.float32), np.empty(ref.shape, np.uint8)
        _int8.depthwise_forward(xq, 77, wq, sh, sw, K // 2, K // 2, scale, bias, y, True, nt, yq=yq, yq_scale=0.37,
                                yq_zero_point=9)
        np.testing.assert_array_equal(y, ref)
        np.testing.assert_array_equal(yq, quantize_model(ref, np.float32(0.37), 9))


@st.composite
def dw_block_cases(draw):
    KH, KW = draw(st.sampled_from([1, 2, 3, 5])), draw(st.sampled_from([1, 3, 4]))
    ph, pw = draw(st.integers(0, KH - 1)), draw(st.integers(0, KW - 1))
    return dict(N=draw(st.integers(1, 3)), C=draw(st.sampled_from([1, 7, 16, 17, 32, 40])), KH=KH, KW=KW, ph=ph,
                pw=pw, H=draw(st.integers(max(1, KH - 2 * ph), 11)), W=draw(st.integers(max(1, KW - 2 * pw), 19)),
                sh=draw(st.sampled_from([1, 2])), sw=draw(st.sampled_from([1, 2, 3])), z=draw(ZPS),
                extreme=draw(st.booleans()), relu=draw(st.booleans()),
                bias=draw(st.sampled_from(["none", "small", "huge"])), keep_y=draw(st.booleans()),
                sq=draw(st.sampled_from([0.013, 0.37, 5.0])), zq=draw(st.sampled_from([0, 9, 255])),
                seed=draw(st.integers(0, 2 ** 31)))


@settings(max_examples=60, deadline=None)
@given(case=dw_block_cases())
def test_depthwise_channel_blocks_and_planes_are_exact(case):
    # both layouts (16-channel blocks with the channels on the lanes, and one plane at a time) on full and
    # partial blocks, odd widths, padding and strides: the model's float32 outputs and their uint8 quantization
    xq, wq, scale, bias, ref = _depthwise_case(case)
    sh, sw, ph, pw = (case[k] for k in ("sh", "sw", "ph", "pw"))
    want_q = quantize_model(ref, np.float32(case["sq"]), case["zq"])
    for mode, path in [("blocks", p) for p in PATHS] + [("planes", PATHS[-1])]:
        old, old_path = _int8._use_depthwise(mode), _int8._use_path(path)
        try:
            for nt in (1, 2):
                y = np.full(ref.shape, np.nan, np.float32) if case["keep_y"] else None
                yq = np.empty(ref.shape, np.uint8)
                _int8.depthwise_forward(xq, case["z"], wq, sh, sw, ph, pw, scale, bias, y, case["relu"], nt, yq=yq,
                                        yq_scale=case["sq"], yq_zero_point=case["zq"])
                if y is not None:
                    np.testing.assert_array_equal(y, ref, err_msg=f"{mode} {path}, {nt} threads, {case}")
                np.testing.assert_array_equal(yq, want_q, err_msg=f"{mode} {path}, {nt} threads, {case}")
                y = np.full(ref.shape, np.nan, np.float32)
                _int8.depthwise_forward(xq, case["z"], wq, sh, sw, ph, pw, scale, bias, y, case["relu"], nt)
                np.testing.assert_array_equal(y, ref, err_msg=f"{mode}, float32 only, {nt} threads, {case}")
        finally:
            _int8._use_depthwise(old)
            _int8._use_path(old_path)


def test_depthwise_requantizes_ties_exactly():
    # as test_conv2d_requantizes_ties_exactly, for both depthwise layouts on every path (the channel blocks'
    # epilogues quantize on the registers)
    rng = np.random.default_rng(11)
    for sq, sc in ((2.0, 1.0), (0.1, 0.05), (0.3, 0.15), (1 / 3, 1 / 6)):
        for relu, zq in ((True, 3), (False, 3), (False, 0), (True, 255), (False, 200)):
            xq = rng.integers(0, 256, (3, 19, 9, 9), dtype=np.uint8)
            wq = rng.integers(-3, 4, (19, 1, 3, 3), dtype=np.int8)
            scale = np.full(19, sc, np.float32)
            ref = depthwise_model(xq, 128, wq, 1, 1, 1, 1, None, scale, relu)
            want = quantize_model(ref, np.float32(sq), zq)
            for mode, path in [("blocks", p) for p in PATHS] + [("planes", PATHS[-1])]:
                old, old_path = _int8._use_depthwise(mode), _int8._use_path(path)
                try:
                    yq = np.empty(ref.shape, np.uint8)
                    _int8.depthwise_forward(xq, 128, wq, 1, 1, 1, 1, scale, None, None, relu, 1, yq=yq, yq_scale=sq,
                                            yq_zero_point=zq)
                finally:
                    _int8._use_depthwise(old)
                    _int8._use_path(old_path)
                np.testing.assert_array_equal(yq, want, err_msg=f"{mode} {path} sq={sq} relu={relu} zq={zq}")


def test_non_finite_scales_quantize_nan_to_the_zero_point():
    # a scale that overflowed float32 (or a NaN one) makes inf and NaN outputs: the epilogues that assume finite
    # values are not taken, and NaN quantizes to the zero point on every path and layout, as the model says
    rng = np.random.default_rng(12)
    xq = rng.integers(0, 256, (2, 16, 6, 6), dtype=np.uint8)
    scale = np.ones(16, np.float32) * np.float32(0.01)
    scale[[1, 5]], scale[9] = np.inf, np.nan
    wq = rng.integers(-5, 6, (16, 16, 3, 3), dtype=np.int8)
    wq[5] = 0  # 0 * inf: NaN
    packed, row_sums = _int8.pack_weights(wq.reshape(16, -1))
    wd = rng.integers(-5, 6, (16, 1, 3, 3), dtype=np.int8)
    wd[5] = 0
    for relu in (False, True):
        with np.errstate(invalid="ignore"):
            ref = conv_model(xq, 7, wq, None, scale, 1, 1, relu)
            dref = depthwise_model(xq, 7, wd, 1, 1, 1, 1, None, scale, relu)
        for path in PATHS:
            old = _int8._use_path(path)
            try:
                y, yq = np.empty(ref.shape, np.float32), np.empty(ref.shape, np.uint8)
                _int8.conv2d_forward(xq, 7, packed, row_sums, 16, 3, 1, 1, scale, None, y, relu, 2, yq=yq,
                                     yq_scale=0.5, yq_zero_point=40)
                np.testing.assert_array_equal(y, ref)
                np.testing.assert_array_equal(yq, quantize_model(ref, np.float32(0.5), 40))
                for mode in ("blocks", "planes"):
                    was = _int8._use_depthwise(mode)
                    try:
                        y, yq = np.empty(dref.shape, np.float32), np.empty(dref.shape, np.uint8)
                        _int8.depthwise_forward(xq, 7, wd, 1, 1, 1, 1, scale, None, y, relu, 2, yq=yq,
                                                yq_scale=0.5, yq_zero_point=40)
                    finally:
                        _int8._use_depthwise(was)
                    np.testing.assert_array_equal(y, dref, err_msg=f"{mode} {path}")
                    np.testing.assert_array_equal(yq, quantize_model(dref, np.float32(0.5), 40),
                                                  err_msg=f"{mode} {path}")
            finally:
                _int8._use_path(old)


def test_depthwise_mode_validates():
    with pytest.raises(ValueError, match="depthwise mode must be one of"):
        _int8._use_depthwise("rows")
    assert _int8._use_depthwise("auto") == "auto"


@st.composite
def linear_cases(draw):
    return dict(N=draw(st.sampled_from([1, 2, 3, 4, 5, 9, 17])), F=draw(st.sampled_from([1, 3, 4, 7, 64, 130, 784])),
                G=draw(st.sampled_from([1, 10, 16, 17, 64, 65, 130])), z=draw(ZPS), extreme=draw(st.booleans()),
                relu=draw(st.booleans()), bias=draw(st.sampled_from(["none", "small", "huge"])),
                seed=draw(st.integers(0, 2 ** 31)))


@settings(max_examples=60)
@given(case=linear_cases())
def test_linear_forward_is_exact_on_every_path_and_thread_count(case):
    rng = np.random.default_rng(case["seed"])
    N, F, G = case["N"], case["F"], case["G"]
    xq = _uint8(rng, (N, F), case["extreme"])
    wq = _int8w(rng, (G, F), case["extreme"])
    scale, bias = _epilogue_args(rng, G, case["bias"])
    packed, row_sums = _int8.pack_weights(wq)
    ref = linear_model(xq, case["z"], wq, bias, scale, case["relu"])
    for path in PATHS:
        for nt in (1, 2):
            y = np.full((N, G), np.nan, np.float32)
            old = _int8._use_path(path)
            try:
                _int8.linear_forward(xq, case["z"], packed, row_sums, scale, bias, y, case["relu"], nt)
            finally:
                _int8._use_path(old)
            np.testing.assert_array_equal(y, ref, err_msg=f"path {path}, {nt} threads, {case}")


# ----------------------------------------------- outputs requantized for the next layer (yq)

@st.composite
def yq_cases(draw):
    # N from 1 (runs of one image split over threads) to 20 (a whole image per job); with y kept or not
    return dict(N=draw(st.sampled_from([1, 2, 3, 9, 20])), C=draw(st.sampled_from([1, 3, 8, 17])),
                O=draw(st.sampled_from([1, 8, 17, 64])), HW=draw(st.integers(1, 12)), K=draw(st.sampled_from([1, 3])),
                S=draw(st.sampled_from([1, 2])), z=draw(ZPS), zq=draw(ZPS), relu=draw(st.booleans()),
                keep_y=draw(st.booleans()), sq=draw(st.sampled_from([1e-3, 0.02, 0.7, 3.0])),
                bias=draw(st.sampled_from(["none", "small", "huge"])), seed=draw(st.integers(0, 2 ** 31)))


def _yq_outputs(case, shape):
    y = np.full(shape, np.nan, np.float32) if case["keep_y"] else None
    return y, np.full(shape, 7, np.uint8)


def _check_yq(y, yq, ref, case, msg):
    np.testing.assert_array_equal(yq, quantize_model(ref, np.float32(case["sq"]), case["zq"]), err_msg=msg)
    if y is not None:
        np.testing.assert_array_equal(y, ref, err_msg=msg)


def _conv_case(case):
    """(its generator, xq, wq, scale, bias, packed weights, row sums) of a drawn convolution case."""
    rng = np.random.default_rng(case["seed"])
    N, C, O, HW, K = (case[k] for k in ("N", "C", "O", "HW", "K"))
    xq = _uint8(rng, (N, C, HW, HW), False)
    wq = _int8w(rng, (O, C, K, K), False)
    scale, bias = _epilogue_args(rng, O, case["bias"])
    packed, row_sums = _int8.pack_weights(wq.reshape(O, -1))
    return rng, xq, wq, scale, bias, packed, row_sums


@settings(max_examples=40, deadline=None)
@given(case=yq_cases())
def test_conv2d_forward_requantizes_for_the_next_layer_exactly(case):
    rng, xq, wq, scale, bias, packed, row_sums = _conv_case(case)
    O, K, S = (case[k] for k in ("O", "K", "S"))
    pad = K // 2
    ref = conv_model(xq, case["z"], wq, bias, scale, S, pad, case["relu"])
    for path in PATHS:
        for nt in (1, 2):
            y, yq = _yq_outputs(case, ref.shape)
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, K, S, pad, scale, bias, y, case["relu"], nt,
                                     yq=yq, yq_scale=case["sq"], yq_zero_point=case["zq"])
            finally:
                _int8._use_path(old)
            _check_yq(y, yq, ref, case, f"path {path}, {nt} threads, {case}")


def residual_model(y, rf, rq, rs, rz, relu):
    """The residual block's epilogue on the convolution's float32 y (no ReLU yet): y + r, then ReLU, where r is the
    float32 shortcut rf or the uint8 one rq dequantized, float32(rq - rz) * rs."""
    r = rf if rf is not None else (rq.astype(np.int32) - rz).astype(np.float32) * np.float32(rs)
    v = (y + r).astype(np.float32)
    return np.maximum(v, np.float32(0)) if relu else v


@settings(max_examples=40, deadline=None)
@given(case=yq_cases(), kind=st.sampled_from(["float", "uint8"]), out=st.sampled_from(["y", "y+yq", "yq"]),
       rs=st.sampled_from([1e-3, 0.02, 0.7]), rz=ZPS)
def test_conv2d_forward_adds_the_residual_shortcut_exactly(case, kind, out, rs, rz):
    rng, xq, wq, scale, bias, packed, row_sums = _conv_case(case)
    O, K, S = (case[k] for k in ("O", "K", "S"))
    pad = K // 2
    y2 = conv_model(xq, case["z"], wq, bias, scale, S, pad, False)
    rf = rq = None
    if kind == "float":  # of y2's size, and now and then its exact negation (a zero sum)
        rf = (rng.standard_normal(y2.shape) * max(float(np.abs(y2).max()), 1e-3)).astype(np.float32)
        rf[..., ::3] = -y2[..., ::3]
    else:
        rq = _uint8(rng, y2.shape, case["seed"] % 3 == 0)
    ref = residual_model(y2, rf, rq, rs, rz, case["relu"])
    for path in PATHS:
        for nt in (1, 2):
            y = np.full(ref.shape, np.nan, np.float32) if out != "yq" else None
            yq = np.full(ref.shape, 7, np.uint8) if out != "y" else None
            old = _int8._use_path(path)
            try:
                _int8.conv2d_forward(xq, case["z"], packed, row_sums, O, K, S, pad, scale, bias, y, case["relu"], nt,
                                     yq=yq, yq_scale=case["sq"], yq_zero_point=case["zq"], residual=rf, residual_q=rq,
                                     residual_scale=rs, residual_zero_point=rz)
            finally:
                _int8._use_path(old)
            msg = f"path {path}, {nt} threads, {kind} shortcut, {out}, {case}"
            if y is not None:
                np.testing.assert_array_equal(y, ref, err_msg=msg)
            if yq is not None:
                np.testing.assert_array_equal(yq, quantize_model(ref, np.float32(case["sq"]), case["zq"]), err_msg=msg)


def test_conv2d_forward_residual_validates():
    xq = np.zeros((2, 3, 5, 5), np.uint8)
    packed, rs = _int8.pack_weights(np.ones((4, 27), np.int8))
    scale = np.ones(4, np.float32)
    y = np.empty((2, 4, 5, 5), np.float32)
    args = (xq, 0, packed, rs, 4, 3, 1, 1, scale, None, y, True, 1)
    with pytest.raises(ValueError, match="not both"):
        _int8.conv2d_forward(*args, residual=np.zeros((2, 4, 5, 5), np.float32),
                             residual_q=np.zeros((2, 4, 5, 5), np.uint8))
    with pytest.raises(ValueError, match=r"residual must have shape \(2, 4, 5, 5\)"):
        _int8.conv2d_forward(*args, residual=np.zeros((2, 4, 5, 4), np.float32))
    with pytest.raises(TypeError, match="residual must have dtype float32"):
        _int8.conv2d_forward(*args, residual=np.zeros((2, 4, 5, 5), np.float64))
    with pytest.raises(TypeError, match="residual_q must have dtype uint8"):
        _int8.conv2d_forward(*args, residual_q=np.zeros((2, 4, 5, 5), np.int8))
    with pytest.raises(ValueError, match="residual_scale must be a finite"):
        _int8.conv2d_forward(*args, residual_q=np.zeros((2, 4, 5, 5), np.uint8), residual_scale=0.0)
    with pytest.raises(ValueError, match="residual_zero_point must be in 0..255"):
        _int8.conv2d_forward(*args, residual_q=np.zeros((2, 4, 5, 5), np.uint8), residual_zero_point=256)
    with pytest.raises(ValueError, match="C-contiguous"):
        _int8.conv2d_forward(*args, residual=np.zeros((2, 4, 5, 10), np.float32)[..., ::2])


@settings(max_examples=40, deadline=None)
@given(case=yq_cases())
def test_depthwise_forward_requantizes_for_the_next_layer_exactly(case):
    rng = np.random.default_rng(case["seed"])
    N, C, HW, K, S = (case[k] for k in ("N", "C", "HW", "K", "S"))
    xq = _uint8(rng, (N, C, HW, HW), False)
    wq = _int8w(rng, (C, 1, K, K), False)
    scale, bias = _epilogue_args(rng, C, case["bias"])
    ref = depthwise_model(xq, case["z"], wq, S, S, K // 2, K // 2, bias, scale, case["relu"])
    for nt in (1, 2):
        y, yq = _yq_outputs(case, ref.shape)
        _int8.depthwise_forward(xq, case["z"], wq, S, S, K // 2, K // 2, scale, bias, y, case["relu"], nt, yq=yq,
                                yq_scale=case["sq"], yq_zero_point=case["zq"])
        _check_yq(y, yq, ref, case, f"{nt} threads, {case}")


@settings(max_examples=40, deadline=None)
@given(case=yq_cases())
def test_linear_forward_requantizes_for_the_next_layer_exactly(case):
    rng = np.random.default_rng(case["seed"])
    N, F, G = case["N"], case["C"] * case["HW"], case["O"]
    xq = _uint8(rng, (N, F), False)
    wq = _int8w(rng, (G, F), False)
    scale, bias = _epilogue_args(rng, G, case["bias"])
    packed, row_sums = _int8.pack_weights(wq)
    ref = linear_model(xq, case["z"], wq, bias, scale, case["relu"])
    for path in PATHS:
        for nt in (1, 2):
            y, yq = _yq_outputs(case, ref.shape)
            old = _int8._use_path(path)
            try:
                _int8.linear_forward(xq, case["z"], packed, row_sums, scale, bias, y, case["relu"], nt, yq=yq,
                                     yq_scale=case["sq"], yq_zero_point=case["zq"])
            finally:
                _int8._use_path(old)
            _check_yq(y, yq, ref, case, f"path {path}, {nt} threads, {case}")


def test_requantized_outputs_validate():
    args = _conv_args()
    yq = np.empty((2, 6, 5, 5), np.uint8)
    for change, error, match in [
        (dict(y=None), TypeError, "y must be a numpy.ndarray"),
        (dict(yq=np.empty((2, 6, 5, 5), np.float32)), TypeError, "yq must have dtype uint8"),
        (dict(yq=np.empty((2, 6, 4, 5), np.uint8)), ValueError, r"yq must have shape \(2, 6, 5, 5\)"),
        (dict(yq=yq, yq_scale=0.0), ValueError, "yq_scale must be a finite float32 > 0"),
        (dict(yq=yq, yq_scale=float("nan")), ValueError, "yq_scale must be a finite float32 > 0"),
        (dict(yq=yq, yq_scale="1"), TypeError, "yq_scale must be a float"),
        (dict(yq=yq, yq_zero_point=256), ValueError, "yq_zero_point must be in 0..255"),
        (dict(yq=yq, yq_zero_point=1.0), TypeError, "yq_zero_point must be an int"),
    ]:
        with pytest.raises(error, match=match):
            _int8.conv2d_forward(**{**args, **change})
    ro = np.empty((2, 6, 5, 5), np.uint8)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="yq is read-only"):
        _int8.conv2d_forward(**{**args, "y": None, "yq": ro})
    rng = np.random.default_rng(2)
    packed, row_sums = _int8.pack_weights(rng.integers(-127, 128, (5, 12), dtype=np.int8))
    xq = rng.integers(0, 256, (3, 12), dtype=np.uint8)
    with pytest.raises(TypeError, match=r"y must be a float32 \(N, G\) array \(or None with a yq output\)"):
        _int8.linear_forward(xq, 0, packed, row_sums, np.ones(5, np.float32), None, None, False, 1)
    with pytest.raises(ValueError, match=r"yq must have shape \(3, 5\)"):
        _int8.linear_forward(xq, 0, packed, row_sums, np.ones(5, np.float32), None, np.empty((3, 5), np.float32),
                             False, 1, yq=np.empty((3, 4), np.uint8))
    xd = rng.integers(0, 256, (1, 4, 6, 6), dtype=np.uint8)
    wd = rng.integers(-127, 128, (4, 1, 3, 3), dtype=np.int8)
    with pytest.raises(ValueError, match=r"yq must have shape \(1, 4, 6, 6\)"):
        _int8.depthwise_forward(xd, 0, wd, 1, 1, 1, 1, np.ones(4, np.float32), None, None, False, 1,
                                yq=np.empty((1, 4, 6, 5), np.uint8))


def test_one_packed_buffer_serves_conv_and_linear_in_any_order():
    # the panels are laid out per kernel size on first use; switching back and forth stays exact
    rng = np.random.default_rng(3)
    wq = rng.integers(-127, 128, (20, 8, 3, 3), dtype=np.int8)
    packed, row_sums = _int8.pack_weights(wq.reshape(20, -1))
    xq = rng.integers(0, 256, (2, 8, 5, 5), dtype=np.uint8)
    xl = rng.integers(0, 256, (3, 72), dtype=np.uint8)
    scale = np.full(20, 0.5, np.float32)
    for _ in range(2):
        y = np.empty((2, 20, 5, 5), np.float32)
        _int8.conv2d_forward(xq, 9, packed, row_sums, 20, 3, 1, 1, scale, None, y, False, 2)
        np.testing.assert_array_equal(y, conv_model(xq, 9, wq, None, scale, 1, 1, False))
        yl = np.empty((3, 20), np.float32)
        _int8.linear_forward(xl, 9, packed, row_sums, scale, None, yl, False, 2)
        np.testing.assert_array_equal(yl, linear_model(xl, 9, wq.reshape(20, -1), None, scale, False))


def test_pack_weights_row_sums_and_limits():
    rng = np.random.default_rng(0)
    wq = rng.integers(-127, 128, (5, 11), dtype=np.int8)
    packed, row_sums = _int8.pack_weights(wq)
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert row_sums.dtype == np.int32
    np.testing.assert_array_equal(row_sums, wq.sum(axis=1))
    with pytest.raises(ValueError, match=r"wq .*\[-127, 127\]"):
        _int8.pack_weights(np.full((2, 3), -128, np.int8))
    with pytest.raises(TypeError, match="wq must have dtype int8"):
        _int8.pack_weights(wq.astype(np.int16))
    with pytest.raises(ValueError, match="wq must be 2-D"):
        _int8.pack_weights(wq.reshape(-1))
    with pytest.raises(ValueError, match="wq must be C-contiguous"):
        _int8.pack_weights(np.asfortranarray(wq))
    with pytest.raises(ValueError, match="too large for int32"):
        _int8.pack_weights(np.zeros((1, 70000), np.int8))


# ---------------------------------------------------------------------- quantize

def _check_quantize(x, scale, zp):
    x = np.ascontiguousarray(x, np.float32)
    ref = quantize_model(x, scale, zp)
    for nt in (1, 2):
        out = np.full(x.shape, 77, np.uint8)
        _int8.quantize(x, scale, zp, out, nt)
        bad = np.flatnonzero(out != ref)
        assert bad.size == 0, (f"scale {scale!r} zp {zp}: x {x[bad[:5]]} -> {out[bad[:5]]}, "
                               f"expected {ref[bad[:5]]}")


def test_quantize_ties_specials_and_range():
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 3.4e38, -3.4e38, 1e-45, -1e-45],
                       np.float32)
    for scale in (1.0, 0.1, 0.05, 1.0 / 3.0, 2.0 ** -7, 7.3, 1e-38, 3e38, 1e-30, 1e30):
        for zp in (0, 1, 128, 254, 255):
            s = np.float32(scale)
            with np.errstate(over="ignore"):
                ties = (np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)) * s
            _check_quantize(np.concatenate([special, ties, np.nextafter(ties, np.float32(np.inf)),
                                            np.nextafter(ties, np.float32(-np.inf))]), s, zp)


@settings(max_examples=40)
@given(seed=st.integers(0, 2 ** 31), scale=st.floats(float(np.float32(1e-6)), 1e3, width=32), zp=ZPS, n=st.integers(1, 3000))
def test_quantize_matches_numpy(seed, scale, zp, n):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale * rng.choice([1, 50, 300], n)).astype(np.float32)
    # values whose quotient lies within float32 rounding of a half-integer
    k = rng.integers(-300, 300, n // 3)
    x[: k.size] = ((k + 0.5) * np.float64(scale) * (1 + rng.uniform(-1e-6, 1e-6, k.size))).astype(np.float32)
    _check_quantize(x, scale, zp)


def test_quantize_finds_a_lone_near_tie_in_any_lane():
    # 208.49998 * float32(1/3) rounds to 69.5 but 208.49998 / 3 is 69.49999: the block holding it must
    # be redone by division, whichever vector lane it falls in (the AVX2 build once missed some lanes)
    for pos in range(64):
        x = np.zeros(256, np.float32)
        x[pos] = np.float32(208.49998)
        q = np.empty(256, np.uint8)
        _int8.quantize(x, 3.0, 0, q, 1)
        np.testing.assert_array_equal(q, quantize_model(x, np.float32(3.0), 0), err_msg=f"lane {pos}")


def test_quantize_validates():
    x, out = np.zeros(4, np.float32), np.zeros(4, np.uint8)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        _int8.quantize(x.astype(np.float64), 1.0, 0, out, 1)
    with pytest.raises(ValueError, match="out must have shape"):
        _int8.quantize(x, 1.0, 0, np.zeros(5, np.uint8), 1)
    with pytest.raises(ValueError, match="scale must be a finite float32 > 0"):
        _int8.quantize(x, 0.0, 0, out, 1)
    with pytest.raises(ValueError, match="scale must be a finite float32 > 0"):
        _int8.quantize(x, float("nan"), 0, out, 1)
    with pytest.raises(ValueError, match="x_zero_point must be in 0..255"):
        _int8.quantize(x, 1.0, 256, out, 1)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        _int8.quantize(np.zeros(8, np.float32)[::2], 1.0, 0, out, 1)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        _int8.quantize(x, 1.0, 0, out, 0)


# -------------------------------------------------------------------- validation

def _conv_args():
    rng = np.random.default_rng(1)
    wq = rng.integers(-127, 128, (6, 3 * 3 * 3), dtype=np.int8)
    packed, row_sums = _int8.pack_weights(wq)
    return dict(xq=rng.integers(0, 256, (2, 3, 5, 5), dtype=np.uint8), x_zero_point=3, packed=packed,
                row_sums=row_sums, O=6, K=3, stride=1, padding=1, scale=np.ones(6, np.float32),
                bias_q=np.zeros(6, np.int32), y=np.empty((2, 6, 5, 5), np.float32), relu=False, num_threads=2)


@pytest.mark.parametrize("change, error, match", [
    (dict(xq=np.zeros((2, 3, 5, 5), np.float32)), TypeError, "xq must have dtype uint8"),
    (dict(xq=np.zeros((3, 5, 5), np.uint8)), ValueError, "xq must be 4-D"),
    (dict(xq=np.zeros((2, 3, 5, 10), np.uint8)[..., ::2]), ValueError, "xq must be C-contiguous"),
    (dict(xq=np.zeros((2, 4, 5, 5), np.uint8)), ValueError, "packed holds weights of reduction size 27"),
    (dict(O=7), ValueError, "packed holds weights for 6 output channels"),
    (dict(K=1), ValueError, "packed holds weights of reduction size 27"),
    (dict(x_zero_point=-1), ValueError, "x_zero_point must be in 0..255"),
    (dict(x_zero_point=1.5), TypeError, "x_zero_point must be an int"),
    (dict(stride=0), ValueError, "stride must be in 1"),
    (dict(padding=-1), ValueError, "padding must be in 0"),
    (dict(packed=np.zeros(100, np.uint8)), ValueError, "packed is not a pack_weights buffer"),
    (dict(packed=np.zeros(10, np.uint8)), ValueError, "packed is not a pack_weights buffer"),
    (dict(packed=[1, 2]), TypeError, "packed must be a numpy.ndarray"),
    (dict(row_sums=np.zeros(6, np.int64)), TypeError, "row_sums must have dtype int32"),
    (dict(row_sums=np.zeros(5, np.int32)), ValueError, "row_sums must have shape"),
    (dict(scale=np.ones(6, np.float64)), TypeError, "scale must have dtype float32"),
    (dict(scale=np.ones(5, np.float32)), ValueError, "scale must have shape"),
    (dict(bias_q=np.zeros(6, np.float32)), TypeError, "bias_q must have dtype int32"),
    (dict(y=np.empty((2, 6, 4, 4), np.float32)), ValueError, r"y must have shape \(2, 6, 5, 5\)"),
    (dict(y=np.empty((2, 6, 5, 5), np.float64)), TypeError, "y must have dtype float32"),
    (dict(K=9, packed=_int8.pack_weights(np.zeros((6, 3 * 81), np.int8))[0]), ValueError, "larger than the padded"),
    (dict(num_threads=0), ValueError, "num_threads must be >= 1"),
])
def test_conv2d_forward_validates(change, error, match):
    args = {**_conv_args(), **change}
    with pytest.raises(error, match=match):
        _int8.conv2d_forward(**args)


def test_conv2d_forward_rejects_read_only_and_tampered_buffers():
    args = _conv_args()
    args["y"].setflags(write=False)
    with pytest.raises(ValueError, match="y is read-only"):
        _int8.conv2d_forward(**args)
    args = _conv_args()
    args["packed"] = args["packed"][:-64].copy()
    with pytest.raises(ValueError, match="packed has .* bytes"):
        _int8.conv2d_forward(**args)


def test_linear_and_depthwise_validate():
    rng = np.random.default_rng(2)
    wq = rng.integers(-127, 128, (5, 12), dtype=np.int8)
    packed, row_sums = _int8.pack_weights(wq)
    xq = rng.integers(0, 256, (3, 12), dtype=np.uint8)
    s = np.ones(5, np.float32)
    with pytest.raises(ValueError, match=r"packed holds weights of reduction size 12, but this layer needs F"):
        _int8.linear_forward(rng.integers(0, 256, (3, 13), dtype=np.uint8), 0, packed, row_sums, s, None,
                             np.empty((3, 5), np.float32), False, 1)
    with pytest.raises(ValueError, match="packed holds weights for 5 output channels, but this layer has O=6"):
        _int8.linear_forward(xq, 0, packed, row_sums, np.ones(6, np.float32), None, np.empty((3, 6), np.float32),
                             False, 1)
    with pytest.raises(ValueError, match=r"y must have shape \(3, 5\)"):
        _int8.linear_forward(xq, 0, packed, row_sums, s, None, np.empty((2, 5), np.float32), False, 1)
    with pytest.raises(TypeError, match="xq must have dtype uint8"):
        _int8.linear_forward(xq.astype(np.int8), 0, packed, row_sums, s, None, np.empty((3, 5), np.float32),
                             False, 1)
    xd = rng.integers(0, 256, (1, 4, 6, 6), dtype=np.uint8)
    wd = rng.integers(-127, 128, (4, 1, 3, 3), dtype=np.int8)
    y = np.empty((1, 4, 6, 6), np.float32)
    s4 = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"wq must have shape \(C, 1, KH, KW\)"):
        _int8.depthwise_forward(xd, 0, wd[:3], 1, 1, 1, 1, s4, None, y, False, 1)
    with pytest.raises(TypeError, match="wq must have dtype int8"):
        _int8.depthwise_forward(xd, 0, wd.astype(np.uint8), 1, 1, 1, 1, s4, None, y, False, 1)
    with pytest.raises(ValueError, match=r"y must have shape \(1, 4, 3, 3\)"):
        _int8.depthwise_forward(xd, 0, wd, 2, 2, 1, 1, s4, None, y, False, 1)
    with pytest.raises(ValueError, match="sh must be in 1"):
        _int8.depthwise_forward(xd, 0, wd, 0, 1, 1, 1, s4, None, y, False, 1)
    with pytest.raises(ValueError, match=r"wq must lie in \[-127, 127\]"):
        _int8.depthwise_forward(xd, 0, np.full((4, 1, 3, 3), -128, np.int8), 1, 1, 1, 1, s4, None, y, False, 1)


def _expected_path(level):
    """The path a level should choose on this CPU: the best one its code has."""
    features = ext.cpu_features()
    if level == "generic":
        return "portable"
    if level == "avx512" and features.get("avx512_vnni"):
        return "avx512_vnni"
    return "avx_vnni" if features.get("avx_vnni") else "avx2"


def test_path_names_what_runs():
    assert _int8.path() == PATHS[-1] == _expected_path(ext.STATE["level"])
    assert PATHS[0] == "portable"
    assert ("avx_vnni" in PATHS) == bool(ext.STATE["level"] != "generic" and ext.cpu_features().get("avx_vnni"))
    with pytest.raises(ValueError, match="path must be one of"):
        _int8._use_path("sse")
    for name in ("avx2", "avx_vnni", "avx512_vnni"):
        if name not in PATHS:
            with pytest.raises(ValueError, match="not available here"):
                _int8._use_path(name)


# ------------------------------------------------------- every level, in children

def _child_code():
    models = "\n".join(inspect.getsource(f) for f in (quantize_model, _finish, _tap_patches, conv_model,
                                                       depthwise_model, linear_model, residual_model))
    body = textwrap.dedent("""
        import json
        from parconv._ext import _int8
        fails = []
        best = _int8.path()
        for path in _int8._paths():  # every path this level and CPU run
            _int8._use_path(path)
            n0 = len(fails)
            rng = np.random.default_rng(11)
            for N, C, O, H, W, K, S, pad, z in ((2, 5, 17, 9, 7, 3, 2, 1, 255), (1, 16, 70, 8, 8, 3, 1, 1, 0),
                                                (3, 3, 8, 6, 11, 5, 1, 2, 128), (1, 9, 16, 7, 7, 1, 2, 0, 77),
                                                (1, 2, 4, 9, 9, 7, 3, 3, 5), (2, 7, 20, 5, 7, 1, 1, 0, 33),
                                                (9, 17, 24, 8, 8, 1, 1, 0, 200), (9, 5, 13, 8, 8, 3, 1, 1, 40),
                                                (8, 6, 10, 32, 32, 3, 2, 1, 90)):
                for extreme in (False, True):
                    xq = rng.choice(np.array([0, 255], np.uint8), (N, C, H, W)) if extreme else \\
                        rng.integers(0, 256, (N, C, H, W), dtype=np.uint8)
                    wq = rng.choice(np.array([-127, 127], np.int8), (O, C, K, K)) if extreme else \\
                        rng.integers(-127, 128, (O, C, K, K), dtype=np.int8)
                    scale = rng.uniform(1e-4, 1e-1, O).astype(np.float32)
                    bias = rng.integers(-10 ** 6, 10 ** 6, O).astype(np.int32)
                    packed, rs = _int8.pack_weights(wq.reshape(O, -1))
                    ref = conv_model(xq, z, wq, bias, scale, S, pad, True)
                    wl = rng.integers(-127, 128, (O, C * H * W), dtype=np.int8)
                    pl, rl = _int8.pack_weights(wl)
                    lin = linear_model(xq.reshape(N, -1), z, wl, bias, scale, False)
                    dw = depthwise_model(xq, z, wq[:C, :1], S, 1, pad, pad, bias[:C], scale[:C], True)
                    for nt in (1, 2):
                        y = np.empty_like(ref)
                        _int8.conv2d_forward(xq, z, packed, rs, O, K, S, pad, scale, bias, y, True, nt)
                        fails += [] if np.array_equal(y, ref) else [("conv", N, C, O, K, S, nt)]
                        yl = np.empty_like(lin)
                        _int8.linear_forward(xq.reshape(N, -1), z, pl, rl, scale, bias, yl, False, nt)
                        fails += [] if np.array_equal(yl, lin) else [("linear", N, C, O, nt)]
                        if O >= C:
                            yd = np.empty_like(dw)
                            _int8.depthwise_forward(xq, z, np.ascontiguousarray(wq[:C, :1]), S, 1, pad, pad,
                                                    scale[:C], bias[:C], yd, True, nt)
                            fails += [] if np.array_equal(yd, dw) else [("depthwise", N, C, K, S, nt)]
                        # the residual block's shortcut, float32 or uint8, added before the ReLU
                        y2 = conv_model(xq, z, wq, bias, scale, S, pad, False)
                        rf = (rng.standard_normal(y2.shape) * np.abs(y2).max()).astype(np.float32)
                        rq = rng.integers(0, 256, y2.shape, dtype=np.uint8)
                        for kind in ("float", "uint8"):
                            want = residual_model(y2, rf if kind == "float" else None, rq, 0.05, z // 3, True)
                            for keep in (True, False):
                                yq = np.empty(y2.shape, np.uint8)
                                y = np.empty_like(y2) if keep else None
                                _int8.conv2d_forward(xq, z, packed, rs, O, K, S, pad, scale, bias, y, True, nt, yq=yq,
                                                     yq_scale=0.013, yq_zero_point=z // 2,
                                                     residual=rf if kind == "float" else None,
                                                     residual_q=rq if kind == "uint8" else None, residual_scale=0.05,
                                                     residual_zero_point=z // 3)
                                ok = np.array_equal(yq, quantize_model(want, np.float32(0.013), z // 2))
                                fails += [] if ok and (y is None or np.array_equal(y, want)) else \
                                    [("conv residual", kind, keep, N, C, O, nt)]
                        # outputs quantized for a next layer (y kept or not)
                        for keep in (True, False):
                            yq = np.empty(ref.shape, np.uint8)
                            y = np.empty_like(ref) if keep else None
                            _int8.conv2d_forward(xq, z, packed, rs, O, K, S, pad, scale, bias, y, True, nt, yq=yq,
                                                 yq_scale=0.013, yq_zero_point=z // 2)
                            ok = np.array_equal(yq, quantize_model(ref, np.float32(0.013), z // 2))
                            fails += [] if ok and (y is None or np.array_equal(y, ref)) else [("conv yq", N, C, O, nt)]
                            yq = np.empty(lin.shape, np.uint8)
                            _int8.linear_forward(xq.reshape(N, -1), z, pl, rl, scale, bias, None, False, nt, yq=yq,
                                                 yq_scale=0.7, yq_zero_point=3)
                            fails += [] if np.array_equal(yq, quantize_model(lin, np.float32(0.7), 3)) else \
                                [("linear yq", N, C, O, nt)]
                            if O >= C:
                                yq = np.empty(dw.shape, np.uint8)
                                yd = np.empty_like(dw) if keep else None
                                _int8.depthwise_forward(xq, z, np.ascontiguousarray(wq[:C, :1]), S, 1, pad, pad,
                                                        scale[:C], bias[:C], yd, True, nt, yq=yq, yq_scale=0.013,
                                                        yq_zero_point=z // 2)
                                ok = np.array_equal(yq, quantize_model(dw, np.float32(0.013), z // 2))
                                fails += [] if ok and (yd is None or np.array_equal(yd, dw)) else \
                                    [("depthwise yq", N, C, K, S, nt)]
            # depthwise in both layouts (channel blocks, planes) on full and partial channel blocks
            # (a bias near the int32 limits: the epilogue adds in int64)
            for N, C, H, W, K, S, pad, z, huge in ((2, 16, 8, 8, 3, 1, 1, 3, False), (1, 33, 9, 7, 3, 2, 1, 250, False),
                                                   (2, 32, 16, 17, 3, 2, 1, 0, False), (1, 17, 5, 21, 5, 1, 2, 128, False),
                                                   (1, 16, 6, 9, 3, 1, 1, 77, True)):
                xq = rng.integers(0, 256, (N, C, H, W), dtype=np.uint8)
                wq = rng.integers(-127, 128, (C, 1, K, K), dtype=np.int8)
                scale = rng.uniform(1e-4, 1e-1, C).astype(np.float32)
                bias = rng.integers(-10 ** 6, 10 ** 6, C).astype(np.int32)
                if huge:
                    bias = rng.choice(np.array([2 ** 31 - 1, -2 ** 31], np.int64), C).astype(np.int32)
                    scale = rng.uniform(1e-12, 1e-10, C).astype(np.float32)
                dw = depthwise_model(xq, z, wq, S, S, pad, pad, bias, scale, True)
                for mode in ("blocks", "planes"):
                    _int8._use_depthwise(mode)
                    for nt in (1, 2):
                        yd, yq = np.empty_like(dw), np.empty(dw.shape, np.uint8)
                        _int8.depthwise_forward(xq, z, wq, S, S, pad, pad, scale, bias, yd, True, nt, yq=yq,
                                                yq_scale=0.021, yq_zero_point=5)
                        ok = np.array_equal(yd, dw) and np.array_equal(yq, quantize_model(dw, np.float32(0.021), 5))
                        yq2 = np.empty(dw.shape, np.uint8)
                        _int8.depthwise_forward(xq, z, wq, S, S, pad, pad, scale, bias, None, True, nt, yq=yq2,
                                                yq_scale=0.021, yq_zero_point=5)
                        fails += [] if ok and np.array_equal(yq, yq2) else [("depthwise " + mode, N, C, K, S, nt)]
                _int8._use_depthwise("auto")
            x = np.concatenate([(np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)) * np.float32(0.05),
                                np.array([np.nan, np.inf, -np.inf, 1e30], np.float32),
                                rng.standard_normal(5000).astype(np.float32) * 9])
            q = np.empty(x.shape, np.uint8)
            for scale, zp in ((0.05, 128), (1 / 3, 0), (1e-38, 255), (3e38, 7), (7.3, 200)):
                xs = np.concatenate([x, (np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)) * np.float32(scale)])
                q = np.empty(xs.shape, np.uint8)
                _int8.quantize(xs, scale, zp, q, 2)
                fails += [] if np.array_equal(q, quantize_model(xs, scale, zp)) else [("quantize", scale, zp)]
            fails[n0:] = [(path,) + tuple(f) for f in fails[n0:]]
        _int8._use_path(best)
        print(json.dumps({"path": _int8.path(), "paths": _int8._paths(), "fails": fails}))
    """)
    return "import numpy as np\n" + models + "\n" + body


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_every_level_is_exact(level):
    result = run_at_isa_level(level, _child_code())
    assert result["fails"] == []
    assert result["path"] == _expected_path(level)
    assert result["paths"][-1] == result["path"]
