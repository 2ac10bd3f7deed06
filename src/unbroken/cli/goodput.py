"""``unbroken goodput``: where a run's time went (productive steps, steps redone, restarts, saves), from
its index (:mod:`unbroken.run.index.goodput`), as a table, JSON or a picture. Reads the index read-only,
as ``events`` and ``metrics`` do (:mod:`.runlog`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint.targets import check_target
from ..run.index.goodput import Goodput, SegmentTime, compute
from ..run.index.plotting import MISSING, available, made_here
from .base import JSON_OPTION, app, emit_json, err, fail, out
from .runlog import open_index

UNKNOWN = "?"
"""What the table shows for an unknown value (``null`` in ``--json``)."""


def seconds(x: float | None) -> str:
    """A duration for people: ``0.42 s``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``; ``?`` if unknown."""
    if x is None:
        return UNKNOWN
    if x < 10:
        return f"{x:.2f} s"
    if x < 60:
        return f"{x:.1f} s"
    if x < 3600:
        return f"{int(x // 60)} min {int(x % 60):02d} s"
    return f"{int(x // 3600)} h {int(x % 3600 // 60):02d} min"


def _share(part: float | None, whole: float | None) -> str:
    return "" if part is None or not whole else f" ({100 * part / whole:.0f}%)"


def _steps(s: SegmentTime) -> str:
    last = UNKNOWN if s.last_step is None else str(s.last_step)
    return f"{s.start_step} → {last}"


def _redone(steps: int | None, secs: float | None, estimated: bool = False) -> str:
    if steps is None:
        return UNKNOWN
    return f"{steps} ({seconds(secs)}{' est.' if estimated else ''})" if steps else "0"


def _saves(n: int | None, blocked: float | None) -> str:
    return f"{UNKNOWN if n is None else n} ({seconds(blocked)})"


def _ratio(productive: float | None, wall: float | None) -> str:
    return UNKNOWN if productive is None or not wall else f"{productive / wall:.3f}"


def print_table(g: Goodput, run: str) -> None:
    """The human report: one row per segment, a total row, the ratio in words and what is unknown."""
    con = out()
    if not g.segments:
        con.print(escape(f"{run}: no segment recorded (the index was rebuilt from the manifests): nothing to report"))
        return
    table = Table(title=escape(f"goodput of {run}"), title_justify="left")
    for col in ("segment", "steps", "how it ended", "restart before", "time", "saves (blocked)", "steps redone (time)",
                "productive", "ratio"):
        table.add_column(col, justify="left" if col in ("segment", "steps", "how it ended") else "right")
    for s in g.segments:
        restart = "" if s.restart_s is None else seconds(s.restart_s) + (
            f" (startup {seconds(s.startup_s)})" if s.startup_s is not None else "")
        table.add_row(str(s.id), _steps(s), escape(s.how), restart, seconds(s.active_s), _saves(s.saves, s.blocked_s),
                      _redone(s.redone_steps, s.redone_s, s.redone_estimated), seconds(s.productive_s),
                      _ratio(s.productive_s, s.active_s))
    table.add_section()
    table.add_row("total", UNKNOWN if g.steps is None else f"{g.steps} steps", f"{g.restarts} restart(s)",
                  seconds(g.restart_s), seconds(g.wall_s), _saves(g.saves, g.blocked_s),
                  _redone(g.redone_steps, g.redone_s), seconds(g.productive_s), _ratio(g.productive_s, g.wall_s))
    con.print(table)
    if g.ratio is not None:
        con.print(f"effective training time ratio: [bold]{g.ratio:.3f}[/] (productive {seconds(g.productive_s)} of "
                  f"{seconds(g.wall_s)} wall: redone {seconds(g.redone_s)}{_share(g.redone_s, g.wall_s)}, restarts "
                  f"{seconds(g.restart_s)}{_share(g.restart_s, g.wall_s)}, blocked by saves "
                  f"{seconds(g.blocked_s)}{_share(g.blocked_s, g.wall_s)})")
    else:
        con.print(f"effective training time ratio: {UNKNOWN} (wall {seconds(g.wall_s)}, restarts "
                  f"{seconds(g.restart_s)})")
    for name, why in g.unknown.items():
        err().print(f"[yellow]{escape(name)} unknown: {escape(why)}[/]")


@app.command()
def goodput(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
            json_: bool = JSON_OPTION,
            plot: Path | None = typer.Option(None, "--plot", metavar="FILE.png",
                                             help="Also draw the run's time line and shares as a PNG."),
            force: bool = typer.Option(False, "--force", help="Replace an existing FILE.png that unbroken did not "
                                       "draw.")) -> None:
    """Where the run's time went: productive steps, steps redone, restarts, time blocked by saves, and the
    effective training time ratio (productive / wall), per segment and in total. Unknown parts (a run
    recorded by an older unbroken) are shown as ? (null in --json), never as 0."""
    if plot is not None:
        if not available():
            fail(escape(MISSING))
        check_target(plot, force=force or made_here(plot), folder=False, tool="goodput", option="--plot")
    with open_index(run) as index:
        report = compute(index)
        url = index.store.url
    if json_:
        emit_json({"run": run, **report.as_json()})
    else:
        print_table(report, run)
    if plot is not None:
        from ..run.index.goodplot import plot_goodput

        png = plot_goodput(report, plot, title=f"goodput: {url}")
        (err() if json_ else out()).print(escape(str(png)))
