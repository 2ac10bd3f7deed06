"""One writer per run folder on a filesystem: an advisory lock held for the writer's lifetime.

The lock is ``fcntl.flock`` on ``<run>/.lock``: the kernel releases it when the
holder dies, however it dies, so a stale lock from a killed process cannot block
the next run (nothing to detect or clean). The holder writes its host and pid into
the file, for the message a refused second writer gets. Within one process every
``Checkpointer`` on the same folder shares the lock (reference-counted).

``flock`` is reliable on local filesystems and on NFSv4; on filesystems without
working locks it may succeed for everyone, which is no worse than no lock.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from pathlib import Path

from ..errors import ReadOnlyRunError, RunLockedError

try:
    import fcntl
except ImportError:  # Windows: no flock; the lock then only guards this process
    fcntl = None  # type: ignore[assignment]

_held: dict[str, tuple[int, int]] = {}  # realpath -> (fd, refcount)
_mutex = threading.Lock()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep the lock's file open: it would hold
    the flock after the writer released it, or died, until the child exits."""
    for fd, _ in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class FlockLock:
    """The writer lock of one run folder; :meth:`acquire` is idempotent."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> None:
        if self._key is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _refuse_readonly(self.root, e)
            raise
        key = os.path.realpath(self.root)
        with _mutex:
            if key in _held:
                fd, n = _held[key]
                _held[key] = (fd, n + 1)
                self._key = key
                return
            path = os.path.join(key, ".lock")
            try:  # O_NOFOLLOW: a planted .lock link must not make us write to a file elsewhere
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise RunLockedError(f"{path} is a symbolic link; remove it (unbroken never follows "
                                         "links inside a run folder)") from None
                _refuse_readonly(self.root, e)
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise RunLockedError(f"{path} is not a regular file; remove it")
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise RunLockedError(
                    f"{self.root} is being written by another process ({holder}). Two writers would "
                    "corrupt each other's retention and resume; stop the other run, or use another "
                    "folder. (The lock is released automatically when that process exits.)") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
            _held[key] = (fd, 1)
            self._key = key

    def verify(self) -> None:
        """A flock cannot be lost while the process lives."""

    def release(self) -> None:
        if self._key is None:
            return
        with _mutex:
            if self._key not in _held:  # forgotten in a forked child
                self._key = None
                return
            fd, n = _held[self._key]
            if n > 1:
                _held[self._key] = (fd, n - 1)
            else:
                del _held[self._key]
                os.close(fd)  # releases the flock
        self._key = None


def _refuse_readonly(root: Path, e: OSError) -> None:
    """A folder that cannot be written (read-only filesystem, no permission) has no writer to
    exclude: :class:`ReadOnlyRunError`, which :meth:`unbroken.run.Run.begin` turns into a
    read-only run."""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise ReadOnlyRunError(f"{root} cannot be written ({os.strerror(e.errno)})") from None
