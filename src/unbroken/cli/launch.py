"""``unbroken run -- python train.py ...``: restart after a failure from a warm spare (:mod:`unbroken.launch`)."""

from __future__ import annotations

import typer

from .base import app


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    command: list[str] = typer.Argument(..., metavar="-- COMMAND...", help="The training command: python [FLAGS] "
                                        "SCRIPT ARGS, python -m MODULE ARGS, or SCRIPT.py ARGS."),
    max_restarts: int = typer.Option(10, metavar="N", help="Restarts after failures before giving up."),
    preload: str = typer.Option("", metavar="MODULES", help="Comma-separated modules the spare imports too "
                                "(transformers, your own package): what a restart then need not import."),
    cold: bool = typer.Option(False, "--cold", help="No spare: every restart starts the command from nothing."),
) -> None:
    """Run the training command; after a failure (SIGKILL, OOM, a crash) restart it at once from a spare
    interpreter that has imported torch and waits. Exit 0 done, 75 preempted, else the training's status."""
    from ..launch.supervisor import Supervisor  # no torch here: the spare imports it

    if max_restarts < 0:
        raise typer.BadParameter("must be 0 or more", param_hint="--max-restarts")
    outcome = Supervisor(list(command), max_restarts=max_restarts,
                         preload=tuple(m for m in preload.split(",") if m), warm=not cold).run()
    raise typer.Exit(outcome.status)
