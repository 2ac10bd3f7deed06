"""How the ranks agree at a step boundary without a blocking collective at every step.

At each :meth:`~unbroken.Checkpointer.step` every rank must take the same decision: save this
step or not, stop for a preemption or not, roll back for a loss spike or not. The inputs of that
decision are of three kinds:

- **The same on every rank by construction**: step-count triggers (``save_every``,
  :class:`~unbroken.policies.EveryNSteps`) and epoch-end triggers
  (:class:`~unbroken.policies.AtEpochEnd`) see only the step and epoch counters. Each rank
  evaluates them alone; nothing is exchanged.
- **Different per rank, fine one step later**: time triggers
  (:class:`~unbroken.policies.EveryMinutes`, :class:`~unbroken.policies.AutoInterval`: each rank
  reads its own clock) and preemption
  signals (one rank may get one, or get it a step before the others). Each step boundary starts a
  non-blocking all-reduce (the largest of the ranks' flags, ``async_op=True`` on the
  Checkpointer's gloo group) and the next boundary takes its result. Every rank takes it at the
  same step index, so every rank acts on the same value, one step later; the reduction finishes
  while the step computes, so no rank waits for it and the faster rank is not held back to the
  slower one's pace. A preemption is then saved at the step after the signal (a step, against
  grace periods of seconds to minutes); a *second* signal still aborts at once (the handler does
  it, see :mod:`unbroken.faults.signals`).
- **Different per rank and needed at this very step**: a ``rollback_if`` predicate (inside
  :meth:`~unbroken.Checkpointer.recover`), :class:`~unbroken.policies.OnImprovement` and any
  trigger of your own (unknown to unbroken). One step late is wrong for them: a loss spike must
  roll back before its step is saved (``save_every`` could fall on it: the rollback would then
  restore the spike), and an improvement's checkpoint must be the improving step. While one is
  configured every step keeps one blocking all-reduce, as before.

**Long steps agree at once too.** One step later costs a step's time before a preemption is
saved, and grace periods are tens of seconds: once any rank reports a step of over
:data:`LONG_STEP_S` (the report travels with the reduction, so every rank switches at the same
step), every later step agrees at once, blocking — a collective of well under a millisecond
against steps of over a second costs nothing there. Short steps, where the blocking collective
is what the lag saves, lose less than a second of the grace period.

``unbroken selftest`` also agrees at once: its planned SIGTERM must save the very step planned
(an epoch's last step, so that a resume starts at the epoch boundary), as with one process.

:meth:`~unbroken.Checkpointer.end_epoch` (once per epoch) always agrees at once, blocking: its
triggers may read the epoch's evaluation metrics, and a signal received during the evaluation
is saved at the epoch's end. At world size 1 nothing is exchanged at all.

Every rank must configure the same triggers, the same preemption signals and call ``recover``
the same way: the sequence of collectives depends on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..dist.comm import Comm, PendingMax
from ..policies import AtEpochEnd, AutoInterval, EveryMinutes, EveryNSteps, Trigger

SAVE, SIGNAL, SPIKE, LONG = 1, 2, 4, 8
"""The flags the ranks agree on: a save is due, a signal arrived, ``rollback_if`` was true, a
step took longer than :data:`LONG_STEP_S`."""
LONG_STEP_S = 1.0
"""A step this long or longer makes every later step agree at once (see the module docstring)."""

SAME_ON_EVERY_RANK: tuple[type, ...] = (EveryNSteps, AtEpochEnd)
"""Triggers that see only the step and epoch counters: no agreement needed."""
LATER_IS_FINE: tuple[type, ...] = (EveryMinutes, AutoInterval)
"""Triggers that differ per rank (the clock) and may be acted on one step later."""

Due = Callable[[Sequence[Trigger] | None], bool]
"""``due(triggers)``: whether a save is due now by ``triggers`` (``None``: all of them)."""


class StepAgreement:
    """The decision of each step boundary, the same on every rank (see the module docstring)."""

    def __init__(self, comm: Comm, triggers: Sequence[Trigger], watches_signals: bool) -> None:
        self.comm = comm
        self.same = [t for t in triggers if isinstance(t, SAME_ON_EVERY_RANK)]
        self.later = [t for t in triggers if isinstance(t, LATER_IS_FINE)]
        self.now_only = [t for t in triggers if not isinstance(t, SAME_ON_EVERY_RANK + LATER_IS_FINE)]
        self._exchange = bool(self.later) or watches_signals  # anything to agree on one step later
        self._pending: PendingMax | None = None
        self.long_steps = False  # agreed: steps are long, every step agrees at once from now on
        self._started: float | None = None  # when the last reduction for later was started

    def blocking(self, at_once: bool) -> bool:
        """Whether this step agrees at once: ``at_once`` (a ``rollback_if``, a selftest), one rank,
        a trigger of :attr:`now_only`, steps agreed to be long."""
        return self.comm.world == 1 or at_once or bool(self.now_only) or self.long_steps

    def at_step(self, due: Due, signal: bool, spike: bool | None, at_once: bool = False) -> int:
        """The flags every rank acts on at this step. ``spike``: ``rollback_if``'s answer here
        (``None``: no ``rollback_if``); ``at_once``: agree at once for another reason."""
        if self.blocking(at_once or spike is not None):
            return self.now((SAVE if due(None) else 0) | (SIGNAL if signal else 0) | (SPIKE if spike else 0))
        return self.previous() | (SAVE if due(self.same) else 0)

    def after_step(self, due: Due, signal: bool, at_once: bool) -> None:
        """Once this step's decision is carried out (saved): start agreeing on this rank's time
        triggers and signal (and whether its step was long), for the next step. Nothing in
        blocking mode."""
        if not self.blocking(at_once) and self._exchange:
            now = time.monotonic()
            long = self._started is not None and now - self._started >= LONG_STEP_S
            self._started = now
            self._pending = self.comm.start_max(_bits((SAVE if due(self.later) else 0) | (SIGNAL if signal else 0)
                                                      | (LONG if long else 0)))

    def now(self, flags: int) -> int:
        """``flags`` agreed at once (blocking), with the result of a reduction still in flight."""
        flags |= self.previous()
        return flags if self.comm.world == 1 else _flags(self.comm.start_max(_bits(flags)).result())

    def previous(self) -> int:
        """The flags agreed by the reduction the previous boundary started (0 if none); a LONG
        among them switches every later step to agreeing at once (on every rank at this step)."""
        pending, self._pending = self._pending, None
        flags = _flags(pending.result()) if pending is not None else 0
        if flags & LONG:
            self.long_steps = True
        return flags & ~LONG


_ALL = (SAVE, SIGNAL, SPIKE, LONG)


def _bits(flags: int) -> list[int]:
    """One element per flag: the element-wise MAX over the ranks is their OR (a MAX of the
    combined integer is not: SPIKE on one rank would hide SIGNAL on another)."""
    return [1 if flags & f else 0 for f in _ALL]


def _flags(bits: list[int]) -> int:
    return sum(f for f, b in zip(_ALL, bits, strict=True) if b)
