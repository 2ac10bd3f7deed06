"""Tiered checkpoints: save to a fast local folder, upload to a remote store in the background.

``Checkpointer("runs/exp1", keep_last=2, remote=Remote("s3://bucket/exp1", keep_last=20))``:
every save commits locally first (the training loop waits only for that), then the
:class:`Uploader` thread copies the checkpoint to the remote: each file is read back
from the local disk and its checksum checked against the manifest *before* it is sent
(a local bit flip is never uploaded), data objects first and the manifest last. A
checkpoint is **durable** once its remote commit succeeded (:class:`~unbroken.events.Uploaded`).

- **Outages** never stop training: a failed upload is retried with backoff (by default 5 s
  doubling to 60 s) for as long as it takes; saves go on locally meanwhile, and the uploads catch
  up, oldest pending first.
- **Restarts**: a new process queues every local checkpoint newer than the remote's newest
  (uploads go oldest first, so the remote's newest is a watermark). If the remote cannot be
  listed at start (an outage), it queues *every* local checkpoint; once the remote answers, the
  uploader drops from the queue those the remote already has and those older than its newest
  (uploaded before, and since removed by the remote's retention), and uploads the rest.
- **Retention per tier**: the local tier follows the Checkpointer's rules, the remote
  tier the :class:`Remote`'s. Local retention never deletes a checkpoint waiting for its
  upload while the remote is healthy. During an outage it keeps only the *newest* waiting
  one beyond its own rules, so the local disk stays bounded and the remote receives the
  newest state once it is back (the older waiting ones are then skipped).
- **What** :meth:`Uploader.wait` **reports**: True only when nothing is pending and every
  queued checkpoint is committed on the remote, or was superseded there by a newer one that
  is (an older one deleted locally while it waited, during an outage). A checkpoint that can
  never be uploaded (its local copy is damaged) keeps it False until a newer one is uploaded.
- **Restore** (:mod:`unbroken.run.run`) picks the newest valid checkpoint across both tiers
  and downloads it, verified, when only the remote has it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._support import faultpoints as _faults
from ..checkpoint.discovery import manifests
from ..errors import ConfigurationError, CorruptCheckpointError
from ..events import Event, Pruned, Uploaded, UploadFailed
from ..format.manifest import MANIFEST, Manifest, is_chunk, new_hasher
from ..policies import Retention

log = logging.getLogger("unbroken")


@dataclass
class Remote:
    """The remote tier of a :class:`~unbroken.Checkpointer`.

    Args:
        location: ``s3://bucket/run`` or any fsspec URL (or a local path: a second disk).
        keep_last: how many checkpoints to keep remotely (``None``: all).
        retention: more rules for the remote tier (``KeepBest(...) | KeepEveryNSteps(...)``).
        storage_options: passed to the fsspec filesystem (endpoint, credentials, profile).
        close_timeout_s: how long :meth:`Checkpointer.close` (and a preemption exit) waits
            for pending uploads before giving up with an error in the log.
        retry_wait_s: after a failed upload, wait this long before the next attempt, doubling
            up to ``retry_max_wait_s``.
        request_deadline_s: how long one remote request (a listing, a download, an upload
            part) is retried on transient errors (connection refused, timeouts, 5xx) before it
            fails: a restore whose remote cannot be listed within it raises
            :class:`~unbroken.NoValidCheckpointError` rather than starting fresh; an upload that
            fails is tried again later.
    """

    location: str
    keep_last: int | None = 20
    retention: Retention | None = None
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    close_timeout_s: float = 300.0
    retry_wait_s: float = 5.0
    retry_max_wait_s: float = 60.0
    request_deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.request_deadline_s > 0:
            raise ConfigurationError(f"request_deadline_s must be > 0, not {self.request_deadline_s!r}")


def copy_checkpoint(src: Any, name: str, dst: Any, *, lock: Any = None) -> tuple[str, Manifest]:
    """Copy checkpoint ``name`` from store ``src`` to store ``dst``, verifying every file against
    the manifest before it is written; the manifest is written last (the commit). Returns the
    name it got in ``dst`` and its manifest. A damaged source raises CorruptCheckpointError."""
    raw = bytes(src.read(name, MANIFEST))
    manifest = Manifest.from_json(raw)
    # chunks (incremental checkpoints) go to the destination's chunk store; one already there is
    # not sent again to an object store (its uploader is the only writer there), while a local
    # destination gets every chunk afresh (a collection may run beside a download)
    present = set(dst.list_chunks()) if manifest.chunks and dst.remote else set()
    staging = dst.stage(name)
    try:
        for fname, entry in sorted(manifest.files.items()):
            if is_chunk(fname) and fname[1:] in present:
                continue
            buf = src.read_chunk(fname[1:], entry.size) if is_chunk(fname) else src.read(name, fname, entry.size)
            h = new_hasher()
            h.update(buf)
            if h.hexdigest() != entry.xxh3_128:
                what = f"chunk {fname[1:]}" if is_chunk(fname) else fname
                raise CorruptCheckpointError(f"{src.describe(name)}: {what}: checksum mismatch")
            if is_chunk(fname):
                dst.put_chunk(fname[1:], buf)
            else:
                with staging.open(fname) as f:
                    f.write(memoryview(buf))
            del buf
            _faults.point("copy.after_file")
        if manifest.chunks:
            dst.sync_chunks()
        _faults.point("copy.before_manifest")
        with staging.open(MANIFEST) as f:
            f.write(raw)
        if lock is not None:
            lock.verify()
        final = staging.commit()
    except BaseException:
        staging.abort()
        raise
    return final, manifest


class Uploader:
    """The background thread that makes local checkpoints durable on the remote tier."""

    def __init__(self, local: Any, remote: Any, remote_lock: Any, publish: Callable[[Event], None],
                 prune_remote: Callable[[], list[str]], sync_meta: Callable[[], None],
                 wait_s: tuple[float, float] = (5.0, 60.0)) -> None:
        self.local, self.remote, self.remote_lock = local, remote, remote_lock
        self.wait_s = wait_s
        self.publish, self.prune_remote, self.sync_meta = publish, prune_remote, sync_meta
        self._queue: deque[str] = deque()
        self._cv = threading.Condition()
        self._busy: str | None = None
        self._stop = False
        self.failing = False  # the last attempt failed: the remote is (probably) down
        self._thread: threading.Thread | None = None
        self.uploaded: dict[str, str] = {}  # local name -> remote name
        self._order: dict[str, int] = {}  # local name -> when it was queued (commit order)
        self._queued = 0
        self._unverified: set[str] = set()  # queued while the remote could not be listed
        self.missed: dict[str, tuple[int, str]] = {}  # never committed remotely, not superseded: (order, why)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="unbroken-upload", daemon=True)
            self._thread.start()

    def enqueue(self, name: str, unverified: bool = False) -> None:
        """Queue ``name`` (in commit order). ``unverified``: queued while the remote could not be
        listed; checked against the remote's listing before it is uploaded (see the module)."""
        with self._cv:
            if name not in self._queue and name != self._busy:
                self._queue.append(name)
                self._order[name] = self._queued
                self._queued += 1
            if unverified:
                self._unverified.add(name)
            self._cv.notify_all()

    def pending(self) -> list[str]:
        """Local checkpoints not yet durable remotely, oldest first."""
        with self._cv:
            return ([self._busy] if self._busy else []) + list(self._queue)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending; True only if every queued checkpoint is then committed
        on the remote (or superseded there by a newer one that is); False if ``timeout`` passed
        first, or if one could not be uploaded (:attr:`missed`)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left if left is None else min(left, 1.0))
            return not self.missed

    def _settle(self, name: str, committed: bool, why: str = "") -> None:
        """``name`` left the queue: committed remotely (a newer state than every checkpoint queued
        before it: those missed are superseded), or not (kept in :attr:`missed` with ``why``)."""
        with self._cv:
            self._busy = None
            self._unverified.discard(name)
            order = self._order.pop(name, self._queued)
            if committed:
                self.missed = {n: (o, w) for n, (o, w) in self.missed.items() if o > order}
            else:
                self.missed[name] = (order, why)
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def _loop(self) -> None:
        attempt, wait_s = 0, self.wait_s[0]
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                self._busy = self._queue.popleft()
            name = self._busy
            try:
                if self._unverified and name in self._reconcile():
                    committed = True  # the remote has it already
                else:
                    committed = self._upload(name)
                if committed:  # the remote answered (a checkpoint pruned locally first asked it nothing)
                    attempt, wait_s, self.failing = 0, self.wait_s[0], False
                self._settle(name, committed, "" if committed else "deleted locally before its upload")
            except CorruptCheckpointError as e:
                if name not in self.local.list_committed():
                    log.info("%s was pruned locally while it was being uploaded", name)
                    self._settle(name, False, "deleted locally during its upload")
                else:  # the local copy is damaged: never upload it
                    log.error("not uploading %s: %s", name, e)
                    self.publish(UploadFailed(name, str(e), attempt + 1, will_retry=False))
                    self._settle(name, False, f"its local copy is damaged: {e}")
            except Exception as e:  # noqa: BLE001 - any upload failure is retried with backoff
                attempt += 1
                self.failing = True
                level = logging.WARNING if attempt == 1 or attempt % 10 == 0 else logging.INFO
                log.log(level, "upload of %s to %s failed (attempt %d: %s: %s); training goes on, retrying in "
                        "%.0f s", name, self.remote.url, attempt, type(e).__name__, str(e)[:200], wait_s)
                self.publish(UploadFailed(name, f"{type(e).__name__}: {e}", attempt))
                with self._cv:
                    self._queue.appendleft(name)
                    self._busy = None
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._stop, timeout=wait_s)
                wait_s = min(wait_s * 2, self.wait_s[1])

    def _reconcile(self) -> set[str]:
        """The remote answers after a start without its listing: the queued names it needs no more,
        dropped from the queue (the one in hand is the caller's): those it has (same name and
        manifest) and those older than its newest (uploaded before and since removed by its
        retention: uploads go oldest first)."""
        # a server just back may not answer yet: reconcile at the next attempt, never take a checkpoint it has
        # for one it lacks (and upload it again)
        remote = manifests(self.remote, raise_transient=True)
        newest = max((m.seq for m in remote.values()), default=-1)
        with self._cv:
            names = sorted(self._unverified)
        skip = set()
        for name in names:
            try:
                raw = bytes(self.local.read(name, MANIFEST))
                mine = Manifest.from_json(raw)
            except Exception:  # noqa: BLE001 - deleted or damaged meanwhile: the upload reports it
                continue
            try:  # a remote copy that cannot be read is not "the same": it is uploaded again
                same = name in remote and bytes(self.remote.read(name, MANIFEST)) == raw
            except CorruptCheckpointError:  # (never taken for damage of the *local* copy)
                same = False
            if same:
                self.uploaded[name] = name
                skip.add(name)
            elif mine.seq <= newest:
                log.info("%s is older than the newest checkpoint on %s: not uploaded again", name, self.remote.url)
                skip.add(name)
        with self._cv:
            for name in skip:
                if name in self._queue:
                    self._queue.remove(name)
                    self._order.pop(name, None)
            self._unverified.clear()
            self._cv.notify_all()
        return skip

    def _upload(self, name: str) -> bool:
        """Upload ``name``; False if there was nothing to do (pruned locally meanwhile)."""
        if name not in self.local.list_committed():
            log.info("%s was pruned locally before it could be uploaded", name)
            return False
        if not self.remote_lock.held:
            self.remote.check()
            self.remote_lock.acquire()
            self.remote.clean_stale()
        t0 = time.monotonic()
        if name in self.remote.list_committed() and \
                bytes(self.remote.read(name, MANIFEST)) == bytes(self.local.read(name, MANIFEST)):
            final = name  # a retry after a commit whose answer was lost: already there
        else:
            final, _ = copy_checkpoint(self.local, name, self.remote, lock=self.remote_lock)
        took = time.monotonic() - t0
        self.uploaded[name] = final
        log.info("uploaded %s to %s in %.1f s", name, self.remote.describe(final), took)
        self.publish(Uploaded(final, self.remote.describe(final), took))
        self.sync_meta()
        for gone in self.prune_remote():
            self.publish(Pruned(gone, tier="remote"))
        return True
