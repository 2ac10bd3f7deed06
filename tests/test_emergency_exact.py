"""An emergency checkpoint is exact or it is not written (issue 23 §6).

Each case runs real processes of ``tests/emergency_train.py``: one raises at a chosen point of
one step (exit status 1, through ``ckpt.guard``), the next resumes from the run folder and trains
to the end. The final parameters, optimizer state, scheduler, scaler and EMA must be bitwise
those of an uninterrupted run; the run folder must hold an emergency checkpoint exactly when the
library could prove it describes one instant, and the log must say why when it did not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import unbroken

SCRIPT = Path(__file__).with_name("emergency_train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def job(run: Path, out: Path, loop: str, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPT), "--run", str(run), "--out", str(out), "--loop", loop, *args],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == rc, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def final(out: Path) -> tuple[dict, str]:
    return load_file(str(out / "final.safetensors")), (out / "final.json").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of each loop, computed once."""
    done: dict[str, tuple[dict, str]] = {}

    def get(loop: str) -> tuple[dict, str]:
        if loop not in done:
            base = tmp_path_factory.mktemp(f"ref-{loop}")
            job(base / "run", base / "out", loop)
            done[loop] = final(base / "out")
        return done[loop]

    return get


def assert_bitwise(got: tuple[dict, str], want: tuple[dict, str]) -> None:
    tensors, other = got
    assert tensors.keys() == want[0].keys()
    different = [k for k in tensors if not (tensors[k].dtype == want[0][k].dtype and tensors[k].equal(want[0][k]))]
    assert not different, different
    assert json.loads(other) == json.loads(want[1])


def checkpoints(run: Path) -> list[tuple[int, str]]:
    return sorted((c.step, c.kind) for c in unbroken.Checkpointer(run, preemption=None).checkpoints())


# (loop, failing step, point, checkpoints after the failure, what the log says)
CASES = {
    # the optimizer step was skipped (inf loss) but scaler.update() and scheduler.step() ran:
    # the checkpoint of the step's start, with the scaler and scheduler as they were then
    "gradscaler skipped the step": ("scaler", 5, "after the bookkeeping", [(3, "regular"), (4, "emergency")],
                                    "emergency checkpoint of the state at its start"),
    "loop skipped optimizer.step on a bad loss": ("skip", 5, "after the bookkeeping",
                                                  [(3, "regular"), (4, "emergency")],
                                                  "emergency checkpoint of the state at its start"),
    # the first step of a fresh process: the optimizer stepped, the scheduler not yet
    "first step of a fresh process": ("plain", 1, "after optimizer.step", [],
                                      "has no committed checkpoint yet: the restart starts from scratch"),
    # some optimizers stepped, others not
    "one of two optimizers stepped": ("two", 5, "between the optimizers", [(3, "regular")],
                                      "state['head_optimizer'] (another optimizer) did not"),
    # an EMA copy updated after a skipped step cannot be put back: no checkpoint
    "EMA updated after a skipped step": ("ema", 5, "after the bookkeeping", [(3, "regular")],
                                         "the parameters of state['ema'] changed without an optimizer step"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_an_emergency_checkpoint_is_exact_or_not_written(reference, tmp_path: Path, case: str) -> None:
    loop, step, point, after, says = CASES[case]
    run, out = tmp_path / "run", tmp_path / "out"
    failed = job(run, out, loop, "--fail-at", str(step), "--fail-point", point, rc=1)
    assert f"injected failure {point} in step {step}" in failed.stderr
    written = checkpoints(run)
    job(run, out, loop)
    assert_bitwise(final(out), reference(loop))
    assert written == after
    assert says in failed.stderr, failed.stderr[-3000:]
    if not any(kind == "emergency" for _, kind in after):
        assert "no emergency checkpoint" in failed.stderr


def test_an_exception_in_the_first_step_after_a_resume(reference, tmp_path: Path) -> None:
    """A process resumes at step 3 and raises in its first step, after optimizer.step() and before
    scheduler.step(): nothing learned in earlier steps, the checkpoint would mix two steps."""
    run, out = tmp_path / "run", tmp_path / "out"
    job(run, out, "plain", "--steps", "3")
    failed = job(run, out, "plain", "--fail-at", "4", "--fail-point", "after optimizer.step", rc=1)
    assert "resumed from step 3" in failed.stdout
    written = checkpoints(run)
    job(run, out, "plain")
    assert_bitwise(final(out), reference("plain"))
    assert written == [(3, "regular")]
    assert "no emergency checkpoint: state['scheduler'] (an LR scheduler) has not stepped" in failed.stderr
    assert "resumes from the last committed checkpoint, step-000000003" in failed.stderr


def test_an_exception_after_the_bookkeeping_of_a_first_step_keeps_the_step(reference, tmp_path: Path) -> None:
    """The proof accepts a finished first step: the scheduler stepped since the optimizer did."""
    run, out = tmp_path / "run", tmp_path / "out"
    job(run, out, "plain", "--steps", "3")
    failed = job(run, out, "plain", "--fail-at", "4", "--fail-point", "after the bookkeeping", rc=1)
    assert "emergency checkpoint of the post-step state" in failed.stderr
    assert checkpoints(run) == [(3, "regular"), (4, "emergency")]
    job(run, out, "plain")
    assert_bitwise(final(out), reference("plain"))


def test_plain_values_are_kept_at_the_step_start(tmp_path: Path) -> None:
    """A plain value in the state (not a Stateful object) changed in place before the failure is
    saved as it was at the step's start; a plain tensor changed in place cannot be put back, so
    no emergency checkpoint is written."""
    import torch

    def run(run_dir: Path, extra: dict) -> list:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "optimizer": opt, **extra}
        ckpt = unbroken.Checkpointer(run_dir, save_every=100, keep_last=None, preemption=None)
        with pytest.raises(RuntimeError, match="bad batch"), ckpt.guard(state):
            for step in range(1, 4):
                if "stats" in state:
                    state["stats"]["tokens"] += 8  # the step's bookkeeping, before the failure
                if "seen" in state:
                    state["seen"].add_(1)
                if step == 3:
                    raise RuntimeError("bad batch")
                model(torch.ones(1, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step(state)
        ckpt.close()
        return [(c.step, c.kind) for c in ckpt.checkpoints()]

    assert run(tmp_path / "a", {"stats": {"tokens": 0}}) == [(2, "emergency")]
    state = {"model": torch.nn.Linear(4, 2), "stats": {"tokens": -1}}
    with unbroken.Checkpointer(tmp_path / "a", preemption=None, strict=False) as ckpt:
        ckpt.restore(state)
    assert state["stats"] == {"tokens": 16}  # two steps done: the start of step 3
    assert run(tmp_path / "b", {"seen": torch.zeros(())}) == []


def test_a_large_plain_value_is_not_copied_at_every_step_and_gets_no_emergency_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A long history list kept as a plain value: copying it at every step start would cost O(n) per
    step, so it is not copied, and a step that raises gets no emergency checkpoint (it could not be
    proven exact); the log says why and names the fix."""
    import logging

    import torch

    from unbroken.faults import guard

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt, "history": [0.0] * (guard.PLAIN_MAX_LEAVES + 1)}
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=100, keep_last=None, preemption=None)
    caplog.set_level(logging.INFO, logger="unbroken")
    with pytest.raises(RuntimeError, match="bad batch"), ckpt.guard(state):
        for step in range(1, 4):
            if step == 3:
                raise RuntimeError("bad batch")
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            state["history"].append(float(step))
            ckpt.step(state)
    ckpt.close()
    assert ckpt.checkpoints() == []
    assert "too large to copy at every step start" in caplog.text and "Stateful" in caplog.text
