"""Reading a checkpoint: verify every byte, then decode, never unpickle.

Each file is read once into memory, its size and xxh3-128 checksum are compared with
the manifest, and only those verified bytes are parsed, so what was checked is exactly
what is loaded. Nothing outside the manifest's list is opened. Any defect raises
:class:`~unbroken.errors.CorruptCheckpointError` before a single value reaches the live
training state.

A checkpoint deleted or moved while it is read (pruned by the retention of the process that
writes the run) is not damaged: when a read fails, :func:`vanished` looks again whether the
checkpoint is still committed, and a gone one raises
:class:`~unbroken.errors.CheckpointVanishedError` instead, which nothing reports as corrupt or
quarantines.

A checkpoint of several ranks (format 2) holds ``state.json`` (what all ranks share),
``rank-<r>.json`` per rank (its RNG and per-rank objects) and, for sharded tensors,
``sharded.json`` plus ``s<r>.safetensors`` per writing rank. :func:`read_checkpoint`
decodes the shared tree and this rank's part; sharded tensors stay :class:`ShardedRef`
placeholders until they are loaded into live shards (:mod:`unbroken.dist.sharded`) or
assembled into full tensors (:meth:`LoadedCheckpoint.materialize`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .._support import progress
from ..errors import CheckpointVanishedError, CorruptCheckpointError
from ..format import chunkmap
from ..format.manifest import STATE_FILE, Manifest, is_chunk, new_hasher, strict_object
from ..format.tensorfile import load_tensor_file
from ..state.codec import StatefulValue
from ..state.decoder import Decoder
from ..store.base import Store as Storage
from .manifests import read_manifest, vanished
from .snapshot import TOP


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass(frozen=True)
class ShardedRef:
    """A sharded tensor in a decoded tree, not loaded yet."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str


def failure(storage: Storage, name: str, e: BaseException, manifest: Manifest | None = None) -> CorruptCheckpointError:
    """The error for a failed read of checkpoint ``name``: :class:`CheckpointVanishedError` if it
    is gone (see :func:`vanished`; ``manifest``: the one read before the failure), else
    :class:`CorruptCheckpointError`, both naming the checkpoint."""
    if isinstance(e, CheckpointVanishedError):
        return e
    where = storage.describe(name)
    if vanished(storage, name, manifest.seq if manifest is not None else None):
        return CheckpointVanishedError(f"{where} was deleted or moved while it was being read (pruned by the "
                                       f"retention of the process writing the run?); it is not damaged ({e})")
    return CorruptCheckpointError(f"{where}: {e}")


def readers() -> int:
    """Large files of one checkpoint read (and hashed) at the same time, ``UNBROKEN_READERS`` (default 2),
    read at each load, not at import."""
    return int(os.environ.get("UNBROKEN_READERS", "2"))
PARALLEL_MIN = 16 * 1024 * 1024


class _Counted:
    """A hasher that also counts the bytes on the progress bar."""

    def __init__(self, hasher: Any) -> None:
        self.hasher = hasher

    def update(self, data: Any) -> None:
        self.hasher.update(data)
        progress.advance(memoryview(data).nbytes)


class CheckpointFiles:
    """The verified files of one checkpoint: each read, checked and parsed at most once."""

    def __init__(self, storage: Storage, name: str, manifest: Manifest) -> None:
        self.storage, self.name, self.manifest = storage, name, manifest
        self._bytes: dict[str, Any] = {}
        self._tensors: dict[str, Mapping[str, torch.Tensor]] = {}
        self._chunks_used: set[str] = set()
        self.check_ids = False
        """Also check that each chunk's SHA-256 is its id (``unbroken verify``; a restore checks
        the xxh3 checksum only)."""
        self.repair: Any = None
        """A :class:`unbroken.checkpoint.chunks.LiveChunks` (at restore): a damaged or missing chunk whose bytes
        the live state still holds is rewritten from them, and read again."""

    def read(self, fname: str) -> Any:
        """The bytes of ``fname``, verified against the manifest."""
        if fname not in self._bytes:
            entry = self.manifest.files.get(fname)
            if entry is None:
                raise CorruptCheckpointError(f"reference to unlisted file {fname!r}")
            if is_chunk(fname):  # a chunk of an incremental checkpoint, in the run's chunks/
                try:
                    buf = self._chunk(fname[1:], entry)
                except CorruptCheckpointError as e:
                    if self.repair is None or not self.repair.repair(fname[1:], entry, str(e)):
                        raise
                    buf = self._chunk(fname[1:], entry)  # read back and verified like any chunk
            else:
                h = new_hasher()
                buf = self.storage.read(self.name, fname, entry.size, _Counted(h))  # hashed as it streams in
                if h.hexdigest() != entry.xxh3_128:
                    raise CorruptCheckpointError(f"{fname}: checksum mismatch (the file was altered or damaged)")
            self._bytes[fname] = buf
        return self._bytes[fname]

    def _chunk(self, cid: str, entry: Any) -> Any:
        """The verified bytes of chunk ``cid`` from the run's chunk store."""
        h = new_hasher()
        try:
            buf = self.storage.read_chunk(cid, entry.size, _Counted(h))
        except CorruptCheckpointError as e:
            if "missing" in str(e):
                raise
            raise CorruptCheckpointError(f"chunk {cid}: damaged ({e})") from None
        if self.check_ids and hashlib.sha256(buf).hexdigest() != cid:
            raise CorruptCheckpointError(f"chunk {cid}: damaged (its bytes do not have the SHA-256 it is named by)")
        if h.hexdigest() != entry.xxh3_128:
            raise CorruptCheckpointError(f"chunk {cid}: checksum mismatch (the chunk was altered or damaged; "
                                         "every checkpoint that uses it is invalid)")
        return buf

    def verify(self, fnames: Iterable[str]) -> None:
        todo = [f for f in fnames if f not in self._bytes]
        total = sum(e.size for f in todo if (e := self.manifest.files.get(f)) is not None)
        big = [f for f in todo if (e := self.manifest.files.get(f)) is not None and e.size >= PARALLEL_MIN]
        with progress.task(f"reading {self.name}", total):
            if len(big) > 1 and readers() > 1:  # large files in parallel: one reads while another hashes
                with ThreadPoolExecutor(min(readers(), len(big)), thread_name_prefix="unbroken-read") as pool:
                    for f in [pool.submit(self.read, fname) for fname in big]:
                        f.result()
            for fname in todo:
                self.read(fname)

    def has_tensor_file(self, fname: str) -> bool:
        """True if ``fname`` is a tensor file of this checkpoint (written, or a chunk map)."""
        return fname in self.manifest.files or chunkmap.map_name(fname) in self.manifest.files

    def logical_files(self) -> set[str]:
        """The names the checkpoint's trees may refer to: its files, and the tensor file each
        chunk map stands for."""
        names = {f for f in self.manifest.files if not is_chunk(f)}
        return names | {chunkmap.tensor_file_of(f) for f in names if f.endswith(chunkmap.SUFFIX)}

    def tensors(self, fname: str) -> Mapping[str, torch.Tensor]:
        if not fname.endswith(".safetensors"):
            raise CorruptCheckpointError(f"tensor reference to non-tensor file {fname!r}")
        if fname not in self._tensors:
            if fname in self.manifest.files:
                self._tensors[fname] = load_tensor_file(self.read(fname), fname)
            else:
                self._tensors[fname] = self._chunked(fname)
        return self._tensors[fname]

    def _chunked(self, fname: str) -> dict[str, torch.Tensor]:
        """The tensors of an incremental checkpoint's tensor file, from its chunk map. A chunk
        used by two tensors (equal bytes) gives each its own memory."""
        mname = chunkmap.map_name(fname)
        if mname not in self.manifest.files:
            raise CorruptCheckpointError(f"tensor reference to unlisted file {fname!r}")
        table = chunkmap.decode(self.read(mname), mname, self.manifest.files)
        out: dict[str, torch.Tensor] = {}
        for key, (dtype, shape, cid) in table.items():
            t = chunkmap.tensor_of(self.read("@" + cid), dtype, shape)
            if cid in self._chunks_used:
                t = t.clone()
            self._chunks_used.add(cid)
            out[key] = t
        return out

    def json(self, fname: str) -> Any:
        try:
            return json.loads(bytes(self.read(fname)).decode("utf-8"), object_pairs_hook=strict_object)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{fname} does not parse ({type(e).__name__})") from None

    def decode(self, fname: str) -> dict[str, Any]:
        """Decode a state tree file (``state.json``, ``rank-<r>.json``)."""
        tree = self.json(fname)
        if not isinstance(tree, dict) or not isinstance(tree.get(TOP), dict):
            raise CorruptCheckpointError(f"{fname} has no state")
        complex_views: dict[tuple[str, str], torch.Tensor] = {}

        def resolve(ref: dict[str, Any]) -> torch.Tensor:
            fname, key = ref["file"], ref["key"]
            if not isinstance(fname, str) or not self.has_tensor_file(fname):
                raise CorruptCheckpointError(f"tensor reference to unlisted file {fname!r}")
            tensors = self.tensors(fname)
            if key not in tensors:
                raise CorruptCheckpointError(f"{fname} has no tensor {key!r}")
            t = tensors[key]
            if not ref.get("complex"):
                return t
            ckey = (fname, key)  # one complex view per stored tensor: shared references stay one object
            if ckey not in complex_views:
                complex_views[ckey] = torch.view_as_complex(t)
            return complex_views[ckey]

        def sharded(ref: dict[str, Any]) -> ShardedRef:
            shape = ref.get("shape")
            if not isinstance(ref.get("fqn"), str) or not isinstance(shape, list) or \
                    not all(type(d) is int and d >= 0 for d in shape):
                raise CorruptCheckpointError(f"{fname}: malformed sharded tensor reference")
            return ShardedRef(ref["fqn"], tuple(shape), str(ref.get("dtype")))

        return Decoder(resolve, sharded).decode({"@": "dict", "v": tree[TOP]})


@dataclass
class LoadedCheckpoint:
    """A verified, decoded checkpoint: its manifest, the shared state tree, this rank's part
    (``None`` for a format-1 checkpoint, or a rank the checkpoint did not have), and the files
    (for sharded tensors)."""

    name: str
    manifest: Manifest
    state: dict[str, Any]
    rank_state: dict[str, Any] | None = None
    files: CheckpointFiles | None = field(default=None, repr=False)

    def sharded_metadata(self) -> Any:
        from ..dist.sharded import SHARDED_FILE, decode_metadata

        assert self.files is not None
        return decode_metadata(bytes(self.files.read(SHARDED_FILE)), self.files.logical_files())

    def materialize(self, tree: Any = None) -> Any:
        """Replace every :class:`ShardedRef` in ``tree`` (default: the state) by the full tensor
        assembled from the saved pieces."""
        from ..dist.sharded import assemble

        if not contains_sharded(self.state if tree is None else tree):
            return self.state if tree is None else tree
        assert self.files is not None
        md = self.sharded_metadata()
        return substitute(self.state if tree is None else tree,
                          lambda ref: assemble(ref.fqn, md, self.files.tensors))


def contains_sharded(x: Any) -> bool:
    if isinstance(x, ShardedRef):
        return True
    if isinstance(x, StatefulValue):
        return contains_sharded(x.value)
    if isinstance(x, dict):
        return any(contains_sharded(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(contains_sharded(v) for v in x)
    return False


def substitute(x: Any, fill: Any) -> Any:
    """``x`` with every :class:`ShardedRef` replaced by ``fill(ref)`` (containers rebuilt)."""
    if isinstance(x, ShardedRef):
        return fill(x)
    if isinstance(x, StatefulValue):
        return StatefulValue(x.cls, substitute(x.value, fill))
    if isinstance(x, dict):
        out = type(x)() if type(x) is not dict else {}
        for k, v in x.items():
            out[k] = substitute(v, fill)
        return out
    if isinstance(x, list):
        return [substitute(v, fill) for v in x]
    if isinstance(x, tuple):
        return tuple(substitute(v, fill) for v in x)
    return x


def read_checkpoint(storage: Storage, name: str, rank: int = 0, files: CheckpointFiles | None = None,
                    all_shards: bool = True) -> LoadedCheckpoint:
    """Verify and decode checkpoint ``name`` for ``rank``; raise ``CorruptCheckpointError`` on
    any defect. Every listed file is verified first, except other ranks' parts and, with
    ``all_shards=False`` (several ranks, after :func:`verify_share`), the sharded pieces,
    which are verified again as they are read."""
    manifest: Manifest | None = files.manifest if files is not None else None
    try:
        manifest = manifest or read_manifest(storage, name)
        files = files or CheckpointFiles(storage, name, manifest)
        mine = rank_file(rank)
        others = {rank_file(r) for r in range(manifest.world_size)} - {mine}
        needed = [f for f in manifest.files if f not in others and not _other_rank_tensor(f, rank)
                  and (all_shards or not _is_shard(f))
                  and (not is_chunk(f) or (all_shards and manifest.world_size == 1))]  # else: as used
        files.verify(needed)
        if STATE_FILE not in manifest.files:
            raise CorruptCheckpointError(f"the manifest does not list {STATE_FILE}")
        state = files.decode(STATE_FILE)
        rank_state = files.decode(mine) if mine in manifest.files else None
    except (CorruptCheckpointError, FileNotFoundError) as e:
        raise failure(storage, name, e, manifest) from None
    return LoadedCheckpoint(name=name, manifest=manifest, state=state, rank_state=rank_state, files=files)


def _is_shard(fname: str) -> bool:
    return len(fname) == 18 and fname.startswith("s") and fname[1:6].isdigit() and \
        fname.endswith((".safetensors", chunkmap.SUFFIX))


def _other_rank_tensor(fname: str, rank: int) -> bool:
    return fname.startswith("r") and fname[1:6].isdigit() and fname[6:7] == "-" and int(fname[1:6]) != rank


def verify_all(storage: Storage, name: str) -> LoadedCheckpoint:
    """Verify every file of every rank and decode every state tree (``unbroken verify``)."""
    files = verify_share(storage, name, 0, 1, check_ids=True)
    loaded = read_checkpoint(storage, name, 0, files)
    try:
        for r in range(1, loaded.manifest.world_size):
            if rank_file(r) in loaded.manifest.files:
                files.decode(rank_file(r))
        if loaded.files is not None and "sharded.json" in loaded.manifest.files:
            loaded.sharded_metadata()
    except (CorruptCheckpointError, FileNotFoundError) as e:
        raise failure(storage, name, e, loaded.manifest) from None
    return loaded


def verify_share(storage: Storage, name: str, rank: int, world: int, check_ids: bool = False,
                 repair: Any = None) -> CheckpointFiles:
    """Verify this rank's share of a checkpoint's files (every ``world``-th, all at world 1),
    keeping them for the load that follows (``check_ids``: chunks' SHA-256 too; ``repair``: see
    :attr:`CheckpointFiles.repair`). Raises ``CorruptCheckpointError``."""
    manifest: Manifest | None = None
    try:
        manifest = read_manifest(storage, name)
        files = CheckpointFiles(storage, name, manifest)
        files.check_ids, files.repair = check_ids, repair
        files.verify(f for i, f in enumerate(sorted(manifest.files)) if i % world == rank)
    except (CorruptCheckpointError, FileNotFoundError) as e:
        raise failure(storage, name, e, manifest) from None
    return files
