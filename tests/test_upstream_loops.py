"""PyTorch's own ``mnist`` and ``word_language_model`` examples, as a user adds unbroken to them
(``tests/upstream/``: the published scripts with synthetic data, tiny sizes and the unbroken lines
marked), killed and resumed with real signals, compared bitwise with an uninterrupted run, and
proved by ``unbroken selftest``.

Each script is run once uninterrupted (the reference) and once as a series of processes, each
interrupted at one point and the next resuming from the run folder:

1. SIGKILL inside an epoch;
2. SIGKILL right after the last step of an epoch (saved there: the resume is *inside* the epoch);
3. SIGKILL during the evaluation that follows it (resumed from the same checkpoint, again);
4. SIGTERM during a later evaluation (unbroken saves at the end of that epoch and exits 75);
5. SIGKILL inside the next save (half-way through a tensor file);
6. to the end.

Compared (``tests/upstream/harness.py`` records them): the loss of every step each process ran,
a digest of the whole state at the end of every epoch each process finished (the epoch-end work
done: ``StepLR``, the LR annealing of ``word_language_model``), and the final state — model,
optimizer, scheduler, data position, loop variables. Negative controls must not compare equal: for
``mnist``, the loader with its behaviour from before the epoch boundary existed (a resume at an
epoch's last step skipped that epoch's evaluation and ``StepLR`` step); for ``word_language_model``,
the carried hidden state left out of the restore.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unbroken.cli import app

pytestmark = pytest.mark.e2e

UPSTREAM = Path(__file__).resolve().parent / "upstream"
HARNESS = UPSTREAM / "harness.py"
SCRIPTS = {"mnist": UPSTREAM / "mnist_main.py", "wlm": UPSTREAM / "wlm_main.py"}
ARGS = {"mnist": ["--log-interval", "2"], "wlm": ["--log-interval", "2"]}  # a log line every other step
STEPS = {"mnist": 32, "wlm": 24}  # 4 epochs of 8 and of 6 steps; saves every 4 and every 3 steps
# (fault, exit status, the step the *next* process resumes from, and the epochs done there)
PLANS = {
    "mnist": [("step:6:SIGKILL", -9, 4, 0), ("step:16:SIGKILL", -9, 16, 1), ("eval:16:2:SIGKILL", -9, 16, 1),
              ("eval:24:1:SIGTERM", 75, 24, 3), ("save.mid_file=1", -9, 24, 3), (None, 0, None, None)],
    "wlm": [("step:4:SIGKILL", -9, 3, 0), ("step:12:SIGKILL", -9, 12, 1), ("eval:12:1:SIGKILL", -9, 12, 1),
            ("eval:18:1:SIGTERM", 75, 18, 3), ("save.mid_file=1", -9, 18, 3), (None, 0, None, None)],
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
for _var in ("UPSTREAM_FAULT", "UPSTREAM_BREAK", "UNBROKEN_FAULTS"):
    ENV.pop(_var, None)


def attempt(name: str, work: Path, fault: str | None = None, **env: str) -> subprocess.CompletedProcess:
    """One process of the script under the harness, in ``work`` (its run folder and files)."""
    return under_harness(SCRIPTS[name], work, fault, args=ARGS[name], **env)


def under_harness(script: Path, work: Path, fault: str | None = None, args: list[str] | tuple[str, ...] = (),
                  **env: str) -> subprocess.CompletedProcess:
    """One process of ``script`` (given ``args``) under the harness, in ``work``; ``fault``: a harness
    interruption (``step:N:SIGNAL``, ``eval:N:K:SIGNAL``) or a fault point (``save.mid_file=1``)."""
    child = dict(ENV, **env)
    if fault and fault.startswith("save."):
        child["UNBROKEN_FAULTS"] = fault
    elif fault:
        child["UPSTREAM_FAULT"] = fault
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(HARNESS), str(work), str(script), *args], cwd=work, env=child,
                          capture_output=True, text=True, timeout=600)


def records(work: Path, name: str) -> list[dict]:
    path = work / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name, work = request.param, tmp_path_factory.mktemp(f"{request.param}-reference")
    done = attempt(name, work)
    assert done.returncode == 0, done.stderr[-3000:]
    (work / "stdout.txt").write_text(done.stdout)
    assert [r["step"] for r in records(work, "steps.jsonl")] == list(range(1, STEPS[name] + 1))
    assert len(records(work, "epochs.jsonl")) == 4
    if name == "wlm":  # the validation loss did not improve once: the LR was annealed
        assert "lr 5.00" in done.stdout and "lr 20.00" in done.stdout
    return name, work


def compare(reference: Path, work: Path) -> dict[str, bool]:
    want_loss = {r["step"]: r["loss"] for r in records(reference, "steps.jsonl")}
    want_epoch = {r["step"]: r["state"] for r in records(reference, "epochs.jsonl")}
    got_steps, got_epochs = records(work, "steps.jsonl"), records(work, "epochs.jsonl")
    return {
        "every step's loss": {r["step"] for r in got_steps} == set(want_loss)
        and all(want_loss[r["step"]] == r["loss"] for r in got_steps),
        "the state at every epoch's end": {r["step"] for r in got_epochs} == set(want_epoch)
        and all(want_epoch[r["step"]] == r["state"] for r in got_epochs),
        "the final state": records(work, "final.json") == records(reference, "final.json"),
    }


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_killed_everywhere_around_the_epoch_boundary_resumes_bitwise(reference: tuple[str, Path],
                                                                    tmp_path: Path) -> None:
    name, ref = reference
    work, lines = tmp_path / "interrupted", set()
    for i, (fault, code, _, _) in enumerate(PLANS[name]):
        done = attempt(name, work, fault)
        assert done.returncode == code, (i, fault, done.stderr[-3000:])
        if fault and "SIGTERM" in fault:
            assert "preempted at step" in done.stdout
        lines |= printed(done.stdout)
    # what the script printed is true: the processes together printed the uninterrupted run's log lines
    # (the batch index of a resumed epoch, the running loss since the last line), and no other
    want = printed((ref / "stdout.txt").read_text())
    assert lines == want, {"printed, not in the uninterrupted run": sorted(lines - want),
                           "missing": sorted(want - lines)}
    # what each process resumed from: the step, and the epochs done there (inside the epoch at its last
    # step; after the SIGTERM, the epoch whose evaluation it arrived in is done)
    starts = [(r["resumed_from"], r["progress"]["epoch"]) for r in records(work, "attempts.jsonl")]
    assert starts == [(None, 0)] + [(step, done) for _, _, step, done in PLANS[name][:-1]], starts
    result = compare(ref, work)
    assert all(result.values()), result
    # the processes resumed at an epoch's last step ran that epoch's end work, once in the result
    ends = [r["step"] for r in records(work, "epochs.jsonl")]
    assert ends.count(STEPS[name] // 2) == 1 and len(set(ends)) == 4, ends


_TIMING = re.compile(r"(ms/batch|time:)\s*[\d.]+s?")


def printed(stdout: str) -> set[str]:
    """The script's own log lines (training, evaluation), their timings left out."""
    return {_TIMING.sub(r"\1 _", line) for line in stdout.splitlines()
            if line.startswith(("Train Epoch", "Test set", "| "))}


# the negative control of each script: what is broken, and where the process is killed
BROKEN = {"mnist": ("old-loader", "step:16:SIGKILL"), "wlm": ("no-hidden", "step:4:SIGKILL")}


def test_a_broken_resume_is_caught(reference: tuple[str, Path], tmp_path: Path) -> None:
    """Negative control (see the module docstring): the same comparison, one thing broken."""
    name, ref = reference
    work, (broken, fault) = tmp_path / "broken", BROKEN[name]
    assert attempt(name, work, fault, UPSTREAM_BREAK=broken).returncode == -9
    assert attempt(name, work, UPSTREAM_BREAK=broken).returncode == 0
    result = compare(ref, work)
    assert not result["the final state"] and not result["the state at every epoch's end"], result


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_selftest_finds_the_upstream_script_identical(reference: tuple[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    name, _ = reference
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = CliRunner().invoke(app, ["selftest", "--steps", str(STEPS[name]), "--kills", "3", "--seed", "4",
                                   "--timeout", "300", "--json", "--", sys.executable, str(SCRIPTS[name])])
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["verdict"] == "identical", (doc.get("divergence"), doc.get("error"),
                                                                   doc.get("stderr_tail"))
    ended = [a["ended"] for a in doc["attempts"]]
    # the 3 random interruptions, plus the targeted ones (an epoch's last step, the epoch-end work)
    extra = [p for p in doc["plan"] if p["why"] or p["kind"] == "between"]
    assert len(doc["plan"]) == 3 + len(extra) and ended[-1] == f"finished at step {STEPS[name]}", (doc["plan"], ended)
    assert len(ended) == len(doc["plan"]) + 1, ended
    if name == "mnist":  # its evaluation runs after every epoch: the selftest interrupted it there too
        assert "between" in [p["kind"] for p in extra], doc["plan"]
    assert doc["compared"]["rerun_steps"] >= 1
