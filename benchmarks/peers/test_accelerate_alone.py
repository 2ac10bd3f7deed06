"""Accelerate's own checkpointing under the faults of tests/test_integration_accelerate.py: measured.

The job is tests/accel_train.py ``--mode alone``: the same model, loop, accumulation, clipping and
epoch-end evaluation, on 2 CPU processes under ``accelerate launch``, checkpointed by Accelerate's
documented recipe done carefully: ``accelerator.save_state(ckpt/step_N)`` every 4 steps; on start
``load_state`` of the newest ``step_N``, then ``skip_first_batches`` over the restored steps'
batches of their epoch; a ``DataLoader(shuffle=True)`` with ``use_seedable_sampler`` and
``set_epoch``, so the data order is a function of the epoch. Each test compares a faulted run with
the uninterrupted one and asserts what Accelerate 1.15 does: where it is bitwise and where not. The
numbers go into the "Accelerate alone" column of docs/integrations.md; they fail if it changes.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from test_integration_accelerate import (
    SCRIPT,
    STEPS,
    differing,
    global_samples,
    launch,
    launch_cmd,
    logged_steps,
    rows,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CUT = 8


def alone(n: int, base: Path, *extra: str, fsdp: bool = False, restarts: int = 0) -> list[str]:
    return launch_cmd(n, base, *extra, fsdp=fsdp, restarts=restarts, mode="alone")


_references: dict[bool, Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted 2-process run of the recipe (DDP or FSDP2), its state dumped after step CUT."""
    def get(fsdp: bool) -> Path:
        if fsdp not in _references:
            base = tmp_path_factory.mktemp(f"accel-alone-{'fsdp' if fsdp else 'ddp'}")
            code, out = launch(alone(2, base, "--dump-at", str(CUT), fsdp=fsdp), base)
            assert code == 0 and out.count(f"fsdp2={fsdp}") == 2, out
            assert sorted(p.name for p in (base / "ckpt").iterdir()) == ["step_12", "step_4", "step_8"]
            _references[fsdp] = base
        return _references[fsdp]

    return get


def kill_rank_1_after(step: int, out: Path, sent: list[int]):
    """Process 1 SIGKILLed after ``step`` (run with ``--wait-at step``: the processes wait there)."""
    def on_line(line: str, proc) -> None:
        if not sent and f"rank 1 step {step}" in line:
            sent.append(int((out / "pid-r1").read_text()))
            os.kill(sent[0], signal.SIGKILL)
            (out / f"go-{step}").touch()

    return on_line


def test_a_rank_sigkilled_resumes_from_the_last_save_but_not_bitwise(reference, tmp_path) -> None:
    """Measured: process 1 killed after step 6, torchrun restarts both, which resume from step 4:
    steps 5 and 6 are lost and computed again. Every step trains on the same samples, but the
    losses differ from the first step after the resume on, and so do both evaluations and the final
    weights and moments."""
    ref, out, sent = reference(False) / "out", tmp_path / "out", []
    code, log = launch(alone(2, tmp_path, "--wait-at", "6", restarts=1), tmp_path, kill_rank_1_after(6, out, sent))
    assert code == 0 and sent and log.count("resumed from step 4 (step_4)") == 2, log
    assert logged_steps(out, 1) == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]
    for rank in (0, 1):
        want, got = rows(ref, rank), rows(out, rank)
        assert all(got[s] == want[s] for s in range(1, 5))  # before the kill
        assert all(got[s][1] == want[s][1] for s in got)  # the data position is right
        assert all(got[s][0] != want[s][0] for s in range(5, STEPS + 1))  # the dropout masks are not
        assert rows(out, rank, "eval") != rows(ref, rank, "eval")
    assert {k.split("/")[0] for k in differing(ref / "final.safetensors", out / "final.safetensors")} == {
        "model", "optimizer"}  # the LR and accelerator.step are restored; weights and moments differ


def test_the_only_difference_is_where_load_state_puts_the_rng_back(reference, tmp_path) -> None:
    """The same fault, with the torch RNG state ``load_state`` restored set again once the resumed
    epoch's iterator has drawn its seed from it (at its first batch): every loss, evaluation and the
    final state are bitwise the uninterrupted run's. ``load_state`` restores the RNG before that
    iterator exists; its creation draws from the restored stream, so dropout is one draw off."""
    ref, out, sent = reference(False) / "out", tmp_path / "out", []
    code, log = launch(alone(2, tmp_path, "--rng-after-iter", "--wait-at", "6", restarts=1), tmp_path,
                       kill_rank_1_after(6, out, sent))
    assert code == 0 and sent and log.count("resumed from step 4 (step_4)") == 2, log
    assert differing(ref / "final.safetensors", out / "final.safetensors") == []
    for rank in (0, 1):
        assert rows(out, rank) == rows(ref, rank) and rows(out, rank, "eval") == rows(ref, rank, "eval")


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_killed_inside_save_state_every_restart_crashes(tmp_path, fsdp) -> None:
    """Process 0 SIGKILLed inside ``save_state`` of step 8, once the model and optimizer are written
    (DDP: ``model.safetensors``, ``optimizer.bin``; FSDP2: DCP folders), before ``scheduler.bin``
    and its RNG file. ``save_state`` writes straight into ``step_8/``, which is then the newest
    folder: both processes crash in ``load_state`` at every restart (2 of 2) with
    ``FileNotFoundError`` for ``scheduler.bin``, until someone deletes the folder."""
    code, log = launch(alone(2, tmp_path, "--kill-in-save", str(CUT), fsdp=fsdp, restarts=2), tmp_path)
    assert code != 0 and f"rank 0: killed inside save_state of step {CUT}, before scheduler.bin" in log, log
    names = {p.name for p in (tmp_path / "ckpt" / f"step_{CUT}").iterdir()}
    written = {"optimizer_0", "pytorch_model_fsdp_0"} if fsdp else {"model.safetensors", "optimizer.bin"}
    assert written <= names and not {"scheduler.bin", "random_states_0.pkl"} & names, names
    missing = f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path}/ckpt/step_{CUT}/scheduler.bin'"
    # each of the 2 restarted rounds crashes on it: both processes, or one whose crash ends the round
    # (torchrun then stops the other, which may not have reached load_state yet)
    assert 2 <= log.count(missing) <= 4, log
    assert ": done" not in log


def test_sigterm_kills_every_process_and_the_steps_since_the_save_are_lost(tmp_path) -> None:
    """Neither Accelerate nor the recipe handles SIGTERM: the launcher and both processes die of
    it after step 6 (no process exits through Python: no status written), nothing is saved, the
    newest checkpoint is step 4."""
    out, sent, parked = tmp_path / "out", [], set()

    def on_line(line: str, proc) -> None:
        for rank in (0, 1):
            if f"rank {rank} step 6" in line:
                parked.add(rank)  # logged step 6, now waiting for go-6
        if not sent and parked == {0, 1}:  # both, not only the first to log it
            for pid in [proc.pid] + [int(f.read_text()) for f in sorted(out.glob("pid-r*"))]:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
            (out / "go-6").touch()

    code, log = launch(alone(2, tmp_path, "--wait-at", "6"), tmp_path, on_line)
    assert code != 0 and len(sent) == 3, log
    assert not list(out.glob("exit-r*")) and ": done" not in log, log
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_4"]
    assert logged_steps(out, 0) == logged_steps(out, 1) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_checkpoint_of_2_processes_resumes_on_1(reference, tmp_path, fsdp) -> None:
    """Measured: this works with Accelerate alone too (DDP's weights, FSDP2's DCP shards resharded):
    the restored weights, moments, LR and ``accelerator.step`` are bitwise the saved ones, and with
    the seedable sampler, the same global batch and the recipe's skip arithmetic every later step
    trains on the samples of the uninterrupted run (process 0's RNG file is used; process 1's is left)."""
    ref = reference(fsdp)
    shutil.copytree(ref / "ckpt", tmp_path / "ckpt")
    args = ["--batch", "8", "--resume-from", str(tmp_path / "ckpt" / f"step_{CUT}"), "--dump-restored"]
    cmd = alone(1, tmp_path, *args, fsdp=True) if fsdp else [
        sys.executable, SCRIPT, "--mode", "alone", "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
        "--steps", str(STEPS), *args]
    code, log = launch(cmd, tmp_path)
    assert code == 0 and f"resumed from step {CUT} (step_{CUT})" in log, log
    assert differing(ref / "out" / f"state-{CUT}.safetensors", tmp_path / "out" / "restored.safetensors") == []
    want, got = global_samples(ref / "out"), global_samples(tmp_path / "out")
    assert sorted(got) == list(range(CUT + 1, STEPS + 1)) and all(got[s] == want[s] for s in got)
