"""``unbroken ls`` and ``unbroken verify``: what a run holds, and whether it is intact.

``ls`` reads manifests only, unless ``--verify``; every checkpoint folder is shown, the
broken ones too, each with a status:

- ``committed``: the manifest is readable (checksums not verified); ``valid`` / ``corrupt``
  with ``--verify`` (every file of every rank verified through the reader);
- ``corrupt``: a committed folder whose manifest is missing, unreadable or invalid;
- ``quarantined``: moved to ``quarantine/`` by a restore that found it invalid;
- ``uncommitted``: an unfinished save (in progress, or left by a killed writer; the next
  writer removes those of dead processes);
- ``remote-only``: with ``--remote``, a checkpoint only the remote tier has;
- ``pruned``: with ``--verify``, listed but deleted (or moved) while it was being verified, by
  the retention of the process that writes the run: not damaged.

Both commands only read, so they work on a read-only run folder, and beside a training process
that writes (and prunes) the run. ``ls`` reads manifests only and never imports torch; ``--verify``,
``--remote`` and ``verify`` read checkpoints through the library's reader, which does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from .._support import progress
from ..checkpoint.discovery import discover
from ..checkpoint.manifests import read_manifest, vanished
from ..errors import CheckpointVanishedError, UnbrokenError
from ..store import is_url
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
    size,
    when,
)

NARROW_DROPS = ("epoch", "size", "tiers", "tags", "saved", "metrics")
"""The ``ls`` columns left out, in this order, while the table is wider than the terminal."""
STYLES = {"valid": "green", "committed": "", "corrupt": "red", "quarantined": "yellow", "uncommitted": "dim",
          "remote-only": "cyan", "pruned": "dim"}
PRUNED = "deleted or moved while it was being verified (pruned by the run's retention?); not damaged"


@dataclass
class Row:
    """One line of ``unbroken ls`` (and of its ``--json`` ``checkpoints`` list)."""

    name: str
    status: str
    path: str = ""
    reason: str = ""
    newest: bool = False
    step: int | None = None
    epoch: int | None = None
    seq: int | None = None
    created: float | None = None
    size_bytes: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)


def check(store: Any, name: str) -> tuple[str, str]:
    """Verify every file of checkpoint ``name``: ``("valid", "")``, ``("corrupt", reason)``, or
    ``("pruned", reason)`` if it was deleted while being read (not damaged)."""
    from ..checkpoint.reader import verify_all  # decodes the state trees: imports torch

    try:
        verify_all(store, name)
    except CheckpointVanishedError:
        return "pruned", PRUNED
    except (UnbrokenError, OSError) as e:
        if vanished(store, name):
            return "pruned", PRUNED
        return "corrupt", str(e).removeprefix(f"{store.describe(name)}: ")  # the caller names the checkpoint
    return "valid", ""


def committed_rows(store: Any, remote: str | None) -> list[Row]:
    """Committed checkpoints, newest first (across both tiers with ``remote``), then those
    whose manifest cannot be read."""
    if remote:
        from ..run.run import Run
        from ..tiers.remote import Remote

        infos = Run(store, remote=Remote(remote, storage_options=options_for(remote))).checkpoints()
    else:
        infos = discover(store)
    rows = [Row(c.name, "remote-only" if c.tiers == ("remote",) else "committed", c.path, newest=i == 0,
                step=c.step, epoch=c.progress.get("epoch"), seq=c.seq, created=c.created, size_bytes=c.size_bytes,
                metrics=c.metrics, tags=list(c.tags), tiers=list(c.tiers)) for i, c in enumerate(infos)]
    readable = {c.name for c in infos if c.tiers != ("remote",)}
    for name in store.list_committed():
        if name not in readable:
            try:
                read_manifest(store, name)
                reason = "the manifest became readable while listing; run ls again"
            except (UnbrokenError, OSError) as e:
                if vanished(store, name):
                    continue  # deleted since it was listed (pruned): not a checkpoint any more
                reason = str(e)
            rows.append(Row(name, "corrupt", store.describe(name), reason))
    return rows


def quarantined_rows(store: Any) -> list[Row]:
    """Checkpoints in ``quarantine/``, with the reason written next to each."""
    q = store.quarantined()
    rows = []
    for name in q.list_committed() if q is not None else []:
        try:
            reason = (q.read_meta(f"{name}.reason.txt") or b"").decode("utf-8", "replace").strip()
        except (UnbrokenError, OSError, ValueError) as e:
            reason = f"(reason file unreadable: {e})"
        row = Row(name, "quarantined", q.describe(name), reason)
        try:
            m = read_manifest(q, name)
            row.step, row.seq, row.created, row.size_bytes = m.step, m.seq, m.created, m.total_bytes
            row.epoch, row.metrics, row.tags = m.progress.get("epoch"), m.metrics, list(m.tags)
        except (UnbrokenError, OSError):
            pass  # the reason says why
        rows.append(row)
    return rows


def gather(store: Any, remote: str | None = None, verify: bool = False) -> list[Row]:
    """Every row of ``unbroken ls`` for ``store``."""
    rows = committed_rows(store, remote)
    todo = [r for r in rows if r.status == "committed"] if verify else []
    with progress.task(f"verifying {plural(len(todo), 'checkpoint')}", sum(r.size_bytes or 0 for r in todo)):
        for row in todo:
            row.status, row.reason = check(store, row.name)
    rows += [Row(n, "uncommitted", reason="unfinished save (in progress, or left by a killed writer)")
             for n in store.list_uncommitted()]
    return rows + quarantined_rows(store)


def _print_rows(title: str, rows: list[Row], tiers: bool) -> None:
    """The ``ls`` table, then why each broken or unfinished checkpoint is what it is (one line each,
    out of the table's width). Columns without any value are left out; on a terminal too narrow for
    the table, the least useful columns are (:data:`NARROW_DROPS`), so names and statuses stay whole."""
    cells: dict[str, list[str]] = {
        "": ["*" if r.newest else "" for r in rows], "name": [r.name for r in rows],
        "step": ["" if r.step is None else str(r.step) for r in rows],
        "epoch": ["" if r.epoch is None else str(r.epoch) for r in rows],
        "saved": [when(r.created) for r in rows], "size": [size(r.size_bytes) for r in rows],
        "metrics": [metrics_text(r.metrics) for r in rows], "tags": [", ".join(r.tags) for r in rows],
        "tiers": [",".join(r.tiers) for r in rows] if tiers else [], "status": [r.status for r in rows]}
    shown = {col: values for col, values in cells.items() if any(values)}
    con = out()
    hidden = [col for col in NARROW_DROPS if col in shown and _width(shown) > con.width and shown.pop(col)]
    table = Table(title=title, caption="* newest" if shown.get("") else None)
    for col in shown:
        table.add_column(col, justify="right" if col in ("step", "epoch", "size") else "left", overflow="fold")
    for i, r in enumerate(rows):
        style = STYLES.get(r.status, "")
        table.add_row(*(f"[{style}]{r.status}[/]" if col == "status" and style else escape(values[i])
                        for col, values in shown.items()))
    con.print(table)
    if hidden:
        con.print(f"[dim]not shown, the terminal is too narrow: {', '.join(hidden)} (or see --json)[/]")
    for r in rows:
        if r.reason:
            con.print(f"[{STYLES[r.status] or 'default'}]{escape(r.name)}[/] ({r.status}): {escape(r.reason)}")


def _width(columns: dict[str, list[str]]) -> int:
    """The width of a table of ``columns`` that wraps nothing (rich's default box and padding)."""
    return 1 + sum(3 + max(len(col), *map(len, values)) for col, values in columns.items())


@app.command("ls")
def ls(run: str = typer.Argument(..., metavar="RUN", help="Run folder or URL."),
       verify: bool = typer.Option(False, "--verify", help="Verify every checksum (reads every byte) instead of "
                                   "trusting the manifests: statuses become valid or corrupt (remote-only "
                                   "checkpoints are not downloaded for this)."),
       remote: str | None = typer.Option(None, "--remote", metavar="URL", help="The run's remote tier (tiered "
                                         "runs): also list the checkpoints only it has."),
       json_: bool = JSON_OPTION) -> None:
    """List a run's checkpoints, newest first, with broken, quarantined and unfinished ones.

    Exit 1 if the folder holds no checkpoint at all, or a corrupt one was found (one pruned while
    --verify read it is not corrupt)."""
    store = open_location(run)
    rows = gather(store, remote, verify)
    if json_:
        emit_json({"run": store.url, "remote": remote, "verified": verify, "checkpoints": [asdict(r) for r in rows]})
    elif rows:
        _print_rows(store.url, rows, remote is not None)
    if not rows:
        fail(no_checkpoints(run))
    if any(r.status == "corrupt" for r in rows):
        raise typer.Exit(1)


app.command("list", hidden=True, help="Same as ls (kept for scripts).")(ls)


def _targets(path: str) -> tuple[Any, list[str], bool]:
    """``(store, checkpoint names, single)``: ``path`` is one checkpoint (its parent run's store
    and its name; a damaged one too) or a run (its store and every committed checkpoint)."""
    try:
        parent, name = open_checkpoint(path)
        if name in parent.list_committed():
            return parent, [name], True
    except UnbrokenError:
        pass  # a URL without a parent (s3://bucket): a run
    store = open_location(path)
    return store, store.list_committed(), False


def no_checkpoints(location: str) -> str:
    """The message for a location without checkpoints."""
    missing = not is_url(location) and not Path(location).exists()
    return f"no checkpoints in {escape(location)}: " + ("no such folder" if missing else
                                                       "not an unbroken run, or nothing was saved yet")


def _manifest_bytes(store: Any, name: str) -> int:
    try:
        return read_manifest(store, name).total_bytes
    except (UnbrokenError, OSError):
        return 0


@app.command()
def verify(path: str = typer.Argument(..., metavar="PATH", help="A checkpoint, or a run to verify every "
                                      "committed checkpoint of (folder or URL)."),
           json_: bool = JSON_OPTION) -> None:
    """Verify checksums, tensor headers and state trees of every rank; exit 1 if anything is wrong.

    A checkpoint deleted while it is read (pruned by a training process writing the run) is
    reported as pruned, not bad; verifying one checkpoint that is pruned meanwhile exits 1.

    A progress bar (bytes) shows on a terminal for runs of 512 MB or more (UNBROKEN_PROGRESS=1:
    always, =0: never)."""
    store, names, single = _targets(path)
    if not names:
        if json_:
            emit_json({"path": path, "ok": False, "checkpoints": []})
        fail(no_checkpoints(path))
    results = []
    total = sum(_manifest_bytes(store, n) for n in names)
    with progress.task(f"verifying {names[0] if single else f'{len(names)} checkpoints'}", total):
        for name in names:
            status, reason = check(store, name)
            results.append({"name": name, "path": store.describe(name), "ok": status == "valid",
                            "pruned": status == "pruned", "error": reason if status == "corrupt" else None})
            if not json_:
                line = {"valid": "[green]ok[/]  ", "corrupt": "[red]BAD[/] ", "pruned": "[dim]gone[/]"}[status]
                out().print(line + escape(store.describe(name) + (f": {reason}" if reason else "")))
    pruned = sum(r["pruned"] for r in results)
    bad = sum(not r["ok"] for r in results) - pruned
    if json_:
        emit_json({"path": path, "ok": not bad and not (single and pruned), "checkpoints": results})
    elif not single:
        out().print(f"{len(results) - bad - pruned} of {plural(len(results), 'checkpoint')} verified"
                    + (f", [red]{bad} bad[/]" if bad else "") + (f", {pruned} pruned meanwhile" if pruned else ""))
    raise typer.Exit(1 if bad or (single and pruned) else 0)
