"""The code blocks of the docs, for the tests that run them as written (a documented loop must never raise)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """``(heading, code)`` of every fenced ``python`` block of a Markdown file, in order: the heading is the
    text of the nearest heading above the block."""
    out: list[tuple[str, str]] = []
    heading, lang, lines = "", None, []
    for line in path.read_text().splitlines():
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, lines = fence.group(1), []
            elif (h := _HEADING.match(line)):
                heading = h.group(2)
        elif fence and not fence.group(1):
            if lang == "python":
                out.append((heading, "\n".join(lines) + "\n"))
            lang = None
        else:
            lines.append(line)
    return out


def block_under(path: Path, heading: str) -> str:
    """The first ``python`` block under ``heading`` (its exact text); an error names the headings there are."""
    blocks = python_blocks(path)
    for h, code in blocks:
        if h == heading:
            return code
    raise LookupError(f"no python block under {heading!r} in {path}; blocks are under: "
                      f"{sorted({h for h, _ in blocks})}")
