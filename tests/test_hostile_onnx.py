"""Hostile ONNX graphs: bounded work and one ``ValueError`` naming the file, the node and the attribute,
never a raw ``RecursionError``, ``OverflowError`` or ``MemoryError``."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import parconv as pc

onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install 'parconv[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import parconv.onnx as pox  # noqa: E402


def _save(path, nodes, inits, in_shape, out_shape, opset=17):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 8
    onnx.save(proto, str(path))
    return path


def _refused_cheaply(path, *needles, limit=64 << 20):
    """``pox.load(path)`` raises one ValueError naming the file and ``needles``, tracing under ``limit`` bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            pox.load(path, backend="numpy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert repr(str(path)) in message, message
    for needle in needles:
        assert needle in message, message
    assert peak < limit, f"{peak / 2**20:.0f} MiB traced before the error"
    return message


def test_constant_of_shape_bomb_is_refused_before_allocating(tmp_path):
    # 197 bytes that asked for a 20000 x 20000 Gemm weight: 4.6 GB before the error
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"], name="bomb",
                              value=numpy_helper.from_array(np.ones(1, np.float32))),
             helper.make_node("Flatten", ["x"], ["f"]),
             helper.make_node("Gemm", ["f", "w"], ["y"])]
    path = _save(tmp_path / "cos.onnx", nodes, {"shape": np.array([20000, 20000], np.int64)},
                 ["N", 20000], ["N", 20000])
    assert path.stat().st_size < 400
    _refused_cheaply(path, "'bomb'", "ConstantOfShape", "(20000, 20000)")


def test_broadcasting_add_of_constants_is_refused_before_allocating(tmp_path):
    # (1, 50000) + (50000, 1) folded to 2.5e9 values: OOM-killed at 22.8 GB before
    nodes = [helper.make_node("Add", ["a", "b"], ["w"], name="outer"),
             helper.make_node("Flatten", ["x"], ["f"]),
             helper.make_node("MatMul", ["f", "w"], ["y"])]
    inits = {"a": np.zeros((1, 50000), np.float32), "b": np.zeros((50000, 1), np.float32)}
    path = _save(tmp_path / "outer.onnx", nodes, inits, ["N", 50000], ["N", 50000])
    _refused_cheaply(path, "'outer'", "(50000, 50000)")


def test_negative_constant_of_shape_names_the_node(tmp_path):
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"], name="neg"),
             helper.make_node("Flatten", ["x"], ["f"]),
             helper.make_node("Gemm", ["f", "w"], ["y"])]
    path = _save(tmp_path / "neg.onnx", nodes, {"shape": np.array([4, -3], np.int64)}, ["N", 4], ["N", 3])
    _refused_cheaply(path, "'neg'", "negative")


def test_small_folded_constants_still_load(tmp_path):
    # the bound is generous: a ConstantOfShape bias and a broadcast of small constants fold as before
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["b"]),
             helper.make_node("Add", ["w0", "w1"], ["w"]),
             helper.make_node("Flatten", ["x"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1)]
    inits = {"shape": np.array([3], np.int64), "w0": np.ones((3, 1), np.float32),
             "w1": np.arange(4, dtype=np.float32)[None]}
    path = _save(tmp_path / "ok.onnx", nodes, inits, ["N", 4], ["N", 3])
    model = pox.load(path, backend="numpy")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(model.predict(x), x @ (np.ones((3, 1)) + np.arange(4)[None]).T, rtol=1e-5)


def _nested_residuals(depth: int) -> list:
    """``depth`` Residuals, each one's body a ReLU then the next Residual (the innermost body a ReLU)."""
    nodes = [helper.make_node("Relu", [f"t{k}" if k else "x"], [f"t{k + 1}"]) for k in range(depth + 1)]
    out = f"t{depth + 1}"
    for k in range(depth - 1, -1, -1):
        y = "y" if k == 0 else f"o{k}"
        nodes.append(helper.make_node("Add", [out, f"t{k}" if k else "x"], [y], name=f"join{k}"))
        out = y
    return nodes


def test_deeply_nested_residuals_are_refused_with_a_clear_error(tmp_path):
    # 1,000 nested Residuals raised RecursionError from the graph walk
    path = _save(tmp_path / "deep.onnx", _nested_residuals(1000), {}, ["N", 3], ["N", 3])
    message = _refused_cheaply(path, "more than 100 deep")
    assert "join" in message


def test_residuals_nested_within_the_limit_load(tmp_path):
    path = _save(tmp_path / "nest.onnx", _nested_residuals(20), {}, ["N", 3], ["N", 3])
    model = pox.load(path, backend="numpy")
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    h = [x]  # h[k] is tensor t_k
    for _ in range(21):
        h.append(np.maximum(h[-1], 0))
    want = h[21] + sum(h[k] for k in range(20))  # each join adds its level's input to the inner output
    np.testing.assert_allclose(model.predict(x), want, rtol=1e-5)


@pytest.mark.parametrize("attrs, attr", [
    (dict(strides=[2**40, 2**40]), "strides"),  # loaded, then OverflowError at the first call
    (dict(pads=[10**6] * 4), "pads"),  # MemoryError at the first call
    (dict(dilations=[2**33, 1]), "dilations"),
])
def test_conv_geometry_out_of_bounds_names_the_node_and_attribute(tmp_path, attrs, attr):
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv0", **attrs)]
    path = _save(tmp_path / "conv.onnx", nodes, {"w": np.zeros((2, 1, 3, 3), np.float32)}, ["N", 1, 8, 8],
                 ["N", 2, "H", "W"])
    _refused_cheaply(path, "'conv0'", f"{attr}=")


def test_pool_stride_out_of_bounds_names_the_node(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["y"], name="pool0", kernel_shape=[2, 2], strides=[2**40, 2])]
    path = _save(tmp_path / "pool.onnx", nodes, {}, ["N", 1, 8, 8], ["N", 1, "H", "W"])
    _refused_cheaply(path, "'pool0'", "strides=")


@pytest.mark.parametrize("axis", [99, 2, -3])
def test_softmax_axis_out_of_range_is_refused(tmp_path, axis):
    # axis 99 used to load as 99 % rank
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Softmax", ["f"], ["y"], name="sm", axis=axis)]
    path = _save(tmp_path / "sm.onnx", nodes, {}, ["N", 3, 2, 2], ["N", 12])
    _refused_cheaply(path, "'sm'", f"axis={axis}", "[-2, 1]")


@pytest.mark.parametrize("axis", [1, -1])
def test_softmax_axis_in_range_loads(tmp_path, axis):
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Softmax", ["f"], ["y"], axis=axis)]
    path = _save(tmp_path / "sm.onnx", nodes, {}, ["N", 3, 2, 2], ["N", 12])
    model = pox.load(path, backend="numpy")
    assert model(np.zeros((2, 3, 2, 2), np.float32)).shape == (2, 12)


@pytest.mark.parametrize("kwargs, name", [
    (dict(stride=2**40), "stride"), (dict(padding=10**6), "padding"), (dict(dilation=(1, 2**17)), "dilation"),
])
def test_conv2d_geometry_bounds(backend, kwargs, name):
    with pytest.raises(ValueError, match=rf"Conv2d: {name} must be <= 65536.*got"):
        pc.Conv2d(1, 1, 3, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=rf"conv2d: {name} must be <= 65536"):
        pc.functional.conv2d(np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 1, 3, 3), np.float32),
                             backend=backend, **kwargs)
    with pytest.raises(ValueError, match=r"MaxPool2d: stride must be <= 65536"):
        pc.MaxPool2d(2, stride=2**40, backend=backend)
    pc.Conv2d(1, 1, 3, stride=65536, padding=(0, 65536), backend=backend)  # the bound itself is accepted


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "pipe.onnx")
    code = f"import parconv.onnx as pox\ntry:\n    pox.load({str(tmp_path / 'pipe.onnx')!r})\nexcept ValueError as e:\n" \
           f"    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "pipe.onnx': the ONNX file is a FIFO (named pipe); expected a regular file" in out.stdout, out


def test_huge_graphs_with_branches_are_refused_before_quadratic_work(tmp_path, monkeypatch):
    # the branch analysis keeps a bit set per node of the nodes after it: n**2 / 8 bytes
    monkeypatch.setattr(pox, "_MAX_FORK_NODES", 50)
    nodes = [helper.make_node("Relu", [f"t{k}" if k else "x"], [f"t{k + 1}"]) for k in range(60)]
    nodes.append(helper.make_node("Add", ["t60", "t59"], ["y"], name="join"))
    path = _save(tmp_path / "wide.onnx", nodes, {}, ["N", 3], ["N", 3])
    _refused_cheaply(path, "forks a graph of 61 data nodes", "at most 50 nodes")
    monkeypatch.setattr(pox, "_MAX_FORK_NODES", 61)
    assert len(pox.load(path, backend="numpy")) == 60
