"""``save_every="auto"`` (:class:`unbroken.policies.AutoInterval`): Young/Daly's interval from what this run
measures — the blocking time of its saves, its failures in the run index, a prior until the first.

The arithmetic with made-up numbers and times (no clock read); then real processes: a run killed twice
with SIGKILL learns from its index that it fails, saves more often for it, records each choice in the
index, and still ends bitwise as the uninterrupted run. Relations only, never durations.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from unbroken.demo import run_attempt
from unbroken.policies import AutoInterval, TriggerContext
from unbroken.run.index.index import RunIndex
from unbroken.run.scheduling import Schedule


def test_the_interval_is_young_dalys_from_the_measured_cost_and_the_runs_failures() -> None:
    t = AutoInterval()
    t.observe_history(failures=4, wall_s=3600.0, now=0.0)
    assert t.interval_s(0.0) is None  # nothing measured yet
    t.observe_save(0.5)
    assert t.mtbf_s(0.0) == 900.0
    assert t.interval_s(0.0) == pytest.approx(math.sqrt(2 * 0.5 * 900) - 0.5)
    # the run's own time counts: 4 failures, 3600 s before this process, 900 s in it
    assert t.mtbf_s(900.0) == pytest.approx(4500.0 / 4)
    # before any failure: the prior, or the run's age when longer
    fresh = AutoInterval(mtbf_hours=2.0)
    fresh.observe_history(0, 100.0, now=0.0)
    assert fresh.mtbf_s(0.0) == 7200.0 and fresh.mtbf_s(10_000.0) == pytest.approx(10_100.0)
    # the newest save weighs 0.3 in the cost
    t.observe_save(1.5)
    assert t.cost_s == pytest.approx(0.7 * 0.5 + 0.3 * 1.5)


def test_bounds_and_a_save_dearer_than_half_the_mtbf() -> None:
    t = AutoInterval(min_seconds=60.0, max_seconds=600.0)
    t.observe_history(1, 1e6, now=0.0)
    t.observe_save(1.0)
    assert t.interval_s(0.0) == 600.0  # sqrt(2 * 1 * 1e6) - 1 = 1413: capped at max_seconds
    t2 = AutoInterval(min_seconds=60.0)
    t2.observe_history(10, 100.0, now=0.0)  # a failure every 10 s
    t2.observe_save(0.001)
    assert t2.interval_s(0.0) == 60.0  # floored at min_seconds
    t3 = AutoInterval()
    t3.observe_history(10, 100.0, now=0.0)
    t3.observe_save(8.0)  # a save costs more than half the time between failures
    assert t3.interval_s(0.0) == 10.0  # then save once per expected failure (and never more often than C)
    for bad in (dict(mtbf_hours=0), dict(max_seconds=-1), dict(min_seconds=10, max_seconds=5)):
        with pytest.raises(ValueError, match="AutoInterval"):
            AutoInterval(**bad)  # type: ignore[arg-type]


def test_due_saves_at_once_to_measure_then_at_the_interval_since_the_last_save() -> None:
    t = AutoInterval()
    t.observe_history(1, 50.0, now=100.0)
    assert not t.due(TriggerContext(step=0, now=100.0))
    assert t.due(TriggerContext(step=1, now=100.5))  # no cost known: the first step boundary saves
    t.observe_save(0.02)
    interval = t.interval_s(101.0)
    assert interval is not None and 0 < interval < 10
    assert not t.due(TriggerContext(step=2, now=101.0, last_save_time=101.0 - interval / 2))
    assert t.due(TriggerContext(step=3, now=101.0, last_save_time=101.0 - interval * 1.01))
    # a resumed process knows the cost from the checkpoint: it does not save at once
    resumed = AutoInterval()
    resumed.load_state_dict(t.state_dict())
    assert resumed.cost_s == t.cost_s and not resumed.due(TriggerContext(step=7, now=5.0))


def test_the_schedule_records_a_choice_only_when_it_moves() -> None:
    sched = Schedule("auto", None, None, None)
    assert len(sched.auto) == 1
    first = sched.observe_history(2, 600.0, now=0.0)
    assert first is not None and "2 failures in 10 min" in first and "at the next step" in first
    said = sched.observe_save(0.1, now=0.0)
    assert said is not None and said.startswith("save every ") and "a save blocks 0.1 s" in said
    assert sched.observe_save(0.11, now=0.0) is None  # moved by less than a tenth
    assert sched.observe_save(5.0, now=0.0) is not None
    with pytest.raises(ValueError, match="'auto' or None"):
        Schedule("often", None, None, None)


LOOP = """
import os, sys, time, hashlib, torch, unbroken
run, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Dropout(0.1), torch.nn.Linear(512, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = {"model": model, "optimizer": opt}
ckpt = unbroken.Checkpointer(run, save_every="auto", preemption=None)
info = ckpt.restore(state)
print(f"resumed from step {ckpt.progress.step}" if info is not None else "fresh start", flush=True)
while ckpt.progress.step < steps:
    s = ckpt.progress.step + 1
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(s))
    loss = model(x).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    time.sleep(0.01)
    ckpt.step(state, loss=loss.item())
    if s == int(os.environ.get("RAISE_AT", "0")) and not os.path.exists(out + ".raised"):
        open(out + ".raised", "w").close()
        raise RuntimeError("a failure inside the loop")  # closes the Checkpointer on the way out: not a kill
    print("step", s, flush=True)
ckpt.close()
h = hashlib.sha256()
for v in model.state_dict().values():
    h.update(v.numpy().tobytes())
open(out, "w").write(h.hexdigest())
"""


@pytest.mark.e2e
def test_a_run_that_fails_saves_more_often_records_why_and_stays_exact(tmp_path: Path) -> None:
    """Killed after step 40, then 120 steps after its resume; finished by a third process. The first
    process knows no failure (the 24 h prior: one save, at its first step, to measure the cost); the
    second learns of one from the index and saves again before it is killed; the third of two. Every
    choice is in the index; the final parameters are the uninterrupted run's."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # as the fork server's (tests/zygote.py)
    steps = 200

    def attempt(run: Path, kind: str = "none", at: int = 0):
        out = str(run) + ".final"
        return run_attempt([sys.executable, str(script), str(run), str(steps), out], kind, str(at), env, timeout=300)

    run = tmp_path / "run"
    first = attempt(run, "step", 40)
    assert first.rc == -9, first.stderr
    with RunIndex(run, readonly=True) as index:
        assert [c["step"] for c in index.checkpoints()] == [1]  # the prior: no second save in 40 steps
    second = attempt(run, "step", 160)
    assert second.rc == -9 and second.started == "resumed from step 1", (second.started, second.stderr)
    with RunIndex(run, readonly=True) as index:
        saved = sorted(c["step"] for c in index.checkpoints())
    assert [s for s in saved if 1 < s <= 160], saved  # one failure known: it saved again within 160 steps
    third = attempt(run)
    assert third.rc == 0 and third.started.startswith("resumed from step"), third.stderr
    with RunIndex(run, readonly=True) as index:
        chosen = index.events("save_interval")
    said = [e["message"] for e in chosen]
    for e in chosen:  # the interval in numbers too (bench_goodput.py reports them)
        seconds = (e["data"] or {}).get("seconds")
        if e["message"].startswith("save every"):
            assert isinstance(seconds, (int, float)) and seconds > 0, e
        else:
            assert seconds is None, e
    assert any("no failure yet" in m for m in said), said
    assert any("1 failure in" in m for m in said), said
    assert any("2 failures in" in m for m in said), said
    assert any(m.startswith("save every") for m in said), said
    assert attempt(tmp_path / "uninterrupted").rc == 0
    assert (tmp_path / "run.final").read_text() == (tmp_path / "uninterrupted.final").read_text()


@pytest.mark.e2e
def test_a_process_that_closed_on_an_exception_but_lost_steps_is_a_failure(tmp_path: Path) -> None:
    """With several ranks the rank that keeps the index does not die when another is killed: it fails in a
    collective and closes on the exception. Its steps since the last save are lost all the same: the next
    process counts it as a failure (here a process that raises after step 30, its last save at step 1)."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RAISE_AT="30")
    run = tmp_path / "run"
    cmd = [sys.executable, str(script), str(run), "40", str(tmp_path / "final")]
    first = run_attempt(cmd, "none", "0", env, ok_codes=(1,), timeout=300)
    assert first.rc == 1 and "a failure inside the loop" in first.stderr
    assert run_attempt(cmd, "none", "0", env, timeout=300).rc == 0
    with RunIndex(run, readonly=True) as index:
        said = [e["message"] for e in index.events("save_interval")]
    assert any("1 failure in" in m for m in said), said
