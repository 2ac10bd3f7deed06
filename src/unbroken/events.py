"""Typed events of a run, and the bus that delivers them to plug-ins.

The :class:`~unbroken.Checkpointer` publishes what happens (a checkpoint saved,
uploaded, restored, quarantined, pruned, a preemption, ...); collaborators such as the
run index (:mod:`unbroken.run.index.recorder`), the SLURM submit script and the step guard
subscribe with ``ckpt.events.subscribe(listener)`` and never touch the Checkpointer's
internals. A listener that raises is logged and ignored: no plug-in can stop training.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("unbroken")


@dataclass(frozen=True)
class Event:
    """Base class of every event."""


@dataclass(frozen=True)
class Started(Event):
    """This process starts writing the run: fresh (``resumed_from`` None) or after a restore."""

    resumed_from: str | None
    step: int


@dataclass(frozen=True)
class StartedOver(Event):
    """A process started over on purpose at ``step``, without restoring, in a run that had
    ``checkpoints`` committed, the newest at ``newest_step``; ``how``: ``"start_fresh()"`` or
    ``"UNBROKEN_START_FRESH=1"``."""

    step: int
    checkpoints: int
    newest_step: int
    how: str = "UNBROKEN_START_FRESH=1"


@dataclass(frozen=True)
class StepEnded(Event):
    """An optimizer step completed (``Checkpointer.step``), with the metrics passed to it."""

    step: int
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Saved(Event):
    """A checkpoint committed to the primary store (``kind``: regular, preemption, emergency)."""

    name: str
    location: str
    manifest: Any
    took_s: float
    tags: tuple[str, ...] = ()
    tier: str = "primary"
    """``"ram"``: committed to the RAM tier (:mod:`unbroken.tiers.ram`), not (yet) to the run location."""


@dataclass(frozen=True)
class Uploaded(Event):
    """A checkpoint committed on the remote tier: from now on it is durable there."""

    name: str
    location: str
    took_s: float


@dataclass(frozen=True)
class Persisted(Event):
    """A RAM checkpoint was copied to the run location by the RAM tier's writer process
    (:mod:`unbroken.tiers.ram`): from now on it survives the loss of the node's memory."""

    name: str
    location: str
    took_s: float


@dataclass(frozen=True)
class PersistIntervalChosen(Event):
    """``RamTier(persist_every="auto")`` chose a new interval between persists (:mod:`unbroken.tiers.ramauto`)."""

    seconds: float | None
    reason: str
    """The choice and its numbers, in words."""


@dataclass(frozen=True)
class UploadFailed(Event):
    """An upload attempt failed; it is retried (``will_retry``) or given up."""

    name: str
    error: str
    attempt: int
    will_retry: bool = True


@dataclass(frozen=True)
class Restored(Event):
    """State was loaded from a checkpoint (``location``: where it was read; ``tier``: ``ram``,
    ``local``, ``remote`` (downloaded first), or ``path`` (named by the caller))."""

    name: str
    location: str
    step: int
    tier: str = ""


@dataclass(frozen=True)
class CorruptionFound(Event):
    """A checkpoint failed verification (it is quarantined next, if possible)."""

    name: str
    reason: str
    tier: str = "primary"


@dataclass(frozen=True)
class Quarantined(Event):
    """An invalid checkpoint was moved to ``quarantine/``."""

    name: str
    reason: str
    moved_to: str
    tier: str = "primary"


@dataclass(frozen=True)
class Pruned(Event):
    """Retention deleted a checkpoint."""

    name: str
    tier: str = "primary"


@dataclass(frozen=True)
class Tagged(Event):
    """A tag was put on a committed checkpoint."""

    tag: str
    name: str


@dataclass(frozen=True)
class Preempted(Event):
    """A watched signal arrived; the run saved (``checkpoint``) and is exiting."""

    signal: str
    step: int
    checkpoint: str | None
    waited_s: float
    save_s: float
    grace_period_s: float | None
    requeue: bool


@dataclass(frozen=True)
class RolledBack(Event):
    """``Checkpointer.recover`` rolled the live state back in the process: step ``step_failed``
    raised ``error`` (or ``rollback_if`` was true there), ``checkpoint`` (step ``restored_step``)
    was restored, ``attempt`` of ``retries`` consecutive rollbacks; ``skipped_batches`` of data
    were skipped after it (a loss-spike rollback)."""

    step_failed: int
    restored_step: int
    checkpoint: str
    error: str
    attempt: int
    retries: int
    skipped_batches: int = 0
    tier: str = ""
    """The tier ``checkpoint`` was read from (see :class:`Restored`)."""


class Listener(Protocol):
    """Anything with ``on_event(event)``."""

    def on_event(self, event: Event) -> None: ...


class EventBus:
    """Delivers events to subscribers in subscription order; thread-safe."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def publish(self, event: Event) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener.on_event(event)
            except Exception as e:  # noqa: BLE001 - a plug-in never stops training
                log.warning("%s failed on %s: %s: %s", type(listener).__name__, type(event).__name__,
                            type(e).__name__, e)
