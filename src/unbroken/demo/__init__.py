"""``unbroken demo``: kill a training run again and again, resume it, prove it bitwise identical.

Runs :mod:`unbroken.demo.train` once without interruption, then again as a series
of attempts, each ended by a real SIGKILL: some sent from outside at a random step,
some delivered inside a save (half-way through a tensor file, between the data files
and the manifest, between the manifest and the commit). Each attempt resumes from
the newest valid checkpoint. At the end it compares the final parameters, optimizer
state, scheduler and scaler, and every logged per-step loss (including the losses
of steps that were recomputed after a kill) with the uninterrupted run, and draws both
runs' losses into a PNG (:func:`plot_losses`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..faults import EXIT_PREEMPTED
from ..selftest.workdir import claim_workdir

WORK_ENTRIES = ("reference", "interrupted", "losses.png")
"""What the demo creates in its work folder (a ``--workdir`` it made is emptied of these alone)."""


@dataclass
class Attempt:
    """One process of the interrupted run and how it ended."""

    plan: str
    started: str = ""
    ended: str = ""
    last_step: int = 0
    seconds: float = 0.0
    workers: int = 0
    rc: int = 0
    stderr: str = ""
    logged: int = 0
    """Lines of the run's ``losses.jsonl`` once this attempt ended (the attempts append to it)."""


def make_plan(rng: random.Random, steps: int, kills: int) -> list[tuple[str, str]]:
    """Alternate external SIGKILLs at random steps with SIGKILLs inside saves."""
    save_points = ["save.mid_file", "save.before_manifest", "save.before_commit"]
    plan: list[tuple[str, str]] = []
    targets = sorted(rng.sample(range(3, max(4, steps - 10)), k=max(1, kills)))
    for i, step in enumerate(targets):
        plan.append(("step", str(step)))
        point = save_points[i % len(save_points)]
        nth = 1 if step > steps - 25 else rng.randint(1, 2)
        plan.append(("save", f"{point}={nth}"))
    return plan


_WHERE = {"save.mid_file": "mid tensor file", "save.before_manifest": "before manifest",
          "save.before_commit": "before rename"}


def _describe_fault(spec: str) -> str:
    point, _, nth = spec.partition("=")
    return f"SIGKILL in save #{nth or 1} ({_WHERE.get(point, point)})"


ATTEMPT_TIMEOUT_S = 900.0
"""The longest one attempt may run before it is killed and the demo fails (a hang, not a slow machine)."""
HOLD_ENV = "UNBROKEN_DEMO_HOLD"
"""A file :func:`run_attempt` creates once it has signalled the child: a training script that finds this
variable set waits before its last step's ``ckpt.step()`` until the file exists (at most
:data:`HOLD_TIMEOUT_S`), so that it never finishes before a signal planned for an earlier step."""
HOLD_TIMEOUT_S = 60.0


def run_attempt(cmd: list[str], kind: str, arg: str, env: dict[str, str],
                ok_codes: tuple[int, ...] = (), timeout: float = ATTEMPT_TIMEOUT_S) -> Attempt:
    """Start one attempt, interrupt it as planned, and return how it went.

    ``kind``: ``"none"`` (let it run), ``"step"`` (SIGKILL once step ``arg`` is done),
    ``"signal"`` (``arg`` = ``"SIGTERM@12"``: send that signal once step 12 is done), or
    ``"save"`` (``arg`` = a fault spec: SIGKILL inside a save). An exit status that is not
    the expected one for the kind, nor in ``ok_codes``, raises with the child's stderr; so does an
    attempt still running after ``timeout`` seconds (it is killed first: every wait is bounded).

    The signal lands where the child is when it arrives (mid-step, in a save...), a few steps after
    ``arg`` when this process is slow to read the line. So that a loaded machine never lets the child
    finish before its signal, a child that honours :data:`HOLD_ENV` (the demo's training script does)
    waits before its last step's ``ckpt.step()`` until the signal has been sent (bounded).
    """
    if kind == "step":
        plan = f"SIGKILL after step {arg}"
    elif kind == "signal":
        plan = f"{arg.split('@')[0]} after step {arg.split('@')[1]}"
    else:
        plan = _describe_fault(arg) if kind == "save" else "run"
    att = Attempt(plan=plan)
    child_env = dict(env)
    hold_dir = tempfile.mkdtemp(prefix="unbroken-attempt-") if kind in ("step", "signal") else None
    if hold_dir is not None:
        child_env[HOLD_ENV] = os.path.join(hold_dir, "sent")
    if kind == "save":
        child_env["UNBROKEN_FAULTS"] = arg
    sig, at = signal.SIGKILL, int(arg) if kind == "step" else 0
    if kind == "signal":
        name, _, step = arg.partition("@")
        sig, at = signal.Signals[name], int(step)
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=child_env)
        assert proc.stdout is not None
        expired = threading.Event()

        def expire() -> None:  # ends a hung child's stream (and so the loop below)
            expired.set()
            proc.kill()

        watchdog = threading.Timer(timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        sent = False
        for line in proc.stdout:
            line = line.strip()
            if line.startswith(("resumed", "fresh")):
                att.started = line
            elif line.startswith("preempted at step"):
                att.ended = line
            elif line.startswith("step "):
                att.last_step = int(line.split()[1])
                if kind in ("step", "signal") and not sent and att.last_step >= at:
                    proc.send_signal(sig)
                    sent = True
                    if hold_dir is not None:  # a child held before its last step may go on: the signal is sent
                        Path(hold_dir, "sent").touch()
        rc = proc.wait()
        if hold_dir is not None:
            shutil.rmtree(hold_dir, ignore_errors=True)
        watchdog.cancel()
        err.seek(0)
        stderr = err.read()
    att.seconds = time.monotonic() - t0
    att.rc = rc
    att.stderr = stderr[-5000:]
    if expired.is_set():
        raise RuntimeError(f"training attempt ({plan}) still ran after {timeout:.0f} s and was killed:\n"
                           f"{stderr[-3000:]}")
    if rc == 0:
        att.ended = "finished"
    elif rc == -signal.SIGKILL and kind in ("step", "save"):
        att.ended = f"killed after step {att.last_step}" if kind == "step" else \
            f"killed in a save after step {att.last_step}"
    elif kind == "signal" and rc == EXIT_PREEMPTED and att.ended:
        pass
    elif rc in ok_codes:
        att.ended = f"exited with status {rc} after step {att.last_step}"
    else:
        raise RuntimeError(f"training attempt ({plan}) ended with status {rc}:\n{stderr[-3000:]}")
    return att


def compare(ref: Path, got: Path) -> dict[str, bool]:
    """Bitwise comparison of two runs' outputs."""
    a, b = load_file(str(ref / "final.safetensors")), load_file(str(got / "final.safetensors"))
    same_tensors = lambda prefix: a.keys() == b.keys() and all(  # noqa: E731
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a if k.startswith(prefix))
    ref_other = json.loads((ref / "final.json").read_text())
    got_other = json.loads((got / "final.json").read_text())
    ref_losses = {r["step"]: r["loss"] for r in map(json.loads, (ref / "losses.jsonl").read_text().split("\n")[:-1])}
    got_records = [json.loads(x) for x in (got / "losses.jsonl").read_text().split("\n")[:-1]]
    losses_ok = bool(got_records) and {r["step"] for r in got_records} == set(ref_losses) and all(
        r["loss"] == ref_losses[r["step"]] for r in got_records)
    return {
        "parameters": same_tensors("model/"),
        "optimizer state": same_tensors("optimizer/") and ref_other["param_groups"] == got_other["param_groups"],
        "scheduler + scaler": ref_other["scheduler"] == got_other["scheduler"]
        and ref_other["scaler"] == got_other["scaler"],
        "per-step losses": losses_ok,
    }


def _losses(path: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` per line of a ``losses.jsonl`` (none if it does not exist yet)."""
    if not path.exists():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().split("\n")[:-1])]


def plot_losses(base: Path, attempts: list[Attempt], out: Path) -> Path:
    """Draw the uninterrupted run's losses (a grey band) and each attempt's (a coloured line on
    it), with the kills and resumes marked, into the PNG file ``out``."""
    from ..run.index.plotting import Curve, Marker, plot_curves

    ref = _losses(base / "reference" / "out" / "losses.jsonl")
    got = _losses(base / "interrupted" / "out" / "losses.jsonl")
    curves = [Curve("uninterrupted", [s for s, _ in ref], [v for _, v in ref], reference=True)]
    markers, start = [], 0
    for i, a in enumerate(attempts, 1):
        part, before, start = got[start:a.logged], got[:start], a.logged
        if not part:
            continue
        resumed_at = int(a.started.rsplit(" ", 1)[1]) if a.started.startswith("resumed from step") else None
        origin = [(s, v) for s, v in before if s == resumed_at][-1:]  # the line starts where it resumed
        if origin:
            part = origin + part
            markers.append(Marker("resume", *origin[0]))
        curves.append(Curve(f"process {i}: {a.started or 'started'}", [s for s, _ in part], [v for _, v in part]))
        if a.ended.startswith("killed"):
            markers.append(Marker("interruption", *part[-1]))
    kills = sum(m.kind == "interruption" for m in markers)
    return plot_curves(curves, out, markers=markers, ylabel="loss",
                       title=f"loss per step: uninterrupted, and killed {kills} times and resumed")


def run_demo(workdir: str | None = None, steps: int = 150, kills: int = 3, seed: int | None = None,
             keep: bool = False) -> bool:
    """Run the whole demo, print the report, return whether the runs are bitwise identical.

    ``workdir``: keep every file there. It must be new, empty, or a folder a previous demo made (marked
    ``.unbroken-demo``: only the demo's own entries in it are replaced); anything else raises
    :class:`~unbroken.errors.TargetExistsError` before anything is written (see
    :func:`unbroken.selftest.workdir.claim_workdir`). Without it, a temporary folder."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    seed = random.SystemRandom().randrange(10_000) if seed is None else seed
    rng = random.Random(seed)
    base = claim_workdir(workdir, "demo", WORK_ENTRIES) if workdir else \
        Path(tempfile.mkdtemp(prefix="unbroken-demo-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def cmd(name: str, workers: int = 0) -> list[str]:
        return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / name / "run"),
                "--out", str(base / name / "out"), "--steps", str(steps), "--seed", str(seed % 97),
                "--workers", str(workers)]

    console.print(f"[bold]unbroken demo[/] (seed {seed}): {steps} steps of an MLP with dropout, shuffled "
                  "data, random augmentation, AdamW, warmup+cosine, 2-step gradient accumulation, GradScaler; "
                  "each attempt uses a different number of DataLoader workers")
    t0 = time.monotonic()
    ref = run_attempt(cmd("reference"), "none", "", env)
    console.print(f"uninterrupted run: {ref.last_step} steps in {ref.seconds:.1f} s")

    attempts: list[Attempt] = []
    for i, (kind, arg) in enumerate(make_plan(rng, steps, kills) + [("none", "")]):
        workers = (0, 2, 1)[i % 3]  # the data position does not depend on the worker count
        att = run_attempt(cmd("interrupted", workers), kind, arg, env)
        att.workers = workers
        att.logged = len(_losses(base / "interrupted" / "out" / "losses.jsonl"))
        if kind == "none":
            att.plan = "run to the end"
        attempts.append(att)
        if att.ended == "finished":
            break
    table = Table(title="interrupted run: one row per process")
    for col in ("#", "plan", "workers", "started from", "ended", "seconds"):
        table.add_column(col)
    for i, a in enumerate(attempts, 1):
        table.add_row(str(i), a.plan, str(a.workers), a.started, a.ended, f"{a.seconds:.1f}")
    console.print(table)
    quarantined = base / "interrupted" / "run" / "quarantine"
    if quarantined.exists():
        console.print(f"quarantined checkpoints: {sorted(p.name for p in quarantined.iterdir())}")

    results = compare(base / "reference" / "out", base / "interrupted" / "out")
    check = Table(title="compared with the uninterrupted run")
    check.add_column("what")
    check.add_column("bitwise equal")
    for what, ok in results.items():
        check.add_row(what, "[green]yes[/]" if ok else "[red]NO[/]")
    console.print(check)
    ok = all(results.values())
    console.print(f"total {time.monotonic() - t0:.1f} s, {len(attempts) - 1} kills")
    console.print(f"bitwise identical: {'yes' if ok else 'no'}", style="bold green" if ok else "bold red")
    from rich.markup import escape

    from ..run.index.plotting import MISSING, available

    if not available():
        console.print(f"loss curves: not drawn: {escape(MISSING)}")
    elif keep or not ok or workdir is not None:
        console.print(f"loss curves: {plot_losses(base, attempts, base / 'losses.png')}")
    else:  # the work folder is removed below: the picture gets a file of its own
        fd, name = tempfile.mkstemp(prefix="unbroken-demo-losses-", suffix=".png")
        os.close(fd)
        console.print(f"loss curves: {plot_losses(base, attempts, Path(name))}")
    if keep or not ok:
        console.print(f"files kept in {base}")
    elif workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    return ok
