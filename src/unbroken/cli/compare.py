"""``unbroken diff``: what differs between two checkpoints, like ``diff(1)`` for state.

Both checkpoints are verified and decoded (never unpickled); their state trees are walked
side by side. Tensors (and numpy arrays) are compared bitwise first; for those that
differ the report gives the largest absolute difference and the relative norm
``||a-b|| / ||a||`` (in float64; NaN equals NaN, a NaN on one side only counts as an
infinite difference). Tensors with another dtype or shape, entries on one side only and
plain values that differ are listed by their path in the tree (``optimizer/state/0/exp_avg``;
rank 0's own part, its RNG states, under ``(rank 0)/``). Then the step, progress,
metrics, kind and world size of the manifests, and the environments
(:func:`unbroken.environment.diff`).

*Identical* means: no tensor, value or manifest field differs and no *significant*
environment field does (code, versions, config, data, world size); *info* fields
(host, argv, platform) are shown but not counted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import typer
from rich.markup import escape
from rich.table import Table

from ..api import read_path
from ..environment import MISSING
from ..environment import diff as environment_diff
from ..errors import UnbrokenError
from ..format.manifest import Manifest
from ..state.codec import StatefulValue
from .base import JSON_OPTION, app, emit_json, fail, number, options_for, out

RANK_PART = "(rank 0)"
SHOWN = 80
"""Characters of a value shown in the text output (JSON has them whole)."""


@dataclass
class TensorDiff:
    """A tensor present on both sides that is not bitwise identical."""

    path: str
    dtype: str
    shape: list[int]
    problem: str = ""
    """``""`` (values differ), ``"dtype"`` or ``"shape"`` (then ``other`` is B's dtype or shape)."""
    other: Any = None
    max_abs_diff: float | None = None
    rel_norm: float | None = None


@dataclass
class Report:
    """Everything ``unbroken diff`` found."""

    identical_tensors: int = 0
    tensors: list[TensorDiff] = field(default_factory=list)
    only_in_a: list[dict[str, str]] = field(default_factory=list)
    only_in_b: list[dict[str, str]] = field(default_factory=list)
    values: list[dict[str, Any]] = field(default_factory=list)
    manifest: list[dict[str, Any]] = field(default_factory=list)
    environment: list[dict[str, Any]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.tensors or self.only_in_a or self.only_in_b or self.values or self.manifest
                    or any(c["severity"] == "significant" for c in self.environment))


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray) and x.dtype.kind in "biufc":
        return torch.from_numpy(np.ascontiguousarray(x))
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return (torch.view_as_real(t) if t.is_complex() else t).to(torch.float64).reshape(-1)


def tensor_diff(path: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff | None:
    """How ``b`` differs from ``a``; ``None`` if they are bitwise identical."""
    dtype = str(a.dtype).removeprefix("torch.")
    if a.dtype != b.dtype:
        return TensorDiff(path, dtype, list(a.shape), "dtype", str(b.dtype).removeprefix("torch."))
    if a.shape != b.shape:
        return TensorDiff(path, dtype, list(a.shape), "shape", list(b.shape))
    if torch.equal(_bits(a), _bits(b)):
        return None
    x, y = _float64(a), _float64(b)
    same = (x == y) | (x.isnan() & y.isnan())
    d = torch.where(same, torch.zeros_like(x), (x - y).abs()).nan_to_num(nan=math.inf)
    norm_a = torch.linalg.vector_norm(x.nan_to_num(nan=0.0)).item()
    norm_d = torch.linalg.vector_norm(d).item()
    rel = norm_d / norm_a if norm_a > 0 and math.isfinite(norm_a) else (0.0 if norm_d == 0 else math.inf)
    return TensorDiff(path, dtype, list(a.shape), max_abs_diff=d.max().item() if d.numel() else 0.0, rel_norm=rel)


def same_value(a: Any, b: Any) -> bool:
    """Plain values equal, and of the same type; floats bitwise (NaN equals NaN, 0.0 differs from -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd type whose == does not give a truth value
        return repr(a) == repr(b)


def _describe(x: Any) -> str:
    t = _as_tensor(x)
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}" if t is not None else type(x).__name__


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def compare_trees(a: Any, b: Any, report: Report, path: str = "") -> None:
    """Walk two decoded state trees side by side and add every difference to ``report``."""
    ta, tb = _as_tensor(a), _as_tensor(b)
    if ta is not None and tb is not None:
        found = tensor_diff(path, ta, tb)
        if found is None:
            report.identical_tensors += 1
        else:
            report.tensors.append(found)
    elif isinstance(a, StatefulValue) and isinstance(b, StatefulValue):
        if a.cls != b.cls:
            report.values.append({"path": _join(path, "@class"), "a": a.cls, "b": b.cls})
        compare_trees(a.value, b.value, report, path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            where = _join(path, key)
            if key not in b:
                report.only_in_a.append({"path": where, "what": _describe(a[key])})
            elif key not in a:
                report.only_in_b.append({"path": where, "what": _describe(b[key])})
            else:
                compare_trees(a[key], b[key], report, where)
    elif isinstance(a, (list, tuple)) and type(a) is type(b):
        for i in range(max(len(a), len(b))):
            if i >= len(b):
                report.only_in_a.append({"path": _join(path, i), "what": _describe(a[i])})
            elif i >= len(a):
                report.only_in_b.append({"path": _join(path, i), "what": _describe(b[i])})
            else:
                compare_trees(a[i], b[i], report, _join(path, i))
    elif not same_value(a, b):
        report.values.append({"path": path or "/", "a": a, "b": b})


def compare_manifests(a: Manifest, b: Manifest, report: Report) -> None:
    """Step, kind, world size, progress and metrics; then the environments."""
    fields = {"step": (a.step, b.step), "kind": (a.kind, b.kind), "world_size": (a.world_size, b.world_size)}
    for group, (x, y) in {"progress": (a.progress, b.progress), "metrics": (a.metrics, b.metrics)}.items():
        for key in [*x, *(k for k in y if k not in x)]:
            fields[f"{group}.{key}"] = (x.get(key, MISSING), y.get(key, MISSING))
    report.manifest += [{"field": f, "a": x, "b": y} for f, (x, y) in fields.items() if not same_value(x, y)]
    report.environment += [{"field": c.field, "a": c.saved, "b": c.current, "severity": c.severity}
                           for c in environment_diff(a.environment, b.environment)]


def diff_checkpoints(path_a: str, path_b: str) -> tuple[Report, Manifest, Manifest]:
    """Verify, decode and compare two checkpoints (raises the library's errors)."""
    loaded = [read_path(p, options_for(p)) for p in (path_a, path_b)]
    report = Report()
    compare_manifests(loaded[0].manifest, loaded[1].manifest, report)
    trees = [{**x.materialize(), **({RANK_PART: x.rank_state} if x.rank_state is not None else {})} for x in loaded]
    compare_trees(trees[0], trees[1], report)
    return report, loaded[0].manifest, loaded[1].manifest


def _short(x: Any) -> str:
    text = "(absent)" if x is MISSING else number(x) if isinstance(x, float) else repr(x)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def _present(changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``changes`` for JSON: a side without the field as ``null``."""
    return [{**c, "a": None if c["a"] is MISSING else c["a"], "b": None if c["b"] is MISSING else c["b"]}
            for c in changes]


def _print(report: Report, a: str, b: str, ma: Manifest, mb: Manifest) -> None:
    con = out()
    con.print(escape(f"A: {a} (step {ma.step})   B: {b} (step {mb.step})"))
    for c in report.manifest:
        con.print(escape(f"checkpoint {c['field']}: {_short(c['a'])} -> {_short(c['b'])}"))
    con.print(f"tensors: {report.identical_tensors} identical, {len(report.tensors)} differ, "
              f"{len(report.only_in_a)} only in A, {len(report.only_in_b)} only in B")
    if report.tensors:
        table = Table()
        for col in ("tensor", "dtype", "shape", "max |a-b|", "||a-b|| / ||a||"):
            table.add_column(col, justify="right" if "|" in col else "left")
        for t in report.tensors:
            if t.problem:
                table.add_row(escape(t.path), t.dtype, escape(str(t.shape)),
                              f"[red]{t.problem} differs[/]", escape(f"B: {t.other}"))
            else:
                table.add_row(escape(t.path), t.dtype, escape(str(t.shape)), number(t.max_abs_diff), number(t.rel_norm))
        con.print(table)
    for side, entries in (("A", report.only_in_a), ("B", report.only_in_b)):
        for e in entries:
            con.print(escape(f"only in {side}: {e['path']} ({e['what']})"))
    for v in report.values:
        con.print(escape(f"value {v['path']}: {_short(v['a'])} -> {_short(v['b'])}"))
    for c in report.environment:
        note = "" if c["severity"] == "significant" else "  (info, not counted)"
        con.print(escape(f"environment {c['field']}: {_short(c['a'])} -> {_short(c['b'])}") + f"[dim]{note}[/]")
    con.print("[bold green]identical[/]" if report.identical else "[bold red]differ[/]")


@app.command()
def diff(a: str = typer.Argument(..., metavar="A", help="A checkpoint (folder or URL)."),
         b: str = typer.Argument(..., metavar="B", help="Another checkpoint."),
         json_: bool = JSON_OPTION) -> None:
    """Compare two checkpoints: tensors, values, step, metrics, environment.

    Exit 0 if identical, 1 if they differ, 2 on an error (like diff(1))."""
    try:
        report, ma, mb = diff_checkpoints(a, b)
    except (UnbrokenError, OSError) as e:
        fail(escape(f"{type(e).__name__}: {e}"), code=2)
    if json_:
        emit_json({"a": a, "b": b, "identical": report.identical, "identical_tensors": report.identical_tensors,
                   "tensors": [asdict(t) for t in report.tensors], "only_in_a": report.only_in_a,
                   "only_in_b": report.only_in_b, "values": report.values,
                   "manifest": _present(report.manifest), "environment": _present(report.environment)})
    else:
        _print(report, a, b, ma, mb)
    raise typer.Exit(0 if report.identical else 1)
