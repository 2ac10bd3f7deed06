"""The RAM tier: checkpoints in node-local shared memory, persisted by a writer process.

``Checkpointer("runs/exp1", save_every=1, ram=RamTier(keep_last=2, persist_every=50))``: every
regular save commits to a folder in ``/dev/shm`` (a memory copy: tmpfs has no disk behind it),
verified and atomic like every other tier (checksums, the manifest written last, a rename).
Every ``persist_every``-th RAM checkpoint is copied to the run location (``runs/exp1``, and
from there to a :class:`~unbroken.Remote` tier if there is one) by a **separate process**
(:mod:`unbroken.ramwriter`): it never holds the training process's GIL, and it does not die
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
Not yet covered (issue 33 §1): a RAM folder is keyed by the run's path, not by an identity the run
folder carries, so another run later created at the same path (or another container's volume at
that path) is taken for the same run; a RAM folder removed under a running trainer is an error.

**Ranks.** With several ranks on one node every rank writes its part into the same RAM folder
and the coordinator commits and persists, as on disk. On several nodes (each with its own
``/dev/shm``) every node keeps a copy of every RAM checkpoint, so the loss of a node is survived
from another node's memory (:mod:`unbroken.rampeers`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigurationError, StorageError, UnbrokenError
from .events import Event, Persisted, Pruned
from .format.manifest import Manifest
from .rampeers import Nodes
from .ramwriter import Persister
from .store import open_ram_store, open_store
from .store.private import private_folder

log = logging.getLogger("unbroken")
MARKER = ".unbroken-ram.json"
"""Written into every RAM folder: the run it belongs to (what removing it may touch)."""
OWNER = ".owner"
"""Locked (shared) by the trainer and its writer process while they live: a folder whose lock can be
taken exclusively has no live owner (:func:`collect_orphans`)."""


@dataclass
class RamTier:
    """The RAM tier of a :class:`~unbroken.Checkpointer` (see :mod:`unbroken.ram`).

    Args:
        keep_last: RAM checkpoints kept (at least 1). Memory: ``keep_last + 1`` checkpoints.
        persist_every: every this many RAM saves, the RAM checkpoint is copied to the run
            location by the writer process (1: every save; the writer takes the newest due
            one when it is free, so a slow disk skips, never queues, copies).
        root: where the RAM folders live (default ``$UNBROKEN_RAM_ROOT`` or ``/dev/shm``).
        close_timeout_s: how long ``close()`` waits for the writer's last copy.
    """

    keep_last: int = 2
    persist_every: int = 10
    root: str | None = None
    close_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigurationError(f"RamTier(keep_last={self.keep_last!r}): keep at least 1 checkpoint in RAM")
        if not isinstance(self.persist_every, int) or self.persist_every < 1:
            raise ConfigurationError(f"RamTier(persist_every={self.persist_every!r}): a positive number of saves")

    def folder(self, identity: str) -> Path:
        """The RAM folder of the run whose store identity is ``identity``."""
        root = Path(self.root or os.environ.get("UNBROKEN_RAM_ROOT") or "/dev/shm")
        digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
        return root / f"unbroken-{os.getuid()}" / digest


class RamRun:
    """The RAM side of a :class:`~unbroken.run.Run`: the RAM store, its retention, the writer."""

    def __init__(self, tier: RamTier, disk: Any, storage_options: Mapping[str, Any] | None,
                 publish: Callable[[Event], None]) -> None:
        if not isinstance(tier, RamTier):
            raise ConfigurationError(f"ram={tier!r}: pass unbroken.RamTier(...)")
        self.tier, self.disk, self.publish = tier, disk, publish
        self.dir = tier.folder(str(getattr(disk, "identity", None) or disk.url))
        self.store = open_ram_store(self.dir, tier.keep_last)
        self.persister = Persister(str(self.dir), disk.url, storage_options)
        self.saves = 0  # RAM commits by this process
        self.pending: str | None = None  # due for persisting while the writer was busy
        self.persisted: dict[str, str] = {}  # RAM name -> its name on disk
        self.failures: list[str] = []
        self._done: list[tuple[str, str, float]] = []  # persisted, not yet handled by the run
        self._owner: int | None = None
        self._manifests: dict[str, Manifest] = {}  # committed RAM checkpoints (a name never changes)
        self._lock = threading.RLock()  # saves commit in a background thread (async_save), prunes in the loop's
        self.nodes: Nodes | None = None  # several nodes (unbroken.rampeers); None on one

    # ---------------------------------------------------------------- lifecycle
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
        marker = self.dir / MARKER
        mine = {"run": self.disk.url, "identity": str(getattr(self.disk, "identity", self.disk.url))}
        if marker.exists():
            try:
                found = json.loads(marker.read_text())
            except (OSError, ValueError):
                found = {}
            if found.get("identity") != mine["identity"]:
                raise StorageError(f"{self.dir} belongs to another run ({found.get('run', 'unknown')}); "
                                   "remove it, or use RamTier(root=...)")
        else:
            self.store.write_meta(MARKER, json.dumps(mine).encode())
        self._owner = own(self.dir)
        for name in self.store.clean_stale():
            log.info("removed leftover %s of an interrupted RAM save", name)
        collect_orphans(self.dir.parent, self.dir)
        held = self.store.list_committed()
        if held:
            log.info("the RAM tier %s holds %d checkpoint(s) of a previous process", self.dir, len(held))

    def manifests(self) -> dict[str, Manifest]:
        """The readable manifests of the committed RAM checkpoints (read once per checkpoint)."""
        from .manifests import read_manifest

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
            if self.saves % self.tier.persist_every == 0:
                self._persist(name)

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
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    def remove(self) -> None:
        """Delete this run's RAM folder: its checkpoints, leftovers and quarantine, then the folder."""
        self._release_owner()
        remove_folder(self.dir, self.store)


def own(folder: Path, exclusive: bool = False) -> int | None:
    """Lock ``folder``'s owner file (shared; ``exclusive`` and non-blocking: None if a live
    process holds it); the open descriptor holds the lock until closed."""
    fd = os.open(folder / OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def collect_orphans(root: Path, mine: Path) -> None:
    """Remove the RAM folders under ``root`` that no live process owns and whose every checkpoint
    is older than the newest one on its run's disk (a killed run relaunched elsewhere, or one that
    ended with ``keep``); a folder holding a newer state is kept for its run's relaunch, and named."""
    from .discovery import manifests

    for folder in sorted(root.iterdir()):
        if folder == mine or not (folder / MARKER).is_file():
            continue
        fd = own(folder, exclusive=True)
        if fd is None:
            continue  # a live trainer or writer
        try:
            run = json.loads((folder / MARKER).read_text())["run"]
            store = open_store(str(folder))
            ram = max((m.seq for m in manifests(store).values()), default=-1)
            disk = max((m.seq for m in manifests(open_store(run)).values()), default=-1) if "://" not in run else None
            if disk is not None and ram <= disk:
                log.info("removing %s: the RAM checkpoints of %s left by a process that ended (all older than "
                         "its newest on disk)", folder, run)
                remove_folder(folder, store)
            else:
                log.warning("%s holds RAM checkpoints of %s newer than its disk's, left by a process that ended: "
                            "relaunching that run on this node resumes from them (and removes them); delete the "
                            "folder to give the memory back", folder, run)
        except Exception as e:  # noqa: BLE001 - someone else's folder: never a reason to stop training
            log.debug("not collecting %s: %s", folder, e)
        finally:
            os.close(fd)


def remove_folder(folder: Path, store: Any) -> None:
    """Delete a RAM folder this library made: its checkpoints, leftovers and quarantine, then itself."""
    try:
        for name in store.list_committed():
            store.delete(name)
        store.clean_stale()
        q = folder / "quarantine"
        if q.is_dir():
            names = sorted(p.name for p in q.iterdir())
            if names:
                log.warning("removing the RAM tier's quarantined copies: %s", ", ".join(names))
            shutil.rmtree(q)
        for p in folder.iterdir():
            if p.name.startswith((".node-", ".lock", OWNER, MARKER)):
                p.unlink()
        folder.rmdir()
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("could not remove the RAM tier's folder %s: %s", folder, e)
        return
    try:  # the per-user folder (unbroken-<uid>) too, once no run of this user has one in it
        folder.parent.rmdir()
    except OSError:
        pass
