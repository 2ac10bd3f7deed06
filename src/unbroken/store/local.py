"""A run on a local or network filesystem, committed by an atomic rename.

Why rename: a POSIX ``rename`` of a folder is atomic, so a reader sees either no
checkpoint or the whole one. Files are written into a hidden staging folder beside
the target (same filesystem, so the rename cannot degrade into a copy), each file is
fsynced, the manifest is written last, the staging folder is fsynced, renamed to its
final name, and the parent folder is fsynced so the rename itself survives a power
cut. Deletion is the same in reverse: rename to a hidden trash name first, then
remove, so a half-deleted checkpoint is never visible either.

Hidden leftovers (``.staging-*``, ``.trash-*``) carry the writer's host and pid; a
later writer removes those whose process is gone.

The run folder is a boundary: files are opened with ``O_NOFOLLOW`` relative to a
folder opened with ``O_NOFOLLOW``, temporary files with ``O_EXCL``, and nothing the
store renames or deletes is followed if it is a symbolic link.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import uuid
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import CorruptCheckpointError, StorageError
from .base import CHUNKS, COMMIT_FILE, MAX_META_BYTES, QUARANTINE, Buffer, check_meta_name, check_name
from .lock import FlockLock
from .readfile import Hasher, read_file

_HIDDEN = re.compile(r"^\.(staging|trash)-(?P<host>[^_]+)_(?P<pid>\d+)_(?:[0-9a-f]{8})_(?P<name>.*)$")
_CHECKPOINT_NAME = re.compile(r"^step-\d{9,}([-.]\d+)?$")
_CHUNK_ID = re.compile(r"^[0-9a-f]{64}$")
_CHUNK_TMP = re.compile(r"^\.[0-9a-f]{64}\.(?P<host>[^_]+)_(?P<pid>\d+)_[0-9a-f]{8}$")  # write_file_atomic's
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: Buffer, mode: int = 0o644, sync_dir: bool = True) -> None:
    """The one atomic file write: a fresh hidden temp file ``.<name>.<host>_<pid>_<random>``
    (``O_EXCL|O_NOFOLLOW``, so a planted link is never written through), fsync, ``rename`` over
    ``path`` (which replaces a link rather than following it), fsync the folder (unless the
    caller does it once for many files: ``sync_dir=False``)."""
    tmp = path.with_name(f".{path.name}.{_tag()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_dir:
        fsync_dir(path.parent)


def _tag() -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(path: str) -> None:
    """Remove a folder we created; a symbolic link in its place is unlinked, never followed."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


class _DurableFile:
    """A write-only file that is flushed and fsynced when closed."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        self._f = os.fdopen(fd, "wb", buffering=0)

    def write(self, data: bytes | memoryview) -> int:
        mv = memoryview(data)
        done = 0
        while done < len(mv):  # raw files may write partially
            done += self._f.write(mv[done:])
        return done

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self._f.closed:
            try:
                os.fsync(self._f.fileno())
            finally:
                self._f.close()

    def __enter__(self) -> "_DurableFile":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


class LocalStaging:
    """A checkpoint being written into a hidden sibling folder."""

    parallel_files = True  # files may be written from several threads at once

    def __init__(self, store: "LocalStore", name: str) -> None:
        self.store = store
        self.name = name
        self.path = store.root / f".staging-{_tag()}_{name}"
        self.path.mkdir()
        self.token = self.path.name

    def open(self, file: str) -> BinaryIO:
        return _DurableFile(self.path / check_name(file))  # type: ignore[return-value]

    def flush(self) -> None:
        pass  # every file is fsynced when it is closed
    def commit(self) -> str:
        fsync_dir(self.path)
        final = self.store.free_name(self.name)
        os.rename(self.path, self.store.root / final)
        self.name = final
        try:
            fsync_dir(self.store.root)
        except OSError as e:  # the rename happened: the checkpoint is committed, maybe not yet durable
            import logging

            logging.getLogger("unbroken").warning(
                "%s committed, but syncing the run folder failed (%s): it may not survive a power cut",
                final, e)
        return final

    def abort(self) -> None:
        _remove_tree(str(self.path))


class _JoinedStaging:
    """A rank writing its files into the coordinator's staging folder."""

    parallel_files = True

    def __init__(self, path: Path) -> None:
        self.path, self.name, self.token = path, _HIDDEN.match(path.name)["name"], path.name  # type: ignore[index]

    def open(self, file: str) -> BinaryIO:
        return _DurableFile(self.path / check_name(file))  # type: ignore[return-value]

    def flush(self) -> None:
        pass

    def commit(self) -> str:
        raise RuntimeError("only the coordinator commits")

    def abort(self) -> None:
        pass  # the coordinator removes the folder


class LocalStore:
    """A run folder on a filesystem. Checkpoints are its non-hidden sub-folders."""

    remote = False

    def __init__(self, root: str | os.PathLike[str], readonly: bool = False,
                 chunk_dir: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.readonly = readonly
        if chunk_dir is None:  # a checkpoint opened inside quarantine/ uses the run's chunks
            inside = self.root.name == QUARANTINE and (self.root.parent / CHUNKS).is_dir()
            chunk_dir = self.root.parent / CHUNKS if inside else self.root / CHUNKS
        self.chunk_dir = Path(chunk_dir)

    # ------------------------------------------------------------------ setup
    def check(self, deadline_s: float = 15.0) -> None:
        """The run location is a folder (or absent) none of whose entries that unbroken reads,
        writes, renames or deletes is a symbolic link: on a shared, group-writable filesystem a
        planted link would lead those operations out of the run folder. Such a run is refused
        with :class:`StorageError` naming the links (each operation also refuses links by
        itself; this says so up front, instead of skipping a checkpoint silently)."""
        if self.root.exists() and not self.root.is_dir():
            raise StorageError(f"{self.root} exists and is not a folder; choose another run location")
        links = linked_entries(self.root)
        if links:
            shown = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
            raise StorageError(f"{self.root} holds symbolic links where unbroken keeps its own files ({shown}); "
                               "it never follows links out of a run folder: remove them (or copy their "
                               "targets in) and run again")

    @property
    def identity(self) -> str:
        """The real path of the run folder (links and ``..`` resolved): one per folder, however spelled."""
        return os.path.realpath(self.root)

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def lock(self) -> FlockLock:
        return FlockLock(self.root)

    def local_dir(self) -> Path:
        return self.root

    def describe(self, name: str) -> str:
        return str(self.root / name)

    def free_bytes(self) -> int | None:
        """Free space on the run folder's filesystem, for the pre-save check."""
        self.ensure()
        return shutil.disk_usage(self.root).free

    # ------------------------------------------------------------------ write
    def stage(self, name: str) -> LocalStaging:
        self.ensure()
        return LocalStaging(self, check_name(name, "checkpoint"))

    def join(self, token: str) -> _JoinedStaging:
        m = _HIDDEN.match(token) if isinstance(token, str) else None
        path = self.root / token
        if m is None or not token.startswith(".staging-") or path.is_symlink() or not path.is_dir():
            raise StorageError(f"no staging folder {token!r} in {self.root}: is the run location a "
                               "filesystem shared by every rank?")
        return _JoinedStaging(path)

    def free_name(self, name: str) -> str:
        """``name`` if unused, else ``name-2``, ``name-3``, ..."""
        candidate, n = name, 1
        while os.path.lexists(self.root / candidate) or os.path.lexists(self.root / QUARANTINE / candidate):
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def delete(self, name: str) -> None:
        check_name(name, "checkpoint")
        trash = self.root / f".trash-{_tag()}_{name}"
        os.rename(self.root / name, trash)
        _remove_tree(str(trash))

    def quarantine(self, name: str, reason: str) -> str | None:
        qdir = self.root / QUARANTINE
        if qdir.is_symlink():  # a planted link would move checkpoints (and write) outside the run
            return None
        qdir.mkdir(exist_ok=True)
        target = qdir / name
        n = 1
        while os.path.lexists(target) or os.path.lexists(qdir / f"{target.name}.reason.txt"):
            n += 1
            target = qdir / f"{name}.{n}"
        try:
            os.rename(self.root / name, target)
        except OSError:
            return None
        # O_EXCL|O_NOFOLLOW: never write through a link planted under the reason file's name.
        fd = os.open(qdir / f"{target.name}.reason.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                     | _NOFOLLOW | _CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(reason + "\n")
        fsync_dir(self.root)
        return str(target)

    def clean_stale(self) -> list[str]:
        if not self.root.is_dir():
            return []
        removed = []
        here = _tag().split("_")[0]
        for entry in os.scandir(self.root):
            m = _HIDDEN.match(entry.name)
            if not m:
                continue
            if m["host"] != here or _pid_alive(int(m["pid"])):
                continue  # a live writer, or another host's that may be: leave it
            _remove_tree(entry.path)
            removed.append(entry.name)
        return removed

    def write_meta(self, file: str, data: bytes) -> None:
        self.ensure()
        write_file_atomic(self.root / check_meta_name(file), data)

    # ------------------------------------------------------------------- read
    def list_committed(self) -> list[str]:
        """Checkpoint folders: those with a manifest, and those named like a Checkpointer's
        (``step-000000500``, ``step-000000500-2``) even without one (a damaged checkpoint, to be
        reported). Other folders a user keeps in the run (``tensorboard/``) are not checkpoints."""
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or entry.name == QUARANTINE:
                continue
            if entry.is_dir(follow_symlinks=False) and (
                    _CHECKPOINT_NAME.match(entry.name) or os.path.lexists(os.path.join(entry.path, COMMIT_FILE))):
                out.append(entry.name)
        return sorted(out)

    def list_uncommitted(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(m["name"] for e in os.scandir(self.root) if (m := _HIDDEN.match(e.name))
                      and e.name.startswith(".staging-"))

    def quarantined(self) -> "LocalStore | None":
        qdir = self.root / QUARANTINE
        if not qdir.is_dir() or qdir.is_symlink():
            return None
        return LocalStore(qdir, readonly=True, chunk_dir=self.chunk_dir)  # their chunks stay in the run

    def read(self, name: str, file: str, size: int | None = None, hasher: Hasher | None = None) -> Buffer:
        try:
            return read_file(self.root / name, file if file == COMMIT_FILE else check_name(file), size,
                             MAX_MANIFEST_BYTES, hasher)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{file} is missing") from None

    def read_meta(self, file: str) -> bytes | None:
        try:
            return bytes(read_file(self.root, check_meta_name(file), None, MAX_META_BYTES))
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------ chunks
    def put_chunk(self, cid: str, data: Buffer) -> None:
        """:func:`write_file_atomic`; the folder is fsynced by :meth:`sync_chunks`."""
        self.chunk_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.chunk_dir / cid, data, sync_dir=False)

    def sync_chunks(self) -> None:
        """Make the chunks written so far durable by name (one folder fsync for many chunks)."""
        if self.chunk_dir.is_dir():
            fsync_dir(self.chunk_dir)

    def read_chunk(self, cid: str, size: int, hasher: Hasher | None = None) -> Buffer:
        try:
            return read_file(self.chunk_dir, cid, size, 0, hasher)
        except FileNotFoundError:
            note = " (it was quarantined as damaged)" if os.path.lexists(self.root / QUARANTINE / CHUNKS / cid) else ""
            raise CorruptCheckpointError(f"chunk {cid} is missing from {self.chunk_dir}{note}") from None

    def list_chunks(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.chunk_dir.is_dir():
            return out
        for entry in os.scandir(self.chunk_dir):
            if _CHUNK_ID.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                out[entry.name] = entry.stat(follow_symlinks=False).st_mtime
        return out

    def delete_chunk(self, cid: str) -> None:
        try:
            os.unlink(self.chunk_dir / cid)
        except FileNotFoundError:
            pass

    def clean_chunk_temps(self) -> list[str]:
        """Remove half-written chunks of writers on this host that are gone."""
        removed: list[str] = []
        if not self.chunk_dir.is_dir():
            return removed
        here = _tag().split("_")[0]
        for entry in os.scandir(self.chunk_dir):
            m = _CHUNK_TMP.match(entry.name)
            if m and m["host"] == here and not _pid_alive(int(m["pid"])):
                os.unlink(entry.path)
                removed.append(entry.name)
        return removed

    def quarantine_chunk(self, cid: str, reason: str) -> str | None:
        qdir = self.root / QUARANTINE / CHUNKS
        if (self.root / QUARANTINE).is_symlink() or qdir.is_symlink():
            return None
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            os.replace(self.chunk_dir / cid, qdir / cid)
            write_file_atomic(qdir / f"{cid}.reason.txt", (reason + "\n").encode())
        except OSError:
            return None
        return str(qdir / cid)


_MANAGED_FILES = {".lock", ".lock.json", "tags.json", "quarantine", "submit.slurm", CHUNKS}


def linked_entries(root: Path) -> list[str]:
    """Entries of ``root`` that unbroken manages (checkpoint folders, staging and trash, the
    lock, tags, index, quarantine) and that are symbolic links, sorted."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    managed = [n for n in names if n in _MANAGED_FILES or n.startswith(("index.sqlite", ".tags.json."))
               or _CHECKPOINT_NAME.match(n) or _HIDDEN.match(n)]
    return sorted(n for n in managed if os.path.islink(root / n))
