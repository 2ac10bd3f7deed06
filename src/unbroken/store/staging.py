"""A checkpoint being written into a hidden folder of a local run, and its commit by rename.

The staging folder ``.staging-<host>_<pid>_<random>_<name>`` is made inside the run folder's
descriptor and opened once with ``O_DIRECTORY|O_NOFOLLOW``; every file is created relative to
that descriptor (``O_EXCL|O_NOFOLLOW``), so replacing the folder (or planting a link in it)
while the save runs can never send a byte outside the run. The commit fsyncs the folder,
renames it to its final name (``renameat`` inside the run folder: a link is renamed, never
followed) and fsyncs the run folder.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import TYPE_CHECKING, BinaryIO

from ..errors import StorageError
from .base import check_name
from .dirfd import CLOEXEC, NOFOLLOW, guarded, lstat, open_dir, remove_tree, writer_tag

if TYPE_CHECKING:
    from .local import LocalStore

log = logging.getLogger("unbroken")


class _DurableFile:
    """A new write-only file (``O_EXCL|O_NOFOLLOW`` inside its folder's descriptor), flushed
    and fsynced when closed."""

    def __init__(self, dir_fd: int, name: str, url: str) -> None:
        self.url = url
        self._f = self._open(dir_fd, name)

    @guarded("creating a checkpoint file")
    def _open(self, dir_fd: int, name: str):  # type: ignore[no-untyped-def]
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644, dir_fd=dir_fd)
        return os.fdopen(fd, "wb", buffering=0)

    @guarded("writing a checkpoint file")
    def write(self, data: bytes | memoryview) -> int:
        mv = memoryview(data)
        done = 0
        while done < len(mv):  # raw files may write partially
            done += self._f.write(mv[done:])
        return done

    def flush(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self._f.closed

    @guarded("syncing a checkpoint file")
    def close(self) -> None:
        if not self._f.closed:
            try:
                os.fsync(self._f.fileno())
            finally:
                self._f.close()

    def __enter__(self) -> _DurableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


class _FolderStaging:
    """Files written inside a staging folder's descriptor (``_fd``, closed with the object)."""

    parallel_files = True  # files may be written from several threads at once
    url: str
    _fd: int

    def open(self, file: str) -> BinaryIO:
        return _DurableFile(self._fd, check_name(file), self.url)  # type: ignore[return-value]

    @property
    def folder_fd(self) -> int:
        """The staging folder's descriptor (files are created inside it; the writer process gets a copy)."""
        return self._fd

    @guarded("removing an incomplete checkpoint file")
    def discard(self, file: str) -> None:
        """Remove ``file`` if it was created (to write it again)."""
        try:
            os.unlink(check_name(file), dir_fd=self._fd)
        except FileNotFoundError:
            pass

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)


class LocalStaging(_FolderStaging):
    """A checkpoint being written into a hidden sibling folder."""

    def __init__(self, store: LocalStore, name: str) -> None:
        self.store, self.name, self.url = store, name, store.url
        self.token = f".staging-{writer_tag()}_{name}"
        self.path = store.root / self.token
        self._fd = self._make()

    @guarded("creating the staging folder")
    def _make(self) -> int:
        with self.store.folder.open(create=True) as rfd:
            assert rfd is not None
            os.mkdir(self.token, 0o777, dir_fd=rfd)  # the umask decides
            return open_dir(self.token, rfd, where=self.store.root)


    def flush(self) -> None:
        pass  # every file is fsynced when it is closed

    @guarded("committing the checkpoint")
    def commit(self) -> str:
        os.fsync(self._fd)
        with self.store.folder.open() as rfd:
            if rfd is None:
                raise StorageError(f"the run folder {self.store.root} was removed during the save")
            here, ours = lstat(self.token, rfd), os.fstat(self._fd)
            if here is None or (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):
                raise StorageError(errno.EEXIST, f"the staging folder {self.path} was moved or replaced during the "
                                                 "save (a link or another folder is in its place); nothing was "
                                                 "committed: remove what is there and save again")
            final = self.store.free_name(self.name, rfd)
            os.rename(self.token, final, src_dir_fd=rfd, dst_dir_fd=rfd)
            self.name = final
            os.close(self._fd)
            self._fd = -1
            try:
                os.fsync(rfd)
            except OSError as e:  # the rename happened: the checkpoint is committed, maybe not yet durable
                log.warning("%s committed, but syncing the run folder failed (%s): it may not survive a "
                            "power cut", final, e)
        return final

    def abort(self) -> None:
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            with self.store.folder.open() as rfd:
                if rfd is not None:
                    remove_tree(self.token, rfd)
        except (OSError, StorageError):
            pass  # never raises: the hidden leftover is removed by the next writer



class JoinedStaging(_FolderStaging):
    """A rank writing its files into the coordinator's staging folder."""

    def __init__(self, store: LocalStore, token: str, name: str) -> None:
        self.name, self.token, self.url = name, token, store.url
        self.path = store.root / token
        with store.folder.open() as rfd:
            try:
                if rfd is None:
                    raise FileNotFoundError(token)
                self._fd = open_dir(token, rfd, where=store.root)
            except (FileNotFoundError, StorageError):
                raise StorageError(f"no staging folder {token!r} in {store.root}: is the run location a "
                                   "filesystem shared by every rank?") from None


    def flush(self) -> None:
        pass

    def commit(self) -> str:
        raise RuntimeError("only the coordinator commits")

    def abort(self) -> None:
        pass  # the coordinator removes the folder

