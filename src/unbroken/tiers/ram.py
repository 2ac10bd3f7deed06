"""The RAM tier: checkpoints in node-local shared memory, persisted by a writer process.

``Checkpointer("runs/exp1", save_every=1, ram=RamTier(keep_last=2, persist_every=50))``: every
regular save commits to a folder in ``/dev/shm`` (a memory copy: tmpfs has no disk behind it),
verified and atomic like every other tier (checksums, the manifest written last, a rename).
Every ``persist_every``-th RAM checkpoint is copied to the run location (``runs/exp1``, and
from there to a :class:`~unbroken.Remote` tier if there is one) by a **separate process**
(:mod:`unbroken.tiers.ramwriter`): it never holds the training process's GIL, and it does not die
with the trainer.

**What survives what.** A killed training process (SIGKILL, the OOM killer, a segfault, an
exception) leaves its RAM checkpoints behind: the relaunched process restores the newest valid
checkpoint across RAM and disk (and the remote tier), so it reads memory, not the disk. A node
that reboots or is lost takes its RAM with it: on one node, the relaunch restores the newest
checkpoint persisted to disk, up to ``persist_every`` saves older; on several, from another
node's memory (see *Ranks*). A checkpoint the writer was persisting
when the node died is simply not committed on disk. Preemption and emergency checkpoints, and
:meth:`~unbroken.Checkpointer.save` calls other than the regular schedule, go to the disk
directly (the node may be about to go away).

**Memory is bounded and stated.** The tier keeps ``keep_last`` checkpoints (plus, while the
writer copies one, that one) and needs room for one more being written: at the first save it
refuses (:class:`~unbroken.errors.InsufficientSpaceError`, with the numbers) when the shared
memory filesystem cannot hold ``keep_last + 1`` checkpoints; containers often mount a 64 MB
``/dev/shm`` (``docker run --shm-size``). Shared memory counts against the job's memory limit
on most schedulers.

**Clean-up.** A normal :meth:`~unbroken.Checkpointer.close` (or leaving a ``with`` block without an
exception) persists the newest RAM checkpoint if the disk does not have it, waits for the writer,
and removes the run's RAM folder, so a finished run leaves no shared memory behind. A process
that stops on a signal (a preemption) or a crash (an exception, the close at interpreter exit of
a Checkpointer left open) persists the same way but keeps the folder for its relaunch on this
node, which restores from it and removes it at its own close. Every start removes the folders
no live process owns (the trainer and its writer hold a shared lock on ``.owner``) whose
checkpoints are all older than their run's newest on disk; one holding a newer state (a killed
run never relaunched) is named in the log and kept (``/dev/shm/unbroken-<uid>/``).

**Other users (threat model).** ``/dev/shm`` is writable by every user of the node and often shared
by containers. The per-user folder ``unbroken-<uid>`` and each run's folder in it are created 0700
and opened without following links, their owner checked on the open descriptor
(:mod:`unbroken.store.private`): another user can neither read nor write the RAM checkpoints, nor
make a trainer use a folder or follow a link they planted (refused, naming them). What they can
still do is deny the tier: take the name ``unbroken-<uid>`` first (the trainer refuses to start and
says how to choose another root) or fill the shared memory (the first save refuses with the sizes).

**One run, one RAM folder.** The folder is keyed by the run's path *and* its id (``run-id`` in the
run folder, created once: :mod:`unbroken.checkpoint.runid`), and its marker names both: a run deleted and made
again at the same path, or another container's volume at that path, never restores, prunes or
persists the other's RAM checkpoints (a start collects another run's folder only when it can tell it
is unneeded: otherwise it is kept and named). One trainer per RAM folder: the coordinator (or a
node's leader) holds ``.trainer`` exclusively, so a second job on the same run reached another way
(a copy of the volume mounted at the same path) is refused, naming the holder. A RAM folder removed
under a running trainer (a ``/dev/shm`` cleaner, systemd's ``RemoveIPC=yes``) is made again at the
next RAM save, with a warning; until a new RAM checkpoint commits, a restart resumes from the disk.
On one process a folder that cannot be made again sends that save to the disk; with several ranks
that save fails on every rank, as any failed write does.

**Ranks.** With several ranks on one node every rank writes its part into the same RAM folder
and the coordinator commits and persists, as on disk. On several nodes (each with its own
``/dev/shm``) every node keeps a copy of every RAM checkpoint, so the loss of a node is survived
from another node's memory (:mod:`unbroken.tiers.rampeers`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigurationError, StorageError, UnbrokenError
from ..events import Event, Persisted, PersistIntervalChosen, Pruned, StepEnded
from ..format.manifest import Manifest
from ..store import open_ram_store
from ..store.private import private_folder
from .ramauto import PersistInterval, check_settings
from .ramfolder import MARKER, collect_orphans, exclusive, own, remove_folder
from .rampeers import Nodes
from .ramwriter import Persister

log = logging.getLogger("unbroken")
@dataclass
class RamTier:
    """The RAM tier of a :class:`~unbroken.Checkpointer` (see :mod:`unbroken.tiers.ram`).

    Args:
        keep_last: RAM checkpoints kept (at least 1). Memory: ``keep_last + 1`` checkpoints.
        persist_every: every this many RAM saves, the RAM checkpoint is copied to the run
            location by the writer process (1: every save; the writer takes the newest due
            one when it is free, so a slow disk skips, never queues, copies). ``"auto"``: at the
            interval that loses the least, from what a copy costs the training and how often the
            run loses its RAM checkpoints (:mod:`unbroken.tiers.ramauto`).
        root: where the RAM folders live (default ``$UNBROKEN_RAM_ROOT`` or ``/dev/shm``).
        close_timeout_s: how long ``close()`` waits for the writer's last copy.
        node_mtbf_hours: ``persist_every="auto"``: the mean time between losses of the node's
            memory to assume until the run has had one.
        persist_max_seconds: ``persist_every="auto"``: never leave more than this much work unpersisted.
    """

    keep_last: int = 2
    persist_every: int | Literal["auto"] = 10
    root: str | None = None
    close_timeout_s: float = 300.0
    node_mtbf_hours: float = 168.0
    persist_max_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigurationError(f"RamTier(keep_last={self.keep_last!r}): keep at least 1 checkpoint in RAM")
        check_settings(persist_every=self.persist_every, node_mtbf_hours=self.node_mtbf_hours,
                       persist_max_seconds=self.persist_max_seconds)

    def folder(self, identity: str, run_id: str) -> Path:
        """The RAM folder of the run whose store identity (its real path) is ``identity`` and whose id
        (:mod:`unbroken.checkpoint.runid`) is ``run_id``."""
        root = Path(self.root or os.environ.get("UNBROKEN_RAM_ROOT") or "/dev/shm")
        digest = hashlib.sha256(f"{identity}\0{run_id}".encode()).hexdigest()[:24]
        return root / f"unbroken-{os.getuid()}" / digest


class RamRun:
    """The RAM side of a :class:`~unbroken.run.run.Run`: the RAM store, its retention, the writer."""

    def __init__(self, tier: RamTier, disk: Any, storage_options: Mapping[str, Any] | None,
                 publish: Callable[[Event], None]) -> None:
        if not isinstance(tier, RamTier):
            raise ConfigurationError(f"ram={tier!r}: pass unbroken.RamTier(...)")
        self.tier, self.disk, self.publish = tier, disk, publish
        self.storage_options = storage_options
        self.run_id = ""  # set by attach(), before the folder is used
        self.attach("")
        self.saves = 0  # RAM commits by this process
        self.pending: str | None = None  # due for persisting while the writer was busy
        self.persisted: dict[str, str] = {}  # RAM name -> its name on disk
        self.failures: list[str] = []
        self._done: list[tuple[str, str, float]] = []  # persisted, not yet handled by the run
        self._owner: int | None = None  # a shared lock on OWNER (the writer process holds one too)
        self._exclusive: int | None = None  # the lock on TRAINER: one trainer per RAM folder
        self._inode = -1  # the folder's, once marked: a folder removed (or replaced) under the trainer differs
        self._manifests: dict[str, Manifest] = {}  # committed RAM checkpoints (a name never changes)
        self._lock = threading.RLock()  # saves commit in a background thread (async_save), prunes in the loop's
        self.nodes: Nodes | None = None  # several nodes (unbroken.tiers.rampeers); None on one
        self.auto = PersistInterval(tier.node_mtbf_hours, tier.persist_max_seconds) \
            if tier.persist_every == "auto" else None
        """``persist_every="auto"``: the interval's choice (:mod:`unbroken.tiers.ramauto`)."""

    # ---------------------------------------------------------------- lifecycle
    def attach(self, run_id: str) -> None:
        """Key the RAM folder by the run's id (:mod:`unbroken.checkpoint.runid`) as well as its path: every rank,
        once the coordinator has read or created the id (``""``: a run without one, read-only)."""
        self.run_id = run_id
        self.dir = self.tier.folder(str(getattr(self.disk, "identity", None) or self.disk.url), run_id)
        self.store = open_ram_store(self.dir, self.tier.keep_last)
        self.persister = Persister(str(self.dir), self.disk.url, self.storage_options)

    def ensure_folder(self) -> None:
        """Create or open the RAM folder and the per-user folder above it, as ``mkstemp`` would in a
        place every user can write (``/dev/shm``): no link followed, each folder checked through its
        open descriptor to be the user's own and private (see :func:`private_folder`)."""
        root = self.dir.parent.parent
        for attempt in range(3):  # another run of this user may remove the per-user folder as it empties it
            try:
                with private_folder(root, self.dir.parent.name, shared_root=True) as user:
                    with private_folder(self.dir.parent, self.dir.name, parent_fd=user):
                        return
            except FileNotFoundError:
                if attempt == 2:
                    raise StorageError(f"cannot create the RAM tier's folder {self.dir}: it keeps vanishing") from None

    def begin(self) -> None:
        """The coordinator (on several nodes: each node's leader) opens the folder: mark it as
        this run's, remove leftovers of saves that died (only those of dead writers)."""
        self.ensure_folder()
        self._mark()
        self._owner = own(self.dir)
        self._exclusive = exclusive(self.dir)
        for name in self.store.clean_stale():
            log.info("removed leftover %s of an interrupted RAM save", name)
        collect_orphans(self.dir.parent, self.dir)
        held = self.store.list_committed()
        if held:
            log.info("the RAM tier %s holds %d checkpoint(s) of a previous process", self.dir, len(held))

    def _mark(self) -> None:
        """The folder's marker names the run (its path and id): a folder of another run (same path,
        another id: a run created again there, another container's volume) is never used."""
        marker = self.dir / MARKER
        mine = {"run": self.disk.url, "identity": str(getattr(self.disk, "identity", self.disk.url)),
                "run_id": self.run_id}
        if marker.exists():
            try:
                found = json.loads(marker.read_text())
            except (OSError, ValueError):
                found = {}
            if (found.get("identity"), found.get("run_id")) != (mine["identity"], mine["run_id"]):
                raise StorageError(f"{self.dir} belongs to another run ({found.get('run', 'unknown')}, id "
                                   f"{found.get('run_id', 'none')}; this run's id is {self.run_id}); remove it, "
                                   "or use RamTier(root=...)")
        else:
            self.store.write_meta(MARKER, json.dumps(mine).encode())
        self._inode = os.stat(self.dir, follow_symlinks=False).st_ino

    def check_folder(self) -> bool:
        """Before a RAM save: the folder is still this run's. Removed under the running trainer (a
        ``/dev/shm`` cleaner, systemd's ``RemoveIPC``), it is made again, empty, with a warning: the
        RAM tier protects again from this save on (the disk tier has the run meanwhile). False if it
        cannot be made again (the caller saves to disk), with a warning saying why."""
        try:
            if os.stat(self.dir, follow_symlinks=False).st_ino == self._inode and (self.dir / MARKER).is_file():
                return True
        except OSError:
            pass
        log.warning("the RAM tier's folder %s was removed (or replaced) under this running process (a /dev/shm "
                    "cleaner? systemd's RemoveIPC=yes?): its RAM checkpoints are gone; making it again (until a "
                    "new RAM checkpoint commits, a restart resumes from the disk tier %s)", self.dir, self.disk.url)
        self._release_owner()
        with self._lock:
            self._manifests.clear()
        try:
            self.ensure_folder()
            self._mark()
            self._owner = own(self.dir)
            self._exclusive = exclusive(self.dir)
        except (OSError, UnbrokenError) as e:
            log.warning("cannot make the RAM tier's folder %s again (%s): this checkpoint goes to the disk tier %s",
                        self.dir, e, self.disk.url)
            return False
        return True

    def manifests(self) -> dict[str, Manifest]:
        """The readable manifests of the committed RAM checkpoints (read once per checkpoint)."""
        from ..checkpoint.manifests import read_manifest

        names = set(self.store.list_committed())
        with self._lock:
            for name in names - set(self._manifests):
                try:
                    self._manifests[name] = read_manifest(self.store, name)
                except (UnbrokenError, OSError):  # unreadable: left to the restore's verification
                    continue
            for gone in set(self._manifests) - names:
                del self._manifests[gone]
            return {n: m for n, m in self._manifests.items() if n in names}

    # ------------------------------------------------------------------- saving
    def committed(self, name: str) -> None:
        """A regular save committed to RAM: hand it to the writer when it is due."""
        with self._lock:
            self.saves += 1
            self.collect()
            if self.auto is not None:
                due = self.auto.due(time.monotonic(), self.persister.busy is not None)
            else:
                due = self.saves % int(self.tier.persist_every) == 0
            if due:
                self._persist(name)

    def on_event(self, e: Event) -> None:
        """``persist_every="auto"``: each step's end, timed, with whether the writer is copying."""
        if self.auto is not None and isinstance(e, StepEnded):
            self.auto.step_ended(time.monotonic(), self.persister.busy is not None)

    def _persist(self, name: str) -> None:
        busy = self.persister.busy
        if busy is not None and time.monotonic() - self.persister.busy_since > self.tier.close_timeout_s:
            pid = self.persister.abandon()  # stopped (SIGSTOP) or stuck on a hung filesystem
            log.warning("the RAM tier's writer process %s has not finished copying %s in %.0f s (close_timeout_s): "
                        "killed it (nothing of that copy is committed); %s goes to a new writer", pid, busy,
                        self.tier.close_timeout_s, name)
            self.failures.append(f"{busy}: the writer did not finish within {self.tier.close_timeout_s:.0f} s")
        if self.persister.busy is None:
            self.persister.submit(name)
        else:
            self.pending = name  # the newest due one; an older pending one is skipped

    def drain(self) -> list[tuple[str, str, float]]:
        """Collect the writer's answers; ``(ram name, disk name, seconds)`` of every checkpoint
        persisted since the last call (for the run's uploads and retention)."""
        with self._lock:
            self.collect()
            done, self._done = self._done, []
        return done

    def collect(self, timeout: float | None = 0.0) -> None:
        """Take the writer's answers: a persisted checkpoint is published as
        :class:`~unbroken.events.Persisted`; a failed copy is logged and kept in :attr:`failures`
        (the next due checkpoint is persisted as usual)."""
        with self._lock:
            self._collect(timeout)

    def _collect(self, timeout: float | None) -> None:
        done = self._done
        while self.persister.busy is not None:
            answer = self.persister.poll(timeout)
            if answer is None:
                break
            name = answer["name"]
            if "error" in answer:
                log.error("persisting %s from RAM to %s failed: %s", name, self.disk.url, answer["error"])
                self.failures.append(f"{name}: {answer['error']}")
                try:  # a writer that died leaves its staging folder: removed now, not at the next start
                    for left in self.disk.clean_stale():
                        log.info("removed %s, left by the RAM tier's writer process", left)
                except Exception as e:  # noqa: BLE001 - the next start removes it
                    log.warning("could not remove what the RAM tier's writer left in %s: %s", self.disk.url, e)
            else:
                self.persisted[name] = answer["final"]
                done.append((name, answer["final"], float(answer["took_s"])))
                log.info("persisted %s from RAM to %s in %.2f s", name, self.disk.describe(answer["final"]),
                         answer["took_s"])
                self.publish(Persisted(answer["final"], self.disk.describe(answer["final"]), answer["took_s"]))
                if self.auto is not None:
                    self.auto.persisted(float(answer["took_s"]))
                    if (said := self.auto.moved(time.monotonic())) is not None:
                        log.info("RAM tier: %s", said)
                        self.publish(PersistIntervalChosen(self.auto.interval_s(time.monotonic()), said))
            if self.pending is not None:
                nxt, self.pending = self.pending, None
                self.persister.submit(nxt)

    def protected(self) -> list[str]:
        return [n for n in (self.persister.busy, self.pending) if n]

    def prune(self, keep: str | None, manifests: Mapping[str, Manifest]) -> list[str]:
        """Keep the newest ``keep_last`` RAM checkpoints (and those the writer needs)."""
        order = sorted(manifests, key=lambda n: (manifests[n].seq, manifests[n].step), reverse=True)
        with self._lock:  # the writer is never handed a checkpoint being deleted
            protect = set(self.protected()) | ({keep} if keep else set())
            doomed = [n for n in order[self.tier.keep_last:] if n not in protect]
            for name in doomed:
                self.store.delete(name)
        for name in doomed:
            self.publish(Pruned(name, tier="ram"))
        return doomed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the writer's copies in hand; True if none is left."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.persister.busy is not None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.collect(timeout=min(left, 0.5) if left is not None else 0.5)  # the lock is held that long
        return True

    def close(self, newest_on_disk: int, manifests: Mapping[str, Manifest], keep: str | None = None) -> None:
        """Persist the newest RAM checkpoint if the disk has nothing as new, wait, stop the writer
        and remove the RAM folder, unless ``keep`` (see the module docstring)."""
        newest = max(manifests, key=lambda n: (manifests[n].seq, manifests[n].step), default=None)
        if newest is not None and manifests[newest].seq > newest_on_disk and newest not in self.persisted:
            if self.persister.busy != newest:
                self.wait(self.tier.close_timeout_s)  # (the pending one, if any, goes first)
                if newest not in self.persisted and self.persister.busy is None:
                    self.pending = None
                    self.persister.submit(newest)
        done = self.wait(self.tier.close_timeout_s)
        if not done:
            pid = self.persister.abandon()  # stopped, or stuck on a hung filesystem: not waited on again
            log.error("the RAM tier's last copy to %s did not finish within %.0f s: its writer process %s is killed; "
                      "the RAM folder %s is kept (the next start restores from it)", self.disk.url,
                      self.tier.close_timeout_s, pid, self.dir)
            return
        self.persister.stop()
        if newest is not None and newest not in self.persisted and manifests[newest].seq > newest_on_disk:
            log.error("the newest RAM checkpoint %s could not be persisted to %s; the RAM folder %s is kept (the "
                      "next start on this node restores from it)", newest, self.disk.url, self.dir)
            return
        if keep:
            log.info("%s: the RAM folder %s is kept for a relaunch on this node (its newest checkpoint is also in "
                     "%s)", keep, self.dir, self.disk.url)
            self._release_owner()
            return
        self.remove()

    def close_copy(self, keep: str | None) -> None:
        """Close on a node other than the coordinator's (several nodes): its copies go with a normal
        close (node 0's writer persisted the newest), stay for a relaunch on a signal or a crash."""
        if keep:
            self._release_owner()
        else:
            self.remove()

    def _release_owner(self) -> None:
        for fd in (self._owner, self._exclusive):
            if fd is not None:
                os.close(fd)
        self._owner = self._exclusive = None

    def remove(self) -> None:
        """Delete this run's RAM folder: its checkpoints, leftovers and quarantine, then the folder."""
        self._release_owner()
        remove_folder(self.dir, self.store)
