"""Every op of the op table and every layer is exported to ONNX or listed, with a reason, in
``parconv.onnx.NOT_EXPORTED``; every exported layer is in a round-trip test. A new op cannot be
silently unexportable."""

from __future__ import annotations

import importlib.util
import re

import pytest

import parconv as pc
import parconv.onnx as pox
from parconv.layers import LAYER_TYPES
from parconv.optable import OPS

if importlib.util.find_spec("mpi4py") is not None:
    import parconv.distributed  # noqa: F401  (registers FilterParallelConv2d as a layer type)


def _exported(cls) -> bool:
    """As ``parconv.onnx`` decides: the class or a parconv base class of it has an exporter."""
    return any(c.__module__.startswith("parconv.") and c.__name__ in pox.SUPPORTED_LAYERS for c in cls.__mro__)


def _layers_named(used_by) -> list:
    """The layer classes an op-table entry names (``"Conv2d+ReLU+MaxPool2d"`` names three)."""
    return [LAYER_TYPES[t] for text in used_by for t in re.findall(r"[A-Za-z_]\w*", text) if t in LAYER_TYPES]


@pytest.mark.parametrize("spec", OPS, ids=[s.name for s in OPS])
def test_every_op_is_exported_or_listed(spec):
    if spec.name in pox.NOT_EXPORTED:
        assert pox.NOT_EXPORTED[spec.name].strip(), f"give a reason for not exporting {spec.name!r}"
        return
    layers = _layers_named(spec.used_by)
    assert layers, (f"op {spec.name!r} (used by {spec.used_by}) backs no layer that parconv.onnx exports: "
                    "export its layer, or list the op in parconv.onnx.NOT_EXPORTED with the reason")
    missing = sorted({c.__name__ for c in layers if not _exported(c) and c.__name__ not in pox.NOT_EXPORTED})
    assert not missing, (f"op {spec.name!r}: layers {missing} have no ONNX export; add one to parconv/onnx.py "
                         "or list them in parconv.onnx.NOT_EXPORTED with the reason")


def test_every_layer_is_exported_or_listed():
    # parconv's own layers only: a test module's Layer subclass registers itself too
    missing = sorted(name for name, cls in LAYER_TYPES.items() if cls.__module__.startswith("parconv")
                     and not _exported(cls) and name not in pox.NOT_EXPORTED)
    assert not missing, (f"layers {missing} have no ONNX export; add one to parconv/onnx.py or list them in "
                         "parconv.onnx.NOT_EXPORTED with the reason")


def test_the_lists_name_real_things():
    names = {s.name for s in OPS} | set(LAYER_TYPES) | {"FilterParallelConv2d"}
    assert set(pox.NOT_EXPORTED) <= names, set(pox.NOT_EXPORTED) - names
    assert not set(pox.NOT_EXPORTED) & set(pox.SUPPORTED_LAYERS)


def test_every_exported_layer_is_in_a_round_trip_test():
    pytest.importorskip("onnx", reason="onnx not installed")
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed")
    from test_onnx import MODELS

    from test_quantization import ONNX_MODELS  # int8 models: their QDQ round trip is checked there

    seen = set()
    for make, _ in list(MODELS.values()) + list(ONNX_MODELS.values()):
        pc.manual_seed(0)
        seen |= {type(m).__name__ for m in make().modules()}
    untested = sorted(set(pox.SUPPORTED_LAYERS) - seen)
    assert not untested, f"exported layers {untested} are in no model of tests/test_onnx.py's MODELS"
