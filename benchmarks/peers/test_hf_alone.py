"""HF Trainer alone, under the faults of tests/test_integration_hf.py: what it loses, measured (moved from that file;
the numbers go into the "alone" columns of the docs, and each run still asserts them, so a peer that changes is
noticed). Run by ``make bench-peers`` (benchmarks/peers/conftest.py)."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from test_integration_hf import (  # noqa: F401 (fixtures)
    SAVE_EVERY,
    STEPS,
    attempt,
    final,
    references,
    same_steps,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_hf_alone_sigkill_and_sigterm_lose_the_steps_since_its_last_save(references, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    ref_att, ref_final = references["hf"]
    # a step after one of its saves, four before the next (a kill inside its save is the test below)
    kill_at = random.Random(11).choice([s for s in range(6, 20) if s % SAVE_EVERY == 1])
    term_at = random.Random(12).choice([s for s in range(22, STEPS - 3) if s % SAVE_EVERY == 1])
    a = attempt(tmp_path, "hf", kill=(signal.SIGKILL, kill_at))
    b = attempt(tmp_path, "hf", kill=(signal.SIGTERM, term_at))
    c = attempt(tmp_path, "hf")
    assert a.rc == -signal.SIGKILL and b.rc == -signal.SIGTERM and c.rc == 0, (b.stderr + c.stderr)[-3000:]
    # SIGTERM is not handled: the process dies like on SIGKILL; both resume from the last save
    for before, after in ((a, b), (b, c)):
        assert after.resumed_at == before.last_step // SAVE_EVERY * SAVE_EVERY < before.last_step
    print(f"measured, HF alone: SIGKILL after step {a.last_step} resumed at {b.resumed_at}, SIGTERM after step "
          f"{b.last_step} resumed at {c.resumed_at}: {a.last_step - b.resumed_at} and {b.last_step - c.resumed_at} "
          "steps lost and recomputed")
    # measured: weights, optimizer and every per-step loss are bitwise those of the uninterrupted run ...
    got = final(tmp_path)
    assert got["sha256"] == ref_final["sha256"] and got["epoch"] == ref_final["epoch"]
    assert not same_steps(ref_att, [a, b, c])
    # ... but the log is not: the logged loss after a resume averages fewer steps, train_loss covers
    # only the last process
    assert got["train_loss"] != ref_final["train_loss"]
    assert got["log_history"] != ref_final["log_history"]
    differ = [e["step"] for e, r in zip(got["log_history"], ref_final["log_history"], strict=True) if e != r]
    print(f"measured, HF alone: train_loss {got['train_loss']} vs {ref_final['train_loss']} uninterrupted; "
          f"log entries that differ at steps {differ}")



def test_hf_alone_exception_loses_the_steps_since_its_last_save(references, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    ref_att, ref_final = references["hf"]
    step = 23
    a = attempt(tmp_path, "hf", "--crash-at", str(step))
    assert a.rc == 1 and f"injected failure in step {step}" in a.stderr
    b = attempt(tmp_path, "hf", "--crash-at", str(step))
    assert b.rc == 0, b.stderr[-3000:]
    assert b.resumed_at == 20  # steps 21 and 22 were lost and recomputed
    print(f"measured, HF alone: exception in step {step}: resumed at {b.resumed_at}, {step - 1 - b.resumed_at} lost")
    assert final(tmp_path)["sha256"] == ref_final["sha256"]
    assert not same_steps(ref_att, [a, b])



def test_hf_alone_killed_inside_its_save_cannot_resume(references, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    a = attempt(tmp_path, "hf", "--hf-kill-in-save", "3")  # weights of checkpoint-15 written, then SIGKILL
    assert a.rc == -signal.SIGKILL and a.last_step == 15
    broken = tmp_path / "hf" / "checkpoint-15"
    assert (broken / "model.safetensors").is_file() and not (broken / "trainer_state.json").exists()
    for _ in range(2):  # every restart picks the torn checkpoint and crashes: the run is stuck
        b = attempt(tmp_path, "hf")
        assert b.rc == 1 and not b.steps
        assert "checkpoint-15/trainer_state.json" in b.stderr and "FileNotFoundError" in b.stderr
    print("measured, HF alone: SIGKILL inside the save of step 15: 2 of 2 restarts crashed (FileNotFoundError)")
