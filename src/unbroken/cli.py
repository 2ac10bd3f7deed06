"""The ``unbroken`` command line: demo, list, verify, inspect, events, metrics."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Checkpoints that survive anything, and resume bitwise identically.")
console = Console()
_options: dict[str, object] = {}


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"unbroken {__version__}")
        raise typer.Exit()


@app.callback()
def _main(option: list[str] = typer.Option([], "--option", "-o", metavar="KEY=VALUE",
                                            help="A storage option for URL locations, e.g. -o endpoint_url=http://"
                                                 "127.0.0.1:8333 -o anon=true (repeatable). Credentials also come "
                                                 "from the backend's environment variables (AWS_*)."),
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print unbroken's version and exit.")) -> None:
    """Checkpoints that survive anything, and resume bitwise identically."""
    for item in option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--option")
        _options[key] = {"true": True, "false": False}.get(value.lower(), value)


def _store(location: str):
    """The store of a run location (path or URL), or exit 1 with a clear message."""
    from .errors import StorageError
    from .store import open_store

    try:
        store = open_store(location, _options or None, readonly=True)
        store.check()
        return store
    except StorageError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)


def _checkpoint(location: str):
    from .errors import StorageError
    from .store import split_checkpoint

    try:
        return split_checkpoint(location, _options or None)
    except StorageError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


@app.command()
def demo(
    workdir: Optional[Path] = typer.Option(None, help="Keep all files in this folder (emptied first)."),
    steps: int = typer.Option(150, help="Training steps."),
    kills: int = typer.Option(3, help="External SIGKILLs at random steps (each followed by one inside a save)."),
    seed: Optional[int] = typer.Option(None, help="Seed for the kill schedule and the data (random if unset)."),
) -> None:
    """Train, kill with SIGKILL at random steps and inside saves, resume, compare bitwise."""
    from .demo import run_demo

    ok = run_demo(str(workdir) if workdir else None, steps=steps, kills=kills, seed=seed)
    raise typer.Exit(0 if ok else 1)


@app.command("list")
def list_(run: str = typer.Argument(..., help="Run folder or URL.")) -> None:
    """List the committed checkpoints of a run, newest first (manifests only, not verified)."""
    from .discovery import discover

    store = _store(run)
    infos = discover(store)
    if not infos:
        console.print(f"no checkpoints in {run}")
        raise typer.Exit(1)
    table = Table()
    for col in ("name", "step", "seq", "saved at", "size", "metrics"):
        table.add_column(col)
    for c in infos:
        when = _dt.datetime.fromtimestamp(c.created).isoformat(sep=" ", timespec="seconds")
        table.add_row(c.name, str(c.step), str(c.seq), when, _size(c.size_bytes), json.dumps(c.metrics))
    console.print(table)
    q = store.quarantined()
    names = q.list_committed() if q is not None else []
    if names:
        console.print(f"quarantined: {', '.join(names)}")


@app.command()
def verify(path: str = typer.Argument(..., help="A checkpoint, or a run to verify all (folder or URL).")) -> None:
    """Verify checksums, headers and the state tree; exit 1 if anything is wrong."""
    from .errors import UnbrokenError
    from .reader import read_checkpoint

    store = _store(path)
    single = (Path(path) / "manifest.json").exists() if not store.remote else False
    if store.remote:
        parent, name = _checkpoint(path)
        single = name in parent.list_committed()
    elif single or not Path(path).is_dir():
        parent, name = _checkpoint(path)
    targets = [(parent, name)] if single or (not store.remote and not Path(path).is_dir()) else \
        [(store, n) for n in store.list_committed()]
    bad = 0
    for where, name in targets:
        try:
            info = read_checkpoint(where, name).manifest
            console.print(f"[green]ok[/]   {where.describe(name)}  step {info.step}, {_size(info.total_bytes)}")
        except (UnbrokenError, OSError) as e:
            bad += 1
            console.print(f"[red]BAD[/]  {where.describe(name)}: {e}")
    if not targets:
        console.print(f"no checkpoints in {path}")
    raise typer.Exit(1 if bad or not targets else 0)


@app.command()
def inspect(path: str = typer.Argument(..., help="A checkpoint (folder or URL).")) -> None:
    """Show a checkpoint's manifest and every tensor (name, dtype, shape) without loading data."""
    from .errors import UnbrokenError
    from .format.tensorfile import parse_header
    from .reader import read_manifest

    storage, name = _checkpoint(path)
    try:
        m = read_manifest(storage, name)
    except UnbrokenError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    console.print(f"[bold]{path}[/]: step {m.step}, seq {m.seq}, format v{m.format_version}, "
                  f"{_size(m.total_bytes)}, saved {_dt.datetime.fromtimestamp(m.created).isoformat(sep=' ')}")
    console.print(f"metrics: {json.dumps(m.metrics)}   progress: {json.dumps(m.progress)}")
    env = m.environment
    console.print("environment: " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "host") if k in env))
    table = Table()
    for col in ("file", "tensor", "dtype", "shape"):
        table.add_column(col)
    for fname, entry in sorted(m.files.items()):
        if not fname.endswith(".safetensors"):
            continue
        try:
            header, _ = parse_header(memoryview(storage.read(name, fname, entry.size)), fname)
        except UnbrokenError as e:
            table.add_row(fname, f"[red]{e}[/]", "", "")
            continue
        for key, info in header.items():
            table.add_row(fname, key, info["dtype"], str(info["shape"]))
    console.print(table)


def _open_index(run: str):
    from .index import RunIndex

    store = _store(run)
    if not store.remote and not Path(store.url).is_dir():
        console.print(f"no run folder {run}")
        raise typer.Exit(1)
    idx = RunIndex(store, readonly=True)
    if idx.in_memory:
        console.print("[yellow]index missing or damaged: showing a rebuild from the manifests (no history)[/]")
    return idx


@app.command()
def events(run: str = typer.Argument(..., help="Run folder or URL."),
           kind: Optional[str] = typer.Option(None, help="Only events of this kind (saved, resumed, ...).")) -> None:
    """The run's event log: starts, resumes, saves, emergency saves, preemptions, corruption, pruning."""
    idx = _open_index(run)
    table = Table()
    for col in ("time", "segment", "kind", "step", "checkpoint", "message"):
        table.add_column(col)
    for e in idx.events(kind):
        when = _dt.datetime.fromtimestamp(e["time"]).isoformat(sep=" ", timespec="seconds")
        table.add_row(when, str(e["segment"]), e["kind"], "" if e["step"] is None else str(e["step"]),
                      e["checkpoint"] or "", (e["message"] or "")[:80])
    console.print(table)
    idx.close()


@app.command()
def metrics(run: str = typer.Argument(..., help="Run folder or URL."),
            name: str = typer.Argument(..., help="Metric name, e.g. loss."),
            check: bool = typer.Option(False, "--check", help="Exit 1 unless steps re-run after a resume "
                                       "logged bitwise identical values.")) -> None:
    """Print a metric per step (with the run segment that logged it); --check proves resume continuity."""
    idx = _open_index(run)
    if check:
        report = idx.continuity(name)
        idx.close()
        for step in report.disagreeing:
            console.print(f"[red]step {step}[/]: " + ", ".join(f"segment {g}: {v!r}" for g, v in report.values[step]))
        console.print(f"{name}: {len(report.checked)} re-run steps checked, {len(report.disagreeing)} differ")
        raise typer.Exit(0 if report.ok else 1)
    for step, value, segment in idx.metric(name):
        console.print(f"{step}\t{value!r}\t{segment}")
    idx.close()


def main() -> None:
    """Entry point of the ``unbroken`` script."""
    from .errors import UnbrokenError

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        app()
    except (UnbrokenError, OSError) as e:  # a library error is a message, not a traceback
        console.print(f"[red]{type(e).__name__}: {e}[/]")
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
