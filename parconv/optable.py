"""The op table: one entry per op family, the single list that drives ``parconv selftest``,
the cross-backend tests (tests/test_optable.py) and the docs' list of supported ops.

Each :class:`OpSpec` names the op, the backend-protocol methods it covers,
the layers built on it, its fixed cases, a generator of random cases, and a
``check(ck, ref, rng, case)`` that runs the backend under test and the NumPy
reference (in float64, on the same float32 inputs) and records the comparison
in a :class:`parconv.selftest.Checker` (elements pass when
``|a - b| <= atol * max(1, max|b|) + rtol * |b|``; indices must match exactly).

Adding an op is one entry here plus its implementations; see the docs page
"Adding an op".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._shapes import out_size

__all__ = ["OpSpec", "OPS", "get_op", "ops_markdown_table", "RTOL", "ATOL"]

#: the agreement every check asks of a backend (see the module docstring)
RTOL = 1e-4
ATOL = 1e-5


@dataclass(frozen=True)
class OpSpec:
    """One op family of the table."""

    #: the name results are reported under (the prefix of every checked quantity)
    name: str
    #: one line for the docs
    summary: str
    #: Backend protocol methods the check exercises (the NumPy reference implements each)
    methods: tuple
    #: layers (or other public names) that run on this op
    used_by: tuple
    #: ``check(ck, ref, rng, case)``: run the backend and the reference, record the comparison
    check: object
    #: cases always checked
    fixed: tuple = ()
    #: ``random_case(rng) -> case``, drawn ``n_random`` times per run (None: fixed cases only)
    random_case: object = None

    def cases(self, rng, n_random: int) -> list:
        """The fixed cases plus ``n_random`` random ones."""
        out = list(self.fixed)
        if self.random_case is not None:
            out += [self.random_case(rng) for _ in range(n_random)]
        return out


def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


# -------------------------------------------------------------------- op checks
def _conv_inputs(rng, n, c, o, h, w, k, bias):
    """x (n, c, h, w), filters (o, c, k, k) scaled to keep outputs near unit size, bias or None."""
    x = _f32(rng, n, c, h, w)
    wt = _f32(rng, o, c, k, k, scale=1 / math.sqrt(c * k * k))
    return x, wt, (_f32(rng, o) if bias else None)


def _check_conv2d(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, bias = case
    be = ck.be
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
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
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
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
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
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


def _check_linear(ck, ref, rng, case, relu=False):
    """``linear_forward``/``linear_backward``, or with ``relu`` the fused ``linear_relu_*`` pair."""
    n, f, g, bias = case
    be = ck.be
    op = "linear_relu" if relu else "linear"
    x = _f32(rng, n, f)
    wt = _f32(rng, g, f, scale=1 / math.sqrt(f))
    b = _f32(rng, g) if bias else None
    tag = f"x{(n, f)} w{(g, f)}{'' if bias else ' nobias'}"
    try:
        X, Wd = be.asarray(x), be.asarray(wt)
        y = getattr(be, f"{op}_forward")(X, Wd, be.asarray(b) if bias else None)
        z_ref = ref.linear_forward(_f64(x), _f64(wt), _f64(b))
        ck.close(f"{op}.y", y, np.maximum(z_ref, 0) if relu else z_ref, tag)
        dy = _f32(rng, n, g)
        if relu:
            # masked by the backend's own output, so an element rounding to the other side of 0 agrees
            dz = np.where(np.asarray(ck.host(y)) > 0, _f64(dy), 0.0)
            dx, dw, db = be.linear_relu_backward(X, Wd, y, be.asarray(dy), True, bias)
        else:
            dz = _f64(dy)
            dx, dw, db = be.linear_backward(X, Wd, be.asarray(dy), True, bias)
        dx_ref, dw_ref, db_ref = ref.linear_backward(_f64(x), _f64(wt), dz, True, bias)
        ck.close(f"{op}.dx", dx, dx_ref, tag)
        ck.close(f"{op}.dw", dw, dw_ref, tag)
        if bias:
            ck.close(f"{op}.db", db, db_ref, tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail(f"{op}.y", tag, exc)


def _check_linear_relu(ck, ref, rng, case):
    _check_linear(ck, ref, rng, case, relu=True)


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


def _check_arrays(ck, ref, rng, case):
    be = ck.be
    tag = "array ops"
    try:
        x = _f32(rng, 3, 4, 5)
        a = be.asarray(x.copy())  # host backends may alias their input
        ck.close("arrays.asarray", a, x, tag)
        ck.close("arrays.reshape", be.reshape(a, (12, 5)), x.reshape(12, 5), tag)
        c = be.copy(a)
        be.copy_into(a, be.zeros(x.shape))
        ck.close("arrays.copy", c, x, tag)
        ck.close("arrays.zeros", a, np.zeros_like(x), tag)
        be.copy_into(a, c)
        ck.close("arrays.copy_into", a, x, tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("arrays.asarray", tag, exc)


# ------------------------------------------------------------------- shape sets
_FIXED_CONV = [  # n, c, o, h, w, k, stride, pad, bias
    (2, 3, 4, 8, 8, 3, 1, 1, True), (1, 1, 1, 1, 1, 1, 1, 0, True), (3, 4, 9, 9, 7, 3, 2, 1, True),
    (2, 5, 16, 11, 13, 5, 3, 2, False), (1, 2, 3, 5, 5, 4, 1, 3, True), (2, 16, 10, 20, 20, 7, 1, 3, True),
    (4, 1, 8, 28, 28, 3, 1, 0, True), (2, 8, 24, 12, 12, 3, 1, 1, True),
    # a weight gradient summed over more images than one work-group of the OpenCL dw kernel takes
    # (a batch above a device's min_groups); small planes keep it cheap on a simulator
    (40, 1, 8, 10, 10, 3, 1, 0, True),
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
        P, Q = out_size(h, k, s, p), out_size(w, k, s, p)
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




# ------------------------------------------------------------- newer op checks
def _run_pair(ck, name, be_fn, ref_fn, tag):
    """Record ``be_fn()`` against ``ref_fn()`` (dicts of outputs, keyed by quantity)."""
    try:
        got = be_fn()
    except Exception as exc:  # noqa: BLE001 - an op that raises is a failed check
        ck.fail(f"{name}.y", tag, exc)
        return
    want = ref_fn()
    for key, value in want.items():
        if value is not None:
            ck.close(f"{name}.{key}", got[key], value, tag)


def _conv_general_data(ref, rng, case, rounded):
    """(x, w, b, dy, the reference's y from rounded(x) and rounded(w), the row tag) of a conv2d_general case."""
    n, c, o, h, w, (kh, kw), stride, pads, dil, groups, bias = case
    x = _f32(rng, n, c, h, w)
    wt = _f32(rng, o, c // groups, kh, kw, scale=1 / math.sqrt(c // groups * kh * kw))
    b = _f32(rng, o) if bias else None
    y_ref = ref.conv2d_general_forward(rounded(x), rounded(wt), _f64(b), stride, pads, dil, groups)
    dy = _f32(rng, *y_ref.shape)
    return x, wt, b, dy, y_ref, f"x{(n, c, h, w)} w{wt.shape} s{stride} pads{pads} d{dil} g{groups}"


def _check_conv2d_general(ck, ref, rng, case):
    x, wt, b, dy, y_ref, tag = _conv_general_data(ref, rng, case, _f64)
    stride, pads, dil, groups, bias = case[6:]
    be = ck.be

    def run_be():
        B = be.asarray(b) if bias else None
        y = be.conv2d_general_forward(be.asarray(x), be.asarray(wt), B, stride, pads, dil, groups)
        dx, dw, db = be.conv2d_general_backward(be.asarray(x), be.asarray(wt), be.asarray(dy), stride, pads, dil,
                                                groups, True, bias)
        return {"y": y, "dx": dx, "dw": dw, "db": db}

    def run_ref():
        dx, dw, db = ref.conv2d_general_backward(_f64(x), _f64(wt), _f64(dy), stride, pads, dil, groups, True, bias)
        return {"y": y_ref, "dx": dx, "dw": dw, "db": db}

    _run_pair(ck, "conv2d_general", run_be, run_ref, tag)


def _check_conv2d_general_relu(ck, ref, rng, case):
    x, wt, b, _, y_ref, tag = _conv_general_data(ref, rng, case, _f64)
    stride, pads, dil, groups, bias = case[6:]
    be = ck.be
    _run_pair(ck, "conv2d_general_relu",
              lambda: {"y": be.conv2d_general_relu_forward(be.asarray(x), be.asarray(wt),
                                                           be.asarray(b) if bias else None, stride, pads, dil,
                                                           groups)},
              lambda: {"y": np.maximum(y_ref, 0.0)}, tag)


def _random_conv_general(rng):
    while True:
        groups = int(rng.choice([1, 2, 3]))
        c = groups * int(rng.integers(1, 4))
        o = groups * int(rng.integers(1, 4))
        if rng.random() < 0.3:  # depthwise
            groups, c = c, c
            o = c * int(rng.integers(1, 3))
        n, h, w = int(rng.integers(1, 4)), int(rng.integers(3, 12)), int(rng.integers(3, 12))
        kh, kw = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        dil = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        pads = tuple(int(v) for v in rng.integers(0, 3, 4))
        if dil[0] * (kh - 1) + 1 > h + pads[0] + pads[1] or dil[1] * (kw - 1) + 1 > w + pads[2] + pads[3]:
            continue
        return (n, c, o, h, w, (kh, kw), stride, pads, dil, groups, bool(rng.integers(0, 2)))


_FIXED_CONV_GENERAL = [  # n, c, o, h, w, (kh, kw), stride, pads, dilation, groups, bias
    (2, 4, 4, 8, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 4, False),     # depthwise
    (2, 8, 16, 9, 9, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 8, True),     # depthwise, multiplier 2, strided
    (1, 4, 6, 10, 7, (3, 1), (2, 1), (1, 1, 0, 0), (1, 1), 2, True),     # grouped, rectangular
    (2, 3, 5, 11, 11, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1, True),    # dilated
    (1, 2, 3, 6, 6, (2, 2), (1, 1), (0, 1, 0, 1), (1, 1), 1, False),     # "same" with an even kernel
]


def _pool_case_tag(case):
    n, c, h, w, kernel, stride, pads = case
    return f"x{(n, c, h, w)} k{kernel} s{stride} p{pads}"


def _check_pool_general(ck, ref, rng, case):
    n, c, h, w, kernel, stride, pads = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    tag = _pool_case_tag(case)
    y_ref, am_ref = ref.maxpool2d_general_forward(_f64(x), kernel, stride, pads)
    dy = _f32(rng, *y_ref.shape)
    try:
        y, am = be.maxpool2d_general_forward(be.asarray(x), kernel, stride, pads)
        ck.close("maxpool2d_general.y", y, y_ref, tag)
        ck.equal("maxpool2d_general.argmax", np.asarray(ck.host(am), np.int64), am_ref.astype(np.int64), tag)
        dx = be.maxpool2d_backward(be.asarray(dy), am, (n, c, h, w))
        ck.close("maxpool2d_general.dx", dx, ref.maxpool2d_backward(_f64(dy), am_ref, (n, c, h, w)), tag)
    except Exception as exc:  # noqa: BLE001
        ck.fail("maxpool2d_general.y", tag, exc)
    _run_pair(ck, "avgpool2d",
              lambda: {"y": be.avgpool2d_forward(be.asarray(x), kernel, stride, pads),
                       "dx": be.avgpool2d_backward(be.asarray(dy), (n, c, h, w), kernel, stride, pads)},
              lambda: {"y": ref.avgpool2d_forward(_f64(x), kernel, stride, pads),
                       "dx": ref.avgpool2d_backward(_f64(dy), (n, c, h, w), kernel, stride, pads)}, tag)


def _random_pool_general(rng):
    while True:
        n, c, h, w = (int(v) for v in rng.integers(1, [4, 5, 12, 12]))
        kernel = (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
        stride = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        pads = (int(rng.integers(0, kernel[0] // 2 + 1)), int(rng.integers(0, kernel[1] // 2 + 1)))
        if kernel[0] <= h + 2 * pads[0] and kernel[1] <= w + 2 * pads[1]:
            return (n, c, h, w, kernel, stride, pads)


_FIXED_POOL_GENERAL = [(2, 3, 8, 8, (3, 3), (2, 2), (1, 1)), (1, 2, 7, 9, (3, 2), (2, 1), (1, 0)),
                       (2, 4, 6, 6, (2, 2), (2, 2), (1, 1))]


def _check_adaptive(ck, ref, rng, case):
    n, c, h, w, out = case
    be = ck.be
    x = _f32(rng, n, c, h, w)
    dy = _f32(rng, n, c, *out)
    _run_pair(ck, "adaptive_avgpool2d",
              lambda: {"y": be.adaptive_avgpool2d_forward(be.asarray(x), out),
                       "dx": be.adaptive_avgpool2d_backward(be.asarray(dy), (n, c, h, w), out)},
              lambda: {"y": ref.adaptive_avgpool2d_forward(_f64(x), out),
                       "dx": ref.adaptive_avgpool2d_backward(_f64(dy), (n, c, h, w), out)}, f"x{(n, c, h, w)} out{out}")


def _random_adaptive(rng):
    n, c, h, w = (int(v) for v in rng.integers(1, [4, 6, 12, 12]))
    return (n, c, h, w, (int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))))


def _check_batch_norm(ck, ref, rng, case):
    shape, affine, relu = case[:3]
    residual = len(case) > 3 and case[3]
    be = ck.be
    c = shape[1]
    x = _f32(rng, *shape, scale=2.0) + 0.5
    wt, bs = (_f32(rng, c) + 1.0, _f32(rng, c)) if affine else (None, None)
    rm, rv = _f32(rng, c, scale=0.1), np.abs(_f32(rng, c)) + 0.5
    dy = _f32(rng, *shape)
    res = _f32(rng, *shape) if residual else None
    tag = f"x{shape}{' affine' if affine else ''}{' +residual' if residual else ''}{' +relu' if relu else ''}"
    B = (lambda a: None if a is None else be.asarray(a))
    for training in (True, False):
        mode = "train" if training else "eval"

        def run_be():
            RM, RV = be.asarray(rm.copy()), be.asarray(rv.copy())
            if training:
                y, mean, invstd = be.batch_norm_forward_train(be.asarray(x), B(wt), B(bs), RM, RV, 0.1, 1e-5, relu,
                                                              B(res))
            else:
                y, mean, invstd = be.batch_norm_forward_eval(be.asarray(x), B(wt), B(bs), RM, RV, 1e-5, relu, B(res))
            dx, dw, db = be.batch_norm_backward(be.asarray(x), B(wt), be.asarray(dy), mean, invstd,
                                                y if relu else None, training, True)
            return {"y": y, "dx": dx, "dweight": dw, "dbias": db, "running_mean": RM, "running_var": RV}

        def run_ref():
            rm64, rv64 = _f64(rm), _f64(rv)
            if training:
                y, mean, invstd = ref.batch_norm_forward_train(_f64(x), _f64(wt), _f64(bs), rm64, rv64, 0.1, 1e-5,
                                                               relu, _f64(res))
            else:
                y, mean, invstd = ref.batch_norm_forward_eval(_f64(x), _f64(wt), _f64(bs), rm64, rv64, 1e-5, relu,
                                                              _f64(res))
            dx, dw, db = ref.batch_norm_backward(_f64(x), _f64(wt), _f64(dy), mean, invstd, y if relu else None,
                                                 training, True)
            return {"y": y, "dx": dx, "dweight": dw, "dbias": db, "running_mean": rm64, "running_var": rv64}

        _run_pair(ck, f"batch_norm_{mode}", run_be, run_ref, tag)


def _check_conv_bn_eval(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, bias, affine, relu = case
    be = ck.be
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
    g, beta = (_f32(rng, o) + 1.0, _f32(rng, o)) if affine else (None, None)
    rm, rv = _f32(rng, o, scale=0.3), np.abs(_f32(rng, o)) + 0.25
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p}{'' if bias else ' nobias'}{' affine' if affine else ''}" \
          f"{' +relu' if relu else ''}"
    B = (lambda a: None if a is None else be.asarray(a))

    def run_ref():
        z = ref.conv2d_forward(_f64(x), _f64(wt), _f64(b), s, p)
        return {"y": ref.batch_norm_forward_eval(z, _f64(g), _f64(beta), _f64(rm), _f64(rv), 1e-5, relu)[0]}

    _run_pair(ck, "conv_bn_eval",
              lambda: {"y": be.conv2d_batch_norm_eval_forward(be.asarray(x), be.asarray(wt), B(b), B(g), B(beta),
                                                              be.asarray(rm), be.asarray(rv), 1e-5, s, p, relu)},
              run_ref, tag)


def _check_conv_scale_shift(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, _, _, relu = case
    be = ck.be
    x, wt, _ = _conv_inputs(rng, n, c, o, h, w, k, False)
    scale, shift = _f32(rng, o) + 1.0, _f32(rng, o)
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p}{' +relu' if relu else ''}"

    def run_ref():
        z = ref.conv2d_forward(_f64(x), _f64(wt), None, s, p) * _f64(scale)[:, None, None] + _f64(shift)[:, None, None]
        return {"y": np.maximum(z, 0.0) if relu else z}

    _run_pair(ck, "conv_scale_shift",
              lambda: {"y": be.conv2d_scale_shift_forward(be.asarray(x), be.asarray(wt), be.asarray(scale),
                                                          be.asarray(shift), s, p, relu)},
              run_ref, tag)


def _random_conv_bn_eval(rng):
    return _random_conv(rng) + (bool(rng.integers(0, 2)), bool(rng.integers(0, 2)))


_FIXED_CONV_BN = (  # conv case + affine, relu: the direct, Winograd (odd width too), phase and im2col paths
    (2, 3, 4, 8, 8, 3, 1, 1, True, True, True), (4, 32, 32, 9, 9, 3, 1, 1, False, True, True),
    (4, 32, 40, 8, 8, 3, 1, 1, True, True, False), (1, 16, 24, 12, 12, 3, 1, 1, True, False, False),
    (3, 4, 9, 9, 7, 3, 2, 1, True, True, True), (2, 5, 7, 11, 13, 1, 3, 0, False, True, True),
    (1, 8, 20, 30, 30, 3, 1, 1, True, True, True),
)


def _random_batch_norm(rng):
    # at least 3 values per channel: two normalise to -1 and +1 whatever they are, so the training
    # dx of M = 2 is all cancellation (zero up to eps) and its float32 value is rounding noise
    while True:
        ndim = int(rng.choice([2, 3, 4]))
        shape = (int(rng.integers(2, 9)),) + tuple(int(v) for v in rng.integers(1, 7, ndim - 1))
        if math.prod(shape) // shape[1] >= 3:
            break
    return (shape, bool(rng.integers(0, 2)), bool(rng.integers(0, 2)), bool(rng.integers(0, 2)))


def _check_dropout(ck, ref, rng, case):
    shape, p, seed = case
    be = ck.be
    x, dy = _f32(rng, *shape), _f32(rng, *shape)
    _run_pair(ck, "dropout",
              lambda: {"y": be.dropout_forward(be.asarray(x), p, seed), "dx": be.dropout_backward(be.asarray(dy), p, seed)},
              lambda: {"y": ref.dropout_forward(_f64(x), p, seed), "dx": ref.dropout_backward(_f64(dy), p, seed)},
              f"x{shape} p={p} seed={seed}")


def _random_dropout(rng):
    shape = tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(1, 5))))
    return (shape, float(rng.choice([0.1, 0.5, 0.9])), int(rng.integers(0, 2**63)))


def _check_normalize(ck, ref, rng, case):
    """``F.normalize`` (batch norm's eval path with var = std**2) against ``(x - mean) / std`` in float64."""
    from . import functional as F

    shape, per_channel = case
    be = ck.be
    c = shape[1] if per_channel else 1
    x, dy = _f32(rng, *shape, scale=3.0), _f32(rng, *shape)
    mean = _f32(rng, c)
    std = (0.05 + rng.random(c) * 3).astype(np.float32)
    bshape = (1, c) + (1,) * (len(shape) - 2) if per_channel else (1,) * len(shape)
    m64, s64 = _f64(mean).reshape(bshape), _f64(std).reshape(bshape)
    _run_pair(ck, "normalize",
              lambda: {"y": F.normalize(be.asarray(x), mean, std, backend=be),
                       "dx": F.normalize_backward(be.asarray(dy), std, backend=be)},
              lambda: {"y": (_f64(x) - m64) / s64, "dx": _f64(dy) / s64},
              f"x{shape} {'per channel' if per_channel else 'one mean and std'}")


def _random_normalize(rng):
    shape = tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(2, 5))))
    return shape, bool(rng.integers(0, 2))


def _check_more_activations(ck, ref, rng, shape):
    be = ck.be
    x = _f32(rng, *shape, scale=3.0)
    dy = _f32(rng, *shape)
    tag = f"{shape}"
    _run_pair(ck, "leaky_relu",
              lambda: {"y": be.leaky_relu_forward(be.asarray(x), 0.1),
                       "dx": be.leaky_relu_backward(be.asarray(x), be.asarray(dy), 0.1)},
              lambda: {"y": ref.leaky_relu_forward(_f64(x), 0.1),
                       "dx": ref.leaky_relu_backward(_f64(x), _f64(dy), 0.1)}, tag)
    y32 = np.tanh(x).astype(np.float32)
    _run_pair(ck, "tanh",
              lambda: {"y": be.tanh_forward(be.asarray(x)), "dx": be.tanh_backward(be.asarray(y32), be.asarray(dy))},
              lambda: {"y": ref.tanh_forward(_f64(x)), "dx": ref.tanh_backward(_f64(y32), _f64(dy))}, tag)
    dim = len(shape) - 1 if len(shape) < 2 else 1
    s32 = ref.softmax_forward(_f64(x), dim).astype(np.float32)
    _run_pair(ck, "softmax",
              lambda: {"y": be.softmax_forward(be.asarray(x), dim),
                       "dx": be.softmax_backward(be.asarray(s32), be.asarray(dy), dim)},
              lambda: {"y": ref.softmax_forward(_f64(x), dim), "dx": ref.softmax_backward(_f64(s32), _f64(dy), dim)},
              tag + f" dim={dim}")
    other = _f32(rng, *shape)
    _run_pair(ck, "add", lambda: {"y": be.add(be.asarray(x), be.asarray(other)),
                                  "y_relu": be.add_relu(be.asarray(x), be.asarray(other))},
              lambda: {"y": _f64(x) + _f64(other), "y_relu": np.maximum(_f64(x) + _f64(other), 0.0)}, tag)


def _check_elu(ck, ref, rng, shape):
    be = ck.be
    x, dy = _f32(rng, *shape, scale=3.0), _f32(rng, *shape)
    y32 = ref.elu_forward(_f64(x), 1.5).astype(np.float32)
    _run_pair(ck, "elu",
              lambda: {"y": be.elementwise_forward("elu", be.asarray(x), (1.5,)),
                       "dx": be.elementwise_backward("elu", be.asarray(y32), be.asarray(dy), (1.5,))},
              lambda: {"y": ref.elu_forward(_f64(x), 1.5), "dx": ref.elu_backward(_f64(y32), _f64(dy), 1.5)},
              f"{shape} alpha=1.5")


def _check_more_losses(ck, ref, rng, case):
    n, g = case
    be = ck.be
    pred, target = _f32(rng, n, g), _f32(rng, n, g)
    tag = f"({n}, {g})"
    _run_pair(ck, "mse",
              lambda: {"loss": be.mse_forward(be.asarray(pred), be.asarray(target)),
                       "dpred": be.mse_backward(be.asarray(pred), be.asarray(target))},
              lambda: {"loss": ref.mse_forward(_f64(pred), _f64(target)),
                       "dpred": ref.mse_backward(_f64(pred), _f64(target))}, tag)
    labels = rng.integers(0, g, n).astype(np.int32)
    logits = _f32(rng, n, g, scale=3.0)

    def run_be():
        loss, probs = be.softmax_cross_entropy_smoothed_forward(be.asarray(logits), be.asarray(labels, np.int32), 0.1)
        return {"loss": loss, "probs": probs,
                "dlogits": be.softmax_cross_entropy_smoothed_backward(probs, be.asarray(labels, np.int32), 0.1)}

    def run_ref():
        loss, probs = ref.softmax_cross_entropy_smoothed_forward(_f64(logits), labels, 0.1)
        return {"loss": loss, "probs": probs,
                "dlogits": ref.softmax_cross_entropy_smoothed_backward(probs, labels, 0.1)}

    _run_pair(ck, "softmax_cross_entropy_smoothed", run_be, run_ref, tag + " s=0.1")


def _rand_shape(rng):
    return tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(1, 5))))


def _rand_linear(rng):
    return (int(rng.integers(1, 65)), int(rng.integers(1, 200)), int(rng.integers(1, 40)), bool(rng.integers(0, 2)))


def _rand_loss(rng):
    return (int(rng.integers(1, 300)), int(rng.integers(1, 20)))


_OPTIM_CASES = tuple((size, variant) for size in (1, 7, 1000) for variant in _OPTIM_VARIANTS)


def _rand_optim(rng):
    return (int(rng.integers(1, 5000)), str(rng.choice(_OPTIM_VARIANTS)))


# ------------------------------------------------------------------- bfloat16
# The NumPy model of the bf16 ops: every input of a product rounded to bf16 (nearest, ties to even),
# products and sums exact (float64 here), the bias added unrounded, db the sum of the unrounded dy.
def _bf16(a):
    from .amp import round_to_bf16_numpy

    return None if a is None else _f64(round_to_bf16_numpy(a))


#: values whose rounding is easy to get wrong: ties both ways, the largest finite floats, inf, NaN
_BF16_EDGES = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.4e38, -3.4e38,
                        np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 2**-126], dtype=np.float32)


def _check_round_bf16(ck, rng, tag):
    from .amp import round_to_bf16_numpy

    x = np.concatenate([_BF16_EDGES, _f32(rng, 257, scale=10.0)])
    x[-1] = np.float32(np.uint32(0x7F800001).view(np.float32))  # a signalling NaN with its payload low
    try:
        got = ck.host(ck.be.round_to_bf16(ck.be.asarray(x))).astype(np.float32)
    except Exception as exc:  # noqa: BLE001
        ck.fail("bf16.round", tag, exc)
        return
    want = round_to_bf16_numpy(x)
    same = np.where(np.isnan(want), np.isnan(got), got.view(np.uint32) == want.view(np.uint32))
    ck.equal("bf16.round", bool(same.all()), True, tag)


def _check_conv2d_bf16(ck, ref, rng, case):
    n, c, o, h, w, k, s, p, bias = case
    be = ck.be
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p}{'' if bias else ' nobias'}"
    _check_round_bf16(ck, rng, tag)
    y_ref = ref.conv2d_forward(_bf16(x), _bf16(wt), _f64(b), s, p)
    dy = _f32(rng, *y_ref.shape, scale=1 / math.sqrt(max(1, y_ref.size // max(1, o))))
    dx_ref, dw_ref, _ = ref.conv2d_backward(_bf16(x), _bf16(wt), _bf16(dy), s, p, True, False)

    def run_be():
        X, Wd = be.asarray(x), be.asarray(wt)
        y = be.conv2d_forward_bf16(X, Wd, be.asarray(b) if bias else None, s, p)
        dx, dw, db = be.conv2d_backward_bf16(X, Wd, be.asarray(dy), s, p, True, bias)
        _, dw2, _ = be.conv2d_backward_bf16(X, Wd, be.asarray(dy), s, p, False, False)
        return {"y": y, "dx": dx, "dw": dw, "db": db, "dw_only": dw2}

    _run_pair(ck, "conv2d_bf16", run_be, lambda: {"y": y_ref, "dx": dx_ref, "dw": dw_ref, "dw_only": dw_ref,
                                                 "db": _f64(dy).sum(axis=(0, 2, 3)) if bias else None}, tag)


def _check_fused_bf16(ck, ref, rng, case):
    """conv+ReLU+maxpool around the bf16 convolution, against the oracle's composition on rounded
    inputs; the backward both with dx (composed) and without (a backend may fuse it)."""
    n, c, o, h, w, k, s, p, bias, pk, ps = case
    be = ck.be
    x, wt, b = _conv_inputs(rng, n, c, o, h, w, k, bias)
    tag = f"x{(n, c, h, w)} w{(o, c, k, k)} s{s} p{p} pool{pk}/{ps}{'' if bias else ' nobias'}"
    X, Wd = be.asarray(x), be.asarray(wt)
    try:
        y, am = be.conv2d_relu_maxpool2d_forward_bf16(X, Wd, be.asarray(b) if bias else None, s, p, pk, ps)
    except Exception as exc:  # noqa: BLE001
        ck.fail("conv_relu_pool_bf16.y", tag, exc)
        return
    z_ref = ref.conv2d_forward(_bf16(x), _bf16(wt), _f64(b), s, p)
    y_ref = ref.relu_forward(ref.maxpool2d_forward(z_ref, pk, ps)[0])
    ck.close("conv_relu_pool_bf16.y", y, y_ref, tag)
    am_h = np.asarray(ck.host(am), dtype=np.int64)
    dy = _f32(rng, *y_ref.shape)
    # the oracle's composition routed through the backend's own argmax, dz rounded as the contract says
    dz = ref.maxpool2d_backward(ref.relu_backward(y_ref, _f64(dy)), am_h, z_ref.shape)
    dx_ref, dw_ref, _ = ref.conv2d_backward(_bf16(x), _bf16(wt), _bf16(dz), s, p, True, False)

    def run_be():
        got = {}
        for need_dx in (True, False):
            dx, dw, db = be.conv2d_relu_maxpool2d_backward_bf16(X, Wd, y, am, be.asarray(dy), s, p, need_dx, bias,
                                                                ps < pk)
            got.update({f"dw{'' if need_dx else '_only'}": dw, f"db{'' if need_dx else '_only'}": db})
            if need_dx:
                got["dx"] = dx
        return got

    db_ref = dz.sum(axis=(0, 2, 3)) if bias else None
    _run_pair(ck, "conv_relu_pool_bf16", run_be, lambda: {"dx": dx_ref, "dw": dw_ref, "dw_only": dw_ref,
                                                         "db": db_ref, "db_only": db_ref}, tag)


def _check_conv2d_general_bf16(ck, ref, rng, case):
    x, wt, b, dy, y_ref, tag = _conv_general_data(ref, rng, case, _bf16)
    stride, pads, dil, groups, bias = case[6:]
    be = ck.be

    def run_be():
        B = be.asarray(b) if bias else None
        y = be.conv2d_general_forward_bf16(be.asarray(x), be.asarray(wt), B, stride, pads, dil, groups)
        dx, dw, db = be.conv2d_general_backward_bf16(be.asarray(x), be.asarray(wt), be.asarray(dy), stride, pads,
                                                     dil, groups, True, bias)
        return {"y": y, "dx": dx, "dw": dw, "db": db}

    def run_ref():
        dx, dw, _ = ref.conv2d_general_backward(_bf16(x), _bf16(wt), _bf16(dy), stride, pads, dil, groups, True,
                                                False)
        return {"y": y_ref, "dx": dx, "dw": dw, "db": _f64(dy).sum(axis=(0, 2, 3)) if bias else None}

    _run_pair(ck, "conv2d_general_bf16", run_be, run_ref, tag)


def _check_linear_bf16(ck, ref, rng, case):
    n, f, g, bias = case
    be = ck.be
    x = _f32(rng, n, f)
    wt = _f32(rng, g, f, scale=1 / math.sqrt(f))
    b = _f32(rng, g) if bias else None
    dy = _f32(rng, n, g)
    tag = f"x{(n, f)} w{(g, f)}{'' if bias else ' nobias'}"

    def run_be():
        X, Wd = be.asarray(x), be.asarray(wt)
        y = be.linear_forward_bf16(X, Wd, be.asarray(b) if bias else None)
        dx, dw, db = be.linear_backward_bf16(X, Wd, be.asarray(dy), True, bias)
        return {"y": y, "dx": dx, "dw": dw, "db": db}

    def run_ref():
        dx, dw, _ = ref.linear_backward(_bf16(x), _bf16(wt), _bf16(dy), True, False)
        return {"y": ref.linear_forward(_bf16(x), _bf16(wt), _f64(b)), "dx": dx, "dw": dw,
                "db": _f64(dy).sum(axis=0) if bias else None}

    _run_pair(ck, "linear_bf16", run_be, run_ref, tag)


# ---------------------------------------------------------------------- the table
OPS: tuple = (
    OpSpec("arrays", "array plumbing: asarray, reshape, copy, copy_into, zeros",
           ("asarray", "to_numpy", "reshape", "copy", "copy_into", "zeros"), ("every layer",),
           _check_arrays, fixed=("array ops",)),
    OpSpec("conv2d", "2-D convolution, square kernel, int stride and padding: forward, dx, dw, db",
           ("conv2d_forward", "conv2d_backward"), ("Conv2d",), _check_conv2d, tuple(_FIXED_CONV), _random_conv),
    OpSpec("conv2d_general", "grouped/depthwise, dilated, rectangular, asymmetrically padded convolution",
           ("conv2d_general_forward", "conv2d_general_backward"), ("Conv2d",), _check_conv2d_general,
           tuple(_FIXED_CONV_GENERAL), _random_conv_general),
    OpSpec("conv2d_general_relu", "the general convolution with the ReLU applied as it stores (eval-mode "
           "Conv2d+BatchNorm2d+ReLU with the batch norm folded into the weights)",
           ("conv2d_general_relu_forward",), ("Conv2d+BatchNorm2d+ReLU in eval mode (grouped, depthwise)",),
           _check_conv2d_general_relu, tuple(_FIXED_CONV_GENERAL), _random_conv_general),
    OpSpec("conv2d_bf16", "the convolution with bf16 inputs and float32 accumulation (autocast); bf16 rounding",
           ("conv2d_forward_bf16", "conv2d_backward_bf16", "round_to_bf16"), ("Conv2d under autocast",),
           _check_conv2d_bf16, tuple(_FIXED_CONV), _random_conv),
    OpSpec("conv2d_relu_maxpool2d_bf16", "fused convolution + ReLU + max pooling around the bf16 convolution",
           ("conv2d_relu_maxpool2d_forward_bf16", "conv2d_relu_maxpool2d_backward_bf16"),
           ("Conv2d+ReLU+MaxPool2d under autocast",), _check_fused_bf16, tuple(_FIXED_FUSED),
           lambda rng: _random_conv(rng, fused=True)),
    OpSpec("conv2d_general_bf16", "grouped/depthwise/dilated convolution with bf16 inputs (autocast)",
           ("conv2d_general_forward_bf16", "conv2d_general_backward_bf16"), ("Conv2d under autocast",),
           _check_conv2d_general_bf16, tuple(_FIXED_CONV_GENERAL), _random_conv_general),
    OpSpec("maxpool2d", "max pooling, square window, no padding: forward, argmax, dx",
           ("maxpool2d_forward", "maxpool2d_backward"), ("MaxPool2d",), _check_maxpool2d, tuple(_FIXED_POOL),
           _random_pool),
    OpSpec("pool2d_general", "max pooling with padding and rectangular windows; average pooling",
           ("maxpool2d_general_forward", "avgpool2d_forward", "avgpool2d_backward"), ("MaxPool2d", "AvgPool2d"),
           _check_pool_general, tuple(_FIXED_POOL_GENERAL), _random_pool_general),
    OpSpec("adaptive_avgpool2d", "adaptive average pooling to any output size (1 is global average pooling)",
           ("adaptive_avgpool2d_forward", "adaptive_avgpool2d_backward"), ("AdaptiveAvgPool2d",), _check_adaptive,
           ((2, 3, 8, 8, (1, 1)), (1, 2, 7, 5, (3, 2))), _random_adaptive),
    OpSpec("conv2d_relu_maxpool2d", "fused convolution + ReLU + max pooling",
           ("conv2d_relu_maxpool2d_forward", "conv2d_relu_maxpool2d_backward"), ("Conv2d+ReLU+MaxPool2d",),
           _check_fused, tuple(_FIXED_FUSED), lambda rng: _random_conv(rng, fused=True)),
    OpSpec("conv2d_relu_maxpool2d_linear", "the fused op with its flatten + linear classifier head",
           ("conv2d_relu_maxpool2d_linear_forward", "conv2d_relu_maxpool2d_linear_backward", "fuses_linear_head"),
           ("Conv2d+ReLU+MaxPool2d+Flatten+Linear",), _check_fused_head, tuple(_FIXED_HEAD)),
    OpSpec("linear", "fully connected layer: forward, dx, dw, db", ("linear_forward", "linear_backward"),
           ("Linear",), _check_linear, tuple(_FIXED_LINEAR), _rand_linear),
    OpSpec("linear_relu", "fully connected layer followed by a ReLU as one op: forward, dx, dw, db",
           ("linear_relu_forward", "linear_relu_backward"), ("Linear+ReLU",), _check_linear_relu,
           tuple(_FIXED_LINEAR), _rand_linear),
    OpSpec("linear_bf16", "fully connected layer with bf16 inputs and float32 accumulation (autocast)",
           ("linear_forward_bf16", "linear_backward_bf16"), ("Linear under autocast",), _check_linear_bf16,
           tuple(_FIXED_LINEAR), _rand_linear),
    OpSpec("batch_norm", "batch normalisation in training and eval mode (running statistics, fused residual "
           "add and ReLU)",
           ("batch_norm_forward_train", "batch_norm_forward_eval", "batch_norm_backward"),
           ("BatchNorm1d", "BatchNorm2d", "BatchNorm+ReLU"), _check_batch_norm,
           (((4, 3, 5, 5), True, False), ((8, 6), False, True), ((3, 2, 7), True, True),
            ((4, 3, 5, 5), True, True, True), ((5, 4), False, False, True)), _random_batch_norm),
    OpSpec("conv2d_batch_norm_eval", "convolution with an eval-mode batch norm (and ReLU) folded into its store",
           ("conv2d_batch_norm_eval_forward",), ("Conv2d+BatchNorm2d(+ReLU) in eval mode",), _check_conv_bn_eval,
           _FIXED_CONV_BN, _random_conv_bn_eval),
    OpSpec("conv2d_scale_shift", "convolution with a per-filter scale and shift (and ReLU) applied as it stores "
           "(an eval-mode batch norm folded once)", ("conv2d_scale_shift_forward",),
           ("Conv2d+BatchNorm2d(+ReLU) in eval mode",), _check_conv_scale_shift, _FIXED_CONV_BN, _random_conv_bn_eval),
    OpSpec("normalize", "input normalisation (x - mean) / std, per channel or one for all: forward, dx",
           ("batch_norm_forward_eval", "batch_norm_backward"), ("Normalize",), _check_normalize,
           (((2, 3, 5, 4), True), ((2, 3, 5, 4), False), ((4, 7), True), ((3, 2, 6), False)), _random_normalize),
    OpSpec("dropout", "inverted dropout with a counter-based mask (the same on every backend)",
           ("dropout_forward", "dropout_backward"), ("Dropout",), _check_dropout,
           (((4, 100), 0.5, 12345), ((2, 3, 4, 5), 0.2, 2**62 + 7)), _random_dropout),
    OpSpec("activations", "ReLU and sigmoid: forward, dx", ("relu_forward", "relu_backward", "sigmoid_forward",
                                                           "sigmoid_backward"), ("ReLU", "Sigmoid"),
           _check_activations, tuple(_FIXED_ACT), _rand_shape),
    OpSpec("more_activations", "LeakyReLU, tanh, softmax and the residual add (with a fused ReLU): forward, dx",
           ("leaky_relu_forward", "leaky_relu_backward", "tanh_forward", "tanh_backward", "softmax_forward",
            "softmax_backward", "add", "add_relu"), ("LeakyReLU", "Tanh", "Softmax", "Residual"),
           _check_more_activations,
           tuple(_FIXED_ACT), _rand_shape),
    OpSpec("elu", "ELU: forward, dx (an elementwise op found by name on every backend)",
           ("elu_forward", "elu_backward", "elementwise_forward", "elementwise_backward"),
           ("ELU",), _check_elu, tuple(_FIXED_ACT), _rand_shape),
    OpSpec("losses", "softmax cross-entropy, binary cross-entropy, accuracy counts",
           ("softmax_cross_entropy_forward", "softmax_cross_entropy_backward", "bce_forward", "bce_backward",
            "count_correct"), ("SoftmaxCrossEntropy", "BCELoss"), _check_losses, tuple(_FIXED_LOSS), _rand_loss),
    OpSpec("more_losses", "mean squared error; cross-entropy with label smoothing",
           ("mse_forward", "mse_backward", "softmax_cross_entropy_smoothed_forward",
            "softmax_cross_entropy_smoothed_backward"), ("MSELoss", "SoftmaxCrossEntropy(label_smoothing)"),
           _check_more_losses, tuple(_FIXED_LOSS), _rand_loss),
    OpSpec("optim", "SGD (momentum, Nesterov, weight decay), Adam, AdamW, RMSprop updates; gradient norms",
           ("sgd_update", "adam_update", "rmsprop_update", "norm_many"), ("optim.SGD", "optim.Adam", "optim.AdamW",
                                                                        "optim.RMSprop", "optim.clip_grad_norm_"),
           _check_optim, _OPTIM_CASES, _rand_optim),
)


def get_op(name: str) -> OpSpec:
    """The table entry called ``name``."""
    for spec in OPS:
        if spec.name == name:
            return spec
    raise KeyError(f"no op {name!r} in the table (ops: {[s.name for s in OPS]})")


def ops_markdown_table() -> str:
    """The docs' list of supported ops: one row per entry, every backend checked against the reference."""
    rows = ["| op | what | layers | backend methods |", "| --- | --- | --- | --- |"]
    for spec in OPS:
        rows.append(f"| `{spec.name}` | {spec.summary} | {', '.join(spec.used_by)} | "
                    f"{', '.join(f'`{m}`' for m in spec.methods)} |")
    return "\n".join(rows)
