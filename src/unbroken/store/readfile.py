"""Reading one checkpoint file from a local filesystem, fast and safely.

Large files (tensor files) are **mapped**, not read into fresh memory: on the machines
measured (see ``docs/format.md``) a private mapping hashed piece by piece and then copied
into the live parameters beat ``readinto`` a fresh buffer followed by the copy by about
1.5-2 ×, because there is no second full-size allocation to fault in: the tensors are
views of the page cache, copy-on-write, like ``safetensors.load_file``'s. The checksum is
computed while the bytes arrive (each piece hashed right after it is read or faulted in,
while it is still in the CPU cache), never in a second pass.

What the mapping trades away: the bytes loaded are the bytes checked only as long as
nobody rewrites the file in place after the check (unbroken never does; committed files
are immutable and retention removes them by unlinking, which leaves a mapping intact); a
file truncated by someone else while mapped would make the process fail with ``SIGBUS``
when the lost pages are touched. Small files (manifests, state trees) are read into
memory. ``UNBROKEN_NO_MMAP=1`` reads everything into memory.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import sys
from pathlib import Path
from typing import Protocol

from ..errors import CorruptCheckpointError, StorageError
from .base import Buffer

log = logging.getLogger("unbroken")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
PIECE = 16 * 1024 * 1024
"""Bytes read (or hashed from a mapping) at a time: small enough to stay in the CPU cache."""
AHEAD = 256 * 1024 * 1024
"""How far ahead of the hasher the kernel is asked to read a mapped file."""
MMAP_MIN = 4 * 1024 * 1024
"""Files at least this large are mapped (where mmap exists and is not turned off)."""


class Hasher(Protocol):
    def update(self, data: Buffer) -> None: ...


def _use_mmap(size: int) -> bool:
    return size >= MMAP_MIN and hasattr(mmap, "MAP_PRIVATE") and os.environ.get("UNBROKEN_NO_MMAP") != "1"


def read_file(dir_fd: int, file: str, size: int | None, max_unsized: int, hasher: Hasher | None = None) -> Buffer:
    """Read ``file`` inside the folder ``dir_fd`` whole, feeding ``hasher`` every byte in order
    as it arrives; the file itself is never a link. ``FileNotFoundError`` if it is missing,
    :class:`CorruptCheckpointError` if it is odd (a link, not a regular file, a size other
    than ``size``, or over ``max_unsized`` bytes when no size is expected). A file that cannot
    be mapped (``ENOMEM``: too many mappings, an address-space limit) is read into memory."""
    flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)  # O_NONBLOCK: a FIFO must not hang
    try:
        fd = os.open(file, flags, dir_fd=dir_fd)  # callers checked the name: one plain component
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{file} is a symbolic link; refusing to follow it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with a raw IsADirectoryError
        os.close(fd)
        raise CorruptCheckpointError(f"{file} is not a regular file")
    with os.fdopen(fd, "rb", buffering=0) as f:
        os.set_blocking(fd, True)
        if size is None and st.st_size > max_unsized:  # refuse before allocating
            raise CorruptCheckpointError(f"{file} is implausibly large ({st.st_size} bytes)")
        if size is not None and st.st_size != size:
            raise CorruptCheckpointError(f"{file} has {st.st_size} bytes, the manifest says {size}")
        failed: OSError | None = None
        if _use_mmap(st.st_size):
            try:  # only the mapping itself may fail over to a read (nothing was hashed yet)
                m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # ENOMEM (vm.max_map_count, ulimit -v), ENODEV (no mmap here): read it
                failed = e
                log.warning("could not map %s (%s); reading it into memory instead", file, e)
            else:
                return _hash_mapped(fd, m, st.st_size, hasher)
        try:
            buf = allocate(st.st_size, file)
        except StorageError as e:
            if failed is None:
                raise
            raise StorageError(errno.ENOMEM, f"{e.strerror} (mapping it failed first: {failed})") from None
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = f.readinto(view[got:got + PIECE])
            if not n:
                raise CorruptCheckpointError(f"{file} shrank while being read")
            if hasher is not None:
                hasher.update(view[got:got + n])
            got += n
        return buf


def _will_need(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to read ahead (asynchronously, in large requests)."""
    if hasattr(os, "posix_fadvise") and length > 0:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def _hash_mapped(fd: int, m: mmap.mmap, size: int, hasher: Hasher | None) -> Buffer:
    """A private (copy-on-write) mapping ``m`` of the whole file, hashed piece by piece while the
    kernel reads :data:`AHEAD` bytes ahead of the hasher (``posix_fadvise``: about twice as
    fast here as page faults with ``madvise`` read-ahead, and bounded, unlike a WILLNEED of
    the whole file, which would flood the page cache with a file larger than memory)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
    _will_need(fd, 0, min(size, AHEAD))
    if hasher is not None:
        view = memoryview(m)
        try:
            for i in range(0, size, PIECE):
                _will_need(fd, i + AHEAD, min(PIECE, size - i - AHEAD))
                hasher.update(view[i:i + PIECE])
        finally:
            view.release()
    return m


def available_memory() -> int | None:
    """Bytes this machine can still give a process (Linux ``MemAvailable`` plus free swap), or
    ``None`` where unknown."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def allocate(size: int, file: str) -> Buffer:
    """Uninitialised memory for reading a file (zero-filling cost as much as the read itself).

    A size the machine cannot hold is refused with :class:`StorageError` before allocating:
    Linux overcommits, so the allocation itself would succeed and the read be killed by the
    OOM killer part way, with no message at all."""
    avail = available_memory()
    if avail is not None and size > avail:
        raise StorageError(errno.ENOMEM, f"cannot read {file}: it has {size / 2**30:.1f} GiB and this machine "
                                         f"has {avail / 2**30:.1f} GiB of memory available; free memory "
                                         "or load on a larger machine")
    # torch's (or numpy's) allocator where it is already loaded; a plain bytearray in torch-free
    # tools (ls, verify). Nothing is imported here: importing a library in the middle of a read
    # maps its shared objects, which fails under the very address-space limit (ulimit -v) that
    # sent the read here instead of to mmap.
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    try:
        if torch is not None:
            return torch.empty(size, dtype=torch.uint8).numpy()
        if np is not None:
            return np.empty(size, dtype=np.uint8)
        return bytearray(size)
    except (RuntimeError, MemoryError, ValueError) as e:
        raise StorageError(errno.ENOMEM, f"cannot allocate {size} bytes to read {file}: {e}; free "
                                         "memory, or raise the process's memory limits (ulimit -v, "
                                         "vm.max_map_count)") from None
