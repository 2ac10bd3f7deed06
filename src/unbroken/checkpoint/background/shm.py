"""Staging buffers in shared memory, which the writer process of background saves maps too.

A :class:`SharedArena` hands out tensors carved from a few large ``memfd`` segments (anonymous
shared memory: nothing appears in ``/dev/shm``, and the memory is freed when the training process
and its writer are both gone, however they end). The :class:`~unbroken.checkpoint.snapshot.Snapshotter` of a
background save copies the state into these buffers; :mod:`unbroken.checkpoint.background.filewriter` passes a
segment's descriptor to the writer process once, and from then on describes each tensor to write
by ``(segment, offset, size)``. Buffers are reused from save to save like the private ones (fresh
pages cost more than the copy). When buffers stop matching the state (shapes changed) and more
than half of the arena is abandoned, :meth:`SharedArena.reset` lets the next capture start over.

With CUDA, each segment is registered with the driver (``cudaHostRegister``), so device-to-host
copies into it are asynchronous like copies into ``pin_memory`` buffers.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("unbroken")
ALIGN = 64
MIN_SEGMENT = 64 << 20
_PAGE = mmap.PAGESIZE
_IDS = itertools.count()  # segment ids, unique in the process (one writer maps several arenas)


@dataclass
class Segment:
    """One memfd mapping: its id (unique in its arena), descriptor, size and base address."""

    id: int
    fd: int
    size: int
    base: torch.Tensor  # uint8 view of the whole mapping (keeps it alive)
    used: int = 0

    @property
    def address(self) -> int:
        return self.base.data_ptr()


class SharedArena:
    """Tensors in shared memory, allocated by bumping a pointer through growing segments.

    ``pin=True`` registers each segment with CUDA (page-locked, for asynchronous copies)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.segments: list[Segment] = []
        self.dropped: list[int] = []  # ids of segments given up, for the writer to unmap

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` in shared memory."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)  # nothing to share: no bytes are written
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.used + nbytes > seg.size:
            seg = self._grow(nbytes)
        start = seg.used
        seg.used = start + -(-nbytes // ALIGN) * ALIGN
        return seg.base[start:start + nbytes].view(dtype).view(shape)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(segment id, offset)`` of a tensor's first byte, or ``None`` if it is not in the arena."""
        ptr = t.data_ptr()
        for s in self.segments:
            if s.address <= ptr < s.address + s.size:
                return s.id, ptr - s.address
        return None

    def wasteful(self, live: int) -> bool:
        """Whether, with ``live`` bytes of buffers still in use, more than half of the arena (and
        over one segment's worth) is abandoned buffers."""
        waste = self.size - live
        return waste > MIN_SEGMENT and waste > live

    def reset(self) -> None:
        """Forget every segment (the tensors handed out keep their memory until they are dropped too)."""
        for s in self.segments:
            self.dropped.append(s.id)
            self._unpin(s)
            os.close(s.fd)
        self.segments = []

    def close(self) -> None:
        self.reset()
        self.dropped.clear()

    def _grow(self, need: int) -> Segment:
        size = max(need, MIN_SEGMENT, self.size)
        size = -(-size // _PAGE) * _PAGE
        fd = os.memfd_create("unbroken-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            base = torch.frombuffer(mm, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        seg = Segment(next(_IDS), fd, size, base)
        if self.pin and torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(seg.address, size, 0)
            if int(err) != 0:  # a locked-memory limit (containers): correct, but device copies wait
                log.warning("could not page-lock %d MB of staging memory for CUDA (%s): device-to-host copies "
                            "of background saves will not overlap training", size >> 20, err)
                self.pin = False
        self.segments.append(seg)
        return seg

    def _unpin(self, seg: Segment) -> None:
        if self.pin and torch.cuda.is_available():  # (pin is off if registering ever failed)
            torch.cuda.cudart().cudaHostUnregister(seg.address)
