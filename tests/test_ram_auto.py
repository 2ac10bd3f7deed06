"""``RamTier(persist_every="auto")`` (:mod:`unbroken.tiers.ramauto`): how often the RAM tier's writer copies a RAM
checkpoint to the disk, from what a copy costs the training and how often the run loses what it saved.

The arithmetic with made-up numbers and times (no clock read); the run index's count of lost saves on an index
written by hand; then real processes: a run whose node memory is lost twice (SIGKILL, the RAM folder wiped) learns
from its index that it loses its RAM checkpoints, persists more often for it, records each choice, and still ends
bitwise as the uninterrupted run. Relations only, never durations.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from unbroken import RamTier
from unbroken.demo import run_attempt
from unbroken.errors import ConfigurationError
from unbroken.run.index.goodput import lost_save_history
from unbroken.run.index.index import RunIndex
from unbroken.store import open_store
from unbroken.tiers.ramauto import PersistInterval


def steps(p: PersistInterval, start: float, durations: list[float], copying: bool) -> float:
    """Feed step ends ``durations`` apart from ``start``, the writer copying or not; the last step's end."""
    now = start
    p.step_ended(now, copying)
    for d in durations:
        now += d
        p.step_ended(now, copying)
    return now


def test_a_copy_costs_its_time_times_the_slowdown_of_the_steps_it_overlaps() -> None:
    p = PersistInterval(node_mtbf_hours=1.0, max_seconds=3600.0)
    p.observe_history(0, 0.0, now=0.0)
    assert p.interval_s(0.0) is None  # no copy measured yet
    p.persisted(2.0)  # the steps' slowdown not measured yet: a copy counts whole (a stalled training)
    assert p.choice.cost_s == 2.0
    assert p.interval_s(0.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600) - 2.0)
    t = steps(p, 0.0, [0.1] * 5, copying=False)
    steps(p, t + 1, [0.4] * 5, copying=True)  # (the step in which the copy started counts for neither)
    assert p.slowdown() == pytest.approx(0.75)
    p.persisted(2.0)
    assert p.choice.cost_s == pytest.approx(2.0 * 0.75)
    assert p.interval_s(0.0) == pytest.approx(math.sqrt(2 * 1.5 * 3600) - 1.5)


def test_a_copy_that_does_not_slow_the_steps_is_made_as_often_as_one_takes() -> None:
    p = PersistInterval(node_mtbf_hours=168.0, max_seconds=3600.0)
    p.observe_history(0, 0.0, now=0.0)
    t = steps(p, 0.0, [0.2] * 4, copying=False)
    steps(p, t, [0.2] * 4, copying=True)
    p.persisted(3.0)
    assert p.slowdown() == 0.0 and p.choice.cost_s == 0.0
    assert p.interval_s(0.0) == 3.0  # never more often than a copy takes


def test_losses_of_the_saved_state_shorten_the_interval_and_the_bound_holds() -> None:
    p = PersistInterval(node_mtbf_hours=168.0, max_seconds=600.0)
    p.observe_history(0, 100.0, now=0.0)
    p.persisted(0.5)
    assert p.interval_s(0.0) == 600.0  # sqrt(2 * 0.5 * 1 week) = 778 s: capped
    p.observe_history(4, 400.0, now=0.0)  # a loss every 100 s
    assert p.interval_s(0.0) == pytest.approx(math.sqrt(2 * 0.5 * 100.0) - 0.5)


def test_due_the_first_when_the_writer_is_free_then_at_the_interval_since_the_last() -> None:
    p = PersistInterval(node_mtbf_hours=1.0, max_seconds=3600.0)
    assert p.due(10.0, copying=False)  # the first: it measures a copy
    assert not p.due(10.5, copying=True)  # nothing known yet and the writer busy: wait for the measurement
    p.persisted(0.05)
    interval = p.interval_s(11.0)
    assert interval is not None and interval > 1
    assert not p.due(10.0 + interval / 2, copying=False)
    assert p.due(10.0 + interval * 1.01, copying=False)
    failed = PersistInterval(node_mtbf_hours=1.0, max_seconds=3600.0)
    assert failed.due(0.0, copying=False)
    assert failed.due(5.0, copying=False)  # the first copy failed (no time measured): the next free one goes


def test_a_choice_is_told_only_when_it_moves_by_a_tenth() -> None:
    p = PersistInterval(node_mtbf_hours=1.0, max_seconds=3600.0)
    p.observe_history(0, 0.0, now=0.0)
    assert p.moved(0.0) is None  # nothing to tell before a copy
    p.persisted(1.0)
    said = p.moved(0.0)
    assert said is not None and said.startswith("persist every ") and "a copy takes 1 s" in said
    assert "none yet: the prior 60 min" in said and "taken as a stalled training" in said
    p.persisted(1.05)
    assert p.moved(0.0) is None
    p.observe_history(3, 30.0, now=0.0)
    assert "3 losses in 30 s" in (p.moved(0.0) or "")


@pytest.mark.parametrize("bad", [dict(persist_every="often"), dict(persist_every=0), dict(persist_every=True),
                                 dict(node_mtbf_hours=0), dict(persist_max_seconds=float("inf"))])
def test_the_tier_refuses_what_is_not_a_number_of_saves_or_auto(bad: dict) -> None:
    with pytest.raises(ConfigurationError, match="RamTier"):
        RamTier(**bad)
    assert RamTier(persist_every="auto").persist_every == "auto"


def test_the_index_counts_the_restarts_that_went_back_past_a_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    open_store(run)  # the run folder
    with RunIndex(run) as index:
        def segment(start: int, resumed: str | None, saved: list[int]) -> None:
            index.start_segment(resumed, start, tier="primary" if resumed else "")
            for s in saved:
                index.record_checkpoint(f"step-{s:09d}", s, s, None, 0.0, 0.1, 1, "regular", {}, [], {})

        segment(0, None, [1, 10, 20])
        segment(20, "step-000000020", [30, 40])  # resumed from its predecessor's newest: nothing lost
        segment(30, "step-000000030", [40, 50])  # 40 was saved and is gone: a loss (40 saved again takes its row)
        index.event("rolled_back", "a spike", step=50)  # an in-process rollback may go back on purpose
        segment(30, "step-000000030", [])
        losses, wall = lost_save_history(index, now=10**10)
    assert losses == 1 and wall > 0


LOOP = """
import hashlib, os, sys, time, torch, unbroken, unbroken.store
run, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Dropout(0.1), torch.nn.Linear(256, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = {"model": model, "optimizer": opt}
ram = unbroken.RamTier(persist_every="auto", root=os.environ["RAM_ROOT"])
ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=None, preemption=None, ram=ram)
info = ckpt.restore(state)
print(f"resumed from step {ckpt.progress.step}" if info is not None else "fresh start", flush=True)
while ckpt.progress.step < steps:
    s = ckpt.progress.step + 1
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(s))
    loss = model(x).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    time.sleep(0.01)
    ckpt.step(state, loss=loss.item())
    if s == 40 and ckpt.progress.step == 40 and info is None:  # the first process: its first persist is done
        deadline = time.monotonic() + 120  # before the test kills it (it never waits on a slow machine's timing)
        while not unbroken.store.open_store(run).list_committed() and time.monotonic() < deadline:
            time.sleep(0.01)
    print("step", s, flush=True)
ckpt.close()
h = hashlib.sha256()
for v in model.state_dict().values():
    h.update(v.numpy().tobytes())
open(out, "w").write(h.hexdigest())
"""


@pytest.mark.e2e
def test_a_run_that_loses_its_ram_persists_more_often_records_why_and_stays_exact(tmp_path: Path) -> None:
    """A RAM save every step, ``persist_every="auto"``. The first process knows no loss (the prior, a week): its
    first RAM checkpoint is persisted, to measure a copy, then none. SIGKILLed after step 80 with its node's
    memory wiped, the next resumes from the disk at step 1 and learns from the index that the run lost what it
    saved: after its own first persist (it measures a copy again) it persists again and again, until it too is
    lost after step 300; the third, told of the losses, runs to the end. Every choice is in the index; the final
    parameters are the uninterrupted run's."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    ram = tmp_path / "shm"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RAM_ROOT=str(ram))  # (tests/zygote.py)
    total = 400

    def attempt(run: Path, kind: str = "none", at: int = 0):
        out = str(run) + ".final"
        return run_attempt([sys.executable, str(script), str(run), str(total), out], kind, str(at), env, timeout=300)

    def on_disk(run: Path) -> list[int]:
        return sorted(int(n.split("-")[1]) for n in open_store(run).list_committed())

    run = tmp_path / "run"
    first = attempt(run, "step", 80)
    assert first.rc == -9, first.stderr
    assert on_disk(run) == [1]  # the prior: no other persist in 80 steps
    shutil.rmtree(ram)  # the node is lost: its memory with it
    second = attempt(run, "step", 300)
    assert second.rc == -9 and second.started == "resumed from step 1", (second.started, second.stderr)
    again = [s for s in on_disk(run) if s > 1]
    assert len(again) >= 3, again  # with the prior it would have been its first RAM checkpoint only
    shutil.rmtree(ram)
    newest = on_disk(run)[-1]
    third = attempt(run)
    assert third.rc == 0 and third.started == f"resumed from step {newest}", (third.started, third.stderr)
    with RunIndex(run, readonly=True) as index:
        said = [e["message"] for e in index.events("persist_interval")]
    assert any("none yet: the prior 168 h" in m for m in said), said
    assert any("1 loss in" in m for m in said), said
    if newest < 300:  # (the second's last RAM checkpoint was not on the disk yet when it was lost)
        assert any("2 losses in" in m for m in said), "\n".join(said)
    assert attempt(tmp_path / "uninterrupted").rc == 0
    assert (tmp_path / "run.final").read_text() == (tmp_path / "uninterrupted.final").read_text()
    assert not any(ram.rglob("step-*"))  # a normal close leaves no shared memory behind
