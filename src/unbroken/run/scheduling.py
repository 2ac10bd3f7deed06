"""When to save and what to keep: the Checkpointer's use of :mod:`unbroken.policies`.

``save_every`` and ``keep_last`` are shortcuts that combine with ``trigger`` and
``retention``: ``keep_last=3, retention=KeepBest(2, "val_loss")`` keeps the last three
*and* the best two. Tagged checkpoints are always kept.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..policies import (
    AnyOf,
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

    def __init__(self, save_every: int | None, trigger: Trigger | None, keep_last: int | None,
                 retention: Retention | None) -> None:
        if save_every is not None and save_every < 1:
            raise ValueError("save_every must be a positive number of steps or None")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep everything)")
        if trigger is not None and not isinstance(trigger, Trigger):
            raise TypeError(f"trigger must have due(ctx), got {type(trigger).__name__}")
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(f"retention must have keep(checkpoints), got {type(retention).__name__}")
        triggers = [t for t in (EveryNSteps(save_every) if save_every else None, trigger) if t is not None]
        self.trigger: AnyOf | None = AnyOf(*triggers) if triggers else None
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
