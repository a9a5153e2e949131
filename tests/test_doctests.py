"""The examples in the docstrings of the public modules run and print what they show.

Each module's examples run with ``doctest`` (``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``). ``doctest.testmod`` only looks at objects defined
in the module it is given, so the submodules that define the re-exported
names are listed too. Modules that need an optional dependency (mpi4py,
pyopencl) are skipped where it is not installed.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util

import pytest

# the modules named in the docs' API reference, and the modules defining their names
MODULES = [
    "parconv",
    "parconv._config",
    "parconv._grad",
    "parconv.amp",
    "parconv._buildinfo",
    "parconv.functional",
    "parconv.layers",
    "parconv.model",
    "parconv.losses",
    "parconv.optim",
    "parconv.optim.lr_scheduler",
    "parconv.datasets",
    "parconv.datasets.idx",
    "parconv.datasets.mnist",
    "parconv.datasets.quadrants",
    "parconv.backends",
    "parconv.backends.base",
    "parconv.backends.numpy_ref",
    "parconv.selftest",
    "parconv.distributed",
    "parconv.quantization",
    "parconv.callbacks",
    "parconv.data",
    "parconv.data.loader",
    "parconv.data.transforms",
]
OPTIONAL = {"parconv.distributed": "mpi4py"}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    needs = OPTIONAL.get(name)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{name} needs {needs}")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=FLAGS, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"


def test_the_public_api_has_examples():
    """Guards against the examples silently disappearing (e.g. a module no longer found)."""
    attempted = 0
    for name in ("parconv", "parconv._config", "parconv.functional", "parconv.layers", "parconv.model",
                 "parconv.losses", "parconv.datasets", "parconv.datasets.quadrants", "parconv.backends"):
        attempted += doctest.testmod(importlib.import_module(name), optionflags=FLAGS, report=False).attempted
    assert attempted >= 20
