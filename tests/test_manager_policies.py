"""Triggers, retention and tags through a real Checkpointer (the rules alone: test_policies.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.policies import (AtEpochEnd, EveryNSteps, KeepBest, KeepEveryNSteps, OnImprovement)


def steps_of(ckpt: unbroken.Checkpointer) -> list[int]:
    return sorted(c.step for c in ckpt.checkpoints())


def test_combined_retention_over_a_long_run(tmp_path: Path) -> None:
    rng = random.Random(3)
    state = {"w": torch.zeros(3)}
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=50, keep_last=3, preemption=None,
                                 retention=KeepBest(2, "val_loss", "min") | KeepEveryNSteps(1000))
    saved: dict[int, float] = {}
    for step in range(1, 3001):
        val = rng.random()
        info = ckpt.step(state, val_loss=val)
        if info is not None:
            saved[step] = val
            if step == 1650:
                ckpt.tag("before-lr-drop")
        if info is not None:
            alive = steps_of(ckpt)
            expect = set(sorted(saved)[-3:])
            expect |= set(sorted(saved, key=lambda s: (saved[s], -s))[:2])
            expect |= {s for s in saved if s % 1000 == 0} | {1650}
            assert set(alive) == {s for s in expect if s <= step}, step
    assert ckpt.checkpoints()[0].step == 3000
    assert [c.tags for c in ckpt.checkpoints() if c.step == 1650] == [("before-lr-drop",)]
    ckpt.close()


def test_tags_at_save_time_restore_by_tag_and_survive_retention(tmp_path: Path) -> None:
    w = torch.zeros(2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", keep_last=1, preemption=None)
    ckpt.progress.step = 5
    w.fill_(5)
    ckpt.save({"w": w}, tag="v1")
    for s in (6, 7, 8):
        ckpt.progress.step = s
        w.fill_(s)
        ckpt.save({"w": w})
    assert steps_of(ckpt) == [5, 8]
    ckpt.close()
    live = {"w": torch.zeros(2)}
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as again:
        assert again.restore(live, tag="v1").step == 5
        assert torch.equal(live["w"], torch.full((2,), 5.0))
        with pytest.raises(unbroken.NoCheckpointError):
            again.restore(live, tag="nope")
        with pytest.raises(ValueError):
            again.tag("../evil")


def test_on_improvement_at_epoch_end_and_its_state_survives_a_resume(tmp_path: Path) -> None:
    vals = [0.9, 0.8, 0.85, 0.7, 0.75, 0.72, 0.6]

    def run(epochs: range, run_dir: Path) -> list[int]:
        state = {"w": torch.zeros(1)}
        ckpt = unbroken.Checkpointer(run_dir, keep_last=None, preemption=None,
                                     trigger=OnImprovement("val_loss", "min"))
        ckpt.restore(state)
        saved = []
        for epoch in epochs:
            ckpt.step(state)
            ckpt.progress.epoch = epoch
            if ckpt.end_epoch(state, val_loss=vals[epoch]) is not None:
                saved.append(epoch)
        ckpt.close()
        return saved

    assert run(range(7), tmp_path / "a") == [0, 1, 3, 6]
    assert run(range(4), tmp_path / "b") == [0, 1, 3]
    # resumed after epoch 3 (best 0.7 restored): 0.75 and 0.72 are no improvement
    assert run(range(4, 7), tmp_path / "b") == [6]


def test_every_n_steps_trigger_and_at_epoch_end(tmp_path: Path) -> None:
    ckpt = unbroken.Checkpointer(tmp_path / "run", keep_last=None, preemption=None,
                                 trigger=EveryNSteps(4) | AtEpochEnd())
    state = {"w": torch.zeros(1)}
    for step in range(1, 11):
        ckpt.step(state)
        if step % 3 == 0:
            ckpt.end_epoch(state)
    assert steps_of(ckpt) == [3, 4, 6, 8, 9]
    ckpt.close()


KILLED_BETWEEN_COMMIT_AND_PRUNE = textwrap.dedent("""
    import sys, torch, unbroken
    ckpt = unbroken.Checkpointer(sys.argv[1], save_every=2, keep_last=2, preemption=None)
    state = {"w": torch.zeros(1)}
    ckpt.restore(state)
    while ckpt.progress.step < 12:
        state["w"] += 1
        ckpt.step(state)
""")


def test_kill_between_commit_and_prune_is_caught_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, UNBROKEN_FAULTS="save.after_commit=3")
    p = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_COMMIT_AND_PRUNE, str(run)], env=env)
    assert p.returncode == -9
    names = sorted(n.name for n in run.iterdir() if n.name.startswith("step-"))
    assert names == ["step-000000002", "step-000000004", "step-000000006"]  # 6 committed, not pruned yet
    p = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_COMMIT_AND_PRUNE, str(run)])
    assert p.returncode == 0
    names = sorted(n.name for n in run.iterdir() if n.name.startswith("step-"))
    assert names == ["step-000000010", "step-000000012"]
    assert unbroken.load(run / "step-000000012")["w"].item() == 12
