"""The docs say what exists: every repository path and every ``UNBROKEN_*`` variable they name exists,
every variable unbroken reads is in the table of docs/environment-variables.md, and every Python block
of the README and the docs is valid Python (``test_doc_blocks.py`` runs them)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

import docblocks

REPO = docblocks.REPO
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:src|tests|benchmarks|examples|tools|docs|scripts)/[\w./-]*$")
VARIABLE = re.compile(r"\bUNBROKEN_[A-Z0-9_]*[A-Z0-9]\b")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    named = set()
    for span in CODE.findall(_text(page)):  # paths are written as code: `src/unbroken/api.py`
        for word in span.split():
            word = word.split("::")[0].rstrip(".,;:)")
            word = re.sub(r":\d+$", "", word)  # a line number
            if PATH.match(word):
                named.add(word)
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


def _read_by_code() -> set[str]:
    """Every UNBROKEN_* name that appears in the package's source or the test suite's."""
    names: set[str] = set()
    for root in (REPO / "src", REPO / "tests", REPO / "benchmarks"):
        for f in root.rglob("*.py"):
            names |= set(VARIABLE.findall(f.read_text(encoding="utf-8")))
    return names


def test_every_variable_the_docs_name_exists_in_the_code() -> None:
    code = _read_by_code()
    named = {v: p for p in PAGES for v in VARIABLE.findall(_text(p))}
    unknown = sorted(v for v in named if v not in code)
    assert not unknown, {v: str(named[v].relative_to(REPO)) for v in unknown}


def test_every_variable_unbroken_reads_is_in_the_table() -> None:
    table = _text(REPO / "docs" / "environment-variables.md")
    read = set()
    for f in (REPO / "src").rglob("*.py"):
        read |= set(VARIABLE.findall(f.read_text(encoding="utf-8")))
    missing = sorted(v for v in read if f"`{v}" not in table)
    assert not missing, f"read by src/ but not in docs/environment-variables.md: {missing}"


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for n, (heading, code) in enumerate(docblocks.python_blocks(page)):
            out.append((f"{page.relative_to(REPO)}#{n}:{heading[:40]}", n, code))
    return out


@pytest.mark.parametrize("where,n,code", _blocks(), ids=[b[0] for b in _blocks()])
def test_every_python_block_is_valid_python(where: str, n: int, code: str) -> None:
    text = textwrap.dedent(code)
    try:
        ast.parse(text)
    except SyntaxError:
        # a fragment of a loop body (indented lines under `...`): valid inside a function
        ast.parse("def _():\n" + textwrap.indent(text, "    "))
