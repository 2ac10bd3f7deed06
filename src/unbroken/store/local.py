"""A run on a local or network filesystem, committed by an atomic rename.

Why rename: a POSIX ``rename`` of a folder is atomic, so a reader sees either no
checkpoint or the whole one. Files are written into a hidden staging folder beside
the target (same filesystem, so the rename cannot degrade into a copy; see
:mod:`.staging`), each file is fsynced, the manifest is written last, the staging folder
is fsynced, renamed to its final name, and the parent folder is fsynced so the rename
itself survives a power cut. Deletion is the same in reverse: rename to a hidden trash
name first, then remove, so a half-deleted checkpoint is never visible either.

Hidden leftovers (``.staging-*``, ``.trash-*``) carry the writer's host and pid; a
later writer removes those whose process is gone.

The run folder is a boundary at every moment (:mod:`.dirfd`): it is opened once, and every
entry in it (checkpoints, ``chunks/``, ``quarantine/``, staging and trash folders,
``tags.json``) is reached relative to a folder descriptor without following a link, so a
link planted at any time, also during a save, is never followed; an entry of the wrong kind
(a file named ``quarantine``, a FIFO named ``tags.json``) gives a :class:`StorageError` or a
fallback, never a hang. Every failed filesystem call is a :class:`StorageError` that keeps
the errno and says what to do.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from ..errors import CorruptCheckpointError, StorageError
from .base import (
    CHUNKS,
    COMMIT_FILE,
    MAX_META_BYTES,
    QUARANTINE,
    Buffer,
    check_meta_name,
    check_name,
    is_checkpoint_name,
)
from .dirfd import (
    CLOEXEC,
    NOFOLLOW,
    Folder,
    fsync_dir,
    guarded,
    lexists,
    open_dir,
    pid_alive,
    remove_tree,
    scan,
    write_at,
    write_file_atomic,
    writer_tag,
)
from .lock import FlockLock, RunFolderLock
from .readfile import Hasher, read_file
from .staging import JoinedStaging, LocalStaging

__all__ = ["LocalStore", "linked_entries", "write_file_atomic", "fsync_dir", "is_checkpoint_name"]

log = logging.getLogger("unbroken")
_tag = writer_tag  # the name tests and older callers import

_HIDDEN = re.compile(r"^\.(staging|trash)-(?P<host>[^_]+)_(?P<pid>\d+)_(?:[0-9a-f]{8})_(?P<name>.*)$")
_CHUNK_ID = re.compile(r"^[0-9a-f]{64}$")
_CHUNK_TMP = re.compile(r"^\.[0-9a-f]{64}\.(?P<host>[^_]+)_(?P<pid>\d+)_[0-9a-f]{8}$")  # write_at's
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def _entry(name: str) -> str:
    """A name read from a listing (or given back by a caller): one path component, not hidden."""
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or name.startswith("."):
        raise CorruptCheckpointError(f"invalid checkpoint name {name!r}")
    return name


class LocalStore:
    """A run folder on a filesystem. Checkpoints are its non-hidden sub-folders."""

    remote = False

    def __init__(self, root: str | os.PathLike[str], readonly: bool = False,
                 chunks: Folder | None = None, folder: Folder | None = None) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.readonly = readonly
        self.folder = folder or Folder(self.root)
        if chunks is None:  # a checkpoint opened inside quarantine/ uses the run's chunks
            inside = self.root.name == QUARANTINE and (self.root.parent / CHUNKS).is_dir()
            chunks = Folder(self.root.parent).child(CHUNKS) if inside else self.folder.child(CHUNKS)
        self.chunks = chunks
        self.chunk_dir = chunks.path

    # ------------------------------------------------------------------ setup
    @guarded("checking the run folder")
    def check(self, deadline_s: float = 15.0) -> None:
        """The run location is a folder (or absent) none of whose entries that unbroken reads,
        writes, renames or deletes is a symbolic link: on a shared, group-writable filesystem a
        planted link would lead those operations out of the run folder. Such a run is refused
        with :class:`StorageError` naming the links. Every operation also refuses links by itself,
        also those planted later (see :mod:`.dirfd`); this says so up front, instead of
        skipping a checkpoint silently."""
        with self.folder.open() as rfd:
            links = linked_entries(rfd) if rfd is not None else []
        if links:
            shown = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
            raise StorageError(f"{self.root} holds symbolic links where unbroken keeps its own files ({shown}); "
                               "it never follows links out of a run folder: remove them (or copy their "
                               "targets in) and run again")

    @property
    def identity(self) -> str:
        """The real path of the run folder (links and ``..`` resolved): one per folder, however spelled."""
        return os.path.realpath(self.root)

    @guarded("creating the run folder")
    def ensure(self) -> None:
        with self.folder.open(create=True):
            pass

    def lock(self) -> FlockLock:
        return RunFolderLock(self.root, self.url, self.ensure)

    def local_dir(self) -> Path:
        return self.root

    def describe(self, name: str) -> str:
        return str(self.root / name)

    @guarded("measuring the free space")
    def free_bytes(self) -> int | None:
        """Free space on the run folder's filesystem, for the pre-save check."""
        with self.folder.open(create=True) as rfd:
            st = os.statvfs(rfd)  # type: ignore[arg-type]
        return st.f_bavail * st.f_frsize

    # ------------------------------------------------------------------ write
    @guarded("creating the staging folder")
    def stage(self, name: str) -> LocalStaging:
        return LocalStaging(self, check_name(name, "checkpoint"))

    @guarded("joining the staging folder")
    def join(self, token: str) -> JoinedStaging:
        m = _HIDDEN.match(token) if isinstance(token, str) else None
        if m is None or not token.startswith(".staging-"):
            raise StorageError(f"no staging folder {token!r} in {self.root}: is the run location a "
                               "filesystem shared by every rank?")
        return JoinedStaging(self, token, m["name"])

    def free_name(self, name: str, rfd: int) -> str:
        """``name`` if unused (in the run folder ``rfd`` and in its quarantine), else ``name-2``,
        ``name-3``, ..."""
        candidate, n = name, 1
        while lexists(candidate, rfd) or self._in_quarantine(candidate, rfd):
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    @staticmethod
    def _in_quarantine(name: str, rfd: int) -> bool:
        try:
            qfd = open_dir(QUARANTINE, rfd)
        except (FileNotFoundError, StorageError):  # none, or not a folder: nothing is in it
            return False
        try:
            return lexists(name, qfd)
        finally:
            os.close(qfd)

    @guarded("deleting a checkpoint")
    def delete(self, name: str) -> None:
        check_name(name, "checkpoint")
        trash = f".trash-{writer_tag()}_{name}"
        with self.folder.open() as rfd:
            if rfd is None:
                return
            try:
                os.rename(name, trash, src_dir_fd=rfd, dst_dir_fd=rfd)  # a link is renamed, not followed
            except FileNotFoundError:
                return  # already gone (another process deleted it)
            remove_tree(trash, rfd)

    @guarded("quarantining a checkpoint")
    def quarantine(self, name: str, reason: str) -> str | None:
        _entry(name)
        with self.folder.open() as rfd:
            if rfd is None:
                return None
            try:  # never through a link: it would move checkpoints (and write) outside the run
                qfd = open_dir(QUARANTINE, rfd, create=True, where=self.root)
            except StorageError as e:
                log.warning("cannot quarantine %s: %s", name, e)
                return None
            try:
                target, n = name, 1
                while lexists(target, qfd) or lexists(f"{target}.reason.txt", qfd):
                    n += 1
                    target = f"{name}.{n}"
                try:
                    os.rename(name, target, src_dir_fd=rfd, dst_dir_fd=qfd)
                except OSError:
                    return None
                try:  # O_EXCL|O_NOFOLLOW: never write through a link planted under the reason file's name
                    fd = os.open(f"{target}.reason.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC,
                                 0o644, dir_fd=qfd)
                    with os.fdopen(fd, "w") as f:
                        f.write(reason + "\n")
                    os.fsync(qfd)
                    os.fsync(rfd)
                except OSError as e:
                    log.warning("quarantined %s, but writing why failed (%s)", name, e)
            finally:
                os.close(qfd)
        return str(self.root / QUARANTINE / target)

    @guarded("removing leftovers of interrupted saves")
    def clean_stale(self) -> list[str]:
        removed: list[str] = []
        here = writer_tag().split("_")[0]
        with self.folder.open() as rfd:
            if rfd is None:
                return removed
            for name, _ in scan(rfd):
                m = _HIDDEN.match(name)
                if not m or m["host"] != here or pid_alive(int(m["pid"])):
                    continue  # not ours, or a live writer, or another host's that may be: leave it
                remove_tree(name, rfd)
                removed.append(name)
        return removed

    @guarded("writing a run-level file")
    def write_meta(self, file: str, data: bytes) -> None:
        with self.folder.open(create=True) as rfd:
            assert rfd is not None
            write_at(rfd, check_meta_name(file), data)

    # ------------------------------------------------------------------- read
    @guarded("listing checkpoints")
    def list_committed(self) -> list[str]:
        """Checkpoint folders: those with a manifest, and those named like a Checkpointer's
        (``step-000000500``, ``step-000000500-2``) even without one (a damaged checkpoint, to be
        reported). Other folders a user keeps in the run (``tensorboard/``) are not checkpoints;
        a copy under another name (``best copy``) is listed, but retention leaves it alone
        (:func:`is_checkpoint_name`)."""
        out = []
        with self.folder.open() as rfd:
            if rfd is None:
                return []
            for name, st in scan(rfd):
                if name.startswith(".") or name == QUARANTINE or not stat.S_ISDIR(st.st_mode):
                    continue
                if is_checkpoint_name(name) or self._has_manifest(name, rfd):
                    out.append(name)
        return sorted(out)

    @staticmethod
    def _has_manifest(name: str, rfd: int) -> bool:
        try:
            cfd = open_dir(name, rfd)
        except (FileNotFoundError, StorageError):  # removed, or replaced by a link, since listed
            return False
        try:
            return lexists(COMMIT_FILE, cfd)
        finally:
            os.close(cfd)

    @guarded("listing checkpoints")
    def list_uncommitted(self) -> list[str]:
        with self.folder.open() as rfd:
            names = [name for name, _ in scan(rfd)] if rfd is not None else []
        return sorted(m["name"] for n in names if (m := _HIDDEN.match(n)) and n.startswith(".staging-"))

    @guarded("listing the quarantine")
    def quarantined(self) -> LocalStore | None:
        """A read-only view of ``quarantine/`` (None if there is no such folder, or it is a link
        or a file); its folder is reached from the run folder's descriptor at every use."""
        with self.folder.open() as rfd:
            st = os.stat(QUARANTINE, dir_fd=rfd, follow_symlinks=False) if rfd is not None and \
                lexists(QUARANTINE, rfd) else None
        if st is None or not stat.S_ISDIR(st.st_mode):
            return None
        return LocalStore(self.root / QUARANTINE, readonly=True, chunks=self.chunks,  # their chunks stay in the run
                          folder=self.folder.child(QUARANTINE))

    @guarded("reading a checkpoint")
    def read(self, name: str, file: str, size: int | None = None, hasher: Hasher | None = None) -> Buffer:
        file = file if file == COMMIT_FILE else check_name(file)
        with self.folder.open() as rfd:
            try:
                if rfd is None:
                    raise FileNotFoundError(name)
                cfd = open_dir(_entry(name), rfd, where=self.root)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{name} is missing from {self.root}") from None
        try:
            return read_file(cfd, file, size, MAX_MANIFEST_BYTES, hasher)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{file} is missing") from None
        finally:
            os.close(cfd)

    @guarded("reading a run-level file")
    def read_meta(self, file: str) -> bytes | None:
        with self.folder.open() as rfd:
            if rfd is None:
                return None
            try:
                return bytes(read_file(rfd, check_meta_name(file), None, MAX_META_BYTES))
            except FileNotFoundError:
                return None

    # ------------------------------------------------------------------ chunks
    @guarded("writing a chunk")
    def put_chunk(self, cid: str, data: Buffer) -> None:
        """:func:`.dirfd.write_at` into ``chunks/``; the folder is fsynced by :meth:`sync_chunks`."""
        with self.chunks.open(create=True) as cfd:
            assert cfd is not None
            write_at(cfd, cid, data, sync_dir=False)

    @guarded("syncing the chunks")
    def sync_chunks(self) -> None:
        """Make the chunks written so far durable by name (one folder fsync for many chunks)."""
        with self.chunks.open() as cfd:
            if cfd is not None:
                os.fsync(cfd)

    @guarded("reading a chunk")
    def read_chunk(self, cid: str, size: int, hasher: Hasher | None = None) -> Buffer:
        with self.chunks.open() as cfd:
            try:
                if cfd is None:
                    raise FileNotFoundError(cid)
                return read_file(cfd, cid, size, 0, hasher)
            except FileNotFoundError:
                pass
        note = " (it was quarantined as damaged)" if self._chunk_quarantined(cid) else ""
        raise CorruptCheckpointError(f"chunk {cid} is missing from {self.chunk_dir}{note}")

    def _chunk_quarantined(self, cid: str) -> bool:
        try:
            with self.folder.child(QUARANTINE).child(CHUNKS).open() as qfd:
                return qfd is not None and lexists(cid, qfd)
        except (OSError, StorageError):
            return False

    @guarded("listing the chunks")
    def list_chunks(self) -> dict[str, float]:
        with self.chunks.open() as cfd:
            found = scan(cfd) if cfd is not None else []
        return {name: st.st_mtime for name, st in found if _CHUNK_ID.fullmatch(name) and stat.S_ISREG(st.st_mode)}

    @guarded("deleting a chunk")
    def delete_chunk(self, cid: str) -> None:
        with self.chunks.open() as cfd:
            if cfd is not None:
                try:
                    os.unlink(cid, dir_fd=cfd)
                except FileNotFoundError:
                    pass

    @guarded("removing half-written chunks")
    def clean_chunk_temps(self) -> list[str]:
        """Remove half-written chunks of writers on this host that are gone."""
        removed: list[str] = []
        here = writer_tag().split("_")[0]
        with self.chunks.open() as cfd:
            for name, _ in scan(cfd) if cfd is not None else []:
                m = _CHUNK_TMP.match(name)
                if m and m["host"] == here and not pid_alive(int(m["pid"])):
                    remove_tree(name, cfd)  # type: ignore[arg-type]
                    removed.append(name)
        return removed

    @guarded("quarantining a chunk")
    def quarantine_chunk(self, cid: str, reason: str) -> str | None:
        try:
            with self.chunks.open() as cfd, self.folder.child(QUARANTINE).child(CHUNKS).open(create=True) as qfd:
                if cfd is None or qfd is None:
                    return None
                os.replace(cid, cid, src_dir_fd=cfd, dst_dir_fd=qfd)
                write_at(qfd, f"{cid}.reason.txt", (reason + "\n").encode())
        except (OSError, StorageError) as e:
            log.warning("cannot quarantine chunk %s: %s", cid, e)
            return None
        return str(self.root / QUARANTINE / CHUNKS / cid)


_MANAGED_FILES = {".lock", ".lock.json", "tags.json", "fresh-starts.json", "run-id", QUARANTINE, "submit.slurm", CHUNKS}


def linked_entries(dir_fd: int) -> list[str]:
    """Entries of the run folder ``dir_fd`` that unbroken manages (checkpoint folders, staging
    and trash, the lock, tags, index, quarantine, chunks) and that are symbolic links, sorted."""
    return sorted(n for n, st in scan(dir_fd) if stat.S_ISLNK(st.st_mode) and (
        n in _MANAGED_FILES or n.startswith(("index.sqlite", ".tags.json.")) or is_checkpoint_name(n)
        or _HIDDEN.match(n)))
