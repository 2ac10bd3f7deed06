"""Which lines of the training script never ran: the code paths a green verdict says nothing about.

A selftest of N steps proves that the code which ran resumes exactly; a branch that never ran
(``if step % 1000 == 0:``, the evaluation after an epoch that never ended, a warm-up that ends
later) was not tested. In the uninterrupted run only (the selftest sets ``UNBROKEN_SELFTEST_LINES``),
from the Checkpointer's creation on, :class:`Lines` records which lines of the script's own files
ran: the files of the frames that created the Checkpointer and ``__main__``'s, never a library's.
A global trace function (``sys.settrace``) hands line tracing to those files' frames alone; every
other frame costs one call per function call and no line events. It does not start when another
tracer (a debugger, coverage) is active, and says so.

:meth:`Lines.report`: per file, the code lines of every function that ran after tracing began
(for the frames already running then: after the line they were at) that never ran, in ranges,
with their first line's source; the lines after the training loop (the outermost loop around the
``ckpt.step()`` call), which no selftest reaches since it stops the script after step N, apart.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import sysconfig
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from .variables import library

_LIBS = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
MAX_RANGES = 8
"""Ranges of lines listed per file (the rest are counted)."""


def _mine(filename: str) -> bool:
    return os.path.isfile(filename) and not str(Path(filename).resolve()).startswith(_LIBS)


class Lines:
    """Line coverage of the script's own files in one process (see the module docstring)."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.hit: dict[str, set[int]] = {}
        self.begun: dict[tuple[str, int, str], int] = {}  # (file, first line, name) of running frames -> their line
        self.skipped = ""

    def start(self, frame: FrameType | None) -> None:
        """Trace the script's files from now on; ``frame``: where the Checkpointer is being created."""
        if sys.gettrace() is not None:
            self.skipped = "another tracer (a debugger, coverage) is active: lines not recorded"
            return
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if main and os.path.isfile(main):
            self.files.add(main)
        stack = []
        while frame is not None:
            if (not library(frame) or frame.f_code.co_filename == main) and _mine(frame.f_code.co_filename):
                self.files.add(frame.f_code.co_filename)
                stack.append(frame)
            frame = frame.f_back
        for f in stack:
            code = f.f_code
            self.begun[(code.co_filename, code.co_firstlineno, code.co_name)] = f.f_lineno
            f.f_trace, f.f_trace_lines = self._line, True
        if not self.files:
            self.skipped = "no file of the script was found on the stack"
            return
        sys.settrace(self._call)

    def stop(self) -> None:
        """Stop tracing (the lines recorded so far are kept for :meth:`report`)."""
        if sys.gettrace() == self._call:
            sys.settrace(None)

    def pause(self) -> bool:
        """Stop the trace function while the recorder works (its own calls are not the script's): True if
        it was ours and running, for :meth:`resume`."""
        if sys.gettrace() == self._call:
            sys.settrace(None)
            return True
        return False

    def resume(self, paused: bool) -> None:
        """Trace again after :meth:`pause`, if it paused."""
        if paused:
            sys.settrace(self._call)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename in self.files else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.hit.setdefault(frame.f_code.co_filename, set()).add(frame.f_lineno)
        return self._line

    # -------------------------------------------------------------- report
    def report(self, loop: tuple[str, int] | None) -> dict[str, Any]:
        """``{"files": [{"file", "missed": [[first, last, where, source]], "more", "after_loop"}]}`` or
        ``{"skipped": why}``; ``loop``: the file and line of the ``ckpt.step()`` call."""
        if self.skipped:
            return {"skipped": self.skipped}
        out = []
        for name in sorted(self.files):
            try:
                tree_src = Path(name).read_text()
                top = compile(tree_src, name, "exec")
            except (OSError, SyntaxError, ValueError):
                continue
            hit = self.hit.get(name, set())
            at = loop[1] if loop and loop[0] == name else None
            after = _after_loop(tree_src, at) if at is not None else None
            missed: list[tuple[int, str]] = []
            late: list[int] = []
            for code in _codes(top):
                lines = sorted({ln for _, _, ln in code.co_lines() if ln is not None}
                               - ({code.co_firstlineno} if code.co_name != "<module>" else set()))
                if not hit.intersection(lines):
                    continue  # never ran after the Checkpointer was created (set-up, or never called)
                since = self.begun.get((name, code.co_firstlineno, code.co_name), 0)
                for ln in lines:
                    if ln in hit or ln <= since:
                        continue
                    if after is not None and ln >= after and at in lines:  # the loop's own function
                        late.append(ln)
                    else:
                        missed.append((ln, _where(code)))
            if missed or late:
                ranges = _ranges(name, sorted(set(missed)), hit)
                out.append({"file": name, "missed": ranges[:MAX_RANGES], "more": max(0, len(ranges) - MAX_RANGES),
                            "after_loop": [min(late), max(late)] if late else None})
        return {"files": out}


def _codes(code: CodeType) -> list[CodeType]:
    out = [code]
    for c in code.co_consts:
        if isinstance(c, CodeType):
            out.extend(_codes(c))
    return out


def _where(code: CodeType) -> str:
    return "at module level" if code.co_name == "<module>" else f"in {code.co_name}()"


def _after_loop(source: str, line: int) -> int | None:
    """The first line after the outermost loop around ``line`` in the innermost function holding it
    (``None``: no loop around it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.lineno > scope.lineno:
                scope = node
    loops = [n for n in ast.walk(scope) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))
             and n.lineno <= line <= (n.end_lineno or 0)]
    if not loops:
        return None
    outer = min(loops, key=lambda n: n.lineno)
    return (outer.end_lineno or outer.lineno) + 1


def _ranges(name: str, missed: list[tuple[int, str]], hit: set[int]) -> list[list[Any]]:
    """Consecutive missed lines (no line that ran between them) as ``[first, last, where, source]``."""
    out: list[list[Any]] = []
    for ln, where in missed:
        if out and out[-1][2] == where and not any(out[-1][1] < h < ln for h in hit):
            out[-1][1] = ln
        else:
            out.append([ln, ln, where, linecache.getline(name, ln).strip()[:80]])
    return out
