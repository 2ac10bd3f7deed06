"""``unbroken demo``: train, kill, resume, compare bitwise (see :mod:`unbroken.demo`)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..demo import run_demo
from .base import app


@app.command()
def demo(
    workdir: Path | None = typer.Option(None, metavar="DIR", help="Keep all files in this folder (emptied first)."),
    steps: int = typer.Option(150, metavar="N", help="Training steps."),
    kills: int = typer.Option(3, metavar="N", help="External SIGKILLs at random steps (each followed by one inside "
                              "a save)."),
    seed: int | None = typer.Option(None, metavar="N", help="Seed for the kill schedule and the data (random if "
                                    "unset)."),
) -> None:
    """Train, kill with SIGKILL at random steps and inside saves, resume, compare bitwise; plot the losses."""
    ok = run_demo(str(workdir) if workdir else None, steps=steps, kills=kills, seed=seed)
    raise typer.Exit(0 if ok else 1)
