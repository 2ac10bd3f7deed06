"""``unbroken diff``: what differs between two checkpoints, like ``diff(1)`` for state.

The comparison is :mod:`.statediff` (tensors, values, RNG streams, manifests, environments;
imported when the command runs: it needs torch); this module prints it, as text or JSON.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import UnbrokenError
from .base import JSON_OPTION, app, emit_json, fail, number, out

if TYPE_CHECKING:
    from ..format.manifest import Manifest
    from .statediff import Report

SHOWN = 80
"""Characters of a value shown in the text output (JSON has them whole)."""


def _short(x: Any) -> str:
    from ..checkpointer.environment import MISSING  # a field one side does not have (loaded with the comparison)

    text = "(absent)" if x is MISSING else number(x) if isinstance(x, float) else repr(x)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def _present(changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``changes`` for JSON: a side without the field as ``null``."""
    from ..checkpointer.environment import MISSING

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
    if report.rng or report.identical_rng:
        apart = sum(not r.counted for r in report.rng)
        con.print(f"rng streams: {report.identical_rng} identical, {len(report.rng) - apart} differ"
                  + (f", {apart} never drawn from (not counted)" if apart else ""))
    for r in report.rng:
        con.print(_rng_line(r))
    for c in report.environment:
        note = "" if c["severity"] == "significant" else "  (info, not counted)"
        con.print(escape(f"environment {c['field']}: {_short(c['a'])} -> {_short(c['b'])}") + f"[dim]{note}[/]")
    con.print("[bold green]identical[/]" if report.identical else "[bold red]differ[/]")


def _rng_line(r: Any) -> str:
    """One RNG stream that is not the same on both sides (an :class:`~.rngdiff.RngDiff`)."""
    from .rngdiff import ABSENT

    if ABSENT in (r.a, r.b):
        present = r.b if r.a == ABSENT else r.a
        text = f"rng {r.path}: only in {'B' if r.a == ABSENT else 'A'}" + (f" ({present})" if present else "")
    else:
        text = f"rng {r.path}: differs" + (f" (A: {r.a or '?'}, B: {r.b or '?'})" if r.a or r.b else "")
    return escape(text) + ("" if r.counted else "[dim]  (never drawn from: not counted)[/]")


@app.command()
def diff(a: str = typer.Argument(..., metavar="A", help="A checkpoint (folder or URL)."),
         b: str = typer.Argument(..., metavar="B", help="Another checkpoint."),
         json_: bool = JSON_OPTION) -> None:
    """Compare two checkpoints: tensors, values, RNG streams, step, metrics, environment.

    RNG streams nothing drew from (unseeded ones differ in every process) are shown apart and
    not counted. Exit 0 if identical, 1 if they differ, 2 on an error (like diff(1))."""
    from .statediff import diff_checkpoints  # torch

    try:
        report, ma, mb = diff_checkpoints(a, b)
    except (UnbrokenError, OSError) as e:
        fail(escape(f"{type(e).__name__}: {e}"), code=2)
    if json_:
        emit_json({"a": a, "b": b, "identical": report.identical, "identical_tensors": report.identical_tensors,
                   "tensors": [asdict(t) for t in report.tensors], "only_in_a": report.only_in_a,
                   "only_in_b": report.only_in_b, "values": report.values,
                   "identical_rng": report.identical_rng, "rng": [asdict(r) for r in report.rng],
                   "manifest": _present(report.manifest), "environment": _present(report.environment)})
    else:
        _print(report, a, b, ma, mb)
    raise typer.Exit(0 if report.identical else 1)
