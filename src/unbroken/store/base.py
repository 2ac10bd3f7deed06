"""The store protocol: where a run's bytes go, and how a checkpoint commits.

A store holds the checkpoints of one run, each a named folder of flat files, plus a
few small run-level files (``tags.json``, the lock). Every caller gets its store from
:func:`unbroken.store.open_store`; nobody constructs a backend by hand.

The writer's call order is fixed::

    store.check()                          # reachable and usable (raises StorageError)
    lock = store.lock(); lock.acquire()    # one writer per run
    store.clean_stale()                    # leftovers of writers that died mid-save
    staging = store.stage(name)            # a private place no reader looks at
    with staging.open(file) as f: ...      # once per data file, then COMMIT_FILE last
    staging.commit()                       # visible, whole or not at all; returns the final name
    # or staging.abort() on any error: nothing becomes visible

Readers call :meth:`Store.list_committed`, then :meth:`Store.read` per file. How a
backend commits is its own strategy (orbax calls this "atomicity"):

- **rename** (:mod:`.local`): stage in a hidden sibling folder, fsync, ``rename`` it
  into place, fsync the parent. POSIX rename of a folder is atomic.
- **commit file** (:mod:`.fsspec`): object stores have no rename, but a single object
  PUT is atomic. Data objects are uploaded first, ``manifest.json`` last; a checkpoint
  without its manifest does not exist for readers and is removed by the next writer.

Retention calls :meth:`Store.delete` only for checkpoints older than one that has
already committed; deletion un-commits first (rename away, or remove the manifest
first), so a half-deleted checkpoint is never visible either.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from ..errors import CorruptCheckpointError

Buffer = Any
"""A writable object supporting the buffer protocol (bytearray, uint8 numpy array)."""

COMMIT_FILE = "manifest.json"
"""The file whose presence makes a checkpoint committed (written last)."""
QUARANTINE = "quarantine"
"""Where checkpoints that failed verification are moved, inside the run."""
CHUNKS = "chunks"
"""Where the run keeps the content-addressed tensor chunks of incremental checkpoints."""
MAX_META_BYTES = 1 << 20
"""Run-level files (``tags.json``) larger than this are refused, never read into memory."""

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_CHECKPOINT_NAME = re.compile(r"^step-\d{9,}([-.]\d+)?$")


def is_checkpoint_name(name: str) -> bool:
    """The naming rule of the checkpoints a Checkpointer writes (``step-000000500``, with a
    ``-2`` suffix after a name collision, ``.2`` in quarantine). Retention deletes only these: a
    copy a user keeps in the run under another name (``cp -r run/step-000000010 "run/best copy"``)
    is listed and can be restored, but is never counted or deleted by retention."""
    return isinstance(name, str) and bool(_CHECKPOINT_NAME.match(name))


def check_name(name: Any, what: str = "file") -> str:
    """``name`` if it is one plain path component (no ``/``, ``..``, leading dot), else raise."""
    if not isinstance(name, str) or not _SAFE.fullmatch(name) or name in (".", ".."):
        raise CorruptCheckpointError(f"unsafe or invalid {what} name {name!r}")
    return name


def check_meta_name(name: Any) -> str:
    """A run-level file name: like :func:`check_name`, or hidden (``.lock.json``)."""
    return "." + check_name(name[1:]) if isinstance(name, str) and name.startswith(".") else check_name(name)


class Staging(Protocol):
    """A checkpoint being written. With several ranks, the coordinator stages and the other
    ranks :meth:`Store.join` it by its ``token`` to write their files into it."""

    name: str
    token: str
    """Identifies this staging area for :meth:`Store.join` (a JSON-able string)."""

    def open(self, file: str) -> BinaryIO:
        """A new file for writing. Its bytes are durable once :meth:`flush` or :meth:`commit` returns."""
        ...

    def flush(self) -> None:
        """Make every file opened so far durable (background uploads finished), without committing."""
        ...

    def commit(self) -> str:
        """Publish the checkpoint under its final name (returned); atomic."""
        ...

    def abort(self) -> None:
        """Discard everything written; never raises."""
        ...


@runtime_checkable
class RunLock(Protocol):
    """The writer lock of a run: one process writes a run at a time."""

    @property
    def held(self) -> bool: ...

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~unbroken.errors.RunLockedError` naming the holder."""
        ...

    def verify(self) -> None:
        """Raise :class:`~unbroken.errors.RunLockedError` if the lock was lost (its file deleted or
        replaced; a lease deleted, or expired and taken over); called before every commit, and
        before retention deletes or tags are written."""
        ...

    def release(self) -> None: ...


class Store(Protocol):
    """Checkpoints of one run. See the module docstring for the call order."""

    url: str
    """Where the run lives (an absolute path or a URL), never with credentials."""
    @property
    def identity(self) -> str:
        """Which run this is, the same for every spelling of its location (a folder's real path;
        the backend's own protocol and path for a URL): what its lock, its lease and its index
        cache are keyed by, and what two tiers must not share."""
        ...

    remote: bool
    """True for object stores and other non-local filesystems."""

    def check(self, deadline_s: float = 15.0) -> None:
        """Fail now, clearly, if the location cannot be used (no bucket, denied, unsafe folder);
        an unreachable server is retried for up to ``deadline_s``."""
        ...

    def stage(self, name: str) -> Staging: ...

    def join(self, token: str) -> Staging:
        """Another rank's view of a staging area the coordinator opened: ``open`` and ``flush``
        only (the coordinator commits or aborts)."""
        ...

    def list_committed(self) -> list[str]:
        """Names of checkpoints whose commit completed (not yet verified)."""
        ...

    def list_uncommitted(self) -> list[str]:
        """Names of checkpoints being written, or left behind by a writer that died."""
        ...

    def read(self, name: str, file: str, size: int | None = None, hasher: Any = None) -> Buffer:
        """The whole content of one file of a committed checkpoint, in a writable buffer;
        ``size`` is the expected size, if known. A missing, oversized or odd file raises
        :class:`~unbroken.errors.CorruptCheckpointError`. With ``hasher``, every byte is fed
        to ``hasher.update`` in order (while it streams in, where the store can)."""
        ...

    def delete(self, name: str) -> None: ...

    def quarantine(self, name: str, reason: str) -> str | None:
        """Move a bad checkpoint out of the way, keeping it for inspection; where it went."""
        ...

    def quarantined(self) -> Store | None:
        """A read-only view of the quarantined checkpoints (or None if there are none)."""
        ...

    def clean_stale(self) -> list[str]:
        """Remove leftovers of writers that died mid-save; return what was removed."""
        ...

    def describe(self, name: str) -> str:
        """Where checkpoint ``name`` is, for people (path or URL, no credentials)."""
        ...

    def free_bytes(self) -> int | None:
        """Free space for the pre-save check, or None where it is unknown (object stores)."""
        ...

    def read_meta(self, file: str) -> bytes | None:
        """A small run-level file (``tags.json``), or None if absent."""
        ...

    def write_meta(self, file: str, data: bytes) -> None:
        """Replace a small run-level file atomically."""
        ...

    def lock(self) -> RunLock:
        """This run's writer lock (not yet acquired)."""
        ...

    def local_dir(self) -> Path:
        """A local folder for data derived from this run (the index, ``submit.slurm``): the run
        folder itself on a filesystem, a cache folder for a remote store."""
        ...

    # Chunks: content-addressed tensor bytes shared by the checkpoints of an incremental run
    # (see unbroken.checkpoint.chunks), in the run's ``chunks/`` folder; ids are checked by the callers.
    def put_chunk(self, cid: str, data: Buffer) -> None:
        """Store chunk ``cid`` atomically (whole or absent; replacing an existing copy, which has
        the same bytes, is harmless); durable once :meth:`sync_chunks` returns."""
        ...

    def sync_chunks(self) -> None:
        """Make every chunk put so far durable (before a manifest that lists them commits)."""
        ...

    def read_chunk(self, cid: str, size: int, hasher: Any = None) -> Buffer:
        """Chunk ``cid`` like :meth:`read` reads a file; a missing one raises
        :class:`~unbroken.errors.CorruptCheckpointError`."""
        ...

    def list_chunks(self) -> dict[str, float]:
        """Every stored chunk with its modification time (seconds since the epoch)."""
        ...

    def delete_chunk(self, cid: str) -> None:
        """Remove a chunk (garbage collection only)."""
        ...

    def quarantine_chunk(self, cid: str, reason: str) -> str | None:
        """Move a damaged chunk to ``quarantine/chunks/`` (so the next save writes it again);
        where it went, or None."""
        ...
