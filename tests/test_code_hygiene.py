"""No dead helpers, and internal names that say what they are."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

import parconv.functional as F

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "parconv"


def _read(paths) -> dict:
    return {p: p.read_text(encoding="utf-8") for p in paths}


SOURCES = _read([p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".pyx", ".pxd", ".h")])
#: where a helper may be used: the package, and the tests, benchmarks and docs tooling that drive it
CORPUS = {**SOURCES, **_read(list((ROOT / "tests").rglob("*.py")) + list((ROOT / "bench").rglob("*.py"))
                              + list((ROOT / "docs" / "_ext").glob("*.py")))}


def _words(corpus: dict) -> Counter:
    """How often each identifier occurs in ``corpus`` (definitions included)."""
    counts = Counter()
    for text in corpus.values():
        counts.update(re.findall(r"\w+", text))
    return counts


def _private_module_functions():
    """Module-level private functions of the package: Python ``def``s and Cython ``def``/``cdef``/``cpdef``s."""
    found = []
    for path, text in SOURCES.items():
        if path.suffix == ".py":
            found += [(path, node.name) for node in ast.parse(text).body
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_")
                      and not node.name.startswith("__")]
        elif path.suffix == ".pyx":
            found += [(path, m.group(1)) for m in
                      re.finditer(r"^c?p?def\s+(?:[\w\[\]*]+\s+)*?(_\w+)\s*\(", text, re.M)]
    return found


def test_every_private_python_and_cython_function_is_used():
    uses = _words(CORPUS)
    dead = [f"{path.relative_to(ROOT)}: {name}" for path, name in _private_module_functions() if uses[name] < 2]
    assert not dead, f"defined but never used (remove them): {dead}"


def test_every_c_helper_is_used():
    ext = {p: t for p, t in SOURCES.items() if p.parent.name == "_ext"}
    uses = _words(ext)
    dead = []
    for path, text in ext.items():
        if path.suffix != ".h":
            continue
        for m in re.finditer(r"^static\s+(?:inline\s+)?[\w \t*]+?\b(\w+)\s*\([^;{]*\)\s*\{", text, re.M):
            if uses[m.group(1)] < 2:
                dead.append(f"{path.name}: {m.group(1)}")
    assert not dead, f"C helpers defined but never used (remove them): {dead}"


def test_the_opencl_one_dimensional_launcher_is_named_for_what_it_does():
    pytest.importorskip("pyopencl", reason="pyopencl not installed")
    from parconv.backends.opencl import OpenCLBackend

    assert callable(getattr(OpenCLBackend, "_launch_1d", None))
    assert not hasattr(OpenCLBackend, "_elementwise")  # it launches any 1-D kernel, not only elementwise ops


@pytest.mark.parametrize("w_shape, stride, pads, dilation, groups, square", [
    ((4, 2, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, True),
    ((4, 2, 5, 5), (2, 2), (0, 0, 0, 0), (1, 1), 1, True),
    ((4, 2, 3, 2), (1, 1), (1, 1, 1, 1), (1, 1), 1, False),   # rectangular kernel
    ((4, 2, 3, 3), (1, 2), (1, 1, 1, 1), (1, 1), 1, False),   # two strides
    ((4, 2, 3, 3), (1, 1), (1, 2, 1, 2), (1, 1), 1, False),   # asymmetric padding
    ((4, 2, 3, 3), (1, 1), (1, 1, 1, 1), (2, 2), 1, False),   # dilated
    ((4, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2, False),   # grouped
])
def test_the_square_convolution_path_is_chosen_by_its_name(w_shape, stride, pads, dilation, groups, square):
    assert not hasattr(F, "_conv_is_legacy")
    assert F._conv_is_square(w_shape, stride, pads, dilation, groups) is square
