"""Saving and choosing a checkpoint with every rank: one protocol for 1 and for N processes.

**Save.** Each rank captured two snapshots: ``shared`` (the replicated state, identical on
every rank: a DDP model and its optimizer, progress, the data position) and ``mine``
(its RNG and per-rank objects); sharded tensors (DTensors) sit in ``shared.sharded``.

1. The ranks exchange the size of their parts; the coordinator (rank 0) checks the free
   space, takes the next ``seq``, checks its lock (:meth:`~unbroken.store.RunLock.verify`),
   opens the staging area and broadcasts its token. Nobody writes if that failed.
2. Every rank writes its share into it: the shared tensor files round-robin (so the
   replicated state is written once, by all ranks together), ``state.json`` (rank 0),
   ``rank-<r>.json`` with its ``r<r>-*.safetensors``, and, if any rank has sharded
   tensors, its pieces through DCP (``s<r>.safetensors``; rank 0 adds ``sharded.json``).
3. The ranks send the coordinator their file list (size, checksum) or their error. If any
   rank failed, the coordinator aborts the staging area and every rank raises an error that
   names each failing rank and its exception; otherwise it checks its lock again (a save can
   take minutes; a writer whose lock was lost meanwhile commits nothing), writes the one
   manifest covering every file, commits, and broadcasts the result.

**Choose.** The coordinator lists the candidates newest first; for each, every rank
verifies its share of the files (every ``world``-th; all at world size 1, kept in memory
for the load so nothing is read twice) and decodes what it needs, and the candidate is
taken only if every rank succeeded. An invalid one is reported (quarantined) by the
coordinator and the next tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._support import faultpoints as _faults
from ..checkpoint.chunks import ChunkSave, ChunkWriter
from ..checkpoint.persist import (
    as_storage_error,
    check_space,
    commit,
    tree_bytes,
    write_blob,
    write_part,
    write_tensors,
)
from ..checkpoint.reader import rank_file
from ..checkpoint.snapshot import Snapshot
from ..dist.comm import Comm
from ..errors import CorruptCheckpointError, NewerFormatError, StorageError, UnbrokenError
from ..format.manifest import STATE_FILE, FileEntry, Manifest
from ..tiers import rampeers
from ..tiers.rampeers import Nodes

log = logging.getLogger("unbroken")
T = TypeVar("T")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def write(comm: Comm, store: Any, lock: Any, name: str, shared: Snapshot, mine: Snapshot,
          next_seq: Callable[[], int], broken: BaseException | None = None, chunks: ChunkWriter | None = None,
          peers: Nodes | None = None, **fields: Any) -> tuple[str, Manifest]:
    """Save as checkpoint ``name`` with every rank (see the module docstring); a collective.

    ``broken``: this rank's snapshot is unusable (a lazy copy found changed): the rank still
    takes part, so that every rank learns it and none commits, and raises ``broken``.
    ``chunks``: save incrementally (:mod:`unbroken.checkpoint.chunks`): every rank stores its tensors as
    chunks of the run's chunk store."""
    save = chunks.begin() if chunks is not None else None
    result: tuple[str, Manifest] | None = None
    try:
        result = _write(comm, store, lock, name, shared, mine, next_seq, broken, save, peers, **fields)
        return result
    finally:
        if save is not None:
            save.finish(result[1] if result is not None else None)


def _write(comm: Comm, store: Any, lock: Any, name: str, shared: Snapshot, mine: Snapshot,
           next_seq: Callable[[], int], broken: BaseException | None, save: ChunkSave | None,
           peers: Nodes | None, **fields: Any) -> tuple[str, Manifest]:
    from ..dist.sharded import SHARDED_FILE, save_sharded

    started = time.time()
    size = mine.nbytes + len(tree_bytes(mine)) + sum(e.tensor.numel() * e.tensor.element_size()
                                                     for es in shared.files.values() for e in es) // comm.world
    sizes = comm.gather({"bytes": size, "sharded": bool(shared.sharded),
                         "broken": _describe(broken) if broken is not None else ""})
    staging, failure, seq = None, None, -1
    if comm.coordinator:
        try:
            bad = [f"rank {r}: {s['broken']}" for r, s in enumerate(sizes) if s["broken"]]
            if bad:
                raise UnbrokenError(f"checkpoint {name} was not saved: " + "; ".join(bad))
            need = sum(s["bytes"] for s in sizes) + len(tree_bytes(shared))
            check_space(store, need)
            seq = next_seq()
            lock.verify()
            staging = store.stage(name)
            opened = {"ok": True, "token": staging.token, "seq": seq, "need": need}
        except BaseException as e:  # noqa: BLE001 - told to every rank, then raised here
            failure, opened = e, {"ok": False, "error": _describe(e)}
    opened = comm.broadcast(opened if comm.coordinator else None)
    if broken is not None:
        raise broken
    if not opened["ok"]:
        if isinstance(failure, Exception):  # a folder that cannot be created or written: a library error
            raise as_storage_error(failure, name, store) from failure
        raise failure if failure is not None else StorageError(
            f"checkpoint {name} was not saved: the coordinator (rank 0) failed: {opened['error']}")
    mine_error: BaseException | None = None
    files: dict[str, FileEntry] = {}
    node_error: BaseException | None = None
    if peers is not None:  # a collective: each node's ranks write into their node's memory
        staging, node_error = rampeers.node_staging(peers, comm, store, name, opened["token"], opened["need"],
                                                     staging)
    try:
        if node_error is not None:
            raise node_error
        if staging is None:
            staging = store.join(opened["token"])
        if any(s["sharded"] for s in sizes):  # a collective inside: every rank takes part
            md = save_sharded(shared.sharded, comm.rank, comm.group,
                              lambda f, entries: files.update(save.write_file(staging, f, entries)) if save
                              else files.__setitem__(f, write_tensors(staging, f, entries)))
            if comm.coordinator and md is not None:
                files[SHARDED_FILE] = write_blob(staging, SHARDED_FILE, md)
        assigned = share(shared, comm.rank, comm.world)
        files.update(write_part(staging, shared, STATE_FILE if comm.coordinator else None, assigned, save))
        files.update(write_part(staging, mine, rank_file(comm.rank), mine.files, save))
        staging.flush()
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator, raised below
        mine_error = e
    results = comm.gather({"ok": mine_error is None, "error": _describe(mine_error) if mine_error else "",
                           "files": {f: [e.size, e.xxh3_128] for f, e in files.items()}})
    if peers is not None and all(res["ok"] for res in results):  # every node gets every file, checked
        copied = comm.gather(rampeers.replicate(peers, staging, results))
        results = [dict(res, ok=False, error=f"copying to another node: {err}") if err else res
                   for res, err in zip(results, copied, strict=True)]
    manifest = None
    if comm.coordinator:
        assert staging is not None
        failed = [(r, res["error"]) for r, res in enumerate(results) if not res["ok"]]
        if failed:
            staging.abort()
            decision = {"ok": False, "errors": failed}
        else:
            try:
                every = {f: FileEntry(s, d) for res in results for f, (s, d) in res["files"].items()}
                lock.verify()  # again: the lock may have been lost while the files were written
                final, manifest = commit(staging, every, seq=seq, created=started, world_size=comm.world, **fields)
                decision = {"ok": True, "name": final, "manifest": manifest.to_json().decode()}
            except BaseException as e:  # noqa: BLE001
                staging.abort()
                mine_error = mine_error or e
                decision = {"ok": False, "errors": [(0, _describe(e))]}
    decision = comm.broadcast(decision if comm.coordinator else None)
    if peers is not None:
        rampeers.commit_copy(peers, store, staging, decision)
    if mine_error is not None:
        if isinstance(mine_error, Exception):
            raise as_storage_error(mine_error, name, store) from mine_error
        raise mine_error
    if not decision["ok"]:
        raise StorageError(f"checkpoint {name} was not committed: " + "; ".join(
            f"rank {r}: {err}" for r, err in decision["errors"]) + ". Earlier checkpoints are intact.")
    if manifest is None:
        manifest = Manifest.from_json(decision["manifest"].encode())
    if comm.coordinator:
        _faults.point("save.after_commit")
    return decision["name"], manifest


def share(shared: Snapshot, rank: int, world: int) -> list[str]:
    """The replicated tensor files ``rank`` writes: largest first to the least loaded rank, so the
    bytes (not just the files) are spread (the same answer on every rank)."""
    sizes = {f: sum(e.tensor.numel() * e.tensor.element_size() for e in es) for f, es in shared.files.items()}
    load, mine = [0] * world, []
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[f]
        if r == rank:
            mine.append(f)
    return mine


def choose(comm: Comm, candidates: Iterator[str] | None, attempt: Callable[[str], T],
           invalid: Callable[[str, str], None]) -> tuple[str, T] | None:
    """The newest candidate every rank could verify and decode, with this rank's result of
    ``attempt(name)`` (which raises ``CorruptCheckpointError`` for a bad one). The
    coordinator's ``candidates`` yields names newest first (downloading from a remote tier
    as needed; other ranks pass None); ``invalid`` is called on the coordinator for each bad
    one. A collective."""
    while True:
        name = comm.broadcast(next(candidates, None) if comm.coordinator and candidates is not None else None)
        if name is None:
            return None
        result, verdict = None, "ok"
        try:
            result = attempt(name)
        except NewerFormatError as e:
            verdict = f"newer: {e}"
        except CorruptCheckpointError as e:
            verdict = str(e)
        verdicts = comm.gather(verdict)
        newer = [v for v in verdicts if v.startswith("newer: ")]
        if newer:
            raise NewerFormatError(newer[0][len("newer: "):])
        bad = [f"rank {r}: {v}" if comm.world > 1 else v for r, v in enumerate(verdicts) if v != "ok"]
        if not bad:
            return name, result  # type: ignore[return-value]
        if comm.coordinator:
            invalid(name, "; ".join(bad))
        comm.barrier()
