"""Signals under a real torchrun (2 ranks, gloo): a scheduler's SIGTERM to the agent and to every worker
at once is one preemption, and workers whose agent was SIGKILLed save, exit and free the run.

The job is tests/dist_train.py (DDP) through tests/signals_train.py, which records each rank's exit
status (torchrun reaps its workers without reporting it). When the agent is SIGKILLed its workers are
adopted by a subreaper started by the test, which reports their real exit statuses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from collections.abc import Callable

import pytest

import jobs
from test_distributed import losses, same_final
from unbroken.faults import EXIT_PREEMPTED
from unbroken.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "signals_train.py")
STEPS, SAVE_EVERY, TARGET = 16, 4, 6
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

# Runs torchrun as its child and, as a child subreaper (prctl PR_SET_CHILD_SUBREAPER), adopts the
# workers if the agent dies; writes {pid: exit status} of every process it reaped to argv[1].
REAPER = """
import ctypes, json, os, subprocess, sys
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
agent = subprocess.Popen(sys.argv[2:])
with open(sys.argv[1] + ".agent", "w") as f:
    f.write(str(agent.pid))
ended = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    ended[pid] = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    json.dump(ended, f)
"""


def torchrun(base: Path, *extra: str) -> list[str]:
    return jobs.torchrun(2, SCRIPT, "--run-dir", str(base / "run"), "--out", str(base / "out"), "--mode", "ddp",
                           "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra)


def worker_pids(base: Path) -> list[int]:
    return [int((base / "out" / f"pid-r{r}").read_text()) for r in (0, 1)]


def run(cmd: list[str], base: Path, on_line: Callable[[str, subprocess.Popen], None] | None = None
        ) -> tuple[int, str]:
    """Run ``cmd`` to its end, streaming its output to ``on_line``; (exit code, output). Whatever goes
    wrong, no worker is left behind (they run in sessions of their own: tests/jobs.py)."""
    return jobs.run(cmd, ENV, 400, on_line, workers=base / "out")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    code, out = run(torchrun(base), base)
    assert code == 0, out
    return base / "out"


def check_one_preemption_and_resume(reference: Path, base: Path, out: str) -> int:
    """Both ranks saved the same step, the last one each finished (no step lost), and exited 75;
    a relaunch resumes there and ends bitwise equal to the uninterrupted run. The step."""
    records = [base / "out" / f"exit-r{r}" for r in (0, 1)]
    ended = [p.read_text() if p.exists() else "killed by a signal (no exit record)" for p in records]
    assert ended == [str(EXIT_PREEMPTED)] * 2, out
    preempted = {int(s) for s in re.findall(r"^preempted at step (\d+)$", out, re.M)}
    assert len(preempted) == 1 and out.count("preempted at step") == 2, out
    step = preempted.pop()
    assert step >= TARGET and all(max(losses(base / "out", r)) == step for r in (0, 1)), out
    assert f"step-{step:09d}" in open_store(base / "run").list_committed()
    code, again = run(torchrun(base), base)  # the lock is free: the relaunch becomes the writer
    assert code == 0 and f"rank 0: resumed from step {step}" in again, again
    assert same_final(reference, base / "out")
    for rank in (0, 1):
        assert losses(base / "out", rank) == losses(reference, rank)
    return step


def test_sigterm_to_the_agent_and_every_worker_at_once_is_one_preemption(reference: Path, tmp_path: Path) -> None:
    """The scheduler signals every process; torchrun forwards the SIGTERM it got to its workers a few
    milliseconds later. Before: the forwarded copy was taken as "abort now": no preemption save,
    the workers died of SIGTERM, the steps since the last save lost."""
    sent: list[int] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if not sent and f"rank 1 step {TARGET}" in line:
            sent.extend([proc.pid, *worker_pids(tmp_path)])  # proc is torchrun's agent
            for pid in sent:
                os.kill(pid, signal.SIGTERM)

    _, out = run(torchrun(tmp_path), tmp_path, on_line)
    assert sent, out
    check_one_preemption_and_resume(reference, tmp_path, out)


def test_workers_whose_agent_was_sigkilled_save_exit_and_free_the_run(reference: Path, tmp_path: Path) -> None:
    """Before: with the agent SIGKILLed the workers trained on to the end, holding the run's lock, and
    a preemption at that point would have lost every step since the last save."""
    ended = tmp_path / "ended.json"
    killed: list[int] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if not killed and f"rank 1 step {TARGET}" in line:
            killed.append(int(Path(f"{ended}.agent").read_text()))
            os.kill(killed[0], signal.SIGKILL)

    code, out = run([sys.executable, "-c", REAPER, str(ended), *torchrun(tmp_path)], tmp_path, on_line)
    assert code == 0 and killed, out
    statuses = {int(pid): status for pid, status in json.loads(ended.read_text()).items()}
    assert statuses.pop(killed[0]) == -signal.SIGKILL
    assert statuses == dict.fromkeys(worker_pids(tmp_path), EXIT_PREEMPTED), out  # adopted, then reaped here
    assert "the launcher died" in out, out
    check_one_preemption_and_resume(reference, tmp_path, out)


def test_a_rank_still_exiting_when_the_agent_signals_it_exits_75_too(reference: Path, tmp_path: Path) -> None:
    """Rank 1 is still exiting after the preemption save when rank 0 has exited with 75, and torchrun's agent
    SIGTERMs it. Before: it ended by that SIGTERM (-15, and no exit record), although its checkpoint was
    saved (issue 35)."""
    sent: list[int] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if not sent and f"rank 1 step {TARGET}" in line:
            sent.append(worker_pids(tmp_path)[0])
            os.kill(sent[0], signal.SIGTERM)

    _, out = jobs.run(torchrun(tmp_path), dict(ENV, LINGER_RANK="1", LINGER_S="2"), 400, on_line,
                      workers=tmp_path / "out")
    assert sent, out
    assert f"Sending process {worker_pids(tmp_path)[1]} closing signal SIGTERM" in out, out  # while rank 1 exited
    check_one_preemption_and_resume(reference, tmp_path, out)


# ------------------------------------------------- several ranks, no blocking collective per step
def test_sigterm_to_one_worker_only_every_rank_saves_the_same_step_exits_75_and_resumes_bitwise(
        reference: Path, tmp_path: Path) -> None:
    """Only rank 1 gets the signal (not the agent, not rank 0). The ranks learn of it through the
    non-blocking reduction each step starts (unbroken.checkpointer.agreement): both act on it at the same later
    step, save that step together and exit 75."""
    sent: list[int] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if not sent and f"rank 1 step {TARGET}" in line:
            sent.append(worker_pids(tmp_path)[1])
            os.kill(sent[0], signal.SIGTERM)

    _, out = run(torchrun(tmp_path), tmp_path, on_line)
    assert sent, out
    check_one_preemption_and_resume(reference, tmp_path, out)


def test_time_triggers_disagreeing_across_ranks_save_the_same_steps_on_every_rank(reference: Path,
                                                                                    tmp_path: Path) -> None:
    """Rank r's time trigger is due every 0.01*(r+1) s (each rank reads its own clock), no step-count
    trigger: the ranks' own answers differ at many steps. Every save is a collective of both ranks,
    so a step saved by one rank alone would hang or fail the job: it ends, having saved several
    times, and trained exactly as the reference (the saves changed nothing)."""
    # 10 and 20 ms: due within a step or two whatever the machine's speed (at 30 and 60 ms, 16 fast steps of a
    # lightly loaded machine once held a single save: run 22 of docs/testing.md)
    code, out = run(torchrun(tmp_path, "--save-every", "1000", "--every-seconds", "0.01"), tmp_path)
    assert code == 0, out
    saved = [int(s) for s in re.findall(r"saved step (\d+) ", out)]
    assert len(saved) >= 2, out  # rank 0 logs each committed save
    assert same_final(reference, tmp_path / "out")
    for rank in (0, 1):
        assert losses(tmp_path / "out", rank) == losses(reference, rank)
