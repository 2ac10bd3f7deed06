"""Incremental checkpoints: tensor bytes stored once per run, as content-addressed chunks.

``Checkpointer(..., incremental=True)``. Each tensor of a save becomes one *chunk*: its raw
bytes, named by their SHA-256, stored in the run's ``chunks/`` folder (or prefix) and listed in
the manifest with its size and xxh3-128 checksum; the checkpoint folder holds a small chunk
map per tensor file instead of the tensor file (:mod:`unbroken.format.chunkmap`). A tensor
whose bytes did not change since the checkpoint this run last committed or restored (a frozen
base model, an embedding that is not trained, an unchanged buffer) is *referenced*, not
written again.

**Change detection.** Every tensor is hashed with xxh3-128 (about 15 GB/s here); a tensor whose
(xxh3, size) matches a chunk of the base checkpoint reuses that chunk's id without the strong
hash. Only new bytes get the SHA-256 (about 1.5 GB/s) and are written. Chunks are found only
in the *base* (the newest committed or restored checkpoint) and in the save itself, never by
listing the store, so no remote listing is needed per save.

**Durability and commit.** A chunk is written whole or not at all (temp file, fsync, rename on a
filesystem; one PUT on an object store) before the manifest that lists it is written; the
manifest stays the only commit marker.

**Garbage collection** (:func:`collect`) is mark-and-sweep: every chunk listed by a committed
manifest (quarantined ones included) is kept; the others are deleted. It runs after retention
deleted checkpoints and when a writer opens the run. Crash-safe by construction: a kill at any
point leaves chunks that nobody references (deleted by a later collection), never a committed
manifest whose chunk is gone. Chunks a save in flight may still commit are never swept: those
this process is writing or reusing are pinned (a background save), and so are the base's, which
the next save of every rank may reuse (all ranks share one base); with several ranks only chunks
older than the newest committed checkpoint's start (minus a margin for clocks) are collected,
since another rank's save in flight wrote its new chunks after that moment. A manifest that
cannot be read stops the sweep.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .._support import faultpoints as _faults
from .._support import progress
from ..errors import CorruptCheckpointError
from ..format import chunkmap
from ..format.manifest import CHUNK_PREFIX, FileEntry, Manifest
from ..format.tensorfile import TensorEntry, raw_bytes
from ..store.base import Staging, Store
from .persist import writers  # threads that hash and write the chunks of one tensor file, as for whole files

log = logging.getLogger("unbroken")

PARALLEL_MIN = 1024 * 1024
"""Only tensors at least this large are handed to the threads."""


def _grace() -> float:
    """While saves may be in flight, a chunk is collected only if it is this much older than the
    newest committed checkpoint's start (clock differences between hosts and an object store):
    ``UNBROKEN_CHUNK_GRACE_S`` (default 60 s), read at each collection."""
    return float(os.environ.get("UNBROKEN_CHUNK_GRACE_S", "60"))


def chunk_id(data: Any) -> str:
    """The id of a chunk: the SHA-256 of its bytes (hex)."""
    return hashlib.sha256(data).hexdigest()


@dataclass
class SaveStats:
    """What one incremental save wrote and what it reused (bytes and chunks)."""

    written_bytes: int = 0
    reused_bytes: int = 0
    written: int = 0
    reused: int = 0


class ChunkWriter:
    """The chunks side of one run for one process: the base checkpoint's chunks, the pins,
    the statistics of the last save. Thread-safe (a background save uses it)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._base: dict[tuple[str, int], str] = {}
        self._pins: Counter[str] = Counter()
        self.last = SaveStats()

    def use_base(self, manifest: Manifest) -> None:
        """Deduplicate the next saves against ``manifest``'s chunks (a committed checkpoint of
        this run: the one just saved or restored). They stay pinned until the next base: a
        collection never deletes a chunk the next save of any rank may reuse."""
        with self._lock:
            self._base = {(e.xxh3_128, e.size): cid for cid, e in manifest.chunks.items()}

    def pinned(self) -> set[str]:
        """The chunks a collection must keep: those of saves in flight and of the base."""
        with self._lock:
            return {c for c, n in self._pins.items() if n > 0} | set(self._base.values())

    def begin(self) -> ChunkSave:
        with self._lock:
            base = dict(self._base)
        return ChunkSave(self, base)

    def _pin(self, cids: list[str], delta: int) -> None:
        with self._lock:
            for c in cids:
                self._pins[c] += delta
                if self._pins[c] <= 0:
                    del self._pins[c]


class ChunkSave:
    """One save's chunks: :meth:`write_file` per tensor file, then :meth:`finish`."""

    def __init__(self, writer: ChunkWriter, base: dict[tuple[str, int], str]) -> None:
        self.writer, self.base = writer, base
        self.seen: dict[tuple[str, int], str] = {}
        self.pins: list[str] = []
        self.stats = SaveStats()
        self._lock = threading.Lock()

    def write_file(self, staging: Staging, fname: str, entries: list[TensorEntry],
                   on_half: Callable[[], None] | None = None) -> dict[str, FileEntry]:
        """Store the tensors of ``fname`` as chunks (new bytes only) and write its chunk map
        into ``staging``; the manifest entries (the map and every chunk it uses). Tensors are
        hashed and written by :func:`~.persist.writers` threads (hashing and writing release the GIL)."""
        total = sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
        done = [0]
        half = [on_half]

        def one(e: TensorEntry) -> tuple[str, FileEntry]:
            data = raw_bytes(e.tensor)
            size = data.nbytes
            digest = xxhash.xxh3_128(data).hexdigest()
            key = (digest, size)
            with self._lock:
                cid = self.seen.get(key) or self.base.get(key)
            fresh = cid is None
            if cid is None:
                cid = chunk_id(data)
            self.writer._pin([cid], 1)
            with self._lock:
                self.pins.append(cid)
            if fresh:
                self.writer.store.put_chunk(cid, data)
            call = None
            with self._lock:
                self.seen[key] = cid
                if fresh:
                    self.stats.written_bytes += size
                    self.stats.written += 1
                else:
                    self.stats.reused_bytes += size
                    self.stats.reused += 1
                done[0] += size
                if half[0] is not None and done[0] * 2 >= total:
                    call, half[0] = half[0], None
            progress.advance(size)
            if call is not None:
                call()
            return cid, FileEntry(size, digest)

        big = [e for e in entries if e.tensor.numel() * e.tensor.element_size() >= PARALLEL_MIN]
        results: dict[str, tuple[str, FileEntry]] = {}
        if len(big) > 1 and writers() > 1:
            with ThreadPoolExecutor(min(writers(), len(big)), thread_name_prefix="unbroken-chunk") as pool:
                futures = {e.key: pool.submit(one, e) for e in big}
                results.update({k: f.result() for k, f in futures.items()})
        for e in entries:
            if e.key not in results:
                results[e.key] = one(e)
        if self.stats.written:
            self.writer.store.sync_chunks()  # durable before the manifest that lists them commits
        out: dict[str, FileEntry] = {CHUNK_PREFIX + cid: fe for cid, fe in results.values()}
        table = {e.key: (e.tensor.dtype, tuple(e.tensor.shape), results[e.key][0]) for e in entries}
        raw = chunkmap.encode(table)
        name = chunkmap.map_name(fname)
        with staging.open(name) as f:
            f.write(raw)
        out[name] = FileEntry(len(raw), xxhash.xxh3_128(raw).hexdigest())
        return out

    def finish(self, manifest: Manifest | None) -> None:
        """After the commit (``manifest``) or a failure (None): unpin; a committed checkpoint
        becomes the base of the next save."""
        self.writer._pin(self.pins, -1)
        self.pins = []
        self.writer.last = self.stats
        if manifest is not None:
            self.writer.use_base(manifest)


# ------------------------------------------------------------------ repair from the live state
def live_tensors(tree: Any) -> Iterable[torch.Tensor]:
    """Every tensor reachable in a training state: through ``state_dict()`` of its objects, dicts,
    lists and tuples (a DTensor gives its local shard). Nothing is copied."""
    stack, seen = [tree], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x.to_local() if hasattr(x, "to_local") else x
        elif isinstance(x, torch.nn.Module):  # its tensors, without state_dict() (a collective under FSDP1)
            stack.extend([*x.parameters(), *x.buffers()])
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif callable(getattr(x, "state_dict", None)) and not isinstance(x, type):
            try:
                stack.append(x.state_dict())
            except Exception:  # noqa: BLE001 - a repair source is best effort
                continue


class LiveChunks:
    """Repairs a damaged or missing chunk from the live state, when the state still holds its exact
    bytes (same SHA-256): a frozen layer loaded again from its pretrained weights, a buffer that
    never changes. Lazy: nothing is hashed until a chunk fails, then only tensors of the chunk's
    size. Thread-safe (checkpoint files are verified by several threads)."""

    def __init__(self, store: Store, state: Any) -> None:
        self.store, self.state = store, state
        self._lock = threading.Lock()
        self._by_size: dict[int, list[torch.Tensor]] | None = None
        self.repaired: list[str] = []

    def _candidates(self, size: int) -> list[torch.Tensor]:
        if self._by_size is None:
            self._by_size = {}
            for t in live_tensors(self.state):
                if t.device.type != "meta":
                    self._by_size.setdefault(t.numel() * t.element_size(), []).append(t)
        return self._by_size.get(size, [])

    def repair(self, cid: str, entry: FileEntry, damage: str) -> bool:
        """Rewrite chunk ``cid`` (listed with ``entry``) from live bytes with its SHA-256 and xxh3;
        the damaged copy is quarantined first. True if it was rewritten (the caller reads it again)."""
        with self._lock:
            for t in self._candidates(entry.size):
                data = raw_bytes(t.detach().to("cpu").contiguous())
                if xxhash.xxh3_128(data).hexdigest() != entry.xxh3_128 or chunk_id(data) != cid:
                    continue
                try:
                    self.store.quarantine_chunk(cid, f"{damage}; rewritten from the live state")
                    self.store.put_chunk(cid, data)
                    self.store.sync_chunks()
                except Exception as e:  # noqa: BLE001 - a read-only run, a full disk: not repairable
                    log.warning("chunk %s is damaged and the live state holds its bytes, but it could not be "
                                "rewritten: %s", cid, e)
                    return False
                self.repaired.append(cid)
                log.warning("chunk %s was damaged (%s); rewritten from the live state, which holds the same bytes "
                            "(SHA-256 %s)", cid, damage, cid)
                return True
            return False


# ------------------------------------------------------------------ garbage collection
@dataclass
class Collected:
    """The outcome of one :func:`collect`."""

    deleted: list[str]
    kept: int
    skipped: str = ""


def collect(store: Store, *, pinned: Callable[[], set[str]] | None = None, elsewhere: bool = False,
            grace_s: float | None = None) -> Collected:
    """Delete the chunks no committed checkpoint of ``store`` uses (see the module docstring).

    ``pinned``: the chunks this process's saves in flight use (asked after the listing, so a
    chunk listed is either still pinned or its save has committed, before the manifests are
    read). ``elsewhere``: other processes may be saving into this run (the other ranks): then
    only chunks older than the newest committed checkpoint's start minus ``grace_s`` go."""
    from .reader import read_manifest

    chunks = store.list_chunks()
    if not chunks:
        return Collected([], 0)
    busy = pinned() if pinned is not None else set()
    marked: set[str] = set()
    newest = 0.0
    for name in store.list_committed():
        try:
            m = read_manifest(store, name)
        except CorruptCheckpointError as e:
            reason = f"checkpoint {name} has an unreadable manifest ({e}); nothing collected until it is quarantined"
            log.info("chunk collection skipped: %s", reason)
            return Collected([], len(chunks), skipped=reason)
        marked.update(m.chunks)
        newest = max(newest, m.created)
    quarantined = store.quarantined()
    if quarantined is not None:  # kept for inspection, with what they use
        for name in quarantined.list_committed():
            try:
                marked.update(read_manifest(quarantined, name).chunks)
            except CorruptCheckpointError:
                pass
    _faults.point("gc.after_mark")
    cutoff = newest - (_grace() if grace_s is None else grace_s) if elsewhere else float("inf")
    deleted: list[str] = []
    for cid, mtime in sorted(chunks.items()):
        if cid in marked or cid in busy or mtime >= cutoff:
            continue
        store.delete_chunk(cid)
        deleted.append(cid)
        if len(deleted) == 1:
            _faults.point("gc.mid_sweep")
    if deleted:
        log.debug("collected %d unreferenced chunk(s) of %s", len(deleted), store.url)
    return Collected(deleted, len(chunks) - len(deleted))

