"""Folders opened without following links: the run folder is a boundary at every moment.

A run folder may sit on a shared, group-writable filesystem, where anyone can plant a
symbolic link (or a FIFO, or a file where a folder belongs) under a name unbroken manages,
at any time, also while a save is running. A check done once and a path used later leave a
window in between; so the local store never uses a path below the run folder:

- the run folder is opened **once** (the path the user named, links in it included: that is
  the user's choice) and kept as a directory descriptor (:class:`Folder`);
- every entry inside it is reached relative to a descriptor (``dir_fd=``): sub-folders
  (``chunks/``, ``quarantine/``, a checkpoint, a staging folder) with
  ``O_DIRECTORY|O_NOFOLLOW`` (:func:`open_dir`), files with ``O_NOFOLLOW`` (and ``O_EXCL``
  when created), folders removed by :func:`remove_tree` (which unlinks a link, never follows
  it), existence checks with ``lstat``;
- an entry of the wrong kind is refused by the open itself (``O_DIRECTORY`` fails on a file
  or a FIFO, ``O_NONBLOCK`` keeps a FIFO from hanging) with a :class:`StorageError` that
  says what is there and what to do.

Every raw ``OSError`` of a filesystem call becomes a :class:`StorageError` that keeps the
errno and says what to do (:func:`os_error`, :func:`guarded`).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import socket
import stat
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ReadOnlyRunError, StorageError, UnbrokenError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _DIRECTORY | CLOEXEC | _NONBLOCK
_WRONG_KIND = {errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY}

_ADVICE = {
    errno.ENOSPC: "the filesystem is full: free space or choose another location (earlier checkpoints "
                  "are intact)",
    errno.EDQUOT: "the disk quota is reached: free space or raise the quota (earlier checkpoints are intact)",
    errno.EACCES: "permission denied: check the owner and mode of the run folder",
    errno.EPERM: "operation not permitted: check the owner and mode of the run folder",
    errno.EROFS: "the filesystem is read-only: choose a writable location",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this machine: close some or raise fs.file-max",
    errno.ENOMEM: "out of memory: free memory or lower the memory limit's pressure (ulimit -v)",
    errno.EIO: "the disk or network filesystem reported an I/O error: check it (dmesg, the server)",
    errno.ELOOP: "a symbolic link is where unbroken keeps its own entry; unbroken never follows links "
                 "inside a run folder: remove it",
}
_KIND_ADVICE = ("an entry of the wrong kind is where unbroken keeps its own file or folder: move it "
                "out of the run folder and run again")


def os_error(e: OSError, doing: str, where: object) -> StorageError:
    """The :class:`StorageError` for a failed filesystem call: keeps the errno, says what to do."""
    code = e.errno or errno.EIO
    advice = _ADVICE.get(code) or (_KIND_ADVICE if code in _WRONG_KIND else "check the run folder and try again")
    name = errno.errorcode.get(code, str(code))
    entry = f" ({e.filename})" if isinstance(e.filename, str) and "/" not in e.filename else ""
    cls = ReadOnlyRunError if code in (errno.EROFS, errno.EACCES, errno.EPERM) else StorageError
    return cls(code, f"{doing}{entry} in {where} failed: {e.strerror or e} ({name}); {advice}")


F = TypeVar("F", bound=Callable[..., Any])


def guarded(doing: str) -> Callable[[F], F]:
    """Method decorator: a raw ``OSError`` becomes :func:`os_error` (``self.url`` says where);
    library errors pass unchanged."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except UnbrokenError:
                raise
            except OSError as e:
                raise os_error(e, doing, self.url) from None
        return inner  # type: ignore[return-value]
    return wrap


def kind_of(mode: int) -> str:
    """What an entry is, for messages."""
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a device or other special file"


def lstat(name: str, dir_fd: int) -> os.stat_result | None:
    """``lstat`` of ``name`` inside ``dir_fd`` (a link is not followed), None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def lexists(name: str, dir_fd: int) -> bool:
    return lstat(name, dir_fd) is not None


def wrong_kind(name: str, dir_fd: int | None, wanted: str, where: object) -> StorageError:
    st = lstat(name, dir_fd) if dir_fd is not None else None
    what = kind_of(st.st_mode) if st is not None else "something else"
    code = errno.ELOOP if st is not None and stat.S_ISLNK(st.st_mode) else errno.ENOTDIR
    hint = ("unbroken never follows links inside a run folder: remove it" if code == errno.ELOOP
            else "move it out of the run folder")
    return StorageError(code, f"{where}/{name} is {what}, not {wanted}; {hint} and run again")


def open_dir(name: str, dir_fd: int, *, create: bool = False, where: object = "the run folder") -> int:
    """The folder ``name`` inside ``dir_fd``, opened without following a link (and created,
    with ``create``). ``FileNotFoundError`` if absent; :class:`StorageError` if a link or not
    a folder (a file, a FIFO: refused without blocking)."""
    if create:
        try:
            os.mkdir(name, 0o777, dir_fd=dir_fd)  # the umask decides, as for Path.mkdir
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS | NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise wrong_kind(name, dir_fd, "a folder", where) from None
        raise


class Folder:
    """A folder of the run, reached without following links: the run folder itself (by the
    path the user named, opened once and kept), or a named folder inside another
    :class:`Folder` (opened with ``O_NOFOLLOW`` at each use, so it may be removed and made
    again between uses)."""

    def __init__(self, path: Path, parent: Folder | None = None) -> None:
        self.path, self.parent = path, parent
        self._fd: int | None = None
        self._close: weakref.finalize | None = None  # closes _fd once: at collection, or when reopened
        self._mutex = threading.Lock()

    def child(self, name: str) -> Folder:
        return Folder(self.path / name, self)

    def _root_fd(self, create: bool) -> int | None:
        with self._mutex:
            if self._fd is not None:
                if os.fstat(self._fd).st_nlink > 0:
                    return os.dup(self._fd)  # a duplicate: another thread may replace the kept one
                assert self._close is not None
                self._close()  # removed (and maybe made again) since: open the path anew
                self._fd = None
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, _DIR_FLAGS)
            except FileNotFoundError:
                if create:
                    raise
                return None
            except NotADirectoryError:
                raise StorageError(f"{self.path} exists and is not a folder; choose another run location") from None
            self._fd, self._close = fd, weakref.finalize(self, os.close, fd)
            return os.dup(fd)

    @contextmanager
    def open(self, create: bool = False) -> Iterator[int | None]:
        """The folder's descriptor for the ``with`` block; None if it does not exist (unless
        ``create``)."""
        if self.parent is None:
            fd = self._root_fd(create)  # a duplicate of the kept descriptor, closed after the block
            if fd is None:
                yield None
                return
            try:
                yield fd
            finally:
                os.close(fd)
            return
        with self.parent.open(create) as pfd:
            if pfd is None:
                yield None
                return
            try:
                fd = open_dir(self.path.name, pfd, create=create, where=self.parent.path)
            except FileNotFoundError:
                yield None
                return
            try:
                yield fd
            finally:
                os.close(fd)


def scan(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """Every entry of the folder ``dir_fd`` with its ``lstat``. Read through a descriptor of
    its own: descriptors made by ``dup`` share the read position, so two threads listing the
    same folder descriptor would each miss entries."""
    fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    out = []
    try:
        with os.scandir(fd) as it:
            for e in it:
                try:
                    out.append((e.name, e.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue  # removed while listed
    finally:
        os.close(fd)
    return out


def remove_tree(name: str, dir_fd: int) -> None:
    """Remove the entry ``name`` inside ``dir_fd``: a folder with everything in it (never
    following a link inside: ``shutil.rmtree`` with ``dir_fd``), a link or a file by
    unlinking it. Best effort: what cannot be removed stays (it is hidden, or reported)."""
    st = lstat(name, dir_fd)
    try:
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_tag() -> str:
    """``<host>_<pid>_<random>``: names what a writer leaves behind, so a later one can tell
    whether the writer is gone."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_at(dir_fd: int, name: str, data: Any, mode: int = 0o644, sync_dir: bool = True) -> None:
    """The one atomic file write, inside the folder ``dir_fd``: a fresh hidden temp file
    ``.<name>.<host>_<pid>_<random>`` (``O_EXCL|O_NOFOLLOW``, so a planted link is never
    written through), fsync, ``rename`` over ``name`` (which replaces a link rather than
    following it; a folder there is an error), fsync the folder (unless the caller does it
    once for many files: ``sync_dir=False``)."""
    tmp = f".{name}.{writer_tag()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if sync_dir:
        os.fsync(dir_fd)


def write_file_atomic(path: Path, data: Any, mode: int = 0o644, sync_dir: bool = True) -> None:
    """:func:`write_at` for a path: its folder is the caller's (opened as named), the file
    itself is never followed if it is a link."""
    dfd = os.open(Path(path).parent, _DIR_FLAGS)
    try:
        write_at(dfd, Path(path).name, data, mode, sync_dir)
    finally:
        os.close(dfd)
