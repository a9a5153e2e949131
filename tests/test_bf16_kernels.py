"""The bf16 kernels (parconv._ext._bf16) against a NumPy model of the same rounding.

Model: every input of a product rounded to bf16 (round to nearest, ties to even, by bit
arithmetic), products and sums in float64, bias added; a kernel sums in fp32 in its own order, so
it must agree within 1e-5 of the sum of the |terms|. ``round_to_bf16`` must match the model bit
for bit on every kernel level; the product kernels run where ``native()`` (the avx512 level on a
CPU with AVX512_BF16) and raise RuntimeError elsewhere, which children pinned to the lower levels
check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parconv._ext import _bf16  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ext.__file__))))
RUNNABLE = [lv for lv in ext.STATE["built"] if lv in ext.STATE["supported"]]
NATIVE = _bf16.native()
needs_native = pytest.mark.skipif(not NATIVE, reason="needs the avx512 kernel level on a CPU with AVX512_BF16")
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
RTOL = 1e-5
# where the CPU has AMX-BF16 every product test runs on the tiles and on VDPBF16PS
PATHS = ["amx", "vdpbf16ps"] if _bf16.amx() else ["vdpbf16ps"]


@pytest.fixture(autouse=True, params=PATHS)
def product_path(request):
    old = _bf16._set_amx(request.param == "amx")
    assert _bf16.amx() == (request.param == "amx")
    yield request.param
    _bf16._set_amx(old)


# ------------------------------------------------------------------ the NumPy model

def bf16_model(a):
    """float32 -> nearest bf16 (ties to even) as float32; NaN keeps sign and top payload, made quiet."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    quiet = ((u | 0x00400000) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = np.where(nan, quiet, rounded).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(a.shape)


def _r64(a):
    return bf16_model(a).astype(np.float64)


def conv_model(x, w, b, stride, pad):
    """(y, sum of |terms|) of the bf16 convolution, in float64."""
    x, w = _r64(x), _r64(w)
    N, C, H, W = x.shape
    O, _, K, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    P, Q = (H + 2 * pad - K) // stride + 1, (W + 2 * pad - K) // stride + 1
    y, mag = np.zeros((N, O, P, Q)), np.zeros((N, O, P, Q))
    for kh in range(K):
        for kw in range(K):
            xs = xp[:, :, kh:kh + stride * (P - 1) + 1:stride, kw:kw + stride * (Q - 1) + 1:stride]
            y += np.einsum("nchw,oc->nohw", xs, w[:, :, kh, kw])
            mag += np.einsum("nchw,oc->nohw", abs(xs), abs(w[:, :, kh, kw]))
    if b is not None:
        y += b.reshape(1, O, 1, 1)
        mag += abs(b).reshape(1, O, 1, 1)
    return y, mag


def conv_backward_model(x, w, dy, stride, pad):
    """(dx, |dx| terms, dw, |dw| terms, db) of the bf16 convolution, in float64."""
    xr, wr, dr = _r64(x), _r64(w), _r64(dy)
    N, C, H, W = x.shape
    O, _, K, _ = w.shape
    P, Q = dy.shape[2:]
    xp = np.pad(xr, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dxp, adxp = np.zeros_like(xp), np.zeros_like(xp)
    dw, adw = np.zeros(w.shape), np.zeros(w.shape)
    for kh in range(K):
        for kw in range(K):
            sl = (slice(None), slice(None), slice(kh, kh + stride * (P - 1) + 1, stride),
                  slice(kw, kw + stride * (Q - 1) + 1, stride))
            dw[:, :, kh, kw] = np.einsum("nchw,nohw->oc", xp[sl], dr)
            adw[:, :, kh, kw] = np.einsum("nchw,nohw->oc", abs(xp[sl]), abs(dr))
            dxp[sl] += np.einsum("nohw,oc->nchw", dr, wr[:, :, kh, kw])
            adxp[sl] += np.einsum("nohw,oc->nchw", abs(dr), abs(wr[:, :, kh, kw]))
    crop = (slice(None), slice(None), slice(pad, pad + H), slice(pad, pad + W))
    return dxp[crop], adxp[crop], dw, adw, dy.astype(np.float64).sum(axis=(0, 2, 3))


def assert_close(got, ref, mag, what):
    err = np.abs(got.astype(np.float64) - ref)
    bound = RTOL * mag + 1e-30
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{what}: error {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"


def _data(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _conv_case(rng, N, C, O, H, W, K, stride, pad, bias=True):
    x, w = _data(rng, (N, C, H, W)), _data(rng, (O, C, K, K))
    b = _data(rng, (O,)) if bias else None
    P, Q = (H + 2 * pad - K) // stride + 1, (W + 2 * pad - K) // stride + 1
    dy = _data(rng, (N, O, P, Q))
    return x, w, b, dy


# ------------------------------------------------------------------ round_to_bf16

SPECIAL_BITS = [
    0x00000000, 0x80000000,                  # +-0
    0x7F800000, 0xFF800000,                  # +-inf
    0x7FC00000, 0xFFC00000, 0x7FC00001,      # quiet NaNs
    0x7F800001, 0xFF800001, 0x7F80FFFF,      # signalling NaNs with payload only in the dropped bits
    0x7FBF0000, 0x7FFFFFFF,                  # other NaNs
    0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007FFFFF,  # subnormals (incl. ties)
    0x00800000, 0x3F800000, 0x3F808000,      # tie, even below: stays 1.0
    0x3F818000,                              # tie, odd below: rounds up
    0x3F807FFF, 0x3F808001,                  # just below / above a tie
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,  # near the largest: overflow to inf on a tie up
    0x3F7FFFFF, 0xBF7FFFFF,                  # carries into the exponent
]


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_round_to_bf16_special_values_match_the_model_bit_for_bit():
    x = np.array(SPECIAL_BITS, dtype=np.uint32).view(np.float32)
    out = np.empty_like(x)
    _bf16.round_to_bf16(x, out, 1)
    np.testing.assert_array_equal(_bits(out), _bits(bf16_model(x)))
    got = dict(zip(SPECIAL_BITS, _bits(out).tolist()))
    assert got[0x3F808000] == 0x3F800000 and got[0x3F818000] == 0x3F820000  # ties to even
    assert got[0x7F7FFFFF] == 0x7F800000 and got[0x7F7F7FFF] == 0x7F7F0000  # overflow only past half
    assert got[0x7F800001] == 0x7FC00000 and got[0xFF800001] == 0xFFC00000  # NaN stays NaN, sign kept
    assert got[0x80000000] == 0x80000000 and got[0x00008000] == 0x00000000  # -0 kept; subnormal tie to even
    assert np.all(_bits(out) & 0xFFFF == 0)


@given(st.integers(0, 2**32 - 1), st.integers(1, 300), st.sampled_from([1, 2]))
@SETTINGS
def test_round_to_bf16_random_bits(seed, n, threads):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = np.empty_like(x)
    _bf16.round_to_bf16(x, out, threads)
    np.testing.assert_array_equal(_bits(out), _bits(bf16_model(x)))


def test_round_to_bf16_in_place_large_and_threads_agree():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, size=300_001, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ref = _bits(bf16_model(x))
    out1 = np.empty_like(x)
    _bf16.round_to_bf16(x, out1, 1)
    y = x.copy()
    _bf16.round_to_bf16(y, y, 2)  # in place, split over two threads
    np.testing.assert_array_equal(_bits(out1), ref)
    np.testing.assert_array_equal(_bits(y), ref)
    empty = np.empty(0, np.float32)
    _bf16.round_to_bf16(empty, empty, 2)


def test_round_to_bf16_validates_its_arguments():
    x = np.ones(8, np.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        _bf16.round_to_bf16(x.astype(np.float64), x, 1)
    with pytest.raises(TypeError, match="out must be a float32 numpy array"):
        _bf16.round_to_bf16(x, [0.0] * 8, 1)
    with pytest.raises(ValueError, match="out must have 8 elements"):
        _bf16.round_to_bf16(x, np.empty(7, np.float32), 1)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        _bf16.round_to_bf16(np.ones(16, np.float32)[::2], x, 1)
    with pytest.raises(ValueError, match="x must have 1 dimension"):
        _bf16.round_to_bf16(np.ones((2, 4), np.float32), x, 1)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        _bf16.round_to_bf16(x, ro, 1)
    buf = np.ones(9, np.float32)
    with pytest.raises(ValueError, match="out overlaps x"):
        _bf16.round_to_bf16(buf[:8], buf[1:], 1)


# ------------------------------------------------------------------ every level, in children

def _run(code, isa):
    env = dict(os.environ)
    env["PARCONV_ISA"] = isa
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_every_level_rounds_exactly_and_says_whether_it_is_native(level):
    if level not in RUNNABLE:
        pytest.skip(f"this CPU or build does not run the {level} level")
    code = f"""
        import numpy as np
        from parconv._ext import _bf16, _cpu
        rng = np.random.default_rng(7)
        x = rng.integers(0, 2**32, size=100_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
        x[:{len(SPECIAL_BITS)}] = np.array({SPECIAL_BITS!r}, dtype=np.uint32).view(np.float32)
        u = x.view(np.uint32).astype(np.uint64)
        model = np.where((u & 0x7FFFFFFF) > 0x7F800000, ((u | 0x00400000) >> 16) & 0xFFFF,
                         ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint32) << 16
        for threads in (1, 2):
            out = np.empty_like(x)
            _bf16.round_to_bf16(x, out, threads)
            assert np.array_equal(out.view(np.uint32), model), threads
        has = bool(_cpu.features().get("avx512_bf16"))
        assert _bf16.native() == ({level!r} == "avx512" and has), (_bf16.native(), has)
        if not _bf16.native():
            z = np.zeros((1, 1, 3, 3), np.float32)
            for call in (lambda: _bf16.conv2d_forward(z, z, None, z[:, :, :1, :1].copy(), 1, 0, 1),
                         lambda: _bf16.linear_forward(z[0, 0], z[0, 0], None, z[0, 0].copy(), 1)):
                try:
                    call()
                except RuntimeError as exc:
                    assert "AVX512_BF16" in str(exc)
                else:
                    raise AssertionError("no RuntimeError off the native path")
        print("ok", _bf16.native())
    """
    res = _run(code, level)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_native_is_a_bool_and_matches_the_cpu():
    assert isinstance(NATIVE, bool)
    if ext.STATE["level"] != "avx512":
        assert not NATIVE
    else:
        assert NATIVE == bool(ext.cpu_features().get("avx512_bf16"))


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def test_amx_is_used_only_where_the_cpu_has_the_tiles(product_path):
    assert isinstance(_bf16.amx(), bool)
    if _bf16.amx():
        assert NATIVE and "amx_bf16" in _cpu_flags()
    if not NATIVE or "amx_bf16" not in _cpu_flags():
        assert PATHS == ["vdpbf16ps"] and not _bf16.amx()
        assert _bf16._set_amx(True) is False and not _bf16.amx()  # a no-op without the tiles
        _bf16._set_amx(False)


@pytest.mark.skipif(NATIVE, reason="the product kernels run here")
def test_product_kernels_raise_runtime_error_off_the_native_path():
    z = np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        _bf16.conv2d_backward(z, z, z[:, :, :1, :1].copy(), None, z.copy(), None, 1, 0, 1)
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        _bf16.linear_backward(z[0, 0], z[0, 0], z[0, 0], None, z[0, 0].copy(), None, 1)


# ------------------------------------------------------------------ convolution

conv_shapes = st.tuples(
    st.integers(1, 5),                     # N
    st.integers(1, 40),                    # C: past 32 the tiles take two chunks of 16 channel pairs
    st.integers(1, 40),                    # O: past 32 two rows of tiles
    st.integers(1, 11), st.integers(1, 11),  # H, W
    st.sampled_from([1, 2, 3, 5]),          # K
    st.sampled_from([1, 2]),                # stride
    st.integers(0, 4),                      # padding, up to K + 3: blocks wholly inside the padding
    st.booleans(),                          # bias
    st.integers(0, 2**32 - 1),
)


def _fit(H, W, K, pad):
    return max(H, K - 2 * pad), max(W, K - 2 * pad), pad


@needs_native
@given(conv_shapes)
@SETTINGS
def test_conv2d_forward_matches_the_model(case):
    N, C, O, H, W, K, stride, pad, bias, seed = case
    H, W, pad = _fit(H, W, K, pad)
    x, w, b, _ = _conv_case(np.random.default_rng(seed), N, C, O, H, W, K, stride, pad, bias)
    ref, mag = conv_model(x, w, b, stride, pad)
    for threads in (1, 2):
        y = np.full(ref.shape, np.nan, np.float32)
        _bf16.conv2d_forward(x, w, b, y, stride, pad, threads)
        assert_close(y, ref, mag, f"y, {threads} thread(s)")


@needs_native
@given(conv_shapes, st.booleans(), st.booleans())
@SETTINGS
def test_conv2d_backward_matches_the_model(case, want_dx, want_db):
    N, C, O, H, W, K, stride, pad, _, seed = case
    H, W, pad = _fit(H, W, K, pad)
    x, w, _, dy = _conv_case(np.random.default_rng(seed), N, C, O, H, W, K, stride, pad)
    rdx, adx, rdw, adw, rdb = conv_backward_model(x, w, dy, stride, pad)
    for threads in (1, 2):
        dx = np.full(x.shape, np.nan, np.float32) if want_dx else None
        dw = np.full(w.shape, np.nan, np.float32)
        db = np.full(O, np.nan, np.float32) if want_db else None
        _bf16.conv2d_backward(x, w, dy, dx, dw, db, stride, pad, threads)
        assert_close(dw, rdw, adw, f"dw, {threads} thread(s)")
        if want_dx:
            assert_close(dx, rdx, adx, f"dx, {threads} thread(s)")
        if want_db:
            np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-5 * np.abs(dy).sum())


@needs_native
@pytest.mark.parametrize("N, C, O, H, K, stride, pad", [
    (5, 16, 16, 8, 3, 1, 1), (3, 7, 9, 11, 3, 1, 1), (4, 16, 32, 16, 3, 2, 1), (2, 33, 17, 9, 5, 3, 2),
    (6, 4, 8, 6, 1, 2, 0), (3, 40, 20, 7, 3, 1, 0)])
def test_weight_gradient_reads_only_what_it_wrote(product_path, N, C, O, H, K, stride, pad):
    """The AMX weight gradient does not zero its scratch: filled with NaN bits first, dw still matches."""
    x, w, _, dy = _conv_case(np.random.default_rng(N + C + K), N, C, O, H, H + 3, K, stride, pad)
    _, _, rdw, adw, _ = conv_backward_model(x, w, dy, stride, pad)
    old = _bf16._fill_scratch(0xFF)
    try:
        for threads in (1, 2):
            dw = np.full(w.shape, np.nan, np.float32)
            _bf16.conv2d_backward(x, w, dy, None, dw, None, stride, pad, threads)
            assert_close(dw, rdw, adw, f"dw, {threads} thread(s)")
    finally:
        _bf16._fill_scratch(old)


@needs_native
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.integers(1, 9), st.sampled_from([1, 2, 3, 4, 5]),
       st.sampled_from([2, 3]), st.integers(0, 7), st.integers(0, 7), st.integers(0, 2**32 - 1))
@SETTINGS
def test_strided_dx_on_phase_convolutions_matches_the_model(N, C, O, H, K, stride, pad, extra, seed):
    """dy rows of 16 or more columns: on the tiles a strided layer's dx runs as S x S stride-1
    convolutions of dy (any padding up to S * ceil(K / S) - 1, col2im past it); both the phases and
    col2im against the model, each repeating its bits."""
    W = 15 * stride + K + extra  # Q >= 16 at every padding
    H, W, pad = _fit(H, W, K, pad)
    x, w, _, dy = _conv_case(np.random.default_rng(seed), N, C, O, H, W, K, stride, pad)
    rdx, adx, _, _, _ = conv_backward_model(x, w, dy, stride, pad)
    for phases in (True, False):
        old = _bf16._set_dx_phases(phases)
        try:
            for threads in (1, 2):
                dx = [np.full(x.shape, np.nan, np.float32) for _ in range(2)]
                for d in dx:
                    _bf16.conv2d_backward(x, w, dy, d, None, None, stride, pad, threads)
                np.testing.assert_array_equal(dx[0], dx[1])
                assert_close(dx[0], rdx, adx, f"dx, phases={phases}, {threads} thread(s)")
        finally:
            _bf16._set_dx_phases(old)


@needs_native
@pytest.mark.parametrize("N, C, O, H, K, stride, pad", [
    (24, 16, 16, 8, 3, 1, 1),    # small planes: whole images stacked into one block
    (5, 6, 10, 15, 3, 1, 1),     # output rows of 16: two per tile, straight into y
    (11, 5, 9, 7, 3, 1, 1),      # output rows of 8: four per tile, an odd number of rows
    (3, 3, 4, 31, 3, 1, 1),      # output rows of 32
    (2, 4, 4, 18, 3, 1, 0),      # output rows of 16 without padding
    (9, 3, 16, 32, 3, 1, 1),     # a first layer: C = 3
    (10, 16, 32, 16, 3, 2, 1),   # resnet's downsampling conv
    (3, 16, 32, 32, 3, 2, 1),    # and on 32x32: dy rows of 16, dx as phase convolutions on the tiles
    (10, 16, 32, 16, 1, 2, 0),   # and its 1x1 shortcut
    (3, 33, 17, 7, 5, 1, 4),     # padding K - 1
    (2, 4, 6, 9, 3, 1, 5),       # padding >= K (dx through col2im)
    (2, 3, 4, 11, 2, 3, 1),      # even K, stride 3
    (4, 4, 9, 4, 1, 2, 2),       # padding > K at stride 2: output rows wholly inside the padding
    (2, 40, 20, 9, 3, 1, 1),     # 20 channel pairs: two chunks of 16 on the tiles, the second half zero
    (1, 8, 37, 20, 3, 1, 1),     # one image split into row blocks; 37 filters: a partial tile of 16
    (3, 64, 64, 8, 3, 1, 1),     # resnet20's last stage
    (2, 4, 8, 16, 1, 2, 0),      # a strided 1x1: shifted views staged for the tiles, rows of 8
    (2, 4, 8, 32, 1, 2, 0),      # and rows of 16
    (12, 32, 8, 9, 3, 2, 1),     # stride 2 from 32 channels: the tiles' weight gradient, stacked images
    (4, 8, 6, 13, 3, 3, 1),      # stride 3: nine phase images
])
def test_conv2d_layer_shapes_match_and_repeat_bit_for_bit(N, C, O, H, K, stride, pad):
    x, w, b, dy = _conv_case(np.random.default_rng(N * 131 + C), N, C, O, H, H + 1, K, stride, pad)
    ref, mag = conv_model(x, w, b, stride, pad)
    rdx, adx, rdw, adw, rdb = conv_backward_model(x, w, dy, stride, pad)
    for threads in (1, 2):
        runs = []
        for _ in range(2):
            y = np.empty(ref.shape, np.float32)
            dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
            _bf16.conv2d_forward(x, w, b, y, stride, pad, threads)
            _bf16.conv2d_backward(x, w, dy, dx, dw, db, stride, pad, threads)
            runs.append((y, dx, dw, db))
        for a, c in zip(*runs):
            np.testing.assert_array_equal(a, c)  # the same bits at a fixed thread count
        y, dx, dw, db = runs[0]
        assert_close(y, ref, mag, "y")
        assert_close(dx, rdx, adx, "dx")
        assert_close(dw, rdw, adw, "dw")
        np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-4)


@needs_native
def test_conv2d_rounds_its_inputs_like_the_model():
    # values that differ only below bf16's 8 bits of mantissa give the same products
    rng = np.random.default_rng(5)
    x, w, b, dy = _conv_case(rng, 2, 3, 4, 6, 6, 3, 1, 1)
    y1, y2 = np.empty((2, 4, 6, 6), np.float32), np.empty((2, 4, 6, 6), np.float32)
    _bf16.conv2d_forward(x, w, b, y1, 1, 1, 1)
    _bf16.conv2d_forward(bf16_model(x), bf16_model(w), b, y2, 1, 1, 1)
    np.testing.assert_array_equal(y1, y2)
    y3 = np.empty_like(y1)
    _bf16.conv2d_forward(x, w, None, y3, 1, 1, 1)
    assert not np.array_equal(y1, y3)  # the bias is not rounded away


# ------------------------------------------------------------------ linear

@needs_native
@given(st.integers(1, 40), st.integers(1, 70), st.integers(1, 50), st.booleans(), st.integers(0, 2**32 - 1))
@SETTINGS
def test_linear_forward_and_backward_match_the_model(N, F, G, bias, seed):
    rng = np.random.default_rng(seed)
    x, w, dy = _data(rng, (N, F)), _data(rng, (G, F)), _data(rng, (N, G))
    b = _data(rng, (G,)) if bias else None
    xr, wr, dr = _r64(x), _r64(w), _r64(dy)
    ref = xr @ wr.T + (0 if b is None else b)
    mag = abs(xr) @ abs(wr).T + (0 if b is None else abs(b))
    for threads in (1, 2):
        y = np.full((N, G), np.nan, np.float32)
        _bf16.linear_forward(x, w, b, y, threads)
        assert_close(y, ref, mag, "y")
        dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty(G, np.float32)
        _bf16.linear_backward(x, w, dy, dx, dw, db, threads)
        assert_close(dx, dr @ wr, abs(dr) @ abs(wr), "dx")
        assert_close(dw, dr.T @ xr, abs(dr).T @ abs(xr), "dw")
        np.testing.assert_allclose(db, dy.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6 * np.abs(dy).sum())
        dw2 = np.empty_like(w)
        _bf16.linear_backward(x, w, dy, None, dw2, None, threads)
        np.testing.assert_array_equal(dw2, dw)


@needs_native
def test_linear_large_repeats_bit_for_bit():
    rng = np.random.default_rng(11)
    x, w, b, dy = _data(rng, (130, 700)), _data(rng, (300, 700)), _data(rng, (300,)), _data(rng, (130, 300))
    xr, wr = _r64(x), _r64(w)
    for threads in (1, 2):
        outs = []
        for _ in range(2):
            y, dx, dw, db = (np.empty((130, 300), np.float32), np.empty_like(x), np.empty_like(w),
                             np.empty_like(b))
            _bf16.linear_forward(x, w, b, y, threads)
            _bf16.linear_backward(x, w, dy, dx, dw, db, threads)
            outs.append((y, dx, dw, db))
        for a, c in zip(*outs):
            np.testing.assert_array_equal(a, c)
        assert_close(outs[0][0], xr @ wr.T + b, abs(xr) @ abs(wr).T + abs(b), "y")


# ------------------------------------------------------------------ validation

@needs_native
def test_conv_and_linear_validate_their_arguments():
    rng = np.random.default_rng(0)
    x, w, b, dy = _conv_case(rng, 2, 3, 4, 6, 6, 3, 1, 1)
    y = np.empty((2, 4, 6, 6), np.float32)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    with pytest.raises(TypeError, match="conv2d_forward: x must be float32"):
        _bf16.conv2d_forward(x.astype(np.float64), w, b, y, 1, 1, 1)
    with pytest.raises(TypeError, match="w must be a float32 numpy array"):
        _bf16.conv2d_forward(x, w.tolist(), b, y, 1, 1, 1)
    with pytest.raises(ValueError, match="y must have shape \\(2, 4, 6, 6\\)"):
        _bf16.conv2d_forward(x, w, b, np.empty((2, 4, 5, 6), np.float32), 1, 1, 1)
    with pytest.raises(ValueError, match="y must be C-contiguous"):
        _bf16.conv2d_forward(x, w, b, np.empty((2, 4, 6, 12), np.float32)[..., ::2], 1, 1, 1)
    with pytest.raises(ValueError, match="x must have 4 dimension"):
        _bf16.conv2d_forward(x[0], w, b, y, 1, 1, 1)
    with pytest.raises(ValueError, match="w must be \\(O, 3, K, K\\)"):
        _bf16.conv2d_forward(x, w[:, :2].copy(), b, y, 1, 1, 1)
    with pytest.raises(ValueError, match="b must have shape \\(4,\\)"):
        _bf16.conv2d_forward(x, w, b[:3].copy(), y, 1, 1, 1)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        _bf16.conv2d_forward(x, w, b, y, 0, 1, 1)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        _bf16.conv2d_forward(x, w, b, y, 1, -1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        _bf16.conv2d_forward(x[:, :, :1, :1].copy(), w, b, y, 1, 0, 1)
    with pytest.raises(ValueError, match="output y overlaps input x"):
        _bf16.conv2d_forward(x, w[:, :, :1, :1].copy()[:3], None, x, 1, 0, 1)
    with pytest.raises(ValueError, match="dy must have shape"):
        _bf16.conv2d_backward(x, w, dy[:, :3].copy(), dx, dw, db, 1, 1, 1)
    with pytest.raises(ValueError, match="dw must have shape"):
        _bf16.conv2d_backward(x, w, dy, dx, dw[:2].copy(), db, 1, 1, 1)
    with pytest.raises(TypeError, match="dw must be a float32 numpy array, got list"):
        _bf16.conv2d_backward(x, w, dy, dx, dw.tolist(), db, 1, 1, 1)
    with pytest.raises(ValueError, match="dx and dw overlap|output dx overlaps"):
        _bf16.conv2d_backward(x, w, dy, dx, dx.reshape(-1)[:w.size].reshape(w.shape), db, 1, 1, 1)
    ro = np.empty_like(w)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="dw is read-only"):
        _bf16.conv2d_backward(x, w, dy, dx, ro, db, 1, 1, 1)
    lx, lw = np.ones((3, 5), np.float32), np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="x has 5 features but w has 6"):
        _bf16.linear_forward(lx, np.ones((4, 6), np.float32), None, np.empty((3, 4), np.float32), 1)
    with pytest.raises(ValueError, match="y must have shape \\(3, 4\\)"):
        _bf16.linear_forward(lx, lw, None, np.empty((4, 3), np.float32), 1)
    with pytest.raises(TypeError, match="dy must be float32"):
        _bf16.linear_backward(lx, lw, np.ones((3, 4)), None, np.empty_like(lw), None, 1)
    with pytest.raises(ValueError, match="dx must have shape \\(3, 5\\)"):
        _bf16.linear_backward(lx, lw, np.ones((3, 4), np.float32), np.empty((3, 4), np.float32),
                              np.empty_like(lw), None, 1)


@needs_native
def test_empty_batch_gives_zero_gradients():
    x = np.zeros((0, 3, 5, 5), np.float32)
    w = np.ones((2, 3, 3, 3), np.float32)
    b = np.array([1.0, 2.0], np.float32)
    y = np.empty((0, 2, 3, 3), np.float32)
    _bf16.conv2d_forward(x, w, b, y, 1, 0, 2)
    dw, db = np.full_like(w, np.nan), np.full(2, np.nan, np.float32)
    _bf16.conv2d_backward(x, w, np.zeros((0, 2, 3, 3), np.float32), np.empty_like(x), dw, db, 1, 0, 2)
    assert not dw.any() and not db.any()


@needs_native
@pytest.mark.parametrize("panel_bytes, rows_outer", [(1, True), (1 << 14, False), (1 << 22, False)])
def test_conv2d_dw_tuning_changes_the_blocking_not_the_answer(panel_bytes, rows_outer):
    """The stride-1 weight gradient's block budget (images stacked per block) and tile order
    (``_bf16._set_dw_tuning``) walk other code paths; each must still match the model."""
    x, w, _, dy = _conv_case(np.random.default_rng(7), 12, 16, 16, 8, 8, 3, 1, 1)
    _, _, rdw, adw, _ = conv_backward_model(x, w, dy, 1, 1)
    old = _bf16._set_dw_tuning(panel_bytes, rows_outer)
    try:
        for threads in (1, 2):
            dw = np.full(w.shape, np.nan, np.float32)
            _bf16.conv2d_backward(x, w, dy, None, dw, None, 1, 1, threads)
            assert_close(dw, rdw, adw, f"dw, {threads} thread(s), budget {panel_bytes}, rows outer {rows_outer}")
    finally:
        _bf16._set_dw_tuning(*old)
    with pytest.raises(ValueError, match="panel_bytes"):
        _bf16._set_dw_tuning(0, True)


@needs_native
@pytest.mark.parametrize("N, C, O, H, W, K, stride, pad", [
    (6, 5, 37, 8, 8, 3, 1, 1),     # even output rows: dy's pixel pairs transposed straight into the panel
    (6, 5, 37, 8, 9, 3, 1, 1),     # odd rows: pairs straddle rows, through the flat copy
    (5, 4, 20, 10, 6, 5, 1, 2),    # even rows, K = 5
    (7, 6, 33, 9, 12, 1, 2, 0),    # 1x1 at stride 2, even output rows
    (7, 6, 33, 9, 9, 1, 2, 0),     # and odd ones
    (3, 2, 8, 6, 8, 2, 1, 1),      # even K: even rows in an odd padded row
])
def test_conv2d_dw_pairings_of_dy_match_the_model(N, C, O, H, W, K, stride, pad):
    """The stride-1 weight gradient pairs dy's pixels one of two ways (by the parity of the rows);
    both, with several filter blocks and stacked images, match the model and repeat bit for bit."""
    x, w, _, dy = _conv_case(np.random.default_rng(N * 7 + W), N, C, O, H, W, K, stride, pad)
    _, _, rdw, adw, _ = conv_backward_model(x, w, dy, stride, pad)
    for threads in (1, 2):
        got = []
        for _ in range(2):
            dw = np.full(w.shape, np.nan, np.float32)
            _bf16.conv2d_backward(x, w, dy, None, dw, None, stride, pad, threads)
            got.append(dw)
        np.testing.assert_array_equal(got[0], got[1])
        assert_close(got[0], rdw, adw, f"dw, {threads} thread(s)")


@needs_native
@pytest.mark.parametrize("stride, pad", [(1, 1), (2, 1)])
def test_conv2d_backward_without_dw_gives_the_same_dx_and_db(stride, pad):
    """dw=None skips the weight gradient (a caller computing it elsewhere); dx and db are unchanged."""
    x, w, _, dy = _conv_case(np.random.default_rng(11), 3, 5, 7, 9, 9, 3, stride, pad)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty(7, np.float32)
    _bf16.conv2d_backward(x, w, dy, dx, dw, db, stride, pad, 2)
    dx2, db2 = np.full_like(x, np.nan), np.full_like(db, np.nan)
    _bf16.conv2d_backward(x, w, dy, dx2, None, db2, stride, pad, 2)
    np.testing.assert_array_equal(dx2, dx)
    np.testing.assert_array_equal(db2, db)
    _bf16.conv2d_backward(x, w, dy, None, None, None, stride, pad, 2)  # nothing asked: nothing done
