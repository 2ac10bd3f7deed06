"""``unbroken events``, ``metrics`` and ``plot``: a run's history, from its index.

They read ``<run>/index.sqlite`` read-only, creating nothing beside it (so a run folder nobody
may write works too: :mod:`unbroken.run.index.indexfile`). A folder that is not an unbroken run is
refused before anything is opened, so nothing is created in it; a run whose index is
missing or damaged is shown from an index rebuilt in memory (checkpoints only: no
metrics, no history), with a warning.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint.targets import check_target
from ..run.index.continuity import CONTINUOUS, NOT_CHECKED, Continuity
from ..run.index.index import RunIndex
from ..run.index.plotting import MISSING, available, made_here, plot_run
from .base import JSON_OPTION, app, emit_json, fail, open_location, out, plural, require_run, warn, when

MESSAGE_CHARS = 100
"""Characters of an event's message shown in the table (``--json`` has it whole)."""


def open_index(run: str) -> RunIndex:
    """The run's index, read-only; exit 1 if ``run`` is not an unbroken run."""
    store = open_location(run)
    require_run(store, run)
    index = RunIndex(store, readonly=True)
    if index.in_memory:
        warn("no readable index.sqlite: showing one rebuilt in memory from the manifests (checkpoints only: "
             "no metrics, no history); the next Checkpointer on this run writes a new one")
    return index


def _unknown_metric(name: str, known: list[str]) -> str:
    if not known:
        return escape(f"no metric was logged in this run (pass them to ckpt.step(state, {name}=...))")
    return escape(f"metric {name!r} was never logged in this run; logged: {', '.join(known)}")


@app.command()
def events(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
           kind: str | None = typer.Option(None, "--kind", metavar="KIND",
                                           help="Only events of this kind (saved, resumed, preempted, ...)."),
           json_: bool = JSON_OPTION) -> None:
    """The run's event log: starts, resumes, saves, emergency saves, preemptions, corruption, pruning."""
    with open_index(run) as index:
        rows = index.events(kind)
        kinds = sorted({e["kind"] for e in index.events()}) if kind and not rows else []
    if json_:
        emit_json({"run": run, "rebuilt": index.in_memory, "events": rows})
        return
    table = Table()
    for col in ("time", "segment", "kind", "step", "checkpoint", "message"):
        table.add_column(col)
    for e in rows:
        message = e["message"] or ""
        message = message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 3] + "..."
        table.add_row(when(e["time"]), "" if e["segment"] is None else str(e["segment"]), escape(e["kind"]),
                      "" if e["step"] is None else str(e["step"]), escape(e["checkpoint"] or ""), escape(message))
    out().print(table)
    if kind and not rows:
        warn(escape(f"no {kind!r} events; kinds in this run: {', '.join(kinds) or '-'}"))


def _report_check(name: str, report: Continuity, resumes: int, json_: bool, run: str) -> bool:
    """Print a continuity report (:meth:`RunIndex.continuity`); whether it proves continuity: at
    least one re-run step compared, every one equal, no row missing. ``ok`` is never said (nor
    ``"ok": true``) after comparing 0 steps: the verdict is then ``not checked``."""
    missing = list(getattr(report, "missing", []))
    proven = report.verdict == CONTINUOUS
    if json_:
        emit_json({"run": run, "name": name, "ok": proven, "verdict": report.verdict, "compared": len(report.checked),
                   "checked": report.checked, "disagreeing": report.disagreeing, "missing": missing,
                   "values": {str(s): [{"segment": g, "value": v} for g, v in pairs]
                              for s, pairs in report.values.items()}, "resumes": resumes})
        return proven
    con = out()
    for step in report.disagreeing:
        con.print(f"[red]step {step}[/]: " + escape(", ".join(f"segment {g}: {v!r}" for g, v in report.values[step])))
    if missing:
        con.print(f"[red]{plural(len(missing), 'step')} missing[/] (saved with a checkpoint, absent from the index): "
                  + ", ".join(map(str, missing)))
    compared = len(report.checked)
    if compared:
        con.print(escape(f"{name}: {plural(compared, 're-run step')} compared, {len(report.disagreeing)} differ"))
    elif resumes:
        times = "once" if resumes == 1 else f"{resumes} times"
        con.print(f"[yellow]{escape(name)}: 0 steps compared: the run was resumed {times}, but no step "
                  "was logged by more than one segment (each resume started after the last logged step), so "
                  "continuity could not be checked[/]")
    else:
        con.print(f"[yellow]{escape(name)}: 0 steps compared: the run was never resumed[/]")
    con.print({CONTINUOUS: "[green]ok[/]", NOT_CHECKED: "[yellow]not checked[/]"}.get(report.verdict,
                                                                                    "[red]not continuous[/]"))
    return proven


@app.command()
def metrics(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
            name: str | None = typer.Argument(None, metavar="[NAME]", help="Metric name, e.g. loss; without it, "
                                              "the names of the run's metrics."),
            check: bool = typer.Option(False, "--check", help="Exit 1 unless the steps re-run after a resume logged "
                                       "bitwise identical values (and no saved row is missing); also when no step "
                                       "could be compared (not checked)."),
            json_: bool = JSON_OPTION) -> None:
    """Print a metric per step (step, value, segment); --check proves resume continuity. Without NAME: the
    names of the metrics the run logged, one per line."""
    with open_index(run) as index:
        if name is None:
            if check:
                fail("--check needs a metric NAME (`unbroken metrics RUN` lists them)")
            names = index.metric_names()
            if json_:
                emit_json({"run": run, "names": names})
            else:
                for n in names:
                    typer.echo(n)
            return
        values = index.metric(name)
        if not values:
            fail(_unknown_metric(name, index.metric_names()))
        if check:
            resumes = sum(1 for s in index.segments() if s["resumed_from"])
            ok = _report_check(name, index.continuity(name), resumes, json_, run)
            raise typer.Exit(0 if ok else 1)
    if json_:
        emit_json({"run": run, "name": name, "values": [{"step": s, "value": v, "segment": g} for s, v, g in values]})
        return
    for step, value, segment in values:  # tab-separated, exact (repr), for other tools: not through rich
        typer.echo(f"{step}\t{value!r}\t{segment}")


@app.command()
def plot(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
         output: Path | None = typer.Option(None, "--output", "-o", metavar="FILE.png",
                                            help="Where to write the PNG (default: ./<run>-<metric>.png)."),
         metric: str | None = typer.Option(None, "--metric", metavar="NAME", help="The metric to draw "
                                           "(default: loss if logged, else the first in alphabetical order)."),
         force: bool = typer.Option(False, "--force", help="Replace an existing FILE.png that unbroken did "
                                    "not draw.")) -> None:
    """Draw a metric over steps as a PNG: one colour per run segment, saves, interruptions, resumes.

    An existing FILE.png is replaced only if unbroken drew it (or with --force); never one inside a
    checkpoint or a run's folders, and a link there is replaced, not written through."""
    if not available():
        fail(escape(MISSING))
    with open_index(run) as index:
        known = index.metric_names()
        chosen = metric or ("loss" if "loss" in known else known[0] if known else "loss")
        if chosen not in known:
            fail(_unknown_metric(chosen, known))
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", f"{Path(index.store.url).name or 'run'}-{chosen}")
        target = output or Path(f"{stem}.png")
        check_target(target, force=force or made_here(target), folder=False, tool="plot", option="-o")
        png = plot_run(index, chosen, target, title=f"{chosen}: {index.store.url}")
    typer.echo(str(png))
