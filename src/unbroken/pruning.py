"""Retention applied to a run's tiers: what :class:`~unbroken.run.Run` deletes after a save or an upload.

:class:`Pruning` is a part of :class:`~unbroken.run.Run` kept in its own module (the class inherits
it): its methods use the run's stores, lock, uploader and RAM tier, which :mod:`unbroken.run` sets
up. Nothing is deleted that retention keeps, the newest checkpoint, the one just saved, or one
waiting for its upload (during an outage, the newest one waiting); a writer whose lock was lost
deletes nothing; chunks no checkpoint uses any more are collected after a prune.
"""

from __future__ import annotations

import logging
from typing import Any

from .chunks import collect
from .discovery import discover
from .events import Pruned
from .scheduling import Schedule
from .tags import retention_blocked

log = logging.getLogger("unbroken")


class Pruning:
    """Retention of :class:`~unbroken.run.Run` (see the module docstring)."""

    def prune(self, schedule: Schedule, keep: str | None) -> list[str]:
        """Delete what ``schedule``'s retention does not keep in the primary store (never the
        newest, never ``keep``, never a checkpoint waiting for its upload; during an outage,
        never the newest one waiting: see :mod:`unbroken.tiers`)."""
        self._schedule = schedule
        self.require_writable("prune")
        if not self.comm.coordinator:
            if self.ram is not None and self.ram.nodes is not None and self.ram.nodes.leader:
                return self.ram.prune(keep, self.ram.manifests())  # its node's copies (unbroken.rampeers)
            return []
        if self.ram is None:
            return self._prune_disk(schedule, keep)
        persisted = self._uploaded_persisted()
        in_ram = self.ram.manifests()
        doomed = self.ram.prune(keep, in_ram)
        if persisted or keep not in in_ram:  # the run location changed: a persisted copy, or a save to it
            doomed += self._prune_disk(schedule, keep)
        return doomed

    def _prune_disk(self, schedule: Schedule, keep: str | None) -> list[str]:
        with self._prune_lock:  # the uploader thread prunes too, after each upload
            if self._retention_blocked(self.store):
                return []
            infos = discover(self.store)
            protect = [keep] if keep else []
            if self.uploader is not None:
                pending = [n for n in self.uploader.pending() if n in {c.name for c in infos}]
                protect += pending[-1:] if self.uploader.failing else pending
            doomed = schedule.doomed(infos, {c.name: set(c.tags) for c in infos}, None, protect=protect)
            if doomed:
                self.lock.verify()  # a writer whose lock was lost deletes nothing either
            for name in doomed:
                self.store.delete(name)
                self.publish(Pruned(name))
                log.debug("retention: deleted %s", self.store.describe(name))
            if doomed and self._has_chunks:  # saves may be in flight (other ranks, the background)
                collect(self.store, pinned=self.chunks.pinned if self.chunks else None, elsewhere=self.comm.world > 1)
        return doomed

    def _retention_blocked(self, store: Any) -> bool:
        """A damaged ``tags.json`` stops retention in ``store`` (the checkpoints it protects are
        unknown), with one warning per run and store until it is readable again."""
        why = retention_blocked(store)
        if why is None:
            self._retention_warned.discard(store.url)
            return False
        if store.url not in self._retention_warned:
            self._retention_warned.add(store.url)
            log.warning("%s", why)
        return True

    def _prune_remote(self) -> list[str]:
        """After an upload: apply the remote tier's retention, and the local one (what waited
        for this upload may go now)."""
        assert self.remote_store is not None and self.remote_schedule is not None
        if self._schedule is not None:
            self._prune_disk(self._schedule, None)
        if self._retention_blocked(self.remote_store):
            return []
        infos = discover(self.remote_store)
        doomed = self.remote_schedule.doomed(infos, {c.name: set(c.tags) for c in infos}, None)
        if doomed and self.remote_lock is not None:
            self.remote_lock.verify()
        for name in doomed:
            self.remote_store.delete(name)
            log.debug("remote retention: deleted %s", self.remote_store.describe(name))
        if doomed and self._has_chunks:  # in the uploader thread: no upload is in flight
            collect(self.remote_store)
        return doomed
