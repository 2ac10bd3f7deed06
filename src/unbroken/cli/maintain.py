"""``unbroken prune`` and ``unbroken tag``: change a run, the way a Checkpointer would.

Both become the run's writer first (:meth:`unbroken.run.run.Run.begin`: the run's lock or
lease), so they are refused while a training process writes the run. Deleting goes
through :meth:`Run.prune` (the store's crash-safe deletion: renamed away first, then
removed; ``pruned`` recorded in the run index); tagging through
:meth:`Checkpointer.tag` (``tags.json``, replaced atomically; ``tagged`` in the index).
Becoming the writer uses the same machinery as training (:class:`~unbroken.run.run.Run`), which
imports torch; ``prune --dry-run`` only reads manifests and does not.
"""

from __future__ import annotations

import re
from typing import Any, cast

import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint.discovery import discover
from ..checkpoint.tags import check_tag
from ..errors import RunLockedError
from ..events import EventBus
from ..policies import CheckpointMeta, KeepBest, KeepLast, KeepTagged, Mode, Retention, Union
from ..run.scheduling import Schedule
from .base import (
    JSON_OPTION,
    app,
    emit_json,
    fail,
    metrics_text,
    open_checkpoint,
    open_location,
    options_for,
    out,
    plural,
    require_run,
)


def parse_best(spec: str) -> tuple[str, int]:
    """``"val_loss:2"`` -> ``("val_loss", 2)``; ``"val_loss"`` -> ``("val_loss", 1)``."""
    metric, sep, n = spec.rpartition(":")
    if not sep:
        return spec, 1
    if not metric or not n.isdigit() or int(n) < 1:
        raise typer.BadParameter(f"expected METRIC or METRIC:N with N >= 1, got {spec!r}", param_hint="--keep-best")
    return metric, int(n)


def _locked(what: str, run: str, e: RunLockedError) -> str:
    """Why ``what`` is refused, and what to do; names the writer when the lock says who it is."""
    holder = re.search(r"\((host [^)]*)\)", str(e))
    who = f"another process ({holder.group(1)})" if holder else f"another process ({e})"
    return escape(f"cannot {what} {run}: it is being written by {who}") + \
        "\n[yellow]wait until that process exits (its lock is released then), and run the command again[/]"


def why_kept(rules: list[tuple[str, Retention]], infos: list[Any]) -> dict[str, list[str]]:
    """For each checkpoint, the rules that keep it (``newest``, ``last 3``, ``tagged``...)."""
    metas = [CheckpointMeta.of(c) for c in infos]
    reasons: dict[str, list[str]] = {m.name: [] for m in metas}
    for label, rule in [*rules, ("tagged", KeepTagged())]:
        for name in rule.keep(metas):
            reasons[name].append(label)
    if metas:
        reasons[max(metas, key=lambda m: (m.seq, m.step)).name].insert(0, "newest")
    return reasons


@app.command()
def prune(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
          keep_last: int = typer.Option(..., "--keep-last", metavar="K", min=1,
                                        help="Keep the K most recently committed checkpoints."),
          keep_best: str | None = typer.Option(None, "--keep-best", metavar="METRIC[:N]",
                                               help="Also keep the N (default 1) best by this metric of the "
                                                    "manifests, e.g. val_loss:2."),
          best_mode: str = typer.Option("min", "--best-mode", metavar="min|max",
                                        help="Whether lower (min) or higher (max) values of --keep-best are better."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be deleted; delete nothing (and "
                                       "take no lock)."),
          json_: bool = JSON_OPTION) -> None:
    """Delete the checkpoints retention does not keep. Tagged ones and the newest are always kept.

    Refused (exit 1) while a training process writes the run."""
    if best_mode not in ("min", "max"):
        raise typer.BadParameter(f"expected min or max, got {best_mode!r}", param_hint="--best-mode")
    rules: list[tuple[str, Retention]] = [(f"last {keep_last}", KeepLast(keep_last))]
    if keep_best is not None:
        metric, n = parse_best(keep_best)
        rules.append((f"best {n} {metric} ({best_mode})", KeepBest(n, metric, cast(Mode, best_mode))))
    store = open_location(run)
    require_run(store, run)
    schedule = Schedule(None, None, None, Union(*(rule for _, rule in rules)))  # + tagged ones, as in training
    infos = discover(store)
    doomed = schedule.doomed(infos, {c.name: set(c.tags) for c in infos})
    if not dry_run:
        doomed = _delete(run, schedule)
    reasons = why_kept(rules, infos)
    if json_:
        emit_json({"run": store.url, "dry_run": dry_run, "delete": doomed,
                   "keep": [{"name": c.name, "step": c.step, "reasons": reasons[c.name]}
                            for c in infos if c.name not in doomed]})
        return
    table = Table(title=store.url)
    for col in ("name", "step", "metrics", "tags", "decision", "why kept"):
        table.add_column(col)
    gone = "would delete" if dry_run else "deleted"
    for c in infos:
        decision = f"[red]{gone}[/]" if c.name in doomed else "[green]keep[/]"
        table.add_row(*map(escape, (c.name, str(c.step), metrics_text(c.metrics), ", ".join(c.tags))), decision,
                      escape(", ".join(reasons.get(c.name, []))))
    out().print(table)
    of = f"{len(doomed)} of {plural(len(infos), 'checkpoint')}"
    out().print(f"dry run: would delete {of}; nothing was deleted" if dry_run else f"deleted {of}")


def _delete(run: str, schedule: Schedule) -> list[str]:
    """Apply ``schedule``'s retention as the run's writer; the names deleted."""
    from ..run.index.recorder import Recorder
    from ..run.run import Run  # the writer's machinery: imports torch

    bus = EventBus()
    writer = Run(run, storage_options=options_for(run), publish=bus.publish)
    try:
        writer.begin()
    except RunLockedError as e:
        fail(_locked("prune", run, e))
    if writer.readonly:  # nothing can be deleted: Run.prune raises ReadOnlyRunError, naming the folder
        try:
            return writer.prune(schedule, None)
        finally:
            writer.close()
    recorder = Recorder(writer.store)  # records "pruned" in the run index, as during training
    bus.subscribe(recorder)
    try:
        return writer.prune(schedule, None)
    finally:
        bus.unsubscribe(recorder)
        recorder.close()
        writer.close()


@app.command()
def tag(checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="A checkpoint folder (or URL) inside "
                                         "a run, e.g. runs/exp1/step-000000500."),
        name: str = typer.Argument(..., metavar="TAG", help="Letters, digits and . _ + - (at most 100)."),
        json_: bool = JSON_OPTION) -> None:
    """Tag a checkpoint: retention never deletes it, and restore(state, tag=TAG) finds it.

    A tag names one checkpoint: tagging another one moves it. Refused (exit 1) while a
    training process writes the run."""
    try:
        check_tag(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="TAG") from None
    storage, ckpt_name = open_checkpoint(checkpoint)
    if ckpt_name not in {c.name for c in discover(storage)}:
        fail(escape(f"{checkpoint} is not a committed checkpoint with a readable manifest; "
                    f"`unbroken ls {storage.url}` lists those of its run"))
    from ..checkpointer.manager import Checkpointer  # imports torch

    writer = Checkpointer(storage.url, keep_last=None, preemption=None, storage_options=options_for(storage.url))
    try:
        writer.tag(name, ckpt_name)
    except RunLockedError as e:
        fail(_locked("tag a checkpoint of", storage.url, e))
    finally:
        writer.close()
    if json_:
        emit_json({"run": storage.url, "checkpoint": ckpt_name, "tag": name})
    else:
        out().print(escape(f"tagged {checkpoint} as {name}"))
