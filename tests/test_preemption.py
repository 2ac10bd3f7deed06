"""Preemption and failures through real processes: signals, exceptions, torchrun restarts.

The training job is the demo's (unbroken.demo.train). A signal (SIGTERM, SIGUSR1) sent
at a random step must lose no completed step: the process saves at the next step
boundary, exits with EXIT_PREEMPTED, and the next attempt resumes from exactly that
step. An exception raised before or after optimizer.step() leaves an exact emergency
checkpoint. Every run ends bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.demo import compare, run_attempt
from unbroken.faults import EXIT_PREEMPTED

pytestmark = pytest.mark.e2e

STEPS, SAVE_EVERY, HIDDEN = 40, 10, 128
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out",
            str(base / "out"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--hidden", str(HIDDEN), "--seed", "5", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    assert run_attempt(cmd(base), "none", "", ENV).ended == "finished"
    return base / "out"


def started_step(att) -> int:
    return int(att.started.split()[-1]) if att.started.startswith("resumed") else 0


@pytest.mark.parametrize("signame,seed", [pytest.param("SIGTERM", 1, marks=pytest.mark.slow), ("SIGUSR1", 2),
                                          pytest.param("SIGINT", 3, marks=pytest.mark.slow)])  # one in the fast tier
def test_signal_at_random_steps_loses_no_step(reference: Path, tmp_path: Path, signame: str, seed: int) -> None:
    rng = random.Random(seed)
    targets = sorted(rng.sample(range(1, STEPS - 2), 3))
    resume_at = 0
    for target in targets:
        att = run_attempt(cmd(tmp_path), "signal", f"{signame}@{target}", ENV)
        assert att.rc == EXIT_PREEMPTED, att
        assert started_step(att) == resume_at
        preempted = int(att.ended.split()[-1])
        # no completed step is lost: the save holds the last step the process finished
        assert preempted == att.last_step >= target, att
        resume_at = preempted
    final = run_attempt(cmd(tmp_path), "none", "", ENV)
    assert started_step(final) == resume_at
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), (targets, results)


@pytest.mark.parametrize("where,seed", [("before", 4), ("after", 5), ("both", 6)])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_exceptions_give_exact_emergency_checkpoints(reference: Path, tmp_path: Path, where: str,
                                                     seed: int) -> None:
    rng = random.Random(seed)
    steps = sorted(rng.sample([s for s in range(2, STEPS) if s % SAVE_EVERY != 1], 3))
    flags: list[str] = []
    for i, s in enumerate(steps):
        kind = where if where != "both" else ("before", "after")[i % 2]
        flags += [f"--crash-{kind}-opt", str(s)]
    expected = []
    for i, s in enumerate(steps):
        kind = where if where != "both" else ("before", "after")[i % 2]
        expected.append(s - 1 if kind == "before" else s)
    starts = []
    for _ in steps:
        att = run_attempt(cmd(tmp_path, *flags), "none", "", ENV, ok_codes=(1,))
        assert att.rc == 1 and "injected failure" in att.stderr, att
        assert "emergency checkpoint" in att.stderr, att.stderr
        starts.append(started_step(att))
    final = run_attempt(cmd(tmp_path, *flags), "none", "", ENV)
    starts.append(started_step(final))
    # each attempt resumes exactly where the failed step left the state: its start
    # (exception before optimizer.step) or its end (after)
    assert starts == [0] + expected, (steps, starts)
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), (steps, results)


@pytest.mark.slow
def test_torchrun_restarts_resume_automatically(reference: Path, tmp_path: Path) -> None:
    """torchrun --max-restarts restarts the crashed worker; restore() needs no extra code."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "--max-restarts=3", "--monitor-interval=0.5", "-m", "unbroken.demo.train", "--run-dir",
         str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--steps", str(STEPS), "--save-every",
         str(SAVE_EVERY), "--hidden", str(HIDDEN), "--seed", "5", "--crash-before-opt", "7",
         "--crash-after-opt", "18", "--crash-before-opt", "33"],
        capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("resumed from step") == 3, out.stdout
    for s in ("resumed from step 6", "resumed from step 18", "resumed from step 32"):
        assert s in out.stdout, out.stdout
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results
