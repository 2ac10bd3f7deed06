"""``unbroken.policies``: save triggers and retention rules, alone, combined over long
simulated runs (with kills between commit and prune, and resumes), and the trigger
state's pickle-free round trip through ``unbroken.save``/``unbroken.load``."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import unbroken
from unbroken.policies import (
    AnyOf,
    AtEpochEnd,
    CheckpointMeta,
    EveryMinutes,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEveryNSteps,
    KeepLast,
    KeepTagged,
    OnImprovement,
    Retention,
    Trigger,
    TriggerContext,
    Union,
    metric_value,
    to_delete,
)


def ctx(step: int = 1, **kw) -> TriggerContext:
    return TriggerContext(step=step, **kw)


def meta(name: str, step: int, seq: int, tags=(), **metrics) -> CheckpointMeta:
    return CheckpointMeta(name=name, step=step, seq=seq, metrics=metrics, tags=frozenset(tags))


def run_of(*steps: int) -> list[CheckpointMeta]:
    return [meta(f"s{s}", s, i) for i, s in enumerate(steps)]


# ------------------------------------------------------------------ triggers alone
def test_every_n_steps():
    t = EveryNSteps(100)
    assert [s for s in range(501) if t.due(ctx(s))] == [100, 200, 300, 400, 500]
    assert isinstance(t, Trigger)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            EveryNSteps(bad)


def test_every_minutes_counts_from_first_question_then_from_last_save():
    t = EveryMinutes(2)
    assert not t.due(ctx(now=1000.0))           # the clock starts here
    assert not t.due(ctx(now=1119.9))
    assert t.due(ctx(now=1120.0))                # 2 minutes since the start, no save yet
    # saved at 1120: counts from the save now
    assert not t.due(ctx(now=1200.0, last_save_step=5, last_save_time=1120.0))
    assert t.due(ctx(now=1240.0, last_save_step=5, last_save_time=1120.0))
    # a save made by another trigger also resets the clock
    assert not t.due(ctx(now=1300.0, last_save_time=1250.0))
    with pytest.raises(ValueError):
        EveryMinutes(0)
    with pytest.raises(ValueError):
        EveryMinutes(float("nan"))


def test_at_epoch_end():
    t = AtEpochEnd()
    assert t.due(ctx(epoch=3, epoch_end=True))
    assert not t.due(ctx(epoch=3))


def test_on_improvement_min_and_max():
    t = OnImprovement("val_loss")
    seen = [t.due(ctx(metrics={"val_loss": v})) for v in [1.0, 1.0, 0.9, 0.95, 0.5, 0.5]]
    assert seen == [True, False, True, False, True, False]
    assert t.best == 0.5
    up = OnImprovement("acc", mode="max")
    assert [up.due(ctx(metrics={"acc": v})) for v in [0.1, 0.3, 0.2, 0.31]] == [True, True, False, True]


def test_on_improvement_min_delta():
    t = OnImprovement("loss", min_delta=0.1)
    assert [t.due(ctx(metrics={"loss": v})) for v in [1.0, 0.95, 0.9, 0.89, 0.7]] == \
        [True, False, False, True, True]
    assert t.best == 0.7
    with pytest.raises(ValueError):
        OnImprovement("loss", min_delta=-1)
    with pytest.raises(ValueError):
        OnImprovement("loss", mode="lowest")  # type: ignore[arg-type]


def test_on_improvement_nan_missing_and_odd_values():
    t = OnImprovement("val_loss")
    assert not t.due(ctx(metrics={"val_loss": float("nan")}))  # nan is never an improvement...
    assert t.best is None                                      # ...nor remembered
    assert not t.due(ctx(metrics={"loss": 0.1}))               # metric absent: not due
    assert not t.due(ctx(metrics={"val_loss": "n/a"}))         # not a number
    assert t.due(ctx(metrics={"val_loss": torch.tensor(2.0)}))  # 0-d tensor
    assert t.due(ctx(metrics={"val_loss": np.float32(1.5)}))   # numpy scalar
    assert not t.due(ctx(metrics={"val_loss": "nan"}))         # how manifests store nan
    assert not t.due(ctx(metrics={"val_loss": torch.tensor([0.1, 0.2])}))  # not a scalar
    assert t.due(ctx(metrics={"val_loss": 1}))
    assert t.best == 1.0
    assert t.due(ctx(metrics={"val_loss": "-inf"}))
    assert not t.due(ctx(metrics={"val_loss": -1e300}))
    assert not t.due(ctx(metrics={"val_loss": True}))          # bools are not metrics


def test_on_improvement_state_restores_best():
    a = OnImprovement("val_loss")
    for v in [3.0, 2.0, 2.5]:
        a.due(ctx(metrics={"val_loss": v}))
    b = OnImprovement("val_loss")
    b.load_state_dict(a.state_dict())
    assert b.best == 2.0
    assert not b.due(ctx(metrics={"val_loss": 2.5}))  # a fresh trigger would have saved here
    assert b.due(ctx(metrics={"val_loss": 1.9}))
    c = OnImprovement("val_acc", mode="max")
    with pytest.warns(UserWarning, match="val_loss"):
        c.load_state_dict(a.state_dict())               # tracked something else: start fresh
    assert c.best is None


def test_any_of_and_or_operator():
    t = EveryNSteps(10) | AtEpochEnd()
    assert isinstance(t, AnyOf) and isinstance(t, Trigger)
    assert t.due(ctx(10)) and t.due(ctx(3, epoch_end=True)) and not t.due(ctx(3))
    # nested | flattens; a user's own trigger (no base class) combines from either side
    class Odd:
        def due(self, c: TriggerContext) -> bool:
            return c.step % 2 == 1

    t2 = (Odd() | EveryNSteps(10)) | AtEpochEnd()
    assert isinstance(t2, AnyOf) and len(t2.triggers) == 3
    assert [s for s in range(1, 12) if t2.due(ctx(s))] == [1, 3, 5, 7, 9, 10, 11]
    with pytest.raises(TypeError):
        AnyOf(EveryNSteps(1), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AnyOf()


def test_any_of_asks_every_trigger_so_state_is_never_missed():
    imp = OnImprovement("val_loss")
    t = EveryNSteps(1) | imp   # EveryNSteps is due at every step, first in the list
    for v in [5.0, 4.0, 3.0]:
        assert t.due(ctx(metrics={"val_loss": v}))
    assert imp.best == 3.0     # a short-circuiting any() would have left it at None
    state = t.state_dict()
    assert state == {"OnImprovement#0": {"metric": "val_loss", "mode": "min", "best": 3.0}}
    # reordered, with triggers of other classes added: the state still finds its trigger
    changed = AtEpochEnd() | OnImprovement("val_loss") | EveryMinutes(1)
    changed.load_state_dict(state)
    assert changed.triggers[1].best == 3.0


def test_any_of_state_keys_per_class_and_missing_state():
    @dataclass
    class Counter:  # a user's stateful trigger, no base class
        count: int = 0

        def due(self, c: TriggerContext) -> bool:
            self.count += 1
            return False

        def state_dict(self) -> dict:
            return {"count": self.count}

        def load_state_dict(self, d: dict) -> None:
            self.count = d["count"]

    t = OnImprovement("a") | Counter() | OnImprovement("b", "max")
    t.due(ctx(metrics={"a": 1.0, "b": 2.0}))
    assert t.state_dict() == {"OnImprovement#0": {"metric": "a", "mode": "min", "best": 1.0},
                              "Counter#0": {"count": 1},
                              "OnImprovement#1": {"metric": "b", "mode": "max", "best": 2.0}}
    other = OnImprovement("a") | OnImprovement("b", "max") | Counter() | Counter()
    with pytest.warns(UserWarning, match="Counter#1"):
        other.load_state_dict(t.state_dict())
    assert [getattr(x, "best", None) for x in other.triggers[:2]] == [1.0, 2.0]
    assert [x.count for x in other.triggers[2:]] == [1, 0]


# ---------------------------------------------------------------- retention alone
def test_keep_last_by_seq_not_step():
    cps = [meta("a", 500, 0), meta("b", 600, 1), meta("c", 300, 2), meta("d", 400, 3)]  # resumed from 300
    assert KeepLast(2).keep(cps) == {"c", "d"}
    assert KeepLast(10).keep(cps) == {"a", "b", "c", "d"}
    assert KeepLast(1).keep([]) == set()
    with pytest.raises(ValueError):
        KeepLast(0)


def test_keep_best_skips_missing_and_nan():
    cps = [meta("a", 1, 0, val_loss=0.5), meta("b", 2, 1, val_loss=float("nan")), meta("c", 3, 2),
           meta("d", 4, 3, val_loss="nan"), meta("e", 5, 4, val_loss=0.7), meta("f", 6, 5, val_loss=0.6),
           meta("g", 7, 6, val_loss="inf")]
    assert KeepBest(2, "val_loss").keep(cps) == {"a", "f"}
    assert KeepBest(2, "val_loss", "max").keep(cps) == {"g", "e"}
    assert KeepBest(10, "val_loss").keep(cps) == {"a", "e", "f", "g"}  # never b, c, d
    assert KeepBest(1, "val_loss").keep([meta("x", 1, 0), meta("y", 2, 1, val_loss=float("nan"))]) == set()
    with pytest.raises(ValueError):
        KeepBest(1, "val_loss", "down")  # type: ignore[arg-type]


def test_keep_best_ties_prefer_newer():
    cps = [meta("a", 1, 0, loss=0.5), meta("b", 2, 1, loss=0.5), meta("c", 3, 2, loss=0.5), meta("d", 4, 3, loss=0.9)]
    assert KeepBest(2, "loss").keep(cps) == {"b", "c"}


def test_keep_every_n_steps_tagged_all():
    cps = run_of(0, 500, 1000, 1500, 2000)
    assert KeepEveryNSteps(1000).keep(cps) == {"s0", "s1000", "s2000"}
    tagged = [meta("a", 1, 0, tags={"milestone"}), meta("b", 2, 1), meta("c", 3, 2, tags={"eval", "x"})]
    assert KeepTagged().keep(tagged) == {"a", "c"}
    assert KeepTagged("eval").keep(tagged) == {"c"}
    assert KeepAll().keep(cps) == {c.name for c in cps}


def test_union_and_or_operator():
    cps = [meta(f"s{s}", s, i, loss=float(10 - i)) for i, s in enumerate(range(100, 1100, 100))]
    cps[0] = meta("s100", 100, 0, loss=-1.0)
    p = KeepLast(2) | KeepBest(1, "loss") | KeepEveryNSteps(500)
    assert isinstance(p, Union) and isinstance(p, Retention) and len(p.policies) == 3
    assert p.keep(cps) == {"s900", "s1000", "s100", "s500"}

    class Even:
        def keep(self, checkpoints):
            return {c.name for c in checkpoints if c.seq % 2 == 0}

    assert (Even() | KeepLast(1)).keep(cps) == {"s100", "s300", "s500", "s700", "s900", "s1000"}
    with pytest.raises(TypeError):
        Union(KeepAll(), 3)  # type: ignore[arg-type]


def test_to_delete_guards_newest_and_protected_oldest_first():
    cps = run_of(100, 200, 300, 400, 500)
    assert to_delete(KeepLast(2), cps) == ["s100", "s200", "s300"]
    assert to_delete(KeepLast(2), list(reversed(cps))) == ["s100", "s200", "s300"]  # input order irrelevant
    assert to_delete(KeepLast(2), cps, protect=["s200", "not-there"]) == ["s100", "s300"]

    class Nothing:  # a rule that keeps nothing still cannot delete the newest
        def keep(self, checkpoints):
            return set()

    assert to_delete(Nothing(), cps) == ["s100", "s200", "s300", "s400"]
    # the newest is the highest seq, even when its step is lower (resumed from an older one)
    branched = run_of(100, 200, 300) + [meta("s150", 150, 3)]
    assert to_delete(Nothing(), branched) == ["s100", "s200", "s300"]
    assert to_delete(KeepAll(), cps) == []
    assert to_delete(Nothing(), []) == []


def test_checkpoint_meta_from_checkpoint_info():
    info = unbroken.CheckpointInfo(name="step-000000100", path="/x/step-000000100", step=100, seq=4,
                                   created=0.0, size_bytes=1, metrics={"val_loss": "nan", "loss": 0.3})
    m = CheckpointMeta.of(info)
    assert (m.name, m.step, m.seq, m.tags) == ("step-000000100", 100, 4, frozenset())
    assert math.isnan(metric_value(m.metrics, "val_loss")) and metric_value(m.metrics, "loss") == 0.3
    assert CheckpointMeta.of(info, tags=["best"]).tags == frozenset({"best"})


# ------------------------------------------------------------- long simulated runs
STEPS, EPOCH, EVAL_EVERY = 10_000, 370, 250


def metric_stream(seed: int) -> dict[int, float]:
    """A noisy, mostly decreasing val_loss, evaluated at epoch ends and every 250 steps, nan sometimes."""
    rng = random.Random(seed)
    out = {}
    for step in range(1, STEPS + 1):
        if step % EPOCH == 0 or step % EVAL_EVERY == 0:
            out[step] = math.nan if rng.random() < 0.06 else 2.0 * math.exp(-step / 3000) + rng.gauss(0, 0.08)
    return out


def tag_stream(seed: int) -> set[int]:
    rng = random.Random(seed + 1)
    return {s for s in range(100, STEPS + 1, 100) if rng.random() < 0.03}


def make_trigger():
    return EveryNSteps(100) | OnImprovement("val_loss", "min") | AtEpochEnd()


POLICY = KeepLast(3) | KeepBest(2, "val_loss", "min") | KeepEveryNSteps(1000) | KeepTagged()


@dataclass
class SimRun:
    """A Checkpointer-like loop: sticky metrics, commit on a due trigger, prune after commit."""

    seed: int
    kill_prob: float = 0.0  # chance that the process dies right after a commit (no prune)
    trigger: AnyOf = field(default_factory=make_trigger)
    existing: dict[str, CheckpointMeta] = field(default_factory=dict)
    history: list[CheckpointMeta] = field(default_factory=list)
    trigger_states: dict[str, dict] = field(default_factory=dict)  # what a checkpoint would hold
    deleted: int = 0
    prunes: int = 0
    skipped: int = 0

    def run(self, start: int = 1, stop: int = STEPS, metrics: dict | None = None, check=None) -> list[int]:
        vals, tags, kill = metric_stream(self.seed), tag_stream(self.seed), random.Random(self.seed + 2)
        metrics = dict(metrics or {})
        saved_at = []
        for step in range(start, stop + 1):
            if step in vals:
                metrics["val_loss"] = vals[step]
            last = self.history[-1] if self.history else None
            c = TriggerContext(step=step, epoch=step // EPOCH, epoch_end=step % EPOCH == 0, now=float(step),
                               last_save_step=last.step if last else None, metrics=metrics)
            if not self.trigger.due(c):
                continue
            saved_at.append(step)
            cp = CheckpointMeta(name=f"step-{step:09d}", step=step, seq=len(self.history),
                                metrics=dict(metrics), tags=frozenset({"milestone"} if step in tags else ()))
            self.history.append(cp)
            self.existing[cp.name] = cp          # committed
            self.trigger_states[cp.name] = self.trigger.state_dict()
            if kill.random() < self.kill_prob:   # killed between commit and prune
                self.skipped += 1
                continue
            doomed = to_delete(POLICY, list(self.existing.values()), protect=[cp.name])
            for name in doomed:
                del self.existing[name]
            self.deleted += len(doomed)
            self.prunes += 1
            if check:
                check(self)
        return saved_at


def expected_survivors(history: list[CheckpointMeta]) -> set[str]:
    """What must (and may only) remain, computed from the whole history, independently."""
    newest = max(history, key=lambda c: c.seq).name
    last3 = {c.name for c in sorted(history, key=lambda c: c.seq)[-3:]}
    scored = [(c.metrics.get("val_loss"), c) for c in history]
    scored = [(v, c) for v, c in scored if v is not None and not math.isnan(v)]
    best2 = {c.name for v, c in sorted(scored, key=lambda vc: (vc[0], -vc[1].seq))[:2]}
    milestones = {c.name for c in history if c.step % 1000 == 0}
    tagged = {c.name for c in history if c.tags}
    return {newest} | last3 | best2 | milestones | tagged


def check_invariants(sim: SimRun) -> None:
    assert set(sim.existing) == expected_survivors(sim.history)


def expected_saves(seed: int) -> list[int]:
    vals, best, out, cur = metric_stream(seed), math.inf, [], None
    for step in range(1, STEPS + 1):
        cur = vals.get(step, cur)
        improved = cur is not None and not math.isnan(cur) and cur < best
        if improved:
            best = cur
        if step % 100 == 0 or step % EPOCH == 0 or improved:
            out.append(step)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_run_triggers_and_retention_invariants(seed):
    sim = SimRun(seed)
    saved = sim.run(check=check_invariants)
    assert saved == expected_saves(seed)
    improvements = [s for s in saved if s % 100 and s % EPOCH]
    assert improvements, "the stream should improve off the 100-step grid at least once"
    assert sim.prunes == len(saved) and sim.deleted > 0
    values = [c.metrics.get("val_loss") for c in sim.history]
    assert any(isinstance(v, float) and math.isnan(v) for v in values)  # nan was saved and survived
    assert any(c.tags for c in sim.history)
    # bounded: 10 milestones + tagged + last 3 + best 2 at most
    assert len(sim.existing) <= 10 + sum(1 for c in sim.history if c.tags) + 3 + 2


@pytest.mark.parametrize("seed", [0, 1])
def test_kill_between_commit_and_prune(seed):
    reference = SimRun(seed)
    reference.run()
    killed = SimRun(seed, kill_prob=0.3)
    killed.run(check=check_invariants)   # the catch-up prune fixes every skipped round at once
    assert killed.skipped > 20
    assert killed.history == reference.history
    if killed.existing.keys() != reference.existing.keys():  # the very last commit was not pruned
        doomed = to_delete(POLICY, list(killed.existing.values()), protect=[killed.history[-1].name])
        for name in doomed:
            del killed.existing[name]
    assert killed.existing == reference.existing


def test_kill_between_commit_and_prune_small():
    cps: list[CheckpointMeta] = []
    policy = KeepLast(2)

    def commit(step):
        cps.append(meta(f"s{step}", step, len(cps)))
        return cps[-1].name

    def prune(protect, limit=None):
        doomed = to_delete(policy, cps, protect=[protect])[:limit]
        cps[:] = [c for c in cps if c.name not in doomed]

    for s in (100, 200, 300):
        prune(commit(s))
    assert [c.name for c in cps] == ["s200", "s300"]
    commit(400)                              # killed before pruning
    assert [c.name for c in cps] == ["s200", "s300", "s400"]
    prune(commit(500))                       # the next commit prunes both rounds
    assert [c.name for c in cps] == ["s400", "s500"]
    for s in (600, 700, 800):
        commit(s)                            # three commits, no prune
    prune("s800", limit=1)                   # killed in the middle of pruning: the oldest went first
    assert [c.name for c in cps] == ["s500", "s600", "s700", "s800"]
    prune("s800")
    assert [c.name for c in cps] == ["s700", "s800"]


@pytest.mark.parametrize("kill_at", [777, 3333, 5000, 9001])
def test_resume_continues_trigger_decisions(kill_at):
    """Killed at ``kill_at``, resumed from the newest checkpoint with its saved trigger state:
    the resumed run saves at exactly the steps the uninterrupted run saves at."""
    seed = 5
    uninterrupted = SimRun(seed).run()
    first = SimRun(seed)
    before = first.run(stop=kill_at)
    last = first.history[-1]
    resumed = SimRun(seed)
    resumed.history = list(first.history)
    resumed.trigger.load_state_dict(first.trigger_states[last.name])
    after = resumed.run(start=last.step + 1, metrics=dict(last.metrics))
    assert [s for s in before if s <= last.step] + after == uninterrupted
    # without the state, the resumed run saves again at once: the restored (sticky) val_loss
    # looks like a first value, hence an improvement
    fresh = SimRun(seed)
    fresh.history = list(first.history)
    fresh_after = fresh.run(start=last.step + 1, metrics=dict(last.metrics))
    assert fresh_after[0] == last.step + 1 and last.step + 1 not in after


# --------------------------------------------------------- pickle-free round trip
def test_trigger_state_round_trip_through_save_and_load(tmp_path):
    imp = OnImprovement("val_loss")
    for v in [0.9, 0.4, 0.6]:
        imp.due(ctx(metrics={"val_loss": v}))
    combo = EveryMinutes(5) | OnImprovement("val_loss") | AtEpochEnd()
    combo.load_state_dict({"OnImprovement#0": imp.state_dict()})
    # both are Stateful (state_dict/load_state_dict), so they go into the state as they are
    unbroken.save(tmp_path / "ck", {"trigger": imp, "combo": combo, "fresh": OnImprovement("x")})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["manifest.json", "state.json"]
    plain = unbroken.load(tmp_path / "ck")  # plain values, nothing unpickled
    assert plain == {"trigger": {"metric": "val_loss", "mode": "min", "best": 0.4},
                     "combo": {"OnImprovement#0": {"metric": "val_loss", "mode": "min", "best": 0.4}},
                     "fresh": {"metric": "x", "mode": "min", "best": None}}

    target, fresh = OnImprovement("val_loss"), OnImprovement("x")
    combo2 = EveryMinutes(5) | OnImprovement("val_loss") | AtEpochEnd()
    fresh.best = 7.0
    unbroken.load(tmp_path / "ck", {"trigger": target, "combo": combo2, "fresh": fresh})
    assert fresh.best is None
    for t in (target, combo2.triggers[1]):
        assert t.best == 0.4
        assert not t.due(ctx(metrics={"val_loss": 0.5}))  # a fresh trigger would save here
        assert t.due(ctx(metrics={"val_loss": 0.3}))


def test_infinite_best_round_trips(tmp_path):
    t = OnImprovement("score", mode="max")
    t.due(ctx(metrics={"score": float("inf")}))
    unbroken.save(tmp_path / "ck", {"t": t})
    back = OnImprovement("score", mode="max")
    unbroken.load(tmp_path / "ck", {"t": back})
    assert back.best == math.inf and not back.due(ctx(metrics={"score": 1e308}))
