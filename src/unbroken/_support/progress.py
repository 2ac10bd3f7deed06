"""Progress bars for long saves and loads, on a terminal only.

A bar appears on stderr when a synchronous save or a load moves at least
:data:`MIN_BYTES`, stderr is a terminal, and the work runs in the main thread
(background saves stay quiet: their bar would tear through the training loop's own
output). ``UNBROKEN_PROGRESS=0`` turns bars off, ``=1`` shows them whatever the size.
Bars are transient: they disappear when the work is done, leaving the log line.

The code that moves bytes calls :func:`advance`; :func:`task` decides whether anything
is shown, so the writers and readers do not need to know.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MIN_BYTES = 512 * 1024 * 1024
"""Saves and loads smaller than this get no bar (they take about a second or less)."""

class _Current:
    bar: Any = None


_local = _Current()  # one bar at a time, opened by the main thread; readers in other threads count on it


def _wanted(total: int) -> bool:
    setting = os.environ.get("UNBROKEN_PROGRESS", "")
    if setting == "0" or _local.bar is not None:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and (setting == "1" or total >= MIN_BYTES)


@contextmanager
def task(description: str, total: int) -> Iterator[None]:
    """Show a transient bar of ``total`` bytes while the block runs, if wanted (see above).
    Nested tasks add nothing: the outer bar counts everything."""
    if not _wanted(total):
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns: list[Any] = [TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        _local.bar = (bar, bar.add_task(description, total=total))
        try:
            yield
        finally:
            _local.bar = None


def advance(nbytes: int) -> None:
    """Count ``nbytes`` moved on the bar shown (nothing if there is none)."""
    current = _local.bar
    if current is not None:
        current[0].advance(current[1], nbytes)
