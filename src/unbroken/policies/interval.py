"""``save_every="auto"``: the save interval that loses the least time, from what this run measures.

A failure costs the work done since the last save (half an interval on average) plus the restart;
a save costs the time it blocks training. With a save blocking ``C`` seconds and a mean time
between failures ``M``, the interval between saves that loses the least is Young's
``sqrt(2 × C × M)``, to first order (Daly, 2006: ``sqrt(2 × C × M) − C``, used here, for
``C < M / 2``; ``M`` itself beyond that). :class:`AutoInterval` computes it from:

- **C**, measured: the time each of this run's saves blocked the training thread (all of a
  synchronous save, the snapshot of an async one), averaged with more weight on the latest
  (kept in the checkpoint, so a resumed process starts from it). Before the first save of a run it
  is unknown: the first step boundary saves, which measures it.
- **M**, from the run's own history in the run index: the failures that lost work (processes that
  ended without closing — killed, crashed — and in-process rollbacks) over the run's wall time so
  far. Before the first failure, ``M`` is the larger of the prior ``mtbf_hours`` and the time the
  run has gone without one; after it, the wall time per failure.

The interval is then bounded by ``min_seconds`` and ``max_seconds`` (at most an hour of work at
risk by default) and never shorter than a save. It is a time trigger: each rank reads its own
clock and the ranks agree one step later (:mod:`unbroken.checkpointer.agreement`), as with
:class:`~unbroken.policies.EveryMinutes`. Each new choice is recorded in the run index
(event ``save_interval``, ``unbroken log``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .triggers import TriggerContext, _TriggerOps

WEIGHT = 0.3
"""The weight of the newest save's blocking time in the running estimate of ``C``."""


@dataclass
class AutoInterval(_TriggerOps):
    """Saves at the interval that loses the least time (see the module docstring):
    ``Checkpointer(..., save_every="auto")`` or ``trigger=AutoInterval(mtbf_hours=...)``.

    Args:
        mtbf_hours: the mean time between failures to assume until the run has had one.
        min_seconds: never save more often than this.
        max_seconds: never let more than this much work go unsaved.
    """

    mtbf_hours: float = 24.0
    min_seconds: float = 0.0
    max_seconds: float = 3600.0
    cost_s: float | None = field(default=None, repr=False)
    """``C``: the running estimate of a save's blocking time (``None`` before the first save)."""
    failures: int = field(default=0, repr=False)
    """Failures that lost work in the run so far (from the run index, :meth:`observe_history`)."""
    history_s: float = field(default=0.0, repr=False)
    """The run's wall time before this process, or before its last rollback."""
    _started: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("mtbf_hours", "max_seconds"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"AutoInterval({name}) must be a positive number, got {v!r}")
        if not (isinstance(self.min_seconds, (int, float)) and 0 <= self.min_seconds <= self.max_seconds):
            raise ValueError(f"AutoInterval(min_seconds) must be between 0 and max_seconds, got {self.min_seconds!r}")

    # ------------------------------------------------------------------ what the run tells it
    def observe_save(self, blocked_s: float) -> None:
        """A save blocked training for ``blocked_s`` seconds."""
        b = max(0.0, float(blocked_s))
        self.cost_s = b if self.cost_s is None else (1 - WEIGHT) * self.cost_s + WEIGHT * b

    def observe_history(self, failures: int, wall_s: float, now: float) -> None:
        """The run index says: ``failures`` failures that lost work in ``wall_s`` seconds of the run
        (until ``now``, this process's ``time.monotonic()``)."""
        self.failures, self.history_s, self._started = max(0, int(failures)), max(0.0, float(wall_s)), now

    # ------------------------------------------------------------------ the choice
    def mtbf_s(self, now: float) -> float:
        """``M``: the mean time between failures this run has shown (the prior before its first)."""
        wall = self.history_s + (now - self._started if self._started is not None else 0.0)
        if self.failures == 0:
            return max(self.mtbf_hours * 3600.0, wall)
        return max(wall, 1e-3) / self.failures

    def interval_s(self, now: float) -> float | None:
        """The interval between saves chosen now (``None``: no save measured yet)."""
        if self.cost_s is None:
            return None
        c, m = self.cost_s, self.mtbf_s(now)
        best = math.sqrt(2 * c * m) - c if c < m / 2 else m
        return min(self.max_seconds, max(self.min_seconds, c, best))

    def due(self, ctx: TriggerContext) -> bool:
        if self._started is None:
            self._started = ctx.now
        interval = self.interval_s(ctx.now)
        if interval is None:
            return ctx.step > 0  # the first save of the run measures what a save costs
        since = ctx.last_save_time if ctx.last_save_time is not None else self._started
        return ctx.now - since >= interval

    def describe(self, now: float) -> str:
        """The choice in words, for the run index."""
        interval = self.interval_s(now)
        m = self.mtbf_s(now)
        why = (f"{self.failures} failure{'s' if self.failures != 1 else ''} in {span(self.history_s)}"
               if self.failures else f"no failure yet: the prior {span(self.mtbf_hours * 3600)} or the run's age")
        every = "at the next step (to measure a save)" if interval is None else f"every {span(interval)}"
        cost = "unknown" if self.cost_s is None else f"{self.cost_s:.3g} s"
        return f"save {every}: a save blocks {cost}, mean time between failures {span(m)} ({why})"

    def state_dict(self) -> dict[str, Any]:
        return {"cost_s": self.cost_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cost = state.get("cost_s") if isinstance(state, dict) else None
        self.cost_s = float(cost) if isinstance(cost, (int, float)) and cost >= 0 else self.cost_s


def span(seconds: float) -> str:
    """A duration in words: seconds, minutes or hours."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
