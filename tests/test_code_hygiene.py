"""No dead helpers, and internal names that say what they are."""

from __future__ import annotations

import ast
import os
import re
from collections import Counter
from pathlib import Path

import pytest

import parconv.functional as F

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "parconv"


def _read(paths) -> dict:
    return {p: p.read_text(encoding="utf-8") for p in paths}


SOURCES = _read([p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".pyx", ".pxi", ".pxd", ".h")])
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
        elif path.suffix in (".pyx", ".pxi"):
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


def _setup_function(name):
    """A top-level function of setup.py, without running setup() (which the module does on import)."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    names = {"_INCLUDE"} | {name}
    body = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in names)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets))]
    space = {"os": os, "re": re}
    exec(compile(ast.Module(body=body, type_ignores=[]), "setup.py", "exec"), space)
    return space[name]


def test_the_build_rebuilds_a_module_when_a_file_it_includes_changes():
    """setup.py regenerates a module's C when a .pxi it includes is newer (its freshness check reads
    the ``include`` lines), and every .pxi belongs to some module, so none escapes the check."""
    included = _setup_function("_included")
    ext = PACKAGE / "_ext"
    by_module = {pyx.stem: included(str(pyx)) for pyx in ext.glob("*.pyx")}  # any working directory
    conv = sorted(os.path.basename(f) for f in by_module["_conv"])
    assert conv == sorted(["_conv_direct.pxi", "_conv_winograd.pxi", "_conv_winograd4.pxi", "_conv_blas.pxi",
                           "_conv_fused.pxi", "_team.pxi"])
    every = {os.path.basename(f) for files in by_module.values() for f in files}
    assert {p.name for p in ext.glob("*.pxi")} <= every, "a .pxi no module includes"
    setup_text = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert '"pc_conv.pxd"' in setup_text  # a changed declaration recompiles every level
    assert '"*.pxi"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # the sdist carries them


def _module_text(pyx: Path) -> str:
    """A kernel module's source with the .pxi files it includes."""
    text = pyx.read_text(encoding="utf-8")
    for name in re.findall(r'^include\s+"([^"]+)"', text, re.M):
        text += (pyx.parent / name).read_text(encoding="utf-8")
    return text


def test_kernel_module_docstrings_name_every_op_they_hold():
    """Each kernel module's docstring names the ops it implements (a forward/backward/update kernel
    ``<op>_forward`` is named as ``<op>``, underscores or spaces; a plain convolution may be called
    one), so it cannot go stale as ops move in."""
    convolutions = {"conv2d", "depthwise"}
    stale = []
    for pyx in sorted((PACKAGE / "_ext").glob("*.pyx")):
        text = _module_text(pyx)
        doc = re.search(r'^"""(.*?)"""', text, re.S | re.M)
        words = re.sub(r"[-_\s]+", " ", (doc.group(1) if doc else "").lower())
        for name in re.findall(r"^def ([a-z]\w*?)_(?:forward|backward|update)\w*\s*\(", text, re.M):
            if name.replace("_", " ") not in words and not (name in convolutions and "convolution" in words):
                stale.append(f"{pyx.name}: {name}")
    assert not stale, f"ops missing from their module's docstring: {sorted(set(stale))}"


def test_conv_holds_one_algorithm_family_per_file():
    """_conv.pyx keeps the entry points that choose an algorithm; each family's kernels are in its .pxi."""
    ext = PACKAGE / "_ext"
    conv = (ext / "_conv.pyx").read_text(encoding="utf-8")
    defined = {f.name: set(re.findall(r"^c?p?def\s+(?:[\w\[\]*]+\s+)*?(\w+)\s*\(", f.read_text(encoding="utf-8"), re.M))
               for f in ext.glob("_conv_*.pxi")}
    assert {"_conv_shifted", "_conv_tiled", "_dw_shifted", "_dw_dot"} <= defined["_conv_direct.pxi"]
    assert {"_conv_winograd", "_dw_winograd", "winograd_applies"} <= defined["_conv_winograd.pxi"]
    assert {"winograd4_applies", "winograd4_dw_applies"} <= defined["_conv_winograd4.pxi"]
    assert {"_backward_blas"} <= defined["_conv_blas.pxi"]
    assert {"conv2d_relu_maxpool2d_forward", "conv2d_relu_maxpool2d_backward"} <= defined["_conv_fused.pxi"]
    own = set(re.findall(r"^c?p?def\s+(?:[\w\[\]*]+\s+)*?(\w+)\s*\(", conv, re.M))
    assert {"conv2d_forward", "conv2d_backward", "fold_batch_norm"} <= own
    assert not own & set().union(*defined.values())
    assert 'cdef extern from' not in conv and not any('cdef extern from' in (ext / n).read_text(encoding="utf-8")
                                                      for n in defined), "C declarations belong in pc_conv.pxd"


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


def _kernel_sources():
    """(path, lines) of every Cython kernel source (.pyx and .pxi)."""
    for path, text in SOURCES.items():
        if path.suffix in (".pyx", ".pxi"):
            yield path, text.splitlines()


def test_every_parallel_loop_lets_a_free_thread_take_the_work():
    """A statically split loop waits at its barrier for the thread the OS descheduled, so on a
    shared machine it runs at the slowest thread's pace: every ``prange`` hands out its blocks
    dynamically (``dynamic`` or ``guided``). Partial sums whose order must not follow the load take
    fixed parts handed out dynamically, one buffer per part (conv2d_general_backward)."""
    bad = []
    for path, lines in _kernel_sources():
        for i, line in enumerate(lines):
            if "prange(" not in line or line.lstrip().startswith("#"):
                continue
            m = re.search(r'schedule\s*=\s*["\'](\w+)["\']', line)
            kind = m.group(1) if m else None
            if kind in ("dynamic", "guided"):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{i + 1}: schedule={kind!r}")
    assert not bad, "parallel loops split statically:\n" + "\n".join(bad)


def test_loops_of_one_parallel_block_are_separated_by_a_barrier():
    """Cython ends each prange inside ``with parallel()`` with ``omp for nowait``: a thread done with
    its share of one loop starts the next while others still write what it may read. Two pranges of
    one block need ``pc_sync_wait()`` between them, at the block's own level (every thread calls it)."""
    bad = []
    for path, lines in _kernel_sources():
        for i, line in enumerate(lines):
            if "parallel(" not in line or not line.lstrip().startswith("with ") or line.lstrip().startswith("#"):
                continue
            indent = len(line) - len(line.lstrip())
            body = None
            seen_loop = barrier = False
            for j in range(i + 1, len(lines)):
                lj = lines[j]
                if not lj.strip() or lj.lstrip().startswith("#"):
                    continue
                ind = len(lj) - len(lj.lstrip())
                if ind <= indent:
                    break
                body = ind if body is None else body
                if ind == body and "pc_sync_wait(" in lj:
                    barrier = True
                if ind == body and "prange(" in lj:
                    if seen_loop and not barrier:
                        bad.append(f"{path.relative_to(ROOT)}:{j + 1}")
                    seen_loop, barrier = True, False
    assert not bad, "a prange after another in one parallel block, with no pc_sync_wait() between:\n" + "\n".join(bad)


def test_every_parallel_region_takes_the_team_cap():
    """With other processes busy, parconv caps every region's team (pc_cap in pc_common.h): a region
    that asks for its threads any other way would still wait for a descheduled one. The cap must not
    change a result, so no region may split its work by the team it got (``threadid()`` indexing
    partial sums, a static split of a sum)."""
    bad = []
    for path, lines in _kernel_sources():
        for i, line in enumerate(lines):
            if line.lstrip().startswith("#"):
                continue
            for m in re.finditer(r"num_threads\s*=\s*(\w+)", line):
                if m.group(1) != "pc_cap":
                    bad.append(f"{path.relative_to(ROOT)}:{i + 1}: num_threads={m.group(1)}...")
            if "threadid()" in line or 'schedule="static"' in line or "schedule='static'" in line:
                bad.append(f"{path.relative_to(ROOT)}:{i + 1}: splits by the team it got")
    assert not bad, "regions outside the team cap:\n" + "\n".join(bad)
    for pyx in (PACKAGE / "_ext").glob("*.pyx"):
        if "prange(" in _module_text(pyx):
            assert 'include "_team.pxi"' in pyx.read_text(encoding="utf-8"), f"{pyx.name} cannot be capped"


def test_every_threaded_entry_point_estimates_its_work():
    """A kernel entry that takes a thread count tells pc_cap what its call costs on one thread
    (``pc_work``) before its first region, so a call too small to pay for waking the team runs on
    fewer threads; an entry without an estimate would run its regions on the previous call's."""
    region = re.compile(r"prange\(|parallel\(|nogil|\b_(?!conv_geometry)(?:conv|dw|gemm|par|pointwise|sum|backward)\w*\(")
    bad = []
    for path, lines in _kernel_sources():
        text = "\n".join(lines)
        for m in re.finditer(r"^def (\w+)\((.*?)\):[^\n]*\n(.*?)(?=^\S)", text + "\nEND", re.S | re.M):
            name, args, body = m.groups()
            if name.startswith("_") or "num_threads" not in args or path.name == "_threads.pyx":
                continue
            code = "\n".join(ln.split("#")[0] for ln in body.splitlines() if not ln.lstrip().startswith(("#", '"')))
            first = region.search(code)
            at = code.find("pc_work(")
            if at < 0 or (first is not None and first.start() < at):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "threaded kernel entries without a pc_work estimate before their first region:\n" + "\n".join(bad)
