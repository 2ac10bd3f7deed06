"""One writer per run folder on a filesystem: an advisory lock held for the writer's lifetime.

The lock is ``fcntl.flock`` on ``<run>/.lock``: the kernel releases it when the
holder dies, however it dies, so a stale lock from a killed process cannot block
the next run (nothing to detect or clean). The holder writes its host and pid into
the file, for the message a refused second writer gets.

- **One lock per folder, whatever its spelling.** The lock is keyed by the folder's real
  path (symbolic links and ``..`` resolved), and every spelling of a local folder
  (``runs/exp1``, ``/abs/runs/exp1/``, ``file://``, ``local://``, a symlinked parent) opens
  a :class:`~unbroken.store.local.LocalStore` (:func:`unbroken.store.open_store`), so all
  of them meet at the same ``.lock`` file. Within one process every holder on the same
  folder shares the lock (reference-counted).
- **Nothing leaks on an error.** If taking the lock fails (a full disk while writing the
  holder's name, a read-only folder), the file is closed again, so neither this process
  nor another one is locked out; the error is a :class:`~unbroken.errors.StorageError`
  that says what to do.
- **A lock that vanished stops the writer.** A flock belongs to the open file, not to the
  name: if ``.lock`` is deleted or replaced, a second writer can lock the new file.
  :meth:`FlockLock.verify`, called before every commit, checks that the file at the path is
  still the one this process locked, and raises :class:`~unbroken.errors.RunLockedError`
  otherwise: the stale writer commits nothing more.
- **A holder that is dropped** (garbage-collected without :meth:`FlockLock.release`)
  gives its share back; the kernel releases whatever is left when the process exits.

``flock`` is reliable on local filesystems and on NFSv4. A filesystem that has no locks
at all (Lustre mounted ``noflock``) answers ``ENOLCK``/``ENOSYS``: the run goes on with a
warning, unprotected, which is no worse than no lock.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ReadOnlyRunError, RunLockedError, StorageError
from .dirfd import guarded

try:
    import fcntl
except ImportError:  # Windows: no flock; the lock then only guards this process
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("unbroken")
LOCK_FILE = ".lock"
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_HINTS = {errno.ENOSPC: "the filesystem is full: free some space (or use another location) and run again",
          errno.EDQUOT: "the disk quota is exhausted: free some space (or use another location) and run again",
          errno.EROFS: "the filesystem is read-only: use a writable location",
          errno.EACCES: "permission denied: use a location this user may write",
          errno.EPERM: "permission denied: use a location this user may write"}


@dataclass
class _Held:
    """This process's lock on one folder."""

    fd: int
    file_id: tuple[int, int]  # (st_dev, st_ino) of the .lock file we locked
    path: str
    count: int = 1


_held: dict[str, _Held] = {}  # realpath of the run folder -> the process's lock on it
_mutex = threading.Lock()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep the lock's file open: it would hold
    the flock after the writer released it, or died, until the child exits."""
    global _mutex
    for held in _held.values():
        try:
            os.close(held.fd)
        except OSError:
            pass
    _held.clear()
    _mutex = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def lock_error(root: str | os.PathLike[str], path: str, e: OSError) -> StorageError:
    """The :class:`StorageError` for an ``OSError`` met while taking a run's lock: what failed, and what to do."""
    hint = _HINTS.get(e.errno or 0, "check the location, then run again")
    # a folder that cannot be written has no writer to exclude: Run.begin opens it read-only
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        err = ReadOnlyRunError(f"{root} cannot be written ({e.strerror or e}, taking its writer lock {path}); {hint}")
        err.errno = e.errno  # kept, without the "[Errno N]" prefix in the message
        return err
    return StorageError(f"cannot take the writer lock of {root} ({path}): {e.strerror or e}; {hint}")


def _take(key: str, root: Path) -> _Held:
    """Open and lock ``<key>/.lock``; on any failure the file is closed again (nothing leaks)."""
    path = os.path.join(key, LOCK_FILE)
    try:  # O_NOFOLLOW: a planted .lock link must not make us write to a file elsewhere
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunLockedError(f"{path} is a symbolic link; remove it (unbroken never follows "
                                 "links inside a run folder)") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            _refuse_if_held(path, root)  # another user's .lock: not "read-only" while its owner writes
        raise lock_error(root, path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunLockedError(f"{path} is not a regular file; remove it")
        _flock(fd, root, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    except BaseException as e:
        os.close(fd)  # releases the flock, if it was taken
        if isinstance(e, OSError) and not isinstance(e, (RunLockedError, StorageError)):
            raise lock_error(root, path, e) from None
        raise
    return _Held(fd, (st.st_dev, st.st_ino), path)


def _refuse_if_held(path: str, root: Path) -> None:
    """``.lock`` exists but this user may not write it: a flock works on a descriptor opened for
    reading, so a live writer (its owner) is still detected and refused (:class:`RunLockedError`)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _flock(fd, root, path)  # raises RunLockedError if held; released with the close below
    finally:
        os.close(fd)


def _flock(fd: int, root: Path, path: str) -> None:
    if fcntl is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise RunLockedError(
            f"{root} is being written by another process ({holder}). Two writers would "
            "corrupt each other's retention and resume; stop the other run, or use another "
            "folder. (The lock is released automatically when that process exits.)") from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        log.warning("%s: this filesystem has no file locks (%s); unbroken cannot keep a second writer "
                    "out of this run: make sure only one process writes it", path, e.strerror)


def _check(held: _Held, root: Path) -> None:
    """Raise :class:`RunLockedError` unless the file at ``held.path`` is the one we locked."""
    try:
        st = os.stat(held.path, follow_symlinks=False)
        now: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except FileNotFoundError:
        now = None
    except OSError as e:
        raise StorageError(f"cannot check the writer lock of {root} ({held.path}): {e.strerror or e}; "
                           "check the location, then run again") from None
    if now != held.file_id:
        what = "was deleted" if now is None else "was replaced by another file"
        raise RunLockedError(
            f"{held.path}, the writer lock this process holds on {root}, {what}: another writer may be "
            "writing this run now, so this one commits no more checkpoints (nothing was written). "
            "Stop the other writer if there is one, then restart this one: it resumes from the newest "
            "checkpoint.")


def _release(key: str, held: _Held) -> None:
    """Give back one share of ``held`` (the lock on ``key``); close it with the last one."""
    with _mutex:
        if _held.get(key) is not held:  # forgotten in a forked child
            return
        held.count -= 1
        if held.count == 0:
            del _held[key]
            os.close(held.fd)  # releases the flock


def _release_dropped(key: str, held: _Held) -> None:
    """A holder was garbage-collected unreleased: give its share back in a thread of its own,
    never inside the collector (which may run in a thread holding ``_mutex``)."""
    try:
        threading.Thread(target=_release, args=(key, held), name="unbroken-lock-release").start()
    except RuntimeError:  # the interpreter is shutting down: the kernel releases the flock
        pass


class FlockLock:
    """The writer lock of one run folder; :meth:`acquire` is idempotent."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._key: str | None = None
        self._held: _Held | None = None
        self._release: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunLockedError` naming the holder (another process),
        or :class:`StorageError` (the folder cannot be written: full, read-only, denied)."""
        if self._key is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise lock_error(self.root, str(self.root), e) from None
        key = os.path.realpath(self.root)
        with _mutex:
            held = _held.get(key)
            if held is not None:
                _check(held, self.root)  # a lock that vanished is not shared with a new holder
                held.count += 1
            else:
                held = _held[key] = _take(key, self.root)
            self._key, self._held = key, held
            self._release = weakref.finalize(self, _release_dropped, key, held)  # if dropped unreleased
            self._release.atexit = False  # at exit the kernel releases the flock

    def verify(self) -> None:
        """Raise :class:`RunLockedError` if ``<run>/.lock`` is no longer the file this process
        locked (deleted, or replaced): another writer may have locked the new one."""
        if self._key is None:
            return
        with _mutex:
            held = _held.get(self._key)
        if held is None or held is not self._held:
            raise RunLockedError(f"{self.root}: this process no longer holds the writer lock (a forked "
                                 "child?); only the process that took it may commit")
        _check(held, self.root)

    def release(self) -> None:
        if self._key is None:
            return
        if self._release is not None and self._release.detach() is not None and self._held is not None:
            _release(self._key, self._held)
        self._key, self._held, self._release = None, None, None


class RunFolderLock(FlockLock):
    """The run's flock, taken once the run folder exists (``ensure`` makes it): a full disk or an odd
    ``.lock`` (a folder) is a :class:`StorageError` that says what to do, not a raw ``OSError``."""

    def __init__(self, root: str | os.PathLike[str], url: str, ensure: Callable[[], None]) -> None:
        super().__init__(root)
        self.url = url
        self._ensure = ensure

    @guarded("taking the run's writer lock (.lock)")
    def acquire(self) -> None:
        if not self.held:
            self._ensure()
        super().acquire()
