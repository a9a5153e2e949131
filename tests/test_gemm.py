"""The register-blocked GEMM of the linear layers (pc_gemm.h) at every ISA level, and the fused
Linear -> ReLU step of a Sequential."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parconv as pc
from conftest import assert_close, host, needs_torch, rand, run_at_isa_level

ext = pytest.importorskip("parconv._ext")
if not ext.STATE.get("built"):
    pytest.skip("the compiled kernels are not built", allow_module_level=True)

from parconv._ext import _dense  # noqa: E402



def _tol(k):
    return 2e-6 * (k ** 0.5 + 4)


def _gemm_errors(m, n, k, seed, threads, relu):
    """Max errors of gemm_nt (with bias, relu) and gemm_nn (both layouts of a) against float64."""
    rng = np.random.default_rng(seed)
    a, b = rand(rng, m, k), rand(rng, n, k)
    bias = rand(rng, n)
    c = np.full((m, n), np.nan, np.float32)
    _dense.gemm_nt(a, b, bias, c, relu, threads)
    want = a.astype(np.float64) @ b.T.astype(np.float64) + bias
    if relu:
        want = np.maximum(want, 0)
    errs = [float(np.abs(c - want).max())]
    bn = rand(rng, k, n)
    want = a.astype(np.float64) @ bn.astype(np.float64)
    c = np.full((m, n), np.nan, np.float32)
    _dense.gemm_nn(a, bn, c, False, threads)
    errs.append(float(np.abs(c - want).max()))
    c = np.full((m, n), np.nan, np.float32)
    _dense.gemm_nn(np.ascontiguousarray(a.T), bn, c, True, threads)
    errs.append(float(np.abs(c - want).max()))
    return errs


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.integers(1, 90), st.integers(0, 2**31 - 1), st.booleans(),
       st.sampled_from([1, 2]))
def test_gemm_matches_float64(m, n, k, seed, relu, threads):
    """Odd sizes, one row or column, k not a multiple of any vector width: every element written
    (the outputs start as NaN) and close to the float64 product."""
    assert max(_gemm_errors(m, n, k, seed, threads, relu)) <= _tol(k)


@settings(max_examples=40, deadline=None)
@given(st.integers(32, 150), st.integers(1, 80), st.integers(2, 400), st.integers(0, 2**31 - 1),
       st.booleans(), st.sampled_from([1, 2]))
def test_gemm_nn_packed_panels_keep_the_bits_of_reading_in_place(m, n, k, seed, trans, threads):
    """From 32 rows a block copies its panels of b (and, for dy^T, its rows of a) in blocks of the
    depth before its tiles run; fewer rows read them in place. Each element's FMAs are the same
    chain either way, so rows computed 16 at a time (in place) equal the packed product bit for bit."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    bn = rng.standard_normal((k, n)).astype(np.float32)
    src = np.ascontiguousarray(a.T) if trans else a
    whole = np.full((m, n), np.nan, np.float32)
    _dense.gemm_nn(src, bn, whole, trans, threads)
    for r in range(0, m, 16):
        rows = slice(r, min(m, r + 16))
        part = np.full((rows.stop - r, n), np.nan, np.float32)
        _dense.gemm_nn(np.ascontiguousarray(a[rows].T) if trans else np.ascontiguousarray(a[rows]), bn, part,
                       trans, threads)
        assert np.array_equal(part, whole[rows]), (r, m, n, k)


def test_gemm_checks_shapes():
    a, b, c = np.ones((3, 4), np.float32), np.ones((5, 4), np.float32), np.ones((3, 5), np.float32)
    with pytest.raises(ValueError, match="b must have"):
        _dense.gemm_nt(a, np.ones((5, 3), np.float32), None, c, False, 1)
    with pytest.raises(ValueError, match="c must have shape"):
        _dense.gemm_nt(a, b, None, np.ones((5, 3), np.float32), False, 1)
    with pytest.raises(ValueError, match="bias must have 5"):
        _dense.gemm_nt(a, b, np.ones(4, np.float32), c, False, 1)
    with pytest.raises(ValueError, match="b must have 4 rows"):
        _dense.gemm_nn(a, b, c, False, 1)


def _child_code():
    return textwrap.dedent("""
        import json
        import numpy as np
        import parconv as pc
        from parconv import _ext
        from parconv._ext import _dense
        rng = np.random.default_rng(3)
        fails, worst = [], 0.0
        shapes = [(1, 1, 1), (1, 512, 784), (1, 17, 33), (5, 1, 19), (3, 7, 1), (64, 512, 784), (9, 33, 17),
                  (70, 10, 512), (13, 65, 100), (32, 64, 3), (95, 130, 20), (31, 200, 9), (2, 31, 15), (257, 19, 47), (4, 4, 16), (33, 70, 129),
                  (1, 9, 200), (1, 23, 67), (2, 130, 300), (3, 8, 64), (1, 1000, 40)]
        for m, n, k in shapes:
            a, b, bn, bias = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (k, n), (n,)))
            ref_nt = np.maximum(a.astype(np.float64) @ b.T.astype(np.float64) + bias, 0)
            ref_nn = a.astype(np.float64) @ bn.astype(np.float64)
            outs = []
            for nt in (1, 2, 2):
                c1, c2, c3 = (np.full((m, n), np.nan, np.float32) for _ in range(3))
                _dense.gemm_nt(a, b, bias, c1, True, nt)
                _dense.gemm_nn(a, bn, c2, False, nt)
                _dense.gemm_nn(np.ascontiguousarray(a.T), bn, c3, True, nt)
                outs.append((c1, c2, c3))
                err = max(float(np.abs(c1 - ref_nt).max()), float(np.abs(c2 - ref_nn).max()),
                          float(np.abs(c3 - ref_nn).max()))
                worst = max(worst, err / (k ** 0.5 + 4))
            # the same bits on every repeat and at every thread count
            if not all(np.array_equal(x, y) for o in outs[1:] for x, y in zip(o, outs[0])):
                fails.append(("bits", m, n, k))
            # in a small batch (the dot-form tiles) a row's bits do not depend on the other rows:
            # batch 1 is the matrix-vector tile
            if m < 32:
                c1 = np.empty((1, n), np.float32)
                _dense.gemm_nt(a[m - 1:], b, bias, c1, True, 1)
                if not np.array_equal(c1[0], outs[0][0][m - 1]):
                    fails.append(("row", m, n, k))
                # the one-call entry of the linear layers: the same bits
                for nt in (1, 2):
                    y = _dense.gemm_linear(a, b, bias, nt, True, -1)
                    if y is None or not np.array_equal(y, outs[0][0]):
                        fails.append(("gemm_linear", m, n, k, nt))
        # the backend's default routes: at a batch below GEMM_BACKWARD_MIN_ROWS the backward is the sgemm's
        # (the same bits as forcing it), from it the own GEMM's; the forward is the own GEMM's at every batch
        from parconv import backends
        be = backends.get("openmp")
        routes = {}
        for rows in (1, 2, 5):
            x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((rows, 300), (70, 300), (rows, 70)))
            got = {}
            for mode in (None, True, False):
                be.gemm_linear = mode
                y = be.linear_forward(x, w, None)
                dx, dw, _ = be.linear_backward(x, w, dy)
                got[mode] = (y, dx, dw)
            be.gemm_linear = None
            same = lambda i, m: np.array_equal(got[None][i], got[m][i])
            fwd = "gemm" if same(0, True) else ("blas" if same(0, False) else "?")
            bwd = "gemm" if same(1, True) and same(2, True) else ("blas" if same(1, False) and same(2, False) else "?")
            routes[rows] = [fwd, bwd]
            ref = (x.astype(np.float64) @ w.T.astype(np.float64), dy.astype(np.float64) @ w.astype(np.float64),
                   dy.T.astype(np.float64) @ x.astype(np.float64))
            for g, r in zip(got[None], ref):
                worst = max(worst, float(np.abs(g - r).max()) / (300 ** 0.5 + 4))
        print(json.dumps({"level": _ext.STATE["level"], "fails": fails, "worst": worst, "routes": routes,
                          "preferred": _dense.GEMM_PREFERRED, "backward_min_rows": _dense.GEMM_BACKWARD_MIN_ROWS}))
    """)


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_every_level_matches_float64_and_repeats_its_bits(level):
    result = run_at_isa_level(level, _child_code())
    assert result["level"] == level
    assert result["fails"] == []
    assert result["worst"] <= 1e-5, result
    # the own GEMM is the default at the vector levels (the AVX2 level's backward from two rows: a rank-1
    # update is the sgemm's); the generic level keeps the BLAS
    assert result["preferred"] == (level != "generic")
    assert result["backward_min_rows"] == {"avx2": 2}.get(level, 1)
    own = "blas" if level == "generic" else "gemm"
    assert result["routes"] == {"1": [own, "blas" if level != "avx512" else own], "2": [own, own], "5": [own, own]}


# ------------------------------------------------------------- backend and fusion

@pytest.fixture(params=[True, False], ids=["gemm", "blas"])
def openmp(request):
    be = pc.backends.get("openmp")
    old = be.gemm_linear
    be.gemm_linear = request.param
    yield be
    be.gemm_linear = old


@pytest.mark.parametrize("n,f,g", [(1, 784, 512), (64, 784, 512), (7, 33, 17), (256, 512, 10), (3, 2049, 5)])
def test_linear_relu_ops_match_the_unfused_ops_bit_for_bit(openmp, n, f, g):
    """linear_relu_forward/backward (the ReLU applied as y is stored, dy masked once with db summed in
    the same pass) give the bits of linear_forward -> relu_forward and relu_backward -> linear_backward,
    on the own GEMM and on the BLAS path."""
    rng = np.random.default_rng(n + f + g)
    x, w, b, dy = rand(rng, n, f), rand(rng, g, f, scale=f ** -0.5), rand(rng, g), rand(rng, n, g)
    with pc.num_threads(2):
        y = openmp.linear_relu_forward(x, w, b)
        assert np.array_equal(y, openmp.relu_forward(openmp.linear_forward(x, w, b)))
        got = openmp.linear_relu_backward(x, w, y, dy, True, True)
        want = openmp.linear_backward(x, w, openmp.relu_backward(y, dy), True, True)
    for a, e, name in zip(got, want, ("dx", "dw", "db")):
        assert np.array_equal(a, e), name
    ref = np.maximum(x.astype(np.float64) @ w.T.astype(np.float64) + b, 0)
    assert_close(y, ref, atol=1e-4, what="y")


def test_own_gemm_linear_repeats_its_bits_under_any_thread_count():
    be = pc.backends.get("openmp")
    old = be.gemm_linear
    be.gemm_linear = True
    try:
        rng = np.random.default_rng(4)
        x, w, b, dy = rand(rng, 100, 300), rand(rng, 70, 300), rand(rng, 70), rand(rng, 100, 70)
        runs = []
        for nt in (1, 2, 2, 3):
            with pc.num_threads(nt):
                y = be.linear_relu_forward(x, w, b)
                runs.append((y,) + tuple(be.linear_relu_backward(x, w, y, dy, True, True)))
        for r in runs[1:]:
            for a, e in zip(r, runs[0]):
                assert np.array_equal(a, e)
    finally:
        be.gemm_linear = old


def _mlp(backend, fuse, sizes=(20, 16, 12, 3)):
    pc.manual_seed(7)
    layers = []
    for i, (f, g) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [pc.Linear(f, g)] + ([pc.ReLU()] if i < len(sizes) - 2 else [])
    return pc.Sequential(*layers, backend=backend, fuse=fuse)


@pytest.mark.parametrize("training", [True, False])
def test_sequential_fuses_linear_relu_as_the_layers(backend, training):
    """Linear -> ReLU runs as one step in both modes and gives the layers' output, input gradient and
    parameter gradients (bit for bit on the openmp backend)."""
    from parconv._fusion import LinearReLU, count_fused

    rng = np.random.default_rng(9)
    x, dy = rand(rng, 5, 20), rand(rng, 5, 3)
    fused, plain = _mlp(backend, True).train(training), _mlp(backend, False).train(training)
    assert count_fused(fused.plan()) == 2 and count_fused(plain.plan()) == 0
    assert all(isinstance(s.step, LinearReLU) for s in fused.plan() if s.stop - s.start == 2)
    outs = []
    for model in (fused, plain):
        y = model.forward(backend.asarray(x))
        dx = model.backward(backend.asarray(dy), need_dx=True)
        outs.append((host(y), host(dx), [host(p.grad) for p in model.parameters()]))
    (y1, dx1, g1), (y2, dx2, g2) = outs
    exact = backend.name == "openmp"
    for a, e in [(y1, y2), (dx1, dx2)] + list(zip(g1, g2)):
        if exact:
            assert np.array_equal(a, e)
        else:
            assert_close(a, e, atol=1e-5)


def test_fused_linear_relu_checks_its_input_and_dy():
    model = _mlp("openmp", True)
    with pytest.raises(ValueError, match="layer 0"):
        model.forward(np.ones((2, 19), np.float32))
    model.forward(np.ones((2, 20), np.float32))
    with pytest.raises(ValueError, match="dy must have"):
        model.plan()[0].step.backward(np.ones((2, 3), np.float32))
    fresh = _mlp("openmp", True)
    with pytest.raises(ValueError, match="forward pass"):
        fresh.plan()[0].step.backward(np.ones((2, 16), np.float32))


def test_fused_linear_relu_under_bf16_autocast_runs_the_layers():
    from parconv._fusion import count_fused

    rng = np.random.default_rng(1)
    x, dy = rand(rng, 4, 20), rand(rng, 4, 3)
    outs = []
    for fuse in (True, False):
        model = _mlp("openmp", fuse)
        assert count_fused(model.plan()) == (2 if fuse else 0)
        with pc.autocast():
            y = model.forward(x)
            dx = model.backward(dy, need_dx=True)
        outs.append((host(y), host(dx)))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


@needs_torch
@pytest.mark.parametrize("n", [1, 64])
def test_fused_mlp_matches_pytorch(n):
    import torch

    from parconv._fusion import count_fused

    sizes = (784, 512, 512, 10)
    model = _mlp("openmp", True, sizes)
    assert count_fused(model.plan()) == 2
    tm = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                             torch.nn.Linear(512, 10))
    with torch.no_grad():
        for tl, pl in zip([m for m in tm if isinstance(m, torch.nn.Linear)], [m for m in model if type(m) is pc.Linear]):
            tl.weight.copy_(torch.from_numpy(host(pl.weight.data)))
            tl.bias.copy_(torch.from_numpy(host(pl.bias.data)))
    rng = np.random.default_rng(n)
    x, dy = rand(rng, n, 784), rand(rng, n, 10)
    y = model.forward(x)
    dx = model.backward(dy, need_dx=True)
    xt = torch.from_numpy(x).requires_grad_(True)
    yt = tm(xt)
    yt.backward(torch.from_numpy(dy))
    assert_close(y, yt.detach().numpy(), atol=1e-4, what="y")
    assert_close(dx, xt.grad.numpy(), atol=1e-4, what="dx")
    for p, tp in zip(model.parameters(), tm.parameters()):
        assert_close(p.grad, tp.grad.numpy(), atol=2e-4, what="grad")


def test_gemm_linear_forward_checks_its_arrays_and_matches_the_memoryview_entry():
    """The batch-1 entry reads ndarray pointers directly; every array is checked first."""
    rng = np.random.default_rng(2)
    for n in (1, 64):
        x, w, b = rand(rng, n, 30), rand(rng, 70, 30), rand(rng, 70)
        y1, y2 = np.empty((n, 70), np.float32), np.empty((n, 70), np.float32)
        shape = _dense.gemm_scratch_shape(n, 70, 30)
        _dense.gemm_linear_forward(x, w, b, y1, 2, True, None if shape is None else np.empty(shape, np.float32))
        _dense.linear_forward(x, w, b, y2, 2, relu=True, gemm=True)
        assert np.array_equal(y1, y2)
    x, w, y = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.empty((2, 4), np.float32)
    bad = [(x.T.copy(), w, None, y), (x, w, np.ones(3, np.float32), y), (x, w, None, np.ones((2, 4))),
           (x.astype(np.float64), w, None, y), (np.asfortranarray(np.ones((2, 3), np.float32)), w, None, y),
           (x, w, None, np.ones((2, 4), np.float32)[:, ::-1]), (np.ones(3, np.float32), w, None, y)]
    for args in bad:
        with pytest.raises(ValueError):
            _dense.gemm_linear_forward(*args, 1, False, None)
    with pytest.raises(TypeError, match="NumPy arrays"):
        _dense.gemm_linear_forward([[1.0]], w, None, y, 1, False, None)
    ro = np.empty((2, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _dense.gemm_linear_forward(x, w, None, ro, 1, False, None)
    if _dense.gemm_scratch_shape(64, 70, 30) is None:
        return  # a level without the transposed form (generic) takes no scratch
    xb, wb, yb = np.ones((64, 30), np.float32), np.ones((70, 30), np.float32), np.empty((64, 70), np.float32)
    with pytest.raises(ValueError, match="scratch"):
        _dense.gemm_linear_forward(xb, wb, None, yb, 1, False, None)
    with pytest.raises(ValueError, match="scratch"):
        _dense.gemm_linear_forward(xb, wb, None, yb, 1, False, np.empty((30, 32), np.float32))


# ------------------------------------------------ small batches: the one-call entry, the row tile

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 70), st.integers(1, 300), st.integers(0, 2**31 - 1), st.booleans(),
       st.booleans(), st.sampled_from([1, 2]))
def test_small_batch_linear_matches_float64_and_the_batched_rows(m, n, k, seed, relu, bias, threads):
    """Fewer rows than a batched tile (a batch of one is a matrix-vector product): every output
    written, close to float64, and each row's bits those it has inside a batch of 32 (the dot
    form) at any thread count."""
    rng = np.random.default_rng(seed)
    a, b = rand(rng, m, k), rand(rng, n, k)
    bb = rand(rng, n) if bias else None
    y = _dense.gemm_linear(a, b, bb, threads, relu, -1)
    want = a.astype(np.float64) @ b.T.astype(np.float64) + (0.0 if bb is None else bb)
    if relu:
        want = np.maximum(want, 0)
    assert y.shape == (m, n) and y.dtype == np.float32
    assert float(np.abs(y - want).max()) <= _tol(k)
    big = np.concatenate([a, rand(rng, 31 - m, k)]) if m < 31 else a
    c = np.full((big.shape[0], n), np.nan, np.float32)
    _dense.gemm_nt(big, b, bb, c, relu, threads)
    assert np.array_equal(y, c[:m])


def test_gemm_linear_takes_only_what_its_kernel_can_read():
    """The one-call entry answers None (the caller converts and takes its general path) for
    anything but C-contiguous float32 ndarrays of matching shapes at a small batch."""
    rng = np.random.default_rng(5)
    x, w, b = rand(rng, 2, 30), rand(rng, 40, 30), rand(rng, 40)
    y = _dense.gemm_linear(x, w, b, 1, False, -1)
    assert np.array_equal(y, np.asarray(_dense.gemm_linear(x, w, b, 2, False, -1)))
    none = [(x.astype(np.float64), w, b), (x, w.astype(np.float64), b), (x, w, b.astype(np.float64)),
            (np.asfortranarray(rand(rng, 2, 30)), w, b), (x, w[:, ::-1], b), (x, w, b[::-1]),
            (x.tolist(), w, b), (x, w, b.tolist()), (x[0], w, b), (x, w[0], b), (x, w, b[:39]),
            (x[:, :29], w, b), (x[:0], w, b), (x, w[:0], b[:0]), (x[:, :0], w[:, :0], b),
            (x[None], w, b), (x, w, b[None])]
    for args in none:
        assert _dense.gemm_linear(*args, 1, False, -1) is None
    # a narrow head (few outputs, many features) and a batch for the transposed form go elsewhere
    xn, wn = rand(rng, 1, 64), rand(rng, 3, 64)
    assert _dense.gemm_linear(xn, wn, None, 1, False, 64) is None
    assert _dense.gemm_linear(xn, wn, None, 1, False, 65) is not None
    assert _dense.gemm_linear(xn, wn, None, 1, False, -1) is not None
    if _dense.gemm_scratch_shape(64, 70, 30) is None:
        return  # a level without the transposed form (generic) runs every batch in the dot form
    xb, wb = rand(rng, 64, 30), rand(rng, 70, 30)
    assert _dense.gemm_linear(xb, wb, None, 1, False, -1) is None


def test_backend_linear_forward_at_batch_one_is_one_call(monkeypatch):
    """The backend's small-batch forward is the one-call entry, with the answer of the general path."""
    be = pc.backends.get("openmp")
    if not (be.gemm_linear if be.gemm_linear is not None else _dense.GEMM_PREFERRED):
        pytest.skip("this level runs the linear layers on the BLAS")
    rng = np.random.default_rng(6)
    x, w, b = rand(rng, 1, 50), rand(rng, 20, 50), rand(rng, 20)
    want = be.linear_relu_forward(x.astype(np.float64), w, b)  # converted: the general path
    calls = []
    real = _dense.gemm_linear_forward
    monkeypatch.setattr(_dense, "gemm_linear_forward", lambda *a: calls.append(1) or real(*a))
    assert np.array_equal(be.linear_relu_forward(x, w, b), want)
    assert calls == []
    be.linear_relu_forward(x.astype(np.float64), w, b)
    assert calls == [1]


def test_gemm_serial_threshold_keeps_the_bits():
    """Splitting a batch-1 product over threads (the tuning hook) gives the serial bits."""
    rng = np.random.default_rng(8)
    x, w, b = rand(rng, 1, 300), rand(rng, 200, 300), rand(rng, 200)
    serial = _dense.gemm_linear(x, w, b, 2, True, -1)
    old = _dense._set_gemm_serial_below(0)
    try:
        assert np.array_equal(_dense.gemm_linear(x, w, b, 2, True, -1), serial)
    finally:
        assert _dense._set_gemm_serial_below(old) == 0
    with pytest.raises(ValueError, match="macs must be >= 0"):
        _dense._set_gemm_serial_below(-1)


# ------------------------------------------------------------- the Linear layer's per-call path

def test_linear_layer_checks_each_input_shape_once(monkeypatch):
    """A Linear layer runs functional.linear's checks once per (x, weight, bias) shape for float32
    arrays used as they are; anything else (another shape, a conversion, bf16) checks again."""
    calls = []
    real = pc.functional.linear
    monkeypatch.setattr(pc.functional, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    pc.manual_seed(3)
    layer = pc.Linear(6, 4)
    rng = np.random.default_rng(9)
    x = rand(rng, 2, 6)
    want = x.astype(np.float64) @ host(layer.weight.data).T.astype(np.float64) + host(layer.bias.data)
    y1 = layer(x)
    assert len(calls) == 1
    y2 = layer(x)
    assert len(calls) == 1 and np.array_equal(host(y1), host(y2))
    assert_close(y2, want, atol=1e-5, what="y")
    layer(rand(rng, 3, 6))  # a new batch size
    assert len(calls) == 2
    layer(x.astype(np.float64))  # converted: checked every time
    layer(x.astype(np.float64))
    assert len(calls) == 4
    layer(np.asfortranarray(rand(rng, 2, 6)))  # not contiguous: converted
    assert len(calls) == 5
    layer(x)  # the cache holds one shape: (3, 6) until now
    assert len(calls) == 6
    with pc.autocast():
        layer(x)
    assert len(calls) == 7
    layer(x)  # bf16 does not forget the float32 shape
    assert len(calls) == 7
    # a parameter of another shape cannot replace the checked one (the cached shapes stay true)
    with pytest.raises(ValueError, match=r"expected an array of shape \(4, 6\), got \(4, 7\)"):
        layer.weight.data = rand(rng, 4, 7)
    layer(x)
    assert len(calls) == 7
    # and a bad input after a cached good one still fails with the layer's message
    pc.manual_seed(3)
    layer = pc.Linear(6, 4)
    layer(x)
    with pytest.raises(ValueError, match="in_features=6"):
        layer(rand(rng, 2, 7))
    with pytest.raises(ValueError, match="2-D"):
        layer(rand(rng, 2, 6, 1))


def test_linear_layer_backward_after_the_cached_forward():
    """The forward that skips the checks keeps what the backward needs (the same gradients)."""
    rng = np.random.default_rng(10)
    x, dy = rand(rng, 3, 6), rand(rng, 3, 4)
    pc.manual_seed(3)
    layer = pc.Linear(6, 4)
    layer(x)
    layer.backward(dy)
    g1 = host(layer.weight.grad).copy(), host(layer.bias.grad).copy()
    layer(x)  # the cached path
    dx = layer.backward(dy)
    assert np.array_equal(host(layer.weight.grad), g1[0]) and np.array_equal(host(layer.bias.grad), g1[1])
    assert_close(dx, dy.astype(np.float64) @ host(layer.weight.data).astype(np.float64), atol=1e-5, what="dx")
    with pc.no_grad():
        layer(x)
    with pytest.raises(RuntimeError, match="no_grad"):
        layer.backward(dy)
