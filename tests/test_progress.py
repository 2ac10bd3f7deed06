"""Progress bars: shown for long synchronous saves and loads on a terminal, counting every
byte; never for background saves, small ones, or when stderr is not a terminal."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken._support import progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every bar opened (its description and total) and every byte counted on it."""
    seen: list[tuple[str, int]] = []
    real_task, real_advance = progress.task, progress.advance

    def task(description: str, total: int):  # type: ignore[no-untyped-def]
        seen.append((description, total))
        return real_task(description, total)

    def advance(n: int) -> None:
        if getattr(progress._local, "bar", None) is not None:
            seen.append(("+", n))
        real_advance(n)

    monkeypatch.setattr(progress, "task", task)
    monkeypatch.setattr(progress, "advance", advance)
    return seen


def shown(seen: list[tuple[str, int]]) -> int:
    return sum(n for d, n in seen if d == "+")


def test_a_large_save_and_load_on_a_terminal_show_a_bar_counting_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted: list[tuple[str, int]]) -> None:
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(progress, "MIN_BYTES", 1000)
    state = {"w": torch.randn(100_000), "b": torch.randn(10)}
    nbytes = 100_010 * 4
    unbroken.save(tmp_path / "c", state)
    assert ("saving", nbytes) in counted and shown(counted) >= nbytes
    assert "saving" in term.getvalue()
    counted.clear()
    unbroken.load(tmp_path / "c")
    info = unbroken.verify(tmp_path / "c")
    assert any(d.startswith("reading") for d, _ in counted) and shown(counted) >= info.size_bytes


@pytest.mark.parametrize("why", ["not a terminal", "small", "turned off", "background"])
def test_no_bar_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO() if why == "not a terminal" else FakeTerminal())
    monkeypatch.setattr(progress, "MIN_BYTES", 10**12 if why == "small" else 1000)
    if why == "turned off":
        monkeypatch.setenv("UNBROKEN_PROGRESS", "0")
    state = {"w": torch.randn(100_000)}
    if why == "background":  # the write runs in the save thread: no bar there
        unbroken.save(tmp_path / "c", state, async_save=True).wait()
    else:
        unbroken.save(tmp_path / "c", state)
        unbroken.load(tmp_path / "c")
    assert sys.stderr.getvalue() == ""
