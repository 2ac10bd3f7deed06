"""LLaMA-Factory alone, under the faults of tests/test_llamafactory.py: what it loses, measured (moved from that file;
the numbers go into the "alone" columns of the docs, and each run still asserts them, so a peer that changes is
noticed). Run by ``make bench-peers`` (benchmarks/peers/conftest.py)."""

from __future__ import annotations

import functools
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_llamafactory import (  # noqa: F401 (fixtures)
    SAVE_EVERY,
    Attempt,
    assets,
    attempt,
    differing_steps,
    final,
    lf_python,
    newest_save,
    references,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_llamafactory_alone_under_the_same_faults(lf_python, assets, references, tmp_path):  # noqa: F811 - pytest fixtures
    """LLaMA-Factory's own resume (``save_steps=4``; restarted with the same command it passes
    ``output_dir``'s last ``checkpoint-N`` to ``train()``), under the faults above: what it loses."""
    outs = {"kills": tmp_path / "kills", "torn": tmp_path / "torn"}

    def kills() -> list[Attempt]:  # SIGKILL at a step, then SIGTERM at a step, then to the end
        run = functools.partial(attempt, lf_python, "llamafactory", assets, outs["kills"], "--mode", "alone")
        kill_at = random.Random(5).randint(SAVE_EVERY + 1, 2 * SAVE_EVERY - 1)
        return [run(kill=(signal.SIGKILL, kill_at)), run(kill=(signal.SIGTERM, 3 * SAVE_EVERY - 1)), run()]

    def torn() -> list[Attempt]:  # SIGKILL inside its 3rd save (checkpoint-12), then two restarts
        run = functools.partial(attempt, lf_python, "llamafactory", assets, outs["torn"], "--mode", "alone")
        return [run("--kill-in-hf-save", "3"), run(), run()]

    with ThreadPoolExecutor(2) as pool:
        chains = {name: pool.submit(job) for name, job in (("kills", kills), ("torn", torn))}
    sigkilled, sigtermed, done = chains["kills"].result()
    ref_att, ref_final = references["alone"]
    assert sigkilled.rc == -signal.SIGKILL and sigtermed.rc == -signal.SIGTERM, sigtermed.stderr[-3000:]
    assert done.rc == 0, done.stderr[-3000:]
    # each restart resumes from LLaMA-Factory's last save: the steps since then are lost and recomputed
    assert sigtermed.resumed_at == newest_save(sigkilled.last_step) < sigkilled.last_step
    assert done.resumed_at == newest_save(sigtermed.last_step) < sigtermed.last_step
    got = final(outs["kills"])
    same = {k: got[k] == ref_final[k] for k in ("sha256", "log_history", "train_loss", "total_flos", "epoch")}
    wrong_steps = differing_steps(ref_att, [sigkilled, sigtermed, done])
    other_logs = [e.get("step") for e, r in zip(got["log_history"], ref_final["log_history"], strict=True) if e != r]
    print(f"measured, LLaMA-Factory alone: SIGKILL after step {sigkilled.last_step}, resumed at "
          f"{sigtermed.resumed_at}; SIGTERM after step {sigtermed.last_step} (exit {sigtermed.rc}), resumed at "
          f"{done.resumed_at}; equal to the uninterrupted run: {same}; steps with other parameters: {wrong_steps}; "
          f"log entries that differ (step): {other_logs}; train_loss {got['train_loss']} vs {ref_final['train_loss']}")
    # what it keeps: parameters, optimizer and schedule bitwise (its checkpoints hold the RNG states), every
    # recomputed step too; what it loses: the steps since its last save, and train_loss, which covers the last
    # process only (its mean over the steps that process ran)
    assert same["sha256"] and not wrong_steps
    assert not same["train_loss"] and len(got["log_history"]) == len(ref_final["log_history"])

    killed, *restarts = chains["torn"].result()
    assert killed.rc == -signal.SIGKILL and killed.last_step == 3 * SAVE_EVERY, killed.stderr[-3000:]
    torn_ckpt = outs["torn"] / "lf" / f"checkpoint-{3 * SAVE_EVERY}"
    assert (torn_ckpt / "model.safetensors").is_file() and not (torn_ckpt / "trainer_state.json").exists()
    for r in restarts:  # it resumes from the torn folder every time: the run is stuck
        assert r.rc != 0 and not r.steps, r.stderr[-3000:]
    errors = [r.stderr.strip().splitlines()[-1] for r in restarts]
    print(f"measured, LLaMA-Factory alone: SIGKILL inside the save of checkpoint-{3 * SAVE_EVERY}: "
          f"{len(restarts)} of {len(restarts)} restarts failed: {errors}")
