"""Step one of a save: a consistent copy of the state in host memory.

:func:`Snapshotter.capture` walks the state tree once, encodes every non-tensor leaf
(see :mod:`unbroken.state.codec`) and collects every tensor as a CPU, contiguous
tensor grouped into files by top-level key. That is all that blocks training; the
slow part, writing, is :mod:`unbroken.persist`. The seam is :class:`Snapshot`.

Copies are made only where needed: GPU tensors (into pinned, reused staging
buffers), non-contiguous tensors, and every tensor when ``copy=True`` (required when
the snapshot is written while training goes on). Buffers are reused from one save
to the next, because first-touch page faults on fresh memory cost more than the
copy itself. Tensors that alias the same memory with the same view are stored once
and come back as one tensor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UnsupportedStateError
from .format.tensorfile import DTYPE_TO_ST, TensorEntry
from .state.codec import Encoder, PathT, render_path


@dataclass
class Snapshot:
    """A captured state: the JSON tree, the tensors per file, and the sharded tensors
    (DTensors: every rank holds a piece; they are written by all ranks together through
    :mod:`unbroken.dist.sharded`), by reference name."""

    tree: dict[str, Any]
    files: dict[str, list[TensorEntry]] = field(default_factory=dict)
    sharded: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.tensor.numel() * e.tensor.element_size() for es in self.files.values() for e in es)


def _file_for(index: int, top: Any, prefix: str = "") -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", str(top))[:40].strip("_") or "x"
    return f"{prefix}t{index:02d}-{stem}.safetensors"


class _Sink:
    def __init__(self, pool: dict[str, torch.Tensor], copy: bool, prefix: str = "") -> None:
        self.pool = pool
        self.copy = copy
        self.prefix = prefix
        self.files: dict[str, list[TensorEntry]] = {}
        self.sharded: dict[str, torch.Tensor] = {}
        self._file_of_top: dict[Any, str] = {}
        self._keys: set[str] = set()
        self._aliases: dict[tuple, dict[str, Any]] = {}
        self.used_cuda = False

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
        if t.device.type == "cpu" and t.is_contiguous() and not self.copy:
            return t
        buf = self.pool.get(slot)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self.pool[slot] = buf
        if t.device.type == "cuda":
            self.used_cuda = True
            buf.copy_(t, non_blocking=True)
        else:
            buf.copy_(t)
        return buf


class Snapshotter:
    """Captures states into host memory, reusing its staging buffers across saves.

    With ``copy=False`` (synchronous saving) contiguous CPU tensors are not copied:
    the writer reads them in place while training waits. With ``copy=True`` every
    tensor is copied so training may modify the originals while the snapshot is
    being written.
    """

    def __init__(self, copy: bool = False) -> None:
        self.copy = copy
        self._pool: dict[str, torch.Tensor] = {}

    def capture(self, state: Mapping[str, Any], prefix: str = "") -> Snapshot:
        """Encode ``state``; tensor files are named ``<prefix>tNN-<key>.safetensors``."""
        if not isinstance(state, Mapping):
            raise UnsupportedStateError(f"the state must be a dict of named parts, got {type(state).__name__}")
        for k in state:
            if not isinstance(k, str):
                raise UnsupportedStateError(f"top-level state keys must be strings, got {k!r}")
        sink = _Sink(self._pool, self.copy, prefix)
        encoder = Encoder(sink)
        tree = {TOP: {k: encoder.encode(v, (k,)) for k, v in state.items()}}
        if sink.used_cuda:
            torch.cuda.synchronize()
        return Snapshot(tree=tree, files=sink.files, sharded=sink.sharded)


TOP = "state"
