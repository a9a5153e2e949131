"""Sphinx configuration of the parconv documentation.

Build (warnings are errors, as in CI)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

The tutorials are MyST notebooks executed by myst-nb at build time; set
``PARCONV_DOCS_EXECUTE=force`` to re-run them even when the cache is fresh,
or ``off`` to skip execution while editing prose.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

# Use the installed parconv (CI installs ".[docs]"); fall back to the
# source tree for an in-place build. The notebook kernels and the `parconv` /
# `mpiexec` processes they start inherit PYTHONPATH, so they see the same copy.
# docs/_ext also holds parconv_shell, the tutorials' terminal helper.
_kernel_path = [str(DOCS / "_ext")]
if importlib.util.find_spec("parconv") is None:
    sys.path.insert(0, str(ROOT))
    _kernel_path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(_kernel_path + [p for p in [os.environ.get("PYTHONPATH")] if p])

import parconv  # noqa: E402
import parconv_docs  # noqa: E402  (docs/_ext)

# ------------------------------------------------------------------ project
project = "parconv"
author = "The parconv developers"
copyright = "2026, The parconv developers"
release = parconv.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_nb",
    "sphinx_copybutton",
    "parconv_docs",  # docs/_ext: CLI reference, API completeness check
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = [
    "_build",
    "Thumbs.db",
    ".DS_Store",
    "**/.ipynb_checkpoints",
    "tutorials/plugin_example/**",  # a package, shown through literalinclude
]
templates_path = ["_templates"]
nitpicky = False

# ------------------------------------------------------------------ API reference
autosummary_generate = True  # stubs in docs/generated/ (git-ignored); class pages: _templates/autosummary
autodoc_default_options = {"members": True, "inherited-members": False, "show-inheritance": True}
autodoc_typehints = "none"  # numpydoc sections carry the types
autodoc_member_order = "bysource"
# parconv.distributed imports mpi4py lazily; mock it where MPI is not installed
autodoc_mock_imports = [] if importlib.util.find_spec("mpi4py") else ["mpi4py"]

numpydoc_show_class_members = False  # autodoc documents the members on each class page
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# ------------------------------------------------------------------ notebooks (myst-nb)
nb_execution_mode = os.environ.get("PARCONV_DOCS_EXECUTE", "cache")
nb_execution_timeout = 120  # seconds per notebook; each tutorial needs well under a minute on 2 cores
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_in_temp = False  # run in docs/tutorials, next to plugin_example/
nb_merge_streams = True
nb_execution_excludepatterns = []
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist", "substitution"]
# figures the prose quotes ({{ tutorial_count }}, ...), computed from the docs and the code
myst_substitutions = parconv_docs.substitutions(DOCS)
myst_heading_anchors = 3

# ------------------------------------------------------------------ HTML
html_theme = "furo"
html_title = f"parconv {release}"
html_static_path = ["_static"]
html_css_files = ["parconv.css"]
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True
