"""``unbroken demo``: train, kill, resume, compare bitwise (see :mod:`unbroken.demo`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ..errors import TargetExistsError
from .base import app, err


@app.command()
def demo(
    workdir: Path | None = typer.Option(None, metavar="DIR", help="Keep all files in this folder: a new or empty "
                                        "one, or one a previous demo made (marked .unbroken-demo; its files are "
                                        "replaced). Anything else is refused (exit 2)."),
    steps: int = typer.Option(150, metavar="N", help="Training steps."),
    kills: int = typer.Option(3, metavar="N", help="External SIGKILLs at random steps (each followed by one inside "
                              "a save)."),
    seed: int | None = typer.Option(None, metavar="N", help="Seed for the kill schedule and the data (random if "
                                    "unset)."),
) -> None:
    """Train, kill with SIGKILL at random steps and inside saves, resume, compare bitwise; plot the losses.
    Exit 0 identical, 1 not, 2 could not run (a --workdir that is not the demo's)."""
    from ..demo import run_demo  # torch

    try:
        ok = run_demo(str(workdir) if workdir else None, steps=steps, kills=kills, seed=seed)
    except TargetExistsError as e:
        err().print(f"[red]{type(e).__name__}: {escape(str(e))}[/]")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if ok else 1)
