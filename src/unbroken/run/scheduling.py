"""When to save and what to keep: the Checkpointer's use of :mod:`unbroken.policies`.

``save_every`` and ``keep_last`` are shortcuts that combine with ``trigger`` and
``retention``: ``keep_last=3, retention=KeepBest(2, "val_loss")`` keeps the last three
*and* the best two. Tagged checkpoints are always kept. ``save_every="auto"`` is an
:class:`~unbroken.policies.AutoInterval`, which the Checkpointer tells what each save blocked
(:meth:`Schedule.observe_save`) and what the run index says of the run's failures
(:meth:`Schedule.observe_history`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..policies import (
    AnyOf,
    AutoInterval,
    CheckpointMeta,
    EveryNSteps,
    KeepLast,
    KeepTagged,
    Retention,
    Trigger,
    TriggerContext,
    Union,
    to_delete,
)
from ..store.base import is_checkpoint_name


class Schedule:
    """The save trigger and retention policy of one Checkpointer."""

    def __init__(self, save_every: int | str | None, trigger: Trigger | None, keep_last: int | None,
                 retention: Retention | None) -> None:
        if save_every is not None and save_every != "auto" and (
                isinstance(save_every, (bool, str)) or not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a positive number of steps, 'auto' or None, not {save_every!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if trigger is not None and not isinstance(trigger, Trigger):
            raise TypeError(f"trigger must have due(ctx), got {type(trigger).__name__}")
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(f"retention must have keep(checkpoints), got {type(retention).__name__}")
        every: Trigger | None = AutoInterval() if save_every == "auto" else (
            EveryNSteps(save_every) if isinstance(save_every, int) else None)
        triggers = [t for t in (every, trigger) if t is not None]
        self.trigger: AnyOf | None = AnyOf(*triggers) if triggers else None
        self.auto = [t for t in (self.trigger.triggers if self.trigger else ()) if isinstance(t, AutoInterval)]
        """The :class:`~unbroken.policies.AutoInterval` triggers, told what saves cost and failures happen."""
        self._told: str | None = None  # the last choice recorded in the run index
        self._last_interval: float | None = None
        rules = [r for r in (KeepLast(keep_last) if keep_last else None, retention) if r is not None]
        self.retention: Retention | None = Union(*rules, KeepTagged()) if rules else None
        self.last_save_time: float | None = None
        self.last_saved: tuple[int, dict[str, Any]] | None = None
        self._last_instant: tuple[int, int, dict[str, Any]] | None = None  # (step, epoch, metrics)

    def due(self, step: int, epoch: int, epoch_end: bool, metrics: Mapping[str, Any],
            triggers: Sequence[Trigger] | None = None) -> bool:
        """Whether a save is due: every trigger asked, or only ``triggers`` (some of :attr:`trigger`'s)."""
        if self.trigger is None:
            return False
        ctx = TriggerContext(step=step, epoch=epoch, epoch_end=epoch_end, now=time.monotonic(),
                             last_save_step=self.last_saved[0] if self.last_saved else None,
                             last_save_time=self.last_save_time, metrics=metrics)
        if triggers is not None:
            return any([t.due(ctx) for t in triggers])  # noqa: C419 -- a list: ask all, no short-circuit
        return self.trigger.due(ctx)

    def observe_save(self, blocked_s: float, now: float) -> str | None:
        """A save blocked training ``blocked_s`` seconds: the auto intervals learn it. Returns the new choice
        in words when it moved by more than a tenth (for the run index), else ``None``."""
        for t in self.auto:
            t.observe_save(blocked_s)
        return self._choice(now)

    def observe_history(self, failures: int, wall_s: float, now: float) -> str | None:
        """The run index's account of the run (failures that lost work, wall time): the auto intervals learn
        it. Returns the choice in words (for the run index)."""
        for t in self.auto:
            t.observe_history(failures, wall_s, now)
        self._told = None
        return self._choice(now)

    def _choice(self, now: float) -> str | None:
        if not self.auto:
            return None
        t = self.auto[0]
        interval = t.interval_s(now)
        said = t.describe(now)
        last = self._last_interval
        if self._told is not None and interval is not None and last is not None and abs(interval - last) <= 0.1 * last:
            return None
        self._told, self._last_interval = said, interval
        return said

    @property
    def chosen_s(self) -> float | None:
        """The interval in seconds of the last choice recorded (``None``: none yet, or no save measured)."""
        return self._last_interval

    def already_saved(self, step: int, metrics: Mapping[str, Any], epoch: int = 0) -> bool:
        """This instant (step and epoch: the last step of an epoch and the end of that epoch's
        end work share a step) with these metrics is committed already (no second save needed)."""
        return self._last_instant is not None and self._last_instant == (step, epoch, dict(metrics))

    def saved(self, step: int, metrics: Mapping[str, Any], epoch: int = 0) -> None:
        self.last_save_time = time.monotonic()
        self.last_saved = (step, dict(metrics))
        self._last_instant = (step, epoch, dict(metrics))

    def state_dict(self) -> dict[str, Any] | None:
        return self.trigger.state_dict() if self.trigger is not None else None

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if self.trigger is not None and state:
            self.trigger.load_state_dict(state)

    def doomed(self, checkpoints: Sequence[Any], tags: Mapping[str, set[str]], keep: str | None = None,
               protect: Sequence[str] = ()) -> list[str]:
        """Names retention deletes now (oldest first; never the newest, never ``keep`` or ``protect``).
        Only checkpoints named by the Checkpointer's rule count: a copy kept under another name is
        the user's (:func:`~unbroken.store.base.is_checkpoint_name`)."""
        if self.retention is None:
            return []
        metas = [CheckpointMeta.of(c, tags=tags.get(c.name, ())) for c in checkpoints if is_checkpoint_name(c.name)]
        return to_delete(self.retention, metas, protect=[*([keep] if keep else []), *protect])
