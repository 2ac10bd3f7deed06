"""The whole selftest: the uninterrupted run, the interrupted one, the comparison, the verdict.

Exit codes of the command: 0 identical, 1 diverged (or the script failed after a resume),
2 could not run (no Checkpointer, a crash or a hang of the uninterrupted run, a hang later).

With ``nproc > 1`` every process of both runs is ``torchrun --standalone --nproc-per-node N
--max-restarts 0 train.py ARGS`` (the leading ``python`` replaced); each rank records its own
fingerprints, rank 0 carries out the interruptions (the other ranks are torn down by torchrun,
or stop at the same step by unbroken's preemption), and the runs are compared rank by rank.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TargetExistsError
from . import protocol
from .compare import Comparison, compare, load_records, order
from .coverage import RunShape, explain, not_covered
from .diagnose import diagnose
from .plan import Interruption, make_plan, targeted
from .runner import Attempt, run_attempt
from .workdir import claim_workdir

IDENTICAL, DIVERGED, ERROR = "identical", "diverged", "error"
EXIT = {IDENTICAL: 0, DIVERGED: 1, ERROR: 2}
WORK_ENTRIES = ("uninterrupted", "interrupted")
"""What a selftest creates in its work folder (a ``--workdir`` it made is emptied of these alone)."""
_OURS = (protocol.DIR, protocol.RUN, protocol.SEGMENT, protocol.STOP, protocol.KILL, protocol.LINES, "UNBROKEN_FAULTS")


@dataclass
class Report:
    """The outcome of a selftest: the verdict and everything the CLI prints or ``--json`` emits."""

    verdict: str
    command: list[str]
    steps: int = 0
    seed: int = 0
    reference: Attempt | None = None
    attempts: list[Attempt] = field(default_factory=list)
    plan: list[Interruption] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=dict)
    divergence: Any = None
    diagnosis: Any = None
    error: str = ""
    stderr_tail: str = ""
    notes: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    """Code paths and interruption places the selftest did not exercise (:mod:`.coverage`)."""
    workdir: str | None = None
    nproc: int = 1

    @property
    def code(self) -> int:
        return EXIT[self.verdict]

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "exit_code": self.code, "command": self.command, "nproc": self.nproc,
                "steps": self.steps,
                "seed": self.seed, "plan": [p.as_dict() for p in self.plan],
                "reference": self.reference.as_dict() if self.reference else None,
                "attempts": [a.as_dict() for a in self.attempts], "compared": self.compared,
                "divergence": self.divergence.as_dict() if self.divergence else None,
                "diagnosis": self.diagnosis.as_dict() if self.diagnosis else None,
                "error": self.error or None, "stderr_tail": self.stderr_tail or None, "notes": self.notes,
                "not_covered": self.not_covered, "workdir": self.workdir}


def _env(records: Path, run: Path, segment: int, stop: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    env.update({"PYTHONUNBUFFERED": "1", protocol.DIR: str(records), protocol.RUN: str(run),
                protocol.SEGMENT: str(segment), protocol.STOP: str(stop)}, **extra)
    return env


def _of(records: list[dict[str, Any]], seg: int, kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("seg") == seg and r.get("kind") == kind]


_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def launcher(cmd: list[str], nproc: int) -> list[str]:
    """The command of one process of a run: ``cmd`` itself, or with ``nproc > 1`` under torchrun (from the
    folder of this Python), its leading ``python`` replaced. ValueError if ``cmd`` does not start with Python."""
    if nproc <= 1:
        return list(cmd)
    exe = os.path.basename(cmd[0])
    if len(cmd) < 2 or not (exe.startswith("python") or os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)):
        raise ValueError(f"--nproc runs the script under torchrun: give it as `python train.py ...` (got {cmd[0]!r})")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", *cmd[1:]]


def rank_exits(stderr: str) -> dict[int, int]:
    """The exit codes of the ranks that failed, from torchrun's failure report on its stderr."""
    return {int(r): int(c) for r, c in _EXIT.findall(stderr)}


def _rank0_rc(att: Attempt, logs: Path) -> int | None:
    """Rank 0's exit status under torchrun (which itself exits 1 whenever a rank failed)."""
    if att.rc == 0 or att.timed_out:
        return att.rc
    try:
        exits = rank_exits(logs.with_suffix(".err").read_text(errors="replace"))
    except OSError:
        exits = {}
    att.ranks = exits
    return exits.get(0, att.rc)


def _outcome(att: Attempt, records: list[dict[str, Any]], seg: int, rc: int | None = None) -> tuple[str, int | None]:
    """Fill ``att.started``/``att.ended``; return (``finished`` | ``interrupted`` | ``failed``, last step).
    ``rc``: the exit status of the process that was interrupted (rank 0 under torchrun; default ``att.rc``)."""
    rc = att.rc if rc is None else rc
    restored = _of(records, seg, "restore")
    steps = [r["step"] for r in _of(records, seg, "step")]
    last = steps[-1] if steps else (restored[0]["step"] if restored else None)
    if restored:
        r = restored[-1].get("resumed_from")
        att.started = f"resumed from step {r}" if r is not None else "fresh start"
    injected = _of(records, seg, "injected")
    after = f" after step {last}" if last is not None else ""
    if rc == 0:
        att.ended = f"finished at step {last}"
        return "finished", last
    if rc == -9 and injected and injected[-1]["what"] == "sigkill":
        att.ended = f"killed{after}"
    elif rc == -9 and injected and injected[-1]["what"] == "between":
        att.ended = f"killed during the work{after}"
    elif rc == -9 and "save" in att.plan:
        att.ended = f"killed in a save{after}"
    elif injected and injected[-1]["what"] == "sigterm" and rc in (75, -15):
        att.ended = f"preempted{after} (exit {rc})"
    elif injected and injected[-1]["what"] == "exception" and rc not in (None, 0) and rc > 0:
        att.ended = f"exception{after} (exit {rc})"
    else:
        att.ended = f"failed{after} (exit {rc})"
        return "failed", last
    return "interrupted", last


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def run_selftest(cmd: list[str], *, steps: int = 40, kills: int = 4, kinds: list[str] | None = None,
                 seed: int = 0, timeout: float = 600.0, workdir: str | None = None, keep: bool = False,
                 nproc: int = 1, say: Callable[[str], None] = lambda _: None) -> Report:
    """Run the selftest of ``cmd`` (the user's unmodified command line); see the module docstring.
    ``nproc > 1``: under torchrun with that many processes (ValueError if ``cmd`` is not ``python ...``).
    ``workdir``: keep everything there; a folder this selftest did not make (no ``.unbroken-selftest``
    marker) must be new or empty, else the report is an error and nothing is touched
    (:func:`~.workdir.claim_workdir`). Without it, a temporary folder, removed when identical."""
    launch = launcher(cmd, nproc)
    kinds = kinds or ["sigkill", "sigterm", "exception"]
    rep = Report(ERROR, list(cmd), steps=steps, seed=seed, nproc=max(nproc, 1))
    try:
        base = claim_workdir(workdir, "selftest", WORK_ENTRIES) if workdir else \
            Path(tempfile.mkdtemp(prefix="unbroken-selftest-"))
    except TargetExistsError as e:
        rep.error = str(e)
        return rep
    rep.workdir = str(base)
    try:
        _run(rep, launch, base, steps, kills, kinds, seed, timeout, say)
    finally:
        if rep.verdict == IDENTICAL and not keep and not workdir:
            shutil.rmtree(base, ignore_errors=True)
            rep.workdir = None
    return rep


def _run(rep: Report, cmd: list[str], base: Path, steps: int, kills: int, kinds: list[str], seed: int,
         timeout: float, say: Callable[[str], None]) -> None:
    ref_dir, got_dir = base / "uninterrupted", base / "interrupted"
    for d in (ref_dir, got_dir):
        d.mkdir(parents=True, exist_ok=True)
    say(f"uninterrupted run to step {steps} ...")
    ref = run_attempt(cmd, _env(ref_dir, ref_dir / "run", 0, steps, {protocol.LINES: "1"}), ref_dir / "process-0",
                      timeout, "run to the end")
    ref_rc = _rank0_rc(ref, ref_dir / "process-0") if rep.nproc > 1 else ref.rc
    rep.reference = ref
    records = load_records(ref_dir)
    if ref.timed_out:
        rep.error = (f"the uninterrupted run did not finish within {timeout:g} s: killed it and every process it "
                     "started. A hang? If it is just slow, raise --timeout or lower --steps")
        rep.stderr_tail = ref.stderr_tail
        return
    if not _of(records, 0, "hello"):
        if ref.rc == 0:
            rep.error = ("no Checkpointer was created: selftest needs one (unbroken.Checkpointer(...), restore(), "
                         "step() once per optimizer step); see README.md, 'Add it to your loop'")
        else:
            rep.error = f"the script failed on its own before creating a Checkpointer (exit {ref.rc})"
            rep.stderr_tail = ref.stderr_tail
        return
    state, last = _outcome(ref, records, 0, ref_rc)
    if state == "failed":
        rep.error = (f"the script failed on its own in the uninterrupted run (exit {ref.rc}): "
                     f"{_last_line(ref.stderr_tail)}")
        rep.stderr_tail = ref.stderr_tail
        return
    if not _of(records, 0, "step"):
        rep.error = ("the script created a Checkpointer but never called ckpt.step(state): selftest fingerprints "
                     "the state at every ckpt.step(), once per optimizer step")
        return
    if last is not None and last < steps:
        rep.notes.append(f"the script ends by itself at step {last}: compared up to there")
        steps = rep.steps = last
    say(f"uninterrupted run: {steps} steps in {ref.seconds:.1f} s")
    saved = sorted({r["step"] for r in _of(records, 0, "saved")})
    if not saved:
        rep.notes.append(f"the script saved no checkpoint in {steps} steps: every resume starts from scratch, so "
                         "this proves little; use --steps larger than its save interval")
    shape = RunShape.of(records)
    rep.plan = targeted(make_plan(steps, kills, kinds, seed), kinds, [e for e in shape.epoch_ends if e < steps],
                        saved, [b for b in shape.between if b < steps])
    seg, finished = 0, False
    for planned in rep.plan + [None]:
        label = planned.describe() if planned else "run to the end"
        say(f"process {seg + 1} of the interrupted run: {label} ...")
        extra = planned.env(rep.nproc) if planned else {}
        att = run_attempt(cmd, _env(got_dir, got_dir / "run", seg, steps, extra), got_dir / f"process-{seg}",
                          timeout, label)
        rep.attempts.append(att)
        if att.timed_out:
            rep.error = (f"process {seg + 1} of the interrupted run ({label}) did not finish within {timeout:g} s: "
                         "killed it and every process it started (a hang after a resume?)")
            rep.stderr_tail = att.stderr_tail
            return
        rc = _rank0_rc(att, got_dir / f"process-{seg}") if rep.nproc > 1 else att.rc
        state, _ = _outcome(att, load_records(got_dir), seg, rc)
        seg += 1
        if state == "failed":
            result = _compare(ref_dir, got_dir, steps, rep.nproc)
            if result.divergence is not None:  # a difference before the failure explains it better
                rep.divergence, rep.diagnosis = result.divergence, diagnose(result.divergence)
            rep.verdict, rep.stderr_tail = DIVERGED, att.stderr_tail
            rep.error = (f"the script failed in process {seg} of the interrupted run ({att.started or 'before restore'}"
                         f", exit {rc}) though it ran uninterrupted: {_last_line(att.stderr_tail)}")
            return
        if state == "finished":
            finished = True
            break
    done = len([a for a in rep.attempts if a.ended and not a.ended.startswith("finished")])
    if done < len(rep.plan):
        rep.notes.append(f"{done} of {len(rep.plan)} planned interruptions happened (the run reached step {steps} "
                         "first, or a process never saved)")
    if not finished:
        rep.error = "the interrupted run did not finish"
        return
    if not any(a.started.startswith("resumed") for a in rep.attempts):
        rep.notes.append("no process of the interrupted run resumed from a checkpoint (every interruption came "
                         "before the first save): this proves little; raise --steps")
    result = _compare(ref_dir, got_dir, steps, rep.nproc)
    resumes = [r["resumed_from"] for r in load_records(got_dir) if r.get("kind") == "restore"
               and r.get("resumed_from") is not None]
    rep.not_covered = not_covered(shape, steps, kinds, resumes,
                                  any(a.ended.startswith("killed during the work") for a in rep.attempts))
    rep.notes.extend(explain(result))
    rep.compared = {"records": result.compared_records, "components": result.compared_components,
                    "rerun_steps": result.rerun_steps}
    if result.ignored:
        rep.notes.append(f"not compared: {', '.join(result.ignored)} (not seeded, but never drawn from)")
    if result.divergence is not None:
        rep.verdict, rep.divergence, rep.diagnosis = DIVERGED, result.divergence, diagnose(result.divergence)
    elif result.missing_steps:
        rep.verdict = DIVERGED
        rep.error = f"the interrupted run has no record of steps {result.missing_steps[:10]}" + (
            f" (rank {result.missing_rank})" if rep.nproc > 1 else "")
    else:
        rep.verdict = IDENTICAL


def _compare(ref_dir: Path, got_dir: Path, steps: int, nproc: int) -> Comparison:
    """Compare the runs; with several ranks rank by rank (each rank's interrupted records with the same rank's
    uninterrupted ones). The divergence reported is the earliest (process, step, restore before step), and
    among ranks diverging there the one whose first differing component comes first causally (the rank
    where it began: DDP's gradient averaging spreads it to the others within the step)."""
    if nproc <= 1:
        return compare(load_records(ref_dir), load_records(got_dir), steps)
    results = [compare(load_records(ref_dir, r), load_records(got_dir, r), steps) for r in range(nproc)]
    for r, res in enumerate(results):
        if res.divergence is not None:
            res.divergence.rank = r
    total = Comparison(sum(x.compared_records for x in results), sum(x.compared_components for x in results),
                       sum(x.rerun_steps for x in results), None, [],
                       sorted({k for x in results for k in x.ignored}), None, results[0].not_drawn, results[0].skipped)
    diverged = [x.divergence for x in results if x.divergence is not None]
    if diverged:
        total.divergence = min(diverged, key=lambda d: (d.segment, d.step, d.kind != "restore", order(d.differ[0]),
                                                        d.rank))
    else:
        for r, res in enumerate(results):
            if res.missing_steps:
                total.missing_steps, total.missing_rank = res.missing_steps, r
                break
    return total
