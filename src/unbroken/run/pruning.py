"""Retention applied to a run's tiers: what :class:`~unbroken.run.run.Run` deletes after a save or an upload.

:class:`Pruner` is a part of :class:`~unbroken.run.run.Run` (``run.pruner``), handed the run at each
call (no reference back: a run dropped without ``close()`` is collected at once, its lock
released): it reads the run's public parts (stores, lock, uploader, RAM tier, ranks), which
:mod:`unbroken.run.run` sets up, and keeps its own state (the local schedule, its lock, the warnings
it gave). Nothing is deleted that retention keeps, the newest checkpoint, the one just saved, or one
waiting for its upload (during an outage, the newest one waiting); a writer whose lock was lost
deletes nothing; chunks no checkpoint uses any more are collected after a prune.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ..checkpoint.chunks import collect
from ..checkpoint.discovery import discover
from ..checkpoint.tags import retention_blocked
from ..events import Pruned
from .scheduling import Schedule

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("unbroken")


class Pruner:
    """Retention of one :class:`~unbroken.run.run.Run` (see the module docstring)."""

    def __init__(self) -> None:
        self.schedule: Schedule | None = None  # the local retention, for prunes after uploads
        self._lock = threading.Lock()  # the uploader thread prunes too, after each upload
        self._warned: set[str] = set()  # stores whose damaged tags.json stopped retention (said once)

    def prune(self, run: Run, schedule: Schedule, keep: str | None) -> list[str]:
        """Delete what ``schedule``'s retention does not keep in the primary store (never the
        newest, never ``keep``, never a checkpoint waiting for its upload; during an outage,
        never the newest one waiting: see :mod:`unbroken.tiers.remote`)."""
        self.schedule = schedule
        run.require_writable("prune")
        if not run.comm.coordinator:
            if run.ram is not None and run.ram.nodes is not None and run.ram.nodes.leader:
                return run.ram.prune(keep, run.ram.manifests())  # its node's copies (unbroken.tiers.rampeers)
            return []
        if run.ram is None:
            return self.prune_disk(run, schedule, keep)
        persisted = run.uploaded_persisted()
        in_ram = run.ram.manifests()
        doomed = run.ram.prune(keep, in_ram)
        if persisted or keep not in in_ram:  # the run location changed: a persisted copy, or a save to it
            doomed += self.prune_disk(run, schedule, keep)
        return doomed

    def prune_disk(self, run: Run, schedule: Schedule, keep: str | None) -> list[str]:
        """Apply ``schedule`` to the run location, never deleting ``keep``."""
        with self._lock:
            if self.blocked(run.store):
                return []
            infos = discover(run.store)
            protect = [keep] if keep else []
            if run.uploader is not None:
                pending = [n for n in run.uploader.pending() if n in {c.name for c in infos}]
                protect += pending[-1:] if run.uploader.failing else pending
            doomed = schedule.doomed(infos, {c.name: set(c.tags) for c in infos}, None, protect=protect)
            if doomed:
                run.lock.verify()  # a writer whose lock was lost deletes nothing either
            for name in doomed:
                run.store.delete(name)
                run.publish(Pruned(name))
                log.debug("retention: deleted %s", run.store.describe(name))
            if doomed and run.has_chunks:  # saves may be in flight (other ranks, the background)
                collect(run.store, pinned=run.chunks.pinned if run.chunks else None, elsewhere=run.comm.world > 1)
        return doomed

    def after_persist(self, run: Run) -> None:
        """The RAM tier's writer persisted checkpoints: what waited for them on disk may go."""
        if self.schedule is not None:
            self.prune_disk(run, self.schedule, None)

    def blocked(self, store: Any) -> bool:
        """A damaged ``tags.json`` stops retention in ``store`` (the checkpoints it protects are
        unknown), with one warning per run and store until it is readable again."""
        why = retention_blocked(store)
        if why is None:
            self._warned.discard(store.url)
            return False
        if store.url not in self._warned:
            self._warned.add(store.url)
            log.warning("%s", why)
        return True

    def after_upload(self, run: Run) -> list[str]:
        """After an upload: apply the remote tier's retention, and the local one (what waited
        for this upload may go now)."""
        assert run.remote_store is not None and run.remote_schedule is not None
        self.after_persist(run)
        if self.blocked(run.remote_store):
            return []
        infos = discover(run.remote_store)
        doomed = run.remote_schedule.doomed(infos, {c.name: set(c.tags) for c in infos}, None)
        if doomed and run.remote_lock is not None:
            run.remote_lock.verify()
        for name in doomed:
            run.remote_store.delete(name)
            log.debug("remote retention: deleted %s", run.remote_store.describe(name))
        if doomed and run.has_chunks:  # in the uploader thread: no upload is in flight
            collect(run.remote_store)
        return doomed
