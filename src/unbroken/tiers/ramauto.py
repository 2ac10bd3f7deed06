"""``RamTier(persist_every="auto")``: how often the RAM tier's writer copies a RAM checkpoint to the disk.

A RAM checkpoint survives a killed process, not the loss of the node's memory (the node lost or rebooted;
on several nodes, only when no other node holds a copy): the run then resumes from the newest checkpoint
persisted, and the work since is lost. A persist does not block the training (the writer is a process of
its own), but it competes with it for the node's CPU, memory bandwidth and disk, which can slow the steps
it overlaps. The interval that loses the least is Young and Daly's, as for ``save_every="auto"``
(:class:`unbroken.policies.AutoInterval` computes it here too), with:

- **C**, measured: what a persist cost the training — its copy time × the slowdown of the steps that
  ran while the writer copied, ``1 − (step time without a copy) / (step time during one)`` (running
  means over this process's steps; zero when the steps were not slower). Until both step times are
  measured, a persist is taken to cost its whole copy time (as if the training had stopped: the safe
  side, a longer interval).
- **M**, the mean time between losses of the saved state: from the run index, the restarts that resumed
  from an earlier step than a checkpoint the process before had saved
  (:func:`unbroken.run.index.goodput.lost_save_history`), over the run's wall time; until the first, the
  larger of the prior ``node_mtbf_hours`` (a week by default) and the run's age.

The interval is at most ``persist_max_seconds`` (an hour of work at risk by default) and never shorter
than a copy takes (the writer takes the newest due checkpoint when it is free: a persist due while it
copies replaces the one waiting, it never queues). The first RAM checkpoint is persisted (it measures a
copy). Each new choice is published (:class:`unbroken.events.PersistInterval`) and recorded in the run
index (event ``persist_interval``). Only the process that persists (the coordinator) chooses.
"""

from __future__ import annotations

import math

from ..errors import ConfigurationError
from ..policies import AutoInterval
from ..policies.interval import span

WEIGHT = 0.1
"""The weight of the newest step in the running means of the step times (steps are many and noisy)."""
MIN_STEPS = 3
"""Steps of each kind (during a copy, without one) before the slowdown is trusted."""


def check_settings(**settings: object) -> None:
    """:class:`~unbroken.tiers.ram.RamTier`'s ``persist_every`` (a positive number of saves, or ``"auto"``) and
    the numbers ``"auto"`` takes (positive); :class:`~unbroken.errors.ConfigurationError` naming the first wrong."""
    for name, v in settings.items():
        if name == "persist_every":
            if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigurationError(f"RamTier(persist_every={v!r}): a positive number of saves, or 'auto'")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigurationError(f"RamTier({name}={v!r}): a positive number")


class PersistInterval:
    """The persist interval of one RAM tier (see the module docstring). Fed by the RAM run: each step's end
    (:meth:`step_ended`, with whether the writer was copying), each persist's copy time
    (:meth:`persisted`) and the run's history (:meth:`observe_history`); asked :meth:`due` at each RAM commit."""

    def __init__(self, node_mtbf_hours: float, max_seconds: float) -> None:
        self.choice = AutoInterval(mtbf_hours=node_mtbf_hours, max_seconds=max_seconds)
        self.copy_s: float | None = None  # running mean of a copy's duration
        self.during: tuple[float, int] = (0.0, 0)  # (mean step time while the writer copied, steps seen)
        self.without: tuple[float, int] = (0.0, 0)  # (the same without a copy under way)
        self.last_submit: float | None = None  # when the last persist was handed to the writer (monotonic)
        self._last_step: tuple[float, bool] | None = None  # (when the last step ended, writer busy then)
        self._told: float | None = None  # the interval last published

    # ------------------------------------------------------------------ what the run tells it
    def step_ended(self, now: float, copying: bool) -> None:
        """A training step ended at ``now`` (monotonic); ``copying``: the writer is copying now."""
        last, self._last_step = self._last_step, (now, copying)
        if last is None or last[1] != copying:  # a step during which the writer started or stopped: neither
            return
        mean, n = self.during if copying else self.without
        took = now - last[0]
        updated = (took if n == 0 else (1 - WEIGHT) * mean + WEIGHT * took, n + 1)
        if copying:
            self.during = updated
        else:
            self.without = updated

    def slowdown(self) -> float | None:
        """The share of the training's speed a copy takes (0: none), ``None`` until measured."""
        (during, n_during), (without, n_without) = self.during, self.without
        if n_during < MIN_STEPS or n_without < MIN_STEPS or during <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - without / during))

    def persisted(self, took_s: float) -> None:
        """The writer copied a checkpoint to the disk in ``took_s`` seconds."""
        took = max(0.0, float(took_s))
        self.copy_s = took if self.copy_s is None else 0.7 * self.copy_s + 0.3 * took
        slow = self.slowdown()
        self.choice.cost_s = self.copy_s * (1.0 if slow is None else slow)  # C (the copy time is averaged already)

    def observe_history(self, losses: int, wall_s: float, now: float) -> None:
        """The run index says: the saved state was lost ``losses`` times in ``wall_s`` seconds of the run."""
        self.choice.observe_history(losses, wall_s, now)

    # ------------------------------------------------------------------ the choice
    def interval_s(self, now: float) -> float | None:
        """Seconds between persists chosen now (``None``: no copy measured yet)."""
        best = self.choice.interval_s(now)
        return None if best is None or self.copy_s is None else max(best, self.copy_s)

    def due(self, now: float, copying: bool) -> bool:
        """Whether the RAM checkpoint committed at ``now`` is to be persisted (if so, it is noted as handed over);
        ``copying``: the writer is copying one now. Until a copy is measured, a checkpoint is due whenever the
        writer is free (the first; another after a copy that failed)."""
        interval = self.interval_s(now)
        if interval is None:
            if copying:
                return False
        elif self.last_submit is not None and now - self.last_submit < interval:
            return False
        self.last_submit = now
        return True

    def moved(self, now: float) -> str | None:
        """The choice in words when it moved by more than a tenth since it was last told (else ``None``)."""
        interval = self.interval_s(now)
        if interval is None or (self._told is not None and math.isclose(interval, self._told, rel_tol=0.1)):
            return None
        self._told = interval
        return self.describe(now)

    def describe(self, now: float) -> str:
        interval, slow, m = self.interval_s(now), self.slowdown(), self.choice.mtbf_s(now)
        every = "at the next RAM checkpoint (to measure a copy)" if interval is None else f"every {span(interval)}"
        copy = "unknown" if self.copy_s is None else f"{self.copy_s:.3g} s"
        slowed = ("not measured yet: taken as a stalled training" if slow is None
                  else f"the steps {100 * slow:.0f} % slower while it copies")
        losses = self.choice.failures
        why = (f"{losses} loss{'es' if losses != 1 else ''} in {span(self.choice.history_s)}" if losses
               else f"none yet: the prior {span(self.choice.mtbf_hours * 3600)} or the run's age")
        return f"persist {every}: a copy takes {copy}, {slowed}; mean time between losses of the RAM {span(m)} ({why})"

