"""Agreement checks of a backend against the NumPy oracle (``parconv selftest``).

Every op of the :class:`~parconv.backends.base.Backend` protocol, forward and every
gradient, runs on the chosen backend over a fixed set of shapes plus ``n_random``
random ones, and is compared with :mod:`parconv.backends.numpy_ref` evaluated in
float64 on the same float32 inputs (so the reference's own rounding does not count
against the backend). An element passes when ``|a - b| <= atol * scale + rtol * |b|``
with ``rtol = 1e-4``, ``atol = 1e-5`` and ``scale = max(1, max |b|)`` over the array:
a sum of many terms is judged against its own magnitude. Indices (argmax, labels,
counts) must match exactly.

Works for any registered backend (numpy, openmp, opencl, third-party); a user can run
it on a new OpenCL device with ``parconv selftest --backend opencl``.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

RTOL = 1e-4
ATOL = 1e-5

__all__ = ["run_selftest", "opencl_devices_info", "RTOL", "ATOL"]


# ----------------------------------------------------------------------- records
@dataclass
class _OpResult:
    """Running tally of one checked quantity (e.g. ``conv2d.dw``)."""

    cases: int = 0
    failures: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.cases > 0 and self.failures == 0


class _Checker:
    def __init__(self, backend):
        self.be = backend
        self.results: dict[str, _OpResult] = {}

    def _rec(self, name: str) -> _OpResult:
        return self.results.setdefault(name, _OpResult())

    def host(self, a) -> np.ndarray:
        if isinstance(a, (float, int, np.generic)):  # scalars (losses) are host values already
            return np.asarray(a)
        return np.asarray(self.be.to_numpy(a))

    def close(self, name: str, actual, expected, case: str) -> None:
        """Record the comparison of a backend array with a float64 reference."""
        rec = self._rec(name)
        rec.cases += 1
        try:
            a = self.host(actual).astype(np.float64)
        except Exception as exc:  # noqa: BLE001 - a broken readback is a failure to report
            rec.failures += 1
            rec.notes.append(f"{case}: cannot read result ({type(exc).__name__}: {exc})")
            return
        e = np.asarray(expected, dtype=np.float64)
        if a.shape != e.shape:
            rec.failures += 1
            rec.notes.append(f"{case}: shape {a.shape} != expected {e.shape}")
            return
        if e.size == 0:
            return
        err = np.abs(a - e)
        err = np.where(np.isnan(a) & np.isnan(e), 0.0, err)
        scale = max(1.0, float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)))
        bad = ~(err <= ATOL * scale + RTOL * np.abs(e))
        max_abs = float(np.nanmax(err)) if np.isfinite(err).any() else math.inf
        rel = max_abs / max(float(np.max(np.abs(e), initial=0.0)), np.finfo(np.float64).tiny)
        rec.max_abs = max(rec.max_abs, max_abs)
        rec.max_rel = max(rec.max_rel, rel)
        if bad.any():
            rec.failures += 1
            if len(rec.notes) < 3:
                i = np.unravel_index(int(np.argmax(np.where(bad, err, -1))), e.shape)
                rec.notes.append(f"{case}: {int(bad.sum())} of {e.size} elements off, worst at {i}: "
                                 f"{a[i]!r} vs {e[i]!r}")

    def equal(self, name: str, actual, expected, case: str) -> None:
        """Record an exact comparison (indices, counts)."""
        rec = self._rec(name)
        rec.cases += 1
        a = np.asarray(actual if np.isscalar(actual) or isinstance(actual, (bool, int)) else self.host(actual))
        e = np.asarray(expected)
        if a.shape != e.shape or not np.array_equal(a, e):
            rec.failures += 1
            if len(rec.notes) < 3:
                rec.notes.append(f"{case}: {a.ravel()[:8]} != expected {e.ravel()[:8]}")

    def fail(self, name: str, case: str, exc: BaseException) -> None:
        rec = self._rec(name)
        rec.cases += 1
        rec.failures += 1
        if len(rec.notes) < 3:
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rec.notes.append(f"{case}: raised {msg}")


def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


# -------------------------------------------------------------------- op checks
def _check_conv2d(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, bias = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    wt = _f32(rng, o, c, k, k, scale=1 / math.sqrt(c * k * k))
    b = _f32(rng, o) if bias else None
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p}{'' if bias else ' nobias'}"
    try:
        X, Wd = be.asarray(x), be.asarray(wt)
        B = be.asarray(b) if bias else None
        y = be.conv2d_forward(X, Wd, B, s, p)
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv2d.y", tag, exc)
        return
    y_ref = ref.conv2d_forward(_f64(x), _f64(wt), _f64(b), s, p)
    ck.close("conv2d.y", y, y_ref, tag)
    dy = _f32(rng, *y_ref.shape, scale=1 / math.sqrt(max(1, y_ref.size // max(1, o))))
    dx_ref, dw_ref, db_ref = ref.conv2d_backward(_f64(x), _f64(wt), _f64(dy), s, p, True, bias)
    try:
        dx, dw, db = be.conv2d_backward(X, Wd, be.asarray(dy), s, p, True, bias)
        ck.close("conv2d.dx", dx, dx_ref, tag)
        ck.close("conv2d.dw", dw, dw_ref, tag)
        if bias:
            ck.close("conv2d.db", db, db_ref, tag)
        _, dw2, _ = be.conv2d_backward(X, Wd, be.asarray(dy), s, p, False, False)
        ck.close("conv2d.dw", dw2, dw_ref, tag + " need_dx=False")
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv2d.dx", tag, exc)


def _check_maxpool2d(ck, ref, rng, case):
    n, c, h, w, k, s = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    tag = f"x{(n, c, h, w)} k{k} s{s}"
    try:
        y, am = be.maxpool2d_forward(be.asarray(x), k, s)
    except Exception as exc:  # noqa: BLE001
        ck.fail("maxpool2d.y", tag, exc)
        return
    y_ref, am_ref = ref.maxpool2d_forward(_f64(x), k, s)
    ck.close("maxpool2d.y", y, y_ref, tag)
    ck.equal("maxpool2d.argmax", am, am_ref, tag)
    dy = _f32(rng, *y_ref.shape)
    try:
        dx = be.maxpool2d_backward(be.asarray(dy), be.asarray(am_ref, np.int32), x.shape)
        ck.close("maxpool2d.dx", dx, ref.maxpool2d_backward(_f64(dy), am_ref, x.shape), tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("maxpool2d.dx", tag, exc)


def _check_fused(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, bias, pk, ps = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    wt = _f32(rng, o, c, k, k, scale=1 / math.sqrt(c * k * k))
    b = _f32(rng, o) if bias else None
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p} pool{pk}/{ps}"
    X, Wd = be.asarray(x), be.asarray(wt)
    B = be.asarray(b) if bias else None
    try:
        y, am = be.conv2d_relu_maxpool2d_forward(X, Wd, B, s, p, pk, ps)
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv_relu_pool.y", tag, exc)
        return
    z_ref = ref.conv2d_forward(_f64(x), _f64(wt), _f64(b), s, p)
    zp_ref, _ = ref.maxpool2d_forward(z_ref, pk, ps)
    y_ref = ref.relu_forward(zp_ref)
    ck.close("conv_relu_pool.y", y, y_ref, tag)
    # argmax: a position of its own window holding the window maximum (up to rounding)
    am_h = np.asarray(ck.host(am), dtype=np.int64)
    rec = ck._rec("conv_relu_pool.argmax")
    rec.cases += 1
    P, Q = z_ref.shape[2], z_ref.shape[3]
    pp, qq = np.meshgrid(np.arange(am_h.shape[2]), np.arange(am_h.shape[3]), indexing="ij")
    hh, ww = am_h // Q, am_h % Q
    inside = (hh >= pp * ps) & (hh < pp * ps + pk) & (ww >= qq * ps) & (ww < qq * ps + pk) & (am_h >= 0) & (am_h < P * Q)
    picked = np.take_along_axis(z_ref.reshape(n, o, -1), np.clip(am_h, 0, P * Q - 1).reshape(n, o, -1), 2)
    scale = max(1.0, float(np.abs(z_ref).max(initial=0.0)))
    near = np.abs(picked.reshape(zp_ref.shape) - zp_ref) <= ATOL * scale + RTOL * np.abs(zp_ref)
    if not (inside.all() and near.all()):
        rec.failures += 1
        rec.notes.append(f"{tag}: argmax outside its window or not a maximum")
        return
    dy = _f32(rng, *y_ref.shape)
    try:
        dx, dw, db = be.conv2d_relu_maxpool2d_backward(X, Wd, y, am, be.asarray(dy), s, p, True, bias)
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv_relu_pool.dx", tag, exc)
        return
    # the oracle's unfused backward, routed through the backend's own argmax
    dz = ref.maxpool2d_backward(ref.relu_backward(y_ref, _f64(dy)), am_h, z_ref.shape)
    dx_ref, dw_ref, db_ref = ref.conv2d_backward(_f64(x), _f64(wt), dz, s, p, True, bias)
    ck.close("conv_relu_pool.dx", dx, dx_ref, tag)
    ck.close("conv_relu_pool.dw", dw, dw_ref, tag)
    if bias:
        ck.close("conv_relu_pool.db", db, db_ref, tag)


def _check_fused_head(ck, ref, rng, case):
    """conv+ReLU+maxpool -> flatten -> linear as one op, against the oracle's composition."""
    n, c, o, h, w, k, s, p, bias, pk, ps, g = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    wt = _f32(rng, o, c, k, k, scale=1 / math.sqrt(c * k * k))
    b = _f32(rng, o) if bias else None
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p} pool{pk}/{ps} head {g}"
    z_ref = ref.conv2d_forward(_f64(x), _f64(wt), _f64(b), s, p)
    y_ref = ref.relu_forward(ref.maxpool2d_forward(z_ref, pk, ps)[0])
    f = y_ref[0].size
    wl, bl = _f32(rng, g, f, scale=1 / math.sqrt(f)), _f32(rng, g)
    X, Wd, WL = be.asarray(x), be.asarray(wt), be.asarray(wl)
    try:
        y, am, logits = be.conv2d_relu_maxpool2d_linear_forward(X, Wd, be.asarray(b) if bias else None, s, p, pk,
                                                                ps, WL, be.asarray(bl))
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv_relu_pool_linear.logits", tag, exc)
        return
    ck.close("conv_relu_pool_linear.y", y, y_ref, tag)
    ck.close("conv_relu_pool_linear.logits", logits, y_ref.reshape(n, f) @ _f64(wl).T + _f64(bl), tag)
    dl = _f32(rng, n, g)
    try:
        dx, dw, db, dwl, dbl = be.conv2d_relu_maxpool2d_linear_backward(X, Wd, y, am, WL, be.asarray(dl), s, p,
                                                                        False, bias, True)
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv_relu_pool_linear.dw", tag, exc)
        return
    am_h = np.asarray(ck.host(am), dtype=np.int64)  # routed through the backend's own argmax
    dy = (_f64(dl) @ _f64(wl)).reshape(y_ref.shape)
    dz = ref.maxpool2d_backward(ref.relu_backward(y_ref, dy), am_h, z_ref.shape)
    _, dw_ref, db_ref = ref.conv2d_backward(_f64(x), _f64(wt), dz, s, p, False, bias)
    ck.close("conv_relu_pool_linear.dw", dw, dw_ref, tag)
    if bias:
        ck.close("conv_relu_pool_linear.db", db, db_ref, tag)
    ck.close("conv_relu_pool_linear.head_dw", dwl, _f64(dl).T @ y_ref.reshape(n, f), tag)
    ck.close("conv_relu_pool_linear.head_db", dbl, _f64(dl).sum(0), tag)


def _check_linear(ck, ref, rng, case):
    n, f, g, bias = case
    be = ck.be
    x = _f32(rng, n, f)
    wt = _f32(rng, g, f, scale=1 / math.sqrt(f))
    b = _f32(rng, g) if bias else None
    tag = f"x{(n, f)} w{(g, f)}{'' if bias else ' nobias'}"
    try:
        X, Wd = be.asarray(x), be.asarray(wt)
        y = be.linear_forward(X, Wd, be.asarray(b) if bias else None)
        ck.close("linear.y", y, ref.linear_forward(_f64(x), _f64(wt), _f64(b)), tag)
        dy = _f32(rng, n, g)
        dx, dw, db = be.linear_backward(X, Wd, be.asarray(dy), True, bias)
        dx_ref, dw_ref, db_ref = ref.linear_backward(_f64(x), _f64(wt), _f64(dy), True, bias)
        ck.close("linear.dx", dx, dx_ref, tag)
        ck.close("linear.dw", dw, dw_ref, tag)
        if bias:
            ck.close("linear.db", db, db_ref, tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("linear.y", tag, exc)


def _check_activations(ck, ref, rng, shape):
    be = ck.be
    x = _f32(rng, *shape, scale=3.0)
    dy = _f32(rng, *shape)
    tag = f"{shape}"
    for op in ("relu", "sigmoid"):
        try:
            y = getattr(be, f"{op}_forward")(be.asarray(x))
            y_ref = getattr(ref, f"{op}_forward")(_f64(x))
            ck.close(f"{op}.y", y, y_ref, tag)
            dx = getattr(be, f"{op}_backward")(be.asarray(y_ref.astype(np.float32)), be.asarray(dy))
            ck.close(f"{op}.dx", dx, getattr(ref, f"{op}_backward")(_f64(y_ref.astype(np.float32)), _f64(dy)), tag)
        except Exception as exc:  # noqa: BLE001
            ck.fail(f"{op}.y", tag, exc)


def _check_losses(ck, ref, rng, case):
    n, g = case
    be = ck.be
    logits = _f32(rng, n, g, scale=3.0)
    labels = rng.integers(0, g, n).astype(np.int32)
    tag = f"logits{(n, g)}"
    try:
        L, Y = be.asarray(logits), be.asarray(labels, np.int32)
        loss, probs = be.softmax_cross_entropy_forward(L, Y)
        loss_ref, probs_ref = ref.softmax_cross_entropy_forward(_f64(logits), labels)
        ck.close("softmax_xent.loss", np.float64(loss), loss_ref, tag)
        ck.close("softmax_xent.probs", probs, probs_ref, tag)
        d = be.softmax_cross_entropy_backward(probs, Y)
        ck.close("softmax_xent.dlogits", d, ref.softmax_cross_entropy_backward(probs_ref, labels), tag)
        ck.equal("count_correct", be.count_correct(L, Y), ref.count_correct(logits, labels), tag)
        ck.equal("argmax_rows", be.argmax_rows(L), ref.argmax_rows(logits), tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("softmax_xent.loss", tag, exc)
    # BCE on probabilities, a few of them exactly 0 or 1 so the clip is exercised
    p = rng.uniform(0, 1, (n, g)).astype(np.float32)
    p.flat[:: max(1, p.size // 3)] = rng.choice([0.0, 1.0])
    t = rng.integers(0, 2, (n, g)).astype(np.float32)
    eps = 1e-7
    try:
        P, T = be.asarray(p), be.asarray(t)
        # float32 data is clipped at the float32 values of eps and 1 - eps
        lo, hi = np.float64(np.float32(eps)), np.float64(np.float32(1 - eps))
        loss_ref = ref.bce_forward(np.clip(_f64(p), lo, hi), _f64(t), eps)
        ck.close("bce.loss", np.float64(be.bce_forward(P, T, eps)), loss_ref, tag)
        # the reference backward in float64 clips at the float32 bounds the forward used
        ck.close("bce.dp", be.bce_backward(P, T, eps), _bce_backward_ref(p, t, eps), tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("bce.loss", tag, exc)


def _bce_backward_ref(p, t, eps):
    lo, hi = np.float64(np.float32(eps)), np.float64(np.float32(1 - eps))
    p64, t64 = _f64(p), _f64(t)
    pc = np.clip(p64, lo, hi)
    g = (pc - t64) / (pc * (1 - pc)) / p.size
    return np.where((p64 < lo) | (p64 > hi), 0.0, g)


def _check_optim(ck, ref, rng, case):
    size, variant = case
    be = ck.be
    p, g = _f32(rng, size), _f32(rng, size)
    tag = f"n={size} {variant}"
    try:
        if variant.startswith("sgd"):
            momentum = 0.0 if variant == "sgd" else 0.9
            nesterov = "nesterov" in variant
            wd = 0.01 if "wd" in variant else 0.0
            v = _f32(rng, size) if momentum else None
            P, V = be.asarray(p.copy()), (be.asarray(v.copy()) if momentum else None)
            for _ in range(2):
                be.sgd_update(P, be.asarray(g), V, 0.1, momentum, wd, nesterov)
            p64, v64 = _f64(p), _f64(v)
            for _ in range(2):
                ref.sgd_update(p64, _f64(g), v64, 0.1, momentum, wd, nesterov)
            ck.close("sgd.p", P, p64, tag)
            if momentum:
                ck.close("sgd.v", V, v64, tag)
        elif variant.startswith("rmsprop"):
            momentum = 0.9 if "momentum" in variant else 0.0
            wd = 0.01 if "wd" in variant else 0.0
            sq, buf = np.abs(_f32(rng, size, scale=0.1)), _f32(rng, size, scale=0.1)
            P, SQ = be.asarray(p.copy()), be.asarray(sq.copy())
            BUF = be.asarray(buf.copy()) if momentum else None
            p64, sq64, buf64 = _f64(p), _f64(sq), _f64(buf)
            for _ in range(3):
                be.rmsprop_update(P, be.asarray(g), SQ, BUF, 1e-2, 0.99, 1e-8, wd, momentum)
                ref.rmsprop_update(p64, _f64(g), sq64, buf64 if momentum else None, 1e-2, 0.99, 1e-8, wd, momentum)
            ck.close("rmsprop.p", P, p64, tag)
            ck.close("rmsprop.square_avg", SQ, sq64, tag)
            if momentum:
                ck.close("rmsprop.momentum_buffer", BUF, buf64, tag)
        else:
            decoupled = variant == "adamw"
            wd = 0.01 if "wd" in variant or decoupled else 0.0
            m, v = _f32(rng, size, scale=0.1), np.abs(_f32(rng, size, scale=0.1))
            P, M, V = be.asarray(p.copy()), be.asarray(m.copy()), be.asarray(v.copy())
            p64, m64, v64 = _f64(p), _f64(m), _f64(v)
            for step in (1, 2, 3):
                be.adam_update(P, be.asarray(g), M, V, 1e-3, 0.9, 0.999, 1e-8, wd, step, decoupled)
                ref.adam_update(p64, _f64(g), m64, v64, 1e-3, 0.9, 0.999, 1e-8, wd, step, decoupled)
            name = "adamw" if decoupled else "adam"
            ck.close(f"{name}.p", P, p64, tag)
            ck.close(f"{name}.m", M, m64, tag)
            ck.close(f"{name}.v", V, v64, tag)
        for norm_type in (2.0, math.inf):
            ck.close(f"norm_many.{'inf' if norm_type == math.inf else 'l2'}", be.norm_many([be.asarray(g)], norm_type),
                     ref.norm_many([_f64(g)], norm_type), tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail(variant.split("-")[0] + ".p", tag, exc)


def _check_arrays(ck, rng):
    be = ck.be
    tag = "array ops"
    try:
        x = _f32(rng, 3, 4, 5)
        a = be.asarray(x.copy())  # host backends may alias their input
        ck.close("arrays.asarray", a, x, tag)
        ck.close("arrays.reshape", be.reshape(a, (12, 5)), x.reshape(12, 5), tag)
        c = be.copy(a)
        be.fill(a, 2.5)
        ck.close("arrays.copy", c, x, tag)
        ck.close("arrays.fill", a, np.full_like(x, 2.5), tag)
        be.copy_into(a, c)
        ck.close("arrays.copy_into", a, x, tag)
        ck.close("arrays.zeros", be.zeros((2, 3)), np.zeros((2, 3)), tag)
        ck.equal("arrays.all_finite", be.all_finite(a), True, tag)
        bad = x.copy()
        bad[1, 2, 3] = np.nan
        ck.equal("arrays.all_finite", be.all_finite(be.asarray(bad)), False, tag + " with NaN")
        bad[1, 2, 3] = np.inf
        ck.equal("arrays.all_finite", be.all_finite(be.asarray(bad)), False, tag + " with inf")
    except Exception as exc:  # noqa: BLE001
        ck.fail("arrays.asarray", tag, exc)


# ------------------------------------------------------------------- shape sets
_FIXED_CONV = [  # n, c, o, h, w, k, stride, pad, bias
    (2, 3, 4, 8, 8, 3, 1, 1, True), (1, 1, 1, 1, 1, 1, 1, 0, True), (3, 4, 9, 9, 7, 3, 2, 1, True),
    (2, 5, 16, 11, 13, 5, 3, 2, False), (1, 2, 3, 5, 5, 4, 1, 3, True), (2, 16, 10, 20, 20, 7, 1, 3, True),
    (4, 1, 8, 28, 28, 3, 1, 0, True), (2, 8, 24, 12, 12, 3, 1, 1, True),
]
_FIXED_POOL = [(2, 3, 8, 8, 2, 2), (1, 1, 5, 5, 4, 1), (2, 4, 7, 9, 3, 2), (1, 2, 26, 26, 2, 2), (1, 1, 1, 1, 1, 1)]
_FIXED_FUSED = [  # conv case + pool kernel, pool stride
    (2, 1, 8, 28, 28, 3, 1, 0, True, 2, 2), (1, 3, 5, 9, 9, 3, 1, 1, False, 3, 2), (2, 2, 12, 10, 11, 3, 2, 1, True, 2, 1),
]
_FIXED_HEAD = [  # fused case + head outputs; the first is a network's first layer with a wide head
    (3, 1, 16, 28, 28, 3, 1, 0, True, 2, 2, 10), (2, 2, 5, 9, 9, 3, 1, 1, False, 3, 2, 3),
]
_FIXED_LINEAR = [(1, 1, 1, True), (4, 7, 3, True), (10, 169, 10, True), (33, 65, 17, False), (100, 300, 70, True)]
_FIXED_ACT = [(1,), (7, 3), (2, 3, 4, 5), (1000,)]
_FIXED_LOSS = [(1, 1), (4, 3), (100, 10), (257, 5)]
_OPTIM_VARIANTS = ["sgd", "sgd-momentum", "sgd-nesterov-wd", "adam", "adam-wd", "adamw", "rmsprop",
                   "rmsprop-momentum-wd"]


def _random_conv(rng, fused=False):
    while True:
        n, c, o = int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.integers(1, 17))
        h, w, k = int(rng.integers(1, 15)), int(rng.integers(1, 15)), int(rng.integers(1, 6))
        s, p = int(rng.integers(1, 4)), int(rng.integers(0, 4))
        if k > h + 2 * p or k > w + 2 * p:
            continue
        case = (n, c, o, h, w, k, s, p, bool(rng.integers(0, 2)))
        if not fused:
            return case
        P, Q = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        pk = int(rng.integers(1, 4))
        if pk > min(P, Q):
            continue
        return case + (pk, int(rng.integers(1, pk + 1)))


def _random_pool(rng):
    while True:
        n, c, h, w = (int(v) for v in rng.integers(1, [4, 6, 15, 15]))
        k, s = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        if k <= min(h, w):
            return n, c, h, w, k, s


# ------------------------------------------------------------------------- run
def run_selftest(backend_name, seed: int = 0, n_random: int = 20, file=None) -> bool:
    """Check every op of a backend against the NumPy oracle and print a pass/fail table.

    Parameters
    ----------
    backend_name : str or Backend
        A registered backend (``"numpy"``, ``"openmp"``, ``"opencl"``, ...), or a
        backend instance.
    seed : int
        Seed of the data and of the random shapes.
    n_random : int
        Random shapes per op on top of the fixed ones.
    file : text stream, optional
        Where the table goes; default ``sys.stdout`` at call time (so redirections and
        pytest's capture see it).

    Returns
    -------
    bool
        True when every check passed; False on any failure, including a backend that
        cannot be loaded or an op that raises.
    """
    from .backends import get
    from .backends.numpy_ref import NumpyBackend

    file = sys.stdout if file is None else file
    out = lambda *a: print(*a, file=file)  # noqa: E731
    try:
        be = get(backend_name)
    except Exception as exc:  # noqa: BLE001 - reported, then a failed run
        out(f"parconv selftest: backend {backend_name!r} cannot be loaded: {exc}")
        return False
    ref = NumpyBackend()
    rng = np.random.default_rng(seed)
    ck = _Checker(be)
    t0 = time.perf_counter()
    backend_name = be.name
    out(f"parconv selftest: backend {backend_name!r} ({be!r}) against the NumPy oracle in float64")
    out(f"seed {seed}, fixed shapes plus {n_random} random ones per op; "
        f"pass: |a - b| <= {ATOL:g} * max(1, max|b|) + {RTOL:g} * |b|")

    def guarded(fn, *args):
        try:
            fn(ck, *args)
        except Exception as exc:  # noqa: BLE001 - a crash in a check is a failure of that op
            ck.fail(fn.__name__.replace("_check_", ""), str(args[-1]), exc)
            if len(ck.results[fn.__name__.replace("_check_", "")].notes) <= 1:
                traceback.print_exc(file=file)

    guarded(_check_arrays, rng)
    for case in _FIXED_CONV + [_random_conv(rng) for _ in range(n_random)]:
        guarded(_check_conv2d, ref, rng, case)
    for case in _FIXED_POOL + [_random_pool(rng) for _ in range(n_random)]:
        guarded(_check_maxpool2d, ref, rng, case)
    for case in _FIXED_FUSED + [_random_conv(rng, fused=True) for _ in range(n_random)]:
        guarded(_check_fused, ref, rng, case)
    for case in _FIXED_HEAD:
        guarded(_check_fused_head, ref, rng, case)
    rand_lin = [(int(rng.integers(1, 65)), int(rng.integers(1, 200)), int(rng.integers(1, 40)), bool(rng.integers(0, 2)))
                for _ in range(n_random)]
    for case in _FIXED_LINEAR + rand_lin:
        guarded(_check_linear, ref, rng, case)
    rand_act = [tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(1, 5)))) for _ in range(n_random)]
    for shape in _FIXED_ACT + rand_act:
        guarded(_check_activations, ref, rng, shape)
    rand_loss = [(int(rng.integers(1, 300)), int(rng.integers(1, 20))) for _ in range(n_random)]
    for case in _FIXED_LOSS + rand_loss:
        guarded(_check_losses, ref, rng, case)
    sizes = [1, 7, 1000] + [int(rng.integers(1, 5000)) for _ in range(max(0, n_random // len(_OPTIM_VARIANTS)))]
    for size in sizes:
        for variant in _OPTIM_VARIANTS:
            guarded(_check_optim, ref, rng, (size, variant))

    ok = all(r.ok for r in ck.results.values())
    out("")
    width = max([24] + [len(name) for name in ck.results])
    out(f"{'op':{width}s} {'cases':>5s} {'max abs err':>12s} {'max rel err':>12s}  result")
    for name in sorted(ck.results):
        r = ck.results[name]
        out(f"{name:{width}s} {r.cases:5d} {r.max_abs:12.2e} {r.max_rel:12.2e}  {'pass' if r.ok else 'FAIL'}")
        for note in r.notes[:3]:
            out(f"    {note}")
    n_fail = sum(not r.ok for r in ck.results.values())
    out("")
    out(f"{'PASSED' if ok else 'FAILED'}: {len(ck.results) - n_fail} of {len(ck.results)} checks passed "
        f"on backend {backend_name!r} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        _report_failure(be, [name for name, r in sorted(ck.results.items()) if not r.ok], file)
    return ok


def _report_failure(be, failed: list, file) -> None:
    """A banner naming the failed checks, on the table's stream and on stderr when that is another stream."""
    shown = ", ".join(failed[:12]) + (f" and {len(failed) - 12} more" if len(failed) > 12 else "")
    banner = "\n".join([
        "=" * 78,
        f"parconv selftest FAILED on {be!r}: {len(failed)} checks gave wrong results or errors",
        f"  failed: {shown}",
        "  Results computed on this backend/device cannot be trusted: do not train on it.",
        "  OpenCL: choose another device (PARCONV_OPENCL_DEVICE) or use the openmp backend,",
        "  and report the table above with your driver's name and version.",
        "=" * 78,
    ])
    print(banner, file=file)
    if file is not sys.stderr:
        print(banner, file=sys.stderr)


# ---------------------------------------------------------------------- devices
def _device_type_name(cl, bits: int) -> str:
    """"GPU", "CPU", "ACCELERATOR" or "CUSTOM" from a device-type bitfield (drivers also set DEFAULT)."""
    names = [n for n in ("GPU", "CPU", "ACCELERATOR", "CUSTOM") if bits & getattr(cl.device_type, n, 0)]
    return " | ".join(names) or "UNKNOWN"


def opencl_devices_info() -> list[dict]:
    """Every OpenCL device visible here, for ``parconv info``; [] without pyopencl.

    Each dict has ``platform_index``, ``device_index``, ``platform``, ``name``,
    ``vendor``, ``type``, ``compute_units``, ``global_mem_bytes``,
    ``max_work_group_size``, ``local_mem_bytes`` and ``version``.
    """
    try:
        import pyopencl as cl
    except ImportError:
        return []
    try:
        platforms = cl.get_platforms()
    except Exception:  # noqa: BLE001 - no ICD / no platform: nothing to list
        return []
    info = []
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:  # noqa: BLE001
            continue
        for di, d in enumerate(devices):
            info.append({
                "platform_index": pi,
                "device_index": di,
                "platform": platform.name.strip(),
                "name": d.name.strip(),
                "vendor": d.vendor.strip(),
                "type": _device_type_name(cl, d.type),
                "compute_units": int(d.max_compute_units),
                "global_mem_bytes": int(d.global_mem_size),
                "max_work_group_size": int(d.max_work_group_size),
                "local_mem_bytes": int(d.local_mem_size),
                "version": d.version.strip(),
            })
    return info
