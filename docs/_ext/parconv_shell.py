"""``shell("parconv info")``: run a command as a reader would type it and show a terminal transcript.

Used by the executed tutorials, from cells whose input is hidden: the page
shows the command and its captured output as one shell block (``$ command``
then the output), rendered from a Markdown output of the cell. ``sh`` prints
the same transcript as plain text or returns it. Leading ``NAME=value``
words set environment variables for the command, as in a shell (``$VAR`` in
the value is expanded). ``parconv``, ``mpiexec``, ``python``, ``pip``
and ``pytest`` resolve to the environment running the notebook (the
directory of ``sys.executable``), so the build does not depend on ``PATH``;
where the ``parconv`` script is not installed (an in-place build of the docs)
``python -m parconv.cli`` runs instead. Progress bars are reduced to their
final state.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_OPTIONS_WITH_VALUE = {"-n", "-np", "-hosts", "-host", "-ppn", "-f", "-hostfile", "-genv", "-env"}


def _program(name: str) -> list[str]:
    if name in ("python", "python3"):
        return [sys.executable]
    if name in ("pip", "pytest"):
        return [sys.executable, "-m", name]
    if name == "parconv":
        script = BIN / "parconv"
        return [str(script)] if script.exists() else [sys.executable, "-m", "parconv.cli"]
    if name == "mpiexec":
        script = BIN / "mpiexec"
        found = str(script) if script.exists() else shutil.which("mpiexec")
        if found is None:
            raise FileNotFoundError('mpiexec not found: pip install "parconv[mpi]" (or install MPI)')
        return [found]
    return [name]


def resolve(argv: list[str]) -> list[str]:
    """``argv`` with its program (and, after ``mpiexec``, the program it starts) resolved."""
    out = _program(argv[0])
    if argv[0] != "mpiexec":
        return out + argv[1:]
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        out.append(argv[i])
        if argv[i] in _OPTIONS_WITH_VALUE and i + 1 < len(argv):
            out.append(argv[i + 1])
            i += 1
        i += 1
    if i < len(argv):
        out += _program(argv[i]) + argv[i + 1:]
    return out


def _final_states(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append(parts[-1] if parts else "")
    return "\n".join(lines).rstrip()


def sh(cmd: str, timeout: float = 110, check: bool = True, cwd=None, env: dict | None = None, show: bool = True):
    """Run ``cmd``; print ``$ cmd`` and its output (stdout and stderr merged).

    Returns the output text when ``show`` is false (else None, so a notebook
    cell does not echo it twice). A non-zero exit status raises
    ``RuntimeError`` (unless ``check=False``), which fails the docs build.
    """
    # no PYTHONUNBUFFERED: buffered ranks write whole lines, so mpiexec does not interleave them mid-line
    argv = shlex.split(cmd)
    assigned = {}
    while argv and _ASSIGNMENT.match(argv[0]):
        name, value = argv.pop(0).split("=", 1)
        assigned[name] = os.path.expandvars(value)
    full_env = dict(os.environ, COLUMNS="100", **(env or {}), **assigned)
    full_env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run(resolve(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, cwd=cwd, env=full_env)
    text = _final_states(proc.stdout.decode("utf-8", "replace"))
    if show:
        print(f"$ {cmd}")
        print(text)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{cmd}` exited with status {proc.returncode}:\n{text}")
    return None if show else text


def console(transcript) -> None:
    """Show ``[(command, output), ...]`` as one shell block: ``$ command`` lines, each followed by its output."""
    from IPython.display import Markdown, display

    body = "\n".join(f"$ {cmd}\n{out}" if out else f"$ {cmd}" for cmd, out in transcript)
    fence = "```"
    while fence in body:
        fence += "`"
    display(Markdown(f"{fence}console\n{body}\n{fence}"))


def shell(cmd: str, timeout: float = 110, check: bool = True, cwd=None, env: dict | None = None) -> None:
    """Run ``cmd`` (see :func:`sh`) and show it with its captured output as a shell block."""
    console([(cmd, sh(cmd, timeout=timeout, check=check, cwd=cwd, env=env, show=False))])
