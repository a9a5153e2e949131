"""Sphinx helpers for the parconv docs.

* ``.. parconv-cli::`` renders ``parconv --help`` and the help of every
  subcommand straight from :func:`parconv.cli.make_parser`, so the
  command-line reference cannot drift from the code.
* After reading, every name in ``__all__`` of the public modules must be
  documented somewhere; a missing one is a warning (an error under ``-W``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

#: modules whose every public name must appear in the API reference
PUBLIC_MODULES = (
    "parconv",
    "parconv.functional",
    "parconv.optim",
    "parconv.optim.lr_scheduler",
    "parconv.datasets",
    "parconv.distributed",
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


def setup(app):
    app.add_directive("parconv-cli", ParconvCLI)
    app.connect("env-check-consistency", _check_api_complete)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
