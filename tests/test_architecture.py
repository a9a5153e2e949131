"""Structure the code keeps: who imports whom, layers do no maths themselves, comments carry no timings."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parconv")
CORE = ("model", "training", "_checkpoint", "distributed", "layers", "_fusion")


def _imports(module: str) -> set:
    """parconv modules ``module`` imports, at the top or inside functions (relative imports)."""
    with open(os.path.join(ROOT, module + ".py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
    return out


def test_model_imports_nothing_from_distributed():
    assert "distributed" not in _imports("model")
    assert "distributed" not in _imports("training")


def test_no_import_cycle_among_the_core_modules():
    graph = {m: _imports(m) & set(CORE) for m in CORE}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in graph[start])

    cycles = [m for m in CORE if reaches(m, m)]
    assert not cycles, {m: sorted(graph[m]) for m in cycles}


def test_layers_call_no_backend_op():
    """Layers reach the maths through parconv.functional; a backend is only asked for arrays."""
    with open(os.path.join(ROOT, "layers.py"), encoding="utf-8") as f:
        source = f.read()
    allowed = {"asarray", "to_numpy", "zeros", "copy_into"}  # array plumbing (zero_grad(set_to_none=False))
    calls = set(re.findall(r"\.backend\.(\w+)\(", source)) | set(re.findall(r"\bbackend\.(\w+)\(", source))
    assert calls <= allowed, sorted(calls - allowed)
    assert "from .backends" not in source.replace("from . import backends as _backends", "")


@pytest.mark.parametrize("ext", [".py", ".pyx", ".pxi", ".h", ".cl", ".pxd"])
def test_no_measured_figures_in_code_comments(ext):
    """Timings and machine names belong in commit messages and docs/performance-internals.md."""
    pattern = re.compile(r"(#|//|/\*|^\s*\*).*(\b\d+(\.\d+)? ?(ms|us|µs)\b|Zen ?\d|Xeon|EPYC)")
    offenders = []
    for base in (ROOT, os.path.join(os.path.dirname(ROOT), "kernels_cl")):
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(ext):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        for i, line in enumerate(f, 1):
                            if pattern.search(line):
                                offenders.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
