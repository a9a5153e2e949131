"""What the docs quote about the code is what the code does: counts and sample output are generated
(docs/_ext/parconv_docs.py, executed cells) or checked here, and ``functional``'s public functions are
all in its ``__all__`` and its API page."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

import parconv.functional as F

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "tutorials").glob("*.md")) + sorted((DOCS / "api").glob("*.rst"))


@pytest.fixture(scope="module")
def parconv_docs():
    pytest.importorskip("sphinx", reason="the docs extension needs sphinx (pip install '.[docs]')")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import parconv_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return parconv_docs


def _prose(page: Path) -> str:
    """A page without its code cells and code blocks (what a reader reads as text)."""
    return re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)


# ------------------------------------------------------------------ functional
def test_every_public_function_of_functional_is_in_all_and_documented():
    public = {name for name, obj in vars(F).items()
              if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
              and obj.__module__ == F.__name__}
    assert public - set(F.__all__) == set(), "public in parconv.functional but not in its __all__"
    assert set(F.__all__) - public == set(), "in parconv.functional.__all__ but not defined there"
    page = (DOCS / "api" / "functional.rst").read_text(encoding="utf-8")
    listed = set(re.findall(r"^   (\w+)$", page, re.M))
    assert set(F.__all__) - listed == set(), "in parconv.functional.__all__ but not in docs/api/functional.rst"


# ------------------------------------------------------------------ counts
def test_the_tutorial_count_is_generated_and_right(parconv_docs):
    pages = parconv_docs.tutorial_pages(DOCS)
    files = sorted(p.stem for p in (DOCS / "tutorials").glob("*.md") if p.stem != "index")
    assert sorted(pages) == files, "docs/tutorials/index.md's toctree and the tutorial files differ"
    assert parconv_docs.substitutions(DOCS)["tutorial_count"] == parconv_docs.number_word(len(files))
    quoted = [(p.name, m) for p in PAGES for m in re.findall(r"(\{\{ \w+ \}\}|\w+) executed tutorials", _prose(p))]
    assert quoted, "the quickstart no longer quotes the tutorial count: drop this test's check or restore it"
    for page, word in quoted:
        assert word == "{{ tutorial_count }}", f"{page} hard-codes the tutorial count as {word!r}"


def test_the_selftest_check_count_is_generated_and_right(parconv_docs, capsys):
    from parconv.selftest import run_selftest

    assert run_selftest("numpy", n_random=0)
    found = re.search(r"PASSED: (\d+) of (\d+) checks", capsys.readouterr().out)
    count = parconv_docs.substitutions(DOCS)["selftest_checks"]
    assert count == found.group(2)
    assert "{{ selftest_checks }}" in (DOCS / "tutorials" / "03_opencl_selftest.md").read_text(encoding="utf-8")
    for page in PAGES:
        for n in re.findall(r"\b(\d+) checks\b", _prose(page)):
            assert n == count, f"{page.name} says {n} checks; parconv selftest runs {count} (use {{{{ selftest_checks }}}})"


def test_adding_an_op_counts_its_own_table():
    text = (DOCS / "adding-an-op.md").read_text(encoding="utf-8")
    words = ("five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")
    said = re.search(r"needs \*\*(\w+) files", text).group(1)
    table = re.search(r"\| # \| file \| what goes there \|\n\| --- \| --- \| --- \|\n((?:\|.*\n)+)", text).group(1)
    rows = table.strip().splitlines()
    assert said == words[len(rows) - 5], f"the page says {said} files, its table has {len(rows)}"
    assert f"## Beyond the {said} files" in text
    for needed in ("parconv/onnx.py", "docs/api/functional.rst", "`functional.__all__`"):
        assert needed in table, f"adding-an-op.md's table misses {needed}"


# ------------------------------------------------------------------ sample output and timings
def test_no_page_hand_writes_training_results():
    """Accuracies, losses and throughputs shown as a command's output come from an executed cell."""
    for page in PAGES:
        prose = _prose(page)
        assert not re.search(r"test accuracy: \d", prose), page.name
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:text|console)\n(.*?)```", text, re.S):
            assert not re.search(r"(test accuracy|throughput): \d", block), \
                f"{page.name} shows hand-written training output; run the command in a code cell instead"


def test_cli_page_runs_the_command_it_shows():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert text.startswith("---\nfile_format: mystnb"), "cli.md must be an executed page"
    assert re.search(r"```\{code-cell\} ipython3\n:tags: \[remove-input\]\ncmd = \"parconv train [^\"]*\"", text)


def test_tutorials_state_no_unmeasured_durations():
    for page in sorted((DOCS / "tutorials").glob("*.md")):
        prose = _prose(page)
        assert not re.search(r"\btakes (a few|\d+) (seconds|minutes)", prose), page.name
    first = (DOCS / "tutorials" / "01_mnist_cnn.md").read_text(encoding="utf-8")
    assert "_page_start = time.perf_counter()" in first and "This page ran in" in first
