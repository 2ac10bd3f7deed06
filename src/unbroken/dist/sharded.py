"""Sharded tensors (DTensor, FSDP2 ``fully_shard``) through ``torch.distributed.checkpoint``.

DCP's planners decide who writes which piece (replicated shards once) and, at load,
which saved pieces every rank needs for *its* sharding: that is what makes a run saved
by 2 ranks resumable by 1 or 4. Only the storage is ours:

- :class:`ShardWriter` writes each rank's pieces into one safetensors file
  ``s<rank>.safetensors`` of the checkpoint being staged, checksummed like every other
  file, and the coordinator writes DCP's metadata as JSON (``sharded.json``) — DCP's own
  ``.metadata`` is a pickle, which unbroken never writes or reads.
- :class:`ShardReader` serves DCP's read requests from those files, each read and
  verified once, narrowed to the requested region and copied into the live shard.

Without live shards to load into (``unbroken.load(path)``, a plain model on one
process), :func:`assemble` rebuilds full tensors from the saved pieces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..errors import CorruptCheckpointError, UnsupportedStateError
from ..format.manifest import strict_object
from ..format.tensorfile import DTYPE_TO_ST, ST_TO_DTYPE, TensorEntry

SHARDED_FILE = "sharded.json"
MAX_DIMS = 64


def shard_file(rank: int) -> str:
    return f"s{rank:05d}.safetensors"


# --------------------------------------------------------------------- metadata JSON
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def encode_metadata(md: Metadata) -> bytes:
    tensors = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise UnsupportedStateError(f"sharded state {fqn!r} is not a tensor")
        tensors[fqn] = {"dtype": DTYPE_TO_ST[meta.properties.dtype], "size": list(meta.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in meta.chunks]}
    storage = [{"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None, **info}
               for idx, info in (md.storage_data or {}).items()]
    return json.dumps({"tensors": tensors, "storage": storage}, indent=1).encode()


def _ints(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or len(x) > MAX_DIMS or not all(type(v) is int and 0 <= v < 1 << 62 for v in x):
        raise CorruptCheckpointError(f"{SHARDED_FILE}: bad {what} {str(x)[:80]}")
    return x


def decode_metadata(raw: bytes, files: set[str]) -> Metadata:
    """Parse ``sharded.json`` strictly (it comes from disk): every field checked."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=strict_object, parse_constant=_no_constant)
        tensors: dict[str, Any] = {}
        for fqn, t in doc["tensors"].items():
            dtype = ST_TO_DTYPE[t["dtype"]]
            size = _ints(t["size"], "size")
            chunks = []
            for c in t["chunks"]:
                off, sz = _ints(c["offsets"], "offsets"), _ints(c["sizes"], "sizes")
                if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                    raise CorruptCheckpointError(f"{SHARDED_FILE}: chunk {c} outside {fqn} {size}")
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
            tensors[str(fqn)] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)
        storage = {}
        for s in doc["storage"]:
            if s["file"] not in files:
                raise CorruptCheckpointError(f"{SHARDED_FILE} refers to unlisted file {s['file']!r}")
            offset = None if s["offset"] is None else torch.Size(_ints(s["offset"], "offset"))
            storage[MetadataIndex(str(s["fqn"]), offset)] = {"file": s["file"], "key": str(s["key"])}
    except CorruptCheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{SHARDED_FILE} is malformed ({type(e).__name__}: {e})") from None
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


# ------------------------------------------------------------------------- writing
class ShardWriter(StorageWriter):
    """DCP storage writer into a staged unbroken checkpoint (see the module docstring).

    ``write_file(name, entries) -> None`` writes one tensor file (checksummed by the caller).
    """

    def __init__(self, rank: int, write_file: Callable[[str, list[TensorEntry]], None]) -> None:
        super().__init__()
        self.rank, self.write_file = rank, write_file
        self.metadata: bytes | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        fname, entries, results = shard_file(self.rank), [], []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise UnsupportedStateError(f"sharded state {item.index.fqn!r} is not a tensor")
            t = data.detach().to("cpu").contiguous()
            key = f"{i}"
            entries.append(TensorEntry(key, t))
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": fname, "key": key}))
        if entries:
            self.write_file(fname, entries)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        self.metadata = encode_metadata(metadata)

    def storage_meta(self) -> Any:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def save_sharded(sharded: dict[str, torch.Tensor], rank: int, group: Any,
                 write_file: Callable[[str, list[TensorEntry]], None]) -> bytes | None:
    """Write this rank's pieces of ``sharded`` (a collective: every rank calls it); the
    coordinator gets the metadata JSON to store as ``sharded.json``."""
    import torch.distributed.checkpoint as dcp
    from .flatshard import SavePlanner as Planner

    writer = ShardWriter(rank, write_file)
    dcp.save(sharded, storage_writer=writer, planner=Planner(), process_group=group,
             no_dist=group is None)
    return writer.metadata


# ------------------------------------------------------------------------- reading
class ShardReader(StorageReader):
    """DCP storage reader over a verified unbroken checkpoint.

    ``tensors(file) -> {key: tensor}`` reads and verifies one file (once; the caller caches).
    """

    def __init__(self, metadata: Metadata, tensors: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
        super().__init__()
        self.metadata, self.tensors = metadata, tensors

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in plan.items:
            info = self.metadata.storage_data.get(item.storage_index)
            if info is None:
                raise CorruptCheckpointError(f"{SHARDED_FILE}: no stored piece for {item.storage_index}")
            src = self.tensors(info["file"]).get(info["key"])
            if src is None:
                raise CorruptCheckpointError(f"{info['file']} has no tensor {info['key']!r}")
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(item)
            if target.shape != src.shape:
                raise CorruptCheckpointError(f"{SHARDED_FILE}: piece of {item.dest_index.fqn} has shape "
                                             f"{tuple(src.shape)}, expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(src)
            planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def load_sharded(targets: dict[str, torch.Tensor], metadata: Metadata, group: Any,
                 tensors: Callable[[str], Mapping[str, torch.Tensor]]) -> None:
    """Fill ``targets`` (this rank's live DTensors, or plain full tensors) in place from the
    saved pieces, whatever the sharding they were saved with (a collective)."""
    import torch.distributed.checkpoint as dcp
    from .flatshard import LoadPlanner as Planner

    dcp.load(targets, storage_reader=ShardReader(metadata, tensors), planner=Planner(),
             process_group=group, no_dist=group is None)


def assemble(fqn: str, metadata: Metadata, tensors: Callable[[str], Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """The full tensor ``fqn`` from its saved pieces (no live shard to load into)."""
    meta = metadata.state_dict_metadata.get(fqn)
    if not isinstance(meta, TensorStorageMetadata):
        raise CorruptCheckpointError(f"{SHARDED_FILE} has no tensor {fqn!r}")
    out = torch.empty(meta.size, dtype=meta.properties.dtype)
    covered = torch.zeros(meta.size, dtype=torch.int8)  # every element exactly once: no garbage left
    for chunk in meta.chunks:
        info = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            raise CorruptCheckpointError(f"{SHARDED_FILE}: no stored piece of {fqn} at {list(chunk.offsets)}")
        src = tensors(info["file"]).get(info["key"])
        if src is None or tuple(src.shape) != tuple(chunk.sizes) or src.dtype != out.dtype:
            raise CorruptCheckpointError(f"{info['file']}: piece {info['key']!r} of {fqn} does not match")
        region, mark = out, covered
        for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region, mark = region.narrow(dim, off, size), mark.narrow(dim, off, size)
        region.copy_(src)
        mark += 1
    if covered.numel() and not bool((covered == 1).all()):
        raise CorruptCheckpointError(f"{SHARDED_FILE}: the pieces of {fqn} overlap or leave holes")
    return out
