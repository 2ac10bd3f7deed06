"""``unbroken selftest``: prove that a training script resumes exactly (see :mod:`unbroken.selftest`)."""

from __future__ import annotations

import random

import typer
from rich.markup import escape
from rich.table import Table

from ..selftest.diagnose import describe
from ..selftest.plan import parse_kinds
from ..selftest.session import ERROR, IDENTICAL, Report, launcher, run_selftest
from .base import JSON_OPTION, app, emit_json, err, out

TAIL_LINES = 20
"""Lines of a failed script's stderr shown (``--json`` has more)."""
VALUES = 2
"""Differing components whose two values are shown (``--json`` has all)."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def selftest(
    ctx: typer.Context,
    steps: int = typer.Option(40, "--steps", metavar="N", help="Optimizer steps of each run (the script is stopped "
                              "cleanly after step N; it needs no option of its own for that)."),
    kills: int = typer.Option(4, "--kills", metavar="K", help="Interruptions of the second run, at random steps "
                              "(plus, when K > 0, up to two targeted ones: at an epoch's last step, and inside the "
                              "work between two steps that reads other DataLoaders)."),
    kinds: str = typer.Option("sigkill,sigterm,exception", "--kinds", metavar="LIST",
                              help="Interruption kinds, cycled: sigkill (every second one inside a save), sigterm, "
                                   "exception, save (always inside a save)."),
    seed: int | None = typer.Option(None, "--seed", metavar="S", help="Seed of the interruption plan "
                                    "(random if unset; printed, so a failure can be replayed)."),
    timeout: float = typer.Option(600.0, "--timeout", metavar="SECONDS", help="Limit per process; one that runs "
                                  "longer is killed with everything it started (exit 2)."),
    nproc: int = typer.Option(1, "--nproc", metavar="N", help="Processes per run: N > 1 runs every process as "
                       "`torchrun --standalone --nproc-per-node N --max-restarts 0 train.py ...` (the leading "
                       "python replaced); rank 0 is interrupted, the ranks are compared one by one."),
    workdir: str | None = typer.Option(None, "--workdir", metavar="DIR", help="Keep run folders, records and logs "
                                       "here: a new or empty folder, or one a previous selftest made (marked "
                                       ".unbroken-selftest; its run folders are replaced). Anything else is "
                                       "refused (exit 2). By default a temporary folder, removed when identical."),
    json_: bool = JSON_OPTION,
) -> None:
    """Run a training script uninterrupted and interrupted (SIGKILL, SIGTERM, exceptions, kills inside saves),
    resume it, compare per-step fingerprints: `identical`, or the first diverging step and component with a
    diagnosis. Usage: unbroken selftest [OPTIONS] -- python train.py ARGS... Exit 0 identical, 1 diverged,
    2 could not run."""
    cmd = list(ctx.args)
    if not cmd:
        raise typer.BadParameter("give the training command after --: unbroken selftest -- python train.py ...")
    if steps < 2 or kills < 0 or timeout <= 0:
        raise typer.BadParameter("--steps must be at least 2, --kills at least 0, --timeout positive")
    if nproc < 1:
        raise typer.BadParameter("--nproc must be at least 1", param_hint="--nproc")
    try:
        launcher(cmd, nproc)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--nproc") from None
    try:
        kind_list = parse_kinds(kinds)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kinds") from None
    seed = random.SystemRandom().randrange(10_000) if seed is None else seed
    note = err()
    say = (lambda _: None) if json_ else (lambda m: note.print(escape(m), style="dim"))
    if not json_:
        ranks = f", {nproc} processes under torchrun" if nproc > 1 else ""
        note.print(escape(f"unbroken selftest (seed {seed}{ranks}): {' '.join(cmd)}"))
    rep = run_selftest(cmd, steps=steps, kills=kills, kinds=kind_list, seed=seed, timeout=timeout,
                       workdir=workdir, nproc=nproc, say=say)
    if json_:
        emit_json(rep.as_dict())
    else:
        _print(rep)
    raise typer.Exit(rep.code)


def _print(rep: Report) -> None:
    con, note = out(), err()
    if rep.attempts:
        table = Table(title="interrupted run: one row per process")
        for col in ("#", "plan", "started", "ended", "seconds"):
            table.add_column(col)
        for i, a in enumerate(rep.attempts, 1):
            table.add_row(str(i), escape(a.plan), escape(a.started), escape(a.ended), f"{a.seconds:.1f}")
        con.print(table)
    for n in rep.notes:
        note.print(f"[yellow]note: {escape(n)}[/]")
    for n in rep.not_covered:
        note.print(f"[yellow]not covered: {escape(n)}[/]")
    if rep.stderr_tail:
        lines = rep.stderr_tail.rstrip().splitlines()[-TAIL_LINES:]
        note.print("[dim]--- the script's stderr (last lines) ---[/]")
        note.print(escape("\n".join(lines)), highlight=False)
        note.print("[dim]---[/]")
    if rep.compared:
        c = rep.compared
        con.print(f"compared {c['records']} records ({c['components']} components, {c['rerun_steps']} steps re-run "
                  "after a resume) with the uninterrupted run")
    if rep.divergence is not None:
        d, g = rep.divergence, rep.diagnosis
        con.print(f"[bold red]diverged[/] {escape(g.headline)}")
        con.print(escape("  differ: " + ", ".join(describe(k) for k in d.differ)))
        if d.agree:
            con.print(escape("  agree:  " + ", ".join(describe(k) for k in d.agree)))
        for k in d.differ[:VALUES]:
            a, b = d.values.get(k, (None, None))
            con.print(escape(f"  values: {describe(k)}: {a} (uninterrupted), {b} (interrupted)"))
        con.print(escape(f"  cause:  {g.cause}"))
        if g.evidence and g.known:  # a "cannot tell" has what it ruled out in its cause
            con.print(escape(f"  evidence: {g.evidence}"))
        con.print(escape(f"  fix:    {g.fix}"))
    if rep.error:
        note.print(f"[red]{escape(rep.error)}[/]")
    if rep.verdict == IDENTICAL:
        count = len(rep.attempts) - 1
        con.print(f"[bold green]identical[/]: {rep.steps} steps, what every step consumed and produced and the final "
                  f"state bitwise equal across {count} interruption{'s' if count != 1 else ''}"
                  + (f", on each of the {rep.nproc} ranks" if rep.nproc > 1 else ""))
    elif rep.verdict != ERROR and not rep.divergence:
        con.print("[bold red]diverged[/]")
    if rep.workdir and rep.verdict != IDENTICAL:
        note.print(escape(f"records, run folders and logs kept in {rep.workdir}"))
