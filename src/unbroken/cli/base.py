"""What every command shares: the app, its global options, output, locations and formatting.

Output rules: tables and messages go through :func:`out` (stdout) and :func:`err` (stderr;
errors and warnings, so that ``--json`` leaves stdout one JSON document). On a terminal
rich uses its width; elsewhere (a pipe, a file) ``COLUMNS`` if set, else a width wide
enough that nothing wraps. A library error (:class:`~unbroken.UnbrokenError`, ``OSError``)
raised by any command becomes one red line and exit status 1 (:class:`_Group`).

Imports: this module and every command module import only typer, rich and torch-free parts of
the library at module level, so that ``--help``, ``--version`` and the commands that read no
tensor start without importing torch; a command that needs it imports it in its body.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import math
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from ..errors import UnbrokenError

WIDE = 1000
"""Console width when stdout is not a terminal and ``COLUMNS`` is unset: tables never wrap."""

_options: dict[str, object] = {}


class _Group(TyperGroup):
    """The command group: a library error in any command is a one-line message and exit 1; a reader
    that went away (``unbroken metrics RUN loss | head``) ends the command quietly; a command that
    reads tensors, where torch is not installed, says so in one line (exit 1)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):  # not a real file (tests)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # not even a last flush reaches it
            raise typer.Exit(1) from None
        except (UnbrokenError, OSError, sqlite3.Error) as e:  # sqlite3: a run index that cannot be read
            err().print(f"[red]{type(e).__name__}: {escape(str(e))}[/]")
            raise typer.Exit(1) from None
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            err().print(f"[red]unbroken {escape(ctx.invoked_subcommand or '')} needs torch (it reads tensors), which "
                        "is not installed here: pip install torch (ls, events, metrics, plot and prune --dry-run "
                        "work without it)[/]")
            raise typer.Exit(1) from None


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: flags without "<bool>" type labels
                  help="Checkpoints that survive anything, and resume bitwise identically.")


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

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
    _options.clear()  # one process may run several commands (tests): options never carry over
    for item in option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--option")
        _options[key] = {"true": True, "false": False}.get(value.lower(), value)


# ----------------------------------------------------------------------- output
def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = bool(getattr(stream, "isatty", lambda: False)())
    width = None if tty or os.environ.get("COLUMNS", "").isdigit() else WIDE
    return Console(stderr=stderr, width=width, highlight=False)


def out() -> Console:
    """A console on stdout, for tables and results."""
    return _console(stderr=False)


def err() -> Console:
    """A console on stderr, for errors, warnings and notes."""
    return _console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` (rich markup) in red on stderr and exit with ``code``."""
    err().print(f"[red]{message}[/]")
    raise typer.Exit(code)


def warn(message: str) -> None:
    """Print ``message`` (rich markup) in yellow on stderr."""
    err().print(f"[yellow]{message}[/]")


def json_safe(x: Any) -> Any:
    """``x`` as strict JSON values: non-finite floats as ``"nan"``/``"inf"``/``"-inf"`` (as in
    manifests), numpy scalars as numbers, tuples and sets as lists, anything else as its string."""
    np = sys.modules.get("numpy")  # numpy scalars exist only if numpy was imported
    if np is not None and isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return [json_safe(v) for v in sorted(x, key=repr)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def emit_json(doc: Any) -> None:
    """Print ``doc`` as one JSON document on stdout."""
    sys.stdout.write(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")


# -------------------------------------------------------------------- locations
def options_for(location: str) -> dict[str, object] | None:
    """The ``-o`` storage options, for a URL location (a local path takes none)."""
    from ..store import is_url

    return dict(_options) if _options and is_url(location) else None


def open_location(location: str) -> Any:
    """The read-only store of a run location (path or URL), checked: a bad location is a
    :class:`~unbroken.StorageError` (exit 1 with its message)."""
    from ..store import open_store

    store = open_store(location, options_for(location), readonly=True)
    store.check()
    return store


def open_checkpoint(location: str) -> tuple[Any, str]:
    """``(store of its run, name)`` for the location of one checkpoint folder."""
    from ..store import split_checkpoint

    return split_checkpoint(location, options_for(location))


def is_run(store: Any) -> bool:
    """Whether ``store`` holds anything of an unbroken run: a committed checkpoint, a
    quarantine, or a run index (local runs). Reads only; creates nothing."""
    from ..run.index.index import INDEX_FILE

    if store.list_committed() or store.quarantined() is not None or store.list_uncommitted():
        return True
    return not store.remote and (Path(store.url) / INDEX_FILE).is_file()


def require_run(store: Any, location: str) -> None:
    """Exit 1 with a message unless ``location`` is an unbroken run (see :func:`is_run`)."""
    if not is_run(store):
        what = "does not exist" if not store.remote and not Path(location).exists() else \
            "is not an unbroken run (no checkpoints, no quarantine/, no index.sqlite)"
        fail(f"{escape(location)} {what}; give the folder (or URL) a Checkpointer writes to")


# ------------------------------------------------------------------- formatting
def size(n: int | None) -> str:
    """``n`` bytes for people (decimal units)."""
    if n is None:
        return ""
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return str(n)


def when(timestamp: float | None) -> str:
    """A time stamp as local ``YYYY-MM-DD HH:MM:SS``."""
    if timestamp is None:
        return ""
    return _dt.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def number(x: Any) -> str:
    """A metric value, short: floats with 6 significant digits."""
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def plural(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def metrics_text(metrics: dict[str, Any]) -> str:
    """``loss=0.125 acc=0.9``."""
    return " ".join(f"{k}={number(v)}" for k, v in metrics.items())


JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table.")
"""The ``--json`` flag every listing command has."""
