"""The training loop's own variables, hashed: evidence for a value carried from step to step outside the state.

A script that carries a value across steps in a plain variable (an RNN's ``hidden``, a running
mean, a counter) and does not put it in the state resumes with that variable at its initial
value. Nothing in the state shows it: the parameters, optimizer, data and RNG agree at the start
of the step, and only the step's result differs. The variables of the loop's frame show it: the
one that exists in both runs at the start of that step and holds different values is the one.

:func:`snapshot` hashes the plain values of a frame (tensors, arrays, numbers, strings, short
containers of them); objects (modules, optimizers, loaders), functions, modules and the state's
own values are left out. :func:`loop_frame` finds the frame to look at: the function that calls
``ckpt.step()`` (the loop), found walking up from a hook, else the first frame outside unbroken
and torch. Nothing here changes the frame or draws from a random generator.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import torch

from .fingerprint import digest

_UNBROKEN = str(Path(__file__).resolve().parent.parent)
_TORCH = str(Path(torch.__file__).resolve().parent)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
MAX_ITEMS = 4096
"""Containers with more items are described, not hashed (a growing log of losses costs nothing)."""
MAX_NUMEL = 1 << 24
"""Tensors and arrays with more elements are described by shape and dtype only."""


def library(frame: FrameType) -> bool:
    """Whether ``frame`` runs code of unbroken or torch (never the user's loop; the script run as
    ``__main__`` is the user's even inside unbroken: ``python -m unbroken.demo.train``)."""
    name = frame.f_code.co_filename
    if name.startswith(_TORCH):
        return True
    return name.startswith(_UNBROKEN) and name != getattr(sys.modules.get("__main__"), "__file__", None)


def caller(depth: int = 1) -> FrameType | None:
    """The first frame outside unbroken and torch, ``depth`` frames above the one calling this."""
    frame: FrameType | None = sys._getframe(depth + 1)
    while frame is not None and library(frame):
        frame = frame.f_back
    return frame


def loop_frame(start: FrameType | None, loop: CodeType | None, limit: int = 30) -> FrameType | None:
    """The frame running ``loop`` (the code that calls ``ckpt.step()``) at or above ``start``; else the
    first frame outside unbroken and torch at or above ``start``."""
    first, frame = None, start
    for _ in range(limit):
        if frame is None:
            break
        if loop is not None and frame.f_code is loop:
            return frame
        if first is None and not library(frame):
            first = frame
        frame = frame.f_back
    return first


def where(frame: FrameType) -> str:
    """``file:function`` of a frame: snapshots of the same function compare name by name."""
    return f"{frame.f_code.co_filename}:{frame.f_code.co_name}"


def _plain(x: Any, depth: int = 0) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic) + _SCALARS):
        return True
    if depth >= 3:
        return False
    if isinstance(x, (list, tuple)):
        return all(_plain(v, depth + 1) for v in x[:MAX_ITEMS])
    if isinstance(x, dict):
        return all(isinstance(k, _SCALARS) and _plain(v, depth + 1) for k, v in list(x.items())[:MAX_ITEMS])
    return False


def describe(x: Any) -> str:
    """A short description of a value for a report: a tensor's shape and dtype, a scalar itself."""
    if isinstance(x, torch.Tensor):
        return f"a tensor {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, np.ndarray):
        return f"an array {x.shape} {x.dtype}"
    if isinstance(x, (list, tuple)):
        kinds = {describe(v).split(" ")[1] for v in x[:8]} if x else set()
        inner = f" {kinds.pop()}s" if len(kinds) == 1 else ""
        return f"a {type(x).__name__} of {len(x)}{inner}"
    if isinstance(x, dict):
        return f"a dict of {len(x)}"
    text = repr(x)
    return f"a {type(x).__name__} {text}" if len(text) <= 24 else f"a {type(x).__name__}"


def _hash(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)) and (x.numel() if isinstance(x, torch.Tensor) else x.size) > MAX_NUMEL:
        return digest(describe(x))
    if isinstance(x, (list, tuple, dict)) and len(x) > MAX_ITEMS:
        return digest(describe(x))
    return digest(x)


def snapshot(scope: Mapping[str, Any], skip: set[int]) -> dict[str, list[str]]:
    """``{name: [description, digest]}`` of the plain values in ``scope`` (a frame's locals, or a
    module's globals), leaving out dunder names and the objects whose ids are in ``skip``."""
    out: dict[str, list[str]] = {}
    for name, value in list(scope.items()):
        if name.startswith("__") or id(value) in skip or not _plain(value):
            continue
        try:
            out[name] = [describe(value), _hash(value)]
        except Exception:  # noqa: BLE001 - evidence never stops training (a tensor on a lost device, ...)
            continue
    return out


@functools.cache
def read_before_set(filename: str, line: int) -> tuple[str, ...]:
    """The names the innermost loop around ``line`` (the ``ckpt.step()`` call) reads in its body before it
    assigns them there: what each iteration takes from the one before (a batch fetched ahead, a running
    mean, a counter), as opposed to the temporaries the body makes first (the loss). Statements are taken in
    source order, an assignment's value before its targets; ``()`` when the source cannot be read."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ()
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor))
             and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not loops:
        return ()
    loop = max(loops, key=lambda n: n.lineno)
    assigned: set[str] = set()
    first_read: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            if node.value is not None:
                visit(node.value)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):  # x += 1 reads x first
                visit(ast.Name(id=node.target.id, ctx=ast.Load()))
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                visit(target)
            return
        if isinstance(node, (ast.For, ast.AsyncFor)):
            visit(node.iter)
            visit(node.target)
            for child in node.body + node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in assigned and node.id not in first_read:
                first_read.append(node.id)
            elif isinstance(node.ctx, ast.Store):
                assigned.add(node.id)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return  # defined here, run elsewhere
        for inner in ast.iter_child_nodes(node):
            visit(inner)

    if isinstance(loop, (ast.For, ast.AsyncFor)):
        visit(loop.target)  # the loop's own variables: set by each iteration
    for stmt in loop.body:
        visit(stmt)
    return tuple(first_read)
