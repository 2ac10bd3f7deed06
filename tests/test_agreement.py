"""unbroken.checkpointer.agreement in one process: which inputs are agreed when, over a recording fake of two ranks.

The end-to-end checks (real torchrun, gloo, signals, time triggers, loss spikes) are in
tests/test_signals_torchrun.py, tests/test_distributed.py and tests/test_recovery.py.
"""

from __future__ import annotations

from typing import Any

import pytest

import unbroken.checkpointer.agreement as agreement
from unbroken.checkpointer.agreement import LONG, SAVE, SIGNAL, SPIKE, StepAgreement
from unbroken.policies import AtEpochEnd, EveryMinutes, EveryNSteps, OnImprovement


class TwoRanks:
    """A Comm of world size 2 whose peer contributes ``peer`` (its flags) to every reduction."""

    world, rank = 2, 0

    def __init__(self) -> None:
        self.peer = 0
        self.calls: list[str] = []

    def start_max(self, values: list[int]) -> Any:
        self.calls.append("start_max")
        peer = [1 if self.peer & f else 0 for f in (SAVE, SIGNAL, SPIKE, LONG)]
        agreed = [max(a, b) for a, b in zip(values, peer, strict=True)]

        class Pending:
            def result(self) -> list[int]:
                return agreed

        return Pending()


def never(triggers: Any) -> bool:
    return False


def test_a_peers_signal_is_acted_on_one_step_later_on_every_rank_without_a_blocking_call() -> None:
    comm = TwoRanks()
    agree = StepAgreement(comm, [EveryNSteps(4)], watches_signals=True)  # type: ignore[arg-type]
    assert not agree.blocking(at_once=False)
    assert agree.at_step(never, signal=False, spike=None) == 0
    comm.peer = SIGNAL  # the peer got a signal during this step
    agree.after_step(never, signal=False, at_once=False)
    comm.peer = 0
    assert agree.at_step(never, signal=False, spike=None) == SIGNAL  # the next step: every rank stops
    assert comm.calls == ["start_max"]  # the one started after the step, nothing blocking


def test_step_count_triggers_are_due_at_their_own_step_time_triggers_one_step_later() -> None:
    comm = TwoRanks()
    every, minutes = EveryNSteps(4), EveryMinutes(1)
    agree = StepAgreement(comm, [every, minutes], watches_signals=False)  # type: ignore[arg-type]
    asked: list[Any] = []

    def due(triggers: Any) -> bool:
        asked.append(triggers)
        return triggers == [every]

    assert agree.at_step(due, signal=False, spike=None) == SAVE  # no exchange needed, same step
    agree.after_step(lambda t: t == [minutes], signal=False, at_once=False)
    assert agree.at_step(never, signal=False, spike=None) == SAVE  # the time trigger, one step later
    assert asked == [[every]] and comm.calls == ["start_max"]


def test_rollback_if_and_metric_triggers_keep_the_blocking_agreement_at_the_same_step() -> None:
    comm = TwoRanks()
    agree = StepAgreement(comm, [EveryNSteps(4)], watches_signals=True)  # type: ignore[arg-type]
    agree.after_step(never, signal=True, at_once=False)  # a reduction in flight from the last step
    comm.peer = SPIKE  # rollback_if true on the other rank only
    flags = agree.at_step(never, signal=False, spike=False)
    assert flags == SPIKE | SIGNAL  # the peer's spike, and the signal agreed by the reduction in flight
    assert comm.calls == ["start_max", "start_max"]  # the one in flight, then one waited for at once
    agree.after_step(never, signal=False, at_once=True)
    assert comm.calls == ["start_max", "start_max"]  # blocking mode: nothing started for later
    assert StepAgreement(comm, [OnImprovement("loss")], watches_signals=True).blocking(False)  # type: ignore[arg-type]
    assert not StepAgreement(comm, [AtEpochEnd(), EveryMinutes(5)], watches_signals=True).blocking(False)  # type: ignore[arg-type]


def test_nothing_to_agree_on_later_exchanges_nothing() -> None:
    comm = TwoRanks()
    agree = StepAgreement(comm, [EveryNSteps(4)], watches_signals=False)  # type: ignore[arg-type]
    agree.after_step(never, signal=False, at_once=False)
    assert agree.at_step(never, signal=False, spike=None) == 0 and comm.calls == []


def test_once_a_rank_reports_a_long_step_every_later_step_agrees_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal one step late costs a step's time: with long steps, the blocking agreement."""
    comm = TwoRanks()
    agree = StepAgreement(comm, [EveryNSteps(4)], watches_signals=True)  # type: ignore[arg-type]
    agree.after_step(never, signal=False, at_once=False)
    assert agree.at_step(never, signal=False, spike=None) == 0 and not agree.long_steps
    comm.peer = LONG  # the peer's step took longer than LONG_STEP_S
    agree.after_step(never, signal=False, at_once=False)
    comm.peer = 0
    assert agree.at_step(never, signal=False, spike=None) == 0  # LONG is not a flag to act on...
    assert agree.long_steps and agree.blocking(at_once=False)  # ...but from now on, at once
    calls = len(comm.calls)
    agree.after_step(never, signal=False, at_once=False)
    assert len(comm.calls) == calls  # nothing started for later
    comm.peer = SIGNAL
    assert agree.at_step(never, signal=False, spike=None) == SIGNAL  # the peer's signal at this very step
    # this rank's own long step is reported too
    monkeypatch.setattr(agreement, "LONG_STEP_S", 0.0)
    comm2 = TwoRanks()
    mine = StepAgreement(comm2, [EveryNSteps(4)], watches_signals=True)  # type: ignore[arg-type]
    mine.after_step(never, signal=False, at_once=False)  # the first: no step timed yet
    assert not mine.at_step(never, signal=False, spike=None) and not mine.long_steps
    mine.after_step(never, signal=False, at_once=False)
    mine.at_step(never, signal=False, spike=None)
    assert mine.long_steps
