"""Sphinx helpers for the parconv docs.

* ``.. parconv-cli::`` renders ``parconv --help`` and the help of every
  subcommand straight from :func:`parconv.cli.make_parser`, so the
  command-line reference cannot drift from the code.
* After reading, every name in ``__all__`` of the public modules must be
  documented somewhere; a missing one is a warning (an error under ``-W``).
* :func:`substitutions` computes the figures the prose quotes (``{{ tutorial_count }}``,
  ``{{ selftest_checks }}``) from the docs and the code, so they cannot drift;
  ``conf.py`` hands them to MyST and tests/test_docs_figures.py checks them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
from pathlib import Path

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

#: modules whose every public name must appear in the API reference
PUBLIC_MODULES = (
    "parconv",
    "parconv.amp",
    "parconv.functional",
    "parconv.optim",
    "parconv.optim.lr_scheduler",
    "parconv.datasets",
    "parconv.distributed",
    "parconv.quantization",
    "parconv.backends",
    "parconv.selftest",
    "parconv.callbacks",
    "parconv.data",
    "parconv.data.transforms",
    "parconv.models",
    "parconv.training",
    "parconv.optable",
)


@contextlib.contextmanager
def _columns(n: int):
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:  # argparse keeps no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


class ParconvCLI(SphinxDirective):
    """``.. parconv-cli:: [subcommand]`` -> the ``--help`` text as a literal block."""

    optional_arguments = 1
    has_content = False

    def run(self):
        from parconv.cli import make_parser

        parser = make_parser()
        if self.arguments:
            name = self.arguments[0]
            subs = _subparsers(parser)
            if name not in subs:
                raise self.error(f"parconv has no subcommand {name!r} (it has {sorted(subs)})")
            parser = subs[name]
        with _columns(88):
            text = parser.format_help()
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def _check_api_complete(app, env):
    objects = env.get_domain("py").data.get("objects", {})
    modules = env.get_domain("py").data.get("modules", {})
    from sphinx.ext.autodoc.mock import mock

    for modname in PUBLIC_MODULES:
        try:
            with mock(app.config.autodoc_mock_imports):  # as autodoc imports it (mpi4py may be mocked)
                module = importlib.import_module(modname)
        except Exception as exc:  # noqa: BLE001 - reported as a docs warning
            logger.warning(f"API reference: cannot import {modname}: {type(exc).__name__}: {exc}")
            continue
        for name in getattr(module, "__all__", ()):
            full = f"{modname}.{name}"
            if full not in objects and full not in modules:
                logger.warning(f"API reference: public name {full} is not documented "
                               f"(add it to docs/api/*.rst)")


_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve")


def number_word(n: int) -> str:
    """``9 -> "nine"``: the docs spell out small counts."""
    return _NUMBER_WORDS[n] if 0 <= n < len(_NUMBER_WORDS) else str(n)


def tutorial_pages(docs_dir) -> list:
    """The pages of the tutorials' toctree (docs/tutorials/index.md), in order."""
    text = (Path(docs_dir) / "tutorials" / "index.md").read_text(encoding="utf-8")
    block = re.search(r"```\{toctree\}\n(.*?)```", text, re.S)
    if block is None:
        raise ValueError("docs/tutorials/index.md has no toctree")
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith(":")]


def selftest_check_count() -> int:
    """How many checks ``parconv selftest`` runs (on the NumPy reference, fixed shapes only: the same checks)."""
    from parconv.selftest import run_selftest

    out = io.StringIO()
    if not run_selftest("numpy", n_random=0, file=out):
        raise RuntimeError(f"parconv selftest fails on the NumPy reference:\n{out.getvalue()}")
    found = re.search(r"PASSED: (\d+) of (\d+) checks", out.getvalue())
    return int(found.group(2))


def substitutions(docs_dir) -> dict:
    """The MyST substitutions of the figures the prose quotes, computed from the docs and the code."""
    return {"tutorial_count": number_word(len(tutorial_pages(docs_dir))),
            "selftest_checks": str(selftest_check_count())}


def setup(app):
    app.add_directive("parconv-cli", ParconvCLI)
    app.connect("env-check-consistency", _check_api_complete)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
