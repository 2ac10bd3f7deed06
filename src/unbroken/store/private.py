"""A private folder in a place every user can write (``/dev/shm``), made as ``mkstemp`` makes a file.

A world-writable folder is shared by every user of the machine, and often by several containers: another
user can create a name first, or plant a symbolic link under it, and wait for a trainer (root, perhaps)
to restore from it, write into it or change the mode of what it points to. :func:`private_folder`
creates with ``mkdir(0700)``, opens with ``O_NOFOLLOW | O_DIRECTORY`` relative to the parent's
descriptor, checks the owner with ``fstat`` on the opened descriptor, and fixes the mode with
``fchmod`` on it; it refuses (never uses) a link, a file, or a folder someone else owns, with a
message naming the owner and the way out. Used by the RAM tier (:mod:`unbroken.tiers.ram`) for its
per-user folder and each run's folder in it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import StorageError


@contextlib.contextmanager
def private_folder(parent: Path, name: str, *, parent_fd: int | None = None,
                   shared_root: bool = False) -> Iterator[int]:
    """Create (mode 0700) or open the folder ``name`` in ``parent`` and yield its descriptor, refusing
    (:class:`~unbroken.errors.StorageError`, naming the owner and the way out) a symbolic link, something
    other than a folder, or a folder another user owns; a folder of the user's own that others may
    enter is made private through its descriptor (never ``chmod`` on a path). ``shared_root``:
    ``parent`` is a folder every user may write (``/dev/shm``), which must have the sticky bit (else
    another user could rename the checked folder away and put theirs in its place)."""
    path = parent / name
    way_out = ("use another root: RamTier(root=...) or UNBROKEN_RAM_ROOT, or have its owner (or root) remove "
               f"{path}")
    if parent_fd is None:
        try:
            os.makedirs(parent, exist_ok=True)  # the root the user chose (/dev/shm exists)
            parent_fd = own_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError(f"cannot open the RAM tier's root {parent}: {e}") from e
    else:
        own_fd = None
    fd = None
    try:
        if shared_root:
            st = os.fstat(parent_fd)
            if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
                raise StorageError(f"the RAM tier's root {parent} is writable by every user without the sticky bit: "
                                   "another user could replace the folders in it; use RamTier(root=...)")
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as e:
            raise StorageError(f"cannot create the RAM tier's folder {path}: {e}") from e
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except FileNotFoundError:
            raise
        except OSError as e:  # ELOOP: a link; ENOTDIR: a file
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
                who = f", made by {_user(st.st_uid)}"
            except OSError:
                what, who = f"unusable ({e})", ""
            raise StorageError(f"the RAM tier's folder {path} is {what}{who}: it is never followed or used; "
                               + way_out) from None
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StorageError(f"the RAM tier's folder {path} belongs to {_user(st.st_uid)}, not to you "
                               f"({_user(os.getuid())}): it is never used; " + way_out)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)  # the user's own folder, made private through the descriptor
        yield fd
    finally:
        if fd is not None:
            os.close(fd)
        if own_fd is not None:
            os.close(own_fd)


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
