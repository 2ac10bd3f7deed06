"""A run opened for writing: its store(s), the writer lock, commits, discovery and retention.

:class:`Run` is what the :class:`~unbroken.Checkpointer` stands on. It opens the run
location once (:func:`unbroken.store.open_store`), and, for a tiered run, the remote
tier with its :class:`~unbroken.tiers.remote.Uploader`. It knows nothing about training: it
writes snapshots, lists and verifies checkpoints, quarantines bad ones, prunes by the
rules it is given, and publishes what it did as events.

With several ranks, every rank has a ``Run`` over the same location; the coordinator
(rank 0) alone holds the lock, cleans leftovers, uploads, prunes, quarantines and writes
tags, and saving and choosing a checkpoint are collectives (:mod:`unbroken.run.collective`).

A location that cannot be written opens *read-only* (docs/architecture.md): restore reads, and
:meth:`Run.write`, :meth:`Run.prune` and :meth:`Run.set_tags` raise ``ReadOnlyRunError``.

Ordering across tiers is by ``seq`` (the commit counter in every manifest): a
checkpoint keeps its seq when it is uploaded or downloaded, so "newest" means the same
thing in both places.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..api import CheckpointInfo
from ..checkpoint.chunks import ChunkWriter, LiveChunks, collect
from ..checkpoint.discovery import discover, manifests, merge_tiers
from ..checkpoint.reader import LoadedCheckpoint
from ..checkpoint.runid import ensure_run_id, read_run_id
from ..checkpoint.snapshot import Snapshot
from ..checkpoint.tags import load_tags, save_tags, sync_tags, tags_by_checkpoint
from ..dist.comm import Comm
from ..errors import ConfigurationError, ReadOnlyRunError, RunLockedError, StorageError, UnbrokenError
from ..events import Event
from ..format.manifest import Manifest
from ..store import open_store
from ..store.local import LocalStore
from ..store.retry import Retry, is_transient
from ..tiers.ram import RamRun, RamTier
from ..tiers.rampeers import start_nodes
from ..tiers.remote import Remote, Uploader, copy_checkpoint
from . import choosing, collective
from .damage import Damage, acknowledge
from .pruning import Pruner
from .scheduling import Schedule

log = logging.getLogger("unbroken")


def _identity(store: Any) -> str:
    """Where a store's data lives, however it was spelled (a store passed in may not say: its URL)."""
    return str(getattr(store, "identity", None) or store.url)


class Run:
    """One run location (plus an optional remote tier), opened by URL or path."""

    def __init__(self, location: Any, *, storage_options: Mapping[str, Any] | None = None,
                 remote: Remote | None = None, publish: Callable[[Event], None] | None = None,
                 comm: Comm | None = None, incremental: bool = False, ram: RamTier | None = None) -> None:
        self.comm = comm or Comm()
        self.store = open_store(location, storage_options)
        if ram is not None and incremental:
            raise ConfigurationError("a RAM tier with incremental=True is not supported: choose one")
        self.chunks: ChunkWriter | None = ChunkWriter(self.store) if incremental else None
        self.has_chunks = incremental  # whether the run may hold chunks (collected after a prune)
        self.remote: Remote | None = remote
        self.remote_store = (open_store(remote.location, remote.storage_options,
                                       retry=Retry(deadline_s=remote.request_deadline_s)) if remote else None)
        if self.remote_store is not None and _identity(self.remote_store) == _identity(self.store):
            raise StorageError("the remote tier must be another location than the run itself")
        self.remote_schedule = Schedule(None, None, remote.keep_last, remote.retention) if remote else None
        self.publish = publish or (lambda e: None)
        self.ram = RamRun(ram, self.store, storage_options, self.publish) if ram is not None else None
        self.lock = self.store.lock()
        self.remote_lock = self.remote_store.lock() if self.remote_store is not None else None
        self.uploader: Uploader | None = None
        self._next_seq = 0
        self.remote_ok = True
        self.last_in_ram = False  # whether the last checkpoint written went to the RAM tier
        self._writing = False
        self.damage = Damage(self.publish)
        self.remote_unlisted = False  # the remote tier could not be listed by the last restore
        self._readonly = ""  # why the run cannot be written (set by begin), "" if it can
        self._readonly_errno = errno.EROFS
        self.pruner = Pruner()

    @property
    def url(self) -> str:
        return self.store.url

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> None:
        """Fail before training on a location that cannot work (unknown scheme, no bucket,
        denied). An unreachable *remote tier* only warns: uploads catch up later."""
        self.store.check()
        if self.remote_store is not None:
            try:
                self.remote_store.check(deadline_s=5.0)
            except StorageError as e:
                if "cannot reach" not in str(e):
                    raise
                self.remote_ok = False
                log.warning("%s; training goes on, checkpoints are kept locally and uploaded when it is back", e)

    @property
    def writing(self) -> bool:
        return self._writing

    @property
    def readonly(self) -> bool:
        """True once :meth:`begin` found that the run location cannot be written."""
        return bool(self._readonly)

    def begin(self) -> None:
        """Become this run's writer (idempotent; a collective): the coordinator locks, cleans
        leftovers and starts uploading; if it cannot, every rank raises. A location that cannot
        be written opens read-only instead (see the module docstring)."""
        if self._writing:
            return
        failure: BaseException | None = None
        readonly, code, run_id = "", errno.EROFS, ""
        if self.comm.coordinator:
            try:
                try:
                    self.lock.acquire()
                except ReadOnlyRunError as e:
                    readonly, code = str(e), e.errno or errno.EROFS
                    run_id = (read_run_id(self.store) or "") if self.ram is not None else ""
                else:
                    for name in self.store.clean_stale():
                        log.info("removed leftover %s of an interrupted save", name)
                    self._collect_at_start()
                    if self.ram is not None:
                        run_id = ensure_run_id(self.store)  # the RAM folder is this run's, not its path's
                        self.ram.attach(run_id)
                        self.ram.begin()
                    if self.remote_store is not None:
                        self._begin_remote()
            except BaseException as e:  # noqa: BLE001 - told to every rank, then raised here
                failure = e
        outcome, readonly, code, run_id = self.comm.broadcast(
            [f"{type(failure).__name__}: {failure}" if failure else "", readonly, code, run_id])
        if failure is not None:
            raise failure
        if outcome:
            raise RunLockedError(f"the coordinator (rank 0) could not open {self.url}: {outcome}")
        self._readonly, self._readonly_errno = readonly, code
        if self.ram is not None and self.ram.run_id != run_id:
            self.ram.attach(run_id)  # the other ranks (and a read-only run: its id, if it has one)
        if self.ram is not None and self.comm.world > 1 and not readonly:
            self.ram.nodes = start_nodes(self.comm, self.ram)  # several nodes: a copy on each
        if readonly and self.comm.coordinator:
            log.warning("%s: the run is read-only: restoring works (nothing is locked, cleaned or quarantined), "
                        "saving, pruning or tagging raises ReadOnlyRunError; to continue training, copy the run "
                        "to a writable folder", readonly)
        self._writing = True

    def require_writable(self, what: str) -> None:
        """Raise :class:`ReadOnlyRunError` (naming the run and why) if this run was opened read-only."""
        if self._readonly:
            err = ReadOnlyRunError(f"cannot {what} {self.url}: {self._readonly}; copy the run to a writable folder "
                                   "and resume from there, or make the folder writable")
            err.errno = self._readonly_errno
            raise err

    def _collect_at_start(self) -> None:
        """Chunks left by saves that died, or by checkpoints deleted before a collection ran
        (no save of this run is in flight yet)."""
        for name in self.store.clean_chunk_temps():
            log.info("removed the half-written chunk %s of an interrupted save", name)
        if self.store.list_chunks():
            self.has_chunks = True
            collect(self.store)

    def _begin_remote(self) -> None:
        assert self.remote_store is not None and self.remote_lock is not None
        try:
            if not self.remote_ok:  # known down: the uploader takes the lease when it is back
                raise ConnectionError("unreachable at start")
            self.remote_lock.acquire()
            for name in self.remote_store.clean_stale():
                log.info("removed leftover %s of an interrupted upload", name)
        except UnbrokenError:
            raise
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning("remote tier %s unreachable (%s); uploads start when it is back", self.remote_store.url, e)
        assert self.remote is not None
        self.uploader = Uploader(self.store, self.remote_store, self.remote_lock, self.publish,
                                 lambda: self.pruner.after_upload(self), self._sync_tags,
                                 (self.remote.retry_wait_s, self.remote.retry_max_wait_s))
        self.uploader.start()
        try:  # catch up: local checkpoints newer than the newest remote one (uploads go oldest first)
            if not self.remote_ok:
                raise ConnectionError("unreachable at start")
            remote_seq: int | None = max((m.seq for m in manifests(self.remote_store).values()), default=-1)
        except Exception:  # noqa: BLE001 - an unreachable remote: its checkpoints are unknown
            remote_seq = None  # unknown: every local one, checked by the uploader once the remote answers
        for name, m in sorted(manifests(self.store).items(), key=lambda kv: kv[1].seq):
            if remote_seq is None or m.seq > remote_seq:
                self.uploader.enqueue(name, unverified=remote_seq is None)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background work (uploads); True only when every checkpoint queued for the
        remote tier is committed there (or superseded by a newer one that is: see
        :meth:`unbroken.tiers.remote.Uploader.wait`); False if some is still pending after ``timeout``
        or could not be uploaded."""
        if self.ram is not None and self.comm.coordinator:
            if not self.ram.wait(timeout):
                return False
            self._persisted()
        return self.uploader.wait(timeout) if self.uploader is not None else True

    def close(self, keep_ram: str | None = None) -> None:
        """Release the run: persist the newest RAM checkpoint, wait for uploads, unlock. The RAM
        folder is removed unless ``keep_ram`` (why the process stops other than by a normal close: a
        signal, a crash; a relaunch on this node restores from memory, and removes it at its own close)."""
        if self.ram is not None and self.comm.coordinator and self._writing and not self._readonly:
            disk = max((m.seq for m in manifests(self.store).values()), default=-1)
            self.ram.close(disk, self.ram.manifests(), keep=keep_ram)
            self._persisted()
        elif self.ram is not None and self.ram.nodes is not None and self.ram.nodes.leader and self._writing:
            self.ram.close_copy(keep=keep_ram)  # another node's copies (node 0's persists the newest)
        if self.uploader is not None:
            assert self.remote is not None
            if not self.uploader.wait(self.remote.close_timeout_s):
                pending = self.uploader.pending()
                if pending:
                    log.error("giving up waiting for uploads after %.0f s: %s not durable on %s (they are "
                              "uploaded by the next run)", self.remote.close_timeout_s, ", ".join(pending),
                              self.remote.location)
                for name, (_, why) in sorted(self.uploader.missed.items()):
                    log.error("%s is not on %s: %s", name, self.remote.location, why)
            self.uploader.stop()
            self.uploader = None
        if self.remote_lock is not None:
            self.remote_lock.release()
        self.lock.release()
        self._writing = False
        self._readonly = ""

    # ----------------------------------------------------------------- discovery
    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints with a readable manifest in every tier, newest first."""
        tiered = self.remote_store is not None or self.ram is not None
        local = discover(self.store, "local" if tiered else "")
        if not tiered:
            return local
        remote = discover(self.ram.store, "ram") if self.ram is not None else []
        if self.remote_store is not None and (self.remote_ok or self.uploader is None or not self.uploader.failing):
            try:
                remote += discover(self.remote_store, "remote")
            except Exception as e:  # noqa: BLE001 - the remote tier down: listed without it, said so
                log.warning("cannot list the remote tier %s: %s", self.remote_store.url, e)
        return merge_tiers(remote + local)  # local last: its path wins

    def next_seq(self) -> int:
        if self.ram is not None and self._next_seq > 0:  # the one writer knows (no listing at every RAM save)
            return self._next_seq
        seqs = [c.seq for c in discover(self.store)] + \
            ([m.seq for m in self.ram.manifests().values()] if self.ram is not None else [])
        if self.remote_store is not None and self._next_seq == 0 and self.remote_ok:
            try:
                seqs += [m.seq for m in manifests(self.remote_store).values()]
            except Exception as e:  # noqa: BLE001 - the remote tier down: numbered from the local ones
                log.warning("cannot list the remote tier %s: %s", self.remote_store.url, e)
        self._next_seq = max(max(seqs, default=-1) + 1, self._next_seq)
        return self._next_seq

    # --------------------------------------------------------------------- write
    def write(self, shared: Snapshot, mine: Snapshot, name: str, comm: Comm | None = None,
              broken: BaseException | None = None, **fields: Any) -> tuple[str, Manifest]:
        """Commit checkpoint ``name`` (or ``name-2``...) with every rank (a collective, see
        :mod:`unbroken.run.collective`, over ``comm``: the background saves' own group when they
        run beside the training loop's step collectives); the coordinator queues its upload.
        A read-only run raises :class:`ReadOnlyRunError` on every rank, before any collective."""
        self.require_writable("save a checkpoint to")
        in_ram = self.saves_to_ram(fields.get("kind", "regular"))
        if in_ram and self.ram is not None and self.comm.coordinator and not self.ram.check_folder() \
                and self.comm.world == 1:  # (several ranks write into one folder: the write fails on every rank)
            in_ram = False  # this checkpoint to the disk tier; the next RAM save tries the folder again
        self.last_in_ram = in_ram
        store = self.ram.store if self.ram is not None and in_ram else self.store
        peers = self.ram.nodes if self.ram is not None and in_ram else None
        final, manifest = collective.write(comm or self.comm, store, self.lock, name, shared, mine,
                                           self.next_seq, broken, chunks=self.chunks, peers=peers, **fields)
        self._next_seq = manifest.seq + 1
        if self.ram is not None and in_ram and self.comm.coordinator:
            self.ram.committed(final)
        elif self.uploader is not None:
            self.uploader.enqueue(final)
        return final, manifest

    def on_local_disk(self, kind: str) -> bool:
        """Whether a save of ``kind`` is written into a local folder (a filesystem or the RAM tier)."""
        return self.saves_to_ram(kind) or isinstance(self.store, LocalStore)

    def saves_to_ram(self, kind: str) -> bool:
        """Whether a save of ``kind`` goes to the RAM tier (regular ones; the others to the disk)."""
        return self.ram is not None and kind == "regular"

    def uploaded_persisted(self) -> bool:
        """Queue the RAM checkpoints the writer persisted for the remote tier; True if any was."""
        assert self.ram is not None
        done = self.ram.drain()
        for _, final, _ in done:
            if self.uploader is not None:
                self.uploader.enqueue(final)
        return bool(done)

    def _persisted(self) -> None:
        """After waiting for the writer: uploads, then what waited for it may go, in RAM and on disk."""
        assert self.ram is not None
        if self.uploaded_persisted():
            self.ram.prune(None, self.ram.manifests())
            self.pruner.after_persist(self)

    def prune(self, schedule: Schedule, keep: str | None) -> list[str]:
        """Apply retention after a save (:meth:`unbroken.run.pruning.Pruner.prune`)."""
        return self.pruner.prune(self, schedule, keep)

    def describe(self, name: str, in_ram: bool = False) -> str:
        """Where checkpoint ``name`` is; ``in_ram``: in the RAM tier (a save of :meth:`saves_to_ram`)."""
        return self.ram.store.describe(name) if in_ram and self.ram is not None else self.store.describe(name)

    # ---------------------------------------------------------------------- read
    def newest_valid(self, repair: LiveChunks | None = None) -> tuple[LoadedCheckpoint | None, str, str]:
        """The newest checkpoint that verifies in any tier (RAM, this location, the remote tier,
        downloaded), where it was read, and the tier it came from; a collective
        (see :func:`unbroken.run.choosing.newest_valid`)."""
        return choosing.newest_valid(self, repair)

    def use_base(self, loaded: LoadedCheckpoint, location: Any = None) -> None:
        """Incremental saves deduplicate against ``loaded`` (just restored) if it is a checkpoint
        of this run (``location``: where it was read, when not found by :meth:`newest_valid`):
        another run's chunks are not in this run's store."""
        if self.chunks is None:
            return
        if location is not None:
            text = os.fspath(location) if not isinstance(location, str) else location
            parent = text.rstrip("/").rpartition("/")[0] if "://" in text else os.path.dirname(os.path.abspath(text))
            own = self.store.url if "://" in text else os.path.abspath(self.store.url)
            if parent != own:
                return
        self.chunks.use_base(loaded.manifest)

    def download(self, name: str) -> str:
        """Copy a checkpoint from the remote tier into the local one, verified; its local name."""
        assert self.remote_store is not None
        log.info("downloading %s", self.remote_store.describe(name))
        final, _ = copy_checkpoint(self.remote_store, name, self.store, lock=self.lock)
        if self.uploader is not None:
            self.uploader.uploaded[final] = name
        return final

    def unrestorable(self) -> list[tuple[str, str]]:
        """Why the run may hold progress that :meth:`newest_valid` could not restore
        (:meth:`unbroken.run.damage.Damage.unrestorable`); empty for a new run. A collective: the
        coordinator looks, every rank gets the list."""
        found: list[tuple[str, str]] = []
        if self.comm.coordinator:
            unknown = self.remote_store is not None and (not self.remote_ok or self.remote_unlisted)
            stores = (self.store, self.remote_store, self.ram.store if self.ram is not None else None)
            found = self.damage.unrestorable([s for s in stores if s is not None],
                                             self.remote_store.url if unknown and self.remote_store else None)
        return [(str(a), str(b)) for a, b in self.comm.broadcast(found)]

    def acknowledge(self, lost: list[tuple[str, str]]) -> None:
        """A fresh start on purpose past ``lost`` (:meth:`unrestorable`): recorded, so the next
        start does not ask again (the coordinator writes it; not in a read-only run)."""
        if self.comm.coordinator and not self.readonly:
            acknowledge(self.store, lost, self.remote_store.url if self.remote_store is not None else None)

    def invalid(self, store: Any, name: str, reason: str, tier: str = "primary") -> None:
        """Report, quarantine and remember an invalid checkpoint (:mod:`unbroken.run.damage`)."""
        self.damage.invalid(store, name, reason, tier, readonly=bool(self._readonly) and store is self.store)

    # ----------------------------------------------------------------------- tags
    def tags(self) -> dict[str, str]:
        return load_tags(self.store)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.require_writable("tag a checkpoint of")
        self.lock.verify()
        save_tags(self.store, tags)
        if self.remote_store is not None and self.uploader is not None:
            self._sync_tags()

    def _sync_tags(self) -> None:
        if self.remote_store is not None and self.uploader is not None:
            sync_tags(self.store, self.remote_store, self.uploader.uploaded)

    def tags_of(self, infos: dict[str, list[str]]) -> dict[str, set[str]]:
        return tags_by_checkpoint(self.store, infos)
