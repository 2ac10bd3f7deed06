"""End to end: real training subprocesses killed with real SIGKILLs, resumed, compared bitwise.

Every run is the demo's training job (unbroken.demo.train): dropout, shuffled data,
random augmentation, AdamW, warmup+cosine, gradient accumulation, GradScaler. The
uninterrupted reference run is made once; each test then kills and resumes a run
and compares final parameters, optimizer state, scheduler, scaler and every logged
per-step loss bitwise. The kill schedules are seeded, so a failure reproduces.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from unbroken.demo import compare, run_attempt

pytestmark = pytest.mark.e2e

STEPS, SAVE_EVERY, HIDDEN = 60, 5, 256
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out",
            str(base / "out"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--hidden", str(HIDDEN), "--seed", "3", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    att = run_attempt(cmd(base), "none", "", ENV)
    assert att.ended == "finished" and att.last_step == STEPS
    return base / "out"


def finish(base: Path, *extra: str) -> None:
    att = run_attempt(cmd(base, *extra), "none", "", ENV)
    assert att.ended == "finished", att


def committed(run: Path) -> list[Path]:
    return [p for p in run.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "quarantine"]


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_at_random_steps(reference: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    targets = sorted(rng.sample(range(2, STEPS - 3), 4))
    resumed_from = []
    for target in targets:
        att = run_attempt(cmd(tmp_path), "step", str(target), ENV)
        assert att.ended.startswith("killed"), att
        resumed_from.append(att.started)
    finish(tmp_path)
    assert resumed_from[0] == "fresh start"
    assert any(s.startswith("resumed from step") for s in resumed_from[1:]), resumed_from
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), (targets, results)


@pytest.mark.parametrize("point,nth", [("save.mid_file", 1), ("save.before_manifest", 2),
                                       ("save.before_commit", 3), ("save.after_commit", 2)])
def test_sigkill_inside_a_save(reference: Path, tmp_path: Path, point: str, nth: int) -> None:
    att = run_attempt(cmd(tmp_path), "save", f"{point}={nth}", ENV)
    assert att.ended.startswith("killed in a save"), att
    run = tmp_path / "run"
    died_at = nth * SAVE_EVERY
    names = {p.name for p in committed(run)}
    if point == "save.after_commit":
        assert f"step-{died_at:09d}" in names
    else:
        # the interrupted save left only a hidden staging folder, never a visible checkpoint
        assert f"step-{died_at:09d}" not in names
        assert any(p.name.startswith(".staging-") for p in run.iterdir())
    assert all((p / "manifest.json").is_file() for p in committed(run))
    finish(tmp_path)
    assert not any(p.name.startswith(".staging-") for p in run.iterdir()), "stale staging not cleaned"
    assert not (run / "quarantine").exists(), "a killed save must not look like corruption"
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_many_kills_mixed_with_changing_worker_counts(reference: Path, tmp_path: Path) -> None:
    """External kills and save kills interleaved, each attempt with another DataLoader worker count."""
    rng = random.Random(7)
    plan = [("step", str(rng.randint(3, 15))), ("save", "save.mid_file=2"), ("step", str(rng.randint(30, 40))),
            ("save", "save.before_commit=1"), ("step", str(rng.randint(45, 55)))]
    for (kind, arg), workers in zip(plan, [0, 2, 4, 0, 2], strict=True):
        att = run_attempt(cmd(tmp_path, "--workers", str(workers)), kind, arg, ENV)
        assert att.ended != "finished", (kind, arg, att)
    finish(tmp_path, "--workers", "1")
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.parametrize("omit,broken", [("rng", "parameters"), ("scheduler", "scheduler + scaler"),
                                         ("data", "parameters")])
def test_comparison_catches_forgotten_state(reference: Path, tmp_path: Path, omit: str, broken: str) -> None:
    """Negative control: the same kill/resume with part of the state left out must NOT compare equal."""
    att = run_attempt(cmd(tmp_path, "--omit", omit), "step", "23", ENV)
    assert att.ended.startswith("killed")
    finish(tmp_path, "--omit", omit)
    results = compare(reference, tmp_path / "out")
    assert not results[broken], results
    assert not results["per-step losses"], results


def test_uninterrupted_runs_are_deterministic(reference: Path, tmp_path: Path) -> None:
    """Two uninterrupted runs agree, so any difference above comes from the resume."""
    finish(tmp_path)
    assert all(compare(reference, tmp_path / "out").values())


def test_an_attempt_that_hangs_is_killed_at_its_bound_and_fails_clearly(tmp_path: Path) -> None:
    """The harness's own wait is bounded: a training process that prints a step and then hangs is killed
    when the attempt's time is up, and the attempt fails naming the bound (it waited forever before)."""
    hang = [sys.executable, "-c", "import sys, time; print('step 1', flush=True); "
            "print('hanging', file=sys.stderr, flush=True); time.sleep(600)"]
    with pytest.raises(RuntimeError, match=r"still ran after 2 s and was killed:\nhanging"):
        run_attempt(hang, "none", "", dict(os.environ), timeout=2)
