"""A loop without a DataLoader that fetches its next batch inside the step (nanoGPT's ``train.py``, in
``tests/upstream/gpt_train.py`` with the unbroken lines marked), killed and resumed with real signals at
random iterations, during an evaluation, inside a save, and preempted, compared bitwise with an
uninterrupted run (the harness of ``test_upstream_loops.py``: every step's loss, the final state).

The shape: each batch is drawn from the global torch RNG (``torch.randint``), and the next one is drawn
before ``ckpt.step()``. unbroken saves the RNG after that draw, so the batch fetched ahead must be saved
too (an ``unbroken.Vars`` of ``X`` and ``Y``: three lines, ``docs/your-loop.md``); the negative control
restores without it and must not compare equal.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from test_upstream_loops import compare, records, under_harness
from typer.testing import CliRunner

from unbroken.cli import app

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parent / "upstream" / "gpt_train.py"
MAX_ITERS, SAVE_EVERY, EVAL_INTERVAL = 30, 4, 10  # as in the script: steps 1..31, an evaluation before 1, 11, 21, 31


def attempt(work: Path, fault: str | None = None, **env: str):
    return under_harness(SCRIPT, work, fault, **env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("gpt-reference")
    done = attempt(work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in records(work, "steps.jsonl")] == list(range(1, MAX_ITERS + 2))
    assert done.stdout.count(": train loss ") == 4  # the evaluations drew their batches too
    return work


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_killed_at_random_iterations_in_an_evaluation_inside_a_save_and_preempted_resumes_bitwise(
        reference: Path, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    kill_at = rnd.randint(2, 17)    # SIGKILL right after this step (its save, if any, committed)
    term_at = rnd.randint(21, 26)   # SIGTERM right after this step: the next step is saved, exit 75
    plan = [(f"step:{kill_at}:SIGKILL", -9, kill_at // SAVE_EVERY * SAVE_EVERY),
            ("eval:20:2:SIGKILL", -9, 20),           # during the evaluation that follows step 20 (saved)
            (f"step:{term_at}:SIGTERM", 75, term_at + 1),
            ("save.mid_file=1", -9, term_at + 1),    # the next save, half-way through a tensor file
            (None, 0, None)]
    work = tmp_path / "interrupted"
    for i, (fault, code, _) in enumerate(plan):
        done = attempt(work, fault)
        assert done.returncode == code, (seed, i, fault, done.stderr[-3000:])
    resumed = [r["resumed_from"] for r in records(work, "attempts.jsonl")]
    assert resumed == [None] + [step or None for _, _, step in plan[:-1]], (seed, resumed)
    result = compare(reference, work)
    assert all(result.values()), (seed, result)


def test_without_the_batch_fetched_ahead_the_resume_is_caught(reference: Path, tmp_path: Path) -> None:
    """Negative control: the same loop restored without ``fetched`` (as the README's five lines alone
    would leave it) draws the batch after the one it had fetched, and every later draw shifts."""
    work = tmp_path / "broken"
    assert attempt(work, "step:6:SIGKILL", UPSTREAM_BREAK="no-fetched").returncode == -9
    assert attempt(work, UPSTREAM_BREAK="no-fetched").returncode == 0
    result = compare(reference, work)
    assert not result["every step's loss"] and not result["the final state"], result


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_selftest_finds_the_loop_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = CliRunner().invoke(app, ["selftest", "--steps", str(MAX_ITERS + 1), "--kills", "2", "--seed", "5",
                                   "--timeout", "300", "--json", "--", sys.executable, str(SCRIPT)])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["verdict"] == "identical", (doc.get("divergence"), doc.get("error"),
                                                                   doc.get("stderr_tail"))
    assert doc["compared"]["rerun_steps"] >= 1  # (seed 5: a kill between saves, so a step really ran twice)
