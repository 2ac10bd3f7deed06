"""Step one of a save: a consistent copy of the state in host memory.

:func:`Snapshotter.capture` walks the state tree once, encodes every non-tensor leaf
(see :mod:`unbroken.state.codec`) and collects every tensor as a CPU, contiguous
tensor grouped into files by top-level key. That is all that blocks training; the
slow part, writing, is :mod:`unbroken.checkpoint.persist`. The seam is :class:`Snapshot`.

Copies are made only where needed: GPU tensors (into pinned, reused staging
buffers), non-contiguous tensors, and every tensor when ``copy=True`` (required when
the snapshot is written while training goes on). Buffers are reused from one save
to the next, because first-touch page faults on fresh memory cost more than the
copy itself. Tensors that alias the same memory with the same view are stored once
and come back as one tensor.

**Deferred copies (lazy snapshots).** Tensors whose storage is listed in ``defer`` are
not copied by :meth:`Snapshotter.capture`: their staging buffer is reserved and the copy
is left to :meth:`Snapshot.complete`, which the background writer runs while the next
forward/backward goes on (:mod:`unbroken.checkpoint.background.lazy` holds the next ``optimizer.step()`` until
then). **GPU tensors** are copied on a side stream into pinned buffers: the training
stream waits (on the GPU, the CPU never blocks) only for the eagerly copied tensors, and
for the deferred ones only at the next optimizer step; the writer waits for the copies'
events before reading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedStateError
from ..format.tensorfile import DTYPE_TO_ST, TensorEntry
from ..state.codec import Encoder, PathT, render_path
from .background.shm import SharedArena


@dataclass
class Snapshot:
    """A captured state: the JSON tree, the tensors per file, and the sharded tensors
    (DTensors: every rank holds a piece; they are written by all ranks together through
    :mod:`unbroken.dist.sharded`), by reference name."""

    tree: dict[str, Any]
    files: dict[str, list[TensorEntry]] = field(default_factory=dict)
    sharded: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: list[tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=list)
    """Copies still to make, ``(staging buffer, live tensor, key)``: see :meth:`complete`."""
    events: list[Any] = field(default_factory=list)
    """CUDA events after which the device-to-host copies are in the staging buffers."""
    lazy_events: list[Any] = field(default_factory=list)
    """CUDA events after which the deferred device copies are done (the optimizer step waits)."""
    device_deferred: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    """The live GPU tensors copied after ``lazy_events``, by key (for the version check)."""
    writer: Any = None
    """A :class:`~unbroken.checkpoint.background.filewriter.FileWriter` that writes the tensor files from shared memory
    (a background save whose buffers are in a :class:`~unbroken.checkpoint.background.shm.SharedArena`), or ``None``."""

    def complete(self) -> None:
        """Make the deferred copies and wait for the device copies: afterwards every staging
        buffer holds the state of the save point (unless a deferred tensor was changed
        meanwhile, which :mod:`unbroken.checkpoint.background.lazy` detects). Idempotent."""
        deferred, self.deferred = self.deferred, []
        for dst, src, _ in deferred:
            dst.copy_(src)
        events, self.events = self.events, []
        for ev in events:
            ev.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(e.tensor.numel() * e.tensor.element_size() for es in self.files.values() for e in es)


def _file_for(index: int, top: Any, prefix: str = "") -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", str(top))[:40].strip("_") or "x"
    return f"{prefix}t{index:02d}-{stem}.safetensors"


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies a tensor's memory (its storage), shared by every view and ``detach()``; a
    DTensor's, its local shard's (a DTensor has no storage of its own)."""
    if type(t) is not torch.Tensor and hasattr(t, "to_local"):
        t = t.to_local()
    return str(t.device), t.untyped_storage().data_ptr()


class _Sink:
    def __init__(self, pool: dict[str, torch.Tensor], copy: bool, prefix: str = "",
                 defer: frozenset[tuple[str, int]] = frozenset(), arena: SharedArena | None = None) -> None:
        self.pool = pool
        self.arena = arena
        self.copy = copy
        self.prefix = prefix
        self.defer = defer
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        self.cuda_eager: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_lazy: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_lazy_keys: list[str] = []
        self.files: dict[str, list[TensorEntry]] = {}
        self.sharded: dict[str, torch.Tensor] = {}
        self._file_of_top: dict[Any, str] = {}
        self._keys: set[str] = set()
        self._aliases: dict[tuple, dict[str, Any]] = {}

    def add(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        t = tensor.detach()
        alias = None
        if t.numel() and t.device.type != "meta":
            alias = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape),
                     t.stride(), t.dtype)
            if alias in self._aliases:
                return self._aliases[alias]
        ref: dict[str, Any] = {}
        if t.is_complex():
            t = torch.view_as_real(t)
            ref["complex"] = True
        if t.dtype not in DTYPE_TO_ST:
            raise UnsupportedStateError(f"{render_path(path)} has dtype {t.dtype}, which cannot be saved.")
        top = path[0] if path else "root"
        if top not in self._file_of_top:
            self._file_of_top[top] = _file_for(len(self._file_of_top), top, self.prefix)
        fname = self._file_of_top[top]
        key = "/".join(str(p) for p in path) or "root"
        base, n = key, 1
        while key in self._keys:
            n += 1
            key = f"{base}~{n}"
        self._keys.add(key)
        self.files.setdefault(fname, []).append(TensorEntry(key, self._host(t, fname + ":" + key)))
        ref.update(file=fname, key=key)
        if alias is not None:
            self._aliases[alias] = ref
        return ref

    def add_sharded(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        fqn = "/".join(str(p) for p in path) or "root"
        if fqn in self.sharded:
            raise UnsupportedStateError(f"{render_path(path)}: two sharded tensors with one name {fqn!r}")
        self.sharded[fqn] = tensor.detach()
        return {"fqn": fqn, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}

    def _host(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        deferred = bool(self.defer) and t.numel() > 0 and storage_key(t) in self.defer
        if t.device.type == "cpu" and t.is_contiguous() and not self.copy and not deferred:
            return t
        buf = self.pool.get(slot)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if self.arena is not None:  # registered with CUDA when the arena pins
                buf = self.arena.empty(t.shape, t.dtype)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            self.pool[slot] = buf
        if t.device.type == "cuda":
            (self.cuda_lazy if deferred else self.cuda_eager).append((buf, t))
            if deferred:
                self.cuda_lazy_keys.append(slot)
        elif deferred:
            self.deferred.append((buf, t, slot))
        else:
            buf.copy_(t)
        return buf

    def copy_from_devices(self, snap: Snapshot) -> None:
        """Queue the device-to-host copies on a side stream: eager ones first (the training
        stream waits for them, on the GPU, when the snapshot must survive training going on),
        then the deferred ones (waited for at the next optimizer step)."""
        if not (self.cuda_eager or self.cuda_lazy):
            return
        device = (self.cuda_eager or self.cuda_lazy)[0][1].device
        main, side = torch.cuda.current_stream(device), _side_stream(device)
        side.wait_stream(main)  # the copies see everything queued before the save point
        with torch.cuda.stream(side):
            for group, events in ((self.cuda_eager, snap.events), (self.cuda_lazy, snap.lazy_events)):
                if not group:
                    continue
                for buf, t in group:
                    if t.device != device:
                        raise UnsupportedStateError("a state on several GPUs of one process is not supported")
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(side)  # the allocator must not reuse t's memory before the copy
                ev = torch.cuda.Event()
                ev.record(side)
                events.append(ev)
        if snap.lazy_events:
            snap.events.extend(snap.lazy_events)
            snap.device_deferred = [(t, key) for (_, t), key in zip(self.cuda_lazy, self.cuda_lazy_keys, strict=True)]
        if self.copy and self.cuda_eager:
            main.wait_event(snap.events[0])  # training may change these right after the save point


_SIDE: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class Snapshotter:
    """Captures states into host memory, reusing its staging buffers across saves.

    With ``copy=False`` (synchronous saving) contiguous CPU tensors are not copied:
    the writer reads them in place while training waits. With ``copy=True`` every
    tensor is copied so training may modify the originals while the snapshot is
    being written; with an ``arena`` too, the copies are in shared memory
    (:mod:`unbroken.checkpoint.background.shm`), where a writer process can read them.
    """

    def __init__(self, copy: bool = False, arena: SharedArena | None = None) -> None:
        if arena is not None and not copy:
            raise ValueError("staging in shared memory needs a copying Snapshotter (copy=True)")
        self.copy = copy
        self.arena = arena
        self._checked = 0  # the arena's size when its waste was last checked
        self._pool: dict[str, torch.Tensor] = {}

    def capture(self, state: Mapping[str, Any], prefix: str = "",
                defer: frozenset[tuple[str, int]] = frozenset()) -> Snapshot:
        """Encode ``state``; tensor files are named ``<prefix>tNN-<key>.safetensors``.

        Tensors whose :func:`storage_key` is in ``defer`` get a staging buffer but are
        copied only by :meth:`Snapshot.complete` (lazy snapshots; needs ``copy=True``)."""
        if defer and not self.copy:
            raise ValueError("deferred copies need a copying Snapshotter (copy=True)")
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"the state must be a dict of named parts, got {type(state).__name__}")
        for k in state:
            if not isinstance(k, str):
                raise UnsupportedStateError(f"top-level state keys must be strings, got {k!r}")
        if self.arena is not None and self.arena.size > self._checked:  # it grew: were buffers abandoned?
            self._checked = self.arena.size
            if self.arena.wasteful(sum(b.numel() * b.element_size() for b in self._pool.values())):
                self._pool.clear()  # the state's shapes changed: start the arena over rather than grow it
                self.arena.reset()
                self._checked = 0
        sink = _Sink(self._pool, self.copy, prefix, defer, self.arena)
        encoder = Encoder(sink)
        tree = {TOP: {k: encoder.encode(v, (k,)) for k, v in state.items()}}
        snap = Snapshot(tree=tree, files=sink.files, sharded=sink.sharded, deferred=sink.deferred)
        sink.copy_from_devices(snap)
        return snap


TOP = "state"
