"""Checkpoints on a local or network filesystem, committed by an atomic rename.

Why rename: a POSIX ``rename`` of a directory is atomic, so a reader sees either no
checkpoint or the whole one. Files are written into a hidden staging folder beside
the target (same filesystem, so the rename cannot degrade into a copy), each file is
fsynced, the manifest is written last, the staging folder is fsynced, renamed to its
final name, and the parent folder is fsynced so the rename itself survives a power
cut. Deletion is the same in reverse: rename to a hidden trash name first, then
remove, so a half-deleted checkpoint is never visible either.

Hidden leftovers (``.staging-*``, ``.trash-*``) carry the writer's host and pid; a
later writer removes those whose process is gone.
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

from ..errors import CorruptCheckpointError
from ..format.manifest import MANIFEST, MAX_MANIFEST_BYTES, check_file_name
from .base import Buffer

_HIDDEN = re.compile(r"^\.(staging|trash)-(?P<host>[^_]+)_(?P<pid>\d+)_")
QUARANTINE = "quarantine"


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class _DurableFile:
    """A write-only file that is flushed and fsynced when closed."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
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

    def __init__(self, storage: "LocalStorage", name: str) -> None:
        self.storage = storage
        self.name = name
        self.path = storage.root / f".staging-{_tag()}_{name}"
        self.path.mkdir()

    def open(self, file: str) -> BinaryIO:
        target = self.path / (MANIFEST if file == MANIFEST else check_file_name(file))
        return _DurableFile(target)  # type: ignore[return-value]

    def commit(self) -> str:
        fsync_dir(self.path)
        final = self.storage.free_name(self.name)
        os.rename(self.path, self.storage.root / final)
        fsync_dir(self.storage.root)
        self.name = final
        return final

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class LocalStorage:
    """A run folder on a filesystem. Checkpoints are its non-hidden sub-folders."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def stage(self, name: str) -> LocalStaging:
        self.ensure()
        return LocalStaging(self, name)

    def free_name(self, name: str) -> str:
        """``name`` if unused, else ``name-2``, ``name-3``, ..."""
        candidate, n = name, 1
        while (self.root / candidate).exists() or (self.root / QUARANTINE / candidate).exists():
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def list_committed(self) -> list[str]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or entry.name == QUARANTINE:
                continue
            if entry.is_dir(follow_symlinks=False):
                out.append(entry.name)
        return sorted(out)

    def read(self, name: str, file: str, size: int | None = None) -> Buffer:
        path = self.root / name / (MANIFEST if file == MANIFEST else check_file_name(file))
        try:
            # O_NONBLOCK: opening a FIFO planted in a checkpoint must not hang (it is refused below).
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{file} is missing") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpointError(f"{file} is a symbolic link; refusing to follow it") from None
            raise
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{file} is not a regular file")
            os.set_blocking(fd, True)
            if size is None and st.st_size > MAX_MANIFEST_BYTES:  # refuse before allocating
                raise CorruptCheckpointError(f"{file} is implausibly large ({st.st_size} bytes)")
            if size is not None and st.st_size != size:
                raise CorruptCheckpointError(f"{file} has {st.st_size} bytes, the manifest says {size}")
            # uninitialised memory: zero-filling a fresh bytearray cost as much as the read itself
            buf = torch.empty(st.st_size, dtype=torch.uint8).numpy()
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    raise CorruptCheckpointError(f"{file} shrank while being read")
                got += n
            return buf

    def delete(self, name: str) -> None:
        src = self.root / name
        trash = self.root / f".trash-{_tag()}_{name}"
        os.rename(src, trash)
        shutil.rmtree(trash, ignore_errors=True)

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
                     | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
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
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
        return removed

    def free_bytes(self) -> int:
        """Free space on the run folder's filesystem, for the pre-save check."""
        self.ensure()
        return shutil.disk_usage(self.root).free

    def describe(self, name: str) -> str:
        return str(self.root / name)
