"""Copying loaded tensors into the live state: ``memcpy`` in pieces, not torch's split copies.

A restore moves every byte of a checkpoint once more after it was read and verified: into a
module's parameters, into an optimizer's existing state, or into fresh memory for state an
object keeps (:func:`unbroken.state.apply._own`). ``Tensor.copy_`` and ``clone`` split such a
copy over torch's intra-op threads, and on a busy machine (other processes on the cores) the
copy waits for its slowest thread: measured on 2 cores with 3-8 other busy processes, a
restore's copies took 4-20 × as long as on an idle machine, while ``torch.load`` (whose copies
are ``read`` calls in one thread) slowed down little (``benchmarks/bench_restore.py``). Here a
restore's copies are queued (:class:`Copies`) and done as ``memcpy`` of 4 MiB pieces that two
threads take one at a time: as fast as torch's on an idle machine, and a thread held up by a
busy core delays one piece only. New memory is mapped in one call per piece before it is
written (:func:`_prefault`). Everything else (other devices, layouts, subclasses, small tensors) goes through
torch as before. The bytes copied are the same either way: a ``memcpy`` of equal dtypes and
shapes is what ``copy_`` does, and autograd's version counter is bumped as by ``copy_``.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

DIRECT_MIN_BYTES = 64 * 1024
"""Tensors at least this large are copied with ``memcpy`` (smaller ones through torch)."""
PIECE = 4 * 1024 * 1024
"""Bytes copied at a time by one thread (:class:`Copies`)."""
PARALLEL_MIN_BYTES = 16 * 1024 * 1024
MAX_THREADS = 2
PREFAULT_MIN_BYTES = 1024 * 1024
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23
_madvise: Any = None


def _plain(t: torch.Tensor) -> bool:
    """A dense CPU tensor of its own class whose bytes are one contiguous run of memory."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and \
        not t.is_quantized and not t.is_conj() and not t.is_neg() and t.is_contiguous()


def _direct(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst`` can take ``src``'s bytes with one ``memcpy``: both plain, same dtype and shape,
    large enough to matter, ``dst`` writable outside inference mode, and not sharing memory."""
    if not _plain(dst) or not _plain(src) or dst.dtype != src.dtype or dst.shape != src.shape or \
            dst.is_inference():
        return False
    n = src.numel() * src.element_size()
    if n < DIRECT_MIN_BYTES:
        return False
    a, b = dst.data_ptr(), src.data_ptr()
    return a + n <= b or b + n <= a


class Copies:
    """Copies queued, then done together by :meth:`run`: large ones cut in pieces of
    :data:`PIECE` bytes that up to ``torch.get_num_threads()`` threads (2 at most) take one after
    the other, so a thread that a busy core holds up delays one piece, not half of the work (as
    a ``copy_`` split evenly over torch's threads does). Everything :func:`_direct` refuses is
    copied by torch at once. Until :meth:`run` returns, a queued destination holds garbage."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, int, int, bool]] = []  # (dst address, src address, bytes, fresh memory)
        self.keep: list[torch.Tensor] = []  # the tensors whose memory the pieces point into
        self.written: list[torch.Tensor] = []

    def _queue(self, dst: torch.Tensor, src: torch.Tensor, fresh: bool) -> None:
        n, a, b = src.numel() * src.element_size(), dst.data_ptr(), src.data_ptr()
        self.pieces += [(a + i, b + i, min(PIECE, n - i), fresh) for i in range(0, n, PIECE)]
        self.keep += [dst, src]

    def into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` without autograd recording it, queued where :func:`_direct` allows."""
        with torch.no_grad():
            if _direct(dst, src):
                self._queue(dst, src, fresh=False)
                self.written.append(dst)
            else:
                dst.copy_(src)

    def fresh(self, t: torch.Tensor) -> torch.Tensor:
        """``t.clone()`` (contiguous): new memory, its copy queued where it can be."""
        if t.requires_grad or not _plain(t) or t.numel() * t.element_size() < DIRECT_MIN_BYTES:
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype)
        self._queue(out, t, fresh=True)
        return out

    def run(self) -> None:
        """Do every queued copy; then bump the version counter of each tensor written in place
        (``copy_`` onto its own memory copies nothing and counts as a write, as ``copy_`` would)."""
        pieces, self.pieces = self.pieces, []
        workers = min(MAX_THREADS, torch.get_num_threads(), len(pieces))
        if workers > 1 and sum(p[2] for p in pieces) >= PARALLEL_MIN_BYTES:
            with ThreadPoolExecutor(workers, thread_name_prefix="unbroken-copy") as pool:
                list(pool.map(_copy_piece, pieces))  # memmove releases the GIL
        else:
            for piece in pieces:
                _copy_piece(piece)
        with torch.no_grad():
            for t in self.written:
                t.copy_(t)
        self.keep, self.written = [], []


def _copy_piece(piece: tuple[int, int, int, bool]) -> None:
    dst, src, n, fresh = piece
    if fresh:
        _prefault(dst, n)
    ctypes.memmove(dst, src, n)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without autograd recording it (``torch.no_grad``), through :class:`Copies`."""
    copies = Copies()
    copies.into(dst, src)
    copies.run()


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` (contiguous), through :class:`Copies`."""
    copies = Copies()
    out = copies.fresh(t)
    copies.run()
    return out


def _prefault(ptr: int, n: int) -> None:
    """Map the fresh memory at ``ptr`` in one call (``MADV_POPULATE_WRITE``, Linux 5.14+) instead
    of one page fault per 4 KiB during the copy: about 10-15 % less CPU time for the copy here.
    Advice only: where the call does not exist or fails, the copy faults the pages in itself."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    if _madvise and n >= PREFAULT_MIN_BYTES:
        start, end = -(-ptr // PAGE) * PAGE, (ptr + n) // PAGE * PAGE  # whole pages inside the tensor only
        if end > start and _madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            _madvise = False  # an older kernel (EINVAL): not asked again


_LOADERS = {torch.nn.Module._load_from_state_dict, torch.nn.modules.batchnorm._NormBase._load_from_state_dict}
"""``_load_from_state_dict`` methods that copy each saved tensor into the parameter or buffer of
the same name (batch norm's only fills in a missing ``num_batches_tracked`` first)."""


def _loads_as_is(m: torch.nn.Module) -> bool:
    """``m`` has no hooks that change what its ``state_dict`` holds or what ``load_state_dict``
    is given (FSDP gathers and scatters its state there; a pre-hook may rename or drop keys), and
    a ``_load_from_state_dict`` of :data:`_LOADERS`: each saved tensor would be copied as it is."""
    return not any(getattr(m, name, None) for name in ("_state_dict_hooks", "_state_dict_pre_hooks",
                                                       "_load_state_dict_pre_hooks")) and \
        getattr(type(m)._load_from_state_dict, "__func__", type(m)._load_from_state_dict) in _LOADERS


def into_module(live: torch.nn.Module, saved: dict[str, object]) -> dict[str, object]:
    """Copy the saved tensors of a module into its parameters and buffers in one thread each
    (:func:`copy_into`) and return ``saved`` with each tensor so copied replaced by the live
    tensor's own detached view: ``load_state_dict`` then runs as always (its hooks, its checks),
    and its ``copy_`` of a tensor onto the same memory copies nothing. Only plain CPU tensors
    of the same shape and dtype are copied here; anything else is left to ``load_state_dict``,
    and so is a whole module that might not load a saved value as it is (:func:`_loads_as_is`)."""
    if not all(_loads_as_is(m) for m in live.modules()):
        return saved
    current = live.state_dict()
    out = dict(saved)
    copies = Copies()
    for key, src in saved.items():
        dst = current.get(key)
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and _direct(dst, src):
            copies.into(dst, src)
            out[key] = dst
    copies.run()
    return out
