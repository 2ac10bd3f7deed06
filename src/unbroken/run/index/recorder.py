"""The run index as a plug-in: it listens to the run's events and never stops training.

The index (:mod:`unbroken.run.index.index`) is derived data. If it cannot be written (a full
disk, a read-only folder, a damaged database that cannot be moved aside), the run goes
on without it: one warning, then the recorder stays silent. ``unbroken`` rebuilds the
index from the manifests the next time it opens.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from ... import events as ev
from .index import RunIndex
from .progress import SegmentProgress, process_started

log = logging.getLogger("unbroken")


class Recorder:
    """Writes the run's segments, checkpoints, events, per-step metrics and each segment's progress (step
    boundaries and what saves blocked: :mod:`unbroken.run.index.progress`) to the index."""

    def __init__(self, store: Any) -> None:
        self._index: RunIndex | None = None
        self._segment = False
        self._rows: dict[str, tuple[int, int]] = {}  # per metric: rows logged by this segment, last step
        self._progress: SegmentProgress | None = None  # this segment's
        self._call("open", lambda: setattr(self, "_index", RunIndex(store)))

    def on_event(self, e: ev.Event) -> None:
        """Translate one run event into index rows (see :mod:`unbroken.events`)."""
        if isinstance(e, ev.Started):
            self.segment(e.resumed_from, e.step)
        elif isinstance(e, ev.StartedOver):  # on purpose (UNBROKEN_START_FRESH=1): never only a log line
            self.event("started_over", e.how, step=e.step,
                       data={"checkpoints": e.checkpoints, "newest_step": e.newest_step})
        elif isinstance(e, ev.Restored):
            self.segment(e.name, e.step, e.tier)
        elif isinstance(e, ev.StepEnded):
            self.metrics(e.step, e.metrics)
            self.stepped(e.step)
        elif isinstance(e, ev.Saved):
            self.saved(e.name, e.manifest, e.took_s, list(e.tags), sync=e.tier != "ram")
        elif isinstance(e, ev.CorruptionFound):
            self.event("corruption_found", e.reason, checkpoint=e.name, data={"tier": e.tier})
        elif isinstance(e, ev.Quarantined):
            if e.tier == "primary":
                self.status(e.name, "quarantined", e.reason)
            else:
                self.event("quarantined", e.reason, checkpoint=e.name, data={"tier": e.tier})
        elif isinstance(e, ev.Pruned):
            if e.tier == "primary":
                self.status(e.name, "pruned", "retention")
            else:
                self.event("pruned", "retention", checkpoint=e.name, data={"tier": e.tier})
        elif isinstance(e, ev.Tagged):
            self.event("tagged", e.tag, checkpoint=e.name)
        elif isinstance(e, ev.Uploaded):
            self.event("uploaded", e.location, checkpoint=e.name, data={"took_s": e.took_s})
        elif isinstance(e, ev.Persisted):
            self.event("persisted", e.location, checkpoint=e.name, data={"took_s": e.took_s})
        elif isinstance(e, ev.PersistIntervalChosen):
            self.event("persist_interval", e.reason, data={"seconds": e.seconds})
        elif isinstance(e, ev.UploadFailed):
            self.event("upload_failed", e.error, checkpoint=e.name,
                       data={"attempt": e.attempt, "will_retry": e.will_retry})
        elif isinstance(e, ev.RolledBack):  # a resume inside the process: a new segment after it
            self.event("rolled_back", e.error, step=e.step_failed, checkpoint=e.checkpoint,
                       data={"restored_step": e.restored_step, "attempt": e.attempt, "retries": e.retries,
                             "skipped_batches": e.skipped_batches, "tier": e.tier})
            self._segment, self._rows = False, {}
            self.segment(e.checkpoint, e.restored_step)
        elif isinstance(e, ev.Preempted):
            self.event("preempted", e.signal, step=e.step, checkpoint=e.checkpoint,
                       data={"waited_s": e.waited_s, "save_s": e.save_s, "grace_period_s": e.grace_period_s,
                             "requeue": e.requeue})

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (sqlite3.Error, OSError, ValueError, TypeError, RuntimeError) as e:
            log.warning("run index disabled after a failed %s: %s: %s (training continues; "
                        "the index is rebuilt from the manifests next time)", what, type(e).__name__, e)
            if self._index is not None:
                try:
                    self._index.close()
                except Exception:  # noqa: BLE001 - closing the index at exit: nothing left to do
                    pass
            self._index = None
            return None

    @property
    def index(self) -> RunIndex | None:
        return self._index

    @property
    def segment_id(self) -> int | None:
        """The run index's id of this process's current segment (``None`` before it starts)."""
        return self._progress.segment if self._progress is not None else None

    def segment(self, resumed_from: str | None, step: int, tier: str = "") -> None:
        """Start the run segment (once per process): after restore (``tier``: where it read from), or
        at the first step."""
        if self._segment or self._index is None:
            return
        self._segment = True
        seg = self._call("start_segment", lambda: self._index.start_segment(resumed_from, step, tier))
        self._progress = SegmentProgress(seg, process_started()) if seg is not None else None

    def stepped(self, step: int) -> None:
        """A step boundary (step ``step`` done): kept in this segment's progress, committed with the next
        write or within ``host_flush_seconds`` (no commit of its own while metrics are logged)."""
        if self._index is None:
            return
        self.segment(None, step - 1)
        if (p := self._progress) is not None:
            p.step(step, time.time())
            self._call("progress", lambda: self._index.progressed(p))

    def save_blocked(self, step: int, seconds: float) -> None:
        """A save of step ``step`` blocked training for ``seconds`` (``Saver.save``: from its call to its
        return; for an async save, the snapshot); added to this segment's progress and committed at once (one
        commit without fsync per save, beside the save's own: a kill right after a save keeps it)."""
        if self._index is not None and (p := self._progress) is not None:
            p.saved(step, seconds, time.time())
            self._call("progress", lambda: self._index.progressed(p, at_once=True))

    def metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                   or (hasattr(v, "numel") and v.numel() == 1)}
        if numbers and self._index is not None:
            self.segment(None, step - 1)
            self._call("log_metrics", lambda: self._index.log_metrics(step, numbers))
            for k in numbers:
                self._rows[k] = (self._rows.get(k, (0, 0))[0] + 1, step)

    def durable(self, step: int, sync: bool = True) -> None:
        """At a save point: every metric row logged so far becomes durable before the checkpoint
        commits, with a mark of how many there are (``metrics --check`` finds lost ones); ``sync``
        False for a RAM checkpoint (committed, not fsynced: see ``RunIndex.mark_durable``)."""
        if self._index is not None and self._segment:
            self._call("mark_durable", lambda: self._index.mark_durable(step, self._rows, sync))

    def saved(self, name: str, manifest: Any, took: float, tags: list[str], sync: bool = True) -> None:
        if self._index is None:
            return
        self.segment(None, manifest.step)
        self._call("record_checkpoint", lambda: self._index.record_checkpoint(
            name, manifest.step, manifest.seq, manifest.progress.get("epoch"), manifest.created, took,
            manifest.total_bytes, manifest.kind, manifest.metrics, tags, manifest.environment, sync=sync))

    def status(self, name: str, status: str, message: str) -> None:
        if self._index is not None:
            self._call("set_status", lambda: self._index.set_status(name, status, message))

    def event(self, kind: str, message: str = "", step: int | None = None, checkpoint: str | None = None,
              data: Mapping[str, Any] | None = None) -> None:
        if self._index is not None:
            self._call("event", lambda: self._index.event(kind, message, step, checkpoint, data))

    def close(self) -> None:
        if self._index is not None:
            self._call("close", self._index.close)
        self._index = None
