"""HF Trainer alone on 2 ranks, under the faults of tests/test_integration_hf_dist.py: what it loses, measured (moved
from that file; the numbers go into the "alone" columns of the docs, and each run still asserts them, so a peer that
changes is noticed). Run by ``make bench-peers`` (benchmarks/peers/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest

from test_integration_hf_dist import (  # noqa: F401 (fixtures)
    ALONE,
    CUT,
    SAVE_EVERY,
    STEPS,
    all_rows,
    differing,
    env,
    errors,
    global_samples,
    launch,
    pid,
    reference,
    rows,
    starts,
    torchrun,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("stack", ALONE)
def test_hf_alone_sigkill_and_sigterm_lose_the_steps_since_its_last_save(stack, reference, env, tmp_path) -> None:  # noqa: F811 - pytest fixtures
    """Rank 1 SIGKILLed after step 5 (HF saved step 3), then SIGTERM to both ranks after step 8 (HF saved
    step 6); torchrun restarts the group each time, HF resumes with ``resume_from_checkpoint=True``."""
    ref = reference(stack, "hf")
    sent: dict[str, list[int]] = {"kill": [], "term": []}
    rounds: list[int] = []

    def on_line(line: str, proc) -> None:
        if m := re.search(r"rank 0: (resumed from step (\d+)|fresh start)", line):
            rounds.append(int(m.group(2) or 0))
        m = re.search(r"rank 1 step (\d+)", line)
        if m is None:
            return
        step = int(m.group(1))
        if len(rounds) == 1 and step >= 5 and not sent["kill"]:
            sent["kill"].append(pid(tmp_path, 1))
            os.kill(sent["kill"][0], signal.SIGKILL)
        elif len(rounds) == 2 and step >= 8 and not sent["term"]:
            for rank in (0, 1):
                sent["term"].append(pid(tmp_path, rank))
                os.kill(sent["term"][-1], signal.SIGTERM)

    code, out = launch(torchrun(2, tmp_path, stack, "hf", restarts=2), env, tmp_path, on_line)
    assert code == 0 and sent["kill"] and sent["term"], out[-5000:]
    # SIGTERM is not handled (the ranks die, nothing is saved); each restart resumes from HF's last save:
    # the steps since then are lost and recomputed (4 and 5, 7 and 8)
    assert starts(out) == [0, SAVE_EVERY, 2 * SAVE_EVERY], out[-5000:]
    got = tmp_path / "out"
    # measured: the parameters, moments and every step's losses and samples, the recomputed ones included,
    # are bitwise the uninterrupted run's (HF saves every rank's RNG) ...
    assert not differing(ref / "final.safetensors", got / "final.safetensors")
    for rank in (0, 1):
        assert [r for r in all_rows(got, rank) if r != rows(ref, rank)[r["step"]]] == []
    # ... the log is not: the first loss logged after a resume averages fewer steps, train_loss covers the
    # last process only
    final, ref_final = (json.loads((p / "final.json").read_text()) for p in (got, ref))
    assert final["train_loss"] != ref_final["train_loss"] and final["log_history"] != ref_final["log_history"]
    print(f"measured, {stack} HF alone: SIGKILL after step 5 -> resumed at 3, SIGTERM after step 8 -> resumed at 6; "
          f"train_loss {final['train_loss']} vs {ref_final['train_loss']} uninterrupted")



@pytest.mark.parametrize("stack", ALONE)
def test_hf_alone_killed_inside_its_save_cannot_resume(stack, env, tmp_path) -> None:  # noqa: F811 - a pytest fixture
    """Rank 0 SIGKILLed inside HF's save of step 6, after the weights, before the optimizer and
    ``trainer_state.json``; torchrun restarts the group twice."""
    code, out = launch(torchrun(2, tmp_path, stack, "hf", "--hf-kill-in-save", "2", "--kill-rank", "0",
                                restarts=2), env, tmp_path)
    torn = tmp_path / "out" / "hf" / f"checkpoint-{CUT}"
    held = sorted(p.name for p in torn.iterdir())
    # every restart picks the torn checkpoint (the highest-numbered folder) and crashes: the run is stuck
    assert code != 0 and starts(out) == [0], out[-5000:]
    crashes = [e for e in errors(out) if e.startswith("FileNotFoundError") and
               f"checkpoint-{CUT}/trainer_state.json" in e]
    assert len(crashes) == 2 and "trainer_state.json" not in held, out[-5000:]
    print(f"measured, {stack} HF alone: killed inside the save of step {CUT}: 2 of 2 restarts crashed "
          f"({crashes[0].split(':')[0]}); the torn folder holds {held}")



@pytest.mark.parametrize("stack", ALONE)
def test_hf_alone_saved_by_two_ranks_resumed_on_one(stack, reference, env, tmp_path) -> None:  # noqa: F811 - pytest fixtures
    ref = reference(stack, "hf")
    shutil.copytree(ref / "hf" / f"checkpoint-{CUT}", tmp_path / "out" / "hf" / f"checkpoint-{CUT}")
    code, out = launch(torchrun(1, tmp_path, stack, "hf", "--dump-restored"), env, tmp_path)
    got = tmp_path / "out"
    if stack.startswith("zero"):  # measured: DeepSpeed refuses another data-parallel world size
        assert code != 0 and starts(out) == [], out[-5000:]
        assert any("ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but the current "
                   "world size is 1" in e for e in errors(out)), out[-5000:]
        print(f"measured, {stack} HF alone 2 -> 1: {errors(out)[0]}")
        return
    # measured: with full state dicts (DDP; FSDP2 with HF's default FULL_STATE_DICT) HF resumes on 1 rank
    # with the saved state and the same global samples per step
    assert code == 0 and starts(out) == [CUT], out[-5000:]
    assert not differing(ref / f"state-{CUT}.safetensors", got / "restored.safetensors")
    want = global_samples(ref)
    assert global_samples(got) == {s: want[s] for s in range(CUT + 1, STEPS + 1)}
    print(f"measured, {stack} HF alone 2 -> 1: resumed at {CUT}, restored state bitwise, same global samples")
