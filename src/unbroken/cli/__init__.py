"""The ``unbroken`` command line (typer): one module per concept.

- :mod:`.base`: the app, the global ``-o KEY=VALUE`` storage options, output and locations;
- :mod:`.listing`: ``ls`` (``list``) and ``verify``;
- :mod:`.inspection`: ``inspect``;
- :mod:`.compare`: ``diff``;
- :mod:`.maintain`: ``prune`` and ``tag``;
- :mod:`.runlog`: ``events``, ``metrics`` and ``plot``;
- :mod:`.goodput`: ``goodput``;
- :mod:`.convert`: ``import`` and ``export``;
- :mod:`.demo`: ``demo``;
- :mod:`.launch`: ``run`` (restarts from a warm spare).

``docs/cli.md`` describes every command, its output, ``--json`` shape and exit codes.
"""

from __future__ import annotations

import os

# each module registers its commands, in the order --help lists them
from . import compare, convert, demo, goodput, inspection, launch, listing, maintain, runlog, selftest  # noqa: F401
from .base import app

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the ``unbroken`` script."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
